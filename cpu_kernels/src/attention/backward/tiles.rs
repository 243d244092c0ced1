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
use crate::bf16_gemm::{round16, Lines, OnLines};
use crate::elementwise::uninit_of;

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
    let (lse, delta) = row_statistics(io, t, d, scale, causal);
    let (dp2, tp) = (d / 2, t.div_ceil(2)); // channel pairs, row pairs
    let mut layouts = PairLayouts::zeroed(t, d, t, tp);
    layouts.fill(io, t, d, tp);
    let PairLayouts { qp, dop, ktp, vtp, krp, qrp, dorp, .. } = layouts;
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
/// product `amx::tile_product`) in blocks of 32 keys × 32 query rows, ordered so that each
/// accumulating product runs its whole contraction in tile registers, its C tiles stored once:
///
/// ```text
/// product                 contraction         A (16 rows × 16 pairs a tile)      B (16 pairs × 16 columns)
/// S  = Q_i K_jᵀ            channels            Q_i's channel pairs                Kᵀ: key panels of channel pairs
/// dP = dO_i V_jᵀ           channels            dO_i's channel pairs               Vᵀ: key panels of channel pairs
/// dV_j = Pᵀ dO             every query row     Pᵀ: key rows of query-row pairs    dO: channel panels of row pairs
/// dK_j = dS'ᵀ Q            every query row     dS'ᵀ: key rows of query-row pairs  Q: channel panels of row pairs
/// dQ_i += dS' K            a group's keys      dS': query rows of key pairs       K: channel panels of key pairs
/// ```
///
/// dS' = dS · scale (so dQ and dK need no scaling pass). For each key block j, the loop over its
/// query blocks computes S and dP, then P and dS' for the 32 × 32 block, and writes them
/// transposed, as pairs of query rows, into one column of Pᵀ and dS'ᵀ ((32, T/2) each); dV_j and
/// dK_j are then one product each over every query row the block sees. dS' is also kept as
/// query rows of key pairs for a group of key blocks (up to `DQ_GROUP_BYTES`, every key at
/// `small`), and dQ_i gets that group's keys in one product. Rows past T are zero in every
/// laid-out operand, and P is zero there, so the padded products add nothing. Rounding as
/// `head_bwd_bf16` (q, k, v, dO, P and dS' to bf16; sums and softmax in f32).
///
/// # Safety
/// `registers::bf16::amx_runs(d)`: AVX512-F, AVX512-BF16 and AMX-BF16, the tile state granted;
/// d a multiple of 32.
#[target_feature(enable = "avx512f,avx512bf16,avx2,fma")]
pub(super) unsafe fn head_bwd_amx(io: &HeadIo, t: usize, d: usize, scale: f32, causal: bool) -> [Vec<f32>; 3] {
    use crate::bf16_gemm::amx::{self, tile_product, TileOperands};
    use std::arch::x86_64::*;
    const B: usize = 32; // keys and query rows per block
    assert!(d.is_multiple_of(32) && d <= 128 && t > 0, "AMX head sizes are multiples of 32 up to 128");
    let (lse, delta) = row_statistics(io, t, d, scale, causal);
    let (dp2, tb) = (d / 2, t.next_multiple_of(B)); // channel pairs; T padded to whole blocks
    let tp = tb / 2; // query-row (and key) pairs, padded

    // dS' as query rows of key pairs, `group` key blocks at a time: (tb, ldk).
    let group = (DQ_GROUP_BYTES / (tb * B / 2 * 4)).clamp(1, tb / B);
    // Row strides one cache line past a multiple of 64 bytes: a tile's 16 rows 1 or 4 KiB
    // apart would share a few L1 sets (at T = 2048 all 16 one set, past its ways).
    let ldk = group * B / 2 + 16;
    let ldt = tp + 16; // Pᵀ's and dS'ᵀ's row stride

    // This worker's buffers from its previous head of the same shape (their padding zero, the
    // rest overwritten below), else new ones: a head's are 1 MiB at `small`, which zeroed
    // afresh per head took a tenth of the backward.
    let mut scratch = AMX_SCRATCH.take().filter(|s| s.shape == (t, d)).unwrap_or_else(|| AmxScratch {
        shape: (t, d),
        layouts: PairLayouts::zeroed(t, d, tb, tp),
        dsk: Lines::zeroed(tb * ldk),
        pt: Lines::zeroed(B * ldt),
        dst: Lines::zeroed(B * ldt),
    });
    scratch.layouts.fill(io, t, d, tp);
    let AmxScratch { layouts: PairLayouts { qp, dop, ktp, vtp, krp, qrp, dorp, .. }, dsk, pt, dst, .. } = &mut scratch;
    // dQ, dK, dV: every element written by a product below (C from zero where it starts).
    // SAFETY: written whole before read, as said; f32 is valid in every bit pattern.
    let (mut dq, mut dk, mut dv) = unsafe { (uninit_of::<f32>(tb * d), uninit_of::<f32>(tb * d), uninit_of::<f32>(tb * d)) };
    // S then P; dP then dS': 32 × 32 f32 each, on 64-byte lines (a tile row across two lines
    // loads and stores at a fraction of the speed).
    let (mut s, mut dp) = (OnLines([[0f32; B]; B]), OnLines([[0f32; B]; B]));
    let (s, dp) = (&mut s.0, &mut dp.0);
    let mut tr = [0u32; 256];
    let sv = _mm512_set1_ps(scale);
    amx::configure();
    for g0 in (0..tb).step_by(group * B) {
        let g1 = (g0 + group * B).min(tb);
        for j0 in (g0..g1).step_by(B) {
            let bc = B.min(t - j0);
            let i_first = if causal { j0 } else { 0 };
            for i0 in (i_first..tb).step_by(B) {
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
                tile_product(d / 32, &scores(qp, ktp), s.as_mut_ptr() as *mut u8, B * 4, false);
                tile_product(d / 32, &scores(dop, vtp), dp.as_mut_ptr() as *mut u8, B * 4, false);
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
                    row[n..].fill(0.0); // masked, or past T: P = 0, so dS' = 0
                    let di = if r < br { delta[i0 + r] } else { 0.0 };
                    for (g, &p) in dp[r].iter_mut().zip(row.iter()) {
                        *g = p * (*g - di) * scale; // dS' = P ∘ (dP − D_i) · scale, in place of dP
                    }
                    // dS''s key pairs in the group's columns: A of dQ
                    let pairs = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(dp[r].as_ptr().add(16)), _mm512_loadu_ps(dp[r].as_ptr()));
                    let at = &mut dsk[(i0 + r) * ldk + (j0 - g0) / 2..][..B / 2];
                    _mm512_storeu_si512(at.as_mut_ptr() as *mut __m512i, std::mem::transmute::<__m512bh, __m512i>(pairs));
                }
                // Pᵀ and dS'ᵀ: the block's 16 row pairs of 16 keys at a time, transposed in
                // registers into column i0/2 of 16 key rows.
                for (x, xt) in [(&s, &mut **pt), (&dp, &mut **dst)] {
                    for k0 in (0..B).step_by(16) {
                        let rows: [__m512i; 16] = std::array::from_fn(|r2| {
                            let (lo, hi) = (_mm512_loadu_ps(x[2 * r2].as_ptr().add(k0)), _mm512_loadu_ps(x[2 * r2 + 1].as_ptr().add(k0)));
                            _mm512_or_si512(round16(lo), _mm512_slli_epi32::<16>(round16(hi)))
                        });
                        crate::bf16_gemm::transpose_16x16_registers(rows, &mut tr);
                        for j in 0..16 {
                            xt[(k0 + j) * ldt + i0 / 2..][..16].copy_from_slice(&tr[16 * j..][..16]);
                        }
                    }
                }
            }
            // dV_j = Pᵀ dO and dK_j = dS'ᵀ Q: 32 keys × 32 channels, over every query row
            // from i_first (16 row pairs a step), C stored once.
            let steps = (tb - i_first) / B;
            for c0 in (0..d).step_by(B) {
                let ops = |a: &[u32], b: &[u32]| TileOperands {
                    a: a.as_ptr().add(i_first / 2) as *const u8,
                    lda: ldt * 4,
                    a_step: 64,
                    b: b.as_ptr().add(tp * c0 + i_first / 2 * PAIR_NR) as *const u8,
                    ldb: PAIR_NR * 4,
                    b_step: 16 * PAIR_NR * 4,
                };
                tile_product(steps, &ops(pt, dorp), dv.as_mut_ptr().add(j0 * d + c0) as *mut u8, d * 4, false);
                tile_product(steps, &ops(dst, qrp), dk.as_mut_ptr().add(j0 * d + c0) as *mut u8, d * 4, false);
            }
        }
        // dQ_i += dS' K over the group's key blocks (up to i's own under the mask), 16 key
        // pairs a step; the first group starts C from zero.
        for i0 in (if causal { g0 } else { 0 }..tb).step_by(B) {
            let j1 = if causal { g1.min(i0 + B) } else { g1 };
            for c0 in (0..d).step_by(B) {
                let ops = TileOperands {
                    a: dsk.as_ptr().add(i0 * ldk) as *const u8,
                    lda: ldk * 4,
                    a_step: 64,
                    b: krp.as_ptr().add(tp * c0 + g0 / 2 * PAIR_NR) as *const u8,
                    ldb: PAIR_NR * 4,
                    b_step: 16 * PAIR_NR * 4,
                };
                tile_product((j1 - g0) / B, &ops, dq.as_mut_ptr().add(i0 * d + c0) as *mut u8, d * 4, g0 > 0);
            }
        }
    }
    amx::release();
    AMX_SCRATCH.set(Some(scratch));
    for x in [&mut dq, &mut dk, &mut dv] {
        x.truncate(t * d);
    }
    [dq, dk, dv]
}

