//! # Stage 2 — fused attention (scaled dot-product attention in one kernel)
//!
//! **What changed.** Attention becomes one fused operation, `attention::attention`, that never
//! writes the (B, n_head, T, T) score matrix to memory; everything else is stage 1 (same
//! precision policy, same GEMMs, same LayerNorm). q, k and v stay in the (B, T, n_head, d_head)
//! layout the projections produce, so the head split and merge copies disappear too.
//!
//! **Why it is faster on the hardware.** Stages 0–1 write the scores, read them back for the
//! mask, the max, the exponentials, the sum and the division, and write the probabilities:
//! O(B·n_head·T²) bytes several times over — at T = 2048 on `small` that is 200 M floats
//! (800 MB) per pass, far more than the weights. The fused kernel keeps each tile of scores in
//! registers/cache and rescales a running result as it goes (FlashAttention's online softmax),
//! so attention moves O(B·T·C) bytes: q, k, v once in, the output once out. It also skips the
//! tiles above the causal diagonal instead of computing and masking them (half the FLOPs).
//! The gain grows with T, in time and in peak memory: on a GPU expect little at T = 512 (the
//! scores are small next to the MLP's GEMMs) and a clear win from T ≈ 2048 up; the recorded CPU
//! run already shows a gain at T = 512 (README's results give the number, from its JSON).
//!
//! **What it costs.** Nothing in accuracy: the same softmax, in f32, summed in another order
//! (relative error ~1e-7 against stage 1 at fp32). The CPU runs our kernel at any precision;
//! on CUDA our FlashAttention-2 kernel (`kernels/flash_attn_v2.cu`, tensor cores; v1,
//! `kernels/flash_attn.cu`, with `--attention-kernel v1`) takes bf16/f16
//! on SM 8.0+ with d_head 32, 64 or 128 — or, built with the `flash-attn` feature,
//! candle-flash-attn does (d_head any multiple of 8 up to 512).
//!
//! **Run it.** `cargo run --release -p stage2_sdpa` (CPU) ·
//! `cargo run --release -p ladder -- --seq 2048` (stages side by side where it pays) ·
//! `cargo run --release --features cuda -p stage2_sdpa -- --device cuda` (GPU).

pub mod attention;
pub mod attention_cuda;
pub mod cubin;
pub mod elementwise;
pub mod harness;

pub use attention::{attention, attention_with};

use candle_core::{DType, Tensor};
use shared::breakdown::part;
use shared::device::{DeviceInfo, GemmSwitches};
use shared::stage::PrecisionChoice;
use shared::Shape;
use shared::{BlockWeights, Plan, PrecisionRequest, SpeedkitError, Stage};
// Element-wise ops: stage 0's primitives, one pass each, as stages 0–1 run them (candle's ops),
// so this stage differs from stage 1 in its attention only. `--elementwise parallel` runs the
// same passes multi-threaded and vectorised on the CPU (`shared::elementwise`), to measure what
// threading alone buys; stage 3 then fuses them.
use crate::elementwise::{self as ew, gelu_tanh, layer_norm, linear, Elementwise, LN_EPS};
use stage1_tensorcore::precision;

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
    dtype: DType,                    // GEMM operand dtype: bf16, f16, or f32 (fp32 and TF32)
    ew: Elementwise,                 // --elementwise
    copies: bool,                    // ablation only (`ladder --ablate`): keep stages 0-1's head split/merge copies
    attn: attention::Implementation, // which attention kernel runs (`--attention-kernel` on CUDA)
}

impl Stage for Block {
    const NAME: &'static str = "stage2_sdpa";
    const TECHNIQUE: &'static str = "fused attention: online softmax, no T x T matrix in memory";

    fn choose_precision(info: &DeviceInfo, requested: PrecisionRequest) -> Result<PrecisionChoice, SpeedkitError> {
        let (p, why) = precision::choose(info, requested)?;
        harness::check_device(info, p)?;
        Ok((p, why))
    }

    fn check_shape(_shape: &Shape) -> Result<(), SpeedkitError> {
        Ok(()) // no (B, n_head, T, T) tensor exists, so no limit on it
    }

    fn estimate_bytes(shape: &Shape) -> u128 {
        harness::estimate_fused_bytes(shape)
    }

    fn switches(plan: &Plan) -> GemmSwitches {
        precision::switches(plan.precision)
    }

    fn notes(plan: &Plan) -> Vec<String> {
        let mut notes = stage1_tensorcore::Block::notes(plan); // alignment advice
        notes.push(format!("attention: {}", attention_of(plan).description()));
        notes
    }

