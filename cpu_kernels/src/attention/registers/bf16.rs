//! The register-blocked kernel for bf16 q, k and v on AVX512-BF16: both products on
//! `vdpbf16ps`, as a GPU's FlashAttention runs them on bf16 tensor cores.
//!
//! ```text
//! S = Q_i K_jᵀ / √d     bf16 · bf16, f32 accumulate: pairs of adjacent channels
//! online softmax        f32 (m, l and P as in the f32 kernel: `softmax_step`)
//! O += P V_j            P rounded to bf16, f32 accumulate: pairs of adjacent keys
//! ```
//!
//! **Why it is faster.** `vdpbf16ps` adds two bf16 products into each f32 lane per instruction,
//! twice an f32 FMA's multiply-adds, and its operands are half the bytes. The f32 kernel on bf16
//! inputs instead widens each head's q, k and v to f32 first (a pass per head) and runs at the
//! f32 rate.
//!
//! **The pair layouts.** An instruction's pairs must be adjacent in the contraction: for S, two
//! channels of one key (K's rows already hold them side by side, so Kᵀ's panel stores each
//! key's channel pair as one u32), for P·V two keys of one channel (V's panel stores rows 2p and
//! 2p + 1 interleaved). q's channel pair and P's key pair are broadcast to all lanes. An odd T
//! leaves V's last pair half empty: it is zero, and so is P there.
//!
//! **What it costs.** q, k and v are bf16 already; P is rounded to bf16 (8 significant bits,
//! ~2e-3 relative) before P·V, as FlashAttention does on GPUs, while m and l are summed from the
//! f32 P. `attend_head_scalar` is its scalar twin (the same steps one value at a time); the test
//! below pairs them.

#[cfg(target_arch = "x86_64")]
use super::{softmax_step, Avx512};
use super::{BC, MR};
use crate::attention::HeadRows;
use crate::bf16_gemm::{Kernel, Lines, OnLines};
use crate::elementwise::exp_f32;
use half::bf16;

/// Keys per score tile: two vectors of 16 f32.
const NR: usize = 32;
/// The largest compiled head size's channel pairs (d_head 128).
const MAX_PAIRS: usize = 64;

thread_local! {
    /// Each worker's packed Kᵀ and V pair panels, reused from head to head.
    /// On 64-byte lines: AMX loads their rows as tile rows.
    static PACKED: std::cell::RefCell<(Lines<u32>, Lines<u32>)> = const { std::cell::RefCell::new((Lines::new(), Lines::new())) };
    /// Each worker's S (then P) and P's bf16 pairs for the AMX body (TR rows each, 96 KiB),
    /// reused from head to head: every entry a step reads, the step wrote first.
    #[cfg(target_arch = "x86_64")]
    static SCORES: std::cell::RefCell<ScoreRows> = const { std::cell::RefCell::new((Vec::new(), Vec::new())) };
}

/// S (then P, f32) and P's bf16 pairs, one array per query row of a block, each on 64-byte
/// lines (AMX stores S and loads P as tile rows).
#[cfg(target_arch = "x86_64")]
type ScoreRows = (Vec<OnLines<[f32; BC]>>, Vec<OnLines<[u32; BC / 2]>>);

/// Whether bf16 attention runs on this kernel here: a compiled head size, a CPU with
/// AVX512-BF16, and `SPEEDKIT_CPU_BF16` not set to `off` (which makes the CPU one without bf16
/// units: the f32 kernel then runs on widened inputs).
pub fn runs(d: usize) -> bool {
    super::supports(d) && Kernel::detect().is_native() && Kernel::Avx512Bf16.available()
}

/// Two bf16 as the instructions read a pair: the first in the low half.
#[inline(always)]
fn pair(lo: bf16, hi: bf16) -> u32 {
    lo.to_bits() as u32 | (hi.to_bits() as u32) << 16
}

