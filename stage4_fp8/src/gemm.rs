//! The FP8 GEMM as a candle op (`Fp8Gemm`), and its arguments in cuBLASLt.
//!
//! **The op.** y = act(s_x·s_w·(q_x W_qᵀ) + b) with q_x (…, K) and W_q (N, K) in E4M3: a
//! `CustomOp2` over (q_x, W_q) that holds the rest — both scales, the bias and, for an E4M3
//! output, its D scale and amax_D buffer — as stage 3's `Linear` holds its residual. The store
//! is bf16, or E4M3(y·d_scale) for the next layer with max|y| recorded (fc1 writing fc2's input).
//! - CUDA forward: one cuBLASLt call (`cuda.rs`) on the E4M3 tensor cores, with the scales, bias,
//!   GELU, D scale and amax_D in its epilogue; the arguments are worked out below.
//! - CPU forward: the same contract in host code — the E4M3 rows decoded to f32 (exactly), f32 dot
//!   products, s_x·s_w, bias and GELU (tanh form) on the f32 sum, the store rounded as cuBLASLt's
//!   D is — so the op runs and is tested without a GPU. It is not faster than an f32 GEMM (a CPU
//!   has no FP8 units): stage 4 on the CPU runs `Fp8Linear`'s emulated mode instead.
//! - Slow twin: `Fp8Gemm::forward_slow`, candle's casts, matmul, add and GELU.
//!
//! **cuBLASLt's arguments**, worked out as a pure function so they can be tested without a GPU
//! (`cuda.rs` only turns them into descriptors).
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
//! = x's) — the scales never visit the host. A bf16 D takes no D scale; an E4M3 D takes one, and
//! amax_D (`fp8_gemm_args_e4m3_out`).

use crate::fp8::{amax_slow, check_scale, dequantize_slow, max_into, scale_value};
use crate::scale::max_abs_bits;
use candle_core::{CpuStorage, CustomOp2, DType, Layout, Shape, Storage, Tensor};
use cpu_kernels::elementwise::par_convert;
use cublaslt_model::{DataType, Epilogue, MatmulArgs, MatrixLayout};
use float8::F8E4M3;
use rayon::prelude::*;

/// Whose per-tensor scale a scale pointer carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ScaleOf {
    Weight,
    Input,
    /// The upstream gradient dY's (training: E5M2).
    Grad,
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
    /// The same call in the terms of `cublaslt_model` (the CPU model of cuBLASLt's
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

// ---------------------------------------------------------------------------------------------
// The HYBRID backward's GEMMs (training)
// ---------------------------------------------------------------------------------------------

/// Which backward GEMM of y = x·Wᵀ + b (`hybrid.rs`), with M = B·T tokens, K in, N out features.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Fp8Grad {
    /// dX (M, K) = dY (M, N) · W (N, K): E5M2 gradient against the E4M3 weight.
    Data,
    /// dW (N, K) = dYᵀ (N, M) · X (M, K): E5M2 gradient against the forward's E4M3 input.
    Weight,
}

/// What a backward GEMM operand's buffer holds: a row-major tensor the training step makes,
/// with the per-tensor scale that goes with it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Fp8Operand {
    /// Wᵀ (K, N) in E4M3, the weight's scale: the transposed copy of the forward's W_q.
    WeightT,
    /// Xᵀ (K, M) in E4M3, the input's scale: the transposed copy of the forward's q_x.
    InputT,
    /// dY (M, N) in E5M2, the gradient's scale.
    Grad,
    /// dYᵀ (N, M) in E5M2, the gradient's scale: the transposed copy of the above.
    GradT,
}

impl Fp8Operand {
    /// Whose scale the operand's scale pointer carries.
    pub fn scale(self) -> ScaleOf {
        match self {
            Fp8Operand::WeightT => ScaleOf::Weight,
            Fp8Operand::InputT => ScaleOf::Input,
            Fp8Operand::Grad | Fp8Operand::GradT => ScaleOf::Grad,
        }
    }

    /// Its FP8 format: E4M3 for the forward's operands, E5M2 for the gradient.
    pub fn dtype(self) -> DataType {
        match self {
            Fp8Operand::WeightT | Fp8Operand::InputT => DataType::E4m3,
            Fp8Operand::Grad | Fp8Operand::GradT => DataType::E5m2,
        }
    }
}

/// One backward GEMM in cuBLASLt's terms (column-major; see `fp8_grad_args`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Fp8GradArgs {
    pub grad: Fp8Grad,
    /// cuBLASLt's m, n, k.
    pub m: u64,
    pub n: u64,
    pub k: u64,
    /// TN, as every FP8 GEMM.
    pub transa: bool,
    pub transb: bool,
    /// A as stored (rows × cols column-major, ld) and what it holds.
    pub a_rows: u64,
    pub a_cols: u64,
    pub lda: i64,
    pub a: Fp8Operand,
    /// B as stored and what it holds.
    pub b_rows: u64,
    pub b_cols: u64,
    pub ldb: i64,
    pub b: Fp8Operand,
    /// D (= C, not read: β = 0) as stored, and its type: bf16 dX (the activations' dtype),
    /// f32 dW (the master weights').
    pub d_rows: u64,
    pub d_cols: u64,
    pub ldd: i64,
    pub d: DataType,
}

