// paged_decode_attn_tiled.cu: one tile of streaming (online-softmax) decode attention (SPEC §6.3, restructured
// as split + merge under SPEC §0).
//
// A tile's tokens (every slot of every listed page, except the last page's min(lbvs, bs) slots) are cut into
// fixed chunks of ATT_CHUNK = 64 tokens counted from the tile's start. CTA z of one (sequence, kv head) of
// paged_decode_attn_tiled takes chunks z, z + gridDim.z, ... (staging the next chunk's K and V rows in shared
// memory with cp.async while it computes the current one) and serves every query head of that kv head (GQA)
// from the staged rows, writing a partial state per (seq, q head, chunk):
//   m_c = max_t x_t,  l_c = sum_t p_t,  o_c[d] = sum_t p_t * V_t[d],  p_t = __expf(x_t - m_c),
//   x_t = dot(q, K_t) * rsqrtf(head_dim)        (f32 throughout; P stays f32 in the P.V product).
// paged_decode_attn_merge then folds the tile's chunks, in chunk order, into the running state (m, l, o):
//   M = max(m, m_0..m_{C-1});  l' = l*e^(m-M) + sum_c l_c*e^(m_c-M);  o' = o*e^(m-M) + sum_c o_c*e^(m_c-M).
// Every chunk is computed the same way whichever CTA runs it and however many chunks the launch has room
// for, so a tile's result depends only on its token list: replaying the same pages in the same tiles gives
// the same bits (pool layout, tile_capacity and the other sequences of the launch do not matter). Splitting
// the pages into other tiles changes the rounding only (both are exact attention up to SPEC §0's bound).
//
// paged_decode_attn_tiled(Q, K_pool, V_pool, tile_blocks, tile_block_counts, part_ml, part_o, num_q_heads,
//     num_kv_heads, head_dim, block_size, tile_capacity, gqa_ratio, max_chunks, blk_stride, tok_stride,
//     kvh_stride, last_block_valid_slots)
//   Q                 bf16 [num_seqs, num_q_heads, head_dim]
//   K_pool, V_pool    bf16, element (page, tok, kv_head, d) at page*blk_stride + tok*tok_stride + kv_head*kvh_stride + d
//                     (element strides, i64; NHD pool (bs*nkv*hd, nkv*hd, hd); HSS scratch slots (2*nkv*gs, hd, gs))
//   tile_blocks       i32 [num_seqs, tile_capacity] page ids of this tile in order (trusted: the host cannot
//                     check device-resident ids); tile_block_counts i32 [num_seqs] (clamped to 0..tile_capacity)
//   part_ml           f32 [num_seqs*num_q_heads, max_chunks, 2] (m_c, l_c), part_o f32 [num_seqs*num_q_heads,
//                     max_chunks, head_dim]: written for the tile's chunks only
//   max_chunks = ceil(tile_capacity*block_size / 64) (the partial arrays' row stride).
//   Launch: grid (num_seqs, num_kv_heads, Z), 1 <= Z <= max_chunks (any Z gives the same bits; the host picks
//   about two CTAs per SM), block (256,1,1), dynamic shared memory Shape<HDP>::BYTES (76 KiB at head_dim 128:
//   the host raises the function's 48 KiB limit). CTAs with no chunk of the tile return at once.
// paged_decode_attn_merge(tile_block_counts, part_ml, part_o, m, l, o, merge_count, num_q_heads, head_dim,
//     block_size, tile_capacity, max_chunks, last_block_valid_slots, fresh)
//   m, l f32 [num_seqs*num_q_heads], o f32 [num_seqs*num_q_heads, head_dim] (read then written; fresh != 0:
//   not read, taken as the initial state m = -inf, l = 0, o = 0, which is what begin_step asked for);
//   merge_count u32 [num_seqs*num_q_heads], zero between launches (the last CTA of a row resets it).
//   Launch: grid (num_seqs, num_q_heads, ceil(head_dim/32)), block (1024,1,1), no dynamic shared memory.
//   A sequence whose tile has no tokens keeps its state (fresh: gets the initial state).
// head_dim <= 256 (any value; rows are padded to 64, 128 or 256 in shared memory). Loads are 16-byte cp.async
// when the pools, strides and head_dim allow it, else 2-byte loads; both stage the same values.
#include "hss_common.cuh"

