// sparse_step.cu: the device sparse swap step (docs/design.md §17.8): page selection, per-(sequence, layer) residency
// of C slots and the reads of the misses, for R sequences at once, with no host in the loop (every count is read on the
// device, so a step captures into a CUDA graph).
//
// Layout of one layer's state (the host offsets every pointer by the layer):
//   page_slot i32 [R, stride]  page i of sequence s sits in slot page_slot[s, i] (-1: not resident)
//   slot_page i32 [R, C]       the page slot c holds (-1: free)
//   slot_stamp i32 [R, C]      the step number at which slot c's page was last selected
//   step i32 [R]               each sequence's step number (shared by its layers; sparse_advance moves it)
//   stats i64 [R, 2]           hits, misses accumulated
//
// sparse_advance(step i32 [R], rows i32 [1], R): step[s] += 1 for s < min(rows[0], R).
//   Launch: grid (ceil(R / 256), 1, 1), block (256, 1, 1).
//
// sparse_counts(visible i32 [R], rows i32 [1], R, block_size, page_counts i32 [R], tail_counts i32 [R]): for a
//   decode step whose newest token sits on a still-open page: page_counts[s] = (visible[s] - 1) / block_size (the
//   complete pages before it), tail_counts[s] = visible[s] - page_counts[s] * block_size (the tokens on the newest
//   page, 1..block_size), for s < min(rows[0], R) (visible < 1: 0 and 0). Launch: sparse_advance's geometry.
//
// sparse_select(scores f32 [R, stride], counts i32 [R], table i32 [R, stride], rows i32 [1], page_slot, slot_page,
//               slot_stamp, step, attend i32 [R, sel_cap], attend_counts i32 [R], fetch i32 [R, sel_cap, 2],
//               fetch_counts i32 [R], stats, stride, slots, sel_cap, budget, keep_first, keep_recent, slot_base i64,
//               src_base i64, head_scores f32 [R, stride, num_heads], num_heads, max_blocks, exp2_scale)
//   CTA s (< rows[0]; the others write attend_counts[s] = fetch_counts[s] = 0 and stop) with n = clamp(counts[s], 0,
//   stride) pages:
//   * S: every page if n <= keep_first + keep_recent + budget (= sel_cap); else pages 0..F-1, n-Rk..n-1 and the
//     `budget` best of the others by (score descending, page ascending), NaN below every number (docs/design.md §17.1).
//   * the scores: scores[s, i] as given (num_heads 0), or (num_heads > 0: the per-head normalised scores,
//     docs/design.md §17.5, folded in here so the step needs no head-max and combine launches) computed from predictor_score_heads_
//     table's head_scores: each head's max over the row's n pages, then predictor_head_combine_rows's sum
//     (hss_headscore.cuh: the same bits), NaN for a table id outside 0..max_blocks-1, written to scores[s, i] for
//     every i < n when not every page is selected (nothing is scored then).
//   * hits: pages of S with page_slot >= 0; misses: the others, ascending. Miss j takes the j-th slot of the order:
//     free slots by slot ascending, then slots holding a page outside S by (stamp, slot) ascending; the page it held
//     is dropped (page_slot = -1). fetch[s, j] = (src_base + table[s, page], slot_base + s * slots + slot): the store
//     page to read and the global slot to read it into (a table id outside 0..max_blocks-1: source -1, read by
//     nobody: the slot keeps what it held, and no other layer's page is read); fetch_counts[s] = misses.
//   * every slot holding a page of S gets stamp = step[s]; attend[s, k] = slot_base + s * slots + slot of the k-th
//     page of S (ascending), attend_counts[s] = |S|; stats[s] += (hits, misses).
//   Needs slots >= sel_cap (the host checks); page_slot entries must name slots < slots (the state's invariant).
//   Launch: grid (R, 1, 1), block (SELECT_THREADS, 1, 1), dynamic shared memory select_shared_bytes(stride, slots).
//
// sparse_fetch(dst u8 (the slot pool, page_vecs * 16 bytes a slot), src u8 (the store's pages, mapped host memory),
//              fetch, fetch_counts, rows, sel_cap, page_vecs, src_pages, dst_pages)
//   For s < rows[0] and j < fetch_counts[s] with (p, d) = fetch[s, j]: slot d of dst = page p of src, 16-byte loads
//   (page_gather's copy); a pair outside src_pages / dst_pages (a block id the table got wrong) copies nothing. Launch:
//   grid (sel_cap, ceil(page_vecs / GATHER_CHUNK), R), block (GATHER_THREADS, 1, 1).
#include "hss_common.cuh"
#include "hss_copy.cuh"
#include "hss_headscore.cuh"

