//! Fused attention: `attention(q, k, v, causal)` computes softmax(q kᵀ / √d_head [+ mask]) v
//! without ever writing the (B, n_head, T, T) score matrix to memory.
//!
//! Layout: q, k, v and the output are (B, T, n_head, d_head) — what a linear layer's (B, T, C)
//! output already is after a free reshape, and what candle-flash-attn expects. No transposes.
//!
//! - CPU: our kernel below (FlashAttention-2's tiled online softmax; f32, bf16 and f16 inputs,
//!   f32 accumulation), the `cpu_fwd` of a candle `CustomOp3`, rayon over batch × heads.
//! - CUDA: our FlashAttention-2 kernels (host side in `attention_cuda.rs`), the same op's
//!   `cuda_fwd`: bf16/f16 on tensor cores, f32 softmax and accumulation, SM 8.0+, d_head 32, 64
//!   or 128. v2, `kernels/flash_attn_v2.cu` (mma.sync, S and P in registers), by default; v1,
//!   `kernels/flash_attn.cu` (WMMA, the teaching kernel), with `--attention-kernel v1`.
//! - CUDA with the `flash-attn` feature: candle-flash-attn instead (bf16/f16, SM 8.0+, d_head a
//!   multiple of 8 up to 512).
//!
//! `implementation` names the one that runs; the report, the table and the JSON carry it. The
//! slow twin is stage 1's `attention`, which materialises the scores; tests assert the two
//! agree on random shapes.

use crate::attention_cuda;
use candle_core::{CpuStorage, CustomOp3, Device, Layout, Shape, Tensor, WithDType};
use rayon::prelude::*;
use shared::device::DeviceInfo;
use shared::elementwise::exp_f32;
use shared::{AttentionKernel, Precision, SpeedkitError};

/// Query rows per tile (B_r in the paper).
pub const BR: usize = 32;
/// Key/value rows per tile (B_c in the paper).
///
/// Tile sizes are chosen for the caches: one worker holds a Q tile (B_r × d), K and V tiles
/// (B_c × d each) and the O accumulator (B_r × d) in f32 — 4·(2·32 + 2·64)·d bytes = 48 KiB at
/// d = 64, 96 KiB at d = 128 — so they stay in L2 (≥ 512 KiB per core on current x86 and Arm
/// server parts), while the inner loops stream one K or V row (256–512 B) through L1.
pub const BC: usize = 64;

/// The attention kernels behind `attention`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Implementation {
    /// The tiled online-softmax kernel in this file (CPU, rayon).
    Cpu,
    /// Our FlashAttention-2 kernel v2, `kernels/flash_attn_v2.cu` (CUDA, mma.sync tensor cores,
    /// S and P in registers): the default on CUDA.
    SpeedkitCuda,
    /// Our v1 kernel, `kernels/flash_attn.cu` (CUDA, WMMA tensor cores): the lesson's first
    /// step, `--attention-kernel v1`.
    SpeedkitCudaV1,
    /// candle-flash-attn (CUDA, the `flash-attn` feature).
    FlashAttn,
}

impl Implementation {
    /// What `attention` runs on `device` in this build.
    pub fn on(device: &Device) -> Self {
        if device.is_cuda() {
            Self::cuda()
        } else {
            Implementation::Cpu
        }
    }

    /// What a stage runs on `device` with `--attention-kernel` = `kernel` (None: the default).
    /// The flag picks between our two CUDA kernels; where neither runs (the CPU, a build with
    /// candle-flash-attn) asking for one is an error, not a request quietly ignored.
    pub fn for_run(device: &Device, kernel: Option<AttentionKernel>) -> Result<Self, SpeedkitError> {
        let default = Self::on(device);
        match (kernel, default) {
            (None, imp) => Ok(imp),
            (Some(AttentionKernel::V2), Implementation::SpeedkitCuda) => Ok(Implementation::SpeedkitCuda),
            (Some(AttentionKernel::V1), Implementation::SpeedkitCuda) => Ok(Implementation::SpeedkitCudaV1),
            (Some(k), imp) => Err(SpeedkitError::usage(format!(
                "--attention-kernel {} chooses between stage 2's two CUDA kernels (v1: WMMA, v2: mma.sync), and \
                 this run's attention is {} instead. Fix: drop --attention-kernel (and SPEEDKIT_ATTENTION_KERNEL), \
                 or run on a GPU (--device cuda) with a build without the flash-attn feature.",
                k.name(),
                imp.description()
            ))),
        }
    }

