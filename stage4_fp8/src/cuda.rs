//! The FP8 GEMM through cuBLASLt's low-level API (cudarc's safe `Matmul` gives A, B, C and D one
//! dtype; FP8 needs E4M3 inputs, a bf16 output and two scale pointers). The arguments come from
//! `gemm::fp8_gemm_args`, a pure function tested on the CPU; this file only turns them into
//! descriptors and launches on candle's stream.

use crate::gemm::{check_pointers, fp8_gemm_args, Fp8Epilogue, Fp8GemmArgs};
use candle_core::cuda::cudarc::cublaslt::{result, sys, MatmulShared};
use candle_core::cuda::cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut};
use candle_core::cuda::{CudaDevice, DeviceId};
use candle_core::Tensor;
use stage3_fused::cuda::{cuda_view, device_key, lt, wrap};
use stage3_fused::device_cache::{Cache, DeviceKey};
use std::ffi::c_void;
use std::rc::Rc;

/// cuBLASLt's recommended workspace on Hopper (its FP8 kernels use it for split-K and
/// stream-K schedules); 4 MiB would do on Ada.
const WORKSPACE_BYTES: usize = 32 << 20;

thread_local! {
    /// One workspace per device (its stream) and architecture, made on first use (cudarc keeps
    /// its own private); keyed as stage 3's handles are (`stage3_fused::device_cache`).
    static WORKSPACE: Cache<DeviceKey<DeviceId>, Rc<CudaSlice<u8>>> = Cache::new();
}

fn err(what: &str, e: impl std::fmt::Debug) -> candle_core::Error {
    candle_core::Error::Msg(format!("FP8 GEMM: {what}: {e:?}"))
}

fn workspace(dev: &CudaDevice) -> candle_core::Result<Rc<CudaSlice<u8>>> {
    let key = device_key(dev)?;
    // SAFETY: cuBLASLt uses the workspace as scratch; nothing reads it before writing.
    WORKSPACE.with(|c| c.get_or_try_insert(key, || Ok(Rc::new(unsafe { dev.alloc::<u8>(WORKSPACE_BYTES)? }))))
}

/// cuBLASLt descriptors, destroyed when dropped.
struct Layout(sys::cublasLtMatrixLayout_t);
struct Desc(sys::cublasLtMatmulDesc_t);
struct Pref(sys::cublasLtMatmulPreference_t);

