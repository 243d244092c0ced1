//! Fused operations, each next to the slow twin it replaces (the twins are stage 0's primitive
//! ops; tests assert each pair agrees on random shapes).
//!
//! | fused op                        | replaces (stage 2)                                   |
//! |---------------------------------|------------------------------------------------------|
//! | `layer_norm(x, g, b, dtype)`    | mean, sub, sqr, mean, add, sqrt, div, mul, add, cast |
//! | `linear_bias(x, w, b)`          | GEMM, then a bias add                                |
//! | `linear_bias_gelu(x, w, b)`     | GEMM, bias add, then GELU's 7 element-wise ops       |
//! | `linear_bias_residual(x,w,b,r)` | GEMM, bias add, cast to f32, residual add            |
//! | `add_layer_norm(x, br, g, b)`   | cast, residual add, then LayerNorm's nine ops, cast  |
//!
//! CPU: single passes over rows (LayerNorm) and a GEMM whose destination starts out holding the
//! bias (and the residual), so `dst = 1·dst + 1·x·Wᵀ` adds them for free; GELU runs on each block
//! of output rows right after the GEMM wrote it, while it is still in cache.
//! CUDA: our two-pass LayerNorm kernel (`kernels/add_layer_norm.cu`), and cuBLASLt GEMMs with epilogues (`cuda` module):
//! bias and bias+GELU applied by the GEMM kernel before it stores, the residual read through the
//! C operand with β = 1.

use candle_core::{CpuStorage, DType, Storage, Tensor};
use rayon::prelude::*;
use stage2_sdpa::elementwise::{exp_f32, map_slice, map_slice_in_place, row_stats, Elementwise, RowStats};

/// LayerNorm's ε, as in GPT-2.
pub const LN_EPS: f32 = 1e-5;

/// Output rows per GEMM call when GELU follows: GELU reads each block after the GEMM wrote it.
/// Big blocks, because the gemm crate packs W again in every call (W is FF × C = 9 MiB at GPT-2
/// sizes). On an Intel Xeon (AVX-512, 2 cores; criterion `fused/linear_bias_gelu/fused` at
/// (2048, 768) × (3072, 768), the bare GEMM 27 ms): blocks of 256 rows took 37.4 ms, 512 rows
/// 33.6 ms, one 2048-row GEMM then one GELU pass 31.1 ms, and that with the bias added in the
/// GELU pass instead of filled in before the GEMM (β = 0: one pass over the output less, and the
/// GEMM does not read it) 28.2 ms. On the 2-core AMD development VM, 64–256-row blocks and one
/// unblocked GEMM had measured within noise of each other. Blocking only bounds a block's size
/// on big shapes (te: 16 Ki rows).
pub const GELU_ROWS: usize = 2048;

/// Rows per rayon task in the row-wise passes (the LayerNorms, fc1's bias + GELU): 16 rows of
/// C = 768 is 48 KiB, enough work (~5 µs) to amortise a task; one task per row ran 3x slower
/// than this at (2048, 768) on 2 cores.
const ROWS_PER_TASK: usize = 16;

/// LayerNorm over the last dimension, output cast to `dtype` in the same pass.
/// x: (…, C) f32; g, b: (C) f32. Per row: the statistics from one read, then normalise and
/// write while the row is in L1 (C = 768 floats is 3 KiB), instead of the seven full passes
/// over (B, T, C) that stage 0's primitive ops make (nine ops, two of them on the (B, T, 1)
/// statistics); the cast to the GEMM dtype rides along.
/// Slow twin: `stage0_baseline::layer_norm` then `to_dtype`.
pub fn layer_norm(x: &Tensor, g: &Tensor, b: &Tensor, dtype: DType) -> candle_core::Result<Tensor> {
    #[cfg(feature = "cuda")]
    if x.device().is_cuda() {
        // Our two-pass kernel (kernels/add_layer_norm.cu, `layer_norm_*`), cast fused into the
        // store: candle's LayerNorm kernel takes var = E[x²] − mean² in f32, which cancels for
        // rows with a large mean.
        return crate::cuda::layer_norm(x, g, b, dtype);
    }
    let c = x.dim(candle_core::D::Minus1)?;
    let (x32, g32, b32) = (host_f32(x)?, host_f32(g)?, host_f32(b)?);
    let ((xg, xl), (gg, gl), (bg, bl)) = (x32.storage_and_layout(), g32.storage_and_layout(), b32.storage_and_layout());
    let (xs, gs, bs) = (f32_slice(&xg, xl)?, f32_slice(&gg, gl)?, f32_slice(&bg, bl)?);
    let mut out = vec![0f32; xs.len()];
    let rows = ROWS_PER_TASK * c;
    out.par_chunks_mut(rows).zip(xs.par_chunks(rows)).for_each(|(o, x)| {
        o.chunks_mut(c).zip(x.chunks(c)).for_each(|(o, row)| normalise_row(row, gs, bs, o));
    });
    cast(Tensor::from_vec(out, x.shape(), x.device())?, dtype)
}

