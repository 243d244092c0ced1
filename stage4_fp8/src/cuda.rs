//! The CUDA forward of the FP8 GEMM op (`gemm::Fp8Gemm`): cuBLASLt's low-level API (cudarc's safe
//! `Matmul` gives A, B, C and D one dtype; FP8 needs E4M3 inputs, a bf16 or E4M3 output and
//! scale pointers). The arguments come from `gemm::fp8_gemm_args`, a pure function tested on
//! the CPU; this file only turns them into descriptors and launches on candle's stream. The
//! descriptors, layouts and the algorithm cuBLASLt's heuristic picks depend only on the GEMM's
//! shape, options and the alignment of its operands, so they are made once per (device, shape,
//! options, alignments) and kept (`PLANS`); a call only sets the pointers of the moment.

use crate::gemm::{
    check_pointers, fp8_alignments, fp8_gemm_args, fp8_gemm_args_e4m3_out, fp8_grad_args, Fp8Epilogue, Fp8GemmArgs, Fp8Grad, Fp8GradArgs,
};
use candle_core::backend::BackendStorage;
use candle_core::cuda::cudarc::cublaslt::{result, sys, MatmulShared};
use candle_core::cuda::cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut, SyncOnDrop};
use candle_core::cuda::{CudaDevice, CudaStorage, DeviceId};
use candle_core::{DType, Storage, Tensor};
use cublaslt_model::DataType;
use stage3_fused::cuda::{device_key, lt, view};
use stage3_fused::cuda_lt::{set_alignments, Desc, MatLayout as Layout, Pref};
use stage3_fused::device_cache::{Cache, DeviceKey};
use std::ffi::c_void;
use std::rc::Rc;
use std::sync::atomic::{AtomicUsize, Ordering};

/// cuBLASLt's recommended workspace on Hopper (its FP8 kernels use it for split-K and
/// stream-K schedules); 4 MiB would do on Ada.
const WORKSPACE_BYTES: usize = 32 << 20;

thread_local! {
    /// One workspace per device (its stream) and architecture, made on first use (cudarc keeps
    /// its own private); keyed as stage 3's handles are (`stage3_fused::device_cache`).
    static WORKSPACE: Cache<DeviceKey<DeviceId>, Rc<CudaSlice<u8>>> = Cache::new();
}

/// What a plan is made for: the device, the GEMM's arguments, fast accumulation, and the
/// alignments in bytes of A, B, C and D it was asked for (an algorithm chosen for 256-byte
/// aligned operands may need all 256).
type PlanKey = (DeviceKey<DeviceId>, Fp8GemmArgs, bool, [u32; 4]);

thread_local! {
    /// Descriptors, layouts and chosen algorithm per (device, shape, options), made on first use.
    static PLANS: Cache<PlanKey, Rc<Plan>> = Cache::new();
}

/// Algorithm heuristic queries so far in this process (one per plan made): a forward that
/// meets only shapes it met before adds none.
static HEURISTIC_QUERIES: AtomicUsize = AtomicUsize::new(0);

/// How many times cuBLASLt's algorithm heuristic has been asked, in this process.
pub fn heuristic_queries() -> usize {
    HEURISTIC_QUERIES.load(Ordering::Relaxed)
}

/// Why a plan could not be made: cuBLASLt offers no algorithm for the configuration (a fact
/// about this GPU and library, which a caller may answer with another configuration), or
/// anything else (an error).
enum PlanError {
    NoAlgorithm(String),
    Cuda(candle_core::Error),
}

impl From<candle_core::Error> for PlanError {
    fn from(e: candle_core::Error) -> Self {
        PlanError::Cuda(e)
    }
}

impl PlanError {
    fn into_candle(self) -> candle_core::Error {
        match self {
            PlanError::NoAlgorithm(m) => candle_core::Error::Msg(format!("FP8 GEMM: {m}")),
            PlanError::Cuda(e) => e,
        }
    }
}

