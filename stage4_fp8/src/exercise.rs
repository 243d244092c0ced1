//! Exercise (stage 4): delayed scaling's scale update, one call of it. Write the body of
//! `delayed_scale`; `cargo test --release -p stage4_fp8 --features exercise --test exercise`
//! passes when it is right. What to write, and what a right answer measures: docs/stages.md,
//! "Exercises". The solution is `exercise_solution.rs` beside this file (what `cargo test` runs
//! without the feature).
#![allow(unused_variables)] // the stub ignores its arguments until you write it

/// One call of delayed scaling for one activation: return the scale s to quantise this call's
/// input x with (x is stored as e4m3(x / s)), and record x's `amax` = max|x| in `history` (the
/// last `history.len()` calls' amaxes, oldest first).
///
/// - s = max(history) · 2^margin / 448, from the history *before* this amax joins it: the
///   scale is known before x is read, so a cast kernel can quantise and take the amax in one
///   pass. The max is floored at f32's smallest normal, 2⁻¹²⁶, so an all-zero history gives a
///   tiny positive s, not 0 (x / 0 would be NaN).
/// - Then the history drops its oldest entry and appends `amax` as its newest.
/// - The first call (`first`: no history yet) fills every slot with its own amax first, so its
///   scale is current scaling's: amax · 2^margin / 448.
pub fn delayed_scale(history: &mut [f32], amax: f32, margin: i32, first: bool) -> f32 {
    todo!("stage 4 exercise: (first: fill the history with amax), s from max(history), then roll amax in")
}
