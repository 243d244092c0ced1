//! # The CPU engine
//!
//! What every stage runs on a CPU that is not a stage's lesson: the kernels a CPU needs so that
//! each stage's time measures its technique and not candle's single-threaded CPU fallbacks.
//! The stages above change one technique each; the engine under them stays the same.
//!
//! - `bf16_gemm`: our bf16 GEMM (AVX512-BF16 `vdpbf16ps` pairs, AMX tiles, MKL's bf16 GEMM in an
//!   `mkl` build, f32 conversion where the CPU has no bf16 unit), with packing and prepacked
//!   weights (`PackedWeight`); `f32_gemm` is the f32 GEMM into a destination (the `gemm` crate
//!   candle's own CPU matmul runs, or MKL's sgemm), for GEMMs whose output pass is fused.
//! - `attention`: the CPU attention kernels behind stage 2's fused attention (register-blocked
//!   f32 and bf16-pair micro-kernels, tile GEMMs, the row-wise first kernel) and FlashAttention-2's
//!   backward.
//! - `elementwise`: the element-wise passes (add, bias, casts, LayerNorm, GELU) one pass per
//!   primitive op, on all threads and vectorised, for f32 and bf16 tensors; `--elementwise
//!   candle` runs candle's own ops instead.
//! - `trace`: every entry point names the kernel it ran, so `--breakdown` records what each part
//!   of the block actually executed.
//!
//! The code is chosen at run time by CPU detection (AVX-512, AVX2 + FMA, scalar), so one binary
//! runs anywhere. On a GPU the engine is not involved: candle's CUDA kernels and the stages' own
//! run there. Depends on candle-core only.

pub mod attention;
pub mod bf16_gemm;
pub mod elementwise;
pub mod f32_gemm;
pub mod trace;
