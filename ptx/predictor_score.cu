// predictor_score.cu: the predictor's block score (docs/design.md §5.3), bandwidth-first.
//
// predictor_score(q_proj bf16 [num_q_heads, r], k_lr bf16 [num_blocks, num_kv_heads, block_size, r],
//                 scores f32 [num_blocks], num_q_heads, num_kv_heads, block_size, r, gqa_ratio, num_blocks)
//   scores[b] = max over q head qh and token t of dot(q_proj[qh, :], k_lr[b, qh / gqa_ratio, t, :]),
//   dot accumulated in f32; no scaling. NaN dots are skipped; a block whose dots are all NaN scores -inf.
//   Requires num_q_heads == gqa_ratio * num_kv_heads (else the kernel writes nothing).
// Launch: block (32 * W, 1, 1) for any 1 <= W <= 8 (hss uses W = 1: hss.decls.predictor.score_warps),
//   grid (ceil(num_blocks / W), 1, 1), no dynamic shared memory. Warp w of CTA c scores block c * W + w; warps
//   past num_blocks exit.
//
// Two paths, chosen per launch (uniform branch):
//  * tensor-core path when block_size % 16 == 0, r in {32, 64, 96, 128}, gqa_ratio <= 8 and both input
//    pointers are 16-byte aligned (the Llama-like shapes hss targets). The block's K rows are cut into
//    "units" of 16 consecutive rows ([16, r], one kv head). Lane l loads rows l/4 and l/4 + 8 of a unit in
//    16-byte chunks at column 8*(l%4) + 32c, so each load instruction of the warp reads contiguous memory
//    (512 B when r = 32) and every byte of the slot is read exactly once, with up to 16 loads per lane in
//    flight. Those chunks are exactly the A fragments of mma.m16n8k16 (bf16 in, f32 accumulate) under a
//    consistent permutation of the r axis (logical k 2t+j <-> column 8t+j, 8+2t+j <-> 8t+2+j, plus 4 for
//    the second k-step); the B fragment is the same 16-byte chunk of the unit's q heads (column n = q head
//    within the kv group, n >= gqa_ratio padded and discarded). Each mma gives 16 tokens x 8 heads of dots;
//    the lane keeps a running max and one warp shuffle-max ends the block. Products of bf16 are exact in
//    f32; only the accumulation order differs from the original.
//  * general path otherwise: the original's arithmetic. Lanes stride over the (q head, token) pairs; each
//    dot is a sequential f32 fma over r ascending; per-lane max, then a warp shuffle-max.
//
// predictor_score_table(q_proj bf16 [R, num_q_heads, r], k_lr bf16 [max_blocks, num_kv_heads, block_size, r] (one
//                       layer of A_g), table i32 [R, table_stride], counts i32 [R], rows i32 [1], scores f32
//                       [R, table_stride], num_q_heads, num_kv_heads, block_size, r, gqa_ratio, table_stride,
//                       max_blocks)
//   For each query row s < rows[0] and i < clamp(counts[s], 0, table_stride): scores[s, i] = predictor_score's score
//   of A_g block table[s, i] for q_proj[s] (the same arithmetic, so the same bits); a block id outside
//   0..max_blocks-1 scores NaN. Nothing else is written. Launch: block (32 * W, 1, 1) (hss: W = 1), grid
//   (ceil(table_stride / W), R, 1): warps past a row's count exit.
// predictor_score_heads_table, predictor_head_max_rows, predictor_head_combine_rows: the three per-head kernels below
//   for R query rows over their tables (the device sparse step; the same arithmetic, so the same bits):
//   predictor_score_heads_table(q_proj [R, nq, r], k_lr, table, counts, rows, head_scores f32 [R, table_stride, nq],
//     nq, nkv, block_size, r, gqa_ratio, table_stride, max_blocks): predictor_score_heads of block table[s, i]
//     (an id outside A_g: NaN for every head). Launch: predictor_score_table's.
//   predictor_head_max_rows(head_scores, counts, rows, head_max f32 [R, nq], nq, table_stride): each row's head max
//     over its first counts[s] entries. Launch: block (HSS_PRED_HEAD_THREADS, 1, 1), grid (nq, R, 1).
//   predictor_head_combine_rows(head_scores, head_max, table, counts, rows, scores f32 [R, table_stride], nq,
//     table_stride, max_blocks, exp2_scale): predictor_head_combine of each entry (an id outside A_g: NaN).
//     Launch: block (HSS_PRED_HEAD_THREADS, 1, 1), grid (ceil(table_stride / HSS_PRED_HEAD_THREADS), R, 1).
//
// Per-head normalised scores (docs/design.md §17.5, hss's option; three launches in this order):
// predictor_score_heads(q_proj, k_lr, head_scores f32 [num_blocks, num_q_heads], the same scalars as predictor_score)
//   head_scores[b, qh] = max over token t of dot(q_proj[qh, :], k_lr[b, qh / gqa_ratio, t, :]) (the general
//   path's arithmetic: sequential f32 fma over r ascending; NaN dots skipped, none left: -inf). Same launch as
//   predictor_score; lanes stride over the tokens, one q head after another.
// predictor_head_max(head_scores, head_max f32 [num_q_heads], num_q_heads, num_blocks)
//   head_max[qh] = max over b of head_scores[b, qh] (NaN skipped; none: -inf). Launch: block
//   (HSS_PRED_HEAD_THREADS, 1, 1), grid (num_q_heads, 1, 1).
// predictor_head_combine(head_scores, head_max, scores f32 [num_blocks], num_q_heads, num_blocks, exp2_scale)
//   scores[b] = sum over qh ascending (f32) of exp2f((head_scores[b, qh] - head_max[qh]) * exp2_scale), a term
//   whose exponent is NaN (a head with no finite score) left out: each head's best block adds 1, a block e nats of
//   that head's logit (at exp2_scale = log2(e) / temperature) below it adds exp(-e). Launch: block
//   (HSS_PRED_HEAD_THREADS, 1, 1), grid (ceil(num_blocks / HSS_PRED_HEAD_THREADS), 1, 1).
#include "hss_common.cuh"
#include "hss_mma.cuh"
#include "hss_headscore.cuh"

