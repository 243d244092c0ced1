//! Stage 4's FP8 GEMM without a GPU: the arguments `gemm::fp8_gemm_args` builds (the ones
//! `cuda.rs` turns into cuBLASLt descriptors) are executed by `cublaslt_model`, a CPU
//! model of cuBLASLt's documented contract (D = scale_A·scale_B·op(A)·op(B) + bias, GELU), on
//! the E4M3 buffers and scales the CUDA path passes (A = W_q with W's scale, B = x_q with x's),
//! and the model's D must equal the emulated `Fp8Linear` (the slow twin) under both recipes.

use candle_core::{DType, Device, Tensor};
use cublaslt_model::matmul;
use proptest::prelude::*;
use stage4_fp8::fp8::Fp8Recipe;
use stage4_fp8::fp8::{quantize, Fp8Linear, Fp8Mode, ScalingConfig};
use stage4_fp8::gemm::fp8_gemm_args;

fn host(t: &Tensor) -> Vec<f32> {
    t.to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1().unwrap()
}

/// Uniform values in (−a, a), from a seeded LCG.
fn uniform(shape: &[usize], a: f32, seed: u64) -> Tensor {
    let len = shape.iter().product();
    let mut s = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    let v: Vec<f32> = (0..len)
        .map(|_| {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 2.0 * a
        })
        .collect();
    Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
}

fn check(tokens: usize, k: usize, n: usize, gelu: bool, recipe: Fp8Recipe, seed: u64) -> f64 {
    let w = uniform(&[n, k], 0.1, seed);
    let b = uniform(&[n], 0.1, seed + 1);
    let layer = Fp8Linear::new(&w, &b, gelu, Fp8Mode::Emulated, ScalingConfig { recipe, history_len: 4, margin: 0 }, "layer").unwrap();
    // Two calls with different magnitudes: the second one's delayed scale is the first's amax.
    let x1 = uniform(&[1, tokens, k], 3.0, seed + 2);
    let x = uniform(&[1, tokens, k], 1.0, seed + 3);
    layer.forward(&x1).unwrap();
    let y = layer.forward(&x).unwrap(); // (1, tokens, n) bf16: the twin
    let s_x = layer.last_input_scale().unwrap();
    let xq = quantize(&x, &s_x).unwrap();
    let (wq, s_w) = (&layer.weight().data, &layer.weight().scale);
    let args = fp8_gemm_args(tokens, k, n, gelu).unwrap().contract();
    let scales = (s_w.to_scalar::<f32>().unwrap(), s_x.to_scalar::<f32>().unwrap()); // (A = W's, B = x's)
    let d = matmul(&args, &host(wq), &host(&xq), None, Some(&host(layer.bias())), scales).unwrap();
    let want = host(&y);
    let num: f64 = d.iter().zip(&want).map(|(a, b)| (*a as f64 - *b as f64).powi(2)).sum();
    let den: f64 = want.iter().map(|b| (*b as f64).powi(2)).sum();
    (num / den).sqrt()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 16, ..ProptestConfig::default() })]
    #[test]
    fn model_of_the_fp8_arguments_matches_the_emulated_layer(
        tokens in 1usize..12, k in 1usize..16, n in 1usize..16, gelu: bool,
        recipe in prop::sample::select(vec![Fp8Recipe::Delayed, Fp8Recipe::Current]), seed in 0u64..1000,
    ) {
        // FP8 GEMMs need multiples of 16 (gemm::check_dims): 16..=176 tokens, 16..=240 features.
        let (tokens, k, n) = (16 * tokens, 16 * k, 16 * n);
        let e = check(tokens, k, n, gelu, recipe, seed);
        // Both sides hold the same E4M3 products; only the bf16 rounding of D and the order
        // of the f32 sums differ.
        prop_assert!(e < 1e-2, "{recipe:?} gelu={gelu} M={tokens} K={k} N={n}: rel err {e:.2e}");
    }
}

/// The fc1 → fc2 fusion's arguments (`fp8_gemm_args_e4m3_out`): fc1 writes E4M3 with fc2's
/// input scale as D scale (1/s) and amax_D, per cuBLASLt's FP8 contract as modelled. Executed
/// by the model, D must be the emulated fc1's f32 output quantised with that scale, bit for bit
/// up to the f32 sum order (a value on a rounding boundary may land on the neighbour), and
/// amax_D its max |·|.
#[test]
fn fc1_writing_e4m3_for_fc2_matches_its_slow_twin() {
    use cublaslt_model::matmul_fp8_out;
    use stage4_fp8::fp8::{amax, dequantize, scale_from_amax};
    use stage4_fp8::gemm::fp8_gemm_args_e4m3_out;
    let (tokens, k, n) = (32, 64, 256); // fc1: C → FF
    let (w, b) = (uniform(&[n, k], 0.1, 40), uniform(&[n], 0.1, 41));
    let layer = Fp8Linear::with_output(&w, &b, true, Fp8Mode::Emulated, ScalingConfig::default(), "fc1", DType::F32).unwrap();
    let x = uniform(&[1, tokens, k], 2.0, 42);
    let y = layer.forward(&x).unwrap(); // (1, tokens, n) f32: GELU(x̃ W̃ᵀ + b), not rounded to bf16
    let s_next = scale_from_amax(&(amax(&y).unwrap() * 0.9).unwrap(), 0).unwrap(); // fc2's delayed scale: a little small, so the top saturates
    let want = host(&dequantize(&quantize(&y, &s_next).unwrap(), &s_next, DType::F32).unwrap());
    let s_x = layer.last_input_scale().unwrap();
    let args = fp8_gemm_args_e4m3_out(tokens, k, n, true).unwrap().contract();
    let scales = (layer.weight().scale.to_scalar::<f32>().unwrap(), s_x.to_scalar::<f32>().unwrap());
    let s = s_next.to_scalar::<f32>().unwrap();
    let (d, amax_d) =
        matmul_fp8_out(&args, &host(&layer.weight().data), &host(&quantize(&x, &s_x).unwrap()), Some(&host(layer.bias())), scales, 1.0 / s)
            .unwrap();
    let got: Vec<f32> = d.iter().map(|q| q * s).collect(); // fc2 reads D with scale s
    let differ = got.iter().zip(&want).filter(|(g, w)| g != w).count();
    assert!(differ * 100 <= want.len(), "{differ} of {} E4M3 values differ", want.len());
    let max_y = host(&y).iter().fold(0f32, |m, v| m.max(v.abs()));
    assert!((amax_d - max_y).abs() <= 1e-5 * max_y, "amax_D {amax_d} vs {max_y}");
    assert!(got.iter().any(|v| (v - 448.0 * s).abs() < 1e-6 * s), "nothing saturated: the test would not see a wrong D scale");
}
