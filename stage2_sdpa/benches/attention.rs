//! criterion: the CPU attention kernels on the `small` preset's heads (B = 4, n_head = 12,
//! d_head = 64), at T = 512 and 2048, causal. Throughput is the useful FLOPs (2·B·T²·C), so
//! criterion's "Gelem/s" reads as GFLOP/s, comparable with `cpu_ops`' GEMM group:
//! - `registers`: the kernel `attention` runs (our register-blocked micro-kernels, d_head a
//!   const generic), and `gemm_tiles`, the other design (Q·Kᵀ and P·V as tile GEMMs on the
//!   `gemm` crate), each on contiguous inputs (stage 2) and on `strided` views of one
//!   (B, T, 3, n_head, d_head) tensor (stage 3);
//! - `row_axpy`: the first CPU kernel, kept as the row-wise twin;
//! - `slow_twin`: stage 1's attention, which materialises the scores.
//!
//! `cargo bench -p stage2_sdpa` (CPU); `-- 512` for T = 512 only.
//!
//! Built with `--features cuda` and run on a GPU, also `attention/cuda`: our CUDA kernel
//! (`kernels/flash_attn.cu`), candle-flash-attn when the `flash-attn` feature is built, and the
//! slow twin, at bf16 on the `te` preset's heads (B = 8, n_head = 32, d_head = 128), each sample
//! synchronizing the device: `cargo bench -p stage2_sdpa --features cuda,flash-attn`.

use candle_core::{Device, IndexOp, Tensor};
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use std::time::Duration;

fn attention(c: &mut Criterion) {
    let dev = Device::Cpu;
    let (b, h, d) = (4, 12, 64); // small: B = 4, n_head = 12, d_head = 64
    use stage2_sdpa::attention::{attention_cpu, CpuKernel};
    let mut group = c.benchmark_group("attention/small");
    group.sample_size(10).measurement_time(Duration::from_secs(5));
    for t in [512usize, 2048] {
        let mk = |seed: u64| Tensor::from_vec(shared::weights::SplitMix64::new(seed).normals(b * t * h * d), (b, t, h, d), &dev).unwrap();
        let (q, k, v) = (mk(1), mk(2), mk(3));
        // Useful FLOPs of causal attention: half of 4·B·T²·C.
        group.throughput(Throughput::Elements((2 * b * t * t * h * d) as u64));
        for (kernel, name) in [(CpuKernel::GemmTiles, "gemm_tiles"), (CpuKernel::Registers, "registers"), (CpuKernel::RowAxpy, "row_axpy")]
        {
            group.bench_function(BenchmarkId::new(name, t), |bench| bench.iter(|| attention_cpu(kernel, &q, &k, &v, true).unwrap()));
        }
        // Stage 3's layout: q, k, v are views of the QKV GEMM's (B, T, 3, n_head, d_head) output.
        let qkv = Tensor::stack(&[&q, &k, &v], 2).unwrap(); // (B, T, 3, n_head, d_head)
        let [qs, ks, vs] = [0, 1, 2].map(|i| qkv.i((.., .., i)).unwrap());
        for (kernel, name) in [(CpuKernel::GemmTiles, "gemm_tiles_strided"), (CpuKernel::Registers, "registers_strided")] {
            group.bench_function(BenchmarkId::new(name, t), |bench| bench.iter(|| attention_cpu(kernel, &qs, &ks, &vs, true).unwrap()));
        }
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
