//! FP8 E4M3 with per-tensor scaling: the number format, the quantiser, the two scaling recipes,
//! and `Fp8Linear` — a linear layer you can lift into your own candle model.
//!
//! **E4M3** (1 sign, 4 exponent, 3 mantissa bits): largest finite ±448, smallest normal 2⁻⁶,
//! smallest subnormal 2⁻⁹, no infinities. Its sibling E5M2 trades a mantissa bit for range
//! (±57344) and is what gradients use; forward activations and weights need the precision more
//! than the range, so the forward pass is E4M3 throughout (TransformerEngine's "HYBRID" recipe).
//!
//! **Per-tensor scale** (cuBLASLt's convention): a tensor x is stored as q = sat(x / s) in E4M3
//! and stands for s·q. s is the *dequantisation* factor, s = amax · 2^margin / 448, so the
//! largest |x| lands at 448 / 2^margin: the format's whole range is used whatever x's magnitude
//! (activations of 1e-2 would otherwise sit in E4M3's subnormals, weights of 1e3 would saturate).
//! The GEMM takes s_x and s_w and computes y = s_x·s_w·(q_x q_wᵀ) with f32 accumulation.
//!
//! **Recipes** for an activation's scale (`--fp8-recipe`):
//! - `current`: s from this very tensor's amax — one extra reduction over x before the cast.
//! - `delayed` (TransformerEngine's default): s from the largest amax of the last `history_len`
//!   calls; this call's amax only joins the history. A fused cast kernel can then quantise and
//!   take the amax in one pass, since s is known before x is read. The price: a tensor whose
//!   amax jumps above the history's saturates at ±448 until the history catches up. The first
//!   call has no history and uses current scaling.
//!
//! On the CPU the quantiser is one parallel pass (`quantize_dequantize_cpu`, bit-identical to
//! candle's F8E4M3 cast). On CUDA it is our own kernels (`kernels/fp8.cu` via `quant_cuda`):
//! candle 0.11.1's CUDA F8 casts cannot be loaded (huggingface/candle#3886), so none is called.
//! There, delayed scaling takes its amax in the cast's own pass (the scale is known before x
//! is read). The scale state is one set of buffers on the input's device, updated in place by
//! candle in-place ops (`scale`), the same ops on the CPU and CUDA: no host round trip and no
//! allocation after the first call, so a CUDA graph captures the update.
//!
//! **Fused producers.** With delayed scaling the scale is known before x exists, so x's producer
//! can write it in E4M3 itself (`Fp8Linear::fused_target` → `Fp8Target`; stage 4's LayerNorms in
//! `producers`, fc1 in `Fp8Linear::forward_e4m3`), maxing its amax into this layer's amax buffer;
//! the layer then takes the `Quantized` input as it is (`Input::Fp8`, `forward_input`) and pushes
//! that amax into its history.
//!
//! **Non-finite values.** The casts saturate finite values at ±448 and keep NaN as NaN (an
//! explicit clamp would turn NaN into ±448 silently). `Fp8Tensor::quantize` and every CPU call
//! of `Fp8Linear` reject NaN/inf with an error; on CUDA the hot path does not read back to the
//! host, so a NaN travels to the output, where the runner's check reports it.

use crate::gemm::Fp8Gemm;
use crate::scale::{amax_into, history_push_into, max_abs_bits, scale_from_amax_into, scale_from_history_into, ScaleBuffers};
use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, CustomOp2, DType, Layout, Shape, Storage, Tensor};
use cpu_kernels::elementwise::Elementwise;
use float8::F8E4M3;
use rayon::prelude::*;
use std::sync::Mutex;

/// How an activation's FP8 scale is picked (the module notes above).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Fp8Recipe {
    /// From the amax of the last calls (a rolling history), TransformerEngine's default.
    #[default]
    Delayed,
    /// From the amax of the very tensor being quantised: one extra reduction per GEMM.
    Current,
}

impl Fp8Recipe {
    pub fn name(self) -> &'static str {
        match self {
            Fp8Recipe::Delayed => "delayed",
            Fp8Recipe::Current => "current",
        }
    }
}

/// Why an FP8 layer or tensor could not be made.
#[derive(Debug)]
pub enum Fp8Error {
    /// The input cannot be run as asked (non-finite values, misaligned dimensions, a mode the
    /// device lacks): one paragraph naming the cause and the fix.
    Refused(String),
    /// A candle op failed.
    Candle(candle_core::Error),
}

impl std::fmt::Display for Fp8Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Fp8Error::Refused(why) => f.write_str(why),
            Fp8Error::Candle(e) => write!(f, "{e}"),
        }
    }
}

impl std::error::Error for Fp8Error {}

impl From<candle_core::Error> for Fp8Error {
    fn from(e: candle_core::Error) -> Self {
        Fp8Error::Candle(e)
    }
}

/// Largest finite E4M3 value.
pub const E4M3_MAX: f32 = 448.0;

/// amax = max |x| over the whole tensor, as a rank-0 f32 tensor on x's device: a candle custom
/// op (`Amax`), one parallel pass on the CPU (candle's abs then max are two single-threaded
/// ones), our kernel on CUDA (`kernels/fp8.cu`: one pass, one atomic per block; an all-zero x
/// reports the smallest normal f32, 2⁻¹²⁶, as its amax, which no scale notices).
pub fn amax(x: &Tensor) -> candle_core::Result<Tensor> {
    // The CUDA kernel reads f32 or bf16; f16 goes in as f32.
    let x = if x.device().is_cuda() && x.dtype() == DType::F16 { x.to_dtype(DType::F32)? } else { x.clone() };
    x.contiguous()?.apply_op1_no_bwd(&Amax)
}

/// Slow twin of `amax`: candle's abs, max and cast.
pub fn amax_slow(x: &Tensor) -> candle_core::Result<Tensor> {
    x.flatten_all()?.abs()?.max(0)?.to_dtype(DType::F32)
}

/// The op behind `amax`: x (contiguous, f32/bf16/f16) → max|x|, rank 0, f32.
struct Amax;

impl CustomOp1 for Amax {
    fn name(&self) -> &'static str {
        "speedkit-fp8-amax"
    }

    fn cpu_fwd(&self, xs: &CpuStorage, xl: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let Some((a, b)) = xl.contiguous_offsets() else { candle_core::bail!("amax: x must be contiguous") };
        fn max_abs<T: Copy + Sync>(v: &[T], f32_of: impl Fn(T) -> f32 + Sync) -> f32 {
            v.par_chunks(CHUNK).map(|c| c.iter().fold(0f32, |m, &x| m.max(f32_of(x).abs()))).reduce(|| 0.0, f32::max)
        }
        let m = match xs {
            CpuStorage::F32(v) => max_abs(&v[a..b], |x| x),
            CpuStorage::BF16(v) => max_abs(&v[a..b], |x| x.to_f32()),
            CpuStorage::F16(v) => max_abs(&v[a..b], |x| x.to_f32()),
            x => candle_core::bail!("amax: unsupported dtype {:?} (f32, bf16 or f16)", x.dtype()),
        };
        Ok((CpuStorage::F32(vec![m]), Shape::from(())))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, xs: &candle_core::CudaStorage, xl: &Layout) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        Ok((crate::quant_cuda::amax_fwd(xs, xl)?, Shape::from(())))
    }
}

/// Elements per rayon task (64 KiB of f32).
const CHUNK: usize = 16 * 1024;

/// x as contiguous f32 on the CPU, cast in parallel when it is bf16/f16.
fn cpu_f32(x: &Tensor) -> candle_core::Result<Tensor> {
    cpu_kernels::elementwise::to_dtype(&x.contiguous()?, DType::F32, Elementwise::Parallel)
}

fn with_host<R>(x32: &Tensor, f: impl FnOnce(&[f32]) -> R) -> candle_core::Result<R> {
    let (storage, layout) = x32.storage_and_layout();
    match (&*storage, layout.contiguous_offsets()) {
        (Storage::Cpu(CpuStorage::F32(v)), Some((a, b))) => Ok(f(&v[a..b])),
        _ => candle_core::bail!("expected a contiguous f32 CPU tensor"),
    }
}

