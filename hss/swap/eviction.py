"""Which resident scratch slot to overwrite (docs/design.md §7.5): :class:`EvictionPolicy`, where predictor scores go.

Per slot the policy keeps the last predictor score recorded for the page it holds (f32, initially -inf)
and the epoch of its last touch (u64, initially 0; the global epoch starts at 1 and wraps). ``rank``
lists the slots that may be overwritten, first choice first: lowest score first, ties to the least
recently touched, then the lower slot. A NaN score compares equal to every score (the original's
``partial_cmp(..).unwrap_or(Equal)``), so recency places it: the (score, access)-ordered non-NaN slots
are merged with the recency-ordered NaN slots by last access. Scores are advisory: they choose what to
overwrite, never what attention reads. Pure host bookkeeping. :meth:`EvictionPolicy.rank_all` and the
``*_planned`` calls are internal API of the swap step (:mod:`hss.swap.step`): the checked calls' work, unchecked.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from hss import _args
from hss.errors import HssError

__all__ = ["EvictionPolicy"]

_U64 = 2**64


def _array(name: str, values: Any, what: str) -> np.ndarray:
    """``values`` (an array or any iterable) as a numpy array; its dtype is the caller's to check."""
    if isinstance(values, np.ndarray):
        return values
    try:
        return np.asarray(list(values))
    except TypeError:
        raise TypeError(f"{name} must be a sequence of {what}, got {type(values).__name__}") from None


