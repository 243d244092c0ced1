//! Unit tests of `ladder/src/roofline.rs`, compiled into that module (`#[path]`), so they
//! reach its private items.

use super::*;
use shared::Preset;

#[test]
fn fusion_and_fused_attention_raise_intensity() {
    let s = Preset::Small.shape();
    let stages = crate::default_stages();
    let traffic = |i: usize, p: Precision, act: f64| stages[i].traffic(&s, p, act);
    let t: Vec<f64> = (0..4).map(|i| traffic(i, Precision::Fp32, 4.0)).collect();
    assert!(t[0] > t[2] && t[2] > t[3], "{t:?}");
    // GEMM bytes alone are a lower bound: weights (4C² + 2·C·FF) once, in f32.
    let (c, ff) = (s.d_model as f64, s.ff as f64);
    assert!(t[3] > 4.0 * (4.0 * c * c + 2.0 * c * ff));
    // FP8 operands: 1 byte; with f32 activations the quantising pass (read f32, write E4M3)
    // costs more than the operands save, so stage 4 moves more bytes than stage 3 on a CPU.
    assert!(traffic(4, Precision::Fp8, 4.0) > t[3]);
}

#[test]
fn points_on_one_pixel_are_fanned_out() {
    let px = [(100, 100), (105, 96), (300, 100), (101, 101)];
    let (before, after): (Vec<i32>, Vec<i32>) = (0..px.len()).map(|i| overlapping(&px, i)).unzip();
    assert_eq!(before, vec![0, 1, 0, 2]);
    assert_eq!(after, vec![2, 1, 0, 0]);
}
