//! FP8 quantisation on CUDA with our own kernels (`kernels/fp8.cu`, and the E4M3 LayerNorm of
//! `kernels/ln_fp8.cu`, compiled by build.rs to a cubin per architecture like stage 3's
//! `add_layer_norm.cu`): amax, the scale (current, or delayed from a history kept on the
//! device), the cast to E4M3 and back. candle's own F8E4M3 casts are never called on CUDA: in
//! candle 0.11.1 their kernels cannot be found (huggingface/candle#3886).
//!
//! Each function here is the CUDA forward of a candle op defined beside its CPU forward: the
//! casts in `fp8`, the scale state's in-place updates in `scale`, the fused producers in
//! `producers`. The scale state's buffers (amax bits, scale, history) are made once and written
//! in place by the kernels through their device pointers, so a CUDA graph captures the whole
//! update — no host round trip, no allocation — and every replay advances the history.

use candle_core::backend::BackendStorage;
use candle_core::cuda::cudarc::driver::{DevicePtr, LaunchConfig, PushKernelArg, SyncOnDrop};
use candle_core::cuda::{CudaDevice, CudaStorage};
use candle_core::op::BackpropOp;
use candle_core::{DType, Layout, Shape, Storage, Tensor};
use kernel_cache::{function, Cubins};
use Arg::{Null, Ptr, F32, I32, I64};

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

/// One kernel parameter: a buffer's device pointer (its storage and layout, contiguous), a null
/// pointer, or a scalar (`long` is i64, `int` i32, `float` f32 in the kernel's signature).
#[derive(Clone, Copy)]
enum Arg<'a> {
    Ptr(&'a CudaStorage, &'a Layout),
    Null,
    I64(i64),
    I32(i32),
    F32(f32),
}

/// Launch `name` with `args`, in the kernel's parameter order. A buffer the kernel writes is
/// passed like one it reads: the pointer is what the kernel takes, and every launch is on
/// candle's one stream, so the order of launches orders the accesses.
fn launch(dev: &CudaDevice, name: &str, blocks: u32, threads: u32, args: &[Arg]) -> candle_core::Result<()> {
    let func = function(dev, &FP8, name)?;
    let stream = dev.cuda_stream();
    let mut pointers = Vec::with_capacity(args.len());
    let mut syncs: Vec<SyncOnDrop<'_>> = Vec::with_capacity(args.len());
    for a in args {
        pointers.push(match a {
            Ptr(cs, l) => {
                let (start, _) = l.contiguous_offsets().ok_or_else(|| err(name, "expected a contiguous buffer"))?;
                let ((p, g), size) = match cs.dtype() {
                    DType::F32 => (cs.as_cuda_slice::<f32>()?.device_ptr(&stream), 4),
                    DType::U32 => (cs.as_cuda_slice::<u32>()?.device_ptr(&stream), 4),
                    DType::BF16 => (cs.as_cuda_slice::<half::bf16>()?.device_ptr(&stream), 2),
                    DType::F8E4M3 => (cs.as_cuda_slice::<float8::F8E4M3>()?.device_ptr(&stream), 1),
                    DType::U8 => (cs.as_cuda_slice::<u8>()?.device_ptr(&stream), 1), // E5M2 codes
                    dt => candle_core::bail!("{name}: unsupported dtype {dt:?}"),
                };
                syncs.push(g);
                p + (start * size) as u64
            }
            _ => 0, // Null; unused for scalars
        });
    }
    let mut builder = stream.launch_builder(&func);
    for (a, p) in args.iter().zip(&pointers) {
        match a {
            Ptr(..) | Null => builder.arg(p),
            I64(v) => builder.arg(v),
            I32(v) => builder.arg(v),
            F32(v) => builder.arg(v),
        };
    }
    let cfg = LaunchConfig { grid_dim: (blocks.max(1), 1, 1), block_dim: (threads, 1, 1), shared_mem_bytes: 0 };
    // SAFETY: each call site lists the kernel's parameters in its order and types (raw device
    // pointers as u64, `long` as i64, `int` as i32, `float` as f32), and the pointers come from
    // live, contiguous buffers of the dtypes the kernel reads and writes.
    unsafe { builder.launch(cfg) }.map_err(|e| err(name, e))?;
    drop(syncs);
    Ok(())
}

