//! Fused operations, each a candle custom op (`CustomOp3`: a CPU forward and, with the `cuda`
//! feature, a CUDA forward, as candle-nn's `ops.rs` writes LayerNorm and softmax) with its slow
//! twin beside it: the same function from plain candle ops (`*_slow`), which a test asserts it
//! agrees with on random shapes (`tests/fused_vs_twin.rs`).
//!
//! | fused op                        | slow twin                   | replaces                                   |
//! |---------------------------------|-----------------------------|--------------------------------------------|
//! | `layer_norm(x, g, b, eps, dtype)` | `layer_norm_slow`         | mean, sub, sqr, mean, add, sqrt, div, mul, add, cast |
//! | `linear_bias(x, w, b)`          | `linear_bias_slow`          | GEMM, then a bias add                      |
//! | `linear_bias_gelu(x, w, b)`     | `linear_bias_gelu_slow`     | GEMM, bias add, then GELU's 7 element-wise ops |
//! | `linear_bias_residual(x,w,b,r)` | `linear_bias_residual_slow` | GEMM, bias add, cast to f32, residual add  |
//! | `add_layer_norm(x, br, g, b, eps)` | `add_layer_norm_slow`    | cast, residual add, then LayerNorm's nine ops, cast |
//! | `mlp(x, w1, b1, w2, b2)`        | `mlp_slow`                  | training: fc1 and fc2 paired, GELU's derivative in fc2's backward GEMM |
//! | `qkv_attention(qkv, n_head, ..)` | stage 2's op on three views | training on the CPU: q, k, v read from the one QKV output, its gradient one tensor |
//! | `qkv_attention_cuda(qkv, n_head, ..)` | stage 2's op on three views | training on CUDA: stage 2's kernels on the one QKV output, its gradient one tensor |
//!
//! CPU: single passes over rows (LayerNorm), and linears on the bf16 GEMM (`cpu_kernels::bf16_gemm`)
//! whose output pass applies the epilogue to each block of the f32 accumulator while it is in
//! cache: the bias, the bias and GELU (fc1), or the bias and residual (fc2), then the rounding to
//! bf16 as it stores, with no pass of its own. Where W is not packed for that GEMM (the f32 GEMM,
//! MKL's) the destination starts out holding the bias (and the residual), so
//! `dst = 1·dst + 1·x·Wᵀ` adds them, and for fc1 the GEMM writes up to `GELU_ROWS` rows and one
//! parallel pass adds the bias and applies GELU.
//! CUDA (`cuda` module): our two-pass LayerNorm kernel (`kernels/add_layer_norm.cu`), and cuBLASLt
//! GEMMs with epilogues: bias and bias+GELU applied by the GEMM kernel before it stores, the
//! residual read through the C operand with β = 1.
//!
//! Training: each op's `bwd` (kernels in `backward.rs`, beside their slow twins) runs when a loss
//! is differentiated through it; on CUDA the linears' backward GEMMs are cuBLASLt's with the
//! BGRADB and (fc2 inside `mlp`) DGELU_BGRAD epilogues (`cuda_lt.rs`). An op is recorded for
//! backward only when one of its inputs is tracked (a `Var`, or computed from one), so inference
//! runs exactly as above.
//!
//! Lifting one into your model needs this file, `cuda.rs`, `cuda_lt.rs` and `device_cache.rs` (CUDA),
//! `cpu_kernels::elementwise` (the CPU loops) and candle: nothing from the benchmark harness.

use crate::backward;
use candle_core::backend::BackendStorage;
use candle_core::op::BackpropOp;
use candle_core::{CpuStorage, CustomOp3, DType, Layout, Shape, Storage, Tensor, D};
use cpu_kernels::bf16_gemm::{self, narrow_bf16, Kernel, MatRef, PackedB, PackedWeight};
use cpu_kernels::elementwise::{
    bias_gelu_tanh, exp_f32, map_slice, map_slice_in_place, par_convert, row_stats, store_f32, uninit_of, Elementwise, RowStats,
};
use rayon::prelude::*;
use std::borrow::Cow;
use std::sync::{Arc, Mutex};

/// LayerNorm's ε in GPT-2 (and this repo's block). The ops take ε as an argument, as candle-nn's
/// `layer_norm` does, so a model with another ε lifts them unchanged.
pub const LN_EPS: f32 = 1e-5;
/// Rows of x one thread block of LayerNorm's CUDA backward takes (`ROWS_BWD` in
/// kernels/add_layer_norm.cu; a test keeps the two equal): the rows of partial dg and db it writes.
pub const LN_BWD_ROWS: usize = 32;

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
pub(crate) const ROWS_PER_TASK: usize = 16;

// ---------------------------------------------------------------------------------------------
// LayerNorm
// ---------------------------------------------------------------------------------------------

/// LayerNorm over the last dimension, output cast to `dtype` in the same pass:
/// (x − mean) / √(var + eps) · g + b, as `candle_nn::ops::layer_norm(x, g, b, eps)` computes it.
/// x: (…, C) f32; g, b: (C) f32. Per row: the statistics from one read, then normalise and
/// write while the row is in L1 (C = 768 floats is 3 KiB), instead of the seven full passes
/// over (B, T, C) that the primitive ops make (nine ops, two of them on the (B, T, 1)
/// statistics); the cast to the GEMM dtype rides along.
/// CUDA: our two-pass kernel (kernels/add_layer_norm.cu, `layer_norm_*`), cast fused into the
/// store; candle's LayerNorm kernel takes var = E[x²] − mean² in f32, which cancels for rows
/// with a large mean.
pub fn layer_norm(x: &Tensor, g: &Tensor, b: &Tensor, eps: f32, dtype: DType) -> candle_core::Result<Tensor> {
    let (x, g, b) = (f32_contiguous(x)?, f32_contiguous(g)?, f32_contiguous(b)?);
    check_norm_params(&x, &g, &b, "layer_norm")?;
    check_eps(eps, "layer_norm")?;
    x.apply_op3(&g, &b, LayerNorm { eps, dtype })
}

/// Slow twin of `layer_norm`: the nine primitive ops (as stage 0 spells them out), then a cast.
pub fn layer_norm_slow(x: &Tensor, g: &Tensor, b: &Tensor, eps: f32, dtype: DType) -> candle_core::Result<Tensor> {
    let mean = x.mean_keepdim(D::Minus1)?; // (B, T, 1)
    let xc = x.broadcast_sub(&mean)?;
    let var = xc.sqr()?.mean_keepdim(D::Minus1)?; // biased variance, as in PyTorch
    let xhat = xc.broadcast_div(&(var + eps as f64)?.sqrt()?)?;
    xhat.broadcast_mul(g)?.broadcast_add(b)?.to_dtype(dtype)
}

/// The op behind `layer_norm`: inputs x (…, C), g (C), b (C), all f32 and contiguous.
struct LayerNorm {
    eps: f32,
    dtype: DType,
}

