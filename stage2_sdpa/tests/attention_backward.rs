//! The attention op's backward on the CPU (the engine's FlashAttention-2 backward, `cpu_kernels::attention::backward`)
//! against its slow twins: candle's autograd through the materialised attention (`grads_slow`),
//! the candle-ops version CUDA runs without our kernel, and the scalar small version; and the
//! log-sum-exp the forward keeps for it.
use candle_core::IndexOp;
use candle_core::{DType, Device, Tensor, Var};
use cpu_kernels::attention::backward::{attention_bwd, bwd_candle_ops, grads_slow, small_head_bwd};
use shared::weights::SplitMix64;

/// max |a − b| / max(max |b|, 1): the worst element against the gradient's scale; absolute
/// for gradients below 1 throughout (dQ and dK are 0 at T = 1, up to rounding).
fn rel_max(a: &Tensor, b: &Tensor) -> f32 {
    let a = a.to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let b = b.to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let worst = a.iter().zip(&b).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
    worst / b.iter().fold(0f32, |m, x| m.max(x.abs())).max(1.0)
}

/// While training, the forward keeps each row's L_i = m_i + ln l_i (`FlashAttn::lse`): for
/// every CPU kernel that keeps it (register and tile kernels in f32, the bf16 one where this
/// CPU runs it), L is logsumexp_j(S_ij) computed in f64, and the backward from it matches the
/// backward that recomputes L by its own sweep.
#[test]
fn the_forward_keeps_the_log_sum_exp_and_the_backward_uses_it() {
    use cpu_kernels::attention::{CpuAttention, CpuKernel};
    let (b, t, h, d) = (2, 37, 3, 64);
    let scale = 1.0 / (d as f32).sqrt();
    let mut cases = vec![(DType::F32, CpuKernel::Registers), (DType::F32, CpuKernel::GemmTiles)];
    if cpu_kernels::attention::registers::bf16::runs(d) {
        cases.push((DType::BF16, CpuKernel::Registers));
    }
    for (dt, cpu) in cases {
        let randn =
            |s: u64| Tensor::from_vec(SplitMix64::new(s).normals(b * t * h * d), (b, t, h, d), &Device::Cpu).unwrap().to_dtype(dt).unwrap();
        let (q, k, v, d_o) = (randn(1), randn(2), randn(3), randn(4));
        for causal in [true, false] {
            let op = CpuAttention::new(cpu, scale, causal, true);
            let o = q.apply_op3_no_bwd(&k, &v, &op).unwrap();
            let lse = op.take_lse().expect("the forward kept L on the host");
            let host = |x: &Tensor| x.to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
            let (qh, kh) = (host(&q), host(&k));
            let at = |bi: usize, r: usize, hi: usize| ((bi * t + r) * h + hi) * d;
            let mut worst = 0f64;
            for (bh, row) in lse.chunks(t).enumerate() {
                let (bi, hi) = (bh / h, bh % h);
                for (i, &l) in row.iter().enumerate() {
                    let s: Vec<f64> = (0..if causal { i + 1 } else { t })
                        .map(|j| (0..d).map(|c| qh[at(bi, i, hi) + c] as f64 * kh[at(bi, j, hi) + c] as f64).sum::<f64>() * scale as f64)
                        .collect();
                    let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    let want = m + s.iter().map(|x| (x - m).exp()).sum::<f64>().ln();
                    worst = worst.max((l as f64 - want).abs());
                }
            }
            assert!(worst < 1e-4, "{dt:?} {cpu:?} causal {causal}: L off by {worst:e}");
            let kept = attention_bwd(&q, &k, &v, &o, &d_o, Some(&lse), scale, causal).unwrap();
            let swept = attention_bwd(&q, &k, &v, &o, &d_o, None, scale, causal).unwrap();
            // f32: the same numbers up to the order of f32 sums. bf16: the bf16 kernel's L
            // (S from bf16 pair products) moves a gradient element across a bf16 rounding
            // boundary now and then: one bf16 ulp, 2⁻⁸ of it.
            let tol = if dt == DType::F32 { 1e-5 } else { 4e-3 };
            for (name, a, w) in [("dq", &kept[0], &swept[0]), ("dk", &kept[1], &swept[1]), ("dv", &kept[2], &swept[2])] {
                let e = rel_max(a, w);
                assert!(e < tol, "{dt:?} {cpu:?} causal {causal}: {name} from the kept L off the recomputed one's by {e}");
            }
        }
    }
}

