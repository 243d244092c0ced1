// Runs stage3_fused/kernels/adamw.cu — the real source, unchanged — on the CPU (block_launch.h:
// one std::thread per CUDA thread) over several parameters of ragged sizes (a 1-element tensor,
// one shorter than a chunk, one spanning three chunks and a partial fourth), for three steps with
// fewer blocks than chunks (the grid-stride loop), against an f64 AdamW with candle_nn::AdamW's
// formulas. Exit 0 when every θ, m and v is within tolerance.
#include "ln_host.h"
#include "../stage3_fused/kernels/adamw.cu"
#include "block_launch.h"

#include <cstdio>
#include <random>

dim3 gridDim;

int main() {
    const long long sizes[] = {1, 5000, 3 * CHUNK + 77, 768};
    const int P = 4;
    std::mt19937 rng(7);
    std::normal_distribution<float> normal;
    std::vector<std::vector<float>> theta(P), g(P), m(P), v(P);
    std::vector<std::vector<double>> theta_ref(P), m_ref(P), v_ref(P);
    for (int p = 0; p < P; ++p) {
        for (long long i = 0; i < sizes[p]; ++i) theta[p].push_back(normal(rng));
        g[p].resize(sizes[p]);
        m[p].assign(sizes[p], 0.0f);
        v[p].assign(sizes[p], 0.0f);
        theta_ref[p].assign(theta[p].begin(), theta[p].end());
        m_ref[p].assign(sizes[p], 0.0);
        v_ref[p].assign(sizes[p], 0.0);
    }
    const double lr = 1e-3, beta1 = 0.9, beta2 = 0.999, eps = 1e-8, wd = 0.01;
    int failed = 0;
    for (int step = 1; step <= 3; ++step) {
        for (int p = 0; p < P; ++p) {
            for (auto& x : g[p]) x = normal(rng);
            // Each step against f64 from the kernel's own state: one step's rounding, not three.
            theta_ref[p].assign(theta[p].begin(), theta[p].end());
            m_ref[p].assign(m[p].begin(), m[p].end());
            v_ref[p].assign(v[p].begin(), v[p].end());
        }
        std::vector<unsigned long long> ptrs;
        std::vector<long long> lens, starts;
        std::vector<int> owners;
        for (int p = 0; p < P; ++p) {
            for (float* q : {theta[p].data(), g[p].data(), m[p].data(), v[p].data()}) ptrs.push_back((unsigned long long)q);
            lens.push_back(sizes[p]);
            for (long long s = 0; s < sizes[p]; s += CHUNK) owners.push_back(p), starts.push_back(s);
        }
        const AdamWStep k{(float)lr, (float)(1 - lr * wd), (float)beta1, (float)beta2, (float)(1 / (1 - std::pow(beta1, step))),
                          (float)(1 / (1 - std::pow(beta2, step))), (float)eps};
        const int n_chunks = (int)owners.size();
        gridDim = {2, 1, 1};  // fewer blocks than chunks: each block walks several
        launch(2, ADAMW_THREADS, [&] { adamw_multi(ptrs.data(), lens.data(), owners.data(), starts.data(), n_chunks, k); });
        double worst = 0;
        for (int p = 0; p < P; ++p)
            for (long long i = 0; i < sizes[p]; ++i) {
                const double gi = g[p][i];
                m_ref[p][i] = beta1 * m_ref[p][i] + (1 - beta1) * gi;
                v_ref[p][i] = beta2 * v_ref[p][i] + (1 - beta2) * gi * gi;
                const double mh = m_ref[p][i] / (1 - std::pow(beta1, step)), vh = v_ref[p][i] / (1 - std::pow(beta2, step));
                theta_ref[p][i] = theta_ref[p][i] * (1 - lr * wd) - lr * mh / (std::sqrt(vh) + eps);
                // The update is lr-sized: θ against lr; m and v against their own size (m near 0, where
                // β1·m and (1 − β1)·g cancel, against 1e-3: g is N(0, 1)).
                const double e = std::max({std::abs(theta[p][i] - theta_ref[p][i]) / lr, std::abs(m[p][i] - m_ref[p][i]) / (std::abs(m_ref[p][i]) + 1e-3),
                                           std::abs(v[p][i] - v_ref[p][i]) / (v_ref[p][i] + 1e-6)});
                if (!std::isfinite(theta[p][i])) worst = INFINITY;
                worst = std::max(worst, e);
            }
        const bool ok = worst < 1e-3;
        failed += !ok;
        printf("adamw step %d: 4 tensors, %d chunks, 2 blocks: worst error %.2e %s\n", step, n_chunks, worst, ok ? "ok" : "FAILED");
    }
    return failed != 0;
}