impl CustomOp3 for LayerNorm {
    fn name(&self) -> &'static str {
        "speedkit-layer-norm"
    }

    fn cpu_fwd(
        &self,
        xs: &CpuStorage,
        xl: &Layout,
        gs: &CpuStorage,
        gl: &Layout,
        bs: &CpuStorage,
        bl: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        cpu_kernels::trace::ran("fused layer_norm: one pass per row (CPU)");
        let c = xl.shape().dims().last().copied().unwrap_or(1);
        let (x, g, b) = (f32_values(xs, xl, "x")?, f32_values(gs, gl, "g")?, f32_values(bs, bl, "b")?);
        if self.dtype == DType::BF16 {
            // bf16 out: each row normalised in L1 and rounded as it is stored, no f32 (B, T, C)
            // buffer and no narrowing pass after it.
            // SAFETY: the chunks cover h, and each row is stored whole.
            let mut h = unsafe { uninit_of::<half::bf16>(x.len()) };
            normalise_rows_bf16(&x, None, &g, &b, self.eps, c, None, &mut h);
            return Ok((CpuStorage::BF16(h), xl.shape().clone()));
        }
        Ok((to_storage(layer_norm_rows(&x, &g, &b, self.eps, c), self.dtype)?, xl.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        xs: &candle_core::CudaStorage,
        xl: &Layout,
        gs: &candle_core::CudaStorage,
        gl: &Layout,
        bs: &candle_core::CudaStorage,
        bl: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        cpu_kernels::trace::ran("fused layer_norm: kernels/add_layer_norm.cu");
        let h = crate::cuda::layer_norm(xs, xl, gs, gl, bs, bl, self.eps, self.dtype)?;
        Ok((h, xl.shape().clone()))
    }

    /// dx, dg, db (f32, the arguments' shapes) in one pass per row (`backward::layer_norm_bwd`);
    /// b is not needed, since the normalised row x̂ comes back from x's statistics.
    fn bwd(
        &self,
        x: &Tensor,
        g: &Tensor,
        _b: &Tensor,
        _h: &Tensor,
        dh: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let [dx, dg, db] = backward::layer_norm_bwd(x, g, dh, self.eps)?;
        Ok((Some(dx), Some(dg), Some(db)))
    }
}

/// The worked example: residual add and LayerNorm in one pass, returning the new residual
/// stream x + branch (f32) and its normalised copy h (in branch's dtype, ready for the next GEMM).
/// CUDA: our kernel `kernels/add_layer_norm.cu` (one launch). CPU: one pass per row.
pub fn add_layer_norm(x: &Tensor, branch: &Tensor, g: &Tensor, b: &Tensor, eps: f32) -> candle_core::Result<(Tensor, Tensor)> {
    if x.dims() != branch.dims() || x.dtype() != DType::F32 {
        candle_core::bail!("add_layer_norm: x {:?} ({:?}) and branch {:?} must match, x in f32", x.dims(), x.dtype(), branch.dims());
    }
    if [x, branch, g, b].iter().any(|t| t.track_op()) {
        // Training: four inputs and two outputs, where candle records an op of at most three
        // inputs and one output. So the graph holds the two parts: the add (candle's: dx_new
        // reaches x and branch as it is) and `layer_norm` with its fused backward. The numbers
        // are the fused kernel's, bit for bit: the same f32 add, the same row pass.
        let x_new = (x + branch.to_dtype(DType::F32)?)?;
        let h = layer_norm(&x_new, g, b, eps, branch.dtype())?;
        return Ok((x_new, h));
    }
    let (x, branch, g, b) = (x.contiguous()?, branch.contiguous()?, f32_contiguous(g)?, f32_contiguous(b)?);
    check_norm_params(&x, &g, &b, "add_layer_norm")?;
    check_eps(eps, "add_layer_norm")?;
    let op = AddLayerNorm { b, eps, x_out: Mutex::new(None) };
    let h = x.apply_op3_no_bwd(&branch, &g, &op)?;
    let x_out = op.x_out.lock().map_err(|_| candle_core::Error::Msg("add_layer_norm: poisoned lock".into()))?.take();
    let x_out = x_out.ok_or_else(|| candle_core::Error::Msg("add_layer_norm: the forward wrote no residual".into()))?;
    Ok((Tensor::from_storage(x_out, x.shape(), BackpropOp::none(), false), h))
}

/// Slow twin of `add_layer_norm`: a cast, an add, then `layer_norm_slow`.
pub fn add_layer_norm_slow(x: &Tensor, branch: &Tensor, g: &Tensor, b: &Tensor, eps: f32) -> candle_core::Result<(Tensor, Tensor)> {
    let x = (x + branch.to_dtype(DType::F32)?)?;
    let h = layer_norm_slow(&x, g, b, eps, branch.dtype())?;
    Ok((x, h))
}

/// The op behind `add_layer_norm`: inputs x (…, C) f32, branch (…, C) f32/bf16/f16, g (C) f32,
/// all contiguous; output h in branch's dtype.
///
/// Four inputs and two outputs of two dtypes, where a candle custom op takes at most three and
/// returns one storage of one dtype. The fourth input, b, is held by the op and its storage read
/// inside the forward. The second output, x + branch (f32), is left in `x_out` for the caller to
/// take: concatenating the two outputs instead would need h in f32 and then a cast pass to
/// branch's dtype — the pass this kernel exists to remove.
struct AddLayerNorm {
    b: Tensor,
    eps: f32,
    x_out: Mutex<Option<Storage>>,
}

impl AddLayerNorm {
    fn put_x_out(&self, s: Storage) -> candle_core::Result<()> {
        *self.x_out.lock().map_err(|_| candle_core::Error::Msg("add_layer_norm: poisoned lock".into()))? = Some(s);
        Ok(())
    }
}

impl CustomOp3 for AddLayerNorm {
    fn name(&self) -> &'static str {
        "speedkit-add-layer-norm"
    }

    fn cpu_fwd(
        &self,
        xs: &CpuStorage,
        xl: &Layout,
        brs: &CpuStorage,
        brl: &Layout,
        gs: &CpuStorage,
        gl: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        cpu_kernels::trace::ran("fused add+layer_norm: one pass per row (CPU)");
        let c = xl.shape().dims().last().copied().unwrap_or(1);
        let (bs, bl) = self.b.storage_and_layout();
        let Storage::Cpu(bs) = &*bs else { candle_core::bail!("add_layer_norm: b is not on the CPU") };
        if let (CpuStorage::BF16(br), Some((start, end))) = (brs, brl.contiguous_offsets()) {
            // A bf16 branch (the proj GEMM's output): each row widened in L1 as it is added, h
            // rounded to bf16 as it is stored; no f32 copy of the branch, no f32 h, no narrowing pass.
            let (x, g, b) = (f32_values(xs, xl, "x")?, f32_values(gs, gl, "g")?, f32_values(bs, bl, "b")?);
            let br = &br[start..end];
            if br.len() != x.len() {
                candle_core::bail!("add_layer_norm: branch {:?} is not x's shape {:?}", brl.shape(), xl.shape());
            }
            // SAFETY (both): the chunks cover them, and each row of each is stored whole.
            let (mut x_out, mut h) = unsafe { (uninit_of::<f32>(x.len()), uninit_of::<half::bf16>(x.len())) };
            normalise_rows_bf16(&x, Some(br), &g, &b, self.eps, c, Some(&mut x_out), &mut h);
            self.put_x_out(Storage::Cpu(CpuStorage::F32(x_out)))?;
            return Ok((CpuStorage::BF16(h), xl.shape().clone()));
        }
        let (x, br, g, b) = (f32_values(xs, xl, "x")?, f32_values(brs, brl, "branch")?, f32_values(gs, gl, "g")?, f32_values(bs, bl, "b")?);
        let (x_out, h_out) = add_layer_norm_rows(&x, &br, &g, &b, self.eps, c);
        self.put_x_out(Storage::Cpu(CpuStorage::F32(x_out)))?;
        Ok((to_storage(h_out, brs.dtype())?, xl.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        xs: &candle_core::CudaStorage,
        xl: &Layout,
        brs: &candle_core::CudaStorage,
        brl: &Layout,
        gs: &candle_core::CudaStorage,
        gl: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        cpu_kernels::trace::ran("fused add+layer_norm: kernels/add_layer_norm.cu");
        let (bs, bl) = self.b.storage_and_layout();
        let Storage::Cuda(bs) = &*bs else { candle_core::bail!("add_layer_norm: b is not on the GPU") };
        let (x_out, h) = crate::cuda::add_layer_norm(xs, xl, brs, brl, gs, gl, bs, bl, self.eps)?;
        self.put_x_out(Storage::Cuda(x_out))?;
        Ok((h, xl.shape().clone()))
    }
}

/// LayerNorm over every row of C values of x (f32, row-major), on all threads: `ROWS_PER_TASK`
/// rows per rayon task. The CPU body of `layer_norm` (and of stage 4's E4M3 LayerNorm).
pub fn layer_norm_rows(x: &[f32], g: &[f32], b: &[f32], eps: f32, c: usize) -> Vec<f32> {
    // SAFETY: the chunks cover h, and normalise_row writes each row whole.
    let mut h = unsafe { uninit_of::<f32>(x.len()) };
    let rows = ROWS_PER_TASK * c.max(1);
    h.par_chunks_mut(rows).zip(x.par_chunks(rows)).for_each(|(h, x)| {
        h.chunks_mut(c.max(1)).zip(x.chunks(c.max(1))).for_each(|(h, row)| normalise_row(row, g, b, eps, h));
    });
    h
}

/// (x + branch, LayerNorm(x + branch)) over every row of C values, one pass per row while it is
/// in L1, on all threads. The CPU body of `add_layer_norm` (and of stage 4's E4M3 version).
pub fn add_layer_norm_rows(x: &[f32], branch: &[f32], g: &[f32], b: &[f32], eps: f32, c: usize) -> (Vec<f32>, Vec<f32>) {
    let c = c.max(1);
    // SAFETY: the chunks cover both; map_slice writes each x_out row whole, normalise_row each h row.
    let (mut x_out, mut h) = unsafe { (uninit_of::<f32>(x.len()), uninit_of::<f32>(x.len())) };
    let rows = ROWS_PER_TASK * c;
    x_out.par_chunks_mut(rows).zip(h.par_chunks_mut(rows)).zip(x.par_chunks(rows).zip(branch.par_chunks(rows))).for_each(
        |((xo, ho), (xr, br))| {
            for (((xo, ho), xr), br) in xo.chunks_mut(c).zip(ho.chunks_mut(c)).zip(xr.chunks(c)).zip(br.chunks(c)) {
                map_slice(xo, xr, &|i, a| a + br[i]); // the new residual stream
                normalise_row(xo, g, b, eps, ho);
            }
        },
    );
    (x_out, h)
}

/// The bf16-out LayerNorm rows of `layer_norm` (branch None) and `add_layer_norm` (x_out: the
/// new residual stream x + branch, f32): per row, the f32 row (x, or x + the widened bf16 branch
/// row, stored to x_out) and its normalisation in an L1 row buffer, h rounded to bf16 as it is
/// stored. On all threads, `ROWS_PER_TASK` rows a task; every row of h (and x_out) written.
#[allow(clippy::too_many_arguments)]
fn normalise_rows_bf16(
    x: &[f32],
    branch: Option<&[half::bf16]>,
    g: &[f32],
    b: &[f32],
    eps: f32,
    c: usize,
    x_out: Option<&mut [f32]>,
    h: &mut [half::bf16],
) {
    let c = c.max(1);
    let rows = ROWS_PER_TASK * c;
    let task = |t: usize, h: &mut [half::bf16], xo: Option<&mut [f32]>| {
        let (mut sum, mut normed) = (vec![0f32; c], vec![0f32; c]);
        let mut xo = xo;
        for (r, hr) in h.chunks_mut(c).enumerate() {
            let at = t * rows + r * c;
            let xr = &x[at..at + c];
            let row: &[f32] = match branch {
                Some(br) => {
                    let br = &br[at..at + c];
                    // bf16 → f32 is exact: the bits shifted up (vectorises).
                    map_slice(&mut sum, xr, &|i, a| a + f32::from_bits((br[i].to_bits() as u32) << 16));
                    if let Some(xo) = xo.as_deref_mut() {
                        xo[r * c..][..c].copy_from_slice(&sum);
                    }
                    &sum
                }
                None => xr,
            };
            normalise_row(row, g, b, eps, &mut normed);
            store_f32(&normed, hr);
        }
    };
    match x_out {
        Some(xo) => h.par_chunks_mut(rows).zip(xo.par_chunks_mut(rows)).enumerate().for_each(|(t, (h, xo))| task(t, h, Some(xo))),
        None => h.par_chunks_mut(rows).enumerate().for_each(|(t, h)| task(t, h, None)),
    }
}

/// h = (row − mean) / √(var + ε) · g + b, the statistics from one read of the row
/// (`cpu_kernels::elementwise::row_stats`: shifted sums in f64, accurate for rows with a large mean),
/// then one vectorised write pass while the row is in L1 (`map_slice` dispatches to AVX-512/AVX2).
#[inline]
pub fn normalise_row(row: &[f32], g: &[f32], b: &[f32], eps: f32, h: &mut [f32]) {
    let RowStats { shift, shift_minus_mean, inv_std } = row_stats(row, eps as f64);
    map_slice(h, row, &|i, v| ((v - shift) + shift_minus_mean) * inv_std * g[i] + b[i]);
}

/// ε must be a finite number ≥ 0 (0 is allowed: a constant row then divides by zero, as in candle-nn).
fn check_eps(eps: f32, op: &str) -> candle_core::Result<()> {
    if !(eps >= 0.0 && eps.is_finite()) {
        candle_core::bail!("{op}: eps = {eps} is not a finite number ≥ 0 (GPT-2 uses 1e-5, `LN_EPS`)");
    }
    Ok(())
}

/// g and b must be (C), C being x's last dimension.
pub fn check_norm_params(x: &Tensor, g: &Tensor, b: &Tensor, op: &str) -> candle_core::Result<()> {
    let c = x.dim(D::Minus1)?;
    if g.dims() != [c] || b.dims() != [c] {
        candle_core::bail!("{op}: g {:?} and b {:?} must be ({c}), the last dimension of x {:?}", g.dims(), b.dims(), x.dims());
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Linear layers with fused epilogues
// ---------------------------------------------------------------------------------------------

/// y = x Wᵀ + b. x: (B, T, K); W: (N, K); b: (N). Output in x's dtype.
pub fn linear_bias(x: &Tensor, w: &Tensor, b: &Tensor) -> candle_core::Result<Tensor> {
    linear(x, w, b, Epilogue::Bias, None, false)
}

/// Slow twin of `linear_bias`: a GEMM, then a bias pass.
pub fn linear_bias_slow(x: &Tensor, w: &Tensor, b: &Tensor) -> candle_core::Result<Tensor> {
    let (bsz, t, c_in) = x.dims3()?;
    let c_out = w.dim(0)?;
    let y = x.reshape((bsz * t, c_in))?.matmul(&w.t()?)?; // (B·T, out)
    y.broadcast_add(b)?.reshape((bsz, t, c_out))
}

/// y = gelu_tanh(x Wᵀ + b).
pub fn linear_bias_gelu(x: &Tensor, w: &Tensor, b: &Tensor) -> candle_core::Result<Tensor> {
    linear(x, w, b, Epilogue::BiasGelu, None, false)
}

/// Slow twin of `linear_bias_gelu`: a GEMM, a bias pass, then GELU from primitives:
/// 0.5·y·(1 + tanh(√(2/π)·(y + 0.044715·y³))).
pub fn linear_bias_gelu_slow(x: &Tensor, w: &Tensor, b: &Tensor) -> candle_core::Result<Tensor> {
    let y = linear_bias_slow(x, w, b)?;
    let y3 = (y.sqr()? * &y)?;
    let inner = ((&y + (y3 * 0.044715)?)? * (2.0 / std::f64::consts::PI).sqrt())?;
    ((inner.tanh()? + 1.0)? * y)? * 0.5
}

/// y = r + x Wᵀ + b, in r's dtype (the f32 residual stream).
pub fn linear_bias_residual(x: &Tensor, w: &Tensor, b: &Tensor, r: &Tensor) -> candle_core::Result<Tensor> {
    linear_residual(x, w, b, r, false)
}

/// `linear_bias_residual`, with bf16 products on f32 operands when `bf16_master` (see `Linear`).
fn linear_residual(x: &Tensor, w: &Tensor, b: &Tensor, r: &Tensor, bf16_master: bool) -> candle_core::Result<Tensor> {
    let (bsz, t, _) = x.dims3()?;
    let n = w.dim(0)?;
    if r.dims() != [bsz, t, n] {
        candle_core::bail!("linear: residual {:?} is not the output shape ({bsz}, {t}, {n})", r.dims());
    }
    if [x, w, b, r].iter().any(|t| t.track_op()) {
        // Training: the residual is a fourth input, and candle records an op of three. The GEMM
        // and bias are the op (its backward: dx, dW, db); the residual add is candle's, which
        // hands dy to r as it is. One pass more than the fused forward, in training only, and
        // at bf16/f16 the branch is rounded to the GEMM dtype before the add (as on CUDA).
        return r + linear(x, w, b, Epilogue::Bias, None, bf16_master)?.to_dtype(r.dtype())?;
    }
    if x.device().is_cuda() && r.dtype() != x.dtype() {
        // The f32 residual stream of a bf16/f16 block cannot ride in through cuBLASLt's C
        // operand (cudarc's wrapper gives C and D one dtype): it is added after, in f32, one pass.
        return r + linear_bias(x, w, b)?.to_dtype(r.dtype())?;
    }
    linear(x, w, b, Epilogue::BiasResidual(&r.contiguous()?), None, bf16_master)
}

/// `linear_bias`, `linear_bias_gelu` or `linear_bias_residual` (`epilogue`) with W held by `w`:
/// on the CPU's bf16 unit, Wᵀ's pair panels packed once when the block is built
/// (`bf16_gemm::PackedWeight`), so no forward packs W again. Otherwise, and when anything is
/// tracked for backward, the plain op on `w.weight()`.
pub fn linear_prepacked(x: &Tensor, w: &PackedWeight, b: &Tensor, epilogue: Epilogue) -> candle_core::Result<Tensor> {
    let plain = w.weight();
    let tracked = [x, plain, b].iter().any(|t| t.track_op()) || matches!(epilogue, Epilogue::BiasResidual(r) if r.track_op());
    let packed = w.packed().filter(|_| x.device().is_cpu() && !tracked);
    let master = w.bf16_products() && plain.dtype() == DType::F32; // an f32 master with bf16 products (training)
    match (epilogue, packed) {
        (Epilogue::BiasResidual(r), None) => linear_residual(x, plain, b, r, master),
        (epilogue, None) => linear(x, plain, b, epilogue, None, master),
        (Epilogue::BiasResidual(r), Some(p)) => {
            let (bsz, t, _) = x.dims3()?;
            if r.dims() != [bsz, t, p.n()] {
                candle_core::bail!("linear: residual {:?} is not the output shape ({bsz}, {t}, {})", r.dims(), p.n());
            }
            linear(x, plain, b, Epilogue::BiasResidual(&r.contiguous()?), Some(p), false)
        }
        (epilogue, Some(p)) => linear(x, plain, b, epilogue, Some(p), false),
    }
}

/// Slow twin of `linear_bias_residual`: a GEMM, a bias pass, a cast pass, an add pass.
pub fn linear_bias_residual_slow(x: &Tensor, w: &Tensor, b: &Tensor, r: &Tensor) -> candle_core::Result<Tensor> {
    r + linear_bias_slow(x, w, b)?.to_dtype(r.dtype())?
}

/// What the GEMM adds or applies before its result is stored.
#[derive(Clone, Copy)]
pub enum Epilogue<'a> {
    Bias,
    BiasGelu,
    /// + r, r: the output's shape, contiguous; in the GEMM's dtype on CUDA.
    BiasResidual(&'a Tensor),
}

/// The op behind the three linears: inputs x (B, T, K), W (N, K), b (N), contiguous, in one
/// dtype. The residual, a fourth input, is held by the op (`Epilogue::BiasResidual`) and its
/// storage read inside the forward.
struct Linear<'a> {
    epilogue: Epilogue<'a>,
    /// Training with GELU on the CPU: the forward keeps x·Wᵀ ((B·T, N) f32, before bias and
    /// GELU), which GELU's derivative in `bwd` needs; `None` when nothing is tracked.
    pre_gelu: Option<Mutex<Option<Vec<f32>>>>,
    /// Wᵀ packed once for the bf16 kernel (`linear_prepacked`), used when the operands run on it.
    packed: Option<&'a PackedB>,
    /// f32 x and W multiplied in bf16 on the CPU's bf16 unit (rounded as packed), f32 out, and the
    /// backward's GEMMs likewise: a training step's f32 master weight with bf16 products
    /// (`PackedWeight::bf16_master`).
    bf16_master: bool,
}

fn linear(
    x: &Tensor,
    w: &Tensor,
    b: &Tensor,
    epilogue: Epilogue,
    packed: Option<&PackedB>,
    bf16_master: bool,
) -> candle_core::Result<Tensor> {
    let (_, _, k) = x.dims3()?;
    let (n, k_w) = w.dims2()?;
    if k != k_w || b.dims() != [n] {
        candle_core::bail!("linear: x {:?}, W {:?}, b {:?} do not fit y = x Wᵀ + b", x.dims(), w.dims(), b.dims());
    }
    if [x, w, b].iter().any(|t| t.track_op()) {
        // Training: recorded with its backward. Candle's own cast keeps W and b in the graph
        // (the parallel one below makes untracked tensors); the values are the same.
        let same = |t: &Tensor| t.contiguous()?.to_dtype(x.dtype());
        let epilogue = match epilogue {
            Epilogue::Bias => Epilogue::Bias,
            Epilogue::BiasGelu => Epilogue::BiasGelu,
            Epilogue::BiasResidual(_) => candle_core::bail!("linear: a tracked residual is added by candle (`linear_bias_residual`)"),
        };
        let pre_gelu = matches!(epilogue, Epilogue::BiasGelu).then(|| Mutex::new(None));
        return x.contiguous()?.apply_op3(&same(w)?, &same(b)?, Linear { epilogue, pre_gelu, packed: None, bf16_master });
    }
    let same = |t: &Tensor| cpu_kernels::elementwise::to_dtype(&t.contiguous()?, x.dtype(), Elementwise::Parallel);
    // W's packed panels are what the GEMM reads: W itself goes in as it is (no per-forward cast).
    let w = if packed.is_some() && x.device().is_cpu() { w.contiguous()? } else { same(w)? };
    let (x, b) = (x.contiguous()?, same(b)?);
    x.apply_op3_no_bwd(&w, &b, &Linear { epilogue, pre_gelu: None, packed, bf16_master })
}

/// `linear_prepacked`'s function with W as a plain tensor and `bf16_master` chosen by the caller:
/// what a training step scheduled by hand runs untracked (`scheduled`).
#[cfg(feature = "harness")] // only the scheduled training step (`scheduled`) uses it
pub(crate) fn linear_master(x: &Tensor, w: &Tensor, b: &Tensor, epilogue: Epilogue, bf16_master: bool) -> candle_core::Result<Tensor> {
    match epilogue {
        Epilogue::BiasResidual(r) => linear_residual(x, w, b, r, bf16_master),
        epilogue => linear(x, w, b, epilogue, None, bf16_master),
    }
}

/// `linear_bias_gelu` untracked, keeping GELU's input x·Wᵀ ((B·T, N) f32, before the bias) for a
/// backward the caller schedules itself (`bwd`'s `pre_gelu`); `bf16_master` as in `Linear`.
/// x, W, b contiguous. Returns (y, x·Wᵀ).
///
/// On the CPU's bf16 unit with an f32 master W, y comes out in bf16 (`master_linear`): what fc2's
/// GEMM and its weight gradient round it to anyway, so the numbers are the f32 y's, in half the
/// bytes. Otherwise `Linear`'s path, y in x's dtype.
#[cfg(feature = "harness")] // only the scheduled training step (`scheduled`) uses it
pub(crate) fn linear_bias_gelu_keeping(x: &Tensor, w: &Tensor, b: &Tensor, bf16_master: bool) -> candle_core::Result<(Tensor, Vec<f32>)> {
    let (_, _, k) = x.dims3()?;
    let (n, k_w) = w.dims2()?;
    if k != k_w || b.dims() != [n] {
        candle_core::bail!("linear: x {:?}, W {:?}, b {:?} do not fit y = x Wᵀ + b", x.dims(), w.dims(), b.dims());
    }
    if let (true, Some(out)) = (bf16_master, master_linear(x, w, b, MasterOut::GeluBf16)?) {
        return Ok(out);
    }
    let op = Linear { epilogue: Epilogue::BiasGelu, pre_gelu: Some(Mutex::new(None)), packed: None, bf16_master };
    let y = x.contiguous()?.apply_op3_no_bwd(&w.contiguous()?, &b.contiguous()?, &op)?;
    let kept = op.pre_gelu.and_then(|m| m.into_inner().ok().flatten());
    Ok((y, kept.ok_or_else(|| candle_core::Error::Msg("linear: the forward kept no x·Wᵀ (not on the CPU?)".into()))?))
}

/// y = r + x Wᵀ + b in f32 for an untracked x of either dtype and an f32 master W: with
/// `bf16_master` on the CPU's bf16 unit `master_linear` (x bf16 or f32, W rounded as packed, the
/// residual and bias added in the output pass); otherwise `linear_residual` (x cast to W's dtype).
#[cfg(feature = "harness")] // only the scheduled training step (`scheduled`) uses it
pub(crate) fn linear_bias_residual_master(
    x: &Tensor,
    w: &Tensor,
    b: &Tensor,
    r: &Tensor,
    bf16_master: bool,
) -> candle_core::Result<Tensor> {
    let (bsz, t, _) = x.dims3()?;
    if r.dims() != [bsz, t, w.dim(0)?] || r.dtype() != DType::F32 {
        candle_core::bail!("linear: residual {:?} ({:?}) is not the f32 output shape ({bsz}, {t}, {})", r.dims(), r.dtype(), w.dim(0)?);
    }
    match bf16_master.then(|| master_linear(x, w, b, MasterOut::Residual(r))).transpose()?.flatten() {
        Some((y, _)) => Ok(y),
        None => linear_residual(&x.to_dtype(w.dtype())?, w, b, r, bf16_master),
    }
}

/// What `master_linear`'s output pass makes.
#[cfg(feature = "harness")] // only the scheduled training step (`scheduled`) uses it
enum MasterOut<'a> {
    /// gelu(acc + b) rounded to bf16, acc kept in f32.
    GeluBf16,
    /// r + acc + b in f32.
    Residual(&'a Tensor),
}

/// x (B, T, K) bf16 or f32 · Wᵀ for an f32 master W (N, K) on this CPU's bf16 unit, Wᵀ packed
/// here (rounded to bf16 as packed), the output pass per `out`. `None` when the operands are not
/// that (off the CPU, another dtype, no bf16 unit): the caller's other path.
#[cfg(feature = "harness")] // only the scheduled training step (`scheduled`) uses it
fn master_linear(x: &Tensor, w: &Tensor, b: &Tensor, out: MasterOut) -> candle_core::Result<Option<(Tensor, Vec<f32>)>> {
    let kernel = Kernel::detect();
    let ok = x.device().is_cpu() && kernel.is_native() && kernel != Kernel::Mkl && [w, b].iter().all(|t| t.dtype() == DType::F32);
    if !ok || !matches!(x.dtype(), DType::F32 | DType::BF16) {
        return Ok(None);
    }
    let (bsz, t, k) = x.dims3()?;
    let n = w.dim(0)?;
    if w.dims() != [n, k] || b.dims() != [n] {
        candle_core::bail!("linear: x {:?}, W {:?}, b {:?} do not fit y = x Wᵀ + b", x.dims(), w.dims(), b.dims());
    }
    let m = bsz * t;
    let (x, w, b) = (x.contiguous()?, w.contiguous()?, b.contiguous()?);
    let (ws, wl) = w.storage_and_layout();
    let (bs, bl) = b.storage_and_layout();
    let (Storage::Cpu(ws), Storage::Cpu(bs)) = (&*ws, &*bs) else { return Ok(None) };
    let (wv, bv) = (f32_values(ws, wl, "W")?, f32_values(bs, bl, "b")?);
    let packed = PackedB::new(kernel, MatRef::row_major(&wv, n, k).t(), true).map_err(candle_core::Error::Msg)?;
    let (xs, xl) = x.storage_and_layout();
    let Storage::Cpu(xs) = &*xs else { return Ok(None) };
    let Some((x0, x1)) = xl.contiguous_offsets() else { return Ok(None) };
    let what = if xs.dtype() == DType::BF16 { "bf16 x, f32 W rounded as packed" } else { "f32 operands rounded as packed" };
    let shape = Shape::from((bsz, t, n));
    let err = candle_core::Error::Msg;
    match out {
        MasterOut::GeluBf16 => {
            cpu_kernels::trace::ran_with(|| {
                format!("fused linear: gemm bf16: {}, {what}, bias+gelu in its output pass, bf16 out", kernel.name())
            });
            let pass = |_: usize, j0: usize, row: &mut [f32]| bias_gelu_tanh(row, &bv[j0..j0 + row.len()]);
            // SAFETY: the GEMM's output pass stores every element of both (`gemm_packed_bf16_with`).
            let (mut y, mut keep) = unsafe { (uninit_of::<half::bf16>(m * n), uninit_of::<f32>(m * n)) };
            match xs {
                CpuStorage::BF16(xv) => bf16_gemm::gemm_packed_bf16_with(
                    &mut y,
                    Some(&mut keep),
                    MatRef::row_major(&xv[x0..x1], m, k),
                    &packed,
                    true,
                    Some(&pass),
                ),
                CpuStorage::F32(xv) => bf16_gemm::gemm_packed_bf16_with(
                    &mut y,
                    Some(&mut keep),
                    MatRef::row_major(&xv[x0..x1], m, k),
                    &packed,
                    true,
                    Some(&pass),
                ),
                _ => return Ok(None),
            }
            .map_err(err)?;
            let y = Tensor::from_storage(Storage::Cpu(CpuStorage::BF16(y)), shape, BackpropOp::none(), false);
            Ok(Some((y, keep)))
        }
        MasterOut::Residual(r) => {
            cpu_kernels::trace::ran_with(|| {
                format!("fused linear: gemm bf16: {}, {what}, bias+residual in its output pass", kernel.name())
            });
            let r = r.contiguous()?;
            let (rs, rl) = r.storage_and_layout();
            let Storage::Cpu(rs) = &*rs else { return Ok(None) };
            let res = f32_values(rs, rl, "residual")?;
            let pass = |i: usize, j0: usize, row: &mut [f32]| map_slice_in_place(row, &|j, v| v + (res[i * n + j0 + j] + bv[j0 + j]));
            // SAFETY: the GEMM's output pass stores every element (`gemm_packed_with`).
            let mut y = unsafe { uninit_of::<f32>(m * n) };
            match xs {
                CpuStorage::BF16(xv) => {
                    bf16_gemm::gemm_packed_with(&mut y, None, MatRef::row_major(&xv[x0..x1], m, k), &packed, true, Some(&pass))
                }
                CpuStorage::F32(xv) => {
                    bf16_gemm::gemm_packed_with(&mut y, None, MatRef::row_major(&xv[x0..x1], m, k), &packed, true, Some(&pass))
                }
                _ => return Ok(None),
            }
            .map_err(err)?;
            let y = Tensor::from_storage(Storage::Cpu(CpuStorage::F32(y)), shape, BackpropOp::none(), false);
            Ok(Some((y, Vec::new())))
        }
    }
}

impl CustomOp3 for Linear<'_> {
    fn name(&self) -> &'static str {
        match self.epilogue {
            Epilogue::Bias => "speedkit-linear-bias",
            Epilogue::BiasGelu => "speedkit-linear-bias-gelu",
            Epilogue::BiasResidual(_) => "speedkit-linear-bias-residual",
        }
    }

    /// The destination is filled with the bias (plus the residual) row by row, then the GEMM
    /// accumulates into it: dst = 1·dst + 1·x·Wᵀ. bf16 operands run on the CPU's bf16 unit
    /// (the engine's `bf16_gemm`, f32 accumulation into dst; f32 activations rounded to bf16 as
    /// they are packed, against W's prepacked panels) where it has one; otherwise, and for
    /// f16, they are widened to f32 first, as candle's own CPU matmul does.
    fn cpu_fwd(
        &self,
        xs: &CpuStorage,
        xl: &Layout,
        ws: &CpuStorage,
        wl: &Layout,
        bs: &CpuStorage,
        bl: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (bsz, t, k) = xl.shape().dims3()?;
        let n = wl.shape().dims()[0];
        let m = bsz * t;
        let operands = Operands::of(xs, xl, ws, wl, self.packed, self.bf16_master)?;
        cpu_kernels::trace::ran_with(|| {
            let epilogue = match self.epilogue {
                Epilogue::Bias => "bias",
                Epilogue::BiasGelu => "bias+gelu",
                Epilogue::BiasResidual(_) => "bias+residual",
            };
            format!("fused linear: {}, {epilogue} in its output pass", operands.name())
        });
        let b = f32_values(bs, bl, "b")?;
        let b = &b[..];
        let gelu = matches!(self.epilogue, Epilogue::BiasGelu);
        // y = gelu(acc + b) or acc + b for a row segment from column j0 (SIMD: `gelu_tanh`'s
        // formula in the engine's `bias_gelu_tanh`): the output pass of every path below that adds
        // the bias after the GEMM.
        let epilogue = |_: usize, j0: usize, row: &mut [f32]| match gelu {
            true => bias_gelu_tanh(row, &b[j0..j0 + row.len()]), // gelu_tanh's formula, on the engine's SIMD
            false => map_slice_in_place(row, &|j, v| v + b[j0 + j]),
        };
        if let (Operands::F32AsBf16 { x, w, kernel }, false) = (&operands, matches!(self.epilogue, Epilogue::BiasResidual(_))) {
            // f32 activations, bf16 products (a training step on a CPU's bf16 unit): W packed once
            // per forward, the bias (and GELU) applied to each block of the GEMM's accumulator in
            // L2, and GELU's input kept from the same block for the backward: no bias fill before
            // the GEMM, no copy and no GELU pass after it.
            let packed = PackedB::new(*kernel, MatRef::row_major(w, n, k).t(), true).map_err(candle_core::Error::Msg)?;
            // SAFETY: the GEMM's output pass stores every element of both (`gemm_packed_with`).
            let (mut out, mut keep) = unsafe { (uninit_of::<f32>(m * n), self.pre_gelu.as_ref().map(|_| uninit_of::<f32>(m * n))) };
            bf16_gemm::gemm_packed_with(&mut out, keep.as_deref_mut(), MatRef::row_major(x, m, k), &packed, true, Some(&epilogue))
                .map_err(candle_core::Error::Msg)?;
            if let (Some(slot), Some(keep)) = (&self.pre_gelu, keep) {
                *slot.lock().map_err(|_| candle_core::Error::Msg("linear: poisoned lock".into()))? = Some(keep);
            }
            return Ok((CpuStorage::F32(out), Shape::from((bsz, t, n))));
        }
        let mut out_dtype = xs.dtype();
        // bf16 out (bias or bias + GELU): the GEMM overwrites f32 rows, then one pass adds the bias
        // (and GELU) and narrows each row while it is in L1, instead of a bias fill before the GEMM
        // and a narrowing pass after it (two passes over the f32 output fewer).
        let narrow = out_dtype == DType::BF16 && !matches!(self.epilogue, Epilogue::BiasResidual(_));
        if let (true, None, Operands::Bf16 { x, packed: Some(wt), .. }) = (narrow, &self.pre_gelu, &operands) {
            // bf16 out with W packed: bias (and GELU) applied to each block of the GEMM's f32
            // accumulator while it is in L2, then rounded as it is stored — the output pass of
            // the GEMM itself, no m × n f32 buffer and no pass of its own.
            // SAFETY: the GEMM's output pass stores every element (`gemm_packed_bf16_with`).
            let mut y = unsafe { uninit_of::<half::bf16>(m * n) };
            bf16_gemm::gemm_packed_bf16_with(&mut y, None, MatRef::row_major(x, m, k), wt, true, Some(&epilogue))
                .map_err(candle_core::Error::Msg)?;
            return Ok((CpuStorage::BF16(y), Shape::from((bsz, t, n))));
        }
        if let Epilogue::BiasResidual(r) = &self.epilogue {
            // f32 out = residual + bias + x·Wᵀ, the residual and bias added to each block of the
            // GEMM's accumulator while it is in L2: C written once, never read (no fill pass,
            // and no load and store of C per K slice). W packed here when `build` did not. MKL's
            // GEMM (asked for by name) and the f32 GEMM take the fill-then-accumulate path below.
            let owned;
            let packed_w = match &operands {
                Operands::Bf16 { packed: Some(wt), .. } | Operands::F32Packed { packed: wt, .. } => Some(*wt),
                Operands::Bf16 { w, kernel, packed: None, .. } if *kernel != Kernel::Mkl => {
                    owned = PackedB::new(*kernel, MatRef::row_major(w, n, k).t(), true).map_err(candle_core::Error::Msg)?;
                    Some(&owned)
                }
                Operands::F32AsBf16 { w, kernel, .. } if *kernel != Kernel::Mkl => {
                    owned = PackedB::new(*kernel, MatRef::row_major(w, n, k).t(), true).map_err(candle_core::Error::Msg)?;
                    Some(&owned)
                }
                _ => None,
            };
            if let Some(wt) = packed_w {
                let (rs, rl) = r.storage_and_layout();
                let Storage::Cpu(rs) = &*rs else { candle_core::bail!("linear: the residual is not on the CPU") };
                let res = f32_values(rs, rl, "residual")?;
                if res.len() != m * n {
                    candle_core::bail!("linear: the residual {:?} is not the output's shape ({bsz}, {t}, {n})", rl.shape());
                }
                let add = |i: usize, j0: usize, row: &mut [f32]| map_slice_in_place(row, &|j, v| v + (res[i * n + j0 + j] + b[j0 + j]));
                // SAFETY: the GEMM's output pass stores every element (`gemm_packed_with`).
                let mut out = unsafe { uninit_of::<f32>(m * n) };
                match &operands {
                    Operands::Bf16 { x, .. } => {
                        bf16_gemm::gemm_packed_with(&mut out, None, MatRef::row_major(x, m, k), wt, true, Some(&add))
                    }
                    Operands::F32Packed { x, .. } | Operands::F32AsBf16 { x, .. } => {
                        bf16_gemm::gemm_packed_with(&mut out, None, MatRef::row_major(x, m, k), wt, true, Some(&add))
                    }
                    Operands::F32 { .. } => unreachable!("no packed W for the f32 GEMM"),
                }
                .map_err(candle_core::Error::Msg)?;
                return to_storage(out, rs.dtype()).map(|s| (s, Shape::from((bsz, t, n))));
            }
        }
        // SAFETY: written whole before it is read — by the bias (and residual) fill below, or, for
        // a bias after the GEMM, by the GEMM itself (β = 0: it never reads dst).
        let mut out = unsafe { uninit_of::<f32>(m * n) };
        // SAFETY: when narrowing, the pass after each GEMM block writes its rows whole.
        let mut narrowed = if narrow { unsafe { uninit_of::<half::bf16>(m * n) } } else { Vec::new() };
        match self.epilogue {
            Epilogue::BiasResidual(r) => {
                let (rs, rl) = r.storage_and_layout();
                let Storage::Cpu(rs) = &*rs else { candle_core::bail!("linear: the residual is not on the CPU") };
                let r = f32_values(rs, rl, "residual")?;
                out.par_chunks_mut(n).zip(r.par_chunks(n)).for_each(|(o, r)| map_slice(o, r, &|i, r| r + b[i]));
                out_dtype = rs.dtype();
            }
            Epilogue::Bias if !narrow => out.par_chunks_mut(n).for_each(|o| o.copy_from_slice(b)),
            Epilogue::Bias | Epilogue::BiasGelu => {} // the bias goes in after the GEMM
        }
        let bias_after = gelu || narrow;
        // training: x·Wᵀ, for bwd. SAFETY: each block's rows are copied in whole after its GEMM.
        let mut pre_gelu = self.pre_gelu.as_ref().map(|_| unsafe { uninit_of::<f32>(m * n) });
        let rows = if gelu { GELU_ROWS } else { m.max(1) };
        for r0 in (0..m).step_by(rows) {
            let mb = rows.min(m - r0);
            let dst = &mut out[r0 * n..(r0 + mb) * n];
            // Bias after: the GEMM overwrites dst (β = 0: it never reads the zeros), then one pass
            // adds the bias (and applies GELU); otherwise it accumulates onto the bias (and
            // residual) rows.
            operands.gemm_into(dst, (r0, mb), (n, k), !bias_after)?;
            if let Some(keep) = pre_gelu.as_mut() {
                keep[r0 * n..(r0 + mb) * n].copy_from_slice(dst);
            }
            if bias_after {
                // on all threads
                if narrow {
                    let y = &mut narrowed[r0 * n..(r0 + mb) * n];
                    dst.par_chunks_mut(ROWS_PER_TASK * n).zip(y.par_chunks_mut(ROWS_PER_TASK * n)).for_each(|(block, y)| {
                        for (row, y) in block.chunks_exact_mut(n).zip(y.chunks_exact_mut(n)) {
                            epilogue(0, 0, row);
                            narrow_bf16(row, y);
                        }
                    });
                } else {
                    dst.par_chunks_mut(ROWS_PER_TASK * n).for_each(|block| block.chunks_exact_mut(n).for_each(|row| epilogue(0, 0, row)));
                }
            }
        }
        if let (Some(slot), Some(keep)) = (&self.pre_gelu, pre_gelu) {
            *slot.lock().map_err(|_| candle_core::Error::Msg("linear: poisoned lock".into()))? = Some(keep);
        }
        let out = if narrow { CpuStorage::BF16(narrowed) } else { to_storage(out, out_dtype)? };
        Ok((out, Shape::from((bsz, t, n))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        xs: &candle_core::CudaStorage,
        xl: &Layout,
        ws: &candle_core::CudaStorage,
        wl: &Layout,
        bs: &candle_core::CudaStorage,
        bl: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        let (bsz, t, _) = xl.shape().dims3()?;
        let n = wl.shape().dims()[0];
        let y = crate::cuda::linear(xs, xl, ws, wl, bs, bl, self.epilogue)?;
        Ok((y, Shape::from((bsz, t, n))))
    }

    /// dx, dW, db in the arguments' dtypes: the bias gradient (and GELU's derivative) in one pass
    /// over dy (`backward`), then dx = dz·W and dW = dzᵀ·x (`linear_grads`: the engine's bf16 GEMM or candle's f32 matmul). On CUDA the bias
    /// linear's db comes out of the weight-gradient GEMM (cuBLASLt's BGRADB, `cuda_lt`); bias +
    /// GELU outside `mlp` takes GELU's derivative by candle ops, then cuBLASLt's two GEMMs.
    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        b: &Tensor,
        _y: &Tensor,
        dy: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        #[cfg(feature = "cuda")]
        if x.device().is_cuda() && matches!(self.epilogue, Epilogue::Bias) {
            let (dx, dw, db) = crate::cuda_lt::linear_bwd(x, w, dy, true)?;
            let db = db.ok_or_else(|| candle_core::Error::Msg("linear: BGRADB wrote no bias gradient".into()))?;
            return Ok((Some(dx), Some(dw), Some(db.to_dtype(b.dtype())?)));
        }
        let (dz, db) = match self.epilogue {
            Epilogue::Bias => backward::bias_bwd(dy)?,
            Epilogue::BiasGelu => {
                let slot = self
                    .pre_gelu
                    .as_ref()
                    .map(|s| s.lock().map_err(|_| candle_core::Error::Msg("linear: poisoned lock".into())))
                    .transpose()?;
                backward::bias_gelu_bwd(dy, slot.as_ref().and_then(|s| s.as_deref()), x, w, b)?
            }
            Epilogue::BiasResidual(_) => {
                candle_core::bail!("linear: bias + residual is never recorded for backward (see `linear_bias_residual`)")
            }
        };
        let (dx, dw) = linear_grads(x, w, &dz, self.bf16_master)?;
        Ok((Some(dx), Some(dw), Some(db.to_dtype(b.dtype())?)))
    }
}

// ---------------------------------------------------------------------------------------------
// Attention on the one QKV output, while training on the CPU
// ---------------------------------------------------------------------------------------------

/// Stage 2's attention on the QKV concatenation's one output: qkv (B, T, 3C) f32 holds q, k and
/// v side by side in each row (C = n_head · d_head each); returns (B, T, C). The forward is stage
/// 2's CPU kernel (`kernel`) reading the three where they lie, as it reads stage 3's views of the
/// same tensor; the difference is in training. Through views, candle differentiates each of the
/// three slices on its own: every slice's gradient is padded back to (B, T, 3C) with zeros (a
/// 18 MiB copy at `small`) and added into qkv's (three reads and writes of it), and the
/// (B, T, 3, n_head, d_head) reshape and the (B, T, C) one after attention each add a gradient
/// pass more. Here the op's input is qkv itself: its backward writes dq, dk and dv into one
/// (B, T, 3C) tensor, row by row, and candle adds it once. Untracked, or off the CPU, use stage
/// 2's op on views (no backward to save). Test: `tests/fused_vs_twin.rs` (same output bits, same
/// gradients).
pub fn qkv_attention(qkv: &Tensor, n_head: usize, kernel: stage2_sdpa::attention::CpuKernel, causal: bool) -> candle_core::Result<Tensor> {
    let (_, _, c3) = qkv.dims3()?;
    if !qkv.device().is_cpu() || qkv.dtype() != DType::F32 {
        candle_core::bail!("qkv_attention: a CPU f32 QKV output, got {:?} on {:?}", qkv.dtype(), qkv.device().location());
    }
    if n_head == 0 || c3 % (3 * n_head) != 0 {
        candle_core::bail!("qkv_attention: the last dimension {c3} is not 3 · n_head ({n_head}) · d_head");
    }
    let scale = 1.0 / ((c3 / (3 * n_head)) as f32).sqrt();
    qkv.contiguous()?.apply_op1(QkvAttention { n_head, scale, causal, kernel, lse: Mutex::new(None) })
}

/// `qkv_attention` untracked, keeping the log-sum-exp ((B, n_head, T) f32) for a backward the
/// caller schedules itself (`qkv_attention_bwd`). Returns (o, lse).
#[cfg(feature = "harness")] // only the scheduled training step (`scheduled`) uses it
pub(crate) fn qkv_attention_keeping(
    qkv: &Tensor,
    n_head: usize,
    kernel: stage2_sdpa::attention::CpuKernel,
    causal: bool,
) -> candle_core::Result<(Tensor, Option<Vec<f32>>)> {
    let qkv = qkv.detach();
    let (_, _, c3) = qkv.dims3()?;
    if !qkv.device().is_cpu() || qkv.dtype() != DType::F32 || n_head == 0 || c3 % (3 * n_head) != 0 {
        candle_core::bail!(
            "qkv_attention: a CPU f32 QKV output with a last dimension of 3 · n_head ({n_head}) · d_head, got {:?}",
            qkv.dims()
        );
    }
    let scale = 1.0 / ((c3 / (3 * n_head)) as f32).sqrt();
    let op = QkvAttention { n_head, scale, causal, kernel, lse: Mutex::new(None) };
    let o = qkv.contiguous()?.apply_op1_no_bwd(&op)?;
    Ok((o, op.lse.into_inner().map_err(|_| candle_core::Error::Msg("qkv_attention: poisoned lock".into()))?))
}

/// `qkv_attention`'s backward: dqkv (B, T, 3C), each row [dq | dk | dv], from the forward's
/// qkv, output o, the log-sum-exp it kept, and d_o.
pub(crate) fn qkv_attention_bwd(
    qkv: &Tensor,
    o: &Tensor,
    d_o: &Tensor,
    lse: Option<&[f32]>,
    n_head: usize,
    kernel: stage2_sdpa::attention::CpuKernel,
    causal: bool,
) -> candle_core::Result<Tensor> {
    let (b, t, c3) = qkv.dims3()?;
    let (c, h) = (c3 / 3, n_head);
    let scale = 1.0 / ((c / h) as f32).sqrt();
    let heads = qkv.detach().reshape((b, t, 3, h, c / h))?;
    let part = |i: usize| heads.narrow(2, i, 1)?.squeeze(2); // (B, T, n_head, d_head) views, no copy
    let (q, k, v) = (part(0)?, part(1)?, part(2)?);
    let (o, d_o) = (o.detach().reshape((b, t, h, c / h))?, d_o.detach().reshape((b, t, h, c / h))?);
    // bf16 pairs where the forward ran them (as stage 2's op decides).
    let bf16 = matches!(kernel, stage2_sdpa::attention::CpuKernel::RegistersBf16);
    let dqkv = stage2_sdpa::attention::backward::attention_bwd_packed(&q, &k, &v, &o, &d_o, lse, scale, causal, bf16)?;
    dqkv.reshape((b, t, c3)) // (B, T, 3, n_head, d_head): each row [dq | dk | dv]
}

struct QkvAttention {
    n_head: usize,
    scale: f32,
    causal: bool,
    kernel: stage2_sdpa::attention::CpuKernel,
    /// The forward's log-sum-exp, (B, n_head, T) f32, for the backward (taken: one per forward).
    lse: Mutex<Option<Vec<f32>>>,
}

/// q, k or v (`which` 0, 1, 2) of a contiguous (B, T, 3C) layout, as a (B, T, n_head, d_head)
/// layout over the same storage: rows 3C apart, starting `which · C` in.
fn qkv_part(l: &Layout, n_head: usize, which: usize) -> candle_core::Result<Layout> {
    let (b, t, c3) = l.shape().dims3()?;
    let c = c3 / 3;
    Ok(Layout::new((b, t, n_head, c / n_head).into(), vec![t * c3, c3, c / n_head, 1], l.start_offset() + which * c))
}

impl candle_core::CustomOp1 for QkvAttention {
    fn name(&self) -> &'static str {
        "speedkit-qkv-attention"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let (b, t, c3) = l.shape().dims3()?;
        let op = cpu_kernels::attention::CpuAttention::new(self.kernel, self.scale, self.causal, true);
        let part = |which: usize| qkv_part(l, self.n_head, which);
        let (out, _) = op.forward((s, &part(0)?), (s, &part(1)?), (s, &part(2)?))?;
        *self.lse.lock().map_err(|_| candle_core::Error::Msg("qkv_attention: poisoned lock".into()))? = op.take_lse();
        Ok((out, Shape::from((b, t, c3 / 3))))
    }

    /// FlashAttention-2's backward from the kept log-sum-exp (stage 2's kernels), dq, dk and dv
    /// written into one (B, T, 3C) gradient, each row [dq | dk | dv] (`attention_bwd_packed`).
    fn bwd(&self, qkv: &Tensor, o: &Tensor, d_o: &Tensor) -> candle_core::Result<Option<Tensor>> {
        let lse = self.lse.lock().map_err(|_| candle_core::Error::Msg("qkv_attention: poisoned lock".into()))?.take();
        Ok(Some(qkv_attention_bwd(qkv, o, d_o, lse.as_deref(), self.n_head, self.kernel, self.causal)?))
    }
}

/// `qkv_attention` on CUDA while training: stage 2's kernel (`kernel`: v2, or v1) forward on the
/// three slices of qkv (B, T, 3C) in bf16 or f16, read where they lie, and its backward written
/// as one (B, T, 3C) gradient. Through stage 2's op on three views, candle pads each slice's
/// gradient back to (B, T, 3C) with zeros and adds the three into qkv's; here q, k, v and dO are
/// stacked for the kernel in one copy (qkv is already (B, T, 3, n_head, d_head); dO joins it) and
/// dQ, dK, dV come back as (B, T, 3, n_head, d_head) in one strided cast.
#[cfg(feature = "cuda")]
pub fn qkv_attention_cuda(
    qkv: &Tensor,
    n_head: usize,
    kernel: stage2_sdpa::attention::AttentionKernel,
    causal: bool,
) -> candle_core::Result<Tensor> {
    let (_, _, c3) = qkv.dims3()?;
    if !qkv.device().is_cuda() || !matches!(qkv.dtype(), DType::BF16 | DType::F16) {
        candle_core::bail!("qkv_attention_cuda: a CUDA bf16 or f16 QKV output, got {:?} on {:?}", qkv.dtype(), qkv.device().location());
    }
    if n_head == 0 || c3 % (3 * n_head) != 0 {
        candle_core::bail!("qkv_attention_cuda: the last dimension {c3} is not 3 · n_head ({n_head}) · d_head");
    }
    let scale = 1.0 / ((c3 / (3 * n_head)) as f32).sqrt();
    qkv.contiguous()?.apply_op1(QkvAttentionCuda { n_head, scale, causal, kernel, lse: Mutex::new(None) })
}

#[cfg(feature = "cuda")]
struct QkvAttentionCuda {
    n_head: usize,
    scale: f32,
    causal: bool,
    kernel: stage2_sdpa::attention::AttentionKernel,
    /// The forward kernel's log-sum-exp, (B · n_head · T) f32 on the device (taken: one backward per forward).
    lse: Mutex<Option<Tensor>>,
}

#[cfg(feature = "cuda")]
impl candle_core::CustomOp1 for QkvAttentionCuda {
    fn name(&self) -> &'static str {
        "speedkit-qkv-attention-cuda"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        candle_core::bail!("qkv_attention_cuda runs on CUDA; the CPU's is qkv_attention")
    }

    fn cuda_fwd(&self, s: &candle_core::CudaStorage, l: &Layout) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        let (b, t, c3) = l.shape().dims3()?;
        let c = c3 / 3;
        let part = |which: usize| qkv_part(l, self.n_head, which);
        let (q_l, k_l, v_l) = (part(0)?, part(1)?, part(2)?);
        let (out, _, lse) =
            stage2_sdpa::attention_cuda::cuda_fwd(self.kernel, self.scale, self.causal, (s, &q_l), (s, &k_l), (s, &v_l), true)?;
        let lse = lse.ok_or_else(|| candle_core::Error::Msg("qkv_attention_cuda: the forward kernel kept no log-sum-exp".into()))?;
        let n = lse.len();
        let lse = Tensor::from_storage(
            Storage::Cuda(candle_core::CudaStorage::wrap_cuda_slice(lse, s.device.clone())),
            n,
            BackpropOp::none(),
            false,
        );
        *self.lse.lock().map_err(|_| candle_core::Error::Msg("qkv_attention_cuda: poisoned lock".into()))? = Some(lse);
        Ok((out, Shape::from((b, t, c))))
    }

    /// dqkv (B, T, 3C), each row [dq | dk | dv], from stage 2's backward kernel.
    fn bwd(&self, qkv: &Tensor, o: &Tensor, d_o: &Tensor) -> candle_core::Result<Option<Tensor>> {
        let lse = self.lse.lock().map_err(|_| candle_core::Error::Msg("qkv_attention_cuda: poisoned lock".into()))?.take();
        let lse = lse.ok_or_else(|| candle_core::Error::Msg("qkv_attention_cuda: this forward's backward already ran".into()))?;
        let (b, t, c3) = qkv.dims3()?;
        let (h, d) = (self.n_head, c3 / 3 / self.n_head);
        let dt = qkv.dtype();
        let heads = |x: &Tensor, n: usize| x.detach().reshape((b, t, n, h, d)); // (B, T, n, n_head, d_head)
        let qkvo = Tensor::cat(&[&heads(qkv, 3)?, &heads(&d_o.to_dtype(dt)?, 1)?], 2)?; // (B, T, 4, n_head, d_head), one copy
        let o4 = o.detach().reshape((b, t, h, d))?;
        let d_o4 = d_o.detach().reshape((b, t, h, d))?;
        // dQ, dK, dV: (3, B, T, n_head, d_head) f32
        let grads = stage2_sdpa::attention_cuda::cuda_bwd_stacked(&qkvo, &o4, &d_o4, &lse, self.scale, self.causal)?;

        // (B, T, 3, n_head, d_head) in one strided cast: rows [dq | dk | dv]
        Ok(Some(grads.permute((1, 2, 0, 3, 4))?.to_dtype(dt)?.reshape((b, t, c3))?))
    }
}

