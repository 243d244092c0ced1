//! `--train`: one training step is the forward, the loss L = ⟨y, r⟩ (r seeded, so dL/dy = r),
//! the backward to every weight and to x, then the optimizer's update. Timed as TransformerEngine
//! times it (forward + backward), with the update timed beside it; checked first, gradient by
//! gradient, against stage 0's fp32 autograd, and the update against `candle_nn::AdamW`'s.

use crate::error::SpeedkitError;
use crate::stage::{train_params, Forward, Optimize, Plan, Precision, TapePass, TrainPass};
use crate::timing::{Progress, Stats};
use crate::weights::{BlockWeights, SplitMix64};
use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor, Var};
use serde::{Deserialize, Serialize};
use std::time::Instant;

/// The gradients' names, in `BlockWeights` order, then the input's.
pub const NAMES: [&str; 13] =
    ["ln1_g", "ln1_b", "w_qkv", "b_qkv", "w_proj", "b_proj", "ln2_g", "ln2_b", "w_fc1", "b_fc1", "w_fc2", "b_fc2", "x"];

/// Largest accepted max |g − g_ref| / max |g_ref| for any one gradient at `p`: the forward's,
/// widened for the backward's extra GEMMs and reductions.
pub fn grad_tolerance(p: Precision) -> f64 {
    match p {
        Precision::Fp32 => 1e-5,
        Precision::Tf32 => 1e-2,
        Precision::Bf16 => 2e-2,
        Precision::F16 => 2e-2,
        Precision::Fp8 => 2e-1,
    }
}

/// One training step's memory by part, in bytes (`Stage::estimate_train_bytes`), so a refusal
/// can say which part to shrink.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TrainBytes {
    /// The f32 weights as the optimizer's `Var`s, their gradients, and AdamW's two moments.
    pub params: u128,
    /// (B, n_head, T, T) tensors naive attention's autograd holds at once (none when fused).
    pub scores: u128,
    /// (B, T, C) and (B, T, FF) tensors the backward holds: saved activations and temporaries.
    pub activations: u128,
}

impl TrainBytes {
    pub fn total(&self) -> u128 {
        self.params.saturating_add(self.scores).saturating_add(self.activations)
    }

    /// The parts, largest first, as "what it is 1.23 GiB".
    pub fn describe(&self) -> String {
        let mut parts = [
            (self.scores, "naive attention's (B, n_head, T, T) tensors kept for the backward"),
            (self.activations, "the (B, T, C) and (B, T, FF) activations kept for the backward"),
            (self.params, "weights, gradients and AdamW's two moments (f32)"),
        ];
        parts.sort_by_key(|p| std::cmp::Reverse(p.0));
        let parts: Vec<String> =
            parts.iter().filter(|(b, _)| *b > 0).map(|(b, what)| format!("{what} {}", crate::runner::gib(*b))).collect();
        parts.join(", ")
    }
}

/// The most sequences (up to `limit`) whose training step, by `need`, fits 90 % of `avail` bytes;
/// all `limit` when `avail` is unknown, 1 when none fits (the runner refused that case up front).
pub fn piece_batch(shape: &crate::Shape, limit: usize, avail: Option<u64>, need: impl Fn(&crate::Shape) -> u128) -> usize {
    let Some(avail) = avail else { return limit.max(1) };
    let fits = |b: usize| need(&crate::Shape { batch: b, ..*shape }) <= avail as u128 * 9 / 10;
    (1..=limit.max(1)).rev().find(|&b| fits(b)).unwrap_or(1)
}

/// One tensor of a max-norm check: the largest |a − b| over its elements, and that over the
/// largest |b| (the reference's max norm).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TensorError {
    pub name: String,
    pub max_abs_err: f64,
    pub max_norm_ratio: f64,
}

