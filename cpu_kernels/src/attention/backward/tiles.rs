//! The backward's five tile products on register-blocked micro-kernels: the forward's register
//! tile (`registers::Simd`: 12 rows × 2 vectors of 16 f32 with AVX-512, 12 × 1 vector of 8 with
//! AVX2) over every product, instead of a general GEMM call per product. A general GEMM packs
//! both operands on every call (a tenth of the backward's time at `small`) and dispatches on the
//! shape; here each operand is laid out once per head, in the order the micro-kernel reads it:
//!
//! ```text
//! product               A (broadcast, any strides)   B (vectors, packed once per head)
//! S  = Q_i K_jᵀ · scale  Q_i rows                     Kᵀ in panels of NR keys: (d, NR) each
//! dP = dO_i V_jᵀ         dO_i rows                    Vᵀ in panels of NR keys
//! dV_j += Pᵀ dO_i        P read down its columns      dO in panels of NR channels: (T, NR) each
//! dQ_i += dS K_j · scale dS rows                      K in panels of NR channels
//! dK_j += dSᵀ Q_i · scale dS read down its columns    Q in panels of NR channels
//! ```
//!
//! NR = 32 (AVX-512) or 8 (AVX2) columns per panel, so a micro-kernel step reads one contiguous
//! row of NR f32; the head's rows in the (B, T, n_head, d_head) buffer are n_head·d f32 apart,
//! where a tile's loads would fall into a few L1 sets (as the forward's comment explains). The
//! A operand needs no packing: each step broadcasts one element of each of the 12 rows.
//! The tiles, the loop order and the equations are `head_bwd_impl`'s; its slow twins check this.

use super::{log_sum_exp, HeadIo, Rows, BC, BR};
use crate::attention::registers::{Avx2, Avx512, Simd, MR};

/// AVX-512: 12 × 32 register tiles.
///
/// # Safety
/// The CPU supports AVX-512F and FMA; `d` is one of the forward's register head sizes.
#[target_feature(enable = "avx512f,avx2,fma")]
pub(super) unsafe fn head_bwd_avx512(io: &HeadIo, t: usize, d: usize, scale: f32, causal: bool) -> [Vec<f32>; 3] {
    head_bwd::<Avx512, 2>(io, t, d, scale, causal)
}

/// AVX2: 12 × 8 register tiles.
///
/// # Safety
/// The CPU supports AVX2 and FMA; `d` is one of the forward's register head sizes.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn head_bwd_avx2_fma(io: &HeadIo, t: usize, d: usize, scale: f32, causal: bool) -> [Vec<f32>; 3] {
    head_bwd::<Avx2, 1>(io, t, d, scale, causal)
}

/// An operand read one element at a time and broadcast: element (i, k) at `p + i·rs + k·cs`.
#[derive(Clone, Copy)]
struct Bcast {
    p: *const f32,
    rs: usize,
    cs: usize,
}

