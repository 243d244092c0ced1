//! Stage 3's training GEMMs on CUDA: cuBLASLt's low-level API, because cudarc's safe `Matmul`
//! sets only the BIAS and GELU_BIAS epilogues, with no aux matrix and no bias gradient. Three
//! epilogues do the element-wise work of the backward inside the GEMMs. TransformerEngine's
//! `cublaslt_gemm.cu` picks the same ones for the same requests (bias + GELU: GELU_AUX_BIAS
//! forward, DGELU_BGRAD backward; bias alone, backward: BGRADB), and its LayerNormMLP runs its
//! backward GEMMs on the transposes used here ("NN" data gradient, "NT" weight gradient):
//!
//! - GELU_AUX_BIAS, fc1's forward while training: h = gelu(z) and z = x·W₁ᵀ + b₁ from one GEMM,
//!   z kept (in h's dtype) for the backward — the CUDA counterpart of the CPU's `pre_gelu`;
//! - DGELU_BGRAD, fc2's data-gradient GEMM: dz₁ = gelu′(z) ∘ (dy·W₂) and db₁ = Σ_tokens dz₁;
//! - BGRADB, every weight-gradient GEMM: dW = dzᵀ·x and db = Σ_tokens dz.
//!
//! The arguments come from `gemm_args` (pure functions, executed by the CPU model of cuBLASLt in
//! `tests/cublaslt_backward.rs`); this file turns them into descriptors and launches on candle's
//! stream with the handle `cuda::lt` keeps. `ladder selftest` has a row per gradient.

use crate::cuda::{cuda_view, device_key, lt, view, wrap};
use crate::device_cache::{Cache, DeviceKey};
use crate::gemm_args::{alignments, dgrad_args, linear_args, wgrad_args, LinearKind};
use candle_core::backend::BackendStorage;
use candle_core::cuda::cudarc::cublaslt::{result, sys, MatmulShared};
use candle_core::cuda::cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut, DeviceRepr};
use candle_core::cuda::{CudaDType, CudaDevice, CudaStorage, DeviceId};
use candle_core::{DType, Layout, Tensor};
use cublaslt_model::{DataType, Epilogue, MatmulArgs};
use std::ffi::c_void;
use std::rc::Rc;

fn err(what: &str, e: impl std::fmt::Debug) -> candle_core::Error {
    candle_core::Error::Msg(format!("cuBLASLt (training): {what}: {e:?}"))
}

thread_local! {
    /// One workspace per device (its stream) and architecture, made on first use: cudarc keeps
    /// the one of its `CudaBlasLT` private.
    static WORKSPACE: Cache<DeviceKey<DeviceId>, Rc<(CudaSlice<u8>, usize)>> = Cache::new();
}

/// cuBLASLt's recommended workspace, as cudarc sizes its own: 32 MiB on Hopper, 4 MiB before.
fn workspace(dev: &CudaDevice) -> candle_core::Result<Rc<(CudaSlice<u8>, usize)>> {
    let key = device_key(dev)?;
    let bytes = if key.sm.0 >= 9 { 32 << 20 } else { 4 << 20 };
    // SAFETY: cuBLASLt uses the workspace as scratch; nothing reads it before writing.
    WORKSPACE.with(|c| c.get_or_try_insert(key, || Ok(Rc::new((unsafe { dev.alloc::<u8>(bytes)? }, bytes)))))
}

/// cuBLASLt descriptors, destroyed when dropped (stage 4's FP8 GEMMs use them too).
pub struct MatLayout(pub sys::cublasLtMatrixLayout_t);
pub struct Desc(pub sys::cublasLtMatmulDesc_t);
pub struct Pref(pub sys::cublasLtMatmulPreference_t);

impl Drop for MatLayout {
    fn drop(&mut self) {
        // SAFETY: created by create_matrix_layout, destroyed once.
        let _ = unsafe { result::destroy_matrix_layout(self.0) };
    }
}
impl Drop for Desc {
    fn drop(&mut self) {
        // SAFETY: created by create_matmul_desc, destroyed once.
        let _ = unsafe { result::destroy_matmul_desc(self.0) };
    }
}
impl Drop for Pref {
    fn drop(&mut self) {
        // SAFETY: created by create_matmul_pref, destroyed once.
        let _ = unsafe { result::destroy_matmul_pref(self.0) };
    }
}