// ---------------------------------------------------------------------------------------------
// The MLP while training: fc1 and fc2 paired
// ---------------------------------------------------------------------------------------------

/// y = gelu_tanh(x W₁ᵀ + b₁) W₂ᵀ + b₂, fc1 and fc2 as one layer (TransformerEngine's LayerNormMLP
/// is one module for the same reason). x: (B, T, C); W₁: (FF, C); b₁: (FF); W₂: (C, FF); b₂: (C).
///
/// Untracked, it is `linear_bias_gelu` then `linear_bias`. Tracked, GELU's derivative moves into
/// fc2's backward, where on CUDA it rides on the data-gradient GEMM: cuBLASLt's DGELU_BGRAD
/// writes dz₁ = gelu′(z) ∘ (dy W₂) instead of dh = dy W₂, and db₁ = Σ_tokens dz₁ through its bias
/// pointer; z = x W₁ᵀ + b₁ is what fc1's forward GEMM stored beside h (GELU_AUX_BIAS). No
/// element-wise pass and no GEMM recomputing z; the weight gradients come with BGRADB's db.
///
/// Candle records an op of at most three inputs, so the layer is two recorded ops, fc1 (x, W₁, b₁)
/// and fc2 (h, W₂, b₂), sharing an `MlpPair`. **The pairing invariant**: h is made here and
/// consumed only by fc2, never returned, so in candle's backward the gradient that reaches fc1's
/// op is exactly what fc2's op returned for h. fc2's backward therefore returns dz₁ (not dh) as
/// "h's gradient", and leaves db₁ in the pair; fc1's backward takes its incoming gradient as dz₁
/// and db₁ from the pair. Were h visible, another consumer's dh would be added to dz₁ and the
/// sum would be wrong: that is why no function hands h out. (candle's `GradStore` does hold dz₁
/// under h's id, which nothing outside this function can name.)
///
/// Off CUDA the same two ops run with candle ops for dz₁ (`backward::gelu_tanh_grad_ops`), which is
/// how the pairing is tested without a GPU; stage 3's block takes this path on CUDA only, and on
/// the CPU keeps `linear_bias_gelu`'s one-pass backward, whose dz₁ stays f32 (here dz₁ returns
/// in h's dtype, as cuBLASLt writes it).
pub fn mlp(x: &Tensor, w1: &Tensor, b1: &Tensor, w2: &Tensor, b2: &Tensor) -> candle_core::Result<Tensor> {
    if ![x, w1, b1, w2, b2].iter().any(|t| t.track_op()) {
        return linear_bias(&linear_bias_gelu(x, w1, b1)?, w2, b2);
    }
    let (_, _, c) = x.dims3()?;
    let (ff, c1) = w1.dims2()?;
    if c1 != c || b1.dims() != [ff] || w2.dims() != [c, ff] || b2.dims() != [c] {
        candle_core::bail!(
            "mlp: x {:?}, W1 {:?}, b1 {:?}, W2 {:?}, b2 {:?} do not fit",
            x.dims(),
            w1.dims(),
            b1.dims(),
            w2.dims(),
            b2.dims()
        );
    }
    #[cfg(feature = "cuda")]
    if x.device().is_cuda() && !crate::gemm_args::gelu_aux_fits(ff) {
        // cuBLASLt's aux matrix (z) needs a leading dimension that is a multiple of 8: the two
        // linears' own backward (GELU's derivative by candle ops) instead.
        return linear_bias(&linear_bias_gelu(x, w1, b1)?, w2, b2);
    }
    let same = |t: &Tensor| t.contiguous()?.to_dtype(x.dtype()); // candle's cast: keeps the graph
    let pair = Arc::new(MlpPair::default());
    let h = x.contiguous()?.apply_op3(&same(w1)?, &same(b1)?, MlpHalf { fc2: false, pair: pair.clone() })?; // (B, T, FF)
    h.apply_op3(&same(w2)?, &same(b2)?, MlpHalf { fc2: true, pair }) // (B, T, C)
}

