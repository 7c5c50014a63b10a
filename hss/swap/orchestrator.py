"""Exact decode attention over a KV history kept in a backing store (docs/design.md §8): :class:`HighSpeedSwap`.

The scratch pool (``resident_blocks`` page slots in HBM) is split in two:

* a **resident set** of ``resident_blocks - 2*T`` slots, pages chosen by predictor score (the
  :class:`~hss.swap.eviction.EvictionPolicy`), attended in place with no transfer;
* a **streaming double buffer** of two tiles of T pages, through which every other page of the step
  passes: the reads of tile i+1 (a copy stream of our own) overlap attention on tile i (the caller's
  stream).

The swap owns the parts (store, pool, predictor, tiled attention, eviction policy, disk block ids), checks every
argument and offloads pages; a step (``attend_layer_on_stream``) is a plan (:mod:`hss.swap.plans`: the exact one, or
the sparse one of docs/design.md §17.6) run by its :class:`~hss.swap.step.SwapStep`, whose module doc gives the queue
order.

Besides a step's one wait for its scores, nothing synchronizes the host, except as documented: FileStore reads
(pread, and reusing a bounce page only after its copy ran), HostStore writes (wait for queued reads of the bytes
they replace), a step after one that failed before its score wait (waits for that step's table upload) and an exact
step after a sparse one (waits for that step's end), the first HostStore reads of a tile wider than any before
(waits for queued reads: its index ring grows), a HostStore's group of reads ``FENCES`` groups after one that no
score wait has covered since (waits for it: its index slot is reused; a step's score wait covers the reads of the
steps before it), and ``diagnostic_summary`` (waits for the stall timers of issued steps). One instance is used from
one thread.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np

from hss import _args
from hss import cuda_min as cm
from hss._util import Closeable
from hss.attention import TiledAttention, TiledAttentionDims
from hss.errors import HssError
from hss.predictor import Predictor, PredictorDims
from hss.swap._checks import StreamCheck, same_device
from hss.swap.backing import BackingStore
from hss.swap.config import DiskBlockAllocator, HighSpeedSwapConfig, HighSpeedSwapDiagnostic, ModelDims
from hss.swap.eviction import EvictionPolicy
from hss.swap.file_store import FileStore
from hss.swap.gather import SPARSE_GATHER_MIN_RUNS
from hss.swap.layout import GroupLayout
from hss.swap.plans import ExactPlan, SparsePlan
from hss.swap.pool import ScratchPool
from hss.swap.sparse import SparseBudget, sparse_budget
from hss.swap.step import StepRecord, SwapStep, TileRecord
from hss.swap.stores import HostStore

__all__ = ["HighSpeedSwap", "StepRecord", "TileRecord"]


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


_BUFFER_NAMES = {"_a_g": "A_g store", "_p": "projection P"}


class HighSpeedSwap(Closeable):
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
            self.eviction = EvictionPolicy(R)
            self._step = own(SwapStep(ctx, model, cfg.rank, T, self.store, self.pool, self.eviction, self.predictor,
                                      self.attn))
            self.copy_stream = self._step.copy_stream
            dev = self._streams.device
            parts = {"its store": self.store.device}
            for name, part in (("its scratch pool", self.pool), ("its predictor", self.predictor),
                               ("its tiled attention", self.attn)):
                parts.update((name, d) for d in _buffer_devices(part) if d != dev)
            parts.update(("its step buffers", buf.device) for buf in self._step.buffers().values()
                         if isinstance(buf, cm.DeviceBuffer) and buf.device != dev)
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
        self.disk = DiskBlockAllocator(model.max_blocks_per_layer)
        self._mine = self._owned_ranges()
        rowbytes = 2 * model.num_q_heads * model.head_dim      # q and out: bf16 [num_q_heads, head_dim]
        # another device's q, output or K page is refused
        self._q_arg = _args.pointer_arg("q_dev", rowbytes, 2, "bf16", False, "bf16 [num_q_heads, head_dim]",
                                        device=dev)
        self._out_arg = _args.pointer_arg("out_dev", rowbytes, 2, "bf16", True,
                                          "a bf16 [num_q_heads, head_dim] output", device=dev)
        self._page_bytes = 2 * model.block_size * model.num_kv_heads * model.head_dim
        self._k_arg = _args.pointer_arg("k_block_dev", self._page_bytes, 2, "bf16", False,
                                        "one bf16 [block_size, num_kv_heads, head_dim] KV page", device=dev)
        self._last_sparse: tuple[tuple[Any, Any, Any], SparseBudget | None] | None = None
        self._last_ids = (np.zeros(0, dtype=np.int64), -1, False)    # the last seq_block_ids checked (_seq_ids):
        #                                                                   (ids, largest, whether 0..n-1 in order)
        self._last_bytes = b""
        self.last_step: StepRecord | None = None

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
        self.store.owned_memory.check(ptr, nbytes, name, "this HighSpeedSwap's store")

    def _owned_ranges(self) -> _args.OwnedRanges:
        """Every device (and pinned, device-addressable) buffer the swap and its parts hold (the step buffers and their
        pinned copies, the scratch pool, the predictor's P and A_g, the tiled attention's running state), so that a
        caller's pointer into one of them is refused. (The store's own memory is the store's: ``store.owned_memory``.)
        The predictor and the tiled attention list no buffers of their own: their attributes are looked through."""
        labelled = [(f"the swap's {name}", buf) for name, buf in self._step.buffers().items()]
        labelled.append(("the scratch pool", self.pool.buffer))
        for obj, label in ((self.predictor, "the predictor's {}"), (self.attn, "the tiled attention's state ({})")):
            labelled += [(label.format(_BUFFER_NAMES.get(name, name.strip("_"))), buf)
                         for name, buf in vars(obj).items()]
        mine = _args.OwnedRanges()
        seen: set[int] = set()
        for label, buf in labelled:
            if isinstance(buf, (cm.DeviceBuffer, cm.PinnedBuffer)) and not buf.closed and buf.ptr not in seen:
                seen.add(buf.ptr)
                mine.add(buf.ptr, buf.bytes, label)
        return mine

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

    def _seq_ids(self, seq_block_ids: Any) -> tuple[np.ndarray, int, bool]:
        """``seq_block_ids`` checked, as our own int64 copy (the step record keeps it), its largest id (-1 when
        empty), and whether it is the pages 0..n-1 in order (n > 0)."""
        arr = np.asarray(seq_block_ids)
        last = self._last_ids
        if arr.shape == last[0].shape and arr.dtype == last[0].dtype and last[0].size and \
                arr.tobytes() == self._last_bytes:
            return last       # a decode loop passes the same pages step after step: our (read-only) copy
        if arr.dtype.kind not in "iu" and (arr.size or arr.dtype.kind not in "f"):   # [] is float64
            raise TypeError(f"seq_block_ids must hold ints, got {arr.dtype}")
        if arr.ndim != 1:
            raise HssError(f"seq_block_ids must be a 1-D sequence of block ids, got shape {arr.shape}")
        arr = arr.astype(np.int64)
        if not arr.size:
            return arr, -1, False
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
        return self._last_ids

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
                self.store.undo_write(saved)
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
        """Write the page into the store, all or nothing; returns what undoes it (``store.undo_write``)."""
        try:
            return self.store.write_planned(layer, block, image)
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
        """Exact attention of one decode query over the pages ``seq_block_ids`` of ``layer`` (:mod:`hss.swap.step`
        gives the queue order); returns (and keeps as :attr:`last_step`) the step's record.

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

        The sparse mode (docs/design.md §17.6; opt in with ``budget_pages``, an int >= 0): the step attends the first
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
        ids, top, in_order = self._seq_ids(seq_block_ids)
        lbvs = self._lbvs(last_block_valid_slots, q_pos)
        sparse = self._sparse_args(budget_pages, keep_first, keep_recent)
        rowbytes = 2 * self.model.num_q_heads * self.model.head_dim
        with _args.deferred_joins():
            q, out = self._q_arg(q_dev, s), self._out_arg(out_dev, s)
            self._refuse_owned(q, rowbytes, "q_dev")
            self._refuse_owned(out, rowbytes, "out_dev")
            if out < q + rowbytes and q < out + rowbytes:      # (the error is _args.disjoint's)
                _args.disjoint("attend_layer", ("out_dev", out, rowbytes, True), ("q_dev", q, rowbytes, False))
        step = self._step
        step.profile["checks"] += time.perf_counter() - t0
        if sparse is not None and not sparse.covers(ids.size):
            plan = SparsePlan(step, layer, ids, top, in_order, lbvs, sparse, self.sparse_gather_min_runs,
                              self.time_sparse_stalls)
        else:       # (a budget covering every page is the exact step)
            plan = ExactPlan(step, layer, ids, top, in_order, lbvs, sparse)
        rec = self.last_step = step.run(s, q, out, plan)
        return rec

    # -- diagnostics, lifetime -------------------------------------------------------------------
    def host_profile(self) -> dict[str, float]:
        """Host seconds spent so far in each part of ``attend_layer`` (totals; pure host clock, waits included):
        ``checks`` (arguments), ``sparse_queue`` (a sparse step's page checks, pool lookup and score launches),
        ``sparse_wait`` (its wait for the scores), ``sparse_select`` (its page choice), ``sparse_plan`` (hits,
        misses, promotions, read planning), ``tiles_queue`` (reads, tables and tiles up to the first streamed tile;
        an exact step's score launches too), ``tiles_rest`` (the other tiles; an exact step's score wait and
        promotions too), ``record`` (the step record). Nothing is synchronized."""
        return dict(self._step.profile)

    def diagnostic_summary(self) -> HighSpeedSwapDiagnostic:
        """The original's fields and hss's counters; waits for the stall timers of issued steps."""
        self._live()
        step = self._step
        stall_ms = step.stall_ms()
        store = self.store.kind
        if isinstance(self.store, FileStore):
            store += " (O_DIRECT)" if self.store.direct else " (buffered)"
        return HighSpeedSwapDiagnostic(
            num_layers=self.model.num_layers, active_disk_blocks=self.disk.active,
            disk_block_capacity=self.model.max_blocks_per_layer, scratch_pool_resident=self.pool.num_slots,
            scratch_pool_free=self.pool.free_count, resident_pages=self.pool.resident_count,
            resident_capacity=self.resident_capacity, stream_tile_blocks=self.tile_blocks, store=store,
            read_stall_ms=stall_ms, host_read_ms=1e3 * step.host_read, score_wait_ms=1e3 * step.score_wait,
            **step.counts)

    @property
    def closed(self) -> bool:
        return not self._owned

    def close(self) -> None:
        """Wait for queued work, then free everything; later calls do nothing."""
        owned, self._owned = self._owned, []
        if not owned:
            return
        try:
            step = getattr(self, "_step", None)
            if step is not None:
                step.wait()
        finally:
            for obj in reversed(owned):
                obj.close()

    def __repr__(self) -> str:
        if self.closed:
            return "HighSpeedSwap(closed)"
        return (f"HighSpeedSwap({self.model}, {self.store.kind} store, {self.pool.num_slots} scratch slots = "
                f"{self.resident_capacity} resident + 2 x {self.tile_blocks} streamed)")
