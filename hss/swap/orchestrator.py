"""Exact decode attention over a KV history kept in a backing store (SPEC §8): :class:`HighSpeedSwap`.

The scratch pool (``resident_blocks`` page slots in HBM) is split in two:

* a **resident set** of ``resident_blocks - 2*T`` slots, pages chosen by predictor score (the
  :class:`~hss.swap.eviction.EvictionPolicy`), attended in place with no transfer;
* a **streaming double buffer** of two tiles of T pages, through which every other page of the step
  passes: the reads of tile i+1 (a copy stream of our own) overlap attention on tile i (the caller's
  stream).

A step (``attend_layer_on_stream``), in queue order on the caller's stream ``s`` and the copy stream ``c``:

1. Everything is checked and every read of the step is planned at once (:meth:`BackingStore.prepare_reads
   <hss.swap.stores.BackingStore.prepare_reads>`): the tiles follow from hits and misses alone (hits = pages
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
   plans: misses are promoted into the resident set best score first: into free slots, then replacing the
   first-ranked resident (lowest score, then least recently touched) while that one ranks before the new page.
   A promoted page is copied (device to device, on ``s``) from its stream slot into its resident slot right
   after its tile is attended, before that tile's ``done``; every hit is attended in the resident tile, queued
   before any streamed tile, so none is overwritten early.
4. Tile i's pages are read on ``c`` into buffer i % 2, which first waits for ``done[i % 2]`` (tile i-2 attended and
   its promotions copied out); the reads' fence follows them (a HostStore records one after every group of reads:
   :attr:`PreparedReads.fence <hss.swap.stores.PreparedReads>`; else ``c`` records ``loaded[i % 2]``). ``s`` waits
   for it, attends tile i, does its promotions and, when tile i + 2 exists, records ``done[i % 2]``. Reads run two
   tiles ahead of attention.
5. The step's last tile also writes ``out`` (the bits ``finalize`` would write; a step with no page
   finalizes the empty state instead); ``s`` records ``step_done``.

The **sparse mode** (SPEC §17.6; ``budget_pages=K, keep_first=F, keep_recent=R``, opt in: exact stays the default)
attends only the first F and last R pages plus the K others that score best. Its step checks that every page is
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
:attr:`HighSpeedSwap.time_sparse_stalls` is set. A budget covering every other page is the exact step: the same code
path, the same bits (and its stalls are timed).

Every tile is recorded (:class:`StepRecord`): the ordered slots, the block ids they hold and the
last_block_valid_slots each tile was applied with. Replaying the same block ids in the same tiles with
in-HBM :class:`~hss.attention.TiledAttention` gives the same bits (a tile's result depends only on its token list).
The last page of ``seq_block_ids`` is always the last entry of its tile, which alone gets the caller's
last_block_valid_slots.

Nothing else synchronizes the host, except as documented: FileStore reads (pread, and reusing a bounce page
only after its copy ran), HostStore writes (wait for queued reads of the bytes they replace), a step after one
that failed before its score wait (waits for that step's table upload) and an exact step after a sparse one (waits
for that step's end), the first HostStore reads of a tile wider than any before (waits for queued reads: its index
ring grows), a HostStore's group of reads ``FENCES`` groups after one that no score wait has covered since (waits for
it: its index slot is reused; a step's score wait covers the reads of the steps before it), and
``diagnostic_summary`` (waits for the stall timers of issued steps). One instance is used from one thread.
"""
from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, NamedTuple

import numpy as np

from hss import _args
from hss import cuda_min as cm
from hss.attention import TiledAttention, TiledAttentionDims
from hss.errors import HssError
from hss.predictor import Predictor, PredictorDims
from hss.swap._checks import StreamCheck, same_device
from hss.swap.config import DiskBlockAllocator, HighSpeedSwapConfig, HighSpeedSwapDiagnostic, ModelDims
from hss.swap.eviction import EvictionPolicy
from hss.swap.gather import SPARSE_GATHER_MIN_RUNS
from hss.swap.layout import GroupLayout
from hss.swap.pool import ScratchPool
from hss.swap.sparse import SparseBudget, select_mask, sparse_budget
from hss.swap.stores import BackingStore, FileStore, HostStore, PreparedReads, StoreError

__all__ = ["HighSpeedSwap", "StepRecord", "TileRecord"]


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

    A sparse step (SPEC §17.6) also records its arguments (``sparse``; None for an exact step) and the blocks it
    did not attend (``skipped``, sequence order); hits and misses are of the attended blocks, and ``block_ids`` /
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


class _Promotions(NamedTuple):
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


class _Picked(NamedTuple):
    """The promotions a step decided on, in decision order (the best score first), before :class:`_Promotions` puts
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


class _Plan(NamedTuple):
    """A step's hits and misses over the pages it attends, its streamed tile count and its reads. A sparse step
    knows its promotions before its reads (``promotions``, the rest made once its reads are queued): those misses are
    read straight into their resident slots (``miss_slots``: the slot each miss is read into and attended from; None:
    the stream buffers)."""
    slots: np.ndarray         # each page's resident slot, -1 where not resident
    hit_pos: np.ndarray
    miss_pos: np.ndarray
    miss_ids: np.ndarray
    streamed_tiles: int
    reads: PreparedReads
    last_is_hit: bool
    promotions: _Picked | None = None
    miss_slots: np.ndarray | None = None


_PHASES = ("checks", "sparse_queue", "sparse_wait", "sparse_select", "sparse_plan", "tiles_queue", "tiles_rest",
           "record")


class _StallTimer:
    """Pairs of timing events around the attention stream's waits for reads; summed once complete."""

    def __init__(self, ctx: Any) -> None:
        self._ctx, self._spare, self._pending, self._open = ctx, [], [], None
        self._mark = self._known = 0      # pairs before the last marked event; pairs known complete
        self.ms = 0.0

    def _event(self) -> cm.CudaEvent:
        return self._spare.pop() if self._spare else cm.CudaEvent(timing=True, ctx=self._ctx)

    def begin(self, stream: int) -> None:
        self._open = self._event()
        self._open.record(stream)

    def end(self, stream: int) -> None:
        b = self._event()
        b.record(stream)
        self._pending.append((self._open, b))

    def mark(self) -> None:
        """An event the host will wait for is recorded after the pairs recorded so far (on their stream or one
        ordered after it): :meth:`reached` once it has completed."""
        self._mark = len(self._pending)

    def reached(self) -> None:
        """The last :meth:`mark`'s event has completed: its pairs are summed with no query."""
        self._known = max(self._known, self._mark)

    def collect(self, wait: bool) -> None:
        """Sum the complete pairs (``wait``: all of them, after waiting; else those known complete, see
        :meth:`reached`, or found complete by queries). Pairs complete in record order: one step's are on one
        stream, and each step's stream waits for the previous step's end."""
        pending = self._pending
        if not pending:
            return
        if wait:
            pending[-1][1].synchronize()
            k = len(pending)
        elif self._known:
            k = min(self._known, len(pending))
        elif pending[-1][1].query():
            k = len(pending)
        else:
            k = 0
            while k < len(pending) and pending[k][1].query():
                k += 1
        for a, b in pending[:k]:
            self.ms += a.elapsed_ms(b)
            self._spare += [a, b]
        del pending[:k]
        self._known, self._mark = max(self._known - k, 0), max(self._mark - k, 0)

    def close(self) -> None:
        for ev in self._spare + [e for pair in self._pending for e in pair]:
            ev.close()
        self._spare, self._pending = [], []


def _missing_dirs(path: Path) -> list[Path]:
    """``path`` and its ancestors that do not exist yet, deepest first."""
    out = []
    while not path.exists() and path != path.parent:
        out.append(path)
        path = path.parent
    return out


def _buffer_devices(obj: Any) -> set[int]:
    """The devices of the device buffers ``obj`` holds (its attributes)."""
    return {buf.device for buf in vars(obj).values() if isinstance(buf, cm.DeviceBuffer) and not buf.closed}


def _never_offloaded(layer: int, pages: np.ndarray) -> StoreError:
    return StoreError(f"layer {layer} blocks {pages[:8].tolist()} were never offloaded (or their last write failed): "
                      "offload_block them before attending", pages)


