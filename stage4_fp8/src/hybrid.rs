//! Training in FP8: TransformerEngine's HYBRID recipe, emulated on the CPU and through
//! cuBLASLt's FP8 GEMMs on CUDA.
//!
//! **Two formats for two jobs.** The forward's operands (weights, activations) are E4M3: 3
//! mantissa bits, range ±448 — values that must be *precise*. The gradients flowing back are
//! E5M2: 2 mantissa bits but f16's exponent range, ±57344, subnormals down to 2⁻¹⁶ — values
//! that must *fit*: a gradient's magnitude swings over many more decades than an activation's
//! across layers and steps, and a saturated or flushed gradient is a wrong update.
//!
//! **The backward GEMMs of y = x·Wᵀ + b.** With dY the upstream gradient (B·T, N):
//! - dX = E5M2(dY) · E4M3(W): the gradient operand in E5M2, the weight as the forward stored it;
//! - dW = E5M2(dY)ᵀ · E4M3(X): the activation as the forward stored it;
//! - db = Σ_rows dY from the unquantised dY (TransformerEngine computes the bias gradient in
//!   high precision, fused into dY's cast).
//!
//! Each FP8 operand carries its per-tensor scale, as in the forward. dY's scale is current
//! (s = amax(dY)·2^margin / 57344, `linear_bwd_hybrid`) or delayed (`DelayedScale`: from the
//! amax of dY over the last backward calls, known before dY is read, as the forward's activation
//! scales are; a dY above it saturates at ±57344·s). Products accumulate in f32.
//!
//! **In a model** (`HybridLinear`): the layer's forward is `Fp8Linear`'s own; the op records
//! (x, W, b) → y with this backward, so `loss.backward()` reaches the f32 master weights and the
//! input through E5M2 gradients. GELU's derivative needs the pre-activation, which the backward
//! recomputes from the stored operands (as stage 3 does on CUDA) rather than keep it.
//!
//! Emulated: every FP8 value is held as s·q in f32 (`round_e5m2`, like `fp8::round_e4m3`),
//! so the numbers are those of an FP8 GEMM with f32 accumulation; the speed is not.
//!
//! **On CUDA** (`linear_bwd_hybrid_fp8`): dY is cast to E5M2 by our kernel, which writes dYᵀ
//! too, and both GEMMs are cuBLASLt's E4M3 × E5M2 (`gemm::fp8_grad_layout` works out why each
//! reads a transposed copy: FP8 takes the "TN" form only). dY's scale state lives in `scale.rs`'s
//! device buffers (`grad_scale_state`), so delayed scaling never reads an amax back to the host.
//! Compiled, not run on a GPU. The same steps run on the CPU, the GEMMs executed by the cuBLASLt
//! model (`gemm::fp8_grad_gemm`), and are tested against the emulation; the GEMMs' arguments,
//! with mutations, in `tests/cublaslt_train.rs`; the kernels under the host emulation.

use crate::fp8::{round_e4m3, Fp8Recipe, ScaleState, ScalingConfig, E4M3_MAX};
use candle_core::{CpuStorage, CustomOp3, DType, Layout, Shape, Tensor};
use stage3_fused::backward::gelu_tanh_grad_ops;
use std::sync::{Arc, Mutex};

/// Largest finite E5M2 value.
pub const E5M2_MAX: f32 = 57344.0;

/// Round an f32 to the nearest E5M2 value (ties to even), saturating at ±57344 (the cast's
/// "satfinite"), NaN kept, and return it as f32. Normals (|y| ≥ 2⁻¹⁴): keep 2 mantissa bits,
/// round-to-nearest-even on the 21 dropped ones. Subnormals: multiples of 2⁻¹⁶ (the 1.5·2²³
/// trick rounds to an integer, ties to even). Slow twin: the float8 crate's `F8E5M2` conversion.
#[inline(always)]
pub fn round_e5m2(y: f32) -> f32 {
    let a = y.abs();
    let bits = a.to_bits();
    let normal = f32::from_bits((bits + 0xF_FFFF + ((bits >> 21) & 1)) & 0xFFE0_0000);
    let sub = ((a * 65536.0 + 12_582_912.0) - 12_582_912.0) * (1.0 / 65536.0);
    let r = if a < 1.0 / 16384.0 { sub } else { normal };
    let r = if r > E5M2_MAX { E5M2_MAX } else { r }; // saturate (NaN compares false and stays NaN)
    let r = if y.is_nan() { y } else { r };
    r.copysign(y)
}

/// The format of one FP8 operand: its largest value and its rounding.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    E4M3,
    E5M2,
}

impl Format {
    fn max(self) -> f32 {
        match self {
            Format::E4M3 => E4M3_MAX,
            Format::E5M2 => E5M2_MAX,
        }
    }

    fn round(self, v: f32) -> f32 {
        match self {
            Format::E4M3 => round_e4m3(v),
            Format::E5M2 => round_e5m2(v),
        }
    }
}

/// x in `format` with a current per-tensor scale s = amax(x)·2^margin / max, held as s·q in f32
/// (same shape, on x's device), and s.
pub fn fake_quantize(x: &Tensor, format: Format, margin: i32) -> candle_core::Result<(Tensor, f32)> {
    fake_quantize_with(x, format, |amax| scale_of(amax, format, margin))
}

/// s = amax·2^margin / max (a tiny positive s for an all-zero tensor, so x / s stays 0).
fn scale_of(amax: f32, format: Format, margin: i32) -> f32 {
    (amax.max(f32::MIN_POSITIVE) * 2f32.powi(margin)) / format.max()
}