/// A worker's AMX backward buffers for heads of one (T, d).
struct AmxScratch {
    shape: (usize, usize),
    layouts: PairLayouts,
    /// dS' as query rows of key pairs: (tb, ldk), a group of key blocks.
    dsk: Lines<u32>,
    /// Pᵀ and dS'ᵀ of one key block: key j's pair r' (query rows 2r', 2r' + 1) at [j·ldt + r'].
    pt: Lines<u32>,
    dst: Lines<u32>,
}

thread_local! {
    static AMX_SCRATCH: std::cell::Cell<Option<AmxScratch>> = const { std::cell::Cell::new(None) };
}

/// The most bytes of dS' (as query rows of key pairs) the AMX backward keeps for dQ: 512 KiB,
/// every key block of a head up to T = 512 (a quarter of a 2 MiB L2), fewer at longer T.
const DQ_GROUP_BYTES: usize = 512 << 10;

/// Every operand layout the bf16 backwards read, rounded to bf16 (see `head_bwd_bf16`'s
/// table). Zero past T.
struct PairLayouts {
    /// Q's and dO's channel pairs: (rows, d/2).
    qp: Lines<u32>,
    dop: Lines<u32>,
    /// Kᵀ and Vᵀ in panels of PAIR_NR keys: panel p is (d/2, PAIR_NR), pair c' of key
    /// p·PAIR_NR + x at [c'][x].
    ktp: Lines<u32>,
    vtp: Lines<u32>,
    /// K, Q and dO in panels of PAIR_NR channels with row pairs: the panel of channels c0..c0 +
    /// w (w = PAIR_NR, the last narrower) is (tp, w) at c0·tp, pair r' of channel c0 + x at
    /// [r'][x] (rows 2r' and 2r' + 1).
    krp: Lines<u32>,
    qrp: Lines<u32>,
    dorp: Lines<u32>,
    /// K's, then V's, channel pairs (T, d/2), on their way into the key panels.
    along: Lines<u32>,
}

