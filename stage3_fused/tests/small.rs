//! The small version (`stage3_fused::small`, a scalar one-pass LayerNorm) against the slow twin
//! (`ops::layer_norm_slow`, the nine primitive ops) and the fast op.

use candle_core::{DType, Device, Tensor};
use shared::weights::SplitMix64;
use stage3_fused::ops::{layer_norm, layer_norm_slow, LN_EPS};
use stage3_fused::small::layer_norm_one_pass;

fn rel_err(a: &[f32], b: &[f32]) -> f64 {
    let diff: f64 = a.iter().zip(b).map(|(x, y)| ((x - y) as f64).powi(2)).sum();
    let norm: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
    (diff / norm).sqrt()
}

#[test]
fn small_layer_norm_matches_the_slow_twin_and_the_fast_op() {
    let dev = Device::Cpu;
    for (rows, c, mean, seed) in [(1, 1, 0.0, 1), (3, 7, 0.0, 2), (64, 768, 0.0, 3), (5, 128, 1e3, 4)] {
        let mut rng = SplitMix64::new(seed);
        let x: Vec<f32> = rng.normals(rows * c).iter().map(|v| v + mean).collect();
        let g: Vec<f32> = rng.normals(c).iter().map(|v| 1.0 + 0.1 * v).collect();
        let b: Vec<f32> = rng.normals(c).iter().map(|v| 0.1 * v).collect();
        let small = layer_norm_one_pass(&x, &g, &b, c, LN_EPS as f64);
        let (xt, gt, bt) = (
            Tensor::from_slice(&x, (rows, c), &dev).unwrap(),
            Tensor::from_slice(&g, c, &dev).unwrap(),
            Tensor::from_slice(&b, c, &dev).unwrap(),
        );
        let slow: Vec<f32> = layer_norm_slow(&xt, &gt, &bt, LN_EPS, DType::F32).unwrap().flatten_all().unwrap().to_vec1().unwrap();
        let fast: Vec<f32> = layer_norm(&xt, &gt, &bt, LN_EPS, DType::F32).unwrap().flatten_all().unwrap().to_vec1().unwrap();
        // The slow twin's f32 mean of values near 1e3 loses digits the shifted f64 sums keep.
        let tol = if mean == 0.0 { 1e-5 } else { 1e-3 };
        assert!(rel_err(&small, &slow) < tol, "rows={rows} C={c} mean={mean}: {:.1e} vs slow twin", rel_err(&small, &slow));
        assert!(rel_err(&small, &fast) < 1e-5, "rows={rows} C={c} mean={mean}: {:.1e} vs fast op", rel_err(&small, &fast));
    }
}

#[test]
fn a_constant_row_normalises_to_the_bias() {
    // var = 0: y = 0 · g + b, not NaN (eps keeps the division finite).
    let out = layer_norm_one_pass(&[5.0; 4], &[2.0; 4], &[0.5, -1.0, 0.0, 3.0], 4, 1e-5);
    assert_eq!(out, [0.5, -1.0, 0.0, 3.0]);
}