    /// What runs on a GPU in this build: candle-flash-attn when the feature is built, else ours.
    pub fn cuda() -> Self {
        if cfg!(feature = "flash-attn") {
            Implementation::FlashAttn
        } else {
            Implementation::SpeedkitCuda
        }
    }

    /// A short name, for the table's precision cell: "bf16 (speedkit cuda attn)".
    pub fn name(self) -> &'static str {
        match self {
            Implementation::Cpu => "speedkit cpu attn",
            Implementation::SpeedkitCuda => "speedkit cuda v2",
            Implementation::SpeedkitCudaV1 => "speedkit cuda v1",
            Implementation::FlashAttn => "flash-attn",
        }
    }

    /// One line, for the run's notes.
    pub fn description(self) -> &'static str {
        match self {
            Implementation::Cpu => "speedkit tiled online-softmax kernel (CPU, rayon)",
            Implementation::SpeedkitCuda => {
                "speedkit FlashAttention-2 kernel v2 (stage2_sdpa/kernels/flash_attn_v2.cu, mma.sync tensor cores, S and P in registers)"
            }
            Implementation::SpeedkitCudaV1 => "speedkit FlashAttention-2 kernel v1 (stage2_sdpa/kernels/flash_attn.cu, WMMA tensor cores)",
            Implementation::FlashAttn => "candle-flash-attn (FlashAttention-2, CUDA)",
        }
    }

    /// The head sizes this implementation takes: any on the CPU; 32, 64 or 128 for our CUDA
    /// kernel (one compiled instance each); multiples of 8 up to 512 for candle-flash-attn 0.11.
    pub fn check_head_size(self, d_head: usize) -> Result<(), SpeedkitError> {
        match self {
            Implementation::Cpu => Ok(()),
            Implementation::SpeedkitCuda | Implementation::SpeedkitCudaV1 => attention_cuda::check_head_size(d_head),
            Implementation::FlashAttn if !d_head.is_multiple_of(8) || d_head > 512 => Err(SpeedkitError::usage(format!(
                "candle-flash-attn supports d_head = C / n_head up to 512 in multiples of 8, and this shape has d_head = {d_head}. \
                 Fix: pick --heads so that C / n_head is one of 64, 128 (the common sizes), or run with --device cpu."
            ))),
            Implementation::FlashAttn => Ok(()),
        }
    }
}

/// Which implementation `attention` runs on `device` (short name, for the report and the table).
pub fn implementation(device: &Device) -> &'static str {
    Implementation::on(device).name()
}

/// Can this device run fused attention at precision `p`? On CUDA both kernels (ours and
/// candle-flash-attn) take bf16 or f16 on SM 8.0+. The CPU kernel takes any precision stage 1
/// allows.
pub fn check_device(info: &DeviceInfo, p: Precision) -> Result<(), SpeedkitError> {
    if !info.is_cuda() {
        return Ok(());
    }
    check_cuda(Implementation::cuda(), built_arch(), info, p)
}

/// The SM our kernel's PTX was compiled for (build.rs, from CUDA_COMPUTE_CAP): (9, 0) for sm_90.
/// `None` in a build without the `cuda` feature.
fn built_arch() -> Option<(u32, u32)> {
    option_env!("SPEEDKIT_ATTN_ARCH").and_then(|a| a.parse::<u32>().ok()).map(|n| (n / 10, n % 10))
}

fn check_cuda(imp: Implementation, built: Option<(u32, u32)>, info: &DeviceInfo, p: Precision) -> Result<(), SpeedkitError> {
    let who = match imp {
        Implementation::FlashAttn => "candle-flash-attn",
        _ => "stage 2's CUDA attention kernels (kernels/flash_attn.cu, flash_attn_v2.cu)",
    };
    let sm = info.sm.map_or("?".into(), |(a, b)| format!("{a}.{b}"));
    if !info.has_bf16_tensor_cores() {
        return Err(SpeedkitError::usage(format!(
            "{who} needs SM 8.0+ (Ampere or newer: bf16 tensor cores), and {} is SM {sm}. \
             Fix: run stage 2 with --device cpu; stages 0-1 run on this GPU.",
            info.name
        )));
    }
    if let (Implementation::SpeedkitCuda | Implementation::SpeedkitCudaV1, Some((ma, mi)), Some(have)) = (imp, built, info.sm) {
        if have < (ma, mi) {
            let (a, b) = have;
            return Err(SpeedkitError::usage(format!(
                "{who} was compiled to PTX for sm_{ma}{mi} (CUDA_COMPUTE_CAP at build time), which {} (SM {sm}) cannot load. \
                 Fix: rebuild with CUDA_COMPUTE_CAP={a}{b} (PTX for an SM also runs on every newer one), or run stage 2 \
                 with --device cpu.",
                info.name
            )));
        }
    }
    if !matches!(p, Precision::Bf16 | Precision::F16) {
        return Err(SpeedkitError::usage(format!(
            "{who} computes in bf16 or f16, so stage 2 cannot run --precision {p} on CUDA. \
             Fix: use --precision bf16 (the auto choice on this GPU) or f16."
        )));
    }
    Ok(())
}

/// The head sizes the implementation that runs on `device` takes.
pub fn check_head_size(device: &Device, d_head: usize) -> Result<(), SpeedkitError> {
    Implementation::on(device).check_head_size(d_head)
}

/// Working set of a block with fused attention, in bytes: weights, a handful of (B, T, C)
/// activations and the MLP's (B, T, FF) ones — and no (B, n_head, T, T) term.
pub fn estimate_fused_bytes(s: &shared::Shape) -> u128 {
    let (b, t, c, ff) = (s.batch as u128, s.seq as u128, s.d_model as u128, s.ff as u128);
    4 * (4 * c * c + 2 * c * ff + 9 * c + ff + 10 * b * t * c + 4 * b * t * ff)
}

/// Fused scaled-dot-product attention.
///
/// q, k, v: (B, T, n_head, d_head), same shape and dtype (f32, bf16 or f16 on CPU; bf16 or f16
/// on CUDA). `causal`: query t attends to keys 0..=t only. Returns (B, T, n_head, d_head) in the
/// input dtype; softmax statistics and accumulation are f32.
pub fn attention(q: &Tensor, k: &Tensor, v: &Tensor, causal: bool) -> candle_core::Result<Tensor> {
    attention_with(Implementation::on(q.device()), q, k, v, causal)
}

/// `attention` through a chosen implementation, to compare them (benches, GPU tests); an error,
/// never a substitute, when this build or q's device cannot run it.
pub fn attention_with(imp: Implementation, q: &Tensor, k: &Tensor, v: &Tensor, causal: bool) -> candle_core::Result<Tensor> {
    let (b, t, h, d) = q.dims4()?;
    if k.dims() != q.dims() || v.dims() != q.dims() {
        candle_core::bail!(
            "attention: q, k, v must share one (B, T, n_head, d_head) shape, got {:?}, {:?}, {:?}",
            q.dims(),
            k.dims(),
            v.dims()
        );
    }
    if k.dtype() != q.dtype() || v.dtype() != q.dtype() {
        candle_core::bail!("attention: q, k, v must share one dtype, got {:?}, {:?}, {:?}", q.dtype(), k.dtype(), v.dtype());
    }
    if b * t * h * d == 0 {
        candle_core::bail!("attention: empty input {:?}", q.dims());
    }
    if (imp == Implementation::Cpu) == q.device().is_cuda() {
        candle_core::bail!("attention: {} cannot run on {:?}", imp.name(), q.device().location());
    }
    let scale = 1.0 / (d as f32).sqrt();
    // The CUDA kernel the op launches (the CPU kernel ignores it).
    let kernel = if imp == Implementation::SpeedkitCudaV1 { AttentionKernel::V1 } else { AttentionKernel::V2 };
    let op = FlashAttn { scale, causal, kernel };
    match imp {
        Implementation::Cpu => {
            let (q, k, v) = (q.contiguous()?, k.contiguous()?, v.contiguous()?);
            q.apply_op3_no_bwd(&k, &v, &op)
        }
        Implementation::SpeedkitCuda | Implementation::SpeedkitCudaV1 => {
            // Views go in as they are when the kernel can read them in place (stage 2's
            // reshapes, stage 3's slices of the QKV output); anything else is copied first.
            // Both kernels share the layout rules.
            if attention_cuda::kernel_strides(q.layout(), k.layout(), v.layout()).is_some() {
                q.apply_op3_no_bwd(k, v, &op)
            } else {
                let (q, k, v) = (q.force_contiguous()?, k.force_contiguous()?, v.force_contiguous()?);
                q.apply_op3_no_bwd(&k, &v, &op)
            }
        }
        Implementation::FlashAttn => flash_attn(q, k, v, scale, causal),
    }
}

