//! Capture a candle forward once as a CUDA graph and replay it: one launch per forward instead
//! of one per kernel (dozens in a transformer block written from candle's ops), a few µs saved
//! per kernel. What a capture needs from candle, in order: its host-to-device parameter cache on
//! before the warm-up (every small upload a kernel launch makes is cached then, none happens
//! inside the capture), a warm-up until the forward takes the path every later one takes, and
//! candle's per-tensor event tracking off (recorded inside a capture, the events would be waited
//! on outside it). A replay computes the captured input; another input is an error, never a
//! stale result.
//!
//! ```ignore
//! cuda_graph::prepare(&device)?;                               // once, before any tensor exists
//! let g = cuda_graph::capture(&x, &|x| model.forward(x), &|| true)?;
//! let y = g.replay(&x)?;                                       // one launch
//! ```

use candle_core::{Result, Tensor};

/// Turn candle's per-tensor event tracking off on a CUDA device (a no-op elsewhere). Call it
/// before the tensors a graph will read are made.
pub fn prepare(device: &candle_core::Device) {
    #[cfg(feature = "cuda")]
    if let candle_core::Device::Cuda(d) = device {
        // SAFETY: every tensor of the process lives on this device's single stream.
        unsafe { d.disable_event_tracking() };
    }
    #[cfg(not(feature = "cuda"))]
    let _ = device;
}

/// The steps of a capture, one method each, so their order can be checked without a GPU.
/// `end_capture` instantiates the graph; `abort_capture` throws a failed forward's partial graph
/// away so the stream stays usable; `release_captured` lets go of what a capture that made no
/// graph produced (dropped while capturing, it would be a free recorded into the capture).
pub trait CaptureSteps {
    fn enable_htod_cache(&mut self);
    fn forward(&mut self) -> Result<()>;
    /// Whether the forward just made took the path every later one takes.
    fn steady(&mut self) -> bool;
    fn synchronize(&mut self) -> Result<()>;
    fn begin_capture(&mut self) -> Result<()>;
    fn end_capture(&mut self) -> Result<()>;
    fn abort_capture(&mut self) -> Result<()>;
    fn release_captured(&mut self);
}

/// Warm-up forwards before a capture, at most (a forward with delayed scaling is steady from its second).
pub const MAX_WARMUPS: usize = 4;

/// The h2d parameter cache goes on *before* the warm-up forwards, which load modules, create
/// library handles, pick cuBLASLt algorithms and cache every small parameter upload: none of that
/// may happen inside a capture. The warm-up repeats until the forward is steady, so the capture
/// records that path and not a first call's. The capture is ended whatever the forward did, then
/// its output let go.
pub fn run_capture(steps: &mut dyn CaptureSteps) -> Result<()> {
    steps.enable_htod_cache();
    let mut warmups = 0;
    loop {
        steps.forward()?;
        warmups += 1;
        if steps.steady() {
            break;
        }
        if warmups == MAX_WARMUPS {
            candle_core::bail!(
                "the forward did not reach its steady path after {MAX_WARMUPS} warm-up forwards, so a graph captured now \
                 would record a first call's path"
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
                Err(end) => Err(e.context(format!("and ending the capture failed too: {end}"))),
            }
        }
    }
}

/// A captured forward: `replay` launches the graph and returns the output it wrote.
pub struct Graph {
    replay: Box<dyn Fn() -> Result<()>>,
    input: candle_core::TensorId,
    out: Tensor,
}

impl Graph {
    /// A graph whose replay is `replay` (a fake, in tests), captured on `input` with output `out`.
    pub fn from_parts(replay: Box<dyn Fn() -> Result<()>>, input: &Tensor, out: Tensor) -> Graph {
        Graph { replay, input: input.id(), out }
    }

    /// One launch of the whole forward on the captured input `x`.
    pub fn replay(&self, x: &Tensor) -> Result<Tensor> {
        if x.id() != self.input {
            candle_core::bail!("a CUDA graph replays the input it captured; capture again for another input");
        }
        (self.replay)()?;
        Ok(self.out.clone())
    }
}

