"""Tests for the device sparse swap step (docs/design.md §17.8): ``ptx/sparse_step.cu`` and the batched predictor entry
points (:mod:`hss.decls.sparse_step`, :mod:`hss.decls.predictor`), the integer reference
(:mod:`hss.reference.sparse_step`) and :class:`hss.swap.device_step.DeviceSparseStep`.

The kernels against their references on outputs poisoned before each launch (0xFF: NaN as floats, -1 as ints), on
data with no zeros: the batched projection and scorer bit for bit against ``project_q`` / ``score_blocks`` of each
row, the selection and residency entry for entry against the integer reference, the reads byte for byte. The
reference against a plain-Python model of §17.8 written here. The component: a hypothesis state machine (steps of a
varying real row count over ragged, growing sequences, resets, new pages) against that model -- residency, stamps,
step numbers, selections, counters -- with the scores the device used equal to the predictor's own bit for bit and
giving the host sparse mode's ``select_pages`` choice, and the output within the bf16 bound of float64 attention over
exactly S; a captured step replayed against eager steps of a twin; every bad argument refused before any device
work, changing nothing; and mutation checks that the comparisons bite.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from test_predictor import check_scores

from hss import cuda_min as cm
from hss._util import ceil_div
from hss.cuda import _driver
from hss.cuda.ptx import load_module
from hss.decls import sparse_step as ks
from hss.decls.predictor import PREDICTOR_SCORE_TABLE, Q_LOWRANK_PROJECT_ROWS, q_rows_geometry, score_warps
from hss.errors import HssError
from hss.predictor import Predictor, PredictorDims
from hss.reference import attention as aref
from hss.reference import predictor as pref
from hss.reference import sparse_step as ref
from hss.swap import HighSpeedSwap, HighSpeedSwapConfig, ModelDims
from hss.swap.device_step import DeviceSparseStep
from hss.swap.sparse import SparseBudget, select_pages

import conftest
from helpers import BF16, assert_bites, assert_close, download, poisoned, upload

ON_GPU = conftest.ON_GPU
SEED = 0xCAFE_F00D
POISON32 = np.uint32(0xFFFFFFFF)


def randn(rng: np.random.Generator, shape: tuple[int, ...], std: float = 1.0) -> np.ndarray:
    """bf16 N(0, std^2) data with no zeros (a zero hides an unwritten output)."""
    x = (rng.standard_normal(shape) * std).astype(np.float32).astype(BF16)
    x[x == 0] = BF16(std)
    return x


def bits(a: np.ndarray) -> np.ndarray:
    return a.view({2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize])


def record_device_work(monkeypatch) -> list[str]:
    """Every driver call that queues device work, recorded at the driver seam (then made)."""
    calls: list[str] = []
    names = {"cuLaunchKernel", "cuLaunchKernelEx", "cuMemsetD32Async", "cuMemsetD8Async", "cuMemcpyHtoDAsync",
             "cuMemcpyDtoHAsync", "cuMemcpyDtoDAsync", "cuMemcpy2DAsync", "cuStreamSynchronize", "cuCtxSynchronize",
             "cuEventSynchronize", "cuGraphLaunch", "cuStreamWaitEvent", "cuEventRecord"}
    for name in names:
        real = getattr(_driver.api, name, None)
        if real is not None:
            monkeypatch.setattr(_driver.api, name, lambda *a, _r=real, _n=name: (calls.append(_n), _r(*a))[1])
    return calls


# -- a plain-Python model of docs/design.md §17.8 (independent of hss.reference.sparse_step) ---------------------------
def model_select(scores, n: int, budget: int, keep_first: int, keep_recent: int) -> list[int]:
    """S, ascending: every page when n <= F + Rk + K, else the first F, the last Rk and the K best others (higher
    score first, NaN below every number, ties to the earlier page)."""
    if n <= keep_first + keep_recent + budget:
        return list(range(n))

    def rank(i: int) -> tuple:
        v = float(scores[i])
        return (1, 0.0, i) if math.isnan(v) else (0, -v, i)
    others = sorted(range(keep_first, n - keep_recent), key=rank)
    return sorted(set(range(keep_first)) | set(range(n - keep_recent, n)) | set(others[:budget]))


@dataclass
class Slots:
    """One (sequence, layer)'s C slots: the page each holds (-1 free) and its stamp."""
    page: list[int]
    stamp: list[int]

    @classmethod
    def free(cls, slots: int) -> Slots:
        return cls([-1] * slots, [0] * slots)

    def page_slot(self, pages: int) -> list[int]:
        ps = [-1] * pages
        for c, p in enumerate(self.page):
            if p >= 0:
                ps[p] = c
        return ps

    def step(self, S: list[int], now: int, victims: str = "spec") -> tuple[int, int, list[tuple[int, int]]]:
        """One step over S: (hits, misses, [(miss page, its slot)]). ``victims="reversed"`` is a wrong model (the
        mutation check): occupied slots taken by (stamp, slot) descending."""
        where = {p: c for c, p in enumerate(self.page) if p >= 0}
        misses = [p for p in S if p not in where]
        kept = {where[p] for p in S if p in where}
        free = [c for c in range(len(self.page)) if self.page[c] < 0]
        held = sorted((c for c in range(len(self.page)) if self.page[c] >= 0 and c not in kept),
                      key=lambda c: (self.stamp[c], c), reverse=victims == "reversed")
        moves = list(zip(misses, free + held))
        for p, c in moves:
            self.page[c] = p
        for p in S:
            self.stamp[self.page.index(p)] = now
        return len(S) - len(misses), len(misses), moves


def model_scores() -> st.SearchStrategy[float]:
    """Page scores with many ties, both zeros, both infinities and NaN."""
    return st.one_of(st.sampled_from([0.0, -0.0, 1.0, -1.0, 2.5, float("inf"), float("-inf"), float("nan")]),
                     st.integers(-3, 3).map(float), st.floats(-1e3, 1e3, width=32))


@given(data=st.data())
def test_reference_is_the_plain_model(data) -> None:
    """hss.reference.sparse_step's select and residency_step against the plain model above, several steps of one
    (sequence, layer) with page counts moving both ways, every selection also the host mode's select_pages."""
    K, F, Rk = data.draw(st.integers(0, 4)), data.draw(st.integers(0, 3)), data.draw(st.integers(0, 3))
    if K + F + Rk == 0:
        K = 1
    C = K + F + Rk + data.draw(st.integers(0, 4))
    stride = data.draw(st.integers(1, 24))
    model = Slots.free(C)
    page_slot, slot_page, stamp = np.full(stride, -1, np.int32), np.full(C, -1, np.int32), np.zeros(C, np.int32)
    for now in range(1, data.draw(st.integers(1, 8)) + 1):
        n = data.draw(st.integers(0, stride))
        scores = np.array(data.draw(st.lists(model_scores(), min_size=n, max_size=n)), np.float32)
        S = model_select(scores, n, K, F, Rk)
        assert select_pages(scores, SparseBudget(K, F, Rk)).tolist() == S, "host mode"
        chosen = ref.select(scores, n, K, F, Rk)
        assert np.flatnonzero(chosen).tolist() == S, f"select, step {now}"
        hits, misses, moves = model.step(S, now)
        slots_of, miss_pages, into = ref.residency_step(chosen, page_slot, slot_page, stamp, now)
        assert [(int(p), int(c)) for p, c in zip(miss_pages, into)] == moves, f"misses and their slots, step {now}"
        assert slot_page.tolist() == model.page and stamp.tolist() == model.stamp, f"slots, step {now}"
        assert page_slot.tolist() == model.page_slot(stride) and slots_of.tolist() == [model.page.index(p) for p in S]


def test_score_keys_order_numbers_and_put_nan_lowest() -> None:
    v = np.array([np.nan, -np.inf, -3.5, -1e-45, -0.0, 0.0, 1e-45, 2.0, np.inf], np.float32)
    keys = ref.score_keys(v).astype(np.int64)
    assert keys[0] == 0 and keys[1] > 0 and np.all(np.diff(keys[1:]) >= 0)
    assert keys[4] == keys[5], "-0.0 and 0.0 are the same score (a tie goes to the earlier page)"
    assert np.all(np.diff(np.delete(keys[1:], 3)) > 0)


