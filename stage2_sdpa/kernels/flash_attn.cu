// FlashAttention-2 forward pass on tensor cores: the CUDA twin of the CPU kernel in
// src/attention.rs, written to be read beside it (same algorithm, same m, l, O notation).
//
//   O = softmax(Q Kᵀ · scale [+ causal mask]) V      for every (batch, head); scale = 1/√d
//
// Dao 2023, "FlashAttention-2", Algorithm 1 (forward), line by line:
//   for each query tile Q_i (B_r rows)          one thread block per (Q_i, head, batch):
//                                               grid (⌈T/B_r⌉, n_head, B)
//     O_i = 0, l_i = 0, m_i = −∞                O_i in shared memory (f32); m, l in registers
//     for each key/value tile K_j, V_j (B_c)    the loop below; K_j, V_j staged through shared
//                                               memory, shared by the block's four warps
//       S_ij = Q_i K_jᵀ                          WMMA (tensor cores), 16-bit in, f32 accumulate
//       m_new = max(m, rowmax(S_ij))             f32, one warp per 16 rows, lanes across keys
//       P̃_ij = exp(S_ij − m_new)                 f32, rounded to 16 bits for the next product
//       l = e^(m − m_new) l + rowsum(P̃_ij)       f32 (the sum uses the unrounded P̃)
//       O_i = diag(e^(m − m_new)) O_i + P̃_ij V_j rescale in shared memory, then WMMA
//     O_i = diag(l)⁻¹ O_i                        rounded to bf16/f16 and stored
// Causal: tiles K_j above the diagonal (j > i) are never loaded; the diagonal tile is masked.
//
// Layout: q, k, v and o are (B, T, n_head, d_head) — the projections' (B, T, C) output viewed
// as heads, as in the CPU kernel and candle-flash-attn. Row t of head (b, h) starts at
// b·stride_b + t·stride_t + h·stride_h (elements) and its d_head values are contiguous, so a
// tile row is one coalesced 128- or 256-byte read. Strides are arguments, so stage 3's q, k, v —
// strided views into one (B, T, 3, n_head, d_head) GEMM output — are read in place, no copies.
// The host side (src/attention_cuda.rs) checks what the loads below assume: rows 16-byte
// aligned (start offset and strides multiples of 8 elements), else it copies first.
//
// Thread layout: THREADS = 128 = 4 warps. Warp w owns query rows 16w .. 16w+15 of Q_i (one
// WMMA tile tall) for the whole kernel: its S rows, P rows, O rows and their m, l. This is
// FlashAttention-2's split of Q across warps: the softmax statistics of a row never leave its
// warp, so warps only meet at the tile loads.
//
// What this kernel leaves out, for readability (each is worth a few tens of per cent):
// O_i is kept in shared memory and rescaled there, where FlashAttention-2 keeps it in
// registers (WMMA's accumulator layout is opaque, so per-row scaling would need raw mma.sync);
// shared-memory rows are not padded or swizzled (bank conflicts on the WMMA loads); tiles are
// loaded synchronously (no cp.async double buffering); exp is expf, not exp2 with log2(e)
// folded into the scale. The arithmetic is the CPU kernel's, so they check against each other.
//
// Compiled by build.rs to a cubin per arch in CUDA_COMPUTE_CAP (nvcc -cubin -arch=sm_XX, SM 8.0+:
// bf16 WMMA) and loaded through `stage2_sdpa::cubin`. Without a GPU, this same
// source also runs on the CPU under host_emulation/ (bash host_emulation/run.sh),
// which checks its indexing, masking and online softmax against an f64 reference.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <mma.h>

using namespace nvcuda;

// Tile sizes: keep in step with BR, BC, WARPS and shared_mem_bytes in src/attention_cuda.rs
// (its tests read these lines back).
constexpr int BR = 64;                // query rows per block (B_r)
constexpr int BC = 64;                // key/value rows per tile (B_c)
constexpr int WARPS = 4;              // warps per block
constexpr int THREADS = WARPS * 32;   // 128
constexpr int WM = 16;                // WMMA tile: 16 × 16 × 16 (bf16/f16 in, f32 accumulate)
constexpr int ROWS_PER_WARP = BR / WARPS;  // 16: each warp's rows are one WMMA tile tall