/// Capture `forward` on `x` (a tensor on a CUDA device), warming up until `steady()`. The error
/// says why a forward could not be captured (a synchronous copy or allocation, a host read of
/// device data inside it).
pub fn capture(x: &Tensor, forward: &dyn Fn(&Tensor) -> Result<Tensor>, steady: &dyn Fn() -> bool) -> Result<Graph> {
    imp::capture(x, forward, steady)
}

#[cfg(not(feature = "cuda"))]
mod imp {
    use super::*;
    pub fn capture(x: &Tensor, _: &dyn Fn(&Tensor) -> Result<Tensor>, _: &dyn Fn() -> bool) -> Result<Graph> {
        candle_core::bail!("a CUDA graph needs a CUDA device and a cuda build; x is on {:?}", x.device().location())
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
    fn end_raw(stream: &CudaStream) -> Result<Option<sys::CUgraph>> {
        // SAFETY: the stream is candle's, capturing on this thread since `begin_capture`.
        let graph = unsafe { result::stream::end_capture(stream.cu_stream()) }
            .map_err(|e| candle_core::Error::msg(format!("cuStreamEndCapture: {e:?}")))?;
        let graph = (!graph.is_null()).then_some(graph);
        if let Err(stored) = stream.context().check_err() {
            if let Some(g) = graph {
                destroy(stream, g);
            }
            candle_core::bail!("a call inside the capture failed: {stored:?}");
        }
        Ok(graph)
    }

    struct Real<'a> {
        dev: candle_core::cuda::CudaDevice,
        stream: Arc<CudaStream>, // candle's one stream
        forward: &'a dyn Fn(&Tensor) -> Result<Tensor>,
        steady: &'a dyn Fn() -> bool,
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
        fn forward(&mut self) -> Result<()> {
            self.out = Some((self.forward)(self.x)?);
            Ok(())
        }
        fn steady(&mut self) -> bool {
            (self.steady)()
        }
        fn synchronize(&mut self) -> Result<()> {
            self.out = None; // the warm-up's output is freed before the capture, not inside it
            self.x.device().synchronize()
        }
        fn begin_capture(&mut self) -> Result<()> {
            self.stream
                .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
                .map_err(|e| candle_core::Error::msg(format!("{e:?}")))
        }
        fn end_capture(&mut self) -> Result<()> {
            let graph = end_raw(&self.stream)?.ok_or_else(|| candle_core::Error::msg("the capture recorded no work"))?;
            // AUTO_FREE_ON_LAUNCH: the graph's own allocations still live at the end of a replay
            // (its output) are freed before the next replay, which allocates them again.
            let flags = sys::CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH;
            // SAFETY: `graph` is the valid graph just captured.
            let exec = unsafe { result::graph::instantiate(graph, flags) }.map_err(|e| {
                destroy(&self.stream, graph);
                candle_core::Error::msg(format!("cuGraphInstantiate: {e:?}"))
            })?;
            self.graph = Some(RawGraph { graph, exec, stream: self.stream.clone() });
            Ok(())
        }
        fn abort_capture(&mut self) -> Result<()> {
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

    pub fn capture(x: &Tensor, forward: &dyn Fn(&Tensor) -> Result<Tensor>, steady: &dyn Fn() -> bool) -> Result<Graph> {
        let dev = x.device().as_cuda_device()?.clone();
        let (graph, out) = {
            let mut real = Real { stream: dev.cuda_stream(), dev, forward, steady, x, guard: None, out: None, graph: None };
            let done = run_capture(&mut real);
            drop(real.guard.take()); // the h2d cache off again, whatever happened
            done?;
            (real.graph.take(), real.out.take())
        };
        let (Some(graph), Some(out)) = (graph, out) else { candle_core::bail!("the capture produced no graph") };
        // SAFETY: the graph's exec and candle's stream, both alive.
        unsafe { result::graph::upload(graph.exec, graph.stream.cu_stream()) }.map_err(|e| candle_core::Error::msg(format!("{e:?}")))?;
        Ok(Graph { replay: Box::new(move || graph.replay()), input: x.id(), out })
    }
}
