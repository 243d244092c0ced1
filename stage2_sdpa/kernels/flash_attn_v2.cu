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
//  4. Shared memory holds Q_i, and K_j and V_j twice (double buffering): the next tile is
//     fetched with cp.async while this one is computed on; no thread stages data in registers.
//  5. An XOR swizzle of the 16-byte chunks of every shared row, so that each ldmatrix phase
//     (8 rows × 16 bytes) hits all 32 banks once: no bank conflicts (argued at `swz` below;
//     the host emulation counts conflicts and requires zero).
//  6. exp2 with log2(e) folded into the scale, as `ex2.approx.ftz` (ptx_warp.h's exp2_ftz): one
//     FFMA and one MUFU.EX2 per score. Plain exp2f adds a subnormal fix-up (FSETP + two FMUL).
//  7. FlashAttention-2's work split: B_r = 128 query rows per block, 32 per warp (two 16-row
//     mma tiles), so each K_j and V_j fragment a warp reads from shared memory feeds two mma —
//     0.31 ldmatrix per mma where 16 rows a warp needed 0.5. Q_i stays in shared memory and is
//     read per k-step (in registers it would take 64 of the 255 a thread has). B_c = 32 keeps S
//     (32 × 32) and O (32 × d) within 255 registers at d = 128 without spills.
//  8. A tile loader with compile-time trip counts: each thread copies the same chunk of the same
//     rows of every tile, so its addresses are fixed offsets, computed once.
//  9. Key tiles are visited last first: the ones that need a mask (the diagonal's, the ragged
//     last one) run in a loop of their own, and the rest, nearly all, carry no masking code.
// 10. The grid is (n_head, B, query tiles), handed out x fastest: with causal masking every
//     head's heaviest query tile starts before any lighter one.
// Shared memory per block: 16, 32, 64 KiB at d = 32, 64, 128 (v1: 40, 56, 88); at d = 128 the
// 241 registers a thread takes (ptxas -v) allow two blocks on an SM, 8 warps.
//
// Thread layout: THREADS = 128 = 4 warps; warp w owns query rows 32w .. 32w+31 of Q_i: its S
// rows, P rows, O rows, m and l, for the whole kernel. Per lane: rows g, g+8, g+16 and g+24 of
// that slice (index (mt, hh) below: row 16mt + 8hh + g), 2 of every 8 columns.
//
// Layout of q, k, v, o, strides, 16-byte alignment: exactly as v1 (see its header), so the host
// side calls either kernel with the same arguments. Built to a cubin by build.rs (-I kernels, so
// <ptx_warp.h> is the inline-PTX one); run on the CPU by host_emulation/attention_v2_check.cpp
// (-I host_emulation, so <ptx_warp.h> is the emulation), against an f64 reference.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <ptx_warp.h>

// Tile sizes: keep in step with src/attention_cuda.rs (its tests read these lines back).
constexpr int BR = 128;              // query rows per block (B_r)
constexpr int BC = 32;               // key/value rows per tile (B_c)
constexpr int WARPS = 4;             // warps per block
constexpr int THREADS = WARPS * 32;  // 128
constexpr int ROWS_PER_WARP = BR / WARPS;      // 32: two m16n8k16 tiles tall
constexpr int M_TILES = ROWS_PER_WARP / 16;    // 2
constexpr float LOG2E = 1.4426950408889634f;
constexpr float LN2 = 0.6931471805599453f;  // L = m·ln 2 + ln l for m in log2 units

static_assert(ROWS_PER_WARP == 32, "each warp owns two mma tiles' rows, and every K_j, V_j fragment feeds both");
// Causal: the key tiles that can hold a key past some row of Q_i are those from i·B_r/B_c on.
static_assert(BR % BC == 0, "a query tile starts at a key tile's start");

// Dynamic shared memory per block: Q_i once, K_j and V_j two stages each, all 16-bit.
template <int D>
constexpr int smem_bytes_v2() {
    return (BR + 2 * 2 * BC) * D * 2;
}
static_assert(smem_bytes_v2<32>() == 16384, "keep in step with shared_mem_bytes_v2() in src/attention_cuda.rs");
static_assert(smem_bytes_v2<64>() == 32768, "keep in step with shared_mem_bytes_v2() in src/attention_cuda.rs");
static_assert(smem_bytes_v2<128>() == 65536, "keep in step with shared_mem_bytes_v2() in src/attention_cuda.rs");

