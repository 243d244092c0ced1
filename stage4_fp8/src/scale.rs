//! An activation's FP8 scale state as buffers, and the in-place ops that update them.
//!
//! One set of buffers per activation (`ScaleBuffers`: amax, scale, amax history, 1/scale), made
//! by the first call on the activation's device and from then on only written in place, by
//! candle in-place ops (`InplaceOp1/2`). Each op's CPU forward does exactly what its kernel in
//! `kernels/fp8.cu` does; its CUDA forward is that kernel's launch (`quant_cuda`). Nothing is
//! allocated or freed after the first call, so a CUDA graph captures the whole update — no host
//! round trip, no `cuMemFreeAsync` of memory the capture did not allocate — and every replay
//! advances the same buffers.
//!
//! | op                        | writes            | kernel                   | update                         |
//! |---------------------------|-------------------|--------------------------|--------------------------------|
//! | `amax_into`               | amax              | `fp8_amax_*`             | amax ← max(amax, max\|x\|)     |
//! | `scale_from_amax_into`    | scale; amax ← 0   | `fp8_scale_from_amax`    | s ← max(amax, 2⁻¹²⁶)·2^m / 448 |
//! | `scale_from_history_into` | scale             | `fp8_scale_from_history` | s ← max(history)·2^m / 448     |
//! | `history_push_into`       | history; amax ← 0 | `fp8_history_push`       | history ← roll(history, amax)  |
//! | `reciprocal_into`         | 1/scale           | `fp8_reciprocal`         | inv ← 1/s                      |
//!
//! The amax is held as its f32 bits in a u32 on every device: for non-negative floats the bit
//! patterns order like unsigned integers, so the kernels' `atomicMax` on the bits is a float
//! max, and the CPU's integer max is the same max. A NaN is made the canonical positive NaN,
//! whose bits beat every number's: a NaN input gives a NaN amax and scale, as on the GPU.
//! Two ops write a second buffer (the amax, cleared once consumed, so the next call starts from
//! zero with no memset): that buffer is held by the op, as stage 3's ops hold their fourth
//! input, and the kernel writes it through its pointer (on the CPU: candle's `zero_set`).
//!
//! Slow twins: the same updates in candle's ops, returning new tensors (`*_slow`).

use crate::fp8::E4M3_MAX;
use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, DType, InplaceOp1, InplaceOp2, Layout, Storage, Tensor};
use rayon::prelude::*;

/// One activation's scale state, on the activation's device.
#[derive(Debug)]
pub struct ScaleBuffers {
    /// (1) u32: the running amax's f32 bits; zero between calls (the push and
    /// `scale_from_amax_into` clear it).
    pub amax_bits: Tensor,
    /// (1) f32: the scale of the last call, read by the GEMM through its pointer.
    pub scale: Tensor,
    /// (history_len) f32, oldest first (delayed scaling).
    pub history: Tensor,
    /// (1) f32: 1/scale, for a producer GEMM writing E4M3 (cuBLASLt's D scale multiplies).
    pub inv_scale: Tensor,
}

impl ScaleBuffers {
    pub fn new(dev: &candle_core::Device, history_len: usize) -> candle_core::Result<ScaleBuffers> {
        Ok(ScaleBuffers {
            amax_bits: Tensor::zeros(1, DType::U32, dev)?,
            scale: Tensor::zeros(1, DType::F32, dev)?,
            history: Tensor::zeros(history_len, DType::F32, dev)?,
            inv_scale: Tensor::zeros(1, DType::F32, dev)?,
        })
    }
}

/// The f32 an amax buffer holds ((1) u32 of f32 bits), read on the host: for tests and reports.
pub fn amax_value(amax_bits: &Tensor) -> candle_core::Result<f32> {
    Ok(f32::from_bits(amax_bits.flatten_all()?.to_vec1::<u32>()?[0]))
}

// ---------------------------------------------------------------------------------------------
// amax ← max(amax, max|x|)
// ---------------------------------------------------------------------------------------------

/// amax_bits ← max(amax_bits, max|x|) as f32 bits. amax_bits: (1) u32; x: any shape, f32, bf16
/// or f16 (f16 goes to the CUDA kernel as f32).
pub fn amax_into(amax_bits: &Tensor, x: &Tensor) -> candle_core::Result<()> {
    let x = if x.device().is_cuda() && x.dtype() == DType::F16 { x.to_dtype(DType::F32)? } else { x.contiguous()? };
    amax_bits.inplace_op2(&x, &AmaxInto)
}

