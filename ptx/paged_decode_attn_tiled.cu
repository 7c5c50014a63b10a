// paged_decode_attn_tiled.cu: one tile of streaming (online-softmax) decode attention (SPEC §6.3, restructured
// as split + merge under SPEC §0).
//
// A tile's tokens (every slot of every listed page, except the last page's min(lbvs, bs) slots) are cut into
// fixed units of ATT_UNIT = 1024 tokens counted from the tile's start, and each unit into 64-token chunks of 8
// rows per warp: warp w of 8 takes rows 8w..8w+7 of every chunk. CTA z of one (sequence, kv head, group of 4
// query heads) takes units z, z + gridDim.z, ...; each of its warps stages its own rows (a 2-deep cp.async
// ring per warp, no block barrier inside a unit) and keeps an online-softmax state per query head:
//   x_t = dot(q, K_t) * rsqrtf(head_dim);  per 8-row step: m' = max(m, max_t x_t), a = __expf(m - m'),
//   p_t = __expf(x_t - m'), l' = l*a + p_t (per lane), o' = o*a + sum_t p_t*V_t    (f32 throughout).
// At the end of a unit the 8 warp states are combined (warp order) into the unit's partial (m_u, l_u, o_u),
// written to the workspace. The last CTA of a (sequence, kv head, head group) to finish (an atomic counter
// that resets itself) folds the tile's units, in unit order, into the running state (m, l, o):
//   M = max(m, m_0..m_{U-1});  l' = l*e^(m-M) + sum_u l_u*e^(m_u-M);  o' = o*e^(m-M) + sum_u o_u*e^(m_u-M)
// and, when `out` is not null, also writes out = bf16(o' * (l' > 0 ? 1/l' : 0)) (what attention_finalize
// writes from that state). Every unit is computed the same way whichever CTA runs it and however many units
// the launch has room for, so a tile's result depends only on its token list: replaying the same pages in
// the same tiles gives the same bits (pool layout, tile_capacity, the grid and the other sequences of the
// launch do not matter). Splitting the pages into other tiles changes the rounding only.
//
// paged_decode_attn_tiled(q, k_pool, v_pool, tile_blocks, tile_block_counts, part_ml, part_o, m, l, o, out,
//     merge_count, num_q_heads, num_kv_heads, head_dim, block_size, tile_capacity, gqa_ratio, max_units,
//     blk_stride, tok_stride, kvh_stride, last_block_valid_slots, fresh)
//   q                 bf16 [num_seqs, num_q_heads, head_dim]
//   k_pool, v_pool    bf16, element (page, tok, kv_head, d) at page*blk_stride + tok*tok_stride + kv_head*kvh_stride + d
//                     (element strides, i64; NHD pool (bs*nkv*hd, nkv*hd, hd); HSS scratch slots (2*nkv*gs, hd, gs))
//   tile_blocks       i32 [num_seqs, tile_capacity] page ids of this tile in order (trusted: the host cannot
//                     check device-resident ids); tile_block_counts i32 [num_seqs] (clamped to 0..tile_capacity)
//   part_ml           f32 [num_seqs*num_q_heads, max_units, 2] (m_u, l_u), part_o f32 [num_seqs*num_q_heads,
//                     max_units, HDP] (HDP = head_dim padded to 64, 128 or 256): the tile's units only
//   m, l              f32 [num_seqs*num_q_heads], o f32 [num_seqs*num_q_heads, head_dim]: read then written
//                     (fresh != 0: not read, taken as m = -inf, l = 0, o = 0, the state begin_step asks for)
//   out               bf16 [num_seqs, num_q_heads, head_dim] or null
//   merge_count       u32 [num_seqs * num_kv_heads * ceil(gqa_ratio/4)], zero between launches
//   max_units = ceil(tile_capacity*block_size / 1024) (the partial arrays' row stride).
//   Launch: grid (num_seqs, num_kv_heads * ceil(gqa_ratio/4), Z), 1 <= Z <= max_units (any Z gives the same
//   bits), block (256,1,1), dynamic shared memory Shape<HDP>::BYTES = 8*2*(2*8*HDP*2) + 1536 bytes (65.5 KiB at
//   head_dim 128: the host raises the function's 48 KiB limit). A sequence whose tile has no tokens keeps its
//   state (fresh: gets the initial state); CTA z = 0 writes it (and out).
// head_dim <= 256 (any value; rows are padded to 64, 128 or 256 in shared memory). Loads are 16-byte cp.async
// when the pools, strides and head_dim allow it, else 2-byte loads; both stage the same values.
#include "hss_async.cuh"
#include "hss_common.cuh"

