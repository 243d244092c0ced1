// FlashAttention-2 backward pass on tensor cores: the CUDA twin of the CPU backward in
// src/attention/backward.rs (same algorithm, same notation), built on the forward kernel's tiles
// and helpers (flash_attn.cu, included below).
//
// Given O = softmax(S) V with S = Q Kᵀ · scale (+ causal mask) and the upstream gradient dO:
//   L_i = m_i + log l_i           one log-sum-exp per query row, written by the forward kernels
//                                 while training (their lse pointer), so that
//                                 P_ij = exp(S_ij − L_i) is recomputed tile by tile, never stored
//   D_i = rowsum(dO_i ∘ O_i)      one number per query row (the host computes it: one pass)
//   dV_j = Σ_i P_ijᵀ dO_i
//   dP_ij = dO_i V_jᵀ
//   dS_ij = P_ij ∘ (dP_ij − D_i)
//   dK_j = scale · Σ_i dS_ijᵀ Q_i
//   dQ_i = scale · Σ_j dS_ij K_j
// Dao 2023, "FlashAttention-2", Algorithm 2: one thread block per key tile (K_j, V_j) of one
// (batch, head), grid (⌈T/B_c⌉, n_head, B); the block walks the query tiles Q_i (causal: only
// i ≥ j, the tiles that see key tile j), keeps dK_j and dV_j in shared memory in f32 for the whole
// walk, and adds its share of dQ_i into an f32 buffer with atomicAdd (other key tiles add theirs).
// Nothing of size T × T exists: per block, one (B_r, B_c) tile of S/dP, P and dS at a time.
//
// Warp w owns query rows 16w .. 16w+15 of each Q_i for S, P, dP, dS and dQ (as in the forward), and
// key rows 16w .. 16w+15 of K_j for dK_j and dV_j: those products read every query row of the tile,
// so a __syncthreads separates the two halves of each step.
//
// Outputs dQ (accumulated), dK and dV are f32, (B, T, n_head, d_head) contiguous; the host casts
// them to the inputs' dtype. q, k, v and dO share one set of strides, as q, k and v do in the
// forward (the host passes four slices of one (B, T, 4, n_head, d_head) tensor); L and D are
// (B, n_head, T) f32.
//
// Compiled like flash_attn.cu (build.rs: one cubin per arch) and run on the CPU by
// host_emulation/attention_bwd_check.cpp against an f64 reference of all three gradients.

#include "flash_attn.cu"

// Dynamic shared memory per block, in bytes, for 16-bit inputs (the carve-up in flash_attn_bwd).
template <int D>
constexpr int bwd_smem_bytes() {
    return 4 * BC * D * 2     // K_j, V_j, Q_i, dO_i: 16-bit
           + BR * BC * 4      // S_ij, then dP_ij (and dQ's 16 × 16 staging): f32
           + 2 * BR * BC * 2  // P_ij and dS_ij: 16-bit operands of the next products
           + 2 * BC * D * 4   // dK_j and dV_j: f32, the whole walk
           + 2 * BR * 4;      // L_i and D_i
}
static_assert(bwd_smem_bytes<32>() == 66048, "keep in step with bwd_shared_mem_bytes() in src/attention_cuda.rs");
static_assert(bwd_smem_bytes<64>() == 98816, "keep in step with bwd_shared_mem_bytes() in src/attention_cuda.rs");
static_assert(bwd_smem_bytes<128>() == 164352, "keep in step with bwd_shared_mem_bytes() in src/attention_cuda.rs");
static_assert(bwd_smem_bytes<128>() <= 166912, "fits SM 8.0's 163 KiB of opt-in shared memory per block");