/// Round an f32 to the nearest E4M3 value (ties to even), saturating at ±448, NaN kept, and
/// return it as f32 (every E4M3 value is exact in f32). Branch-free arithmetic on the bits, so a
/// loop over it vectorises — unlike a per-element conversion to the 8-bit type and back.
/// Normals (|y| ≥ 2⁻⁶): keep 3 mantissa bits, round-to-nearest-even on the 20 dropped ones.
/// Subnormals (|y| < 2⁻⁶): multiples of 2⁻⁹, rounded with the 1.5·2²³ trick.
/// Slow twin: `Tensor::to_dtype(F8E4M3)` then back to f32 (float8's conversion, as candle's).
#[inline(always)]
pub fn round_e4m3(y: f32) -> f32 {
    let a = y.abs();
    let bits = a.to_bits();
    let normal = f32::from_bits((bits + 0x7_FFFF + ((bits >> 20) & 1)) & 0xFFF0_0000);
    let sub = ((a * 512.0 + 12_582_912.0) - 12_582_912.0) * (1.0 / 512.0);
    let r = if a < 1.0 / 64.0 { sub } else { normal };
    let r = if r > E4M3_MAX { E4M3_MAX } else { r }; // saturate (NaN compares false and stays NaN)
    let r = if y.is_nan() { y } else { r };
    r.copysign(y)
}

/// CPU, emulated FP8: s·e4m3(x / s) in f32, one parallel vectorised pass — what
/// `dequantize(&quantize(x, s)?, s, F32)` computes with two casts and three passes.
pub fn quantize_dequantize_cpu(x: &Tensor, scale: &Tensor) -> candle_core::Result<Tensor> {
    let s = scale.to_dtype(DType::F32)?.to_scalar::<f32>()?;
    let x32 = cpu_f32(x)?;
    let out = with_host(&x32, |v| {
        let mut out = vec![0f32; v.len()];
        out.par_chunks_mut(CHUNK).zip(v.par_chunks(CHUNK)).for_each(|(o, v)| {
            cpu_kernels::elementwise::map_slice(o, v, &|_, x| round_e4m3(x / s) * s);
            // x / s as quantize divides
        });
        out
    })?;
    Tensor::from_vec(out, x.shape(), x.device())
}

/// s = amax · 2^margin / 448 (rank 0, f32). An all-zero tensor gets a tiny positive s rather
/// than 0, so that x / s stays 0 instead of NaN.
pub fn scale_from_amax(amax: &Tensor, margin: i32) -> candle_core::Result<Tensor> {
    amax.maximum(f32::MIN_POSITIVE)?.affine(2f64.powi(margin) / E4M3_MAX as f64, 0.0)
}

/// q = sat(x / s) in E4M3, same shape as x; s is rank 0 (or (1) on CUDA). Round to nearest
/// even; the cast saturates at ±448 and keeps NaN. A candle custom op (`Quantize`): on the CPU
/// one parallel pass of the float8 crate's conversion (what candle's cast uses); on CUDA our
/// kernel (`kernels/fp8.cu`), which agrees with it on every f32 bit pattern
/// (host_emulation/fp8_check.cpp) — candle 0.11.1's own CUDA F8 cast cannot be loaded
/// (huggingface/candle#3886), so it is never called.
pub fn quantize(x: &Tensor, scale: &Tensor) -> candle_core::Result<Tensor> {
    check_scale(scale)?;
    // The CUDA kernel reads f32 or bf16; f16 goes in as f32.
    let x = if x.device().is_cuda() && x.dtype() == DType::F16 { x.to_dtype(DType::F32)? } else { x.clone() };
    x.contiguous()?.apply_op2_no_bwd(&scale.to_dtype(DType::F32)?.contiguous()?, &Quantize { amax_bits: None })
}

/// `quantize`, with max|x| also maxed into `amax_bits` ((1) u32, f32 bits) in the same pass:
/// delayed scaling's cast, which records the amax of what it quantises for the history.
pub fn quantize_recording(x: &Tensor, scale: &Tensor, amax_bits: &Tensor) -> candle_core::Result<Tensor> {
    check_scale(scale)?;
    let x = if x.device().is_cuda() && x.dtype() == DType::F16 { x.to_dtype(DType::F32)? } else { x.clone() };
    x.contiguous()?.apply_op2_no_bwd(&scale.to_dtype(DType::F32)?.contiguous()?, &Quantize { amax_bits: Some(amax_bits.clone()) })
}

/// Slow twin of `quantize`: candle's ops, a division then candle's cast to F8E4M3 (CPU).
pub fn quantize_slow(x: &Tensor, scale: &Tensor) -> candle_core::Result<Tensor> {
    x.to_dtype(DType::F32)?.broadcast_div(&scale.reshape(())?)?.to_dtype(DType::F8E4M3)
}

/// s·q in `dtype`: a candle custom op (`Dequantize`) to f32 — one parallel pass on the CPU, our
/// kernel `fp8_dequantize_f32` on CUDA — then the cast to `dtype`.
pub fn dequantize(q: &Tensor, scale: &Tensor, dtype: DType) -> candle_core::Result<Tensor> {
    check_scale(scale)?;
    let y = q.contiguous()?.apply_op2_no_bwd(&scale.to_dtype(DType::F32)?.contiguous()?, &Dequantize)?;
    cpu_kernels::elementwise::to_dtype(&y, dtype, Elementwise::Parallel)
}

/// Slow twin of `dequantize`: candle's cast from F8E4M3, a multiplication, a cast (CPU).
pub fn dequantize_slow(q: &Tensor, scale: &Tensor, dtype: DType) -> candle_core::Result<Tensor> {
    q.to_dtype(DType::F32)?.broadcast_mul(&scale.reshape(())?)?.to_dtype(dtype)
}

/// A per-tensor scale is one f32 value: rank 0 or (1).
pub(crate) fn check_scale(scale: &Tensor) -> candle_core::Result<()> {
    if scale.elem_count() != 1 {
        candle_core::bail!("an FP8 per-tensor scale holds one value, rank 0 or (1); got {:?}", scale.dims());
    }
    Ok(())
}

/// The one value of a scale's CPU storage.
pub(crate) fn scale_value(s: &CpuStorage, l: &Layout) -> candle_core::Result<f32> {
    match s {
        CpuStorage::F32(v) => v.get(l.start_offset()).copied().ok_or_else(|| candle_core::Error::Msg("empty FP8 scale".into())),
        _ => candle_core::bail!("an FP8 scale is f32"),
    }
}

/// The op behind `quantize` and `quantize_recording`: x (contiguous, f32/bf16/f16) and its scale
/// (one f32) → E4M3; with `amax_bits` held ((1) u32), max|x| maxed into it too.
struct Quantize {
    amax_bits: Option<Tensor>,
}

