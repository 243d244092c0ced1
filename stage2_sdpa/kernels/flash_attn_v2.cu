// FlashAttention-2 forward, step 2 of the kernel series: the same algorithm as flash_attn.cu
// (v1; read that first — same m, l, O notation, same tiles, same entry signature), rebuilt so
// that S and P never leave registers. docs/stages.md tells the series and which Nsight Compute
// number each change answers.
//
//   O = softmax(Q Kᵀ · scale [+ causal mask]) V      for every (batch, head); scale = 1/√d
//
// What changed from v1, and why (v1 on an H100 at te, d_head = 128: 12.5 % occupancy, shared
// loads with 6.7-way bank conflicts, IPC 0.53, L1/TEX throughput 87 % while Compute (SM)
// throughput is 19 % and SM Busy 13 %, in Nsight Compute's metric names):
//  1. Raw mma.sync.m16n8k16 instead of WMMA. WMMA's accumulator layout is opaque, so v1 had to
//     store S to shared memory to find a row, and read P back from it: two round trips per
//     tile. mma.sync's layout is documented (ptx_warp.h): lane (g = lane/4, t = lane%4) holds
//     S[g][2t, 2t+1] and S[g+8][2t, 2t+1] of every 16 × 8 tile, so the softmax works on the
//     accumulators in place, and a row's max and sum need only the 4 lanes of its quad
//     (__shfl_xor 1 and 2).
//  2. P stays in registers: two neighbouring 16 × 8 accumulator tiles of P, rounded to 16 bits
//     and packed in pairs, are exactly the A fragment of the next 16 × 16 × 16 product (the
//     accumulator's rows g, g+8 and columns 2t, 2t+1 are the A operand's). No shared memory.
//  3. O stays in registers too (the 16 × d accumulators of P·V), rescaled by α per row in place;
//     v1 kept O_i in shared memory (f32, 32 KiB at d = 128) and rescaled it there.
//  4. Shared memory holds only K_j and V_j, twice (double buffering): tile j+1 is fetched with
//     cp.async while tile j is computed on, and no thread stages the data through registers.
//  5. An XOR swizzle of the 16-byte chunks of every shared row, so that each ldmatrix phase
//     (8 rows × 16 bytes) hits all 32 banks once: no bank conflicts (argued at `swz` below;
//     the host emulation counts conflicts and requires zero).
//  6. exp2f with log2(e) folded into the scale: one FFMA and one MUFU.EX2 per score, where expf
//     costs a multiply more.
// Shared memory per block: 16, 32, 64 KiB at d = 32, 64, 128 (v1: 40, 56, 88), so three blocks
// fit an H100 SM at d = 128 where v1 fitted two — if registers allow (ptxas -v; see
// REGISTERS_PER_THREAD_V2 in src/attention_cuda.rs).
//
// Thread layout: as v1, THREADS = 128 = 4 warps, B_r = B_c = 64, warp w owns query rows
// 16w .. 16w+15 of Q_i: its S rows, P rows, O rows, m and l, for the whole kernel. Per lane:
// rows g and g+8 of that slice (index h = 0, 1 below), 2 of every 8 columns.
//
// Layout of q, k, v, o, strides, 16-byte alignment: exactly as v1 (see its header), so the host
// side calls either kernel with the same arguments. Built to a cubin by build.rs (-I kernels, so
// <ptx_warp.h> is the inline-PTX one); run on the CPU by host_emulation/attention_v2_check.cpp
// (-I host_emulation, so <ptx_warp.h> is the emulation), against an f64 reference.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <ptx_warp.h>

// Tile sizes: keep in step with src/attention_cuda.rs (its tests read these lines back).
constexpr int BR = 64;               // query rows per block (B_r)
constexpr int BC = 64;               // key/value rows per tile (B_c)
constexpr int WARPS = 4;             // warps per block
constexpr int THREADS = WARPS * 32;  // 128
constexpr int ROWS_PER_WARP = BR / WARPS;  // 16: one m16n8k16 tile tall
constexpr float LOG2E = 1.4426950408889634f;

static_assert(ROWS_PER_WARP == 16, "each warp owns one mma tile's 16 rows");
// As in v1: with B_r == B_c every tile the block loads holds a key that every query row of Q_i
// may see (key j·B_c ≤ every row of tile i ≥ j, and < T), so m is finite after the first tile
// and α = exp2(m − m_new) never meets −∞ − (−∞). Q_i also passes through a K buffer.
static_assert(BR == BC, "Q_i is staged through a K_j buffer; every row sees a key in every tile");