/// The worked example: residual add and LayerNorm in one pass, returning the new residual
/// stream x + branch (f32) and its normalised copy h (in branch's dtype, ready for the next GEMM).
/// CUDA: our NVRTC kernel `kernels/add_layer_norm.cu` (one launch). CPU: one pass per row.
/// Slow twin: `x + branch.to_dtype(f32)`, then `stage0_baseline::layer_norm`, then `to_dtype`.
pub fn add_layer_norm(x: &Tensor, branch: &Tensor, g: &Tensor, b: &Tensor) -> candle_core::Result<(Tensor, Tensor)> {
    if x.dims() != branch.dims() || x.dtype() != DType::F32 {
        candle_core::bail!("add_layer_norm: x {:?} ({:?}) and branch {:?} must match, x in f32", x.dims(), x.dtype(), branch.dims());
    }
    #[cfg(feature = "cuda")]
    if x.device().is_cuda() {
        return crate::cuda::add_layer_norm(x, branch, g, b);
    }
    let c = x.dim(candle_core::D::Minus1)?;
    let (x32, br32, g32, b32) = (host_f32(x)?, host_f32(branch)?, host_f32(g)?, host_f32(b)?);
    let ((xg, xl), (brg, brl)) = (x32.storage_and_layout(), br32.storage_and_layout());
    let ((gg, gl), (bg, bl)) = (g32.storage_and_layout(), b32.storage_and_layout());
    let (xs, brs, gs, bs) = (f32_slice(&xg, xl)?, f32_slice(&brg, brl)?, f32_slice(&gg, gl)?, f32_slice(&bg, bl)?);
    let (mut x_out, mut h_out) = (vec![0f32; xs.len()], vec![0f32; xs.len()]);
    let rows = ROWS_PER_TASK * c;
    x_out.par_chunks_mut(rows).zip(h_out.par_chunks_mut(rows)).zip(xs.par_chunks(rows).zip(brs.par_chunks(rows))).for_each(
        |((xo, ho), (xr, br))| {
            for (((xo, ho), xr), br) in xo.chunks_mut(c).zip(ho.chunks_mut(c)).zip(xr.chunks(c)).zip(br.chunks(c)) {
                map_slice(xo, xr, &|i, a| a + br[i]); // the new residual stream
                normalise_row(xo, gs, bs, ho);
            }
        },
    );
    let x_new = Tensor::from_vec(x_out, x.shape(), x.device())?;
    let h = cast(Tensor::from_vec(h_out, x.shape(), x.device())?, branch.dtype())?;
    Ok((x_new, h))
}

/// h = (row − mean) / √(var + ε) · g + b, the statistics from one read of the row
/// (`stage2_sdpa::elementwise::row_stats`: shifted sums in f64, accurate for rows with a large mean),
/// then one vectorised write pass while the row is in L1 (`map_slice` dispatches to AVX-512/AVX2).
#[inline]
fn normalise_row(row: &[f32], g: &[f32], b: &[f32], h: &mut [f32]) {
    let RowStats { shift, shift_minus_mean, inv_std } = row_stats(row, LN_EPS as f64);
    map_slice(h, row, &|i, v| ((v - shift) + shift_minus_mean) * inv_std * g[i] + b[i]);
}

/// A cast in parallel on the CPU (candle's is one thread); a no-op when the dtype is already right.
fn cast(t: Tensor, dtype: DType) -> candle_core::Result<Tensor> {
    stage2_sdpa::elementwise::to_dtype(&t, dtype, Elementwise::Parallel)
}

/// y = x Wᵀ + b. x: (B, T, K); W: (N, K); b: (N). Output in x's dtype.
/// Slow twin: `stage0_baseline::linear`.
pub fn linear_bias(x: &Tensor, w: &Tensor, b: &Tensor) -> candle_core::Result<Tensor> {
    linear(x, w, b, Epilogue::Bias)
}

/// y = gelu_tanh(x Wᵀ + b). Slow twin: `stage0_baseline::gelu_tanh(&linear(x, w, b))`.
pub fn linear_bias_gelu(x: &Tensor, w: &Tensor, b: &Tensor) -> candle_core::Result<Tensor> {
    linear(x, w, b, Epilogue::BiasGelu)
}

