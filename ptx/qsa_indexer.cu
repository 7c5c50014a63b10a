// qsa_indexer.cu: the QSA indexer kernels (docs/design.md §10-§12). Built WITHOUT --use_fast_math, as the original:
// IEEE f32 division, rsqrtf where the original used it, RoPE angles in double. All layouts row-major,
// outermost first; bf16 = __nv_bfloat16 (round-to-nearest-even on store); scalars are u32 except the f32
// theta and eps. Every kernel returns without touching memory when its launch contract is broken (checked
// uniformly per CTA, before any barrier), so a bad launch cannot read or write out of bounds.
//
// Shared math.
//   RMS norm (group = hd): y[d] = x[d] * rsqrtf(sum_d x[d]^2 / hd + eps) * (1 + w[d]), all f32; the sum is a
//     block reduction: a shuffle-down tree per warp, per-warp sums in shared memory, thread 0 adds them in
//     warp order (deterministic; hss_block_sum in hss_common.cuh).
//   RoPE, rotate-half on the first `rot` dims (rot even, <= hd): for d < rot, half = rot/2, j = d mod half,
//     inv_freq = exp(-(2j/rot) ln theta) and (sin, cos)(pos * inv_freq) computed in double, then cast to f32;
//     out[d] = y[j]*c - y[j+half]*s (d < half), y[j+half]*c + y[j]*s (half <= d < rot), y[d] (d >= rot)
//     (hss_rope in hss_rope.cuh).
//
// Decode kernels:
// qsa_block_pool(raw_keys bf16 [*, hd], k_norm_w bf16 [hd], block_keys bf16 [*, hd], first_block, ratio, hd,
//                rot, theta f32, eps f32)
//   grid (n_new, 1, 1), block (hd, 1, 1) with hd a multiple of 32, dynamic smem (hd + 32) * 4 B.
//   Block b = first_block + blockIdx.x: v[d] = (sum_{r < ratio, ascending} raw_keys[b*ratio + r, d]) / ratio
//   (f32 sum, f32 division); block_keys[b, d] = bf16(rope(rmsnorm(v, k_norm_w), pos = b * ratio)).
// qsa_qprep(q_in bf16 [n_heads, hd], q_norm_w bf16 [hd], q_out f32 [n_heads, hd], hd, rot, pos, theta f32,
//           eps f32)
//   grid (n_heads, 1, 1), block (hd, 1, 1) with hd a multiple of 32, dynamic smem (hd + 32) * 4 B.
//   q_out[h, d] = rope(rmsnorm(q_in[h], q_norm_w), pos)[d], kept in f32.
// qsa_score(q f32 [n_heads, hd], block_keys bf16 [n_blocks, hd], scores f32 [n_blocks], n_blocks, n_heads, hd)
//   grid (G, 1, 1) for any G >= 1 (grid-stride; hss.decls.qsa.score_grid(n_blocks, hd) gives every warp one
//   tile), block (256, 1, 1), dynamic smem n_heads * hd * 4 B (q staged in shared memory).
//   scores[b] = (sum_{h ascending} fmaxf(dot(q[h], k[b]), 0)) * rsqrtf(hd), dots accumulated in f32.
//   Blocks go on grid.x, so any number of blocks launches (the original's grid.y = n_blocks stopped at 65535).
//   Fast path (hd in {32, 64, 128, 256}, block_keys 16-byte aligned): a block's key row is hd/8 chunks of 16 B,
//   one chunk per lane, so a warp covers 32*8/hd consecutive blocks per step with one 16-byte load per lane and
//   unrolls QSA_SCORE_STEPS steps (that many loads in flight per lane, issued before q is staged). Each lane
//   fma-accumulates its 8 products per head in dim order, then an xor-shuffle tree over the block's lanes
//   sums the head's dot. Other hd: a warp per block, lanes stride over dims, then a warp shuffle sum.
// qsa_gather(k_cache, v_cache bf16 [pages, block_size, nkv, hd] (paged NHD), block_table i32 [logical pages],
//            sel i32 [n_sel], k_out, v_out bf16 [n_sel, nkv, hd], block_size, nkv, hd)
//   grid (n_sel, 1, 1), block (256, 1, 1) (any x size works). Row i: token p = sel[i]; its nkv*hd elements at
//   block_table[p / block_size] * block_size*nkv*hd + (p % block_size) * nkv*hd are copied to row i of k_out
//   and of v_out (16-byte copies when every pointer and the row size allow, else 2-byte). A negative sel entry
//   or page id leaves the row unwritten.
//
// The prefill kernels (qsa_qprep_rows, qsa_score_rows, qsa_score_rows_tc, qsa_prefill_attn, qsa_prefill_attn_tc)
// are in qsa_prefill.cuh, included at the end of this file.
#include "hss_common.cuh"
#include "hss_rope.cuh"
#include "qsa_common.cuh"

// The shape contract of the one-CTA-per-row kernels (pool, qprep): uniform over the CTA.
__device__ __forceinline__ bool qsa_row_launch_ok(u32 hd, u32 rot) {
    return blockDim.x == hd && blockDim.y == 1 && blockDim.z == 1 && (hd & 31) == 0 && rot <= hd && (rot & 1) == 0 &&
           qsa_dynamic_smem_bytes() >= (hd + 32) * 4;
}