/// Whether cuBLASLt has an algorithm on `dev` for the FP8 GEMM y (tokens, n) = x (tokens, k)·Wᵀ
/// with a bias (GELU'd if `gelu`) epilogue, writing bf16 or (`e4m3_out`) E4M3 with a D scale
/// and amax_D. The heuristic reads descriptors, never memory, so the pointers it is asked with
/// are placeholders, 16 bytes aligned: the least a call accepts (`check_pointers`), so the answer
/// holds for every call (a call makes its own plan for its own alignments, or finds this one).
/// Ok(false) only when there is no algorithm.
pub fn has_algorithm(
    dev: &CudaDevice,
    tokens: usize,
    k: usize,
    n: usize,
    gelu: bool,
    e4m3_out: bool,
    fast_accum: bool,
) -> candle_core::Result<bool> {
    let args = match e4m3_out {
        false => fp8_gemm_args(tokens, k, n, gelu),
        true => fp8_gemm_args_e4m3_out(tokens, k, n, gelu),
    }
    .map_err(candle_core::Error::Msg)?;
    let handle = lt(dev)?;
    const PLACEHOLDER: u64 = 16;
    let align = fp8_alignments(&args, [PLACEHOLDER, PLACEHOLDER, c_pointer(&args, PLACEHOLDER), PLACEHOLDER]);
    let made = PLANS.with(|c| {
        c.get_or_try_insert((device_key(dev)?, args, fast_accum, align), || {
            plan(&args, fast_accum, *handle.handle(), [PLACEHOLDER; 7], e4m3_out.then_some((PLACEHOLDER, PLACEHOLDER)), align).map(Rc::new)
        })
    });
    match made {
        Ok(_) => Ok(true),
        Err(PlanError::NoAlgorithm(_)) => Ok(false),
        Err(PlanError::Cuda(e)) => Err(e),
    }
}

fn err(what: &str, e: impl std::fmt::Debug) -> candle_core::Error {
    candle_core::Error::Msg(format!("FP8 GEMM: {what}: {e:?}"))
}

