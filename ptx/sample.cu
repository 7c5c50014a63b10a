// sample.cu: the next token of each batch row on the device (hss.model.sample's Sampler): repetition and presence
// penalties over the row's history, temperature, top-k, top-p, min-p and a counter-based draw, or the greedy token.
// Row-major; bf16 logits; f32 arithmetic, integer masses; no fast math. Nothing is read from the host, so a
// captured CUDA graph replays it and draws anew each step (the step counter lives on the device).
//
// sample_tokens(logits bf16 [m, vocab], h bf16 [m, dim] or null, weight bf16 [vocab, dim], params u32 [m,
//               SAMPLE_PARAM_WORDS], history i32 [m, history_cap], state i32, rows i32 [1] or null, vocab, dim,
//               history_cap, m, state_stride, advance, stage)
//   One CTA per row r < m (rows r >= rows[0] skipped when `rows` is not null: nothing read or written).
//   params row r (words): 0 temperature f32, 1 top_k i32 (0..SAMPLE_CANDIDATES), 2 top_p f32 (0, 1], 3 min_p f32
//   [0, 1], 4 repetition_penalty f32 > 0, 5 presence_penalty f32, 6/7 seed u64 (low word first), 8 step u32,
//   9 count u32 (tokens appended to the history), 10 flags u32 (sticky, SAMPLE_FLAG_*), 11..15 unused. The host
//   writes words 0..10; the kernel adds 1 to step and count and ORs flags.
//   History: the row's ring of its last history_cap tokens, entry j = the token appended when count was j (mod
//   history_cap); entries j < min(count, history_cap) are the history (ids outside [0, vocab) ignored). A
//   history_cap of 0 keeps none.
//   1. z_i = logits[r, i] in f32; NaN -> -inf (flag NAN). Tokens in the history: z = (z > 0 ? z / rp : z * rp) - pp
//      (f32, rp = repetition_penalty, pp = presence_penalty; the llama.cpp / HF rule).  M = max z.
//   2. M = -inf: token 0 (flag EMPTY). temperature 0, or M = +inf (flag INF): model_argmax's rule over z (its near
//      ties, z_i >= M - 2 ulp_bf16(M), recomputed as the penalised f32 dot of h[r] and weight[i], the same fma
//      chain; the lowest index on equal values; one candidate, more than SAMPLE_CANDIDATES, or h null: the first
//      index of M): with neutral penalties (rp = 1, pp = 0) exactly model_argmax's token.
//   3. Otherwise the order is descending z, ascending id. The candidates are its first k = top_k (top_k = 0:
//      SAMPLE_CANDIDATES, and every other token is the tail) tokens, found by a radix select on the order-
//      preserving u32 key of z (11, 11 and 10 bits a round, counts only; with top_k > 0 the first round alone where
//      the k-th key's bin and the bins above it hold at most SAMPLE_CANDIDATES keys: those are sorted and the
//      first k kept) and ranked by a bitonic sort; e_i =
//      expf((z_i - M) / T) (f32), mass w_i = floor(e_i 2^SAMPLE_MASS_BITS) (u64; the top token's is 2^40, a token
//      under 2^-40 of it has none). top_p < 1: the shortest candidate prefix whose mass reaches ceil(W top_p) (f64,
//      W = every candidate's and the tail's mass); if none does, every candidate and the tail stay. min_p: the
//      prefix ends before the first candidate with e < min_p; tail tokens with e < min_p are dropped, and the tail
//      stays only when no candidate prefix reaches top_p's target and min_p cut no candidate. At least one candidate
//      stays.
//   4. x = word 0 of Philox4x32-10(counter (step, 0, 0, 0), key seed); t = floor(W_kept x / 2^32); the token is the
//      first kept one, candidates in their order then the tail in ascending id, whose cumulative mass exceeds t.
//      The draw depends on the seed, step, logits and history only: not on the row's place in the batch.
//   5. state[r] = token; advance >= 0 (model state words at w * state_stride + r, as model_argmax):
//      state[state_stride + r] += advance, state[2 state_stride + r] = that + 1. history[r, count % cap] = token
//      (cap > 0); step += 1, count += 1.
//   Every mass and prefix is an integer, so a row's token is the same on every run and in every batch.
//
//   stage != 0: the first pass keeps every penalised key in shared memory and the later passes read them there
//   (same results; the logits and the history are read once).
//
// Launch (hss.decls.sample's sample_geometry): grid (m), block (SAMPLE_THREADS), dynamic shared memory 4
// ceil(vocab / 32) bytes (the history bitmap), and with stage 4 SAMPLE_THREADS (8 cpt + 1) more (the keys: thread
// t's j-th token at t (8 cpt + 1) + j, cpt = ceil(ceil(vocab / 8) / SAMPLE_THREADS); an odd stride, so a warp's
// lanes read 32 banks); vocab <= SAMPLE_MAX_VOCAB.
#include "hss_common.cuh"
#include "hss_dot.cuh"

