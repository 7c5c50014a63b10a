// paged_decode_attn_tiled.cu: one tile of streaming (online-softmax) decode attention (SPEC §6.3).
//
// Inputs (bf16 = __nv_bfloat16, element strides are in ELEMENTS, i64):
//   Q                 bf16 [num_seqs, num_q_heads, head_dim]
//   K_pool, V_pool    bf16, element (page, tok, kv_head, d) at
//                     page*blk_stride + tok*tok_stride + kv_head*kvh_stride + d
//                     (NHD pool: (bs*nkv*hd, nkv*hd, hd); HSS scratch slots: (nkv*gs, hd, gs/2), V = K + nkv*gs/2)
//   tile_blocks       i32 [num_seqs, tile_capacity]: the page ids of this tile, in order
//   tile_block_counts i32 [num_seqs]: entries of this tile (clamped to [0, tile_capacity])
// State (f32, read then written): m, l [num_seqs*num_q_heads]; o [num_seqs*num_q_heads, head_dim].
// last_block_valid_slots: tokens used of each sequence's LAST entry in this tile (min with block_size;
//   0 or negative drops that page). kh = qh / gqa_ratio. head_dim <= 256 (any value).
//
// Per (seq, qh), for each token of the tile in order (the original's recurrence, all f32):
//   logit = dot(q, k) * rsqrtf(head_dim); m_new = max(m, logit); s_old = __expf(m - m_new);
//   s_new = __expf(logit - m_new); l = fma(l, s_old, s_new); O[d] = fma(O[d], s_old, V[d]*s_new).
// Every token's logit is computed the same way wherever the token falls (the dot over head_dim in a
// fixed order: each lane's 16 (8) consecutive dims by fma in two chains, even and odd dims, then their
// sum, then a fixed xor tree over the token's lanes), and the recurrence runs token by token, so
// splitting the same pages into any tiles gives the same bits (and any chunking inside the kernel too).
//
// Launch: grid (num_seqs, num_q_heads, 1), block (256, 1, 1), no dynamic shared memory (22 KiB static;
// <= 128 registers, so two CTAs fit on an SM).
// The CTA walks the tile in chunks of CT tokens (28; 14 for head_dim > 128) as a 3-stage pipeline with
// one barrier per step. Step i:
//   A  warps 0-6, one token per group of G lanes (16 dims per lane; 8 when head_dim <= 64): the logits
//      of chunk i (K in registers, loaded two steps earlier), their running max within each warp, V of
//      chunk i into shared memory, then the loads of chunk i+2 (page ids two steps ahead of those);
//   B  warp 7: chunk i-1's running max across warps, then s_old and s_new of every token (two __expf);
//   C  threads owning output dims (one each; two when head_dim > 128): O[d] over chunk i-2, token by
//      token; thread 0 also carries l.
// Loads are 16-byte vectors when the pools, strides and head_dim allow it, else 2-byte loads; both give
// the same values, so the arithmetic is identical. Reads stay inside the tile's pages and the rows'
// head_dim elements; page ids themselves are trusted (the host cannot check device-resident ids).
#include "hss_common.cuh"

#define ATT_THREADS 256
#define ATT_A_WARPS 7        // warps 0-6 load and compute logits; warp 7 runs the softmax scan
#define ATT_SCAN_WARP 7
#define ATT_MAX_HD 256
#define ATT_VBUF_ELEMS 3584  // bf16 elements of one staged V chunk (CT * HDP)

