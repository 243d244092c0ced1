//! The solution to stage 2's exercise (`exercise.rs` holds the stub; docs/stages.md, "Exercises").
//! Compiled as `stage2_sdpa::exercise` when the `exercise` feature is off, so `cargo test` checks it.

/// One key j of FlashAttention's online softmax for one query row: (m, l, o) absorb score `s`
/// and value row `v_j`; returns the new (m, l), `o` updated in place (see `exercise.rs`).
pub fn online_softmax_step(m: f32, l: f32, o: &mut [f32], s: f32, v_j: &[f32]) -> (f32, f32) {
    let m_new = m.max(s);
    let alpha = (m - m_new).exp(); // e^(m_old − m_new): 1 if the max held, 0 on the first key (m = −∞)
    let p = (s - m_new).exp(); // key j's weight under the new max, ≤ 1: never overflows
    for (o_x, v_x) in o.iter_mut().zip(v_j) {
        *o_x = alpha * *o_x + p * v_x; // O = diag(α) O + p v_j
    }
    (m_new, alpha * l + p) // l = α l + p
}
