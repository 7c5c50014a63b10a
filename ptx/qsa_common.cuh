// qsa_common.cuh: pieces shared by the QSA kernel modules (qsa_indexer.cu, qsa_device.cu): the dynamic
// shared-memory size, the RMS norm and the block scorer (docs/design.md §12; the math is described in qsa_indexer.cu).
#pragma once
#include "hss_common.cuh"

typedef unsigned int u32;

#define QSA_SCORE_THREADS 256   // qsa_score / qsa_dev_score: most threads per CTA
#define QSA_SCORE_STEPS 4       // qsa_score / qsa_dev_score: tile steps per warp (loads in flight per lane)

// The launch's dynamic shared memory in bytes.
__device__ __forceinline__ u32 qsa_dynamic_smem_bytes() {
    u32 r;
    asm volatile("mov.u32 %0, %%dynamic_smem_size;" : "=r"(r));
    return r;
}

// y[d] = x * rsqrtf(mean(x^2) + eps) * (1 + w[d]) into shared y; ends with a barrier.
__device__ __forceinline__ void qsa_rms_norm(float x, const __nv_bfloat16* __restrict__ w, u32 hd, float eps, float* y,
                                             float* red) {
    const float ms = hss_block_sum<false>(x * x, red);
    const float rms = rsqrtf(ms / (float)hd + eps);
    const u32 d = threadIdx.x;
    y[d] = x * rms * (1.0f + __bfloat162float(w[d]));
    __syncthreads();
}

// Fast path: LPB = hd / 8 lanes per block (one 16-byte chunk each), G = 32 / LPB blocks per warp step, a warp
// tile = QSA_SCORE_STEPS steps. Warps walk tiles grid-stride. qs: shared [n_heads, hd], staged here.
template <int LPB>
__device__ __forceinline__ void qsa_score_chunks(const float* __restrict__ q, const __nv_bfloat16* __restrict__ keys,
                                                 float* __restrict__ scores, u32 n_blocks, u32 n_heads, u32 hd,
                                                 float* qs) {
    constexpr int G = 32 / LPB;
    constexpr int U = QSA_SCORE_STEPS;
    constexpr int TILE = G * U;
    const u32 lane = threadIdx.x & 31, sub = lane / LPB, c = lane % LPB;
    const size_t warps_per_cta = blockDim.x >> 5;
    const size_t n_tiles = ((size_t)n_blocks + TILE - 1) / TILE;
    const size_t stride = (size_t)gridDim.x * warps_per_cta;
    size_t t = (size_t)blockIdx.x * warps_per_cta + (threadIdx.x >> 5);
    const uint4* rows = reinterpret_cast<const uint4*>(keys);   // hd / 8 = LPB uint4 per block row

    uint4 kv[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {   // the first tile's keys are in flight while q is staged
        const size_t b = t * TILE + u * G + sub;
        kv[u] = (t < n_tiles && b < n_blocks) ? __ldg(rows + b * LPB + c) : make_uint4(0u, 0u, 0u, 0u);
    }
    for (u32 i = threadIdx.x; i < n_heads * hd; i += blockDim.x) qs[i] = q[i];
    __syncthreads();

    const float scale = rsqrtf((float)hd);
    while (t < n_tiles) {   // warp-uniform: every lane of a warp shares t
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const size_t b = t * TILE + u * G + sub;
            const float k0 = hss_bf16_lo(kv[u].x), k1 = hss_bf16_hi(kv[u].x);
            const float k2 = hss_bf16_lo(kv[u].y), k3 = hss_bf16_hi(kv[u].y);
            const float k4 = hss_bf16_lo(kv[u].z), k5 = hss_bf16_hi(kv[u].z);
            const float k6 = hss_bf16_lo(kv[u].w), k7 = hss_bf16_hi(kv[u].w);
            float acc = 0.0f;
            for (u32 h = 0; h < n_heads; ++h) {
                const float4 qa = *reinterpret_cast<const float4*>(qs + h * hd + 8 * c);
                const float4 qb = *reinterpret_cast<const float4*>(qs + h * hd + 8 * c + 4);
                float dot = qa.x * k0;
                dot = fmaf(qa.y, k1, dot);
                dot = fmaf(qa.z, k2, dot);
                dot = fmaf(qa.w, k3, dot);
                dot = fmaf(qb.x, k4, dot);
                dot = fmaf(qb.y, k5, dot);
                dot = fmaf(qb.z, k6, dot);
                dot = fmaf(qb.w, k7, dot);
                dot = hss_warp_sum<LPB>(dot);   // over the block's LPB lanes
                acc += fmaxf(dot, 0.0f);
            }
            if (c == 0 && b < n_blocks) scores[b] = acc * scale;
        }
        t += stride;
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const size_t b = t * TILE + u * G + sub;
            kv[u] = (t < n_tiles && b < n_blocks) ? __ldg(rows + b * LPB + c) : make_uint4(0u, 0u, 0u, 0u);
        }
    }
}

// Any hd: a warp per block (grid-stride over warps), lanes stride over dims.
__device__ __forceinline__ void qsa_score_dims(const float* __restrict__ q, const __nv_bfloat16* __restrict__ keys,
                                               float* __restrict__ scores, u32 n_blocks, u32 n_heads, u32 hd,
                                               float* qs) {
    for (u32 i = threadIdx.x; i < n_heads * hd; i += blockDim.x) qs[i] = q[i];
    __syncthreads();
    const u32 lane = threadIdx.x & 31;
    const size_t warps_per_cta = blockDim.x >> 5;
    const size_t stride = (size_t)gridDim.x * warps_per_cta;
    const float scale = rsqrtf((float)hd);
    for (size_t b = (size_t)blockIdx.x * warps_per_cta + (threadIdx.x >> 5); b < n_blocks; b += stride) {
        const __nv_bfloat16* k = keys + b * hd;
        float acc = 0.0f;
        for (u32 h = 0; h < n_heads; ++h) {
            float dot = 0.0f;
            for (u32 d = lane; d < hd; d += 32) dot = fmaf(qs[h * hd + d], __bfloat162float(k[d]), dot);
            acc += fmaxf(hss_warp_sum(dot), 0.0f);
        }
        if (lane == 0) scores[b] = acc * scale;
    }
}
