// hss_softmax.cuh: the online softmax and the merge of partial softmax states, for every attention kernel
// (docs/design.md §6.3, §6.4). A state is (m, l, o): m the largest logit so far, l = sum_t 2^(x_t - m), o = sum_t
// 2^(x_t - m) v_t, logits in log2 units (x * log2(e)); m = -inf, l = 0, o = 0: nothing attended yet. BASE_E
// (qsa_prefill_attn, as the original): natural logits and e^ by __expf. The exponentials are exp2f / __expf, so each
// module's flags (--use_fast_math or not) pick their instructions.
#pragma once
#include "hss_common.cuh"

// The weight of a state of max m under a max M >= m: 2^(m - M) (BASE_E: e^(m - M)); m = -inf: 0.
template <bool BASE_E = false>
__device__ __forceinline__ float hss_softmax_weight(float m, float M) {
    return BASE_E ? __expf(m - M) : exp2f(m - M);
}

// One online-softmax step of the two rows a lane holds in an m16n8 mma C fragment (lane = 4g + c: row g in x0, x1,
// row g + 8 in x2, x3; masked tokens -inf, at least one finite per row over the quad), from the rows' state (m0, l0),
// (m1, l1) and their step maxima mx0, mx1 (over the quad, lanes 4g .. 4g + 3):
//   m' = max(m, mx), a = 2^(m - m'), p = 2^(x - m'), l' = fma(l, a, p_0 + p_1) (this lane's share of the row sum:
//   the caller sums the quad's shares at the end). The caller rescales its o by a0 (row g) and a1 (row g + 8).
// By value in and out: a reference to the caller's loop-carried state would change how nvcc compiles its loop.
struct HssFragStep {
    float m0, m1, l0, l1;   // the rows' new state
    float a0, a1;           // 2^(m - m') of row g, row g + 8
    float p0, p1, p2, p3;   // the tokens' weights, as x0 .. x3
};

__device__ __forceinline__ HssFragStep hss_softmax_step_frag(float x0, float x1, float x2, float x3, float mx0,
                                                             float mx1, float m0, float m1, float l0, float l1) {
    HssFragStep s;
    s.m0 = fmaxf(m0, mx0);
    s.m1 = fmaxf(m1, mx1);
    s.a0 = hss_softmax_weight(m0, s.m0);
    s.a1 = hss_softmax_weight(m1, s.m1);
    s.p0 = hss_softmax_weight(x0, s.m0);
    s.p1 = hss_softmax_weight(x1, s.m0);
    s.p2 = hss_softmax_weight(x2, s.m1);
    s.p3 = hss_softmax_weight(x3, s.m1);
    s.l0 = fmaf(l0, s.a0, s.p0 + s.p1);
    s.l1 = fmaf(l1, s.a1, s.p2 + s.p3);
    return s;
}

// 1 / l, or 0 for a state that attended nothing (l = 0): the factor that turns o into the attention output.
__device__ __forceinline__ float hss_softmax_inv(float l) { return l > 0.f ? 1.f / l : 0.f; }

// ---- merging partial states ---------------------------------------------------------------------------------
// Partials (m_j, l_j, o_j) of one row merge under a common max M >= every m_j: l = sum_j l_j w_j, o = sum_j o_j w_j
// with w_j = hss_softmax_weight(m_j, M), as fma chains in the caller's order; or online, one partial at a time
// (hss_softmax_fold4), when M is not known in advance.

// acc = fma(x, w, acc) for the 4 dims of a piece of o: one partial's weighted term of a merge. (x by value: a
// float4 read from memory stays one vector load.)
__device__ __forceinline__ void hss_softmax_add4(float4& acc, float4 x, float w) {
    acc.x = fmaf(x.x, w, acc.x);
    acc.y = fmaf(x.y, w, acc.y);
    acc.z = fmaf(x.z, w, acc.z);
    acc.w = fmaf(x.w, w, acc.w);
}

// Online merge of a partial (m_j, l_j) = ml, o_j = x (4 dims; m_j finite) into a running (M, l, acc):
//   M' = max(M, m_j), a = 2^(M - M'), w = 2^(m_j - M'), acc' = fma(x, w, acc * a), l' = fma(l_j, w, l * a), M = M'.
__device__ __forceinline__ void hss_softmax_fold4(const float4& x, float2 ml, float4& acc, float& M, float& l) {
    const float Mn = fmaxf(M, ml.x);
    const float a = hss_softmax_weight(M, Mn), w = hss_softmax_weight(ml.x, Mn);
    acc.x = fmaf(x.x, w, acc.x * a);
    acc.y = fmaf(x.y, w, acc.y * a);
    acc.z = fmaf(x.z, w, acc.z * a);
    acc.w = fmaf(x.w, w, acc.w * a);
    l = fmaf(ml.y, w, l * a);
    M = Mn;
}
