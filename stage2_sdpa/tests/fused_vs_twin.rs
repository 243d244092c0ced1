//! The fused kernel against its slow twin (stage 1's attention, which materialises the
//! scores), on random shapes: T = 1, T below one tile, T not a multiple of the tiles, several
//! d_head, causal and not, f32 and bf16.

use candle_core::{DType, Device, Tensor};
use proptest::prelude::*;
use shared::weights::SplitMix64;

/// (B, T, n_head, d_head) of N(0, 1) values, as f32.
fn randn(dims: (usize, usize, usize, usize), seed: u64) -> Tensor {
    let n = dims.0 * dims.1 * dims.2 * dims.3;
    Tensor::from_vec(SplitMix64::new(seed).normals(n), dims, &Device::Cpu).unwrap()
}

/// ||a − b|| / ||b||, as the runner's check computes it.
fn rel_err(a: &Tensor, b: &Tensor) -> f64 {
    shared::check::compare(a, b, shared::Precision::Fp32).unwrap().rel_err
}

/// The slow twin on (B, T, n_head, d_head) inputs: stage 1's attention takes (B, T, C) and a
/// (T, T) additive mask — causal, or all zeros for non-causal.
fn twin(q: &Tensor, k: &Tensor, v: &Tensor, causal: bool) -> Tensor {
    let (b, t, h, d) = q.dims4().unwrap();
    let flat = |x: &Tensor| x.reshape((b, t, h * d)).unwrap();
    let mask = if causal {
        stage0_baseline::causal_mask(t, &Device::Cpu).unwrap()
    } else {
        Tensor::zeros((t, t), DType::F32, &Device::Cpu).unwrap()
    };
    stage1_tensorcore::attention(&flat(q), &flat(k), &flat(v), h, &mask).unwrap().reshape((b, t, h, d)).unwrap()
}

fn check(b: usize, t: usize, h: usize, d: usize, causal: bool, seed: u64) {
    let dims = (b, t, h, d);
    let (q, k, v) = (randn(dims, seed), randn(dims, seed + 1), randn(dims, seed + 2));
    // f32: the same arithmetic up to summation order.
    let fused = stage2_sdpa::attention(&q, &k, &v, causal).unwrap();
    assert_eq!(fused.dims(), q.dims());
    let e = rel_err(&fused, &twin(&q, &k, &v, causal));
    assert!(e < 1e-5, "f32 {dims:?} causal={causal}: rel err {e}");
    // bf16 inputs: the kernel widens them and accumulates in f32, so against the f32 twin on the
    // same (bf16-rounded) values it differs only by the final rounding of the output to bf16.
    let bf = |x: &Tensor| x.to_dtype(DType::BF16).unwrap();
    let up = |x: &Tensor| bf(x).to_dtype(DType::F32).unwrap();
    let fused = stage2_sdpa::attention(&bf(&q), &bf(&k), &bf(&v), causal).unwrap();
    assert_eq!(fused.dtype(), DType::BF16);
    let e = rel_err(&fused, &twin(&up(&q), &up(&k), &up(&v), causal));
    assert!(e < 8e-3, "bf16 {dims:?} causal={causal}: rel err {e}");
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn fused_matches_slow_twin(
        b in 1usize..3,
        t in prop_oneof![Just(1usize), 2usize..32, 33usize..200],
        h in 1usize..4,
        d in prop_oneof![Just(16usize), Just(32), Just(64), Just(80), Just(128)],
        causal in any::<bool>(),
        seed in 0u64..1000,
    ) {
        check(b, t, h, d, causal, seed);
    }
}

#[test]
fn tile_edges() {
    use stage2_sdpa::attention::{BC, BR};
    for t in [1, BR - 1, BR, BR + 1, BC - 1, BC, BC + 1, 2 * BC + 3] {
        for causal in [true, false] {
            check(1, t, 2, 64, causal, t as u64);
        }
    }
}

#[test]
fn causal_row_sees_only_the_past() {
    // Changing the last key/value must not change any output row but the last.
    let dims = (1, 70, 1, 16);
    let (q, k, v) = (randn(dims, 1), randn(dims, 2), randn(dims, 3));
    let o1 = stage2_sdpa::attention(&q, &k, &v, true).unwrap();
    let bump = |x: &Tensor| {
        let mut data = x.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let n = data.len();
        data[n - 16..].iter_mut().for_each(|x| *x += 5.0);
        Tensor::from_vec(data, dims, &Device::Cpu).unwrap()
    };
    let o2 = stage2_sdpa::attention(&q, &bump(&k), &bump(&v), true).unwrap();
    let rows = |o: &Tensor| o.reshape((70, 16)).unwrap().to_vec2::<f32>().unwrap();
    let (r1, r2) = (rows(&o1), rows(&o2));
    assert_eq!(r1[..69], r2[..69]);
    assert_ne!(r1[69], r2[69]);
}
