//! Stage 1 as the runner and the ladder see it (the block itself is `block.rs`).

use crate::loss_scale::LossScaler;
use crate::{precision, Block};
use candle_core::backprop::GradStore;
use candle_core::Var;
use candle_nn::Optimizer;
use cpu_kernels::bf16_gemm::{self, Kernel};
use cpu_kernels::elementwise as ew;
use shared::device::{DeviceInfo, GemmSwitches};
use shared::perf::Traffic;
use shared::stage::{train_params, CandleAdamW, Optimize, PrecisionChoice, Rebuild};
use shared::{BlockWeights, Forward, Plan, Precision, PrecisionRequest, Shape, SpeedkitError, Stage, StageEntry};

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
        advice.into_iter().map(|a| format!("{on}{a}")).collect()
    }

    fn implementation(&self, plan: &Plan) -> Option<String> {
        let gemms = precision::cpu_bf16_kernel(plan).map(|k| format!("bf16 GEMMs {k}"));
        let parts: Vec<String> = gemms.into_iter().chain(stage0_baseline::elementwise_label(plan, ew::mode())).collect();
        (!parts.is_empty()).then(|| parts.join(", "))
    }

    fn build(&self, w: &BlockWeights, plan: &Plan) -> anyhow::Result<Box<dyn Forward>> {
        Ok(Box::new(Block::build(w, plan, ew::mode())?))
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
