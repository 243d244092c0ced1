//! The backward passes of `ops`' fused ops: each is the `bwd` of its candle op, so
//! `loss.backward()` through the block runs them; each sits here beside its slow twin, candle's
//! autograd through the op's plain-ops twin (`grads_of` on `ops::*_slow`), and a test asserts
//! they agree on random shapes.
//!
//! | fused op               | its backward                                          | GEMMs after         |
//! |------------------------|-------------------------------------------------------|---------------------|
//! | `layer_norm`           | `layer_norm_bwd`: one pass per row of x and dy        | —                   |
//! | `linear_bias`          | `bias_bwd`: db = Σ_rows dy, one pass                  | dx = dy·W, dW = dyᵀ·x |
//! | `linear_bias_gelu`     | `bias_gelu_bwd`: dz = dy ∘ gelu′(z), db = Σ_rows dz, one pass | dx = dz·W, dW = dzᵀ·x |
//! | `linear_bias_residual` | `linear_bias`'s, and dr = dy through candle's add     | as `linear_bias`    |
//! | `add_layer_norm`       | `layer_norm_bwd`, and candle's add                    | —                   |
//! | `mlp` (fc1, fc2 paired)| fc2's: db₂, then dz₁ = gelu′(z) ∘ (dy·W₂), db₁; fc1's: db₁ from fc2's | dx, dW per linear |
//!
//! The element-wise backward work rides on one read of the output gradient, as the forward's
//! epilogues ride on the GEMM's output: the primitive ops' autograd makes a pass per op (GELU's
//! nine, LayerNorm's nine, a reduction for the bias). The two GEMMs per linear run on the engine's
//! bf16 GEMM when the forward's did (`linear_bwd`: operands read where they lie, f32
//! accumulation), candle's f32 matmul otherwise; gradients return in the operands' dtype.
//!
//! On CUDA the element-wise work of the linears' backward rides on cuBLASLt's GEMMs (`cuda_lt`):
//! every weight-gradient GEMM writes db with the BGRADB epilogue, and inside `ops::mlp` fc2's
//! data-gradient GEMM writes dz₁ and db₁ with DGELU_BGRAD, at the z fc1's forward kept
//! (GELU_AUX_BIAS). LayerNorm's backward is one kernel (`cuda::layer_norm_bwd`,
//! `kernels/add_layer_norm.cu`: dx and per-block partial sums of dg and db, which a column sum
//! finishes); its candle-ops twin (`layer_norm_bwd_ops`) runs on devices without it. Bias +
//! GELU's backward outside `mlp` runs as candle ops (`bias_gelu_bwd_ops`, which recomputes
//! z = x·Wᵀ + b: a lone `linear_bias_gelu` keeps none on CUDA), correct on any device and tested
//! against the CPU's passes.

use crate::ops::{f32_values, ROWS_PER_TASK};
use candle_core::{CpuStorage, DType, Device, Storage, Tensor, Var, D};
use cpu_kernels::bf16_gemm::{self, Kernel, MatRef, Operand};
use cpu_kernels::elementwise::{bias_gelu_tanh_grad, row_stats, uninit_of, RowStats};
use rayon::prelude::*;

// ---------------------------------------------------------------------------------------------
// LayerNorm
// ---------------------------------------------------------------------------------------------

/// LayerNorm's backward. x: (…, C) f32; g: (C) f32; dy: x's shape, any float dtype. Per row
/// (x̂ = (x − mean)/σ, σ = √(var + ε), from the same one-read statistics as the forward):
///
/// ```text
/// dx = (1/σ) · (g∘dy − mean(g∘dy) − x̂ · mean(g∘dy∘x̂))
/// dg = Σ_rows dy∘x̂        db = Σ_rows dy
/// ```
///
/// One read of the row for the two means (and its share of dg, db), one write of dx while the
/// row is in L1; dg and db as per-thread partial sums, added at the end. Returns (dx, dg, db), f32.
pub fn layer_norm_bwd(x: &Tensor, g: &Tensor, dy: &Tensor, eps: f32) -> candle_core::Result<[Tensor; 3]> {
    layer_norm_bwd_plus(x, g, dy, eps, None)
}

/// `layer_norm_bwd` with `plus` (x's shape, f32) added to dx in the same pass: the gradient the
/// residual stream carries past the LayerNorm, so a hand-scheduled backward adds the two branches
/// without a pass of its own.
pub fn layer_norm_bwd_plus(x: &Tensor, g: &Tensor, dy: &Tensor, eps: f32, plus: Option<&Tensor>) -> candle_core::Result<[Tensor; 3]> {
    if let Some(p) = plus {
        if p.dims() != x.dims() {
            candle_core::bail!("layer_norm backward: the added gradient {:?} is not x's shape {:?}", p.dims(), x.dims());
        }
    }
    #[cfg(feature = "cuda")]
    if x.device().is_cuda() {
        cpu_kernels::trace::ran("layer_norm backward: kernels/add_layer_norm.cu (layer_norm_bwd)");
        return crate::cuda::layer_norm_bwd(x, g, dy, eps, plus);
    }
    if !x.device().is_cpu() {
        let [dx, dg, db] = layer_norm_bwd_ops(x, g, dy, eps)?;
        return Ok([plus.map_or(Ok(dx.clone()), |p| dx + p.to_dtype(DType::F32)?)?, dg, db]);
    }
    let c = x.dim(D::Minus1)?;
    cpu_kernels::trace::ran(if plus.is_some() {
        "layer_norm backward: one pass, + the residual's gradient"
    } else {
        "layer_norm backward: one pass"
    });
    let (dx, dg, db) = with_f32(x, |x| {
        with_f32(g, |g| {
            with_f32(dy, |dy| {
                with_f32_opt(plus, |plus| {
                    // SAFETY: every row of dx is written whole by `layer_norm_row_bwd` before any read.
                    let mut dx = unsafe { uninit_of::<f32>(x.len()) };
                    let rows = ROWS_PER_TASK * c;
                    let zeros = || (vec![0f32; c], vec![0f32; c]);
                    let (dg, db) = dx
                        .par_chunks_mut(rows)
                        .zip(x.par_chunks(rows).zip(dy.par_chunks(rows)))
                        .enumerate()
                        .fold(zeros, |(mut dg, mut db), (i, (dx, (x, dy)))| {
                            let plus = plus.map(|p| &p[i * rows..i * rows + x.len()]);
                            for (r, ((dx, x), dy)) in dx.chunks_mut(c).zip(x.chunks(c)).zip(dy.chunks(c)).enumerate() {
                                layer_norm_row_bwd(x, g, dy, eps, plus.map(|p| &p[r * c..(r + 1) * c]), dx, &mut dg, &mut db);
                            }
                            (dg, db)
                        })
                        .reduce(zeros, |(a_g, a_b), (b_g, b_b)| (add(a_g, &b_g), add(a_b, &b_b)));
                    Ok((dx, dg, db))
                })
            })
        })
    })?;
    Ok([Tensor::from_vec(dx, x.shape(), &Device::Cpu)?, Tensor::from_vec(dg, c, &Device::Cpu)?, Tensor::from_vec(db, c, &Device::Cpu)?])
}