/// Slow twin of `mlp`: the two linears' slow twins.
pub fn mlp_slow(x: &Tensor, w1: &Tensor, b1: &Tensor, w2: &Tensor, b2: &Tensor) -> candle_core::Result<Tensor> {
    linear_bias_slow(&linear_bias_gelu_slow(x, w1, b1)?, w2, b2)
}

/// What `mlp`'s two ops hand each other (see the pairing invariant at `mlp`).
#[derive(Default)]
struct MlpPair {
    /// z = x W₁ᵀ + b₁ (B, T, FF), written by fc1's forward: cuBLASLt's aux output in h's dtype on
    /// CUDA, f32 on the CPU.
    z: Mutex<Option<Tensor>>,
    /// db₁ (FF), written by fc2's backward for fc1's.
    db1: Mutex<Option<Tensor>>,
}

fn locked<T>(m: &Mutex<T>) -> candle_core::Result<std::sync::MutexGuard<'_, T>> {
    m.lock().map_err(|_| candle_core::Error::Msg("mlp: poisoned lock".into()))
}

/// One of `mlp`'s two ops: fc1 (inputs x, W₁, b₁; output h = gelu(z)) or fc2 (h, W₂, b₂; y).
struct MlpHalf {
    fc2: bool,
    pair: Arc<MlpPair>,
}

