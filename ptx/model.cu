// model.cu: the small kernels of a Llama-style decoder's forward pass (hss.model, SmolLM2): everything between
// the cuBLAS GEMMs. Row-major everywhere; bf16 activations, f32 residual stream, f32 arithmetic; no fast math.
//
// The decode step reads its position from the device, so a captured CUDA graph replays whole steps: `state` is
// i32 [MODEL_STATE_WORDS] = {token, pos, visible, 0}: the next input token, the position of that token, and
// pos + 1 (the attention's token count, read by paged_decode_attn_tiled as its tile_block_counts). model_argmax
// writes the token and advances pos and visible; model_rope_kv reads pos.
// A batch of sequences (hss.model.batch) keeps one state per row, word-major: word w of row r is at
// state[w * state_stride + r] (state_stride >= the rows; 1 for one sequence: the layout above), so the tokens are
// one contiguous i32 [rows] array (model_embed_norm's ids), and so are the visible counts (the attention's
// per-row token counts). A row not in use holds {-1, -1, 0}: every kernel leaves it alone.
//
// model_embed_norm(ids i32 [m], embed bf16 [vocab, dim], gain f32 [dim], x f32 [m, dim], h bf16 [m, dim],
//                  m, dim, vocab, eps, next_gain)
//   x[r] = f32(embed[ids[r]]); h[r] = bf16(x[r] * rsqrtf(ss / dim + eps) * gain), ss = sum_d x[r,d]^2   (RMSNorm)
//   A row whose id is outside [0, vocab) is left untouched (the host checks ids; model_argmax writes valid ones).
// model_add_norm(x f32 [m, dim], delta bf16 [m, dim], gain f32 [dim], h bf16 [m, dim], m, dim, eps, next_gain)
//   x[r] += f32(delta[r]) (one f32 rounding); h[r] = RMSNorm of the new x[r] as above.
// next_gain (both; f32 [dim] or null): the gain of the step's next row norm, prefetched into L2 (a hint only).
// The order of ss (both): thread t owns the 4-element chunks c = t + k MODEL_THREADS (k = 0, 1, ...; elements
//   4c .. 4c + 3 < dim) and chains ss = fmaf(x, x, ss) over them, k then the element ascending, from +0; the thread
//   sums are added as hss_block_sum's (a shuffle-down tree per warp, then +0 and the warp sums in warp order).
//   Chunks are single float4 / 8-byte accesses when dim % 4 == 0 and every row pointer is aligned (x, gain: 16
//   bytes; embed, delta, h: 8), else element by element: the same values. Rows of up to MODEL_NORM_HELD chunks a
//   thread (dim <= 4096) stay in registers from the loads (x, delta and gain issued together) to h; wider rows read
//   x and gain again.
// model_rope_kv(qkv bf16 [m, (n_head + 2 n_kv_head) head_dim], cos f32 [max_pos, head_dim/2], sin (same),
//               state, q_out bf16 [m, n_head, head_dim], k_cache bf16 (cache_rows rows of n_kv_head heads of
//               head_dim), v_cache (same), m, n_head, n_kv_head, head_dim, max_pos, cache_rows, row_stride,
//               kvh_stride)
//   Element (row, kv head, d) of k_cache / v_cache is at row * row_stride + kv_head * kvh_stride + d (elements,
//   i64, >= 0): positional [cache_rows, n_kv_head, head_dim] rows are row_stride = n_kv_head head_dim, kvh_stride =
//   head_dim; a page of the swap store's layout (stripes [kv head][block_size, head_dim], docs/design.md §7.1) is
//   row_stride = head_dim, kvh_stride = the stripe stride, cache_rows = block_size (v_cache: the page's V half).
//   Row r is the token at pos = state[1] + r, stored at cache row pos % cache_rows. Each qkv row is q | k | v
//   (heads in order); q and k heads get rotate-half RoPE (element j pairs with j + head_dim/2, j < head_dim/2):
//   y_j = x_j c - x_{j+h} s, y_{j+h} = x_{j+h} c + x_j s, c = cos[pos, j], s = sin[pos, j] (f32 tables the host
//   computes in double; each y one product then one fma: hss_rope_pair, as the tiled attention's rope entry points
//   round it); q to q_out, k to k_cache, v copied to v_cache. Rows with pos outside [0, max_pos), or
//   cache_rows < 1: untouched. A thread's first MODEL_ROPE_HELD pairs and v elements are loaded with state (they do
//   not depend on pos), so only the cos / sin loads wait for it.
// model_rope_kv_paged(qkv, cos, sin, state, q_out, k_pool, v_pool, tables i32 [m, table_stride], m, n_head,
//                     n_kv_head, head_dim, max_pos, state_stride, block_size, table_stride, blk_stride, tok_stride,
//                     kvh_stride)
//   model_rope_kv for m rows of a batch, each at its own position pos = state[state_stride + r] (word 1 of row r),
//   its K / V written into the row's own pages: page = tables[r * table_stride + pos / block_size], element
//   (kv head, d) of the token at page * blk_stride + (pos % block_size) * tok_stride + kv_head * kvh_stride + d
//   (elements, i64, >= 0; an NHD pool [pages, block_size, n_kv_head, head_dim] is blk_stride = block_size
//   n_kv_head head_dim, tok_stride = n_kv_head head_dim, kvh_stride = head_dim). The same rounding as
//   model_rope_kv (one shared row routine). Rows with pos outside [0, max_pos), pos / block_size >= table_stride or
//   a negative page: untouched (q_out included).
// model_silu_mul(gu bf16 [m, 2 ffn] (gate | up), act bf16 [m, ffn], m, ffn)
//   act = bf16(g / (1 + expf(-g)) * u)
// model_argmax(logits bf16 [m, vocab], h bf16 [m, dim], weight bf16 [vocab, dim], vocab, dim, state, advance, m,
//              state_stride, rows)
//   Per row r < m (one CTA each; logits and h rows r * vocab and r * dim elements in; its state words at
//   w * state_stride + r), skipping rows r >= rows[0] when `rows` (i32 [1], the live rows) is not null:
//   the greedy token of bf16 logits = bf16(h . weight[i]) (the LM head GEMM's output), its near ties resolved in
//   f32: M = the largest logit (NaN never counts), the candidates are every i with logits[i] >= M - 2 ulp_bf16(M)
//   (ulp_bf16(M) = 2^(floor(log2 |M|) - 7), at least 2^-126): the only tokens whose unrounded logit can reach the
//   largest one; each candidate's logit is recomputed as an f32 dot of h and weight[i] (lane-strided fma chains
//   over dim, xor-butterfly sum), and state[0] = the candidate of the largest recomputed logit (the lowest index on
//   equal values). More than MODEL_ARGMAX_CANDIDATES candidates: the first index of M. M = -inf (every logit -inf
//   or NaN): 0. Then state[1] += advance; state[2] = state[1] + 1 (the row's words 0, 1, 2). One sequence: m = 1,
//   state_stride = 1, rows null.
//   How (the token does not depend on it): the logits are read once, 8 a 16-byte load (element by element where
//   logits is not 16-byte aligned, and for a last partial chunk), MODEL_ARGMAX_HELD loads a thread in flight and
//   kept in registers for the candidate scan when vocab <= 8 MODEL_ARGMAX_HELD MODEL_ARGMAX_THREADS (65536; a larger
//   vocab is read again, by the threads holding a candidate only); only threads whose largest logit reaches the
//   floor scan theirs; a single candidate (the usual case) is the token whatever its f32 logit, so it is not
//   recomputed; a recomputation keeps MODEL_ARGMAX_DOT_LOADS loads per lane in flight.
// model_prefill_attn(q bf16 [m, n_head, 64], k_cache bf16 [q_start + m, n_kv_head, 64], v_cache (same), out bf16
//                    [m, n_head, 64], m, n_head, n_kv_head, head_dim, q_start)
//   Causal GQA attention: query row i (position q_start + i) of head h attends cache rows 0 .. q_start + i of kv
//   head h / (n_head / n_kv_head): out = bf16(sum_t p_t v_t / sum_t p_t), p_t = 2^(x_t - max), x_t = (q . k_t)
//   * rsqrt(64) * log2(e) (f32 fma chains; the softmax weights stay f32). head_dim must be MODEL_HD (64), else
//   nothing is written.
//
// Launch (hss.decls.model's *_geometry): model_embed_norm, model_add_norm, model_rope_kv, model_rope_kv_paged: grid
// (m), block (MODEL_THREADS); model_silu_mul: grid (ceil(ffn / MODEL_THREADS), m), block (MODEL_THREADS);
// model_argmax: grid (m), block (MODEL_ARGMAX_THREADS); model_prefill_attn: grid (ceil(m / MODEL_ATTN_ROWS),
// n_head), block (MODEL_ATTN_THREADS). No dynamic shared memory.
#include "hss_common.cuh"
#include "hss_dot.cuh"
#include "hss_rope.cuh"
#include "hss_softmax.cuh"

