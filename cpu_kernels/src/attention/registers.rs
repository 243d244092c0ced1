//! The register-blocked CPU kernel (`CpuKernel::Registers`): FlashAttention-2's forward pass
//! for one (batch, head) with our own two micro-kernels instead of the `gemm` crate's, d_head a
//! const generic so every loop over it has a compile-time length.
//!
//! ```text
//! for each block of MR = 12 query rows (O_i: 12 × d, m_i, l_i):
//!   for each step of B_c = 512 keys (causal: up to the block's last row):
//!     S = Q_i K_jᵀ / √d     12 × 32 tiles of S in 24 vector registers, d FMA steps each
//!     m' = max(m, rowmax(S)); P = exp(S − m'); l = e^(m − m')·l + rowsum(P); O = e^(m − m')·O
//!     O += P V_j            O_i's 12 rows × 32 columns in 24 vector registers, B_c FMA steps
//!   O_i / l
//! ```
//!
//! Against the tile-GEMM kernel (`attend_head_tiles`), what changes is the size of a step: that
//! kernel calls a general GEMM per 256 × 256 tile (dispatch, packing, a 256 KiB S tile in L2);
//! this one's query block is 12 rows, so S for one step is 24 KiB and stays in L1, the causal
//! diagonal wastes a 12-row triangle instead of a 64-row one, and nothing is packed but Kᵀ and V,
//! once per head. Each micro-kernel is a loop nest over an MR × NV array of vector registers,
//! written once over a small `Simd` trait: with AVX-512, 12 rows × 2 vectors of 16 f32 (24 of its
//! 32 registers), an inner step of 2 loads, 12 broadcasts and 24 FMAs; with AVX2, 12 rows × 1
//! vector of 8 f32 (12 of its 16 registers).
//!
//! The block sizes were measured (Intel Xeon, AVX-512, 2 threads, `small`'s heads at T = 512,
//! an unrecorded development run): MR = 12 beat 8 by ~4 % (the Kᵀ and V panels, streamed from L2
//! once per block, serve 12 rows instead of 8), MR = 14 spilled registers and lost ~20 %, and
//! B_c = 512 beat 256 by ~1.5 % (fewer rescales of O).

use super::HeadRows;
pub mod bf16;
use crate::elementwise::exp_f32;

/// Query rows per block: the rows of every register tile (24 accumulators with AVX-512).
pub const MR: usize = 12;
/// Keys per online-softmax step (B_c).
pub const BC: usize = 512;

/// The head sizes compiled for (d_head is a const generic); others run the tile-GEMM kernel.
pub const D_HEADS: [usize; 5] = [32, 64, 80, 96, 128];

thread_local! {
    /// Each worker's packed Kᵀ and V panels, reused from head to head (no allocation, no fresh
    /// pages per head).
    static PACKED: std::cell::RefCell<(Vec<f32>, Vec<f32>)> = const { std::cell::RefCell::new((Vec::new(), Vec::new())) };
}

/// Whether this kernel has a body for head size `d`.
pub fn supports(d: usize) -> bool {
    D_HEADS.contains(&d)
}

/// The few vector operations the micro-kernels use, for one instruction set: a register of
/// `LANES` f32. The micro-kernels are written once over this trait; `attend_head` picks the
/// widest set this CPU has. Written with the `std::arch` intrinsics because the compiler does
/// not find this register blocking on its own from plain loops over arrays (it vectorised
/// them across the rows, with gathers).
pub(super) trait Simd {
    type V: Copy;
    const LANES: usize;
    /// # Safety
    /// For every method: the CPU supports the instruction set (`attend_head` checks), and
    /// pointers are valid for LANES f32.
    unsafe fn zero() -> Self::V;
    unsafe fn splat(x: f32) -> Self::V;
    unsafe fn load(p: *const f32) -> Self::V;
    unsafe fn store(p: *mut f32, v: Self::V);
    unsafe fn mul(a: Self::V, b: Self::V) -> Self::V;
    /// a·b + c
    unsafe fn fma(a: Self::V, b: Self::V, c: Self::V) -> Self::V;
    /// P = exp(S − m) in place over a row whose values are ≤ m (or −∞), and rowsum(P). The
    /// portable body by default.
    #[inline(always)]
    unsafe fn exp_sum(row: &mut [f32], m: f32) -> f32 {
        exp_sum(row, m)
    }
}