// Where 16-byte chunk `chunk` (values 8·chunk .. 8·chunk+7) of tile row `row` lives, in chunks
// from the tile's start: the row's chunks XOR-permuted by the row number.
//
// Why this is conflict-free: shared memory has 32 banks of 4 bytes, so a 128-byte line is one
// pass over every bank and chunk q covers banks 4(q mod 8) .. 4(q mod 8)+3. One ldmatrix phase
// (one of its four 8 × 8 matrices) reads 8 consecutive rows r0 .. r0+7 (r0 a multiple of 8)
// at one logical chunk c. Unswizzled, with D/8 chunks per row, d = 64 or 128 puts every one of
// those rows at the same q mod 8: an 8-way conflict (v1's loads had 6.7-way). Swizzled:
//  - d ≥ 64 (8 or 16 chunks a row, a multiple of 8): q mod 8 = c XOR (row mod 8), which takes
//    8 different values over the 8 rows — every bank once, one wavefront. Only the low three
//    bits of c are permuted, so chunk c and c + 8 stay 128 bytes apart: ldmatrix addresses of
//    k-steps kk and kk + 4 differ by a constant the instruction carries as an immediate.
//  - d = 32 (4 chunks a row): q mod 8 = 4·(row mod 2) + (c XOR ((row / 2) mod 4)), and
//    (row mod 2, (row / 2) mod 4) takes 8 different values over the 8 rows — again one pass.
// The cp.async stores are conflict-free by the same sums: 8 consecutive threads write 8
// consecutive logical chunks of one row (two rows at d = 32).
template <int D>
__device__ __forceinline__ int swz(int row, int chunk) {
    constexpr int CHUNKS = D / 8;
    if constexpr (CHUNKS >= 8) return row * CHUNKS + (chunk & ~7) + ((chunk & 7) ^ (row % 8));
    else return row * CHUNKS + (chunk ^ ((row / 2) % 4));
}