/// Slow twin of `amax_into`, on an f32 amax: max(amax, max|x|) in candle's ops, a new (1) tensor.
pub fn amax_into_slow(amax: &Tensor, x: &Tensor) -> candle_core::Result<Tensor> {
    amax.maximum(&crate::fp8::amax_slow(x)?.reshape(1)?)
}

/// max|v| of f32 values given as their bits (`bits_of`), as the kernel takes it: NaN made the
/// canonical positive NaN. |v|'s bits are v's with the sign cleared, and an integer max over
/// them is the float max (the loop vectorises, unlike a NaN-keeping float max).
pub(crate) fn max_abs_bits<T: Copy + Sync>(v: &[T], bits_of: impl Fn(T) -> u32 + Sync) -> u32 {
    let m = v.par_chunks(16 * 1024).map(|c| c.iter().fold(0u32, |m, &x| m.max(bits_of(x) & 0x7fff_ffff))).reduce(|| 0, u32::max);
    if m > f32::INFINITY.to_bits() {
        0x7fc0_0000 // NaN
    } else {
        m
    }
}

/// The op behind `amax_into`: dst the (1) u32 amax buffer, src x (contiguous).
struct AmaxInto;

impl InplaceOp2 for AmaxInto {
    fn name(&self) -> &'static str {
        "speedkit-fp8-amax-into"
    }

    fn cpu_fwd(&self, dst: &mut CpuStorage, dl: &Layout, xs: &CpuStorage, xl: &Layout) -> candle_core::Result<()> {
        let Some((a, b)) = xl.contiguous_offsets() else { candle_core::bail!("amax_into: x must be contiguous") };
        let m = match xs {
            CpuStorage::F32(v) => max_abs_bits(&v[a..b], f32::to_bits),
            CpuStorage::BF16(v) => max_abs_bits(&v[a..b], |x| x.to_f32().to_bits()),
            CpuStorage::F16(v) => max_abs_bits(&v[a..b], |x| x.to_f32().to_bits()),
            x => candle_core::bail!("amax_into: unsupported dtype {:?} (f32, bf16 or f16)", x.dtype()),
        };
        let bits = u32_slot(dst, dl, "amax_into")?;
        *bits = (*bits).max(m); // the kernel's atomicMax on the bits
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        dst: &mut candle_core::CudaStorage,
        dl: &Layout,
        xs: &candle_core::CudaStorage,
        xl: &Layout,
    ) -> candle_core::Result<()> {
        crate::quant_cuda::amax_into_fwd(dst, dl, xs, xl)
    }
}

// ---------------------------------------------------------------------------------------------
// the scale
// ---------------------------------------------------------------------------------------------

/// s = max(amax, 2⁻¹²⁶)·2^m / 448 (the kernels' `scale_of`); a NaN amax gives a NaN scale.
fn scale_of(amax: f32, pow2_margin: f32) -> f32 {
    if amax.is_nan() {
        amax
    } else {
        amax.max(f32::MIN_POSITIVE) * (pow2_margin / E4M3_MAX)
    }
}

/// Current scaling: scale ← max(amax, 2⁻¹²⁶)·2^margin / 448 from the amax buffer, which is then
/// cleared for the next call. scale: (1) f32; amax_bits: (1) u32.
pub fn scale_from_amax_into(scale: &Tensor, amax_bits: &Tensor, margin: i32) -> candle_core::Result<()> {
    scale.inplace_op1(&ScaleFromAmax { amax_bits: amax_bits.clone(), pow2_margin: 2f32.powi(margin) })
}

// Slow twin of `scale_from_amax_into`: `fp8::scale_from_amax` (candle's maximum and affine).

/// The op behind `scale_from_amax_into`: dst the (1) f32 scale; the amax buffer held, read and
/// cleared (the kernel writes both).
struct ScaleFromAmax {
    amax_bits: Tensor,
    pow2_margin: f32,
}