# -- the batched predictor entry points ---------------------------------------------------------------------------
@st.composite
def predictor_shapes(draw: st.DrawFn) -> dict:
    gqa, nkv = draw(st.integers(1, 4)), draw(st.integers(1, 3))
    return dict(num_q_heads=gqa * nkv, num_kv_heads=nkv, head_dim=draw(st.sampled_from([64, 96, 128])),
                r=draw(st.one_of(st.sampled_from([32, 64]), st.integers(8, 40))),
                block_size=draw(st.one_of(st.sampled_from([16, 32]), st.integers(1, 20))))


@given(shape=predictor_shapes(), layered=st.booleans(), rows=st.integers(1, 4), data=st.data())
def test_q_lowrank_project_rows_is_project_q_of_each_row(ctx, stream, shape, layered, rows, data) -> None:
    """Rows s < rows[0] (also a count past the capacity) get project_q's bits, through the seeded P or a layer's
    per-kv-head P; rows past the count keep their poison."""
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    d = PredictorDims(num_layers=3, max_blocks=1, **shape)
    nq, hd, r = d.num_q_heads, d.head_dim, d.r
    real = data.draw(st.integers(0, rows + 1))
    kw = dict(projection=randn(rng, (3, d.num_kv_heads, hd, r), 1 / math.sqrt(hd))) if layered else \
        dict(projection_seed=SEED)
    layer = data.draw(st.integers(0, 2))
    with Predictor(ctx, d, **kw) as pred:
        q = randn(rng, (rows, nq, hd))
        q_dev, rows_dev = upload(q, stream), upload(np.array([real], np.int32), stream)
        out = poisoned(2 * rows * nq * r, stream)
        per_p, p_stride = (d.gqa_ratio(), hd * r) if layered else (nq, 0)
        block, grid = q_rows_geometry(r, nq, per_p, rows)
        pack = Q_LOWRANK_PROJECT_ROWS.pack(q=q_dev.ptr, p=pred.projection_dev_ptr + layer * 2 * d.num_kv_heads * hd *
                                           r * layered, q_proj=out.ptr, rows=rows_dev.ptr, num_q_heads=nq,
                                           head_dim=hd, r=r, heads_per_p=per_p, p_stride=p_stride)
        with load_module("q_lowrank_project", ctx) as mod:
            cm.launch_kernel(mod.function("q_lowrank_project_rows"), grid, block, 0, stream, pack)
            got = download(out, (rows, nq, r), BF16, stream)
        one = poisoned(2 * nq * r, stream)
        for s in range(min(real, rows)):
            pred.project_q(ctx, q_dev.ptr + s * q[0].nbytes, one, layer=layer)
            want = download(one, (nq, r), BF16, stream)
            assert np.array_equal(bits(got[s]), bits(want)), f"row {s} of {real}: not project_q's bits"
            assert_close(got[s], pref.project_q(q[s], kw["projection"][layer] if layered else pred.projection,
                                                d.gqa_ratio() if layered else None), "bf16", (1,), f"row {s}")
        assert np.all(bits(got[max(real, 0):]) == 0xFFFF), "a row past the real count was written"
        for b in (q_dev, rows_dev, out, one):
            b.close()


@given(shape=predictor_shapes(), rows=st.integers(1, 4), data=st.data())
def test_predictor_score_table_is_score_blocks_through_the_table(ctx, stream, shape, rows, data) -> None:
    """scores[s, i] = score_blocks' bits for A_g block table[s, i] and query row s (ids repeating; an id outside A_g
    NaN), for i < clamp(counts[s], 0, stride) and s < rows[0]; nothing else written."""
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    d = PredictorDims(num_layers=1, max_blocks=data.draw(st.integers(1, 6)), **shape)
    nq, nkv, bs, r, M = d.num_q_heads, d.num_kv_heads, d.block_size, d.r, d.max_blocks
    stride = data.draw(st.integers(1, 12))
    real = data.draw(st.integers(0, rows + 1))
    table = rng.integers(-2, M + 2, (rows, stride)).astype(np.int32)
    counts = rng.integers(-1, stride + 2, rows).astype(np.int32)
    small = rng.random() < 0.5   # the original's small scale, else unit data
    k_lr = randn(rng, (M, nkv, bs, r), 1 / math.sqrt(r) if small else 1.0)
    q_proj = randn(rng, (rows, nq, r))
    with Predictor(ctx, d, SEED) as pred:
        kd, qd, td, cd = (upload(a, stream) for a in (k_lr, q_proj, table, counts))
        rows_dev = upload(np.array([real], np.int32), stream)
        out = poisoned(4 * rows * stride, stream)
        w = score_warps()
        pack = PREDICTOR_SCORE_TABLE.pack(q_proj=qd.ptr, k_lr=kd.ptr, table=td.ptr, counts=cd.ptr, rows=rows_dev.ptr,
                                          scores=out.ptr, num_q_heads=nq, num_kv_heads=nkv, block_size=bs, r=r,
                                          gqa_ratio=d.gqa_ratio(), table_stride=stride, max_blocks=M)
        with load_module("predictor_score", ctx) as mod:
            cm.launch_kernel(mod.function("predictor_score_table"), (ceil_div(stride, w), rows, 1), (32 * w, 1, 1), 0,
                             stream, pack)
            got = download(out, (rows, stride), np.float32, stream)
        one = poisoned(4 * M, stream)
        for s in range(rows):
            n = min(max(int(counts[s]), 0), stride) if s < real else 0
            if n:
                pred.score_blocks(ctx, qd.ptr + s * q_proj[0].nbytes, kd, one, M)
                per_block = download(one, (M,), np.float32, stream)
                check_scores(per_block, q_proj[s], k_lr, d.gqa_ratio(), rng, f"row {s}'s scores")   # (the bound)
                ids = table[s, :n]
                ok = (ids >= 0) & (ids < M)
                assert np.array_equal(bits(got[s, :n][ok]), bits(per_block[ids[ok]])), f"row {s}: not the bits"
                assert np.all(np.isnan(got[s, :n][~ok]) & (bits(got[s, :n][~ok]) != POISON32)), \
                    f"row {s}: an id outside A_g must score NaN"
            assert np.all(bits(got[s, n:]) == POISON32), f"row {s}: an entry past its count was written"
        for b in (kd, qd, td, cd, rows_dev, out, one):
            b.close()


# -- sparse_select, sparse_fetch, sparse_advance, sparse_counts launched directly --------------------------------
@dataclass
class SelectCase:
    """One launch of sparse_select: R rows (``real`` of them real), per-row page counts, valid residency states
    built by ``warmup`` reference steps per row, and the launch's scores."""
    stride: int
    budget: int
    keep_first: int
    keep_recent: int
    slots: int
    counts: list[int]
    real: int
    warmup: int = 3
    special: bool = True          # scores with ties, NaN, both infinities and both zeros
    seed: int = 0
    extra: dict = field(default_factory=dict)

    @property
    def sel_cap(self) -> int:
        return self.budget + self.keep_first + self.keep_recent


def draw_scores(rng: np.random.Generator, shape: tuple[int, ...], special: bool) -> np.ndarray:
    s = rng.standard_normal(shape).astype(np.float32)
    if special:
        pick = rng.random(shape)
        s[pick < 0.3] = np.round(s[pick < 0.3])                       # ties (and zeros of both signs)
        s[pick < 0.05] = -0.0
        s[(pick > 0.9) & (pick < 0.93)] = np.nan
        s[(pick > 0.93) & (pick < 0.96)] = -np.inf
        s[pick > 0.97] = np.inf
    return s


