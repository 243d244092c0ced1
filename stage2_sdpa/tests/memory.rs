//! Proof that the fused kernel never materialises the (B, n_head, T, T) scores: at T = 4096 its
//! peak memory growth stays far below the size of that matrix, while the slow twin's (measured
//! the same way, in the same process) exceeds it — so the probe is known to see it.
//! One test in this file, so no other test allocates in this process meanwhile.

use candle_core::{DType, Device, Tensor};
use shared::device::MemProbe;

#[test]
fn scores_are_never_materialised_at_t_4096() {
    let (b, t, h, d) = (1usize, 4096usize, 4usize, 64usize);
    let scores_bytes = (b * h * t * t * 4) as u64; // 256 MiB in f32
    let dev = Device::Cpu;
    let mk = |s: f64| Tensor::randn(0f32, 1.0, (b, t, h, d), &dev).unwrap().affine(s, 0.0).unwrap();
    let (q, k, v) = (mk(1.0), mk(1.0), mk(1.0));

    let probe = MemProbe::start(&dev);
    let o = stage2_sdpa::attention(&q, &k, &v, true).unwrap();
    let (fused, method) = probe.finish();
    let fused = fused.expect("peak RSS is readable on this platform");
    assert_eq!(o.dtype(), DType::F32);
    drop(o);

    let probe = MemProbe::start(&dev);
    let flat = |x: &Tensor| x.reshape((b, t, h * d)).unwrap();
    let mask = stage0_baseline::causal_mask(t, &dev).unwrap();
    let o = stage1_tensorcore::attention(&flat(&q), &flat(&k), &flat(&v), h, &mask).unwrap();
    let (naive, _) = probe.finish();
    drop(o);
    let naive = naive.unwrap();

    eprintln!("scores {scores_bytes} B · fused peak growth {fused} B · naive {naive} B ({method})");
    assert!(naive >= scores_bytes, "the probe must see the naive path's scores: {naive} < {scores_bytes}");
    assert!(fused < scores_bytes / 16, "fused attention grew by {fused} B, not far below the {scores_bytes} B score matrix");
}
