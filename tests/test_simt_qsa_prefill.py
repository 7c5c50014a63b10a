"""``ptx/qsa_indexer.cu``'s tensor-core prefill kernels, ``qsa_score_rows_tc`` and ``qsa_prefill_attn_tc``, compiled for
the CPU and run through the SIMT harness (tests/simt: ldmatrix / mma.sync / cp.async as warp calls) against their
staged float64 references, under the rules of test_qsa_prefill_kernels: the scorer within the derived split-q bound
(``helpers.tc_bound``; the harness's mma sums in double, inside it) with masked entries exactly -1e30 and nothing
written past n_blocks or the rows, the same bits for any grid.y and thread schedule; the attention under the bf16
rule, on the original's small case (LCG data) too; dropping a head or the heaviest token breaks each bound.
"""
from __future__ import annotations

import numpy as np
import pytest
import simt
from hypothesis import given, settings
from hypothesis import strategies as st
from test_qsa_prefill_kernels import (
    SCALES,
    _attn_case,
    _check_score_layout,
    _drop_heaviest_token,
    _score_case,
    _std,
    check_score_tc,
    draw_attn_case,
    draw_score_tc_case,
    original_small_case,
)

from hss.decls import qsa_prefill as kq
from hss.reference import qsa_prefill as ref

from helpers import BF16, assert_bites, assert_close, tc_bound


@pytest.fixture(scope="module")
def program() -> simt.Program:
    simt.require()
    return simt.build(simt.PTX_DIR / "qsa_indexer.cu")


def scores_tc(program, q, keys, first_pos, ratio, n_blocks, stride, groups=None, schedule="ascending"):
    """qsa_score_rows_tc's whole [rows + 1, stride] output, NaN before the launch."""
    rows = q.shape[0]
    g = kq.score_rows_tc_geometry(rows, n_blocks, groups)
    full = np.full((rows + 1, stride), np.nan, np.float32)
    program.kernel("qsa_score_rows_tc", kq.QSA_SCORE_ROWS_TC)(
        g.grid, g.block, g.shared, np.ascontiguousarray(q), keys, full, first_pos, stride, ratio, n_blocks, rows,
        schedule=schedule)
    return full


def attn_tc(program, q, k_cache, v_cache, table, lists, first_pos, ratio, inv, schedule="ascending"):
    """qsa_prefill_attn_tc's [rows, nq, hd] output (float64), the row past them checked untouched."""
    rows, nq, hd = q.shape
    _, bs, nkv, _ = k_cache.shape
    g = kq.prefill_attn_tc_geometry(rows, nkv)
    out = np.full((rows + 1, nq, hd), np.nan, np.float32).astype(BF16)
    program.kernel("qsa_prefill_attn_tc", kq.QSA_PREFILL_ATTN_TC)(
        g.grid, g.block, g.shared, q, k_cache, v_cache, table, np.ascontiguousarray(lists), out, first_pos,
        lists.shape[1], ratio, bs, nq, nkv, hd, inv, schedule=schedule)
    assert np.isnan(out[rows].astype(np.float32)).all(), "qsa_prefill_attn_tc wrote past its rows"
    return out[:rows].astype(np.float64)


@pytest.mark.parametrize("scale", SCALES)
def test_score_rows_tc_matches_the_reference(program, rng, scale):
    rows, first_pos, ratio = 37, 150, 4
    q, keys, n_blocks, stride = _score_case(rng, rows, first_pos, ratio, kq.TC_HEADS, kq.TC_HD, _std(scale, kq.TC_HD))
    full = scores_tc(program, q, keys, first_pos, ratio, n_blocks, stride)
    again = scores_tc(program, q, keys, first_pos, ratio, n_blocks, stride, groups=1, schedule=int(rng.integers(99)))
    assert np.array_equal(full.view(np.uint32), again.view(np.uint32)), "the bits depend on grid.y or the schedule"
    check_score_tc(full, q, keys, first_pos, ratio, n_blocks)


@settings(max_examples=max(4, settings().max_examples // 4))
@given(data=st.data())
def test_score_rows_tc_shapes(program, data):
    q, keys, first_pos, ratio, n_blocks, stride, groups = draw_score_tc_case(data, 24, 300)
    rows = q.shape[0]
    full = scores_tc(program, q, keys, first_pos, ratio, n_blocks, stride, groups)
    got, valid = _check_score_layout(full, rows, n_blocks, first_pos, ratio, "qsa_score_rows_tc")
    want = ref.score_rows(q, keys, first_pos, ratio, n_blocks)
    assert_close(got, want, "f32", (1,), "qsa_score_rows_tc", valid=valid, tol=tc_bound(q, keys, want))


@pytest.mark.parametrize("scale", SCALES)
def test_prefill_attn_tc_gqa_12_to_1(program, rng, scale):
    rows, topk, first_pos, nq, nkv, hd, ratio, bs = 2, 12, 90, 24, 2, 256, 4, 16
    case = _attn_case(rng, rows, nq, nkv, hd, topk, ratio, bs, first_pos, _std(scale, hd))
    inv = float(np.float32(hd ** -0.5))
    got = attn_tc(program, *case, first_pos, ratio, inv)
    assert_close(got, ref.prefill_attn(*case, first_pos, ratio, inv), "bf16", (2,), "qsa_prefill_attn_tc")
    assert_bites(got, _drop_heaviest_token(*case, first_pos, ratio, inv), "bf16", (2,),
                 "qsa_prefill_attn_tc, heaviest token dropped")
    again = attn_tc(program, *case, first_pos, ratio, inv, schedule="warps-descending")
    assert np.array_equal(got, again), "the bits depend on the thread schedule"


def test_prefill_attn_tc_original_small_case(program):
    """The upstream attention test (docs/design.md §14; test_qsa_prefill_kernels has it on the device)."""
    case, first_pos, ratio, inv = original_small_case()
    got = attn_tc(program, *case, first_pos, ratio, inv)
    want = ref.prefill_attn(*case, first_pos, ratio, inv)
    assert_close(got, want, "bf16", (2,), "qsa_prefill_attn_tc, docs/design.md §14 case")
    cos = (got * want).sum(-1) / (np.linalg.norm(got, axis=-1) * np.linalg.norm(want, axis=-1))
    assert cos.min() > 0.999, f"recorded parity: worst cosine {cos.min()}"


@settings(max_examples=max(4, settings().max_examples // 4))
@given(data=st.data())
def test_prefill_attn_tc_shapes(program, data):
    case, first_pos, ratio, inv = draw_attn_case(data, "tc", 2, [1, 3, 8, 16], 8, 3, 40)
    got = attn_tc(program, *case, first_pos, ratio, inv)
    assert_close(got, ref.prefill_attn(*case, first_pos, ratio, inv), "bf16", (2,), "qsa_prefill_attn_tc")