/// One row of `layer_norm_bwd`: dx written (plus `plus`'s row, if any), the row's dy∘x̂ and dy
/// added into dg and db.
#[inline]
#[allow(clippy::too_many_arguments)] // the row's inputs, its output, and the two running sums
fn layer_norm_row_bwd(x: &[f32], g: &[f32], dy: &[f32], eps: f32, plus: Option<&[f32]>, dx: &mut [f32], dg: &mut [f32], db: &mut [f32]) {
    let RowStats { shift, shift_minus_mean, inv_std } = row_stats(x, eps as f64);
    // x̂ as the forward's normalise_row computes it; the two row sums in 16 independent lanes
    // each, so the loop vectorises (one running sum makes every add wait for the last).
    let xhat = |v: f32| ((v - shift) + shift_minus_mean) * inv_std;
    let (mut sum_gdy, mut sum_gdy_xhat) = ([0f32; 16], [0f32; 16]);
    let whole = x.len() / 16 * 16;
    for i0 in (0..whole).step_by(16) {
        for l in 0..16 {
            let i = i0 + l;
            let (xh, gdy) = (xhat(x[i]), g[i] * dy[i]);
            sum_gdy[l] += gdy;
            sum_gdy_xhat[l] += gdy * xh;
            dg[i] += dy[i] * xh; // dg = Σ_rows dy∘x̂
            db[i] += dy[i]; // db = Σ_rows dy
        }
    }
    for i in whole..x.len() {
        let (xh, gdy) = (xhat(x[i]), g[i] * dy[i]);
        sum_gdy[0] += gdy;
        sum_gdy_xhat[0] += gdy * xh;
        dg[i] += dy[i] * xh;
        db[i] += dy[i];
    }
    let n = x.len() as f32;
    let (mean_gdy, mean_gdy_xhat) = (sum_gdy.iter().sum::<f32>() / n, sum_gdy_xhat.iter().sum::<f32>() / n);
    // dx = (g∘dy − mean(g∘dy) − x̂·mean(g∘dy∘x̂)) / σ
    match plus {
        None => (0..x.len()).for_each(|i| dx[i] = inv_std * (g[i] * dy[i] - mean_gdy - xhat(x[i]) * mean_gdy_xhat)),
        Some(p) => (0..x.len()).for_each(|i| dx[i] = inv_std * (g[i] * dy[i] - mean_gdy - xhat(x[i]) * mean_gdy_xhat) + p[i]),
    }
}

/// `layer_norm_bwd` as candle ops, on any device (what CUDA runs): the same equations, a pass
/// per op.
pub fn layer_norm_bwd_ops(x: &Tensor, g: &Tensor, dy: &Tensor, eps: f32) -> candle_core::Result<[Tensor; 3]> {
    let c = x.dim(D::Minus1)?;
    let (x, dy) = (x.to_dtype(DType::F32)?, dy.to_dtype(DType::F32)?);
    let xc = x.broadcast_sub(&x.mean_keepdim(D::Minus1)?)?;
    let inv_std = (xc.sqr()?.mean_keepdim(D::Minus1)? + eps as f64)?.sqrt()?.recip()?; // (…, 1)
    let xhat = xc.broadcast_mul(&inv_std)?;
    let gdy = dy.broadcast_mul(g)?;
    let proj = xhat.broadcast_mul(&(&gdy * &xhat)?.mean_keepdim(D::Minus1)?)?; // x̂ · mean(g∘dy∘x̂)
    let dx = (gdy.broadcast_sub(&gdy.mean_keepdim(D::Minus1)?)? - proj)?.broadcast_mul(&inv_std)?;
    let rows = |t: Tensor| t.reshape(((), c))?.sum(0); // Σ over every row: (C)
    Ok([dx, rows((&dy * &xhat)?)?, rows(dy)?])
}

// ---------------------------------------------------------------------------------------------
// Linear layers: the epilogue's backward, then two GEMMs
// ---------------------------------------------------------------------------------------------

/// The bias epilogue's backward: dz = dy as it is (no copy), db = Σ_rows dy in one parallel pass
/// on the CPU. dy: (B, T, N). Returns (dz, db), db (N) f32.
pub fn bias_bwd(dy: &Tensor) -> candle_core::Result<(Tensor, Tensor)> {
    let n = dy.dim(D::Minus1)?;
    if !dy.device().is_cpu() {
        return Ok((dy.clone(), dy.to_dtype(DType::F32)?.reshape(((), n))?.sum(0)?));
    }
    cpu_kernels::trace::ran("bias backward: one pass");
    let db = with_f32(dy, |dy| Ok(column_sums(dy, n)))?;
    Ok((dy.clone(), Tensor::from_vec(db, n, &Device::Cpu)?))
}

