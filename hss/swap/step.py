"""One decode step of :class:`~hss.swap.HighSpeedSwap` (docs/design.md §8): :class:`SwapStep` runs a plan in three
phases, *plan* (host metadata: hits, misses, reads, promotions; :mod:`hss.swap.plans`), *issue* (reads on the copy
stream, tiles on the caller's stream) and *settle* (the pool and eviction bookkeeping of what was queued), and makes the
step's :class:`StepRecord`. The exact step and the sparse step (docs/design.md §17.6) are two plans of this one step.

A step, in queue order on the caller's stream ``s`` and the copy stream ``c``:

1. Everything is checked and every read of the step is planned at once (:meth:`BackingStore.prepare_reads
   <hss.swap.backing.BackingStore.prepare_reads>`): the tiles follow from hits and misses alone (hits = pages
   resident for this layer; misses stream in tiles of T, sequence order, tile i through buffer i % 2). ``c`` waits
   for the previous step (``step_done``; write-after-read: the stream buffers may still be read by it; before any
   step, or after one whose ``step_done`` could not be recorded, ``c`` waits for ``s`` instead, through ``go``), and
   so does ``s`` where the previous step ran on another stream; the reads of the first two tiles are queued on
   ``c``.
2. On ``s``, all that does not need the scores: q_proj = project_q(q), scores of the layer's pages, their D2H into
   pinned memory, the block tables (one copy from pinned memory), the ``scores`` event (it covers the tables too:
   the next step refills their pinned copy); ``begin_step``; the resident tile (hits, attended in place); tile 0
   (after its reads, see 4).
3. The **host waits for the scores** (the step's one planned host sync; the original synchronized here too) and
   plans: misses are promoted into the resident set best score first (:class:`~hss.swap.promotion.Promoter`): into
   free slots, then replacing the first-ranked resident (lowest score, then least recently touched) while that one
   ranks before the new page. A promoted page is copied (device to device, on ``s``) from its stream slot into its
   resident slot right after its tile is attended, before that tile's ``done``; every hit is attended in the resident
   tile, queued before any streamed tile, so none is overwritten early.
4. Tile i's pages are read on ``c`` into buffer i % 2, which first waits for ``done[i % 2]`` (tile i-2 attended and
   its promotions copied out); the reads' fence follows them (a HostStore records one after every group of reads:
   :attr:`PreparedReads.fence <hss.swap.backing.PreparedReads>`; else ``c`` records ``loaded[i % 2]``). ``s`` waits
   for it, attends tile i, does its promotions and, when tile i + 2 exists, records ``done[i % 2]``. Reads run two
   tiles ahead of attention.
5. The step's last tile also writes ``out`` (the bits ``finalize`` would write; a step with no page
   finalizes the empty state instead); ``s`` records ``step_done``.

The **sparse mode** (docs/design.md §17.6; ``budget_pages=K, keep_first=F, keep_recent=R``, opt in: exact stays the
default) attends only the first F and last R pages plus the K others that score best. Its step checks that every page is
readable, then on ``s`` (after ``step_done``, as above) queues the scores and the host waits for them at
once; it picks the pages (:func:`~hss.swap.sparse.select_mask`), records this query's scores for every resident
page (so those it skips are the first victims when they score low), and runs 1-5 above over the pages picked
(hits = those resident; only the picked misses are read, each tile's in one prepared group: one batched copy, or one
``page_gather`` launch where a HostStore finds the tile's pages scattered, in more than ``sparse_gather_min_runs``
runs; an exact step's tiles stay batched copies unless the store's ``gather_min_runs`` says otherwise). Its scores
being known before any read, its promotions (the same rule, best score first) are planned first and those misses are
read straight into their resident slots, where their tile attends them: no device-to-device copy, and the pool and
eviction bookkeeping of the step (its hits' touch included) is one vectorized update once its reads are queued (of
the tiles whose reads were all queued, if one failed). A tile whose reads overwrite the slot of a page attended in the
resident tile waits (``c`` on an event of ``s``) for that tile; of the first two tiles, those that do not are read
before the tables and the resident tile are queued (so where tile 0 alone waits, tile 1's reads go first). From the
score wait to the first read the host does only what that read needs. Its scores were waited for before its table
upload, so no second ``scores`` event follows the upload: the step's end covers it. It times no read
stall (no timing events around its tiles' waits; ``read_stall_ms`` counts exact steps') unless
:attr:`HighSpeedSwap.time_sparse_stalls <hss.swap.HighSpeedSwap.time_sparse_stalls>` is set. A budget covering every
other page is the exact step: the same code path, the same bits (and its stalls are timed).

Every tile is recorded (:class:`StepRecord`): the ordered slots, the block ids they hold and the
last_block_valid_slots each tile was applied with. Replaying the same block ids in the same tiles with
in-HBM :class:`~hss.attention.TiledAttention` gives the same bits (a tile's result depends only on its token list).
The last page of ``seq_block_ids`` is always the last entry of its tile, which alone gets the caller's
last_block_valid_slots.
"""
from __future__ import annotations

