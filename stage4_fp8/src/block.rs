//! Stage 4's block for the runner and the ladder: stage 3's forward with FP8 GEMMs, and the
//! flags stage 4 introduces.

use crate::fp8::Fp8Recipe;
use crate::fp8::{Fp8Linear, Fp8Mode, Fp8Target, Input, ScalingConfig};
use crate::hybrid::{DelayedScale, GradScaling, HybridLinear};
use crate::{gemm, producers, twin};
use candle_core::{DType, IndexOp, Tensor};
use clap::builder::{PossibleValuesParser, TypedValueParser};
use shared::breakdown::part;
use shared::check::{compare_within, NamedCheck};
use shared::device::{DeviceInfo, GemmSwitches};
use shared::perf::Traffic;
use shared::stage::{describe_switches, parse_switches, switch_off, switches_on, PrecisionChoice, EMULATED};
use shared::{BlockWeights, Forward, Plan, Precision, PrecisionRequest, Shape, SpeedkitError, Stage, StageEntry};
use stage1_tensorcore::precision;
use stage2_sdpa::attention;
use stage3_fused::ops::{add_layer_norm, layer_norm};
use stage3_fused::{Fused, Fusions};
use std::sync::{Arc, Mutex};

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
            None => {
                (DType::F32, Some("activations in f32: stage 3 cannot run this --precision, so stage 4 keeps the CPU's default".into()))
            }
        }
    }
}

pub struct Block {
    ln1_g: Tensor,   // (C) f32
    ln1_b: Tensor,   // (C) f32
    qkv: Fp8Linear,  // (3C, C) E4M3: q, k and v weights stacked, one GEMM
    proj: Fp8Linear, // (C, C) E4M3
    ln2_g: Tensor,   // (C) f32
    ln2_b: Tensor,   // (C) f32
    fc1: Fp8Linear,  // (FF, C) E4M3, GELU in the epilogue
    fc2: Fp8Linear,  // (C, FF) E4M3
    n_head: usize,
    dtype: DType,                    // what the GEMMs write and attention reads: stage 3's activation dtype (`activation_dtype`)
    attn: attention::Implementation, // stage 2's attention kernel (`--attention-kernel` on CUDA)
    fusions: Fp8Fusions,             // producers writing E4M3 for the next GEMM (`fusions`)
    // Whether fc1 can write fc2's E4M3 input on this device: asked at the first fused call.
    fc1_e4m3: std::sync::OnceLock<bool>,
}

/// The row's note when fc1's E4M3 output fell back (`Block::fc1_writes_e4m3`).
pub const FC1_FALLBACK: &str = "fp8 fusion fc1 not run: cuBLASLt has no algorithm for fc1's GELU + bias epilogue with an \
     E4M3 output on this GPU, so fc1 wrote bf16 and fc2 quantised it with its own kernel (as --fp8-fusions ln runs)";

/// Tolerance of the pre-rounded twin check (`twin`): measured ~1e-4 on a CPU without AVX512-BF16
/// (emulated). On a GPU, and on a CPU with AVX512-BF16, the fused attention rounds its
/// probabilities to bf16 before P·V and the twin does not, so bf16-sized differences (~4e-4 on
/// the CPU, a few 1e-3 on a GPU) are expected there; a wrong scale or layout is O(1).
pub const TWIN_TOLERANCE: f64 = 1e-2;

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
            true => format!("fp8 fusions none (training), HYBRID backward: E5M2 dY, {recipe} scaling"),
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
        let mut notes = self.fused.sdpa.notes(plan); // alignment advice, which attention runs
        if self.fused.fusions != Fusions::ALL {
            notes.push(format!(
                "--fusions {} applies to stage 3 only: stage 4 runs stage 3's fusions as written, so its \"vs previous\" also prices them",
                self.fused.fusions.describe()
            ));
        }
        if self.mode(plan) == Fp8Mode::Emulated {
            notes.push("FP8 emulated: activations and weights rounded to E4M3 with per-tensor scales, then f32 GEMMs".into());
        }
        let (dt, forced) = self.activation_dtype(plan);
        notes.push(forced.unwrap_or_else(|| {
            format!("activations in {}, as stage 3 at this --precision: only the GEMMs' format differs", dtype_name(dt))
        }));
        notes
    }

    fn build(&self, w: &BlockWeights, plan: &Plan) -> anyhow::Result<Box<dyn Forward>> {
        Ok(Box::new(Block::build(w, plan, self)?))
    }

    /// Training is emulated on the CPU (`TrainBlock`), with the producer fusions off.
    fn check_train(&self, plan: &Plan) -> Result<(), SpeedkitError> {
        if plan.info.is_cuda() {
            return Err(SpeedkitError::usage(
                "stage 4 cannot train on CUDA yet: its backward is TransformerEngine's HYBRID recipe (E5M2 gradients \
                 against the forward's E4M3 operands), and only its CPU emulation is built (hybrid.rs); no cuBLASLt FP8 \
                 backward GEMMs exist here, and the forward's E4M3 operands live on the GPU. Fix: train stage 4 with \
                 --device cpu (FP8's numerics, emulated), or train stage 3 on this GPU."
                    .to_string(),
            ));
        }
        match self.args.fp8_fusions {
            Some(f) if !f.on().is_empty() => Err(SpeedkitError::usage(format!(
                "--fp8-fusions {} cannot train: the fused producers (LayerNorm, fc1) write the next GEMM's input in E4M3 \
                 directly, and those ops have no backward, so no gradient would reach the LayerNorms or fc1 through them. \
                 Fix: drop --fp8-fusions (training runs them all off, and the label says so) or pass none.",
                f.describe()
            ))),
            _ => Ok(()),
        }
    }

    fn build_train(&self, w: &BlockWeights, plan: &Plan) -> anyhow::Result<Box<dyn Forward>> {
        self.check_train(plan)?;
        Ok(Box::new(TrainBlock::build(w, plan, self)?))
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
        // (Its CUDA graph row, `selftest::graph_delayed_scaling`, runs with the ladder's graph
        // rows, last.)
    }
}

