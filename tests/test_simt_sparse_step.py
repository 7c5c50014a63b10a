"""``ptx/sparse_step.cu``'s ``sparse_select`` (the device sparse swap step's page selection and slot residency,
docs/design.md §17.8) compiled for the CPU and run through the SIMT harness, against its emulation through
:mod:`hss.reference.sparse_step` on the same inputs, bit for bit: the attended slots and their count, the reads (store
page, slot) of the misses in order, the updated page -> slot and slot -> page maps and stamps, the hit / miss counts,
the rows past ``rows[0]`` zeroed; with scores (ties, NaN) and with the folded per-head scores (``num_heads`` > 0:
compared under the f32 rule, the harness's exp2f not being a GPU's ex2.approx). States are random but keep the
invariant (page_slot and slot_page inverse where set); several steps run one after another on the same state; the
thread schedule does not change the result.
"""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import simt
from hypothesis import given, settings
from hypothesis import strategies as st

from hss.decls import sparse_step as kd
from hss.decls._decl import Launch

from helpers import assert_close

SLOT_BASE, SRC_BASE = 1000, 50_000


@pytest.fixture(scope="module")
def program() -> simt.Program:
    simt.require()
    return simt.build(simt.PTX_DIR / "sparse_step.cu")


def make_state(rng, R: int, stride: int, slots: int, max_blocks: int) -> dict:
    """Random inputs of one layer: scores (ties and NaN), counts, table ids (some outside A_g), a consistent
    residency (each row: some pages in distinct slots), stamps and steps."""
    scores = rng.choice(np.array([0.5, 1.0, 2.0, np.nan], np.float32), (R, stride)) \
        if rng.random() < 0.3 else rng.standard_normal((R, stride)).astype(np.float32)
    scores[rng.random((R, stride)) < 0.05] = np.nan
    page_slot = np.full((R, stride), -1, np.int32)
    slot_page = np.full((R, slots), -1, np.int32)
    for s in range(R):
        k = int(rng.integers(0, min(slots, stride) + 1))
        pages = rng.choice(stride, k, replace=False)
        where = rng.choice(slots, k, replace=False)
        page_slot[s, pages] = where
        slot_page[s, where] = pages
    return dict(
        scores=scores, counts=rng.integers(-2, stride + 3, R).astype(np.int32),
        table=rng.integers(-1, max_blocks + 2, (R, stride)).astype(np.int32),
        page_slot=page_slot, slot_page=slot_page,
        slot_stamp=rng.integers(0, 50, (R, slots)).astype(np.int32), step=rng.integers(50, 60, R).astype(np.int32))


def outputs(R: int, cap: int) -> dict:
    return dict(attend=np.full((R, cap), -7, np.int32), attend_counts=np.full(R, -7, np.int32),
                fetch=np.full((R, cap, 2), -7, np.int32), fetch_counts=np.full(R, -7, np.int32),
                stats=np.arange(2 * R, dtype=np.int64).reshape(R, 2))


def select(program, state: dict, out: dict, rows: int, params: dict, heads: np.ndarray | None,
           schedule: str | int = "ascending") -> None:
    R, stride = state["scores"].shape
    slots = state["slot_page"].shape[1]
    g = kd.select_geometry(R, stride, slots, params["sel_cap"])
    hs = heads if heads is not None else np.zeros(1, np.float32)
    program.kernel("sparse_select", kd.SPARSE_SELECT)(
        g.grid, g.block, g.shared, rows=np.array([rows], np.int32), head_scores=hs,
        num_heads=0 if heads is None else heads.shape[2], stride=stride, slots=slots, slot_base=SLOT_BASE,
        src_base=SRC_BASE, schedule=schedule, **state, **out, **params)