// S = A Bᵀ for this warp's 16 rows of A (a (16, d) tile, row stride D) against the B_c rows of
// B (a (B_c, d) tile, stored row-major, which read column-major is Bᵀ), into out (16, B_c) f32.
// The backward's S_ij = Q_i K_jᵀ and dP_ij = dO_i V_jᵀ, as the forward's S_ij.
template <typename T, int D>
__device__ __forceinline__ void warp_rows_times_tile_t(float* out, const T* a_rows, const T* b_tile) {
#pragma unroll
    for (int n = 0; n < BC / WM; ++n) {
        wmma::fragment<wmma::accumulator, WM, WM, WM, float> acc;
        wmma::fill_fragment(acc, 0.0f);
#pragma unroll
        for (int kk = 0; kk < D / WM; ++kk) {
            wmma::fragment<wmma::matrix_a, WM, WM, WM, T, wmma::row_major> a;
            wmma::fragment<wmma::matrix_b, WM, WM, WM, T, wmma::col_major> bt;
            wmma::load_matrix_sync(a, a_rows + kk * WM, D);
            wmma::load_matrix_sync(bt, b_tile + n * WM * D + kk * WM, D);
            wmma::mma_sync(acc, a, bt, acc);
        }
        wmma::store_matrix_sync(out + n * WM, acc, BC, wmma::mem_row_major);
    }
}