impl Block {
    pub fn build(w: &BlockWeights, plan: &Plan, stage: &Fp8) -> anyhow::Result<Block> {
        stage.switches(plan).apply();
        stage.check_plan(plan)?;
        let attn = stage2_sdpa::harness::for_run(&plan.device, stage.fused.sdpa.args.attention_kernel)?;
        let (mode, scaling) = (stage.mode(plan), ScalingConfig { recipe: stage.args.fp8_recipe, ..ScalingConfig::default() });
        let dtype = stage.activation_dtype(plan).0;
        let fast_accum = stage.args.fp8_fast_accum;
        let linear = |w: &Tensor, b: &Tensor, gelu: bool, name: &str| {
            Ok::<_, anyhow::Error>(
                Fp8Linear::with_output(w, b, gelu, mode, scaling, name, dtype)
                    .map_err(crate::harness::fp8_error)?
                    .with_fast_accum(fast_accum),
            )
        };
        Ok(Block {
            ln1_g: w.ln1_g.clone(),
            ln1_b: w.ln1_b.clone(),
            qkv: linear(&w.w_qkv, &w.b_qkv, false, "qkv")?, // one (3C, C) GEMM, as in stage 3
            proj: linear(&w.w_proj, &w.b_proj, false, "proj")?,
            ln2_g: w.ln2_g.clone(),
            ln2_b: w.ln2_b.clone(),
            fc1: linear(&w.w_fc1, &w.b_fc1, true, "fc1")?,
            fc2: linear(&w.w_fc2, &w.b_fc2, false, "fc2")?,
            n_head: plan.shape.n_head,
            dtype,
            attn,
            fusions: stage.fusions(),
            fc1_e4m3: std::sync::OnceLock::new(),
        })
    }
}

