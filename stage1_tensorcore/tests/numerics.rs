//! Stage 1 against the fp32 stage-0 reference on the CPU, at every precision the CPU can run.
//! The error must be within the written tolerance and, for bf16/f16, measurably above fp32's —
//! otherwise the check would not be looking at reduced-precision arithmetic at all.

use candle_core::{DType, Device, Tensor};
use shared::check::{compare, tolerance};
use shared::device::{select, DeviceRequest};
use shared::stage::plan_alone;
use shared::weights::random_input;
use shared::{BlockWeights, Precision, PrecisionRequest, Preset, Shape, Stage};

fn run(spec: &dyn Stage, shape: Shape, requested: PrecisionRequest) -> (Tensor, Precision) {
    let (device, info) = select(DeviceRequest::Cpu).unwrap();
    let w = BlockWeights::from_seed(&shape, 11).unwrap();
    let x = random_input(&shape, 11).unwrap();
    let plan = plan_alone(spec, &device, &info, shape, requested).unwrap();
    let y = spec.build(&w, &plan).unwrap().forward(&x).unwrap();
    (y, plan.precision)
}

fn errors(shape: Shape) -> Vec<(Precision, f64)> {
    let (reference, _) = run(&stage0_baseline::Baseline, shape, PrecisionRequest::Auto);
    [Precision::Fp32, Precision::F16, Precision::Bf16]
        .into_iter()
        .map(|p| {
            let (y, got) = run(&stage1_tensorcore::TensorCore, shape, PrecisionRequest::Exactly(p));
            assert_eq!(got, p);
            assert_eq!(y.dtype(), DType::F32, "the residual stream, and so the output, stays f32");
            let c = compare(&y, &reference, p).unwrap();
            assert!(c.passed, "{p}: rel err {} above tolerance {}", c.rel_err, tolerance(p));
            (p, c.rel_err)
        })
        .collect()
}

#[test]
fn within_tolerance_and_not_vacuous_on_tiny() {
    let e = errors(Preset::Tiny.shape());
    let (fp32, f16, bf16) = (e[0].1, e[1].1, e[2].1);
    // auto on CPU is fp32: the same arithmetic as stage 0.
    assert_eq!(fp32, 0.0, "fp32 stage 1 is stage 0's arithmetic");
    // bf16 keeps 8 significant bits, f16 11: both well above fp32's 0, bf16 above f16.
    assert!(f16 > 1e-6, "f16 error {f16} is suspiciously small: did the GEMMs run in f16?");
    assert!(bf16 > 1e-5, "bf16 error {bf16} is suspiciously small: did the GEMMs run in bf16?");
    assert!(bf16 > 2.0 * f16, "bf16 ({bf16}) should be clearly less precise than f16 ({f16})");
}

#[test]
fn odd_shape_too() {
    // T = 7, C = 24 with 3 heads (d_head 8), FF = 40: nothing a multiple of a tile.
    errors(Shape { batch: 2, seq: 7, d_model: 24, n_head: 3, ff: 40 });
}

#[test]
fn mixed_precision_attention_against_fp32_attention() {
    // (B, T, C) = (2, 33, 64), 4 heads; values like post-LayerNorm activations.
    let (b, t, c, n_head) = (2, 33, 64, 4);
    let mk = |seed: u64| random_input(&Shape { batch: b, seq: t, d_model: c, n_head, ff: 1 }, seed).unwrap();
    let (q, k, v) = (mk(1), mk(2), mk(3));
    let mask = stage0_baseline::causal_mask(t, &Device::Cpu).unwrap();
    let reference = stage0_baseline::attention(&q, &k, &v, n_head, &mask).unwrap();
    for dt in [DType::BF16, DType::F16] {
        let cast = |x: &Tensor| x.to_dtype(dt).unwrap();
        let a = stage1_tensorcore::attention(&cast(&q), &cast(&k), &cast(&v), n_head, &mask).unwrap();
        assert_eq!(a.dtype(), dt, "attention output stays in the GEMM dtype");
        let c = compare(&a, &reference, if dt == DType::BF16 { Precision::Bf16 } else { Precision::F16 }).unwrap();
        assert!(c.passed && c.rel_err > 0.0, "{dt:?}: {c:?}");
    }
}