impl CustomOp3 for MlpHalf {
    fn name(&self) -> &'static str {
        if self.fc2 {
            "speedkit-mlp-fc2"
        } else {
            "speedkit-mlp-fc1"
        }
    }

    /// The f32 GEMM (`gemm_into`), then the bias (and GELU, keeping z) row by row.
    fn cpu_fwd(
        &self,
        xs: &CpuStorage,
        xl: &Layout,
        ws: &CpuStorage,
        wl: &Layout,
        bs: &CpuStorage,
        bl: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (bsz, t, k) = xl.shape().dims3()?;
        let n = wl.shape().dims()[0];
        let (x, w, b) = (f32_values(xs, xl, "x")?, f32_values(ws, wl, "W")?, f32_values(bs, bl, "b")?);
        // SAFETY: the GEMM overwrites every element (β = 0: it never reads dst).
        let mut out = unsafe { uninit_of::<f32>(bsz * t * n) };
        cpu_kernels::f32_gemm::gemm_into(&mut out, &x, &w, (bsz * t, n, k), false);
        out.par_chunks_mut(n).for_each(|row| map_slice_in_place(row, &|j, v| v + b[j])); // z = x·Wᵀ + b
        if !self.fc2 {
            *locked(&self.pair.z)? = Some(Tensor::from_vec(out.clone(), (bsz, t, n), &candle_core::Device::Cpu)?);
            out.par_chunks_mut(n).for_each(|row| map_slice_in_place(row, &|_, v| gelu_tanh(v)));
        }
        Ok((to_storage(out, xs.dtype())?, Shape::from((bsz, t, n))))
    }

    /// fc1: GELU_AUX_BIAS (h and z from one GEMM); fc2: the BIAS epilogue, as `linear_bias`.
    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        xs: &candle_core::CudaStorage,
        xl: &Layout,
        ws: &candle_core::CudaStorage,
        wl: &Layout,
        bs: &candle_core::CudaStorage,
        bl: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        let (bsz, t, _) = xl.shape().dims3()?;
        let n = wl.shape().dims()[0];
        let shape = Shape::from((bsz, t, n));
        if self.fc2 {
            return Ok((crate::cuda::linear(xs, xl, ws, wl, bs, bl, Epilogue::Bias)?, shape));
        }
        let (h, z) = crate::cuda_lt::linear_gelu_aux(xs, xl, ws, wl, bs, bl)?; // z: (B, T, FF), h's dtype
        *locked(&self.pair.z)? = Some(Tensor::from_storage(Storage::Cuda(z), shape.clone(), BackpropOp::none(), false));
        Ok((h, shape))
    }

    /// fc2 (x = h, w = W₂, b = b₂, dy): dW₂ and db₂, then dz₁ = gelu′(z) ∘ (dy W₂) and db₁, which it
    /// leaves in the pair; it returns dz₁ as h's gradient. fc1 (dy = dz₁): dx and dW₁, db₁ from the
    /// pair. On CUDA: cuBLASLt's BGRADB and DGELU_BGRAD epilogues (`cuda_lt`).
    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        b: &Tensor,
        _y: &Tensor,
        dy: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        if !self.fc2 {
            let db1 = locked(&self.pair.db1)?.clone();
            let db1 =
                db1.ok_or_else(|| candle_core::Error::Msg("mlp: fc1's backward ran before fc2's left db1 (h used outside mlp?)".into()))?;
            let (dx, dw) = linear_grads(x, w, dy, false)?;
            return Ok((Some(dx), Some(dw), Some(db1.to_dtype(b.dtype())?)));
        }
        let z = locked(&self.pair.z)?.clone();
        let z = z.ok_or_else(|| candle_core::Error::Msg("mlp: fc2's backward without fc1's z".into()))?;
        #[cfg(feature = "cuda")]
        if x.device().is_cuda() {
            let (dz1, db1, dw, db) = crate::cuda_lt::mlp_fc2_bwd(x, w, dy, &z)?;
            *locked(&self.pair.db1)? = Some(db1);
            return Ok((Some(dz1), Some(dw), Some(db.to_dtype(b.dtype())?)));
        }
        let (dz, db) = backward::bias_bwd(dy)?;
        let (dh, dw) = backward::linear_bwd(x, w, &dz, false)?;
        let ff = x.dim(D::Minus1)?;
        let dz1 = (dh.to_dtype(DType::F32)? * backward::gelu_tanh_grad_ops(&z.to_dtype(DType::F32)?)?)?; // (B, T, FF)
        *locked(&self.pair.db1)? = Some(dz1.reshape(((), ff))?.sum(0)?);
        Ok((Some(dz1.to_dtype(x.dtype())?), Some(dw), Some(db.to_dtype(b.dtype())?)))
    }
}

