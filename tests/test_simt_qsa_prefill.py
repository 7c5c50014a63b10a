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
    _assert_bites_tol,
    _attn_case,
    _check_score_layout,
    _drop_heaviest_token,
    _lcg_bf16,
    _score_case,
    _std,
)

from hss._util import ceil_div
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
    got, valid = _check_score_layout(full, rows, n_blocks, first_pos, ratio, "qsa_score_rows_tc")
    want = ref.score_rows(q, keys, first_pos, ratio, n_blocks)
    tol = tc_bound(q, keys, want)
    assert_close(got, want, "f32", (1,), "qsa_score_rows_tc", valid=valid, tol=tol)
    _assert_bites_tol(got, ref.score_rows(q[:, 1:], keys, first_pos, ratio, n_blocks), tol, valid,
                      "qsa_score_rows_tc, one head dropped")


@settings(max_examples=max(4, settings().max_examples // 4))
@given(data=st.data())
def test_score_rows_tc_shapes(program, data):
    rows = data.draw(st.integers(1, 24), label="rows")
    ratio = data.draw(st.integers(1, 5), label="ratio")
    first_pos = data.draw(st.integers(0, 300), label="first_pos")
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="seed"))
    q, keys, n_max, _ = _score_case(rng, rows, first_pos, ratio, kq.TC_HEADS, kq.TC_HD,
                                    _std(data.draw(st.sampled_from(SCALES)), kq.TC_HD))
    n_blocks = data.draw(st.integers(1, max(n_max, 1)), label="n_blocks")
    stride = n_blocks + data.draw(st.integers(0, 6), label="stride extra")
    groups = data.draw(st.integers(1, ceil_div(n_blocks, kq.TC_BLOCKS)), label="grid.y")
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
    rows, nq, nkv, hd, ratio, topk, bs, first_pos = 3, 24, 2, 256, 4, 8, 16, 41
    pages = ceil_div(first_pos + rows, bs)
    s = 1
    q, s = _lcg_bf16(rows * nq * hd, s)
    k, s = _lcg_bf16(pages * bs * nkv * hd, s)
    v, s = _lcg_bf16(pages * bs * nkv * hd, s)
    case = (q.reshape(rows, nq, hd), k.reshape(pages, bs, nkv, hd), v.reshape(pages, bs, nkv, hd),
            np.arange(pages, dtype=np.int32),
            np.array([[(5 * i + r) % 10 for i in range(topk)] for r in range(rows)], dtype=np.int32))
    inv = float(np.float32(hd ** -0.5))
    got = attn_tc(program, *case, first_pos, ratio, inv)
    want = ref.prefill_attn(*case, first_pos, ratio, inv)
    assert_close(got, want, "bf16", (2,), "qsa_prefill_attn_tc, docs/design.md §14 case")
    cos = (got * want).sum(-1) / (np.linalg.norm(got, axis=-1) * np.linalg.norm(want, axis=-1))
    assert cos.min() > 0.999, f"recorded parity: worst cosine {cos.min()}"


@settings(max_examples=max(4, settings().max_examples // 4))
@given(data=st.data())
def test_prefill_attn_tc_shapes(program, data):
    hd = data.draw(st.sampled_from(kq.ATTN_TC_HD), label="hd")
    group = data.draw(st.integers(1, kq.ATTN_TC_MAX_GROUP), label="group")
    nkv = data.draw(st.integers(1, 2), label="nkv")
    ratio = data.draw(st.integers(1, 5), label="ratio")
    bs = data.draw(st.sampled_from([1, 3, 8, 16]), label="block_size")
    topk = data.draw(st.integers(0, 8), label="topk")
    rows = data.draw(st.integers(1, 3), label="rows")
    first_pos = data.draw(st.integers(max(topk * ratio - 1, 0), topk * ratio + 40), label="first_pos")
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="seed"))
    case = _attn_case(rng, rows, group * nkv, nkv, hd, topk, ratio, bs, first_pos,
                      _std(data.draw(st.sampled_from(SCALES), label="scale"), hd))
    inv = float(np.float32(hd ** -0.5))
    got = attn_tc(program, *case, first_pos, ratio, inv)
    assert_close(got, ref.prefill_attn(*case, first_pos, ratio, inv), "bf16", (2,), "qsa_prefill_attn_tc")