impl CustomOp2 for Quantize {
    fn name(&self) -> &'static str {
        "speedkit-fp8-quantize"
    }

    fn cpu_fwd(&self, xs: &CpuStorage, xl: &Layout, ss: &CpuStorage, sl: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        use cpu_kernels::elementwise::par_convert;
        let s = scale_value(ss, sl)?;
        let Some((a, b)) = xl.contiguous_offsets() else { candle_core::bail!("quantize: x must be contiguous") };
        // x / s in f32, then the float8 crate's round-to-nearest-even, saturating cast
        let q = match xs {
            CpuStorage::F32(v) => par_convert(&v[a..b], |x| F8E4M3::from_f32(x / s)),
            CpuStorage::BF16(v) => par_convert(&v[a..b], |x| F8E4M3::from_f32(x.to_f32() / s)),
            CpuStorage::F16(v) => par_convert(&v[a..b], |x| F8E4M3::from_f32(x.to_f32() / s)),
            x => candle_core::bail!("quantize: unsupported dtype {:?} (f32, bf16 or f16)", x.dtype()),
        };
        if let Some(bits) = &self.amax_bits {
            let m = match xs {
                CpuStorage::F32(v) => max_abs_bits(&v[a..b], f32::to_bits),
                CpuStorage::BF16(v) => max_abs_bits(&v[a..b], |x| x.to_f32().to_bits()),
                CpuStorage::F16(v) => max_abs_bits(&v[a..b], |x| x.to_f32().to_bits()),
                _ => unreachable!("the dtype was matched above"),
            };
            max_into(bits, m)?;
        }
        Ok((CpuStorage::F8E4M3(q), xl.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        xs: &candle_core::CudaStorage,
        xl: &Layout,
        ss: &candle_core::CudaStorage,
        sl: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        let q = match &self.amax_bits {
            None => crate::quant_cuda::quantize_fwd(xs, xl, ss, sl, None)?,
            Some(bits) => {
                let (bs, bl) = bits.storage_and_layout();
                let Storage::Cuda(bs) = &*bs else { candle_core::bail!("quantize: the amax buffer is not on the GPU") };
                crate::quant_cuda::quantize_fwd(xs, xl, ss, sl, Some((bs, bl)))?
            }
        };
        Ok((q, xl.shape().clone()))
    }
}

/// The op behind `dequantize`: q (contiguous E4M3) and its scale (one f32) → s·q in f32.
struct Dequantize;

impl CustomOp2 for Dequantize {
    fn name(&self) -> &'static str {
        "speedkit-fp8-dequantize"
    }

    fn cpu_fwd(&self, qs: &CpuStorage, ql: &Layout, ss: &CpuStorage, sl: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let s = scale_value(ss, sl)?;
        let Some((a, b)) = ql.contiguous_offsets() else { candle_core::bail!("dequantize: q must be contiguous") };
        let CpuStorage::F8E4M3(q) = qs else { candle_core::bail!("dequantize: q must be F8E4M3, got {:?}", qs.dtype()) };
        let y = cpu_kernels::elementwise::par_convert(&q[a..b], |q| q.to_f32() * s);
        Ok((CpuStorage::F32(y), ql.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        qs: &candle_core::CudaStorage,
        ql: &Layout,
        ss: &candle_core::CudaStorage,
        sl: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        Ok((crate::quant_cuda::dequantize_fwd(qs, ql, ss, sl)?, ql.shape().clone()))
    }
}

/// Refuse a tensor holding NaN or ±inf: its amax, and so its scale, would not be a number.
/// The common case, all finite, costs one pass where the tensor lives: on the CPU a parallel
/// scan without a copy; on the GPU the amax kernel (it keeps NaN and ±inf: `kernels/fp8.cu`)
/// and one f32 read back — training quantises every master weight each step, where a host
/// copy of them would cost more than the step's GEMMs. Only a tensor that fails is read on the
/// host, to describe what it holds.
pub fn check_finite(x: &Tensor, what: &str) -> Result<(), String> {
    check_finite_with(x, None, what)
}

/// `check_finite` given x's amax where the caller has it already (on the GPU it is the check).
fn check_finite_with(x: &Tensor, amax_of_x: Option<&Tensor>, what: &str) -> Result<(), String> {
    let all_finite = if x.device().is_cpu() {
        // The CPU's amax drops NaN (f32::max), so the CPU scans.
        cpu_f32(x).and_then(|x32| with_host(&x32, |v| v.par_chunks(CHUNK).all(|c| c.iter().all(|v| v.is_finite()))))
    } else {
        amax_of_x.map_or_else(|| amax(x), |a| Ok(a.clone())).and_then(|a| a.to_scalar::<f32>()).map(f32::is_finite)
    }
    .map_err(|e| format!("cannot read {what} to check it for FP8: {e}"))?;
    if all_finite {
        return Ok(());
    }
    let values: Vec<f32> = x
        .to_dtype(DType::F32)
        .and_then(|t| t.flatten_all()?.to_vec1())
        .map_err(|e| format!("cannot read {what} to check it for FP8: {e}"))?;
    check_values(&values, what)
}

/// `check_finite` on values already in host memory.
fn check_values(values: &[f32], what: &str) -> Result<(), String> {
    let bad = values.iter().filter(|v| !v.is_finite()).count();
    match values.iter().position(|v| !v.is_finite()) {
        None => Ok(()),
        Some(first) => Err(format!(
            "{what} holds {bad} NaN or infinite values (the first at flat index {first}, {}), so it cannot be \
             quantised to FP8: its per-tensor scale is amax / 448, and the amax of a tensor with NaN or inf is \
             not a finite number. Fix: find where the non-finite values come from (an overflow upstream, or a \
             --weights/--input file that holds them); FP8 needs finite inputs.",
            values[first]
        )),
    }
}

/// A tensor in E4M3 with its per-tensor dequantisation scale: it stands for `scale · data`.
#[derive(Clone, Debug)]
pub struct Fp8Tensor {
    /// E4M3 values, x's shape.
    pub data: Tensor,
    /// Rank-0 f32 on the same device.
    pub scale: Tensor,
}

impl Fp8Tensor {
    /// Current scaling, checked: what a weight gets, once, when a model is built.
    pub fn quantize(x: &Tensor, margin: i32, what: &str) -> Result<Fp8Tensor, Fp8Error> {
        let amax_x = amax(x)?;
        check_finite_with(x, Some(&amax_x), what).map_err(Fp8Error::Refused)?;
        let scale = scale_from_amax(&amax_x, margin)?;
        Ok(Fp8Tensor { data: quantize(x, &scale)?, scale })
    }

    pub fn dequantize(&self, dtype: DType) -> candle_core::Result<Tensor> {
        dequantize(&self.data, &self.scale, dtype)
    }
}

/// Where a fused producer writes an FP8 GEMM's input (`Fp8Linear::fused_target`): the
/// consuming layer's delayed scale s (q = sat(x / s)) and its buffers the producer writes into.
#[derive(Clone, Debug)]
pub struct Fp8Target {
    /// s, rank 0 f32: a view of the consumer's scale buffer.
    pub scale: Tensor,
    /// (1) u32: the consumer's amax buffer (f32 bits, zero on entry) that the producer maxes
    /// |x| into; the consumer pushes it into its history.
    pub amax_bits: Tensor,
    /// (1) f32: 1/s, written for a producer GEMM (cuBLASLt's D scale multiplies).
    pub inv_scale: Tensor,
}

impl Fp8Target {
    /// A target with scale s (one f32, on the producer's device) and buffers of its own, zeroed:
    /// what a layer's state hands out, for a producer run on its own (tests, selftests).
    pub fn new(scale: &Tensor) -> candle_core::Result<Fp8Target> {
        check_scale(scale)?;
        let dev = scale.device();
        Ok(Fp8Target {
            scale: scale.to_dtype(DType::F32)?.reshape(())?.contiguous()?,
            amax_bits: Tensor::zeros(1, DType::U32, dev)?,
            inv_scale: Tensor::zeros(1, DType::F32, dev)?,
        })
    }

    /// The producer's last step written out: y (its f32 output, never rounded to the activation
    /// dtype) quantised with s, and max|y| maxed into the consumer's amax buffer, in one pass. A
    /// candle custom op (`QuantizeForTarget`): what the CPU producers' ops end with and fc1 runs
    /// when emulated (s·q in f32 on the CPU, as the emulated GEMMs read it); on CUDA fp8.cu's
    /// cast with the amax (the fused kernels do it in their own pass instead).
    pub fn quantize(&self, y: &Tensor) -> candle_core::Result<Quantized> {
        // The CUDA kernel reads f32 or bf16; f16 goes in as f32.
        let y = if y.device().is_cuda() && y.dtype() == DType::F16 { y.to_dtype(DType::F32)? } else { y.contiguous()? };
        let op = QuantizeForTarget { amax_bits: self.amax_bits.clone() };
        Ok(Quantized { data: y.apply_op2_no_bwd(&self.scale, &op)?, scale: self.scale.clone() })
    }

    /// Slow twin of `quantize` (CPU): candle's division and casts to E4M3 and back (s·q in f32),
    /// and candle's abs and max for the amax (rank 0). The target's buffers are not touched.
    pub fn quantize_slow(&self, y: &Tensor) -> candle_core::Result<(Tensor, Tensor)> {
        Ok((dequantize_slow(&quantize_slow(y, &self.scale)?, &self.scale, DType::F32)?, amax_slow(y)?))
    }

    /// The amax recorded so far (since the consumer's last push), read on the host: for tests.
    pub fn amax(&self) -> candle_core::Result<f32> {
        crate::scale::amax_value(&self.amax_bits)
    }
}

/// The op behind `Fp8Target::quantize`: y (contiguous, f32/bf16/f16) and s (one f32) → q (CUDA:
/// E4M3; CPU: s·q in f32, finite inputs only); max|y| maxed into the held amax buffer.
struct QuantizeForTarget {
    amax_bits: Tensor,
}

impl CustomOp2 for QuantizeForTarget {
    fn name(&self) -> &'static str {
        "speedkit-fp8-quantize-for-target"
    }

    fn cpu_fwd(&self, ys: &CpuStorage, yl: &Layout, ss: &CpuStorage, sl: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let s = scale_value(ss, sl)?;
        let Some((a, b)) = yl.contiguous_offsets() else { candle_core::bail!("Fp8Target::quantize: y must be contiguous") };
        let mut v = match ys {
            CpuStorage::F32(v) => v[a..b].to_vec(),
            CpuStorage::BF16(v) => cpu_kernels::elementwise::par_convert(&v[a..b], |x| x.to_f32()),
            CpuStorage::F16(v) => cpu_kernels::elementwise::par_convert(&v[a..b], |x| x.to_f32()),
            y => candle_core::bail!("Fp8Target::quantize: unsupported dtype {:?} (f32, bf16 or f16)", y.dtype()),
        };
        quantize_recording_cpu(&mut v, s, &self.amax_bits, "a fused producer's output")?;
        Ok((CpuStorage::F32(v), yl.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        ys: &candle_core::CudaStorage,
        yl: &Layout,
        ss: &candle_core::CudaStorage,
        sl: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        let (bs, bl) = self.amax_bits.storage_and_layout();
        let Storage::Cuda(bs) = &*bs else { candle_core::bail!("Fp8Target::quantize: the amax buffer is not on the GPU") };
        Ok((crate::quant_cuda::quantize_fwd(ys, yl, ss, sl, Some((bs, bl)))?, yl.shape().clone()))
    }
}

/// CPU, a producer's f32 output v in place: v ← s·e4m3(v / s) (the emulation's form), its
/// max|v| maxed into `amax_bits`. Refuses NaN and inf (`check_finite`), whose amax is no number.
pub(crate) fn quantize_recording_cpu(v: &mut [f32], s: f32, amax_bits: &Tensor, what: &str) -> candle_core::Result<()> {
    let m = max_abs_bits(v, f32::to_bits);
    if m >= f32::INFINITY.to_bits() {
        check_values(v, what).map_err(candle_core::Error::Msg)?;
    }
    v.par_chunks_mut(CHUNK).for_each(|c| cpu_kernels::elementwise::map_slice_in_place(c, &|_, x| round_e4m3(x / s) * s));
    max_into(amax_bits, m)
}

/// amax_bits ← max(amax_bits, m) for a max already taken (`max_abs_bits`) in a CPU forward:
/// `scale::amax_into` on the one value, what the kernels' atomicMax does at a block's end.
pub(crate) fn max_into(amax_bits: &Tensor, m: u32) -> candle_core::Result<()> {
    amax_into(amax_bits, &Tensor::new(&[f32::from_bits(m)], &candle_core::Device::Cpu)?)
}

/// An FP8 GEMM's input as a fused producer wrote it, with the consumer's scale; its amax is
/// already in the consumer's amax buffer.
#[derive(Clone, Debug)]
pub struct Quantized {
    /// CUDA: q in E4M3. CPU: s·q in f32 (the emulation never holds the 8-bit type).
    pub data: Tensor,
    /// s, the scale it was quantised with.
    pub scale: Tensor,
}

/// A GEMM input: in the activation dtype (the GEMM quantises it), or already in E4M3 from a
/// fused producer (`--fp8-fusions`).
#[derive(Clone, Debug)]
pub enum Input {
    Plain(Tensor),
    Fp8(Quantized),
}

impl Input {
    /// (B, T, K)
    pub fn dims3(&self) -> candle_core::Result<(usize, usize, usize)> {
        match self {
            Input::Plain(x) => x.dims3(),
            Input::Fp8(q) => q.data.dims3(),
        }
    }

    /// A copy that later calls cannot change (the scale is a view of the layer's scale buffer,
    /// which the next call rewrites).
    pub fn kept(&self) -> candle_core::Result<Input> {
        Ok(match self {
            Input::Plain(x) => Input::Plain(x.clone()),
            Input::Fp8(q) => Input::Fp8(Quantized { scale: q.scale.copy()?, ..q.clone() }),
        })
    }
}

/// How an `Fp8Linear` scales its input: the recipe, the amax history length (delayed) and the
/// margin (s gets 2^margin of headroom above the amax).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ScalingConfig {
    pub recipe: Fp8Recipe,
    pub history_len: usize,
    pub margin: i32,
}

impl Default for ScalingConfig {
    /// Delayed scaling over the last 16 calls, no margin. (TransformerEngine defaults to a
    /// 1024-long history for training; a forward benchmark sees fewer calls than that.)
    fn default() -> Self {
        ScalingConfig { recipe: Fp8Recipe::Delayed, history_len: 16, margin: 0 }
    }
}

/// The scale state of one activation: one set of buffers (`scale::ScaleBuffers`: amax, scale,
/// amax history oldest first, 1/scale) on the input's device, and the calls so far.
///
/// The buffers are allocated by the first call and then only updated in place, by the in-place
/// ops of `scale` (the same ops on the CPU and CUDA), never replaced: under `--cuda-graph` the
/// second call runs inside a capture, and dropping the first call's tensor there would be a
/// `cuMemFreeAsync` of memory the graph did not allocate, which invalidates the capture. A
/// replay then updates the same buffers, the history included, with no host round trip.
#[derive(Debug)]
pub struct ScaleState {
    config: ScalingConfig,
    buffers: Option<ScaleBuffers>,
    /// Calls so far (the first delayed call fills the history from its own amax).
    calls: usize,
    /// Whether the last call's input was quantised by its producer (`Fp8Target`).
    last_fused: bool,
}

impl ScaleState {
    pub fn new(config: ScalingConfig) -> Result<ScaleState, String> {
        if config.history_len == 0 {
            return Err("an FP8 amax history of length 0 holds nothing to scale from. Fix: use a history_len of 1 or more.".into());
        }
        Ok(ScaleState { config, buffers: None, calls: 0, last_fused: false })
    }

    /// The buffers, made on `dev` by the first call.
    fn buffers(&mut self, dev: &candle_core::Device) -> candle_core::Result<&ScaleBuffers> {
        if self.buffers.is_none() {
            self.buffers = Some(ScaleBuffers::new(dev, self.config.history_len)?);
        }
        self.buffers.as_ref().ok_or_else(|| candle_core::Error::Msg("scale state: no buffers".into()))
    }

    /// x in E4M3 with the recipe's scale: (q, the scale used, rank 0). Delayed scaling after the
    /// first call takes x's amax in the cast's own pass (x read once: scale from the history,
    /// cast + amax, push); otherwise `scale_for`, then the cast.
    pub fn quantize(&mut self, x: &Tensor) -> candle_core::Result<(Tensor, Tensor)> {
        if self.config.recipe == Fp8Recipe::Current || self.calls == 0 {
            let scale = self.scale_for(x)?;
            return Ok((quantize(x, &scale)?, scale));
        }
        let margin = self.config.margin;
        let b = self.buffers(x.device())?;
        scale_from_history_into(&b.scale, &b.history, margin)?;
        let scale = b.scale.reshape(())?;
        let q = quantize_recording(x, &scale, &b.amax_bits)?;
        history_push_into(&b.history, &b.amax_bits, false)?;
        self.calls += 1;
        self.last_fused = false;
        Ok((q, scale))
    }

    /// The scale to quantise `x` with, per the recipe (rank 0, a view of the scale buffer: the
    /// next call overwrites it); records x's amax in the history.
    pub fn scale_for(&mut self, x: &Tensor) -> candle_core::Result<Tensor> {
        let (recipe, margin, first) = (self.config.recipe, self.config.margin, self.calls == 0);
        let b = self.buffers(x.device())?;
        amax_into(&b.amax_bits, x)?;
        match (recipe, first) {
            (Fp8Recipe::Current, _) => scale_from_amax_into(&b.scale, &b.amax_bits, margin)?,
            // No history yet: this amax fills it, so s comes from x's own amax, as current scaling.
            (Fp8Recipe::Delayed, true) => {
                history_push_into(&b.history, &b.amax_bits, true)?;
                scale_from_history_into(&b.scale, &b.history, margin)?;
            }
            // The last calls' largest amax, not this one's (s is known before x is read); this
            // amax only joins the history.
            (Fp8Recipe::Delayed, false) => {
                scale_from_history_into(&b.scale, &b.history, margin)?;
                history_push_into(&b.history, &b.amax_bits, false)?;
            }
        }
        let scale = b.scale.reshape(())?;
        self.calls += 1;
        self.last_fused = false;
        Ok(scale)
    }

    /// Where a producer may write this state's next input in E4M3 (a fused LayerNorm, fc1's
    /// E4M3 output): the delayed scale, known before the input exists, updated from the history
    /// into the scale buffer the GEMM reads. None for current scaling and before the first
    /// delayed call, when the scale needs the input's own amax.
    pub fn fused_target(&mut self) -> candle_core::Result<Option<Fp8Target>> {
        let Some(b) = self.buffers.as_ref().filter(|_| self.calls > 0 && self.config.recipe == Fp8Recipe::Delayed) else {
            return Ok(None);
        };
        scale_from_history_into(&b.scale, &b.history, self.config.margin)?;
        Ok(Some(Fp8Target { scale: b.scale.reshape(())?, amax_bits: b.amax_bits.clone(), inv_scale: b.inv_scale.clone() }))
    }

    /// Close a call whose input its producer quantised with `fused_target`'s scale: the amax it
    /// maxed into the amax buffer joins the history.
    pub fn finish_fused(&mut self) -> candle_core::Result<()> {
        let Some(b) = &self.buffers else { candle_core::bail!("finish_fused: no fused_target was handed out before") };
        history_push_into(&b.history, &b.amax_bits, false)?;
        self.calls += 1;
        self.last_fused = true;
        Ok(())
    }

    /// Whether the last call's input came quantised from its producer (the twins need to know:
    /// such an input was never stored in the activation dtype).
    pub fn last_fused(&self) -> bool {
        self.last_fused
    }

    /// The amax history, oldest first (empty before the first delayed call; always empty for
    /// current scaling). Reads it on the host: for tests and reports.
    pub fn history(&self) -> candle_core::Result<Vec<f32>> {
        match (&self.buffers, self.config.recipe) {
            (Some(b), Fp8Recipe::Delayed) if self.calls > 0 => b.history.to_vec1(),
            _ => Ok(Vec::new()),
        }
    }

    /// The scale the last call used (rank 0): a copy, since the buffer changes with each call.
    pub fn last_scale(&self) -> Option<Tensor> {
        let b = self.buffers.as_ref().filter(|_| self.calls > 0)?;
        b.scale.reshape(()).and_then(|s| s.copy()).ok()
    }

    /// The state's buffers (history under delayed scaling, scale): the same tensors from the
    /// first call on.
    pub fn buffer_ids(&self) -> (Option<candle_core::TensorId>, Option<candle_core::TensorId>) {
        match &self.buffers {
            Some(b) => ((self.config.recipe == Fp8Recipe::Delayed).then(|| b.history.id()), Some(b.scale.id())),
            None => (None, None),
        }
    }
}

/// How `Fp8Linear` runs its GEMM.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fp8Mode {
    /// E4M3 tensor cores through cuBLASLt (CUDA, SM 8.9+).
    Cublaslt,
    /// Quantise and dequantise, then an f32 GEMM: FP8's numerics anywhere, not its speed.
    Emulated,
}

/// y = act(x Wᵀ + b) with x and W in E4M3, output bf16. W is quantised once (current scaling);
/// x is quantised on every call with the scale its `ScalingConfig` picks. The bias (bf16) and
/// GELU are applied to the f32 accumulator before the bf16 store: in cuBLASLt's epilogue on
/// CUDA, in the f32 GEMM's pass when emulated.
///
/// ```no_run
/// # use stage4_fp8::fp8::{Fp8Linear, Fp8Mode, ScalingConfig};
/// # use candle_nn::Module;
/// # fn f(w: &candle_core::Tensor, b: &candle_core::Tensor, x: &candle_core::Tensor) -> Result<(), Box<dyn std::error::Error>> {
/// let fc1 = Fp8Linear::new(w, b, true, Fp8Mode::Cublaslt, ScalingConfig::default(), "fc1")?; // W: (FF, C)
/// let m = fc1.forward(x)?; // x: (B, T, C) bf16 → (B, T, FF) bf16, GELU applied (candle_nn::Module)
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct Fp8Linear {
    weight: Fp8Tensor,                  // (N, K) E4M3, its scale
    emulated: Option<(Tensor, Tensor)>, // emulation only: (N, K) s_w·q_w and (N) bias in f32, made once, not per call
    bias: Tensor,                       // (N) in the output dtype (bf16 for cuBLASLt), as the epilogue reads it
    out: DType,                         // what the GEMM stores: bf16 (cuBLASLt); emulated, stage 3's activation dtype
    gelu: bool,
    fast_accum: bool, // cuBLASLt's FP8 fast accumulation (`--fp8-fast-accum`); on by default
    name: String,
    state: Mutex<ScaleState>,
}

impl Fp8Linear {
    /// W: (N, K) and b: (N), any float dtype, on the device the layer runs on.
    pub fn new(w: &Tensor, b: &Tensor, gelu: bool, mode: Fp8Mode, scaling: ScalingConfig, name: &str) -> Result<Fp8Linear, Fp8Error> {
        Self::with_output(w, b, gelu, mode, scaling, name, DType::BF16)
    }

    /// `new`, storing `out` instead of bf16: emulated only (stage 4 on the CPU keeps stage 3's
    /// activation dtype, so the GEMMs' number format is its one change); cuBLASLt writes bf16.
    pub fn with_output(
        w: &Tensor,
        b: &Tensor,
        gelu: bool,
        mode: Fp8Mode,
        scaling: ScalingConfig,
        name: &str,
        out: DType,
    ) -> Result<Fp8Linear, Fp8Error> {
        if mode == Fp8Mode::Cublaslt && out != DType::BF16 {
            return Err(Fp8Error::Refused(format!("{name}: the cuBLASLt FP8 GEMM stores bf16 here, not {out:?}")));
        }
        let (n, k) = w.dims2()?;
        if b.dims() != [n] {
            return Err(Fp8Error::Refused(format!("{name}: bias {:?} does not match W {:?}", b.dims(), w.dims())));
        }
        if mode == Fp8Mode::Cublaslt {
            if !w.device().is_cuda() {
                return Err(Fp8Error::Refused(format!(
                    "{name}: FP8 GEMMs through cuBLASLt run on a CUDA device, and W is on the CPU. Fix: move W to the \
                     GPU, or use Fp8Mode::Emulated to study FP8's numerics on the CPU."
                )));
            }
            crate::gemm::check_dims(16, k, n).map_err(Fp8Error::Refused)?; // the token count is checked per call
        }
        let weight = Fp8Tensor::quantize(w, 0, &format!("{name}'s weight"))?;
        let bias = b.to_dtype(out)?;
        let emulated = match mode {
            Fp8Mode::Emulated => Some((weight.dequantize(DType::F32)?, bias.to_dtype(DType::F32)?)),
            Fp8Mode::Cublaslt => None,
        };
        Ok(Fp8Linear {
            weight,
            emulated,
            bias,
            out,
            gelu,
            fast_accum: true,
            name: name.into(),
            state: Mutex::new(ScaleState::new(scaling).map_err(Fp8Error::Refused)?),
        })
    }

    /// Turn cuBLASLt's FP8 fast accumulation on (the default) or off (`--fp8-fast-accum`).
    pub fn with_fast_accum(mut self, on: bool) -> Fp8Linear {
        self.fast_accum = on;
        self
    }

    /// How the GEMM runs.
    pub fn mode(&self) -> Fp8Mode {
        if self.emulated.is_some() {
            Fp8Mode::Emulated
        } else {
            Fp8Mode::Cublaslt
        }
    }

    /// The layer's name (qkv, proj, fc1, fc2 in stage 4).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Whether cuBLASLt's fast accumulation is on.
    pub fn fast_accum(&self) -> bool {
        self.fast_accum
    }

    /// x: (B, T, K), any float dtype (bf16 in stage 4) → (B, T, N) in the output dtype (bf16).
    /// (Also `candle_nn::Module::forward`, so the layer drops into a model as any linear does.)
    pub fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        self.forward_input(&Input::Plain(x.clone()), None)
    }

    /// r + x Wᵀ + b in r's dtype (the f32 residual stream). Emulated on the CPU the residual
    /// rides in the f32 GEMM's epilogue, as in stage 3 (`linear_bias_residual`); through cuBLASLt
    /// the bf16 output is added to r afterwards (stage 3's two launches at bf16 on CUDA).
    pub fn forward_residual(&self, x: &Tensor, r: &Tensor) -> candle_core::Result<Tensor> {
        self.forward_input(&Input::Plain(x.clone()), Some(r))
    }

    /// `forward` (with the residual r when given) on an input as its producer wrote it: in the
    /// activation dtype, or already quantised with this layer's scale (`fused_target`).
    pub fn forward_input(&self, x: &Input, residual: Option<&Tensor>) -> candle_core::Result<Tensor> {
        let (xq, xd, scale) = self.operands(x)?;
        self.gemm(xq.as_ref(), xd.as_ref(), &scale, residual)
    }

    /// `forward` for training (`hybrid::HybridLinear`): also returns the input as the GEMM read
    /// it, s_x·q_x in f32, which the backward's dW GEMM reads. Emulated layers only.
    pub fn forward_keeping_input(&self, x: &Tensor) -> candle_core::Result<(Tensor, Tensor)> {
        let (xq, xd, scale) = self.operands(&Input::Plain(x.clone()))?;
        let xd = xd.filter(|_| self.emulated.is_some()).ok_or_else(|| {
            candle_core::Error::Msg(format!("{}: the HYBRID backward reads the emulated operands; this layer runs cuBLASLt", self.name))
        })?;
        Ok((self.gemm(xq.as_ref(), Some(&xd), &scale, None)?, xd))
    }

    /// `forward` for training through cuBLASLt (`hybrid::HybridLinear` on CUDA): also returns
    /// the input as the GEMM read it, q_x in E4M3, and its scale s_x (a copy: the scale buffer
    /// changes with the next call), which the backward's dW GEMM reads. cuBLASLt layers only.
    pub fn forward_keeping_fp8_input(&self, x: &Tensor) -> candle_core::Result<(Tensor, Tensor, Tensor)> {
        let (xq, _, scale) = self.operands(&Input::Plain(x.clone()))?;
        let xq = xq.filter(|_| self.emulated.is_none()).ok_or_else(|| {
            candle_core::Error::Msg(format!(
                "{}: the HYBRID backward on CUDA reads cuBLASLt's E4M3 operands; this layer is emulated",
                self.name
            ))
        })?;
        let scale = scale.copy()?;
        Ok((self.gemm(Some(&xq), None, &scale, None)?, xq, scale))
    }

    /// A training step's updated W and b, quantised into this layer as `new` does (W with
    /// current scaling), while its input's scale state, the amax history, carries on. W and b
    /// are read as values: nothing here is recorded for the backward.
    pub fn set_weights(&mut self, w: &Tensor, b: &Tensor) -> Result<(), Fp8Error> {
        let (w, b) = (w.detach(), b.detach());
        if w.dims() != self.weight.data.dims() || b.dims() != self.bias.dims() {
            return Err(Fp8Error::Refused(format!("{}: new W {:?} and b {:?} do not fit the layer's", self.name, w.dims(), b.dims())));
        }
        self.weight = Fp8Tensor::quantize(&w, 0, &format!("{}'s weight", self.name))?;
        self.bias = b.to_dtype(self.out)?;
        if self.emulated.is_some() {
            self.emulated = Some((self.weight.dequantize(DType::F32)?, self.bias.to_dtype(DType::F32)?));
        }
        Ok(())
    }

    /// Where this layer's producer may write its next input in E4M3 (`ScaleState::fused_target`):
    /// Some with delayed scaling from the second call on, None when the scale is not known yet.
    pub fn fused_target(&self) -> candle_core::Result<Option<Fp8Target>> {
        self.state()?.fused_target()
    }

    /// fc1 → fc2: this layer's output written in E4M3 for the next layer (`target`, its
    /// `fused_target`) instead of in the activation dtype, its amax recorded there. Through
    /// cuBLASLt the GEMM's epilogue does it (D scale = 1/s, amax_D: `gemm::Fp8Gemm`);
    /// emulated, the f32 output is quantised by `target.quantize` — never stored in between.
    pub fn forward_e4m3(&self, x: &Input, target: &Fp8Target) -> candle_core::Result<Quantized> {
        let (xq, xd, scale) = self.operands(x)?;
        if let (Some((w, b)), Some(xd)) = (&self.emulated, &xd) {
            return target.quantize(&self.emulated_f32(xd, w, b)?);
        }
        let xq = xq.ok_or_else(|| candle_core::Error::Msg(format!("{}: no E4M3 input for cuBLASLt", self.name)))?;
        self.forward_cublaslt_e4m3(&xq, &scale, target)
    }

    /// The GEMM's operands from its input: (q_x for cuBLASLt, s_x·q_x in f32 when emulated,
    /// s_x), the scale state advanced by one call. A plain input is quantised here; a fused
    /// producer's already is, and the amax it recorded joins the history.
    fn operands(&self, x: &Input) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Tensor)> {
        let k = x.dims3()?.2;
        if self.weight.data.dim(1)? != k {
            candle_core::bail!("{}: x {:?} does not fit W {:?}", self.name, x.dims3()?, self.weight.data.dims());
        }
        let (xq, scale) = match x {
            Input::Fp8(q) => {
                cpu_kernels::trace::ran("fp8: input in E4M3 from its producer");
                self.state()?.finish_fused()?;
                if q.data.device().is_cpu() {
                    return Ok((None, Some(q.data.clone()), q.scale.clone())); // already s·q in f32
                }
                (q.data.clone(), q.scale.clone())
            }
            Input::Plain(x) if x.device().is_cpu() => {
                // Free to check on the CPU (the data is already host memory); see the module notes.
                check_finite(x, &format!("the input of {}", self.name)).map_err(candle_core::Error::Msg)?;
                let scale = self.state()?.scale_for(x)?;
                cpu_kernels::trace::ran("fp8: quantise the input to E4M3 (CPU pass)");
                // s_x·q_x in f32 in one parallel pass (`quantize_dequantize_cpu`), never the 8-bit type
                return Ok((None, Some(quantize_dequantize_cpu(x, &scale)?), scale));
            }
            // CUDA: our kernels quantise (kernels/fp8.cu), the scale stays on the device.
            Input::Plain(x) => self.state()?.quantize(x)?,
        };
        // emulated on a GPU without FP8 (--fp8-emulate): its f32 GEMM reads s_x·q_x
        let xd = if self.emulated.is_some() { Some(dequantize(&xq, &scale, DType::F32)?) } else { None };
        Ok((Some(xq), xd, scale))
    }

    fn state(&self) -> candle_core::Result<std::sync::MutexGuard<'_, ScaleState>> {
        self.state.lock().map_err(|_| candle_core::Error::Msg(format!("{}: scale state poisoned", self.name)))
    }

    /// The GEMM on the quantised input: cuBLASLt on q_x (`xq`), or, emulated, the f32 GEMM on
    /// s_x·q_x (`xd`), then the store in the output dtype and the residual.
    fn gemm(&self, xq: Option<&Tensor>, xd: Option<&Tensor>, scale: &Tensor, residual: Option<&Tensor>) -> candle_core::Result<Tensor> {
        let (Some((w, b)), Some(xd)) = (&self.emulated, xd) else {
            let xq = xq.ok_or_else(|| candle_core::Error::Msg(format!("{}: no E4M3 input for cuBLASLt", self.name)))?;
            cpu_kernels::trace::ran("fp8 gemm: cuBLASLt E4M3");
            return match residual {
                None => self.forward_cublaslt(xq, scale),
                Some(r) => r + self.forward_cublaslt(xq, scale)?.to_dtype(r.dtype())?,
            };
        };
        if let (Some(r), true, false) = (residual, xd.device().is_cpu(), self.gelu) {
            cpu_kernels::trace::ran("fp8 gemm: emulated (E4M3 values, f32 GEMM)");
            return stage3_fused::ops::linear_bias_residual(xd, w, b, r); // stage 3's fused residual epilogue
        }
        // the store cuBLASLt makes (bf16), or stage 3's dtype on the CPU
        let y = cpu_kernels::elementwise::to_dtype(&self.emulated_f32(xd, w, b)?, self.out, Elementwise::Parallel)?;
        match residual {
            None => Ok(y),
            Some(r) => r + y.to_dtype(r.dtype())?,
        }
    }

    /// Emulated: act(xd Wᵀ + b) in f32, before any store.
    fn emulated_f32(&self, xd: &Tensor, w: &Tensor, b: &Tensor) -> candle_core::Result<Tensor> {
        cpu_kernels::trace::ran("fp8 gemm: emulated (E4M3 values, f32 GEMM)");
        if xd.device().is_cpu() {
            // stage 3's fused f32 GEMM + epilogue (the CPU has no FP8 to be faster with)
            return match self.gelu {
                true => stage3_fused::ops::linear_bias_gelu(xd, w, b),
                false => stage3_fused::ops::linear_bias(xd, w, b),
            };
        }
        // Plain ops on a GPU (stage 3's slow twins): its cuBLASLt f32 GEMM would compute in TF32.
        match self.gelu {
            true => stage3_fused::ops::linear_bias_gelu_slow(xd, w, b),
            false => stage3_fused::ops::linear_bias_slow(xd, w, b),
        }
    }

    /// The GEMM twin (the twin check, `twin::gemm_twin_tolerance`): this layer's GEMM run again
    /// on x quantised with the scale of the last forward (or, from a fused producer, on the very
    /// E4M3 tensor it wrote), and the f32 GEMM of the very same E4M3 operands with the same
    /// scales (+ bias, GELU) — only the accumulation (order and precision) and the output's
    /// store differ. Returns (fp8 GEMM, f32 twin), both (B, T, N). The scale state is not touched.
    pub fn gemm_twin(&self, x: &Input) -> candle_core::Result<(Tensor, Tensor)> {
        let (xq, xd, scale) = match x {
            Input::Plain(x) => {
                let scale = self
                    .last_input_scale()
                    .ok_or_else(|| candle_core::Error::Msg(format!("{}: the GEMM twin needs one forward first", self.name)))?;
                let xq = quantize(x, &scale)?; // the E4M3 operand the forward used
                let xd = dequantize(&xq, &scale, DType::F32)?; // s_x·q_x, exact in f32
                (Some(xq), xd, scale)
            }
            Input::Fp8(q) if q.data.device().is_cpu() => (None, q.data.clone(), q.scale.clone()), // s·q in f32 already
            Input::Fp8(q) => (Some(q.data.clone()), dequantize(&q.data, &q.scale, DType::F32)?, q.scale.clone()),
        };
        let got = self.gemm(xq.as_ref(), Some(&xd).filter(|_| self.emulated.is_some()), &scale, None)?;
        let (w, b) = (self.weight.dequantize(DType::F32)?, self.bias.to_dtype(DType::F32)?);
        // f32 GEMM (TF32 off: `Stage::switches`), + bias, GELU: stage 3's slow twins
        let want = match self.gelu {
            true => stage3_fused::ops::linear_bias_gelu_slow(&xd, &w, &b)?,
            false => stage3_fused::ops::linear_bias_slow(&xd, &w, &b)?,
        };
        Ok((got, want))
    }

    /// Whether this layer can write an E4M3 output for the next layer (`forward_e4m3`) for
    /// `tokens` input rows: always when emulated; through cuBLASLt, whether it offers an
    /// algorithm for that configuration (`cuda::has_algorithm`; fc1's GELU + bias epilogue with
    /// an E4M3 D is the one most likely to lack one).
    pub fn e4m3_output_supported(&self, tokens: usize) -> candle_core::Result<bool> {
        match self.mode() {
            Fp8Mode::Emulated => Ok(true),
            Fp8Mode::Cublaslt => self.cublaslt_e4m3_supported(tokens),
        }
    }

    #[cfg(feature = "cuda")]
    fn cublaslt_e4m3_supported(&self, tokens: usize) -> candle_core::Result<bool> {
        let (n, k) = self.weight.data.dims2()?;
        let dev = self.weight.data.device().as_cuda_device()?;
        crate::cuda::has_algorithm(dev, tokens, k, n, self.gelu, true, self.fast_accum)
    }

    #[cfg(not(feature = "cuda"))]
    fn cublaslt_e4m3_supported(&self, _tokens: usize) -> candle_core::Result<bool> {
        candle_core::bail!("{}: FP8 GEMMs through cuBLASLt need a build with --features cuda", self.name)
    }

    /// What the GEMM stores.
    pub fn out_dtype(&self) -> DType {
        self.out
    }

    /// The FP8 GEMM op over this layer's weight, bias and options, for an input of scale s_x.
    fn gemm_op(&self, x_scale: &Tensor) -> candle_core::Result<Fp8Gemm> {
        Ok(Fp8Gemm::new(x_scale, &self.weight.scale, &self.bias, self.gelu)?.with_fast_accum(self.fast_accum))
    }

    /// The GEMM through cuBLASLt (`gemm::Fp8Gemm`): q_x (B, T, K) → (B, T, N) bf16.
    fn forward_cublaslt(&self, xq: &Tensor, scale: &Tensor) -> candle_core::Result<Tensor> {
        self.gemm_op(scale)?.forward(xq, &self.weight.data)
    }

    /// The GEMM with an E4M3 output for `target` (cuBLASLt's D scale 1/s and amax_D).
    fn forward_cublaslt_e4m3(&self, xq: &Tensor, scale: &Tensor, target: &Fp8Target) -> candle_core::Result<Quantized> {
        crate::scale::reciprocal_into(&target.inv_scale, &target.scale)?; // cuBLASLt's D scale multiplies: 1/s
        let op = self.gemm_op(scale)?.with_e4m3_out(&target.inv_scale, &target.amax_bits)?;
        Ok(Quantized { data: op.forward(xq, &self.weight.data)?, scale: target.scale.clone() })
    }

    /// The weight in E4M3 with its scale.
    pub fn weight(&self) -> &Fp8Tensor {
        &self.weight
    }

    /// The bias as the GEMM reads it (in the output dtype: bf16 for cuBLASLt).
    pub fn bias(&self) -> &Tensor {
        &self.bias
    }

    pub fn gelu(&self) -> bool {
        self.gelu
    }

    /// The input scale the last forward used (None before the first).
    pub fn last_input_scale(&self) -> Option<Tensor> {
        self.state.lock().ok()?.last_scale()
    }

    /// Whether the last forward's input came quantised from a fused producer.
    pub fn last_input_fused(&self) -> bool {
        self.state.lock().is_ok_and(|s| s.last_fused())
    }

    /// The input amax history, oldest first (see `ScaleState::history`).
    pub fn input_amax_history(&self) -> candle_core::Result<Vec<f32>> {
        self.state.lock().map_err(|_| candle_core::Error::Msg("scale state poisoned".into()))?.history()
    }
}