/// dx = dz·W and dW = dzᵀ·x of a linear whose bias gradient comes from elsewhere: cuBLASLt's two
/// GEMMs on CUDA (`cuda_lt::linear_bwd`); on the CPU the engine's bf16 GEMMs when the forward's
/// products were bf16 (`backward::linear_bwd`), candle's f32 matmuls at fp32.
fn linear_grads(x: &Tensor, w: &Tensor, dz: &Tensor, bf16_master: bool) -> candle_core::Result<(Tensor, Tensor)> {
    #[cfg(feature = "cuda")]
    if x.device().is_cuda() {
        let (dx, dw, _) = crate::cuda_lt::linear_bwd(x, w, dz, false)?;
        return Ok((dx, dw));
    }
    backward::linear_bwd(x, w, dz, bf16_master)
}

/// The GEMM operands x (m × k) and W (n × k), row-major: bf16 in place when the CPU's bf16 unit
/// runs them (with Wᵀ's panels when they were packed for that kernel), else f32 (borrowed, or
/// widened on all threads).
enum Operands<'a> {
    Bf16 {
        x: &'a [half::bf16],
        w: &'a [half::bf16],
        kernel: Kernel,
        packed: Option<&'a PackedB>,
    },
    /// f32 activations against Wᵀ packed for the bf16 kernel: x rounded to bf16 as it is packed
    /// (stage 1's mixed precision on a CPU with a bf16 unit), f32 out.
    F32Packed {
        x: &'a [f32],
        packed: &'a PackedB,
    },
    /// f32 x and W (a training step's master weight) multiplied in bf16, each rounded as it is
    /// packed, f32 out.
    F32AsBf16 {
        x: &'a [f32],
        w: &'a [f32],
        kernel: Kernel,
    },
    F32 {
        x: Cow<'a, [f32]>,
        w: Cow<'a, [f32]>,
    },
}