// Dynamic shared memory per block: K_j and V_j, two stages each, 16-bit. Nothing else.
template <int D>
constexpr int smem_bytes_v2() {
    return 2 * 2 * BC * D * 2;
}
static_assert(smem_bytes_v2<32>() == 16384, "keep in step with shared_mem_bytes_v2() in src/attention_cuda.rs");
static_assert(smem_bytes_v2<64>() == 32768, "keep in step with shared_mem_bytes_v2() in src/attention_cuda.rs");
static_assert(smem_bytes_v2<128>() == 65536, "keep in step with shared_mem_bytes_v2() in src/attention_cuda.rs");

// Where 16-byte chunk `chunk` (values 8·chunk .. 8·chunk+7) of tile row `row` lives, in chunks
// from the tile's start: the row's chunks XOR-permuted by the row number.
//
// Why this is conflict-free: shared memory has 32 banks of 4 bytes, so a 128-byte line is one
// pass over every bank and chunk q covers banks 4(q mod 8) .. 4(q mod 8)+3. One ldmatrix phase
// (one of its four 8 × 8 matrices) reads 8 consecutive rows r0 .. r0+7 (r0 a multiple of 8:
// query rows 16w, 16w+8; key rows 16n, 16n+8) at one logical chunk c. Unswizzled, with D/8
// chunks per row, d = 64 or 128 puts every one of those rows at the same q mod 8: an 8-way
// conflict (v1's loads had 6.7-way). Swizzled:
//  - d ≥ 64 (8 or 16 chunks a row, a multiple of 8): q mod 8 = c XOR (row mod 8), which takes
//    8 different values over the 8 rows — every bank once, one wavefront.
//  - d = 32 (4 chunks a row): q mod 8 = 4·(row mod 2) + (c XOR ((row / 2) mod 4)), and
//    (row mod 2, (row / 2) mod 4) takes 8 different values over the 8 rows — again one pass.
// The cp.async stores are conflict-free by the same sums: 8 consecutive threads write 8
// consecutive logical chunks of one row (two rows at d = 32).
template <int D>
__device__ __forceinline__ int swz(int row, int chunk) {
    constexpr int CHUNKS = D / 8;
    if constexpr (CHUNKS >= 8) return row * CHUNKS + (chunk ^ (row % 8));
    else return row * CHUNKS + (chunk ^ ((row / 2) % 4));
}

// Start fetching rows r0 .. r0+63 of one head into a (64, D) swizzled tile with cp.async, 16
// bytes per thread per step (consecutive threads, consecutive pieces of a row: coalesced).
// Rows at or past T are zero-filled and not read (src-size 0): a padded key scores 0 (and is
// masked), a padded value adds 0·0, a padded query stays finite.
template <typename T, int D>
__device__ __forceinline__ void load_tile_async(T* dst, const T* src, int r0, int T_len, long long stride_t) {
    constexpr int CHUNKS = D / 8;
    for (int c = threadIdx.x; c < BC * CHUNKS; c += THREADS) {
        const int r = c / CHUNKS, piece = c % CHUNKS;
        const bool valid = r0 + r < T_len;
        const T* row = src + (long long)(valid ? r0 + r : 0) * stride_t;  // a valid address either way
        cp_async_16(dst + swz<D>(r, piece) * 8, row + piece * 8, valid);
    }
}

// Max and sum over the 4 lanes of a quad, which together hold one row of an accumulator tile.
__device__ __forceinline__ float quad_max(float x) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
    return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// One thread block: query tile Q_i of head (b, h). T is __nv_bfloat16 or __half; D = d_head.