#define HSS_PRED_HEAD_THREADS 256   // predictor_head_max and predictor_head_combine: threads per CTA

// Tensor-core path for one K_lr block: `units` = num_kv_heads * block_size / 16 units of [16, r] rows,
// R32 = r / 32 chunks of 16 bytes per row and lane. U units are loaded before any is used (U * 2 * R32
// 16-byte loads in flight per lane).
template <int R32>
__device__ __forceinline__ float hss_score_block_mma(const __nv_bfloat16* __restrict__ q_proj,
                                                     const __nv_bfloat16* __restrict__ blk, int units,
                                                     int block_size, int gqa, int lane) {
    constexpr int U = R32 == 1 ? 8 : R32 == 2 ? 4 : 2;
    constexpr int r = 32 * R32;
    const int grp = lane >> 2, t = lane & 3;
    const int qn = min(grp, gqa - 1);   // padded columns read a real head; their dots are discarded
    const bool use0 = 2 * t < gqa, use1 = 2 * t + 1 < gqa;
    float best = hss_neg_inf();
    for (int u0 = 0; u0 < units; u0 += U) {
        uint4 a[U][2][R32];
        uint4 b[U][R32];
#pragma unroll
        for (int j = 0; j < U; ++j) {
            if (u0 + j < units) {
                const __nv_bfloat16* rows = blk + (size_t)(u0 + j) * 16 * r + grp * r + t * 8;
                const int kv = (u0 + j) * 16 / block_size;
                const __nv_bfloat16* q = q_proj + (size_t)(kv * gqa + qn) * r + t * 8;
#pragma unroll
                for (int c = 0; c < R32; ++c) {
                    a[j][0][c] = __ldcs(reinterpret_cast<const uint4*>(rows + 32 * c));
                    a[j][1][c] = __ldcs(reinterpret_cast<const uint4*>(rows + 8 * r + 32 * c));
                    b[j][c] = __ldg(reinterpret_cast<const uint4*>(q + 32 * c));
                }
            }
        }
#pragma unroll
        for (int j = 0; j < U; ++j) {
            if (u0 + j < units) {
                float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
                for (int c = 0; c < R32; ++c) {
                    const uint32_t lo[4] = {a[j][0][c].x, a[j][1][c].x, a[j][0][c].y, a[j][1][c].y};
                    const uint32_t hi[4] = {a[j][0][c].z, a[j][1][c].z, a[j][0][c].w, a[j][1][c].w};
                    hss_mma16816(d, lo, b[j][c].x, b[j][c].y);
                    hss_mma16816(d, hi, b[j][c].z, b[j][c].w);
                }
                // d[0], d[2]: head 2t, tokens grp and grp + 8; d[1], d[3]: head 2t + 1. fmaxf skips NaN.
                if (use0) best = fmaxf(best, fmaxf(d[0], d[2]));
                if (use1) best = fmaxf(best, fmaxf(d[1], d[3]));
            }
        }
    }
    return best;
}

