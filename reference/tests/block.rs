//! The reference block computes the stages' function: against stage 0's fp32 output at every
//! precision the CPU runs, with B > 1 (bf16 takes candle-nn's one-sequence path).

use shared::check::compare;
use shared::device::{select, DeviceRequest};
use shared::stage::plan_alone;
use shared::weights::random_input;
use shared::{BlockWeights, Precision, PrecisionRequest, Preset, Shape, Stage};

#[test]
fn candle_nn_block_matches_stage0() {
    let shape = Shape { batch: 2, ..Preset::Tiny.shape() };
    let (device, info) = select(DeviceRequest::Cpu).unwrap();
    let w = BlockWeights::from_seed(&shape, 7).unwrap();
    let x = random_input(&shape, 7).unwrap();
    let run = |stage: &dyn Stage, p: PrecisionRequest| {
        let plan = plan_alone(stage, &device, &info, shape, p).unwrap();
        stage.build(&w, &plan).unwrap().forward(&x).unwrap()
    };
    let want = run(&stage0_baseline::Baseline, PrecisionRequest::Auto);
    for p in [Precision::Fp32, Precision::Bf16, Precision::F16] {
        let got = run(&reference::CandleNn, PrecisionRequest::Exactly(p));
        let c = compare(&got, &want, p).unwrap();
        assert!(c.passed, "{p}: {c:?}");
    }
}
