// FlashAttention-2 backward pass on tensor cores: the CUDA twin of the CPU backward in
// src/attention/backward.rs (same algorithm, same notation), built from the forward v2's
// fragment machinery (flash_attn_v2.cu, included below, and ptx_warp.h: mma.sync m16n8k16,
// ldmatrix(.trans), cp.async, the swizzle and the tile loader).
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
// i ≥ j, the tiles that see key tile j), and adds its share of dQ_i into an f32 buffer with
// atomicAdd (other key tiles add theirs). Nothing of size T × T exists.
//
// How it maps onto the hardware, and why (the forward v2's header gives the fragment layouts):
//  1. Warp w owns key rows 16w .. 16w+15 of K_j for the whole walk, and computes the transposed
//     products: S_ijᵀ = K_j Q_iᵀ and dP_ijᵀ = V_j dO_iᵀ, 16 keys × B_r queries a warp. Then
//     P_ijᵀ and dS_ijᵀ sit in mma accumulators whose rows are this warp's keys, and two
//     neighbouring 16 × 8 tiles, rounded and packed, are the A fragment of dV_j += P_ijᵀ dO_i
//     and dK_j += dS_ijᵀ Q_i (as P̃ is of P̃ V in the forward): S, P, dP and dS never touch
//     shared memory on their way to dK and dV.
//  2. dK_j and dV_j (16 × d a warp, f32) stay in registers for the whole walk, 2·d/8·4
//     accumulators a thread (128 at d = 128), written to global memory once at the end.
//  3. Operands come from shared memory by ldmatrix.x4 (.trans where the stored tile is the
//     operand's transpose: Q_i and dO_i as the B of dK and dV, K_j as the B of dQ, dSᵀ as the A
//     of dQ), every tile XOR-swizzled (swz) so that no ldmatrix phase has a bank conflict.
//  4. Q_i, dO_i, L_i and D_i are double-buffered with cp.async: tile i+1 loads while tile i is
//     computed on, without passing through registers. K_j and V_j load once.
//  5. dQ_i = scale · dS_ij K_j needs every key column of dS, which four warps hold: each warp
//     stores its (16, B_r) slice of scale · dS_ijᵀ to shared memory (16-bit), and after a barrier
//     warp w computes query rows 16w .. 16w+15 of dQ_i against all of K_j, 16 columns of d at a
//     time, and adds them into the f32 buffer (ptx_warp.h's red_add_f32x2: two neighbouring
//     columns in one red.global.add.v2.f32 on sm_90, two atomicAdd before).
//  6. Padding: the ragged last tiles are zero-filled by cp.async (K, V, Q, dO, and L, D too). A
//     padded query row then has dO = 0 and D = 0, so dP = dS = 0 and it adds nothing; rows past
//     T are never written. A padded key scores 0, and its P = exp(0 − L_i) would overflow to +inf
//     for a row whose scores are all below about −88 (then dS · K = inf · 0 = NaN in dQ): padded
//     keys are masked. So the tiles with a mask are the causal diagonal one (B_r = B_c: a causal
//     block's first) and every tile of the block that holds the ragged last key tile.
// Shared memory per block: K_j, V_j, two stages of Q_i, dO_i, L_i, D_i, and dSᵀ: 33, 57, 105
// KiB at d = 32, 64, 128, so two blocks (8 warps) share an H100's SM at d = 128.
//
// Outputs dQ (accumulated), dK and dV are f32, (B, T, n_head, d_head) contiguous; the host casts
// them to the inputs' dtype. q, k, v and dO share one set of strides, as q, k and v do in the
// forward (the host passes four slices of one (B, T, 4, n_head, d_head) tensor), each row 16-byte
// aligned; L and D are (B, n_head, T) f32.
//
// Compiled like flash_attn_v2.cu (build.rs: one cubin per arch, -I kernels) and run on the CPU by
// host_emulation/attention_bwd_check.cpp (-I host_emulation, so <ptx_warp.h> is the emulation)
// against an f64 reference of L and all three gradients.

