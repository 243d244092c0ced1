//! Stage 1 trains through the contract (`build_train`, `optimizer`): its block gradients against
//! stage 0's autograd at every precision it runs on the CPU, one optimizer step against
//! `candle_nn::AdamW`, and f16's loss-scaled optimizer skipping a step whose gradients overflow.

#[path = "../../stage0_baseline/tests/support/train.rs"]
mod train;

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor, Var};
use candle_nn::Optimizer;
use shared::stage::train_params;
use shared::{Precision, Stage};
use stage1_tensorcore::TensorCore;

#[test]
fn block_gradients_match_stage_0_autograd_on_tiny() {
    // Tolerance, max |Δ| / max |g| per tensor: 1e-5 at fp32 (the same ops as stage 0; measured
    // 0); 2e-2 at bf16 and 1e-2 at f16 (GEMM operands, and on the way back dY, rounded to 8 and
    // 11 significant bits; measured 5.3e-3, dln1_g, and 3.2e-3, db_fc1, on a CPU with
    // AVX512-BF16). The training forward is `build`'s, bit for bit.
    train::check_against_stage_0(&TensorCore, &[(Precision::Fp32, 1e-5, 0.0), (Precision::Bf16, 2e-2, 0.0), (Precision::F16, 1e-2, 0.0)]);
}

#[test]
fn one_step_matches_candle_adamw() {
    // fp32 and bf16: candle-nn's AdamW itself. f16: the same behind the loss scale, so the
    // first steps at S = 2^16 overflow f16 (|dy| = |r|·S > 65504) and are skipped until S fits;
    // the step taken is candle-nn's on the unscaled gradients up to f32 rounding of ÷S.
    for p in [Precision::Fp32, Precision::Bf16] {
        let (name, skipped) = train::step_matches_candle_adamw(&TensorCore, p, 0.0);
        assert_eq!((name.as_str(), skipped), ("candle-nn AdamW", 0));
    }
    let (name, skipped) = train::step_matches_candle_adamw(&TensorCore, Precision::F16, 1e-6);
    assert_eq!(name, "candle-nn AdamW, dynamic loss scaling");
    eprintln!("f16: {skipped} steps skipped before the scale fit");
}

#[test]
fn the_f16_optimizer_skips_an_overflowed_step_and_unscales_a_clean_one() {
    let plan = train::train_plan(&TensorCore, Precision::F16);
    let w = Var::from_tensor(&Tensor::new(&[1f32, -2.0, 3.0], &Device::Cpu).unwrap()).unwrap();
    let mut opt = TensorCore.optimizer(vec![w.clone()], &plan).unwrap();
    assert_eq!(opt.loss_scale(), 65536.0);
    // An f16 gradient that overflowed: skipped, θ untouched, S halved.
    let mut g = GradStore::default();
    g.insert(w.as_tensor(), Tensor::new(&[1f32, 70_000.0, 0.0], &Device::Cpu).unwrap().to_dtype(DType::F16).unwrap());
    assert!(!opt.step(&g).unwrap());
    assert_eq!(w.as_tensor().to_vec1::<f32>().unwrap(), [1.0, -2.0, 3.0]);
    assert_eq!(opt.loss_scale(), 32768.0);
    // A clean one: candle-nn's AdamW on g / S.
    let scaled = Tensor::new(&[32768f32, -16384.0, 8192.0], &Device::Cpu).unwrap();
    let mut g = GradStore::default();
    g.insert(w.as_tensor(), scaled.to_dtype(DType::F16).unwrap());
    assert!(opt.step(&g).unwrap());
    let twin = Var::from_tensor(&Tensor::new(&[1f32, -2.0, 3.0], &Device::Cpu).unwrap()).unwrap();
    let mut same = GradStore::default();
    same.insert(twin.as_tensor(), (scaled / 32768.0).unwrap());
    candle_nn::AdamW::new(vec![twin.clone()], train_params()).unwrap().step(&same).unwrap();
    assert_eq!(w.as_tensor().to_vec1::<f32>().unwrap(), twin.as_tensor().to_vec1::<f32>().unwrap());
}

/// The stage binary's f16 training check: the first step at S = 2^16 overflows f16 by design and
/// the scaler skips it; the check compares the first step it accepts, unscaled, so it passes
/// (it failed before on the skipped step's non-finite gradients).
#[test]
fn the_f16_training_check_passes_on_the_first_accepted_step() {
    let json = std::env::temp_dir().join(format!("speedkit-stage1-f16-train-{}.json", std::process::id()));
    let o = std::process::Command::new(env!("CARGO_BIN_EXE_stage1_tensorcore"))
        .args(["--device", "cpu", "--preset", "tiny", "--train", "--precision", "f16", "--warmup", "0", "--iters", "1"])
        .arg("--json")
        .arg(&json)
        .output()
        .unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    assert!(o.status.success(), "{text}");
    let record: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    std::fs::remove_file(&json).ok();
    let g = &record["train"]["grad_check"];
    assert_eq!(g["passed"], true, "{g}");
    assert_eq!(g["non_finite"], 0, "{g}");
    // Unscaled: a gradient still carrying S (≥ 1) would be off by orders of magnitude.
    let e = g["max_norm_ratio"].as_f64().unwrap();
    assert!(e > 0.0 && e <= 2e-2, "f16 gradients differ from fp32's by rounding, within the tolerance: {e}");
    assert_eq!(record["train"]["optimizer"], "candle-nn AdamW, dynamic loss scaling");
}
