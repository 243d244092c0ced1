//! Quantisation fused into the producers (`--fp8-fusions ln`): stage 3's two LayerNorms, writing
//! the next GEMM's input in E4M3 instead of in the activation dtype, and recording its amax for
//! that GEMM's history. The GEMM (qkv after ln1, fc1 after ln2) then skips its own quantise
//! pass: one read and one write of a (B, T, C) tensor fewer, and a launch fewer, per LayerNorm.
//! (fc1 writing E4M3 for fc2 is `Fp8Linear::forward_e4m3`: cuBLASLt's D scale and amax_D.)
//!
//! The scale must be known before the LayerNorm writes, so these need delayed scaling
//! (`Fp8Target`: the consumer's scale from its amax history), as in TransformerEngine.
//!
//! CUDA: one launch each, stage 3's LayerNorm row (`add_layer_norm.cu`) with an E4M3 store
//! (`kernels/ln_fp8.cu`, fp8.cu's cast and amax). CPU: stage 3's fused LayerNorm in f32, then
//! `Fp8Target::quantize` — the same values quantised with the same scale, in two passes.
//! Slow twin: `stage0_baseline::layer_norm`, then `quantize` / `dequantize` with the target's scale.

use crate::fp8::{Fp8Target, Quantized};
use candle_core::{DType, Tensor};
use stage3_fused::ops::{add_layer_norm, layer_norm};

/// q = E4M3(LayerNorm(x) / s) with the consumer's scale s (`target`), amax(LayerNorm(x)) recorded
/// for it. x: (B, T, C) f32; g, b: (C) f32.
pub fn layer_norm_e4m3(x: &Tensor, g: &Tensor, b: &Tensor, target: &Fp8Target) -> candle_core::Result<Quantized> {
    #[cfg(feature = "cuda")]
    if let (true, Some((amax_bits, _))) = (x.device().is_cuda(), &target.device) {
        let data = crate::quant_cuda::layer_norm_e4m3(x, g, b, &target.scale, amax_bits)?; // one launch
        return Ok(Quantized { data, scale: target.scale.clone(), amax: None });
    }
    target.quantize(&layer_norm(x, g, b, DType::F32)?) // f32 out: never rounded to the activation dtype first
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
    #[cfg(feature = "cuda")]
    if let (true, Some((amax_bits, _))) = (x.device().is_cuda(), &target.device) {
        let (x_new, data) = crate::quant_cuda::add_layer_norm_e4m3(x, branch, g, b, &target.scale, amax_bits)?; // one launch
        return Ok((x_new, Quantized { data, scale: target.scale.clone(), amax: None }));
    }
    // branch widened to f32 (exact), so stage 3's op hands h back in f32
    let (x_new, h) = add_layer_norm(x, &branch.to_dtype(DType::F32)?, g, b)?;
    Ok((x_new, target.quantize(&h)?))
}
