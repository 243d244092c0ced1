//! Stage 4 as a whole block on the CPU (emulated): within the fp8 tolerance of the fp32
//! reference, ~0 against its fp8-rounded twin, the twin check able to fail, and the plan-level
//! refusals for GPUs we do not have here.

use candle_core::{DType, Device, Tensor};
use shared::check::{compare, compare_within};
use shared::device::{select, DeviceInfo, DeviceRequest};
use shared::stage::{plan, plan_alone};
use shared::weights::random_input;
use shared::{BlockWeights, Forward, Precision, PrecisionRequest, Preset, Shape, Stage};
use stage4_fp8::fp8::{dequantize, quantize, Fp8Linear, Fp8Mode, Fp8Recipe, ScalingConfig};
use stage4_fp8::{Args, Block, Fp8, TWIN_TOLERANCE};

fn stage(fp8_recipe: Fp8Recipe) -> Fp8 {
    Fp8 { args: Args { fp8_recipe, ..Args::default() }, ..Fp8::default() }
}

#[test]
fn emulated_block_within_fp8_tolerance_and_twin_near_zero() {
    let shape = Preset::Tiny.shape();
    let (device, info) = select(DeviceRequest::Cpu).unwrap();
    let w = BlockWeights::from_seed(&shape, 4).unwrap();
    let x = random_input(&shape, 4).unwrap();
    let reference = {
        let spec = &stage0_baseline::Baseline;
        let plan = plan_alone(spec, &device, &info, shape, PrecisionRequest::Auto).unwrap();
        spec.build(&w, &plan).unwrap().forward(&x).unwrap()
    };
    let bf16 = {
        let spec = &stage3_fused::Fused::default();
        let plan = plan_alone(spec, &device, &info, shape, PrecisionRequest::Exactly(Precision::Bf16)).unwrap();
        compare(&spec.build(&w, &plan).unwrap().forward(&x).unwrap(), &reference, Precision::Bf16).unwrap()
    };
    for recipe in [Fp8Recipe::Delayed, Fp8Recipe::Current] {
        let spec = stage(recipe);
        // f32 activations (stage 3 at fp32), so the twin differs in accumulation order only; on a
        // CPU with a bf16 unit auto would give bf16 activations, whose rounding the twin also sees.
        let plan =
            plan(&spec, &device, &info, shape, PrecisionRequest::Auto, PrecisionRequest::Exactly(Precision::Fp32), false, false).unwrap();
        assert_eq!(plan.precision, Precision::Fp8);
        let fused = if recipe == Fp8Recipe::Delayed { "all" } else { "none" }; // all the recipe allows
        assert_eq!(spec.implementation(&plan).unwrap(), format!("emulated, {} scaling, fp8 fusions {fused}", recipe.name()));
        let block = spec.build(&w, &plan).unwrap();
        let y = block.forward(&x).unwrap();
        let c = compare(&y, &reference, Precision::Fp8).unwrap();
        assert!(c.passed, "{recipe:?}: {c:?}");
        // Not vacuous: E4M3 costs visibly more than stage 3's bf16.
        assert!(c.rel_err > 1.5 * bf16.rel_err, "fp8 {c:?} vs bf16 {bf16:?}");
        let twin = block.self_check(&x, &y).unwrap().unwrap();
        assert!(twin.result.passed && twin.result.rel_err < 1e-3, "{recipe:?}: {twin:?}");
        // Delayed scaling carries state: a second forward still agrees with the reference.
        let c2 = compare(&block.forward(&x).unwrap(), &reference, Precision::Fp8).unwrap();
        assert!(c2.passed, "{recipe:?} second call: {c2:?}");
    }
}

