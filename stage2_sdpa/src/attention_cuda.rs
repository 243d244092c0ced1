//! Stage 2's attention on CUDA without candle-flash-attn: our FlashAttention-2 kernels, v1
//! `kernels/flash_attn.cu` (WMMA; read it beside the CPU kernel in `attention.rs`: same
//! algorithm, same m, l, O notation) and v2 `kernels/flash_attn_v2.cu` (mma.sync, S, P and O in
//! registers, cp.async double buffering, swizzled shared memory; the default). Both take the
//! same arguments and layouts and run 4 warps a block; v1's tiles are B_r = B_c = 64, v2's
//! B_r = 128 (32 query rows a warp) and B_c = 32, and v2's grid puts the heads fastest.
//!
//! This file holds the host side: the launch arithmetic — grid, threads, shared memory, tiles
//! skipped, occupancy — as pure functions tested on any machine, and, with the `cuda` feature,
//! the launch itself: the cubin that `build.rs` compiled with nvcc for the device's
//! architecture, loaded once per device (`kernel_cache`) and launched on candle's stream as the
//! `cuda_fwd` of the same candle op (`attention::FlashAttn`) whose `cpu_fwd` is the CPU kernel.
//!
//! Layout: (B, T, n_head, d_head), read through strides, so a view costs nothing: stage 2's
//! q, k, v (free reshapes of (B, T, C)) and stage 3's (strided slices of one (B, T, 3, n_head,
//! d_head) QKV output) go to the kernel as they are. Each row's d_head values must be
//! contiguous and 16-byte aligned (the kernel loads 8 values per instruction); `attention()`
//! copies anything else first (`kernel_strides`).

use crate::attention::AttentionKernel;

/// Query rows per thread block (B_r); `BR` in the kernel.
pub const BR: usize = 64;
/// Key/value rows per tile (B_c); `BC` in the kernel.
pub const BC: usize = 64;
/// v2's query rows per block (`BR` in flash_attn_v2.cu): 32 per warp, so each K_j and V_j
/// fragment a warp loads from shared memory feeds two mma (FlashAttention-2's 128 × 4 warps).
pub const BR_V2: usize = 128;
/// v2's key/value rows per tile (`BC` there): 32, so that S (32 × 32 a warp) and O (32 × d)
/// fit the 255 registers a thread has at d_head 128 without spilling.
pub const BC_V2: usize = 32;
/// Warps per block. v1: each owns BR / WARPS = 16 query rows, one WMMA tile tall.
pub const WARPS: usize = 4;
/// Threads per block.
pub const THREADS: usize = WARPS * 32;
/// d_head values the kernel is instantiated for (one entry point per dtype and size).
pub const HEAD_SIZES: [usize; 3] = [32, 64, 128];
/// Dynamic shared memory a block may use without opting in (cuFuncSetAttribute).
pub const DEFAULT_SHARED_BYTES: usize = 48 * 1024;
/// Longest sequence: T and every query position of the last, padded tile are `int`s in the
/// kernel (2³¹ is a multiple of B_r, so T ≤ i32::MAX keeps them all in range), and the grid's
/// x dimension (⌈T / B_r⌉ ≤ 2²⁵) stays far below its 2³¹ − 1 limit.
pub const MAX_T: usize = i32::MAX as usize;
/// Limit of the grid's y and z dimensions, which carry n_head and B.
pub const MAX_GRID_YZ: usize = 65_535;
/// Registers per thread for v2: `nvcc -cubin -arch=sm_90 -Xptxas -v` (CUDA 13.0) reports 241 at
/// d_head 128, 167 at 64 and 123 at 32, no spills (`__launch_bounds__(128, 2)`); sm_80: 244,
/// 163, 119. The largest, 244 × 128 threads = 31 K a block, fits two blocks in 64 K registers.
pub const REGISTERS_PER_THREAD_V2: usize = 244;
/// Registers per thread the occupancy arithmetic assumes for v1 at `d_head`: the most of its
/// entry points there. `nvcc -cubin -arch=sm_90 -Xptxas -v` (CUDA 13.0) reports, f16 / bf16, 96 / 96
/// at d_head 32, 104 / 96 at 64 and 128 / 168 at 128 (the bf16 one, with the log-sum-exp
/// epilogue, is the largest), no spills; sm_80: 96 / 96, 96 / 128, 128 / 168, and its f16 d_head 64
/// spills 20 bytes. At d_head 128, 168 × THREADS = 21 K registers a block lets three blocks share
/// one SM's 64 K, and shared memory allows two; at 64, 128 × THREADS = 16 K lets four; so on an
/// H100 shared memory, not registers, limits blocks per SM at d_head 64 and 128 (`blocks_per_sm`).
pub fn registers_per_thread(d_head: usize) -> usize {
    if d_head > 64 {
        168
    } else {
        128
    }
}

/// Dynamic shared memory a block needs for 16-bit inputs, in bytes: K_j and V_j (B_c × d,
/// 16-bit; Q_i passes through K_j's buffer first), S_ij (B_r × B_c, f32), P̃_ij (B_r × B_c,
/// 16-bit) and O_i (B_r × d, f32). 40 KiB at d_head 32, 56 KiB at 64, 88 KiB at 128 — under
/// the 99 KiB a block may opt into on every SM 8.x/9.x part (sm_86/89 have the least).
pub fn shared_mem_bytes(d_head: usize) -> usize {
    2 * BC * d_head * 2 + BR * BC * 4 + BR * BC * 2 + BR * d_head * 4
}

/// v2's dynamic shared memory per block: Q_i (B_r × d), K_j and V_j (B_c × d, two stages each
/// for the cp.async double buffering), all 16-bit — nothing else, as S, P and O live in
/// registers. 16 KiB at d_head 32, 32 KiB at 64, 64 KiB at 128.
pub fn shared_mem_bytes_v2(d_head: usize) -> usize {
    (BR_V2 + 2 * 2 * BC_V2) * d_head * 2
}

/// Shared memory per block of `kernel` at `d_head`.
pub fn shared_mem_bytes_of(kernel: AttentionKernel, d_head: usize) -> usize {
    match kernel {
        AttentionKernel::V1 => shared_mem_bytes(d_head),
        AttentionKernel::V2 => shared_mem_bytes_v2(d_head),
    }
}