/// x in `format` with the scale `scale(amax(x))` picks, as s·q in f32, and s.
fn fake_quantize_with(x: &Tensor, format: Format, scale: impl FnOnce(f32) -> f32) -> candle_core::Result<(Tensor, f32)> {
    let x32 = x.to_dtype(DType::F32)?;
    let v = x32.flatten_all()?.to_vec1::<f32>()?;
    let amax = v.iter().fold(0f32, |m, x| m.max(x.abs()));
    let s = scale(amax);
    let q: Vec<f32> = v.iter().map(|&x| format.round(x / s) * s).collect();
    Ok((Tensor::from_vec(q, x.shape(), x.device())?, s))
}

/// Delayed scaling of a gradient operand, TransformerEngine's for dY: s from the largest amax of
/// the last `len` calls (the first call's own amax fills the history), and this call's amax then
/// joins the history, oldest dropped. Shared by the backward calls of one layer across steps.
#[derive(Debug)]
pub struct DelayedScale {
    history: Mutex<Vec<f32>>, // oldest first, at most `len`
    len: usize,
    margin: i32,
}

impl DelayedScale {
    pub fn new(len: usize, margin: i32) -> DelayedScale {
        DelayedScale { history: Mutex::new(Vec::with_capacity(len)), len: len.max(1), margin }
    }

    /// The E5M2 scale for a call whose operand has amax `amax`; records `amax`.
    pub fn next(&self, amax: f32) -> f32 {
        let mut h = self.history.lock().unwrap_or_else(|e| e.into_inner());
        if h.is_empty() {
            h.push(amax);
        }
        let s = scale_of(h.iter().fold(0f32, |m, a| m.max(*a)), Format::E5M2, self.margin);
        if h.len() == self.len {
            h.remove(0);
        }
        h.push(amax);
        s
    }