fn blocks(n: usize) -> candle_core::Result<u32> {
    u32::try_from(n.div_ceil(CHUNK)).map_err(|_| err("grid", format!("{n} elements need more than 2^32 blocks")))
}

/// max|x| as one f32: the CUDA forward of `fp8::amax` (a candle custom op). x: contiguous f32
/// or bf16. One pass, one atomic per block, into a zeroed u32 (the f32's bits); then those
/// bits reinterpreted as the f32 result on the device.
pub fn amax_fwd(xs: &CudaStorage, xl: &Layout) -> candle_core::Result<CudaStorage> {
    let dev = xs.device().clone();
    let one = Shape::from(1);
    let (bits, bl) = (CudaStorage::wrap_cuda_slice(dev.alloc_zeros::<u32>(1)?, dev.clone()), Layout::contiguous(&one));
    amax_into_fwd(&bits, &bl, xs, xl)?;
    // scale_from_amax with pow2_margin = 448 gives s = max(amax, FLT_MIN): the amax itself
    // (FLT_MIN only for an all-zero x, where amax is then reported as FLT_MIN, not 0).
    let (out, ol) = output::<f32>(&dev, &one)?;
    scale_from_amax_fwd(&out, &ol, &bits, &bl, 448.0)?;
    Ok(out)
}

/// y = s·q in f32: the CUDA forward of `fp8::dequantize`. q: contiguous E4M3; s: one f32.
pub fn dequantize_fwd(qs: &CudaStorage, ql: &Layout, ss: &CudaStorage, sl: &Layout) -> candle_core::Result<CudaStorage> {
    let dev = qs.device().clone();
    let n = ql.shape().elem_count();
    let (y, yl) = output::<f32>(&dev, ql.shape())?;
    launch(&dev, "fp8_dequantize_f32", blocks(n)?, THREADS, &[Ptr(qs, ql), I64(n as i64), Ptr(ss, sl), Ptr(&y, &yl)])?;
    Ok(y)
}

/// The kernels' suffix for x's dtype (they read f32 or bf16).
fn suffix(xs: &CudaStorage, op: &str) -> candle_core::Result<&'static str> {
    match xs.dtype() {
        DType::F32 => Ok("f32"),
        DType::BF16 => Ok("bf16"),
        dt => candle_core::bail!("{op} on CUDA: unsupported dtype {dt:?} (f32 or bf16)"),
    }
}

/// An output buffer of `shape` that the kernel writes in full, with its contiguous layout.
fn output<T: candle_core::cuda::CudaDType + candle_core::cuda::cudarc::driver::DeviceRepr>(
    dev: &CudaDevice,
    shape: &Shape,
) -> candle_core::Result<(CudaStorage, Layout)> {
    // SAFETY: every caller's kernel writes each of the elements before anything reads them.
    let slice = unsafe { dev.alloc::<T>(shape.elem_count())? };
    Ok((CudaStorage::wrap_cuda_slice(slice, dev.clone()), Layout::contiguous(shape)))
}

/// q = E4M3(x / s): the CUDA forward of `fp8::quantize` and `Fp8Target::quantize` (candle custom
/// ops). x: contiguous f32 or bf16; s: one f32; with `amax_bits` ((1) u32) also
/// amax ← max(amax, max|x|) in the same pass (null: no amax).
pub fn quantize_fwd(
    xs: &CudaStorage,
    xl: &Layout,
    ss: &CudaStorage,
    sl: &Layout,
    amax_bits: Option<(&CudaStorage, &Layout)>,
) -> candle_core::Result<CudaStorage> {
    let dev = xs.device().clone();
    let n = xl.shape().elem_count();
    let name = format!("fp8_quantize_{}", suffix(xs, "quantize")?);
    let (q, ql) = output::<float8::F8E4M3>(&dev, xl.shape())?;
    let amax = amax_bits.map_or(Null, |(s, l)| Ptr(s, l));
    launch(&dev, &name, blocks(n)?, THREADS, &[Ptr(xs, xl), I64(n as i64), Ptr(ss, sl), Ptr(&q, &ql), amax])?;
    Ok(q)
}

