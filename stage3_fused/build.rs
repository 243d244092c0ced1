//! With the `cuda` feature: nvcc compiles `kernels/add_layer_norm.cu` (the fused residual add +
//! LayerNorm, and the plain LayerNorm) and `kernels/adamw.cu` (the multi-tensor AdamW) to one cubin per architecture in CUDA_COMPUTE_CAP, the
//! way stage 2 builds its attention kernels (`kernel_build::build`). CPU builds need no nvcc.

fn main() {
    // sm_75: the oldest architecture CUDA 13's nvcc targets; the kernel needs nothing newer.
    kernel_build::build::build_cubins("stage3_fused", &["add_layer_norm", "adamw"], 75, &["kernels/add_layer_norm.cu", "kernels/adamw.cu"]);
}
