// hss_headscore.cuh: the per-head normalised score's arithmetic (docs/design.md §17.5) in explicit instructions, so
// every module that includes it computes the same bits whatever its build flags (predictor_score is built with
// --use_fast_math, sparse_step without): flush-to-zero subtract, multiply, add and max, and the hardware ex2.
#pragma once

__device__ __forceinline__ float hss_sub_ftz(float a, float b) {
    float r;
    asm("sub.ftz.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
}
__device__ __forceinline__ float hss_mul_ftz(float a, float b) {
    float r;
    asm("mul.ftz.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
}
__device__ __forceinline__ float hss_add_ftz(float a, float b) {
    float r;
    asm("add.ftz.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
}
__device__ __forceinline__ float hss_ex2_ftz(float x) {
    float r;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
    return r;
}

// One block's normalised score from its per-head maxima: the sum over qh ascending of 2^((row[qh] - head_max[qh]) *
// exp2_scale), a term whose exponent is NaN (a head with no finite score) left out. A head max that is subnormal or
// +-0 gives the same sum (the subtraction flushes it), so a max computed in any order serves.
__device__ __forceinline__ float hss_head_combine(const float* __restrict__ row, const float* __restrict__ head_max,
                                                  int num_q_heads, float exp2_scale) {
    float acc = 0.0f;
    for (int qh = 0; qh < num_q_heads; ++qh) {
        const float x = hss_mul_ftz(hss_sub_ftz(row[qh], head_max[qh]), exp2_scale);
        if (!isnan(x)) acc = hss_add_ftz(acc, hss_ex2_ftz(x));
    }
    return acc;
}