fn cuda_type(t: DataType) -> candle_core::Result<sys::cudaDataType> {
    Ok(match t {
        DataType::F32 => sys::cudaDataType_t::CUDA_R_32F,
        DataType::Bf16 => sys::cudaDataType_t::CUDA_R_16BF,
        DataType::F16 => sys::cudaDataType_t::CUDA_R_16F,
        DataType::E4m3 | DataType::E5m2 => return Err(err("data type", "stage 3's training GEMMs take f32, bf16 or f16")),
    })
}

fn model_type(dt: DType) -> candle_core::Result<DataType> {
    Ok(match dt {
        DType::BF16 => DataType::Bf16,
        DType::F16 => DataType::F16,
        DType::F32 => DataType::F32,
        dt => return Err(err("data type", format!("{dt:?} (f32, bf16 or f16)"))),
    })
}

fn layout(l: &cublaslt_model::MatrixLayout) -> candle_core::Result<MatLayout> {
    result::create_matrix_layout(cuda_type(l.dtype)?, l.rows, l.cols, l.ld).map(MatLayout).map_err(|e| err("matrix layout", e))
}

fn set<T>(desc: &Desc, attr: sys::cublasLtMatmulDescAttributes_t, value: &T) -> candle_core::Result<()> {
    // SAFETY: `value` is the type cuBLASLt documents for `attr` (each call site says which), and
    // cuBLASLt copies it before returning.
    unsafe { result::set_matmul_desc_attribute(desc.0, attr, value as *const T as *const c_void, std::mem::size_of::<T>()) }
        .map_err(|e| err(&format!("{attr:?}"), e))
}

/// The minimum-alignment preferences of A, B, C and D, in bytes (`gemm_args::alignments`): the
/// heuristic then offers only algorithms that work at those alignments. (Stage 4's plans too.)
pub fn set_alignments(pref: &Pref, align: [u32; 4]) -> candle_core::Result<()> {
    use sys::cublasLtMatmulPreferenceAttributes_t as P;
    let attrs = [
        P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES,
        P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
        P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
        P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES,
    ];
    for (attr, bytes) in attrs.into_iter().zip(align) {
        // SAFETY: a uint32_t attribute, copied by cuBLASLt.
        unsafe { result::set_matmul_pref_attribute(pref.0, attr, &bytes as *const u32 as *const c_void, std::mem::size_of::<u32>()) }
            .map_err(|e| err(&format!("{attr:?}"), e))?;
    }
    Ok(())
}

/// Device pointers of one GEMM: A, B, D (also C: β = 0 never reads it), and the bias and aux
/// pointers when the epilogue has them (0 when not).
struct Ptrs {
    a: u64,
    b: u64,
    d: u64,
    bias: u64,
    aux: u64,
}

