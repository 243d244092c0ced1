//! Exercise (stage 1): rounding an f32 to bf16, the conversion every bf16 GEMM's operands go
//! through. Write the body of `f32_to_bf16_bits`; `cargo test --release -p stage1_tensorcore
//! --features exercise --test exercise` passes when it is right. What to write, and what a
//! right answer measures: docs/stages.md, "Exercises". The solution is `exercise_solution.rs`
//! beside this file (what `cargo test` runs without the feature).
#![allow(unused_variables)] // the stub ignores its arguments until you write it

/// The bf16 nearest to `x`, as its 16 bits: bf16 is f32's top half (1 sign, 8 exponent, 7
/// mantissa bits), so the conversion drops the low 16 bits — rounding to nearest, ties to even,
/// not truncating. Values past bf16's largest finite (~3.39e38) round to ±∞, as IEEE rounding
/// does; a NaN stays a NaN (careful: a NaN whose payload is all in the low 16 bits).
pub fn f32_to_bf16_bits(x: f32) -> u16 {
    todo!("stage 1 exercise: add 0x7FFF plus the lowest kept bit to x's bits, keep the top 16; NaN apart")
}
