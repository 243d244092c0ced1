//! # Stage 1 — tensor cores: TF32, bf16/f16 mixed precision
//!
//! **What changed.** The matrix multiplications run in a tensor-core format; everything else
//! is stage 0. `precision::choose` picks it per device (bf16 on SM 8.0+, f16 on SM 7.x, fp32
//! where there are no tensor cores; on a CPU bf16 where it has AVX512-BF16 or AMX-BF16, else
//! fp32); `--precision` overrides. On a CPU the bf16 GEMMs run on `cpu_kernels::bf16_gemm`, the engine's kernel for
//! the CPU's own bf16 dot-product units.
//!
//! **The mixed-precision rule (as PyTorch's autocast).** Weights are cast once, in `build`.
//! GEMM operands and outputs are bf16/f16, accumulated in f32 inside the tensor core. Three
//! things stay f32: LayerNorm statistics (a mean and variance over C values need more than
//! bf16's 8 significant bits), softmax (exp of scores needs range, and its sum accumulates
//! error), and the residual stream x (it is summed into at every block; rounding it to bf16
//! each time would compound). TF32 keeps f32 storage and only rounds GEMM inputs to 10
//! mantissa bits inside the tensor core (candle's `set_gemm_reduced_precision_f32`); the
//! switches are set deliberately per precision in `precision::switches`. On a CPU the same rule
//! holds: activations in bf16 between the ops, the engine's element-wise passes reading and
//! writing bf16 (computing in f32 inside), the GEMMs on the CPU's bf16 unit.
//!
//! **Why it is faster on the hardware.** Tensor cores do a small matrix product per
//! instruction: on an H100 SXM, dense bf16 peaks at ~989 TFLOP/s and TF32 at ~495, against
//! ~67 for fp32 on the CUDA cores — about 7x from TF32 on large fp32 GEMMs, ~15x from bf16 —
//! and bf16 halves the bytes every GEMM reads. The GEMMs are ~95% of this block's FLOPs at
//! GPT-2 sizes, but stage 0's memory-bound element-wise ops are untouched, so the block gains
//! less than the GEMMs do. A CPU's version of the same idea: `vdpbf16ps` (AVX512-BF16, AMD Zen 4
//! and later, Intel Xeons since Cooper Lake) adds two bf16 products into each f32 lane per
//! instruction, twice an f32 FMA's multiply-adds, and AMX tiles (Intel Xeons since Sapphire
//! Rapids) a 16 × 16 × 32 product per instruction.
//!
//! **What it costs.** TF32: ~1e-3 relative error. bf16: ~3e-3–1e-2 (7 mantissa bits); f16:
//! less error but 5 exponent bits. On a CPU without bf16 units (and for f16 on any CPU) there
//! is nothing to run them on: bf16/f16 run (so the numerics can be studied anywhere) but every
//! GEMM converts its operands, so it is *slower*; the label says `converted to f32`.
//!
//! **Run it.** `cargo run --release -p stage1_tensorcore` (CPU: bf16 on a bf16 unit, else
//! fp32; says why) · `SPEEDKIT_CPU_BF16=off cargo run --release -p stage1_tensorcore -- --precision
//! bf16` (CPU as one without bf16 units: bf16 numerics, converted) ·
//! `cargo run --release --features cuda -p stage1_tensorcore -- --device cuda` (GPU, auto).

/// This stage's exercise (docs/stages.md, "Exercises"): with `--features exercise` your version in
/// `src/exercise.rs`, otherwise its solution, `src/exercise_solution.rs`; `tests/exercise.rs` checks it.
#[cfg_attr(feature = "exercise", path = "exercise.rs")]
#[cfg_attr(not(feature = "exercise"), path = "exercise_solution.rs")]
pub mod exercise;
pub mod loss_scale;
pub mod precision;

#[cfg(feature = "harness")]
mod block;
#[cfg(feature = "harness")]
mod stage;
#[cfg(feature = "harness")]
pub use block::Block;
#[cfg(feature = "harness")]
pub use stage::{register_bf16_ceiling, LossScaledAdamW, TensorCore, STAGE};

use candle_core::{DType, Tensor};
use cpu_kernels::bf16_gemm::{self, PackedWeight};
use stage0_baseline::{causal_mask, merge_heads, softmax, split_heads};

/// y = x Wᵀ + b for x (B, T, in), W (out, in), b (out): stage 0's `linear` with the GEMM on
/// `bf16_gemm::matmul_prepacked` (bf16 W on the CPU's bf16 unit, packed once when the block is
/// built; a bf16 x gives a bf16 y, as in the forward; an f32 x, as in a CPU training step, is
/// rounded to bf16 as it is packed and y stays f32; candle's matmul otherwise). b in y's dtype.
pub fn linear(x: &Tensor, w: &PackedWeight, b: &Tensor) -> candle_core::Result<Tensor> {
    let (bsz, t, c_in) = x.dims3()?;
    let c_out = w.weight().dim(0)?;
    let y = bf16_gemm::matmul_prepacked(&x.reshape((bsz * t, c_in))?, w)?; // (B·T, out)
    y.broadcast_add(b)?.reshape((bsz, t, c_out))
}

/// Causal self-attention over the full score matrix, mixed precision: q kᵀ and p v run on
/// tensor cores (on a CPU, its bf16 unit through `bf16_gemm::matmul`) in the GEMM dtype; the scores are widened to f32 for the mask and softmax.
/// q, k, v: (B, T, C) in the GEMM dtype; `mask` (T, T) f32. Returns (B, T, C), GEMM dtype.
pub fn attention(q: &Tensor, k: &Tensor, v: &Tensor, n_head: usize, mask: &Tensor) -> candle_core::Result<Tensor> {
    attention_in(q, k, v, n_head, mask, q.dtype(), &softmax)
}

/// `attention` with its two products in `gemm` whatever q, k and v are stored in (bf16 GEMMs on
/// a CPU's bf16 unit through `bf16_gemm::matmul_bf16`: operands rounded to bf16 as they are
/// packed) and the softmax given (stage 0's `attention_with`). Returns (B, T, C) in q's dtype.
pub fn attention_in(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    n_head: usize,
    mask: &Tensor,
    gemm: DType,
    softmax: &dyn Fn(&Tensor) -> candle_core::Result<Tensor>,
) -> candle_core::Result<Tensor> {
    let matmul = |a: &Tensor, b: &Tensor| if gemm == DType::BF16 { bf16_gemm::matmul_bf16(a, b) } else { a.matmul(b) };
    let t = q.dim(1)?;
    let (q, k, v) = (split_heads(q, n_head)?, split_heads(k, n_head)?, split_heads(v, n_head)?); // (B, n_head, T, d_head)
    let scale = 1.0 / (q.dim(candle_core::D::Minus1)? as f64).sqrt();
    let s = (matmul(&q, &k.t()?)?.to_dtype(DType::F32)? * scale)?; // (B, n_head, T, T) f32: exp needs the range
    let mask = if mask.dim(0)? == t { mask.clone() } else { causal_mask(t, q.device())? };
    let p = softmax(&s.broadcast_add(&mask)?)?.to_dtype(v.dtype())?; // probabilities in [0, 1]: bf16 holds them
    merge_heads(&matmul(&p, &v)?) // (B, n_head, T, d_head) → (B, T, C)
}
