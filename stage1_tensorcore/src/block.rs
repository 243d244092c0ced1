//! Stage 1's block for the runner and the ladder: stage 0's forward with the GEMMs in the
//! precision policy's dtype.

use crate::bf16_gemm::{self, Kernel, PackedWeight};
use crate::loss_scale::LossScaler;
use crate::{attention_in, linear, precision};
use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor, Var};
use candle_nn::Optimizer;
use shared::breakdown::part;
use shared::device::{DeviceInfo, GemmSwitches};
use shared::perf::Traffic;
use shared::stage::{train_params, CandleAdamW, Optimize, PrecisionChoice, Rebuild};
use shared::{BlockWeights, Forward, Plan, Precision, PrecisionRequest, Shape, SpeedkitError, Stage, StageEntry};
use stage0_baseline::{causal_mask, gelu_tanh, layer_norm};

pub struct Block {
    ln1_g: Tensor,        // (C) f32
    ln1_b: Tensor,        // (C) f32
    w_q: PackedWeight,    // (C, C) GEMM dtype; on a CPU's bf16 unit Wᵀ packed once, here (`bf16_gemm::PackedWeight`)
    b_q: Tensor,          // (C) activation dtype
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
    mask: Tensor, // (T, T) f32: 0 on and below the diagonal, -inf above
    dtype: DType, // GEMM operand dtype: bf16, f16, or f32 (fp32 and TF32)
    act: DType,   // activations between GEMMs: the GEMM dtype, or f32 on a CPU's bf16 unit (`precision::activation_dtype`)
}

/// Stage 1 as the runner and the ladder see it: `--precision` is its only flag, and every
/// stage has that one.
#[derive(Clone, Copy, Debug, Default)]
pub struct TensorCore;

/// How a binary or the ladder finds stage 1.
pub const STAGE: StageEntry = StageEntry {
    args: |c| c,
    make: |_| {
        register_bf16_ceiling();
        Ok(Box::new(TensorCore))
    },
};

/// Lets the CPU ceiling probe time the linears in bf16 on this CPU's bf16 unit, where it has one,
/// so that bf16 rows' % of peak is against a bf16 rate. The stages that run bf16 GEMMs call it
/// when they are made, before the probe runs.
pub fn register_bf16_ceiling() {
    let kernel = Kernel::detect();
    if kernel.is_native() {
        shared::ceiling::register_bf16_gemm(shared::ceiling::Bf16Gemm { kernel: kernel.name(), matmul: bf16_gemm::matmul });
    }
}

impl Stage for TensorCore {
    fn name(&self) -> &'static str {
        "stage1_tensorcore"
    }

    fn technique(&self) -> &'static str {
        "GEMMs on tensor cores: TF32 or bf16/f16, f32 LN/softmax/residual"
    }

    fn choose_precision(&self, info: &DeviceInfo, requested: PrecisionRequest) -> Result<PrecisionChoice, SpeedkitError> {
        precision::choose(info, requested)
    }

    fn switches(&self, plan: &Plan) -> GemmSwitches {
        precision::switches(plan.precision)
    }

    fn notes(&self, plan: &Plan) -> Vec<String> {
        let advice = precision::alignment_advice(&plan.shape, plan.precision);
        let on = if plan.info.is_cuda() { "" } else { "on a GPU, " };
        let mut notes: Vec<String> = advice.into_iter().map(|a| format!("{on}{a}")).collect();
        if precision::activation_dtype(plan) == DType::F32 && plan.precision == Precision::Bf16 {
            notes.push(
                "bf16 mixed precision on the CPU: bf16 weights, activations kept in f32 and rounded to bf16 as each GEMM packs them, \
                 f32 accumulate and f32 out; bias, GELU, mask, softmax, residual and LayerNorm run in f32 (candle's CPU element-wise \
                 ops on bf16 convert every element to f32 and back)"
                    .into(),
            );
        }
        notes
    }

    fn implementation(&self, plan: &Plan) -> Option<String> {
        let act =
            if precision::activation_dtype(plan) == DType::F32 && plan.precision == Precision::Bf16 { ", f32 activations" } else { "" };
        precision::cpu_bf16_kernel(plan).map(|k| format!("bf16 GEMMs {k}{act}"))
    }

    fn build(&self, w: &BlockWeights, plan: &Plan) -> anyhow::Result<Box<dyn Forward>> {
        Ok(Box::new(Block::build(w, plan)?))
    }

    fn traffic(&self, shape: &Shape, p: Precision, act: f64) -> f64 {
        let t = Traffic::new(shape, p, act);
        t.gemms + t.naive_attention + t.unfused
    }

    fn check_train(&self, _plan: &Plan) -> Result<(), SpeedkitError> {
        Ok(()) // candle's autograd, and on a CPU's bf16 unit `bf16_gemm`'s own backward GEMMs
    }

    /// The casts of `build` once per step, as autocast's: the weights stay f32 masters.
    fn build_train(&self, w: &BlockWeights, plan: &Plan) -> anyhow::Result<Box<dyn Forward>> {
        Ok(Box::new(Rebuild { stage: TensorCore, weights: w.clone(), plan: plan.clone() }))
    }

    /// f16: candle-nn's AdamW behind dynamic loss scaling (f16's range loses small gradients);
    /// the other precisions keep f32's exponent range and need none.
    fn optimizer(&self, vars: Vec<Var>, plan: &Plan) -> anyhow::Result<Box<dyn Optimize>> {
        let adamw = candle_nn::AdamW::new(vars.clone(), train_params())?;
        Ok(match plan.precision {
            Precision::F16 => Box::new(LossScaledAdamW { adamw, vars, scaler: LossScaler::default() }),
            _ => Box::new(CandleAdamW(adamw)),
        })
    }
}

