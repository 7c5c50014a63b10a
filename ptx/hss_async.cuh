// hss_async.cuh: cp.async (sm_80+) global -> shared copies: queue 16-byte pieces, commit them as a group, wait.
#pragma once

// Queue a 16-byte copy gmem -> smem (both 16-byte aligned; .cg: cached in L2 only).
__device__ __forceinline__ void hss_cp_async16(void* smem, const void* gmem) {
    const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem) : "memory");
}

// Close this thread's copies queued since the last commit into one group.
__device__ __forceinline__ void hss_cp_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

// Wait until at most N of this thread's committed groups are in flight (its other copies have landed; other
// threads' copies need a barrier as well).
template <int N>
__device__ __forceinline__ void hss_cp_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }
