//! # Stage 4 — FP8: the four GEMMs in E4M3 with per-tensor scaling
//!
//! **What changed.** The four matrix multiplications (qkv, proj, fc1, fc2) take E4M3 inputs —
//! weights quantised once at build, activations on every call with a per-tensor scale from
//! `--fp8-recipe` (delayed: an amax history; current: this tensor's amax) — and write bf16
//! with bias (and fc1's GELU) in cuBLASLt's epilogue (`fp8::Fp8Linear`). Everything else is
//! stage 3: its fused LayerNorm and residual kernels, stage 2's attention, LayerNorm
//! statistics and the residual stream in f32. The activations stay in the dtype stage 3 uses
//! at the same `--precision` (`activation_dtype`): on the CPU, f32 by default, so the GEMMs'
//! number format is the one change; on CUDA, bf16 (what cuBLASLt's FP8 GEMMs store), and a
//! note says so when stage 3 would run something else.
//!
//! **Why it is faster on the hardware.** Hopper's tensor cores do twice as many E4M3 FLOPs per
//! clock as bf16 (1979 vs 989 dense TFLOP/s on H100 SXM), and E4M3 operands are half the bytes.
//! What FP8 cannot speed up — attention, LayerNorm, the quantisation itself (an amax reduction
//! and a cast per activation, a few µs each) — stays the same or grows, so the gain depends on
//! how much of the block the GEMMs are: on `te` (C = 4096, FF = 16384, 16 k tokens) they are
//! ~90 % of the FLOPs and the block should gain ~1.3–1.5x over stage 3; at GPT-2 sizes
//! (C = 768) the GEMMs are too small to leave the launch- and memory-bound regime, and the
//! quantisation overhead eats the gain (expect ~1.0x).
//!
//! **What it costs.** E4M3 keeps 3 mantissa bits: each operand is off by up to 1/16 of its
//! value, so the block's relative error grows to ~1e-2 (fp8 tolerance 8e-2). Two checks:
//! against the fp32 reference, and each FP8 GEMM against the f32 GEMM of the very same E4M3
//! operands and scales (the GEMM twins, `twin::gemm_twin_tolerance`): only the accumulation
//! differs there, so the tolerance follows from K and from whether Hopper's fast accumulation
//! is on (`--fp8-fast-accum`); anything beyond it is a bug. FP8 tensor cores need SM 8.9+
//! (Ada, Hopper) and dimensions that are multiples of 16. The quantisation on CUDA is our own
//! kernels (`kernels/fp8.cu`, built by nvcc with the crate).
//! Elsewhere the stage is *emulated* (quantise to E4M3 and back, then an f32 GEMM): FP8's
//! numerics on any machine, labelled "emulated", and its time is not an FP8 speed. On a GPU
//! without FP8 it refuses unless asked (`--fp8-emulate`).
//!
//! **Quantisation fused into the producers** (`--fp8-fusions ln,fc1`, TransformerEngine's way):
//! the two LayerNorms write qkv's and fc1's input in E4M3 (`producers`, `kernels/ln_fp8.cu`),
//! and fc1's GEMM writes fc2's (cuBLASLt's D scale and amax_D), each recording the amax of what
//! it wrote in the consumer's history: three quantise passes (over (B, T, C), (B, T, C) and
//! (B, T, FF)) and their launches saved, and the producers write 1 byte per value instead of 2.
//! They need the scale before the producer writes, so delayed scaling: by default all of them
//! with `--fp8-recipe delayed`, none with `current` (asking for one there is refused); the first
//! call, with no history yet, runs unfused. Compiled, not run on a GPU; emulated on the CPU.
//!
//! **Run it.** `cargo run --release -p stage4_fp8` (CPU, emulated) ·
//! `cargo run --release --features cuda -p stage4_fp8 -- --device cuda --preset te` (Hopper/Ada).

#[cfg(feature = "cuda")]
pub mod cuda;
pub mod fp8;
pub mod gemm;
pub mod harness;
pub mod producers;
#[cfg(feature = "cuda")]
pub mod quant_cuda;
pub mod twin;

use candle_core::{DType, IndexOp, Tensor};
use fp8::{Fp8Linear, Fp8Mode, Fp8Target, Input, ScalingConfig};
use shared::breakdown::part;
use shared::check::{compare_within, NamedCheck};
use shared::device::{DeviceInfo, GemmSwitches};
use shared::stage::{PrecisionChoice, EMULATED};
use shared::Shape;
use shared::{BlockWeights, Fp8FastAccum, Fp8Fusions, Plan, Precision, PrecisionRequest, SpeedkitError, Stage};
use stage1_tensorcore::precision;
use stage2_sdpa::attention;
use stage3_fused::ops::{add_layer_norm, layer_norm};

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
}

/// Tolerance of the pre-rounded twin check (`twin`): measured ~1e-4 on CPU (emulated). On a GPU
/// the fused attention rounds its probabilities to bf16 before P·V and the twin does not, so
/// bf16-sized differences (a few 1e-3) are expected there; a wrong scale or layout is O(1).
pub const TWIN_TOLERANCE: f64 = 1e-2;

/// Does `plan` run FP8 on tensor cores, or emulate it?
pub fn mode(plan: &Plan) -> Fp8Mode {
    if plan.info.is_cuda() && plan.info.has_fp8_tensor_cores() {
        Fp8Mode::Cublaslt
    } else {
        Fp8Mode::Emulated
    }
}

/// The producer fusions this plan runs (`--fp8-fusions`; by default all the recipe allows).
pub fn fusions(plan: &Plan) -> Fp8Fusions {
    Fp8Fusions::effective(plan.options.fp8_fusions, plan.options.fp8_recipe)
}