/// One (batch, head) of bf16 inputs: `write(r, o)` receives output row r (normalised, f32).
/// An error, never a fault, unless `runs(d)`.
pub(in crate::attention) fn attend_head(
    head: &HeadRows<bf16>,
    t: usize,
    d: usize,
    scale: f32,
    causal: bool,
    write: &mut dyn FnMut(usize, &[f32], f32),
) -> Result<(), String> {
    if !runs(d) {
        return Err(format!("bf16 attention: no AVX512-BF16 body for d_head {d} on this CPU (kernel {})", Kernel::detect().name()));
    }
    #[cfg(target_arch = "x86_64")]
    // SAFETY: `runs` checked that this CPU has AVX512-F and AVX512-BF16; `amx_runs` that it has
    // AMX-BF16 tiles granted and d is a multiple of 32.
    unsafe {
        match amx_runs(d) {
            true => attend_on_tiles(head, t, d, scale, causal, write),
            false => attend_avx512_bf16(head, t, d, scale, causal, write),
        }
    };
    Ok(())
}

/// The AMX body for the head sizes that are multiples of 32.
///
/// # Safety
/// `amx_runs(d)`.
#[cfg(target_arch = "x86_64")]
unsafe fn attend_on_tiles(head: &HeadRows<bf16>, t: usize, d: usize, scale: f32, causal: bool, write: &mut dyn FnMut(usize, &[f32], f32)) {
    match d {
        32 => attend_amx::<32>(head, t, scale, causal, write),
        64 => attend_amx::<64>(head, t, scale, causal, write),
        96 => attend_amx::<96>(head, t, scale, causal, write),
        128 => attend_amx::<128>(head, t, scale, causal, write),
        _ => unreachable!("d_head {d} has no AMX body; `amx_runs` checks"),
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16,avx2,fma")]
unsafe fn attend_avx512_bf16(
    head: &HeadRows<bf16>,
    t: usize,
    d: usize,
    scale: f32,
    causal: bool,
    write: &mut dyn FnMut(usize, &[f32], f32),
) {
    match d {
        32 => attend::<32>(head, t, scale, causal, write),
        64 => attend::<64>(head, t, scale, causal, write),
        80 => attend::<80>(head, t, scale, causal, write),
        96 => attend::<96>(head, t, scale, causal, write),
        128 => attend::<128>(head, t, scale, causal, write),
        _ => unreachable!("d_head {d} has no register-blocked body; `runs` checks"),
    }
}

/// The kernel for head size D: the f32 kernel's loop (`registers::attend`) with pair panels.
///
/// # Safety
/// The CPU supports AVX512-F and AVX512-BF16.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn attend<const D: usize>(head: &HeadRows<bf16>, t: usize, scale: f32, causal: bool, write: &mut dyn FnMut(usize, &[f32], f32)) {
    let HeadRows { q, q_rs, .. } = *head;
    let dp = D / 2; // channel pairs (every compiled D is even)
    let (mut kt, mut vp) = PACKED.take();
    let t2 = pack_panels::<D>(head, t, 1, &mut kt, &mut vp);
    let panels = &panels::<D>()[..D.div_ceil(NR)];
    let mut s = [[0f32; BC]; MR]; // S, then P (f32), for one step
    let mut p16 = [[0u32; BC / 2]; MR]; // P rounded to bf16, key pairs
    let mut q_i = [[0u32; MAX_PAIRS]; MR]; // Q_i's channel pairs
    for i0 in (0..t).step_by(MR) {
        let mr = MR.min(t - i0);
        for (r, qr) in q_i.iter_mut().enumerate() {
            // A last block of fewer than MR rows repeats its last row (computed, never written).
            let row = &q[(i0 + r.min(mr - 1)) * q_rs..][..D];
            pairs_of_row(row, &mut qr[..dp]);
        }
        let mut o = [[0f32; D]; MR]; // O_i = 0
        let (mut m, mut l) = ([f32::NEG_INFINITY; MR], [0f32; MR]); // m_i = −∞, l_i = 0
        let kv_end = if causal { i0 + mr } else { t };
        for j0 in (0..kv_end).step_by(BC) {
            let bc = BC.min(kv_end - j0);
            for jj in (0..bc).step_by(NR) {
                // SAFETY: panel (j0 + jj)/NR of Kᵀ, D/2 · NR pairs, lies inside kt; S columns
                // jj..jj + NR ≤ B_c.
                scores_tile::<D>(&q_i, kt.as_ptr().add((j0 + jj) * dp), scale, &mut s, jj);
            }
            softmax_step::<Avx512, D, MR>(&mut s, (i0, mr), (j0, bc), causal, &mut m, &mut l, &mut o);
            // P to bf16, whole vectors of 16: the keys past bc are P = 0.
            let bc16 = bc.next_multiple_of(16);
            for (sr, pr) in s.iter_mut().zip(p16.iter_mut()) {
                sr[bc..bc16].fill(0.0);
                round_to_bf16(&sr[..bc16], &mut pr[..bc16 / 2]);
            }
            // O += P V_j over ⌈bc/2⌉ key pairs (an odd bc's last pair: P = 0 on its second key).
            let pairs = bc.div_ceil(2);
            for &(c0, w) in panels.iter() {
                // SAFETY: pairs j0/2..j0/2 + pairs ≤ t2 of the panel lie inside vp; O has columns
                // c0..c0 + w ≤ D.
                let v_j = vp.as_ptr().add(t2 * c0 + (j0 / 2) * w);
                if w == NR {
                    pv_tile::<D, 2>(&p16, pairs, v_j, w, &mut o, c0);
                } else {
                    for x in (0..w).step_by(16) {
                        pv_tile::<D, 1>(&p16, pairs, v_j.add(x), w, &mut o, c0 + x);
                        // the narrower last panel
                    }
                }
            }
        }
        // O_i = diag(l)⁻¹ · O_i
        for (r, row) in o.iter_mut().enumerate().take(mr) {
            let inv_l = 1.0 / l[r];
            row.iter_mut().for_each(|x| *x *= inv_l);
            write(i0 + r, row, m[r] + l[r].ln()); // with L_i = m_i + ln l_i
        }
    }
    PACKED.set((kt, vp));
}

/// `out[c2]` = pair(row[2·c2], row[2·c2 + 1]) for a whole row: the pair two neighbouring bf16
/// make is their bytes read as one little-endian u32, so this is a copy (`pair` one at a time was
/// ~6 % of the AMX kernel's time).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn pairs_of_row(row: &[bf16], out: &mut [u32]) {
    assert_eq!(row.len(), 2 * out.len(), "two bf16 per pair");
    #[cfg(target_endian = "little")]
    // SAFETY: both regions are 4·out.len() bytes (asserted), distinct (one is &mut), and u32 has
    // no invalid bit patterns; bytes are copied, so alignment does not matter.
    unsafe {
        std::ptr::copy_nonoverlapping(row.as_ptr() as *const u8, out.as_mut_ptr() as *mut u8, 4 * out.len())
    };
    #[cfg(not(target_endian = "little"))]
    for (o, two) in out.iter_mut().zip(row.chunks_exact(2)) {
        *o = pair(two[0], two[1]);
    }
}

