//! Stage 3's block for the runner and the ladder: stage 2's forward with the element-wise work
//! fused, each fusion switchable (`--fusions`), and the flags stage 3 introduces.

use crate::adamw::{AdamW, ParamsAdamW};
use crate::ops::{add_layer_norm, layer_norm, linear_prepacked, mlp, Epilogue};
use candle_core::backprop::GradStore;
use candle_core::{DType, IndexOp, Tensor, Var};
use shared::breakdown::part;
use shared::device::{DeviceInfo, GemmSwitches};
use shared::perf::Traffic;
use shared::stage::{describe_switches, parse_switches, switch_off, switches_on, train_params, Optimize, PrecisionChoice, Rebuild};
use shared::{BlockWeights, Forward, Plan, Precision, PrecisionRequest, Shape, SpeedkitError, Stage, StageEntry};
use stage1_tensorcore::bf16_gemm::PackedWeight;
use stage1_tensorcore::precision;
use stage2_sdpa::attention;
use stage2_sdpa::elementwise::{self as ew, Elementwise, LN_EPS};
use stage2_sdpa::Sdpa;

/// Stage 3's four fusions, each switchable on its own (`--fusions ln,qkv,epilogue,add-ln`).
/// A fusion that is off runs its slow twin, the way stage 2 computes that part.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
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
        switches_on(self.flags(), &Fusions::NAMES)
    }

    /// "all", "none", or the list of those on, as `--fusions` takes it.
    pub fn describe(&self) -> String {
        describe_switches(self.flags(), &Fusions::NAMES)
    }
}

impl std::str::FromStr for Fusions {
    type Err = String;
    /// "all", "none", or a comma-separated list of the fusions to keep on.
    fn from_str(s: &str) -> Result<Self, String> {
        parse_switches(s, &Fusions::NAMES, "stage 3's fusions").map(Fusions::from_flags)
    }
}

/// The flags stage 3 introduces (stage 4 honours them too).
#[derive(clap::Args, Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Args {
    /// Stages 3–4: which of stage 3's fusions to keep on, e.g. ln,qkv,epilogue,add-ln (or all, none); the others run their slow twins
    #[arg(long, env = "SPEEDKIT_FUSIONS", default_value = "all")]
    pub fusions: Fusions,
}

/// Stage 3 as the runner and the ladder see it: stage 2's flags (its attention) and its own.
#[derive(Clone, Copy, Debug, Default)]
pub struct Fused {
    pub sdpa: Sdpa,
    pub fusions: Fusions,
}

/// How a binary or the ladder finds stage 3.
pub const STAGE: StageEntry = StageEntry {
    args: <Args as clap::Args>::augment_args,
    make: |m| {
        stage1_tensorcore::register_bf16_ceiling(); // bf16 rows' % of peak: against the bf16 GEMM rate
        Ok(Box::new(Fused::from_matches(m)?))
    },
};

impl Fused {
    /// Stage 3 configured by parsed flags (stage 2's and its own).
    pub fn from_matches(m: &clap::ArgMatches) -> Result<Fused, clap::Error> {
        Ok(Fused { sdpa: Sdpa::from_matches(m)?, fusions: <Args as clap::FromArgMatches>::from_arg_matches(m)?.fusions })
    }

    /// What runs this plan: stage 2's attention, and the fusions when not all are on.
    pub fn label(&self, plan: &Plan) -> String {
        let attention = self.sdpa.label(plan);
        match self.fusions {
            Fusions::ALL => attention,
            f => format!("{attention}, fusions {}", f.describe()),
        }
    }
}

