//! The CUDA side of the fused ops: cuBLASLt GEMMs with epilogues, and the NVRTC-compiled
//! residual-add + LayerNorm kernel (`kernels/add_layer_norm.cu`) wrapped for candle.

use crate::cublaslt_model::{DataType, Epilogue as ModelEpilogue};
use crate::device_cache::{Cache, DeviceKey};
use crate::gemm_args::{linear_args, LinearKind};
use crate::ops::{Epilogue, LN_EPS};
use candle_core::cuda::cudarc::cublaslt::{Activation, CudaBlasLT, Matmul, MatmulConfig};
use candle_core::cuda::cudarc::driver::{CudaSlice, CudaView, DeviceRepr, LaunchConfig, PushKernelArg};
use candle_core::cuda::{CudaDType, CudaDevice, CudaStorage, DeviceId};
use candle_core::op::BackpropOp;
use candle_core::{DType, Layout, Storage, Tensor};
use std::sync::Arc;

fn err(what: &str, e: impl std::fmt::Debug) -> candle_core::Error {
    candle_core::Error::Msg(format!("{what}: {e:?}"))
}

thread_local! {
    /// One cuBLASLt handle (and its workspace) per device, made on first use: creating them
    /// per call would cost an allocation and a handle setup every GEMM. Keyed by the device
    /// (its stream) and its compute capability, not the GPU ordinal (`device_cache`).
    static LT: Cache<DeviceKey<DeviceId>, Arc<CudaBlasLT>> = Cache::new();
    /// NVRTC's PTX of kernels/add_layer_norm.cu, per architecture.
    static PTX: Cache<(u32, u32), String> = Cache::new();
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
    let (start, end) = layout.contiguous_offsets().ok_or_else(|| err("cuda_view", "expected a contiguous tensor"))?;
    Ok(cs.as_cuda_slice::<T>()?.slice(start..end))
}

/// A CUDA allocation, written by our own launch on candle's stream, as a candle tensor.
pub fn wrap<T: CudaDType>(slice: CudaSlice<T>, dev: &CudaDevice, shape: impl Into<candle_core::Shape>) -> Tensor {
    Tensor::from_storage(Storage::Cuda(CudaStorage::wrap_cuda_slice(slice, dev.clone())), shape, BackpropOp::none(), false)
}

/// y = epilogue(x Wᵀ + b) through cuBLASLt. cuBLASLt is column-major, so we ask for
/// yᵀ (N × M) = W (N × K) · xᵀ (K × M): W's rows are K-contiguous, so A = W with transa and
/// B = x, both with leading dimension K; the column-major N × M result is y's row-major M × N.
/// The bias, a length-N vector added to every column, is exactly a per-row-of-y bias.
pub fn linear(x: &Tensor, w: &Tensor, b: &Tensor, epilogue: Epilogue) -> candle_core::Result<Tensor> {
    match x.dtype() {
        DType::BF16 => linear_t::<half::bf16>(x, w, b, epilogue),
        DType::F16 => linear_t::<half::f16>(x, w, b, epilogue),
        // cudarc's cuBLASLt f32 GEMM computes in TF32 (CUBLAS_COMPUTE_32F_FAST_TF32), so only
        // the tf32 precision takes this path; stage 3 refuses fp32 on CUDA for that reason.
        DType::F32 => linear_t::<f32>(x, w, b, epilogue),
        dt => candle_core::bail!("cuBLASLt linear: unsupported dtype {dt:?}"),
    }
}