    /// The amax history, oldest first (after the first call it holds that call's amax twice:
    /// once as the fill, once as its record).
    pub fn history(&self) -> Vec<f32> {
        self.history.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

/// How dY's E5M2 scale is chosen.
#[derive(Clone, Debug)]
pub enum GradScaling {
    /// This dY's amax·2^margin / 57344.
    Current(i32),
    /// From the history (`DelayedScale`).
    Delayed(Arc<DelayedScale>),
    /// With the FP8 GEMMs: dY's scale state in `scale.rs`'s buffers on dY's device, updated by our
    /// kernels on CUDA (`grad_scale_state`), current or delayed as its config says.
    OnDevice(Arc<Mutex<ScaleState>>),
}

/// dY's scale state on a device for the HYBRID backward on CUDA: `fp8::ScaleState` (the
/// forward's amax, scale and history buffers, and their kernels) with E5M2's rule. E5M2's scale
/// amax·2^margin / 57344 is E4M3's amax·2^(margin − 7) / 448, since 57344 = 448·2⁷: the state
/// runs E4M3's rule with 7 bits less margin.
pub fn grad_scale_state(recipe: Fp8Recipe, history_len: usize, margin: i32) -> Result<ScaleState, String> {
    ScaleState::new(ScalingConfig { recipe, history_len, margin: margin - 7 })
}

/// The backward of y = x·Wᵀ + b in the HYBRID recipe (see the module notes), from the forward's
/// E4M3 operands as s·q in f32 (`xq`: (B, T, K), `wq`: (N, K)) and dY (B, T, N) in any dtype,
/// dY's scale current. Returns (dX (B, T, K), dW (N, K), db (N)), f32.
pub fn linear_bwd_hybrid(xq: &Tensor, wq: &Tensor, dy: &Tensor, margin: i32) -> candle_core::Result<(Tensor, Tensor, Tensor)> {
    linear_bwd_hybrid_scaled(xq, wq, dy, &GradScaling::Current(margin))
}

/// `linear_bwd_hybrid` with dY's scale per `scaling` (current or `Delayed`: emulated on the CPU).
pub fn linear_bwd_hybrid_scaled(
    xq: &Tensor,
    wq: &Tensor,
    dy: &Tensor,
    scaling: &GradScaling,
) -> candle_core::Result<(Tensor, Tensor, Tensor)> {
    let (bsz, t, k) = xq.dims3()?;
    let n = wq.dim(0)?;
    let dy = dy.to_dtype(DType::F32)?.reshape((bsz * t, n))?; // (B·T, N)
    let (dy8, _) = match scaling {
        GradScaling::Current(margin) => fake_quantize(&dy, Format::E5M2, *margin)?,
        GradScaling::Delayed(history) => fake_quantize_with(&dy, Format::E5M2, |amax| history.next(amax))?,
        GradScaling::OnDevice(_) => candle_core::bail!("linear_bwd_hybrid: the device's scale state is for the CUDA backward"),
    };
    let dx = dy8.matmul(wq)?.reshape((bsz, t, k))?; // (B·T, N)·(N, K)
    let dw = dy8.t()?.matmul(&xq.reshape((bsz * t, k))?)?; // (N, B·T)·(B·T, K)
    Ok((dx, dw, dy.sum(0)?))
}

/// (q, qᵀ): E5M2(x / s) (rows, cols) and its transpose (cols, rows) as E5M2 codes in u8 tensors
/// (candle has no E5M2 dtype), on x's device. x: (rows, cols) f32 or bf16; s: one f32. On CUDA
/// one kernel (`kernels/fp8.cu`, `quant_cuda::quantize_e5m2_transpose`); on the CPU the same in
/// host code (x / s, then the float8 crate's saturating cast, which `round_e5m2` matches bit for
/// bit, as the kernel's cast does under the host emulation).
pub fn quantize_e5m2_transpose(x: &Tensor, scale: &Tensor) -> candle_core::Result<(Tensor, Tensor)> {
    #[cfg(feature = "cuda")]
    if x.device().is_cuda() {
        return crate::quant_cuda::quantize_e5m2_transpose(x, scale, None);
    }
    let (rows, cols) = x.dims2()?;
    let s = scale.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?[0];
    let v = x.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
    let q: Vec<u8> = v.iter().map(|x| float8::F8E5M2::from_f32(x / s).to_bits()).collect();
    let q = Tensor::from_vec(q, (rows, cols), x.device())?;
    let qt = q.t()?.contiguous()?;
    Ok((q, qt))
}

/// qᵀ (cols, rows) of FP8 codes q (rows, cols), E4M3 or E5M2 in u8, on q's device: on CUDA our
/// tiled kernel (`quant_cuda::transpose_fp8`), on the CPU candle's copy.
pub fn transpose_fp8(q: &Tensor) -> candle_core::Result<Tensor> {
    #[cfg(feature = "cuda")]
    if q.device().is_cuda() {
        return crate::quant_cuda::transpose_fp8(q);
    }
    q.t()?.contiguous()
}

/// The HYBRID backward through the FP8 GEMMs (cuBLASLt's on CUDA): q_x (B, T, K) and W_q (N, K)
/// the forward's E4M3 codes with their scales s_x and s_w (one f32 each), dY (B, T, N) f32 or
/// bf16, its E5M2 scale from `state` (`grad_scale_state`). dY is cast to E5M2 with its transpose
/// in one pass, W_q and q_x transposed (`kernels/fp8.cu` on CUDA), and the two GEMMs read what
/// `gemm::fp8_grad_args` says: dX = dY·W (Wᵀ × dY) and dW = dYᵀ·X (Xᵀ × dYᵀ), E4M3 × E5M2, TN
/// (`gemm::fp8_grad_gemm`; where cuBLASLt offers no algorithm for one, its fallback on the same
/// values, recorded in `fallbacks`). db = Σ_rows dY in f32 from the unquantised dY. Returns (dX (B, T, K)
/// bf16, dW (N, K) f32, db (N) f32). On CUDA compiled, not run on a GPU; on the CPU the same
/// steps run, the GEMMs executed by the cuBLASLt model, and are tested against the emulation.
pub fn linear_bwd_hybrid_fp8(
    (xq, x_scale): (&Tensor, &Tensor),
    (wq, w_scale): (&Tensor, &Tensor),
    dy: &Tensor,
    state: &Mutex<ScaleState>,
    fallbacks: &GradFallbacks,
) -> candle_core::Result<(Tensor, Tensor, Tensor)> {
    use crate::gemm::{fp8_grad_args, fp8_grad_gemm, fp8_grad_gemm_fallback, Fp8Grad, Fp8Operand, ScaleOf};
    let (bsz, t, k) = xq.dims3()?;
    let n = wq.dim(0)?;
    let m = bsz * t;
    let dy = match dy.dtype() {
        DType::F32 | DType::BF16 => dy.reshape((m, n))?, // (B·T, N): what the cast kernel reads
        _ => dy.to_dtype(DType::F32)?.reshape((m, n))?,
    };
    let s_dy = state.lock().map_err(|_| candle_core::Error::Msg("dY's scale state poisoned".into()))?.scale_for(&dy)?;
    let (g, gt) = quantize_e5m2_transpose(&dy, &s_dy)?; // dY (M, N), dYᵀ (N, M): E5M2 codes
    let (wt, xt) = (transpose_fp8(wq)?, transpose_fp8(&xq.reshape((m, k))?)?); // Wᵀ (K, N), Xᵀ (K, M): E4M3
    let operand = |op: Fp8Operand| match op {
        Fp8Operand::WeightT => &wt,
        Fp8Operand::InputT => &xt,
        Fp8Operand::Grad => &g,
        Fp8Operand::GradT => &gt,
    };
    let scale = |s: ScaleOf| match s {
        ScaleOf::Weight => w_scale,
        ScaleOf::Input => x_scale,
        ScaleOf::Grad => &s_dy,
    };
    let gemm = |grad: Fp8Grad| -> candle_core::Result<Tensor> {
        let args = fp8_grad_args(grad, m, k, n).map_err(candle_core::Error::Msg)?;
        let (a, b, sa, sb) = (operand(args.a), operand(args.b), scale(args.a.scale()), scale(args.b.scale()));
        match !fallbacks.always && grad_gemm_supported(xq.device(), grad, m, k, n)? {
            true => fp8_grad_gemm(&args, a, b, sa, sb),
            false => {
                fallbacks.record(grad);
                fp8_grad_gemm_fallback(&args, a, b, sa, sb)
            }
        }
    };
    let dx = gemm(Fp8Grad::Data)?.reshape((bsz, t, k))?; // (M, K) bf16
    let dw = gemm(Fp8Grad::Weight)?; // (N, K) f32
    Ok((dx, dw, dy.to_dtype(DType::F32)?.sum(0)?))
}

/// Whether `fp8_grad_gemm` can run the backward GEMM `grad` on `device`: on CUDA whether cuBLASLt
/// offers an algorithm (`cuda::has_grad_algorithm`, asked once per shape: its plans are kept);
/// on the CPU always (the cuBLASLt model executes it).
fn grad_gemm_supported(
    device: &candle_core::Device,
    grad: crate::gemm::Fp8Grad,
    m: usize,
    k: usize,
    n: usize,
) -> candle_core::Result<bool> {
    #[cfg(feature = "cuda")]
    if let Ok(dev) = device.as_cuda_device() {
        return crate::cuda::has_grad_algorithm(dev, grad, m, k, n);
    }
    let _ = (device, grad, m, k, n);
    Ok(true)
}

/// The backward GEMMs that ran on their fallback (`gemm::fp8_grad_gemm_fallback`: cuBLASLt had
/// no E4M3 × E5M2 algorithm for them), shared by a block's layers so its row's notes say so.
#[derive(Clone, Debug, Default)]
pub struct GradFallbacks {
    ran: Arc<Mutex<std::collections::BTreeSet<crate::gemm::Fp8Grad>>>,
    always: bool,
}

impl GradFallbacks {
    /// Every backward GEMM on its fallback, as where cuBLASLt offers none: the fallback's own
    /// tests and selftest rows, on any device.
    pub fn always() -> GradFallbacks {
        GradFallbacks { always: true, ..GradFallbacks::default() }
    }

    fn record(&self, grad: crate::gemm::Fp8Grad) {
        self.ran.lock().unwrap_or_else(|e| e.into_inner()).insert(grad);
    }

    /// The GEMMs that fell back so far, data gradient first.
    pub fn ran(&self) -> Vec<crate::gemm::Fp8Grad> {
        self.ran.lock().unwrap_or_else(|e| e.into_inner()).iter().copied().collect()
    }
}

/// The forward's operands, as the HYBRID backward reads them.
#[derive(Clone, Debug)]
pub enum Operands {
    /// Emulated: s_x·q_x (B, T, K) and s_w·q_w (N, K) in f32.
    Emulated { xq: Tensor, wq: Tensor },
    /// Through the FP8 GEMMs (cuBLASLt's on CUDA): q_x (B, T, K) and W_q (N, K) as the forward's
    /// E4M3 codes, with their scales s_x and s_w (one f32 each, on the operands' device).
    Fp8 { xq: Tensor, x_scale: Tensor, wq: Tensor, w_scale: Tensor },
}

/// y = act(x·Wᵀ + b) as a differentiable op: `y` is the FP8 layer's forward output, computed by
/// `Fp8Linear` from its operands (`Operands`), which `apply` hands to candle as the op's result
/// so that candle records (x, W, b) → y; the backward is the HYBRID recipe's, through GELU's
/// derivative when `gelu`: emulated (`linear_bwd_hybrid_scaled`, CPU), or through the FP8 GEMMs
/// (`linear_bwd_hybrid_fp8`: cuBLASLt's on CUDA).
pub struct HybridLinear {
    pub y: Tensor, // (B, T, N): the FP8 forward's output
    pub operands: Operands,
    pub gelu: bool,
    pub scaling: GradScaling, // dY's E5M2 scale
    /// Where the FP8 path records a backward GEMM that ran on its fallback.
    pub fallbacks: GradFallbacks,
}

impl HybridLinear {
    /// y, recorded as a function of x (B, T, K), W (N, K) and b (N): the tracked tensors the
    /// gradients go to, each in its own dtype (the f32 master weights, x in the activation dtype).
    pub fn apply(self, x: &Tensor, w: &Tensor, b: &Tensor) -> candle_core::Result<Tensor> {
        let (bsz, t, k) = x.dims3()?;
        let n = w.dim(0)?;
        let (xq, wq) = match &self.operands {
            Operands::Emulated { xq, wq } | Operands::Fp8 { xq, wq, .. } => (xq, wq),
        };
        let y = &self.y;
        if y.dims() != [bsz, t, n] || xq.dims() != x.dims() || wq.dims() != w.dims() || w.dim(1)? != k || b.dims() != [n] {
            candle_core::bail!(
                "HybridLinear: x {:?}, W {:?}, b {:?}, y {:?}, xq {:?}, wq {:?} do not fit y = act(x Wᵀ + b)",
                x.dims(),
                w.dims(),
                b.dims(),
                y.dims(),
                xq.dims(),
                wq.dims()
            );
        }
        // The op's forward hands candle a copy of y's storage, which must start at its offset 0.
        let y = if y.layout().start_offset() == 0 { y.contiguous()? } else { y.copy()? };
        let op = HybridLinear { y, ..self };
        x.apply_op3(w, b, op)
    }
}

impl CustomOp3 for HybridLinear {
    fn name(&self) -> &'static str {
        "speedkit-fp8-hybrid-linear"
    }

    /// The forward already ran (`Fp8Linear`, which advanced its input's delayed scale): its
    /// output, as candle's storage of this op.
    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let y = self.y.flatten_all()?;
        let storage = match y.dtype() {
            DType::F32 => CpuStorage::F32(y.to_vec1()?),
            DType::BF16 => CpuStorage::BF16(y.to_vec1()?),
            DType::F16 => CpuStorage::F16(y.to_vec1()?),
            dt => candle_core::bail!("HybridLinear: y in {dt:?}; f32, bf16 or f16 expected"),
        };
        Ok((storage, self.y.shape().clone()))
    }

