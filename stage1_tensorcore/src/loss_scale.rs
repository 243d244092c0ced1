//! Dynamic loss scaling for f16 training, as PyTorch's `GradScaler` does it.
//!
//! **Why.** f16 has 5 exponent bits: its smallest normal value is 6.1e-5 and its subnormals end at
//! 6.0e-8, so the small gradients of a deep network's early layers round to zero in an f16
//! backward. Multiplying the loss by a scale S (2^16 to start) multiplies every gradient by S on
//! the way back, lifting them into f16's range; the optimizer step then divides by S in f32 (the
//! master weights' precision). bf16 keeps f32's 8 exponent bits and needs none of this.
//!
//! **Dynamic.** Too large an S overflows: some gradient becomes ±inf or NaN. Then the step is
//! skipped (the weights and the optimizer's moments stay as they were) and S is halved. After
//! `growth_interval` clean steps in a row S is doubled again, so it hovers just under the largest
//! value that does not overflow.
//!
//! Use: multiply the upstream gradient (or the loss) by `scale()`, run the backward, pass the
//! gradients to `unscale` (or the backward's `GradStore` to `unscale_grads`); apply the optimizer
//! step only when it returns `Some`.

use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor, Var};

/// The scale's state and its update rule (PyTorch's `GradScaler` defaults).
#[derive(Clone, Debug, PartialEq)]
pub struct LossScaler {
    scale: f64,
    /// S ← S · growth after `growth_interval` clean steps in a row.
    pub growth: f64,
    /// S ← S · backoff after a step with a non-finite gradient.
    pub backoff: f64,
    pub growth_interval: usize,
    clean_steps: usize,
    skipped: usize,
}

impl Default for LossScaler {
    fn default() -> Self {
        LossScaler::new(65536.0)
    }
}

impl LossScaler {
    /// Start at `scale` (2^16 by default) with growth 2, backoff 0.5 and an interval of 2000.
    pub fn new(scale: f64) -> LossScaler {
        LossScaler { scale, growth: 2.0, backoff: 0.5, growth_interval: 2000, clean_steps: 0, skipped: 0 }
    }

    /// S: what the upstream gradient dL/dy is multiplied by before the backward.
    pub fn scale(&self) -> f64 {
        self.scale
    }

    /// Steps skipped so far (a gradient overflowed).
    pub fn skipped(&self) -> usize {
        self.skipped
    }

    /// The gradients of a backward run with the scaled loss, divided by S in f32 — or `None` when
    /// any of them holds ±inf or NaN: skip this step. Updates S either way.
    pub fn unscale(&mut self, grads: &[Tensor]) -> candle_core::Result<Option<Vec<Tensor>>> {
        if !all_finite(grads)? {
            self.scale *= self.backoff;
            self.clean_steps = 0;
            self.skipped += 1;
            return Ok(None);
        }
        let inv = 1.0 / self.scale;
        let unscaled = grads.iter().map(|g| g.to_dtype(DType::F32)? * inv).collect::<candle_core::Result<Vec<_>>>()?;
        self.clean_steps += 1;
        if self.clean_steps == self.growth_interval {
            self.scale *= self.growth;
            self.clean_steps = 0;
        }
        Ok(Some(unscaled))
    }

    /// `unscale` over a backward's gradients: those of `vars` (the ones that have one) divided
    /// by S, in a store of their own for the optimizer's step, each in its parameter's dtype (the
    /// f32 master weights); `None` when any overflowed: skip this step.
    pub fn unscale_grads(&mut self, vars: &[Var], grads: &GradStore) -> candle_core::Result<Option<GradStore>> {
        let (with, g): (Vec<&Var>, Vec<Tensor>) = vars.iter().filter_map(|v| Some((v, grads.get(v.as_tensor())?.clone()))).unzip();
        let Some(unscaled) = self.unscale(&g)? else { return Ok(None) };
        let mut store = GradStore::default();
        for (v, g) in with.into_iter().zip(unscaled) {
            store.insert(v.as_tensor(), g.to_dtype(v.dtype())?);
        }
        Ok(Some(store))
    }
}

/// Whether every element of every tensor is finite, with one read back to the host: Σ|g| per
/// tensor in f32 is ±inf or NaN as soon as one element is (or the sum overflows f32, which no
/// usable gradient does).
pub fn all_finite(grads: &[Tensor]) -> candle_core::Result<bool> {
    if grads.is_empty() {
        return Ok(true);
    }
    let sums = grads.iter().map(|g| g.to_dtype(DType::F32)?.abs()?.sum_all()?.reshape(1)).collect::<candle_core::Result<Vec<_>>>()?;
    let total: f32 = Tensor::cat(&sums, 0)?.sum_all()?.to_scalar()?;
    Ok(total.is_finite())
}

/// The same decision spelled out element by element on the host: the slow twin of `unscale`'s
/// check.
pub fn all_finite_slow(grads: &[Tensor]) -> candle_core::Result<bool> {
    for g in grads {
        if !g.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?.iter().all(|v| v.is_finite()) {
            return Ok(false);
        }
    }
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn grads(values: &[f32]) -> Vec<Tensor> {
        let a = Tensor::new(values, &Device::Cpu).unwrap().to_dtype(DType::F16).unwrap();
        vec![a, Tensor::ones((3, 4), DType::F16, &Device::Cpu).unwrap()]
    }

    /// An f16 gradient that overflowed: the step is skipped and S halved; clean steps divide by S
    /// and, after the interval, double it.
    #[test]
    fn an_overflow_skips_the_step_and_halves_the_scale() {
        let mut s = LossScaler::new(1024.0);
        s.growth_interval = 3;
        // 70,000 does not fit f16 (max 65,504): the cast gives +inf, as an f16 backward would.
        assert!(s.unscale(&grads(&[1.0, 70_000.0])).unwrap().is_none());
        assert_eq!((s.scale(), s.skipped()), (512.0, 1));
        assert!(s.unscale(&grads(&[f32::NAN, 1.0])).unwrap().is_none());
        assert_eq!((s.scale(), s.skipped()), (256.0, 2));
        for step in 1..=3 {
            let g = s.unscale(&grads(&[512.0, -256.0])).unwrap().expect("finite gradients step");
            if step < 3 {
                assert_eq!(g[0].to_vec1::<f32>().unwrap(), [2.0, -1.0], "divided by S = 256 in f32");
                assert_eq!(g[0].dtype(), DType::F32);
                assert_eq!(s.scale(), 256.0);
            }
        }
        assert_eq!(s.scale(), 512.0, "doubled after 3 clean steps");
        // An overflow resets the run of clean steps.
        s.unscale(&grads(&[1.0, 1.0])).unwrap();
        s.unscale(&grads(&[f32::INFINITY, 1.0])).unwrap();
        s.unscale(&grads(&[1.0, 1.0])).unwrap();
        s.unscale(&grads(&[1.0, 1.0])).unwrap();
        assert_eq!(s.scale(), 256.0, "halved, and not yet doubled again");
    }

    #[test]
    fn the_finite_check_matches_its_slow_twin() {
        let cases: [&[f32]; 6] = [&[0.0, 1.0], &[f32::INFINITY], &[-f32::INFINITY, 2.0], &[f32::NAN], &[65504.0, -65504.0], &[6e-8, -6e-8]];
        for c in cases {
            let g = grads(c);
            assert_eq!(all_finite(&g).unwrap(), all_finite_slow(&g).unwrap(), "{c:?}");
        }
        assert!(all_finite(&[]).unwrap());
    }
}
