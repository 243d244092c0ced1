//! Stage 0's block: the weights as the baseline holds them, and the forward, every op from
//! `crate`'s primitives — on a CPU each element-wise one a pass of the engine
//! (`cpu_kernels::elementwise`, multi-threaded and vectorised, one pass per op), its GEMMs
//! candle's f32 matmul.

use crate::{attention_with, causal_mask, Baseline};
use candle_core::Tensor;
use cpu_kernels::bf16_gemm::PackedWeight;
use cpu_kernels::elementwise::{self as ew, gelu_tanh, layer_norm, linear, Elementwise, LN_EPS};
use shared::breakdown::enter;
use shared::{BlockWeights, Forward, Plan, Stage};

pub struct Block {
    ln1_g: Tensor,        // (C)
    ln1_b: Tensor,        // (C)
    w_q: PackedWeight,    // (C, C) f32
    b_q: Tensor,          // (C)
    w_k: PackedWeight,    // (C, C)
    b_k: Tensor,          // (C)
    w_v: PackedWeight,    // (C, C)
    b_v: Tensor,          // (C)
    w_proj: PackedWeight, // (C, C)
    b_proj: Tensor,       // (C)
    ln2_g: Tensor,        // (C)
    ln2_b: Tensor,        // (C)
    w_fc1: PackedWeight,  // (FF, C)
    b_fc1: Tensor,        // (FF)
    w_fc2: PackedWeight,  // (C, FF)
    b_fc2: Tensor,        // (C)
    n_head: usize,
    mask: Tensor,    // (T, T): 0 on and below the diagonal, -inf above
    ew: Elementwise, // the engine's passes, or candle's ops (`--elementwise`)
}

impl Block {
    pub fn build(w: &BlockWeights, plan: &Plan, ew: Elementwise) -> anyhow::Result<Block> {
        Baseline.switches(plan).apply();
        let c = plan.shape.d_model;
        // Three separate projections, as a first implementation would write them.
        let pack = |t: &Tensor| PackedWeight::new(&t.contiguous()?); // f32: held as it is, candle's matmul runs it
        let rows = |i: usize| w.w_qkv.narrow(0, i * c, c).and_then(|t| pack(&t)); // (C, C)
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
            w_proj: pack(&w.w_proj)?,
            b_proj: w.b_proj.clone(),
            ln2_g: w.ln2_g.clone(),
            ln2_b: w.ln2_b.clone(),
            w_fc1: pack(&w.w_fc1)?,
            b_fc1: w.b_fc1.clone(),
            w_fc2: pack(&w.w_fc2)?,
            b_fc2: w.b_fc2.clone(),
            n_head: plan.shape.n_head,
            mask: causal_mask(plan.shape.seq, &plan.device)?,
            ew,
        })
    }

    /// Causal self-attention over the full (B, n_head, T, T) score matrix (`crate::attention`),
    /// its softmax the engine's passes.
    fn attention(&self, q: &Tensor, k: &Tensor, v: &Tensor) -> candle_core::Result<Tensor> {
        cpu_kernels::trace::ran("attention: materialised scores (scale and mask: candle ops)");
        let softmax = |s: &Tensor| ew::softmax_last_dim(s, self.ew);
        attention_with(q, k, v, self.n_head, &self.mask, &softmax) // (B, T, C)
    }
}

impl Forward for Block {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let e = self.ew;
        let [x] = enter("ln1", [x])?; // a no-op unless --breakdown is recording (shared::breakdown)
        let h = layer_norm(&x, &self.ln1_g, &self.ln1_b, LN_EPS, e)?; // (B, T, C)
        let [h] = enter("qkv", [&h])?;
        let q = linear(&h, &self.w_q, &self.b_q, e)?; // (B, T, C)
        let k = linear(&h, &self.w_k, &self.b_k, e)?;
        let v = linear(&h, &self.w_v, &self.b_v, e)?;
        let [q, k, v] = enter("attention", [&q, &k, &v])?;
        let a = self.attention(&q, &k, &v)?; // (B, T, C)
        let [a] = enter("proj+residual", [&a])?;
        let x = ew::add(&x, &linear(&a, &self.w_proj, &self.b_proj, e)?, e)?;
        let [x] = enter("ln2", [&x])?;
        let h = layer_norm(&x, &self.ln2_g, &self.ln2_b, LN_EPS, e)?;
        let [h] = enter("fc1+gelu", [&h])?;
        let m = gelu_tanh(&linear(&h, &self.w_fc1, &self.b_fc1, e)?, e)?; // (B, T, FF)
        let [m] = enter("fc2+residual", [&m])?;
        ew::add(&x, &linear(&m, &self.w_fc2, &self.b_fc2, e)?, e)
    }
}
