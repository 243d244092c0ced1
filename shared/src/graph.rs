//! `--cuda-graph`: capture a built stage's forward once as a CUDA graph and replay it, so the
//! CPU issues one launch per forward instead of one per kernel (dozens in stages 0–2). What it
//! saves is launch overhead — a few µs per kernel — which matters when kernels are short:
//! small shapes, or a fused stage whose kernels are few and fast.
//!
//! How: one ordinary forward first (loads every kernel module, compiles NVRTC code, creates
//! library handles — none of which may happen inside a capture), then the forward again with
//! the stream in capture mode (candle's small host-to-device copies go through its graph-safe
//! cache meanwhile), then instantiate with AUTO_FREE_ON_LAUNCH so the graph's own allocations
//! (its output) are released before each replay. A replay computes the captured input: the
//! runner always times the same x, and a different x is an error, not a silent stale result.

use crate::error::SpeedkitError;
use crate::stage::Forward;
use candle_core::Tensor;

/// Call once, before any tensor of the run exists on `device`: refuses the CPU (exit 2), and on
/// CUDA turns off candle's per-tensor event tracking. Everything runs on one stream, so the
/// events guard no cross-stream hazard, and recorded inside a capture they would later be
/// waited on outside it.
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
    use candle_core::cuda::cudarc::driver::{sys, CudaGraph};

    struct Graphed {
        graph: CudaGraph,
        input: candle_core::TensorId,
        out: Tensor,
        // The stage owns the weights the graph reads: it must outlive the graph.
        _stage: Box<dyn Forward>,
    }

    impl Forward for Graphed {
        fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
            if x.id() != self.input {
                candle_core::bail!("a CUDA graph replays the input it captured; build it again for another input");
            }
            self.graph.launch().map_err(|e| candle_core::Error::Msg(format!("CUDA graph launch: {e:?}")))?;
            Ok(self.out.clone())
        }
    }

    pub fn capture(name: &str, stage: Box<dyn Forward>, x: &Tensor) -> anyhow::Result<Box<dyn Forward>> {
        let dev = x.device().as_cuda_device()?.clone();
        let stream = dev.cuda_stream();
        drop(stage.forward(x)?); // warm: module loads, NVRTC, handles — not capturable
        x.device().synchronize()?;
        let _htod = dev.enable_cuda_graph_htod_cache();
        stream.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL).map_err(|e| refuse(name, format!("{e:?}")))?;
        let out = stage.forward(x);
        // End the capture whatever happened, so the stream is usable again.
        let graph = stream.end_capture(sys::CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH);
        let out = out.map_err(|e| refuse(name, e.to_string()))?;
        let graph =
            graph.map_err(|e| refuse(name, format!("{e:?}")))?.ok_or_else(|| refuse(name, "the capture recorded no work".into()))?;
        graph.upload().map_err(|e| refuse(name, format!("{e:?}")))?;
        Ok(Box::new(Graphed { graph, input: x.id(), out, _stage: stage }))
    }

    fn refuse(name: &str, why: String) -> anyhow::Error {
        SpeedkitError::usage(format!(
            "--cuda-graph: {name}'s forward could not be captured as a CUDA graph ({why}). Something in it is not \
             capturable (a synchronous copy or allocation, a host read of device data). Fix: run {name} without --cuda-graph."
        ))
        .into()
    }
}
