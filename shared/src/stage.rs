//! The stage contract: every stage turns the same weights into the same function; what differs
//! is how (precision, kernels, fusion). The runner and the ladder only see this trait.

use crate::check::NamedCheck;
use crate::device::{DeviceInfo, GemmSwitches};
use crate::error::SpeedkitError;
use crate::preset::Shape;
use crate::weights::BlockWeights;
use candle_core::{Device, Tensor};
use serde::{Deserialize, Serialize};

/// The number format the block's matrix multiplications run in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Precision {
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

/// `--elementwise`: which unfused element-wise ops stage 2 uses on the CPU.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Elementwise {
    /// This module: multi-threaded, vectorised, one pass per op.
    Parallel,
    /// candle's CPU ops (single-threaded), as stages 0–1 use: the default, so that stage 2
    /// differs from stage 1 in its attention only.
    #[default]
    Candle,
}

/// A stage's precision decision: the precision, and one sentence saying why.
pub type PrecisionChoice = (Precision, String);

/// How stage 4 picks the scale of each activation it quantises to FP8 (`--fp8-recipe`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Fp8Recipe {
    /// From the amax of the last calls (a rolling history), TransformerEngine's default.
    #[default]
    Delayed,
    /// From the amax of the very tensor being quantised: one extra reduction per GEMM.
    Current,
}

impl Fp8Recipe {
    pub fn name(self) -> &'static str {
        match self {
            Fp8Recipe::Delayed => "delayed",
            Fp8Recipe::Current => "current",
        }
    }
}

/// `--attention-kernel v1|v2`: which of stage 2's own CUDA attention kernels stages 2–4 run
/// (`stage2_sdpa/kernels/flash_attn.cu` = v1, the WMMA teaching kernel; `flash_attn_v2.cu` =
/// v2, register-resident mma.sync). CUDA only: the CPU has one attention kernel, and a build
/// with `flash-attn` runs candle-flash-attn; both refuse the flag rather than ignore it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum AttentionKernel {
    V1,
    V2,
}

impl AttentionKernel {
    pub fn name(self) -> &'static str {
        match self {
            AttentionKernel::V1 => "v1",
            AttentionKernel::V2 => "v2",
        }
    }
}

/// Stage 4 on Hopper/Ada: whether cuBLASLt's FP8 GEMMs use fast accumulation
/// (`CUBLASLT_MATMUL_DESC_FAST_ACCUM`: partial sums stay in the tensor cores' reduced-precision
/// accumulator instead of being promoted to f32 every few k-steps). On by default, as
/// TransformerEngine runs its forward GEMMs; the twin check's tolerance depends on it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Fp8FastAccum {
    #[default]
    On,
    Off,
}

/// Run options that only some stages read (today: stage 4's FP8 flags and --cuda-graph); every stage gets them
/// in its `Plan` so the runner and the ladder pass one thing.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StageOptions {
    /// `--fp8-recipe`
    pub fp8_recipe: Fp8Recipe,
    /// `--fp8-emulate`: run FP8 as quantise-dequantise on a GPU without FP8 tensor cores.
    pub fp8_emulate: bool,
    /// `--fp8-fast-accum on|off`
    pub fp8_fast_accum: Fp8FastAccum,
    /// `--cuda-graph`: the forward will be captured once and replayed (stateful stages refuse).
    pub cuda_graph: bool,
    /// `--elementwise`: stage 2's unfused CPU element-wise ops, candle's (default) or parallel.
    pub elementwise: Elementwise,
    /// `--fusions`: which of stage 3's fusions are on (all by default; `ladder --ablate` removes
    /// one at a time).
    pub fusions: Fusions,
    /// `--fp8-fusions`: None when not given (every fusion the recipe allows:
    /// `Fp8Fusions::effective`), so a request the recipe cannot honour is refused, not ignored.
    pub fp8_fusions: Option<Fp8Fusions>,
    /// Stage 2 ablation: keep stages 0–1's head split/merge copies around the fused kernel, so
    /// the kernel's gain and the copies' are measured apart.
    pub attention_copies: bool,
    /// `--attention-kernel`: None = the default (v2 on CUDA); Some only when asked for, so a
    /// request the device cannot honour is refused, not ignored.
    pub attention_kernel: Option<AttentionKernel>,
    /// The run's `--precision` for the stages without a precision of their own: stage 4 keeps
    /// stage 3's activation precision at the same request, so FP8 is its only change.
    pub requested: PrecisionRequest,
}