impl<'a> Operands<'a> {
    fn of(
        xs: &'a CpuStorage,
        xl: &Layout,
        ws: &'a CpuStorage,
        wl: &Layout,
        packed: Option<&'a PackedB>,
        bf16_master: bool,
    ) -> candle_core::Result<Self> {
        let kernel = Kernel::detect();
        let packed = packed.filter(|p| p.kernel() == kernel);
        match (xs, ws, xl.contiguous_offsets(), wl.contiguous_offsets()) {
            (CpuStorage::F32(x), CpuStorage::F32(w), Some((x0, x1)), Some((w0, w1))) if bf16_master && kernel.is_native() => {
                Ok(Operands::F32AsBf16 { x: &x[x0..x1], w: &w[w0..w1], kernel })
            }
            (CpuStorage::BF16(x), CpuStorage::BF16(w), Some((x0, x1)), Some((w0, w1))) if kernel.is_native() => {
                Ok(Operands::Bf16 { x: &x[x0..x1], w: &w[w0..w1], kernel, packed })
            }
            (CpuStorage::F32(x), _, Some((x0, x1)), _) if kernel.is_native() && packed.is_some() => {
                Ok(Operands::F32Packed { x: &x[x0..x1], packed: packed.expect("checked on the line above") })
            }
            _ => Ok(Operands::F32 { x: f32_values(xs, xl, "x")?, w: f32_values(ws, wl, "W")? }),
        }
    }