/// q, k, v as views of one (B, T, 3, n_head, d_head) Var (stage 3's QKV output, strides
/// (3·T·C, 3·C, d, 1)) or as three contiguous Vars; returns the views and the Vars.
fn inputs(dims: (usize, usize, usize, usize), seed: u64, strided: bool) -> ([Tensor; 3], Vec<Var>) {
    let (b, t, h, d) = dims;
    let randn = |n: usize, s: u64| SplitMix64::new(s).normals(n);
    if strided {
        let qkv = Var::from_vec(randn(b * t * 3 * h * d, seed), (b, t, 3, h, d), &Device::Cpu).unwrap();
        let part = |i: usize| qkv.as_tensor().i((.., .., i)).unwrap();
        ([part(0), part(1), part(2)], vec![qkv])
    } else {
        let vars: Vec<Var> = (0..3).map(|i| Var::from_vec(randn(b * t * h * d, seed + i), dims, &Device::Cpu).unwrap()).collect();
        ([vars[0].as_tensor().clone(), vars[1].as_tensor().clone(), vars[2].as_tensor().clone()], vars)
    }
}

#[test]
fn backward_matches_the_autograd_twin() {
    // Ragged T (not a multiple of B_r = B_c = 128, nor of the 12-row register tiles, and below
    // one tile), B·n_head > 1, d_head 16 (the tile GEMMs) and every register head size (32–128;
    // 80 ends in a narrower panel), causal and not, contiguous inputs and stage 3's strided views.
    let cases = [
        ((2, 37, 3, 16), true, false),
        ((1, 300, 2, 64), true, true),
        ((2, 129, 2, 80), false, true),
        ((1, 260, 1, 64), false, false),
        ((1, 1, 2, 16), true, false),
        ((2, 45, 1, 32), true, true),
        ((1, 131, 2, 96), true, false),
        ((1, 200, 1, 128), false, true),
        ((1, 5, 1, 128), true, false),
    ];
    let worst = cases
        .iter()
        .enumerate()
        .map(|(i, &(dims, causal, strided))| check_against_twin(dims, causal, strided, 11 + i as u64))
        .fold(0f32, f32::max);
    eprintln!("attention backward vs autograd twin, f32: max |Δ| / max |g| = {worst:.2e}");
}

/// The gradients candle's graph gives q, k, v through `attention` (`loss.backward()`, through
/// the views when `strided`) against the autograd twin's, dq, dk, dv each within 1e-5 at f32
/// (max |Δ| / max |g|: sums of up to T·d products reordered by tiles; measured 7e-7).
/// Returns the worst.
fn check_against_twin(dims: (usize, usize, usize, usize), causal: bool, strided: bool, seed: u64) -> f32 {
    let ([q, k, v], vars) = inputs(dims, seed, strided);
    let d_o = Tensor::from_vec(SplitMix64::new(seed + 99).normals(dims.0 * dims.1 * dims.2 * dims.3), dims, &Device::Cpu).unwrap();
    let y = stage2_sdpa::attention::attention(&q, &k, &v, causal).unwrap();
    cpu_kernels::trace::start();
    let grads = (y * &d_o).unwrap().sum_all().unwrap().backward().unwrap();
    let ran = cpu_kernels::trace::stop().join("; ");
    // The register-blocked products at the forward's register head sizes on x86-64 with AVX2,
    // the tile GEMMs elsewhere; the trace names the one that ran.
    let registers = cfg!(target_arch = "x86_64")
        && cpu_kernels::attention::registers::supports(dims.3)
        && std::arch::is_x86_feature_detected!("avx2")
        && std::arch::is_x86_feature_detected!("fma");
    let kernel = if registers { "register-blocked f32 micro-kernels" } else { "f32 tile GEMMs (gemm crate)" };
    assert!(ran.contains(&format!("attention backward: FlashAttention-2 tiles, {kernel}")), "d_head {}: {ran}", dims.3);
    let want = grads_slow(&q, &k, &v, &d_o, causal).unwrap();
    let got: Vec<Tensor> = if strided {
        let g = grads.get(vars[0].as_tensor()).expect("a gradient for the QKV tensor");
        (0..3).map(|p| g.i((.., .., p)).unwrap()).collect()
    } else {
        vars.iter().map(|x| grads.get(x.as_tensor()).expect("a gradient for each input").clone()).collect()
    };
    let mut worst = 0f32;
    for (name, g, w) in [("dq", &got[0], &want[0]), ("dk", &got[1], &want[1]), ("dv", &got[2], &want[2])] {
        assert_eq!(g.dims(), w.dims());
        let e = rel_max(g, w);
        assert!(e <= 1e-5, "{dims:?} causal={causal} strided={strided} {name}: {e}");
        worst = worst.max(e);
    }
    worst
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig { cases: 16, ..Default::default() })]

    #[test]
    fn backward_matches_the_twin_on_random_shapes(
        b in 1usize..3,
        t in 1usize..300,
        h in 1usize..4,
        d in proptest::sample::select(vec![8usize, 16, 24, 32, 40, 64, 80, 128]),
        causal: bool,
        strided: bool,
        seed in 0u64..1 << 20,
    ) {
        check_against_twin((b, t, h, d), causal, strided, seed);
    }
}

