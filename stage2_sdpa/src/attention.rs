//! Fused attention: `attention(q, k, v, causal)` computes softmax(q kᵀ / √d_head [+ mask]) v
//! without ever writing the (B, n_head, T, T) score matrix to memory.
//!
//! Layout: q, k, v and the output are (B, T, n_head, d_head) — what a linear layer's (B, T, C)
//! output already is after a free reshape, and what candle-flash-attn expects. No transposes.
//!
//! - CPU: our kernels (FlashAttention-2's tiled online softmax; f32, bf16 and f16 inputs, f32
//!   accumulation), the `cpu_fwd` of a candle `CustomOp3`, rayon over batch × heads. By
//!   default Q·Kᵀ and P·V run on our own register-blocked micro-kernels (`registers`, d_head a
//!   const generic); the other design, tile GEMMs on the `gemm` crate's micro-kernels
//!   (`CpuKernel::GemmTiles`), runs head sizes that kernel has no body for, and both were
//!   measured side by side (the criterion bench `attention`). Both read q, k and v through their
//!   strides (stage 3's views of one QKV output too), no copy. bf16 inputs on a CPU with
//!   AVX512-BF16 run both products on `vdpbf16ps` (`registers::bf16`, P rounded to bf16 as on a
//!   GPU); elsewhere each head is widened to f32 first. Their slow twins: the first
//!   row-wise kernel (`CpuKernel::RowAxpy`) and stage 1's materialised attention.
//! - CUDA: our FlashAttention-2 kernels (host side in `attention_cuda.rs`), the same op's
//!   `cuda_fwd`: bf16/f16 on tensor cores, f32 softmax and accumulation, SM 8.0+, d_head 32, 64
//!   or 128. v2, `kernels/flash_attn_v2.cu` (mma.sync, S and P in registers), by default; v1,
//!   `kernels/flash_attn.cu` (WMMA, the teaching kernel), with `--attention-kernel v1`.
//! - CUDA with the `flash-attn` feature: candle-flash-attn instead (bf16/f16, SM 8.0+, d_head a
//!   multiple of 8 up to 512).
//!
//! - Backward (`backward`): the op's `bwd`, so `loss.backward()` through `attention` gives dQ, dK
//!   and dV: FlashAttention-2's tiled backward on the CPU (P recomputed tile by tile from each
//!   row's log-sum-exp, no (T, T) tensor), the same equations as candle ops on CUDA.
//!
//! `implementation` names the one that runs; the report, the table and the JSON carry it. The
//! slow twin is stage 1's `attention`, which materialises the scores; tests assert the two
//! agree on random shapes.

use crate::attention_cuda;
use candle_core::{CpuStorage, CustomOp3, DType, Device, Layout, Shape, Tensor};
use cpu_kernels::attention::CpuAttention;
pub use cpu_kernels::attention::{backward, registers, CpuKernel, BC, BR, ROW_BC, ROW_BR};
use std::sync::Mutex;

/// Which of our two CUDA attention kernels runs: v1, `kernels/flash_attn.cu` (WMMA, the
/// teaching kernel), or v2, `kernels/flash_attn_v2.cu` (mma.sync, S and P in registers; the
/// default). The CPU has one attention kernel and ignores it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum AttentionKernel {
    V1,
    #[default]
    V2,
}

impl AttentionKernel {
    pub fn name(self) -> &'static str {
        match self {
            AttentionKernel::V1 => "v1",
            AttentionKernel::V2 => "v2",
        }
    }
}

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

    /// `kernel` on `device`: our CUDA kernel v1 or v2 where ours runs; `None` where neither
    /// does (the CPU, a build with candle-flash-attn).
    pub fn with_kernel(device: &Device, kernel: AttentionKernel) -> Option<Self> {
        match (Self::on(device), kernel) {
            (Implementation::SpeedkitCuda, AttentionKernel::V2) => Some(Implementation::SpeedkitCuda),
            (Implementation::SpeedkitCuda, AttentionKernel::V1) => Some(Implementation::SpeedkitCudaV1),
            _ => None,
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
            Implementation::Cpu => "speedkit tiled online-softmax kernel (CPU, tile GEMMs, rayon)",
            Implementation::SpeedkitCuda => {
                "speedkit FlashAttention-2 kernel v2 (stage2_sdpa/kernels/flash_attn_v2.cu, mma.sync tensor cores, S and P in registers)"
            }
            Implementation::SpeedkitCudaV1 => "speedkit FlashAttention-2 kernel v1 (stage2_sdpa/kernels/flash_attn.cu, WMMA tensor cores)",
            Implementation::FlashAttn => "candle-flash-attn (FlashAttention-2, CUDA)",
        }
    }

    /// The head sizes this implementation takes: any on the CPU; 32, 64 or 128 for our CUDA
    /// kernel (one compiled instance each); multiples of 8 up to 512 for candle-flash-attn 0.11.
    pub fn check_head_size(self, d_head: usize) -> Result<(), String> {
        match self {
            Implementation::Cpu => Ok(()),
            Implementation::SpeedkitCuda | Implementation::SpeedkitCudaV1 => attention_cuda::check_head_size(d_head),
            Implementation::FlashAttn if !d_head.is_multiple_of(8) || d_head > 512 => Err(format!(
                "candle-flash-attn supports d_head = C / n_head up to 512 in multiples of 8, and this shape has d_head = {d_head}. \
                 Fix: pick --heads so that C / n_head is one of 64, 128 (the common sizes), or run with --device cpu."
            )),
            Implementation::FlashAttn => Ok(()),
        }
    }
}

