//! Stage 3's training GEMMs on CUDA without a GPU: the arguments `gemm_args` builds for them
//! (fc1's forward with GELU_AUX_BIAS; every linear's weight gradient with BGRADB; fc2's data
//! gradient with DGELU_BGRAD, fc1's without) are executed by `cublaslt_model` on
//! the buffers the CUDA path hands over — W, x and dy as stored, fc1's aux output as fc2's aux
//! input, fc2's dz output as fc1's dz — and every result must equal candle's autograd of the plain
//! function (stage 0's `linear` and `gelu_tanh`: the slow twin): dx, dW₁, db₁, dz₁, dW₂, db₂.
//! Random non-square shapes prove which operand each BGRAD reduction runs over and along which
//! axis the bias gradient lies.

use candle_core::{DType, Device, Tensor, Var};
use cublaslt_model::{matmul_ex, DataType, Epilogue};
use proptest::prelude::*;
use stage3_fused::gemm_args::{dgrad_args, linear_args, wgrad_args, LinearKind};

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

/// ‖got − want‖ / ‖want‖.
fn rel_err(got: &[f32], want: &Tensor) -> f64 {
    let want: Vec<f32> = want.flatten_all().unwrap().to_vec1().unwrap();
    assert_eq!(got.len(), want.len());
    let num: f64 = got.iter().zip(&want).map(|(a, b)| (*a as f64 - *b as f64).powi(2)).sum();
    let den: f64 = want.iter().map(|b| (*b as f64).powi(2)).sum();
    (num / den.max(1e-30)).sqrt()
}

/// The chain rounds h, z and dz₁ to the GEMM's type on the way (as the GPU stores them), so the
/// errors are a few of that type's roundings (measured up to 2.6e-3 at bf16, 3.3e-4 at f16); f32
/// differs by the order of summation and f32 roundings only (measured 3e-7).
fn tolerance(dtype: DataType) -> f64 {
    match dtype {
        DataType::Bf16 => 1e-2,
        DataType::F16 => 1.5e-3,
        _ => 1e-5,
    }
}