#define ATT_THREADS 256
#define ATT_CHUNK 64   // tokens per chunk (fixed: the result of a tile depends on it)
#define ATT_HG 4       // query heads served per pass over the staged chunk
#define ATT_MAX_HD 256
#define ATT_STAGES 3   // chunks in flight per CTA (the one computed and the next two)
#define MERGE_THREADS 1024

namespace {

// Compile-time shape for head_dim rounded up to HDP (64, 128 or 256).
template <int HDP>
struct Shape {
    static constexpr int E = HDP / 32;              // logits: dims per lane
    static constexpr int DPT = HDP == 256 ? 4 : 2;  // P.V: dims per thread
    static constexpr int TPR = HDP / DPT;           // P.V: threads per row
    static constexpr int RG = ATT_THREADS / TPR;    // P.V: row groups (8, 4, 4)
    static constexpr int RPG = ATT_CHUNK / RG;      // P.V: rows per group
    static constexpr int SC = ATT_CHUNK + 1;        // logits row pitch (padded against bank conflicts)
    // shared memory layout, in bytes: two stages of (K, V) chunks, then the per-chunk work arrays
    static constexpr int STAGE = 2 * ATT_CHUNK * HDP * 2;         // bf16 K [CHUNK][HDP] then V [CHUNK][HDP]
    static constexpr int RED = ATT_STAGES * STAGE;                // f32 [RG][HG][HDP]
    static constexpr int QS = RED + RG * ATT_HG * HDP * 4;        // f32 [HG][HDP]
    static constexpr int PS = QS + ATT_HG * HDP * 4;              // f32 [CHUNK][HG]
    static constexpr int SCS = PS + ATT_CHUNK * ATT_HG * 4;       // f32 [HG][SC]
    static constexpr int BYTES = SCS + ATT_HG * SC * 4;
    static_assert(BYTES <= 227 * 1024, "shared memory per CTA");
};

__device__ __forceinline__ int hdp_of(int hd) { return hd <= 64 ? 64 : (hd <= 128 ? 128 : 256); }

// Tokens of this tile for sequence `seq` (both kernels compute it the same way): every slot of every
// entry, except the last entry's min(lbvs, bs) slots. 0 when the arguments make no sense.
__device__ __forceinline__ int tile_tokens(const int* __restrict__ counts, int seq, int capacity, int bs, int lbvs,
                                           int& n_blocks, int& last_slots) {
    if (bs <= 0 || capacity < 0) return 0;
    n_blocks = counts[seq];
    n_blocks = n_blocks < 0 ? 0 : (n_blocks > capacity ? capacity : n_blocks);
    last_slots = lbvs < 0 ? 0 : min(lbvs, bs);
    return n_blocks == 0 ? 0 : (n_blocks - 1) * bs + last_slots;
}

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
    const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem) : "memory");
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }

__device__ __forceinline__ float bf16_lo(unsigned w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf16_hi(unsigned w) { return __uint_as_float(w & 0xffff0000u); }

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
        v[i] = keep + __shfl_xor_sync(0xffffffffu, send, OFF);
    }
    if constexpr (OFF > 1) butterfly<OFF / 2>(v, lane);
}

struct Args {
    const unsigned short* q;   // this sequence's first query head of the kv head
    const unsigned short* k;   // pools, already offset to the kv head
    const unsigned short* v;
    const int* blocks;         // this sequence's page ids
    float* part_ml;            // row (seq, first q head of the kv head), chunk 0
    float* part_o;
    long long blk, tok, row_step_ml, row_step_o;
    int hd, bs, g, n_tok;
    bool vec;
};

