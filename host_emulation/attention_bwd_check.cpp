// Runs stage2_sdpa/kernels/flash_attn_bwd.cu — the real source, unchanged — on the CPU through the
// emulation in mma.h, as training runs it: the forward kernel (flash_attn.cu, which it includes)
// writes O and L, the host's D_i = rowsum(dO ∘ O) is summed in f32 from that O, then the backward
// kernel; against an f64 reference of L, dQ, dK and dV on the same 16-bit q, k, v and dO. T = 1, T not a multiple of the tile, several tiles, heads and
// batches, causal and not, stage 3's strided layout and stage 2's contiguous one. Shared memory
// and dK, dV start as NaN; dQ starts at 0, as the host zeroes it. Exit 0 when all are within tolerance.
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
__attribute__((aligned(128))) unsigned char smem[bwd_smem_bytes<128>()];

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

template <typename T, int D>
Errors check(int B, int Tn, int H, bool causal, bool strided, unsigned seed) {
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
    const size_t n_out = (size_t)B * Tn * H * D;
    auto dO = [&](int b, int h, int t, int c) { return (double)to_f(qkv[3][b * sb + t * st + h * sh + c]); };
    const float scale = 1.0f / std::sqrt((float)D);
    auto at = [&](int p, int b, int h, int t, int c) { return (double)to_f(qkv[p][b * sb + t * st + h * sh + c]); };
    auto out_at = [&](int b, int h, int t) { return ((size_t)b * Tn + t) * H * D + (size_t)h * D; };

    // The forward as training launches it (src/attention_cuda.rs): O (contiguous (B, T, H, D)) and L.
    std::vector<float> lse((size_t)B * H * Tn, NAN), dq(n_out, 0.0f), dk(n_out, NAN), dv(n_out, NAN);
    std::vector<T> o(n_out);
    std::memset(o.data(), 0xff, o.size() * sizeof(T));
    const dim3 grid{(unsigned)((Tn + BR - 1) / BR), (unsigned)H, (unsigned)B};
    run_grid(grid, [&] {
        flash_attn_fwd<T, D>(qkv[0], qkv[1], qkv[2], o.data(), Tn, sb, st, sh, (long long)Tn * H * D, (long long)H * D, D, scale,
                             causal, lse.data());
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
    run_grid(grid, [&] {
        flash_attn_bwd<T, D>(qkv[0], qkv[1], qkv[2], qkv[3], lse.data(), delta.data(), dq.data(), dk.data(), dv.data(), Tn,
                             sb, st, sh, scale, causal);
    });
    return {rel(lse, lse_ref), rel(dq, dq_ref), rel(dk, dk_ref), rel(dv, dv_ref)};
}

int main() {
    struct Shape {
        int B, T, H;
    } shapes[] = {{1, 1, 1}, {1, 17, 2}, {2, 64, 1}, {1, 65, 2}, {2, 33, 3}, {1, 150, 1}};
    int failed = 0, n = 0;
    for (int dt = 0; dt < 2; ++dt)
        for (int d : {32, 64, 128})
            for (int si = 0; si < 6; ++si)
                for (int causal = 0; causal < 2; ++causal) {
                    const Shape& s = shapes[si];
                    const bool strided = (d / 32 + si) % 2 == 0;
                    ++n;
                    const bool bf16 = dt == 0;
                    auto run = [&]<typename T>() -> Errors {
                        if (d == 32) return check<T, 32>(s.B, s.T, s.H, causal, strided, n);
                        if (d == 64) return check<T, 64>(s.B, s.T, s.H, causal, strided, n);
                        return check<T, 128>(s.B, s.T, s.H, causal, strided, n);
                    };
                    const Errors e = bf16 ? run.template operator()<__nv_bfloat16>() : run.template operator()<__half>();
                    // P and dS are rounded to 16 bits as operands, as the forward rounds P̃: bf16
                    // keeps 8 significant bits, f16 11. L is f32 throughout.
                    const double tol = bf16 ? 3e-2 : 5e-3;
                    const bool ok = e.lse < 1e-5 && e.dq < tol && e.dk < tol && e.dv < tol;
                    failed += !ok;
                    printf("bwd %-4s d%-3d B=%d T=%-3d n_head=%d causal=%d %-10s rel err L %.1e dQ %.2e dK %.2e dV %.2e %s\n",
                           bf16 ? "bf16" : "f16", d, s.B, s.T, s.H, causal, strided ? "strided" : "contiguous", e.lse, e.dq,
                           e.dk, e.dv, ok ? "ok" : "FAILED");
                }
    printf("%d of %d backward calls within tolerance\n", n - failed, n);
    return failed != 0;
}
