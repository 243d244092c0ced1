// Host emulation of the CUDA features stage2_sdpa/kernels/flash_attn.cu uses, so its source can run on a CPU
// (attention_check.cpp): one std::thread per CUDA thread, std::barrier for __syncthreads and __syncwarp, a
// warp shuffle through a per-warp buffer, WMMA fragments as whole 16 × 16 float tiles, bf16 and
// f16 as rounded 16-bit values. This file stands in for CUDA's <mma.h> (attention_check.cpp's include path
// puts this folder first); cuda_bf16.h and cuda_fp16.h here are empty for the same reason.
//
// What it checks: the kernel's indexing, strides, tile loop, causal skipping and masking, padding
// of the last tiles, the online softmax, the output — against an f64 reference. Shared memory and
// the output start as NaN bit patterns, so a value read before it is written shows up. Fragment
// stores are done by lane 0 alone, so a lane reading another lane's results without the
// __syncwarp in between reads NaN. What it cannot check: WMMA's real fragment layouts, the GPU's
// memory model and timing, speed. A GPU run is still the real test (tests/cuda.rs).
#pragma once
#include <algorithm>
#include <barrier>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <thread>
#include <type_traits>
using std::min;
#define __device__
#define __global__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__
#define __align__(n) __attribute__((aligned(n)))

struct dim3 {
    unsigned x = 0, y = 0, z = 0;
};
extern thread_local dim3 threadIdx;  // per emulated thread
extern dim3 blockIdx, gridDim;       // blocks run one after another
struct uint4 {
    unsigned x, y, z, w;
};
inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return {a, b, c, d}; }
struct float2 {
    float x, y;
};
inline float2 make_float2(float x, float y) { return {x, y}; }

struct __nv_bfloat16 {
    uint16_t bits;
};
struct __half {
    _Float16 v;
};
inline __nv_bfloat16 __float2bfloat16(float f) {  // round to nearest even, as the GPU does
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return {uint16_t((u >> 16) | 0x40u)};
    u += 0x7fffu + ((u >> 16) & 1u);
    return {uint16_t(u >> 16)};
}
inline __half __float2half(float f) { return {(_Float16)f}; }
inline float to_f(__nv_bfloat16 b) {
    uint32_t u = uint32_t(b.bits) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
inline float to_f(__half h) { return (float)h.v; }

extern std::barrier<>* block_barrier;
extern std::barrier<>* warp_barrier[4];
extern float shfl_buf[4][32];
// Race tests (attention_v2_check.cpp) can drop chosen barriers (`skip_barrier`, called by every
// thread at every __syncthreads; all threads of a block must agree) and hold one warp back at
// each one for longer than the others take to compute a tile (`slow_warp`, 50 ms; -1: none), so
// that the others run ahead into whatever a missing barrier leaves unguarded every time, not
// only when the OS happens to schedule them so.
inline bool (*skip_barrier)() = nullptr;
inline int slow_warp = -1;
inline void __syncthreads() {
    if (!(skip_barrier && skip_barrier())) block_barrier->arrive_and_wait();
    if ((int)(threadIdx.x / 32) == slow_warp) std::this_thread::sleep_for(std::chrono::milliseconds(50));
}
inline void __syncwarp() { warp_barrier[threadIdx.x / 32]->arrive_and_wait(); }
inline float __shfl_xor_sync(unsigned, float v, int off) {
    const int w = threadIdx.x / 32, l = threadIdx.x % 32;
    shfl_buf[w][l] = v;
    __syncwarp();
    const float r = shfl_buf[w][l ^ off];
    __syncwarp();
    return r;
}

// atomicAdd on f32 global memory (the attention backward's dQ): a real atomic, since the emulated
// threads of one block run at once.
#include <atomic>
inline float atomicAdd(float* p, float v) { return std::atomic_ref<float>(*p).fetch_add(v); }

namespace nvcuda {
namespace wmma {
struct matrix_a {};
struct matrix_b {};
struct accumulator {};
struct row_major {};
struct col_major {};
enum layout_t { mem_row_major, mem_col_major };
template <class Use, int M, int N, int K, class T, class L = void>
struct fragment {
    float x[M * N];  // the whole tile, in every lane
};
using acc_t = fragment<accumulator, 16, 16, 16, float>;
template <class U, class T, class L>
void load_matrix_sync(fragment<U, 16, 16, 16, T, L>& f, const T* p, unsigned ldm) {
    for (int r = 0; r < 16; ++r)
        for (int c = 0; c < 16; ++c) f.x[r * 16 + c] = to_f(std::is_same<L, col_major>::value ? p[c * ldm + r] : p[r * ldm + c]);
}
inline void load_matrix_sync(acc_t& f, const float* p, unsigned ldm, layout_t) {
    for (int r = 0; r < 16; ++r)
        for (int c = 0; c < 16; ++c) f.x[r * 16 + c] = p[r * ldm + c];
}
inline void fill_fragment(acc_t& f, float v) {
    for (float& x : f.x) x = v;
}
template <class T, class LA, class LB>
void mma_sync(acc_t& d, const fragment<matrix_a, 16, 16, 16, T, LA>& a, const fragment<matrix_b, 16, 16, 16, T, LB>& b,
              const acc_t& c) {
    acc_t out;
    for (int r = 0; r < 16; ++r)
        for (int n = 0; n < 16; ++n) {
            float s = c.x[r * 16 + n];
            for (int k = 0; k < 16; ++k) s += a.x[r * 16 + k] * b.x[k * 16 + n];
            out.x[r * 16 + n] = s;
        }
    d = out;
}
// Lane 0 alone writes: the other lanes see the values only after a __syncwarp.
inline void store_matrix_sync(float* p, const acc_t& f, unsigned ldm, layout_t) {
    if (threadIdx.x % 32 != 0) return;
    for (int r = 0; r < 16; ++r)
        for (int c = 0; c < 16; ++c) p[r * ldm + c] = f.x[r * 16 + c];
}
}  // namespace wmma
}  // namespace nvcuda