#define MODEL_THREADS 256          // block of the row kernels
#define MODEL_ARGMAX_THREADS 1024  // block of model_argmax
#define MODEL_ARGMAX_CANDIDATES 1024   // near ties model_argmax recomputes in f32, at most
#define MODEL_ARGMAX_HELD 8        // 16-byte logit chunks a model_argmax thread holds per batch (65536 logits a batch)
#define MODEL_ARGMAX_DOT_LOADS 16  // lane-strided loads in flight per lane in model_argmax's f32 recomputation
#define MODEL_NORM_HELD 4          // 4-element chunks a row-norm thread keeps in registers (rows up to 4096)
#define MODEL_ROPE_HELD 2          // pairs (and v elements) per model_rope_kv thread loaded before pos is known
#define MODEL_STATE_WORDS 4        // state: token, pos, visible, 0
#define MODEL_HD 64                // head_dim of model_prefill_attn
#define MODEL_ATTN_ROWS 64         // query rows per CTA of model_prefill_attn (4 threads per row)
#define MODEL_ATTN_KEYS 64         // keys per staged tile
#define MODEL_ATTN_THREADS 256     // 4 * MODEL_ATTN_ROWS
#define MODEL_ATTN_PART 20         // floats per quarter row in shared memory (16 + 4: conflict-free float4 reads)

namespace {

__device__ __forceinline__ bool aligned_to(const void* p, unsigned bytes) {
    return (reinterpret_cast<uintptr_t>(p) & (bytes - 1u)) == 0;
}

// ---- block reductions with one barrier ---------------------------------------------------------------------
// hss_block_sum<true>'s sum (a shuffle-down tree per warp, then +0.0f plus the warp sums in warp order), but every
// thread adds the warp sums itself instead of thread 0 adding and a second barrier broadcasting: the same value,
// one barrier. One use per kernel (red is never rewritten).
__device__ __forceinline__ float block_sum_once(float v, float* red) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) v += __shfl_down_sync(HSS_FULL_MASK, v, off);
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
    __syncthreads();
    const int nwarps = (blockDim.x + 31) >> 5;
    float s = 0.f;
    for (int w = 0; w < nwarps; ++w) s += red[w];
    return s;
}

// Max over the CTA (fmaxf: NaN never wins unless all are NaN): warp maxima to red, one barrier, then every warp
// reduces the warp maxima itself (a max is the same in any order). red is not rewritten before the next barrier.
__device__ __forceinline__ float block_max_once(float v, float* red) {
    v = hss_warp_max(v);
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
    __syncthreads();
    const unsigned lane = threadIdx.x & 31;
    return hss_warp_max(lane < (blockDim.x >> 5) ? red[lane] : hss_neg_inf());
}

// (value, index) of the larger value, the lower index on equal values, over the warp (xor butterfly); NaN values
// are never passed, so the pairwise rule is associative and every order gives the same index.
__device__ __forceinline__ void warp_argmax(float& best, int& idx) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
        const float ov = __shfl_xor_sync(HSS_FULL_MASK, best, off);
        const int oi = __shfl_xor_sync(HSS_FULL_MASK, idx, off);
        if (ov > best || (ov == best && oi < idx)) { best = ov; idx = oi; }
    }
}

// warp_argmax over the CTA (every thread passes its own and gets the result): one barrier; `sv` / `si` shared, one
// entry per warp, not rewritten before the next barrier.
__device__ __forceinline__ void block_argmax_once(float& best, int& idx, float* sv, int* si) {
    warp_argmax(best, idx);
    const unsigned lane = threadIdx.x & 31;
    if (lane == 0) { sv[threadIdx.x >> 5] = best; si[threadIdx.x >> 5] = idx; }
    __syncthreads();
    const bool live = lane < (blockDim.x >> 5);
    best = live ? sv[lane] : hss_neg_inf();
    idx = live ? si[lane] : 0x7fffffff;
    warp_argmax(best, idx);
}

// ---- RMSNorm rows (model_embed_norm, model_add_norm) ---------------------------------------------------------
// Thread t of the CTA (T threads) owns the chunks c = t + k T (k = 0, 1, ...) of 4 elements 4c .. 4c + 3 < dim.
// `vec`: every row pointer is aligned (x, gain: 16 bytes; the bf16 rows: 8) and dim % 4 == 0, so a chunk is one
// float4 / one 8-byte access; otherwise element by element (the same values; elements past dim read as 0).
__device__ __forceinline__ float4 load_f32x4(const float* __restrict__ p, int c, int dim, bool vec) {
    if (vec) return reinterpret_cast<const float4*>(p)[c];
    const int d = 4 * c;
    return make_float4(d < dim ? p[d] : 0.f, d + 1 < dim ? p[d + 1] : 0.f, d + 2 < dim ? p[d + 2] : 0.f,
                       d + 3 < dim ? p[d + 3] : 0.f);
}

__device__ __forceinline__ float4 load_bf16x4(const __nv_bfloat16* __restrict__ p, int c, int dim, bool vec) {
    if (vec) {
        const uint2 w = reinterpret_cast<const uint2*>(p)[c];
        return make_float4(hss_bf16_lo(w.x), hss_bf16_hi(w.x), hss_bf16_lo(w.y), hss_bf16_hi(w.y));
    }
    const int d = 4 * c;
    return make_float4(d < dim ? hss_bf16_to_f32(p[d]) : 0.f, d + 1 < dim ? hss_bf16_to_f32(p[d + 1]) : 0.f,
                       d + 2 < dim ? hss_bf16_to_f32(p[d + 2]) : 0.f, d + 3 < dim ? hss_bf16_to_f32(p[d + 3]) : 0.f);
}

__device__ __forceinline__ void store_f32x4(float* __restrict__ p, int c, int dim, bool vec, float4 v) {
    if (vec) {
        reinterpret_cast<float4*>(p)[c] = v;
        return;
    }
    const int d = 4 * c;
    if (d < dim) p[d] = v.x;
    if (d + 1 < dim) p[d + 1] = v.y;
    if (d + 2 < dim) p[d + 2] = v.z;
    if (d + 3 < dim) p[d + 3] = v.w;
}

// h = bf16(x * inv * gain) of one chunk (the product in that order, as before).
__device__ __forceinline__ void store_norm4(__nv_bfloat16* __restrict__ p, int c, int dim, bool vec, float4 x,
                                            float inv, float4 g) {
    const __nv_bfloat16 a = hss_f32_to_bf16(x.x * inv * g.x), b = hss_f32_to_bf16(x.y * inv * g.y);
    const __nv_bfloat16 e = hss_f32_to_bf16(x.z * inv * g.z), f = hss_f32_to_bf16(x.w * inv * g.w);
    if (vec) {
        reinterpret_cast<uint2*>(p)[c] = make_uint2(hss_bf16_pack(a, b), hss_bf16_pack(e, f));
        return;
    }
    const int d = 4 * c;
    if (d < dim) p[d] = a;
    if (d + 1 < dim) p[d + 1] = b;
    if (d + 2 < dim) p[d + 2] = e;
    if (d + 3 < dim) p[d + 3] = f;
}

