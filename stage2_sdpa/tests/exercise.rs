//! Stage 2's exercise (docs/stages.md, "Exercises"): `exercise::online_softmax_step` — yours with
//! `--features exercise`, the solution without — folds a row of keys into the softmax-weighted
//! average of their values, as the two-pass softmax over the stored scores computes it.

use shared::weights::SplitMix64;
use stage2_sdpa::exercise::online_softmax_step;

/// o / l after folding every key of `scores` (one query row) through the step, from m = −∞.
fn fold(scores: &[f32], v: &[f32], d: usize) -> Vec<f32> {
    let (mut m, mut l, mut o) = (f32::NEG_INFINITY, 0f32, vec![0f32; d]);
    for (j, &s) in scores.iter().enumerate() {
        (m, l) = online_softmax_step(m, l, &mut o, s, &v[j * d..(j + 1) * d]);
    }
    o.iter().map(|x| x / l).collect()
}

/// softmax(scores) v in f64, two passes over the stored scores: the function the step computes.
fn two_pass(scores: &[f32], v: &[f32], d: usize) -> Vec<f64> {
    let max = scores.iter().fold(f64::NEG_INFINITY, |m, &s| m.max(s as f64));
    let p: Vec<f64> = scores.iter().map(|&s| (s as f64 - max).exp()).collect();
    let sum: f64 = p.iter().sum();
    (0..d).map(|x| p.iter().enumerate().map(|(j, pj)| pj * v[j * d + x] as f64).sum::<f64>() / sum).collect()
}

fn rel_err(got: &[f32], want: &[f64]) -> f64 {
    let diff: f64 = got.iter().zip(want).map(|(g, w)| (*g as f64 - w).powi(2)).sum();
    let norm: f64 = want.iter().map(|w| w.powi(2)).sum();
    (diff / norm).sqrt()
}

#[test]
fn folding_the_keys_gives_the_two_pass_softmax() {
    // Scores from N(0, σ²) with σ up to 8: the running max changes often, and by a lot.
    for (keys, d, sigma, seed) in [(1, 4, 1.0, 1), (2, 8, 1.0, 2), (37, 16, 3.0, 3), (200, 64, 8.0, 4)] {
        let mut rng = SplitMix64::new(seed);
        let scores: Vec<f32> = rng.normals(keys).iter().map(|s| s * sigma).collect();
        let v = rng.normals(keys * d);
        let e = rel_err(&fold(&scores, &v, d), &two_pass(&scores, &v, d));
        assert!(e < 1e-5, "{keys} keys, d = {d}, scores N(0, {sigma}²): relative error {e:.1e} against the two-pass softmax");
    }
}

#[test]
fn a_larger_score_later_rescales_what_was_summed_before() {
    // Key 0 scores 0, key 1 scores 40: key 0's weight must shrink by e^−40, so the output is v_1
    // to f32 precision. Without the rescale it would be the average of v_0 and v_1.
    assert_eq!(fold(&[0.0, 40.0], &[3.0, -5.0], 1), [-5.0]);
    // Rising scores (the max changes at every key) and falling ones (it never does) agree.
    let scores: Vec<f32> = (0..50).map(|j| j as f32 * 0.5).collect();
    let v: Vec<f32> = (0..50).map(|j| (j as f32).sin()).collect();
    let (rising, want) = (fold(&scores, &v, 1), two_pass(&scores, &v, 1));
    let rev = |x: &[f32]| x.iter().rev().copied().collect::<Vec<f32>>();
    let falling = fold(&rev(&scores), &rev(&v), 1);
    assert!(rel_err(&rising, &want) < 1e-5 && rel_err(&falling, &want) < 1e-5, "rising {rising:?}, falling {falling:?}, want {want:?}");
}

#[test]
fn scores_far_beyond_exp_range_stay_finite() {
    // e^100 overflows f32 (max ~e^88.7): only the max-subtracted form survives these.
    let out = fold(&[100.0, 120.0, 110.0], &[1.0, 2.0, 3.0], 1);
    let want = two_pass(&[100.0, 120.0, 110.0], &[1.0, 2.0, 3.0], 1);
    assert!(out[0].is_finite() && rel_err(&out, &want) < 1e-6, "got {out:?}, want {want:?}");
}
