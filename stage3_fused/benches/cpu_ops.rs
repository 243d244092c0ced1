//! criterion, CPU: what the block's time is made of on the `small` preset
//! (B·T = 2048 rows, C = 768, FF = 3072).
//! - `gemm`: the shapes the ceiling probe measures: the four linears through candle's matmul,
//!   i.e. the GEMM backend this build uses, and attention's Q·Kᵀ and P·V per head through the gemm
//!   crate, rayon over heads (`shared::ceiling::attention_gemms`, as stage 2's kernel runs them) (`gemm` x86-v4 by default; MKL with `--features mkl`, after `eval "$(scripts/mkl.sh)"`).
//!   Throughput is in FLOPs, so criterion prints GFLOP/s as "Gelem/s".
//! - `elementwise`: `cpu_kernels::elementwise` (parallel, vectorised, one pass per op) against its
//!   slow twin, candle's own ops (`Elementwise::Candle`): LayerNorm, GELU, bias add, cast.
//! - `elementwise-train`: a training step's forward and backward of LayerNorm, GELU and the
//!   materialised attention's softmax (48 × 512 rows of 512 scores, causal mask) on tracked
//!   tensors: the engine's ops with their backward (`cpu_kernels/src/elementwise/grad.rs`) against
//!   candle's autograd of its own ops.
//! - `fused`: stage 3's fused ops against their slow twins beside them in `ops.rs` (plain candle ops).
//!
//! `cargo bench -p stage3_fused --bench cpu_ops` (add `-- gemm` for one group).

use candle_core::{DType, Device, Tensor};
use cpu_kernels::elementwise::{self as ew, Elementwise};
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use shared::weights::SplitMix64;
use std::time::Duration;

const C: usize = 768;
const FF: usize = 3072;

fn randn(dims: &[usize], seed: u64, std: f32) -> Tensor {
    let n = dims.iter().product();
    let v: Vec<f32> = SplitMix64::new(seed).normals(n).into_iter().map(|x| x * std).collect();
    Tensor::from_vec(v, dims, &Device::Cpu).unwrap()
}

fn gemm(c: &mut Criterion) {
    let mut group = c.benchmark_group(format!("gemm/{}", shared::ceiling::gemm_backend()));
    group.sample_size(10).measurement_time(Duration::from_secs(5));
    let shape = shared::Shape { batch: 4, seq: 512, d_model: C, n_head: 12, ff: FF }; // small: B·T = 2048
    for g in shared::ceiling::probe_gemms(&shape) {
        let (name, batch, m, n, k) = (g.name, g.batch, g.m, g.n, g.k);
        group.throughput(Throughput::Elements(g.flops() as u64));
        let id = BenchmarkId::new(name, format!("{batch}x{m}x{n}x{k}"));
        if batch == 1 {
            // The linears: x (m × k) · Wᵀ through candle's matmul.
            let (x, w) = (randn(&[m, k], 1, 1.0), randn(&[n, k], 2, 0.02).t().unwrap());
            group.bench_function(id, |b| b.iter(|| x.matmul(&w).unwrap()));
        } else {
            // Attention's products, per head, as the probe and stage 2's kernel run them.
            let (x, w) = (SplitMix64::new(1).normals(batch * m * k), SplitMix64::new(2).normals(batch * k * n));
            let mut y = vec![0f32; batch * m * n];
            group.bench_function(id, |b| b.iter(|| shared::ceiling::attention_gemms(&g, &x, &w, &mut y)));
        }
    }
    group.finish();
}

fn elementwise(c: &mut Criterion) {
    let mut group = c.benchmark_group("elementwise");
    group.sample_size(10).measurement_time(Duration::from_secs(3));
    let (x, h) = (randn(&[4, 512, C], 3, 1.0), randn(&[4, 512, FF], 4, 1.0));
    let (g, b, bff) = (randn(&[C], 5, 0.02), randn(&[C], 6, 0.02), randn(&[FF], 7, 0.02));
    for (label, mode) in [("parallel", Elementwise::Parallel), ("candle", Elementwise::Candle)] {
        group.bench_function(BenchmarkId::new("layer_norm", label), |bn| bn.iter(|| ew::layer_norm(&x, &g, &b, ew::LN_EPS, mode).unwrap()));
        group.bench_function(BenchmarkId::new("gelu_tanh", label), |bn| bn.iter(|| ew::gelu_tanh(&h, mode).unwrap()));
        group.bench_function(BenchmarkId::new("bias_add", label), |bn| bn.iter(|| ew::add(&h, &bff, mode).unwrap()));
        group.bench_function(BenchmarkId::new("cast_bf16", label), |bn| bn.iter(|| ew::to_dtype(&h, DType::BF16, mode).unwrap()));
    }
    group.finish();
}

