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
//  1. dK_j and dV_j stay in registers for the whole walk, written to global memory once at the
//     end. FlashAttention-2's split of them over the warps: warp w holds keys 32·kh .. 32·kh+31
//     (kh = w / 2) × columns DH·dh .. DH·dh+DH−1 of d (dh = w % 2, DH = d/2), f32, 128
//     accumulators a thread at d = 128 — the same count as 16 keys × all of d, but each operand
//     fragment of dV and dK now feeds twice the mma (2 key tiles of 16 × DH/8 column tiles).
//  2. S and dP are computed transposed, S_ijᵀ = K_j Q_iᵀ and dP_ijᵀ = V_j dO_iᵀ, warp w taking
//     its 32 keys × queries 32·qh .. 32·qh+31 (qh = w % 2) of the tile: each K_j, V_j fragment
//     feeds 4 mma, each Q_i, dO_i fragment 4. P_ijᵀ = exp(S_ijᵀ·scale − L_i) and dS_ijᵀ sit in
//     accumulators whose rows are keys; rounded to 16 bits they go to shared memory (Pᵀ, dSᵀ,
//     (B_c, B_r) tiles), where after a barrier both warps of a key half read all B_r queries of
//     their 32 keys as the A operand of dV_j += P_ijᵀ dO_i and dK_j += dS_ijᵀ Q_i.
//     dS_ij = P_ij ∘ (dP_ij − D_i) uses P as rounded to 16 bits (the operand dV uses too):
//     P in f32 beside dP, dK and dV needs more than the 255 registers a thread has (ptxas
//     spills). It adds about one rounding of P (2⁻⁹ relative at bf16) to dS before dS itself is
//     rounded; FlashAttention-2 keeps P in f32.
//  3. Operands come from shared memory by ldmatrix.x4 (.trans where the stored tile is the
//     operand's transpose: Q_i and dO_i as the B of dK and dV, K_j as the B of dQ, dSᵀ as the A
//     of dQ), every tile XOR-swizzled (swz) so that no ldmatrix phase has a bank conflict.
//  4. Q_i, dO_i, L_i and D_i are double-buffered with cp.async: tile i+1 loads while tile i is
//     computed on, without passing through registers. K_j and V_j load once.
//  5. dQ_i = scale · dS_ij K_j: warp w computes query rows 16w .. 16w+15 of dQ_i from dSᵀ in
//     shared memory against all of K_j, 16 columns of d at a time, and adds them into the f32
//     buffer (ptx_warp.h's red_add_f32x2: two neighbouring columns in one
//     red.global.add.v2.f32 on sm_90, two atomicAdd before).
//  6. Padding: the ragged last tiles are zero-filled by cp.async (K, V, Q, dO, and L, D too). A
//     padded query row then has dO = 0 and D = 0, so dP = dS = 0 and it adds nothing; rows past
//     T are never written. A padded key scores 0, and its P = exp(0 − L_i) would overflow to +inf
//     for a row whose scores are all below about −88 (then dS · K = inf · 0 = NaN in dQ): padded
//     keys are masked. So the tiles with a mask are the causal diagonal one (B_r = B_c: a causal
//     block's first) and every tile of the block that holds the ragged last key tile.
// Shared memory per block: K_j, V_j, two stages of Q_i, dO_i, L_i, D_i, and Pᵀ, dSᵀ: 41, 65, 113
// KiB at d = 32, 64, 128, so two blocks (8 warps) share an H100's SM at d = 128 (2 × 114 KiB
// with the driver's reserve: all of its 228).
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
constexpr int BC_BWD = 64;  // key rows per block (B_c): 32 for each pair of warps
static_assert(WARPS == 4 && BC_BWD == 64 && BR_BWD == 64, "warps 2 (keys) × 2 (queries, d) of 32 × 32 tiles; 16 dQ rows a warp");
static_assert(BR_BWD == BC_BWD, "causal: a block's first query tile is its diagonal one, and the only one it masks");
static_assert(THREADS == 2 * BR_BWD, "one thread per L_i and per D_i of a query tile");