/// A check of several tensors against a reference by max norms, as the gradient and the update
/// checks make it: per tensor max |a − b| / max |b| (max |a − b| where b is all zeros), the worst
/// against `tolerance`. The forward's check (`CheckResult::rel_err`) is an L2 ratio instead.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct MaxNormCheck {
    /// The worst tensor's max |a − b| / max |b|. Records before this name called it `rel_err`.
    #[serde(alias = "rel_err")]
    pub max_norm_ratio: f64,
    /// The largest |a − b| over every tensor (older records wrote 0 here).
    pub max_abs_err: f64,
    pub tolerance: f64,
    pub non_finite: usize,
    pub passed: bool,
    /// Each tensor's own max |a − b| and ratio, in `NAMES` order (absent from older records).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tensors: Vec<TensorError>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TrainRecord {
    pub optimizer: String,
    /// The update alone, per step (the row's `timing` is forward + backward).
    pub optimizer_timing: Stats,
    /// Every gradient against stage 0's autograd by max norms, and which was worst (`None` with --no-check).
    pub grad_check: Option<MaxNormCheck>,
    pub worst_grad: String,
    /// One update against `candle_nn::AdamW`'s on the same gradients, per weight: max |θ − θ_ref|
    /// beyond two f32 ulps of θ_ref, over max |θ_ref − θ₀| (`update_error`).
    pub optimizer_check: Option<MaxNormCheck>,
    /// Steps skipped for a non-finite gradient under loss scaling.
    pub skipped_steps: usize,
}

/// The seeded upstream gradient r (the shape of y), so L = ⟨y, r⟩ has dL/dy = r.
pub fn upstream(x: &Tensor, seed: u64) -> candle_core::Result<Tensor> {
    let r = SplitMix64::new(seed ^ 0x7261_696e).normals(x.elem_count()); // "rain": a stream of its own
    Tensor::from_vec(r, x.shape(), x.device())
}

/// Fresh copies of the weights as `Var`s (each stage's run starts from the same weights).
pub fn vars(w: &BlockWeights) -> candle_core::Result<Vec<Var>> {
    w.tensors().into_iter().map(|t| Var::from_tensor(&t.copy()?)).collect()
}

/// A `BlockWeights` whose tensors are the vars themselves.
pub fn weights_of(v: &[Var]) -> BlockWeights {
    let t: Vec<Tensor> = v.iter().map(|v| v.as_tensor().clone()).collect();
    BlockWeights::from_tensors(t.try_into().expect("twelve weights"))
}

/// Forward on x, the loss ⟨y, r⟩·`scale`, backward: y and every gradient.
pub fn step(forward: &dyn Forward, x: &Var, r: &Tensor, scale: f64) -> candle_core::Result<(Tensor, GradStore)> {
    let pass = Pass::forward(forward, x.as_tensor())?;
    let grads = pass.backward(r, scale)?;
    Ok((pass.output().clone(), grads))
}

/// A training forward and its backward: the stage's own schedule (`Forward::train_forward`), or
/// candle's autograd of the output (`TapePass`).
pub struct Pass(Box<dyn TrainPass>);

impl Pass {
    pub fn forward(forward: &dyn Forward, x: &Tensor) -> candle_core::Result<Pass> {
        let pass = match forward.train_forward(x) {
            Some(pass) => pass?,
            None => TapePass::boxed(forward.forward(x)?),
        };
        Ok(Pass(pass))
    }

    pub fn output(&self) -> &Tensor {
        self.0.output()
    }

    /// The gradients of the loss ⟨y, r⟩·`scale`: dL/dy = `scale`·r (the loss scale is a power of
    /// two, so scaling r is exact).
    pub fn backward(&self, r: &Tensor, scale: f64) -> candle_core::Result<GradStore> {
        self.0.backward(&if scale == 1.0 { r.clone() } else { r.affine(scale, 0.0)? })
    }
}

/// Most overflowed steps `accepted_step` lets the loss scale skip: 2^16 halved 24 times is 2^-8,
/// far below any scale a usable f16 backward needs.
pub const MAX_SKIPPED: usize = 24;

/// y and the 13 unscaled gradients of the first step `opt`'s loss scale does not overflow: what
/// the gradient check compares. A loss-scaled optimizer starts at a scale that may overflow by
/// design (f16: 2^16); such a step goes to `opt.step`, which skips it and lowers the scale, and
/// the step runs again at the new scale, at most `MAX_SKIPPED` times. Past that, or when the
/// optimizer takes a step whose gradients are not all finite, the gradients are returned as
/// they are and the check fails naming the first non-finite one. A clean step never reaches
/// `opt.step`: the weights stay those the reference's gradients were taken at.
pub fn accepted_step(
    forward: &dyn Forward,
    opt: &mut dyn Optimize,
    vars: &[Var],
    x: &Var,
    r: &Tensor,
) -> anyhow::Result<(Tensor, Vec<Tensor>)> {
    let mut skipped = 0;
    loop {
        let scale = opt.loss_scale();
        let (y, grads) = step(forward, x, r, scale)?;
        let got = gradients(&grads, vars, x, scale)?;
        if scale == 1.0 || skipped == MAX_SKIPPED || all_finite(&got)? || opt.step(&grads)? {
            return Ok((y, got));
        }
        skipped += 1;
    }
}

