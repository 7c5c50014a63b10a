// q_lowrank_project.cu: the decode query's low-rank projection (SPEC §5.1), Q_proj = bf16(Q @ P).
//
// q_lowrank_project(q bf16 [num_q_heads, head_dim], p bf16 [head_dim, r], q_proj bf16 [num_q_heads, r],
//                   num_q_heads, head_dim, r)      all row-major
//   q_proj[h, o] = bf16_rne(acc), acc = sequential f32 fma over i = 0 .. head_dim-1 of q[h, i] * p[i, o]
//   (the original's arithmetic; no scaling).
// Launch: grid (num_q_heads, 1, 1), block (r, 1, 1) (any larger geometry works: threads past the shape
//   return), no shared memory. Thread (h, o) computes one output; the loop is unrolled so the loads of
//   p (coalesced over o) and q (a broadcast) are issued in batches ahead of the fma chain.
#include "hss_common.cuh"

extern "C" __global__ void q_lowrank_project(const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ p,
                                             __nv_bfloat16* __restrict__ q_proj, int num_q_heads, int head_dim, int r) {
    const int h = blockIdx.x, o = threadIdx.x;
    if (h >= num_q_heads || o >= r) return;
    const __nv_bfloat16* row = q + (size_t)h * head_dim;
    float acc = 0.0f;
#pragma unroll 16
    for (int i = 0; i < head_dim; ++i) acc = fmaf(hss_bf16_to_f32(row[i]), hss_bf16_to_f32(p[(size_t)i * r + o]), acc);
    q_proj[(size_t)h * r + o] = hss_f32_to_bf16(acc);
}
