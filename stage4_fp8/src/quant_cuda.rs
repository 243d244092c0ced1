//! FP8 quantisation on CUDA with our own kernels (`kernels/fp8.cu`, and the E4M3 LayerNorm of
//! `kernels/ln_fp8.cu`, compiled by build.rs to a cubin per architecture like stage 3's
//! `add_layer_norm.cu`): amax, the scale (current, or delayed from a history kept on the
//! device), the cast to E4M3 and back. candle's own F8E4M3 casts are never called on CUDA: in
//! candle 0.11.1 their kernels cannot be found (huggingface/candle#3886).
//!
//! The scale state's buffers (amax bits, scale, history) are tensors made once and written in
//! place by the kernels through their device pointers, so a CUDA graph captures the whole
//! update — no host round trip, no allocation — and every replay advances the history.

use candle_core::backend::BackendStorage;
use candle_core::cuda::cudarc::driver::{DevicePtr, LaunchConfig, PushKernelArg, SyncOnDrop};
use candle_core::cuda::{CudaDevice, CudaStorage};
use candle_core::{DType, Layout, Storage, Tensor};
use stage2_sdpa::cubin::{function, Cubins};
use stage3_fused::cuda::{view, wrap};
use Arg::{Null, Tensor as T, F32, I32, I64};

mod cubins {
    include!(concat!(env!("OUT_DIR"), "/cubins.rs"));
}
/// One module: `kernels/ln_fp8.cu`, which includes fp8.cu and stage 3's add_layer_norm.cu (its
/// E4M3 LayerNorm is their row and cast), so it holds every FP8 kernel.
pub static FP8: Cubins = Cubins { file: "stage4_fp8/kernels/ln_fp8.cu (with fp8.cu)", archs: cubins::LN_FP8 };
/// THREADS and CHUNK (= THREADS · ITEMS) of fp8.cu: each block owns CHUNK elements.
const THREADS: u32 = 256;
const CHUNK: usize = 256 * 16;

fn err(what: &str, e: impl std::fmt::Debug) -> candle_core::Error {
    candle_core::Error::Msg(format!("FP8 kernel: {what}: {e:?}"))
}

/// q = E4M3(x / s): the CUDA forward of `fp8::quantize` (a candle custom op). x: contiguous f32
/// or bf16; s: one f32.
pub fn quantize_fwd(xs: &CudaStorage, xl: &Layout, ss: &CudaStorage, sl: &Layout) -> candle_core::Result<CudaStorage> {
    let dev = xs.device().clone();
    let n = xl.shape().elem_count();
    let sv = view::<f32>(ss, sl)?;
    // SAFETY: the kernel writes every one of the n elements before anything reads them.
    let mut q = unsafe { dev.alloc::<float8::F8E4M3>(n)? };
    let (n64, no_amax) = (n as i64, 0u64); // amax_bits = nullptr: no amax in this pass
    let stream = dev.cuda_stream();
    let name = match xs.dtype() {
        DType::F32 => "fp8_quantize_f32",
        DType::BF16 => "fp8_quantize_bf16",
        dt => candle_core::bail!("quantize on CUDA: unsupported dtype {dt:?} (f32 or bf16)"),
    };
    let func = function(&dev, &FP8, name)?;
    let xf = if xs.dtype() == DType::F32 { Some(view::<f32>(xs, xl)?) } else { None };
    let xb = if xs.dtype() == DType::BF16 { Some(view::<half::bf16>(xs, xl)?) } else { None };
    let mut launch = stream.launch_builder(&func);
    match (&xf, &xb) {
        (Some(x), _) => launch.arg(x),
        (_, Some(x)) => launch.arg(x),
        _ => candle_core::bail!("quantize on CUDA: unsupported dtype {:?}", xs.dtype()),
    };
    launch.arg(&n64).arg(&sv).arg(&mut q).arg(&no_amax);
    let cfg = LaunchConfig { grid_dim: (blocks(n)?.max(1), 1, 1), block_dim: (THREADS, 1, 1), shared_mem_bytes: 0 };
    // SAFETY: the arguments are fp8_quantize_*'s (x, n, scale, q, amax_bits) in order and type.
    unsafe { launch.launch(cfg) }.map_err(|e| err(name, e))?;
    drop(launch);
    Ok(CudaStorage::wrap_cuda_slice(q, dev))
}