/// V's column panels for head size D: (first column, width), NR wide, the last narrower when
/// NR does not divide D (d_head 80). Only the first ⌈D/NR⌉ are used.
#[cfg(target_arch = "x86_64")]
fn panels<const D: usize>() -> [(usize, usize); 2 * MAX_PAIRS / NR] {
    std::array::from_fn(|i| (i * NR, NR.min(D.saturating_sub(i * NR))))
}

/// Packs one head's K and V into the pair panels both bf16 kernels read; returns the pairs per V
/// panel column, ⌈T/2⌉ rounded up to a multiple of `pad_pairs`.
///
/// Kᵀ in panels of NR keys: panel p is (D/2, NR) pairs, channel pair c2 of key p·NR + jj at
/// (p·D/2 + c2)·NR + jj; keys past T are zero. V in column panels (first column c0, width
/// w ≤ NR), rows paired: key pair j2 of column c0 + cc at t2·c0 + j2·w + cc; pairs past T are
/// zero (an odd T's last pair has a zero second key).
#[cfg(target_arch = "x86_64")]
fn pack_panels<const D: usize>(head: &HeadRows<bf16>, t: usize, pad_pairs: usize, kt: &mut Lines<u32>, vp: &mut Lines<u32>) -> usize {
    let HeadRows { q, k, v, q_rs, k_rs, v_rs } = *head;
    assert!(
        t > 0 && q.len() >= (t - 1) * q_rs + D && k.len() >= (t - 1) * k_rs + D && v.len() >= (t - 1) * v_rs + D,
        "head rows sized by the caller"
    );
    let dp = D / 2;
    kt.reset(t.div_ceil(NR) * dp * NR);
    for (p, panel) in kt.chunks_exact_mut(dp * NR).enumerate() {
        let keys = NR.min(t - p * NR);
        if dp.is_multiple_of(16) {
            // 16 keys × 16 channel pairs at a time, transposed in registers (keys past T: zero rows).
            for k0 in (0..keys).step_by(16) {
                for cb in 0..dp / 16 {
                    let mut m = [0u32; 256]; // row jj: key k0 + jj's pairs 16·cb..16·cb + 16
                    for jj in 0..16.min(keys - k0) {
                        pairs_of_row(&k[(p * NR + k0 + jj) * k_rs + 32 * cb..][..32], &mut m[16 * jj..][..16]);
                    }
                    let mut tr = [0u32; 256]; // row c: channel pair 16·cb + c of the 16 keys
                    crate::bf16_gemm::transpose_16x16(&m, &mut tr);
                    for c in 0..16 {
                        panel[(16 * cb + c) * NR + k0..][..16].copy_from_slice(&tr[16 * c..][..16]);
                    }
                }
            }
            continue;
        }
        for jj in 0..keys {
            let row = &k[(p * NR + jj) * k_rs..][..D];
            let mut pairs = [0u32; MAX_PAIRS];
            pairs_of_row(row, &mut pairs[..dp]);
            for c2 in 0..dp {
                panel[c2 * NR + jj] = pairs[c2];
            }
        }
    }
    let pairs = t.div_ceil(2);
    let t2 = pairs.next_multiple_of(pad_pairs);
    vp.reset(t2 * D);
    for &(c0, w) in &panels::<D>()[..D.div_ceil(NR)] {
        let panel = &mut vp[t2 * c0..][..t2 * w];
        for j2 in 0..pairs {
            let r0 = &v[2 * j2 * v_rs + c0..][..w];
            let dst = &mut panel[j2 * w..][..w];
            if 2 * j2 + 1 < t {
                let r1 = &v[(2 * j2 + 1) * v_rs + c0..][..w];
                for cc in 0..w {
                    dst[cc] = pair(r0[cc], r1[cc]);
                }
            } else {
                for cc in 0..w {
                    dst[cc] = pair(r0[cc], bf16::ZERO); // an odd T: the pair's second key is zero
                }
            }
        }
    }
    t2
}

