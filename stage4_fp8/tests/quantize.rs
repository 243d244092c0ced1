//! The FP8 primitives on the CPU: the E4M3 grid, saturation, scales, round-trip bounds, the
//! amax history, and refusals of non-finite input.

use candle_core::{DType, Device, Tensor};
use proptest::prelude::*;
use stage4_fp8::fp8::Fp8Recipe;
use stage4_fp8::fp8::{
    amax, amax_slow, dequantize, quantize, scale_from_amax, Fp8Error, Fp8Linear, Fp8Mode, Fp8Tensor, ScaleState, ScalingConfig, E4M3_MAX,
};

fn t(v: &[f32]) -> Tensor {
    Tensor::new(v, &Device::Cpu).unwrap()
}

fn scalar(v: f32) -> Tensor {
    Tensor::new(v, &Device::Cpu).unwrap()
}

/// x rounded to E4M3 with scale s, back in f32.
fn round_trip(x: &[f32], s: f32) -> Vec<f32> {
    let s = scalar(s);
    dequantize(&quantize(&t(x), &s).unwrap(), &s, DType::F32).unwrap().to_vec1().unwrap()
}

#[test]
fn e4m3_grid_round_to_nearest_even_and_saturate() {
    // In [1, 2) E4M3 steps by 1/8: 1.0625 is halfway between 1 and 1.125 and goes to the even
    // mantissa (1.0); 1.1875 is halfway between 1.125 and 1.25 and goes to 1.25.
    assert_eq!(round_trip(&[1.0625, 1.1875, 1.2, -3.3], 1.0), vec![1.0, 1.25, 1.25, -3.25]);
    // Largest finite is 448; beyond it the cast saturates (no infinities in E4M3).
    assert_eq!(round_trip(&[448.0, 449.0, 1000.0, -1e6], 1.0), vec![448.0, 448.0, 448.0, -448.0]);
    // Subnormals step by 2^-9; half of that rounds to 0 (ties to even).
    let sub = 2f32.powi(-9);
    assert_eq!(round_trip(&[sub, sub / 2.0, 3.0 * sub], 1.0), vec![sub, 0.0, 3.0 * sub]);
}

#[test]
fn scale_maps_amax_to_448() {
    let s = scale_from_amax(&scalar(2.0), 0).unwrap().to_scalar::<f32>().unwrap();
    assert!((s - 2.0 / 448.0).abs() < 1e-9);
    // margin m leaves 2^m of headroom: amax lands at 448 / 2^m
    let s1 = scale_from_amax(&scalar(2.0), 1).unwrap().to_scalar::<f32>().unwrap();
    assert!((s1 / s - 2.0).abs() < 1e-6);
    // an all-zero tensor: a positive scale, and zeros stay zeros (not NaN)
    let z = scale_from_amax(&scalar(0.0), 0).unwrap().to_scalar::<f32>().unwrap();
    assert!(z > 0.0 && z.is_finite());
    assert_eq!(round_trip(&[0.0, 0.0], z), vec![0.0, 0.0]);
    // quantised with its own amax, the largest value is exactly 448 in E4M3
    let x = t(&[0.01, -0.3, 0.25, 0.07]);
    let q = Fp8Tensor::quantize(&x, 0, "x").unwrap();
    let qmax = amax(&q.data.to_dtype(DType::F32).unwrap()).unwrap().to_scalar::<f32>().unwrap();
    assert_eq!(qmax, E4M3_MAX);
    assert_eq!(q.data.dtype(), DType::F8E4M3);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]
    /// `amax` (the custom op) against its slow twin: exactly equal (a maximum of absolute
    /// values rounds nothing), in f32, bf16 and f16, on views that are not contiguous, and on
    /// lengths across the CPU pass's 16 Ki-element chunks.
    #[test]
    fn amax_matches_its_slow_twin(values in prop::collection::vec(-1.0f32..1.0, 1..40_000), log_mag in -3.0f32..3.0) {
        let mag = 10f32.powf(log_mag);
        let x = t(&values.iter().map(|v| v * mag).collect::<Vec<_>>());
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            let xd = x.to_dtype(dtype).unwrap();
            let got = amax(&xd).unwrap();
            prop_assert_eq!(got.dims(), &[] as &[usize]);
            prop_assert_eq!(got.to_scalar::<f32>().unwrap(), amax_slow(&xd).unwrap().to_scalar::<f32>().unwrap(), "{:?}", dtype);
        }
        if values.len() >= 2 {
            let every_other = x.reshape((values.len() / 2, 2)).ok().map(|m| m.narrow(0, 0, values.len() / 2).unwrap().t().unwrap());
            if let Some(v) = every_other {
                prop_assert_eq!(amax(&v).unwrap().to_scalar::<f32>().unwrap(), amax_slow(&v).unwrap().to_scalar::<f32>().unwrap());
            }
        }
    }

    /// |x − x̃| ≤ 2⁻⁴·|x| in E4M3's normal range (3 mantissa bits: half a step is 1/16 of the
    /// value at worst), and ≤ 2⁻¹⁰·s below it (half the subnormal step 2⁻⁹, in units of s).
    #[test]
    fn round_trip_error_is_bounded(values in prop::collection::vec(-1.0f32..1.0, 1..200), log_mag in -3.0f32..3.0) {
        let mag = 10f32.powf(log_mag);
        let x: Vec<f32> = values.iter().map(|v| v * mag).collect();
        let q = Fp8Tensor::quantize(&t(&x), 0, "x").unwrap();
        let s = q.scale.to_scalar::<f32>().unwrap();
        let back: Vec<f32> = q.dequantize(DType::F32).unwrap().to_vec1().unwrap();
        for (&a, &b) in x.iter().zip(&back) {
            let bound = if (a / s).abs() >= 2f32.powi(-6) { a.abs() / 16.0 } else { s * 2f32.powi(-10) };
            prop_assert!((a - b).abs() <= bound * (1.0 + 1e-5) + 1e-30, "x {a} → {b}, scale {s}");
        }
    }
}

