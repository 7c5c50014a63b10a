// paged_decode_attn_tiled.cu: one tile of streaming (online-softmax) decode attention (docs/design.md §6.3,
// restructured as split + merge under docs/design.md §0), on the tensor cores, each kv head's K/V read once per tile
// whatever the GQA ratio (up to ATT_HG = 16 query heads share a CTA: the 16 rows of the mma tiles).
//
// A tile's tokens (every slot of every listed page, except the last page's min(lbvs, bs) slots) are cut into
// units of U tokens counted from the tile's start, U = unit_tokens(n, ctas) (below): n the sequence's tokens in
// this tile, ctas = gridDim.x * gridDim.y (sequences x CTA rows). CTA z of one (sequence, kv head, group of up
// to 16 query heads) takes units z, z + gridDim.z, ...; in a unit, warp w of 8 takes the 8-token steps w, w + 8,
// ... (tokens u*U + 8*(8i + w) ..), each staged by the warp alone (a Cfg<HDP>::STAGES-deep cp.async ring per
// warp: 2, or 4 at HDP 64; no block barrier inside a unit), and keeps an online-softmax state per query head in
// log2 units:
//   x_t = (q . K_t) * rsqrt(head_dim) * log2(e)   (bf16 mma m16n8k16, f32 accumulate in 4 chains over head_dim)
//   per step: m' = max(m, max_t x_t), a = exp2(m - m'), p_t = exp2(x_t - m'), l' = l*a + sum_t p_t,
//   o' = o*a + sum_t p_t*V_t   (p as bf16 hi + lo, >= 16 bits (docs/design.md §0); bf16 mma m16n8k8, f32 accumulate).
// At a unit's end the 8 warp states are combined (warp order: M = max_w m_w, w_w = 2^(m_w - M), 0 for a warp with
// no step; l_u = sum_w l_w w_w and o_u = sum_w o_w w_w as fma chains from 0) into the unit's partial (m_u = M, l_u,
// o_u), written to the workspace (a tile of one unit: folded into the state at once, by the same ops, without the
// workspace's round trip). The last CTA to finish (atomic counters that reset themselves) folds the units
// straight into the running state (m, l, o) when the tile has at most ATT_GROUP = 8 units or units x query heads of
// the CTA x HDP <= ATT_FOLD_DIRECT (16384); else in two levels: the units of each group of 8 (unit order) into the
// group's first slot, then the groups (group order) into the state. The fold (fold() gives the exact order) is
//   M = max(m, m_0..m_{k-1});  l' = l*2^(m-M) + sum_j l_j*2^(m_j-M);  o' = o*2^(m-M) + sum_j o_j*2^(m_j-M)
// and, when `out` is not null, the state's fold also writes out = bf16(o' * (l' > 0 ? 1/l' : 0)) (what
// attention_finalize writes from that state). The one-level rule depends on the tile's unit count and the CTA's
// query heads and HDP only. Every unit is computed the same way whichever CTA runs it, so a
// tile's result depends only on its token list and U: replaying the same pages in the same tiles with the same
// number of sequences gives the same bits (pool layout, tile_capacity, gridDim.z and the other sequences' pages
// do not matter). Splitting the pages into other tiles changes the rounding only.
//
// unit_tokens(n, ctas): want = min(ATT_MAX_UNITS, max(1, ceil(T / ctas))) units per (sequence, CTA row), T =
//   the CTAs a launch aims at (Cfg<HDP>::TARGET: about one wave of the 132 SMs of an H100 / H200 at the CTAs per SM
//   the shared memory allows); U = ceil(n / want) rounded up to a multiple of 64 (a step for each warp), at least
//   UMIN = Cfg<HDP>::UNIT_MIN (ATT_UNIT_MIN 128 at HDP 64 and 256, ATT_UNIT_MIN_128 256 at HDP 128). So at most
//   want <= ATT_MAX_UNITS units per tile, as even as 64-token steps allow, and at most ceil(n / UMIN).
//
// paged_decode_attn_tiled(q, k_pool, v_pool, tile_blocks, tile_block_counts, part_ml, part_o, m, l, o, out,
//     merge_count, num_q_heads, num_kv_heads, head_dim, block_size, tile_capacity, gqa_ratio, max_units,
//     blk_stride, tok_stride, kvh_stride, last_block_valid_slots, fresh)
//   q                 bf16 [num_seqs, num_q_heads, head_dim]
//   k_pool, v_pool    bf16, element (page, tok, kv_head, d) at page*blk_stride + tok*tok_stride + kv_head*kvh_stride + d
//                     (element strides, i64; NHD pool (bs*nkv*hd, nkv*hd, hd); HSS scratch slots (2*nkv*gs, hd, gs))
//   tile_blocks       i32 [num_seqs, tile_capacity] page ids of this tile in order (trusted: the host cannot
//                     check device-resident ids); tile_block_counts i32 [num_seqs] (clamped to 0..tile_capacity)
//                     or, in token mode (fresh & 2), token counts: the tile is then the first
//                     clamp(tile_block_counts[seq] - last_block_valid_slots, 0, tile_capacity*block_size) tokens of
//                     the listed pages (last_block_valid_slots >= 0 is the offset; page j holds tokens j*bs ..)
//   part_ml           f32 [num_seqs*num_q_heads, max_units, 2] (m_u, l_u), part_o f32 [num_seqs*num_q_heads,
//                     max_units, HDP] (HDP = head_dim padded to 64, 128 or 256): the tile's units only
//   m, l              f32 [num_seqs*num_q_heads], o f32 [num_seqs*num_q_heads, head_dim]: read then written
//                     (fresh & 1: not read, taken as m = -inf, l = 0, o = 0, the state begin_step asks for); m
//                     is in log2 units (base-2 logits)
//   out               bf16 [num_seqs, num_q_heads, head_dim] or null
//   merge_count       u32 [num_seqs, num_kv_heads * ceil(gqa_ratio/16), ATT_COUNTERS], zero between launches
//   max_units = min(ATT_MAX_UNITS, ceil(tile_capacity*block_size / UMIN)) (the partial arrays' row
//   stride). Launch: grid (num_seqs, num_kv_heads * ceil(gqa_ratio/16), Z), 1 <= Z <= max_units (any Z gives the
//   same bits), block (256,1,1), dynamic shared memory Cfg<HDP>::BYTES (hss.decls.attention.step_shared_bytes:
//   past 48 KiB, the host raises the function's limit). A sequence whose tile has no tokens keeps its state
//   (fresh: gets the initial state); CTA z = 0 writes it (and out).
// head_dim <= 256 (any value; rows are padded to 64, 128 or 256 in shared memory). Loads are 16-byte cp.async
// when the pools, strides and head_dim allow it, else 2-byte loads; both stage the same values.
// paged_decode_attn_rope_64/128/256: the same parameters plus cos_t, sin_t f32 [max_pos, head_dim / 2] and max_pos;
// a token-count tile whose query and newest token arrive un-rotated as qkv rows (see the entry points at the end).
#include "hss_async.cuh"
#include "hss_common.cuh"
#include "hss_mma.cuh"
#include "hss_rope.cuh"
#include "hss_softmax.cuh"

#define ATT_THREADS 256
#define ATT_WARPS 8
#define ATT_ROWS 8           // tokens per warp step (the n of the S tile, the k of the P.V mma)
#define ATT_HG 16            // query heads per CTA (the m of every mma tile)
#define ATT_UNIT_MIN 128     // the smallest unit, in tokens (HDP 64 and 256)
#define ATT_UNIT_MIN_128 256 // the smallest unit at HDP 128
#define ATT_MAX_UNITS 64     // units of one tile at most
#define ATT_GROUP 8          // units per first-level fold group
#define ATT_COUNTERS 9       // fold counters per (sequence, CTA row): one per group, then the groups' own
#define ATT_MAX_HD 256
#define ATT_FOLD_LD 8        // partial slots a folding thread has in flight
#define ATT_FOLD_DIRECT 16384   // units x query heads x HDP at most for a one-level fold