/// dQ, dK, dV of one head as (T, d) rows, NR = NV·LANES columns per register tile.
///
/// # Safety
/// The CPU supports `S`'s instruction set; d is a multiple of `S::LANES` (every register head
/// size is a multiple of 16).
#[inline(always)]
unsafe fn head_bwd<S: Simd, const NV: usize>(io: &HeadIo, t: usize, d: usize, scale: f32, causal: bool) -> [Vec<f32>; 3] {
    let nr = NV * S::LANES;
    assert!(BC.is_multiple_of(nr) && d.is_multiple_of(S::LANES), "register tiles divide B_c and d_head");
    let HeadIo { q, k, v, o, d_o, lse } = *io;
    let lse = match lse {
        Some(l) => std::borrow::Cow::Borrowed(l),
        None => std::borrow::Cow::Owned(log_sum_exp(q, k, t, d, scale, causal)),
    };
    // D_i = rowsum(dO_i ∘ O_i), 16 partial sums per row so the loop vectorises.
    let mut delta = vec![0f32; t];
    for (r, di) in delta.iter_mut().enumerate() {
        *di = dot(d_o.row(r, d), o.row(r, d));
    }
    let (kt, vt) = (key_panels(k, t, d, nr), key_panels(v, t, d, nr));
    let (kc, qc, doc) = (channel_panels(k, t, d, nr), channel_panels(q, t, d, nr), channel_panels(d_o, t, d, nr));
    // B operands: keys j0 + c0.. of a key panel (rows: channels, NR apart); rows r0.. of a
    // channel panel (rows: positions, w apart, w = the panel's width).
    let keys = |panels: &[f32], j0: usize| {
        let base = panels.as_ptr();
        move |c0: usize| (base.add((j0 + c0) / nr * d * nr), nr)
    };
    let rows = |panels: &[f32], r0: usize| {
        let base = panels.as_ptr();
        move |c0: usize| {
            let w = nr.min(d - c0);
            (base.add(t * c0 + r0 * w), w)
        }
    };
    let (mut dq, mut dk, mut dv) = (vec![0f32; t * d], vec![0f32; t * d], vec![0f32; t * d]);
    let (mut p, mut dp) = (vec![0f32; BR * BC], vec![0f32; BR * BC]); // P, then dS, in p; dP: B_r × B_c, row stride B_c
    for j0 in (0..t).step_by(BC) {
        let bc = BC.min(t - j0);
        let bc_tiles = bc.next_multiple_of(nr); // S and dP columns computed (keys past T are zero in the panels)
        let i_first = if causal { j0 / BR * BR } else { 0 };
        for i0 in (i_first..t).step_by(BR) {
            let br = BR.min(t - i0);
            let q_i = Bcast { p: q.data.as_ptr().add(i0 * q.rs), rs: q.rs, cs: 1 };
            let do_i = Bcast { p: d_o.data.as_ptr().add(i0 * d_o.rs), rs: d_o.rs, cs: 1 };
            // S = Q_i K_jᵀ · scale
            product::<S, NV>((br, bc_tiles, d), q_i, keys(&kt, j0), (p.as_mut_ptr(), BC), false, scale);
            for r in 0..br {
                let n = if causal { bc.min((i0 + r + 1).saturating_sub(j0)) } else { bc };
                let row = &mut p[r * BC..][..bc];
                S::exp_sum(&mut row[..n], lse[i0 + r]); // P = exp(S − L)
                row[n..].fill(0.0); // masked: P = 0, so dS = 0 there too
            }
            // dV_j += Pᵀ dO_i
            let p_t = Bcast { p: p.as_ptr(), rs: 1, cs: BC };
            product::<S, NV>((bc, d, br), p_t, rows(&doc, i0), (dv.as_mut_ptr().add(j0 * d), d), true, 1.0);
            // dP = dO_i V_jᵀ
            product::<S, NV>((br, bc_tiles, d), do_i, keys(&vt, j0), (dp.as_mut_ptr(), BC), false, 1.0);
            for r in 0..br {
                let di = delta[i0 + r];
                let (ds, dp) = (&mut p[r * BC..][..bc], &dp[r * BC..][..bc]);
                ds.iter_mut().zip(dp).for_each(|(x, &g)| *x *= g - di); // dS = P ∘ (dP − D_i), in place of P
            }
            // dQ_i += dS K_j · scale
            let ds = Bcast { p: p.as_ptr(), rs: BC, cs: 1 };
            product::<S, NV>((br, d, bc), ds, rows(&kc, j0), (dq.as_mut_ptr().add(i0 * d), d), true, scale);
            // dK_j += dSᵀ Q_i · scale
            let ds_t = Bcast { p: p.as_ptr(), rs: 1, cs: BC };
            product::<S, NV>((bc, d, br), ds_t, rows(&qc, i0), (dk.as_mut_ptr().add(j0 * d), d), true, scale);
        }
    }
    [dq, dk, dv]
}

/// Σ a_c·b_c over a row of d (a multiple of 16) f32, in 16 partial sums.
#[inline(always)]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 16];
    for (x, y) in a.chunks_exact(16).zip(b.chunks_exact(16)) {
        for i in 0..16 {
            acc[i] += x[i] * y[i];
        }
    }
    acc.iter().sum()
}

/// Xᵀ in panels of `nr` keys: panel p is (d, nr), channel c of keys p·nr.. one row of it; keys
/// past T are zero.
#[inline(always)]
fn key_panels(x: Rows, t: usize, d: usize, nr: usize) -> Vec<f32> {
    let mut out = vec![0f32; t.div_ceil(nr) * d * nr];
    for (panel_index, panel) in out.chunks_exact_mut(d * nr).enumerate() {
        let keys = nr.min(t - panel_index * nr);
        // Blocks of 8 keys × 8 channels: 8 rows read, 8 panel rows written, all in L1.
        for j8 in (0..keys).step_by(8) {
            let rows: [&[f32]; 8] = std::array::from_fn(|jj| x.row(panel_index * nr + (j8 + jj).min(keys - 1), d));
            for c in 0..d {
                let dst = &mut panel[c * nr + j8..][..8.min(nr - j8)];
                for (jj, y) in dst.iter_mut().enumerate().take(keys - j8) {
                    *y = rows[jj][c];
                }
            }
        }
    }
    out
}