/// Bias + GELU's backward in one pass over dy: z = x·Wᵀ + b (x·Wᵀ kept by the forward, `pre_gelu`,
/// (B·T, N) f32), dz = dy ∘ gelu′(z), db = Σ_rows dz. dy: (B, T, N); x: (B, T, K); W: (N, K);
/// b: (N). Returns (dz, db) f32. Off the CPU, `bias_gelu_bwd_ops`: a lone `linear_bias_gelu` runs
/// cuBLASLt's GELU_BIAS epilogue, which keeps no pre-activation, so z is recomputed there (one more
/// GEMM instead of a stored (B·T, N) tensor); the block's fc1 trains through `ops::mlp` instead.
pub fn bias_gelu_bwd(dy: &Tensor, pre_gelu: Option<&[f32]>, x: &Tensor, w: &Tensor, b: &Tensor) -> candle_core::Result<(Tensor, Tensor)> {
    if !dy.device().is_cpu() {
        return bias_gelu_bwd_ops(dy, x, w, b);
    }
    let Some(acc) = pre_gelu else { candle_core::bail!("linear_bias_gelu: backward without the forward's x·Wᵀ (recorded untracked?)") };
    let n = dy.dim(D::Minus1)?;
    cpu_kernels::trace::ran("bias+gelu backward: one pass");
    let (dz, db) = with_f32(dy, |dy| {
        with_f32(b, |b| {
            if acc.len() != dy.len() || b.len() != n {
                candle_core::bail!("linear_bias_gelu: kept x·Wᵀ has {} values, dy {}, b {} (N = {n})", acc.len(), dy.len(), b.len());
            }
            // SAFETY: every element of dz is written by the pass below before any read.
            let mut dz = unsafe { uninit_of::<f32>(dy.len()) };
            let rows = ROWS_PER_TASK * n;
            let db = dz
                .par_chunks_mut(rows)
                .zip(dy.par_chunks(rows).zip(acc.par_chunks(rows)))
                .fold(
                    || vec![0f32; n],
                    |mut db, (dz, (dy, acc))| {
                        for ((dz, dy), acc) in dz.chunks_mut(n).zip(dy.chunks(n)).zip(acc.chunks(n)) {
                            // dz = dy ∘ gelu′(x·Wᵀ + b), db = Σ_rows dz: the engine's SIMD row
                            bias_gelu_tanh_grad(dy, acc, b, dz, &mut db);
                        }
                        db
                    },
                )
                .reduce(|| vec![0f32; n], |a, b| add(a, &b));
            Ok((dz, db))
        })
    })?;
    Ok((Tensor::from_vec(dz, dy.shape(), &Device::Cpu)?, Tensor::from_vec(db, n, &Device::Cpu)?))
}

/// `bias_gelu_bwd` as candle ops, on any device (what CUDA runs outside `ops::mlp`): z = x·Wᵀ + b recomputed in f32,
/// then `gelu_tanh_grad`'s expression, a pass per op.
pub fn bias_gelu_bwd_ops(dy: &Tensor, x: &Tensor, w: &Tensor, b: &Tensor) -> candle_core::Result<(Tensor, Tensor)> {
    let (bsz, t, k) = x.dims3()?;
    let n = w.dim(0)?;
    let x2 = x.to_dtype(DType::F32)?.reshape((bsz * t, k))?;
    let z = x2.matmul(&w.to_dtype(DType::F32)?.t()?)?.broadcast_add(&b.to_dtype(DType::F32)?)?; // (B·T, N)
    let dz = (dy.to_dtype(DType::F32)?.reshape((bsz * t, n))? * gelu_tanh_grad_ops(&z)?)?;
    let db = dz.sum(0)?;
    Ok((dz.reshape((bsz, t, n))?, db))
}

/// `gelu_tanh_grad` as candle ops on a tensor of pre-activations z, any device (a pass per op).
pub fn gelu_tanh_grad_ops(z: &Tensor) -> candle_core::Result<Tensor> {
    const SQRT_2_OVER_PI: f64 = 0.797_884_560_802_865_4;
    let u = ((z + z.powf(3.0)? * 0.044715)? * SQRT_2_OVER_PI)?;
    let s = ((u * -2.0)?.exp()? + 1.0)?.recip()?; // σ(2u)
    let ds = (((z.sqr()? * (3.0 * 0.044715))? + 1.0)? * (2.0 * SQRT_2_OVER_PI))?; // d(2u)/dz
    &s + ((z * &s)? * (1.0 - &s)?)? * ds // gelu′(z)
}

/// d/dv of `ops::gelu_tanh` (the engine's scalar form, which its SIMD row follows): tested
/// against a central difference below.
pub use cpu_kernels::elementwise::gelu_tanh_grad;

/// The two GEMMs of a linear's backward: dx = dz·W ((B·T, N)·(N, K)) and dW = dzᵀ·x
/// ((N, B·T)·(B·T, K)). x: (B, T, K); W: (N, K); dz: (B, T, N). Returns dx and dW in x's and W's
/// dtypes.
///
/// When the forward's products were bf16 (bf16 operands, or f32 masters with `bf16_master`) and
/// this CPU's bf16 unit runs the engine's kernel, both are the engine's bf16 GEMMs, as autocast
/// runs them: f32 accumulation, each operand read where it lies and rounded to bf16 as it is
/// packed — W untransposed as B, dz transposed as A (both in memory order), x as B — so no
/// (B·T, ·) tensor is widened or copied first. Otherwise (fp32, f16, a CPU without a bf16
/// unit) candle's matmuls in f32.
pub fn linear_bwd(x: &Tensor, w: &Tensor, dz: &Tensor, bf16_master: bool) -> candle_core::Result<(Tensor, Tensor)> {
    let (dx, dw) = linear_bwd_f32(x, w, dz, bf16_master)?;
    let cast = |v: Tensor, dt: DType| cpu_kernels::elementwise::to_dtype(&v, dt, cpu_kernels::elementwise::Elementwise::Parallel);
    Ok((cast(dx, x.dtype())?, cast(dw, w.dtype())?))
}

