//! Exercise (stage 3): the bias + GELU epilogue, the pass that follows fc1's GEMM. Write the
//! body of `bias_gelu_epilogue`; `cargo test --release -p stage3_fused --features exercise
//! --test exercise` passes when it is right. What to write, and what a right answer measures:
//! docs/stages.md, "Exercises". The solution is `exercise_solution.rs` beside this file (what
//! `cargo test` runs without the feature).
#![allow(unused_variables)] // the stub ignores its arguments until you write it

/// y ← gelu_tanh(y + b) in place, for the GEMM's output `y`: rows of N = `b.len()` values,
/// row-major, f32. gelu_tanh(v) = 0.5·v·(1 + tanh(√(2/π)·(v + 0.044715·v³))), GPT-2's GELU. One
/// read and one write of each value, where the unfused block makes a pass for the bias add and
/// seven more for GELU's primitive ops (`ops::linear_bias_gelu_slow`). Every finite v gives a
/// finite output, v = ±100 included.
pub fn bias_gelu_epilogue(y: &mut [f32], b: &[f32]) {
    todo!("stage 3 exercise: for each row, v = y[n] + b[n], then y[n] = gelu_tanh(v), in one loop")
}