fn elementwise_train(c: &mut Criterion) {
    use candle_core::Var;
    shared::device::keep_freed_memory(); // as every binary: the scores' 48 MiB tensors reused, not mapped afresh
    let mut group = c.benchmark_group("elementwise-train");
    group.sample_size(10).measurement_time(Duration::from_secs(3));
    let (x, h) = (Var::from_tensor(&randn(&[4, 512, C], 13, 1.0)).unwrap(), Var::from_tensor(&randn(&[4, 512, FF], 14, 1.0)).unwrap());
    let (g, b) = (Var::from_tensor(&(randn(&[C], 15, 0.02) + 1.0).unwrap()).unwrap(), Var::from_tensor(&randn(&[C], 16, 0.02)).unwrap());
    let s = Var::from_tensor(&randn(&[4, 12, 512, 512], 17, 1.0)).unwrap(); // (B, n_head, T, T)
    let mask: Vec<f32> = (0..512 * 512).map(|i| if i % 512 > i / 512 { f32::NEG_INFINITY } else { 0.0 }).collect(); // causal
    let mask = Tensor::from_vec(mask, (512, 512), &Device::Cpu).unwrap();
    let (rx, rh, rs) = (randn(&[4, 512, C], 18, 1.0), randn(&[4, 512, FF], 19, 1.0), randn(&[4, 12, 512, 512], 20, 1.0));
    // ⟨y, r⟩'s backward: the op's forward, its backward, and candle's loss around it.
    let step = |y: Tensor, r: &Tensor| (y * r).unwrap().sum_all().unwrap().backward().unwrap();
    for (label, mode) in [("parallel", Elementwise::Parallel), ("candle", Elementwise::Candle)] {
        group.bench_function(BenchmarkId::new("layer_norm", label), |bn| {
            bn.iter(|| step(ew::layer_norm(x.as_tensor(), g.as_tensor(), b.as_tensor(), ew::LN_EPS, mode).unwrap(), &rx))
        });
        group.bench_function(BenchmarkId::new("gelu_tanh", label), |bn| bn.iter(|| step(ew::gelu_tanh(h.as_tensor(), mode).unwrap(), &rh)));
        group.bench_function(BenchmarkId::new("masked_softmax", label), |bn| {
            bn.iter(|| step(ew::softmax_last_dim(&s.as_tensor().broadcast_add(&mask).unwrap(), mode).unwrap(), &rs))
        });
    }
    group.finish();
}

fn fused(c: &mut Criterion) {
    use stage3_fused::ops;
    let mut group = c.benchmark_group("fused");
    group.sample_size(10).measurement_time(Duration::from_secs(5));
    let x = randn(&[4, 512, C], 8, 1.0);
    let (g, b) = (randn(&[C], 9, 0.02), randn(&[C], 10, 0.02));
    let (w1, b1) = (randn(&[FF, C], 11, 0.02), randn(&[FF], 12, 0.02));
    group.bench_function("layer_norm/fused", |bn| bn.iter(|| ops::layer_norm(&x, &g, &b, ops::LN_EPS, DType::F32).unwrap()));
    group.bench_function("layer_norm/slow_twin", |bn| bn.iter(|| ops::layer_norm_slow(&x, &g, &b, ops::LN_EPS, DType::F32).unwrap()));
    group.bench_function("linear_bias_gelu/fused", |bn| bn.iter(|| ops::linear_bias_gelu(&x, &w1, &b1).unwrap()));
    group.bench_function("linear_bias_gelu/slow_twin", |bn| bn.iter(|| ops::linear_bias_gelu_slow(&x, &w1, &b1).unwrap()));
    group.finish();
}

criterion_group!(benches, gemm, elementwise, elementwise_train, fused);
criterion_main!(benches);