impl PairLayouts {
    /// Zeros for heads of T rows: `rows` ≥ T rows of channel pairs, tp ≥ ⌈T/2⌉ row pairs.
    fn zeroed(t: usize, d: usize, rows: usize, tp: usize) -> Self {
        let dp2 = d / 2;
        PairLayouts {
            qp: Lines::zeroed(rows * dp2),
            dop: Lines::zeroed(rows * dp2),
            ktp: Lines::zeroed(t.div_ceil(PAIR_NR) * dp2 * PAIR_NR),
            vtp: Lines::zeroed(t.div_ceil(PAIR_NR) * dp2 * PAIR_NR),
            krp: Lines::zeroed(tp * d),
            qrp: Lines::zeroed(tp * d),
            dorp: Lines::zeroed(tp * d),
            along: Lines::zeroed(t * dp2),
        }
    }

    /// One head's layouts, in one pass over each input's rows: two neighbouring rows are loaded
    /// once, and their pairs along the channels and across the two rows are made from the same
    /// registers (the rows lie 3·C f32 apart in stage 3's QKV output, so each first read misses
    /// the cache; a pass per layout, seven of them, took over a quarter of the AMX backward's time).
    /// Writes every pair of the first T rows (⌈T/2⌉ row pairs); the padding past them stays as
    /// `zeroed` left it.
    ///
    /// # Safety
    /// The CPU supports AVX512-F and AVX512-BF16; d is a multiple of 16, at most 128; self is
    /// `zeroed(t, d, ·, tp)` (or filled since).
    #[inline(always)]
    unsafe fn fill(&mut self, io: &HeadIo, t: usize, d: usize, tp: usize) {
        let HeadIo { q, k, v, d_o, .. } = *io;
        lay_out_rows(q, t, d, tp, &mut self.qp, Some(&mut self.qrp));
        lay_out_rows(d_o, t, d, tp, &mut self.dop, Some(&mut self.dorp));
        lay_out_rows(k, t, d, tp, &mut self.along, Some(&mut self.krp));
        pair_key_panels(&self.along, t, d / 2, &mut self.ktp);
        lay_out_rows(v, t, d, tp, &mut self.along, None);
        pair_key_panels(&self.along, t, d / 2, &mut self.vtp);
    }
}

