"""``ptx/predictor_score.cu``'s block scores compiled for the CPU and run through the SIMT harness (tests/simt: mma.sync
as warp calls, ``hss_headscore.cuh``'s .ftz arithmetic flushed to zero), under the rules of test_predictor:

* ``predictor_score``: the tensor-core path (block_size % 16 == 0, r in 32..128, gqa <= 8, 16-byte aligned) and the
  general path (the same data 2 bytes off alignment, and other shapes) within the derived bound of the float64
  reference (``score_tolerance``), NaN dots skipped, all-NaN blocks -inf, the bound shown to bite; any warps per CTA
  and thread schedule give the same bits;
* ``predictor_score_heads`` within its bound, then ``predictor_head_max`` exact and ``predictor_head_combine`` within
  the f32 rule of the float64 reference of the max kernel's output.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import simt
from test_predictor import FAST_SHAPES, check_scores, drop_best_key_heads, heads_tolerance, randn

from hss._util import ceil_div
from hss.decls import predictor as kp
from hss.reference import predictor as ref

from helpers import assert_close, violations


@pytest.fixture(scope="module")
def program() -> simt.Program:
    simt.require()
    return simt.build(simt.PTX_DIR / "predictor_score.cu")


def aligned_copy(x: np.ndarray, offset: int) -> np.ndarray:
    """A view of ``x``'s bytes starting ``offset`` bytes past a 16-byte boundary (its own buffer)."""
    raw = np.zeros(x.nbytes + offset + 16, np.uint8)
    start = (-raw.ctypes.data) % 16 + offset
    view = raw[start:start + x.nbytes].view(x.dtype).reshape(x.shape)
    view[...] = x
    return view


def scores(program, q: np.ndarray, k: np.ndarray, warps: int = 1, offset: int = 0,
           schedule: str | int = "ascending") -> np.ndarray:
    n, nkv, bs, r = k.shape
    nq = q.shape[0]
    out = np.full(n + 1, np.nan, np.float32)
    k_arg = aligned_copy(k, offset) if offset else k
    kernel = program.kernel("predictor_score", kp.PREDICTOR_SCORE)
    kernel(ceil_div(n, warps), 32 * warps, 0, q, int(k_arg.ctypes.data) if offset else k, out, nq, nkv, bs, r,
           nq // nkv, n, schedule=schedule)
    assert np.isnan(out[n]), "predictor_score wrote past num_blocks"
    return out[:n]


@pytest.mark.parametrize("nq, nkv, r, bs", FAST_SHAPES)
@pytest.mark.parametrize("offset", [0, 2], ids=["aligned", "misaligned"])
def test_score_both_paths_match_the_float64_reference(program, rng, nq, nkv, r, bs, offset):
    for std in (1.0, 1 / math.sqrt(128)):
        q = randn(rng, (nq, r), std)
        k = randn(rng, (5, nkv, bs, r), std)
        got = scores(program, q, k, offset=offset)
        check_scores(got, q, k, nq // nkv, rng, f"scores (std {std:.3g}, offset {offset})")


def test_score_bits_do_not_depend_on_the_warps_or_the_schedule(program, rng):
    for nq, nkv, r, bs in ((32, 8, 32, 16), (6, 2, 24, 5)):   # the tensor-core path, the general path
        q, k = randn(rng, (nq, r), 1.0), randn(rng, (11, nkv, bs, r), 1.0)
        first = scores(program, q, k)
        for warps, schedule in ((3, "descending"), (8, int(rng.integers(2**31)))):
            assert scores(program, q, k, warps, schedule=schedule).tobytes() == first.tobytes(), (nq, warps)


def test_score_nan_semantics(program, rng):
    for bs, r in ((16, 32), (5, 24)):
        q = randn(rng, (8, r), 1.0)
        k = randn(rng, (6, 2, bs, r), 1.0)
        k[0] = np.nan                           # every key NaN: -inf
        k[1, 0, 3] = np.nan                     # one key NaN: skipped
        k[2, 1, :, 5] = np.nan                  # every key of kv head 1 NaN: kv head 0 decides
        got = scores(program, q, k)
        assert got[0] == -np.inf and np.isfinite(got[1:]).all()
        check_scores(got, q, k, 4, rng, f"scores with NaN keys (bs {bs}, r {r})")


def test_head_scores_max_and_combine(program, rng):
    nq, nkv, bs, r, n = 8, 2, 16, 32, 9
    q, k = randn(rng, (nq, r), 1.0), randn(rng, (n, nkv, bs, r), 1.0)
    k[3, 1, 4] = np.nan   # one key skipped
    hs = np.full((n, nq), np.nan, np.float32)
    program.kernel("predictor_score_heads", kp.PREDICTOR_SCORE_HEADS)(n, 32, 0, q, k, hs, nq, nkv, bs, r, nq // nkv, n)
    want = ref.predictor_score_heads(q, k, nq // nkv)
    tol = heads_tolerance(q, k, nq // nkv, want)
    assert_close(hs, want, "f32", (0, 1), "head scores", tol=tol)
    mutated = drop_best_key_heads(q, k, nq // nkv, want, tol)
    assert violations(hs, mutated, "f32", (0, 1), tol=tol).any(), "head scores: the bound does not bite"
    head_max = np.full(nq, np.nan, np.float32)
    program.kernel("predictor_head_max", kp.PREDICTOR_HEAD_MAX)(nq, kp.HEAD_THREADS, 0, hs, head_max, nq, n)
    assert head_max.tobytes() == np.max(hs, axis=0).tobytes(), "a max is exact"
    exp2_scale = float(np.float32(math.log2(math.e) / 0.7))
    combined = np.full(n, np.nan, np.float32)
    program.kernel("predictor_head_combine", kp.PREDICTOR_HEAD_COMBINE)(
        ceil_div(n, kp.HEAD_THREADS), kp.HEAD_THREADS, 0, hs, head_max, combined, nq, n, exp2_scale)
    x = (hs.astype(np.float64) - head_max.astype(np.float64)) * exp2_scale
    ref_comb = np.exp2(x).sum(axis=1)
    assert_close(combined, ref_comb, "f32", (0,), "head combine")
    assert violations(combined, ref_comb - np.exp2(x[:, 0]), "f32", (0,)).any(), "combine: one head dropped passes"
