// The warp-level PTX that flash_attn_v2.cu and flash_attn_bwd.cu use, one small device function per instruction, so
// the kernel reads as algorithm and this file as hardware. Each function is one inline-asm
// statement, written as the PTX ISA spells it (section "Warp Level Matrix Multiply-Accumulate
// Instructions": mma.sync m16n8k16, ldmatrix; "Data Movement": cp.async; "Floating Point": ex2).
//
// host_emulation/ptx_warp.h is this file's CPU twin with the same names and signatures: the
// kernel includes <ptx_warp.h> with angle brackets, so the include path decides which one it
// gets (build.rs and .ci/run pass -I stage2_sdpa/kernels; host_emulation/run.sh passes
// -I host_emulation). The kernel's source is then the same on the GPU and under the emulation.
//
// Fragment layouts (PTX ISA, "Matrix Fragments for mma.m16n8k16 with floating point type"),
// with g = lane / 4 (groupID) and t = lane % 4 (threadID_in_group); a 32-bit register holds two
// 16-bit values, the lower-indexed one in its low half:
//   A (16 × 16, row): a0 = A[g][2t, 2t+1]    a1 = A[g+8][2t, 2t+1]
//                     a2 = A[g][2t+8, 2t+9]  a3 = A[g+8][2t+8, 2t+9]
//   B (16 × 8, col):  b0 = B[2t, 2t+1][g]    b1 = B[2t+8, 2t+9][g]
//   C, D (16 × 8, f32): c0, c1 = C[g][2t, 2t+1]   c2, c3 = C[g+8][2t, 2t+1]
// ldmatrix.x4 loads four 8 × 8 matrices of 16-bit values: lane 8m + r gives the shared-memory
// address of row r of matrix m (16 contiguous bytes), and register m of lane 4r + w receives
// row r, values 2w and 2w+1 of matrix m (with .trans: column r, values 2w and 2w+1 — the
// matrix transposed on the way).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

// D = A·B + D on tensor cores: A 16 × 16 and B 16 × 8 in bf16 or f16, D 16 × 8 in f32.
template <typename T>
__device__ __forceinline__ void mma_m16n8k16(float d[4], const uint32_t a[4], const uint32_t b[2]);
template <>
__device__ __forceinline__ void mma_m16n8k16<__nv_bfloat16>(float d[4], const uint32_t a[4], const uint32_t b[2]) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
template <>
__device__ __forceinline__ void mma_m16n8k16<__half>(float d[4], const uint32_t a[4], const uint32_t b[2]) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// Four 8 × 8 matrices from shared memory; `row` is this lane's row address (see above).
__device__ __forceinline__ void ldmatrix_x4(uint32_t r[4], const void* row) {
    const unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(row));
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}
// The same, each matrix transposed: lane 4r + w receives column r, rows 2w and 2w+1.
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t r[4], const void* row) {
    const unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(row));
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

// 16 bytes global → shared without passing through registers, asynchronously (.cg: cached in
// L2 only, as the data is read once per block). `valid` false: the 16 bytes are zero-filled and
// nothing is read (src-size 0), which pads the ragged last tile.
__device__ __forceinline__ void cp_async_16(void* dst, const void* src, bool valid) {
    const unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(dst));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(addr), "l"(src), "r"(valid ? 16 : 0));
}
// 4 bytes global → shared, asynchronously (.ca: the copy size below 16 bytes takes only .ca,
// cached in L1 too); the backward's L_i and D_i, one f32 per query row, whose rows need not start
// on a 16-byte boundary. `valid` false: the 4 bytes are zero-filled and nothing is read.
__device__ __forceinline__ void cp_async_4(void* dst, const void* src, bool valid) {
    const unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(dst));
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(addr), "l"(src), "r"(valid ? 4 : 0));
}
// Close the group of this thread's cp.async issued since the last commit.
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
// Wait until at most N of this thread's committed groups are still in flight (the older ones
// have landed in shared memory — for this thread; other threads see them after a barrier).
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// p[0] += a and p[1] += b in global memory, atomically: on sm_90 one 8-byte reduction
// (red.global.add.v2.f32, PTX "Parallel Synchronization and Communication"), half the
// instructions and L2 operations of two f32 atomicAdd, which is what older GPUs run. p: 8-byte
// aligned.
__device__ __forceinline__ void red_add_f32x2(float* p, float a, float b) {
#if __CUDA_ARCH__ >= 900
    asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" ::"l"(p), "f"(a), "f"(b) : "memory");
#else
    atomicAdd(p, a);
    atomicAdd(p + 1, b);
#endif
}

// 2^x as one MUFU.EX2 (PTX "ex2"): .approx is the hardware's own (max relative error 2⁻²²),
// .ftz flushes subnormal inputs and results to zero. exp2f without -ftz wraps the same
// instruction in a range fix-up for subnormal results (FSETP and two FMULs); softmax needs none,
// as a P̃ below 2⁻¹²⁶ adds nothing to a row sum of at least 1. exp2(−∞) = +0.
__device__ __forceinline__ float exp2_ftz(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

// Two f32 values rounded to 16 bits and packed, `lo` in the low half: the register layout of a
// fragment (the lower column index in the low half).
template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi);
template <>
__device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
}
template <>
__device__ __forceinline__ uint32_t pack2<__half>(float lo, float hi) {
    __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
}

// The two 16-bit values of a packed register as f32, the low half in .x: pack2's inverse.
template <typename T>
__device__ __forceinline__ float2 unpack2(uint32_t r);
template <>
__device__ __forceinline__ float2 unpack2<__nv_bfloat16>(uint32_t r) {
    return __bfloat1622float2(*reinterpret_cast<__nv_bfloat162*>(&r));
}
template <>
__device__ __forceinline__ float2 unpack2<__half>(uint32_t r) {
    return __half22float2(*reinterpret_cast<__half2*>(&r));
}
