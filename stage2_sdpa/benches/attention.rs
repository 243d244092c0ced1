//! criterion: the CPU attention kernels on the `small` preset's heads (B = 4, n_head = 12,
//! d_head = 64), at T = 512 and 2048, causal. Throughput is the useful FLOPs (2·B·T²·C), so
//! criterion's "Gelem/s" reads as GFLOP/s, comparable with `cpu_ops`' GEMM group:
//! - `registers`: the kernel `attention` runs (our register-blocked micro-kernels, d_head a
//!   const generic), and `gemm_tiles`, the other design (Q·Kᵀ and P·V as tile GEMMs on the
//!   `gemm` crate), each on contiguous inputs (stage 2) and on `strided` views of one
//!   (B, T, 3, n_head, d_head) tensor (stage 3);
//! - `bf16_pairs_strided`: stage 3's views in bf16, as it runs at bf16: the kernel's bf16 body
//!   (AMX tiles where the CPU has them, else `vdpbf16ps`), where this CPU's bf16 unit runs it;
//! - `row_axpy`: the first CPU kernel, kept as the row-wise twin;
//! - `slow_twin`: stage 1's attention, which materialises the scores;
//! - `attention/small-backward`: the FlashAttention-2 backward from the forward's O and L, f32
//!   and on bf16 pairs.
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
        // The same views in bf16, as stage 3 runs them at bf16: bf16 pairs (AMX tiles where the
        // CPU has them), where this CPU's bf16 unit runs the kernel.
        if cpu_kernels::attention::registers::bf16::runs(d) {
            let qkv16 = qkv.to_dtype(candle_core::DType::BF16).unwrap();
            let [qs, ks, vs] = [0, 1, 2].map(|i| qkv16.i((.., .., i)).unwrap());
            group.bench_function(BenchmarkId::new("bf16_pairs_strided", t), |bench| {
                bench.iter(|| attention_cpu(CpuKernel::Registers, &qs, &ks, &vs, true).unwrap())
            });
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

/// The CPU backward (`attention/small-backward`): dQ, dK, dV from the forward's O and L, as a
/// training step runs it, in f32 (`f32`) and, where this CPU's bf16 unit runs it, on bf16 pairs
/// (`bf16-pairs`; AMX tiles on a CPU with AMX). Throughput: the backward's useful FLOPs, 2.5
/// forwards' (five tile products to the forward's two).
fn attention_backward(c: &mut Criterion) {
    use cpu_kernels::attention::backward::attention_bwd_with;
    use cpu_kernels::attention::{CpuAttention, CpuKernel};
    let dev = Device::Cpu;
    let (b, h, d) = (4, 12, 64);
    let scale = 1.0 / (d as f32).sqrt();
    let mut group = c.benchmark_group("attention/small-backward");
    group.sample_size(10).measurement_time(Duration::from_secs(5));
    for t in [512usize, 2048] {
        let mk = |seed: u64| Tensor::from_vec(shared::weights::SplitMix64::new(seed).normals(b * t * h * d), (b, t, h, d), &dev).unwrap();
        let (q, k, v, d_o) = (mk(1), mk(2), mk(3), mk(4));
        group.throughput(Throughput::Elements((5 * b * t * t * h * d) as u64));
        let mut variants = vec![(CpuKernel::Registers, false, "f32")];
        if cpu_kernels::attention::registers::bf16::runs(d) {
            variants.push((CpuKernel::RegistersBf16, true, "bf16-pairs"));
        }
        for (kernel, bf16, name) in variants {
            let op = CpuAttention::new(kernel, scale, true, true);
            let o = q.apply_op3_no_bwd(&k, &v, &op).unwrap();
            let lse = op.take_lse().expect("the forward kept L");
            group.bench_function(BenchmarkId::new(name, t), |bench| {
                bench.iter(|| attention_bwd_with(&q, &k, &v, &o, &d_o, Some(&lse), scale, true, bf16).unwrap())
            });
        }
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

criterion_group!(benches, attention, attention_backward, attention_cuda);
criterion_main!(benches);