def emulate(state: dict, out: dict, rows: int, params: dict, heads: np.ndarray | None) -> None:
    """The declaration's emulation (hss.reference.sparse_step) over the same arrays, in place."""
    R, stride = state["scores"].shape
    slots = state["slot_page"].shape[1]
    hs = heads if heads is not None else np.zeros(1, np.float32)
    views = {k: v.reshape(-1).view(np.uint8) for k, v in {**state, **out}.items()}
    a = SimpleNamespace(rows=np.array([rows], np.int32).view(np.uint8), head_scores=hs.reshape(-1).view(np.uint8),
                        num_heads=0 if heads is None else heads.shape[2], stride=stride, slots=slots,
                        slot_base=SLOT_BASE, src_base=SRC_BASE, **views, **params)
    g = kd.select_geometry(R, stride, slots, params["sel_cap"])
    assert kd.SPARSE_SELECT.check(a, Launch(g.grid, g.block, g.shared)) is None
    kd.SPARSE_SELECT.emulate(a, Launch(g.grid, g.block, g.shared))


@settings(max_examples=max(6, settings().max_examples // 3))
@given(data=st.data())
def test_select_equals_its_reference(program, data):
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="seed"))
    R = data.draw(st.integers(1, 4), label="R")
    budget, first, recent = (data.draw(st.integers(0, 6), label=n) for n in ("budget", "first", "recent"))
    cap = budget + first + recent
    if cap == 0:
        budget = cap = 1
    stride = data.draw(st.integers(1, 60), label="stride")
    slots = cap + data.draw(st.integers(0, 9), label="spare slots")
    rows = data.draw(st.integers(0, R), label="rows")
    max_blocks = 40
    params = dict(sel_cap=cap, budget=budget, keep_first=first, keep_recent=recent, max_blocks=max_blocks,
                  exp2_scale=1.0)
    state = make_state(rng, R, stride, slots, max_blocks)
    got_state, want_state = ({k: v.copy() for k, v in state.items()} for _ in range(2))
    got_out, want_out = outputs(R, cap), outputs(R, cap)
    for step in range(3):   # one step after another on the same state
        select(program, got_state, got_out, rows, params, None, schedule=int(rng.integers(2**31)))
        emulate(want_state, want_out, rows, params, None)
        for name in (*got_state, *got_out):
            got = {**got_state, **got_out}[name]
            want = {**want_state, **want_out}[name]
            assert got.tobytes() == want.tobytes(), f"step {step}: {name} differs"
        assert (got_out["attend_counts"][:rows] >= 0).all() and (got_out["attend_counts"][rows:] == 0).all()
        for s in (got_state, want_state):
            s["step"] += 1


def test_select_with_folded_head_scores(program, rng):
    R, stride, heads, budget, first, recent = 3, 40, 4, 5, 1, 2
    cap = budget + first + recent
    slots, max_blocks = cap + 3, 30
    params = dict(sel_cap=cap, budget=budget, keep_first=first, keep_recent=recent, max_blocks=max_blocks,
                  exp2_scale=float(np.float32(1.4426950408889634)))
    state = make_state(rng, R, stride, slots, max_blocks)
    state["counts"][:] = [stride, stride - 3, 5]   # selective, selective, every page taken (nothing scored)
    hs = (rng.standard_normal((R, stride, heads)) * 3).astype(np.float32)
    got_state, want_state = ({k: v.copy() for k, v in state.items()} for _ in range(2))
    got_out, want_out = outputs(R, cap), outputs(R, cap)
    select(program, got_state, got_out, R, params, hs)
    emulate(want_state, want_out, R, params, hs)
    for s, n in enumerate(state["counts"]):
        g, w = got_state["scores"][s, :n], want_state["scores"][s, :n]
        assert np.array_equal(np.isnan(g), np.isnan(w)), f"row {s}: NaN scores differ"
        ok = ~np.isnan(w)
        assert_close(g[ok], w[ok], "f32", (0,), f"row {s}: folded per-head scores")
    assert got_state["scores"][2].tobytes() == state["scores"][2].tobytes(), "a row taking every page scores nothing"
    assert not np.array_equal(got_state["scores"][0], state["scores"][0]), "a selective row is scored"
    assert (got_out["attend_counts"] == [cap, cap, 5]).all()