/// Whether every element of every tensor is finite (Σ|g| in f32 is, for any usable gradient).
fn all_finite(ts: &[Tensor]) -> candle_core::Result<bool> {
    for t in ts {
        if !t.to_dtype(DType::F32)?.abs()?.sum_all()?.to_scalar::<f32>()?.is_finite() {
            return Ok(false);
        }
    }
    Ok(true)
}

/// The 13 gradients (weights, then x) in f32, each divided by `scale`.
pub fn gradients(grads: &GradStore, vars: &[Var], x: &Var, scale: f64) -> candle_core::Result<Vec<Tensor>> {
    // Detached: candle computes a weight's gradient from forward activations as a tracked tensor,
    // whose op would keep that forward alive as long as the gradient (the reference's: all run).
    let grad = |(v, name): (&Var, &str)| match grads.get(v.as_tensor()) {
        Some(g) => g.detach().to_dtype(DType::F32)?.affine(1.0 / scale, 0.0),
        None => candle_core::bail!("the backward reached no gradient for {name}"),
    };
    vars.iter().chain([x]).zip(NAMES).map(grad).collect()
}

/// Each pair of `got` and `reference` (on the host) by max norms (`MaxNormCheck`), the worst
/// ratio against `tolerance`, and which pair it was (the first with a NaN or infinity in `got`,
/// if any).
fn worst(got: &[Tensor], reference: &[Tensor], tolerance: f64) -> candle_core::Result<(MaxNormCheck, usize)> {
    let (mut worst, mut at, mut bad, mut raw) = (0f64, 0, 0, 0f64);
    let mut tensors = Vec::with_capacity(got.len());
    for (i, (a, b)) in got.iter().zip(reference).enumerate() {
        let (a, b) = (crate::check::host_f32(a)?, crate::check::host_f32(b)?);
        let nan = a.iter().filter(|v| !v.is_finite()).count();
        let diff = a.iter().zip(&b).map(|(x, y)| (x - y).abs() as f64).fold(0.0, f64::max);
        let scale = b.iter().map(|y| y.abs() as f64).fold(0.0, f64::max);
        let e = if scale > 0.0 { diff / scale } else { diff };
        if bad == 0 && (e > worst || nan > 0) {
            at = i;
        }
        (worst, bad, raw) = (worst.max(e), bad + nan, raw.max(diff));
        tensors.push(TensorError { name: NAMES.get(i).unwrap_or(&"?").to_string(), max_abs_err: diff, max_norm_ratio: e });
    }
    let passed = bad == 0 && worst <= tolerance;
    Ok((MaxNormCheck { max_norm_ratio: worst, max_abs_err: raw, tolerance, non_finite: bad, passed, tensors }, at))
}

/// Each gradient against the reference's: the worst one's error and its name.
pub fn compare_grads(got: &[Tensor], reference: &[Tensor], p: Precision) -> candle_core::Result<(MaxNormCheck, String)> {
    if let Some(((g, r), n)) = got.iter().zip(reference).zip(NAMES).find(|((g, r), _)| g.dims() != r.dims()) {
        candle_core::bail!("the gradient of {n} has shape {:?}, the reference's {:?}", g.dims(), r.dims());
    }
    let (result, at) = worst(got, reference, grad_tolerance(p))?;
    Ok((result, NAMES[at].to_string()))
}

/// Stage 0's fp32 gradients for (x, r) in pieces of `chunk` sequences (weight gradients summed, x's joined).
pub fn reference_gradients(forward: &dyn Forward, vars: &[Var], x: &Tensor, r: &Tensor, chunk: usize) -> candle_core::Result<Vec<Tensor>> {
    let b = x.dim(0)?;
    let mut sum: Option<Vec<Tensor>> = None;
    let mut dx = Vec::new();
    for start in (0..b).step_by(chunk.max(1)) {
        let n = chunk.min(b - start);
        let xv = Var::from_tensor(&x.narrow(0, start, n)?)?;
        let (_, grads) = step(forward, &xv, &r.narrow(0, start, n)?, 1.0)?;
        let mut g = gradients(&grads, vars, &xv, 1.0)?;
        dx.push(g.pop().expect("x's gradient is last"));
        sum = Some(match sum {
            None => g,
            Some(s) => s.iter().zip(&g).map(|(a, b)| a + b).collect::<candle_core::Result<_>>()?,
        });
        x.device().synchronize()?;
    }
    let mut all = sum.unwrap_or_default();
    all.push(Tensor::cat(&dx, 0)?);
    Ok(all)
}

