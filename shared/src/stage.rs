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
        ["fp32", "tf32", "bf16", "f16", "fp8"][self as usize]
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

/// A comma-separated list of switches (`--fusions ln,qkv`): "all", "none", or some of `names`.
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
    match switches_on(flags, names) {
        on if on.len() == N => "all".into(),
        on if on.is_empty() => "none".into(),
        on => on.join(","),
    }
}

/// `flags` with the one named `name` off.
pub fn switch_off<const N: usize>(flags: [bool; N], names: &[&str; N], name: &str) -> [bool; N] {
    std::array::from_fn(|i| flags[i] && names[i] != name)
}

/// How `Stage::implementation` starts when the stage imitates a number format: no % of peak then.
pub const EMULATED: &str = "emulated";

/// Everything a stage's `build` may depend on besides its own flags, decided before it runs.
#[derive(Clone, Debug)]
pub struct Plan {
    pub device: Device,
    pub info: DeviceInfo,
    pub precision: Precision,
    /// One sentence: why this precision.
    pub precision_reason: String,
    pub shape: Shape,
    /// The run's `--precision` (stage 4 keeps stage 3's activation precision at the same request).
    pub requested: PrecisionRequest,
    pub cuda_graph: bool,
    pub train: bool,
}

/// One rung of the ladder, configured by its flags. `build` runs once, outside timing (convert,
/// fuse, quantize the weights; set candle's global switches); the `Forward` it returns is timed.
pub trait Stage {
    /// Crate name, e.g. "stage2_sdpa".
    fn name(&self) -> &'static str;
    fn technique(&self) -> &'static str;
    /// The precision this stage *is* (stage 0: fp32, stage 4: fp8), which the ladder asks it for
    /// whatever `--precision` says.
    fn own_precision(&self) -> Option<Precision> {
        None
    }

    /// The precision this stage runs at here for this request, and why; exit 2 if it cannot.
    fn choose_precision(&self, info: &DeviceInfo, requested: PrecisionRequest) -> Result<PrecisionChoice, SpeedkitError>;

    /// candle's global GEMM switches this stage runs with; `build` must apply them.
    fn switches(&self, plan: &Plan) -> GemmSwitches;

    /// Shape limits beyond `Shape::validate` (default: the naive scores must be addressable).
    fn check_shape(&self, shape: &Shape) -> Result<(), SpeedkitError> {
        shape.validate_score_matrix()
    }

    /// Bytes this stage needs at its widest point, to refuse runs that cannot fit (default: the naive block's).
    fn estimate_bytes(&self, shape: &Shape) -> u128 {
        shape.estimate_naive_bytes()
    }

    /// `--train`: bytes of one training step by part (default: the naive block's, stage 0's autograd).
    fn estimate_train_bytes(&self, shape: &Shape) -> crate::train::TrainBytes {
        shape.estimate_naive_train_bytes()
    }

    /// What the reader should know about this plan (a precision slow here, ...), kept with the record.
    fn notes(&self, _plan: &Plan) -> Vec<String> {
        Vec::new()
    }

    /// Which implementation runs this plan, when there is a choice (stage 4's real or emulated
    /// FP8): shown beside the precision, so a number is never read as something else.
    fn implementation(&self, _plan: &Plan) -> Option<String> {
        None
    }

    /// Refusals that depend on the whole plan, checked before any weights exist (`ladder report` too).
    fn check_plan(&self, _plan: &Plan) -> Result<(), SpeedkitError> {
        Ok(())
    }

    fn build(&self, weights: &BlockWeights, plan: &Plan) -> anyhow::Result<Box<dyn Forward>>;

    /// `ladder --ablate`: one variant per change undone, labelled as its row ("without ln").
    fn ablations(&self, _plan: &Plan) -> Vec<(String, Box<dyn Stage>)> {
        Vec::new()
    }

    /// Bytes one forward moves (GEMM operands at `p`, activations `act` bytes), from `perf::Traffic`.
    fn traffic(&self, shape: &Shape, p: Precision, act: f64) -> f64;

    /// `--train`: refusals of a training plan (the default refuses: a stage has no backward until
    /// it says how, `build_train`).
    fn check_train(&self, _plan: &Plan) -> Result<(), SpeedkitError> {
        Err(SpeedkitError::usage(format!(
            "{} has no training step (no backward through its ops). Fix: drop --train, or run a stage that has one.",
            self.name()
        )))
    }

    /// `--train`: the forward over `w`, f32 master weights held as `Var`s the optimizer updates in
    /// place. It must read (cast, quantize) them at every call, as autocast does, so the backward
    /// reaches each one; `Rebuild` does that by running `build` every step.
    fn build_train(&self, _w: &BlockWeights, plan: &Plan) -> anyhow::Result<Box<dyn Forward>> {
        Err(self.check_train(plan).err().unwrap_or_else(|| SpeedkitError::usage(format!("{} has no build_train", self.name()))).into())
    }

    /// `--train`: the optimizer that updates `vars` (default: `candle_nn::AdamW`).
    fn optimizer(&self, vars: Vec<Var>, _plan: &Plan) -> anyhow::Result<Box<dyn Optimize>> {
        Ok(Box::new(CandleAdamW(candle_nn::AdamW::new(vars, train_params())?)))
    }