/// The layouts of a HYBRID backward GEMM for any M, K, N (`fp8_grad_args` adds cuBLASLt's
/// multiple-of-16 rule). Both are TN, which FP8 requires, so each reads one transposed copy
/// that the training step makes (as TransformerEngine keeps a "columnwise" copy of each FP8
/// tensor for exactly this):
///
/// - **dX (M, K) = dY · W.** Row-major dX is K × M column-major (ld K): m = K, n = M, k = N.
///   op(A) must be K × N with A transposed, so A is stored N × K column-major (ld N) — Wᵀ
///   (K, N) row-major: the transposed copy of W_q. B is N × M column-major (ld N): dY (M, N)
///   row-major as it is. E4M3 × E5M2.
/// - **dW (N, K) = dYᵀ · X.** Row-major dW is K × N column-major (ld K): m = K, n = N, k = M.
///   A is stored M × K column-major (ld M) — Xᵀ (K, M) row-major, the transposed copy of q_x;
///   B is M × N column-major (ld M) — dYᵀ (N, M) row-major, the transposed copy of dY's E5M2.
///   E4M3 × E5M2 again: with the gradient as B both GEMMs are the same combination.
///
/// Neither product can avoid the copies: W (N, K) row-major is N-major along the reduction of
/// dX, and X and dY are M-major along dW's, where TN needs both operands contiguous along k.
pub fn fp8_grad_layout(grad: Fp8Grad, tokens: usize, in_features: usize, out_features: usize) -> Fp8GradArgs {
    let (mt, k, n) = (tokens as u64, in_features as u64, out_features as u64);
    let (m_, n_, k_, a, b, d) = match grad {
        Fp8Grad::Data => (k, mt, n, Fp8Operand::WeightT, Fp8Operand::Grad, DataType::Bf16),
        Fp8Grad::Weight => (k, n, mt, Fp8Operand::InputT, Fp8Operand::GradT, DataType::F32),
    };
    Fp8GradArgs {
        grad,
        m: m_,
        n: n_,
        k: k_,
        transa: true,
        transb: false,
        a_rows: k_, // A transposed: stored k × m, K-major
        a_cols: m_,
        lda: k_ as i64,
        a,
        b_rows: k_, // B as is: k × n, K-major
        b_cols: n_,
        ldb: k_ as i64,
        b,
        d_rows: m_,
        d_cols: n_,
        ldd: m_ as i64,
        d,
    }
}

/// `fp8_grad_layout`, with M, K and N checked to be multiples of 16 (cuBLASLt's FP8 rule, as
/// for the forward: here M is a leading dimension too, of the dW GEMM's operands).
pub fn fp8_grad_args(grad: Fp8Grad, tokens: usize, in_features: usize, out_features: usize) -> Result<Fp8GradArgs, String> {
    check_dims(16, in_features, out_features)?;
    if tokens == 0 || !tokens.is_multiple_of(16) {
        return Err(misaligned("token count B·T", tokens, 16, "pick --batch and --seq so that B·T is a multiple of 16"));
    }
    Ok(fp8_grad_layout(grad, tokens, in_features, out_features))
}

impl Fp8GradArgs {
    /// The same call in `cublaslt_model`'s terms: FP8 A and B in their formats, C = D (β = 0)
    /// in D's type, α = 1, both scale pointers set, no epilogue (the bias gradient is Σ dY in
    /// high precision, outside the GEMM, as TransformerEngine computes it).
    pub fn contract(&self) -> MatmulArgs {
        let d = MatrixLayout { dtype: self.d, rows: self.d_rows, cols: self.d_cols, ld: self.ldd };
        MatmulArgs {
            m: self.m,
            n: self.n,
            k: self.k,
            transa: self.transa,
            transb: self.transb,
            a: MatrixLayout { dtype: self.a.dtype(), rows: self.a_rows, cols: self.a_cols, ld: self.lda },
            b: MatrixLayout { dtype: self.b.dtype(), rows: self.b_rows, cols: self.b_cols, ld: self.ldb },
            c: d,
            d,
            alpha: 1.0,
            beta: 0.0,
            epilogue: Epilogue::Default,
            bias_len: 0,
            scaled: true,
        }
    }

    /// The minimum-alignment preferences (bytes) of A, B, C and D at these pointers (C is D).
    pub fn alignments(&self, ptrs: [u64; 3]) -> [u32; 4] {
        let c = self.contract();
        let [a, b, d] = ptrs;
        stage3_fused::gemm_args::alignments([a, b, d, d], [&c.a, &c.b, &c.c, &c.d])
    }
}

