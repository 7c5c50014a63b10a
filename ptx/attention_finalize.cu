// attention_finalize.cu: the last step of tiled decode attention (docs/design.md §6.4).
//
// attention_finalize(o f32 [num_seqs*num_q_heads, head_dim], l f32 [num_seqs*num_q_heads],
//                    out bf16 [num_seqs, num_q_heads, head_dim], num_q_heads i32, head_dim i32):
//   out[seq, qh, d] = bf16_rne(o[seq, qh, d] * (l > 0 ? 1/l : 0))   (l == 0: no token was attended -> 0)
// Launch: grid (num_seqs, num_q_heads, 1), block (128, 1, 1) (threads stride over head_dim), no shared memory.
#include "hss_common.cuh"
#include "hss_softmax.cuh"

extern "C" __global__ void __launch_bounds__(128)
attention_finalize(const float* __restrict__ o, const float* __restrict__ l, __nv_bfloat16* __restrict__ out,
                   int num_q_heads, int head_dim) {
    const long long row = (long long)blockIdx.x * num_q_heads + blockIdx.y;
    const float lv = l[row];
    const float inv = hss_softmax_inv(lv);
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x)
        out[row * head_dim + d] = hss_f32_to_bf16(o[row * head_dim + d] * inv);
}
