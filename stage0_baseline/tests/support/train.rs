//! The training contract's checks, shared by every stage's `tests/train.rs` (included with
//! `#[path]`): a stage's block gradients through `Stage::build_train` — all 12 weights and x,
//! loss ⟨y, r⟩ — against stage 0's autograd at fp32, and one step of `Stage::optimizer` against
//! `candle_nn::AdamW` on the same gradients. On the CPU, at `tiny`.
#![allow(dead_code)] // each stage's tests use some of it

use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor, Var};
use candle_nn::Optimizer;
use shared::device::{select, DeviceRequest};
use shared::stage::{plan, train_params};
use shared::weights::{random_input, SplitMix64};
use shared::{BlockWeights, Plan, Precision, PrecisionRequest, Preset, Stage};

pub const NAMES: [&str; 13] =
    ["ln1_g", "ln1_b", "w_qkv", "b_qkv", "w_proj", "b_proj", "ln2_g", "ln2_b", "w_fc1", "b_fc1", "w_fc2", "b_fc2", "x"];

/// The f32 master weights as `Var`s, as the runner holds them.
pub fn vars(w: &BlockWeights) -> [Var; 12] {
    let t = [&w.ln1_g, &w.ln1_b, &w.w_qkv, &w.b_qkv, &w.w_proj, &w.b_proj, &w.ln2_g, &w.ln2_b, &w.w_fc1, &w.b_fc1, &w.w_fc2, &w.b_fc2];
    t.map(|t| Var::from_tensor(&t.copy().unwrap()).unwrap())
}

pub fn weights(v: &[Var; 12]) -> BlockWeights {
    let [ln1_g, ln1_b, w_qkv, b_qkv, w_proj, b_proj, ln2_g, ln2_b, w_fc1, b_fc1, w_fc2, b_fc2] = v.clone().map(|v| v.as_tensor().clone());
    BlockWeights { ln1_g, ln1_b, w_qkv, b_qkv, w_proj, b_proj, ln2_g, ln2_b, w_fc1, b_fc1, w_fc2, b_fc2 }
}

/// max |a − b| / max |b|.
pub fn rel_max(a: &Tensor, b: &Tensor) -> f32 {
    let v = |t: &Tensor| t.to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let (a, b) = (v(a), v(b));
    assert_eq!(a.len(), b.len());
    a.iter().zip(&b).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max) / b.iter().fold(0f32, |m, x| m.max(x.abs()))
}

/// A `--train` plan for `stage` at `p` on the CPU at `tiny` (so `check_train` runs).
pub fn train_plan(stage: &dyn Stage, p: Precision) -> Plan {
    let (device, info) = select(DeviceRequest::Cpu).unwrap();
    let asked = PrecisionRequest::Exactly(p);
    plan(stage, &device, &info, Preset::Tiny.shape(), asked, asked, false, true).unwrap()
}

/// The block's inputs from seed 12 (weights and x) and 13 (r), as `Var`s where trained.
pub struct Problem {
    pub w: BlockWeights,
    pub wv: [Var; 12],
    pub xv: Var,
    pub r: Tensor,
}

impl Problem {
    pub fn new() -> Problem {
        let shape = Preset::Tiny.shape();
        let w = BlockWeights::from_seed(&shape, 12).unwrap();
        let x = random_input(&shape, 12).unwrap();
        let r = Tensor::from_vec(SplitMix64::new(13).normals(x.elem_count()), x.shape(), x.device()).unwrap();
        Problem { wv: vars(&w), w, xv: Var::from_tensor(&x).unwrap(), r }
    }

    /// One step's forward and backward as the runner makes it (`shared::train::step`):
    /// `build_train` over the `Var`s, loss = Σ y·r·`scale`, backward — candle's tape, or the
    /// stage's own schedule where it has one (`Forward::train_forward`). Also returns y.
    pub fn backward(&self, stage: &dyn Stage, plan: &Plan, scale: f64) -> (Tensor, GradStore) {
        let f = stage.build_train(&weights(&self.wv), plan).unwrap();
        shared::train::step(f.as_ref(), &self.xv, &self.r, scale).unwrap()
    }

    /// `backward` through candle's tape whatever the stage schedules: `forward` differentiated
    /// by candle's autograd.
    pub fn backward_on_tape(&self, stage: &dyn Stage, plan: &Plan, scale: f64) -> (Tensor, GradStore) {
        struct Tape(Box<dyn shared::Forward>);
        impl shared::Forward for Tape {
            fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
                self.0.forward(x)
            }
        }
        let f = Tape(stage.build_train(&weights(&self.wv), plan).unwrap());
        shared::train::step(&f, &self.xv, &self.r, scale).unwrap()
    }

    /// Every weight's gradient and x's, in `NAMES` order.
    pub fn grads(&self, g: &GradStore) -> Vec<Tensor> {
        self.wv
            .iter()
            .chain([&self.xv])
            .zip(NAMES)
            .map(|(v, n)| g.get(v.as_tensor()).unwrap_or_else(|| panic!("no gradient for {n}")).clone())
            .collect()
    }
}

