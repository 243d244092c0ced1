//! The reference rows: the block written the way a candle user would write it with the library's
//! own fast paths, so every stage can be read against what it would otherwise cost to get.
//!
//! - LayerNorm: `candle_nn::ops::layer_norm`, candle-nn's fused one-pass op (CPU and CUDA).
//! - Linear layers: `candle_nn::Linear` (a GEMM, then the bias as a separate broadcast add).
//! - Attention on the CPU: `candle_nn::attention::flash_attn`, candle-nn's CPU flash attention
//!   (online softmax, no T × T matrix). On CUDA: candle-flash-attn in a `flash-attn` build, else
//!   the materialised scores with candle-nn's fused `softmax_last_dim`.
//! - GELU: candle's tanh-approximation `gelu`, as GPT-2 uses.
//!
//! It runs at the precision stage 1's policy picks on a GPU (`--precision` applies), with the same
//! mixed-precision rule: LayerNorm statistics, softmax and the residual stream in f32. On a CPU
//! `auto` is fp32: candle's CPU matmul has no bf16 kernel, so that is the library's fastest.

use candle_core::{DType, Module, Tensor};
use candle_nn::Linear;
use shared::breakdown::part;
use shared::device::{DeviceInfo, GemmSwitches};
use shared::perf::Traffic;
use shared::stage::PrecisionChoice;
use shared::{BlockWeights, Forward, Plan, Precision, PrecisionRequest, Shape, SpeedkitError, Stage, StageEntry};
use stage1_tensorcore::precision;

/// The reference rows the ladder can time (`ladder --reference`).
pub const REFERENCES: [StageEntry; 1] = [StageEntry { args: |c| c, make: |_| Ok(Box::new(CandleNn)) }];

/// The block on candle-nn's ops.
pub struct CandleNn;

/// What runs the attention on this device, in this build.
fn attention_kind(info: &DeviceInfo) -> &'static str {
    match (info.is_cuda(), cfg!(feature = "flash-attn")) {
        (false, _) => "candle-nn's CPU flash attention",
        (true, true) => "candle-flash-attn",
        (true, false) => "materialised scores, candle-nn's fused softmax",
    }
}

impl Stage for CandleNn {
    fn name(&self) -> &'static str {
        "candle-nn ops"
    }

    fn technique(&self) -> &'static str {
        "reference: candle-nn's fused LayerNorm, Linear and attention, as a user would write it"
    }

    fn choose_precision(&self, info: &DeviceInfo, requested: PrecisionRequest) -> Result<PrecisionChoice, SpeedkitError> {
        match requested {
            // The reference is what the library gives at its best: candle's CPU matmul has no
            // bf16 kernel (it converts), so on a CPU that is fp32 whatever bf16 units it has.
            PrecisionRequest::Auto if !info.is_cuda() => {
                Ok((Precision::Fp32, "auto on CPU: candle-nn's GEMMs have no bf16 kernel on the CPU, so fp32 is its fastest".into()))
            }
            _ => precision::choose(info, requested),
        }
    }

    fn switches(&self, plan: &Plan) -> GemmSwitches {
        precision::switches(plan.precision)
    }

    fn check_shape(&self, shape: &Shape) -> Result<(), SpeedkitError> {
        // On CUDA without candle-flash-attn the scores are materialised; on the CPU they are not.
        shape.validate_score_matrix()
    }

    fn implementation(&self, plan: &Plan) -> Option<String> {
        Some(attention_kind(&plan.info).to_string())
    }

    fn build(&self, w: &BlockWeights, plan: &Plan) -> anyhow::Result<Box<dyn Forward>> {
        self.switches(plan).apply();
        let dt = precision::gemm_dtype(plan.precision);
        let linear = |w: &Tensor, b: &Tensor| -> candle_core::Result<Linear> { Ok(Linear::new(w.to_dtype(dt)?, Some(b.to_dtype(dt)?))) };
        Ok(Box::new(Block {
            ln1: (w.ln1_g.clone(), w.ln1_b.clone()),
            qkv: linear(&w.w_qkv, &w.b_qkv)?,
            proj: linear(&w.w_proj, &w.b_proj)?,
            ln2: (w.ln2_g.clone(), w.ln2_b.clone()),
            fc1: linear(&w.w_fc1, &w.b_fc1)?,
            fc2: linear(&w.w_fc2, &w.b_fc2)?,
            n_head: plan.shape.n_head,
            dtype: dt,
            cuda: plan.info.is_cuda(),
        }))
    }

    fn traffic(&self, shape: &Shape, p: Precision, act: f64) -> f64 {
        let t = Traffic::new(shape, p, act);
        t.gemms + t.fused_attention + t.unfused
    }
}