    /// The same on CUDA: a copy of y's storage (contiguous from offset 0: `apply`).
    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        _: &candle_core::CudaStorage,
        _: &Layout,
        _: &candle_core::CudaStorage,
        _: &Layout,
        _: &candle_core::CudaStorage,
        _: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        use candle_core::backend::BackendStorage;
        let (s, l) = self.y.storage_and_layout();
        let candle_core::Storage::Cuda(s) = &*s else { candle_core::bail!("HybridLinear: y is not on the GPU") };
        Ok((s.try_clone(l)?, self.y.shape().clone()))
    }

    /// dZ = dY ∘ GELU'(z) (z = x·Wᵀ + b recomputed from the stored operands: in f32 when
    /// emulated, by the forward's FP8 GEMM without GELU on CUDA) when the layer has GELU, then
    /// the HYBRID GEMMs on dZ; each gradient in its argument's dtype.
    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        b: &Tensor,
        _y: &Tensor,
        dy: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (dx, dw, db) = match &self.operands {
            Operands::Emulated { xq, wq } => {
                if !dy.device().is_cpu() {
                    candle_core::bail!("HybridLinear: the emulated HYBRID backward runs on the CPU only");
                }
                let dz = match self.gelu {
                    false => dy.to_dtype(DType::F32)?,
                    true => {
                        let (bsz, t, k) = xq.dims3()?;
                        let z = xq.reshape((bsz * t, k))?.matmul(&wq.t()?)?.broadcast_add(&b.to_dtype(DType::F32)?)?; // (B·T, N)
                        (dy.to_dtype(DType::F32)? * gelu_tanh_grad_ops(&z)?.reshape(dy.shape())?)?
                    }
                };
                linear_bwd_hybrid_scaled(xq, wq, &dz, &self.scaling)?
            }
            Operands::Fp8 { xq, x_scale, wq, w_scale } => self.bwd_fp8((xq, x_scale), (wq, w_scale), b, dy)?,
        };
        Ok((Some(dx.to_dtype(x.dtype())?), Some(dw.to_dtype(w.dtype())?), Some(db.to_dtype(b.dtype())?)))
    }
}

