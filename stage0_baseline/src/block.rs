//! Stage 0's block for the runner and the ladder: the weights as the baseline holds them, and
//! the forward, every op from `crate`'s primitives.

use crate::{attention, causal_mask, gelu_tanh, layer_norm, linear};
use candle_core::Tensor;
use shared::breakdown::part;
use shared::device::{DeviceInfo, GemmSwitches};
use shared::perf::Traffic;
use shared::stage::{PrecisionChoice, Rebuild};
use shared::{BlockWeights, Forward, Plan, Precision, PrecisionRequest, Shape, SpeedkitError, Stage, StageEntry};

pub struct Block {
    ln1_g: Tensor,  // (C)
    ln1_b: Tensor,  // (C)
    w_q: Tensor,    // (C, C)
    b_q: Tensor,    // (C)
    w_k: Tensor,    // (C, C)
    b_k: Tensor,    // (C)
    w_v: Tensor,    // (C, C)
    b_v: Tensor,    // (C)
    w_proj: Tensor, // (C, C)
    b_proj: Tensor, // (C)
    ln2_g: Tensor,  // (C)
    ln2_b: Tensor,  // (C)
    w_fc1: Tensor,  // (FF, C)
    b_fc1: Tensor,  // (FF)
    w_fc2: Tensor,  // (C, FF)
    b_fc2: Tensor,  // (C)
    n_head: usize,
    mask: Tensor, // (T, T): 0 on and below the diagonal, -inf above
}

/// Stage 0 as the runner and the ladder see it: no flags of its own.
#[derive(Clone, Copy, Debug, Default)]
pub struct Baseline;

/// How a binary or the ladder finds stage 0.
pub const STAGE: StageEntry = StageEntry { args: |c| c, make: |_| Ok(Box::new(Baseline)) };

impl Stage for Baseline {
    fn name(&self) -> &'static str {
        "stage0_baseline"
    }

    fn technique(&self) -> &'static str {
        "fp32, every op spelled out, full T x T attention"
    }

    fn own_precision(&self) -> Option<Precision> {
        Some(Precision::Fp32)
    }

    fn choose_precision(&self, _info: &DeviceInfo, requested: PrecisionRequest) -> Result<PrecisionChoice, SpeedkitError> {
        match requested {
            PrecisionRequest::Auto | PrecisionRequest::Exactly(Precision::Fp32) => {
                Ok((Precision::Fp32, "the baseline is fp32 by definition (TF32 off)".into()))
            }
            PrecisionRequest::Exactly(p) => Err(SpeedkitError::usage(format!(
                "stage0_baseline runs fp32 only (it is the reference), but --precision {p} was given. \
                 Fix: drop --precision here, or run stage 1 and later, where lower precision is the technique."
            ))),
        }
    }

    fn switches(&self, _plan: &Plan) -> GemmSwitches {
        GemmSwitches::OFF
    }

    fn build(&self, w: &BlockWeights, plan: &Plan) -> anyhow::Result<Box<dyn Forward>> {
        Ok(Box::new(Block::build(w, plan)?))
    }

    fn check_train(&self, _plan: &Plan) -> Result<(), SpeedkitError> {
        Ok(()) // candle's autograd differentiates every primitive op of the forward
    }

    fn build_train(&self, w: &BlockWeights, plan: &Plan) -> anyhow::Result<Box<dyn Forward>> {
        Ok(Box::new(Rebuild { stage: Baseline, weights: w.clone(), plan: plan.clone() }))
    }

    fn traffic(&self, shape: &Shape, p: Precision, act: f64) -> f64 {
        let t = Traffic::new(shape, p, act);
        t.gemms + t.naive_attention + t.unfused
    }
}

impl Block {
    pub fn build(w: &BlockWeights, plan: &Plan) -> anyhow::Result<Block> {
        Baseline.switches(plan).apply();
        let c = plan.shape.d_model;
        // Three separate projections, as a first implementation would write them.
        let rows = |i: usize| w.w_qkv.narrow(0, i * c, c).and_then(|t| t.contiguous()); // (C, C)
        let bias = |i: usize| w.b_qkv.narrow(0, i * c, c).and_then(|t| t.contiguous()); // (C)
        Ok(Block {
            ln1_g: w.ln1_g.clone(),
            ln1_b: w.ln1_b.clone(),
            w_q: rows(0)?,
            b_q: bias(0)?,
            w_k: rows(1)?,
            b_k: bias(1)?,
            w_v: rows(2)?,
            b_v: bias(2)?,
            w_proj: w.w_proj.clone(),
            b_proj: w.b_proj.clone(),
            ln2_g: w.ln2_g.clone(),
            ln2_b: w.ln2_b.clone(),
            w_fc1: w.w_fc1.clone(),
            b_fc1: w.b_fc1.clone(),
            w_fc2: w.w_fc2.clone(),
            b_fc2: w.b_fc2.clone(),
            n_head: plan.shape.n_head,
            mask: causal_mask(plan.shape.seq, &plan.device)?,
        })
    }
}

impl Forward for Block {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        part("ln1")?; // a no-op unless --breakdown is recording (shared::breakdown)
        let h = layer_norm(x, &self.ln1_g, &self.ln1_b)?; // (B, T, C)
        part("qkv")?;
        let q = linear(&h, &self.w_q, &self.b_q)?; // (B, T, C)
        let k = linear(&h, &self.w_k, &self.b_k)?;
        let v = linear(&h, &self.w_v, &self.b_v)?;
        part("attention")?;
        let a = attention(&q, &k, &v, self.n_head, &self.mask)?; // (B, T, C)
        part("proj+residual")?;
        let x = (x + linear(&a, &self.w_proj, &self.b_proj)?)?;
        part("ln2")?;
        let h = layer_norm(&x, &self.ln2_g, &self.ln2_b)?;
        part("fc1+gelu")?;
        let m = gelu_tanh(&linear(&h, &self.w_fc1, &self.b_fc1)?)?; // (B, T, FF)
        part("fc2+residual")?;
        x + linear(&m, &self.w_fc2, &self.b_fc2)?
    }
}