#define SAMPLE_THREADS 1024        // block of sample_tokens
#define SAMPLE_CANDIDATES 1024     // the most candidates (top_k's cap); also model_argmax's near-tie cap
#define SAMPLE_MASS_BITS 40        // masses are fixed point: the most likely token's mass is 2^40
#define SAMPLE_PARAM_WORDS 16      // u32 words of a row's parameters and counters
#define SAMPLE_MAX_VOCAB 262144    // the bitmap (32 KiB) and the 8 KiB candidate array stay under 48 KiB
#define SAMPLE_RADIX_BINS 2048     // the widest radix round (11 bits)
#define SAMPLE_FLAG_NAN 1u         // a NaN logit (it counted as -inf)
#define SAMPLE_FLAG_INF 2u         // a +inf logit after penalties: the greedy token
#define SAMPLE_FLAG_EMPTY 4u       // no logit above -inf: token 0

namespace {

struct RowParams {
    float temperature, top_p, min_p, rp, pp;
    int top_k;
    uint32_t seed_lo, seed_hi, step, count;
    bool pen;
};

// ---- Philox4x32-10 ----------------------------------------------------------------------------------------------
__device__ __forceinline__ uint4 philox4x32_10(uint4 c, uint32_t k0, uint32_t k1) {
#pragma unroll
    for (int r = 0; r < 10; ++r) {
        if (r) { k0 += 0x9E3779B9u; k1 += 0xBB67AE85u; }
        const uint32_t lo0 = 0xD2511F53u * c.x, hi0 = __umulhi(0xD2511F53u, c.x);
        const uint32_t lo1 = 0xCD9E8D57u * c.z, hi1 = __umulhi(0xCD9E8D57u, c.z);
        c = make_uint4(hi1 ^ c.y ^ k0, lo1, hi0 ^ c.w ^ k1, lo0);
    }
    return c;
}

// ---- keys and masses --------------------------------------------------------------------------------------------
// An order-preserving u32 of z (z + 0 first, so -0 and +0 are one key); NaN never reaches it.
__device__ __forceinline__ uint32_t key_of(float z) {
    const uint32_t u = __float_as_uint(z + 0.f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__device__ __forceinline__ float z_of(uint32_t k) {
    return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

__device__ __forceinline__ float rel_of(float z, float top, float temperature) {
    return expf((z - top) / temperature);
}

__device__ __forceinline__ unsigned long long mass_of(float e) {
    return __float2ull_rz(e * (float)(1ull << SAMPLE_MASS_BITS));
}

__device__ __forceinline__ float penalize(float x, bool present, const RowParams& p) {
    if (!present) return x;
    return (x > 0.f ? x / p.rp : x * p.rp) - p.pp;
}

// ---- the row's tokens: thread t owns the chunks [t cpt, (t + 1) cpt) of 8 ids (contiguous: id order is thread
// order, then position) -----------------------------------------------------------------------------------------
struct RowTokens {
    const __nv_bfloat16* logits;
    const uint32_t* bitmap;
    uint32_t* keys;   // staged keys of this thread (stride 1: its j-th token at keys[j]), or null
    int vocab, cpt, c0;
    bool vec;
};

// The 8 raw logits of chunk c as f32 (past vocab: NaN, never used).
__device__ __forceinline__ void load_chunk(const RowTokens& t, int c, float (&x)[8]) {
    const int e0 = 8 * c;
    if (t.vec && e0 + 8 <= t.vocab) {
        const uint4 u = reinterpret_cast<const uint4*>(t.logits)[c];
        const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
        for (int j = 0; j < 4; ++j) { x[2 * j] = hss_bf16_lo(w[j]); x[2 * j + 1] = hss_bf16_hi(w[j]); }
        return;
    }
#pragma unroll
    for (int e = 0; e < 8; ++e) x[e] = e0 + e < t.vocab ? hss_bf16_to_f32(t.logits[e0 + e]) : __int_as_float(0x7fc00000);
}

__device__ __forceinline__ bool in_history(const RowTokens& t, const RowParams& p, int i) {
    return p.pen && ((t.bitmap[i >> 5] >> (i & 31)) & 1u);
}

// f(k, i, z) for every token i of this thread in id order (k: the chunk's number in the thread's range); every
// thread runs the same cpt chunk iterations (tokens past vocab are skipped), so f may use whole-warp calls only
// through `chunk_end(k)`, which every lane reaches once per chunk.
template <class F, class G>
__device__ __forceinline__ void for_tokens(const RowTokens& t, const RowParams& p, F&& f, G&& chunk_end) {
    if (t.keys != nullptr) {   // CTA-uniform: the staged keys (no NaN left)
        for (int k = 0; k < t.cpt; ++k) {
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                const int i = 8 * (t.c0 + k) + e;
                if (i < t.vocab) f(k, i, z_of(t.keys[8 * k + e]), false);
            }
            chunk_end(k);
        }
        return;
    }
    for (int k = 0; k < t.cpt; ++k) {
        const int c = t.c0 + k;
        float x[8];
        load_chunk(t, c, x);
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            const int i = 8 * c + e;
            if (i < t.vocab) {
                const float v = isnan(x[e]) ? hss_neg_inf() : x[e];
                f(k, i, penalize(v, in_history(t, p, i), p), isnan(x[e]));
            }
        }
        chunk_end(k);
    }
}

// One radix round's counts: hist[(key >> sh) & mask] += 1 for each token whose key >> up == prefix (every token
// when first), one shared atomic per counted token (on an H100 faster than aggregating a warp's equal bins first,
// equal logits included).
__device__ void count_round(const RowTokens& t, const RowParams& p, bool first, int up, uint32_t prefix, int sh,
                            uint32_t mask, uint32_t* hist) {
    if (t.keys != nullptr) {   // CTA-uniform
        for (int k = 0; k < t.cpt; ++k) {
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                if (8 * (t.c0 + k) + e >= t.vocab) continue;   // (never written)
                const uint32_t key = t.keys[8 * k + e];
                if (first || (key >> up) == prefix) atomicAdd(&hist[(key >> sh) & mask], 1u);
            }
        }
        return;
    }
    for (int k = 0; k < t.cpt; ++k) {
        const int c = t.c0 + k;
        float x[8];
        load_chunk(t, c, x);
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            const int i = 8 * c + e;
            if (i < t.vocab) {
                const float v = isnan(x[e]) ? hss_neg_inf() : x[e];
                const uint32_t key = key_of(penalize(v, in_history(t, p, i), p));
                if (first || (key >> up) == prefix) atomicAdd(&hist[(key >> sh) & mask], 1u);
            }
        }
    }
}

