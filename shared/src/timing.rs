//! Timing: warm up, then per iteration run, synchronize and take wall time (GPU work is
//! asynchronous: without the synchronize the clock stops when kernels are queued, not finished).

use candle_core::{Device, Tensor};
use serde::{Deserialize, Serialize};
use std::io::{IsTerminal, Write};
use std::time::{Duration, Instant};

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
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
pub fn time_forward(
    label: &str,
    device: &Device,
    warmup: usize,
    iters: usize,
    mut f: impl FnMut() -> candle_core::Result<Tensor>,
) -> candle_core::Result<Stats> {
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
        match i.checked_sub(warmup) {
            None => progress("warm-up", i + 1, warmup, ms),
            Some(j) => {
                samples.push(ms);
                progress("timing", j + 1, iters, ms);
            }
        }
    }
    if tty && last_shown.is_some() {
        let _ = write!(std::io::stderr().lock(), "\r{:78}\r", "");
    }
    Ok(Stats::from_samples(samples))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles() {
        let s = Stats::from_samples((1..=11).rev().map(|v| v as f64).collect());
        assert_eq!((s.median_ms, s.p10_ms, s.p90_ms, s.min_ms, s.max_ms), (6.0, 2.0, 10.0, 1.0, 11.0));
        let s = Stats::from_samples(vec![1.0, 2.0]);
        assert_eq!(s.median_ms, 1.5);
        let s = Stats::from_samples(vec![4.0]);
        assert_eq!((s.p10_ms, s.p90_ms), (4.0, 4.0));
    }

    #[test]
    fn times_each_iteration_and_excludes_warmup() {
        let mut calls = 0;
        let s = time_forward("t", &Device::Cpu, 2, 3, || {
            calls += 1;
            std::thread::sleep(Duration::from_millis(if calls <= 2 { 500 } else { 2 }));
            Tensor::zeros(1, candle_core::DType::F32, &Device::Cpu)
        })
        .unwrap();
        assert_eq!(calls, 5);
        assert_eq!(s.samples_ms.len(), 3);
        // sleep() never returns early, so every sample covers its 2 ms; the 500 ms warm-up
        // calls are not among the samples.
        assert!(s.min_ms >= 2.0 && s.max_ms < 400.0, "{s:?}");
    }
}
