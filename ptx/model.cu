// model.cu: the small kernels of a Llama-style decoder's forward pass (hss.model, SmolLM2): everything between
// the cuBLAS GEMMs. Row-major everywhere; bf16 activations, f32 residual stream, f32 arithmetic; no fast math.
//
// The decode step reads its position from the device, so a captured CUDA graph replays whole steps: `state` is
// i32 [MODEL_STATE_WORDS] = {token, pos, visible, 0}: the next input token, the position of that token, and
// pos + 1 (the attention's token count, read by paged_decode_attn_tiled as its tile_block_counts). model_argmax
// writes the token and advances pos and visible; model_rope_kv reads pos.
//
// model_embed_norm(ids i32 [m], embed bf16 [vocab, dim], gain f32 [dim], x f32 [m, dim], h bf16 [m, dim],
//                  m, dim, vocab, eps)
//   x[r] = f32(embed[ids[r]]); h[r] = bf16(x[r] * rsqrtf(sum_d x[r,d]^2 / dim + eps) * gain)   (RMSNorm)
//   A row whose id is outside [0, vocab) is left untouched (the host checks ids; model_argmax writes valid ones).
// model_add_norm(x f32 [m, dim], delta bf16 [m, dim], gain f32 [dim], h bf16 [m, dim], m, dim, eps)
//   x[r] += f32(delta[r]) (one f32 rounding); h[r] = RMSNorm of the new x[r] as above.
// model_rope_kv(qkv bf16 [m, (n_head + 2 n_kv_head) head_dim], cos f32 [max_pos, head_dim/2], sin (same),
//               state, q_out bf16 [m, n_head, head_dim], k_cache bf16 [cache_rows, n_kv_head, head_dim], v_cache
//               (same), m, n_head, n_kv_head, head_dim, max_pos, cache_rows)
//   Row r is the token at pos = state[1] + r, stored at cache row pos % cache_rows. Each qkv row is q | k | v
//   (heads in order); q and k heads get rotate-half RoPE (element j pairs with j + head_dim/2, j < head_dim/2):
//   y_j = x_j c - x_{j+h} s, y_{j+h} = x_{j+h} c + x_j s, c = cos[pos, j], s = sin[pos, j] (f32 tables the host
//   computes in double); q to q_out, k to k_cache, v copied to v_cache. Rows with pos outside [0, max_pos), or
//   cache_rows < 1: untouched.
// model_silu_mul(gu bf16 [m, 2 ffn] (gate | up), act bf16 [m, ffn], m, ffn)
//   act = bf16(g / (1 + expf(-g)) * u)
// model_argmax(logits bf16 [vocab], h bf16 [dim], weight bf16 [vocab, dim], vocab, dim, state, advance)
//   The greedy token of bf16 logits = bf16(h . weight[i]) (the LM head GEMM's output), its near ties resolved in
//   f32: M = the largest logit (NaN never counts), the candidates are every i with logits[i] >= M - 2 ulp_bf16(M)
//   (ulp_bf16(M) = 2^(floor(log2 |M|) - 7), at least 2^-126): the only tokens whose unrounded logit can reach the
//   largest one; each candidate's logit is recomputed as an f32 dot of h and weight[i] (lane-strided fma chains
//   over dim, xor-butterfly sum), and state[0] = the candidate of the largest recomputed logit (the lowest index on
//   equal values). More than MODEL_ARGMAX_CANDIDATES candidates: the first index of M. M = -inf (every logit -inf
//   or NaN): 0. Then state[1] += advance; state[2] = state[1] + 1.
// model_prefill_attn(q bf16 [m, n_head, 64], k_cache bf16 [q_start + m, n_kv_head, 64], v_cache (same), out bf16
//                    [m, n_head, 64], m, n_head, n_kv_head, head_dim, q_start)
//   Causal GQA attention: query row i (position q_start + i) of head h attends cache rows 0 .. q_start + i of kv
//   head h / (n_head / n_kv_head): out = bf16(sum_t p_t v_t / sum_t p_t), p_t = 2^(x_t - max), x_t = (q . k_t)
//   * rsqrt(64) * log2(e) (f32 fma chains; the softmax weights stay f32). head_dim must be MODEL_HD (64), else
//   nothing is written.
//
// Launch (hss.kernels.model's *_geometry): model_embed_norm, model_add_norm, model_rope_kv: grid (m), block
// (MODEL_THREADS); model_silu_mul: grid (ceil(ffn / MODEL_THREADS), m), block (MODEL_THREADS); model_argmax: grid
// (1), block (MODEL_ARGMAX_THREADS); model_prefill_attn: grid (ceil(m / MODEL_ATTN_ROWS), n_head), block
// (MODEL_ATTN_THREADS). No dynamic shared memory.
#include "hss_common.cuh"

