// qsa_device.cu: the QSA decode step on the device (docs/design.md §17.1-§17.4): R sequences of one indexer per launch,
// each sequence's position read from device memory, the step advancing it, nothing read back by the host.
// Built WITHOUT --use_fast_math, as qsa_indexer: IEEE f32 division, rsqrtf where the original used it, RoPE
// angles in double. Layouts row-major, outermost first; bf16 = __nv_bfloat16 (round-to-nearest-even on store).
// Scalars are u32 except the f32 theta, eps and scale.
//
// The step's device state (owned by the indexer): pos i32 [max_seqs] (slot s: tokens ingested), desc u64
// [max_seqs, 2] (slot s: raw_keys bf16 [max_tokens, hd] address, block_keys bf16 [max_tokens / ratio, hd]
// address), slots i32 [R] (batch row r -> its slot; distinct slots, each < max_seqs). Every kernel reads
// p = pos[slots[r]]; a row with slots[r] < 0 or p outside [0, max_tokens) is left alone (qsa_dev_topk writes
// its count 0 and does not advance it). Grids are sized for the worst case; CTAs with nothing to do return.
// Every kernel returns without touching memory when its launch contract is broken (checked uniformly per CTA,
// before any memory access or barrier). Pointers marked "16 B" / "8 B" must be so aligned (allocations are).
//
// qsa_dev_qk(act bf16 [R, k], w bf16 [n, k], out bf16 [R, n], rows = R, n, k)
//   grid (ceil(n / QSA_QK_COLS), 1, 1), block (QSA_QK_THREADS, 1, 1), no shared memory; 1 <= R <= QSA_QK_MAX_ROWS.
//   The step's qk projection for small batches (in place of a cuBLAS m = R GEMM): out[m, j] = bf16(sum_i
//   act[m, i] * w[j, i]), one warp per output column j for every row m: lane l sums the 8-element chunks l, l + 32,
//   ... of the row in order (f32 fma, elements ascending within a chunk), then the lanes' sums are added by a fixed
//   butterfly (xor 16, 8, 4, 2, 1). The bits of row m depend only on row m and w, never on R, the alignment (16-byte
//   vector loads where it allows, else scalar ones in the same order) or the grid.
// qsa_dev_prep(qk bf16 [R, qkw], q_norm_w bf16 [hd], k_norm_w bf16 [hd], desc, pos, slots, q_post f32
//              [R, n_heads, hd], qkw, n_heads, hd, ratio, rot, theta f32, eps f32, max_tokens)
//   grid (R, n_heads + 2, 1), block (hd, 1, 1) with hd a multiple of 32, dynamic smem (hd + 32) * 4 B.
//   (n_heads + 1) * hd <= qkw; rot even <= hd. CTA (r, y):
//   y < n_heads: q_post[r, y] = rope(rmsnorm(qk[r, y*hd .. +hd], q_norm_w), p)           (= qsa_qprep's math)
//   y == n_heads: raw_keys[p] = qk[r, n_heads*hd .. +hd]                                   (the token's raw key)
//   y == n_heads + 1: if (p + 1) % ratio == 0, block b = (p + 1) / ratio - 1 is complete:
//     block_keys[b] = bf16(rope(rmsnorm(mean of raw rows b*ratio .. p ascending, k_norm_w), b*ratio))
//     (= qsa_block_pool's math), reading row p from qk (CTA y == n_heads may not have stored it yet).
// qsa_dev_score(q_post f32 [R, n_heads, hd], desc, pos, slots, scores f32 [R, score_stride], score_stride,
//               n_heads, hd, ratio, k_blocks)
//   grid (G, R, 1) for any G >= 1 (grid-stride over blocks), block (32 * W <= 256, 1, 1), dynamic smem
//   n_heads * hd * 4 B. complete = (p + 1) / ratio; complete <= k_blocks (inert) or complete > score_stride:
//   nothing. Else scores[r, b] for b < complete = qsa_score's value for q_post[r] and block_keys of the slot,
//   bit for bit (the same code: per-head dots f32 fma in dim order, relu, heads summed in order, * rsqrtf(hd)).
//   Entries b >= complete are never written.
// qsa_dev_topk(scores f32 [R, score_stride], pos, slots, tokens i32 [R, sel_cap], counts i32 [R], score_stride,
//              k_blocks, ratio, sel_cap, max_tokens)
//   grid (R, 1, 1), block (QSA_TOPK_THREADS, 1, 1), dynamic smem: any (hss.decls.qsa_device.topk_smem_bytes);
//   a row of N > QSA_TOPK_TILE blocks caches its order keys there when 4 * N bytes fit, else re-reads the scores
//   (L2) at every pass; a row of at most QSA_TOPK_TILE blocks keeps them in registers. Needs
//   score_stride >= max_tokens / ratio, sel_cap >= k_blocks * ratio + ratio - 1, max_tokens < 2^31.
//   visible = p + 1, complete = visible / ratio, tail = visible % ratio, K = k_blocks.
//   Inert (complete <= K): tokens[r, 0 .. visible) = 0 .. visible - 1, counts[r] = visible.
//   Else the top K blocks under docs/design.md §17.1 (score descending, block index ascending; NaN below every number,
//   -inf above NaN; -0.0 == +0.0), ascending, expanded: tokens[r, i*ratio + j] = b_i*ratio + j, then the tail
//   complete*ratio .. visible - 1; counts[r] = K*ratio + tail. Entries past counts[r] are never written.
//   Last, after a barrier (every thread has read p): pos[slots[r]] = p + 1.
//   Algorithm: order-preserving u32 keys (NaN -> 0, -0.0 -> +0.0, else sign-flipped bits); a pre-pass finds the
//   smallest and largest key; a radix select over 8-bit digits (most significant first) from the highest bit in
//   which they differ, restricted to the keys matching the digits chosen so far, each pass a shared histogram (a
//   warp whose counted keys share a digit adds them with one atomic, else one atomic per key) then one warp
//   scanning its 256 bins from the top, stopping early once the threshold bucket is taken whole; then a stable
//   compaction: thread t owns QSA_TOPK_ITEMS consecutive blocks of a QSA_TOPK_TILE tile, one block-wide exclusive
//   scan per tile counts the keys above the threshold and the ones equal to it before each block, so the ties are
//   taken lowest index first and every chosen block knows its (ascending) output position.
// qsa_sparse_attn(q bf16 [R, nq, hd] 16 B, k_pool, v_pool bf16 [pages, block_size, nkv, hd] 16 B, block_tables
//                 i32 [R, max_pages], tokens i32 [R, sel_cap], counts i32 [R], part_ml f32 [R, nq, S, 2],
//                 part_o f32 [R, nq, S, hd] 8 B, max_pages, sel_cap, block_size, nq, nkv, hd, scale f32)
//   S = ceil(sel_cap / QSA_SPLIT). grid (R, nkv, S), block (QSA_ATTN_THREADS, 1, 1), dynamic smem
//   hss.decls.qsa_device.attn_smem_bytes(hd) (153,360 B at hd 256: needs the opt-in past 48 KiB).
//   hd a multiple of 32, <= 256; G = nq / nkv an integer in 1..16. CTA (r, g, s): the tokens
//   tokens[r, s*QSA_SPLIT ..) below n = min(counts[r], sel_cap) (a split past n returns), for the G query heads
//   of kv head g. Token t's K/V row: page block_tables[r, t / block_size], slot t % block_size, kv head g
//   (t < 0, t / block_size >= max_pages or a negative page: the token contributes nothing).
//   x = (q . k) * scale * log2(e) (bf16 mma, f32 accumulate in 4 interleaved chains over hd); per split and head
//   m = max x (log2 units), p = exp2(x - m), l = sum p (f32), o = sum p * v with p as bf16 hi + lo (>= 16 bits,
//   docs/design.md §0) in f32: part_ml[r, h, s] = (m, l), part_o[r, h, s, :] = o (h = g*G + head). The bits depend only
//   on (q, the split's token list, K/V), never on R, the grid or the other requests. A split without a valid token:
//   (-inf, 0), o 0.
//   CTA: Q (16 rows, rows >= G zero), the split's QSA_SPLIT K rows and V rows in shared memory by cp.async (missing
//   tokens as zero rows); warp w < QSA_SPLIT / 16 computes S for tokens 16w .. 16w + 15 (ldmatrix + mma.m16n8k16),
//   QSA_SPLIT / 8 threads per head take the softmax of the split's logits, then warp w computes O for the 8-column
//   tiles w, w + 8, ... over all the split's tokens (ldmatrix.trans of V). The code serves any QSA_SPLIT of whole
//   warps up to 128.
// qsa_sparse_merge(part_ml, part_o (as above), counts i32 [R], out bf16 [R, nq, hd], sel_cap, nq, hd)
//   grid (R, nq, 1), block (B, 1, 1) for any B (hss.decls.qsa_device.merge_threads: hd rounded up to 32, at
//   most 256). Folds the ceil(n / QSA_SPLIT) partials of (r, h) in split order: M = max m_s, w_s =
//   exp2(m_s - M), out = bf16(sum o_s w_s / sum l_s w_s) (f32, fma in split order); no token (n = 0, or every
//   split empty) -> zeros.
#include "hss_async.cuh"
#include "hss_common.cuh"
#include "hss_mma.cuh"
#include "hss_rope.cuh"
#include "hss_softmax.cuh"
#include "qsa_common.cuh"