/// One HYBRID backward GEMM, D = s_A·s_B·op(A)·B, on the operands' device: `a` and `b` hold what
/// `args.a` and `args.b` say (Wᵀ or Xᵀ as E4M3 codes, dY or dYᵀ as E5M2 codes in u8 tensors:
/// candle has no E5M2 dtype), row-major as the layouts read them; `scale_a`, `scale_b` one f32
/// each. Returns D row-major: dX (M, K) bf16 or dW (N, K) f32.
/// - CUDA: cuBLASLt's E4M3 × E5M2 GEMM (`cuda::fp8_grad_gemm`).
/// - CPU: the same arguments executed by `cublaslt_model` (f64 sums, D rounded to its type) on
///   the decoded codes: the CUDA path's contract, run where there is no GPU (tests, `ladder
///   selftest`); the CPU trains with the emulation (`hybrid::linear_bwd_hybrid`) instead.
pub fn fp8_grad_gemm(args: &Fp8GradArgs, a: &Tensor, b: &Tensor, scale_a: &Tensor, scale_b: &Tensor) -> candle_core::Result<Tensor> {
    #[cfg(feature = "cuda")]
    if a.device().is_cuda() {
        return crate::cuda::fp8_grad_gemm(args, a, b, scale_a, scale_b);
    }
    let c = args.contract();
    let (a, b) = (decode_operand(a, &c.a, "A")?.flatten_all()?.to_vec1()?, decode_operand(b, &c.b, "B")?.flatten_all()?.to_vec1()?);
    let scale = |s: &Tensor| -> candle_core::Result<f32> { s.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>().map(|v| v[0]) };
    let d = cublaslt_model::matmul(&c, &a, &b, None, None, (scale(scale_a)?, scale(scale_b)?)).map_err(candle_core::Error::Msg)?;
    let d = Tensor::from_vec(d, (args.d_cols as usize, args.d_rows as usize), &candle_core::Device::Cpu)?; // D column-major = (d_cols, d_rows) row-major
    match args.d {
        DataType::Bf16 => d.to_dtype(DType::BF16), // exact: the model rounded D to bf16
        _ => Ok(d),
    }
}

/// An operand's FP8 codes (E4M3, or E5M2 in u8) decoded to f32, exactly, as (rows, cols) of its
/// row-major tensor, after checking it against its layout `l` (stored l.rows × l.cols
/// column-major = (l.cols, l.rows) row-major, of l's type). On CUDA our kernel
/// (`quant_cuda::decode_fp8`), on the CPU the float8 crate's conversions.
fn decode_operand(t: &Tensor, l: &MatrixLayout, what: &str) -> candle_core::Result<Tensor> {
    if t.dims() != [l.cols as usize, l.rows as usize] {
        candle_core::bail!("fp8_grad_gemm: {what} is {:?} where the layout reads ({}, {})", t.dims(), l.cols, l.rows);
    }
    match (l.dtype, t.dtype()) {
        (DataType::E4m3, DType::F8E4M3) | (DataType::E5m2, DType::U8) => {}
        (want, got) => candle_core::bail!("fp8_grad_gemm: {what} is a {got:?} tensor where the layout says {want:?}"),
    }
    #[cfg(feature = "cuda")]
    if t.device().is_cuda() {
        return crate::quant_cuda::decode_fp8(t);
    }
    match t.dtype() {
        DType::U8 => {
            let v: Vec<f32> = t.flatten_all()?.to_vec1::<u8>()?.into_iter().map(|q| float8::F8E5M2::from_bits(q).to_f32()).collect();
            Tensor::from_vec(v, t.shape(), t.device())
        }
        _ => t.to_dtype(DType::F32),
    }
}

/// `fp8_grad_gemm`'s fallback, where cuBLASLt offers no E4M3 × E5M2 algorithm: the same operands
/// and scales, the codes decoded to f32 (exact: every E4M3 and E5M2 value is an f32), and an f32
/// GEMM in candle's matmul (TF32 off: `Stage::switches`), D = s_A·s_B·op(A)·B stored in D's
/// type. So the numbers are the FP8 GEMM's but for the order of the f32 sums; the speed is
/// an f32 GEMM's, and the training row's notes say it ran (`block::GRAD_FALLBACK`). In row-major
/// terms D (n, m) = B (n, k) · A (m, k)ᵀ: A stored k × m column-major is (m, k) row-major.
pub fn fp8_grad_gemm_fallback(
    args: &Fp8GradArgs,
    a: &Tensor,
    b: &Tensor,
    scale_a: &Tensor,
    scale_b: &Tensor,
) -> candle_core::Result<Tensor> {
    let c = args.contract();
    let (a, b) = (decode_operand(a, &c.a, "A")?, decode_operand(b, &c.b, "B")?); // (m, k), (n, k) f32
    let s = (scale_a.to_dtype(DType::F32)?.reshape(())? * scale_b.to_dtype(DType::F32)?.reshape(())?)?; // s_A·s_B, on the device
    let d = b.matmul(&a.t()?)?.broadcast_mul(&s)?; // (n, m) = D column-major m × n
    match args.d {
        DataType::Bf16 => d.to_dtype(DType::BF16),
        _ => Ok(d),
    }
}

