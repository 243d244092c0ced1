//! Stage 2's CUDA attention kernels (`kernels/flash_attn.cu` = v1, `kernels/flash_attn_v2.cu` =
//! v2) on a GPU, each against the CPU kernel on the same 16-bit inputs, and the block against the fp32 reference. Built only with the `cuda`
//! feature, so `cargo test` passes on machines without a GPU; with the feature, these need one
//! (SM 8.0+): `cargo test --release --features cuda -p stage2_sdpa --test cuda`.
#![cfg(feature = "cuda")]

use candle_core::{DType, Device, IndexOp, Tensor};
use shared::check::{compare, compare_within};
use shared::device::{select, DeviceRequest};
use shared::stage::plan_alone;
use shared::weights::{random_input, SplitMix64};
use shared::{BlockWeights, Precision, PrecisionRequest, Preset, Stage};
use stage2_sdpa::attention::{attention_with, Implementation};

fn gpu() -> Device {
    Device::new_cuda(0).expect("tests/cuda.rs needs an NVIDIA GPU (SM 8.0+); without one, run the tests without --features cuda")
}

/// N(0, 1) values of shape `dims` in `dtype` on `dev`.
fn randn(dims: &[usize], seed: u64, dtype: DType, dev: &Device) -> Tensor {
    let n = dims.iter().product();
    Tensor::from_vec(SplitMix64::new(seed).normals(n), dims, &Device::Cpu).unwrap().to_dtype(dtype).unwrap().to_device(dev).unwrap()
}

/// Our two CUDA kernels.
const KERNELS: [Implementation; 2] = [Implementation::SpeedkitCudaV1, Implementation::SpeedkitCuda];

/// Each of our CUDA kernels against the CPU kernel on the same rounded inputs. Both accumulate in f32;
/// the GPU also rounds P̃ to 16 bits before P̃ V (tensor-core operand), so the two differ by about
/// one 16-bit rounding: ~2e-3 relative at bf16, ~3e-4 at f16.
fn check(q: &Tensor, k: &Tensor, v: &Tensor, causal: bool) {
    let cpu = |x: &Tensor| x.to_device(&Device::Cpu).unwrap();
    let want = attention_with(Implementation::Cpu, &cpu(q), &cpu(k), &cpu(v), causal).unwrap();
    let tol = if q.dtype() == DType::BF16 { 1e-2 } else { 2e-3 };
    for imp in KERNELS {
        let got = attention_with(imp, q, k, v, causal).unwrap();
        assert_eq!((got.dims(), got.dtype()), (q.dims(), q.dtype()));
        let c = compare_within(&got, &want, tol).unwrap();
        assert!(c.passed, "{} {:?} {:?} causal={causal}: {c:?}", imp.name(), q.dims(), q.dtype());
        assert!(c.rel_err > 0.0, "not vacuous: 16-bit rounding shows");
    }
}

#[test]
fn kernel_matches_the_cpu_kernel() {
    let dev = gpu();
    for dtype in [DType::BF16, DType::F16] {
        for d in [32, 64, 128] {
            // T = 1, one partial tile, exactly one tile, a tile and one row, several tiles.
            for t in [1, 63, 64, 65, 200, 1024] {
                for causal in [true, false] {
                    let dims = [2, t, 3, d];
                    let seed = (t * d) as u64;
                    let (q, k, v) =
                        (randn(&dims, seed, dtype, &dev), randn(&dims, seed + 1, dtype, &dev), randn(&dims, seed + 2, dtype, &dev));
                    check(&q, &k, &v, causal);
                }
            }
        }
    }
}

#[test]
fn strided_views_in_place_and_copied() {
    let dev = gpu();
    let (b, t, h, d) = (2, 130, 4, 64);
    // Stage 3's q, k, v: strided slices of one (B, T, 3, n_head, d_head) tensor, read in place.
    let qkv = randn(&[b, t, 3, h, d], 7, DType::BF16, &dev);
    let (q, k, v) = (qkv.i((.., .., 0)).unwrap(), qkv.i((.., .., 1)).unwrap(), qkv.i((.., .., 2)).unwrap());
    assert!(stage2_sdpa::attention_cuda::kernel_strides(q.layout(), k.layout(), v.layout()).is_some());
    check(&q, &k, &v, true);
    // Heads-first (B, n_head, T, d_head) transposed to (B, T, n_head, d_head): other strides.
    let hf = |s| randn(&[b, h, t, d], s, DType::F16, &dev).transpose(1, 2).unwrap();
    check(&hf(8), &hf(9), &hf(10), false);
    // Rows off a 16-byte boundary: attention() copies them first.
    let flat = randn(&[b * t * h * d + 3], 11, DType::BF16, &dev);
    let odd = flat.narrow(0, 3, b * t * h * d).unwrap().reshape((b, t, h, d)).unwrap();
    assert!(stage2_sdpa::attention_cuda::kernel_strides(odd.layout(), odd.layout(), odd.layout()).is_none());
    check(&odd, &odd, &odd, true);
}

