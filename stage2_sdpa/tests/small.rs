//! The small version (`stage2_sdpa::small`, scalar online softmax) against the materialised
//! attention (stage 1's, which writes the T × T scores), and against the fast CPU kernel.

use candle_core::{DType, Device, Tensor};
use shared::weights::SplitMix64;
use stage2_sdpa::small::online_softmax_attention;

/// ||a − b|| / ||b||.
fn rel_err(a: &[f32], b: &[f32]) -> f64 {
    let diff: f64 = a.iter().zip(b).map(|(x, y)| ((x - y) as f64).powi(2)).sum();
    let norm: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
    (diff / norm).sqrt()
}

/// Stage 1's attention on one head (B = 1, n_head = 1): (T, d) rows in, (T, d) rows out.
fn materialised(q: &[f32], k: &[f32], v: &[f32], t: usize, d: usize, causal: bool) -> Vec<f32> {
    let dev = Device::Cpu;
    let x = |s: &[f32]| Tensor::from_slice(s, (1, t, d), &dev).unwrap();
    let mask = if causal { stage0_baseline::causal_mask(t, &dev).unwrap() } else { Tensor::zeros((t, t), DType::F32, &dev).unwrap() };
    stage1_tensorcore::attention(&x(q), &x(k), &x(v), 1, &mask).unwrap().flatten_all().unwrap().to_vec1().unwrap()
}

#[test]
fn small_version_matches_the_materialised_attention() {
    for (t, d, seed) in [(1, 16, 1), (7, 16, 2), (64, 64, 3), (133, 32, 4)] {
        let data = SplitMix64::new(seed).normals(3 * t * d);
        let (q, k, v) = (&data[..t * d], &data[t * d..2 * t * d], &data[2 * t * d..]);
        for causal in [true, false] {
            let small = online_softmax_attention(q, k, v, d, causal);
            let want = materialised(q, k, v, t, d, causal);
            let e = rel_err(&small, &want);
            assert!(e < 1e-5, "T={t} d={d} causal={causal}: rel err {e:.1e}");
            // The fast kernel computes the same function: same layout at B = n_head = 1.
            let qkv = |s: &[f32]| Tensor::from_slice(s, (1, t, 1, d), &Device::Cpu).unwrap();
            let fast: Vec<f32> =
                stage2_sdpa::attention(&qkv(q), &qkv(k), &qkv(v), causal).unwrap().flatten_all().unwrap().to_vec1().unwrap();
            assert!(rel_err(&small, &fast) < 1e-5, "T={t} d={d} causal={causal}: against the fast kernel");
        }
    }
}

#[test]
fn a_large_score_later_in_the_row_rescales_what_came_before() {
    // Row 1 (causal) sees key 0 with score 0, then key 1 with score 40: the running max jumps,
    // so key 0's weight must shrink to e^−40 and the output is v_1 to f32 precision.
    let (q, k, v) = ([1.0, 40.0], [0.0, 1.0], [3.0, -5.0]);
    let out = online_softmax_attention(&q, &k, &v, 1, true);
    assert_eq!(out[0], 3.0); // row 0 sees only key 0
    assert_eq!(out[1], -5.0);
}