/// X in panels of `nr` channels: the panel of channels c0..c0 + w (w = nr, the last narrower
/// when nr does not divide d) is (T, w) at c0·T, rows w apart.
#[inline(always)]
fn channel_panels(x: Rows, t: usize, d: usize, nr: usize) -> Vec<f32> {
    let mut out = vec![0f32; t * d];
    for c0 in (0..d).step_by(nr) {
        let w = nr.min(d - c0);
        let panel = &mut out[t * c0..][..t * w];
        for j in 0..t {
            // An element loop, not `copy_from_slice`: w is 8–32 f32, where a memcpy call costs
            // more than the copy; inlined, the loop is a few vector moves.
            for (y, &value) in panel[j * w..][..w].iter_mut().zip(&x.row(j, d)[c0..c0 + w]) {
                *y = value;
            }
        }
    }
    out
}

/// C (m × n, rows `c_rs` apart) = [C +] alpha · A (m × kn) · B, one NR-column block of B at a
/// time (`b(c0)`: its row 0 and row stride; NR wide, the last block narrower), all of C's row
/// blocks against it while it stays in L1. n is a multiple of `S::LANES`.
///
/// # Safety
/// The CPU supports `S`; A, B and C address (m × kn), (kn × n) and (m × n) valid f32.
#[inline(always)]
unsafe fn product<S: Simd, const NV: usize>(
    (m, n, kn): (usize, usize, usize),
    a: Bcast,
    b: impl Fn(usize) -> (*const f32, usize),
    (c, c_rs): (*mut f32, usize),
    accumulate: bool,
    alpha: f32,
) {
    let nr = NV * S::LANES;
    for c0 in (0..n).step_by(nr) {
        let (b_c, b_rs) = b(c0);
        let w = nr.min(n - c0);
        for i0 in (0..m).step_by(MR) {
            let (a_i, mr, c_i) = (a.p.add(i0 * a.rs), MR.min(m - i0), c.add(i0 * c_rs + c0));
            if w == nr {
                tile::<S, NV>(kn, Bcast { p: a_i, ..a }, mr, (b_c, b_rs), (c_i, c_rs), accumulate, alpha);
            } else {
                for x in (0..w).step_by(S::LANES) {
                    // The narrower last block, one vector at a time (w is a multiple of LANES).
                    tile::<S, 1>(kn, Bcast { p: a_i, ..a }, mr, (b_c.add(x), b_rs), (c_i.add(x), c_rs), accumulate, alpha);
                }
            }
        }
    }
}

/// One register tile: C[r][0..NV·LANES] = [C +] alpha · Σ_k A[r][k] · B[k][..] for r < mr, the
/// MR × NV accumulators in registers for all kn steps; each step is NV loads, MR broadcasts and
/// MR·NV FMAs. Rows r ≥ mr (a last block's) repeat row mr − 1 and are not stored.
///
/// # Safety
/// The CPU supports `S`; A's mr rows of kn, B's kn rows of NV·LANES and C's mr rows of
/// NV·LANES f32 are valid.
#[inline(always)]
#[allow(clippy::needless_range_loop)] // indices, as in the equation: the register tile is acc[r][x]
unsafe fn tile<S: Simd, const NV: usize>(
    kn: usize,
    a: Bcast,
    mr: usize,
    (b, b_rs): (*const f32, usize),
    (c, c_rs): (*mut f32, usize),
    accumulate: bool,
    alpha: f32,
) {
    let rows: [*const f32; MR] = std::array::from_fn(|r| a.p.add(r.min(mr - 1) * a.rs));
    let mut acc = [[S::zero(); NV]; MR];
    for k in 0..kn {
        let b_k: [S::V; NV] = std::array::from_fn(|x| S::load(b.add(k * b_rs + x * S::LANES)));
        for r in 0..MR {
            let a_rk = S::splat(*rows[r].add(k * a.cs)); // broadcast
            for x in 0..NV {
                acc[r][x] = S::fma(a_rk, b_k[x], acc[r][x]);
            }
        }
    }
    let alpha = S::splat(alpha);
    for r in 0..mr {
        for x in 0..NV {
            let out = c.add(r * c_rs + x * S::LANES);
            S::store(out, if accumulate { S::fma(acc[r][x], alpha, S::load(out)) } else { S::mul(acc[r][x], alpha) });
        }
    }
}