#[test]
fn the_twin_check_catches_scale_and_layout_bugs() {
    let shape = Preset::Tiny.shape();
    let (device, info) = select(DeviceRequest::Cpu).unwrap();
    let w = BlockWeights::from_seed(&shape, 5).unwrap();
    let x = random_input(&shape, 5).unwrap();
    let plan = plan_alone(&Fp8::default(), &device, &info, shape, PrecisionRequest::Auto).unwrap();
    let block = Block::build(&w, &plan, &Fp8::default()).unwrap();
    let y = block.forward(&x).unwrap();
    let good = compare_within(&y, &block.twin().unwrap().forward(&x).unwrap(), TWIN_TOLERANCE).unwrap();
    assert!(good.passed, "{good:?}");
    // The twin stands in for a stage-4 run with one bug planted: fc1's GEMM applying a wrong
    // scale (s_w·1.5 — what passing the wrong scale pointer or a stale history does).
    let mut bad = block.twin().unwrap();
    bad.fc1.w = (bad.fc1.w * 1.5).unwrap();
    let c = compare_within(&y, &bad.forward(&x).unwrap(), TWIN_TOLERANCE).unwrap();
    // The margin over the good run: ~1,000x where the fused attention keeps P in f32 as the twin
    // does, ~75x where it rounds P to bf16 before P·V (a GPU, a CPU with AVX512-BF16).
    assert!(!c.passed && c.rel_err > 20.0 * good.rel_err.max(1e-6), "scale bug not caught: {c:?} (good: {good:?})");
    // A wrong *input* scale by a power of two is invisible, as it should be: E4M3 rounds
    // relative to the value, so x/2s rounds exactly like x/s (barring under/overflow).
    let mut pow2 = block.twin().unwrap();
    pow2.fc1.x_scale = (pow2.fc1.x_scale * 2.0).unwrap();
    assert!(compare_within(&y, &pow2.forward(&x).unwrap(), TWIN_TOLERANCE).unwrap().passed);
    // proj's weight read transposed (a layout bug; proj is square, so shapes still fit):
    let mut bad = block.twin().unwrap();
    bad.proj.w = bad.proj.w.t().unwrap().contiguous().unwrap();
    let c = compare_within(&y, &bad.forward(&x).unwrap(), TWIN_TOLERANCE).unwrap();
    assert!(!c.passed, "layout bug not caught: {c:?}");
}

#[test]
fn fp8_linear_matches_its_slow_twin() {
    // Fp8Linear (emulated) vs plain ops on the same rounded operands: y = bf16(gelu(x̃ W̃ᵀ + b)).
    let dev = Device::Cpu;
    for (bsz, t, k, n, gelu) in [(1, 1, 16, 16, false), (2, 7, 48, 80, true), (3, 33, 128, 64, false)] {
        let wt = (Tensor::randn(0f32, 0.1, (n, k), &dev).unwrap() * 3.0).unwrap();
        let b = Tensor::randn(0f32, 0.5, n, &dev).unwrap();
        let x = Tensor::randn(0f32, 2.0, (bsz, t, k), &dev).unwrap().to_dtype(DType::BF16).unwrap();
        let l = Fp8Linear::new(&wt, &b, gelu, Fp8Mode::Emulated, ScalingConfig::default(), "l").unwrap();
        let y = l.forward(&x).unwrap();
        assert_eq!((y.dims(), y.dtype()), ([bsz, t, n].as_slice(), DType::BF16));
        let s = l.last_input_scale().unwrap();
        let xq = dequantize(&quantize(&x, &s).unwrap(), &s, DType::F32).unwrap();
        let wq = l.weight().dequantize(DType::F32).unwrap();
        let mut slow = stage0_baseline::linear(&xq, &wq, &l.bias().to_dtype(DType::F32).unwrap()).unwrap();
        if gelu {
            slow = stage0_baseline::gelu_tanh(&slow).unwrap();
        }
        // both end in one bf16 rounding: they agree to bf16's half step (2^-9) and summation order
        let c = compare_within(&y, &slow, 4e-3).unwrap();
        assert!(c.passed, "{bsz}x{t}x{k}->{n} gelu={gelu}: {c:?}");
    }
}

fn plan_on(info: &DeviceInfo, shape: Shape, args: Args, cuda_graph: bool) -> Result<shared::Plan, shared::SpeedkitError> {
    let auto = PrecisionRequest::Auto;
    plan(&Fp8 { args, ..Fp8::default() }, &Device::Cpu, info, shape, auto, auto, cuda_graph, false)
}

