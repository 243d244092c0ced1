//! Stage 1's block: stage 0's forward with the GEMMs in the precision policy's dtype.

use crate::{attention_in, precision};
use candle_core::{DType, Tensor};
use cpu_kernels::bf16_gemm::PackedWeight;
use cpu_kernels::elementwise::{self as ew, gelu_tanh, layer_norm, linear, Elementwise, LN_EPS};
use shared::breakdown::enter;
use shared::{BlockWeights, Forward, Plan};
use stage0_baseline::causal_mask;

pub struct Block {
    ln1_g: Tensor,        // (C) f32
    ln1_b: Tensor,        // (C) f32
    w_q: PackedWeight,    // (C, C) GEMM dtype; on a CPU's bf16 unit Wᵀ packed once, here (`bf16_gemm::PackedWeight`)
    b_q: Tensor,          // (C) GEMM dtype
    w_k: PackedWeight,    // (C, C)
    b_k: Tensor,          // (C)
    w_v: PackedWeight,    // (C, C)
    b_v: Tensor,          // (C)
    w_proj: PackedWeight, // (C, C)
    b_proj: Tensor,       // (C)
    ln2_g: Tensor,        // (C) f32
    ln2_b: Tensor,        // (C) f32
    w_fc1: PackedWeight,  // (FF, C)
    b_fc1: Tensor,        // (FF)
    w_fc2: PackedWeight,  // (C, FF)
    b_fc2: Tensor,        // (C)
    n_head: usize,
    mask: Tensor,    // (T, T) f32: 0 on and below the diagonal, -inf above
    dtype: DType,    // GEMM operand dtype: bf16, f16, or f32 (fp32 and TF32)
    act: DType,      // activations: the GEMM dtype (f32 in a training step on the CPU, `precision::activation_dtype`)
    ew: Elementwise, // the engine's passes, or candle's ops (`--elementwise`)
}

impl Block {
    pub fn build(w: &BlockWeights, plan: &Plan, ew: Elementwise) -> anyhow::Result<Block> {
        precision::switches(plan.precision).apply();
        let c = plan.shape.d_model;
        let (dt, act) = (precision::gemm_dtype(plan.precision), precision::activation_dtype(plan));
        // Three separate projections, as in stage 0; cast once here, never per forward, and on a
        // CPU's bf16 unit packed once into the GEMM's pair panels (build is outside the timing).
        let pack = |t: &Tensor| precision::weight(t, plan);
        let rows = |i: usize| w.w_qkv.narrow(0, i * c, c).and_then(|t| pack(&t)); // (C, C)
        let bias = |i: usize| w.b_qkv.narrow(0, i * c, c).and_then(|t| t.to_dtype(act)?.contiguous()); // (C): added to the GEMM's output
        Ok(Block {
            ln1_g: w.ln1_g.clone(),
            ln1_b: w.ln1_b.clone(),
            w_q: rows(0)?,
            b_q: bias(0)?,
            w_k: rows(1)?,
            b_k: bias(1)?,
            w_v: rows(2)?,
            b_v: bias(2)?,
            w_proj: pack(&w.w_proj)?,
            b_proj: w.b_proj.to_dtype(act)?,
            ln2_g: w.ln2_g.clone(),
            ln2_b: w.ln2_b.clone(),
            w_fc1: pack(&w.w_fc1)?,
            b_fc1: w.b_fc1.to_dtype(act)?,
            w_fc2: pack(&w.w_fc2)?,
            b_fc2: w.b_fc2.to_dtype(act)?,
            n_head: plan.shape.n_head,
            mask: causal_mask(plan.shape.seq, &plan.device)?,
            dtype: dt,
            act,
            ew,
        })
    }

    /// Causal self-attention over the full (B, n_head, T, T) score matrix, its two products in
    /// the GEMM dtype (`crate::attention_in`), its softmax the engine's passes.
    fn attention(&self, q: &Tensor, k: &Tensor, v: &Tensor) -> candle_core::Result<Tensor> {
        cpu_kernels::trace::ran("attention: materialised scores (scale and mask: candle ops)");
        let softmax = |s: &Tensor| ew::softmax_last_dim(s, self.ew);
        attention_in(q, k, v, self.n_head, &self.mask, self.dtype, &softmax) // (B, T, C)
    }
}

impl Forward for Block {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let e = self.ew;
        let [x] = enter("ln1", [x])?; // a no-op unless --breakdown is recording (shared::breakdown)
        let h = ew::to_dtype(&layer_norm(&x, &self.ln1_g, &self.ln1_b, LN_EPS, e)?, self.act, e)?; // (B, T, C): f32 statistics, GEMM dtype out
        let [h] = enter("qkv", [&h])?;
        let q = linear(&h, &self.w_q, &self.b_q, e)?; // (B, T, C)
        let k = linear(&h, &self.w_k, &self.b_k, e)?;
        let v = linear(&h, &self.w_v, &self.b_v, e)?;
        let [q, k, v] = enter("attention", [&q, &k, &v])?;
        let a = self.attention(&q, &k, &v)?; // (B, T, C)
        let [a] = enter("proj+residual", [&a])?;
        let x = ew::add(&x, &ew::to_dtype(&linear(&a, &self.w_proj, &self.b_proj, e)?, DType::F32, e)?, e)?; // residual stream stays f32
        let [x] = enter("ln2", [&x])?;
        let h = ew::to_dtype(&layer_norm(&x, &self.ln2_g, &self.ln2_b, LN_EPS, e)?, self.act, e)?;
        let [h] = enter("fc1+gelu", [&h])?;
        let m = gelu_tanh(&linear(&h, &self.w_fc1, &self.b_fc1, e)?, e)?; // (B, T, FF)
        let [m] = enter("fc2+residual", [&m])?;
        ew::add(&x, &ew::to_dtype(&linear(&m, &self.w_fc2, &self.b_fc2, e)?, DType::F32, e)?, e)
    }
}
