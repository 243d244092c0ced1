//! criterion: the fused attention kernel against its slow twin (stage 1's attention, which
//! materialises the scores) on the `small` preset's heads, at T = 512 and 2048 — where fusing
//! starts to pay. `cargo bench -p stage2_sdpa` (CPU).
//!
//! Built with `--features cuda` and run on a GPU, also `attention/cuda`: our CUDA kernel
//! (`kernels/flash_attn.cu`), candle-flash-attn when the `flash-attn` feature is built, and the
//! slow twin, at bf16 on the `te` preset's heads (B = 8, n_head = 32, d_head = 128), each sample
//! synchronizing the device: `cargo bench -p stage2_sdpa --features cuda,flash-attn`.

use candle_core::{Device, Tensor};
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use std::time::Duration;

fn attention(c: &mut Criterion) {
    let dev = Device::Cpu;
    let (b, h, d) = (4, 12, 64); // small: B = 4, n_head = 12, d_head = 64
    let mut group = c.benchmark_group("attention/small");
    group.sample_size(10).measurement_time(Duration::from_secs(10));
    for t in [512usize, 2048] {
        let mk = |seed: u64| Tensor::from_vec(shared::weights::SplitMix64::new(seed).normals(b * t * h * d), (b, t, h, d), &dev).unwrap();
        let (q, k, v) = (mk(1), mk(2), mk(3));
        // Useful FLOPs of causal attention: half of 4·B·T²·C.
        group.throughput(Throughput::Elements((2 * b * t * t * h * d) as u64));
        group.bench_function(BenchmarkId::new("fused", t), |bench| bench.iter(|| stage2_sdpa::attention(&q, &k, &v, true).unwrap()));
        let flat = |x: &Tensor| x.reshape((b, t, h * d)).unwrap();
        let (qf, kf, vf) = (flat(&q), flat(&k), flat(&v));
        let mask = stage0_baseline::causal_mask(t, &dev).unwrap();
        group.bench_function(BenchmarkId::new("slow_twin", t), |bench| {
            bench.iter(|| stage1_tensorcore::attention(&qf, &kf, &vf, h, &mask).unwrap())
        });
    }
    group.finish();
}

#[cfg(feature = "cuda")]
fn attention_cuda(c: &mut Criterion) {
    use stage2_sdpa::attention::{attention_with, Implementation};
    let Ok(dev) = Device::new_cuda(0) else {
        eprintln!("attention/cuda: no CUDA device could be opened, so the GPU group is not run");
        return;
    };
    let (b, h, d) = (8, 32, 128); // te: B = 8, n_head = 32, d_head = 128
    let mut group = c.benchmark_group("attention/cuda");
    for t in [512usize, 2048] {
        let mk = |seed: u64| {
            let x = Tensor::from_vec(shared::weights::SplitMix64::new(seed).normals(b * t * h * d), (b, t, h, d), &Device::Cpu).unwrap();
            x.to_dtype(candle_core::DType::BF16).unwrap().to_device(&dev).unwrap()
        };
        let (q, k, v) = (mk(1), mk(2), mk(3));
        group.throughput(Throughput::Elements((2 * b * t * t * h * d) as u64));
        let mut imps = vec![Implementation::SpeedkitCuda];
        if cfg!(feature = "flash-attn") {
            imps.push(Implementation::FlashAttn);
        }
        for imp in imps {
            group.bench_function(BenchmarkId::new(imp.name(), t), |bench| {
                bench.iter(|| {
                    let o = attention_with(imp, &q, &k, &v, true).unwrap();
                    dev.synchronize().unwrap();
                    o
                })
            });
        }
        let flat = |x: &Tensor| x.reshape((b, t, h * d)).unwrap();
        let (qf, kf, vf) = (flat(&q), flat(&k), flat(&v));
        let mask = stage0_baseline::causal_mask(t, &dev).unwrap();
        group.bench_function(BenchmarkId::new("slow_twin", t), |bench| {
            bench.iter(|| {
                let o = stage1_tensorcore::attention(&qf, &kf, &vf, h, &mask).unwrap();
                dev.synchronize().unwrap();
                o
            })
        });
    }
    group.finish();
}

#[cfg(not(feature = "cuda"))]
fn attention_cuda(_: &mut Criterion) {}

criterion_group!(benches, attention, attention_cuda);
criterion_main!(benches);
