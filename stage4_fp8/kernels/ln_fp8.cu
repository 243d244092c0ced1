// Quantisation fused into the LayerNorm (stage 4's `--fp8-fusions ln`): stage 3's LayerNorm row
// (add_layer_norm.cu's `layer_norm_row`, unchanged) with an E4M3 store, so the GEMM after it
// (qkv, fc1) reads E4M3 and skips its own quantise pass.
//
//   h[r, c] = LayerNorm(x[r, :])[c]                 (as stage 3, f32 statistics, two-pass variance)
//   q[r, c] = E4M3(h[r, c] / s)                     s: the GEMM's delayed scale, read from its buffer
//   amax    = max(amax, max |h|)                    into the GEMM's amax buffer, for its history
//
// Unfused, the GEMM's quantise kernel (fp8.cu's fp8_quantize_bf16) reads h back: for a (B, T, C)
// activation that is 2 bytes read + 1 written per element and a launch, gone here; the LayerNorm
// also writes 1 byte per element instead of bf16's 2. h is never rounded to bf16 on the way.
//
// The scale must be known before the row is written, so this runs under delayed scaling (s from
// the amax history: fp8_scale_from_history before, fp8_history_push after, as fp8.cu's own
// quantise does); the amax is taken of h before the division (the value the recipe records).
//
// One translation unit with add_layer_norm.cu and fp8.cu: the cast (f32_to_e4m3), the NaN-keeping
// max and the block reduction are theirs, not copies. nvcc (stage4_fp8/build.rs: this file is
// the FP8 module) and the host emulation (host_emulation/ln_fp8_check.cpp) include them here.
// Both files define THREADS 256 and WARPS the same way: one block per row.

#include "../../stage3_fused/kernels/add_layer_norm.cu"
#include "fp8.cu"

// Pass 3's store: q = E4M3(h / s), and the block's max |h| into amax_bits once every thread has
// stored (`finish`: one atomicMax on the f32 bits per block, as fp8.cu's quantise does).
struct StoreE4m3 {
    unsigned char* q;
    float s;
    unsigned int* amax_bits;
    float m;  // this thread's max |h| so far
    __device__ __forceinline__ void store(long i, float v) {
        q[i] = f32_to_e4m3(v / s);  // x / s as a division, as fp8.cu and the CPU quantiser divide
        m = max_keep_nan(m, abs_keep_nan(v));
    }
    __device__ __forceinline__ void finish(float* shared) {
        const float b = block_max(m != m ? __uint_as_float(0x7fc00000u) : m, shared);
        if (threadIdx.x == 0) atomicMax(amax_bits, __float_as_uint(b));
    }
};

// q = E4M3(LayerNorm(x) / s), amax ← max(amax, max |LayerNorm(x)|). One block per row.
extern "C" __global__ void layer_norm_e4m3(const float* x, const float* g, const float* b, const float* scale,
                                           unsigned char* q, unsigned int* amax_bits, int C, float eps) {
    layer_norm_row<false, float>(x, nullptr, g, b, nullptr, StoreE4m3{q, scale[0], amax_bits, 0.0f}, C, eps, 0);
}

// x_out = x + branch (f32), q = E4M3(LayerNorm(x_out) / s), amax as above. branch: bf16 (bf16 = 1)
// or f16, as 16-bit patterns. One block per row.
extern "C" __global__ void add_layer_norm_16_e4m3(const float* x, const unsigned short* branch, const float* g,
                                                  const float* b, float* x_out, const float* scale, unsigned char* q,
                                                  unsigned int* amax_bits, int C, float eps, int bf16) {
    layer_norm_row<true>(x, branch, g, b, x_out, StoreE4m3{q, scale[0], amax_bits, 0.0f}, C, eps, bf16);
}