impl Drop for Layout {
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

fn layout(dtype: sys::cudaDataType, rows: u64, cols: u64, ld: i64) -> candle_core::Result<Layout> {
    result::create_matrix_layout(dtype, rows, cols, ld).map(Layout).map_err(|e| err("matrix layout", e))
}

fn set<T>(desc: &Desc, attr: sys::cublasLtMatmulDescAttributes_t, value: &T) -> candle_core::Result<()> {
    // SAFETY: `value` is the type cuBLASLt documents for `attr` (each call site says which), and
    // cuBLASLt copies it before returning.
    unsafe { result::set_matmul_desc_attribute(desc.0, attr, value as *const T as *const c_void, std::mem::size_of::<T>()) }
        .map_err(|e| err(&format!("{attr:?}"), e))
}

/// y (M, N) bf16 = s_x·s_w·(x_q W_qᵀ) + b, GELU'd if `gelu`. x_q: (M, K) E4M3; W_q: (N, K) E4M3;
/// s_x, s_w: one f32 each (rank 0 or (1)); b: (N) bf16. All on one CUDA device. `fast_accum`:
/// CUBLASLT_MATMUL_DESC_FAST_ACCUM (see `launch`).
pub fn fp8_linear(
    xq: &Tensor,
    x_scale: &Tensor,
    wq: &Tensor,
    w_scale: &Tensor,
    bias: &Tensor,
    gelu: bool,
    fast_accum: bool,
) -> candle_core::Result<Tensor> {
    let (tokens, k) = xq.dims2()?;
    let n = wq.dim(0)?;
    let args = fp8_gemm_args(tokens, k, n, gelu).map_err(candle_core::Error::wrap)?;
    let dev = xq.device().as_cuda_device()?.clone();
    // Fresh, contiguous allocations are 256-byte aligned (cuBLASLt wants 16).
    let (xq, wq, bias, x_scale, w_scale) =
        (xq.contiguous()?, wq.contiguous()?, bias.contiguous()?, x_scale.contiguous()?, w_scale.contiguous()?);
    let ((xs, xl), (ws, wl), (bs, bl)) = (xq.storage_and_layout(), wq.storage_and_layout(), bias.storage_and_layout());
    let ((sxs, sxl), (sws, swl)) = (x_scale.storage_and_layout(), w_scale.storage_and_layout());
    let (xv, wv) = (cuda_view::<float8::F8E4M3>(&xs, xl)?, cuda_view::<float8::F8E4M3>(&ws, wl)?);
    let (bv, sxv, swv) = (cuda_view::<half::bf16>(&bs, bl)?, cuda_view::<f32>(&sxs, sxl)?, cuda_view::<f32>(&sws, swl)?);
    // SAFETY: β = 0, so C is not read; the GEMM writes every element of D = out.
    let mut out: CudaSlice<half::bf16> = unsafe { dev.alloc::<half::bf16>(tokens * n)? };
    let ws_buf = workspace(&dev)?;
    let handle = lt(&dev)?;
    let stream = dev.cuda_stream();
    {
        // The pointers, each with a guard that orders the access on candle's stream.
        let (a, _ga) = wv.device_ptr(&stream);
        let (b, _gb) = xv.device_ptr(&stream);
        let (d, _gd) = out.device_ptr_mut(&stream);
        let (bias_ptr, _gbias) = bv.device_ptr(&stream);
        let (sa, _gsa) = swv.device_ptr(&stream);
        let (sb, _gsb) = sxv.device_ptr(&stream);
        let (w, _gw) = ws_buf.device_ptr(&stream);
        check_pointers(&[("A (W)", a), ("B (x)", b), ("D (y)", d), ("bias", bias_ptr)]).map_err(|e| err("alignment", e))?;
        launch(&args, fast_accum, *handle.handle(), [a, b, d, bias_ptr, sa, sb, w], stream.cu_stream() as sys::cudaStream_t)?;
    }
    drop((xs, ws, bs, sxs, sws));
    Ok(wrap(out, &dev, (tokens, n)))
}

/// Descriptors from `args`, then cublasLtMatmul. ptrs: A, B, D, bias, scale_A, scale_B, workspace.
fn launch(
    args: &Fp8GemmArgs,
    fast_accum: bool,
    handle: sys::cublasLtHandle_t,
    ptrs: [u64; 7],
    stream: sys::cudaStream_t,
) -> candle_core::Result<()> {
    use sys::cublasLtMatmulDescAttributes_t as A;
    use sys::cudaDataType_t as T;
    let [a, b, d, bias, scale_a, scale_b, workspace] = ptrs;
    let a_layout = layout(T::CUDA_R_8F_E4M3, args.a_rows, args.a_cols, args.lda)?;
    let b_layout = layout(T::CUDA_R_8F_E4M3, args.b_rows, args.b_cols, args.ldb)?;
    let d_layout = layout(T::CUDA_R_16BF, args.d_rows, args.d_cols, args.ldd)?; // C shares it (β = 0)

    // f32 accumulation and f32 alpha/beta/scales.
    let desc = result::create_matmul_desc(sys::cublasComputeType_t::CUBLAS_COMPUTE_32F, T::CUDA_R_32F)
        .map(Desc)
        .map_err(|e| err("matmul desc", e))?;
    // cublasOperation_t (a C enum, int32): CUBLAS_OP_N = 0, CUBLAS_OP_T = 1; cudarc's cuBLASLt
    // bindings do not export the type.
    let op = |t: bool| -> i32 { t as i32 };
    set(&desc, A::CUBLASLT_MATMUL_DESC_TRANSA, &op(args.transa))?;
    set(&desc, A::CUBLASLT_MATMUL_DESC_TRANSB, &op(args.transb))?;
    // Device pointers to the per-tensor scales (A = W's, B = x's; see gemm.rs): D = s_A·s_B·A·B.
    set(&desc, A::CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &scale_a)?; // const float*
    set(&desc, A::CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &scale_b)?;
    // Hopper's FP8 tensor cores accumulate in reduced precision (a ~14-bit truncating
    // accumulator: twin.rs) unless the kernel promotes partial sums to f32 every few k-steps;
    // fast accumulation skips that promotion. TransformerEngine runs the forward pass this way
    // (and the backward without it); `--fp8-fast-accum off` measures what it costs.
    set(&desc, A::CUBLASLT_MATMUL_DESC_FAST_ACCUM, &(fast_accum as i8))?; // int8_t
    let epilogue = match args.epilogue {
        Fp8Epilogue::Bias => sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_BIAS,
        Fp8Epilogue::GeluBias => sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_GELU_BIAS,
    };
    set(&desc, A::CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue)?; // cublasLtEpilogue_t
    set(&desc, A::CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias)?; // const void*, bias_len values
    set(&desc, A::CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &T::CUDA_R_16BF)?; // cudaDataType: bf16, as D
    let pref = result::create_matmul_pref().map(Pref).map_err(|e| err("preference", e))?;
    // SAFETY: size_t attribute, copied by cuBLASLt.
    unsafe {
        result::set_matmul_pref_attribute(
            pref.0,
            sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
            &WORKSPACE_BYTES as *const usize as *const c_void,
            std::mem::size_of::<usize>(),
        )
    }
    .map_err(|e| err("workspace preference", e))?;
    // SAFETY: every descriptor is alive and describes the allocations behind the pointers.
    let heuristic = unsafe { result::get_matmul_algo_heuristic(handle, desc.0, a_layout.0, b_layout.0, d_layout.0, d_layout.0, pref.0) }
        .map_err(|e| {
            err(
                &format!(
                    "cuBLASLt has no FP8 algorithm for m={} n={} k={} with the {:?} epilogue on this GPU (it needs SM 8.9+ and CUDA 12+)",
                    args.m, args.n, args.k, args.epilogue
                ),
                e,
            )
        })?;
    let contract = args.contract(); // α = 1, β = 0: what the CPU model executes in the tests
    let (alpha, beta) = (contract.alpha, contract.beta);
    // SAFETY: A, B are k·m and k·n E4M3 values, D m·n bf16, bias m bf16, the scales one f32
    // each, the workspace WORKSPACE_BYTES — as the layouts say; all on `stream`'s device.
    unsafe {
        result::matmul(
            handle,
            desc.0,
            &alpha as *const f32 as *const c_void,
            &beta as *const f32 as *const c_void,
            a as *const c_void,
            a_layout.0,
            b as *const c_void,
            b_layout.0,
            d as *const c_void,
            d_layout.0,
            d as *mut c_void,
            d_layout.0,
            &heuristic.algo,
            workspace as *mut c_void,
            WORKSPACE_BYTES,
            stream,
        )
    }
    .map_err(|e| err("cublasLtMatmul", e))
}