/// cublasLtMatmul of `args` (from `gemm_args`) on `ptrs`, on `dev`'s stream.
///
/// # Safety
/// Every pointer addresses the values its layout in `args` describes (the bias `args.bias_len`,
/// the aux m × n at its ld), on `dev`, and stays alive until the GEMM has run on the stream (the
/// callers hold each pointer's stream guard across the call).
unsafe fn matmul(dev: &CudaDevice, args: &MatmulArgs, p: Ptrs) -> candle_core::Result<()> {
    use sys::cublasLtEpilogue_t as E;
    use sys::cublasLtMatmulDescAttributes_t as A;
    let (a_layout, b_layout, c_layout, d_layout) = (layout(&args.a)?, layout(&args.b)?, layout(&args.c)?, layout(&args.d)?);
    // f32 accumulation; an f32 GEMM runs on TF32 tensor cores, as cudarc's (stage 3 refuses fp32 on CUDA).
    let compute = match args.a.dtype {
        DataType::F32 => sys::cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_TF32,
        _ => sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
    };
    let desc = result::create_matmul_desc(compute, sys::cudaDataType_t::CUDA_R_32F).map(Desc).map_err(|e| err("matmul desc", e))?;
    // cublasOperation_t (int32): CUBLAS_OP_N = 0, CUBLAS_OP_T = 1.
    set(&desc, A::CUBLASLT_MATMUL_DESC_TRANSA, &(args.transa as i32))?;
    set(&desc, A::CUBLASLT_MATMUL_DESC_TRANSB, &(args.transb as i32))?;
    let (epilogue, aux) = match args.epilogue {
        Epilogue::Default => (E::CUBLASLT_EPILOGUE_DEFAULT, None),
        Epilogue::Bias => (E::CUBLASLT_EPILOGUE_BIAS, None),
        Epilogue::GeluBias => (E::CUBLASLT_EPILOGUE_GELU_BIAS, None),
        Epilogue::GeluAuxBias { aux } => (E::CUBLASLT_EPILOGUE_GELU_AUX_BIAS, Some(aux)),
        Epilogue::DGeluBgrad { aux } => (E::CUBLASLT_EPILOGUE_DGELU_BGRAD, Some(aux)),
        Epilogue::BgradA => (E::CUBLASLT_EPILOGUE_BGRADA, None),
        Epilogue::BgradB => (E::CUBLASLT_EPILOGUE_BGRADB, None),
    };
    set(&desc, A::CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue)?; // cublasLtEpilogue_t
    if args.epilogue.reads_bias() || args.epilogue.writes_bias() {
        // const void* (a bias read) or void* (a bias gradient written), in D's type: BIAS_DATA_TYPE
        // is left at its default, as TransformerEngine leaves it outside FP8.
        set(&desc, A::CUBLASLT_MATMUL_DESC_BIAS_POINTER, &p.bias)?;
    }
    if let Some(aux) = aux {
        set(&desc, A::CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &p.aux)?; // void*: z written, or read by DGELU
        set(&desc, A::CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &aux.ld)?; // int64_t, a multiple of 8
        set(&desc, A::CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_DATA_TYPE, &cuda_type(aux.dtype)?)?;
        // cudaDataType
    }
    let ws = workspace(dev)?;
    let pref = result::create_matmul_pref().map(Pref).map_err(|e| err("preference", e))?;
    // SAFETY: size_t attribute, copied by cuBLASLt.
    unsafe {
        result::set_matmul_pref_attribute(
            pref.0,
            sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
            &ws.1 as *const usize as *const c_void,
            std::mem::size_of::<usize>(),
        )
    }
    .map_err(|e| err("workspace preference", e))?;
    // This call's alignments (C is D's buffer): without them cuBLASLt assumes 256 bytes and may
    // pick a kernel whose wide loads fault on a view 16 bytes into its allocation.
    let align = alignments([p.a, p.b, p.d, p.d], [&args.a, &args.b, &args.c, &args.d]);
    set_alignments(&pref, align)?;
    let handle = lt(dev)?;
    // The heuristic reads the descriptor's bias and aux pointers for their alignment, so it is
    // asked with this call's pointers set. (No plan cache: one query per GEMM, as cudarc's own.)
    // SAFETY: every descriptor and layout is alive.
    let heuristic =
        unsafe { result::get_matmul_algo_heuristic(*handle.handle(), desc.0, a_layout.0, b_layout.0, c_layout.0, d_layout.0, pref.0) }
            .map_err(|e| err(&format!("no algorithm for m={} n={} k={} with {:?}", args.m, args.n, args.k, args.epilogue), e))?;
    let stream = dev.cuda_stream();
    let (w, _gw) = ws.0.device_ptr(&stream);
    let (alpha, beta) = (args.alpha, args.beta);
    // SAFETY: the caller's contract (pointers as the layouts say, alive on this stream); β = 0, so
    // C (D's buffer) is not read; the workspace holds ws.1 bytes.
    unsafe {
        result::matmul(
            *handle.handle(),
            desc.0,
            &alpha as *const f32 as *const c_void,
            &beta as *const f32 as *const c_void,
            p.a as *const c_void,
            a_layout.0,
            p.b as *const c_void,
            b_layout.0,
            p.d as *const c_void,
            c_layout.0,
            p.d as *mut c_void,
            d_layout.0,
            &heuristic.algo,
            w as *mut c_void,
            ws.1,
            stream.cu_stream() as sys::cudaStream_t,
        )
    }
    .map_err(|e| err("cublasLtMatmul", e))
}

