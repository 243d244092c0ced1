//! # Stage 3 — kernel fusion: fewer passes over memory, fewer launches
//!
//! **What changed.** The element-wise work around the matrix multiplications is fused into
//! them or into single-pass kernels, the way a graph compiler (torch.compile, XLA) would, but
//! written out (`ops`, each op beside its slow twin); everything else is stage 2:
//! - LayerNorm in one kernel (on CUDA our two-pass `layer_norm_*` in `kernels/add_layer_norm.cu`,
//!   one pass per row on CPU), the cast included;
//! - GEMM epilogues: bias (q/k/v, proj), bias + GELU (fc1), bias + residual (fc2) applied by the
//!   GEMM before it stores (cuBLASLt on CUDA; on CPU the GEMM accumulates onto a destination
//!   that already holds bias and residual, and GELU runs on each block of rows while it is hot);
//! - horizontal fusion: q, k and v come from ONE GEMM against the (3C, C) weight;
//! - the worked example of a hand-written kernel: residual add + LayerNorm in one pass
//!   (`kernels/add_layer_norm.cu`, compiled by nvcc at build time, wrapped as a candle op).
//!
//! **Why it is faster on the hardware.** Element-wise ops do almost no arithmetic per byte, so
//! each one costs a full trip through memory (and, on a GPU, a kernel launch of a few µs).
//! Counted on paper for one block forward at bf16 on CUDA (full passes = element-wise kernels
//! that read and/or write a whole (B, T, C) or (B, T, FF) activation; GEMMs not counted):
//!
//! | part of the block          | stage 2 launches | stage 3 launches | stage 2 passes | stage 3 passes |
//! |----------------------------|------------------|------------------|----------------|----------------|
//! | LayerNorm 1 (+ cast)       | 10               | 1                | 8              | 1              |
//! | q, k, v projections        | 3 GEMM + 3 bias  | 1 GEMM           | 3              | 0              |
//! | attention                  | 1                | 1                | 0              | 0              |
//! | proj + residual + LN 2     | GEMM + 3 + 10    | GEMM + 1         | 11             | 1              |
//! | fc1 + GELU                 | GEMM + 1 + 9     | 1 GEMM           | 10             | 0              |
//! | fc2 + residual             | GEMM + 3         | GEMM + 2         | 3              | 2              |
//! | **total**                  | **46**           | **9**            | **35**         | **4**          |
//!
//! (fc2's residual stays two launches on CUDA at bf16/f16: the f32 residual stream cannot ride
//! in through cuBLASLt's C operand when C and D share the GEMM's 16-bit dtype in cudarc's
//! wrapper; at TF32 it does, with β = 1.) Expect the gain to be largest where the block is
//! memory- or launch-bound: small shapes on a GPU, and everything on a CPU, where stage 2's
//! element-wise ops run single-threaded passes over DRAM.
//!
//! **What it costs.** Nothing in accuracy — the same arithmetic in another order (LayerNorm
//! statistics in f64 on CPU, f32 on CUDA). On CUDA, stage 3 needs bf16, f16 or TF32: cudarc's
//! cuBLASLt f32 GEMM always computes in TF32, so plain fp32 is refused rather than mislabelled.
//!
//! **One change at a time.** Each of the four fusions can be switched off on its own
//! (`--fusions ln,qkv,epilogue,add-ln`, `StageOptions::fusions`); one that is off runs its slow
//! twin, the way stage 2 computes that part, and `ladder --ablate` times stage 3 with each
//! removed in turn, so the table shows what each one buys on this machine.
//!
//! **Run it.** `cargo run --release -p stage3_fused` (CPU) ·
//! `cargo run --release --features cuda -p stage3_fused -- --device cuda` (GPU).

pub mod cublaslt_model;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod device_cache;
pub mod gemm_args;
pub mod ops;

use candle_core::{DType, IndexOp, Tensor};
use ops::{add_layer_norm, layer_norm, linear_bias, linear_bias_gelu, linear_bias_residual};
use shared::breakdown::part;
use shared::device::{DeviceInfo, GemmSwitches};
use shared::stage::PrecisionChoice;
use shared::Shape;
use shared::{BlockWeights, Plan, PrecisionRequest, SpeedkitError, Stage};
use shared::{Fusions, Precision};
use stage1_tensorcore::precision;
use stage2_sdpa::attention;

