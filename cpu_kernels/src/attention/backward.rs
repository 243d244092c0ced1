//! The backward pass of `attention`: FlashAttention-2's (Dao 2023, Algorithm 2) on the CPU, as
//! the `bwd` of the same candle op, so `loss.backward()` through `attention(q, k, v, causal)`
//! gives dQ, dK, dV without ever holding a (T, T) tensor.
//!
//! Per (batch, head), in the paper's notation (O the forward's output, dO its gradient, L the
//! per-row log-sum-exp of the scaled scores):
//!
//! ```text
//! D_i   = rowsum(dO_i ∘ O_i)                    one pass, before any tile
//! for each key tile K_j, V_j (B_c × d):  dK_j = dV_j = 0
//!   for each query tile Q_i (B_r × d) that sees it:
//!     S    = Q_i K_jᵀ · scale                   GEMM  B_r × B_c × d
//!     P    = exp(S − L_i)  (0 where masked)     the softmax, recomputed from L: no max, no sum
//!     dV_j += Pᵀ dO_i                           GEMM  B_c × d × B_r
//!     dP   = dO_i V_jᵀ                          GEMM  B_r × B_c × d
//!     dS   = P ∘ (dP − D_i)                     softmax's Jacobian, row by row
//!     dQ_i += dS K_j · scale                    GEMM  B_r × d × B_c
//!     dK_j += dSᵀ Q_i · scale                   GEMM  B_c × d × B_r
//! ```
//!
//! Five tile GEMMs where the forward has two: 2.5 forwards' worth of FLOPs. The key
//! tiles are the outer loop (as in the paper): dK_j and dV_j stay in one worker's cache while
//! the query tiles stream past; dQ accumulates across key tiles in a (T, d) buffer of the head.
//! One rayon task per (batch, head) owns all three, so nothing is shared between threads.
//!
//! The five products run on the forward's register-blocked micro-kernels (`tiles`: 12-row
//! register tiles, AVX-512 or AVX2, at the forward's register head sizes), each operand laid out
//! once per head in the order the micro-kernel reads it — after a forward with bf16 products, on
//! bf16 pairs (`vdpbf16ps`, or AMX tiles in 32 × 32 blocks where the forward's ran on AMX:
//! `tiles::head_bwd_amx`); elsewhere through the `gemm` crate
//! (`head_bwd_impl`), which packs both operands on every call (at `small`'s heads, one thread of
//! an AVX-512 Xeon: 48 ms per backward against the `gemm` crate's 64).
//!
//! L comes from the forward: while training (q, k or v tracked) the CPU kernels hand each row's
//! L_i = m_i + ln l_i to their row writer with the row (they hold m and l there anyway), and the
//! op keeps them, one f32 per row, for this pass; inference keeps nothing. Where no L was kept
//! (the row-wise ablation kernel, a call of `attention_bwd` without one) it is recomputed by one
//! more Q·Kᵀ sweep with the forward's online max and sum (`log_sum_exp`): a sixth tile GEMM per
//! tile pair, a sixth of this pass's FLOPs.
//!
//! On CUDA the same `bwd` runs `bwd_candle_ops`: the same equations as whole-tensor candle ops,
//! which do materialise (B, n_head, T, T) — correct, but not FlashAttention's memory.
//!
//! Slow twins: `grads_slow`, candle's autograd through the naive attention (matmul, mask,
//! softmax, matmul), and `small_head_bwd`, the same algorithm as scalar loops over one head.

use super::max_f32;
#[cfg(target_arch = "x86_64")]
mod tiles;
use crate::elementwise::{exp_f32, sum_f32};
use candle_core::{DType, Device, Tensor, Var, D};
use rayon::prelude::*;

/// Query rows per tile (B_r): S, P and dP are B_r × B_c f32 (64 KiB each at 128 × 128), and with
/// dK_j, dV_j (B_c × d) they stay in a worker's L2 while the five GEMMs run over them.
pub const BR: usize = 128;
/// Keys per tile (B_c).
pub const BC: usize = 128;