/// Whether the AMX body runs bf16 attention here: the bf16 GEMMs run on AMX (`Kernel::detect`:
/// the CPU has the tiles, Linux granted them, `SPEEDKIT_CPU_BF16` did not ask for
/// `avx512-bf16`), and d_head is a compiled size that is a multiple of 32 (whole tiles of 16
/// channel pairs, V panels of 32 columns).
pub fn amx_runs(d: usize) -> bool {
    runs(d) && d.is_multiple_of(32) && Kernel::detect() == Kernel::Amx
}

/// Query rows per AMX block: two 16-row tiles.
#[cfg(target_arch = "x86_64")]
const TR: usize = 32;

/// The AMX body: the AVX512-BF16 kernel's steps with both products on tiles (`tdpbf16ps`, a
/// 16 × 16 f32 tile += 16 rows × 16 pairs · 16 pairs × 16 columns) for blocks of TR = 32 query
/// rows. S for 32 keys at a time is four C tiles (two row halves × two key halves), from Q's
/// two A tiles and Kᵀ's two B tiles per 16 channel pairs, stored into S; the online softmax is
/// `softmax_step`, on AVX-512; P, rounded to bf16 pairs, is the A operand of P·V, which
/// accumulates onto O (loaded into C tiles, 32 columns at a time, and stored back after the
/// step's keys). The pair panels are the AVX512-BF16 kernel's, V's padded to whole tiles.
///
/// # Safety
/// `amx_runs(D)`: the CPU has AVX512-F, AVX512-BF16 and AMX-BF16, Linux granted the tile state;
/// D is a multiple of 32.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16,avx2,fma")]
unsafe fn attend_amx<const D: usize>(head: &HeadRows<bf16>, t: usize, scale: f32, causal: bool, write: &mut dyn FnMut(usize, &[f32], f32)) {
    use crate::bf16_gemm::amx;
    let HeadRows { q, q_rs, .. } = *head;
    let dp = D / 2;
    let (mut kt, mut vp) = PACKED.take();
    let t2 = pack_panels::<D>(head, t, 16, &mut kt, &mut vp);
    // S (then P) and P's bf16 pairs for one step of B_c keys, Q_i's pairs and O_i: 32 rows each.
    // S and P (96 KiB together) in the worker's reused buffers, Q_i and O_i (8 and ≤ 16 KiB) on the stack.
    let (mut s_rows, mut p_rows) = SCORES.take();
    s_rows.resize_with(TR, || OnLines([0f32; BC]));
    p_rows.resize_with(TR, || OnLines([0u32; BC / 2]));
    // SAFETY: TR rows each (resized above); OnLines<[T; N]> is repr(C) around the array, whose
    // size (512 and 256 bytes) is a multiple of its 64-byte alignment, so TR of them are laid out
    // exactly as [[T; N]; TR].
    let (s, p16) =
        unsafe { (&mut *(s_rows.as_mut_ptr() as *mut [[f32; BC]; TR]), &mut *(p_rows.as_mut_ptr() as *mut [[u32; BC / 2]; TR])) };
    let (mut q_i, mut o) = (OnLines([[0u32; MAX_PAIRS]; TR]), OnLines([[0f32; D]; TR])); // on 64-byte lines too
    let (q_i, o) = (&mut q_i.0, &mut o.0);
    amx::configure();
    for i0 in (0..t).step_by(TR) {
        let mr = TR.min(t - i0);
        for (r, qr) in q_i.iter_mut().enumerate() {
            // A last block of fewer than TR rows repeats its last row (computed, never written).
            let row = &q[(i0 + r.min(mr - 1)) * q_rs..][..D];
            pairs_of_row(row, &mut qr[..dp]);
        }
        o.iter_mut().for_each(|row| row.fill(0.0)); // O_i = 0
        let (mut m, mut l) = ([f32::NEG_INFINITY; TR], [0f32; TR]); // m_i = −∞, l_i = 0
        let kv_end = if causal { i0 + mr } else { t };
        for j0 in (0..kv_end).step_by(BC) {
            let bc = BC.min(kv_end - j0);
            let bc32 = bc.next_multiple_of(32); // whole Kᵀ panels (keys past T are zero there)
            for jj in (0..bc32).step_by(NR) {
                // SAFETY: panel (j0 + jj)/NR of Kᵀ exists (j0 + jj < T, rounded down to a panel),
                // D/2 rows of NR pairs; S columns jj..jj + 32 ≤ B_c (B_c is a multiple of 32).
                scores_amx::<D>(q_i, kt.as_ptr().add((j0 + jj) * dp), s, jj);
            }
            for row in s.iter_mut().take(mr) {
                scale_row(&mut row[..bc], scale); // S / √d
            }
            softmax_step::<Avx512, D, TR>(s, (i0, mr), (j0, bc), causal, &mut m, &mut l, o);
            // P to bf16 pairs over whole tiles of 32 keys: the keys past bc are P = 0.
            for (sr, pr) in s.iter_mut().zip(p16.iter_mut()) {
                sr[bc..bc32].fill(0.0);
                round_to_bf16(&sr[..bc32], &mut pr[..bc32 / 2]);
            }
            // O += P V_j over bc32 / 2 key pairs, 32 columns of O at a time.
            for c0 in (0..D).step_by(NR) {
                // SAFETY: pairs j0/2..j0/2 + bc32/2 ≤ t2 (t2 is ⌈T/2⌉ rounded up to 16, and
                // j0 + bc32 ≤ T rounded up to 32) of the panel at column c0 (NR wide) lie inside vp.
                pv_amx::<D>(p16, bc32 / 2, vp.as_ptr().add(t2 * c0 + (j0 / 2) * NR), o, c0);
            }
        }
        // O_i = diag(l)⁻¹ · O_i
        for (r, row) in o.iter_mut().enumerate().take(mr) {
            let inv_l = 1.0 / l[r];
            row.iter_mut().for_each(|x| *x *= inv_l);
            write(i0 + r, row, m[r] + l[r].ln()); // with L_i = m_i + ln l_i
        }
    }
    amx::release();
    PACKED.set((kt, vp));
    SCORES.set((s_rows, p_rows));
}

