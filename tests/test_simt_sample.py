"""``ptx/sample.cu``'s ``sample_tokens`` compiled for the CPU and run through the SIMT harness (tests/simt) against
:mod:`hss.reference.sample`, staged (stage 1) and not (stage 0); and the harness itself on small kernels.

The sampled token may differ from the float64 reference's only where ``tests/test_sample.py``'s ``near_boundary``
allows it (docs/design.md §22: a decision within the f32 rounding of a boundary; the harness's ``expf`` is glibc's,
within that rule's 2 ulp of CUDA's); greedy and empty rows, counters, the history ring, flags and state words must
be exact, and the two stages must agree bit for bit (with different shared-memory poison and thread schedules).
The harness runs threads as fibers that switch only at barriers and warp calls: it finds barrier and shuffle
misuse, reads of uninitialised shared memory (the poison) and out-of-bounds accesses (guard pages); a race only
where the schedules give different results.
"""
from __future__ import annotations

import numpy as np
import pytest
import simt
from hypothesis import given, settings
from hypothesis import strategies as st
from test_sample import near_boundary, randn, ties_logits

from hss.decls import model as km
from hss.decls import sample as ks
from hss.model.sample import _params_words
from hss.reference import sample as ref

from helpers import BF16

FULL = 0xFFFFFFFF


@pytest.fixture(scope="module")
def sample_tokens() -> simt.Kernel:
    simt.require()
    return simt.build(simt.PTX_DIR / "sample.cu").kernel("sample_tokens", ks.SAMPLE_TOKENS)


@pytest.fixture(scope="module")
def model_argmax() -> simt.Kernel:
    simt.require()
    return simt.build(simt.PTX_DIR / "model.cu").kernel("model_argmax", km.MODEL_ARGMAX)


# -- sample_tokens ----------------------------------------------------------------------------------------------
def row_words(rng: np.random.Generator, p: dict) -> np.ndarray:
    """One params row: the checked parameter words (as the Sampler writes them), seed, step, count, sticky flags
    already set, and garbage in the unused words (which must stay)."""
    w = rng.integers(0, 2**32, ks.PARAM_WORDS, dtype=np.uint64).astype(np.uint32)
    w[: ks.P_PRESENCE + 1] = _params_words(p["temperature"], p["top_k"], p["top_p"], p["min_p"],
                                           p["repetition_penalty"], p["presence_penalty"])
    w[ks.P_SEED_LO], w[ks.P_SEED_HI] = p["seed"] & FULL, p["seed"] >> 32
    w[ks.P_STEP], w[ks.P_COUNT], w[ks.P_FLAGS] = p["step"], p["count"], p["flags"]
    return w


def run_sample(kernel: simt.Kernel, logits: np.ndarray, params: np.ndarray, history: np.ndarray, state: np.ndarray,
               stage: int, *, rows: np.ndarray | None = None, h: np.ndarray | None = None,
               weight: np.ndarray | None = None, stride: int = 0, advance: int = -1, poison: int = simt.POISON,
               schedule: str | int = "ascending") -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One launch over copies of params, history and state (returned), with sample_geometry's launch."""
    m, vocab = logits.shape
    params, history, state = params.copy(), history.copy(), state.copy()
    g = ks.sample_geometry(m, vocab, bool(stage))
    kernel(g.grid, g.block, g.shared, logits=logits, h=h, weight=weight, params=params, history=history, state=state,
           rows=rows, vocab=vocab, dim=0 if h is None else h.shape[1], history_cap=history.shape[1], m=m,
           state_stride=stride or m, advance=advance, stage=stage, poison=poison, schedule=schedule)
    return params, history, state


