//! The small version: LayerNorm over rows in one read of each row, scalar loops only. Read it
//! before `ops::layer_norm`, which is this plus engineering: 8 partial sums so the statistics
//! loop vectorises, rows handed to rayon 16 at a time, the cast to the GEMM's dtype in the store.

/// y = (x − mean) / √(var + eps) · g + b per row of `c` values. One read of the row gathers Σy and
/// Σy² with y = x − x₀ (shifted by the row's first value, in f64, so a row with a large mean does
/// not cancel); a second loop over the same row, still in L1, normalises and writes.
pub fn layer_norm_one_pass(x: &[f32], g: &[f32], b: &[f32], c: usize, eps: f64) -> Vec<f32> {
    let mut out = vec![0f32; x.len()];
    for (row, o) in x.chunks(c).zip(out.chunks_mut(c)) {
        let shift = row[0] as f64;
        let (mut s1, mut s2) = (0f64, 0f64);
        for &v in row {
            let y = v as f64 - shift;
            s1 += y;
            s2 += y * y;
        }
        let n = c as f64;
        let mean = shift + s1 / n;
        let var = ((s2 - s1 * s1 / n) / n).max(0.0); // biased variance, as PyTorch's LayerNorm
        let inv_std = 1.0 / (var + eps).sqrt();
        for (i, (o_i, &v)) in o.iter_mut().zip(row).enumerate() {
            *o_i = ((v as f64 - mean) * inv_std) as f32 * g[i] + b[i];
        }
    }
    out
}