impl HybridLinear {
    /// The backward through the FP8 GEMMs (`Operands::Fp8`): dZ (GELU's derivative at z,
    /// recomputed by the FP8 GEMM with the bias epilogue alone, as the forward computed it before
    /// GELU), then `linear_bwd_hybrid_fp8` with dY's scale state (`GradScaling::OnDevice`).
    fn bwd_fp8(
        &self,
        x: (&Tensor, &Tensor),
        w: (&Tensor, &Tensor),
        b: &Tensor,
        dy: &Tensor,
    ) -> candle_core::Result<(Tensor, Tensor, Tensor)> {
        let GradScaling::OnDevice(state) = &self.scaling else {
            candle_core::bail!("HybridLinear: the FP8 backward keeps dY's scale state with the operands (GradScaling::OnDevice)")
        };
        let dz = match self.gelu {
            false => dy.clone(),
            true => {
                let z = crate::gemm::Fp8Gemm::new(x.1, w.1, b, false)?.with_fast_accum(false).forward(x.0, w.0)?; // (B, T, N) bf16
                (dy.to_dtype(DType::F32)? * gelu_tanh_grad_ops(&z.to_dtype(DType::F32)?)?)?
            }
        };
        linear_bwd_hybrid_fp8(x, w, &dz, state, &self.fallbacks)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// GELU's derivative as HYBRID's backward takes it (stage 3's `gelu_tanh_grad_ops`) against
    /// candle's autograd of stage 0's GELU: within f32 rounding (its σ(2u) form rounds otherwise
    /// than autograd's tanh; measured 1.7e-6).
    #[test]
    fn gelu_grad_matches_autograd() {
        let z = candle_core::Var::from_tensor(&randn(&[4, 33], 7, 3.0)).unwrap();
        let g = stage0_baseline::gelu_tanh(z.as_tensor()).unwrap().sum_all().unwrap().backward().unwrap();
        let want = g.get(z.as_tensor()).unwrap();
        let e = rel(&gelu_tanh_grad_ops(z.as_tensor()).unwrap(), want);
        assert!(e < 1e-5, "{e}");
    }

    /// `HybridLinear`'s gradients against candle's autograd of act(xq·wqᵀ + b) on the same
    /// E4M3-stored operands: dX and dW off by E5M2's rounding of dZ only, db exact up to f32
    /// sums (it is taken from the unquantised dZ); with and without GELU; delayed dY scaling keeps
    /// its history across calls and saturates a dY beyond it.
    #[test]
    fn hybrid_linear_is_the_autograd_of_its_forward_up_to_e5m2() {
        use candle_core::Var;
        let (bsz, t, k, n) = (2, 9, 24, 40);
        let (x, w, b, r) = (randn(&[bsz, t, k], 1, 1.0), randn(&[n, k], 2, 0.2), randn(&[n], 3, 0.1), randn(&[bsz, t, n], 4, 1.0));
        let (xq, _) = fake_quantize(&x, Format::E4M3, 0).unwrap();
        let (wq, _) = fake_quantize(&w, Format::E4M3, 0).unwrap();
        for gelu in [false, true] {
            let act = |z: Tensor| if gelu { stage0_baseline::gelu_tanh(&z) } else { Ok(z) };
            let plain = |xq: &Tensor, wq: &Tensor, b: &Tensor| {
                act(xq.reshape((bsz * t, k))?.matmul(&wq.t()?)?.broadcast_add(b)?)?.reshape((bsz, t, n))
            };
            // Candle's autograd of the forward on the stored operands, and ours with y from it.
            let grads = |x0: &Tensor, w0: &Tensor, f: &dyn Fn(&Tensor, &Tensor, &Tensor) -> candle_core::Result<Tensor>| {
                let (xv, wv, bv) = (Var::from_tensor(x0).unwrap(), Var::from_tensor(w0).unwrap(), Var::from_tensor(&b).unwrap());
                let y = f(xv.as_tensor(), wv.as_tensor(), bv.as_tensor()).unwrap();
                let g = (y * &r).unwrap().sum_all().unwrap().backward().unwrap();
                [&xv, &wv, &bv].map(|v| g.get(v.as_tensor()).unwrap().clone())
            };
            let want = grads(&xq, &wq, &|x, w, b| plain(x, w, b));
            let y = plain(&xq, &wq, &b).unwrap();
            let saved = || HybridLinear {
                y: y.clone(),
                operands: Operands::Emulated { xq: xq.clone(), wq: wq.clone() },
                gelu,
                scaling: GradScaling::Current(0),
                fallbacks: GradFallbacks::default(),
            };
            let ours = grads(&x, &w, &|x, w, b| saved().apply(x, w, b));
            let [ex, ew, eb] = [0, 1, 2].map(|i| rel(&ours[i], &want[i]));
            eprintln!("HybridLinear (gelu {gelu}) vs autograd: dX {ex:.2e}, dW {ew:.2e}, db {eb:.2e}");
            assert!(ex < 0.1 && ew < 0.1 && ex > 0.0, "dX {ex}, dW {ew}");
            assert!(eb < 1e-5, "db {eb}");
        }
        // Delayed: the first call scales from its own amax; a later dY beyond the history's
        // largest amax saturates at 57344·s. With X = 1, dW's rows are dY's E5M2 values.
        let d = Arc::new(DelayedScale::new(4, 0));
        assert_eq!((d.next(1.0), d.history()), (1.0 / E5M2_MAX, vec![1.0, 1.0]));
        let ones = Tensor::ones((1, 1, 3), DType::F32, &Device::Cpu).unwrap();
        let dy8 = |dy: [f32; 2]| {
            let dy = Tensor::new(&[[dy]], &Device::Cpu).unwrap();
            let (_, dw, db) = linear_bwd_hybrid_scaled(
                &ones,
                &Tensor::ones((2, 3), DType::F32, &Device::Cpu).unwrap(),
                &dy,
                &GradScaling::Delayed(d.clone()),
            )
            .unwrap();
            assert_eq!(db.to_vec1::<f32>().unwrap(), dy.flatten_all().unwrap().to_vec1::<f32>().unwrap(), "db from the unquantised dY");
            dw.to_vec2::<f32>().unwrap().iter().map(|row| row[0]).collect::<Vec<_>>()
        };
        assert_eq!(dy8([4.0, -2.0]), [1.0, -1.0], "s from the history's 1: both saturate at ±57344·s = ±1");
        assert_eq!(dy8([4.0, -2.0]), [4.0, -2.0], "s from the 4 the call before recorded: both fit");
        assert_eq!(d.history(), vec![1.0, 1.0, 4.0, 4.0]);
        assert_eq!(dy8([16.0, -2.0]), [4.0, -2.0], "16 saturates at the history's 4");
        assert_eq!(d.history(), vec![1.0, 4.0, 4.0, 16.0], "oldest dropped");
    }

    /// Every f32 that is a boundary case (powers of two around E5M2's range, ties between
    /// neighbours, subnormals, the saturation threshold) and a sweep of ordinary values: bit for
    /// bit the float8 crate's conversion (which saturates, like ours).
    #[test]
    fn round_e5m2_matches_the_float8_crate() {
        let mut values = vec![0.0, -0.0, 1.0, 1.25, 1.125, 1.375, 1.625, 1.875, 57344.0, 57343.0, 61440.0, 61439.0, 1e9, f32::MAX];
        for e in -20..17 {
            let p = 2f32.powi(e);
            values.extend([p, p * 1.125, p * 1.375, p * 1.0625, p * 0.75, p * 0.625]);
        }
        let mut seed = 0x2545_f491_u32;
        for _ in 0..200_000 {
            seed ^= seed << 13;
            seed ^= seed >> 17;
            seed ^= seed << 5;
            let f = f32::from_bits(seed);
            if f.is_finite() {
                values.push(f);
            }
        }
        for &v in &values {
            for v in [v, -v] {
                let want = float8::F8E5M2::from_f32(v).to_f32();
                assert_eq!(round_e5m2(v).to_bits(), want.to_bits(), "{v:e}: ours {:e}, float8 {want:e}", round_e5m2(v));
            }
        }
        assert!(round_e5m2(f32::NAN).is_nan());
    }

    fn randn(dims: &[usize], seed: u64, std: f32) -> Tensor {
        let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        let n: usize = dims.iter().product();
        let v: Vec<f32> = (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 3.46 * std
            })
            .collect();
        Tensor::from_vec(v, dims, &Device::Cpu).unwrap()
    }

