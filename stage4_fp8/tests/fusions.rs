//! Stage 4's producer fusions (`--fp8-fusions ln,fc1`) on the CPU emulation: the
//! LayerNorms and fc1 hand the next GEMM its input already in E4M3, quantised from their f32
//! output with the GEMM's delayed scale, and record its amax in the GEMM's history. Checked:
//! fused against unfused (exactly equal at f32 activations, within a derived bound at bf16), the
//! amax histories advancing alike, the GEMM twins and the block twin with the fusions on, and
//! the refusal of a fusion that current scaling cannot run.

use candle_core::{DType, Tensor};
use shared::check::compare_within;
use shared::device::{select, DeviceRequest};
use shared::stage::plan;
use shared::weights::{random_input, SplitMix64};
use shared::{BlockWeights, Forward, Precision, PrecisionRequest, Preset, Shape, Stage};
use stage4_fp8::fp8::Fp8Recipe;
use stage4_fp8::{Args, Block, Fp8, Fp8Fusions, TWIN_TOLERANCE};

fn block(shape: Shape, seed: u64, fp8_fusions: Fp8Fusions, requested: PrecisionRequest) -> Block {
    let (device, info) = select(DeviceRequest::Cpu).unwrap();
    let stage = Fp8 { args: Args { fp8_fusions: Some(fp8_fusions), ..Args::default() }, ..Fp8::default() };
    let plan = plan(&stage, &device, &info, shape, PrecisionRequest::Auto, requested, false, false).unwrap();
    Block::build(&BlockWeights::from_seed(&shape, seed).unwrap(), &plan, &stage).unwrap()
}

/// Three forwards on inputs of different magnitudes (so the delayed scales move): the outputs
/// and, after them, each layer's amax history.
fn run(b: &Block, xs: &[Tensor]) -> (Vec<Tensor>, Vec<Vec<f32>>) {
    let ys = xs.iter().map(|x| b.forward(x).unwrap()).collect();
    (ys, b.layers().iter().map(|l| l.input_amax_history().unwrap()).collect())
}

/// A few tiny shapes from a seed: C a multiple of the heads, every dimension small.
fn shapes() -> Vec<Shape> {
    let mut rng = SplitMix64::new(20);
    let mut pick = |choices: &[usize]| choices[(rng.next_u64() % choices.len() as u64) as usize];
    let mut v = vec![Preset::Tiny.shape()];
    for _ in 0..3 {
        let n_head = pick(&[1, 2, 4]);
        v.push(Shape {
            batch: pick(&[1, 2]),
            seq: pick(&[5, 16, 33]),
            d_model: n_head * pick(&[16, 32]),
            n_head,
            ff: pick(&[48, 64, 128]),
        });
    }
    v
}

fn inputs(shape: &Shape, seed: u64) -> Vec<Tensor> {
    [1.0, 3.0, 0.5].iter().map(|a| (random_input(shape, seed).unwrap() * *a).unwrap()).collect()
}

/// At f32 activations (stage 3 at fp32) nothing is rounded between a producer and the
/// quantiser: unfused, h (or m) is stored in f32 and the GEMM quantises it with the scale from
/// its history; fused, the producer quantises the same f32 values with the same scale. So the
/// two must agree bit for bit — outputs and every amax history — and each fusion must have
/// happened (from the second call on; the first call has no history, so it runs unfused).
#[test]
fn fused_equals_unfused_at_f32_activations_and_the_histories_advance_alike() {
    for (i, shape) in shapes().into_iter().enumerate() {
        let xs = inputs(&shape, 30 + i as u64);
        let f32_activations = PrecisionRequest::Exactly(Precision::Fp32);
        let (want, want_h) = run(&block(shape, 40 + i as u64, Fp8Fusions::NONE, f32_activations), &xs);
        for name in ["all", "ln", "fc1"] {
            let fusions: Fp8Fusions = name.parse().unwrap();
            let b = block(shape, 40 + i as u64, fusions, f32_activations);
            let (got, got_h) = run(&b, &xs);
            for (k, (g, w)) in got.iter().zip(&want).enumerate() {
                let diff = (g - w).unwrap().abs().unwrap().flatten_all().unwrap().max(0).unwrap();
                assert_eq!(diff.to_scalar::<f32>().unwrap(), 0.0, "{shape:?} fusions {name}, call {k}");
            }
            assert_eq!(got_h, want_h, "{shape:?} fusions {name}: amax histories");
            let [qkv, proj, fc1, fc2] = b.layers();
            let fused = [qkv.last_input_fused(), proj.last_input_fused(), fc1.last_input_fused(), fc2.last_input_fused()];
            assert_eq!(fused, [fusions.ln, false, fusions.ln, fusions.fc1], "{shape:?} fusions {name}");
        }
    }
}