/// Stage 3's four fusions, each switchable on its own (`--fusions ln,qkv,epilogue,add-ln`).
/// A fusion that is off runs its slow twin, the way stage 2 computes that part.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Fusions {
    /// LayerNorm in one pass per row, the cast to the GEMM dtype included (off: stage 0's LayerNorm from primitive ops).
    pub ln: bool,
    /// q, k and v from one (3C, C) GEMM (off: three (C, C) GEMMs).
    pub qkv: bool,
    /// Bias, bias + GELU and bias + residual applied inside the GEMM (off: separate element-wise passes).
    pub epilogue: bool,
    /// proj's residual add and LayerNorm 2 in one pass (off: the add, then LayerNorm).
    pub add_ln: bool,
}

impl Default for Fusions {
    fn default() -> Self {
        Fusions::ALL
    }
}

impl Fusions {
    pub const ALL: Fusions = Fusions { ln: true, qkv: true, epilogue: true, add_ln: true };
    pub const NONE: Fusions = Fusions { ln: false, qkv: false, epilogue: false, add_ln: false };
    /// The names `--fusions` takes, in forward order.
    pub const NAMES: [&'static str; 4] = ["ln", "qkv", "epilogue", "add-ln"];

    fn flags(&self) -> [bool; 4] {
        [self.ln, self.qkv, self.epilogue, self.add_ln]
    }

    fn from_flags([ln, qkv, epilogue, add_ln]: [bool; 4]) -> Fusions {
        Fusions { ln, qkv, epilogue, add_ln }
    }

    /// These fusions with `name` (one of `NAMES`) off.
    pub fn without(self, name: &str) -> Fusions {
        Fusions::from_flags(switch_off(self.flags(), &Fusions::NAMES, name))
    }

    /// The names of the fusions that are on, in `NAMES` order.
    pub fn on(&self) -> Vec<&'static str> {
        names_on(self.flags(), &Fusions::NAMES)
    }

    /// "all", "none", or the list of those on, as `--fusions` takes it.
    pub fn describe(&self) -> String {
        describe(self.flags(), &Fusions::NAMES)
    }
}

impl std::str::FromStr for Fusions {
    type Err = String;
    /// "all", "none", or a comma-separated list of the fusions to keep on.
    fn from_str(s: &str) -> Result<Self, String> {
        parse_switches(s, &Fusions::NAMES, "stage 3's fusions").map(Fusions::from_flags)
    }
}

/// Stage 4's producer fusions (`--fp8-fusions ln,fc1`): the producer of an FP8 GEMM's input
/// writes it in E4M3 with the GEMM's scale and records its amax, so the GEMM skips its own
/// quantisation pass. The scale must be known before the producer writes, so they need delayed
/// scaling (`--fp8-recipe delayed`), as in TransformerEngine.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Fp8Fusions {
    /// Both LayerNorms write E4M3 for the GEMM after them (qkv, fc1).
    pub ln: bool,
    /// fc1's GEMM writes E4M3 for fc2 (cuBLASLt's D scale and amax_D).
    pub fc1: bool,
}

impl Fp8Fusions {
    pub const ALL: Fp8Fusions = Fp8Fusions { ln: true, fc1: true };
    pub const NONE: Fp8Fusions = Fp8Fusions { ln: false, fc1: false };
    /// The names `--fp8-fusions` takes, in forward order.
    pub const NAMES: [&'static str; 2] = ["ln", "fc1"];

    fn flags(&self) -> [bool; 2] {
        [self.ln, self.fc1]
    }

    fn from_flags([ln, fc1]: [bool; 2]) -> Fp8Fusions {
        Fp8Fusions { ln, fc1 }
    }

    /// These fusions with `name` (one of `NAMES`) off.
    pub fn without(self, name: &str) -> Fp8Fusions {
        Fp8Fusions::from_flags(switch_off(self.flags(), &Fp8Fusions::NAMES, name))
    }

    /// The names of the fusions that are on, in `NAMES` order.
    pub fn on(&self) -> Vec<&'static str> {
        names_on(self.flags(), &Fp8Fusions::NAMES)
    }

    /// "all", "none", or the list of those on, as `--fp8-fusions` takes it.
    pub fn describe(&self) -> String {
        describe(self.flags(), &Fp8Fusions::NAMES)
    }

    /// The fusions stage 4 runs: `requested` (`--fp8-fusions`; None = not given) under `recipe`.
    /// Not given: every fusion the recipe allows — all of them with delayed scaling, none with
    /// current scaling (the scale is this tensor's amax, unknown until the producer has written
    /// it all). Given: as asked; `check` refuses what the recipe cannot honour.
    pub fn effective(requested: Option<Fp8Fusions>, recipe: Fp8Recipe) -> Fp8Fusions {
        match (requested, recipe) {
            (Some(f), _) => f,
            (None, Fp8Recipe::Delayed) => Fp8Fusions::ALL,
            (None, Fp8Recipe::Current) => Fp8Fusions::NONE,
        }
    }