#[test]
fn half_precision_inputs_get_gradients_in_their_dtype() {
    // bf16/f16 q, k, v: computed in f32, returned in the input dtype; against the f32 twin
    // on the same (rounded) inputs within 5e-3 for bf16, 1e-3 for f16 (the rounding of dO
    // and of each gradient to 8 or 11 bits; measured 2.8e-3 and 3.8e-4).
    let dims = (1, 70, 2, 32);
    for dtype in [DType::BF16, DType::F16] {
        let ([q, k, v], _) = inputs(dims, 5, false);
        let (q, k, v) = (q.to_dtype(dtype).unwrap(), k.to_dtype(dtype).unwrap(), v.to_dtype(dtype).unwrap());
        let d_o = Tensor::from_vec(SplitMix64::new(6).normals(70 * 64), dims, &Device::Cpu).unwrap().to_dtype(dtype).unwrap();
        let o = stage2_sdpa::attention::attention(&q, &k, &v, true).unwrap();
        let got = attention_bwd(&q, &k, &v, &o, &d_o, None, 1.0 / 32f32.sqrt(), true).unwrap();
        let want = grads_slow(&q, &k, &v, &d_o, true).unwrap();
        for (g, w) in got.iter().zip(&want) {
            assert_eq!(g.dtype(), dtype);
            let (e, tol) = (rel_max(g, w), if dtype == DType::BF16 { 5e-3 } else { 1e-3 });
            assert!(e <= tol, "{dtype:?}: {e}");
            eprintln!("attention backward, {dtype:?} inputs, vs f32 twin: {e:.2e}");
        }
    }
}

#[test]
fn candle_ops_version_and_small_version_match_the_twin() {
    // The CUDA path (`bwd_candle_ops`) runs on the CPU too, and the scalar small version
    // on one head: both within 1e-5 of autograd, f32.
    for causal in [true, false] {
        let dims = (2, 45, 2, 16);
        let ([q, k, v], _) = inputs(dims, 21, true);
        let d_o = Tensor::from_vec(SplitMix64::new(22).normals(2 * 45 * 32), dims, &Device::Cpu).unwrap();
        let o = stage2_sdpa::attention::attention(&q, &k, &v, causal).unwrap();
        let want = grads_slow(&q, &k, &v, &d_o, causal).unwrap();
        let ops = bwd_candle_ops(&q, &k, &v, &o, &d_o, 0.25, causal).unwrap();
        for (g, w) in ops.iter().zip(&want) {
            assert!(rel_max(g, w) <= 1e-5, "candle ops causal={causal}: {}", rel_max(g, w));
        }
        // Head (b = 1, h = 0) as (T, d) rows.
        let head = |x: &Tensor| x.i((1, .., 0)).unwrap().contiguous().unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let small = small_head_bwd(&head(&q), &head(&k), &head(&v), &head(&o), &head(&d_o), 16, causal);
        for (g, w) in small.into_iter().zip(&want) {
            let g = Tensor::from_vec(g, (45, 16), &Device::Cpu).unwrap();
            let w = w.i((1, .., 0)).unwrap();
            assert!(rel_max(&g, &w) <= 1e-5, "small causal={causal}: {}", rel_max(&g, &w));
        }
    }
}

