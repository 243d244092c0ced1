//! Stage 3's training step on the CPU with its backward scheduled by hand, as llm.c writes one:
//! the forward runs the fused ops untracked and keeps what their backwards need; the backward
//! calls those backwards (`backward.rs`) in reverse order and hands each gradient straight to the
//! next.
//!
//! Through candle's autograd the same kernels ran, but every gradient crossed candle's
//! `GradStore`: for each input of each op a zero tensor of its size, then an add into it (three
//! passes over every activation's gradient, 24 MiB for fc2's input at `small`); the loss
//! ⟨y, r⟩ was a multiply, a sum and a broadcast back; each residual add split its gradient in
//! two, added again later. Here dL/dy = r is the backward's input as it is, the residual stream's
//! gradient is added inside the LayerNorm backward's own pass (`layer_norm_bwd_plus`), and each
//! gradient is written once.
//!
//! Used for stage 3's CPU training step with every fusion on (`Block::train_forward`); the
//! numbers are the tape's kernels' (test: `tests/train.rs`, against candle's autograd of the same
//! block). `shared::breakdown::backward_part_done` stamps each part's end, so `--breakdown`
//! times the same parts as on the tape.

use crate::backward::{bias_bwd, bias_gelu_bwd, layer_norm_bwd_plus, linear_bwd_f32 as linear_bwd};
use crate::ops::{self, Epilogue, LN_EPS};
use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor};
use shared::breakdown::{backward_part_done, enter};
use shared::TrainPass;
use stage2_sdpa::attention::CpuKernel;
use std::sync::Mutex;

/// The block's twelve weights as the stage was built from them (the `Var`s' tensors: the keys of
/// their gradients), in `BlockWeights` order, paired per layer: (g, b) of a LayerNorm, (W, b) of
/// a linear.
pub(crate) struct Weights {
    pub ln1: [Tensor; 2],
    pub qkv: [Tensor; 2],
    pub proj: [Tensor; 2],
    pub ln2: [Tensor; 2],
    pub fc1: [Tensor; 2],
    pub fc2: [Tensor; 2],
}

/// How the block's kernels run: heads, attention's CPU kernel, and whether the linears' products
/// are bf16 on f32 masters (`PackedWeight::bf16_master`).
#[derive(Clone, Copy)]
pub(crate) struct Config {
    pub n_head: usize,
    pub kernel: CpuKernel,
    pub bf16_products: bool,
}

/// What the backward reads: the forward's input, every activation a backward needs, and attention's
/// log-sum-exp and fc1's pre-activation.
struct Saved {
    x: Tensor,
    h1: Tensor,
    qkv: Tensor,
    lse: Option<Vec<f32>>,
    a: Tensor,
    x2: Tensor,
    h2: Tensor,
    pre_gelu: Vec<f32>, // fc1's x·Wᵀ, before the bias
    m: Tensor,          // fc1's output, fc2's input
}

/// One training forward, ready for its backward (taken once).
pub struct ScheduledPass {
    y: Tensor,
    weights: Weights,
    config: Config,
    saved: Mutex<Option<Saved>>,
}

/// The block's forward on x (B, T, C) f32, untracked, as `Block::forward` computes it on the CPU
/// with f32 activations, except fc1's output: bf16 with bf16 products (`ops::master_linear`), the
/// values fc2's GEMMs would round it to. Each part is entered as the tape's forward enters it
/// (`--breakdown`, and the row's notes).
pub(crate) fn forward(x: &Tensor, weights: Weights, config: Config) -> candle_core::Result<ScheduledPass> {
    let plain = |t: &Tensor| t.detach(); // untracked: the ops take their no-backward paths
    let w = &weights;
    let bf16 = config.bf16_products;
    let linear = |x: &Tensor, [w, b]: &[Tensor; 2], e: Epilogue| ops::linear_master(x, &plain(w), &plain(b), e, bf16);
    let [xd] = enter("ln1", [&plain(x).contiguous()?])?;
    let h1 = ops::layer_norm(&xd, &plain(&w.ln1[0]), &plain(&w.ln1[1]), LN_EPS, DType::F32)?;
    let [h1] = enter("qkv", [&h1])?;
    let qkv = linear(&h1, &w.qkv, Epilogue::Bias)?; // (B, T, 3C)
    let [qkv] = enter("attention", [&qkv])?;
    let (a, lse) = ops::qkv_attention_keeping(&qkv, config.n_head, config.kernel, true)?;
    let [a] = enter("proj+residual+ln2", [&a])?;
    let p = linear(&a, &w.proj, Epilogue::Bias)?;
    let (x2, h2) = ops::add_layer_norm(&xd, &p, &plain(&w.ln2[0]), &plain(&w.ln2[1]), LN_EPS)?;
    let [h2] = enter("fc1+gelu", [&h2])?;
    let (m, pre_gelu) = ops::linear_bias_gelu_keeping(&h2, &plain(&w.fc1[0]), &plain(&w.fc1[1]), bf16)?;
    let [m] = enter("fc2+residual", [&m])?;
    let y = ops::linear_bias_residual_master(&m, &plain(&w.fc2[0]), &plain(&w.fc2[1]), &x2, bf16)?; // x2 + m W₂ᵀ + b₂
    let saved = Saved { x: x.clone(), h1, qkv, lse, a, x2, h2, pre_gelu, m };
    Ok(ScheduledPass { y, weights, config, saved: Mutex::new(Some(saved)) })
}