/// Which implementation `attention` runs on `device` (short name, for the report and the table).
pub fn implementation(device: &Device) -> &'static str {
    Implementation::on(device).name()
}

/// The head sizes the implementation that runs on `device` takes.
pub fn check_head_size(device: &Device, d_head: usize) -> Result<(), String> {
    Implementation::on(device).check_head_size(d_head)
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
    attention_opts(imp, CpuKernel::Registers, q, k, v, causal)
}

/// `attention_with`, on the CPU through a chosen kernel (`cpu`; CUDA ignores it).
pub fn attention_opts(
    imp: Implementation,
    cpu: CpuKernel,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    causal: bool,
) -> candle_core::Result<Tensor> {
    let d = check_inputs(q, k, v)?;
    if (imp == Implementation::Cpu) == q.device().is_cuda() {
        candle_core::bail!("attention: {} cannot run on {:?}", imp.name(), q.device().location());
    }
    let scale = 1.0 / (d as f32).sqrt();
    // The CUDA kernel the op launches (the CPU kernels ignore it).
    let kernel = if imp == Implementation::SpeedkitCudaV1 { AttentionKernel::V1 } else { AttentionKernel::V2 };
    // While training (q, k or v tracked) the op keeps the forward's log-sum-exp for its backward.
    let tracked = [q, k, v].iter().any(|x| x.track_op());
    let op = FlashAttn { scale, causal, cpu, kernel, lse: tracked.then(|| Mutex::new(None)) };
    match imp {
        Implementation::Cpu => cpu_views(q, k, v, op),
        Implementation::SpeedkitCuda | Implementation::SpeedkitCudaV1 => {
            cpu_kernels::trace::ran(imp.name());
            // Views go in as they are when the kernel can read them in place (stage 2's
            // reshapes, stage 3's slices of the QKV output); anything else is copied first.
            // Both kernels share the layout rules.
            if attention_cuda::kernel_strides(q.layout(), k.layout(), v.layout()).is_some() {
                q.apply_op3(k, v, op)
            } else {
                let (q, k, v) = (q.force_contiguous()?, k.force_contiguous()?, v.force_contiguous()?);
                q.apply_op3(&k, &v, op)
            }
        }
        Implementation::FlashAttn => {
            cpu_kernels::trace::ran(imp.name());
            flash_attn(q, k, v, scale, causal)
        }
    }
}

/// `attention` on CPU tensors through a chosen CPU kernel: the register-blocked one (what
/// `attention` runs), the GEMM-tile one, or their slow twin, the row-wise kernel (benches and
/// tests compare them).
pub fn attention_cpu(kernel: CpuKernel, q: &Tensor, k: &Tensor, v: &Tensor, causal: bool) -> candle_core::Result<Tensor> {
    if q.device().is_cuda() {
        candle_core::bail!("attention: the CPU kernel {kernel:?} cannot run on {:?}", q.device().location());
    }
    attention_opts(Implementation::Cpu, kernel, q, k, v, causal)
}

/// The CPU kernels read q, k and v where they are, through their strides: stage 2's contiguous
/// (B, T, n_head, d_head) tensors and stage 3's views of its (B, T, 3, n_head, d_head) QKV
/// output alike, no copy. Only a view whose d_head elements are not adjacent is copied first.
/// While training (q, k or v tracked) the op keeps the forward's log-sum-exp for its backward.
fn cpu_views(q: &Tensor, k: &Tensor, v: &Tensor, op: FlashAttn) -> candle_core::Result<Tensor> {
    let rows = |x: &Tensor| if x.dim(3).is_ok_and(|d| d == 1) || x.stride()[3] == 1 { Ok(x.clone()) } else { x.contiguous() };
    let tracked = [q, k, v].iter().any(|x| x.track_op());
    let op = FlashAttn { lse: tracked.then(|| Mutex::new(None)), ..op };
    rows(q)?.apply_op3(&rows(k)?, &rows(v)?, op)
}