/// The backward's query rows per tile (`BR_BWD` in flash_attn_bwd.cu): 32 a warp for S, P, dP and
/// dS, 16 a warp for dQ.
pub const BR_BWD: usize = 64;
/// The backward's key rows per block (`BC_BWD` there): 32 for each pair of warps, whose dK_j and
/// dV_j (32 × d_head / 2 f32 each, a warp) stay in registers for the whole walk over the query tiles.
pub const BC_BWD: usize = 64;
/// Registers per thread of the backward at d_head 128: `nvcc -cubin -arch=sm_90 -Xptxas -v`
/// (CUDA 13.0) reports 255 (bf16 and f16; 248 and 215 at d_head 64, 168 and 155 at 32), no spills
/// (`__launch_bounds__(128, 2)`), so two blocks share an SM's 64 K registers. sm_80: 255, 213,
/// 149, no spills.
pub const REGISTERS_PER_THREAD_BWD: usize = 255;

/// The backward's dynamic shared memory per block (`bwd_smem_bytes` in flash_attn_bwd.cu): K_j and
/// V_j (16-bit), two cp.async stages of Q_i and dO_i (16-bit) and of one L and D per query row
/// (f32), and P_ijᵀ and scale · dS_ijᵀ (16-bit, the operands of dV, dK and dQ). 41, 65 and 113 KiB
/// at d_head 32, 64 and 128: SM 8.0 and 9.0 (163 and 227 KiB per block) take all three, sm_86/89
/// (99 KiB) up to 64.
pub fn bwd_shared_mem_bytes(d_head: usize) -> usize {
    2 * BC_BWD * d_head * 2 + 2 * 2 * BR_BWD * d_head * 2 + 2 * BC_BWD * BR_BWD * 2 + 2 * 2 * BR_BWD * 4
}

/// The kernels have one compiled instance per head size in `HEAD_SIZES`.
pub fn check_head_size(d_head: usize) -> Result<(), String> {
    if HEAD_SIZES.contains(&d_head) {
        return Ok(());
    }
    Err(format!(
        "stage 2's CUDA attention kernel is built for d_head = C / n_head of 32, 64 or 128, and this shape has \
         d_head = {d_head}. Fix: pick --heads so that C / n_head is 64 or 128, build with --features flash-attn \
         (candle-flash-attn: any multiple of 8 up to 512), or run with --device cpu."
    ))
}

/// How one call is launched, and what it computes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LaunchPlan {
    /// One block per (Q_i, head, batch). v1: (⌈T / B_r⌉ query tiles, n_head, B). v2: (n_head, B,
    /// ⌈T / B_r⌉), handed out x fastest, so every head's heaviest causal tile starts first.
    pub grid: (u32, u32, u32),
    pub threads: u32,
    pub shared_mem_bytes: u32,
    /// Above the 48 KiB default: the launch must raise the function's
    /// MAX_DYNAMIC_SHARED_SIZE_BYTES first.
    pub needs_opt_in: bool,
    /// Query tiles per head (B_r rows; the last one padded when B_r does not divide T).
    pub q_tiles: usize,
    /// Key/value tiles per head (B_c rows).
    pub kv_tiles: usize,
    /// (Q_i, K_j) tile pairs one head computes: q_tiles · kv_tiles, or the lower triangle with
    /// its diagonal when causal.
    pub tile_pairs: usize,
    /// Tile pairs above the causal diagonal, never loaded nor computed.
    pub tile_pairs_skipped: usize,
}

/// The launch for q, k, v of shape (B, T, n_head, d_head) on a device that lets a block opt
/// into `max_shared_bytes` of shared memory; an error naming the limit for shapes the kernel
/// cannot take.
pub fn launch_config(
    kernel: AttentionKernel,
    b: usize,
    t: usize,
    n_head: usize,
    d_head: usize,
    causal: bool,
    max_shared_bytes: usize,
) -> Result<LaunchPlan, String> {
    check_head_size(d_head)?;
    if b == 0 || t == 0 || n_head == 0 {
        return Err(format!("attention: empty input (B = {b}, T = {t}, n_head = {n_head})"));
    }
    if t > MAX_T {
        return Err(format!(
            "stage 2's CUDA attention kernel indexes positions with 32-bit ints, so T may be at most {MAX_T}, and it is {t}. \
             Fix: a shorter --seq."
        ));
    }
    if n_head > MAX_GRID_YZ || b > MAX_GRID_YZ {
        return Err(format!(
            "stage 2's CUDA attention kernel puts n_head and B on the grid's y and z axes (at most {MAX_GRID_YZ} each), \
             and this call has n_head = {n_head}, B = {b}. Fix: split the batch."
        ));
    }
    let bytes = shared_mem_bytes_of(kernel, d_head);
    if bytes > max_shared_bytes {
        return Err(format!(
            "stage 2's CUDA attention kernel needs {} KiB of shared memory per block at d_head = {d_head}, and this \
             device allows {} KiB. Fix: a smaller d_head (more --heads), or run with --device cpu.",
            bytes / 1024,
            max_shared_bytes / 1024
        ));
    }
    let (br, bc) = match kernel {
        AttentionKernel::V1 => (BR, BC),
        AttentionKernel::V2 => (BR_V2, BC_V2),
    };
    let (q_tiles, kv_tiles) = (t.div_ceil(br), t.div_ceil(bc));
    if kernel == AttentionKernel::V2 && q_tiles > MAX_GRID_YZ {
        return Err(format!(
            "stage 2's CUDA attention kernel v2 puts the query tiles on the grid's z axis (at most {MAX_GRID_YZ}, so T at \
             most {}), and this call has T = {t}. Fix: a shorter --seq, or --attention-kernel v1.",
            MAX_GRID_YZ * BR_V2
        ));
    }
    // Causal: query tile i (rows i·B_r .. (i+1)·B_r − 1) needs the key tiles up to its last row:
    // the triangle with its diagonal (B_r is a multiple of B_c).
    let tile_pairs = if causal { (0..q_tiles).map(|i| ((i + 1) * br / bc).min(kv_tiles)).sum() } else { q_tiles * kv_tiles };
    let grid = match kernel {
        AttentionKernel::V1 => (q_tiles as u32, n_head as u32, b as u32),
        AttentionKernel::V2 => (n_head as u32, b as u32, q_tiles as u32),
    };
    Ok(LaunchPlan {
        grid,
        threads: THREADS as u32,
        shared_mem_bytes: bytes as u32,
        needs_opt_in: bytes > DEFAULT_SHARED_BYTES,
        q_tiles,
        kv_tiles,
        tile_pairs,
        tile_pairs_skipped: q_tiles * kv_tiles - tile_pairs,
    })
}

