//! `--cuda-graph`: capture a stage's forward once as a CUDA graph and replay it: one launch per
//! forward instead of one per kernel (dozens in stages 0–2), a few µs saved per kernel. A replay
//! computes the captured input; a different x is an error, not a silent stale result.

use crate::error::SpeedkitError;
use crate::stage::Forward;
use candle_core::Tensor;

/// Refuses the CPU (exit 2). On CUDA, candle's per-tensor event tracking off (as `device::select`
/// leaves it): recorded inside a capture, the events would be waited on outside it.
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

/// Capture `stage` on `x` (exit 2 if its forward does something a capture does not allow).
pub fn capture(name: &str, stage: Box<dyn Forward>, x: &Tensor) -> anyhow::Result<Box<dyn Forward>> {
    prepare(x.device())?;
    imp::capture(name, stage, x)
}

/// The steps of a capture, one method each, so their order can be checked without a GPU.
/// `end_capture` instantiates the graph; `abort_capture` throws a failed forward's partial graph
/// away so the stream stays usable; `release_captured` lets go of what a capture that made no
/// graph produced (dropped while capturing, it would be a free recorded into the capture).
pub trait CaptureSteps {
    fn enable_htod_cache(&mut self);
    fn forward(&mut self) -> anyhow::Result<()>;
    /// The stage's `Forward::steady` after the forward just made.
    fn steady(&mut self) -> bool;
    fn synchronize(&mut self) -> anyhow::Result<()>;
    fn begin_capture(&mut self) -> anyhow::Result<()>;
    fn end_capture(&mut self) -> anyhow::Result<()>;
    fn abort_capture(&mut self) -> anyhow::Result<()>;
    fn release_captured(&mut self);
}

/// Warm-up forwards before a capture, at most: stage 4 is steady from its second.
pub const MAX_WARMUPS: usize = 4;

/// The h2d parameter cache goes on *before* the warm-up forwards, which load modules, create
/// library handles, pick cuBLASLt algorithms and cache every small parameter upload: none of that
/// may happen inside a capture. The warm-up repeats until the stage is steady (its forward takes
/// the path every later one takes), so the capture records that path and not a first call's.
/// The capture is ended whatever the forward did, then its output let go.
pub fn run_capture(steps: &mut dyn CaptureSteps) -> anyhow::Result<()> {
    steps.enable_htod_cache();
    let mut warmups = 0;
    loop {
        steps.forward()?;
        warmups += 1;
        if steps.steady() {
            break;
        }
        if warmups == MAX_WARMUPS {
            anyhow::bail!(
                "the stage did not reach its steady path after {MAX_WARMUPS} warm-up forwards, so a CUDA graph captured now \
                 would record a first call's path; run it without --cuda-graph"
            );
        }
    }
    steps.synchronize()?;
    steps.begin_capture()?;
    match steps.forward() {
        Ok(()) => steps.end_capture().inspect_err(|_| steps.release_captured()),
        Err(e) => {
            let end = steps.abort_capture();
            steps.release_captured();
            match end {
                Ok(()) => Err(e),
                Err(end) => Err(e.context(format!("and ending the capture failed too: {end:#}"))),
            }
        }
    }
}

/// A captured stage: `forward` replays the graph (a fake in the tests), `self_check` asks the
/// stage itself, outside the graph.
pub struct Graphed {
    replay: Box<dyn Fn() -> candle_core::Result<()>>,
    input: candle_core::TensorId,
    out: Tensor,
    // Owns the weights the graph reads: declared last, so dropped after the graph.
    stage: Box<dyn Forward>,
}

impl Forward for Graphed {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        if x.id() != self.input {
            candle_core::bail!("a CUDA graph replays the input it captured; build it again for another input");
        }
        (self.replay)()?;
        Ok(self.out.clone())
    }

    fn self_check(&self, x: &Tensor, y: &Tensor) -> anyhow::Result<Option<crate::check::NamedCheck>> {
        self.stage.self_check(x, y)
    }

    fn ran(&self) -> Vec<String> {
        self.stage.ran()
    }
}