import contextlib
import functools
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple

import numpy as np

from hss import cuda_min as cm
from hss._util import ceil_div
from hss.errors import StoreError
from hss.swap.backing import BackingStore, PreparedReads
from hss.swap.config import ModelDims
from hss.swap.eviction import EvictionPolicy
from hss.swap.pool import ScratchPool
from hss.swap.promotion import Promoter
from hss.swap.sparse import SparseBudget
from hss.swap.stall import StallTimer

if TYPE_CHECKING:
    from hss.swap.plans import StepPlan

__all__ = ["StepRecord", "TileRecord", "SwapStep", "Tiles"]


# -- the record ----------------------------------------------------------------------------------
class TileRecord(NamedTuple):
    """One ``step_tile`` launch of a step: scratch ``slots`` in the order attended, the disk ``block_ids``
    they held, the ``last_block_valid_slots`` passed, and whether it was ``streamed`` (else resident)."""
    slots: tuple[int, ...]
    block_ids: tuple[int, ...]
    last_block_valid_slots: int
    streamed: bool


class _Built:
    """A field of :class:`StepRecord` made on first access from the step's arrays (a non-data descriptor: once made,
    the value sits in the instance dict and is read from there)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            return self
        build = vars(obj).pop("_builder")
        vars(obj).update(zip(StepRecord._BUILT, build()))
        return vars(obj)[self.name]


@dataclass(frozen=True)
class StepRecord:
    """What one ``attend_layer`` did: its tiles in launch order, the predictor score of each block, the hits
    and misses, and the promotions ((block id, resident slot)) and evictions (((layer, page), slot)) in decision
    order: the best-scoring miss first, the first-ranked (lowest score, least recent) victim first.

    A sparse step (docs/design.md §17.6) also records its arguments (``sparse``; None for an exact step) and the blocks
    it did not attend (``skipped``, sequence order); hits and misses are of the attended blocks, and ``block_ids`` /
    ``block_scores`` cover every block of the step, attended or not. A step keeps only its arrays: ``tiles``,
    ``hits``, ``misses``, ``promoted``, ``evicted`` and ``skipped`` are made from them when one is first read."""
    layer: int
    tiles: tuple[TileRecord, ...]
    hits: tuple[int, ...]
    misses: tuple[int, ...]
    promoted: tuple[tuple[int, int], ...]
    evicted: tuple[tuple[tuple[int, int], int], ...]
    block_ids: np.ndarray = field(repr=False)        # the step's seq_block_ids
    block_scores: np.ndarray = field(repr=False)     # f32 predictor score of each
    skipped: tuple[int, ...] = ()
    sparse: SparseBudget | None = None

    _BUILT: ClassVar[tuple[str, ...]] = ("tiles", "hits", "misses", "promoted", "evicted", "skipped")

    @classmethod
    def _of_step(cls, layer: int, block_ids: np.ndarray, block_scores: np.ndarray, sparse: SparseBudget | None,
                 build: Any) -> StepRecord:
        """A record whose ``_BUILT`` fields ``build()`` makes (a tuple of them, in that order) when one is first
        read."""
        self = cls.__new__(cls)
        vars(self).update(layer=layer, block_ids=block_ids, block_scores=block_scores, sparse=sparse,
                          _builder=build)
        return self

    @functools.cached_property
    def scores(self) -> dict[int, float]:
        """{block id: predictor score} of the step's blocks."""
        return dict(zip(self.block_ids.tolist(), self.block_scores.tolist()))

    @property
    def attended(self) -> tuple[int, ...]:
        """The blocks attended, in sequence order (every block of an exact step)."""
        if not self.skipped:
            return tuple(self.block_ids.tolist())
        skipped = set(self.skipped)
        return tuple(b for b in self.block_ids.tolist() if b not in skipped)


