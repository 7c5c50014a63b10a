// q_lowrank_project.cu: the decode query's low-rank projection (docs/design.md §5.1, §17.5), Q_proj = bf16(Q @ P).
//
// q_lowrank_project(q bf16 [num_q_heads, head_dim], p bf16 G x [head_dim, r] (matrix g at p + g * p_stride),
//                   q_proj bf16 [num_q_heads, r], num_q_heads, head_dim, r, heads_per_p, p_stride)
//   all row-major; head_dim <= 256; G = ceil(num_q_heads / heads_per_p). q head h is projected with
//   matrix g = h / heads_per_p (docs/design.md §17.5: one P per kv head is heads_per_p = gqa_ratio, p_stride =
//   head_dim * r; the original's one P is heads_per_p = num_q_heads, p_stride = 0):
//   q_proj[h, o] = bf16_rne(acc), acc = sequential f32 fma over i = 0 .. head_dim-1 of q[h, i] * P_g[i, o]
//   (the original's arithmetic and order; no scaling). heads_per_p < 1 or p_stride < 0: nothing is written.
// Launch: block (bx, by) with bx >= r, 1 <= by <= 8 (hss: (r, min(8, 256 / r, heads_per_p))), grid
//   (ceil(heads_per_p / by), G, 1), static shared memory only. CTA (c, g) projects heads
//   g*heads_per_p + c*by .. + by-1 (never past its matrix's heads); thread (o, y) computes one q_proj entry.
//   With heads_per_p = num_q_heads the geometry, and every thread's fma chain, are the original P's.
// q_lowrank_project_rows(q bf16 [R, num_q_heads, head_dim], p, q_proj bf16 [R, num_q_heads, r], rows i32 [1], the same
//   scalars): query rows s < rows[0] each projected exactly as q_lowrank_project projects one query (the same bits);
//   rows past rows[0] untouched. Launch: q_lowrank_project's block and grid with grid.z = R.
// The kernel is latency-bound (a few KiB): the CTA stages its q rows and P (in chunks of up to
//   32 KiB, all copies in flight at once through cp.async) into shared memory, so each thread's fma chain
//   waits for one round trip to L2 instead of one per batch of loads.
#include "hss_lowrank.cuh"

// One CTA's share of q_lowrank_project for the rows of q / q_proj given (the kernel, or one query row of the
// batched kernel).
__device__ __forceinline__ void hss_q_project(const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ p,
                                              __nv_bfloat16* __restrict__ q_proj, int num_q_heads, int head_dim,
                                              int r, int heads_per_p, int p_stride) {
    __shared__ __align__(16) __nv_bfloat16 ps[HSS_LR_P_ELEMS];
    __shared__ __align__(16) __nv_bfloat16 xs[HSS_LR_ROWS][HSS_LR_HEAD_DIM];
    const int o = threadIdx.x, y = threadIdx.y;
    const int tid = y * blockDim.x + o, nthreads = blockDim.x * blockDim.y;
    const int in_group = blockIdx.x * blockDim.y;   // first head of this CTA within its matrix's heads
    const long long first = (long long)blockIdx.y * heads_per_p + in_group;
    // CTA-uniform exits, before any barrier
    if (heads_per_p <= 0 || p_stride < 0 || in_group >= heads_per_p || first >= num_q_heads) return;
    const int row0 = (int)first;
    const int rows = min(min((int)blockDim.y, heads_per_p - in_group), num_q_heads - row0);
    if (r <= 0 || head_dim <= 0 || head_dim > HSS_LR_HEAD_DIM || blockDim.y > HSS_LR_ROWS) return;
    p += (size_t)blockIdx.y * p_stride;
    hss_lr_copy(xs[0], HSS_LR_HEAD_DIM, q + (size_t)row0 * head_dim, head_dim, rows, head_dim, tid, nthreads);
    const bool active = o < r && y < rows;
    const float acc = hss_lr_project(xs, ps, p, head_dim, r, o, y, active, tid, nthreads);
    if (active) q_proj[(size_t)(row0 + y) * r + o] = hss_f32_to_bf16(acc);
}

extern "C" __global__ void __launch_bounds__(256)
q_lowrank_project(const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ p,
                  __nv_bfloat16* __restrict__ q_proj, int num_q_heads, int head_dim, int r, int heads_per_p,
                  int p_stride) {
    hss_q_project(q, p, q_proj, num_q_heads, head_dim, r, heads_per_p, p_stride);
}

extern "C" __global__ void __launch_bounds__(256)
q_lowrank_project_rows(const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ p,
                       __nv_bfloat16* __restrict__ q_proj, const int* __restrict__ rows, int num_q_heads, int head_dim,
                       int r, int heads_per_p, int p_stride) {
    const int s = blockIdx.z;
    if (s >= rows[0]) return;   // CTA-uniform, before any barrier
    hss_q_project(q + (size_t)s * num_q_heads * head_dim, p, q_proj + (size_t)s * num_q_heads * r, num_q_heads,
                  head_dim, r, heads_per_p, p_stride);
}