/// The minimum-alignment preferences (bytes) of a call's A, B, C and D (pointers in that order;
/// C's is 0 for an E4M3 D, which gets no C), each layout's leading dimension counted in its own
/// element size: E4M3 A and B, bf16 C, bf16 or E4M3 D (`stage3_fused::gemm_args::alignment`).
pub fn fp8_alignments(args: &Fp8GemmArgs, ptrs: [u64; 4]) -> [u32; 4] {
    let c = args.contract();
    stage3_fused::gemm_args::alignments(ptrs, [&c.a, &c.b, &c.c, &c.d])
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

// ---------------------------------------------------------------------------------------------
// The op
// ---------------------------------------------------------------------------------------------

/// The FP8 GEMM y = act(s_x·s_w·(q_x W_qᵀ) + b), a candle op over (q_x, W_q): q_x (…, K) and
/// W_q (N, K) in E4M3 → y (…, N) in bf16, or in E4M3 with `with_e4m3_out`.
///
/// ```no_run
/// # use stage4_fp8::gemm::Fp8Gemm;
/// # fn f(xq: &candle_core::Tensor, sx: &candle_core::Tensor, wq: &candle_core::Tensor, sw: &candle_core::Tensor, b: &candle_core::Tensor) -> candle_core::Result<()> {
/// let y = Fp8Gemm::new(sx, sw, b, true)?.forward(xq, wq)?; // (B, T, K) E4M3 → (B, T, N) bf16, GELU'd
/// # Ok(()) }
/// ```
#[derive(Clone, Debug)]
pub struct Fp8Gemm {
    x_scale: Tensor, // s_x: one f32 (rank 0 or (1)), read by the GEMM through its pointer
    w_scale: Tensor, // s_w: one f32
    bias: Tensor,    // (N) bf16: the FP8 type table's bias type for a bf16 or an E4M3 D
    gelu: bool,      // GELU (tanh form) after the bias: CUBLASLT_EPILOGUE_GELU_BIAS
    fast_accum: bool,
    e4m3_out: Option<Fp8Out>,
}

/// An E4M3 output for the next layer: y is multiplied by `d_scale` (1/s of the next layer's
/// input) before the cast, and max|y| (before that scaling: the amax the next layer's history
/// records) goes to `amax_d`.
#[derive(Clone, Debug)]
pub struct Fp8Out {
    /// (1) f32: 1/s (CUBLASLT_MATMUL_DESC_D_SCALE_POINTER).
    pub d_scale: Tensor,
    /// (1) u32 holding an f32's bits (CUBLASLT_MATMUL_DESC_AMAX_D_POINTER): the next layer's amax.
    pub amax_d: Tensor,
}

impl Fp8Gemm {
    /// s_x, s_w: one f32 each (rank 0 or (1)); b: (N), stored as bf16 (any float dtype is cast).
    /// Fast accumulation on and a bf16 output unless `with_fast_accum` / `with_e4m3_out` say otherwise.
    pub fn new(x_scale: &Tensor, w_scale: &Tensor, bias: &Tensor, gelu: bool) -> candle_core::Result<Fp8Gemm> {
        check_scale(x_scale)?;
        check_scale(w_scale)?;
        if bias.rank() != 1 {
            candle_core::bail!("fp8_gemm: the bias must be (N), one value per output feature; got {:?}", bias.dims());
        }
        // An f32 scale that views a layer's buffer stays that view (the cast and `contiguous`
        // copy nothing then): the GEMM reads what the buffer holds at launch, as a CUDA graph
        // replays it.
        let f32_of = |s: &Tensor| s.to_dtype(DType::F32)?.contiguous();
        Ok(Fp8Gemm {
            x_scale: f32_of(x_scale)?,
            w_scale: f32_of(w_scale)?,
            bias: bias.to_dtype(DType::BF16)?.contiguous()?,
            gelu,
            fast_accum: true,
            e4m3_out: None,
        })
    }

    /// cuBLASLt's FP8 fast accumulation (CUBLASLT_MATMUL_DESC_FAST_ACCUM; `cuda.rs` says what
    /// it skips). The CPU forward accumulates in f32 either way.
    pub fn with_fast_accum(mut self, on: bool) -> Fp8Gemm {
        self.fast_accum = on;
        self
    }

    /// Store E4M3(y·d_scale) instead of bf16 and record max|y| in `amax_d` ((1) u32, f32 bits).
    /// cuBLASLt sets amax_D, the CPU forward maxes into it (as every CPU producer does): the
    /// same value when the buffer is zero on entry, as the next layer's state leaves it.
    pub fn with_e4m3_out(mut self, d_scale: &Tensor, amax_d: &Tensor) -> candle_core::Result<Fp8Gemm> {
        check_scale(d_scale)?;
        if amax_d.dtype() != DType::U32 || amax_d.elem_count() != 1 {
            candle_core::bail!("fp8_gemm: amax_D is one u32 holding an f32's bits; got {:?} {:?}", amax_d.dtype(), amax_d.dims());
        }
        self.e4m3_out = Some(Fp8Out { d_scale: d_scale.to_dtype(DType::F32)?.contiguous()?, amax_d: amax_d.contiguous()? });
        Ok(self)
    }

    /// q_x (…, K) and W_q (N, K), E4M3, on one device with the held tensors → y (…, N): bf16, or
    /// E4M3 with `with_e4m3_out`. On CUDA, M, N and K must be multiples of 16 (`fp8_gemm_args`).
    pub fn forward(&self, xq: &Tensor, wq: &Tensor) -> candle_core::Result<Tensor> {
        if xq.dtype() != DType::F8E4M3 || wq.dtype() != DType::F8E4M3 {
            candle_core::bail!(
                "fp8_gemm: q_x and W_q must be E4M3 (got {:?} and {:?}); quantise them first (`fp8::quantize`)",
                xq.dtype(),
                wq.dtype()
            );
        }
        self.out_dims(xq.shape(), wq.shape())?;
        xq.contiguous()?.apply_op2_no_bwd(&wq.contiguous()?, self)
    }

    /// Slow twin of `forward` (CPU): candle's casts from E4M3 times the scales (`dequantize_slow`),
    /// matmul, bias add and GELU in candle's ops, then candle's cast to the stored dtype (for E4M3
    /// after multiplying by the D scale). Returns (y as stored, max|y| before the store, rank 0:
    /// what amax_D records); no buffer is touched.
    pub fn forward_slow(&self, xq: &Tensor, wq: &Tensor) -> candle_core::Result<(Tensor, Tensor)> {
        let (shape, (m, k, _)) = self.out_dims(xq.shape(), wq.shape())?;
        let x = dequantize_slow(xq, &self.x_scale, DType::F32)?.reshape((m, k))?; // (M, K): s_x·q_x
        let w = dequantize_slow(wq, &self.w_scale, DType::F32)?; // (N, K): s_w·W_q
        let y = x.matmul(&w.t()?)?.broadcast_add(&self.bias.to_dtype(DType::F32)?)?; // (M, N)
        let y = if self.gelu { stage0_baseline::gelu_tanh(&y)? } else { y };
        let stored = match &self.e4m3_out {
            None => y.to_dtype(DType::BF16)?,
            Some(o) => y.broadcast_mul(&o.d_scale.reshape(())?)?.to_dtype(DType::F8E4M3)?,
        };
        Ok((stored.reshape(shape)?, amax_slow(&y)?))
    }

    /// y's shape (…, N) and (M, K, N) from q_x (…, K) and W_q (N, K), checked against the bias.
    fn out_dims(&self, x: &Shape, w: &Shape) -> candle_core::Result<(Shape, (usize, usize, usize))> {
        let (n, k) = w.dims2()?;
        let Some((&k_x, lead)) = x.dims().split_last() else { candle_core::bail!("fp8_gemm: q_x must be (…, K), not a scalar") };
        if k_x != k || self.bias.dims() != [n] || n == 0 || k == 0 {
            candle_core::bail!("fp8_gemm: q_x {:?}, W_q {:?} and b {:?} do not fit y = q_x W_qᵀ + b", x.dims(), w.dims(), self.bias.dims());
        }
        let out: Vec<usize> = lead.iter().copied().chain([n]).collect();
        Ok((Shape::from(out), (lead.iter().product(), k, n)))
    }
}

impl CustomOp2 for Fp8Gemm {
    fn name(&self) -> &'static str {
        "speedkit-fp8-gemm"
    }

    /// y_ij = act(s_x·s_w·(x_i · w_j) + b_j) in f32, rows of y on all threads, then the store.
    fn cpu_fwd(&self, xs: &CpuStorage, xl: &Layout, ws: &CpuStorage, wl: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let (shape, (m, k, n)) = self.out_dims(xl.shape(), wl.shape())?;
        let (CpuStorage::F8E4M3(x), CpuStorage::F8E4M3(w), Some((x0, x1)), Some((w0, w1))) =
            (xs, ws, xl.contiguous_offsets(), wl.contiguous_offsets())
        else {
            candle_core::bail!("fp8_gemm: q_x and W_q must be contiguous E4M3")
        };
        // Decoded once per operand (exact: every E4M3 value is an f32), so the inner loop is an
        // f32 dot product the compiler vectorises.
        let (x, w) = (par_convert(&x[x0..x1], |q| q.to_f32()), par_convert(&w[w0..w1], |q| q.to_f32()));
        let s = held_f32(&self.x_scale, "s_x")? * held_f32(&self.w_scale, "s_w")?; // cuBLASLt's scale_B·scale_A
        let b = held_bias(&self.bias)?; // (N)
        let gelu = self.gelu;
        let mut y = vec![0f32; m * n]; // (M, N)
        y.par_chunks_mut(n).zip(x.par_chunks(k)).for_each(|(y_row, x_row)| {
            for ((y, w_row), b) in y_row.iter_mut().zip(w.chunks_exact(k)).zip(&b) {
                let v = s * dot(x_row, w_row) + b;
                *y = if gelu { stage3_fused::ops::gelu_tanh(v) } else { v };
            }
        });
        let out = match &self.e4m3_out {
            // round to nearest even, as cuBLASLt's bf16 D
            None => CpuStorage::BF16(par_convert(&y, half::bf16::from_f32)),
            // D = E4M3(d_scale·y), saturating; amax_D = max|y| (NaN kept, as the GPU's)
            Some(o) => {
                let d = held_f32(&o.d_scale, "the D scale")?;
                let q = par_convert(&y, |v| F8E4M3::from_f32(v * d));
                max_into(&o.amax_d, max_abs_bits(&y, f32::to_bits))?;
                CpuStorage::F8E4M3(q)
            }
        };
        Ok((out, shape))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        xs: &candle_core::CudaStorage,
        xl: &Layout,
        ws: &candle_core::CudaStorage,
        wl: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        let (shape, _) = self.out_dims(xl.shape(), wl.shape())?;
        let ((bs, bl), (sxs, sxl), (sws, swl)) =
            (self.bias.storage_and_layout(), self.x_scale.storage_and_layout(), self.w_scale.storage_and_layout());
        let (Storage::Cuda(bs), Storage::Cuda(sxs), Storage::Cuda(sws)) = (&*bs, &*sxs, &*sws) else {
            candle_core::bail!("fp8_gemm: the bias and both scales must be on the GPU")
        };
        let out_guards = self.e4m3_out.as_ref().map(|o| (o.d_scale.storage_and_layout(), o.amax_d.storage_and_layout()));
        let out = match &out_guards {
            None => None,
            Some(((ds, dl), (am, al))) => match (&**ds, &**am) {
                (Storage::Cuda(ds), Storage::Cuda(am)) => Some(((ds, *dl), (am, *al))),
                _ => candle_core::bail!("fp8_gemm: the D scale and amax_D must be on the GPU"),
            },
        };
        let y = crate::cuda::fp8_gemm_fwd((xs, xl), (ws, wl), (bs, bl), (sxs, sxl), (sws, swl), self.gelu, self.fast_accum, out)?;
        Ok((y, shape))
    }
}

/// a · b in f32 with eight running sums (the lanes of one AVX register), added at the end.
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = ca.remainder().iter().zip(cb.remainder()).map(|(x, y)| x * y).sum();
    let mut acc = [0f32; 8];
    for (x, y) in ca.zip(cb) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// One f32 held by the op (a scale), read on the CPU.
fn held_f32(t: &Tensor, what: &str) -> candle_core::Result<f32> {
    let (s, l) = t.storage_and_layout();
    let Storage::Cpu(s) = &*s else { candle_core::bail!("fp8_gemm: {what} is not on the CPU") };
    scale_value(s, l)
}

/// The held bias (N) bf16 as f32, read on the CPU.
fn held_bias(t: &Tensor) -> candle_core::Result<Vec<f32>> {
    let (s, l) = t.storage_and_layout();
    let (Storage::Cpu(CpuStorage::BF16(v)), Some((a, b))) = (&*s, l.contiguous_offsets()) else {
        candle_core::bail!("fp8_gemm: the bias is not a contiguous bf16 CPU tensor")
    };
    Ok(v[a..b].iter().map(|v| v.to_f32()).collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fp8::{amax, quantize, scale_from_amax};
    use crate::twin::{gemm_twin_tolerance, Accumulation};
    use candle_core::Device;
    use shared::check::compare_within;
    use shared::weights::SplitMix64;

    fn randn(dims: &[usize], seed: u64, scale: f32) -> Tensor {
        let v = SplitMix64::new(seed).normals(dims.iter().product()).into_iter().map(|x| x * scale).collect();
        Tensor::from_vec(v, dims, &Device::Cpu).unwrap()
    }

    fn host(t: &Tensor) -> Vec<f32> {
        t.to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1().unwrap()
    }

    /// (q_x, W_q, the op) for y = act(x Wᵀ + b), x: (B, T, K) ~ N(0, 1), W ~ N(0, 0.05), each
    /// quantised with its own amax (current scaling, as a weight is).
    fn operands(dims: (usize, usize, usize, usize), gelu: bool, seed: u64) -> (Tensor, Tensor, Fp8Gemm) {
        let (bsz, t, k, n) = dims;
        let (x, w, b) = (randn(&[bsz, t, k], seed, 1.0), randn(&[n, k], seed + 1, 0.05), randn(&[n], seed + 2, 0.05));
        let (sx, sw) = (scale_from_amax(&amax(&x).unwrap(), 0).unwrap(), scale_from_amax(&amax(&w).unwrap(), 0).unwrap());
        let op = Fp8Gemm::new(&sx, &sw, &b, gelu).unwrap();
        (quantize(&x, &sx).unwrap(), quantize(&w, &sw).unwrap(), op)
    }

    /// How many E4M3 values differ between `got` and `want` (decoded), asserting each difference
    /// is one step of the larger value's binade (2⁻⁹ among subnormals): two f32 sums that agree
    /// to the last bits round apart only where they straddle a rounding boundary.
    fn e4m3_differences(got: &[f32], want: &[f32], what: &str) -> usize {
        let step = |v: f32| if v < 1.0 / 64.0 { 2f32.powi(-9) } else { 2f32.powi(v.log2().floor() as i32 - 3) };
        let differ: Vec<(f32, f32)> = got.iter().zip(want).filter(|(g, w)| g != w).map(|(g, w)| (*g, *w)).collect();
        for (g, w) in &differ {
            assert!((g - w).abs() <= step(g.abs().max(w.abs())), "{what}: {g} vs {w} are not neighbours");
        }
        differ.len()
    }

    /// The op's CPU forward beside its slow twin on random ragged shapes (M = B·T, K and N from 1
    /// to a few hundred, not multiples of 16), with and without GELU, bf16 and E4M3 outputs.
    /// Only the f32 sum order and where s_x·s_w is applied differ, then the store:
    /// - bf16: within the derived GEMM-twin tolerance for f32 accumulation and a bf16 store
    ///   (`gemm_twin_tolerance(K, F32, BF16)`, 2·2⁻⁹ + 4·√K·2⁻²⁴);
    /// - E4M3: the codes equal but where the two sums straddle a rounding boundary (each such
    ///   code a neighbour, at most 1 % of them plus one); amax_D, maxed into the buffer over two
    ///   calls (the second smaller), the larger call's max|y| within f32 rounding (1e-5).
    #[test]
    fn the_fp8_gemm_matches_its_slow_twin() {
        let mut rng = SplitMix64::new(53);
        let (mut worst_bf16, mut worst_amax, mut differing) = (0f64, 0f64, (0usize, 0usize));
        for case in 0..16u64 {
            let (bsz, t) = (1 + (case % 2) as usize, 1 + (rng.next_u64() % 150) as usize);
            let (k, n) = (1 + (rng.next_u64() % 300) as usize, 1 + (rng.next_u64() % 200) as usize);
            let (gelu, e4m3) = (case % 2 == 1, (case / 2) % 2 == 1);
            let (xq, wq, op) = operands((bsz, t, k, n), gelu, 10 * case);
            let (y, y_amax) = op.forward_slow(&xq, &wq).unwrap(); // bf16 store, max|y|
            let what = format!("case {case}: (B, T, K, N) = ({bsz}, {t}, {k}, {n}), gelu {gelu}, E4M3 out {e4m3}");
            if !e4m3 {
                let got = op.forward(&xq, &wq).unwrap();
                assert_eq!((got.dims(), got.dtype()), (&[bsz, t, n][..], DType::BF16), "{what}");
                let tol = gemm_twin_tolerance(k, Accumulation::F32, DType::BF16);
                let c = compare_within(&got, &y, tol).unwrap();
                assert!(c.passed, "{what}: {c:?} (tolerance {tol:e})");
                worst_bf16 = worst_bf16.max(c.rel_err);
                continue;
            }
            // the next layer's scale a little small, so the top saturates
            let s_next = 0.8 * y_amax.to_scalar::<f32>().unwrap() / 448.0;
            let amax_d = Tensor::zeros(1, DType::U32, &Device::Cpu).unwrap();
            let mut largest = 0f32;
            for (call, x_scale) in [1.0f64, 0.5].into_iter().enumerate() {
                // the second call's s_x halved: a smaller y, whose amax must not replace the first's
                let sx = (&op.x_scale * x_scale).unwrap();
                let op = Fp8Gemm { x_scale: sx, ..op.clone() }
                    .with_e4m3_out(&Tensor::new(&[1.0 / s_next], &Device::Cpu).unwrap(), &amax_d)
                    .unwrap();
                let got = op.forward(&xq, &wq).unwrap();
                let (want, want_amax) = op.forward_slow(&xq, &wq).unwrap();
                assert_eq!((got.dims(), got.dtype()), (&[bsz, t, n][..], DType::F8E4M3), "{what}");
                let (got, want) = (host(&got), host(&want));
                let d = e4m3_differences(&got, &want, &what);
                assert!(d <= got.len() / 100 + 1, "{what} call {call}: {d} of {} E4M3 values differ", got.len());
                if call == 0 {
                    assert!(got.iter().any(|v| v.abs() == 448.0), "{what}: nothing saturated, so a wrong D scale could pass");
                }
                differing = (differing.0 + d, differing.1 + got.len());
                largest = largest.max(want_amax.to_scalar::<f32>().unwrap());
                let recorded = crate::scale::amax_value(&amax_d).unwrap();
                let rel = ((recorded - largest).abs() / largest) as f64;
                assert!(rel <= 1e-5, "{what} call {call}: amax_D {recorded} vs {largest}");
                worst_amax = worst_amax.max(rel);
            }
        }
        eprintln!(
            "Fp8Gemm vs its slow twin: bf16 rel err at most {worst_bf16:.2e}; E4M3 codes differing {} of {}; amax_D rel err at most {worst_amax:.2e}",
            differing.0, differing.1
        );
    }

    /// The CPU forward computes what the CUDA forward asks cuBLASLt for: the arguments
    /// `fp8_gemm_args*` build, executed by `cublaslt_model` (f64 sums, the
    /// documented epilogue and D rounding) on the same E4M3 buffers and scales, agree with the op
    /// within the f32-accumulation tolerance (bf16 D), and code for code up to neighbours at
    /// rounding boundaries with amax_D within 1e-5 (E4M3 D).
    #[test]
    fn the_cpu_forward_executes_the_cublaslt_arguments() {
        use cublaslt_model::{matmul, matmul_fp8_out};
        let (mut worst_bf16, mut differing) = (0f64, (0usize, 0usize));
        for (case, &(m, k, n, gelu)) in
            [(16, 32, 48, false), (32, 64, 16, true), (48, 160, 96, true), (64, 16, 32, false)].iter().enumerate()
        {
            let (xq, wq, op) = operands((1, m, k, n), gelu, 100 + case as u64);
            let scales = (op.w_scale.to_scalar::<f32>().unwrap(), op.x_scale.to_scalar::<f32>().unwrap()); // (A = W's, B = x's)
            let (a, b, bias) = (host(&wq), host(&xq), host(&op.bias));
            let d = matmul(&fp8_gemm_args(m, k, n, gelu).unwrap().contract(), &a, &b, None, Some(&bias), scales).unwrap();
            let want = Tensor::from_vec(d, (1, m, n), &Device::Cpu).unwrap();
            let c = compare_within(&op.forward(&xq, &wq).unwrap(), &want, gemm_twin_tolerance(k, Accumulation::F32, DType::BF16)).unwrap();
            assert!(c.passed, "case {case} bf16 D: {c:?}");
            worst_bf16 = worst_bf16.max(c.rel_err);

            let s_next = 0.8 * want.abs().unwrap().max_all().unwrap().to_dtype(DType::F32).unwrap().to_scalar::<f32>().unwrap() / 448.0;
            let amax_d = Tensor::zeros(1, DType::U32, &Device::Cpu).unwrap();
            let op = op.with_e4m3_out(&Tensor::new(&[1.0 / s_next], &Device::Cpu).unwrap(), &amax_d).unwrap();
            let args = fp8_gemm_args_e4m3_out(m, k, n, gelu).unwrap().contract();
            let (d, want_amax) = matmul_fp8_out(&args, &a, &b, Some(&bias), scales, 1.0 / s_next).unwrap();
            let got = host(&op.forward(&xq, &wq).unwrap());
            let differ = e4m3_differences(&got, &d, &format!("case {case}"));
            assert!(differ <= got.len() / 100 + 1, "case {case}: {differ} of {} E4M3 values differ", got.len());
            let recorded = crate::scale::amax_value(&amax_d).unwrap();
            assert!((recorded - want_amax).abs() <= 1e-5 * want_amax, "case {case}: amax_D {recorded} vs {want_amax}");
            differing = (differing.0 + differ, differing.1 + got.len());
        }
        eprintln!(
            "Fp8Gemm vs cublaslt_model: bf16 D rel err at most {worst_bf16:.2e}; E4M3 codes differing {} of {}",
            differing.0, differing.1
        );
    }

    /// What the op refuses, with the reason: operands not in E4M3, shapes that do not fit.
    #[test]
    fn the_fp8_gemm_refuses_what_does_not_fit() {
        let (xq, wq, op) = operands((1, 4, 8, 6), false, 7);
        let e = op.forward(&xq.to_dtype(DType::F32).unwrap(), &wq).unwrap_err().to_string();
        assert!(e.contains("must be E4M3") && e.contains("quantise"), "{e}");
        let e = op.forward(&xq, &wq.narrow(1, 0, 4).unwrap()).unwrap_err().to_string();
        assert!(e.contains("do not fit"), "{e}");
        let e =
            op.clone().with_e4m3_out(&Tensor::new(&[1f32], &Device::Cpu).unwrap(), &Tensor::zeros(1, DType::F32, &Device::Cpu).unwrap());
        assert!(e.unwrap_err().to_string().contains("one u32"));
    }

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
    fn fp8_alignments_count_each_matrix_in_its_own_element_size() {
        let base = 0x7f00_0000_0000u64;
        // K = 48, N = 80: A and B columns 48 bytes apart (E4M3), D's 80 elements apart: 160 bytes
        // as bf16, 80 as E4M3.
        let bf16_out = fp8_gemm_args(32, 48, 80, false).unwrap();
        assert_eq!(fp8_alignments(&bf16_out, [base; 4]), [16, 16, 32, 32]);
        let e4m3_out = fp8_gemm_args_e4m3_out(32, 48, 80, false).unwrap();
        assert_eq!(fp8_alignments(&e4m3_out, [base, base + 16, 0, base]), [16, 16, 32, 16]);
        // The te shapes: every stride a multiple of 256 bytes, so the pointers decide.
        let te = fp8_gemm_args(16384, 4096, 16384, true).unwrap();
        assert_eq!(fp8_alignments(&te, [base, base + 0x40, base + 0x100, base + 0x100]), [256, 64, 256, 256]);
    }

    #[test]
    fn pointer_alignment() {
        assert!(check_pointers(&[("A", 0x7f00_0000_0100), ("B", 0x7f00_0000_0010)]).is_ok());
        let e = check_pointers(&[("A", 0x100), ("bias", 0x108)]).unwrap_err();
        assert!(e.contains("bias") && e.contains("0x108"), "{e}");
    }
}