/// Stage 1's optimizer at f16: `candle_nn::AdamW` on gradients unscaled by `LossScaler`, the
/// step skipped (and S halved) when one overflowed.
pub struct LossScaledAdamW {
    pub adamw: candle_nn::AdamW,
    pub vars: Vec<Var>,
    pub scaler: LossScaler,
}

impl Optimize for LossScaledAdamW {
    fn name(&self) -> String {
        "candle-nn AdamW, dynamic loss scaling".into()
    }

    fn loss_scale(&self) -> f64 {
        self.scaler.scale()
    }

    fn step(&mut self, grads: &GradStore) -> anyhow::Result<bool> {
        let Some(unscaled) = self.scaler.unscale_grads(&self.vars, grads)? else { return Ok(false) };
        self.adamw.step(&unscaled)?;
        Ok(true)
    }
}

impl Block {
    pub fn build(w: &BlockWeights, plan: &Plan) -> anyhow::Result<Block> {
        precision::switches(plan.precision).apply();
        let c = plan.shape.d_model;
        let dt = precision::gemm_dtype(plan.precision);
        let act = precision::activation_dtype(plan);
        // Three separate projections, as in stage 0; cast once here, never per forward, and on a
        // CPU's bf16 unit packed once into the GEMM's pair panels (build is outside the timing).
        let pack = |t: &Tensor| PackedWeight::new(&t.to_dtype(dt)?.contiguous()?);
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
        })
    }
}

impl Forward for Block {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        part("ln1")?; // a no-op unless --breakdown is recording (shared::breakdown)
        let h = layer_norm(x, &self.ln1_g, &self.ln1_b)?.to_dtype(self.act)?; // (B, T, C): f32 statistics, activation dtype out
        part("qkv")?;
        let q = linear(&h, &self.w_q, &self.b_q)?; // (B, T, C)
        let k = linear(&h, &self.w_k, &self.b_k)?;
        let v = linear(&h, &self.w_v, &self.b_v)?;
        part("attention")?;
        let a = attention_in(&q, &k, &v, self.n_head, &self.mask, self.dtype)?; // (B, T, C)
        part("proj+residual")?;
        let x = (x + linear(&a, &self.w_proj, &self.b_proj)?.to_dtype(DType::F32)?)?; // residual stream stays f32
        part("ln2")?;
        let h = layer_norm(&x, &self.ln2_g, &self.ln2_b)?.to_dtype(self.act)?;
        part("fc1+gelu")?;
        let m = gelu_tanh(&linear(&h, &self.w_fc1, &self.b_fc1)?)?; // (B, T, FF)
        part("fc2+residual")?;
        x + linear(&m, &self.w_fc2, &self.b_fc2)?.to_dtype(DType::F32)?
    }
}