/// One f32 at a time: any CPU (the compiler may still vectorise it).
pub(super) struct Scalar;
impl Simd for Scalar {
    type V = f32;
    const LANES: usize = 1;
    #[inline(always)]
    unsafe fn zero() -> f32 {
        0.0
    }
    #[inline(always)]
    unsafe fn splat(x: f32) -> f32 {
        x
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> f32 {
        *p
    }
    #[inline(always)]
    unsafe fn store(p: *mut f32, v: f32) {
        *p = v
    }
    #[inline(always)]
    unsafe fn mul(a: f32, b: f32) -> f32 {
        a * b
    }
    #[inline(always)]
    unsafe fn fma(a: f32, b: f32, c: f32) -> f32 {
        a * b + c
    }
}

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

/// 16 lanes (AVX-512F).
#[cfg(target_arch = "x86_64")]
pub(super) struct Avx512;
#[cfg(target_arch = "x86_64")]
impl Simd for Avx512 {
    type V = __m512;
    const LANES: usize = 16;
    #[inline(always)]
    unsafe fn zero() -> __m512 {
        _mm512_setzero_ps()
    }
    #[inline(always)]
    unsafe fn splat(x: f32) -> __m512 {
        _mm512_set1_ps(x)
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> __m512 {
        _mm512_loadu_ps(p)
    }
    #[inline(always)]
    unsafe fn store(p: *mut f32, v: __m512) {
        _mm512_storeu_ps(p, v)
    }
    #[inline(always)]
    unsafe fn mul(a: __m512, b: __m512) -> __m512 {
        _mm512_mul_ps(a, b)
    }
    #[inline(always)]
    unsafe fn fma(a: __m512, b: __m512, c: __m512) -> __m512 {
        _mm512_fmadd_ps(a, b, c)
    }
    /// `exp_f32`'s algorithm on AVX-512 (`elementwise::exp_clamped_avx512`: `vrndscaleps` and
    /// `vscalefps` in place of its scalar-friendly tricks), about 10 instructions per 16 values
    /// instead of ~28: the exponentials are the softmax's cost, one per score against 2·d FMAs.
    #[inline(always)]
    unsafe fn exp_sum(row: &mut [f32], m: f32) -> f32 {
        let (mv, low) = (_mm512_set1_ps(m), _mm512_set1_ps(-86.6));
        // P = exp(S − m) for 16 values at p, stored in place; the value is P, for the sum (a
        // macro, not a closure: a closure is compiled without this function's AVX-512).
        macro_rules! exp16 {
            ($p:expr) => {{
                let p: *mut f32 = $p;
                let x = _mm512_sub_ps(_mm512_loadu_ps(p), mv); // ≤ 0, or −∞ (masked)
                let y = crate::elementwise::exp_clamped_avx512(_mm512_max_ps(x, low)); // e^x above −86.6
                // Below −86.6 (−∞ included): 0, as exp_f32 gives; NaN stays NaN (an unordered compare).
                let y = _mm512_mask_mov_ps(y, _mm512_cmp_ps_mask::<_CMP_LT_OQ>(x, low), _mm512_setzero_ps());
                _mm512_storeu_ps(p, y);
                y
            }};
        }
        // Two sums, 32 values a step: one sum made every add wait for the previous one (and
        // the compiler kept it on the stack, a store and a load per add).
        let (mut sum0, mut sum1) = (_mm512_setzero_ps(), _mm512_setzero_ps());
        let mut pairs = row.chunks_exact_mut(32);
        for c in &mut pairs {
            sum0 = _mm512_add_ps(sum0, exp16!(c.as_mut_ptr()));
            sum1 = _mm512_add_ps(sum1, exp16!(c.as_mut_ptr().add(16)));
        }
        let mut chunks = pairs.into_remainder().chunks_exact_mut(16);
        for c in &mut chunks {
            sum0 = _mm512_add_ps(sum0, exp16!(c.as_mut_ptr()));
        }
        _mm512_reduce_add_ps(_mm512_add_ps(sum0, sum1)) + exp_sum(chunks.into_remainder(), m)
    }
}

/// 8 lanes (AVX2 with FMA).
#[cfg(target_arch = "x86_64")]
pub(super) struct Avx2;
#[cfg(target_arch = "x86_64")]
impl Simd for Avx2 {
    type V = __m256;
    const LANES: usize = 8;
    #[inline(always)]
    unsafe fn zero() -> __m256 {
        _mm256_setzero_ps()
    }
    #[inline(always)]
    unsafe fn splat(x: f32) -> __m256 {
        _mm256_set1_ps(x)
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> __m256 {
        _mm256_loadu_ps(p)
    }
    #[inline(always)]
    unsafe fn store(p: *mut f32, v: __m256) {
        _mm256_storeu_ps(p, v)
    }
    #[inline(always)]
    unsafe fn mul(a: __m256, b: __m256) -> __m256 {
        _mm256_mul_ps(a, b)
    }
    #[inline(always)]
    unsafe fn fma(a: __m256, b: __m256, c: __m256) -> __m256 {
        _mm256_fmadd_ps(a, b, c)
    }
}

/// One (batch, head): `write(r, o)` receives output row r (normalised, f32). `d` must be one of
/// `D_HEADS` (the caller checks `supports`).
pub(super) fn attend_head(head: &HeadRows, t: usize, d: usize, scale: f32, causal: bool, write: &mut dyn FnMut(usize, &[f32], f32)) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f") && std::arch::is_x86_feature_detected!("fma") {
        // SAFETY: this CPU supports AVX-512F and FMA, checked on the line above.
        return unsafe { attend_head_avx512(head, t, d, scale, causal, write) };
    }
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
        // SAFETY: this CPU supports AVX2 and FMA, checked on the line above.
        return unsafe { attend_head_avx2_fma(head, t, d, scale, causal, write) };
    }
    // SAFETY: `Scalar` needs no instruction set.
    unsafe { by_head_size::<Scalar, 8>(head, t, d, scale, causal, write) }
}