/// y = r + x Wᵀ + b, in r's dtype (the f32 residual stream).
/// Slow twin: `r + stage0_baseline::linear(x, w, b).to_dtype(r.dtype())`.
pub fn linear_bias_residual(x: &Tensor, w: &Tensor, b: &Tensor, r: &Tensor) -> candle_core::Result<Tensor> {
    linear(x, w, b, Epilogue::BiasResidual(r))
}

/// What the GEMM adds or applies before its result is stored.
#[derive(Clone, Copy)]
pub enum Epilogue<'a> {
    Bias,
    BiasGelu,
    BiasResidual(&'a Tensor),
}

fn linear(x: &Tensor, w: &Tensor, b: &Tensor, epilogue: Epilogue) -> candle_core::Result<Tensor> {
    let (bsz, t, k) = x.dims3()?;
    let (n, k_w) = w.dims2()?;
    if k != k_w || b.dims() != [n] {
        candle_core::bail!("linear: x {:?}, W {:?}, b {:?} do not fit y = x Wᵀ + b", x.dims(), w.dims(), b.dims());
    }
    if let Epilogue::BiasResidual(r) = epilogue {
        if r.dims() != [bsz, t, n] {
            candle_core::bail!("linear: residual {:?} is not the output shape ({bsz}, {t}, {n})", r.dims());
        }
    }
    #[cfg(feature = "cuda")]
    if x.device().is_cuda() {
        return crate::cuda::linear(x, w, b, epilogue);
    }
    linear_cpu(x, w, b, epilogue, (bsz * t, n, k))
}

/// The CPU path: the destination is filled with the bias (plus the residual) row by row, then
/// the GEMM accumulates into it: dst = 1·dst + 1·x·Wᵀ. bf16/f16 operands are widened to f32
/// first, as candle's own CPU matmul does (there is no bf16 GEMM kernel on CPU).
fn linear_cpu(x: &Tensor, w: &Tensor, b: &Tensor, epilogue: Epilogue, (m, n, k): (usize, usize, usize)) -> candle_core::Result<Tensor> {
    let (x32, w32, b32) = (host_f32(x)?, host_f32(w)?, host_f32(b)?);
    let ((xg, xl), (wg, wl), (bg, bl)) = (x32.storage_and_layout(), w32.storage_and_layout(), b32.storage_and_layout());
    let (xs, ws, bs) = (f32_slice(&xg, xl)?, f32_slice(&wg, wl)?, f32_slice(&bg, bl)?);
    let mut out = vec![0f32; m * n];
    match epilogue {
        Epilogue::BiasResidual(r) => {
            let r32 = host_f32(r)?;
            let (rg, rl) = r32.storage_and_layout();
            let rs = f32_slice(&rg, rl)?;
            out.par_chunks_mut(n).zip(rs.par_chunks(n)).for_each(|(o, r)| map_slice(o, r, &|i, r| r + bs[i]));
        }
        Epilogue::Bias => out.par_chunks_mut(n).for_each(|o| o.copy_from_slice(bs)),
        Epilogue::BiasGelu => {} // the bias goes in with GELU, after the GEMM
    }
    let gelu = matches!(epilogue, Epilogue::BiasGelu);
    let rows = if gelu { GELU_ROWS } else { m };
    for r0 in (0..m).step_by(rows) {
        let mb = rows.min(m - r0);
        let dst = &mut out[r0 * n..(r0 + mb) * n];
        // GELU: the GEMM overwrites dst (β = 0: it never reads the zeros), then one pass adds the
        // bias and applies GELU; otherwise it accumulates onto the bias (and residual) rows.
        gemm_into(dst, &xs[r0 * k..(r0 + mb) * k], ws, (mb, n, k), !gelu);
        if gelu {
            // y = gelu(acc + b), on all threads, SIMD (gelu_tanh has no libm call)
            dst.par_chunks_mut(ROWS_PER_TASK * n).for_each(|block| {
                for row in block.chunks_exact_mut(n) {
                    map_slice_in_place(row, &|j, v| gelu_tanh(v + bs[j]));
                }
            });
        }
    }
    let out_dtype = match epilogue {
        Epilogue::BiasResidual(r) => r.dtype(),
        _ => x.dtype(),
    };
    cast(Tensor::from_vec(out, (m / x.dim(1)?, x.dim(1)?, n), x.device())?, out_dtype)
}

