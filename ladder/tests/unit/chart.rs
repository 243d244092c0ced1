//! Unit tests of `ladder/src/chart.rs`, compiled into that module (`#[path]`), so they
//! reach its private items.

use super::*;

#[test]
fn lines_break_at_missing_values() {
    let pts = [(0.0, 1.0), (1.0, 2.0), (3.0, 4.0)];
    assert_eq!(segments(&pts), vec![vec![(0.0, 1.0), (1.0, 2.0)], vec![(3.0, 4.0)]]);
    assert!(segments(&[]).is_empty());
}

#[test]
fn log_ticks() {
    assert_eq!(ticks_125(0.3, 7.0), vec![0.5, 1.0, 2.0, 5.0]);
    assert_eq!(ticks_125(15.0, 300.0), vec![20.0, 50.0, 100.0, 200.0]);
}

#[test]
fn stage_colours_follow_the_stage_number() {
    assert_eq!(stage_colour("stage4_fp8", 0), COLOURS[4]);
    assert_eq!(stage_colour("custom", 2), COLOURS[2]);
}