// One K_lr block's score (the warp's lanes together; every lane returns the block's max): the tensor-core path
// where it applies, else the original's arithmetic.
__device__ __forceinline__ float hss_score_block(const __nv_bfloat16* __restrict__ q_proj,
                                                 const __nv_bfloat16* __restrict__ blk, bool aligned, int num_q_heads,
                                                 int num_kv_heads, int block_size, int r, int gqa_ratio, int lane) {
    float best;
    if (aligned && block_size % 16 == 0 && r % 32 == 0 && r <= 128 && gqa_ratio <= 8) {
        const int units = num_kv_heads * (block_size / 16);
        switch (r >> 5) {
            case 1: best = hss_score_block_mma<1>(q_proj, blk, units, block_size, gqa_ratio, lane); break;
            case 2: best = hss_score_block_mma<2>(q_proj, blk, units, block_size, gqa_ratio, lane); break;
            case 3: best = hss_score_block_mma<3>(q_proj, blk, units, block_size, gqa_ratio, lane); break;
            default: best = hss_score_block_mma<4>(q_proj, blk, units, block_size, gqa_ratio, lane); break;
        }
    } else {
        best = hss_neg_inf();
        const int pairs = num_q_heads * block_size;
        for (int p = lane; p < pairs; p += 32) {
            const int qh = p / block_size, tok = p - qh * block_size;
            const __nv_bfloat16* q = q_proj + (size_t)qh * r;
            const __nv_bfloat16* k = blk + ((size_t)(qh / gqa_ratio) * block_size + tok) * r;
            float acc = 0.0f;
            for (int i = 0; i < r; ++i) acc = fmaf(hss_bf16_to_f32(q[i]), hss_bf16_to_f32(k[i]), acc);
            best = fmaxf(best, acc);   // skips a NaN dot, as the original's strict '>' update did
        }
    }
    return hss_warp_max(best);
}

extern "C" __global__ void __launch_bounds__(256, 2)
predictor_score(const __nv_bfloat16* __restrict__ q_proj, const __nv_bfloat16* __restrict__ k_lr,
                float* __restrict__ scores, int num_q_heads, int num_kv_heads, int block_size, int r,
                int gqa_ratio, int num_blocks) {
    const int lane = threadIdx.x & 31;
    const long long b = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (b >= num_blocks) return;   // warp-uniform; no barrier follows
    if (num_kv_heads <= 0 || block_size <= 0 || r <= 0 || gqa_ratio <= 0 ||
        num_q_heads != gqa_ratio * num_kv_heads)
        return;
    const __nv_bfloat16* blk = k_lr + (size_t)b * num_kv_heads * block_size * r;
    const bool aligned = ((reinterpret_cast<uintptr_t>(q_proj) | reinterpret_cast<uintptr_t>(k_lr)) & 15) == 0;
    const float best = hss_score_block(q_proj, blk, aligned, num_q_heads, num_kv_heads, block_size, r, gqa_ratio,
                                       lane);
    if (lane == 0) scores[b] = best;
}

