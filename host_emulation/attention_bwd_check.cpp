// Runs stage2_sdpa/kernels/flash_attn_bwd.cu — the real source, unchanged — on the CPU through the
// emulation of its PTX in ptx_warp.h (mma.sync m16n8k16, ldmatrix .x4 and .x4.trans, cp.async
// groups of 16- and 4-byte copies; threads, shuffles and atomics from mma.h), as training runs
// it: the forward v2 kernel (flash_attn_v2.cu, which it includes) writes O and L, the host's
// D_i = rowsum(dO ∘ O) is summed in f32 from that O, then the backward kernel; against an f64
// reference of L, dQ, dK and dV on the same 16-bit q, k, v and dO. Every entry point (bf16, f16;
// d_head 32, 64, 128), T = 1, T not a multiple of the tile, several tiles, heads and batches,
// causal and not, stage 3's strided layout and stage 2's contiguous one, and rows whose every score
// is far below zero (a padded key must be masked there). Shared memory and dK,
// dV start as NaN; dQ starts at 0, as the host zeroes it. Also requires no ldmatrix bank
// conflict and no misaligned ldmatrix row.
//
// Every call runs twice: with cp.async copies landing at their wait_group (the latest the PTX
// memory model allows) and at issue (the earliest); the kernel must be right under both.
//
// Then the mutation tests, as attention_v2_check.cpp's: the backward (the forward before it runs
// exact) under an emulation with one fragment layout, the .trans or the cp.async wait
// deliberately wrong, or one of the query loop's two barriers deleted, must fail the check; a
// mutation that passes means the check could not tell the ISA's layout from another, or could not
// see the race the barrier prevents. The barrier mutations try each warp in turn, held back at
// every barrier and wait, under the copy timing that exposes their race: without the barrier
// after the wait, the other warps read tile i before the held warp's late copies land, and
// refill the stage it still reads with early ones; without the barrier after Pᵀ and dSᵀ are
// stored, the other warps read rows of them the held warp has not written.
// Exit 0 when every kernel call is within tolerance and every mutation is caught.
//
//   bash host_emulation/run.sh attention_bwd_check
#include <string>
#include "../stage2_sdpa/kernels/flash_attn_bwd.cu"

#include <cstdio>
#include <memory>
#include <random>
#include <thread>
#include <vector>

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
constexpr int SMEM_BYTES = bwd_smem_bytes<128>() > smem_bytes_v2<128>() ? bwd_smem_bytes<128>() : smem_bytes_v2<128>();
__attribute__((aligned(128))) unsigned char smem[SMEM_BYTES];

template <typename F>
void run_grid(dim3 grid, F kernel) {
    gridDim = grid;
    for (unsigned z = 0; z < grid.z; ++z)
        for (unsigned y = 0; y < grid.y; ++y)
            for (unsigned x = 0; x < grid.x; ++x) {
                blockIdx = {x, y, z};
                std::memset(smem, 0xff, sizeof smem);  // shared memory starts as garbage (NaN)
                std::barrier<> block(THREADS);
                std::unique_ptr<std::barrier<>> warps[WARPS];
                for (int w = 0; w < WARPS; ++w) warp_barrier[w] = (warps[w] = std::make_unique<std::barrier<>>(32)).get();
                block_barrier = &block;
                std::vector<std::thread> threads;
                for (int t = 0; t < THREADS; ++t)
                    threads.emplace_back([&, t] {
                        threadIdx = {(unsigned)t, 0, 0};
                        scratch_turn = 0;
                        cp_open.clear();
                        cp_groups.clear();
                        kernel();
                    });
                for (auto& th : threads) th.join();
            }
}

template <typename T>
T round16(float x) {
    if constexpr (std::is_same<T, __nv_bfloat16>::value) return __float2bfloat16(x);
    else return __float2half(x);
}

