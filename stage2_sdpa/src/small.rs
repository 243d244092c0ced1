//! The small version: FlashAttention's online softmax for one head, in scalar loops and nothing
//! else. Read it before `attention.rs`: the fast CPU kernel is this algorithm plus engineering
//! (query rows in blocks of 12, keys in blocks of 32, S and O tiles in AVX-512 registers, rayon
//! over batch × heads), and the CUDA kernels are it plus tensor cores and shared memory.

/// softmax(q kᵀ / √d [+ causal mask]) v for one head, without the T × T scores: per query row,
/// a running max m, a running denominator l and an unnormalised output O, rescaled by
/// e^(m_old − m_new) whenever a key raises the max. q, k, v and the result: (T, d) rows.
pub fn online_softmax_attention(q: &[f32], k: &[f32], v: &[f32], d: usize, causal: bool) -> Vec<f32> {
    let t = q.len() / d;
    let scale = 1.0 / (d as f32).sqrt();
    let mut out = vec![0f32; t * d];
    for (i, o) in out.chunks_mut(d).enumerate() {
        let q_i = &q[i * d..(i + 1) * d];
        let (mut m, mut l) = (f32::NEG_INFINITY, 0f32); // running max and Σ e^(s − m)
        let keys = if causal { i + 1 } else { t }; // causal: keys after i are never read
        for j in 0..keys {
            let s = scale * q_i.iter().zip(&k[j * d..(j + 1) * d]).map(|(a, b)| a * b).sum::<f32>();
            let m_new = m.max(s);
            let alpha = (m - m_new).exp(); // rescales what was summed under the old max
            let p = (s - m_new).exp();
            l = alpha * l + p;
            for (o_x, v_x) in o.iter_mut().zip(&v[j * d..(j + 1) * d]) {
                *o_x = alpha * *o_x + p * v_x; // O = diag(α) O + p v_j
            }
            m = m_new;
        }
        o.iter_mut().for_each(|o_x| *o_x /= l); // O / l: the softmax's denominator, applied once
    }
    out
}