def _owned_ranges(h: HighSpeedSwap) -> _args.OwnedRanges:
    """Every device (and pinned, device-addressable) buffer the swap and its parts hold (scratch pool, the predictor's
    P and A_g, the tiled attention's running state, the step buffers and their pinned copies), so that a caller's
    pointer into one of them is refused. (The store's own memory is the store's: ``store._memory``.)"""
    mine = _args.OwnedRanges()
    parts = ((h, "the swap's {}"), (h.pool, "the scratch pool"), (h.predictor, "the predictor's {}"),
             (h.attn, "the tiled attention's state ({})"))
    seen: set[int] = set()
    for obj, label in parts:
        for name, buf in vars(obj).items():
            if isinstance(buf, (cm.DeviceBuffer, cm.PinnedBuffer)) and not buf.closed and buf.ptr not in seen:
                seen.add(buf.ptr)
                mine.add(buf.ptr, buf.bytes, label.format(_BUFFER_NAMES.get(name, name.strip("_"))))
    return mine


_BUFFER_NAMES = {"_a_g": "A_g store", "_p": "projection P", "_q_proj": "q_proj", "_scores_dev": "block scores",
                 "_scores_host": "pinned block scores", "_tile_index_dev": "tile tables",
                 "_tile_index_host": "pinned tile tables", "buffer": "slots"}


