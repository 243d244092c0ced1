//! `--cuda-graph`: capture a built stage's forward once as a CUDA graph and replay it, so the
//! CPU issues one launch per forward instead of one per kernel (dozens in stages 0–2). What it
//! saves is launch overhead — a few µs per kernel — which matters when kernels are short:
//! small shapes, or a fused stage whose kernels are few and fast.
//!
//! How (`run_capture`, the order tested with a recording fake): turn on candle's graph-safe
//! host-to-device cache first, then one ordinary forward (loads every kernel module, compiles
//! NVRTC code, creates library handles, and fills that cache with every small parameter upload
//! — reduce dims, broadcast strides — none of which may happen inside a capture), then the
//! forward again with the stream in capture mode (each upload is now a cache hit), then instantiate with AUTO_FREE_ON_LAUNCH so the graph's own allocations
//! (its output) are released before each replay. A replay computes the captured input: the
//! runner always times the same x, and a different x is an error, not a silent stale result.

use crate::error::SpeedkitError;
use crate::stage::Forward;
use candle_core::Tensor;

/// Refuses the CPU (exit 2). On CUDA, makes sure candle's per-tensor event tracking is off
/// (`device::select` turns it off for every CUDA run, before the first tensor): everything
/// runs on one stream, so the events guard no cross-stream hazard, and recorded inside a
/// capture they would later be waited on outside it.
pub fn prepare(device: &candle_core::Device) -> Result<(), SpeedkitError> {
    if !device.is_cuda() {
        return Err(SpeedkitError::usage(
            "--cuda-graph replays captured GPU work, and this run is on the CPU, where there is no launch overhead to save. \
             Fix: drop --cuda-graph, or run on a GPU with --device cuda (a --features cuda build).",
        ));
    }
    #[cfg(feature = "cuda")]
    if let candle_core::Device::Cuda(d) = device {
        // SAFETY: every tensor of this run lives on this device's single stream.
        unsafe { d.disable_event_tracking() };
    }
    Ok(())
}

/// Capture `stage` on `x` (after `prepare`); errors (exit 2) if the stage's forward does
/// something a capture does not allow (the message says which stage and why).
pub fn capture(name: &str, stage: Box<dyn Forward>, x: &Tensor) -> anyhow::Result<Box<dyn Forward>> {
    prepare(x.device())?;
    imp::capture(name, stage, x)
}

/// The steps of a capture, one method each, so their order can be checked without a GPU.
pub trait CaptureSteps {
    /// candle's h2d parameter cache on (kept on until the captured forward has run).
    fn enable_htod_cache(&mut self);
    /// One forward of the stage (the warm-up, or the captured one).
    fn forward(&mut self) -> anyhow::Result<()>;
    fn synchronize(&mut self) -> anyhow::Result<()>;
    fn begin_capture(&mut self) -> anyhow::Result<()>;
    /// End the capture and instantiate its graph (the captured forward succeeded).
    fn end_capture(&mut self) -> anyhow::Result<()>;
    /// End a capture whose forward failed and throw its partial graph away, leaving the stream
    /// and the context usable for every later stage or selftest row.
    fn abort_capture(&mut self) -> anyhow::Result<()>;
    /// Let go of what the captured forward made (its output) when no graph came of it. Called
    /// only after the capture has ended: a tensor dropped while the stream still captures is a
    /// free recorded into the capture (or a failed call), not a free.
    fn release_captured(&mut self);
}

/// The capture sequence. The cache must be on *before* the warm-up: candle fills it only while
/// it is on (`SlicePtrOrNull::params_from_vec`, `cached_htod_slice`), and a miss during the
/// capture is an error — taking it after the warm-up let only stage 3 (whose kernels need no
/// parameter uploads) be captured. The capture is ended whatever the forward did (aborted when
/// it failed), and only then is what it made let go.
pub fn run_capture(steps: &mut dyn CaptureSteps) -> anyhow::Result<()> {
    steps.enable_htod_cache();
    steps.forward()?; // warm: module loads, NVRTC, handles, and the h2d cache's entries
    steps.synchronize()?;
    steps.begin_capture()?;
    match steps.forward() {
        Ok(()) => steps.end_capture().inspect_err(|_| steps.release_captured()),
        Err(e) => {
            let end = steps.abort_capture(); // end it, so the stream is usable again
            steps.release_captured();
            match end {
                Ok(()) => Err(e),
                Err(end) => Err(e.context(format!("and ending the capture failed too: {end:#}"))),
            }
        }
    }
}

/// Something that replays captured work: a CUDA graph, or a fake in the tests.
pub trait Replay {
    fn replay(&self) -> candle_core::Result<()>;
}