typedef unsigned int u32;
typedef unsigned long long u64;

// Programmatic dependent launch (the sm_90 variant, ptx/qsa_device.sm_90.ptx; hss.qsa.device launches the step's
// kernels with programmatic stream serialization where it is served). Every kernel's first act, on every path:
// wait until the launches before it in the stream completed (their memory visible), then let the next launch
// start; so the next kernel's launch overlaps this one's run, and a kernel that returns early still orders the
// ones after it behind the ones before it. Without the launch attribute both are no-ops; the base build and the
// CPU SIMT harness have neither.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define QSD_PDL_ENTRY() asm volatile("griddepcontrol.wait;\n\tgriddepcontrol.launch_dependents;" ::: "memory")
#else
#define QSD_PDL_ENTRY()
#endif

#define QSA_TOPK_THREADS 1024    // qsa_dev_topk: block
#define QSA_TOPK_ITEMS 8         // qsa_dev_topk: consecutive blocks per thread in a tile
#define QSA_TOPK_TILE (QSA_TOPK_THREADS * QSA_TOPK_ITEMS)
#ifndef QSA_SPLIT                // qsa_sparse_attn: tokens per split (fixed: the bits depend on it; 128, 64 or 32)
#define QSA_SPLIT 128
#endif
#define QSA_ATTN_THREADS 256     // qsa_sparse_attn: 8 warps
#define QSA_ATTN_MAX_G 16        // qsa_sparse_attn: query heads per kv head (the 16 rows of an mma tile)
#define QSA_ATTN_MAX_HD 256
#define QSD_PARTS (QSA_SPLIT / 8)   // qsa_sparse_attn: softmax threads per head (8 tokens each)
static_assert(QSA_SPLIT % 32 == 0 && QSA_SPLIT <= 128 && 16 * QSD_PARTS <= QSA_ATTN_THREADS,
              "qsa_sparse_attn: a split is whole warps of tokens, at most 8 warps of 16, softmax in whole warps");
#define QSA_QK_THREADS 128       // qsa_dev_qk: 4 warps
#define QSA_QK_COLS (QSA_QK_THREADS / 32)   // qsa_dev_qk: output columns per CTA (one per warp)
#define QSA_QK_MAX_ROWS 8        // qsa_dev_qk: batch rows per launch at most
#define QSA_QK_AHEAD 12          // qsa_dev_qk: weight chunks a lane loads before using them

// The slot of batch row r and its position p (false: the row is left alone). Plain loads: qsa_dev_topk writes pos.
__device__ __forceinline__ bool qsd_row(const int* __restrict__ slots, const int* pos, u32 r, int& slot, u32& p) {
    slot = slots[r];
    if (slot < 0) return false;
    const int v = pos[slot];
    p = (u32)v;
    return v >= 0;
}

// ------------------------------------------------------------------------------------------------
// qsa_dev_qk
// ------------------------------------------------------------------------------------------------
// The eight bf16 of a 16-byte word as f32 (element 0 in the low half of the first word).
__device__ __forceinline__ void qsd_bf16x8(const uint4 v, float (&f)[8]) {
    const u32 w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        f[2 * j] = __uint_as_float(w[j] << 16);
        f[2 * j + 1] = __uint_as_float(w[j] & 0xffff0000u);
    }
}

// Eight bf16 from 16-byte-aligned memory, or (unaligned) one by one: the same values either way.
__device__ __forceinline__ void qsd_qk_chunk(const __nv_bfloat16* __restrict__ p, bool vec, float (&f)[8]) {
    if (vec) {
        qsd_bf16x8(__ldg(reinterpret_cast<const uint4*>(p)), f);
    } else {
#pragma unroll
        for (int j = 0; j < 8; ++j) f[j] = __bfloat162float(p[j]);
    }
}

// acc[m] += chunk c of act row m . wf (elements ascending, f32 fma) for the rows m < rows.
__device__ __forceinline__ void qsd_qk_rows(float (&acc)[QSA_QK_MAX_ROWS], const __nv_bfloat16* __restrict__ act,
                                            u32 k, u32 c, u32 rows, bool avec, const float (&wf)[8]) {
#pragma unroll
    for (int m = 0; m < QSA_QK_MAX_ROWS; ++m) {
        if ((u32)m < rows) {   // uniform
            float af[8];
            qsd_qk_chunk(act + (size_t)m * k + 8 * (size_t)c, avec, af);
#pragma unroll
            for (int j = 0; j < 8; ++j) acc[m] = fmaf(af[j], wf[j], acc[m]);
        }
    }
}

