//! The order of a capture's steps, on a recording fake: what must hold on any GPU, checked
//! without one.

use cuda_graph::{run_capture, CaptureSteps, MAX_WARMUPS};

/// Records the order of the steps; `fail_captured_forward` makes the captured forward fail.
#[derive(Default)]
struct Recorder {
    calls: Vec<&'static str>,
    cache_on: bool,
    fail_captured_forward: bool,
    fail_end: bool,
    /// Warm-up forwards after which the stage is steady (0 and 1: the first).
    steady_after: usize,
}

impl CaptureSteps for Recorder {
    fn enable_htod_cache(&mut self) {
        self.cache_on = true;
        self.calls.push("cache on");
    }
    fn forward(&mut self) -> candle_core::Result<()> {
        let captured = self.calls.contains(&"begin");
        self.calls.push(match (captured, self.cache_on) {
            (false, true) => "warm-up (cache on)",
            (false, false) => "warm-up (cache off)",
            (true, _) => "captured forward",
        });
        if captured && self.fail_captured_forward {
            candle_core::bail!("h2d param cache miss during CUDA graph capture");
        }
        Ok(())
    }
    fn steady(&mut self) -> bool {
        self.calls.iter().filter(|c| c.starts_with("warm-up")).count() >= self.steady_after
    }
    fn synchronize(&mut self) -> candle_core::Result<()> {
        self.calls.push("sync");
        Ok(())
    }
    fn begin_capture(&mut self) -> candle_core::Result<()> {
        self.calls.push("begin");
        Ok(())
    }
    fn end_capture(&mut self) -> candle_core::Result<()> {
        self.calls.push("end");
        if self.fail_end {
            candle_core::bail!("cuGraphInstantiate: CUDA_ERROR_INVALID_VALUE");
        }
        Ok(())
    }
    fn abort_capture(&mut self) -> candle_core::Result<()> {
        self.calls.push("abort");
        Ok(())
    }
    fn release_captured(&mut self) {
        self.calls.push("release");
    }
}

/// The warm-up runs with the h2d cache on, so the cache is full when the capture needs it.
#[test]
fn the_warm_up_fills_the_htod_cache_before_the_capture() {
    let mut r = Recorder::default();
    run_capture(&mut r).unwrap();
    assert_eq!(r.calls, ["cache on", "warm-up (cache on)", "sync", "begin", "captured forward", "end"]);
}

/// A stage that is steady only from its second forward (stage 4 with a producer fusion) is
/// warmed up twice; one that never is, is not captured.
#[test]
fn the_warm_up_repeats_until_the_stage_is_steady() {
    let mut r = Recorder { steady_after: 2, ..Default::default() };
    run_capture(&mut r).unwrap();
    assert_eq!(r.calls, ["cache on", "warm-up (cache on)", "warm-up (cache on)", "sync", "begin", "captured forward", "end"]);

    let mut r = Recorder { steady_after: MAX_WARMUPS + 1, ..Default::default() };
    let e = run_capture(&mut r).unwrap_err();
    assert!(e.to_string().contains("steady"), "{e}");
    assert_eq!(r.calls.iter().filter(|c| c.starts_with("warm-up")).count(), MAX_WARMUPS);
    assert!(!r.calls.contains(&"begin"), "nothing is captured: {:?}", r.calls);
}

/// A captured forward that fails aborts the capture, and what the capture made is let go
/// only after the capture ended.
#[test]
fn a_failed_capture_is_aborted_before_its_tensors_are_let_go() {
    let mut r = Recorder { fail_captured_forward: true, ..Default::default() };
    let e = run_capture(&mut r).unwrap_err();
    assert!(e.to_string().contains("cache miss"), "{e}");
    assert_eq!(r.calls[4..], ["captured forward", "abort", "release"]);

    let mut r = Recorder { fail_end: true, ..Default::default() };
    let e = run_capture(&mut r).unwrap_err();
    assert!(e.to_string().contains("cuGraphInstantiate"), "{e}");
    assert_eq!(r.calls[4..], ["captured forward", "end", "release"]);

    let mut r = Recorder::default();
    run_capture(&mut r).unwrap();
    assert!(!r.calls.contains(&"release") && !r.calls.contains(&"abort"), "a graph keeps its output: {:?}", r.calls);
}