// ---- block scans and reductions (scratch: 32 entries, free again on return) -----------------------------------
template <class T>
__device__ __forceinline__ T block_scan_excl(T v, T* scratch, T& total) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    T incl = v;
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
        const T o = __shfl_up_sync(HSS_FULL_MASK, incl, off);
        if (lane >= off) incl += o;
    }
    if (lane == 31) scratch[warp] = incl;
    __syncthreads();
    T base = 0, all = 0;
    for (int w = 0; w < nwarps; ++w) {
        const T s = scratch[w];
        if (w < warp) base += s;
        all += s;
    }
    __syncthreads();
    total = all;
    return base + incl - v;
}

// This lane's first slot of n in a shared array counted by *counter (a warp prefix, one atomicAdd per warp).
__device__ __forceinline__ int claim_slots(int n, int* counter) {
    const int lane = threadIdx.x & 31;
    int incl = n;
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
        const int o = __shfl_up_sync(HSS_FULL_MASK, incl, off);
        if (lane >= off) incl += o;
    }
    const int total = __shfl_sync(HSS_FULL_MASK, incl, 31);
    int base = 0;
    if (lane == 31 && total) base = atomicAdd(counter, total);
    return __shfl_sync(HSS_FULL_MASK, base, 31) + incl - n;
}