impl Forward for Block {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        self.forward_keeping(x, &mut None)
    }

    /// Steady once every producer fusion that is on has written its consumer's input: from the
    /// second forward on (the first has no delayed scale yet, so its producers run unfused).
    fn steady(&self) -> bool {
        let fc1_fusion = self.fusions.fc1 && self.fc1_e4m3.get() != Some(&false); // on, and not fallen back
        (!self.fusions.ln || (self.qkv.last_input_fused() && self.fc1.last_input_fused())) && (!fc1_fusion || self.fc2.last_input_fused())
    }

    fn ran(&self) -> Vec<String> {
        match self.fc1_e4m3.get() {
            Some(false) => vec![FC1_FALLBACK.into()],
            _ => Vec::new(),
        }
    }

    fn self_check(&self, x: &Tensor, _y: &Tensor) -> anyhow::Result<Option<NamedCheck>> {
        // One more forward, keeping each GEMM's input (it advances a delayed history by one call,
        // as any forward does); then each FP8 GEMM against its f32 twin on the same operands.
        let mut inputs = Some(Vec::with_capacity(4));
        self.forward_keeping(x, &mut inputs)?;
        let mut worst: Option<(f64, String, shared::check::CheckResult)> = None;
        let mut all = Vec::new();
        for (layer, input) in self.layers().into_iter().zip(inputs.unwrap_or_default()) {
            let (got, want) = layer.gemm_twin(&input)?;
            let k = input.dims3()?.2;
            let tol = twin::gemm_twin_tolerance(k, self.accumulation(layer), layer.out_dtype());
            let r = compare_within(&got, &want, tol)?;
            let name = format!("{} (K={k})", layer.name());
            all.push(format!("{name} {:.1e} of {:.1e}", r.rel_err, tol));
            let ratio = if r.passed { r.rel_err / tol } else { f64::INFINITY };
            if worst.as_ref().is_none_or(|(w, _, _)| ratio > *w) {
                worst = Some((ratio, name, r));
            }
        }
        let (_, name, result) = worst.ok_or_else(|| anyhow::anyhow!("stage 4 has no FP8 GEMM to check"))?;
        let acc = match self.accumulation(&self.qkv) {
            twin::Accumulation::F32 => "f32 accumulation: emulated",
            twin::Accumulation::TensorCoreFast => "tensor cores, fast accumulation on",
            twin::Accumulation::TensorCorePromoted => "tensor cores, fast accumulation off",
        };
        Ok(Some(NamedCheck {
            name: "fp8 GEMM twins".into(),
            meaning: format!(
                "each FP8 GEMM against the f32 GEMM of the very same E4M3 operands and scales, so only the \
                 accumulation and the output's rounding differ; tolerance derived from K and the accumulation \
                 ({acc}; twin::gemm_twin_tolerance). A failure means a scale, layout or epilogue bug, or an \
                 accumulation worse than modelled. Worst: {name}; all: {}",
                all.join(", ")
            ),
            result,
        }))
    }
}

impl Block {
    /// The block's dataflow (`forward`), keeping each FP8 GEMM's input in `inputs` when it is
    /// Some (for the GEMM twins): h, a, h after ln2, m — the inputs of qkv, proj, fc1, fc2. With
    /// a producer fusion on (`--fp8-fusions`, from the second call on) h and m arrive in E4M3.
    fn forward_keeping(&self, x: &Tensor, inputs: &mut Option<Vec<Input>>) -> candle_core::Result<Tensor> {
        let mut keep = |t: &Input| -> candle_core::Result<()> {
            if let Some(v) = inputs.as_mut() {
                v.push(t.kept()?);
            }
            Ok(())
        };
        let (b, t, c) = x.dims3()?;
        let heads = (b, t, 3, self.n_head, c / self.n_head); // (B, T, 3, n_head, d_head): a view of (B, T, 3C), no copy
        part("ln1")?; // a no-op unless --breakdown is recording (shared::breakdown)
        let h = match self.target(&self.qkv, self.fusions.ln)? {
            Some(s) => Input::Fp8(producers::layer_norm_e4m3(x, &self.ln1_g, &self.ln1_b, &s)?), // (B, T, C) E4M3 for qkv, its amax recorded
            None => Input::Plain(layer_norm(x, &self.ln1_g, &self.ln1_b, self.dtype)?), // (B, T, C): one kernel, activation dtype out
        };
        part("qkv")?;
        keep(&h)?;
        let qkv = self.qkv.forward_input(&h, None)?.reshape(heads)?; // one FP8 GEMM, bias in its epilogue
        let (q, k, v) = (qkv.i((.., .., 0))?, qkv.i((.., .., 1))?, qkv.i((.., .., 2))?); // (B, T, n_head, d_head) views
        part("attention")?;
        let a = attention::attention_with(self.attn, &q, &k, &v, true)?.reshape((b, t, c))?; // (B, T, C)
        part("proj+residual+ln2")?;
        keep(&Input::Plain(a.clone()))?;
        let p = self.proj.forward(&a)?;
        let (x, h) = match self.target(&self.fc1, self.fusions.ln)? {
            Some(s) => {
                let (x, h) = producers::add_layer_norm_e4m3(x, &p, &self.ln2_g, &self.ln2_b, &s)?; // x += proj; h = E4M3(LN(x))
                (x, Input::Fp8(h))
            }
            None => {
                let (x, h) = add_layer_norm(x, &p, &self.ln2_g, &self.ln2_b)?; // x += proj; h = LN(x)
                (x, Input::Plain(h))
            }
        };
        part("fc1+gelu")?;
        keep(&h)?;
        let m = match self.target(&self.fc2, self.fusions.fc1 && self.fc1_writes_e4m3(&h)?)? {
            Some(s) => Input::Fp8(self.fc1.forward_e4m3(&h, &s)?), // (B, T, FF) E4M3 for fc2: GELU, then fc2's scale, in the epilogue
            None => Input::Plain(self.fc1.forward_input(&h, None)?), // (B, T, FF): GELU in the FP8 GEMM's epilogue
        };
        part("fc2+residual")?;
        keep(&m)?;
        self.fc2.forward_input(&m, Some(&x)) // x + m W_fc2ᵀ + b_fc2, f32: the residual in the epilogue, as in stage 3
    }

