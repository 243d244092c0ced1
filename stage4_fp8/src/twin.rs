//! The second numerical check (after TransformerEngine's FP8 primer): the same block in plain
//! fp32 (stage 0's ops), on GEMM inputs and weights rounded to E4M3 with the *same* scales the
//! FP8 run used, and with every tensor that stage 4 stores in bf16 rounded to bf16 at the same
//! place. What stage 4 loses against the fp32 reference is then split in two:
//! - stage 4 vs the reference: FP8 rounding error (expected, ~1e-2);
//! - stage 4 vs this twin: everything else — a wrong scale, a transposed operand, a bad
//!   epilogue, a layout bug — which must be ~0 (summation order, and the odd value that rounds
//!   to the neighbouring E4M3 number because its bf16 input differed in the last bit).

use crate::fp8::{dequantize, quantize};
use candle_core::{DType, Tensor};
use stage0_baseline::{attention, causal_mask, gelu_tanh, layer_norm, linear};

/// One FP8 linear as the twin sees it: W already rounded to E4M3 and dequantised (f32), the
/// bias as the GEMM reads it (bf16 values, held in f32), the input scale the FP8 run used.
pub struct TwinLinear {
    pub w: Tensor,       // (N, K) f32: s_w·q_w
    pub b: Tensor,       // (N) f32 holding bf16 values
    pub x_scale: Tensor, // rank-0 f32
}

impl TwinLinear {
    /// y = x̃ W̃ᵀ + b in f32, x̃ = x rounded to E4M3 with the FP8 run's scale.
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let xq = dequantize(&quantize(x, &self.x_scale)?, &self.x_scale, DType::F32)?;
        linear(&xq, &self.w, &self.b)
    }
}

/// Everything the twin needs from a built stage 4 block after one forward.
pub struct TwinBlock {
    pub ln1_g: Tensor,
    pub ln1_b: Tensor,
    pub qkv: TwinLinear,
    pub proj: TwinLinear,
    pub ln2_g: Tensor,
    pub ln2_b: Tensor,
    pub fc1: TwinLinear,
    pub fc2: TwinLinear,
    pub n_head: usize,
    /// The activation dtype stage 4 stores (bf16 on CUDA; stage 3's on the CPU): every stored
    /// activation is rounded to it here too.
    pub act: DType,
    /// fc2's output is stored (rounded to `act`) before the residual add (cuBLASLt), rather
    /// than added in the f32 epilogue (the CPU emulation, as stage 3).
    pub fc2_stored: bool,
}

impl TwinBlock {
    /// x: (B, T, C) f32 → (B, T, C) f32, stage 4's dataflow in stage 0's operations.
    pub fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let bf16 = |t: &Tensor| t.to_dtype(self.act)?.to_dtype(DType::F32); // where stage 4 stores a tensor: its rounding (none at f32)
        let (_, t, c) = x.dims3()?;
        let h = bf16(&layer_norm(x, &self.ln1_g, &self.ln1_b)?)?; // (B, T, C)
        let qkv = bf16(&self.qkv.forward(&h)?)?; // (B, T, 3C)
        let (q, k, v) = (qkv.narrow(2, 0, c)?, qkv.narrow(2, c, c)?, qkv.narrow(2, 2 * c, c)?);
        let a = bf16(&attention(&q, &k, &v, self.n_head, &causal_mask(t, x.device())?)?)?; // (B, T, C)
        let x = (x + bf16(&self.proj.forward(&a)?)?)?;
        let h = bf16(&layer_norm(&x, &self.ln2_g, &self.ln2_b)?)?;
        let m = bf16(&gelu_tanh(&self.fc1.forward(&h)?)?)?; // (B, T, FF)
        match self.fc2_stored {
            true => x + bf16(&self.fc2.forward(&m)?)?,
            false => x + self.fc2.forward(&m)?,
        }
    }
}
