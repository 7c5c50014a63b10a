"""``ptx/qsa_device.cu``'s ``qsa_dev_topk`` compiled for the CPU and run through the SIMT harness (tests/simt) against
:mod:`hss.reference.qsa_device` (``step_tokens``) and the host ``select_tokens``: the docs/design.md §17.1 rule
exactly (score descending, block index ascending, NaN below every number, -inf above NaN, -0.0 == +0.0), rows that
fit a tile (keys in registers) and rows of more tiles with the dynamic key cache and without it (re-read scores),
which must agree bit for bit; nothing past a row's count written; pos advanced by one for the rows' slots only.
Every test runs on each build of the histogram's warp aggregation (``QSA_TOPK_HIST`` 0, 1, 2).
"""
from __future__ import annotations

import numpy as np
import pytest
import simt
from hypothesis import given, settings
from hypothesis import strategies as st
from test_qsa_device_kernels import KINDS, make_scores

from hss.decls import qsa_device as kd
from hss.qsa.select import select_tokens
from hss.reference import qsa_device as dref

POISON = -1   # tokens and counts start as 0xFFFFFFFF


@pytest.fixture(scope="module", params=[0, 1, 2], ids=lambda v: f"hist{v}")
def program(request) -> simt.Program:
    """The kernel file built with each way of adding a warp's counts (``QSA_TOPK_HIST``: 0 is the default build; 1
    and 2, kept to be timed against it, must give the same selections)."""
    simt.require()
    return simt.build(simt.PTX_DIR / "qsa_device.cu", defines={"QSA_TOPK_HIST": request.param})


@pytest.fixture(scope="module")
def topk(program) -> simt.Kernel:
    return program.kernel("qsa_dev_topk", kd.QSA_DEV_TOPK)


def run_topk(kernel: simt.Kernel, scores: np.ndarray, pos: np.ndarray, slots: np.ndarray, k: int, ratio: int,
             max_tokens: int, sel_cap: int, shared: int, poison: int = simt.POISON,
             schedule: str | int = "ascending") -> tuple[np.ndarray, ...]:
    """One launch (grid: a CTA per row of ``scores``) over poisoned tokens / counts; returns (tokens, counts, pos)."""
    rows, stride = scores.shape
    tokens, counts, pos = np.full((rows, sel_cap), POISON, np.int32), np.full(rows, POISON, np.int32), pos.copy()
    g = kd.topk_geometry(rows, stride)
    kernel(g.grid, g.block, shared, scores=scores, pos=pos, slots=slots, tokens=tokens, counts=counts,
           score_stride=stride, k_blocks=k, ratio=ratio, sel_cap=sel_cap, max_tokens=max_tokens, poison=poison,
           schedule=schedule)
    return tokens, counts, pos


def check_rows(scores, pos, slots, k, ratio, max_tokens, tokens, counts, after) -> None:
    """Every row against step_tokens and select_tokens exactly; poison past the count; pos moved for live slots."""
    moved = pos.copy()
    for r, s in enumerate(slots):
        if s < 0 or not 0 <= pos[s] < max_tokens:
            assert counts[r] == 0 and (tokens[r] == POISON).all(), r
            continue
        p = int(pos[s])
        want = dref.step_tokens(scores[r], p, ratio, k)
        assert np.array_equal(want, select_tokens(scores[r], k, ratio, p + 1))
        n = int(counts[r])
        assert n == want.size and np.array_equal(tokens[r, :n], want), (r, p, n, want.size)
        assert (tokens[r, n:] == POISON).all(), f"row {r} wrote past its count"
        moved[s] += 1
    assert after.tolist() == moved.tolist()


SIZES = st.one_of(st.integers(1, 3000), st.sampled_from([8191, 8192, 8193, 16385, 20000]))


@settings(max_examples=2 * settings().max_examples)
@given(n=SIZES, kind=st.sampled_from(KINDS), ratio=st.sampled_from([1, 2, 4]), rows=st.integers(1, 3),
       data=st.data())
