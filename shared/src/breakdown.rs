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
    /// Median of the per-iteration sums of the parts.
    pub total_ms: f64,
    #[serde(default)]
    pub total_samples_ms: Vec<f64>,
    pub iters: usize,
    pub method: String,
}

impl Breakdown {
    fn from_samples(parts: Vec<(String, Vec<f64>)>, total: Vec<f64>, iters: usize, method: String) -> Breakdown {
        let part = |(name, samples)| {
            let Stats { median_ms, p10_ms, p90_ms, samples_ms, .. } = Stats::from_samples(samples);
            PartTime { name, median_ms, p10_ms, p90_ms, samples_ms, regime: None, kernels: Vec::new() }
        };
        let Stats { median_ms: total_ms, samples_ms: total_samples_ms, .. } = Stats::from_samples(total);
        Breakdown { parts: parts.into_iter().map(part).collect(), total_ms, total_samples_ms, iters, method }
    }
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

/// A part of the block begins here (a no-op unless this thread is recording).
pub fn part(name: &'static str) -> Result<()> {
    RECORDER.with(|r| r.borrow_mut().as_mut().map_or(Ok(()), |rec| rec.boundary(Some(name))))
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
    let pooled = |x: &[f64], y: &[f64]| x.iter().chain(y).copied().collect();
    let parts = a.parts.iter().zip(&b.parts).map(|(p, q)| (p.name.clone(), pooled(&p.samples_ms, &q.samples_ms))).collect();
    Some(Breakdown::from_samples(parts, pooled(&a.total_samples_ms, &b.total_samples_ms), a.iters + b.iters, a.method.clone()))
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
    out
}

#[cfg(test)]
#[path = "../tests/unit/breakdown.rs"]
mod tests;
