"""The indexer's host top-k (SPEC §11.4 steps 6-7) as pure functions.

The original sorts the block ids ``0..complete-1`` with Rust's stable ``sort_by`` and the comparator
``scores[b].partial_cmp(&scores[a]).unwrap_or(Equal).then(a.cmp(&b))``: score descending, index ascending,
and a NaN compares Equal to everything, so any comparison that involves a NaN is decided by index alone.

Without NaN that comparator is a total order and the result is unique: hss reproduces it exactly.

With NaN it is not a total order (scores 1, NaN, 5 at ids 0, 1, 2 give 0 < 1 < 2 < 0), so the outcome is
whatever the sorting algorithm's comparison sequence makes of it (Rust's own result differs between
releases, and since 1.81 ``sort_by`` may panic on such input). hss defines it as what a stable *insertion*
sort with that comparator produces from the initial order ``0..n-1`` (Rust's stable sort for fewer than 21
elements before 1.81): an element never moves across a NaN, because the NaN compares by index and every
later id is larger. So **each NaN is a barrier**: the NaNs split the ids into segments, each segment is
sorted by (score desc, index asc), and the order is segment 0, the first NaN, segment 1, the second NaN, ...
Every adjacent pair of that order satisfies the comparator, it is deterministic, and it equals the exact
order when there is no NaN. ``top_blocks`` returns its first k ids; ``select_tokens`` takes that set.
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


def _nan_mask(s: np.ndarray) -> np.ndarray | None:
    nan = np.isnan(s)
    return nan if nan.any() else None


def _full_order(s: np.ndarray, nan: np.ndarray | None) -> np.ndarray:
    """Every id in comparator order (NaNs as barriers, see the module docstring)."""
    idx = np.arange(s.size)
    neg = -np.where(nan, 0, s) if nan is not None else -s
    if nan is None:
        return np.lexsort((idx, neg))
    before = np.cumsum(nan) - nan               # NaNs at smaller ids
    segment = 2 * before + nan                  # NaN j (0-based) sits between segments j and j + 1
    return np.lexsort((idx, neg, segment))


def top_blocks(scores: Any, k: int) -> np.ndarray:
    """The first ``min(k, n)`` ids of ``scores [n]`` in the comparator's order (score desc, index asc; NaN
    handling in the module docstring), in that order (not re-sorted), int64."""
    s = _scores(scores, np.asarray(scores).size if np.ndim(scores) == 1 else 0, "top_blocks")
    k = min(_args.as_int("top_blocks: k", k, 0), s.size)
    if 0 < k < s.size:
        chosen = _top_set(s, k)
        if chosen is not None:   # no NaN: the order is total; order just the k chosen
            return chosen[np.lexsort((chosen, -s[chosen]))]
    return _full_order(s, _nan_mask(s))[:k]


def _top_set(s: np.ndarray, k: int) -> np.ndarray | None:
    """The ids of the k first under (score desc, index asc), ascending, for 0 < k < n; None when ``s`` has a NaN
    (a NaN sorts last in a partition, so it lands among the top k, or is the k-th itself)."""
    n = s.size
    top = np.partition(s, n - k)[n - k:]
    if np.isnan(top).any():
        return None
    blocks = np.flatnonzero(s >= top[0])         # top[0]: the k-th largest score
    extra = blocks.size - k
    if extra:                                      # ties at the cut-off: the lowest ids stay
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
    The ``min(block_topk, complete)`` first blocks under (score desc, index asc; NaN as in the module docstring)
    are chosen, sorted ascending and expanded to tokens ``b*ratio .. b*ratio + ratio - 1``; the tail
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
    return _select_tokens(s, block_topk, ratio, visible, out)


def _select_tokens(s: np.ndarray, block_topk: int, ratio: int, visible: int, out: np.ndarray | None) -> np.ndarray:
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
        if blocks is None:
            blocks = np.sort(_full_order(s, _nan_mask(s))[:k])
    size = k * ratio + visible % ratio
    res = np.empty(size, dtype=np.int32) if out is None else out[:size]
    np.add((blocks * ratio).astype(np.int32)[:, None], np.arange(ratio, dtype=np.int32),
           out=res[:k * ratio].reshape(k, ratio))
    res[k * ratio:] = np.arange(complete * ratio, visible, dtype=np.int32)
    return res