def expected(logits: np.ndarray, params: np.ndarray, history: np.ndarray, state: np.ndarray, got_state: np.ndarray,
             live: int, stride: int, advance: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The contract's outputs (sample.cu's step 5) from the reference's token of each live row; where the kernel's
    token differs, it must be within near_boundary's rule and the kernel's token is carried on."""
    params, history, state = params.copy(), history.copy(), state.copy()
    cap = history.shape[1]
    for r in range(live):
        w = params[r]
        p = ks.row_params(w)
        out = ref.sample_row(logits[r], p, history[r], int(w[ks.P_COUNT]), int(w[ks.P_STEP]))
        token = out.token
        if int(got_state[r]) != token:
            assert near_boundary(out, p), (r, int(got_state[r]), token, p)
            token = int(got_state[r])
        state[r] = token
        if advance >= 0:
            pos = np.int32(state[stride + r]) + np.int32(advance)
            state[stride + r], state[2 * stride + r] = pos, pos + np.int32(1)
        if cap:
            history[r, int(w[ks.P_COUNT]) % cap] = token
        w[ks.P_STEP] = (int(w[ks.P_STEP]) + 1) & FULL
        w[ks.P_COUNT] = (int(w[ks.P_COUNT]) + 1) & FULL
        w[ks.P_FLAGS] |= np.uint32(out.flags)
    return params, history, state


ROW = st.fixed_dictionaries({
    "temperature": st.one_of(st.just(0.0), st.floats(0.05, 3.0)),
    "top_k": st.one_of(st.just(0), st.integers(1, ks.CANDIDATES), st.sampled_from([1, 2, ks.CANDIDATES])),
    "top_p": st.one_of(st.just(1.0), st.floats(0.02, 1.0)),
    "min_p": st.one_of(st.just(0.0), st.floats(0.0, 0.6)),
    "repetition_penalty": st.one_of(st.just(1.0), st.floats(0.3, 3.0)),
    "presence_penalty": st.one_of(st.just(0.0), st.floats(-2.0, 2.0)),
    "seed": st.integers(0, 2**64 - 1),
    "step": st.integers(0, 2**32 - 1),
    "count": st.one_of(st.integers(0, 80), st.integers(0, 2**32 - 1)),
    "flags": st.integers(0, 7),
})
VOCABS = st.one_of(st.integers(1, 5000), st.sampled_from([1, 2, 8, 9, 1023, 1024, 1025, 8192, 8193]))


def make_logits(rng: np.random.Generator, m: int, vocab: int, kind: str) -> np.ndarray:
    """bf16 [m, vocab], no zeros: normal, exact ties (few distinct values), wide (masses underflow), or with NaN and
    -inf entries."""
    if kind == "ties":
        return rng.choice(np.array([-1.5, -0.25, 0.5, 0.625, 2.0], np.float32), (m, vocab)).astype(BF16)
    x = randn(rng, (m, vocab), 8.0 if kind == "wide" else 1.5)
    if kind == "specials":
        for r in range(m):
            x[r, rng.integers(0, vocab, rng.integers(0, vocab // 4 + 2))] = np.nan
            x[r, rng.integers(0, vocab, rng.integers(0, vocab // 4 + 2))] = -np.inf
    return x


@settings(max_examples=5 * settings().max_examples)
@given(m=st.integers(1, 3), vocab=VOCABS, cap=st.sampled_from([0, 1, 5, 64]), rows=st.lists(ROW, min_size=3,
       max_size=3), kind=st.sampled_from(["normal", "normal", "ties", "wide", "specials"]),
       live=st.sampled_from([None, 0, 1, 2, 5]), advance=st.sampled_from([-1, -1, 0, 3]), extra=st.integers(0, 2),
       seed=st.integers(0, 2**32 - 1))
def test_sample_tokens_matches_reference_in_both_stages(sample_tokens, m, vocab, cap, rows, kind, live, advance, extra,
                                                        seed):
    """Random rows of parameters, histories (ids outside the vocabulary included) and counters, a live-row count or
    none, plain token words or model state rows: the reference's tokens and every word step 5 names, rows past the
    live count and every other word untouched; stage 0 and stage 1 identical under different shared-memory poison
    and thread schedules (ascending, warp by warp descending, random)."""
    rng = np.random.default_rng(seed)
    logits = make_logits(rng, m, vocab, kind)
    params = np.stack([row_words(rng, p) for p in rows[:m]])
    history = rng.integers(-3, vocab + 3, (m, cap)).astype(np.int32)
    stride = m + extra
    state = rng.integers(-2**31, 2**31, 2 * stride + m if advance >= 0 else m, dtype=np.int64).astype(np.int32)
    state[stride:2 * stride] = rng.integers(0, 10**6, stride) if advance >= 0 else state[stride:2 * stride]
    rows_arr = None if live is None else np.array([live], np.int32)
    runs = [(0, 0xA5, "ascending"), (1, 0x00, "warps-descending"), (0, 0xFF, seed), (1, 0x5A, seed ^ 1)]
    outs = [run_sample(sample_tokens, logits, params, history, state, stage, rows=rows_arr, stride=stride,
                       advance=advance, poison=poison, schedule=schedule) for stage, poison, schedule in runs]
    for out in outs[1:]:
        assert all(a.tobytes() == b.tobytes() for a, b in zip(outs[0], out))
    n = m if live is None else min(live, m)
    want = expected(logits, params, history, state, outs[0][2], n, stride, advance)
    for name, got, w in zip(("params", "history", "state"), outs[0], want):
        assert np.array_equal(got, w), name


@pytest.mark.parametrize("stage", [0, 1])
def test_nan_and_inf_rules(sample_tokens, rng, stage):
    """NaN counts as -inf (FLAG_NAN); a +inf logit (also after penalties) is the greedy token, the first of them
    (FLAG_INF); no logit above -inf is token 0 (FLAG_EMPTY); flags are sticky."""
    vocab = 300
    logits = randn(rng, (6, vocab), 1.0)
    nan_at = rng.integers(0, vocab, 40)
    logits[0, nan_at] = np.nan
    logits[1, [5, 200]] = np.inf
    logits[2] = np.nan
    logits[3] = -np.inf
    logits[4] = -np.inf
    logits[4, 17] = np.nan
    logits[4, 250] = BF16(-3.0)
    logits[5, [9, 99]] = np.inf   # token 9 is in the history: inf / rp - pp is still inf
    p = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "repetition_penalty": 1.5,
         "presence_penalty": 0.5, "step": 3, "count": 1, "flags": 0}
    params = np.stack([row_words(rng, {**p, "seed": r + 5}) for r in range(6)])
    params[5, ks.P_FLAGS] = ks.FLAG_EMPTY
    history = np.full((6, 4), 9, np.int32)
    state = np.full(6, -7, np.int32)
    for _ in range(5):   # the next step draws anew (and the history grows)
        got_params, got_history, got_state = run_sample(sample_tokens, logits, params, history, state, stage)
        assert got_state[0] not in set(nan_at.tolist())
        assert got_state[1:].tolist() == [5, 0, 0, 250, 9]
        assert got_params[:, ks.P_FLAGS].tolist() == [ks.FLAG_NAN, ks.FLAG_INF, ks.FLAG_NAN | ks.FLAG_EMPTY,
                                                      ks.FLAG_EMPTY, ks.FLAG_NAN, ks.FLAG_INF | ks.FLAG_EMPTY]
        want = expected(logits, params, history, state, got_state, 6, 6, -1)
        for got, w in zip((got_params, got_history, got_state), want):
            assert np.array_equal(got, w)
        params, history = got_params, got_history


@given(m=st.integers(1, 3), vocab=st.sampled_from([100, 2048, 5003]), dim=st.sampled_from([8, 40, 577]),
       kind=st.sampled_from(["plain", "ties", "many"]), seed=st.integers(0, 2**32 - 1))
def test_temperature_zero_is_model_argmax(sample_tokens, model_argmax, m, vocab, dim, kind, seed):
    """Greedy rows with neutral penalties take model_argmax's token (near ties recomputed in f32 from h and the LM
    head), and advance the model state as it does, bit for bit, in both stages."""
    rng = np.random.default_rng(seed)
    h, weight, logits = ties_logits(rng, m, vocab, dim, kind)
    state = np.concatenate([np.full(m, -5), rng.integers(0, 100, m), np.zeros(2 * m)]).astype(np.int32)
    state[2 * m:3 * m] = state[m:2 * m] + 1
    p = {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "repetition_penalty": 1.0,
         "presence_penalty": 0.0, "step": 0, "count": 0, "flags": 0}
    params = np.stack([row_words(rng, {**p, "seed": r}) for r in range(m)])
    want = state.copy()
    g = km.argmax_geometry(m)
    model_argmax(g.grid, g.block, g.shared, logits=logits, h=h, weight=weight, vocab=vocab, dim=dim, state=want,
                 advance=1, m=m, state_stride=m, rows=None)
    for stage in (0, 1):
        _, _, got = run_sample(sample_tokens, logits, params, np.zeros((m, 8), np.int32), state[:3 * m], stage, h=h,
                               weight=weight, advance=1)
        assert got.tolist() == want[:3 * m].tolist()


@pytest.mark.parametrize("vocab", [49152, 151936])
def test_model_sized_vocabularies(sample_tokens, rng, vocab):
    """SmolLM2's and Qwen's vocabularies with llama.cpp's defaults and a long history: the reference's tokens, both
    stages alike (the harness has no shared-memory limit, so 151,936 tokens stage too)."""
    m, cap = 2, 64
    p = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05, "repetition_penalty": 1.1,
         "presence_penalty": 0.0, "count": 200, "flags": 0}
    params = np.stack([row_words(rng, {**p, "seed": 77 + r, "step": r}) for r in range(m)])
    history = rng.integers(0, vocab, (m, cap)).astype(np.int32)
    logits = randn(rng, (m, vocab), 2.0)
    state = np.full(m, -1, np.int32)
    outs = [run_sample(sample_tokens, logits, params, history, state, stage) for stage in (0, 1)]
    assert all(np.array_equal(a, b) for a, b in zip(*outs))
    want = expected(logits, params, history, state, outs[0][2], m, m, -1)
    assert all(np.array_equal(a, b) for a, b in zip(outs[0], want))


@pytest.mark.parametrize("crowd", [0, 20, 3000])
def test_top_k_whether_or_not_the_first_round_settles_it(sample_tokens, rng, crowd):
    """top_k 40 where the 40th key's first-round bin holds few keys (the candidates sorted from that round) or more
    than SAMPLE_CANDIDATES with the bins above it (``crowd`` equal logits just under the 30 largest: the later
    rounds and the ties' ranks): the reference's token, both stages alike."""
    m, vocab, cap = 3, 5000, 8
    logits = randn(rng, (m, vocab), 1.5)
    for r in range(m):
        top = rng.choice(vocab, 30 + crowd, replace=False)
        logits[r, top[:30]] = (6.0 + rng.random(30)).astype(BF16)
        logits[r, top[30:]] = BF16(5.5)
    p = {"temperature": 1.0, "top_k": 40, "top_p": 1.0, "min_p": 0.0, "repetition_penalty": 1.0,
         "presence_penalty": 0.0, "count": 0, "flags": 0}
    params = np.stack([row_words(rng, {**p, "seed": 5 + r, "step": 3 * r}) for r in range(m)])
    history = np.zeros((m, cap), np.int32)
    state = np.full(m, -1, np.int32)
    outs = [run_sample(sample_tokens, logits, params, history, state, stage) for stage in (0, 1)]
    assert all(np.array_equal(a, b) for a, b in zip(*outs))
    want = expected(logits, params, history, state, outs[0][2], m, m, -1)
    assert all(np.array_equal(a, b) for a, b in zip(outs[0], want))


def test_launch_contract_is_checked(sample_tokens):
    """The declaration holds harness launches to sample_geometry and its extents, as the emulator does."""
    logits = randn(np.random.default_rng(0), (1, 100), 1.0)
    params, history, state = np.zeros((1, 16), np.uint32), np.zeros((1, 4), np.int32), np.zeros(1, np.int32)
    args = dict(logits=logits, h=None, weight=None, params=params, history=history, state=state, rows=None,
                vocab=100, dim=0, history_cap=4, m=1, state_stride=1, advance=-1, stage=0)
    with pytest.raises(simt.SimtError, match="dynamic shared memory"):
        sample_tokens(1, ks.THREADS, 0, **args)
    with pytest.raises(simt.SimtError, match="logits holds 200 bytes, the launch uses 400"):
        sample_tokens(*ks.sample_geometry(1, 200), **{**args, "vocab": 200})
    with pytest.raises(simt.SimtError, match="declaration says"):
        simt.build(simt.PTX_DIR / "sample.cu").kernel("sample_tokens", km.MODEL_ARGMAX)


# -- the harness ------------------------------------------------------------------------------------------------
HARNESS = r"""
#include "qsa_common.cuh"   // qsa_dynamic_smem_bytes: inline PTX the harness rewrites

// out[16 t + j]: warp call j of thread t (7 t + 1 shuffled); dout / uout: 8-byte shuffles.
extern "C" __global__ void warp_calls(int* out, double* dout, unsigned long long* uout, int src, int delta,
                                      int lane_mask) {
    const int t = threadIdx.x;
    const int v = 7 * t + 1;
    int* o = out + 16 * t;
    o[0] = __shfl_sync(0xffffffffu, v, src);
    o[1] = __shfl_sync(0xffffffffu, v, src, 16);
    o[2] = __shfl_up_sync(0xffffffffu, v, delta);
    o[3] = __shfl_up_sync(0xffffffffu, v, delta, 8);
    o[4] = __shfl_down_sync(0xffffffffu, v, delta);
    o[5] = __shfl_down_sync(0xffffffffu, v, delta, 16);
    o[6] = __shfl_xor_sync(0xffffffffu, v, lane_mask);
    o[7] = __shfl_xor_sync(0xffffffffu, v, lane_mask, 8);
    o[8] = (int)__ballot_sync(0xffffffffu, t % 3 == 0);
    o[9] = __any_sync(0xffffffffu, t == 37);
    o[10] = __all_sync(0xffffffffu, t != 37);
    o[11] = __syncthreads_count(t % 5 == 0);
    o[12] = __syncthreads_or(t == (int)blockDim.x - 1);
    o[13] = __syncthreads_and(t != 40);
    o[14] = (int)__match_any_sync(0xffffffffu, t % 4);
    o[15] = (int)__reduce_add_sync(0xffffffffu, (unsigned)t);
    dout[t] = __shfl_xor_sync(0xffffffffu, 0.5 * t + 1e-300, 1);
    uout[t] = __shfl_sync(0xffffffffu, (unsigned long long)t << 40 | (unsigned)t, 31 - (t & 31));
}

// Threads t >= live (whole warps) return at once; the others sum x over the CTA (barriers the returned threads no
// longer count in) and update shared and global counters with atomics. sums [blocks], counters [blocks, 8],
// total / big / fsum / imax / imin: over the grid.
extern "C" __global__ void reduce_and_atomics(const int* x, int* sums, unsigned* counters, int* total,
                                              unsigned long long* big, float* fsum, int* imax, int* imin, int live) {
    __shared__ int warp_sums[32];
    __shared__ unsigned c[8];
    const int t = threadIdx.x;
    if (t >= live) return;
    const int b = blockIdx.x + gridDim.x * blockIdx.y;
    if (t < 8) c[t] = (t == 2 || t == 4) ? 0xffffffffu : 0u;
    __syncthreads();
    const int v = x[b * blockDim.x + t];
    int s = v;
    for (int off = 16; off > 0; off >>= 1) s += __shfl_down_sync(0xffffffffu, s, off);
    if ((t & 31) == 0) warp_sums[t >> 5] = s;
    atomicAdd(&c[0], (unsigned)v);
    atomicMax(&c[1], (unsigned)v);
    atomicMin(&c[2], (unsigned)v);
    atomicOr(&c[3], 1u << (t & 31));
    atomicAnd(&c[4], ~(1u << (t % 29)));
    unsigned old = c[5], seen;
    do { seen = old; old = atomicCAS(&c[5], seen, seen + 2u); } while (old != seen);
    atomicExch(&c[6], (unsigned)t);
    atomicAdd(&c[7], atomicAdd(&c[7], 0u) == 0u ? 1u : 0u);
    atomicAdd(total, v);
    atomicAdd(big, (unsigned long long)v << 33);
    atomicAdd(fsum, (float)v);
    atomicMax(imax, v - 500);
    atomicMin(imin, v - 500);
    __syncthreads();
    if (t == 0) {
        int all = 0;
        for (int w = 0; w < (live + 31) / 32; ++w) all += warp_sums[w];
        sums[b] = all;
        for (int j = 0; j < 8; ++j) counters[8 * b + j] = c[j];
    }
}

// Each CTA first reads shared memory it never wrote (the poison), then writes it for the next CTA to not see.
extern "C" __global__ void uninitialised(unsigned* out) {
    __shared__ unsigned s[4];
    extern __shared__ __align__(16) unsigned char dyn[];
    const unsigned n = qsa_dynamic_smem_bytes();
    if (threadIdx.x == 0) {
        out[3 * blockIdx.x] = s[threadIdx.x];
        out[3 * blockIdx.x + 1] = dyn[0] | (unsigned)dyn[n - 1] << 8;
        out[3 * blockIdx.x + 2] = n;
    }
    __syncthreads();
    s[0] = 12345u;
    dyn[0] = 7;
    dyn[n - 1] = 9;
}

// Every thread's indices: out[(block linear) * threads + (thread linear)] = packed block, thread and sizes.
extern "C" __global__ void indices(int4* out) {
    const int bl = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
    const int tl = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
    out[bl * blockDim.x * blockDim.y * blockDim.z + tl] = make_int4(
        blockIdx.x | blockIdx.y << 8 | blockIdx.z << 16, threadIdx.x | threadIdx.y << 10 | threadIdx.z << 20,
        gridDim.x | gridDim.y << 8 | gridDim.z << 16, blockDim.x | blockDim.y << 10 | blockDim.z << 20);
}

// A missing barrier: thread 0 writes what every thread reads (right only if thread 0 happens to run first).
extern "C" __global__ void racy(int* out) {
    __shared__ int x;
    if (threadIdx.x == 0) x = 42;
    out[threadIdx.x] = x;
}

// ---- kernel bugs the harness reports -----------------------------------------------------------------------
extern "C" __global__ void partial_warp(int* out) {
    if (threadIdx.x == 5) return;
    out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, (int)threadIdx.x, 1);
}
extern "C" __global__ void divergent_barrier(int* out) {
    if (threadIdx.x < 64) {
        __syncthreads();
    } else {
        __syncthreads();
    }
    out[threadIdx.x] = 1;
}
extern "C" __global__ void shuffle_against_barrier(int* out) {
    if ((threadIdx.x & 31) == 0) __syncthreads();
    out[threadIdx.x] = __shfl_sync(0xffffffffu, 1, 0);
}
extern "C" __global__ void half_mask(int* out) { out[threadIdx.x] = __shfl_sync(0xffffu, 1, 0); }
extern "C" __global__ void read_past(const int* x, int* out, int n) { out[threadIdx.x] = x[n + threadIdx.x]; }
extern "C" __global__ void write_input(const int* x) { const_cast<int*>(x)[threadIdx.x] = 1; }
extern "C" __global__ void write_past_dynamic(int n) {
    extern __shared__ unsigned char d[];
    if (threadIdx.x == 0) d[n] = 1;
}
extern "C" __global__ void divide(int* out, int n) { out[threadIdx.x] = 100 / n; }
extern "C" __global__ void inline_ptx(float* out) {
    float r;
    asm("lg2.approx.f32 %0, %1;" : "=f"(r) : "f"(out[0]));
    out[0] = r;
}
"""


@pytest.fixture(scope="module")
def harness() -> simt.Program:
    simt.require()
    return simt.build_source(HARNESS, "harness.cu")


def shfl_source(op: str, lane: int, b: int, width: int) -> int:
    """CUDA's __shfl*_sync source lane (its own lane where the source falls outside its width segment)."""
    seg = lane // width * width
    j = {"idx": seg + b % width, "up": lane - b, "down": lane + b, "xor": lane ^ b}[op]
    return j if seg <= j < seg + width or (op == "xor" and j < seg) else lane