/// One update of `optimizer` against `candle_nn::AdamW`'s from the same weights and gradients
/// (`grads`, unscaled; the stage's optimizer gets them times its loss scale, as from a backward).
pub fn check_optimizer(
    make: &dyn Fn(Vec<Var>) -> anyhow::Result<Box<dyn Optimize>>,
    w: &BlockWeights,
    grads: &[Tensor],
) -> anyhow::Result<MaxNormCheck> {
    let (ours, theirs) = (vars(w)?, vars(w)?);
    let mut opt = make(ours.clone())?;
    let store = |v: &[Var], s: f64| -> candle_core::Result<GradStore> {
        let mut g = GradStore::default();
        for (v, grad) in v.iter().zip(grads) {
            g.insert(v.as_tensor(), grad.affine(s, 0.0)?);
        }
        Ok(g)
    };
    opt.step(&store(&ours, opt.loss_scale())?)?;
    let mut reference = <candle_nn::AdamW as candle_nn::Optimizer>::new(theirs.clone(), train_params())?;
    candle_nn::Optimizer::step(&mut reference, &store(&theirs, 1.0)?)?;
    let host = |v: &[Var]| v.iter().map(|v| crate::check::host_f32(v.as_tensor())).collect::<candle_core::Result<Vec<_>>>();
    let before = w.tensors().iter().map(|t| crate::check::host_f32(t)).collect::<candle_core::Result<Vec<_>>>()?;
    Ok(update_error(&host(&ours)?, &host(&theirs)?, &before))
}

/// One update against a reference update, per tensor: the largest |θ − θ_ref| beyond two f32 ulps
/// of θ_ref, over the largest |θ_ref − θ₀| (the update's size). An update is a small change to θ
/// (lr 1e-4 moves a LayerNorm gain near 1 by ~1e-4), and θ + Δθ is rounded to f32 on each side:
/// two correct implementations that round in another order (CUDA's kernel contracts
/// θ·(1 − lr·λ) − lr·u into one FMA, candle rounds each op) differ by an ulp of θ, which is 1.2e-3
/// of such an update (measured on an H100: 1.179e-3, one ulp exactly). Those ulps are forgiven; a
/// wrong update is not (dropping the weight decay moves θ ≈ 1 by lr·λ = 1e-6, eight ulps).
pub fn update_error(got: &[Vec<f32>], reference: &[Vec<f32>], before: &[Vec<f32>]) -> MaxNormCheck {
    let ulp = |x: f32| f32::from_bits(x.abs().to_bits() + 1) - x.abs();
    let (mut worst, mut raw, mut bad) = (0f64, 0f64, 0);
    let mut tensors = Vec::with_capacity(got.len());
    for (i, ((a, b), t0)) in got.iter().zip(reference).zip(before).enumerate() {
        bad += a.iter().filter(|v| !v.is_finite()).count();
        let size = b.iter().zip(t0).map(|(y, y0)| (y - y0).abs() as f64).fold(0.0, f64::max);
        let diff = |(x, y): (&f32, &f32)| (x - y).abs() as f64;
        let beyond = a.iter().zip(b).map(|(x, y)| (diff((x, y)) - 2.0 * ulp(*y) as f64).max(0.0)).fold(0.0, f64::max);
        let max_abs_err = a.iter().zip(b).map(diff).fold(0.0, f64::max);
        let e = if size > 0.0 { beyond / size } else { beyond };
        (raw, worst) = (raw.max(max_abs_err), worst.max(e));
        tensors.push(TensorError { name: NAMES.get(i).unwrap_or(&"?").to_string(), max_abs_err, max_norm_ratio: e });
    }
    let tolerance = 1e-4;
    MaxNormCheck { max_norm_ratio: worst, max_abs_err: raw, tolerance, non_finite: bad, passed: bad == 0 && worst <= tolerance, tensors }
}

