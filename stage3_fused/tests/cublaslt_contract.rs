//! Stage 3's cuBLASLt GEMMs without a GPU: the arguments `gemm_args::linear_args` builds (the
//! ones `cuda.rs` passes to cuBLASLt) are executed by `cublaslt_model`, a CPU model of
//! cuBLASLt's documented contract, on the buffers the CUDA path hands over (W and x as stored,
//! the residual in D's buffer), and the model's D must equal each op's slow twin (stage 0's
//! plain ops). Random non-square shapes prove the row/column-major mapping, the transposes,
//! the leading dimensions, the bias axis and the residual through C.

use candle_core::{Device, Tensor};
use cublaslt_model::{matmul, matmul_ex, DataType};
use proptest::prelude::*;
use stage3_fused::gemm_args::{linear_args, LinearKind};

fn values(len: usize, seed: u64, dtype: DataType) -> Vec<f32> {
    let mut s = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    (0..len)
        .map(|_| {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            let u = (s >> 40) as f32 / (1u64 << 24) as f32; // [0, 1)
            dtype.round((u - 0.5) as f64 * 2.0) as f32 // values in the GEMM's type, as the GPU holds them
        })
        .collect()
}

fn rel_err(got: &[f32], want: &[f32]) -> f64 {
    let num: f64 = got.iter().zip(want).map(|(a, b)| (*a as f64 - *b as f64).powi(2)).sum();
    let den: f64 = want.iter().map(|b| (*b as f64).powi(2)).sum();
    (num / den).sqrt()
}

/// Model D (column-major N × M = row-major M × N) vs the slow twin, for one shape; with
/// GELU_AUX_BIAS also the aux (z = x Wᵀ + b) vs the twin's pre-activation, N rounded up to a
/// multiple of 8 (the aux's leading dimension must be).
fn check(bsz: usize, t: usize, k: usize, n: usize, kind: LinearKind, dtype: DataType, seed: u64) -> f64 {
    let m = bsz * t;
    let n = if kind == LinearKind::BiasGeluAux { n.next_multiple_of(8) } else { n };
    let (x, w, b, r) =
        (values(m * k, seed, dtype), values(n * k, seed + 1, dtype), values(n, seed + 2, dtype), values(m * n, seed + 3, dtype));
    let args = linear_args(m, k, n, dtype, kind);
    // The CUDA path's buffers: A = W as stored, B = x as stored, C = D = out (holding r when fused).
    let c = (kind == LinearKind::BiasResidualInC).then_some(&r[..]);
    let out = matmul_ex(&args, &w, &x, c, Some(&b), None, (1.0, 1.0)).unwrap();
    // The slow twin, in f32 on the same values.
    let dev = Device::Cpu;
    let xt = Tensor::from_vec(x, (bsz, t, k), &dev).unwrap();
    let wt = Tensor::from_vec(w, (n, k), &dev).unwrap();
    let bt = Tensor::from_vec(b, n, &dev).unwrap();
    let z = stage0_baseline::linear(&xt, &wt, &bt).unwrap();
    let y = match kind {
        LinearKind::Bias => z.clone(),
        LinearKind::BiasGelu | LinearKind::BiasGeluAux => stage0_baseline::gelu_tanh(&z).unwrap(),
        LinearKind::BiasResidualInC => (&z + Tensor::from_vec(r, (bsz, t, n), &dev).unwrap()).unwrap(),
    };
    let flat = |t: &Tensor| -> Vec<f32> { t.flatten_all().unwrap().to_vec1().unwrap() };
    let e = rel_err(&out.d, &flat(&y));
    match (kind, out.aux) {
        (LinearKind::BiasGeluAux, Some(aux)) => e.max(rel_err(&aux, &flat(&z))),
        (LinearKind::BiasGeluAux, None) => panic!("GELU_AUX_BIAS wrote no aux"),
        _ => e,
    }
}

/// D is rounded to its type: bf16 keeps 8 significant bits (~2e-3 relative), f16 11; f32 differs
/// only by the order of summation.
fn tolerance(dtype: DataType) -> f64 {
    match dtype {
        DataType::Bf16 => 8e-3,
        DataType::F16 => 1e-3,
        _ => 1e-5,
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]
    #[test]
    fn model_of_the_cuda_arguments_matches_the_twin(
        bsz in 1usize..3, t in 16usize..160, k in 16usize..320, n in 16usize..320,
        kind in prop::sample::select(vec![LinearKind::Bias, LinearKind::BiasGelu, LinearKind::BiasResidualInC, LinearKind::BiasGeluAux]),
        dtype in prop::sample::select(vec![DataType::F32, DataType::Bf16, DataType::F16]),
        seed in 0u64..1000,
    ) {
        let e = check(bsz, t, k, n, kind, dtype, seed);
        prop_assert!(e < tolerance(dtype), "{kind:?} {dtype:?} B={bsz} T={t} K={k} N={n}: rel err {e:.2e}");
    }
}

/// The edges of the range, every kind.
#[test]
fn edges() {
    for (bsz, t, k, n) in [(1, 16, 16, 16), (2, 17, 300, 16), (1, 300, 16, 301), (3, 16, 31, 47)] {
        for kind in [LinearKind::Bias, LinearKind::BiasGelu, LinearKind::BiasResidualInC, LinearKind::BiasGeluAux] {
            let e = check(bsz, t, k, n, kind, DataType::F32, 7);
            assert!(e < 1e-5, "{kind:?} B={bsz} T={t} K={k} N={n}: {e:.2e}");
        }
    }
}

/// The model is not a mirror of the builder: swapping the transposes (a real mistake) is caught.
#[test]
fn a_wrong_transpose_is_caught() {
    let (m, k, n) = (32, 48, 64);
    let mut args = linear_args(m, k, n, DataType::F32, LinearKind::Bias);
    args.transa = false;
    let (w, x, b) = (values(n * k, 1, DataType::F32), values(m * k, 2, DataType::F32), values(n, 3, DataType::F32));
    assert!(matmul(&args, &w, &x, None, Some(&b), (1.0, 1.0)).is_err(), "A's layout no longer fits op(A)");
}