// Dynamic shared memory per block, in bytes, for 16-bit inputs (the carve-up in flash_attn_bwd).
template <int D>
constexpr int bwd_smem_bytes() {
    return 2 * BC_BWD * D * 2         // K_j, V_j: 16-bit, the whole walk
           + 2 * 2 * BR_BWD * D * 2   // Q_i, dO_i: 16-bit, two stages
           + 2 * BC_BWD * BR_BWD * 2  // P_ijᵀ and scale · dS_ijᵀ: 16-bit, operands of dV, dK and dQ
           + 2 * 2 * BR_BWD * 4;      // L_i, D_i: f32, two stages
}
static_assert(bwd_smem_bytes<32>() == 41984, "keep in step with bwd_shared_mem_bytes() in src/attention_cuda.rs");
static_assert(bwd_smem_bytes<64>() == 66560, "keep in step with bwd_shared_mem_bytes() in src/attention_cuda.rs");
static_assert(bwd_smem_bytes<128>() == 115712, "keep in step with bwd_shared_mem_bytes() in src/attention_cuda.rs");

// One thread block: key tile K_j of head (b, h). T is __nv_bfloat16 or __half; D = d_head.
template <typename T, int D>
__device__ __forceinline__ void flash_attn_bwd(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                                               const T* __restrict__ d_o, const float* __restrict__ lse,
                                               const float* __restrict__ delta, float* __restrict__ dq,
                                               float* __restrict__ dk, float* __restrict__ dv, int T_len,
                                               long long stride_b, long long stride_t, long long stride_h, float scale,
                                               int causal) {
    static_assert(D % 32 == 0, "d_head: two halves of whole 16-column steps, at least 4 chunks a row");
    constexpr int CHUNKS = D / 8;
    extern __shared__ __align__(128) unsigned char smem[];
    T* k_tile = reinterpret_cast<T*>(smem);     // [B_c × d] K_j, swizzled
    T* v_tile = k_tile + BC_BWD * D;            // [B_c × d] V_j, swizzled
    T* q_tiles = v_tile + BC_BWD * D;           // [2][B_r × d] Q_i, swizzled
    T* do_tiles = q_tiles + 2 * BR_BWD * D;     // [2][B_r × d] dO_i, swizzled
    T* p_tile = do_tiles + 2 * BR_BWD * D;      // [B_c × B_r] P_ijᵀ, swizzled
    T* ds_tile = p_tile + BC_BWD * BR_BWD;      // [B_c × B_r] scale · dS_ijᵀ, swizzled
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
    // Causal: query tiles before the diagonal (i < j) see none of these keys.
    const int T_r = T_len / BR_BWD + (T_len % BR_BWD != 0);
    const int i_first = causal ? j_tile : 0;

    // The next query tile into stage `stage`: Q_i and dO_i, and thread x copies L of row x (x <
    // B_r) or D of row x − B_r. Rows at or past T are zero-filled (header, 6), their copies
    // reading nothing from `any_row`, a valid address. This thread's source pointers walk one
    // tile a call (no 64-bit multiply per tile: fewer registers live across the loop).
    const long long tile_step = (long long)BR_BWD * stride_t;
    const T* any_row = q + chunk * 8;
    const T* q_next = q + thread_off + i_first * tile_step;
    const T* do_next = d_o + thread_off + i_first * tile_step;
    const int stat_row = threadIdx.x % BR_BWD;
    const float* stat_next = (threadIdx.x < BR_BWD ? lse : delta) + i_first * BR_BWD + stat_row;
    int i0_next = i_first * BR_BWD;
    auto load_next_query_tile = [&](int stage) {
        load_tile_async<T, D, BR_BWD, true>(q_tiles + stage * BR_BWD * D, q_next, row_step, T_len - i0_next - trow, any_row);
        load_tile_async<T, D, BR_BWD, true>(do_tiles + stage * BR_BWD * D, do_next, row_step, T_len - i0_next - trow, any_row);
        const bool valid = i0_next + stat_row < T_len;
        cp_async_4(stat_tiles + stage * 2 * BR_BWD + threadIdx.x, valid ? stat_next : reinterpret_cast<const float*>(any_row), valid);
        q_next += tile_step;
        do_next += tile_step;
        stat_next += BR_BWD;
        i0_next += BR_BWD;
    };

    // Prologue: K_j, V_j and the first query tile into stage 0, as one cp.async group.
    load_tile_async<T, D, BC_BWD, true>(k_tile, k + (long long)j0 * stride_t + thread_off, row_step, T_len - j0 - trow,
                                        k + chunk * 8);
    load_tile_async<T, D, BC_BWD, true>(v_tile, v + (long long)j0 * stride_t + thread_off, row_step, T_len - j0 - trow,
                                        v + chunk * 8);
    load_next_query_tile(0);
    cp_async_commit();

    // Warp w's share (header, 1): keys 32·kh .. 32·kh+31 of K_j (kh = w / 2); of dK_j and dV_j
    // the columns DH·dh .. DH·dh+DH−1 of d (dh = w % 2); of S, P, dP and dS the queries 32·qh ..
    // 32·qh+31 of each Q_i (qh = w % 2).
    const int kh = warp / 2, dh = warp % 2, qh = warp % 2;
    constexpr int DH = D / 2;
    float dk_acc[2][DH / 8][4], dv_acc[2][DH / 8][4];  // dK_j, dV_j: 2 row tiles of 16 keys × DH/8 tiles of 8 columns
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int n = 0; n < DH / 8; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) dk_acc[mt][n][e] = dv_acc[mt][n][e] = 0.0f;  // dK_j = dV_j = 0

    // Per-lane ldmatrix row addresses, as in the forward (its comment at k_lane and v_lane):
    // `b_lane` reads a (rows = n, k) tile as B (the forward's K: here Q_i and dO_i for Sᵀ and
    // dPᵀ); `a_lane` reads a (rows = m, k) tile as A (the forward's Q: here K_j and V_j), and
    // with .trans a (k, n) tile as B (the forward's V: here Q_i, dO_i for dK, dV and K_j for dQ).
    // `pa_lane` is a_lane in a tile B_r wide: Pᵀ and dSᵀ as the A of dV and dK. dSᵀ, stored (keys,
    // queries), is dQ's A transposed: matrices (keys 0-7, queries 0-7), (keys 0-7, queries 8-15),
    // (keys 8-15, queries 0-7), (keys 8-15, queries 8-15) read with .trans are a0..a3 — the rows
    // and chunks b_lane walks, in a tile B_r wide (`ds_lane`).
    const int b_lane = swz<D>(lane % 8 + 8 * (lane / 16), lane / 8 % 2) * 8;
    const int a_lane = swz<D>(lane % 8 + 8 * (lane / 8 % 2), lane / 16) * 8;
    const int pa_lane = swz<BR_BWD>(lane % 8 + 8 * (lane / 8 % 2), lane / 16) * 8;
    const int ds_lane = swz<BR_BWD>(lane % 8 + 8 * (lane / 16), lane / 8 % 2) * 8;
    auto frag = [](int lane_off, int c) { return (lane_off ^ (16 * (c % 4))) + 64 * (c / 4); };
    // Where this lane's packed pair (row (mt, hh), columns 8n + 2t, +1 of its 32 queries) goes
    // in the swizzled Pᵀ and dSᵀ tiles: swz<B_r>(32kh + 16mt + 8hh + g, 4qh + n) · 8 + 2t, which,
    // as B_r = 64 is one line of 8 chunks a row and (4qh + n) XOR g = (4qh XOR g) XOR n for n < 4,
    // is one lane offset plus constants: no address arithmetic per store.
    static_assert(BR_BWD == 64, "P and dS rows of 8 chunks: swz<64>(row, c) = 8·row + (c XOR row % 8)");
    const int p_lane = (32 * kh + g) * BR_BWD + 2 * t, p_chunk = (4 * qh ^ g) * 8;
    auto pst = [&](int mt, int hh, int n) { return p_lane + (16 * mt + 8 * hh) * BR_BWD + (p_chunk ^ (8 * n)); };
    float* dq_lane = dq + out_head + (long long)(16 * warp + g) * out_t + 2 * t;  // dQ row 16w + g of the head, + i0 rows
    const T* k_warp = k_tile + 32 * kh * D;  // this warp's 32 keys
    const T* v_warp = v_tile + 32 * kh * D;

    // One query tile, visited `p`-th (stage p mod 2). MASK: P = 0 above the causal diagonal and
    // for padded keys (header, 6).
    auto query_tile = [&](int i_tile, int p, auto masked) {
        constexpr bool MASK = decltype(masked)::value;
        const int i0 = i_tile * BR_BWD, stage = p % 2;
        cp_async_wait<0>();
        __syncthreads();  // barrier 1: every thread's part of tile i (and, first time, of K_j, V_j) has
                          // landed; every warp is done with tile i − 1 (its stage, P, dSᵀ)
        // Fetch the next query tile into the other stage while this one is computed on: after
        // barrier 1, as every warp read the other stage (tile i − 1) until the end of its trip.
        if (i_tile + 1 < T_r) load_next_query_tile(1 - stage);
        cp_async_commit();
        const T* q_tile = q_tiles + stage * BR_BWD * D;
        const T* do_tile = do_tiles + stage * BR_BWD * D;
        const float* l_tile = stat_tiles + stage * 2 * BR_BWD;  // L_i
        const float* d_tile = l_tile + BR_BWD;                   // D_i

        // Element e of accumulator tile (mt, n) below is key 32kh + 16mt + g + 8(e/2) of the
        // block, query 32qh + 8n + 2t + e%2 of the tile.
        //
        // S_ijᵀ = K_j Q_iᵀ, this warp's 32 keys × 32 queries: K_j's rows are A (row-major), Q_i
        // stored (B_r, d) is Q_iᵀ column-major, mma's B without a transpose. Each K fragment
        // feeds 4 mma, each Q fragment 4.
        float s[2][4][4];
#pragma unroll
        for (int mt = 0; mt < 2; ++mt)
#pragma unroll
            for (int n = 0; n < 4; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e) s[mt][n][e] = 0.0f;
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
            uint32_t kf[2][4];
#pragma unroll
            for (int mt = 0; mt < 2; ++mt) ldmatrix_x4(kf[mt], k_warp + frag(a_lane, kk) + 16 * mt * D);
#pragma unroll
            for (int n = 0; n < 2; ++n) {
                uint32_t qf[4];
                ldmatrix_x4(qf, q_tile + frag(b_lane, kk) + (32 * qh + 16 * n) * D);
#pragma unroll
                for (int mt = 0; mt < 2; ++mt) {
                    mma_m16n8k16<T>(s[mt][2 * n], kf[mt], qf);
                    mma_m16n8k16<T>(s[mt][2 * n + 1], kf[mt], qf + 2);
                }
            }
        }

        // P_ijᵀ = exp(S_ijᵀ · scale − L_i), column by column (L_i is per query). MASK: 0 where
        // key > query (causal) or key ≥ T; per row (mt, hh) one bound on the column, relative to
        // this lane's first column, so each element is one compare against a constant 8n + e%2.
#pragma unroll
        for (int n = 0; n < 4; ++n) {
            const float2 l2 = *reinterpret_cast<const float2*>(l_tile + 32 * qh + 8 * n + 2 * t);
#pragma unroll
            for (int mt = 0; mt < 2; ++mt)
#pragma unroll
                for (int e = 0; e < 4; ++e) s[mt][n][e] = exp2_ftz(fmaf(s[mt][n][e], scale_log2, -(e % 2 ? l2.y : l2.x) * LOG2E));
        }
        if constexpr (MASK) {
#pragma unroll
            for (int mt = 0; mt < 2; ++mt)
#pragma unroll
                for (int hh = 0; hh < 2; ++hh) {
                    const int key = j0 + 32 * kh + 16 * mt + g + 8 * hh;
                    // Columns below `bound` are masked: all of them for a padded key, else those
                    // before the key's own query.
                    const int bound = key >= T_len ? BR_BWD : (causal ? key - i0 - 32 * qh - 2 * t : 0);
#pragma unroll
                    for (int n = 0; n < 4; ++n)
#pragma unroll
                        for (int e = 2 * hh; e < 2 * hh + 2; ++e)
                            if (8 * n + e % 2 < bound) s[mt][n][e] = 0.0f;
                }
        }

        // P_ijᵀ rounded to 16 bits and packed in pairs (row (mt, hh), columns 8n + 2t, +1): the
        // operand of dV, kept for dS (as rounded: P and dP in f32 together would need more than
        // the 255 registers a thread has beside dK and dV), and stored to shared memory, where
        // both warps of this key half read all B_r queries of it (each wrote half). One 4-byte
        // store per register: 8 rows × 4 lanes hit the 8 swizzled chunk slots of a line once,
        // no bank conflict.
        uint32_t pp[2][4][2];