// The new x of a chunk: x + f32(delta) (ADD, one f32 rounding) or f32(embedding).
template <bool ADD>
__device__ __forceinline__ float4 new_x(float4 x, float4 s) {
    return ADD ? make_float4(x.x + s.x, x.y + s.y, x.z + s.z, x.w + s.w) : s;
}

// ss's fmaf chain over a chunk's elements in order (an element past dim is 0: fmaf(0, 0, ss) = ss, as ss >= +0).
__device__ __forceinline__ float sum_sq4(float4 v, float ss) {
    return fmaf(v.w, v.w, fmaf(v.z, v.z, fmaf(v.y, v.y, fmaf(v.x, v.x, ss))));
}

// A row of at most K chunks per thread: x (ADD), src and gain are all loaded first (one round trip), the new x is
// written and kept in registers through the block sum, then h.
template <int K, bool ADD>
__device__ __forceinline__ void norm_row_held(float* __restrict__ xr, const __nv_bfloat16* __restrict__ src,
                                              const float* __restrict__ gain, __nv_bfloat16* __restrict__ hr,
                                              int dim, float eps, bool vec, float* red) {
    const int n4 = (dim + 3) >> 2;
    float4 x[K], s[K], g[K];
#pragma unroll
    for (int k = 0; k < K; ++k) {
        const int c = threadIdx.x + k * blockDim.x;
        x[k] = s[k] = g[k] = make_float4(0.f, 0.f, 0.f, 0.f);
        if (c < n4) {
            if (ADD) x[k] = load_f32x4(xr, c, dim, vec);
            s[k] = load_bf16x4(src, c, dim, vec);
            g[k] = load_f32x4(gain, c, dim, vec);
        }
    }
    float ss = 0.f;
#pragma unroll
    for (int k = 0; k < K; ++k) {
        const int c = threadIdx.x + k * blockDim.x;
        if (c < n4) {
            x[k] = new_x<ADD>(x[k], s[k]);
            store_f32x4(xr, c, dim, vec, x[k]);
            ss = sum_sq4(x[k], ss);
        }
    }
    const float inv = rsqrtf(block_sum_once(ss, red) / (float)dim + eps);
#pragma unroll
    for (int k = 0; k < K; ++k) {
        const int c = threadIdx.x + k * blockDim.x;
        if (c < n4) store_norm4(hr, c, dim, vec, x[k], inv, g[k]);
    }
}

template <bool ADD>
__device__ __forceinline__ void norm_row_wide(float* __restrict__ xr, const __nv_bfloat16* __restrict__ src,
                                              const float* __restrict__ gain, __nv_bfloat16* __restrict__ hr,
                                              int dim, float eps, bool vec, float* red) {
    const int n4 = (dim + 3) >> 2;
    float ss = 0.f;
    for (int c = threadIdx.x; c < n4; c += blockDim.x) {
        const float4 v = new_x<ADD>(ADD ? load_f32x4(xr, c, dim, vec) : make_float4(0.f, 0.f, 0.f, 0.f),
                                    load_bf16x4(src, c, dim, vec));
        store_f32x4(xr, c, dim, vec, v);
        ss = sum_sq4(v, ss);
    }
    const float inv = rsqrtf(block_sum_once(ss, red) / (float)dim + eps);
    for (int c = threadIdx.x; c < n4; c += blockDim.x)
        store_norm4(hr, c, dim, vec, load_f32x4(xr, c, dim, vec), inv, load_f32x4(gain, c, dim, vec));
}

// x = new_x<ADD>(x, src), h = RMSNorm(x) * gain for one row; every thread of the CTA calls it (a block sum).
template <bool ADD>
__device__ __forceinline__ void norm_row(float* __restrict__ xr, const __nv_bfloat16* __restrict__ src,
                                         const float* __restrict__ gain, __nv_bfloat16* __restrict__ hr, int dim,
                                         float eps) {
    __shared__ float red[32];
    const bool vec = (dim & 3) == 0 && aligned_to(xr, 16) && aligned_to(src, 8) && aligned_to(gain, 16) &&
                     aligned_to(hr, 8);
    const int n4 = (dim + 3) >> 2, t = blockDim.x;
    if (n4 <= t) norm_row_held<1, ADD>(xr, src, gain, hr, dim, eps, vec, red);   // dim <= 1024: SmolLM2's 576
    else if (n4 <= 2 * t) norm_row_held<2, ADD>(xr, src, gain, hr, dim, eps, vec, red);
    else if (n4 <= MODEL_NORM_HELD * t) norm_row_held<MODEL_NORM_HELD, ADD>(xr, src, gain, hr, dim, eps, vec, red);
    else norm_row_wide<ADD>(xr, src, gain, hr, dim, eps, vec, red);
}

// ---- model_argmax ----------------------------------------------------------------------------------------------
// Batch b of thread t: the chunks c = (b H + k) T + t (k < H = MODEL_ARGMAX_HELD) of 8 logits 8c .. 8c + 7, each
// one 16-byte load when logits is 16-byte aligned and the chunk lies inside vocab, else element by element (the
// same values); elements past vocab read as -inf (never above the maximum, never a candidate).
#define MODEL_NEG_INF_BF16X2 0xff80ff80u

// The element-by-element form (a chunk straddling vocab's end, or logits not 16-byte aligned): not inlined, so the
// unrolled loads keep their size.
__device__ __noinline__ uint4 logit_chunk_scalar(const __nv_bfloat16* __restrict__ logits, int e, int vocab) {
    const unsigned short* raw = reinterpret_cast<const unsigned short*>(logits);
    uint32_t w[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const uint32_t lo = e + 2 * j < vocab ? raw[e + 2 * j] : 0xff80u;
        const uint32_t hi = e + 2 * j + 1 < vocab ? raw[e + 2 * j + 1] : 0xff80u;
        w[j] = lo | hi << 16;
    }
    return make_uint4(w[0], w[1], w[2], w[3]);
}