/// At bf16 activations the unfused path rounds h and m to bf16 before quantising, the fused
/// one does not: an E4M3 code differs only where the bf16 rounding (≤ 2⁻⁹ relative) moves a
/// value across an E4M3 rounding boundary (2⁻³ apart, relative), i.e. for a fraction
/// p ≤ 2·2⁻⁹ / 2⁻³ = 2⁻⁵ of the values, by one E4M3 step (≤ 2⁻³ relative, ~2⁻⁴ in rms). The GEMM
/// inputs then differ by √p·2⁻⁴ ≈ 1.1e-2 relative (rms), and a GEMM of random-sign weights carries
/// a relative input perturbation to its output at the same size; the residual stream, identical
/// in both, only dilutes it. Bound: 2·√(2⁻⁵)·2⁻⁴ = 2.2e-2 on the block's output.
#[test]
fn fused_agrees_with_unfused_at_bf16_activations_within_the_derived_bound() {
    let bound = 2.0 * 2f64.powi(-5).sqrt() * 2f64.powi(-4);
    for (i, shape) in shapes().into_iter().enumerate() {
        let xs = inputs(&shape, 50 + i as u64);
        let requested = PrecisionRequest::Exactly(Precision::Bf16);
        let (want, _) = run(&block(shape, 60 + i as u64, Fp8Fusions::NONE, requested), &xs);
        let (got, _) = run(&block(shape, 60 + i as u64, Fp8Fusions::ALL, requested), &xs);
        for (k, (g, w)) in got.iter().zip(&want).enumerate() {
            let c = compare_within(g, w, bound).unwrap();
            println!("{shape:?} call {k}: fused vs unfused rel err {:.2e} (bound {bound:.1e})", c.rel_err);
            assert!(c.passed, "{shape:?} call {k}: {c:?} (bound {bound:.1e})");
            // not vacuous: from the second call on the fusions skip a bf16 rounding
            assert!(k == 0 || c.rel_err > 0.0, "{shape:?} call {k}: fused and unfused identical at bf16");
        }
        assert_eq!(
            got[0].to_dtype(DType::F32).unwrap().to_vec3::<f32>().unwrap(),
            want[0].to_vec3::<f32>().unwrap(),
            "call 0 runs unfused"
        );
    }
}

/// With the fusions on, each GEMM's twin reads the very E4M3 tensor its producer wrote (and its
/// scale): all four pass at tiny and at small, and the fp8-rounded block twin — quantising the
/// producers' f32 outputs where the fusions do — agrees within its tolerance.
#[test]
fn the_twin_checks_hold_with_the_fusions_on() {
    for (preset, seed) in [(Preset::Tiny, 70), (Preset::Small, 71)] {
        let shape = preset.shape();
        let b = block(shape, seed, Fp8Fusions::ALL, PrecisionRequest::Auto);
        let x = random_input(&shape, seed).unwrap();
        let y = b.forward(&x).unwrap(); // the first call: unfused, fills the histories
        let check = b.self_check(&x, &y).unwrap().unwrap(); // the second: fused
        assert!(check.result.passed, "{preset:?}: {check:?}");
        assert!(b.layers().iter().filter(|l| l.last_input_fused()).count() == 3, "{preset:?}: qkv, fc1 and fc2 read fused inputs");
        let y = b.forward(&x).unwrap();
        let twin = compare_within(&y, &b.twin().unwrap().forward(&x).unwrap(), TWIN_TOLERANCE).unwrap();
        // Where the fused attention rounds P to bf16 and the twin does not (a CPU with
        // AVX512-BF16, as on a GPU), E4M3's rounding of what follows turns that into a few 1e-3:
        // within the tolerance; elsewhere the two agree to 1e-3.
        let close = if stage2_sdpa::attention::registers::bf16::runs(shape.d_head()) { TWIN_TOLERANCE } else { 1e-3 };
        assert!(twin.passed && twin.rel_err < close, "{preset:?}: {twin:?}");
    }
}

