//! Stage 4's FP8 training GEMMs without a GPU: the arguments `gemm::fp8_grad_args` builds for the
//! HYBRID backward (the ones `cuda.rs` turns into cuBLASLt descriptors: TN layouts, E4M3 × E5M2,
//! which operand's scale goes to which pointer, bf16 dX and f32 dW) are executed by
//! `cublaslt_model` on the buffers the CUDA path hands over — Wᵀ and Xᵀ as E4M3 codes, dY and
//! dYᵀ as E5M2 codes, each with its scale — and dX and dW must equal the CPU emulation of the
//! recipe (`hybrid::linear_bwd_hybrid`) on the same operands. Random shapes, ragged ones (not
//! multiples of 16: the layouts hold for any shape; cuBLASLt's FP8 kernels then refuse them,
//! and so does `fp8_grad_args`) among them; every mutation of the arguments must fail.

use candle_core::{DType, Device, Tensor};
use cublaslt_model::{matmul, DataType, Epilogue};
use proptest::prelude::*;
use stage4_fp8::fp8::round_e4m3;
use stage4_fp8::gemm::{fp8_grad_args, fp8_grad_layout, Fp8Grad, Fp8GradArgs, Fp8Operand, ScaleOf};
use stage4_fp8::hybrid::{linear_bwd_hybrid, round_e5m2, E5M2_MAX};

/// Uniform values in (−a, a), from a seeded LCG.
fn uniform(len: usize, a: f32, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    (0..len)
        .map(|_| {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 2.0 * a
        })
        .collect()
}

/// (rows, cols) row-major → (cols, rows) row-major: the transposed copies the CUDA path makes.
fn transpose(v: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    (0..cols * rows).map(|i| v[(i % rows) * cols + i / rows]).collect()
}

/// One linear's backward operands, as the training step holds them: E4M3 codes of x (M, K) and
/// W (N, K) with their current scales, E5M2 codes of dY (M, N) with its current scale (the
/// emulation's rule, amax / 57344), and the f32 values s·q the emulation reads.
struct Problem {
    m: usize,
    k: usize,
    n: usize,
    qx: Vec<f32>,
    qw: Vec<f32>,
    qdy: Vec<f32>,
    sx: f32,
    sw: f32,
    sdy: f32,
    dy: Vec<f32>,
}

impl Problem {
    fn new(m: usize, k: usize, n: usize, seed: u64) -> Problem {
        // x's and W's scales 20x apart and dY's far smaller (a gradient's size), so a scale read
        // from the wrong pointer is an O(1) error. A few dY values 10³ times the rest: E5M2's
        // range keeps both.
        let (x, w) = (uniform(m * k, 2.0, seed), uniform(n * k, 0.1, seed + 1));
        let mut dy = uniform(m * n, 1e-4, seed + 2);
        for v in dy.iter_mut().step_by(7) {
            *v *= 1e3;
        }
        let amax = |v: &[f32]| v.iter().fold(0f32, |a, x| a.max(x.abs()));
        let (sx, sw) = (amax(&x).max(f32::MIN_POSITIVE) / 448.0, amax(&w).max(f32::MIN_POSITIVE) / 448.0);
        let sdy = amax(&dy).max(f32::MIN_POSITIVE) / E5M2_MAX;
        let codes = |v: &[f32], s: f32, round: fn(f32) -> f32| v.iter().map(|x| round(x / s)).collect::<Vec<f32>>();
        Problem { m, k, n, qx: codes(&x, sx, round_e4m3), qw: codes(&w, sw, round_e4m3), qdy: codes(&dy, sdy, round_e5m2), sx, sw, sdy, dy }
    }

