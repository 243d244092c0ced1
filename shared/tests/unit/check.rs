//! Unit tests of `shared/src/check.rs`, compiled into that module (`#[path]`), so they
//! reach its private items.

use super::*;

#[test]
fn reference_pieces_keep_the_scores_within_the_limit() {
    let te = crate::Preset::Te.shape(); // B 8, n_head 32
    let t4096 = crate::Shape { seq: 4096, ..te };
    // 32·4096² = 5.4e8 per sequence: 3 sequences at a time within 2^31 - 1.
    assert_eq!(reference_batch_chunk(&t4096, crate::preset::MAX_TENSOR_ELEMENTS).unwrap(), 3);
    assert_eq!(reference_batch_chunk(&te, crate::preset::MAX_TENSOR_ELEMENTS).unwrap(), 8, "whole when it fits");
    let e = reference_batch_chunk(&crate::Shape { seq: 8192, ..te }, crate::preset::MAX_TENSOR_ELEMENTS).unwrap_err();
    assert!(e.to_string().contains("Fix:") && e.to_string().contains("(32, 8192, 8192)"), "{e}");
    let x = Tensor::arange(0f32, 3.0 * 2.0 * 4.0, &Device::Cpu).unwrap().reshape((3, 2, 4)).unwrap();
    let seen = std::cell::RefCell::new(Vec::new());
    let y = forward_in_pieces(&x, 2, |p| {
        seen.borrow_mut().push(p.dim(0)?);
        p * 2.0
    })
    .unwrap();
    assert_eq!(*seen.borrow(), [2, 1], "uneven pieces");
    assert_eq!(y.to_vec3::<f32>().unwrap(), (&x * 2.0).unwrap().to_vec3::<f32>().unwrap());
}

#[test]
fn tolerances_order_by_mantissa_bits() {
    use Precision::*;
    assert!(tolerance(Fp32) < tolerance(Tf32));
    assert!(tolerance(Tf32) < tolerance(F16));
    assert!(tolerance(F16) < tolerance(Bf16));
    assert!(tolerance(Bf16) < tolerance(Fp8));
}

#[test]
fn compare_measures_and_fails() {
    let r = Tensor::new(&[3f32, 4.0], &Device::Cpu).unwrap();
    let same = compare(&r, &r, Precision::Fp32).unwrap();
    assert_eq!(same.rel_err, 0.0);
    assert!(same.passed);
    // y − ref = (0, 0.05): ||·|| = 0.05, ||ref|| = 5 → 1e-2
    let y = Tensor::new(&[3f32, 4.05], &Device::Cpu).unwrap();
    let c = compare(&y, &r, Precision::Fp32).unwrap();
    assert!((c.rel_err - 1e-2).abs() < 1e-6 && (c.max_abs_err - 0.05).abs() < 1e-6);
    assert!(!c.passed);
    assert!(c.to_error("s", Precision::Fp32).unwrap().to_string().contains("exceeds the fp32 tolerance"));
    assert!(compare(&y, &r, Precision::Bf16).unwrap().passed);
    let nan = Tensor::new(&[f32::NAN, 4.0], &Device::Cpu).unwrap();
    let c = compare(&nan, &r, Precision::Fp8).unwrap();
    assert_eq!(c.non_finite, 1);
    assert!(!c.passed);
}
