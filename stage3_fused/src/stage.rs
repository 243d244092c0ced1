//! Stage 3 as the runner and the ladder see it (the block itself is `block.rs`): its four
//! fusions, each switchable (`--fusions`), and the flags stage 3 introduces.

use crate::adamw::{AdamW, ParamsAdamW};
use crate::Block;
use candle_core::backprop::GradStore;
use candle_core::Var;
use cpu_kernels::elementwise as ew;
use shared::device::{DeviceInfo, GemmSwitches};
use shared::perf::Traffic;
use shared::stage::{describe_switches, parse_switches, switch_off, switches_on, train_params, Optimize, PrecisionChoice, Rebuild};
use shared::{BlockWeights, Forward, Plan, Precision, PrecisionRequest, Shape, SpeedkitError, Stage, StageEntry};
use stage1_tensorcore::precision;
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
        Ok(Box::new(Block::build(w, plan, self, ew::mode())?))
    }

    /// One row per fusion that is on, that fusion alone undone (its slow twin: stage 2's passes
    /// for that part, on the same engine), everything else as it is.
    fn ablations(&self, _plan: &Plan) -> Vec<(String, Box<dyn Stage>)> {
        let without = |name: &str| -> (String, Box<dyn Stage>) {
            (format!("without {name}"), Box::new(Fused { fusions: self.fusions.without(name), ..*self }))
        };
        self.fusions.on().into_iter().map(without).collect()
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
        crate::selftest::layer_norm_backward(rows, device);
        crate::selftest::qkv_attention_backward(rows, device);
        crate::selftest::adamw(rows, device);
    }

    /// The fused ops' backward (`backward.rs`), stage 2's attention's and candle's autograd for
    /// the rest (a fusion switched off runs stage 2's passes, which hand tracked tensors to
    /// candle's differentiable ops).
    fn check_train(&self, _plan: &Plan) -> Result<(), SpeedkitError> {
        Ok(())
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