#[cfg(feature = "flash-attn")]
fn flash_attn(q: &Tensor, k: &Tensor, v: &Tensor, scale: f32, causal: bool) -> candle_core::Result<Tensor> {
    candle_flash_attn::flash_attn(q, k, v, scale, causal)
}

#[cfg(not(feature = "flash-attn"))]
fn flash_attn(_q: &Tensor, _k: &Tensor, _v: &Tensor, _scale: f32, _causal: bool) -> candle_core::Result<Tensor> {
    candle_core::bail!(
        "candle-flash-attn is not in this build: rebuild with --features flash-attn \
         (needs network access at build time to fetch CUTLASS)"
    )
}

/// Both kernels as one candle op (three inputs, one output, no backward): candle calls
/// `cpu_fwd` for CPU tensors and `cuda_fwd` for CUDA ones.
struct FlashAttn {
    scale: f32,
    causal: bool,
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))] // read by cuda_fwd only
    kernel: AttentionKernel,
}

impl CustomOp3 for FlashAttn {
    fn name(&self) -> &'static str {
        "speedkit-flash-attention"
    }

    /// Our CUDA kernel (`kernels/flash_attn_v2.cu`, or v1's `flash_attn.cu`), launched by `attention_cuda`.
    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
        s3: &candle_core::CudaStorage,
        l3: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        attention_cuda::cuda_fwd(self.kernel, self.scale, self.causal, (s1, l1), (s2, l2), (s3, l3))
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let dims: [usize; 4] = l1.shape().dims().try_into().map_err(|_| candle_core::Error::Msg("attention: q must be 4-d".into()))?;
        let shape = l1.shape().clone();
        fn slice<'a, T>(s: &'a [T], l: &Layout) -> candle_core::Result<&'a [T]> {
            match l.contiguous_offsets() {
                Some((start, end)) => Ok(&s[start..end]),
                None => candle_core::bail!("attention: inputs must be contiguous"),
            }
        }
        let out = match (s1, s2, s3) {
            (CpuStorage::F32(q), CpuStorage::F32(k), CpuStorage::F32(v)) => {
                CpuStorage::F32(self.run(slice(q, l1)?, slice(k, l2)?, slice(v, l3)?, dims))
            }
            (CpuStorage::BF16(q), CpuStorage::BF16(k), CpuStorage::BF16(v)) => {
                CpuStorage::BF16(self.run(slice(q, l1)?, slice(k, l2)?, slice(v, l3)?, dims))
            }
            (CpuStorage::F16(q), CpuStorage::F16(k), CpuStorage::F16(v)) => {
                CpuStorage::F16(self.run(slice(q, l1)?, slice(k, l2)?, slice(v, l3)?, dims))
            }
            _ => candle_core::bail!(
                "attention: CPU kernel takes f32, bf16 or f16 (all three alike), got {:?}",
                candle_core::backend::BackendStorage::dtype(s1)
            ),
        };
        Ok((out, shape))
    }
}

impl FlashAttn {
    /// One task per (batch, head): each writes its (T, d_head) result, then the results are
    /// scattered into the (B, T, n_head, d_head) output (one extra pass over B·T·C values,
    /// small next to the O(T²·d) attention work, and it keeps every task's writes disjoint).
    fn run<T: WithDType>(&self, q: &[T], k: &[T], v: &[T], [b, t, h, d]: [usize; 4]) -> Vec<T> {
        let heads: Vec<Vec<T>> = (0..b * h)
            .into_par_iter()
            .map(|bh| {
                // Row r of this head starts at ((b·T + r)·n_head + h)·d; rows are n_head·d apart.
                let base = (bh / h) * t * h * d + (bh % h) * d;
                let rows = Rows { base, stride: h * d, d };
                attend_one_head(q, k, v, rows, t, self.scale, self.causal)
            })
            .collect();
        let mut out = vec![T::zero(); b * t * h * d];
        for (bh, o) in heads.iter().enumerate() {
            let base = (bh / h) * t * h * d + (bh % h) * d;
            for (r, row) in o.chunks_exact(d).enumerate() {
                out[base + r * h * d..][..d].copy_from_slice(row);
            }
        }
        out
    }
}

