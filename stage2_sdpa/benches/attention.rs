//! criterion: the fused attention kernel against its slow twin (stage 1's attention, which
//! materialises the scores) on the `small` preset's heads, at T = 512 and 2048 — where fusing
//! starts to pay. `cargo bench -p stage2_sdpa` (CPU).

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

criterion_group!(benches, attention);
criterion_main!(benches);
