//! The solution to stage 1's exercise (`exercise.rs` holds the stub; docs/stages.md, "Exercises").
//! Compiled as `stage1_tensorcore::exercise` when the `exercise` feature is off, so `cargo test` checks it.

/// The bf16 nearest to `x` (ties to even), as its 16 bits (see `exercise.rs`).
pub fn f32_to_bf16_bits(x: f32) -> u16 {
    let bits = x.to_bits();
    if x.is_nan() {
        return ((bits >> 16) | 0x0040) as u16; // keep sign and payload's top, force a quiet NaN
    }
    // Below half an ulp of the kept part (0x8000) rounds down, above rounds up; at exactly half,
    // adding the kept part's lowest bit makes an odd mantissa carry up and an even one stay.
    // A carry out of the mantissa bumps the exponent, and out of the largest finite gives ∞.
    let rounded = bits.wrapping_add(0x7FFF + ((bits >> 16) & 1));
    (rounded >> 16) as u16
}
