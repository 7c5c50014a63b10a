"""The two plans of a swap step (:mod:`hss.swap.step`): :class:`ExactPlan` (docs/design.md §8) and :class:`SparsePlan`
(docs/design.md §17.6), behind one protocol, :class:`StepPlan`.

A plan is made before any device work (so everything it checks raises first), then the step calls its hooks in queue
order: ``open`` (once the step is ordered after the previous one), ``choose`` (the :class:`~hss.swap.step.Tiles`),
``queue_tables``, ``after_first_tile``, ``after_tile`` (each streamed tile), ``settle`` (always, even when a phase
failed) and, once the step is issued, ``finish`` (what its record needs). The exact plan knows its tiles before the
scores and decides its promotions after the score wait, copying each out of its stream slot after its tile; the
sparse plan queues the scores first, waits for them in ``choose``, picks its pages and decides its promotions before
any read, and reads those misses straight into their resident slots.
"""
from __future__ import annotations

import functools
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from hss import cuda_min as cm
from hss._util import ceil_div
from hss.swap.promotion import Picked, Promotions
from hss.swap.sparse import SparseBudget, select_mask
from hss.swap.step import Tiles, never_offloaded

if TYPE_CHECKING:
    from hss.swap.step import StepIssue, SwapStep

__all__ = ["StepPlan", "ExactPlan", "SparsePlan"]


class StepPlan:
    """What a step runs: over the pages ``ids`` (the swap's read-only int64 copy, sequence order; ``top`` the largest,
    -1 where none; ``in_order``: they are the pages 0..n-1 in order) of ``layer``, the last one holding ``lbvs`` valid
    slots, ``budget`` its sparse arguments (None: an exact step); ``timed`` whether its streamed tiles' read stalls
    are timed, ``scores`` the predictor scores of ``ids`` once known. The hooks below do nothing unless a plan needs
    them."""

    timed = True

    def __init__(self, step: SwapStep, layer: int, ids: np.ndarray, top: int, in_order: bool, lbvs: int,
                 budget: SparseBudget | None) -> None:
        self.step, self.layer, self.ids, self.budget = step, layer, ids, budget
        self.scores: np.ndarray | None = None
        self._top, self._in_order, self._lbvs = top, in_order, lbvs

    def open(self, s: int, q: int) -> None:
        """The step was ordered after the previous one on ``s``: queue what needs no tile (``q``: the query)."""

    def choose(self) -> Tiles:
        """The step's tiles."""
        raise NotImplementedError

    def queue_tables(self, s: int, q: int, tiles: Tiles) -> None:
        """Queue the tile tables' upload on ``s`` (and what must come with it)."""
        raise NotImplementedError

    def after_first_tile(self) -> None:
        """The resident tile and tile 0 are queued."""

    def after_tile(self, s: int, i: int) -> None:
        """Streamed tile i is queued on ``s`` (before its ``done``)."""

    def settle(self, issue: StepIssue | None) -> None:
        """The bookkeeping of what was queued (``issue``: which reads were; None where the step failed before its
        issue phase), whether the step finished or failed."""

    def finish(self) -> tuple[Any, np.ndarray | None]:
        """Once the step is issued: (what makes its record's (promoted, evicted), or None; the mask of the pages it
        attended, None where it attended all)."""
        raise NotImplementedError


def _ranked_moves(promoted: list, evicted: list) -> tuple[tuple, tuple]:
    """An exact step's (promoted, evicted) for its record, in decision order (the lists hold (decision rank, ...))."""
    return tuple(p[1:] for p in sorted(promoted)), tuple(e[1:] for e in sorted(evicted))


