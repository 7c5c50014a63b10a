// page_gather.cu: many KV pages copied in one launch, from host memory the device reads directly (a mapped pinned
// buffer, zero-copy over PCIe) into device memory: hss.swap's HostStore reads of a group of scattered pages (a sparse
// decode step's misses) cost one launch instead of one DMA copy per page.
//
// page_gather(dst u8 [*], src u8 [*], pairs i32 [n_pages, 2], n_pages i32, page_vecs i32)
//   For every request r < n_pages, with (s, d) = pairs[r] and P = 16 * page_vecs bytes:
//     dst[d * P .. d * P + P) = src[s * P .. s * P + P)
//   dst and src 16-byte aligned (every page then is); pages and slots are indices in units of P (int32, >= 0: the
//   host checks them); the destinations of one launch must not overlap (sources may repeat). src and pairs may be
//   mapped host memory: the host writes them before the launch and not again until the launch has run (an event).
// Launch: grid (n_pages, ceil(page_vecs / GATHER_CHUNK), 1), block (GATHER_THREADS, 1, 1), no dynamic shared memory.
//   CTA (r, c) copies the 16-byte vectors c * GATHER_CHUNK .. (c + 1) * GATHER_CHUNK - 1 of request r (those below
//   page_vecs): thread t the vectors c * GATHER_CHUNK + u * GATHER_THREADS + t, u < GATHER_UNROLL, so each warp's
//   u-th access is one contiguous 512-byte span. A thread issues all its loads before its first store: a zero-copy
//   read crosses PCIe (~1-2 us), so bandwidth needs many in flight (GATHER_CHUNK * 16 = 32 KiB per CTA, and every CTA
//   of a group's launch is resident at once on a large GPU). Thread 0 reads the request's pair once for the CTA.
#include "hss_common.cuh"
#include "hss_copy.cuh"

extern "C" __global__ void __launch_bounds__(GATHER_THREADS)
page_gather(uint4* __restrict__ dst, const uint4* __restrict__ src, const int2* pairs, int n_pages, int page_vecs) {
    __shared__ int2 pair;
    if (blockIdx.x >= (unsigned)n_pages) return;       // (the grid is exactly n_pages wide)
    if (threadIdx.x == 0) pair = pairs[blockIdx.x];    // plain load: the host rewrote the ring slot before the launch
    __syncthreads();
    hss_copy_page_chunk(dst + (long long)pair.y * page_vecs, src + (long long)pair.x * page_vecs, page_vecs);
}