// Programmatic dependent launch (module paged_decode_attn_pdl: this source built for sm_90 with -DATT_PDL): each
// CTA lets the stream's next launch start at once, and waits for the launch before it to complete (its memory
// visible) before it touches what consecutive tiles share: the workspace, the counters, the state and out. Only
// the K/V streaming (q, tables, counts, pools: written by no tile of the step) overlaps the previous tile. Without
// the launch attribute both are no-ops; in the base build they are absent.
#ifdef ATT_PDL
#define ATT_PDL_TRIGGER() asm volatile("griddepcontrol.launch_dependents;" ::: "memory")
#define ATT_PDL_WAIT() asm volatile("griddepcontrol.wait;" ::: "memory")
#else
#define ATT_PDL_TRIGGER()
#define ATT_PDL_WAIT()
#endif

// The parameters every entry point takes after q, k_pool and v_pool, in the order hss.decls.attention declares
// them (the rope entry points add cos_t, sin_t and max_pos after them), and the same names as arguments.
#define ATT_TILE_PARAMS                                                                                              \
    const int* __restrict__ tile_blocks, const int* __restrict__ tile_block_counts, float* __restrict__ part_ml,     \
        float* __restrict__ part_o, float* __restrict__ m, float* __restrict__ l, float* __restrict__ o,             \
        __nv_bfloat16* __restrict__ out, unsigned* __restrict__ merge_count, int num_q_heads, int num_kv_heads,      \
        int head_dim, int block_size, int tile_capacity, int gqa_ratio, int max_units, long long blk_stride,         \
        long long tok_stride, long long kvh_stride, int last_block_valid_slots, int fresh
#define ATT_TILE_ARGS                                                                                                \
    tile_blocks, tile_block_counts, part_ml, part_o, m, l, o, out, merge_count, num_q_heads, num_kv_heads, head_dim, \
        block_size, tile_capacity, gqa_ratio, max_units, blk_stride, tok_stride, kvh_stride, last_block_valid_slots, \
        fresh
// The plain entry points' parameters; the rope entry points' (their pools are written, so not __restrict__).
#define ATT_STEP_PARAMS                                                                                              \
    const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k_pool,                                   \
        const __nv_bfloat16* __restrict__ v_pool, ATT_TILE_PARAMS
#define ATT_ROPE_PARAMS                                                                                              \
    const __nv_bfloat16* __restrict__ q, __nv_bfloat16* k_pool, __nv_bfloat16* v_pool, ATT_TILE_PARAMS,              \
        const float* __restrict__ cos_t, const float* __restrict__ sin_t, int max_pos