/// amax_bits ← max(amax_bits, max|x|) as f32 bits: the CUDA forward of `scale::amax_into`.
/// x: contiguous f32 or bf16.
pub fn amax_into_fwd(bits: &CudaStorage, bl: &Layout, xs: &CudaStorage, xl: &Layout) -> candle_core::Result<()> {
    let n = xl.shape().elem_count();
    let name = format!("fp8_amax_{}", suffix(xs, "amax")?);
    launch(xs.device(), &name, blocks(n)?, THREADS, &[Ptr(xs, xl), I64(n as i64), Ptr(bits, bl)])
}

/// scale ← max(amax, FLT_MIN)·2^m/448, amax ← 0: the CUDA forward of `scale::scale_from_amax_into`.
pub fn scale_from_amax_fwd(scale: &CudaStorage, sl: &Layout, bits: &CudaStorage, bl: &Layout, pow2_margin: f32) -> candle_core::Result<()> {
    launch(scale.device(), "fp8_scale_from_amax", 1, 1, &[Ptr(bits, bl), Ptr(scale, sl), F32(pow2_margin)])
}

/// scale ← max(history)·2^m/448: the CUDA forward of `scale::scale_from_history_into`.
pub fn scale_from_history_fwd(
    scale: &CudaStorage,
    sl: &Layout,
    history: &CudaStorage,
    hl: &Layout,
    pow2_margin: f32,
) -> candle_core::Result<()> {
    let len = hl.shape().elem_count() as i32;
    launch(scale.device(), "fp8_scale_from_history", 1, 1, &[Ptr(history, hl), I32(len), Ptr(scale, sl), F32(pow2_margin)])
}

/// history ← roll(history, amax) (with `fill`: every slot ← amax), amax ← 0: the CUDA forward
/// of `scale::history_push_into`.
pub fn history_push_fwd(history: &CudaStorage, hl: &Layout, bits: &CudaStorage, bl: &Layout, fill: bool) -> candle_core::Result<()> {
    let len = hl.shape().elem_count() as i32;
    launch(history.device(), "fp8_history_push", 1, 1, &[Ptr(bits, bl), Ptr(history, hl), I32(len), I32(fill as i32)])
}

/// inv ← 1/s, both one f32: the CUDA forward of `scale::reciprocal_into`.
pub fn reciprocal_fwd(inv: &CudaStorage, il: &Layout, scale: &CudaStorage, sl: &Layout) -> candle_core::Result<()> {
    launch(inv.device(), "fp8_reciprocal", 1, 1, &[Ptr(scale, sl), Ptr(inv, il)])
}

/// LayerNorm's launch: one block of THREADS threads per row of C.
fn rows(xl: &Layout) -> candle_core::Result<(u32, i32)> {
    let c = xl.shape().dims().last().copied().unwrap_or(1).max(1);
    let rows = u32::try_from(xl.shape().elem_count() / c).map_err(|_| err("grid", "more than 2^32 rows"))?;
    Ok((rows, c as i32))
}

/// A buffer as an op's CUDA forward holds it: its storage and layout (contiguous).
pub type Buf<'a> = (&'a CudaStorage, &'a Layout);

