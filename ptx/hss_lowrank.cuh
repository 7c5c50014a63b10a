// hss_lowrank.cuh: shared-memory staging shared by q_lowrank_project.cu and kv_lowrank_project.cu.
#pragma once
#include "hss_async.cuh"
#include "hss_common.cuh"

#define HSS_LR_P_ELEMS 16384   // bf16 elements of P staged per chunk (32 KiB)
#define HSS_LR_ROWS 8          // input rows per CTA at most
#define HSS_LR_HEAD_DIM 256    // longest input row

// Queue a copy of `rows` rows of `len` bf16 (global rows `src_stride` apart) into shared memory (rows
// `dst_stride` apart, 16-byte aligned): cp.async 16-byte pieces when the addresses allow it, so every
// piece is in flight at once, else plain element copies. The caller commits, waits and barriers.
__device__ __forceinline__ void hss_lr_copy(__nv_bfloat16* dst, int dst_stride, const __nv_bfloat16* src,
                                            size_t src_stride, int rows, int len, int tid, int nthreads) {
    if ((reinterpret_cast<uintptr_t>(src) & 15) == 0 && ((len | dst_stride) & 7) == 0 && (src_stride & 7) == 0) {
        const int per = len / 8;
        for (int j = tid; j < rows * per; j += nthreads) {
            const int t = j / per, c = j - t * per;
            hss_cp_async16(dst + (size_t)t * dst_stride + 8 * c, src + t * src_stride + 8 * c);
        }
    } else {
        for (int j = tid; j < rows * len; j += nthreads) {
            const int t = j / len, c = j - t * len;
            dst[(size_t)t * dst_stride + c] = src[t * src_stride + c];
        }
    }
}

// Wait for this thread's queued copies, then make every thread's copies visible to the CTA.
__device__ __forceinline__ void hss_lr_wait() {
    hss_cp_commit();
    hss_cp_wait<0>();
    __syncthreads();
}

// Thread (o, y)'s sequential fma chain over i = 0 .. head_dim-1 of xs[y][i] * P[i, o] (the original's order),
// staging P through `ps` in chunks. The input rows must already be queued (hss_lr_copy); every thread of the
// CTA calls this (it holds barriers); `active` threads accumulate.
__device__ __forceinline__ float hss_lr_project(const __nv_bfloat16 (*xs)[HSS_LR_HEAD_DIM], __nv_bfloat16* ps,
                                                const __nv_bfloat16* p, int head_dim, int r, int o, int y,
                                                bool active, int tid, int nthreads) {
    const int chunk = (HSS_LR_P_ELEMS / r) & ~7;   // P rows per chunk: 16-byte aligned chunk starts
    float acc = 0.0f;
    for (int i0 = 0; i0 < head_dim; i0 += chunk) {
        const int n = min(chunk, head_dim - i0);
        if (i0 > 0) __syncthreads();   // every thread is done with the previous chunk
        hss_lr_copy(ps, 0, p + (size_t)i0 * r, 0, 1, n * r, tid, nthreads);
        hss_lr_wait();   // the first wait also covers the input rows, queued together with P's first chunk
        if (active) {
            const __nv_bfloat16* x = xs[y] + i0;
#pragma unroll 8
            for (int i = 0; i < n; ++i) acc = fmaf(hss_bf16_to_f32(x[i]), hss_bf16_to_f32(ps[i * r + o]), acc);
        }
    }
    return acc;
}