/// The gradients of `attention(q, k, v, causal)` for output gradient `d_o`, given the forward's
/// output `o` and, when it kept them, its log-sum-exps `lse` ((B, n_head, T), else recomputed). q, k, v: (B, T, n_head, d_head) in any layout (stage 3's views of one QKV output
/// too); o and d_o the same shape. Returns (dq, dk, dv), contiguous, in q's dtype.
#[allow(clippy::too_many_arguments)] // the op's five tensors, L, and the two numbers that define it
pub fn attention_bwd(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    o: &Tensor,
    d_o: &Tensor,
    lse: Option<&[f32]>,
    scale: f32,
    causal: bool,
) -> candle_core::Result<[Tensor; 3]> {
    attention_bwd_with(q, k, v, o, d_o, lse, scale, causal, false)
}

/// `attention_bwd` with bf16 products when `bf16_products`, as the forward with bf16 products
/// (bf16 inputs, or `CpuKernel::RegistersBf16`) ran them, so the backward multiplies in the
/// forward's precision: on AMX tiles where the forward's ran there (`registers::bf16::amx_runs`:
/// `tiles::head_bwd_amx`), on `vdpbf16ps` where AVX512-BF16 is the bf16 unit. An AMX CPU's
/// `vdpbf16ps` retires no more multiply-adds per cycle than an f32 FMA, and the pairs' extra
/// layout passes made that body slower than the f32 one there (69 against 50 ms at `small`'s
/// heads, one thread, AMX Xeon), so at head sizes AMX does not take, the products are f32, as
/// in `attention_bwd`.
#[allow(clippy::too_many_arguments)] // attention_bwd's arguments and the products' precision
pub fn attention_bwd_with(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    o: &Tensor,
    d_o: &Tensor,
    lse: Option<&[f32]>,
    scale: f32,
    causal: bool,
    bf16_products: bool,
) -> candle_core::Result<[Tensor; 3]> {
    if q.device().is_cuda() {
        // Our CUDA kernel runs from the L its forward wrote (`FlashAttn::bwd`); without one (f32,
        // stage 3 at TF32, which our forward kernels do not take) the backward is candle's ops.
        return bwd_candle_ops(q, k, v, o, d_o, scale, causal);
    }
    let (b, t, h, d, grads) = head_grads(q, k, v, o, d_o, lse, scale, causal, bf16_products)?;
    let back = |which: usize| Tensor::from_vec(gather(&grads, (t, h, d), &[which]), (b, t, h, d), &Device::Cpu)?.to_dtype(q.dtype());
    Ok([back(0)?, back(1)?, back(2)?])
}

/// The heads' (T, d) gradients (`head_grads`) written row by row: for each batch entry and
/// position, the gradients `which` names (0, 1, 2: dq, dk, dv) in that order, each across the
/// heads — (B, T, n_head, d_head) for one, (B, T, 3, n_head, d_head) for all three. Blocks of
/// rows on all threads (one thread copying 18 MiB at `small` left the other idle), each row
/// written whole, so there is no zeroed buffer to overwrite.
fn gather(grads: &[[Vec<f32>; 3]], (t, h, d): (usize, usize, usize), which: &[usize]) -> Vec<f32> {
    const ROWS: usize = 16; // 16 rows of [dq | dk | dv] at C = 768: 144 KiB a task
    let row = which.len() * h * d;
    let rows = grads.len().checked_div(h).unwrap_or(0) * t;
    // SAFETY: every row is written whole below before the buffer is returned.
    let mut out = unsafe { crate::elementwise::uninit_of::<f32>(rows * row) };
    if row == 0 {
        return out;
    }
    out.par_chunks_mut(ROWS * row).enumerate().for_each(|(c, block)| {
        for (i, dst) in block.chunks_exact_mut(row).enumerate() {
            let (bi, r) = ((c * ROWS + i) / t, (c * ROWS + i) % t);
            let heads = &grads[bi * h..][..h];
            let mut at = 0;
            for &w in which {
                for head in heads {
                    dst[at..at + d].copy_from_slice(&head[w][r * d..][..d]);
                    at += d;
                }
            }
        }
    });
    out
}

