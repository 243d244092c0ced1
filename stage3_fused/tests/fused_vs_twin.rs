//! Every fused op against its slow twin beside it in `ops.rs` (plain candle ops) on random
//! shapes, including widths that are not multiples of a SIMD vector or of the GELU row block.

use candle_core::{DType, Device, Tensor};
use proptest::prelude::*;
use shared::weights::SplitMix64;
use stage3_fused::ops;

fn randn(dims: &[usize], seed: u64, std: f32) -> Tensor {
    let n = dims.iter().product();
    let v: Vec<f32> = SplitMix64::new(seed).normals(n).into_iter().map(|z| z * std).collect();
    Tensor::from_vec(v, dims, &Device::Cpu).unwrap()
}

/// ||a − b|| / ||b||, as the runner's check computes it.
fn rel_err(a: &Tensor, b: &Tensor) -> f64 {
    shared::check::compare(a, b, shared::Precision::Fp32).unwrap().rel_err
}

fn check_all(bsz: usize, t: usize, k: usize, n: usize, seed: u64) {
    let x = randn(&[bsz, t, k], seed, 1.0);
    let w = randn(&[n, k], seed + 1, 0.05);
    let b = randn(&[n], seed + 2, 0.05);
    let r = randn(&[bsz, t, n], seed + 3, 1.0);
    let (g, beta) = (randn(&[k], seed + 4, 0.1).affine(1.0, 1.0).unwrap(), randn(&[k], seed + 5, 0.1));
    let e = rel_err(&ops::linear_bias(&x, &w, &b).unwrap(), &ops::linear_bias_slow(&x, &w, &b).unwrap());
    assert!(e < 1e-5, "linear_bias {bsz}x{t}x{k}->{n}: {e}");
    let e = rel_err(&ops::linear_bias_gelu(&x, &w, &b).unwrap(), &ops::linear_bias_gelu_slow(&x, &w, &b).unwrap());
    assert!(e < 1e-5, "linear_bias_gelu {bsz}x{t}x{k}->{n}: {e}");
    let e = rel_err(&ops::linear_bias_residual(&x, &w, &b, &r).unwrap(), &ops::linear_bias_residual_slow(&x, &w, &b, &r).unwrap());
    assert!(e < 1e-5, "linear_bias_residual {bsz}x{t}x{k}->{n}: {e}");
    // The twins are stage 0's primitive ops, spelled out again beside the fused ops.
    let stage0 = stage0_baseline::gelu_tanh(&stage0_baseline::linear(&x, &w, &b).unwrap()).unwrap();
    assert_eq!(rel_err(&ops::linear_bias_gelu_slow(&x, &w, &b).unwrap(), &stage0), 0.0);

    let slow_ln = ops::layer_norm_slow(&x, &g, &beta, ops::LN_EPS, DType::F32).unwrap();
    let e = rel_err(&ops::layer_norm(&x, &g, &beta, ops::LN_EPS, DType::F32).unwrap(), &slow_ln);
    assert!(e < 1e-5, "layer_norm C={k}: {e}");
    let ln_bf16 = ops::layer_norm(&x, &g, &beta, ops::LN_EPS, DType::BF16).unwrap();
    assert_eq!(ln_bf16.dtype(), DType::BF16);
    assert!(rel_err(&ln_bf16, &slow_ln) < 4e-3, "layer_norm cast to bf16");

    let branch = randn(&[bsz, t, k], seed + 6, 0.5);
    let (x_new, h) = ops::add_layer_norm(&x, &branch, &g, &beta, ops::LN_EPS).unwrap();
    let (slow_x, slow_h) = ops::add_layer_norm_slow(&x, &branch, &g, &beta, ops::LN_EPS).unwrap();
    assert_eq!(rel_err(&x_new, &slow_x), 0.0, "the residual add is exact");
    let e = rel_err(&h, &slow_h);
    assert!(e < 1e-5, "add_layer_norm C={k}: {e}");
    // A bf16 branch: h comes out in bf16, x_new stays f32.
    let branch16 = branch.to_dtype(DType::BF16).unwrap();
    let (x16, h16) = ops::add_layer_norm(&x, &branch16, &g, &beta, ops::LN_EPS).unwrap();
    assert_eq!((x16.dtype(), h16.dtype()), (DType::F32, DType::BF16));
    let (slow_x16, slow_h16) = ops::add_layer_norm_slow(&x, &branch16, &g, &beta, ops::LN_EPS).unwrap();
    assert_eq!(rel_err(&x16, &slow_x16), 0.0);
    assert!(rel_err(&h16, &slow_h16) < 8e-3, "add_layer_norm, bf16 h");
    // bf16 operands: widened to f32 on the CPU, the output back in bf16.
    let (x_b, w_b, b_b) = (x.to_dtype(DType::BF16).unwrap(), w.to_dtype(DType::BF16).unwrap(), b.to_dtype(DType::BF16).unwrap());
    let y16 = ops::linear_bias_gelu(&x_b, &w_b, &b_b).unwrap();
    assert_eq!(y16.dtype(), DType::BF16);
    let twin16 = ops::linear_bias_gelu_slow(
        &x_b.to_dtype(DType::F32).unwrap(),
        &w_b.to_dtype(DType::F32).unwrap(),
        &b_b.to_dtype(DType::F32).unwrap(),
    )
    .unwrap();
    assert!(rel_err(&y16, &twin16) < 8e-3, "linear_bias_gelu in bf16");
    // Bias only, bf16 out: the bias added and each row narrowed in one pass after the GEMM.
    let y16 = ops::linear_bias(&x_b, &w_b, &b_b).unwrap();
    assert_eq!(y16.dtype(), DType::BF16);
    let wide = |t: &Tensor| t.to_dtype(DType::F32).unwrap();
    let twin16 = ops::linear_bias_slow(&wide(&x_b), &wide(&w_b), &wide(&b_b)).unwrap();
    assert!(rel_err(&y16, &twin16) < 8e-3, "linear_bias in bf16");
    // W packed once (`linear_prepacked`, as the block holds it): the same products as the op
    // that packs W per call, so the same outputs, for each epilogue; and near the slow twins.
    // An f32 W is not packed: the plain op.
    let r16 = r.clone(); // the residual stream stays f32
    for (wt, xt, bt) in [(&w_b, &x_b, &b_b), (&w, &x, &b)] {
        let pw = cpu_kernels::bf16_gemm::PackedWeight::new(wt).unwrap();
        let cases = [
            (ops::Epilogue::Bias, ops::linear_bias(xt, wt, bt).unwrap(), ops::linear_bias_slow(&wide(xt), &wide(wt), &wide(bt)).unwrap()),
            (
                ops::Epilogue::BiasGelu,
                ops::linear_bias_gelu(xt, wt, bt).unwrap(),
                ops::linear_bias_gelu_slow(&wide(xt), &wide(wt), &wide(bt)).unwrap(),
            ),
            (
                ops::Epilogue::BiasResidual(&r16),
                ops::linear_bias_residual(xt, wt, bt, &r16).unwrap(),
                ops::linear_bias_residual_slow(&wide(xt), &wide(wt), &wide(bt), &r16).unwrap(),
            ),
        ];
        for (epilogue, unpacked, twin) in cases {
            let got = ops::linear_prepacked(xt, &pw, bt, epilogue).unwrap();
            assert_eq!((got.dims(), got.dtype()), (unpacked.dims(), unpacked.dtype()));
            assert_eq!(rel_err(&wide(&got), &wide(&unpacked)), 0.0, "prepacked {:?} {bsz}x{t}x{k}->{n}", wt.dtype());
            assert!(rel_err(&got, &twin) < 8e-3, "prepacked {:?} vs slow twin {bsz}x{t}x{k}->{n}", wt.dtype());
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 32, ..ProptestConfig::default() })]

    #[test]
    fn fused_ops_match_slow_twins(
        bsz in 1usize..3,
        t in prop_oneof![Just(1usize), 2usize..40, 250usize..300],
        k in prop_oneof![Just(1usize), 2usize..20, Just(64), 65usize..140],
        n in prop_oneof![Just(1usize), 2usize..20, Just(96), 97usize..200],
        seed in 0u64..1000,
    ) {
        check_all(bsz, t, k, n, seed);
    }
}