__device__ __forceinline__ uint4 logit_chunk(const __nv_bfloat16* __restrict__ logits, int c, int vocab, bool vec) {
    const int e = 8 * c;
    if (e >= vocab) return make_uint4(MODEL_NEG_INF_BF16X2, MODEL_NEG_INF_BF16X2, MODEL_NEG_INF_BF16X2,
                                      MODEL_NEG_INF_BF16X2);
    if (vec && e + 8 <= vocab) return reinterpret_cast<const uint4*>(logits)[c];
    return logit_chunk_scalar(logits, e, vocab);
}

template <int H>
__device__ __forceinline__ void load_logits(uint4 (&v)[H], const __nv_bfloat16* __restrict__ logits, int vocab,
                                            int batch, bool vec) {
#pragma unroll
    for (int k = 0; k < H; ++k) v[k] = logit_chunk(logits, (batch * H + k) * (int)blockDim.x + threadIdx.x, vocab,
                                                   vec);
}

__device__ __forceinline__ uint32_t word_of(const uint4& u, int j) {   // j is a constant after unrolling
    return j == 0 ? u.x : j == 1 ? u.y : j == 2 ? u.z : u.w;
}

__device__ __forceinline__ __nv_bfloat162 bf16x2_of(uint32_t w) {
    __nv_bfloat162 r;
    memcpy(&r, &w, sizeof r);
    return r;
}

// The largest logit of a batch (__hmax2: a NaN loses to any number; the result is one of the inputs, exactly).
template <int H>
__device__ __forceinline__ float held_max(const uint4 (&v)[H]) {
    __nv_bfloat162 m = bf16x2_of(MODEL_NEG_INF_BF16X2);
#pragma unroll
    for (int k = 0; k < H; ++k)
        m = __hmax2(m, __hmax2(__hmax2(bf16x2_of(v[k].x), bf16x2_of(v[k].y)),
                               __hmax2(bf16x2_of(v[k].z), bf16x2_of(v[k].w))));
    uint32_t w;
    memcpy(&w, &m, sizeof w);
    return fmaxf(hss_bf16_lo(w), hss_bf16_hi(w));
}

// How many logits of a batch are near ties (>= floor_v; NaN never is).
template <int H>
__device__ __forceinline__ int count_near(const uint4 (&v)[H], float floor_v) {
    int n = 0;
#pragma unroll
    for (int k = 0; k < H; ++k)
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const uint32_t w = word_of(v[k], j);
            n += (hss_bf16_lo(w) >= floor_v) + (hss_bf16_hi(w) >= floor_v);
        }
    return n;
}

// The near ties of a batch, ascending: their indices to cand[at ..] (while at < MODEL_ARGMAX_CANDIDATES; at counts
// on), and the lowest index whose logit equals top (in f32: -0 == +0) into first.
template <int H>
__device__ __forceinline__ void collect_near(const uint4 (&v)[H], int batch, float floor_v, float top, int* cand,
                                             int& at, int& first) {
#pragma unroll
    for (int k = 0; k < H; ++k) {
        const int base = 8 * ((batch * H + k) * (int)blockDim.x + threadIdx.x);
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            const uint32_t w = word_of(v[k], e >> 1);
            const float x = e & 1 ? hss_bf16_hi(w) : hss_bf16_lo(w);
            if (x >= floor_v) {
                if (at < MODEL_ARGMAX_CANDIDATES) cand[at] = base + e;
                ++at;
                if (x == top) first = min(first, base + e);
            }
        }
    }
}

// This lane's first slot of n in a shared array counted by *counter: the exclusive prefix of n over the warp plus
// the warp's base (one atomicAdd per warp that has any). Every lane of the warp calls it.
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

}  // namespace

namespace {

// Ask L2 to fetch (and keep) the f32 row `next` [dim] that a later kernel of the step reads: the gain of the next
// row norm, which the weight stream in between would otherwise leave in DRAM. CTA 0 only; a hint, no data moves.
__device__ __forceinline__ void prefetch_gain(const float* __restrict__ next, int dim) {
    if (next == nullptr || blockIdx.x != 0) return;
    for (int i = threadIdx.x * 32; i < dim; i += blockDim.x * 32)   // one 128-byte line a thread
        asm volatile("prefetch.global.L2::evict_last [%0];" ::"l"(next + i));
}

}  // namespace

extern "C" __global__ void __launch_bounds__(MODEL_THREADS)
model_embed_norm(const int* __restrict__ ids, const __nv_bfloat16* __restrict__ embed, const float* __restrict__ gain,
                 float* __restrict__ x, __nv_bfloat16* __restrict__ h, int m, int dim, int vocab, float eps,
                 const float* __restrict__ next_gain) {
    prefetch_gain(next_gain, dim);
    const int row = blockIdx.x;
    if (row >= m) return;
    const int id = ids[row];
    if (id < 0 || id >= vocab) return;   // CTA-uniform, before the barrier
    norm_row<false>(x + (size_t)row * dim, embed + (size_t)id * dim, gain, h + (size_t)row * dim, dim, eps);
}

