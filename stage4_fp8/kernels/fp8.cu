// FP8 E4M3 per-tensor quantisation on the GPU: amax, the scale (current or delayed), the cast to
// E4M3 and the cast back. Our own kernels because candle 0.11.1's F8E4M3 CUDA casts cannot be
// loaded (their symbols are named `…_f8_e4m3`, candle asks for `…_f8e4m3`: huggingface/candle
// candle issue #3886), and because owning them lets delayed scaling keep its history on the device.
//
// One activation, per call (M·K values x, bf16 or f32; s, amax and history are device buffers
// that live as long as the layer, so a CUDA graph replays the same pointers):
//
//   current scaling                          delayed scaling (calls after the first)
//   fp8_amax_*        amax ← max|x|          fp8_scale_from_history   s ← max(history)·2^m/448
//   fp8_scale_from_amax s ← amax·2^m/448     fp8_quantize_*           q ← sat(x/s), amax ← max|x|
//                       amax ← 0                                       (one pass over x)
//   fp8_quantize_*    q ← sat(x/s)           fp8_history_push         history ← roll(history, amax)
//                                                                      amax ← 0
// The first delayed call has no history: amax, then fp8_history_push with fill = 1 (every slot
// gets this amax), then fp8_scale_from_history — s from its own amax, as current scaling.
//
// amax: each block reduces its chunk (warp shuffles, then across warps in shared memory) and
// does one atomicMax on the float's bits: for non-negative floats the IEEE bit patterns order
// like unsigned integers, so an integer atomic max is a float max. NaN (bits above 0x7f800000)
// wins that max, so a NaN input gives a NaN amax and scale, and the runner's check reports it.
//
// The cast (f32 → E4M3) is written out on the bits, round to nearest even, saturating to ±448
// (what cuda_fp8.h's __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3) does, and the float8
// crate behind candle's CPU cast): NaN → 0x7F (sign kept), ±inf and |x| > 448 → ±448. No CUDA headers,
// so the host emulation (host_emulation/
// fp8_check.cpp) runs this very file on the CPU and checks the cast on every f32 bit pattern.
//
// Thread layout: THREADS threads per block, each block owns CHUNK = THREADS·ITEMS consecutive
// elements (coalesced: thread t reads t, t + THREADS, …); grid = ceil(n / CHUNK) blocks. The
// one-thread kernels (scale, history) are launched as one block of one thread.

#define THREADS 256
#define WARPS (THREADS / 32)
#define ITEMS 16
#define CHUNK (THREADS * ITEMS)
#define E4M3_MAX 448.0f
#define E5M2_MAX 57344.0f
#define TILE 32  // the transposes' tile: 32 × 32 values, THREADS / TILE = 8 rows per pass
#define FLT_MIN_NORMAL 1.17549435e-38f

// ---- the number format ------------------------------------------------------------------

// f32 → E4M3 bits, round to nearest even, saturate finite (±448), NaN → NaN.
__device__ __forceinline__ unsigned char f32_to_e4m3(float x) {
    const unsigned int u = __float_as_uint(x);
    const unsigned char sign = (unsigned char)((u >> 24) & 0x80u);
    const unsigned int a = u & 0x7fffffffu;  // |x| bits
    if (a > 0x7f800000u) return sign | 0x7f;  // NaN
    const float ax = __uint_as_float(a);
    if (ax >= 1.0f / 64.0f) {
        // Normal range (≥ 2⁻⁶): keep 3 mantissa bits, round to nearest even on the 20 dropped.
        // ±inf goes through too (its bits round to inf) and saturates below.
        const unsigned int r = (a + 0x7ffffu + ((a >> 20) & 1u)) & 0xfff00000u;
        if (__uint_as_float(r) > E4M3_MAX) return sign | 0x7e;  // 448 (0x7E); 0x7F is NaN
        // f32 exponent e (bias 127) → E4M3 exponent e − 127 + 7; mantissa's top 3 bits.
        const unsigned int e = (r >> 23) - 120u;
        return sign | (unsigned char)((e << 3) | ((r >> 20) & 7u));
    }
    // Subnormal range: multiples of 2⁻⁹. ax·512 < 8 is exact in f32; rint rounds half to even.
    // 8 (ax just below 2⁻⁶ rounding up) is code 0x08, the smallest normal: the encoding carries.
    return sign | (unsigned char)rintf(ax * 512.0f);
}

// E4M3 bits → f32 (exact).
__device__ __forceinline__ float e4m3_to_f32(unsigned char q) {
    const unsigned int e = (q >> 3) & 0xfu, m = q & 7u;
    float v;
    if (e == 0xfu && m == 7u) {
        v = __uint_as_float(0x7fc00000u);  // NaN (E4M3 has no infinities)
    } else if (e == 0) {
        v = (float)m * (1.0f / 512.0f);  // subnormal: m · 2⁻⁹
    } else {
        v = __uint_as_float(((e + 120u) << 23) | (m << 20));  // (1 + m/8) · 2^(e − 7)
    }
    return (q & 0x80u) ? -v : v;
}