namespace {

// Compile-time shape of the kernel for head_dim rounded up to HDP (64, 128 or 256).
template <int HDP>
struct Shape {
    static constexpr int E = HDP == 64 ? 8 : 16;   // dims per lane in stage A
    static constexpr int PIECES = E / 8;           // 16-byte pieces per lane per row
    static constexpr int G = HDP / E;              // lanes per token (8, 8, 16)
    static constexpr int TPW = 32 / G;             // tokens per warp (4, 4, 2)
    static constexpr int CT = ATT_A_WARPS * TPW;   // tokens per chunk (28, 28, 14)
    static constexpr bool PAIRS = HDP > 128;       // stage C: two dims per thread
    static_assert(CT * HDP <= ATT_VBUF_ELEMS, "V chunk does not fit");
};

struct Args {
    const unsigned short* q;
    const unsigned short* k;
    const unsigned short* v;
    const int* blocks;
    float* m;
    float* l;
    float* o;
    long long state, blk, tok;
    int hd, bs, n_blocks, last_slots;
    long long n_tok;
    bool vec;
};

// 8 bf16 (one 16-byte piece of a row) as 4 packed words; elements at or past `valid` read as zero
// (nothing is read past the row).
// The 2-byte path (unaligned pools or strides, head_dim % 8 != 0) is a fallback: it keeps few loads in
// flight so that it does not raise the register count of the vector path.
__device__ __forceinline__ uint4 load_piece(const unsigned short* __restrict__ p, int valid, bool vec) {
    if (vec) return __ldg(reinterpret_cast<const uint4*>(p));   // callers pass valid > 0; vec: valid >= 8
    unsigned long long lo = 0, hi = 0;
#pragma unroll 1
    for (int k = 0; k < 4; ++k) {
        if (k < valid) lo |= (unsigned long long)__ldg(p + k) << (16 * k);
        if (k + 4 < valid) hi |= (unsigned long long)__ldg(p + k + 4) << (16 * k);
    }
    return make_uint4((unsigned)lo, (unsigned)(lo >> 32), (unsigned)hi, (unsigned)(hi >> 32));
}

__device__ __forceinline__ float bf16_lo(unsigned w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf16_hi(unsigned w) { return __uint_as_float(w & 0xffff0000u); }

template <int HDP>
__device__ __forceinline__ void run(const Args& a, unsigned short (*vbuf)[ATT_VBUF_ELEMS], float (*logit)[32],
                                    float (*lmax)[32], float (*wmax)[8], float2 (*svals)[32]) {
    using S = Shape<HDP>;
    constexpr int E = S::E, P = S::PIECES, G = S::G, TPW = S::TPW, CT = S::CT;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int hd = a.hd, bs = a.bs;
    const int nch = (int)((a.n_tok + CT - 1) / CT);

    // Stage A roles: token `slot` of the chunk, dims [part*E, part*E + E).
    const int slot = tid / G, part = tid % G;
    const bool loader = warp < ATT_A_WARPS && part * E < hd;
    float q[E];
#pragma unroll
    for (int e = 0; e < E; ++e) {
        const int d = part * E + e;
        q[e] = (loader && d < hd) ? __uint_as_float((unsigned)__ldg(a.q + a.state * hd + d) << 16) : 0.0f;
    }
    const float scale = rsqrtf((float)hd);

    // Even and odd chunks each have their own register set, (entry, slot) tracker and page id, so a
    // chunk's page id is loaded two steps before its rows, and its rows two steps before their use; no
    // register that a load is still filling is ever copied or selected (that would wait for the load).
    // Loads are issued unconditionally: a lane whose token lies past the tile reads the tile's first row
    // instead, and its logit is masked.
    const int ct2_div = 2 * CT / bs, ct2_mod = 2 * CT % bs;
    bool piece_ok[P];
#pragma unroll
    for (int c = 0; c < P; ++c) piece_ok[c] = loader && part * E + 8 * c < hd;
    const long long row0 = loader ? (long long)__ldg(a.blocks) * a.blk + part * E : 0;
    auto page_of = [&](int b) { return __ldg(a.blocks + min(b, a.n_blocks - 1)); };
    auto load_chunk = [&](uint4 (&kd)[P], uint4 (&vd)[P], int& pid, int& b, int& t) {
        const bool ok = b < a.n_blocks - 1 || (b == a.n_blocks - 1 && t < a.last_slots);
        const long long row = ok ? (long long)pid * a.blk + (long long)t * a.tok + part * E : row0;
#pragma unroll
        for (int c = 0; c < P; ++c) {
            if (piece_ok[c]) {   // lanes and pieces past head_dim keep the zeros they start with
                kd[c] = load_piece(a.k + row + 8 * c, hd - part * E - 8 * c, a.vec);
                vd[c] = load_piece(a.v + row + 8 * c, hd - part * E - 8 * c, a.vec);
            }
        }
        b += ct2_div;
        t += ct2_mod;
        if (t >= bs) { t -= bs; b += 1; }
        pid = page_of(b);
    };

    // Stage C roles: output dims.
    const int d0 = S::PAIRS ? 2 * tid : tid;
    const bool owner = d0 < hd;
    const bool owner1 = S::PAIRS && d0 + 1 < hd;
    float o0 = 0.0f, o1 = 0.0f, l_run = 0.0f, m_run = 0.0f;
    if (owner) o0 = a.o[a.state * hd + d0];
    if (owner1) o1 = a.o[a.state * hd + d0 + 1];
    if (tid == 0) l_run = a.l[a.state];
    if (warp == ATT_SCAN_WARP) m_run = a.m[a.state];

    auto step = [&](int i, uint4 (&kc)[P], uint4 (&vc)[P], int& pid, int& pb, int& pt) {
        // A (chunk i): stage V, logits, running max inside the warp, then load chunk i+2.
        if (i < nch && warp < ATT_A_WARPS) {
            const int n = (int)min((long long)CT, a.n_tok - (long long)i * CT);
            if (loader)
#pragma unroll
                for (int c = 0; c < P; ++c)
                    *reinterpret_cast<uint4*>(&vbuf[i % 3][slot * HDP + part * E + 8 * c]) = vc[c];
            float even = 0.0f, odd = 0.0f;   // this lane's dims, in order, even and odd ones apart
#pragma unroll
            for (int c = 0; c < P; ++c) {
                const uint4 w = kc[c];
                const float* qc = q + 8 * c;
                even = fmaf(qc[0], bf16_lo(w.x), even);
                odd = fmaf(qc[1], bf16_hi(w.x), odd);
                even = fmaf(qc[2], bf16_lo(w.y), even);
                odd = fmaf(qc[3], bf16_hi(w.y), odd);
                even = fmaf(qc[4], bf16_lo(w.z), even);
                odd = fmaf(qc[5], bf16_hi(w.z), odd);
                even = fmaf(qc[6], bf16_lo(w.w), even);
                odd = fmaf(qc[7], bf16_hi(w.w), odd);
            }
            float dot = even + odd;
#pragma unroll
            for (int off = G / 2; off > 0; off >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, off);
            const float x = dot * scale;
            float run_max = slot < n ? x : -INFINITY;   // inclusive max over this warp's tokens up to here
#pragma unroll
            for (int off = G; off < 32; off <<= 1) {
                const float y = __shfl_up_sync(0xffffffffu, run_max, off);
                if (lane >= off) run_max = fmaxf(run_max, y);
            }
            if (part == 0 && slot < n) {
                logit[i & 1][slot] = x;
                lmax[i & 1][slot] = run_max;
            }
            if (lane == 31) wmax[i & 1][warp] = run_max;
            if (i + 2 < nch) load_chunk(kc, vc, pid, pb, pt);
        }
        // B (chunk i-1, warp 7): running max across warps, then the two exponentials of every token.
        if (i >= 1 && i <= nch && warp == ATT_SCAN_WARP) {
            const int k = i - 1, b = k & 1;
            const int n = (int)min((long long)CT, a.n_tok - (long long)k * CT);
            const int j = lane < n ? lane : 0;
            const int w = j / TPW;
            float before = -INFINITY, total = -INFINITY;   // max over earlier warps' tokens / all tokens
#pragma unroll
            for (int u = 0; u < ATT_A_WARPS; ++u) {
                const float mu = wmax[b][u];
                total = fmaxf(total, mu);
                before = fmaxf(before, u < w ? mu : -INFINITY);
            }
            const float x = logit[b][j];
            const float mj = fmaxf(m_run, fmaxf(before, lmax[b][j]));        // max(m, logit_0..j)
            const float mp = fmaxf(m_run, j % TPW ? fmaxf(before, lmax[b][j - 1]) : before);   // ..j-1
            if (lane < n) svals[b][lane] = make_float2(__expf(mp - mj), __expf(x - mj));
            m_run = fmaxf(m_run, total);
        }
        // C (chunk i-2): O[d] = fma(O[d], s_old, V[d]*s_new) token by token; thread 0 also carries l.
        if (i >= 2 && owner) {
            const int k = i - 2;
            const int n = (int)min((long long)CT, a.n_tok - (long long)k * CT);
            const float2* sv = svals[k & 1];
            const unsigned short* vb = vbuf[k % 3];
            auto apply = [&](int j) {
                const float2 s = sv[j];
                if (S::PAIRS) {
                    const unsigned v2 = *reinterpret_cast<const unsigned*>(&vb[j * HDP + d0]);
                    o0 = fmaf(o0, s.x, bf16_lo(v2) * s.y);
                    o1 = fmaf(o1, s.x, bf16_hi(v2) * s.y);
                } else {
                    o0 = fmaf(o0, s.x, __uint_as_float((unsigned)vb[j * HDP + d0] << 16) * s.y);
                }
                if (tid == 0) l_run = fmaf(l_run, s.x, s.y);
            };
            if (n == CT) {   // every chunk but the tile's last: fully unrolled
#pragma unroll
                for (int j = 0; j < CT; ++j) apply(j);
            } else {
#pragma unroll 4
                for (int j = 0; j < n; ++j) apply(j);
            }
        }
        __syncthreads();
    };

    uint4 ka[P], va[P], kb[P], vb_[P];
#pragma unroll
    for (int c = 0; c < P; ++c) ka[c] = va[c] = kb[c] = vb_[c] = make_uint4(0u, 0u, 0u, 0u);
    int pba = slot / bs, pta = slot % bs;                        // even chunks: this lane's token in chunk 0
    int pbb = (slot + CT) / bs, ptb = (slot + CT) % bs;          // odd chunks: in chunk 1
    int pida = page_of(pba), pidb = page_of(pbb);
    load_chunk(ka, va, pida, pba, pta);
    if (nch > 1) load_chunk(kb, vb_, pidb, pbb, ptb);
    for (int i = 0; i < nch + 2; i += 2) {
        step(i, ka, va, pida, pba, pta);
        if (i + 1 < nch + 2) step(i + 1, kb, vb_, pidb, pbb, ptb);
    }

    if (owner) a.o[a.state * hd + d0] = o0;
    if (owner1) a.o[a.state * hd + d0 + 1] = o1;
    if (tid == 0) a.l[a.state] = l_run;
    if (tid == ATT_SCAN_WARP * 32) a.m[a.state] = m_run;
}

}  // namespace

extern "C" __global__ void __launch_bounds__(ATT_THREADS, 2)
paged_decode_attn_tiled(const __nv_bfloat16* __restrict__ Q, const __nv_bfloat16* __restrict__ K_pool,
                        const __nv_bfloat16* __restrict__ V_pool, const int* __restrict__ tile_blocks,
                        const int* __restrict__ tile_block_counts, float* __restrict__ m_state,
                        float* __restrict__ l_state, float* __restrict__ o_state, int num_q_heads,
                        int num_kv_heads, int head_dim, int block_size, int tile_capacity, int gqa_ratio,
                        long long blk_stride, long long tok_stride, long long kvh_stride,
                        int last_block_valid_slots) {
    __shared__ __align__(16) unsigned short vbuf[3][ATT_VBUF_ELEMS];
    __shared__ float logit[2][32], lmax[2][32], wmax[2][8];
    __shared__ __align__(16) float2 svals[2][32];

    const int seq = blockIdx.x, qh = blockIdx.y;
    if (head_dim <= 0 || head_dim > ATT_MAX_HD || block_size <= 0 || gqa_ratio <= 0 || tile_capacity < 0) return;
    const int kh = qh / gqa_ratio;
    if (kh >= num_kv_heads) return;

    // Tokens of this tile: every slot of every entry, except the last entry's min(lbvs, bs) slots.
    int n_blocks = tile_block_counts[seq];
    n_blocks = n_blocks < 0 ? 0 : (n_blocks > tile_capacity ? tile_capacity : n_blocks);
    const int last_slots = last_block_valid_slots < 0 ? 0 : min(last_block_valid_slots, block_size);
    const long long n_tok = n_blocks == 0 ? 0 : (long long)(n_blocks - 1) * block_size + last_slots;
    if (n_tok <= 0) return;   // nothing to attend: the state stays as it is

    Args a;
    a.q = reinterpret_cast<const unsigned short*>(Q);
    a.k = reinterpret_cast<const unsigned short*>(K_pool) + kh * kvh_stride;
    a.v = reinterpret_cast<const unsigned short*>(V_pool) + kh * kvh_stride;
    a.blocks = tile_blocks + (long long)seq * tile_capacity;
    a.m = m_state;
    a.l = l_state;
    a.o = o_state;
    a.state = (long long)seq * num_q_heads + qh;
    a.blk = blk_stride;
    a.tok = tok_stride;
    a.hd = head_dim;
    a.bs = block_size;
    a.n_blocks = n_blocks;
    a.last_slots = last_slots;
    a.n_tok = n_tok;
    a.vec = (head_dim & 7) == 0 &&
            ((reinterpret_cast<unsigned long long>(a.k) | reinterpret_cast<unsigned long long>(a.v)) & 15) == 0 &&
            ((blk_stride | tok_stride) & 7) == 0;
    if (head_dim <= 64)
        run<64>(a, vbuf, logit, lmax, wmax, svals);
    else if (head_dim <= 128)
        run<128>(a, vbuf, logit, lmax, wmax, svals);
    else
        run<256>(a, vbuf, logit, lmax, wmax, svals);
}