/// `linear_bwd` with dx and dW in f32 whatever x's and W's dtypes: a hand-scheduled backward
/// (`scheduled`) keeps x in bf16 where the GEMMs round it anyway, and its gradient in f32.
pub fn linear_bwd_f32(x: &Tensor, w: &Tensor, dz: &Tensor, bf16_master: bool) -> candle_core::Result<(Tensor, Tensor)> {
    let (bsz, t, k) = x.dims3()?;
    let n = w.dim(0)?;
    let m = bsz * t;
    let kernel = Kernel::detect();
    let bf16 = bf16_master || [x, w].iter().any(|t| t.dtype() == DType::BF16);
    let ours = |t: &Tensor| matches!(t.dtype(), DType::F32 | DType::BF16);
    if x.device().is_cpu() && bf16 && kernel.is_native() && [x, w, dz].into_iter().all(ours) {
        cpu_kernels::trace::ran_with(|| format!("linear backward: gemm bf16 ×2 ({})", kernel.name()));
        let (xc, wc, dzc) = (x.contiguous()?, w.contiguous()?, dz.contiguous()?);
        // SAFETY: both GEMMs overwrite their output whole (not accumulating; a zero-length K
        // writes zeros), so neither buffer is read before it is written.
        let (mut dx, mut dw) = unsafe { (uninit_of::<f32>(m * k), uninit_of::<f32>(n * k)) };
        with_vals(&dzc, |dzv| {
            with_vals(&wc, |wv| gemm_vals(kernel, &mut dx, (dzv, m, n, false), (wv, n, k)))?; // dx = dz·W
            with_vals(&xc, |xv| gemm_vals(kernel, &mut dw, (dzv, m, n, true), (xv, m, k)))
            // dW = dzᵀ·x
        })?;
        return Ok((Tensor::from_vec(dx, (bsz, t, k), &Device::Cpu)?, Tensor::from_vec(dw, (n, k), &Device::Cpu)?));
    }
    cpu_kernels::trace::ran("linear backward: candle matmul f32 ×2");
    let dz = dz.to_dtype(DType::F32)?.reshape((m, n))?; // (B·T, N)
    let dx = dz.matmul(&w.to_dtype(DType::F32)?)?.reshape((bsz, t, k))?;
    let dw = dz.t()?.matmul(&x.to_dtype(DType::F32)?.reshape((m, k))?)?;
    Ok((dx, dw))
}

/// A contiguous CPU tensor's values, f32 or bf16, where they lie.
#[derive(Clone, Copy)]
enum Vals<'a> {
    F32(&'a [f32]),
    Bf16(&'a [half::bf16]),
}

fn with_vals<R>(t: &Tensor, f: impl FnOnce(Vals) -> candle_core::Result<R>) -> candle_core::Result<R> {
    let (s, l) = t.storage_and_layout();
    match (&*s, l.contiguous_offsets()) {
        (Storage::Cpu(CpuStorage::F32(v)), Some((a, b))) => f(Vals::F32(&v[a..b])),
        (Storage::Cpu(CpuStorage::BF16(v)), Some((a, b))) => f(Vals::Bf16(&v[a..b])),
        _ => candle_core::bail!("linear backward: expected a contiguous f32 or bf16 CPU tensor, got {:?}", t.dtype()),
    }
}

/// c = a · b on the engine's bf16 `kernel`, all threads: a is a row-major (rows × cols) matrix,
/// read transposed when `t`; b a row-major (rows × cols) matrix.
fn gemm_vals(
    kernel: Kernel,
    c: &mut [f32],
    (a, ar, ac, t): (Vals, usize, usize, bool),
    (b, br, bc): (Vals, usize, usize),
) -> candle_core::Result<()> {
    fn view<T: Operand>(v: &[T], rows: usize, cols: usize, t: bool) -> MatRef<'_, T> {
        let m = MatRef::row_major(v, rows, cols);
        if t {
            m.t()
        } else {
            m
        }
    }
    match (a, b) {
        (Vals::F32(a), Vals::F32(b)) => bf16_gemm::gemm(kernel, c, view(a, ar, ac, t), view(b, br, bc, false), false, true),
        (Vals::F32(a), Vals::Bf16(b)) => bf16_gemm::gemm(kernel, c, view(a, ar, ac, t), view(b, br, bc, false), false, true),
        (Vals::Bf16(a), Vals::F32(b)) => bf16_gemm::gemm(kernel, c, view(a, ar, ac, t), view(b, br, bc, false), false, true),
        (Vals::Bf16(a), Vals::Bf16(b)) => bf16_gemm::gemm(kernel, c, view(a, ar, ac, t), view(b, br, bc, false), false, true),
    }
    .map_err(candle_core::Error::Msg)
}

// ---------------------------------------------------------------------------------------------
// The slow twin, and helpers
// ---------------------------------------------------------------------------------------------

/// Gradients of the loss Σ_i ⟨f(inputs)_i, upstream_i⟩ with respect to each input, by candle's
/// autograd: with `ops::*_slow` as f, the slow twin of every backward in this file (with the
/// fused op as f, what `bwd` computes). Returns one gradient per input (zeros where none flows).
pub fn grads_of(
    inputs: &[&Tensor],
    f: impl Fn(&[Tensor]) -> candle_core::Result<Vec<Tensor>>,
    upstream: &[&Tensor],
) -> candle_core::Result<Vec<Tensor>> {
    let vars = inputs.iter().map(|t| Var::from_tensor(&t.copy()?)).collect::<candle_core::Result<Vec<_>>>()?;
    let outputs = f(&vars.iter().map(|v| v.as_tensor().clone()).collect::<Vec<_>>())?;
    let mut loss = Tensor::zeros((), DType::F32, &inputs[0].device().clone())?;
    for (y, dy) in outputs.iter().zip(upstream) {
        loss = (loss + (y.to_dtype(DType::F32)? * dy.to_dtype(DType::F32)?)?.sum_all()?)?;
    }
    let grads = loss.backward()?;
    vars.iter().map(|v| grads.get(v.as_tensor()).cloned().map_or_else(|| v.as_tensor().zeros_like(), Ok)).collect()
}

