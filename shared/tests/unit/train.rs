//! Unit tests of `shared/src/train.rs`, compiled into that module (`#[path]`), so they
//! reach its private items.

use super::*;
use crate::{Preset, Shape};

#[test]
fn pieces_are_the_most_sequences_that_fit() {
    let s = Shape { batch: 8, ..Preset::Small.shape() };
    let need = |s: &Shape| s.estimate_naive_train_bytes().total();
    let one = need(&Shape { batch: 1, ..s });
    assert_eq!(piece_batch(&s, 8, None, need), 8, "unknown free memory: the whole batch");
    assert_eq!(piece_batch(&s, 8, Some(u64::MAX), need), 8);
    assert_eq!(piece_batch(&s, 3, Some(u64::MAX), need), 3, "never past the element limit's piece");
    // Room for three sequences' steps (with the 10 % headroom), not four.
    let three = need(&Shape { batch: 3, ..s });
    assert_eq!(piece_batch(&s, 8, Some((three * 10 / 9 + 1) as u64), need), 3);
    assert_eq!(piece_batch(&s, 8, Some((one * 10 / 9 + 1) as u64), need), 1);
    assert_eq!(piece_batch(&s, 8, Some(1), need), 1, "none fits: one (the runner refused it up front)");
}

#[test]
fn a_training_step_names_its_largest_part_first() {
    let t = TrainBytes { params: 1 << 30, scores: 3 << 30, activations: 2 << 30 };
    assert_eq!(t.total(), 6 << 30);
    let d = t.describe();
    let at = |what: &str| d.find(what).unwrap_or_else(|| panic!("{what} in {d}"));
    assert!(at("(B, n_head, T, T)") < at("(B, T, FF)") && at("(B, T, FF)") < at("AdamW"), "{d}");
    assert!(d.contains("3.00 GiB"), "{d}");
    // A fused stage has no T x T part to name.
    assert!(!TrainBytes { scores: 0, ..t }.describe().contains("n_head, T, T"));
}

#[test]
fn an_update_rounded_in_another_order_passes_and_a_wrong_one_fails() {
    // θ near 1 (LayerNorm gains), an update of lr = 1e-4 as AdamW's first step makes it; the first
    // two are values where one rounding (FMA) and two give different f32 results.
    let before = vec![vec![1.0249665f32, 1.0021392, -0.984375, 0.0625, 0.0]];
    let step = |decay: f32, fma: bool| -> Vec<Vec<f32>> {
        let u = [-0.5f32, 1.0, 0.999, -1.0, 0.5]; // m̂ / (√v̂ + ε)
        let row = before[0].iter().zip(u).map(|(&t, u)| if fma { t.mul_add(decay, -1e-4 * u) } else { t * decay - 1e-4 * u }).collect();
        vec![row]
    };
    let decay = 1.0 - 1e-4 * 0.01;
    let (reference, fused) = (step(decay, false), step(decay, true));
    // The two orders of rounding differ, by at most an ulp or two of θ.
    let raw = update_error(&fused, &reference, &before).max_abs_err;
    assert!(raw > 0.0 && raw <= 2.5e-7, "the FMA order should differ from the separate one by an ulp of θ: {raw}");
    let r = update_error(&fused, &reference, &before);
    assert!(r.passed && r.max_norm_ratio == 0.0, "{r:?}");
    // Without the weight decay: eight ulps of θ ≈ 1, caught.
    let r = update_error(&step(1.0, true), &reference, &before);
    assert!(!r.passed && r.max_norm_ratio > 1e-3, "{r:?}");
    // A NaN is never forgiven.
    let mut nan = fused.clone();
    nan[0][4] = f32::NAN;
    assert!(!update_error(&nan, &reference, &before).passed);
}

/// A training run of minutes printed nothing until its table: the step loop reports progress as
/// the forward's does (here every step, with the interval at zero).
#[test]
fn training_steps_report_progress() {
    struct Scale(Var);
    impl Forward for Scale {
        fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
            let [x] = crate::breakdown::enter("ln1", [x])?; // one part, so the instrumented steps time its backward
            x.broadcast_mul(self.0.as_tensor())
        }
    }
    struct Nothing;
    impl Optimize for Nothing {
        fn name(&self) -> String {
            "none".into()
        }
        fn step(&mut self, _: &GradStore) -> anyhow::Result<bool> {
            Ok(true)
        }
    }
    let dev = candle_core::Device::Cpu;
    let w = Var::from_tensor(&Tensor::ones(4, DType::F32, &dev).unwrap()).unwrap();
    let x = Var::from_tensor(&Tensor::ones((1, 2, 4), DType::F32, &dev).unwrap()).unwrap();
    let r = Tensor::ones((1, 2, 4), DType::F32, &dev).unwrap();
    for parts in [false, true] {
        let total = total_steps(1, 3, parts);
        let mut progress = Progress::every("stage_t", "training steps", total, std::time::Duration::ZERO);
        let (fb, _, split, _) = time_steps(&Scale(w.clone()), &mut Nothing, &x, &r, (1, 3, parts), &mut progress).unwrap();
        let split =
            split.map(|s| (s.split.len(), s.backward.iter().map(|b| b.iter().map(|p| p.0).collect::<Vec<_>>()).collect::<Vec<_>>()));
        let want = parts.then(|| (3, vec![vec!["ln1", "optimizer"]; 3]));
        assert_eq!((fb.samples_ms.len(), split), (3, want));
        assert_eq!(progress.printed, total);
        let last = progress.last.unwrap();
        assert!(last.starts_with(&format!("[stage_t] {total} of {total} warm-up + timed training steps")), "{last}");
    }
    // At the default interval a short run prints nothing.
    let mut quiet = Progress::new("stage_t", "training steps", 4);
    time_steps(&Scale(w), &mut Nothing, &x, &r, (1, 3, false), &mut quiet).unwrap();
    assert_eq!(quiet.printed, 0);
}