    /// Refuse an explicit `--fp8-fusions` that `recipe` cannot honour (a usage error, exit 2).
    pub fn check(requested: Option<Fp8Fusions>, recipe: Fp8Recipe) -> Result<(), SpeedkitError> {
        match requested {
            Some(f) if recipe == Fp8Recipe::Current && !f.on().is_empty() => Err(SpeedkitError::usage(format!(
                "--fp8-fusions {} asks the producers (LayerNorm, fc1) to write E4M3 with the next GEMM's scale, but \
                 --fp8-recipe current takes that scale from the amax of the very tensor being written, which is only \
                 known once the producer has written all of it: a fused producer needs the scale before it starts, \
                 which only delayed scaling (an amax history) gives. Fix: drop --fp8-fusions (or pass none) to run \
                 current scaling unfused, or use --fp8-recipe delayed to run the fusions.",
                f.describe()
            ))),
            _ => Ok(()),
        }
    }
}

impl std::str::FromStr for Fp8Fusions {
    type Err = String;
    /// "all", "none", or a comma-separated list of the fusions to keep on.
    fn from_str(s: &str) -> Result<Self, String> {
        parse_switches(s, &Fp8Fusions::NAMES, "stage 4's FP8 fusions").map(Fp8Fusions::from_flags)
    }
}

/// `flags` with the one named `name` (in `names`) off.
fn switch_off<const N: usize>(mut flags: [bool; N], names: &[&str; N], name: &str) -> [bool; N] {
    if let Some(i) = names.iter().position(|n| *n == name) {
        flags[i] = false;
    }
    flags
}