/// A captured stage: `forward` replays the graph, `self_check` asks the stage itself (stage 4's
/// FP8 twin check must run under --cuda-graph too; it runs outside the graph).
pub struct Graphed<G: Replay> {
    graph: G,
    input: candle_core::TensorId,
    out: Tensor,
    // The stage owns the weights the graph reads: it must outlive the graph (fields drop in
    // declaration order, so the graph goes first).
    stage: Box<dyn Forward>,
}

impl<G: Replay> Graphed<G> {
    pub fn new(graph: G, input: &Tensor, out: Tensor, stage: Box<dyn Forward>) -> Self {
        Graphed { graph, input: input.id(), out, stage }
    }
}

impl<G: Replay> Forward for Graphed<G> {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        if x.id() != self.input {
            candle_core::bail!("a CUDA graph replays the input it captured; build it again for another input");
        }
        self.graph.replay()?;
        Ok(self.out.clone())
    }

    fn self_check(&self, x: &Tensor, y: &Tensor) -> anyhow::Result<Option<crate::check::NamedCheck>> {
        self.stage.self_check(x, y)
    }
}

#[cfg(not(feature = "cuda"))]
mod imp {
    use super::*;
    pub fn capture(_name: &str, _stage: Box<dyn Forward>, _x: &Tensor) -> anyhow::Result<Box<dyn Forward>> {
        unreachable!("a tensor on a CUDA device exists only in a cuda build")
    }
}

#[cfg(feature = "cuda")]
mod imp {
    use super::*;
    use candle_core::cuda::cudarc::driver::{result, sys, CudaStream};
    use std::sync::Arc;

    /// An instantiated graph, held as the driver's handles. Not cudarc's `CudaGraph`: that is
    /// made only by cudarc's `end_capture`, which calls `bind_to_thread` first — and that
    /// returns (and clears) any error a call inside the capture stored in the context (a free
    /// on the capturing stream, say) before ending anything, leaving the stream capturing and
    /// every later call on it failing.
    struct RawGraph {
        graph: sys::CUgraph,
        exec: sys::CUgraphExec,
        stream: Arc<CudaStream>,
    }

    impl Replay for RawGraph {
        fn replay(&self) -> candle_core::Result<()> {
            let launch = self.stream.context().bind_to_thread().and_then(|_| {
                // SAFETY: `exec` was instantiated from a capture of `stream` and lives as long as self.
                unsafe { result::graph::launch(self.exec, self.stream.cu_stream()) }
            });
            launch.map_err(|e| candle_core::Error::Msg(format!("CUDA graph launch: {e:?}")))
        }
    }

    impl Drop for RawGraph {
        fn drop(&mut self) {
            let ctx = self.stream.context();
            // SAFETY: both handles were created by this struct's owner and are destroyed once.
            ctx.record_err(unsafe { result::graph::exec_destroy(self.exec) });
            ctx.record_err(unsafe { result::graph::destroy(self.graph) });
        }
    }

    /// End the stream's capture straight through the driver, and take the error (if any) that a
    /// call inside the capture stored in the context, clearing it. `Ok(None)`: nothing captured.
    fn end_raw(stream: &CudaStream) -> anyhow::Result<Option<sys::CUgraph>> {
        // SAFETY: the stream is candle's, capturing on this thread since `begin_capture`.
        let graph = unsafe { result::stream::end_capture(stream.cu_stream()) }.map_err(|e| anyhow::anyhow!("cuStreamEndCapture: {e:?}"))?;
        let graph = (!graph.is_null()).then_some(graph);
        if let Err(stored) = stream.context().check_err() {
            if let Some(g) = graph {
                // SAFETY: the graph just returned by cuStreamEndCapture, not yet used.
                stream.context().record_err(unsafe { result::graph::destroy(g) });
                let _ = stream.context().check_err();
            }
            anyhow::bail!("a call inside the capture failed: {stored:?}");
        }
        Ok(graph)
    }

