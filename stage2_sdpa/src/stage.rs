//! Stage 2 as the runner and the ladder see it (the block itself is `block.rs`): the flags stage
//! 2 introduces, its labels and ablations.

use crate::attention::{self, AttentionKernel};
use crate::Block;
use clap::builder::{PossibleValuesParser, TypedValueParser};
use cpu_kernels::elementwise as ew;
use shared::device::{DeviceInfo, GemmSwitches};
use shared::perf::Traffic;
use shared::stage::{PrecisionChoice, Rebuild};
use shared::{BlockWeights, Forward, Plan, Precision, PrecisionRequest, Shape, SpeedkitError, Stage, StageEntry};
use stage1_tensorcore::precision;

/// The flags stage 2 introduces (stages 3 and 4 honour them too).
#[derive(clap::Args, Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Args {
    /// Stages 2–4 on CUDA: which of our attention kernels runs, v1 (WMMA, the teaching kernel) or v2 (mma.sync, S and P in registers; the default). CUDA only
    #[arg(long, env = "SPEEDKIT_ATTENTION_KERNEL", value_parser = PossibleValuesParser::new(["v1", "v2"]).map(|s| if s == "v1" { AttentionKernel::V1 } else { AttentionKernel::V2 }))]
    pub attention_kernel: Option<AttentionKernel>,
}

/// Stage 2 as the runner and the ladder see it: its flags, and two variants `ladder --ablate`
/// times: stages 0–1's head split/merge copies kept around the fused kernel (`copies`), and on
/// the CPU the row-wise kernel, the online softmax alone without register tiles (`row_wise`).
#[derive(Clone, Copy, Debug, Default)]
pub struct Sdpa {
    pub args: Args,
    pub copies: bool,
    pub row_wise: bool,
}

/// How a binary or the ladder finds stage 2.
pub const STAGE: StageEntry = StageEntry {
    args: <Args as clap::Args>::augment_args,
    make: |m| {
        stage1_tensorcore::register_bf16_ceiling(); // bf16 rows' % of peak: against the bf16 GEMM rate
        Ok(Box::new(Sdpa::from_matches(m)?))
    },
};

impl Sdpa {
    /// Stage 2 configured by parsed flags.
    pub fn from_matches(m: &clap::ArgMatches) -> Result<Sdpa, clap::Error> {
        Ok(Sdpa { args: <Args as clap::FromArgMatches>::from_arg_matches(m)?, ..Sdpa::default() })
    }

    /// The CPU kernel `attention` runs at head size `d_head` on this CPU: the register-blocked
    /// micro-kernels where they have a body for it, else the tile-GEMM kernel.
    pub fn cpu_kernel(d_head: usize) -> &'static str {
        if attention::registers::supports(d_head) {
            "register-blocked CPU kernel"
        } else {
            "tile-GEMM CPU kernel"
        }
    }

    /// What runs this plan's attention, in words, with what stage 2's flags changed.
    pub fn label(&self, plan: &Plan) -> String {
        let imp = attention_of(plan, self.args.attention_kernel);
        let mut label = match imp {
            attention::Implementation::Cpu if self.row_wise => "speedkit cpu attn (row-wise CPU kernel)".to_string(),
            attention::Implementation::Cpu => format!("speedkit cpu attn ({})", Self::cpu_kernel(plan.shape.d_head())),
            imp => imp.name().to_string(),
        };
        if self.copies {
            label.push_str(", head split/merge copies kept");
        }
        if let Some(ew) = stage0_baseline::elementwise_label(plan, ew::mode()) {
            label.push_str(&format!(", {ew}"));
        }
        if let Some(kernel) = precision::cpu_bf16_kernel(plan) {
            label.push_str(&format!(", bf16 linears {kernel}"));
            // The fused attention's products: on AMX tiles or AVX512-BF16 where its kernel runs
            // (AMX where the bf16 GEMMs run on it and d_head is a multiple of 32), else bf16
            // widened to f32 per head.
            let d = plan.shape.d_head();
            let on_bf16 = imp == attention::Implementation::Cpu && !self.row_wise && attention::registers::bf16::runs(d);
            label.push_str(match (on_bf16, attention::registers::bf16::amx_runs(d)) {
                (true, true) => ", bf16 attention amx",
                (true, false) => ", bf16 attention avx512-bf16",
                (false, _) => ", attention widened to f32",
            });
        }
        label
    }
}

/// `--train` on CUDA: which backward attention runs, by the dtype attention computes in (stage
/// 4 passes its activations' bf16, not its fp8): our kernel for bf16 and f16, candle's ops that
/// materialise the scores otherwise. None for a forward or on the CPU.
pub fn cuda_attention_backward_note(plan: &Plan, attention_dtype: candle_core::DType) -> Option<String> {
    use candle_core::DType;
    (plan.train && plan.info.is_cuda()).then(|| match attention_dtype {
        DType::BF16 | DType::F16 => {
            "training on CUDA: attention's backward is our kernel (kernels/flash_attn_bwd.cu), from the L the forward kept".into()
        }
        dt => format!(
            "training on CUDA with attention in {}: attention's backward runs as candle ops that materialise the (B, n_head, T, T) \
             scores (the backward kernel takes bf16 or f16)",
            format!("{dt:?}").to_lowercase()
        ),
    })
}