/// A layer like candle-nn's `Linear`: `x.apply(&fc1)` in a model. Each call advances the input's
/// scale state (its amax history), hence the `Mutex` inside.
impl candle_nn::Module for Fp8Linear {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        Fp8Linear::forward(self, x)
    }
}

#[cfg(test)]
mod state_tests {
    use super::*;
    use candle_core::Device;

    /// Regression: each call replaced the state tensors, so the call
    /// captured by --cuda-graph freed the warm-up's scale inside the capture. Now the buffers
    /// are made once and overwritten; the history still rolls and the scale is still right.
    #[test]
    fn state_buffers_are_allocated_once_and_updated_in_place() {
        for recipe in [Fp8Recipe::Delayed, Fp8Recipe::Current] {
            let mut st = ScaleState::new(ScalingConfig { recipe, history_len: 3, margin: 0 }).unwrap();
            let x = |a: f32| Tensor::new(&[a, -a / 2.0], &Device::Cpu).unwrap();
            st.scale_for(&x(448.0)).unwrap();
            let ids = st.buffer_ids();
            assert!(ids.1.is_some() && ids.0.is_some() == (recipe == Fp8Recipe::Delayed));
            let mut scales = Vec::new();
            for a in [896.0, 224.0, 1792.0] {
                let s = st.scale_for(&x(a)).unwrap().to_scalar::<f32>().unwrap();
                assert_eq!(st.last_scale().unwrap().to_scalar::<f32>().unwrap(), s);
                assert_eq!(st.buffer_ids(), ids, "{recipe:?}: a state tensor was replaced");
                scales.push(s);
            }
            match recipe {
                // amax of the previous calls (window of 3): 448 | 448,448,896 | 448,896,224
                Fp8Recipe::Delayed => {
                    assert_eq!(scales, [1.0, 2.0, 2.0]);
                    assert_eq!(st.history().unwrap(), [896.0, 224.0, 1792.0]);
                }
                Fp8Recipe::Current => assert_eq!(scales, [2.0, 0.5, 4.0]),
            }
        }
    }