#include "flash_attn_v2.cu"

// Tile sizes: keep in step with src/attention_cuda.rs (its tests read these lines back).
constexpr int BR_BWD = 64;  // query rows per tile (B_r): 16 a warp for dQ
constexpr int BC_BWD = 64;  // key rows per block (B_c): 16 a warp for S, P, dP, dS, dK, dV
static_assert(BC_BWD == 16 * WARPS && BR_BWD == 16 * WARPS, "one 16-row mma tile of keys (and of dQ's queries) a warp");
static_assert(BR_BWD == BC_BWD, "causal: a block's first query tile is its diagonal one, and the only one it masks");
static_assert(THREADS == 2 * BR_BWD, "one thread per L_i and per D_i of a query tile");

// Dynamic shared memory per block, in bytes, for 16-bit inputs (the carve-up in flash_attn_bwd).
template <int D>
constexpr int bwd_smem_bytes() {
    return 2 * BC_BWD * D * 2         // K_j, V_j: 16-bit, the whole walk
           + 2 * 2 * BR_BWD * D * 2   // Q_i, dO_i: 16-bit, two stages
           + BC_BWD * BR_BWD * 2      // scale · dS_ijᵀ: 16-bit, dQ's operand
           + 2 * 2 * BR_BWD * 4;      // L_i, D_i: f32, two stages
}
static_assert(bwd_smem_bytes<32>() == 33792, "keep in step with bwd_shared_mem_bytes() in src/attention_cuda.rs");
static_assert(bwd_smem_bytes<64>() == 58368, "keep in step with bwd_shared_mem_bytes() in src/attention_cuda.rs");
static_assert(bwd_smem_bytes<128>() == 107520, "keep in step with bwd_shared_mem_bytes() in src/attention_cuda.rs");

