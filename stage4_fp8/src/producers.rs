//! Quantisation fused into the producers (`--fp8-fusions ln`): stage 3's two LayerNorms, writing
//! the next GEMM's input in E4M3 instead of in the activation dtype, and recording its amax for
//! that GEMM's history. The GEMM (qkv after ln1, fc1 after ln2) then skips its own quantise
//! pass: one read and one write of a (B, T, C) tensor fewer, and a launch fewer, per LayerNorm.
//! (fc1 writing E4M3 for fc2 is `Fp8Linear::forward_e4m3`: cuBLASLt's D scale and amax_D.)
//!
//! The scale must be known before the LayerNorm writes, so these need delayed scaling
//! (`Fp8Target`: the consumer's scale from its amax history), as in TransformerEngine.
//!
//! Each is a candle custom op holding the target's buffers (its scale, its amax buffer), as
//! stage 3's ops hold their fourth input. CUDA: one launch each, stage 3's LayerNorm row
//! (`add_layer_norm.cu`) with an E4M3 store (`kernels/ln_fp8.cu`, fp8.cu's cast and amax). CPU:
//! stage 3's LayerNorm row in f32, then the target's quantiser (`fp8::quantize_recording_cpu`)
//! over the op's own output — the same values quantised with the same scale, s·q held in f32.
//! Slow twins: stage 3's plain-ops LayerNorm, then candle's casts with the target's scale.

use crate::fp8::{amax_slow, dequantize_slow, quantize_recording_cpu, quantize_slow, Fp8Target, Quantized};
use candle_core::op::BackpropOp;
use candle_core::{CpuStorage, CustomOp3, DType, Layout, Shape, Storage, Tensor};
use stage3_fused::ops::{
    add_layer_norm_rows, add_layer_norm_slow, check_norm_params, f32_values, layer_norm_rows, layer_norm_slow, LN_EPS,
};
use std::sync::Mutex;

/// q = E4M3(LayerNorm(x) / s) with the consumer's scale s (`target`), amax(LayerNorm(x)) maxed
/// into its amax buffer. x: (B, T, C), f32 (other dtypes are widened first); g, b: (C).
pub fn layer_norm_e4m3(x: &Tensor, g: &Tensor, b: &Tensor, target: &Fp8Target) -> candle_core::Result<Quantized> {
    cpu_kernels::trace::ran("fp8 producer: layer_norm writing E4M3");
    let (x, g, b) = (f32_contiguous(x)?, f32_contiguous(g)?, f32_contiguous(b)?);
    check_norm_params(&x, &g, &b, "layer_norm_e4m3")?;
    let op = LayerNormE4m3 { scale: target.scale.clone(), amax_bits: target.amax_bits.clone(), eps: LN_EPS };
    Ok(Quantized { data: x.apply_op3_no_bwd(&g, &b, &op)?, scale: target.scale.clone() })
}

/// Slow twin of `layer_norm_e4m3`: stage 3's plain-ops LayerNorm in f32, candle's casts to E4M3
/// and back with s, candle's amax. (s·q in f32, amax rank 0); no buffer is touched.
pub fn layer_norm_e4m3_slow(x: &Tensor, g: &Tensor, b: &Tensor, scale: &Tensor) -> candle_core::Result<(Tensor, Tensor)> {
    let h = layer_norm_slow(&x.to_dtype(DType::F32)?, g, b, LN_EPS, DType::F32)?;
    Ok((dequantize_slow(&quantize_slow(&h, scale)?, scale, DType::F32)?, amax_slow(&h)?))
}

/// The op behind `layer_norm_e4m3`: inputs x (…, C), g (C), b (C), f32 and contiguous; the
/// target's scale (one f32) and amax buffer ((1) u32) held. Output q: E4M3 on CUDA, s·q in f32
/// on the CPU.
struct LayerNormE4m3 {
    scale: Tensor,
    amax_bits: Tensor,
    eps: f32,
}