struct Block {
    ln1: (Tensor, Tensor), // gain, bias (C) f32
    qkv: Linear,           // (3C, C): q, k, v in one GEMM, as GPT-2's c_attn
    proj: Linear,
    ln2: (Tensor, Tensor),
    fc1: Linear,
    fc2: Linear,
    n_head: usize,
    dtype: DType, // GEMM operand dtype
    cuda: bool,
}

const LN_EPS: f32 = 1e-5;

impl Block {
    /// q, k, v as (B, T, n_head, d_head); out (B, T, C).
    fn attention(&self, q: &Tensor, k: &Tensor, v: &Tensor) -> candle_core::Result<Tensor> {
        let (b, t, h, d) = q.dims4()?;
        let scale = 1.0 / (d as f32).sqrt();
        let out = if !self.cuda {
            // candle-nn's CPU kernel takes B > 1 in f32 and f16 only: bf16 goes one sequence at a time.
            let one = |q: &Tensor, k: &Tensor, v: &Tensor| {
                let mask = candle_nn::attention::AttnMask::causal();
                match q.dtype() {
                    DType::BF16 => candle_nn::attention::flash_attn::<half::bf16>(q, k, v, scale, mask, None, None),
                    DType::F16 => candle_nn::attention::flash_attn::<half::f16>(q, k, v, scale, mask, None, None),
                    _ => candle_nn::attention::flash_attn::<f32>(q, k, v, scale, mask, None, None),
                }
            };
            let o = if q.dtype() == DType::BF16 && b > 1 {
                let per = (0..b)
                    .map(|i| one(&q.narrow(0, i, 1)?, &k.narrow(0, i, 1)?, &v.narrow(0, i, 1)?))
                    .collect::<candle_core::Result<Vec<_>>>()?;
                Tensor::cat(&per, 0)?
            } else {
                one(q, k, v)?
            }; // (B, n_head, T, d_head)
            o.transpose(1, 2)?
        } else if cfg!(feature = "flash-attn") {
            flash_attn(q, k, v, scale)? // (B, T, n_head, d_head)
        } else {
            let (q, k, v) = (q.transpose(1, 2)?.contiguous()?, k.transpose(1, 2)?.contiguous()?, v.transpose(1, 2)?.contiguous()?);
            let s = (q.matmul(&k.t()?)? * scale as f64)?.to_dtype(DType::F32)?; // (B, n_head, T, T), softmax in f32
            let mask: Vec<f32> = (0..t * t).map(|i| if i % t > i / t { f32::NEG_INFINITY } else { 0.0 }).collect();
            let s = s.broadcast_add(&Tensor::from_vec(mask, (t, t), q.device())?)?;
            let p = candle_nn::ops::softmax_last_dim(&s)?.to_dtype(self.dtype)?;
            p.matmul(&v)?.transpose(1, 2)?
        };
        // candle-nn's CPU kernel returns f32 for half-precision inputs: back to the GEMM dtype.
        out.to_dtype(self.dtype)?.contiguous()?.reshape((b, t, h * d))
    }
}

#[cfg(feature = "flash-attn")]
fn flash_attn(q: &Tensor, k: &Tensor, v: &Tensor, scale: f32) -> candle_core::Result<Tensor> {
    candle_flash_attn::flash_attn(q, k, v, scale, true)
}

#[cfg(not(feature = "flash-attn"))]
fn flash_attn(_q: &Tensor, _k: &Tensor, _v: &Tensor, _scale: f32) -> candle_core::Result<Tensor> {
    candle_core::bail!("candle-flash-attn is not in this build (the flash-attn feature)")
}

impl Forward for Block {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let (b, t, c) = x.dims3()?;
        let heads = (b, t, 3, self.n_head, c / self.n_head);
        let ln = |x: &Tensor, (g, beta): &(Tensor, Tensor)| candle_nn::ops::layer_norm(x, g, beta, LN_EPS)?.to_dtype(self.dtype);
        part("ln1")?; // `--breakdown`'s part boundaries, as in the stages
        let h = ln(x, &self.ln1)?;
        part("qkv")?;
        let qkv = self.qkv.forward(&h)?.reshape(heads)?; // (B, T, 3, n_head, d_head)
        let head = |i: usize| qkv.narrow(2, i, 1)?.squeeze(2)?.contiguous();
        let (q, k, v) = (head(0)?, head(1)?, head(2)?);
        part("attention")?;
        let a = self.attention(&q, &k, &v)?;
        part("proj+residual")?;
        let x = (x + self.proj.forward(&a)?.to_dtype(DType::F32)?)?; // residual stream in f32
        part("ln2")?;
        let h = ln(&x, &self.ln2)?;
        part("fc1+gelu")?;
        let m = self.fc1.forward(&h)?.gelu()?;
        part("fc2+residual")?;
        x + self.fc2.forward(&m)?.to_dtype(DType::F32)?
    }
}
