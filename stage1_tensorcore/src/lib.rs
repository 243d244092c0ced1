//! # Stage 1 — tensor cores: TF32, bf16/f16 mixed precision
//!
//! **What changed.** The matrix multiplications run in a tensor-core format; everything else
//! is stage 0. `precision::choose` picks it per device (bf16 on SM 8.0+, f16 on SM 7.x, fp32
//! where there are no tensor cores — including every CPU); `--precision` overrides.
//!
//! **The mixed-precision rule (as PyTorch's autocast).** Weights are cast once, in `build`.
//! GEMM operands and outputs are bf16/f16, accumulated in f32 inside the tensor core. Three
//! things stay f32: LayerNorm statistics (a mean and variance over C values need more than
//! bf16's 8 significant bits), softmax (exp of scores needs range, and its sum accumulates
//! error), and the residual stream x (it is summed into at every block; rounding it to bf16
//! each time would compound). TF32 keeps f32 storage and only rounds GEMM inputs to 10
//! mantissa bits inside the tensor core (candle's `set_gemm_reduced_precision_f32`); the
//! switches are set deliberately per precision in `precision::switches`.
//!
//! **Why it is faster on the hardware.** Tensor cores do a small matrix product per
//! instruction: on an H100 SXM, dense bf16 peaks at ~989 TFLOP/s and TF32 at ~495, against
//! ~67 for fp32 on the CUDA cores — about 7x from TF32 on large fp32 GEMMs, ~15x from bf16 —
//! and bf16 halves the bytes every GEMM reads. The GEMMs are ~95% of this block's FLOPs at
//! GPT-2 sizes, but stage 0's memory-bound element-wise ops are untouched, so the block gains
//! less than the GEMMs do.
//!
//! **What it costs.** TF32: ~1e-3 relative error. bf16: ~3e-3–1e-2 (7 mantissa bits); f16:
//! less error but 5 exponent bits. On a CPU there are no tensor cores: bf16/f16 run (so the
//! numerics can be studied anywhere) but every GEMM converts its operands, so it is *slower*.
//!
//! **Run it.** `cargo run --release -p stage1_tensorcore` (CPU: fp32, says why) ·
//! `cargo run --release -p stage1_tensorcore -- --precision bf16` (CPU, bf16 numerics) ·
//! `cargo run --release --features cuda -p stage1_tensorcore -- --device cuda` (GPU, auto).

pub mod precision;

use candle_core::{DType, Tensor};
use shared::breakdown::part;
use shared::device::{DeviceInfo, GemmSwitches};
use shared::stage::PrecisionChoice;
use shared::{BlockWeights, Plan, PrecisionRequest, SpeedkitError, Stage};
use stage0_baseline::{causal_mask, gelu_tanh, layer_norm, linear, merge_heads, softmax, split_heads};

pub struct Block {
    ln1_g: Tensor,  // (C) f32
    ln1_b: Tensor,  // (C) f32
    w_q: Tensor,    // (C, C) GEMM dtype
    b_q: Tensor,    // (C) GEMM dtype
    w_k: Tensor,    // (C, C)
    b_k: Tensor,    // (C)
    w_v: Tensor,    // (C, C)
    b_v: Tensor,    // (C)
    w_proj: Tensor, // (C, C)
    b_proj: Tensor, // (C)
    ln2_g: Tensor,  // (C) f32
    ln2_b: Tensor,  // (C) f32
    w_fc1: Tensor,  // (FF, C)
    b_fc1: Tensor,  // (FF)
    w_fc2: Tensor,  // (C, FF)
    b_fc2: Tensor,  // (C)
    n_head: usize,
    mask: Tensor, // (T, T) f32: 0 on and below the diagonal, -inf above
    dtype: DType, // GEMM operand dtype: bf16, f16, or f32 (fp32 and TF32)
}

impl Stage for Block {
    const NAME: &'static str = "stage1_tensorcore";
    const TECHNIQUE: &'static str = "GEMMs on tensor cores: TF32 or bf16/f16, f32 LN/softmax/residual";

    fn choose_precision(info: &DeviceInfo, requested: PrecisionRequest) -> Result<PrecisionChoice, SpeedkitError> {
        precision::choose(info, requested)
    }

    fn switches(plan: &Plan) -> GemmSwitches {
        precision::switches(plan.precision)
    }

    fn notes(plan: &Plan) -> Vec<String> {
        let advice = precision::alignment_advice(&plan.shape, plan.precision);
        let on = if plan.info.is_cuda() { "" } else { "on a GPU, " };
        advice.into_iter().map(|a| format!("{on}{a}")).collect()
    }

    fn build(w: &BlockWeights, plan: &Plan) -> anyhow::Result<Self> {
        Self::switches(plan).apply();
        let c = plan.shape.d_model;
        let dt = precision::gemm_dtype(plan.precision);
        // Three separate projections, as in stage 0; cast once here, never per forward.
        let rows = |i: usize| w.w_qkv.narrow(0, i * c, c).and_then(|t| t.to_dtype(dt)?.contiguous()); // (C, C)
        let bias = |i: usize| w.b_qkv.narrow(0, i * c, c).and_then(|t| t.to_dtype(dt)?.contiguous()); // (C)
        Ok(Block {
            ln1_g: w.ln1_g.clone(),
            ln1_b: w.ln1_b.clone(),
            w_q: rows(0)?,
            b_q: bias(0)?,
            w_k: rows(1)?,
            b_k: bias(1)?,
            w_v: rows(2)?,
            b_v: bias(2)?,
            w_proj: w.w_proj.to_dtype(dt)?,
            b_proj: w.b_proj.to_dtype(dt)?,
            ln2_g: w.ln2_g.clone(),
            ln2_b: w.ln2_b.clone(),
            w_fc1: w.w_fc1.to_dtype(dt)?,
            b_fc1: w.b_fc1.to_dtype(dt)?,
            w_fc2: w.w_fc2.to_dtype(dt)?,
            b_fc2: w.b_fc2.to_dtype(dt)?,
            n_head: plan.shape.n_head,
            mask: causal_mask(plan.shape.seq, &plan.device)?,
            dtype: dt,
        })
    }

    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        part("ln1")?; // a no-op unless --breakdown is recording (shared::breakdown)
        let h = layer_norm(x, &self.ln1_g, &self.ln1_b)?.to_dtype(self.dtype)?; // (B, T, C): f32 statistics, GEMM dtype out
        part("qkv")?;
        let q = linear(&h, &self.w_q, &self.b_q)?; // (B, T, C)
        let k = linear(&h, &self.w_k, &self.b_k)?;
        let v = linear(&h, &self.w_v, &self.b_v)?;
        part("attention")?;
        let a = attention(&q, &k, &v, self.n_head, &self.mask)?; // (B, T, C)
        part("proj+residual")?;
        let x = (x + linear(&a, &self.w_proj, &self.b_proj)?.to_dtype(DType::F32)?)?; // residual stream stays f32
        part("ln2")?;
        let h = layer_norm(&x, &self.ln2_g, &self.ln2_b)?.to_dtype(self.dtype)?;
        part("fc1+gelu")?;
        let m = gelu_tanh(&linear(&h, &self.w_fc1, &self.b_fc1)?)?; // (B, T, FF)
        part("fc2+residual")?;
        x + linear(&m, &self.w_fc2, &self.b_fc2)?.to_dtype(DType::F32)?
    }
}

/// Causal self-attention over the full score matrix, mixed precision: q kᵀ and p v run on
/// tensor cores in the GEMM dtype; the scores are widened to f32 for the mask and softmax.
/// q, k, v: (B, T, C) in the GEMM dtype; `mask` (T, T) f32. Returns (B, T, C), GEMM dtype.
pub fn attention(q: &Tensor, k: &Tensor, v: &Tensor, n_head: usize, mask: &Tensor) -> candle_core::Result<Tensor> {
    let t = q.dim(1)?;
    let (q, k, v) = (split_heads(q, n_head)?, split_heads(k, n_head)?, split_heads(v, n_head)?); // (B, n_head, T, d_head)
    let scale = 1.0 / (q.dim(candle_core::D::Minus1)? as f64).sqrt();
    let s = (q.matmul(&k.t()?)?.to_dtype(DType::F32)? * scale)?; // (B, n_head, T, T) f32: exp needs the range
    let mask = if mask.dim(0)? == t { mask.clone() } else { causal_mask(t, q.device())? };
    let p = softmax(&s.broadcast_add(&mask)?)?.to_dtype(v.dtype())?; // probabilities in [0, 1]: bf16 holds them
    merge_heads(&p.matmul(&v)?) // (B, n_head, T, d_head) → (B, T, C)
}