// ||got − ref|| / ||ref||, infinity if any value is not finite. A reference that is zero but for
// rounding (T = 1: one key, so P = 1 and dS = dP − D = 0; the reference's D is the f32 sum the
// host makes, its dP an f64 one) is compared by the RMS of the difference instead.
static double rel(const std::vector<float>& got, const std::vector<double>& ref) {
    double num = 0, den = 0;
    for (size_t i = 0; i < ref.size(); ++i) {
        if (!std::isfinite(got[i])) return INFINITY;
        num += (got[i] - ref[i]) * (got[i] - ref[i]);
        den += ref[i] * ref[i];
    }
    const double n = (double)ref.size();
    return std::sqrt(den / n) > 1e-4 ? std::sqrt(num / den) : std::sqrt(num / n);
}

struct Errors {
    double lse, dq, dk, dv;
};

// One forward + backward call; `mutation` applies to the backward kernel only.
template <typename T, int D>
// `shift`: q drawn around +shift and k around −shift, so that every score is far below zero.
Errors check(int B, int Tn, int H, bool causal, bool strided, unsigned seed, EmuMutation mutation, float shift = 0) {
    // q, k, v, dO: four slices of one (B, T, 4, H, D) buffer as the host passes them, or four
    // contiguous ones (the same strides, which is all the kernel asks).
    const int parts = strided ? 4 : 1;
    const long long sb = (long long)Tn * parts * H * D, st = (long long)parts * H * D, sh = D;
    std::vector<std::vector<T>> buf(strided ? 1 : 4, std::vector<T>((size_t)B * Tn * parts * H * D));
    std::mt19937 rng(seed);
    std::normal_distribution<float> normal;
    for (auto& b : buf)
        for (auto& x : b) x = round16<T>(normal(rng));
    const T* qkv[4];
    for (int p = 0; p < 4; ++p) qkv[p] = strided ? buf[0].data() + p * H * D : buf[p].data();
    for (int p = 0; p < 2; ++p)  // q += shift, k −= shift
        for (size_t i = 0; i < (size_t)B * Tn; ++i)
            for (int c = 0; c < H * D; ++c) {
                T* x = const_cast<T*>(qkv[p]) + i * st + c;
                *x = round16<T>(to_f(*x) + (p == 0 ? shift : -shift));
            }
    const size_t n_out = (size_t)B * Tn * H * D;
    auto dO = [&](int b, int h, int t, int c) { return (double)to_f(qkv[3][b * sb + t * st + h * sh + c]); };
    const float scale = 1.0f / std::sqrt((float)D);
    auto at = [&](int p, int b, int h, int t, int c) { return (double)to_f(qkv[p][b * sb + t * st + h * sh + c]); };
    auto out_at = [&](int b, int h, int t) { return ((size_t)b * Tn + t) * H * D + (size_t)h * D; };

    // The forward as training launches it (src/attention_cuda.rs, v2): O (contiguous (B, T, H, D)) and L.
    std::vector<float> lse((size_t)B * H * Tn, NAN), dq(n_out, 0.0f), dk(n_out, NAN), dv(n_out, NAN);
    std::vector<T> o(n_out);
    std::memset(o.data(), 0xff, o.size() * sizeof(T));
    const int held = slow_warp;  // the race tests hold a warp back in the backward only
    slow_warp = -1;
    emu_mutation = EMU_EXACT;
    skip_barrier = nullptr;
    run_grid(dim3{(unsigned)H, (unsigned)B, (unsigned)((Tn + BR - 1) / BR)}, [&] {
        flash_attn_v2_fwd<T, D>(qkv[0], qkv[1], qkv[2], o.data(), Tn, sb, st, sh, (long long)Tn * H * D, (long long)H * D, D,
                                scale, causal, lse.data());
    });
    // D_i = Σ_c dO_ic O_ic in f32, from the forward's 16-bit O, as the host's candle ops sum it.
    std::vector<float> delta((size_t)B * H * Tn);
    for (int b = 0; b < B; ++b)
        for (int h = 0; h < H; ++h)
            for (int i = 0; i < Tn; ++i) {
                float d_i = 0;
                for (int c = 0; c < D; ++c) d_i += (float)dO(b, h, i, c) * to_f(o[out_at(b, h, i) + c]);
                delta[((size_t)b * H + h) * Tn + i] = d_i;
            }

    // f64 reference: P = softmax(S), then the gradients (with the D above: the backward's input).
    std::vector<double> lse_ref((size_t)B * H * Tn), dq_ref(n_out, 0), dk_ref(n_out, 0), dv_ref(n_out, 0);
    for (int b = 0; b < B; ++b)
        for (int h = 0; h < H; ++h) {
            std::vector<double> P((size_t)Tn * Tn, 0), dP((size_t)Tn * Tn, 0);
            for (int i = 0; i < Tn; ++i) {
                const int n = causal ? i + 1 : Tn;
                double m = -INFINITY, l = 0;
                for (int j = 0; j < n; ++j) {
                    double s = 0;
                    for (int c = 0; c < D; ++c) s += at(0, b, h, i, c) * at(1, b, h, j, c);
                    m = std::max(m, P[(size_t)i * Tn + j] = s * scale);
                }
                for (int j = 0; j < n; ++j) l += (P[(size_t)i * Tn + j] = std::exp(P[(size_t)i * Tn + j] - m));
                for (int j = 0; j < n; ++j) P[(size_t)i * Tn + j] /= l;
                lse_ref[((size_t)b * H + h) * Tn + i] = m + std::log(l);
            }
            for (int i = 0; i < Tn; ++i)
                for (int j = 0; j < Tn; ++j) {
                    double s = 0;
                    for (int c = 0; c < D; ++c) s += dO(b, h, i, c) * at(2, b, h, j, c);
                    dP[(size_t)i * Tn + j] = s;
                }
            for (int i = 0; i < Tn; ++i)
                for (int j = 0; j < Tn; ++j) {
                    const double p = P[(size_t)i * Tn + j];
                    const double ds = p * (dP[(size_t)i * Tn + j] - delta[((size_t)b * H + h) * Tn + i]) * scale;
                    for (int c = 0; c < D; ++c) {
                        dv_ref[out_at(b, h, j) + c] += p * dO(b, h, i, c);
                        dq_ref[out_at(b, h, i) + c] += ds * at(1, b, h, j, c);
                        dk_ref[out_at(b, h, j) + c] += ds * at(0, b, h, i, c);
                    }
                }
        }

    // The backward, as src/attention_cuda.rs launches it: one block per (key tile, head, batch).
    emu_mutation = mutation;
    skip_barrier = emu_skip_barrier;
    slow_warp = held;
    run_grid(dim3{(unsigned)((Tn + BC_BWD - 1) / BC_BWD), (unsigned)H, (unsigned)B}, [&] {
        flash_attn_bwd<T, D>(qkv[0], qkv[1], qkv[2], qkv[3], lse.data(), delta.data(), dq.data(), dk.data(), dv.data(), Tn,
                             sb, st, sh, scale, causal);
    });
    emu_mutation = EMU_EXACT;
    skip_barrier = nullptr;
    slow_warp = held;
    return {rel(lse, lse_ref), rel(dq, dq_ref), rel(dk, dk_ref), rel(dv, dv_ref)};
}