// Start fetching a (ROWS, D) tile of one head into swizzled shared memory with cp.async, 16
// bytes per instruction. Thread x always copies chunk x mod D/8 of rows x / (D/8) + n·ROW_STEP
// (n = 0 .. ROWS/ROW_STEP − 1, a compile-time trip count): consecutive threads read consecutive
// chunks of a row (coalesced), and every address is this thread's first one plus a constant
// (shared memory) or plus n row steps (global), so the loop is cp.async and two adds per step —
// no division, no 64-bit multiply. `src` is this thread's chunk of the tile's first row for it;
// `step` = ROW_STEP · stride_t.
// CHECK_ROWS: rows at or past T (`rows_left` = T − that first row) are zero-filled and not read
// (src-size 0, address `any_row`, a valid one): a padded key scores 0 (and is masked), a padded
// value adds 0·0, a padded query stays finite. Only the first tiles a block loads can be ragged.
template <typename T, int D, int ROWS, bool CHECK_ROWS>
__device__ __forceinline__ void load_tile_async(T* dst, const T* src, long long step, int rows_left, const T* any_row) {
    constexpr int CHUNKS = D / 8, ROW_STEP = THREADS / CHUNKS;
    static_assert(THREADS % CHUNKS == 0 && ROWS % ROW_STEP == 0 && ROW_STEP % 8 == 0,
                  "whole steps; a step keeps every row's swizzle (row mod 8)");
    dst += swz<D>(threadIdx.x / CHUNKS, threadIdx.x % CHUNKS) * 8;
#pragma unroll
    for (int n = 0; n < ROWS / ROW_STEP; ++n) {
        const bool valid = !CHECK_ROWS || n * ROW_STEP < rows_left;
        cp_async_16(dst + n * ROW_STEP * D, valid ? src : any_row, valid);
        src += step;
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

// Compile-time arguments for the lambdas below.
template <bool B>
struct Masked {
    static constexpr bool value = B;
};
template <int N>
struct Int {
    static constexpr int value = N;
};

// One thread block: query tile Q_i of head (b, h). T is __nv_bfloat16 or __half; D = d_head.
template <typename T, int D>
__device__ __forceinline__ void flash_attn_v2_fwd(const T* __restrict__ q, const T* __restrict__ k,
                                                  const T* __restrict__ v, T* __restrict__ o, int T_len,
                                                  long long stride_b, long long stride_t, long long stride_h,
                                                  long long o_stride_b, long long o_stride_t, long long o_stride_h,
                                                  float scale, int causal, float* __restrict__ lse) {
    static_assert(D % 16 == 0 && D >= 32, "d_head: whole k-steps of 16, at least 4 chunks a row");
    constexpr int CHUNKS = D / 8;
    extern __shared__ __align__(128) unsigned char smem[];
    T* q_tile = reinterpret_cast<T*>(smem);  // [B_r × d] Q_i, swizzled
    T* k_tiles = q_tile + BR * D;            // [2][B_c × d] K_j, swizzled
    T* v_tiles = k_tiles + 2 * BC * D;       // [2][B_c × d] V_j, swizzled

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = lane / 4, t = lane % 4;  // fragment coordinates (ptx_warp.h)
    // Grid (n_head, B, T_r), handed out x fastest: every head's heaviest query tile goes out
    // before any head's next one. Causal: later query tiles see more keys, so they come first.
    const int h = blockIdx.x, b = blockIdx.y;
    const int i_tile = causal ? gridDim.z - 1 - blockIdx.z : blockIdx.z;
    const int i0 = i_tile * BR;
    const long long head = b * stride_b + h * stride_h;  // row t of this head: head + t·stride_t
    q += head;
    k += head;
    v += head;
    o += b * o_stride_b + h * o_stride_h;
    const int row0 = i0 + warp * ROWS_PER_WARP + g;  // query position of this lane's row (mt, hh) = (0, 0); + 16mt + 8hh
    const float scale_log2 = scale * LOG2E;           // exp(x·scale) = exp2(x·scale·log2 e)

    // T_c key/value tiles; causal: tiles after the diagonal are skipped. Tiles are visited last
    // first, so the ones that need a mask — the ragged last tile, and with causal the tiles from
    // i·B_r/B_c on, which hold keys past some row of Q_i — come first, in a loop of their own,
    // and the rest run without any masking code.
    const int T_c = T_len / BC + (T_len % BC != 0);
    const int kv_tiles = causal ? min((i0 + BR) / BC, T_c) : T_c;
    const int masked_tiles = causal ? kv_tiles - i0 / BC : (T_len % BC != 0);

    // This thread's share of every tile copy (load_tile_async): chunk `chunk` of row `trow`, at
    // `thread_off` elements from a tile's first row (q, k and v have the same strides).
    const int trow = threadIdx.x / CHUNKS, chunk = threadIdx.x % CHUNKS;
    const long long thread_off = (long long)trow * stride_t + chunk * 8;
    const long long row_step = (long long)(THREADS / CHUNKS) * stride_t;
    const int j_last = (kv_tiles - 1) * BC;  // first key of the first tile visited

    // Prologue: Q_i, and the last K_j, V_j into stage 0, as one cp.async group.
    load_tile_async<T, D, BR, true>(q_tile, q + (long long)i0 * stride_t + thread_off, row_step, T_len - i0 - trow,
                                    q + chunk * 8);
    load_tile_async<T, D, BC, true>(k_tiles, k + (long long)j_last * stride_t + thread_off, row_step,
                                    T_len - j_last - trow, k + chunk * 8);
    load_tile_async<T, D, BC, true>(v_tiles, v + (long long)j_last * stride_t + thread_off, row_step,
                                    T_len - j_last - trow, v + chunk * 8);
    cp_async_commit();

    float o_acc[M_TILES][D / 8][4];  // O_i, this warp's 32 × d slice: two 16-row halves of d/8 tiles of 16 × 8
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
        for (int n = 0; n < D / 8; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) o_acc[mt][n][e] = 0.0f;  // O_i = 0
    // m_i = −∞ and l_i = 0 for this lane's rows (mt, hh); m in log2 units (× scale·log2 e), l
    // this lane's share of the row's sum (the quad's sum at the end).
    float m[M_TILES][2], l[M_TILES][2];
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt)
        for (int hh = 0; hh < 2; ++hh) m[mt][hh] = -INFINITY, l[mt][hh] = 0.0f;

    // Per-lane ldmatrix row addresses (ptx_warp.h: lane 8m + r gives row r of matrix m). Q:
    // matrices (rows 0-7, k 0-7), (rows 8-15, k 0-7), (rows 0-7, k 8-15), (rows 8-15, k 8-15)
    // = a0..a3. K: (keys 0-7, k 0-7), (keys 0-7, k 8-15), (keys 8-15, ..) = b0, b1 of two key
    // tiles. V (.trans): (keys 0-7, d 0-7), (keys 8-15, d 0-7), (.., d 8-15) = b0, b1 of two d
    // tiles. Q's rows are V's shifted by this warp's 32. A lane reads row R + 16i, chunk
    // 2c + half (k-step or d tile c), at element swz(R + 16i, 2c + half)·8, which is
    //   (lane_off XOR 16·(c mod 4)) + 64·(c / 4) + 16·i·d,   lane_off = swz(R, half)·8:
    // 16 rows keep the swizzle, 8 chunks are 128 bytes on, and the low chunk bits are XORed,
    // never carried (swz). One offset per operand; the rest are constants in the instruction.
    const int k_lane = swz<D>(lane % 8 + 8 * (lane / 16), lane / 8 % 2) * 8;
    const int v_lane = swz<D>(lane % 8 + 8 * (lane / 8 % 2), lane / 16) * 8;
    auto frag = [](int lane_off, int c) { return (lane_off ^ (16 * (c % 4))) + 64 * (c / 4); };
    const T* q_warp = q_tile + warp * ROWS_PER_WARP * D;

    // One key/value tile, visited `p`-th (tile j = kv_tiles − 1 − p, stage p mod 2).
    auto kv_tile = [&](int p, auto masked) {
        constexpr bool MASK = decltype(masked)::value;
        const int j_tile = kv_tiles - 1 - p, j0 = j_tile * BC, stage = p % 2;
        // Fetch the next tile (j − 1, always whole) into the other stage while this one is
        // computed on. One group per tile, empty on the last, so "wait for all but the newest
        // group" always means "tile j has landed".
        if (j_tile > 0) {
            const long long next = (long long)(j0 - BC) * stride_t + thread_off;
            load_tile_async<T, D, BC, false>(k_tiles + (1 - stage) * BC * D, k + next, row_step, 0, k);
            load_tile_async<T, D, BC, false>(v_tiles + (1 - stage) * BC * D, v + next, row_step, 0, v);
        }
        cp_async_commit();
        cp_async_wait<1>();
        __syncthreads();  // barrier 1: every thread's part of tile j (and, first time, of Q_i) has landed
        const T* k_tile = k_tiles + stage * BC * D;
        const T* v_tile = v_tiles + stage * BC * D;

        // Causal: a warp whose 32 rows all come before K_j's first key has nothing to add.
        if (!MASK || !causal || j0 <= i0 + warp * ROWS_PER_WARP + ROWS_PER_WARP - 1) {
            // Rows 16·FIRST .. 16·(FIRST + COUNT) − 1 of this warp's 32.
            auto halves = [&](auto first, auto count) {
                constexpr int FIRST = decltype(first)::value, COUNT = decltype(count)::value;
                // S_ij = Q_i K_jᵀ, 32 × B_c for this warp: per 16-row half, B_c/8 accumulator tiles of
                // 16 × 8. K_j is stored (B_c, d), which is Kᵀ column-major: mma's B operand without a
                // transpose. Each K fragment feeds both halves.
                float s[COUNT][BC / 8][4];
    #pragma unroll
                for (int mt = FIRST; mt < FIRST + COUNT; ++mt)
    #pragma unroll
                    for (int n = 0; n < BC / 8; ++n)
    #pragma unroll
                        for (int e = 0; e < 4; ++e) s[mt - FIRST][n][e] = 0.0f;
    #pragma unroll
                for (int kk = 0; kk < D / 16; ++kk) {
                    uint32_t qf[COUNT][4];
    #pragma unroll
                    for (int mt = FIRST; mt < FIRST + COUNT; ++mt) ldmatrix_x4(qf[mt - FIRST], q_warp + frag(v_lane, kk) + 16 * mt * D);
    #pragma unroll
                    for (int n = 0; n < BC / 16; ++n) {
                        uint32_t kf[4];
                        ldmatrix_x4(kf, k_tile + frag(k_lane, kk) + 16 * n * D);
    #pragma unroll
                        for (int mt = FIRST; mt < FIRST + COUNT; ++mt) {
                            mma_m16n8k16<T>(s[mt - FIRST][2 * n], qf[mt - FIRST], kf);
                            mma_m16n8k16<T>(s[mt - FIRST][2 * n + 1], qf[mt - FIRST], kf + 2);
                        }
                    }
                }

                // Element e of tile (mt, n) is key j0 + 8n + 2t + e%2 of row row0 + 16mt + 8(e/2); the
                // row sees keys below min(T, row + 1) (causal) or T. Per row one bound, relative to
                // this lane's first key, so each element is one compare against a constant 8n + e%2.
                if constexpr (MASK) {
    #pragma unroll
                    for (int mt = FIRST; mt < FIRST + COUNT; ++mt)
    #pragma unroll
                        for (int hh = 0; hh < 2; ++hh) {
                            const int row = row0 + 16 * mt + 8 * hh;
                            const int bound = (causal ? min(T_len, row + 1) : T_len) - j0 - 2 * t;
    #pragma unroll
                            for (int n = 0; n < BC / 8; ++n)
    #pragma unroll
                                for (int e = 2 * hh; e < 2 * hh + 2; ++e)
                                    if (8 * n + e % 2 >= bound) s[mt - FIRST][n][e] = -INFINITY;
                        }
                }

                // Online softmax on the accumulators, per row (mt, hh) (log2 units: s·scale·log2 e).
    #pragma unroll
                for (int mt = FIRST; mt < FIRST + COUNT; ++mt)
    #pragma unroll
                    for (int hh = 0; hh < 2; ++hh) {
                        float mx = -INFINITY;
    #pragma unroll
                        for (int n = 0; n < BC / 8; ++n) mx = fmaxf(mx, fmaxf(s[mt - FIRST][n][2 * hh], s[mt - FIRST][n][2 * hh + 1]));
                        float m_new = fmaxf(m[mt][hh], quad_max(mx) * scale_log2);  // m_new = max(m, rowmax(S))
                        // A masked tile visited first can hide every key from a row: m_new = −∞ then,
                        // and exp2(−∞ − (−∞)) would be NaN. Subtracting 0 instead gives α = 0 and P̃ = 0.
                        // Unmasked tiles come after a tile in which every row saw a key.
                        if constexpr (MASK) m_new = m_new == -INFINITY ? 0.0f : m_new;
                        const float alpha = exp2_ftz(m[mt][hh] - m_new);  // α = exp(m − m_new); 0 on the first tile
                        float rowsum = 0.0f;
    #pragma unroll
                        for (int n = 0; n < BC / 8; ++n)
    #pragma unroll
                            for (int e = 2 * hh; e < 2 * hh + 2; ++e) {
                                s[mt - FIRST][n][e] = exp2_ftz(fmaf(s[mt - FIRST][n][e], scale_log2, -m_new));  // P̃ = exp(S·scale − m_new)
                                rowsum += s[mt - FIRST][n][e];
                            }
                        l[mt][hh] = alpha * l[mt][hh] + rowsum;  // l = α·l + rowsum(P̃) (this lane's columns)
    #pragma unroll
                        for (int n = 0; n < D / 8; ++n) {  // O = diag(α)·O
                            o_acc[mt][n][2 * hh] *= alpha;
                            o_acc[mt][n][2 * hh + 1] *= alpha;
                        }
                        m[mt][hh] = m_new;
                    }

                // O_i += P̃_ij V_j. P̃'s accumulator tiles 2kk and 2kk+1 (keys 16kk .. 16kk+15),
                // rounded and packed, are the A fragment of k-step kk: a0 = row g of tile 2kk, a1 =
                // row g+8 of it, a2, a3 the same of tile 2kk+1. V_j is stored (B_c, d) row-major = B
                // (k = key, n = d) row-major, so ldmatrix.trans hands out its col-major fragments.
                // Each V fragment feeds both halves.
    #pragma unroll
                for (int kk = 0; kk < BC / 16; ++kk) {
                    uint32_t pa[COUNT][4];
    #pragma unroll
                    for (int mt = FIRST; mt < FIRST + COUNT; ++mt) {
                        pa[mt - FIRST][0] = pack2<T>(s[mt - FIRST][2 * kk][0], s[mt - FIRST][2 * kk][1]);
                        pa[mt - FIRST][1] = pack2<T>(s[mt - FIRST][2 * kk][2], s[mt - FIRST][2 * kk][3]);
                        pa[mt - FIRST][2] = pack2<T>(s[mt - FIRST][2 * kk + 1][0], s[mt - FIRST][2 * kk + 1][1]);
                        pa[mt - FIRST][3] = pack2<T>(s[mt - FIRST][2 * kk + 1][2], s[mt - FIRST][2 * kk + 1][3]);
                    }
    #pragma unroll
                    for (int n = 0; n < D / 16; ++n) {
                        uint32_t vf[4];
                        ldmatrix_x4_trans(vf, v_tile + frag(v_lane, n) + 16 * kk * D);
    #pragma unroll
                        for (int mt = FIRST; mt < FIRST + COUNT; ++mt) {
                            mma_m16n8k16<T>(o_acc[mt][2 * n], pa[mt - FIRST], vf);
                            mma_m16n8k16<T>(o_acc[mt][2 * n + 1], pa[mt - FIRST], vf + 2);
                        }
                    }
                }
            };
            // Unmasked tiles compute both halves at once, so every K and V fragment feeds two
            // mma. Masked tiles take one half at a time: the mask's bounds and selects would
            // otherwise need more than the 255 registers a thread has (ptxas spills), and they
            // are at most two of a row's tiles.
            if constexpr (MASK) {
                halves(Int<0>{}, Int<1>{});
                halves(Int<1>{}, Int<1>{});
            } else {
                halves(Int<0>{}, Int<M_TILES>{});
            }
        }
        __syncthreads();  // barrier 2: every warp is done with this stage before the next tile refills it
    };
    int p = 0;
    for (; p < masked_tiles; ++p) kv_tile(p, Masked<true>{});
    for (; p < kv_tiles; ++p) kv_tile(p, Masked<false>{});

    // O_i = diag(l)⁻¹ O_i, rows past T are padding. Each lane writes its two neighbouring columns
    // of every d tile as one 4-byte store.
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            const int row = row0 + 16 * mt + 8 * hh;
            const float l_row = quad_sum(l[mt][hh]);  // every lane of the quad, shuffles included
            const float inv_l = 1.0f / l_row;
            if (row >= T_len) continue;
            // Training: L = m·ln 2 + ln l (m is in log2 units) into lse (B, n_head, T), one lane a quad.
            if (lse != nullptr && t == 0) lse[((long long)b * gridDim.x + h) * T_len + row] = m[mt][hh] * LN2 + logf(l_row);
            T* out = o + (long long)row * o_stride_t + 2 * t;
#pragma unroll
            for (int n = 0; n < D / 8; ++n)
                *reinterpret_cast<uint32_t*>(out + 8 * n) =
                    pack2<T>(o_acc[mt][n][2 * hh] * inv_l, o_acc[mt][n][2 * hh + 1] * inv_l);
        }
}

