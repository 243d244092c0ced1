//! Stage 4 as the runner and the ladder see it (the block itself is `block.rs`): its FP8
//! producer fusions and the flags stage 4 introduces.

use crate::fp8::Fp8Mode;
use crate::fp8::Fp8Recipe;
use crate::gemm;
use crate::{Block, TrainBlock};
use candle_core::DType;
use clap::builder::{PossibleValuesParser, TypedValueParser};
use shared::device::{DeviceInfo, GemmSwitches};
use shared::perf::Traffic;
use shared::stage::{describe_switches, parse_switches, switch_off, switches_on, PrecisionChoice, EMULATED};
use shared::{BlockWeights, Forward, Plan, Precision, PrecisionRequest, Shape, SpeedkitError, Stage, StageEntry};
use stage1_tensorcore::precision;
use stage3_fused::{Fused, Fusions};

/// Stage 4's producer fusions (`--fp8-fusions ln,fc1`): the producer of an FP8 GEMM's input
/// writes it in E4M3 with the GEMM's scale and records its amax, so the GEMM skips its own
/// quantisation pass. The scale must be known before the producer writes, so they need delayed
/// scaling (`--fp8-recipe delayed`), as in TransformerEngine.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
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
        switches_on(self.flags(), &Fp8Fusions::NAMES)
    }

    /// "all", "none", or the list of those on, as `--fp8-fusions` takes it.
    pub fn describe(&self) -> String {
        describe_switches(self.flags(), &Fp8Fusions::NAMES)
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

/// The flags stage 4 introduces.
#[derive(clap::Args, Clone, Copy, Debug, PartialEq, Eq)]
pub struct Args {
    /// Stage 4: how activation scales are chosen — delayed (amax history) or current (this tensor's amax)
    #[arg(long, env = "SPEEDKIT_FP8_RECIPE", default_value = "delayed", value_parser = PossibleValuesParser::new(["delayed", "current"]).map(|s| if s == "current" { Fp8Recipe::Current } else { Fp8Recipe::Delayed }))]
    pub fp8_recipe: Fp8Recipe,
    /// Stage 4: on a GPU without FP8 tensor cores (SM < 8.9), emulate FP8 instead of refusing
    #[arg(long, env = "SPEEDKIT_FP8_EMULATE", action = clap::ArgAction::SetTrue, value_parser = clap::builder::BoolishValueParser::new())]
    pub fp8_emulate: bool,
    /// Stage 4 on Hopper/Ada: cuBLASLt's FP8 fast accumulation (on: faster, partial sums kept in the tensor cores' ~14-bit accumulator; off: promoted to f32 every few k-steps); the twin check's tolerance follows it
    // `Set`: a `bool` field's inferred action is SetTrue, which hands its own "true" to this parser.
    #[arg(long, env = "SPEEDKIT_FP8_FAST_ACCUM", action = clap::ArgAction::Set, default_value = "on", value_parser = PossibleValuesParser::new(["on", "off"]).map(|s| s == "on"))]
    pub fp8_fast_accum: bool,
    /// Stage 4: which producers write E4M3 for the next GEMM, so it skips its quantise pass: ln (both LayerNorms, for qkv and fc1), fc1 (its GEMM, for fc2), all or none [default: all the recipe allows: all with delayed scaling, none with current]
    #[arg(long, env = "SPEEDKIT_FP8_FUSIONS")]
    pub fp8_fusions: Option<Fp8Fusions>,
}

impl Default for Args {
    fn default() -> Self {
        Args { fp8_recipe: Fp8Recipe::Delayed, fp8_emulate: false, fp8_fast_accum: true, fp8_fusions: None }
    }
}

/// Stage 4 as the runner and the ladder see it: stage 3's flags (its attention; its fusions,
/// which stage 4 runs as written and labels when they differ) and its own.
#[derive(Clone, Copy, Debug, Default)]
pub struct Fp8 {
    pub fused: Fused,
    pub args: Args,
}

/// How a binary or the ladder finds stage 4.
pub const STAGE: StageEntry = StageEntry { args: <Args as clap::Args>::augment_args, make: |m| Ok(Box::new(Fp8::from_matches(m)?)) };

impl Fp8 {
    /// Stage 4 configured by parsed flags (stages 2 and 3's and its own).
    pub fn from_matches(m: &clap::ArgMatches) -> Result<Fp8, clap::Error> {
        Ok(Fp8 { fused: Fused::from_matches(m)?, args: <Args as clap::FromArgMatches>::from_arg_matches(m)? })
    }

    /// Does `plan` run FP8 on tensor cores, or emulate it?
    pub fn mode(&self, plan: &Plan) -> Fp8Mode {
        if plan.info.is_cuda() && plan.info.has_fp8_tensor_cores() {
            Fp8Mode::Cublaslt
        } else {
            Fp8Mode::Emulated
        }
    }

    /// The producer fusions this stage runs (`--fp8-fusions`; by default all the recipe allows).
    pub fn fusions(&self) -> Fp8Fusions {
        Fp8Fusions::effective(self.args.fp8_fusions, self.args.fp8_recipe)
    }

    /// The activation dtype stage 4 runs with, and a note when it must differ from stage 3's at
    /// the same `--precision` (`Plan::requested`). Stage 3 is asked as the ladder asks it:
    /// fp8 (this stage's own precision) means stage 3's auto choice.
    pub fn activation_dtype(&self, plan: &Plan) -> (DType, Option<String>) {
        let request = match plan.requested {
            PrecisionRequest::Exactly(Precision::Fp8) => PrecisionRequest::Auto,
            r => r,
        };
        let stage3 = self.fused.choose_precision(&plan.info, request).ok().map(|(p, _)| precision::gemm_dtype(p));
        if plan.info.is_cuda() {
            // cuBLASLt's FP8 GEMMs store bf16 (and stage 2's CUDA attention reads bf16 or f16).
            let note = match stage3 {
                Some(DType::BF16) => None,
                other => Some(format!(
                    "activations in bf16, not stage 3's {}: cuBLASLt's FP8 GEMMs store bf16, so stage 4 differs from stage 3 in that too",
                    other.map_or("choice (it cannot run this request)".into(), |d| dtype_name(d).to_string())
                )),
            };
            return (DType::BF16, note);
        }
        match stage3 {
            Some(dt) => (dt, None),
            None => (DType::F32, Some("activations in f32: stage 3 cannot run this --precision, so stage 4 keeps them f32".into())),
        }
    }
}

impl Stage for Fp8 {
    fn name(&self) -> &'static str {
        "stage4_fp8"
    }

    fn technique(&self) -> &'static str {
        "FP8 E4M3 GEMMs with per-tensor scaling (delayed or current)"
    }

    fn own_precision(&self) -> Option<Precision> {
        Some(Precision::Fp8)
    }

    fn choose_precision(&self, info: &DeviceInfo, requested: PrecisionRequest) -> Result<PrecisionChoice, SpeedkitError> {
        let sm = info.sm.map(|(a, b)| format!("SM {a}.{b}")).unwrap_or_else(|| "the CPU".into());
        match requested {
            PrecisionRequest::Auto | PrecisionRequest::Exactly(Precision::Fp8) => Ok((
                Precision::Fp8,
                if !info.is_cuda() {
                    "FP8 is this stage's technique; the CPU has no FP8 units, so it is emulated (E4M3 rounding, f32 GEMMs): FP8's numerics, not its speed".into()
                } else if info.has_fp8_tensor_cores() {
                    format!("FP8 is this stage's technique: E4M3 GEMMs on {sm}'s FP8 tensor cores, f32 accumulate, bf16 out")
                } else {
                    format!("FP8 is this stage's technique; {sm} has no FP8 tensor cores (SM 8.9+), so it can only be emulated")
                },
            )),
            PrecisionRequest::Exactly(p) => Err(SpeedkitError::usage(format!(
                "stage 4's technique is FP8 GEMMs, so it runs --precision fp8 (or auto) only, not {p}. \
                 Fix: drop --precision or pass fp8; {p} is what stages 1-3 run (in the ladder, --precision \
                 applies to them and stage 4 stays fp8)."
            ))),
        }
    }

    fn check_plan(&self, plan: &Plan) -> Result<(), SpeedkitError> {
        Fp8Fusions::check(self.args.fp8_fusions, self.args.fp8_recipe)?; // fusions need delayed scaling
        self.fused.sdpa.check_plan(plan)?; // stage 2's attention flags and head size
        let info = &plan.info;
        if !info.is_cuda() {
            return Ok(()); // emulated, any shape
        }
        let sm = info.sm.map_or("?".into(), |(a, b)| format!("{a}.{b}"));
        if !info.has_fp8_tensor_cores() && !self.args.fp8_emulate {
            return Err(SpeedkitError::usage(format!(
                "{} (SM {sm}) has no FP8 tensor cores: they arrived with Ada and Hopper (SM 8.9 and 9.0). Running \
                 stage 4 here would only emulate FP8 (round to E4M3 and back, then bf16/f32 GEMMs) — its numerics, \
                 not its speed. Fix: pass --fp8-emulate to study the numerics on this GPU, or run stage 4 on an \
                 SM 8.9+ GPU (L4, L40, RTX 4090, H100, H200).",
                info.name
            )));
        }
        // Stage 2's attention on CUDA, in bf16.
        stage2_sdpa::harness::check_device(info, Precision::Bf16)?;
        // --cuda-graph with delayed scaling is fine: the history lives on the device and our
        // kernels update it in place (quant_cuda), so every replay advances it.
        if self.mode(plan) == Fp8Mode::Cublaslt {
            let s = plan.shape;
            gemm::check_dims(16, s.d_model, s.ff).map_err(SpeedkitError::usage)?;
            gemm::fp8_gemm_args(s.batch * s.seq, s.d_model, s.d_model, false).map_err(SpeedkitError::usage)?;
            // the token count
        }
        Ok(())
    }

    fn implementation(&self, plan: &Plan) -> Option<String> {
        let recipe = self.args.fp8_recipe.name();
        let fused = match plan.train {
            false => format!("fp8 fusions {}", self.fusions().describe()),
            true => match self.mode(plan) {
                Fp8Mode::Cublaslt => {
                    format!("fp8 fusions none (training), HYBRID backward: cuBLASLt E4M3 × E5M2 (E5M2 dY), {recipe} scaling")
                }
                Fp8Mode::Emulated => format!("fp8 fusions none (training), HYBRID backward: E5M2 dY, {recipe} scaling"),
            },
        };
        let mut label = match self.mode(plan) {
            Fp8Mode::Cublaslt => format!("cuBLASLt E4M3, {recipe} scaling, {fused}"),
            Fp8Mode::Emulated => format!("{EMULATED}, {recipe} scaling, {fused}"),
        };
        if self.fused.fusions != Fusions::ALL {
            label.push_str(", stage 3's fusions all (stage 4 runs them as written)");
        }
        Some(label)
    }

    fn check_shape(&self, _shape: &Shape) -> Result<(), SpeedkitError> {
        Ok(()) // fused attention: no (B, n_head, T, T) tensor exists
    }

    fn estimate_bytes(&self, shape: &Shape) -> u128 {
        stage2_sdpa::harness::estimate_fused_bytes(shape)
    }

    fn estimate_train_bytes(&self, shape: &Shape) -> shared::train::TrainBytes {
        stage2_sdpa::harness::estimate_fused_train_bytes(shape)
    }

    fn switches(&self, _plan: &Plan) -> GemmSwitches {
        // TF32 off: the emulated GEMMs and the twin check must be true f32.
        GemmSwitches::OFF
    }

    fn notes(&self, plan: &Plan) -> Vec<String> {
        // Alignment advice; the attention backward's note by the dtype attention runs in (the
        // activations', bf16 at fp8).
        let mut notes = stage1_tensorcore::TensorCore.notes(plan);
        notes.extend(stage2_sdpa::cuda_attention_backward_note(plan, self.activation_dtype(plan).0));
        if self.fused.fusions != Fusions::ALL {
            notes.push(format!(
                "--fusions {} applies to stage 3 only: stage 4 runs stage 3's fusions as written, so its \"vs previous\" also prices them",
                self.fused.fusions.describe()
            ));
        }
        // Which GEMMs and dtypes ran, the runner's notes say (`shared::ran`); here only why the
        // activations' dtype differs from stage 3's where it does.
        notes.extend(self.activation_dtype(plan).1);
        notes
    }

    fn build(&self, w: &BlockWeights, plan: &Plan) -> anyhow::Result<Box<dyn Forward>> {
        Ok(Box::new(Block::build(w, plan, self)?))
    }

    /// Training (`TrainBlock`), with the producer fusions off: emulated on the CPU; on CUDA
    /// through cuBLASLt's FP8 GEMMs, forward and backward, where the GPU has FP8 tensor cores (a
    /// backward GEMM cuBLASLt offers no algorithm for falls back, and the row's notes say so).
    fn check_train(&self, plan: &Plan) -> Result<(), SpeedkitError> {
        if plan.info.is_cuda() && self.mode(plan) == Fp8Mode::Emulated {
            return Err(SpeedkitError::usage(format!(
                "stage 4 trains on CUDA through cuBLASLt's FP8 GEMMs (E4M3 forward, E5M2 gradients: TransformerEngine's \
                 HYBRID recipe), which need FP8 tensor cores, and {} has none (SM 8.9+); the recipe's emulation \
                 (hybrid.rs) runs its backward on the CPU only, so --fp8-emulate cannot train here. Fix: train stage 4 \
                 on an SM 8.9+ GPU (L4, L40, RTX 4090, H100, H200), or with --device cpu (FP8's numerics, emulated), or \
                 train stage 3 on this GPU.",
                plan.info.name
            )));
        }
        if let Some(f) = self.args.fp8_fusions.filter(|f| !f.on().is_empty()) {
            return Err(SpeedkitError::usage(format!(
                "--fp8-fusions {} cannot train: the fused producers (LayerNorm, fc1) write the next GEMM's input in E4M3 \
                 directly, and those ops have no backward, so no gradient would reach the LayerNorms or fc1 through them. \
                 Fix: drop --fp8-fusions (training runs them all off, and the label says so) or pass none.",
                f.describe()
            )));
        }
        Ok(())
    }

    fn build_train(&self, w: &BlockWeights, plan: &Plan) -> anyhow::Result<Box<dyn Forward>> {
        self.check_train(plan)?;
        Ok(Box::new(TrainBlock::build(w, plan, self)?))
    }

    /// Stage 3's fused AdamW: FP8 changes the GEMMs, not the update of the f32 master weights.
    fn optimizer(&self, vars: Vec<candle_core::Var>, plan: &Plan) -> anyhow::Result<Box<dyn shared::stage::Optimize>> {
        self.fused.optimizer(vars, plan)
    }

    fn ablations(&self, plan: &Plan) -> Vec<(String, Box<dyn Stage>)> {
        // The producer fusions its recipe runs, one at a time; "fp8" in the label keeps
        // "without fp8 ln" apart from stage 3's "without ln". Training runs them all off already.
        if plan.train {
            return Vec::new();
        }
        let fusions = self.fusions();
        let without = |name: &str| -> (String, Box<dyn Stage>) {
            let args = Args { fp8_fusions: Some(fusions.without(name)), ..self.args };
            (format!("without fp8 {name}"), Box::new(Fp8 { args, ..*self }))
        };
        fusions.on().into_iter().map(without).collect()
    }

    fn traffic(&self, shape: &Shape, p: Precision, act: f64) -> f64 {
        // Stage 3's passes, with E4M3 GEMM operands (and their quantising passes: `Traffic`).
        let t = Traffic::new(shape, p, act);
        let fc2_residual = if act >= 4.0 { 0.0 } else { 2.0 * t.pass_c };
        t.gemms + t.fused_attention + 3.0 * t.pass_c + fc2_residual
    }

    fn selftest(&self, device: &candle_core::Device, info: &DeviceInfo, rows: &mut shared::selftest::Rows) {
        crate::selftest::fp8(rows, device, info);
        crate::selftest::fp8_kernels(rows, device);
        crate::selftest::fp8_fusions(rows, device, info);
        crate::selftest::fp8_train(rows, device, info);
        // (Its CUDA graph row, `selftest::graph_delayed_scaling`, runs with the ladder's graph
        // rows, last.)
    }
}

fn dtype_name(dt: DType) -> &'static str {
    match dt {
        DType::F32 => "f32",
        DType::BF16 => "bf16",
        DType::F16 => "f16",
        _ => "another dtype",
    }
}
