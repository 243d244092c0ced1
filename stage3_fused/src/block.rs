//! Stage 3's block: stage 2's forward with the element-wise work fused, each fusion switchable
//! (`--fusions`); a fusion that is off runs its slow twin, stage 2's passes for that part.

use crate::ops::{self, add_layer_norm, layer_norm, linear_prepacked, mlp, Epilogue};
use crate::{scheduled, Fused, Fusions};
use candle_core::{DType, IndexOp, Tensor};
use cpu_kernels::bf16_gemm::PackedWeight;
use cpu_kernels::elementwise::{self as ew, Elementwise, LN_EPS};
use shared::breakdown::enter;
use shared::{BlockWeights, Forward, Plan, Stage, TrainPass};
use stage1_tensorcore::precision;
use stage2_sdpa::attention::{self, CpuKernel};

pub struct Block {
    ln1_g: Tensor,        // (C) f32
    ln1_b: Tensor,        // (C) f32
    w_qkv: PackedWeight,  // (3C, C) GEMM dtype: q, k and v weights stacked, one GEMM; Wᵀ packed once on a CPU's bf16 unit
    b_qkv: Tensor,        // (3C) GEMM dtype
    w_proj: PackedWeight, // (C, C)
    b_proj: Tensor,       // (C)
    ln2_g: Tensor,        // (C) f32
    ln2_b: Tensor,        // (C) f32
    w_fc1: PackedWeight,  // (FF, C)
    b_fc1: Tensor,        // (FF)
    w_fc2: PackedWeight,  // (C, FF)
    b_fc2: Tensor,        // (C)
    n_head: usize,
    attn: attention::Implementation, // stage 2's attention kernel (`--attention-kernel` on CUDA)
    dtype: DType, // activations: the GEMM dtype, bf16, f16 or f32 (f32 in a training step on the CPU, `precision::activation_dtype`)
    bf16_attention: bool, // f32 activations with bf16 products (training on the CPU): attention's too
    ew: Elementwise, // the engine's passes, or candle's ops (`--elementwise`), for a fusion that is off
    fusions: Fusions, // all on unless ablated (--fusions)
    split_qkv: Option<[(PackedWeight, Tensor); 3]>, // qkv fusion off only: (C, C) weights and (C) biases of q, k, v
}

impl Block {
    pub fn build(w: &BlockWeights, plan: &Plan, stage: &Fused, ew: Elementwise) -> anyhow::Result<Block> {
        stage.switches(plan).apply();
        stage.check_plan(plan)?;
        let attn = stage2_sdpa::harness::for_run(&plan.device, stage.sdpa.args.attention_kernel)?;
        let c = plan.shape.d_model;
        let (dt, act) = (precision::gemm_dtype(plan.precision), precision::activation_dtype(plan));
        // Cast once here, never per forward, and on a CPU's bf16 unit packed once into the GEMM's
        // pair panels (build is outside the timing; every forward would otherwise pack W again).
        let pack = |t: &Tensor| precision::weight(t, plan);
        let split_qkv = match stage.fusions.qkv {
            true => None,
            false => {
                let rows = |i: usize| w.w_qkv.narrow(0, i * c, c).and_then(|t| pack(&t)); // (C, C)
                let bias = |i: usize| w.b_qkv.narrow(0, i * c, c).and_then(|t| t.to_dtype(act)?.contiguous()); // (C)
                Some([(rows(0)?, bias(0)?), (rows(1)?, bias(1)?), (rows(2)?, bias(2)?)])
            }
        };
        Ok(Block {
            ln1_g: w.ln1_g.clone(),
            ln1_b: w.ln1_b.clone(),
            w_qkv: pack(&w.w_qkv)?, // one (3C, C) GEMM instead of three (C, C) ones
            b_qkv: w.b_qkv.to_dtype(act)?,
            w_proj: pack(&w.w_proj)?,
            b_proj: w.b_proj.to_dtype(act)?,
            ln2_g: w.ln2_g.clone(),
            ln2_b: w.ln2_b.clone(),
            w_fc1: pack(&w.w_fc1)?,
            b_fc1: w.b_fc1.to_dtype(act)?,
            w_fc2: pack(&w.w_fc2)?,
            b_fc2: w.b_fc2.to_dtype(act)?,
            n_head: plan.shape.n_head,
            attn,
            dtype: act,
            bf16_attention: act != dt,
            ew,
            fusions: stage.fusions,
            split_qkv,
        })
    }

    /// Stage 2's fused attention on (B, T, n_head, d_head) views (of the one QKV output here).
    fn attention(&self, q: &Tensor, k: &Tensor, v: &Tensor) -> candle_core::Result<Tensor> {
        let cpu = if self.bf16_attention { CpuKernel::RegistersBf16 } else { CpuKernel::Registers };
        stage2_sdpa::attention_opts(self.attn, cpu, q, k, v, true)
        // (B, T, n_head, d_head)
    }
}

