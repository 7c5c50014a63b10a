"""Tests for hss.qsa.select: the host top-k of decode_select (docs/design.md §11.4 steps 6-7) in the docs/design.md
§17.1 order (NaN below every number), pure Python."""
from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from hss.cuda._driver import HssError
from hss.qsa.select import select_tokens, selection_size, top_blocks

# Few distinct values so that ties (and -0.0 against 0.0) are common.
TIE_VALUES = [0.0, -0.0, 0.5, 1.0, 2.0, -1.0, math.inf, -math.inf, 1e-30]
finite = st.one_of(st.sampled_from([v for v in TIE_VALUES if math.isfinite(v)]),
                   st.floats(-1e6, 1e6, allow_nan=False, width=32))
with_nan = st.one_of(finite, st.sampled_from(TIE_VALUES + [math.nan]))


def spec_order(s: list[float]) -> list[int]:
    """docs/design.md §17.1 literally: ids sorted by (NaN last, score descending, index ascending); -0.0 == +0.0 by
    value."""
    return sorted(range(len(s)), key=lambda i: (math.isnan(s[i]), 0.0 if math.isnan(s[i]) else -s[i], i))


def original_cmp(s: list[float], a: int, b: int) -> int:
    """The original comparator: scores[b].partial_cmp(scores[a]).unwrap_or(Equal).then(a.cmp(b)); -1 = Less."""
    sa, sb = s[a], s[b]
    if sb < sa:
        return -1
    if sb > sa:
        return 1
    return (a > b) - (a < b)   # Equal (including any NaN): by index


def expand(blocks, ratio: int, visible: int) -> list[int]:
    complete = visible // ratio
    return [b * ratio + r for b in sorted(blocks) for r in range(ratio)] + list(range(complete * ratio, visible))


@given(st.lists(finite, min_size=0, max_size=60), st.integers(0, 70), st.integers(1, 5), st.integers(0, 3),
       st.integers(0, 8))
def test_select_tokens_is_the_exact_top_k_without_nan(values, block_topk, ratio, tail, extra):
    complete = len(values)
    visible = complete * ratio + min(tail, ratio - 1)
    scores = np.array(values + [7.0] * extra, dtype=np.float32)   # entries past `complete` are never read
    got = select_tokens(scores, block_topk, ratio, visible)
    s = [float(v) for v in scores[:complete]]
    order = sorted(range(complete), key=lambda i: (-s[i], i))
    k = min(block_topk, complete)
    assert got.dtype == np.int32
    assert got.size == selection_size(block_topk, ratio, visible) == k * ratio + visible % ratio
    assert got.tolist() == expand(order[:k], ratio, visible)
    assert (np.diff(got) > 0).all()
    assert got[got.size - visible % ratio:].tolist() == list(range(complete * ratio, visible))   # the tail


@given(st.lists(with_nan, min_size=0, max_size=45))
def test_order_is_spec_17_1(values):
    s = np.array(values, dtype=np.float64)
    order = top_blocks(s, len(values)).tolist()
    assert order == spec_order([float(v) for v in s])
    numbers = [i for i in order if not math.isnan(s[i])]
    assert order[:len(numbers)] == numbers   # every number before every NaN, the NaNs by index
    for a, b in zip(numbers, numbers[1:]):   # among numbers the original comparator agrees
        assert original_cmp(list(s), a, b) < 0


@given(st.lists(with_nan, min_size=1, max_size=45), st.integers(0, 50), st.integers(1, 4), st.integers(0, 3))
def test_select_tokens_with_nan_takes_the_first_k_of_that_order(values, block_topk, ratio, tail):
    complete = len(values)
    visible = complete * ratio + min(tail, ratio - 1)
    for dtype in (np.float32, np.float64):
        s = np.array(values, dtype=dtype)
        got = select_tokens(s, block_topk, ratio, visible)
        k = min(block_topk, complete)
        want = spec_order([float(v) for v in s])[:k]
        assert got.tolist() == expand(want, ratio, visible)
        assert got.dtype == np.int32 and (np.diff(got) > 0).all()
        assert top_blocks(s, k).tolist() == want


def test_nan_ranks_below_every_number():
    nan, inf = math.nan, math.inf
    assert top_blocks(np.array([1.0, nan, 5.0, 3.0]), 4).tolist() == [2, 3, 0, 1]
    assert top_blocks(np.array([nan, 1.0, 5.0, 3.0]), 4).tolist() == [2, 3, 1, 0]
    assert top_blocks(np.array([nan, -inf, nan, -1e30]), 4).tolist() == [3, 1, 0, 2]   # -inf above NaN
    assert top_blocks(np.array([nan, -inf, nan, -1e30]), 3).tolist() == [3, 1, 0]
    assert select_tokens(np.array([1.0, nan, 5.0, 3.0], np.float32), 2, 1, 4).tolist() == [2, 3]
    assert select_tokens(np.array([nan, nan, 5.0, nan], np.float32), 3, 2, 9).tolist() == [0, 1, 2, 3, 4, 5, 8]
    # quiet, negative and signalling NaNs, then -inf: every NaN pattern ranks below -inf
    bits = np.array([0x7FC00000, 0xFFC00001, 0x7F800001, 0xFF800000], np.uint32)
    assert select_tokens(bits.view(np.float32), 2, 1, 4).tolist() == [0, 3]


