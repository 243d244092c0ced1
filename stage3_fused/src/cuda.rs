//! The CUDA forwards of the fused ops (`ops.rs` holds the custom ops that call them): cuBLASLt
//! GEMMs with epilogues, and the residual-add + LayerNorm kernel (`kernels/add_layer_norm.cu`,
//! compiled to a cubin per architecture by build.rs, loaded once per device by
//! `kernel_cache`).

use crate::device_cache::{Cache, DeviceKey};
use crate::gemm_args::{linear_args, LinearKind};
use crate::ops::Epilogue;
use candle_core::backend::BackendStorage;
use candle_core::cuda::cudarc::cublaslt::{Activation, CudaBlasLT, Matmul, MatmulConfig};
use candle_core::cuda::cudarc::driver::{CudaSlice, CudaView, DevicePtr, DeviceRepr, LaunchConfig, PushKernelArg};
use candle_core::cuda::{CudaDType, CudaDevice, CudaStorage, DeviceId};
use candle_core::op::BackpropOp;
use candle_core::{DType, Layout, Storage, Tensor};
use cublaslt_model::{DataType, Epilogue as ModelEpilogue};
use kernel_cache::{function, Cubins};
use std::sync::Arc;

fn err(what: &str, e: impl std::fmt::Debug) -> candle_core::Error {
    candle_core::Error::Msg(format!("{what}: {e:?}"))
}

thread_local! {
    /// One cuBLASLt handle (and its workspace) per device, made on first use: creating them
    /// per call would cost an allocation and a handle setup every GEMM. Keyed by the device
    /// (its stream) and its compute capability, not the GPU ordinal (`device_cache`).
    static LT: Cache<DeviceKey<DeviceId>, Arc<CudaBlasLT>> = Cache::new();
}

/// The cache key of `dev`: candle's id for it (one per stream) and its compute capability.
pub fn device_key(dev: &CudaDevice) -> candle_core::Result<DeviceKey<DeviceId>> {
    let (major, minor) = dev.cuda_stream().context().compute_capability().map_err(|e| err("compute capability", e))?;
    Ok(DeviceKey { id: dev.id(), sm: (major as u32, minor as u32) })
}

/// The cuBLASLt handle (with its workspace) bound to `dev`'s stream; stage 4 shares it.
pub fn lt(dev: &CudaDevice) -> candle_core::Result<Arc<CudaBlasLT>> {
    let key = device_key(dev)?;
    LT.with(|c| c.get_or_try_insert(key, || Ok(Arc::new(CudaBlasLT::new(dev.cuda_stream()).map_err(|e| err("cuBLASLt handle", e))?))))
}

/// The device memory behind a contiguous CUDA tensor, as a typed view borrowed from its
/// storage guard (`Tensor::storage_and_layout`).
pub fn cuda_view<'a, T: CudaDType>(storage: &'a Storage, layout: &Layout) -> candle_core::Result<CudaView<'a, T>> {
    let Storage::Cuda(cs) = storage else { candle_core::bail!("expected a CUDA tensor") };
    view(cs, layout)
}

/// The device memory of a contiguous CUDA storage (as a custom op's forward receives it), as a
/// typed view.
pub fn view<'a, T: CudaDType>(cs: &'a CudaStorage, layout: &Layout) -> candle_core::Result<CudaView<'a, T>> {
    let (start, end) = layout.contiguous_offsets().ok_or_else(|| err("cuda view", "expected a contiguous tensor"))?;
    Ok(cs.as_cuda_slice::<T>()?.slice(start..end))
}

/// A CUDA allocation, written by our own launch on candle's stream, as a candle tensor.
pub fn wrap<T: CudaDType>(slice: CudaSlice<T>, dev: &CudaDevice, shape: impl Into<candle_core::Shape>) -> Tensor {
    Tensor::from_storage(Storage::Cuda(CudaStorage::wrap_cuda_slice(slice, dev.clone())), shape, BackpropOp::none(), false)
}

