//! Stage 2's block for the runner and the ladder: stage 1's forward with attention fused, and
//! the flags stage 2 introduces.

use crate::attention::{self, attention_cpu, AttentionKernel, CpuKernel};
// Element-wise ops: stage 0's primitives, one pass each, as stages 0–1 run them (candle's ops),
// so this stage differs from stage 1 in its attention only. `--elementwise parallel` runs the
// same passes multi-threaded and vectorised on the CPU (`crate::elementwise`), to measure what
// threading alone buys; stage 3 then fuses them.
use crate::elementwise::{self as ew, gelu_tanh, layer_norm, linear, Elementwise, LN_EPS};
use crate::{attention_with, attention_with_copies};
use candle_core::{DType, Tensor};
use clap::builder::{PossibleValuesParser, TypedValueParser};
use shared::breakdown::part;
use shared::device::{DeviceInfo, GemmSwitches};
use shared::perf::Traffic;
use shared::stage::{PrecisionChoice, Rebuild};
use shared::{BlockWeights, Forward, Plan, Precision, PrecisionRequest, Shape, SpeedkitError, Stage, StageEntry};
use stage1_tensorcore::precision;

/// The flags stage 2 introduces (stages 3 and 4 honour them too).
#[derive(clap::Args, Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Args {
    /// Stage 2 on the CPU: its unfused element-wise ops (LayerNorm, GELU, bias, residual) from candle, as stages 0–1 run them (candle, the default: the step from stage 1 is attention alone), or multi-threaded and vectorised (parallel), to measure what threading them buys
    #[arg(long, env = "SPEEDKIT_ELEMENTWISE", default_value = "candle", value_parser = PossibleValuesParser::new(["parallel", "candle"]).map(|s| if s == "parallel" { Elementwise::Parallel } else { Elementwise::Candle }))]
    pub elementwise: Elementwise,
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
        if self.args.elementwise == Elementwise::Parallel && !plan.info.is_cuda() {
            label.push_str(", elementwise parallel");
        }
        if let Some(kernel) = precision::cpu_bf16_kernel(plan) {
            label.push_str(&format!(", bf16 linears {kernel}"));
            // The fused attention's products: on AVX512-BF16 where its kernel runs, else bf16
            // widened to f32 per head.
            let on_bf16 = imp == attention::Implementation::Cpu && !self.row_wise && attention::registers::bf16::runs(plan.shape.d_head());
            label.push_str(if on_bf16 { ", bf16 attention avx512-bf16" } else { ", attention widened to f32" });
        }
        label
    }
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
        let mut notes = stage1_tensorcore::TensorCore.notes(plan); // alignment advice
        let imp = attention_of(plan, self.args.attention_kernel);
        notes.push(match imp {
            attention::Implementation::Cpu => format!(
                "attention: speedkit online-softmax attention on the CPU, the {} at d_head {} (rayon over batch × heads)",
                Self::cpu_kernel(plan.shape.d_head()),
                plan.shape.d_head()
            ),
            imp => format!("attention: {}", imp.description()),
        });
        if plan.train && plan.info.is_cuda() {
            notes.push(match plan.precision {
                Precision::Bf16 | Precision::F16 => {
                    "training on CUDA: attention's backward is our kernel (kernels/flash_attn_bwd.cu), from the L the forward kept".into()
                }
                p => format!(
                    "training on CUDA at {p}: attention's backward runs as candle ops that materialise the (B, n_head, T, T) \
                     scores (the backward kernel takes bf16 or f16)"
                ),
            });
        }
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
        Ok(Box::new(Block::build(w, plan, self)?))
    }

    fn ablations(&self, plan: &Plan) -> Vec<(String, Box<dyn Stage>)> {
        let mut v: Vec<(String, Box<dyn Stage>)> = vec![("head split/merge copies kept".into(), Box::new(Sdpa { copies: true, ..*self }))];
        // Our attention kernel's second step undone: v1 (WMMA) where v2 runs by default.
        if attention_of(plan, self.args.attention_kernel) == attention::Implementation::SpeedkitCuda {
            let args = Args { attention_kernel: Some(AttentionKernel::V1), ..self.args };
            v.push(("v1 instead of v2".into(), Box::new(Sdpa { args, ..*self })));
        }
        if attention_of(plan, self.args.attention_kernel) == attention::Implementation::Cpu {
            // The algorithm without the engineering: the same online softmax one query row at a
            // time (scores, then one axpy per key into an O row in memory), no register tiles.
            v.push(("row-wise online softmax, no register tiles".into(), Box::new(Sdpa { row_wise: true, ..*self })));
        }
        if !plan.info.is_cuda() && self.args.elementwise == Elementwise::Parallel {
            // Asked to run the unfused passes multi-threaded: also the stage as written, on
            // candle's single-threaded ops, to show what that buys.
            let args = Args { elementwise: Elementwise::Candle, ..self.args };
            v.push(("candle's element-wise ops".into(), Box::new(Sdpa { args, ..*self })));
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
    /// autograd for the rest; `--elementwise parallel` cannot train (its passes are untracked).
    fn check_train(&self, plan: &Plan) -> Result<(), SpeedkitError> {
        check_elementwise_trains(self.args.elementwise, plan, "stage 2")
    }

    /// The casts of `build` once per step, as autocast's: the weights stay f32 masters.
    fn build_train(&self, w: &BlockWeights, plan: &Plan) -> anyhow::Result<Box<dyn Forward>> {
        Ok(Box::new(Rebuild { stage: *self, weights: w.clone(), plan: plan.clone() }))
    }
}

/// `--train` with `--elementwise parallel` on the CPU is refused: those passes write their
/// outputs as new tensors outside candle's graph, so the weights before them would get no
/// gradient. `who`: the stage whose passes they are.
pub fn check_elementwise_trains(ew: Elementwise, plan: &Plan, who: &str) -> Result<(), SpeedkitError> {
    if ew == Elementwise::Parallel && !plan.info.is_cuda() {
        return Err(SpeedkitError::usage(format!(
            "{who} cannot train with --elementwise parallel: its multi-threaded CPU passes (LayerNorm, GELU, bias, residual, casts) \
             build their outputs outside candle's autograd graph, so no gradient would reach the weights before them. \
             Fix: drop --elementwise parallel (and SPEEDKIT_ELEMENTWISE) for --train; candle's element-wise ops, the default, are differentiated."
        )));
    }
    Ok(())
}

/// The attention implementation a run with `--attention-kernel` = `kernel` uses on this plan's
/// device, for labels and notes (`check_plan` refuses a kernel the device cannot honour; the
/// label then shows the default).
pub fn attention_of(plan: &Plan, kernel: Option<AttentionKernel>) -> attention::Implementation {
    crate::harness::for_run(&plan.device, kernel).unwrap_or(attention::Implementation::on(&plan.device))
}

pub struct Block {
    ln1_g: Tensor,  // (C) f32
    ln1_b: Tensor,  // (C) f32
    w_q: Tensor,    // (C, C) GEMM dtype
    b_q: Tensor,    // (C) GEMM dtype
    w_k: Tensor,    // (C, C)
    b_k: Tensor,    // (C)
    w_v: Tensor,    // (C, C)
    b_v: Tensor,    // (C)
    w_proj: Tensor, // (C, C)
    b_proj: Tensor, // (C)
    ln2_g: Tensor,  // (C) f32
    ln2_b: Tensor,  // (C) f32
    w_fc1: Tensor,  // (FF, C)
    b_fc1: Tensor,  // (FF)
    w_fc2: Tensor,  // (C, FF)
    b_fc2: Tensor,  // (C)
    n_head: usize,
    dtype: DType,                    // GEMM operand dtype: bf16, f16, or f32 (fp32 and TF32)
    ew: Elementwise,                 // --elementwise
    copies: bool,                    // ablation only (`ladder --ablate`): keep stages 0-1's head split/merge copies
    row_wise: bool,                  // ablation only: the CPU's row-wise kernel instead of the register-blocked one
    attn: attention::Implementation, // which attention kernel runs (`--attention-kernel` on CUDA)
}

impl Block {
    pub fn build(w: &BlockWeights, plan: &Plan, stage: &Sdpa) -> anyhow::Result<Block> {
        precision::switches(plan.precision).apply();
        stage.check_plan(plan)?;
        let attn = crate::harness::for_run(&plan.device, stage.args.attention_kernel)?;
        let c = plan.shape.d_model;
        let dt = precision::gemm_dtype(plan.precision);
        // Three separate projections, as in stages 0 and 1 (stage 3 fuses them).
        let rows = |i: usize| w.w_qkv.narrow(0, i * c, c).and_then(|t| t.to_dtype(dt)?.contiguous()); // (C, C)
        let bias = |i: usize| w.b_qkv.narrow(0, i * c, c).and_then(|t| t.to_dtype(dt)?.contiguous()); // (C)
        Ok(Block {
            ln1_g: w.ln1_g.clone(),
            ln1_b: w.ln1_b.clone(),
            w_q: rows(0)?,
            b_q: bias(0)?,
            w_k: rows(1)?,
            b_k: bias(1)?,
            w_v: rows(2)?,
            b_v: bias(2)?,
            w_proj: w.w_proj.to_dtype(dt)?,
            b_proj: w.b_proj.to_dtype(dt)?,
            ln2_g: w.ln2_g.clone(),
            ln2_b: w.ln2_b.clone(),
            w_fc1: w.w_fc1.to_dtype(dt)?,
            b_fc1: w.b_fc1.to_dtype(dt)?,
            w_fc2: w.w_fc2.to_dtype(dt)?,
            b_fc2: w.b_fc2.to_dtype(dt)?,
            n_head: plan.shape.n_head,
            dtype: dt,
            ew: stage.args.elementwise,
            copies: stage.copies,
            row_wise: stage.row_wise && attn == attention::Implementation::Cpu,
            attn,
        })
    }
}

impl Forward for Block {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let (b, t, c) = x.dims3()?;
        let heads = (b, t, self.n_head, c / self.n_head); // (B, T, n_head, d_head): a view of (B, T, C), no copy
        let e = self.ew;
        part("ln1")?; // a no-op unless --breakdown is recording (shared::breakdown)
        let h = ew::to_dtype(&layer_norm(x, &self.ln1_g, &self.ln1_b, LN_EPS, e)?, self.dtype, e)?; // (B, T, C): f32 statistics, GEMM dtype out
        part("qkv")?;
        let q = linear(&h, &self.w_q, &self.b_q, e)?.reshape(heads)?; // (B, T, n_head, d_head)
        let k = linear(&h, &self.w_k, &self.b_k, e)?.reshape(heads)?;
        let v = linear(&h, &self.w_v, &self.b_v, e)?.reshape(heads)?;
        part("attention")?;
        let a = if self.row_wise {
            attention_cpu(CpuKernel::RowAxpy, &q, &k, &v, true)?
        } else if self.copies {
            attention_with_copies(self.attn, &q, &k, &v)?
        } else {
            attention_with(self.attn, &q, &k, &v, true)?
        }
        .reshape((b, t, c))?; // (B, T, C)
        part("proj+residual")?;
        let x = ew::add(x, &ew::to_dtype(&linear(&a, &self.w_proj, &self.b_proj, e)?, DType::F32, e)?, e)?; // residual stream stays f32
        part("ln2")?;
        let h = ew::to_dtype(&layer_norm(&x, &self.ln2_g, &self.ln2_b, LN_EPS, e)?, self.dtype, e)?;
        part("fc1+gelu")?;
        let m = gelu_tanh(&linear(&h, &self.w_fc1, &self.b_fc1, e)?, e)?; // (B, T, FF)
        part("fc2+residual")?;
        ew::add(&x, &ew::to_dtype(&linear(&m, &self.w_fc2, &self.b_fc2, e)?, DType::F32, e)?, e)
    }
}
