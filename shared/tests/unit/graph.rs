//! Unit tests of `shared/src/graph.rs`, compiled into that module (`#[path]`), so they
//! reach its private items.

use super::*;

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
    let g = Graphed { graph: cuda_graph::Graph::from_parts(Box::new(|| Ok(())), &x, x.clone()), stage: Box::new(Checked) };
    let y = g.forward(&x).unwrap();
    assert_eq!(g.self_check(&x, &y).unwrap_err().to_string(), "the stage's own check ran");
    assert!(g.forward(&x.clone().contiguous().unwrap().affine(1.0, 0.0).unwrap()).is_err(), "another input is refused");
}