/// y = epilogue(x Wᵀ + b) through cuBLASLt: the CUDA forward of `ops`' linears. x: (B, T, K),
/// W: (N, K), b: (N), contiguous, one dtype; a residual in that dtype and the output's shape.
/// cuBLASLt is column-major, so we ask for yᵀ (N × M) = W (N × K) · xᵀ (K × M): W's rows are
/// K-contiguous, so A = W with transa and B = x, both with leading dimension K; the column-major
/// N × M result is y's row-major M × N. The bias, a length-N vector added to every column, is
/// exactly a per-row-of-y bias.
pub fn linear(
    xs: &CudaStorage,
    xl: &Layout,
    ws: &CudaStorage,
    wl: &Layout,
    bs: &CudaStorage,
    bl: &Layout,
    epilogue: Epilogue,
) -> candle_core::Result<CudaStorage> {
    match xs.dtype() {
        DType::BF16 => linear_t::<half::bf16>((xs, xl), (ws, wl), (bs, bl), epilogue),
        DType::F16 => linear_t::<half::f16>((xs, xl), (ws, wl), (bs, bl), epilogue),
        // cudarc's cuBLASLt f32 GEMM computes in TF32 (CUBLAS_COMPUTE_32F_FAST_TF32), so only
        // the tf32 precision takes this path; stage 3 refuses fp32 on CUDA for that reason.
        DType::F32 => linear_t::<f32>((xs, xl), (ws, wl), (bs, bl), epilogue),
        dt => candle_core::bail!("cuBLASLt linear: unsupported dtype {dt:?}"),
    }
}

fn linear_t<T: CudaDType + DeviceRepr>(
    (xs, xl): (&CudaStorage, &Layout),
    (ws, wl): (&CudaStorage, &Layout),
    (bs, bl): (&CudaStorage, &Layout),
    epilogue: Epilogue,
) -> candle_core::Result<CudaStorage>
where
    CudaBlasLT: Matmul<T>,
{
    let (bsz, t, k) = xl.shape().dims3()?;
    let n = wl.shape().dims()[0];
    let m = bsz * t;
    let dev = xs.device().clone();
    let (xv, wv, bv) = (view::<T>(xs, xl)?, view::<T>(ws, wl)?, view::<T>(bs, bl)?);
    // SAFETY (allocation): every element of `out` is written by the memcpy or the GEMM (β = 0
    // never reads C) before anything reads it.
    let mut out: CudaSlice<T> = unsafe { dev.alloc::<T>(m * n)? };
    // The residual rides in through C with β = 1: D's buffer starts out holding it. (The caller,
    // `ops::linear_bias_residual`, adds an f32 residual of a bf16/f16 GEMM after, in f32.)
    if let Epilogue::BiasResidual(r) = epilogue {
        if r.dtype() != xs.dtype() {
            candle_core::bail!("cuBLASLt linear: the residual ({:?}) must have the GEMM's dtype ({:?})", r.dtype(), xs.dtype());
        }
        let (rs, rl) = r.storage_and_layout();
        dev.memcpy_dtod(&cuda_view::<T>(&rs, rl)?, &mut out)?;
    }
    let dtype = match xs.dtype() {
        DType::BF16 => DataType::Bf16,
        DType::F16 => DataType::F16,
        _ => DataType::F32,
    };
    let kind = match epilogue {
        Epilogue::Bias => LinearKind::Bias,
        Epilogue::BiasGelu => LinearKind::BiasGelu,
        Epilogue::BiasResidual(_) => LinearKind::BiasResidualInC,
    };
    // The pure argument builder (gemm_args.rs), executed on the CPU by the tests' cuBLASLt model.
    let args = linear_args(m, k, n, dtype, kind);
    let cfg = MatmulConfig {
        transa: args.transa,
        transb: args.transb,
        transc: false,
        m: args.m,
        n: args.n,
        k: args.k,
        alpha: args.alpha,
        lda: args.a.ld,
        ldb: args.b.ld,
        beta: args.beta,
        ldc: args.c.ld, // cudarc gives D the same layout as C (and we pass one buffer for both)
        stride_a: None,
        stride_b: None,
        stride_c: None,
        stride_bias: None,
        batch_size: None,
    };
    // cudarc picks the epilogue from (bias, activation): BIAS, or GELU_BIAS with Gelu.
    let act = matches!(args.epilogue, ModelEpilogue::GeluBias).then_some(Activation::Gelu);
    // SAFETY: A holds n·k, B k·m, C/D n·m values and the bias n, as the config describes.
    unsafe { lt(&dev)?.matmul(cfg, &wv, &xv, &mut out, Some(&bv), act.as_ref()) }.map_err(|e| err("cuBLASLt matmul", e))?;
    Ok(CudaStorage::wrap_cuda_slice(out, dev))
}