// Stage chunk c's K and V rows (one cp.async group): rows past the tile and dims >= head_dim are zero.
template <int HDP>
__device__ __forceinline__ void stage(const Args& a, int c, unsigned short* ks) {
    constexpr int PPR = HDP / 8;   // 16-byte pieces per staged row
    unsigned short* vs = ks + ATT_CHUNK * HDP;
    const int tid = threadIdx.x, t0 = c * ATT_CHUNK, n = min(ATT_CHUNK, a.n_tok - t0);
    if (a.vec) {
#pragma unroll
        for (int p = tid; p < ATT_CHUNK * PPR; p += ATT_THREADS) {
            const int r = p / PPR, pc = p % PPR;
            uint4* dk = reinterpret_cast<uint4*>(ks + r * HDP + pc * 8);
            uint4* dv = reinterpret_cast<uint4*>(vs + r * HDP + pc * 8);
            if (r < n && pc * 8 < a.hd) {
                const int t = t0 + r;
                const long long off = (long long)__ldg(a.blocks + t / a.bs) * a.blk + (long long)(t % a.bs) * a.tok + pc * 8;
                cp_async16(dk, a.k + off);
                cp_async16(dv, a.v + off);
            } else {
                *dk = make_uint4(0u, 0u, 0u, 0u);
                *dv = make_uint4(0u, 0u, 0u, 0u);
            }
        }
    } else {
        for (int p = tid; p < ATT_CHUNK * HDP; p += ATT_THREADS) {
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
    cp_commit();
}

// Query heads h0 .. h0+HG-1 of the kv head as f32 [HG][HDP] (zero past gqa_ratio and head_dim).
template <int HDP>
__device__ __forceinline__ void load_q(const Args& a, int h0, float* qs) {
    for (int i = threadIdx.x; i < ATT_HG * HDP; i += ATT_THREADS) {
        const int h = i / HDP, d = i % HDP;
        qs[i] = (h0 + h < a.g && d < a.hd) ? __uint_as_float((unsigned)__ldg(a.q + (h0 + h) * a.hd + d) << 16) : 0.0f;
    }
}

// One chunk's partial states for every query head of the kv head (K and V staged in ks, vs).
template <int HDP>
__device__ __forceinline__ void chunk(const Args& a, const unsigned short* ks, const unsigned short* vs, int n,
                                      float* part_ml, float* part_o, float* red, unsigned char* smem) {
    using S = Shape<HDP>;
    constexpr int E = S::E, DPT = S::DPT, TPR = S::TPR, RG = S::RG, RPG = S::RPG, SC = S::SC;
    float* qs = reinterpret_cast<float*>(smem + S::QS);
    float* ps = reinterpret_cast<float*>(smem + S::PS);
    float* sc = reinterpret_cast<float*>(smem + S::SCS);
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int hd = a.hd;
    const float scale = rsqrtf((float)hd);
    for (int h0 = 0; h0 < a.g; h0 += ATT_HG) {
        if (a.g > ATT_HG) load_q<HDP>(a, h0, qs);   // one head group: loaded once per CTA (run)
        __syncthreads();   // everyone's copies of the chunk have landed; qs is written

        // Logits: warp w takes rows 8w..8w+7; lane holds dims [E*lane, E*lane+E) of each row and head. The
        // 32 partial dots (8 rows x 4 heads) are summed across lanes by a transposing butterfly, after which
        // lane L holds the complete dot of row 8w + L/4, head L%4.
        {
            float qr[ATT_HG][E];
#pragma unroll
            for (int h = 0; h < ATT_HG; ++h)
#pragma unroll
                for (int e = 0; e < E; ++e) qr[h][e] = qs[h * HDP + lane * E + e];
            float v[32];
#pragma unroll
            for (int rr = 0; rr < 8; ++rr) {
                const unsigned short* kr = ks + (warp * 8 + rr) * HDP + lane * E;
                float kf[E];
                if constexpr (E == 2) {
                    const unsigned w = *reinterpret_cast<const unsigned*>(kr);
                    kf[0] = bf16_lo(w); kf[1] = bf16_hi(w);
                } else if constexpr (E == 4) {
                    const uint2 w = *reinterpret_cast<const uint2*>(kr);
                    kf[0] = bf16_lo(w.x); kf[1] = bf16_hi(w.x); kf[2] = bf16_lo(w.y); kf[3] = bf16_hi(w.y);
                } else {
                    const uint4 w = *reinterpret_cast<const uint4*>(kr);
                    kf[0] = bf16_lo(w.x); kf[1] = bf16_hi(w.x); kf[2] = bf16_lo(w.y); kf[3] = bf16_hi(w.y);
                    kf[4] = bf16_lo(w.z); kf[5] = bf16_hi(w.z); kf[6] = bf16_lo(w.w); kf[7] = bf16_hi(w.w);
                }
#pragma unroll
                for (int h = 0; h < ATT_HG; ++h) {
                    float dot = 0.0f;
#pragma unroll
                    for (int e = 0; e < E; ++e) dot = fmaf(qr[h][e], kf[e], dot);
                    v[rr * ATT_HG + h] = dot;
                }
            }
            butterfly<16>(v, lane);
            sc[(lane % ATT_HG) * SC + warp * 8 + lane / ATT_HG] = v[0] * scale;
        }
        __syncthreads();

        // Softmax of the chunk, warp h for head h: m_c, p_t = __expf(x_t - m_c), l_c.
        if (warp < ATT_HG) {
            const int h = warp;
            float p0 = 0.0f, p1 = 0.0f;
            if (h0 + h < a.g) {
                const float x0 = lane < n ? sc[h * SC + lane] : -INFINITY;
                const float x1 = lane + 32 < n ? sc[h * SC + lane + 32] : -INFINITY;
                const float m = hss_warp_max(fmaxf(x0, x1));
                p0 = lane < n ? __expf(x0 - m) : 0.0f;
                p1 = lane + 32 < n ? __expf(x1 - m) : 0.0f;
                const float l = hss_warp_sum(p0 + p1);
                if (lane == 0) {
                    float* ml = part_ml + (h0 + h) * a.row_step_ml;
                    ml[0] = m;
                    ml[1] = l;
                }
            }
            ps[lane * ATT_HG + h] = p0;
            ps[(lane + 32) * ATT_HG + h] = p1;
        }
        __syncthreads();

        // P.V: thread (row group rg, dims d0..d0+DPT-1) over its rows, then the row groups summed in order.
        {
            const int rg = tid / TPR, d0 = (tid % TPR) * DPT;
            float acc[ATT_HG][DPT];
#pragma unroll
            for (int h = 0; h < ATT_HG; ++h)
#pragma unroll
                for (int e = 0; e < DPT; ++e) acc[h][e] = 0.0f;
            const int r_end = min(RPG, n - rg * RPG);
#pragma unroll 4
            for (int j = 0; j < r_end; ++j) {
                const int r = rg * RPG + j;
                const float4 p = *reinterpret_cast<const float4*>(ps + r * ATT_HG);
                float vf[DPT];
                if constexpr (DPT == 2) {
                    const unsigned w = *reinterpret_cast<const unsigned*>(vs + r * HDP + d0);
                    vf[0] = bf16_lo(w); vf[1] = bf16_hi(w);
                } else {
                    const uint2 w = *reinterpret_cast<const uint2*>(vs + r * HDP + d0);
                    vf[0] = bf16_lo(w.x); vf[1] = bf16_hi(w.x); vf[2] = bf16_lo(w.y); vf[3] = bf16_hi(w.y);
                }
                const float pv[ATT_HG] = {p.x, p.y, p.z, p.w};
#pragma unroll
                for (int h = 0; h < ATT_HG; ++h)
#pragma unroll
                    for (int e = 0; e < DPT; ++e) acc[h][e] = fmaf(pv[h], vf[e], acc[h][e]);
            }
#pragma unroll
            for (int h = 0; h < ATT_HG; ++h) {
                float* dst = red + (rg * ATT_HG + h) * HDP + d0;
                if constexpr (DPT == 2) *reinterpret_cast<float2*>(dst) = make_float2(acc[h][0], acc[h][1]);
                else *reinterpret_cast<float4*>(dst) = make_float4(acc[h][0], acc[h][1], acc[h][2], acc[h][3]);
            }
        }
        __syncthreads();
        for (int i = tid; i < ATT_HG * HDP; i += ATT_THREADS) {
            const int h = i / HDP, d = i % HDP;
            if (h0 + h < a.g && d < hd) {
                float s = red[h * HDP + d];
#pragma unroll
                for (int rg = 1; rg < RG; ++rg) s += red[(rg * ATT_HG + h) * HDP + d];
                part_o[(h0 + h) * a.row_step_o + d] = s;
            }
        }
        __syncthreads();   // qs, sc, ps and red are reused by the next head group; the stage by the next chunk
    }
}

template <int HDP>
__device__ __forceinline__ void run(const Args& a, unsigned char* smem) {
    using S = Shape<HDP>;
    float* red = reinterpret_cast<float*>(smem + S::RED);
    const int hd = a.hd;
    const int n_chunks = (a.n_tok + ATT_CHUNK - 1) / ATT_CHUNK;

    // This CTA's chunks: blockIdx.z, + gridDim.z, ...; chunks i+1 and i+2 are staged while chunk i is computed
    // (a ring of ATT_STAGES buffers; a buffer is refilled only after the barrier that ends its chunk).
    const int z = gridDim.z;
    auto buffer = [&](int it) { return reinterpret_cast<unsigned short*>(smem + (it % ATT_STAGES) * S::STAGE); };
    int c = blockIdx.z;
    stage<HDP>(a, c, buffer(0));
    if (a.g <= ATT_HG) load_q<HDP>(a, 0, reinterpret_cast<float*>(smem + S::QS));   // read by every chunk
    if (c + z < n_chunks) stage<HDP>(a, c + z, buffer(1));
    else cp_commit();
    for (int it = 0; c < n_chunks; c += z, ++it) {
        if (c + 2 * z < n_chunks) stage<HDP>(a, c + 2 * z, buffer(it + 2));
        else cp_commit();   // empty groups keep the count: wait<2> always means "chunk c has landed"
        cp_wait<2>();
        const unsigned short* ks = buffer(it);
        const int n = min(ATT_CHUNK, a.n_tok - c * ATT_CHUNK);
        chunk<HDP>(a, ks, ks + ATT_CHUNK * HDP, n, a.part_ml + 2LL * c, a.part_o + (long long)c * hd, red, smem);
    }
}

}  // namespace

extern "C" __global__ void __launch_bounds__(ATT_THREADS, 2)
paged_decode_attn_tiled(const __nv_bfloat16* __restrict__ Q, const __nv_bfloat16* __restrict__ K_pool,
                        const __nv_bfloat16* __restrict__ V_pool, const int* __restrict__ tile_blocks,
                        const int* __restrict__ tile_block_counts, float* __restrict__ part_ml,
                        float* __restrict__ part_o, int num_q_heads, int num_kv_heads, int head_dim, int block_size,
                        int tile_capacity, int gqa_ratio, int max_chunks, long long blk_stride, long long tok_stride,
                        long long kvh_stride, int last_block_valid_slots) {
    extern __shared__ __align__(16) unsigned char att_smem[];
    const int seq = blockIdx.x, kh = blockIdx.y, c = blockIdx.z;
    if (head_dim <= 0 || head_dim > ATT_MAX_HD || gqa_ratio <= 0 || kh >= num_kv_heads || c >= max_chunks) return;
    int n_blocks = 0, last_slots = 0;
    const int n_tok = tile_tokens(tile_block_counts, seq, tile_capacity, block_size, last_block_valid_slots,
                                  n_blocks, last_slots);
    if (c * ATT_CHUNK >= n_tok) return;   // no chunk of the tile for this CTA

    Args a;
    const long long row0 = (long long)seq * num_q_heads + (long long)kh * gqa_ratio;   // first q head's state row
    a.q = reinterpret_cast<const unsigned short*>(Q) + row0 * head_dim;
    a.k = reinterpret_cast<const unsigned short*>(K_pool) + kh * kvh_stride;
    a.v = reinterpret_cast<const unsigned short*>(V_pool) + kh * kvh_stride;
    a.blocks = tile_blocks + (long long)seq * tile_capacity;
    a.row_step_ml = 2LL * max_chunks;
    a.row_step_o = (long long)max_chunks * head_dim;
    a.part_ml = part_ml + row0 * a.row_step_ml;
    a.part_o = part_o + row0 * a.row_step_o;
    a.blk = blk_stride;
    a.tok = tok_stride;
    a.hd = head_dim;
    a.bs = block_size;
    a.g = gqa_ratio;
    a.n_tok = n_tok;
    a.vec = (head_dim & 7) == 0 &&
            ((reinterpret_cast<unsigned long long>(a.k) | reinterpret_cast<unsigned long long>(a.v)) & 15) == 0 &&
            ((blk_stride | tok_stride) & 7) == 0;
    switch (hdp_of(head_dim)) {
        case 64: run<64>(a, att_smem); break;
        case 128: run<128>(a, att_smem); break;
        default: run<256>(a, att_smem); break;
    }
}

extern "C" __global__ void __launch_bounds__(MERGE_THREADS)
paged_decode_attn_merge(const int* __restrict__ tile_block_counts, const float* __restrict__ part_ml,
                        const float* __restrict__ part_o, float* __restrict__ m_state, float* __restrict__ l_state,
                        float* __restrict__ o_state, unsigned* __restrict__ merge_count, int num_q_heads, int head_dim,
                        int block_size, int tile_capacity, int max_chunks, int last_block_valid_slots, int fresh) {
    constexpr int W = MERGE_THREADS / 32;
    __shared__ float wmax[W], wl[W], wo[W][32];
    const int seq = blockIdx.x, qh = blockIdx.y;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    if (head_dim <= 0 || head_dim > ATT_MAX_HD) return;
    int n_blocks = 0, last_slots = 0;
    const int n_tok = tile_tokens(tile_block_counts, seq, tile_capacity, block_size, last_block_valid_slots,
                                  n_blocks, last_slots);
    const int n_chunks = min((n_tok + ATT_CHUNK - 1) / ATT_CHUNK, max_chunks);
    const long long row = (long long)seq * num_q_heads + qh;
    const int d = blockIdx.z * 32 + lane;
    if (n_chunks <= 0) {   // nothing attended: the state stays as it is (a fresh state is written)
        if (fresh && warp == 0) {
            if (d < head_dim) o_state[row * head_dim + d] = 0.0f;
            if (blockIdx.z == 0 && lane == 0) {
                m_state[row] = -INFINITY;
                l_state[row] = 0.0f;
            }
        }
        return;
    }

    const float* ml = part_ml + row * 2LL * max_chunks;
    const float* po = part_o + row * (long long)max_chunks * head_dim;
    const float m_old = fresh ? -INFINITY : m_state[row], l_old = fresh ? 0.0f : l_state[row];

    float mx = -INFINITY;
    for (int c = tid; c < n_chunks; c += MERGE_THREADS) mx = fmaxf(mx, ml[2 * c]);
    mx = hss_warp_max(mx);
    if (lane == 0) wmax[warp] = mx;
    __syncthreads();
    float M = m_old;
#pragma unroll
    for (int w = 0; w < W; ++w) M = fmaxf(M, wmax[w]);

    // warp w folds chunks w, w+W, ... (in order); lane = one dim of this CTA's 32-dim slice
    float acc = 0.0f, lacc = 0.0f;
#pragma unroll 16
    for (int c = warp; c < n_chunks; c += W) {
        const float2 mlc = *reinterpret_cast<const float2*>(ml + 2 * c);
        const float w = __expf(mlc.x - M);
        lacc = fmaf(mlc.y, w, lacc);
        if (d < head_dim) acc = fmaf(po[(long long)c * head_dim + d], w, acc);
    }
    wo[warp][lane] = acc;
    if (lane == 0) wl[warp] = lacc;
    __syncthreads();
    if (warp == 0) {
        float tot = wo[0][lane], ltot = wl[0];
#pragma unroll
        for (int w = 1; w < W; ++w) {
            tot += wo[w][lane];
            ltot += wl[w];
        }
        const float s_old = __expf(m_old - M);   // m_old = -inf (fresh state): 0
        if (d < head_dim) {
            const float o_old = fresh ? 0.0f : o_state[row * head_dim + d];
            o_state[row * head_dim + d] = fmaf(o_old, s_old, tot);
        }
        // m and l are read by every dim slice of this row: the last slice to finish writes them
        if (lane == 0) {
            __threadfence();
            if (atomicAdd(merge_count + row, 1u) == gridDim.z - 1) {
                __threadfence();
                m_state[row] = M;
                l_state[row] = fmaf(l_old, s_old, ltot);
                merge_count[row] = 0u;
            }
        }
    }
}