#define MODEL_THREADS 256          // block of the row kernels
#define MODEL_ARGMAX_THREADS 1024  // block of model_argmax
#define MODEL_ARGMAX_CANDIDATES 1024   // near ties model_argmax recomputes in f32, at most
#define MODEL_STATE_WORDS 4        // state: token, pos, visible, 0
#define MODEL_HD 64                // head_dim of model_prefill_attn
#define MODEL_ATTN_ROWS 64         // query rows per CTA of model_prefill_attn (4 threads per row)
#define MODEL_ATTN_KEYS 64         // keys per staged tile
#define MODEL_ATTN_THREADS 256     // 4 * MODEL_ATTN_ROWS
#define MODEL_ATTN_PART 20         // floats per quarter row in shared memory (16 + 4: conflict-free float4 reads)

namespace {

// RMSNorm of the f32 row xr [dim] (already written by this thread for its own elements) into h: every thread of
// the CTA calls it (a block reduction); each thread reads back only the elements it wrote.
__device__ __forceinline__ void rms_norm_row(const float* xr, float ss, const float* __restrict__ gain,
                                             __nv_bfloat16* __restrict__ hr, int dim, float eps) {
    __shared__ float red[32];
    ss = hss_block_sum<true>(ss, red);
    const float inv = rsqrtf(ss / (float)dim + eps);
    for (int d = threadIdx.x; d < dim; d += blockDim.x) hr[d] = hss_f32_to_bf16(xr[d] * inv * gain[d]);
}

// (value, index) of the larger value, the lower index on equal values, over the CTA (every thread passes its
// own); every thread gets the result. Two barriers; `sv` / `si` shared, one entry per warp.
__device__ __forceinline__ void block_argmax(float& best, int& idx, float* sv, int* si) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
        const float ov = __shfl_xor_sync(HSS_FULL_MASK, best, off);
        const int oi = __shfl_xor_sync(HSS_FULL_MASK, idx, off);
        if (ov > best || (ov == best && oi < idx)) { best = ov; idx = oi; }
    }
    const int warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    if ((threadIdx.x & 31) == 0) { sv[warp] = best; si[warp] = idx; }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < nwarps; ++w)
            if (sv[w] > best || (sv[w] == best && si[w] < idx)) { best = sv[w]; idx = si[w]; }
        sv[0] = best;
        si[0] = idx;
    }
    __syncthreads();
    best = sv[0];
    idx = si[0];
}

}  // namespace

extern "C" __global__ void __launch_bounds__(MODEL_THREADS)
model_embed_norm(const int* __restrict__ ids, const __nv_bfloat16* __restrict__ embed, const float* __restrict__ gain,
                 float* __restrict__ x, __nv_bfloat16* __restrict__ h, int m, int dim, int vocab, float eps) {
    const int row = blockIdx.x;
    if (row >= m) return;
    const int id = ids[row];
    if (id < 0 || id >= vocab) return;   // CTA-uniform, before the barrier
    const __nv_bfloat16* e = embed + (size_t)id * dim;
    float* xr = x + (size_t)row * dim;
    float ss = 0.f;
    for (int d = threadIdx.x; d < dim; d += blockDim.x) {
        const float v = hss_bf16_to_f32(e[d]);
        xr[d] = v;
        ss = fmaf(v, v, ss);
    }
    rms_norm_row(xr, ss, gain, h + (size_t)row * dim, dim, eps);
}

extern "C" __global__ void __launch_bounds__(MODEL_THREADS)
model_add_norm(float* __restrict__ x, const __nv_bfloat16* __restrict__ delta, const float* __restrict__ gain,
               __nv_bfloat16* __restrict__ h, int m, int dim, float eps) {
    const int row = blockIdx.x;
    if (row >= m) return;
    float* xr = x + (size_t)row * dim;
    const __nv_bfloat16* dr = delta + (size_t)row * dim;
    float ss = 0.f;
    for (int d = threadIdx.x; d < dim; d += blockDim.x) {
        const float v = xr[d] + hss_bf16_to_f32(dr[d]);
        xr[d] = v;
        ss = fmaf(v, v, ss);
    }
    rms_norm_row(xr, ss, gain, h + (size_t)row * dim, dim, eps);
}

