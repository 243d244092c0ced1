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
    /// The input came quantised from its producer (`--fp8-fusions`): it was never stored in the
    /// activation dtype, so the twin quantises the producer's f32 output directly.
    pub fused_input: bool,
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
                                                                            // the input of `l` as the FP8 run had it: stored in the activation dtype, or (fused) not
        let stored_for = |l: &TwinLinear, t: Tensor| if l.fused_input { Ok(t) } else { bf16(&t) };
        let (_, t, c) = x.dims3()?;
        let h = stored_for(&self.qkv, layer_norm(x, &self.ln1_g, &self.ln1_b)?)?; // (B, T, C)
        let qkv = bf16(&self.qkv.forward(&h)?)?; // (B, T, 3C)
        let (q, k, v) = (qkv.narrow(2, 0, c)?, qkv.narrow(2, c, c)?, qkv.narrow(2, 2 * c, c)?);
        let a = bf16(&attention(&q, &k, &v, self.n_head, &causal_mask(t, x.device())?)?)?; // (B, T, C)
        let x = (x + bf16(&self.proj.forward(&a)?)?)?;
        let h = stored_for(&self.fc1, layer_norm(&x, &self.ln2_g, &self.ln2_b)?)?;
        let m = stored_for(&self.fc2, gelu_tanh(&self.fc1.forward(&h)?)?)?; // (B, T, FF)
        match self.fc2_stored {
            true => x + bf16(&self.fc2.forward(&m)?)?,
            false => x + self.fc2.forward(&m)?,
        }
    }
}

/// How an FP8 GEMM accumulates its K products (what the GEMM twin's tolerance depends on).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Accumulation {
    /// f32 multiply-adds: the emulation (CPU, or a GPU without FP8, TF32 off).
    F32,
    /// Hopper/Ada FP8 tensor cores, partial sums promoted to f32 every few k-steps
    /// (`--fp8-fast-accum off`).
    TensorCorePromoted,
    /// FP8 tensor cores with CUBLASLT_MATMUL_DESC_FAST_ACCUM: never promoted (`--fp8-fast-accum on`).
    TensorCoreFast,
}

/// Significant bits the FP8 tensor cores' accumulator keeps: partial sums are truncated to
/// 14 (an "FP22" with 13 explicit mantissa bits). Not documented by NVIDIA; measured by
/// DeepSeek (DeepSeek-V3 technical report §3.5.2, also deepseek-ai/DeepGEMM#37: "only uses the
/// highest 14 bits … and truncates bits exceeding this range") and by SageAttention 2's authors
/// (thu-ml/SageAttention#287: mma f32.e4m3.e4m3.f32 zeroes D's 10 lowest mantissa bits).
pub const TENSOR_CORE_ACCUM_BITS: i32 = 14;
/// K consumed by one FP8 MMA instruction (Hopper wgmma and Ada mma.sync take k = 32 for E4M3):
/// one truncation of the running sum per 32 products.
pub const MMA_K: usize = 32;
/// K between two promotions to f32 without fast accumulation. cuBLAS documents only that
/// fast accumulation skips the periodic promotion ("intermediate results will not periodically
/// be promoted to a higher precision", CUBLASLT_MATMUL_DESC_FAST_ACCUM); CUTLASS's Hopper FP8
/// GEMM promotes every 4 MMAs (`mma_promotion_interval` = 4, 128 along K), as DeepGEMM does.
pub const PROMOTION_K: usize = 128;

/// Tolerance of one GEMM twin — ||y_fp8 − y_f32|| / ||y_f32|| where both GEMMs read the same
/// E4M3 operands with the same scales — derived from K, the accumulation and the output dtype.
///
/// Derivation. The operands are identical, so the difference is (1) how the K products are
/// summed and (2) the rounding of the stored output.
/// (2) A store to `out` rounds to nearest: relative error ≤ u_out = 2⁻⁹ (bf16), 2⁻¹² (f16),
///     2⁻²⁴ (f32); we allow 2·u_out (the GELU epilogue's own last-bit differences).
/// (1a) f32 accumulation: the probabilistic bound of Higham & Mary (SIAM J. Sci. Comput. 2019,
///     "A new approach to probabilistic rounding error analysis"): |Δy| ≤ λ·√K·u·Σ|a||b| with
///     high probability; for products of random sign Σ|a||b| is within a small factor of |y|'s
///     scale column-norm-wise, so λ = 4 gives 4·√K·2⁻²⁴ (3e-5 at K = 16384).
/// (1b) Tensor cores: after each MMA (MMA_K products) the running partial sum s_j is truncated
///     to 14 significant bits, an error below one unit in its last place: |δ_j| < 2⁻¹³·|s_j|.
///     Over n truncations |Δy| ≤ 2⁻¹³·Σ_j |s_j| ≤ 2⁻¹³·n·max_j |s_j|, and because the weights'
///     products have mean ~0 the partial sums grow like a random walk, so max_j |s_j| stays
///     near |s_n| norm-wise: relative error ≲ n·2⁻¹³. Truncation is biased (toward zero), so
///     the n errors add up rather than cancel: n, not √n.
///     - fast accumulation: n = ⌈K / MMA_K⌉ — 512 at te's fc2 (K = 16384): 6.3e-2; 24 at
///       C = 768: 2.9e-3. This is why the whole-block twin with a fixed 1e-2 failed at te on the
///       H100 (2.80e-2) while it passed at small.
///     - promoted every PROMOTION_K: n = PROMOTION_K / MMA_K = 4 within each chunk, relative to
///       the chunk's sum; the chunks' errors are independent and add in f32: ≈ 4·2⁻¹³ = 4.9e-4
///       for any K, plus (1a) for the f32 sum of the ⌈K / 128⌉ chunks.
/// What the check still catches: a wrong scale (factor ≥ 1.25: rel. error ≥ 0.2), a transposed
/// or misaligned operand, a wrong epilogue — all O(1). The tolerance stays below 0.1 while
/// K ≤ 24 576 with fast accumulation (`tolerance_stays_discriminating`); beyond that, turn
/// fast accumulation off for a sharp check.
pub fn gemm_twin_tolerance(k: usize, acc: Accumulation, out: candle_core::DType) -> f64 {
    use candle_core::DType;
    let store = 2.0
        * match out {
            DType::BF16 => 2f64.powi(-9),
            DType::F16 => 2f64.powi(-12),
            _ => 2f64.powi(-24),
        };
    let f32_sum = |terms: usize| 4.0 * (terms.max(1) as f64).sqrt() * 2f64.powi(-24);
    let truncations = |n: usize| n as f64 * 2f64.powi(1 - TENSOR_CORE_ACCUM_BITS);
    store
        + match acc {
            Accumulation::F32 => f32_sum(k),
            Accumulation::TensorCorePromoted => truncations(PROMOTION_K / MMA_K) + f32_sum(k.div_ceil(PROMOTION_K)),
            Accumulation::TensorCoreFast => truncations(k.div_ceil(MMA_K)),
        }
}
