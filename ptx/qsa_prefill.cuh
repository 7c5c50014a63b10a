// qsa_prefill.cuh: the QSA prefill kernels (docs/design.md §12.5-12.8 as amended by docs/design.md §0), part of PTX
// module qsa_indexer (included at the end of qsa_indexer.cu).
// Built without --use_fast_math, as the original. All scalars u32 except theta/eps/inv_sqrt_d (f32).
// Tensor cores through inline PTX mma.sync (sm_80+), so the base compute_80 build carries everything.
// Every pointer below is assumed 16-byte aligned (allocations are) unless it says otherwise.
//
// qsa_qprep_rows(qk, q_norm_w, q_out, first_pos, qkw, n_heads, hd, rot, theta, eps)          [docs/design.md §12.5]
//   qk [rows, qkw] bf16 (query heads in the first n_heads*hd columns), q_norm_w [hd] bf16 (offset from 1),
//   q_out [rows, n_heads, hd] f32. Row r is at position first_pos + r. Per (row, head): x = f32(qk);
//   rms = rsqrtf(hss_block_sum(x^2)/hd + eps); normed = x*rms*(1+w); RoPE rotate-half on dims < rot with
//   double-precision angles (sincos(pos * exp(-(2j/rot) ln theta))), f32 out, no bf16 rounding.
//   Grid (rows, n_heads, 1), block (hd, 1, 1) with hd % 32 == 0, dynamic smem (hd + 32) * 4 B. rot is
//   clamped to hd (the launcher requires an even rot <= hd).
//
// qsa_score_rows(q, block_keys, scores, first_pos, score_stride, ratio, n_heads, hd, rows, n_blocks)
//   [docs/design.md §12.6; blocks on grid.x per docs/design.md §0; DEVIATION: `rows` and `n_blocks` (= the original's
//   n_blocks_max) are passed, because a CTA covers a 64 x 64 tile and the grid no longer encodes them]
//   q [rows, n_heads, hd] f32, block_keys [n, hd] bf16 (n >= min(n_blocks, (first_pos+rows)/ratio)),
//   scores [rows, score_stride] f32 (score_stride >= n_blocks). Entry (r, b), b < n_blocks:
//   -1e30 if b >= complete_r = (first_pos + r + 1) / ratio, else sum_h relu(q[r,h] . k[b]) * rsqrtf(hd)
//   (per-head dots f32 fma in d order, heads summed in order). b >= n_blocks is never written.
//   Grid (ceil(n_blocks/64), ceil(rows/64), 1), block (256, 1, 1), static smem 17 KB. Any hd >= 1.
//   Tile: q (64 rows x 32 d) and keys (64 blocks x 32 d) staged in smem as f32, 4 x 4 outputs per thread.
//
// qsa_score_rows_tc(q, block_keys, scores, first_pos, score_stride, ratio, n_blocks, rows)   [docs/design.md §12.7]
//   Same shapes and outputs as qsa_score_rows with n_heads = 4 and hd = 128 hard-coded. Split q:
//   q = hi + lo (hi = bf16(q), lo = bf16(q - f32(hi)), ~17 significant bits), keys bf16, f32 accumulation
//   in mma.sync.m16n8k16 (per k16 step: hi then lo into one accumulator), relu per head, heads summed in
//   f32 as (h0 + h2) + (h1 + h3), x rsqrtf(128). Entry (r, b), b < n_blocks: -1e30 if b >= complete_r =
//   (first_pos + r + 1) / ratio, else that sum; b >= n_blocks and rows >= `rows` are never written; keys are
//   read only below min(n_blocks, complete of the CTA's last row). DEVIATION (docs/design.md §0 allows it): `rows` is
//   an extra trailing parameter and every row is bounds-checked (q rows past it read as zeros, their scores
//   not stored), so q and scores need only `rows` rows, not the original's rounding up to 16 (nor to the
//   32-row CTA tile here). Grid (ceil(rows/32), Y, 1) for any Y in [1, ceil(n_blocks/64)] (CTA y
//   takes a contiguous run of ceil(ceil(n_blocks/64)/Y) 64-block chunks), block (256, 1, 1), static smem
//   48 KB (3 key stages). CTA: 32 rows; warp w's m16 fragment rows are its 4 score rows x 4 heads, its A
//   fragments (q hi/lo) held in registers for the whole CTA, all 64 blocks of a chunk per warp; the heads
//   are reduced in registers (one shuffle), no smem reduction; 64-block key chunks in a 3-stage cp.async
//   ring with one barrier per chunk.
//
// qsa_prefill_attn(q, k_cache, v_cache, block_table, lists, attn_out, first_pos, topk, ratio,
//                  block_size, nq, nkv, hd, inv_sqrt_d)                                          [docs/design.md §12.8]
//   q [rows, nq, hd] bf16 (roped), k_cache/v_cache paged NHD [pages, block_size, nkv, hd] bf16,
//   block_table [ceil((first_pos+rows)/block_size)] i32, lists [rows, topk] i32, attn_out [rows, nq, hd]
//   bf16. Row r (pos = first_pos + r, complete = (pos+1)/ratio) attends, per query head qh with kv head
//   qh / (nq/nkv), over tokens lists[r,i]*ratio + j (i < topk, j < ratio, list order) then the tail
//   complete*ratio .. pos: softmax(q.k * inv_sqrt_d) V, all f32, bf16 out. Needs hd % 32 == 0, hd <= 256,
//   nq % nkv == 0 (any GQA group). The general path: grid (rows, nkv * ceil(G/4), 1) with G = nq/nkv, one
//   CTA per (row, kv head, group of <= 4 query heads) so each K/V row it loads serves 4 heads; block
//   (256, 1, 1) = 8 warps over tokens t = w (mod 8), lane holds hd/32 dims; dynamic smem 128*hd + 256 B
//   for the merge of the 8 warps (warps 0..7 in order, __expf as the original).
//
// qsa_prefill_attn_tc(same parameters)                    fast path: hd in {64, 128, 256}, G = nq/nkv <= 16
//   Grid (rows, nkv, 1), block (64, 1, 1) = 2 warps, static smem 41 KB. One CTA per (row, kv head): the
//   G query heads are the 16 rows of m16n8k16 tiles, so each selected K/V row is read once per row for
//   all G heads. Warp w takes 8-token sub-chunks w, w+2, ...: S = Q K^T (bf16 mma, f32 accumulate),
//   online softmax in f32 (log2 domain, exp2f), P split into bf16 hi + lo (>= 16 bits, docs/design.md §0) for
//   O += P V (mma m16n8k8, each sub-chunk accumulated from zero then added to the f32 running O with
//   its rescale, so no long tensor-core accumulation chain). K/V rows arrive by cp.async (16 B) into a
//   2-stage per-warp ring; each lane reads back only what it copied (the hd index order inside a K row and
//   the column order of O are permuted so that a lane's fragments are contiguous 16-byte runs), so the
//   ring needs no barrier. The two warps merge through smem at the end.
#pragma once
#include "hss_async.cuh"
#include "hss_common.cuh"
#include "hss_mma.cuh"
#include "hss_rope.cuh"
#include "hss_softmax.cuh"

