// hss_rope.cuh: RoPE, rotate-half (docs/design.md §12 common RoPE), angles in double as the original.
#pragma once

// Output dim d of the row y (shared, [hd] f32) at position pos: for d < rot (rot even, <= hd), half = rot/2,
// j = d mod half, inv_freq = exp(-(2j/rot) ln theta) and (s, c) = sincos(pos * inv_freq) in double, cast to
// f32; y[j]*c - y[j+half]*s (d < half), y[j+half]*c + y[j]*s (half <= d < rot); y[d] for d >= rot.
__device__ __forceinline__ float hss_rope(const float* y, unsigned d, unsigned rot, double pos, float theta) {
    if (d >= rot) return y[d];
    const unsigned half = rot >> 1;
    const unsigned j = d < half ? d : d - half;
    const double inv_freq = exp(-((double)(2 * j) / (double)rot) * log((double)theta));
    double s, c;
    sincos(pos * inv_freq, &s, &c);
    const float fs = (float)s, fc = (float)c;
    const float x1 = y[j], x2 = y[j + half];
    return d < half ? x1 * fc - x2 * fs : x2 * fc + x1 * fs;
}

// One rotate-half pair (x1, x2) = (y[j], y[j + half]) by the table's (c, s): r1 = x1 c - x2 s, r2 = x2 c + x1 s,
// each an explicit product then one fma, so every kernel that rotates a cache row rounds it the same way (model_rope_kv
// and the tiled attention's rope entry points: their rows are bitwise equal).
__device__ __forceinline__ void hss_rope_pair(float x1, float x2, float c, float s, float& r1, float& r2) {
    r1 = __fmaf_rn(x1, c, -__fmul_rn(x2, s));
    r2 = __fmaf_rn(x2, c, __fmul_rn(x1, s));
}