pub struct Block {
    ln1_g: Tensor,        // (C) f32
    ln1_b: Tensor,        // (C) f32
    w_qkv: PackedWeight,  // (3C, C) GEMM dtype: q, k and v weights stacked, one GEMM; Wᵀ packed once on a CPU's bf16 unit
    b_qkv: Tensor,        // (3C) GEMM dtype
    w_proj: PackedWeight, // (C, C)
    b_proj: Tensor,       // (C)
    ln2_g: Tensor,        // (C) f32
    ln2_b: Tensor,        // (C) f32
    w_fc1: PackedWeight,  // (FF, C)
    b_fc1: Tensor,        // (FF)
    w_fc2: PackedWeight,  // (C, FF)
    b_fc2: Tensor,        // (C)
    n_head: usize,
    dtype: DType,                                   // GEMM operand dtype: bf16, f16, or f32 (fp32 and TF32)
    fusions: Fusions,                               // all on unless ablated (--fusions)
    ew: Elementwise,                                // how a fusion that is off runs its passes: stage 2's `--elementwise`
    split_qkv: Option<[(PackedWeight, Tensor); 3]>, // qkv fusion off only: (C, C) weights and (C) biases of q, k, v
    attn: attention::Implementation,                // stage 2's attention kernel (`--attention-kernel` on CUDA)
}

impl Stage for Fused {
    fn name(&self) -> &'static str {
        "stage3_fused"
    }

    fn technique(&self) -> &'static str {
        "kernel fusion: fused LayerNorm, GEMM epilogues, one QKV GEMM"
    }

    fn choose_precision(&self, info: &DeviceInfo, requested: PrecisionRequest) -> Result<PrecisionChoice, SpeedkitError> {
        let (p, why) = self.sdpa.choose_precision(info, requested)?;
        if info.is_cuda() && p == Precision::Fp32 {
            return Err(SpeedkitError::usage(
                "stage 3's cuBLASLt GEMMs (through cudarc) compute f32 matrices in TF32, so stage 3 cannot run \
                 --precision fp32 on CUDA without mislabelling it. Fix: --precision tf32 (same f32 storage, TF32 \
                 tensor cores) or bf16 (the auto choice).",
            ));
        }
        Ok((p, why))
    }

    fn check_shape(&self, _shape: &Shape) -> Result<(), SpeedkitError> {
        Ok(()) // no (B, n_head, T, T) tensor exists, so no limit on it
    }

    fn estimate_bytes(&self, shape: &Shape) -> u128 {
        stage2_sdpa::harness::estimate_fused_bytes(shape)
    }

    fn estimate_train_bytes(&self, shape: &Shape) -> shared::train::TrainBytes {
        stage2_sdpa::harness::estimate_fused_train_bytes(shape)
    }

    fn switches(&self, plan: &Plan) -> GemmSwitches {
        precision::switches(plan.precision)
    }

    fn notes(&self, plan: &Plan) -> Vec<String> {
        let mut notes = self.sdpa.notes(plan); // alignment advice, which attention runs
        if self.fusions != Fusions::ALL {
            notes.push(format!("fusions on: {} (the others run their slow twins, as in stage 2)", self.fusions.describe()));
        }
        notes
    }

    fn implementation(&self, plan: &Plan) -> Option<String> {
        Some(self.label(plan))
    }

    fn check_plan(&self, plan: &Plan) -> Result<(), SpeedkitError> {
        self.sdpa.check_plan(plan)
    }

    fn build(&self, w: &BlockWeights, plan: &Plan) -> anyhow::Result<Box<dyn Forward>> {
        Ok(Box::new(Block::build(w, plan, self)?))
    }

    fn ablations(&self, plan: &Plan) -> Vec<(String, Box<dyn Stage>)> {
        let without = |name: &str| -> (String, Box<dyn Stage>) {
            (format!("without {name}"), Box::new(Fused { fusions: self.fusions.without(name), ..*self }))
        };
        let mut v: Vec<(String, Box<dyn Stage>)> = self.fusions.on().into_iter().map(without).collect();
        if !plan.info.is_cuda() && !plan.train && !self.fusions.on().is_empty() {
            // Stage 3's CPU element-wise ops are multi-threaded and vectorised, stage 2's are
            // not by default: this row is stage 2 with threads and SIMD only (no fusion), so
            // the step from 2 to 3 splits into threading and fusion. (Not while training: those
            // threaded passes are outside candle's autograd graph.)
            let sdpa = Sdpa { args: stage2_sdpa::Args { elementwise: Elementwise::Parallel, ..self.sdpa.args }, ..self.sdpa };
            v.push(("threads and SIMD only".into(), Box::new(Fused { sdpa, fusions: Fusions::NONE })));
        }
        v
    }

    fn traffic(&self, shape: &Shape, p: Precision, act: f64) -> f64 {
        let t = Traffic::new(shape, p, act);
        // LayerNorm 1 (2), add + LayerNorm (1), fc2's residual (2 at 16-bit; in the GEMM at f32).
        let fc2_residual = if act >= 4.0 { 0.0 } else { 2.0 * t.pass_c };
        t.gemms + t.fused_attention + 3.0 * t.pass_c + fc2_residual
    }

    fn selftest(&self, device: &candle_core::Device, _info: &DeviceInfo, rows: &mut shared::selftest::Rows) {
        crate::selftest::epilogues(rows, device);
        crate::selftest::training_epilogues(rows, device);
        crate::selftest::layer_norms(rows, device);
        crate::selftest::adamw(rows, device);
    }

    /// The fused ops' backward (`backward.rs`), stage 2's attention's and candle's autograd for
    /// the rest. A fusion switched off runs stage 2's passes, which cannot train under
    /// `--elementwise parallel`.
    fn check_train(&self, plan: &Plan) -> Result<(), SpeedkitError> {
        match self.fusions {
            Fusions::ALL => Ok(()),
            _ => stage2_sdpa::check_elementwise_trains(self.sdpa.args.elementwise, plan, "stage 3 with a fusion off"),
        }
    }

    /// The casts of `build` once per step, as autocast's: the weights stay f32 masters.
    fn build_train(&self, w: &BlockWeights, plan: &Plan) -> anyhow::Result<Box<dyn Forward>> {
        Ok(Box::new(Rebuild { stage: *self, weights: w.clone(), plan: plan.clone() }))
    }

    /// The fused AdamW (`adamw.rs`): one pass per parameter on the CPU, one multi-tensor launch
    /// on CUDA (`kernels/adamw.cu`).
    fn optimizer(&self, vars: Vec<Var>, plan: &Plan) -> anyhow::Result<Box<dyn Optimize>> {
        let p = train_params();
        let params = ParamsAdamW { lr: p.lr, beta1: p.beta1, beta2: p.beta2, eps: p.eps, weight_decay: p.weight_decay };
        let name = if plan.device.is_cpu() { "fused AdamW" } else { "fused AdamW (one multi-tensor launch)" };
        Ok(Box::new(FusedAdamW(AdamW::new(vars, params)?, name)))
    }
}

