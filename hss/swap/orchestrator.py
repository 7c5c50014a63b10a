"""Exact decode attention over a KV history kept in a backing store (SPEC §8): :class:`HighSpeedSwap`.

The scratch pool (``resident_blocks`` page slots in HBM) is split in two:

* a **resident set** of ``resident_blocks - 2*T`` slots, pages chosen by predictor score (the
  :class:`~hss.swap.eviction.EvictionPolicy`), attended in place with no transfer;
* a **streaming double buffer** of two tiles of T pages, through which every other page of the step
  passes: the reads of tile i+1 (a copy stream of our own) overlap attention on tile i (the caller's
  stream).

A step (``attend_layer_on_stream``), in queue order on the caller's stream ``s`` and the copy stream ``c``:

1. ``s`` waits for the previous step (``step_done``) and records ``go``; ``c`` waits for it (write-after-read:
   the stream buffers may still be read by the previous step). The tiles follow from hits and misses alone
   (hits = pages resident for this layer; misses stream in tiles of T, sequence order), so the reads of the
   first two streamed tiles are queued on ``c`` at once. Then q_proj = project_q(q), scores of the layer's
   pages, D2H into pinned memory, and the **host waits for the scores** (the step's one planned host sync;
   the original synchronized here too) while those reads run.
2. Host plan: misses are
   promoted into the resident set best score first: into free slots, then replacing the first-ranked
   resident (lowest score, then least recently touched) while that one ranks before the new page. A promoted
   page is copied (device to device, on ``s``) from its stream slot into its resident slot right after its
   tile is attended, so hits attended earlier in the step are never overwritten early.
3. Block tables go up in one copy; ``begin_step``; the resident tile is attended first.
4. Tile i's pages are read on ``c`` into buffer i % 2, which first waits for ``done[i % 2]`` (attention on
   tile i-2 finished), then records ``loaded[i % 2]``. ``s`` waits ``loaded[i % 2]``, attends tile i, does
   its promotions, records ``done[i % 2]``. Reads run two tiles ahead of attention.
5. ``finalize`` into ``out``; ``s`` records ``step_done``.

Every tile is recorded (:class:`StepRecord`): the ordered slots, the block ids they hold and the
last_block_valid_slots each tile was applied with. Replaying the same block ids in the same tiles with
in-HBM :class:`~hss.attention.TiledAttention` gives the same bits (a tile's result depends only on its token list).
The last page of ``seq_block_ids`` is always the last entry of its tile, which alone gets the caller's
last_block_valid_slots.

Nothing else synchronizes the host, except as documented: FileStore reads (pread, and reusing a bounce page
only after its copy ran), HostStore writes (wait for queued reads of the bytes they replace), and
``diagnostic_summary`` (waits for the stall timers of issued steps). One instance is used from one thread.
"""
from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from hss import cuda_min as cm
from hss._driver import HssError
from hss.attention import TiledAttention, TiledAttentionDims
from hss.attention import _pointer as _device_arg
from hss.predictor import Predictor, PredictorDims
from hss.swap.config import DiskBlockAllocator, HighSpeedSwapConfig, HighSpeedSwapDiagnostic, ModelDims
from hss.swap.eviction import EvictionPolicy
from hss._params import as_int
from hss.swap.layout import GroupLayout
from hss.swap.pool import ScratchPool
from hss.swap.stores import BackingStore, FileStore, HostStore, StoreError

__all__ = ["HighSpeedSwap", "StepRecord", "TileRecord"]


class TileRecord(NamedTuple):
    """One ``step_tile`` launch of a step: scratch ``slots`` in the order attended, the disk ``block_ids``
    they held, the ``last_block_valid_slots`` passed, and whether it was ``streamed`` (else resident)."""
    slots: tuple[int, ...]
    block_ids: tuple[int, ...]
    last_block_valid_slots: int
    streamed: bool