static_assert(ROWS_PER_WARP == WM, "each warp owns one WMMA tile's rows");
static_assert(BC % 32 == 0, "the softmax splits a row's B_c scores evenly over 32 lanes");
// Q_i passes through K's buffer, and with B_r == B_c every K_j the block loads (j <= i when
// causal) holds key j·B_c, which every query row of Q_i may see: so each row has a finite
// score in every tile and m_new below is never −∞ (no exp(−∞ − (−∞)) = NaN to guard against).
static_assert(BR == BC, "Q_i is staged through the K_j buffer; every row sees a key in every tile");

// Dynamic shared memory per block, in bytes, for 16-bit inputs (see the carve-up in the kernel).
template <int D>
constexpr int smem_bytes() {
    return 2 * BC * D * 2     // K_j and V_j, 16-bit (Q_i passes through K_j's buffer first)
           + BR * BC * 4      // S_ij, f32
           + BR * BC * 2      // P̃_ij, 16-bit
           + BR * D * 4;      // O_i, f32
}
static_assert(smem_bytes<32>() == 40960, "keep in step with shared_mem_bytes() in src/attention_cuda.rs");
static_assert(smem_bytes<64>() == 57344, "keep in step with shared_mem_bytes() in src/attention_cuda.rs");
static_assert(smem_bytes<128>() == 90112, "keep in step with shared_mem_bytes() in src/attention_cuda.rs");

__device__ __forceinline__ void store_rounded(__nv_bfloat16* p, float x) { *p = __float2bfloat16(x); }
__device__ __forceinline__ void store_rounded(__half* p, float x) { *p = __float2half(x); }

__device__ __forceinline__ float warp_max(float x) {
    for (int off = 16; off > 0; off >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, off));
    return x;
}
__device__ __forceinline__ float warp_sum(float x) {
    for (int off = 16; off > 0; off >>= 1) x += __shfl_xor_sync(0xffffffffu, x, off);
    return x;
}

// Copy rows r0 .. r0+ROWS−1 of one head into a (ROWS, D) shared-memory tile, 16 bytes (8
// values) per thread per step: consecutive threads take consecutive 16-byte pieces of a row, so
// each row is one coalesced read. Rows at or past T are zero: a padded key then scores 0 (and is
// masked), a padded value adds 0·0, a padded query stays finite — uninitialised shared memory
// could hold NaN bit patterns, and 0·NaN is NaN.
template <typename T, int D, int ROWS>
__device__ __forceinline__ void load_tile(T* dst, const T* src, int r0, int T_len, long long stride_t) {
    constexpr int CHUNKS = D * (int)sizeof(T) / 16;  // 16-byte pieces per row: 4, 8 or 16
    for (int c = threadIdx.x; c < ROWS * CHUNKS; c += THREADS) {
        const int r = c / CHUNKS, piece = c % CHUNKS;
        uint4 x = make_uint4(0, 0, 0, 0);
        if (r0 + r < T_len) x = reinterpret_cast<const uint4*>(src + (long long)(r0 + r) * stride_t)[piece];
        reinterpret_cast<uint4*>(dst + r * D)[piece] = x;
    }
}