/// Current scaling takes a tensor's scale from its own amax, known only after the producer has
/// written it: an explicit fusion is refused (exit 2, cause and fix), none by default.
#[test]
fn current_scaling_refuses_an_explicit_fusion() {
    let (device, info) = select(DeviceRequest::Cpu).unwrap();
    let stage = |fp8_fusions| Fp8 { args: Args { fp8_recipe: Fp8Recipe::Current, fp8_fusions, ..Args::default() }, ..Fp8::default() };
    let plan = |fp8_fusions| shared::stage::plan_alone(&stage(fp8_fusions), &device, &info, Preset::Tiny.shape(), PrecisionRequest::Auto);
    let e = plan(Some(Fp8Fusions::ALL.without("ln"))).unwrap_err();
    assert!(matches!(e, shared::SpeedkitError::Usage(_)) && e.to_string().contains("Fix:"), "{e}");
    let ok = plan(None).unwrap();
    assert!(stage(None).implementation(&ok).unwrap().ends_with("fp8 fusions none"));
    assert!(plan(Some(Fp8Fusions::NONE)).is_ok());
    // the binary: exit 2, one paragraph naming the flag and the fix, before any work
    let o = std::process::Command::new(env!("CARGO_BIN_EXE_stage4_fp8"))
        .args(["--device", "cpu", "--preset", "tiny", "--fp8-recipe", "current", "--fp8-fusions", "fc1"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("--fp8-fusions fc1") && err.contains("--fp8-recipe delayed") && err.contains("Fix:"), "{err}");
    let o = std::process::Command::new(env!("CARGO_BIN_EXE_stage4_fp8"))
        .args(["--device", "cpu", "--preset", "tiny", "--iters", "1", "--warmup", "0"])
        .env("SPEEDKIT_FP8_RECIPE", "current")
        .env("SPEEDKIT_FP8_FUSIONS", "ln")
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2), "{}", String::from_utf8_lossy(&o.stderr));
}

/// The producers beside their slow twins, on random shapes: stage 0's LayerNorm (plain ops,
/// f32), then the quantiser with the consumer's scale. A code can only move by one E4M3 step
/// (2⁻³), and only where the two LayerNorms' f32 values (~1e-6 apart) straddle a rounding
/// boundary: a handful of values at most, ≤ 1e-2 in the norm. The recorded amax is max |h|.
#[test]
fn the_producers_match_their_slow_twins() {
    use stage4_fp8::fp8::{amax, quantize_dequantize_cpu, Fp8Target};
    use stage4_fp8::producers::{add_layer_norm_e4m3, layer_norm_e4m3};
    let mut rng = SplitMix64::new(90);
    for case in 0..6u64 {
        let (rows, c) = (1 + (rng.next_u64() % 40) as usize, 1 + (rng.next_u64() % 300) as usize);
        let randn = |dims: &[usize], seed: u64, scale: f32, offset: f32| {
            let v = SplitMix64::new(seed).normals(dims.iter().product()).into_iter().map(|x| x * scale + offset).collect();
            Tensor::from_vec(v, dims, &candle_core::Device::Cpu).unwrap()
        };
        let (g, b) = (randn(&[c], case, 0.1, 1.0), randn(&[c], case + 100, 0.1, 0.0));
        let x = randn(&[1, rows, c], case + 200, 2.0, 0.5);
        let branch = randn(&[1, rows, c], case + 300, 1.0, 0.0).to_dtype(DType::BF16).unwrap();
        for add in [false, true] {
            let sum = if add { (&x + branch.to_dtype(DType::F32).unwrap()).unwrap() } else { x.clone() };
            let h = stage0_baseline::layer_norm(&sum, &g, &b).unwrap(); // the slow twin
            let s = Tensor::new(0.8 * amax(&h).unwrap().to_scalar::<f32>().unwrap() / 448.0, &candle_core::Device::Cpu).unwrap();
            let target = Fp8Target::new(&s).unwrap();
            let q = match add {
                true => {
                    let (x_new, q) = add_layer_norm_e4m3(&x, &branch, &g, &b, &target).unwrap();
                    assert!(compare_within(&x_new, &sum, 1e-7).unwrap().passed, "x + branch");
                    q
                }
                false => layer_norm_e4m3(&x, &g, &b, &target).unwrap(),
            };
            let want = quantize_dequantize_cpu(&h, &s).unwrap();
            let r = compare_within(&q.data, &want, 1e-2).unwrap();
            assert!(r.passed, "({rows}, {c}) add={add}: {r:?}");
            let (got_a, want_a) = (target.amax().unwrap(), amax(&h).unwrap().to_scalar::<f32>().unwrap());
            assert!((got_a - want_a).abs() <= 1e-5 * want_a, "({rows}, {c}) add={add}: amax {got_a} vs {want_a}");
            assert_eq!(q.scale.to_scalar::<f32>().unwrap(), s.to_scalar::<f32>().unwrap());
        }
    }
}

