//! criterion: each stage's forward on the `tiny` and `small` presets.
//!
//! `cargo bench -p ladder` (CPU) · `cargo bench -p ladder --features cuda` (first GPU).
//! Each timed forward is followed by a device synchronize, so a sample is the finished work,
//! exactly as the runner times it. Stages that cannot run on this device are skipped with a
//! line on stderr.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use shared::device::{select, DeviceRequest};
use shared::weights::random_input;
use shared::{BlockWeights, PrecisionRequest, Preset};
use std::hint::black_box;
use std::time::{Duration, Instant};

fn stages(c: &mut Criterion) {
    let (device, info) = select(DeviceRequest::Auto).expect("a device");
    eprintln!("device: {}", info.describe());
    for preset in [Preset::Tiny, Preset::Small] {
        let shape = preset.shape();
        let weights = BlockWeights::from_seed(&shape, 0).and_then(|w| w.to_device(&device)).expect("weights");
        let x = random_input(&shape, 0).and_then(|x| x.to_device(&device)).expect("input");
        let mut group = c.benchmark_group(format!("block/{}", preset.name()));
        group.throughput(Throughput::Elements(shape.tokens() as u64));
        if preset == Preset::Small && !info.is_cuda() {
            // ~0.5 s per forward on a laptop CPU: keep the whole bench to a few minutes.
            group.sample_size(10).measurement_time(Duration::from_secs(10));
        }
        for spec in ladder::default_stages() {
            let plan = match shared::stage::plan_alone(spec.as_ref(), &device, &info, shape, PrecisionRequest::Auto) {
                Ok(plan) => plan,
                Err(e) => {
                    eprintln!("{}: skipped: {e}", spec.name());
                    continue;
                }
            };
            let stage = spec.build(&weights, &plan).expect("build");
            // "fp8 (emulated, delayed scaling)": an emulation's time is never labelled as the format's
            let label = spec.implementation(&plan).map_or(plan.precision.to_string(), |i| format!("{} ({i})", plan.precision));
            group.bench_function(BenchmarkId::new(spec.name(), label), |b| {
                b.iter_custom(|iters| {
                    let mut total = Duration::ZERO;
                    for _ in 0..iters {
                        let t0 = Instant::now();
                        let y = stage.forward(black_box(&x)).expect("forward");
                        device.synchronize().expect("synchronize");
                        total += t0.elapsed();
                        drop(y);
                    }
                    total
                })
            });
        }
        group.finish();
    }
}

criterion_group!(benches, stages);
criterion_main!(benches);