pub struct Block {
    ln1_g: Tensor,  // (C) f32
    ln1_b: Tensor,  // (C) f32
    w_qkv: Tensor,  // (3C, C) GEMM dtype: q, k and v weights stacked, one GEMM
    b_qkv: Tensor,  // (3C) GEMM dtype
    w_proj: Tensor, // (C, C)
    b_proj: Tensor, // (C)
    ln2_g: Tensor,  // (C) f32
    ln2_b: Tensor,  // (C) f32
    w_fc1: Tensor,  // (FF, C)
    b_fc1: Tensor,  // (FF)
    w_fc2: Tensor,  // (C, FF)
    b_fc2: Tensor,  // (C)
    n_head: usize,
    dtype: DType,                             // GEMM operand dtype: bf16, f16, or f32 (fp32 and TF32)
    fusions: Fusions,                         // all on unless ablated (--fusions)
    split_qkv: Option<[(Tensor, Tensor); 3]>, // qkv fusion off only: (C, C) weights and (C) biases of q, k, v
    attn: attention::Implementation,          // stage 2's attention kernel (`--attention-kernel` on CUDA)
}

impl Stage for Block {
    const NAME: &'static str = "stage3_fused";
    const TECHNIQUE: &'static str = "kernel fusion: fused LayerNorm, GEMM epilogues, one QKV GEMM";

    fn choose_precision(info: &DeviceInfo, requested: PrecisionRequest) -> Result<PrecisionChoice, SpeedkitError> {
        let (p, why) = stage2_sdpa::Block::choose_precision(info, requested)?;
        if info.is_cuda() && p == Precision::Fp32 {
            return Err(SpeedkitError::usage(
                "stage 3's cuBLASLt GEMMs (through cudarc) compute f32 matrices in TF32, so stage 3 cannot run \
                 --precision fp32 on CUDA without mislabelling it. Fix: --precision tf32 (same f32 storage, TF32 \
                 tensor cores) or bf16 (the auto choice).",
            ));
        }
        Ok((p, why))
    }

    fn check_shape(_shape: &Shape) -> Result<(), SpeedkitError> {
        Ok(()) // no (B, n_head, T, T) tensor exists, so no limit on it
    }

    fn estimate_bytes(shape: &Shape) -> u128 {
        stage2_sdpa::harness::estimate_fused_bytes(shape)
    }

    fn switches(plan: &Plan) -> GemmSwitches {
        precision::switches(plan.precision)
    }

    fn notes(plan: &Plan) -> Vec<String> {
        let mut notes = stage2_sdpa::Block::notes(plan); // alignment advice, which attention runs
        if plan.options.fusions != Fusions::ALL {
            notes.push(format!("fusions on: {} (the others run their slow twins, as in stage 2)", plan.options.fusions.describe()));
        }
        notes
    }

    fn implementation(plan: &Plan) -> Option<String> {
        let attention = stage2_sdpa::Block::implementation(plan)?; // stage 2's attention
        Some(match plan.options.fusions {
            Fusions::ALL => attention,
            f => format!("{attention}, fusions {}", f.describe()),
        })
    }