extern "C" __global__ void __launch_bounds__(QSA_QK_THREADS)
    qsa_dev_qk(const __nv_bfloat16* __restrict__ act, const __nv_bfloat16* __restrict__ w,
               __nv_bfloat16* __restrict__ out, u32 rows, u32 n, u32 k) {
    QSD_PDL_ENTRY();
    if (blockDim.x != QSA_QK_THREADS || blockDim.y != 1 || blockDim.z != 1 || gridDim.y != 1 || gridDim.z != 1 ||
        rows == 0 || rows > QSA_QK_MAX_ROWS || n == 0 || k == 0 || (u64)gridDim.x * QSA_QK_COLS < n)
        return;
    const u32 lane = threadIdx.x & 31;
    const u32 col = blockIdx.x * QSA_QK_COLS + (threadIdx.x >> 5);
    if (col >= n) return;   // warp-uniform
    const __nv_bfloat16* wr = w + (size_t)col * k;
    const bool full = (k & 7) == 0;
    const bool wvec = full && (reinterpret_cast<uintptr_t>(wr) & 15) == 0;
    const bool avec = full && (reinterpret_cast<uintptr_t>(act) & 15) == 0;
    float acc[QSA_QK_MAX_ROWS];
#pragma unroll
    for (int m = 0; m < QSA_QK_MAX_ROWS; ++m) acc[m] = 0.f;
    const u32 whole = k >> 3;   // chunks of 8 elements
    if (wvec) {   // QSA_QK_AHEAD of the lane's weight chunks in flight at once (k <= 32 * 8 * QSA_QK_AHEAD: all)
        const uint4* w4 = reinterpret_cast<const uint4*>(wr);
        for (u32 c0 = lane; c0 < whole; c0 += 32 * QSA_QK_AHEAD) {
            uint4 wv[QSA_QK_AHEAD];
#pragma unroll
            for (int b = 0; b < QSA_QK_AHEAD; ++b) {
                const u32 c = c0 + 32 * b;
                wv[b] = c < whole ? __ldg(w4 + c) : make_uint4(0u, 0u, 0u, 0u);
            }
#pragma unroll
            for (int b = 0; b < QSA_QK_AHEAD; ++b) {
                const u32 c = c0 + 32 * b;
                if (c >= whole) break;
                float wf[8];
                qsd_bf16x8(wv[b], wf);
                qsd_qk_rows(acc, act, k, c, rows, avec, wf);
            }
        }
    } else {   // the same chunks in the same order, loaded one element at a time
        for (u32 c = lane; c < whole; c += 32) {
            float wf[8];
            qsd_qk_chunk(wr + 8 * (size_t)c, false, wf);
            qsd_qk_rows(acc, act, k, c, rows, avec, wf);
        }
    }
    if (k & 7) {   // the last, partial chunk: lane whole % 32's, as if it were whole
        if (lane == (whole & 31)) {
            const u32 i0 = whole * 8;
            for (u32 i = i0; i < k; ++i) {
                const float wv = __bfloat162float(wr[i]);
#pragma unroll
                for (int m = 0; m < QSA_QK_MAX_ROWS; ++m)
                    if ((u32)m < rows) acc[m] = fmaf(__bfloat162float(act[(size_t)m * k + i]), wv, acc[m]);
            }
        }
    }
#pragma unroll
    for (int m = 0; m < QSA_QK_MAX_ROWS; ++m) {
        float v = acc[m];
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(HSS_FULL_MASK, v, off);
        if ((u32)m < rows && lane == (u32)m) out[(size_t)m * n + col] = __float2bfloat16_rn(v);
    }
}

// ------------------------------------------------------------------------------------------------
// qsa_dev_prep
// ------------------------------------------------------------------------------------------------

extern "C" __global__ void qsa_dev_prep(const __nv_bfloat16* __restrict__ qk, const __nv_bfloat16* __restrict__ q_norm_w,
                                        const __nv_bfloat16* __restrict__ k_norm_w, const u64* __restrict__ desc,
                                        const int* __restrict__ pos, const int* __restrict__ slots,
                                        float* __restrict__ q_post, u32 qkw, u32 n_heads, u32 hd, u32 ratio, u32 rot,
                                        float theta, float eps, u32 max_tokens) {
    extern __shared__ float smem[];   // [hd] normed row, then [32] warp sums
    QSD_PDL_ENTRY();
    if (hd == 0 || (hd & 31) || blockDim.x != hd || blockDim.y != 1 || blockDim.z != 1 || rot > hd || (rot & 1) ||
        ratio == 0 || gridDim.y != n_heads + 2 || gridDim.z != 1 || (u64)(n_heads + 1) * hd > qkw ||
        qsa_dynamic_smem_bytes() < (hd + 32) * 4)
        return;
    const u32 r = blockIdx.x, y = blockIdx.y, d = threadIdx.x;
    int slot;
    u32 p;
    if (!qsd_row(slots, pos, r, slot, p) || p >= max_tokens) return;
    const __nv_bfloat16* row = qk + (size_t)r * qkw;
    if (y < n_heads) {
        qsa_rms_norm(__bfloat162float(row[(size_t)y * hd + d]), q_norm_w, hd, eps, smem, smem + hd);
        q_post[((size_t)r * n_heads + y) * hd + d] = hss_rope(smem, d, rot, (double)p, theta);
        return;
    }
    const __nv_bfloat16 key = row[(size_t)n_heads * hd + d];   // this token's raw key, element d
    __nv_bfloat16* raw = reinterpret_cast<__nv_bfloat16*>(desc[2 * (size_t)slot]);
    if (y == n_heads) {
        raw[(size_t)p * hd + d] = key;
        return;
    }
    if ((p + 1) % ratio) return;   // no block completes at this token (uniform per CTA)
    const size_t b = (p + 1) / ratio - 1;
    float sum = 0.0f;
    for (u32 i = 0; i < ratio; ++i) {   // ascending rows, as qsa_block_pool; row p is this token's
        const size_t t = b * ratio + i;
        sum += __bfloat162float(t == p ? key : raw[t * hd + d]);
    }
    const float v = sum / (float)ratio;
    qsa_rms_norm(v, k_norm_w, hd, eps, smem, smem + hd);
    __nv_bfloat16* keys = reinterpret_cast<__nv_bfloat16*>(desc[2 * (size_t)slot + 1]);
    keys[b * hd + d] = __float2bfloat16_rn(hss_rope(smem, d, rot, (double)b * (double)ratio, theta));
}

// ------------------------------------------------------------------------------------------------
// qsa_dev_score (qsa_indexer's qsa_score, per batch row)
// ------------------------------------------------------------------------------------------------
extern "C" __global__ void __launch_bounds__(QSA_SCORE_THREADS)
    qsa_dev_score(const float* __restrict__ q_post, const u64* __restrict__ desc, const int* __restrict__ pos,
                  const int* __restrict__ slots, float* __restrict__ scores, u32 score_stride, u32 n_heads, u32 hd,
                  u32 ratio, u32 k_blocks) {
    extern __shared__ __align__(16) float qs[];   // [n_heads, hd]
    QSD_PDL_ENTRY();
    if (hd == 0 || n_heads == 0 || ratio == 0 || (blockDim.x & 31) || blockDim.x > QSA_SCORE_THREADS ||
        blockDim.y != 1 || blockDim.z != 1 || gridDim.z != 1 ||
        (u64)qsa_dynamic_smem_bytes() < 4ull * n_heads * hd)
        return;
    const u32 r = blockIdx.y;
    int slot;
    u32 p;
    if (!qsd_row(slots, pos, r, slot, p)) return;
    const u64 complete = ((u64)p + 1) / ratio;
    if (complete <= k_blocks || complete > score_stride) return;   // inert (or past the row): nothing to score
    const __nv_bfloat16* keys = reinterpret_cast<const __nv_bfloat16*>(desc[2 * (size_t)slot + 1]);
    const float* q = q_post + (size_t)r * n_heads * hd;
    float* out = scores + (size_t)r * score_stride;
    const u32 n = (u32)complete;
    const bool aligned = (reinterpret_cast<uintptr_t>(keys) & 15) == 0;
    if (aligned && hd == 128)
        qsa_score_chunks<16>(q, keys, out, n, n_heads, hd, qs);
    else if (aligned && hd == 64)
        qsa_score_chunks<8>(q, keys, out, n, n_heads, hd, qs);
    else if (aligned && hd == 256)
        qsa_score_chunks<32>(q, keys, out, n, n_heads, hd, qs);
    else if (aligned && hd == 32)
        qsa_score_chunks<4>(q, keys, out, n, n_heads, hd, qs);
    else
        qsa_score_dims(q, keys, out, n, n_heads, hd, qs);
}