#define QSP_MASKED (-1e30f)

extern __shared__ __align__(16) unsigned char qsp_dynsmem[];

// ------------------------------------------------------------------------------------------------
// small helpers
// ------------------------------------------------------------------------------------------------
// Token t of a row's selection (t < sel = topk*ratio: list order; then the tail).
__device__ __forceinline__ unsigned qsp_token(unsigned t, unsigned sel, const int* __restrict__ list_r,
                                              unsigned ratio, unsigned complete) {
    if (t < sel) {
        const unsigned li = t / ratio;
        return (unsigned)list_r[li] * ratio + (t - li * ratio);
    }
    return complete * ratio + (t - sel);
}

// Element offset of token `tok`, kv head `kvh` in a paged NHD pool [pages, bs, nkv, hd].
__device__ __forceinline__ size_t qsp_row_offset(unsigned tok, const int* __restrict__ table, unsigned bs,
                                                 unsigned nkv, unsigned kvh, unsigned hd) {
    const unsigned pg = tok / bs;
    const size_t page = (size_t)(unsigned)table[pg];
    return ((page * bs + (tok - pg * bs)) * nkv + kvh) * (size_t)hd;
}

// ------------------------------------------------------------------------------------------------
// qsa_qprep_rows
// ------------------------------------------------------------------------------------------------
extern "C" __global__ void qsa_qprep_rows(const __nv_bfloat16* __restrict__ qk, const __nv_bfloat16* __restrict__ q_norm_w,
                                          float* __restrict__ q_out, unsigned first_pos, unsigned qkw, unsigned n_heads,
                                          unsigned hd, unsigned rot, float theta, float eps) {
    float* normed = reinterpret_cast<float*>(qsp_dynsmem);
    float* red = normed + hd;
    const unsigned r = blockIdx.x, h = blockIdx.y, d = threadIdx.x;
    if (h >= n_heads || hd == 0) return;   // uniform per CTA
    const float x = d < hd ? __bfloat162float(qk[(size_t)r * qkw + (size_t)h * hd + d]) : 0.f;
    const float ss = hss_block_sum<true>(x * x, red);
    const float rms = rsqrtf(ss / (float)hd + eps);
    if (d < hd) normed[d] = x * rms * (1.f + __bfloat162float(q_norm_w[d]));
    __syncthreads();
    if (d >= hd) return;
    const unsigned rot_e = rot < hd ? rot : hd;
    const float out = hss_rope(normed, d, rot_e, (double)(first_pos + r), theta);
    q_out[((size_t)r * n_heads + h) * hd + d] = out;
}

// ------------------------------------------------------------------------------------------------
// qsa_score_rows (scalar, tiled)
// ------------------------------------------------------------------------------------------------
#define QSP_SR_BM 64
#define QSP_SR_BN 64
#define QSP_SR_BK 32
#define QSP_SR_PAD 68   // floats per smem row: 64 + 4 keeps float4 rows 16-byte aligned

// Store 4 consecutive scores of row r starting at block b (b < n_blocks), masking b + e >= comp.
__device__ __forceinline__ void qsp_store4(float* __restrict__ scores, size_t row_base, unsigned b, unsigned n_blocks,
                                           unsigned comp, const float (&v)[4], float scale) {
    float o[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) o[e] = (b + e >= comp) ? QSP_MASKED : v[e] * scale;
    float* dst = scores + row_base + b;
    if (b + 3 < n_blocks && (reinterpret_cast<uintptr_t>(dst) & 15u) == 0) {
        *reinterpret_cast<float4*>(dst) = make_float4(o[0], o[1], o[2], o[3]);
    } else {
#pragma unroll
        for (int e = 0; e < 4; ++e)
            if (b + e < n_blocks) dst[e] = o[e];
    }
}