__device__ __forceinline__ float block_max(float v, float* red) {
    v = hss_warp_max(v);
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
    __syncthreads();
    float m = hss_neg_inf();
    for (int w = 0; w < (int)(blockDim.x >> 5); ++w) m = fmaxf(m, red[w]);
    __syncthreads();
    return m;
}

// (value, index) of the larger value, the lower index on equal ones, over the CTA; sv / si: 32 entries each.
__device__ __forceinline__ void block_argmax(float& best, int& idx, float* sv, int* si) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
        const float ov = __shfl_xor_sync(HSS_FULL_MASK, best, off);
        const int oi = __shfl_xor_sync(HSS_FULL_MASK, idx, off);
        if (ov > best || (ov == best && oi < idx)) { best = ov; idx = oi; }
    }
    if ((threadIdx.x & 31) == 0) { sv[threadIdx.x >> 5] = best; si[threadIdx.x >> 5] = idx; }
    __syncthreads();
    for (int w = 0; w < (int)(blockDim.x >> 5); ++w)
        if (sv[w] > best || (sv[w] == best && si[w] < idx)) { best = sv[w]; idx = si[w]; }
    __syncthreads();
}

struct Shared {
    union {
        uint32_t hist[SAMPLE_RADIX_BINS];
        unsigned long long cand[SAMPLE_CANDIDATES];
        int near[SAMPLE_CANDIDATES];
    } u;
    unsigned long long scan64[32];
    int scan32[32];
    float red[32];
    int ri[32];
    int n_cand, first_top, lp, lm, pick;
    uint32_t bin, above;
    unsigned long long c_keep, wt_all, wt_minp;
};

// ---- greedy: model_argmax's rule over the penalised logits ---------------------------------------------------
__device__ int greedy_token(const RowTokens& t, const RowParams& p, float top, const __nv_bfloat16* h,
                            const __nv_bfloat16* weight, int dim, Shared& s) {
    if (threadIdx.x == 0) { s.n_cand = 0; s.first_top = 0x7fffffff; }
    __syncthreads();
    const int e = (int)((__float_as_uint(top) >> 23) & 0xffu) - 127;
    const float floor_v = top - 2.0f * ldexpf(1.0f, max(e - 7, -126));
    int first = 0x7fffffff, n = 0;
    for_tokens(t, p, [&](int, int i, float z, bool) {
        if (z >= floor_v) {
            ++n;
            if (z == top) first = min(first, i);
        }
    }, [](int) {});
    int at = claim_slots(n, &s.n_cand);
    if (n) {
        for_tokens(t, p, [&](int, int i, float z, bool) {
            if (z >= floor_v) {
                if (at < SAMPLE_CANDIDATES) s.u.near[at] = i;
                ++at;
            }
        }, [](int) {});
        atomicMin(&s.first_top, first);
    }
    __syncthreads();
    const int count = s.n_cand;
    int token = s.first_top;
    if (h != nullptr && count >= 2 && count <= SAMPLE_CANDIDATES) {   // CTA-uniform
        const int warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
        float rb = hss_neg_inf();
        int ri = 0x7fffffff;
        for (int c = warp; c < count; c += nwarps) {
            const int i = s.u.near[c];
            const float a = penalize(hss_refine_logit<16>(h, weight + (size_t)i * dim, dim), in_history(t, p, i), p);
            if (a > rb || (a == rb && i < ri)) { rb = a; ri = i; }
        }
        block_argmax(rb, ri, s.red, s.ri);
        if (ri < t.vocab) token = ri;
    }
    return token;
}

