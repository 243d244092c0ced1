//! # Stage 0 — baseline: the block in fp32, every op spelled out
//!
//! **What this is.** The GPT-2 pre-LayerNorm decoder block written the way a first
//! implementation is: fp32 everywhere, TF32 explicitly off, LayerNorm, softmax and GELU built
//! from primitive tensor ops, q, k and v from three separate matrix multiplications, and
//! attention that materialises the full (B, n_head, T, T) score matrix with a causal mask.
//!
//! **Why it is slow on the hardware.** Every primitive op is its own pass over memory (a
//! kernel launch on GPU): LayerNorm alone is 7 passes over (B, T, C) (plus two over the (B, T, 1)
//! statistics), GELU 9 over (B, T, FF) — count the ops in `layer_norm` and `gelu_tanh` below.
//! The attention scores cost B·n_head·T² floats written and read several times — at T = 2048
//! that is more memory traffic than all the weights. fp32 GEMMs run on the CUDA cores, not the
//! tensor cores (on an H100: ~67 TFLOP/s instead of ~989 for bf16).
//!
//! **On a CPU: the engine.** candle's CPU element-wise kernels run on one thread (and `tanh`
//! scalar), which would swamp every comparison above this stage. So on a CPU every stage, this
//! one included, runs its element-wise ops as the engine's passes (`cpu_kernels::elementwise`:
//! each primitive op still one pass over memory, but on all threads and vectorised; LayerNorm in
//! four passes, the softmax in five; in a training step LayerNorm's, GELU's and the softmax's
//! backward run on the engine too), and its GEMMs on the engine's (`cpu_kernels::bf16_gemm`;
//! candle's f32 matmul at fp32). The engine is the same under every stage, so each stage's gain
//! is its technique's.
//! `--elementwise candle` runs candle's own ops instead, and `ladder --ablate` prices the engine
//! against them in stage 0's row.
//!
//! **What to expect.** The reference speed every later stage is measured against, and the
//! reference output every stage is checked against (relative error 0 by construction).
//!
//! **Run it.** `cargo run --release -p stage0_baseline` (CPU, `small` preset) ·
//! `cargo run --release --features cuda -p stage0_baseline -- --device cuda` (GPU).

/// This stage's exercise (docs/stages.md, "Exercises"): with `--features exercise` your version in
/// `src/exercise.rs`, otherwise its solution, `src/exercise_solution.rs`; `tests/exercise.rs` checks it.
#[cfg_attr(feature = "exercise", path = "exercise.rs")]
#[cfg_attr(not(feature = "exercise"), path = "exercise_solution.rs")]
pub mod exercise;

#[cfg(feature = "harness")]
mod block;
#[cfg(feature = "harness")]
mod stage;
#[cfg(feature = "harness")]
pub use block::Block;
#[cfg(feature = "harness")]
pub use stage::{elementwise_label, Baseline, BaselineCandleOps, STAGE};

use candle_core::{Tensor, D};

/// LayerNorm's ε, as in GPT-2.
pub const LN_EPS: f64 = 1e-5;

/// y = x Wᵀ + b for x (B, T, in), W (out, in): one (B·T, in) x (in, out) GEMM.
pub fn linear(x: &Tensor, w: &Tensor, b: &Tensor) -> candle_core::Result<Tensor> {
    let (bsz, t, c_in) = x.dims3()?;
    let c_out = w.dim(0)?;
    let y = x.reshape((bsz * t, c_in))?.matmul(&w.t()?)?; // (B·T, out)
    y.broadcast_add(b)?.reshape((bsz, t, c_out))
}

/// LayerNorm over the last dim from primitives: (x − mean) / sqrt(var + eps) · g + b.
pub fn layer_norm(x: &Tensor, g: &Tensor, b: &Tensor) -> candle_core::Result<Tensor> {
    let mean = x.mean_keepdim(D::Minus1)?; // (B, T, 1)
    let xc = x.broadcast_sub(&mean)?;
    let var = xc.sqr()?.mean_keepdim(D::Minus1)?; // biased variance, as in PyTorch
    let xhat = xc.broadcast_div(&(var + LN_EPS)?.sqrt()?)?;
    xhat.broadcast_mul(g)?.broadcast_add(b)
}

/// softmax over the last dim, max-subtracted so exp never overflows.
pub fn softmax(s: &Tensor) -> candle_core::Result<Tensor> {
    let m = s.max_keepdim(D::Minus1)?;
    let e = s.broadcast_sub(&m)?.exp()?;
    e.broadcast_div(&e.sum_keepdim(D::Minus1)?)
}

/// GELU, tanh approximation (GPT-2's): 0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³))).
pub fn gelu_tanh(x: &Tensor) -> candle_core::Result<Tensor> {
    let x3 = (x.sqr()? * x)?;
    let inner = ((x + (x3 * 0.044715)?)? * (2.0 / std::f64::consts::PI).sqrt())?;
    ((inner.tanh()? + 1.0)? * x)? * 0.5
}

/// (T, T) additive causal mask: 0 where key j ≤ query i, −inf above the diagonal.
pub fn causal_mask(t: usize, device: &candle_core::Device) -> candle_core::Result<Tensor> {
    let v: Vec<f32> = (0..t * t).map(|idx| if idx % t > idx / t { f32::NEG_INFINITY } else { 0.0 }).collect();
    Tensor::from_vec(v, (t, t), device)
}

/// (B, T, C) → (B, n_head, T, d_head)
pub fn split_heads(x: &Tensor, n_head: usize) -> candle_core::Result<Tensor> {
    let (b, t, c) = x.dims3()?;
    x.reshape((b, t, n_head, c / n_head))?.transpose(1, 2)?.contiguous()
}

/// (B, n_head, T, d_head) → (B, T, C)
pub fn merge_heads(x: &Tensor) -> candle_core::Result<Tensor> {
    let (b, h, t, d) = x.dims4()?;
    x.transpose(1, 2)?.contiguous()?.reshape((b, t, h * d))
}

/// Causal self-attention over the full score matrix: softmax(q kᵀ / √d_head + mask) v.
/// q, k, v: (B, T, C); `mask` at least (T, T). Returns (B, T, C).
pub fn attention(q: &Tensor, k: &Tensor, v: &Tensor, n_head: usize, mask: &Tensor) -> candle_core::Result<Tensor> {
    attention_with(q, k, v, n_head, mask, &softmax)
}

/// `attention` with the softmax given: the block passes the engine's (the same five steps, on
/// all threads; `cpu_kernels::elementwise::softmax_last_dim`).
pub fn attention_with(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    n_head: usize,
    mask: &Tensor,
    softmax: &dyn Fn(&Tensor) -> candle_core::Result<Tensor>,
) -> candle_core::Result<Tensor> {
    let t = q.dim(1)?;
    let (q, k, v) = (split_heads(q, n_head)?, split_heads(k, n_head)?, split_heads(v, n_head)?); // (B, n_head, T, d_head)
    let scale = 1.0 / (q.dim(D::Minus1)? as f64).sqrt();
    let s = (q.matmul(&k.t()?)? * scale)?; // (B, n_head, T, T): the matrix later stages never write
    let mask = if mask.dim(0)? == t { mask.clone() } else { causal_mask(t, q.device())? };
    let p = softmax(&s.broadcast_add(&mask)?)?;
    merge_heads(&p.matmul(&v)?) // (B, n_head, T, d_head) → (B, T, C)
}