extern "C" __global__ void __launch_bounds__(256) qsa_score_rows(
    const float* __restrict__ q, const __nv_bfloat16* __restrict__ block_keys, float* __restrict__ scores,
    unsigned first_pos, unsigned score_stride, unsigned ratio, unsigned n_heads, unsigned hd, unsigned rows,
    unsigned n_blocks) {
    __shared__ __align__(16) float qs[QSP_SR_BK][QSP_SR_PAD];   // [d][row]
    __shared__ __align__(16) float ks[QSP_SR_BK][QSP_SR_PAD];   // [d][block]
    const unsigned b0 = blockIdx.x * QSP_SR_BN, r0 = blockIdx.y * QSP_SR_BM;
    if (ratio == 0 || b0 >= n_blocks || r0 >= rows) return;   // uniform per CTA
    const unsigned r_end = min(r0 + QSP_SR_BM, rows);
    const unsigned kb_lim = min(n_blocks, (first_pos + r_end) / ratio);   // blocks any row of the tile scores
    const unsigned t = threadIdx.x, ty = t >> 4, tx = t & 15u;
    float tot[4][4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) tot[i][j] = 0.f;

    if (b0 < kb_lim) {
        const bool qvec = (hd & 3u) == 0, kvec = (hd & 7u) == 0;
        for (unsigned h = 0; h < n_heads; ++h) {
            float acc[4][4];
#pragma unroll
            for (int i = 0; i < 4; ++i)
#pragma unroll
                for (int j = 0; j < 4; ++j) acc[i][j] = 0.f;
            for (unsigned d0 = 0; d0 < hd; d0 += QSP_SR_BK) {
#pragma unroll
                for (int k = 0; k < 2; ++k) {   // q tile: 64 rows x 32 dims, float4 pieces
                    const unsigned p = t + 256u * k, row = p >> 3, dq = (p & 7u) * 4, r = r0 + row, d = d0 + dq;
                    float v[4] = {0.f, 0.f, 0.f, 0.f};
                    if (r < rows) {
                        const float* src = q + ((size_t)r * n_heads + h) * hd + d;
                        if (qvec && d + 3 < hd) {
                            const float4 f = *reinterpret_cast<const float4*>(src);
                            v[0] = f.x; v[1] = f.y; v[2] = f.z; v[3] = f.w;
                        } else {
#pragma unroll
                            for (int e = 0; e < 4; ++e)
                                if (d + e < hd) v[e] = src[e];
                        }
                    }
#pragma unroll
                    for (int e = 0; e < 4; ++e) qs[dq + e][row] = v[e];
                }
                {   // key tile: 64 blocks x 32 dims, 8 bf16 per thread
                    const unsigned b = t >> 2, dq = (t & 3u) * 8, bb = b0 + b, d = d0 + dq;
                    float v[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
                    if (bb < kb_lim) {
                        const __nv_bfloat16* src = block_keys + (size_t)bb * hd + d;
                        if (kvec && d + 7 < hd) {
                            const uint4 u = *reinterpret_cast<const uint4*>(src);
                            const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
                            for (int e = 0; e < 4; ++e) {
                                v[2 * e] = hss_bf16_lo(w[e]);
                                v[2 * e + 1] = hss_bf16_hi(w[e]);
                            }
                        } else {
#pragma unroll
                            for (int e = 0; e < 8; ++e)
                                if (d + e < hd) v[e] = __bfloat162float(src[e]);
                        }
                    }
#pragma unroll
                    for (int e = 0; e < 8; ++e) ks[dq + e][b] = v[e];
                }
                __syncthreads();
#pragma unroll 8
                for (int kk = 0; kk < QSP_SR_BK; ++kk) {
                    const float4 a = *reinterpret_cast<const float4*>(&qs[kk][ty * 4]);
                    const float4 bk = *reinterpret_cast<const float4*>(&ks[kk][tx * 4]);
                    const float av[4] = {a.x, a.y, a.z, a.w}, bv[4] = {bk.x, bk.y, bk.z, bk.w};
#pragma unroll
                    for (int i = 0; i < 4; ++i)
#pragma unroll
                        for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(av[i], bv[j], acc[i][j]);
                }
                __syncthreads();
            }
#pragma unroll
            for (int i = 0; i < 4; ++i)
#pragma unroll
                for (int j = 0; j < 4; ++j) tot[i][j] += fmaxf(acc[i][j], 0.f);
        }
    }
    const float scale = rsqrtf((float)hd);
    const unsigned b = b0 + tx * 4;
    if (b >= n_blocks) return;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const unsigned r = r0 + ty * 4 + i;
        if (r < rows) qsp_store4(scores, (size_t)r * score_stride, b, n_blocks, (first_pos + r + 1) / ratio, tot[i], scale);
    }
}

// ------------------------------------------------------------------------------------------------
// qsa_score_rows_tc (tensor cores, split q)
// ------------------------------------------------------------------------------------------------
// The hd order inside each 32-dim group is permuted identically for A (q) and B (keys) so that a lane's
// fragments for two consecutive k16 steps are one contiguous 8-element run: lane (g, c) of k-pair m uses
// dims 32m + 8c + 0..7, as (k = 2c, 2c+1 | 2c+8, 2c+9) of step 2m and the same of step 2m+1. A dot product
// is invariant under a permutation of its index, so the result is the plain q . k.
#define QSP_TC_H 4
#define QSP_TC_HD 128
#define QSP_TC_WARPS 8
#define QSP_TC_BM (4 * QSP_TC_WARPS)   // score rows per CTA: 4 per warp
#define QSP_TC_BN 64                   // blocks per key chunk
#define QSP_TC_STAGES 3                // key chunks in flight in the cp.async ring

// A fragments (hi, lo) of k16 steps 0..7 for fragment rows g (q row ra, head ha) and g + 8 (row rb, head hb);
// rows >= rows read as zeros.
__device__ __forceinline__ void qsp_tc_load_a(const float* __restrict__ q, unsigned ra, unsigned ha, unsigned rb,
                                              unsigned hb, unsigned rows, unsigned c, uint32_t (&ahi)[8][4],
                                              uint32_t (&alo)[8][4]) {
    const float* qa = q + ((size_t)ra * QSP_TC_H + ha) * QSP_TC_HD + 8 * c;
    const float* qb = q + ((size_t)rb * QSP_TC_H + hb) * QSP_TC_HD + 8 * c;
#pragma unroll
    for (int m = 0; m < 4; ++m) {
        float xa[8], xb[8];
#pragma unroll
        for (int e = 0; e < 8; e += 4) {
            float4 fa = make_float4(0.f, 0.f, 0.f, 0.f), fb = fa;
            if (ra < rows) fa = *reinterpret_cast<const float4*>(qa + 32 * m + e);
            if (rb < rows) fb = *reinterpret_cast<const float4*>(qb + 32 * m + e);
            xa[e] = fa.x; xa[e + 1] = fa.y; xa[e + 2] = fa.z; xa[e + 3] = fa.w;
            xb[e] = fb.x; xb[e + 1] = fb.y; xb[e + 2] = fb.z; xb[e + 3] = fb.w;
        }
        hss_bf16_split2(xa[0], xa[1], ahi[2 * m][0], alo[2 * m][0]);
        hss_bf16_split2(xb[0], xb[1], ahi[2 * m][1], alo[2 * m][1]);
        hss_bf16_split2(xa[2], xa[3], ahi[2 * m][2], alo[2 * m][2]);
        hss_bf16_split2(xb[2], xb[3], ahi[2 * m][3], alo[2 * m][3]);
        hss_bf16_split2(xa[4], xa[5], ahi[2 * m + 1][0], alo[2 * m + 1][0]);
        hss_bf16_split2(xb[4], xb[5], ahi[2 * m + 1][1], alo[2 * m + 1][1]);
        hss_bf16_split2(xa[6], xa[7], ahi[2 * m + 1][2], alo[2 * m + 1][2]);
        hss_bf16_split2(xb[6], xb[7], ahi[2 * m + 1][3], alo[2 * m + 1][3]);
    }
}