// ------------------------------------------------------------------------------------------------
// qsa_dev_topk
// ------------------------------------------------------------------------------------------------
// The docs/design.md §17.1 order as an unsigned key: larger key = ranked first. NaN -> 0 (below -inf's 0x007fffff),
// -0.0 -> +0.0, negatives bit-flipped, non-negatives with the sign bit set.
__device__ __forceinline__ u32 qsd_order_key(u32 bits) {
    const u32 mag = bits & 0x7fffffffu;
    if (mag > 0x7f800000u) return 0u;
    if (mag == 0u) bits = 0u;
    return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}

// Score bits of this thread's QSA_TOPK_ITEMS consecutive entries from index i0 of a row with `n` readable entries.
__device__ __forceinline__ void qsd_topk_load(const float* __restrict__ row, size_t i0, size_t n, bool vec,
                                              u32 (&v)[QSA_TOPK_ITEMS]) {
    if (vec && i0 + QSA_TOPK_ITEMS <= n) {
        const uint4* src = reinterpret_cast<const uint4*>(row + i0);
        const uint4 a = __ldg(src), b = __ldg(src + 1);
        v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
        v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
    } else {
#pragma unroll
        for (int j = 0; j < QSA_TOPK_ITEMS; ++j) v[j] = i0 + j < n ? __float_as_uint(__ldg(row + i0 + j)) : 0u;
    }
}

// Keys of tile `tile` for this thread: from the shared cache (filled at the first load), or the scores.
__device__ __forceinline__ void qsd_topk_keys(const float* __restrict__ row, u32 n, u32 tile, bool vec, u32* cache,
                                              bool from_cache, bool to_cache, u32 (&key)[QSA_TOPK_ITEMS]) {
    const size_t i0 = (size_t)tile * QSA_TOPK_TILE + (size_t)threadIdx.x * QSA_TOPK_ITEMS;
    const bool full = i0 + QSA_TOPK_ITEMS <= n;
    if (from_cache) {   // each thread reads back only the entries it cached itself: no barrier needed
        if (full) {
            const uint4 a = *reinterpret_cast<const uint4*>(cache + i0);
            const uint4 b = *reinterpret_cast<const uint4*>(cache + i0 + 4);
            key[0] = a.x; key[1] = a.y; key[2] = a.z; key[3] = a.w;
            key[4] = b.x; key[5] = b.y; key[6] = b.z; key[7] = b.w;
        } else {
#pragma unroll
            for (int j = 0; j < QSA_TOPK_ITEMS; ++j) key[j] = i0 + j < n ? cache[i0 + j] : 0u;
        }
        return;
    }
    u32 bits[QSA_TOPK_ITEMS];
    qsd_topk_load(row, i0, n, vec, bits);
#pragma unroll
    for (int j = 0; j < QSA_TOPK_ITEMS; ++j) key[j] = qsd_order_key(bits[j]);
    if (to_cache) {
        if (full) {
            *reinterpret_cast<uint4*>(cache + i0) = make_uint4(key[0], key[1], key[2], key[3]);
            *reinterpret_cast<uint4*>(cache + i0 + 4) = make_uint4(key[4], key[5], key[6], key[7]);
        } else {
#pragma unroll
            for (int j = 0; j < QSA_TOPK_ITEMS; ++j)
                if (i0 + j < n) cache[i0 + j] = key[j];
        }
    }
}

// hist[digit] += 1 for each active lane (every lane of the warp calls it); QSA_TOPK_HIST picks how a warp adds its
// counted keys (the same counts in every case, so the same selection):
//   0: where the warp's active lanes share one digit (equal scores, a narrow range of them) its first active lane
//      adds their count with one atomic, else each active lane adds 1 (on an H100 the sampler's radix counts ran
//      faster so than aggregating equal digits with __match_any_sync first; same-address atomics of a whole warp
//      serialise, hence the uniform case);
//   1: one atomic per distinct digit among the active lanes (__match_any_sync);
//   2: up to QSA_TOPK_ROUNDS rounds of one atomic per distinct digit found by ballot (a pass over a few binades has
//      few), then one atomic per lane for what is left.
// 0 is the measured default; 1 and 2 are there to be timed against it (build with -DQSA_TOPK_HIST=1 or 2).
#ifndef QSA_TOPK_HIST
#define QSA_TOPK_HIST 0
#endif
#define QSA_TOPK_ROUNDS 4
__device__ __forceinline__ void qsd_hist_add(u32* hist, u32 digit, bool active) {
    const u32 act = __ballot_sync(HSS_FULL_MASK, active);
    if (act == 0u) return;   // warp-uniform
    const u32 lane = threadIdx.x & 31;
#if QSA_TOPK_HIST == 1
    const u32 peers = __match_any_sync(HSS_FULL_MASK, active ? digit : 0xffffffffu) & act;   // digits are < 256
    if (active && lane == (u32)__ffs(peers) - 1) atomicAdd(hist + digit, (u32)__popc(peers));
#elif QSA_TOPK_HIST == 2
    u32 left = act;
#pragma unroll
    for (int round = 0; round < QSA_TOPK_ROUNDS; ++round) {
        if (left == 0u) return;   // warp-uniform
        const u32 lead = __ffs(left) - 1;
        const u32 d0 = __shfl_sync(HSS_FULL_MASK, digit, lead);
        const u32 same = __ballot_sync(HSS_FULL_MASK, digit == d0) & left;
        if (lane == lead) atomicAdd(hist + d0, (u32)__popc(same));
        left &= ~same;
    }
    if ((left >> lane) & 1u) atomicAdd(hist + digit, 1u);
#else
    const u32 lead = __ffs(act) - 1;
    const u32 d0 = __shfl_sync(HSS_FULL_MASK, digit, lead);
    if (__all_sync(HSS_FULL_MASK, !active || digit == d0)) {
        if (lane == lead) atomicAdd(hist + d0, (u32)__popc(act));
    } else if (active) {
        atomicAdd(hist + digit, 1u);
    }
#endif
}