extern "C" __global__ void __launch_bounds__(MODEL_THREADS)
model_add_norm(float* __restrict__ x, const __nv_bfloat16* __restrict__ delta, const float* __restrict__ gain,
               __nv_bfloat16* __restrict__ h, int m, int dim, float eps, const float* __restrict__ next_gain) {
    prefetch_gain(next_gain, dim);
    const int row = blockIdx.x;
    if (row >= m) return;
    norm_row<true>(x + (size_t)row * dim, delta + (size_t)row * dim, gain, h + (size_t)row * dim, dim, eps);
}

namespace {

// One rotated pair of a q or k head: elements j and j + half of dst.
__device__ __forceinline__ void rope_pair(__nv_bfloat16* __restrict__ dst, int j, int half, float x1, float x2,
                                          float c, float s) {
    float r1, r2;
    hss_rope_pair(x1, x2, c, s, r1, r2);
    dst[j] = hss_f32_to_bf16(r1);
    dst[j + half] = hss_f32_to_bf16(r2);
}

// One qkv row's RoPE and cache write (model_rope_kv, model_rope_kv_paged): q to q_row, k and v to the cache
// rows `where(pos, k_row, v_row)` names (false: the row is left untouched, q included). `pos` is the row's
// position as read from the state; this thread's first MODEL_ROPE_HELD pairs and v elements do not depend on it,
// so their loads go out with the state's.
template <class Where>
__device__ __forceinline__ void rope_kv_row(const __nv_bfloat16* __restrict__ src, __nv_bfloat16* __restrict__ q_row,
                                            int pos, const float* __restrict__ cos_t, const float* __restrict__ sin_t,
                                            int n_head, int n_kv_head, int head_dim, int max_pos,
                                            long long kvh_stride, Where where) {
    constexpr int R = MODEL_ROPE_HELD;
    const int half = head_dim >> 1;
    const int pairs = (n_head + n_kv_head) * half, kv = n_kv_head * head_dim;
    const __nv_bfloat16* vs = src + (size_t)(n_head + n_kv_head) * head_dim;
    const __nv_bfloat16 zero = __ushort_as_bfloat16(0);
    __nv_bfloat16 x1[R], x2[R], vv[R];
#pragma unroll
    for (int k = 0; k < R; ++k) {
        const int i = threadIdx.x + k * blockDim.x;
        x1[k] = x2[k] = vv[k] = zero;
        if (i < pairs) {
            const int head = i / half, j = i - head * half;
            x1[k] = src[head * head_dim + j];
            x2[k] = src[head * head_dim + j + half];
        }
        if (i < kv) vv[k] = vs[i];
    }
    if (pos < 0 || pos >= max_pos) return;
    __nv_bfloat16* k_row;
    __nv_bfloat16* v_row;
    if (!where(pos, k_row, v_row)) return;   // CTA-uniform
    const float* c_row = cos_t + (size_t)pos * half;
    const float* s_row = sin_t + (size_t)pos * half;
#pragma unroll
    for (int k = 0; k < R; ++k) {
        const int i = threadIdx.x + k * blockDim.x;
        if (i < pairs) {
            const int head = i / half, j = i - head * half;
            __nv_bfloat16* dst = head < n_head ? q_row + (size_t)head * head_dim
                                               : k_row + (head - n_head) * kvh_stride;
            rope_pair(dst, j, half, hss_bf16_to_f32(x1[k]), hss_bf16_to_f32(x2[k]), c_row[j], s_row[j]);
        }
        if (i < kv) { const int h = i / head_dim; v_row[h * kvh_stride + (i - h * head_dim)] = vv[k]; }
    }
    for (int i = threadIdx.x + R * blockDim.x; i < pairs; i += blockDim.x) {   // wider rows
        const int head = i / half, j = i - head * half;
        __nv_bfloat16* dst = head < n_head ? q_row + (size_t)head * head_dim : k_row + (head - n_head) * kvh_stride;
        rope_pair(dst, j, half, hss_bf16_to_f32(src[head * head_dim + j]),
                  hss_bf16_to_f32(src[head * head_dim + j + half]), c_row[j], s_row[j]);
    }
    for (int e = threadIdx.x + R * blockDim.x; e < kv; e += blockDim.x) {
        const int h = e / head_dim;
        v_row[h * kvh_stride + (e - h * head_dim)] = vs[e];
    }
}

}  // namespace

extern "C" __global__ void __launch_bounds__(MODEL_THREADS)
model_rope_kv(const __nv_bfloat16* __restrict__ qkv, const float* __restrict__ cos_t, const float* __restrict__ sin_t,
              const int* __restrict__ state, __nv_bfloat16* __restrict__ q_out, __nv_bfloat16* __restrict__ k_cache,
              __nv_bfloat16* __restrict__ v_cache, int m, int n_head, int n_kv_head, int head_dim, int max_pos,
              int cache_rows, long long row_stride, long long kvh_stride) {
    const int row = blockIdx.x;
    if (row >= m || cache_rows < 1) return;
    const int pos = state[1] + row;
    rope_kv_row(qkv + (size_t)row * (n_head + 2 * n_kv_head) * head_dim, q_out + (size_t)row * n_head * head_dim,
                pos, cos_t, sin_t, n_head, n_kv_head, head_dim, max_pos, kvh_stride,
                [=](int p, __nv_bfloat16*& k, __nv_bfloat16*& v) {
                    const int crow = p % cache_rows;
                    k = k_cache + crow * row_stride;
                    v = v_cache + crow * row_stride;
                    return true;
                });
}

