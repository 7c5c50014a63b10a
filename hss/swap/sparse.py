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
    (``scores``: float, ``[n]``, in sequence order)."""
    scores = np.asarray(scores).reshape(-1)
    n = scores.size
    if budget.covers(n):
        return np.arange(n, dtype=np.int64)
    keep = np.zeros(n, dtype=bool)
    keep[:budget.keep_first] = True
    if budget.keep_recent:
        keep[n - budget.keep_recent:] = True         # forced() < n here, so keep_recent < n
    others = np.flatnonzero(~keep)
    # -score ascending, stable: the best first, ties to the earlier page, NaN (still NaN) last
    keep[others[np.argsort(-scores[others], kind="stable")[:budget.budget_pages]]] = True
    return np.flatnonzero(keep)