namespace {

// Shared memory of one CTA (bytes): Q bf16 [16][RS]; per warp a ring of STAGES steps (K bf16 [8][RS], then V);
// the fold's staged (m, l) f32 [ATT_MAX_UNITS][16][2] (at a unit's end: the warps' (m, l)); per query head the
// fold's (m', l', 2^(m - M), 1 / l') f32 [16][4]; the warps' weights f32 [8][16]; the fold flag. At a unit's end
// the rings hold every warp's o, f32 [8 warps][16][OWS = HDP + 8]; in a fold, the chunk sums f32 [<= 256][4].
// RS = HDP + 8 makes every ldmatrix conflict-free.
template <int HDP>
struct Cfg {
    static constexpr int STAGES = HDP == 64 ? 4 : 2;
    static constexpr int TARGET = HDP == 256 ? 128 : 256;   // CTAs a launch aims at (1 resp. 2 per SM, 132 SMs)
    static constexpr int UNIT_MIN = HDP == 128 ? ATT_UNIT_MIN_128 : ATT_UNIT_MIN;   // the smallest unit (tokens)
    static constexpr int RS = HDP + 8;
    static constexpr int STEP = 2 * ATT_ROWS * RS * 2;
    static constexpr int RING = STAGES * STEP;
    static constexpr int Q = 0;
    static constexpr int RINGS = Q + ATT_HG * RS * 2;
    static constexpr int FOLD = RINGS + ATT_WARPS * RING;             // f32 [ATT_MAX_UNITS][16][2]
    static constexpr int HEADS = FOLD + ATT_MAX_UNITS * ATT_HG * 2 * 4;  // f32 [16][4]
    static constexpr int WT = HEADS + ATT_HG * 4 * 4;                    // f32 [8][16]
    static constexpr int FLAG = WT + ATT_WARPS * ATT_HG * 4;
    static constexpr int ROPE = FLAG + 16;                               // RopeRow (rope entry points)
    static constexpr int BYTES = ROPE + 64;
    static constexpr int OWS = HDP + 8;   // row stride (floats) of the warps' unit-end o: conflict-free float2 stores
    static_assert(ATT_WARPS * ATT_HG * OWS * 4 <= ATT_WARPS * RING, "every warp's unit-end o fits the rings");
    static_assert(ATT_WARPS + 1 <= ATT_MAX_UNITS, "the unit-end warp states (and a lone unit's) share the fold's area");
    static_assert(ATT_THREADS * 16 <= ATT_WARPS * RING, "the fold's chunk sums fit the rings");
    static_assert(BYTES <= 227 * 1024, "shared memory per CTA");
};

__device__ __forceinline__ int hdp_of(int hd) { return hd <= 64 ? 64 : (hd <= 128 ? 128 : 256); }

// Tokens of this tile for sequence `seq`: every slot of every entry, except the last entry's min(lbvs, bs)
// slots. 0 when the arguments make no sense.
__device__ __forceinline__ int tile_tokens(const int* __restrict__ counts, int seq, int capacity, int bs, int lbvs) {
    if (bs <= 0 || capacity < 0) return 0;
    int n_blocks = counts[seq];
    n_blocks = n_blocks < 0 ? 0 : (n_blocks > capacity ? capacity : n_blocks);
    const int last_slots = lbvs < 0 ? 0 : min(lbvs, bs);
    return n_blocks == 0 ? 0 : (n_blocks - 1) * bs + last_slots;
}

// Tokens of this tile for sequence `seq` counted by the device (token mode): the first counts[seq] - offset
// tokens of the listed pages, clamped to 0 .. capacity * bs.
__device__ __forceinline__ int tile_tokens_counted(const int* __restrict__ counts, int seq, int capacity, int bs,
                                                   int offset) {
    if (bs <= 0 || capacity <= 0) return 0;
    const long long n = (long long)counts[seq] - offset, cap = min((long long)capacity * bs, 0x7fffffffLL);
    return (int)(n < 0 ? 0 : (n > cap ? cap : n));
}

// The unit size for a tile of n >= 1 tokens in a launch of `ctas` CTAs per unit index (see the header).
__device__ __forceinline__ long long unit_tokens(int n, int ctas, int target, int unit_min) {
    constexpr long long STEPS = ATT_WARPS * ATT_ROWS;   // a step for every warp
    const int want = min(ATT_MAX_UNITS, max(1, (target + ctas - 1) / ctas));
    const long long need = ((long long)n + want - 1) / want;
    const long long u = (need + STEPS - 1) / STEPS * STEPS;
    return u > unit_min ? u : unit_min;
}

struct Args {
    const unsigned short* q;   // this CTA's first query head
    const unsigned short* k;   // pools, already offset to the kv head
    const unsigned short* v;
    const int* blocks;         // this sequence's page ids
    float* part_ml;            // row of this CTA's first query head, unit 0
    float* part_o;
    float *m, *l, *o;          // running state, row of the first query head
    unsigned short* out;       // or null
    unsigned* count;           // this (sequence, CTA row)'s ATT_COUNTERS counters
    long long blk, tok, row_ml, row_o;
    int hd, bs, hg, n_tok, n_units, unit;
    bool vec, fresh;
    int newest;   // rope entry points: the tile index of the newest token (else -1); its rows: RopeRow
};

// Rope entry points, in shared memory (Cfg::ROPE; read only by the step that holds the newest token): that token's
// un-rotated k row `knew` and v row `vnew` in qkv (this kv head's), its cos / sin rows [head_dim / 2], and where it
// goes (kw, vw: the pools offset to the kv head; null in CTA rows past group 0, which do not write it).
struct RopeRow {
    const unsigned short *knew, *vnew;
    const float *cs, *sn;
    unsigned short *kw, *vw;
};

// Stage the warp step of tokens t0 .. t0 + n - 1 (n <= 8) into ks (K rows) and ks + 8*RS (V rows); rows past n
// and dims >= head_dim are zero (finite for the mma: a zero V row times p = 0 adds nothing). One cp.async group
// per lane; the caller commits.
template <int HDP, bool ROPE>
__device__ __forceinline__ void stage(const Args& a, int t0, int n, unsigned short* ks, int lane, int r_new,
                                      const RopeRow* rr) {
    constexpr int RS = Cfg<HDP>::RS;
    constexpr int PPR = HDP / 8;   // 16-byte pieces per row
    unsigned short* vs = ks + ATT_ROWS * RS;
    if (a.vec) {
        // the step's rows: one page when they share it (t0 is a multiple of 8: always so when 8 divides bs)
        const int pg0 = t0 / a.bs, slot0 = t0 - pg0 * a.bs;
        const bool one_page = slot0 + ATT_ROWS <= a.bs;
        const long long base0 = one_page ? (long long)__ldg(a.blocks + pg0) * a.blk + (long long)slot0 * a.tok : 0;
#pragma unroll
        for (int p = lane; p < ATT_ROWS * PPR; p += 32) {
            const int r = p / PPR, pc = p % PPR;
            uint4* dk = reinterpret_cast<uint4*>(ks + r * RS + pc * 8);
            uint4* dv = reinterpret_cast<uint4*>(vs + r * RS + pc * 8);
            if (r < n && pc * 8 < a.hd) {
                const int t = t0 + r;
                if (ROPE && r == r_new) {   // rope: the newest token's rows come from qkv (k rotated later)
                    hss_cp_async16(dk, rr->knew + pc * 8);
                    hss_cp_async16(dv, rr->vnew + pc * 8);
                    continue;
                }
                const long long off = (one_page ? base0 + (long long)r * a.tok
                                                : (long long)__ldg(a.blocks + t / a.bs) * a.blk +
                                                      (long long)(t % a.bs) * a.tok) + pc * 8;
                hss_cp_async16(dk, a.k + off);
                hss_cp_async16(dv, a.v + off);
            } else {
                *dk = make_uint4(0u, 0u, 0u, 0u);
                *dv = make_uint4(0u, 0u, 0u, 0u);
            }
        }
    } else {
        for (int p = lane; p < ATT_ROWS * HDP; p += 32) {
            const int r = p / HDP, d = p % HDP;
            unsigned short xk = 0, xv = 0;
            if (r < n && d < a.hd) {
                const int t = t0 + r;
                if (ROPE && r == r_new) {
                    xk = rr->knew[d];
                    xv = rr->vnew[d];
                } else {
                    const long long off = (long long)__ldg(a.blocks + t / a.bs) * a.blk + (long long)(t % a.bs) * a.tok + d;
                    xk = __ldg(a.k + off);
                    xv = __ldg(a.v + off);
                }
            }
            ks[r * RS + d] = xk;
            vs[r * RS + d] = xv;
        }
    }
}

// stage() for a full step (8 rows) on one page with 16-byte loads, its addresses by increments from the step's
// page and slot (no division): the same copies. PPR (16-byte pieces a row) divides 32, so lane l stages pieces
// (row l / PPR + j * 32 / PPR, column l % PPR) for j = 0 .. 8 * PPR / 32 - 1.
template <int HDP>
__device__ __forceinline__ void stage_full(const Args& a, int pg, int slot, unsigned short* ks, int lane) {
    constexpr int RS = Cfg<HDP>::RS, PPR = HDP / 8, RJ = 32 / PPR, J = ATT_ROWS * PPR / 32;
    const int rl = lane / PPR, pc = lane % PPR;
    unsigned short* dk = ks + rl * RS + pc * 8;
    unsigned short* dv = dk + ATT_ROWS * RS;
    if (pc * 8 >= a.hd) {   // padding dims: zero, as stage() writes them
#pragma unroll
        for (int j = 0; j < J; ++j) {
            *reinterpret_cast<uint4*>(dk + j * RJ * RS) = make_uint4(0u, 0u, 0u, 0u);
            *reinterpret_cast<uint4*>(dv + j * RJ * RS) = make_uint4(0u, 0u, 0u, 0u);
        }
        return;
    }
    const long long off = (long long)__ldg(a.blocks + pg) * a.blk + (long long)(slot + rl) * a.tok + pc * 8;
    const long long step = (long long)RJ * a.tok;
#pragma unroll
    for (int j = 0; j < J; ++j) {
        hss_cp_async16(dk + j * RJ * RS, a.k + off + j * step);
        hss_cp_async16(dv + j * RJ * RS, a.v + off + j * step);
    }
}

// One warp step over the n (1..8) staged tokens in ks: lane (g = lane/4, c = lane%4) holds the state of query
// heads g (m0, l0) and g + 8 (m1, l1) and o[j] = the mma C fragment of dims 8j .. 8j + 7 (rows g, g + 8).
template <int HDP>
__device__ __forceinline__ void step(const unsigned short* qs, const unsigned short* ks, int n, float sl2, float& m0,
                                     float& m1, float& l0, float& l1, float (&o)[HDP / 8][4], int lane) {
    constexpr int RS = Cfg<HDP>::RS;
    const unsigned short* vs = ks + ATT_ROWS * RS;
    const int c = lane & 3;
    // S = Q K^T, 16 heads x 8 tokens: A = Q (ldmatrix x4 per 16 dims), B = K rows (x4: two 16-dim k-steps).
    const int arow = (lane & 7) + ((lane >> 3) & 1) * 8, acol = (lane >> 4) * 8;
    const int krow = lane & 7, kcol = (lane >> 3) * 8;
    float acc[4][4];
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < HDP / 32; ++kk) {
        uint32_t b[4], a0[4], a1[4];
        hss_ldsm_x4(b, ks + krow * RS + kk * 32 + kcol);
        hss_ldsm_x4(a0, qs + arow * RS + kk * 32 + acol);
        hss_ldsm_x4(a1, qs + arow * RS + kk * 32 + 16 + acol);
        hss_mma16816(acc[(2 * kk) & 3], a0, b[0], b[1]);
        hss_mma16816(acc[(2 * kk + 1) & 3], a1, b[2], b[3]);
    }
    const float ninf = hss_neg_inf();
    float x[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) x[e] = ((acc[0][e] + acc[1][e]) + (acc[2][e] + acc[3][e])) * sl2;
    if (2 * c >= n) x[0] = x[2] = ninf;       // tokens 2c, 2c + 1 of the step
    if (2 * c + 1 >= n) x[1] = x[3] = ninf;
    float mx0 = fmaxf(x[0], x[1]), mx1 = fmaxf(x[2], x[3]);
    mx0 = fmaxf(mx0, __shfl_xor_sync(HSS_FULL_MASK, mx0, 1));
    mx1 = fmaxf(mx1, __shfl_xor_sync(HSS_FULL_MASK, mx1, 1));
    mx0 = fmaxf(mx0, __shfl_xor_sync(HSS_FULL_MASK, mx0, 2));
    mx1 = fmaxf(mx1, __shfl_xor_sync(HSS_FULL_MASK, mx1, 2));
    // token 0 of a step is always there: the new maxima are finite
    const HssFragStep sm = hss_softmax_step_frag(x[0], x[1], x[2], x[3], mx0, mx1, m0, m1, l0, l1);
    m0 = sm.m0;
    m1 = sm.m1;
    l0 = sm.l0;
    l1 = sm.l1;
    const float al0 = sm.a0, al1 = sm.a1;
    uint32_t h0, lo0, h1, lo1;   // P as the m16n8k8 A fragment: rows g (h0) and g + 8 (h1), tokens 2c, 2c + 1
    hss_bf16_split2(sm.p0, sm.p1, h0, lo0);
    hss_bf16_split2(sm.p2, sm.p3, h1, lo1);
    // O = O * a + P V: B = V rows (ldmatrix x4 .trans: four 8-dim n-tiles)
    const int vrow = lane & 7, vcol = (lane >> 3) * 8;
#pragma unroll
    for (int j = 0; j < HDP / 32; ++j) {
        uint32_t b[4];
        hss_ldsm_x4_trans(b, vs + vrow * RS + j * 32 + vcol);
#pragma unroll
        for (int t = 0; t < 4; ++t) {
            float(&d)[4] = o[4 * j + t];
            d[0] *= al0;
            d[1] *= al0;
            d[2] *= al1;
            d[3] *= al1;
            hss_mma1688(d, h0, h1, b[t]);
            hss_mma1688(d, lo0, lo1, b[t]);
        }
    }
}