extern "C" __global__ void __launch_bounds__(MODEL_THREADS)
model_rope_kv(const __nv_bfloat16* __restrict__ qkv, const float* __restrict__ cos_t, const float* __restrict__ sin_t,
              const int* __restrict__ state, __nv_bfloat16* __restrict__ q_out, __nv_bfloat16* __restrict__ k_cache,
              __nv_bfloat16* __restrict__ v_cache, int m, int n_head, int n_kv_head, int head_dim, int max_pos,
              int cache_rows) {
    const int row = blockIdx.x;
    if (row >= m || cache_rows < 1) return;
    const int pos = state[1] + row;
    if (pos < 0 || pos >= max_pos) return;
    const int crow = pos % cache_rows;
    const int half = head_dim >> 1;
    const __nv_bfloat16* src = qkv + (size_t)row * (n_head + 2 * n_kv_head) * head_dim;
    const float* c_row = cos_t + (size_t)pos * half;
    const float* s_row = sin_t + (size_t)pos * half;
    const int pairs = (n_head + n_kv_head) * half;
    for (int i = threadIdx.x; i < pairs; i += blockDim.x) {
        const int head = i / half, j = i - head * half;
        const float x1 = hss_bf16_to_f32(src[head * head_dim + j]);
        const float x2 = hss_bf16_to_f32(src[head * head_dim + j + half]);
        const float c = c_row[j], s = s_row[j];
        __nv_bfloat16* dst = head < n_head
            ? q_out + ((size_t)row * n_head + head) * head_dim
            : k_cache + ((size_t)crow * n_kv_head + (head - n_head)) * head_dim;
        dst[j] = hss_f32_to_bf16(x1 * c - x2 * s);
        dst[j + half] = hss_f32_to_bf16(x2 * c + x1 * s);
    }
    const int kv = n_kv_head * head_dim;
    const __nv_bfloat16* vs = src + (size_t)(n_head + n_kv_head) * head_dim;
    for (int e = threadIdx.x; e < kv; e += blockDim.x) v_cache[(size_t)crow * kv + e] = vs[e];
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
             const __nv_bfloat16* __restrict__ weight, int vocab, int dim, int* __restrict__ state, int advance) {
    __shared__ float sv[32];
    __shared__ int si[32];
    __shared__ int cand[MODEL_ARGMAX_CANDIDATES];
    __shared__ int n_cand;
    if (threadIdx.x == 0) n_cand = 0;
    float best = hss_neg_inf();
    int idx = 0x7fffffff;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) {   // ascending: the first of equal values stays
        const float v = hss_bf16_to_f32(logits[i]);
        if (v > best) { best = v; idx = i; }
    }
    block_argmax(best, idx, sv, si);   // its first barrier also orders n_cand = 0 before the atomics
    int token = 0;
    if (best > hss_neg_inf()) {        // CTA-uniform
        const int e = (int)((__float_as_uint(best) >> 23) & 0xffu) - 127;
        const float floor_v = best - 2.0f * ldexpf(1.0f, max(e - 7, -126));   // exact: a power of two >= ulp
        for (int i = threadIdx.x; i < vocab; i += blockDim.x)
            if (hss_bf16_to_f32(logits[i]) >= floor_v) {
                const int k = atomicAdd(&n_cand, 1);
                if (k < MODEL_ARGMAX_CANDIDATES) cand[k] = i;
            }
        __syncthreads();
        const int count = n_cand;
        token = idx;
        if (count <= MODEL_ARGMAX_CANDIDATES) {
            const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
            float rb = hss_neg_inf();
            int ri = 0x7fffffff;
            for (int c = warp; c < count; c += nwarps) {   // a warp per candidate
                const int i = cand[c];
                const __nv_bfloat16* w = weight + (size_t)i * dim;
                float a = 0.f;
                for (int d = lane; d < dim; d += 32) a = fmaf(hss_bf16_to_f32(h[d]), hss_bf16_to_f32(w[d]), a);
                a = hss_warp_sum(a);
                if (a > rb || (a == rb && i < ri)) { rb = a; ri = i; }
            }
            block_argmax(rb, ri, sv, si);
            if (ri < vocab) token = ri;
        }
    }
    if (threadIdx.x == 0) {
        state[0] = token;
        const int pos = state[1] + advance;
        state[1] = pos;
        state[2] = pos + 1;
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
            const float alpha = exp2f(mrow - mnew);   // mrow = -inf: 0
            l *= alpha;
#pragma unroll
            for (int c = 0; c < 16; ++c) o[c] *= alpha;
#pragma unroll
            for (int jj = 0; jj < MODEL_ATTN_KEYS; ++jj) {
                const float p = exp2f(s[jj] - mnew);
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
    const float inv = l > 0.f ? 1.0f / l : 0.f;
    __nv_bfloat16* dst = out + ((size_t)i * n_head + h) * MODEL_HD + quarter * 16;
#pragma unroll
    for (int c = 0; c < 16; ++c) dst[c] = hss_f32_to_bf16(o[c] * inv);
}