// One thread block: query tile Q_i of head (b, h). T is __nv_bfloat16 or __half; D = d_head.
template <typename T, int D>
__device__ __forceinline__ void flash_attn_fwd(const T* __restrict__ q, const T* __restrict__ k,
                                               const T* __restrict__ v, T* __restrict__ o, int T_len,
                                               long long stride_b, long long stride_t, long long stride_h,
                                               long long o_stride_b, long long o_stride_t, long long o_stride_h,
                                               float scale, int causal, float* __restrict__ lse) {
    static_assert(D % WM == 0 && D % 32 == 0, "d_head: whole WMMA tiles, whole warps across a row");
    extern __shared__ __align__(128) unsigned char smem[];
    T* k_tile = reinterpret_cast<T*>(smem);                   // (B_c, d) K_j  — Q_i at the start
    T* v_tile = k_tile + BC * D;                              // (B_c, d) V_j
    float* s_tile = reinterpret_cast<float*>(v_tile + BC * D);  // (B_r, B_c) S_ij, f32
    T* p_tile = reinterpret_cast<T*>(s_tile + BR * BC);       // (B_r, B_c) P̃_ij, 16-bit
    float* o_tile = reinterpret_cast<float*>(p_tile + BR * BC);  // (B_r, d) O_i, f32

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    // Causal: later query tiles see more keys, so they are launched first (the longest blocks
    // start earliest and the short ones fill the tail of the grid).
    const int i_tile = causal ? gridDim.x - 1 - blockIdx.x : blockIdx.x;
    const int i0 = i_tile * BR;
    const int h = blockIdx.y, b = blockIdx.z;
    const long long head = b * stride_b + h * stride_h;  // row t of this head: head + t·stride_t
    q += head;
    k += head;
    v += head;
    o += b * o_stride_b + h * o_stride_h;

    // This warp's rows of S, P̃ and O_i.
    float* s_w = s_tile + warp * ROWS_PER_WARP * BC;  // (16, B_c)
    T* p_w = p_tile + warp * ROWS_PER_WARP * BC;      // (16, B_c)
    float* o_w = o_tile + warp * ROWS_PER_WARP * D;   // (16, d)

    // Q_i: through shared memory (K_j's buffer) once, then into registers as WMMA A fragments
    // for the whole kernel — it is the operand every S_ij reuses.
    load_tile<T, D, BR>(k_tile, q, i0, T_len, stride_t);
    __syncthreads();  // Q_i is complete before warps read rows that other threads loaded
    wmma::fragment<wmma::matrix_a, WM, WM, WM, T, wmma::row_major> q_frag[D / WM];
#pragma unroll
    for (int kk = 0; kk < D / WM; ++kk) {
        wmma::load_matrix_sync(q_frag[kk], k_tile + warp * ROWS_PER_WARP * D + kk * WM, D);
    }

    float m[ROWS_PER_WARP], l[ROWS_PER_WARP];  // per row; every lane of the warp holds all 16
#pragma unroll
    for (int r = 0; r < ROWS_PER_WARP; ++r) {
        m[r] = -INFINITY;  // m_i = −∞
        l[r] = 0.0f;       // l_i = 0
        for (int c = lane; c < D; c += 32) o_w[r * D + c] = 0.0f;  // O_i = 0
    }

    // T_c = ⌈T / B_c⌉ key/value tiles (written so that T near INT_MAX cannot overflow). Causal:
    // tiles after the diagonal (j > i) are masked for every row of Q_i, so they are skipped
    // entirely — about half the work at long T. Counting tiles rather than positions keeps every
    // position below in int range (launch_config allows T up to INT_MAX).
    const int T_c = T_len / BC + (T_len % BC != 0);
    const int kv_tiles = causal ? min(i_tile + 1, T_c) : T_c;
    for (int j_tile = 0; j_tile < kv_tiles; ++j_tile) {
        const int j0 = j_tile * BC;  // first key of K_j
        __syncthreads();  // every warp is done with the buffers (Q_i on the first pass, K_j−1
                          // and V_j−1 after) before they are overwritten
        load_tile<T, D, BC>(k_tile, k, j0, T_len, stride_t);
        load_tile<T, D, BC>(v_tile, v, j0, T_len, stride_t);
        __syncthreads();  // K_j and V_j are complete before warps read rows other threads loaded

        // S_ij = Q_i K_jᵀ for this warp's 16 rows, 16 keys at a time. K_j is stored (B_c, d)
        // row-major, which read column-major is K_jᵀ: no transpose is ever written.
#pragma unroll
        for (int n = 0; n < BC / WM; ++n) {
            wmma::fragment<wmma::accumulator, WM, WM, WM, float> acc;
            wmma::fill_fragment(acc, 0.0f);
#pragma unroll
            for (int kk = 0; kk < D / WM; ++kk) {
                wmma::fragment<wmma::matrix_b, WM, WM, WM, T, wmma::col_major> kt;
                wmma::load_matrix_sync(kt, k_tile + n * WM * D + kk * WM, D);
                wmma::mma_sync(acc, q_frag[kk], kt, acc);
            }
            wmma::store_matrix_sync(s_w + n * WM, acc, BC, wmma::mem_row_major);
        }
        __syncwarp();  // S rows are complete before lanes read scores that other lanes stored
                       // (the accumulator's element-to-lane mapping is unspecified)

        // Online softmax, one row at a time, the 32 lanes splitting its B_c scores: lane x holds
        // keys x and x + 32 (consecutive lanes, consecutive addresses: no bank conflicts).
#pragma unroll
        for (int r = 0; r < ROWS_PER_WARP; ++r) {
            const int i = i0 + warp * ROWS_PER_WARP + r;  // this row's query position
            float s[BC / 32];
            float m_new = m[r];
#pragma unroll
            for (int x = 0; x < BC / 32; ++x) {
                const int j = j0 + lane + 32 * x;  // key position
                s[x] = s_w[r * BC + lane + 32 * x] * scale;           // S_ij = q_i · k_j / √d
                if (j >= T_len || (causal && j > i)) s[x] = -INFINITY;  // padding, or a future key
                m_new = fmaxf(m_new, s[x]);
            }
            m_new = warp_max(m_new);  // m_new = max(m, rowmax(S))
            // Rescale what was accumulated under the old max: α = exp(m − m_new)
            // (m = −∞ on the first tile gives α = 0).
            const float alpha = expf(m[r] - m_new);
            float rowsum = 0.0f;
#pragma unroll
            for (int x = 0; x < BC / 32; ++x) {
                const float p = expf(s[x] - m_new);  // P̃_ij = exp(S_ij − m_new)
                rowsum += p;
                store_rounded(&p_w[r * BC + lane + 32 * x], p);  // 16-bit operand of P̃ V
            }
            l[r] = alpha * l[r] + warp_sum(rowsum);  // l = α·l + rowsum(P̃)
            for (int c = lane; c < D; c += 32) o_w[r * D + c] *= alpha;  // O = α·O
            m[r] = m_new;
        }
        __syncwarp();  // P̃ and the rescaled O rows are complete before WMMA loads them

        // O_i += P̃_ij V_j, 16 output columns at a time, accumulating onto O in f32.
#pragma unroll
        for (int n = 0; n < D / WM; ++n) {
            wmma::fragment<wmma::accumulator, WM, WM, WM, float> acc;
            wmma::load_matrix_sync(acc, o_w + n * WM, D, wmma::mem_row_major);
#pragma unroll
            for (int kk = 0; kk < BC / WM; ++kk) {
                wmma::fragment<wmma::matrix_a, WM, WM, WM, T, wmma::row_major> pa;
                wmma::fragment<wmma::matrix_b, WM, WM, WM, T, wmma::row_major> vb;
                wmma::load_matrix_sync(pa, p_w + kk * WM, BC);
                wmma::load_matrix_sync(vb, v_tile + kk * WM * D + n * WM, D);
                wmma::mma_sync(acc, pa, vb, acc);
            }
            wmma::store_matrix_sync(o_w + n * WM, acc, D, wmma::mem_row_major);
        }
    }
    __syncwarp();  // the last O stores are complete before lanes read values other lanes stored

    // Training: L_i = m_i + log l_i, one f32 per row into lse (B, n_head, T), which the backward
    // recomputes P = exp(S − L) from. Lane r writes row r (every lane holds all 16 rows' m and l).
    if (lse != nullptr) {
#pragma unroll
        for (int r = 0; r < ROWS_PER_WARP; ++r) {
            const int i = i0 + warp * ROWS_PER_WARP + r;
            if (lane == r && i < T_len) lse[((long long)b * gridDim.y + h) * T_len + i] = m[r] + logf(l[r]);
        }
    }

    // O_i = diag(l)⁻¹ · O_i, written out in the input dtype (rows past T are padding).
#pragma unroll
    for (int r = 0; r < ROWS_PER_WARP; ++r) {
        const int i = i0 + warp * ROWS_PER_WARP + r;
        if (i >= T_len) break;
        const float inv_l = 1.0f / l[r];
        for (int c = lane; c < D; c += 32) store_rounded(&o[(long long)i * o_stride_t + c], o_w[r * D + c] * inv_l);
    }
}