impl Stage for Sdpa {
    fn name(&self) -> &'static str {
        "stage2_sdpa"
    }

    fn technique(&self) -> &'static str {
        "fused attention: online softmax, no T x T matrix in memory"
    }

    fn choose_precision(&self, info: &DeviceInfo, requested: PrecisionRequest) -> Result<PrecisionChoice, SpeedkitError> {
        let (p, why) = precision::choose(info, requested)?;
        crate::harness::check_device(info, p)?;
        Ok((p, why))
    }

    fn check_shape(&self, _shape: &Shape) -> Result<(), SpeedkitError> {
        Ok(()) // no (B, n_head, T, T) tensor exists, so no limit on it
    }

    fn estimate_bytes(&self, shape: &Shape) -> u128 {
        crate::harness::estimate_fused_bytes(shape)
    }

    fn estimate_train_bytes(&self, shape: &Shape) -> shared::train::TrainBytes {
        crate::harness::estimate_fused_train_bytes(shape)
    }

    fn switches(&self, plan: &Plan) -> GemmSwitches {
        precision::switches(plan.precision)
    }

    fn notes(&self, plan: &Plan) -> Vec<String> {
        // Alignment advice; which attention kernel ran, the runner's notes say (`shared::ran`).
        let mut notes = stage1_tensorcore::TensorCore.notes(plan);
        notes.extend(cuda_attention_backward_note(plan, precision::gemm_dtype(plan.precision)));
        notes
    }

    fn implementation(&self, plan: &Plan) -> Option<String> {
        Some(self.label(plan))
    }

    /// Every flag this device cannot honour, refused before any weights exist.
    fn check_plan(&self, plan: &Plan) -> Result<(), SpeedkitError> {
        crate::harness::for_run(&plan.device, self.args.attention_kernel)?;
        attention::check_head_size(&plan.device, plan.shape.d_head()).map_err(SpeedkitError::usage)
    }

    fn build(&self, w: &BlockWeights, plan: &Plan) -> anyhow::Result<Box<dyn Forward>> {
        Ok(Box::new(Block::build(w, plan, self, ew::mode())?))
    }

    fn ablations(&self, plan: &Plan) -> Vec<(String, Box<dyn Stage>)> {
        let mut v: Vec<(String, Box<dyn Stage>)> = vec![("head split/merge copies kept".into(), Box::new(Sdpa { copies: true, ..*self }))];
        // Our attention kernel's second step undone: v1 (WMMA) where v2 runs by default.
        if attention_of(plan, self.args.attention_kernel) == attention::Implementation::SpeedkitCuda {
            let args = Args { attention_kernel: Some(AttentionKernel::V1) };
            v.push(("v1 instead of v2".into(), Box::new(Sdpa { args, ..*self })));
        }
        if attention_of(plan, self.args.attention_kernel) == attention::Implementation::Cpu {
            // The algorithm without the engineering: the same online softmax one query row at a
            // time (scores, then one axpy per key into an O row in memory), no register tiles.
            v.push(("row-wise online softmax, no register tiles".into(), Box::new(Sdpa { row_wise: true, ..*self })));
        }
        v
    }

    fn traffic(&self, shape: &Shape, p: Precision, act: f64) -> f64 {
        let t = Traffic::new(shape, p, act);
        t.gemms + t.fused_attention + t.unfused
    }

    fn selftest(&self, device: &candle_core::Device, _info: &DeviceInfo, rows: &mut shared::selftest::Rows) {
        crate::selftest::attention(rows, device);
        crate::selftest::attention_backward(rows, device);
    }

    /// The attention op's backward (`attention::backward`), stage 1's bf16 GEMM's, and candle's
    /// autograd for the rest (the engine's element-wise passes hand tracked tensors to candle's
    /// ops, which its autograd differentiates).
    fn check_train(&self, _plan: &Plan) -> Result<(), SpeedkitError> {
        Ok(())
    }

    /// The casts of `build` once per step, as autocast's: the weights stay f32 masters.
    fn build_train(&self, w: &BlockWeights, plan: &Plan) -> anyhow::Result<Box<dyn Forward>> {
        Ok(Box::new(Rebuild { stage: *self, weights: w.clone(), plan: plan.clone() }))
    }
}

/// The attention implementation a run with `--attention-kernel` = `kernel` uses on this plan's
/// device, for labels and notes (`check_plan` refuses a kernel the device cannot honour; the
/// label then shows the default).
pub fn attention_of(plan: &Plan, kernel: Option<AttentionKernel>) -> attention::Implementation {
    crate::harness::for_run(&plan.device, kernel).unwrap_or(attention::Implementation::on(&plan.device))
}
