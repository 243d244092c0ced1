//! Stage 0's exercise (docs/stages.md, "Exercises"): `exercise::causal_softmax` — yours with
//! `--features exercise`, the solution without — against stage 0's tensor ops (`softmax` of the
//! scores plus `causal_mask`), the function the block's attention computes.

use candle_core::{Device, Tensor};
use shared::weights::SplitMix64;
use stage0_baseline::exercise::causal_softmax;
use stage0_baseline::{causal_mask, softmax};

/// Stage 0's way: softmax(s + mask) on a (T, T) tensor.
fn with_tensor_ops(s: &[f32], t: usize) -> Vec<f32> {
    let dev = Device::Cpu;
    let scores = Tensor::from_slice(s, (t, t), &dev).unwrap();
    softmax(&(scores + causal_mask(t, &dev).unwrap()).unwrap()).unwrap().flatten_all().unwrap().to_vec1().unwrap()
}

#[test]
fn matches_stage_0s_tensor_ops() {
    for (t, sigma, seed) in [(1, 1.0, 1), (2, 1.0, 2), (17, 3.0, 3), (64, 8.0, 4)] {
        let s: Vec<f32> = SplitMix64::new(seed).normals(t * t).iter().map(|x| x * sigma).collect();
        let mut got = s.clone();
        causal_softmax(&mut got, t);
        let want = with_tensor_ops(&s, t);
        let worst = got.iter().zip(&want).map(|(g, w)| (g - w).abs()).fold(0f32, f32::max);
        assert!(worst < 1e-6, "T = {t}, scores N(0, {sigma}²): max |yours − stage 0's| = {worst:e}");
        for (i, row) in got.chunks(t).enumerate() {
            assert!(row[i + 1..].iter().all(|&p| p == 0.0), "T = {t}, row {i}: a future key has weight: {row:?}");
            let sum: f32 = row.iter().sum();
            assert!((sum - 1.0).abs() < 1e-5, "T = {t}, row {i}: weights sum to {sum}");
        }
    }
}

#[test]
fn large_scores_do_not_overflow() {
    // e^100 overflows f32 (max ~e^88.7): without subtracting the row's max this row is inf / inf.
    let mut s = vec![100.0, 0.0, 120.0, 100.0];
    causal_softmax(&mut s, 2);
    let want = 1.0 / (1.0 + (-20f32).exp());
    assert_eq!(s[..2], [1.0, 0.0], "row 0 sees key 0 only");
    assert!((s[2] - want).abs() < 1e-6 && (s[3] - (1.0 - want)).abs() < 1e-6, "row 1: {:?}", &s[2..]);
}