/// A CUDA graph is captured once the block is steady: with a producer fusion on, from the second
/// forward (the first has no delayed scale, so its producers run unfused); with none, from the
/// first. Each fusion alone counts.
#[test]
fn the_block_is_steady_once_its_fused_producers_have_run() {
    let shape = Preset::Tiny.shape();
    let xs = inputs(&shape, 3);
    for fusions in [Fp8Fusions::ALL, Fp8Fusions { ln: true, fc1: false }, Fp8Fusions { ln: false, fc1: true }] {
        let b = block(shape, 5, fusions, PrecisionRequest::Auto);
        b.forward(&xs[0]).unwrap();
        assert!(!b.steady(), "{fusions:?}: the first forward ran unfused, yet the block says steady");
        b.forward(&xs[1]).unwrap();
        assert!(b.steady(), "{fusions:?}: the second forward ran every fusion, yet the block is not steady");
    }
    let b = block(shape, 5, Fp8Fusions::NONE, PrecisionRequest::Auto);
    b.forward(&xs[0]).unwrap();
    assert!(b.steady(), "no fusion: the first forward is the steady path");
}

/// When cuBLASLt has no algorithm for fc1's E4M3 output, stage 4 runs the next configuration:
/// exactly `--fp8-fusions ln` (fc1 writes its activation dtype, fc2 quantises it), bit for bit,
/// histories included; the row's notes say so, and the block is steady without the fc1 fusion.
#[test]
fn without_an_fc1_e4m3_algorithm_the_block_runs_the_ln_only_dataflow_and_says_so() {
    let shape = Preset::Tiny.shape();
    let xs = inputs(&shape, 7);
    let fell_back = block(shape, 9, Fp8Fusions::ALL, PrecisionRequest::Auto);
    fell_back.assume_no_fc1_e4m3_algorithm();
    let ln_only = block(shape, 9, Fp8Fusions { ln: true, fc1: false }, PrecisionRequest::Auto);
    let (ys, hs) = run(&fell_back, &xs);
    let (want_ys, want_hs) = run(&ln_only, &xs);
    for (y, w) in ys.iter().zip(&want_ys) {
        assert_eq!(y.flatten_all().unwrap().to_vec1::<f32>().unwrap(), w.flatten_all().unwrap().to_vec1::<f32>().unwrap());
    }
    assert_eq!(hs, want_hs);
    assert!(fell_back.steady(), "steady without the fc1 fusion");
    let notes = fell_back.ran();
    assert!(notes.len() == 1 && notes[0].contains("fc1") && notes[0].contains("no algorithm"), "{notes:?}");
    assert!(ln_only.ran().is_empty());
}