/// y = gelu_tanh(x W₁ᵀ + b₁) W₂ᵀ + b₂ with upstream gradient dy: the model executing the CUDA
/// path's six GEMMs against candle's autograd of stage 0's ops. Returns the relative error of
/// (dx, dW₁, db₁, dz₁, dW₂, db₂).
fn mlp(bsz: usize, t: usize, c: usize, ff: usize, dtype: DataType, seed: u64) -> [(&'static str, f64); 6] {
    let m = bsz * t;
    let (x, w1, b1) = (values(m * c, seed, dtype), values(ff * c, seed + 1, dtype), values(ff, seed + 2, dtype));
    let (w2, b2, dy) = (values(c * ff, seed + 3, dtype), values(c, seed + 4, dtype), values(m * c, seed + 5, dtype));
    let one = (1.0, 1.0);

    // Forward, fc1: h = gelu(z), z = x W₁ᵀ + b₁ kept in the aux matrix (both (M, FF) row-major).
    let fwd = matmul_ex(&linear_args(m, c, ff, dtype, LinearKind::BiasGeluAux), &w1, &x, None, Some(&b1), None, one).unwrap();
    let (h, z) = (fwd.d, fwd.aux.expect("GELU_AUX_BIAS writes z"));
    // Backward, fc2's weight gradient with BGRADB: A = h, B = dy → dW₂ (C, FF), db₂ (C).
    let g2 = matmul_ex(&wgrad_args(m, ff, c, dtype, true), &h, &dy, None, None, None, one).unwrap();
    // fc2's data gradient with DGELU_BGRAD: A = W₂, B = dy, aux = z → dz₁ (M, FF), db₁ (FF).
    let d2 = matmul_ex(&dgrad_args(m, ff, c, dtype, true), &w2, &dy, None, None, Some(&z), one).unwrap();
    let dz1 = &d2.d;
    // fc1's weight and data gradients from dz₁ (db₁ came out of the GEMM above).
    let g1 = matmul_ex(&wgrad_args(m, c, ff, dtype, false), &x, dz1, None, None, None, one).unwrap();
    let d1 = matmul_ex(&dgrad_args(m, c, ff, dtype, false), &w1, dz1, None, None, None, one).unwrap();

    // The slow twin: candle's autograd through stage 0's plain ops, in f32 on the same values.
    let dev = Device::Cpu;
    let var = |v: &[f32], shape: &[usize]| Var::from_tensor(&Tensor::from_vec(v.to_vec(), shape, &dev).unwrap()).unwrap();
    let (xv, w1v, b1v) = (var(&x, &[bsz, t, c]), var(&w1, &[ff, c]), var(&b1, &[ff]));
    let (w2v, b2v) = (var(&w2, &[c, ff]), var(&b2, &[c]));
    let zt = stage0_baseline::linear(xv.as_tensor(), w1v.as_tensor(), b1v.as_tensor()).unwrap(); // (B, T, FF)
    let ht = stage0_baseline::gelu_tanh(&zt).unwrap();
    let y = stage0_baseline::linear(&ht, w2v.as_tensor(), b2v.as_tensor()).unwrap(); // (B, T, C)
    let dyt = Tensor::from_vec(dy, (bsz, t, c), &dev).unwrap();
    let grads = (y * &dyt).unwrap().sum_all().unwrap().backward().unwrap();
    let g = |t: &Tensor| grads.get(t).unwrap().to_dtype(DType::F32).unwrap();
    // dz₁ = ∂loss/∂z: the same function from z on (candle keeps no gradient of an intermediate).
    let zv = Var::from_tensor(&zt.detach()).unwrap();
    let y_of_z = stage0_baseline::linear(&stage0_baseline::gelu_tanh(zv.as_tensor()).unwrap(), w2v.as_tensor(), b2v.as_tensor()).unwrap();
    let dz_want = (y_of_z * &dyt).unwrap().sum_all().unwrap().backward().unwrap().get(zv.as_tensor()).unwrap().clone();
    [
        ("dx", rel_err(&d1.d, &g(xv.as_tensor()))),
        ("dW1", rel_err(&g1.d, &g(w1v.as_tensor()))),
        ("db1", rel_err(d2.bias_grad.as_deref().expect("DGELU_BGRAD writes db1"), &g(b1v.as_tensor()))),
        ("dz1", rel_err(dz1, &dz_want)),
        ("dW2", rel_err(&g2.d, &g(w2v.as_tensor()))),
        ("db2", rel_err(g2.bias_grad.as_deref().expect("BGRADB writes db2"), &g(b2v.as_tensor()))),
    ]
}

/// One linear's backward (qkv, proj, fc2 outside the pairing): dW and db from the weight-gradient
/// GEMM with BGRADB, dx from the data-gradient GEMM. Returns the errors of (dx, dW, db).
fn linear(bsz: usize, t: usize, k: usize, n: usize, dtype: DataType, seed: u64) -> [(&'static str, f64); 3] {
    let m = bsz * t;
    let (x, w, b, dy) =
        (values(m * k, seed, dtype), values(n * k, seed + 1, dtype), values(n, seed + 2, dtype), values(m * n, seed + 3, dtype));
    let one = (1.0, 1.0);
    let g = matmul_ex(&wgrad_args(m, k, n, dtype, true), &x, &dy, None, None, None, one).unwrap();
    let d = matmul_ex(&dgrad_args(m, k, n, dtype, false), &w, &dy, None, None, None, one).unwrap();
    let dev = Device::Cpu;
    let var = |v: &[f32], shape: &[usize]| Var::from_tensor(&Tensor::from_vec(v.to_vec(), shape, &dev).unwrap()).unwrap();
    let (xv, wv, bv) = (var(&x, &[bsz, t, k]), var(&w, &[n, k]), var(&b, &[n]));
    let y = stage0_baseline::linear(xv.as_tensor(), wv.as_tensor(), bv.as_tensor()).unwrap();
    let loss = (y * Tensor::from_vec(dy, (bsz, t, n), &dev).unwrap()).unwrap().sum_all().unwrap();
    let grads = loss.backward().unwrap();
    let gr = |t: &Tensor| grads.get(t).unwrap().clone();
    [
        ("dx", rel_err(&d.d, &gr(xv.as_tensor()))),
        ("dW", rel_err(&g.d, &gr(wv.as_tensor()))),
        ("db", rel_err(g.bias_grad.as_deref().expect("BGRADB writes db"), &gr(bv.as_tensor()))),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 16, ..ProptestConfig::default() })]
    /// FF a multiple of 8 (the aux matrix's leading dimension), everything else free.
    #[test]
    fn mlp_backward_through_the_model_matches_autograd(
        bsz in 1usize..3, t in 5usize..70, c in 8usize..90, ff8 in 2usize..24,
        dtype in prop::sample::select(vec![DataType::F32, DataType::Bf16, DataType::F16]),
        seed in 0u64..1000,
    ) {
        for (what, e) in mlp(bsz, t, c, 8 * ff8, dtype, seed) {
            prop_assert!(e < tolerance(dtype), "{what} {dtype:?} B={bsz} T={t} C={c} FF={}: rel err {e:.2e}", 8 * ff8);
        }
    }

    #[test]
    fn linear_backward_through_the_model_matches_autograd(
        bsz in 1usize..3, t in 5usize..70, k in 3usize..90, n in 3usize..90,
        dtype in prop::sample::select(vec![DataType::F32, DataType::Bf16, DataType::F16]),
        seed in 0u64..1000,
    ) {
        for (what, e) in linear(bsz, t, k, n, dtype, seed) {
            prop_assert!(e < tolerance(dtype), "{what} {dtype:?} B={bsz} T={t} K={k} N={n}: rel err {e:.2e}");
        }
    }
}