/// The heads' gradients on the CPU: (B, T, n_head, d_head) and each head's (dq, dk, dv) as (T, d)
/// rows, head bh = bi·n_head + hi.
#[allow(clippy::too_many_arguments)] // attention_bwd_with's arguments
fn head_grads(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    o: &Tensor,
    d_o: &Tensor,
    lse: Option<&[f32]>,
    scale: f32,
    causal: bool,
    bf16_products: bool,
) -> candle_core::Result<HeadGrads> {
    if !q.device().is_cpu() {
        candle_core::bail!("attention backward: the CPU kernels got tensors on {:?}", q.device().location());
    }
    let (b, t, h, d) = q.dims4()?;
    // bf16 products on AMX tiles where the forward's ran there; on AVX512-BF16 where that is the
    // bf16 unit; f32 otherwise (see above).
    let amx = bf16_products && super::registers::bf16::amx_runs(d);
    let bf16 = !amx
        && bf16_products
        && super::registers::bf16::runs(d)
        && crate::bf16_gemm::Kernel::detect() == crate::bf16_gemm::Kernel::Avx512Bf16;
    crate::trace::ran_with(|| {
        format!(
            "attention backward: FlashAttention-2 tiles, {}{}",
            match (amx, bf16, registered(d)) {
                (true, _, _) => "bf16 pairs on AMX tiles (amx)",
                (false, true, _) => "register-blocked, bf16 pairs (avx512-bf16)",
                (false, false, true) => "register-blocked f32 micro-kernels",
                (false, false, false) => "f32 tile GEMMs (gemm crate)",
            },
            if lse.is_none() { ", L recomputed" } else { "" }
        )
    });
    // Each input as f32 rows read where they lie: a (B, T, n_head, d_head) f32 view whose
    // channels are adjacent (stage 3's q, k and v are views of one QKV output, rows 3·C apart)
    // is read in place; anything else (bf16/f16, channels apart) is copied once as contiguous
    // f32 (widening on the way: the products run from f32 rows).
    let tensors = [q, k, v, o, d_o];
    let mut owned = Vec::with_capacity(5);
    for x in tensors {
        let in_place = x.dtype() == DType::F32 && x.stride().get(3) == Some(&1);
        owned.push(if in_place { None } else { Some(x.to_dtype(DType::F32)?.contiguous()?) });
    }
    let guards: Vec<_> = tensors.iter().zip(&owned).map(|(x, c)| c.as_ref().unwrap_or(x).storage_and_layout()).collect();
    let mut views = Vec::with_capacity(5);
    for ((storage, layout), x) in guards.iter().zip(tensors) {
        match (&**storage, layout.stride()) {
            (candle_core::Storage::Cpu(candle_core::CpuStorage::F32(v)), &[sb, st, sh, 1]) if layout.dims() == x.dims() => {
                views.push(HeadView { data: v, start: layout.start_offset(), sb, st, sh })
            }
            _ => candle_core::bail!("attention backward: an input is not a (B, T, n_head, d_head) f32 CPU tensor with adjacent channels"),
        }
    }
    let (qv, kv, vv, ov, dov) = (views[0], views[1], views[2], views[3], views[4]);
    let grads: Vec<[Vec<f32>; 3]> = (0..b * h)
        .into_par_iter()
        .map(|bh| {
            let io = HeadIo {
                q: qv.head(bh / h, bh % h),
                k: kv.head(bh / h, bh % h),
                v: vv.head(bh / h, bh % h),
                o: ov.head(bh / h, bh % h),
                d_o: dov.head(bh / h, bh % h),
                lse: lse.map(|l| &l[bh * t..][..t]),
            };
            #[cfg(target_arch = "x86_64")]
            if amx {
                // SAFETY: `registers::bf16::amx_runs(d)`: AVX512-F, AVX512-BF16, AMX-BF16 with the
                // tile state granted, and d a multiple of 32.
                return unsafe { tiles::head_bwd_amx(&io, t, d, scale, causal) };
            }
            #[cfg(target_arch = "x86_64")]
            if bf16 {
                // SAFETY: `registers::bf16::runs(d)`: AVX512-F, AVX512-BF16 (and so FMA) and a
                // register head size.
                return unsafe { tiles::head_bwd_bf16(&io, t, d, scale, causal) };
            }
            head_bwd(&io, t, d, scale, causal)
        })
        .collect();
    Ok((b, t, h, d, grads))
}