    fn rel(a: &Tensor, b: &Tensor) -> f32 {
        let d = (a - b).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
        d / b.abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap()
    }

    /// The hybrid backward against the f32 backward of the same (E4M3-stored) operands: off by
    /// E5M2's rounding of dY only, so within a few of its half-ulps (2⁻³) relative to the largest
    /// gradient, and db exact; and a gradient 10⁷ times smaller than the largest, which E4M3 at
    /// the same scale rule flushes, keeps its size.
    #[test]
    fn the_hybrid_backward_is_the_f32_backward_up_to_e5m2_rounding() {
        for (bsz, t, k, n, seed) in [(2, 13, 24, 40, 1u64), (1, 37, 77, 130, 2), (3, 1, 16, 8, 3)] {
            let (x, w, dy) = (randn(&[bsz, t, k], seed, 1.0), randn(&[n, k], seed + 1, 0.2), randn(&[bsz, t, n], seed + 2, 1e-3));
            let (xq, _) = fake_quantize(&x, Format::E4M3, 0).unwrap();
            let (wq, _) = fake_quantize(&w, Format::E4M3, 0).unwrap();
            let (dx, dw, db) = linear_bwd_hybrid(&xq, &wq, &dy, 0).unwrap();
            let dy2 = dy.reshape((bsz * t, n)).unwrap();
            let dx_f32 = dy2.matmul(&wq).unwrap().reshape((bsz, t, k)).unwrap();
            let dw_f32 = dy2.t().unwrap().matmul(&xq.reshape((bsz * t, k)).unwrap()).unwrap();
            let (ex, ew) = (rel(&dx, &dx_f32), rel(&dw, &dw_f32));
            assert!(ex < 0.1 && ew < 0.1, "({bsz}, {t}, {k} → {n}): dX {ex:.2e}, dW {ew:.2e}");
            assert!(ex > 0.0 && ew > 0.0, "the gradient operand was really rounded to E5M2");
            eprintln!("hybrid backward vs f32, ({bsz}, {t}, {k} → {n}): dX {ex:.2e}, dW {ew:.2e}");
            assert_eq!(db.to_vec1::<f32>().unwrap(), dy2.sum(0).unwrap().to_vec1::<f32>().unwrap());
        }
        // One entry 10⁷ times smaller than the largest: E5M2's range keeps it (to its 2 mantissa
        // bits), E4M3's flushes it to 0.
        let dy = Tensor::new(&[[1.0f32, 1e-7]], &Device::Cpu).unwrap();
        let (e5, _) = fake_quantize(&dy, Format::E5M2, 0).unwrap();
        let (e4, _) = fake_quantize(&dy, Format::E4M3, 0).unwrap();
        let (small5, small4) = (e5.to_vec2::<f32>().unwrap()[0][1], e4.to_vec2::<f32>().unwrap()[0][1]);
        assert!((small5 - 1e-7).abs() < 1.3e-8 && small4 == 0.0, "E5M2 {small5:e}, E4M3 {small4:e}");
    }