    /// `ladder selftest`: this stage's GPU building blocks (on a CPU, their stand-ins) against CPU twins.
    fn selftest(&self, _device: &Device, _info: &DeviceInfo, _rows: &mut crate::selftest::Rows) {}
}

/// A built stage: what gets timed.
pub trait Forward {
    /// (B, T, C) -> (B, T, C)
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor>;

    /// The stage's own check of the forward `y` just made on `x` (stage 4: an fp32 twin on FP8 operands).
    fn self_check(&self, _x: &Tensor, _y: &Tensor) -> anyhow::Result<Option<NamedCheck>> {
        Ok(None)
    }

    /// Whether the forward just made took the path every later one takes (stage 4's first has no
    /// delayed scale yet); a CUDA graph capture warms up until it does.
    fn steady(&self) -> bool {
        true
    }

    /// What the forwards actually ran where it can differ from the plan (stage 4: a fusion
    /// cuBLASLt had no algorithm for); added to the row's notes.
    fn ran(&self) -> Vec<String> {
        Vec::new()
    }

    /// A training step's forward whose backward the stage schedules itself, without candle's
    /// tape: the output y and what its backward needs (`TrainPass`). `None`, the default: the
    /// step differentiates `forward` with candle's autograd.
    fn train_forward(&self, _x: &Tensor) -> Option<candle_core::Result<Box<dyn TrainPass>>> {
        None
    }
}

/// A training forward kept for its hand-scheduled backward (`Forward::train_forward`).
pub trait TrainPass {
    /// The forward's output y.
    fn output(&self) -> &Tensor;

    /// Every gradient of a loss whose gradient at y is `dy`: one per weight and one for x, keyed
    /// by the tensors the stage was built from and the forward given (the `Var`s' tensors), as
    /// candle's backward keys them. Runs once; a second call is an error.
    fn backward(&self, dy: &Tensor) -> candle_core::Result<GradStore>;
}

/// `--train`: an optimizer over the stage's weights.
pub trait Optimize {
    /// "candle-nn AdamW", "fused AdamW", ...
    fn name(&self) -> String;
    /// The loss's factor before the backward (f16's dynamic loss scale), divided out again in `step`.
    fn loss_scale(&self) -> f64 {
        1.0
    }
    /// One update from the gradients of the scaled loss; `false` when the step was skipped
    /// (a non-finite gradient under loss scaling).
    fn step(&mut self, grads: &GradStore) -> anyhow::Result<bool>;
}

/// Every stage's AdamW: candle-nn's defaults but lr 1e-4, so timed steps keep the block in range.
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

/// A training forward that runs `build` on the current weights at every call, so its casts happen
/// once per step, as autocast's do, and the backward reaches the weights through them.
pub struct Rebuild<S> {
    pub stage: S,
    pub weights: BlockWeights,
    pub plan: Plan,
}

impl<S: Stage> Forward for Rebuild<S> {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        self.built()?.forward(x)
    }

    /// The built stage's own scheduled pass, or else the tape through the same build: one build
    /// (one set of casts) per step either way.
    fn train_forward(&self, x: &Tensor) -> Option<candle_core::Result<Box<dyn TrainPass>>> {
        let built = match self.built() {
            Ok(built) => built,
            Err(e) => return Some(Err(e)),
        };
        Some(match built.train_forward(x) {
            Some(pass) => pass,
            None => built.forward(x).map(TapePass::boxed),
        })
    }
}

/// A training forward left to candle's autograd: y as the tape recorded it; the backward
/// differentiates ⟨y, dy⟩, whose gradient at y is dy.
pub struct TapePass {
    y: Tensor,
}

impl TapePass {
    pub fn boxed(y: Tensor) -> Box<dyn TrainPass> {
        Box::new(TapePass { y })
    }
}

impl TrainPass for TapePass {
    fn output(&self) -> &Tensor {
        &self.y
    }

    fn backward(&self, dy: &Tensor) -> candle_core::Result<GradStore> {
        (self.y.to_dtype(candle_core::DType::F32)? * dy)?.sum_all()?.backward()
    }
}

impl<S: Stage> Rebuild<S> {
    fn built(&self) -> candle_core::Result<Box<dyn Forward>> {
        self.stage.build(&self.weights, &self.plan).map_err(|e| candle_core::Error::Msg(format!("{e:#}")))
    }
}

/// How a binary or the ladder finds a stage: `args` adds the flags it introduces, `make` builds it
/// from flags parsed by a command that `args` of it and every earlier stage augmented.
#[derive(Clone, Copy)]
pub struct StageEntry {
    pub args: fn(clap::Command) -> clap::Command,
    pub make: fn(&clap::ArgMatches) -> Result<Box<dyn Stage>, clap::Error>,
}

/// What the ladder asks `stage` for: its own precision if it has one, else the run's request.
pub fn ladder_request(stage: &dyn Stage, requested: PrecisionRequest) -> PrecisionRequest {
    stage.own_precision().map_or(requested, PrecisionRequest::Exactly)
}

/// Choose the precision for `asked`, assemble the plan and run the stage's plan-level refusals.
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

/// `plan` for a stage run alone: asked for `requested`, no CUDA graph, forward only.
pub fn plan_alone(
    stage: &dyn Stage,
    device: &Device,
    info: &DeviceInfo,
    shape: Shape,
    requested: PrecisionRequest,
) -> Result<Plan, SpeedkitError> {
    plan(stage, device, info, shape, requested, requested, false, false)
}