@dataclass(frozen=True)
class StepRecord:
    """What one ``attend_layer`` did: its tiles in launch order, the predictor score of each block, the hits
    and misses, and the promotions ((block id, resident slot)) and evictions (((layer, page), slot)) in decision
    order: the best-scoring miss first, the first-ranked (lowest score, least recent) victim first."""
    layer: int
    tiles: tuple[TileRecord, ...]
    hits: tuple[int, ...]
    misses: tuple[int, ...]
    promoted: tuple[tuple[int, int], ...]
    evicted: tuple[tuple[tuple[int, int], int], ...]
    block_ids: np.ndarray = field(repr=False)        # the step's seq_block_ids
    block_scores: np.ndarray = field(repr=False)     # f32 predictor score of each

    @functools.cached_property
    def scores(self) -> dict[int, float]:
        """{block id: predictor score} of the step's blocks."""
        return dict(zip(self.block_ids.tolist(), self.block_scores.tolist()))


class _StallTimer:
    """Pairs of timing events around the attention stream's waits for reads; summed once complete."""

    def __init__(self, ctx: Any) -> None:
        self._ctx, self._spare, self._pending, self._open = ctx, [], [], None
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

    def collect(self, wait: bool) -> None:
        keep = []
        for a, b in self._pending:
            if wait:
                b.synchronize()
            elif not b.query():
                keep.append((a, b))
                continue
            self.ms += a.elapsed_ms(b)
            self._spare += [a, b]
        self._pending = keep

    def close(self) -> None:
        for ev in self._spare + [e for pair in self._pending for e in pair]:
            ev.close()
        self._spare, self._pending = [], []