    /// The state on the in-place ops against the recipe spelled in candle's ops (the slow twins
    /// in `scale`): random inputs (sizes, magnitudes over 2⁻²⁰ to 2²⁰), both recipes, history
    /// lengths 1 to 5, margins −1 to 2, fused calls (`fused_target`, a producer, `finish_fused`)
    /// mixed in under delayed scaling. Every scale and the final history equal bit for bit.
    #[test]
    fn the_state_matches_the_recipe_in_plain_ops() {
        use crate::scale::{history_push_slow, scale_from_history_slow};
        use shared::weights::SplitMix64;
        let mut rng = SplitMix64::new(23);
        let values = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        for case in 0..24u64 {
            let recipe = if case % 2 == 0 { Fp8Recipe::Delayed } else { Fp8Recipe::Current };
            let (history_len, margin) = (1 + (case % 5) as usize, (case % 4) as i32 - 1);
            let mut st = ScaleState::new(ScalingConfig { recipe, history_len, margin }).unwrap();
            let mut history: Option<Tensor> = None; // the twin's window, (history_len)
            for call in 0..8u64 {
                let n = 1 + (rng.next_u64() % 3000) as usize;
                let mag = 2f32.powi((rng.next_u64() % 41) as i32 - 20);
                let v = SplitMix64::new(1000 * case + call).normals(n).into_iter().map(|x| x * mag).collect();
                let x = Tensor::from_vec(v, n, &Device::Cpu).unwrap();
                let a = amax_slow(&x).unwrap().reshape(1).unwrap(); // (1)
                let fused = history.is_some() && rng.next_u64().is_multiple_of(3);
                let (got, want) = match (&history, fused) {
                    (Some(h), true) => {
                        let target = st.fused_target().unwrap().expect("delayed scaling after a call has a target");
                        target.quantize(&x).unwrap(); // the producer: its amax into the layer's buffer
                        st.finish_fused().unwrap();
                        (target.scale.copy().unwrap(), scale_from_history_slow(h, margin).unwrap())
                    }
                    (Some(h), false) => (st.scale_for(&x).unwrap().copy().unwrap(), scale_from_history_slow(h, margin).unwrap()),
                    (None, _) => (st.scale_for(&x).unwrap().copy().unwrap(), scale_from_amax(&a, margin).unwrap()),
                };
                assert_eq!(values(&got), values(&want), "case {case} call {call} ({recipe:?}, fused {fused})");
                assert_eq!(values(&st.last_scale().unwrap()), values(&want));
                if recipe == Fp8Recipe::Delayed {
                    let h = history.clone().unwrap_or_else(|| Tensor::zeros(history_len, DType::F32, &Device::Cpu).unwrap());
                    history = Some(history_push_slow(&h, &a, call == 0).unwrap());
                }
            }
            assert_eq!(st.history().unwrap(), history.as_ref().map_or(Vec::new(), values), "case {case}: history");
        }
    }