    /// The real steps: candle's stream, its cache guard, cudarc's capture.
    struct Real<'a> {
        dev: candle_core::cuda::CudaDevice,
        stream: Arc<CudaStream>,
        stage: &'a dyn Forward,
        x: &'a Tensor,
        // candle's cache guard (its type is not exported): the cache is on while it lives.
        guard: Option<Box<dyn std::any::Any>>,
        out: Option<Tensor>,
        graph: Option<RawGraph>,
    }

    impl CaptureSteps for Real<'_> {
        fn enable_htod_cache(&mut self) {
            self.guard = Some(Box::new(self.dev.enable_cuda_graph_htod_cache()));
        }
        fn forward(&mut self) -> anyhow::Result<()> {
            self.out = Some(self.stage.forward(self.x)?);
            Ok(())
        }
        fn synchronize(&mut self) -> anyhow::Result<()> {
            self.out = None; // the warm-up's output is freed before the capture, not inside it
            Ok(self.x.device().synchronize()?)
        }
        fn begin_capture(&mut self) -> anyhow::Result<()> {
            self.stream.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL).map_err(|e| anyhow::anyhow!("{e:?}"))
        }
        fn end_capture(&mut self) -> anyhow::Result<()> {
            let graph = end_raw(&self.stream)?.ok_or_else(|| anyhow::anyhow!("the capture recorded no work"))?;
            // AUTO_FREE_ON_LAUNCH: the graph's own allocations still live at the end of a replay
            // (its output) are freed before the next replay, which allocates them again.
            let flags = sys::CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH;
            // SAFETY: `graph` is the valid graph just captured.
            match unsafe { result::graph::instantiate(graph, flags) } {
                Ok(exec) => {
                    self.graph = Some(RawGraph { graph, exec, stream: self.stream.clone() });
                    Ok(())
                }
                Err(e) => {
                    // SAFETY: as above; destroyed once, here.
                    self.stream.context().record_err(unsafe { result::graph::destroy(graph) });
                    let _ = self.stream.context().check_err();
                    anyhow::bail!("cuGraphInstantiate: {e:?}")
                }
            }
        }
        fn abort_capture(&mut self) -> anyhow::Result<()> {
            if let Some(g) = end_raw(&self.stream)? {
                // SAFETY: the partial graph just ended, destroyed once, here.
                self.stream.context().record_err(unsafe { result::graph::destroy(g) });
                let _ = self.stream.context().check_err();
            }
            Ok(())
        }
        fn release_captured(&mut self) {
            // The output's memory came from the failed graph's allocation nodes, which never ran:
            // freeing it would free an address no allocation holds (an error stored in the
            // context, failing the next call). It is left allocated: one output per failed capture.
            if let Some(out) = self.out.take() {
                std::mem::forget(out);
            }
        }
    }

    pub fn capture(name: &str, stage: Box<dyn Forward>, x: &Tensor) -> anyhow::Result<Box<dyn Forward>> {
        let dev = x.device().as_cuda_device()?.clone();
        let stream = dev.cuda_stream();
        let (graph, out) = {
            let mut real = Real { dev, stream, stage: stage.as_ref(), x, guard: None, out: None, graph: None };
            let done = run_capture(&mut real);
            drop(real.guard.take()); // the h2d cache off again, whatever happened
            done.map_err(|e| refuse(name, e.to_string()))?;
            (real.graph.take(), real.out.take())
        };
        let (Some(graph), Some(out)) = (graph, out) else { return Err(refuse(name, "the capture produced no graph".into())) };
        // SAFETY: the graph's exec and candle's stream, both alive.
        unsafe { result::graph::upload(graph.exec, graph.stream.cu_stream()) }.map_err(|e| refuse(name, format!("{e:?}")))?;
        Ok(Box::new(Graphed::new(graph, x, out, stage)))
    }

    fn refuse(name: &str, why: String) -> anyhow::Error {
        SpeedkitError::usage(format!(
            "--cuda-graph: {name}'s forward could not be captured as a CUDA graph ({why}). Something in it is not \
             capturable (a synchronous copy or allocation, a host read of device data). Fix: run {name} without --cuda-graph."
        ))
        .into()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Records the order of the steps; `fail_captured_forward` makes the captured forward fail.
    #[derive(Default)]
    struct Recorder {
        calls: Vec<&'static str>,
        cache_on: bool,
        fail_captured_forward: bool,
        fail_end: bool,
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

    /// Regression (issue 13, finding 1): the warm-up ran before the h2d cache was on, so the
    /// cache was empty when the capture needed it and every stage but 3 failed to capture.
    #[test]
    fn the_warm_up_fills_the_htod_cache_before_the_capture() {
        let mut r = Recorder::default();
        run_capture(&mut r).unwrap();
        assert_eq!(r.calls, ["cache on", "warm-up (cache on)", "sync", "begin", "captured forward", "end"]);
    }

    struct FakeGraph;
    impl Replay for FakeGraph {
        fn replay(&self) -> candle_core::Result<()> {
            Ok(())
        }
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

    /// Regression (issue 13, finding 4): the graphed stage answered `self_check` with the
    /// trait's default (no check), so stage 4's FP8 twin check was skipped under --cuda-graph.
    #[test]
    fn a_graphed_stage_forwards_its_own_check() {
        let x = Tensor::zeros(4, candle_core::DType::F32, &candle_core::Device::Cpu).unwrap();
        let g = Graphed::new(FakeGraph, &x, x.clone(), Box::new(Checked));
        let y = g.forward(&x).unwrap();
        assert_eq!(g.self_check(&x, &y).unwrap_err().to_string(), "the stage's own check ran");
        assert!(g.forward(&x.clone().contiguous().unwrap().affine(1.0, 0.0).unwrap()).is_err(), "another input is refused");
    }

    /// Issue 24, item 7: a captured forward that fails aborts the capture (not through cudarc's
    /// end_capture, whose bind_to_thread returns the stored error first and leaves the stream
    /// capturing), and what the capture made is let go only after the capture ended.
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
}