/// fc1's forward while training: (h, z) = (gelu(x Wᵀ + b), x Wᵀ + b) from one GEMM with
/// GELU_AUX_BIAS. x: (B, T, K), W: (N, K), b: (N), contiguous, one dtype; h and z (B, T, N) in
/// that dtype. N must be a multiple of 8 (`gemm_args::gelu_aux_fits`).
pub fn linear_gelu_aux(
    xs: &CudaStorage,
    xl: &Layout,
    ws: &CudaStorage,
    wl: &Layout,
    bs: &CudaStorage,
    bl: &Layout,
) -> candle_core::Result<(CudaStorage, CudaStorage)> {
    match xs.dtype() {
        DType::BF16 => gelu_aux_t::<half::bf16>((xs, xl), (ws, wl), (bs, bl)),
        DType::F16 => gelu_aux_t::<half::f16>((xs, xl), (ws, wl), (bs, bl)),
        DType::F32 => gelu_aux_t::<f32>((xs, xl), (ws, wl), (bs, bl)),
        dt => candle_core::bail!("linear_gelu_aux: unsupported dtype {dt:?}"),
    }
}

fn gelu_aux_t<T: CudaDType + DeviceRepr>(
    (xs, xl): (&CudaStorage, &Layout),
    (ws, wl): (&CudaStorage, &Layout),
    (bs, bl): (&CudaStorage, &Layout),
) -> candle_core::Result<(CudaStorage, CudaStorage)> {
    let (bsz, t, k) = xl.shape().dims3()?;
    let n = wl.shape().dims()[0];
    let m = bsz * t;
    let args = linear_args(m, k, n, model_type(xs.dtype())?, LinearKind::BiasGeluAux);
    let dev = xs.device().clone();
    let (xv, wv, bv) = (view::<T>(xs, xl)?, view::<T>(ws, wl)?, view::<T>(bs, bl)?);
    // SAFETY (allocations): the GEMM writes every element of h (D) and z (aux).
    let (mut h, mut z) = unsafe { (dev.alloc::<T>(m * n)?, dev.alloc::<T>(m * n)?) };
    let stream = dev.cuda_stream();
    {
        let ((a, _ga), (b, _gb), (bias, _gbias)) = (wv.device_ptr(&stream), xv.device_ptr(&stream), bv.device_ptr(&stream));
        let ((d, _gd), (aux, _gaux)) = (h.device_ptr_mut(&stream), z.device_ptr_mut(&stream));
        // SAFETY: A = W (k·n), B = x (k·m), D = h and aux = z (n·m, ld n), bias n values, as `args`.
        unsafe { matmul(&dev, &args, Ptrs { a, b, d, bias, aux })? };
    }
    Ok((CudaStorage::wrap_cuda_slice(h, dev.clone()), CudaStorage::wrap_cuda_slice(z, dev)))
}

/// `t` in `dtype`, contiguous, starting 16-byte aligned (cuBLASLt's minimum for its tensor-core
/// kernels): a copy only when a view starts mid-allocation at an odd offset.
fn operand(t: &Tensor, dtype: DType) -> candle_core::Result<Tensor> {
    let t = t.to_dtype(dtype)?.contiguous()?;
    match (t.layout().start_offset() * dtype.size_in_bytes()) % 16 {
        0 => Ok(t),
        _ => t.copy(),
    }
}