#pragma unroll
        for (int mt = 0; mt < 2; ++mt)
#pragma unroll
            for (int n = 0; n < 4; ++n)
#pragma unroll
                for (int hh = 0; hh < 2; ++hh) {
                    pp[mt][n][hh] = pack2<T>(s[mt][n][2 * hh], s[mt][n][2 * hh + 1]);
                    *reinterpret_cast<uint32_t*>(p_tile + pst(mt, hh, n)) = pp[mt][n][hh];
                }

        // dP_ijᵀ = V_j dO_iᵀ, as S_ijᵀ.
        float dp[2][4][4];
#pragma unroll
        for (int mt = 0; mt < 2; ++mt)
#pragma unroll
            for (int n = 0; n < 4; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e) dp[mt][n][e] = 0.0f;
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
            uint32_t vf[2][4];
#pragma unroll
            for (int mt = 0; mt < 2; ++mt) ldmatrix_x4(vf[mt], v_warp + frag(a_lane, kk) + 16 * mt * D);
#pragma unroll
            for (int n = 0; n < 2; ++n) {
                uint32_t of[4];
                ldmatrix_x4(of, do_tile + frag(b_lane, kk) + (32 * qh + 16 * n) * D);
#pragma unroll
                for (int mt = 0; mt < 2; ++mt) {
                    mma_m16n8k16<T>(dp[mt][2 * n], vf[mt], of);
                    mma_m16n8k16<T>(dp[mt][2 * n + 1], vf[mt], of + 2);
                }
            }
        }

        // scale · dS_ijᵀ = scale · P_ijᵀ ∘ (dP_ijᵀ − D_i) (D_i per query: per column), rounded and
        // stored to shared memory as P was: the operand of dK and dQ.
