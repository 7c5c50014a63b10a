// hss_common.cuh: helpers shared by every hss kernel: constants, bf16 conversions, warp and block reductions.
// Concept headers beside it: hss_async.cuh (cp.async), hss_mma.cuh (bf16 tensor-core mma), hss_rope.cuh (RoPE),
// hss_softmax.cuh (online softmax and merge), hss_headscore.cuh (per-head normalised scores), hss_copy.cuh (page
// copies), hss_lowrank.cuh (low-rank projection staging); qsa_common.cuh for the QSA modules.
#pragma once
#include <cuda_bf16.h>
#include <stdint.h>

#define HSS_FULL_MASK 0xffffffffu   // every lane of the warp, for the __shfl_*_sync calls

// -inf as its bit pattern: the same constant with or without --use_fast_math.
__device__ __forceinline__ float hss_neg_inf() { return __int_as_float(0xff800000); }

// ---- bf16 -------------------------------------------------------------------------------------------------
__device__ __forceinline__ float hss_bf16_to_f32(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ __nv_bfloat16 hss_f32_to_bf16(float v) { return __float2bfloat16_rn(v); }

// The two bf16 of a little-endian 32-bit word as f32 (exact): element 0 is the low half.
__device__ __forceinline__ float hss_bf16_lo(uint32_t w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float hss_bf16_hi(uint32_t w) { return __uint_as_float(w & 0xffff0000u); }

// Two bf16 in one 32-bit word, `a` in the low half (the lower k / column index of an mma fragment register).
__device__ __forceinline__ uint32_t hss_bf16_pack(__nv_bfloat16 a, __nv_bfloat16 b) {
    return (uint32_t)__bfloat16_as_ushort(a) | ((uint32_t)__bfloat16_as_ushort(b) << 16);
}

// x = hi + lo with hi = bf16(x), lo = bf16(x - f32(hi)) (x - f32(hi) is exact in f32), for a pair, packed.
__device__ __forceinline__ void hss_bf16_split2(float x0, float x1, uint32_t& hi, uint32_t& lo) {
    const __nv_bfloat16 h0 = __float2bfloat16_rn(x0), h1 = __float2bfloat16_rn(x1);
    hi = hss_bf16_pack(h0, h1);
    lo = hss_bf16_pack(__float2bfloat16_rn(x0 - __bfloat162float(h0)), __float2bfloat16_rn(x1 - __bfloat162float(h1)));
}

// ---- reductions -------------------------------------------------------------------------------------------
// Sum over each aligned group of WIDTH lanes (a power of two <= 32); every lane of the group gets its total
// (xor butterfly, offsets WIDTH/2 .. 1).
template <int WIDTH = 32>
__device__ __forceinline__ float hss_warp_sum(float v) {
#pragma unroll
    for (int off = WIDTH / 2; off > 0; off >>= 1) v += __shfl_xor_sync(HSS_FULL_MASK, v, off);
    return v;
}

// Max over the 32 lanes of a warp; every lane gets the result.
__device__ __forceinline__ float hss_warp_max(float v) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) v = fmaxf(v, __shfl_xor_sync(HSS_FULL_MASK, v, off));
    return v;
}

// Sum of v over the CTA (docs/design.md §12 block reduction): a shuffle-down tree per warp, lane 0 writes red[warp]
// (shared, one float per warp), thread 0 adds the warp sums in warp order (deterministic) into red[0], which every
// thread returns. One use per kernel: red[0] is rewritten between the two barriers.
// Two forms, each the code its kernels were written with (same PTX as before): FROM_ZERO (the prefill kernels)
// starts thread 0's sum at +0.0f and also counts a last partial warp; otherwise (the decode kernels, which
// check that blockDim.x is a multiple of 32) it starts at red[0]. For whole warps the sums differ only if
// red[0] is -0.0f (+0.0f + -0.0f = +0.0f), which a sum of squares never is.
template <bool FROM_ZERO>
__device__ __forceinline__ float hss_block_sum(float v, float* red) {
    const unsigned nwarps = FROM_ZERO ? (blockDim.x + 31u) >> 5 : blockDim.x >> 5;
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) v += __shfl_down_sync(HSS_FULL_MASK, v, off);
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
    __syncthreads();
    if (threadIdx.x == 0) {
        float s = FROM_ZERO ? 0.f : red[0];
        for (unsigned w = FROM_ZERO ? 0 : 1; w < nwarps; ++w) s += red[w];
        red[0] = s;
    }
    __syncthreads();
    return red[0];
}