// f32 → E5M2 bits (training's gradients: 2 mantissa bits, f16's exponent range), round to
// nearest even, saturate finite (±57344), NaN → NaN: __nv_cvt_float_to_fp8(x, __NV_SATFINITE,
// __NV_E5M2) written out on the bits, as f32_to_e4m3 above.
__device__ __forceinline__ unsigned char f32_to_e5m2(float x) {
    const unsigned int u = __float_as_uint(x);
    const unsigned char sign = (unsigned char)((u >> 24) & 0x80u);
    const unsigned int a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return sign | 0x7f;  // NaN
    const float ax = __uint_as_float(a);
    if (ax >= 1.0f / 16384.0f) {
        // Normal range (≥ 2⁻¹⁴): keep 2 mantissa bits, round to nearest even on the 21 dropped.
        const unsigned int r = (a + 0xfffffu + ((a >> 21) & 1u)) & 0xffe00000u;
        if (__uint_as_float(r) > E5M2_MAX) return sign | 0x7b;  // 57344 (0x7B); 0x7C is inf
        // f32 exponent e (bias 127) → E5M2 exponent e − 127 + 15; mantissa's top 2 bits.
        const unsigned int e = (r >> 23) - 112u;
        return sign | (unsigned char)((e << 2) | ((r >> 21) & 3u));
    }
    // Subnormal range: multiples of 2⁻¹⁶; 4 (rounding up to 2⁻¹⁴) is code 0x04, the smallest normal.
    return sign | (unsigned char)rintf(ax * 65536.0f);
}

// E5M2 bits → f32 (exact); the host emulation checks the cast against it.
__device__ __forceinline__ float e5m2_to_f32(unsigned char q) {
    const unsigned int e = (q >> 2) & 0x1fu, m = q & 3u;
    float v;
    if (e == 0x1fu) {
        v = __uint_as_float(m ? 0x7fc00000u : 0x7f800000u);  // NaN, or inf (never written: we saturate)
    } else if (e == 0) {
        v = (float)m * (1.0f / 65536.0f);  // subnormal: m · 2⁻¹⁶
    } else {
        v = __uint_as_float(((e + 112u) << 23) | (m << 21));  // (1 + m/4) · 2^(e − 15)
    }
    return (q & 0x80u) ? -v : v;
}

// ---- loads of the activation dtype --------------------------------------------------------

__device__ __forceinline__ float load(const float* p, long i) { return p[i]; }
// bf16 travels as its 16-bit pattern: the top half of an f32.
__device__ __forceinline__ float load(const unsigned short* p, long i) { return __uint_as_float(((unsigned int)p[i]) << 16); }

// ---- amax ---------------------------------------------------------------------------------

// |v|, and a max that keeps NaN (fmaxf would drop it, and a NaN input must give a NaN amax).
__device__ __forceinline__ float abs_keep_nan(float v) { return __uint_as_float(__float_as_uint(v) & 0x7fffffffu); }
__device__ __forceinline__ float max_keep_nan(float a, float b) { return (a != a || a > b) ? a : b; }

// Max over the block; every thread gets the result.
__device__ __forceinline__ float block_max(float v, float* shared) {
    for (int off = 16; off > 0; off >>= 1) v = max_keep_nan(v, __shfl_xor_sync(0xffffffffu, v, off));
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (lane == 0) shared[warp] = v;
    __syncthreads();  // every warp's partial is in shared memory before anyone reads them
    v = lane < WARPS ? shared[lane] : 0.0f;
    for (int off = 16; off > 0; off >>= 1) v = max_keep_nan(v, __shfl_xor_sync(0xffffffffu, v, off));
    __syncthreads();  // all reads of `shared` done before it is reused
    return v;
}

template <typename T>
__device__ __forceinline__ void amax_chunk(const T* x, long n, unsigned int* amax_bits) {
    __shared__ float shared[WARPS];
    const long base = (long)blockIdx.x * CHUNK;
    float m = 0.0f;
    for (int i = 0; i < ITEMS; ++i) {
        const long j = base + threadIdx.x + (long)i * THREADS;
        if (j < n) m = max_keep_nan(m, abs_keep_nan(load(x, j)));
    }
    // A NaN is made the canonical positive one, whose bits beat every number's in atomicMax.
    m = block_max(m != m ? __uint_as_float(0x7fc00000u) : m, shared);
    if (threadIdx.x == 0) atomicMax(amax_bits, __float_as_uint(m));
}