for _name in StepRecord._BUILT:     # after the dataclass is made: __init__ keeps its defaults, instances set fields
    setattr(StepRecord, _name, _Built(_name))


def _record_fields(ids: np.ndarray, slots: np.ndarray, hit_pos: np.ndarray, miss_ids: np.ndarray,
                   miss_slots: np.ndarray | None, lbvs: int, last_is_hit: bool, bs: int, T: int,
                   buffer_slots: tuple[tuple[int, ...], tuple[int, ...]], moves: Any, kept: np.ndarray | None) -> tuple:
    """A step's (tiles, hits, misses, promoted, evicted, skipped) for its :class:`StepRecord`, from the arrays of its
    :class:`Tiles` (a record keeps only those). Tiles: the resident tile (hits in sequence order), then the misses in
    tiles of T (read into the stream buffers ``buffer_slots``, or into ``miss_slots``). ``moves``: what makes the
    step's (promoted, evicted), in decision order (None: none). ``kept``: a sparse step's mask of the blocks
    attended."""
    out = []
    hits = tuple(ids[hit_pos].tolist())
    if hit_pos.size:
        out.append(TileRecord(tuple(slots[hit_pos].tolist()), hits, lbvs if last_is_hit else bs, False))
    misses = tuple(miss_ids.tolist())
    where = None if miss_slots is None else miss_slots.tolist()
    ns = ceil_div(len(misses), T)
    for i in range(ns):
        part = misses[i * T:(i + 1) * T]
        out.append(TileRecord(buffer_slots[i % 2][:len(part)] if where is None else tuple(where[i * T:(i + 1) * T]),
                              part, lbvs if i == ns - 1 and not last_is_hit else bs, True))
    promoted, evicted = ((), ()) if moves is None else moves()
    skipped = () if kept is None else tuple(ids[~kept].tolist())
    return tuple(out), hits, misses, promoted, evicted, skipped


# -- what a plan gives the step ------------------------------------------------------------------
class Tiles(NamedTuple):
    """A step's tiles as its plan made them: over the pages it attends, their hits (``hit_pos``: positions in the
    step's ids, each resident in ``slots[pos]``) and misses (``miss_pos``, ``miss_ids``), the streamed tile count and
    every read (``reads``: group i is streamed tile i's misses). ``last_is_hit``: the last page attended is a hit;
    ``lbvs``: the valid slots of the last page attended (block_size where the step's last page is skipped).
    ``miss_slots``: the slot each miss is read into and attended from (None: the stream buffers). ``wait_tile``: the
    first streamed tile whose reads overwrite a slot the resident tile reads (the streamed tile count where none
    does); ``late``: those of tiles 0 and 1 that wait, read after the resident tile is queued."""
    slots: np.ndarray         # each page's resident slot, -1 where not resident
    hit_pos: np.ndarray
    miss_pos: np.ndarray
    miss_ids: np.ndarray
    streamed: int
    reads: PreparedReads
    last_is_hit: bool
    lbvs: int
    miss_slots: np.ndarray | None = None
    wait_tile: int = 0
    late: tuple[int, ...] = ()