// R queries, each over its own list of A_g blocks (the device sparse step, docs/design.md §17.8): see the header
// comment.
extern "C" __global__ void __launch_bounds__(256, 2)
predictor_score_table(const __nv_bfloat16* __restrict__ q_proj, const __nv_bfloat16* __restrict__ k_lr,
                      const int* __restrict__ table, const int* __restrict__ counts, const int* __restrict__ rows,
                      float* __restrict__ scores, int num_q_heads, int num_kv_heads, int block_size, int r,
                      int gqa_ratio, int table_stride, int max_blocks) {
    const int lane = threadIdx.x & 31;
    const int s = blockIdx.y;
    const long long i = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (s >= rows[0] || i >= min(max(counts[s], 0), table_stride)) return;   // warp-uniform; no barrier follows
    if (num_kv_heads <= 0 || block_size <= 0 || r <= 0 || gqa_ratio <= 0 ||
        num_q_heads != gqa_ratio * num_kv_heads)
        return;
    const int b = table[(size_t)s * table_stride + i];
    float best = __int_as_float(0x7fffffff);   // a block id outside A_g scores NaN: ranked below every number
    if (0 <= b && b < max_blocks) {
        const __nv_bfloat16* q = q_proj + (size_t)s * num_q_heads * r;
        const __nv_bfloat16* blk = k_lr + (size_t)b * num_kv_heads * block_size * r;
        const bool aligned = ((reinterpret_cast<uintptr_t>(q) | reinterpret_cast<uintptr_t>(k_lr)) & 15) == 0;
        best = hss_score_block(q, blk, aligned, num_q_heads, num_kv_heads, block_size, r, gqa_ratio, lane);
    }
    if (lane == 0) scores[(size_t)s * table_stride + i] = best;
}

// The general path's dot for one (q head, token): sequential f32 fma over r ascending.
__device__ __forceinline__ float hss_lowrank_dot(const __nv_bfloat16* q, const __nv_bfloat16* k, int r) {
    float acc = 0.0f;
    for (int i = 0; i < r; ++i) acc = fmaf(hss_bf16_to_f32(q[i]), hss_bf16_to_f32(k[i]), acc);
    return acc;
}

// One block's per-head maxima (the warp's lanes together): out[qh] for every q head.
__device__ __forceinline__ void hss_head_scores_block(const __nv_bfloat16* __restrict__ q_proj,
                                                      const __nv_bfloat16* __restrict__ blk, float* __restrict__ out,
                                                      int num_q_heads, int block_size, int r, int gqa_ratio, int lane) {
    for (int qh = 0; qh < num_q_heads; ++qh) {
        const __nv_bfloat16* q = q_proj + (size_t)qh * r;
        const __nv_bfloat16* keys = blk + (size_t)(qh / gqa_ratio) * block_size * r;
        float best = hss_neg_inf();
        for (int tok = lane; tok < block_size; tok += 32)
            best = fmaxf(best, hss_lowrank_dot(q, keys + (size_t)tok * r, r));   // fmaxf skips a NaN dot
        best = hss_warp_max(best);
        if (lane == 0) out[qh] = best;
    }
}

// The max over n blocks of head qh's scores (rows num_q_heads apart), by the CTA (HSS_PRED_HEAD_THREADS threads).
__device__ __forceinline__ float hss_head_max(const float* __restrict__ head_scores, int num_q_heads, int qh,
                                              long long n, float* warp_best) {
    float best = hss_neg_inf();
    for (long long b = threadIdx.x; b < n; b += HSS_PRED_HEAD_THREADS)
        best = fmaxf(best, head_scores[b * num_q_heads + qh]);
    best = hss_warp_max(best);
    if ((threadIdx.x & 31) == 0) warp_best[threadIdx.x >> 5] = best;
    __syncthreads();
    for (int w = 1; w < HSS_PRED_HEAD_THREADS / 32; ++w) best = fmaxf(best, warp_best[w]);
    return best;   // (thread 0's is the CTA's: warp_best[0] is its own warp's)
}

extern "C" __global__ void __launch_bounds__(256)
predictor_score_heads(const __nv_bfloat16* __restrict__ q_proj, const __nv_bfloat16* __restrict__ k_lr,
                      float* __restrict__ head_scores, int num_q_heads, int num_kv_heads, int block_size, int r,
                      int gqa_ratio, int num_blocks) {
    const int lane = threadIdx.x & 31;
    const long long b = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (b >= num_blocks) return;   // warp-uniform; no barrier follows
    if (num_kv_heads <= 0 || block_size <= 0 || r <= 0 || gqa_ratio <= 0 ||
        num_q_heads != gqa_ratio * num_kv_heads)
        return;
    const __nv_bfloat16* blk = k_lr + (size_t)b * num_kv_heads * block_size * r;
    hss_head_scores_block(q_proj, blk, head_scores + (size_t)b * num_q_heads, num_q_heads, block_size, r, gqa_ratio,
                          lane);
}

