// Fused residual add + LayerNorm: the worked example of writing your own kernel for candle.
//
//   x_out[r, :] = x[r, :] + branch[r, :]                  (the residual stream, f32)
//   h_out[r, :] = (x_out[r, :] - mu_r) / sqrt(var_r + eps) * g + b   (its normalised copy)
//
// Unfused (stage 2) this is: cast branch to f32 (read C·2 B, write C·4 B), add (read 8 B, write
// 4 B per element), then LayerNorm's ~9 element-wise kernels, then a cast — about a dozen
// launches and ~15 passes over a (B, T, C) tensor. Here: one launch; x and branch are read
// once, x_out and h_out written once; x_out is re-read twice from L1/L2 by the thread that wrote
// it (variance about the mean, then normalising) — two-pass variance, no cancellation.
//
// Thread layout: one thread block per row (B·T blocks), THREADS threads striding over the C
// channels of that row, so consecutive threads touch consecutive addresses (coalesced). The
// row's sum and sum of squares are reduced first within each warp (shuffles), then across the
// warps through shared memory.
//
// No CUDA headers, so the host emulation compiles it with g++: bf16 and f16 are handled as
// their 16-bit patterns and converted with explicit instructions.
//
// The same file holds `layer_norm_*`: the first LayerNorm of the block, which has no residual
// to add. Same three passes, reading x where the fused kernel reads x + branch. It replaces
// candle's LayerNorm kernel, which takes var = E[x²] − mean² in f32: for a row whose mean is
// large next to its spread (a real GPT-2 residual stream) that difference cancels, and var + eps
// can even come out negative (NaN).
//
// Host emulation (kernels/host_emulation/check.cpp) compiles this file unchanged with g++; only
// the two f16 conversion instructions (inline PTX) come from the emulation's header there.

#define THREADS 256
#define WARPS (THREADS / 32)

#ifndef SPEEDKIT_HOST_EMULATION
__device__ __forceinline__ float f16_to_f32(unsigned short v) {
    float f;
    asm("{ cvt.f32.f16 %0, %1; }" : "=f"(f) : "h"(v));
    return f;
}
__device__ __forceinline__ unsigned short f32_to_f16(float f) {
    unsigned short h;
    asm("{ cvt.rn.f16.f32 %0, %1; }" : "=h"(h) : "f"(f));  // round to nearest even
    return h;
}
#endif

__device__ __forceinline__ float load_f(const unsigned short* p, long i, int bf16) {
    unsigned short v = p[i];
    if (bf16) {
        return __uint_as_float(((unsigned int)v) << 16);  // bf16 is the top half of an f32
    }
    return f16_to_f32(v);
}
__device__ __forceinline__ unsigned short store_16(float f, int bf16) {
    if (bf16) {
        // Round to nearest even on the 16 bits that are dropped (NaN stays NaN).
        unsigned int u = __float_as_uint(f);
        if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x40u);
        u += 0x7fffu + ((u >> 16) & 1u);
        return (unsigned short)(u >> 16);
    }
    return f32_to_f16(f);
}

// Sum `v` over the block; every thread gets the result.
__device__ __forceinline__ float block_sum(float v, float* shared) {
    for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (lane == 0) shared[warp] = v;
    __syncthreads();  // every warp's partial is in shared memory before anyone reads them
    v = lane < WARPS ? shared[lane] : 0.0f;
    for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
    __syncthreads();  // all reads of `shared` are done before the caller reuses it
    return v;
}

__device__ __forceinline__ float load_f(const float* p, long i, int) { return p[i]; }

// Where pass 3 writes h: a store per element, then `finish` once per block (after every
// thread's last store; all threads call it). Stage 4 adds an E4M3 store that also takes the
// amax (stage4_fp8/kernels/ln_fp8.cu); these two write f32, or bf16/f16 as 16-bit patterns.
struct StoreF32 {
    float* h;
    __device__ __forceinline__ void store(long i, float v) { h[i] = v; }
    __device__ __forceinline__ void finish(float*) {}
};
struct Store16 {
    unsigned short* h;
    int bf16;
    __device__ __forceinline__ void store(long i, float v) { h[i] = store_16(v, bf16); }
    __device__ __forceinline__ void finish(float*) {}
};

// One row per thread block. B is the branch's type: float, or unsigned short for 16-bit values
// (bf16 if `bf16`, else f16); x, x_out, g and b are always f32; `out` stores h. Without
// `branch` (ADD = false) the row is x itself and x_out is not written: plain LayerNorm.
template <bool ADD, typename B, typename Out>
__device__ __forceinline__ void layer_norm_row(const float* x, const B* branch, const float* g, const float* b,
                                               float* x_out, Out out, int C, float eps, int bf16) {
    __shared__ float shared[WARPS];
    const long row = (long)blockIdx.x * C;
    // Pass 1: x_out = x + branch, and the row sum. Each thread later re-reads only the x_out
    // values it wrote itself, so no barrier is needed between the passes for them.
    float s = 0.0f;
    for (int c = threadIdx.x; c < C; c += THREADS) {
        float v = x[row + c];
        if (ADD) {
            v += load_f(branch, row + c, bf16);
            x_out[row + c] = v;
        }
        s += v;
    }
    const float* src = ADD ? x_out : x;  // the row the next two passes read
    const float mean = block_sum(s, shared) / C;
    // Pass 2: variance about the mean (biased, as PyTorch): Σ(v − mean)², never E[v²] − mean².
    float s2 = 0.0f;
    for (int c = threadIdx.x; c < C; c += THREADS) {
        float d = src[row + c] - mean;
        s2 += d * d;
    }
    const float inv = rsqrtf(block_sum(s2, shared) / C + eps);
    // Pass 3: normalise, scale, shift, store (rounded to the output type by `out`).
    for (int c = threadIdx.x; c < C; c += THREADS) {
        out.store(row + c, (src[row + c] - mean) * inv * g[c] + b[c]);
    }
    out.finish(shared);
}