#pragma unroll
        for (int n = 0; n < 4; ++n) {
            const float2 d2 = *reinterpret_cast<const float2*>(d_tile + 32 * qh + 8 * n + 2 * t);
#pragma unroll
            for (int mt = 0; mt < 2; ++mt)
#pragma unroll
                for (int hh = 0; hh < 2; ++hh) {
                    const float2 pf = unpack2<T>(pp[mt][n][hh]);
                    *reinterpret_cast<uint32_t*>(ds_tile + pst(mt, hh, n)) = pack2<T>(
                        scale * pf.x * (dp[mt][n][2 * hh] - d2.x), scale * pf.y * (dp[mt][n][2 * hh + 1] - d2.y));
                }
        }
        __syncthreads();  // barrier 2: Pᵀ and dSᵀ are complete (every warp's keys and queries)

        // dV_j += P_ijᵀ dO_i and dK_j += (scale · dS_ijᵀ) Q_i, this warp's 32 keys × DH columns:
        // Pᵀ and dSᵀ stored (keys, queries) are A (row-major); Q_i and dO_i stored (B_r, d) are B
        // (k = query, n = d) row-major, so ldmatrix.trans hands out their fragments. Each A
        // fragment feeds DH/8 mma, each B fragment 4.
#pragma unroll
        for (int kk = 0; kk < BR_BWD / 16; ++kk) {
            uint32_t pa[2][4];
#pragma unroll
            for (int mt = 0; mt < 2; ++mt) ldmatrix_x4(pa[mt], p_tile + frag(pa_lane, kk) + (32 * kh + 16 * mt) * BR_BWD);
#pragma unroll
            for (int n = 0; n < DH / 16; ++n) {
                uint32_t of[4];
                ldmatrix_x4_trans(of, do_tile + frag(a_lane, dh * DH / 16 + n) + 16 * kk * D);
#pragma unroll
                for (int mt = 0; mt < 2; ++mt) {
                    mma_m16n8k16<T>(dv_acc[mt][2 * n], pa[mt], of);
                    mma_m16n8k16<T>(dv_acc[mt][2 * n + 1], pa[mt], of + 2);
                }
            }
        }