// The state (m, l) = st of query head r and o = oo of its dims d .. d + 3, folded with the chunks' M, sum, L (cnt
// slots; 0: the state as it is): o (and out) written for the dims < head_dim; returns (m', l').
__device__ __forceinline__ float2 fold_state(const Args& a, int r, int d, float2 st, const float (&oo)[4], float M,
                                             const float4& sum, float L, int cnt) {
    float m2 = st.x, l2 = st.y, s_old = 1.f;   // nothing attended: the state as it is (fresh: the initial one)
    if (cnt > 0) {
        s_old = hss_softmax_weight(st.x, M);   // m = -inf (fresh state): 0
        m2 = M;
        l2 = fmaf(st.y, s_old, L);
    }
    if (d < a.hd) {
        const float inv = hss_softmax_inv(l2);
        const float sv[4] = {sum.x, sum.y, sum.z, sum.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            if (d + i >= a.hd) break;
            const float o2 = cnt > 0 ? fmaf(oo[i], s_old, sv[i]) : oo[i];
            a.o[r * a.hd + d + i] = o2;
            if (a.out) a.out[r * a.hd + d + i] = __bfloat16_as_ushort(hss_f32_to_bf16(o2 * inv));
        }
    }
    return make_float2(m2, l2);
}

// The state of query head r and its o at dims d .. d + 3 (keep: read; else the initial state).
__device__ __forceinline__ float2 load_state(const Args& a, bool keep, int r, int d, float (&oo)[4]) {
#pragma unroll
    for (int i = 0; i < 4; ++i) oo[i] = keep && d + i < a.hd ? a.o[r * a.hd + d + i] : 0.f;
    return keep ? make_float2(a.m[r], a.l[r]) : make_float2(hss_neg_inf(), 0.f);
}

// Fold `cnt` partials (slots first, first + stride, ... in that order) of this CTA row: into the running state
// (to_state: m, l, o read unless fresh; out written when present) or into slot `first`. cnt == 0 (to_state
// only): the state as it is. All threads; barriers inside.
// Per 4 dims of a query head (a piece) the slots are cut into C chunks of S consecutive slots (C = min(cnt,
// 256 / (hg * HDP / 4)) or 1, S = ceil(cnt / C), the last chunk shorter); a chunk runs an online max over its slots
// in order: M_c' = max(M_c, m_j), a = 2^(M_c - M_c'), w = 2^(m_j - M_c'), acc = fma(o_j, w, acc * a), lw = fma(l_j,
// w, lw * a) (from M_c = -inf, acc = lw = 0). Then M = max(m, M_0, .., M_{C-1}) (a chain from the state's m), and
// over the chunks in order s_c = 2^(M_c - M), sum = fma(acc_c, s_c, sum), L = fma(lw_c, s_c, L) (from 0);
// o' = fma(o, 2^(m - M), sum), l' = fma(l, 2^(m - M), L) (the state's m = -inf: 2^(m - M) = 0). Every piece of a
// head computes the head's (M, L) the same way; a piece's loads (the chunk's (m_j, l_j) and o_j, the state) are
// all issued before any of it is used.
template <int HDP>
__device__ __forceinline__ void fold(const Args& a, int first, int stride, int cnt, bool to_state,
                                     unsigned char* smem) {
    using C = Cfg<HDP>;
    constexpr int Q4 = HDP / 4;   // float4 pieces per head
    constexpr int LD = ATT_FOLD_LD;   // slots in flight per thread
    const int tid = threadIdx.x;
    float4* hd4 = reinterpret_cast<float4*>(smem + C::HEADS);   // [16] (m', l') of each head, for the writers
    float4* sums = reinterpret_cast<float4*>(smem + C::RINGS);  // [chunk][piece] acc_c
    float2* chm = reinterpret_cast<float2*>(smem + C::FOLD);    // [chunk][piece] (M_c, lw_c)
    const float ninf = hss_neg_inf();
    const bool keep = to_state && !a.fresh;
    const int pieces = a.hg * Q4;
    int chunks = pieces >= ATT_THREADS || cnt <= 1 ? 1 : min(cnt, ATT_THREADS / pieces);
    const int per = chunks > 1 ? (cnt + chunks - 1) / chunks : cnt;
    if (chunks > 1) chunks = (cnt + per - 1) / per;
    __syncthreads();   // the rings and the (m, l) areas are free
    // slots j0 .. j1 - 1 of piece e folded into (acc, M_c, lw) in order, LD loads in flight
    auto fold_slots = [&](int e, int j0, int j1, float4& acc, float& Mc, float& lw) {
        const int r = e / Q4, d = 4 * (e % Q4);
        const float* src = a.part_o + r * a.row_o + (long long)first * HDP + d;
        const float* srm = a.part_ml + r * a.row_ml + 2LL * first;
        for (int jb = j0; jb < j1; jb += LD) {
            float4 x[LD];
            float2 ml[LD];
#pragma unroll
            for (int i = 0; i < LD; ++i) {
                const bool in = jb + i < j1;
                const long long j = (long long)(jb + i) * stride;
                x[i] = in ? __ldcg(reinterpret_cast<const float4*>(src + j * HDP)) : make_float4(0.f, 0.f, 0.f, 0.f);
                ml[i] = in ? __ldcg(reinterpret_cast<const float2*>(srm + 2 * j)) : make_float2(ninf, 0.f);
            }
#pragma unroll
            for (int i = 0; i < LD; ++i) {
                if (jb + i >= j1) break;
                hss_softmax_fold4(x[i], ml[i], acc, Mc, lw);
            }
        }
    };
    // chunk ch of piece e: (M_c, lw_c) and acc_c
    auto chunk = [&](int e, int ch, float& Mc, float& lw) {
        float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
        Mc = ninf;
        lw = 0.f;
        fold_slots(e, ch * per, min(cnt, ch * per + per), acc, Mc, lw);
        return acc;
    };
    // piece e's result from its chunks (acc_c, M_c, lw_c for c < chunks, read by `get`) and the state
    auto finish = [&](int e, float2 st, const float (&oo)[4], auto get) {
        const int r = e / Q4, d = 4 * (e % Q4);
        float M = st.x;
        for (int c2 = 0; c2 < chunks; ++c2) M = fmaxf(M, get(c2).y.x);
        float4 sum = make_float4(0.f, 0.f, 0.f, 0.f);
        float L = 0.f;
        for (int c2 = 0; c2 < chunks; ++c2) {
            const auto v = get(c2);
            const float sc = hss_softmax_weight(v.y.x, M);
            hss_softmax_add4(sum, v.x, sc);
            L = fmaf(v.y.y, sc, L);
        }
        if (!to_state) {
            *reinterpret_cast<float4*>(a.part_o + r * a.row_o + (long long)first * HDP + d) = sum;
            if (d == 0) hd4[r] = make_float4(M, L, 0.f, 0.f);
            return;
        }
        const float2 h = fold_state(a, r, d, st, oo, M, sum, L, cnt);
        if (d == 0) hd4[r] = make_float4(h.x, h.y, 0.f, 0.f);
    };
    struct Part {
        float4 x;
        float2 y;
    };
    // the state of piece e's head and its o (what the writer needs), loaded before the chunk's loads are used
    auto state_of = [&](int e, float (&oo)[4]) { return load_state(a, keep, e / Q4, 4 * (e % Q4), oo); };
    if (chunks == 1) {   // FP pieces per thread at a time, their states and first LD slots loaded before any is used
        // (FP = 1, written as loops over the pieces: the form the shipped PTX is compiled from)
        constexpr int FP = 1;
        for (int e0 = tid; e0 < pieces; e0 += FP * ATT_THREADS) {
            float4 x[FP][LD];
            float2 ml[FP][LD];
            float oo[FP][4];
            float2 st[FP];
#pragma unroll
            for (int k = 0; k < FP; ++k) {
                const int e = e0 + k * ATT_THREADS, r = e / Q4, d = 4 * (e % Q4);
                const bool has = e < pieces;
                oo[k][0] = oo[k][1] = oo[k][2] = oo[k][3] = 0.f;
                st[k] = has && to_state ? state_of(e, oo[k]) : make_float2(ninf, 0.f);
                const float* src = a.part_o + r * a.row_o + (long long)first * HDP + d;
                const float* srm = a.part_ml + r * a.row_ml + 2LL * first;
#pragma unroll
                for (int i = 0; i < LD; ++i) {
                    const bool in = has && i < cnt;
                    const long long j = (long long)i * stride;
                    x[k][i] = in ? __ldcg(reinterpret_cast<const float4*>(src + j * HDP)) : make_float4(0.f, 0.f, 0.f, 0.f);
                    ml[k][i] = in ? __ldcg(reinterpret_cast<const float2*>(srm + 2 * j)) : make_float2(ninf, 0.f);
                }
            }
#pragma unroll
            for (int k = 0; k < FP; ++k) {
                const int e = e0 + k * ATT_THREADS;
                if (e >= pieces) break;
                float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
                float Mc = ninf, lw = 0.f;
#pragma unroll
                for (int i = 0; i < LD; ++i) {
                    if (i >= cnt) break;
                    hss_softmax_fold4(x[k][i], ml[k][i], acc, Mc, lw);
                }
                fold_slots(e, LD, cnt, acc, Mc, lw);
                const Part p{acc, make_float2(Mc, lw)};
                finish(e, st[k], oo[k], [&](int) { return p; });
            }
        }
    } else {   // pieces * chunks <= ATT_THREADS: one piece-chunk per thread
        const int e = tid % pieces, ch = tid / pieces;
        float oo[4] = {0.f, 0.f, 0.f, 0.f};
        float2 st = make_float2(ninf, 0.f);
        if (ch == 0 && to_state) st = state_of(e, oo);
        if (ch < chunks) {
            float Mc, lw;
            sums[tid] = chunk(e, ch, Mc, lw);
            chm[tid] = make_float2(Mc, lw);
        }
        __syncthreads();
        if (ch == 0)
            finish(e, st, oo, [&](int c2) { return Part{sums[c2 * pieces + e], chm[c2 * pieces + e]}; });
    }
    __syncthreads();   // every piece has read the state's and slot first's (m, l): the heads' are written now
    if (tid < a.hg) {
        const float4 h = hd4[tid];
        if (to_state) {
            a.m[tid] = h.x;
            a.l[tid] = h.y;
        } else {
            *reinterpret_cast<float2*>(a.part_ml + tid * a.row_ml + 2LL * first) = make_float2(h.x, h.y);
        }
    }
    if (!to_state) __threadfence();   // a group's slot is visible device-wide before the group is counted (the
    __syncthreads();                  // state's fold ends the tile: nothing in this launch reads what it wrote)
}

