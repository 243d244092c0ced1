//! The GEMM twin check at te's K: its tolerance (twin::gemm_twin_tolerance) is
//! derived, not guessed, so it is tested against what it claims to bound — the emulated FP8
//! GEMM (f32 accumulation) at te's shapes with a reduced token count, and a model of the FP8
//! tensor cores' truncating accumulator with and without fast accumulation — and it must stay
//! sharp enough to catch a scale bug.

use candle_core::{DType, Device, Tensor};
use shared::check::compare_within;
use shared::weights::SplitMix64;
use shared::Preset;
use stage4_fp8::fp8::Fp8Recipe;
use stage4_fp8::fp8::{quantize_dequantize_cpu, Fp8Linear, Fp8Mode, Input, ScalingConfig};
use stage4_fp8::twin::{gemm_twin_tolerance, Accumulation, MMA_K, PROMOTION_K, TENSOR_CORE_ACCUM_BITS};

fn randn(dims: &[usize], seed: u64, scale: f32) -> Tensor {
    let n = dims.iter().product();
    let v: Vec<f32> = SplitMix64::new(seed).normals(n).into_iter().map(|x| x * scale).collect();
    Tensor::from_vec(v, dims, &Device::Cpu).unwrap()
}

#[test]
fn tolerance_stays_discriminating() {
    let te = Preset::Te.shape();
    for k in [te.d_model, te.ff] {
        // Fast accumulation at te's largest K is the loosest case; a scale off by 1.25x gives 0.2.
        let fast = gemm_twin_tolerance(k, Accumulation::TensorCoreFast, DType::BF16);
        assert!(fast < 0.1, "K={k}: {fast}");
        let promoted = gemm_twin_tolerance(k, Accumulation::TensorCorePromoted, DType::BF16);
        assert!(promoted < 5e-3 && promoted < fast, "K={k}: {promoted}");
        let f32 = gemm_twin_tolerance(k, Accumulation::F32, DType::F32);
        assert!(f32 < 1e-4, "K={k}: {f32}");
    }
    // grows with K under fast accumulation (n truncations), not without
    let at = |k, a| gemm_twin_tolerance(k, a, DType::BF16);
    assert!(at(16384, Accumulation::TensorCoreFast) > 5.0 * at(768, Accumulation::TensorCoreFast));
    assert!(at(16384, Accumulation::TensorCorePromoted) < 1.01 * at(768, Accumulation::TensorCorePromoted));
}

/// The emulated FP8 layer (what stage 4 runs on the CPU) at te's fc2 (K = FF = 16384) and fc1
/// (K = C = 4096, GELU) — the K the tolerance depends on — with 16 tokens and 1024 of the
/// outputs (N = 4096 / 16384 at te: the same per-output sums, fewer of them): the GEMM twin
/// passes with the f32 tolerance, and fails a planted scale bug.
#[test]
fn emulated_gemm_twins_hold_at_te_k() {
    let te = Preset::Te.shape();
    for (k, n, gelu, name) in [(te.ff, 1024, false, "fc2"), (te.d_model, 1024, true, "fc1")] {
        let (w, b) = (randn(&[n, k], 1, 0.02), randn(&[n], 2, 0.02));
        let scaling = ScalingConfig { recipe: Fp8Recipe::Delayed, ..ScalingConfig::default() };
        let layer = Fp8Linear::with_output(&w, &b, gelu, Fp8Mode::Emulated, scaling, name, DType::F32).unwrap();
        let x = if gelu { randn(&[1, 16, k], 3, 1.0) } else { stage0_baseline::gelu_tanh(&randn(&[1, 16, k], 3, 1.0)).unwrap() };
        layer.forward(&x).unwrap();
        let (got, want) = layer.gemm_twin(&Input::Plain(x.clone())).unwrap();
        let tol = gemm_twin_tolerance(k, Accumulation::F32, layer.out_dtype());
        let c = compare_within(&got, &want, tol).unwrap();
        assert!(c.passed, "{name} K={k}: {c:?} (tolerance {tol:e})");
        let c = compare_within(&(got * 1.25).unwrap(), &want, gemm_twin_tolerance(k, Accumulation::TensorCoreFast, DType::BF16)).unwrap();
        assert!(!c.passed, "{name}: a 1.25x scale bug passes even the loosest tolerance: {c:?}");
    }
}

