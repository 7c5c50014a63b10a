// q_lowrank_project.cu: the decode query's low-rank projection (SPEC §5.1), Q_proj = bf16(Q @ P).
//
// q_lowrank_project(q bf16 [num_q_heads, head_dim], p bf16 [head_dim, r], q_proj bf16 [num_q_heads, r],
//                   num_q_heads, head_dim, r)      all row-major; head_dim <= 256
//   q_proj[h, o] = bf16_rne(acc), acc = sequential f32 fma over i = 0 .. head_dim-1 of q[h, i] * p[i, o]
//   (the original's arithmetic and order; no scaling).
// Launch: block (bx, by) with bx >= r, 1 <= by <= 8 (hss: (r, min(8, 256 / r, num_q_heads))), grid
//   (ceil(num_q_heads / by), 1, 1), static shared memory only. CTA c projects heads c*by .. c*by+by-1;
//   thread (o, y) computes q_proj[c*by + y, o].
// The kernel is latency-bound (a few KiB): the CTA stages its q rows and P (in chunks of up to
//   32 KiB, all copies in flight at once through cp.async) into shared memory, so each thread's fma chain
//   waits for one round trip to L2 instead of one per batch of loads.
#include "hss_lowrank.cuh"

extern "C" __global__ void __launch_bounds__(256)
q_lowrank_project(const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ p,
                  __nv_bfloat16* __restrict__ q_proj, int num_q_heads, int head_dim, int r) {
    __shared__ __align__(16) __nv_bfloat16 ps[HSS_LR_P_ELEMS];
    __shared__ __align__(16) __nv_bfloat16 xs[HSS_LR_ROWS][HSS_LR_HEAD_DIM];
    const int o = threadIdx.x, y = threadIdx.y;
    const int tid = y * blockDim.x + o, nthreads = blockDim.x * blockDim.y;
    const int row0 = blockIdx.x * blockDim.y;
    const int rows = min((int)blockDim.y, num_q_heads - row0);
    // CTA-uniform exits, before any barrier
    if (rows <= 0 || r <= 0 || head_dim <= 0 || head_dim > HSS_LR_HEAD_DIM || blockDim.y > HSS_LR_ROWS) return;
    hss_lr_copy(xs[0], HSS_LR_HEAD_DIM, q + (size_t)row0 * head_dim, head_dim, rows, head_dim, tid, nthreads);
    const bool active = o < r && y < rows;
    const float acc = hss_lr_project(xs, ps, p, head_dim, r, o, y, active, tid, nthreads);
    if (active) q_proj[(size_t)(row0 + y) * r + o] = hss_f32_to_bf16(acc);
}