// One thread block: key tile K_j of head (b, h).
template <typename T, int D>
__device__ __forceinline__ void flash_attn_bwd(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                                               const T* __restrict__ d_o, const float* __restrict__ lse,
                                               const float* __restrict__ delta, float* __restrict__ dq,
                                               float* __restrict__ dk, float* __restrict__ dv, int T_len,
                                               long long stride_b, long long stride_t, long long stride_h, float scale,
                                               int causal) {
    extern __shared__ __align__(128) unsigned char smem[];
    T* k_tile = reinterpret_cast<T*>(smem);                      // (B_c, d) K_j
    T* v_tile = k_tile + BC * D;                                 // (B_c, d) V_j
    T* q_tile = v_tile + BC * D;                                 // (B_r, d) Q_i
    T* do_tile = q_tile + BR * D;                                // (B_r, d) dO_i
    float* s_tile = reinterpret_cast<float*>(do_tile + BR * D);  // (B_r, B_c) S_ij, then dP_ij
    T* p_tile = reinterpret_cast<T*>(s_tile + BR * BC);          // (B_r, B_c) P_ij
    T* ds_tile = p_tile + BR * BC;                               // (B_r, B_c) scale · dS_ij
    float* dk_tile = reinterpret_cast<float*>(ds_tile + BR * BC);  // (B_c, d) dK_j
    float* dv_tile = dk_tile + BC * D;                           // (B_c, d) dV_j
    float* l_tile = dv_tile + BC * D;                            // (B_r) L_i
    float* d_tile = l_tile + BR;                                 // (B_r) D_i

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int j_tile = blockIdx.x, j0 = j_tile * BC, h = blockIdx.y, b = blockIdx.z, H = gridDim.y;
    const long long head = b * stride_b + h * stride_h;
    const long long out_head = (long long)b * T_len * H * D + (long long)h * D, out_t = (long long)H * D;  // (B, T, H, D)
    const long long stats = ((long long)b * H + h) * T_len;  // row 0 of this head's L and D
    q += head;
    k += head;
    v += head;
    d_o += head;

    load_tile<T, D, BC>(k_tile, k, j0, T_len, stride_t);
    load_tile<T, D, BC>(v_tile, v, j0, T_len, stride_t);
    for (int c = threadIdx.x; c < BC * D; c += THREADS) dk_tile[c] = dv_tile[c] = 0.0f;  // dK_j = dV_j = 0

    float* s_w = s_tile + warp * ROWS_PER_WARP * BC;  // this warp's 16 query rows of S, dP
    T* p_w = p_tile + warp * ROWS_PER_WARP * BC;
    T* ds_w = ds_tile + warp * ROWS_PER_WARP * BC;

    // Causal: query tiles before the diagonal (i < j) see none of these keys.
    const int T_r = T_len / BR + (T_len % BR != 0);
    for (int i_tile = causal ? j_tile : 0; i_tile < T_r; ++i_tile) {
        const int i0 = i_tile * BR;
        __syncthreads();  // K_j, V_j and the zeroed dK_j, dV_j are complete (first pass); every warp
                          // is done with Q_i−1, dO_i−1, P and dS (after)
        load_tile<T, D, BR>(q_tile, q, i0, T_len, stride_t);
        load_tile<T, D, BR>(do_tile, d_o, i0, T_len, stride_t);
        for (int r = threadIdx.x; r < BR; r += THREADS) {
            // A padded row: L = +∞ makes its P zero, D = 0 its dS.
            l_tile[r] = i0 + r < T_len ? lse[stats + i0 + r] : INFINITY;
            d_tile[r] = i0 + r < T_len ? delta[stats + i0 + r] : 0.0f;
        }
        __syncthreads();

        // S_ij = Q_i K_jᵀ (this warp's rows), as in the forward.
        warp_rows_times_tile_t<T, D>(s_w, q_tile + warp * ROWS_PER_WARP * D, k_tile);
        __syncwarp();

        // P_ij = exp(S_ij · scale − L_i), 0 where masked; kept in f32 registers for dS, and
        // rounded to 16 bits as the operand of dV += Pᵀ dO.
        float p[ROWS_PER_WARP][BC / 32];
#pragma unroll
        for (int r = 0; r < ROWS_PER_WARP; ++r) {
            const int i = i0 + warp * ROWS_PER_WARP + r;
#pragma unroll
            for (int x = 0; x < BC / 32; ++x) {
                const int j = j0 + lane + 32 * x;
                const bool masked = j >= T_len || (causal && j > i);
                p[r][x] = masked ? 0.0f : expf(s_w[r * BC + lane + 32 * x] * scale - l_tile[warp * ROWS_PER_WARP + r]);
                store_rounded(&p_w[r * BC + lane + 32 * x], p[r][x]);
            }
        }
        __syncwarp();  // every lane has read its S before dP overwrites the rows

        // dP_ij = dO_i V_jᵀ (this warp's rows), into S's place.
        warp_rows_times_tile_t<T, D>(s_w, do_tile + warp * ROWS_PER_WARP * D, v_tile);
        __syncwarp();

        // scale · dS_ij = scale · P_ij ∘ (dP_ij − D_i), rounded to 16 bits for dK and dQ.
#pragma unroll
        for (int r = 0; r < ROWS_PER_WARP; ++r) {
            const float d_i = d_tile[warp * ROWS_PER_WARP + r];
#pragma unroll
            for (int x = 0; x < BC / 32; ++x)
                store_rounded(&ds_w[r * BC + lane + 32 * x], scale * p[r][x] * (s_w[r * BC + lane + 32 * x] - d_i));
        }
        __syncthreads();  // P and dS of every query row are complete: dV and dK read them all

        // dV_j += P_ijᵀ dO_i and dK_j += (scale · dS_ij)ᵀ Q_i, this warp's 16 key rows. P is stored
        // (B_r, B_c) row-major, which read column-major is Pᵀ: no transpose is written.
        const int kr = warp * ROWS_PER_WARP;  // this warp's first key row in the tile
#pragma unroll
        for (int n = 0; n < D / WM; ++n) {
            wmma::fragment<wmma::accumulator, WM, WM, WM, float> acc_v, acc_k;
            wmma::load_matrix_sync(acc_v, dv_tile + kr * D + n * WM, D, wmma::mem_row_major);
            wmma::load_matrix_sync(acc_k, dk_tile + kr * D + n * WM, D, wmma::mem_row_major);
#pragma unroll
            for (int kk = 0; kk < BR / WM; ++kk) {
                wmma::fragment<wmma::matrix_a, WM, WM, WM, T, wmma::col_major> pt, dst;
                wmma::fragment<wmma::matrix_b, WM, WM, WM, T, wmma::row_major> dob, qb;
                wmma::load_matrix_sync(pt, p_tile + kk * WM * BC + kr, BC);
                wmma::load_matrix_sync(dst, ds_tile + kk * WM * BC + kr, BC);
                wmma::load_matrix_sync(dob, do_tile + kk * WM * D + n * WM, D);
                wmma::load_matrix_sync(qb, q_tile + kk * WM * D + n * WM, D);
                wmma::mma_sync(acc_v, pt, dob, acc_v);
                wmma::mma_sync(acc_k, dst, qb, acc_k);
            }
            wmma::store_matrix_sync(dv_tile + kr * D + n * WM, acc_v, D, wmma::mem_row_major);
            wmma::store_matrix_sync(dk_tile + kr * D + n * WM, acc_k, D, wmma::mem_row_major);
        }

        // dQ_i += (scale · dS_ij) K_j, this warp's 16 query rows, 16 columns at a time through a
        // 16 × 16 staging tile in S's place, added into the f32 buffer other key tiles add to.
#pragma unroll
        for (int n = 0; n < D / WM; ++n) {
            wmma::fragment<wmma::accumulator, WM, WM, WM, float> acc;
            wmma::fill_fragment(acc, 0.0f);
#pragma unroll
            for (int kk = 0; kk < BC / WM; ++kk) {
                wmma::fragment<wmma::matrix_a, WM, WM, WM, T, wmma::row_major> dsa;
                wmma::fragment<wmma::matrix_b, WM, WM, WM, T, wmma::row_major> kb;
                wmma::load_matrix_sync(dsa, ds_w + kk * WM, BC);
                wmma::load_matrix_sync(kb, k_tile + kk * WM * D + n * WM, D);
                wmma::mma_sync(acc, dsa, kb, acc);
            }
            __syncwarp();  // the lanes are done reading the previous staging tile (and the dP rows)
            wmma::store_matrix_sync(s_w, acc, WM, wmma::mem_row_major);
            __syncwarp();
            for (int e = lane; e < WM * WM; e += 32) {
                const int i = i0 + warp * ROWS_PER_WARP + e / WM;
                if (i < T_len) atomicAdd(&dq[out_head + (long long)i * out_t + n * WM + e % WM], s_w[e]);
            }
        }
    }
    __syncthreads();  // the last dK_j, dV_j stores are complete (each warp wrote only its rows, but
                      // the write-out below is spread over all threads)
    for (int c = threadIdx.x; c < BC * D; c += THREADS) {
        const int j = j0 + c / D;
        if (j < T_len) {
            dk[out_head + (long long)j * out_t + c % D] = dk_tile[c];
            dv[out_head + (long long)j * out_t + c % D] = dv_tile[c];
        }
    }
}

