//! Stage 1's exercise (docs/stages.md, "Exercises"): `exercise::f32_to_bf16_bits` — yours with
//! `--features exercise`, the solution without — against the `half` crate's conversion (what
//! candle's `to_dtype(BF16)` uses) on every kind of f32, and the error it leaves.

use half::bf16;
use shared::weights::SplitMix64;
use stage1_tensorcore::exercise::f32_to_bf16_bits;

fn check(x: f32) {
    let got = f32_to_bf16_bits(x);
    let want = bf16::from_f32(x).to_bits();
    if x.is_nan() {
        assert!(bf16::from_bits(got).is_nan(), "{x:?} (bits {:#010x}) must stay NaN, got bf16 bits {got:#06x}", x.to_bits());
    } else {
        assert_eq!(got, want, "{x:e} (bits {:#010x}): got bf16 bits {got:#06x}, want {want:#06x}", x.to_bits());
    }
}

#[test]
fn every_kind_of_f32_rounds_to_the_nearest_bf16() {
    let special = [
        0x3F80_8000u32, // 1 + 2⁻⁸: halfway between 1 and 1 + 2⁻⁷, even below: stays 1
        0x3F81_8000,    // 1 + 3·2⁻⁸: halfway, odd below: goes up to 1 + 2⁻⁶
        0x3F80_8001,    // just above a tie: up
        0x3F80_7FFF,    // just below a tie: down
        0x3FFF_8000,    // rounding up carries into the exponent: 2
        0x7F7F_FFFF,    // the largest finite f32, past bf16's: ∞
        0x7F7F_7FFF,    // just below bf16's largest finite: stays finite
        0x7F80_0000,    // +∞
        0xFF80_0000,    // −∞
        0x0000_0000,    // +0
        0x8000_0000,    // −0
        0x0000_0001,    // the smallest subnormal: 0
        0x0001_8000,    // a subnormal tie, odd below: up
        0x807F_FFFF,    // the largest negative subnormal: rounds up into the normals
        0x7FC0_0000,    // quiet NaN
        0xFFC0_0000,    // negative quiet NaN
        0x7F80_0001,    // a NaN with its payload in the low bits only: truncation would give ∞
        0xFF80_FFFF,    // a negative one
    ];
    special.iter().for_each(|&b| check(f32::from_bits(b)));
    // ~1M bit patterns spread over all of them: every exponent, both signs, NaNs included.
    (0..=u32::MAX).step_by(4099).for_each(|b| check(f32::from_bits(b)));
}

#[test]
fn the_rounding_error_is_half_an_ulp_and_unbiased() {
    // Round to nearest: |error| ≤ 2⁻⁸ relative (half of bf16's spacing of 2⁻⁷ in [1, 2)), and its
    // mean over many values ~0. Truncation errs by up to 2⁻⁷, always towards zero: a mean of
    // about −2.8e−3 in magnitude, which every dot product in a bf16 GEMM would accumulate.
    let xs = SplitMix64::new(1).normals(1 << 16);
    let (mut worst, mut mean) = (0f64, 0f64);
    for &x in &xs {
        let r = bf16::from_bits(f32_to_bf16_bits(x)).to_f32() as f64;
        let rel = (r.abs() - (x as f64).abs()) / (x as f64).abs(); // < 0: towards zero
        worst = worst.max(rel.abs());
        mean += rel / xs.len() as f64;
    }
    assert!(worst <= 2f64.powi(-8), "worst relative error {worst:.2e} > 2⁻⁸");
    assert!(mean.abs() < 1e-4, "mean relative error {mean:.2e}: biased (truncation gives ~−2.8e−3)");
}