#[test]
fn the_gradient_check_records_each_tensors_max_abs_difference_and_names_its_ratio() {
    let dev = candle_core::Device::Cpu;
    let t = |v: &[f32]| Tensor::new(v, &dev).unwrap();
    let reference = [t(&[1.0, -4.0]), t(&[0.5, 0.25]), t(&[0.0, 0.0])];
    let got = [t(&[1.0, -4.002]), t(&[0.5, 0.25]), t(&[0.0, 3e-6])];
    let (c, worst) = compare_grads(&got, &reference, Precision::Bf16).unwrap();
    // Per tensor: max |Δ|, and that over max |ref| (max |Δ| itself where ref is all zeros).
    let got: Vec<(&str, f64, f64)> = c.tensors.iter().map(|e| (e.name.as_str(), e.max_abs_err, e.max_norm_ratio)).collect();
    assert_eq!(got.iter().map(|g| g.0).collect::<Vec<_>>(), ["ln1_g", "ln1_b", "w_qkv"]);
    assert!((got[0].1 - 2e-3).abs() < 1e-6 && (got[0].2 - 5e-4).abs() < 1e-6, "{got:?}");
    assert_eq!((got[1].1, got[1].2), (0.0, 0.0));
    assert!((got[2].1 - 3e-6).abs() < 1e-9 && got[2].1 == got[2].2, "{got:?}");
    assert_eq!(worst, "ln1_g");
    assert!((c.max_norm_ratio - 5e-4).abs() < 1e-6 && (c.max_abs_err - 2e-3).abs() < 1e-6 && c.passed, "{c:?}");
    // Written under the name that says what it is.
    let json = serde_json::to_value(&c).unwrap();
    assert!(json.get("max_norm_ratio").is_some() && json.get("rel_err").is_none(), "{json}");
}

#[test]
fn a_recorded_gradient_check_under_its_old_name_still_reads() {
    let old = r#"{"rel_err": 0.0057, "max_abs_err": 0.0, "tolerance": 0.02, "non_finite": 0, "passed": true}"#;
    let c: MaxNormCheck = serde_json::from_str(old).unwrap();
    assert_eq!((c.max_norm_ratio, c.max_abs_err, c.tensors.len()), (0.0057, 0.0, 0));
    // A committed training run recorded before the rename reads with its ratios intact.
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../results/train-memory/ladder-train-t2048-cpu.json");
    let raw: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let report: crate::report::LadderReport = serde_json::from_value(raw.clone()).unwrap();
    for (r, j) in report.records.iter().zip(raw["records"].as_array().unwrap()) {
        let (g, j) = (r.train.as_ref().and_then(|t| t.grad_check.as_ref()).unwrap(), &j["train"]["grad_check"]);
        assert!(j.get("max_norm_ratio").is_none(), "{}: recorded under the old name", r.stage);
        let recorded = j["rel_err"].as_f64().unwrap();
        assert_eq!(g.max_norm_ratio, recorded, "{}", r.stage);
    }
}

/// The gradients `gradients` hands out (and the reference's, kept for a whole run) hold no graph:
/// a weight's gradient candle computes from a forward activation is itself a tracked tensor whose
/// op keeps that activation, and through it the whole forward, alive (stage 0's (B, n_head, T, T)
/// scores: tens of GiB at `te`).
#[test]
fn gradients_keep_no_forward_alive() {
    use candle_core::{Device, Var};
    let dev = Device::Cpu;
    let w = Var::from_tensor(&Tensor::randn(0f32, 1.0, (3, 4), &dev).unwrap()).unwrap();
    let x = Var::from_tensor(&Tensor::randn(0f32, 1.0, (5, 4), &dev).unwrap()).unwrap();
    let h = x.as_tensor().matmul(&w.as_tensor().t().unwrap()).unwrap().exp().unwrap(); // an activation
    let loss = h.sqr().unwrap().sum_all().unwrap();
    let grads = loss.backward().unwrap();
    // What candle hands back may be tracked (the reason for this test); ours must not be.
    let got = gradients(&grads, std::slice::from_ref(&w), &x, 2.0).unwrap();
    assert_eq!(got.len(), 2);
    for g in &got {
        assert!(!g.track_op(), "a gradient still records its op, and so the forward it came from");
    }
    let want = (grads.get(w.as_tensor()).unwrap() / 2.0).unwrap();
    assert_eq!(rel_max_for_test(&got[0], &want), 0.0);
}

fn rel_max_for_test(a: &Tensor, b: &Tensor) -> f32 {
    (a - b).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap()
}