// No cross-warp head reduction: a warp's 16 fragment rows are 4 score rows x 4 heads, fragment row g = (head
// g/4, row g%4) and g + 8 = (head 2 + g/4, row g%4), so a lane's accumulator holds heads {g/4, 2 + g/4} of one
// score row and lane ^ 16 the other two: relu, add in registers, one shuffle per pair of n-tiles. Warp w owns
// rows r0 + 4w .. r0 + 4w + 3 and takes all 64 blocks (8 n-tiles) of every chunk; key chunks arrive in a
// 3-stage cp.async ring (one barrier per chunk). Rows past `rows` are bounds-checked (q read as zeros, scores
// not written), so q and scores need only `rows` rows, not a multiple of 32.
extern "C" __global__ void __launch_bounds__(32 * QSP_TC_WARPS, 2) qsa_score_rows_tc(
    const float* __restrict__ q, const __nv_bfloat16* __restrict__ block_keys, float* __restrict__ scores,
    unsigned first_pos, unsigned score_stride, unsigned ratio, unsigned n_blocks, unsigned rows) {
    constexpr unsigned PIECES = QSP_TC_BN * 16, NT = 32 * QSP_TC_WARPS;   // 16-byte key pieces per chunk
    // key chunk: [block n][16-byte piece ch] at piece ch ^ ((n & 1) << 2) (conflict-free LDS.128)
    __shared__ __align__(128) uint4 ks[QSP_TC_STAGES * PIECES];
    const unsigned tid = threadIdx.x, warp = tid >> 5, lane = tid & 31u, g = lane >> 2, c = lane & 3u;
    const unsigned r0 = blockIdx.x * QSP_TC_BM;
    if (ratio == 0 || n_blocks == 0 || r0 >= rows) return;   // uniform per CTA
    const unsigned kb_lim = min(n_blocks, (first_pos + min(r0 + QSP_TC_BM, rows)) / ratio);   // any row scores
    const unsigned nchunks = (n_blocks + QSP_TC_BN - 1) / QSP_TC_BN;
    const unsigned per = (nchunks + gridDim.y - 1) / gridDim.y;
    const unsigned cb = blockIdx.y * per;
    if (cb >= nchunks) return;
    const unsigned ce = min(cb + per, nchunks);
    const unsigned cl = max(cb, min(ce, (kb_lim + QSP_TC_BN - 1) / QSP_TC_BN));   // chunks [cb, cl) need compute
    const float scale = rsqrtf((float)QSP_TC_HD);

    if (cb < cl) {
        auto issue = [&](unsigned chunk, unsigned stage) {
            // kb_lim recomputed from the parameters (keeping it live costs a spill at 128 registers)
            const unsigned lim = min(n_blocks, (first_pos + min(blockIdx.x * QSP_TC_BM + QSP_TC_BM, rows)) / ratio);
#pragma unroll
            for (unsigned i = 0; i < PIECES / NT; ++i) {
                const unsigned p = tid + NT * i, n = p >> 4, ch = p & 15u, b = chunk * QSP_TC_BN + n;
                uint4* dst = &ks[stage * PIECES + n * 16 + (ch ^ ((n & 1u) << 2))];
                if (b < lim) hss_cp_async16(dst, block_keys + (size_t)b * QSP_TC_HD + ch * 8);
                else *dst = make_uint4(0u, 0u, 0u, 0u);   // past the scorable blocks: zeros
            }
        };
        issue(cb, 0);   // the first two chunks fly while q is loaded and split
        hss_cp_commit();
        if (cb + 1 < cl) issue(cb + 1, 1);
        hss_cp_commit();
        const unsigned row = r0 + 4 * warp + (g & 3u), hi_half = g >> 2;   // hi_half: lane holds heads 1, 3
        uint32_t ahi[8][4], alo[8][4];
        qsp_tc_load_a(q, row, hi_half, row, 2 + hi_half, rows, c, ahi, alo);
        const unsigned comp = (first_pos + row + 1) / ratio;
        unsigned st = 0;
        for (unsigned ci = cb; ci < cl; ++ci) {
            hss_cp_wait<1>();   // this thread's copies of chunk ci have landed
            __syncthreads();    // everyone's have, and everyone is done with chunk ci - 1's stage
            const uint4* kst = ks + st * PIECES;
            float acc[8][4];
#pragma unroll
            for (int j = 0; j < 8; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) acc[j][e] = 0.f;
#pragma unroll
            for (int m = 0; m < 4; ++m) {
#pragma unroll
                for (int j = 0; j < 8; ++j) {
                    const unsigned n = j * 8 + g;
                    const uint4 w = kst[n * 16 + ((4u * m + c) ^ ((n & 1u) << 2))];
                    hss_mma16816(acc[j], ahi[2 * m], w.x, w.y);
                    hss_mma16816(acc[j], alo[2 * m], w.x, w.y);
                    hss_mma16816(acc[j], ahi[2 * m + 1], w.z, w.w);
                    hss_mma16816(acc[j], alo[2 * m + 1], w.z, w.w);
                }
            }
#pragma unroll
            for (int p = 0; p < 4; ++p) {   // n-tiles 2p (kept by lanes g < 4) and 2p + 1 (g >= 4); all lanes shuffle
                float s0[2], s1[2], o[2];
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    s0[e] = fmaxf(acc[2 * p][e], 0.f) + fmaxf(acc[2 * p][e + 2], 0.f);
                    s1[e] = fmaxf(acc[2 * p + 1][e], 0.f) + fmaxf(acc[2 * p + 1][e + 2], 0.f);
                }
                const unsigned b = ci * QSP_TC_BN + (2 * p + hi_half) * 8 + 2 * c;
#pragma unroll
                for (int e = 0; e < 2; ++e) {   // (h0 + h2) + (h1 + h3)
                    const float other = __shfl_xor_sync(HSS_FULL_MASK, hi_half ? s0[e] : s1[e], 16);
                    const float mine = hi_half ? s1[e] : s0[e];
                    const float lo_heads = hi_half ? other : mine, hi_heads = hi_half ? mine : other;
                    o[e] = (b + e >= comp) ? QSP_MASKED : (lo_heads + hi_heads) * scale;
                }
                if (row >= rows) continue;
                float* dst = scores + (size_t)row * score_stride + b;
                if (b + 1 < n_blocks && ((row * score_stride) & 1u) == 0) {   // scores is 16-byte aligned, b even
                    *reinterpret_cast<float2*>(dst) = make_float2(o[0], o[1]);
                } else {
                    if (b < n_blocks) dst[0] = o[0];
                    if (b + 1 < n_blocks) dst[1] = o[1];
                }
            }
            {   // chunk ci + 2 into chunk ci - 1's stage (free since this iteration's barrier), with acc dead
                const unsigned nst = st >= QSP_TC_STAGES - 2 ? st + 2 - QSP_TC_STAGES : st + 2;
                if (ci + 2 < cl) issue(ci + 2, nst);
                hss_cp_commit();
            }
            st = st + 1 == QSP_TC_STAGES ? 0u : st + 1;
        }
    }
    // Chunks past every row's complete count: all masked. Stride blockDim.x, not NT: a constant stride gets
    // this loop unrolled, which spills at 128 registers.
    for (unsigned ci = cl; ci < ce; ++ci) {
        for (unsigned idx = tid; idx < QSP_TC_BM * QSP_TC_BN; idx += blockDim.x) {
            const unsigned r = r0 + idx / QSP_TC_BN, b = ci * QSP_TC_BN + idx % QSP_TC_BN;
            if (r < rows && b < n_blocks) scores[(size_t)r * score_stride + b] = QSP_MASKED;
        }
    }
}

