//! Stage 4 trains through the contract (`build_train`, `optimizer`), emulated on the CPU: its
//! block gradients through the HYBRID backward (E5M2 dY against the forward's E4M3 operands)
//! against stage 0's autograd, the scale state carried across steps (the inputs' amax
//! histories and dY's), one optimizer step against `candle_nn::AdamW`, and the refusals (and
//! what is no longer refused: CUDA on FP8 tensor cores, the GEMMs of `tests/cublaslt_train.rs`).

#[path = "../../stage0_baseline/tests/support/train.rs"]
mod train;

use candle_core::DType;
use shared::device::DeviceKind;
use shared::{Precision, Stage};
use stage4_fp8::fp8::Fp8Recipe;
use stage4_fp8::{Args, Fp8, Fp8Fusions, TrainBlock};

#[test]
fn block_gradients_match_stage_0_autograd_on_tiny() {
    // Tolerance, max |Δ| / max |g| per tensor: 2e-1. Every GEMM's operands are E4M3 (3
    // mantissa bits: each off by up to 1/16) and every dY E5M2 (2 bits: up to 1/8), and a
    // gradient that reaches a LayerNorm gain or a weight is a sum over rows of such products,
    // with cancellation. Measured on `tiny`: worst 1.2e-1 (dln1_g); with dY left unquantised
    // (E4M3 operands alone) 5.3e-2, so E5M2 roughly doubles it. A wrong scale or layout is O(1).
    // The training forward is `build`'s but for fc2's residual, added after the store instead of
    // in the GEMM's epilogue (≤ 1e-3).
    for recipe in [Fp8Recipe::Delayed, Fp8Recipe::Current] {
        let stage = Fp8 { args: Args { fp8_recipe: recipe, ..Args::default() }, ..Fp8::default() };
        train::check_against_stage_0(&stage, &[(Precision::Fp8, 2e-1, 1e-3)]);
    }
}

#[test]
fn the_scale_state_carries_across_steps() {
    // Three training steps on one `build_train`: each layer's input amax history and dY's gain
    // one entry per step (a fresh build per step would restart them: a history filled with one
    // amax), and the weights change.
    let stage = Fp8::default();
    let plan = train::train_plan(&stage, Precision::Fp8);
    let pr = train::Problem::new();
    let block = TrainBlock::build(&train::weights(&pr.wv), &plan, &stage).unwrap();
    let mut opt = stage.optimizer(pr.wv.to_vec(), &plan).unwrap();
    for step in 0..3 {
        // A new batch per step, so that each step's amaxes differ (LayerNorm makes them
        // independent of x's scale).
        let x = shared::weights::random_input(&shared::Preset::Tiny.shape(), 20 + step).unwrap();
        let y = shared::Forward::forward(&block, &x).unwrap();
        let g = (y.to_dtype(DType::F32).unwrap() * &pr.r).unwrap().sum_all().unwrap().backward().unwrap();
        assert!(opt.step(&g).unwrap());
    }
    for (name, h) in ["qkv", "proj", "fc1", "fc2"].iter().zip(block.input_amax_histories().unwrap()) {
        let n = h.len();
        assert!(h[..n - 3].iter().all(|a| *a == h[n - 3]), "{name}: the first call fills the history: {h:?}");
        assert!(h[n - 3] != h[n - 2] || h[n - 2] != h[n - 1], "{name}: each step's amax is recorded: {h:?}");
    }
    for (name, h) in ["qkv", "proj", "fc1", "fc2"].iter().zip(block.grad_amax_histories().unwrap()) {
        assert_eq!(h.len(), 4, "{name}: dY's history: the first call's fill and three records: {h:?}");
        assert!(h.iter().all(|a| a.is_finite() && *a > 0.0), "{name}: {h:?}");
    }
    assert!(train::rel_max(&(pr.wv[2].as_tensor() - &pr.w.w_qkv).unwrap(), &pr.w.w_qkv) > 0.0);
}

#[test]
fn one_step_matches_candle_adamw() {
    // Stage 3's fused AdamW, at stage 3's tolerance: FP8 leaves the update of the f32 masters as it was.
    let (name, skipped) = train::step_matches_candle_adamw(&Fp8::default(), Precision::Fp8, 1e-6);
    assert_eq!((name.as_str(), skipped), ("fused AdamW", 0));
}

#[test]
fn what_cannot_train_is_refused_with_the_fix() {
    let stage = Fp8::default();
    let mut plan = train::train_plan(&stage, Precision::Fp8);
    assert!(stage.implementation(&plan).unwrap().contains("fp8 fusions none (training)"), "the label says what trains");
    // On CUDA: refused without FP8 tensor cores (the emulation's backward is CPU-only); on
    // Hopper the HYBRID recipe trains through cuBLASLt, and the label says so.
    plan.info.kind = DeviceKind::Cuda;
    plan.info.sm = Some((8, 0));
    let e = stage.check_train(&plan).unwrap_err().to_string();
    assert!(e.contains("FP8 tensor cores") && e.contains("--fp8-emulate") && e.contains("Fix:"), "{e}");
    plan.info.sm = Some((9, 0));
    assert!(stage.check_train(&plan).is_ok());
    let label = stage.implementation(&plan).unwrap();
    assert!(label.contains("cuBLASLt E4M3") && label.contains("HYBRID backward: cuBLASLt E4M3 × E5M2"), "{label}");
    (plan.info.kind, plan.info.sm) = (DeviceKind::Cpu, None);
    let fused = Fp8 { args: Args { fp8_fusions: Some(Fp8Fusions::ALL.without("fc1")), ..Args::default() }, ..stage };
    let e = fused.check_train(&plan).unwrap_err().to_string();
    assert!(e.contains("--fp8-fusions ln") && e.contains("Fix:"), "{e}");
    let none = Fp8 { args: Args { fp8_fusions: Some(Fp8Fusions::NONE), ..Args::default() }, ..stage };
    assert!(none.check_train(&plan).is_ok());
}
