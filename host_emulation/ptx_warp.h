// CPU twin of stage2_sdpa/kernels/ptx_warp.h: the same functions, implemented from the PTX ISA's
// definitions, so flash_attn_v2.cu and flash_attn_bwd.cu run unchanged on the CPU
// (attention_v2_check.cpp, attention_bwd_check.cpp). Threads,
// barriers, shuffles and the 16-bit types come from mma.h beside this file (one std::thread per
// CUDA thread). What each instruction models, and what a kernel bug would look like here:
//
//  mma_m16n8k16: each lane writes its A and B registers into a per-warp 16 × 16 and 16 × 8
//    scratch at the positions the PTX ISA assigns to (g = lane/4, t = lane%4, register, half)
//    (layouts in the real ptx_warp.h), then every lane computes its own four D elements from the
//    whole matrices, again at the ISA's positions. A kernel that assumes another layout computes
//    with the wrong values — the check fails.
//  ldmatrix_x4[_trans]: lane 8m + r writes its row address for row r of matrix m; register m of
//    lane 4r + w then receives values 2w, 2w+1 of that row (.trans: of column r, from rows 2w and
//    2w+1). It also counts bank conflicts: a phase (one matrix, 8 rows of 16 bytes) is
//    conflict-free when its 8 rows fall in 8 different 16-byte slots of a 128-byte line (all 32
//    banks once); any repeat is counted in ldmatrix_conflicts. Rows must be 16-byte aligned.
//  cp_async_16, cp_async_4 / commit / wait<N>: two timings, both allowed by the PTX memory
//    model, and the check runs every call under each. Late (the default): a copy is recorded
//    when issued and lands in shared memory when a wait_group leaves its group behind — the
//    latest moment; a
//    kernel that reads a tile before waiting for it, or waits for too few groups, or reads
//    another thread's copy before a barrier, reads NaN (shared memory starts as NaN) or a stale
//    tile. Early (`cp_async_at_issue`): the copy lands the moment it is issued — the earliest;
//    a kernel that refills a buffer while another warp still reads it (no barrier between the
//    reads and the next copy) overwrites that warp's operands. src-size 0 zero-fills.
//
// emu_mutation breaks one of these on purpose (the wrong-mapping tests of attention_v2_check.cpp
// and attention_bwd_check.cpp):
// the check must then fail, which shows it depends on the layouts being exactly the ISA's.
#pragma once
#include <atomic>
#include <vector>

#include "mma.h"

enum EmuMutation {
    EMU_EXACT = 0,
    EMU_A_ROWS_COLS_SWAPPED,  // a1 taken as A[g][2t+8..] and a2 as A[g+8][2t..] (PTX: the other way)
    EMU_B_REGS_SWAPPED,       // b0 taken as rows 2t+8.. and b1 as rows 2t..
    EMU_D_ROWS_SWAPPED,       // d0, d1 taken as row g+8 and d2, d3 as row g
    EMU_LDMATRIX_NO_TRANS,    // ldmatrix .trans behaves as the plain load
    EMU_WAIT_ONE_GROUP_LESS,  // cp.async.wait_group N leaves N+1 groups in flight
    EMU_NO_BARRIER_AFTER_WAIT,  // the __syncthreads right after a cp.async.wait_group is deleted
    EMU_NO_OTHER_BARRIER,       // every other __syncthreads is deleted (v2: the end of a KV tile;
                                // the backward: the one after Pᵀ and dSᵀ are stored)
};
extern EmuMutation emu_mutation;
extern bool cp_async_at_issue;  // copies land when issued (early), not at their wait_group (late)
extern thread_local bool cp_async_just_waited;
extern std::atomic<long> ldmatrix_conflicts, ldmatrix_misaligned;

