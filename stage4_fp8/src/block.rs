//! Stage 4's block: stage 3's forward with FP8 GEMMs.

use crate::fp8::Fp8Recipe;
use crate::fp8::{Fp8Linear, Fp8Mode, Fp8Target, Input, ScalingConfig};
use crate::hybrid::{grad_scale_state, DelayedScale, GradFallbacks, GradScaling, HybridLinear, Operands};
use crate::{producers, twin};
use crate::{Fp8, Fp8Fusions};
use candle_core::{DType, IndexOp, Tensor};
use shared::breakdown::{enter, part};
use shared::check::{compare_within, NamedCheck};
use shared::{BlockWeights, Forward, Plan, Stage};
use stage2_sdpa::attention;
use stage3_fused::ops::{add_layer_norm, layer_norm, LN_EPS};
use std::sync::{Arc, Mutex};

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

/// The row's note when a HYBRID backward GEMM fell back (`hybrid::linear_bwd_hybrid_fp8`).
pub const GRAD_FALLBACK: &str = "cuBLASLt has no E4M3 × E5M2 algorithm for them on this GPU, so they multiplied the same \
     E4M3 and E5M2 values, decoded to f32, in an f32 GEMM (an FP8 GEMM's numbers, not its speed)";

/// Tolerance of the pre-rounded twin check (`twin`): measured ~1e-4 on a CPU without AVX512-BF16
/// (emulated). On a GPU, and on a CPU with AVX512-BF16, the fused attention rounds its
/// probabilities to bf16 before P·V and the twin does not, so bf16-sized differences (~4e-4 on
/// the CPU, a few 1e-3 on a GPU) are expected there; a wrong scale or layout is O(1).
pub const TWIN_TOLERANCE: f64 = 1e-2;

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
        let [x] = enter("ln1", [x])?; // a no-op unless --breakdown is recording (shared::breakdown)
        let h = match self.target(&self.qkv, self.fusions.ln)? {
            Some(s) => Input::Fp8(producers::layer_norm_e4m3(&x, &self.ln1_g, &self.ln1_b, &s)?), // (B, T, C) E4M3 for qkv, its amax recorded
            None => Input::Plain(layer_norm(&x, &self.ln1_g, &self.ln1_b, LN_EPS, self.dtype)?), // (B, T, C): one kernel, activation dtype out
        };
        part("qkv")?;
        keep(&h)?;
        let qkv = self.qkv.forward_input(&h, None)?.reshape(heads)?; // one FP8 GEMM, bias in its epilogue
        let [qkv] = enter("attention", [&qkv])?;
        let (q, k, v) = (qkv.i((.., .., 0))?, qkv.i((.., .., 1))?, qkv.i((.., .., 2))?); // (B, T, n_head, d_head) views
        let a = attention::attention_with(self.attn, &q, &k, &v, true)?.reshape((b, t, c))?; // (B, T, C)
        let [a] = enter("proj+residual+ln2", [&a])?;
        keep(&Input::Plain(a.clone()))?;
        let p = self.proj.forward(&a)?;
        let (x, h) = match self.target(&self.fc1, self.fusions.ln)? {
            Some(s) => {
                let (x, h) = producers::add_layer_norm_e4m3(&x, &p, &self.ln2_g, &self.ln2_b, &s)?; // x += proj; h = E4M3(LN(x))
                (x, Input::Fp8(h))
            }
            None => {
                let (x, h) = add_layer_norm(&x, &p, &self.ln2_g, &self.ln2_b, LN_EPS)?; // x += proj; h = LN(x)
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

/// Stage 4's training forward (`Stage::build_train`): the block's dataflow with the producer
/// fusions off, emulated on the CPU, through cuBLASLt's FP8 GEMMs on CUDA. The four FP8 layers
/// live across steps: each call quantises the current master weights into them
/// (`Fp8Linear::set_weights`) while their inputs' amax histories carry on, where a fresh `build`
/// per step would restart every history. Each GEMM is recorded with the HYBRID backward
/// (`hybrid::HybridLinear`): E5M2 dY, its scale delayed with a history per layer as the inputs'
/// are (current with `--fp8-recipe current`), kept on the device on CUDA.
pub struct TrainBlock {
    w: BlockWeights,               // the f32 master weights, tracked: the gradients' destination
    layers: Mutex<[Fp8Linear; 4]>, // qkv, proj, fc1, fc2: E4M3 weights of this step, the input scale states
    grads: [GradScaling; 4],       // dY's E5M2 scale per layer
    fallbacks: GradFallbacks,      // backward GEMMs cuBLASLt had no algorithm for (CUDA)
    n_head: usize,
    dtype: DType,                    // stage 3's activation dtype (`activation_dtype`)
    attn: attention::Implementation, // stage 2's attention (with its backward)
}

impl TrainBlock {
    pub fn build(w: &BlockWeights, plan: &Plan, stage: &Fp8) -> anyhow::Result<TrainBlock> {
        let block = Block::build(w, plan, stage)?; // the layers, checked as the forward's
        let Block { qkv, proj, fc1, fc2, n_head, dtype, attn, .. } = block;
        let (recipe, len) = (stage.args.fp8_recipe, ScalingConfig::default().history_len);
        let on_device = stage.mode(plan) == Fp8Mode::Cublaslt;
        let grad = || -> anyhow::Result<GradScaling> {
            Ok(match (on_device, recipe) {
                (true, _) => GradScaling::OnDevice(Arc::new(Mutex::new(grad_scale_state(recipe, len, 0).map_err(anyhow::Error::msg)?))),
                (false, Fp8Recipe::Delayed) => GradScaling::Delayed(Arc::new(DelayedScale::new(len, 0))),
                (false, Fp8Recipe::Current) => GradScaling::Current(0),
            })
        };
        Ok(TrainBlock {
            w: w.clone(),
            layers: Mutex::new([qkv, proj, fc1, fc2]),
            grads: [grad()?, grad()?, grad()?, grad()?],
            fallbacks: GradFallbacks::default(),
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
    pub fn grad_amax_histories(&self) -> candle_core::Result<Vec<Vec<f32>>> {
        self.grads
            .iter()
            .map(|g| match g {
                GradScaling::Delayed(d) => Ok(d.history()),
                GradScaling::OnDevice(s) => s.lock().map_err(|_| candle_core::Error::Msg("dY's scale state poisoned".into()))?.history(),
                GradScaling::Current(_) => Ok(Vec::new()),
            })
            .collect()
    }
}

impl Forward for TrainBlock {
    /// The backward GEMMs that ran on their fallback (`GRAD_FALLBACK`), if any.
    fn ran(&self) -> Vec<String> {
        self.fallbacks.ran().into_iter().map(|g| format!("{g:?}-gradient GEMMs: {GRAD_FALLBACK}")).collect()
    }

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
            let (y, operands) = match layer.mode() {
                Fp8Mode::Emulated => {
                    let (y, xq) = layer.forward_keeping_input(&x.detach())?;
                    let wq = layer.weight().dequantize(DType::F32)?; // (N, K) s_w·q_w
                    (y, Operands::Emulated { xq, wq })
                }
                Fp8Mode::Cublaslt => {
                    let (y, xq, x_scale) = layer.forward_keeping_fp8_input(&x.detach())?;
                    let (wq, w_scale) = (layer.weight().data.clone(), layer.weight().scale.clone()); // (N, K) E4M3, s_w
                    (y, Operands::Fp8 { xq, x_scale, wq, w_scale })
                }
            };
            let (gelu, scaling, fallbacks) = (layer.gelu(), self.grads[i].clone(), self.fallbacks.clone());
            HybridLinear { y, operands, gelu, scaling, fallbacks }.apply(x, masters[i].0, masters[i].1)
        };
        let (b, t, c) = x.dims3()?;
        let heads = (b, t, 3, self.n_head, c / self.n_head); // (B, T, 3, n_head, d_head): a view of (B, T, 3C), no copy
        let [x] = enter("ln1", [x])?;
        let h = layer_norm(&x, &w.ln1_g, &w.ln1_b, LN_EPS, self.dtype)?; // (B, T, C), activation dtype
        let [h] = enter("qkv", [&h])?;
        let qkv = linear(0, &h)?.reshape(heads)?;
        let [qkv] = enter("attention", [&qkv])?;
        let (q, k, v) = (qkv.i((.., .., 0))?, qkv.i((.., .., 1))?, qkv.i((.., .., 2))?); // (B, T, n_head, d_head) views
        let a = attention::attention_with(self.attn, &q, &k, &v, true)?.reshape((b, t, c))?; // (B, T, C)
        let [a] = enter("proj+residual+ln2", [&a])?;
        let (x, h) = add_layer_norm(&x, &linear(1, &a)?, &w.ln2_g, &w.ln2_b, LN_EPS)?; // x += proj; h = LN(x)
        let [h] = enter("fc1+gelu", [&h])?;
        let m = linear(2, &h)?; // (B, T, FF), GELU in the layer
        let [m] = enter("fc2+residual", [&m])?;
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
