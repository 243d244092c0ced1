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
//! Under the causal mask the tile pairs on the diagonal skip the register tiles wholly above it
//! and cut each contraction where P and dS are zero (`Causal`): at T = 512 four of the ten tile
//! pairs a head runs are diagonal, half of each of them masked.

use super::{row_statistics, HeadIo, Rows, BC, BR};
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
    let HeadIo { q, k, v, d_o, .. } = *io;
    let (lse, delta) = row_statistics(io, t, d, scale, causal);
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
            let mask = Causal::of(causal, i0, j0);
            let q_i = Bcast { p: q.data.as_ptr().add(i0 * q.rs), rs: q.rs, cs: 1 };
            let do_i = Bcast { p: d_o.data.as_ptr().add(i0 * d_o.rs), rs: d_o.rs, cs: 1 };
            // S = Q_i K_jᵀ · scale
            product::<S, NV>((br, bc_tiles, d), q_i, keys(&kt, j0), (p.as_mut_ptr(), BC), false, scale, mask.scores());
            for r in 0..br {
                let n = mask.visible(r, bc);
                let row = &mut p[r * BC..][..bc];
                S::exp_sum(&mut row[..n], lse[i0 + r]); // P = exp(S − L)
                row[n..].fill(0.0); // masked: P = 0, so dS = 0 there too
            }
            // dV_j += Pᵀ dO_i
            let p_t = Bcast { p: p.as_ptr(), rs: 1, cs: BC };
            product::<S, NV>((bc, d, br), p_t, rows(&doc, i0), (dv.as_mut_ptr().add(j0 * d), d), true, 1.0, mask.over_rows(1));
            // dP = dO_i V_jᵀ
            product::<S, NV>((br, bc_tiles, d), do_i, keys(&vt, j0), (dp.as_mut_ptr(), BC), false, 1.0, mask.scores());
            for r in 0..br {
                let (di, n) = (delta[i0 + r], mask.visible(r, bc));
                let (ds, dp) = (&mut p[r * BC..][..n], &dp[r * BC..][..n]);
                ds.iter_mut().zip(dp).for_each(|(x, &g)| *x *= g - di); // dS = P ∘ (dP − D_i), in place of P (0 past n)
            }
            // dQ_i += dS K_j · scale
            let ds = Bcast { p: p.as_ptr(), rs: BC, cs: 1 };
            product::<S, NV>((br, d, bc), ds, rows(&kc, j0), (dq.as_mut_ptr().add(i0 * d), d), true, scale, mask.over_keys(1));
            // dK_j += dSᵀ Q_i · scale
            let ds_t = Bcast { p: p.as_ptr(), rs: 1, cs: BC };
            product::<S, NV>((bc, d, br), ds_t, rows(&qc, i0), (dk.as_mut_ptr().add(j0 * d), d), true, scale, mask.over_rows(1));
        }
    }
    [dq, dk, dv]
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
#[allow(clippy::too_many_arguments)] // the product's shape, three operands, how it adds, and its causal span
unsafe fn product<S: Simd, const NV: usize>(
    (m, n, kn): (usize, usize, usize),
    a: Bcast,
    b: impl Fn(usize) -> (*const f32, usize),
    (c, c_rs): (*mut f32, usize),
    accumulate: bool,
    alpha: f32,
    span: Span,
) {
    let nr = NV * S::LANES;
    for c0 in (0..n).step_by(nr) {
        let (b_c, b_rs) = b(c0);
        let w = nr.min(n - c0);
        for i0 in (0..m).step_by(MR) {
            let mr = MR.min(m - i0);
            let (k0, k1) = span.of((i0, mr), c0, kn);
            if k0 >= k1 {
                continue; // every product of this tile is masked (or adds zeros)
            }
            let (a_i, c_i) = (a.p.add(i0 * a.rs + k0 * a.cs), c.add(i0 * c_rs + c0));
            let b_k = b_c.add(k0 * b_rs);
            if w == nr {
                tile::<S, NV>(k1 - k0, Bcast { p: a_i, ..a }, mr, (b_k, b_rs), (c_i, c_rs), accumulate, alpha);
            } else {
                for x in (0..w).step_by(S::LANES) {
                    // The narrower last block, one vector at a time (w is a multiple of LANES).
                    tile::<S, 1>(k1 - k0, Bcast { p: a_i, ..a }, mr, (b_k.add(x), b_rs), (c_i.add(x), c_rs), accumulate, alpha);
                }
            }
        }
    }
}