// Entry points, one per (dtype, d_head): flash_attn_v2_fwd_bf16_d64, ... Same arguments as v1's.
#define FLASH_ATTN_V2_ENTRY(T, TNAME, D)                                                                 \
    extern "C" __global__ void __launch_bounds__(THREADS, 2) flash_attn_v2_fwd_##TNAME##_d##D(              \
        const T* q, const T* k, const T* v, T* o, int T_len, long long stride_b, long long stride_t,     \
        long long stride_h, long long o_stride_b, long long o_stride_t, long long o_stride_h, float scale, \
        int causal, float* lse) {                                                                        \
        flash_attn_v2_fwd<T, D>(q, k, v, o, T_len, stride_b, stride_t, stride_h, o_stride_b, o_stride_t, \
                                o_stride_h, scale, causal, lse);                                         \
    }

FLASH_ATTN_V2_ENTRY(__nv_bfloat16, bf16, 32)
FLASH_ATTN_V2_ENTRY(__nv_bfloat16, bf16, 64)
FLASH_ATTN_V2_ENTRY(__nv_bfloat16, bf16, 128)
FLASH_ATTN_V2_ENTRY(__half, f16, 32)
FLASH_ATTN_V2_ENTRY(__half, f16, 64)
FLASH_ATTN_V2_ENTRY(__half, f16, 128)