impl Forward for Block {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let (b, t, c) = x.dims3()?;
        let heads = (b, t, 3, self.n_head, c / self.n_head); // (B, T, 3, n_head, d_head): a view of (B, T, 3C), no copy
        let [x] = enter("ln1", [x])?; // a no-op unless --breakdown is recording (shared::breakdown)
        let h = self.layer_norm(&x, &self.ln1_g, &self.ln1_b)?; // (B, T, C): one kernel, GEMM dtype out
        let [h] = enter("qkv", [&h])?;
        let a = match &self.split_qkv {
            None => {
                let qkv = self.linear(&h, &self.w_qkv, &self.b_qkv)?; // (B, T, 3C): one GEMM, bias in its epilogue
                let [qkv] = enter("attention", [&qkv])?;
                self.attention_of_qkv(&qkv, heads)?
            }
            Some([q, k, v]) => {
                let (q, k, v) = self.three_projections(&h, [q, k, v])?; // ablation: stage 2's three GEMMs
                let [q, k, v] = enter("attention", [&q, &k, &v])?;
                self.attention(&q, &k, &v)?.reshape((b, t, c))?
            }
        }; // (B, T, C)
        let [a] = enter(if self.fusions.add_ln { "proj+residual+ln2" } else { "proj+residual" }, [&a])?;
        let (x, h) = self.add_layer_norm(&x, &self.linear(&a, &self.w_proj, &self.b_proj)?, &self.ln2_g, &self.ln2_b)?; // x += proj; h = LN(x)
        let [h] = enter("fc1+gelu", [&h])?;
        if let Some(y) = self.mlp_training_cuda(&h, &x)? {
            return Ok(y); // training on CUDA: fc1 and fc2 paired (`ops::mlp`), one part
        }
        let m = self.linear_gelu(&h, &self.w_fc1, &self.b_fc1)?; // (B, T, FF): GELU in the GEMM's epilogue
        let [m] = enter("fc2+residual", [&m])?;
        self.linear_residual(&m, &self.w_fc2, &self.b_fc2, &x) // x + m W_fc2ᵀ + b_fc2, f32
    }

    /// A training step on the CPU with every fusion on: the same forward, with the backward
    /// scheduled by hand instead of candle's tape (`scheduled`). Elsewhere (CUDA, an ablation)
    /// the tape.
    fn train_forward(&self, x: &Tensor) -> Option<candle_core::Result<Box<dyn TrainPass>>> {
        let linears = [&self.w_qkv, &self.w_proj, &self.w_fc1, &self.w_fc2];
        let bf16_products = self.w_qkv.bf16_products();
        let f32_weights = linears.iter().all(|w| w.weight().dtype() == DType::F32 && w.bf16_products() == bf16_products);
        let cpu_f32 = x.device().is_cpu() && x.dtype() == DType::F32 && self.dtype == DType::F32;
        if !(cpu_f32 && f32_weights && self.fusions == Fusions::ALL && self.split_qkv.is_none()) {
            return None;
        }
        let pair = |w: &PackedWeight, b: &Tensor| [w.weight().clone(), b.clone()];
        let weights = scheduled::Weights {
            ln1: [self.ln1_g.clone(), self.ln1_b.clone()],
            qkv: pair(&self.w_qkv, &self.b_qkv),
            proj: pair(&self.w_proj, &self.b_proj),
            ln2: [self.ln2_g.clone(), self.ln2_b.clone()],
            fc1: pair(&self.w_fc1, &self.b_fc1),
            fc2: pair(&self.w_fc2, &self.b_fc2),
        };
        let kernel = if self.bf16_attention { CpuKernel::RegistersBf16 } else { CpuKernel::Registers };
        let config = scheduled::Config { n_head: self.n_head, kernel, bf16_products };
        Some(scheduled::forward(x, weights, config).map(|p| Box::new(p) as Box<dyn TrainPass>))
    }
}

/// Each fusion, or (switched off with `--fusions`) its slow twin: stage 2's passes for that part,
/// on the same engine. The fused op comes first in each; the twins exist so `ladder --ablate` can
/// price one fusion at a time.
impl Block {
    fn layer_norm(&self, x: &Tensor, g: &Tensor, b: &Tensor) -> candle_core::Result<Tensor> {
        match self.fusions.ln {
            true => layer_norm(x, g, b, ops::LN_EPS, self.dtype),
            false => ew::to_dtype(&ew::layer_norm(x, g, b, LN_EPS, self.ew)?, self.dtype, self.ew), // stage 2's passes, then its cast
        }
    }

    fn linear(&self, x: &Tensor, w: &PackedWeight, b: &Tensor) -> candle_core::Result<Tensor> {
        match self.fusions.epilogue {
            true => linear_prepacked(x, w, b, Epilogue::Bias),
            false => ew::linear(x, w, b, self.ew), // GEMM, then a bias pass
        }
    }

    fn linear_gelu(&self, x: &Tensor, w: &PackedWeight, b: &Tensor) -> candle_core::Result<Tensor> {
        match self.fusions.epilogue {
            true => linear_prepacked(x, w, b, Epilogue::BiasGelu),
            false => ew::gelu_tanh(&ew::linear(x, w, b, self.ew)?, self.ew), // GEMM, bias pass, GELU passes
        }
    }

