//! Unit tests of `shared/src/timing.rs`, compiled into that module (`#[path]`), so they
//! reach its private items.

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

#[test]
fn the_forward_loop_reports_progress() {
    let mut p = Progress::every("stage_t", "iterations", 5, Duration::ZERO);
    time_forward_with(&mut p, &Device::Cpu, 2, 3, || Tensor::zeros(1, candle_core::DType::F32, &Device::Cpu)).unwrap();
    assert_eq!(p.printed, 5);
    assert!(p.last.as_deref().unwrap().starts_with("[stage_t] 5 of 5 warm-up + timed iterations ("), "{:?}", p.last);
}