    /// Run as if cuBLASLt offered no algorithm for fc1's E4M3 output (before the first forward):
    /// the fallback's dataflow, for tests on machines where it cannot happen by itself.
    pub fn assume_no_fc1_e4m3_algorithm(&self) {
        let _ = self.fc1_e4m3.set(false);
    }

    /// Whether fc1 can write fc2's input in E4M3 here, asked once: cuBLASLt may offer no
    /// algorithm for a GELU + bias epilogue with an E4M3 output. When it offers none, fc1 writes
    /// bf16 and fc2 quantises that with its own kernel — the next configuration, the dataflow of
    /// `--fp8-fusions ln` — and the row's notes say so (`FC1_FALLBACK`).
    fn fc1_writes_e4m3(&self, h: &Input) -> candle_core::Result<bool> {
        if let Some(ok) = self.fc1_e4m3.get() {
            return Ok(*ok);
        }
        let (b, t, _) = h.dims3()?;
        let ok = self.fc1.e4m3_output_supported(b * t)?;
        Ok(*self.fc1_e4m3.get_or_init(|| ok))
    }

    /// Where `consumer`'s producer writes its input when the fusion is `on`: its delayed scale
    /// (`Fp8Linear::fused_target`), or None — fusion off, or no scale yet (the first call).
    fn target(&self, consumer: &Fp8Linear, on: bool) -> candle_core::Result<Option<Fp8Target>> {
        if !on {
            return Ok(None);
        }
        consumer.fused_target()
    }

    /// How `layer`'s GEMM accumulates (what its twin's tolerance depends on).
    fn accumulation(&self, layer: &Fp8Linear) -> twin::Accumulation {
        match (layer.mode(), layer.fast_accum()) {
            (Fp8Mode::Emulated, _) => twin::Accumulation::F32,
            (Fp8Mode::Cublaslt, true) => twin::Accumulation::TensorCoreFast,
            (Fp8Mode::Cublaslt, false) => twin::Accumulation::TensorCorePromoted,
        }
    }

    /// The fp8-rounded fp32 twin of this block, with the input scales of the last forward.
    pub fn twin(&self) -> anyhow::Result<twin::TwinBlock> {
        Ok(twin::TwinBlock {
            ln1_g: self.ln1_g.clone(),
            ln1_b: self.ln1_b.clone(),
            qkv: twin_linear(&self.qkv)?,
            proj: twin_linear(&self.proj)?,
            ln2_g: self.ln2_g.clone(),
            ln2_b: self.ln2_b.clone(),
            fc1: twin_linear(&self.fc1)?,
            fc2: twin_linear(&self.fc2)?,
            n_head: self.n_head,
            act: self.dtype,
            fc2_stored: self.fc2.weight().data.device().is_cuda(), // cuBLASLt and GPU emulation store fc2's output first
        })
    }

    /// The four FP8 layers, in forward order (qkv, proj, fc1, fc2).
    pub fn layers(&self) -> [&Fp8Linear; 4] {
        [&self.qkv, &self.proj, &self.fc1, &self.fc2]
    }
}

/// Stage 4's training forward (`Stage::build_train`), emulated on the CPU: the block's dataflow
/// with the producer fusions off. The four FP8 layers live across steps: each call quantises the
/// current master weights into them (`Fp8Linear::set_weights`) while their inputs' amax
/// histories carry on, where a fresh `build` per step would restart every history. Each GEMM is
/// recorded with the HYBRID backward (`hybrid::HybridLinear`): E5M2 dY, its scale delayed with
/// a history per layer as the inputs' are (current with `--fp8-recipe current`).
pub struct TrainBlock {
    w: BlockWeights,               // the f32 master weights, tracked: the gradients' destination
    layers: Mutex<[Fp8Linear; 4]>, // qkv, proj, fc1, fc2: E4M3 weights of this step, the input scale states
    grads: [GradScaling; 4],       // dY's E5M2 scale per layer
    n_head: usize,
    dtype: DType,                    // stage 3's activation dtype (`activation_dtype`)
    attn: attention::Implementation, // stage 2's attention (the CPU kernel, with its backward)
}