// ---- sampling ----------------------------------------------------------------------------------------------
// Radix select of the k-th key in the order: after it, the candidates are key > thr, plus (ties >= 0) the `ties`
// lowest ids with key == thr, or (ties < 0) every key >= thr. With `few`, when the first round's bin of the k-th
// key and the bins above it hold at most SAMPLE_CANDIDATES keys, the select stops there (ties -1, thr the bin's
// lowest key): every key >= thr is a candidate, and the first k of them in the order are the top k.
__device__ void select_kth(const RowTokens& t, const RowParams& p, int k, bool few, Shared& s, uint32_t& thr,
                           int& ties) {
    const int shifts[3] = {21, 10, 0}, widths[3] = {11, 11, 10};
    uint32_t prefix = 0;
    int want = k;
#pragma unroll
    for (int r = 0; r < 3; ++r) {
        const int sh = shifts[r], bins = 1 << widths[r];
        for (int b = threadIdx.x; b < bins; b += blockDim.x) s.u.hist[b] = 0;
        __syncthreads();
        count_round(t, p, r == 0, r ? shifts[r - 1] : 0, prefix, sh, (uint32_t)(bins - 1), s.u.hist);
        __syncthreads();
        // descending bins: thread j holds positions 2j and 2j + 1 (bins bins-1-2j and bins-2-2j)
        const int b0 = bins - 1 - 2 * (int)threadIdx.x, b1 = b0 - 1;
        const uint32_t c0 = b0 >= 0 ? s.u.hist[b0] : 0u, c1 = b1 >= 0 ? s.u.hist[b1] : 0u;
        uint32_t total;
        const uint32_t above = block_scan_excl<uint32_t>(c0 + c1, reinterpret_cast<uint32_t*>(s.scan32), total);
        const uint32_t w = (uint32_t)want;
        if (c0 && above < w && w <= above + c0) { s.bin = (uint32_t)b0; s.above = above; }
        else if (c1 && above + c0 < w && w <= above + c0 + c1) { s.bin = (uint32_t)b1; s.above = above + c0; }
        __syncthreads();
        const uint32_t bin = s.bin, cnt = s.u.hist[bin];
        const bool stop = few && r == 0 && s.above + cnt <= SAMPLE_CANDIDATES;   // CTA-uniform
        want -= (int)s.above;
        prefix = (prefix << widths[r]) | bin;
        __syncthreads();   // hist is rewritten by the next round
        if (stop) {
            thr = prefix << sh;
            ties = -1;
            return;
        }
        if ((uint32_t)want == cnt || r == 2) {
            thr = prefix << sh;
            ties = (uint32_t)want == cnt ? -1 : want;
            return;
        }
    }
}

__device__ __forceinline__ void bitonic_sort(unsigned long long* a, int n) {
    for (int size = 2; size <= n; size <<= 1)
        for (int stride = size >> 1; stride > 0; stride >>= 1) {
            const int i = threadIdx.x;
            const int j = i ^ stride;
            if (i < n && j > i) {
                const unsigned long long x = a[i], y = a[j];
                const bool up = (i & size) == 0;
                if ((x > y) == up) { a[i] = y; a[j] = x; }
            }
            __syncthreads();
        }
}