def _record_fields(ids: np.ndarray, slots: np.ndarray, hit_pos: np.ndarray, miss_ids: np.ndarray,
                   miss_slots: np.ndarray | None, lbvs: int, last_is_hit: bool, bs: int, T: int,
                   buffer_slots: tuple[tuple[int, ...], tuple[int, ...]], moves: Any, block_ids: np.ndarray,
                   kept: np.ndarray | None) -> tuple:
    """A step's (tiles, hits, misses, promoted, evicted, skipped) for its :class:`StepRecord`. Tiles: the resident
    tile (hits in sequence order), then the misses in tiles of T (read into the stream buffers ``buffer_slots``, or
    into ``miss_slots``). ``moves``: an exact step's (promoted, evicted) lists of (decision rank, ...), or a sparse
    step's :class:`_Promotions` (None: none). ``kept``: a sparse step's mask of the blocks attended."""
    tiles = []
    hits = tuple(ids[hit_pos].tolist())
    if hit_pos.size:
        tiles.append(TileRecord(tuple(slots[hit_pos].tolist()), hits, lbvs if last_is_hit else bs, False))
    misses = tuple(miss_ids.tolist())
    where = None if miss_slots is None else miss_slots.tolist()
    ns = -(-len(misses) // T)
    for i in range(ns):
        part = misses[i * T:(i + 1) * T]
        tiles.append(TileRecord(buffer_slots[i % 2][:len(part)] if where is None else tuple(where[i * T:(i + 1) * T]),
                                part, lbvs if i == ns - 1 and not last_is_hit else bs, True))
    if moves is None:
        promoted = evicted = ()
    elif not isinstance(moves, _Promotions):
        promoted, evicted = (tuple(p[1:] for p in sorted(moves[0])), tuple(e[1:] for e in sorted(moves[1])))
    else:       # a sparse step's promotions, in decision order
        order = np.argsort(moves.rank)
        into = moves.into[order]
        promoted = tuple(zip(miss_ids[moves.take[order]].tolist(), into.tolist()))
        layers, pages = moves.old_layer[order], moves.old_page[order]
        held = layers >= 0
        evicted = tuple(zip(zip(layers[held].tolist(), pages[held].tolist()), into[held].tolist()))
    skipped = () if kept is None else tuple(block_ids[~kept].tolist())
    return tuple(tiles), hits, misses, promoted, evicted, skipped


class HighSpeedSwap:
    """Streams a layer's KV pages from a backing store through HBM scratch for exact decode attention.

    ``HighSpeedSwap(ctx, cfg, model)`` sets up on ``ctx.stream``; :meth:`new_on_stream` on a caller's stream in
    the current context. Construction validates ``cfg`` and ``model``, creates ``cfg.dir``, opens the store,
    allocates the scratch pool, the predictor (which synchronizes the stream, as the original did), the
    tiled attention state and the step buffers. ``close()`` (or leaving a ``with`` block) waits for queued
    work and frees everything once. Single sequence per step, like the mainline original.
    """

    #: a sparse step's tile of misses of more runs than this is read by one ``page_gather`` launch where the store
    #: is a HostStore (:data:`~hss.swap.gather.SPARSE_GATHER_MIN_RUNS`; per instance too: a huge value keeps them
    #: batched DMA copies). Exact steps' tiles follow the store's own ``gather_min_runs`` (off by default).
    sparse_gather_min_runs: int = SPARSE_GATHER_MIN_RUNS

    #: whether sparse steps time their streamed tiles' read stalls (``read_stall_ms``): off by default, a sparse step
    #: records no timing events (two a streamed tile, and their queries); exact steps always time theirs. Per
    #: instance too.
    time_sparse_stalls: bool = False

    def __init__(self, ctx: cm.CudaCtx, cfg: HighSpeedSwapConfig, model: ModelDims) -> None:
        if not isinstance(ctx, cm.CudaCtx):
            raise TypeError(f"ctx must be a CudaCtx, got {type(ctx).__name__}; new_on_stream takes a stream")
        self._build(ctx, _args.stream(ctx, "ctx"), cfg, model)

    @classmethod
    def new_on_stream(cls, stream: Any, cfg: HighSpeedSwapConfig, model: ModelDims) -> HighSpeedSwap:
        """The original's constructor: set up on ``stream`` in the thread's current context."""
        self = cls.__new__(cls)
        self._build(None, _args.stream(stream), cfg, model)
        return self

    def _build(self, ctx: cm.CudaCtx | None, stream: int, cfg: HighSpeedSwapConfig, model: ModelDims) -> None:
        self._owned: list[Any] = []
        if not isinstance(cfg, HighSpeedSwapConfig):
            raise TypeError(f"cfg must be a HighSpeedSwapConfig, not {type(cfg).__name__}")
        if not isinstance(model, ModelDims):
            raise TypeError(f"model must be a ModelDims, not {type(model).__name__}")
        model.validate()
        cfg.validate()
        if ctx is not None:
            ctx.make_current()
        self._streams = StreamCheck(ctx, "this HighSpeedSwap")    # ctx None: the current context
        self._streams(stream, "stream" if ctx is None else "ctx")   # the setup stream: one of that context's
        self.config, self.model = cfg, model
        self.layout = GroupLayout(model.max_blocks_per_layer, model.num_kv_heads, model.block_size, model.head_dim)
        need = model.num_layers * self.layout.bytes_per_layer
        if need > cfg.bytes:
            raise HssError(f"the backing store needs {need} bytes ({model.num_layers} layers x "
                           f"{model.max_blocks_per_layer} pages x {self.layout.block_bytes} bytes) but "
                           f"HighSpeedSwapConfig.bytes is {cfg.bytes}: raise bytes, or lower max_blocks_per_layer "
                           "or num_layers")
        made = _missing_dirs(Path(cfg.dir))
        cfg.validate_and_prepare()
        self.tile_blocks, self.resident_capacity = cfg.tile_blocks, cfg.resident_capacity
        T, R = self.tile_blocks, self.resident_capacity
        try:
            own = self._own
            if cfg.store == "file":
                self.store: BackingStore = own(FileStore(cfg.dir, self.layout, model.num_layers, direct=cfg.direct,
                                                         qd=cfg.qd, bounce_pages=3 * T, ctx=ctx,
                                                         run_cap_bytes=cfg.run_cap_bytes))
            else:
                self.store = own(HostStore(self.layout, model.num_layers, ctx=ctx))
            self.pool = own(ScratchPool(self.layout, cfg.resident_blocks, num_layers=model.num_layers,
                                        reserved_slots=2 * T, ctx=ctx))
            pdims = PredictorDims(model.num_layers, model.num_q_heads, model.num_kv_heads, model.head_dim,
                                  cfg.rank, model.block_size, model.max_blocks_per_layer)
            seed = cfg.projection_seed if cfg.projection is None else None
            self.predictor = own(Predictor.new_on_stream(stream, pdims, seed, projection=cfg.projection,
                                                         head_temperature=cfg.head_temperature))
            cap = max(R, T)
            self.attn = own(TiledAttention(ctx, TiledAttentionDims(1, model.num_q_heads, model.num_kv_heads,
                                                                   model.head_dim, model.block_size, cap)))
            self._max_tiles = 1 + -(-model.max_blocks_per_layer // T)
            nb = model.max_blocks_per_layer
            self._q_proj = own(cm.DeviceBuffer(2 * model.num_q_heads * cfg.rank, ctx))
            self._scores_dev = own(cm.DeviceBuffer(4 * nb, ctx))
            self._scores_host = own(cm.PinnedBuffer(4 * nb, ctx))
            # per-tile entry counts (i32 [max_tiles]), then at _tables_offset the slot tables (i32 [max_tiles, cap])
            self._tables_offset = -(-4 * self._max_tiles // 256) * 256
            index_bytes = self._tables_offset + 4 * self._max_tiles * cap
            self._tile_index_dev = own(cm.DeviceBuffer(index_bytes, ctx))
            self._tile_index_host = own(cm.PinnedBuffer(index_bytes, ctx))
            self.copy_stream = own(cm.CudaStream(ctx))
            ev = lambda: own(cm.CudaEvent(ctx=ctx))   # noqa: E731
            self._ev_scores, self._ev_go, self._ev_step_done, self._ev_resident = ev(), ev(), ev(), ev()
            self._ev_loaded, self._ev_done = (ev(), ev()), (ev(), ev())
            self._timer = own(_StallTimer(ctx))
            dev = self._streams.device
            parts = {"its store": self.store.device}
            for name, part in (("its scratch pool", self.pool), ("its predictor", self.predictor),
                               ("its tiled attention", self.attn), ("its step buffers", self)):
                parts.update((name, d) for d in _buffer_devices(part) if d != dev)
            same_device("HighSpeedSwap", dev, **parts)
        except BaseException:
            try:
                self.close()
            finally:
                for d in made:        # the directories validate_and_prepare made, if still empty
                    try:
                        d.rmdir()
                    except OSError:
                        pass
            raise
        self._counts_dev = self._tile_index_dev.ptr
        self._tables_dev = self._counts_dev + self._tables_offset
        self._scores_f32 = self._scores_host.view(np.float32)
        self._count_rows = self._tile_index_host.view(np.int32)[:self._max_tiles]
        self._table_rows = self._tile_index_host.view(np.int32)[self._tables_offset // 4:].reshape(self._max_tiles, cap)
        self._tables_pending = False
        self._tables_fence = self._ev_scores     # what covers the last table upload (see _upload_tables)
        # streamed miss j goes to slot R + (j // T % 2) * T + j % T: tile j // T in stream buffer (j // T) % 2
        j = np.arange(nb, dtype=np.int64)
        self._stream_slots = R + j // T % 2 * T + j % T
        self._slot_dsts = self.pool.ptr + self.layout.block_bytes * np.arange(self.pool.num_slots, dtype=np.int64)
        self._stream_dsts = self._slot_dsts[self._stream_slots]
        self._tile_bounds = np.arange(0, (self._max_tiles + 1) * T, T, dtype=np.int64)
        self._edges: dict[int, tuple[np.ndarray, list[int]]] = {}     # misses: their tiles' bounds (_plan_reads)
        self._buffer_slots = (tuple(range(R, R + T)), tuple(range(R + T, R + 2 * T)))
        self._stream_table = np.zeros((self._max_tiles, cap), dtype=np.int32)
        self._stream_table[:, :T] = R + np.arange(self._max_tiles)[:, None] % 2 * T + np.arange(T)
        self.eviction = EvictionPolicy(R)
        self.disk = DiskBlockAllocator(model.max_blocks_per_layer)
        self._operands = self.pool.attention_operands(self.attn)
        self._mine = _owned_ranges(self)
        rowbytes = 2 * model.num_q_heads * model.head_dim      # q and out: bf16 [num_q_heads, head_dim]
        # another device's q, output or K page is refused
        self._q_arg = _args.pointer_arg("q_dev", rowbytes, 2, "bf16", False, "bf16 [num_q_heads, head_dim]",
                                        device=dev)
        self._out_arg = _args.pointer_arg("out_dev", rowbytes, 2, "bf16", True,
                                          "a bf16 [num_q_heads, head_dim] output", device=dev)
        self._page_bytes = 2 * model.block_size * model.num_kv_heads * model.head_dim
        self._k_arg = _args.pointer_arg("k_block_dev", self._page_bytes, 2, "bf16", False,
                                        "one bf16 [block_size, num_kv_heads, head_dim] KV page", device=dev)
        self._copy = self.copy_stream.handle
        self._stepped = False
        self._ended = False      # the last step's end was recorded (step_done follows all its work on its stream)
        self._done_on = -1       # the stream step_done was last recorded on
        self._pending_touch: np.ndarray | None = None    # a sparse step's hits, touched once its reads are queued
        self._read_mark: Any = None     # the store's fences known run once the next step's scores are (_wait_scores)
        self._last_sparse: tuple[tuple[Any, Any, Any], SparseBudget | None] | None = None
        self._last_ids = (np.zeros(0, dtype=np.int64), -1, False)    # the last seq_block_ids checked (_seq_ids):
        #                                                                   (ids, largest, whether 0..n-1 in order)
        self._last_bytes = b""
        self._readable: dict[int, tuple[np.ndarray, int]] = {}  # layer: (ids, store epoch) with every page readable
        self.last_step: StepRecord | None = None
        self._n = dict(steps=0, tiles=0, hits=0, misses=0, promotions=0, evictions=0, bytes_read=0, sparse_steps=0,
                       skipped=0)
        self._host_read = self._score_wait = 0.0
        self._prof = dict.fromkeys(_PHASES, 0.0)     # host_profile()

    def _own(self, obj: Any) -> Any:
        self._owned.append(obj)
        return obj

    @property
    def device(self) -> int:
        """The ordinal of the device the swap works on (its context's)."""
        return self._streams.device

    def _refuse_owned(self, ptr: int, nbytes: int, name: str) -> None:
        """HssError where argument ``name`` overlaps memory the swap or its store owns (which its work writes)."""
        self._mine.check(ptr, nbytes, name, "this HighSpeedSwap")
        self.store._memory.check(ptr, nbytes, name, "this HighSpeedSwap's store")

    # -- argument checks -------------------------------------------------------------------------
    def _live(self) -> None:
        if not self._owned:
            raise HssError("this HighSpeedSwap is closed")

    def _layer(self, layer: Any) -> int:
        v = _args.as_int("layer", layer)
        if not 0 <= v < self.model.num_layers:
            raise HssError(f"layer {v} is out of range: the model has {self.model.num_layers} layers")
        return v

    def _block(self, block: Any) -> int:
        v = _args.as_int("block", block)
        if not 0 <= v < self.model.max_blocks_per_layer:
            raise HssError(f"block {v} is out of range 0..{self.model.max_blocks_per_layer - 1} "
                           "(ModelDims.max_blocks_per_layer)")
        return v

    def _seq_ids(self, seq_block_ids: Any) -> tuple[np.ndarray, int]:
        """``seq_block_ids`` checked, as our own int64 copy (the step record keeps it), and its largest id (-1 when
        empty)."""
        arr = np.asarray(seq_block_ids)
        last, last_top, _ = self._last_ids
        if arr.shape == last.shape and arr.dtype == last.dtype and last.size and arr.tobytes() == self._last_bytes:
            return last, last_top     # a decode loop passes the same pages step after step: our (read-only) copy
        if arr.dtype.kind not in "iu" and (arr.size or arr.dtype.kind not in "f"):   # [] is float64
            raise TypeError(f"seq_block_ids must hold ints, got {arr.dtype}")
        if arr.ndim != 1:
            raise HssError(f"seq_block_ids must be a 1-D sequence of block ids, got shape {arr.shape}")
        arr = arr.astype(np.int64)
        if not arr.size:
            return arr, -1
        nb = self.model.max_blocks_per_layer
        increasing = not np.count_nonzero(arr[1:] <= arr[:-1])     # the usual order: no repeat, ends bound the range
        top = int(arr[-1]) if increasing else int(arr.view(np.uint64).max())   # a negative id wraps to a huge one
        if top >= nb or arr[0] < 0:
            bad = arr[(arr < 0) | (arr >= nb)]
            raise HssError(f"seq_block_ids holds {bad[:8].tolist()}, out of range 0..{nb - 1}")
        if not increasing:
            counts = np.bincount(arr)          # O(max id), like the scores the step computes
            if counts.max() > 1:
                raise HssError(f"seq_block_ids repeats block ids {np.flatnonzero(counts > 1)[:8].tolist()}: each "
                               "page may appear once per attend_layer call")
        arr.setflags(write=False)      # the step records keep it, and the next step may reuse it
        # (increasing from 0 to size - 1: the pages 0..n-1 in order, whose scores are a prefix of the layer's)
        self._last_ids, self._last_bytes = (arr, top, increasing and top == arr.size - 1), arr.tobytes()
        return arr, top

    def _sparse_args(self, budget_pages: Any, keep_first: Any, keep_recent: Any) -> SparseBudget | None:
        """:func:`~hss.swap.sparse.sparse_budget` of the arguments, the last step's answer where they are the same
        ints (a decode loop passes the same budget step after step)."""
        key = (budget_pages, keep_first, keep_recent)
        last = self._last_sparse
        if last is not None and all(v is None or type(v) is int for v in key) and last[0] == key:
            return last[1]
        sparse = sparse_budget(budget_pages, keep_first, keep_recent)
        self._last_sparse = (key, sparse)
        return sparse

    def _lbvs(self, lbvs: Any, q_pos: Any) -> int:
        bs = self.model.block_size
        if q_pos is not None:
            qp = _args.as_int("q_pos", q_pos)
            if qp < 0:
                raise HssError(f"q_pos must be >= 0 (got {qp})")
            from_pos = qp % bs + 1
            if lbvs is not None and _args.as_int("last_block_valid_slots", lbvs) != from_pos:
                raise HssError(f"last_block_valid_slots ({lbvs}) disagrees with q_pos {qp} (which gives "
                               f"q_pos % block_size + 1 = {from_pos}); pass one of them")
            return from_pos
        if lbvs is None:
            return bs
        v = _args.as_int("last_block_valid_slots", lbvs)
        if not -2**31 <= v < 2**31:
            raise HssError(f"last_block_valid_slots ({v}) must fit in int32")
        return v

    # -- offload ---------------------------------------------------------------------------------
    def offload_block(self, ctx: cm.CudaCtx, layer: int, block: int, k_block_dev: Any, k_host: Any,
                      v_host: Any) -> None:
        """:meth:`offload_block_on_stream` on ``ctx.stream``."""
        self.offload_block_on_stream(self._streams(ctx, "ctx"), layer, block, k_block_dev, k_host, v_host)

    def offload_block_on_stream(self, stream: Any, layer: int, block: int, k_block_dev: Any, k_host: Any,
                                v_host: Any) -> None:
        """Store page ``block`` of ``layer`` and queue its predictor projection on ``stream``.

        k_block_dev: device bf16 ``[block_size, num_kv_heads, head_dim]`` (the NHD page in the KV cache, of the swap's
        device; not in the swap's or its store's own memory); k_host, v_host: the same page's K and V on the host,
        bf16 ``[block_size, num_kv_heads, head_dim]`` (a typed array must be bf16, or its bits as uint16, of exactly
        that shape; raw bytes and flat arrays are taken as that layout). Everything is checked before anything
        happens. The store write is synchronous; then the projection into the block's A_g slot is queued, and a
        resident copy of the page is dropped from the scratch pool.

        All or nothing: a call that fails changes nothing observable. A store write that fails
        (:class:`StoreIOError`) leaves the page's stored bytes, the A_g slot and the pool as they were (nothing is
        projected); a projection that fails to queue after the write (a driver error) puts the page's previous bytes
        back before its error propagates, so the store, the A_g slot and the pool are again as before. Only where
        the previous bytes cannot be put back (the disk fails again) is the page left unreadable, and dropped from
        the pool, until it is offloaded again (the error says so). (An interrupt landing after the projection was
        queued leaves the A_g slot projected from the new page, a score hint only; offload again.)
        """
        self._live()
        s = self._streams(stream)
        layer, block = self._layer(layer), self._block(block)
        with _args.deferred_joins():
            k = self._k_arg(k_block_dev, s)
            self._refuse_owned(k, self._page_bytes, "k_block_dev")
            image = self.layout.pack_page(k_host, v_host)
        saved = self._store(layer, block, image)
        try:
            self.predictor.project_kv_block_on_stream(s, layer, block, k)
        except BaseException:
            try:
                self.store._undo(saved)
            finally:
                self._forget_if_unreadable(layer, block)
            raise
        self.pool.invalidate((layer, block))

    def offload_block_no_predict_on_stream(self, stream: Any, layer: int, block: int, k_host: Any,
                                           v_host: Any) -> None:
        """:meth:`offload_block_on_stream` without the projection (quantized caches): the block's A_g slot
        keeps what it had (zeros if never written), so its score is stale; eviction still works. All or nothing
        like the store write there."""
        self._live()
        self._streams(stream)
        layer, block = self._layer(layer), self._block(block)
        self._store(layer, block, self.layout.pack_page(k_host, v_host))
        self.pool.invalidate((layer, block))

    def _store(self, layer: int, block: int, image: np.ndarray) -> Any:
        """Write the page into the store, all or nothing; returns what undoes it (``store._undo``)."""
        try:
            return self.store._put(layer, block, 0, image, slice(None))
        except BaseException:
            self._forget_if_unreadable(layer, block)
            raise

    def _forget_if_unreadable(self, layer: int, block: int) -> None:
        """After a failed write: a page the store can no longer read is dropped from the pool too (else the pool
        keeps its copy, the same bytes as the store's)."""
        if not self.store.page_valid(layer, block):
            self.pool.invalidate((layer, block))

    # -- disk block ids --------------------------------------------------------------------------
    def alloc_disk_block(self) -> int | None:
        """A free disk block id (refcount 1), or None when all ``max_blocks_per_layer`` are in use."""
        self._live()
        return self.disk.alloc()

    def inc_ref(self, block: int) -> None:
        self._live()
        self.disk.inc_ref(block)

    def dec_ref(self, block: int) -> bool:
        """Drop a reference; at 0 the id is freed and its pages (every layer) are forgotten by the store and
        the scratch pool, so a recycled id never serves stale data. Returns True when freed."""
        self._live()
        block = _args.as_int("block", block)
        freed = self.disk.dec_ref(block)
        if freed:
            self.store.invalidate_block(block)
            self.pool.invalidate_page(block)
        return freed

    def disk_free_count(self) -> int:
        return self.disk.free_count

    # -- attention -------------------------------------------------------------------------------
    def attend_layer(self, ctx: cm.CudaCtx, layer: int, seq_block_ids: Any, q_dev: Any, out_dev: Any,
                     last_block_valid_slots: int | None = None, *, q_pos: int | None = None,
                     budget_pages: int | None = None, keep_first: int | None = None,
                     keep_recent: int | None = None) -> StepRecord:
        """:meth:`attend_layer_on_stream` on ``ctx.stream``."""
        return self.attend_layer_on_stream(self._streams(ctx, "ctx"), layer, seq_block_ids, q_dev, out_dev,
                                           last_block_valid_slots, q_pos=q_pos, budget_pages=budget_pages,
                                           keep_first=keep_first, keep_recent=keep_recent)

    def attend_layer_on_stream_with_q_pos(self, stream: Any, layer: int, seq_block_ids: Any, q_dev: Any,
                                          out_dev: Any, last_block_valid_slots: int) -> StepRecord:
        """The original's name: :meth:`attend_layer_on_stream` with ``last_block_valid_slots``."""
        return self.attend_layer_on_stream(stream, layer, seq_block_ids, q_dev, out_dev, last_block_valid_slots)

    def attend_layer_on_stream(self, stream: Any, layer: int, seq_block_ids: Any, q_dev: Any, out_dev: Any,
                               last_block_valid_slots: int | None = None, *, q_pos: int | None = None,
                               budget_pages: int | None = None, keep_first: int | None = None,
                               keep_recent: int | None = None) -> StepRecord:
        """Exact attention of one decode query over the pages ``seq_block_ids`` of ``layer`` (see the module
        docstring for the queue order); returns (and keeps as :attr:`last_step`) the step's record.

        q_dev: device bf16 ``[num_q_heads, head_dim]``; out_dev: device bf16 ``[num_q_heads, head_dim]``.
        seq_block_ids: distinct disk block ids in token order; each must have been offloaded for ``layer``.
        The last page contributes ``last_block_valid_slots`` tokens (default block_size; or give ``q_pos``:
        ``q_pos % block_size + 1``). Everything is checked before any work is queued: ``stream`` must be one of
        the swap's context, q_dev and out_dev memory of its device; neither may overlap memory the swap owns (its
        scratch pool, the predictor's P and A_g, the attention state, its tables and their pinned copies) or its store
        owns (the HostStore's pages and index ring, the FileStore's bounce ring), nor out_dev q_dev. Waits on the
        host for the predictor scores; otherwise asynchronous on ``stream``. A step that fails part way (a read
        error, a driver error, an interrupt) changes no page: the pool keeps only resident pages whose copies were
        queued, and the next step is exact.

        The sparse mode (SPEC §17.6; opt in with ``budget_pages``, an int >= 0): the step attends the first
        ``keep_first`` (None: 1) and the last ``keep_recent`` (None: 4; the sparse mode's one set of defaults, the
        recall bench's best, :data:`hss.swap.sparse.KEEP_FIRST` / ``KEEP_RECENT``; 0 / 0 is the plain top-K) pages
        of ``seq_block_ids`` plus the ``budget_pages`` others with the highest predictor scores (ties to the earlier
        page, NaN last), in sequence order, and reads only those of them that are not resident: exact attention over
        exactly those pages (the last page keeps its valid slots if attended). It waits for the scores before
        queueing any read; the record says what it skipped. A budget covering every other page is the exact step,
        bits included.
        """
        t0 = time.perf_counter()
        self._live()
        s = self._streams(stream)
        layer = self._layer(layer)
        ids, top = self._seq_ids(seq_block_ids)
        lbvs = self._lbvs(last_block_valid_slots, q_pos)
        sparse = self._sparse_args(budget_pages, keep_first, keep_recent)
        rowbytes = 2 * self.model.num_q_heads * self.model.head_dim
        with _args.deferred_joins():
            q, out = self._q_arg(q_dev, s), self._out_arg(out_dev, s)
            self._refuse_owned(q, rowbytes, "q_dev")
            self._refuse_owned(out, rowbytes, "out_dev")
            if out < q + rowbytes and q < out + rowbytes:      # (the error is _args.disjoint's)
                _args.disjoint("attend_layer", ("out_dev", out, rowbytes, True), ("q_dev", q, rowbytes, False))
        self._prof["checks"] += time.perf_counter() - t0
        if sparse is not None and not sparse.covers(ids.size):
            rec = self._sparse_step(s, layer, ids, top, q, out, lbvs, sparse)
        else:
            rec = self._step(s, layer, ids, q, out, lbvs, self._plan(layer, ids), None, budget=sparse)
            if sparse is not None:
                self._n["sparse_steps"] += 1
        self.last_step = rec
        return rec

    def _sparse_step(self, s: int, layer: int, ids: np.ndarray, top: int, q: int, out: int, lbvs: int,
                     sparse: SparseBudget) -> StepRecord:
        """The sparse step (SPEC §17.6): the scores first (the host waits), then :meth:`_step` over the pages
        chosen. Every page must be readable, checked before any device work like the exact step's reads. With the
        scores known before any read, the promotions are planned first and those misses are read straight into
        their resident slots (no device-to-device copy); every tile's reads are one prepared batch. Here the scores
        are queued and what needs no score is done; :meth:`_step` sets its tiles up, then waits
        (:meth:`_choose`): from the score wait to the first read only what that read needs is done."""
        t0 = time.perf_counter()
        self._check_readable(layer, ids)
        self._begin(s)
        try:
            self._queue_scores(s, layer, q, top + 1)
            self._record_scores_event(s)
            resident = self.pool._lookup_planned(layer, ids)     # host work while the device scores
            held = resident >= 0
            held_pos = held.nonzero()[0]
            held_slots = resident[held_pos]
            by_slot = None
            if held_slots.size == self.resident_capacity:      # every slot holds one of these pages: slot i's
                by_slot = np.empty_like(held_pos)               # is at position by_slot[i]
                by_slot[held_slots] = held_pos
            choose = functools.partial(self._choose, layer, ids, sparse, resident, held, held_pos, held_slots,
                                       by_slot)
        except BaseException:
            self._end(s)
            raise
        self._prof["sparse_queue"] += time.perf_counter() - t0
        return self._step(s, layer, ids, q, out, lbvs, choose, None, budget=sparse)

    def _choose(self, layer: int, ids: np.ndarray, sparse: SparseBudget, resident: np.ndarray, held: np.ndarray,
                held_pos: np.ndarray, held_slots: np.ndarray, by_slot: np.ndarray | None) -> tuple:
        """A sparse step's wait for its scores, page choice and plan (:meth:`_plan_sparse`): (plan, the scores of
        ``ids``, the mask of those attended, the host seconds of (wait, choice, plan)). ``resident``: the slot of
        each page (-1: none); ``held``, ``held_pos``, ``held_slots``: where there is one, and which; ``by_slot``
        (every slot holding one of them): the position of each slot's page."""
        t1 = time.perf_counter()
        scores = self._wait_scores(ids)
        t2 = time.perf_counter()
        keep = select_mask(scores, sparse)
        # every resident page ranks by this query's score (the skipped are never touched; hits are, see _plan_sparse)
        if by_slot is None:
            self.eviction._score_planned(held_slots, scores[held_pos])
        else:
            self.eviction._score_all_planned(scores, by_slot)
        t3 = time.perf_counter()
        plan = self._plan_sparse(layer, ids, scores, resident, keep, held, held_pos, held_slots)
        return plan, scores, keep, (t2 - t1, t3 - t2, time.perf_counter() - t3)

    def _plan(self, layer: int, ids: np.ndarray) -> _Plan:
        """Hits, misses, streamed tiles and every read of an exact step over ``ids``, checked (StoreError naming
        pages never offloaded) and planned: the step's loop only issues them."""
        slots = self.pool._lookup_planned(layer, ids)
        hit = slots >= 0
        hit_pos, miss_pos = hit.nonzero()[0], (~hit).nonzero()[0]
        m = int(miss_pos.size)
        miss_ids = ids[miss_pos]
        if not self._known_readable(layer, ids):
            missing = self.store._missing_planned(layer, miss_ids)
            if missing.size:
                raise _never_offloaded(layer, missing)
        ns, reads = self._plan_reads(layer, miss_ids, self._stream_dsts[:m], self._stream_slots[:m], None)
        return _Plan(slots, hit_pos, miss_pos, miss_ids, ns, reads, bool(ids.size) and bool(hit[-1]))

    def _plan_sparse(self, layer: int, ids: np.ndarray, scores: np.ndarray, resident: np.ndarray, keep: np.ndarray,
                     held: np.ndarray, held_pos: np.ndarray, held_slots: np.ndarray) -> _Plan:
        """:meth:`_plan` of a sparse step over the pages ``ids`` (checked readable already) it attends where ``keep``
        (a mask), ``scores`` their scores (waited for), ``resident`` their resident slots (-1: none; ``held``: where
        there is one, positions ``held_pos``, slots ``held_slots``). Its hit_pos and miss_pos index ``ids``. The
        promotions are decided here, before the reads, and those misses read into their resident slots; the hits'
        touch waits until the reads are queued (:meth:`_touch_hits`) unless the decision needs recency first."""
        hit = keep[held_pos]
        hit_pos, hit_slots = held_pos[hit], held_slots[hit]
        miss_pos = (keep > held).nonzero()[0]
        m = int(miss_pos.size)
        last = self._last_ids
        miss_ids = miss_pos if ids is last[0] and last[2] else ids[miss_pos]     # (pages 0..n-1: position = page)
        if hit_pos.size:
            self._pending_touch = hit_slots
        ns = -(-m // self.tile_blocks)
        picked = self._pick_promotions(scores, miss_pos, ns, hit_slots)
        if picked is None:
            miss_slots, dsts, dst_slots = None, self._stream_dsts[:m], self._stream_slots[:m]
        else:
            miss_slots = self._stream_slots[:m].copy()
            miss_slots[picked.take] = picked.into
            dsts, dst_slots = self._slot_dsts[miss_slots], miss_slots
        ns, reads = self._plan_reads(layer, miss_ids, dsts, dst_slots, self.sparse_gather_min_runs)
        last_is_hit = bool(hit_pos.size) and (not m or int(hit_pos[-1]) > int(miss_pos[-1]))
        return _Plan(resident, hit_pos, miss_pos, miss_ids, ns, reads, last_is_hit, picked, miss_slots)

    def _plan_reads(self, layer: int, miss_ids: np.ndarray, dsts: np.ndarray, dst_slots: np.ndarray,
                    gather_min_runs: int | None) -> tuple[int, PreparedReads]:
        """(streamed tiles, the reads of ``miss_ids`` into pool slots ``dst_slots`` at ``dsts``: tile i's misses
        ``i * T:(i + 1) * T``, one group each)."""
        t0 = time.perf_counter()
        m = miss_ids.size
        ns = -(-m // self.tile_blocks)                      # streamed tiles: the misses in sequence order
        edges = self._edges.get(m)
        if edges is None:         # (a few miss counts recur: made once each, never changed)
            bounds = self._tile_bounds[:ns + 1].copy()
            bounds[-1] = m
            edges = self._edges[m] = (bounds, bounds.tolist())
        reads = self.store._plan_reads(layer, miss_ids, dsts, *edges, (self.pool._slot_ptrs, dst_slots),
                                       gather_min_runs)
        self._host_read += time.perf_counter() - t0
        return ns, reads

    def _known_readable(self, layer: int, ids: np.ndarray) -> bool:
        """Whether every page ``ids`` (our read-only copy) of ``layer`` was found readable since the store last
        changed (its epoch: bumped by every write and invalidation)."""
        seen = self._readable.get(layer)
        return seen is not None and seen[0] is ids and seen[1] == self.store._epoch

    def _check_readable(self, layer: int, ids: np.ndarray) -> None:
        """StoreError naming the pages ``ids`` of ``layer`` never offloaded, if any; once all are readable, the same
        ids are not looked up again until the store changes."""
        if self._known_readable(layer, ids):
            return
        missing = self.store._missing_planned(layer, ids)
        if missing.size:
            raise _never_offloaded(layer, missing)
        self._readable[layer] = (ids, self.store._epoch)

    def _begin(self, s: int) -> None:
        """Order the step after the previous one on ``s`` and on the copy stream (the stream buffers and the promoted
        pages' slots may still be read by the previous step); before any step, the copy stream after ``s``. (``s``
        itself waits only where the previous step's end was recorded on another stream: a stream runs in order.)"""
        c = self._copy
        if self._stepped and s != self._done_on:
            cm.stream_wait_event(s, self._ev_step_done)
        if self._ended:
            cm.stream_wait_event(c, self._ev_step_done)
        else:        # (and after a step whose end was not recorded: step_done is older than its work on s)
            self._ev_go.record(s)
            cm.stream_wait_event(c, self._ev_go)

    def _end(self, s: int) -> None:
        self._ended = False
        self._ev_step_done.record(s)
        self._stepped = self._ended = True
        self._done_on = s

    def _step(self, s: int, layer: int, ids: np.ndarray, q: int, out: int, lbvs: int, plan: Any,
              known: np.ndarray | None, budget: SparseBudget | None = None) -> StepRecord:
        """Attend the pages ``ids`` (sequence order) as ``plan`` says (its hits and misses: those of ``ids`` it
        attends). ``plan`` a :class:`_Plan`: the exact step (the module doc: reads and the score work queued before the
        host waits for the scores; ``budget``: its sparse arguments, a covering budget). Else the sparse step's tiles,
        begun by the caller: ``plan`` is its :meth:`_choose` (the score wait and the plan, called once the tiles are
        set up), which gives the scores of ``ids`` (``known``) and the promotions, read straight into their resident
        slots (a tile whose reads overwrite a hit's slot waits for the resident tile; the pool and eviction
        bookkeeping of the tiles whose reads were queued, the hits' touch included, is done at once at the end, see
        :meth:`_put_promotions`); ``budget`` its sparse arguments."""
        c, n = self._copy, self._n
        choose = None if type(plan) is _Plan else plan
        t_start = time.perf_counter()
        if choose is None:
            self._begin(s)
        loaded, done = self._ev_loaded, self._ev_done
        begun: list[int] = []    # the streamed tiles whose reads were begun, in issue order (tile order, but where
        queued = [0]             # tile 0 alone waits for the resident tile: 1, 0, 2, ...); how many were queued
        ready: list[Any] = [None, None]     # the event after the reads of the last tile read into each buffer

        def read(i: int) -> None:
            if i >= 2:
                cm.stream_wait_event(c, done[i % 2])
            if i == wait_tile:        # its reads overwrite a slot the resident tile reads
                cm.stream_wait_event(c, self._ev_resident)
            t = time.perf_counter()
            begun.append(i)
            n["bytes_read"] += reads.issue(i, c)
            queued[0] += 1
            self._host_read += time.perf_counter() - t
            fence = reads.fence      # (the store keeps this record for FENCES - 1 more groups: s waits for it
            #                          before read(i + 2))
            if fence is None:        # a FileStore's: its own events guard its bounce ring
                fence = loaded[i % 2]
                fence.record(c)
            ready[i % 2] = fence

        promoted: list[tuple[int, int, int]] = []                 # exact: (decision rank, block id, slot)
        evicted: list[tuple[int, tuple[int, int], int]] = []      # exact: (decision rank, (layer, page), slot)
        promo: _Promotions | None = None
        try:
            if choose is not None:      # the sparse step: its scores (the host waits) and its plan
                plan, known, kept, waited = choose()
                t_start = time.perf_counter()
                if not kept[-1]:        # (the last page is skipped: no tile gets the caller's valid slots)
                    lbvs = self.model.block_size
            slots, hit_pos, miss_pos, miss_ids, ns, reads, last_is_hit, picked, miss_slots = plan
            wait_tile, late = (ns, ()) if picked is None else (picked.wait_tile, picked.late)
            early = min(2, ns)          # the first reads run while the host queues (and waits for) the scores
            for i in range(early):
                if i not in late:
                    read(i)
            bs, m = self.model.block_size, int(miss_pos.size)
            first = 1 if hit_pos.size else 0                    # the resident tile, if any, is row 0
            ta, cap = self.attn, self.attn.dims.tile_capacity
            kp, vp, blk, tok, kvh = self._operands
            tables, counts = self._tables_dev, self._counts_dev
            timer = self._timer
            timed = known is None or self.time_sparse_stalls      # (a sparse step's stalls: opt in)
            pool = self.pool

            def attend(row: int, tile_lbvs: int) -> None:
                output = out if row == first + ns - 1 else 0   # the step's last tile also writes the output
                if row == 0:   # checks q, the pool and the strides once per step
                    ta.step_tile(s, q, kp, vp, tables, counts, 1, blk, tok, kvh, tile_lbvs, output or None)
                else:
                    ta._next_tile(s, tables + 4 * row * cap, counts + 4 * row, tile_lbvs, output)

            def attend_streamed(i: int) -> None:
                if timed:
                    timer.begin(s)
                    cm.stream_wait_event(s, ready[i % 2])
                    timer.end(s)
                else:
                    cm.stream_wait_event(s, ready[i % 2])
                attend(first + i, lbvs if i == ns - 1 and not last_is_hit else bs)

            if first + ns:
                if known is None:
                    self._queue_scores(s, layer, q, int(ids.max()) + 1)
                self._upload_tables(s, slots[hit_pos], first, ns, m, miss_slots)
                if known is None:     # covers the table upload: the next step may refill the pinned tables
                    self._record_scores_event(s)
                    self._tables_fence = self._ev_scores
                else:                 # a sparse step waited for its scores already: its end covers the upload
                    self._tables_fence = self._ev_step_done
            ta.begin_step(s, 1)
            if first:
                attend(0, lbvs if last_is_hit else bs)
                if wait_tile < ns:
                    self._ev_resident.record(s)
            for i in late:
                read(i)
            if ns:
                attend_streamed(0)
            t_queued = time.perf_counter()
            if known is None:
                scores = self._wait_scores(ids)
                if hit_pos.size:
                    self.eviction.record_scores(slots[hit_pos], scores[hit_pos])
                    self.eviction.touch_many(slots[hit_pos])
                promo = self._plan_promotions(scores, miss_pos, ns)
            else:
                scores = known
            bb = self.layout.block_bytes
            for i in range(ns):
                if i:
                    attend_streamed(i)
                if known is None and promo is not None:     # after the tile's attention, before done
                    lo, hi = promo.at[i], promo.at[i + 1]
                    for j, slot, rank in zip(promo.take[lo:hi].tolist(), promo.into[lo:hi].tolist(),
                                             promo.rank[lo:hi].tolist()):
                        cm.copy_d_to_d_async(pool.ptr + slot * bb, int(self._stream_dsts[j]), bb, s)
                        block = int(miss_ids[j])
                        old = pool.put((layer, block), slot)
                        self.eviction.record_score(slot, scores[miss_pos[j]])
                        self.eviction.touch(slot)
                        promoted.append((rank, block, slot))
                        if old is not None:
                            evicted.append((rank, old, slot))
                if i + 2 < ns:       # (the next step's reads wait for step_done)
                    done[i % 2].record(s)
                    read(i + 2)
            if not first + ns:   # no tile: the output of the empty state
                ta.finalize(s, out, 1)
        finally:
            try:       # the bookkeeping of what was queued, even when the step's end cannot be recorded
                if choose is None:
                    n["promotions"] += len(promoted)
                    n["evictions"] += len(evicted)
                elif known is None:     # a sparse step that failed before its plan was made
                    self._touch_hits()
                else:
                    promo = self._settle(layer, ids, plan, waited, begun, queued[0])
            finally:
                self._end(s)
        if ns:      # s waited for every tile's reads before the end: once a later step's scores are in, so were they
            self._read_mark = self.store._read_mark()
        t_issued = time.perf_counter()
        self._timer.collect(wait=False)     # host work here overlaps the step's last tiles on the device
        n["steps"] += 1
        n["tiles"] += first + ns
        n["hits"] += int(hit_pos.size)
        n["misses"] += m
        # (scores may be a view of the pinned scores, _wait_scores: the next step refills it)
        block_scores = scores if scores.flags.owndata else scores.copy()
        ids.setflags(write=False)
        block_scores.setflags(write=False)
        moves, kept = ((promoted, evicted), None) if choose is None else (promo, kept)
        build = functools.partial(_record_fields, ids, slots, hit_pos, miss_ids, miss_slots, lbvs, last_is_hit, bs,
                                  self.tile_blocks, self._buffer_slots, moves, ids, kept)
        rec = StepRecord._of_step(layer, ids, block_scores, budget, build)
        prof = self._prof
        prof["tiles_queue"] += t_queued - t_start
        prof["tiles_rest"] += t_issued - t_queued
        prof["record"] += time.perf_counter() - t_issued
        return rec

    def _settle(self, layer: int, ids: np.ndarray, plan: _Plan, waited: tuple, begun: list[int],
                queued: int) -> _Promotions | None:
        """A sparse step's bookkeeping once its reads are queued (or one failed; ``begun``: the streamed tiles whose
        reads were begun, in issue order, the first ``queued`` of them queued): its hits touched, then the promotions of
        the tiles read (with every tile before them) put and the slots of the later tiles begun lost
        (:meth:`_put_promotions`), its counts and host seconds (``waited``: :meth:`_choose`'s). Returns its
        promotions."""
        self._touch_hits()
        promo = None
        if plan.promotions is not None:
            read = 0
            while read in begun[:queued]:
                read += 1
            promo = self._promotions(plan.promotions, plan.streamed_tiles)
            self._put_promotions(layer, promo, plan.miss_ids, read, tuple(i for i in begun if i >= read))
        prof = self._prof
        prof["sparse_wait"] += waited[0]
        prof["sparse_select"] += waited[1]
        prof["sparse_plan"] += waited[2]
        self._n["sparse_steps"] += 1
        self._n["skipped"] += ids.size - plan.hit_pos.size - plan.miss_pos.size
        return promo

    def _put_promotions(self, layer: int, promo: _Promotions, miss_ids: np.ndarray, tiles: int,
                        lost: tuple[int, ...]) -> None:
        """A sparse step's pool and eviction bookkeeping, at once, of the promotions in its first ``tiles`` streamed
        tiles (their reads queued): pages placed, scores recorded, slots touched in sequence order (as tile by
        tile). ``lost`` (a step that failed): later tiles whose reads were begun and may be partly queued (or queued
        ahead of an earlier tile's): their slots' pages are gone."""
        k = promo.at[tiles]
        if k:
            into, old_layer = promo.into[:k], promo.old_layer[:k]
            evicted = self.pool._put_planned(layer, miss_ids[promo.take[:k]], into, old_layer, promo.old_page[:k])
            self.eviction._record_planned(into, promo.scores[:k])
            self._n["promotions"] += k
            self._n["evictions"] += evicted
        for i in lost:
            self.pool.invalidate_slots(promo.into[promo.at[i]:promo.at[i + 1]])

    def _queue_scores(self, s: int, layer: int, q: int, n: int) -> None:
        """Queue the predictor scores of pages 0..n-1 and their copy into pinned host memory on ``s``."""
        self.predictor.project_q_on_stream(s, q, self._q_proj, layer=layer)
        self.predictor.score_layer_on_stream(s, self._q_proj, layer, 0, n, self._scores_dev)
        cm._d_to_h_planned(self._scores_host.ptr, self._scores_dev.ptr, 4 * n, s)   # n <= max_blocks_per_layer

    def _record_scores_event(self, s: int) -> None:
        """Record ``_ev_scores`` on ``s``, noting the stall-timer pairs recorded before it (complete once it is)."""
        self._ev_scores.record(s)
        self._timer.mark()

    def _wait_scores(self, ids: np.ndarray) -> np.ndarray:
        """Predictor scores of ``ids`` (host float32) once ``_ev_scores`` has completed; waits on the host. Where
        ``ids`` are pages 0..n-1 in order (the usual decode step), a view of the pinned scores: read it before the
        next step queues its scores (the step's record keeps a copy)."""
        if ids.size == 0:
            return np.zeros(0, dtype=np.float32)
        t0 = time.perf_counter()
        self._ev_scores.synchronize()
        self._score_wait += time.perf_counter() - t0
        self._tables_pending = False
        self._timer.reached()     # the stall timers of earlier steps are complete: summed with no query
        self.store._reads_ran(self._read_mark)    # and so are the reads of earlier steps
        last = self._last_ids
        if ids is last[0] and last[2]:
            return self._scores_f32[:ids.size]
        return self._scores_f32.take(ids)

    def _plan_promotions(self, scores: np.ndarray, miss_pos: np.ndarray, ns: int,
                         hit_slots: np.ndarray | None = None) -> _Promotions | None:
        """The misses to promote (see the module doc), or None. ``hit_slots`` (a sparse step, whose promoted misses
        are read into their slots): the slots the resident tile reads, for ``wait_tile``."""
        picked = self._pick_promotions(scores, miss_pos, ns, hit_slots)
        return None if picked is None else self._promotions(picked, ns)

    def _pick_promotions(self, scores: np.ndarray, miss_pos: np.ndarray, ns: int,
                         hit_slots: np.ndarray | None = None) -> _Picked | None:
        """The decision of :meth:`_plan_promotions`: what a sparse step's reads need (the rest: :meth:`_promotions`,
        from the pool as it is until the promotions are put)."""
        m = miss_pos.size
        if self.resident_capacity == 0 or m == 0:
            return None
        pool, eviction = self.pool, self.eviction
        miss_scores = scores[miss_pos]
        if pool._free:               # (free_count)
            self._touch_hits()       # (the ranking reads recency)
            picked = self._promote_into_free(miss_scores)
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
                picked = self._promote_by_value(miss_scores, ranked)
            else:
                self._touch_hits()
                picked = self._promote_ranked(miss_scores, [], eviction._rank_all(low))
        if picked is None:
            return None
        take, into, k = picked
        wait_tile, late = ns, ()
        if k and hit_slots is not None and hit_slots.size:      # (only a victim's slot can be a hit's)
            hit = np.zeros(self.resident_capacity, dtype=bool)
            hit[hit_slots] = True
            over = hit[into[-k:]]
            if np.count_nonzero(over):
                over = take[-k:][over].tolist()      # the misses read into a hit's slot (a few)
                T = self.tile_blocks
                wait_tile = min(over) // T
                if wait_tile < 2:
                    late = (0, 1) if wait_tile == 0 and any(T <= j < 2 * T for j in over) else (wait_tile,)
        return _Picked(take, into, k, miss_scores, wait_tile, late)

    def _promotions(self, picked: _Picked, ns: int) -> _Promotions:
        """The :class:`_Promotions` of a decision, in sequence order (the slots' keys read from the pool now)."""
        rank = picked.take.argsort()    # decision rank of each, in sequence order (distinct: any sort is stable)
        take, into = picked.take[rank], picked.into[rank]
        old_layer, old_page = self.pool._keys_planned(into)
        at = [0, take.size] if ns == 1 else take.searchsorted(self._tile_bounds[:ns + 1]).tolist()
        return _Promotions(take, into, rank, old_layer, old_page, picked.miss_scores[take], at, picked.wait_tile)

    def _touch_hits(self) -> None:
        """Touch the hits a sparse step's plan left pending (in sequence order): once its reads are queued, or before
        anything reads recency first."""
        pending, self._pending_touch = self._pending_touch, None
        if pending is not None:
            self.eviction._touch_planned(pending)

    def _promote_into_free(self, miss_scores: np.ndarray) -> tuple | None:
        """:meth:`_plan_promotions`' (take, into, victims taken: decision order) with free slots: the free ones first,
        then the first-ranked of the others."""
        m, pool = miss_scores.size, self.pool
        free = pool.free_slots()[:m]
        victims = None
        if len(free) < m:
            victims = self.eviction.rank(free)
            victims = victims[pool._keys_planned(victims)[0] >= 0]
        return self._promote_ranked(miss_scores, free, victims)

    def _promote_ranked(self, miss_scores: np.ndarray, free: list, victims: np.ndarray | None) -> tuple | None:
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

    def _promote_by_value(self, miss_scores: np.ndarray, ranked: tuple | None = None) -> tuple | None:
        """:meth:`_promote_ranked` into a full resident set with no NaN score on either side, the same answer with
        cheaper sorts: how many victims yield follows from the sorted scores alone (the i-th lowest resident against
        the i-th best miss), and where no two scores on a side are equal (-0.0 equals 0.0) any sort of them is the
        stable one (the usual case: a plain argsort, not the lexsort by recency and the stable sort). ``ranked``: the
        caller's (victims, their scores, order, the misses' scores in that order) of the sorts below."""
        eviction = self.eviction
        score = eviction.last_score
        n = min(miss_scores.size, self.resident_capacity)
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
            self._touch_hits()
            victims = np.lexsort((eviction.last_access, score))
        if np.count_nonzero(best[1:] == best[:-1]):   # a tie: the earlier miss first
            order = (-miss_scores).argsort(kind="stable")
        return order[:k], victims[:k], k

    def _upload_tables(self, s: int, hit_slots: np.ndarray, first: int, ns: int, misses: int,
                       miss_slots: np.ndarray | None = None) -> None:
        """Fill the pinned per-tile slot tables and counts (row 0 the resident tile when ``first``; the streamed
        tiles' slots the stream buffers', or a sparse step's ``miss_slots``) and queue their copy to the device on
        ``s``."""
        nt = first + ns
        if not nt:
            return
        if self._tables_pending:      # the last upload may not have run (a step failed before its score wait, or
            self._tables_fence.synchronize()    # a sparse step: its end covers it)
        table, count = self._table_rows, self._count_rows
        T = self.tile_blocks
        if first:
            table[0, :hit_slots.size] = hit_slots
            table[0, hit_slots.size:] = 0
            count[0] = hit_slots.size
        if ns:
            table[first:nt] = self._stream_table[:ns]
            if miss_slots is not None:       # tile i's misses are miss_slots[i * T:(i + 1) * T]
                whole, rest = divmod(misses, T)
                table[first:first + whole, :T] = miss_slots[:whole * T].reshape(whole, T)
                if rest:
                    table[nt - 1, :rest] = miss_slots[whole * T:]
            count[first:nt] = T
            count[nt - 1] = misses - (ns - 1) * T
        cap = self.attn.dims.tile_capacity
        # one copy: the counts, padding, then the first nt rows of the tables
        cm._h_to_d_planned(self._tile_index_dev.ptr, self._tile_index_host.ptr, self._tables_offset + 4 * nt * cap, s)
        self._tables_pending = True

    # -- diagnostics, lifetime -------------------------------------------------------------------
    def host_profile(self) -> dict[str, float]:
        """Host seconds spent so far in each part of ``attend_layer`` (totals; pure host clock, waits included):
        ``checks`` (arguments), ``sparse_queue`` (a sparse step's page checks, pool lookup and score launches),
        ``sparse_wait`` (its wait for the scores), ``sparse_select`` (its page choice), ``sparse_plan`` (hits,
        misses, promotions, read planning), ``tiles_queue`` (reads, tables and tiles up to the first streamed tile;
        an exact step's score launches too), ``tiles_rest`` (the other tiles; an exact step's score wait and
        promotions too), ``record`` (the step record). Nothing is synchronized."""
        return dict(self._prof)

    def diagnostic_summary(self) -> HighSpeedSwapDiagnostic:
        """The original's fields and hss's counters; waits for the stall timers of issued steps."""
        self._live()
        self._timer.collect(wait=True)
        store = self.store.kind
        if isinstance(self.store, FileStore):
            store += " (O_DIRECT)" if self.store.direct else " (buffered)"
        return HighSpeedSwapDiagnostic(
            num_layers=self.model.num_layers, active_disk_blocks=self.disk.active,
            disk_block_capacity=self.model.max_blocks_per_layer, scratch_pool_resident=self.pool.num_slots,
            scratch_pool_free=self.pool.free_count, resident_pages=self.pool.resident_count,
            resident_capacity=self.resident_capacity, stream_tile_blocks=self.tile_blocks, store=store,
            read_stall_ms=self._timer.ms, host_read_ms=1e3 * self._host_read, score_wait_ms=1e3 * self._score_wait,
            **self._n)

    @property
    def closed(self) -> bool:
        return not self._owned

    def close(self) -> None:
        """Wait for queued work, then free everything; later calls do nothing."""
        owned, self._owned = self._owned, []
        if not owned:
            return
        try:
            if getattr(self, "_stepped", False):
                self._ev_step_done.synchronize()
                self.copy_stream.synchronize()
        finally:
            self._count_rows = self._table_rows = self._scores_f32 = None    # views of the pinned memory freed below
            for obj in reversed(owned):
                obj.close()

    def __enter__(self) -> HighSpeedSwap:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        if self.closed:
            return "HighSpeedSwap(closed)"
        return (f"HighSpeedSwap({self.model}, {self.store.kind} store, {self.pool.num_slots} scratch slots = "
                f"{self.resident_capacity} resident + 2 x {self.tile_blocks} streamed)")