    /// The buffer the CUDA path passes for `op` (`cuda::fp8_grad_gemm` reads the same tensors).
    fn buffer(&self, op: Fp8Operand) -> Vec<f32> {
        let (m, k, n) = (self.m, self.k, self.n);
        match op {
            Fp8Operand::WeightT => transpose(&self.qw, n, k), // (K, N)
            Fp8Operand::InputT => transpose(&self.qx, m, k),  // (K, M)
            Fp8Operand::Grad => self.qdy.clone(),             // (M, N)
            Fp8Operand::GradT => transpose(&self.qdy, m, n),  // (N, M)
        }
    }

    fn scale(&self, s: ScaleOf) -> f32 {
        match s {
            ScaleOf::Weight => self.sw,
            ScaleOf::Input => self.sx,
            ScaleOf::Grad => self.sdy,
        }
    }

    /// The emulation's (dX (M, K), dW (N, K)) on the same operands, f32 row-major.
    fn emulated(&self) -> (Vec<f32>, Vec<f32>) {
        let dev = Device::Cpu;
        let sq = |q: &[f32], s: f32, shape: &[usize]| Tensor::from_vec(q.iter().map(|q| q * s).collect::<Vec<f32>>(), shape, &dev).unwrap();
        let xq = sq(&self.qx, self.sx, &[1, self.m, self.k]);
        let wq = sq(&self.qw, self.sw, &[self.n, self.k]);
        let dy = Tensor::from_vec(self.dy.clone(), (1, self.m, self.n), &dev).unwrap();
        let (dx, dw, _) = linear_bwd_hybrid(&xq, &wq, &dy, 0).unwrap(); // dY's scale current, margin 0: `sdy`
        let host = |t: Tensor| t.to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
        (host(dx), host(dw))
    }
}

/// How a test breaks the CUDA path's arguments: each is a bug the model must expose.
#[derive(Clone, Copy, Debug)]
enum Mutation {
    /// B transposed too (NT): not TN.
    NotTn,
    /// The weight passed as stored (N, K) instead of its transposed copy.
    WeightNotTransposed,
    /// dY passed as stored (M, N) to the dW GEMM instead of its transposed copy.
    GradNotTransposed,
    /// The scale pointers unset: D lacks s_A·s_B.
    NoScales,
    /// The gradient's scale missing (1 in its pointer).
    GradScaleOne,
    /// A's scale pointer given the other forward operand's scale (s_x for Wᵀ, s_w for Xᵀ).
    WrongWeightScale,
    /// The E4M3 operand typed E5M2 (E5M2 × E5M2).
    BothE5m2,
    /// A bias epilogue set where the backward GEMMs have none (the bias gradient is Σ dY apart).
    BiasEpilogue,
    /// dW stored bf16 instead of f32 (the master weights' gradient rounded to 8 bits).
    WeightGradInBf16,
}

/// ‖got − want‖ / ‖want‖.
fn rel_err(got: &[f32], want: &[f32]) -> f64 {
    assert_eq!(got.len(), want.len());
    let num: f64 = got.iter().zip(want).map(|(a, b)| (*a as f64 - *b as f64).powi(2)).sum();
    let den: f64 = want.iter().map(|b| (*b as f64).powi(2)).sum();
    (num / den.max(1e-300)).sqrt()
}