/// row *= scale, 16 at a time.
///
/// # Safety
/// The CPU supports AVX512-F.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn scale_row(row: &mut [f32], scale: f32) {
    let sv = _mm512_set1_ps(scale);
    let mut chunks = row.chunks_exact_mut(16);
    for c in &mut chunks {
        _mm512_storeu_ps(c.as_mut_ptr(), _mm512_mul_ps(_mm512_loadu_ps(c.as_ptr()), sv));
    }
    chunks.into_remainder().iter_mut().for_each(|x| *x *= scale);
}

/// S[r][jj..jj + 32] = q_r · (32 keys)ᵀ for the TR = 32 rows, unscaled: the GEMM's 2 × 2 tile
/// product (`amx::tile_product`), A = Q_i's pairs (rows `MAX_PAIRS` pairs apart), B = the keys'
/// Kᵀ panel (rows NR pairs apart), 16 channel pairs a step, C stored into S (tiles start at zero).
///
/// # Safety
/// Tiles configured (`amx::configure`); kt is valid for D/2 rows of NR pairs; jj + 32 ≤ B_c.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn scores_amx<const D: usize>(q_i: &[[u32; MAX_PAIRS]; TR], kt: *const u32, s: &mut [[f32; BC]; TR], jj: usize) {
    use crate::bf16_gemm::amx::{tile_product, TileOperands};
    let ops = TileOperands {
        a: q_i[0].as_ptr() as *const u8,
        lda: MAX_PAIRS * 4,
        a_step: 64,
        b: kt as *const u8,
        ldb: NR * 4,
        b_step: 16 * NR * 4,
    };
    tile_product(D / 32, &ops, s[0][jj..].as_mut_ptr() as *mut u8, BC * 4, false);
}