/// The activation dtype stage 4 runs with, and a note when it must differ from stage 3's at
/// the same `--precision` (`StageOptions::requested`). Stage 3 is asked as the ladder asks it:
/// fp8 (this stage's own precision) means stage 3's auto choice.
pub fn activation_dtype(plan: &Plan) -> (DType, Option<String>) {
    let request = match plan.options.requested {
        PrecisionRequest::Exactly(Precision::Fp8) => PrecisionRequest::Auto,
        r => r,
    };
    let stage3 = stage3_fused::Block::choose_precision(&plan.info, request).ok().map(|(p, _)| precision::gemm_dtype(p));
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
        None => (DType::F32, Some("activations in f32: stage 3 cannot run this --precision, so stage 4 keeps the CPU's default".into())),
    }
}

impl Stage for Block {
    const NAME: &'static str = "stage4_fp8";
    const TECHNIQUE: &'static str = "FP8 E4M3 GEMMs with per-tensor scaling (delayed or current)";
    const OWN_PRECISION: Option<Precision> = Some(Precision::Fp8);

    fn choose_precision(info: &DeviceInfo, requested: PrecisionRequest) -> Result<PrecisionChoice, SpeedkitError> {
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

    fn check_plan(plan: &Plan) -> Result<(), SpeedkitError> {
        Fp8Fusions::check(plan.options.fp8_fusions, plan.options.fp8_recipe)?; // fusions need delayed scaling
        let info = &plan.info;
        if !info.is_cuda() {
            return Ok(()); // emulated, any shape
        }
        let sm = info.sm.map_or("?".into(), |(a, b)| format!("{a}.{b}"));
        if !info.has_fp8_tensor_cores() && !plan.options.fp8_emulate {
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
        if mode(plan) == Fp8Mode::Cublaslt {
            let s = plan.shape;
            gemm::check_dims(16, s.d_model, s.ff).map_err(SpeedkitError::usage)?;
            gemm::fp8_gemm_args(s.batch * s.seq, s.d_model, s.d_model, false).map_err(SpeedkitError::usage)?;
            // the token count
        }
        Ok(())
    }

    fn implementation(plan: &Plan) -> Option<String> {
        let recipe = plan.options.fp8_recipe.name();
        let fused = format!("fp8 fusions {}", fusions(plan).describe());
        Some(match mode(plan) {
            Fp8Mode::Cublaslt => format!("cuBLASLt E4M3, {recipe} scaling, {fused}"),
            Fp8Mode::Emulated => format!("{EMULATED}, {recipe} scaling, {fused}"),
        })
    }

    fn check_shape(_shape: &Shape) -> Result<(), SpeedkitError> {
        Ok(()) // fused attention: no (B, n_head, T, T) tensor exists
    }

    fn estimate_bytes(shape: &Shape) -> u128 {
        stage2_sdpa::harness::estimate_fused_bytes(shape)
    }

    fn switches(_plan: &Plan) -> GemmSwitches {
        // TF32 off: the emulated GEMMs and the twin check must be true f32.
        GemmSwitches::OFF
    }

    fn notes(plan: &Plan) -> Vec<String> {
        let mut notes = stage2_sdpa::Block::notes(plan); // alignment advice, which attention runs
        if mode(plan) == Fp8Mode::Emulated {
            notes.push("FP8 emulated: activations and weights rounded to E4M3 with per-tensor scales, then f32 GEMMs".into());
        }
        let (dt, forced) = activation_dtype(plan);
        notes.push(forced.unwrap_or_else(|| {
            format!("activations in {}, as stage 3 at this --precision: only the GEMMs' format differs", dtype_name(dt))
        }));
        notes
    }

    fn build(w: &BlockWeights, plan: &Plan) -> anyhow::Result<Self> {
        Self::switches(plan).apply();
        stage2_sdpa::attention::check_head_size(&plan.device, plan.shape.d_head()).map_err(SpeedkitError::usage)?;
        let attn = stage2_sdpa::harness::for_run(&plan.device, plan.options.attention_kernel)?;
        let (mode, scaling) = (mode(plan), ScalingConfig { recipe: plan.options.fp8_recipe.into(), ..ScalingConfig::default() });
        let dtype = activation_dtype(plan).0;
        let fast_accum = plan.options.fp8_fast_accum == Fp8FastAccum::On;
        let linear = |w: &Tensor, b: &Tensor, gelu: bool, name: &str| {
            Ok::<_, anyhow::Error>(
                Fp8Linear::with_output(w, b, gelu, mode, scaling, name, dtype).map_err(harness::fp8_error)?.with_fast_accum(fast_accum),
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
            fusions: fusions(plan),
        })
    }

    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        self.forward_keeping(x, &mut None)
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
        let m = match self.target(&self.fc2, self.fusions.fc1)? {
            Some(s) => Input::Fp8(self.fc1.forward_e4m3(&h, &s)?), // (B, T, FF) E4M3 for fc2: GELU, then fc2's scale, in the epilogue
            None => Input::Plain(self.fc1.forward_input(&h, None)?), // (B, T, FF): GELU in the FP8 GEMM's epilogue
        };
        part("fc2+residual")?;
        keep(&m)?;
        self.fc2.forward_input(&m, Some(&x)) // x + m W_fc2ᵀ + b_fc2, f32: the residual in the epilogue, as in stage 3
    }

    /// Where `consumer`'s producer writes its input when the fusion is `on`: its delayed scale
    /// (`Fp8Linear::fused_target`), or None — fusion off, or no scale yet (the first call).
    fn target(&self, consumer: &Fp8Linear, on: bool) -> candle_core::Result<Option<Fp8Target>> {
        if !on {
            return Ok(None);
        }
        consumer.fused_target(self.ln1_g.device())
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
