//! The stage contract: every stage turns the same weights into the same function; what differs
//! is how (precision, kernels, fusion). The runner and the ladder only see this trait.

use crate::check::NamedCheck;
use crate::device::{DeviceInfo, GemmSwitches};
use crate::error::SpeedkitError;
use crate::preset::Shape;
use crate::weights::BlockWeights;
use candle_core::backprop::GradStore;
use candle_core::{Device, Tensor, Var};
use candle_nn::Optimizer;
use serde::{Deserialize, Serialize};

/// The number format the block's matrix multiplications run in.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    #[default]
    Fp32,
    Tf32,
    Bf16,
    F16,
    Fp8,
}

impl Precision {
    pub fn name(self) -> &'static str {
        match self {
            Precision::Fp32 => "fp32",
            Precision::Tf32 => "tf32",
            Precision::Bf16 => "bf16",
            Precision::F16 => "f16",
            Precision::Fp8 => "fp8",
        }
    }
}

impl std::fmt::Display for Precision {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// `--precision auto|fp32|tf32|bf16|f16|fp8`: `Auto` lets the stage's policy decide.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum PrecisionRequest {
    #[default]
    Auto,
    Exactly(Precision),
}

/// A stage's precision decision: the precision, and one sentence saying why.
pub type PrecisionChoice = (Precision, String);

/// A comma-separated list of switches (`--fusions ln,qkv`): "all", "none", or some of `names`;
/// `what` names the list in errors.
pub fn parse_switches<const N: usize>(s: &str, names: &[&str; N], what: &str) -> Result<[bool; N], String> {
    match s.trim() {
        "all" => return Ok([true; N]),
        "none" => return Ok([false; N]),
        // Empty is a typo or an unset variable, not "none" (as --precision '' is refused).
        "" => return Err(format!("an empty list is not a choice of {what}. Fix: give all, none, or some of {}", names.join(", "))),
        _ => {}
    }
    let mut flags = [false; N];
    for name in s.split(',').map(str::trim) {
        match names.iter().position(|n| *n == name) {
            Some(i) => flags[i] = true,
            None => return Err(format!("'{name}' is not one of {what}. Fix: list some of {} (or all, or none)", names.join(", "))),
        }
    }
    Ok(flags)
}