/// `f` on the values of a CPU tensor as f32 (its storage borrowed when it is f32 and contiguous).
fn with_f32<R>(t: &Tensor, f: impl FnOnce(&[f32]) -> candle_core::Result<R>) -> candle_core::Result<R> {
    let t = t.contiguous()?;
    let (s, l) = t.storage_and_layout();
    let Storage::Cpu(s) = &*s else { candle_core::bail!("backward: {:?} is not on the CPU", t.device().location()) };
    f(&f32_values(s, l, "backward input")?)
}

/// `with_f32` on an optional tensor.
fn with_f32_opt<R>(t: Option<&Tensor>, f: impl FnOnce(Option<&[f32]>) -> candle_core::Result<R>) -> candle_core::Result<R> {
    match t {
        Some(t) => with_f32(t, |v| f(Some(v))),
        None => f(None),
    }
}

/// Σ over the rows of a (rows, n) matrix: per-thread partial sums over blocks of rows, then added.
fn column_sums(v: &[f32], n: usize) -> Vec<f32> {
    v.par_chunks(ROWS_PER_TASK * n)
        .fold(
            || vec![0f32; n],
            |mut acc, block| {
                block.chunks(n).for_each(|row| acc.iter_mut().zip(row).for_each(|(a, x)| *a += x));
                acc
            },
        )
        .reduce(|| vec![0f32; n], |a, b| add(a, &b))
}

