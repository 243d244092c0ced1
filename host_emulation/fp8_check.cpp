// Runs stage4_fp8/kernels/fp8.cu — the real source, unchanged — on the CPU (ln_host.h's threads,
// barriers, shuffles and atomicMax; block_launch.h's launcher) and checks:
// 1. the cast f32 → E4M3 on EVERY f32 bit pattern (2³², split over the cores) against the
//    reference conversion of cuda_fp8.hpp (__nv_cvt_double_to_fp8, E4M3, __NV_SATFINITE), ported
//    below from the float8 crate, which is what candle's CPU F8E4M3 cast runs — so the GPU's cast
//    and the CPU's agree bit for bit, ties, subnormals, saturation and NaN included;
// 2. the cast back on all 256 codes against (−1)^s·2^(e−7)·(1 + m/8) (subnormals m·2⁻⁹, NaN);
// 3. every kernel entry point, launched block by block: amax (f32, bf16; a tail that is not a
//    whole chunk; a NaN), both scales, the history roll, quantise with and without the fused
//    amax, dequantise — against f64 arithmetic on the same inputs.
// Exit 0 when everything agrees.
//
//   bash host_emulation/run.sh fp8_check
#include "ln_host.h"

#include "../stage4_fp8/kernels/fp8.cu"

#include <algorithm>
#include <cstdio>
#include <memory>
#include <random>
#include <thread>
#include <vector>

#include "block_launch.h"
long grid(long n) { return (n + CHUNK - 1) / CHUNK; }

// cuda_fp8.hpp's __nv_cvt_double_to_fp8 for E4M3 with __NV_SATFINITE, as the float8 crate
// (0.7, `convert_to_fp8`) ports it; an f32 is converted through f64 exactly as float8 does.
unsigned char reference_e4m3(double x) {
    uint64_t xb;
    std::memcpy(&xb, &x, 8);
    const uint64_t half_ulp = 1ull << (53 - 4 - 1), mindenorm_o2 = 0x3F50000000000000ull,
                   overflow = 0x407D000000000000ull, minnorm = 0x3F90000000000000ull, inf = 0x7FF0000000000000ull;
    const unsigned char sign = (unsigned char)((xb >> 63) << 7);
    const unsigned char exp = (unsigned char)((((xb >> 52) & 0x7FF) - 1023 + 7) & 0xFF);
    const unsigned char mant = (unsigned char)((xb >> (53 - 4)) & 7);
    const uint64_t absx = xb & 0x7FFFFFFFFFFFFFFFull;
    unsigned char res;
    if (absx <= mindenorm_o2) {
        res = 0;
    } else if (absx > inf) {
        return 0x7F | sign;  // NaN: float8 gives 0x7F, then ORs the sign, like the normal codes
    } else if (absx > overflow) {
        res = 0x7E;
    } else if (absx >= minnorm) {
        res = (unsigned char)((exp << 3) | mant);
        const uint64_t round = xb & ((half_ulp << 1) - 1);
        if (round > half_ulp || (round == half_ulp && (mant & 1))) ++res;
    } else {
        const unsigned shift = (unsigned)(1 - (int)exp) & 0xFF;
        const unsigned char m = mant | (1 << 3);
        res = m >> shift;
        const uint64_t round = (xb | (1ull << 52)) & ((half_ulp << (shift + 1)) - 1);
        if (round > (half_ulp << shift) || (round == (half_ulp << shift) && (res & 1))) ++res;
    }
    return res | sign;
}

double decode_reference(unsigned char q) {
    const int s = q >> 7, e = (q >> 3) & 15, m = q & 7;
    if (e == 15 && m == 7) return NAN;
    const double v = e == 0 ? m * std::ldexp(1.0, -9) : std::ldexp(1.0 + m / 8.0, e - 7);
    return s ? -v : v;
}