    /// dY's scale state for the FP8 path (`grad_scale_state`: E4M3's rule with 7 bits less
    /// margin, in `scale.rs`'s ops) gives the emulation's E5M2 scales (`DelayedScale`, and the
    /// current rule amax / 57344) over a run of calls whose amax jumps up and down, within an
    /// f32 ulp (the two multiply and divide in another order), margins 0 and 2.
    #[test]
    fn the_device_scale_state_is_the_e5m2_rule() {
        for margin in [0, 2] {
            let delayed = DelayedScale::new(3, margin);
            let mut state = grad_scale_state(Fp8Recipe::Delayed, 3, margin).unwrap();
            let mut current = grad_scale_state(Fp8Recipe::Current, 1, margin).unwrap();
            for (call, a) in [1e-3f32, 4e-3, 5e-4, 2e-2, 1e-4, 1e-4].into_iter().enumerate() {
                let dy = Tensor::new(&[a, -a / 3.0, 0.0], &Device::Cpu).unwrap();
                let got = state.scale_for(&dy).unwrap().to_scalar::<f32>().unwrap();
                let want = delayed.next(a);
                assert!((got - want).abs() <= want * 2.5e-7, "delayed, margin {margin}, call {call}: {got:e} vs {want:e}");
                let got = current.scale_for(&dy).unwrap().to_scalar::<f32>().unwrap();
                let want = scale_of(a, Format::E5M2, margin);
                assert!((got - want).abs() <= want * 2.5e-7, "current, margin {margin}, call {call}: {got:e} vs {want:e}");
            }
            assert_eq!(state.history().unwrap(), [2e-2, 1e-4, 1e-4], "the last three dY amaxes");
        }
    }

