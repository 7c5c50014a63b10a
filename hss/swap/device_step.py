"""The sparse swap step on the device (docs/design.md §17.8): :class:`DeviceSparseStep`.

For R sequences of one :class:`~hss.swap.HighSpeedSwap` (its ``HostStore`` holding every layer's pages in pinned host
memory), a decode step of one layer is five launches on the caller's stream and no host work beyond queueing them:

1. ``q_lowrank_project_rows``: each query row's low-rank projection (the swap's predictor P, the same bits as
   ``project_q``);
2. ``predictor_score_table``: each sequence's complete pages scored through its block table (the same bits as
   ``score_layer``; a block id outside A_g scores NaN, ranked lowest);
3. ``sparse_select``: one CTA per sequence picks S (the first ``keep_first`` and last ``keep_recent`` pages plus the
   ``budget_pages`` best others, docs/design.md §17.1's order), finds its hits among the sequence's ``slots`` HBM slots
   of the layer, gives each miss a slot (free slots first, then the least recently selected), lists the misses' reads
   and S's slots in page order, and counts hits and misses; with the predictor's ``head_temperature`` the scores of 2.
   are per head (``predictor_score_heads_table``) and this launch folds in each head's max and the normalised sum
   (docs/design.md §17.5, the predictor's arithmetic and bits) first;
4. ``sparse_fetch``: the misses read straight from the store's mapped pinned memory into their slots (16-byte loads,
   many in flight);
5. the tiled attention over exactly S's slots (one tile; ``output=`` ends the step, or the caller adds the newest,
   still-open page as another tile of :attr:`DeviceSparseStep.attention`).

Every count (the real row count, each sequence's page count, hits, misses) stays on the device, so a step captures
into a CUDA graph (hss's or ``torch.cuda.graph``) and replays with no host in the loop; rows past the real count
(a batch padded to a captured size) do nothing and attend nothing. A sequence with at most ``keep_first +
keep_recent + budget_pages`` complete pages selects every page: after the step that reads them all, its steps are
all hits (no scores matter, nothing is read). A row's residency starts free (:meth:`DeviceSparseStep.reset`, also
for a new sequence in a row); the state is per (layer, row) and its step number per row (:meth:`begin_step`).

Pages are identified by their position in the sequence: a page offloaded again with new content must be dropped
from the residency (:meth:`reset` of its row) before a step reads it.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from hss import _args
from hss import cuda_min as cm
from hss._util import Closeable, ceil_div
from hss.attention import TiledAttention, TiledAttentionDims
from hss.cuda._launch import launcher
from hss.cuda.ptx import load_module
from hss.decls import sparse_step as ks
from hss.decls.predictor import (
    PREDICTOR_SCORE_HEADS_TABLE,
    PREDICTOR_SCORE_TABLE,
    Q_LOWRANK_PROJECT_ROWS,
    q_rows_geometry,
    score_warps,
)
from hss.errors import HssError
from hss.swap._checks import StreamCheck, same_device

__all__ = ["DeviceSparseStep", "DeviceStepCounters"]

_I32_MAX = 2**31 - 1
_SHARED_DEFAULT = 48 * 1024


@dataclass(frozen=True)
class DeviceStepCounters:
    """What the device steps did since the rows' last :meth:`DeviceSparseStep.reset`: ``hits``, ``misses`` (pages of
    S that were resident / read), ``bytes_read`` (misses times the page size), each int64 ``[rows, num_layers]``."""
    hits: np.ndarray
    misses: np.ndarray
    bytes_read: np.ndarray


class DeviceSparseStep(Closeable):
    """The device sparse step of up to ``max_seqs`` sequences over ``swap``'s pages (see the module docstring).

    ``budget_pages``, ``keep_first``, ``keep_recent``: the selection (docs/design.md §17.8; ``sel_cap`` = their sum
    pages are attended at most); ``slots``: HBM slots per (sequence, layer), at least ``sel_cap`` (default ``sel_cap``);
    ``max_pages``: the longest sequence in complete pages (default the swap's ``max_blocks_per_layer``); ``ctx``: the
    swap's context (None: the thread's current one); ``stream``: where the initial reset is queued. Allocates the
    slot pool (``num_layers * max_seqs * slots`` pages), the residency state and a :class:`TiledAttention` for
    ``max_seqs`` sequences; ``close()`` frees them (idempotent; a context manager). ``swap`` must stay open while
    this is used.
    """

    def __init__(self, swap: Any, stream: Any, *, max_seqs: int, budget_pages: int, keep_first: int = 1,
                 keep_recent: int = 4, slots: int | None = None, max_pages: int | None = None,
                 ctx: cm.CudaCtx | None = None) -> None:
        from hss.swap.orchestrator import HighSpeedSwap
        from hss.swap.stores import HostStore
        if not isinstance(swap, HighSpeedSwap):
            raise TypeError(f"swap must be a HighSpeedSwap, not {type(swap).__name__}")
        if not isinstance(swap.store, HostStore):
            raise HssError("DeviceSparseStep reads the pages straight from pinned host memory: the swap needs "
                           "store='host' (HighSpeedSwapConfig.store)")
        pred = swap.predictor
        m = swap.model
        self.max_seqs = _args.as_int("max_seqs", max_seqs, 1, 65535, why="sequences per step (grid.y of the scores)")
        self.budget = _args.as_count("budget_pages", budget_pages)
        self.keep_first = _args.as_count("keep_first", keep_first)
        self.keep_recent = _args.as_count("keep_recent", keep_recent)
        self.sel_cap = self.budget + self.keep_first + self.keep_recent
        if self.sel_cap < 1:
            raise HssError("budget_pages + keep_first + keep_recent must be >= 1: a step attends at least one page")
        self.slots = self.sel_cap if slots is None else _args.as_int(
            "slots", slots, self.sel_cap, ks.MAX_SLOTS - 1, why="HBM slots per (sequence, layer): at least "
            "budget_pages + keep_first + keep_recent, the pages one step attends")
        self.max_pages = m.max_blocks_per_layer if max_pages is None else _args.as_int(
            "max_pages", max_pages, 1, m.max_blocks_per_layer, why="complete pages per sequence (the block tables' "
            "row length), at most the swap's max_blocks_per_layer")
        self.swap, self.layout = swap, swap.layout
        L, R, C = m.num_layers, self.max_seqs, self.slots
        self.num_layers = L
        page = self.layout.block_bytes
        if L * R * C >= _I32_MAX:
            raise HssError(f"num_layers * max_seqs * slots ({L} * {R} * {C}) must be < 2^31 (slot indices are int32)")
        geo = ks.select_geometry(R, self.max_pages, C, self.sel_cap)
        if pred.head_temperature is not None and m.num_q_heads > ks.MAX_HEADS:
            raise HssError(f"the per-head normalised scores (head_temperature) of the device step take at most "
                           f"{ks.MAX_HEADS} q heads, not {m.num_q_heads}: use head_temperature=None")
        if geo.shared > 227 * 1024 - ks.SELECT_STATIC_SHARED:
            raise HssError(f"max_pages ({self.max_pages}) and slots ({C}) need {geo.shared} bytes of shared memory "
                           f"for the selection; at most {227 * 1024 - ks.SELECT_STATIC_SHARED} fit: lower max_pages or "
                           "slots")
        if ctx is not None and not isinstance(ctx, cm.CudaCtx):
            raise TypeError(f"ctx must be a CudaCtx or None (the current context), not {type(ctx).__name__}")
        self._streams = StreamCheck(ctx, "this DeviceSparseStep")    # ctx None: the current context
        same_device("DeviceSparseStep", self._streams.device, **{"its HighSpeedSwap": swap.device})
        s0 = self._streams(stream)
        self.ctx = ctx
        self._parts = contextlib.ExitStack()
        own = self._parts.enter_context
        self._closed = True
        try:
            alloc = lambda n: own(cm.DeviceBuffer(max(n, 16), ctx))   # noqa: E731
            self.pool = alloc(L * R * C * page)
            self.page_slot = alloc(4 * L * R * self.max_pages)
            self.slot_page = alloc(4 * L * R * C)
            self.slot_stamp = alloc(4 * L * R * C)
            self.stats = alloc(16 * L * R)
            self.step_no = alloc(4 * R)
            self.rows_dev = alloc(16)
            self.q_proj = alloc(2 * R * m.num_q_heads * pred.dims.r)
            self.scores = alloc(4 * R * self.max_pages)
            self.attend = alloc(4 * R * self.sel_cap)
            self.attend_counts = alloc(4 * R)
            self.fetch = alloc(8 * R * self.sel_cap)
            self.fetch_counts = alloc(4 * R)
            # per-head normalised scores (docs/design.md §17.5) when not None
            self._temperature = pred.head_temperature
            heads = m.num_q_heads if self._temperature is not None else 0
            self.head_scores = alloc(4 * R * self.max_pages * heads)
            self.page_counts = alloc(4 * R)     # begin_step(token_counts=): complete pages, then the newest page's
            self.tail_counts = alloc(4 * R)     # tokens (sparse_counts)
            self.attention = own(TiledAttention(ctx, TiledAttentionDims(R, m.num_q_heads, m.num_kv_heads,
                                                                        m.head_dim, m.block_size, self.sel_cap)))
            self._prepare(pred, geo)
        except BaseException:
            self._parts.close()
            raise
        self._closed = False
        self._mine = _args.OwnedRanges()
        for name in ("pool", "page_slot", "slot_page", "slot_stamp", "stats", "step_no", "rows_dev", "q_proj",
                     "scores", "attend", "attend_counts", "fetch", "fetch_counts", "page_counts", "tail_counts",
                     "head_scores"):
            buf = getattr(self, name)
            self._mine.add(buf.ptr, buf.bytes, f"the DeviceSparseStep's {name}")
        self._tables = self._counts = 0
        self._io_checked: tuple[int, int, int] = (-1, -1, -1)
        self._begun = False
        self.reset(s0)

    # -- kernels -----------------------------------------------------------------------------------------------
    def _prepare(self, pred: Any, geo: Any) -> None:
        m, d, R = self.swap.model, pred.dims, self.max_seqs
        ctx = self.ctx
        load = lambda name: self._parts.enter_context(load_module(name, ctx))   # noqa: E731
        f_q = load("q_lowrank_project").function("q_lowrank_project_rows")
        f_score = load("predictor_score").function("predictor_score_table")
        mod = load(ks.MODULE)
        f_adv, f_cnt, f_sel, f_fetch = (mod.function(n) for n in ("sparse_advance", "sparse_counts", "sparse_select",
                                                                  "sparse_fetch"))
        nq, nkv, hd, r = m.num_q_heads, m.num_kv_heads, m.head_dim, d.r
        self._layered = pred.layered
        self._p_base = pred.projection_dev_ptr
        self._p_layer = 2 * nkv * hd * r if self._layered else 0
        stride, per_p = (hd * r, d.gqa_ratio()) if self._layered else (0, nq)
        block_q, self._q_grid = q_rows_geometry(r, nq, per_p, R)
        self._q_pack = Q_LOWRANK_PROJECT_ROWS.pack(p=self._p_base, q_proj=self.q_proj.ptr, rows=self.rows_dev.ptr,
                                                   num_q_heads=nq, head_dim=hd, r=r, heads_per_p=per_p,
                                                   p_stride=stride)
        self._q_in, self._q_p = self._q_pack.slot("q"), self._q_pack.slot("p")
        self._run_q = launcher(f_q, block_q, 0, self._q_pack)
        self._a_g = pred.a_g_dev_ptr
        self._a_g_layer = d.max_blocks * d.slot_bytes()
        w = score_warps()
        self._score_grid = (ceil_div(self.max_pages, w), R, 1)
        if geo.shared > _SHARED_DEFAULT:
            f_sel.set_max_dynamic_shared(geo.shared)
        # one prepared score and select launch per layer (its A_g, state and slot offsets filled once; the step's
        # tables and counts refilled by begin_step only when they change)
        self._layer_runs: list[tuple[Any, Any]] = []
        self._layer_packs: list[tuple[Any, Any]] = []
        C = self.slots
        for layer in range(m.num_layers):
            score = PREDICTOR_SCORE_TABLE.pack(
                q_proj=self.q_proj.ptr, k_lr=self._a_g + layer * self._a_g_layer, scores=self.scores.ptr,
                rows=self.rows_dev.ptr, num_q_heads=nq, num_kv_heads=nkv, block_size=m.block_size, r=r,
                gqa_ratio=d.gqa_ratio(), table_stride=self.max_pages, max_blocks=d.max_blocks)
            sel = ks.SPARSE_SELECT.pack(
                scores=self.scores.ptr, rows=self.rows_dev.ptr, step=self.step_no.ptr, attend=self.attend.ptr,
                attend_counts=self.attend_counts.ptr, fetch=self.fetch.ptr, fetch_counts=self.fetch_counts.ptr,
                page_slot=self.page_slot.ptr + 4 * layer * R * self.max_pages,
                slot_page=self.slot_page.ptr + 4 * layer * R * C, slot_stamp=self.slot_stamp.ptr + 4 * layer * R * C,
                stats=self.stats.ptr + 16 * layer * R, stride=self.max_pages, slots=C, sel_cap=self.sel_cap,
                budget=self.budget, keep_first=self.keep_first, keep_recent=self.keep_recent,
                slot_base=layer * R * C, src_base=layer * self.layout.num_blocks, head_scores=0, num_heads=0,
                max_blocks=min(self.layout.num_blocks, d.max_blocks), exp2_scale=0.0)
            self._layer_packs.append((score, sel))
            self._layer_runs.append((launcher(f_score, (32 * w, 1, 1), 0, score),
                                     launcher(f_sel, geo.block, geo.shared, sel)))
        if self._temperature is not None:
            self._prepare_heads(m, d, w)
        packs = [p for pair in self._layer_packs for p in pair]
        self._table_slots = [p.slot("table") for p in packs if "table" in p.names]
        self._count_slots = [p.slot("counts") for p in packs if "counts" in p.names]
        self._adv_pack = ks.SPARSE_ADVANCE.pack(step=self.step_no.ptr, rows=self.rows_dev.ptr, R=R)
        self._run_adv = launcher(f_adv, ks.advance_geometry(R).block, 0, self._adv_pack)
        self._adv_grid = ks.advance_geometry(R).grid
        self._cnt_pack = ks.SPARSE_COUNTS.pack(rows=self.rows_dev.ptr, R=R, block_size=m.block_size,
                                               page_counts=self.page_counts.ptr, tail_counts=self.tail_counts.ptr)
        self._cnt_visible = self._cnt_pack.slot("visible")
        self._run_cnt = launcher(f_cnt, ks.advance_geometry(R).block, 0, self._cnt_pack)
        page_vecs = self.layout.block_bytes // 16
        store = self.swap.store
        self._src = store.buffer.device_ptr()
        fgeo = ks.fetch_geometry(R, self.sel_cap, page_vecs)
        self._fetch_grid = fgeo.grid
        self._fetch_pack = ks.SPARSE_FETCH.pack(
            dst=self.pool.ptr, src=self._src, fetch=self.fetch.ptr, fetch_counts=self.fetch_counts.ptr,
            rows=self.rows_dev.ptr, sel_cap=self.sel_cap, page_vecs=page_vecs,
            src_pages=m.num_layers * self.layout.num_blocks, dst_pages=m.num_layers * R * self.slots)
        self._run_fetch = launcher(f_fetch, fgeo.block, 0, self._fetch_pack)
        blk, tok, kvh, v_off = self.attention.scratch_pool_strides(self.layout.group_stride)
        self._strides = (blk, tok, kvh)
        self._k_pool, self._v_pool = self.pool.ptr, self.pool.ptr + 2 * v_off
        dev = self.pool.device
        row = 2 * R * nq * hd
        self._q_arg = _args.pointer_arg("q", row, 16, "bf16", what=f"the queries bf16 [max_seqs, num_q_heads, "
                                        f"head_dim] = [{R}, {nq}, {hd}]", device=dev)
        self._out_arg = _args.pointer_arg("out", row, 16, "bf16", write=True, what=f"the output bf16 [max_seqs, "
                                          f"num_q_heads, head_dim] = [{R}, {nq}, {hd}]", device=dev)
        self._table_arg = _args.pointer_arg("block_tables", 4 * R * self.max_pages, 4, "i32",
                                            what=f"i32 [max_seqs, max_pages] = [{R}, {self.max_pages}] block ids",
                                            device=dev)
        self._counts_arg = _args.pointer_arg("page_counts", 4 * R, 4, "i32",
                                             what=f"i32 [max_seqs] = [{R}] complete pages per sequence", device=dev)
        self._rows_arg = _args.pointer_arg("rows", 4, 4, "i32", what="an i32 [1] real row count", device=dev)

    def _prepare_heads(self, m: Any, d: Any, w: int) -> None:
        """Per-head normalised scores (the predictor's head_temperature): per layer, the heads' maxima of every
        page (``predictor_score_heads_table``); the selection folds in each row's head max and the normalised sum
        (the predictor's arithmetic, the same bits: one launch a layer instead of three)."""
        ctx, P, nq = self.ctx, self.max_pages, m.num_q_heads
        f_heads = self._parts.enter_context(load_module("predictor_score", ctx)).function(
            "predictor_score_heads_table")
        hs = self.head_scores.ptr
        for layer, (_, sel) in enumerate(self._layer_packs):
            heads = PREDICTOR_SCORE_HEADS_TABLE.pack(
                q_proj=self.q_proj.ptr, k_lr=self._a_g + layer * self._a_g_layer, rows=self.rows_dev.ptr,
                head_scores=hs, num_q_heads=nq, num_kv_heads=m.num_kv_heads, block_size=m.block_size, r=d.r,
                gqa_ratio=d.gqa_ratio(), table_stride=P, max_blocks=d.max_blocks)
            sel.slot("head_scores").value = hs
            sel.slot("num_heads").value = nq
            sel.slot("exp2_scale").value = math.log2(math.e) / self._temperature
            self._layer_runs[layer] = (launcher(f_heads, (32 * w, 1, 1), 0, heads), self._layer_runs[layer][1])
            self._layer_packs[layer] = (heads, sel)

    # -- lifetime ----------------------------------------------------------------------------------------------
    def close(self) -> None:
        """Free the slot pool, the state and the attention (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._mine.clear()
        self._parts.close()

    @property
    def closed(self) -> bool:
        return self._closed

    def _live(self, what: str) -> None:
        if self._closed:
            raise HssError(f"DeviceSparseStep.{what}: it is closed")
        if self.swap.closed:
            raise HssError(f"DeviceSparseStep.{what}: its HighSpeedSwap is closed")

    # -- the step ---------------------------------------------------------------------------------------------
    def reset(self, stream: Any, rows: Any = None) -> None:
        """Make every slot of ``rows`` (a row index, a sequence of them, or None: every row) free, its step number and
        counters 0, on ``stream`` (capturable memsets): a new sequence in those rows."""
        self._live("reset")
        s = self._streams(stream)
        R, L, C, P = self.max_seqs, self.num_layers, self.slots, self.max_pages
        if rows is not None and not isinstance(rows, (int, np.integer)):
            try:
                rows = list(rows)
            except TypeError:
                raise TypeError(f"rows must be a row index, a sequence of them or None (every row), not "
                                f"{type(rows).__name__}") from None
        picked = range(R) if rows is None else sorted({_args.as_index("rows", r, R, "rows (max_seqs)") for r in
                                                       ([rows] if isinstance(rows, (int, np.integer)) else rows)})
        spans = _spans(list(picked))
        for first, count in spans:
            for layer in range(L):
                base = layer * R
                cm.memset_d32_async(self.page_slot.ptr + 4 * (base + first) * P, 0xFFFFFFFF, count * P, s)
                cm.memset_d32_async(self.slot_page.ptr + 4 * (base + first) * C, 0xFFFFFFFF, count * C, s)
                cm.memset_d32_async(self.slot_stamp.ptr + 4 * (base + first) * C, 0, count * C, s)
                cm.memset_d32_async(self.stats.ptr + 16 * (base + first), 0, 4 * count, s)
            cm.memset_d32_async(self.step_no.ptr + 4 * first, 0, count, s)

    def begin_step(self, stream: Any, block_tables: Any, page_counts: Any, rows: Any, *,
                   token_counts: Any = None) -> None:
        """Start a decode step of the first ``rows`` rows: ``rows`` an int (1..max_seqs; queued as a memset) or a
        device i32 ``[1]`` holding it (read when the step runs: a captured step replays any real count);
        ``block_tables`` i32 ``[max_seqs, max_pages]`` (row s: sequence s's disk block ids, page order) and
        ``page_counts`` i32 ``[max_seqs]`` (its complete pages), read by every layer's step when it runs. Or, for a
        step whose newest token sits on a page still open (a model's decode step), ``page_counts=None`` and
        ``token_counts`` i32 ``[max_seqs]``, each sequence's visible tokens: the complete pages are
        ``(visible - 1) // block_size`` and :attr:`tail_counts` gets the newest page's tokens (computed on the device,
        for the tail tile: :meth:`TiledAttention.step_tile_tokens`). Advances each real row's step number (on
        ``stream``)."""
        self._live("begin_step")
        s = self._streams(stream)
        if (page_counts is None) == (token_counts is None):
            raise HssError("DeviceSparseStep.begin_step: pass page_counts (complete pages) or token_counts= (visible "
                           "tokens, the newest on an open page), one of the two")
        with _args.deferred_joins():
            tables = self._table_arg(block_tables, s)
            counts = self._counts_arg(page_counts if token_counts is None else token_counts, s)
            read = [("block_tables", tables, 4 * self.max_seqs * self.max_pages),
                    ("page_counts" if token_counts is None else "token_counts", counts, 4 * self.max_seqs)]
            if isinstance(rows, (int, np.integer)) and not isinstance(rows, (bool, np.bool_)):
                real = _args.as_int("rows", rows, 1, self.max_seqs, why="the real row count of this step")
                src = None
            else:
                real, src = None, self._rows_arg(rows, s)
                read.append(("rows", src, 4))
            for name, p, n in read:   # read by every layer's step: memory the step or the swap writes is refused
                self._mine.check(p, n, name, "this DeviceSparseStep")
                self.swap._refuse_owned(p, n, name)
        if real is not None:
            cm.memset_d32_async(self.rows_dev.ptr, real, 1, s)
        else:
            cm.copy_d_to_d_async(self.rows_dev.ptr, src, 4, s)
        if token_counts is not None:
            self._cnt_visible.value = counts
            self._run_cnt(s, *self._adv_grid)
            counts = self.page_counts.ptr
        if (tables, counts) != (self._tables, self._counts):
            for slot in self._table_slots:
                slot.value = tables
            for slot in self._count_slots:
                slot.value = counts
            self._tables, self._counts = tables, counts
        self._run_adv(s, *self._adv_grid)
        self._begun = True

    def attend_layer(self, stream: Any, layer: int, q: Any, out: Any = None) -> None:
        """One layer of the step begun by :meth:`begin_step`: scores, selection, residency, the misses' reads and the
        attention over exactly S (see the module docstring), on ``stream``. ``q`` bf16 ``[max_seqs, num_q_heads,
        head_dim]`` (rows past the real count ignored); ``out`` (optional) bf16 of the same shape, written (rows past
        the real count: zeros). Without ``out`` the attention's state is kept for another tile of
        :attr:`attention` (e.g. the newest, still-open page) that writes the output."""
        if self._closed or not self._begun or self.swap.closed:   # (a closed swap's P, A_g and pages are freed)
            self._live("attend_layer")
            raise HssError("DeviceSparseStep.attend_layer: call begin_step first (it names the step's block tables)")
        s = self._streams(stream)
        if type(layer) is not int or not 0 <= layer < self.num_layers:
            layer = _args.as_index("layer", layer, self.num_layers, "layers")
        if type(q) is int and (out is None or type(out) is int):   # addresses: no producer stream to join
            qp, op = self._q_arg(q, s), (0 if out is None else self._out_arg(out, s))
        else:
            with _args.deferred_joins():
                qp = self._q_arg(q, s)
                op = 0 if out is None else self._out_arg(out, s)
        if (qp, op, _args.RANGES.generation) != self._io_checked:
            self._check_io(qp, op)
        R = self.max_seqs
        self._q_in.value = qp
        if self._layered:
            self._q_p.value = self._p_base + layer * self._p_layer
        self._run_q(s, *self._q_grid)
        run_score, run_sel = self._layer_runs[layer]
        run_score(s, *self._score_grid)
        run_sel(s, R)
        self._run_fetch(s, *self._fetch_grid)
        attn = self.attention
        attn.begin_step(s, R)
        attn.queue_checked_tile(s, R, qp, self._k_pool, self._v_pool, *self._strides, self.attend.ptr,
                                self.attend_counts.ptr, self.swap.model.block_size, op)

    def _check_io(self, qp: int, op: int) -> None:
        """q and out (addresses) against this step's and its swap's memory and each other; remembered while the live
        buffers stay as they are (a decode loop passes the same q and out every layer)."""
        row = 2 * self.max_seqs * self.swap.model.num_q_heads * self.swap.model.head_dim
        self._mine.check(qp, row, "q", "this DeviceSparseStep")
        own_attention = self.attention._own   # (step_tile's check of its output, which queue_checked_tile skips)
        own_attention.check(qp, row, "q", "this DeviceSparseStep's attention")
        if op:
            self._mine.check(op, row, "out", "this DeviceSparseStep")
            own_attention.check(op, row, "out", "this DeviceSparseStep's attention")
            _args.disjoint("DeviceSparseStep.attend_layer", ("out", op, row, True), ("q", qp, row, False))
            self.swap._refuse_owned(op, row, "out")     # (the swap's P, A_g and store pages are read here)
        self._io_checked = (qp, op, _args.RANGES.generation)

    # -- reading the state (outside a step) -----------------------------------------------------------------
    def counters(self, stream: Any) -> DeviceStepCounters:
        """Hits, misses and bytes read per (row, layer) since each row's last reset; waits for ``stream``."""
        self._live("counters")
        s = self._streams(stream)
        host = np.empty((self.num_layers, self.max_seqs, 2), np.int64)
        cm.copy_d_to_h_async(host, self.stats.ptr, host.nbytes, s)
        cm.stream_sync(s)
        hits, misses = host[..., 0].T.copy(), host[..., 1].T.copy()
        return DeviceStepCounters(hits, misses, misses * self.layout.block_bytes)

    def residency(self, stream: Any, layer: int, row: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
        """(page_slot ``[max_pages]``, slot_page ``[slots]``, slot_stamp ``[slots]``, step number) of one (layer, row);
        waits for ``stream``."""
        self._live("residency")
        s = self._streams(stream)
        layer = _args.as_index("layer", layer, self.num_layers, "layers")
        row = _args.as_index("row", row, self.max_seqs, "rows (max_seqs)")
        R, C, P = self.max_seqs, self.slots, self.max_pages
        ps, sp, st, no = (np.empty(P, np.int32), np.empty(C, np.int32), np.empty(C, np.int32), np.empty(1, np.int32))
        i = layer * R + row
        cm.copy_d_to_h_async(ps, self.page_slot.ptr + 4 * i * P, ps.nbytes, s)
        cm.copy_d_to_h_async(sp, self.slot_page.ptr + 4 * i * C, sp.nbytes, s)
        cm.copy_d_to_h_async(st, self.slot_stamp.ptr + 4 * i * C, st.nbytes, s)
        cm.copy_d_to_h_async(no, self.step_no.ptr + 4 * row, 4, s)
        cm.stream_sync(s)
        return ps, sp, st, int(no[0])

    def selection(self, stream: Any) -> tuple[np.ndarray, np.ndarray]:
        """The last layer step's attend lists (i32 ``[max_seqs, sel_cap]`` global slot indices) and counts; waits."""
        self._live("selection")
        s = self._streams(stream)
        att, cnt = np.empty((self.max_seqs, self.sel_cap), np.int32), np.empty(self.max_seqs, np.int32)
        cm.copy_d_to_h_async(att, self.attend.ptr, att.nbytes, s)
        cm.copy_d_to_h_async(cnt, self.attend_counts.ptr, cnt.nbytes, s)
        cm.stream_sync(s)
        return att, cnt


def _spans(rows: list[int]) -> list[tuple[int, int]]:
    """Runs of consecutive row indices as (first, count)."""
    spans: list[tuple[int, int]] = []
    for r in rows:
        if spans and spans[-1][0] + spans[-1][1] == r:
            spans[-1] = (spans[-1][0], spans[-1][1] + 1)
        else:
            spans.append((r, 1))
    return spans