/// AVX-512: 12 × 32 register tiles (two vectors per row: 24 accumulators of the 32 registers).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn attend_head_avx512(head: &HeadRows, t: usize, d: usize, scale: f32, causal: bool, write: &mut dyn FnMut(usize, &[f32], f32)) {
    by_head_size::<Avx512, 2>(head, t, d, scale, causal, write)
}

/// AVX2: 12 × 8 register tiles (one vector per row: 12 accumulators of the 16 registers).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn attend_head_avx2_fma(head: &HeadRows, t: usize, d: usize, scale: f32, causal: bool, write: &mut dyn FnMut(usize, &[f32], f32)) {
    by_head_size::<Avx2, 1>(head, t, d, scale, causal, write)
}

/// # Safety
/// The CPU supports `S`'s instruction set.
#[inline(always)]
unsafe fn by_head_size<S: Simd, const NV: usize>(
    head: &HeadRows,
    t: usize,
    d: usize,
    scale: f32,
    causal: bool,
    write: &mut dyn FnMut(usize, &[f32], f32),
) {
    match d {
        32 => attend::<S, 32, NV>(head, t, scale, causal, write),
        64 => attend::<S, 64, NV>(head, t, scale, causal, write),
        80 => attend::<S, 80, NV>(head, t, scale, causal, write),
        96 => attend::<S, 96, NV>(head, t, scale, causal, write),
        128 => attend::<S, 128, NV>(head, t, scale, causal, write),
        _ => unreachable!("d_head {d} has no register-blocked body; callers check `supports`"),
    }
}

