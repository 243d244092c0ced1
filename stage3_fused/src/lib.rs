//! # Stage 3 — kernel fusion: fewer passes over memory, fewer launches
//!
//! **Start with the small version.** `small::layer_norm_one_pass` is LayerNorm in one read of
//! each row, scalar loops: the row's Σy and Σy² (y = x − x₀, in f64), then normalise and write
//! while the row is still in L1, instead of the nine primitive ops' seven passes over (B, T, C).
//! `ops::layer_norm` is that loop plus engineering: eight partial sums so the statistics
//! vectorise, rows handed to rayon 16 at a time, the cast to the GEMM's dtype in the store. The
//! other fusions follow the same idea — do the element-wise work where the data already is.
//!
//! **What changed.** The element-wise work around the matrix multiplications is fused into
//! them or into single-pass kernels, the way a graph compiler (torch.compile, XLA) would, but
//! written out (`ops`, each op beside its slow twin); everything else is stage 2:
//! - LayerNorm in one kernel (on CUDA our two-pass `layer_norm_*` in `kernels/add_layer_norm.cu`,
//!   one pass per row on CPU), the cast included;
//! - GEMM epilogues: bias (q/k/v, proj), bias + GELU (fc1), bias + residual (fc2) applied by the
//!   GEMM before it stores (cuBLASLt on CUDA; on CPU the bf16 GEMM's output pass applies them to
//!   each block of its f32 accumulator while the block is in cache, and rounds to bf16 as it
//!   stores; the f32 and MKL GEMMs accumulate onto a destination that already holds the bias and
//!   residual, and for fc1 one parallel pass adds the bias and applies GELU, see `ops::GELU_ROWS`);
//! - horizontal fusion: q, k and v come from ONE GEMM against the (3C, C) weight;
//! - the worked example of a hand-written kernel: residual add + LayerNorm in one pass
//!   (`kernels/add_layer_norm.cu`, compiled by nvcc at build time, wrapped as a candle op).
//!
//! **Why it is faster on the hardware.** Element-wise ops do almost no arithmetic per byte, so
//! each one costs a full trip through memory (and, on a GPU, a kernel launch of a few µs).
//! Counted on paper for one block forward at bf16 on CUDA (full passes = element-wise kernels
//! that read and/or write a whole (B, T, C) or (B, T, FF) activation; GEMMs not counted):
//!
//! | part of the block          | stage 2 launches | stage 3 launches | stage 2 passes | stage 3 passes |
//! |----------------------------|------------------|------------------|----------------|----------------|
//! | LayerNorm 1 (+ cast)       | 10               | 1                | 8              | 1              |
//! | q, k, v projections        | 3 GEMM + 3 bias  | 1 GEMM           | 3              | 0              |
//! | attention                  | 1                | 1                | 0              | 0              |
//! | proj + residual + LN 2     | GEMM + 3 + 10    | GEMM + 1         | 11             | 1              |
//! | fc1 + GELU                 | GEMM + 1 + 9     | 1 GEMM           | 10             | 0              |
//! | fc2 + residual             | GEMM + 3         | GEMM + 2         | 3              | 2              |
//! | **total**                  | **46**           | **9**            | **35**         | **4**          |
//!
//! (fc2's residual stays two launches on CUDA at bf16/f16: the f32 residual stream cannot ride
//! in through cuBLASLt's C operand when C and D share the GEMM's 16-bit dtype in cudarc's
//! wrapper; at TF32 it does, with β = 1.) Expect the gain to be largest where the block is
//! memory- or launch-bound: small shapes on a GPU, and on a CPU, where each of stage 2's
//! element-wise passes (threaded and vectorised on the engine, `cpu_kernels::elementwise`) still
//! reads and writes a whole activation that does not fit in cache.
//!
//! **What it costs.** Nothing in accuracy — the same arithmetic in another order (LayerNorm
//! statistics in f64 on CPU, f32 on CUDA). On CUDA, stage 3 needs bf16, f16 or TF32: cudarc's
//! cuBLASLt f32 GEMM always computes in TF32, so plain fp32 is refused rather than mislabelled.
//!
//! **Training.** Each fused op has its backward (`backward`). On the CPU with every fusion on,
//! the training step schedules those backwards itself instead of differentiating through
//! candle's tape (`scheduled`: each gradient written once and handed straight on); docs/training.md
//! says what that removes.
//!
//! **One change at a time.** Each of the four fusions can be switched off on its own
//! (`--fusions ln,qkv,epilogue,add-ln`); one that is off runs its slow
//! twin, the way stage 2 computes that part, and `ladder --ablate` times stage 3 with each
//! removed in turn, so the table shows what each one buys on this machine.
//!
//! **Run it.** `cargo run --release -p stage3_fused` (CPU) ·
//! `cargo run --release --features cuda -p stage3_fused -- --device cuda` (GPU).

pub mod adamw;
pub mod backward;
#[cfg(feature = "cuda")]
pub mod cuda;
#[cfg(feature = "cuda")]
pub mod cuda_lt;
pub mod device_cache;
/// This stage's exercise (docs/stages.md, "Exercises"): with `--features exercise` your version in
/// `src/exercise.rs`, otherwise its solution, `src/exercise_solution.rs`; `tests/exercise.rs` checks it.
#[cfg_attr(feature = "exercise", path = "exercise.rs")]
#[cfg_attr(not(feature = "exercise"), path = "exercise_solution.rs")]
pub mod exercise;
#[cfg(feature = "cublaslt-args")]
pub mod gemm_args;
pub mod ops;
pub mod small;

#[cfg(feature = "harness")]
mod block;
#[cfg(feature = "harness")]
mod scheduled;
#[cfg(feature = "harness")]
pub mod selftest;
#[cfg(feature = "harness")]
mod stage;
#[cfg(feature = "harness")]
pub use block::Block;
#[cfg(feature = "harness")]
pub use stage::{Args, Fused, FusedAdamW, Fusions, STAGE};