@given(warps=st.integers(1, 32), src=st.integers(-40, 40), delta=st.integers(0, 40), lane_mask=st.integers(0, 40))
def test_warp_calls_and_block_votes(harness, warps, src, delta, lane_mask):
    n = 32 * warps
    out, dout, uout = np.full(16 * n, -1, np.int32), np.zeros(n), np.zeros(n, np.uint64)
    harness.kernel("warp_calls")(1, n, 0, out, dout, uout, src, delta, lane_mask)
    out = out.reshape(n, 16)
    t = np.arange(n)
    base = t // 32 * 32
    calls = [("idx", src, 32), ("idx", src, 16), ("up", delta, 32), ("up", delta, 8), ("down", delta, 32),
             ("down", delta, 16), ("xor", lane_mask, 32), ("xor", lane_mask, 8)]
    for j, (op, b, width) in enumerate(calls):
        want = [7 * (base[i] + shfl_source(op, i % 32, b, width)) + 1 for i in t]
        assert out[:, j].tolist() == want, (op, b, width)
    ballot = np.array([sum(1 << lane for lane in range(32) if (w * 32 + lane) % 3 == 0) for w in range(warps)])
    assert (out[:, 8].astype(np.uint32) == ballot[t // 32].astype(np.uint32)).all()
    assert out[:, 9].tolist() == [int(w == 1) for w in t // 32]
    assert out[:, 10].tolist() == [int(w != 1) for w in t // 32]
    assert (out[:, 11] == (t % 5 == 0).sum()).all() and (out[:, 12] == 1).all()
    assert (out[:, 13] == int(n <= 40)).all()
    assert (out[:, 14].astype(np.uint32) == np.uint32(0x11111111) << (t % 4).astype(np.uint32)).all()
    assert (out[:, 15] == [sum(range(b0, b0 + 32)) for b0 in base]).all()
    assert dout.tolist() == (0.5 * (t ^ 1) + 1e-300).tolist()
    assert uout.tolist() == [int(base[i] + 31 - i % 32) << 40 | int(base[i] + 31 - i % 32) for i in t]


@pytest.mark.parametrize("live", [32, 96, 1024])
def test_early_return_and_atomics(harness, rng, live):
    """Returned threads drop out of later barriers; shared and global atomics over the live threads of a 2-D grid."""
    grid, n = (3, 2), 1024
    blocks = grid[0] * grid[1]
    x = rng.integers(0, 1000, (blocks, n)).astype(np.int32)
    sums, counters = np.full(blocks, -1, np.int32), np.zeros((blocks, 8), np.uint32)
    total, big, fsum = np.zeros(1, np.int32), np.zeros(1, np.uint64), np.zeros(1, np.float32)
    imax, imin = np.full(1, -2**31, np.int32), np.full(1, 2**31 - 1, np.int32)
    harness.kernel("reduce_and_atomics")(grid, n, 0, x, sums, counters, total, big, fsum, imax, imin, live)
    xl = x[:, :live].astype(np.int64)
    assert sums.tolist() == xl.sum(1).tolist()
    t = np.arange(live)
    for b in range(blocks):
        c = counters[b]
        assert c[0] == xl[b].sum() and c[1] == xl[b].max() and c[2] == xl[b].min()
        assert c[3] == np.bitwise_or.reduce(np.uint32(1) << (t % 32).astype(np.uint32))
        assert c[4] == np.bitwise_and.reduce(~(np.uint32(1) << (t % 29).astype(np.uint32)))
        assert c[5] == 2 * live and c[6] < live and c[7] == 1
    assert total[0] == xl.sum() and big[0] == xl.sum() << 33 and fsum[0] == float(xl.sum())
    assert imax[0] == xl.max() - 500 and imin[0] == xl.min() - 500


@pytest.mark.parametrize("poison", [0x00, 0xA5, 0xFF])
def test_shared_memory_is_poisoned_before_every_cta(harness, poison):
    out = np.zeros(3 * 4, np.uint32)
    harness.kernel("uninitialised")(4, 64, 40, out, poison=poison)
    p = poison | poison << 8
    assert out.reshape(4, 3).tolist() == [[p | p << 16, p, 40]] * 4


def test_schedules_expose_a_missing_barrier(harness):
    """Threads switch only at barriers, so a race shows as a result that depends on the schedule."""
    runs = {}
    for schedule in (*simt.SCHEDULES, 7):
        out = np.zeros(256, np.int32)
        harness.kernel("racy")(1, 256, 0, out, poison=0, schedule=schedule)
        runs[schedule] = (out == 42).sum()
    assert runs == {"ascending": 256, "descending": 1, "warps": 256, "warps-descending": 32, 7: runs[7]}
    assert 1 <= runs[7] < 256
    with pytest.raises(simt.SimtError, match="schedule"):
        harness.kernel("racy")(1, 32, 0, np.zeros(32, np.int32), schedule="random")


def test_indices_of_a_3d_launch(harness):
    grid, block = (3, 2, 2), (8, 4, 2)
    nb, nt = 12, 64
    out = np.zeros((nb * nt, 4), np.int32)
    harness.kernel("indices")(grid, block, 0, out)
    want = [[bx | by << 8 | bz << 16, tx | ty << 10 | tz << 20, 3 | 2 << 8 | 2 << 16, 8 | 4 << 10 | 2 << 20]
            for bz in range(2) for by in range(2) for bx in range(3)
            for tz in range(2) for ty in range(4) for tx in range(8)]
    assert out.tolist() == want


@pytest.mark.parametrize("name, args, shared, message", [
    ("partial_warp", (np.zeros(64, np.int32),), 0,
     r"thread \(5, 0, 0\): returned while 5 lanes of warp 0 wait at __shfl_xor_sync .*: a partial warp"),
    ("divergent_barrier", (np.zeros(128, np.int32),), 0, r"barrier in divergent code"),
    ("shuffle_against_barrier", (np.zeros(64, np.int32),), 0, r"lane 0 of warp 0 waits at __syncthreads"),
    ("half_mask", (np.zeros(64, np.int32),), 0, r"mask 0x0000ffff: the harness supports full-warp masks only"),
    ("read_past", (np.zeros(64, np.int32), np.zeros(64, np.int32), 64), 0,
     r"invalid memory access .*\(byte 256 of x, which holds 256\)"),
    ("write_past_dynamic", (10,), 10, r"a write past the 10 bytes of dynamic shared memory"),
    ("write_past_dynamic", (4096,), 4096, r"past the 4096 bytes of dynamic shared memory"),
    ("divide", (np.zeros(64, np.int32), 0), 0, r"integer division by zero"),
    ("inline_ptx", (np.zeros(1, np.float32),), 0, r"inline PTX `lg2.approx.f32 %0, %1` \(harness.cu:\d+\)"),
])
def test_kernel_bugs_are_reported(harness, name, args, shared, message):
    with pytest.raises(simt.SimtError, match=message):
        harness.kernel(name)(1, 64 if name != "divergent_barrier" else 128, shared, *args)
    out = np.zeros((64, 4), np.int32)   # the runtime is whole again
    harness.kernel("indices")(1, 64, 0, out)
    assert out[:, 1].tolist() == list(range(64))


def test_writes_to_read_only_arrays_are_reported(harness):
    x = np.zeros(64, np.int32)
    x.flags.writeable = False
    with pytest.raises(simt.SimtError, match="wrote to x, a read-only array"):
        harness.kernel("write_input")(1, 64, 0, x)


def test_rewrite_keeps_lines():
    src = ('extern __shared__ __align__(16) unsigned char buf[];\n// asm("not code");\n'
           'asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\\n"\n :: "r"(s), "l"(g) : "memory");\nx;\n'
           'asm volatile("prefetch.global.L2::evict_last [%0];" ::"l"(p));\n'
           'asm volatile("red.global.add.u32 [%0], 1;" ::"l"(p));\n')
    out = simt.rewrite(src)
    assert out.count("\n") == src.count("\n")
    assert "unsigned char* const buf = static_cast<unsigned char*>(::simt::dynamic_shared());" in out
    assert '// asm("not code");' in out and out.splitlines()[2] == "::simt::cp_async16((uint32_t)(s), (g))"
    assert out.splitlines()[4] == "x;" and out.splitlines()[5] == "(void)0;"
    assert out.splitlines()[6].startswith('::simt::unsupported("inline PTX `red.global.add.u32 [%0], 1`"')