/// X's T rows as channel pairs into `along` ((T, d/2) and beyond), and, where asked, as row
/// pairs into `across` (channel panels of (tp, w), as `PairLayouts::krp`).
///
/// # Safety
/// As `pair_layouts`; along holds T·d/2 pairs, across tp·d.
#[inline(always)]
unsafe fn lay_out_rows(x: Rows, t: usize, d: usize, tp: usize, along: &mut [u32], mut across: Option<&mut [u32]>) {
    use std::arch::x86_64::*;
    let dp2 = d / 2;
    assert!(d.is_multiple_of(16) && d <= 128 && along.len() >= t * dp2 && across.as_ref().is_none_or(|a| a.len() >= tp * d));
    let zeros = [0f32; 128];
    for r2 in 0..t.div_ceil(2) {
        let lo = x.row(2 * r2, d);
        let hi = if 2 * r2 + 1 < t { x.row(2 * r2 + 1, d) } else { &zeros[..d] };
        for c in (0..d).step_by(32) {
            let l0 = _mm512_loadu_ps(lo.as_ptr().add(c));
            let h0 = _mm512_loadu_ps(hi.as_ptr().add(c));
            let whole = c + 32 <= d;
            let (l1, h1) = match whole {
                true => (_mm512_loadu_ps(lo.as_ptr().add(c + 16)), _mm512_loadu_ps(hi.as_ptr().add(c + 16))),
                false => (_mm512_setzero_ps(), _mm512_setzero_ps()),
            };
            // Pairs along the channels: c/2.. of each row (8 of them in a last half panel).
            let n = if whole { 0xffff } else { 0x00ff };
            for (r, l, h) in [(2 * r2, l0, l1), (2 * r2 + 1, h0, h1)] {
                if r < t {
                    let pairs = std::mem::transmute::<__m512bh, __m512i>(_mm512_cvtne2ps_pbh(h, l));
                    _mm512_mask_storeu_epi32(along.as_mut_ptr().add(r * dp2 + c / 2) as *mut i32, n, pairs);
                }
            }
            // Pairs across the two rows: row pair r2 of channels c.. in the panel at c·tp.
            if let Some(rp) = across.as_deref_mut() {
                let w = PAIR_NR.min(d - c);
                let at = rp.as_mut_ptr().add(tp * c + r2 * w);
                _mm512_storeu_si512(at as *mut __m512i, _mm512_or_si512(round16(l0), _mm512_slli_epi32::<16>(round16(h0))));
                if whole {
                    _mm512_storeu_si512(at.add(16) as *mut __m512i, _mm512_or_si512(round16(l1), _mm512_slli_epi32::<16>(round16(h1))));
                }
            }
        }
    }
}

/// Channel pairs (T, dp2) into key panels of PAIR_NR keys ((dp2, PAIR_NR) each, as
/// `PairLayouts::ktp`).
#[inline(always)]
fn pair_key_panels(along: &[u32], t: usize, dp2: usize, out: &mut [u32]) {
    for (r, row) in along.chunks_exact(dp2).take(t).enumerate() {
        let panel = &mut out[r / PAIR_NR * dp2 * PAIR_NR..][..dp2 * PAIR_NR];
        for (c2, &pair) in row.iter().enumerate() {
            panel[c2 * PAIR_NR + r % PAIR_NR] = pair;
        }
    }
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
    /// AMX's 32-row blocks; long enough for several of dQ's key groups), rows strided as in
    /// stage 3's QKV views, causal and not: every
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
            // T = 1100: the AMX backward's dQ takes its keys in several groups (`DQ_GROUP_BYTES`);
            // its second head reuses the first's buffers (`AmxScratch`), with other inputs.
            for (t, causal) in [(BC + 45, true), (77, false), (1, true), (64, true), (33, false), (1100, true), (1100, false)] {
                let rs = 3 * d; // rows of a (T, 3, d) buffer, one head
                let data = shared::weights::SplitMix64::new(d as u64 + t as u64 + causal as u64).normals(t * rs + 2 * d);
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
