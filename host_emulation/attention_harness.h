// The launch-and-compare harness of both attention checks (attention_check.cpp for v1,
// attention_v2_check.cpp for v2): random 16-bit q, k, v in stage 2's contiguous or stage 3's
// strided layout, every block of the grid run as THREADS emulated threads over NaN-filled shared
// memory and output, then the relative error against an f64 softmax(q kᵀ · scale) v. Included
// after the kernel and the emulation's globals (THREADS, WARPS, smem, the barriers) and the
// check's `launch_grid(T, n_head, B)`, the grid its kernel is launched with (v1: (⌈T / B_r⌉,
// n_head, B); v2: (n_head, B, ⌈T / B_r⌉)).
#pragma once

// The signature every FLASH_ATTN_ENTRY and FLASH_ATTN_V2_ENTRY has, with the element pointers type-erased.
using Entry = void (*)(const void*, const void*, const void*, void*, int, long long, long long, long long, long long,
                       long long, long long, float, int, float*);

// The last call's log-sum-exp error (the kernels' training output, (B, n_head, T) f32):
// ||L − L_ref|| / ||L_ref||, infinity if one is not finite.
inline double last_lse_err = 0;

// Relative error ||o − ref|| / ||ref|| of one kernel call; infinity if any output is not finite.
template <typename T>
double check(Entry entry, int B, int Tn, int H, int D, bool causal, bool strided, unsigned seed) {
    const int parts = strided ? 3 : 1;  // strided: q, k, v interleaved in one (B, T, 3, H, D) buffer
    const long long sb = (long long)Tn * parts * H * D, st = (long long)parts * H * D, sh = D;
    std::vector<std::vector<T>> buf(strided ? 1 : 3, std::vector<T>((size_t)B * Tn * parts * H * D));
    std::mt19937 rng(seed);
    std::normal_distribution<float> normal;
    for (auto& b : buf)
        for (auto& x : b) {
            if constexpr (std::is_same<T, __nv_bfloat16>::value) x = __float2bfloat16(normal(rng));
            else x = __float2half(normal(rng));
        }
    const T* qkv[3];
    for (int p = 0; p < 3; ++p) qkv[p] = strided ? buf[0].data() + p * H * D : buf[p].data();
    std::vector<T> o((size_t)B * Tn * H * D);
    std::memset(o.data(), 0xff, o.size() * sizeof(T));  // NaN: every element must be written
    std::vector<float> lse((size_t)B * H * Tn, NAN);
    const float scale = 1.0f / std::sqrt((float)D);

    gridDim = launch_grid(Tn, H, B);
    for (unsigned z = 0; z < gridDim.z; ++z)
        for (unsigned y = 0; y < gridDim.y; ++y)
            for (unsigned x = 0; x < gridDim.x; ++x) {
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
                        entry(qkv[0], qkv[1], qkv[2], o.data(), Tn, sb, st, sh, (long long)Tn * H * D, (long long)H * D, D,
                              scale, causal, lse.data());
                    });
                for (auto& th : threads) th.join();
            }

    double num = 0, den = 0, lnum = 0, lden = 0;
    for (int b = 0; b < B; ++b)
        for (int h = 0; h < H; ++h)
            for (int i = 0; i < Tn; ++i) {
                auto at = [&](int p, int t, int c) { return (double)to_f(qkv[p][b * sb + t * st + h * sh + c]); };
                const int n = causal ? i + 1 : Tn;  // keys row i may see
                std::vector<double> p(n);
                double m = -INFINITY, l = 0;
                for (int j = 0; j < n; ++j) {
                    double s = 0;
                    for (int c = 0; c < D; ++c) s += at(0, i, c) * at(1, j, c);
                    m = std::max(m, p[j] = s * scale);
                }
                for (int j = 0; j < n; ++j) l += (p[j] = std::exp(p[j] - m));
                const double lse_ref = m + std::log(l), got_l = lse[((size_t)b * H + h) * Tn + i];
                lnum += std::isfinite(got_l) ? (got_l - lse_ref) * (got_l - lse_ref) : INFINITY;
                lden += lse_ref * lse_ref;
                for (int c = 0; c < D; ++c) {
                    double ref = 0;
                    for (int j = 0; j < n; ++j) ref += p[j] * at(2, j, c);
                    ref /= l;
                    const double got = to_f(o[((size_t)b * Tn + i) * H * D + h * D + c]);
                    if (!std::isfinite(got)) return INFINITY;
                    num += (got - ref) * (got - ref);
                    den += ref * ref;
                }
            }
    last_lse_err = std::sqrt(lnum / std::max(lden, 1e-30));
    return std::sqrt(num / den);
}