/// q, k, v share one non-empty (B, T, n_head, d_head) shape and one dtype; returns d_head.
fn check_inputs(q: &Tensor, k: &Tensor, v: &Tensor) -> candle_core::Result<usize> {
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
    Ok(d)
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

/// Both kernels as one candle op (three inputs, one output): candle calls `cpu_fwd` for CPU
/// tensors and `cuda_fwd` for CUDA ones, and `bwd` when a loss is differentiated through it
/// (candle records the op only when q, k or v is tracked, so inference pays nothing).
struct FlashAttn {
    scale: f32,
    causal: bool,
    cpu: CpuKernel, // which CPU kernel `cpu_fwd` runs
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))] // read by cuda_fwd only
    kernel: AttentionKernel, // which CUDA kernel `cuda_fwd` launches
    /// Training (q, k or v tracked): where the forward keeps each row's log-sum-exp
    /// L_i = m_i + ln l_i, (B, n_head, T) f32, for `bwd` to recompute P from; None otherwise,
    /// and for the row-wise kernel, whose backward recomputes L.
    lse: Option<Mutex<Option<Kept>>>,
}

/// The forward's L, where it was written: the CPU kernels' buffer, or the CUDA kernel's (a
/// (B·n_head·T) f32 tensor on the device).
pub(crate) enum Kept {
    Host(Vec<f32>),
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    Device(Tensor),
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
        let (out, shape, lse) =
            attention_cuda::cuda_fwd(self.kernel, self.scale, self.causal, (s1, l1), (s2, l2), (s3, l3), self.lse.is_some())?;
        if let (Some(slot), Some(lse)) = (&self.lse, lse) {
            let dev = s1.device.clone();
            let n = lse.len();
            let l = Tensor::from_storage(
                candle_core::Storage::Cuda(candle_core::CudaStorage::wrap_cuda_slice(lse, dev)),
                n,
                candle_core::op::BackpropOp::none(),
                false,
            );
            *slot.lock().unwrap_or_else(|e| e.into_inner()) = Some(Kept::Device(l));
        }
        Ok((out, shape))
    }

    /// FlashAttention-2's backward (`backward`), from the log-sum-exp the forward kept: tiled on
    /// the CPU, our kernel on CUDA (`kernels/flash_attn_bwd.cu`). dq, dk and dv come back
    /// contiguous in the arguments' shape and dtype; candle carries them on through whatever views
    /// q, k and v were (stage 3's slices of one QKV output).
    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        o: &Tensor,
        d_o: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        // The forward's L, when it kept one (taken: one backward per forward).
        let kept = self.lse.as_ref().and_then(|slot| slot.lock().ok()?.take());
        // The backward multiplies in the forward's precision: bf16 pairs where the forward's
        // register kernel ran them (bf16 inputs, or f32 ones rounded by `RegistersBf16`).
        let bf16 = match self.cpu {
            CpuKernel::RegistersBf16 => true,
            CpuKernel::Registers => q.dtype() == DType::BF16,
            CpuKernel::GemmTiles | CpuKernel::RowAxpy => false,
        };
        let [dq, dk, dv] = match kept {
            #[cfg(feature = "cuda")]
            Some(Kept::Device(lse)) => attention_cuda::cuda_bwd(q, k, v, o, d_o, &lse, self.scale, self.causal)?,
            Some(Kept::Host(lse)) => backward::attention_bwd_with(q, k, v, o, d_o, Some(&lse), self.scale, self.causal, bf16)?,
            _ => backward::attention_bwd_with(q, k, v, o, d_o, None, self.scale, self.causal, bf16)?,
        };
        Ok((Some(dq), Some(dk), Some(dv)))
    }

    /// The engine's CPU kernels (`cpu_kernels::attention`): register-blocked by default, the
    /// row-wise first kernel for the ablation.
    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let op = CpuAttention::new(self.cpu, self.scale, self.causal, self.lse.is_some());
        let out = op.forward((s1, l1), (s2, l2), (s3, l3))?;
        if let (Some(slot), Some(lse)) = (&self.lse, op.take_lse()) {
            *slot.lock().unwrap_or_else(|e| e.into_inner()) = Some(Kept::Host(lse));
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::DType;

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
    fn a_kernel_is_chosen_only_where_ours_runs() {
        let cpu = candle_core::Device::Cpu;
        for k in [AttentionKernel::V1, AttentionKernel::V2] {
            assert_eq!(Implementation::with_kernel(&cpu, k), None);
        }
        assert_eq!(AttentionKernel::default(), AttentionKernel::V2);
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
