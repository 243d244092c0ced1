//! `--cuda-graph`: every stage's forward captured once as a CUDA graph and timed as its replays
//! (the `cuda_graph` crate does the capture; this is the runner's side of it).

use crate::error::SpeedkitError;
use crate::stage::Forward;
use candle_core::Tensor;

/// Refuses the CPU (exit 2). (`device::select` already did `cuda_graph::prepare`'s work on CUDA.)
pub fn prepare(device: &candle_core::Device) -> Result<(), SpeedkitError> {
    if !device.is_cuda() {
        return Err(SpeedkitError::usage(
            "--cuda-graph replays captured GPU work, and this run is on the CPU, where there is no launch overhead to save. \
             Fix: drop --cuda-graph, or run on a GPU with --device cuda (a --features cuda build).",
        ));
    }
    Ok(())
}

/// Capture `stage` on `x`, warming up until it is steady (exit 2 if its forward does something a
/// capture does not allow).
pub fn capture(name: &str, stage: Box<dyn Forward>, x: &Tensor) -> anyhow::Result<Box<dyn Forward>> {
    prepare(x.device())?;
    let graph = cuda_graph::capture(x, &|x| stage.forward(x), &|| stage.steady()).map_err(|e| {
        SpeedkitError::usage(format!(
            "--cuda-graph: {name}'s forward could not be captured as a CUDA graph ({e}). Something in it is not \
             capturable (a synchronous copy or allocation, a host read of device data), or it never reached a steady \
             path. Fix: run {name} without --cuda-graph."
        ))
    })?;
    Ok(Box::new(Graphed { graph, stage }))
}

/// `forward` replays the graph; `self_check` and `ran` ask the stage itself.
pub struct Graphed {
    graph: cuda_graph::Graph,
    // Owns the weights the graph reads: declared last, so dropped after the graph.
    stage: Box<dyn Forward>,
}

impl Forward for Graphed {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        self.graph.replay(x)
    }

    fn self_check(&self, x: &Tensor, y: &Tensor) -> anyhow::Result<Option<crate::check::NamedCheck>> {
        self.stage.self_check(x, y)
    }

    fn ran(&self) -> Vec<String> {
        self.stage.ran()
    }
}

#[cfg(test)]
#[path = "../tests/unit/graph.rs"]
mod tests;