impl TrainBlock {
    pub fn build(w: &BlockWeights, plan: &Plan, stage: &Fp8) -> anyhow::Result<TrainBlock> {
        let block = Block::build(w, plan, stage)?; // the layers, checked as the forward's
        let Block { qkv, proj, fc1, fc2, n_head, dtype, attn, .. } = block;
        let grad = || match stage.args.fp8_recipe {
            Fp8Recipe::Delayed => GradScaling::Delayed(Arc::new(DelayedScale::new(ScalingConfig::default().history_len, 0))),
            Fp8Recipe::Current => GradScaling::Current(0),
        };
        Ok(TrainBlock {
            w: w.clone(),
            layers: Mutex::new([qkv, proj, fc1, fc2]),
            grads: [grad(), grad(), grad(), grad()],
            n_head,
            dtype,
            attn,
        })
    }

    /// The amax histories of the four layers' inputs (qkv, proj, fc1, fc2), oldest first.
    pub fn input_amax_histories(&self) -> candle_core::Result<Vec<Vec<f32>>> {
        let layers = self.layers.lock().map_err(|_| candle_core::Error::Msg("stage 4: layers poisoned".into()))?;
        layers.iter().map(|l| l.input_amax_history()).collect()
    }

    /// The amax histories of the four layers' dY (empty under current scaling).
    pub fn grad_amax_histories(&self) -> Vec<Vec<f32>> {
        self.grads.iter().map(|g| if let GradScaling::Delayed(d) = g { d.history() } else { Vec::new() }).collect()
    }
}

impl Forward for TrainBlock {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let w = &self.w;
        let masters = [(&w.w_qkv, &w.b_qkv), (&w.w_proj, &w.b_proj), (&w.w_fc1, &w.b_fc1), (&w.w_fc2, &w.b_fc2)];
        let mut layers = self.layers.lock().map_err(|_| candle_core::Error::Msg("stage 4: layers poisoned".into()))?;
        for (layer, (wm, bm)) in layers.iter_mut().zip(masters) {
            layer.set_weights(wm, bm).map_err(|e| candle_core::Error::Msg(e.to_string()))?;
            // this step's E4M3 weights
        }
        // Layer i on x: the FP8 forward (its delayed input scale advancing), recorded with the
        // HYBRID backward towards x and the master W_i, b_i.
        let linear = |i: usize, x: &Tensor| {
            let layer = &layers[i];
            let (y, xq) = layer.forward_keeping_input(&x.detach())?;
            let wq = layer.weight().dequantize(DType::F32)?; // (N, K) s_w·q_w
            HybridLinear { y, xq, wq, gelu: layer.gelu(), scaling: self.grads[i].clone() }.apply(x, masters[i].0, masters[i].1)
        };
        let (b, t, c) = x.dims3()?;
        let heads = (b, t, 3, self.n_head, c / self.n_head); // (B, T, 3, n_head, d_head): a view of (B, T, 3C), no copy
        part("ln1")?;
        let h = layer_norm(x, &w.ln1_g, &w.ln1_b, self.dtype)?; // (B, T, C), activation dtype
        part("qkv")?;
        let qkv = linear(0, &h)?.reshape(heads)?;
        let (q, k, v) = (qkv.i((.., .., 0))?, qkv.i((.., .., 1))?, qkv.i((.., .., 2))?); // (B, T, n_head, d_head) views
        part("attention")?;
        let a = attention::attention_with(self.attn, &q, &k, &v, true)?.reshape((b, t, c))?; // (B, T, C)
        part("proj+residual+ln2")?;
        let (x, h) = add_layer_norm(x, &linear(1, &a)?, &w.ln2_g, &w.ln2_b)?; // x += proj; h = LN(x)
        part("fc1+gelu")?;
        let m = linear(2, &h)?; // (B, T, FF), GELU in the layer
        part("fc2+residual")?;
        x + linear(3, &m)?.to_dtype(DType::F32)? // the residual added by candle, after the store
    }
}

/// What the twin needs of one layer after a forward: W̃ = s_w·q_w, the bias as read, s_x.
fn twin_linear(l: &Fp8Linear) -> anyhow::Result<twin::TwinLinear> {
    let x_scale = l.last_input_scale().ok_or_else(|| anyhow::anyhow!("the twin check needs one forward first"))?;
    Ok(twin::TwinLinear {
        w: l.weight().dequantize(DType::F32)?,
        b: l.bias().to_dtype(DType::F32)?,
        x_scale,
        fused_input: l.last_input_fused(),
    })
}

fn dtype_name(dt: DType) -> &'static str {
    match dt {
        DType::F32 => "f32",
        DType::BF16 => "bf16",
        DType::F16 => "f16",
        _ => "another dtype",
    }
}
