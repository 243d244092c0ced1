//! Unit tests of `shared/src/preset.rs`, compiled into that module (`#[path]`), so they
//! reach its private items.

use super::*;

/// The suggestion is never empty, and near n_head on both sides.
#[test]
fn heads_suggestion_is_never_empty() {
    assert_eq!(near_divisors(128, 256), [64, 128]);
    assert_eq!(near_divisors(768, 10), [6, 8, 12, 16]);
    assert_eq!(near_divisors(7, 3), [1, 7]);
    assert!(!near_divisors(usize::MAX, 1 << 40).is_empty());
    let e = Shape { batch: 1, seq: 1, d_model: 128, n_head: 256, ff: 1 }.validate(None).unwrap_err().to_string();
    assert!(e.contains("among [64, 128]") && !e.contains("[]"), "{e}");
}

#[test]
fn presets_match_design_table() {
    assert_eq!(Preset::Small.shape(), Shape { batch: 4, seq: 512, d_model: 768, n_head: 12, ff: 3072 });
    assert_eq!(Preset::Te.shape().d_head(), 128);
    for p in [Preset::Tiny, Preset::Small, Preset::Gpt2, Preset::Te] {
        p.shape().validate(None).unwrap();
    }
}

#[test]
fn rejects_bad_shapes_with_reason() {
    let mut s = Preset::Tiny.shape();
    s.n_head = 3;
    let e = s.validate(None).unwrap_err().to_string();
    assert!(e.contains("not divisible by n_head = 3"), "{e}");
    let mut s = Preset::Tiny.shape();
    s.seq = 0;
    assert!(s.validate(None).unwrap_err().to_string().contains("--seq (T) is 0"));
    let mut s = Preset::Tiny.shape();
    s.seq = 1 << 20;
    s.validate(None).unwrap();
    assert!(s.validate_score_matrix().unwrap_err().to_string().contains("attention scores"));
    let mut s = Preset::Tiny.shape();
    s.batch = usize::MAX / 2;
    assert!(s.validate(None).unwrap_err().to_string().contains("2^64"));
    // W_qkv (3C, C) counts: C = 30000 is 2.7e9 elements even with FF = 1.
    let s = Shape { batch: 1, seq: 1, d_model: 30000, n_head: 1, ff: 1 };
    assert!(s.validate(None).unwrap_err().to_string().contains("W_qkv"));
    // 3C overflowing usize is refused, not wrapped.
    let s = Shape { batch: 1, seq: 1, d_model: usize::MAX / 2, n_head: 1, ff: 1 };
    assert!(s.validate(None).is_err());
    assert_eq!(Shape { n_head: 0, ..s }.d_head(), 0);
    // A huge C that n_head does not divide: answered at once (no scan over 1..=C).
    let s = Shape { batch: 1, seq: 1, d_model: 1 << 40, n_head: 3, ff: 1 };
    assert!(s.validate(None).unwrap_err().to_string().contains("[1, 2, 4, 8]"));
    // B from an input file is named as such, not as --batch.
    let s = Shape { batch: 1 << 40, ..Preset::Tiny.shape() };
    let e = s.validate(Some(Path::new("x.st"))).unwrap_err().to_string();
    assert!(e.contains("input file x.st") && !e.contains("--batch"), "{e}");
}

#[test]
fn naive_estimate_is_dominated_by_scores_at_long_t() {
    let mut s = Preset::Small.shape();
    s.seq = 4096;
    let scores = 4 * (s.batch * s.n_head * s.seq * s.seq) as u128;
    assert!(s.estimate_naive_bytes() > 3 * scores);
}
