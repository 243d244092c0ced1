//! With the `cuda` feature: nvcc compiles `kernels/ln_fp8.cu` — which includes `kernels/fp8.cu`
//! and stage 3's `add_layer_norm.cu`, so one module holds every FP8 kernel — to one cubin per
//! architecture in CUDA_COMPUTE_CAP (`kernel_build::build`). CPU builds need no nvcc.

fn main() {
    // sm_75: the oldest architecture CUDA 13's nvcc targets. The kernels convert to E4M3 with
    // integer arithmetic (no FP8 instruction), so they build for any of them; the FP8 GEMMs
    // (cuBLASLt) are what need SM 8.9.
    kernel_build::build::build_cubins(
        "stage4_fp8",
        &["ln_fp8"],
        75,
        &["kernels/ln_fp8.cu", "kernels/fp8.cu", "../stage3_fused/kernels/add_layer_norm.cu"],
    );
}
