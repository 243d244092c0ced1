//! Stage 0 as the runner and the ladder see it (the block itself is `block.rs`).

use crate::Block;
use cpu_kernels::elementwise::{self as ew, Elementwise};
use shared::device::{DeviceInfo, GemmSwitches};
use shared::perf::Traffic;
use shared::stage::{PrecisionChoice, Rebuild};
use shared::{BlockWeights, Forward, Plan, Precision, PrecisionRequest, Shape, SpeedkitError, Stage, StageEntry};

/// Stage 0 as the runner and the ladder see it: no flags of its own.
#[derive(Clone, Copy, Debug, Default)]
pub struct Baseline;

/// How a binary or the ladder finds stage 0.
pub const STAGE: StageEntry = StageEntry { args: |c| c, make: |_| Ok(Box::new(Baseline)) };

impl Stage for Baseline {
    fn name(&self) -> &'static str {
        "stage0_baseline"
    }

    fn technique(&self) -> &'static str {
        "fp32, every op spelled out, full T x T attention"
    }

    fn own_precision(&self) -> Option<Precision> {
        Some(Precision::Fp32)
    }

    fn choose_precision(&self, _info: &DeviceInfo, requested: PrecisionRequest) -> Result<PrecisionChoice, SpeedkitError> {
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

    fn switches(&self, _plan: &Plan) -> GemmSwitches {
        GemmSwitches::OFF
    }

    fn implementation(&self, plan: &Plan) -> Option<String> {
        elementwise_label(plan, ew::mode())
    }

    fn build(&self, w: &BlockWeights, plan: &Plan) -> anyhow::Result<Box<dyn Forward>> {
        Ok(Box::new(Block::build(w, plan, ew::mode())?))
    }

    /// On the CPU, the block as written on candle's own element-wise ops (single-threaded): what
    /// the engine's passes buy every stage. (The GEMMs are candle's in both rows.)
    fn ablations(&self, plan: &Plan) -> Vec<(String, Box<dyn Stage>)> {
        match plan.info.is_cuda() || plan.train || ew::mode() == Elementwise::Candle {
            true => Vec::new(),
            false => vec![("candle's element-wise ops".into(), Box::new(BaselineCandleOps))],
        }
    }

    fn check_train(&self, _plan: &Plan) -> Result<(), SpeedkitError> {
        Ok(()) // candle's autograd: every primitive op of the forward, on a CPU LayerNorm, GELU and softmax as engine ops with their own backward
    }

    fn build_train(&self, w: &BlockWeights, plan: &Plan) -> anyhow::Result<Box<dyn Forward>> {
        Ok(Box::new(Rebuild { stage: Baseline, weights: w.clone(), plan: plan.clone() }))
    }

    fn traffic(&self, shape: &Shape, p: Precision, act: f64) -> f64 {
        let t = Traffic::new(shape, p, act);
        t.gemms + t.naive_attention + t.unfused
    }
}

/// The CPU label's element-wise part: "" for the engine's passes (the default), or the ops
/// `--elementwise candle` runs instead. On a GPU candle's ops run either way.
pub fn elementwise_label(plan: &Plan, mode: Elementwise) -> Option<String> {
    (!plan.info.is_cuda() && mode == Elementwise::Candle).then(|| "candle's element-wise ops".to_string())
}

/// Stage 0 on candle's own element-wise ops on the CPU (`ladder --ablate`'s row): the same block,
/// the same GEMMs, LayerNorm, GELU, bias and residual as candle's single-threaded CPU ops.
#[derive(Clone, Copy, Debug, Default)]
pub struct BaselineCandleOps;

impl Stage for BaselineCandleOps {
    fn name(&self) -> &'static str {
        Baseline.name()
    }

    fn technique(&self) -> &'static str {
        Baseline.technique()
    }

    fn own_precision(&self) -> Option<Precision> {
        Baseline.own_precision()
    }

    fn choose_precision(&self, info: &DeviceInfo, requested: PrecisionRequest) -> Result<PrecisionChoice, SpeedkitError> {
        Baseline.choose_precision(info, requested)
    }

    fn switches(&self, plan: &Plan) -> GemmSwitches {
        Baseline.switches(plan)
    }

    fn implementation(&self, plan: &Plan) -> Option<String> {
        elementwise_label(plan, Elementwise::Candle)
    }

    fn build(&self, w: &BlockWeights, plan: &Plan) -> anyhow::Result<Box<dyn Forward>> {
        Ok(Box::new(Block::build(w, plan, Elementwise::Candle)?))
    }

    fn traffic(&self, shape: &Shape, p: Precision, act: f64) -> f64 {
        Baseline.traffic(shape, p, act)
    }
}