struct WarpScratch {
    float a[16][16];
    float b[16][8];
    const unsigned char* rows[32];
};
// Two per warp, used in turn by consecutive mma/ldmatrix calls, so one barrier per call is
// enough: a lane can only write a scratch again (call k+2) after every lane passed the barrier of
// call k+1, that is, after every lane finished reading it in call k.
extern WarpScratch warp_scratch[4][2];
extern thread_local unsigned scratch_turn;  // per lane: calls so far, the same in every lane of a warp
inline WarpScratch& next_scratch() { return warp_scratch[threadIdx.x / 32][scratch_turn++ % 2]; }

template <typename T>
inline T emu_round(float x) {
    if constexpr (std::is_same<T, __nv_bfloat16>::value) return __float2bfloat16(x);
    else return __float2half(x);
}
// The low (hi = 0) or high 16 bits of a register, as a float.
template <typename T>
inline float half_of(uint32_t r, int hi) {
    const uint16_t bits = hi ? uint16_t(r >> 16) : uint16_t(r & 0xffffu);
    T x;
    std::memcpy(&x, &bits, 2);
    return to_f(x);
}
template <typename T>
inline uint32_t pack2(float lo, float hi) {
    const T a = emu_round<T>(lo), b = emu_round<T>(hi);
    uint16_t la, lb;
    std::memcpy(&la, &a, 2);
    std::memcpy(&lb, &b, 2);
    return uint32_t(la) | (uint32_t(lb) << 16);
}

// pack2's inverse: the low half in .x.
template <typename T>
inline float2 unpack2(uint32_t r) {
    return {half_of<T>(r, 0), half_of<T>(r, 1)};
}

template <typename T>
inline void mma_m16n8k16(float d[4], const uint32_t a[4], const uint32_t b[2]) {
    const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    WarpScratch& s = next_scratch();
    const bool swap_a = emu_mutation == EMU_A_ROWS_COLS_SWAPPED, swap_b = emu_mutation == EMU_B_REGS_SWAPPED;
    for (int e = 0; e < 2; ++e) {  // e: the register's low and high halves, columns (or rows of B) 2t, 2t+1
        s.a[g][2 * t + e] = half_of<T>(a[0], e);
        s.a[g + 8][2 * t + e] = half_of<T>(a[swap_a ? 2 : 1], e);
        s.a[g][2 * t + 8 + e] = half_of<T>(a[swap_a ? 1 : 2], e);
        s.a[g + 8][2 * t + 8 + e] = half_of<T>(a[3], e);
        s.b[2 * t + e][g] = half_of<T>(b[swap_b ? 1 : 0], e);
        s.b[2 * t + 8 + e][g] = half_of<T>(b[swap_b ? 0 : 1], e);
    }
    __syncwarp();  // the warp's whole A and B are in place
    float out[4];
    for (int i = 0; i < 4; ++i) {  // d0, d1: row g, columns 2t, 2t+1; d2, d3: row g+8
        const int row = g + 8 * ((i / 2) ^ (emu_mutation == EMU_D_ROWS_SWAPPED)), col = 2 * t + i % 2;
        float acc = d[i];  // f32 accumulate; the 16-bit products are exact in f32
        for (int kk = 0; kk < 16; ++kk) acc += s.a[row][kk] * s.b[kk][col];
        out[i] = acc;
    }
    for (int i = 0; i < 4; ++i) d[i] = out[i];
}