template <typename T, int D>
__device__ __forceinline__ void flash_attn_v2_fwd(const T* __restrict__ q, const T* __restrict__ k,
                                                  const T* __restrict__ v, T* __restrict__ o, int T_len,
                                                  long long stride_b, long long stride_t, long long stride_h,
                                                  long long o_stride_b, long long o_stride_t, long long o_stride_h,
                                                  float scale, int causal) {
    static_assert(D % 16 == 0 && D >= 32, "d_head: whole k-steps of 16, at least 4 chunks a row");
    extern __shared__ __align__(128) unsigned char smem[];
    T* k_tiles = reinterpret_cast<T*>(smem);  // [2][B_c × d] K_j, swizzled; stage 1 holds Q_i first
    T* v_tiles = k_tiles + 2 * BC * D;        // [2][B_c × d] V_j, swizzled

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = lane / 4, t = lane % 4;  // fragment coordinates (ptx_warp.h)
    // Causal: later query tiles see more keys, so they are launched first (as v1).
    const int i_tile = causal ? gridDim.x - 1 - blockIdx.x : blockIdx.x;
    const int i0 = i_tile * BR;
    const int h = blockIdx.y, b = blockIdx.z;
    const long long head = b * stride_b + h * stride_h;  // row t of this head: head + t·stride_t
    q += head;
    k += head;
    v += head;
    o += b * o_stride_b + h * o_stride_h;
    const int row0 = i0 + warp * ROWS_PER_WARP + g;  // query position of this lane's row h = 0 (h = 1: +8)
    const float scale_log2 = scale * LOG2E;           // exp(x·scale) = exp2(x·scale·log2 e)

    // T_c key/value tiles; causal: tiles after the diagonal (j > i) are skipped, as in v1.
    const int T_c = T_len / BC + (T_len % BC != 0);
    const int kv_tiles = causal ? min(i_tile + 1, T_c) : T_c;

    // Prologue: Q_i into stage 1's K buffer, K_0 and V_0 into stage 0, as one cp.async group.
    load_tile_async<T, D>(k_tiles + BC * D, q, i0, T_len, stride_t);
    load_tile_async<T, D>(k_tiles, k, 0, T_len, stride_t);
    load_tile_async<T, D>(v_tiles, v, 0, T_len, stride_t);
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();  // every thread's part of Q_i, K_0, V_0 has landed

    // Q_i → registers, once: this warp's 16 rows as D/16 A fragments (16 × 16 each). ldmatrix.x4
    // matrices 0..3 are (rows 0-7, cols 0-7), (rows 8-15, cols 0-7), (rows 0-7, cols 8-15),
    // (rows 8-15, cols 8-15) of the k-step: registers a0..a3 in the order mma expects.
    uint32_t q_frag[D / 16][4];
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
        const int r = warp * ROWS_PER_WARP + lane % 8 + 8 * (lane / 8 % 2);
        ldmatrix_x4(q_frag[kk], k_tiles + BC * D + swz<D>(r, 2 * kk + lane / 16) * 8);
    }
    __syncthreads();  // every warp holds its Q_i before stage 1 is refilled with K_1

    float o_acc[D / 8][4];  // O_i, this warp's 16 × d slice as d/8 accumulator tiles of 16 × 8
#pragma unroll
    for (int n = 0; n < D / 8; ++n)
        for (int e = 0; e < 4; ++e) o_acc[n][e] = 0.0f;  // O_i = 0
    float m[2] = {-INFINITY, -INFINITY};  // m_i = −∞, rows g and g+8, in log2 units (× scale·log2 e)
    float l[2] = {0.0f, 0.0f};            // l_i = 0: this lane's share; the quad's sum at the end

    for (int j_tile = 0; j_tile < kv_tiles; ++j_tile) {
        const int j0 = j_tile * BC;  // first key of K_j
        const int stage = j_tile % 2;
        // Fetch K_j+1, V_j+1 into the other stage while this one is computed on. One group per
        // iteration, empty on the last, so "wait for all but the newest group" always means
        // "tile j has landed".
        if (j_tile + 1 < kv_tiles) {
            load_tile_async<T, D>(k_tiles + (1 - stage) * BC * D, k, j0 + BC, T_len, stride_t);
            load_tile_async<T, D>(v_tiles + (1 - stage) * BC * D, v, j0 + BC, T_len, stride_t);
        }
        cp_async_commit();
        cp_async_wait<1>();
        __syncthreads();  // ... and every other thread's part of tile j too
        const T* k_tile = k_tiles + stage * BC * D;
        const T* v_tile = v_tiles + stage * BC * D;

        // S_ij = Q_i K_jᵀ, 16 × B_c for this warp: B_c/8 accumulator tiles of 16 × 8. K_j is
        // stored (B_c, d), which is Kᵀ column-major: mma's B operand without a transpose.
        // ldmatrix.x4 gives two key tiles at once: matrices (keys 0-7, d 0-7), (keys 0-7, d 8-15)
        // = b0, b1 of key tile 2n; (keys 8-15, ...) = b0, b1 of key tile 2n+1.
        float s[BC / 8][4];
#pragma unroll
        for (int n = 0; n < BC / 8; ++n)
            for (int e = 0; e < 4; ++e) s[n][e] = 0.0f;
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
#pragma unroll
            for (int n = 0; n < BC / 16; ++n) {
                uint32_t kf[4];
                const int r = 16 * n + lane % 8 + 8 * (lane / 16);
                ldmatrix_x4(kf, k_tile + swz<D>(r, 2 * kk + lane / 8 % 2) * 8);
                mma_m16n8k16<T>(s[2 * n], q_frag[kk], kf);
                mma_m16n8k16<T>(s[2 * n + 1], q_frag[kk], kf + 2);
            }
        }

        // Mask only where it can apply: the diagonal tile (causal) and the ragged last tile.
        // Element e of tile n is key j0 + 8n + 2t + e%2 of row h = e/2.
        if ((causal && j_tile == i_tile) || j0 + BC > T_len) {
#pragma unroll
            for (int n = 0; n < BC / 8; ++n)
                for (int e = 0; e < 4; ++e) {
                    const int key = j0 + 8 * n + 2 * t + e % 2, row = row0 + 8 * (e / 2);
                    if (key >= T_len || (causal && key > row)) s[n][e] = -INFINITY;
                }
        }

        // Online softmax on the accumulators, per row h (log2 units: s·scale·log2 e).
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            float mx = -INFINITY;
#pragma unroll
            for (int n = 0; n < BC / 8; ++n) mx = fmaxf(mx, fmaxf(s[n][2 * hh], s[n][2 * hh + 1]));
            const float m_new = fmaxf(m[hh], quad_max(mx) * scale_log2);  // m_new = max(m, rowmax(S))
            const float alpha = exp2f(m[hh] - m_new);  // α = exp(m − m_new); 0 on the first tile
            float rowsum = 0.0f;
