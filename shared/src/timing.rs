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

/// Run `f` `warmup` times untimed, then `iters` times timed. After 10 s, a progress line goes to
/// stderr every 10 s.
pub fn time_forward(label: &str, device: &Device, warmup: usize, iters: usize, mut f: impl FnMut() -> Result<Tensor>) -> Result<Stats> {
    let (start, mut shown) = (Instant::now(), Duration::ZERO);
    device.synchronize()?;
    let mut samples = Vec::with_capacity(iters);
    for i in 0..warmup + iters {
        let t0 = Instant::now();
        let y = f()?;
        device.synchronize()?;
        let ms = t0.elapsed().as_secs_f64() * 1e3;
        drop(y);
        samples.extend((i >= warmup).then_some(ms));
        if start.elapsed() >= shown + Duration::from_secs(10) {
            shown = start.elapsed();
            let left = ms * (warmup + iters - i - 1) as f64 / 1e3;
            eprintln!("[{label}] {} of {} warm-up + timed iterations ({ms:.1} ms each, ~{left:.0} s left)", i + 1, warmup + iters);
        }
    }
    Ok(Stats::from_samples(samples))
}

#[cfg(test)]
#[path = "../tests/unit/timing.rs"]
mod tests;
