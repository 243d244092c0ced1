//! With the `cuda` feature: nvcc compiles `kernels/flash_attn.cu` (v1),
//! `kernels/flash_attn_v2.cu` (v2) and `kernels/flash_attn_bwd.cu` (the backward), stage 2's
//! FlashAttention-2 kernels, to one cubin per
//! architecture in CUDA_COMPUTE_CAP (`kernel_build::build`, a build-dependency shared with stages 3 and 4). Their bf16
//! tensor-core instructions need SM 8.0, so a lower request builds sm_80 (with a warning) and
//! stage 2 refuses such a GPU at run time with the reason. CPU builds need no nvcc.

fn main() {
    kernel_build::build::build_cubins(
        "stage2_sdpa",
        &["flash_attn", "flash_attn_v2", "flash_attn_bwd"],
        80,
        &["kernels/flash_attn.cu", "kernels/flash_attn_v2.cu", "kernels/flash_attn_bwd.cu", "kernels/ptx_warp.h"],
    );
}
