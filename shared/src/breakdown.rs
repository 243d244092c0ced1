//! `--breakdown`: where the milliseconds go inside one forward. A stage's `forward` calls
//! `part("ln1")?`, ... where each part begins (a no-op outside `record`): on the CPU a synchronize
//! and a clock read; on a GPU a CUDA event (the queue keeps going).
//! Boundaries stop work overlapping across them, so the total stands beside the uninstrumented median.

use crate::timing::Stats;
use candle_core::{Device, Result, Tensor};
use serde::{Deserialize, Serialize};
use std::cell::RefCell;
use std::time::Instant;

/// The block's parts in forward order; a fused part joins names, e.g. stage 3's "proj+residual+ln2".
pub const PARTS: [&str; 7] = ["ln1", "qkv", "attention", "proj+residual", "ln2", "fc1+gelu", "fc2+residual"];

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PartTime {
    pub name: String,
    pub median_ms: f64,
    pub p10_ms: f64,
    pub p90_ms: f64,
    /// One per iteration, so rounds can be merged (`merge`).
    #[serde(default)]
    pub samples_ms: Vec<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub regime: Option<crate::regime::PartRegime>,
    /// The kernels this part ran, in order ("name ×n" for n runs), as each code path named itself
    /// when it executed (`cpu_kernels::trace`): what ran, not what the flags asked for.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub kernels: Vec<String>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Breakdown {
    pub parts: Vec<PartTime>,
    /// A training step's backward by part (`--train --breakdown`), in the order it runs (the
    /// forward's parts reversed), then the optimizer's update; empty for a forward.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub backward: Vec<PartTime>,
    /// Median of the per-iteration sums of the parts.
    pub total_ms: f64,
    #[serde(default)]
    pub total_samples_ms: Vec<f64>,
    pub iters: usize,
    pub method: String,
}

impl Breakdown {
    fn from_samples(parts: Vec<(String, Vec<f64>)>, total: Vec<f64>, iters: usize, method: String) -> Breakdown {
        let Stats { median_ms: total_ms, samples_ms: total_samples_ms, .. } = Stats::from_samples(total);
        Breakdown { parts: part_times(parts), backward: Vec::new(), total_ms, total_samples_ms, iters, method }
    }
}

/// (name, samples) as parts with their percentiles.
fn part_times(parts: Vec<(String, Vec<f64>)>) -> Vec<PartTime> {
    let part = |(name, samples)| {
        let Stats { median_ms, p10_ms, p90_ms, samples_ms, .. } = Stats::from_samples(samples);
        PartTime { name, median_ms, p10_ms, p90_ms, samples_ms, regime: None, kernels: Vec::new() }
    };
    parts.into_iter().map(part).collect()
}

enum Clock {
    Host(Instant),
    #[cfg(feature = "cuda")]
    Event(candle_core::cuda::cudarc::driver::CudaEvent),
}

