"""Reference of the device sparse swap step (docs/design.md §17.8): the page selection and the residency of C slots.

Integer logic, so exact: the kernels must match it entry for entry. One sequence and one layer per call; the
state arrays are updated in place.
"""
from __future__ import annotations

import numpy as np

from hss.reference import predictor as pref

__all__ = ["score_keys", "head_scores", "select", "residency_step"]


def score_keys(scores: np.ndarray) -> np.ndarray:
    """uint32 keys ordering scores (float32) as docs/design.md §17.1 ranks them: a higher score a higher key, NaN
    lowest, -0.0 and 0.0 one key (equal scores)."""
    s = np.asarray(scores, dtype=np.float32) + np.float32(0.0)   # -0.0 becomes 0.0: the two scores tie
    b = s.view(np.uint32)
    keys = np.where(b & np.uint32(0x80000000), ~b, b | np.uint32(0x80000000)).astype(np.uint32)
    keys[np.isnan(s)] = 0
    return keys


def head_scores(per_head: np.ndarray, table: np.ndarray, max_blocks: int, exp2_scale: float) -> np.ndarray:
    """float32 ``[n]``: the per-head normalised scores sparse_select folds in (docs/design.md §17.5) from the ``[n,
    heads]`` per-head scores of one row's pages (block ids ``table[:n]``): each head's max over the n pages (NaN
    skipped), then the sum over heads of 2^((score - max) * exp2_scale) (a NaN exponent left out), each rounded to
    float32 as the kernels store them; NaN for a block id outside 0..max_blocks-1."""
    best = pref.head_max(per_head).astype(np.float32) if per_head.shape[0] else np.full(per_head.shape[1], -np.inf)
    got = pref.head_combine(per_head, best, exp2_scale).astype(np.float32)
    ids = np.asarray(table)
    got[(ids < 0) | (ids >= max_blocks)] = np.nan
    return got


def select(scores: np.ndarray, n: int, budget: int, keep_first: int, keep_recent: int) -> np.ndarray:
    """bool ``[n]``: the pages S attends (docs/design.md §17.8): every page when ``n <= keep_first + keep_recent +
    budget``, else the first ``keep_first``, the last ``keep_recent`` and the ``budget`` best others (score descending,
    page ascending; NaN below every number)."""
    chosen = np.zeros(n, dtype=bool)
    if n <= keep_first + keep_recent + budget:
        chosen[:] = True
        return chosen
    lo, hi = keep_first, n - keep_recent
    chosen[:lo] = True
    chosen[hi:] = True
    if budget:
        keys = score_keys(np.asarray(scores, dtype=np.float32)[lo:hi]).astype(np.int64)
        order = np.lexsort((np.arange(keys.size), -keys))   # key descending, then page ascending
        chosen[lo + order[:budget]] = True
    return chosen


def residency_step(chosen: np.ndarray, page_slot: np.ndarray, slot_page: np.ndarray, slot_stamp: np.ndarray,
                   step: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One step's residency update for pages ``chosen`` (bool ``[n]``), in place on ``page_slot`` (i32 ``[>= n]``),
    ``slot_page`` and ``slot_stamp`` (i32 ``[C]``). Returns (attend slots of S's pages ascending, miss pages
    ascending, the slot each miss went to)."""
    pages = np.flatnonzero(chosen)
    slots = page_slot[pages]
    misses = pages[slots < 0]
    in_s = np.zeros(slot_page.size, dtype=bool)
    in_s[slots[slots >= 0]] = True
    free = np.flatnonzero((slot_page < 0) & ~in_s)
    held = np.flatnonzero((slot_page >= 0) & ~in_s)
    held = held[np.lexsort((held, slot_stamp[held].astype(np.int64)))]   # stamp ascending, then slot
    into = np.concatenate([free, held])[:misses.size]
    old = slot_page[into]
    page_slot[old[old >= 0]] = -1
    page_slot[misses] = into
    slot_page[into] = misses
    in_s[into] = True
    slot_stamp[in_s] = step
    return page_slot[pages].copy(), misses, into