/// (B, T, n_head, d_head) and each head's (dq, dk, dv) as (T, d) rows (`head_grads`).
type HeadGrads = (usize, usize, usize, usize, Vec<[Vec<f32>; 3]>);

/// `attention_bwd_with`'s gradients as one (B, T, 3, n_head, d_head) tensor, in q's dtype, each
/// row [dq | dk | dv]: the gradient of a packed QKV tensor whose three slices were q, k and v
/// (stage 3's QKV output), written once from the heads' results, with no per-slice tensors to
/// pad and add.
#[allow(clippy::too_many_arguments)] // attention_bwd_with's arguments
pub fn attention_bwd_packed(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    o: &Tensor,
    d_o: &Tensor,
    lse: Option<&[f32]>,
    scale: f32,
    causal: bool,
    bf16_products: bool,
) -> candle_core::Result<Tensor> {
    let (b, t, h, d, grads) = head_grads(q, k, v, o, d_o, lse, scale, causal, bf16_products)?;
    Tensor::from_vec(gather(&grads, (t, h, d), &[0, 1, 2]), (b, t, 3, h, d), &Device::Cpu)?.to_dtype(q.dtype())
}

/// Whether the backward runs the register-blocked micro-kernels (`tiles`) at head size `d`: on
/// x86-64 with AVX2 or AVX-512, at the head sizes the forward's register kernel compiles.
fn registered(d: usize) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        super::registers::supports(d) && std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = d;
        false
    }
}

/// A (B, T, n_head, d_head) f32 tensor's storage and strides (channels adjacent).
#[derive(Clone, Copy)]
struct HeadView<'a> {
    data: &'a [f32],
    start: usize,
    sb: usize,
    st: usize,
    sh: usize,
}

impl<'a> HeadView<'a> {
    /// Head `hi` of batch entry `bi`: its T rows, `st` apart.
    fn head(&self, bi: usize, hi: usize) -> Rows<'a> {
        Rows { data: &self.data[self.start + bi * self.sb + hi * self.sh..], rs: self.st }
    }
}

/// One head's rows inside a (B, T, n_head, d_head) buffer: row r starts at `r·rs`.
#[derive(Clone, Copy)]
struct Rows<'a> {
    data: &'a [f32],
    rs: usize,
}

impl Rows<'_> {
    fn row(&self, r: usize, d: usize) -> &[f32] {
        &self.data[r * self.rs..][..d]
    }
}

/// One head's inputs to the backward.
struct HeadIo<'a> {
    q: Rows<'a>,
    k: Rows<'a>,
    v: Rows<'a>,
    o: Rows<'a>,
    d_o: Rows<'a>,
    /// The forward's L_i of this head's T rows, when it kept them (else recomputed).
    lse: Option<&'a [f32]>,
}