/// y = s·q in f32: the CUDA forward of `fp8::dequantize`. q: contiguous E4M3; s: one f32.
pub fn dequantize_fwd(qs: &CudaStorage, ql: &Layout, ss: &CudaStorage, sl: &Layout) -> candle_core::Result<CudaStorage> {
    let dev = qs.device().clone();
    let n = ql.shape().elem_count();
    let (qv, sv) = (view::<float8::F8E4M3>(qs, ql)?, view::<f32>(ss, sl)?);
    // SAFETY: the kernel writes every one of the n elements.
    let mut y = unsafe { dev.alloc::<f32>(n)? };
    let n64 = n as i64;
    let stream = dev.cuda_stream();
    let func = function(&dev, &FP8, "fp8_dequantize_f32")?;
    let mut launch = stream.launch_builder(&func);
    launch.arg(&qv).arg(&n64).arg(&sv).arg(&mut y);
    let cfg = LaunchConfig { grid_dim: (blocks(n)?.max(1), 1, 1), block_dim: (THREADS, 1, 1), shared_mem_bytes: 0 };
    // SAFETY: the arguments are fp8_dequantize_f32's (q, n, scale, y) in order and type.
    unsafe { launch.launch(cfg) }.map_err(|e| err("fp8_dequantize_f32", e))?;
    drop(launch);
    Ok(CudaStorage::wrap_cuda_slice(y, dev))
}

/// One kernel parameter: the device pointer of the i-th tensor passed to `launch`, a null
/// pointer, or a scalar (`long` is i64, `int` i32, `float` f32 in the kernel's signature).
#[derive(Clone, Copy, Debug)]
enum Arg {
    Tensor(usize),
    Null,
    I64(i64),
    I32(i32),
    F32(f32),
}

/// Launch `name` with `args`, in the kernel's parameter order. Every tensor must be contiguous
/// and on `dev`.
fn launch(dev: &CudaDevice, name: &str, blocks: u32, threads: u32, tensors: &[&Tensor], args: &[Arg]) -> candle_core::Result<()> {
    let func = function(dev, &FP8, name)?;
    let stream = dev.cuda_stream();
    let guards: Vec<_> = tensors.iter().map(|t| t.storage_and_layout()).collect();
    let mut ptrs = Vec::with_capacity(tensors.len());
    let mut syncs: Vec<SyncOnDrop<'_>> = Vec::with_capacity(tensors.len());
    for ((s, l), t) in guards.iter().zip(tensors) {
        let Storage::Cuda(cs) = &**s else { candle_core::bail!("{name}: expected a CUDA tensor") };
        let (start, _) = l.contiguous_offsets().ok_or_else(|| err(name, "expected a contiguous tensor"))?;
        let ((p, g), size) = match t.dtype() {
            DType::F32 => (cs.as_cuda_slice::<f32>()?.device_ptr(&stream), 4),
            DType::U32 => (cs.as_cuda_slice::<u32>()?.device_ptr(&stream), 4),
            DType::BF16 => (cs.as_cuda_slice::<half::bf16>()?.device_ptr(&stream), 2),
            DType::F8E4M3 => (cs.as_cuda_slice::<float8::F8E4M3>()?.device_ptr(&stream), 1),
            dt => candle_core::bail!("{name}: unsupported dtype {dt:?}"),
        };
        ptrs.push(p + (start * size) as u64);
        syncs.push(g);
    }
    // The values, kept alive until the launch (the builder holds references to them).
    let pointers: Vec<u64> = args
        .iter()
        .map(|a| match a {
            Arg::Tensor(i) => ptrs[*i],
            _ => 0, // Null; unused for scalars
        })
        .collect();
    let mut builder = stream.launch_builder(&func);
    for (a, p) in args.iter().zip(&pointers) {
        match a {
            Arg::Tensor(_) | Arg::Null => builder.arg(p),
            Arg::I64(v) => builder.arg(v),
            Arg::I32(v) => builder.arg(v),
            Arg::F32(v) => builder.arg(v),
        };
    }
    let cfg = LaunchConfig { grid_dim: (blocks.max(1), 1, 1), block_dim: (threads, 1, 1), shared_mem_bytes: 0 };
    // SAFETY: each call site lists the kernel's parameters in its order and types (raw device
    // pointers as u64, `long` as i64, `int` as i32, `float` as f32), and the pointers come from
    // live, contiguous tensors of the dtypes the kernel reads and writes.
    unsafe { builder.launch(cfg) }.map_err(|e| err(name, e))?;
    drop(syncs);
    Ok(())
}

