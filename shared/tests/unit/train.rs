//! Unit tests of `shared/src/train.rs`, compiled into that module (`#[path]`), so they
//! reach its private items.

use super::*;
use crate::{Preset, Shape};

#[test]
fn pieces_are_the_most_sequences_that_fit() {
    let s = Shape { batch: 8, ..Preset::Small.shape() };
    let need = |s: &Shape| s.estimate_naive_train_bytes().total();
    let one = need(&Shape { batch: 1, ..s });
    assert_eq!(piece_batch(&s, 8, None, need), 8, "unknown free memory: the whole batch");
    assert_eq!(piece_batch(&s, 8, Some(u64::MAX), need), 8);
    assert_eq!(piece_batch(&s, 3, Some(u64::MAX), need), 3, "never past the element limit's piece");
    // Room for three sequences' steps (with the 10 % headroom), not four.
    let three = need(&Shape { batch: 3, ..s });
    assert_eq!(piece_batch(&s, 8, Some((three * 10 / 9 + 1) as u64), need), 3);
    assert_eq!(piece_batch(&s, 8, Some((one * 10 / 9 + 1) as u64), need), 1);
    assert_eq!(piece_batch(&s, 8, Some(1), need), 1, "none fits: one (the runner refused it up front)");
}

#[test]
fn a_training_step_names_its_largest_part_first() {
    let t = TrainBytes { params: 1 << 30, scores: 3 << 30, activations: 2 << 30 };
    assert_eq!(t.total(), 6 << 30);
    let d = t.describe();
    let at = |what: &str| d.find(what).unwrap_or_else(|| panic!("{what} in {d}"));
    assert!(at("(B, n_head, T, T)") < at("(B, T, FF)") && at("(B, T, FF)") < at("AdamW"), "{d}");
    assert!(d.contains("3.00 GiB"), "{d}");
    // A fused stage has no T x T part to name.
    assert!(!TrainBytes { scores: 0, ..t }.describe().contains("n_head, T, T"));
}
