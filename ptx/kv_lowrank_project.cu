// kv_lowrank_project.cu: one KV page's per-token low-rank keys (docs/design.md §5.2, §17.5; per token, not a block
// mean).
//
// kv_lowrank_project(k_block bf16 [block_size, num_kv_heads, head_dim] (one NHD page),
//                    p bf16 num_kv_heads x [head_dim, r] (kv head h's matrix at p + h * p_stride),
//                    k_lr bf16 [num_kv_heads, block_size, r] (one A_g slot), block_size, num_kv_heads,
//                    head_dim, r, p_stride)      all row-major; head_dim <= 256
//   k_lr[h, t, o] = bf16_rne(acc), acc = sequential f32 fma over i = 0 .. head_dim-1 of
//   k_block[t, h, i] * P_h[i, o] (the original's arithmetic and order; no scaling). The original's one P
//   for every head is p_stride = 0; docs/design.md §17.5's P per kv head is p_stride = head_dim * r. p_stride < 0:
//   nothing is written.
// Launch: block (bx, by) with bx >= r, 1 <= by <= 8 (hss: (r, min(8, 256 / r, block_size))), grid
//   (num_kv_heads, ceil(block_size / by), 1), static shared memory only. CTA (h, c) projects tokens
//   c*by .. c*by+by-1 of kv head h; thread (o, y) computes k_lr[h, c*by + y, o].
// Latency-bound like q_lowrank_project: the CTA stages its keys and P (chunks of up to 32 KiB,
//   all copies in flight through cp.async) into shared memory before the fma chains.
#include "hss_lowrank.cuh"

extern "C" __global__ void __launch_bounds__(256)
kv_lowrank_project(const __nv_bfloat16* __restrict__ k_block, const __nv_bfloat16* __restrict__ p,
                   __nv_bfloat16* __restrict__ k_lr, int block_size, int num_kv_heads, int head_dim, int r,
                   int p_stride) {
    __shared__ __align__(16) __nv_bfloat16 ps[HSS_LR_P_ELEMS];
    __shared__ __align__(16) __nv_bfloat16 xs[HSS_LR_ROWS][HSS_LR_HEAD_DIM];
    const int o = threadIdx.x, y = threadIdx.y, h = blockIdx.x;
    const int tid = y * blockDim.x + o, nthreads = blockDim.x * blockDim.y;
    const int tok0 = blockIdx.y * blockDim.y;
    const int rows = min((int)blockDim.y, block_size - tok0);
    // CTA-uniform exits, before any barrier
    if (h >= num_kv_heads || rows <= 0 || r <= 0 || head_dim <= 0 || head_dim > HSS_LR_HEAD_DIM ||
        blockDim.y > HSS_LR_ROWS || p_stride < 0)
        return;
    p += (size_t)h * p_stride;
    hss_lr_copy(xs[0], HSS_LR_HEAD_DIM, k_block + ((size_t)tok0 * num_kv_heads + h) * head_dim,
                (size_t)num_kv_heads * head_dim, rows, head_dim, tid, nthreads);
    const bool active = o < r && y < rows;
    const float acc = hss_lr_project(xs, ps, p, head_dim, r, o, y, active, tid, nthreads);
    if (active) k_lr[((size_t)h * block_size + tok0 + y) * r + o] = hss_f32_to_bf16(acc);
}