/// dst (m × n, row-major) = x (m × k, row-major) · Wᵀ (+ dst when `accumulate`), W (n × k,
/// row-major). With the `mkl` feature: MKL's sgemm (β = 1 accumulates onto dst, β = 0 overwrites it), the library candle's matmul uses in that
/// build, so stage 3 runs the same GEMM as stages 0–2. (MKL could also pre-pack W once in
/// `build` with cblas_sgemm_pack; not done here, see docs/cpu.md.)
#[cfg(feature = "mkl")]
fn gemm_into(dst: &mut [f32], x: &[f32], w: &[f32], (m, n, k): (usize, usize, usize), accumulate: bool) {
    extern "C" {
        // MKL's CBLAS, linked by intel-mkl-src through candle-core's `mkl` feature.
        fn cblas_sgemm(
            layout: i32,
            transa: i32,
            transb: i32,
            m: i32,
            n: i32,
            k: i32,
            alpha: f32,
            a: *const f32,
            lda: i32,
            b: *const f32,
            ldb: i32,
            beta: f32,
            c: *mut f32,
            ldc: i32,
        );
    }
    const ROW_MAJOR: i32 = 101;
    const NO_TRANS: i32 = 111;
    const TRANS: i32 = 112;
    assert!(dst.len() == m * n && x.len() == m * k && w.len() == n * k, "gemm operands sized by the caller");
    let dim = |v: usize| i32::try_from(v).expect("GEMM dimension fits MKL's 32-bit (LP64) interface");
    // SAFETY: the slices hold exactly m·n, m·k and n·k elements (asserted above), row-major with
    // leading dimensions k (x), k (W, read transposed) and n (dst); dst is unique.
    unsafe {
        cblas_sgemm(
            ROW_MAJOR,
            NO_TRANS,
            TRANS,
            dim(m),
            dim(n),
            dim(k),
            1.0,
            x.as_ptr(),
            dim(k),
            w.as_ptr(),
            dim(k),
            if accumulate { 1.0 } else { 0.0 },
            dst.as_mut_ptr(),
            dim(n),
        )
    }
}

/// dst (m × n, row-major) = x (m × k, row-major) · Wᵀ (+ dst when `accumulate`), W (n × k,
/// row-major), via the gemm crate (candle's own CPU GEMM): W is read as the k × n right-hand side
/// with column stride k.
#[cfg(not(feature = "mkl"))]
fn gemm_into(dst: &mut [f32], x: &[f32], w: &[f32], (m, n, k): (usize, usize, usize), accumulate: bool) {
    let threads = candle_core::utils::get_num_threads();
    let parallelism = if threads > 1 { gemm::Parallelism::Rayon(threads) } else { gemm::Parallelism::None };
    assert!(dst.len() == m * n && x.len() == m * k && w.len() == n * k, "gemm operands sized by the caller");
    // SAFETY: the three slices hold exactly m·n, m·k and n·k elements (asserted above) and the
    // strides below address them row-major, so every access is in bounds; dst is unique.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            1,          // dst column stride
            n as isize, // dst row stride
            accumulate, // read dst: it holds the bias (and residual) to accumulate onto
            x.as_ptr(),
            1,
            k as isize,
            w.as_ptr(),
            k as isize, // rhs[kk][j] = W[j][kk]: next column is the next row of W
            1,
            1.0, // alpha: dst keeps its value (when read)
            1.0, // beta: + x·Wᵀ
            false,
            false,
            false,
            parallelism,
        )
    }
}

/// GPT-2's GELU, tanh approximation: 0.5·v·(1 + tanh(u)), u = √(2/π)·(v + 0.044715·v³).
/// Since 1 + tanh(u) = 2·sigmoid(2u), this is v / (1 + e^(−2u)): one exp and one division,
/// about three times cheaper than libm's tanhf, and exact in the limits (v→±∞ gives v or −0).
/// The exp is `stage2_sdpa::elementwise::exp_f32` (no libm call), so loops over GELU vectorise.
#[inline(always)]
pub fn gelu_tanh(v: f32) -> f32 {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    let u = SQRT_2_OVER_PI * (v + 0.044715 * v * v * v);
    v / (1.0 + exp_f32(-2.0 * u))
}

/// `t` as contiguous f32 on the host: the same tensor when it already is (no copy), else a
/// widened/compacted copy. Borrow its values with `f32_slice`.
pub(crate) fn host_f32(t: &Tensor) -> candle_core::Result<Tensor> {
    cast(t.contiguous()?, DType::F32)
}

/// The values of a contiguous f32 CPU tensor's storage, borrowed from its read guard.
pub(crate) fn f32_slice<'a>(storage: &'a Storage, layout: &candle_core::Layout) -> candle_core::Result<&'a [f32]> {
    match (storage, layout.contiguous_offsets()) {
        (Storage::Cpu(CpuStorage::F32(v)), Some((start, end))) => Ok(&v[start..end]),
        _ => candle_core::bail!("expected a contiguous f32 CPU tensor"),
    }
}