impl InplaceOp1 for ScaleFromAmax {
    fn name(&self) -> &'static str {
        "speedkit-fp8-scale-from-amax"
    }

    fn cpu_fwd(&self, dst: &mut CpuStorage, dl: &Layout) -> candle_core::Result<()> {
        let a = f32::from_bits(held_u32(&self.amax_bits, "scale_from_amax_into")?);
        *f32_slot(dst, dl, "scale_from_amax_into")? = scale_of(a, self.pow2_margin);
        self.amax_bits.zero_set() // the kernel's `*amax_bits = 0`
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, dst: &mut candle_core::CudaStorage, dl: &Layout) -> candle_core::Result<()> {
        let (bits, bl) = self.amax_bits.storage_and_layout();
        let Storage::Cuda(bits) = &*bits else { candle_core::bail!("scale_from_amax_into: the amax buffer is not on the GPU") };
        crate::quant_cuda::scale_from_amax_fwd(dst, dl, bits, bl, self.pow2_margin)
    }
}

/// Delayed scaling: scale ← max(history)·2^margin / 448, known before the next input exists.
/// scale: (1) f32; history: (len) f32.
pub fn scale_from_history_into(scale: &Tensor, history: &Tensor, margin: i32) -> candle_core::Result<()> {
    scale.inplace_op2(history, &ScaleFromHistory { pow2_margin: 2f32.powi(margin) })
}

/// Slow twin of `scale_from_history_into`: candle's max over the history, then `scale_from_amax`.
pub fn scale_from_history_slow(history: &Tensor, margin: i32) -> candle_core::Result<Tensor> {
    crate::fp8::scale_from_amax(&history.max(0)?, margin)?.reshape(1)
}

/// The op behind `scale_from_history_into`: dst the (1) f32 scale, src the history.
struct ScaleFromHistory {
    pow2_margin: f32,
}

impl InplaceOp2 for ScaleFromHistory {
    fn name(&self) -> &'static str {
        "speedkit-fp8-scale-from-history"
    }

    fn cpu_fwd(&self, dst: &mut CpuStorage, dl: &Layout, hs: &CpuStorage, hl: &Layout) -> candle_core::Result<()> {
        let h = f32_values(hs, hl, "scale_from_history_into")?;
        // from 0, keeping NaN, as the kernel's loop
        let a = h.iter().fold(0f32, |m, &v| if m.is_nan() || m > v { m } else { v });
        *f32_slot(dst, dl, "scale_from_history_into")? = scale_of(a, self.pow2_margin);
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        dst: &mut candle_core::CudaStorage,
        dl: &Layout,
        hs: &candle_core::CudaStorage,
        hl: &Layout,
    ) -> candle_core::Result<()> {
        crate::quant_cuda::scale_from_history_fwd(dst, dl, hs, hl, self.pow2_margin)
    }
}

// ---------------------------------------------------------------------------------------------
// the history, and 1/s
// ---------------------------------------------------------------------------------------------

/// Delayed scaling: the amax in the buffer joins the history (oldest dropped, newest last); with
/// `fill` (the first call) it fills every slot. The amax buffer is then cleared. history: (len)
/// f32; amax_bits: (1) u32.
pub fn history_push_into(history: &Tensor, amax_bits: &Tensor, fill: bool) -> candle_core::Result<()> {
    history.inplace_op1(&HistoryPush { amax_bits: amax_bits.clone(), fill })
}

/// Slow twin of `history_push_into`, on an f32 amax (1): the window rolled with candle's narrow
/// and cat, or filled by a broadcast. A new (len) tensor.
pub fn history_push_slow(history: &Tensor, amax: &Tensor, fill: bool) -> candle_core::Result<Tensor> {
    let n = history.dim(0)?;
    let a = amax.reshape(1)?; // (1)
    match (fill, n) {
        (true, _) | (_, 1) => a.broadcast_as(n)?.contiguous(),
        _ => Tensor::cat(&[&history.narrow(0, 1, n - 1)?, &a], 0), // drop the oldest, append the newest
    }
}

/// The op behind `history_push_into`: dst the (len) f32 history; the amax buffer held, read and
/// cleared (the kernel writes both).
struct HistoryPush {
    amax_bits: Tensor,
    fill: bool,
}

impl InplaceOp1 for HistoryPush {
    fn name(&self) -> &'static str {
        "speedkit-fp8-history-push"
    }

    fn cpu_fwd(&self, dst: &mut CpuStorage, dl: &Layout) -> candle_core::Result<()> {
        let a = f32::from_bits(held_u32(&self.amax_bits, "history_push_into")?);
        let (CpuStorage::F32(h), Some((start, end))) = (dst, dl.contiguous_offsets()) else {
            candle_core::bail!("history_push_into: the history must be a contiguous f32 buffer")
        };
        let h = &mut h[start..end];
        match self.fill {
            true => h.fill(a),
            false => {
                h.rotate_left(1); // the oldest moves to the end, where the newest replaces it
                if let Some(last) = h.last_mut() {
                    *last = a;
                }
            }
        }
        self.amax_bits.zero_set() // the kernel's `*amax_bits = 0`
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, dst: &mut candle_core::CudaStorage, dl: &Layout) -> candle_core::Result<()> {
        let (bits, bl) = self.amax_bits.storage_and_layout();
        let Storage::Cuda(bits) = &*bits else { candle_core::bail!("history_push_into: the amax buffer is not on the GPU") };
        crate::quant_cuda::history_push_fwd(dst, dl, bits, bl, self.fill)
    }
}

/// inv_scale ← 1/scale, both (1) f32: the quantisation factor cuBLASLt's D scale multiplies by.
pub fn reciprocal_into(inv_scale: &Tensor, scale: &Tensor) -> candle_core::Result<()> {
    inv_scale.inplace_op2(scale, &Reciprocal)
}

/// Slow twin of `reciprocal_into`: candle's `recip`.
pub fn reciprocal_slow(scale: &Tensor) -> candle_core::Result<Tensor> {
    scale.reshape(1)?.recip()
}

/// The op behind `reciprocal_into`: dst the (1) f32 1/s, src the scale (one f32).
struct Reciprocal;

impl InplaceOp2 for Reciprocal {
    fn name(&self) -> &'static str {
        "speedkit-fp8-reciprocal"
    }

    fn cpu_fwd(&self, dst: &mut CpuStorage, dl: &Layout, ss: &CpuStorage, sl: &Layout) -> candle_core::Result<()> {
        let s = f32_values(ss, sl, "reciprocal_into")?.first().copied().unwrap_or(f32::NAN);
        *f32_slot(dst, dl, "reciprocal_into")? = 1.0 / s;
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        dst: &mut candle_core::CudaStorage,
        dl: &Layout,
        ss: &candle_core::CudaStorage,
        sl: &Layout,
    ) -> candle_core::Result<()> {
        crate::quant_cuda::reciprocal_fwd(dst, dl, ss, sl)
    }
}

// ---------------------------------------------------------------------------------------------
// CPU storage access
// ---------------------------------------------------------------------------------------------

/// The first element of a one-value u32 buffer, to write.
fn u32_slot<'a>(s: &'a mut CpuStorage, l: &Layout, op: &str) -> candle_core::Result<&'a mut u32> {
    match s {
        CpuStorage::U32(v) => v.get_mut(l.start_offset()).ok_or_else(|| candle_core::Error::Msg(format!("{op}: empty buffer"))),
        s => candle_core::bail!("{op}: the amax buffer is u32 (f32 bits), got {:?}", s.dtype()),
    }
}

/// The first element of a one-value f32 buffer, to write.
fn f32_slot<'a>(s: &'a mut CpuStorage, l: &Layout, op: &str) -> candle_core::Result<&'a mut f32> {
    match s {
        CpuStorage::F32(v) => v.get_mut(l.start_offset()).ok_or_else(|| candle_core::Error::Msg(format!("{op}: empty buffer"))),
        s => candle_core::bail!("{op}: the buffer is f32, got {:?}", s.dtype()),
    }
}

/// A contiguous f32 storage's values.
fn f32_values<'a>(s: &'a CpuStorage, l: &Layout, op: &str) -> candle_core::Result<&'a [f32]> {
    match (s, l.contiguous_offsets()) {
        (CpuStorage::F32(v), Some((a, b))) => Ok(&v[a..b]),
        _ => candle_core::bail!("{op}: expected a contiguous f32 buffer"),
    }
}