fn names_on<const N: usize>(flags: [bool; N], names: &[&'static str; N]) -> Vec<&'static str> {
    names.iter().zip(flags).filter(|(_, on)| *on).map(|(n, _)| *n).collect()
}

fn describe<const N: usize>(flags: [bool; N], names: &[&'static str; N]) -> String {
    match flags {
        f if f.iter().all(|on| *on) => "all".into(),
        f if f.iter().all(|on| !on) => "none".into(),
        f => names_on(f, names).join(","),
    }
}

/// "all", "none", or a comma-separated list of some of `names`: one flag per name (`--fusions`,
/// `--fp8-fusions`). `what` names the list in the error.
fn parse_switches<const N: usize>(s: &str, names: &[&str; N], what: &str) -> Result<[bool; N], String> {
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

/// What `Stage::implementation` starts with when the stage imitates a number format instead of
/// running it on hardware; the runner then reports no % of peak for it.
pub const EMULATED: &str = "emulated";

/// Everything a stage's `build` may depend on, decided before it runs.
#[derive(Clone, Debug)]
pub struct Plan {
    pub device: Device,
    pub info: DeviceInfo,
    pub precision: Precision,
    /// One sentence: why this precision (the policy's decision or the user's override).
    pub precision_reason: String,
    pub shape: Shape,
    pub options: StageOptions,
}

/// One rung of the ladder. `build` runs once, outside timing (convert, fuse, quantize the
/// weights; set candle's global switches); `forward` is what gets timed.
pub trait Stage: Sized {
    /// Crate name, e.g. "stage2_sdpa".
    const NAME: &'static str;
    /// One line: the technique this stage adds.
    const TECHNIQUE: &'static str;
    /// The precision this stage *is*, when it is one (stage 0: fp32, stage 4: fp8): the ladder
    /// asks it for that, whatever `--precision` says for the stages in between.
    const OWN_PRECISION: Option<Precision> = None;

    /// The precision this stage runs at on this device for this request, and why; an error
    /// (exit 2) when the request is something this stage or device cannot do.
    fn choose_precision(info: &DeviceInfo, requested: PrecisionRequest) -> Result<PrecisionChoice, SpeedkitError>;

    /// candle's global GEMM switches this stage runs with; `build` must apply them.
    fn switches(plan: &Plan) -> GemmSwitches;

    /// Shape limits beyond `Shape::validate` (the default: the naive (B, n_head, T, T) score
    /// matrix must be addressable).
    fn check_shape(shape: &Shape) -> Result<(), SpeedkitError> {
        shape.validate_score_matrix()
    }

    /// Bytes this stage needs at its widest point, to refuse runs that cannot fit. The default
    /// is the naive block's (the T x T scores dominate at long T).
    fn estimate_bytes(shape: &Shape) -> u128 {
        shape.estimate_naive_bytes()
    }

    /// What the reader should know about running this plan (misaligned dimensions, a
    /// precision that is slow on this device, ...). Printed and stored with the record.
    fn notes(_plan: &Plan) -> Vec<String> {
        Vec::new()
    }

    /// Which implementation runs this plan, when a stage has more than one (stage 2's attention
    /// kernel, stage 4's real or emulated FP8). Shown in the table beside the precision and
    /// stored in the record, so a number is never read as something else than what ran.
    fn implementation(_plan: &Plan) -> Option<String> {
        None
    }

    /// Refusals that depend on the whole plan (device, precision, shape and options together),
    /// checked when the plan is made, so `ladder report` shows them too. Default: none.
    fn check_plan(_plan: &Plan) -> Result<(), SpeedkitError> {
        Ok(())
    }

    fn build(weights: &BlockWeights, plan: &Plan) -> anyhow::Result<Self>;

    /// (B, T, C) -> (B, T, C)
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor>;

    /// A check of this stage's own, beyond the fp32 reference, run on the output `y` of the
    /// forward just made on `x` (stage 4: the fp32 twin on FP8-rounded operands). Default: none.
    fn self_check(&self, _x: &Tensor, _y: &Tensor) -> anyhow::Result<Option<NamedCheck>> {
        Ok(None)
    }
}

/// A built stage behind a pointer, so the ladder can hold different stages in one list.
pub trait Forward {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor>;

    /// `Stage::self_check` of the stage behind the pointer.
    fn self_check(&self, _x: &Tensor, _y: &Tensor) -> anyhow::Result<Option<NamedCheck>> {
        Ok(None)
    }
}

struct Built<S: Stage>(S);

impl<S: Stage> Forward for Built<S> {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        self.0.forward(x)
    }

    fn self_check(&self, x: &Tensor, y: &Tensor) -> anyhow::Result<Option<NamedCheck>> {
        self.0.self_check(x, y)
    }
}

/// A stage type turned into values: what the runner and the ladder iterate over.
#[derive(Clone, Copy)]
pub struct StageSpec {
    pub name: &'static str,
    pub technique: &'static str,
    pub own_precision: Option<Precision>,
    pub choose_precision: fn(&DeviceInfo, PrecisionRequest) -> Result<PrecisionChoice, SpeedkitError>,
    pub switches: fn(&Plan) -> GemmSwitches,
    pub check_shape: fn(&Shape) -> Result<(), SpeedkitError>,
    pub estimate_bytes: fn(&Shape) -> u128,
    pub notes: fn(&Plan) -> Vec<String>,
    pub implementation: fn(&Plan) -> Option<String>,
    pub check_plan: fn(&Plan) -> Result<(), SpeedkitError>,
    pub build: fn(&BlockWeights, &Plan) -> anyhow::Result<Box<dyn Forward>>,
}

impl StageSpec {
    pub fn of<S: Stage + 'static>() -> StageSpec {
        StageSpec {
            name: S::NAME,
            technique: S::TECHNIQUE,
            own_precision: S::OWN_PRECISION,
            choose_precision: S::choose_precision,
            switches: S::switches,
            check_shape: S::check_shape,
            estimate_bytes: S::estimate_bytes,
            notes: S::notes,
            implementation: S::implementation,
            check_plan: S::check_plan,
            build: |w, p| Ok(Box::new(Built(S::build(w, p)?)) as Box<dyn Forward>),
        }
    }

    /// What the ladder asks this stage for, given the run's `--precision`: its own precision if
    /// it has one, else the request.
    pub fn ladder_request(&self, requested: PrecisionRequest) -> PrecisionRequest {
        self.own_precision.map_or(requested, PrecisionRequest::Exactly)
    }

    /// Choose the precision and assemble the plan for this stage, with default options.
    pub fn plan(&self, device: &Device, info: &DeviceInfo, shape: Shape, requested: PrecisionRequest) -> Result<Plan, SpeedkitError> {
        self.plan_with(device, info, shape, requested, StageOptions::default())
    }

    /// Choose the precision, assemble the plan and run the stage's plan-level refusals.
    pub fn plan_with(
        &self,
        device: &Device,
        info: &DeviceInfo,
        shape: Shape,
        requested: PrecisionRequest,
        options: StageOptions,
    ) -> Result<Plan, SpeedkitError> {
        let (precision, precision_reason) = (self.choose_precision)(info, requested)?;
        let plan = Plan { device: device.clone(), info: info.clone(), precision, precision_reason, shape, options };
        (self.check_plan)(&plan)?;
        Ok(plan)
    }
}