/// Runs `args` (mutated) through the model on `p`'s buffers: D as f32 values, row-major, or
/// the model's refusal.
fn run(p: &Problem, args: &Fp8GradArgs, mutation: Option<Mutation>) -> Result<Vec<f32>, String> {
    let mut contract = args.contract();
    let (mut a, mut b) = (p.buffer(args.a), p.buffer(args.b));
    let (mut sa, mut sb) = (p.scale(args.a.scale()), p.scale(args.b.scale()));
    match mutation {
        None => {}
        Some(Mutation::NotTn) => contract.transb = true,
        Some(Mutation::WeightNotTransposed) if args.a == Fp8Operand::WeightT => a = p.qw.clone(),
        Some(Mutation::GradNotTransposed) if args.b == Fp8Operand::GradT => b = p.qdy.clone(),
        Some(Mutation::WeightNotTransposed | Mutation::GradNotTransposed) => {} // the other GEMM reads no such copy
        Some(Mutation::NoScales) => contract.scaled = false,
        Some(Mutation::GradScaleOne) => sb = 1.0,
        Some(Mutation::WrongWeightScale) => sa = p.scale(if args.a.scale() == ScaleOf::Weight { ScaleOf::Input } else { ScaleOf::Weight }),
        Some(Mutation::BothE5m2) => contract.a.dtype = DataType::E5m2,
        Some(Mutation::BiasEpilogue) => (contract.epilogue, contract.bias_len) = (Epilogue::Bias, args.m),
        Some(Mutation::WeightGradInBf16) if args.grad == Fp8Grad::Weight => {
            (contract.c.dtype, contract.d.dtype) = (DataType::Bf16, DataType::Bf16);
        }
        Some(Mutation::WeightGradInBf16) => {}
    }
    matmul(&contract, &a, &b, None, None, (sa, sb))
}

/// Tolerances against the emulation, whose f32 GEMMs read s·q where the model reads q and
/// multiplies s_A·s_B in at the end (f32 roundings apart, ~1e-6): dX is stored bf16 (2⁻⁹
/// relative per value, ~2e-3 in the norm), dW f32.
const DX_TOL: f64 = 5e-3;
const DW_TOL: f64 = 1e-5;

/// (dX's, dW's) relative errors of the arguments against the emulation at (M, K, N).
fn errors(args: [Fp8GradArgs; 2], p: &Problem, mutation: Option<Mutation>) -> [Result<f64, String>; 2] {
    let (dx, dw) = p.emulated();
    let [data, weight] = args;
    [run(p, &data, mutation).map(|d| rel_err(&d, &dx)), run(p, &weight, mutation).map(|d| rel_err(&d, &dw))]
}

fn layouts(m: usize, k: usize, n: usize) -> [Fp8GradArgs; 2] {
    [fp8_grad_layout(Fp8Grad::Data, m, k, n), fp8_grad_layout(Fp8Grad::Weight, m, k, n)]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]
    /// Any shape, ragged ones included (the layouts do not depend on alignment).
    #[test]
    fn the_training_gemm_arguments_compute_the_hybrid_backward(m in 1usize..70, k in 1usize..70, n in 1usize..70, seed in 0u64..1000) {
        let p = Problem::new(m, k, n, seed);
        let [ex, ew] = errors(layouts(m, k, n), &p, None);
        let (ex, ew) = (ex.map_err(TestCaseError::fail)?, ew.map_err(TestCaseError::fail)?);
        prop_assert!(ex < DX_TOL && ew < DW_TOL, "M={m} K={k} N={n}: dX {ex:.2e}, dW {ew:.2e}");
    }

    /// The shapes cuBLASLt runs: multiples of 16, through the checked builder.
    #[test]
    fn the_checked_arguments_compute_the_hybrid_backward(m in 1usize..8, k in 1usize..8, n in 1usize..8, seed in 0u64..1000) {
        let (m, k, n) = (16 * m, 16 * k, 16 * n);
        let args = [fp8_grad_args(Fp8Grad::Data, m, k, n).unwrap(), fp8_grad_args(Fp8Grad::Weight, m, k, n).unwrap()];
        prop_assert_eq!(args, layouts(m, k, n));
        let [ex, ew] = errors(args, &Problem::new(m, k, n, seed), None);
        let (ex, ew) = (ex.map_err(TestCaseError::fail)?, ew.map_err(TestCaseError::fail)?);
        prop_assert!(ex < DX_TOL && ew < DW_TOL, "M={m} K={k} N={n}: dX {ex:.2e}, dW {ew:.2e}");
    }
}