    fn build(w: &BlockWeights, plan: &Plan) -> anyhow::Result<Self> {
        Self::switches(plan).apply();
        stage2_sdpa::attention::check_head_size(&plan.device, plan.shape.d_head()).map_err(SpeedkitError::usage)?;
        let attn = stage2_sdpa::harness::for_run(&plan.device, plan.options.attention_kernel)?;
        let dt = precision::gemm_dtype(plan.precision);
        let c = plan.shape.d_model;
        let split_qkv = match plan.options.fusions.qkv {
            true => None,
            false => {
                let part = |i: usize| -> candle_core::Result<(Tensor, Tensor)> {
                    let w_i = w.w_qkv.narrow(0, i * c, c)?.to_dtype(dt)?.contiguous()?; // (C, C)
                    Ok((w_i, w.b_qkv.narrow(0, i * c, c)?.to_dtype(dt)?.contiguous()?))
                    // (C)
                };
                Some([part(0)?, part(1)?, part(2)?])
            }
        };
        Ok(Block {
            ln1_g: w.ln1_g.clone(),
            ln1_b: w.ln1_b.clone(),
            w_qkv: w.w_qkv.to_dtype(dt)?, // one (3C, C) GEMM instead of three (C, C) ones
            b_qkv: w.b_qkv.to_dtype(dt)?,
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
            fusions: plan.options.fusions,
            split_qkv,
            attn,
        })
    }

    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let (b, t, c) = x.dims3()?;
        let heads = (b, t, 3, self.n_head, c / self.n_head); // (B, T, 3, n_head, d_head): a view of (B, T, 3C), no copy
        part("ln1")?; // a no-op unless --breakdown is recording (shared::breakdown)
        let h = self.layer_norm(x, &self.ln1_g, &self.ln1_b)?; // (B, T, C): one kernel, GEMM dtype out
        part("qkv")?;
        let (q, k, v) = match &self.split_qkv {
            None => {
                let qkv = self.linear(&h, &self.w_qkv, &self.b_qkv)?.reshape(heads)?; // one GEMM, bias in its epilogue
                (qkv.i((.., .., 0))?, qkv.i((.., .., 1))?, qkv.i((.., .., 2))?) // (B, T, n_head, d_head) views
            }
            Some([q, k, v]) => self.three_projections(&h, [q, k, v])?, // ablation: stage 2's three GEMMs
        };
        part("attention")?;
        let a = attention::attention_with(self.attn, &q, &k, &v, true)?.reshape((b, t, c))?; // (B, T, C)
        part(if self.fusions.add_ln { "proj+residual+ln2" } else { "proj+residual" })?;
        let (x, h) = self.add_layer_norm(x, &self.linear(&a, &self.w_proj, &self.b_proj)?, &self.ln2_g, &self.ln2_b)?; // x += proj; h = LN(x)
        part("fc1+gelu")?;
        let m = self.linear_gelu(&h, &self.w_fc1, &self.b_fc1)?; // (B, T, FF): GELU in the GEMM's epilogue
        part("fc2+residual")?;
        self.linear_residual(&m, &self.w_fc2, &self.b_fc2, &x) // x + m W_fc2ᵀ + b_fc2, f32
    }
}

/// Each fusion, or (switched off with `--fusions`) its slow twin: the way stage 2 computes that
/// part. The fused op comes first in each; the twins exist so `ladder --ablate` can price one
/// fusion at a time.
impl Block {
    fn layer_norm(&self, x: &Tensor, g: &Tensor, b: &Tensor) -> candle_core::Result<Tensor> {
        match self.fusions.ln {
            true => layer_norm(x, g, b, self.dtype),
            false => stage0_baseline::layer_norm(x, g, b)?.to_dtype(self.dtype), // primitive ops, then a cast pass
        }
    }

    fn linear(&self, x: &Tensor, w: &Tensor, b: &Tensor) -> candle_core::Result<Tensor> {
        match self.fusions.epilogue {
            true => linear_bias(x, w, b),
            false => stage0_baseline::linear(x, w, b), // GEMM, then a bias pass
        }
    }

    fn linear_gelu(&self, x: &Tensor, w: &Tensor, b: &Tensor) -> candle_core::Result<Tensor> {
        match self.fusions.epilogue {
            true => linear_bias_gelu(x, w, b),
            false => stage0_baseline::gelu_tanh(&stage0_baseline::linear(x, w, b)?), // GEMM, bias pass, GELU passes
        }
    }

    /// r + x Wᵀ + b, f32 (r: the residual stream).
    fn linear_residual(&self, x: &Tensor, w: &Tensor, b: &Tensor, r: &Tensor) -> candle_core::Result<Tensor> {
        match self.fusions.epilogue {
            true => linear_bias_residual(x, w, b, r),
            false => r + stage0_baseline::linear(x, w, b)?.to_dtype(DType::F32)?, // GEMM, bias pass, cast pass, add pass
        }
    }

    /// (x + branch in f32, LayerNorm of it in the GEMM dtype).
    fn add_layer_norm(&self, x: &Tensor, branch: &Tensor, g: &Tensor, b: &Tensor) -> candle_core::Result<(Tensor, Tensor)> {
        if self.fusions.add_ln {
            return add_layer_norm(x, branch, g, b);
        }
        let x = (x + branch.to_dtype(DType::F32)?)?; // the add, a pass of its own
        part("ln2")?;
        let h = self.layer_norm(&x, g, b)?;
        Ok((x, h))
    }

    /// The qkv fusion off: three (C, C) GEMMs, as in stage 2. h: (B, T, C) → three (B, T, n_head, d_head).
    fn three_projections(&self, h: &Tensor, [q, k, v]: [&(Tensor, Tensor); 3]) -> candle_core::Result<(Tensor, Tensor, Tensor)> {
        let (b, t, c) = h.dims3()?;
        let heads = (b, t, self.n_head, c / self.n_head);
        let one = |(w, bias): &(Tensor, Tensor)| self.linear(h, w, bias)?.reshape(heads);
        Ok((one(q)?, one(k)?, one(v)?))
    }
}