// Warp 0: the digit holding rank `krem` counted from the top of the 256-bin histogram `hist`:
// choice = (digit, entries in higher bins, entries in the digit's bin). Needs krem <= the histogram's total.
__device__ __forceinline__ void qsd_topk_choose(const u32* hist, u32 krem, u32* choice) {
    const u32 lane = threadIdx.x & 31;
    const uint4 a = *reinterpret_cast<const uint4*>(hist + 8 * lane);
    const uint4 b = *reinterpret_cast<const uint4*>(hist + 8 * lane + 4);
    const u32 c[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
    const u32 own = ((c[0] + c[1]) + (c[2] + c[3])) + ((c[4] + c[5]) + (c[6] + c[7]));
    u32 suffix = own;   // inclusive: bins of lanes >= this one
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
        const u32 v = __shfl_down_sync(HSS_FULL_MASK, suffix, off);
        if (lane + off < 32) suffix += v;
    }
    u32 above = suffix - own;
    if (above < krem && krem <= suffix) {   // exactly one lane
#pragma unroll
        for (int j = 7; j >= 0; --j) {
            if (above + c[j] >= krem) {
                choice[0] = 8 * lane + j;
                choice[1] = above;
                choice[2] = c[j];
                break;
            }
            above += c[j];
        }
    }
}

// Exclusive scan of v over the CTA (every thread calls it); *total gets the sum. ws: shared [32]. Two barriers.
__device__ __forceinline__ u32 qsd_block_scan(u32 v, u32* ws, u32* total) {
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    u32 incl = v;
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
        const u32 t = __shfl_up_sync(HSS_FULL_MASK, incl, off);
        if (lane >= (u32)off) incl += t;
    }
    if (lane == 31) ws[warp] = incl;
    __syncthreads();
    if (warp == 0) {   // QSA_TOPK_THREADS = 32 warps: one value per lane
        const u32 w = ws[lane];
        u32 wi = w;
#pragma unroll
        for (int off = 1; off < 32; off <<= 1) {
            const u32 t = __shfl_up_sync(HSS_FULL_MASK, wi, off);
            if (lane >= (u32)off) wi += t;
        }
        ws[lane] = wi - w;
        if (lane == 31) *total = wi;
    }
    __syncthreads();
    return ws[warp] + incl - v;
}

// Tokens of selected block `blk` at selection position `at`: out[at*ratio + j] = blk*ratio + j.
__device__ __forceinline__ void qsd_emit(int* __restrict__ out, u32 at, u32 blk, u32 ratio, bool vec4) {
    const u32 t0 = blk * ratio;
    if (vec4) {
        *reinterpret_cast<int4*>(out + (size_t)at * 4) = make_int4((int)t0, (int)t0 + 1, (int)t0 + 2, (int)t0 + 3);
    } else {
        for (u32 j = 0; j < ratio; ++j) out[(size_t)at * ratio + j] = (int)(t0 + j);
    }
}

// The top k (0 < k < n) of the n scores of `row` by docs/design.md §17.1, expanded ascending into out[0 .. k*ratio).
__device__ __forceinline__ void qsd_topk_select(const float* __restrict__ row, u32 n, u32 k, u32 ratio,
                                                int* __restrict__ out, const u32 (&bits0)[QSA_TOPK_ITEMS], bool vec,
                                                bool vec4, u32* cache) {
    __shared__ __align__(16) u32 hist[2][256];
    __shared__ u32 choice[3];
    __shared__ u32 wsum[2][32];
    __shared__ u32 tile_total[2];
    __shared__ u32 wmin[32], wmax[32];
    const u32 tid = threadIdx.x, warp = tid >> 5;
    const u32 n_tiles = (n + QSA_TOPK_TILE - 1) / QSA_TOPK_TILE;
    const bool cached = n_tiles > 1 && 4ull * n <= qsa_dynamic_smem_bytes();
    for (u32 i = tid; i < 2 * 256; i += QSA_TOPK_THREADS) (&hist[0][0])[i] = 0u;

    // Pre-pass: the smallest and largest key (caching every tile's keys where there is room). The radix passes
    // start at the highest bit in which the keys differ: the bits above it are every key's, so a row of scores in
    // a narrow range spends no pass (and no contended atomics) on them.
    u32 key[QSA_TOPK_ITEMS];   // tile 0's keys, kept for the whole selection when the row is one tile
#pragma unroll
    for (int j = 0; j < QSA_TOPK_ITEMS; ++j) key[j] = qsd_order_key(bits0[j]);
    u32 kmin = 0xffffffffu, kmax = 0u;
    for (u32 t = 0; t < n_tiles; ++t) {
        const size_t i0 = (size_t)t * QSA_TOPK_TILE + (size_t)tid * QSA_TOPK_ITEMS;
        if (t > 0) {
            qsd_topk_keys(row, n, t, vec, cache, false, cached, key);
        } else if (cached) {
#pragma unroll
            for (int j = 0; j < QSA_TOPK_ITEMS; ++j)
                if (i0 + j < n) cache[i0 + j] = key[j];
        }
#pragma unroll
        for (int j = 0; j < QSA_TOPK_ITEMS; ++j) {
            if (i0 + j < n) {
                kmin = min(kmin, key[j]);
                kmax = max(kmax, key[j]);
            }
        }
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
        kmin = min(kmin, __shfl_xor_sync(HSS_FULL_MASK, kmin, off));
        kmax = max(kmax, __shfl_xor_sync(HSS_FULL_MASK, kmax, off));
    }
    if ((tid & 31) == 0) {
        wmin[warp] = kmin;
        wmax[warp] = kmax;
    }
    __syncthreads();   // histograms cleared, every warp's extremes written
#pragma unroll 8
    for (u32 w = 0; w < QSA_TOPK_THREADS / 32; ++w) {
        kmin = min(kmin, wmin[w]);
        kmax = max(kmax, wmax[w]);
    }
    const u32 diff = kmin ^ kmax;
    const int top = diff ? 31 - __clz(diff) : -1;   // the highest bit in which two keys differ (-1: all equal)

    // Radix select: after a pass, the keys whose bits under `mask` equal `prefix` hold the threshold, and krem
    // of them are still to be taken; the ones above the prefix are all taken. Pass digits: bits hi .. hi - 7 from
    // hi = top down (the last one narrower where top + 1 is not a multiple of 8).
    u32 mask = top < 0 ? 0xffffffffu : (top == 31 ? 0u : 0xffffffffu << (top + 1));
    u32 prefix = kmin & mask, krem = k;
    int pass = 0;
    for (int hi = top; hi >= 0; hi -= 8, ++pass) {
        const int shift = max(hi - 7, 0);
        const u32 dmask = (2u << (hi - shift)) - 1u;
        u32* h = hist[pass & 1];
        for (u32 t = 0; t < n_tiles; ++t) {
            if (n_tiles > 1) qsd_topk_keys(row, n, t, vec, cache, cached, false, key);
            const size_t i0 = (size_t)t * QSA_TOPK_TILE + (size_t)tid * QSA_TOPK_ITEMS;
#pragma unroll
            for (int j = 0; j < QSA_TOPK_ITEMS; ++j)
                qsd_hist_add(h, (key[j] >> shift) & dmask, i0 + j < n && (key[j] & mask) == prefix);
        }
        __syncthreads();   // histogram complete
        if (warp == 0)
            qsd_topk_choose(h, krem, choice);
        else if (warp == 1)   // the other buffer's last reader (the previous pass's choice) is behind the barrier above
            for (u32 i = tid & 31; i < 256; i += 32) hist[(pass + 1) & 1][i] = 0u;
        __syncthreads();   // choice visible
        const u32 digit = choice[0], above = choice[1], bucket = choice[2];
        krem -= above;
        prefix |= digit << shift;
        mask |= dmask << shift;
        if (bucket == krem) break;   // the threshold bucket is taken whole (uniform: everyone read the same)
    }

    // Stable compaction: block i is taken iff (key & mask) > prefix, or == prefix and fewer than krem of those
    // precede it; its output position is (taken before it) = above_before + min(equal_before, krem).
    u32 run_gt = 0u, run_eq = 0u;
    for (u32 t = 0; t < n_tiles; ++t) {
        if (n_tiles > 1) qsd_topk_keys(row, n, t, vec, cache, cached, false, key);
        const size_t i0 = (size_t)t * QSA_TOPK_TILE + (size_t)tid * QSA_TOPK_ITEMS;
        u32 n_gt = 0u, n_eq = 0u;
#pragma unroll
        for (int j = 0; j < QSA_TOPK_ITEMS; ++j) {
            if (i0 + j < n) {
                const u32 km = key[j] & mask;
                n_gt += km > prefix;
                n_eq += km == prefix;
            }
        }
        // both counts of a tile fit 16 bits (<= QSA_TOPK_TILE = 8192 each): one scan of gt | eq << 16
        const u32 before = qsd_block_scan(n_gt | (n_eq << 16), wsum[t & 1], &tile_total[t & 1]);
        const u32 total = tile_total[t & 1];
        u32 gt = run_gt + (before & 0xffffu), eq = run_eq + (before >> 16);
        if (gt + min(eq, krem) < k) {   // else nothing of this thread's run is taken
#pragma unroll
            for (int j = 0; j < QSA_TOPK_ITEMS; ++j) {
                if (i0 + j < n) {
                    const u32 km = key[j] & mask;
                    if (km > prefix) {
                        qsd_emit(out, gt + min(eq, krem), (u32)(i0 + j), ratio, vec4);
                        ++gt;
                    } else if (km == prefix) {
                        if (eq < krem) qsd_emit(out, gt + eq, (u32)(i0 + j), ratio, vec4);
                        ++eq;
                    }
                }
            }
        }
        run_gt += total & 0xffffu;
        run_eq += total >> 16;
    }
}

