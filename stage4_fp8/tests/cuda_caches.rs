//! On a GPU (`--features cuda`, SM 8.9+ for FP8): once a layer has run, running it again does no
//! host work that could be done once — no kernel module is loaded (`kernel_cache`) and
//! cuBLASLt's algorithm heuristic is not asked again (`stage4_fp8::cuda`'s plan cache). The
//! caches' logic is tested without a GPU in `kernel_cache`'s tests.
#![cfg(feature = "cuda")]

use candle_core::{DType, Device, Tensor};
use stage4_fp8::fp8::{Fp8Linear, Fp8Mode, Fp8Recipe, ScalingConfig};

#[test]
fn a_forward_after_the_first_loads_no_module_and_asks_no_heuristic() {
    let dev = Device::new_cuda(0)
        .expect("tests/cuda_caches.rs needs an NVIDIA GPU (SM 8.9+); without one, run the tests without --features cuda");
    let bf16 = |t: Tensor| t.to_dtype(DType::BF16).unwrap();
    // fc1-like: (B, T, C) = (2, 64, 128) into 256 features, GELU epilogue.
    let w = bf16(Tensor::randn(0f32, 0.02, (256, 128), &dev).unwrap());
    let b = bf16(Tensor::randn(0f32, 0.02, 256, &dev).unwrap());
    let x = bf16(Tensor::randn(0f32, 1.0, (2, 64, 128), &dev).unwrap());
    for recipe in [Fp8Recipe::Delayed, Fp8Recipe::Current] {
        let scaling = ScalingConfig { recipe, ..ScalingConfig::default() };
        let layer = Fp8Linear::new(&w, &b, true, Fp8Mode::Cublaslt, scaling, "fc1").unwrap();
        let first = layer.forward(&x).unwrap();
        let (loads, queries) = (kernel_cache::module_loads(), stage4_fp8::cuda::heuristic_queries());
        assert!(queries >= 1, "the first forward asked cuBLASLt for an algorithm");
        for _ in 0..3 {
            let y = layer.forward(&x).unwrap();
            assert_eq!(y.dims(), first.dims());
        }
        dev.synchronize().unwrap();
        assert_eq!(kernel_cache::module_loads(), loads, "{recipe:?}: a later forward loaded a kernel module");
        assert_eq!(stage4_fp8::cuda::heuristic_queries(), queries, "{recipe:?}: a later forward asked the heuristic again");
    }
}