fn workspace(dev: &CudaDevice) -> candle_core::Result<Rc<CudaSlice<u8>>> {
    let key = device_key(dev)?;
    // SAFETY: cuBLASLt uses the workspace as scratch; nothing reads it before writing.
    WORKSPACE.with(|c| c.get_or_try_insert(key, || Ok(Rc::new(unsafe { dev.alloc::<u8>(WORKSPACE_BYTES)? }))))
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

/// A storage as a custom op's forward receives it, with its layout (contiguous).
type Operand<'a> = (&'a CudaStorage, &'a candle_core::Layout);

/// y (M, N) = s_x·s_w·(x_q W_qᵀ) + b, GELU'd if `gelu`: bf16, or with `e4m3_out` (D scale =
/// 1/s of the next layer's input, amax_D buffer) E4M3(y / s) with amax(y) written for the next
/// layer. The CUDA forward of `gemm::Fp8Gemm`, on the storages it receives and holds: x_q (…, K)
/// E4M3 (M rows); W_q (N, K) E4M3; b (N) bf16 (the FP8 table's bias type for a bf16 or an E4M3
/// D with a bf16 C); s_x, s_w and the D scale one f32 each; amax_D one u32 (an f32's bits). All
/// contiguous, on one CUDA device. `fast_accum`: CUBLASLT_MATMUL_DESC_FAST_ACCUM (see `plan`).
#[allow(clippy::too_many_arguments)]
pub fn fp8_gemm_fwd(
    (xs, xl): Operand<'_>,
    (ws, wl): Operand<'_>,
    (bs, bl): Operand<'_>,
    (sxs, sxl): Operand<'_>,
    (sws, swl): Operand<'_>,
    gelu: bool,
    fast_accum: bool,
    e4m3_out: Option<(Operand<'_>, Operand<'_>)>,
) -> candle_core::Result<CudaStorage> {
    let k = xl.shape().dims().last().copied().unwrap_or(0);
    let tokens = xl.shape().elem_count() / k.max(1);
    let (n, _) = wl.shape().dims2()?;
    let args = match e4m3_out {
        None => fp8_gemm_args(tokens, k, n, gelu),
        Some(_) => fp8_gemm_args_e4m3_out(tokens, k, n, gelu),
    }
    .map_err(candle_core::Error::Msg)?;
    let dev = xs.device().clone();
    // Fresh, contiguous allocations are 256-byte aligned (cuBLASLt wants 16); a view with an
    // offset may not be, which `check_pointers` reports.
    let (xv, wv) = (view::<float8::F8E4M3>(xs, xl)?, view::<float8::F8E4M3>(ws, wl)?);
    let (bv, sxv, swv) = (view::<half::bf16>(bs, bl)?, view::<f32>(sxs, sxl)?, view::<f32>(sws, swl)?);
    // The output: bf16, or E4M3 for the next layer; its D scale and amax buffers.
    let out_views = match e4m3_out {
        Some(((ds, dl), (am, al))) => Some((view::<f32>(ds, dl)?, view::<u32>(am, al)?)),
        None => None,
    };
    // SAFETY: β = 0, so C is not read; the GEMM writes every element of D = out.
    let mut out_bf16: Option<CudaSlice<half::bf16>> = None;
    let mut out_e4m3: Option<CudaSlice<float8::F8E4M3>> = None;
    if out_views.is_some() {
        out_e4m3 = Some(unsafe { dev.alloc::<float8::F8E4M3>(tokens * n)? });
    } else {
        out_bf16 = Some(unsafe { dev.alloc::<half::bf16>(tokens * n)? });
    }
    let ws_buf = workspace(&dev)?;
    let handle = lt(&dev)?;
    let stream = dev.cuda_stream();
    {
        // The pointers, each with a guard that orders the access on candle's stream.
        let (a, _ga) = wv.device_ptr(&stream);
        let (b, _gb) = xv.device_ptr(&stream);
        let (d, _gd) = match (&mut out_bf16, &mut out_e4m3) {
            (Some(o), _) => o.device_ptr_mut(&stream),
            (_, Some(o)) => o.device_ptr_mut(&stream),
            _ => unreachable!("one output is allocated above"),
        };
        let (bias_ptr, _gbias) = bv.device_ptr(&stream);
        let (sa, _gsa) = swv.device_ptr(&stream);
        let (sb, _gsb) = sxv.device_ptr(&stream);
        let (w, _gw) = ws_buf.device_ptr(&stream);
        let fp8_out = out_views.as_ref().map(|(dv, av)| (dv.device_ptr(&stream), av.device_ptr(&stream)));
        let fp8_ptrs = fp8_out.as_ref().map(|((ds, _), (am, _))| (*ds, *am));
        check_pointers(&[("A (W)", a), ("B (x)", b), ("D (y)", d), ("bias", bias_ptr)]).map_err(|e| err("alignment", e))?;
        let ptrs = [a, b, d, bias_ptr, sa, sb, w];
        let align = fp8_alignments(&args, [a, b, c_pointer(&args, d), d]);
        let key = (device_key(&dev)?, args, fast_accum, align);
        let plan = PLANS
            .with(|c| c.get_or_try_insert(key, || plan(&args, fast_accum, *handle.handle(), ptrs, fp8_ptrs, align).map(Rc::new)))
            .map_err(PlanError::into_candle)?;
        launch(&args, &plan, *handle.handle(), ptrs, fp8_ptrs, stream.cu_stream() as sys::cudaStream_t)?;
    }
    Ok(match (out_bf16, out_e4m3) {
        (Some(o), _) => CudaStorage::wrap_cuda_slice(o, dev),
        (_, Some(o)) => CudaStorage::wrap_cuda_slice(o, dev),
        _ => unreachable!("one output is allocated above"),
    })
}

/// The attributes that are pointers, which change from call to call. ptrs: A, B, D, bias,
/// scale_A, scale_B, workspace; `fp8_out`: (D scale, amax_D) when `args.out_e4m3`.
fn set_pointers(desc: &Desc, args: &Fp8GemmArgs, ptrs: [u64; 7], fp8_out: Option<(u64, u64)>) -> candle_core::Result<()> {
    use sys::cublasLtMatmulDescAttributes_t as A;
    let [_, _, _, bias, scale_a, scale_b, _] = ptrs;
    // Device pointers to the per-tensor scales (A = W's, B = x's; see gemm.rs): D = s_A·s_B·A·B.
    set(desc, A::CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &scale_a)?; // const float*
    set(desc, A::CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &scale_b)?;
    set(desc, A::CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias)?; // const void*, bias_len values
    match (args.out_e4m3, fp8_out) {
        (false, None) => {}
        // D = E4M3(scale_D · result), scale_D = 1/s of the next layer's input; amax_D = max|result|
        // before scale_D (what TransformerEngine records as the next tensor's amax). const float*, void*.
        (true, Some((d_scale, amax_d))) => {
            set(desc, A::CUBLASLT_MATMUL_DESC_D_SCALE_POINTER, &d_scale)?;
            set(desc, A::CUBLASLT_MATMUL_DESC_AMAX_D_POINTER, &amax_d)?;
        }
        _ => return Err(err("FP8 output", "an E4M3 D needs its D scale and amax pointers, and only an E4M3 D takes them")),
    }
    Ok(())
}

/// One GEMM configuration, ready to launch: its layouts, its descriptor (with every attribute
/// but the pointers set) and the algorithm cuBLASLt's heuristic chose for them.
struct Plan {
    a_layout: Layout,
    b_layout: Layout,
    c_layout: Layout,
    d_layout: Layout,
    desc: Desc,
    algo: sys::cublasLtMatmulAlgo_t,
}

/// Descriptors and layouts from `args`, and the algorithm cuBLASLt's heuristic picks for them
/// (asked with the first call's pointers set, as which ones are set — amax_D, the D scale — is
/// part of the configuration), among those that work at `align` (A, B, C, D in bytes).
fn plan(
    args: &Fp8GemmArgs,
    fast_accum: bool,
    handle: sys::cublasLtHandle_t,
    ptrs: [u64; 7],
    fp8_out: Option<(u64, u64)>,
    align: [u32; 4],
) -> Result<Plan, PlanError> {
    use sys::cublasLtMatmulDescAttributes_t as A;
    use sys::cudaDataType_t as T;
    let a_layout = layout(T::CUDA_R_8F_E4M3, args.a_rows, args.a_cols, args.lda)?;
    let b_layout = layout(T::CUDA_R_8F_E4M3, args.b_rows, args.b_cols, args.ldb)?;
    // C is bf16 (not read, β = 0); D is bf16, or E4M3 for the next layer — the FP8 table's
    // combinations for E4M3 A and B: with an E4M3 D, C's type must be the bias type (bf16), as
    // TransformerEngine's cuBLASLt call also sets it.
    let c_layout = layout(T::CUDA_R_16BF, args.d_rows, args.d_cols, args.ldd)?;
    let d_type = if args.out_e4m3 { T::CUDA_R_8F_E4M3 } else { T::CUDA_R_16BF };
    let d_layout = layout(d_type, args.d_rows, args.d_cols, args.ldd)?;

    // f32 accumulation and f32 alpha/beta/scales.
    let desc = result::create_matmul_desc(sys::cublasComputeType_t::CUBLAS_COMPUTE_32F, T::CUDA_R_32F)
        .map(Desc)
        .map_err(|e| err("matmul desc", e))?;
    // cublasOperation_t (a C enum, int32): CUBLAS_OP_N = 0, CUBLAS_OP_T = 1; cudarc's cuBLASLt
    // bindings do not export the type.
    let op = |t: bool| -> i32 { t as i32 };
    set(&desc, A::CUBLASLT_MATMUL_DESC_TRANSA, &op(args.transa))?;
    set(&desc, A::CUBLASLT_MATMUL_DESC_TRANSB, &op(args.transb))?;
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
    set(&desc, A::CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &T::CUDA_R_16BF)?; // cudaDataType: bf16, as C
    set_pointers(&desc, args, ptrs, fp8_out)?;
    let heuristic = match heuristic(handle, &desc, [&a_layout, &b_layout, &c_layout, &d_layout], align)? {
        Ok(h) => h,
        // No algorithm: cudarc reports an empty answer as NOT_SUPPORTED, as cuBLASLt does.
        Err(e) if e.0 == sys::cublasStatus_t::CUBLAS_STATUS_NOT_SUPPORTED => {
            return Err(PlanError::NoAlgorithm(format!(
                "cuBLASLt has no FP8 algorithm for m={} n={} k={} with the {:?} epilogue{} on this GPU (it needs SM 8.9+ and CUDA 12+)",
                args.m,
                args.n,
                args.k,
                args.epilogue,
                if args.out_e4m3 { " and an E4M3 output (D scale, amax_D)" } else { "" },
            )))
        }
        Err(e) => return Err(err("cublasLtMatmulAlgoGetHeuristic", e).into()),
    };
    Ok(Plan { a_layout, b_layout, c_layout, d_layout, desc, algo: heuristic.algo })
}

/// C is never read (β = 0): D's own buffer for a bf16 D, as cuBLASLt allows in place; no
/// pointer at all for an E4M3 D, as TransformerEngine passes it (its C layout is bf16, D's is not).
fn c_pointer(args: &Fp8GemmArgs, d: u64) -> u64 {
    if args.out_e4m3 {
        0
    } else {
        d
    }
}

/// Sets this call's pointers on `plan`'s descriptor, then cublasLtMatmul. ptrs: A, B, D, bias,
/// scale_A, scale_B, workspace; `fp8_out`: (D scale, amax_D) when `args.out_e4m3`.
fn launch(
    args: &Fp8GemmArgs,
    plan: &Plan,
    handle: sys::cublasLtHandle_t,
    ptrs: [u64; 7],
    fp8_out: Option<(u64, u64)>,
    stream: sys::cudaStream_t,
) -> candle_core::Result<()> {
    let [a, b, d, _, _, _, workspace] = ptrs;
    let desc = &plan.desc;
    set_pointers(desc, args, ptrs, fp8_out)?;
    let c = c_pointer(args, d);
    let contract = args.contract(); // α = 1, β = 0: what the CPU model executes in the tests
    let (alpha, beta) = (contract.alpha, contract.beta);
    // SAFETY: A, B are k·m and k·n E4M3 values, D m·n bf16 or E4M3 (C: D's buffer or null, never
    // read at β = 0), bias m bf16, the scales one f32 each (amax_D one f32 written), the
    // workspace WORKSPACE_BYTES — as the layouts say; all on `stream`'s device.
    unsafe {
        result::matmul(
            handle,
            desc.0,
            &alpha as *const f32 as *const c_void,
            &beta as *const f32 as *const c_void,
            a as *const c_void,
            plan.a_layout.0,
            b as *const c_void,
            plan.b_layout.0,
            c as *const c_void,
            plan.c_layout.0,
            d as *mut c_void,
            plan.d_layout.0,
            &plan.algo,
            workspace as *mut c_void,
            WORKSPACE_BYTES,
            stream,
        )
    }
    .map_err(|e| err("cublasLtMatmul", e))
}

// ---------------------------------------------------------------------------------------------
// Training: the HYBRID backward's GEMMs (E4M3 × E5M2)
// ---------------------------------------------------------------------------------------------

/// What a backward GEMM's plan is made for: the device, its arguments and the alignments in
/// bytes of A, B, C and D.
type GradPlanKey = (DeviceKey<DeviceId>, Fp8GradArgs, [u32; 4]);

thread_local! {
    /// The backward GEMMs' plans, made on first use as the forward's are (`PLANS`).
    static GRAD_PLANS: Cache<GradPlanKey, Rc<Plan>> = Cache::new();
}

/// Whether cuBLASLt has an algorithm on `dev` for the HYBRID backward GEMM `grad` of a layer
/// with `k` in and `n` out features over `tokens` rows (E4M3 × E5M2, TN, bf16 dX or f32 dW),
/// asked with 16-byte placeholders as `has_algorithm` is. Ok(false) only when there is none.
pub fn has_grad_algorithm(dev: &CudaDevice, grad: Fp8Grad, tokens: usize, k: usize, n: usize) -> candle_core::Result<bool> {
    let args = fp8_grad_args(grad, tokens, k, n).map_err(candle_core::Error::Msg)?;
    let handle = lt(dev)?;
    const PLACEHOLDER: u64 = 16;
    let align = args.alignments([PLACEHOLDER; 3]);
    let made = GRAD_PLANS.with(|c| {
        c.get_or_try_insert((device_key(dev)?, args, align), || grad_plan(&args, *handle.handle(), [PLACEHOLDER; 6], align).map(Rc::new))
    });
    match made {
        Ok(_) => Ok(true),
        Err(PlanError::NoAlgorithm(_)) => Ok(false),
        Err(PlanError::Cuda(e)) => Err(e),
    }
}

/// cuBLASLt's type for a layout of the backward GEMMs.
fn grad_type(t: DataType) -> sys::cudaDataType {
    use sys::cudaDataType_t as T;
    match t {
        DataType::E4m3 => T::CUDA_R_8F_E4M3,
        DataType::E5m2 => T::CUDA_R_8F_E5M2,
        DataType::Bf16 => T::CUDA_R_16BF,
        DataType::F16 => T::CUDA_R_16F,
        DataType::F32 => T::CUDA_R_32F,
    }
}

/// A contiguous tensor's device pointer (at its offset) with the guard that orders the access on
/// `stream`, checked to be of `dtype` (E5M2 codes travel in u8 tensors).
fn tensor_ptr<'a>(
    cs: &'a CudaStorage,
    l: &candle_core::Layout,
    dtype: DataType,
    stream: &'a CudaStream,
    what: &str,
) -> candle_core::Result<(u64, SyncOnDrop<'a>)> {
    let (start, _) = l.contiguous_offsets().ok_or_else(|| err(what, "expected a contiguous tensor"))?;
    let ((p, g), size) = match (dtype, cs.dtype()) {
        (DataType::E4m3, DType::F8E4M3) => (cs.as_cuda_slice::<float8::F8E4M3>()?.device_ptr(stream), 1),
        (DataType::E5m2, DType::U8) => (cs.as_cuda_slice::<u8>()?.device_ptr(stream), 1),
        (DataType::F32, DType::F32) => (cs.as_cuda_slice::<f32>()?.device_ptr(stream), 4),
        (want, got) => return Err(err(what, format!("{got:?} tensor where the GEMM's layout says {want:?}"))),
    };
    Ok((p + (start * size) as u64, g))
}