/// The kernel for head size D with register tiles of MR rows × NV vectors of `S`.
///
/// # Safety
/// The CPU supports `S`'s instruction set.
#[inline(always)]
unsafe fn attend<S: Simd, const D: usize, const NV: usize>(
    head: &HeadRows,
    t: usize,
    scale: f32,
    causal: bool,
    write: &mut dyn FnMut(usize, &[f32], f32),
) {
    let HeadRows { q, k, v, q_rs, k_rs, v_rs } = *head;
    assert!(
        q.len() >= (t - 1) * q_rs + D && k.len() >= (t - 1) * k_rs + D && v.len() >= (t - 1) * v_rs + D,
        "head rows sized by the caller"
    );
    let nr = NV * S::LANES; // keys per score tile, columns per P·V tile
    assert!(BC.is_multiple_of(nr) && D.is_multiple_of(S::LANES), "tiles divide B_c and d_head");
    // Kᵀ and V packed once per head, so that every tile reads consecutive memory: strided rows
    // (3·C f32 apart in stage 3's QKV output) put a tile's loads a few KiB apart, where they
    // fall into the same few L1 sets and evict each other.
    // Kᵀ in panels of nr keys: panel p is (d, nr), channel c of keys p·nr.. one row of it; the
    // keys past T are zero. Written in order, read from a panel's nr rows of K (nr·d f32, which
    // stay in L1 across the d channels).
    // Taken out of the thread-local and put back at the end, not borrowed in a closure: a
    // closure's body would not inherit this function's target features (and every intrinsic
    // would become a call).
    let (mut kt, mut vp) = PACKED.take();
    let kt_panels = t.div_ceil(nr);
    kt.clear();
    kt.resize(kt_panels * D * nr, 0.0);
    for (p, panel) in kt.chunks_exact_mut(D * nr).enumerate() {
        let keys = nr.min(t - p * nr);
        for (c, dst) in panel.chunks_exact_mut(nr).enumerate() {
            for (jj, x) in dst[..keys].iter_mut().enumerate() {
                *x = k[(p * nr + jj) * k_rs + c];
            }
        }
    }
    // V in column panels: panel p is (T, w) for columns p·nr..p·nr + w (w = nr, the last one
    // narrower when nr does not divide d), rows w apart.
    vp.clear();
    vp.resize(t * D, 0.0);
    let panels: Vec<(usize, usize)> = (0..D).step_by(nr).map(|c0| (c0, nr.min(D - c0))).collect(); // (first column, width)
    for &(c0, w) in &panels {
        let panel = &mut vp[t * c0..][..t * w];
        for j in 0..t {
            panel[j * w..][..w].copy_from_slice(&v[j * v_rs + c0..][..w]);
        }
    }
    let mut s = [[0f32; BC]; MR]; // S, then P, for one step: MR × B_c
    for i0 in (0..t).step_by(MR) {
        let mr = MR.min(t - i0);
        // Q_i's rows; a last block of fewer than MR rows repeats its last row (computed, never written).
        let q_i: [&[f32; D]; MR] = std::array::from_fn(|r| q[(i0 + r.min(mr - 1)) * q_rs..][..D].try_into().expect("D wide"));
        let mut o = [[0f32; D]; MR]; // O_i = 0
        let (mut m, mut l) = ([f32::NEG_INFINITY; MR], [0f32; MR]); // m_i = −∞, l_i = 0
        let kv_end = if causal { i0 + mr } else { t }; // keys the block's last row may see
        for j0 in (0..kv_end).step_by(BC) {
            let bc = BC.min(kv_end - j0);
            // S = Q_i K_jᵀ, one register tile of nr keys at a time.
            for jj in (0..bc).step_by(nr) {
                // SAFETY: the tile reads panel (j0 + jj)/nr of Kᵀ, D·nr f32 inside kt (j0 + jj is
                // a multiple of nr below T), and writes S columns jj..jj + nr ≤ B_c.
                scores_tile::<S, D, NV>(&q_i, kt.as_ptr().add((j0 + jj) * D), nr, scale, &mut s, jj);
            }
            softmax_step::<S, D, MR>(&mut s, (i0, mr), (j0, bc), causal, &mut m, &mut l, &mut o);
            // O += P V_j, one column panel of V at a time.
            for &(c0, w) in &panels {
                // SAFETY (the pv_tile calls): rows j0..j0 + bc ≤ T of the panel, w f32 each, lie inside
                // vp; O has columns c0..c0 + w ≤ D.
                let v_j = vp[t * c0 + j0 * w..].as_ptr(); // the panel's row j0
                if w == nr {
                    pv_tile::<S, D, NV>(&s, bc, v_j, w, &mut o, c0);
                } else {
                    for x in (0..w).step_by(S::LANES) {
                        // The narrower last panel, one vector at a time (w is a multiple of LANES).
                        pv_tile::<S, D, 1>(&s, bc, v_j.add(x), w, &mut o, c0 + x);
                    }
                }
            }
        }
        // O_i = diag(l)⁻¹ · O_i
        for (r, row) in o.iter_mut().enumerate().take(mr) {
            let inv_l = 1.0 / l[r];
            row.iter_mut().for_each(|x| *x *= inv_l);
            write(i0 + r, row, m[r] + l[r].ln()); // with L_i = m_i + ln l_i, which the backward can keep
        }
    }
    PACKED.set((kt, vp));
}