class ExactPlan(StepPlan):
    """The exact step: every page of ``ids`` attended. Hits and misses come from the pool alone and every read is
    planned when the plan is made (a page never offloaded: :class:`StoreError` then). The scores are queued with the
    tables and waited for once tile 0 is queued; then the promotions are decided and each is copied (device to
    device) out of its stream slot right after its tile is attended. ``budget``: a sparse budget that covers every
    page (the step is exact; its record keeps the budget)."""

    def __init__(self, step: SwapStep, layer: int, ids: np.ndarray, top: int, in_order: bool, lbvs: int,
                 budget: SparseBudget | None = None) -> None:
        super().__init__(step, layer, ids, top, in_order, lbvs, budget)
        slots = step.pool.lookup_planned(layer, ids)
        hit = slots >= 0
        hit_pos, miss_pos = hit.nonzero()[0], (~hit).nonzero()[0]
        m = int(miss_pos.size)
        miss_ids = ids[miss_pos]
        if not step.known_readable(layer, ids):
            missing = step.store.missing_planned(layer, miss_ids)
            if missing.size:
                raise never_offloaded(layer, missing)
        ns, reads = step.plan_reads(layer, miss_ids, step.stream_dsts[:m], step.stream_slots[:m], None)
        self.tiles = Tiles(slots, hit_pos, miss_pos, miss_ids, ns, reads, bool(ids.size) and bool(hit[-1]), lbvs,
                           wait_tile=ns)
        self._promo: Promotions | None = None
        self._promoted: list[tuple[int, int, int]] = []                 # (decision rank, block id, slot)
        self._evicted: list[tuple[int, tuple[int, int], int]] = []      # (decision rank, (layer, page), slot)

    def choose(self) -> Tiles:
        return self.tiles

    def queue_tables(self, s: int, q: int, tiles: Tiles) -> None:
        """The scores of the layer's pages, the tables, then the ``scores`` event (which covers the upload: the next
        step may refill the pinned tables once it has completed)."""
        step = self.step
        step.queue_scores(s, self.layer, q, self._top + 1)
        step.upload_tables(s, tiles)
        step.record_scores_event(s)
        step.tables_fence = step.ev_scores

    def after_first_tile(self) -> None:
        """The host waits for the scores; the hits' scores are recorded and the hits touched; the promotions are
        decided."""
        step, tiles = self.step, self.tiles
        scores = self.scores = step.wait_scores(self.ids, self._in_order)
        hit_pos = tiles.hit_pos
        if hit_pos.size:
            step.eviction.record_scores(tiles.slots[hit_pos], scores[hit_pos])
            step.eviction.touch_many(tiles.slots[hit_pos])
        self._promo = step.promoter.plan(scores, tiles.miss_pos, tiles.streamed)

    def after_tile(self, s: int, i: int) -> None:
        """Tile i's promotions: each page copied from its stream slot into its resident slot on ``s``, then placed
        in the pool and scored and touched in the eviction policy."""
        promo = self._promo
        if promo is None:
            return
        step, tiles = self.step, self.tiles
        pool, eviction, scores = step.pool, step.eviction, self.scores
        bb = pool.slot_bytes
        lo, hi = promo.at[i], promo.at[i + 1]
        for j, slot, rank in zip(promo.take[lo:hi].tolist(), promo.into[lo:hi].tolist(), promo.rank[lo:hi].tolist()):
            cm.copy_d_to_d_async(pool.ptr + slot * bb, int(step.stream_dsts[j]), bb, s)
            block = int(tiles.miss_ids[j])
            old = pool.put((self.layer, block), slot)
            eviction.record_score(slot, scores[tiles.miss_pos[j]])
            eviction.touch(slot)
            self._promoted.append((rank, block, slot))
            if old is not None:
                self._evicted.append((rank, old, slot))

    def settle(self, issue: StepIssue | None) -> None:
        n = self.step.counts
        n["promotions"] += len(self._promoted)
        n["evictions"] += len(self._evicted)

    def finish(self) -> tuple[Any, None]:
        if self.budget is not None:
            self.step.counts["sparse_steps"] += 1
        return functools.partial(_ranked_moves, self._promoted, self._evicted), None