/// Where one head's rows live inside a (B, T, n_head, d_head) buffer.
#[derive(Clone, Copy)]
struct Rows {
    base: usize,
    stride: usize,
    d: usize,
}

impl Rows {
    /// Copy rows r0..r0+n into `dst` (n × d, f32): the tile load.
    fn load<T: WithDType>(&self, src: &[T], r0: usize, n: usize, dst: &mut [f32]) {
        for (i, out) in dst.chunks_exact_mut(self.d).take(n).enumerate() {
            let row = &src[self.base + (r0 + i) * self.stride..][..self.d];
            for (o, x) in out.iter_mut().zip(row) {
                *o = x.to_f64() as f32;
            }
        }
    }

    /// Copy rows r0..r0+n into `dst` transposed (d × B_c, f32): column c of the tile becomes a
    /// contiguous row, so the score loop below runs along keys, one SIMD lane per key.
    fn load_transposed<T: WithDType>(&self, src: &[T], r0: usize, n: usize, dst: &mut [f32]) {
        for j in 0..n {
            let row = &src[self.base + (r0 + j) * self.stride..][..self.d];
            for (c, x) in row.iter().enumerate() {
                dst[c * BC + j] = x.to_f64() as f32;
            }
        }
    }
}

/// FlashAttention-2's forward pass for one (batch, head), in the paper's notation (Dao 2023,
/// Algorithm 1): for each query tile Q_i, stream the key/value tiles K_j, V_j and keep per
/// query row a running max m, a running softmax denominator l and an unnormalised output
/// accumulator O, rescaling both whenever the max grows. Scratch is O(T·d) for the result
/// plus the O((B_r + B_c)·d) tiles — never O(T²).
///
/// The CPU's vector width is decided at run time: the same body is compiled three times, for the
/// x86-64 baseline (SSE2: 4 lanes, separate multiply and add), with AVX2 + FMA (8 lanes, fused
/// multiply-add) and with AVX-512 (16 lanes), and the fastest one this CPU supports runs. Release builds for the
/// baseline target would otherwise leave half the vector units idle.
fn attend_one_head<T: WithDType>(q: &[T], k: &[T], v: &[T], rows: Rows, t: usize, scale: f32, causal: bool) -> Vec<T> {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f") && std::arch::is_x86_feature_detected!("fma") {
        // SAFETY: this CPU supports AVX-512F and FMA, checked on the line above.
        return unsafe { attend_one_head_avx512(q, k, v, rows, t, scale, causal) };
    }
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
        // SAFETY: this CPU supports AVX2 and FMA, checked on the line above.
        return unsafe { attend_one_head_avx2_fma(q, k, v, rows, t, scale, causal) };
    }
    // aarch64 always has fused multiply-add (NEON); elsewhere use separate multiply and add.
    attend_one_head_impl::<T, { cfg!(target_arch = "aarch64") }>(q, k, v, rows, t, scale, causal)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn attend_one_head_avx2_fma<T: WithDType>(q: &[T], k: &[T], v: &[T], rows: Rows, t: usize, scale: f32, causal: bool) -> Vec<T> {
    attend_one_head_impl::<T, true>(q, k, v, rows, t, scale, causal)
}

/// The same body with 16-lane AVX-512 registers: a B_c = 64 score row is four registers.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn attend_one_head_avx512<T: WithDType>(q: &[T], k: &[T], v: &[T], rows: Rows, t: usize, scale: f32, causal: bool) -> Vec<T> {
    attend_one_head_impl::<T, true>(q, k, v, rows, t, scale, causal)
}