/// Which query rows see which keys in a tile pair (query tile at i0, key tile at j0): row r
/// (of the query tile) sees key c (of the key tile) when c ≤ r + i0 − j0 under the causal mask.
/// Only the tile pairs on the diagonal mask anything (B_r = B_c: the others lie wholly below
/// it); there a product's tiles wholly above the diagonal are skipped and its contractions cut
/// where P and dS are zero, about half of the diagonal pair's work.
#[derive(Clone, Copy)]
struct Causal {
    /// i0 − j0 when causal (≥ 0: the key tiles a query tile meets start at or before it).
    offset: Option<usize>,
}

impl Causal {
    fn of(causal: bool, i0: usize, j0: usize) -> Causal {
        assert!(!causal || i0 >= j0, "a causal query tile starts at or after its key tile (B_r = B_c)");
        Causal { offset: causal.then(|| i0 - j0) }
    }

    /// Keys (of bc) query row r sees.
    fn visible(self, r: usize, bc: usize) -> usize {
        self.offset.map_or(bc, |o| bc.min(r + o + 1))
    }

    /// S or dP (rows: queries, columns: keys): a tile of rows is skipped in a column block that
    /// starts past its last row's last visible key.
    fn scores(self) -> Span {
        Span { rows: Along::Scores, offset: self.offset, per: 1 }
    }

    /// dV or dK (rows: keys, contraction over query rows, `per` rows per step): key c's products
    /// start at query row c − offset.
    fn over_rows(self, per: usize) -> Span {
        Span { rows: Along::Keys, offset: self.offset, per }
    }

    /// dQ (rows: queries, contraction over keys, `per` keys per step): row r's products end at
    /// key r + offset.
    fn over_keys(self, per: usize) -> Span {
        Span { rows: Along::Queries, offset: self.offset, per }
    }
}

/// What a product's rows are, for `Span::of`.
#[derive(Clone, Copy)]
enum Along {
    Scores,
    Keys,
    Queries,
}

/// The contraction range of each register tile of a product under the causal mask (`Causal`).
#[derive(Clone, Copy)]
struct Span {
    rows: Along,
    offset: Option<usize>,
    /// Contraction elements per step (2 for bf16 pairs).
    per: usize,
}

