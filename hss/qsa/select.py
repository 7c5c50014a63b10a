"""The indexer's host top-k (docs/design.md §11.4 steps 6-7) as pure functions, under docs/design.md §17.1's total
order.

Blocks are ranked by (score descending, block index ascending) in a total order where NaN ranks below every
number (-inf ranks above NaN) and -0.0 equals +0.0; the first k are chosen. The device top-k
(``qsa_dev_topk``) follows the same rule, so the two choose the same set from the same f32 scores.

The original sorted with ``partial_cmp(..).unwrap_or(Equal)``, which is not a total order once a NaN is present
(its result depended on the sorting algorithm); for scores without NaN the two rules agree, and the result is
unique: hss reproduces it exactly. ``top_blocks`` returns the first k ids in that order; ``select_tokens`` takes
that set, ascending, and expands it to tokens.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from hss import _args
from hss.errors import HssError

__all__ = ["top_blocks", "select_tokens", "selection_size"]


def _scores(scores: Any, complete: int, what: str) -> np.ndarray:
    s = np.asarray(scores)
    if s.ndim != 1:
        raise HssError(f"{what}: scores must be one-dimensional (got shape {s.shape})")
    if not (np.issubdtype(s.dtype, np.floating) or np.issubdtype(s.dtype, np.integer)):
        raise TypeError(f"{what}: scores must be real numbers (got dtype {s.dtype})")
    if not np.issubdtype(s.dtype, np.floating):
        s = s.astype(np.float64)   # so negation cannot wrap
    if s.size < complete:
        raise HssError(f"{what}: {complete} complete blocks need {complete} scores, got {s.size}; "
                       "pass the scores of blocks 0..visible // ratio - 1")
    return s[:complete]


def _full_order(s: np.ndarray) -> np.ndarray:
    """Every id in the docs/design.md §17.1 order: numbers by (score desc, index asc), then the NaNs by index."""
    nan = np.isnan(s)
    return np.lexsort((np.arange(s.size), -np.where(nan, 0, s), nan))   # the last key sorts first


def top_blocks(scores: Any, k: int) -> np.ndarray:
    """The first ``min(k, n)`` ids of ``scores [n]`` in the docs/design.md §17.1 order (score desc, index asc; NaN below
    every number), in that order (not re-sorted), int64."""
    s = _scores(scores, np.asarray(scores).size if np.ndim(scores) == 1 else 0, "top_blocks")
    k = min(_args.as_int("top_blocks: k", k, 0), s.size)
    if 0 < k < s.size:   # order just the k chosen
        chosen = _top_set(s, k)
        nan = np.isnan(s[chosen])
        return chosen[np.lexsort((chosen, -np.where(nan, 0, s[chosen]), nan))]
    return _full_order(s)[:k]


def _top_set(s: np.ndarray, k: int) -> np.ndarray:
    """The ids of the k first in the docs/design.md §17.1 order, ascending, for 0 < k < n: the numbers' top k, or every
    number and the lowest-id NaNs when fewer than k scores are numbers."""
    n = s.size
    top = np.partition(s, n - k)[n - k:]   # a NaN sorts last in a partition: s has one iff top has one
    if np.isnan(top).any():
        nan = np.isnan(s)
        numbers = np.flatnonzero(~nan)
        if k >= numbers.size:
            return np.sort(np.concatenate([numbers, np.flatnonzero(nan)[:k - numbers.size]]))
        return numbers[_top_set(s[numbers], k)]
    blocks = np.flatnonzero(s >= top[0])   # top[0]: the k-th largest score
    extra = blocks.size - k
    if extra:                              # ties at the cut-off: the lowest ids stay
        keep = np.ones(blocks.size, dtype=bool)
        keep[np.flatnonzero(s[blocks] == top[0])[-extra:]] = False
        blocks = blocks[keep]
    return blocks


def selection_size(block_topk: int, ratio: int, visible: int) -> int:
    """Number of selected tokens: ``min(block_topk, visible // ratio) * ratio + visible % ratio``."""
    return min(block_topk, visible // ratio) * ratio + visible % ratio


def select_tokens(scores: Any, block_topk: int, ratio: int, visible: int, out: np.ndarray | None = None) -> np.ndarray:
    """The tokens the query at 0-based position ``visible - 1`` attends: the chosen blocks' tokens, then the tail.

    ``scores``: at least ``complete = visible // ratio`` block scores (only the first ``complete`` are read).
    The ``min(block_topk, complete)`` first blocks under (score desc, index asc; docs/design.md §17.1: NaN below every
    number) are chosen, sorted ascending and expanded to tokens ``b*ratio .. b*ratio + ratio - 1``; the tail
    ``complete*ratio .. visible-1`` follows. Returns int32 ``[selection_size(block_topk, ratio, visible)]``,
    ascending; written into ``out[:size]`` (and a view of it returned) when ``out`` is given.
    """
    block_topk = _args.as_int("select_tokens: block_topk", block_topk, 0)
    ratio = _args.as_int("select_tokens: ratio", ratio, 1)
    visible = _args.as_int("select_tokens: visible", visible, 0, 2**31 - 1,
                           why="the int32 token ids hold at most 2**31 - 1 positions")
    s = _scores(scores, visible // ratio, "select_tokens")
    size = min(block_topk, visible // ratio) * ratio + visible % ratio
    if out is not None and (not isinstance(out, np.ndarray) or out.dtype != np.int32 or out.ndim != 1
                            or out.size < size):
        raise HssError(f"select_tokens: out must be a 1-D int32 array of at least {size} entries")
    return select_tokens_unchecked(s, block_topk, ratio, visible, out)


def select_tokens_unchecked(s: np.ndarray, block_topk: int, ratio: int, visible: int,
                            out: np.ndarray | None) -> np.ndarray:
    """:func:`select_tokens` on checked arguments: ``s`` at least ``visible // ratio`` real scores, ``out`` None
    or large enough (the decode hot path, whose arguments the indexer fixed)."""
    complete = visible // ratio
    s = s[:complete]
    k = min(block_topk, complete)
    if k == complete:
        blocks = np.arange(complete)
    elif k == 0:
        blocks = np.empty(0, dtype=np.int64)
    else:
        blocks = _top_set(s, k)
    size = k * ratio + visible % ratio
    res = np.empty(size, dtype=np.int32) if out is None else out[:size]
    np.add((blocks * ratio).astype(np.int32)[:, None], np.arange(ratio, dtype=np.int32),
           out=res[:k * ratio].reshape(k, ratio))
    res[k * ratio:] = np.arange(complete * ratio, visible, dtype=np.int32)
    return res
