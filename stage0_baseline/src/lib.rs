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
//! **What to expect.** The reference speed every later stage is measured against, and the
//! reference output every stage is checked against (relative error 0 by construction).
//!
//! **Run it.** `cargo run --release -p stage0_baseline` (CPU, `small` preset) ·
//! `cargo run --release --features cuda -p stage0_baseline -- --device cuda` (GPU).

use candle_core::{Tensor, D};
use shared::breakdown::part;
use shared::device::{DeviceInfo, GemmSwitches};
use shared::stage::PrecisionChoice;
use shared::{BlockWeights, Plan, Precision, PrecisionRequest, SpeedkitError, Stage};

const LN_EPS: f64 = 1e-5;

pub struct Block {
    ln1_g: Tensor,  // (C)
    ln1_b: Tensor,  // (C)
    w_q: Tensor,    // (C, C)
    b_q: Tensor,    // (C)
    w_k: Tensor,    // (C, C)
    b_k: Tensor,    // (C)
    w_v: Tensor,    // (C, C)
    b_v: Tensor,    // (C)
    w_proj: Tensor, // (C, C)
    b_proj: Tensor, // (C)
    ln2_g: Tensor,  // (C)
    ln2_b: Tensor,  // (C)
    w_fc1: Tensor,  // (FF, C)
    b_fc1: Tensor,  // (FF)
    w_fc2: Tensor,  // (C, FF)
    b_fc2: Tensor,  // (C)
    n_head: usize,
    mask: Tensor, // (T, T): 0 on and below the diagonal, -inf above
}

impl Stage for Block {
    const NAME: &'static str = "stage0_baseline";
    const TECHNIQUE: &'static str = "fp32, every op spelled out, full T x T attention";
    const OWN_PRECISION: Option<Precision> = Some(Precision::Fp32);

    fn choose_precision(_info: &DeviceInfo, requested: PrecisionRequest) -> Result<PrecisionChoice, SpeedkitError> {
        match requested {
            PrecisionRequest::Auto | PrecisionRequest::Exactly(Precision::Fp32) => {
                Ok((Precision::Fp32, "the baseline is fp32 by definition (TF32 off)".into()))
            }
            PrecisionRequest::Exactly(p) => Err(SpeedkitError::usage(format!(
                "stage0_baseline runs fp32 only (it is the reference), but --precision {p} was given. \
                 Fix: drop --precision here, or run stage 1 and later, where lower precision is the technique."
            ))),
        }
    }

    fn switches(_plan: &Plan) -> GemmSwitches {
        GemmSwitches::OFF
    }

    fn build(w: &BlockWeights, plan: &Plan) -> anyhow::Result<Self> {
        Self::switches(plan).apply();
        let c = plan.shape.d_model;
        // Three separate projections, as a first implementation would write them.
        let rows = |i: usize| w.w_qkv.narrow(0, i * c, c).and_then(|t| t.contiguous()); // (C, C)
        let bias = |i: usize| w.b_qkv.narrow(0, i * c, c).and_then(|t| t.contiguous()); // (C)
        Ok(Block {
            ln1_g: w.ln1_g.clone(),
            ln1_b: w.ln1_b.clone(),
            w_q: rows(0)?,
            b_q: bias(0)?,
            w_k: rows(1)?,
            b_k: bias(1)?,
            w_v: rows(2)?,
            b_v: bias(2)?,
            w_proj: w.w_proj.clone(),
            b_proj: w.b_proj.clone(),
            ln2_g: w.ln2_g.clone(),
            ln2_b: w.ln2_b.clone(),
            w_fc1: w.w_fc1.clone(),
            b_fc1: w.b_fc1.clone(),
            w_fc2: w.w_fc2.clone(),
            b_fc2: w.b_fc2.clone(),
            n_head: plan.shape.n_head,
            mask: causal_mask(plan.shape.seq, &plan.device)?,
        })
    }

    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        part("ln1")?; // a no-op unless --breakdown is recording (shared::breakdown)
        let h = layer_norm(x, &self.ln1_g, &self.ln1_b)?; // (B, T, C)
        part("qkv")?;
        let q = linear(&h, &self.w_q, &self.b_q)?; // (B, T, C)
        let k = linear(&h, &self.w_k, &self.b_k)?;
        let v = linear(&h, &self.w_v, &self.b_v)?;
        part("attention")?;
        let a = attention(&q, &k, &v, self.n_head, &self.mask)?; // (B, T, C)
        part("proj+residual")?;
        let x = (x + linear(&a, &self.w_proj, &self.b_proj)?)?;
        part("ln2")?;
        let h = layer_norm(&x, &self.ln2_g, &self.ln2_b)?;
        part("fc1+gelu")?;
        let m = gelu_tanh(&linear(&h, &self.w_fc1, &self.b_fc1)?)?; // (B, T, FF)
        part("fc2+residual")?;
        x + linear(&m, &self.w_fc2, &self.b_fc2)?
    }
}

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
    let t = q.dim(1)?;
    let (q, k, v) = (split_heads(q, n_head)?, split_heads(k, n_head)?, split_heads(v, n_head)?); // (B, n_head, T, d_head)
    let scale = 1.0 / (q.dim(D::Minus1)? as f64).sqrt();
    let s = (q.matmul(&k.t()?)? * scale)?; // (B, n_head, T, T): the matrix later stages never write
    let mask = if mask.dim(0)? == t { mask.clone() } else { causal_mask(t, q.device())? };
    let p = softmax(&s.broadcast_add(&mask)?)?;
    merge_heads(&p.matmul(&v)?) // (B, n_head, T, d_head) → (B, T, C)
}