/// O[r][c0..c0 + 32] += Σ_j2 P[r][j2] · V[j0 + 2·j2..][c0..] for the TR = 32 rows over `pairs`
/// key pairs (a multiple of 16): the same tile product, A = P's pairs (rows B_c/2 pairs apart),
/// B = the V panel's pair rows (NR pairs apart; `v_j` at the step's first pair), C loaded from
/// O and stored back.
///
/// # Safety
/// Tiles configured; v_j is valid for `pairs` rows of NR pairs; c0 + 32 ≤ D.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn pv_amx<const D: usize>(p: &[[u32; BC / 2]; TR], pairs: usize, v_j: *const u32, o: &mut [[f32; D]; TR], c0: usize) {
    use crate::bf16_gemm::amx::{tile_product, TileOperands};
    let ops =
        TileOperands { a: p[0].as_ptr() as *const u8, lda: BC / 2 * 4, a_step: 64, b: v_j as *const u8, ldb: NR * 4, b_step: 16 * NR * 4 };
    tile_product(pairs / 16, &ops, o[0][c0..].as_mut_ptr() as *mut u8, D * 4, true);
}

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

/// `pairs[i]` = (bf16(p[2i]), bf16(p[2i + 1])), rounded to nearest even (`vcvtneps2bf16`, 16 at a
/// time). p's length is a multiple of 16.
///
/// # Safety
/// The CPU supports AVX512-F and AVX512-BF16.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn round_to_bf16(p: &[f32], pairs: &mut [u32]) {
    debug_assert!(p.len().is_multiple_of(16) && pairs.len() * 2 == p.len());
    for (src, dst) in p.chunks_exact(16).zip(pairs.chunks_exact_mut(8)) {
        let h: __m256i = std::mem::transmute(_mm512_cvtneps_pbh(_mm512_loadu_ps(src.as_ptr())));
        _mm256_storeu_si256(dst.as_mut_ptr() as *mut __m256i, h);
    }
}

/// S[r][jj..jj + NR] = q_r · (keys j0 + jj..)ᵀ · scale for the MR rows: `kt` points at those
/// keys' Kᵀ pair panel, channel pair rows NR apart. Each of the D/2 steps: 2 loads, MR
/// broadcasts of q's pair, 2·MR `vdpbf16ps`.
///
/// # Safety
/// The CPU supports AVX512-F and AVX512-BF16; kt is valid for D/2 rows of NR pairs.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
#[allow(clippy::needless_range_loop)] // indices, as in the equation: the register tile is acc[r][x]
unsafe fn scores_tile<const D: usize>(q_i: &[[u32; MAX_PAIRS]; MR], kt: *const u32, scale: f32, s: &mut [[f32; BC]; MR], jj: usize) {
    let mut acc = [[_mm512_setzero_ps(); 2]; MR];
    for c2 in 0..D / 2 {
        let k0: __m512bh = std::mem::transmute(_mm512_loadu_si512(kt.add(c2 * NR) as *const _));
        let k1: __m512bh = std::mem::transmute(_mm512_loadu_si512(kt.add(c2 * NR + 16) as *const _));
        for r in 0..MR {
            let q_rc: __m512bh = std::mem::transmute(_mm512_set1_epi32(q_i[r][c2] as i32)); // broadcast
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], q_rc, k0);
            acc[r][1] = _mm512_dpbf16_ps(acc[r][1], q_rc, k1);
        }
    }
    let scale = _mm512_set1_ps(scale);
    for r in 0..MR {
        _mm512_storeu_ps(s[r][jj..].as_mut_ptr(), _mm512_mul_ps(acc[r][0], scale)); // S / √d
        _mm512_storeu_ps(s[r][jj + 16..].as_mut_ptr(), _mm512_mul_ps(acc[r][1], scale));
    }
}

/// O[r][c0..c0 + 16·NV] += Σ_j2 P[r][2·j2..2·j2 + 2] · V[j0 + 2·j2..][c0..] over `pairs` key
/// pairs (`v_j` points at the panel's pair row j0/2, rows `w` apart), O's MR × NV vectors in
/// registers for the whole sum.
///
/// # Safety
/// The CPU supports AVX512-F and AVX512-BF16; v_j is valid for `pairs` rows `w` apart of 16·NV
/// pairs; c0 + 16·NV ≤ D.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
#[allow(clippy::needless_range_loop)]
unsafe fn pv_tile<const D: usize, const NV: usize>(
    p: &[[u32; BC / 2]; MR],
    pairs: usize,
    v_j: *const u32,
    w: usize,
    o: &mut [[f32; D]; MR],
    c0: usize,
) {
    let mut acc = [[_mm512_setzero_ps(); NV]; MR];
    for r in 0..MR {
        for x in 0..NV {
            acc[r][x] = _mm512_loadu_ps(o[r][c0 + 16 * x..].as_ptr());
        }
    }
    let mut v_row = [std::mem::transmute::<__m512, __m512bh>(_mm512_setzero_ps()); NV];
    for j2 in 0..pairs {
        for x in 0..NV {
            v_row[x] = std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_si512(v_j.add(j2 * w + 16 * x) as *const _));
        }
        for r in 0..MR {
            let p_rj: __m512bh = std::mem::transmute(_mm512_set1_epi32(p[r][j2] as i32)); // broadcast
            for x in 0..NV {
                acc[r][x] = _mm512_dpbf16_ps(acc[r][x], p_rj, v_row[x]);
            }
        }
    }
    for r in 0..MR {
        for x in 0..NV {
            _mm512_storeu_ps(o[r][c0 + 16 * x..].as_mut_ptr(), acc[r][x]);
        }
    }
}