    /// The two quantisers that record an amax (`quantize_recording`: E4M3 out; `Fp8Target::quantize`:
    /// s·q in f32 on the CPU) beside their slow twins on random inputs (sizes, magnitudes over
    /// 2⁻²⁰ to 2²⁰, f32 and bf16, scales that saturate the top): the values bit for bit, and the
    /// amax buffer holding the largest amax of the calls so far.
    #[test]
    fn the_recording_quantisers_match_their_slow_twins() {
        use shared::weights::SplitMix64;
        let mut rng = SplitMix64::new(11);
        for case in 0..12u64 {
            let target = Fp8Target::new(&Tensor::new(1.0f32, &Device::Cpu).unwrap()).unwrap();
            let bits = Tensor::zeros(1, DType::U32, &Device::Cpu).unwrap();
            let mut largest = 0f32;
            for call in 0..3u64 {
                let n = 1 + (rng.next_u64() % 5000) as usize;
                let mag = 2f32.powi((rng.next_u64() % 41) as i32 - 20);
                let v = SplitMix64::new(100 * case + call).normals(n).into_iter().map(|x| x * mag).collect();
                let x = Tensor::from_vec(v, n, &Device::Cpu).unwrap();
                let x = if case % 2 == 1 { x.to_dtype(DType::BF16).unwrap() } else { x };
                let a = amax_slow(&x).unwrap().to_scalar::<f32>().unwrap();
                largest = largest.max(a);
                let s = Tensor::new(0.7 * a / E4M3_MAX, &Device::Cpu).unwrap(); // the top 30 % saturates

                let q = quantize_recording(&x, &s, &bits).unwrap();
                let want = quantize_slow(&x, &s).unwrap();
                let (q, want) = (q.to_dtype(DType::F32).unwrap(), want.to_dtype(DType::F32).unwrap());
                assert_eq!(q.to_vec1::<f32>().unwrap(), want.to_vec1::<f32>().unwrap(), "case {case}: quantize_recording");
                assert_eq!(crate::scale::amax_value(&bits).unwrap(), largest, "case {case}: quantize_recording's amax");

                let target = Fp8Target { scale: s.clone(), ..target.clone() };
                let got = target.quantize(&x).unwrap();
                let (want, want_amax) = target.quantize_slow(&x).unwrap();
                assert_eq!(got.data.to_vec1::<f32>().unwrap(), want.to_vec1::<f32>().unwrap(), "case {case}: Fp8Target::quantize");
                assert_eq!(want_amax.to_scalar::<f32>().unwrap(), a);
                assert_eq!(target.amax().unwrap(), largest, "case {case}: Fp8Target::quantize's amax");
            }
        }
    }
}