/// dQ, dK, dV of one head as (T, d) rows. The element-wise loops (exp, dS) are compiled three
/// times (baseline, AVX2+FMA, AVX-512) and picked at run time, as the forward's are; the tile
/// GEMMs dispatch on their own.
fn head_bwd(io: &HeadIo, t: usize, d: usize, scale: f32, causal: bool) -> [Vec<f32>; 3] {
    #[cfg(target_arch = "x86_64")]
    if registered(d) && std::arch::is_x86_feature_detected!("avx512f") && std::arch::is_x86_feature_detected!("fma") {
        // SAFETY: this CPU supports AVX-512F and FMA, checked on the line above.
        return unsafe { tiles::head_bwd_avx512(io, t, d, scale, causal) };
    }
    #[cfg(target_arch = "x86_64")]
    if registered(d) && std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
        // SAFETY: this CPU supports AVX2 and FMA, checked on the line above.
        return unsafe { tiles::head_bwd_avx2_fma(io, t, d, scale, causal) };
    }
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f") && std::arch::is_x86_feature_detected!("fma") {
        // SAFETY: this CPU supports AVX-512F and FMA, checked on the line above.
        return unsafe { head_bwd_avx512(io, t, d, scale, causal) };
    }
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
        // SAFETY: this CPU supports AVX2 and FMA, checked on the line above.
        return unsafe { head_bwd_avx2_fma(io, t, d, scale, causal) };
    }
    head_bwd_impl(io, t, d, scale, causal)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn head_bwd_avx2_fma(io: &HeadIo, t: usize, d: usize, scale: f32, causal: bool) -> [Vec<f32>; 3] {
    head_bwd_impl(io, t, d, scale, causal)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn head_bwd_avx512(io: &HeadIo, t: usize, d: usize, scale: f32, causal: bool) -> [Vec<f32>; 3] {
    head_bwd_impl(io, t, d, scale, causal)
}

#[inline(always)]
fn head_bwd_impl(io: &HeadIo, t: usize, d: usize, scale: f32, causal: bool) -> [Vec<f32>; 3] {
    let HeadIo { q, k, v, d_o, .. } = *io;
    let (lse, delta) = row_statistics(io, t, d, scale, causal);
    let (mut dq, mut dk, mut dv) = (vec![0f32; t * d], vec![0f32; t * d], vec![0f32; t * d]);
    let (mut p, mut dp) = (vec![0f32; BR * BC], vec![0f32; BR * BC]); // P and dS in p; dP: B_r × B_c, row stride B_c
    for j0 in (0..t).step_by(BC) {
        let bc = BC.min(t - j0);
        let (dk_j, dv_j) = (&mut dk[j0 * d..(j0 + bc) * d], &mut dv[j0 * d..(j0 + bc) * d]); // (B_c, d), accumulated
        let k_j = Mat { data: &k.data[j0 * k.rs..], rows: bc, cols: d, rs: k.rs, cs: 1 };
        let v_j = Mat { data: &v.data[j0 * v.rs..], rows: bc, cols: d, rs: v.rs, cs: 1 };
        // Causal: query tiles wholly before this key tile see none of it.
        let i_first = if causal { j0 / BR * BR } else { 0 };
        for i0 in (i_first..t).step_by(BR) {
            let br = BR.min(t - i0);
            let q_i = Mat { data: &q.data[i0 * q.rs..], rows: br, cols: d, rs: q.rs, cs: 1 };
            let do_i = Mat { data: &d_o.data[i0 * d_o.rs..], rows: br, cols: d, rs: d_o.rs, cs: 1 };
            gemm_into(&mut p, BC, false, q_i, k_j.t(), scale); // S = Q_i K_jᵀ · scale
            for r in 0..br {
                // Keys this row sees: all, or (causal) up to its own position.
                let n = if causal { bc.min((i0 + r + 1).saturating_sub(j0)) } else { bc };
                let (row, l) = (&mut p[r * BC..][..bc], lse[i0 + r]);
                row[..n].iter_mut().for_each(|s| *s = exp_f32(*s - l)); // P = exp(S − L)
                row[n..].fill(0.0); // masked: P = 0, so dS = 0 there too
            }
            let p_ij = Mat { data: &p, rows: br, cols: bc, rs: BC, cs: 1 };
            gemm_into(dv_j, d, true, p_ij.t(), do_i, 1.0); // dV_j += Pᵀ dO_i
            gemm_into(&mut dp, BC, false, do_i, v_j.t(), 1.0); // dP = dO_i V_jᵀ
            for r in 0..br {
                let di = delta[i0 + r];
                let (ds, dp) = (&mut p[r * BC..][..bc], &dp[r * BC..][..bc]);
                ds.iter_mut().zip(dp).for_each(|(x, &g)| *x *= g - di); // dS = P ∘ (dP − D_i), in place of P
            }
            let ds = Mat { data: &p, rows: br, cols: bc, rs: BC, cs: 1 };
            gemm_into(&mut dq[i0 * d..(i0 + br) * d], d, true, ds, k_j, scale); // dQ_i += dS K_j · scale
            gemm_into(dk_j, d, true, ds.t(), q_i, scale); // dK_j += dSᵀ Q_i · scale
        }
    }
    [dq, dk, dv]
}

/// Each query row's L_i (kept by the forward, else recomputed: `log_sum_exp`) and D_i =
/// rowsum(dO_i ∘ O_i), the Σ_j P_ij dP_ij that softmax's Jacobian subtracts, from (T, d) values
/// instead of a (T, T) row. Inlined into each head's backward, so its loops are compiled for the
/// same vector width.
#[inline(always)]
fn row_statistics<'a>(io: &HeadIo<'a>, t: usize, d: usize, scale: f32, causal: bool) -> (std::borrow::Cow<'a, [f32]>, Vec<f32>) {
    let lse = match io.lse {
        Some(l) => std::borrow::Cow::Borrowed(l),
        None => std::borrow::Cow::Owned(log_sum_exp(io.q, io.k, t, d, scale, causal)),
    };
    let mut delta = vec![0f32; t];
    for (r, di) in delta.iter_mut().enumerate() {
        *di = dot(io.d_o.row(r, d), io.o.row(r, d));
    }
    (lse, delta)
}