/// `--train --breakdown`'s instrumented steps: per step, the forward and the backward (a
/// synchronize between them), the backward by part (`breakdown::record_backward`) and the update;
/// and the kernels each backward part ran in the last step.
#[derive(Default)]
pub struct StepParts {
    pub split: Vec<Vec<(&'static str, f64)>>,
    pub backward: Vec<Vec<(&'static str, f64)>>,
    pub kernels: Vec<Vec<String>>,
}

impl StepParts {
    /// The breakdown: `parts` forward and backward, `backward` by part then the optimizer, each
    /// backward part with the kernels it ran.
    pub fn summarise(self, iters: usize) -> candle_core::Result<crate::breakdown::Breakdown> {
        let method = "instrumented: a synchronize after the forward and after the backward; the backward by part at each \
                      part input's completed gradient"
            .to_string();
        let mut b = crate::breakdown::summarise(&self.split, iters, method.clone())?;
        b.backward = crate::breakdown::summarise(&self.backward, iters, method)?.parts;
        for (part, ran) in b.backward.iter_mut().zip(self.kernels) {
            part.kernels = ran;
        }
        Ok(b)
    }
}

/// `warmup` untimed steps, then `iters` timed (forward + backward, and apart the update); with
/// `parts`, `iters` more, instrumented (`StepParts`). Each step reports to `progress`
/// (`Progress::new(label, "training steps", total_steps(..))`: a line every 10 s, as the
/// forward's loop prints). Returns (forward + backward, update, the instrumented parts, skipped
/// steps).
pub fn time_steps(
    forward: &dyn Forward,
    opt: &mut dyn Optimize,
    x: &Var,
    r: &Tensor,
    (warmup, iters, parts): (usize, usize, bool),
    progress: &mut Progress,
) -> anyhow::Result<(Stats, Stats, Option<StepParts>, usize)> {
    let device = x.device().clone();
    let ms = |t: Instant| t.elapsed().as_secs_f64() * 1e3;
    let (mut fb, mut up, mut skipped, mut split) = (Vec::new(), Vec::new(), 0, StepParts::default());
    device.synchronize()?;
    for i in 0..total_steps(warmup, iters, parts) {
        let t0 = Instant::now();
        let instrumented = i >= warmup + iters;
        let (t_fb, loss_grads) = match instrumented {
            false => {
                let grads = Pass::forward(forward, x.as_tensor())?.backward(r, opt.loss_scale())?;
                device.synchronize()?;
                (ms(t0), grads)
            }
            true => {
                let mut t_f = 0.0;
                let fwd = || {
                    let pass = Pass::forward(forward, x.as_tensor())?;
                    device.synchronize()?; // the forward alone, then the backward from its loss
                    t_f = ms(t0);
                    Ok(pass)
                };
                let (_, grads, by_part) = crate::breakdown::record_backward(fwd, |pass| pass.backward(r, opt.loss_scale()))?;
                device.synchronize()?;
                let t_fb = ms(t0);
                split.split.push(vec![("forward", t_f), ("backward", t_fb - t_f)]);
                split.backward.push(by_part.iter().map(|p| (p.0, p.1)).collect());
                split.kernels = by_part.into_iter().map(|p| p.2).collect();
                (t_fb, grads)
            }
        };
        let t1 = Instant::now();
        skipped += usize::from(!opt.step(&loss_grads)?);
        device.synchronize()?;
        let t_up = ms(t1);
        if instrumented {
            split.backward.last_mut().expect("pushed above").push(("optimizer", t_up));
            split.kernels.push(vec![opt.name()]);
        } else if i >= warmup {
            fb.push(t_fb);
            up.push(t_up);
        }
        progress.tick(i, t_fb + t_up);
    }
    Ok((Stats::from_samples(fb), Stats::from_samples(up), parts.then_some(split), skipped))
}

/// The steps `time_steps` runs: warm-up, timed, and with `parts` the instrumented ones.
pub fn total_steps(warmup: usize, iters: usize, parts: bool) -> usize {
    warmup + iters + if parts { iters } else { 0 }
}

pub fn check_failed(stage: &str, what: &str, c: &MaxNormCheck, plan: &Plan) -> SpeedkitError {
    SpeedkitError::CheckFailed(format!(
        "{stage}'s {what} at {}: max |Δ| / max |ref| {:.3e} above the tolerance {:.1e} ({} values NaN or infinite), \
         against stage 0's fp32 autograd and candle-nn's AdamW on the same weights, input and r. Nothing was timed. \
         Fix: report it with this command line.",
        plan.precision, c.max_norm_ratio, c.tolerance, c.non_finite
    ))
}

#[cfg(test)]
#[path = "../tests/unit/train.rs"]
mod tests;