/// The CUDA forward of `gemm::fp8_grad_gemm`: one HYBRID backward GEMM, D = s_A·s_B·op(A)·B
/// (`gemm::fp8_grad_layout`), on candle's stream.
pub fn fp8_grad_gemm(args: &Fp8GradArgs, a: &Tensor, b: &Tensor, scale_a: &Tensor, scale_b: &Tensor) -> candle_core::Result<Tensor> {
    let contract = args.contract();
    // A stored a_rows × a_cols column-major = (a_cols, a_rows) row-major; likewise B.
    for (t, rows, cols, what) in [(a, args.a_rows, args.a_cols, "A"), (b, args.b_rows, args.b_cols, "B")] {
        if t.dims() != [cols as usize, rows as usize] {
            return Err(err(what, format!("{:?} where the layout reads ({cols}, {rows})", t.dims())));
        }
    }
    let (a, b, sa, sb) =
        (a.contiguous()?, b.contiguous()?, scale_a.to_dtype(DType::F32)?.contiguous()?, scale_b.to_dtype(DType::F32)?.contiguous()?);
    let dev = a.device().as_cuda_device()?.clone();
    let ((a_s, a_l), (b_s, b_l)) = (a.storage_and_layout(), b.storage_and_layout());
    let ((sa_s, sa_l), (sb_s, sb_l)) = (sa.storage_and_layout(), sb.storage_and_layout());
    let (Storage::Cuda(a_s), Storage::Cuda(b_s), Storage::Cuda(sa_s), Storage::Cuda(sb_s)) = (&*a_s, &*b_s, &*sa_s, &*sb_s) else {
        return Err(err("operands", "A, B and both scales must be on the GPU"));
    };
    let len = (args.d_rows * args.d_cols) as usize;
    // SAFETY: β = 0, so C (D's buffer) is not read; the GEMM writes every element of D.
    let mut out_bf16: Option<CudaSlice<half::bf16>> = None;
    let mut out_f32: Option<CudaSlice<f32>> = None;
    match args.d {
        DataType::Bf16 => out_bf16 = Some(unsafe { dev.alloc::<half::bf16>(len)? }),
        DataType::F32 => out_f32 = Some(unsafe { dev.alloc::<f32>(len)? }),
        t => return Err(err("D", format!("{t:?}: the backward GEMMs write bf16 dX or f32 dW"))),
    }
    let ws_buf = workspace(&dev)?;
    let handle = lt(&dev)?;
    let stream = dev.cuda_stream();
    {
        let (pa, _ga) = tensor_ptr(a_s, a_l, contract.a.dtype, &stream, "A")?;
        let (pb, _gb) = tensor_ptr(b_s, b_l, contract.b.dtype, &stream, "B")?;
        let (psa, _gsa) = tensor_ptr(sa_s, sa_l, DataType::F32, &stream, "scale_A")?;
        let (psb, _gsb) = tensor_ptr(sb_s, sb_l, DataType::F32, &stream, "scale_B")?;
        let (pd, _gd) = match (&mut out_bf16, &mut out_f32) {
            (Some(o), _) => o.device_ptr_mut(&stream),
            (_, Some(o)) => o.device_ptr_mut(&stream),
            _ => unreachable!("one output is allocated above"),
        };
        let (w, _gw) = ws_buf.device_ptr(&stream);
        check_pointers(&[("A", pa), ("B", pb), ("D", pd)]).map_err(|e| err("alignment", e))?;
        let ptrs = [pa, pb, pd, psa, psb, w];
        let align = args.alignments([pa, pb, pd]);
        let plan = GRAD_PLANS
            .with(|c| {
                c.get_or_try_insert((device_key(&dev)?, *args, align), || grad_plan(args, *handle.handle(), ptrs, align).map(Rc::new))
            })
            .map_err(PlanError::into_candle)?;
        set_grad_pointers(&plan.desc, ptrs)?;
        let (alpha, beta) = (contract.alpha, contract.beta);
        // SAFETY: A and B hold k·m and k·n FP8 codes, D m·n values of D's type (also C, never read
        // at β = 0), the scales one f32 each, the workspace WORKSPACE_BYTES — as the layouts say,
        // all on `stream`'s device, each guarded for the call.
        unsafe {
            result::matmul(
                *handle.handle(),
                plan.desc.0,
                &alpha as *const f32 as *const c_void,
                &beta as *const f32 as *const c_void,
                pa as *const c_void,
                plan.a_layout.0,
                pb as *const c_void,
                plan.b_layout.0,
                pd as *const c_void,
                plan.c_layout.0,
                pd as *mut c_void,
                plan.d_layout.0,
                &plan.algo,
                w as *mut c_void,
                WORKSPACE_BYTES,
                stream.cu_stream() as sys::cudaStream_t,
            )
        }
        .map_err(|e| err("cublasLtMatmul (backward)", e))?;
    }
    let shape = (args.d_cols as usize, args.d_rows as usize); // D column-major = (d_cols, d_rows) row-major
    Ok(match (out_bf16, out_f32) {
        (Some(o), _) => stage3_fused::cuda::wrap(o, &dev, shape),
        (_, Some(o)) => stage3_fused::cuda::wrap(o, &dev, shape),
        _ => unreachable!("one output is allocated above"),
    })
}

