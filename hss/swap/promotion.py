"""Which misses of a swap step enter the resident set (docs/design.md §8): :class:`Promoter`.

The rule: the misses are promoted best score first (NaN last): into free slots, then replacing the first-ranked
resident (:meth:`EvictionPolicy.rank <hss.swap.eviction.EvictionPolicy.rank>`: lowest score, then least recently
touched) while that one ranks before the new page. The promoter decides with vectorized sorts (the scalar rule is what
the tests hold it to), reads the pool and the eviction policy through their internal API, and keeps the one piece of
state a sparse step leaves between its plan and its settle: the hits whose touch waits until the step's reads are
queued. Pure host bookkeeping.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from hss.swap.eviction import EvictionPolicy
from hss.swap.pool import ScratchPool

__all__ = ["Promoter", "Promotions", "Picked"]


class Picked(NamedTuple):
    """The promotions a step decided on, in decision order (the best score first), before :class:`Promotions` puts
    them in sequence order (a sparse step reads first): ``take`` (indices into the misses), ``into`` (resident slots),
    ``victims`` (how many of them held a page: the last ones), ``miss_scores`` (the predictor score of each miss),
    ``wait_tile`` as there, ``late`` (those of tiles 0 and 1 with one whose slot holds a page attended in the
    resident tile: read after it)."""
    take: np.ndarray
    into: np.ndarray
    victims: int
    miss_scores: np.ndarray
    wait_tile: int
    late: tuple[int, ...]


class Promotions(NamedTuple):
    """The misses a step promotes into the resident set, in sequence order: ``take`` (indices into the misses),
    ``into`` (resident slots), ``rank`` (decision ranks: the best score first), ``old_layer`` / ``old_page`` (what
    each slot held, -1 where free), ``scores`` (their predictor scores); streamed tile i's are ``at[i]:at[i + 1]``.
    ``wait_tile``: the first tile with one whose slot holds a page attended in the resident tile (the streamed tile
    count where none does)."""
    take: np.ndarray
    into: np.ndarray
    rank: np.ndarray
    old_layer: np.ndarray
    old_page: np.ndarray
    scores: np.ndarray
    at: list[int]
    wait_tile: int

    def moves(self, miss_ids: np.ndarray) -> tuple[tuple, tuple]:
        """(promoted, evicted) of a step record (:class:`~hss.swap.step.StepRecord`), in decision order: ((block id,
        slot), ...) and (((layer, page), slot), ...) of the slots that held a page; ``miss_ids`` the step's misses."""
        order = np.argsort(self.rank)
        into = self.into[order]
        promoted = tuple(zip(miss_ids[self.take[order]].tolist(), into.tolist()))
        layers, pages = self.old_layer[order], self.old_page[order]
        held = layers >= 0
        evicted = tuple(zip(zip(layers[held].tolist(), pages[held].tolist()), into[held].tolist()))
        return promoted, evicted