/// Stage 3's optimizer: `adamw::AdamW`, one pass per parameter on the CPU, every parameter in one
/// launch on CUDA; and its label.
pub struct FusedAdamW(pub AdamW, pub &'static str);

impl Optimize for FusedAdamW {
    fn name(&self) -> String {
        self.1.into()
    }
    fn step(&mut self, grads: &GradStore) -> anyhow::Result<bool> {
        self.0.step(grads)?;
        Ok(true)
    }
}

impl Block {
    pub fn build(w: &BlockWeights, plan: &Plan, stage: &Fused) -> anyhow::Result<Block> {
        precision::switches(plan.precision).apply();
        stage.check_plan(plan)?;
        let attn = stage2_sdpa::harness::for_run(&plan.device, stage.sdpa.args.attention_kernel)?;
        let dt = precision::gemm_dtype(plan.precision);
        let c = plan.shape.d_model;
        let split_qkv = match stage.fusions.qkv {
            true => None,
            false => {
                let part = |i: usize| -> candle_core::Result<(PackedWeight, Tensor)> {
                    let w_i = PackedWeight::new(&w.w_qkv.narrow(0, i * c, c)?.to_dtype(dt)?.contiguous()?)?; // (C, C)
                    Ok((w_i, w.b_qkv.narrow(0, i * c, c)?.to_dtype(dt)?.contiguous()?))
                    // (C)
                };
                Some([part(0)?, part(1)?, part(2)?])
            }
        };
        // Cast once here, never per forward, and on a CPU's bf16 unit packed once into the GEMM's
        // pair panels (build is outside the timing; every forward would otherwise pack W again).
        let pack = |t: &Tensor| PackedWeight::new(&t.to_dtype(dt)?);
        Ok(Block {
            ln1_g: w.ln1_g.clone(),
            ln1_b: w.ln1_b.clone(),
            w_qkv: pack(&w.w_qkv)?, // one (3C, C) GEMM instead of three (C, C) ones
            b_qkv: w.b_qkv.to_dtype(dt)?,
            w_proj: pack(&w.w_proj)?,
            b_proj: w.b_proj.to_dtype(dt)?,
            ln2_g: w.ln2_g.clone(),
            ln2_b: w.ln2_b.clone(),
            w_fc1: pack(&w.w_fc1)?,
            b_fc1: w.b_fc1.to_dtype(dt)?,
            w_fc2: pack(&w.w_fc2)?,
            b_fc2: w.b_fc2.to_dtype(dt)?,
            n_head: plan.shape.n_head,
            dtype: dt,
            fusions: stage.fusions,
            ew: stage.sdpa.args.elementwise,
            split_qkv,
            attn,
        })
    }
}

impl Forward for Block {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let (b, t, c) = x.dims3()?;
        let heads = (b, t, 3, self.n_head, c / self.n_head); // (B, T, 3, n_head, d_head): a view of (B, T, 3C), no copy
        part("ln1")?; // a no-op unless --breakdown is recording (shared::breakdown)
        let h = self.layer_norm(x, &self.ln1_g, &self.ln1_b)?; // (B, T, C): one kernel, GEMM dtype out
        part("qkv")?;
        let (q, k, v) = match &self.split_qkv {
            None => {
                let qkv = self.linear(&h, &self.w_qkv, &self.b_qkv)?.reshape(heads)?; // one GEMM, bias in its epilogue
                (qkv.i((.., .., 0))?, qkv.i((.., .., 1))?, qkv.i((.., .., 2))?) // (B, T, n_head, d_head) views
            }
            Some([q, k, v]) => self.three_projections(&h, [q, k, v])?, // ablation: stage 2's three GEMMs
        };
        part("attention")?;
        let a = attention::attention_with(self.attn, &q, &k, &v, true)?.reshape((b, t, c))?; // (B, T, C)
        part(if self.fusions.add_ln { "proj+residual+ln2" } else { "proj+residual" })?;
        let (x, h) = self.add_layer_norm(x, &self.linear(&a, &self.w_proj, &self.b_proj)?, &self.ln2_g, &self.ln2_b)?; // x += proj; h = LN(x)
        part("fc1+gelu")?;
        if let Some(y) = self.mlp_training_cuda(&h, &x)? {
            return Ok(y); // training on CUDA: fc1 and fc2 paired (`ops::mlp`), one part
        }
        let m = self.linear_gelu(&h, &self.w_fc1, &self.b_fc1)?; // (B, T, FF): GELU in the GEMM's epilogue
        part("fc2+residual")?;
        self.linear_residual(&m, &self.w_fc2, &self.b_fc2, &x) // x + m W_fc2ᵀ + b_fc2, f32
    }
}