/// The backward GEMM's pointer attributes: scale_A and scale_B (ptrs: A, B, D, scale_A,
/// scale_B, workspace). No bias, no D scale, no amax_D: D is bf16 or f32, not FP8.
fn set_grad_pointers(desc: &Desc, ptrs: [u64; 6]) -> candle_core::Result<()> {
    use sys::cublasLtMatmulDescAttributes_t as A;
    let [_, _, _, scale_a, scale_b, _] = ptrs;
    set(desc, A::CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &scale_a)?; // const float*
    set(desc, A::CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &scale_b)
}

/// cuBLASLt's heuristic answer for `desc` over the A, B, C, D layouts, with the preferences
/// every plan sets (the workspace, `align`'s alignments); one counted query. An empty answer
/// comes back as cuBLASLt's NOT_SUPPORTED, for the caller to name.
fn heuristic(
    handle: sys::cublasLtHandle_t,
    desc: &Desc,
    [a, b, c, d]: [&Layout; 4],
    align: [u32; 4],
) -> candle_core::Result<Result<sys::cublasLtMatmulHeuristicResult_t, result::CublasError>> {
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
    set_alignments(&pref, align)?;
    HEURISTIC_QUERIES.fetch_add(1, Ordering::Relaxed);
    // SAFETY: every descriptor and layout is alive.
    Ok(unsafe { result::get_matmul_algo_heuristic(handle, desc.0, a.0, b.0, c.0, d.0, pref.0) })
}