/// The block's gradients through `stage.build_train` at `p` (loss scale 1), checking on the way
/// that the training forward computes what `build`'s does, within `forward_tol` (max |Δ| / max |y|).
pub fn block_grads(stage: &dyn Stage, p: Precision, forward_tol: f32) -> Vec<Tensor> {
    let plan = train_plan(stage, p);
    let pr = Problem::new();
    let (y, g) = pr.backward(stage, &plan, 1.0);
    let untracked = stage.build(&pr.w, &plan).unwrap().forward(pr.xv.as_tensor()).unwrap();
    let moved = rel_max(&y, &untracked);
    assert!(moved <= forward_tol, "{} at {p}: the training forward moved by {moved} from build's", stage.name());
    pr.grads(&g)
}

/// `stage`'s gradients against stage 0's autograd at each (precision, tolerance): every
/// tensor's max |Δ| / max |g| within the tolerance. Returns the worst per precision.
pub fn check_against_stage_0(stage: &dyn Stage, cases: &[(Precision, f32, f32)]) -> Vec<(Precision, f32)> {
    let reference = block_grads(&stage0_baseline::Baseline, Precision::Fp32, 0.0);
    let mut out = vec![];
    for &(p, tol, forward_tol) in cases {
        let ours = block_grads(stage, p, forward_tol);
        let mut worst = (0f32, "");
        for ((name, a), b) in NAMES.iter().zip(&ours).zip(&reference) {
            assert_eq!(a.dims(), b.dims(), "d{name}");
            assert_eq!(a.dtype(), DType::F32, "d{name}: the master weights' gradients are f32");
            let e = rel_max(a, b);
            eprintln!("{} {p} d{name}: {e:.1e}", stage.name());
            assert!(e <= tol, "{} at {p}: d{name} off by {e} (tolerance {tol})", stage.name());
            if e >= worst.0 {
                worst = (e, name);
            }
        }
        eprintln!(
            "{} block gradients vs stage 0 autograd, tiny, {p}: worst max |Δ| / max |g| = {:.2e} (d{})",
            stage.name(),
            worst.0,
            worst.1
        );
        out.push((p, worst.0));
    }
    out
}

/// One step of `stage.optimizer` at `p` from the block's gradients (loss scaled by its
/// `loss_scale`), against `candle_nn::AdamW` with `train_params` on the same gradients unscaled,
/// over copies of the weights: every weight within `tol` (max |Δθ| / max |θ|). Steps the
/// optimizer skips (a gradient overflowed under loss scaling) must leave the weights as they
/// were and lower the scale. Returns the optimizer's name and the steps skipped.
pub fn step_matches_candle_adamw(stage: &dyn Stage, p: Precision, tol: f32) -> (String, usize) {
    let plan = train_plan(stage, p);
    let pr = Problem::new();
    let mut opt = stage.optimizer(pr.wv.to_vec(), &plan).unwrap();
    let copies = pr.wv.clone().map(|v| Var::from_tensor(&v.as_tensor().copy().unwrap()).unwrap());
    for skipped in 0..16 {
        let scale = opt.loss_scale();
        let (_, g) = pr.backward(stage, &plan, scale);
        let mut same = GradStore::default();
        for (v, c) in pr.wv.iter().zip(&copies) {
            let unscaled = (g.get(v.as_tensor()).expect("a gradient for every weight").to_dtype(DType::F32).unwrap() / scale).unwrap();
            same.insert(c.as_tensor(), unscaled);
        }
        if !opt.step(&g).unwrap() {
            assert!(opt.loss_scale() < scale, "{}: a skipped step must lower the loss scale", opt.name());
            for ((v, c), name) in pr.wv.iter().zip(&copies).zip(NAMES) {
                assert_eq!(rel_max(v.as_tensor(), c.as_tensor()), 0.0, "{}: a skipped step moved {name}", opt.name());
            }
            continue;
        }
        candle_nn::AdamW::new(copies.to_vec(), train_params()).unwrap().step(&same).unwrap();
        for ((v, c), name) in pr.wv.iter().zip(&copies).zip(NAMES) {
            let e = rel_max(v.as_tensor(), c.as_tensor());
            assert!(e <= tol, "{} ({}) at {p}: {name} after one step off candle-nn's by {e}", stage.name(), opt.name());
        }
        let moved = rel_max(&(pr.wv[2].as_tensor() - &pr.w.w_qkv).unwrap(), &pr.w.w_qkv);
        assert!(moved > 0.0, "{}: the step moved no weight", opt.name());
        return (opt.name(), skipped);
    }
    panic!("{} ({}) at {p}: 16 steps skipped in a row", stage.name(), opt.name());
}