// One thread block: key tile K_j of head (b, h). T is __nv_bfloat16 or __half; D = d_head.
template <typename T, int D>
__device__ __forceinline__ void flash_attn_bwd(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                                               const T* __restrict__ d_o, const float* __restrict__ lse,
                                               const float* __restrict__ delta, float* __restrict__ dq,
                                               float* __restrict__ dk, float* __restrict__ dv, int T_len,
                                               long long stride_b, long long stride_t, long long stride_h, float scale,
                                               int causal) {
    static_assert(D % 16 == 0 && D >= 32, "d_head: whole k-steps of 16, at least 4 chunks a row");
    constexpr int CHUNKS = D / 8;
    extern __shared__ __align__(128) unsigned char smem[];
    T* k_tile = reinterpret_cast<T*>(smem);     // [B_c × d] K_j, swizzled
    T* v_tile = k_tile + BC_BWD * D;            // [B_c × d] V_j, swizzled
    T* q_tiles = v_tile + BC_BWD * D;           // [2][B_r × d] Q_i, swizzled
    T* do_tiles = q_tiles + 2 * BR_BWD * D;     // [2][B_r × d] dO_i, swizzled
    T* ds_tile = do_tiles + 2 * BR_BWD * D;     // [B_c × B_r] scale · dS_ijᵀ, swizzled
    float* stat_tiles = reinterpret_cast<float*>(ds_tile + BC_BWD * BR_BWD);  // [2][L_i (B_r), D_i (B_r)]

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = lane / 4, t = lane % 4;  // fragment coordinates (ptx_warp.h)
    const int j_tile = blockIdx.x, j0 = j_tile * BC_BWD, h = blockIdx.y, b = blockIdx.z, H = gridDim.y;
    const long long head = b * stride_b + h * stride_h;  // row t of this head: head + t·stride_t
    const long long out_head = (long long)b * T_len * H * D + (long long)h * D, out_t = (long long)H * D;  // (B, T, H, D)
    const long long stats = ((long long)b * H + h) * T_len;  // row 0 of this head's L and D
    q += head;
    k += head;
    v += head;
    d_o += head;
    lse += stats;
    delta += stats;
    const float scale_log2 = scale * LOG2E;  // exp(x·scale − L) = exp2(x·scale·log2 e − L·log2 e)

    // This thread's share of every tile copy (load_tile_async, as in the forward).
    const int trow = threadIdx.x / CHUNKS, chunk = threadIdx.x % CHUNKS;
    const long long thread_off = (long long)trow * stride_t + chunk * 8;
    const long long row_step = (long long)(THREADS / CHUNKS) * stride_t;
    // Query tile i into stage `stage`: Q_i and dO_i, and thread x copies L of row x (x < B_r) or
    // D of row x − B_r. Rows at or past T are zero-filled (header, 6), their copies reading
    // nothing from `any_row`, a valid address. Per-thread pointers, so that a tile's copies are
    // these plus i0 rows.
    const T* q_thread = q + thread_off;
    const T* do_thread = d_o + thread_off;
    const T* any_row = q + chunk * 8;
    const int stat_row = threadIdx.x % BR_BWD;
    const float* stat_thread = (threadIdx.x < BR_BWD ? lse : delta) + stat_row;
    auto load_query_tile = [&](int i_tile, int stage) {
        const int i0 = i_tile * BR_BWD;
        const long long first = (long long)i0 * stride_t;
        load_tile_async<T, D, BR_BWD, true>(q_tiles + stage * BR_BWD * D, q_thread + first, row_step, T_len - i0 - trow, any_row);
        load_tile_async<T, D, BR_BWD, true>(do_tiles + stage * BR_BWD * D, do_thread + first, row_step, T_len - i0 - trow, any_row);
        const bool valid = i0 + stat_row < T_len;
        cp_async_4(stat_tiles + stage * 2 * BR_BWD + threadIdx.x, valid ? stat_thread + i0 : reinterpret_cast<const float*>(any_row),
                   valid);
    };

    // Causal: query tiles before the diagonal (i < j) see none of these keys.
    const int T_r = T_len / BR_BWD + (T_len % BR_BWD != 0);
    const int i_first = causal ? j_tile : 0;

    // Prologue: K_j, V_j and the first query tile into stage 0, as one cp.async group.
    load_tile_async<T, D, BC_BWD, true>(k_tile, k + (long long)j0 * stride_t + thread_off, row_step, T_len - j0 - trow,
                                        k + chunk * 8);
    load_tile_async<T, D, BC_BWD, true>(v_tile, v + (long long)j0 * stride_t + thread_off, row_step, T_len - j0 - trow,
                                        v + chunk * 8);
    load_query_tile(i_first, 0);
    cp_async_commit();

    float dk_acc[D / 8][4], dv_acc[D / 8][4];  // dK_j, dV_j: this warp's 16 keys × d, d/8 tiles of 16 × 8
#pragma unroll
    for (int n = 0; n < D / 8; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) dk_acc[n][e] = dv_acc[n][e] = 0.0f;  // dK_j = dV_j = 0

    // Per-lane ldmatrix row addresses, as in the forward (its comment at k_lane and v_lane):
    // `b_lane` reads a (rows = n, k) tile as B (the forward's K: here Q_i and dO_i for Sᵀ and
    // dPᵀ); `a_lane` reads a (rows = m, k) tile as A (the forward's Q: here K_j and V_j), and
    // with .trans a (k, n) tile as B (the forward's V: here Q_i, dO_i for dK, dV and K_j for dQ).
    // dSᵀ, stored (keys, queries), is dQ's A transposed: matrices (keys 0-7, queries 0-7),
    // (keys 0-7, queries 8-15), (keys 8-15, queries 0-7), (keys 8-15, queries 8-15) read with
    // .trans are a0..a3 — the rows and chunks b_lane walks, in a tile B_r wide.
    const int b_lane = swz<D>(lane % 8 + 8 * (lane / 16), lane / 8 % 2) * 8;
    const int a_lane = swz<D>(lane % 8 + 8 * (lane / 8 % 2), lane / 16) * 8;
    const int ds_lane = swz<BR_BWD>(lane % 8 + 8 * (lane / 16), lane / 8 % 2) * 8;
    auto frag = [](int lane_off, int c) { return (lane_off ^ (16 * (c % 4))) + 64 * (c / 4); };
    const T* k_warp = k_tile + 16 * warp * D;  // this warp's 16 keys
    const T* v_warp = v_tile + 16 * warp * D;

    // One query tile, visited `p`-th (stage p mod 2). MASK: P = 0 above the causal diagonal and
    // for padded keys (header, 6).
    auto query_tile = [&](int i_tile, int p, auto masked) {
        constexpr bool MASK = decltype(masked)::value;
        const int i0 = i_tile * BR_BWD, stage = p % 2;
        // Fetch the next query tile into the other stage while this one is computed on. One
        // group per tile, empty on the last, so "wait for all but the newest group" always means
        // "tile i has landed".
        if (i_tile + 1 < T_r) load_query_tile(i_tile + 1, 1 - stage);
        cp_async_commit();
        cp_async_wait<1>();
        __syncthreads();  // barrier 1: every thread's part of tile i (and, first time, of K_j, V_j) has landed
        const T* q_tile = q_tiles + stage * BR_BWD * D;
        const T* do_tile = do_tiles + stage * BR_BWD * D;
        const float* l_tile = stat_tiles + stage * 2 * BR_BWD;  // L_i
        const float* d_tile = l_tile + BR_BWD;                   // D_i

        // Element e of accumulator tile n below is key 16w + g + 8(e/2) of the block, query
        // 8n + 2t + e%2 of the tile.
        //
        // S_ijᵀ = K_j Q_iᵀ, this warp's 16 keys × B_r queries: K_j's rows are A (row-major),
        // Q_i stored (B_r, d) is Q_iᵀ column-major, mma's B without a transpose.
        float s[BR_BWD / 8][4];
#pragma unroll
        for (int n = 0; n < BR_BWD / 8; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) s[n][e] = 0.0f;
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
            uint32_t kf[4];
            ldmatrix_x4(kf, k_warp + frag(a_lane, kk));
#pragma unroll
            for (int n = 0; n < BR_BWD / 16; ++n) {
                uint32_t qf[4];
                ldmatrix_x4(qf, q_tile + frag(b_lane, kk) + 16 * n * D);
                mma_m16n8k16<T>(s[2 * n], kf, qf);
                mma_m16n8k16<T>(s[2 * n + 1], kf, qf + 2);
            }
        }

        // P_ijᵀ = exp(S_ijᵀ · scale − L_i), column by column (L_i is per query), in place. MASK:
        // 0 where key > query (causal) or key ≥ T; per row (hh) one bound on the column, relative
        // to this lane's first column, so each element is one compare against a constant 8n + e%2.
#pragma unroll
        for (int n = 0; n < BR_BWD / 8; ++n) {
            const float2 l2 = *reinterpret_cast<const float2*>(l_tile + 8 * n + 2 * t);
#pragma unroll
            for (int e = 0; e < 4; ++e) s[n][e] = exp2_ftz(fmaf(s[n][e], scale_log2, -(e % 2 ? l2.y : l2.x) * LOG2E));
        }
        if constexpr (MASK) {
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
                const int key = j0 + 16 * warp + g + 8 * hh;
                // Columns below `bound` are masked: all of them for a padded key, else those
                // before the key's own query.
                const int bound = key >= T_len ? BR_BWD : (causal ? key - i0 - 2 * t : 0);
#pragma unroll
                for (int n = 0; n < BR_BWD / 8; ++n)
#pragma unroll
                    for (int e = 2 * hh; e < 2 * hh + 2; ++e)
                        if (8 * n + e % 2 < bound) s[n][e] = 0.0f;
            }
        }

        // dV_j += P_ijᵀ dO_i: P's accumulator tiles 2kk and 2kk+1 (queries 16kk .. 16kk+15),
        // rounded and packed, are the A fragment of k-step kk; dO_i stored (B_r, d) is B (k =
        // query, n = d) row-major, so ldmatrix.trans hands out its fragments.