class SparsePlan(StepPlan):
    """The sparse step (docs/design.md §17.6): the first ``budget.keep_first`` and last ``budget.keep_recent`` pages of
    ``ids`` plus the ``budget.budget_pages`` others that score best (a budget that does not cover them all). Every page
    is checked readable when the plan is made. ``open`` queues the scores and looks the pages up in the pool while the
    device scores; ``choose`` waits for them, picks the pages, records this query's score for every resident page,
    and decides the promotions before any read: those misses are read straight into their resident slots (no
    device-to-device copy), their bookkeeping done at once in ``settle`` for the tiles whose reads were queued (the
    hits' touch included). ``gather_min_runs``: the HostStore reads a tile of more runs than this with one
    ``page_gather`` launch; ``timed``: whether its read stalls are timed."""

    def __init__(self, step: SwapStep, layer: int, ids: np.ndarray, top: int, in_order: bool, lbvs: int,
                 budget: SparseBudget, gather_min_runs: int, timed: bool) -> None:
        self._t0 = time.perf_counter()
        step.check_readable(layer, ids)
        super().__init__(step, layer, ids, top, in_order, lbvs, budget)
        self.timed, self._gather_min_runs = timed, gather_min_runs
        self.tiles: Tiles | None = None       # once chosen
        self.kept: np.ndarray | None = None
        self._resident: tuple = ()
        self._picked: Picked | None = None
        self._promo: Promotions | None = None
        self._waited = (0.0, 0.0, 0.0)        # host seconds of the score wait, the page choice, the plan

    def open(self, s: int, q: int) -> None:
        """The scores of pages 0..max id, their ``scores`` event, then the pool lookup (host work while the device
        scores)."""
        step = self.step
        step.queue_scores(s, self.layer, q, self._top + 1)
        step.record_scores_event(s)
        resident = step.pool.lookup_planned(self.layer, self.ids)
        held = resident >= 0
        held_pos = held.nonzero()[0]
        held_slots = resident[held_pos]
        by_slot = None
        if held_slots.size == step.capacity:      # every slot holds one of these pages: slot i's
            by_slot = np.empty_like(held_pos)      # is at position by_slot[i]
            by_slot[held_slots] = held_pos
        self._resident = (resident, held, held_pos, held_slots, by_slot)
        step.profile["sparse_queue"] += time.perf_counter() - self._t0

    def choose(self) -> Tiles:
        """The host waits for the scores, picks the pages (:func:`~hss.swap.sparse.select_mask`), records this
        query's score for every resident page (the skipped are never touched; the hits are, at ``settle``) and plans
        the tiles: from the score wait to the first read only what that read needs."""
        step = self.step
        t1 = time.perf_counter()
        scores = self.scores = step.wait_scores(self.ids, self._in_order)
        t2 = time.perf_counter()
        keep = self.kept = select_mask(scores, self.budget)
        resident, held, held_pos, held_slots, by_slot = self._resident
        if by_slot is None:
            step.eviction.score_planned(held_slots, scores[held_pos])
        else:
            step.eviction.score_all_planned(scores, by_slot)
        t3 = time.perf_counter()
        tiles = self._plan(scores, keep, resident, held, held_pos, held_slots)
        self._waited = (t2 - t1, t3 - t2, time.perf_counter() - t3)
        self.tiles = tiles
        return tiles

    def _plan(self, scores: np.ndarray, keep: np.ndarray, resident: np.ndarray, held: np.ndarray,
              held_pos: np.ndarray, held_slots: np.ndarray) -> Tiles:
        """The tiles over the pages attended (``keep``, a mask of ``ids``; ``resident``: their resident slots, -1:
        none; ``held``: where there is one, positions ``held_pos``, slots ``held_slots``). Hit and miss positions index
        ``ids``. The promotions are decided here, before the reads, and those misses read into their resident slots;
        the hits' touch waits until the reads are queued unless the decision needs recency first."""
        step = self.step
        hit = keep[held_pos]
        hit_pos, hit_slots = held_pos[hit], held_slots[hit]
        miss_pos = (keep > held).nonzero()[0]
        m = int(miss_pos.size)
        miss_ids = miss_pos if self._in_order else self.ids[miss_pos]     # (pages 0..n-1: position = page)
        if hit_pos.size:
            step.promoter.defer_touch(hit_slots)
        ns = ceil_div(m, step.tile_blocks)
        picked = self._picked = step.promoter.pick(scores, miss_pos, ns, hit_slots)
        if picked is None:
            miss_slots, dsts, dst_slots = None, step.stream_dsts[:m], step.stream_slots[:m]
            wait_tile, late = ns, ()
        else:
            miss_slots = step.stream_slots[:m].copy()
            miss_slots[picked.take] = picked.into
            dsts, dst_slots = step.slot_dsts[miss_slots], miss_slots
            wait_tile, late = picked.wait_tile, picked.late
        ns, reads = step.plan_reads(self.layer, miss_ids, dsts, dst_slots, self._gather_min_runs)
        last_is_hit = bool(hit_pos.size) and (not m or int(hit_pos[-1]) > int(miss_pos[-1]))
        lbvs = self._lbvs if keep[-1] else step.block_size   # (the last page skipped: no tile gets its valid slots)
        return Tiles(resident, hit_pos, miss_pos, miss_ids, ns, reads, last_is_hit, lbvs, miss_slots, wait_tile, late)

    def queue_tables(self, s: int, q: int, tiles: Tiles) -> None:
        """The tables (their slots: the misses' resident or stream slots); the scores were waited for already, so the
        step's end covers the upload."""
        step = self.step
        step.upload_tables(s, tiles)
        step.tables_fence = step.ev_step_done

    def settle(self, issue: StepIssue | None) -> None:
        """The hits touched; then the promotions of the tiles read (with every tile before them) put and the slots of
        the later tiles begun lost (:meth:`Promoter.put <hss.swap.promotion.Promoter.put>`); the step's counts and
        host seconds. A step that failed before its tiles were chosen only touches its hits."""
        step = self.step
        promoter = step.promoter
        promoter.touch_hits()
        tiles = self.tiles
        if tiles is None:
            return
        n = step.counts
        if self._picked is not None:
            begun, queued = ([], 0) if issue is None else (issue.begun, issue.queued)
            read = 0
            while read in begun[:queued]:
                read += 1
            promo = self._promo = promoter.in_sequence(self._picked, tiles.streamed)
            k, evicted = promoter.put(self.layer, promo, tiles.miss_ids, read, tuple(i for i in begun if i >= read))
            n["promotions"] += k
            n["evictions"] += evicted
        prof, waited = step.profile, self._waited
        prof["sparse_wait"] += waited[0]
        prof["sparse_select"] += waited[1]
        prof["sparse_plan"] += waited[2]
        n["sparse_steps"] += 1
        n["skipped"] += self.ids.size - tiles.hit_pos.size - tiles.miss_pos.size

    def finish(self) -> tuple[Any, np.ndarray | None]:
        promo = self._promo
        return (None if promo is None else functools.partial(promo.moves, self.tiles.miss_ids)), self.kept
