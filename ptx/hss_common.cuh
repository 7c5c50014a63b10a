// hss_common.cuh: helpers shared by the hss kernels (bf16 conversions, warp and block reductions).
#pragma once
#include <cuda_bf16.h>

// Sum over the 32 lanes of a warp; every lane gets the total (xor butterfly).
__device__ __forceinline__ float hss_warp_sum(float v) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
    return v;
}

// Max over the 32 lanes of a warp; every lane gets the result.
__device__ __forceinline__ float hss_warp_max(float v) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, off));
    return v;
}

__device__ __forceinline__ float hss_bf16_to_f32(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ __nv_bfloat16 hss_f32_to_bf16(float v) { return __float2bfloat16_rn(v); }