/// Keep `bits` significant bits of x, truncating toward zero (the FP8 tensor cores' accumulator).
fn truncate(x: f32, bits: i32) -> f32 {
    f32::from_bits(x.to_bits() & !((1u32 << (24 - bits)) - 1))
}

/// One output of an FP8 GEMM as the tensor cores sum it: exact products (E4M3 × E4M3 fits in
/// f32), summed per MMA (MMA_K products), and the running sum truncated to 14 significant bits
/// after each MMA; without fast accumulation that running sum is added to an f32 accumulator
/// and restarted every PROMOTION_K products.
fn tensor_core_dot(a: &[f32], b: &[f32], fast: bool) -> f32 {
    let (mut acc, mut part) = (0f32, 0f32);
    for (j, (ca, cb)) in a.chunks(MMA_K).zip(b.chunks(MMA_K)).enumerate() {
        let mma: f64 = ca.iter().zip(cb).map(|(x, y)| *x as f64 * *y as f64).sum();
        part = truncate((part as f64 + mma) as f32, TENSOR_CORE_ACCUM_BITS);
        if !fast && ((j + 1) * MMA_K).is_multiple_of(PROMOTION_K) {
            acc += part;
            part = 0.0;
        }
    }
    acc + part
}

/// The derived tolerances against a model of the tensor cores at te's fc2 (K = 16384, GELU'd
/// inputs, N(0, 0.02) weights, quantised to E4M3 with per-tensor scales): fast accumulation
/// stays within its tolerance but not within the promoted one (the H100's failure at te with
/// one fixed tolerance), and promoted accumulation stays within its own.
#[test]
fn tensor_core_accumulation_model_within_the_derived_tolerances_at_te() {
    let (m, k, n) = (8, Preset::Te.shape().ff, 64); // 8 tokens × 64 outputs of te's fc2
    let quant = |t: &Tensor| {
        let s = stage4_fp8::fp8::scale_from_amax(&stage4_fp8::fp8::amax(t).unwrap(), 0).unwrap();
        quantize_dequantize_cpu(t, &s).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap()
    };
    let x = quant(&stage0_baseline::gelu_tanh(&randn(&[m, k], 11, 1.0)).unwrap());
    let w = quant(&randn(&[n, k], 12, 0.02));
    let bf16 = |v: f32| half::bf16::from_f32(v).to_f32() as f64;
    let rel = |fast: bool| {
        let (mut num, mut den) = (0f64, 0f64);
        for i in 0..m {
            for j in 0..n {
                let (a, b) = (&x[i * k..(i + 1) * k], &w[j * k..(j + 1) * k]);
                let exact: f64 = a.iter().zip(b).map(|(p, q)| *p as f64 * *q as f64).sum();
                let got = bf16(tensor_core_dot(a, b, fast));
                num += (got - exact).powi(2);
                den += exact * exact;
            }
        }
        (num / den).sqrt()
    };
    let (fast, promoted) = (rel(true), rel(false));
    let tol = |a| gemm_twin_tolerance(k, a, DType::BF16);
    assert!(fast < tol(Accumulation::TensorCoreFast), "fast {fast:e} vs {:e}", tol(Accumulation::TensorCoreFast));
    assert!(
        fast > tol(Accumulation::TensorCorePromoted),
        "fast {fast:e} should exceed the promoted tolerance {:e}",
        tol(Accumulation::TensorCorePromoted)
    );
    assert!(promoted < tol(Accumulation::TensorCorePromoted), "promoted {promoted:e} vs {:e}", tol(Accumulation::TensorCorePromoted));
    eprintln!("te fc2 (K = {k}) tensor-core model: fast accumulation {fast:.2e}, promoted {promoted:.2e}");
}