#[cfg(not(feature = "cuda"))]
mod imp {
    pub fn capture(_: &str, _: Box<dyn super::Forward>, _: &super::Tensor) -> anyhow::Result<Box<dyn super::Forward>> {
        unreachable!("a tensor on a CUDA device exists only in a cuda build")
    }
}

#[cfg(feature = "cuda")]
mod imp {
    use super::*;
    use candle_core::cuda::cudarc::driver::{result, sys, CudaStream};
    use std::sync::Arc;

    /// The driver's handles. Not cudarc's `CudaGraph`: its `end_capture` first returns any error a
    /// call inside the capture stored, leaving the stream capturing and every later call failing.
    struct RawGraph {
        graph: sys::CUgraph,
        exec: sys::CUgraphExec,
        stream: Arc<CudaStream>,
    }

    impl RawGraph {
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

    /// Destroy a graph no `RawGraph` owns, leaving no error stored.
    fn destroy(stream: &CudaStream, graph: sys::CUgraph) {
        // SAFETY: a graph just returned by cuStreamEndCapture and never instantiated, destroyed once.
        stream.context().record_err(unsafe { result::graph::destroy(graph) });
        let _ = stream.context().check_err();
    }

    /// End the capture through the driver, taking (and clearing) any error a call inside it
    /// stored. `Ok(None)`: nothing captured.
    fn end_raw(stream: &CudaStream) -> anyhow::Result<Option<sys::CUgraph>> {
        // SAFETY: the stream is candle's, capturing on this thread since `begin_capture`.
        let graph = unsafe { result::stream::end_capture(stream.cu_stream()) }.map_err(|e| anyhow::anyhow!("cuStreamEndCapture: {e:?}"))?;
        let graph = (!graph.is_null()).then_some(graph);
        if let Err(stored) = stream.context().check_err() {
            if let Some(g) = graph {
                destroy(stream, g);
            }
            anyhow::bail!("a call inside the capture failed: {stored:?}");
        }
        Ok(graph)
    }

    struct Real<'a> {
        dev: candle_core::cuda::CudaDevice,
        stream: Arc<CudaStream>, // candle's one stream
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
        fn steady(&mut self) -> bool {
            self.stage.steady()
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
            let exec = unsafe { result::graph::instantiate(graph, flags) }.map_err(|e| {
                destroy(&self.stream, graph);
                anyhow::anyhow!("cuGraphInstantiate: {e:?}")
            })?;
            self.graph = Some(RawGraph { graph, exec, stream: self.stream.clone() });
            Ok(())
        }
        fn abort_capture(&mut self) -> anyhow::Result<()> {
            if let Some(g) = end_raw(&self.stream)? {
                destroy(&self.stream, g);
            }
            Ok(())
        }
        fn release_captured(&mut self) {
            // The output's memory came from the failed graph's allocation nodes, which never ran:
            // freeing it would store an error in the context, failing the next call.
            std::mem::forget(self.out.take());
        }
    }

    pub fn capture(name: &str, stage: Box<dyn Forward>, x: &Tensor) -> anyhow::Result<Box<dyn Forward>> {
        let dev = x.device().as_cuda_device()?.clone();
        let (graph, out) = {
            let mut real = Real { stream: dev.cuda_stream(), dev, stage: stage.as_ref(), x, guard: None, out: None, graph: None };
            let done = run_capture(&mut real);
            drop(real.guard.take()); // the h2d cache off again, whatever happened
            done.map_err(|e| refuse(name, e.to_string()))?;
            (real.graph.take(), real.out.take())
        };
        let (Some(graph), Some(out)) = (graph, out) else { return Err(refuse(name, "the capture produced no graph".into())) };
        // SAFETY: the graph's exec and candle's stream, both alive.
        unsafe { result::graph::upload(graph.exec, graph.stream.cu_stream()) }.map_err(|e| refuse(name, format!("{e:?}")))?;
        Ok(Box::new(Graphed { replay: Box::new(move || graph.replay()), input: x.id(), out, stage }))
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
#[path = "../tests/unit/graph.rs"]
mod tests;