// ------------------------------------------------------------------------------------------------
// qsa_prefill_attn (general path)
// ------------------------------------------------------------------------------------------------
#define QSP_PA_WARPS 8
#define QSP_PA_HG 4   // query heads per CTA

template <int VEC>
struct QspRaw {
    uint32_t w[(VEC + 1) / 2];
};

template <int VEC>
__device__ __forceinline__ QspRaw<VEC> qsp_load_vec(const __nv_bfloat16* p) {   // VEC bf16 at p
    QspRaw<VEC> r;
    if constexpr (VEC == 8) {
        const uint4 u = *reinterpret_cast<const uint4*>(p);
        r.w[0] = u.x; r.w[1] = u.y; r.w[2] = u.z; r.w[3] = u.w;
    } else if constexpr (VEC == 4) {
        const uint2 u = *reinterpret_cast<const uint2*>(p);
        r.w[0] = u.x; r.w[1] = u.y;
    } else if constexpr (VEC % 2 == 0) {
#pragma unroll
        for (int i = 0; i < VEC / 2; ++i) r.w[i] = reinterpret_cast<const uint32_t*>(p)[i];
    } else {
#pragma unroll
        for (int i = 0; i < (VEC + 1) / 2; ++i) r.w[i] = 0u;
#pragma unroll
        for (int i = 0; i < VEC; ++i)
            r.w[i >> 1] |= (uint32_t)__bfloat16_as_ushort(p[i]) << (16 * (i & 1));
    }
    return r;
}

template <int VEC>
__device__ __forceinline__ void qsp_unpack_vec(const QspRaw<VEC>& r, float (&f)[VEC]) {
#pragma unroll
    for (int i = 0; i < VEC; ++i) f[i] = (i & 1) ? hss_bf16_hi(r.w[i >> 1]) : hss_bf16_lo(r.w[i >> 1]);
}

template <int VEC>
__device__ __forceinline__ void qsp_prefill_attn_body(
    const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k_cache, const __nv_bfloat16* __restrict__ v_cache,
    const int* __restrict__ block_table, const int* __restrict__ lists, __nv_bfloat16* __restrict__ attn_out,
    unsigned first_pos, unsigned topk, unsigned ratio, unsigned bs, unsigned nq, unsigned nkv, float inv_sqrt_d) {
    constexpr unsigned HD = 32 * VEC;
    const unsigned G = nq / nkv, ngroups = (G + QSP_PA_HG - 1) / QSP_PA_HG;
    const unsigned r = blockIdx.x, kvh = blockIdx.y / ngroups, grp = blockIdx.y - kvh * ngroups;
    if (kvh >= nkv) return;   // uniform per CTA
    const unsigned h0 = grp * QSP_PA_HG, nh = min((unsigned)QSP_PA_HG, G - h0);
    const unsigned warp = threadIdx.x >> 5, lane = threadIdx.x & 31u, d0 = lane * VEC;
    const unsigned pos = first_pos + r, complete = (pos + 1) / ratio, sel = topk * ratio;
    const unsigned n_tok = sel + (pos + 1 - complete * ratio);
    const int* list_r = lists + (size_t)r * topk;
    const size_t qrow = (size_t)r * nq + (size_t)kvh * G + h0;

    float qv[QSP_PA_HG][VEC], acc[QSP_PA_HG][VEC], m[QSP_PA_HG], l[QSP_PA_HG];
#pragma unroll
    for (int hh = 0; hh < QSP_PA_HG; ++hh) {
        m[hh] = -1e30f;
        l[hh] = 0.f;
#pragma unroll
        for (int i = 0; i < VEC; ++i) { qv[hh][i] = 0.f; acc[hh][i] = 0.f; }
        if (hh < (int)nh) qsp_unpack_vec<VEC>(qsp_load_vec<VEC>(q + (qrow + hh) * HD + d0), qv[hh]);
    }
    QspRaw<VEC> kr, vr;
    unsigned t = warp;
    if (t < n_tok) {
        const size_t off = qsp_row_offset(qsp_token(t, sel, list_r, ratio, complete), block_table, bs, nkv, kvh, HD) + d0;
        kr = qsp_load_vec<VEC>(k_cache + off);
        vr = qsp_load_vec<VEC>(v_cache + off);
    }
    for (; t < n_tok; t += QSP_PA_WARPS) {
        float kf[VEC], vf[VEC];
        qsp_unpack_vec<VEC>(kr, kf);
        qsp_unpack_vec<VEC>(vr, vf);
        const unsigned tn = t + QSP_PA_WARPS;
        if (tn < n_tok) {   // the next token's rows are in flight while this one is used
            const size_t off = qsp_row_offset(qsp_token(tn, sel, list_r, ratio, complete), block_table, bs, nkv, kvh, HD) + d0;
            kr = qsp_load_vec<VEC>(k_cache + off);
            vr = qsp_load_vec<VEC>(v_cache + off);
        }
#pragma unroll
        for (int hh = 0; hh < QSP_PA_HG; ++hh) {
            if (hh >= (int)nh) break;
            float part = 0.f;
#pragma unroll
            for (int i = 0; i < VEC; ++i) part = fmaf(qv[hh][i], kf[i], part);
            const float x = hss_warp_sum(part) * inv_sqrt_d;
            const float mn = fmaxf(m[hh], x);
            const float sc = hss_softmax_weight<true>(m[hh], mn), p = hss_softmax_weight<true>(x, mn);
            l[hh] = l[hh] * sc + p;
#pragma unroll
            for (int i = 0; i < VEC; ++i) acc[hh][i] = acc[hh][i] * sc + p * vf[i];
            m[hh] = mn;
        }
    }
    // merge the 8 warps: smem [8][4][2] (m, l) then [8][4][HD] partial outputs
    float* mlb = reinterpret_cast<float*>(qsp_dynsmem);
    float* accb = mlb + QSP_PA_WARPS * QSP_PA_HG * 2;
#pragma unroll
    for (int hh = 0; hh < QSP_PA_HG; ++hh) {
#pragma unroll
        for (int i = 0; i < VEC; ++i) accb[(warp * QSP_PA_HG + hh) * HD + d0 + i] = acc[hh][i];
        if (lane == 0) {
            mlb[(warp * QSP_PA_HG + hh) * 2] = m[hh];
            mlb[(warp * QSP_PA_HG + hh) * 2 + 1] = l[hh];
        }
    }
    __syncthreads();
    for (unsigned idx = threadIdx.x; idx < nh * HD; idx += blockDim.x) {
        const unsigned hh = idx / HD, d = idx - hh * HD;
        float mt = -1e30f;
        for (unsigned w = 0; w < QSP_PA_WARPS; ++w) mt = fmaxf(mt, mlb[(w * QSP_PA_HG + hh) * 2]);
        float lt = 0.f, o = 0.f;
        for (unsigned w = 0; w < QSP_PA_WARPS; ++w) {
            const float wt = hss_softmax_weight<true>(mlb[(w * QSP_PA_HG + hh) * 2], mt);
            lt += mlb[(w * QSP_PA_HG + hh) * 2 + 1] * wt;
            o += accb[(w * QSP_PA_HG + hh) * HD + d] * wt;
        }
        attn_out[(qrow + hh) * HD + d] = __float2bfloat16_rn(o * hss_softmax_inv(lt));
    }
}