/// Each fusion, or (switched off with `--fusions`) its slow twin: the way stage 2 computes that
/// part. The fused op comes first in each; the twins exist so `ladder --ablate` can price one
/// fusion at a time.
impl Block {
    fn layer_norm(&self, x: &Tensor, g: &Tensor, b: &Tensor) -> candle_core::Result<Tensor> {
        match self.fusions.ln {
            true => layer_norm(x, g, b, self.dtype),
            false => ew::to_dtype(&ew::layer_norm(x, g, b, LN_EPS, self.ew)?, self.dtype, self.ew), // stage 2's passes, then a cast pass
        }
    }

    fn linear(&self, x: &Tensor, w: &PackedWeight, b: &Tensor) -> candle_core::Result<Tensor> {
        match self.fusions.epilogue {
            true => linear_prepacked(x, w, b, Epilogue::Bias),
            false => ew::linear(x, w.weight(), b, self.ew), // GEMM, then a bias pass
        }
    }

    fn linear_gelu(&self, x: &Tensor, w: &PackedWeight, b: &Tensor) -> candle_core::Result<Tensor> {
        match self.fusions.epilogue {
            true => linear_prepacked(x, w, b, Epilogue::BiasGelu),
            false => ew::gelu_tanh(&ew::linear(x, w.weight(), b, self.ew)?, self.ew), // GEMM, bias pass, GELU passes
        }
    }