fn blocks(n: usize) -> candle_core::Result<u32> {
    u32::try_from(n.div_ceil(CHUNK)).map_err(|_| err("grid", format!("{n} elements need more than 2^32 blocks")))
}

/// x as the kernels read it: contiguous f32 or bf16 (f16 is converted to f32 first).
fn readable(x: &Tensor) -> candle_core::Result<Tensor> {
    match x.dtype() {
        DType::F32 | DType::BF16 => x.contiguous(),
        _ => x.to_dtype(DType::F32)?.contiguous(),
    }
}

fn suffix(x: &Tensor) -> &'static str {
    if x.dtype() == DType::BF16 {
        "bf16"
    } else {
        "f32"
    }
}

/// amax_bits (a (1) u32 buffer, zero on entry) ← max(amax_bits, max|x|) as f32 bits.
fn amax_into(x: &Tensor, amax_bits: &Tensor) -> candle_core::Result<()> {
    let dev = x.device().as_cuda_device()?;
    let x = readable(x)?;
    let n = x.elem_count() as i64;
    launch(dev, &format!("fp8_amax_{}", suffix(&x)), blocks(x.elem_count())?, THREADS, &[&x, amax_bits], &[T(0), I64(n), T(1)])
}

/// max|x| as one f32: the CUDA forward of `fp8::amax` (a candle custom op). x: contiguous f32
/// or bf16. One pass, one atomic per block, into a zeroed u32 (the f32's bits); then those
/// bits reinterpreted as the f32 result on the device.
pub fn amax_fwd(xs: &CudaStorage, xl: &Layout) -> candle_core::Result<CudaStorage> {
    let dev = xs.device().clone();
    let n = xl.shape().elem_count();
    let stream = dev.cuda_stream();
    let mut bits = dev.alloc_zeros::<u32>(1)?;
    // SAFETY: fp8_scale_from_amax writes the one element before anything reads it.
    let mut out = unsafe { dev.alloc::<f32>(1)? };
    let name = match xs.dtype() {
        DType::F32 => "fp8_amax_f32",
        DType::BF16 => "fp8_amax_bf16",
        dt => candle_core::bail!("amax on CUDA: unsupported dtype {dt:?} (f32 or bf16)"),
    };
    let func = function(&dev, &FP8, name)?;
    let xf = if xs.dtype() == DType::F32 { Some(view::<f32>(xs, xl)?) } else { None };
    let xb = if xs.dtype() == DType::BF16 { Some(view::<half::bf16>(xs, xl)?) } else { None };
    let n64 = n as i64;
    let mut launch = stream.launch_builder(&func);
    match (&xf, &xb) {
        (Some(x), _) => launch.arg(x),
        (_, Some(x)) => launch.arg(x),
        _ => candle_core::bail!("amax on CUDA: unsupported dtype {:?}", xs.dtype()),
    };
    launch.arg(&n64).arg(&mut bits);
    let cfg = LaunchConfig { grid_dim: (blocks(n)?.max(1), 1, 1), block_dim: (THREADS, 1, 1), shared_mem_bytes: 0 };
    // SAFETY: the arguments are fp8_amax_*'s (x, n, amax_bits) in order and type.
    unsafe { launch.launch(cfg) }.map_err(|e| err(name, e))?;
    drop(launch);
    // scale_from_amax with pow2_margin = 448 gives s = max(amax, FLT_MIN): the amax itself
    // (FLT_MIN only for an all-zero x, where amax is then reported as FLT_MIN, not 0).
    let func = function(&dev, &FP8, "fp8_scale_from_amax")?;
    let margin = 448f32;
    let mut launch = stream.launch_builder(&func);
    launch.arg(&mut bits).arg(&mut out).arg(&margin);
    let one = LaunchConfig { grid_dim: (1, 1, 1), block_dim: (1, 1, 1), shared_mem_bytes: 0 };
    // SAFETY: fp8_scale_from_amax's (amax_bits, scale, pow2_margin) in order and type.
    unsafe { launch.launch(one) }.map_err(|e| err("fp8_scale_from_amax", e))?;
    drop(launch);
    Ok(CudaStorage::wrap_cuda_slice(out, dev))
}