extern "C" __global__ void __launch_bounds__(QSA_TOPK_THREADS)
    qsa_dev_topk(const float* __restrict__ scores, int* pos, const int* __restrict__ slots, int* __restrict__ tokens,
                 int* __restrict__ counts, u32 score_stride, u32 k_blocks, u32 ratio, u32 sel_cap, u32 max_tokens) {
    extern __shared__ __align__(16) u32 key_cache[];   // [N] order keys (when the launch gave room for them)
    QSD_PDL_ENTRY();
    if (blockDim.x != QSA_TOPK_THREADS || blockDim.y != 1 || blockDim.z != 1 || gridDim.y != 1 || gridDim.z != 1 ||
        ratio == 0 || max_tokens > 0x7fffffffu || (u64)score_stride < max_tokens / ratio ||
        (u64)sel_cap + 1 < ((u64)k_blocks + 1) * ratio)
        return;
    const u32 r = blockIdx.x, tid = threadIdx.x;
    const float* row = scores + (size_t)r * score_stride;
    const bool vec = (reinterpret_cast<uintptr_t>(row) & 15) == 0;
    u32 bits0[QSA_TOPK_ITEMS];   // tile 0 of the row, loaded while the slot and position arrive
    qsd_topk_load(row, (size_t)tid * QSA_TOPK_ITEMS, score_stride, vec, bits0);
    int slot;
    u32 p;
    if (!qsd_row(slots, pos, r, slot, p) || p >= max_tokens) {
        if (tid == 0) counts[r] = 0;
        return;
    }
    const u32 visible = p + 1, complete = visible / ratio, tail = visible - complete * ratio;
    int* out = tokens + (size_t)r * sel_cap;
    if (complete <= k_blocks) {   // inert: every visible token
        for (u32 i = tid; i < visible; i += QSA_TOPK_THREADS) out[i] = (int)i;
        if (tid == 0) counts[r] = (int)visible;
    } else {
        if (k_blocks > 0) {
            const bool vec4 = ratio == 4 && (reinterpret_cast<uintptr_t>(out) & 15) == 0;
            qsd_topk_select(row, complete, k_blocks, ratio, out, bits0, vec, vec4, key_cache);
        }
        const u32 sel = k_blocks * ratio;
        for (u32 i = tid; i < tail; i += QSA_TOPK_THREADS) out[sel + i] = (int)(complete * ratio + i);
        if (tid == 0) counts[r] = (int)(sel + tail);
    }
    __syncthreads();   // every thread has read p
    if (tid == 0) pos[slot] = (int)visible;
}

// ------------------------------------------------------------------------------------------------
// qsa_sparse_attn
// ------------------------------------------------------------------------------------------------
// Shared memory of one CTA for head dim HD (hss.decls.qsa_device.attn_smem_bytes mirrors it): Q [16][HD+8] bf16,
// K and V [QSA_SPLIT][HD+8] bf16, S [16][QSA_SPLIT+8] f32, token row offsets [QSA_SPLIT] i64, the valid tokens as a
// QSA_SPLIT-bit mask. P hi and lo ([16][QSA_SPLIT+8] bf16 each) reuse K's space once S is done. The +8 pads make
// every ldmatrix conflict-free.
template <int HD>
struct QsdAttnSmem {
    static constexpr u32 RS = HD + 8;                  // bf16 row stride of Q, K, V
    static constexpr u32 SS = QSA_SPLIT + 8;           // f32 row stride of S, bf16 row stride of P
    static constexpr u32 Q = 0;
    static constexpr u32 K = Q + 16 * RS * 2;
    static constexpr u32 V = K + QSA_SPLIT * RS * 2;
    static constexpr u32 S = V + QSA_SPLIT * RS * 2;
    static constexpr u32 OFF = S + 16 * SS * 4;
    static constexpr u32 MASK = OFF + QSA_SPLIT * 8;
    static constexpr u32 BYTES = MASK + QSA_SPLIT / 8;
};