def select_state(case: SelectCase, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Valid per-row states after ``warmup`` reference steps of random counts and scores."""
    R, P, C = len(case.counts), case.stride, case.slots
    state = dict(page_slot=np.full((R, P), -1, np.int32), slot_page=np.full((R, C), -1, np.int32),
                 slot_stamp=np.zeros((R, C), np.int32), step=np.zeros(R, np.int32))
    for s in range(R):
        for _ in range(int(rng.integers(0, case.warmup + 1))):
            state["step"][s] += 1
            n = int(rng.integers(0, P + 1))
            chosen = ref.select(draw_scores(rng, (n,), case.special), n, case.budget, case.keep_first,
                                case.keep_recent)
            ref.residency_step(chosen, state["page_slot"][s], state["slot_page"][s], state["slot_stamp"][s],
                               int(state["step"][s]))
        state["step"][s] += 1   # this launch's step number (sparse_advance ran first)
    return state


def run_select(ctx, stream, case: SelectCase) -> None:
    """Launch sparse_select on a case and compare every output and state array with the integer reference."""
    rng = np.random.default_rng(case.seed)
    R, P, C, cap = len(case.counts), case.stride, case.slots, case.sel_cap
    state = select_state(case, rng)
    scores = draw_scores(rng, (R, P), case.special)
    table = rng.integers(0, 1000, (R, P)).astype(np.int32)
    max_blocks = int(rng.integers(900, 1001))   # ids at or past it: NaN (folded scores) and read from nowhere
    counts = np.array(case.counts, np.int32)
    stats = rng.integers(0, 1 << 40, (R, 2)).astype(np.int64)
    heads = case.extra.get("heads", 0)
    scale = float(np.float32(rng.uniform(0.05, 2.0)))
    per_head = (rng.standard_normal((R, P, max(heads, 1))) * 4).astype(np.float32)
    per_head[rng.random(per_head.shape) < 0.1] = -np.inf
    per_head[rng.random(per_head.shape) < 0.05] = np.nan
    slot_base, src_base = int(rng.integers(0, 1 << 20)), int(rng.integers(0, 1 << 20))
    dev = {k: upload(v, stream) for k, v in dict(scores=scores, table=table, counts=counts, stats=stats,
                                                 rows=np.array([case.real], np.int32), head_scores=per_head,
                                                 **state).items()}
    outs = dict(attend=poisoned(4 * R * cap, stream), attend_counts=poisoned(4 * R, stream),
                fetch=poisoned(8 * R * cap, stream), fetch_counts=poisoned(4 * R, stream))
    geo = ks.select_geometry(R, P, C, cap)
    with load_module(ks.MODULE, ctx) as mod:
        fn = mod.function("sparse_select")
        if geo.shared > 48 * 1024:
            fn.set_max_dynamic_shared(geo.shared)
        pack = ks.SPARSE_SELECT.pack(**{k: b.ptr for k, b in (dev | outs).items()}, stride=P, slots=C, sel_cap=cap,
                                     budget=case.budget, keep_first=case.keep_first, keep_recent=case.keep_recent,
                                     slot_base=slot_base, src_base=src_base, num_heads=heads,
                                     max_blocks=max_blocks, exp2_scale=scale)
        if not heads:
            pack.slot("head_scores").value = 0
        cm.launch_kernel(fn, geo.grid, geo.block, geo.shared, stream, pack)
        got = {k: download(dev[k], v.shape, v.dtype, stream) for k, v in (state | dict(stats=stats)).items()}
        got_scores = download(dev["scores"], (R, P), np.float32, stream)
        got["attend"] = download(outs["attend"], (R, cap), np.int32, stream)
        got["fetch"] = download(outs["fetch"], (R, cap, 2), np.int32, stream)
        got["attend_counts"] = download(outs["attend_counts"], (R,), np.int32, stream)
        got["fetch_counts"] = download(outs["fetch_counts"], (R,), np.int32, stream)
    want = {k: v.copy() for k, v in (state | dict(stats=stats)).items()}
    want |= dict(attend=np.full((R, cap), -1, np.int32), fetch=np.full((R, cap, 2), -1, np.int32),
                 attend_counts=np.zeros(R, np.int32), fetch_counts=np.zeros(R, np.int32))
    want_scores = scores.copy()
    for s in range(min(max(case.real, 0), R)):
        n = min(max(int(counts[s]), 0), P)
        if heads and n > cap:
            # the folded per-head scores: the reference's within docs/design.md §0's f32 rule (exact on the emulator)
            folded = ref.head_scores(per_head[s, :n, :heads], table[s, :n], max_blocks, scale)
            nan = np.isnan(folded)
            assert np.array_equal(np.isnan(got_scores[s, :n]), nan), f"row {s}: NaN scores; {case}"
            if ON_GPU:
                assert_close(got_scores[s, :n][~nan], folded[~nan].astype(np.float64), "f32", (0,), "folded scores")
            else:
                assert np.array_equal(got_scores[s, :n][~nan].view(np.uint32), folded[~nan].view(np.uint32))
            want_scores[s, :n] = got_scores[s, :n]   # (the selection is exact integer logic over these)
        chosen = ref.select(want_scores[s, :n], n, case.budget, case.keep_first, case.keep_recent)
        assert np.flatnonzero(chosen).tolist() == model_select(want_scores[s], n, case.budget, case.keep_first,
                                                               case.keep_recent)
        slots_of, misses, into = ref.residency_step(chosen, want["page_slot"][s], want["slot_page"][s],
                                                    want["slot_stamp"][s], int(state["step"][s]))
        base = slot_base + s * C
        k, m = slots_of.size, misses.size
        want["attend"][s, :k] = base + slots_of
        ids = table[s, misses]
        want["fetch"][s, :m, 0] = np.where(ids < max_blocks, src_base + ids, -1)
        want["fetch"][s, :m, 1] = base + into
        want["attend_counts"][s], want["fetch_counts"][s] = k, m
        want["stats"][s] += (k - m, m)
    nan = np.isnan(want_scores)   # scores of rows not folded stay as they were
    assert np.array_equal(np.isnan(got_scores), nan)
    assert np.array_equal(got_scores[~nan].view(np.uint32), want_scores[~nan].view(np.uint32)), "scores"
    for k in want:
        bad = np.argwhere(got[k] != want[k])
        assert not bad.size, f"{k}: {len(bad)} entries differ, first at {bad[0].tolist()} (got " \
                             f"{got[k][tuple(bad[0])]}, want {want[k][tuple(bad[0])]}); {case}"
    for b in (*dev.values(), *outs.values()):
        b.close()


SELECT_CASES = [
    SelectCase(12, 3, 1, 2, 6, [12, 9, 4], 3),                      # ragged, one row covered
    SelectCase(12, 0, 1, 2, 3, [12, 7, 0], 3),                      # budget 0; n = 0
    SelectCase(12, 4, 0, 0, 4, [12, 11], 2),                        # no forced pages
    SelectCase(10, 2, 0, 3, 7, [10, 10], 2),                        # keep_first 0
    SelectCase(10, 2, 3, 0, 5, [10, 10], 2),                        # keep_recent 0
    SelectCase(8, 8, 2, 2, 12, [8, 8, 3], 3),                       # covered: n <= sel_cap
    SelectCase(9, 3, 1, 1, 5, [9, 9, 9, 9], 2),                     # padded rows past the real count
    SelectCase(9, 3, 1, 1, 5, [9, 9], 0),                           # no real row
    SelectCase(9, 3, 1, 1, 5, [9, 9], 7),                           # a real count past the capacity
    SelectCase(9, 3, 1, 1, 5, [-4, 40], 2),                         # counts clamped to 0 .. stride
    SelectCase(6, 1, 0, 0, 1, [6, 6, 6], 3, warmup=8),              # one slot
    SelectCase(2500, 1000, 7, 9, 1500, [2500, 2001, 1017], 3, warmup=2),   # many chunks; a 2048-entry sort
    SelectCase(3000, 0, 1, 1, 1100, [3000, 2999], 2, warmup=2, special=False),
]


@pytest.mark.parametrize("case", SELECT_CASES, ids=lambda c: f"P{c.stride}-K{c.budget}F{c.keep_first}"
                         f"R{c.keep_recent}-C{c.slots}-n{c.counts}-rows{c.real}"[:60])
def test_sparse_select_edge_cases(ctx, stream, rng, case: SelectCase) -> None:
    case.seed = int(rng.integers(2**32))
    run_select(ctx, stream, case)


HEAD_CASES = [SelectCase(12, 3, 1, 2, 6, [12, 9, 4], 3, extra=dict(heads=3)),
              SelectCase(40, 5, 1, 4, 12, [40, 33], 2, extra=dict(heads=8)),
              SelectCase(300, 16, 1, 4, 21, [300, 250, 22], 3, extra=dict(heads=9)),
              SelectCase(2500, 200, 1, 4, 300, [2500, 2001], 2, warmup=2, extra=dict(heads=32)),
              SelectCase(9, 3, 1, 1, 5, [9, 9, 9], 1, extra=dict(heads=256))]


@pytest.mark.parametrize("case", HEAD_CASES, ids=lambda c: f"P{c.stride}-K{c.budget}-heads{c.extra['heads']}")
def test_sparse_select_folds_the_per_head_scores(ctx, stream, rng, case: SelectCase) -> None:
    """With num_heads > 0 the selection first computes each row's per-head normalised scores from the per-head
    maxima (NaN and -inf holes, ids at or past max_blocks NaN), writes them to scores (rows not every page of which
    is selected), and selects over them; the rest is the integer reference's."""
    case.seed = int(rng.integers(2**32))
    run_select(ctx, stream, case)


@given(data=st.data())
def test_sparse_select_is_the_reference(ctx, stream, data) -> None:
    """Random shapes, counts, states and scores: every output and state entry is the integer reference's."""
    K, F, Rk = data.draw(st.integers(0, 6)), data.draw(st.integers(0, 3)), data.draw(st.integers(0, 4))
    if K + F + Rk == 0:
        F = 1
    R, P = data.draw(st.integers(1, 4)), data.draw(st.integers(1, 300 if ON_GPU else 40))
    C = K + F + Rk + data.draw(st.integers(0, 6))
    counts = data.draw(st.lists(st.integers(-1, P + 1), min_size=R, max_size=R))
    run_select(ctx, stream, SelectCase(P, K, F, Rk, C, counts, data.draw(st.integers(0, R + 1)),
                                       warmup=data.draw(st.integers(0, 5)), special=data.draw(st.booleans()),
                                       seed=data.draw(st.integers(0, 2**32 - 1))))


@given(page_vecs=st.sampled_from([1, 3, ks.CHUNK - 1, ks.CHUNK, ks.CHUNK + 1, 2 * ks.CHUNK + 5]), data=st.data())
def test_sparse_fetch_copies_exactly_the_good_pairs(ctx, stream, page_vecs, data) -> None:
    """Pair j < fetch_counts[s] of row s < rows[0]: dst slot = src page, byte for byte; a pair outside src_pages or
    dst_pages, a pair past a row's count and every pair of a padded row copy nothing."""
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    R, cap = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 5))
    n_src, n_dst = data.draw(st.integers(1, 8)), R * cap + data.draw(st.integers(0, 3))
    real = data.draw(st.integers(0, R + 1))
    pb = 16 * page_vecs
    src = cm.PinnedBuffer(n_src * pb)
    src.array[:] = rng.integers(1, 256, src.bytes, dtype=np.uint8)
    dst = cm.DeviceBuffer(n_dst * pb)
    cm.memset_d8_async(dst, 0, dst.bytes, stream)
    slots = rng.permutation(n_dst)[:R * cap].reshape(R, cap)         # distinct destinations
    fetch = np.stack([rng.integers(0, n_src, (R, cap)), slots], axis=2).astype(np.int32)
    for s, j in np.argwhere(rng.random((R, cap)) < 0.3):   # a block id the table got wrong, a slot past the pool
        page, slot = fetch[s, j]
        fetch[s, j] = [(-1, slot), (n_src, slot), (n_src + 1000, slot), (page, -1), (page, n_dst)][rng.integers(5)]
    counts = rng.integers(-1, cap + 2, R).astype(np.int32)
    fd, cd, rows_dev = upload(fetch, stream), upload(counts, stream), upload(np.array([real], np.int32), stream)
    geo = ks.fetch_geometry(R, cap, page_vecs)
    with load_module(ks.MODULE, ctx) as mod:
        cm.launch_kernel(mod.function("sparse_fetch"), geo.grid, geo.block, geo.shared, stream,
                         ks.SPARSE_FETCH.pack(dst=dst.ptr, src=src.device_ptr(), fetch=fd.ptr, fetch_counts=cd.ptr,
                                              rows=rows_dev.ptr, sel_cap=cap, page_vecs=page_vecs, src_pages=n_src,
                                              dst_pages=n_dst))
        got = download(dst, (n_dst, pb), np.uint8, stream)
    want = np.zeros((n_dst, pb), np.uint8)
    img = src.array.reshape(n_src, pb)
    for s in range(min(real, R)):
        for j in range(min(max(int(counts[s]), 0), cap)):
            p, d = fetch[s, j]
            if 0 <= p < n_src and 0 <= d < n_dst:
                want[d] = img[p]
    assert np.array_equal(got, want), f"rows {real} of {R}, counts {counts.tolist()}, pairs {fetch.tolist()}"
    for b in (fd, cd, rows_dev, dst, src):
        b.close()