/// Descriptors and layouts of a backward GEMM from `args`/// Descriptors and layouts of a backward GEMM from `args`, and the algorithm cuBLASLt's heuristic
/// picks at `align`: TN, E4M3 A × E5M2 B, f32 accumulation, no epilogue.
fn grad_plan(args: &Fp8GradArgs, handle: sys::cublasLtHandle_t, ptrs: [u64; 6], align: [u32; 4]) -> Result<Plan, PlanError> {
    use sys::cublasLtMatmulDescAttributes_t as A;
    let c = args.contract();
    let l = |m: &cublaslt_model::MatrixLayout| layout(grad_type(m.dtype), m.rows, m.cols, m.ld);
    let (a_layout, b_layout, c_layout, d_layout) = (l(&c.a)?, l(&c.b)?, l(&c.c)?, l(&c.d)?);
    let desc = result::create_matmul_desc(sys::cublasComputeType_t::CUBLAS_COMPUTE_32F, sys::cudaDataType_t::CUDA_R_32F)
        .map(Desc)
        .map_err(|e| err("matmul desc", e))?;
    set(&desc, A::CUBLASLT_MATMUL_DESC_TRANSA, &(c.transa as i32))?; // cublasOperation_t: N = 0, T = 1
    set(&desc, A::CUBLASLT_MATMUL_DESC_TRANSB, &(c.transb as i32))?;
    // Partial sums promoted to f32 (fast accumulation off), as TransformerEngine runs its
    // backward GEMMs: a gradient's sum over B·T tokens is the long reduction of the step.
    set(&desc, A::CUBLASLT_MATMUL_DESC_FAST_ACCUM, &0i8)?; // int8_t
    set(&desc, A::CUBLASLT_MATMUL_DESC_EPILOGUE, &sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_DEFAULT)?;
    set_grad_pointers(&desc, ptrs)?;
    let heuristic = match heuristic(handle, &desc, [&a_layout, &b_layout, &c_layout, &d_layout], align)? {
        Ok(h) => h,
        Err(e) if e.0 == sys::cublasStatus_t::CUBLAS_STATUS_NOT_SUPPORTED => {
            return Err(PlanError::NoAlgorithm(format!(
                "cuBLASLt has no E4M3 × E5M2 algorithm for the {:?}-gradient GEMM m={} n={} k={} ({:?} D) on this GPU (it needs SM 8.9+ and CUDA 12+)",
                args.grad, args.m, args.n, args.k, args.d
            )))
        }
        Err(e) => return Err(err("cublasLtMatmulAlgoGetHeuristic", e).into()),
    };
    Ok(Plan { a_layout, b_layout, c_layout, d_layout, desc, algo: heuristic.algo })
}