extern "C" __global__ void qsa_block_pool(const __nv_bfloat16* __restrict__ raw_keys,
                                          const __nv_bfloat16* __restrict__ k_norm_w,
                                          __nv_bfloat16* __restrict__ block_keys, u32 first_block, u32 ratio, u32 hd,
                                          u32 rot, float theta, float eps) {
    extern __shared__ float smem[];   // [hd] normed key, then [32] warp sums
    if (!qsa_row_launch_ok(hd, rot) || ratio == 0 || blockIdx.y != 0 || blockIdx.z != 0) return;
    const u32 d = threadIdx.x;
    const size_t b = (size_t)first_block + blockIdx.x;
    const __nv_bfloat16* src = raw_keys + b * ratio * hd + d;
    float sum = 0.0f;
    for (u32 r = 0; r < ratio; ++r) sum += __bfloat162float(src[(size_t)r * hd]);
    const float v = sum / (float)ratio;
    qsa_rms_norm(v, k_norm_w, hd, eps, smem, smem + hd);
    block_keys[b * hd + d] = __float2bfloat16_rn(hss_rope(smem, d, rot, (double)b * (double)ratio, theta));
}

extern "C" __global__ void qsa_qprep(const __nv_bfloat16* __restrict__ q_in, const __nv_bfloat16* __restrict__ q_norm_w,
                                     float* __restrict__ q_out, u32 hd, u32 rot, u32 pos, float theta, float eps) {
    extern __shared__ float smem[];   // [hd] normed head, then [32] warp sums
    if (!qsa_row_launch_ok(hd, rot) || blockIdx.y != 0 || blockIdx.z != 0) return;
    const u32 d = threadIdx.x;
    const size_t row = (size_t)blockIdx.x * hd;
    qsa_rms_norm(__bfloat162float(q_in[row + d]), q_norm_w, hd, eps, smem, smem + hd);
    q_out[row + d] = hss_rope(smem, d, rot, (double)pos, theta);
}

extern "C" __global__ void __launch_bounds__(QSA_SCORE_THREADS)
    qsa_score(const float* __restrict__ q, const __nv_bfloat16* __restrict__ block_keys, float* __restrict__ scores,
              u32 n_blocks, u32 n_heads, u32 hd) {
    extern __shared__ __align__(16) float qs[];   // [n_heads, hd]
    if (hd == 0 || n_heads == 0 || (blockDim.x & 31) || blockDim.y != 1 || blockDim.z != 1 || blockIdx.y != 0 ||
        blockIdx.z != 0 || (unsigned long long)qsa_dynamic_smem_bytes() < 4ull * n_heads * hd)
        return;
    const bool aligned = (reinterpret_cast<uintptr_t>(block_keys) & 15) == 0;
    if (aligned && hd == 128)
        qsa_score_chunks<16>(q, block_keys, scores, n_blocks, n_heads, hd, qs);
    else if (aligned && hd == 64)
        qsa_score_chunks<8>(q, block_keys, scores, n_blocks, n_heads, hd, qs);
    else if (aligned && hd == 256)
        qsa_score_chunks<32>(q, block_keys, scores, n_blocks, n_heads, hd, qs);
    else if (aligned && hd == 32)
        qsa_score_chunks<4>(q, block_keys, scores, n_blocks, n_heads, hd, qs);
    else
        qsa_score_dims(q, block_keys, scores, n_blocks, n_heads, hd, qs);
}

extern "C" __global__ void qsa_gather(const __nv_bfloat16* __restrict__ k_cache, const __nv_bfloat16* __restrict__ v_cache,
                                      const int* __restrict__ block_table, const int* __restrict__ sel,
                                      __nv_bfloat16* __restrict__ k_out, __nv_bfloat16* __restrict__ v_out,
                                      u32 block_size, u32 nkv, u32 hd) {
    if (block_size == 0 || blockDim.y != 1 || blockDim.z != 1 || blockIdx.y != 0 || blockIdx.z != 0) return;
    const size_t i = blockIdx.x;
    const int p = sel[i];
    if (p < 0) return;
    const int page = block_table[(u32)p / block_size];
    if (page < 0) return;
    const size_t row = (size_t)nkv * hd;   // elements per token (all kv heads)
    const size_t src = ((size_t)page * block_size + (u32)p % block_size) * row;
    const size_t dst = i * row;
    const uintptr_t any = reinterpret_cast<uintptr_t>(k_cache) | reinterpret_cast<uintptr_t>(v_cache) |
                          reinterpret_cast<uintptr_t>(k_out) | reinterpret_cast<uintptr_t>(v_out) | (row * 2);
    if ((any & 15) == 0) {
        const size_t n16 = row / 8;   // 16-byte chunks per row
        const uint4* ks = reinterpret_cast<const uint4*>(k_cache + src);
        const uint4* vs = reinterpret_cast<const uint4*>(v_cache + src);
        uint4* kd = reinterpret_cast<uint4*>(k_out + dst);
        uint4* vd = reinterpret_cast<uint4*>(v_out + dst);
        for (size_t t = threadIdx.x; t < 2 * n16; t += blockDim.x) {
            if (t < n16)
                kd[t] = __ldg(ks + t);
            else
                vd[t - n16] = __ldg(vs + (t - n16));
        }
    } else {
        const unsigned short* ks = reinterpret_cast<const unsigned short*>(k_cache + src);
        const unsigned short* vs = reinterpret_cast<const unsigned short*>(v_cache + src);
        unsigned short* kd = reinterpret_cast<unsigned short*>(k_out + dst);
        unsigned short* vd = reinterpret_cast<unsigned short*>(v_out + dst);
        for (size_t t = threadIdx.x; t < 2 * row; t += blockDim.x) {
            if (t < row)
                kd[t] = ks[t];
            else
                vd[t - row] = vs[t - row];
        }
    }
}

// The prefill-selection kernels (docs/design.md §12.5-12.8) live in their own header.
#include "qsa_prefill.cuh"
