//! Stage 3's exercise (docs/stages.md, "Exercises"): `exercise::bias_gelu_epilogue` — yours with
//! `--features exercise`, the solution without — after a plain GEMM gives what the unfused ops
//! give (`ops::linear_bias_gelu_slow`: bias pass, then GELU's primitives) and the fused op.

use candle_core::{Device, Tensor};
use shared::weights::SplitMix64;
use stage3_fused::exercise::bias_gelu_epilogue;
use stage3_fused::ops::{linear_bias_gelu, linear_bias_gelu_slow};

fn values(t: &Tensor) -> Vec<f32> {
    t.flatten_all().unwrap().to_vec1().unwrap()
}

#[test]
fn after_the_gemm_it_gives_the_unfused_ops_output() {
    let dev = Device::Cpu;
    // (B, T, K) × (N, K): N = 1 and ragged sizes included; bias up to ±3 so GELU's negative
    // branch, its bend near 0 and its linear part are all reached.
    for (bsz, t, k, n, seed) in [(1, 1, 1, 1, 1), (2, 3, 5, 7, 2), (2, 17, 64, 256, 3)] {
        let mut rng = SplitMix64::new(seed);
        let x = Tensor::from_vec(rng.normals(bsz * t * k), (bsz, t, k), &dev).unwrap();
        let w = Tensor::from_vec(rng.normals(n * k), (n, k), &dev).unwrap();
        let b = Tensor::from_vec(rng.normals(n).iter().map(|v| 3.0 * v).collect::<Vec<f32>>(), n, &dev).unwrap();
        let mut y = values(&x.reshape((bsz * t, k)).unwrap().matmul(&w.t().unwrap()).unwrap()); // the GEMM alone
        bias_gelu_epilogue(&mut y, &values(&b));
        for (name, want) in [("unfused ops", linear_bias_gelu_slow(&x, &w, &b)), ("fused op", linear_bias_gelu(&x, &w, &b))] {
            let want = values(&want.unwrap());
            let worst = y.iter().zip(&want).map(|(g, w)| (g - w).abs() / (1.0 + w.abs())).fold(0f32, f32::max);
            assert!(worst < 1e-5, "(B, T, K, N) = ({bsz}, {t}, {k}, {n}): max |yours − {name}| / (1 + |y|) = {worst:e}");
        }
    }
}

#[test]
fn large_inputs_stay_finite_and_meet_gelus_asymptotes() {
    // gelu(v) → v for large v, → 0 for very negative v; tanh written with exponentials overflows here.
    let mut y = vec![100.0, -100.0, 20.0, -20.0, 0.0, 1.0];
    bias_gelu_epilogue(&mut y, &[0.0, 0.0]);
    let gelu_1 = 0.5 * (1.0 + ((2.0 / std::f32::consts::PI).sqrt() * 1.044715f32).tanh());
    let want = [100.0, 0.0, 20.0, 0.0, 0.0, gelu_1];
    assert!(y.iter().zip(&want).all(|(g, w)| (g - w).abs() < 1e-5), "got {y:?}, want {want:?}");
    // The bias is added per column, before GELU: row [0, 0] with b = [100, −100] is the first row above.
    let mut z = vec![0.0, 0.0];
    bias_gelu_epilogue(&mut z, &[100.0, -100.0]);
    assert_eq!(z, [100.0, 0.0]);
}