_PHASES = ("checks", "sparse_queue", "sparse_wait", "sparse_select", "sparse_plan", "tiles_queue", "tiles_rest",
           "record")


class StepIssue:
    """The issue phase of one step of ``step`` on ``s`` (query ``q``, output ``out``): ``tiles``' reads on the copy
    stream, two tiles ahead of their attention (their read stalls ``timed`` or not). ``begun``: the streamed tiles
    whose reads were begun, in issue order (tile order, but where tile 0 alone waits for the resident tile: 1, 0, 2,
    ...), the first ``queued`` of them queued; ``ready[b]``: the event after the reads of the last tile read into
    buffer b."""

    __slots__ = ("step", "s", "q", "out", "tiles", "timed", "first", "begun", "queued", "ready")

    def __init__(self, step: SwapStep, s: int, q: int, out: int, tiles: Tiles, timed: bool) -> None:
        self.step, self.s, self.q, self.out, self.tiles, self.timed = step, s, q, out, tiles, timed
        self.first = 1 if tiles.hit_pos.size else 0      # the resident tile, if any, is row 0
        self.begun: list[int] = []
        self.queued = 0
        self.ready: list[Any] = [None, None]

    def run(self, plan: StepPlan) -> float:
        """The issue phase (the module doc, 1-5) of ``plan``'s tiles: reads, tables, the resident tile, then the
        streamed tiles, with the plan's score wait after tile 0 and its work after each tile. Returns when tile 0 was
        queued (host clock)."""
        step, s, tiles = self.step, self.s, self.tiles
        ns, first = tiles.streamed, self.first
        for i in range(min(2, ns)):     # the first reads run while the host queues (and waits for) the scores
            if i not in tiles.late:
                self.read(i)
        if first + ns:
            plan.queue_tables(s, self.q, tiles)
        step.attn.begin_step(s, 1)
        if first:
            self.attend(0, tiles.lbvs if tiles.last_is_hit else step.block_size)
            if tiles.wait_tile < ns:
                step.ev_resident.record(s)
        for i in tiles.late:
            self.read(i)
        if ns:
            self.attend_streamed(0)
        t_queued = time.perf_counter()
        plan.after_first_tile()
        for i in range(ns):
            if i:
                self.attend_streamed(i)
            plan.after_tile(s, i)
            if i + 2 < ns:       # (the next step's reads wait for step_done)
                step.ev_done[i % 2].record(s)
                self.read(i + 2)
        if not first + ns:   # no tile: the output of the empty state
            step.attn.finalize(s, self.out, 1)
        return t_queued

    def read(self, i: int) -> None:
        """Queue streamed tile i's reads on the copy stream, after ``done[i % 2]`` (i >= 2) and the resident tile
        (its ``wait_tile``)."""
        step = self.step
        c = step.copy
        if i >= 2:
            cm.stream_wait_event(c, step.ev_done[i % 2])
        if i == self.tiles.wait_tile:        # its reads overwrite a slot the resident tile reads
            cm.stream_wait_event(c, step.ev_resident)
        t = time.perf_counter()
        self.begun.append(i)
        reads = self.tiles.reads
        step.counts["bytes_read"] += reads.issue(i, c)
        self.queued += 1
        step.host_read += time.perf_counter() - t
        fence = reads.fence      # (the store keeps this record for FENCES - 1 more groups: s waits for it
        #                          before read(i + 2))
        if fence is None:        # a FileStore's: its own events guard its bounce ring
            fence = step.ev_loaded[i % 2]
            fence.record(c)
        self.ready[i % 2] = fence

    def attend(self, row: int, tile_lbvs: int) -> None:
        """Attend tile ``row`` of the tables (0: the resident tile, if any); the step's last tile also writes the
        output."""
        step, s = self.step, self.s
        output = self.out if row == self.first + self.tiles.streamed - 1 else 0
        if row == 0:   # checks q, the pool and the strides once per step
            kp, vp, blk, tok, kvh = step.operands
            step.attn.step_tile(s, self.q, kp, vp, step.tables_dev, step.counts_dev, 1, blk, tok, kvh, tile_lbvs,
                                output or None)
        else:
            cap = step.tile_capacity
            step.attn._next_tile(s, step.tables_dev + 4 * row * cap, step.counts_dev + 4 * row, tile_lbvs, output)

    def attend_streamed(self, i: int) -> None:
        """Wait (on ``s``) for streamed tile i's reads, timed where the plan says, and attend it."""
        s, tiles = self.s, self.tiles
        if self.timed:
            timer = self.step.timer
            timer.begin(s)
            cm.stream_wait_event(s, self.ready[i % 2])
            timer.end(s)
        else:
            cm.stream_wait_event(s, self.ready[i % 2])
        last = i == tiles.streamed - 1 and not tiles.last_is_hit
        self.attend(self.first + i, tiles.lbvs if last else self.step.block_size)