inline void emu_ldmatrix_x4(uint32_t r[4], const void* row, bool trans) {
    const int lane = threadIdx.x % 32;
    WarpScratch& s = next_scratch();
    s.rows[lane] = static_cast<const unsigned char*>(row);
    __syncwarp();  // all 32 row addresses are in
    if (lane == 0) {
        for (int m = 0; m < 4; ++m) {
            unsigned seen = 0;  // which 16-byte slots of a 128-byte line this phase's rows hit
            for (int i = 0; i < 8; ++i) {
                const uintptr_t addr = reinterpret_cast<uintptr_t>(s.rows[8 * m + i]);
                if (addr % 16 != 0) ++ldmatrix_misaligned;
                const unsigned slot = 1u << ((addr / 16) % 8);
                if (seen & slot) ++ldmatrix_conflicts;
                seen |= slot;
            }
        }
    }
    const int rr = lane / 4, w = lane % 4;
    for (int m = 0; m < 4; ++m) {
        uint16_t lo, hi;
        if (!trans) {  // row rr, values 2w and 2w+1
            const unsigned char* p = s.rows[8 * m + rr];
            std::memcpy(&lo, p + 2 * (2 * w), 2);
            std::memcpy(&hi, p + 2 * (2 * w + 1), 2);
        } else {  // column rr, rows 2w and 2w+1
            std::memcpy(&lo, s.rows[8 * m + 2 * w] + 2 * rr, 2);
            std::memcpy(&hi, s.rows[8 * m + 2 * w + 1] + 2 * rr, 2);
        }
        r[m] = uint32_t(lo) | (uint32_t(hi) << 16);
    }
}
inline void ldmatrix_x4(uint32_t r[4], const void* row) { emu_ldmatrix_x4(r, row, false); }
inline void ldmatrix_x4_trans(uint32_t r[4], const void* row) {
    emu_ldmatrix_x4(r, row, emu_mutation != EMU_LDMATRIX_NO_TRANS);
}

struct PendingCopy {
    void* dst;
    const void* src;
    bool valid;
    int bytes;  // 16 (cp_async_16) or 4 (cp_async_4)
};
// Per thread, as cp.async groups are: copies issued since the last commit, and committed groups
// not yet waited for, oldest first. Each emulated block starts fresh threads, so both start empty.
extern thread_local std::vector<PendingCopy> cp_open;
extern thread_local std::vector<std::vector<PendingCopy>> cp_groups;

// red.global.add.v2.f32 (and the two atomicAdd below sm_90): two f32 atomic adds.
inline void red_add_f32x2(float* p, float a, float b) {
    atomicAdd(p, a);
    atomicAdd(p + 1, b);
}

// ex2.approx.ftz.f32: 2^x, with subnormal inputs and results flushed to zero (+0 for −∞).
inline float exp2_ftz(float x) {
    if (std::fpclassify(x) == FP_SUBNORMAL) x = 0.0f;
    const float y = std::exp2(x);
    return std::fpclassify(y) == FP_SUBNORMAL ? 0.0f : y;
}

inline void emu_cp_async(void* dst, const void* src, bool valid, int bytes) {
    if (!cp_async_at_issue) cp_open.push_back({dst, src, valid, bytes});
    else if (valid) std::memcpy(dst, src, bytes);
    else std::memset(dst, 0, bytes);
}
inline void cp_async_16(void* dst, const void* src, bool valid) { emu_cp_async(dst, src, valid, 16); }
inline void cp_async_4(void* dst, const void* src, bool valid) { emu_cp_async(dst, src, valid, 4); }
inline void cp_async_commit() {
    cp_groups.push_back(std::move(cp_open));
    cp_open.clear();
}
template <int N>
inline void cp_async_wait() {
    cp_async_just_waited = true;
    // Race tests: the held warp's late copies land well after the other warps passed their waits.
    if ((int)(threadIdx.x / 32) == slow_warp) std::this_thread::sleep_for(std::chrono::milliseconds(50));
    const size_t keep = N + (emu_mutation == EMU_WAIT_ONE_GROUP_LESS);
    while (cp_groups.size() > keep) {
        for (const PendingCopy& c : cp_groups.front()) {
            if (c.valid) std::memcpy(c.dst, c.src, c.bytes);
            else std::memset(c.dst, 0, c.bytes);
        }
        cp_groups.erase(cp_groups.begin());
    }
}

// The barrier mutations (mma.h's skip_barrier): which __syncthreads this thread leaves out.
inline bool emu_skip_barrier() {
    const bool after_wait = cp_async_just_waited;
    cp_async_just_waited = false;
    return (emu_mutation == EMU_NO_BARRIER_AFTER_WAIT && after_wait) || (emu_mutation == EMU_NO_OTHER_BARRIER && !after_wait);
}