extern "C" __global__ void add_layer_norm_16(const float* x, const unsigned short* branch, const float* g,
                                             const float* b, float* x_out, unsigned short* h_out, int C,
                                             float eps, int bf16) {
    layer_norm_row<true>(x, branch, g, b, x_out, Store16{h_out, bf16}, C, eps, bf16);
}

extern "C" __global__ void add_layer_norm_f32(const float* x, const float* branch, const float* g, const float* b,
                                              float* x_out, float* h_out, int C, float eps) {
    layer_norm_row<true>(x, branch, g, b, x_out, StoreF32{h_out}, C, eps, 0);
}

// h = LayerNorm(x), h in bf16/f16 (the cast fused into the store).
extern "C" __global__ void layer_norm_16(const float* x, const float* g, const float* b, unsigned short* h_out, int C,
                                         float eps, int bf16) {
    layer_norm_row<false, float>(x, nullptr, g, b, nullptr, Store16{h_out, bf16}, C, eps, bf16);
}

extern "C" __global__ void layer_norm_f32(const float* x, const float* g, const float* b, float* h_out, int C,
                                          float eps) {
    layer_norm_row<false, float>(x, nullptr, g, b, nullptr, StoreF32{h_out}, C, eps, 0);
}

// ---- the backward ------------------------------------------------------------------------
//
// With x̂ = (x − μ)·inv (inv = 1/√(var + eps)) and h = x̂∘g + b, for dy = ∂L/∂h:
//
//   dx = inv · (g∘dy − mean(g∘dy) − x̂ · mean(g∘dy∘x̂))  (+ plus: the residual stream's gradient)
//   dg = Σ_rows dy∘x̂,   db = Σ_rows dy
//
// As candle ops this is ~15 passes over (B·T, C) f32 tensors, each a launch. Here one block
// takes ROWS_BWD consecutive rows; per row it reads x and dy from global memory once (the later
// passes find them in L1/L2), recomputes μ and inv two-pass, as the forward does, and writes dx
// once. Each thread owns the same channels in every row of its block, so it adds its rows' dy∘x̂
// and dy into its block's row of the partial sums (dg_part, db_part: (blocks, C)) without
// atomics; one column sum over those few rows (candle's) finishes dg and db.
#define ROWS_BWD 32

template <typename D>
__device__ __forceinline__ void layer_norm_bwd_rows(const float* x, const D* dy, const float* g, const float* plus,
                                                    float* dx, float* dg_part, float* db_part, int rows, int C,
                                                    float eps, int bf16) {
    __shared__ float shared[WARPS];
    const int first = blockIdx.x * ROWS_BWD;
    const int last = rows < first + ROWS_BWD ? rows : first + ROWS_BWD;
    float* dgp = dg_part + (long)blockIdx.x * C;
    float* dbp = db_part + (long)blockIdx.x * C;
    for (int r = first; r < last; ++r) {
        const long row = (long)r * C;
        float s = 0.0f;
        for (int c = threadIdx.x; c < C; c += THREADS) s += x[row + c];
        const float mean = block_sum(s, shared) / C;
        float s2 = 0.0f;
        for (int c = threadIdx.x; c < C; c += THREADS) {
            const float d = x[row + c] - mean;
            s2 += d * d;
        }
        const float inv = rsqrtf(block_sum(s2, shared) / C + eps);
        // mean(g∘dy) and mean(g∘dy∘x̂) over the row
        float a = 0.0f, b = 0.0f;
        for (int c = threadIdx.x; c < C; c += THREADS) {
            const float gdy = g[c] * load_f(dy, row + c, bf16);
            a += gdy;
            b += gdy * (x[row + c] - mean) * inv;
        }
        a = block_sum(a, shared) / C;
        b = block_sum(b, shared) / C;
        for (int c = threadIdx.x; c < C; c += THREADS) {
            const float d = load_f(dy, row + c, bf16);
            const float xhat = (x[row + c] - mean) * inv;
            float v = inv * (g[c] * d - a - xhat * b);
            if (plus) v += plus[row + c];
            dx[row + c] = v;
            // this block's first row starts its partial sums; later rows add (same thread, same c)
            dgp[c] = (r == first ? 0.0f : dgp[c]) + d * xhat;
            dbp[c] = (r == first ? 0.0f : dbp[c]) + d;
        }
    }
}

// dy in f32; `plus` may be null (nothing added to dx).
extern "C" __global__ void layer_norm_bwd_f32(const float* x, const float* dy, const float* g, const float* plus,
                                              float* dx, float* dg_part, float* db_part, int rows, int C, float eps) {
    layer_norm_bwd_rows(x, dy, g, plus, dx, dg_part, db_part, rows, C, eps, 0);
}

// dy in bf16 (bf16 = 1) or f16 (bf16 = 0), as the 16-bit GEMMs after a LayerNorm hand it back.
extern "C" __global__ void layer_norm_bwd_16(const float* x, const unsigned short* dy, const float* g,
                                             const float* plus, float* dx, float* dg_part, float* db_part, int rows,
                                             int C, float eps, int bf16) {
    layer_norm_bwd_rows(x, dy, g, plus, dx, dg_part, db_part, rows, C, eps, bf16);
}