#define SELECT_THREADS 1024
#define SELECT_WARPS (SELECT_THREADS / 32)
#define SELECT_MAX_HEADS 256   // num_heads of the folded per-head scores, at most

// An order-preserving u32 key of a score: higher score, higher key; every NaN 0 (below -inf, whose key is 0x007fffff);
// -0.0 and 0.0 one key (equal scores tie, as docs/design.md §17.1 and the host mode rank them).
__device__ __forceinline__ unsigned hss_score_key(float v) {
    if (v != v) return 0u;
    if (v == 0.0f) return 0x80000000u;
    const unsigned b = __float_as_uint(v);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// Exclusive prefix sum of one int per thread over the CTA (SELECT_THREADS threads); *total gets the sum. Uses
// red[SELECT_WARPS + 1]; every thread must call it.
__device__ __forceinline__ int hss_block_scan(int v, int* red, int* total) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int x = v;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
        const int y = __shfl_up_sync(HSS_FULL_MASK, x, d);
        if (lane >= d) x += y;
    }
    if (lane == 31) red[warp] = x;
    __syncthreads();
    if (warp == 0) {
        int w = lane < SELECT_WARPS ? red[lane] : 0;
#pragma unroll
        for (int d = 1; d < 32; d <<= 1) {
            const int y = __shfl_up_sync(HSS_FULL_MASK, w, d);
            if (lane >= d) w += y;
        }
        if (lane < SELECT_WARPS) red[lane] = w;   // inclusive per warp
        if (lane == SELECT_WARPS - 1) red[SELECT_WARPS] = w;
    }
    __syncthreads();
    const int before = (warp ? red[warp - 1] : 0) + x - v;
    *total = red[SELECT_WARPS];
    __syncthreads();   // red is reused by the next call
    return before;
}

extern "C" __global__ void __launch_bounds__(256) sparse_advance(int* __restrict__ step, const int* __restrict__ rows,
                                                                int R) {
    const int s = blockIdx.x * blockDim.x + threadIdx.x;
    if (s < min(rows[0], R)) step[s] += 1;
}

extern "C" __global__ void __launch_bounds__(256) sparse_counts(const int* __restrict__ visible,
                                                               const int* __restrict__ rows, int R, int block_size,
                                                               int* __restrict__ page_counts,
                                                               int* __restrict__ tail_counts) {
    const int s = blockIdx.x * blockDim.x + threadIdx.x;
    if (s >= min(rows[0], R)) return;
    const int v = visible[s];
    const int full = v >= 1 ? (v - 1) / block_size : 0;
    page_counts[s] = full;
    tail_counts[s] = v >= 1 ? v - full * block_size : 0;
}

