//! Unit tests of `shared/src/regime.rs`, compiled into that module (`#[path]`), so they
//! reach its private items.

use super::*;
use crate::preset::Preset;

fn roofs() -> Roofs {
    Roofs { gflops: 173.0, gbs: 19.0 }
}

#[test]
fn fused_names_split_into_the_blocks_parts() {
    assert_eq!(components("proj+residual+ln2"), Some(vec!["proj+residual", "ln2"]));
    assert_eq!(components("fc1+gelu"), Some(vec!["fc1+gelu"]));
    assert_eq!(components("ln1"), Some(vec!["ln1"]));
    assert_eq!(components("proj+"), None);
    assert_eq!(components("softmax"), None);
    assert_eq!(components(""), None);
}

#[test]
fn the_parts_gemm_flops_add_up_to_the_blocks() {
    let s = Preset::Small.shape();
    let total: f64 = PART_NAMES.iter().map(|p| part_work(p, &s, 4.0, 4.0).unwrap().flops).sum();
    let (n, c, ff) = ((s.batch * s.seq) as f64, s.d_model as f64, s.ff as f64);
    let elementwise = 7.0 * n * c * 2.0 + n * 3.0 * c + 2.0 * n * c * 2.0 + 9.0 * n * ff;
    let block = crate::perf::block_flops(&s);
    assert!((total - elementwise - block).abs() <= 1e-9 * block, "{total} vs {block} + {elementwise}");
}

#[test]
fn fusing_drops_the_handoff_but_keeps_the_work() {
    let s = Preset::Small.shape();
    let (a, b) = (part_work("proj+residual", &s, 4.0, 4.0).unwrap(), part_work("ln2", &s, 4.0, 4.0).unwrap());
    let fused = part_work("proj+residual+ln2", &s, 4.0, 4.0).unwrap();
    assert_eq!(fused.flops, a.flops + b.flops);
    let n_c = (s.batch * s.seq * s.d_model) as f64;
    assert_eq!(fused.min_bytes, a.min_bytes + b.min_bytes - 4.0 * n_c);
}

#[test]
fn labels_follow_the_roof_that_explains_the_time() {
    let s = Preset::Small.shape();
    // qkv at small: 7.25 GFLOP; at 40 ms that is 181 GFLOP/s, the measured GEMM rate.
    let qkv = classify(part_work("qkv", &s, 4.0, 4.0).unwrap(), 40.0, roofs()).unwrap();
    assert_eq!(qkv.regime, "compute-bound");
    assert!(qkv.pct_of_compute_roof > 90.0, "{qkv:?}");
    // ln1 at small moves 12.6 MB at least: 1.0 ms is 12.6 GB/s, two thirds of STREAM.
    let ln = classify(part_work("ln1", &s, 4.0, 4.0).unwrap(), 1.0, roofs()).unwrap();
    assert_eq!(ln.regime, "memory-bound");
    // The same LayerNorm taking 10 ms is far from both roofs.
    let slow = classify(part_work("ln1", &s, 4.0, 4.0).unwrap(), 10.0, roofs()).unwrap();
    assert_eq!(slow.regime, UNEXPLAINED);
    assert_eq!(tag(&slow), "U 7%");
    // Stage 0's attention at small (1.6 GFLOP in 223 ms) is unexplained by both roofs: the T × T passes.
    let att = classify(part_work("attention", &s, 4.0, 4.0).unwrap(), 223.0, roofs()).unwrap();
    assert_eq!(att.regime, UNEXPLAINED);
    assert!(classify(part_work("qkv", &s, 4.0, 4.0).unwrap(), 0.0, roofs()).is_none());
}