#[inline(always)]
fn attend_one_head_impl<T: WithDType, const FMA: bool>(
    q: &[T],
    k: &[T],
    v: &[T],
    rows: Rows,
    t: usize,
    scale: f32,
    causal: bool,
) -> Vec<T> {
    let d = rows.d;
    let mut out = vec![T::zero(); t * d];
    let (mut q_tile, mut o_tile) = (vec![0f32; BR * d], vec![0f32; BR * d]);
    let (mut k_tile_t, mut v_tile) = (vec![0f32; d * BC], vec![0f32; BC * d]); // K_jᵀ (d × B_c), V_j (B_c × d)
    let (mut m, mut l, mut s) = ([0f32; BR], [0f32; BR], [0f32; BC]);

    for i0 in (0..t).step_by(BR) {
        let br = BR.min(t - i0);
        rows.load(q, i0, br, &mut q_tile);
        o_tile.fill(0.0); // O_i = 0
        m.fill(f32::NEG_INFINITY); // m_i = −∞
        l.fill(0.0); // l_i = 0

        // Causal: keys after this tile's last query are masked for every row in it, so those
        // K/V tiles are skipped entirely — about half the work at long T.
        let kv_end = if causal { i0 + br } else { t };
        for j0 in (0..kv_end).step_by(BC) {
            let bc = BC.min(kv_end - j0);
            rows.load_transposed(k, j0, bc, &mut k_tile_t);
            rows.load(v, j0, bc, &mut v_tile);
            for r in 0..br {
                // Keys this row may see in this tile: all, or up to its own position.
                let n = if causal { bc.min((i0 + r + 1).saturating_sub(j0)) } else { bc };
                if n == 0 {
                    continue;
                }
                // S_r = q_r · K_jᵀ / √d, all B_c keys at once: for each channel c, broadcast
                // q_rc and multiply-add it into the B_c scores (eight keys per AVX2 register,
                // the whole row of scores held in registers; lanes past n are never read).
                s.fill(0.0);
                for (c, &q_rc) in q_tile[r * d..][..d].iter().enumerate() {
                    let k_c: &[f32; BC] = k_tile_t[c * BC..][..BC].try_into().expect("B_c wide");
                    for (s_j, &k_cj) in s.iter_mut().zip(k_c) {
                        *s_j = fma::<FMA>(q_rc, k_cj, *s_j);
                    }
                }
                let mut m_new = m[r];
                for s_j in s[..n].iter_mut() {
                    *s_j *= scale;
                    m_new = m_new.max(*s_j); // m_new = max(m, rowmax(S))
                }
                // Rescale what was accumulated under the old max: α = exp(m − m_new)
                // (m = −∞ on the first tile gives α = 0).
                let alpha = (m[r] - m_new).exp();
                let o_r = &mut o_tile[r * d..][..d];
                o_r.iter_mut().for_each(|o| *o *= alpha); // O = α·O
                l[r] *= alpha; // l = α·l
                               // P_rj = exp(S_rj − m_new) for the whole row first: one loop the compiler
                               // vectorises (shared's libm-free exp), instead of a scalar exp per key.
                let mut row_sum = 0f32;
                for s_j in s[..n].iter_mut() {
                    *s_j = exp_f32(*s_j - m_new);
                    row_sum += *s_j;
                }
                l[r] += row_sum; // l += rowsum(P)
                for (j, &p) in s[..n].iter().enumerate() {
                    axpy::<FMA>(p, &v_tile[j * d..][..d], o_r); // O += P_rj · v_j
                }
                m[r] = m_new;
            }
        }
        // O_i = diag(l)⁻¹ · O_i, written out in the input dtype.
        for r in 0..br {
            let inv_l = 1.0 / l[r];
            let dst = &mut out[(i0 + r) * d..][..d];
            for (o, &acc) in dst.iter_mut().zip(&o_tile[r * d..][..d]) {
                *o = T::from_f64((acc * inv_l) as f64);
            }
        }
    }
    out
}

/// a·b + c, as one fused instruction where the CPU has it (and exact rounding either way).
#[inline(always)]
fn fma<const FMA: bool>(a: f32, b: f32, c: f32) -> f32 {
    if FMA {
        a.mul_add(b, c)
    } else {
        a * b + c
    }
}