extern "C" __global__ void __launch_bounds__(MODEL_THREADS)
model_rope_kv_paged(const __nv_bfloat16* __restrict__ qkv, const float* __restrict__ cos_t,
                    const float* __restrict__ sin_t, const int* __restrict__ state, __nv_bfloat16* __restrict__ q_out,
                    __nv_bfloat16* __restrict__ k_pool, __nv_bfloat16* __restrict__ v_pool,
                    const int* __restrict__ tables, int m, int n_head, int n_kv_head, int head_dim, int max_pos,
                    int state_stride, int block_size, int table_stride, long long blk_stride, long long tok_stride,
                    long long kvh_stride) {
    const int row = blockIdx.x;
    if (row >= m || block_size < 1) return;
    const int pos = state[state_stride + row];
    const int* table = tables + (size_t)row * table_stride;
    rope_kv_row(qkv + (size_t)row * (n_head + 2 * n_kv_head) * head_dim, q_out + (size_t)row * n_head * head_dim,
                pos, cos_t, sin_t, n_head, n_kv_head, head_dim, max_pos, kvh_stride,
                [=](int p, __nv_bfloat16*& k, __nv_bfloat16*& v) {
                    const int at = p / block_size;
                    if (at >= table_stride) return false;
                    const int page = table[at];
                    if (page < 0) return false;
                    const long long e = page * blk_stride + (long long)(p - at * block_size) * tok_stride;
                    k = k_pool + e;
                    v = v_pool + e;
                    return true;
                });
}

extern "C" __global__ void __launch_bounds__(MODEL_THREADS)
model_silu_mul(const __nv_bfloat16* __restrict__ gu, __nv_bfloat16* __restrict__ act, int m, int ffn) {
    const int row = blockIdx.y;
    const int j = blockIdx.x * blockDim.x + threadIdx.x;
    if (row >= m || j >= ffn) return;
    const __nv_bfloat16* r = gu + (size_t)row * 2 * ffn;
    const float g = hss_bf16_to_f32(r[j]), u = hss_bf16_to_f32(r[ffn + j]);
    act[(size_t)row * ffn + j] = hss_f32_to_bf16(g / (1.0f + expf(-g)) * u);
}

extern "C" __global__ void __launch_bounds__(MODEL_ARGMAX_THREADS)
model_argmax(const __nv_bfloat16* __restrict__ logits, const __nv_bfloat16* __restrict__ h,
             const __nv_bfloat16* __restrict__ weight, int vocab, int dim, int* __restrict__ state, int advance,
             int m, int state_stride, const int* __restrict__ rows) {
    constexpr int H = MODEL_ARGMAX_HELD;
    __shared__ float red[32];
    __shared__ float sv[32];
    __shared__ int si[32];
    __shared__ int cand[MODEL_ARGMAX_CANDIDATES];
    __shared__ int n_cand, first_top;
    const int row = blockIdx.x;
    if (row >= m || (rows != nullptr && row >= rows[0])) return;   // CTA-uniform
    logits += (size_t)row * vocab;
    h += (size_t)row * dim;
    if (threadIdx.x == 0) {
        n_cand = 0;
        first_top = 0x7fffffff;
    }
    const bool vec = aligned_to(logits, 16);
    const int per_batch = H * 8 * (int)blockDim.x;
    const int batches = vocab > 0 ? (vocab - 1) / per_batch + 1 : 1;
    uint4 v[H];                        // after the loop: the last batch (the only one for vocab <= per_batch)
    float lm = hss_neg_inf();          // this thread's largest logit
    for (int b = 0; b < batches; ++b) {
        load_logits<H>(v, logits, vocab, b, vec);
        lm = fmaxf(lm, held_max<H>(v));
    }
    const float top = block_max_once(lm, red);   // its barrier also orders n_cand / first_top before the atomics
    int token = 0;
    if (top > hss_neg_inf()) {         // CTA-uniform
        const int e = (int)((__float_as_uint(top) >> 23) & 0xffu) - 127;
        const float floor_v = top - 2.0f * ldexpf(1.0f, max(e - 7, -126));   // exact: a power of two >= ulp
        const bool near = lm >= floor_v;   // this thread holds a near tie (a few threads do)
        int n = 0;
        if (near) {
            for (int b = 0; b < batches; ++b) {   // one batch: v holds it still
                if (batches > 1) load_logits<H>(v, logits, vocab, b, vec);
                n += count_near<H>(v, floor_v);
            }
        }
        int at = claim_slots(n, &n_cand);
        if (n) {
            int first = 0x7fffffff;
            for (int b = 0; b < batches; ++b) {
                if (batches > 1) load_logits<H>(v, logits, vocab, b, vec);
                collect_near<H>(v, b, floor_v, top, cand, at, first);
            }
            atomicMin(&first_top, first);
        }
        __syncthreads();
        const int count = n_cand;
        token = first_top;             // the first index of the largest logit
        if (count >= 2 && count <= MODEL_ARGMAX_CANDIDATES) {   // one candidate: it is that index
            const int warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
            float rb = hss_neg_inf();
            int ri = 0x7fffffff;
            for (int c = warp; c < count; c += nwarps) {   // a warp per candidate
                const int i = cand[c];
                const float a = hss_refine_logit<MODEL_ARGMAX_DOT_LOADS>(h, weight + (size_t)i * dim, dim);
                if (a > rb || (a == rb && i < ri)) { rb = a; ri = i; }
            }
            block_argmax_once(rb, ri, sv, si);
            if (ri < vocab) token = ri;
        }
    }
    if (threadIdx.x == 0) {
        state[row] = token;
        const int pos = state[state_stride + row] + advance;
        state[state_stride + row] = pos;
        state[2 * state_stride + row] = pos + 1;
    }
}

