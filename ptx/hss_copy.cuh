// hss_copy.cuh: a CTA's share of a whole-page copy, 16-byte vectors with many loads in flight (page_gather and
// sparse_fetch: pages read from mapped host memory, where a load crosses PCIe and bandwidth needs many in flight).
#pragma once
#include <cuda_runtime.h>

#define GATHER_THREADS 256                            // block size
#define GATHER_UNROLL 8                               // 16-byte loads in flight per thread
#define GATHER_CHUNK (GATHER_THREADS * GATHER_UNROLL)  // 16-byte vectors per CTA

// CTA (., blockIdx.y, .) copies the vectors blockIdx.y * GATHER_CHUNK .. + GATHER_CHUNK - 1 (those below page_vecs)
// of `from` into `to`: thread t the vectors blockIdx.y * GATHER_CHUNK + u * GATHER_THREADS + t, u < GATHER_UNROLL, so
// each warp's u-th access is one contiguous 512-byte span; every load is issued before the first store.
__device__ __forceinline__ void hss_copy_page_chunk(uint4* __restrict__ to, const uint4* __restrict__ from,
                                                    int page_vecs) {
    const long long first = (long long)blockIdx.y * GATHER_CHUNK + threadIdx.x;
    uint4 v[GATHER_UNROLL];
#pragma unroll
    for (int u = 0; u < GATHER_UNROLL; ++u) {
        const long long i = first + (long long)u * GATHER_THREADS;
        if (i < page_vecs) v[u] = __ldcs(from + i);   // streamed: read once, no need to keep it in L1 / L2
    }
#pragma unroll
    for (int u = 0; u < GATHER_UNROLL; ++u) {
        const long long i = first + (long long)u * GATHER_THREADS;
        if (i < page_vecs) to[i] = v[u];              // default caching: the attention reads the page next
    }
}