    /// Rows r0..r0+mb of dst (mb × n) = x[r0..r0+mb] · Wᵀ (+ dst when `accumulate`).
    fn gemm_into(&self, dst: &mut [f32], (r0, mb): (usize, usize), (n, k): (usize, usize), accumulate: bool) -> candle_core::Result<()> {
        match self {
            Operands::Bf16 { x, w, kernel, packed } => {
                let x = MatRef::row_major(&x[r0 * k..(r0 + mb) * k], mb, k);
                match packed {
                    Some(wt) => bf16_gemm::gemm_packed(dst, x, wt, accumulate, true), // Wᵀ packed in `build`
                    None => bf16_gemm::gemm(*kernel, dst, x, MatRef::row_major(w, n, k).t(), accumulate, true), // W read transposed
                }
                .map_err(candle_core::Error::Msg)
            }
            Operands::F32Packed { x, packed } => {
                bf16_gemm::gemm_packed(dst, MatRef::row_major(&x[r0 * k..(r0 + mb) * k], mb, k), packed, accumulate, true)
                    .map_err(candle_core::Error::Msg)
            }
            Operands::F32AsBf16 { x, w, kernel } => {
                let x = MatRef::row_major(&x[r0 * k..(r0 + mb) * k], mb, k);
                bf16_gemm::gemm(*kernel, dst, x, MatRef::row_major(w, n, k).t(), accumulate, true).map_err(candle_core::Error::Msg)
            }
            Operands::F32 { x, w } => {
                cpu_kernels::f32_gemm::gemm_into(dst, &x[r0 * k..(r0 + mb) * k], w, (mb, n, k), accumulate);
                Ok(())
            }
        }
    }

    /// The GEMM these operands run, for the kernel trace.
    fn name(&self) -> String {
        match self {
            Operands::Bf16 { kernel, packed: Some(_), .. } => format!("gemm bf16: {}, prepacked W", kernel.name()),
            Operands::Bf16 { kernel, packed: None, .. } => format!("gemm bf16: {}", kernel.name()),
            Operands::F32Packed { packed, .. } => format!("gemm bf16: {}, prepacked W", packed.kernel().name()),
            Operands::F32AsBf16 { kernel, .. } => format!("gemm bf16: {}, f32 operands rounded as packed", kernel.name()),
            Operands::F32 { .. } if cfg!(feature = "mkl") => "gemm f32: mkl sgemm".into(),
            Operands::F32 { .. } => "gemm f32: gemm crate".into(),
        }
    }
}

/// GPT-2's GELU, tanh approximation: 0.5·v·(1 + tanh(u)), u = √(2/π)·(v + 0.044715·v³).
/// Since 1 + tanh(u) = 2·sigmoid(2u), this is v / (1 + e^(−2u)): one exp and one division,
/// about three times cheaper than libm's tanhf, and exact in the limits (v→±∞ gives v or −0).
/// The exp is `cpu_kernels::elementwise::exp_f32` (no libm call), so loops over GELU vectorise.
#[inline(always)]
pub fn gelu_tanh(v: f32) -> f32 {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    let u = SQRT_2_OVER_PI * (v + 0.044715 * v * v * v);
    v / (1.0 + exp_f32(-2.0 * u))
}

// ---------------------------------------------------------------------------------------------
// Storage helpers for the CPU forwards
// ---------------------------------------------------------------------------------------------

/// `t` in f32 and contiguous: the same tensor when it already is (no copy); on the CPU the cast
/// runs on all threads (`cpu_kernels::elementwise::to_dtype`).
fn f32_contiguous(t: &Tensor) -> candle_core::Result<Tensor> {
    if t.track_op() {
        return t.contiguous()?.to_dtype(DType::F32); // candle's cast keeps the graph; same values
    }
    cpu_kernels::elementwise::to_dtype(&t.contiguous()?, DType::F32, Elementwise::Parallel)
}

/// A contiguous CPU storage's values as f32: borrowed when they are f32, else widened on all threads.
pub fn f32_values<'a>(s: &'a CpuStorage, l: &Layout, what: &str) -> candle_core::Result<Cow<'a, [f32]>> {
    let Some((start, end)) = l.contiguous_offsets() else { candle_core::bail!("{what} must be contiguous") };
    Ok(match s {
        CpuStorage::F32(v) => Cow::Borrowed(&v[start..end]),
        CpuStorage::BF16(v) => Cow::Owned(par_convert(&v[start..end], half::bf16::to_f32)),
        CpuStorage::F16(v) => Cow::Owned(par_convert(&v[start..end], half::f16::to_f32)),
        s => candle_core::bail!("{what}: unsupported dtype {:?} (f32, bf16 or f16)", s.dtype()),
    })
}

/// f32 results as a CPU storage of `dtype`, narrowed on all threads.
fn to_storage(v: Vec<f32>, dtype: DType) -> candle_core::Result<CpuStorage> {
    Ok(match dtype {
        DType::F32 => CpuStorage::F32(v),
        DType::BF16 => {
            // SAFETY: the chunks cover out, each written whole by narrow_bf16.
            let mut out = unsafe { uninit_of::<half::bf16>(v.len()) };
            out.par_chunks_mut(16 * 1024).zip(v.par_chunks(16 * 1024)).for_each(|(o, s)| narrow_bf16(s, o));
            CpuStorage::BF16(out)
        }
        DType::F16 => CpuStorage::F16(par_convert(&v, half::f16::from_f32)),
        dt => candle_core::bail!("unsupported output dtype {dt:?} (f32, bf16 or f16)"),
    })
}
