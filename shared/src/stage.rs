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
    pub elementwise: crate::elementwise::Elementwise,
    /// `--fusions`: which of stage 3's fusions are on (all by default; `ladder --ablate` removes
    /// one at a time).
    pub fusions: Fusions,
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

    fn slot(&mut self, name: &str) -> Option<&mut bool> {
        match name {
            "ln" => Some(&mut self.ln),
            "qkv" => Some(&mut self.qkv),
            "epilogue" => Some(&mut self.epilogue),
            "add-ln" => Some(&mut self.add_ln),
            _ => None,
        }
    }

    /// These fusions with `name` (one of `NAMES`) off.
    pub fn without(mut self, name: &str) -> Fusions {
        if let Some(on) = self.slot(name) {
            *on = false;
        }
        self
    }

    /// The names of the fusions that are on, in `NAMES` order.
    pub fn on(&self) -> Vec<&'static str> {
        let flags = [self.ln, self.qkv, self.epilogue, self.add_ln];
        Fusions::NAMES.iter().zip(flags).filter(|(_, on)| *on).map(|(n, _)| *n).collect()
    }

    /// "all", "none", or the list of those on, as `--fusions` takes it.
    pub fn describe(&self) -> String {
        match *self {
            Fusions::ALL => "all".into(),
            Fusions::NONE => "none".into(),
            _ => self.on().join(","),
        }
    }
}

impl std::str::FromStr for Fusions {
    type Err = String;
    /// "all", "none", or a comma-separated list of the fusions to keep on.
    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim() {
            "all" => return Ok(Fusions::ALL),
            "none" => return Ok(Fusions::NONE),
            // Empty is a typo or an unset variable, not "none" (as --precision '' is refused).
            "" => return Err("an empty list is not a choice of fusions. Fix: give all, none, or some of ln, qkv, epilogue, add-ln".into()),
            _ => {}
        }
        let mut f = Fusions::NONE;
        for name in s.split(',').map(str::trim) {
            match f.slot(name) {
                Some(on) => *on = true,
                None => {
                    return Err(format!(
                        "'{name}' is not one of stage 3's fusions. Fix: list some of {} (or all, or none)",
                        Fusions::NAMES.join(", ")
                    ))
                }
            }
        }
        Ok(f)
    }
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