fn feed(state: &mut ScaleState, amaxes: &[f32]) -> Vec<f32> {
    amaxes.iter().map(|&a| state.scale_for(&t(&[a, -a / 2.0])).unwrap().to_scalar::<f32>().unwrap() * E4M3_MAX).collect()
}

#[test]
fn delayed_scaling_rolls_a_history_window() {
    let mut s = ScaleState::new(ScalingConfig { recipe: Fp8Recipe::Delayed, history_len: 3, margin: 0 }).unwrap();
    assert!(s.history().unwrap().is_empty());
    // amax·2^0 per call: the 1st has no history (its own amax); each later call the largest of
    // the last three *earlier* amaxes: a spike (8) is seen one call late and for three calls.
    let scales = feed(&mut s, &[1.0, 2.0, 8.0, 4.0, 0.5, 0.5, 0.5]);
    let want = [1.0, 1.0, 2.0, 8.0, 8.0, 8.0, 4.0];
    for (got, want) in scales.iter().zip(want) {
        assert!((got - want).abs() < 1e-5, "{scales:?} vs {want:?}");
    }
    assert_eq!(s.history().unwrap(), vec![0.5, 0.5, 0.5]);
}

#[test]
fn margin_and_current_scaling() {
    let mut m = ScaleState::new(ScalingConfig { recipe: Fp8Recipe::Delayed, history_len: 2, margin: 2 }).unwrap();
    let scales = feed(&mut m, &[1.0, 3.0]);
    assert!((scales[0] - 4.0).abs() < 1e-5 && (scales[1] - 4.0).abs() < 1e-5, "{scales:?}"); // 2^2 · (1, then max(1, 1))
    let mut c = ScaleState::new(ScalingConfig { recipe: Fp8Recipe::Current, history_len: 16, margin: 0 }).unwrap();
    let scales = feed(&mut c, &[1.0, 8.0, 0.5]);
    for (got, want) in scales.iter().zip([1.0, 8.0, 0.5]) {
        assert!((got - want).abs() < 1e-5, "{scales:?}");
    }
    assert!(c.history().unwrap().is_empty(), "current scaling keeps no history");
    assert!(ScaleState::new(ScalingConfig { history_len: 0, ..ScalingConfig::default() }).is_err());
}

#[test]
fn delayed_scaling_saturates_a_spike() {
    // The trade-off: a value 10x above the history's amax saturates at 448·s.
    let mut s = ScaleState::new(ScalingConfig { recipe: Fp8Recipe::Delayed, history_len: 4, margin: 0 }).unwrap();
    feed(&mut s, &[1.0]);
    let x = t(&[10.0, 0.5]);
    let scale = s.scale_for(&x).unwrap();
    let back: Vec<f32> = dequantize(&quantize(&x, &scale).unwrap(), &scale, DType::F32).unwrap().to_vec1().unwrap();
    assert!((back[0] - 1.0).abs() < 1e-6, "10 saturates at amax 1: {back:?}");
    assert!((back[1] - 0.5).abs() < 1e-6);
}