#[test]
fn causal_row_sees_only_the_past() {
    // Changing the last key/value must not change any output row but the last.
    let dev = gpu();
    let dims = [1, 130, 1, 64];
    let (q, k, v) = (randn(&dims, 1, DType::BF16, &dev), randn(&dims, 2, DType::BF16, &dev), randn(&dims, 3, DType::BF16, &dev));
    let bump = |x: &Tensor| {
        let last = (x.narrow(1, 129, 1).unwrap() + 5.0).unwrap();
        Tensor::cat(&[&x.narrow(1, 0, 129).unwrap(), &last], 1).unwrap()
    };
    let rows = |x: &Tensor| x.narrow(1, 0, 129).unwrap().to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
    for imp in KERNELS {
        let a = attention_with(imp, &q, &k, &v, true).unwrap();
        let b = attention_with(imp, &q, &bump(&k), &bump(&v), true).unwrap();
        assert_eq!(rows(&a), rows(&b), "{}", imp.name());
    }
}

#[test]
fn block_matches_reference_on_the_gpu() {
    // tiny (d_head 32) and small (d_head 64) at bf16 and f16, against the fp32 stage-0 block.
    let (device, info) = select(DeviceRequest::Cuda(0)).unwrap();
    for preset in [Preset::Tiny, Preset::Small] {
        let shape = preset.shape();
        let w = BlockWeights::from_seed(&shape, 4).unwrap();
        let x = random_input(&shape, 4).unwrap().to_device(&device).unwrap();
        let run = |spec: &dyn Stage, req| {
            let plan = plan_alone(spec, &device, &info, shape, req).unwrap();
            (spec.build(&w, &plan).unwrap().forward(&x).unwrap(), spec.implementation(&plan))
        };
        let (reference, _) = run(&stage0_baseline::Baseline, PrecisionRequest::Auto);
        for p in [Precision::Bf16, Precision::F16] {
            let (y, imp) = run(&stage2_sdpa::Sdpa::default(), PrecisionRequest::Exactly(p));
            assert_eq!(imp.as_deref(), Some(Implementation::cuda().name()));
            let c = compare(&y, &reference, p).unwrap();
            assert!(c.passed, "{preset:?} {p}: {c:?}");
        }
    }
}

#[cfg(feature = "flash-attn")]
#[test]
fn kernel_matches_candle_flash_attn() {
    let dev = gpu();
    for d in [64, 128] {
        for causal in [true, false] {
            let dims = [2, 300, 4, d];
            let (q, k, v) = (randn(&dims, 1, DType::BF16, &dev), randn(&dims, 2, DType::BF16, &dev), randn(&dims, 3, DType::BF16, &dev));
            let ours = attention_with(Implementation::SpeedkitCuda, &q, &k, &v, causal).unwrap();
            let theirs = attention_with(Implementation::FlashAttn, &q, &k, &v, causal).unwrap();
            let c = compare_within(&ours, &theirs, 1e-2).unwrap();
            assert!(c.passed, "d={d} causal={causal}: {c:?}");
        }
    }
}

/// The backward on CUDA (`kernels/flash_attn_bwd.cu`) against the CPU backward on the same
/// 16-bit q, k, v and upstream gradient: dQ, dK, dV through `loss.backward()`, as training runs
/// them. The GPU rounds P and dS to 16 bits as tensor-core operands; the CPU's are f32.
#[test]
fn backward_kernel_matches_the_cpu_backward() {
    use candle_core::Var;
    let dev = gpu();
    for dtype in [DType::BF16, DType::F16] {
        // (T = 1 makes dQ and dK zero but for rounding: the host emulation checks it by RMS.)
        for (b, t, h, d) in [(1, 64, 1, 64), (2, 65, 3, 32), (1, 200, 2, 128), (2, 512, 4, 64)] {
            for causal in [true, false] {
                let grads = |device: &Device| {
                    let x = |seed| Var::from_tensor(&randn(&[b, t, h, d], seed, dtype, device)).unwrap();
                    let (q, k, v) = (x(1), x(2), x(3));
                    let r = randn(&[b, t, h, d], 4, DType::F32, device);
                    let o = stage2_sdpa::attention::attention(q.as_tensor(), k.as_tensor(), v.as_tensor(), causal).unwrap();
                    let g = (o.to_dtype(DType::F32).unwrap() * r).unwrap().sum_all().unwrap().backward().unwrap();
                    [q, k, v].map(|v| g.get(v.as_tensor()).unwrap().to_device(&Device::Cpu).unwrap())
                };
                let (gpu_grads, cpu_grads) = (grads(&dev), grads(&Device::Cpu));
                let tol = if dtype == DType::BF16 { 3e-2 } else { 5e-3 };
                for (name, (g, c)) in ["dq", "dk", "dv"].iter().zip(gpu_grads.iter().zip(&cpu_grads)) {
                    let r = compare_within(g, c, tol).unwrap();
                    assert!(r.passed, "{name} {dtype:?} ({b}, {t}, {h}, {d}) causal={causal}: {r:?}");
                }
            }
        }
    }
}