// E5M2 with __NV_SATFINITE, from f64 arithmetic (independent of the kernel's bit tricks): an
// f32 widened to f64 is exact, so this is the one rounding the cast must make.
unsigned char reference_e5m2(double x) {
    const unsigned char sign = std::signbit(x) ? 0x80 : 0;
    if (std::isnan(x)) return sign | 0x7f;
    const double a = std::fabs(x);
    if (a >= 61440.0) return sign | 0x7b;  // 57344 + half its ulp (a tie, to even = 65536): saturates
    if (a < std::ldexp(1.0, -14)) return sign | (unsigned char)std::nearbyint(a * 65536.0);  // subnormal; 4 = 2⁻¹⁴
    int e;
    std::frexp(a, &e);  // a = f·2^e, f in [0.5, 1)
    int E = e - 1;
    long q = std::lrint((a / std::ldexp(1.0, E) - 1.0) * 4.0);  // ties to even (default rounding)
    if (q == 4) q = 0, ++E;
    return sign | (unsigned char)(((E + 15) << 2) | q);
}

double decode_e5m2_reference(unsigned char q) {
    const int s = q >> 7, e = (q >> 2) & 31, m = q & 3;
    if (e == 31) return m ? NAN : (s ? -INFINITY : INFINITY);
    const double v = e == 0 ? m * std::ldexp(1.0, -16) : std::ldexp(1.0 + m / 4.0, e - 15);
    return s ? -v : v;
}

bool same(double a, double b) { return (std::isnan(a) && std::isnan(b)) || a == b; }

