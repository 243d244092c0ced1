//! The arguments of an FP8 GEMM in cuBLASLt, worked out as a pure function so they can be
//! tested without a GPU (`cuda.rs` only turns them into descriptors).
//!
//! We want y (M × N, row-major) = x (M × K) · Wᵀ, with M = B·T tokens, x and W in E4M3.
//! cuBLASLt is column-major, and its FP8 kernels take one form only: **"TN"** — A transposed,
//! B not — meaning both operands are *K-major* (consecutive elements along K, the reduction
//! dimension), the layout FP8 tensor cores (Hopper's wgmma, Ada's mma) load from. Our tensors
//! already are:
//! - W (N, K) row-major is, read column-major, a K × N matrix with leading dimension K. As A with
//!   transa = T, op(A) is its transpose — the N × K matrix W itself: cuBLASLt's m = N.
//! - x (M, K) row-major is a K × M column-major matrix with leading dimension K: B with
//!   transb = N, cuBLASLt's n = M.
//! - D = op(A)·B = W·xᵀ is N × M column-major with leading dimension N — which is exactly y
//!   (M × N) row-major. No transpose is ever materialised.
//!
//! Scales: cuBLASLt computes D = scale_A·scale_B·(A·B) (+ bias, activation) with f32 accumulation,
//! reading scale_A and scale_B from device pointers (A_SCALE_POINTER = W's scale, B_SCALE_POINTER
//! = x's) — the scales never visit the host. D is bf16, so no D scale (that is for FP8 outputs).

use stage3_fused::cublaslt_model::{DataType, Epilogue, MatmulArgs, MatrixLayout};

/// Whose per-tensor scale a scale pointer carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ScaleOf {
    Weight,
    Input,
}

/// Which epilogue cuBLASLt applies to the f32 accumulator before the bf16 store.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Fp8Epilogue {
    /// + bias (CUBLASLT_EPILOGUE_BIAS)
    Bias,
    /// GELU(· + bias), tanh approximation (CUBLASLT_EPILOGUE_GELU_BIAS)
    GeluBias,
}

/// One FP8 GEMM in cuBLASLt's terms (column-major; see the module notes).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Fp8GemmArgs {
    /// cuBLASLt's m, n, k: out features, tokens, in features.
    pub m: u64,
    pub n: u64,
    pub k: u64,
    /// TN: A transposed, B not (the only form FP8 takes).
    pub transa: bool,
    pub transb: bool,
    /// A = W as stored: rows × cols of the column-major matrix, and its leading dimension.
    pub a_rows: u64,
    pub a_cols: u64,
    pub lda: i64,
    /// B = x as stored.
    pub b_rows: u64,
    pub b_cols: u64,
    pub ldb: i64,
    /// C = D = y (bf16; C is not read, β = 0).
    pub d_rows: u64,
    pub d_cols: u64,
    pub ldd: i64,
    pub a_scale: ScaleOf,
    pub b_scale: ScaleOf,
    pub epilogue: Fp8Epilogue,
    /// Length of the bias vector (one per output feature, i.e. per row of D).
    pub bias_len: u64,
    /// D in E4M3 instead of bf16, with a D scale (the next GEMM's 1/s) and amax_D: fc1 writing
    /// the operand fc2 reads (`fp8_gemm_args_e4m3_out`).
    pub out_e4m3: bool,
}

/// cuBLASLt's FP8 kernels need 16-byte-aligned leading dimensions — 16 E4M3 elements — and
/// TransformerEngine asks the same of the token count; we require all three dimensions to be
/// multiples of `align` (16), with a fix the user can apply.
pub fn check_dims(align: usize, in_features: usize, out_features: usize) -> Result<(), String> {
    for (what, v, fix) in [
        ("in features (K)", in_features, "pick --d-model and --ff as multiples of 16 (every preset is)"),
        ("out features (N)", out_features, "pick --d-model and --ff as multiples of 16 (every preset is)"),
    ] {
        if v == 0 || !v.is_multiple_of(align) {
            return Err(misaligned(what, v, align, fix));
        }
    }
    Ok(())
}