// The CTA's query heads as 16-byte pieces (piece p: head p / (HDP/8), dims 8 (p % (HDP/8)) ..), thread t holding
// pieces t, t + 256, ..: when q allows 16-byte loads, loaded before anything else (they depend on no other load)
// and stored to shared memory while the tile's count is loaded (else staged 2 bytes at a time there).
template <int HDP>
struct QPieces {
    static constexpr int N = (ATT_HG * HDP / 8 + ATT_THREADS - 1) / ATT_THREADS;
    uint4 v[N];
    bool vec;
};

template <int HDP>
__device__ __forceinline__ void store_q(const QPieces<HDP>& qp, const unsigned short* q, int hg, int hd,
                                        unsigned char* smem) {
    unsigned short* q_s = reinterpret_cast<unsigned short*>(smem + Cfg<HDP>::Q);
    if (!qp.vec) {
        for (int i = threadIdx.x; i < ATT_HG * HDP; i += ATT_THREADS) {
            const int r = i / HDP, d = i % HDP;
            q_s[r * Cfg<HDP>::RS + d] = (r < hg && d < hd) ? __ldg(q + r * hd + d) : (unsigned short)0;
        }
        return;
    }
#pragma unroll
    for (int i = 0; i < QPieces<HDP>::N; ++i) {
        const int p = threadIdx.x + i * ATT_THREADS, r = p / (HDP / 8), pc = p % (HDP / 8);
        if (r < ATT_HG) *reinterpret_cast<uint4*>(q_s + r * Cfg<HDP>::RS + pc * 8) = qp.v[i];
    }
}

template <int HDP>
__device__ __forceinline__ void load_q(QPieces<HDP>& qp, const unsigned short* q, int hg, int hd) {
    qp.vec = (hd & 7) == 0 && (reinterpret_cast<unsigned long long>(q) & 15) == 0;
    if (!qp.vec) return;
#pragma unroll
    for (int i = 0; i < QPieces<HDP>::N; ++i) {
        const int p = threadIdx.x + i * ATT_THREADS, r = p / (HDP / 8), pc = p % (HDP / 8);
        qp.v[i] = r < hg && pc * 8 < hd ? __ldg(reinterpret_cast<const uint4*>(q + r * hd + pc * 8))
                                        : make_uint4(0u, 0u, 0u, 0u);
    }
}

// Rope entry points: the CTA's query heads arrive un-rotated (rows of qkv) and are rotated at the newest token's
// position while the first unit stages them, after its first loads were issued (q and the cos / sin rows are
// read then: the K/V loads in flight hide them). With 16-byte loads (head_dim a multiple of 16, q and the tables
// 16-byte aligned) thread t takes pair piece t (head t / (HDP/16), dims 8 (t % (HDP/16)) .. of the first half and
// the same dims of the second; HDP pair pieces, one per thread at most) and stores both rotated (hss_rope_pair,
// rounded to bf16 as model_rope_kv rounds); otherwise every element is rotated 2 bytes at a time.
template <int HDP>
struct RopeQ {
    const unsigned short* q;   // the CTA's first query head (un-rotated)
    const float *cs, *sn;      // the newest token's cos / sin rows
    bool vec;
};