/// The scalar twin: one query row at a time, the same B_c steps, the same f32 softmax and the
/// same rounding of P to bf16, products of bf16 values summed in f32. Any head size.
#[cfg_attr(not(test), allow(dead_code))] // the twin: the test below runs it
pub(in crate::attention) fn attend_head_scalar(
    head: &HeadRows<bf16>,
    t: usize,
    d: usize,
    scale: f32,
    causal: bool,
    write: &mut dyn FnMut(usize, &[f32], f32),
) {
    let HeadRows { q, k, v, q_rs, k_rs, v_rs } = *head;
    let mut o = vec![0f32; d];
    for i in 0..t {
        let (mut m, mut l) = (f32::NEG_INFINITY, 0f32);
        o.fill(0.0);
        let end = if causal { i + 1 } else { t }; // keys row i sees
        for j0 in (0..end).step_by(BC) {
            let n = BC.min(end - j0);
            let s: Vec<f32> =
                (j0..j0 + n).map(|j| (0..d).map(|c| q[i * q_rs + c].to_f32() * k[j * k_rs + c].to_f32()).sum::<f32>() * scale).collect(); // S = q kᵀ / √d
            let m_new = s.iter().fold(m, |a, &x| a.max(x)); // m' = max(m, rowmax(S))
            let alpha = exp_f32(m - m_new);
            let p: Vec<f32> = s.iter().map(|&x| exp_f32(x - m_new)).collect(); // P = exp(S − m')
            l = alpha * l + p.iter().sum::<f32>(); // l = e^(m − m')·l + rowsum(P)
            for (c, oc) in o.iter_mut().enumerate() {
                let pv: f32 = p.iter().enumerate().map(|(jj, &pj)| bf16::from_f32(pj).to_f32() * v[(j0 + jj) * v_rs + c].to_f32()).sum();
                *oc = alpha * *oc + pv; // O = e^(m − m')·O + bf16(P) V
            }
            m = m_new;
        }
        o.iter_mut().for_each(|x| *x /= l);
        write(i, &o, m + l.ln());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::attention::registers::D_HEADS;

    #[test]
    #[cfg(target_arch = "x86_64")] // the bodies are x86's; elsewhere `runs` is false
    fn avx512_bf16_agrees_with_its_scalar_twin() {
        // A head read through strides (the second of 2 heads, rows 3·h·d apart as in stage 3's
        // QKV output), T ragged (odd, not a multiple of MR or NR, one more B_c step), every
        // compiled head size, causal and not.
        if !runs(64) {
            eprintln!("skipped: no AVX512-BF16 here (or SPEEDKIT_CPU_BF16=off)");
            return;
        }
        for d in D_HEADS {
            for t in [1, 13, 47, BC + 3 * MR + 5] {
                let h = 2;
                let rs = 3 * h * d;
                let data: Vec<bf16> =
                    shared::weights::SplitMix64::new((d * t) as u64).normals(t * rs).into_iter().map(bf16::from_f32).collect();
                let head = HeadRows { q: &data[d..], k: &data[h * d + d..], v: &data[2 * h * d + d..], q_rs: rs, k_rs: rs, v_rs: rs };
                for causal in [true, false] {
                    let mut want = vec![f32::NAN; t * d];
                    attend_head_scalar(&head, t, d, 0.17, causal, &mut |r, o, _| want[r * d..][..d].copy_from_slice(o));
                    // Each body this CPU has: AVX512-BF16 always here, AMX where amx_runs(d).
                    type Body = unsafe fn(&HeadRows<bf16>, usize, usize, f32, bool, &mut dyn FnMut(usize, &[f32], f32));
                    let mut bodies: Vec<(&str, Body)> = vec![("avx512-bf16", attend_avx512_bf16)];
                    if amx_runs(d) {
                        bodies.push(("amx", attend_on_tiles));
                    }
                    for (name, body) in bodies {
                        let mut got = vec![f32::NAN; t * d];
                        // SAFETY: runs(64) (checked above), and amx_runs(d) for the AMX body.
                        unsafe { body(&head, t, d, 0.17, causal, &mut |r, o, _| got[r * d..][..d].copy_from_slice(o)) };
                        assert!(got.iter().all(|x| x.is_finite()), "{name} d={d} t={t}: every row written, finite");
                        let worst = want.iter().zip(&got).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
                        // Summation order, and the odd P on a bf16 rounding boundary that the two
                        // exponentials (vector and scalar, an ulp apart) round to neighbours: one
                        // bf16 ulp (2⁻⁸) of one weight ≤ 1, times |v|. A wrong pair layout or step
                        // is off by O(|v|).
                        let v_max = data.iter().map(|x| x.to_f32().abs()).fold(0f32, f32::max);
                        assert!(worst < v_max / 256.0, "{name} d={d} t={t} causal={causal}: {worst}");
                    }
                }
            }
        }
    }

    #[test]
    fn refuses_what_it_cannot_run() {
        let x = [bf16::ZERO; 48];
        let head = HeadRows { q: &x, k: &x, v: &x, q_rs: 48, k_rs: 48, v_rs: 48 };
        let e = attend_head(&head, 1, 48, 1.0, true, &mut |_, _, _| {}).unwrap_err();
        assert!(e.contains("d_head 48"), "{e}");
    }
}