fn linear_t<T: CudaDType + DeviceRepr>(x: &Tensor, w: &Tensor, b: &Tensor, epilogue: Epilogue) -> candle_core::Result<Tensor>
where
    CudaBlasLT: Matmul<T>,
{
    let (bsz, t, k) = x.dims3()?;
    let n = w.dim(0)?;
    let m = bsz * t;
    let dev = x.device().as_cuda_device()?.clone();
    let (x, w, b) = (x.contiguous()?, w.to_dtype(x.dtype())?.contiguous()?, b.to_dtype(x.dtype())?.contiguous()?);
    // The residual rides in through C with β = 1 when it has the GEMM's dtype. The f32
    // residual stream of a bf16/f16 block does not (cudarc's wrapper gives C and D one dtype),
    // so there it is added after the bias epilogue, in f32: one extra pass, said in the header.
    let fused_residual = match epilogue {
        Epilogue::BiasResidual(r) if r.dtype() == x.dtype() => Some(r.contiguous()?),
        _ => None,
    };
    let ((xs, xl), (ws, wl), (bs, bl)) = (x.storage_and_layout(), w.storage_and_layout(), b.storage_and_layout());
    let (xv, wv, bv) = (cuda_view::<T>(&xs, xl)?, cuda_view::<T>(&ws, wl)?, cuda_view::<T>(&bs, bl)?);
    // SAFETY (allocations below): every element of `out` is written by the memcpy or the GEMM
    // (β = 0 never reads C) before anything reads it.
    let mut out: CudaSlice<T> = unsafe { dev.alloc::<T>(m * n)? };
    if let Some(r) = &fused_residual {
        let (rs, rl) = r.storage_and_layout();
        dev.memcpy_dtod(&cuda_view::<T>(&rs, rl)?, &mut out)?;
    }
    let dtype = match x.dtype() {
        DType::BF16 => DataType::Bf16,
        DType::F16 => DataType::F16,
        _ => DataType::F32,
    };
    let kind = match epilogue {
        Epilogue::Bias => LinearKind::Bias,
        Epilogue::BiasGelu => LinearKind::BiasGelu,
        Epilogue::BiasResidual(_) if fused_residual.is_some() => LinearKind::BiasResidualInC,
        Epilogue::BiasResidual(_) => LinearKind::Bias, // residual added after, in f32 (below)
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
    let y = wrap(out, &dev, (bsz, t, n));
    match epilogue {
        Epilogue::BiasResidual(r) if fused_residual.is_none() => r + y.to_dtype(r.dtype())?,
        _ => Ok(y),
    }
}

/// The kernel source. CI compiles it with `nvcc --ptx`; at run time NVRTC compiles it once per
/// process for the device's architecture.
pub const ADD_LAYER_NORM_CU: &str = include_str!("../kernels/add_layer_norm.cu");
const MODULE: &str = "speedkit_add_layer_norm";

fn add_layer_norm_ptx(dev: &CudaDevice) -> candle_core::Result<String> {
    let sm = device_key(dev)?.sm;
    PTX.with(|c| {
        c.get_or_try_insert(sm, || {
            // CompileOptions wants a 'static str; one leaked string per architecture.
            let arch: &'static str = Box::leak(format!("compute_{}{}", sm.0, sm.1).into_boxed_str());
            let opts = candle_core::cuda::cudarc::nvrtc::CompileOptions { arch: Some(arch), ..Default::default() };
            candle_core::cuda::cudarc::nvrtc::compile_ptx_with_opts(ADD_LAYER_NORM_CU, opts)
                .map(|p| p.to_src())
                .map_err(|e| err("NVRTC could not compile kernels/add_layer_norm.cu", e))
        })
    })
}

/// (x + branch, LayerNorm(x + branch)) in one launch. x: (…, C) f32; branch: same shape, f32,
/// bf16 or f16; h comes out in branch's dtype.
pub fn add_layer_norm(x: &Tensor, branch: &Tensor, g: &Tensor, b: &Tensor) -> candle_core::Result<(Tensor, Tensor)> {
    let c = x.dim(candle_core::D::Minus1)?;
    let rows = x.elem_count() / c;
    let dev = x.device().as_cuda_device()?.clone();
    let ptx = add_layer_norm_ptx(&dev)?;
    let (x, branch, g, b) = (x.contiguous()?, branch.contiguous()?, g.contiguous()?, b.contiguous()?);
    let ((xs, xl), (gs, gl), (bs, bl)) = (x.storage_and_layout(), g.storage_and_layout(), b.storage_and_layout());
    let (xv, gv, bv) = (cuda_view::<f32>(&xs, xl)?, cuda_view::<f32>(&gs, gl)?, cuda_view::<f32>(&bs, bl)?);
    let (brs, brl) = branch.storage_and_layout();
    let cfg = LaunchConfig { grid_dim: (rows as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
    let (c_i32, eps) = (c as i32, LN_EPS);
    // SAFETY (allocations): the kernel writes every element of x_out and h_out.
    let mut x_out = unsafe { dev.alloc::<f32>(rows * c)? };
    let shape = x.shape().clone();
    let h = match branch.dtype() {
        DType::F32 => {
            let brv = cuda_view::<f32>(&brs, brl)?;
            let mut h_out = unsafe { dev.alloc::<f32>(rows * c)? };
            let func = dev.get_or_load_custom_func("add_layer_norm_f32", MODULE, &ptx)?;
            let mut launch = func.builder();
            launch.arg(&xv).arg(&brv).arg(&gv).arg(&bv).arg(&mut x_out).arg(&mut h_out).arg(&c_i32).arg(&eps);
            // SAFETY: argument order and types match the kernel's signature; one block per row.
            unsafe { launch.launch(cfg) }.map_err(|e| err("add_layer_norm_f32", e))?;
            wrap(h_out, &dev, shape.clone())
        }
        DType::BF16 => {
            launch_16::<half::bf16>(&dev, &ptx, cfg, (&xv, &gv, &bv), cuda_view(&brs, brl)?, &mut x_out, (c_i32, eps, 1), &shape)?
        }
        DType::F16 => launch_16::<half::f16>(&dev, &ptx, cfg, (&xv, &gv, &bv), cuda_view(&brs, brl)?, &mut x_out, (c_i32, eps, 0), &shape)?,
        dt => candle_core::bail!("add_layer_norm: unsupported branch dtype {dt:?}"),
    };
    Ok((wrap(x_out, &dev, shape), h))
}

/// h = LayerNorm(x) in `dtype`, one launch of `layer_norm_*` (two-pass variance, cast fused
/// into the store). x: (…, C) f32 contiguous; g, b: (C) f32.
pub fn layer_norm(x: &Tensor, g: &Tensor, b: &Tensor, dtype: DType) -> candle_core::Result<Tensor> {
    let c = x.dim(candle_core::D::Minus1)?;
    let rows = x.elem_count() / c;
    let dev = x.device().as_cuda_device()?.clone();
    let ptx = add_layer_norm_ptx(&dev)?;
    let (x, g, b) = (x.to_dtype(DType::F32)?.contiguous()?, g.to_dtype(DType::F32)?.contiguous()?, b.to_dtype(DType::F32)?.contiguous()?);
    let ((xs, xl), (gs, gl), (bs, bl)) = (x.storage_and_layout(), g.storage_and_layout(), b.storage_and_layout());
    let (xv, gv, bv) = (cuda_view::<f32>(&xs, xl)?, cuda_view::<f32>(&gs, gl)?, cuda_view::<f32>(&bs, bl)?);
    let cfg = LaunchConfig { grid_dim: (rows as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
    let (c_i32, eps) = (c as i32, LN_EPS);
    let shape = x.shape().clone();
    let n = rows * c;
    match dtype {
        DType::F32 => {
            // SAFETY (allocation): the kernel writes every element of h_out.
            let mut h_out = unsafe { dev.alloc::<f32>(n)? };
            let func = dev.get_or_load_custom_func("layer_norm_f32", MODULE, &ptx)?;
            let mut launch = func.builder();
            launch.arg(&xv).arg(&gv).arg(&bv).arg(&mut h_out).arg(&c_i32).arg(&eps);
            // SAFETY: argument order and types match layer_norm_f32; one block per row.
            unsafe { launch.launch(cfg) }.map_err(|e| err("layer_norm_f32", e))?;
            Ok(wrap(h_out, &dev, shape))
        }
        DType::BF16 => layer_norm_16::<half::bf16>(&dev, &ptx, cfg, (&xv, &gv, &bv), (c_i32, eps, 1), &shape),
        DType::F16 => layer_norm_16::<half::f16>(&dev, &ptx, cfg, (&xv, &gv, &bv), (c_i32, eps, 0), &shape),
        dt => candle_core::bail!("layer_norm: unsupported output dtype {dt:?}"),
    }
}

fn layer_norm_16<H: CudaDType + DeviceRepr>(
    dev: &CudaDevice,
    ptx: &str,
    cfg: LaunchConfig,
    (xv, gv, bv): (&CudaView<f32>, &CudaView<f32>, &CudaView<f32>),
    (c, eps, bf16): (i32, f32, i32),
    shape: &candle_core::Shape,
) -> candle_core::Result<Tensor> {
    let n = shape.elem_count();
    // SAFETY (allocation): the kernel writes every element of h_out.
    let mut h_out = unsafe { dev.alloc::<H>(n)? };
    {
        // SAFETY: bf16 and f16 are 2-byte types, so n of them are n u16 bit patterns.
        let mut h16 = unsafe { h_out.transmute_mut::<u16>(n) }.ok_or_else(|| err("layer_norm", "h is not 2-byte"))?;
        let func = dev.get_or_load_custom_func("layer_norm_16", MODULE, ptx)?;
        let mut launch = func.builder();
        launch.arg(xv).arg(gv).arg(bv).arg(&mut h16).arg(&c).arg(&eps).arg(&bf16);
        // SAFETY: argument order and types match layer_norm_16; one block per row.
        unsafe { launch.launch(cfg) }.map_err(|e| err("layer_norm_16", e))?;
    }
    Ok(wrap(h_out, dev, shape.clone()))
}

/// The 16-bit variant: branch and h travel as their bit patterns (u16); the kernel converts.
#[allow(clippy::too_many_arguments)]
fn launch_16<H: CudaDType + DeviceRepr>(
    dev: &CudaDevice,
    ptx: &str,
    cfg: LaunchConfig,
    (xv, gv, bv): (&CudaView<f32>, &CudaView<f32>, &CudaView<f32>),
    branch: CudaView<H>,
    x_out: &mut CudaSlice<f32>,
    (c, eps, bf16): (i32, f32, i32),
    shape: &candle_core::Shape,
) -> candle_core::Result<Tensor> {
    let n = shape.elem_count();
    // SAFETY: bf16 and f16 are 2-byte types, so n of them are n u16 bit patterns.
    let branch16 = unsafe { branch.transmute::<u16>(n) }.ok_or_else(|| err("add_layer_norm", "branch is not 2-byte"))?;
    let mut h_out = unsafe { dev.alloc::<H>(n)? };
    {
        let mut h16 = unsafe { h_out.transmute_mut::<u16>(n) }.ok_or_else(|| err("add_layer_norm", "h is not 2-byte"))?;
        let func = dev.get_or_load_custom_func("add_layer_norm_16", MODULE, ptx)?;
        let mut launch = func.builder();
        launch.arg(xv).arg(&branch16).arg(gv).arg(bv).arg(x_out).arg(&mut h16).arg(&c).arg(&eps).arg(&bf16);
        // SAFETY: argument order and types match add_layer_norm_16; one block per row.
        unsafe { launch.launch(cfg) }.map_err(|e| err("add_layer_norm_16", e))?;
    }
    Ok(wrap(h_out, dev, shape.clone()))
}