/// A linear's backward from dz = ∂loss/∂(x Wᵀ + b): dx = dz·W (the "NN" data-gradient GEMM),
/// dW = dzᵀ·x and, with `bgrad`, db = Σ_tokens dz (the "NT" weight-gradient GEMM with BGRADB).
/// x: (B, T, K); W: (N, K); dz: (B, T, N), cast to x's dtype (the GEMMs' dtype, as TransformerEngine
/// feeds its GEMMs dy in the activations' type). Returns dx, dW and db in that dtype.
pub fn linear_bwd(x: &Tensor, w: &Tensor, dz: &Tensor, bgrad: bool) -> candle_core::Result<(Tensor, Tensor, Option<Tensor>)> {
    match x.dtype() {
        DType::BF16 => linear_bwd_t::<half::bf16>(x, w, dz, bgrad),
        DType::F16 => linear_bwd_t::<half::f16>(x, w, dz, bgrad),
        DType::F32 => linear_bwd_t::<f32>(x, w, dz, bgrad),
        dt => candle_core::bail!("linear backward: unsupported dtype {dt:?}"),
    }
}

fn linear_bwd_t<T: CudaDType + DeviceRepr>(
    x: &Tensor,
    w: &Tensor,
    dz: &Tensor,
    bgrad: bool,
) -> candle_core::Result<(Tensor, Tensor, Option<Tensor>)> {
    let (bsz, t, k) = x.dims3()?;
    let n = w.dim(0)?;
    let m = bsz * t;
    let dt = x.dtype();
    let (x, w, dz) = (operand(x, dt)?, operand(w, dt)?, operand(dz, dt)?);
    let dev = x.device().as_cuda_device()?.clone();
    let dtype = model_type(dt)?;
    let (wgrad, dgrad) = (wgrad_args(m, k, n, dtype, bgrad), dgrad_args(m, k, n, dtype, false));
    // SAFETY (allocations): the GEMMs write every element of dx, dW and db.
    let (mut dx, mut dw) = unsafe { (dev.alloc::<T>(m * k)?, dev.alloc::<T>(n * k)?) };
    let mut db = if bgrad { Some(unsafe { dev.alloc::<T>(n)? }) } else { None };
    let stream = dev.cuda_stream();
    {
        let ((xs, xl), (ws, wl), (dzs, dzl)) = (x.storage_and_layout(), w.storage_and_layout(), dz.storage_and_layout());
        let (xv, wv, dzv) = (cuda_view::<T>(&xs, xl)?, cuda_view::<T>(&ws, wl)?, cuda_view::<T>(&dzs, dzl)?);
        let ((xp, _gx), (wp, _gw), (dzp, _gdz)) = (xv.device_ptr(&stream), wv.device_ptr(&stream), dzv.device_ptr(&stream));
        let (dwp, _gdw) = dw.device_ptr_mut(&stream);
        let (bias, _gdb) = db.as_mut().map(|s| s.device_ptr_mut(&stream)).unzip();
        // SAFETY: A = x (k·m), B = dz (n·m, read transposed), D = dW (k·n), db n values, as `wgrad`.
        unsafe { matmul(&dev, &wgrad, Ptrs { a: xp, b: dzp, d: dwp, bias: bias.unwrap_or(0), aux: 0 })? };
        let (dxp, _gdx) = dx.device_ptr_mut(&stream);
        // SAFETY: A = W (k·n), B = dz (n·m), D = dx (k·m), as `dgrad`.
        unsafe { matmul(&dev, &dgrad, Ptrs { a: wp, b: dzp, d: dxp, bias: 0, aux: 0 })? };
    }
    let db = db.map(|s| wrap(s, &dev, n));
    Ok((wrap(dx, &dev, (bsz, t, k)), wrap(dw, &dev, (n, k)), db))
}