/// The names of the switches that are on, in `names` order.
pub fn switches_on<const N: usize>(flags: [bool; N], names: &[&'static str; N]) -> Vec<&'static str> {
    names.iter().zip(flags).filter(|(_, on)| *on).map(|(n, _)| *n).collect()
}

/// "all", "none", or the list of those on, as the flag takes it.
pub fn describe_switches<const N: usize>(flags: [bool; N], names: &[&'static str; N]) -> String {
    match flags {
        f if f.iter().all(|on| *on) => "all".into(),
        f if f.iter().all(|on| !on) => "none".into(),
        f => switches_on(f, names).join(","),
    }
}

/// `flags` with the one named `name` (in `names`) off.
pub fn switch_off<const N: usize>(mut flags: [bool; N], names: &[&str; N], name: &str) -> [bool; N] {
    if let Some(i) = names.iter().position(|n| *n == name) {
        flags[i] = false;
    }
    flags
}

/// What `Stage::implementation` starts with when the stage imitates a number format instead of
/// running it on hardware; the runner then reports no % of peak for it.
pub const EMULATED: &str = "emulated";

/// Everything a stage's `build` may depend on, decided before it runs (a stage's own flags live
/// in the stage value).
#[derive(Clone, Debug)]
pub struct Plan {
    pub device: Device,
    pub info: DeviceInfo,
    pub precision: Precision,
    /// One sentence: why this precision (the policy's decision or the user's override).
    pub precision_reason: String,
    pub shape: Shape,
    /// The run's `--precision`, for stages that follow another stage's choice (stage 4 keeps
    /// stage 3's activation precision at the same request, so FP8 is its only change).
    pub requested: PrecisionRequest,
    /// `--cuda-graph`: the forward will be captured once and replayed (stateful stages refuse).
    pub cuda_graph: bool,
    /// `--train`: the step timed is forward + backward, then the optimizer's update.
    pub train: bool,
}

/// One rung of the ladder, configured by its flags. `build` runs once, outside timing (convert,
/// fuse, quantize the weights; set candle's global switches); the `Forward` it returns is timed.
pub trait Stage {
    /// Crate name, e.g. "stage2_sdpa".
    fn name(&self) -> &'static str;
    /// One line: the technique this stage adds.
    fn technique(&self) -> &'static str;
    /// The precision this stage *is*, when it is one (stage 0: fp32, stage 4: fp8): the ladder
    /// asks it for that, whatever `--precision` says for the stages in between.
    fn own_precision(&self) -> Option<Precision> {
        None
    }

    /// The precision this stage runs at on this device for this request, and why; an error
    /// (exit 2) when the request is something this stage or device cannot do.
    fn choose_precision(&self, info: &DeviceInfo, requested: PrecisionRequest) -> Result<PrecisionChoice, SpeedkitError>;

    /// candle's global GEMM switches this stage runs with; `build` must apply them.
    fn switches(&self, plan: &Plan) -> GemmSwitches;

    /// Shape limits beyond `Shape::validate` (the default: the naive (B, n_head, T, T) score
    /// matrix must be addressable).
    fn check_shape(&self, shape: &Shape) -> Result<(), SpeedkitError> {
        shape.validate_score_matrix()
    }

    /// Bytes this stage needs at its widest point, to refuse runs that cannot fit (default: the naive block's).
    fn estimate_bytes(&self, shape: &Shape) -> u128 {
        shape.estimate_naive_bytes()
    }

    /// What the reader should know about running this plan (misaligned dimensions, a
    /// precision that is slow on this device, ...). Printed and stored with the record.
    fn notes(&self, _plan: &Plan) -> Vec<String> {
        Vec::new()
    }

    /// Which implementation runs this plan, when a stage has more than one (stage 4's real or
    /// emulated FP8) or a non-default option: shown beside the precision, so a number is never
    /// read as something else than what ran.
    fn implementation(&self, _plan: &Plan) -> Option<String> {
        None
    }

    /// Refusals that depend on the whole plan, checked when it is made, before any weights exist
    /// (so `ladder report` shows them too).
    fn check_plan(&self, _plan: &Plan) -> Result<(), SpeedkitError> {
        Ok(())
    }

    fn build(&self, weights: &BlockWeights, plan: &Plan) -> anyhow::Result<Box<dyn Forward>>;

    /// `ladder --ablate`: this stage with one of its changes undone, one variant per change,
    /// labelled as its row ("without ln").
    fn ablations(&self, _plan: &Plan) -> Vec<(String, Box<dyn Stage>)> {
        Vec::new()
    }

    /// The roofline's traffic model: bytes one forward moves at `shape`, GEMM operands at `p`,
    /// activations in `act` bytes per element (`perf::Traffic` holds the shared terms).
    fn traffic(&self, shape: &Shape, p: Precision, act: f64) -> f64;

    /// `--train`: refusals of a training plan, checked with `check_plan` before any work. The
    /// default refuses: a stage trains only once it says how (`build_train`).
    fn check_train(&self, _plan: &Plan) -> Result<(), SpeedkitError> {
        Err(SpeedkitError::usage(format!(
            "{} has no training step (no backward through its ops). Fix: drop --train, or run a stage that has one.",
            self.name()
        )))
    }

    /// `--train`: the forward over `w`, f32 master weights held as `Var`s that the optimizer
    /// updates in place between steps. It must read their current values at every call (casting
    /// or quantizing them there, as autocast does), so that `loss.backward()` reaches every one.
    /// `Rebuild` does that for a stage whose `build` is cheap enough to run every step.
    fn build_train(&self, _w: &BlockWeights, plan: &Plan) -> anyhow::Result<Box<dyn Forward>> {
        Err(self.check_train(plan).err().unwrap_or_else(|| SpeedkitError::usage(format!("{} has no build_train", self.name()))).into())
    }

    /// `--train`: the optimizer that updates `vars` (the default: `candle_nn::AdamW`, one op
    /// per parameter per moment).
    fn optimizer(&self, vars: Vec<Var>, _plan: &Plan) -> anyhow::Result<Box<dyn Optimize>> {
        Ok(Box::new(CandleAdamW(candle_nn::AdamW::new(vars, train_params())?)))
    }

    /// `ladder selftest`: this stage's GPU building blocks, each against its CPU twin (on the CPU,
    /// their CPU stand-ins).
    fn selftest(&self, _device: &Device, _info: &DeviceInfo, _rows: &mut crate::selftest::Rows) {}
}

/// A built stage: what gets timed.
pub trait Forward {
    /// (B, T, C) -> (B, T, C)
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor>;

    /// A check of the stage's own on the output `y` of the forward just made on `x` (stage 4:
    /// the fp32 twin on FP8-rounded operands).
    fn self_check(&self, _x: &Tensor, _y: &Tensor) -> anyhow::Result<Option<NamedCheck>> {
        Ok(None)
    }

    /// Whether the forward just made took the path every later one takes (stage 4's first has no
    /// delayed scale yet); a CUDA graph capture warms up until it does (`cuda_graph::run_capture`).
    fn steady(&self) -> bool {
        true
    }

    /// Notes on what the forwards so far actually ran, where it can differ from the plan (stage
    /// 4: a fusion cuBLASLt had no algorithm for); added to the row's notes after timing.
    fn ran(&self) -> Vec<String> {
        Vec::new()
    }
}

/// `--train`: an optimizer over the stage's weights.
pub trait Optimize {
    /// What updates the weights, for the label ("candle-nn AdamW", "fused AdamW").
    fn name(&self) -> String;
    /// The factor the loss is multiplied by before the backward (f16's dynamic loss scale); the
    /// optimizer divides it out of the gradients again.
    fn loss_scale(&self) -> f64 {
        1.0
    }
    /// One update from the gradients of the scaled loss; `false` when the step was skipped
    /// (a non-finite gradient under loss scaling).
    fn step(&mut self, grads: &GradStore) -> anyhow::Result<bool>;
}

/// The hyper-parameters of every stage's AdamW: candle-nn's defaults but a learning rate of
/// 1e-4, so that a few timed steps move the weights without leaving the block's range.
pub fn train_params() -> candle_nn::ParamsAdamW {
    candle_nn::ParamsAdamW { lr: 1e-4, ..Default::default() }
}

/// Stage 0's optimizer: `candle_nn::AdamW`.
pub struct CandleAdamW(pub candle_nn::AdamW);

impl Optimize for CandleAdamW {
    fn name(&self) -> String {
        "candle-nn AdamW".into()
    }
    fn step(&mut self, grads: &GradStore) -> anyhow::Result<bool> {
        self.0.step(grads)?;
        Ok(true)
    }
}

/// A training forward that builds `stage` from the current weights at every call: the casts
/// (and packing) `build` does happen once per step, as autocast's do, and the tracked weights
/// reach the backward through them.
pub struct Rebuild<S> {
    pub stage: S,
    pub weights: BlockWeights,
    pub plan: Plan,
}

impl<S: Stage> Forward for Rebuild<S> {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let built = self.stage.build(&self.weights, &self.plan).map_err(|e| candle_core::Error::Msg(format!("{e:#}")))?;
        built.forward(x)
    }
}

/// How a binary or the ladder finds a stage. A stage binary takes the flags of every stage up to
/// its own (stage 4 honours stage 3's `--fusions`); the ladder takes every stage's.
#[derive(Clone, Copy)]
pub struct StageEntry {
    /// Adds the flags this stage introduces (`clap::Args::augment_args` of its args struct).
    pub args: fn(clap::Command) -> clap::Command,
    /// The stage, from flags parsed by a command `args` of it and every earlier stage augmented.
    pub make: fn(&clap::ArgMatches) -> Result<Box<dyn Stage>, clap::Error>,
}

/// What the ladder asks `stage` for, given the run's `--precision`: its own precision if it has
/// one, else the request.
pub fn ladder_request(stage: &dyn Stage, requested: PrecisionRequest) -> PrecisionRequest {
    stage.own_precision().map_or(requested, PrecisionRequest::Exactly)
}

/// Choose the precision for `asked` (`ladder_request` in the ladder), assemble the plan and run
/// the stage's plan-level refusals. `requested` is the run's `--precision`.
#[allow(clippy::too_many_arguments)] // each is one decision of the run's flags, named at every call
pub fn plan(
    stage: &dyn Stage,
    device: &Device,
    info: &DeviceInfo,
    shape: Shape,
    asked: PrecisionRequest,
    requested: PrecisionRequest,
    cuda_graph: bool,
    train: bool,
) -> Result<Plan, SpeedkitError> {
    let (precision, precision_reason) = stage.choose_precision(info, asked)?;
    let plan = Plan { device: device.clone(), info: info.clone(), precision, precision_reason, shape, requested, cuda_graph, train };
    stage.check_plan(&plan)?;
    if train {
        stage.check_train(&plan)?;
    }
    Ok(plan)
}

/// `plan` for a stage run alone, as its binary plans it: asked for `requested`, no CUDA graph,
/// forward only.
pub fn plan_alone(
    stage: &dyn Stage,
    device: &Device,
    info: &DeviceInfo,
    shape: Shape,
    requested: PrecisionRequest,
) -> Result<Plan, SpeedkitError> {
    plan(stage, device, info, shape, requested, requested, false, false)
}