fn misaligned(what: &str, v: usize, align: usize, fix: &str) -> String {
    format!(
        "FP8 GEMMs in cuBLASLt need every dimension to be a multiple of {align} (16-byte-aligned rows of E4M3), \
         and the {what} is {v}. Fix: {fix}; or run stage 4 emulated (--device cpu) to study the numerics."
    )
}

/// The arguments of y (tokens × out) = x (tokens × in) · Wᵀ in E4M3, bf16 out.
pub fn fp8_gemm_args(tokens: usize, in_features: usize, out_features: usize, gelu: bool) -> Result<Fp8GemmArgs, String> {
    check_dims(16, in_features, out_features)?;
    if tokens == 0 || !tokens.is_multiple_of(16) {
        return Err(misaligned("token count B·T", tokens, 16, "pick --batch and --seq so that B·T is a multiple of 16"));
    }
    let (m, n, k) = (out_features as u64, tokens as u64, in_features as u64);
    Ok(Fp8GemmArgs {
        m,
        n,
        k,
        transa: true,
        transb: false,
        a_rows: k, // W (N, K) row-major = K × N column-major, K-contiguous
        a_cols: m,
        lda: k as i64,
        b_rows: k, // x (M, K) row-major = K × M column-major, K-contiguous
        b_cols: n,
        ldb: k as i64,
        d_rows: m, // y (M, N) row-major = N × M column-major
        d_cols: n,
        ldd: m as i64,
        a_scale: ScaleOf::Weight,
        b_scale: ScaleOf::Input,
        epilogue: if gelu { Fp8Epilogue::GeluBias } else { Fp8Epilogue::Bias },
        bias_len: m,
        out_e4m3: false,
    })
}

/// `fp8_gemm_args` with an E4M3 output: D = E4M3(scale_D · epilogue(s_w·s_x·W_q x_qᵀ + b)) with
/// scale_D = 1/s_next (CUBLASLT_MATMUL_DESC_D_SCALE_POINTER) and amax_D = max|epilogue(…)|
/// written to the next layer's amax buffer (CUBLASLT_MATMUL_DESC_AMAX_D_POINTER). Same layouts:
/// D (N × M column-major, ld N) is the next GEMM's B (K' × M, ld K') exactly, K' = N.
pub fn fp8_gemm_args_e4m3_out(tokens: usize, in_features: usize, out_features: usize, gelu: bool) -> Result<Fp8GemmArgs, String> {
    Ok(Fp8GemmArgs { out_e4m3: true, ..fp8_gemm_args(tokens, in_features, out_features, gelu)? })
}

impl Fp8GemmArgs {
    /// The same call in the terms of `stage3_fused::cublaslt_model` (the CPU model of cuBLASLt's
    /// contract), so the tests can execute exactly these arguments: E4M3 A and B, bf16 C/D
    /// (one layout, β = 0), α = 1, both scale pointers set. With `out_e4m3`, D is E4M3 and C
    /// stays bf16 (`cublaslt_model::matmul_fp8_out` executes it).
    pub fn contract(&self) -> MatmulArgs {
        let c = MatrixLayout { dtype: DataType::Bf16, rows: self.d_rows, cols: self.d_cols, ld: self.ldd };
        let d = MatrixLayout { dtype: if self.out_e4m3 { DataType::E4m3 } else { DataType::Bf16 }, ..c };
        MatmulArgs {
            m: self.m,
            n: self.n,
            k: self.k,
            transa: self.transa,
            transb: self.transb,
            a: MatrixLayout { dtype: DataType::E4m3, rows: self.a_rows, cols: self.a_cols, ld: self.lda },
            b: MatrixLayout { dtype: DataType::E4m3, rows: self.b_rows, cols: self.b_cols, ld: self.ldb },
            c,
            d,
            alpha: 1.0,
            beta: 0.0,
            epilogue: match self.epilogue {
                Fp8Epilogue::Bias => Epilogue::Bias,
                Fp8Epilogue::GeluBias => Epilogue::GeluBias,
            },
            bias_len: self.bias_len,
            scaled: true,
        }
    }
}