// Every query head row of the CTA's shared q, rotated (rows >= hg and dims >= head_dim zero).
template <int HDP>
__device__ __forceinline__ void store_rope_q(const RopeQ<HDP>& rq, int hg, int hd, unsigned char* smem) {
    constexpr int RS = Cfg<HDP>::RS;
    unsigned short* q_s = reinterpret_cast<unsigned short*>(smem + Cfg<HDP>::Q);
    const int half = hd >> 1;
    if (!rq.vec) {
        for (int i = threadIdx.x; i < ATT_HG * HDP; i += ATT_THREADS) {
            const int r = i / HDP, d = i % HDP;
            unsigned short y = 0;
            if (r < hg && d < hd) {
                const int j = d < half ? d : d - half;
                float r1, r2;
                hss_rope_pair(hss_bf16_lo(__ldg(rq.q + r * hd + j)), hss_bf16_lo(__ldg(rq.q + r * hd + j + half)),
                              __ldg(rq.cs + j), __ldg(rq.sn + j), r1, r2);
                y = __bfloat16_as_ushort(hss_f32_to_bf16(d < half ? r1 : r2));
            }
            q_s[r * RS + d] = y;
        }
        return;
    }
    const int t = threadIdx.x, r = t / (HDP / 16), pc = t % (HDP / 16);
    const bool mine = t < HDP && r < hg && pc * 8 < half;
    uint4 x1 = make_uint4(0u, 0u, 0u, 0u), x2 = x1;
    float4 c0 = make_float4(0.f, 0.f, 0.f, 0.f), c1 = c0, s0 = c0, s1 = c0;
    if (mine) {
        x1 = __ldg(reinterpret_cast<const uint4*>(rq.q + r * hd + pc * 8));
        x2 = __ldg(reinterpret_cast<const uint4*>(rq.q + r * hd + half + pc * 8));
        c0 = __ldg(reinterpret_cast<const float4*>(rq.cs + pc * 8));
        c1 = __ldg(reinterpret_cast<const float4*>(rq.cs + pc * 8 + 4));
        s0 = __ldg(reinterpret_cast<const float4*>(rq.sn + pc * 8));
        s1 = __ldg(reinterpret_cast<const float4*>(rq.sn + pc * 8 + 4));
    }
    for (int i = threadIdx.x; i < ATT_HG * RS / 8; i += ATT_THREADS)   // zero rows and padding first
        reinterpret_cast<uint4*>(q_s)[i] = make_uint4(0u, 0u, 0u, 0u);
    __syncthreads();
    if (mine) {
        const uint32_t xa[4] = {x1.x, x1.y, x1.z, x1.w}, xb[4] = {x2.x, x2.y, x2.z, x2.w};
        const float c[8] = {c0.x, c0.y, c0.z, c0.w, c1.x, c1.y, c1.z, c1.w};
        const float sv[8] = {s0.x, s0.y, s0.z, s0.w, s1.x, s1.y, s1.z, s1.w};
        uint32_t ya[4], yb[4];
#pragma unroll
        for (int w = 0; w < 4; ++w) {
            float a0, b0, a1, b1;
            hss_rope_pair(hss_bf16_lo(xa[w]), hss_bf16_lo(xb[w]), c[2 * w], sv[2 * w], a0, b0);
            hss_rope_pair(hss_bf16_hi(xa[w]), hss_bf16_hi(xb[w]), c[2 * w + 1], sv[2 * w + 1], a1, b1);
            ya[w] = hss_bf16_pack(hss_f32_to_bf16(a0), hss_f32_to_bf16(a1));
            yb[w] = hss_bf16_pack(hss_f32_to_bf16(b0), hss_f32_to_bf16(b1));
        }
        *reinterpret_cast<uint4*>(q_s + r * RS + pc * 8) = make_uint4(ya[0], ya[1], ya[2], ya[3]);
        *reinterpret_cast<uint4*>(q_s + r * RS + half + pc * 8) = make_uint4(yb[0], yb[1], yb[2], yb[3]);
    }
}