extern "C" __global__ void fp8_amax_f32(const float* x, long n, unsigned int* amax_bits) { amax_chunk(x, n, amax_bits); }
extern "C" __global__ void fp8_amax_bf16(const unsigned short* x, long n, unsigned int* amax_bits) {
    amax_chunk(x, n, amax_bits);
}

// ---- the scale ----------------------------------------------------------------------------

// s = max(amax, FLT_MIN)·2^margin / 448: the dequantisation factor (cuBLASLt's convention, x ≈ s·q).
// An all-zero tensor gets a tiny positive s, so x / s stays 0 rather than NaN.
__device__ __forceinline__ float scale_of(float amax, float pow2_margin) {
    return fmaxf(amax, FLT_MIN_NORMAL) * (pow2_margin / E4M3_MAX);
}

// Current scaling: s from this call's amax, then the amax buffer is cleared for the next call
// (so a graph replay needs no memset node). One thread.
extern "C" __global__ void fp8_scale_from_amax(unsigned int* amax_bits, float* scale, float pow2_margin) {
    const float a = __uint_as_float(*amax_bits);
    scale[0] = a != a ? a : scale_of(a, pow2_margin);
    *amax_bits = 0u;
}

// Delayed scaling: s from the largest amax in the history (the last `len` calls). One thread.
extern "C" __global__ void fp8_scale_from_history(const float* history, int len, float* scale, float pow2_margin) {
    float a = 0.0f;
    for (int i = 0; i < len; ++i) a = max_keep_nan(a, history[i]);
    scale[0] = a != a ? a : scale_of(a, pow2_margin);
}

// Delayed scaling: this call's amax joins the history (oldest dropped, newest last); with
// `fill` (the first call) it fills every slot. Clears the amax buffer. One thread.
extern "C" __global__ void fp8_history_push(unsigned int* amax_bits, float* history, int len, int fill) {
    const float a = __uint_as_float(*amax_bits);
    for (int i = 0; i + 1 < len; ++i) history[i] = fill ? a : history[i + 1];
    history[len - 1] = a;
    *amax_bits = 0u;
}

// 1/s: the quantisation factor, for a GEMM that writes E4M3 (cuBLASLt's D scale multiplies the
// result, D = E4M3(scale_D · result); stage 4's fc1 writing fc2's input). One thread.
extern "C" __global__ void fp8_reciprocal(const float* scale, float* inv_scale) { inv_scale[0] = 1.0f / scale[0]; }

// ---- the casts ----------------------------------------------------------------------------

// q = E4M3(x / s); with amax_bits (delayed scaling) also amax ← max(amax, max|x|) in the same
// pass. x / s as a division, not x·(1/s): the CPU quantiser and the twin divide too.
template <typename T>
__device__ __forceinline__ void quantize_chunk(const T* x, long n, const float* scale, unsigned char* q,
                                               unsigned int* amax_bits) {
    __shared__ float shared[WARPS];
    const float s = scale[0];
    const long base = (long)blockIdx.x * CHUNK;
    float m = 0.0f;
    for (int i = 0; i < ITEMS; ++i) {
        const long j = base + threadIdx.x + (long)i * THREADS;
        if (j < n) {
            const float v = load(x, j);
            q[j] = f32_to_e4m3(v / s);
            m = max_keep_nan(m, abs_keep_nan(v));
        }
    }
    if (amax_bits != nullptr) {  // uniform across the grid: every thread takes the same branch
        m = block_max(m != m ? __uint_as_float(0x7fc00000u) : m, shared);
        if (threadIdx.x == 0) atomicMax(amax_bits, __float_as_uint(m));
    }
}

extern "C" __global__ void fp8_quantize_f32(const float* x, long n, const float* scale, unsigned char* q,
                                            unsigned int* amax_bits) {
    quantize_chunk(x, n, scale, q, amax_bits);
}
extern "C" __global__ void fp8_quantize_bf16(const unsigned short* x, long n, const float* scale, unsigned char* q,
                                             unsigned int* amax_bits) {
    quantize_chunk(x, n, scale, q, amax_bits);
}

// y = s·dequant(q) in f32 (exact: an E4M3 value times s is one f32 rounding).
extern "C" __global__ void fp8_dequantize_f32(const unsigned char* q, long n, const float* scale, float* y) {
    const float s = scale[0];
    const long base = (long)blockIdx.x * CHUNK;
    for (int i = 0; i < ITEMS; ++i) {
        const long j = base + threadIdx.x + (long)i * THREADS;
        if (j < n) y[j] = e4m3_to_f32(q[j]) * s;
    }
}

