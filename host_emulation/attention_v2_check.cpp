// Runs stage2_sdpa/kernels/flash_attn_v2.cu — the real source, unchanged — on the CPU through the
// emulation of its PTX in ptx_warp.h (mma.sync m16n8k16, ldmatrix .x4 and .x4.trans, cp.async
// groups; threads and shuffles from mma.h), and checks every entry point (bf16, f16; d_head 32,
// 64, 128) against an f64 reference on the same 16-bit inputs: T = 1, 15, 64, 67, 128 and 1000
// (one tile, ragged tiles, exact tiles, many tiles), causal and not, in stage 3's strided layout
// (q, k, v slices of one (B, T, 3, n_head, d_head) tensor) and stage 2's contiguous one, over
// several heads and batches. Also requires: no ldmatrix bank conflicts (the swizzle) and no
// misaligned ldmatrix row.
//
// Every call runs twice (the T = 1000 shape once): with cp.async copies landing at their
// wait_group (the latest the PTX memory model allows) and at issue (the earliest); a kernel must
// be right under both.
//
// Then the mutation tests: the same kernel under an emulation with one fragment layout, the
// .trans or the cp.async wait deliberately wrong, or one of the KV loop's two barriers deleted
// (EmuMutation in ptx_warp.h) must fail the check; a mutation that passes means the check could
// not tell the ISA's layout from another, or could not see the race the barrier prevents. The
// probe calls of a mutation stop at the first that fails. The barrier mutations try each warp in
// turn, held back at every barrier and wait (a
// causal block's first warps skip its last key tiles, so no one warp sees every race), under the
// copy timing that exposes their race: without the barrier after the wait, the other warps read
// tile j before the held warp's late copies land; without the barrier at the end of a tile,
// they refill a buffer with early copies while the held warp still reads it.
// Exit 0 when every kernel call is within tolerance and every mutation is caught.
//
//   bash host_emulation/run.sh attention_v2_check      (~2 min on 2 cores)
#include <string>
#include "../stage2_sdpa/kernels/flash_attn_v2.cu"

#include <cstdio>
#include <memory>
#include <random>
#include <thread>

thread_local dim3 threadIdx;
dim3 blockIdx, gridDim;
std::barrier<>* block_barrier;
std::barrier<>* warp_barrier[4];
float shfl_buf[4][32];
WarpScratch warp_scratch[4][2];
thread_local unsigned scratch_turn = 0;
EmuMutation emu_mutation = EMU_EXACT;
bool cp_async_at_issue = false;
thread_local bool cp_async_just_waited = false;
std::atomic<long> ldmatrix_conflicts{0}, ldmatrix_misaligned{0};
thread_local std::vector<PendingCopy> cp_open;
thread_local std::vector<std::vector<PendingCopy>> cp_groups;
__attribute__((aligned(128))) unsigned char smem[smem_bytes_v2<128>()];

// As src/attention_cuda.rs launches v2: (n_head, B, query tiles), heads fastest.
dim3 launch_grid(int T, int H, int B) { return {(unsigned)H, (unsigned)B, (unsigned)((T + BR - 1) / BR)}; }

#include "attention_harness.h"

#define ENTRY(name) reinterpret_cast<Entry>(&name)
struct Case {
    const char* name;
    Entry entry;
    bool bf16;
    int d;
};
const Case cases[] = {
    {"bf16 d32", ENTRY(flash_attn_v2_fwd_bf16_d32), true, 32},  {"bf16 d64", ENTRY(flash_attn_v2_fwd_bf16_d64), true, 64},
    {"bf16 d128", ENTRY(flash_attn_v2_fwd_bf16_d128), true, 128}, {"f16 d32", ENTRY(flash_attn_v2_fwd_f16_d32), false, 32},
    {"f16 d64", ENTRY(flash_attn_v2_fwd_f16_d64), false, 64},     {"f16 d128", ENTRY(flash_attn_v2_fwd_f16_d128), false, 128},
};
struct Shape {
    int B, T, H;
};
// T = 1000 runs one head: the f64 reference and the emulation are O(T²·d) per head.
const Shape shapes[] = {{1, 1, 2}, {2, 15, 3}, {1, 64, 2}, {2, 67, 1}, {1, 128, 2}, {1, 1000, 1}};