extern "C" __global__ void __launch_bounds__(256) qsa_prefill_attn(
    const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k_cache, const __nv_bfloat16* __restrict__ v_cache,
    const int* __restrict__ block_table, const int* __restrict__ lists, __nv_bfloat16* __restrict__ attn_out,
    unsigned first_pos, unsigned topk, unsigned ratio, unsigned block_size, unsigned nq, unsigned nkv, unsigned hd,
    float inv_sqrt_d) {
    if (nkv == 0 || nq == 0 || nq % nkv != 0 || ratio == 0 || block_size == 0 || blockDim.x != 32 * QSP_PA_WARPS)
        return;
#define QSP_PA_CASE(V)                                                                                            \
    case V:                                                                                                       \
        qsp_prefill_attn_body<V>(q, k_cache, v_cache, block_table, lists, attn_out, first_pos, topk, ratio,       \
                                 block_size, nq, nkv, inv_sqrt_d);                                                \
        break;
    if (hd % 32 != 0) return;
    switch (hd / 32) {
        QSP_PA_CASE(1) QSP_PA_CASE(2) QSP_PA_CASE(3) QSP_PA_CASE(4)
        QSP_PA_CASE(5) QSP_PA_CASE(6) QSP_PA_CASE(7) QSP_PA_CASE(8)
        default: break;
    }
#undef QSP_PA_CASE
}

// ------------------------------------------------------------------------------------------------
// qsa_prefill_attn_tc (tensor cores; hd in {64, 128, 256}, G <= 16)
// ------------------------------------------------------------------------------------------------
// Lane (g = lane/4, c = lane%4) of a warp, for an 8-token sub-chunk:
//  S step:  B = K^T, n = token g. Lane copies K[token g][32m + 8c .. +7] (m < HD/32) = its B fragments of
//           k16 steps 2m, 2m+1 in the permuted-k order of qsa_score_rows_tc; Q (smem) is read the same way.
//  PV step: m16n8k8 with k = the 8 tokens: A = P straight from the S accumulator (P[g][2c..2c+1], P[g+8][..]),
//           B = V[token 2c..2c+1][column of n-tile j, n = g]. O's column order is permuted: n-tile
//           j = 8i + e, n holds column 64i + 8n + e, so lane copies V[token 2c + p][64i + 8g .. +7]
//           (i < HD/64, p < 2) and builds B of n-tile 8i + e by pairing element e of both tokens.
#define QSP_AT_WARPS 2
#define QSP_AT_MAXG 16
#define QSP_AT_QBYTES (QSP_AT_MAXG * (256 * 2 + 64))   // Q rows, stride 2*HD + 64 B (conflict-free reads)
#define QSP_AT_SBYTES (2 * 8 * 256 * 2)                 // one stage of one warp: K and V of 8 tokens