#pragma unroll
        for (int kk = 0; kk < BR_BWD / 16; ++kk) {
            uint32_t dsa[2][4];
#pragma unroll
            for (int mt = 0; mt < 2; ++mt) ldmatrix_x4(dsa[mt], ds_tile + frag(pa_lane, kk) + (32 * kh + 16 * mt) * BR_BWD);
#pragma unroll
            for (int n = 0; n < DH / 16; ++n) {
                uint32_t qf[4];
                ldmatrix_x4_trans(qf, q_tile + frag(a_lane, dh * DH / 16 + n) + 16 * kk * D);
#pragma unroll
                for (int mt = 0; mt < 2; ++mt) {
                    mma_m16n8k16<T>(dk_acc[mt][2 * n], dsa[mt], qf);
                    mma_m16n8k16<T>(dk_acc[mt][2 * n + 1], dsa[mt], qf + 2);
                }
            }
        }

        // dQ_i += (scale · dS_ij) K_j for this warp's 16 query rows, 16 columns of d at a time,
        // added into the f32 buffer other key tiles add to. dS's A fragments (all B_c keys) are
        // read once; K_j stored (B_c, d) is B (k = key, n = d) row-major: ldmatrix.trans.
        uint32_t dsf[BC_BWD / 16][4];
#pragma unroll
        for (int kk = 0; kk < BC_BWD / 16; ++kk) ldmatrix_x4_trans(dsf[kk], ds_tile + frag(ds_lane, warp) + 16 * kk * BR_BWD);
        const int row = i0 + 16 * warp + g;  // query of this lane's accumulator row hh: row + 8hh
        float* dq_row = dq_lane + (long long)i0 * out_t;
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
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            const int j = j0 + 32 * kh + 16 * mt + g + 8 * hh;
            if (j >= T_len) continue;
            float* dk_row = dk + out_head + (long long)j * out_t + dh * DH + 2 * t;
            float* dv_row = dv + out_head + (long long)j * out_t + dh * DH + 2 * t;
#pragma unroll
            for (int n = 0; n < DH / 8; ++n) {
                *reinterpret_cast<float2*>(dk_row + 8 * n) = make_float2(dk_acc[mt][n][2 * hh], dk_acc[mt][n][2 * hh + 1]);
                *reinterpret_cast<float2*>(dv_row + 8 * n) = make_float2(dv_acc[mt][n][2 * hh], dv_acc[mt][n][2 * hh + 1]);
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