class EvictionPolicy:
    """Scores and recency of ``num_slots`` scratch slots (0 slots is allowed: nothing is ever ranked)."""

    def __init__(self, num_slots: int) -> None:
        n = _args.as_int("num_slots", num_slots)
        if n < 0:
            raise HssError(f"num_slots must be >= 0 (got {n})")
        self.num_slots = n
        self.last_score = np.full(n, -np.inf, dtype=np.float32)
        self.last_access = np.zeros(n, dtype=np.uint64)
        self.epoch = 1

    def _slot(self, slot: Any) -> int:
        s = _args.as_int("slot", slot)
        if not 0 <= s < self.num_slots:
            raise HssError(f"slot {s} is out of range 0..{self.num_slots - 1}")
        return s

    def _slots(self, slots: Iterable[int], name: str = "slots") -> np.ndarray:
        arr = _array(name, slots, "slot indices")
        if arr.size and arr.dtype.kind not in "iu":
            raise TypeError(f"{name} must be integers, got {arr.dtype}")
        arr = arr.astype(np.int64, copy=False).reshape(-1)
        if arr.size and arr.view(np.uint64).max() >= self.num_slots:     # a negative slot wraps to a huge one
            raise HssError(f"{name} must be in 0..{self.num_slots - 1}")
        return arr

    def touch(self, slot: int) -> None:
        """Mark ``slot`` as used now (last_access = epoch; epoch += 1, wrapping at 2^64)."""
        self.last_access[self._slot(slot)] = self.epoch
        self.epoch = (self.epoch + 1) % _U64

    def touch_many(self, slots: Iterable[int]) -> None:
        """:meth:`touch` each slot in order (later slots are more recent)."""
        arr = self._slots(slots)
        self.last_access[arr] = np.arange(arr.size, dtype=np.uint64) + np.uint64(self.epoch)   # wraps mod 2^64
        self.epoch = (self.epoch + arr.size) % _U64

    def record_score(self, slot: int, score: float) -> None:
        """Remember the predictor score of the page now held by ``slot``."""
        self.last_score[self._slot(slot)] = np.float32(_args.as_float("score", score, finite=False))

    def record_scores(self, slots: Iterable[int], scores: Iterable[float]) -> None:
        """:meth:`record_score` of each ``(slots[i], scores[i])``."""
        arr = self._slots(slots)
        sc = _array("scores", scores, "scores")
        if sc.size and sc.dtype.kind not in "fiu":
            raise TypeError(f"scores must be numbers, got {sc.dtype}")
        if sc.size != arr.size:
            raise HssError(f"{arr.size} slots but {sc.size} scores")
        self.last_score[arr] = sc.astype(np.float32, copy=False).reshape(-1)

    def record_planned(self, slots: np.ndarray, scores: np.ndarray) -> None:
        """:meth:`record_scores` then :meth:`touch_many` of ``slots`` without the argument checks, for slots the
        caller computed (int64, distinct, in 0..num_slots-1) and f32 ``scores``. Internal API: the swap step's
        promotions."""
        self.score_planned(slots, scores)
        self.touch_planned(slots)

    def score_planned(self, slots: np.ndarray, scores: np.ndarray) -> None:
        """:meth:`record_scores` without the argument checks (``slots``: int64, in 0..num_slots-1, computed by the
        caller; ``scores``: f32, one each). Internal API: the swap step's hits."""
        self.last_score[slots] = scores

    def score_all_planned(self, scores: np.ndarray, index: np.ndarray) -> None:
        """:meth:`score_planned` of every slot at once: slot i scores ``scores[index[i]]`` (``index``: int64
        ``[num_slots]``, in range, computed by the caller; ``scores``: f32). Internal API: a sparse swap step whose
        pages fill every slot."""
        scores.take(index, out=self.last_score, mode="clip")     # (in range: "clip" writes straight into out)

    def touch_planned(self, slots: np.ndarray) -> None:
        """:meth:`touch_many` without the argument checks (``slots``: int64, in 0..num_slots-1, computed by the
        caller). Internal API: the swap step's hits."""
        e, n = self.epoch, slots.size
        if e + n <= 2**63:        # (no wrap, and within arange's int64 reach: one op)
            self.last_access[slots] = np.arange(e, e + n, dtype=np.uint64)
        else:
            self.last_access[slots] = np.arange(n, dtype=np.uint64) + np.uint64(e)   # wraps mod 2^64
        self.epoch = (e + n) % _U64

    def reset(self) -> None:
        """Scores -inf, accesses 0, epoch 1."""
        self.last_score.fill(-np.inf)
        self.last_access.fill(0)
        self.epoch = 1

    def rank(self, pinned: Iterable[int] = ()) -> np.ndarray:
        """Every slot not in ``pinned``, first eviction choice first (see the module docstring)."""
        pin = self._slots(pinned, "pinned") if not isinstance(pinned, (tuple, list)) or pinned else pinned
        if len(pin):
            keep = np.ones(self.num_slots, dtype=bool)
            keep[pin] = False
            cand = np.flatnonzero(keep)
            score, access = self.last_score[cand], self.last_access[cand]
        else:
            cand, score, access = np.arange(self.num_slots), self.last_score, self.last_access
        nan = np.isnan(score)
        if not nan.any():
            return cand[np.lexsort((access, score))]     # stable: ties in both keep the slot order
        a = cand[~nan][np.lexsort((cand[~nan], access[~nan], score[~nan]))]
        b = cand[nan][np.lexsort((cand[nan], access[nan]))]
        out, i, j = [], 0, 0
        la = self.last_access
        while i < a.size and j < b.size:     # a NaN ties with any score: recency, then slot, decides
            if (int(la[b[j]]), int(b[j])) < (int(la[a[i]]), int(a[i])):
                out.append(b[j])
                j += 1
            else:
                out.append(a[i])
                i += 1
        return np.concatenate([np.asarray(out, dtype=np.int64), a[i:], b[j:]]).astype(np.int64)

    def rank_all(self, low: float | None = None) -> np.ndarray:
        """:meth:`rank` of every slot (nothing pinned): the swap's steady state, every slot holding a page. ``low``:
        ``last_score.min()`` if the caller has it (NaN where any score is). Internal API: the swap step's promotions."""
        score = self.last_score
        top = (score.min() if low is None else low) if score.size else 0.0
        if top != top:      # a NaN (min propagates it): the merge by recency
            return self.rank()
        return np.lexsort((self.last_access, score))     # stable: ties in both keep the slot order

    @staticmethod
    def yields_to(old_score: float, new_score: float) -> bool:
        """Whether a slot scored ``old_score`` ranks before a page scored ``new_score`` touched now (so the
        page may take the slot): the new page is the most recent, so it wins ties and any NaN comparison."""
        o = np.float32(_args.as_float("old_score", old_score, finite=False))
        n = np.float32(_args.as_float("new_score", new_score, finite=False))
        return bool(np.isnan(o) or np.isnan(n) or o <= n)