/// A training step on the CPU at bf16: f32 q, k, v (tracked) through the op with bf16 products
/// (`CpuKernel::RegistersBf16`: the bf16 pair kernel, f32 rows out, L kept), then
/// FlashAttention-2's backward from that L. Against the autograd twin in f32 on the same inputs,
/// d_head 32/64/128, T ragged (below, across and past the 128-row tiles), causal and not,
/// contiguous and stage 3's strided views: each gradient within 2e-2 of its largest value (the
/// forward's L comes from bf16 products; the training step's gradient tolerance at bf16). Where
/// this CPU has no bf16 unit the f32 kernel runs, and the check is f32's 1e-5.
#[test]
fn bf16_forward_backward_matches_the_twin() {
    use cpu_kernels::attention::CpuKernel;
    use stage2_sdpa::attention::{attention_opts, Implementation};
    let mut worst = 0f32;
    for (i, &((b, t, h, d), causal, strided)) in [
        ((1, 37, 2, 32), true, false),
        ((2, 129, 1, 64), true, true),
        ((1, 200, 2, 128), false, false),
        ((1, 300, 1, 64), false, true),
        ((1, 1, 2, 32), true, false),
    ]
    .iter()
    .enumerate()
    {
        let bf16 = cpu_kernels::attention::registers::bf16::runs(d);
        let seed = 500 + 10 * i as u64;
        let ([q, k, v], vars) = inputs((b, t, h, d), seed, strided);
        let d_o = Tensor::from_vec(SplitMix64::new(seed + 99).normals(b * t * h * d), (b, t, h, d), &Device::Cpu).unwrap();
        cpu_kernels::trace::start();
        let y = attention_opts(Implementation::Cpu, CpuKernel::RegistersBf16, &q, &k, &v, causal).unwrap();
        let grads = (y * &d_o).unwrap().sum_all().unwrap().backward().unwrap();
        let ran = cpu_kernels::trace::stop().join("; ");
        let forward = if bf16 { "register-blocked, bf16 pairs" } else { "register-blocked, f32" };
        // The backward in the forward's precision: on AMX tiles where the forward's ran there, on
        // vdpbf16ps where AVX512-BF16 is the bf16 unit; at a head size AMX does not take on an
        // AMX CPU (its vdpbf16ps no faster than an FMA), f32 products.
        let backward = if cpu_kernels::attention::registers::bf16::amx_runs(d) {
            "attention backward: FlashAttention-2 tiles, bf16 pairs on AMX tiles (amx)"
        } else if bf16 && cpu_kernels::bf16_gemm::Kernel::detect() == cpu_kernels::bf16_gemm::Kernel::Avx512Bf16 {
            "attention backward: FlashAttention-2 tiles, register-blocked, bf16 pairs (avx512-bf16)"
        } else {
            "attention backward: FlashAttention-2 tiles, register-blocked f32 micro-kernels"
        };
        assert!(ran.contains(forward) && ran.contains(backward) && !ran.contains("L recomputed"), "{ran}");
        let want = grads_slow(&q, &k, &v, &d_o, causal).unwrap();
        let got: Vec<Tensor> = if strided {
            let g = grads.get(vars[0].as_tensor()).expect("a gradient for the QKV tensor");
            (0..3).map(|p| g.i((.., .., p)).unwrap()).collect()
        } else {
            vars.iter().map(|x| grads.get(x.as_tensor()).expect("a gradient for each input").clone()).collect()
        };
        for (name, g, w) in [("dq", &got[0], &want[0]), ("dk", &got[1], &want[1]), ("dv", &got[2], &want[2])] {
            assert_eq!((g.dims(), g.dtype()), (w.dims(), DType::F32));
            let e = rel_max(g, w);
            assert!(e <= if bf16 { 2e-2 } else { 1e-5 }, "({b}, {t}, {h}, {d}) causal={causal} strided={strided} {name}: {e}");
            worst = worst.max(e);
        }
    }
    eprintln!("attention backward after a bf16-pair forward, vs the f32 autograd twin: max |Δ| / max |g| = {worst:.2e}");
}