impl TrainPass for ScheduledPass {
    fn output(&self) -> &Tensor {
        &self.y
    }

    /// The parts' backwards in reverse order, each gradient handed straight on. dy: (B, T, C).
    fn backward(&self, dy: &Tensor) -> candle_core::Result<GradStore> {
        let s = self.saved.lock().map_err(|_| candle_core::Error::Msg("scheduled step: poisoned lock".into()))?.take();
        let s = s.ok_or_else(|| candle_core::Error::Msg("scheduled step: this forward's backward already ran".into()))?;
        if dy.dims() != self.y.dims() {
            candle_core::bail!("scheduled step: dy {:?} is not y's shape {:?}", dy.dims(), self.y.dims());
        }
        let (w, bf16, device) = (&self.weights, self.config.bf16_products, dy.device());
        let dy = dy.to_dtype(DType::F32)?.contiguous()?;
        let mut grads = GradStore::default();
        let mut put = |key: &Tensor, g: Tensor| {
            grads.insert(key, g);
        };

        // fc2+residual: y = x2 + m W₂ᵀ + b₂. dy reaches x2 as it is (added in ln2's backward).
        let (dz2, db2) = bias_bwd(&dy)?;
        let (dm, dw2) = linear_bwd(&s.m, &w.fc2[0], &dz2, bf16)?;
        put(&w.fc2[0], dw2);
        put(&w.fc2[1], db2);
        backward_part_done("fc2+residual", device)?;

        // fc1+gelu: m = gelu(h2 W₁ᵀ + b₁), from the kept pre-activation.
        let (dz1, db1) = bias_gelu_bwd(&dm, Some(&s.pre_gelu), &s.h2, &w.fc1[0], &w.fc1[1])?;
        drop(dm);
        let (dh2, dw1) = linear_bwd(&s.h2, &w.fc1[0], &dz1, bf16)?;
        drop(dz1);
        put(&w.fc1[0], dw1);
        put(&w.fc1[1], db1);
        backward_part_done("fc1+gelu", device)?;

        // proj+residual+ln2: x2 = x + a W_projᵀ + b_proj, h2 = LN(x2); x2's gradient is LN's
        // backward plus dy (the residual), in one pass.
        let [dx2, dg2, db2_ln] = layer_norm_bwd_plus(&s.x2, &w.ln2[0], &dh2, LN_EPS, Some(&dy))?;
        let (dp, db_proj) = bias_bwd(&dx2)?;
        let (da, dw_proj) = linear_bwd(&s.a, &w.proj[0], &dp, bf16)?;
        put(&w.ln2[0], dg2);
        put(&w.ln2[1], db2_ln);
        put(&w.proj[0], dw_proj);
        put(&w.proj[1], db_proj);
        backward_part_done("proj+residual+ln2", device)?;

        // attention: FlashAttention-2's backward from the kept log-sum-exp, dq, dk, dv in one
        // (B, T, 3C) tensor.
        let dqkv = ops::qkv_attention_bwd(&s.qkv, &s.a, &da, s.lse.as_deref(), self.config.n_head, self.config.kernel, true)?;
        backward_part_done("attention", device)?;

        // qkv
        let (dz_qkv, db_qkv) = bias_bwd(&dqkv)?;
        let (dh1, dw_qkv) = linear_bwd(&s.h1, &w.qkv[0], &dz_qkv, bf16)?;
        put(&w.qkv[0], dw_qkv);
        put(&w.qkv[1], db_qkv);
        backward_part_done("qkv", device)?;

        // ln1: x feeds LN 1 and the residual stream, whose gradient is dx2.
        let [dx, dg1, db1_ln] = layer_norm_bwd_plus(&s.x, &w.ln1[0], &dh1, LN_EPS, Some(&dx2))?;
        put(&w.ln1[0], dg1);
        put(&w.ln1[1], db1_ln);
        put(&s.x, dx);
        backward_part_done("ln1", device)?;
        Ok(grads)
    }
}