def test_signed_zeros_tie_by_index():
    s = np.array([-0.0, 0.0, -0.0, 0.0, 1.0], dtype=np.float32)
    assert top_blocks(s, 5).tolist() == [4, 0, 1, 2, 3]
    assert select_tokens(s, 2, 2, 10).tolist() == [0, 1, 8, 9]


def test_large_random_matches_a_sort():
    rng = np.random.default_rng(7)
    s = rng.integers(0, 50, 8192).astype(np.float32)   # many ties at the cut-off
    got = select_tokens(s, 512, 4, 8192 * 4 + 3)
    order = np.lexsort((np.arange(s.size), -s))[:512]
    assert got.tolist() == expand(order.tolist(), 4, 8192 * 4 + 3)
    assert top_blocks(s, 512).tolist() == order.tolist()


def test_spec_inert_numbers():
    # docs/design.md §14: "2048 visible masks nothing, 2052 masks 4" (ratio 4, block_topk 512)
    rng = np.random.default_rng(1)
    s = rng.random(600).astype(np.float32)
    for visible, size in ((2048, 2048), (2051, 2051), (2052, 2048), (2053, 2049), (2055, 2051), (2056, 2048)):
        got = select_tokens(s, 512, 4, visible)
        assert got.size == size == selection_size(512, 4, visible)
        assert visible - got.size == (0 if visible // 4 <= 512 else visible - 2048 - visible % 4)


def test_out_buffer_is_filled_and_returned():
    out = np.full(16, -5, dtype=np.int32)
    got = select_tokens(np.array([3.0, 1.0, 2.0]), 2, 4, 14, out=out)
    assert got.base is out or got is out[:10] or np.shares_memory(got, out)
    assert out[:10].tolist() == [0, 1, 2, 3, 8, 9, 10, 11, 12, 13] and out[10:].tolist() == [-5] * 6


@pytest.mark.parametrize("kwargs, match", [
    (dict(scores=[1.0], block_topk=-1, ratio=1, visible=1), "block_topk"),
    (dict(scores=[1.0], block_topk=1, ratio=0, visible=1), "ratio"),
    (dict(scores=[1.0], block_topk=1, ratio=1, visible=-1), "visible"),
    (dict(scores=[1.0], block_topk=1, ratio=1, visible=2), "2 complete blocks need 2 scores"),
    (dict(scores=[[1.0]], block_topk=1, ratio=1, visible=1), "one-dimensional"),
    (dict(scores=[1.0], block_topk=1, ratio=1, visible=2**31), "int32"),
    (dict(scores=[1.0], block_topk=1, ratio=1, visible=1, out=np.empty(4, np.int64)), "out must be"),
    (dict(scores=[1.0], block_topk=1, ratio=1, visible=1, out=np.empty(0, np.int32)), "out must be"),
])
def test_select_tokens_errors(kwargs, match):
    with pytest.raises(HssError, match=match):
        select_tokens(**kwargs)


def test_type_errors():
    with pytest.raises(TypeError, match="real numbers"):
        select_tokens(np.array(["a"]), 1, 1, 1)
    with pytest.raises(TypeError, match="block_topk must be an int, got float 1.5"):
        select_tokens([1.0], 1.5, 1, 1)
    with pytest.raises(TypeError, match="ratio must be an int, got bool"):
        select_tokens([1.0], 1, True, 1)
    with pytest.raises(TypeError, match="visible must be an int, got float"):
        select_tokens([1.0], 1, 1, np.float64(1))
    with pytest.raises(HssError, match="k = -1 must be >= 0"):
        top_blocks([1.0], -1)
    with pytest.raises(TypeError, match="k must be an int, got float"):
        top_blocks([1.0], 1.0)


def test_numpy_integer_arguments():
    """numpy integers are Python ints before any arithmetic: np.int8 visible past 127 cannot wrap."""
    s = np.arange(40, dtype=np.float32)
    want = select_tokens(s, 3, 4, 130)
    assert select_tokens(s, np.int8(3), np.uint8(4), np.int16(130)).tolist() == want.tolist()
    assert top_blocks(s, np.int64(3)).tolist() == [39, 38, 37]
