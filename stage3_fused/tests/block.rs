//! Stage 3 as a whole block: within tolerance of the fp32 stage-0 reference on `tiny`, at fp32,
//! bf16 and f16, and agreeing with stage 2 (the same function, fused differently).

use shared::check::compare;
use shared::device::{select, DeviceRequest};
use shared::stage::plan_alone;
use shared::weights::random_input;
use shared::{BlockWeights, Precision, PrecisionRequest, Preset, Stage};

#[test]
fn block_matches_reference_on_tiny() {
    let shape = Preset::Tiny.shape();
    let (device, info) = select(DeviceRequest::Cpu).unwrap();
    let w = BlockWeights::from_seed(&shape, 8).unwrap();
    let x = random_input(&shape, 8).unwrap();
    let run = |spec: &dyn Stage, req| {
        let plan = plan_alone(spec, &device, &info, shape, req).unwrap();
        (spec.build(&w, &plan).unwrap().forward(&x).unwrap(), plan.precision)
    };
    let (reference, _) = run(&stage0_baseline::Baseline, PrecisionRequest::Auto);
    for p in [Precision::Fp32, Precision::Bf16, Precision::F16] {
        let (y, got) = run(&stage3_fused::Fused::default(), PrecisionRequest::Exactly(p));
        assert_eq!(got, p);
        let c = compare(&y, &reference, p).unwrap();
        assert!(c.passed, "{p}: {c:?}");
        if p != Precision::Fp32 {
            // Not vacuous: reduced precision shows up in the error.
            assert!(c.rel_err > 1e-6, "{p}: {c:?}");
        }
        let (y2, _) = run(&stage2_sdpa::Sdpa::default(), PrecisionRequest::Exactly(p));
        let c = compare(&y, &y2, p).unwrap();
        assert!(c.passed, "stage 3 vs stage 2 at {p}: {c:?}");
    }
}

#[test]
fn fp32_on_cuda_is_refused_not_mislabelled() {
    // Simulated Hopper: cudarc's cuBLASLt f32 GEMM computes in TF32, so fp32 must be refused.
    // (Stage 2's fused attention, bf16/f16 only on CUDA, may refuse first; either way: exit 2, a fix.)
    let h100 = shared::device::DeviceInfo::simulated_cuda("NVIDIA H100 80GB HBM3", (9, 0));
    let e = stage3_fused::Fused::default().choose_precision(&h100, PrecisionRequest::Exactly(Precision::Fp32)).unwrap_err();
    assert!(e.to_string().contains("Fix:"), "{e}");
}

#[test]
fn each_fusion_switched_off_alone_computes_the_same_block() {
    // --fusions / ladder --ablate: every combination of one fusion off (and all off) matches the
    // reference and the block with every fusion on, at fp32 and bf16.
    use stage3_fused::{Fused, Fusions};
    let shape = Preset::Tiny.shape();
    let (device, info) = select(DeviceRequest::Cpu).unwrap();
    let w = BlockWeights::from_seed(&shape, 9).unwrap();
    let x = random_input(&shape, 9).unwrap();
    let run = |p: Precision, fusions: Fusions| {
        let spec = Fused { fusions, ..Fused::default() };
        let plan = plan_alone(&spec, &device, &info, shape, PrecisionRequest::Exactly(p)).unwrap();
        let label = spec.implementation(&plan).unwrap();
        (spec.build(&w, &plan).unwrap().forward(&x).unwrap(), label)
    };
    let reference = {
        let s0 = &stage0_baseline::Baseline;
        s0.build(&w, &plan_alone(s0, &device, &info, shape, PrecisionRequest::Auto).unwrap()).unwrap().forward(&x).unwrap()
    };
    for p in [Precision::Fp32, Precision::Bf16] {
        let (all, label) = run(p, Fusions::ALL);
        assert!(!label.contains("fusions"), "{label}");
        let variants = Fusions::NAMES.iter().map(|n| (n.to_string(), Fusions::ALL.without(n))).chain([("none".into(), Fusions::NONE)]);
        for (name, fusions) in variants {
            let (y, label) = run(p, fusions);
            assert!(label.contains(&format!("fusions {}", fusions.describe())), "{label}");
            let c = compare(&y, &reference, p).unwrap();
            assert!(c.passed, "{p} without {name}: {c:?}");
            let c = compare(&y, &all, p).unwrap();
            assert!(c.passed, "{p} without {name} vs all fusions: {c:?}");
        }
    }
}