__device__ int sample_token(const RowTokens& t, const RowParams& p, float top, Shared& s) {
    const bool tail = p.top_k == 0;
    const int k = min(tail ? SAMPLE_CANDIDATES : p.top_k, t.vocab);
    uint32_t thr = 0;
    int ties = -1;
    if (k < t.vocab) select_kth(t, p, k, !tail, s, thr, ties);
    // ranks of the ties (id order), then the candidates into cand and the tail's masses
    int rank = 0;
    if (ties >= 0) {
        int mine = 0;
        for_tokens(t, p, [&](int, int, float z, bool) { mine += key_of(z) == thr; }, [](int) {});
        int total;
        rank = block_scan_excl<int>(mine, s.scan32, total);
    }
    if (threadIdx.x == 0) s.n_cand = 0;
    __syncthreads();
    unsigned long long wt_all = 0, wt_minp = 0;
    const int tie_rank0 = rank;
    int kept_n = 0;
    unsigned long long pend[8];
    for_tokens(t, p, [&](int, int i, float z, bool) {
        const uint32_t key = key_of(z);
        const bool keep = key > thr || (key == thr && (ties < 0 || rank++ < ties));
        if (keep) {
            pend[kept_n++] = (unsigned long long)(~key) << 32 | (uint32_t)i;
        } else if (tail) {
            const float e = rel_of(z, top, p.temperature);
            const unsigned long long w = mass_of(e);
            wt_all += w;
            if (e >= p.min_p) wt_minp += w;
        }
    }, [&](int) {
        const int at = claim_slots(kept_n, &s.n_cand);
        for (int j = 0; j < kept_n; ++j) s.u.cand[at + j] = pend[j];
        kept_n = 0;
    });
    unsigned long long tot_all, tot_minp;
    block_scan_excl<unsigned long long>(wt_all, s.scan64, tot_all);
    block_scan_excl<unsigned long long>(wt_minp, s.scan64, tot_minp);
    const int n_all = s.n_cand;   // k, or (select_kth's `few`) every key >= thr, of which the first k are kept
    int np2 = 1;
    while (np2 < n_all) np2 <<= 1;
    for (int j = n_all + threadIdx.x; j < np2; j += blockDim.x) s.u.cand[j] = ~0ull;
    __syncthreads();
    bitonic_sort(s.u.cand, np2);
    const int n = min(n_all, k);
    // masses in the order, their prefix, the top-p and min-p cuts
    const int j = threadIdx.x;
    float e = 0.f;
    int id = 0;
    unsigned long long w = 0;
    if (j < n) {
        const unsigned long long c = s.u.cand[j];
        id = (int)(uint32_t)c;
        e = rel_of(z_of(~(uint32_t)(c >> 32)), top, p.temperature);
        w = mass_of(e);
    }
    if (threadIdx.x == 0) { s.lp = n; s.lm = n; }
    unsigned long long c_all;
    const unsigned long long excl = block_scan_excl<unsigned long long>(w, s.scan64, c_all);
    const unsigned long long incl = excl + w;
    bool tail_p = true;
    if (p.top_p < 1.f) {
        const unsigned long long target = (unsigned long long)ceil(__ull2double_rn(c_all + tot_all) * (double)p.top_p);
        if (j < n && incl >= target && excl < target) atomicMin(&s.lp, j + 1);   // the first to reach it
        tail_p = c_all < target;   // CTA-uniform: no candidate prefix reaches the target
    }
    if (j < n && e < p.min_p) atomicMin(&s.lm, j);
    __syncthreads();
    const int lm = s.lm;
    const int keep = max(1, min(min(n, s.lp), lm));
    if (j == keep - 1) s.c_keep = incl;
    if (threadIdx.x == 0) s.pick = -1;
    __syncthreads();
    const unsigned long long c_keep = s.c_keep;
    const bool keep_tail = tail && keep == n && tail_p && lm == n;
    const unsigned long long w_kept = c_keep + (keep_tail ? tot_minp : 0ull);
    const uint4 r = philox4x32_10(make_uint4(p.step, 0u, 0u, 0u), p.seed_lo, p.seed_hi);
    const unsigned long long target = __umul64hi(w_kept, (unsigned long long)r.x << 32);
    if (target < c_keep) {   // CTA-uniform
        if (j < keep && excl <= target && target < incl) s.pick = id;
        __syncthreads();
        return s.pick;
    }
    const int first_id = (int)(uint32_t)s.u.cand[0];   // (only if the tail's masses failed to add up)
    // the tail, ascending id: this thread's kept tail mass, the scan, then the owner walks its range
    const unsigned long long t2 = target - c_keep;
    unsigned long long mine = 0;
    rank = tie_rank0;
    auto is_tail = [&](float z) {
        const uint32_t key = key_of(z);
        return !(key > thr || (key == thr && (ties < 0 || rank++ < ties)));
    };
    for_tokens(t, p, [&](int, int, float z, bool) {
        if (is_tail(z)) {
            const float e2 = rel_of(z, top, p.temperature);
            if (e2 >= p.min_p) mine += mass_of(e2);
        }
    }, [](int) {});
    unsigned long long all;
    unsigned long long base = block_scan_excl<unsigned long long>(mine, s.scan64, all);
    if (base <= t2 && t2 < base + mine) {
        rank = tie_rank0;
        for_tokens(t, p, [&](int, int i, float z, bool) {
            if (is_tail(z)) {
                const float e2 = rel_of(z, top, p.temperature);
                if (e2 >= p.min_p) {
                    base += mass_of(e2);
                    if (t2 < base && s.pick < 0) s.pick = i;
                }
            }
        }, [](int) {});
    }
    __syncthreads();
    return s.pick >= 0 ? s.pick : first_id;
}

}  // namespace

extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS)
sample_tokens(const __nv_bfloat16* __restrict__ logits, const __nv_bfloat16* __restrict__ h,
              const __nv_bfloat16* __restrict__ weight, uint32_t* __restrict__ params, int* __restrict__ history,
              int* __restrict__ state, const int* __restrict__ rows, int vocab, int dim, int history_cap, int m,
              int state_stride, int advance, int stage) {
    extern __shared__ uint32_t bitmap[];
    __shared__ Shared s;
    const int row = blockIdx.x;
    if (row >= m || (rows != nullptr && row >= rows[0]) || vocab < 1 || vocab > SAMPLE_MAX_VOCAB) return;
    uint32_t* pw = params + (size_t)row * SAMPLE_PARAM_WORDS;
    RowParams p;
    p.temperature = __uint_as_float(pw[0]);
    p.top_k = (int)pw[1];
    p.top_p = __uint_as_float(pw[2]);
    p.min_p = __uint_as_float(pw[3]);
    p.rp = __uint_as_float(pw[4]);
    p.pp = __uint_as_float(pw[5]);
    p.seed_lo = pw[6];
    p.seed_hi = pw[7];
    p.step = pw[8];
    p.count = pw[9];
    p.pen = p.rp != 1.f || p.pp != 0.f;
    p.top_k = min(max(p.top_k, 0), SAMPLE_CANDIDATES);
    const int* hist = history + (size_t)row * max(history_cap, 0);
    if (p.pen) {
        const int words = (vocab + 31) >> 5;
        for (int w = threadIdx.x; w < words; w += blockDim.x) bitmap[w] = 0u;
        __syncthreads();
        const uint32_t n = history_cap > 0 ? min(p.count, (uint32_t)history_cap) : 0u;
        for (uint32_t j = threadIdx.x; j < n; j += blockDim.x) {
            const int tok = hist[j];
            if (tok >= 0 && tok < vocab) atomicOr(&bitmap[tok >> 5], 1u << (tok & 31));
        }
    }
    const bool sampling = p.temperature != 0.f;
    __syncthreads();   // the bitmap
    RowTokens t;
    t.logits = logits + (size_t)row * vocab;
    t.bitmap = bitmap;
    t.vocab = vocab;
    const int chunks = (vocab + 7) >> 3;
    t.cpt = (chunks + (int)blockDim.x - 1) / (int)blockDim.x;
    t.c0 = threadIdx.x * t.cpt;
    t.vec = (reinterpret_cast<uintptr_t>(t.logits) & 15u) == 0;
    t.keys = nullptr;
    uint32_t* keys = stage ? bitmap + ((vocab + 31) >> 5) + threadIdx.x * (8 * t.cpt + 1) : nullptr;
    // pass 1: the maximum and the flags (and the staged keys)
    float lm = hss_neg_inf();
    bool nan_seen = false;
    for_tokens(t, p, [&](int, int i, float z, bool was_nan) {
        lm = fmaxf(lm, z);
        nan_seen |= was_nan;
        if (keys != nullptr) keys[i - 8 * t.c0] = key_of(z);
    }, [](int) {});
    t.keys = keys;   // each thread reads only its own keys: no barrier needed before the next pass
    const bool any_nan = __syncthreads_or(nan_seen);
    const float top = block_max(lm, s.red);
    uint32_t flags = any_nan ? SAMPLE_FLAG_NAN : 0u;
    int token = 0;
    if (top == hss_neg_inf()) {
        flags |= SAMPLE_FLAG_EMPTY;
    } else if (!sampling || top == __int_as_float(0x7f800000)) {
        if (top == __int_as_float(0x7f800000)) flags |= SAMPLE_FLAG_INF;
        token = greedy_token(t, p, top, h == nullptr ? nullptr : h + (size_t)row * dim, weight, dim, s);
    } else {
        token = sample_token(t, p, top, s);
    }
    if (threadIdx.x == 0) {
        state[row] = token;
        if (advance >= 0) {
            const int pos = state[state_stride + row] + advance;
            state[state_stride + row] = pos;
            state[2 * state_stride + row] = pos + 1;
        }
        if (history_cap > 0) history[(size_t)row * history_cap + p.count % (uint32_t)history_cap] = token;
        pw[8] = p.step + 1u;
        pw[9] = p.count + 1u;
        pw[10] |= flags;
    }
}
