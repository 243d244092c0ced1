//! Unit tests of `shared/src/graph.rs`, compiled into that module (`#[path]`), so they
//! reach its private items.

use super::*;

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
    fn forward(&mut self) -> anyhow::Result<()> {
        let captured = self.calls.contains(&"begin");
        self.calls.push(match (captured, self.cache_on) {
            (false, true) => "warm-up (cache on)",
            (false, false) => "warm-up (cache off)",
            (true, _) => "captured forward",
        });
        if captured && self.fail_captured_forward {
            anyhow::bail!("h2d param cache miss during CUDA graph capture");
        }
        Ok(())
    }
    fn steady(&mut self) -> bool {
        self.calls.iter().filter(|c| c.starts_with("warm-up")).count() >= self.steady_after
    }
    fn synchronize(&mut self) -> anyhow::Result<()> {
        self.calls.push("sync");
        Ok(())
    }
    fn begin_capture(&mut self) -> anyhow::Result<()> {
        self.calls.push("begin");
        Ok(())
    }
    fn end_capture(&mut self) -> anyhow::Result<()> {
        self.calls.push("end");
        if self.fail_end {
            anyhow::bail!("cuGraphInstantiate: CUDA_ERROR_INVALID_VALUE");
        }
        Ok(())
    }
    fn abort_capture(&mut self) -> anyhow::Result<()> {
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
    assert!(e.to_string().contains("steady") && e.to_string().contains("without --cuda-graph"), "{e}");
    assert_eq!(r.calls.iter().filter(|c| c.starts_with("warm-up")).count(), MAX_WARMUPS);
    assert!(!r.calls.contains(&"begin"), "nothing is captured: {:?}", r.calls);
}

/// A stage with its own check, as stage 4 has.
struct Checked;
impl Forward for Checked {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        Ok(x.clone())
    }
    fn self_check(&self, _x: &Tensor, _y: &Tensor) -> anyhow::Result<Option<crate::check::NamedCheck>> {
        anyhow::bail!("the stage's own check ran")
    }
}

/// A graphed stage answers `self_check` with the stage's own check (stage 4's FP8 twin
/// check), not the trait's default of none.
#[test]
fn a_graphed_stage_forwards_its_own_check() {
    let x = Tensor::zeros(4, candle_core::DType::F32, &candle_core::Device::Cpu).unwrap();
    let g = Graphed { replay: Box::new(|| Ok(())), input: x.id(), out: x.clone(), stage: Box::new(Checked) };
    let y = g.forward(&x).unwrap();
    assert_eq!(g.self_check(&x, &y).unwrap_err().to_string(), "the stage's own check ran");
    assert!(g.forward(&x.clone().contiguous().unwrap().affine(1.0, 0.0).unwrap()).is_err(), "another input is refused");
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