/// The online softmax for one step of B_c keys, on the block's R rows of S (in place: S becomes
/// P; R = MR in the register kernels, 32 in the AMX one), with the running max m, sum l and
/// output O of each row:
/// m' = max(m, rowmax(S)); P = exp(S − m'); l = e^(m − m')·l + rowsum(P); O = e^(m − m')·O.
/// Rows past `mr` (a last block's repeats) and keys a row may not see (causal) get P = 0. The
/// f32 and bf16 kernels share it.
///
/// # Safety
/// The CPU supports `S`'s instruction set.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn softmax_step<S: Simd, const D: usize, const R: usize>(
    s: &mut [[f32; BC]; R],
    (i0, mr): (usize, usize),
    (j0, bc): (usize, usize),
    causal: bool,
    m: &mut [f32; R],
    l: &mut [f32; R],
    o: &mut [[f32; D]; R],
) {
    for r in 0..R {
        // Keys row r may see in this step: all, or up to its own position (causal).
        let n = if r >= mr {
            0 // a repeated row: P = 0, O stays 0
        } else if causal {
            bc.min((i0 + r + 1).saturating_sub(j0))
        } else {
            bc
        };
        let row = &mut s[r];
        if n == 0 {
            row[..bc].fill(0.0);
            continue;
        }
        // Whole vectors of 16 from here on: the masked keys up to the next multiple of 16
        // get S = −∞, which leaves the max alone and gives P = exp(−∞) = 0.
        let n16 = n.next_multiple_of(16); // ≤ B_c, a multiple of 16
        row[n..n16].fill(f32::NEG_INFINITY);
        let m_new = super::max_f32(&row[..n16], m[r]); // m' = max(m, rowmax(S))
        let alpha = exp_f32(m[r] - m_new); // e^(m − m'): 0 on the first step (m = −∞)
        let row_sum = S::exp_sum(&mut row[..n16], m_new); // P = exp(S − m'), rowsum(P)
        if n16 < bc {
            row[n16..bc].fill(0.0); // masked (causal diagonal): P = 0
        }
        l[r] = alpha * l[r] + row_sum; // l = e^(m − m')·l + rowsum(P)
        if alpha != 1.0 {
            o[r].iter_mut().for_each(|x| *x *= alpha); // O = e^(m − m')·O
        }
        m[r] = m_new;
    }
}

/// S[r][jj..jj + nr] = q_r · (keys j0 + jj..)ᵀ · scale for the MR rows, nr = NV·LANES keys: `kt` points
/// at those keys' Kᵀ panel, channel rows `tp` apart. The MR × NV accumulators are the register
/// tile; each of the D steps is NV loads, MR broadcasts and MR·NV FMAs.
///
/// # Safety
/// The CPU supports `S`; kt is valid for D rows of nr f32, `tp` apart; jj + nr ≤ B_c.
#[inline(always)]
#[allow(clippy::needless_range_loop)] // indices, as in the equation: the register tile is acc[r][x]
unsafe fn scores_tile<S: Simd, const D: usize, const NV: usize>(
    q_i: &[&[f32; D]; MR],
    kt: *const f32,
    tp: usize,
    scale: f32,
    s: &mut [[f32; BC]; MR],
    jj: usize,
) {
    let mut acc = [[S::zero(); NV]; MR];
    for c in 0..D {
        let k_c: [S::V; NV] = std::array::from_fn(|x| S::load(kt.add(c * tp + x * S::LANES))); // channel c of nr keys
        for r in 0..MR {
            let q_rc = S::splat(q_i[r][c]); // broadcast
            for x in 0..NV {
                acc[r][x] = S::fma(q_rc, k_c[x], acc[r][x]);
            }
        }
    }
    let scale = S::splat(scale);
    for r in 0..MR {
        for x in 0..NV {
            S::store(s[r][jj + x * S::LANES..][..S::LANES].as_mut_ptr(), S::mul(acc[r][x], scale));
            // S / √d
        }
    }
}

/// P = exp(S − m) in place, and rowsum(P), in one pass: 16 running sums, so the loop
/// vectorises.
#[inline(always)]
fn exp_sum(row: &mut [f32], m: f32) -> f32 {
    let mut acc = [0f32; 16];
    let mut chunks = row.chunks_exact_mut(16);
    for c in &mut chunks {
        for (a, x) in acc.iter_mut().zip(c) {
            *x = exp_f32(*x - m);
            *a += *x;
        }
    }
    let tail: f32 = chunks
        .into_remainder()
        .iter_mut()
        .map(|x| {
            *x = exp_f32(*x - m);
            *x
        })
        .sum();
    acc.iter().sum::<f32>() + tail
}

