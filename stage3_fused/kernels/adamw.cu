// AdamW over every parameter of a model in one launch (multi-tensor): the CUDA twin of the CPU's
// fused AdamW in src/adamw.rs, with candle_nn::AdamW's arithmetic, at step t:
//
//   m = β1·m + (1 − β1)·g              v = β2·v + (1 − β2)·g²
//   m̂ = m / (1 − β1ᵗ)                  v̂ = v / (1 − β2ᵗ)
//   θ = θ·(1 − lr·λ) − lr · m̂ / (√v̂ + ε)
//
// One pass reads θ, g, m, v and writes θ, m, v: 28 bytes per parameter, memory-bound, where
// candle_nn::AdamW runs about a dozen tensor ops per parameter (a launch and a pass over memory
// each). The parameters are separate allocations, so the launch takes a table of them: for
// tensor i, its four pointers (θ, g, m, v) and its length; and a list of chunks (tensor, first
// element) of up to CHUNK elements each. Block b takes chunks b, b + gridDim.x, ...: a 768-value
// bias and a 2.4M-value weight cost a launch together, not one each (apex's multi_tensor_apply).
//
// Compiled by build.rs to a cubin per arch (nvcc -cubin), loaded through stage2_sdpa::cubin; run
// on the CPU by host_emulation/adamw_check.cpp against an f64 AdamW.

constexpr int ADAMW_THREADS = 256;
constexpr long long CHUNK = 16 * 1024;  // elements per chunk; keep in step with src/adamw_cuda.rs

struct AdamWStep {
    float lr, decay, beta1, beta2, scale_m, scale_v, eps;  // decay = 1 − lr·λ; scale_* = 1/(1 − βᵗ)
};

extern "C" __global__ void __launch_bounds__(ADAMW_THREADS)
    adamw_multi(const unsigned long long* __restrict__ ptrs,  // 4 per tensor: θ, g, m, v
                const long long* __restrict__ lens,           // elements per tensor
                const int* __restrict__ chunk_tensor, const long long* __restrict__ chunk_start, int n_chunks,
                AdamWStep k) {
    for (int c = blockIdx.x; c < n_chunks; c += gridDim.x) {
        const int t = chunk_tensor[c];
        float* theta = reinterpret_cast<float*>(ptrs[4 * t]);
        const float* g = reinterpret_cast<const float*>(ptrs[4 * t + 1]);
        float* m = reinterpret_cast<float*>(ptrs[4 * t + 2]);
        float* v = reinterpret_cast<float*>(ptrs[4 * t + 3]);
        const long long start = chunk_start[c];
        const long long end = min(start + CHUNK, lens[t]);
        // Consecutive threads, consecutive elements: every load and store is coalesced.
        for (long long i = start + threadIdx.x; i < end; i += ADAMW_THREADS) {
            const float gi = g[i];
            const float mi = k.beta1 * m[i] + (1.0f - k.beta1) * gi;          // m = β1·m + (1 − β1)·g
            const float vi = k.beta2 * v[i] + (1.0f - k.beta2) * (gi * gi);   // v = β2·v + (1 − β2)·g²
            const float m_hat = mi * k.scale_m, v_hat = vi * k.scale_v;
            theta[i] = theta[i] * k.decay - (m_hat / (sqrtf(v_hat) + k.eps)) * k.lr;  // θ·(1 − lr·λ) − lr·m̂/(√v̂ + ε)
            m[i] = mi;
            v[i] = vi;
        }
    }
}