/// The layouts of both GEMMs spelled out at one ragged shape, and what the checked builder
/// refuses.
#[test]
fn the_layouts_are_tn_with_the_transposed_copies() {
    let (m, k, n) = (40, 24, 56);
    let [data, weight] = layouts(m, k, n);
    assert!(data.transa && !data.transb && weight.transa && !weight.transb, "FP8 takes TN only");
    // dX (M, K) = K × M column-major: m = K, n = M, k = N; A = Wᵀ (K, N) = N × K column-major
    assert_eq!((data.m, data.n, data.k), (24, 40, 56));
    assert_eq!((data.a, data.a_rows, data.a_cols, data.lda), (Fp8Operand::WeightT, 56, 24, 56));
    assert_eq!((data.b, data.b_rows, data.b_cols, data.ldb), (Fp8Operand::Grad, 56, 40, 56));
    assert_eq!((data.d, data.ldd), (DataType::Bf16, 24));
    // dW (N, K) = K × N column-major: m = K, n = N, k = M; A = Xᵀ (K, M), B = dYᵀ (N, M)
    assert_eq!((weight.m, weight.n, weight.k), (24, 56, 40));
    assert_eq!((weight.a, weight.lda, weight.b, weight.ldb), (Fp8Operand::InputT, 40, Fp8Operand::GradT, 40));
    assert_eq!((weight.d, weight.ldd), (DataType::F32, 24));
    // E4M3 × E5M2 in both, with the gradient's scale on B
    for a in [data, weight] {
        let c = a.contract();
        assert_eq!((c.a.dtype, c.b.dtype, a.b.scale()), (DataType::E4m3, DataType::E5m2, ScaleOf::Grad));
        assert!(c.scaled && c.beta == 0.0);
    }
    for (m, k, n, what) in [(40, 32, 32, "token count"), (32, 24, 32, "in features"), (32, 32, 56, "out features")] {
        for grad in [Fp8Grad::Data, Fp8Grad::Weight] {
            let e = fp8_grad_args(grad, m, k, n).unwrap_err();
            assert!(e.contains("multiple of 16") && e.contains(what) && e.contains("Fix:"), "{e}");
        }
    }
}

/// Every mutation fails, at a ragged shape where M, K and N differ and at a square one (where a
/// missing transpose still fits every layout): the model refuses it, or one of dX and dW is
/// beyond ten times its tolerance (measured: a bf16 dW 1.7e-3 against 1e-5, every other one O(1)
/// or refused). The unmutated arguments pass at both.
#[test]
fn every_mutation_of_the_arguments_is_caught() {
    use Mutation::*;
    for (m, k, n) in [(40, 24, 56), (32, 32, 32)] {
        let p = Problem::new(m, k, n, 7);
        let [ex, ew] = errors(layouts(m, k, n), &p, None);
        let (ex, ew) = (ex.unwrap(), ew.unwrap());
        assert!(ex < DX_TOL && ew < DW_TOL, "unmutated: dX {ex:.2e}, dW {ew:.2e}");
        for mutation in [
            NotTn,
            WeightNotTransposed,
            GradNotTransposed,
            NoScales,
            GradScaleOne,
            WrongWeightScale,
            BothE5m2,
            BiasEpilogue,
            WeightGradInBf16,
        ] {
            let [dx, dw] = errors(layouts(m, k, n), &p, Some(mutation));
            let caught = |r: &Result<f64, String>, tol: f64| r.as_ref().map_or(true, |e| *e > 10.0 * tol);
            assert!(caught(&dx, DX_TOL) || caught(&dw, DW_TOL), "{mutation:?} at M={m} K={k} N={n} passed: dX {dx:?}, dW {dw:?}");
            let show = |r: &Result<f64, String>| r.as_ref().map_or_else(|e| format!("refused ({e})"), |e| format!("{e:.2e}"));
            eprintln!("{mutation:?} at M={m} K={k} N={n}: dX {}, dW {}", show(&dx), show(&dw));
        }
    }
}