class Promoter:
    """The promotion rule of a swap step over ``pool`` (its poolable slots are the resident set) and ``eviction``
    (their scores and recency), streamed tiles of ``tile_blocks`` misses whose bounds are ``tile_bounds`` (int64
    ``0, T, 2T, ...``, one more than the most tiles of a step)."""

    def __init__(self, pool: ScratchPool, eviction: EvictionPolicy, tile_blocks: int, tile_bounds: np.ndarray) -> None:
        self.pool, self.eviction, self.tile_blocks, self.tile_bounds = pool, eviction, tile_blocks, tile_bounds
        self.capacity = eviction.num_slots
        self._pending_touch: np.ndarray | None = None    # a sparse step's hits, touched once its reads are queued

    # -- the hits' touch -------------------------------------------------------------------------
    def defer_touch(self, hit_slots: np.ndarray) -> None:
        """Touch ``hit_slots`` (a sparse step's hits, sequence order) at :meth:`touch_hits`, or before anything reads
        recency first."""
        self._pending_touch = hit_slots

    @property
    def pending_touch(self) -> np.ndarray | None:
        """The hits whose touch is deferred (None: none)."""
        return self._pending_touch

    def touch_hits(self) -> None:
        """Touch the hits a sparse step's plan left pending (in sequence order): once its reads are queued, or before
        anything reads recency first."""
        pending, self._pending_touch = self._pending_touch, None
        if pending is not None:
            self.eviction.touch_planned(pending)

    # -- the decision ----------------------------------------------------------------------------
    def plan(self, scores: np.ndarray, miss_pos: np.ndarray, ns: int,
             hit_slots: np.ndarray | None = None) -> Promotions | None:
        """The misses to promote (``scores[miss_pos]`` theirs; ``ns`` streamed tiles), or None. ``hit_slots`` (a
        sparse step, whose promoted misses are read into their slots): the slots the resident tile reads, for
        ``wait_tile``."""
        picked = self.pick(scores, miss_pos, ns, hit_slots)
        return None if picked is None else self.in_sequence(picked, ns)

    def pick(self, scores: np.ndarray, miss_pos: np.ndarray, ns: int,
             hit_slots: np.ndarray | None = None) -> Picked | None:
        """The decision of :meth:`plan`: what a sparse step's reads need (the rest: :meth:`in_sequence`, from the
        pool as it is until the promotions are put)."""
        m = miss_pos.size
        if self.capacity == 0 or m == 0:
            return None
        eviction = self.eviction
        miss_scores = scores[miss_pos]
        if self.pool.free_count:
            self.touch_hits()       # (the ranking reads recency)
            picked = self._into_free(miss_scores)
        else:       # every slot holds a page (a slot is free exactly when it holds none): the steady state
            # the usual case: every miss scores below the first victim, the lowest score (a NaN on either side: not
            # known here; then the rule below decides, as it would have here)
            if hit_slots is None:       # an exact step's many misses: sorted only if one may be promoted
                ranked, low, top = None, eviction.last_score.min(), miss_scores.max()
            else:       # a sparse step's few, mostly promoted: both sides sorted now (NaN last, so first reversed)
                victims, order = eviction.last_score.argsort(), miss_scores.argsort()[::-1]
                lows, best = eviction.last_score[victims], miss_scores[order]
                ranked = victims, lows, order, best
                low = lows[0] if lows[-1] == lows[-1] else lows[-1]     # (NaN where any, as min gives)
                top = best[0]
            if top < low:
                return None
            if low == low and top == top:
                picked = self._by_value(miss_scores, ranked)
            else:
                self.touch_hits()
                picked = self._ranked(miss_scores, [], eviction.rank_all(low))
        if picked is None:
            return None
        take, into, k = picked
        wait_tile, late = ns, ()
        if k and hit_slots is not None and hit_slots.size:      # (only a victim's slot can be a hit's)
            hit = np.zeros(self.capacity, dtype=bool)
            hit[hit_slots] = True
            over = hit[into[-k:]]
            if np.count_nonzero(over):
                over = take[-k:][over].tolist()      # the misses read into a hit's slot (a few)
                T = self.tile_blocks
                wait_tile = min(over) // T
                if wait_tile < 2:
                    late = (0, 1) if wait_tile == 0 and any(T <= j < 2 * T for j in over) else (wait_tile,)
        return Picked(take, into, k, miss_scores, wait_tile, late)

    def in_sequence(self, picked: Picked, ns: int) -> Promotions:
        """The :class:`Promotions` of a decision, in sequence order (the slots' keys read from the pool now)."""
        rank = picked.take.argsort()    # decision rank of each, in sequence order (distinct: any sort is stable)
        take, into = picked.take[rank], picked.into[rank]
        old_layer, old_page = self.pool.keys_planned(into)
        at = [0, take.size] if ns == 1 else take.searchsorted(self.tile_bounds[:ns + 1]).tolist()
        return Promotions(take, into, rank, old_layer, old_page, picked.miss_scores[take], at, picked.wait_tile)

    def _into_free(self, miss_scores: np.ndarray) -> tuple | None:
        """:meth:`pick`'s (take, into, victims taken: decision order) with free slots: the free ones first, then the
        first-ranked of the others."""
        m, pool = miss_scores.size, self.pool
        free = pool.free_slots()[:m]
        victims = None
        if len(free) < m:
            victims = self.eviction.rank(free)
            victims = victims[pool.keys_planned(victims)[0] >= 0]
        return self._ranked(miss_scores, free, victims)

    def _ranked(self, miss_scores: np.ndarray, free: list, victims: np.ndarray | None) -> tuple | None:
        """The rule itself: the best misses (NaN last) into the ``free`` slots, then into the ranked ``victims`` while
        each ranks before its miss. (take, into: in decision order; victims taken), or None."""
        m, nf = miss_scores.size, len(free)
        order = np.argsort(-miss_scores, kind="stable")          # miss indices, best first, NaN last
        k = 0
        if victims is not None:
            k = min(m - nf, victims.size)
            if k:      # not EvictionPolicy.yields_to: False for NaN, like the scalar rule
                bad = self.eviction.last_score[victims[:k]] > miss_scores[order[nf:nf + k]]
                j = int(bad.argmax())
                if bad[j]:
                    k = j
            if not free and not k:
                return None
        take = order[:nf + k]
        if not k:
            into = np.asarray(free, np.int64)
        elif free:
            into = np.concatenate([np.asarray(free, dtype=np.int64), victims[:k]])
        else:
            into = victims[:k]
        return take, into, k

    def _by_value(self, miss_scores: np.ndarray, ranked: tuple | None = None) -> tuple | None:
        """:meth:`_ranked` into a full resident set with no NaN score on either side, the same answer with cheaper
        sorts: how many victims yield follows from the sorted scores alone (the i-th lowest resident against the i-th
        best miss), and where no two scores on a side are equal (-0.0 equals 0.0) any sort of them is the stable one
        (the usual case: a plain argsort, not the lexsort by recency and the stable sort). ``ranked``: the caller's
        (victims, their scores, order, the misses' scores in that order) of the sorts below."""
        eviction = self.eviction
        score = eviction.last_score
        n = min(miss_scores.size, self.capacity)
        if ranked is None:
            victims, order = score.argsort(), miss_scores.argsort()[::-1]     # (no NaN: reversed is best first)
            low, best = score[victims], miss_scores[order]     # sorted: the victims' scores, the misses' best first
        else:
            victims, low, order, best = ranked
        bad = low[:n] > best[:n]
        j = int(bad.argmax())
        k = j if bad[j] else n
        if not k:
            return None
        if np.count_nonzero(low[1:] == low[:-1]):     # a tie: recency, then the slot, decides
            self.touch_hits()
            victims = np.lexsort((eviction.last_access, score))
        if np.count_nonzero(best[1:] == best[:-1]):   # a tie: the earlier miss first
            order = (-miss_scores).argsort(kind="stable")
        return order[:k], victims[:k], k

    # -- the bookkeeping -------------------------------------------------------------------------
    def put(self, layer: int, promo: Promotions, miss_ids: np.ndarray, tiles: int,
            lost: tuple[int, ...]) -> tuple[int, int]:
        """A sparse step's pool and eviction bookkeeping, at once, of the promotions in its first ``tiles`` streamed
        tiles (their reads queued): pages placed, scores recorded, slots touched in sequence order (as tile by
        tile). ``lost`` (a step that failed): later tiles whose reads were begun and may be partly queued (or queued
        ahead of an earlier tile's): their slots' pages are gone. Returns (pages promoted, pages evicted)."""
        k = promo.at[tiles]
        evicted = 0
        if k:
            into, old_layer = promo.into[:k], promo.old_layer[:k]
            evicted = self.pool.put_planned(layer, miss_ids[promo.take[:k]], into, old_layer, promo.old_page[:k])
            self.eviction.record_planned(into, promo.scores[:k])
        for i in lost:
            self.pool.invalidate_slots(promo.into[promo.at[i]:promo.at[i + 1]])
        return k, evicted