class HighSpeedSwap:
    """Streams a layer's KV pages from a backing store through HBM scratch for exact decode attention.

    ``HighSpeedSwap(ctx, cfg, model)`` sets up on ``ctx.stream``; :meth:`new_on_stream` on a caller's stream in
    the current context. Construction validates ``cfg`` and ``model``, creates ``cfg.dir``, opens the store,
    allocates the scratch pool, the predictor (which synchronizes the stream, as the original did), the
    tiled attention state and the step buffers. ``close()`` (or leaving a ``with`` block) waits for queued
    work and frees everything once. Single sequence per step, like the mainline original.
    """

    def __init__(self, ctx: cm.CudaCtx, cfg: HighSpeedSwapConfig, model: ModelDims) -> None:
        if not isinstance(ctx, cm.CudaCtx):
            raise TypeError(f"ctx must be a CudaCtx, got {type(ctx).__name__}; new_on_stream takes a stream")
        self._build(ctx, ctx.stream, cfg, model)

    @classmethod
    def new_on_stream(cls, stream: Any, cfg: HighSpeedSwapConfig, model: ModelDims) -> "HighSpeedSwap":
        """The original's constructor: set up on ``stream`` in the thread's current context."""
        self = cls.__new__(cls)
        self._build(None, cm.stream_handle(stream), cfg, model)
        return self

    def _build(self, ctx: cm.CudaCtx | None, stream: int, cfg: HighSpeedSwapConfig, model: ModelDims) -> None:
        self._owned: list[Any] = []
        if not isinstance(cfg, HighSpeedSwapConfig):
            raise TypeError(f"cfg must be a HighSpeedSwapConfig, not {type(cfg).__name__}")
        if not isinstance(model, ModelDims):
            raise TypeError(f"model must be a ModelDims, not {type(model).__name__}")
        model.validate()
        cfg.validate()
        self.config, self.model = cfg, model
        self.layout = GroupLayout(model.max_blocks_per_layer, model.num_kv_heads, model.block_size, model.head_dim)
        need = model.num_layers * self.layout.bytes_per_layer
        if need > cfg.bytes:
            raise HssError(f"the backing store needs {need} bytes ({model.num_layers} layers x "
                           f"{model.max_blocks_per_layer} pages x {self.layout.block_bytes} bytes) but "
                           f"HighSpeedSwapConfig.bytes is {cfg.bytes}: raise bytes, or lower max_blocks_per_layer "
                           "or num_layers")
        cfg.validate_and_prepare()
        self.tile_blocks, self.resident_capacity = cfg.tile_blocks, cfg.resident_capacity
        T, R = self.tile_blocks, self.resident_capacity
        if ctx is not None:
            ctx.make_current()
        try:
            own = self._own
            if cfg.store == "file":
                self.store: BackingStore = own(FileStore(cfg.dir, self.layout, model.num_layers, direct=cfg.direct,
                                                         qd=cfg.qd, bounce_pages=3 * T, ctx=ctx))
            else:
                self.store = own(HostStore(self.layout, model.num_layers, ctx=ctx))
            self.pool = own(ScratchPool(self.layout, cfg.resident_blocks, num_layers=model.num_layers,
                                        reserved_slots=2 * T, ctx=ctx))
            pdims = PredictorDims(model.num_layers, model.num_q_heads, model.num_kv_heads, model.head_dim,
                                  cfg.rank, model.block_size, model.max_blocks_per_layer)
            self.predictor = own(Predictor.new_on_stream(stream, pdims, cfg.projection_seed))
            cap = max(R, T)
            self.attn = own(TiledAttention(ctx, TiledAttentionDims(1, model.num_q_heads, model.num_kv_heads,
                                                                   model.head_dim, model.block_size, cap)))
            self._max_tiles = 1 + -(-model.max_blocks_per_layer // T)
            nb = model.max_blocks_per_layer
            self._q_proj = own(cm.DeviceBuffer(2 * model.num_q_heads * cfg.rank, ctx))
            self._scores_dev = own(cm.DeviceBuffer(4 * nb, ctx))
            self._scores_host = own(cm.PinnedBuffer(4 * nb, ctx))
            self._tables_dev = own(cm.DeviceBuffer(4 * self._max_tiles * cap, ctx))
            self._tables_host = own(cm.PinnedBuffer(4 * self._max_tiles * cap, ctx))
            self._counts_dev = own(cm.DeviceBuffer(4 * self._max_tiles, ctx))
            self._counts_host = own(cm.PinnedBuffer(4 * self._max_tiles, ctx))
            self.copy_stream = own(cm.CudaStream(ctx))
            ev = lambda: own(cm.CudaEvent(ctx=ctx))   # noqa: E731
            self._ev_scores, self._ev_go, self._ev_step_done = ev(), ev(), ev()
            self._ev_loaded, self._ev_done = (ev(), ev()), (ev(), ev())
            self._timer = own(_StallTimer(ctx))
        except BaseException:
            self.close()
            raise
        self.eviction = EvictionPolicy(R)
        self.disk = DiskBlockAllocator(model.max_blocks_per_layer)
        self._operands = self.pool.attention_operands(self.attn)
        self._stepped = False
        self.last_step: StepRecord | None = None
        self._n = dict(steps=0, tiles=0, hits=0, misses=0, promotions=0, evictions=0, bytes_read=0)
        self._host_read = self._score_wait = 0.0

    def _own(self, obj: Any) -> Any:
        self._owned.append(obj)
        return obj

    # -- argument checks -------------------------------------------------------------------------
    def _live(self) -> None:
        if not self._owned:
            raise HssError("this HighSpeedSwap is closed")

    def _layer(self, layer: Any) -> int:
        v = as_int("layer", layer)
        if not 0 <= v < self.model.num_layers:
            raise HssError(f"layer {v} is out of range: the model has {self.model.num_layers} layers")
        return v

    def _block(self, block: Any) -> int:
        v = as_int("block", block)
        if not 0 <= v < self.model.max_blocks_per_layer:
            raise HssError(f"block {v} is out of range 0..{self.model.max_blocks_per_layer - 1} "
                           "(ModelDims.max_blocks_per_layer)")
        return v

    def _seq_ids(self, seq_block_ids: Any) -> np.ndarray:
        arr = np.asarray(seq_block_ids)
        if arr.ndim != 1:
            raise HssError(f"seq_block_ids must be a 1-D sequence of block ids, got shape {arr.shape}")
        if arr.size and arr.dtype.kind not in "iu":
            raise TypeError(f"seq_block_ids must hold ints, got {arr.dtype}")
        arr = arr.astype(np.int64)
        nb = self.model.max_blocks_per_layer
        bad = arr[(arr < 0) | (arr >= nb)]
        if bad.size:
            raise HssError(f"seq_block_ids holds {bad[:8].tolist()}, out of range 0..{nb - 1}")
        uniq, counts = np.unique(arr, return_counts=True)
        if (counts > 1).any():
            raise HssError(f"seq_block_ids repeats block ids {uniq[counts > 1][:8].tolist()}: each page may appear "
                           "once per attend_layer call")
        return arr

    def _lbvs(self, lbvs: Any, q_pos: Any) -> int:
        bs = self.model.block_size
        if q_pos is not None:
            qp = as_int("q_pos", q_pos)
            if qp < 0:
                raise HssError(f"q_pos must be >= 0 (got {qp})")
            from_pos = qp % bs + 1
            if lbvs is not None and as_int("last_block_valid_slots", lbvs) != from_pos:
                raise HssError(f"last_block_valid_slots ({lbvs}) disagrees with q_pos {qp} (which gives "
                               f"q_pos % block_size + 1 = {from_pos}); pass one of them")
            return from_pos
        if lbvs is None:
            return bs
        v = as_int("last_block_valid_slots", lbvs)
        if not -2**31 <= v < 2**31:
            raise HssError(f"last_block_valid_slots ({v}) must fit in int32")
        return v

    # -- offload ---------------------------------------------------------------------------------
    def offload_block(self, ctx: cm.CudaCtx, layer: int, block: int, k_block_dev: Any, k_host: Any,
                      v_host: Any) -> None:
        """:meth:`offload_block_on_stream` on ``ctx.stream``."""
        self.offload_block_on_stream(ctx.stream, layer, block, k_block_dev, k_host, v_host)

    def offload_block_on_stream(self, stream: Any, layer: int, block: int, k_block_dev: Any, k_host: Any,
                                v_host: Any) -> None:
        """Store page ``block`` of ``layer`` and queue its predictor projection on ``stream``.

        k_block_dev: device bf16 ``[block_size, num_kv_heads, head_dim]`` (the NHD page in the KV cache);
        k_host, v_host: the same page's K and V on the host, bf16 ``[block_size, num_kv_heads, head_dim]``.
        Sizes are checked before anything happens. The store write is synchronous; a resident copy of the
        page is dropped from the scratch pool.
        """
        self._live()
        layer, block = self._layer(layer), self._block(block)
        image = self.layout.pack_page(k_host, v_host)
        self.predictor.project_kv_block_on_stream(cm.stream_handle(stream), layer, block, k_block_dev)
        self._store(layer, block, image)

    def offload_block_no_predict_on_stream(self, stream: Any, layer: int, block: int, k_host: Any,
                                           v_host: Any) -> None:
        """:meth:`offload_block_on_stream` without the projection (quantized caches): the block's A_g slot
        keeps what it had (zeros if never written), so its score is stale; eviction still works."""
        self._live()
        cm.stream_handle(stream)
        layer, block = self._layer(layer), self._block(block)
        self._store(layer, block, self.layout.pack_page(k_host, v_host))

    def _store(self, layer: int, block: int, image: np.ndarray) -> None:
        try:
            self.store.write_page(layer, block, image)
        finally:
            self.pool.invalidate((layer, block))

    # -- disk block ids --------------------------------------------------------------------------
    def alloc_disk_block(self) -> int | None:
        """A free disk block id (refcount 1), or None when all ``max_blocks_per_layer`` are in use."""
        return self.disk.alloc()

    def inc_ref(self, block: int) -> None:
        self.disk.inc_ref(block)

    def dec_ref(self, block: int) -> bool:
        """Drop a reference; at 0 the id is freed and its pages (every layer) are forgotten by the store and
        the scratch pool, so a recycled id never serves stale data. Returns True when freed."""
        freed = self.disk.dec_ref(block)
        if freed:
            self.store.invalidate_block(block)
            self.pool.invalidate_page(block)
        return freed

    def disk_free_count(self) -> int:
        return self.disk.free_count

    # -- attention -------------------------------------------------------------------------------
    def attend_layer(self, ctx: cm.CudaCtx, layer: int, seq_block_ids: Any, q_dev: Any, out_dev: Any,
                     last_block_valid_slots: int | None = None, *, q_pos: int | None = None) -> StepRecord:
        """:meth:`attend_layer_on_stream` on ``ctx.stream``."""
        return self.attend_layer_on_stream(ctx.stream, layer, seq_block_ids, q_dev, out_dev,
                                           last_block_valid_slots, q_pos=q_pos)

    def attend_layer_on_stream_with_q_pos(self, stream: Any, layer: int, seq_block_ids: Any, q_dev: Any,
                                          out_dev: Any, last_block_valid_slots: int) -> StepRecord:
        """The original's name: :meth:`attend_layer_on_stream` with ``last_block_valid_slots``."""
        return self.attend_layer_on_stream(stream, layer, seq_block_ids, q_dev, out_dev, last_block_valid_slots)

    def attend_layer_on_stream(self, stream: Any, layer: int, seq_block_ids: Any, q_dev: Any, out_dev: Any,
                               last_block_valid_slots: int | None = None, *,
                               q_pos: int | None = None) -> StepRecord:
        """Exact attention of one decode query over the pages ``seq_block_ids`` of ``layer`` (see the module
        docstring for the queue order); returns (and keeps as :attr:`last_step`) the step's record.

        q_dev: device bf16 ``[num_q_heads, head_dim]``; out_dev: device bf16 ``[num_q_heads, head_dim]``.
        seq_block_ids: distinct disk block ids in token order; each must have been offloaded for ``layer``.
        The last page contributes ``last_block_valid_slots`` tokens (default block_size; or give ``q_pos``:
        ``q_pos % block_size + 1``). Everything is checked before any work is queued. Waits on the host for
        the predictor scores; otherwise asynchronous on ``stream``.
        """
        self._live()
        s = cm.stream_handle(stream)
        layer = self._layer(layer)
        ids = self._seq_ids(seq_block_ids)
        lbvs = self._lbvs(last_block_valid_slots, q_pos)
        d = self.model
        rowbytes = 2 * d.num_q_heads * d.head_dim
        q = _device_arg(q_dev, "q_dev", 2, rowbytes, "bf16 [num_q_heads, head_dim]")
        out = _device_arg(out_dev, "out_dev", 2, rowbytes, "a bf16 [num_q_heads, head_dim] output")
        slots = self.pool.lookup_many(layer, ids)
        hit = slots >= 0
        hit_pos, miss_pos = np.flatnonzero(hit), np.flatnonzero(~hit)
        missing = self.store.missing_pages(layer, ids[miss_pos])
        if missing.size:
            raise StoreError(f"layer {layer} blocks {missing[:8].tolist()} were never offloaded (or their last "
                             "write failed): offload_block them before attending")
        if self._stepped:
            cm.stream_wait_event(s, self._ev_step_done)
        tiles = self._tiles(ids, slots, hit_pos, miss_pos, lbvs)     # the schedule needs hits and misses only
        promoted: list[tuple[int, int, int]] = []                 # (decision rank, block id, slot)
        evicted: list[tuple[int, tuple[int, int], int]] = []      # (decision rank, (layer, page), slot)
        self._ev_go.record(s)
        cm.stream_wait_event(self.copy_stream, self._ev_go)
        ta, cap, bb = self.attn, self.attn.dims.tile_capacity, self.layout.block_bytes
        kp, vp, blk, tok, kvh = self._operands
        tables, counts = self._tables_dev.ptr, self._counts_dev.ptr

        def attend(row: int, tile: TileRecord) -> None:
            if row == 0:   # checks q, the pool and the strides once per step
                ta.step_tile_on_stream(s, q, kp, vp, tables, counts, 1, blk, tok, kvh, tile.last_block_valid_slots)
            else:
                ta._next_tile(s, tables + 4 * row * cap, counts + 4 * row, tile.last_block_valid_slots)

        streamed = [t for t in tiles if t.streamed]
        first = len(tiles) - len(streamed)
        chunks = [miss_pos[i:i + self.tile_blocks] for i in range(0, miss_pos.size, self.tile_blocks)]

        def read(i: int) -> None:
            c = self.copy_stream
            if i >= 2:
                cm.stream_wait_event(c, self._ev_done[i % 2])
            t0 = time.perf_counter()
            dsts = self.pool.ptr + bb * np.asarray(streamed[i].slots, dtype=np.int64)
            self._n["bytes_read"] += self.store.read_pages(c, layer, ids[chunks[i]], dsts)
            self._host_read += time.perf_counter() - t0
            self._ev_loaded[i % 2].record(c)

        try:
            for i in range(min(2, len(streamed))):   # the first reads run while the host waits for the scores
                read(i)
            scores = self._scores(s, layer, q, ids)
            self._timer.collect(wait=False)
            if hit_pos.size:
                self.eviction.record_scores(slots[hit_pos], scores[hit_pos])
                self.eviction.touch_many(slots[hit_pos])
            plan = self._plan_promotions(scores, miss_pos)
            self._upload_tables(s, tiles)
            ta.begin_step_on_stream(s, 1)
            if first:
                attend(0, tiles[0])
            for i, tile in enumerate(streamed):
                self._timer.begin(s)
                cm.stream_wait_event(s, self._ev_loaded[i % 2])
                self._timer.end(s)
                attend(first + i, tile)
                for j, pos in enumerate(chunks[i].tolist()):
                    if pos in plan:
                        slot, rank = plan[pos]
                        cm.copy_d_to_d_async(self.pool.slot_ptr(slot), self.pool.slot_ptr(tile.slots[j]), bb, s)
                        old = self.pool.put((layer, int(ids[pos])), slot)
                        self.eviction.record_score(slot, scores[pos])
                        self.eviction.touch(slot)
                        promoted.append((rank, int(ids[pos]), slot))
                        if old is not None:
                            evicted.append((rank, old, slot))
                self._ev_done[i % 2].record(s)
                if i + 2 < len(streamed):
                    read(i + 2)
            ta.finalize_on_stream(s, out, 1)
        finally:
            self._ev_step_done.record(s)
            self._stepped = True
            n = self._n
            n["promotions"] += len(promoted)
            n["evictions"] += len(evicted)
        n["steps"] += 1
        n["tiles"] += len(tiles)
        n["hits"] += int(hit_pos.size)
        n["misses"] += int(miss_pos.size)
        ids.setflags(write=False)
        scores.setflags(write=False)
        self.last_step = StepRecord(layer, tuple(tiles), tuple(ids[hit_pos].tolist()), tuple(ids[miss_pos].tolist()),
                                    tuple(p[1:] for p in sorted(promoted)), tuple(e[1:] for e in sorted(evicted)),
                                    ids, scores)
        return self.last_step

    def _scores(self, s: int, layer: int, q: int, ids: np.ndarray) -> np.ndarray:
        """Predictor scores of ``ids`` (host float32); waits on the host for them."""
        if ids.size == 0:
            return np.zeros(0, dtype=np.float32)
        n = int(ids.max()) + 1
        t0 = time.perf_counter()
        self.predictor.project_q_on_stream(s, q, self._q_proj)
        self.predictor.score_layer_on_stream(s, self._q_proj, layer, 0, n, self._scores_dev)
        cm.copy_d_to_h_async(self._scores_host, self._scores_dev, 4 * n, s)
        self._ev_scores.record(s)
        self._ev_scores.synchronize()
        self._score_wait += time.perf_counter() - t0
        return self._scores_host.view(np.float32)[ids]

    def _plan_promotions(self, scores: np.ndarray, miss_pos: np.ndarray) -> dict[int, tuple[int, int]]:
        """{position in seq: (resident slot, decision rank)} of the misses to promote (see the module doc)."""
        if self.resident_capacity == 0 or miss_pos.size == 0:
            return {}
        order = miss_pos[np.argsort(-scores[miss_pos], kind="stable")]     # best first, NaN last
        free = self.pool.free_slots()[:order.size]
        plan = {int(p): (int(slot), i) for i, (p, slot) in enumerate(zip(order, free))}
        rest = order[len(free):]
        if rest.size:
            victims = self.eviction.rank(free)
            victims = victims[[self.pool.key_of(int(v)) is not None for v in victims]]
            k = min(rest.size, victims.size)
            if k:
                old, new = self.eviction.last_score[victims[:k]], scores[rest[:k]]
                ok = np.isnan(old) | np.isnan(new) | (old <= new)      # EvictionPolicy.yields_to, vectorized
                k = k if ok.all() else int(np.argmin(ok))
                plan.update({int(p): (int(v), len(free) + i) for i, (p, v) in enumerate(zip(rest[:k], victims[:k]))})
        return plan

    def _tiles(self, ids: np.ndarray, slots: np.ndarray, hit_pos: np.ndarray, miss_pos: np.ndarray,
               lbvs: int) -> list[TileRecord]:
        bs, T, R = self.model.block_size, self.tile_blocks, self.resident_capacity
        last_is_hit = bool(ids.size) and slots[-1] >= 0
        tiles = []
        if hit_pos.size:
            tiles.append(TileRecord(tuple(slots[hit_pos].tolist()), tuple(ids[hit_pos].tolist()),
                                    lbvs if last_is_hit else bs, False))
        nchunks = -(-miss_pos.size // T)
        for i in range(nchunks):
            part = miss_pos[i * T:(i + 1) * T]
            base = R + (i % 2) * T
            last = i == nchunks - 1 and not last_is_hit
            tiles.append(TileRecord(tuple(range(base, base + part.size)), tuple(ids[part].tolist()),
                                    lbvs if last else bs, True))
        return tiles

    def _upload_tables(self, s: int, tiles: list[TileRecord]) -> None:
        if not tiles:
            return
        cap, nt = self.attn.dims.tile_capacity, len(tiles)
        table = self._tables_host.view(np.int32)[:nt * cap].reshape(nt, cap)
        table.fill(0)
        count = self._counts_host.view(np.int32)[:nt]
        for r, tile in enumerate(tiles):
            table[r, :len(tile.slots)] = tile.slots
            count[r] = len(tile.slots)
        cm.copy_h_to_d_async(self._tables_dev, self._tables_host, 4 * nt * cap, s)
        cm.copy_h_to_d_async(self._counts_dev, self._counts_host, 4 * nt, s)

    # -- diagnostics, lifetime -------------------------------------------------------------------
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
            for obj in reversed(owned):
                obj.close()

    def __enter__(self) -> "HighSpeedSwap":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        if self.closed:
            return "HighSpeedSwap(closed)"
        return (f"HighSpeedSwap({self.model}, {self.store.kind} store, {self.pool.num_slots} scratch slots = "
                f"{self.resident_capacity} resident + 2 x {self.tile_blocks} streamed)")
