//! Timing: warm up, then per iteration run, synchronize and take wall time (GPU work is
//! asynchronous: without the synchronize the clock stops when kernels are queued, not finished).

use candle_core::{Device, Result, Tensor};
use serde::{Deserialize, Serialize};
use std::io::{IsTerminal, Write};
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

/// Run `f` `warmup` times untimed, then `iters` times timed. Progress goes to stderr after 2 s:
/// one updating line on a terminal, a line every 10 s in a log.
pub fn time_forward(label: &str, device: &Device, warmup: usize, iters: usize, mut f: impl FnMut() -> Result<Tensor>) -> Result<Stats> {
    let (start, tty) = (Instant::now(), std::io::stderr().is_terminal());
    let every = if tty { Duration::from_millis(200) } else { Duration::from_secs(10) };
    let mut last_shown: Option<Instant> = None;
    let mut progress = |phase: &str, done: usize, total: usize, last_ms: f64| {
        let now = Instant::now();
        if now - start < Duration::from_secs(2) || last_shown.is_some_and(|l| now - l < every) {
            return;
        }
        last_shown = Some(now);
        let eta = last_ms * (total - done) as f64 / 1e3;
        let line = format!("[{label}] {phase} {done}/{total} ({last_ms:.1} ms/iter, ~{eta:.0} s left)");
        let mut err = std::io::stderr().lock();
        let _ = if tty { write!(err, "\r{line:<78}") } else { writeln!(err, "{line}") };
        let _ = err.flush();
    };
    device.synchronize()?;
    let mut samples = Vec::with_capacity(iters);
    for i in 0..warmup + iters {
        let t0 = Instant::now();
        let y = f()?;
        device.synchronize()?;
        let ms = t0.elapsed().as_secs_f64() * 1e3;
        drop(y);
        samples.extend((i >= warmup).then_some(ms));
        let (phase, done, total) = if i < warmup { ("warm-up", i + 1, warmup) } else { ("timing", i + 1 - warmup, iters) };
        progress(phase, done, total, ms);
    }
    if tty && last_shown.is_some() {
        let _ = write!(std::io::stderr().lock(), "\r{:78}\r", "");
    }
    Ok(Stats::from_samples(samples))
}

#[cfg(test)]
#[path = "../tests/unit/timing.rs"]
mod tests;
