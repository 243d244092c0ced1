//! The CPU kernels (the GEMM-tile kernel `attention` runs, and the row-wise one kept as its
//! twin) against the materialised slow twin (stage 1's attention, which writes the scores), on
//! random shapes: T = 1, T below one tile, T not a multiple of the tiles, d_head 16/32/64/80/128,
//! causal and not, f32, bf16 and f16, contiguous inputs and stage 3's strided QKV views.

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

/// q, k, v of shape (B, T, n_head, d_head): contiguous tensors (stage 2's layout), or views of
/// one (B, T, 3, n_head, d_head) tensor (stage 3's QKV GEMM output, strides (3·T·C, 3·C, d, 1)).
fn inputs(dims: (usize, usize, usize, usize), seed: u64, strided: bool) -> [Tensor; 3] {
    use candle_core::IndexOp;
    let (b, t, h, d) = dims;
    if !strided {
        return [randn(dims, seed), randn(dims, seed + 1), randn(dims, seed + 2)];
    }
    let qkv = Tensor::from_vec(SplitMix64::new(seed).normals(b * t * 3 * h * d), (b, t, 3, h, d), &Device::Cpu).unwrap();
    let [q, k, v] = [0, 1, 2].map(|i| qkv.i((.., .., i)).unwrap());
    assert_eq!(q.stride(), [t * 3 * h * d, 3 * h * d, d, 1]);
    [q, k, v]
}

fn check(b: usize, t: usize, h: usize, d: usize, causal: bool, seed: u64) {
    for strided in [false, true] {
        check_layout(b, t, h, d, causal, seed, strided);
    }
}

fn check_layout(b: usize, t: usize, h: usize, d: usize, causal: bool, seed: u64, strided: bool) {
    use stage2_sdpa::attention::{attention_cpu, CpuKernel};
    let dims = (b, t, h, d);
    let [q, k, v] = inputs(dims, seed, strided);
    let want = twin(&q.contiguous().unwrap(), &k.contiguous().unwrap(), &v.contiguous().unwrap(), causal);
    for kernel in [CpuKernel::GemmTiles, CpuKernel::Registers, CpuKernel::RowAxpy] {
        let case = format!("{kernel:?} {dims:?} causal={causal} strided={strided}");
        // f32: the same arithmetic up to summation order.
        let fused = attention_cpu(kernel, &q, &k, &v, causal).unwrap();
        assert_eq!(fused.dims(), q.dims());
        let e = rel_err(&fused, &want);
        assert!(e < 1e-5, "f32 {case}: rel err {e}");
        // bf16 and f16 inputs: the kernel widens them and accumulates in f32, so against the f32
        // twin on the same (rounded) values it differs only by the final rounding of the output.
        for (dt, tol) in [(DType::BF16, 8e-3), (DType::F16, 1e-3)] {
            let low = |x: &Tensor| x.to_dtype(dt).unwrap();
            let up = |x: &Tensor| low(x).to_dtype(DType::F32).unwrap();
            let fused = attention_cpu(kernel, &low(&q), &low(&k), &low(&v), causal).unwrap();
            assert_eq!(fused.dtype(), dt);
            let e = rel_err(&fused.to_dtype(DType::F32).unwrap(), &twin(&up(&q), &up(&k), &up(&v), causal));
            assert!(e < tol, "{dt:?} {case}: rel err {e}");
        }
    }
    // `attention` is the register-blocked kernel.
    let fused = stage2_sdpa::attention(&q, &k, &v, causal).unwrap();
    assert_eq!(
        fused.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
        attention_cpu(CpuKernel::Registers, &q, &k, &v, causal).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap()
    );
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 32, ..ProptestConfig::default() })]

    #[test]
    fn fused_matches_slow_twin(
        b in 1usize..3,
        t in prop_oneof![Just(1usize), 2usize..70, 70usize..300],
        h in 1usize..4,
        d in prop_oneof![Just(16usize), Just(32), Just(64), Just(80), Just(96), Just(128)],
        causal in any::<bool>(),
        seed in 0u64..1000,
    ) {
        check(b, t, h, d, causal, seed);
    }
}

#[test]
fn tile_edges() {
    use stage2_sdpa::attention::{registers, BC, BR, ROW_BC, ROW_BR};
    let mr = registers::MR;
    for t in [1, mr - 1, mr + 1, ROW_BR + 1, ROW_BC + 1, BR - 1, BR, BR + 1, BC - 1, BC, BC + 1, BC + BR + 3, 2 * registers::BC + mr + 1] {
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