/// fc2's backward inside `ops::mlp`: from dy (B, T, C), h (B, T, FF), W₂ (C, FF) and fc1's z
/// (B, T, FF, the GELU_AUX_BIAS aux): the weight-gradient GEMM with BGRADB (dW₂, db₂) and the
/// data-gradient GEMM with DGELU_BGRAD (dz₁ = gelu′(z) ∘ (dy·W₂), db₁ = Σ_tokens dz₁). Returns
/// (dz₁, db₁, dW₂, db₂) in h's dtype.
pub fn mlp_fc2_bwd(h: &Tensor, w2: &Tensor, dy: &Tensor, z: &Tensor) -> candle_core::Result<(Tensor, Tensor, Tensor, Tensor)> {
    match h.dtype() {
        DType::BF16 => mlp_fc2_bwd_t::<half::bf16>(h, w2, dy, z),
        DType::F16 => mlp_fc2_bwd_t::<half::f16>(h, w2, dy, z),
        DType::F32 => mlp_fc2_bwd_t::<f32>(h, w2, dy, z),
        dt => candle_core::bail!("mlp backward: unsupported dtype {dt:?}"),
    }
}

fn mlp_fc2_bwd_t<T: CudaDType + DeviceRepr>(
    h: &Tensor,
    w2: &Tensor,
    dy: &Tensor,
    z: &Tensor,
) -> candle_core::Result<(Tensor, Tensor, Tensor, Tensor)> {
    let (bsz, t, ff) = h.dims3()?;
    let c = w2.dim(0)?;
    let m = bsz * t;
    let dt = h.dtype();
    if z.dims() != h.dims() || z.dtype() != dt {
        candle_core::bail!("mlp backward: z {:?} ({:?}) must be h's shape {:?} and dtype {dt:?}", z.dims(), z.dtype(), h.dims());
    }
    let (h, w2, dy, z) = (operand(h, dt)?, operand(w2, dt)?, operand(dy, dt)?, operand(z, dt)?);
    let dev = h.device().as_cuda_device()?.clone();
    let dtype = model_type(dt)?;
    // fc2 is the linear (in = FF, out = C); its input h is GELU's output.
    let (wgrad, dgrad) = (wgrad_args(m, ff, c, dtype, true), dgrad_args(m, ff, c, dtype, true));
    // SAFETY (allocations): the GEMMs write every element of each.
    let (mut dz1, mut db1, mut dw2, mut db2) =
        unsafe { (dev.alloc::<T>(m * ff)?, dev.alloc::<T>(ff)?, dev.alloc::<T>(c * ff)?, dev.alloc::<T>(c)?) };
    let stream = dev.cuda_stream();
    {
        let (hs, hl) = h.storage_and_layout();
        let (ws, wl) = w2.storage_and_layout();
        let (dys, dyl) = dy.storage_and_layout();
        let (zs, zl) = z.storage_and_layout();
        let (hv, wv, dyv, zv) = (cuda_view::<T>(&hs, hl)?, cuda_view::<T>(&ws, wl)?, cuda_view::<T>(&dys, dyl)?, cuda_view::<T>(&zs, zl)?);
        let ((hp, _gh), (wp, _gw), (dyp, _gdy), (zp, _gz)) =
            (hv.device_ptr(&stream), wv.device_ptr(&stream), dyv.device_ptr(&stream), zv.device_ptr(&stream));
        let ((dw2p, _gdw2), (db2p, _gdb2)) = (dw2.device_ptr_mut(&stream), db2.device_ptr_mut(&stream));
        // SAFETY: A = h (ff·m), B = dy (c·m, read transposed), D = dW₂ (ff·c), db₂ c values, as `wgrad`.
        unsafe { matmul(&dev, &wgrad, Ptrs { a: hp, b: dyp, d: dw2p, bias: db2p, aux: 0 })? };
        let ((dz1p, _gdz1), (db1p, _gdb1)) = (dz1.device_ptr_mut(&stream), db1.device_ptr_mut(&stream));
        // SAFETY: A = W₂ (ff·c), B = dy (c·m), D = dz₁ and aux = z (ff·m, ld ff), db₁ ff values, as `dgrad`.
        unsafe { matmul(&dev, &dgrad, Ptrs { a: wp, b: dyp, d: dz1p, bias: db1p, aux: zp })? };
    }
    Ok((wrap(dz1, &dev, (bsz, t, ff)), wrap(db1, &dev, ff), wrap(dw2, &dev, (c, ff)), wrap(db2, &dev, c)))
}