struct Recorder {
    device: Device,
    /// (part, when it began), in order.
    marks: Vec<(&'static str, Clock)>,
    /// The kernels each closed part ran, in order (`cpu_kernels::trace`).
    kernels: Vec<Vec<String>>,
}

thread_local! {
    static RECORDER: RefCell<Option<Recorder>> = const { RefCell::new(None) };
}

/// A part of the block begins here (a no-op unless this thread is recording, or observing what
/// ran: `ran::observe`).
pub fn part(name: &'static str) -> Result<()> {
    crate::ran::boundary(name);
    RECORDER.with(|r| r.borrow_mut().as_mut().map_or(Ok(()), |rec| rec.boundary(Some(name))))
}

/// Part `name` begins here and takes `xs` as its inputs: `part(name)` for the forward's clock,
/// and, while a training step's backward is being recorded (`record_backward`), each input
/// passed through an identity op whose backward stamps the moment the part's backward is done.
/// candle's backward visits an op only after every op that used its output, so that op's
/// backward runs once all of the part's ops have run theirs. Several inputs share one identity op
/// (joined and split again: a copy in the instrumented forward, and one pass more in the part's
/// backward). Otherwise the inputs come back as they are.
pub fn enter<const N: usize>(name: &'static str, xs: [&Tensor; N]) -> Result<[Tensor; N]> {
    part(name)?;
    crate::ran::inputs(xs.iter().map(|x| x.dtype()));
    let marking = BACKWARD.with(|b| b.borrow().as_ref().is_some_and(|log| log.marking));
    if marking && N > 1 && xs.iter().all(|x| x.track_op()) {
        // Several inputs (stages 0–2's q, k, v) go through ONE identity op, joined along their
        // last dimension and split again: separate ones would stamp as soon as their own branch
        // of the part's backward is done (v's, say, while q's is still running), and the
        // backward would run the part before's ops (v's projection) in between.
        let last = xs[0].rank().saturating_sub(1);
        let owned: Vec<Tensor> = xs.iter().map(|x| (*x).clone()).collect();
        if let Ok(joined) = Tensor::cat(&owned, last) {
            let joined = joined.apply_op1(Enter(name))?;
            let mut at = 0;
            let mut out = Vec::with_capacity(N);
            for x in xs {
                let n = x.dim(last)?;
                out.push(joined.narrow(last, at, n)?);
                at += n;
            }
            return Ok(out.try_into().unwrap_or_else(|_| unreachable!("N inputs, N outputs")));
        }
    }
    let mark = |x: &Tensor| match marking && x.track_op() {
        true => x.apply_op1(Enter(name)),
        false => Ok(x.clone()),
    };
    let mut out = Vec::with_capacity(N);
    for x in xs {
        out.push(mark(x)?);
    }
    Ok(out.try_into().unwrap_or_else(|_| unreachable!("N inputs, N outputs")))
}

/// The identity op `enter` puts on a part's input: its forward copies, its backward hands the
/// gradient on and stamps the part done.
struct Enter(&'static str);

impl candle_core::CustomOp1 for Enter {
    fn name(&self) -> &'static str {
        "speedkit-breakdown-enter"
    }

    fn cpu_fwd(&self, s: &candle_core::CpuStorage, l: &candle_core::Layout) -> Result<(candle_core::CpuStorage, candle_core::Shape)> {
        use candle_core::backend::{BackendDevice, BackendStorage};
        // SAFETY: every element is written by the copy below before anything reads it.
        let mut out = unsafe { candle_core::cpu_backend::CpuDevice.alloc_uninit(l.shape(), s.dtype())? };
        s.copy_strided_src(&mut out, 0, l)?;
        Ok((out, l.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s: &candle_core::CudaStorage, l: &candle_core::Layout) -> Result<(candle_core::CudaStorage, candle_core::Shape)> {
        use candle_core::backend::{BackendDevice, BackendStorage};
        // SAFETY: every element is written by the copy below before anything reads it.
        let mut out = unsafe { s.device().alloc_uninit(l.shape(), s.dtype())? };
        s.copy_strided_src(&mut out, 0, l)?;
        Ok((out, l.shape().clone()))
    }

    fn bwd(&self, _arg: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        backward_part_done(self.0, grad.device())?;
        Ok(Some(grad.clone()))
    }
}

/// Part `name`'s backward is done: what `enter`'s identity op stamps when candle's backward
/// reaches it, called by a backward the stage schedules itself (`Forward::train_forward`) once
/// the gradients of the part's inputs are complete. A no-op unless a step is being recorded.
pub fn backward_part_done(name: &'static str, device: &Device) -> Result<()> {
    device.synchronize()?; // the part's backward work, queued on a GPU, is done
    let now = Instant::now();
    BACKWARD.with(|b| {
        if let Some(log) = b.borrow_mut().as_mut() {
            log.stamps.push((name, now, cpu_kernels::trace::take()));
        }
    });
    Ok(())
}

/// What one recorded backward saw: when it began, and each part input's gradient completion
/// (part, when, the kernels run since the stamp before).
struct BackwardLog {
    /// Whether `enter` marks inputs (the instrumented forward of a recorded step).
    marking: bool,
    start: Option<Instant>,
    stamps: Vec<(&'static str, Instant, Vec<String>)>,
}

thread_local! {
    static BACKWARD: RefCell<Option<BackwardLog>> = const { RefCell::new(None) };
}

/// One part's backward: its name, ms, and the kernels it ran.
pub type BackwardPart = (&'static str, f64, Vec<String>);

/// One instrumented training step's backward by part: `forward` runs with every `enter` marking
/// its inputs, then `backward` (on the forward's output); returns its result and (part, ms, the
/// kernels it ran) in the order the backward ran them — the forward's parts reversed. A part's
/// backward runs from the end of the one before it (the first: from the backward's start) to its
/// inputs' gradients being complete; the first part of the forward runs to the backward's end.
pub fn record_backward<T, R>(
    forward: impl FnOnce() -> Result<T>,
    backward: impl FnOnce(&T) -> Result<R>,
) -> Result<(T, R, Vec<BackwardPart>)> {
    BACKWARD.with(|b| *b.borrow_mut() = Some(BackwardLog { marking: true, start: None, stamps: Vec::new() }));
    let y = forward();
    let y = match y {
        Ok(y) => y,
        Err(e) => {
            BACKWARD.with(|b| b.borrow_mut().take());
            return Err(e);
        }
    };
    cpu_kernels::trace::start();
    BACKWARD.with(|b| {
        if let Some(log) = b.borrow_mut().as_mut() {
            log.marking = false;
            log.start = Some(Instant::now());
        }
    });
    let out = backward(&y);
    let end = Instant::now();
    let tail = cpu_kernels::trace::take();
    cpu_kernels::trace::stop();
    let log = BACKWARD.with(|b| b.borrow_mut().take()).expect("installed above");
    let out = out?;
    let start = log.start.expect("set above");
    // The first stamp of each part closes it; later stamps of a closed part (its other inputs)
    // hand their kernels to the part still open.
    let mut parts: Vec<BackwardPart> = Vec::new();
    let (mut from, mut pending) = (start, Vec::new());
    for (name, at, ran) in log.stamps {
        pending.extend(ran);
        if parts.iter().any(|p| p.0 == name) {
            continue;
        }
        parts.push((name, (at - from).as_secs_f64() * 1e3, group(std::mem::take(&mut pending))));
        from = at;
    }
    pending.extend(tail);
    match parts.last_mut() {
        Some(last) => {
            last.1 += (end - from).as_secs_f64() * 1e3;
            let mut ran = std::mem::take(&mut last.2);
            ran.extend(pending);
            last.2 = group(ran);
        }
        None => candle_core::bail!("breakdown: the backward stamped no part (the forward does not call shared::breakdown::enter)"),
    }
    Ok((y, out, parts))
}

/// Kernel names as `trace::take` gives them ("name ×n", first-run order) pooled across several
/// takes the same way: one entry per name, in first-run order, with the total count.
pub(crate) fn group(ran: Vec<String>) -> Vec<String> {
    let split = |s: &str| -> (String, usize) {
        match s.rsplit_once(" ×") {
            Some((n, k)) if k.parse::<usize>().is_ok() => (n.to_string(), k.parse().unwrap_or(1)),
            _ => (s.to_string(), 1),
        }
    };
    let mut out: Vec<(String, usize)> = Vec::new();
    for (name, n) in ran.iter().map(|s| split(s)) {
        match out.iter_mut().find(|(k, _)| *k == name) {
            Some((_, k)) => *k += n,
            None => out.push((name, n)),
        }
    }
    out.into_iter().map(|(name, n)| if n == 1 { name } else { format!("{name} ×{n}") }).collect()
}

/// Timing on: with cudarc's default, CU_EVENT_DISABLE_TIMING, cuEventElapsedTime fails.
#[cfg(feature = "cuda")]
const TIMING_EVENT: candle_core::cuda::cudarc::driver::sys::CUevent_flags =
    candle_core::cuda::cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT;

impl Recorder {
    /// Close the open part (if any) and open `next` (if any).
    fn boundary(&mut self, next: Option<&'static str>) -> Result<()> {
        let ran = cpu_kernels::trace::take(); // what the part now closing ran
        if !self.marks.is_empty() {
            self.kernels.push(ran);
        }
        #[cfg(feature = "cuda")]
        if let Device::Cuda(d) = &self.device {
            let event = d.cuda_stream().record_event(Some(TIMING_EVENT)).map_err(candle_core::Error::wrap)?;
            self.marks.push((next.unwrap_or(""), Clock::Event(event)));
            return Ok(());
        }
        self.device.synchronize()?;
        self.marks.push((next.unwrap_or(""), Clock::Host(Instant::now())));
        Ok(())
    }

    /// (part, ms) for the forward just recorded; waits for the GPU first.
    fn times(&self) -> Result<Vec<(&'static str, f64)>> {
        self.device.synchronize()?;
        let ms = |w: &[(&'static str, Clock)]| match (&w[0].1, &w[1].1) {
            (Clock::Host(a), Clock::Host(b)) => Ok((w[0].0, (*b - *a).as_secs_f64() * 1e3)),
            #[cfg(feature = "cuda")]
            (Clock::Event(a), Clock::Event(b)) => Ok((w[0].0, a.elapsed_ms(b).map_err(candle_core::Error::wrap)? as f64)),
            #[cfg(feature = "cuda")]
            _ => candle_core::bail!("breakdown: host and CUDA clocks mixed in one forward"),
        };
        self.marks.windows(2).map(ms).collect()
    }
}

/// Run `forward` `warmup` + `iters` times with the boundaries recorded; a forward that marks no
/// part is an error (the stage is not instrumented).
pub fn record(device: &Device, warmup: usize, iters: usize, mut forward: impl FnMut() -> Result<Tensor>) -> Result<Breakdown> {
    let method = if device.is_cuda() { "a CUDA event" } else { "device synchronize" };
    let mut samples = Vec::with_capacity(iters);
    let mut kernels = Vec::new();
    for i in 0..warmup + iters {
        RECORDER.with(|r| *r.borrow_mut() = Some(Recorder { device: device.clone(), marks: Vec::new(), kernels: Vec::new() }));
        cpu_kernels::trace::start();
        let y = forward();
        // The recorder comes off whatever the forward did; the forward's end closes the last part.
        let mut rec = RECORDER.with(|r| r.borrow_mut().take()).expect("the recorder installed above");
        let closed = if y.is_ok() { rec.boundary(None) } else { Ok(()) };
        cpu_kernels::trace::stop(); // recording ends whatever the forward did
        let y = y?;
        closed?;
        kernels = std::mem::take(&mut rec.kernels);
        drop(y);
        let times = rec.times()?;
        if times.is_empty() {
            candle_core::bail!("breakdown: the forward marked no part (it does not call shared::breakdown::part)");
        }
        if i >= warmup {
            samples.push(times);
        }
    }
    let mut b = summarise(&samples, iters, format!("instrumented: {method} at each part boundary"))?;
    for (part, ran) in b.parts.iter_mut().zip(kernels) {
        part.kernels = ran;
    }
    Ok(b)
}

/// Per-part percentiles and the median total of per-iteration (part, ms) lists.
pub fn summarise(samples: &[Vec<(&'static str, f64)>], iters: usize, method: String) -> Result<Breakdown> {
    let Some(first) = samples.first() else { candle_core::bail!("breakdown: no timed iteration") };
    if samples.iter().any(|s| s.iter().map(|p| p.0).ne(first.iter().map(|p| p.0))) {
        candle_core::bail!("breakdown: the forward marked different parts on different iterations");
    }
    let parts = first.iter().enumerate().map(|(j, p)| (p.0.to_string(), samples.iter().map(|s| s[j].1).collect())).collect();
    let total = samples.iter().map(|s| s.iter().map(|p| p.1).sum()).collect();
    Ok(Breakdown::from_samples(parts, total, iters, method))
}

/// Two breakdowns of one stage (the ladder's rounds) pooled; `None` when they name different parts.
pub fn merge(a: &Breakdown, b: &Breakdown) -> Option<Breakdown> {
    if a.parts.iter().map(|p| &p.name).ne(b.parts.iter().map(|p| &p.name)) {
        return None;
    }
    if a.backward.iter().map(|p| &p.name).ne(b.backward.iter().map(|p| &p.name)) {
        return None;
    }
    let pooled = |x: &[f64], y: &[f64]| x.iter().chain(y).copied().collect();
    let pool = |x: &[PartTime], y: &[PartTime]| -> Vec<(String, Vec<f64>)> {
        x.iter().zip(y).map(|(p, q)| (p.name.clone(), pooled(&p.samples_ms, &q.samples_ms))).collect()
    };
    let total = pooled(&a.total_samples_ms, &b.total_samples_ms);
    let mut merged = Breakdown::from_samples(pool(&a.parts, &b.parts), total, a.iters + b.iters, a.method.clone());
    let mut backward = part_times(pool(&a.backward, &b.backward));
    for ((m, p), q) in merged.parts.iter_mut().zip(&a.parts).zip(&b.parts) {
        m.kernels = if p.kernels.is_empty() { q.kernels.clone() } else { p.kernels.clone() };
    }
    for (m, p) in backward.iter_mut().zip(&a.backward) {
        m.kernels = p.kernels.clone();
    }
    merged.backward = backward;
    Some(merged)
}

/// One line per part, then the total beside the uninstrumented median.
pub fn text(b: &Breakdown, uninstrumented_ms: f64) -> String {
    let mut out = format!("breakdown ({}, {} iterations)\n", b.method, b.iters);
    let width = b.parts.iter().map(|p| p.name.len()).max().unwrap_or(0);
    for PartTime { name, median_ms, p10_ms, p90_ms, .. } in &b.parts {
        let pct = 100.0 * median_ms / b.total_ms.max(f64::MIN_POSITIVE);
        out += &format!("  {name:<width$}  {median_ms:>9.3} ms  ({pct:>5.1} %)  p10-p90 {p10_ms:.3}-{p90_ms:.3}\n");
    }
    out += &format!("  {:<width$}  {:>9.3} ms  (uninstrumented median {uninstrumented_ms:.3} ms)\n", "total", b.total_ms);
    if !b.backward.is_empty() {
        out += "the backward by part, in the order it runs, and the optimizer's update\n";
        let width = b.backward.iter().map(|p| p.name.len()).max().unwrap_or(0);
        for p in &b.backward {
            let regime = p.regime.as_ref().map(|g| format!("  {}", crate::regime::tag(g))).unwrap_or_default();
            out += &format!("  {:<width$}  {:>9.3} ms{regime}  {}\n", p.name, p.median_ms, p.kernels.join(", "));
        }
    }
    out
}

#[cfg(test)]
#[path = "../tests/unit/breakdown.rs"]
mod tests;