#[test]
fn refusals_name_cause_and_fix() {
    let shape = Preset::Te.shape();
    let a100 = DeviceInfo::simulated_cuda("NVIDIA A100-SXM4-80GB", (8, 0));
    let h100 = DeviceInfo::simulated_cuda("NVIDIA H100 80GB HBM3", (9, 0));
    // No FP8 tensor cores: refused by default...
    let e = plan_on(&a100, shape, Args::default(), false).unwrap_err().to_string();
    assert!(e.contains("no FP8 tensor cores") && e.contains("--fp8-emulate"), "{e}");
    // ...and labelled "emulated" when asked (unless this build cannot run attention on CUDA).
    match plan_on(&a100, shape, Args { fp8_emulate: true, ..Args::default() }, false) {
        Ok(plan) => assert!(Fp8::default().implementation(&plan).unwrap().starts_with("emulated")),
        Err(e) => assert!(e.to_string().contains("Fix:"), "{e}"),
    }
    // Hopper: the real thing, or a refusal that names its cause; never an unlabelled fallback.
    if let Ok(plan) = plan_on(&h100, shape, Args::default(), false) {
        assert_eq!(Fp8::default().implementation(&plan).unwrap(), "cuBLASLt E4M3, delayed scaling, fp8 fusions all");
        // dimensions that are not multiples of 16
        let odd = Shape { d_model: 4104, n_head: 57, ..shape };
        let e = plan_on(&h100, odd, Args::default(), false).unwrap_err().to_string();
        assert!(e.contains("multiple of 16") && e.contains("4104"), "{e}");
        let odd = Shape { batch: 1, seq: 100, ..shape };
        let e = plan_on(&h100, odd, Args::default(), false).unwrap_err().to_string();
        assert!(e.contains("token count") && e.contains("100"), "{e}");
        // both recipes can be graph-captured: delayed scaling's history lives and is updated on
        // the device
        for fp8_recipe in [Fp8Recipe::Delayed, Fp8Recipe::Current] {
            assert!(plan_on(&h100, shape, Args { fp8_recipe, ..Args::default() }, true).is_ok());
        }
    }
    // Other precisions are stages 1-3's.
    let e = Fp8::default().choose_precision(&h100, PrecisionRequest::Exactly(Precision::Bf16)).unwrap_err().to_string();
    assert!(e.contains("fp8") && e.contains("Fix:"), "{e}");
}

#[test]
fn on_the_cpu_stage_4_differs_from_stage_3_only_in_the_gemms() {
    // Activations in stage 3's dtype at the same --precision (by default bf16 on a CPU with a bf16
    // unit and f32 on one without, bf16 or fp32 when asked), and no note of a forced difference;
    // on a GPU, bf16 with a note when stage 3 would run something else.
    let (device, info) = select(DeviceRequest::Cpu).unwrap();
    let shape = Preset::Tiny.shape();
    let auto = stage1_tensorcore::precision::auto_dtype(&device).unwrap();
    for (requested, dtype) in [
        (PrecisionRequest::Auto, auto),
        (PrecisionRequest::Exactly(Precision::Fp8), auto),
        (PrecisionRequest::Exactly(Precision::Bf16), DType::BF16),
        (PrecisionRequest::Exactly(Precision::Fp32), DType::F32),
    ] {
        let spec = Fp8::default();
        let plan = plan(&spec, &device, &info, shape, PrecisionRequest::Auto, requested, false, false).unwrap();
        assert_eq!(spec.activation_dtype(&plan), (dtype, None), "{requested:?}");
        assert!(spec.notes(&plan).iter().all(|n| !n.contains("activations")), "{:?}", spec.notes(&plan));
        // It runs, within the fp8 tolerance, and its twin (same dtype, same fused residual) agrees.
        let w = BlockWeights::from_seed(&shape, 6).unwrap();
        let x = random_input(&shape, 6).unwrap();
        let block = Block::build(&w, &plan, &spec).unwrap();
        let (y, ran) = shared::ran::observe(|| block.forward(&x)).unwrap();
        // What the forward ran says so: attention's input in that dtype, the GEMMs FP8's.
        let notes = shared::ran::notes(&ran);
        let want = format!("{} into", shared::ran::dtype_name(dtype));
        let into_attention =
            notes.iter().filter_map(|n| n.strip_prefix("ran: activations ")).flat_map(|n| n.split("; ")).find(|g| g.contains("attention"));
        assert!(into_attention.is_some_and(|g| g.starts_with(&want)), "{requested:?}: {notes:?}");
        assert!(notes.iter().any(|n| n.starts_with("ran: GEMMs by kernel: fp8 gemm: emulated")), "{notes:?}");
        let twin = block.self_check(&x, &y).unwrap().unwrap();
        assert!(twin.result.passed, "{requested:?}: {twin:?}");
    }
    let h100 = DeviceInfo::simulated_cuda("NVIDIA H100 80GB HBM3", (9, 0));
    let requested = PrecisionRequest::Exactly(Precision::F16);
    let plan = shared::Plan {
        device: Device::Cpu,
        info: h100,
        precision: Precision::Fp8,
        precision_reason: String::new(),
        shape,
        requested,
        cuda_graph: false,
        train: false,
    };
    let (dt, note) = Fp8::default().activation_dtype(&plan);
    assert_eq!(dt, DType::BF16);
    assert!(note.as_deref().is_some_and(|n| n.contains("not stage 3's f16")), "{note:?}");
    // Training on CUDA: attention runs in the activations' bf16, so its backward is the kernel
    // (the plan's fp8 is the GEMMs'), and the notes say so; stage 2 at fp32 says candle's ops.
    let train = shared::Plan { train: true, requested: PrecisionRequest::Auto, ..plan };
    let notes = shared::Stage::notes(&Fp8::default(), &train);
    assert!(notes.iter().any(|n| n.contains("attention's backward is our kernel")), "{notes:?}");
    assert!(!notes.iter().any(|n| n.contains("materialise")), "{notes:?}");
    let fp32 = shared::Plan { precision: Precision::Fp32, ..train };
    let notes = shared::Stage::notes(&stage2_sdpa::Sdpa::default(), &fp32);
    assert!(notes.iter().any(|n| n.contains("with attention in f32: attention's backward runs as candle ops")), "{notes:?}");
}