struct Shape {
    int B, T, H;
};
// T = 150: three key tiles and three query tiles, the last ragged; causal: a diagonal tile and
// unmasked ones in every block but the last.
const Shape shapes[] = {{1, 1, 1}, {1, 17, 2}, {2, 64, 1}, {1, 65, 2}, {2, 33, 3}, {1, 150, 1}};

// One call, printed unless quiet; true when within tolerance.
bool run(bool bf16, int d, const Shape& s, bool causal, bool strided, unsigned seed, EmuMutation mutation, bool quiet) {
    auto call = [&]<typename T>() -> Errors {
        if (d == 32) return check<T, 32>(s.B, s.T, s.H, causal, strided, seed, mutation);
        if (d == 64) return check<T, 64>(s.B, s.T, s.H, causal, strided, seed, mutation);
        return check<T, 128>(s.B, s.T, s.H, causal, strided, seed, mutation);
    };
    const Errors e = bf16 ? call.template operator()<__nv_bfloat16>() : call.template operator()<__half>();
    // P and dS are rounded to 16 bits as operands, as the forward rounds P̃: bf16 keeps 8
    // significant bits (rel. error ~2e-3 here), f16 11 (~2e-4). L is f32 throughout.
    const double tol = bf16 ? 1e-2 : 2e-3;
    const bool ok = e.lse < 1e-5 && e.dq < tol && e.dk < tol && e.dv < tol;
    if (!quiet)
        printf("bwd %-4s d%-3d B=%d T=%-3d n_head=%d causal=%d %-10s copies %s rel err L %.1e dQ %.2e dK %.2e dV %.2e %s\n",
               bf16 ? "bf16" : "f16", d, s.B, s.T, s.H, causal, strided ? "strided" : "contiguous",
               cp_async_at_issue ? "early" : "late ", e.lse, e.dq, e.dk, e.dv, ok ? "ok" : "FAILED");
    return ok;
}