    /// Training on CUDA with the epilogue fusion on: r + mlp(h), `ops::mlp` pairing fc1 and fc2 so
    /// that GELU's derivative and both bias gradients come out of the backward GEMMs (cuBLASLt's
    /// DGELU_BGRAD and BGRADB); the residual add is candle's, as `linear_bias_residual`'s while
    /// training. `None` otherwise: the CPU keeps fc1's one-pass backward (f32 dz).
    fn mlp_training_cuda(&self, h: &Tensor, r: &Tensor) -> candle_core::Result<Option<Tensor>> {
        let (w1, w2) = (self.w_fc1.weight(), self.w_fc2.weight());
        let tracked = [h, w1, &self.b_fc1, w2, &self.b_fc2].iter().any(|t| t.track_op());
        if !(self.fusions.epilogue && tracked && h.device().is_cuda()) {
            return Ok(None);
        }
        let y = mlp(h, w1, &self.b_fc1, w2, &self.b_fc2)?; // (B, T, C) in the GEMM dtype
        Ok(Some((r + y.to_dtype(r.dtype())?)?))
    }

    /// r + x Wᵀ + b, f32 (r: the residual stream).
    fn linear_residual(&self, x: &Tensor, w: &PackedWeight, b: &Tensor, r: &Tensor) -> candle_core::Result<Tensor> {
        match self.fusions.epilogue {
            true => linear_prepacked(x, w, b, Epilogue::BiasResidual(r)),
            false => ew::add(r, &ew::to_dtype(&ew::linear(x, w.weight(), b, self.ew)?, DType::F32, self.ew)?, self.ew), // GEMM, bias, cast, add passes
        }
    }

    /// (x + branch in f32, LayerNorm of it in the GEMM dtype).
    fn add_layer_norm(&self, x: &Tensor, branch: &Tensor, g: &Tensor, b: &Tensor) -> candle_core::Result<(Tensor, Tensor)> {
        if self.fusions.add_ln {
            return add_layer_norm(x, branch, g, b);
        }
        let x = ew::add(x, &ew::to_dtype(branch, DType::F32, self.ew)?, self.ew)?; // the add, a pass of its own
        part("ln2")?;
        let h = self.layer_norm(&x, g, b)?;
        Ok((x, h))
    }

    /// The qkv fusion off: three (C, C) GEMMs, as in stage 2. h: (B, T, C) → three (B, T, n_head, d_head).
    fn three_projections(&self, h: &Tensor, [q, k, v]: [&(PackedWeight, Tensor); 3]) -> candle_core::Result<(Tensor, Tensor, Tensor)> {
        let (b, t, c) = h.dims3()?;
        let heads = (b, t, self.n_head, c / self.n_head);
        let one = |(w, bias): &(PackedWeight, Tensor)| self.linear(h, w, bias)?.reshape(heads);
        Ok((one(q)?, one(k)?, one(v)?))
    }
}