#pragma unroll
            for (int n = 0; n < BC / 8; ++n)
                for (int e = 2 * hh; e < 2 * hh + 2; ++e) {
                    s[n][e] = exp2f(fmaf(s[n][e], scale_log2, -m_new));  // P̃ = exp(S·scale − m_new)
                    rowsum += s[n][e];
                }
            l[hh] = alpha * l[hh] + rowsum;  // l = α·l + rowsum(P̃) (this lane's columns)
#pragma unroll
            for (int n = 0; n < D / 8; ++n) {  // O = diag(α)·O
                o_acc[n][2 * hh] *= alpha;
                o_acc[n][2 * hh + 1] *= alpha;
            }
            m[hh] = m_new;
        }

        // O_i += P̃_ij V_j. P̃'s accumulator tiles 2kk and 2kk+1 (keys 16kk .. 16kk+15), rounded
        // and packed, are the A fragment of k-step kk: a0 = row g of tile 2kk, a1 = row g+8 of
        // it, a2, a3 the same of tile 2kk+1. V_j is stored (B_c, d) row-major = B (k = key,
        // n = d) row-major, so ldmatrix.trans hands out its col-major fragments: matrices
        // (keys 0-7, d 0-7), (keys 8-15, d 0-7) = b0, b1 of d tile 2n; (.., d 8-15) of 2n+1.
#pragma unroll
        for (int kk = 0; kk < BC / 16; ++kk) {
            const uint32_t pa[4] = {pack2<T>(s[2 * kk][0], s[2 * kk][1]), pack2<T>(s[2 * kk][2], s[2 * kk][3]),
                                    pack2<T>(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                                    pack2<T>(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
            for (int n = 0; n < D / 16; ++n) {
                uint32_t vf[4];
                const int r = 16 * kk + lane % 8 + 8 * (lane / 8 % 2);
                ldmatrix_x4_trans(vf, v_tile + swz<D>(r, 2 * n + lane / 16) * 8);
                mma_m16n8k16<T>(o_acc[2 * n], pa, vf);
                mma_m16n8k16<T>(o_acc[2 * n + 1], pa, vf + 2);
            }
        }
        __syncthreads();  // every warp is done with this stage before the next iteration refills it
    }

    // O_i = diag(l)⁻¹ O_i, rows past T are padding. Each lane writes its two neighbouring columns
    // of every d tile as one 4-byte store.
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
        const int row = row0 + 8 * hh;
        const float inv_l = 1.0f / quad_sum(l[hh]);  // every lane of the quad, shuffles included
        if (row >= T_len) continue;
        T* out = o + (long long)row * o_stride_t + 2 * t;
#pragma unroll
        for (int n = 0; n < D / 8; ++n)
            *reinterpret_cast<uint32_t*>(out + 8 * n) = pack2<T>(o_acc[n][2 * hh] * inv_l, o_acc[n][2 * hh + 1] * inv_l);
    }
}

// Entry points, one per (dtype, d_head): flash_attn_v2_fwd_bf16_d64, ... Same arguments as v1's.
#define FLASH_ATTN_V2_ENTRY(T, TNAME, D)                                                                 \
    extern "C" __global__ void __launch_bounds__(THREADS, 3) flash_attn_v2_fwd_##TNAME##_d##D(              \
        const T* q, const T* k, const T* v, T* o, int T_len, long long stride_b, long long stride_t,     \
        long long stride_h, long long o_stride_b, long long o_stride_t, long long o_stride_h, float scale, \
        int causal) {                                                                                    \
        flash_attn_v2_fwd<T, D>(q, k, v, o, T_len, stride_b, stride_t, stride_h, o_stride_b, o_stride_t, \
                                o_stride_h, scale, causal);                                              \
    }

FLASH_ATTN_V2_ENTRY(__nv_bfloat16, bf16, 32)
FLASH_ATTN_V2_ENTRY(__nv_bfloat16, bf16, 64)
FLASH_ATTN_V2_ENTRY(__nv_bfloat16, bf16, 128)
FLASH_ATTN_V2_ENTRY(__half, f16, 32)
FLASH_ATTN_V2_ENTRY(__half, f16, 64)
FLASH_ATTN_V2_ENTRY(__half, f16, 128)