// Entry points, one per (dtype, d_head): flash_attn_bwd_bf16_d64, flash_attn_bwd_f16_d128, ...
#define FLASH_ATTN_BWD_ENTRY(T, TNAME, D)                                                                           \
    extern "C" __global__ void __launch_bounds__(THREADS) flash_attn_bwd_##TNAME##_d##D(                            \
        const T* q, const T* k, const T* v, const T* d_o, const float* lse, const float* delta, float* dq, float* dk, \
        float* dv, int T_len, long long stride_b, long long stride_t, long long stride_h, float scale, int causal) {   \
        flash_attn_bwd<T, D>(q, k, v, d_o, lse, delta, dq, dk, dv, T_len, stride_b, stride_t, stride_h, scale,       \
                             causal);                                                                               \
    }

FLASH_ATTN_BWD_ENTRY(__nv_bfloat16, bf16, 32)
FLASH_ATTN_BWD_ENTRY(__nv_bfloat16, bf16, 64)
FLASH_ATTN_BWD_ENTRY(__nv_bfloat16, bf16, 128)
FLASH_ATTN_BWD_ENTRY(__half, f16, 32)
FLASH_ATTN_BWD_ENTRY(__half, f16, 64)
FLASH_ATTN_BWD_ENTRY(__half, f16, 128)
