//! Training in FP8: TransformerEngine's HYBRID recipe, emulated on the CPU.
//!
//! **Two formats for two jobs.** The forward's operands (weights, activations) are E4M3: 3
//! mantissa bits, range ±448 — values that must be *precise*. The gradients flowing back are
//! E5M2: 2 mantissa bits but f16's exponent range, ±57344, subnormals down to 2⁻¹⁶ — values
//! that must *fit*: a gradient's magnitude swings over many more decades than an activation's
//! across layers and steps, and a saturated or flushed gradient is a wrong update.
//!
//! **The backward GEMMs of y = x·Wᵀ + b.** With dY the upstream gradient (B·T, N):
//! - dX = E5M2(dY) · E4M3(W): the gradient operand in E5M2, the weight as the forward stored it;
//! - dW = E5M2(dY)ᵀ · E4M3(X): the activation as the forward stored it;
//! - db = Σ_rows dY from the unquantised dY (TransformerEngine computes the bias gradient in
//!   high precision, fused into dY's cast).
//!
//! Each FP8 operand carries its per-tensor scale, as in the forward; dY's scale here is current
//! (s = amax(dY)·2^margin / 57344). Products accumulate in f32.
//!
//! Emulated: every FP8 value is held as s·q in f32 (`round_e5m2`, like `fp8::round_e4m3`),
//! so the numbers are those of an FP8 GEMM with f32 accumulation; the speed is not.

use crate::fp8::{round_e4m3, E4M3_MAX};
use candle_core::{DType, Tensor};

/// Largest finite E5M2 value.
pub const E5M2_MAX: f32 = 57344.0;

/// Round an f32 to the nearest E5M2 value (ties to even), saturating at ±57344 (the cast's
/// "satfinite"), NaN kept, and return it as f32. Normals (|y| ≥ 2⁻¹⁴): keep 2 mantissa bits,
/// round-to-nearest-even on the 21 dropped ones. Subnormals: multiples of 2⁻¹⁶ (the 1.5·2²³
/// trick rounds to an integer, ties to even). Slow twin: the float8 crate's `F8E5M2` conversion.
#[inline(always)]
pub fn round_e5m2(y: f32) -> f32 {
    let a = y.abs();
    let bits = a.to_bits();
    let normal = f32::from_bits((bits + 0xF_FFFF + ((bits >> 21) & 1)) & 0xFFE0_0000);
    let sub = ((a * 65536.0 + 12_582_912.0) - 12_582_912.0) * (1.0 / 65536.0);
    let r = if a < 1.0 / 16384.0 { sub } else { normal };
    let r = if r > E5M2_MAX { E5M2_MAX } else { r }; // saturate (NaN compares false and stays NaN)
    let r = if y.is_nan() { y } else { r };
    r.copysign(y)
}

/// The format of one FP8 operand: its largest value and its rounding.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    E4M3,
    E5M2,
}

impl Format {
    fn max(self) -> f32 {
        match self {
            Format::E4M3 => E4M3_MAX,
            Format::E5M2 => E5M2_MAX,
        }
    }

    fn round(self, v: f32) -> f32 {
        match self {
            Format::E4M3 => round_e4m3(v),
            Format::E5M2 => round_e5m2(v),
        }
    }
}

/// x in `format` with a current per-tensor scale s = amax(x)·2^margin / max, held as s·q in f32
/// (same shape, on x's device), and s.
pub fn fake_quantize(x: &Tensor, format: Format, margin: i32) -> candle_core::Result<(Tensor, f32)> {
    let x32 = x.to_dtype(DType::F32)?;
    let v = x32.flatten_all()?.to_vec1::<f32>()?;
    let amax = v.iter().fold(0f32, |m, x| m.max(x.abs()));
    let s = (amax.max(f32::MIN_POSITIVE) * 2f32.powi(margin)) / format.max();
    let q: Vec<f32> = v.iter().map(|&x| format.round(x / s) * s).collect();
    Ok((Tensor::from_vec(q, x.shape(), x.device())?, s))
}