// ---- training: the gradient in E5M2, and the transposed copies ------------------------------
//
// cuBLASLt's FP8 GEMMs take both operands K-major ("TN"), so the HYBRID backward reads
// transposed copies (gemm.rs, `fp8_grad_layout`): dY (M, N) and dYᵀ (N, M) in E5M2 for the data-
// and weight-gradient GEMMs, and Wᵀ, Xᵀ of the forward's E4M3 codes. One block per 32 × 32 tile
// (grid = ceil(rows/32)·ceil(cols/32), tiles row-major): the tile is read along rows into shared
// memory and written along the transposed rows, so both the loads and the stores are coalesced.
// The tile's rows are padded by one, so the threads reading one of its columns spread over the
// shared-memory banks.

// q = E5M2(x / s) (rows, cols) and qᵀ (cols, rows); with amax_bits also amax ← max(amax, max|x|).
template <typename T>
__device__ __forceinline__ void quantize_e5m2_transpose_tile(const T* x, long rows, long cols, const float* scale, unsigned char* q,
                                                             unsigned char* qt, unsigned int* amax_bits) {
    __shared__ unsigned char tile[TILE][TILE + 1];
    __shared__ float shared[WARPS];
    const float s = scale[0];
    const long tiles_c = (cols + TILE - 1) / TILE;
    const long r0 = ((long)blockIdx.x / tiles_c) * TILE, c0 = ((long)blockIdx.x % tiles_c) * TILE;
    const int tx = threadIdx.x % TILE, ty = threadIdx.x / TILE;  // 32 columns × 8 rows
    float m = 0.0f;
    for (int i = ty; i < TILE; i += THREADS / TILE) {
        const long r = r0 + i, c = c0 + tx;
        if (r < rows && c < cols) {
            const float v = load(x, r * cols + c);
            const unsigned char code = f32_to_e5m2(v / s);
            q[r * cols + c] = code;
            tile[i][tx] = code;
            m = max_keep_nan(m, abs_keep_nan(v));
        }
    }
    __syncthreads();  // the whole tile is in shared memory before any thread reads a column of it
    for (int i = ty; i < TILE; i += THREADS / TILE) {
        const long c = c0 + i, r = r0 + tx;  // qᵀ's row c, column r
        if (r < rows && c < cols) qt[c * rows + r] = tile[tx][i];
    }
    if (amax_bits != nullptr) {  // uniform across the grid
        m = block_max(m != m ? __uint_as_float(0x7fc00000u) : m, shared);
        if (threadIdx.x == 0) atomicMax(amax_bits, __float_as_uint(m));
    }
}

extern "C" __global__ void fp8_quantize_e5m2_transpose_f32(const float* x, long rows, long cols, const float* scale, unsigned char* q,
                                                           unsigned char* qt, unsigned int* amax_bits) {
    quantize_e5m2_transpose_tile(x, rows, cols, scale, q, qt, amax_bits);
}
extern "C" __global__ void fp8_quantize_e5m2_transpose_bf16(const unsigned short* x, long rows, long cols, const float* scale,
                                                            unsigned char* q, unsigned char* qt, unsigned int* amax_bits) {
    quantize_e5m2_transpose_tile(x, rows, cols, scale, q, qt, amax_bits);
}

// qt (cols, rows) = q (rows, cols)ᵀ, bytes (E4M3 or E5M2 codes): Wᵀ and Xᵀ of the forward's codes.
extern "C" __global__ void fp8_transpose(const unsigned char* q, long rows, long cols, unsigned char* qt) {
    __shared__ unsigned char tile[TILE][TILE + 1];
    const long tiles_c = (cols + TILE - 1) / TILE;
    const long r0 = ((long)blockIdx.x / tiles_c) * TILE, c0 = ((long)blockIdx.x % tiles_c) * TILE;
    const int tx = threadIdx.x % TILE, ty = threadIdx.x / TILE;
    for (int i = ty; i < TILE; i += THREADS / TILE) {
        const long r = r0 + i, c = c0 + tx;
        if (r < rows && c < cols) tile[i][tx] = q[r * cols + c];
    }
    __syncthreads();
    for (int i = ty; i < TILE; i += THREADS / TILE) {
        const long c = c0 + i, r = r0 + tx;
        if (r < rows && c < cols) qt[c * rows + r] = tile[tx][i];
    }
}

// y = the value of each FP8 code (E4M3, or E5M2 with `e5m2`) in f32, exact: the backward GEMMs'
// fallback, where cuBLASLt offers no E4M3 × E5M2 algorithm, multiplies the very values the FP8
// GEMM would (gemm.rs, `fp8_grad_gemm_fallback`).
extern "C" __global__ void fp8_decode_f32(const unsigned char* q, long n, int e5m2, float* y) {
    const long base = (long)blockIdx.x * CHUNK;
    for (int i = 0; i < ITEMS; ++i) {
        const long j = base + threadIdx.x + (long)i * THREADS;
        if (j < n) y[j] = e5m2 ? e5m2_to_f32(q[j]) : e4m3_to_f32(q[j]);
    }
}