// Entry points, one per (dtype, d_head): flash_attn_fwd_bf16_d64, flash_attn_fwd_f16_d128, ...
// Strides are in elements; causal is 0 or 1; lse is null, or (B, n_head, T) f32 for training.
#define FLASH_ATTN_ENTRY(T, TNAME, D)                                                                    \
    extern "C" __global__ void __launch_bounds__(THREADS) flash_attn_fwd_##TNAME##_d##D(                 \
        const T* q, const T* k, const T* v, T* o, int T_len, long long stride_b, long long stride_t,     \
        long long stride_h, long long o_stride_b, long long o_stride_t, long long o_stride_h, float scale, \
        int causal, float* lse) {                                                                        \
        flash_attn_fwd<T, D>(q, k, v, o, T_len, stride_b, stride_t, stride_h, o_stride_b, o_stride_t,    \
                             o_stride_h, scale, causal, lse);                                            \
    }

FLASH_ATTN_ENTRY(__nv_bfloat16, bf16, 32)
FLASH_ATTN_ENTRY(__nv_bfloat16, bf16, 64)
FLASH_ATTN_ENTRY(__nv_bfloat16, bf16, 128)
FLASH_ATTN_ENTRY(__half, f16, 32)
FLASH_ATTN_ENTRY(__half, f16, 64)
FLASH_ATTN_ENTRY(__half, f16, 128)