/// q = E4M3(x / s) (`s`: (1) or rank-0 f32 on x's device), with amax_bits also updated in the
/// same pass when given.
fn quantize_into(x: &Tensor, scale: &Tensor, amax_bits: Option<&Tensor>) -> candle_core::Result<Tensor> {
    let dev = x.device().as_cuda_device()?.clone();
    let x = readable(x)?;
    let n = x.elem_count();
    // SAFETY: the kernel writes every one of the n elements before anything reads them.
    let q = wrap(unsafe { dev.alloc::<float8::F8E4M3>(n)? }, &dev, x.shape().clone());
    let scale = scale.contiguous()?;
    let n64 = n as i64;
    let name = format!("fp8_quantize_{}", suffix(&x));
    match amax_bits {
        Some(bits) => launch(&dev, &name, blocks(n)?, THREADS, &[&x, &scale, &q, bits], &[T(0), I64(n64), T(1), T(2), T(3)])?,
        // amax_bits = nullptr: no amax in this pass
        None => launch(&dev, &name, blocks(n)?, THREADS, &[&x, &scale, &q], &[T(0), I64(n64), T(1), T(2), Null])?,
    }
    Ok(q)
}

/// `fp8::quantize`, with max|x| also maxed into `amax_bits` in the same pass (a producer's output
/// quantised for the next layer, when no kernel of its own does it: `Fp8Target::quantize`).
pub fn quantize_with_amax(x: &Tensor, scale: &Tensor, amax_bits: &Tensor) -> candle_core::Result<Tensor> {
    quantize_into(x, scale, Some(amax_bits))
}

/// inv ← 1/s, both (1) f32 device buffers (cuBLASLt's D scale: the GEMM multiplies by it).
pub fn reciprocal(scale: &Tensor, inv: &Tensor) -> candle_core::Result<()> {
    launch(scale.device().as_cuda_device()?, "fp8_reciprocal", 1, 1, &[scale, inv], &[T(0), T(1)])
}

/// LayerNorm's launch: one block of THREADS threads per row of C.
fn rows(x: &Tensor) -> candle_core::Result<(u32, i32)> {
    let c = x.dim(candle_core::D::Minus1)?;
    let rows = u32::try_from(x.elem_count() / c).map_err(|_| err("grid", "more than 2^32 rows"))?;
    Ok((rows, c as i32))
}

/// q = E4M3(LayerNorm(x) / s), amax_bits ← max(amax_bits, max|LayerNorm(x)|) (kernels/ln_fp8.cu).
/// x: (…, C) f32; g, b: (C) f32; s: (1) f32; amax_bits: (1) u32.
pub fn layer_norm_e4m3(x: &Tensor, g: &Tensor, b: &Tensor, scale: &Tensor, amax_bits: &Tensor) -> candle_core::Result<Tensor> {
    let dev = x.device().as_cuda_device()?.clone();
    let (x, g, b) = (x.to_dtype(DType::F32)?.contiguous()?, g.contiguous()?, b.contiguous()?);
    let (blocks, c) = rows(&x)?;
    // SAFETY: the kernel writes every element of q (every row, every column).
    let q = wrap(unsafe { dev.alloc::<float8::F8E4M3>(x.elem_count())? }, &dev, x.shape().clone());
    let eps = stage3_fused::ops::LN_EPS;
    let args = [T(0), T(1), T(2), T(3), T(4), T(5), I32(c), F32(eps)];
    launch(&dev, "layer_norm_e4m3", blocks, THREADS, &[&x, &g, &b, scale, &q, amax_bits], &args)?;
    Ok(q)
}