/// Σ a_c·b_c, in 16 partial sums so the loop vectorises.
#[inline(always)]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 16];
    let (whole_a, whole_b) = (a.chunks_exact(16), b.chunks_exact(16));
    let tail: f32 = whole_a.remainder().iter().zip(whole_b.remainder()).map(|(x, y)| x * y).sum();
    for (x, y) in whole_a.zip(whole_b) {
        for i in 0..16 {
            acc[i] += x[i] * y[i];
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// L_i = m_i + ln l_i per query row: the forward's online max and sum over the scaled scores,
/// tile by tile (S = Q_i K_jᵀ · scale, B_r × B_c at a time), without the output. Inlined into
/// `head_bwd_impl`, so its loops are compiled for the same vector width.
#[inline(always)]
fn log_sum_exp(q: Rows, k: Rows, t: usize, d: usize, scale: f32, causal: bool) -> Vec<f32> {
    let mut lse = vec![0f32; t];
    let mut s = vec![0f32; BR * BC];
    for i0 in (0..t).step_by(BR) {
        let br = BR.min(t - i0);
        let (mut m, mut l) = ([f32::NEG_INFINITY; BR], [0f32; BR]);
        let q_i = Mat { data: &q.data[i0 * q.rs..], rows: br, cols: d, rs: q.rs, cs: 1 };
        let kv_end = if causal { i0 + br } else { t };
        for j0 in (0..kv_end).step_by(BC) {
            let bc = BC.min(kv_end - j0);
            let k_j = Mat { data: &k.data[j0 * k.rs..], rows: bc, cols: d, rs: k.rs, cs: 1 };
            gemm_into(&mut s, BC, false, q_i, k_j.t(), scale);
            for r in 0..br {
                let n = if causal { bc.min((i0 + r + 1).saturating_sub(j0)) } else { bc };
                if n == 0 {
                    continue;
                }
                // The forward's vectorised loops: 16 running maxima and sums, exp in place.
                let row = &mut s[r * BC..][..n];
                let m_new = max_f32(row, m[r]); // m' = max(m, rowmax(S))
                row.iter_mut().for_each(|x| *x = exp_f32(*x - m_new));
                l[r] = exp_f32(m[r] - m_new) * l[r] + sum_f32(row); // l = e^(m − m')·l + rowsum(e^(S − m'))
                m[r] = m_new;
            }
        }
        for r in 0..br {
            lse[i0 + r] = m[r] + l[r].ln();
        }
    }
    lse
}

/// A strided f32 matrix: element (i, j) at `i·rs + j·cs`; `t()` is its transpose, no copy.
#[derive(Clone, Copy)]
struct Mat<'a> {
    data: &'a [f32],
    rows: usize,
    cols: usize,
    rs: usize,
    cs: usize,
}

impl Mat<'_> {
    fn t(self) -> Self {
        Mat { rows: self.cols, cols: self.rows, rs: self.cs, cs: self.rs, ..self }
    }
}