impl Span {
    /// Steps (k0, k1) of kn the tile of rows i0..i0 + mr runs, in the column block at c0; k0 ≥
    /// k1 when it has nothing to add.
    fn of(self, (i0, mr): (usize, usize), c0: usize, kn: usize) -> (usize, usize) {
        let Some(o) = self.offset else { return (0, kn) };
        match self.rows {
            // Every key of the block lies past the rows' last visible key: all masked.
            Along::Scores if c0 > i0 + mr - 1 + o => (0, 0),
            Along::Scores => (0, kn),
            // Keys i0..: query rows before i0 − o see none of them.
            Along::Keys => ((i0.saturating_sub(o) / self.per).min(kn), kn),
            // Queries i0..i0 + mr: keys past i0 + mr − 1 + o are masked for all of them.
            Along::Queries => (0, kn.min((i0 + mr + o).div_ceil(self.per))),
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

/// bf16 pairs (AVX512-BF16): the same tiles, loop order and equations, every product on
/// `vdpbf16ps` (two bf16 products per f32 lane per instruction) with f32 accumulation, as a GPU's
/// FlashAttention-2 backward runs them on bf16 tensor cores. Each product's pairs lie along its
/// contraction, so each operand is laid out once per head (or, for P and dS, once per tile):
///
/// ```text
/// product                contraction   A (pairs broadcast)            B (pair panels)
/// S  = Q_i K_jᵀ · scale   channels      Q_i's channel pairs            Kᵀ: key panels of channel pairs
/// dP = dO_i V_jᵀ          channels      dO_i's channel pairs           Vᵀ: key panels of channel pairs
/// dV_j += Pᵀ dO_i         query rows    P's row pairs, per tile         dO: channel panels of row pairs
/// dQ_i += dS K_j · scale  keys          dS's key pairs, per tile        K: channel panels of key pairs
/// dK_j += dSᵀ Q_i · scale query rows    dS's row pairs, per tile        Q: channel panels of row pairs
/// ```
///
/// What it costs: q, k, v, dO, P and dS rounded to bf16 (8 significant bits) as they are laid
/// out; L, D, the softmax and every sum stay f32. An odd count along a contraction leaves the
/// last pair half zero.
///
/// # Safety
/// The CPU supports AVX512-F, AVX512-BF16 and FMA; `d` is one of the forward's register head
/// sizes (even).
#[target_feature(enable = "avx512f,avx512bf16,avx2,fma")]
pub(super) unsafe fn head_bwd_bf16(io: &HeadIo, t: usize, d: usize, scale: f32, causal: bool) -> [Vec<f32>; 3] {
    use std::arch::x86_64::*;
    assert!(d.is_multiple_of(16), "register head sizes are multiples of 16");
    let HeadIo { q, k, v, d_o, .. } = *io;
    let (lse, delta) = row_statistics(io, t, d, scale, causal);
    let (dp2, tp) = (d / 2, t.div_ceil(2)); // channel pairs, row pairs
    let (qp, dop) = (channel_pairs(q, t, d, t), channel_pairs(d_o, t, d, t));
    let (ktp, vtp) = (key_pair_panels(k, t, d), key_pair_panels(v, t, d));
    let (krp, qrp, dorp) = (row_pair_panels(k, t, d, tp), row_pair_panels(q, t, d, tp), row_pair_panels(d_o, t, d, tp));
    let keys = |panels: &[u32], j0: usize| {
        let base = panels.as_ptr();
        move |c0: usize| (base.add((j0 + c0) / PAIR_NR * dp2 * PAIR_NR), PAIR_NR)
    };
    let rows = |panels: &[u32], r0: usize| {
        let base = panels.as_ptr();
        move |c0: usize| {
            let w = PAIR_NR.min(d - c0);
            (base.add(tp * c0 + r0 * w), w)
        }
    };
    let (mut dq, mut dk, mut dv) = (vec![0f32; t * d], vec![0f32; t * d], vec![0f32; t * d]);
    let (mut p, mut dp) = (vec![0f32; BR * BC], vec![0f32; BR * BC]); // P, then dS, in p; dP
    let mut row_pairs = vec![0u32; BR.div_ceil(2) * BC]; // Pᵀ or dSᵀ: row pair r' of key j at r'·B_c + j
    let mut key_pairs = vec![0u32; BR * BC / 2]; // dS: key pair j' of row r at r·B_c/2 + j'
    for j0 in (0..t).step_by(BC) {
        let bc = BC.min(t - j0);
        let bc_tiles = bc.next_multiple_of(PAIR_NR);
        let i_first = if causal { j0 / BR * BR } else { 0 };
        for i0 in (i_first..t).step_by(BR) {
            let br = BR.min(t - i0);
            let (br2, bc2) = (br.div_ceil(2), bc.div_ceil(2));
            let mask = Causal::of(causal, i0, j0);
            // S = Q_i K_jᵀ · scale
            let q_i = PairBcast { p: qp.as_ptr().add(i0 * dp2), rs: dp2, cs: 1 };
            product_bf16((br, bc_tiles, dp2), q_i, keys(&ktp, j0), (p.as_mut_ptr(), BC), false, scale, mask.scores());
            for r in 0..br {
                let n = mask.visible(r, bc);
                let row = &mut p[r * BC..][..bc];
                <Avx512 as Simd>::exp_sum(&mut row[..n], lse[i0 + r]); // P = exp(S − L)
                row[n..].fill(0.0);
            }
            // dV_j += Pᵀ dO_i
            pairs_of_rows(&p, br, bc, &mut row_pairs);
            let p_t = PairBcast { p: row_pairs.as_ptr(), rs: 1, cs: BC };
            product_bf16((bc, d, br2), p_t, rows(&dorp, i0 / 2), (dv.as_mut_ptr().add(j0 * d), d), true, 1.0, mask.over_rows(2));
            // dP = dO_i V_jᵀ
            let do_i = PairBcast { p: dop.as_ptr().add(i0 * dp2), rs: dp2, cs: 1 };
            product_bf16((br, bc_tiles, dp2), do_i, keys(&vtp, j0), (dp.as_mut_ptr(), BC), false, 1.0, mask.scores());
            for r in 0..br {
                let (di, n) = (delta[i0 + r], mask.visible(r, bc));
                let (ds, dp) = (&mut p[r * BC..][..n], &dp[r * BC..][..n]); // P = 0 past n: so is dS
                let (whole, dv) = (n / 16 * 16, _mm512_set1_ps(di));
                for c in (0..whole).step_by(16) {
                    // dS = P ∘ (dP − D_i), in place of P
                    let x = _mm512_mul_ps(_mm512_loadu_ps(ds.as_ptr().add(c)), _mm512_sub_ps(_mm512_loadu_ps(dp.as_ptr().add(c)), dv));
                    _mm512_storeu_ps(ds.as_mut_ptr().add(c), x);
                }
                for c in whole..n {
                    ds[c] *= dp[c] - di;
                }
                f32_pairs(&p[r * BC..][..bc], &mut key_pairs[r * BC / 2..][..bc2]);
                // dS's key pairs, for dQ
            }
            // dQ_i += dS K_j · scale
            let ds = PairBcast { p: key_pairs.as_ptr(), rs: BC / 2, cs: 1 };
            product_bf16((br, d, bc2), ds, rows(&krp, j0 / 2), (dq.as_mut_ptr().add(i0 * d), d), true, scale, mask.over_keys(2));
            // dK_j += dSᵀ Q_i · scale
            pairs_of_rows(&p, br, bc, &mut row_pairs);
            let ds_t = PairBcast { p: row_pairs.as_ptr(), rs: 1, cs: BC };
            product_bf16((bc, d, br2), ds_t, rows(&qrp, i0 / 2), (dk.as_mut_ptr().add(j0 * d), d), true, scale, mask.over_rows(2));
        }
    }
    [dq, dk, dv]
}

/// The same backward with every product on AMX tiles (`tdpbf16ps`, the GEMM's 2 × 2 tile
/// product `amx::tile_product`), in blocks of 32 keys × 32 query rows: S and dP are one 32 × 32
/// product each over the channel pairs (A: Q_i's or dO_i's channel pairs, B: Kᵀ's or Vᵀ's key
/// panels, as the forward's scores); P and dS, rounded to bf16, are then laid out for the three
/// accumulating products:
///
/// ```text
/// product                 contraction   A (16 rows × 16 pairs a tile)     B (16 pairs × 16 columns)
/// dV_jᵀ += dO_iᵀ P        query rows    dOᵀ: channel rows of row pairs    P's row pairs (keys across)
/// dK_jᵀ += Q_iᵀ dS        query rows    Qᵀ: channel rows of row pairs     dS's row pairs
/// dQ_i  += dS K_j         keys          dS's key pairs (rows: queries)    K: channel panels of key pairs
/// ```
///
/// dV and dK are accumulated transposed ((d, T): keys across, so the tile's columns are the
/// block's 32 keys) and transposed back once at the end, with dK's and dQ's scale. Rows past T
/// are zero in every laid-out operand, and P is zero there, so the padded products add nothing.
/// Rounding as `head_bwd_bf16` (q, k, v, dO, P and dS to bf16; sums and softmax in f32).
///
/// # Safety
/// `registers::bf16::amx_runs(d)`: AVX512-F, AVX512-BF16 and AMX-BF16, the tile state granted;
/// d a multiple of 32.
#[target_feature(enable = "avx512f,avx512bf16,avx2,fma")]
pub(super) unsafe fn head_bwd_amx(io: &HeadIo, t: usize, d: usize, scale: f32, causal: bool) -> [Vec<f32>; 3] {
    use crate::bf16_gemm::amx::{self, tile_product, TileOperands};
    use std::arch::x86_64::*;
    const B: usize = 32; // keys and query rows per block
    assert!(d.is_multiple_of(32) && t > 0, "AMX head sizes are multiples of 32");
    let HeadIo { q, k, v, d_o, .. } = *io;
    let (lse, delta) = row_statistics(io, t, d, scale, causal);
    let (dp2, tb) = (d / 2, t.next_multiple_of(B)); // channel pairs; T padded to whole blocks
    let tp = tb / 2; // row pairs, padded
                     // Operands, zero past T: channel pairs (tb, d/2); key panels (tb/32 panels of (d/2, 32));
                     // K's channel panels of key pairs (d/32 panels of (tp, 32)); Qᵀ and dOᵀ as (d, tp) row pairs.
    let (qp, dop) = (channel_pairs(q, t, d, tb), channel_pairs(d_o, t, d, tb));
    let (ktp, vtp) = (key_pair_panels(k, t, d), key_pair_panels(v, t, d));
    let krp = row_pair_panels(k, t, d, tp);
    // Qᵀ and dOᵀ: X's row pairs (the channel panels of `row_pair_panels`), transposed 16 × 16
    // pairs at a time in registers; tp is a multiple of 16.
    let transposed_row_pairs = |x: Rows| {
        let rp = row_pair_panels(x, t, d, tp);
        let mut out = vec![0u32; d * tp];
        for c0 in (0..d).step_by(PAIR_NR) {
            let panel = &rp[tp * c0..][..tp * PAIR_NR]; // (tp, 32): pair r' of channel c0 + x at [r'][x]
            for r0 in (0..tp).step_by(16) {
                for x0 in (0..PAIR_NR).step_by(16) {
                    let mut m = [0u32; 256]; // row i: pairs r0 + i, channels c0 + x0..+16
                    for (i, row) in m.chunks_exact_mut(16).enumerate() {
                        row.copy_from_slice(&panel[(r0 + i) * PAIR_NR + x0..][..16]);
                    }
                    let mut tr = [0u32; 256]; // row c: channel c0 + x0 + c, pairs r0..r0 + 16
                    crate::bf16_gemm::transpose_16x16(&m, &mut tr);
                    for c in 0..16 {
                        out[(c0 + x0 + c) * tp + r0..][..16].copy_from_slice(&tr[16 * c..][..16]);
                    }
                }
            }
        }
        out
    };
    let (qt, dot) = (transposed_row_pairs(q), transposed_row_pairs(d_o));
    let mut dq = vec![0f32; tb * d];
    let (mut dkt, mut dvt) = (vec![0f32; d * tb], vec![0f32; d * tb]); // dKᵀ, dVᵀ: (d, tb)
    let (mut s, mut dp) = ([[0f32; B]; B], [[0f32; B]; B]); // S then P; dP then dS
    let (mut p_rows, mut ds_rows, mut ds_keys) = ([[0u32; B]; B / 2], [[0u32; B]; B / 2], [[0u32; B / 2]; B]);
    let sv = _mm512_set1_ps(scale);
    amx::configure();
    for j0 in (0..t).step_by(B) {
        let bc = B.min(t - j0);
        let i_first = if causal { j0 } else { 0 };
        for i0 in (i_first..t).step_by(B) {
            let br = B.min(t - i0);
            // S = Q_i K_jᵀ, dP = dO_i V_jᵀ: 32 × 32 each, over d/2 channel pairs (C from zero).
            let scores = |a: &[u32], b: &[u32]| TileOperands {
                a: a.as_ptr().add(i0 * dp2) as *const u8,
                lda: dp2 * 4,
                a_step: 64,
                b: b.as_ptr().add(j0 * dp2) as *const u8, // key panel j0/32: (d/2, 32)
                ldb: B * 4,
                b_step: 16 * B * 4,
            };
            tile_product(d / 32, &scores(&qp, &ktp), s.as_mut_ptr() as *mut u8, B * 4, false);
            tile_product(d / 32, &scores(&dop, &vtp), dp.as_mut_ptr() as *mut u8, B * 4, false);
            for r in 0..B {
                // Keys row r sees (all, or up to its own position); none for rows past T.
                let n = if r >= br {
                    0
                } else if causal {
                    bc.min((i0 + r + 1).saturating_sub(j0))
                } else {
                    bc
                };
                let row = &mut s[r];
                for c in (0..B).step_by(16) {
                    _mm512_storeu_ps(row.as_mut_ptr().add(c), _mm512_mul_ps(_mm512_loadu_ps(row.as_ptr().add(c)), sv));
                }
                if n > 0 {
                    <Avx512 as Simd>::exp_sum(&mut row[..n], lse[i0 + r]); // P = exp(S·scale − L)
                }
                row[n..].fill(0.0); // masked, or past T: P = 0, so dS = 0
                let di = if r < br { delta[i0 + r] } else { 0.0 };
                for (g, &p) in dp[r].iter_mut().zip(row.iter()) {
                    *g = p * (*g - di); // dS = P ∘ (dP − D_i), in place of dP
                }
                f32_pairs(&dp[r], &mut ds_keys[r]); // dS's key pairs: A of dQ
            }
            for r2 in 0..B / 2 {
                use crate::bf16_gemm::Operand;
                f32::pairs_across(&s[2 * r2], &s[2 * r2 + 1], &mut p_rows[r2]); // P's row pairs
                f32::pairs_across(&dp[2 * r2], &dp[2 * r2 + 1], &mut ds_rows[r2]);
                // dS's row pairs
            }
            for c0 in (0..d).step_by(32) {
                // dV_jᵀ += dO_iᵀ P and dK_jᵀ += Q_iᵀ dS: 32 channels × 32 keys, 16 row pairs.
                let transposed = |a: &[u32], b: &[[u32; B]; B / 2]| TileOperands {
                    a: a.as_ptr().add(c0 * tp + i0 / 2) as *const u8,
                    lda: tp * 4,
                    a_step: 64,
                    b: b.as_ptr() as *const u8,
                    ldb: B * 4,
                    b_step: 16 * B * 4,
                };
                tile_product(1, &transposed(&dot, &p_rows), dvt.as_mut_ptr().add(c0 * tb + j0) as *mut u8, tb * 4, true);
                tile_product(1, &transposed(&qt, &ds_rows), dkt.as_mut_ptr().add(c0 * tb + j0) as *mut u8, tb * 4, true);
                // dQ_i += dS K_j: 32 rows × 32 channels, 16 key pairs.
                let ops = TileOperands {
                    a: ds_keys.as_ptr() as *const u8,
                    lda: B / 2 * 4,
                    a_step: 64,
                    b: krp.as_ptr().add(tp * c0 + (j0 / 2) * PAIR_NR) as *const u8,
                    ldb: PAIR_NR * 4,
                    b_step: 16 * PAIR_NR * 4,
                };
                tile_product(1, &ops, dq.as_mut_ptr().add(i0 * d + c0) as *mut u8, d * 4, true);
            }
        }
    }
    amx::release();
    // dQ · scale; dK = (dKᵀ)ᵀ · scale, dV = (dVᵀ)ᵀ: (T, d) rows.
    dq.truncate(t * d);
    dq.iter_mut().for_each(|x| *x *= scale);
    let back = |xt: &[f32], alpha: f32| {
        // 16 × 16 blocks transposed in registers (as bits); tb is a multiple of 32, d of 16.
        let mut out = vec![0f32; t * d];
        for c0 in (0..d).step_by(16) {
            for r0 in (0..t).step_by(16) {
                let m: [u32; 256] = std::array::from_fn(|i| xt[(c0 + i / 16) * tb + r0 + i % 16].to_bits());
                let mut tr = [0u32; 256]; // row j: position r0 + j, channels c0..c0 + 16
                crate::bf16_gemm::transpose_16x16(&m, &mut tr);
                for j in 0..16.min(t - r0) {
                    for (y, &bits) in out[(r0 + j) * d + c0..][..16].iter_mut().zip(&tr[16 * j..][..16]) {
                        *y = f32::from_bits(bits) * alpha;
                    }
                }
            }
        }
        out
    };
    [dq, back(&dkt, scale), back(&dvt, 1.0)]
}

/// Columns per bf16 register tile: two vectors of 16 f32.
const PAIR_NR: usize = 32;

/// An operand of pairs read one u32 at a time and broadcast: pair (i, k) at `p + i·rs + k·cs`.
#[derive(Clone, Copy)]
struct PairBcast {
    p: *const u32,
    rs: usize,
    cs: usize,
}

/// `src` rounded to bf16 in pairs of neighbours, the last half zero when its length is odd.
#[inline(always)]
fn f32_pairs(src: &[f32], out: &mut [u32]) {
    use crate::bf16_gemm::Operand;
    let whole = src.len() / 2;
    f32::pairs_along(&src[..2 * whole], &mut out[..whole]);
    if src.len() % 2 == 1 {
        out[whole] = src[2 * whole].bf16_bits() as u32;
    }
}

/// Rows of a B_r × B_c tile (row stride B_c) in pairs down its columns: `out[r'·B_c + j]` = the
/// pair (tile[2r'][j], tile[2r' + 1][j]) for j < bc, the second zero past row br.
#[inline(always)]
fn pairs_of_rows(tile: &[f32], br: usize, bc: usize, out: &mut [u32]) {
    use crate::bf16_gemm::Operand;
    const ZEROS: [f32; BC] = [0.0; BC];
    for r2 in 0..br.div_ceil(2) {
        let lo = &tile[2 * r2 * BC..][..bc];
        let hi = if 2 * r2 + 1 < br { &tile[(2 * r2 + 1) * BC..][..bc] } else { &ZEROS[..bc] };
        f32::pairs_across(lo, hi, &mut out[r2 * BC..][..bc]);
    }
}

/// Each of X's T rows as d/2 channel pairs: (rows, d/2) u32, rows ≥ T, zero past T.
#[inline(always)]
fn channel_pairs(x: Rows, t: usize, d: usize, rows: usize) -> Vec<u32> {
    let mut out = vec![0u32; rows * d / 2];
    for (r, row) in out.chunks_exact_mut(d / 2).enumerate().take(t) {
        f32_pairs(x.row(r, d), row);
    }
    out
}

/// Xᵀ in panels of PAIR_NR keys with channel pairs: panel p is (d/2, PAIR_NR), pair c' of key
/// p·PAIR_NR + x at [c'][x]; keys past T are zero.
#[inline(always)]
fn key_pair_panels(x: Rows, t: usize, d: usize) -> Vec<u32> {
    let mut out = vec![0u32; t.div_ceil(PAIR_NR) * d / 2 * PAIR_NR];
    let mut pairs = vec![0u32; d / 2];
    for (panel_index, panel) in out.chunks_exact_mut(d / 2 * PAIR_NR).enumerate() {
        for jj in 0..PAIR_NR.min(t - panel_index * PAIR_NR) {
            f32_pairs(x.row(panel_index * PAIR_NR + jj, d), &mut pairs);
            for (c2, &pair) in pairs.iter().enumerate() {
                panel[c2 * PAIR_NR + jj] = pair;
            }
        }
    }
    out
}

/// X in panels of PAIR_NR channels with row pairs: the panel of channels c0..c0 + w (w =
/// PAIR_NR, the last narrower) is (tp, w) at c0·tp, pair r' of channel c0 + x at [r'][x] (rows
/// 2r' and 2r' + 1; zero past T). tp ≥ ⌈T/2⌉: pairs past ⌈T/2⌉ (AMX's padded blocks) are zero.
#[inline(always)]
fn row_pair_panels(x: Rows, t: usize, d: usize, tp: usize) -> Vec<u32> {
    use crate::bf16_gemm::Operand;
    let mut out = vec![0u32; tp * d];
    let zeros = vec![0f32; d];
    for c0 in (0..d).step_by(PAIR_NR) {
        let w = PAIR_NR.min(d - c0);
        for r2 in 0..t.div_ceil(2) {
            let lo = &x.row(2 * r2, d)[c0..c0 + w];
            let hi = if 2 * r2 + 1 < t { &x.row(2 * r2 + 1, d)[c0..c0 + w] } else { &zeros[..w] };
            f32::pairs_across(lo, hi, &mut out[tp * c0 + r2 * w..][..w]);
        }
    }
    out
}

/// `product` on pairs: C (m × n, rows `c_rs` apart) = [C +] alpha · Σ_k' A'(i, k')·B'(k', ·)
/// over kn pairs, one PAIR_NR-column block of B at a time. n is a multiple of 16.
///
/// # Safety
/// The CPU supports AVX512-F and AVX512-BF16; A, B and C address (m × kn), (kn × n) pairs and
/// (m × n) f32.
#[inline(always)]
#[allow(clippy::too_many_arguments)] // `product`'s arguments
unsafe fn product_bf16(
    (m, n, kn): (usize, usize, usize),
    a: PairBcast,
    b: impl Fn(usize) -> (*const u32, usize),
    (c, c_rs): (*mut f32, usize),
    accumulate: bool,
    alpha: f32,
    span: Span,
) {
    for c0 in (0..n).step_by(PAIR_NR) {
        let (b_c, b_rs) = b(c0);
        let w = PAIR_NR.min(n - c0);
        for i0 in (0..m).step_by(MR) {
            let mr = MR.min(m - i0);
            let (k0, k1) = span.of((i0, mr), c0, kn);
            if k0 >= k1 {
                continue; // every product of this tile is masked (or adds zeros)
            }
            let (a_i, c_i) = (PairBcast { p: a.p.add(i0 * a.rs + k0 * a.cs), ..a }, c.add(i0 * c_rs + c0));
            let b_k = b_c.add(k0 * b_rs);
            if w == PAIR_NR {
                tile_bf16::<2>(k1 - k0, a_i, mr, (b_k, b_rs), (c_i, c_rs), accumulate, alpha);
            } else {
                tile_bf16::<1>(k1 - k0, a_i, mr, (b_k, b_rs), (c_i, c_rs), accumulate, alpha);
                // w = 16
            }
        }
    }
}

/// One register tile on pairs: C[r][0..16·NV] = [C +] alpha · Σ_k' A'[r][k']·B'[k'][..], the
/// MR × NV accumulators in registers; each step is NV loads, MR broadcasts of a pair and MR·NV
/// `vdpbf16ps`. Rows r ≥ mr repeat row mr − 1 and are not stored.
///
/// # Safety
/// The CPU supports AVX512-F and AVX512-BF16; A's mr rows of kn pairs, B's kn rows of 16·NV
/// pairs and C's mr rows of 16·NV f32 are valid.
#[inline(always)]
#[allow(clippy::needless_range_loop)] // indices, as in the equation: the register tile is acc[r][x]
unsafe fn tile_bf16<const NV: usize>(
    kn: usize,
    a: PairBcast,
    mr: usize,
    (b, b_rs): (*const u32, usize),
    (c, c_rs): (*mut f32, usize),
    accumulate: bool,
    alpha: f32,
) {
    use std::arch::x86_64::*;
    let rows: [*const u32; MR] = std::array::from_fn(|r| a.p.add(r.min(mr - 1) * a.rs));
    let mut acc = [[_mm512_setzero_ps(); NV]; MR];
    for k in 0..kn {
        let b_k: [__m512bh; NV] = std::array::from_fn(|x| std::mem::transmute(_mm512_loadu_si512(b.add(k * b_rs + 16 * x) as *const _)));
        for r in 0..MR {
            let a_rk: __m512bh = std::mem::transmute(_mm512_set1_epi32(*rows[r].add(k * a.cs) as i32)); // broadcast
            for x in 0..NV {
                acc[r][x] = _mm512_dpbf16_ps(acc[r][x], a_rk, b_k[x]);
            }
        }
    }
    let alpha = _mm512_set1_ps(alpha);
    for r in 0..mr {
        for x in 0..NV {
            let out = c.add(r * c_rs + 16 * x);
            let v = if accumulate { _mm512_fmadd_ps(acc[r][x], alpha, _mm512_loadu_ps(out)) } else { _mm512_mul_ps(acc[r][x], alpha) };
            _mm512_storeu_ps(out, v);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each of dQ, dK, dV within 2e-2 of the f32 gradient's largest value.
    fn agree(want: &[Vec<f32>; 3], got: &[Vec<f32>; 3], what: &str) {
        for (name, w, g) in [("dq", &want[0], &got[0]), ("dk", &want[1], &got[1]), ("dv", &want[2], &got[2])] {
            assert_eq!(w.len(), g.len(), "{what} {name}: length");
            let worst = w.iter().zip(g).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
            let scale = w.iter().fold(0f32, |m, x| m.max(x.abs())).max(1.0);
            assert!(worst / scale <= 2e-2, "{what} {name}: {}", worst / scale);
        }
    }

    /// The bf16-pair backwards (AVX512-BF16, and AMX tiles where the CPU has them and d is a
    /// multiple of 32) against the f32 register one on the same head (all recompute L), every
    /// register head size, ragged T (odd: half-empty pairs; not a multiple of the tiles or of
    /// AMX's 32-row blocks), rows strided as in stage 3's QKV views, causal and not: every
    /// gradient within 2e-2 of its largest value (the inputs, P and dS rounded to bf16). Where
    /// the CPU has no AVX512-BF16 it checks nothing and says so.
    #[test]
    fn bf16_pairs_agree_with_f32_products() {
        let mut amx_checked = 0;
        if !(crate::attention::registers::bf16::runs(64) && std::arch::is_x86_feature_detected!("fma")) {
            eprintln!("no AVX512-BF16 here: the bf16-pair backward is not compiled into a run");
            return;
        }
        for d in crate::attention::registers::D_HEADS {
            for (t, causal) in [(BC + 45, true), (77, false), (1, true), (64, true), (33, false)] {
                let rs = 3 * d; // rows of a (T, 3, d) buffer, one head
                let data = shared::weights::SplitMix64::new(d as u64 + t as u64).normals(t * rs + 2 * d);
                let o = shared::weights::SplitMix64::new(7).normals(t * d);
                let d_o = shared::weights::SplitMix64::new(8).normals(t * d);
                let io = HeadIo {
                    q: Rows { data: &data[..], rs },
                    k: Rows { data: &data[d..], rs },
                    v: Rows { data: &data[2 * d..], rs },
                    o: Rows { data: &o, rs: d },
                    d_o: Rows { data: &d_o, rs: d },
                    lse: None,
                };
                let scale = 1.0 / (d as f32).sqrt();
                // SAFETY: AVX-512F, AVX512-BF16 and FMA are available (checked above); d is a
                // register head size.
                let (want, got) = unsafe { (head_bwd_avx512(&io, t, d, scale, causal), head_bwd_bf16(&io, t, d, scale, causal)) };
                agree(&want, &got, &format!("avx512-bf16, d {d} T {t} causal {causal}"));
                if crate::attention::registers::bf16::amx_runs(d) {
                    // SAFETY: amx_runs(d): AMX-BF16 with the tile state granted, d a multiple of 32.
                    let amx = unsafe { head_bwd_amx(&io, t, d, scale, causal) };
                    agree(&want, &amx, &format!("amx, d {d} T {t} causal {causal}"));
                    amx_checked += 1;
                }
            }
        }
        eprintln!("AMX backward checked on {amx_checked} heads (0: no AMX here, or AVX512-BF16 asked for)");
    }
}
