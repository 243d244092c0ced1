// Runs stage4_fp8/kernels/ln_fp8.cu — the real source, which includes stage 3's
// add_layer_norm.cu and stage 4's fp8.cu unchanged — on the CPU (ln_host.h's threads, barriers,
// shuffles and atomicMax; block_launch.h's launcher) and checks both entry points that write E4M3 (layer_norm_e4m3,
// add_layer_norm_16_e4m3 with a bf16 and an f16 branch) and fp8_reciprocal:
// - h against an f64 LayerNorm: each E4M3 code must be fp8.cu's own cast (f32_to_e4m3) of the
//   f64 reference h / s, except where the f32 LayerNorm and the f64 one straddle a rounding
//   boundary (none at row mean 0; at mean 10⁴ a few percent, bounded by the f32 LayerNorm's
//   own error; then the code is the neighbour);
// - the amax against max |h| in f64 (before the division by s: what the recipe records), and
//   the codes that saturate (s chosen below amax / 448, so some must);
// - x_out = x + branch against f64.
// Rows of C below a warp, not a multiple of 256, and GPT-2's 768; rows of mean 10⁴.
// Exit 0 when all agree.
//
//   bash host_emulation/run.sh ln_fp8_check
#include "ln_host.h"

#include "../stage4_fp8/kernels/ln_fp8.cu"

#include <algorithm>
#include <cstdio>
#include <memory>
#include <random>
#include <thread>
#include <vector>

#include "block_launch.h"

// mode: 0 = layer_norm_e4m3, 1 = add with a bf16 branch, 2 = add with an f16 branch.
// Returns true when every check holds; prints one line.
bool check(int mode, int rows, int C, double mean_scale, unsigned seed) {
    const bool add = mode != 0;
    const int bf16 = mode == 1;
    std::mt19937 rng(seed);
    std::normal_distribution<float> normal;
    std::vector<float> x((size_t)rows * C), br((size_t)rows * C), g(C), b(C);
    for (int r = 0; r < rows; ++r) {
        const float mean = mean_scale * normal(rng);
        for (int c = 0; c < C; ++c) x[(size_t)r * C + c] = mean + normal(rng);
    }
    std::vector<unsigned short> br16(br.size());
    for (size_t i = 0; i < br.size(); ++i) {
        br16[i] = bf16 ? store_16(normal(rng), 1) : f32_to_f16(normal(rng));
        br[i] = load_f(br16.data(), (long)i, bf16);
    }
    for (int c = 0; c < C; ++c) g[c] = 1.0f + 0.1f * normal(rng), b[c] = 0.1f * normal(rng);
    const float eps = 1e-5f;
    // The f64 reference first, to pick a scale that saturates the top: s = 0.8 · amax / 448.
    std::vector<double> h_ref(x.size()), v_ref(x.size());
    double amax_ref = 0;
    for (int r = 0; r < rows; ++r) {
        double s = 0, s2 = 0;
        for (int c = 0; c < C; ++c) {
            const size_t i = (size_t)r * C + c;
            s += (v_ref[i] = (double)x[i] + (add ? (double)br[i] : 0.0));
        }
        const double mean = s / C;
        for (int c = 0; c < C; ++c) s2 += (v_ref[(size_t)r * C + c] - mean) * (v_ref[(size_t)r * C + c] - mean);
        const double inv = 1.0 / std::sqrt(s2 / C + eps);
        for (int c = 0; c < C; ++c) {
            const size_t i = (size_t)r * C + c;
            h_ref[i] = (v_ref[i] - mean) * inv * g[c] + b[c];
            amax_ref = std::max(amax_ref, std::fabs(h_ref[i]));
        }
    }
    float scale = (float)(0.8 * amax_ref / 448.0), inv_scale = 0;
    launch(1, 1, [&] { fp8_reciprocal(&scale, &inv_scale); });
    std::vector<unsigned char> q(x.size(), 0x7f);  // NaN code: every element must be written
    std::vector<float> x_out(x.size(), NAN);
    unsigned amax_bits = 0;
    launch(rows, THREADS, [&] {
        if (add)
            add_layer_norm_16_e4m3(x.data(), br16.data(), g.data(), b.data(), x_out.data(), &scale, q.data(), &amax_bits, C, eps,
                                   bf16);
        else
            layer_norm_e4m3(x.data(), g.data(), b.data(), &scale, q.data(), &amax_bits, C, eps);
    });
    // The f32 LayerNorm's own error: ~1e-6 relative for rows of mean 0; at mean 1e4 the inputs'
    // f32 rounding (ulp 1e-3) against a spread of 1 bounds any f32 LayerNorm at ~1e-3 (ln_check).
    const double h_tol = mean_scale > 0 ? 5e-3 : 1e-5;
    long differ = 0, far = 0, saturated = 0;
    double xerr = 0;
    for (size_t i = 0; i < x.size(); ++i) {
        const unsigned char want = f32_to_e4m3((float)(h_ref[i] / scale));
        if (q[i] != want) {
            ++differ;
            // the neighbour only, and only where h itself is within the f32 LayerNorm's error of a boundary
            const double got = e4m3_to_f32(q[i]) * scale;
            if (!(std::fabs(got - h_ref[i]) <= std::fabs(e4m3_to_f32(want) * scale - h_ref[i]) + h_tol * amax_ref)) ++far;
        }
        saturated += (q[i] & 0x7f) == 0x7e;
        if (add) xerr = std::max(xerr, std::fabs(x_out[i] - v_ref[i]) / std::max(1.0, std::fabs(v_ref[i])));
    }
    const float amax = __uint_as_float(amax_bits);
    const double amax_err = std::fabs(amax - amax_ref) / amax_ref;
    // A code changes only where h lies within the LayerNorm's error (h_tol, relative) of a rounding
    // boundary; E4M3's boundaries are 2⁻³ apart relative to h, so at most 2·h_tol / 2⁻³ of them.
    const bool ok = far == 0 && differ <= 16 * h_tol * x.size() + 1 && amax_err < h_tol && saturated > 0 &&
                    (!add || xerr < 1e-6) && inv_scale == 1.0f / scale;
    const char* names[] = {"layer_norm_e4m3", "add_layer_norm_16_e4m3 bf16", "add_layer_norm_16_e4m3 f16"};
    printf("%-28s C=%-4d row mean ~%-5g codes off f64's cast %ld of %zu (far %ld), saturated %ld, amax rel err %.1e%s %s\n",
           names[mode], C, mean_scale, differ, x.size(), far, saturated, amax_err,
           add ? (" x_out err " + std::to_string(xerr)).c_str() : "", ok ? "ok" : "FAILED");
    return ok;
}

int main() {
    int failed = 0, n = 0;
    for (int mode = 0; mode < 3; ++mode)
        for (int C : {17, 257, 768})
            for (double mean_scale : {0.0, 1e4}) {
                ++n;
                failed += !check(mode, 3, C, mean_scale, 100 + n);
            }
    printf("%d of %d E4M3 LayerNorm kernel calls agree\n", n - failed, n);
    return failed != 0;
}
