//! Exercise (stage 2): one step of the online softmax. Write the body of `online_softmax_step`;
//! `cargo test --release -p stage2_sdpa --features exercise --test exercise` passes when it is
//! right. What to write, and what a right answer measures: docs/stages.md, "Exercises". The
//! solution is `exercise_solution.rs` beside this file (what `cargo test` runs without the feature).
#![allow(unused_variables)] // the stub ignores its arguments until you write it

/// One key j of FlashAttention's online softmax for one query row. The row so far is summed
/// under its running max `m`: `l` = Σ e^(s_i − m), `o` = Σ e^(s_i − m) v_i (d values,
/// unnormalised). Absorb key j's score `s` and value row `v_j` (d values): update `o` in place
/// and return the new (m, l). Before the first key: m = −∞, l = 0, o = 0. After the last:
/// o / l is the softmax-weighted average of the v rows, without the scores ever being stored.
/// The loop body of `small::online_softmax_attention`, written by you.
pub fn online_softmax_step(m: f32, l: f32, o: &mut [f32], s: f32, v_j: &[f32]) -> (f32, f32) {
    todo!("stage 2 exercise: rescale l and o by e^(m_old − m_new), then add key j's e^(s − m_new) and its v row")
}