def test_sparse_advance_and_counts(ctx, stream, rng) -> None:
    """sparse_advance moves the first min(rows[0], R) step numbers; sparse_counts splits visible tokens into complete
    pages and the newest page's tokens (1..block_size; visible < 1: 0 and 0); neither writes past the real rows."""
    R, bs = 300, 16
    step = rng.integers(0, 1000, R).astype(np.int32)
    visible = rng.integers(-2, 100, R).astype(np.int32)
    visible[:4] = [0, 1, 16, 17]
    for real in (0, 1, 257, R, R + 5):
        sd, vd, rd = upload(step, stream), upload(visible, stream), upload(np.array([real], np.int32), stream)
        pc, tc = poisoned(4 * R, stream), poisoned(4 * R, stream)
        g = ks.advance_geometry(R)
        with load_module(ks.MODULE, ctx) as mod:
            cm.launch_kernel(mod.function("sparse_advance"), g.grid, g.block, 0, stream,
                             ks.SPARSE_ADVANCE.pack(step=sd.ptr, rows=rd.ptr, R=R))
            cm.launch_kernel(mod.function("sparse_counts"), g.grid, g.block, 0, stream,
                             ks.SPARSE_COUNTS.pack(visible=vd.ptr, rows=rd.ptr, R=R, block_size=bs,
                                                   page_counts=pc.ptr, tail_counts=tc.ptr))
            got_step = download(sd, (R,), np.int32, stream)
            pages, tail = download(pc, (R,), np.int32, stream), download(tc, (R,), np.int32, stream)
        k = min(real, R)
        assert np.array_equal(got_step, step + (np.arange(R) < k)), f"rows {real}"
        v = visible[:k].astype(np.int64)
        full = np.where(v >= 1, (v - 1) // bs, 0)
        assert np.array_equal(pages[:k], full) and np.array_equal(tail[:k], np.where(v >= 1, v - full * bs, 0))
        assert np.all(tail[:k][v >= 1] >= 1) and np.all(tail[:k] <= bs)
        assert np.all(pages[k:] == -1) and np.all(tail[k:] == -1), "written past the real rows"
        for b in (sd, vd, rd, pc, tc):
            b.close()


# -- DeviceSparseStep against the model ---------------------------------------------------------------------------
DIMS = dict(num_q_heads=8, num_kv_heads=2, head_dim=64, block_size=16) if not ON_GPU else \
    dict(num_q_heads=32, num_kv_heads=8, head_dim=128, block_size=16)


class World:
    """A host-store HighSpeedSwap of ``layers`` x ``blocks`` pages plus the host truth of every offloaded page: k, v
    bf16 [layers, blocks, block_size, num_kv_heads, head_dim] (NaN where nothing was offloaded)."""

    def __init__(self, ctx, path, rng, *, layers: int = 2, blocks: int = 24, dims: dict = DIMS, **cfg) -> None:
        self.ctx, self.stream, self.rng = ctx, ctx.stream, rng
        self.cfg = HighSpeedSwapConfig(path, 1 << 36, 4, 32, 2, False, SEED, store=cfg.pop("store", "host"),
                                       stream_tile_blocks=1, **cfg)
        self.model = ModelDims(layers, blocks, **dims)
        self.h = HighSpeedSwap(ctx, self.cfg, self.model)
        d = self.model
        shape = (layers, blocks, d.block_size, d.num_kv_heads, d.head_dim)
        self.k, self.v = np.full(shape, np.nan, BF16), np.full(shape, np.nan, BF16)
        self.written: list[int] = []

    def offload(self, block: int) -> None:
        """Fresh random K and V for ``block`` in every layer."""
        d = self.model
        page = (d.block_size, d.num_kv_heads, d.head_dim)
        for layer in range(d.num_layers):
            self.k[layer, block] = randn(self.rng, page, 1 / math.sqrt(d.head_dim))
            self.v[layer, block] = randn(self.rng, page)
            kd = upload(self.k[layer, block], self.stream)
            self.h.offload_block(self.ctx, layer, block, kd, self.k[layer, block], self.v[layer, block])
            cm.stream_sync(self.stream)
            kd.close()
        self.written.append(block)

    def query(self, rows: int) -> np.ndarray:
        d = self.model
        return randn(self.rng, (rows, d.num_q_heads, d.head_dim))

    def predictor_scores(self, q: np.ndarray, layer: int) -> np.ndarray:
        """The predictor's own score of every A_g block of ``layer`` for query ``q`` (project_q then score_layer)."""
        pred, s = self.h.predictor, self.stream
        qd, qp, sc = upload(q, s), poisoned(2 * q.shape[0] * pred.dims.r, s), poisoned(4 * self.model.
                                                                                       max_blocks_per_layer, s)
        pred.project_q(self.ctx, qd, qp)
        pred.score_layer(self.ctx, qp, layer, 0, self.model.max_blocks_per_layer, sc)
        got = download(sc, (self.model.max_blocks_per_layer,), np.float32, s)
        for b in (qd, qp, sc):
            b.close()
        return got

    def close(self) -> None:
        self.h.close()


@dataclass
class Rows:
    """The model of one DeviceSparseStep: per row its block ids (page order) and step number; per (row, layer)
    its slots and counters."""
    R: int
    L: int
    C: int
    tables: list[list[int]] = field(default_factory=list)
    steps: list[int] = field(default_factory=list)
    slots: dict = field(default_factory=dict)
    hits: np.ndarray = None
    misses: np.ndarray = None

    def __post_init__(self) -> None:
        self.tables = [[] for _ in range(self.R)]
        self.steps = [0] * self.R
        self.hits, self.misses = np.zeros((self.R, self.L), np.int64), np.zeros((self.R, self.L), np.int64)
        for r in range(self.R):
            self.reset(r)

    def reset(self, r: int) -> None:
        self.steps[r] = 0
        self.hits[r], self.misses[r] = 0, 0
        for layer in range(self.L):
            self.slots[r, layer] = Slots.free(self.C)


class Harness:
    """A DeviceSparseStep over a World, its fixed device inputs (tables, page counts, rows, q, out) and the model."""

    def __init__(self, world: World, *, max_seqs: int, budget: int, keep_first: int, keep_recent: int,
                 slots: int | None = None, max_pages: int | None = None) -> None:
        self.w, s = world, world.stream
        self.stream = s   # where feed, run and outputs queue their work
        self.step = DeviceSparseStep(world.h, s, max_seqs=max_seqs, budget_pages=budget, keep_first=keep_first,
                                     keep_recent=keep_recent, slots=slots, max_pages=max_pages, ctx=world.ctx)
        st_ = self.step
        self.K, self.F, self.Rk, self.C, self.P = budget, keep_first, keep_recent, st_.slots, st_.max_pages
        self.R, self.L = max_seqs, world.model.num_layers
        d = world.model
        self.row_bytes = 2 * d.num_q_heads * d.head_dim
        self.tables = cm.DeviceBuffer(4 * self.R * self.P)
        self.counts = cm.DeviceBuffer(4 * self.R)
        self.rows = cm.DeviceBuffer(4)
        self.q = cm.DeviceBuffer(self.R * self.row_bytes)
        self.outs = [cm.DeviceBuffer(self.R * self.row_bytes) for _ in range(self.L)]
        self.model = Rows(self.R, self.L, self.C)

    def feed(self, q: np.ndarray, real: int) -> None:
        """The model's tables and counts, ``q`` and the real row count into the fixed buffers; outputs poisoned."""
        s, P = self.stream, self.P
        table = np.full((self.R, P), -7, np.int32)   # entries past a row's count are never read
        for r, ids in enumerate(self.model.tables):
            table[r, :len(ids)] = ids
        self._host = (table, np.array([len(t) for t in self.model.tables], np.int32), np.array([real], np.int32),
                      np.ascontiguousarray(q))
        for buf, arr in zip((self.tables, self.counts, self.rows, self.q), self._host):
            cm.copy_h_to_d_async(buf, arr, arr.nbytes, s)
        for out in self.outs:
            cm.memset_d8_async(out, 0xFF, out.bytes, s)

    def run(self, rows=None) -> None:
        """begin_step + attend_layer of every layer (``rows``: an int, else the device count)."""
        s = self.stream
        self.step.begin_step(s, self.tables, self.counts, self.rows if rows is None else rows)
        for layer in range(self.L):
            self.step.attend_layer(s, layer, self.q, self.outs[layer])

    def outputs(self) -> np.ndarray:
        d = self.w.model
        return np.stack([download(o, (self.R, d.num_q_heads, d.head_dim), BF16, self.stream) for o in self.outs])

    def state(self) -> tuple:
        """Everything the step keeps: residency of every (layer, row), step numbers, counters."""
        s = self.stream
        res = [tuple(a.copy() if isinstance(a, np.ndarray) else a for a in self.step.residency(s, layer, r))
               for layer in range(self.L) for r in range(self.R)]
        c = self.step.counters(s)
        return res, c.hits.copy(), c.misses.copy(), c.bytes_read.copy()

    def close(self) -> None:
        for b in (self.tables, self.counts, self.rows, self.q, *self.outs):
            b.close()
        self.step.close()


def same_state(a: tuple, b: tuple) -> bool:
    (ra, *ca), (rb, *cb) = a, b
    return all(all(np.array_equal(x, y) for x, y in zip(p, q)) for p, q in zip(ra, rb)) and \
        all(np.array_equal(x, y) for x, y in zip(ca, cb))


def check_layer(hn: Harness, layer: int, q: np.ndarray, real: int, out: np.ndarray, what: str,
                victims: str = "spec") -> list[list[int]]:
    """One layer just run: the scores the device used (= the predictor's bits, giving select_pages' choice), the
    selection, the residency against the model (advanced here), the output against float64 attention over S.
    Returns S of each real row."""
    w, s, step, m = hn.w, hn.w.stream, hn.step, hn.model
    scores = download(step.scores, (hn.R, hn.P), np.float32, s)
    att, cnt = step.selection(s)
    chosen = []
    for r in range(hn.R):
        ps, sp, stamps, no = step.residency(s, layer, r)
        slots = m.slots[r, layer]
        where = f"{what}, layer {layer}, row {r}"
        if r >= real:
            assert cnt[r] == 0, f"{where}: a padded row attends nothing"
            assert not bits(out[r]).any(), f"{where}: a padded row's output must be zeros"
        else:
            ids = m.tables[r]
            n = len(ids)
            if w.h.predictor.head_temperature is None:   # (per-head normalised scores are normalised over the row)
                own = w.predictor_scores(q[r], layer)
                assert np.array_equal(bits(scores[r, :n]), bits(own[ids])), f"{where}: not the predictor's scores"
            S = model_select(scores[r], n, hn.K, hn.F, hn.Rk)
            assert select_pages(scores[r, :n], SparseBudget(hn.K, hn.F, hn.Rk)).tolist() == S, where
            hits, misses, _ = slots.step(S, no, victims)
            m.hits[r, layer] += hits
            m.misses[r, layer] += misses
            chosen.append(S)
            assert cnt[r] == len(S), f"{where}: attend count"
            local = att[r, :cnt[r]] - (layer * hn.R + r) * hn.C
            assert sp[local].tolist() == S, f"{where}: the attended slots must hold S's pages in page order"
            k = np.concatenate([w.k[layer, ids[p]] for p in S]) if S else w.k[layer, :0, 0]
            v = np.concatenate([w.v[layer, ids[p]] for p in S]) if S else w.v[layer, :0, 0]
            want = aref.attention(q[r], k, v)
            assert_close(out[r], want, "bf16", (1,), f"{where}: attention over S")
        assert no == m.steps[r], f"{what}, row {r}: step number"
        assert sp.tolist() == slots.page and stamps.tolist() == slots.stamp, \
            f"{what}, layer {layer}, row {r}: slots {sp.tolist()} stamps {stamps.tolist()}, model {slots}"
        assert ps.tolist() == slots.page_slot(hn.P), f"{what}, layer {layer}, row {r}: page_slot"
    return chosen


def check_counters(hn: Harness, what: str) -> None:
    c = hn.step.counters(hn.w.stream)
    m = hn.model
    assert np.array_equal(c.hits, m.hits) and np.array_equal(c.misses, m.misses), \
        f"{what}: counters {c.hits.tolist()} / {c.misses.tolist()}, model {m.hits.tolist()} / {m.misses.tolist()}"
    assert np.array_equal(c.bytes_read, m.misses * hn.w.h.layout.block_bytes), what


def model_step(hn: Harness, q: np.ndarray, real: int, rows=None, what: str = "") -> list[tuple[list, np.ndarray]]:
    """One step through the harness (``rows`` None: the device count), checked layer by layer against the model;
    returns (S of each real row, the output) per layer."""
    hn.feed(q, real)
    s = hn.w.stream
    hn.step.begin_step(s, hn.tables, hn.counts, hn.rows if rows is None else rows)
    for r in range(min(real, hn.R)):
        hn.model.steps[r] += 1
    seen = []
    for layer in range(hn.L):
        hn.step.attend_layer(s, layer, hn.q, hn.outs[layer])
        out = download(hn.outs[layer], q.shape, BF16, s)
        seen.append((check_layer(hn, layer, q, real, out, what), out))
    check_counters(hn, what)
    return seen


class DeviceStepMachine(RuleBasedStateMachine):
    """Steps of a DeviceSparseStep (real row count varying, through an int or the device count), resets of rows (a
    new sequence, or the same pages again), pages offloaded between steps and appended to rows (ragged, growing),
    all against the model."""
    ctx = path = None
    built = 0

    @initialize(K=st.integers(0, 3), F=st.integers(0, 1), Rk=st.integers(0, 2), extra=st.integers(0, 2),
                R=st.integers(1, 3), seed=st.integers(0, 2**32 - 1), temperature=st.sampled_from([None, None, 0.5]))
    def build(self, K, F, Rk, extra, R, seed, temperature) -> None:
        if K + F + Rk == 0:
            K = 1
        DeviceStepMachine.built += 1
        self.rng = np.random.default_rng(seed)
        self.world = World(self.ctx, self.path / f"kv{DeviceStepMachine.built}", self.rng, blocks=20,
                           head_temperature=temperature)
        for b in range(8):
            self.world.offload(b)
        self.hn = Harness(self.world, max_seqs=R, budget=K, keep_first=F, keep_recent=Rk, slots=K + F + Rk + extra,
                          max_pages=16)
        for r in range(R):   # ragged starting lengths over the pages written so far
            self.hn.model.tables[r] = [int(b) for b in self.rng.choice(8, int(self.rng.integers(3, 15)))]
        self.n = 0

    @rule(data=st.data())
    def step(self, data) -> None:
        hn = self.hn
        real = data.draw(st.integers(1, hn.R))
        via_device = data.draw(st.booleans())
        self.n += 1
        model_step(hn, self.world.query(hn.R), real, None if via_device else real, f"step {self.n} (rows {real})")

    @precondition(lambda self: len(self.world.written) < self.world.model.max_blocks_per_layer)
    @rule(data=st.data())
    def offload(self, data) -> None:
        """A new page (fresh block id, every layer) appended to a row, maybe with an old page or two after it."""
        w, hn = self.world, self.hn
        block = len(w.written)
        w.offload(block)
        r = data.draw(st.integers(0, hn.R - 1))
        extra = [int(b) for b in self.rng.choice(w.written, data.draw(st.integers(0, 2)))]
        hn.model.tables[r] = (hn.model.tables[r] + [block] + extra)[:hn.P]

    @rule(data=st.data())
    def reset(self, data) -> None:
        hn = self.hn
        rows = sorted(set(data.draw(st.lists(st.integers(0, hn.R - 1), min_size=1, max_size=hn.R))))
        new_seq = data.draw(st.booleans())
        hn.step.reset(self.world.stream, rows[0] if len(rows) == 1 and data.draw(st.booleans()) else rows)
        for r in rows:
            hn.model.reset(r)
            if new_seq:
                hn.model.tables[r] = [int(b) for b in self.rng.choice(self.world.written, int(self.rng.integers(
                    0, 4)))]

    @invariant()
    def residency_and_counters(self) -> None:
        hn = getattr(self, "hn", None)
        if hn is None:
            return
        s = self.world.stream
        for layer in range(hn.L):
            for r in range(hn.R):
                ps, sp, stamps, no = hn.step.residency(s, layer, r)
                slots = hn.model.slots[r, layer]
                assert (sp.tolist(), stamps.tolist(), ps.tolist(), no) == (slots.page, slots.stamp,
                                                                          slots.page_slot(hn.P), hn.model.steps[r])
        check_counters(hn, "invariant")

    def teardown(self) -> None:
        if getattr(self, "hn", None) is not None:
            self.hn.close()
            self.world.close()


def test_device_step_state_machine(ctx, tmp_path) -> None:
    DeviceStepMachine.ctx, DeviceStepMachine.path = ctx, tmp_path
    sanitize = os.environ.get("HSS_HYPOTHESIS_PROFILE") == "sanitize"   # compute-sanitizer: a short run
    examples, steps = (3, 10) if sanitize else (20, 30) if ON_GPU else (6, 15)
    run_state_machine_as_test(DeviceStepMachine, settings=settings(max_examples=examples, stateful_step_count=steps,
                                                                    deadline=None))


def test_the_comparisons_bite(ctx, tmp_path, rng) -> None:
    """Under eviction pressure a residency model with the victim order reversed disagrees with the device, and the
    output misses the bound of attention over S less one page (the page holding the largest logit)."""
    w = World(ctx, tmp_path / "kv", rng, blocks=16)
    for b in range(16):
        w.offload(b)
    hn = Harness(w, max_seqs=2, budget=2, keep_first=1, keep_recent=1, slots=5)
    hn.model.tables = [list(range(16)), list(rng.permutation(16)[:11])]
    wrong = {key: Slots(list(v.page), list(v.stamp)) for key, v in hn.model.slots.items()}
    diverged = bites = 0
    for i in range(6):
        q = w.query(2)
        seen = model_step(hn, q, 2, what=f"step {i}")
        for layer, (chosen, out) in enumerate(seen):
            for r, S in enumerate(chosen):
                wrong[r, layer].step(S, hn.model.steps[r], "reversed")
                ps, sp, stamps, _ = hn.step.residency(w.stream, layer, r)
                diverged += sp.tolist() != wrong[r, layer].page
                ids = hn.model.tables[r]
                k, v = (np.stack([a[layer, ids[p]] for p in S]) for a in (w.k, w.v))
                top = int(np.argmax(aref.logits(q[r], k.reshape(-1, *k.shape[2:])).max(axis=1))) // k.shape[1]
                less = [np.concatenate(np.delete(a, top, 0)) for a in (k, v)]
                assert_bites(out[r], aref.attention(q[r], *less), "bf16", (1,), f"step {i}: S less page {S[top]}")
                bites += 1
    assert diverged and bites == 6 * 2 * 2, "the reversed victim order must disagree with the device somewhere"
    hn.close()
    w.close()


def test_a_covering_budget_reads_once_then_only_hits(ctx, tmp_path, rng) -> None:
    """A sequence with at most sel_cap pages attends every page: the first step reads them all, later ones are all
    hits; a reset row reads again; a padded row attends nothing and keeps its state."""
    w = World(ctx, tmp_path / "kv", rng, blocks=8)
    for b in range(8):
        w.offload(b)
    hn = Harness(w, max_seqs=3, budget=3, keep_first=1, keep_recent=2)
    hn.model.tables = [list(range(6)), [7, 3], [5]]
    for i in range(3):
        model_step(hn, w.query(3), 2, what=f"step {i}")
    c = hn.step.counters(w.stream)
    assert c.misses[:, 0].tolist() == [6, 2, 0] and c.hits[:, 0].tolist() == [12, 4, 0]
    hn.step.reset(w.stream, 0)
    hn.model.reset(0)
    model_step(hn, w.query(3), 3, what="after the reset")
    c = hn.step.counters(w.stream)
    assert c.misses[:, 1].tolist() == [6, 2, 1] and c.hits[:, 1].tolist() == [0, 6, 0]
    hn.close()
    w.close()


def test_token_counts_select_over_the_complete_pages(ctx, tmp_path, rng) -> None:
    """begin_step(token_counts=): each row's complete pages are (visible - 1) // block_size (the newest page, still
    open, is the caller's tail tile), its tokens on the newest page in tail_counts; the step is the model's over the
    complete pages."""
    w = World(ctx, tmp_path / "kv", rng, blocks=16)
    for b in range(16):
        w.offload(b)
    hn = Harness(w, max_seqs=4, budget=2, keep_first=1, keep_recent=1)
    bs = w.model.block_size
    visible = np.array([9 * bs + 5, 3 * bs, 1, 0], np.int32)
    seqs = [[int(b) for b in rng.permutation(16)] for _ in range(4)]
    tok = cm.DeviceBuffer(visible.nbytes)
    for i in range(3):
        hn.model.tables = [ids[:max(int(v) - 1, 0) // bs] for ids, v in zip(seqs, visible)]
        q = w.query(4)
        hn.feed(q, 3)
        cm.copy_h_to_d_async(tok, visible, visible.nbytes, w.stream)
        hn.step.begin_step(w.stream, hn.tables, None, 3, token_counts=tok)
        for r in range(3):
            hn.model.steps[r] += 1
        for layer in range(hn.L):
            hn.step.attend_layer(w.stream, layer, hn.q, hn.outs[layer])
            check_layer(hn, layer, q, 3, download(hn.outs[layer], q.shape, BF16, w.stream), f"step {i}")
        pages = download(hn.step.page_counts, (3,), np.int32, w.stream)
        tails = download(hn.step.tail_counts, (3,), np.int32, w.stream)
        want = [max(int(v) - 1, 0) // bs for v in visible[:3]]
        assert pages.tolist() == want and tails.tolist() == [int(v) - p * bs for v, p in zip(visible, want)], i
        assert i or (want, tails.tolist()) == ([9, 2, 0], [5, bs, 1])
        check_counters(hn, f"step {i}")
        visible[:3] += [bs, 1, 2 * bs]
    tok.close()
    hn.close()
    w.close()


# -- graphs -------------------------------------------------------------------------------------------------------
def twins(ctx, path, rng, R: int = 3) -> tuple[World, Harness, Harness, list[list[int]]]:
    w = World(ctx, path, rng, blocks=24)
    for b in range(24):
        w.offload(b)
    make = lambda: Harness(w, max_seqs=R, budget=3, keep_first=1, keep_recent=2, slots=8, max_pages=20)  # noqa
    seqs = [[int(b) for b in rng.choice(24, 20)] for _ in range(R)]
    return w, make(), make(), seqs


def grow(hn: Harness, seqs: list[list[int]], i: int) -> None:
    """Step i's page counts: ragged, growing, capped at max_pages."""
    for r, ids in enumerate(seqs):
        hn.model.tables[r] = ids[:min(len(ids), 2 + 3 * r + i // (2 + r))]


def test_captured_step_replays_equal_eager_steps(ctx, tmp_path, rng) -> None:
    """begin_step + every layer captured once (rows from a device i32 [1]) and replayed 50 times, the real row count,
    the queries and the page counts changed between replays: the outputs' bits, the residency, the step numbers and
    the counters equal 50 eager steps of a twin."""
    w, eager, graphed, seqs = twins(ctx, tmp_path / "kv", rng)
    s = w.stream
    grow(graphed, seqs, 0)
    graphed.feed(w.query(3), 3)
    cm.stream_sync(s)
    cm.begin_capture(s)
    graphed.run()
    graph = cm.end_capture(s)
    for i in range(50):
        q, real = w.query(3), int(rng.integers(1, 4))
        for hn in (eager, graphed):
            grow(hn, seqs, i)
            hn.feed(q, real)
        eager.run()
        graph.launch(s)
        a, b = eager.outputs(), graphed.outputs()
        assert np.array_equal(bits(a), bits(b)), f"replay {i} (rows {real}): output bits differ from the eager step"
        assert not bits(a[:, real:]).any(), f"replay {i}: padded rows must be zeros"
        if i % 10 == 9:
            assert same_state(eager.state(), graphed.state()), f"replay {i}: residency or counters differ"
    final = graphed.state()
    assert same_state(eager.state(), final) and final[1].sum() and final[2].sum(), "hits and misses both happened"
    graph.close()
    for hn in (eager, graphed):
        hn.close()
    w.close()


@pytest.mark.gpu
def test_torch_graph_capture(ctx, tmp_path, rng) -> None:
    """The same step captured by torch.cuda.graph on a torch stream and replayed: an eager twin's bits and state."""
    torch = pytest.importorskip("torch")
    w, eager, graphed, seqs = twins(ctx, tmp_path / "kv", rng)
    side = torch.cuda.Stream()
    graphed.stream = side.cuda_stream
    cm.stream_sync(w.stream)
    grow(graphed, seqs, 0)
    graphed.feed(w.query(3), 3)
    cm.stream_sync(graphed.stream)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side):
        with torch.cuda.graph(g, stream=side):
            graphed.run()
    for i in range(20):
        q, real = w.query(3), int(rng.integers(1, 4))
        for hn in (eager, graphed):
            grow(hn, seqs, i)
            hn.feed(q, real)
        eager.run()
        with torch.cuda.stream(side):
            g.replay()
        assert np.array_equal(bits(eager.outputs()), bits(graphed.outputs())), f"replay {i}"
    assert same_state(eager.state(), graphed.state())
    del g
    for hn in (eager, graphed):
        hn.close()
    w.close()


# -- bad input ----------------------------------------------------------------------------------------------------
def test_construction_refuses_what_it_cannot_serve(ctx, tmp_path, rng) -> None:
    w = World(ctx, tmp_path / "kv-file", rng, blocks=4, store="file")
    with pytest.raises(HssError, match="store='host'"):
        DeviceSparseStep(w.h, w.stream, max_seqs=2, budget_pages=1)
    w.close()
    w = World(ctx, tmp_path / "kv", rng, blocks=12)
    h, s = w.h, w.stream
    make = lambda **kw: DeviceSparseStep(h, s, **{"max_seqs": 2, "budget_pages": 2, **kw})   # noqa: E731
    for kw, err, words in [
        (dict(slots=6), HssError, r"slots = 6 must be in 7\.\.16777215"),
        (dict(budget_pages=0, keep_first=0, keep_recent=0), HssError, "must be >= 1: a step attends at least one"),
        (dict(max_seqs=0), HssError, r"max_seqs = 0 must be in 1\.\.65535"),
        (dict(max_seqs=65536), HssError, r"max_seqs = 65536 must be in 1\.\.65535"),
        (dict(max_seqs=2.0), TypeError, "max_seqs must be an int"),
        (dict(budget_pages=-1), HssError, "budget_pages = -1 must be >= 0"),
        (dict(keep_recent=True), TypeError, "keep_recent must be an int, got bool"),
        (dict(max_pages=13), HssError, r"max_pages = 13 must be in 1\.\.12"),
        (dict(slots=30000), HssError, "shared memory for the selection"),
        (dict(ctx="ctx"), TypeError, "ctx must be a CudaCtx or None")]:
        with pytest.raises(err, match=words):
            make(**kw)
    with pytest.raises(TypeError, match="swap must be a HighSpeedSwap, not str"):
        DeviceSparseStep("swap", s, max_seqs=2, budget_pages=1)
    with make(slots=7, keep_first=0) as step:
        assert (step.slots, step.sel_cap, step.max_pages) == (7, 6, 12)
    w.close()


def test_bad_arguments_raise_before_any_device_work_and_change_nothing(ctx, tmp_path, rng, monkeypatch) -> None:
    w = World(ctx, tmp_path / "kv", rng, blocks=12)
    for b in range(12):
        w.offload(b)
    hn = Harness(w, max_seqs=2, budget=2, keep_first=1, keep_recent=1)
    step, s, h = hn.step, w.stream, w.h
    with pytest.raises(HssError, match="call begin_step first"):
        step.attend_layer(s, 0, hn.q, hn.outs[0])
    hn.model.tables = [list(range(10)), list(range(5))]
    for i in range(2):
        model_step(hn, w.query(2), 2, what=f"step {i}")
    before = hn.state()
    row = 2 * 2 * DIMS["num_q_heads"] * DIMS["head_dim"]   # bytes of q (and out): bf16 [max_seqs = 2, nq, hd]
    small, both = cm.DeviceBuffer(64), cm.DeviceBuffer(2 * row)
    i32 = hn.counts.view(np.float32)
    two = cm.device_count() >= 2     # the emulator offers two devices (tests/conftest.py)
    c1 = cm.CudaCtx(1) if two else None
    q1, t1 = (cm.DeviceBuffer(hn.q.bytes, c1), cm.DeviceBuffer(hn.tables.bytes, c1)) if two else (None, None)
    cm.stream_sync(s)
    work = record_device_work(monkeypatch)
    begin = lambda t=hn.tables, c=hn.counts, rows=2, **kw: step.begin_step(s, t, c, rows, **kw)   # noqa: E731
    attend = lambda layer=0, q=hn.q, out=hn.outs[0], st_=s: step.attend_layer(st_, layer, q, out)  # noqa: E731
    other_device = [
        (lambda: begin(t=t1), HssError, "block_tables is memory of device 1, but this call runs on device 0"),
        (lambda: step.begin_step(c1.stream, hn.tables, hn.counts, 2), HssError, "is a stream of device 1"),
        (lambda: attend(q=q1), HssError, "q is memory of device 1, but this call runs on device 0"),
        (lambda: attend(st_=c1.stream), HssError, "is a stream of device 1")] if two else []
    for call, err, words in other_device + [
        (lambda: begin(t=small), HssError, r"block_tables holds 64 bytes but 96 are needed \(i32 \[max_seqs, "
         r"max_pages\] = \[2, 12\]"),
        (lambda: begin(t=hn.tables.view(np.float32)), HssError, "block_tables holds f32 but i32 is needed"),
        (lambda: begin(c=i32), HssError, "page_counts holds f32 but i32 is needed"),
        (lambda: begin(c=small.ptr + 60), HssError, "page_counts: 8 bytes at offset 60 run past"),
        (lambda: begin(c=None), HssError, "pass page_counts .* or token_counts="),
        (lambda: begin(token_counts=hn.counts), HssError, "one of the two"),
        (lambda: begin(t=step.scores), HssError, "block_tables .* overlaps the DeviceSparseStep's scores"),
        (lambda: begin(t=step.pool.ptr + 64), HssError, "block_tables .* overlaps the DeviceSparseStep's pool"),
        (lambda: begin(c=step.page_counts), HssError, "page_counts .* overlaps the DeviceSparseStep's page_counts"),
        (lambda: begin(t=h.predictor.a_g_dev_ptr), HssError, "block_tables .* overlaps the predictor's A_g store"),
        (lambda: begin(c=h.store.buffer.device_ptr()), HssError, "page_counts .* overlaps"),
        (lambda: begin(rows=step.rows_dev), HssError, "rows .* overlaps the DeviceSparseStep's rows_dev"),
        (lambda: begin(rows=0), HssError, r"rows = 0 must be in 1\.\.2"),
        (lambda: begin(rows=3), HssError, r"rows = 3 must be in 1\.\.2"),
        (lambda: begin(rows=True), TypeError, "rows: cannot use bool"),
        (lambda: begin(rows=2.0), TypeError, "rows: cannot use float"),
        (lambda: step.begin_step(None, hn.tables, hn.counts, 2), TypeError, "stream: a stream is required"),
        (lambda: attend(q=small), HssError, r"q holds 64 bytes but \d+ are needed \(the queries bf16 \[max_seqs, "
         r"num_q_heads, head_dim\] = \[2, \d+, \d+\]\)"),
        (lambda: attend(out=small), HssError, r"out holds 64 bytes but \d+ are needed"),
        (lambda: attend(q=hn.q.view(np.float32)), HssError, "q holds f32 but bf16 is needed"),
        (lambda: attend(out=hn.outs[1].view(np.int16)), HssError, "out holds i16 but bf16 is needed"),
        (lambda: attend(out=hn.q), HssError, "out overlaps q"),
        (lambda: attend(q=both.ptr, out=both.ptr + row - 16), HssError, "out overlaps q"),
        (lambda: attend(out=hn.outs[1].ptr + 2), HssError, "out .* must be 16-byte aligned"),
        (lambda: attend(out=step.pool), HssError, "out .* overlaps the DeviceSparseStep's pool"),
        (lambda: attend(out=step.attention.o), HssError, "out .* overlaps its o, memory that this DeviceSparseStep's "
         "attention owns"),
        (lambda: attend(q=step.attention.o.ptr + 64), HssError, "q .* overlaps its o"),
        (lambda: attend(q=step.pool), HssError, "q .* overlaps the DeviceSparseStep's pool"),
        (lambda: attend(out=h.predictor.a_g_dev_ptr), HssError, "out .* overlaps the predictor's A_g store"),
        (lambda: attend(out=h.store.buffer.device_ptr()), HssError, "out .* overlaps"),
        (lambda: attend(layer=2), HssError, r"layer 2 is out of range: there are 2 layers"),
        (lambda: attend(layer=-1), HssError, "layer -1 is out of range"),
        (lambda: attend(layer=1.0), TypeError, "layer must be an int, got float"),
        (lambda: attend(layer=True), TypeError, "layer must be an int, got bool"),
        (lambda: step.reset(s, [0, 2]), HssError, r"rows 2 is out of range: there are 2 rows"),
        (lambda: step.reset(s, 1.0), TypeError, "rows must be a row index, a sequence of them or None"),
        (lambda: step.reset(s, [0, True]), TypeError, "rows must be an int, got bool"),
        (lambda: step.residency(s, 2, 0), HssError, "layer 2 is out of range"),
        (lambda: step.residency(s, 0, 2), HssError, "row 2 is out of range")]:
        with pytest.raises(err, match=words):
            call()
        assert work == [], f"{words}: device work was queued before the error"
    step.selection(s)
    assert work, "the control: a good call is recorded"
    monkeypatch.undo()
    assert same_state(hn.state(), before), "a refused call changed the residency, step numbers or counters"
    model_step(hn, w.query(2), 1, what="after the refused calls")     # the next step is the model's
    before = hn.state()
    h.close()
    for call in (lambda: begin(), lambda: attend(), lambda: step.reset(s), lambda: step.counters(s)):
        with pytest.raises(HssError, match="its HighSpeedSwap is closed"):
            call()
    step.close()
    assert step.closed
    step.close()   # idempotent
    for call in (lambda: begin(), lambda: attend(), lambda: step.reset(s), lambda: step.selection(s),
                 lambda: step.residency(s, 0, 0)):
        with pytest.raises(HssError, match="DeviceSparseStep.* it is closed"):
            call()
    for b in (small, both, hn.tables, hn.counts, hn.rows, hn.q, *hn.outs, *((q1, t1, c1) if two else ())):
        b.close()
