//! The solution to stage 4's exercise (`exercise.rs` holds the stub; docs/stages.md, "Exercises").
//! Compiled as `stage4_fp8::exercise` when the `exercise` feature is off, so `cargo test` checks it.

use crate::fp8::E4M3_MAX;

/// One call of delayed scaling: the scale from the history, then this call's amax joins it
/// (see `exercise.rs`).
pub fn delayed_scale(history: &mut [f32], amax: f32, margin: i32, first: bool) -> f32 {
    if first {
        history.fill(amax); // no history yet: this call's own amax stands for it
    }
    let max = history.iter().fold(0f32, |m, &a| m.max(a));
    let s = max.max(f32::MIN_POSITIVE) * (2f32.powi(margin) / E4M3_MAX); // the largest recent |x| lands at 448 / 2^margin
    if !first {
        history.rotate_left(1); // the oldest moves to the end ...
        if let Some(newest) = history.last_mut() {
            *newest = amax; // ... where this call's amax replaces it
        }
    }
    s
}