/// (x + branch, E4M3(LayerNorm(x + branch) / s)), amax as `layer_norm_e4m3`, in one launch of
/// `add_layer_norm_16_e4m3`. x: (…, C) f32; branch: same shape, bf16.
pub fn add_layer_norm_e4m3(
    x: &Tensor,
    branch: &Tensor,
    g: &Tensor,
    b: &Tensor,
    scale: &Tensor,
    amax_bits: &Tensor,
) -> candle_core::Result<(Tensor, Tensor)> {
    let dev = x.device().as_cuda_device()?.clone();
    let (x, branch, g, b) = (x.contiguous()?, branch.to_dtype(DType::BF16)?.contiguous()?, g.contiguous()?, b.contiguous()?);
    let (blocks, c) = rows(&x)?;
    let n = x.elem_count();
    // SAFETY: the kernel writes every element of x_out and q.
    let x_out = wrap(unsafe { dev.alloc::<f32>(n)? }, &dev, x.shape().clone());
    let q = wrap(unsafe { dev.alloc::<float8::F8E4M3>(n)? }, &dev, x.shape().clone());
    let eps = stage3_fused::ops::LN_EPS;
    let args = [T(0), T(1), T(2), T(3), T(4), T(5), T(6), T(7), I32(c), F32(eps), I32(1)]; // bf16 = 1
    launch(&dev, "add_layer_norm_16_e4m3", blocks, THREADS, &[&x, &branch, &g, &b, &x_out, scale, &q, amax_bits], &args)?;
    Ok((x_out, q))
}

/// One activation's scale state on the device: what `ScaleState` holds on CUDA.
#[derive(Debug)]
pub struct DeviceScale {
    /// (1) u32: the running amax's f32 bits; zero between calls (the kernels clear it).
    pub amax_bits: Tensor,
    /// (1) f32: the scale of the last call, read by the GEMM through its pointer.
    pub scale: Tensor,
    /// (history_len) f32, oldest first (delayed scaling).
    pub history: Tensor,
    /// (1) f32: 1/scale, for a producer GEMM writing E4M3 (cuBLASLt's D scale).
    pub inv_scale: Tensor,
}

impl DeviceScale {
    pub fn new(dev: &candle_core::Device, history_len: usize) -> candle_core::Result<DeviceScale> {
        Ok(DeviceScale {
            amax_bits: Tensor::zeros(1, DType::U32, dev)?,
            scale: Tensor::zeros(1, DType::F32, dev)?,
            history: Tensor::zeros(history_len, DType::F32, dev)?,
            inv_scale: Tensor::zeros(1, DType::F32, dev)?,
        })
    }

    /// Current scaling: amax pass, scale, cast pass (3 launches, x read twice).
    pub fn quantize_current(&self, x: &Tensor, pow2_margin: f32) -> candle_core::Result<Tensor> {
        let dev = x.device().as_cuda_device()?;
        amax_into(x, &self.amax_bits)?;
        launch(dev, "fp8_scale_from_amax", 1, 1, &[&self.amax_bits, &self.scale], &[T(0), T(1), F32(pow2_margin)])?;
        quantize_into(x, &self.scale, None)
    }

    /// Delayed scaling: the scale from the history, then the cast with this call's amax fused
    /// into the same pass, then the amax joins the history (3 launches, x read once). The first
    /// call (`first`) has no history: its own amax fills it first.
    pub fn quantize_delayed(&self, x: &Tensor, pow2_margin: f32, first: bool) -> candle_core::Result<Tensor> {
        if first {
            amax_into(x, &self.amax_bits)?;
            self.push(1)?;
        }
        self.scale_from_history(pow2_margin)?;
        if first {
            return quantize_into(x, &self.scale, None); // this amax is already in the history
        }
        let q = quantize_into(x, &self.scale, Some(&self.amax_bits))?;
        self.push_amax()?;
        Ok(q)
    }

    /// scale ← max(history)·2^m/448 (the delayed scale, before the input is written).
    pub fn scale_from_history(&self, pow2_margin: f32) -> candle_core::Result<()> {
        let len = self.history.elem_count() as i32;
        let dev = self.history.device().as_cuda_device()?;
        launch(dev, "fp8_scale_from_history", 1, 1, &[&self.history, &self.scale], &[T(0), I32(len), T(1), F32(pow2_margin)])
    }

    /// The amax maxed into `amax_bits` since the last push joins the history; the buffer is cleared.
    pub fn push_amax(&self) -> candle_core::Result<()> {
        self.push(0)
    }

    /// `fp8_history_push`; with `fill` (the first call) the amax fills every slot.
    fn push(&self, fill: i32) -> candle_core::Result<()> {
        let len = self.history.elem_count() as i32;
        let dev = self.history.device().as_cuda_device()?;
        launch(dev, "fp8_history_push", 1, 1, &[&self.amax_bits, &self.history], &[T(0), T(1), I32(len), I32(fill)])
    }
}