// One unit u: the warps' steps, the unit's partial, its count and the folds it completes.
template <int HDP, bool ROPE>
__device__ __forceinline__ void unit(const Args& a, int u, bool first_unit, unsigned char* smem,
                                     const RopeQ<HDP>& rq) {
    using C = Cfg<HDP>;
    constexpr int E = HDP / 8;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, c = lane & 3;
    const unsigned short* qs = reinterpret_cast<const unsigned short*>(smem + C::Q);
    unsigned short* ring = reinterpret_cast<unsigned short*>(smem + C::RINGS + warp * C::RING);
    const int u0 = u * a.unit, uend = min(u0 + a.unit, a.n_tok);
    const int groups = (uend - u0 + ATT_ROWS - 1) / ATT_ROWS;               // 8-token steps; step s -> warp s % 8
    const int ns = groups > warp ? (groups - warp + ATT_WARPS - 1) / ATT_WARPS : 0;
    auto t0_of = [&](int i) { return u0 + (i * ATT_WARPS + warp) * ATT_ROWS; };
    auto buffer = [&](int i) { return ring + (i % C::STAGES) * (C::STEP / 2); };
    // rope entry points: the warp whose step i_new holds the newest token (row r_new of it): stage() loaded that
    // row's k and v from qkv (un-rotated); the k row is rotated in place once the step has landed
    const RopeRow* rr = reinterpret_cast<const RopeRow*>(smem + C::ROPE);
    int i_new = -1, r_new = 0;
    if (ROPE && a.newest >= u0 && a.newest < uend && ((a.newest - u0) / ATT_ROWS) % ATT_WARPS == warp) {
        i_new = (a.newest - u0) / ATT_ROWS / ATT_WARPS;
        r_new = (a.newest - u0) % ATT_ROWS;
    }
    // the next issued step's page and slot: steps are issued in order, each ATT_WARPS * ATT_ROWS tokens on
    int cur_pg = 0, cur_slot = 0;
    {
        const int t = t0_of(0);
        cur_pg = t / a.bs;
        cur_slot = t - cur_pg * a.bs;
    }
    const int adv_pg = ATT_WARPS * ATT_ROWS / a.bs, adv_slot = ATT_WARPS * ATT_ROWS - adv_pg * a.bs;
    auto issue = [&](int i) {
        if (i < ns) {
            const int n = min(ATT_ROWS, uend - t0_of(i));
            if (n == ATT_ROWS && a.vec && cur_slot + ATT_ROWS <= a.bs && i != i_new)
                stage_full<HDP>(a, cur_pg, cur_slot, buffer(i), lane);
            else
                stage<HDP, ROPE>(a, t0_of(i), n, buffer(i), lane, i == i_new ? r_new : -1, rr);
        }
        hss_cp_commit();   // empty groups keep the count: hss_cp_wait<STAGES-1> always means "step i has landed"
        cur_pg += adv_pg;
        cur_slot += adv_slot;
        if (cur_slot >= a.bs) {
            cur_slot -= a.bs;
            ++cur_pg;
        }
    };
#pragma unroll
    for (int i = 0; i < C::STAGES - 1; ++i) issue(i);
    if (first_unit) {   // the query heads entry() staged (rope entry points: staged here, rotated)
        if (ROPE) store_rope_q<HDP>(rq, a.hg, a.hd, smem);
        __syncthreads();
    }
    const float sl2 = rsqrtf((float)a.hd) * 1.4426950408889634f;
    float m0 = hss_neg_inf(), m1 = hss_neg_inf(), l0 = 0.f, l1 = 0.f;
    float o[E][4];
#pragma unroll
    for (int j = 0; j < E; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
    for (int i = 0; i < ns; ++i) {
        issue(i + C::STAGES - 1);
        hss_cp_wait<C::STAGES - 1>();
        __syncwarp();
        if (ROPE && i == i_new) {   // the newest token's k row rotated in place; it and its v row into the pools
            unsigned short* kr = buffer(i) + r_new * C::RS;
            const unsigned short* vr = kr + ATT_ROWS * C::RS;
            const int half = a.hd >> 1;
            const float *cs = rr->cs, *sn = rr->sn;
            unsigned short *kw = rr->kw, *vw = rr->vw;
            const long long at = (long long)__ldg(a.blocks + a.newest / a.bs) * a.blk +
                                 (long long)(a.newest % a.bs) * a.tok;
            for (int j = lane; j < half; j += 32) {
                float r1, r2;
                hss_rope_pair(hss_bf16_lo(kr[j]), hss_bf16_lo(kr[j + half]), __ldg(cs + j), __ldg(sn + j), r1, r2);
                const unsigned short y1 = __bfloat16_as_ushort(hss_f32_to_bf16(r1));
                const unsigned short y2 = __bfloat16_as_ushort(hss_f32_to_bf16(r2));
                kr[j] = y1;
                kr[j + half] = y2;
                if (kw) {
                    kw[at + j] = y1;
                    kw[at + j + half] = y2;
                }
            }
            if (vw)
                for (int d = lane; d < a.hd; d += 32) vw[at + d] = vr[d];
            __syncwarp();
        }
        step<HDP>(qs, buffer(i), min(ATT_ROWS, uend - t0_of(i)), sl2, m0, m1, l0, l1, o, lane);
        __syncwarp();   // this stage is refilled next
    }
    hss_cp_wait<0>();
    ATT_PDL_WAIT();   // the previous launch's folds are done with the workspace, counters and state
    l0 += __shfl_xor_sync(HSS_FULL_MASK, l0, 1);
    l1 += __shfl_xor_sync(HSS_FULL_MASK, l1, 1);
    l0 += __shfl_xor_sync(HSS_FULL_MASK, l0, 2);
    l1 += __shfl_xor_sync(HSS_FULL_MASK, l1, 2);
    float2* wst = reinterpret_cast<float2*>(smem + C::FOLD);   // [warp][16] (m, l)
    float* wt = reinterpret_cast<float*>(smem + C::WT);        // [warp][16] the warps' weights
    float* ow = reinterpret_cast<float*>(smem + C::RINGS);     // [warp][16][OWS]
    float2* uml = wst + ATT_WARPS * ATT_HG;                     // [16] the unit's (m, l) when it is the tile's only
    const bool only = a.n_units == 1;
    __syncthreads();   // every ring has been read: they take the warps' o now
#pragma unroll
    for (int j = 0; j < E; ++j) {
        float* row0 = ow + (warp * ATT_HG + g) * C::OWS + 8 * j + 2 * c;
        *reinterpret_cast<float2*>(row0) = make_float2(o[j][0], o[j][1]);
        *reinterpret_cast<float2*>(row0 + 8 * C::OWS) = make_float2(o[j][2], o[j][3]);
    }
    if (c == 0) {
        wst[warp * ATT_HG + g] = make_float2(ns > 0 ? m0 : hss_neg_inf(), l0);
        wst[warp * ATT_HG + g + 8] = make_float2(ns > 0 ? m1 : hss_neg_inf(), l1);
    }
    __syncthreads();
    // The unit's partial: the warps' states combined in warp order (a warp with no step in this unit weighs 0).
    if (tid < a.hg) {
        float M = hss_neg_inf();
#pragma unroll
        for (int w = 0; w < ATT_WARPS; ++w) M = fmaxf(M, wst[w * ATT_HG + tid].x);
        float lacc = 0.f;
#pragma unroll
        for (int w = 0; w < ATT_WARPS; ++w) {
            const float2 ml = wst[w * ATT_HG + tid];
            const float x = ml.x == hss_neg_inf() ? 0.f : hss_softmax_weight(ml.x, M);
            wt[w * ATT_HG + tid] = x;
            if (ml.x != hss_neg_inf()) lacc = fmaf(ml.y, x, lacc);
        }
        if (only)
            uml[tid] = make_float2(M, lacc);
        else
            *reinterpret_cast<float2*>(a.part_ml + tid * a.row_ml + 2LL * u) = make_float2(M, lacc);
    }
    __syncthreads();
    auto combined = [&](int r, int d) {   // the unit's o at dims d .. d + 3 of query head r (>= head_dim: 0)
        float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
        for (int w = 0; w < ATT_WARPS; ++w) {
            const float x = wt[w * ATT_HG + r];
            hss_softmax_add4(acc, *reinterpret_cast<const float4*>(ow + (w * ATT_HG + r) * C::OWS + d), x);
        }
        return acc;
    };
    if (only) {   // the tile's only unit: folded into the state here (fold()'s ops on one slot, the same bits)
        float4* hd4 = reinterpret_cast<float4*>(smem + C::HEADS);
        for (int e = tid; e < a.hg * (HDP / 4); e += ATT_THREADS) {
            const int r = e / (HDP / 4), d = 4 * (e % (HDP / 4));
            float oo[4];
            const float2 st = load_state(a, !a.fresh, r, d, oo);
            float4 cacc = make_float4(0.f, 0.f, 0.f, 0.f);
            float Mc = hss_neg_inf(), lw = 0.f;
            hss_softmax_fold4(combined(r, d), uml[r], cacc, Mc, lw);
            const float M = fmaxf(st.x, Mc), sc = hss_softmax_weight(Mc, M);
            float4 sum = make_float4(0.f, 0.f, 0.f, 0.f);
            hss_softmax_add4(sum, cacc, sc);
            const float2 h = fold_state(a, r, d, st, oo, M, sum, fmaf(lw, sc, 0.f), 1);
            if (d == 0) hd4[r] = make_float4(h.x, h.y, 0.f, 0.f);
        }
        __syncthreads();   // every piece has read the state's (m, l)
        if (tid < a.hg) {
            a.m[tid] = hd4[tid].x;
            a.l[tid] = hd4[tid].y;
        }
        __syncthreads();
        return;
    }
    for (int e = tid; e < a.hg * (HDP / 4); e += ATT_THREADS) {
        const int r = e / (HDP / 4), d = 4 * (e % (HDP / 4));
        *reinterpret_cast<float4*>(a.part_o + r * a.row_o + (long long)u * HDP + d) = combined(r, d);
    }
    __threadfence();   // the partial is visible device-wide before this CTA counts it
    __syncthreads();
    // Count it; the last unit of a group folds the group, the last group the groups.
    int* flag = reinterpret_cast<int*>(smem + C::FLAG);
    const bool direct = a.n_units <= ATT_GROUP || a.n_units * a.hg * HDP <= ATT_FOLD_DIRECT;
    const int grp = direct ? 0 : u / ATT_GROUP, n_groups = direct ? 1 : (a.n_units + ATT_GROUP - 1) / ATT_GROUP;
    const int gs = direct ? a.n_units : min(ATT_GROUP, a.n_units - grp * ATT_GROUP);
    if (tid == 0) {
        const bool last = atomicAdd(a.count + grp, 1u) + 1u == (unsigned)gs;
        if (last) {
            __threadfence();
            a.count[grp] = 0u;
        }
        *flag = last ? (n_groups == 1 ? 2 : 1) : 0;
    }
    __syncthreads();
    const int what = *flag;
    if (what == 2) {
        fold<HDP>(a, 0, 1, a.n_units, true, smem);
    } else if (what == 1) {
        fold<HDP>(a, grp * ATT_GROUP, 1, gs, false, smem);
        if (tid == 0) {
            const bool last = atomicAdd(a.count + ATT_GROUP, 1u) + 1u == (unsigned)n_groups;
            if (last) {
                __threadfence();
                a.count[ATT_GROUP] = 0u;
            }
            *flag = last ? 3 : 0;
        }
        __syncthreads();
        if (*flag == 3) {
            fold<HDP>(a, 0, ATT_GROUP, n_groups, true, smem);
        }
    }
    __syncthreads();   // the rings, (m, l) areas and flag are reused by the next unit
}

template <int HDP, bool ROPE>
__device__ __forceinline__ void run(const Args& a, unsigned char* smem, const RopeQ<HDP>& rq) {
    const int z = blockIdx.z;
    if (a.n_units == 0) {   // an empty tile: CTA 0 writes the state as it is (fresh: the initial one)
        if (z == 0) {
            ATT_PDL_WAIT();
            fold<HDP>(a, 0, 1, 0, true, smem);
        }
        return;
    }
    if (z >= a.n_units) return;
    if constexpr (ROPE) {   // the first unit stages the rotated q: its registers are free after it
        unit<HDP, ROPE>(a, z, true, smem, rq);
        for (int u = z + (int)gridDim.z; u < a.n_units; u += gridDim.z) unit<HDP, ROPE>(a, u, false, smem, rq);
    } else {
        for (int u = z; u < a.n_units; u += gridDim.z) unit<HDP, ROPE>(a, u, u == z, smem, rq);
    }
}

template <int HDP, bool ROPE>
__device__ __forceinline__ void entry(const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k_pool,
                                      const __nv_bfloat16* __restrict__ v_pool, ATT_TILE_PARAMS,
                                      const float* __restrict__ cos_t, const float* __restrict__ sin_t, int max_pos,
                                      unsigned char* smem) {
    ATT_PDL_TRIGGER();
    const int seq = blockIdx.x;
    if (head_dim <= 0 || head_dim > ATT_MAX_HD || gqa_ratio <= 0 || num_kv_heads <= 0 || max_units <= 0 ||
        blockDim.x != ATT_THREADS || blockDim.y != 1 || blockDim.z != 1 || (ROPE && (head_dim & 1)))
        return;
    const int groups = (gqa_ratio + ATT_HG - 1) / ATT_HG;
    const int kh = blockIdx.y / groups, h0 = (blockIdx.y % groups) * ATT_HG;
    if (kh >= num_kv_heads) return;
    if (hdp_of(head_dim) != HDP) return;
    unsigned have;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(have));
    if (have < (unsigned)Cfg<HDP>::BYTES) return;
    const long long row0 = (long long)seq * num_q_heads + (long long)kh * gqa_ratio + h0;   // first q head's row
    const int hg = min(ATT_HG, gqa_ratio - h0);
    // rope entry points: q holds qkv rows [num_seqs][num_q_heads + 2 num_kv_heads][head_dim]
    const long long qkv_row = (long long)seq * (num_q_heads + 2 * num_kv_heads);
    const unsigned short* qh = reinterpret_cast<const unsigned short*>(q) +
                               (ROPE ? qkv_row + (long long)kh * gqa_ratio + h0 : row0) * head_dim;
    QPieces<HDP> qp;
    RopeQ<HDP> rq;
    rq.q = qh;
    rq.cs = rq.sn = nullptr;
    rq.vec = false;
    if (!ROPE) load_q<HDP>(qp, qh, hg, head_dim);
    const int target = Cfg<HDP>::TARGET;
    const int n_tok = ROPE || (fresh & 2) ? tile_tokens_counted(tile_block_counts, seq, tile_capacity, block_size,
                                                                last_block_valid_slots)
                                          : tile_tokens(tile_block_counts, seq, tile_capacity, block_size,
                                                        last_block_valid_slots);
    long long pos = 0;   // rope: the newest token's position (the tile's token t is at last_block_valid_slots + t)
    if (ROPE && n_tok > 0) {
        pos = (long long)last_block_valid_slots + n_tok - 1;
        if (pos < 0 || pos >= max_pos) return;   // no table row: nothing written (as model_rope_kv)
        rq.cs = cos_t + pos * (head_dim >> 1);
        rq.sn = sin_t + pos * (head_dim >> 1);
        rq.vec = (head_dim & 15) == 0 &&
                 ((reinterpret_cast<unsigned long long>(qh) | reinterpret_cast<unsigned long long>(rq.cs) |
                   reinterpret_cast<unsigned long long>(rq.sn)) & 15) == 0;
    }
    if (!ROPE)   // while the count's load is in flight; the first unit's barrier publishes it
        store_q<HDP>(qp, qh, hg, head_dim, smem);
    Args a;
    a.n_tok = n_tok;
    a.unit = 0;
    a.n_units = 0;
    if (n_tok > 0) {
        const long long u = unit_tokens(n_tok, (int)(gridDim.x * gridDim.y), target, Cfg<HDP>::UNIT_MIN);
        const long long nu = (n_tok + u - 1) / u;
        if (nu > max_units) return;   // max_units does not cover the tile (a broken launch contract)
        a.unit = (int)u;
        a.n_units = (int)nu;
    }
    a.q = qh;
    a.k = reinterpret_cast<const unsigned short*>(k_pool) + kh * kvh_stride;
    a.v = reinterpret_cast<const unsigned short*>(v_pool) + kh * kvh_stride;
    a.blocks = tile_blocks + (long long)seq * tile_capacity;
    a.row_ml = 2LL * max_units;
    a.row_o = (long long)max_units * HDP;
    a.part_ml = part_ml + row0 * a.row_ml;
    a.part_o = part_o + row0 * a.row_o;
    a.m = m + row0;
    a.l = l + row0;
    a.o = o + row0 * head_dim;
    a.out = out ? reinterpret_cast<unsigned short*>(out) + row0 * head_dim : nullptr;
    a.count = merge_count + ((long long)seq * gridDim.y + blockIdx.y) * ATT_COUNTERS;
    a.blk = blk_stride;
    a.tok = tok_stride;
    a.hd = head_dim;
    a.bs = block_size;
    a.hg = hg;
    a.fresh = (fresh & 1) != 0;
    a.vec = (head_dim & 7) == 0 &&
            ((reinterpret_cast<unsigned long long>(a.k) | reinterpret_cast<unsigned long long>(a.v)) & 15) == 0 &&
            ((blk_stride | tok_stride) & 7) == 0 &&
            (!ROPE || (reinterpret_cast<unsigned long long>(q) & 15) == 0);
    a.newest = ROPE && n_tok > 0 ? n_tok - 1 : -1;
    if (ROPE) {   // the newest token's rows, for the step that holds it (published before any unit stages)
        if (threadIdx.x == 0) {
            RopeRow* rr = reinterpret_cast<RopeRow*>(smem + Cfg<HDP>::ROPE);
            rr->knew = reinterpret_cast<const unsigned short*>(q) + (qkv_row + num_q_heads + kh) * head_dim;
            rr->vnew = reinterpret_cast<const unsigned short*>(q) + (qkv_row + num_q_heads + num_kv_heads + kh) * head_dim;
            rr->cs = rq.cs;
            rr->sn = rq.sn;
            rr->kw = h0 == 0 ? const_cast<unsigned short*>(a.k) : nullptr;   // one CTA row per kv head writes it
            rr->vw = h0 == 0 ? const_cast<unsigned short*>(a.v) : nullptr;
        }
        __syncthreads();
    }
    run<HDP, ROPE>(a, smem, rq);
}

}  // namespace