template <int HD>
__device__ __forceinline__ void qsd_sparse_attn_body(
    const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k_pool, const __nv_bfloat16* __restrict__ v_pool,
    const int* __restrict__ block_tables, const int* __restrict__ tokens, u32 n_total, float* __restrict__ part_ml,
    float* __restrict__ part_o, u32 max_pages, u32 sel_cap, u32 bs, u32 nq, u32 nkv, u32 G, u32 splits, float scale,
    unsigned char* smem) {
    using L = QsdAttnSmem<HD>;
    constexpr u32 CH = HD / 8;     // 16-byte chunks per row
    constexpr u32 NT = HD / 8;     // 8-column n-tiles of O
    constexpr u32 NJ = (NT + 7) / 8;
    constexpr u32 RS = L::RS, SS = L::SS;
    __nv_bfloat16* qs = reinterpret_cast<__nv_bfloat16*>(smem + L::Q);
    __nv_bfloat16* ks = reinterpret_cast<__nv_bfloat16*>(smem + L::K);
    __nv_bfloat16* vs = reinterpret_cast<__nv_bfloat16*>(smem + L::V);
    float* ss = reinterpret_cast<float*>(smem + L::S);
    long long* offs = reinterpret_cast<long long*>(smem + L::OFF);
    u32* valid = reinterpret_cast<u32*>(smem + L::MASK);   // bit t % 32 of word t / 32: token t contributes
    __nv_bfloat16* ph = ks;             // after S: P hi [16][SS]
    __nv_bfloat16* pl = ks + 16 * SS;   //          P lo [16][SS]
    const u32 r = blockIdx.x, kvh = blockIdx.y, s = blockIdx.z;
    const u32 tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, c = lane & 3;
    const u32 first = s * QSA_SPLIT;
    const u32 n = min((u32)QSA_SPLIT, n_total - first);
    const size_t qrow = (size_t)r * nq + (size_t)kvh * G;   // first query head of this kv head

    // 1. Q rows (zero past G) and each token's element offset in the pools (-1: contributes nothing).
    for (u32 i = tid; i < 16 * CH; i += QSA_ATTN_THREADS) {
        const u32 row = i / CH, col = i - row * CH;
        uint4 v = make_uint4(0u, 0u, 0u, 0u);
        if (row < G) v = __ldg(reinterpret_cast<const uint4*>(q + (qrow + row) * HD) + col);
        *reinterpret_cast<uint4*>(qs + row * RS + col * 8) = v;
    }
    if (tid < QSA_SPLIT) {
        long long off = -1;
        if (tid < n) {
            const int t = tokens[(size_t)r * sel_cap + first + tid];
            if (t >= 0) {
                const u32 pg = (u32)t / bs;
                if (pg < max_pages) {
                    const int page = block_tables[(size_t)r * max_pages + pg];
                    if (page >= 0)
                        off = (((long long)page * bs + ((u32)t - pg * bs)) * nkv + kvh) * (long long)HD;
                }
            }
        }
        offs[tid] = off;
        const u32 bits = __ballot_sync(HSS_FULL_MASK, off >= 0);   // warps 0 .. QSA_SPLIT/32 - 1, whole
        if (lane == 0) valid[warp] = bits;
    }
    __syncthreads();

    // 2. K rows, then V rows, by cp.async (two groups); rows of missing tokens are zeros (finite for the mma).
    for (u32 i = tid; i < QSA_SPLIT * CH; i += QSA_ATTN_THREADS) {
        const u32 row = i / CH, col = i - row * CH;
        const long long off = offs[row];
        __nv_bfloat16* dst = ks + row * RS + col * 8;
        if (off >= 0) hss_cp_async16(dst, k_pool + off + col * 8);
        else *reinterpret_cast<uint4*>(dst) = make_uint4(0u, 0u, 0u, 0u);
    }
    hss_cp_commit();
    for (u32 i = tid; i < QSA_SPLIT * CH; i += QSA_ATTN_THREADS) {
        const u32 row = i / CH, col = i - row * CH;
        const long long off = offs[row];
        __nv_bfloat16* dst = vs + row * RS + col * 8;
        if (off >= 0) hss_cp_async16(dst, v_pool + off + col * 8);
        else *reinterpret_cast<uint4*>(dst) = make_uint4(0u, 0u, 0u, 0u);
    }
    hss_cp_commit();
    hss_cp_wait<1>();   // this thread's K copies landed
    __syncthreads();    // everyone's

    // 3. S = Q K^T for tokens 16w .. 16w + 15 (two n-tiles; warps past the split's tokens idle), scaled to log2
    //    units, into shared S.
    if (16 * warp < QSA_SPLIT) {   // warp-uniform
        const u32 arow = (lane & 7) + ((lane >> 3) & 1) * 8, acol = (lane >> 4) * 8;        // A: Q rows, dims
        const u32 krow = 16 * warp + (lane & 7) + (lane >> 4) * 8, kcol = ((lane >> 3) & 1) * 8;   // B: K rows
        // [n-tile][k-step mod 4][fragment]: four short tensor-core chains per dot product (as qsa_prefill_attn_tc),
        // summed as (0 + 1) + (2 + 3)
        float acc[2][4][4];
#pragma unroll
        for (u32 j = 0; j < 2; ++j)
#pragma unroll
            for (u32 a = 0; a < 4; ++a) acc[j][a][0] = acc[j][a][1] = acc[j][a][2] = acc[j][a][3] = 0.f;
#pragma unroll
        for (u32 kk = 0; kk < HD / 16; ++kk) {
            uint32_t a[4], b[4];
            hss_ldsm_x4(a, qs + arow * RS + kk * 16 + acol);
            hss_ldsm_x4(b, ks + krow * RS + kk * 16 + kcol);
            hss_mma16816(acc[0][kk & 3], a, b[0], b[1]);
            hss_mma16816(acc[1][kk & 3], a, b[2], b[3]);
        }
        const float sl2 = scale * 1.4426950408889634f;
#pragma unroll
        for (u32 j = 0; j < 2; ++j) {
            float x[4];
#pragma unroll
            for (u32 e = 0; e < 4; ++e) x[e] = ((acc[j][0][e] + acc[j][1][e]) + (acc[j][2][e] + acc[j][3][e])) * sl2;
            const u32 col = 16 * warp + 8 * j + 2 * c;
            *reinterpret_cast<float2*>(ss + g * SS + col) = make_float2(x[0], x[1]);
            *reinterpret_cast<float2*>(ss + (g + 8) * SS + col) = make_float2(x[2], x[3]);
        }
    }
    __syncthreads();   // S complete; K no longer read (P takes its space)

    // 4. Softmax per head over the split: QSA_SPLIT / 8 threads per head, 8 tokens each (whole warps; the rest idle).
    if (tid < 16 * QSD_PARTS) {
        const u32 h = tid / QSD_PARTS, part = tid % QSD_PARTS;
        const float ninf = hss_neg_inf();
        const u32 live = valid[part >> 2] >> ((part & 3) * 8);   // tokens part*8 .. part*8 + 7
        const float4 s0 = *reinterpret_cast<const float4*>(ss + h * SS + part * 8);
        const float4 s1 = *reinterpret_cast<const float4*>(ss + h * SS + part * 8 + 4);
        const float sv[8] = {s0.x, s0.y, s0.z, s0.w, s1.x, s1.y, s1.z, s1.w};
        float x[8];
        float m = ninf;
#pragma unroll
        for (u32 j = 0; j < 8; ++j) {
            x[j] = (live >> j) & 1u ? sv[j] : ninf;
            m = fmaxf(m, x[j]);
        }
#pragma unroll
        for (int off = QSD_PARTS / 2; off > 0; off >>= 1) m = fmaxf(m, __shfl_xor_sync(HSS_FULL_MASK, m, off));
        float pv[8];
        float l = 0.f;
#pragma unroll
        for (u32 j = 0; j < 8; ++j) {
            pv[j] = m == ninf ? 0.f : hss_softmax_weight(x[j], m);
            l += pv[j];
        }
#pragma unroll
        for (int off = QSD_PARTS / 2; off > 0; off >>= 1) l += __shfl_xor_sync(HSS_FULL_MASK, l, off);
        uint4 hi, lo;
        hss_bf16_split2(pv[0], pv[1], hi.x, lo.x);
        hss_bf16_split2(pv[2], pv[3], hi.y, lo.y);
        hss_bf16_split2(pv[4], pv[5], hi.z, lo.z);
        hss_bf16_split2(pv[6], pv[7], hi.w, lo.w);
        *reinterpret_cast<uint4*>(ph + h * SS + part * 8) = hi;
        *reinterpret_cast<uint4*>(pl + h * SS + part * 8) = lo;
        if (part == 0 && h < G) {
            float* ml = part_ml + (((qrow + h) * splits) + s) * 2;
            ml[0] = m;
            ml[1] = l;
        }
    }
    hss_cp_wait<0>();   // this thread's V copies landed
    __syncthreads();    // everyone's, and P complete

    // 5. O = P V for the n-tiles j = w, w + 8, ... over the split's tokens (k-steps of 16), each k-step's
    //    hi and lo products summed from zero then added to the f32 O (no long tensor-core accumulation chain).
    {
        const u32 arow = (lane & 7) + ((lane >> 3) & 1) * 8, acol = (lane >> 4) * 8;   // A: P rows, tokens
        const u32 vrow = (lane & 7) + ((lane >> 3) & 1) * 8;                          // B: V rows (x2: lanes < 16)
        float o[NJ][4];
#pragma unroll
        for (u32 jj = 0; jj < NJ; ++jj) o[jj][0] = o[jj][1] = o[jj][2] = o[jj][3] = 0.f;
#pragma unroll
        for (u32 kk = 0; kk < QSA_SPLIT / 16; ++kk) {
            uint32_t ah[4], al[4];
            hss_ldsm_x4(ah, ph + arow * SS + kk * 16 + acol);
            hss_ldsm_x4(al, pl + arow * SS + kk * 16 + acol);
#pragma unroll
            for (u32 jj = 0; jj < NJ; ++jj) {
                const u32 j = warp + 8 * jj;
                if (j < NT) {   // warp-uniform
                    uint32_t b0, b1;
                    hss_ldsm_x2_trans(b0, b1, vs + (kk * 16 + vrow) * RS + j * 8);
                    float t[4] = {0.f, 0.f, 0.f, 0.f};
                    hss_mma16816(t, ah, b0, b1);
                    hss_mma16816(t, al, b0, b1);
                    o[jj][0] += t[0];
                    o[jj][1] += t[1];
                    o[jj][2] += t[2];
                    o[jj][3] += t[3];
                }
            }
        }
#pragma unroll
        for (u32 jj = 0; jj < NJ; ++jj) {
            const u32 j = warp + 8 * jj;
            if (j >= NT) continue;
            const u32 col = j * 8 + 2 * c;
            float* row0 = part_o + ((qrow + g) * splits + s) * HD + col;   // head g; head g + 8 is 8 rows on
            if (g < G) *reinterpret_cast<float2*>(row0) = make_float2(o[jj][0], o[jj][1]);
            if (g + 8 < G) *reinterpret_cast<float2*>(row0 + 8 * (size_t)splits * HD) = make_float2(o[jj][2], o[jj][3]);
        }
    }
}