#define ATT_THREADS 256
#define ATT_WARPS 8
#define ATT_ROWS 8      // rows per warp per step (a chunk is ATT_WARPS * ATT_ROWS = 64 tokens)
#ifndef ATT_UNIT
#define ATT_UNIT 1024   // tokens per partial state (fixed: the result of a tile depends on it)
#endif
#define ATT_SPU (ATT_UNIT / (ATT_WARPS * ATT_ROWS))   // steps per warp per full unit
#define ATT_HG 4        // query heads per CTA
#define ATT_MAX_HD 256
#ifndef ATT_STAGES
#define ATT_STAGES 2    // steps staged per warp (the one computed and the next)
#endif

namespace {

// Shared memory, in bytes: per warp a ring of ATT_STAGES steps (bf16 K [8][HDP] then V [8][HDP]); then the
// per-warp p row (f32 [32]), the unit-end warp states (m, l: f32 [8][4] each) and each warp's o buffer index.
// The fold of the last CTA reuses the stage area.
template <int HDP>
struct Shape {
    static constexpr int E = HDP / 32;                                // dims per lane
    static constexpr int STEP = 2 * ATT_ROWS * HDP * 2;               // one staged step of one warp
    static constexpr int WARP_RING = ATT_STAGES * STEP;
    static constexpr int PS = ATT_WARPS * WARP_RING;                  // f32 [8][32]
    static constexpr int MS = PS + ATT_WARPS * 32 * 4;                // f32 [8][4]
    static constexpr int LS = MS + ATT_WARPS * ATT_HG * 4;            // f32 [8][4]
    static constexpr int BS = LS + ATT_WARPS * ATT_HG * 4;            // i32 [8] o buffer of each warp, + flag
    static constexpr int BYTES = BS + 256;
    static_assert(BYTES == 8 * ATT_STAGES * (2 * 8 * HDP * 2) + 1536, "documented size");
    static_assert(ATT_WARPS * ATT_HG * HDP * 4 + ATT_WARPS * ATT_HG * 4 * 2 <= PS, "fold scratch fits the rings");
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

// E consecutive bf16 values at p (4*E-byte aligned) as f32.
template <int E>
__device__ __forceinline__ void load_row(const unsigned short* p, float (&f)[E]) {
    if constexpr (E == 2) {
        const unsigned w = *reinterpret_cast<const unsigned*>(p);
        f[0] = hss_bf16_lo(w); f[1] = hss_bf16_hi(w);
    } else if constexpr (E == 4) {
        const uint2 w = *reinterpret_cast<const uint2*>(p);
        f[0] = hss_bf16_lo(w.x); f[1] = hss_bf16_hi(w.x); f[2] = hss_bf16_lo(w.y); f[3] = hss_bf16_hi(w.y);
    } else {
        const uint4 w = *reinterpret_cast<const uint4*>(p);
        f[0] = hss_bf16_lo(w.x); f[1] = hss_bf16_hi(w.x); f[2] = hss_bf16_lo(w.y); f[3] = hss_bf16_hi(w.y);
        f[4] = hss_bf16_lo(w.z); f[5] = hss_bf16_hi(w.z); f[6] = hss_bf16_lo(w.w); f[7] = hss_bf16_hi(w.w);
    }
}

// Transposing butterfly: 2*OFF partial sums per lane in, after the steps OFF, OFF/2, .., 1 lane L holds in v[0]
// the full sum (over all 32 lanes) of value index L. Each step keeps half of the values (the upper half on lanes
// with that bit set) and adds the partner's matching half.
template <int OFF>
__device__ __forceinline__ void butterfly(float (&v)[32], int lane) {
    const bool up = lane & OFF;
#pragma unroll
    for (int i = 0; i < OFF; ++i) {
        const float send = up ? v[i] : v[i + OFF];
        const float keep = up ? v[i + OFF] : v[i];
        v[i] = keep + __shfl_xor_sync(HSS_FULL_MASK, send, OFF);
    }
    if constexpr (OFF > 1) butterfly<OFF / 2>(v, lane);
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
    unsigned* count;
    long long blk, tok, row_ml, row_o;
    int hd, bs, hg, n_tok, n_units;
    bool vec, fresh;
};

// Stage warp step (unit u, step j) of warp w: rows t0..t0+7, t0 = u*UNIT + (j*8 + w)*8 (one cp.async group per
// lane; the caller commits). Rows past the tile and dims >= head_dim are zero.
template <int HDP>
__device__ __forceinline__ void stage(const Args& a, int t0, unsigned short* ks, int lane) {
    constexpr int PPR = HDP / 8;   // 16-byte pieces per row
    unsigned short* vs = ks + ATT_ROWS * HDP;
    const int n = min(ATT_ROWS, a.n_tok - t0);
    if (a.vec) {
#pragma unroll
        for (int p = lane; p < ATT_ROWS * PPR; p += 32) {
            const int r = p / PPR, pc = p % PPR;
            uint4* dk = reinterpret_cast<uint4*>(ks + r * HDP + pc * 8);
            uint4* dv = reinterpret_cast<uint4*>(vs + r * HDP + pc * 8);
            if (r < n && pc * 8 < a.hd) {
                const int t = t0 + r;
                const long long off =
                    (long long)__ldg(a.blocks + t / a.bs) * a.blk + (long long)(t % a.bs) * a.tok + pc * 8;
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
                const long long off = (long long)__ldg(a.blocks + t / a.bs) * a.blk + (long long)(t % a.bs) * a.tok + d;
                xk = __ldg(a.k + off);
                xv = __ldg(a.v + off);
            }
            ks[r * HDP + d] = xk;
            vs[r * HDP + d] = xv;
        }
    }
}

// Warp state: running max m (lane L: head L%4), per-lane sum l, o[h][e] for dims lane*E + e.
template <int E>
struct WarpState {
    float m, l, o[ATT_HG][E];
    __device__ __forceinline__ void reset() {
        m = hss_neg_inf();
        l = 0.0f;
#pragma unroll
        for (int h = 0; h < ATT_HG; ++h)
#pragma unroll
            for (int e = 0; e < E; ++e) o[h][e] = 0.0f;
    }
};

// One 8-row step of one warp: rows [t0, t0 + n) staged in ks (K) and ks + 8*HDP (V).
template <int HDP>
__device__ __forceinline__ void step(const float (&q)[ATT_HG][HDP / 32], const unsigned short* ks, int n,
                                     float scale, WarpState<HDP / 32>& st, float* ps, int lane) {
    constexpr int E = HDP / 32;
    const unsigned short* vs = ks + ATT_ROWS * HDP;
    // Logits: lane holds dims [E*lane, E*lane+E) of each row; 32 partial dots (8 rows x 4 heads) summed across
    // lanes by the transposing butterfly, after which lane L holds the dot of row L/4, head L%4.
    float v[32];
#pragma unroll
    for (int r = 0; r < ATT_ROWS; ++r) {
        float kf[E];
        load_row<E>(ks + r * HDP + lane * E, kf);
#pragma unroll
        for (int h = 0; h < ATT_HG; ++h) {
            float dot = 0.0f;
#pragma unroll
            for (int e = 0; e < E; ++e) dot = fmaf(q[h][e], kf[e], dot);
            v[r * ATT_HG + h] = dot;
        }
    }
    butterfly<16>(v, lane);
    const float x = (lane >> 2) < n ? v[0] * scale : hss_neg_inf();
    float mx = fmaxf(x, __shfl_xor_sync(HSS_FULL_MASK, x, 4));
    mx = fmaxf(mx, __shfl_xor_sync(HSS_FULL_MASK, mx, 8));
    mx = fmaxf(mx, __shfl_xor_sync(HSS_FULL_MASK, mx, 16));
    const float m_new = fmaxf(st.m, mx);               // finite: row 0 of a step is always a token
    const float alpha = __expf(st.m - m_new);          // st.m = -inf (nothing yet): 0
    const float p = __expf(x - m_new);                 // x = -inf (no token): 0
    st.l = fmaf(st.l, alpha, p);
    st.m = m_new;
    ps[lane] = p;
    float al[ATT_HG];
#pragma unroll
    for (int h = 0; h < ATT_HG; ++h) al[h] = __shfl_sync(HSS_FULL_MASK, alpha, h);
    __syncwarp();
#pragma unroll
    for (int h = 0; h < ATT_HG; ++h)
#pragma unroll
        for (int e = 0; e < E; ++e) st.o[h][e] *= al[h];
#pragma unroll
    for (int r = 0; r < ATT_ROWS; ++r) {
        const float4 pr = *reinterpret_cast<const float4*>(ps + r * ATT_HG);
        const float pv[ATT_HG] = {pr.x, pr.y, pr.z, pr.w};
        float vf[E];
        load_row<E>(vs + r * HDP + lane * E, vf);
#pragma unroll
        for (int h = 0; h < ATT_HG; ++h)
#pragma unroll
            for (int e = 0; e < E; ++e) st.o[h][e] = fmaf(pv[h], vf[e], st.o[h][e]);
    }
    __syncwarp();   // ps and this stage are rewritten next
}

// Steps of warp w in unit u (a prefix of 0..SPU-1: only the tile's last unit is short).
__device__ __forceinline__ int warp_steps(const Args& a, int u, int w) {
    const int rows = min(ATT_UNIT, a.n_tok - u * ATT_UNIT);               // tokens of the unit
    const int groups = (rows + ATT_ROWS - 1) / ATT_ROWS;                  // 8-row groups; group g -> warp g % 8
    return groups > w ? (groups - w + ATT_WARPS - 1) / ATT_WARPS : 0;
}

// Fold the tile's units (in unit order) into the running state, write it (and out): one CTA.
template <int HDP>
__device__ __forceinline__ void fold(const Args& a, unsigned char* smem) {
    using S = Shape<HDP>;
    constexpr int E = S::E;                     // float4s per lane
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    float* red = reinterpret_cast<float*>(smem);                           // f32 [8][4*HDP]
    float* mxs = red + ATT_WARPS * ATT_HG * HDP;                          // f32 [8][4]
    float* lsum = mxs + ATT_WARPS * ATT_HG;                               // f32 [8][4]
    const int nu = a.n_units;
    // M_h = max(m_old, max_u m_u)
#pragma unroll
    for (int h = 0; h < ATT_HG; ++h) {
        float mx = hss_neg_inf();
        if (h < a.hg)
            for (int u = tid; u < nu; u += ATT_THREADS) mx = fmaxf(mx, __ldcg(a.part_ml + h * a.row_ml + 2 * u));
        mx = hss_warp_max(mx);
        if (lane == 0) mxs[warp * ATT_HG + h] = mx;
    }
    __syncthreads();
    float M[ATT_HG], m_old[ATT_HG], l_old[ATT_HG];   // read before anything is written (barrier below)
#pragma unroll
    for (int h = 0; h < ATT_HG; ++h) {
        m_old[h] = (a.fresh || h >= a.hg) ? hss_neg_inf() : a.m[h];
        l_old[h] = (a.fresh || h >= a.hg) ? 0.0f : a.l[h];
        float mx = m_old[h];
#pragma unroll
        for (int w = 0; w < ATT_WARPS; ++w) mx = fmaxf(mx, mxs[w * ATT_HG + h]);
        M[h] = mx;
    }
    // warp w folds units w, w+8, ...; lane's float4 k covers flat (head, dim) 4*(lane + 32k) of [4][HDP]
    float4 acc[E];
    float lacc[ATT_HG];
#pragma unroll
    for (int k = 0; k < E; ++k) acc[k] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
    for (int h = 0; h < ATT_HG; ++h) lacc[h] = 0.0f;
    for (int u = warp; u < nu; u += ATT_WARPS) {
        float wgt[ATT_HG];
#pragma unroll
        for (int h = 0; h < ATT_HG; ++h) {
            if (h < a.hg) {
                const float2 ml = __ldcg(reinterpret_cast<const float2*>(a.part_ml + h * a.row_ml + 2 * u));
                wgt[h] = __expf(ml.x - M[h]);
                lacc[h] = fmaf(ml.y, wgt[h], lacc[h]);
            } else {
                wgt[h] = 0.0f;
            }
        }
#pragma unroll
        for (int k = 0; k < E; ++k) {
            const int f = 4 * (lane + 32 * k), h = f / HDP, d = f % HDP;
            if (h < a.hg) {
                const float* src = a.part_o + h * a.row_o + (long long)u * HDP + d;
                const float4 x = __ldcg(reinterpret_cast<const float4*>(src));
                acc[k].x = fmaf(x.x, wgt[h], acc[k].x);
                acc[k].y = fmaf(x.y, wgt[h], acc[k].y);
                acc[k].z = fmaf(x.z, wgt[h], acc[k].z);
                acc[k].w = fmaf(x.w, wgt[h], acc[k].w);
            }
        }
    }
#pragma unroll
    for (int k = 0; k < E; ++k)
        *reinterpret_cast<float4*>(red + warp * ATT_HG * HDP + 4 * (lane + 32 * k)) = acc[k];
    if (lane == 0)
#pragma unroll
        for (int h = 0; h < ATT_HG; ++h) lsum[warp * ATT_HG + h] = lacc[h];
    __syncthreads();
    for (int i = tid; i < ATT_HG * HDP; i += ATT_THREADS) {
        const int h = i / HDP, d = i % HDP;
        if (h >= a.hg || d >= a.hd) continue;
        float tot = 0.0f, ltot = 0.0f;
#pragma unroll
        for (int w = 0; w < ATT_WARPS; ++w) {
            tot += red[w * ATT_HG * HDP + i];
            ltot += lsum[w * ATT_HG + h];
        }
        float m2, l2, o2;
        const float o_old = a.fresh ? 0.0f : a.o[h * a.hd + d];
        if (nu == 0) {   // nothing attended: the state as it is (fresh: the initial state)
            m2 = m_old[h];
            l2 = l_old[h];
            o2 = o_old;
        } else {
            const float s_old = __expf(m_old[h] - M[h]);   // m_old = -inf (fresh state): 0
            m2 = M[h];
            l2 = fmaf(l_old[h], s_old, ltot);
            o2 = fmaf(o_old, s_old, tot);
        }
        a.o[h * a.hd + d] = o2;
        if (d == 0) {
            a.m[h] = m2;
            a.l[h] = l2;
        }
        if (a.out) {
            const float inv = l2 > 0.0f ? 1.0f / l2 : 0.0f;
            a.out[h * a.hd + d] = __bfloat16_as_ushort(hss_f32_to_bf16(o2 * inv));
        }
    }
}

template <int HDP>
__device__ __forceinline__ void run(const Args& a, unsigned char* smem) {
    using S = Shape<HDP>;
    constexpr int E = S::E;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int z = blockIdx.z, Z = gridDim.z;
    float* ps = reinterpret_cast<float*>(smem + S::PS) + warp * 32;
    float* ms = reinterpret_cast<float*>(smem + S::MS);
    float* ls = reinterpret_cast<float*>(smem + S::LS);
    int* bufs = reinterpret_cast<int*>(smem + S::BS);
    unsigned short* ring = reinterpret_cast<unsigned short*>(smem + warp * S::WARP_RING);
    auto buffer = [&](int it) { return ring + (it % ATT_STAGES) * (S::STEP / 2); };

    if (z < a.n_units) {
        // Query heads (zero past the group and head_dim), dims lane*E .. lane*E+E-1.
        float q[ATT_HG][E];
#pragma unroll
        for (int h = 0; h < ATT_HG; ++h)
#pragma unroll
            for (int e = 0; e < E; ++e) {
                const int d = lane * E + e;
                q[h][e] = (h < a.hg && d < a.hd) ? hss_bf16_lo(__ldg(a.q + h * a.hd + d)) : 0.0f;
            }
        const float scale = rsqrtf((float)a.hd);

        // This warp's steps, in order over the CTA's units: a flat index it -> (unit z + (it / SPU) * Z, step
        // it % SPU); steps past the tile's end are skipped (they are the last unit's tail).
        auto t0_of = [&](int it) {
            return (z + (it / ATT_SPU) * Z) * ATT_UNIT + ((it % ATT_SPU) * ATT_WARPS + warp) * ATT_ROWS;
        };
        auto stage_or_skip = [&](int it) {
            const int u = z + (it / ATT_SPU) * Z;
            if (u < a.n_units && (it % ATT_SPU) < warp_steps(a, u, warp)) stage<HDP>(a, t0_of(it), buffer(it), lane);
            hss_cp_commit();   // empty groups keep the count: hss_cp_wait<STAGES-1> always means "step it has landed"
        };
#pragma unroll
        for (int i = 0; i < ATT_STAGES - 1; ++i) stage_or_skip(i);
        WarpState<E> st;
        const int n_mine = (a.n_units - z + Z - 1) / Z;   // units of this CTA
        for (int k = 0; k < n_mine; ++k) {
            const int u = z + k * Z;
            const int ns = warp_steps(a, u, warp);
            st.reset();
            for (int j = 0; j < ns; ++j) {
                const int it = k * ATT_SPU + j;
                stage_or_skip(it + ATT_STAGES - 1);
                hss_cp_wait<ATT_STAGES - 1>();
                __syncwarp();
                step<HDP>(q, buffer(it), min(ATT_ROWS, a.n_tok - t0_of(it)), scale, st, ps, lane);
            }
            // This warp's state: l summed over the lanes of each head; o into the buffer of the step just
            // consumed (refilled only after the unit's second barrier).
            st.l += __shfl_xor_sync(HSS_FULL_MASK, st.l, 4);
            st.l += __shfl_xor_sync(HSS_FULL_MASK, st.l, 8);
            st.l += __shfl_xor_sync(HSS_FULL_MASK, st.l, 16);
            float* ob = reinterpret_cast<float*>(buffer(k * ATT_SPU + max(ns, 1) - 1));
            if (ns > 0) {
#pragma unroll
                for (int h = 0; h < ATT_HG; ++h)
#pragma unroll
                    for (int e = 0; e < E; ++e) ob[h * HDP + lane * E + e] = st.o[h][e];
            }
            if (lane < ATT_HG) {
                ms[warp * ATT_HG + lane] = ns > 0 ? st.m : hss_neg_inf();
                ls[warp * ATT_HG + lane] = st.l;
            }
            if (lane == 0) bufs[warp] = (int)((reinterpret_cast<unsigned char*>(ob) - smem) / 4);
            __syncthreads();
            // The unit's partial: the warps' states combined in warp order.
            for (int i = tid; i < ATT_HG * HDP; i += ATT_THREADS) {
                const int h = i / HDP, d = i % HDP;
                if (h >= a.hg) continue;
                float M = hss_neg_inf();
#pragma unroll
                for (int w = 0; w < ATT_WARPS; ++w) M = fmaxf(M, ms[w * ATT_HG + h]);
                float o = 0.0f, l = 0.0f;
#pragma unroll
                for (int w = 0; w < ATT_WARPS; ++w) {
                    const float mw = ms[w * ATT_HG + h];
                    if (mw == hss_neg_inf()) continue;   // a warp with no row in this unit
                    const float e = __expf(mw - M);
                    o = fmaf(reinterpret_cast<const float*>(smem)[bufs[w] + h * HDP + d], e, o);
                    l = fmaf(ls[w * ATT_HG + h], e, l);
                }
                a.part_o[h * a.row_o + (long long)u * HDP + d] = o;   // dims >= head_dim: 0
                if (d == 0) *reinterpret_cast<float2*>(a.part_ml + h * a.row_ml + 2 * u) = make_float2(M, l);
            }
            __threadfence();   // the partials are visible device-wide before this CTA counts its units
            __syncthreads();   // the o buffers are refilled next
        }
        hss_cp_wait<0>();
        // The last CTA of this (sequence, kv head, head group) folds the units.
        __shared__ bool last;
        if (tid == 0) {
            __threadfence();
            const unsigned done = atomicAdd(a.count, (unsigned)n_mine) + (unsigned)n_mine;
            last = done == (unsigned)a.n_units;
            if (last) {
                __threadfence();
                *a.count = 0u;
            }
        }
        __syncthreads();
        if (!last) return;
    } else if (!(a.n_units == 0 && z == 0)) {
        return;   // no unit for this CTA (z = 0 of an empty tile writes the state)
    }
    fold<HDP>(a, smem);
}

}  // namespace

extern "C" __global__ void __launch_bounds__(ATT_THREADS, 2)
paged_decode_attn_tiled(const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k_pool,
                        const __nv_bfloat16* __restrict__ v_pool, const int* __restrict__ tile_blocks,
                        const int* __restrict__ tile_block_counts, float* __restrict__ part_ml,
                        float* __restrict__ part_o, float* __restrict__ m, float* __restrict__ l,
                        float* __restrict__ o, __nv_bfloat16* __restrict__ out,
                        unsigned* __restrict__ merge_count, int num_q_heads, int num_kv_heads, int head_dim,
                        int block_size, int tile_capacity, int gqa_ratio, int max_units, long long blk_stride,
                        long long tok_stride, long long kvh_stride, int last_block_valid_slots, int fresh) {
    extern __shared__ __align__(16) unsigned char att_smem[];
    const int seq = blockIdx.x;
    if (head_dim <= 0 || head_dim > ATT_MAX_HD || gqa_ratio <= 0 || num_kv_heads <= 0) return;
    const int groups = (gqa_ratio + ATT_HG - 1) / ATT_HG;
    const int kh = blockIdx.y / groups, h0 = (blockIdx.y % groups) * ATT_HG;
    if (kh >= num_kv_heads) return;
    const int n_tok = tile_tokens(tile_block_counts, seq, tile_capacity, block_size, last_block_valid_slots);
    Args a;
    a.n_tok = n_tok;
    a.n_units = min((n_tok + ATT_UNIT - 1) / ATT_UNIT, max_units);
    const int hdp = hdp_of(head_dim);
    const long long row0 = (long long)seq * num_q_heads + (long long)kh * gqa_ratio + h0;   // first q head's row
    a.q = reinterpret_cast<const unsigned short*>(q) + row0 * head_dim;
    a.k = reinterpret_cast<const unsigned short*>(k_pool) + kh * kvh_stride;
    a.v = reinterpret_cast<const unsigned short*>(v_pool) + kh * kvh_stride;
    a.blocks = tile_blocks + (long long)seq * tile_capacity;
    a.row_ml = 2LL * max_units;
    a.row_o = (long long)max_units * hdp;
    a.part_ml = part_ml + row0 * a.row_ml;
    a.part_o = part_o + row0 * a.row_o;
    a.m = m + row0;
    a.l = l + row0;
    a.o = o + row0 * head_dim;
    a.out = out ? reinterpret_cast<unsigned short*>(out) + row0 * head_dim : nullptr;
    a.count = merge_count + (long long)seq * num_kv_heads * groups + blockIdx.y;
    a.blk = blk_stride;
    a.tok = tok_stride;
    a.hd = head_dim;
    a.bs = block_size;
    a.hg = min(ATT_HG, gqa_ratio - h0);
    a.fresh = fresh != 0;
    a.vec = (head_dim & 7) == 0 &&
            ((reinterpret_cast<unsigned long long>(a.k) | reinterpret_cast<unsigned long long>(a.v)) & 15) == 0 &&
            ((blk_stride | tok_stride) & 7) == 0;
    switch (hdp) {
        case 64: run<64>(a, att_smem); break;
        case 128: run<128>(a, att_smem); break;
        default: run<256>(a, att_smem); break;
    }
}
