//! The solution to stage 0's exercise (`exercise.rs` holds the stub; docs/stages.md, "Exercises").
//! Compiled as `stage0_baseline::exercise` when the `exercise` feature is off, so `cargo test` checks it.

/// softmax(s + causal mask) over each row of the (T, T) scores `s`, in place (see `exercise.rs`).
pub fn causal_softmax(s: &mut [f32], t: usize) {
    for (i, row) in s.chunks_mut(t).enumerate() {
        let (kept, masked) = row.split_at_mut(i + 1); // keys 0..=i; the rest is the mask's −∞
        let max = kept.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x)); // e^(x − max) ≤ 1: no overflow
        let mut sum = 0f32;
        for x in kept.iter_mut() {
            *x = (*x - max).exp();
            sum += *x;
        }
        kept.iter_mut().for_each(|x| *x /= sum);
        masked.fill(0.0); // e^(−∞) = 0
    }
}