/// y += a·x
#[inline(always)]
fn axpy<const FMA: bool>(a: f32, x: &[f32], y: &mut [f32]) {
    for (yi, xi) in y.iter_mut().zip(x) {
        *yi = fma::<FMA>(a, *xi, *yi);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::DType;

    #[test]
    fn axpy_both_bodies() {
        let x: Vec<f32> = (0..19).map(|i| i as f32).collect();
        let (mut y1, mut y2) = (vec![1f32; 19], vec![1f32; 19]);
        axpy::<false>(2.0, &x, &mut y1);
        axpy::<true>(2.0, &x, &mut y2);
        assert_eq!(y1, y2);
        assert_eq!(y1[3], 7.0);
    }

    #[test]
    fn baseline_and_fma_bodies_agree() {
        // Whichever body this CPU dispatches to, the other one is checked here too.
        let (t, h, d) = (77, 2, 64);
        let n = t * h * d;
        let data = shared::weights::SplitMix64::new(3).normals(3 * n);
        let (q, k, v) = (&data[..n], &data[n..2 * n], &data[2 * n..]);
        let rows = Rows { base: d, stride: h * d, d }; // the second head
        for causal in [true, false] {
            let a = attend_one_head_impl::<f32, false>(q, k, v, rows, t, 0.125, causal);
            let b = attend_one_head_impl::<f32, true>(q, k, v, rows, t, 0.125, causal);
            let worst = a.iter().zip(&b).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
            assert!(worst < 1e-5, "causal={causal}: {worst}");
            // The compiled-for-SIMD bodies, where this CPU has them.
            #[cfg(target_arch = "x86_64")]
            for (name, ok, body) in [
                (
                    "avx2",
                    std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma"),
                    attend_one_head_avx2_fma::<f32> as unsafe fn(_, _, _, _, _, _, _) -> _,
                ),
                (
                    "avx512",
                    std::arch::is_x86_feature_detected!("avx512f") && std::arch::is_x86_feature_detected!("fma"),
                    attend_one_head_avx512::<f32>,
                ),
            ] {
                if ok {
                    // SAFETY: the CPU has the features this body is compiled for (checked in `ok`).
                    let c = unsafe { body(q, k, v, rows, t, 0.125, causal) };
                    let worst = a.iter().zip(&c).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
                    assert!(worst < 1e-5, "{name} causal={causal}: {worst}");
                }
            }
        }
    }

    #[test]
    fn cuda_refusals_name_the_fix() {
        let h100 = DeviceInfo::simulated_cuda("H100", (9, 0));
        let a100 = DeviceInfo::simulated_cuda("A100", (8, 0));
        let t4 = DeviceInfo::simulated_cuda("T4", (7, 5));
        let cpu = DeviceInfo { kind: shared::device::DeviceKind::Cpu, ..DeviceInfo::simulated_cuda("cpu", (0, 0)) };
        assert!(check_device(&cpu, Precision::Fp32).is_ok());
        // A CUDA GPU no longer needs the flash-attn feature: ours runs when it is not built.
        assert!(check_device(&h100, Precision::Bf16).is_ok());
        assert!(check_device(&h100, Precision::F16).is_ok());
        for imp in [Implementation::SpeedkitCuda, Implementation::FlashAttn] {
            let who = if imp == Implementation::FlashAttn { "candle-flash-attn" } else { "kernels/flash_attn.cu" };
            assert!(check_cuda(imp, None, &a100, Precision::Bf16).is_ok());
            let e = check_cuda(imp, None, &t4, Precision::F16).unwrap_err().to_string();
            assert!(e.contains(who) && e.contains("SM 8.0+") && e.contains("SM 7.5") && e.contains("--device cpu"), "{e}");
            for p in [Precision::Fp32, Precision::Tf32] {
                let e = check_cuda(imp, None, &h100, p).unwrap_err().to_string();
                assert!(e.contains(who) && e.contains(&format!("--precision {p}")) && e.contains("--precision bf16"), "{e}");
            }
        }
        // PTX built for sm_90 cannot load on an A100: say so, and how to rebuild.
        let e = check_cuda(Implementation::SpeedkitCuda, Some((9, 0)), &a100, Precision::Bf16).unwrap_err().to_string();
        assert!(e.contains("sm_90") && e.contains("CUDA_COMPUTE_CAP=80"), "{e}");
        assert!(check_cuda(Implementation::SpeedkitCuda, Some((8, 0)), &h100, Precision::Bf16).is_ok());
        assert!(check_cuda(Implementation::FlashAttn, Some((9, 0)), &a100, Precision::Bf16).is_ok());
    }

    #[test]
    fn head_sizes_follow_the_implementation() {
        // Head sizes only matter on CUDA, and there they depend on which kernel runs.
        assert!(check_head_size(&candle_core::Device::Cpu, 20).is_ok());
        for d in [32, 64, 128] {
            assert!(Implementation::SpeedkitCuda.check_head_size(d).is_ok());
        }
        for d in [20, 80, 256] {
            let e = Implementation::SpeedkitCuda.check_head_size(d).unwrap_err().to_string();
            assert!(e.contains(&format!("d_head = {d}")) && e.contains("Fix:"), "{e}");
        }
        assert!(Implementation::FlashAttn.check_head_size(80).is_ok());
        assert!(Implementation::FlashAttn.check_head_size(256).is_ok());
        for d in [20, 520] {
            assert!(Implementation::FlashAttn.check_head_size(d).unwrap_err().to_string().contains("multiples of 8"));
        }
    }

    #[test]
    fn implementation_names() {
        assert_eq!(implementation(&candle_core::Device::Cpu), "speedkit cpu attn");
        let cuda = if cfg!(feature = "flash-attn") { "flash-attn" } else { "speedkit cuda v2" };
        assert_eq!(Implementation::cuda().name(), cuda);
        for imp in [Implementation::Cpu, Implementation::SpeedkitCuda, Implementation::SpeedkitCudaV1, Implementation::FlashAttn] {
            assert!(imp.name().len() <= 18, "a table cell: {}", imp.name());
        }
    }

    #[test]
    fn a_cuda_implementation_on_cpu_tensors_is_an_error_not_a_fallback() {
        let dev = candle_core::Device::Cpu;
        let q = Tensor::zeros((1, 4, 2, 64), DType::BF16, &dev).unwrap();
        for imp in [Implementation::SpeedkitCuda, Implementation::SpeedkitCudaV1, Implementation::FlashAttn] {
            let e = attention_with(imp, &q, &q, &q, true).unwrap_err().to_string();
            assert!(e.contains(imp.name()) && e.contains("cannot run"), "{e}");
        }
        assert!(attention_with(Implementation::Cpu, &q, &q, &q, true).is_ok());
    }

    #[test]
    fn attention_kernel_flag_is_refused_where_it_cannot_apply() {
        // The CPU has one attention kernel: asking for v1 or v2 there is an error naming the fix.
        let cpu = candle_core::Device::Cpu;
        assert_eq!(Implementation::for_run(&cpu, None).unwrap(), Implementation::Cpu);
        for k in [AttentionKernel::V1, AttentionKernel::V2] {
            let e = Implementation::for_run(&cpu, Some(k)).unwrap_err().to_string();
            assert!(e.contains(&format!("--attention-kernel {}", k.name())) && e.contains("Fix:"), "{e}");
            assert!(!e.contains("  "), "one paragraph, no source indentation: {e}");
        }
    }

    #[test]
    fn single_key_returns_its_value() {
        // T = 1: softmax over one key is 1, so the output is v exactly.
        let dev = candle_core::Device::Cpu;
        let q = Tensor::new(&[[[[0.3f32, -1.0]]]], &dev).unwrap();
        let k = Tensor::new(&[[[[2.0f32, 0.5]]]], &dev).unwrap();
        let v = Tensor::new(&[[[[7.0f32, -3.0]]]], &dev).unwrap();
        for causal in [false, true] {
            let o = attention(&q, &k, &v, causal).unwrap();
            assert_eq!(o.flatten_all().unwrap().to_vec1::<f32>().unwrap(), vec![7.0, -3.0]);
        }
    }

    #[test]
    fn rejects_mismatched_inputs() {
        let dev = candle_core::Device::Cpu;
        let q = Tensor::zeros((1, 4, 2, 8), DType::F32, &dev).unwrap();
        let k = Tensor::zeros((1, 5, 2, 8), DType::F32, &dev).unwrap();
        assert!(attention(&q, &k, &q, true).unwrap_err().to_string().contains("share one"));
        let kb = q.to_dtype(DType::BF16).unwrap();
        assert!(attention(&q, &kb, &q, true).unwrap_err().to_string().contains("dtype"));
    }
}