/// The GEMM twin check at small (one GPT-2 small layer, 2048 tokens) on the CPU emulation:
/// all four GEMMs within their derived tolerances (te's K is covered GEMM by GEMM in
/// tests/gemm_twin.rs, the whole stage at te is too slow for a test on the CPU).
#[test]
fn gemm_twins_pass_at_small() {
    let shape = Preset::Small.shape();
    let (device, info) = select(DeviceRequest::Cpu).unwrap();
    let spec = stage(Fp8Recipe::Delayed);
    let plan = plan_alone(&spec, &device, &info, shape, PrecisionRequest::Auto).unwrap();
    let block = Block::build(&BlockWeights::from_seed(&shape, 7).unwrap(), &plan, &spec).unwrap();
    let x = random_input(&shape, 7).unwrap();
    let y = block.forward(&x).unwrap();
    let check = block.self_check(&x, &y).unwrap().unwrap();
    assert!(check.result.passed, "{check:?}");
    for name in ["qkv (K=768)", "proj (K=768)", "fc1 (K=768)", "fc2 (K=3072)"] {
        assert!(check.meaning.contains(name), "{}", check.meaning);
    }
}

/// `--fusions` is stage 3's switch; stage 4 runs stage 3's fusions as written, so when the run
/// turns some off, stage 4's label and notes say what it ran (its "vs previous" prices both).
#[test]
fn stage_4_labels_stage_3_fusions_it_runs_as_written() {
    let (device, info) = select(DeviceRequest::Cpu).unwrap();
    let shape = Preset::Tiny.shape();
    let spec = Fp8 { fused: stage3_fused::Fused { fusions: stage3_fused::Fusions::NONE, ..Default::default() }, ..Fp8::default() };
    let plan = plan_alone(&spec, &device, &info, shape, PrecisionRequest::Auto).unwrap();
    let label = spec.implementation(&plan).unwrap();
    assert!(label.ends_with("stage 3's fusions all (stage 4 runs them as written)"), "{label}");
    assert!(spec.notes(&plan).iter().any(|n| n.contains("--fusions none applies to stage 3 only")), "{:?}", spec.notes(&plan));
    let plain = Fp8::default();
    assert!(!plain.implementation(&plan).unwrap().contains("stage 3's fusions"));
}