    fn implementation(plan: &Plan) -> Option<String> {
        let imp = attention_of(plan).name();
        Some(if plan.options.attention_copies { format!("{imp}, head split/merge copies kept") } else { imp.into() })
    }

    fn build(w: &BlockWeights, plan: &Plan) -> anyhow::Result<Self> {
        Self::switches(plan).apply();
        attention::check_head_size(&plan.device, plan.shape.d_head()).map_err(SpeedkitError::usage)?;
        let attn = harness::for_run(&plan.device, plan.options.attention_kernel)?;
        let c = plan.shape.d_model;
        let dt = precision::gemm_dtype(plan.precision);
        // Three separate projections, as in stages 0 and 1 (stage 3 fuses them).
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
            dtype: dt,
            ew: plan.options.elementwise.into(),
            copies: plan.options.attention_copies,
            attn,
        })
    }

    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let (b, t, c) = x.dims3()?;
        let heads = (b, t, self.n_head, c / self.n_head); // (B, T, n_head, d_head): a view of (B, T, C), no copy
        let e = self.ew;
        part("ln1")?; // a no-op unless --breakdown is recording (shared::breakdown)
        let h = ew::to_dtype(&layer_norm(x, &self.ln1_g, &self.ln1_b, LN_EPS, e)?, self.dtype, e)?; // (B, T, C): f32 statistics, GEMM dtype out
        part("qkv")?;
        let q = linear(&h, &self.w_q, &self.b_q, e)?.reshape(heads)?; // (B, T, n_head, d_head)
        let k = linear(&h, &self.w_k, &self.b_k, e)?.reshape(heads)?;
        let v = linear(&h, &self.w_v, &self.b_v, e)?.reshape(heads)?;
        part("attention")?;
        let a = if self.copies { attention_with_copies(self.attn, &q, &k, &v)? } else { attention_with(self.attn, &q, &k, &v, true)? }
            .reshape((b, t, c))?; // (B, T, C)
        part("proj+residual")?;
        let x = ew::add(x, &ew::to_dtype(&linear(&a, &self.w_proj, &self.b_proj, e)?, DType::F32, e)?, e)?; // residual stream stays f32
        part("ln2")?;
        let h = ew::to_dtype(&layer_norm(&x, &self.ln2_g, &self.ln2_b, LN_EPS, e)?, self.dtype, e)?;
        part("fc1+gelu")?;
        let m = gelu_tanh(&linear(&h, &self.w_fc1, &self.b_fc1, e)?, e)?; // (B, T, FF)
        part("fc2+residual")?;
        ew::add(&x, &ew::to_dtype(&linear(&m, &self.w_fc2, &self.b_fc2, e)?, DType::F32, e)?, e)
    }
}

/// The ablation of this stage's second change (`ladder --ablate`): the fused kernel, with the
/// head split and merge copies of stages 0-1 kept, so the table shows the kernel's gain and the
/// copies' apart. q, k, v: (B, T, n_head, d_head) views of the projections' (B, T, C) outputs.
/// Each is copied into (B, n_head, T, d_head) as `split_heads` does; the CPU kernel reads
/// (B, T, n_head, d_head) rows and copies it back (so on the CPU each input pays two copies,
/// an upper bound on stage 1's one; the CUDA kernel reads the head-major view in place). The
/// output is copied out to (B, n_head, T, d_head), as stage 1's attention returns it, and back
/// into (B, T, C) rows, as `merge_heads` does.
pub fn attention_with_copies(imp: attention::Implementation, q: &Tensor, k: &Tensor, v: &Tensor) -> candle_core::Result<Tensor> {
    let split = |t: &Tensor| t.transpose(1, 2)?.contiguous()?.transpose(1, 2); // copy to (B, n_head, T, d_head), viewed back
    let a = attention_with(imp, &split(q)?, &split(k)?, &split(v)?, true)?; // (B, T, n_head, d_head)
    a.transpose(1, 2)?.contiguous()?.transpose(1, 2)?.contiguous() // the merge: (B, n_head, T, d_head) copy, then (B, T, n_head, d_head) rows
}

/// The attention implementation a run of this plan uses, for its label and notes (`build`
/// refuses a `--attention-kernel` this device cannot honour; the label then shows the default).
pub fn attention_of(plan: &Plan) -> attention::Implementation {
    harness::for_run(&plan.device, plan.options.attention_kernel).unwrap_or(attention::Implementation::on(&plan.device))
}