extern "C" __global__ void __launch_bounds__(SELECT_THREADS)
sparse_select(float* __restrict__ scores, const int* __restrict__ counts, const int* __restrict__ table,
              const int* __restrict__ rows, int* __restrict__ page_slot, int* __restrict__ slot_page,
              int* __restrict__ slot_stamp, const int* __restrict__ step, int* __restrict__ attend,
              int* __restrict__ attend_counts, int2* __restrict__ fetch, int* __restrict__ fetch_counts,
              long long* __restrict__ stats, int stride, int slots, int sel_cap, int budget, int keep_first,
              int keep_recent, long long slot_base, long long src_base, const float* __restrict__ head_scores,
              int num_heads, int max_blocks, float exp2_scale) {
    extern __shared__ __align__(16) unsigned char smem[];
    // [keys u32 | order u64 (pow2 >= slots) | misses i32 (sel_cap) | chosen u8 (stride) | in_s u8 (slots)]
    int cap = 1;
    while (cap < slots) cap <<= 1;
    unsigned* keys = reinterpret_cast<unsigned*>(smem);
    unsigned long long* order = reinterpret_cast<unsigned long long*>(smem + 4 * ((stride + 1) & ~1));
    int* misses = reinterpret_cast<int*>(order + cap);
    unsigned char* chosen = reinterpret_cast<unsigned char*>(misses + sel_cap);
    unsigned char* in_s = chosen + stride;
    __shared__ int red[SELECT_WARPS + 1];
    __shared__ unsigned hist[256];
    __shared__ unsigned prefix_s, want_s;
    __shared__ unsigned head_key[SELECT_MAX_HEADS];
    __shared__ float head_max[SELECT_MAX_HEADS];

    const int s = blockIdx.x, tid = threadIdx.x;
    if (s >= rows[0]) {   // a padded row: nothing to attend or read
        if (tid == 0) attend_counts[s] = fetch_counts[s] = 0;
        return;
    }
    const int n = min(max(counts[s], 0), stride);
    float* sc = scores + (size_t)s * stride;   // (read, or with num_heads > 0 written first)
    int* ps = page_slot + (size_t)s * stride;
    int* sp = slot_page + (size_t)s * slots;
    int* st = slot_stamp + (size_t)s * slots;
    const int* tb = table + (size_t)s * stride;
    const long long base = slot_base + (long long)s * slots;

    // 1. the selection S (chosen[i] = 1)
    const bool all = n <= keep_first + keep_recent + budget;
    const int lo = keep_first, hi = n - keep_recent;   // the scored pages, when not all
    const int heads = min(max(num_heads, 0), SELECT_MAX_HEADS);
    if (!all && heads > 0) {   // each head's max over the n pages (NaN skipped; none: -inf), as an ordered key
        const float* hs = head_scores + (size_t)s * stride * heads;
        for (int h = tid; h < heads; h += SELECT_THREADS) head_key[h] = hss_score_key(hss_neg_inf());
        __syncthreads();
        for (long long j = tid; j < (long long)n * heads; j += SELECT_THREADS) {
            const float v = hs[j];
            if (v == v) atomicMax(&head_key[(int)(j % heads)], hss_score_key(v));
        }
        __syncthreads();
        for (int h = tid; h < heads; h += SELECT_THREADS) {
            const unsigned k = head_key[h];   // back to the float (+-0 and subnormals: the combine flushes them)
            head_max[h] = __uint_as_float(k & 0x80000000u ? k & 0x7fffffffu : ~k);
        }
        __syncthreads();
        for (int i = tid; i < n; i += SELECT_THREADS) {
            const int b = table[(size_t)s * stride + i];
            sc[i] = (b < 0 || b >= max_blocks) ? __int_as_float(0x7fffffff)
                                                : hss_head_combine(hs + (size_t)i * heads, head_max, heads,
                                                                   exp2_scale);
        }
        __syncthreads();
    }
    for (int i = tid; i < n; i += SELECT_THREADS) {
        chosen[i] = all || i < lo || i >= hi;
        if (!all && i >= lo && i < hi) keys[i] = hss_score_key(sc[i]);
    }
    for (int c = tid; c < slots; c += SELECT_THREADS) in_s[c] = 0;
    __syncthreads();
    if (!all && budget > 0) {
        // the budget-th largest key T (radix select, 8 bits a pass); then every key > T and the earliest keys == T
        if (tid == 0) { prefix_s = 0u; want_s = (unsigned)budget; }
        unsigned mask = 0u;
        for (int shift = 24; shift >= 0; shift -= 8) {
            for (int b = tid; b < 256; b += SELECT_THREADS) hist[b] = 0u;
            __syncthreads();
            const unsigned prefix = prefix_s;
            for (int i = lo + tid; i < hi; i += SELECT_THREADS) {
                const unsigned k = keys[i];
                if ((k & mask) == prefix) atomicAdd(&hist[(k >> shift) & 255u], 1u);
            }
            __syncthreads();
            if (tid < 32) {   // warp 0 finds the bin holding the want-th largest key: lane l owns bins 255 - 8l ..
                const unsigned want = want_s;   //   248 - 8l, so lanes ascend as the bins descend
                unsigned own = 0u;
#pragma unroll
                for (int j = 0; j < 8; ++j) own += hist[255 - 8 * tid - j];
                unsigned incl = own;
#pragma unroll
                for (int d = 1; d < 32; d <<= 1) {
                    const unsigned y = __shfl_up_sync(HSS_FULL_MASK, incl, d);
                    if (tid >= d) incl += y;
                }
                const unsigned hit = __ballot_sync(HSS_FULL_MASK, incl >= want);
                const int lane = hit ? __ffs(hit) - 1 : 31;   // (always hit: fewer wanted than scored keys)
                if (tid == lane) {
                    unsigned before = incl - own, b = 255u - 8u * (unsigned)lane;
                    for (int j = 0; j < 7 && before + hist[b] < want; ++j, --b) before += hist[b];
                    prefix_s = prefix | (b << shift);
                    want_s = want - before;   // how many keys equal to the prefix so far are still to take
                }
            }
            mask |= 255u << shift;
            __syncthreads();
        }
        const unsigned t = prefix_s;
        const int ties = (int)want_s;
        // keys == t taken in page order: a running count over chunks of SELECT_THREADS pages
        int taken = 0;
        for (int c0 = lo; c0 < hi; c0 += SELECT_THREADS) {
            const int i = c0 + tid;
            const unsigned k = i < hi ? keys[i] : 0u;
            const int eq = i < hi && k == t;
            int total;
            const int rank = taken + hss_block_scan(eq, red, &total);
            if (i < hi) chosen[i] = k > t || (eq && rank < ties);
            taken += total;
        }
        __syncthreads();
    }

    // 2. hits mark their slots; misses are listed in page order
    int n_miss = 0;
    for (int c0 = 0; c0 < n; c0 += SELECT_THREADS) {
        const int i = c0 + tid;
        int miss = 0;
        if (i < n && chosen[i]) {
            const int slot = ps[i];
            if (slot >= 0) in_s[slot] = 1;
            else miss = 1;
        }
        int total;
        const int rank = n_miss + hss_block_scan(miss, red, &total);
        if (miss && rank < sel_cap) misses[rank] = i;
        n_miss += total;
    }
    __syncthreads();

    // 3. the slots' order for the misses: free (slot), then holding a page outside S (stamp, slot); S's slots last
    // (n_miss is the CTA's: a step with no miss skips 3 and 4)
    const int m = min(n_miss, sel_cap);
    if (m > 0) {
    for (int c = tid; c < cap; c += SELECT_THREADS) {
        unsigned long long key = ~0ull;
        if (c < slots && !in_s[c]) {
            key = sp[c] < 0 ? (unsigned long long)c
                            : (1ull << 62) | ((unsigned long long)(unsigned)st[c] << 24) | (unsigned long long)c;
        }
        order[c] = key;
    }
    __syncthreads();
    for (int k = 2; k <= cap; k <<= 1) {   // bitonic sort, ascending
        for (int j = k >> 1; j > 0; j >>= 1) {
            for (int i = tid; i < cap; i += SELECT_THREADS) {
                const int p = i ^ j;
                if (p > i) {
                    const unsigned long long a = order[i], b = order[p];
                    if (((i & k) == 0) == (a > b)) { order[i] = b; order[p] = a; }
                }
            }
            __syncthreads();
        }
    }

    // 4. miss j into the j-th slot of the order: the page it held dropped, the miss's read listed
    for (int j = tid; j < m; j += SELECT_THREADS) {
        const int slot = (int)(order[j] & 0xffffffull);
        const int old = sp[slot];
        if (old >= 0 && old < stride) ps[old] = -1;   // a page outside S: no miss of this step is it
    }
    __syncthreads();
    for (int j = tid; j < m; j += SELECT_THREADS) {
        const int slot = (int)(order[j] & 0xffffffull);
        const int page = misses[j];
        ps[page] = slot;
        sp[slot] = page;
        in_s[slot] = 1;
        const int id = tb[page];
        fetch[(size_t)s * sel_cap + j] = make_int2(0 <= id && id < max_blocks ? (int)(src_base + id) : -1,
                                                   (int)(base + slot));
    }
    __syncthreads();
    }

    // 5. stamps, the attend list in page order, the counts
    const int now = step[s];
    for (int c = tid; c < slots; c += SELECT_THREADS)
        if (in_s[c]) st[c] = now;
    int n_sel = 0;
    for (int c0 = 0; c0 < n; c0 += SELECT_THREADS) {
        const int i = c0 + tid;
        const int sel = i < n && chosen[i];
        int total;
        const int rank = n_sel + hss_block_scan(sel, red, &total);
        if (sel && rank < sel_cap) attend[(size_t)s * sel_cap + rank] = (int)(base + ps[i]);
        n_sel += total;
    }
    if (tid == 0) {
        attend_counts[s] = min(n_sel, sel_cap);
        fetch_counts[s] = m;
        stats[2 * (size_t)s] += n_sel - m;
        stats[2 * (size_t)s + 1] += m;
    }
}

extern "C" __global__ void __launch_bounds__(GATHER_THREADS)
sparse_fetch(uint4* __restrict__ dst, const uint4* __restrict__ src, const int2* __restrict__ fetch,
             const int* __restrict__ fetch_counts, const int* __restrict__ rows, int sel_cap, int page_vecs,
             int src_pages, long long dst_pages) {
    const int s = blockIdx.z, j = blockIdx.x;
    if (s >= rows[0] || j >= fetch_counts[s]) return;   // CTA-uniform: the grid is sized for the worst case
    const int2 pair = fetch[(size_t)s * sel_cap + j];
    if (pair.x < 0 || pair.x >= src_pages || pair.y < 0 || pair.y >= dst_pages) return;   // a bad table entry
    hss_copy_page_chunk(dst + (long long)pair.y * page_vecs, src + (long long)pair.x * page_vecs, page_vecs);
}
