//! Correctness before speed: compare a stage's output with the fp32 reference.

use crate::error::SpeedkitError;
use crate::stage::Precision;
use candle_core::{DType, Device, Tensor};
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
pub fn compare(y: &Tensor, reference: &Tensor, precision: Precision) -> candle_core::Result<CheckResult> {
    compare_within(y, reference, tolerance(precision))
}

pub fn compare_within(y: &Tensor, reference: &Tensor, tolerance: f64) -> candle_core::Result<CheckResult> {
    if y.dims() != reference.dims() {
        candle_core::bail!("output shape {:?} differs from the reference's {:?}", y.dims(), reference.dims());
    }
    let host = |t: &Tensor| -> candle_core::Result<Vec<f32>> { t.to_device(&Device::Cpu)?.to_dtype(DType::F32)?.flatten_all()?.to_vec1() };
    let (y, r) = (host(y)?, host(reference)?);
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

/// How many sequences the fp32 reference (stage 0) computes at once so its (b, n_head, T, T)
/// scores hold at most `limit` elements: sequences are independent, so in pieces along B it still
/// checks shapes whose whole score matrix would not fit (te at T = 4096). Exit 2 if one is too many.
pub fn reference_batch_chunk(shape: &crate::Shape, limit: usize) -> Result<usize, SpeedkitError> {
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
pub fn forward_in_pieces(
    x: &Tensor,
    chunk: usize,
    forward: impl Fn(&Tensor) -> candle_core::Result<Tensor>,
) -> candle_core::Result<Tensor> {
    let b = x.dim(0)?;
    let pieces = (0..b).step_by(chunk.max(1)).map(|start| forward(&x.narrow(0, start, chunk.min(b - start))?)); // (chunk, T, C)
    Tensor::cat(&pieces.collect::<candle_core::Result<Vec<_>>>()?, 0) // (B, T, C)
}

impl CheckResult {
    /// When the check failed: what, by how much, and what to do.
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
mod tests {
    use super::*;

    #[test]
    fn reference_pieces_keep_the_scores_within_the_limit() {
        let te = crate::Preset::Te.shape(); // B 8, n_head 32
        let t4096 = crate::Shape { seq: 4096, ..te };
        // 32·4096² = 5.4e8 per sequence: 3 sequences at a time within 2^31 - 1.
        assert_eq!(reference_batch_chunk(&t4096, crate::preset::MAX_TENSOR_ELEMENTS).unwrap(), 3);
        assert_eq!(reference_batch_chunk(&te, crate::preset::MAX_TENSOR_ELEMENTS).unwrap(), 8, "whole when it fits");
        let e = reference_batch_chunk(&crate::Shape { seq: 8192, ..te }, crate::preset::MAX_TENSOR_ELEMENTS).unwrap_err();
        assert!(e.to_string().contains("Fix:") && e.to_string().contains("(32, 8192, 8192)"), "{e}");
        let x = Tensor::arange(0f32, 3.0 * 2.0 * 4.0, &Device::Cpu).unwrap().reshape((3, 2, 4)).unwrap();
        let seen = std::cell::RefCell::new(Vec::new());
        let y = forward_in_pieces(&x, 2, |p| {
            seen.borrow_mut().push(p.dim(0)?);
            p * 2.0
        })
        .unwrap();
        assert_eq!(*seen.borrow(), [2, 1], "uneven pieces");
        assert_eq!(y.to_vec3::<f32>().unwrap(), (&x * 2.0).unwrap().to_vec3::<f32>().unwrap());
    }

    #[test]
    fn tolerances_order_by_mantissa_bits() {
        use Precision::*;
        assert!(tolerance(Fp32) < tolerance(Tf32));
        assert!(tolerance(Tf32) < tolerance(F16));
        assert!(tolerance(F16) < tolerance(Bf16));
        assert!(tolerance(Bf16) < tolerance(Fp8));
    }

    #[test]
    fn compare_measures_and_fails() {
        let r = Tensor::new(&[3f32, 4.0], &Device::Cpu).unwrap();
        let same = compare(&r, &r, Precision::Fp32).unwrap();
        assert_eq!(same.rel_err, 0.0);
        assert!(same.passed);
        // y − ref = (0, 0.05): ||·|| = 0.05, ||ref|| = 5 → 1e-2
        let y = Tensor::new(&[3f32, 4.05], &Device::Cpu).unwrap();
        let c = compare(&y, &r, Precision::Fp32).unwrap();
        assert!((c.rel_err - 1e-2).abs() < 1e-6 && (c.max_abs_err - 0.05).abs() < 1e-6);
        assert!(!c.passed);
        assert!(c.to_error("s", Precision::Fp32).unwrap().to_string().contains("exceeds the fp32 tolerance"));
        assert!(compare(&y, &r, Precision::Bf16).unwrap().passed);
        let nan = Tensor::new(&[f32::NAN, 4.0], &Device::Cpu).unwrap();
        let c = compare(&nan, &r, Precision::Fp8).unwrap();
        assert_eq!(c.non_finite, 1);
        assert!(!c.passed);
    }
}
