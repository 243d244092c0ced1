//! # Stage 2 — fused attention (scaled dot-product attention in one kernel)
//!
//! **Start with the small version.** `small::online_softmax_attention` is the algorithm alone in
//! scalar loops, one head: per query row a running max m, a running denominator l and an
//! unnormalised output O, rescaled by e^(m_old − m_new) whenever a key raises the max, so the
//! T × T scores never exist. The kernels below are that loop plus named engineering steps. On the
//! CPU: (1) SIMD dot products and one axpy per key into O's row, rayon over batch × heads — the
//! row-wise kernel, `attention::CpuKernel::RowAxpy`; (2) register blocking — 12 query rows × 32
//! keys of S and of O held in AVX-512 registers, `cpu_kernels::attention::registers`, the default. Measured
//! apart (criterion, `results/cpu-xeon-attention-registers/attention-bench.txt`), the algorithm buys 3.2x
//! over the materialised attention (145.6 → 45.6 ms at `small`) and the register blocking 5.6x
//! more (→ 8.2 ms): on a CPU the engineering is the larger gain. On CUDA: tensor
//! cores for S = Q Kᵀ and P̃ V, K and V tiles in shared memory, S, P̃ and O in registers (v2).
//!
//! **What changed.** Attention becomes one fused operation, `attention::attention`, that never
//! writes the (B, n_head, T, T) score matrix to memory; everything else is stage 1 (same
//! precision policy, same GEMMs, same LayerNorm). q, k and v stay in the (B, T, n_head, d_head)
//! layout the projections produce, so the head split and merge copies disappear too.
//!
//! **Why it is faster on the hardware.** Stages 0–1 write the scores, read them back for the
//! mask, the max, the exponentials, the sum and the division, and write the probabilities:
//! O(B·n_head·T²) bytes several times over — at T = 2048 on `small` that is 200 M floats
//! (800 MB) per pass, far more than the weights. The fused kernel keeps each tile of scores in
//! registers/cache and rescales a running result as it goes (FlashAttention's online softmax),
//! so attention moves O(B·T·C) bytes: q, k, v once in, the output once out. It also skips the
//! tiles above the causal diagonal instead of computing and masking them (half the FLOPs).
//! The gain grows with T, in time and in peak memory: on a GPU expect little at T = 512 (the
//! scores are small next to the MLP's GEMMs) and a clear win from T ≈ 2048 up; the recorded CPU
//! run already shows a gain at T = 512 (README's results give the number, from its JSON).
//!
//! **What it costs.** Nothing in accuracy: the same softmax, in f32, summed in another order
//! (relative error ~1e-7 against stage 1 at fp32). In bf16, P is rounded to bf16 before P·V
//! on the GPU and on a CPU with AVX512-BF16 (`cpu_kernels::attention::registers::bf16`: both products on
//! `vdpbf16ps`), as FlashAttention does; other CPUs widen bf16 inputs to f32 per head. The CPU
//! runs our kernel at any precision;
//! on CUDA our FlashAttention-2 kernel (`kernels/flash_attn_v2.cu`, tensor cores; v1,
//! `kernels/flash_attn.cu`, with `--attention-kernel v1`) takes bf16/f16
//! on SM 8.0+ with d_head 32, 64 or 128 — or, built with the `flash-attn` feature,
//! candle-flash-attn does (d_head any multiple of 8 up to 512).
//!
//! **Run it.** `cargo run --release -p stage2_sdpa` (CPU) ·
//! `cargo run --release -p ladder -- --seq 2048` (stages side by side where it pays) ·
//! `cargo run --release --features cuda -p stage2_sdpa -- --device cuda` (GPU).

pub mod attention;
pub mod attention_cuda;
/// This stage's exercise (docs/stages.md, "Exercises"): with `--features exercise` your version in
/// `src/exercise.rs`, otherwise its solution, `src/exercise_solution.rs`; `tests/exercise.rs` checks it.
#[cfg_attr(feature = "exercise", path = "exercise.rs")]
#[cfg_attr(not(feature = "exercise"), path = "exercise_solution.rs")]
pub mod exercise;
#[cfg(feature = "harness")]
pub mod harness;
pub mod small;

pub use attention::{attention, attention_opts, attention_with};

#[cfg(feature = "harness")]
mod block;
#[cfg(feature = "harness")]
pub mod selftest;
#[cfg(feature = "harness")]
mod stage;
#[cfg(feature = "harness")]
pub use block::Block;
#[cfg(feature = "harness")]
pub use stage::{attention_of, cuda_attention_backward_note, Args, Sdpa, STAGE};

use candle_core::Tensor;

/// The ablation of this stage's second change (`ladder --ablate`): the fused kernel, with the
/// head split and merge copies of stages 0-1 kept, so the table shows the kernel's gain and the
/// copies' apart. q, k, v: (B, T, n_head, d_head) views of the projections' (B, T, C) outputs.
/// Each is copied into (B, n_head, T, d_head) as `split_heads` does; the CPU kernel reads
/// (B, T, n_head, d_head) rows and copies it back (so on the CPU each input pays two copies,
/// an upper bound on stage 1's one; the CUDA kernel reads the head-major view in place). The
/// output is copied out to (B, n_head, T, d_head), as stage 1's attention returns it, and back
/// into (B, T, C) rows, as `merge_heads` does. `cpu`: the CPU kernel the stage itself runs
/// (`Registers`; `RegistersBf16` in a training step on a CPU with a bf16 unit), so the copies are
/// the one change.
pub fn attention_with_copies(
    imp: attention::Implementation,
    cpu: attention::CpuKernel,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
) -> candle_core::Result<Tensor> {
    let split = |t: &Tensor| t.transpose(1, 2)?.contiguous()?.transpose(1, 2); // copy to (B, n_head, T, d_head), viewed back
    let a = attention_opts(imp, cpu, &split(q)?, &split(k)?, &split(v)?, true)?; // (B, T, n_head, d_head)
    a.transpose(1, 2)?.contiguous()?.transpose(1, 2)?.contiguous() // the merge: (B, n_head, T, d_head) copy, then (B, T, n_head, d_head) rows
}