int main() {
    int failed = 0, n = 0;
    for (int at_issue = 0; at_issue < 2; ++at_issue) {
        cp_async_at_issue = at_issue;
        for (int dt = 0; dt < 2; ++dt)
            for (int d : {32, 64, 128})
                for (int si = 0; si < 6; ++si)
                    for (int causal = 0; causal < 2; ++causal) {
                        const bool strided = (d / 32 + si) % 2 == 0;  // each shape in both layouts, over the sizes
                        ++n;
                        failed += !run(dt == 0, d, shapes[si], causal, strided, n, EMU_EXACT, false);
                    }
    }
    cp_async_at_issue = false;
    // Every score near −128 (q ≈ 4, k ≈ −4 at d_head 64): L_i ≈ −124, so a padded key's zero
    // score would give P = exp(0 − L_i) = +inf were padded keys not masked, and dS · K_pad = inf · 0
    // would put NaN into dQ. T = 65 and 150: the last key tile is ragged, causal and not.
    for (int dt = 0; dt < 2; ++dt)
        for (int si : {3, 5})
            for (int causal = 0; causal < 2; ++causal) {
                ++n;
                const Shape& s = shapes[si];
                const bool bf16 = dt == 0;
                const Errors e = bf16 ? check<__nv_bfloat16, 64>(s.B, s.T, s.H, causal, si == 3, n, EMU_EXACT, 4.0f)
                                      : check<__half, 64>(s.B, s.T, s.H, causal, si == 3, n, EMU_EXACT, 4.0f);
                const double tol = bf16 ? 1e-2 : 2e-3;
                const bool ok = e.lse < 1e-5 && e.dq < tol && e.dk < tol && e.dv < tol;
                failed += !ok;
                printf("bwd %-4s d64  B=%d T=%-3d n_head=%d causal=%d scores near -128 rel err L %.1e dQ %.2e dK %.2e dV %.2e %s\n",
                       bf16 ? "bf16" : "f16", s.B, s.T, s.H, causal, e.lse, e.dq, e.dk, e.dv, ok ? "ok" : "FAILED");
            }
    printf("bwd: %d of %d kernel calls within tolerance\n", n - failed, n);
    printf("bwd: ldmatrix bank conflicts %ld, misaligned rows %ld (both must be 0)\n", ldmatrix_conflicts.load(),
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
        {EMU_NO_BARRIER_AFTER_WAIT, false, "query loop: barrier after the wait deleted, late copies"},
        {EMU_NO_OTHER_BARRIER, true, "query loop: barrier after P and dS are stored deleted, early copies"},
    };
    const struct {
        bool bf16;
        int d, si;
        bool causal, strided;
    } probes[] = {{true, 64, 3, true, true}, {false, 128, 2, false, false}, {true, 32, 1, true, false}};
    for (const auto& mu : mutations) {
        cp_async_at_issue = mu.at_issue;
        const bool race = mu.m == EMU_NO_BARRIER_AFTER_WAIT || mu.m == EMU_NO_OTHER_BARRIER;
        // Probe calls until one fails (the mutation is caught) or all have passed (it is not).
        int calls = 0;
        bool good = false;
        for (int w = race ? 0 : -1; w < (race ? WARPS : 0) && !good; ++w) {
            slow_warp = w;
            for (const auto& p : probes) {
                ++calls;
                if (!run(p.bf16, p.d, shapes[p.si], p.causal, p.strided, 7, mu.m, true)) {
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
    cp_async_at_issue = false;
    slow_warp = -1;
    return ok ? 0 : 1;
}