fn add(mut a: Vec<f32>, b: &[f32]) -> Vec<f32> {
    a.iter_mut().zip(b).for_each(|(x, y)| *x += y);
    a
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops;
    use shared::weights::SplitMix64;

    fn randn(dims: &[usize], seed: u64, std: f32) -> Tensor {
        let v: Vec<f32> = SplitMix64::new(seed).normals(dims.iter().product()).into_iter().map(|z| z * std).collect();
        Tensor::from_vec(v, dims, &Device::Cpu).unwrap()
    }

    type Lin = fn(&Tensor, &Tensor, &Tensor) -> candle_core::Result<Tensor>;

    /// max |a − b| / max(max |b|, 1e-3): the worst element against the gradient's scale.
    fn rel_max(a: &Tensor, b: &Tensor) -> f32 {
        assert_eq!(a.dims(), b.dims());
        let v = |t: &Tensor| t.to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let (a, b) = (v(a), v(b));
        let worst = a.iter().zip(&b).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
        worst / b.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-3)
    }

    /// Fused against slow gradients, input by input, within `tol`; returns the worst error.
    fn agree(what: &str, fused: &[Tensor], slow: &[Tensor], tol: f32) -> f32 {
        let mut worst = 0f32;
        for (i, (a, b)) in fused.iter().zip(slow).enumerate() {
            let e = rel_max(a, b);
            assert!(e <= tol, "{what}, input {i}: {e} > {tol}");
            worst = worst.max(e);
        }
        worst
    }

    /// (B, T, K → N) shapes: rows not a multiple of the 16-row tasks, widths not a multiple of
    /// a SIMD vector, one row.
    const SHAPES: [(usize, usize, usize, usize); 4] = [(2, 13, 48, 40), (1, 37, 77, 130), (3, 5, 16, 200), (1, 1, 24, 8)];

    #[test]
    fn layer_norm_backward_matches_the_twin() {
        let worst = SHAPES.iter().enumerate().map(|(i, &(bsz, t, c, _))| check_layer_norm((bsz, t, c), 10 * i as u64)).fold(0f32, f32::max);
        eprintln!("layer_norm backward vs autograd twin, f32: {worst:.2e}");
    }

    #[test]
    fn add_layer_norm_backward_matches_the_twin_and_its_forward_is_unchanged() {
        let worst = SHAPES
            .iter()
            .enumerate()
            .map(|(i, &(bsz, t, c, _))| check_add_layer_norm((bsz, t, c), 20 + 10 * i as u64))
            .fold(0f32, f32::max);
        eprintln!("add_layer_norm backward vs autograd twin, f32: {worst:.2e}");
    }

    #[test]
    fn linear_backwards_match_their_twins() {
        let (mut worst, mut worst_bf16) = (0f32, 0f32);
        for (i, &shape) in SHAPES.iter().enumerate() {
            worst = worst.max(check_linears(shape, 100 + 10 * i as u64, DType::F32));
            worst_bf16 = worst_bf16.max(check_linears(shape, 100 + 10 * i as u64, DType::BF16));
        }
        eprintln!("linear backwards vs autograd twins: f32 {worst:.2e}, bf16 operands {worst_bf16:.2e}");
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig { cases: 16, ..Default::default() })]

        #[test]
        fn backwards_match_their_twins_on_random_shapes(bsz in 1usize..3, t in 1usize..40, k in 1usize..100, n in 1usize..100, seed in 0u64..1 << 20) {
            // C ≥ 16: a LayerNorm over one or two values has dx = 0 identically (x̂ is 0, or ±1
            // whatever x is), so the comparison would be of rounding noise alone; over three,
            // a row's variance can come out tiny and its x̂ amplify rounding past 1e-5 (at
            // C = 3, T = 6: 3 seeds of 300 over, up to 2.2e-5; at C = 16, none).
            check_layer_norm((bsz, t, k.max(16)), seed);
            check_add_layer_norm((bsz, t, k.max(16)), seed);
            check_linears((bsz, t, k, n), seed, DType::F32);
        }
    }

    /// `layer_norm`'s gradients (x, g, b) against the twin's, and the candle-ops version (CUDA's)
    /// too; f32: max |Δ| / max |g| ≤ 1e-5 (row means reordered; the twin's nine ops round
    /// differently; measured 2e-7). Returns the worst.
    fn check_layer_norm((bsz, t, c): (usize, usize, usize), s: u64) -> f32 {
        let x = (randn(&[bsz, t, c], s, 2.0) + 3.0).unwrap(); // a mean far from 0
        let (g, b) = ((randn(&[c], s + 1, 0.1) + 1.0).unwrap(), randn(&[c], s + 2, 0.1));
        let dy = randn(&[bsz, t, c], s + 3, 1.0);
        let fused = grads_of(&[&x, &g, &b], |v| Ok(vec![ops::layer_norm(&v[0], &v[1], &v[2], ops::LN_EPS, DType::F32)?]), &[&dy]).unwrap();
        let slow =
            grads_of(&[&x, &g, &b], |v| Ok(vec![ops::layer_norm_slow(&v[0], &v[1], &v[2], ops::LN_EPS, DType::F32)?]), &[&dy]).unwrap();
        let ops_version = layer_norm_bwd_ops(&x, &g, &dy, ops::LN_EPS).unwrap();
        agree("layer_norm", &fused, &slow, 1e-5).max(agree("layer_norm_bwd_ops", &ops_version, &slow, 1e-5))
    }

    /// `add_layer_norm`'s gradients (x, branch, g, b), both outputs carrying one (x_new feeds the
    /// next residual, h the MLP), against the twin's within 1e-5 at f32; and its forward, tracked
    /// or not, the same bit for bit. Returns the worst.
    fn check_add_layer_norm((bsz, t, c): (usize, usize, usize), s: u64) -> f32 {
        let (x, branch) = (randn(&[bsz, t, c], s, 1.0), randn(&[bsz, t, c], s + 1, 0.5));
        let (g, b) = ((randn(&[c], s + 2, 0.1) + 1.0).unwrap(), randn(&[c], s + 3, 0.1));
        let (dx_new, dh) = (randn(&[bsz, t, c], s + 4, 1.0), randn(&[bsz, t, c], s + 5, 1.0));
        let two = |(x, h): (Tensor, Tensor)| vec![x, h];
        let inputs = [&x, &branch, &g, &b];
        let fused = grads_of(&inputs, |v| Ok(two(ops::add_layer_norm(&v[0], &v[1], &v[2], &v[3], ops::LN_EPS)?)), &[&dx_new, &dh]).unwrap();
        let slow =
            grads_of(&inputs, |v| Ok(two(ops::add_layer_norm_slow(&v[0], &v[1], &v[2], &v[3], ops::LN_EPS)?)), &[&dx_new, &dh]).unwrap();
        let untracked = ops::add_layer_norm(&x, &branch, &g, &b, ops::LN_EPS).unwrap();
        let vars: Vec<Var> = inputs.iter().map(|t| Var::from_tensor(t).unwrap()).collect();
        let tracked =
            ops::add_layer_norm(vars[0].as_tensor(), vars[1].as_tensor(), vars[2].as_tensor(), vars[3].as_tensor(), ops::LN_EPS).unwrap();
        assert_eq!(rel_max(&tracked.0, &untracked.0), 0.0);
        assert_eq!(rel_max(&tracked.1, &untracked.1), 0.0);
        agree("add_layer_norm", &fused, &slow, 1e-5)
    }

    /// dx, dW, db (and dr) of the three epilogues against their twins': f32 within 1e-5; bf16
    /// operands against the f32 twin on the same (rounded) values within 2e-2 (dy reaches the op
    /// rounded to bf16, and the gradients return in bf16). Returns the worst.
    fn check_linears((bsz, t, k, n): (usize, usize, usize, usize), s: u64, dtype: DType) -> f32 {
        let (x, w, b) = (randn(&[bsz, t, k], s, 1.0), randn(&[n, k], s + 1, 0.2), randn(&[n], s + 2, 0.5));
        let (r, dy) = (randn(&[bsz, t, n], s + 3, 1.0), randn(&[bsz, t, n], s + 4, 1.0));
        let (x, w, b) = (x.to_dtype(dtype).unwrap(), w.to_dtype(dtype).unwrap(), b.to_dtype(dtype).unwrap());
        let tol = if dtype == DType::F32 { 1e-5 } else { 2e-2 };
        let f32_inputs = |v: &[Tensor]| -> Vec<Tensor> { v.iter().map(|t| t.to_dtype(DType::F32).unwrap()).collect() };
        let pairs: [(&str, Lin, Lin); 2] =
            [("bias", ops::linear_bias, ops::linear_bias_slow), ("bias+gelu", ops::linear_bias_gelu, ops::linear_bias_gelu_slow)];
        let mut worst = 0f32;
        for (name, fused, slow) in pairs {
            let a = grads_of(&[&x, &w, &b], |v| Ok(vec![fused(&v[0], &v[1], &v[2])?]), &[&dy]).unwrap();
            let z = grads_of(&[&x, &w, &b], |v| Ok(vec![slow(&f32_inputs(v)[0], &f32_inputs(v)[1], &f32_inputs(v)[2])?]), &[&dy]).unwrap();
            assert!(a.iter().zip([&x, &w, &b]).all(|(g, t)| g.dtype() == t.dtype()), "{name}: gradients in the operands' dtype");
            worst = worst.max(agree(&format!("{name} {dtype:?} ({bsz}, {t}, {k} → {n})"), &a, &z, tol));
        }
        let a = grads_of(&[&x, &w, &b, &r], |v| Ok(vec![ops::linear_bias_residual(&v[0], &v[1], &v[2], &v[3])?]), &[&dy]).unwrap();
        let z = grads_of(
            &[&x, &w, &b, &r],
            |v| {
                let f = f32_inputs(&v[..3]);
                Ok(vec![ops::linear_bias_residual_slow(&f[0], &f[1], &f[2], &v[3])?])
            },
            &[&dy],
        )
        .unwrap();
        worst.max(agree(&format!("bias+residual {dtype:?} ({bsz}, {t}, {k} → {n})"), &a, &z, tol))
    }

    /// A training step's linears on the CPU: f32 tensors, the weight an f32 master with bf16
    /// products (`PackedWeight::bf16_master`), against the f32 twin on the bf16-rounded x and W:
    /// dx, dW, db within 2e-2 of each gradient's largest value (dz is rounded to bf16 as the
    /// backward GEMMs pack it), every gradient f32. Ragged shapes: odd K (a half-empty last
    /// pair), M, N, K off the tiles, and a strided x (a column slice of a wider tensor).
    #[test]
    fn bf16_master_linears_match_the_twin_on_ragged_shapes() {
        use cpu_kernels::bf16_gemm::PackedWeight;
        let shapes = [(2, 13, 48, 40), (1, 37, 77, 130), (3, 5, 131, 200), (1, 1, 3, 8), (2, 67, 257, 45)];
        let round = |t: &Tensor| t.to_dtype(DType::BF16).unwrap().to_dtype(DType::F32).unwrap();
        let mut worst = 0f32;
        for (i, &(bsz, t, k, n)) in shapes.iter().enumerate() {
            let s = 300 + 10 * i as u64;
            let wide = randn(&[bsz, t, k + 5], s, 1.0);
            let x = wide.narrow(2, 2, k).unwrap(); // strided: rows k + 5 apart
            let (w, b) = (randn(&[n, k], s + 1, 0.2), randn(&[n], s + 2, 0.5));
            let (dy, r) = (randn(&[bsz, t, n], s + 3, 1.0), randn(&[bsz, t, n], s + 4, 1.0));
            type Fused = fn(&Tensor, &PackedWeight, &Tensor, Option<&Tensor>) -> candle_core::Result<Tensor>;
            let cases: [(&str, Fused, Lin); 3] = [
                ("bias", |x, w, b, _| ops::linear_prepacked(x, w, b, ops::Epilogue::Bias), ops::linear_bias_slow),
                ("bias+gelu", |x, w, b, _| ops::linear_prepacked(x, w, b, ops::Epilogue::BiasGelu), ops::linear_bias_gelu_slow),
                (
                    "bias+residual",
                    |x, w, b, r| ops::linear_prepacked(x, w, b, ops::Epilogue::BiasResidual(r.unwrap())),
                    |x, w, b| ops::linear_bias_slow(x, w, b),
                ),
            ];
            for (name, fused, slow) in cases {
                let residual = name == "bias+residual";
                let inputs: Vec<&Tensor> = if residual { vec![&x, &w, &b, &r] } else { vec![&x, &w, &b] };
                cpu_kernels::trace::start();
                let got = grads_of(
                    &inputs,
                    |v| {
                        let pw = PackedWeight::bf16_master(&v[1])?;
                        Ok(vec![fused(&v[0], &pw, &v[2], v.get(3))?])
                    },
                    &[&dy],
                )
                .unwrap();
                let ran = cpu_kernels::trace::stop().join("; ");
                if cpu_kernels::bf16_gemm::Kernel::detect().is_native() {
                    // What ran: the bf16 GEMM forward on f32 operands, and the backward's two.
                    assert!(ran.contains("f32 operands rounded as packed") && ran.contains("linear backward: gemm bf16"), "{name}: {ran}");
                }
                let want = grads_of(
                    &inputs,
                    |v| {
                        let y = slow(&round(&v[0]), &round(&v[1]), &v[2])?;
                        Ok(vec![if residual { (y + &v[3])? } else { y }])
                    },
                    &[&dy],
                )
                .unwrap();
                assert!(got.iter().all(|g| g.dtype() == DType::F32), "{name}: f32 gradients");
                worst = worst.max(agree(&format!("{name} bf16 master ({bsz}, {t}, {k} → {n})"), &got, &want, 2e-2));
            }
        }
        eprintln!("bf16-master linears vs the f32 twin on rounded operands: {worst:.2e}");
    }

    /// `ops::mlp`'s paired ops (fc2's backward hands dz₁ to fc1's as h's gradient, and db₁ through
    /// the pair) against candle's autograd through the twin, every input, f32 within 1e-5 and bf16
    /// against the f32 twin on the same values within 3e-2 (h, dz₁ and the gradients rounded to
    /// bf16 on the way; measured 6.8e-3); and the paired forward against the two fused linears'
    /// (the same values: f32 GEMM, bias, GELU). Random shapes, FF a multiple of 8 as the CUDA path
    /// needs.
    #[test]
    fn mlp_pairing_matches_the_twin() {
        let mut worst = 0f32;
        for (i, &(bsz, t, c, ff)) in [(2, 13, 24, 40), (1, 37, 17, 64), (3, 5, 40, 8), (1, 1, 8, 16)].iter().enumerate() {
            let s = 100 + 10 * i as u64;
            let (x, w1, b1) = (randn(&[bsz, t, c], s, 1.0), randn(&[ff, c], s + 1, 0.3), randn(&[ff], s + 2, 0.5));
            let (w2, b2, dy) = (randn(&[c, ff], s + 3, 0.3), randn(&[c], s + 4, 0.5), randn(&[bsz, t, c], s + 5, 1.0));
            for (dtype, tol) in [(DType::F32, 1e-5), (DType::BF16, 3e-2)] {
                let inputs: Vec<Tensor> = [&x, &w1, &b1, &w2, &b2].iter().map(|t| t.to_dtype(dtype).unwrap()).collect();
                let refs: Vec<&Tensor> = inputs.iter().collect();
                let fused = grads_of(&refs, |v| Ok(vec![ops::mlp(&v[0], &v[1], &v[2], &v[3], &v[4])?]), &[&dy]).unwrap();
                let f32s = |v: &[Tensor]| -> Vec<Tensor> { v.iter().map(|t| t.to_dtype(DType::F32).unwrap()).collect() };
                let slow = grads_of(
                    &refs,
                    |v| {
                        let f = f32s(v);
                        Ok(vec![ops::mlp_slow(&f[0], &f[1], &f[2], &f[3], &f[4])?])
                    },
                    &[&dy],
                )
                .unwrap();
                assert!(fused.iter().zip(&refs).all(|(g, t)| g.dtype() == t.dtype()), "gradients in the operands' dtype");
                worst = worst.max(agree(&format!("mlp {dtype:?} ({bsz}, {t}, {c}, FF {ff})"), &fused, &slow, tol));
                let untracked = ops::mlp(refs[0], refs[1], refs[2], refs[3], refs[4]).unwrap();
                let vars: Vec<Var> = refs.iter().map(|t| Var::from_tensor(t).unwrap()).collect();
                let tracked =
                    ops::mlp(vars[0].as_tensor(), vars[1].as_tensor(), vars[2].as_tensor(), vars[3].as_tensor(), vars[4].as_tensor())
                        .unwrap();
                let moved = rel_max(&tracked, &untracked);
                assert!(moved <= if dtype == DType::F32 { 1e-6 } else { 1e-2 }, "mlp {dtype:?}: the tracked forward moved by {moved}");
            }
        }
        eprintln!("mlp (fc1 and fc2 paired) vs candle's autograd of the twin: {worst:.2e}");
    }

    /// On a GPU: `mlp` (fc1's GELU_AUX_BIAS, BGRADB and DGELU_BGRAD in fc2's backward, `cuda_lt`)
    /// and `linear_bias` (BGRADB) at bf16 and f16, against candle's autograd of the twins in f32 on
    /// the CPU, on the same values: within 3e-2 of each gradient's largest value, as on the CPU.
    #[cfg(feature = "cuda")]
    #[test]
    fn cuda_training_epilogues_match_the_twin() {
        let gpu = Device::new_cuda(0).expect("needs an NVIDIA GPU");
        let on_cpu = |v: Vec<Tensor>| -> Vec<Tensor> { v.iter().map(|t| t.to_device(&Device::Cpu).unwrap()).collect() };
        let f32s = |v: &[Tensor]| -> Vec<Tensor> { v.iter().map(|t| t.to_dtype(DType::F32).unwrap()).collect() };
        for (i, &(bsz, t, c, ff)) in [(2, 16, 64, 256), (1, 33, 40, 72)].iter().enumerate() {
            let s = 200 + 10 * i as u64;
            let (x, w1, b1) = (randn(&[bsz, t, c], s, 1.0), randn(&[ff, c], s + 1, 0.3), randn(&[ff], s + 2, 0.5));
            let (w2, b2, dy) = (randn(&[c, ff], s + 3, 0.3), randn(&[c], s + 4, 0.5), randn(&[bsz, t, c], s + 5, 1.0));
            for dtype in [DType::BF16, DType::F16] {
                let cpu: Vec<Tensor> = [&x, &w1, &b1, &w2, &b2].iter().map(|t| t.to_dtype(dtype).unwrap()).collect();
                let dev: Vec<Tensor> = cpu.iter().map(|t| t.to_device(&gpu).unwrap()).collect();
                let (cpu, dev): (Vec<&Tensor>, Vec<&Tensor>) = (cpu.iter().collect(), dev.iter().collect());
                let dy_gpu = dy.to_device(&gpu).unwrap();
                let fused = grads_of(&dev, |v| Ok(vec![ops::mlp(&v[0], &v[1], &v[2], &v[3], &v[4])?]), &[&dy_gpu]).unwrap();
                let slow = grads_of(
                    &cpu,
                    |v| {
                        let f = f32s(v);
                        Ok(vec![ops::mlp_slow(&f[0], &f[1], &f[2], &f[3], &f[4])?])
                    },
                    &[&dy],
                )
                .unwrap();
                agree(&format!("mlp on CUDA {dtype:?} ({bsz}, {t}, {c}, FF {ff})"), &on_cpu(fused), &slow, 3e-2);
                let dyl = randn(&[bsz, t, ff], s + 6, 1.0); // (B, T, FF): fc1 as a plain bias linear
                let fused =
                    grads_of(&dev[..3], |v| Ok(vec![ops::linear_bias(&v[0], &v[1], &v[2])?]), &[&dyl.to_device(&gpu).unwrap()]).unwrap();
                let slow = grads_of(
                    &cpu[..3],
                    |v| {
                        let f = f32s(v);
                        Ok(vec![ops::linear_bias_slow(&f[0], &f[1], &f[2])?])
                    },
                    &[&dyl],
                )
                .unwrap();
                agree(&format!("linear_bias on CUDA {dtype:?} ({bsz}, {t}, {c} → {ff})"), &on_cpu(fused), &slow, 3e-2);
            }
        }
    }

    /// The candle-ops bias+GELU backward (what CUDA runs) against the CPU's one pass, on the CPU.
    #[test]
    fn bias_gelu_backward_as_ops_matches_the_fused_pass() {
        let (bsz, t, k, n) = (2, 37, 19, 45);
        let (x, w, b) = (randn(&[bsz, t, k], 7, 1.0), randn(&[n, k], 8, 0.4), randn(&[n], 9, 0.5));
        let dy = randn(&[bsz, t, n], 10, 1.0);
        let acc: Vec<f32> = x.reshape((bsz * t, k)).unwrap().matmul(&w.t().unwrap()).unwrap().flatten_all().unwrap().to_vec1().unwrap();
        let fused = bias_gelu_bwd(&dy, Some(&acc), &x, &w, &b).unwrap();
        let ops = bias_gelu_bwd_ops(&dy, &x, &w, &b).unwrap();
        let worst = agree("bias+gelu backward, ops vs fused", &[fused.0, fused.1], &[ops.0, ops.1], 1e-5);
        eprintln!("bias+gelu backward as candle ops vs the fused pass: {worst:.2e}");
    }

    #[test]
    fn gelu_derivative_matches_a_central_difference() {
        // The derivative of the function the forward computes, in f64 differences: within 1e-4
        // absolute over [−12, 12], and 0 and 1 in the tails.
        for i in -1200..=1200 {
            let v = i as f64 / 100.0;
            let h = 1e-3;
            let f = |x: f64| x * 0.5 * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x * x * x)).tanh());
            let want = (f(v + h) - f(v - h)) / (2.0 * h);
            let got = gelu_tanh_grad(v as f32) as f64;
            assert!((got - want).abs() < 1e-4, "gelu'({v}) = {got}, central difference {want}");
        }
        assert_eq!(gelu_tanh_grad(-100.0), 0.0);
        assert_eq!(gelu_tanh_grad(100.0), 1.0);
    }
}