/// One token, one feature, and shapes where M, K, N and FF all differ.
#[test]
fn edges() {
    for (bsz, t, c, ff) in [(1, 1, 1, 8), (2, 3, 5, 16), (1, 37, 24, 8), (3, 7, 64, 40)] {
        for (what, e) in mlp(bsz, t, c, ff, DataType::F32, 11) {
            assert!(e < 1e-5, "{what} B={bsz} T={t} C={c} FF={ff}: {e:.2e}");
        }
    }
}

/// Reducing the wrong operand is caught: BGRADA on the weight-gradient GEMM sums x (over tokens,
/// one value per input feature) instead of dy. At K ≠ N the model refuses the length; at K = N it
/// runs, and the result is not db.
#[test]
fn bgrad_of_the_wrong_operand_is_caught() {
    let (m, k, n) = (24, 16, 16);
    let dt = DataType::F32;
    let (x, dy) = (values(m * k, 1, dt), values(m * n, 2, dt));
    let mut args = wgrad_args(m, k, n, dt, true);
    args.epilogue = Epilogue::BgradA;
    let wrong = matmul_ex(&args, &x, &dy, None, None, None, (1.0, 1.0)).unwrap().bias_grad.unwrap();
    let db: Vec<f32> = (0..n).map(|j| (0..m).map(|i| dy[i * n + j]).sum()).collect(); // Σ_tokens dy, row-major dy
    let right = matmul_ex(&wgrad_args(m, k, n, dt, true), &x, &dy, None, None, None, (1.0, 1.0)).unwrap().bias_grad.unwrap();
    assert!(right.iter().zip(&db).all(|(a, b)| (a - b).abs() < 1e-4), "BGRADB is Σ_tokens dy");
    assert!(wrong.iter().zip(&db).any(|(a, b)| (a - b).abs() > 1e-2), "BGRADA's sum is another vector");
    let mut args = wgrad_args(m, 16, 24, dt, true);
    args.epilogue = Epilogue::BgradA;
    assert!(matmul_ex(&args, &values(m * 16, 1, dt), &values(m * 24, 2, dt), None, None, None, (1.0, 1.0)).is_err());
}

/// The aux matrix's leading dimension must be a multiple of 8 (FF = 12 is refused), and
/// DGELU_BGRAD refuses to run without the forward's aux.
#[test]
fn aux_rules_are_enforced() {
    let dt = DataType::Bf16;
    let (m, c, ff) = (16, 8, 12);
    let fwd = linear_args(m, c, ff, dt, LinearKind::BiasGeluAux);
    let err = matmul_ex(&fwd, &values(ff * c, 1, dt), &values(m * c, 2, dt), None, Some(&values(ff, 3, dt)), None, (1.0, 1.0));
    assert!(err.unwrap_err().contains("multiple of 8"));
    let bwd = dgrad_args(m, 16, c, dt, true);
    let err = matmul_ex(&bwd, &values(c * 16, 1, dt), &values(m * c, 2, dt), None, None, None, (1.0, 1.0));
    assert!(err.unwrap_err().contains("aux"));
}
