// hss_dot.cuh: the f32 logit h . w that model_argmax and sample_tokens recompute for near ties, by a whole warp
// (docs/design.md §0: one fixed summation order, so both kernels get the same bits).
#pragma once
#include "hss_common.cuh"

// Lane l's fmaf chain over d = l, l + 32, ... ascending (its loads issued U at a time), then the xor-butterfly sum
// (hss_warp_sum); every lane gets the result.
template <int U>
__device__ __forceinline__ float hss_refine_logit(const __nv_bfloat16* __restrict__ h,
                                                  const __nv_bfloat16* __restrict__ w, int dim) {
    float a = 0.f;
    for (int d0 = threadIdx.x & 31; d0 < dim; d0 += 32 * U) {
        float hv[U], wv[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int d = d0 + 32 * u;
            hv[u] = d < dim ? hss_bf16_to_f32(h[d]) : 0.f;
            wv[u] = d < dim ? hss_bf16_to_f32(w[d]) : 0.f;
        }
#pragma unroll
        for (int u = 0; u < U; ++u)
            if (d0 + 32 * u < dim) a = fmaf(hv[u], wv[u], a);
    }
    return hss_warp_sum(a);
}
