//! The arguments of stage 3's cuBLASLt GEMMs, worked out as a pure function so they can be
//! executed on the CPU by `cublaslt_model` and compared with each op's slow twin
//! (`tests/cublaslt_contract.rs`); `cuda.rs` only copies them into cudarc's `MatmulConfig`.
//!
//! We want y (M × N, row-major) = x (M × K) · Wᵀ + b, M = B·T tokens. cuBLASLt is column-major,
//! so we ask for yᵀ (N × M) = W (N × K) · xᵀ (K × M):
//! - A = W: (N, K) row-major is, read column-major, K × N with leading dimension K; transa = T
//!   makes op(A) the N × K matrix W itself, so cuBLASLt's m = N.
//! - B = x: (M, K) row-major is K × M column-major with leading dimension K; transb = N, n = M.
//! - C = D = y: N × M column-major with leading dimension N is y (M × N) row-major.
//! - The bias (N values) is added per row of D, i.e. per output feature: per column of y.
//! - The residual r (M × N row-major, the output's layout) rides in through C with β = 1 when it
//!   has the GEMM's dtype (cudarc gives C and D one type, and C is D's buffer, pre-filled with r).
//! - Training's fc1 (GELU_AUX_BIAS) also writes z = x·Wᵀ + b to an aux matrix laid out as D
//!   (ld N, which cuBLASLt wants a multiple of 8): z (M × N) row-major, what fc2's backward reads.
//!
//! The backward of y = x·Wᵀ + b, dz = ∂loss/∂(x·Wᵀ + b) (M × N), in the same column-major terms:
//! - data gradient (`dgrad_args`), dx (M × K) = dz·W: dxᵀ (K × M) = Wᵀ (K × N) · dzᵀ (N × M).
//!   A = W as stored (K × N column-major, ld K, not transposed), B = dz as stored (N × M, ld N,
//!   not transposed): TransformerEngine's "NN" data-gradient GEMM. For fc2, whose input is
//!   GELU's output, DGELU_BGRAD turns D into dz₁ = gelu′(z) ∘ dh and writes db₁ = Σ_tokens dz₁
//!   (one per row of D = per hidden feature) through the bias pointer; the aux is fc1's z.
//! - weight gradient (`wgrad_args`), dW (N × K) = dzᵀ·x: dWᵀ (K × N) = xᵀ (K × M) · dz (M × N).
//!   A = x as stored (K × M, ld K, not transposed), B = dz as stored (N × M, ld N) transposed:
//!   the "NT" weight-gradient GEMM. The GEMM's k is M (tokens), so BGRADB — the sum over k of
//!   op(B) = dz, one value per column of D = per output feature — is db = Σ_tokens dz.

use cublaslt_model::{AuxLayout, DataType, Epilogue, MatmulArgs, MatrixLayout};

/// What stage 3 asks the GEMM to do after x·Wᵀ.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LinearKind {
    /// + b
    Bias,
    /// gelu_tanh(· + b)
    BiasGelu,
    /// + b + r, r read through C with β = 1 (r in the GEMM's dtype)
    BiasResidualInC,
    /// gelu_tanh(· + b), keeping z = · + b in an aux matrix for the backward (training's fc1)
    BiasGeluAux,
}

/// Whether cuBLASLt can keep GELU's pre-activation for a layer of `out_features` outputs: the aux
/// matrix shares D's leading dimension, which must be a multiple of 8.
pub fn gelu_aux_fits(out_features: usize) -> bool {
    out_features.is_multiple_of(8)
}

/// The cuBLASLt arguments of y (tokens × out) = x (tokens × in) · Wᵀ + b (+ r, GELU) in `dtype`.
pub fn linear_args(tokens: usize, in_features: usize, out_features: usize, dtype: DataType, kind: LinearKind) -> MatmulArgs {
    let (m, n, k) = (out_features as u64, tokens as u64, in_features as u64);
    let layout = |rows: u64, cols: u64| MatrixLayout { dtype, rows, cols, ld: rows as i64 };
    MatmulArgs {
        m,
        n,
        k,
        transa: true,
        transb: false,
        a: layout(k, m), // W (N, K) row-major = K × N column-major
        b: layout(k, n), // x (M, K) row-major = K × M column-major
        c: layout(m, n), // y (M, N) row-major = N × M column-major
        d: layout(m, n),
        alpha: 1.0,
        beta: if kind == LinearKind::BiasResidualInC { 1.0 } else { 0.0 },
        epilogue: match kind {
            LinearKind::BiasGelu => Epilogue::GeluBias,
            LinearKind::BiasGeluAux => Epilogue::GeluAuxBias { aux: AuxLayout { dtype, ld: m as i64 } }, // z laid out as y
            LinearKind::Bias | LinearKind::BiasResidualInC => Epilogue::Bias,
        },
        bias_len: m,
        scaled: false,
    }
}

/// The data-gradient GEMM: dx (tokens × in) = dz (tokens × out) · W (out × in). With `dgelu`
/// (the layer's input is GELU's output; `out`/`in` are fc2's), DGELU_BGRAD: D becomes
/// gelu′(z) ∘ (dz·W) with z the aux (tokens × in row-major, fc1's GELU_AUX_BIAS aux), and its sum
/// over tokens (in values) is written through the bias pointer.
pub fn dgrad_args(tokens: usize, in_features: usize, out_features: usize, dtype: DataType, dgelu: bool) -> MatmulArgs {
    let (m, n, k) = (in_features as u64, tokens as u64, out_features as u64);
    let layout = |rows: u64, cols: u64| MatrixLayout { dtype, rows, cols, ld: rows as i64 };
    MatmulArgs {
        m,
        n,
        k,
        transa: false,
        transb: false,
        a: layout(m, k), // W (out, in) row-major = in × out column-major
        b: layout(k, n), // dz (tokens, out) row-major = out × tokens column-major
        c: layout(m, n), // dx (tokens, in) row-major = in × tokens column-major
        d: layout(m, n),
        alpha: 1.0,
        beta: 0.0,
        epilogue: if dgelu { Epilogue::DGeluBgrad { aux: AuxLayout { dtype, ld: m as i64 } } } else { Epilogue::Default },
        bias_len: if dgelu { m } else { 0 },
        scaled: false,
    }
}

/// The weight-gradient GEMM: dW (out × in) = dzᵀ · x, dz (tokens × out), x (tokens × in). With
/// `bgrad`, BGRADB also writes db = Σ_tokens dz (out values) through the bias pointer.
pub fn wgrad_args(tokens: usize, in_features: usize, out_features: usize, dtype: DataType, bgrad: bool) -> MatmulArgs {
    let (m, n, k) = (in_features as u64, out_features as u64, tokens as u64);
    let layout = |rows: u64, cols: u64| MatrixLayout { dtype, rows, cols, ld: rows as i64 };
    MatmulArgs {
        m,
        n,
        k,
        transa: false,
        transb: true,
        a: layout(m, k), // x (tokens, in) row-major = in × tokens column-major
        b: layout(n, k), // dz (tokens, out) row-major = out × tokens column-major, read transposed
        c: layout(m, n), // dW (out, in) row-major = in × out column-major
        d: layout(m, n),
        alpha: 1.0,
        beta: 0.0,
        epilogue: if bgrad { Epilogue::BgradB } else { Epilogue::Default },
        bias_len: if bgrad { n } else { 0 },
        scaled: false,
    }
}

/// cuBLASLt assumes every matrix is 256-byte aligned unless a preference says less
/// (`CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_{A,B,C,D}_BYTES`), and may pick a kernel whose vector
/// loads need that much. What a matrix at device address `ptr`, its columns `ld_bytes` apart,
/// can promise: the largest power of two dividing both, capped at 256. A null pointer (a C that
/// is never read) promises the cap.
pub fn alignment(ptr: u64, ld_bytes: u64) -> u32 {
    const CAP: u64 = 256;
    // `x | CAP` has bit 8 set, so its trailing zeros are those of x, at most 8 (also for x = 0).
    1 << (ptr | CAP).trailing_zeros().min((ld_bytes | CAP).trailing_zeros())
}

/// The four alignment preferences of one GEMM, A, B, C and D, from each matrix's pointer and
/// layout (its leading dimension in bytes). A plan made for these alignments is valid for any
/// call whose alignments are at least these.
pub fn alignments(ptrs: [u64; 4], layouts: [&MatrixLayout; 4]) -> [u32; 4] {
    std::array::from_fn(|i| alignment(ptrs[i], layouts[i].ld as u64 * layouts[i].dtype.size_in_bytes()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alignment_is_the_largest_power_of_two_dividing_pointer_and_stride() {
        let base = 0x7f00_0000_0000u64; // a fresh allocation: 256-byte aligned and more
        assert_eq!(alignment(base, 768 * 2), 256, "capped at cuBLASLt's default");
        assert_eq!(alignment(base + 0x100, 4096), 256);
        assert_eq!(alignment(base + 0x80, 4096), 128);
        assert_eq!(alignment(base + 0x10, 4096), 16, "a view 16 bytes into its allocation");
        assert_eq!(alignment(base + 0x30, 4096), 16);
        assert_eq!(alignment(base + 2, 4096), 2);
        assert_eq!(alignment(base, 100), 4, "columns 100 bytes apart: every other column starts 4-byte aligned");
        assert_eq!(alignment(base, 24), 8);
        assert_eq!(alignment(base + 8, 64), 8, "the smaller of the two");
        assert_eq!(alignment(0, 0), 256, "a null C, never read");
        assert_eq!(alignment(1, 4096), 1);
        // Every value is a power of two, at most 256, and divides both pointer and stride.
        for ptr in (0..2048u64).step_by(7) {
            for ld in [0u64, 1, 2, 6, 16, 48, 100, 512, 1536] {
                let a = alignment(ptr, ld) as u64;
                assert!(a.is_power_of_two() && a <= 256 && ptr.is_multiple_of(a) && ld.is_multiple_of(a), "ptr {ptr} ld {ld}: {a}");
                assert!(a == 256 || !ptr.is_multiple_of(2 * a) || !ld.is_multiple_of(2 * a), "ptr {ptr} ld {ld}: {a} is not the largest");
            }
        }
    }

    #[test]
    fn alignments_read_each_matrix_stride_in_bytes() {
        // bf16 fc1 at C = 100 (x: ld 100 elements = 200 bytes, 8-byte aligned columns) into 3072 features.
        let args = linear_args(80, 100, 3072, DataType::Bf16, LinearKind::Bias);
        let base = 0x7f00_0000_0000u64;
        assert_eq!(alignments([base, base, base, base], [&args.a, &args.b, &args.c, &args.d]), [8, 8, 256, 256]);
        assert_eq!(alignments([base + 16, base, 0, base + 32], [&args.a, &args.b, &args.c, &args.d]), [8, 8, 256, 32]);
        // An f32 GEMM at ld 96: 384 bytes, 128-byte aligned columns.
        let args = linear_args(80, 96, 96, DataType::F32, LinearKind::Bias);
        assert_eq!(alignments([base; 4], [&args.a, &args.b, &args.c, &args.d]), [128; 4]);
    }
}