/// kernels/add_layer_norm.cu as build.rs compiled it: a cubin per architecture in CUDA_COMPUTE_CAP.
pub static ADD_LAYER_NORM: Cubins = Cubins { file: "stage3_fused/kernels/add_layer_norm.cu", archs: cubins::ADD_LAYER_NORM };

mod cubins {
    include!(concat!(env!("OUT_DIR"), "/cubins.rs"));
}

/// One block of 256 threads per row (the kernel's THREADS).
fn row_launch(rows: usize) -> LaunchConfig {
    LaunchConfig { grid_dim: (rows as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 }
}

/// (x + branch, LayerNorm(x + branch)) in one launch: the CUDA forward of `ops::add_layer_norm`.
/// x: (…, C) f32; branch: same shape, f32, bf16 or f16; g, b: (C) f32; all contiguous.
/// Returns (x_out in f32, h in branch's dtype).
#[allow(clippy::too_many_arguments)]
pub fn add_layer_norm(
    xs: &CudaStorage,
    xl: &Layout,
    brs: &CudaStorage,
    brl: &Layout,
    gs: &CudaStorage,
    gl: &Layout,
    bs: &CudaStorage,
    bl: &Layout,
    eps: f32,
) -> candle_core::Result<(CudaStorage, CudaStorage)> {
    let dev = xs.device().clone();
    let c = xl.shape().dims().last().copied().unwrap_or(1);
    let n = xl.shape().elem_count();
    let rows = n / c.max(1);
    let (xv, gv, bv) = (view::<f32>(xs, xl)?, view::<f32>(gs, gl)?, view::<f32>(bs, bl)?);
    let c_i32 = c as i32;
    // SAFETY (allocations): the kernel writes every element of x_out and h_out.
    let mut x_out = unsafe { dev.alloc::<f32>(n)? };
    let h = match brs.dtype() {
        DType::F32 => {
            let brv = view::<f32>(brs, brl)?;
            let mut h_out = unsafe { dev.alloc::<f32>(n)? };
            let func = function(&dev, &ADD_LAYER_NORM, "add_layer_norm_f32")?;
            let stream = dev.cuda_stream();
            let mut launch = stream.launch_builder(&func);
            launch.arg(&xv).arg(&brv).arg(&gv).arg(&bv).arg(&mut x_out).arg(&mut h_out).arg(&c_i32).arg(&eps);
            // SAFETY: argument order and types match the kernel's signature; one block per row.
            unsafe { launch.launch(row_launch(rows)) }.map_err(|e| err("add_layer_norm_f32", e))?;
            CudaStorage::wrap_cuda_slice(h_out, dev.clone())
        }
        DType::BF16 => add_layer_norm_16::<half::bf16>(&dev, rows, (&xv, &gv, &bv), view(brs, brl)?, &mut x_out, (c_i32, eps, 1))?,
        DType::F16 => add_layer_norm_16::<half::f16>(&dev, rows, (&xv, &gv, &bv), view(brs, brl)?, &mut x_out, (c_i32, eps, 0))?,
        dt => candle_core::bail!("add_layer_norm: unsupported branch dtype {dt:?}"),
    };
    Ok((CudaStorage::wrap_cuda_slice(x_out, dev), h))
}

/// h = LayerNorm(x) in `dtype`, one launch of `layer_norm_*` (two-pass variance, cast fused
/// into the store): the CUDA forward of `ops::layer_norm`. x: (…, C) f32; g, b: (C) f32; contiguous.
#[allow(clippy::too_many_arguments)]
pub fn layer_norm(
    xs: &CudaStorage,
    xl: &Layout,
    gs: &CudaStorage,
    gl: &Layout,
    bs: &CudaStorage,
    bl: &Layout,
    eps: f32,
    dtype: DType,
) -> candle_core::Result<CudaStorage> {
    let dev = xs.device().clone();
    let c = xl.shape().dims().last().copied().unwrap_or(1);
    let n = xl.shape().elem_count();
    let rows = n / c.max(1);
    let (xv, gv, bv) = (view::<f32>(xs, xl)?, view::<f32>(gs, gl)?, view::<f32>(bs, bl)?);
    let c_i32 = c as i32;
    match dtype {
        DType::F32 => {
            // SAFETY (allocation): the kernel writes every element of h_out.
            let mut h_out = unsafe { dev.alloc::<f32>(n)? };
            let func = function(&dev, &ADD_LAYER_NORM, "layer_norm_f32")?;
            let stream = dev.cuda_stream();
            let mut launch = stream.launch_builder(&func);
            launch.arg(&xv).arg(&gv).arg(&bv).arg(&mut h_out).arg(&c_i32).arg(&eps);
            // SAFETY: argument order and types match layer_norm_f32; one block per row.
            unsafe { launch.launch(row_launch(rows)) }.map_err(|e| err("layer_norm_f32", e))?;
            Ok(CudaStorage::wrap_cuda_slice(h_out, dev))
        }
        DType::BF16 => layer_norm_16::<half::bf16>(&dev, rows, n, (&xv, &gv, &bv), (c_i32, eps, 1)),
        DType::F16 => layer_norm_16::<half::f16>(&dev, rows, n, (&xv, &gv, &bv), (c_i32, eps, 0)),
        dt => candle_core::bail!("layer_norm: unsupported output dtype {dt:?}"),
    }
}

fn layer_norm_16<H: CudaDType + DeviceRepr>(
    dev: &CudaDevice,
    rows: usize,
    n: usize,
    (xv, gv, bv): (&CudaView<f32>, &CudaView<f32>, &CudaView<f32>),
    (c, eps, bf16): (i32, f32, i32),
) -> candle_core::Result<CudaStorage> {
    // SAFETY (allocation): the kernel writes every element of h_out.
    let mut h_out = unsafe { dev.alloc::<H>(n)? };
    {
        // SAFETY: bf16 and f16 are 2-byte types, so n of them are n u16 bit patterns.
        let mut h16 = unsafe { h_out.transmute_mut::<u16>(n) }.ok_or_else(|| err("layer_norm", "h is not 2-byte"))?;
        let func = function(dev, &ADD_LAYER_NORM, "layer_norm_16")?;
        let stream = dev.cuda_stream();
        let mut launch = stream.launch_builder(&func);
        launch.arg(xv).arg(gv).arg(bv).arg(&mut h16).arg(&c).arg(&eps).arg(&bf16);
        // SAFETY: argument order and types match layer_norm_16; one block per row.
        unsafe { launch.launch(row_launch(rows)) }.map_err(|e| err("layer_norm_16", e))?;
    }
    Ok(CudaStorage::wrap_cuda_slice(h_out, dev.clone()))
}

/// The 16-bit variant: branch and h travel as their bit patterns (u16); the kernel converts.
fn add_layer_norm_16<H: CudaDType + DeviceRepr>(
    dev: &CudaDevice,
    rows: usize,
    (xv, gv, bv): (&CudaView<f32>, &CudaView<f32>, &CudaView<f32>),
    branch: CudaView<H>,
    x_out: &mut CudaSlice<f32>,
    (c, eps, bf16): (i32, f32, i32),
) -> candle_core::Result<CudaStorage> {
    let n = branch.len();
    // SAFETY: bf16 and f16 are 2-byte types, so n of them are n u16 bit patterns.
    let branch16 = unsafe { branch.transmute::<u16>(n) }.ok_or_else(|| err("add_layer_norm", "branch is not 2-byte"))?;
    // SAFETY (allocation): the kernel writes every element of h_out.
    let mut h_out = unsafe { dev.alloc::<H>(n)? };
    {
        let mut h16 = unsafe { h_out.transmute_mut::<u16>(n) }.ok_or_else(|| err("add_layer_norm", "h is not 2-byte"))?;
        let func = function(dev, &ADD_LAYER_NORM, "add_layer_norm_16")?;
        let stream = dev.cuda_stream();
        let mut launch = stream.launch_builder(&func);
        launch.arg(xv).arg(&branch16).arg(gv).arg(bv).arg(x_out).arg(&mut h16).arg(&c).arg(&eps).arg(&bf16);
        // SAFETY: argument order and types match add_layer_norm_16; one block per row.
        unsafe { launch.launch(row_launch(rows)) }.map_err(|e| err("add_layer_norm_16", e))?;
    }
    Ok(CudaStorage::wrap_cuda_slice(h_out, dev.clone()))
}

/// LayerNorm's backward in one launch of `layer_norm_bwd_*` (kernels/add_layer_norm.cu): dx
/// (plus `plus`, the residual stream's gradient, when given) and per-block partial sums of dg and
/// db, which one column sum each finishes. x: (…, C) f32; g: (C) f32; dy: x's shape in f32, bf16
/// or f16; plus: x's shape, f32. Returns [dx (x's shape), dg (C), db (C)], f32.
pub fn layer_norm_bwd(x: &Tensor, g: &Tensor, dy: &Tensor, eps: f32, plus: Option<&Tensor>) -> candle_core::Result<[Tensor; 3]> {
    let dev = x.device().as_cuda_device()?.clone();
    let c = x.dim(candle_core::D::Minus1)?;
    let n = x.elem_count();
    let rows = n / c.max(1);
    if rows == 0 {
        return Ok([
            x.zeros_like()?.to_dtype(DType::F32)?,
            Tensor::zeros(c, DType::F32, x.device())?,
            Tensor::zeros(c, DType::F32, x.device())?,
        ]);
    }
    let blocks = rows.div_ceil(crate::ops::LN_BWD_ROWS);
    let (x, g, dy) = (x.to_dtype(DType::F32)?.contiguous()?, g.to_dtype(DType::F32)?.contiguous()?, dy.contiguous()?);
    let plus = plus.map(|p| p.to_dtype(DType::F32)?.contiguous()).transpose()?;
    let (xs, xl) = x.storage_and_layout();
    let (gs, gl) = g.storage_and_layout();
    let (ds, dl) = dy.storage_and_layout();
    let (xv, gv) = (cuda_view::<f32>(&xs, xl)?, cuda_view::<f32>(&gs, gl)?);
    let stream = dev.cuda_stream();
    let plus_storage = plus.as_ref().map(|p| p.storage_and_layout());
    let plus_view = match &plus_storage {
        Some((ps, pl)) => Some(cuda_view::<f32>(ps, pl)?),
        None => None,
    };
    // A null pointer when there is nothing to add: the kernel skips the add.
    let (plus_ptr, _plus_sync) = match &plus_view {
        Some(v) => {
            let (p, s) = v.device_ptr(&stream);
            (p, Some(s))
        }
        None => (0, None),
    };
    // SAFETY (allocations): the kernel writes every element of dx, and every element of each
    // block's row of the partial sums (its first row stores, the rest add).
    let (mut dx, mut dg_part, mut db_part) =
        unsafe { (dev.alloc::<f32>(n)?, dev.alloc::<f32>(blocks * c)?, dev.alloc::<f32>(blocks * c)?) };
    let (rows_i32, c_i32) = (rows as i32, c as i32);
    let cfg = LaunchConfig { grid_dim: (blocks as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
    let Storage::Cuda(dcs) = &*ds else { candle_core::bail!("layer_norm backward: dy is not on the GPU") };
    match dy.dtype() {
        DType::F32 => {
            let dv = view::<f32>(dcs, dl)?;
            let func = function(&dev, &ADD_LAYER_NORM, "layer_norm_bwd_f32")?;
            let mut launch = stream.launch_builder(&func);
            launch.arg(&xv).arg(&dv).arg(&gv).arg(&plus_ptr).arg(&mut dx).arg(&mut dg_part).arg(&mut db_part);
            launch.arg(&rows_i32).arg(&c_i32).arg(&eps);
            // SAFETY: argument order and types match layer_norm_bwd_f32; one block per ROWS_BWD rows.
            unsafe { launch.launch(cfg) }.map_err(|e| err("layer_norm_bwd_f32", e))?;
        }
        dt @ (DType::BF16 | DType::F16) => {
            // dy's device pointer, read by the kernel as 16-bit patterns (the views live to the launch)
            let (dy_bf16, dy_f16) = match dt {
                DType::BF16 => (Some(view::<half::bf16>(dcs, dl)?), None),
                _ => (None, Some(view::<half::f16>(dcs, dl)?)),
            };
            let (ptr, _sync) = match (&dy_bf16, &dy_f16) {
                (Some(v), _) => v.device_ptr(&stream),
                (_, Some(v)) => v.device_ptr(&stream),
                _ => candle_core::bail!("layer_norm backward: dy is neither bf16 nor f16"),
            };
            let bf16 = i32::from(dt == DType::BF16);
            let func = function(&dev, &ADD_LAYER_NORM, "layer_norm_bwd_16")?;
            let mut launch = stream.launch_builder(&func);
            launch.arg(&xv).arg(&ptr).arg(&gv).arg(&plus_ptr).arg(&mut dx).arg(&mut dg_part).arg(&mut db_part);
            launch.arg(&rows_i32).arg(&c_i32).arg(&eps).arg(&bf16);
            // SAFETY: argument order and types match layer_norm_bwd_16 (dy as its 16-bit patterns,
            // the view's device pointer); one block per ROWS_BWD rows.
            unsafe { launch.launch(cfg) }.map_err(|e| err("layer_norm_bwd_16", e))?;
        }
        dt => candle_core::bail!("layer_norm backward: unsupported dy dtype {dt:?}"),
    }
    let dx = wrap(dx, &dev, x.shape().clone());
    let partial_sum = |p: CudaSlice<f32>| wrap(p, &dev, (blocks, c)).sum(0); // (blocks, C) → (C)
    Ok([dx, partial_sum(dg_part)?, partial_sum(db_part)?])
}

/// `kernels/adamw.cu`: AdamW over every parameter in one launch.
pub static ADAMW: Cubins = Cubins { file: "stage3_fused/kernels/adamw.cu", archs: cubins::ADAMW };

// SAFETY: `Coefs` is #[repr(C)], seven f32, the layout of the kernel's `AdamWStep` argument.
unsafe impl DeviceRepr for crate::adamw::Coefs {}

/// One AdamW step of every parameter: `theta[i]` (updated in place) with its gradient, first and
/// second moment at `grads[i]`, `m[i]`, `v[i]` (updated in place), all f32, contiguous, on one
/// CUDA device. One launch: a table of the tensors' pointers and lengths, and of the chunks
/// (`adamw::chunks`) the blocks walk.
pub fn adamw_step(theta: &[Tensor], grads: &[Tensor], m: &[Tensor], v: &[Tensor], k: crate::adamw::Coefs) -> candle_core::Result<()> {
    let Some(first) = theta.first() else { return Ok(()) };
    let dev = first.device().as_cuda_device()?.clone();
    let stream = dev.cuda_stream();
    let lens: Vec<i64> = theta.iter().map(|t| t.elem_count() as i64).collect();
    // Per tensor: θ, g, m, v. The storage guards and the pointers' stream-order records live
    // until the launch is queued.
    let tensors: Vec<&Tensor> = (0..theta.len()).flat_map(|i| [&theta[i], &grads[i], &m[i], &v[i]]).collect();
    let guards: Vec<_> = tensors.iter().map(|t| t.storage_and_layout()).collect();
    let mut ptrs = Vec::with_capacity(tensors.len());
    let mut records = Vec::with_capacity(tensors.len());
    for ((guard, layout), t) in guards.iter().zip(&tensors) {
        let (Storage::Cuda(s), Some((o0, o1))) = (&**guard, layout.contiguous_offsets()) else {
            candle_core::bail!("adamw: every θ, g, m and v must be a contiguous CUDA tensor, got {:?}", t.layout())
        };
        if t.dtype() != DType::F32 || o1 - o0 != t.elem_count() {
            candle_core::bail!("adamw: f32 tensors only, got {:?}", t.dtype());
        }
        // The allocation's base pointer, then the tensor's first element (4 bytes an f32).
        let (ptr, record) = s.as_cuda_slice::<f32>()?.device_ptr(&stream);
        ptrs.push(ptr + 4 * o0 as u64);
        records.push(record);
    }
    let (owners, starts) = crate::adamw::chunks(&lens);
    let n_chunks = owners.len() as i32;
    if n_chunks == 0 {
        return Ok(());
    }
    let table = |e| err("adamw: upload the tensor table", e);
    let (ptrs_d, lens_d) = (stream.clone_htod(&ptrs).map_err(table)?, stream.clone_htod(&lens).map_err(table)?);
    let (owners_d, starts_d) = (stream.clone_htod(&owners).map_err(table)?, stream.clone_htod(&starts).map_err(table)?);
    let func = function(&dev, &ADAMW, "adamw_multi")?;
    // One block per chunk up to 65 535; the kernel's grid-stride loop takes the rest.
    let cfg = LaunchConfig { grid_dim: ((n_chunks as u32).min(65_535), 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
    let mut launch = stream.launch_builder(&func);
    launch.arg(&ptrs_d).arg(&lens_d).arg(&owners_d).arg(&starts_d).arg(&n_chunks).arg(&k);
    // SAFETY: argument order and types match adamw_multi's signature; every pointer in the table
    // addresses its tensor's `lens` f32 values, alive (the guards above) until the launch is
    // queued on candle's stream, where it is ordered with every other use of them.
    unsafe { launch.launch(cfg) }.map_err(|e| err("adamw_multi", e))?;
    drop(records);
    Ok(())
}