    /// Training on CUDA with the epilogue fusion on: r + mlp(h), `ops::mlp` pairing fc1 and fc2 so
    /// that GELU's derivative and both bias gradients come out of the backward GEMMs (cuBLASLt's
    /// DGELU_BGRAD and BGRADB); the residual add is candle's, as `linear_bias_residual`'s while
    /// training. `None` otherwise: the CPU keeps fc1's one-pass backward (f32 dz).
    fn mlp_training_cuda(&self, h: &Tensor, r: &Tensor) -> candle_core::Result<Option<Tensor>> {
        let (w1, w2) = (self.w_fc1.weight(), self.w_fc2.weight());
        let tracked = [h, w1, &self.b_fc1, w2, &self.b_fc2].iter().any(|t| t.track_op());
        if !(self.fusions.epilogue && tracked && h.device().is_cuda()) {
            return Ok(None);
        }
        let y = mlp(h, w1, &self.b_fc1, w2, &self.b_fc2)?; // (B, T, C) in the GEMM dtype
        Ok(Some((r + y.to_dtype(r.dtype())?)?))
    }

    /// r + x Wᵀ + b, f32 (r: the residual stream).
    fn linear_residual(&self, x: &Tensor, w: &PackedWeight, b: &Tensor, r: &Tensor) -> candle_core::Result<Tensor> {
        match self.fusions.epilogue {
            true => linear_prepacked(x, w, b, Epilogue::BiasResidual(r)),
            false => ew::add(r, &ew::to_dtype(&ew::linear(x, w, b, self.ew)?, DType::F32, self.ew)?, self.ew), // GEMM, bias, cast, add passes
        }
    }

    /// (x + branch in f32, LayerNorm of it in the GEMM dtype).
    fn add_layer_norm(&self, x: &Tensor, branch: &Tensor, g: &Tensor, b: &Tensor) -> candle_core::Result<(Tensor, Tensor)> {
        if self.fusions.add_ln {
            return add_layer_norm(x, branch, g, b, ops::LN_EPS); // h in the branch's dtype: the GEMM dtype
        }
        let x = ew::add(x, &ew::to_dtype(branch, DType::F32, self.ew)?, self.ew)?; // the add, a pass of its own
        let [x] = enter("ln2", [&x])?;
        let h = self.layer_norm(&x, g, b)?;
        Ok((x, h))
    }

    /// Attention on the one QKV output (B, T, 3C) → (B, T, C): stage 2's op on (B, T, n_head,
    /// d_head) views of it; while training on the CPU, the same kernels as one op on qkv itself
    /// (`ops::qkv_attention`), and on CUDA stage 2's kernels as one op on qkv
    /// (`ops::qkv_attention_cuda`): either way the gradient is one tensor instead of three padded slices.
    fn attention_of_qkv(&self, qkv: &Tensor, heads: (usize, usize, usize, usize, usize)) -> candle_core::Result<Tensor> {
        let (b, t, _, n_head, d) = heads;
        if qkv.track_op() && qkv.device().is_cpu() && qkv.dtype() == DType::F32 {
            let cpu = if self.bf16_attention { CpuKernel::RegistersBf16 } else { CpuKernel::Registers };
            return ops::qkv_attention(qkv, n_head, cpu, true);
        }
        #[cfg(feature = "cuda")]
        if qkv.track_op() && qkv.device().is_cuda() && matches!(qkv.dtype(), DType::BF16 | DType::F16) {
            use stage2_sdpa::attention::{AttentionKernel, Implementation};
            let kernel = match self.attn {
                Implementation::SpeedkitCuda => Some(AttentionKernel::V2),
                Implementation::SpeedkitCudaV1 => Some(AttentionKernel::V1),
                Implementation::Cpu | Implementation::FlashAttn => None,
            };
            if let Some(kernel) = kernel {
                cpu_kernels::trace::ran(self.attn.name());
                return ops::qkv_attention_cuda(qkv, n_head, kernel, true);
            }
        }
        let qkv = qkv.reshape(heads)?;
        let (q, k, v) = (qkv.i((.., .., 0))?, qkv.i((.., .., 1))?, qkv.i((.., .., 2))?); // (B, T, n_head, d_head) views
        self.attention(&q, &k, &v)?.reshape((b, t, n_head * d))
    }

    /// The qkv fusion off: three (C, C) GEMMs, as in stage 2. h: (B, T, C) → three (B, T, n_head, d_head).
    fn three_projections(&self, h: &Tensor, [q, k, v]: [&(PackedWeight, Tensor); 3]) -> candle_core::Result<(Tensor, Tensor, Tensor)> {
        let (b, t, c) = h.dims3()?;
        let heads = (b, t, self.n_head, c / self.n_head);
        let one = |(w, bias): &(PackedWeight, Tensor)| self.linear(h, w, bias)?.reshape(heads);
        Ok((one(q)?, one(k)?, one(v)?))
    }
}
