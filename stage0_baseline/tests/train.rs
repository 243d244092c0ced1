//! `--train` as the runner does it: the binary's training row, and the two checks that guard it
//! (every gradient against stage 0's autograd, one update against candle-nn's AdamW) failing when
//! a gradient or an update is wrong.

use candle_core::backprop::GradStore;
use candle_core::{Tensor, Var};
use shared::device::{select, DeviceRequest};
use shared::stage::{plan_alone, Optimize};
use shared::train::{check_optimizer, compare_grads, gradients, reference_gradients, step, upstream, vars, weights_of, NAMES};
use shared::weights::random_input;
use shared::{BlockWeights, Precision, PrecisionRequest, Preset, Stage};
use std::process::Command;

#[test]
fn the_binary_times_a_checked_training_step() {
    let json = std::env::temp_dir().join(format!("speedkit-train-{}.json", std::process::id()));
    let o = Command::new(env!("CARGO_BIN_EXE_stage0_baseline"))
        .args(["--preset", "tiny", "--warmup", "0", "--iters", "2", "--train", "--json"])
        .arg(&json)
        .output()
        .unwrap();
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{out}{}", String::from_utf8_lossy(&o.stderr));
    assert!(out.contains("check     gradients") && out.contains("optimizer candle-nn AdamW"), "{out}");
    let j: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    std::fs::remove_file(&json).unwrap();
    assert_eq!(j["mode"], "train");
    assert_eq!(j["train"]["grad_check"]["passed"], true);
    assert_eq!(j["train"]["optimizer_check"]["passed"], true);
    assert_eq!(j["train"]["optimizer_timing"]["samples_ms"].as_array().unwrap().len(), 2);
}

#[test]
fn cuda_graph_and_train_together_are_refused_before_any_work() {
    let o = Command::new(env!("CARGO_BIN_EXE_stage0_baseline")).args(["--preset", "tiny", "--train", "--cuda-graph"]).output().unwrap();
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("drop one of --train and --cuda-graph"));
}

/// Stage 0's gradients at `tiny`, through `build_train` (the contract the runner uses).
fn stage0_grads() -> (BlockWeights, Vec<Tensor>) {
    let shape = Preset::Tiny.shape();
    let (device, info) = select(DeviceRequest::Cpu).unwrap();
    let w = BlockWeights::from_seed(&shape, 3).unwrap();
    let x = random_input(&shape, 3).unwrap();
    let plan = plan_alone(&stage0_baseline::Baseline, &device, &info, shape, PrecisionRequest::Exactly(Precision::Fp32)).unwrap();
    let v = vars(&w).unwrap();
    let f = stage0_baseline::Baseline.build_train(&weights_of(&v), &plan).unwrap();
    let r = upstream(&x, 3).unwrap();
    // In one piece and in pieces of one sequence: the same gradients (summed, joined).
    let whole = reference_gradients(f.as_ref(), &v, &x, &r, 2).unwrap();
    let pieces = reference_gradients(f.as_ref(), &v, &x, &r, 1).unwrap();
    let (same, _) = compare_grads(&pieces, &whole, Precision::Fp32).unwrap();
    assert!(same.passed && same.max_norm_ratio < 1e-6, "{same:?}");
    let xv = Var::from_tensor(&x).unwrap();
    let (_, g) = step(f.as_ref(), &xv, &r, 1.0).unwrap();
    assert_eq!(gradients(&g, &v, &xv, 1.0).unwrap().len(), NAMES.len());
    (w, whole)
}

#[test]
fn a_wrong_gradient_fails_the_check_and_is_named() {
    let (_, g) = stage0_grads();
    let (ok, _) = compare_grads(&g, &g, Precision::Fp32).unwrap();
    assert!(ok.passed && ok.max_norm_ratio == 0.0);
    for (i, name) in NAMES.iter().enumerate() {
        let mut wrong = g.clone();
        wrong[i] = (&wrong[i] * 1.001).unwrap(); // 1e-3 off: 100x the fp32 tolerance
        let (bad, worst) = compare_grads(&wrong, &g, Precision::Fp32).unwrap();
        assert!(!bad.passed && worst == *name, "{name}: {bad:?} named {worst}");
    }
}

/// Plain SGD: a different update from AdamW's, which the update check must catch.
struct Sgd(Vec<Var>);
impl Optimize for Sgd {
    fn name(&self) -> String {
        "sgd".into()
    }
    fn step(&mut self, grads: &GradStore) -> anyhow::Result<bool> {
        for v in &self.0 {
            v.set(&(v.as_tensor() - (grads.get(v.as_tensor()).unwrap() * 1e-4)?)?)?;
        }
        Ok(true)
    }
}

#[test]
fn the_update_check_passes_adamw_and_fails_another_update() {
    let (w, g) = stage0_grads();
    let plan_free = |v: Vec<Var>| -> anyhow::Result<Box<dyn Optimize>> {
        Ok(Box::new(shared::stage::CandleAdamW(<candle_nn::AdamW as candle_nn::Optimizer>::new(v, shared::stage::train_params())?)))
    };
    let same = check_optimizer(&plan_free, &w, &g[..12]).unwrap();
    assert!(same.passed && same.max_norm_ratio == 0.0, "{same:?}");
    let sgd = |v: Vec<Var>| -> anyhow::Result<Box<dyn Optimize>> { Ok(Box::new(Sgd(v))) };
    let other = check_optimizer(&sgd, &w, &g[..12]).unwrap();
    assert!(!other.passed, "{other:?}");
}
