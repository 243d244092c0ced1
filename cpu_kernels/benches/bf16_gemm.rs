//! criterion, CPU: the block's four linears on the `small` preset (B·T = 2048 rows, C = 768,
//! FF = 3072), x (m × k) · Wᵀ:
//! - `f32`: candle's f32 matmul (the `gemm` crate's x86-v4 kernels, or MKL with `--features mkl`):
//!   what stages 0–3 run at fp32;
//! - `bf16`: `bf16_gemm::matmul` on the kernel this CPU has (`avx512-bf16`, `amx`, or
//!   `converted to f32`; the group's name says which), W packed in every call;
//! - `bf16-prepacked`: `bf16_gemm::matmul_prepacked`, W packed once (`PackedWeight`), as the
//!   blocks of stages 1 and 3 hold it;
//! - `bf16-mkl` (builds with `--features mkl`): MKL's `cblas_gemm_bf16bf16f32` through the same op;
//! - `bf16-dx`, `bf16-dw` (on a CPU whose bf16 unit runs our kernel): the linear's backward GEMMs,
//!   dx = dz·W and dW = dzᵀ·x (f32 dz and W, bf16 x, read where they lie and packed in the
//!   call), as a training step runs them;
//! - `bf16-candle` (with `BENCH_CANDLE_BF16=1`): candle's own matmul on bf16 tensors, what stage 1
//!   ran on a CPU before.
//!
//! Throughput is in FLOPs, so criterion prints GFLOP/s as "Gelem/s".
//! `cargo bench -p stage1_tensorcore --bench bf16_gemm` (add `-- f32` for one variant). For fp32
//! and bf16 timed interleaved (one machine shared with other work), `--bench bf16_gemm_pairs`.

use candle_core::{DType, Device, Tensor};
use cpu_kernels::bf16_gemm::{self, Kernel, MatRef};
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use shared::weights::SplitMix64;
use std::time::Duration;

fn randn(dims: &[usize], seed: u64, std: f32) -> Tensor {
    let n = dims.iter().product();
    let v: Vec<f32> = SplitMix64::new(seed).normals(n).into_iter().map(|x| x * std).collect();
    Tensor::from_vec(v, dims, &Device::Cpu).unwrap()
}

fn linears(c: &mut Criterion) {
    let mut group = c.benchmark_group(format!("linears/bf16 kernel {}", Kernel::detect().name()));
    group.sample_size(10).measurement_time(Duration::from_secs(3));
    let shape = shared::Preset::Small.shape();
    for g in shared::ceiling::probe_gemms(&shape).into_iter().filter(|g| g.batch == 1) {
        let (m, n, k) = (g.m, g.n, g.k);
        group.throughput(Throughput::Elements(g.flops() as u64));
        let (x, w) = (randn(&[m, k], 1, 1.0), randn(&[n, k], 2, 0.02).t().unwrap()); // Wᵀ: a (k, n) view
        let (xb, wb) = (x.to_dtype(DType::BF16).unwrap(), w.to_dtype(DType::BF16).unwrap());
        let id = |v: &str| BenchmarkId::new(v, format!("{}_{m}x{n}x{k}", g.name));
        group.bench_function(id("f32"), |b| b.iter(|| x.matmul(&w).unwrap()));
        group.bench_function(id("bf16"), |b| b.iter(|| bf16_gemm::matmul(&xb, &wb).unwrap()));
        let packed = bf16_gemm::PackedWeight::new(&wb.t().unwrap()).unwrap(); // W (n, k), packed once
        group.bench_function(id("bf16-prepacked"), |b| b.iter(|| bf16_gemm::matmul_prepacked(&xb, &packed).unwrap()));
        // The training step's two backward GEMMs of this linear, as stage 3's backward runs them
        // (f32 dz and W, the weight's f32 master; bf16 x), each packing its operands in the call.
        // Only on a CPU whose bf16 unit runs our kernel: `gemm` refuses the others.
        let kernel = Kernel::detect();
        if kernel.is_native() {
            let dz = randn(&[m, n], 3, 0.02);
            let mut grad = vec![0f32; m.max(n) * k];
            let f32s = |t: &Tensor| t.contiguous().unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
            let (dzv, wv) = (f32s(&dz), f32s(&w.t().unwrap())); // W (n, k)
            let xv: Vec<half::bf16> = xb.flatten_all().unwrap().to_vec1().unwrap();
            let dx = |g: &mut [f32]| bf16_gemm::gemm(kernel, g, MatRef::row_major(&dzv, m, n), MatRef::row_major(&wv, n, k), false, true);
            let dw =
                |g: &mut [f32]| bf16_gemm::gemm(kernel, g, MatRef::row_major(&dzv, m, n).t(), MatRef::row_major(&xv, m, k), false, true);
            group.bench_function(id("bf16-dx"), |b| b.iter(|| dx(&mut grad[..m * k]).unwrap()));
            group.bench_function(id("bf16-dw"), |b| b.iter(|| dw(&mut grad[..n * k]).unwrap()));
        }
        if Kernel::Mkl.available() {
            group.bench_function(id("bf16-mkl"), |b| b.iter(|| bf16_gemm::matmul_with(&xb, &wb, Kernel::Mkl).unwrap()));
        }
        if std::env::var_os("BENCH_CANDLE_BF16").is_some() {
            group.bench_function(id("bf16-candle"), |b| b.iter(|| xb.matmul(&wb).unwrap()));
        }
    }
    group.finish();
}

criterion_group!(benches, linears);
criterion_main!(benches);
