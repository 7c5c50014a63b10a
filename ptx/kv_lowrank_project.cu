// kv_lowrank_project.cu: one KV page's per-token low-rank keys (SPEC §5.2; per token, not a block mean).
//
// kv_lowrank_project(k_block bf16 [block_size, num_kv_heads, head_dim] (one NHD page), p bf16 [head_dim, r],
//                    k_lr bf16 [num_kv_heads, block_size, r] (one A_g slot), block_size, num_kv_heads,
//                    head_dim, r)      all row-major
//   k_lr[h, t, o] = bf16_rne(acc), acc = sequential f32 fma over i = 0 .. head_dim-1 of
//   k_block[t, h, i] * p[i, o] (the original's arithmetic; no scaling).
// Launch: grid (num_kv_heads, block_size, 1), block (r, 1, 1) (any larger geometry works: threads past
//   the shape return), no shared memory. Thread (h, t, o) computes one output; the loop is unrolled so
//   the loads of p (coalesced over o) and of the key (a broadcast) are issued in batches.
#include "hss_common.cuh"

extern "C" __global__ void kv_lowrank_project(const __nv_bfloat16* __restrict__ k_block,
                                              const __nv_bfloat16* __restrict__ p, __nv_bfloat16* __restrict__ k_lr,
                                              int block_size, int num_kv_heads, int head_dim, int r) {
    const int h = blockIdx.x, t = blockIdx.y, o = threadIdx.x;
    if (h >= num_kv_heads || t >= block_size || o >= r) return;
    const __nv_bfloat16* key = k_block + ((size_t)t * num_kv_heads + h) * head_dim;
    float acc = 0.0f;
#pragma unroll 16
    for (int i = 0; i < head_dim; ++i) acc = fmaf(hss_bf16_to_f32(key[i]), hss_bf16_to_f32(p[(size_t)i * r + o]), acc);
    k_lr[((size_t)h * block_size + t) * r + o] = hss_f32_to_bf16(acc);
}