fn ptr((s, l): Buf<'_>) -> Arg<'_> {
    Ptr(s, l)
}

/// q = E4M3(LayerNorm(x) / s), amax_bits ← max(amax_bits, max|LayerNorm(x)|) in one launch of
/// `layer_norm_e4m3` (kernels/ln_fp8.cu): the CUDA forward of `producers::layer_norm_e4m3`.
/// x: (…, C) f32; g, b: (C) f32; s: one f32; amax_bits: (1) u32.
pub fn layer_norm_e4m3_fwd(x: Buf, g: Buf, b: Buf, scale: Buf, amax_bits: Buf) -> candle_core::Result<CudaStorage> {
    let dev = x.0.device().clone();
    let (blocks, c) = rows(x.1)?;
    let (q, ql) = output::<float8::F8E4M3>(&dev, x.1.shape())?;
    let eps = stage3_fused::ops::LN_EPS;
    let args = [ptr(x), ptr(g), ptr(b), ptr(scale), Ptr(&q, &ql), ptr(amax_bits), I32(c), F32(eps)];
    launch(&dev, "layer_norm_e4m3", blocks, THREADS, &args)?;
    Ok(q)
}

/// (x + branch, E4M3(LayerNorm(x + branch) / s)), amax as `layer_norm_e4m3_fwd`, in one launch
/// of `add_layer_norm_16_e4m3`: the CUDA forward of `producers::add_layer_norm_e4m3`.
/// x: (…, C) f32; branch: same shape, bf16.
pub fn add_layer_norm_e4m3_fwd(
    x: Buf,
    branch: Buf,
    g: Buf,
    b: Buf,
    scale: Buf,
    amax_bits: Buf,
) -> candle_core::Result<(CudaStorage, CudaStorage)> {
    if branch.0.dtype() != DType::BF16 {
        candle_core::bail!("add_layer_norm_e4m3 on CUDA: the branch must be bf16, got {:?}", branch.0.dtype());
    }
    let dev = x.0.device().clone();
    let (blocks, c) = rows(x.1)?;
    let (x_out, xol) = output::<f32>(&dev, x.1.shape())?;
    let (q, ql) = output::<float8::F8E4M3>(&dev, x.1.shape())?;
    let eps = stage3_fused::ops::LN_EPS;
    let args = [ptr(x), ptr(branch), ptr(g), ptr(b), Ptr(&x_out, &xol), ptr(scale), Ptr(&q, &ql), ptr(amax_bits), I32(c), F32(eps), I32(1)]; // bf16 = 1
    launch(&dev, "add_layer_norm_16_e4m3", blocks, THREADS, &args)?;
    Ok((x_out, q))
}

// ---------------------------------------------------------------------------------------------
// Training: the gradient in E5M2, and the transposed copies the backward GEMMs read
// ---------------------------------------------------------------------------------------------

/// A storage our kernel wrote, as a candle tensor (no backward).
fn tensor(cs: CudaStorage, shape: impl Into<Shape>) -> Tensor {
    Tensor::from_storage(Storage::Cuda(cs), shape, BackpropOp::none(), false)
}

/// The transposes' grid: one block per 32 × 32 tile.
fn tiles(rows: usize, cols: usize) -> candle_core::Result<u32> {
    u32::try_from(rows.div_ceil(32) * cols.div_ceil(32)).map_err(|_| err("grid", "more than 2^32 tiles"))
}

/// (q, qᵀ): E5M2(x / s) (rows, cols) and its transpose (cols, rows), E5M2 codes in u8 tensors
/// (candle has no E5M2 dtype; cuBLASLt is told the type by the layout), in one launch of
/// `fp8_quantize_e5m2_transpose_*`; with `amax_bits` ((1) u32) also amax ← max(amax, max|x|).
/// x: (rows, cols) f32 or bf16 on CUDA; s: one f32. The HYBRID backward's dY and dYᵀ.
pub fn quantize_e5m2_transpose(x: &Tensor, scale: &Tensor, amax_bits: Option<&Tensor>) -> candle_core::Result<(Tensor, Tensor)> {
    let (rows, cols) = x.dims2()?;
    let (x, scale) = (x.contiguous()?, scale.contiguous()?);
    let ((xs, xl), (ss, sl)) = (x.storage_and_layout(), scale.storage_and_layout());
    let (Storage::Cuda(xs), Storage::Cuda(ss)) = (&*xs, &*ss) else {
        candle_core::bail!("quantize_e5m2_transpose: x and s must be on the GPU")
    };
    let amax = amax_bits.map(|a| a.storage_and_layout());
    let amax_arg = match &amax {
        None => Null,
        Some((s, l)) => match &**s {
            Storage::Cuda(s) => Ptr(s, l),
            _ => candle_core::bail!("quantize_e5m2_transpose: the amax buffer must be on the GPU"),
        },
    };
    let dev = xs.device().clone();
    let name = format!("fp8_quantize_e5m2_transpose_{}", suffix(xs, "quantize_e5m2_transpose")?);
    let (q, ql) = output::<u8>(&dev, &Shape::from((rows, cols)))?;
    let (qt, qtl) = output::<u8>(&dev, &Shape::from((cols, rows)))?;
    let args = [Ptr(xs, xl), I64(rows as i64), I64(cols as i64), Ptr(ss, sl), Ptr(&q, &ql), Ptr(&qt, &qtl), amax_arg];
    launch(&dev, &name, tiles(rows, cols)?, THREADS, &args)?;
    Ok((tensor(q, (rows, cols)), tensor(qt, (cols, rows))))
}

/// qᵀ (cols, rows) of FP8 codes q (rows, cols) (E4M3, or E5M2 in u8), in q's dtype: one launch of
/// `fp8_transpose`. The HYBRID backward's Wᵀ and Xᵀ of the forward's E4M3 codes.
pub fn transpose_fp8(q: &Tensor) -> candle_core::Result<Tensor> {
    let (rows, cols) = q.dims2()?;
    let q = q.contiguous()?;
    let (qs, ql) = q.storage_and_layout();
    let Storage::Cuda(qs) = &*qs else { candle_core::bail!("transpose_fp8: q must be on the GPU") };
    let dev = qs.device().clone();
    let shape = Shape::from((cols, rows));
    let (qt, qtl) = match q.dtype() {
        DType::F8E4M3 => output::<float8::F8E4M3>(&dev, &shape)?,
        DType::U8 => output::<u8>(&dev, &shape)?,
        dt => candle_core::bail!("transpose_fp8: FP8 codes (E4M3, or E5M2 in u8) expected, got {dt:?}"),
    };
    launch(&dev, "fp8_transpose", tiles(rows, cols)?, THREADS, &[Ptr(qs, ql), I64(rows as i64), I64(cols as i64), Ptr(&qt, &qtl)])?;
    Ok(tensor(qt, shape))
}

/// The f32 value of each FP8 code (E4M3, or E5M2 in u8), q's shape: one launch of
/// `fp8_decode_f32`. The backward GEMMs' fallback (`gemm::fp8_grad_gemm_fallback`).
pub fn decode_fp8(q: &Tensor) -> candle_core::Result<Tensor> {
    let q = q.contiguous()?;
    let e5m2 = match q.dtype() {
        DType::F8E4M3 => 0,
        DType::U8 => 1,
        dt => candle_core::bail!("decode_fp8: FP8 codes (E4M3, or E5M2 in u8) expected, got {dt:?}"),
    };
    let (qs, ql) = q.storage_and_layout();
    let Storage::Cuda(qs) = &*qs else { candle_core::bail!("decode_fp8: q must be on the GPU") };
    let dev = qs.device().clone();
    let n = ql.shape().elem_count();
    let (y, yl) = output::<f32>(&dev, ql.shape())?;
    launch(&dev, "fp8_decode_f32", blocks(n)?, THREADS, &[Ptr(qs, ql), I64(n as i64), I32(e5m2), Ptr(&y, &yl)])?;
    Ok(tensor(y, q.shape().clone()))
}