/// cuBLASLt requires 16-byte-aligned A, B, C, D and bias pointers for FP8. candle's allocations
/// are 256-byte aligned; a view with an offset may not be, which is why inputs are made
/// contiguous (a fresh allocation) first.
pub fn check_pointers(ptrs: &[(&str, u64)]) -> Result<(), String> {
    match ptrs.iter().find(|(_, p)| p % 16 != 0) {
        None => Ok(()),
        Some((what, p)) => Err(format!("FP8 GEMM: {what} at {p:#x} is not 16-byte aligned")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tn_layout_for_a_qkv_gemm() {
        // small's QKV: 4·512 tokens, C = 768 in, 3C = 2304 out
        let a = fp8_gemm_args(2048, 768, 2304, false).unwrap();
        assert_eq!((a.m, a.n, a.k), (2304, 2048, 768));
        assert!(a.transa && !a.transb, "FP8 takes TN only");
        // A = W: K × N column-major, ld K; B = x: K × M column-major, ld K (both K-major)
        assert_eq!((a.a_rows, a.a_cols, a.lda), (768, 2304, 768));
        assert_eq!((a.b_rows, a.b_cols, a.ldb), (768, 2048, 768));
        // op(A) is m × k and B is k × n: the product is defined
        let (op_a_rows, op_a_cols) = if a.transa { (a.a_cols, a.a_rows) } else { (a.a_rows, a.a_cols) };
        assert_eq!((op_a_rows, op_a_cols), (a.m, a.k));
        assert_eq!((a.b_rows, a.b_cols), (a.k, a.n));
        // D: N × M column-major, ld N = y (M, N) row-major
        assert_eq!((a.d_rows, a.d_cols, a.ldd), (2304, 2048, 2304));
        assert_eq!((a.a_scale, a.b_scale), (ScaleOf::Weight, ScaleOf::Input));
        assert_eq!((a.epilogue, a.bias_len), (Fp8Epilogue::Bias, 2304));
        // every element of D is written: ldd·cols = M·N
        assert_eq!(a.ldd as u64 * a.d_cols, 2048 * 2304);
    }

    #[test]
    fn fc1_gets_the_gelu_epilogue_and_fc2_swaps_widths() {
        let fc1 = fp8_gemm_args(128, 128, 512, true).unwrap();
        assert_eq!((fc1.epilogue, fc1.m, fc1.k, fc1.lda, fc1.ldd), (Fp8Epilogue::GeluBias, 512, 128, 128, 512));
        let fc2 = fp8_gemm_args(128, 512, 128, false).unwrap();
        assert_eq!((fc2.m, fc2.k, fc2.lda, fc2.ldb, fc2.ldd), (128, 512, 512, 512, 128));
    }

    #[test]
    fn dimensions_must_be_multiples_of_16() {
        for (t, k, n, what) in
            [(100, 768, 768, "token count"), (128, 760, 768, "in features"), (128, 768, 776, "out features"), (0, 768, 768, "token")]
        {
            let e = fp8_gemm_args(t, k, n, false).unwrap_err().to_string();
            assert!(e.contains("multiple of 16") && e.contains(what) && e.contains("Fix:"), "{e}");
        }
        assert!(fp8_gemm_args(16, 16, 16, false).is_ok());
        assert!(check_dims(16, 4096, 16384).is_ok());
    }

    #[test]
    fn pointer_alignment() {
        assert!(check_pointers(&[("A", 0x7f00_0000_0100), ("B", 0x7f00_0000_0010)]).is_ok());
        let e = check_pointers(&[("A", 0x100), ("bias", 0x108)]).unwrap_err();
        assert!(e.contains("bias") && e.contains("0x108"), "{e}");
    }
}