int main() {
    int failed = 0;
    // 1. The cast on all 2³² f32 bit patterns, against the reference.
    {
        const unsigned workers = std::max(1u, std::thread::hardware_concurrency());
        std::vector<unsigned long long> bad(workers, 0), first(workers, ~0ull);
        std::vector<std::thread> ts;
        for (unsigned w = 0; w < workers; ++w)
            ts.emplace_back([&, w] {
                const uint64_t lo = (1ull << 32) * w / workers, hi = (1ull << 32) * (w + 1) / workers;
                for (uint64_t b = lo; b < hi; ++b) {
                    const float x = __uint_as_float((unsigned)b);
                    unsigned char want = reference_e4m3((double)x);
                    // float8 maps every NaN to 0x7F | sign; NVIDIA's __nv_cvt_* too. Compare NaN as NaN.
                    const unsigned char got = f32_to_e4m3(x);
                    if (got != want) {
                        if (!bad[w]) first[w] = b;
                        ++bad[w];
                    }
                }
            });
        for (auto& t : ts) t.join();
        unsigned long long total = 0, f = ~0ull;
        for (unsigned w = 0; w < workers; ++w) total += bad[w], f = std::min(f, first[w]);
        if (total) {
            const float x = __uint_as_float((unsigned)f);
            printf("cast f32 -> e4m3: %llu of 2^32 bit patterns differ from the reference; first %#010llx (%g): got %#04x want %#04x FAILED\n",
                   total, f, x, f32_to_e4m3(x), reference_e4m3(x));
            ++failed;
        } else {
            printf("cast f32 -> e4m3: all 2^32 bit patterns agree with cuda_fp8.hpp's / float8's conversion ok\n");
        }
    }
    // 2. The cast back on all 256 codes, and the round trip of every code.
    {
        int bad = 0;
        for (int q = 0; q < 256; ++q) {
            const float v = e4m3_to_f32((unsigned char)q);
            bad += !same(v, decode_reference((unsigned char)q));
            if (!std::isnan(v)) bad += f32_to_e4m3(v) != (unsigned char)q && !(q == 0x80 && v == 0.0f && f32_to_e4m3(v) == 0x80);
        }
        printf("cast e4m3 -> f32: %d of 256 codes wrong (value or round trip) %s\n", bad, bad ? "FAILED" : "ok");
        failed += bad != 0;
    }
    // 3. The kernels.
    std::mt19937 rng(7);
    std::normal_distribution<float> normal;
    for (long n : {1L, 255L, (long)CHUNK, 2L * CHUNK + 777}) {
        for (int bf16 : {0, 1}) {
            std::vector<float> x(n);
            for (auto& v : x) v = 3.0f * normal(rng);
            std::vector<unsigned short> xb(n);
            for (long i = 0; i < n; ++i) {
                xb[i] = (unsigned short)(__float_as_uint(x[i]) >> 16);  // truncate to bf16: any bf16 will do
                if (bf16) x[i] = __uint_as_float((unsigned)xb[i] << 16);
            }
            double amax = 0;
            for (float v : x) amax = std::max(amax, (double)std::fabs(v));
            unsigned amax_bits = 0;
            float scale = -1, pow2_margin = 2.0f;  // margin 1
            launch(grid(n), THREADS, [&] { bf16 ? fp8_amax_bf16(xb.data(), n, &amax_bits) : fp8_amax_f32(x.data(), n, &amax_bits); });
            const bool amax_ok = __uint_as_float(amax_bits) == (float)amax;
            launch(1, 1, [&] { fp8_scale_from_amax(&amax_bits, &scale, pow2_margin); });
            const float want_scale = (float)amax * (2.0f / 448.0f);
            const bool scale_ok = scale == want_scale && amax_bits == 0;
            // quantise with the fused amax (delayed scaling's pass), then dequantise
            std::vector<unsigned char> q(n, 0xAA);
            std::vector<float> y(n, NAN);
            launch(grid(n), THREADS, [&] {
                bf16 ? fp8_quantize_bf16(xb.data(), n, &scale, q.data(), &amax_bits) : fp8_quantize_f32(x.data(), n, &scale, q.data(), &amax_bits);
            });
            launch(grid(n), THREADS, [&] { fp8_dequantize_f32(q.data(), n, &scale, y.data()); });
            long bad_q = 0;
            double num = 0, den = 0;
            for (long i = 0; i < n; ++i) {
                bad_q += q[i] != reference_e4m3((double)(x[i] / scale));
                const float want = (float)decode_reference(reference_e4m3((double)(x[i] / scale))) * scale;  // one f32 rounding, as the kernel
                bad_q += !same(y[i], want);
                num += (y[i] - x[i]) * (double)(y[i] - x[i]), den += (double)x[i] * x[i];
            }
            // E4M3 keeps 3 mantissa bits: relative rounding error ≤ 2⁻⁴ per value; RMS well below.
            const double rel = std::sqrt(num / den);
            const bool fused_ok = __uint_as_float(amax_bits) == (float)amax;
            const bool ok = amax_ok && scale_ok && bad_q == 0 && fused_ok && rel < 0.0625 && (n < 100 || rel > 1e-3);
            printf("n=%-6ld %-4s amax %s, scale %s, quantise+dequantise %ld wrong, fused amax %s, rel err %.2e %s\n", n,
                   bf16 ? "bf16" : "f32", amax_ok ? "exact" : "WRONG", scale_ok ? "exact" : "WRONG", bad_q,
                   fused_ok ? "exact" : "WRONG", rel, ok ? "ok" : "FAILED");
            failed += !ok;
        }
    }
    // History: fill on the first call, then roll; s from the max of the window.
    {
        float history[3] = {-1, -1, -1}, scale = 0;
        unsigned amax_bits = __float_as_uint(448.0f);
        bool ok = true;
        launch(1, 1, [&] { fp8_history_push(&amax_bits, history, 3, 1); });
        ok &= history[0] == 448 && history[1] == 448 && history[2] == 448 && amax_bits == 0;
        const float calls[] = {896, 224, 1792};
        const float want_scales[] = {1, 2, 2};  // the window before each call: 448·3 | 448,448,896 | 448,896,224
        for (int i = 0; i < 3; ++i) {
            launch(1, 1, [&] { fp8_scale_from_history(history, 3, &scale, 1.0f); });
            ok &= scale == want_scales[i];
            amax_bits = __float_as_uint(calls[i]);
            launch(1, 1, [&] { fp8_history_push(&amax_bits, history, 3, 0); });
        }
        ok &= history[0] == 896 && history[1] == 224 && history[2] == 1792;
        printf("delayed scaling: history fill, roll and scale %s\n", ok ? "ok" : "FAILED");
        failed += !ok;
    }
    // NaN in the input: the amax, and so the scale, is NaN (the runner's finiteness check sees it).
    {
        std::vector<float> x(300, 1.0f);
        x[299] = NAN;
        unsigned amax_bits = 0;
        float scale = 0;
        launch(1, THREADS, [&] { fp8_amax_f32(x.data(), 300, &amax_bits); });
        launch(1, 1, [&] { fp8_scale_from_amax(&amax_bits, &scale, 1.0f); });
        const bool ok = std::isnan(scale);
        printf("a NaN input gives a NaN scale %s\n", ok ? "ok" : "FAILED");
        failed += !ok;
    }
    // check_finite on the GPU reads only the amax: NaN, +inf or -inf anywhere (here in the last
    // block of three, among values larger than 1) must give an amax that is not finite, in f32
    // and bf16.
    for (float bad : {NAN, INFINITY, -INFINITY}) {
        for (int bf16 : {0, 1}) {
            const long n = 2L * CHUNK + 777;
            std::vector<float> x(n, -5.0f);
            x[n - 3] = bad;
            std::vector<unsigned short> xb(n);
            for (long i = 0; i < n; ++i) xb[i] = (unsigned short)(__float_as_uint(x[i]) >> 16);
            unsigned amax_bits = 0;
            launch(grid(n), THREADS, [&] { bf16 ? fp8_amax_bf16(xb.data(), n, &amax_bits) : fp8_amax_f32(x.data(), n, &amax_bits); });
            const bool ok = !std::isfinite(__uint_as_float(amax_bits));
            printf("amax of %-4s with %-4s among finite values is not finite %s\n", bf16 ? "bf16" : "f32", std::isnan(bad) ? "NaN" : bad > 0 ? "+inf" : "-inf", ok ? "ok" : "FAILED");
            failed += !ok;
        }
    }
    // 4. Training: the E5M2 cast on all 2³² f32 bit patterns, the cast back, the transposes.
    {
        const unsigned workers = std::max(1u, std::thread::hardware_concurrency());
        std::vector<unsigned long long> bad(workers, 0), first(workers, ~0ull);
        std::vector<std::thread> ts;
        for (unsigned w = 0; w < workers; ++w)
            ts.emplace_back([&, w] {
                const uint64_t lo = (1ull << 32) * w / workers, hi = (1ull << 32) * (w + 1) / workers;
                for (uint64_t b = lo; b < hi; ++b) {
                    const float x = __uint_as_float((unsigned)b);
                    if (f32_to_e5m2(x) != reference_e5m2((double)x)) {
                        if (!bad[w]) first[w] = b;
                        ++bad[w];
                    }
                }
            });
        for (auto& t : ts) t.join();
        unsigned long long total = 0, f = ~0ull;
        for (unsigned w = 0; w < workers; ++w) total += bad[w], f = std::min(f, first[w]);
        if (total) {
            const float x = __uint_as_float((unsigned)f);
            printf("cast f32 -> e5m2: %llu of 2^32 bit patterns differ from the f64 rounding; first %#010llx (%g): got %#04x want %#04x FAILED\n",
                   total, f, x, f32_to_e5m2(x), reference_e5m2(x));
            ++failed;
        } else {
            printf("cast f32 -> e5m2: all 2^32 bit patterns agree with the f64 rounding ok\n");
        }
        int bad_codes = 0;
        for (int q = 0; q < 256; ++q) {
            const float v = e5m2_to_f32((unsigned char)q);
            bad_codes += !same(v, decode_e5m2_reference((unsigned char)q));
            const bool finite = (q & 0x7c) != 0x7c;  // inf and NaN codes are never written (the cast saturates)
            if (finite && q != 0x80) bad_codes += f32_to_e5m2(v) != (unsigned char)q;
        }
        printf("cast e5m2 -> f32: %d of 256 codes wrong (value or round trip) %s\n", bad_codes, bad_codes ? "FAILED" : "ok");
        failed += bad_codes != 0;
    }
    for (auto [rows, cols] : {std::pair{1L, 1L}, {32L, 32L}, {40L, 70L}, {96L, 33L}}) {
        for (int bf16 : {0, 1}) {
            const long n = rows * cols;
            std::vector<float> x(n);
            std::vector<unsigned short> xb(n);
            for (long i = 0; i < n; ++i) {
                x[i] = 1e-3f * normal(rng) * (i % 7 == 0 ? 1e3f : 1.0f);  // a gradient: small, a few large
                xb[i] = (unsigned short)(__float_as_uint(x[i]) >> 16);
                if (bf16) x[i] = __uint_as_float((unsigned)xb[i] << 16);
            }
            double amax = 0;
            for (float v : x) amax = std::max(amax, (double)std::fabs(v));
            const float scale = (float)amax / 57344.0f * 0.5f;  // half the amax's scale: the top saturates
            std::vector<unsigned char> q(n, 0xAA), qt(n, 0xAA), back(n, 0xAA);
            unsigned amax_bits = 0;
            const long tiles = ((rows + TILE - 1) / TILE) * ((cols + TILE - 1) / TILE);
            launch(tiles, THREADS, [&] {
                bf16 ? fp8_quantize_e5m2_transpose_bf16(xb.data(), rows, cols, &scale, q.data(), qt.data(), &amax_bits)
                     : fp8_quantize_e5m2_transpose_f32(x.data(), rows, cols, &scale, q.data(), qt.data(), &amax_bits);
            });
            launch(((cols + TILE - 1) / TILE) * ((rows + TILE - 1) / TILE), THREADS, [&] { fp8_transpose(qt.data(), cols, rows, back.data()); });
            long bad_q = 0, bad_t = 0, bad_back = 0, saturated = 0;
            for (long r = 0; r < rows; ++r)
                for (long c = 0; c < cols; ++c) {
                    const long i = r * cols + c;
                    bad_q += q[i] != reference_e5m2((double)(x[i] / scale));
                    bad_t += qt[c * rows + r] != q[i];
                    bad_back += back[i] != q[i];
                    saturated += (q[i] & 0x7f) == 0x7b;
                }
            const bool amax_ok = __uint_as_float(amax_bits) == (float)amax;
            const bool ok = bad_q == 0 && bad_t == 0 && bad_back == 0 && amax_ok && (n < 100 || saturated > 0);
            printf("e5m2 cast+transpose %ldx%ld %-4s: %ld codes wrong, %ld transposed wrong, %ld back wrong, %ld saturated, amax %s %s\n",
                   rows, cols, bf16 ? "bf16" : "f32", bad_q, bad_t, bad_back, saturated, amax_ok ? "exact" : "WRONG", ok ? "ok" : "FAILED");
            failed += !ok;
        }
    }
    // The decode to f32 (the backward GEMMs' fallback): every code of both formats, over more
    // than one block.
    for (int e5m2 : {0, 1}) {
        const long n = 2 * CHUNK + 300;
        std::vector<unsigned char> q(n);
        for (long i = 0; i < n; ++i) q[i] = (unsigned char)(i * 7 % 256);
        std::vector<float> y(n, -1.0f);
        launch(grid(n), THREADS, [&] { fp8_decode_f32(q.data(), n, e5m2, y.data()); });
        long bad = 0;
        for (long i = 0; i < n; ++i) bad += !same(y[i], e5m2 ? decode_e5m2_reference(q[i]) : decode_reference(q[i]));
        printf("decode %s -> f32, n=%ld: %ld wrong %s\n", e5m2 ? "e5m2" : "e4m3", n, bad, bad ? "FAILED" : "ok");
        failed += bad != 0;
    }
    printf("%s\n", failed ? "FP8 kernels: FAILED" : "FP8 kernels: all checks passed");
    return failed != 0;
}