extern "C" __global__ void __launch_bounds__(HSS_PRED_HEAD_THREADS)
predictor_head_max(const float* __restrict__ head_scores, float* __restrict__ head_max, int num_q_heads,
                   int num_blocks) {
    __shared__ float warp_best[HSS_PRED_HEAD_THREADS / 32];
    const int qh = blockIdx.x;
    if (qh >= num_q_heads || blockDim.x != HSS_PRED_HEAD_THREADS) return;   // CTA-uniform, before the barrier
    const float best = hss_head_max(head_scores, num_q_heads, qh, num_blocks, warp_best);
    if (threadIdx.x == 0) head_max[qh] = best;
}

extern "C" __global__ void __launch_bounds__(HSS_PRED_HEAD_THREADS)
predictor_head_combine(const float* __restrict__ head_scores, const float* __restrict__ head_max,
                       float* __restrict__ scores, int num_q_heads, int num_blocks, float exp2_scale) {
    const long long b = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (b >= num_blocks) return;
    scores[b] = hss_head_combine(head_scores + b * num_q_heads, head_max, num_q_heads, exp2_scale);
}

// The per-head normalised scores of the device sparse step: the three kernels above, each query row s < rows[0] over
// its table's first clamp(counts[s], 0, table_stride) entries (see the header comment).
extern "C" __global__ void __launch_bounds__(256)
predictor_score_heads_table(const __nv_bfloat16* __restrict__ q_proj, const __nv_bfloat16* __restrict__ k_lr,
                            const int* __restrict__ table, const int* __restrict__ counts,
                            const int* __restrict__ rows, float* __restrict__ head_scores, int num_q_heads,
                            int num_kv_heads, int block_size, int r, int gqa_ratio, int table_stride, int max_blocks) {
    const int lane = threadIdx.x & 31;
    const int s = blockIdx.y;
    const long long i = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (s >= rows[0] || i >= min(max(counts[s], 0), table_stride)) return;   // warp-uniform; no barrier follows
    if (num_kv_heads <= 0 || block_size <= 0 || r <= 0 || gqa_ratio <= 0 ||
        num_q_heads != gqa_ratio * num_kv_heads)
        return;
    float* out = head_scores + ((size_t)s * table_stride + i) * num_q_heads;
    const int b = table[(size_t)s * table_stride + i];
    if (b < 0 || b >= max_blocks) {   // outside A_g: no score (skipped by the max; the combine writes NaN)
        for (int qh = lane; qh < num_q_heads; qh += 32) out[qh] = __int_as_float(0x7fffffff);
        return;
    }
    hss_head_scores_block(q_proj + (size_t)s * num_q_heads * r, k_lr + (size_t)b * num_kv_heads * block_size * r,
                          out, num_q_heads, block_size, r, gqa_ratio, lane);
}

extern "C" __global__ void __launch_bounds__(HSS_PRED_HEAD_THREADS)
predictor_head_max_rows(const float* __restrict__ head_scores, const int* __restrict__ counts,
                        const int* __restrict__ rows, float* __restrict__ head_max, int num_q_heads, int table_stride) {
    __shared__ float warp_best[HSS_PRED_HEAD_THREADS / 32];
    const int qh = blockIdx.x, s = blockIdx.y;
    if (qh >= num_q_heads || s >= rows[0] || blockDim.x != HSS_PRED_HEAD_THREADS) return;   // CTA-uniform
    const int n = min(max(counts[s], 0), table_stride);
    const float best = hss_head_max(head_scores + (size_t)s * table_stride * num_q_heads, num_q_heads, qh, n,
                                    warp_best);
    if (threadIdx.x == 0) head_max[(size_t)s * num_q_heads + qh] = best;
}

extern "C" __global__ void __launch_bounds__(HSS_PRED_HEAD_THREADS)
predictor_head_combine_rows(const float* __restrict__ head_scores, const float* __restrict__ head_max,
                            const int* __restrict__ table, const int* __restrict__ counts,
                            const int* __restrict__ rows, float* __restrict__ scores, int num_q_heads,
                            int table_stride, int max_blocks, float exp2_scale) {
    const int s = blockIdx.y;
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (s >= rows[0] || i >= min(max(counts[s], 0), table_stride)) return;
    const size_t at = (size_t)s * table_stride + i;
    const int b = table[at];
    scores[at] = (b < 0 || b >= max_blocks)
        ? __int_as_float(0x7fffffff)
        : hss_head_combine(head_scores + at * num_q_heads, head_max + (size_t)s * num_q_heads, num_q_heads,
                           exp2_scale);
}
