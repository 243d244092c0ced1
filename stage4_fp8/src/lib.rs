//! # Stage 4 — FP8: the four GEMMs in E4M3 with per-tensor scaling
//!
//! **What changed.** The four matrix multiplications (qkv, proj, fc1, fc2) take E4M3 inputs —
//! weights quantised once at build, activations on every call with a per-tensor scale from
//! `--fp8-recipe` (delayed: an amax history; current: this tensor's amax) — and write bf16
//! with bias (and fc1's GELU) in cuBLASLt's epilogue (`fp8::Fp8Linear` on the candle op
//! `gemm::Fp8Gemm`). Everything else is stage 3: its fused LayerNorm and residual kernels,
//! stage 2's attention, LayerNorm statistics and the residual stream in f32. The activations
//! stay in the dtype stage 3 uses at the same `--precision` (`activation_dtype`): on the CPU,
//! stage 3's GEMM dtype — at the default `auto`, bf16 on a CPU with a bf16 unit (AVX512-BF16,
//! AMX-BF16) and f32 on one without, f32 at `--precision fp32` — so the GEMMs' number format is
//! the one change; on CUDA, bf16 (what cuBLASLt's FP8 GEMMs store), and a note says so when
//! stage 3 would run something else.
//!
//! **Why it is faster on the hardware.** Hopper's tensor cores do twice as many E4M3 FLOPs per
//! clock as bf16 (1979 vs 989 dense TFLOP/s on H100 SXM), and E4M3 operands are half the bytes.
//! What FP8 cannot speed up — attention, LayerNorm, the quantisation itself (an amax reduction
//! and a cast per activation, a few µs each) — stays the same or grows, so the gain depends on
//! how much of the block the GEMMs are: on `te` (C = 4096, FF = 16384, 16 k tokens) they are
//! ~90 % of the FLOPs and the block should gain ~1.3–1.5x over stage 3; at GPT-2 sizes
//! (C = 768) the GEMMs are too small to leave the launch- and memory-bound regime, and the
//! quantisation overhead eats the gain (expect ~1.0x).
//!
//! **What it costs.** E4M3 keeps 3 mantissa bits: each operand is off by up to 1/16 of its
//! value, so the block's relative error grows to ~1e-2 (fp8 tolerance 8e-2). Two checks:
//! against the fp32 reference, and each FP8 GEMM against the f32 GEMM of the very same E4M3
//! operands and scales (the GEMM twins, `twin::gemm_twin_tolerance`): only the accumulation
//! differs there, so the tolerance follows from K and from whether Hopper's fast accumulation
//! is on (`--fp8-fast-accum`); anything beyond it is a bug. FP8 tensor cores need SM 8.9+
//! (Ada, Hopper) and dimensions that are multiples of 16. The quantisation on CUDA is our own
//! kernels (`kernels/fp8.cu`, built by nvcc with the crate).
//! Elsewhere the stage is *emulated* (quantise to E4M3 and back, then an f32 GEMM): FP8's
//! numerics on any machine, labelled "emulated", and its time is not an FP8 speed. On a GPU
//! without FP8 it refuses unless asked (`--fp8-emulate`).
//!
//! **Quantisation fused into the producers** (`--fp8-fusions ln,fc1`, TransformerEngine's way):
//! the two LayerNorms write qkv's and fc1's input in E4M3 (`producers`, `kernels/ln_fp8.cu`),
//! and fc1's GEMM writes fc2's (cuBLASLt's D scale and amax_D), each recording the amax of what
//! it wrote in the consumer's history: three quantise passes (over (B, T, C), (B, T, C) and
//! (B, T, FF)) and their launches saved, and the producers write 1 byte per value instead of 2.
//! They need the scale before the producer writes, so delayed scaling: by default all of them
//! with `--fp8-recipe delayed`, none with `current` (asking for one there is refused); the first
//! call, with no history yet, runs unfused. Compiled, not run on a GPU; emulated on the CPU.
//!
//! **Training** (`--train`: TransformerEngine's HYBRID recipe, `hybrid`): the backward's GEMMs
//! take the gradient dY in E5M2 (f16's range, 2 mantissa bits) against the forward's E4M3
//! operands. On CUDA both, dX = dY·W and dW = dYᵀ·X, are cuBLASLt E4M3 × E5M2 GEMMs that read
//! transposed copies, since FP8 takes the "TN" form only (`gemm::fp8_grad_layout`): compiled, not
//! run on a GPU. On the CPU, emulated.
//!
//! **Run it.** `cargo run --release -p stage4_fp8` (CPU, emulated) ·
//! `cargo run --release --features cuda -p stage4_fp8 -- --device cuda --preset te` (Hopper/Ada).

#[cfg(feature = "cuda")]
pub mod cuda;
/// This stage's exercise (docs/stages.md, "Exercises"): with `--features exercise` your version in
/// `src/exercise.rs`, otherwise its solution, `src/exercise_solution.rs`; `tests/exercise.rs` checks it.
#[cfg_attr(feature = "exercise", path = "exercise.rs")]
#[cfg_attr(not(feature = "exercise"), path = "exercise_solution.rs")]
pub mod exercise;
pub mod fp8;
pub mod gemm;
#[cfg(feature = "harness")]
pub mod harness;
pub mod hybrid;
pub mod producers;
#[cfg(feature = "cuda")]
pub mod quant_cuda;
pub mod scale;
pub mod twin;

#[cfg(feature = "harness")]
mod block;
#[cfg(feature = "harness")]
pub mod selftest;
#[cfg(feature = "harness")]
mod stage;
#[cfg(feature = "harness")]
pub use block::{Block, TrainBlock, FC1_FALLBACK, TWIN_TOLERANCE};
#[cfg(feature = "harness")]
pub use stage::{Args, Fp8, Fp8Fusions, STAGE};
