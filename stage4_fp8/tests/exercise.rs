//! Stage 4's exercise (docs/stages.md, "Exercises"): `exercise::delayed_scale` — yours with
//! `--features exercise`, the solution without — picks the scales `Fp8Linear`'s scale state
//! (`fp8::ScaleState`, delayed recipe) picks, call after call, and keeps the same history.

use candle_core::{Device, Tensor};
use shared::weights::SplitMix64;
use stage4_fp8::exercise::delayed_scale;
use stage4_fp8::fp8::{round_e4m3, Fp8Recipe, ScaleState, ScalingConfig, E4M3_MAX};

/// A tensor whose amax is `a`.
fn with_amax(a: f32) -> Tensor {
    Tensor::new(&[a, -a / 2.0, a / 3.0], &Device::Cpu).unwrap()
}

#[test]
fn scales_and_history_follow_the_scale_state() {
    for (history_len, margin, seed) in [(1, 0, 1), (3, 0, 2), (5, 1, 3), (16, -1, 4)] {
        let mut state = ScaleState::new(ScalingConfig { recipe: Fp8Recipe::Delayed, history_len, margin }).unwrap();
        let mut history = vec![0f32; history_len];
        let mut rng = SplitMix64::new(seed);
        // amaxes over 2⁻¹⁰ to 2¹⁰, jumps up and down included, and one all-zero call.
        let amaxes: Vec<f32> = rng.normals(40).iter().enumerate().map(|(i, z)| if i == 7 { 0.0 } else { (z * 5.0).exp2() }).collect();
        for (call, &a) in amaxes.iter().enumerate() {
            let want = state.scale_for(&with_amax(a)).unwrap().to_scalar::<f32>().unwrap();
            let got = delayed_scale(&mut history, a, margin, call == 0);
            assert!(
                (got - want).abs() <= 1e-6 * want,
                "history_len {history_len}, margin {margin}, call {call} (amax {a:e}): scale {got:e}, the scale state's {want:e}"
            );
        }
        assert_eq!(history, state.history().unwrap(), "history_len {history_len}: the history after 40 calls, oldest first");
    }
}

#[test]
fn the_largest_recent_amax_lands_at_448_and_a_jump_saturates() {
    // Calls with amax 2, 8, 4 (history of 2, margin 0): call 2's scale comes from max(2, 8) = 8,
    // so its input's largest value, 4, lands at 448 · 4/8 = 224 — half the range, unsaturated.
    let mut history = vec![0f32; 2];
    assert_eq!(delayed_scale(&mut history, 2.0, 0, true), 2.0 / E4M3_MAX); // first call: current scaling
    assert_eq!(delayed_scale(&mut history, 8.0, 0, false), 2.0 / E4M3_MAX); // 8 is not in the history yet
    let s = delayed_scale(&mut history, 4.0, 0, false);
    assert_eq!((s, round_e4m3(4.0 / s)), (8.0 / E4M3_MAX, 224.0));
    assert_eq!(history, [8.0, 4.0]);
    // The price of delay: an amax 4x above the history's saturates at ±448 on this call.
    let s = delayed_scale(&mut history, 32.0, 0, false);
    assert_eq!(round_e4m3(32.0 / s), E4M3_MAX);
    // An all-zero history still gives a positive, finite scale.
    let mut zeros = vec![0f32; 3];
    let s = delayed_scale(&mut zeros, 0.0, 0, true);
    assert!(s > 0.0 && (0.0 / s) == 0.0, "scale {s:e}");
}