extern "C" __global__ void __launch_bounds__(MODEL_ATTN_THREADS)
model_prefill_attn(const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k_cache,
                   const __nv_bfloat16* __restrict__ v_cache, __nv_bfloat16* __restrict__ out, int m, int n_head,
                   int n_kv_head, int head_dim, int q_start) {
    constexpr int ROW = 4 * MODEL_ATTN_PART;   // floats per staged key (4 quarters of 16 dims, padded)
    __shared__ __align__(16) float ks[MODEL_ATTN_KEYS * ROW];
    __shared__ __align__(16) float vs[MODEL_ATTN_KEYS * ROW];
    if (head_dim != MODEL_HD || n_kv_head <= 0 || n_head % n_kv_head || q_start < 0) return;   // CTA-uniform
    const int h = blockIdx.y, kvh = h / (n_head / n_kv_head);
    const int tid = threadIdx.x, r = tid >> 2, quarter = tid & 3;
    const int i = blockIdx.x * MODEL_ATTN_ROWS + r;
    const bool live = i < m;
    const int p_abs = q_start + i;
    const int n_keys = q_start + min(m, (int)(blockIdx.x + 1) * MODEL_ATTN_ROWS);   // keys this CTA reads
    const float scale = rsqrtf((float)MODEL_HD) * 1.4426950408889634f;
    float qv[16], o[16];
#pragma unroll
    for (int c = 0; c < 16; ++c) {
        qv[c] = live ? hss_bf16_to_f32(q[((size_t)i * n_head + h) * MODEL_HD + quarter * 16 + c]) * scale : 0.f;
        o[c] = 0.f;
    }
    float mrow = hss_neg_inf(), l = 0.f;
    const size_t kv_row = (size_t)n_kv_head * MODEL_HD;
    for (int k0 = 0; k0 < n_keys; k0 += MODEL_ATTN_KEYS) {
        __syncthreads();   // the previous tile is no longer read
        for (int e = tid; e < MODEL_ATTN_KEYS * MODEL_HD; e += MODEL_ATTN_THREADS) {
            const int key = e / MODEL_HD, d = e - key * MODEL_HD, t = k0 + key;
            const size_t g = (size_t)t * kv_row + (size_t)kvh * MODEL_HD + d;
            const int at = key * ROW + (d >> 4) * MODEL_ATTN_PART + (d & 15);
            ks[at] = t < n_keys ? hss_bf16_to_f32(k_cache[g]) : 0.f;
            vs[at] = t < n_keys ? hss_bf16_to_f32(v_cache[g]) : 0.f;
        }
        __syncthreads();
        float s[MODEL_ATTN_KEYS];
        float tmax = hss_neg_inf();
#pragma unroll
        for (int jj = 0; jj < MODEL_ATTN_KEYS; ++jj) {
            const float4* kr = reinterpret_cast<const float4*>(ks + jj * ROW + quarter * MODEL_ATTN_PART);
            float a = 0.f;
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                const float4 kk = kr[c];
                a = fmaf(qv[4 * c], kk.x, a);
                a = fmaf(qv[4 * c + 1], kk.y, a);
                a = fmaf(qv[4 * c + 2], kk.z, a);
                a = fmaf(qv[4 * c + 3], kk.w, a);
            }
            a += __shfl_xor_sync(HSS_FULL_MASK, a, 1);   // the row's 4 quarters
            a += __shfl_xor_sync(HSS_FULL_MASK, a, 2);
            s[jj] = k0 + jj <= p_abs ? a : hss_neg_inf();
            tmax = fmaxf(tmax, s[jj]);
        }
        if (tmax > hss_neg_inf()) {   // the same for the 4 threads of a row
            const float mnew = fmaxf(mrow, tmax);
            const float alpha = hss_softmax_weight(mrow, mnew);   // mrow = -inf: 0
            l *= alpha;
#pragma unroll
            for (int c = 0; c < 16; ++c) o[c] *= alpha;
#pragma unroll
            for (int jj = 0; jj < MODEL_ATTN_KEYS; ++jj) {
                const float p = hss_softmax_weight(s[jj], mnew);
                l += p;
                const float4* vr = reinterpret_cast<const float4*>(vs + jj * ROW + quarter * MODEL_ATTN_PART);
#pragma unroll
                for (int c = 0; c < 4; ++c) {
                    const float4 vv = vr[c];
                    o[4 * c] = fmaf(p, vv.x, o[4 * c]);
                    o[4 * c + 1] = fmaf(p, vv.y, o[4 * c + 1]);
                    o[4 * c + 2] = fmaf(p, vv.z, o[4 * c + 2]);
                    o[4 * c + 3] = fmaf(p, vv.w, o[4 * c + 3]);
                }
            }
            mrow = mnew;
        }
    }
    if (!live) return;
    const float inv = hss_softmax_inv(l);
    __nv_bfloat16* dst = out + ((size_t)i * n_head + h) * MODEL_HD + quarter * 16;
#pragma unroll
    for (int c = 0; c < 16; ++c) dst[c] = hss_f32_to_bf16(o[c] * inv);
}