    /// The FP8 path's backward (`Operands::Fp8`: the E4M3 codes and scales, dY cast to E5M2 with
    /// its transpose, the transposed copies, the two GEMMs through `gemm::fp8_grad_gemm`, GELU's
    /// z recomputed by the FP8 GEMM; on the CPU the GEMMs are the cuBLASLt model) through
    /// candle's autograd, against the emulated backward on the same operands, current and delayed
    /// dY scales (two steps, the second's scale from the first's history). Max |Δ| / max |g|:
    /// - without GELU, against `Operands::Emulated`: dX 1e-2 (stored bf16 on the FP8 path, 2⁻⁹;
    ///   measured 2.6e-3), dW 1e-5 and db 1e-6 (f32 sums in another order; measured 2.5e-7, 0);
    /// - with GELU the FP8 path's z is the FP8 GEMM's output (bf16 bias, bf16 store), the
    ///   emulation's f32, so against `Operands::Emulated` only 5e-2 (measured 3.2e-2: gelu′ moves
    ///   by ~1e-3 and a dZ near a
    ///   rounding boundary lands on the neighbouring E5M2 code, 2⁻³ away), and tightly against the
    ///   emulated GEMMs on dZ = dY ∘ gelu′(z) with z as the FP8 GEMM computes it (bf16 bias, bf16
    ///   store): the tolerances without GELU, db 1e-5 (Σ dZ of f32 products).
    ///
    /// The same for the fallback (every GEMM through `gemm::fp8_grad_gemm_fallback`, as where
    /// cuBLASLt offers no algorithm), which must record both GEMMs. A wrong operand, transpose
    /// or scale is O(1).
    #[test]
    fn the_fp8_backward_matches_the_emulated_one() {
        use crate::fp8::{dequantize, quantize, scale_from_amax};
        use candle_core::Var;
        for (bsz, t, k, n, seed) in [(2, 16, 48, 64, 1u64), (1, 32, 16, 16, 2)] {
            let (x, w, b) = (randn(&[bsz, t, k], seed, 1.0), randn(&[n, k], seed + 1, 0.2), randn(&[n], seed + 2, 0.1));
            let (sx, sw) =
                (scale_from_amax(&crate::fp8::amax(&x).unwrap(), 0).unwrap(), scale_from_amax(&crate::fp8::amax(&w).unwrap(), 0).unwrap());
            let (xq8, wq8) = (quantize(&x, &sx).unwrap(), quantize(&w, &sw).unwrap()); // E4M3 codes
            let (xq, wq) = (dequantize(&xq8, &sx, DType::F32).unwrap(), dequantize(&wq8, &sw, DType::F32).unwrap()); // s·q
            for (gelu, recipe) in
                [(false, Fp8Recipe::Current), (true, Fp8Recipe::Current), (false, Fp8Recipe::Delayed), (true, Fp8Recipe::Delayed)]
            {
                let y = {
                    let z = xq.reshape((bsz * t, k)).unwrap().matmul(&wq.t().unwrap()).unwrap().broadcast_add(&b).unwrap();
                    let z = if gelu { stage0_baseline::gelu_tanh(&z).unwrap() } else { z };
                    z.reshape((bsz, t, n)).unwrap()
                };
                let emulated = match recipe {
                    Fp8Recipe::Current => GradScaling::Current(0),
                    Fp8Recipe::Delayed => GradScaling::Delayed(Arc::new(DelayedScale::new(4, 0))),
                };
                let fp8 = GradScaling::OnDevice(Arc::new(Mutex::new(grad_scale_state(recipe, 4, 0).unwrap())));
                // The fallback (`GradFallbacks::always`) with its own scale state: the same steps.
                let fp8_fallback = GradScaling::OnDevice(Arc::new(Mutex::new(grad_scale_state(recipe, 4, 0).unwrap())));
                let grads = |operands: &Operands, scaling: &GradScaling, fallbacks: &GradFallbacks, r: &Tensor| {
                    let (xv, wv, bv) = (Var::from_tensor(&x).unwrap(), Var::from_tensor(&w).unwrap(), Var::from_tensor(&b).unwrap());
                    let op = HybridLinear {
                        y: y.clone(),
                        operands: operands.clone(),
                        gelu,
                        scaling: scaling.clone(),
                        fallbacks: fallbacks.clone(),
                    };
                    let out = op.apply(xv.as_tensor(), wv.as_tensor(), bv.as_tensor()).unwrap();
                    let g = (out * r).unwrap().sum_all().unwrap().backward().unwrap();
                    [&xv, &wv, &bv].map(|v| g.get(v.as_tensor()).unwrap().to_dtype(DType::F32).unwrap())
                };
                let ops_fp8 = Operands::Fp8 { xq: xq8.clone(), x_scale: sx.clone(), wq: wq8.clone(), w_scale: sw.clone() };
                let ops_emu = Operands::Emulated { xq: xq.clone(), wq: wq.clone() };
                // The emulated GEMMs on dZ from the bf16 z, with a scale state of their own.
                let tight = match recipe {
                    Fp8Recipe::Current => GradScaling::Current(0),
                    Fp8Recipe::Delayed => GradScaling::Delayed(Arc::new(DelayedScale::new(4, 0))),
                };
                let z16 = xq
                    .reshape((bsz * t, k))
                    .unwrap()
                    .matmul(&wq.t().unwrap())
                    .unwrap()
                    .broadcast_add(&b.to_dtype(DType::BF16).unwrap().to_dtype(DType::F32).unwrap()) // the bias as the epilogue reads it
                    .unwrap()
                    .to_dtype(DType::BF16)
                    .unwrap()
                    .to_dtype(DType::F32)
                    .unwrap()
                    .reshape((bsz, t, n))
                    .unwrap();
                // two steps: the second's delayed scale is the first's (larger) dY amax
                for (step, r_scale) in [(0, 4e-3f32), (1, 1e-3)] {
                    let r = randn(&[bsz, t, n], seed + 10 + step, r_scale);
                    let (none, all) = (GradFallbacks::default(), GradFallbacks::always());
                    let want = grads(&ops_emu, &emulated, &none, &r);
                    let got = grads(&ops_fp8, &fp8, &none, &r);
                    assert!(none.ran().is_empty(), "the CPU runs every FP8 GEMM (the model): no fallback");
                    let fell_back = grads(&ops_fp8, &fp8_fallback, &all, &r);
                    assert_eq!(all.ran(), [crate::gemm::Fp8Grad::Data, crate::gemm::Fp8Grad::Weight], "recorded");
                    let [ex, ew, eb] = [0, 1, 2].map(|i| rel(&got[i], &want[i]));
                    let [fx, fw, fb] = [0, 1, 2].map(|i| rel(&fell_back[i], &want[i]));
                    let what = format!(
                        "({bsz}, {t}, {k} → {n}) gelu {gelu} {recipe:?} step {step}: dX {ex:.2e}, dW {ew:.2e}, db {eb:.2e}; \
                         fallback dX {fx:.2e}, dW {fw:.2e}, db {fb:.2e}"
                    );
                    eprintln!("FP8 path vs emulated backward, {what}");
                    let (tx, tw, tb) = if gelu { (5e-2, 5e-2, 5e-2) } else { (1e-2, 1e-5, 1e-6) };
                    assert!(ex < tx && ew < tw && eb < tb && fx < tx && fw < tw && fb < tb, "{what}");
                    assert_eq!(got[0].dims(), x.dims(), "{what}");
                    if gelu {
                        let dz = (&r * gelu_tanh_grad_ops(&z16).unwrap()).unwrap();
                        let (dx, dw, db) = linear_bwd_hybrid_scaled(&xq, &wq, &dz, &tight).unwrap();
                        for (path, got) in [("FP8 path", &got), ("fallback", &fell_back)] {
                            let [ex, ew, eb] = [(0, &dx), (1, &dw), (2, &db)].map(|(i, w)| rel(&got[i], w));
                            let what =
                                format!("{what}; {path} against the emulated GEMMs on the bf16 z: dX {ex:.2e}, dW {ew:.2e}, db {eb:.2e}");
                            eprintln!("FP8 path vs emulated backward, {what}");
                            assert!(ex < 1e-2 && ew < 1e-5 && eb < 1e-5, "{what}");
                        }
                    }
                }
            }
        }
    }
}