// One entry point per padded head dim (the host picks it: hss.decls.attention.step_kernel_name), each with
// its own register budget: HDP 256 one CTA per SM, HDP 64 and 128 two. Same parameters, same contract.
extern "C" __global__ void __launch_bounds__(ATT_THREADS, 2) paged_decode_attn_tiled_64(ATT_STEP_PARAMS) {
    extern __shared__ __align__(16) unsigned char att_smem[];
    entry<64, false>(q, k_pool, v_pool, ATT_TILE_ARGS, nullptr, nullptr, 0, att_smem);
}

extern "C" __global__ void __launch_bounds__(ATT_THREADS, 2) paged_decode_attn_tiled_128(ATT_STEP_PARAMS) {
    extern __shared__ __align__(16) unsigned char att_smem[];
    entry<128, false>(q, k_pool, v_pool, ATT_TILE_ARGS, nullptr, nullptr, 0, att_smem);
}

extern "C" __global__ void __launch_bounds__(ATT_THREADS, 1) paged_decode_attn_tiled_256(ATT_STEP_PARAMS) {
    extern __shared__ __align__(16) unsigned char att_smem[];
    entry<256, false>(q, k_pool, v_pool, ATT_TILE_ARGS, nullptr, nullptr, 0, att_smem);
}

// The rope entry points (one per padded head dim, the HDP's register budget): a token-count tile (any `fresh` & 2
// is implied) whose newest token, tile index n - 1 (n the tile's tokens; position last_block_valid_slots + n - 1),
// and the query arrive un-rotated: `q` is qkv bf16 [num_seqs, num_q_heads + 2 num_kv_heads, head_dim] (q | k | v
// heads), cos_t / sin_t f32 [max_pos, head_dim / 2]. The query heads and the newest token's k heads are rotated as
// model_rope_kv rotates them (same bits), that token's K/V rows are written into the pools at its page and slot
// (CTA rows of group 0) and attended from the rotated values; the rest is the tiled step above, the same bits as
// model_rope_kv followed by the token-count tile. head_dim even; a position outside [0, max_pos): nothing written.
extern "C" __global__ void __launch_bounds__(ATT_THREADS, 2) paged_decode_attn_rope_64(ATT_ROPE_PARAMS) {
    extern __shared__ __align__(16) unsigned char att_smem[];
    entry<64, true>(q, k_pool, v_pool, ATT_TILE_ARGS, cos_t, sin_t, max_pos, att_smem);
}

extern "C" __global__ void __launch_bounds__(ATT_THREADS, 2) paged_decode_attn_rope_128(ATT_ROPE_PARAMS) {
    extern __shared__ __align__(16) unsigned char att_smem[];
    entry<128, true>(q, k_pool, v_pool, ATT_TILE_ARGS, cos_t, sin_t, max_pos, att_smem);
}

extern "C" __global__ void __launch_bounds__(ATT_THREADS, 1) paged_decode_attn_rope_256(ATT_ROPE_PARAMS) {
    extern __shared__ __align__(16) unsigned char att_smem[];
    entry<256, true>(q, k_pool, v_pool, ATT_TILE_ARGS, cos_t, sin_t, max_pos, att_smem);
}