def test_topk_matches_reference_with_and_without_the_key_cache(topk, n, kind, ratio, rows, data):
    """A batch of rows on permuted slots (one may be negative, or at max_tokens: count 0, no advance), each at its
    own position (selective or inert); launches with and without the key cache, under different shared-memory
    poison and thread schedules (ascending, warp by warp descending, random), all equal."""
    seed = data.draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    k = data.draw(st.one_of(st.integers(0, n), st.sampled_from(sorted({1, min(512, n), max(1, n - 1), n}))))
    max_tokens = n * ratio + data.draw(st.integers(0, ratio - 1))
    stride = max_tokens // ratio
    scores = np.stack([make_scores(rng, kind, stride) for _ in range(rows)])
    n_slots = rows + 2
    slots = rng.permutation(n_slots)[:rows].astype(np.int32)
    pos = rng.integers(0, max_tokens, n_slots).astype(np.int32)
    pos[slots[0]] = max_tokens - 1   # the full row: every block complete
    last = data.draw(st.sampled_from(["live", "live", "negative slot", "at max_tokens"])) if rows > 1 else "live"
    if last == "negative slot":
        slots[-1] = -1
    elif last == "at max_tokens":
        pos[slots[-1]] = max_tokens
    sel_cap = (k + 1) * ratio + data.draw(st.integers(0, 3))
    runs = [(kd.topk_smem_bytes(stride), 0xA5, "ascending"), (0, 0x00, "warps-descending"), (0, 0xFF, seed),
            (kd.topk_smem_bytes(stride), 0x5A, seed ^ 1)]
    outs = [run_topk(topk, scores, pos, slots, k, ratio, max_tokens, sel_cap, shared, poison, schedule)
            for shared, poison, schedule in runs]
    for out in outs[1:]:
        assert all(np.array_equal(a, b) for a, b in zip(outs[0], out))
    check_rows(scores, pos, slots, k, ratio, max_tokens, *outs[0])


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n, k", [(8192, 512), (513, 512), (8193, 8192), (20000, 512), (100, 37)])
def test_topk_production_shapes(topk, rng, kind, n, k):
    ratio = 4
    max_tokens = n * ratio + 3
    scores = make_scores(rng, kind, n)[None]
    pos, slots = np.array([77, max_tokens - 1], np.int32), np.array([1], np.int32)
    for shared in {kd.topk_smem_bytes(n), 0}:
        tokens, counts, after = run_topk(topk, scores, pos, slots, k, ratio, max_tokens, (k + 1) * ratio, shared)
        check_rows(scores, pos, slots, k, ratio, max_tokens, tokens, counts, after)


def test_topk_largest_rows(topk, rng):
    """N = 262,144 blocks (1M tokens): past the key cache, every pass re-reads the scores."""
    n, k, ratio = 262_144, 131_072, 4
    max_tokens = n * ratio + 1
    scores = make_scores(rng, "mixed", n)[None]
    pos, slots = np.array([max_tokens - 1], np.int32), np.array([0], np.int32)
    assert kd.topk_smem_bytes(n) == 0
    tokens, counts, after = run_topk(topk, scores, pos, slots, k, ratio, max_tokens, (k + 1) * ratio, 0)
    check_rows(scores, pos, slots, k, ratio, max_tokens, tokens, counts, after)


def test_topk_ties_nan_and_infinities_by_the_order(topk):
    """Hand-made row: +inf first, then numbers, -0.0 and +0.0 as one value (lower index first), -inf above NaN (any
    sign or payload), NaN last; every cut k = 1 .. n against the reference."""
    nans = np.array([0x7FC00000, 0xFFC00001, 0x7F800001], np.uint32).view(np.float32)
    row = np.array([np.nan, -np.inf, 0.0, -0.0, 2.0, np.inf, 2.0, -1e-45, 1e-45, -np.inf, nans[1], nans[2], 0.0,
                    np.inf, -3.0], np.float32)
    n, ratio = row.size, 1
    pos, slots = np.array([n - 1], np.int32), np.array([0], np.int32)
    for k in range(0, n + 1):
        tokens, counts, after = run_topk(topk, row[None], pos, slots, k, ratio, n, (k + 1) * ratio, 0)
        check_rows(row[None], pos, slots, k, ratio, n, tokens, counts, after)
    tokens, counts, _ = run_topk(topk, row[None], pos, slots, 8, 1, n, 9, 0)
    assert counts[0] == 8 and tokens[0, :8].tolist() == [2, 3, 4, 5, 6, 8, 12, 13]   # +inf x2, 2.0 x2, 1e-45, +-0 x3


def test_broken_contracts_leave_memory_untouched(program):
    """Undeclared (no harness check), the kernel itself returns before any access on a broken contract."""
    kernel = program.kernel("qsa_dev_topk")
    scores = np.ones((1, 50), np.float32)
    base = dict(score_stride=50, k_blocks=8, ratio=4, sel_cap=36, max_tokens=200)
    for block, change in [((256, 1, 1), {}), ((1024, 1, 1), {"max_tokens": 404}), ((1024, 1, 1), {"sel_cap": 34}),
                          ((1024, 1, 1), {"ratio": 0})]:
        pos, tokens, counts = np.array([199], np.int32), np.full((1, 36), POISON, np.int32), np.full(1, 7, np.int32)
        kernel(1, block, 0, scores, pos, np.array([0], np.int32), tokens, counts, *{**base, **change}.values())
        assert pos[0] == 199 and counts[0] == 7 and (tokens == POISON).all(), (block, change)