#[test]
fn the_copies_kept_variant_of_stage_2_computes_the_same_block() {
    let shape = Preset::Tiny.shape();
    let (device, info) = select(DeviceRequest::Cpu).unwrap();
    let w = BlockWeights::from_seed(&shape, 10).unwrap();
    let x = random_input(&shape, 10).unwrap();
    let run = |copies: bool| {
        let spec = stage2_sdpa::Sdpa { copies, ..Default::default() };
        let plan = plan_alone(&spec, &device, &info, shape, PrecisionRequest::Auto).unwrap();
        (spec.build(&w, &plan).unwrap().forward(&x).unwrap(), spec.implementation(&plan).unwrap())
    };
    let ((y, plain), (y_copies, label)) = (run(false), run(true));
    assert!(label.contains("head split/merge copies kept") && !plain.contains("copies"), "{label}");
    // The same arithmetic on the same values, only moved around: bit-identical.
    let d = (y - y_copies).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
    assert_eq!(d, 0.0);
}

#[test]
fn with_every_fusion_off_stage_3_computes_exactly_what_stage_2_computes() {
    // Each slow twin is what stage 2 runs for that part: stage 3 with all four fusions
    // off must then produce stage 2's output bit for bit, on the same weights and input, at fp32
    // and at bf16 (where the casts are part of the ops). Any other op, order or formula in a
    // twin (another GELU, a threaded LayerNorm, a different cast) would change some bits.
    use stage3_fused::{Fused, Fusions};
    let shape = Preset::Tiny.shape();
    let (device, info) = select(DeviceRequest::Cpu).unwrap();
    let w = BlockWeights::from_seed(&shape, 10).unwrap();
    let x = random_input(&shape, 10).unwrap();
    for p in [Precision::Fp32, Precision::Bf16] {
        let run = |spec: &dyn Stage| {
            let plan = plan_alone(spec, &device, &info, shape, PrecisionRequest::Exactly(p)).unwrap();
            spec.build(&w, &plan).unwrap().forward(&x).unwrap().to_dtype(candle_core::DType::F32).unwrap()
        };
        let stage2 = run(&stage2_sdpa::Sdpa::default()).flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let unfused = run(&Fused { fusions: Fusions::NONE, ..Fused::default() }).flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let fused = run(&Fused::default()).flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<u32>>();
        assert_eq!(bits(&unfused), bits(&stage2), "{p}: stage 3 with every fusion off is not stage 2's computation");
        // Not vacuous: the fusions do change the arithmetic (another GELU evaluation, one-pass
        // LayerNorm statistics), so the fused block differs from stage 2 in some bits.
        assert_ne!(bits(&fused), bits(&stage2), "{p}: the fused block is bit-identical to stage 2, so the test cannot tell");
    }
}

/// A stage's own flags are refused as every runner flag is: an empty `--fusions` (or
/// `SPEEDKIT_FUSIONS`) is a typo, not "none" — exit 2 with a fix, before any work.
#[test]
fn an_empty_fusion_list_is_refused() {
    let run = |args: &[&str], env: &[(&str, &str)]| {
        let o = std::process::Command::new(env!("CARGO_BIN_EXE_stage3_fused"))
            .args(["--preset", "tiny", "--iters", "1", "--warmup", "0"])
            .args(args)
            .envs(env.iter().copied())
            .output()
            .unwrap();
        (o.status.code(), format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr)))
    };
    for (code, text) in [run(&["--fusions", ""], &[]), run(&[], &[("SPEEDKIT_FUSIONS", "")])] {
        assert_eq!(code, Some(2), "{text}");
        assert!(text.contains("Fix") && !text.contains("panicked") && !text.contains("ran "), "{text}");
    }
}
