"""Which pages a sparse swap step attends (docs/design.md §17.6): :func:`select_pages` (:func:`select_mask`, the same as
a mask). Pure host code.

A step over the pages ``seq_block_ids`` (n of them, in sequence order) in the sparse mode attends the first
``keep_first`` and the last ``keep_recent`` pages of the sequence, plus the ``budget_pages`` others with the highest
predictor scores, ranked by (score descending, sequence position ascending) under a total order in which NaN ranks
below every number (docs/design.md §17.1's rule), in sequence order. A budget that covers every other page attends all
n: the exact step.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from hss import _args
from hss.errors import HssError

__all__ = ["SparseBudget", "sparse_budget", "select_pages", "select_mask"]


class SparseBudget(NamedTuple):
    """The sparse mode's arguments: ``budget_pages`` scored pages plus the first ``keep_first`` and the last
    ``keep_recent`` pages of the sequence."""
    budget_pages: int
    keep_first: int
    keep_recent: int

    def forced(self, n: int) -> int:
        """How many of n pages the first / last rule keeps (the two may overlap)."""
        return min(n, self.keep_first + self.keep_recent)

    def covers(self, n: int) -> bool:
        """Whether every one of n pages is attended (then the step is the exact step)."""
        return self.budget_pages >= n - self.forced(n)


#: The sparse mode's defaults (the recall bench's best setting): the first page and the last four are always attended.
KEEP_FIRST, KEEP_RECENT = 1, 4


def sparse_budget(budget_pages: Any, keep_first: Any = None, keep_recent: Any = None) -> SparseBudget | None:
    """The sparse arguments of ``attend_layer`` checked: ``None`` for the exact mode (``budget_pages`` None, the
    others None or 0), else a :class:`SparseBudget` (``keep_first`` / ``keep_recent`` None: the sparse mode's defaults
    :data:`KEEP_FIRST` / :data:`KEEP_RECENT`). ``TypeError`` for a non-int (bool included), :class:`HssError` for a
    negative count or ``keep_first`` / ``keep_recent`` without ``budget_pages``, each naming the parameter."""
    first = 0 if keep_first is None else _args.as_count("keep_first", keep_first)
    recent = 0 if keep_recent is None else _args.as_count("keep_recent", keep_recent)
    if budget_pages is None:
        if first or recent:
            raise HssError(f"keep_first ({first}) and keep_recent ({recent}) choose pages of the sparse mode: pass "
                           "budget_pages too (None attends every page)")
        return None
    return SparseBudget(_args.as_count("budget_pages", budget_pages), KEEP_FIRST if keep_first is None else first,
                        KEEP_RECENT if keep_recent is None else recent)


def select_pages(scores: np.ndarray, budget: SparseBudget) -> np.ndarray:
    """Sequence positions (int64, ascending) of the pages attended, given the predictor score of each page
    (``scores``: float, ``[n]``, in sequence order). O(n): a partition finds the K-th best score, then every page
    above it and the earliest pages equal to it are kept (no sort)."""
    if type(scores) is not np.ndarray or scores.ndim != 1:
        scores = np.asarray(scores).reshape(-1)
    if budget.covers(scores.size):
        return np.arange(scores.size, dtype=np.int64)
    return select_mask(scores, budget).nonzero()[0]


def select_mask(scores: np.ndarray, budget: SparseBudget) -> np.ndarray:
    """:func:`select_pages` as a mask: whether each page is attended (bool ``[n]``)."""
    if type(scores) is not np.ndarray or scores.ndim != 1:
        scores = np.asarray(scores).reshape(-1)
    n = scores.size
    first, recent, k = budget.keep_first, budget.keep_recent, budget.budget_pages
    keep = np.empty(n, dtype=bool)
    if budget.covers(n):
        keep[:] = True
        return keep
    hi = n - recent                   # not covered: first + recent < n, so the others are first..hi-1
    keep[:first] = True
    keep[hi:] = True
    take = keep[first:hi]
    if not k:
        take[:] = False
        return keep
    others = scores[first:hi]
    if others.dtype.kind != "f":
        others = others.astype(np.float64)
    neg = -others                     # ascending = best first; NaN sorts last (below every number)
    neg.partition(k - 1)
    kth = neg[k - 1]                  # the K-th best (NaN: fewer than K numbers)
    if kth != kth:     # NaN: every number, then the earliest NaN
        nan = np.isnan(others)
        np.logical_not(nan, out=take)
        take[nan.nonzero()[0][:k - int(np.count_nonzero(take))]] = True
        return keep
    bar = -kth         # -(-x) == x exactly: others >= bar is neg <= kth (NaN neither)
    np.greater_equal(others, bar, out=take)
    if np.count_nonzero(take) != k:     # (the usual case: none past the K-th ties with it)
        np.greater(others, bar, out=take)
        tied = (others == bar).nonzero()[0]
        take[tied[:k - int(np.count_nonzero(take))]] = True     # ties to the earlier page
    return keep