/// dst (a.rows × b.cols, row stride `ld`) = [dst +] beta · a · b, on one thread (rayon is busy
/// with the other heads), through the `gemm` crate's micro-kernels.
fn gemm_into(dst: &mut [f32], ld: usize, accumulate: bool, a: Mat, b: Mat, beta: f32) {
    let (m, n, k) = (a.rows, b.cols, a.cols);
    assert_eq!(k, b.rows, "inner dimensions");
    let last = |x: &Mat| (x.rows - 1) * x.rs + (x.cols - 1) * x.cs;
    assert!(
        m * n * k > 0 && last(&a) < a.data.len() && last(&b) < b.data.len() && (m - 1) * ld + n <= dst.len(),
        "tiles sized by the caller"
    );
    // SAFETY: every element either operand or dst addresses lies inside its slice (asserted
    // above); dst is a unique borrow, so it aliases neither operand.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            1,
            ld as isize,
            accumulate,
            a.data.as_ptr(),
            a.cs as isize,
            a.rs as isize,
            b.data.as_ptr(),
            b.cs as isize,
            b.rs as isize,
            if accumulate { 1.0 } else { 0.0 },
            beta,
            false,
            false,
            false,
            gemm::Parallelism::None,
        )
    }
}

/// The same equations as whole-tensor candle ops, on any device: what `bwd` runs on CUDA. It
/// materialises P and dS, (B, n_head, T, T) f32 each — FlashAttention's backward on the GPU is
/// not built yet, and this keeps training correct there meanwhile.
pub fn bwd_candle_ops(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    o: &Tensor,
    d_o: &Tensor,
    scale: f32,
    causal: bool,
) -> candle_core::Result<[Tensor; 3]> {
    let heads = |x: &Tensor| x.to_dtype(DType::F32)?.transpose(1, 2)?.contiguous(); // (B, n_head, T, d_head)
    let (qh, kh, vh, oh, doh) = (heads(q)?, heads(k)?, heads(v)?, heads(o)?, heads(d_o)?);
    let p = softmax_scores(&qh, &kh, scale, causal)?; // (B, n_head, T, T)
    let dv = p.t()?.matmul(&doh)?; // dV = Pᵀ dO
    let dp = doh.matmul(&vh.t()?)?; // dP = dO Vᵀ
    let delta = (&doh * &oh)?.sum_keepdim(D::Minus1)?; // D = rowsum(dO ∘ O), (B, n_head, T, 1)
    let ds = (&p * dp.broadcast_sub(&delta)?)?; // dS = P ∘ (dP − D)
    let dq = (ds.matmul(&kh)? * scale as f64)?; // dQ = dS K · scale
    let dk = (ds.t()?.matmul(&qh)? * scale as f64)?; // dK = dSᵀ Q · scale
    let back = |g: Tensor| g.transpose(1, 2)?.contiguous()?.to_dtype(q.dtype()); // (B, T, n_head, d_head)
    Ok([back(dq)?, back(dk)?, back(dv)?])
}