#[test]
fn gelu_rewrite_matches_tanh_form() {
    // v / (1 + e^(−2u)) against 0.5·v·(1 + tanh(u)) over a wide range, including the tails.
    for i in -2000..=2000 {
        let v = i as f32 * 0.01;
        let u = 0.797_884_6f32 * (v + 0.044715 * v * v * v);
        let reference = 0.5 * v * (1.0 + u.tanh());
        let got = ops::gelu_tanh(v);
        assert!((got - reference).abs() <= 1e-6 * (1.0 + reference.abs()), "v={v}: {got} vs {reference}");
    }
    assert_eq!(ops::gelu_tanh(-100.0), 0.0);
    assert_eq!(ops::gelu_tanh(100.0), 100.0);
}

#[test]
fn shapes_that_do_not_fit_are_errors() {
    let x = randn(&[1, 2, 8], 1, 1.0);
    let w = randn(&[4, 7], 2, 1.0);
    let b = randn(&[4], 3, 1.0);
    assert!(ops::linear_bias(&x, &w, &b).unwrap_err().to_string().contains("do not fit"));
}

/// `qkv_attention` (training on the CPU: one op on the QKV output) against its twin, stage 2's
/// op on three views of the same tensor, differentiated by candle through the views: the same
/// forward bits, and the same gradient for qkv (both run the same backward kernel; only how dq,
/// dk and dv reach qkv's gradient differs), at f32 and with bf16 products, at head sizes 32, 64
/// and 80, T off the tiles, causal and not.
#[test]
fn qkv_attention_matches_attention_on_views() {
    use candle_core::{IndexOp, Var};
    use stage2_sdpa::attention::CpuKernel;
    for (i, &(bsz, t, n_head, d)) in [(2, 13, 3, 32), (1, 70, 2, 64), (2, 37, 2, 80)].iter().enumerate() {
        let c = n_head * d;
        let seed = 900 + 10 * i as u64;
        let (qkv0, dy) = (randn(&[bsz, t, 3 * c], seed, 1.0), randn(&[bsz, t, c], seed + 1, 1.0));
        for kernel in [CpuKernel::Registers, CpuKernel::RegistersBf16] {
            for causal in [true, false] {
                let run = |fused: bool| {
                    let qkv = Var::from_tensor(&qkv0).unwrap();
                    let y = if fused {
                        ops::qkv_attention(qkv.as_tensor(), n_head, kernel, causal).unwrap()
                    } else {
                        let heads = qkv.as_tensor().reshape((bsz, t, 3, n_head, d)).unwrap();
                        let (q, k, v) = (heads.i((.., .., 0)).unwrap(), heads.i((.., .., 1)).unwrap(), heads.i((.., .., 2)).unwrap());
                        stage2_sdpa::attention::attention_cpu(kernel, &q, &k, &v, causal).unwrap().reshape((bsz, t, c)).unwrap()
                    };
                    let grads = (&y * &dy).unwrap().sum_all().unwrap().backward().unwrap();
                    (y, grads.get(qkv.as_tensor()).unwrap().clone())
                };
                let ((y, g), (y_views, g_views)) = (run(true), run(false));
                let what = format!("qkv_attention {kernel:?} causal={causal} ({bsz}, {t}, {n_head}×{d})");
                assert_eq!(rel_err(&y, &y_views), 0.0, "{what}: forward");
                assert_eq!(g.dims(), [bsz, t, 3 * c], "{what}: gradient shape");
                let e = rel_err(&g, &g_views);
                assert!(e < 1e-6, "{what}: gradient {e}");
            }
        }
    }
}