impl CustomOp3 for LayerNormE4m3 {
    fn name(&self) -> &'static str {
        "speedkit-fp8-layer-norm-e4m3"
    }

    fn cpu_fwd(
        &self,
        xs: &CpuStorage,
        xl: &Layout,
        gs: &CpuStorage,
        gl: &Layout,
        bs: &CpuStorage,
        bl: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let c = xl.shape().dims().last().copied().unwrap_or(1).max(1);
        let (x, g, b) = (f32_values(xs, xl, "x")?, f32_values(gs, gl, "g")?, f32_values(bs, bl, "b")?);
        let mut h = layer_norm_rows(&x, &g, &b, self.eps, c);
        quantize_recording_cpu(&mut h, held_scale(&self.scale)?, &self.amax_bits, "a fused LayerNorm's output")?;
        Ok((CpuStorage::F32(h), xl.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        xs: &candle_core::CudaStorage,
        xl: &Layout,
        gs: &candle_core::CudaStorage,
        gl: &Layout,
        bs: &candle_core::CudaStorage,
        bl: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        let ((ss, sl), (ab, al)) = (self.scale.storage_and_layout(), self.amax_bits.storage_and_layout());
        let (Storage::Cuda(ss), Storage::Cuda(ab)) = (&*ss, &*ab) else {
            candle_core::bail!("layer_norm_e4m3: the target's buffers are not on the GPU")
        };
        let q = crate::quant_cuda::layer_norm_e4m3_fwd((xs, xl), (gs, gl), (bs, bl), (ss, sl), (ab, al))?; // one launch
        Ok((q, xl.shape().clone()))
    }
}

/// (x + branch, E4M3(LayerNorm(x + branch) / s)) with the consumer's scale s, amax recorded.
/// x: (B, T, C) f32; branch: same shape, the activation dtype (bf16 on CUDA).
pub fn add_layer_norm_e4m3(
    x: &Tensor,
    branch: &Tensor,
    g: &Tensor,
    b: &Tensor,
    target: &Fp8Target,
) -> candle_core::Result<(Tensor, Quantized)> {
    cpu_kernels::trace::ran("fp8 producer: add+layer_norm writing E4M3");
    if x.dims() != branch.dims() || x.dtype() != DType::F32 {
        candle_core::bail!("add_layer_norm_e4m3: x {:?} ({:?}) and branch {:?} must match, x in f32", x.dims(), x.dtype(), branch.dims());
    }
    // The CUDA kernel reads a bf16 branch (the activation dtype there).
    let branch = if x.device().is_cuda() { branch.to_dtype(DType::BF16)? } else { branch.clone() };
    let (x, branch, g, b) = (x.contiguous()?, branch.contiguous()?, f32_contiguous(g)?, f32_contiguous(b)?);
    check_norm_params(&x, &g, &b, "add_layer_norm_e4m3")?;
    let op = AddLayerNormE4m3 { b, scale: target.scale.clone(), amax_bits: target.amax_bits.clone(), eps: LN_EPS, x_out: Mutex::new(None) };
    let data = x.apply_op3_no_bwd(&branch, &g, &op)?;
    let x_out = op.x_out.lock().map_err(|_| candle_core::Error::Msg("add_layer_norm_e4m3: poisoned lock".into()))?.take();
    let x_out = x_out.ok_or_else(|| candle_core::Error::Msg("add_layer_norm_e4m3: the forward wrote no residual".into()))?;
    let x_new = Tensor::from_storage(x_out, x.shape(), BackpropOp::none(), false);
    Ok((x_new, Quantized { data, scale: target.scale.clone() }))
}

/// Slow twin of `add_layer_norm_e4m3`: stage 3's plain-ops add and LayerNorm in f32, then as
/// `layer_norm_e4m3_slow`. (x + branch, s·q in f32, amax rank 0); no buffer is touched.
pub fn add_layer_norm_e4m3_slow(
    x: &Tensor,
    branch: &Tensor,
    g: &Tensor,
    b: &Tensor,
    scale: &Tensor,
) -> candle_core::Result<(Tensor, Tensor, Tensor)> {
    let (x_new, h) = add_layer_norm_slow(x, &branch.to_dtype(DType::F32)?, g, b, LN_EPS)?; // h in the branch's dtype: f32
    Ok((x_new, dequantize_slow(&quantize_slow(&h, scale)?, scale, DType::F32)?, amax_slow(&h)?))
}

/// The op behind `add_layer_norm_e4m3`: inputs x (…, C) f32, branch (…, C) (CPU: f32, bf16 or
/// f16; CUDA: bf16), g (C) f32, contiguous. Four inputs and two outputs, as stage 3's
/// `AddLayerNorm`: b is held and read inside the forward, x + branch (f32) is left in `x_out`
/// for the caller; the target's scale and amax buffer are held too.
struct AddLayerNormE4m3 {
    b: Tensor,
    scale: Tensor,
    amax_bits: Tensor,
    eps: f32,
    x_out: Mutex<Option<Storage>>,
}

impl AddLayerNormE4m3 {
    fn put_x_out(&self, s: Storage) -> candle_core::Result<()> {
        *self.x_out.lock().map_err(|_| candle_core::Error::Msg("add_layer_norm_e4m3: poisoned lock".into()))? = Some(s);
        Ok(())
    }
}

impl CustomOp3 for AddLayerNormE4m3 {
    fn name(&self) -> &'static str {
        "speedkit-fp8-add-layer-norm-e4m3"
    }

    fn cpu_fwd(
        &self,
        xs: &CpuStorage,
        xl: &Layout,
        brs: &CpuStorage,
        brl: &Layout,
        gs: &CpuStorage,
        gl: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let c = xl.shape().dims().last().copied().unwrap_or(1).max(1);
        let (bs, bl) = self.b.storage_and_layout();
        let Storage::Cpu(bs) = &*bs else { candle_core::bail!("add_layer_norm_e4m3: b is not on the CPU") };
        let (x, br, g, b) = (f32_values(xs, xl, "x")?, f32_values(brs, brl, "branch")?, f32_values(gs, gl, "g")?, f32_values(bs, bl, "b")?);
        let (x_out, mut h) = add_layer_norm_rows(&x, &br, &g, &b, self.eps, c);
        quantize_recording_cpu(&mut h, held_scale(&self.scale)?, &self.amax_bits, "a fused LayerNorm's output")?;
        self.put_x_out(Storage::Cpu(CpuStorage::F32(x_out)))?;
        Ok((CpuStorage::F32(h), xl.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        xs: &candle_core::CudaStorage,
        xl: &Layout,
        brs: &candle_core::CudaStorage,
        brl: &Layout,
        gs: &candle_core::CudaStorage,
        gl: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        let ((bs, bl), (ss, sl), (ab, al)) =
            (self.b.storage_and_layout(), self.scale.storage_and_layout(), self.amax_bits.storage_and_layout());
        let (Storage::Cuda(bs), Storage::Cuda(ss), Storage::Cuda(ab)) = (&*bs, &*ss, &*ab) else {
            candle_core::bail!("add_layer_norm_e4m3: b and the target's buffers must be on the GPU")
        };
        let (x_out, q) = crate::quant_cuda::add_layer_norm_e4m3_fwd((xs, xl), (brs, brl), (gs, gl), (bs, bl), (ss, sl), (ab, al))?; // one launch
        self.put_x_out(Storage::Cuda(x_out))?;
        Ok((q, xl.shape().clone()))
    }
}

fn f32_contiguous(t: &Tensor) -> candle_core::Result<Tensor> {
    t.to_dtype(DType::F32)?.contiguous()
}

/// The target's scale, one f32 held by the op, read on the CPU.
fn held_scale(scale: &Tensor) -> candle_core::Result<f32> {
    let (s, l) = scale.storage_and_layout();
    match &*s {
        Storage::Cpu(CpuStorage::F32(v)) => {
            v.get(l.start_offset()).copied().ok_or_else(|| candle_core::Error::Msg("empty FP8 scale".into()))
        }
        _ => candle_core::bail!("fused LayerNorm: the target's scale must be an f32 CPU tensor here"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;
    use shared::check::compare_within;
    use shared::weights::SplitMix64;

    fn randn(dims: &[usize], seed: u64, scale: f32, offset: f32) -> Tensor {
        let v = SplitMix64::new(seed).normals(dims.iter().product()).into_iter().map(|x| x * scale + offset).collect();
        Tensor::from_vec(v, dims, &Device::Cpu).unwrap()
    }

    /// Both producers beside their slow twins on random shapes, twice into one target: s·q
    /// within one E4M3 step where the two LayerNorms' f32 values straddle a rounding boundary
    /// (≤ 1e-2 in the norm), the residual to f32 rounding, and the target's amax buffer holding
    /// the larger of the two calls' amax (maxed into, not overwritten).
    #[test]
    fn the_fused_producers_match_their_slow_twins() {
        let mut rng = SplitMix64::new(31);
        for case in 0..8u64 {
            let (rows, c) = (1 + (rng.next_u64() % 30) as usize, 1 + (rng.next_u64() % 400) as usize);
            let (g, b) = (randn(&[c], case, 0.1, 1.0), randn(&[c], case + 50, 0.1, 0.0));
            let add = case % 2 == 1;
            let mut amaxes = Vec::new();
            let target = Fp8Target::new(&Tensor::new(0.01f32, &Device::Cpu).unwrap()).unwrap();
            for call in 0..2u64 {
                let x = randn(&[1, rows, c], 100 + 2 * case + call, 1.0 + call as f32, 0.5);
                let branch = randn(&[1, rows, c], 300 + 2 * case + call, 1.0, 0.0).to_dtype(DType::BF16).unwrap();
                let (got, want, want_amax) = match add {
                    true => {
                        let (x_new, q) = add_layer_norm_e4m3(&x, &branch, &g, &b, &target).unwrap();
                        let (x_slow, want, a) = add_layer_norm_e4m3_slow(&x, &branch, &g, &b, &target.scale).unwrap();
                        assert!(compare_within(&x_new, &x_slow, 1e-7).unwrap().passed, "case {case}: x + branch");
                        (q, want, a)
                    }
                    false => {
                        let (want, a) = layer_norm_e4m3_slow(&x, &g, &b, &target.scale).unwrap();
                        (layer_norm_e4m3(&x, &g, &b, &target).unwrap(), want, a)
                    }
                };
                let r = compare_within(&got.data, &want, 1e-2).unwrap();
                assert!(r.passed, "case {case} ({rows}, {c}) add={add}: {r:?}");
                amaxes.push(want_amax.to_scalar::<f32>().unwrap());
                let (got_a, want_a) = (target.amax().unwrap(), amaxes.iter().copied().fold(0f32, f32::max));
                assert!((got_a - want_a).abs() <= 1e-5 * want_a, "case {case} call {call}: amax {got_a} vs {want_a}");
            }
        }
    }

    /// A non-finite LayerNorm output is refused on the CPU with the reason, not quantised.
    #[test]
    fn a_non_finite_output_is_refused() {
        let x = Tensor::new(&[[[1.0f32, f32::INFINITY, 2.0]]], &Device::Cpu).unwrap();
        let (g, b) = (randn(&[3], 1, 0.1, 1.0), randn(&[3], 2, 0.1, 0.0));
        let target = Fp8Target::new(&Tensor::new(1.0f32, &Device::Cpu).unwrap()).unwrap();
        let e = layer_norm_e4m3(&x, &g, &b, &target).unwrap_err().to_string();
        assert!(e.contains("NaN or infinite"), "{e}");
    }
}
