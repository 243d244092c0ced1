//! Correctness before speed: compare a stage's output with the fp32 reference.

use crate::error::SpeedkitError;
use crate::stage::Precision;
use candle_core::{DType, Device, Result, Tensor};
use serde::{Deserialize, Serialize};

/// Largest accepted ||y − ref||₂ / ||ref||₂ for a stage running at `p`.
pub fn tolerance(p: Precision) -> f64 {
    match p {
        // Summation order only: ~1e-7 is typical, 1e-5 leaves room for other GEMM blockings.
        Precision::Fp32 => 1e-5,
        // 10 mantissa bits of the GEMM inputs (unit roundoff 2^-11); several GEMMs compound to ~1e-3.
        Precision::Tf32 => 5e-3,
        // 7 mantissa bits (2^-8 ≈ 3.9e-3) for weights and activations.
        Precision::Bf16 => 2e-2,
        // 10 mantissa bits (2^-11) but less range; activations stay inside it here.
        Precision::F16 => 1e-2,
        // E4M3: 3 mantissa bits (6.25e-2 relative step at worst); per-tensor scaling keeps values
        // in range, and rounding errors partly average out across a dot product.
        Precision::Fp8 => 8e-2,
    }
}

/// `rel_err` ||y − ref||₂ / ||ref||₂, `max_abs_err` max |y − ref|, `non_finite` NaN/inf in y.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CheckResult {
    pub rel_err: f64,
    pub max_abs_err: f64,
    pub tolerance: f64,
    pub non_finite: usize,
    pub passed: bool,
}

/// A stage's own check (`Stage::self_check`), e.g. "fp8-rounded fp32 twin"; `meaning`: what a
/// pass rules out and what a failure would mean.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct NamedCheck {
    pub name: String,
    pub meaning: String,
    pub result: CheckResult,
}

/// Compare `y` against `reference` (any devices, any float dtypes), in f64 on the host.
pub fn compare(y: &Tensor, reference: &Tensor, precision: Precision) -> Result<CheckResult> {
    compare_within(y, reference, tolerance(precision))
}

pub fn compare_within(y: &Tensor, reference: &Tensor, tolerance: f64) -> Result<CheckResult> {
    if y.dims() != reference.dims() {
        candle_core::bail!("output shape {:?} differs from the reference's {:?}", y.dims(), reference.dims());
    }
    let (y, r) = (host_f32(y)?, host_f32(reference)?);
    let (mut diff2, mut ref2, mut max_abs, mut non_finite) = (0f64, 0f64, 0f64, 0usize);
    for (&a, &b) in y.iter().zip(&r) {
        if !a.is_finite() {
            non_finite += 1;
            continue;
        }
        let d = a as f64 - b as f64;
        diff2 += d * d;
        ref2 += b as f64 * b as f64;
        max_abs = max_abs.max(d.abs());
    }
    let rel_err = if ref2 > 0.0 { (diff2 / ref2).sqrt() } else { diff2.sqrt() };
    Ok(CheckResult { rel_err, max_abs_err: max_abs, tolerance, non_finite, passed: non_finite == 0 && rel_err <= tolerance })
}

pub(crate) fn host_f32(t: &Tensor) -> Result<Vec<f32>> {
    t.to_device(&Device::Cpu)?.to_dtype(DType::F32)?.flatten_all()?.to_vec1()
}

/// How many sequences the fp32 reference computes at once so its scores hold at most `limit`
/// elements: in pieces along B it checks shapes whose whole score matrix would not fit.
pub fn reference_batch_chunk(shape: &crate::Shape, limit: usize) -> std::result::Result<usize, SpeedkitError> {
    let per_sequence = shape.n_head.checked_mul(shape.seq).and_then(|n| n.checked_mul(shape.seq));
    match per_sequence {
        Some(n) if n > 0 && n <= limit => Ok((limit / n).clamp(1, shape.batch.max(1))),
        _ => Err(SpeedkitError::usage(format!(
            "the fp32 reference (stage 0) needs the attention scores of one whole sequence, (n_head, T, T) = ({}, {}, {}), \
             past the limit of {limit} elements (2^31 - 1: 32-bit GEMM and kernel indexing), even one sequence at a time. \
             Fix: lower --seq or --heads, or run without the check (--no-check; the timings then vouch for nothing).",
            shape.n_head, shape.seq, shape.seq
        ))),
    }
}

/// `forward` over `x` (B, T, C) in pieces of `chunk` sequences along B, joined again.
pub fn forward_in_pieces(x: &Tensor, chunk: usize, forward: impl Fn(&Tensor) -> Result<Tensor>) -> Result<Tensor> {
    let b = x.dim(0)?;
    let pieces = (0..b).step_by(chunk.max(1)).map(|start| forward(&x.narrow(0, start, chunk.min(b - start))?)); // (chunk, T, C)
    Tensor::cat(&pieces.collect::<Result<Vec<_>>>()?, 0) // (B, T, C)
}

impl CheckResult {
    pub fn to_error(&self, stage: &str, precision: Precision) -> Option<SpeedkitError> {
        let what = if self.passed {
            return None;
        } else if self.non_finite > 0 {
            format!("{} output values are NaN or infinite", self.non_finite)
        } else {
            let (e, tol, max) = (self.rel_err, self.tolerance, self.max_abs_err);
            format!("relative error {e:.3e} exceeds the {precision} tolerance {tol:.1e} (max abs error {max:.3e})")
        };
        Some(SpeedkitError::CheckFailed(format!(
            "{stage} does not compute the block's function: {what} against the fp32 stage-0 reference \
             on the same weights and input. Nothing was timed. This is a bug in the stage (or, with \
             --weights/--input, values outside the precision's range). Fix: report it with this \
             command line; --no-check skips the check but the timing would then measure a wrong block."
        )))
    }
}

#[cfg(test)]
#[path = "../tests/unit/check.rs"]
mod tests;