template <int HD>
__device__ __forceinline__ void qsp_attn_tc_body(
    const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k_cache, const __nv_bfloat16* __restrict__ v_cache,
    const int* __restrict__ block_table, const int* __restrict__ lists, __nv_bfloat16* __restrict__ attn_out,
    unsigned first_pos, unsigned topk, unsigned ratio, unsigned bs, unsigned nq, unsigned nkv, float inv_sqrt_d,
    unsigned char* qsm, unsigned char* stg) {
    constexpr unsigned NM = HD / 32, NI = HD / 64, NT = HD / 8;
    constexpr unsigned QST = HD * 2 + 64;   // Q row stride in bytes
    constexpr unsigned KB = 8 * HD * 2;     // K bytes of one stage (= NM pieces x 32 lanes x 16 B)
    constexpr unsigned SB = 2 * KB;         // K + V
    constexpr unsigned OST = HD + 4;        // merge buffer row stride in floats
    const unsigned G = nq / nkv;
    const unsigned r = blockIdx.x, kvh = blockIdx.y;
    const unsigned tid = threadIdx.x, warp = tid >> 5, lane = tid & 31u, g = lane >> 2, c = lane & 3u;
    const unsigned pos = first_pos + r, complete = (pos + 1) / ratio, sel = topk * ratio;
    const unsigned n_tok = sel + (pos + 1 - complete * ratio);
    const unsigned n_sc = (n_tok + 7) >> 3;
    const int* list_r = lists + (size_t)r * topk;
    const size_t qrow = (size_t)r * nq + (size_t)kvh * G;

    {   // the G query rows of this kv head -> smem
        const uint4* src = reinterpret_cast<const uint4*>(q + qrow * HD);
        for (unsigned p = tid; p < G * (HD / 8); p += 32 * QSP_AT_WARPS) {
            const unsigned row = p / (HD / 8), col = p - row * (HD / 8);
            *reinterpret_cast<uint4*>(qsm + row * QST + col * 16) = src[p];
        }
    }
    __syncthreads();

    unsigned char* wst = stg + warp * 2 * SB;
    auto tok_of = [&](unsigned sc) -> unsigned {   // token of slot lane%8 of sub-chunk sc (~0u: none)
        const unsigned t = sc * 8 + (lane & 7u);
        return t < n_tok ? qsp_token(t, sel, list_r, ratio, complete) : 0xffffffffu;
    };
    auto off_of = [&](unsigned tok) -> long long {
        return tok == 0xffffffffu ? -1ll : (long long)qsp_row_offset(tok, block_table, bs, nkv, kvh, HD);
    };
    auto issue = [&](unsigned stage, long long off) {   // warp-uniform call
        unsigned char* ks = wst + stage * SB;
        unsigned char* vs = ks + KB;
        const long long ok = __shfl_sync(HSS_FULL_MASK, off, g);
        const long long ov0 = __shfl_sync(HSS_FULL_MASK, off, 2 * c), ov1 = __shfl_sync(HSS_FULL_MASK, off, 2 * c + 1);
#pragma unroll
        for (unsigned m = 0; m < NM; ++m) {
            void* dst = ks + (m * 32 + lane) * 16;
            if (ok >= 0) hss_cp_async16(dst, k_cache + ok + 32 * m + 8 * c);
            else *reinterpret_cast<uint4*>(dst) = make_uint4(0u, 0u, 0u, 0u);
        }
#pragma unroll
        for (unsigned i = 0; i < NI; ++i) {
            void* d0 = vs + ((2 * i) * 32 + lane) * 16;
            void* d1 = vs + ((2 * i + 1) * 32 + lane) * 16;
            if (ov0 >= 0) hss_cp_async16(d0, v_cache + ov0 + 64 * i + 8 * g);
            else *reinterpret_cast<uint4*>(d0) = make_uint4(0u, 0u, 0u, 0u);
            if (ov1 >= 0) hss_cp_async16(d1, v_cache + ov1 + 64 * i + 8 * g);
            else *reinterpret_cast<uint4*>(d1) = make_uint4(0u, 0u, 0u, 0u);
        }
    };

    float o[NT][4];
#pragma unroll
    for (unsigned j = 0; j < NT; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
    float m_a = -1e30f, m_b = -1e30f, l_a = 0.f, l_b = 0.f;   // rows g and g + 8; m in log2 units
    const float sl2 = inv_sqrt_d * 1.4426950408889634f;
    const unsigned n_my = n_sc > warp ? (n_sc - warp + 1) >> 1 : 0u;   // sub-chunks warp, warp + 2, ...

    if (n_my > 0) {
        unsigned sc = warp;
        issue(0, off_of(tok_of(sc)));
        hss_cp_commit();
        long long off_n1 = off_of(tok_of(sc + 2));   // next sub-chunk's rows (lists -> table resolved)
        unsigned tok_n2 = tok_of(sc + 4);             // the one after: lists read, table not yet
        for (unsigned it = 0; it < n_my; ++it, sc += 2) {
            const unsigned st = it & 1u;
            if (it + 1 < n_my) issue(st ^ 1u, off_n1);
            hss_cp_commit();
            off_n1 = off_of(tok_n2);   // these loads complete while sub-chunk sc is computed
            tok_n2 = tok_of(sc + 6);
            hss_cp_wait<1>();          // sub-chunk sc has landed (each lane reads only its own copies)
            const unsigned char* ks = wst + st * SB;
            const unsigned char* vs = ks + KB;

            float sacc[4][4];
#pragma unroll
            for (int a = 0; a < 4; ++a) sacc[a][0] = sacc[a][1] = sacc[a][2] = sacc[a][3] = 0.f;
#pragma unroll
            for (unsigned m = 0; m < NM; ++m) {
                const uint4 kw = *reinterpret_cast<const uint4*>(ks + (m * 32 + lane) * 16);
                uint4 qa = make_uint4(0u, 0u, 0u, 0u), qb = qa;
                if (g < G) qa = *reinterpret_cast<const uint4*>(qsm + g * QST + (32 * m + 8 * c) * 2);
                if (g + 8 < G) qb = *reinterpret_cast<const uint4*>(qsm + (g + 8) * QST + (32 * m + 8 * c) * 2);
                const uint32_t a0[4] = {qa.x, qb.x, qa.y, qb.y};
                const uint32_t a1[4] = {qa.z, qb.z, qa.w, qb.w};
                hss_mma16816(sacc[(2 * m) & 3u], a0, kw.x, kw.y);
                hss_mma16816(sacc[(2 * m + 1) & 3u], a1, kw.z, kw.w);
            }
            float s[4];
#pragma unroll
            for (int e = 0; e < 4; ++e) s[e] = (sacc[0][e] + sacc[1][e]) + (sacc[2][e] + sacc[3][e]);
            const unsigned t0 = sc * 8 + 2 * c;
            const bool v0 = t0 < n_tok, v1 = t0 + 1 < n_tok;
            const float ninf = hss_neg_inf();
            const float x0 = v0 ? s[0] * sl2 : ninf, x1 = v1 ? s[1] * sl2 : ninf;
            const float x2 = v0 ? s[2] * sl2 : ninf, x3 = v1 ? s[3] * sl2 : ninf;
            float mxa = fmaxf(x0, x1), mxb = fmaxf(x2, x3);
            mxa = fmaxf(mxa, __shfl_xor_sync(HSS_FULL_MASK, mxa, 1));
            mxa = fmaxf(mxa, __shfl_xor_sync(HSS_FULL_MASK, mxa, 2));
            mxb = fmaxf(mxb, __shfl_xor_sync(HSS_FULL_MASK, mxb, 1));
            mxb = fmaxf(mxb, __shfl_xor_sync(HSS_FULL_MASK, mxb, 2));
            const HssFragStep sm = hss_softmax_step_frag(x0, x1, x2, x3, mxa, mxb, m_a, m_b, l_a, l_b);
            m_a = sm.m0;
            m_b = sm.m1;
            l_a = sm.l0;   // this lane's share of the row sum
            l_b = sm.l1;
            const float ala = sm.a0, alb = sm.a1;
            uint32_t ph0, pl0, ph1, pl1;
            hss_bf16_split2(sm.p0, sm.p1, ph0, pl0);
            hss_bf16_split2(sm.p2, sm.p3, ph1, pl1);
#pragma unroll
            for (unsigned i = 0; i < NI; ++i) {
                const uint4 va = *reinterpret_cast<const uint4*>(vs + ((2 * i) * 32 + lane) * 16);
                const uint4 vb = *reinterpret_cast<const uint4*>(vs + ((2 * i + 1) * 32 + lane) * 16);
                const uint32_t wa[4] = {va.x, va.y, va.z, va.w}, wb[4] = {vb.x, vb.y, vb.z, vb.w};
#pragma unroll
                for (unsigned e = 0; e < 8; ++e) {
                    const uint32_t b = __byte_perm(wa[e >> 1], wb[e >> 1], (e & 1u) ? 0x7632u : 0x5410u);
                    float tmp[4] = {0.f, 0.f, 0.f, 0.f};
                    hss_mma1688(tmp, ph0, ph1, b);
                    hss_mma1688(tmp, pl0, pl1, b);
                    float(&oj)[4] = o[8 * i + e];
                    oj[0] = fmaf(oj[0], ala, tmp[0]);
                    oj[1] = fmaf(oj[1], ala, tmp[1]);
                    oj[2] = fmaf(oj[2], alb, tmp[2]);
                    oj[3] = fmaf(oj[3], alb, tmp[3]);
                }
            }
        }
    }
    l_a += __shfl_xor_sync(HSS_FULL_MASK, l_a, 1);
    l_a += __shfl_xor_sync(HSS_FULL_MASK, l_a, 2);
    l_b += __shfl_xor_sync(HSS_FULL_MASK, l_b, 1);
    l_b += __shfl_xor_sync(HSS_FULL_MASK, l_b, 2);
    hss_cp_wait<0>();
    __syncthreads();   // both warps are done with their rings: reuse them for the merge
    float* ob = reinterpret_cast<float*>(stg);   // [16][OST] f32, natural column order
    float* mlb = ob + 16 * OST;                  // [16][2] (m, l) of warp 1
    if (warp == 1) {
        if (c == 0) {
            mlb[g * 2] = m_a; mlb[g * 2 + 1] = l_a;
            mlb[(g + 8) * 2] = m_b; mlb[(g + 8) * 2 + 1] = l_b;
        }
#pragma unroll
        for (unsigned j = 0; j < NT; ++j) {
            const unsigned col = 64 * (j >> 3) + 16 * c + (j & 7u);   // columns of n = 2c and n = 2c + 1 (+8)
            ob[g * OST + col] = o[j][0];
            ob[g * OST + col + 8] = o[j][1];
            ob[(g + 8) * OST + col] = o[j][2];
            ob[(g + 8) * OST + col + 8] = o[j][3];
        }
    }
    __syncthreads();
    if (warp == 0) {
        const float m1a = mlb[g * 2], l1a = mlb[g * 2 + 1], m1b = mlb[(g + 8) * 2], l1b = mlb[(g + 8) * 2 + 1];
        const float mta = fmaxf(m_a, m1a), mtb = fmaxf(m_b, m1b);
        const float w0a = hss_softmax_weight(m_a, mta), w1a = hss_softmax_weight(m1a, mta);
        const float w0b = hss_softmax_weight(m_b, mtb), w1b = hss_softmax_weight(m1b, mtb);
        const float la = l_a * w0a + l1a * w1a, lb = l_b * w0b + l1b * w1b;
        const float ia = hss_softmax_inv(la), ib = hss_softmax_inv(lb);
#pragma unroll
        for (unsigned j = 0; j < NT; ++j) {
            const unsigned col = 64 * (j >> 3) + 16 * c + (j & 7u);
            float* pa = ob + g * OST + col;
            float* pb = ob + (g + 8) * OST + col;
            pa[0] = (o[j][0] * w0a + pa[0] * w1a) * ia;
            pa[8] = (o[j][1] * w0a + pa[8] * w1a) * ia;
            pb[0] = (o[j][2] * w0b + pb[0] * w1b) * ib;
            pb[8] = (o[j][3] * w0b + pb[8] * w1b) * ib;
        }
    }
    __syncthreads();
    for (unsigned p = tid; p < G * (HD / 8); p += 32 * QSP_AT_WARPS) {
        const unsigned row = p / (HD / 8), col = (p - row * (HD / 8)) * 8;
        const float4 f0 = *reinterpret_cast<const float4*>(ob + row * OST + col);
        const float4 f1 = *reinterpret_cast<const float4*>(ob + row * OST + col + 4);
        uint4 u;
        u.x = hss_bf16_pack(__float2bfloat16_rn(f0.x), __float2bfloat16_rn(f0.y));
        u.y = hss_bf16_pack(__float2bfloat16_rn(f0.z), __float2bfloat16_rn(f0.w));
        u.z = hss_bf16_pack(__float2bfloat16_rn(f1.x), __float2bfloat16_rn(f1.y));
        u.w = hss_bf16_pack(__float2bfloat16_rn(f1.z), __float2bfloat16_rn(f1.w));
        *reinterpret_cast<uint4*>(attn_out + (qrow + row) * HD + col) = u;
    }
}

extern "C" __global__ void __launch_bounds__(32 * QSP_AT_WARPS) qsa_prefill_attn_tc(
    const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k_cache, const __nv_bfloat16* __restrict__ v_cache,
    const int* __restrict__ block_table, const int* __restrict__ lists, __nv_bfloat16* __restrict__ attn_out,
    unsigned first_pos, unsigned topk, unsigned ratio, unsigned block_size, unsigned nq, unsigned nkv, unsigned hd,
    float inv_sqrt_d) {
    __shared__ __align__(16) unsigned char qsm[QSP_AT_QBYTES];
    __shared__ __align__(16) unsigned char stg[QSP_AT_WARPS * 2 * QSP_AT_SBYTES];
    if (nkv == 0 || nq == 0 || nq % nkv != 0 || nq / nkv > QSP_AT_MAXG || ratio == 0 || block_size == 0 ||
        blockIdx.y >= nkv || blockDim.x != 32 * QSP_AT_WARPS)
        return;
    if (hd == 256)
        qsp_attn_tc_body<256>(q, k_cache, v_cache, block_table, lists, attn_out, first_pos, topk, ratio, block_size, nq,
                              nkv, inv_sqrt_d, qsm, stg);
    else if (hd == 128)
        qsp_attn_tc_body<128>(q, k_cache, v_cache, block_table, lists, attn_out, first_pos, topk, ratio, block_size, nq,
                              nkv, inv_sqrt_d, qsm, stg);
    else if (hd == 64)
        qsp_attn_tc_body<64>(q, k_cache, v_cache, block_table, lists, attn_out, first_pos, topk, ratio, block_size, nq,
                             nkv, inv_sqrt_d, qsm, stg);
}
