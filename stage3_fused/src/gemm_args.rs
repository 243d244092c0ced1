//! The arguments of stage 3's cuBLASLt GEMMs, worked out as a pure function so they can be
//! executed on the CPU by `crate::cublaslt_model` and compared with each op's slow twin
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

use crate::cublaslt_model::{DataType, Epilogue, MatmulArgs, MatrixLayout};

/// What stage 3 asks the GEMM to do after x·Wᵀ.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LinearKind {
    /// + b
    Bias,
    /// gelu_tanh(· + b)
    BiasGelu,
    /// + b + r, r read through C with β = 1 (r in the GEMM's dtype)
    BiasResidualInC,
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
        epilogue: if kind == LinearKind::BiasGelu { Epilogue::GeluBias } else { Epilogue::Bias },
        bias_len: m,
        scaled: false,
    }
}