// One kernel call, printed; true when within tolerance. The output is rounded to 16 bits, and so
// is P̃ before P̃ V: bf16 keeps 8 significant bits (rel. error ~2e-3), f16 11 (~3e-4).
bool run(const Case& c, const Shape& s, bool causal, bool strided, unsigned seed, bool quiet) {
    const double e = c.bf16 ? check<__nv_bfloat16>(c.entry, s.B, s.T, s.H, c.d, causal, strided, seed)
                            : check<__half>(c.entry, s.B, s.T, s.H, c.d, causal, strided, seed);
    const double tol = c.bf16 ? 1e-2 : 2e-3;
    // L (the training output) is f32 arithmetic on the f32 scores: ~1e-7 relative.
    const bool ok = e < tol && last_lse_err < 1e-5;
    if (!quiet)
        printf("v2 %-9s B=%d T=%-4d n_head=%d causal=%d %-10s copies %s rel err %.2e L %.1e %s\n", c.name, s.B, s.T,
               s.H, causal, strided ? "strided" : "contiguous", cp_async_at_issue ? "early" : "late ", e, last_lse_err,
               ok ? "ok" : "FAILED");
    return ok;
}

int main() {
    int failed = 0, n = 0;
    for (int at_issue = 0; at_issue < 2; ++at_issue) {
        cp_async_at_issue = at_issue;
        for (int ci = 0; ci < 6; ++ci)
            // T = 1000 (the last shape) runs with late copies only: early copies change when a
            // copy lands, not the arithmetic, and T = 128 already crosses four key tiles.
            for (int si = 0; si < (at_issue ? 5 : 6); ++si)
                for (int causal = 0; causal < 2; ++causal) {
                    const bool strided = (ci + si) % 2 == 0;  // each shape in both layouts, over the cases
                    ++n;
                    failed += !run(cases[ci], shapes[si], causal, strided, n, false);
                }
    }
    printf("v2: %d of %d kernel calls within tolerance\n", n - failed, n);
    printf("v2: ldmatrix bank conflicts %ld, misaligned rows %ld (both must be 0)\n", ldmatrix_conflicts.load(),
           ldmatrix_misaligned.load());
    bool ok = failed == 0 && ldmatrix_conflicts == 0 && ldmatrix_misaligned == 0;

    // Mutation tests: each mutation must make at least one of these calls fail.
    const struct {
        EmuMutation m;
        bool at_issue;  // copy timing the mutation runs under
        const char* what;
    } mutations[] = {
        {EMU_A_ROWS_COLS_SWAPPED, false, "A fragment: a1 and a2 swapped"},
        {EMU_B_REGS_SWAPPED, false, "B fragment: b0 and b1 swapped"},
        {EMU_D_ROWS_SWAPPED, false, "C/D fragment: rows g and g+8 swapped"},
        {EMU_LDMATRIX_NO_TRANS, false, "ldmatrix .trans ignored"},
        {EMU_WAIT_ONE_GROUP_LESS, false, "cp.async.wait_group waits for one group less"},
        {EMU_NO_BARRIER_AFTER_WAIT, false, "KV loop: barrier after the wait deleted, late copies"},
        {EMU_NO_OTHER_BARRIER, true, "KV loop: barrier at the end of a tile deleted, early copies"},
    };
    const struct {
        int ci, si;
        bool causal, strided;
    } probes[] = {{1, 3, true, true}, {5, 4, false, false}, {0, 1, true, false}};
    skip_barrier = emu_skip_barrier;
    for (const auto& mu : mutations) {
        emu_mutation = mu.m;
        cp_async_at_issue = mu.at_issue;
        const bool race = mu.m == EMU_NO_BARRIER_AFTER_WAIT || mu.m == EMU_NO_OTHER_BARRIER;
        // Probe calls until one fails (the mutation is caught) or all have passed (it is not).
        int calls = 0;
        bool good = false;
        for (int w = race ? 0 : -1; w < (race ? WARPS : 0) && !good; ++w) {
            slow_warp = w;
            for (const auto& p : probes) {
                ++calls;
                if (!run(cases[p.ci], shapes[p.si], p.causal, p.strided, 7, true)) {
                    good = true;
                    break;
                }
            }
        }
        printf("mutation (%s): %s\n", mu.what,
               good ? ("caught by probe call " + std::to_string(calls) + ", as it must be").c_str()
                    : "NOT CAUGHT: no probe call fails, so the check cannot see this mistake");
        ok &= good;
    }
    emu_mutation = EMU_EXACT;
    cp_async_at_issue = false;
    slow_warp = -1;
    return ok ? 0 : 1;
}
