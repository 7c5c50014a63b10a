"""Which pages a sparse swap step attends (SPEC §17.6): :func:`select_pages`. Pure host code.

A step over the pages ``seq_block_ids`` (n of them, in sequence order) in the sparse mode attends the first
``keep_first`` and the last ``keep_recent`` pages of the sequence, plus the ``budget_pages`` others with the highest
predictor scores, ranked by (score descending, sequence position ascending) under a total order in which NaN ranks
below every number (SPEC §17.1's rule), in sequence order. A budget that covers every other page attends all n:
the exact step.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from hss import _args
from hss.errors import HssError

__all__ = ["SparseBudget", "sparse_budget", "select_pages"]


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


def sparse_budget(budget_pages: Any, keep_first: Any, keep_recent: Any) -> SparseBudget | None:
    """The sparse arguments of ``attend_layer`` checked: ``None`` for the exact mode (``budget_pages`` None, the
    others 0), else a :class:`SparseBudget`. ``TypeError`` for a non-int (bool included), :class:`HssError` for a
    negative count or ``keep_first`` / ``keep_recent`` without ``budget_pages``, each naming the parameter."""
    first, recent = _args.as_count("keep_first", keep_first), _args.as_count("keep_recent", keep_recent)
    if budget_pages is None:
        if first or recent:
            raise HssError(f"keep_first ({first}) and keep_recent ({recent}) choose pages of the sparse mode: pass "
                           "budget_pages too (None attends every page)")
        return None
    return SparseBudget(_args.as_count("budget_pages", budget_pages), first, recent)


def select_pages(scores: np.ndarray, budget: SparseBudget) -> np.ndarray:
    """Sequence positions (int64, ascending) of the pages attended, given the predictor score of each page
    (``scores``: float, ``[n]``, in sequence order). O(n): a partition finds the K-th best score, then every page
    above it and the earliest pages equal to it are kept (no sort)."""
    scores = np.asarray(scores).reshape(-1)
    n = scores.size
    if budget.covers(n):
        return np.arange(n, dtype=np.int64)
    first, recent, k = budget.keep_first, budget.keep_recent, budget.budget_pages
    hi = n - recent                   # not covered: first + recent < n, so the others are first..hi-1
    keep = np.zeros(n, dtype=bool)
    keep[:first] = True
    keep[hi:] = True
    if k:
        others = scores[first:hi]
        neg = -(others if others.dtype.kind == "f" else others.astype(np.float64))   # ascending = best first
        kth = np.partition(neg, k - 1)[k - 1]     # the K-th best (NaN sorts last: fewer than K numbers)
        if kth != kth:     # NaN: every number, then the earliest NaN
            take = ~np.isnan(neg)
            take[(~take).nonzero()[0][:k - int(np.count_nonzero(take))]] = True
        else:
            take = neg <= kth
            if np.count_nonzero(take) != k:     # (the usual case: none past the K-th ties with it)
                take = neg < kth
                tied = (neg == kth).nonzero()[0]
                take[tied[:k - int(np.count_nonzero(take))]] = True     # ties to the earlier page
        keep[first:hi] = take
    return keep.nonzero()[0]