#pragma unroll
        for (int kk = 0; kk < BR_BWD / 16; ++kk) {
            const uint32_t pa[4] = {pack2<T>(s[2 * kk][0], s[2 * kk][1]), pack2<T>(s[2 * kk][2], s[2 * kk][3]),
                                    pack2<T>(s[2 * kk + 1][0], s[2 * kk + 1][1]), pack2<T>(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
            for (int n = 0; n < D / 16; ++n) {
                uint32_t of[4];
                ldmatrix_x4_trans(of, do_tile + frag(a_lane, n) + 16 * kk * D);
                mma_m16n8k16<T>(dv_acc[2 * n], pa, of);
                mma_m16n8k16<T>(dv_acc[2 * n + 1], pa, of + 2);
            }
        }

        // dP_ijᵀ = V_j dO_iᵀ as S_ijᵀ, then dS and dK, for half of the queries at a time (HALF
        // columns): P_ijᵀ and all of dP_ijᵀ at once would need more than the 255 registers a
        // thread has at d = 128 beside dK_j and dV_j (ptxas spills); the price is V_j's A
        // fragments read twice.
        constexpr int HALF = BR_BWD / 2;
        T* ds_warp = ds_tile + 16 * warp * BR_BWD;
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            float dp[HALF / 8][4];
#pragma unroll
            for (int n = 0; n < HALF / 8; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e) dp[n][e] = 0.0f;
#pragma unroll
            for (int kk = 0; kk < D / 16; ++kk) {
                uint32_t vf[4];
                ldmatrix_x4(vf, v_warp + frag(a_lane, kk));
#pragma unroll
                for (int n = 0; n < HALF / 16; ++n) {
                    uint32_t of[4];
                    ldmatrix_x4(of, do_tile + frag(b_lane, kk) + 16 * (n + half * HALF / 16) * D);
                    mma_m16n8k16<T>(dp[2 * n], vf, of);
                    mma_m16n8k16<T>(dp[2 * n + 1], vf, of + 2);
                }
            }

            // scale · dS_ijᵀ = scale · P_ijᵀ ∘ (dP_ijᵀ − D_i) (D_i per query: per column), in dP's place.
#pragma unroll
            for (int n = 0; n < HALF / 8; ++n) {
                const int col = 8 * (n + half * HALF / 8) + 2 * t;
                const float2 d2 = *reinterpret_cast<const float2*>(d_tile + col);
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    dp[n][e] = scale * s[n + half * HALF / 8][e] * (dp[n][e] - (e % 2 ? d2.y : d2.x));
            }

            // dK_j += (scale · dS_ijᵀ) Q_i, as dV; each packed A fragment also goes to shared
            // memory for dQ: its four registers are rows g and g+8, chunks 2kk and 2kk+1 of this
            // warp's slice of dSᵀ (one 4-byte store each; 8 rows × 4 lanes hit the 8 swizzled
            // chunk slots of a line once: no conflict).
#pragma unroll
            for (int k2 = 0; k2 < HALF / 16; ++k2) {
                const int kk = k2 + half * HALF / 16;  // k-step: queries 16kk .. 16kk+15
                const uint32_t dsa[4] = {pack2<T>(dp[2 * k2][0], dp[2 * k2][1]), pack2<T>(dp[2 * k2][2], dp[2 * k2][3]),
                                         pack2<T>(dp[2 * k2 + 1][0], dp[2 * k2 + 1][1]),
                                         pack2<T>(dp[2 * k2 + 1][2], dp[2 * k2 + 1][3])};
#pragma unroll
                for (int x = 0; x < 4; ++x)
                    *reinterpret_cast<uint32_t*>(ds_warp + swz<BR_BWD>(g + 8 * (x % 2), 2 * kk + x / 2) * 8 + 2 * t) = dsa[x];
#pragma unroll
                for (int n = 0; n < D / 16; ++n) {
                    uint32_t qf[4];
                    ldmatrix_x4_trans(qf, q_tile + frag(a_lane, n) + 16 * kk * D);
                    mma_m16n8k16<T>(dk_acc[2 * n], dsa, qf);
                    mma_m16n8k16<T>(dk_acc[2 * n + 1], dsa, qf + 2);
                }
            }
        }
        __syncthreads();  // barrier 2: dSᵀ is complete (every warp's keys); every warp is done
                          // reading Q_i and dO_i, so the next tile's copies may refill this stage

        // dQ_i += (scale · dS_ij) K_j for this warp's 16 query rows, 16 columns of d at a time,
        // added into the f32 buffer other key tiles add to. dS's A fragments (all B_c keys) are
        // read once; K_j stored (B_c, d) is B (k = key, n = d) row-major: ldmatrix.trans.
        uint32_t dsf[BC_BWD / 16][4];
#pragma unroll
        for (int kk = 0; kk < BC_BWD / 16; ++kk) ldmatrix_x4_trans(dsf[kk], ds_tile + frag(ds_lane, warp) + 16 * kk * BR_BWD);
        const int row = i0 + 16 * warp + g;  // query of this lane's accumulator row hh: row + 8hh
        float* dq_row = dq + out_head + (long long)row * out_t + 2 * t;
#pragma unroll
        for (int n = 0; n < D / 16; ++n) {
            float acc[2][4] = {};
#pragma unroll
            for (int kk = 0; kk < BC_BWD / 16; ++kk) {
                uint32_t kf[4];
                ldmatrix_x4_trans(kf, k_tile + frag(a_lane, n) + 16 * kk * D);
                mma_m16n8k16<T>(acc[0], dsf[kk], kf);
                mma_m16n8k16<T>(acc[1], dsf[kk], kf + 2);
            }
#pragma unroll
            for (int hh = 0; hh < 2; ++hh)
                if (row + 8 * hh < T_len)
#pragma unroll
                    for (int x = 0; x < 2; ++x) red_add_f32x2(dq_row + 8 * hh * out_t + 16 * n + 8 * x, acc[x][2 * hh], acc[x][2 * hh + 1]);
        }
    };
    // The tiles that need a mask come first, in a loop of their own (header, 6); the rest, nearly
    // all, carry no masking code.
    const int masked_tiles = j0 + BC_BWD > T_len ? T_r - i_first : causal;
    int i_tile = i_first;
    for (; i_tile < i_first + masked_tiles; ++i_tile) query_tile(i_tile, i_tile - i_first, Masked<true>{});
    for (; i_tile < T_r; ++i_tile) query_tile(i_tile, i_tile - i_first, Masked<false>{});

    // dK_j and dV_j, from the registers: each lane writes its two neighbouring columns of every
    // d tile as one 8-byte store; keys past T are padding.
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
        const int j = j0 + 16 * warp + g + 8 * hh;
        if (j >= T_len) continue;
        float* dk_row = dk + out_head + (long long)j * out_t + 2 * t;
        float* dv_row = dv + out_head + (long long)j * out_t + 2 * t;
#pragma unroll
        for (int n = 0; n < D / 8; ++n) {
            *reinterpret_cast<float2*>(dk_row + 8 * n) = make_float2(dk_acc[n][2 * hh], dk_acc[n][2 * hh + 1]);
            *reinterpret_cast<float2*>(dv_row + 8 * n) = make_float2(dv_acc[n][2 * hh], dv_acc[n][2 * hh + 1]);
        }
    }
}

// Entry points, one per (dtype, d_head): flash_attn_bwd_bf16_d64, flash_attn_bwd_f16_d128, ...
#define FLASH_ATTN_BWD_ENTRY(T, TNAME, D)                                                                           \
    extern "C" __global__ void __launch_bounds__(THREADS, 2) flash_attn_bwd_##TNAME##_d##D(                         \
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
