//! Exercise (stage 0): the causal softmax over one head's T × T scores, in scalar loops. Write
//! the body of `causal_softmax`; `cargo test --release -p stage0_baseline --features exercise
//! --test exercise` passes when it is right. What to write, and what a right answer measures:
//! docs/stages.md, "Exercises". The solution is `exercise_solution.rs` beside this file (what
//! `cargo test` runs without the feature).
#![allow(unused_variables)] // the stub ignores its arguments until you write it

/// softmax(s + causal mask) over each row of the (T, T) scores `s` (row-major, in place): row i
/// keeps keys 0..=i and gets 0 above the diagonal; each row's kept weights sum to 1. What
/// stage 0's `attention` computes with five tensor ops (mask add, max, subtract and exp, sum,
/// divide), each a pass over (B, n_head, T, T); here one row at a time.
pub fn causal_softmax(s: &mut [f32], t: usize) {
    todo!("stage 0 exercise: per row i, subtract the max of s[i][0..=i], exponentiate, divide by the sum; zero the rest")
}