/// The value of a held one-value u32 CPU buffer (the amax an op reads besides its operands).
fn held_u32(t: &Tensor, op: &str) -> candle_core::Result<u32> {
    let (s, l) = t.storage_and_layout();
    match &*s {
        Storage::Cpu(CpuStorage::U32(v)) => {
            v.get(l.start_offset()).copied().ok_or_else(|| candle_core::Error::Msg(format!("{op}: empty buffer")))
        }
        _ => candle_core::bail!("{op}: the amax buffer must be a u32 CPU tensor here"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;
    use shared::weights::SplitMix64;

    /// Each in-place op beside its slow twin, on random inputs (lengths, magnitudes over 2⁻¹²⁰ to
    /// 2¹²⁰, zeros, margins): the buffers after a chain of updates equal the twins' results bit
    /// for bit, and the ops that consume the amax leave its buffer cleared.
    #[test]
    fn the_scale_ops_match_their_slow_twins() {
        let cpu = Device::Cpu;
        let mut rng = SplitMix64::new(7);
        let mut uniform = move || (rng.next_u64() >> 40) as f32 / (1u64 << 24) as f32; // [0, 1)
        for case in 0..40 {
            let len = 1 + (case % 5);
            let margin = (case % 4) as i32 - 1;
            let b = ScaleBuffers::new(&cpu, len).unwrap();
            let mut history = Tensor::zeros(len, DType::F32, &cpu).unwrap(); // the twin's state
            for call in 0..6 {
                let n = 1 + (uniform() * 3000.0) as usize;
                let mag = 2f32.powf(uniform() * 240.0 - 120.0);
                let zero = case % 7 == 0 && call == 2; // an all-zero input: the 2⁻¹²⁶ floor
                let v: Vec<f32> = (0..n).map(|_| if zero { 0.0 } else { (uniform() * 2.0 - 1.0) * mag }).collect();
                let x = Tensor::from_vec(v, n, &cpu).unwrap();
                let x = if call % 2 == 1 { x.to_dtype(DType::BF16).unwrap() } else { x };

                // amax, then the current scale from it (which clears the buffer)
                amax_into(&b.amax_bits, &x).unwrap();
                let want_amax = amax_into_slow(&Tensor::zeros(1, DType::F32, &cpu).unwrap(), &x).unwrap();
                assert_eq!(amax_value(&b.amax_bits).unwrap(), want_amax.to_vec1::<f32>().unwrap()[0], "case {case}: amax");
                scale_from_amax_into(&b.scale, &b.amax_bits, margin).unwrap();
                let want = crate::fp8::scale_from_amax(&want_amax, margin).unwrap();
                assert_eq!(b.scale.to_vec1::<f32>().unwrap(), want.to_vec1::<f32>().unwrap(), "case {case}: scale from amax");
                assert_eq!(amax_value(&b.amax_bits).unwrap(), 0.0, "case {case}: scale_from_amax_into clears the amax");

                // the amax again, into the history (the first call fills it), then the delayed scale
                amax_into(&b.amax_bits, &x).unwrap();
                history_push_into(&b.history, &b.amax_bits, call == 0).unwrap();
                history = history_push_slow(&history, &want_amax, call == 0).unwrap();
                assert_eq!(b.history.to_vec1::<f32>().unwrap(), history.to_vec1::<f32>().unwrap(), "case {case}: history");
                assert_eq!(amax_value(&b.amax_bits).unwrap(), 0.0, "case {case}: the push clears the amax");
                scale_from_history_into(&b.scale, &b.history, margin).unwrap();
                let want = scale_from_history_slow(&history, margin).unwrap();
                assert_eq!(b.scale.to_vec1::<f32>().unwrap(), want.to_vec1::<f32>().unwrap(), "case {case}: scale from history");
                reciprocal_into(&b.inv_scale, &b.scale).unwrap();
                let want = reciprocal_slow(&b.scale).unwrap();
                assert_eq!(b.inv_scale.to_vec1::<f32>().unwrap(), want.to_vec1::<f32>().unwrap(), "case {case}: 1/s");
            }
        }
    }

    /// The amax is a max across calls until a push consumes it (a producer's rows and a GEMM's
    /// epilogue both add to it), and a NaN wins it as on the GPU.
    #[test]
    fn the_amax_buffer_keeps_the_largest_and_nan() {
        let cpu = Device::Cpu;
        let b = ScaleBuffers::new(&cpu, 2).unwrap();
        for (v, want) in [(&[1.0f32, -3.0][..], 3.0), (&[2.0, 0.5], 3.0), (&[-7.5, 0.0], 7.5)] {
            amax_into(&b.amax_bits, &Tensor::new(v, &cpu).unwrap()).unwrap();
            assert_eq!(amax_value(&b.amax_bits).unwrap(), want);
        }
        amax_into(&b.amax_bits, &Tensor::new(&[f32::NAN, -1.0], &cpu).unwrap()).unwrap();
        assert!(amax_value(&b.amax_bits).unwrap().is_nan());
        scale_from_amax_into(&b.scale, &b.amax_bits, 0).unwrap();
        assert!(b.scale.to_vec1::<f32>().unwrap()[0].is_nan(), "a NaN amax gives a NaN scale");
    }
}