/// The backward of y = x·Wᵀ + b in the HYBRID recipe (see the module notes), from the forward's
/// E4M3 operands as s·q in f32 (`xq`: (B, T, K), `wq`: (N, K)) and dY (B, T, N) in any dtype.
/// Returns (dX (B, T, K), dW (N, K), db (N)), f32.
pub fn linear_bwd_hybrid(xq: &Tensor, wq: &Tensor, dy: &Tensor, margin: i32) -> candle_core::Result<(Tensor, Tensor, Tensor)> {
    let (bsz, t, k) = xq.dims3()?;
    let n = wq.dim(0)?;
    let dy = dy.to_dtype(DType::F32)?.reshape((bsz * t, n))?; // (B·T, N)
    let (dy8, _) = fake_quantize(&dy, Format::E5M2, margin)?;
    let dx = dy8.matmul(wq)?.reshape((bsz, t, k))?; // (B·T, N)·(N, K)
    let dw = dy8.t()?.matmul(&xq.reshape((bsz * t, k))?)?; // (N, B·T)·(B·T, K)
    Ok((dx, dw, dy.sum(0)?))
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// Every f32 that is a boundary case (powers of two around E5M2's range, ties between
    /// neighbours, subnormals, the saturation threshold) and a sweep of ordinary values: bit for
    /// bit the float8 crate's conversion (which saturates, like ours).
    #[test]
    fn round_e5m2_matches_the_float8_crate() {
        let mut values = vec![0.0, -0.0, 1.0, 1.25, 1.125, 1.375, 1.625, 1.875, 57344.0, 57343.0, 61440.0, 61439.0, 1e9, f32::MAX];
        for e in -20..17 {
            let p = 2f32.powi(e);
            values.extend([p, p * 1.125, p * 1.375, p * 1.0625, p * 0.75, p * 0.625]);
        }
        let mut seed = 0x2545_f491_u32;
        for _ in 0..200_000 {
            seed ^= seed << 13;
            seed ^= seed >> 17;
            seed ^= seed << 5;
            let f = f32::from_bits(seed);
            if f.is_finite() {
                values.push(f);
            }
        }
        for &v in &values {
            for v in [v, -v] {
                let want = float8::F8E5M2::from_f32(v).to_f32();
                assert_eq!(round_e5m2(v).to_bits(), want.to_bits(), "{v:e}: ours {:e}, float8 {want:e}", round_e5m2(v));
            }
        }
        assert!(round_e5m2(f32::NAN).is_nan());
    }

    fn randn(dims: &[usize], seed: u64, std: f32) -> Tensor {
        let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        let n: usize = dims.iter().product();
        let v: Vec<f32> = (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 3.46 * std
            })
            .collect();
        Tensor::from_vec(v, dims, &Device::Cpu).unwrap()
    }

    fn rel(a: &Tensor, b: &Tensor) -> f32 {
        let d = (a - b).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
        d / b.abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap()
    }

    /// The hybrid backward against the f32 backward of the same (E4M3-stored) operands: off by
    /// E5M2's rounding of dY only, so within a few of its half-ulps (2⁻³) relative to the largest
    /// gradient, and db exact; and a gradient 10⁷ times smaller than the largest, which E4M3 at
    /// the same scale rule flushes, keeps its size.
    #[test]
    fn the_hybrid_backward_is_the_f32_backward_up_to_e5m2_rounding() {
        for (bsz, t, k, n, seed) in [(2, 13, 24, 40, 1u64), (1, 37, 77, 130, 2), (3, 1, 16, 8, 3)] {
            let (x, w, dy) = (randn(&[bsz, t, k], seed, 1.0), randn(&[n, k], seed + 1, 0.2), randn(&[bsz, t, n], seed + 2, 1e-3));
            let (xq, _) = fake_quantize(&x, Format::E4M3, 0).unwrap();
            let (wq, _) = fake_quantize(&w, Format::E4M3, 0).unwrap();
            let (dx, dw, db) = linear_bwd_hybrid(&xq, &wq, &dy, 0).unwrap();
            let dy2 = dy.reshape((bsz * t, n)).unwrap();
            let dx_f32 = dy2.matmul(&wq).unwrap().reshape((bsz, t, k)).unwrap();
            let dw_f32 = dy2.t().unwrap().matmul(&xq.reshape((bsz * t, k)).unwrap()).unwrap();
            let (ex, ew) = (rel(&dx, &dx_f32), rel(&dw, &dw_f32));
            assert!(ex < 0.1 && ew < 0.1, "({bsz}, {t}, {k} → {n}): dX {ex:.2e}, dW {ew:.2e}");
            assert!(ex > 0.0 && ew > 0.0, "the gradient operand was really rounded to E5M2");
            eprintln!("hybrid backward vs f32, ({bsz}, {t}, {k} → {n}): dX {ex:.2e}, dW {ew:.2e}");
            assert_eq!(db.to_vec1::<f32>().unwrap(), dy2.sum(0).unwrap().to_vec1::<f32>().unwrap());
        }
        // One entry 10⁷ times smaller than the largest: E5M2's range keeps it (to its 2 mantissa
        // bits), E4M3's flushes it to 0.
        let dy = Tensor::new(&[[1.0f32, 1e-7]], &Device::Cpu).unwrap();
        let (e5, _) = fake_quantize(&dy, Format::E5M2, 0).unwrap();
        let (e4, _) = fake_quantize(&dy, Format::E4M3, 0).unwrap();
        let (small5, small4) = (e5.to_vec2::<f32>().unwrap()[0][1], e4.to_vec2::<f32>().unwrap()[0][1]);
        assert!((small5 - 1e-7).abs() < 1.3e-8 && small4 == 0.0, "E5M2 {small5:e}, E4M3 {small4:e}");
    }
}