/// softmax(q kᵀ · scale [+ causal mask]) over (B, n_head, T, d_head) f32 inputs: (B, n_head, T, T).
fn softmax_scores(q: &Tensor, k: &Tensor, scale: f32, causal: bool) -> candle_core::Result<Tensor> {
    let t = q.dim(2)?;
    let mut s = (q.matmul(&k.t()?)? * scale as f64)?;
    if causal {
        let mask: Vec<f32> = (0..t * t).map(|i| if i % t > i / t { f32::NEG_INFINITY } else { 0.0 }).collect();
        s = s.broadcast_add(&Tensor::from_vec(mask, (t, t), q.device())?)?;
    }
    let e = s.broadcast_sub(&s.max_keepdim(D::Minus1)?)?.exp()?;
    e.broadcast_div(&e.sum_keepdim(D::Minus1)?)
}

/// The slow twin: the naive attention (matmul, mask, softmax, matmul; f32) and candle's autograd
/// through it, for the loss ⟨attention(q, k, v), d_o⟩. q, k, v, d_o: (B, T, n_head, d_head).
/// Returns (dq, dk, dv) in f32.
pub fn grads_slow(q: &Tensor, k: &Tensor, v: &Tensor, d_o: &Tensor, causal: bool) -> candle_core::Result<[Tensor; 3]> {
    let scale = 1.0 / (q.dim(3)? as f32).sqrt();
    let var = |x: &Tensor| Var::from_tensor(&x.to_dtype(DType::F32)?.contiguous()?);
    let (qv, kv, vv) = (var(q)?, var(k)?, var(v)?);
    let heads = |x: &Tensor| x.transpose(1, 2)?.contiguous(); // (B, n_head, T, d_head)
    let p = softmax_scores(&heads(qv.as_tensor())?, &heads(kv.as_tensor())?, scale, causal)?;
    let y = p.matmul(&heads(vv.as_tensor())?)?.transpose(1, 2)?; // (B, T, n_head, d_head)
    let loss = (y * d_o.to_dtype(DType::F32)?)?.sum_all()?;
    let grads = loss.backward()?;
    let grad = |x: &Var| grads.get(x.as_tensor()).cloned().ok_or_else(|| candle_core::Error::Msg("attention twin: no gradient".into()));
    Ok([grad(&qv)?, grad(&kv)?, grad(&vv)?])
}

/// The small version: one head's backward as scalar loops, row by row (the same equations as
/// `head_bwd_impl` without tiles or GEMMs). q, k, v, o, d_o: (T, d) rows. Returns dQ, dK, dV.
pub fn small_head_bwd(q: &[f32], k: &[f32], v: &[f32], o: &[f32], d_o: &[f32], d: usize, causal: bool) -> [Vec<f32>; 3] {
    let t = q.len() / d;
    let scale = 1.0 / (d as f32).sqrt();
    let dot = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(x, y)| x * y).sum::<f32>();
    let (mut dq, mut dk, mut dv) = (vec![0f32; t * d], vec![0f32; t * d], vec![0f32; t * d]);
    for i in 0..t {
        let (q_i, do_i) = (&q[i * d..][..d], &d_o[i * d..][..d]);
        let keys = if causal { i + 1 } else { t };
        let s: Vec<f32> = (0..keys).map(|j| scale * dot(q_i, &k[j * d..][..d])).collect();
        let m = s.iter().fold(f32::NEG_INFINITY, |a, &x| a.max(x));
        let lse = m + s.iter().map(|&x| (x - m).exp()).sum::<f32>().ln(); // L_i
        let delta = dot(do_i, &o[i * d..][..d]); // D_i = dO_i · O_i
        for (j, &s_ij) in s.iter().enumerate() {
            let p = (s_ij - lse).exp(); // P_ij
            let ds = p * (dot(do_i, &v[j * d..][..d]) - delta); // dS_ij = P_ij (dP_ij − D_i)
            for c in 0..d {
                dv[j * d + c] += p * do_i[c]; // dV_j += P_ij dO_i
                dq[i * d + c] += scale * ds * k[j * d + c]; // dQ_i += dS_ij K_j · scale
                dk[j * d + c] += scale * ds * q_i[c]; // dK_j += dS_ij Q_i · scale
            }
        }
    }
    [dq, dk, dv]
}