/// O[r][c0..c0 + NV·LANES] += Σ_j P[r][j] · V[j0 + j][c0..] over the step's bc keys (`v_j`
/// points at V[j0][c0] in its panel, rows `v_rs` apart), with those MR × NV vectors of O in
/// registers for the whole sum; each of the bc steps is NV loads, MR broadcasts and MR·NV FMAs.
///
/// # Safety
/// The CPU supports `S`; v_j is valid for bc rows `v_rs` apart of NV·LANES f32; c0 + NV·LANES ≤ D.
#[inline(always)]
#[allow(clippy::needless_range_loop)] // indices, as in the equation: the register tile is acc[r][x]
unsafe fn pv_tile<S: Simd, const D: usize, const NV: usize>(
    p: &[[f32; BC]; MR],
    bc: usize,
    v_j: *const f32,
    v_rs: usize,
    o: &mut [[f32; D]; MR],
    c0: usize,
) {
    let mut acc: [[S::V; NV]; MR] =
        std::array::from_fn(|r| std::array::from_fn(|x| S::load(o[r][c0 + x * S::LANES..][..S::LANES].as_ptr())));
    for j in 0..bc {
        let v_row: [S::V; NV] = std::array::from_fn(|x| S::load(v_j.add(j * v_rs + x * S::LANES)));
        for r in 0..MR {
            let p_rj = S::splat(p[r][j]); // broadcast
            for x in 0..NV {
                acc[r][x] = S::fma(p_rj, v_row[x], acc[r][x]);
            }
        }
    }
    for r in 0..MR {
        for x in 0..NV {
            S::store(o[r][c0 + x * S::LANES..][..S::LANES].as_mut_ptr(), acc[r][x]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn simd_bodies_agree_with_the_baseline_one() {
        // The scalar body (12 × 8 tiles of single f32, separate multiply and add) against the
        // AVX2 and AVX-512 ones, on a head read through
        // strides (the second of 2 heads, rows 3·h·d apart as in stage 3's QKV output), with a
        // ragged T (not a multiple of MR, NR or B_c) and every compiled head size.
        type Body = unsafe fn(&HeadRows, usize, usize, f32, bool, &mut dyn FnMut(usize, &[f32], f32));
        fn baseline(h: &HeadRows, t: usize, d: usize, s: f32, c: bool, w: &mut dyn FnMut(usize, &[f32], f32)) {
            // SAFETY: `Scalar` needs no instruction set.
            unsafe { by_head_size::<Scalar, 8>(h, t, d, s, c, w) }
        }
        for d in D_HEADS {
            let (t, h) = (BC + 3 * MR + 5, 2);
            let rs = 3 * h * d;
            let data = shared::weights::SplitMix64::new(d as u64).normals(t * rs);
            let head = HeadRows { q: &data[d..], k: &data[h * d + d..], v: &data[2 * h * d + d..], q_rs: rs, k_rs: rs, v_rs: rs };
            let run = |body: Body, causal: bool| {
                let mut out = vec![f32::NAN; t * d];
                // SAFETY: called only with bodies this CPU supports (checked by the caller).
                unsafe { body(&head, t, d, 0.17, causal, &mut |r, o, _| out[r * d..][..d].copy_from_slice(o)) };
                out
            };
            for causal in [true, false] {
                let a = run(baseline as Body, causal);
                assert!(a.iter().all(|x| x.is_finite()), "d={d}: every row written, finite");
                #[cfg(target_arch = "x86_64")]
                for (name, ok, body) in [
                    (
                        "avx2",
                        std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma"),
                        attend_head_avx2_fma as Body,
                    ),
                    (
                        "avx512",
                        std::arch::is_x86_feature_detected!("avx512f") && std::arch::is_x86_feature_detected!("fma"),
                        attend_head_avx512,
                    ),
                ] {
                    if ok {
                        let c = run(body, causal);
                        let worst = a.iter().zip(&c).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
                        assert!(worst < 1e-5, "{name} d={d} causal={causal}: {worst}");
                    }
                }
            }
        }
    }

    #[test]
    fn only_compiled_head_sizes_are_supported() {
        for d in D_HEADS {
            assert!(supports(d));
        }
        for d in [1, 16, 48, 65, 256] {
            assert!(!supports(d), "{d}");
        }
    }
}
