//! Timing: warm up, then per iteration run, synchronize and take wall time (GPU work is
//! asynchronous: without the synchronize the clock stops when kernels are queued, not finished).

use candle_core::{Device, Result, Tensor};
use serde::{Deserialize, Serialize};
use std::time::{Duration, Instant};

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Stats {
    pub median_ms: f64,
    pub p10_ms: f64,
    pub p90_ms: f64,
    pub min_ms: f64,
    pub max_ms: f64,
    pub samples_ms: Vec<f64>,
}

impl Stats {
    /// Percentiles by linear interpolation between closest ranks (numpy's default).
    pub fn from_samples(samples_ms: Vec<f64>) -> Stats {
        assert!(!samples_ms.is_empty(), "at least one timed iteration");
        let mut sorted = samples_ms.clone();
        sorted.sort_by(f64::total_cmp);
        let q = |p: f64| {
            let pos = p * (sorted.len() - 1) as f64;
            let (lo, hi) = (pos.floor() as usize, pos.ceil() as usize);
            sorted[lo] + (sorted[hi] - sorted[lo]) * (pos - lo as f64)
        };
        Stats { median_ms: q(0.5), p10_ms: q(0.1), p90_ms: q(0.9), min_ms: sorted[0], max_ms: sorted[sorted.len() - 1], samples_ms }
    }
}

/// How often a timing loop says how far it is (the first line after this long too).
pub const PROGRESS_EVERY: Duration = Duration::from_secs(10);

/// A timing loop's progress on stderr: after `every`, a line every `every`, so a run of minutes
/// is not silent until its table. The forward loop and the training loop print the same line.
pub struct Progress {
    label: String,
    /// "iterations" or "training steps".
    what: &'static str,
    total: usize,
    every: Duration,
    start: Instant,
    shown: Duration,
    /// Lines printed so far, and the last one.
    pub printed: usize,
    pub last: Option<String>,
}

impl Progress {
    pub fn new(label: &str, what: &'static str, total: usize) -> Progress {
        Progress::every(label, what, total, PROGRESS_EVERY)
    }

    pub fn every(label: &str, what: &'static str, total: usize, every: Duration) -> Progress {
        let (label, start) = (label.to_string(), Instant::now());
        Progress { label, what, total, every, start, shown: Duration::ZERO, printed: 0, last: None }
    }

    /// Iteration `i` (from 0) took `ms`: print the line if one is due.
    pub fn tick(&mut self, i: usize, ms: f64) {
        if self.start.elapsed() < self.shown + self.every {
            return;
        }
        self.shown = self.start.elapsed();
        let left = ms * self.total.saturating_sub(i + 1) as f64 / 1e3;
        let (label, what, total) = (&self.label, self.what, self.total);
        let line = format!("[{label}] {} of {total} warm-up + timed {what} ({ms:.1} ms each, ~{left:.0} s left)", i + 1);
        eprintln!("{line}");
        (self.printed, self.last) = (self.printed + 1, Some(line));
    }
}

/// Run `f` `warmup` times untimed, then `iters` times timed, with a progress line on stderr every
/// `PROGRESS_EVERY` after the first `PROGRESS_EVERY`.
pub fn time_forward(label: &str, device: &Device, warmup: usize, iters: usize, f: impl FnMut() -> Result<Tensor>) -> Result<Stats> {
    time_forward_with(&mut Progress::new(label, "iterations", warmup + iters), device, warmup, iters, f)
}

/// `time_forward` reporting to `progress`.
pub fn time_forward_with(
    progress: &mut Progress,
    device: &Device,
    warmup: usize,
    iters: usize,
    mut f: impl FnMut() -> Result<Tensor>,
) -> Result<Stats> {
    device.synchronize()?;
    let mut samples = Vec::with_capacity(iters);
    for i in 0..warmup + iters {
        let t0 = Instant::now();
        let y = f()?;
        device.synchronize()?;
        let ms = t0.elapsed().as_secs_f64() * 1e3;
        drop(y);
        samples.extend((i >= warmup).then_some(ms));
        progress.tick(i, ms);
    }
    Ok(Stats::from_samples(samples))
}

#[cfg(test)]
#[path = "../tests/unit/timing.rs"]
mod tests;