# -- the step ------------------------------------------------------------------------------------
class SwapStep:
    """The decode step of one :class:`~hss.swap.HighSpeedSwap` over its ``store``, ``pool`` (``resident_capacity``
    slots then two stream buffers of ``tile_blocks``), ``eviction``, ``predictor`` and ``attn``: :meth:`run` takes a
    plan (:class:`~hss.swap.plans.ExactPlan` or :class:`~hss.swap.plans.SparsePlan`) through the issue and settle
    phases and returns the step's record. It owns what every step shares: the step buffers (q_proj, the block scores
    and their pinned copy, the tile tables and theirs: :meth:`buffers`), the copy stream, the events, the stall timer,
    the stream buffers' slot maps, the :class:`~hss.swap.promotion.Promoter` and the counters. Internal API of the
    swap: its attributes and methods are for the swap and the plans. ``close()`` frees what it owns."""

    def __init__(self, ctx: cm.CudaCtx | None, model: ModelDims, rank: int, tile_blocks: int, store: BackingStore,
                 pool: ScratchPool, eviction: EvictionPolicy, predictor: Any, attn: Any) -> None:
        self.store, self.pool, self.eviction, self.predictor, self.attn = store, pool, eviction, predictor, attn
        self.tile_blocks = T = tile_blocks
        self.capacity = R = eviction.num_slots       # the resident set
        self.block_size = model.block_size
        self.tile_capacity = cap = attn.dims.tile_capacity
        nb = model.max_blocks_per_layer
        self._max_tiles = 1 + ceil_div(nb, T)
        self._parts = contextlib.ExitStack()
        own = self._own
        try:
            self.q_proj = own(cm.DeviceBuffer(2 * model.num_q_heads * rank, ctx))
            self.scores_dev = own(cm.DeviceBuffer(4 * nb, ctx))
            self.scores_host = own(cm.PinnedBuffer(4 * nb, ctx))
            # per-tile entry counts (i32 [max_tiles]), then at _tables_offset the slot tables (i32 [max_tiles, cap])
            self._tables_offset = ceil_div(4 * self._max_tiles, 256) * 256
            index_bytes = self._tables_offset + 4 * self._max_tiles * cap
            self.tile_index_dev = own(cm.DeviceBuffer(index_bytes, ctx))
            self.tile_index_host = own(cm.PinnedBuffer(index_bytes, ctx))
            self.copy_stream = own(cm.CudaStream(ctx))
            ev = lambda: own(cm.CudaEvent(ctx=ctx))   # noqa: E731
            self.ev_scores, self.ev_go, self.ev_step_done, self.ev_resident = ev(), ev(), ev(), ev()
            self.ev_loaded, self.ev_done = (ev(), ev()), (ev(), ev())
            self.timer = own(StallTimer(ctx))
        except BaseException:
            self._parts.close()
            raise
        self.counts_dev = self.tile_index_dev.ptr
        self.tables_dev = self.counts_dev + self._tables_offset
        self._scores_f32 = self.scores_host.view(np.float32)
        self._count_rows = self.tile_index_host.view(np.int32)[:self._max_tiles]
        self._table_rows = self.tile_index_host.view(np.int32)[self._tables_offset // 4:].reshape(self._max_tiles, cap)
        self.tables_pending = False
        self.tables_fence = self.ev_scores     # what covers the last table upload (see upload_tables)
        # streamed miss j goes to slot R + (j // T % 2) * T + j % T: tile j // T in stream buffer (j // T) % 2
        j = np.arange(nb, dtype=np.int64)
        self.stream_slots = R + j // T % 2 * T + j % T
        self.slot_dsts = pool.ptr + pool.slot_bytes * np.arange(pool.num_slots, dtype=np.int64)
        self.stream_dsts = self.slot_dsts[self.stream_slots]
        self.tile_bounds = np.arange(0, (self._max_tiles + 1) * T, T, dtype=np.int64)
        self._edges: dict[int, tuple[np.ndarray, list[int]]] = {}     # misses: their tiles' bounds (plan_reads)
        self.buffer_slots = (tuple(range(R, R + T)), tuple(range(R + T, R + 2 * T)))
        self._stream_table = np.zeros((self._max_tiles, cap), dtype=np.int32)
        self._stream_table[:, :T] = R + np.arange(self._max_tiles)[:, None] % 2 * T + np.arange(T)
        self.promoter = Promoter(pool, eviction, T, self.tile_bounds)
        self.operands = pool.attention_operands(attn)
        self.copy = self.copy_stream.handle
        self.stepped = False
        self._ended = False      # the last step's end was recorded (step_done follows all its work on its stream)
        self._done_on = -1       # the stream step_done was last recorded on
        self._read_mark: Any = None     # the store's fences known run once the next step's scores are (wait_scores)
        self._readable: dict[int, tuple[np.ndarray, int]] = {}  # layer: (ids, store epoch) with every page readable
        self.counts = dict(steps=0, tiles=0, hits=0, misses=0, promotions=0, evictions=0, bytes_read=0,
                           sparse_steps=0, skipped=0)
        self.host_read = self.score_wait = 0.0       # host seconds planning and issuing reads; waiting for scores
        self.profile = dict.fromkeys(_PHASES, 0.0)     # HighSpeedSwap.host_profile()

    def _own(self, obj: Any) -> Any:
        self._parts.callback(obj.close)
        return obj

    def buffers(self) -> dict[str, cm.DeviceBuffer | cm.PinnedBuffer]:
        """{label: buffer} of the step buffers (the swap refuses a caller's pointer into any of them)."""
        return {"q_proj": self.q_proj, "block scores": self.scores_dev, "pinned block scores": self.scores_host,
                "tile tables": self.tile_index_dev, "pinned tile tables": self.tile_index_host}

    # -- the phases ------------------------------------------------------------------------------
    def run(self, s: int, q: int, out: int, plan: StepPlan) -> StepRecord:
        """Attend as ``plan`` says (made, and so checked, before any device work) with q and out (device addresses,
        checked) on ``s``: begin (order after the previous step), open and choose (the plan's score work: a sparse
        plan waits for its scores here), issue, settle (even when a phase fails), end; returns the step's record."""
        self._begin(s)
        issue = None
        try:
            plan.open(s, q)
            tiles = plan.choose()
            t_start = time.perf_counter()
            issue = StepIssue(self, s, q, out, tiles, plan.timed)
            t_queued = issue.run(plan)
        finally:
            try:       # the bookkeeping of what was queued, even when the step's end cannot be recorded
                plan.settle(issue)
            finally:
                self._end(s)
        if tiles.streamed:    # s waited for every tile's reads before the end: once a later step's scores are in,
            self._read_mark = self.store.read_mark()      # so were they
        t_issued = time.perf_counter()
        self.timer.collect(wait=False)     # host work here overlaps the step's last tiles on the device
        n = self.counts
        n["steps"] += 1
        n["tiles"] += issue.first + tiles.streamed
        n["hits"] += int(tiles.hit_pos.size)
        n["misses"] += int(tiles.miss_pos.size)
        # (scores may be a view of the pinned scores, wait_scores: the next step refills it)
        scores = plan.scores
        block_scores = scores if scores.flags.owndata else scores.copy()
        ids = plan.ids
        ids.setflags(write=False)
        block_scores.setflags(write=False)
        moves, kept = plan.finish()
        build = functools.partial(_record_fields, ids, tiles.slots, tiles.hit_pos, tiles.miss_ids, tiles.miss_slots,
                                  tiles.lbvs, tiles.last_is_hit, self.block_size, self.tile_blocks, self.buffer_slots,
                                  moves, kept)
        rec = StepRecord._of_step(plan.layer, ids, block_scores, plan.budget, build)
        prof = self.profile
        prof["tiles_queue"] += t_queued - t_start
        prof["tiles_rest"] += t_issued - t_queued
        prof["record"] += time.perf_counter() - t_issued
        return rec

    def _begin(self, s: int) -> None:
        """Order the step after the previous one on ``s`` and on the copy stream (the stream buffers and the promoted
        pages' slots may still be read by the previous step); before any step, the copy stream after ``s``. (``s``
        itself waits only where the previous step's end was recorded on another stream: a stream runs in order.)"""
        c = self.copy
        if self.stepped and s != self._done_on:
            cm.stream_wait_event(s, self.ev_step_done)
        if self._ended:
            cm.stream_wait_event(c, self.ev_step_done)
        else:        # (and after a step whose end was not recorded: step_done is older than its work on s)
            self.ev_go.record(s)
            cm.stream_wait_event(c, self.ev_go)

    def _end(self, s: int) -> None:
        self._ended = False
        self.ev_step_done.record(s)
        self.stepped = self._ended = True
        self._done_on = s

    # -- what the plans call ---------------------------------------------------------------------
    def known_readable(self, layer: int, ids: np.ndarray) -> bool:
        """Whether every page ``ids`` (the swap's read-only copy) of ``layer`` was found readable since the store last
        changed (its epoch: bumped by every write and invalidation)."""
        seen = self._readable.get(layer)
        return seen is not None and seen[0] is ids and seen[1] == self.store.epoch

    def check_readable(self, layer: int, ids: np.ndarray) -> None:
        """StoreError naming the pages ``ids`` of ``layer`` never offloaded, if any; once all are readable, the same
        ids are not looked up again until the store changes."""
        if self.known_readable(layer, ids):
            return
        missing = self.store.missing_planned(layer, ids)
        if missing.size:
            raise never_offloaded(layer, missing)
        self._readable[layer] = (ids, self.store.epoch)

    def plan_reads(self, layer: int, miss_ids: np.ndarray, dsts: np.ndarray, dst_slots: np.ndarray,
                   gather_min_runs: int | None) -> tuple[int, PreparedReads]:
        """(streamed tiles, the reads of ``miss_ids`` into pool slots ``dst_slots`` at ``dsts``: tile i's misses
        ``i * T:(i + 1) * T``, one group each)."""
        t0 = time.perf_counter()
        m = miss_ids.size
        ns = ceil_div(m, self.tile_blocks)                      # streamed tiles: the misses in sequence order
        edges = self._edges.get(m)
        if edges is None:         # (a few miss counts recur: made once each, never changed)
            bounds = self.tile_bounds[:ns + 1].copy()
            bounds[-1] = m
            edges = self._edges[m] = (bounds, bounds.tolist())
        reads = self.store.plan_reads(layer, miss_ids, dsts, *edges, (self.pool.slot_table, dst_slots),
                                      gather_min_runs)
        self.host_read += time.perf_counter() - t0
        return ns, reads

    def queue_scores(self, s: int, layer: int, q: int, n: int) -> None:
        """Queue the predictor scores of pages 0..n-1 and their copy into pinned host memory on ``s``."""
        self.predictor.project_q_on_stream(s, q, self.q_proj, layer=layer)
        self.predictor.score_layer_on_stream(s, self.q_proj, layer, 0, n, self.scores_dev)
        cm._d_to_h_planned(self.scores_host.ptr, self.scores_dev.ptr, 4 * n, s)   # n <= max_blocks_per_layer

    def record_scores_event(self, s: int) -> None:
        """Record ``ev_scores`` on ``s``, noting the stall-timer pairs recorded before it (complete once it is)."""
        self.ev_scores.record(s)
        self.timer.mark()

    def wait_scores(self, ids: np.ndarray, in_order: bool) -> np.ndarray:
        """Predictor scores of ``ids`` (host float32) once ``ev_scores`` has completed; waits on the host. Where
        ``ids`` are pages 0..n-1 in order (``in_order``: the usual decode step), a view of the pinned scores: read it
        before the next step queues its scores (the step's record keeps a copy)."""
        if ids.size == 0:
            return np.zeros(0, dtype=np.float32)
        t0 = time.perf_counter()
        self.ev_scores.synchronize()
        self.score_wait += time.perf_counter() - t0
        self.tables_pending = False
        self.timer.reached()     # the stall timers of earlier steps are complete: summed with no query
        self.store.reads_ran(self._read_mark)    # and so are the reads of earlier steps
        if in_order:
            return self._scores_f32[:ids.size]
        return self._scores_f32.take(ids)

    def upload_tables(self, s: int, tiles: Tiles) -> None:
        """Fill the pinned per-tile slot tables and counts (row 0 the resident tile, if any; the streamed tiles' slots
        the stream buffers', or the tiles' ``miss_slots``) and queue their copy to the device on ``s``."""
        first = 1 if tiles.hit_pos.size else 0
        ns, misses = tiles.streamed, int(tiles.miss_pos.size)
        nt = first + ns
        if not nt:
            return
        if self.tables_pending:      # the last upload may not have run (a step failed before its score wait, or
            self.tables_fence.synchronize()    # a sparse step: its end covers it)
        table, count = self._table_rows, self._count_rows
        T = self.tile_blocks
        if first:
            hit_slots = tiles.slots[tiles.hit_pos]
            table[0, :hit_slots.size] = hit_slots
            table[0, hit_slots.size:] = 0
            count[0] = hit_slots.size
        if ns:
            table[first:nt] = self._stream_table[:ns]
            miss_slots = tiles.miss_slots
            if miss_slots is not None:       # tile i's misses are miss_slots[i * T:(i + 1) * T]
                whole, rest = divmod(misses, T)
                table[first:first + whole, :T] = miss_slots[:whole * T].reshape(whole, T)
                if rest:
                    table[nt - 1, :rest] = miss_slots[whole * T:]
            count[first:nt] = T
            count[nt - 1] = misses - (ns - 1) * T
        # one copy: the counts, padding, then the first nt rows of the tables
        cm._h_to_d_planned(self.tile_index_dev.ptr, self.tile_index_host.ptr,
                           self._tables_offset + 4 * nt * self.tile_capacity, s)
        self.tables_pending = True

    # -- diagnostics, lifetime -------------------------------------------------------------------
    def stall_ms(self) -> float:
        """Milliseconds the attention stream waited for reads in timed tiles; waits for the timers of issued steps."""
        self.timer.collect(wait=True)
        return self.timer.ms

    def wait(self) -> None:
        """Wait (host) for the last step's work on both streams, if a step ran."""
        if self.stepped:
            self.ev_step_done.synchronize()
            self.copy_stream.synchronize()

    def close(self) -> None:
        """Free the step buffers, the copy stream, the events and the timers; later calls do nothing."""
        self._count_rows = self._table_rows = self._scores_f32 = None    # views of the pinned memory freed here
        self._parts.close()


def never_offloaded(layer: int, pages: np.ndarray) -> StoreError:
    """The error of a step over pages of ``layer`` that were never offloaded."""
    return StoreError(f"layer {layer} blocks {pages[:8].tolist()} were never offloaded (or their last write failed): "
                      "offload_block them before attending", pages)