#[test]
fn non_finite_input_is_refused() {
    for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
        let e = Fp8Tensor::quantize(&t(&[1.0, bad, 2.0]), 0, "the test tensor").unwrap_err().to_string();
        assert!(e.contains("the test tensor holds 1 NaN or infinite") && e.contains("flat index 1") && e.contains("Fix:"), "{e}");
    }
    let w = Tensor::ones((16, 16), DType::F32, &Device::Cpu).unwrap();
    let b = Tensor::zeros(16, DType::F32, &Device::Cpu).unwrap();
    let l = Fp8Linear::new(&w, &b, false, Fp8Mode::Emulated, ScalingConfig::default(), "fc").unwrap();
    let mut x = vec![0.5f32; 2 * 16];
    x[7] = f32::NAN;
    let x = Tensor::from_vec(x, (1, 2, 16), &Device::Cpu).unwrap();
    let e = l.forward(&x).unwrap_err().to_string();
    assert!(e.contains("the input of fc holds 1 NaN"), "{e}");
    // a weight with inf is refused when the layer is built
    let w_bad = Tensor::new(&[[1f32, f32::INFINITY]], &Device::Cpu).unwrap();
    let e = Fp8Linear::new(&w_bad, &t(&[0.0]), false, Fp8Mode::Emulated, ScalingConfig::default(), "proj").unwrap_err().to_string();
    assert!(e.contains("proj's weight holds 1 NaN or infinite"), "{e}");
    // the cuBLASLt mode refuses a CPU weight with a sentence, not a panic
    let e = Fp8Linear::new(&w, &b, false, Fp8Mode::Cublaslt, ScalingConfig::default(), "fc").unwrap_err();
    assert!(matches!(e, Fp8Error::Refused(_)) && e.to_string().contains("CUDA device") && e.to_string().contains("Fix:"), "{e}");
}

/// `Fp8Linear` is a `candle_nn::Module`: `x.apply(&layer)` runs its forward (each call advances
/// the input's scale state, so two identical layers are compared call for call).
#[test]
fn fp8_linear_is_a_module() {
    use candle_nn::Module;
    let w = Tensor::arange(0f32, 32.0 * 16.0, &Device::Cpu).unwrap().reshape((32, 16)).unwrap().affine(1e-3, -0.2).unwrap();
    let b = Tensor::arange(0f32, 32.0, &Device::Cpu).unwrap().affine(0.01, -0.1).unwrap();
    let x = Tensor::arange(0f32, 2.0 * 16.0 * 16.0, &Device::Cpu).unwrap().reshape((2, 16, 16)).unwrap().affine(0.01, -2.0).unwrap();
    let new = || Fp8Linear::new(&w, &b, true, Fp8Mode::Emulated, ScalingConfig::default(), "fc1").unwrap();
    let (as_module, as_layer) = (new(), new());
    for _ in 0..2 {
        let y_module = x.apply(&as_module).unwrap();
        let y_layer = Fp8Linear::forward(&as_layer, &x).unwrap();
        assert_eq!(y_module.dims(), [2, 16, 32]);
        assert_eq!(
            y_module.flatten_all().unwrap().to_vec1::<half::bf16>().unwrap(),
            y_layer.flatten_all().unwrap().to_vec1::<half::bf16>().unwrap()
        );
    }
    let _ = Module::forward(&as_module, &x).unwrap();
}

// The CPU's fast quantisation: one parallel, vectorised pass against its slow twin,
// candle's casts through the 8-bit type.
mod fast_cpu_quantisation {
    use candle_core::{DType, Device, Tensor};
    use proptest::prelude::*;
    use stage4_fp8::fp8::{amax, dequantize, quantize, quantize_dequantize_cpu, round_e4m3, scale_from_amax};