/// Blocks resident per SM with `shared_per_sm` bytes of shared memory (228 KiB on H100, 164 on
/// A100, 100 on sm_86/89): the smallest of the shared-memory, register (64 K per SM) and thread
/// (2048 per SM) limits. The driver reserves 1 KiB of shared memory per block.
pub fn blocks_per_sm(kernel: AttentionKernel, d_head: usize, shared_per_sm: usize) -> usize {
    let by_shared = shared_per_sm / (shared_mem_bytes_of(kernel, d_head) + 1024);
    let registers = match kernel {
        AttentionKernel::V1 => registers_per_thread(d_head),
        AttentionKernel::V2 => REGISTERS_PER_THREAD_V2,
    };
    let by_registers = 65_536 / (registers * THREADS);
    let by_threads = 2048 / THREADS;
    by_shared.min(by_registers).min(by_threads)
}

/// The kernel's entry point for a dtype ("bf16" or "f16") and d_head: `flash_attn_fwd_bf16_d64`
/// (v1), `flash_attn_v2_fwd_bf16_d64` (v2).
pub fn kernel_name(kernel: AttentionKernel, dtype: &str, d_head: usize) -> String {
    match kernel {
        AttentionKernel::V1 => format!("flash_attn_fwd_{dtype}_d{d_head}"),
        AttentionKernel::V2 => format!("flash_attn_v2_fwd_{dtype}_d{d_head}"),
    }
}

/// The (batch, row, head) strides in elements shared by q, k and v, when the kernel can read
/// them in place: all three (B, T, n_head, d_head) with one set of strides, each row's d_head
/// values contiguous, and every row starting on a 16-byte boundary (start offset and strides
/// multiples of 8 16-bit values) for the kernel's 16-byte loads. `None`: copy them first.
pub fn kernel_strides(q: &candle_core::Layout, k: &candle_core::Layout, v: &candle_core::Layout) -> Option<[usize; 3]> {
    let s = q.stride();
    let same = [k, v].iter().all(|l| l.dims() == q.dims() && l.stride() == s);
    let aligned = [q, k, v].iter().all(|l| l.start_offset() % 8 == 0) && s.len() == 4 && s[3] == 1 && s[..3].iter().all(|x| x % 8 == 0);
    (same && aligned).then(|| [s[0], s[1], s[2]])
}

#[cfg(feature = "cuda")]
pub use launch::{cubins_of, cuda_bwd, cuda_bwd_stacked, cuda_fwd};

/// The architectures build.rs compiled the kernels for (10·major + minor, from CUDA_COMPUTE_CAP);
/// empty in a build without the `cuda` feature.
pub fn built_archs() -> Vec<u32> {
    #[cfg(feature = "cuda")]
    return launch::FLASH_ATTN_V2.archs.iter().map(|(a, _)| *a).collect();
    #[cfg(not(feature = "cuda"))]
    Vec::new()
}

#[cfg(feature = "cuda")]
mod launch {
    use super::{kernel_name, kernel_strides, launch_config};
    use crate::attention::AttentionKernel;
    use candle_core::backend::BackendStorage;
    use candle_core::cuda::cudarc::driver::sys::{CUdevice_attribute, CUfunction_attribute};
    use candle_core::cuda::cudarc::driver::{CudaFunction, CudaSlice, CudaView, DevicePtrMut};
    use candle_core::cuda::cudarc::driver::{DeviceRepr, LaunchConfig, PushKernelArg};
    use candle_core::cuda::{CudaDType, CudaStorage};
    use candle_core::{CpuStorage, DType, InplaceOp3, Layout, Result, Shape, Tensor};
    use kernel_cache::{function, Cubins};

