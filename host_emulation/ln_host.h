// Host emulation of the CUDA features stage3_fused/kernels/add_layer_norm.cu uses, so its
// source runs on a CPU (ln_check.cpp): one std::thread per CUDA thread, std::barrier for
// __syncthreads and for the warp-synchronous shuffle, f16 through _Float16. Same approach as
// mma.h (the attention kernel's); kept apart because this kernel runs 8 warps, not 4.
#pragma once
#include <atomic>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <algorithm>
using std::min;
#define __device__
#define __global__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static  // one array for the whole process = per block, as blocks run one at a time
#define SPEEDKIT_HOST_EMULATION

struct dim3 {
    unsigned x = 0, y = 0, z = 0;
};
extern thread_local dim3 threadIdx;
extern dim3 blockIdx;
extern dim3 gridDim;  // set by a check before its launch (blocks run one after another)

extern std::barrier<>* block_barrier;
extern std::barrier<>* warp_barrier[32];
extern float shfl_buf[32][32];

inline void __syncthreads() { block_barrier->arrive_and_wait(); }
inline float __shfl_xor_sync(unsigned, float v, int off) {
    const int w = threadIdx.x / 32, l = threadIdx.x % 32;
    shfl_buf[w][l] = v;
    warp_barrier[w]->arrive_and_wait();
    const float r = shfl_buf[w][l ^ off];
    warp_barrier[w]->arrive_and_wait();
    return r;
}
inline float __uint_as_float(unsigned u) {
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
inline unsigned __float_as_uint(float f) {
    unsigned u;
    std::memcpy(&u, &f, 4);
    return u;
}
inline float rsqrtf(float v) { return 1.0f / std::sqrt(v); }
inline float f16_to_f32(unsigned short v) {
    _Float16 h;
    std::memcpy(&h, &v, 2);
    return (float)h;
}
inline unsigned short f32_to_f16(float f) {  // round to nearest even, as cvt.rn.f16.f32
    _Float16 h = (_Float16)f;
    unsigned short v;
    std::memcpy(&v, &h, 2);
    return v;
}
// atomicMax on unsigned (fp8.cu's amax: a float max on the bits of non-negative floats).
inline unsigned atomicMax(unsigned* p, unsigned v) {
    std::atomic_ref<unsigned> r(*p);
    unsigned old = r.load();
    while (old < v && !r.compare_exchange_weak(old, v)) {
    }
    return old;
}
using std::rintf;