    /// Every f32 bit pattern's neighbourhood that matters: all E4M3 values, the midpoints between
    /// them (ties), and one ulp either side, both signs, plus saturation, zero and NaN.
    #[test]
    fn round_e4m3_matches_the_cast_on_every_edge() {
        let mut xs = vec![0.0f32, -0.0, 447.9, 448.0, 449.0, 463.9, 464.0, 465.0, 1e6, f32::MAX, 1e-30, f32::MIN_POSITIVE];
        for code in 0u8..0x7E {
            // 0x7E is 448, the largest; 0x7F is NaN in E4M3 (no infinities)
            let v = float8::F8E4M3::from_bits(code).to_f32();
            let next = float8::F8E4M3::from_bits(code + 1).to_f32();
            let mid = (v + next) / 2.0;
            for x in [v, mid, f32::from_bits(mid.to_bits() - 1), f32::from_bits(mid.to_bits() + 1)] {
                xs.extend([x, -x]);
            }
        }
        let t = Tensor::new(xs.as_slice(), &Device::Cpu).unwrap();
        let want: Vec<f32> = t.to_dtype(DType::F8E4M3).unwrap().to_dtype(DType::F32).unwrap().to_vec1().unwrap();
        for (x, w) in xs.iter().zip(&want) {
            assert_eq!(round_e4m3(*x).to_bits(), w.to_bits(), "x = {x:e}: fast {} vs cast {w}", round_e4m3(*x));
        }
        assert!(round_e4m3(f32::NAN).is_nan());
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(32))]

        #[test]
        fn quantize_dequantize_cpu_is_the_slow_twin(n in 1usize..40_000, seed in 0u64..10_000, log_mag in -12i32..12) {
            let x = (Tensor::randn(0f32, 1.0, n, &Device::Cpu).unwrap() * 2f64.powi(log_mag)).unwrap();
            let _ = seed;
            let s = scale_from_amax(&amax(&x).unwrap(), 0).unwrap();
            let fast: Vec<f32> = quantize_dequantize_cpu(&x, &s).unwrap().to_vec1().unwrap();
            let slow: Vec<f32> = dequantize(&quantize(&x, &s).unwrap(), &s, DType::F32).unwrap().to_vec1().unwrap();
            prop_assert_eq!(fast, slow);
            let slow_amax: f32 = x.abs().unwrap().max(0).unwrap().to_scalar().unwrap();
            prop_assert_eq!(amax(&x).unwrap().to_scalar::<f32>().unwrap(), slow_amax);
            let xb = x.to_dtype(DType::BF16).unwrap(); // stage 4's activations are bf16
            let fast: Vec<f32> = quantize_dequantize_cpu(&xb, &s).unwrap().to_vec1().unwrap();
            let slow: Vec<f32> = dequantize(&quantize(&xb, &s).unwrap(), &s, DType::F32).unwrap().to_vec1().unwrap();
            prop_assert_eq!(fast, slow);
        }
    }
}

/// `quantize` and `dequantize` (candle custom ops) against their slow twins, candle's casts
/// through the 8-bit type: bit for bit, f32, bf16 and f16 inputs, NaN, ±inf and saturation included.
#[test]
fn quantize_ops_match_their_slow_twins() {
    use stage4_fp8::fp8::{dequantize_slow, quantize_slow};
    let mut v: Vec<f32> = (0..5000).map(|i| ((i as f32) * 0.7311).sin() * 10f32.powi(i % 7 - 3)).collect();
    v.extend([f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 1e9, -1e9, 0.0, -0.0, 1e-12]);
    let x = t(&v);
    for s in [scalar(1.0), scalar(0.013), Tensor::new(&[3.5f32], &Device::Cpu).unwrap()] {
        for dt in [DType::F32, DType::BF16, DType::F16] {
            let xd = x.to_dtype(dt).unwrap();
            let bits =
                |q: &Tensor| q.to_dtype(DType::F32).unwrap().to_vec1::<f32>().unwrap().iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            let (q, q_slow) = (quantize(&xd, &s).unwrap(), quantize_slow(&xd, &s).unwrap());
            assert_eq!(q.dtype(), DType::F8E4M3);
            assert_eq!(bits(&q), bits(&q_slow), "quantize, {dt:?}");
            for out in [DType::F32, DType::BF16] {
                let (y, y_slow) = (dequantize(&q, &s, out).unwrap(), dequantize_slow(&q, &s, out).unwrap());
                assert_eq!(y.dtype(), out);
                assert_eq!(bits(&y), bits(&y_slow), "dequantize to {out:?}");
            }
        }
    }
}