    mod cubins {
        include!(concat!(env!("OUT_DIR"), "/cubins.rs"));
    }
    /// `kernels/flash_attn.cu` (v1) and `kernels/flash_attn_v2.cu`, compiled by build.rs to a
    /// cubin per architecture in CUDA_COMPUTE_CAP.
    pub static FLASH_ATTN: Cubins = Cubins { file: "stage2_sdpa/kernels/flash_attn.cu", archs: cubins::FLASH_ATTN };
    pub static FLASH_ATTN_V2: Cubins = Cubins { file: "stage2_sdpa/kernels/flash_attn_v2.cu", archs: cubins::FLASH_ATTN_V2 };
    /// `kernels/flash_attn_bwd.cu`: the backward kernels.
    pub static FLASH_ATTN_BWD: Cubins = Cubins { file: "stage2_sdpa/kernels/flash_attn_bwd.cu", archs: cubins::FLASH_ATTN_BWD };
    /// The kernel file of `kernel`, as built.
    pub fn cubins_of(kernel: AttentionKernel) -> &'static Cubins {
        match kernel {
            AttentionKernel::V1 => &FLASH_ATTN,
            AttentionKernel::V2 => &FLASH_ATTN_V2,
        }
    }

    fn err(what: &str, e: impl std::fmt::Debug) -> candle_core::Error {
        candle_core::Error::Msg(format!("{what}: {e:?}"))
    }

    /// The kernel on q, k, v (B, T, n_head, d_head), bf16 or f16, laid out as `kernel_strides`
    /// accepts. Returns a new contiguous (B, T, n_head, d_head) tensor's storage, and with
    /// `keep_lse` (training) each row's L = m + log l, (B, n_head, T) f32, for the backward.
    #[allow(clippy::type_complexity)]
    pub fn cuda_fwd(
        kernel: AttentionKernel,
        scale: f32,
        causal: bool,
        (q, q_l): (&CudaStorage, &Layout),
        (k, k_l): (&CudaStorage, &Layout),
        (v, v_l): (&CudaStorage, &Layout),
        keep_lse: bool,
    ) -> candle_core::Result<(CudaStorage, Shape, Option<CudaSlice<f32>>)> {
        match q.dtype() {
            DType::BF16 => launch::<half::bf16>(kernel, "bf16", scale, causal, (q, q_l), (k, k_l), (v, v_l), keep_lse),
            DType::F16 => launch::<half::f16>(kernel, "f16", scale, causal, (q, q_l), (k, k_l), (v, v_l), keep_lse),
            dt => candle_core::bail!(
                "stage 2's CUDA attention kernel takes bf16 or f16 (tensor-core inputs), got {dt:?}: \
                 cast q, k, v first, or use --precision bf16"
            ),
        }
    }

    #[allow(clippy::too_many_arguments, clippy::type_complexity)]
    fn launch<T: CudaDType + DeviceRepr>(
        kernel: AttentionKernel,
        dtype: &str,
        scale: f32,
        causal: bool,
        (q, q_l): (&CudaStorage, &Layout),
        (k, k_l): (&CudaStorage, &Layout),
        (v, v_l): (&CudaStorage, &Layout),
        keep_lse: bool,
    ) -> candle_core::Result<(CudaStorage, Shape, Option<CudaSlice<f32>>)> {
        let dev = &q.device;
        let (b, t, h, d) = q_l.shape().dims4()?;
        let Some([stride_b, stride_t, stride_h]) = kernel_strides(q_l, k_l, v_l) else {
            candle_core::bail!(
                "stage 2's CUDA attention kernel needs q, k, v with one shape and one set of strides, rows of d_head \
                 contiguous values starting on 16-byte boundaries; got {q_l:?}, {k_l:?}, {v_l:?} (attention() copies such inputs first)"
            )
        };
        let ctx = dev.cuda_stream().context().clone();
        let max_shared = ctx
            .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
            .map_err(|e| err("shared memory per block", e))?;
        let plan = launch_config(kernel, b, t, h, d, causal, max_shared as usize).map_err(candle_core::Error::Msg)?;
        // The cubin for this GPU's architecture, loaded on the first call (a refusal naming
        // the fix when the build has none for it), then cached.
        let name = kernel_name(kernel, dtype, d);
        let func = function(dev, cubins_of(kernel), &name)?;
        if plan.needs_opt_in {
            // Above 48 KiB of dynamic shared memory a kernel must opt in, per function.
            func.set_attribute(CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, plan.shared_mem_bytes as i32)
                .map_err(|e| err("opt into shared memory", e))?;
        }
        // Views from each tensor's first element; the kernel walks them with the strides.
        let qv = q.as_cuda_slice::<T>()?.slice(q_l.start_offset()..);
        let kv = k.as_cuda_slice::<T>()?.slice(k_l.start_offset()..);
        let vv = v.as_cuda_slice::<T>()?.slice(v_l.start_offset()..);
        // SAFETY: the kernel writes every element of `out`: all d_head values of every row t < T
        // of every (batch, head).
        let mut out = unsafe { dev.alloc::<T>(b * t * h * d)? };
        let (t_i32, causal_i32) = (t as i32, causal as i32);
        let [sb, st, sh] = [stride_b, stride_t, stride_h].map(|s| s as i64);
        let [osb, ost, osh] = [t * h * d, h * d, d].map(|s| s as i64); // contiguous (B, T, n_head, d_head)
        let cfg = LaunchConfig { grid_dim: plan.grid, block_dim: (plan.threads, 1, 1), shared_mem_bytes: plan.shared_mem_bytes };
        let stream = dev.cuda_stream();
        let mut args = stream.launch_builder(&func);
        // Training: each row's L into (B, n_head, T) f32, every element written (rows < T of
        // every head); inference passes a null pointer and the kernel writes none.
        // SAFETY (allocation): as for `out`, the kernel writes every element.
        let mut lse = if keep_lse { Some(unsafe { dev.alloc::<f32>(b * h * t)? }) } else { None };
        let (lse_ptr, _record) = match &mut lse {
            Some(l) => {
                let (p, r) = l.device_ptr_mut(&stream);
                (p, Some(r))
            }
            None => (0, None),
        };
        args.arg(&qv).arg(&kv).arg(&vv).arg(&mut out).arg(&t_i32);
        args.arg(&sb).arg(&st).arg(&sh).arg(&osb).arg(&ost).arg(&osh).arg(&scale).arg(&causal_i32).arg(&lse_ptr);
        // SAFETY: argument order and types match FLASH_ATTN_ENTRY's (and FLASH_ATTN_V2_ENTRY's,
        // the same) signature; the grid and
        // shared memory come from launch_config for this shape, checked against the device.
        unsafe { args.launch(cfg) }.map_err(|e| err(&name, e))?;
        drop(_record);
        Ok((CudaStorage::wrap_cuda_slice(out, dev.clone()), q_l.shape().clone(), lse))
    }

    /// FlashAttention-2's backward on CUDA (`kernels/flash_attn_bwd.cu`) for q, k, v, the
    /// forward's output o and the upstream gradient d_o, all (B, T, n_head, d_head) in bf16 or f16:
    /// L as the forward kernel wrote it while training, D = rowsum(dO ∘ O) as candle ops, then dQ, dK and dV in
    /// one kernel (f32, cast to q's dtype here). q, k, v and dO go in as four slices of one
    /// (B, T, 4, n_head, d_head) copy, so they share the strides the kernel takes: one copy of
    /// 4·B·T·C values, against the Q Kᵀ the backward recomputes.
    #[allow(clippy::too_many_arguments)]
    pub fn cuda_bwd(
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        o: &Tensor,
        d_o: &Tensor,
        lse: &Tensor,
        scale: f32,
        causal: bool,
    ) -> Result<[Tensor; 3]> {
        let dt = q.dtype();
        if !matches!(dt, DType::BF16 | DType::F16) {
            candle_core::bail!("stage 2's CUDA attention backward takes bf16 or f16, got {dt:?}");
        }
        // candle's stack of strided views (stage 3 splits q, k, v out of one fused QKV output)
        // comes back as a transposed view, not contiguous: the kernel needs one contiguous block.
        let qkvo = Tensor::stack(&[q, k, v, &d_o.to_dtype(dt)?], 2)?.contiguous()?; // (B, T, 4, n_head, d_head)
        let grads = cuda_bwd_stacked(&qkvo, o, d_o, lse, scale, causal)?;
        let g = |i: usize| grads.get(i)?.to_dtype(dt);
        Ok([g(0)?, g(1)?, g(2)?])
    }

    /// `cuda_bwd` on q, k, v and dO already stacked as the kernel reads them, (B, T, 4, n_head,
    /// d_head) contiguous in bf16 or f16 (stage 3 builds it from its one QKV output with a
    /// single copy): dQ, dK, dV as one (3, B, T, n_head, d_head) f32 tensor.
    pub fn cuda_bwd_stacked(qkvo: &Tensor, o: &Tensor, d_o: &Tensor, lse: &Tensor, scale: f32, causal: bool) -> Result<Tensor> {
        let (b, t, four, h, d) = qkvo.dims5()?;
        if four != 4 || !matches!(qkvo.dtype(), DType::BF16 | DType::F16) {
            candle_core::bail!(
                "attention backward: q, k, v and dO stacked as (B, T, 4, n_head, d_head) bf16 or f16, got {:?} {:?}",
                qkvo.dims(),
                qkvo.dtype()
            );
        }
        let lse = lse.reshape((b, h, t))?; // (B, n_head, T), as the forward kernel wrote it
                                           // D_i = Σ_c dO_ic O_ic, in f32: (B, T, n_head) → (B, n_head, T).
        let delta = (d_o.to_dtype(DType::F32)? * o.to_dtype(DType::F32)?)?.sum(3)?.transpose(1, 2)?;
        let stats = Tensor::stack(&[&lse, &delta], 0)?.contiguous()?; // (2, B, n_head, T): L, D
        let grads = Tensor::zeros((3, b, t, h, d), DType::F32, qkvo.device())?; // dQ, dK, dV
        grads.inplace_op3(&qkvo.contiguous()?, &stats, &Bwd { scale, causal })?;
        Ok(grads)
    }

    /// The stacked (B, T, 4, n_head, d_head) input as the kernel reads it: q, k, v and dO each a
    /// view from its first element, their shared (batch, row, head) strides, and (B, T, n_head, d_head).
    #[allow(clippy::type_complexity)]
    fn stacked<'a, T: CudaDType>(s: &'a CudaStorage, l: &Layout) -> Result<([CudaView<'a, T>; 4], [i64; 3], [usize; 4])> {
        let (b, t, four, h, d) = l.shape().dims5()?;
        let Some((start, end)) = l.contiguous_offsets().filter(|_| four == 4) else {
            candle_core::bail!("attention backward: q, k, v and dO must come stacked, contiguous (B, T, 4, n_head, d_head)")
        };
        let all = s.as_cuda_slice::<T>()?.slice(start..end);
        let views = std::array::from_fn(|p| all.slice(p * h * d..));
        Ok((views, [t * 4 * h * d, 4 * h * d, d].map(|x| x as i64), [b, t, h, d]))
    }

    /// The function `name` of the backward's cubin, opted into `bytes` of shared memory.
    fn bwd_function(dev: &candle_core::CudaDevice, name: &str, bytes: usize) -> Result<CudaFunction> {
        let func = function(dev, &FLASH_ATTN_BWD, name)?;
        if bytes > super::DEFAULT_SHARED_BYTES {
            func.set_attribute(CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, bytes as i32)
                .map_err(|e| err("opt into shared memory", e))?;
        }
        Ok(func)
    }

    /// The shape checks the forward's launch makes (head size, T, grid), and the device's
    /// shared-memory limit against `bytes`.
    fn check_bwd(dev: &candle_core::CudaDevice, [b, t, h, d]: [usize; 4], bytes: usize) -> Result<()> {
        launch_config(AttentionKernel::V1, b, t, h, d, false, usize::MAX).map_err(candle_core::Error::Msg)?;
        let ctx = dev.cuda_stream().context().clone();
        let max = ctx
            .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
            .map_err(|e| err("shared memory per block", e))? as usize;
        if bytes > max {
            candle_core::bail!(
                "stage 2's CUDA attention backward needs {} KiB of shared memory per block at d_head = {d}, and this device \
                 allows {} KiB. Fix: a smaller d_head (more --heads), or train on the CPU.",
                bytes / 1024,
                max / 1024
            );
        }
        Ok(())
    }

    /// dQ, dK, dV into `grads` (3, B, T, n_head, d_head) f32, zeroed by the caller (dQ is
    /// accumulated), from the stacked input and `stats` (2, B, n_head, T): L and D.
    struct Bwd {
        scale: f32,
        causal: bool,
    }

    impl InplaceOp3 for Bwd {
        fn name(&self) -> &'static str {
            "speedkit-flash-attention-bwd"
        }
        fn cpu_fwd(&self, _: &mut CpuStorage, _: &Layout, _: &CpuStorage, _: &Layout, _: &CpuStorage, _: &Layout) -> Result<()> {
            candle_core::bail!("this is CUDA's attention backward; the CPU's is attention::backward")
        }
        fn cuda_fwd(&self, g: &mut CudaStorage, g_l: &Layout, s: &CudaStorage, l: &Layout, st: &CudaStorage, st_l: &Layout) -> Result<()> {
            match s.dtype() {
                DType::BF16 => self.launch::<half::bf16>("bf16", g, g_l, s, l, st, st_l),
                DType::F16 => self.launch::<half::f16>("f16", g, g_l, s, l, st, st_l),
                dt => candle_core::bail!("attention backward: bf16 or f16, got {dt:?}"),
            }
        }
    }

    impl Bwd {
        #[allow(clippy::too_many_arguments)]
        fn launch<T: CudaDType + DeviceRepr>(
            &self,
            name: &str,
            g: &mut CudaStorage,
            g_l: &Layout,
            s: &CudaStorage,
            l: &Layout,
            stats: &CudaStorage,
            stats_l: &Layout,
        ) -> Result<()> {
            let dev = s.device.clone();
            let ([q, k, v, d_o], [sb, st, sh], [b, t, h, d]) = stacked::<T>(s, l)?;
            let bytes = super::bwd_shared_mem_bytes(d);
            check_bwd(&dev, [b, t, h, d], bytes)?;
            let (Some((g0, g1)), Some((s0, s1))) = (g_l.contiguous_offsets(), stats_l.contiguous_offsets()) else {
                candle_core::bail!("attention backward: the gradients and statistics must be contiguous")
            };
            let n = b * t * h * d;
            if g1 - g0 != 3 * n || s1 - s0 != 2 * b * h * t {
                candle_core::bail!(
                    "attention backward: gradients {:?} or statistics {:?} do not fit (B, T, n_head, d_head) = ({b}, {t}, {h}, {d})",
                    g_l.shape(),
                    stats_l.shape()
                );
            }
            let func = bwd_function(&dev, &format!("flash_attn_bwd_{name}_d{d}"), bytes)?;
            let all = stats.as_cuda_slice::<f32>()?.slice(s0..s1);
            let (lse, delta) = (all.slice(..b * h * t), all.slice(b * h * t..));
            let mut grads = g.as_cuda_slice_mut::<f32>()?.slice_mut(g0..g1);
            let (mut dq, mut rest) = grads.split_at_mut(n);
            let (mut dk, mut dv) = rest.split_at_mut(n);
            let (t_i32, causal) = (t as i32, self.causal as i32);
            let grid = (t.div_ceil(super::BC_BWD) as u32, h as u32, b as u32);
            let cfg = LaunchConfig { grid_dim: grid, block_dim: (super::THREADS as u32, 1, 1), shared_mem_bytes: bytes as u32 };
            let stream = dev.cuda_stream();
            let mut args = stream.launch_builder(&func);
            args.arg(&q).arg(&k).arg(&v).arg(&d_o).arg(&lse).arg(&delta).arg(&mut dq).arg(&mut dk).arg(&mut dv);
            args.arg(&t_i32).arg(&sb).arg(&st).arg(&sh).arg(&self.scale).arg(&causal);
            // SAFETY: the arguments are FLASH_ATTN_BWD_ENTRY's flash_attn_bwd_* signature, in
            // order; dq, dk, dv are three disjoint (B, T, n_head, d_head) f32 ranges of `grads`
            // (dq zeroed, as the kernel adds into it); one block per (key tile, head, batch).
            unsafe { args.launch(cfg) }.map_err(|e| err("flash_attn_bwd", e))?;
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device, IndexOp, Layout, Tensor};
    use AttentionKernel::{V1, V2};

    const H100_OPT_IN: usize = 227 * 1024;
    const SM86_OPT_IN: usize = 99 * 1024;
    /// The kernel source, to check that its constants are the ones this file computes with.
    const KERNEL: &str = include_str!("../kernels/flash_attn.cu");
    const KERNEL_V2: &str = include_str!("../kernels/flash_attn_v2.cu");

    #[test]
    fn constants_match_the_kernel_source() {
        for (name, value) in [("BR", BR), ("BC", BC), ("WARPS", WARPS)] {
            assert!(KERNEL.contains(&format!("constexpr int {name} = {value};")), "{name} = {value} not in flash_attn.cu");
        }
        for d in HEAD_SIZES {
            let line = format!("static_assert(smem_bytes<{d}>() == {}", shared_mem_bytes(d));
            assert!(KERNEL.contains(&line), "flash_attn.cu lacks `{line}`");
            for (ty, name) in [("__nv_bfloat16", "bf16"), ("__half", "f16")] {
                let entry = format!("FLASH_ATTN_ENTRY({ty}, {name}, {d})");
                assert!(KERNEL.contains(&entry), "flash_attn.cu lacks `{entry}`");
            }
        }
        // The macro pastes the entry-point name together the way kernel_name spells it.
        assert!(KERNEL.contains("flash_attn_fwd_##TNAME##_d##D("));
        assert_eq!(kernel_name(V1, "bf16", 64), "flash_attn_fwd_bf16_d64");
        assert_eq!(kernel_name(V2, "f16", 128), "flash_attn_v2_fwd_f16_d128");
    }

    #[test]
    fn constants_match_the_v2_kernel_source() {
        for (name, value) in [("BR", BR_V2), ("BC", BC_V2), ("WARPS", WARPS)] {
            assert!(KERNEL_V2.contains(&format!("constexpr int {name} = {value};")), "{name} = {value} not in flash_attn_v2.cu");
        }
        for d in HEAD_SIZES {
            let line = format!("static_assert(smem_bytes_v2<{d}>() == {}", shared_mem_bytes_v2(d));
            assert!(KERNEL_V2.contains(&line), "flash_attn_v2.cu lacks `{line}`");
            for (ty, name) in [("__nv_bfloat16", "bf16"), ("__half", "f16")] {
                let entry = format!("FLASH_ATTN_V2_ENTRY({ty}, {name}, {d})");
                assert!(KERNEL_V2.contains(&entry), "flash_attn_v2.cu lacks `{entry}`");
            }
        }
        assert!(KERNEL_V2.contains("flash_attn_v2_fwd_##TNAME##_d##D("));
        // The same argument list as v1, so one launch serves both.
        let args = |src: &str| {
            let start = src.find("const T* q, const T* k, const T* v, T* o, int T_len").expect("entry arguments");
            src[start..start + 200].split(')').next().unwrap().split_whitespace().collect::<Vec<_>>().join(" ")
        };
        assert_eq!(args(KERNEL), args(KERNEL_V2));
        // The occupancy arithmetic's register count is the __launch_bounds__ the kernel asks for.
        assert!(KERNEL_V2.contains("__launch_bounds__(THREADS, 2)"));
        const { assert!(REGISTERS_PER_THREAD_V2 * THREADS * 2 <= 65_536 && REGISTERS_PER_THREAD_V2 <= 255) };
    }

    #[test]
    fn constants_match_the_backward_kernel_source() {
        const BWD: &str = include_str!("../kernels/flash_attn_bwd.cu");
        assert!(BWD.contains("#include \"flash_attn_v2.cu\""), "the backward reuses v2's WARPS, swizzle and tile loader");
        for (name, value) in [("BR_BWD", BR_BWD), ("BC_BWD", BC_BWD)] {
            assert!(BWD.contains(&format!("constexpr int {name} = {value};")), "{name} = {value} not in flash_attn_bwd.cu");
        }
        for d in HEAD_SIZES {
            let line = format!("static_assert(bwd_smem_bytes<{d}>() == {}", bwd_shared_mem_bytes(d));
            assert!(BWD.contains(&line), "flash_attn_bwd.cu lacks `{line}`");
            for (ty, name) in [("__nv_bfloat16", "bf16"), ("__half", "f16")] {
                let entry = format!("FLASH_ATTN_BWD_ENTRY({ty}, {name}, {d})");
                assert!(BWD.contains(&entry), "flash_attn_bwd.cu lacks `{entry}`");
            }
        }
        assert!(BWD.contains("flash_attn_bwd_##TNAME##_d##D("));
        assert_eq!([32, 64, 128].map(bwd_shared_mem_bytes), [41 * 1024, 65 * 1024, 113 * 1024]);
        // d_head 128 needs SM 8.0/9.0's opt-in limit (163 / 227 KiB); sm_86/89 (99 KiB) stop at 64.
        assert!(bwd_shared_mem_bytes(128) <= 166_912 && bwd_shared_mem_bytes(64) <= SM86_OPT_IN);
        assert!(bwd_shared_mem_bytes(128) > SM86_OPT_IN);
        // Two blocks an SM on an H100 at d_head 128: shared memory (2 × (113 + 1) KiB of 228) and
        // registers (2 × 255 × 128 of 64 K), as the kernel's __launch_bounds__ asks.
        assert!(BWD.contains("__launch_bounds__(THREADS, 2) flash_attn_bwd_"));
        assert!(2 * (bwd_shared_mem_bytes(128) + 1024) <= 228 * 1024);
        const { assert!(REGISTERS_PER_THREAD_BWD * THREADS * 2 <= 65_536 && REGISTERS_PER_THREAD_BWD <= 255) };
    }

    #[test]
    fn v2_shared_memory_and_occupancy() {
        assert_eq!(shared_mem_bytes_v2(32), 16 * 1024);
        assert_eq!(shared_mem_bytes_v2(64), 32 * 1024);
        assert_eq!(shared_mem_bytes_v2(128), 64 * 1024);
        // d = 32 fits the 48 KiB default; 64 and 128 opt in on the same SMs v1 does.
        assert!(!launch_config(V2, 1, 64, 1, 32, true, SM86_OPT_IN).unwrap().needs_opt_in);
        assert!(!launch_config(V2, 1, 64, 1, 64, true, DEFAULT_SHARED_BYTES).unwrap().needs_opt_in);
        assert!(launch_config(V2, 1, 64, 1, 128, true, SM86_OPT_IN).unwrap().needs_opt_in);
        // H100 at te (d = 128): two blocks of 4 warps, as FlashAttention-2 runs; registers
        // (2 × 31 K) allow two, shared memory three. v1 fits two as well (12.5 %, what ncu
        // measured), but each v2 warp does twice the rows.
        assert_eq!(blocks_per_sm(V2, 128, 228 * 1024), 2);
        assert_eq!(blocks_per_sm(V1, 128, 228 * 1024), 2);
        assert_eq!(blocks_per_sm(V2, 64, 228 * 1024), 2); // registers: 2 × 31 K
        assert_eq!(blocks_per_sm(V2, 128, 164 * 1024), 2); // A100
        assert_eq!(blocks_per_sm(V2, 128, 100 * 1024), 1); // sm_86 / sm_89

        // te: heads fastest, then batch, then the 16 query tiles of 128 rows; causal, query tile i
        // needs key tiles 0 ..= 4i + 3 of 32 keys: 4 + 8 + … + 64 = 544 of 1024 pairs.
        let p = launch_config(V2, 8, 2048, 32, 128, true, H100_OPT_IN).unwrap();
        assert_eq!(p.grid, (32, 8, 16));
        assert_eq!((p.q_tiles, p.kv_tiles, p.tile_pairs, p.tile_pairs_skipped), (16, 64, 544, 480));
        assert_eq!(p.shared_mem_bytes, 65_536);
        // Ragged: T = 67 is one query tile and three key tiles, all needed.
        let p = launch_config(V2, 1, 67, 2, 64, true, H100_OPT_IN).unwrap();
        assert_eq!((p.grid, p.q_tiles, p.kv_tiles, p.tile_pairs), ((2, 1, 1), 1, 3, 3));
        // The query tiles ride on grid.z: at most 65 535 of them.
        assert!(launch_config(V2, 1, MAX_GRID_YZ * BR_V2, 1, 64, true, H100_OPT_IN).is_ok());
        let e = launch_config(V2, 1, MAX_GRID_YZ * BR_V2 + 1, 1, 64, true, H100_OPT_IN).unwrap_err().to_string();
        assert!(e.contains("v1") && e.contains("Fix:"), "{e}");
    }

    #[test]
    fn shared_memory_per_head_size() {
        assert_eq!(shared_mem_bytes(32), 40 * 1024);
        assert_eq!(shared_mem_bytes(64), 56 * 1024);
        assert_eq!(shared_mem_bytes(128), 88 * 1024);
        // d = 32 fits the default; 64 and 128 must opt in, and fit every SM 8.x/9.x limit.
        assert!(!launch_config(V1, 1, 64, 1, 32, true, SM86_OPT_IN).unwrap().needs_opt_in);
        for d in [64, 128] {
            let p = launch_config(V1, 1, 64, 1, d, true, SM86_OPT_IN).unwrap();
            assert!(p.needs_opt_in && p.shared_mem_bytes as usize <= SM86_OPT_IN, "{p:?}");
        }
        // A device that only allows the 48 KiB default cannot take d = 64.
        let e = launch_config(V1, 1, 64, 1, 64, true, DEFAULT_SHARED_BYTES).unwrap_err().to_string();
        assert!(e.contains("56 KiB") && e.contains("48 KiB") && e.contains("Fix:"), "{e}");
    }

    #[test]
    fn grid_for_the_presets() {
        // te: B = 8, T = 2048, n_head = 32, d_head = 128.
        let p = launch_config(V1, 8, 2048, 32, 128, true, H100_OPT_IN).unwrap();
        assert_eq!(p.grid, (32, 32, 8));
        assert_eq!(p.threads, 128);
        assert_eq!((p.q_tiles, p.kv_tiles), (32, 32));
        // Causal: 32·33/2 = 528 of the 1024 tile pairs, 496 skipped.
        assert_eq!((p.tile_pairs, p.tile_pairs_skipped), (528, 496));
        let p = launch_config(V1, 8, 2048, 32, 128, false, H100_OPT_IN).unwrap();
        assert_eq!((p.tile_pairs, p.tile_pairs_skipped), (1024, 0));
        // small: B = 4, T = 512, n_head = 12, d_head = 64.
        let p = launch_config(V1, 4, 512, 12, 64, true, H100_OPT_IN).unwrap();
        assert_eq!(p.grid, (8, 12, 4));
        assert_eq!((p.tile_pairs, p.tile_pairs_skipped), (36, 28));
    }

    #[test]
    fn t_of_one_is_one_padded_tile() {
        for causal in [true, false] {
            let p = launch_config(V1, 2, 1, 4, 64, causal, H100_OPT_IN).unwrap();
            assert_eq!(p.grid, (1, 4, 2));
            assert_eq!((p.q_tiles, p.kv_tiles, p.tile_pairs, p.tile_pairs_skipped), (1, 1, 1, 0));
        }
    }

    #[test]
    fn t_not_a_multiple_of_the_tile() {
        // 65 = one full tile and one tile of a single row: both axes round up.
        let p = launch_config(V1, 1, 65, 1, 64, true, H100_OPT_IN).unwrap();
        assert_eq!((p.q_tiles, p.kv_tiles, p.tile_pairs, p.tile_pairs_skipped), (2, 2, 3, 1));
        let p = launch_config(V1, 1, 63, 1, 64, false, H100_OPT_IN).unwrap();
        assert_eq!((p.q_tiles, p.tile_pairs), (1, 1));
        let p = launch_config(V1, 1, 2 * BC + 3, 1, 128, true, H100_OPT_IN).unwrap();
        assert_eq!((p.q_tiles, p.tile_pairs, p.tile_pairs_skipped), (3, 6, 3));
    }

    #[test]
    fn largest_t_and_grid_limits() {
        // T = i32::MAX: 2²⁵ query tiles, well inside grid.x's 2³¹ − 1, and the padded last tile
        // ends exactly at 2³¹ − 1, so every position the kernel forms fits its int.
        let p = launch_config(V1, 1, MAX_T, 1, 64, false, H100_OPT_IN).unwrap();
        assert_eq!(p.grid.0, 1 << 25);
        assert_eq!(p.q_tiles * BR - 1, i32::MAX as usize);
        let e = launch_config(V1, 1, MAX_T + 1, 1, 64, false, H100_OPT_IN).unwrap_err().to_string();
        assert!(e.contains("at most 2147483647") && e.contains("Fix:"), "{e}");
        // Causal at T = i32::MAX: the triangle, counted without overflow.
        let p = launch_config(V1, 1, MAX_T, 1, 64, true, H100_OPT_IN).unwrap();
        let n = 1usize << 25;
        assert_eq!((p.tile_pairs, p.tile_pairs_skipped), (n * (n + 1) / 2, n * (n - 1) / 2));
        // n_head and B ride on grid.y and grid.z: 65 535 each.
        assert_eq!(launch_config(V1, MAX_GRID_YZ, 64, MAX_GRID_YZ, 64, true, H100_OPT_IN).unwrap().grid, (1, 65_535, 65_535));
        for (b, h) in [(MAX_GRID_YZ + 1, 1), (1, MAX_GRID_YZ + 1)] {
            let e = launch_config(V1, b, 64, h, 64, true, H100_OPT_IN).unwrap_err().to_string();
            assert!(e.contains("65535") && e.contains("Fix:"), "{e}");
        }
    }

    #[test]
    fn unsupported_head_sizes_and_empty_inputs() {
        for d in [8, 16, 48, 80, 96, 256] {
            let e = launch_config(V1, 1, 64, 1, d, true, H100_OPT_IN).unwrap_err().to_string();
            assert!(e.contains(&format!("d_head = {d}")) && e.contains("--features flash-attn"), "{e}");
        }
        assert!(launch_config(V1, 1, 0, 1, 64, true, H100_OPT_IN).unwrap_err().to_string().contains("empty"));
    }

    #[test]
    fn occupancy_is_limited_by_shared_memory() {
        assert_eq!(blocks_per_sm(V1, 64, 228 * 1024), 4); // H100: 4 × 57 KiB
        assert_eq!(blocks_per_sm(V1, 128, 228 * 1024), 2);
        assert_eq!(blocks_per_sm(V1, 64, 164 * 1024), 2); // A100
        assert_eq!(blocks_per_sm(V1, 128, 164 * 1024), 1);
        assert_eq!(blocks_per_sm(V1, 128, 100 * 1024), 1); // sm_86 / sm_89
        assert_eq!(blocks_per_sm(V1, 32, 228 * 1024), 4); // registers cap it at 4 (16 K each)
    }

    #[test]
    fn strided_views_are_read_in_place_when_aligned() {
        let (b, t, h, d) = (2, 10, 3, 64);
        // Stage 2: (B, T, C) reshaped to heads — contiguous.
        let c = Layout::contiguous((b, t, h, d));
        assert_eq!(kernel_strides(&c, &c, &c), Some([t * h * d, h * d, d]));
        // Stage 3: q, k, v = qkv.i((.., .., i)) of a contiguous (B, T, 3, n_head, d_head), exactly
        // as stage3_fused's forward takes them.
        let qkv = Tensor::zeros((b, t, 3, h, d), DType::BF16, &Device::Cpu).unwrap();
        let (q, k, v) = (qkv.i((.., .., 0)).unwrap(), qkv.i((.., .., 1)).unwrap(), qkv.i((.., .., 2)).unwrap());
        assert!(!q.is_contiguous());
        assert_eq!((k.layout().start_offset(), v.layout().start_offset()), (h * d, 2 * h * d));
        assert_eq!(kernel_strides(q.layout(), k.layout(), v.layout()), Some([t * 3 * h * d, 3 * h * d, d]));
        // Heads-first (B, n_head, T, d_head) transposed to (B, T, n_head, d_head): still rows of
        // contiguous values, other strides — fine as long as all three agree.
        let hf = Layout::contiguous((b, h, t, d)).transpose(1, 2).unwrap();
        assert_eq!(kernel_strides(&hf, &hf, &hf), Some([h * t * d, d, t * d]));
        // Strides that differ between q, k and v, d_head not contiguous, or rows off a 16-byte
        // boundary: copy first.
        assert_eq!(kernel_strides(&hf, &c, &c), None);
        let td = Layout::contiguous((b, t, d, h)).transpose(2, 3).unwrap();
        assert_eq!(kernel_strides(&td, &td, &td), None);
        let off = Layout::contiguous_with_offset((b, t, h, d), 4);
        assert_eq!(kernel_strides(&off, &c, &c), None);
    }
}