extern "C" __global__ void __launch_bounds__(QSA_ATTN_THREADS) qsa_sparse_attn(
    const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k_pool, const __nv_bfloat16* __restrict__ v_pool,
    const int* __restrict__ block_tables, const int* __restrict__ tokens, const int* __restrict__ counts,
    float* __restrict__ part_ml, float* __restrict__ part_o, u32 max_pages, u32 sel_cap, u32 block_size, u32 nq,
    u32 nkv, u32 hd, float scale) {
    extern __shared__ __align__(16) unsigned char qsd_attn_smem[];
    QSD_PDL_ENTRY();
    const u32 splits = (sel_cap + QSA_SPLIT - 1) / QSA_SPLIT;
    const uintptr_t any = reinterpret_cast<uintptr_t>(q) | reinterpret_cast<uintptr_t>(k_pool) |
                          reinterpret_cast<uintptr_t>(v_pool);
    if (blockDim.x != QSA_ATTN_THREADS || blockDim.y != 1 || blockDim.z != 1 || nkv == 0 || nq % nkv != 0 ||
        nq / nkv == 0 || nq / nkv > QSA_ATTN_MAX_G || gridDim.y != nkv || sel_cap == 0 || gridDim.z != splits ||
        block_size == 0 || hd == 0 || (hd & 31) || hd > QSA_ATTN_MAX_HD || (any & 15) ||
        (reinterpret_cast<uintptr_t>(part_o) & 7))
        return;
    const int cnt = counts[blockIdx.x];
    const u32 n_total = cnt <= 0 ? 0u : min((u32)cnt, sel_cap);
    if (blockIdx.z * QSA_SPLIT >= n_total) return;   // an empty split: nothing to write (the merge skips it)
    const u32 G = nq / nkv;
    const u32 have = qsa_dynamic_smem_bytes();
#define QSD_ATTN_CASE(HD)                                                                                         \
    case HD:                                                                                                      \
        if (have >= QsdAttnSmem<HD>::BYTES)                                                                       \
            qsd_sparse_attn_body<HD>(q, k_pool, v_pool, block_tables, tokens, n_total, part_ml, part_o, max_pages, \
                                     sel_cap, block_size, nq, nkv, G, splits, scale, qsd_attn_smem);              \
        break;
    switch (hd) {
        QSD_ATTN_CASE(32) QSD_ATTN_CASE(64) QSD_ATTN_CASE(96) QSD_ATTN_CASE(128)
        QSD_ATTN_CASE(160) QSD_ATTN_CASE(192) QSD_ATTN_CASE(224) QSD_ATTN_CASE(256)
        default: break;
    }
#undef QSD_ATTN_CASE
}

// ------------------------------------------------------------------------------------------------
// qsa_sparse_merge
// ------------------------------------------------------------------------------------------------
extern "C" __global__ void qsa_sparse_merge(const float* __restrict__ part_ml, const float* __restrict__ part_o,
                                            const int* __restrict__ counts, __nv_bfloat16* __restrict__ out,
                                            u32 sel_cap, u32 nq, u32 hd) {
    QSD_PDL_ENTRY();
    if (sel_cap == 0 || nq == 0 || hd == 0 || blockDim.y != 1 || blockDim.z != 1 || gridDim.y != nq ||
        gridDim.z != 1)
        return;
    const u32 r = blockIdx.x, h = blockIdx.y;
    const u32 splits = (sel_cap + QSA_SPLIT - 1) / QSA_SPLIT;
    const int cnt = counts[r];
    const u32 n = cnt <= 0 ? 0u : min((u32)cnt, sel_cap);
    const u32 ns = (n + QSA_SPLIT - 1) / QSA_SPLIT;
    const size_t row = (size_t)r * nq + h;
    const float* ml = part_ml + row * splits * 2;
    const float* po = part_o + row * splits * hd;
    const float ninf = hss_neg_inf();
    float big = ninf;
    for (u32 s = 0; s < ns; ++s) big = fmaxf(big, ml[2 * s]);
    for (u32 d = threadIdx.x; d < hd; d += blockDim.x) {
        float res = 0.f;
        if (big != ninf) {
            float l = 0.f, o = 0.f;
            for (u32 s = 0; s < ns; ++s) {
                const float w = hss_softmax_weight(ml[2 * s], big);
                l = fmaf(ml[2 * s + 1], w, l);
                o = fmaf(po[(size_t)s * hd + d], w, o);
            }
            res = l > 0.f ? o / l : 0.f;
        }
        out[row * hd + d] = __float2bfloat16_rn(res);
    }
}
