"""The KV modes of a :class:`~hss.model.batch.BatchSession`: where each row's history lives and how a step of ``b``
rows attends it (docs/design.md §21.2, §21.7; the exact swap, behind the same interface, is
:class:`~hss.model.batch_swap.BatchSwapKV`, §21.8).

- :class:`BatchHbmKV` (``kv="hbm"``): pages of :data:`~hss.model.kv.HBM_PAGE` tokens from one shared HBM pool, one
  token-count tile per layer over each row's pages.
- :class:`BatchSparseKV` (``kv="sparse"``): each row's complete pages of :func:`~hss.model.kv.swap_block_size` tokens
  in one :class:`~hss.swap.HighSpeedSwap`'s pinned host store, attended through one
  :class:`~hss.swap.device_step.DeviceSparseStep` (each row its own selection, residency and counters), its newest,
  still-open page (its *tail*) in HBM.

Both keep a page table i32 ``[max_batch, entries]`` on the device (lane r's row: its page ids in position order, -1
unused) with a host mirror, and answer the session's calls: :meth:`check_join` / :meth:`join` (a prefilled row's
pages from the positional scratch caches), :meth:`before_step` / :meth:`after_step` (between steps),
:meth:`step_ops` / :meth:`attention_ops` / :meth:`step_end_ops` (the step program, captured as a graph; its
``graph_epoch`` constant here), :meth:`release`, :meth:`move` and
:meth:`clear` (a row leaves and the last lane's row moves into its lane). The rows are the session's ``_Row`` records
(``lane``, ``pos``: the position the next step writes, ``pages``: the page ids this mode gave the row).
"""
from __future__ import annotations

import contextlib
import heapq
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from hss import _args
from hss import cuda_min as cm
from hss._util import Closeable, ceil_div
from hss.attention import TiledAttention, TiledAttentionDims
from hss.checkpoint import Config
from hss.decls.sparse_step import MAX_HEADS
from hss.errors import HssError
from hss.model.forward import Forward, Op
from hss.model.kv import HBM_PAGE, host_swap, sparse_support, swap_block_size
from hss.model.weights import BF16
from hss.predictor import PredictorDims, check_projection
from hss.swap.device_step import DeviceSparseStep

__all__ = ["BatchHbmKV", "BatchSparseKV", "sparse_options"]

_I32 = np.int32
Scratch = Callable[[int], tuple[int, int]]   # layer -> (K, V) positional prefill caches, [max_tokens, n_kv, hd]


def sparse_options(c: Config, kv: str, max_batch: int, max_tokens: int, pages: int | None,
                   **opts: Any) -> dict[str, Any] | None:
    """:class:`BatchSparseKV`'s options (``budget``, ``keep_first``, ``keep_recent``, ``rank``, ``projection``,
    ``head_temperature``) checked before any device work, as keywords for it; None for kv='hbm' and kv='swap', which
    take none of them (``TypeError`` / :class:`HssError` naming the option)."""
    budget, projection, temperature = opts["budget"], opts["projection"], opts["head_temperature"]
    if kv != "sparse":
        for name in ("budget", "projection", "head_temperature"):
            if opts[name] is not None:
                raise HssError(f"{name}= is for the sparse KV mode (kv='sparse'), not kv={kv!r}")
        return None
    problem = sparse_support()
    if problem:
        raise HssError(f"the sparse KV mode needs hss.swap's sparse attention: {problem}; use kv='hbm'")
    if budget is None:
        raise HssError("kv='sparse' needs budget= (pages chosen by score per row and layer)")
    out = {name: _args.as_count(name, opts[name]) for name in ("budget", "keep_first", "keep_recent")}
    if sum(out.values()) < 1:
        raise HssError("budget + keep_first + keep_recent must be >= 1: a step attends at least one page")
    out["rank"] = _args.as_int("rank", opts["rank"], 1, 128, "the predictor's rank")
    bs = swap_block_size(c.head_dim)
    if pages is not None and pages < ceil_div(max_tokens, bs):
        raise HssError(f"pages ({pages}, the swap's disk block ids) must cover one row of max_tokens: at least "
                       f"{ceil_div(max_tokens, bs)} pages of {bs} tokens")
    if projection is not None:
        blocks = max_batch * ceil_div(max_tokens, bs) if pages is None else pages
        check_projection(projection, PredictorDims(c.n_layer, c.n_head, c.n_kv_head, c.head_dim, out["rank"], bs,
                                                   blocks))
    if temperature is not None:
        temperature = _args.as_float("head_temperature", temperature)
        if not temperature > 0 or math.log2(math.e) / temperature > float(np.finfo(np.float32).max):
            raise HssError(f"head_temperature = {temperature!r} must be a positive number (at least 1e-38), or None")
        if c.n_head > MAX_HEADS:
            raise HssError(f"head_temperature: the device sparse step folds at most {MAX_HEADS} q heads, not "
                           f"{c.n_head}: use head_temperature=None")
    # the seed of SwapKV's default P: a row decodes what Session(kv="sparse") decodes alone
    return {**out, "seed": 0x5EED, "projection": projection, "head_temperature": temperature}


class _PagedRows(Closeable):
    """What both modes share: the page table (device i32 ``[max_batch, entries]`` and its host mirror), the owner
    stack, the session's forward workspace and row states."""

    mode = ""
    graph_epoch = 0   # the step's work never changes with the rows: one capture per batch size replays throughout

    def __init__(self, ctx: cm.CudaCtx, config: Config, fwd: Forward, state: int, stream: int, max_batch: int,
                 max_tokens: int, block_size: int) -> None:
        self.config, self.fwd, self.state, self.stream = config, fwd, state, stream
        self.max_batch, self.max_tokens, self.block_size = max_batch, max_tokens, block_size
        self.entries = ceil_div(max_tokens, block_size)   # pages a row can need
        self._row_bytes = 2 * config.n_kv_head * config.head_dim   # one token's K (or V) of one layer
        self._page_bytes = block_size * self._row_bytes
        self._owned = contextlib.ExitStack()
        self.tables = self._owned.enter_context(cm.DeviceBuffer(4 * max_batch * self.entries, ctx))
        cm.memset_d32_async(self.tables, 0xFFFFFFFF, max_batch * self.entries, stream)
        self._table = np.full((max_batch, self.entries), -1, _I32)

    def _upload(self, lane: int) -> None:
        cm.copy_h_to_d_async(self.tables.ptr + lane * self._table.strides[0], self._table[lane],
                             self._table[lane].nbytes, self.stream)   # pageable: staged at once

    def _set_row(self, lane: int, ids: Sequence[int]) -> None:
        self._table[lane] = -1
        self._table[lane, :len(ids)] = ids
        self._upload(lane)

    def _set_entry(self, lane: int, i: int, page: int) -> None:
        """Eager, between steps: the step reads the tables when it runs."""
        self._table[lane, i] = page
        cm.copy_h_to_d_async(self.tables.ptr + 4 * (lane * self.entries + i), np.array([page], _I32), 4,
                             self.stream)

    def move(self, row: Any, src: int, dst: int) -> None:
        """``row`` moves from lane ``src`` into lane ``dst`` (its table row, in stream order)."""
        self._table[dst] = self._table[src]
        self._upload(dst)

    def clear(self, lane: int) -> None:
        """``lane`` goes idle: a table row of -1."""
        self._table[lane] = -1
        self._upload(lane)

    def step_ops(self, b: int) -> list[Op]:
        """Ops at the start of a step of ``b`` rows, before the embedding."""
        return []

    def step_end_ops(self, b: int) -> list[Op]:
        """Ops at the end of a step of ``b`` rows, after the token's launch."""
        return []

    def close(self) -> None:
        self._owned.close()


class BatchHbmKV(_PagedRows):
    """The history in HBM: ``pages`` pages of :data:`HBM_PAGE` tokens shared by every row (per layer K and V bf16 NHD
    ``[pages, HBM_PAGE, n_kv_head, head_dim]``; a page id names the same page in every layer), taken lowest id first
    as rows grow and given back when they leave (docs/design.md §21.2)."""

    mode = "hbm"

    def __init__(self, ctx: cm.CudaCtx, config: Config, fwd: Forward, state: int, stream: int, *, max_batch: int,
                 max_tokens: int, pages: int | None, fuse_rope: bool) -> None:
        super().__init__(ctx, config, fwd, state, stream, max_batch, max_tokens, HBM_PAGE)
        self.pages = max_batch * self.entries if pages is None else pages
        self.fuse_rope = fuse_rope
        own = self._owned.enter_context
        try:
            c = config
            self.k, self.v = (own(cm.DeviceBuffer(c.n_layer * self.pages * self._page_bytes, ctx)) for _ in "kv")
            self.attn = own(TiledAttention(ctx, TiledAttentionDims(max_batch, c.n_head, c.n_kv_head, c.head_dim,
                                                                   HBM_PAGE, self.entries)))
        except BaseException:
            self._owned.close()
            raise
        self._free = list(range(self.pages))   # a heap: the lowest page ids first

    @property
    def free_pages(self) -> int:
        return len(self._free)

    def _pool(self, layer: int) -> tuple[int, int]:
        """(K, V) page pools of ``layer``: bf16 NHD ``[pages, HBM_PAGE, n_kv_head, head_dim]``."""
        off = layer * self.pages * self._page_bytes
        return self.k.ptr + off, self.v.ptr + off

    def check_join(self, tokens: int) -> None:
        need = ceil_div(tokens + 1, HBM_PAGE)   # the prompt and the first step's position
        if need > len(self._free):
            raise HssError(f"the page pool has {len(self._free)} free pages, the prompt needs {need}: remove a row, "
                           f"or make the BatchSession with more pages (pages={self.pages})")

    def join(self, row: Any, tokens: int, scratch: Scratch) -> None:
        """The prompt's pages (queued): one copy per layer and run of consecutive page ids from the scratch caches,
        then the row's table row."""
        row.pages = [heapq.heappop(self._free) for _ in range(ceil_div(tokens, HBM_PAGE))]
        s, pb = self.stream, self._page_bytes
        for layer in range(self.config.n_layer):
            (kp, vp), (ks, vs) = self._pool(layer), scratch(layer)
            first = 0
            for i in range(1, len(row.pages) + 1):
                if i < len(row.pages) and row.pages[i] == row.pages[i - 1] + 1:
                    continue
                n = min(i * HBM_PAGE, tokens) - first * HBM_PAGE
                dst, src = row.pages[first] * pb, first * pb
                cm.copy_d_to_d_async(kp + dst, ks + src, n * self._row_bytes, s)
                cm.copy_d_to_d_async(vp + dst, vs + src, n * self._row_bytes, s)
                first = i
        self._set_row(row.lane, row.pages)

    def before_step(self, rows: Sequence[Any]) -> None:
        """Every row whose position starts a new page gets one (raises first, changing nothing, when the pool cannot
        cover them)."""
        grow = [r for r in rows if r.pos // HBM_PAGE == len(r.pages)]
        if len(grow) > len(self._free):
            raise HssError(f"{len(grow)} rows need a new KV page and the pool has {len(self._free)} free: remove() "
                           f"a row, or make the BatchSession with more pages (pages={self.pages})")
        for r in grow:
            page = heapq.heappop(self._free)
            self._set_entry(r.lane, len(r.pages), page)
            r.pages.append(page)

    def after_step(self, rows: Sequence[Any]) -> None:
        pass

    def release(self, row: Any) -> None:
        """The row's pages return to the pool."""
        for p in row.pages:
            heapq.heappush(self._free, p)
        row.pages = []

    def attention_ops(self, layer: int, b: int) -> list[Op]:
        """Layer ``layer``'s RoPE, KV write and decode attention of ``b`` rows: one token-count tile over each row's
        pages (its table row), ``visible`` tokens (its state word 2), into ``fwd.attn``."""
        fwd, attn, c, s, S = self.fwd, self.attn, self.config, self.stream, self.max_batch
        k, v = self._pool(layer)
        table, counts = self.tables.ptr, self.state + 4 * 2 * S
        strides = attn.paged_strides()
        if self.fuse_rope:
            tiles = attn.begin_tiles(s, fwd.qkv, k, v, b, *strides)
            cos, sin, max_pos = fwd.w.rope_cos, fwd.w.rope_sin, c.context_length

            def run(st: int) -> None:
                attn.begin_step(st, b)
                tiles.tile_tokens_rope(table, counts, fwd.qkv, cos, sin, max_pos, 0, output=fwd.attn)
            return [("attention", run)]
        tiles = attn.begin_tiles(s, fwd.q, k, v, b, *strides)

        def run_tile(st: int) -> None:
            attn.begin_step(st, b)
            tiles.tile_tokens(table, counts, 0, output=fwd.attn)
        return [fwd.rows_rope_op(b, self.state, S, k, v, table, self.entries, HBM_PAGE, strides),
                ("attention", run_tile)]


class BatchSparseKV(_PagedRows):
    """The history in one :class:`~hss.swap.HighSpeedSwap` (pinned host store, ``pages`` block ids of
    :func:`swap_block_size` tokens per layer), attended through one :class:`DeviceSparseStep` of ``max_batch`` rows
    (docs/design.md §17.8, §21.7): per row and layer it selects the first ``keep_first``, the last ``keep_recent``
    and the ``budget`` best-scoring other complete pages, keeps them in its own HBM slots and reads only the misses;
    the row's tail (its newest, still-open page, per layer bf16 NHD ``[max_batch, bs, n_kv_head, head_dim]``, lane r's
    page r) is one more tile. A row's page is offloaded when the step that writes its last slot has run (one host
    sync between such steps), into a disk block id the swap gives and takes back when the row leaves. ``rank``,
    ``seed``, ``projection``, ``head_temperature``: the swap predictor's (checked by the session)."""

    mode = "sparse"

    def __init__(self, ctx: cm.CudaCtx, config: Config, fwd: Forward, state: int, live: cm.DeviceBuffer,
                 stream: int, *,
                 max_batch: int, max_tokens: int, pages: int | None, budget: int, keep_first: int,
                 keep_recent: int, rank: int, seed: int, projection: np.ndarray | None,
                 head_temperature: float | None) -> None:
        c = config
        bs = swap_block_size(c.head_dim)
        super().__init__(ctx, config, fwd, state, stream, max_batch, max_tokens, bs)
        self.live = live
        own = self._owned.enter_context
        try:
            self.swap = host_swap(self._owned, ctx, c, max_batch * self.entries if pages is None else pages,
                                  resident=0, tile=1, rank=rank, seed=seed, projection=projection,
                                  head_temperature=head_temperature)   # (the swap's own scratch is unused)
            self.pages = self.swap.model.max_blocks_per_layer
            self.step = own(DeviceSparseStep(self.swap, stream, max_seqs=max_batch, budget_pages=budget,
                                             keep_first=keep_first, keep_recent=keep_recent, max_pages=self.entries,
                                             ctx=ctx))
            tail_bytes = c.n_layer * max_batch * self._page_bytes
            self.k_tail, self.v_tail = (own(cm.DeviceBuffer(tail_bytes, ctx)) for _ in "kv")
            self._host_k, self._host_v = (own(cm.PinnedBuffer(tail_bytes, ctx)) for _ in "kv")
            # every entry of lane r names its tail page r: the paged RoPE writes position pos at row pos % bs of it
            # (rope_table, one entry per page of a row), the tail tile reads it (tail_table, the tile's capacity)
            lanes = np.arange(max_batch, dtype=_I32)[:, None]
            self._rope_table = own(cm.DeviceBuffer(4 * max_batch * self.entries, ctx))
            self._tail_table = own(cm.DeviceBuffer(4 * max_batch * self.step.sel_cap, ctx))
            for buf, width in ((self._rope_table, self.entries), (self._tail_table, self.step.sel_cap)):
                ids = np.ascontiguousarray(np.broadcast_to(lanes, (max_batch, width)))
                cm.copy_h_to_d_async(buf, ids, ids.nbytes, stream)   # pageable: staged at once
        except BaseException:
            self._owned.close()
            raise
        self._done: dict[int, np.ndarray] = {}   # finished rows' counters

    @property
    def free_pages(self) -> int:
        return self.swap.disk_free_count()

    def _tail(self, layer: int, lane: int = 0) -> tuple[int, int]:
        """(K, V) of ``lane``'s tail page of ``layer`` (lane 0: the layer's tail pool)."""
        off = (layer * self.max_batch + lane) * self._page_bytes
        return self.k_tail.ptr + off, self.v_tail.ptr + off

    def _host_tails(self) -> tuple[np.ndarray, np.ndarray]:
        c = self.config
        shape = (c.n_layer, self.max_batch, self.block_size, c.n_kv_head, c.head_dim)
        return self._host_k.view(BF16).reshape(shape), self._host_v.view(BF16).reshape(shape)

    def _block(self) -> int:
        block = self.swap.alloc_disk_block()
        if block is None:   # (check_join and before_step keep this from happening)
            raise HssError(f"the swap's {self.pages} disk block ids are all in use")
        return block

    def check_join(self, tokens: int) -> None:
        need = (tokens + 1) // self.block_size   # the prompt's complete pages and the one its first step may complete
        if need > self.free_pages:
            raise HssError(f"the swap has {self.free_pages} free pages, the prompt needs {need}: remove a row, or "
                           f"make the BatchSession with more pages (pages={self.pages})")

    def join(self, row: Any, tokens: int, scratch: Scratch) -> None:
        """The prompt's complete pages into the swap (each layer's K and V read back from the scratch caches: waits
        for the stream), its last, partial page into the lane's tails, its table row, and a fresh residency for the
        lane (docs/design.md §17.8: pages are known by position)."""
        c, bs, s, lane = self.config, self.block_size, self.stream, row.lane
        full, rest = divmod(tokens, bs)
        shape = (c.n_layer, full * bs, c.n_kv_head, c.head_dim)
        k, v = np.empty(shape, BF16), np.empty(shape, BF16)
        for layer in range(c.n_layer if full else 0):
            for host, dev in zip((k, v), scratch(layer)):
                cm.copy_d_to_h_async(host[layer], dev, host[layer].nbytes, s)   # pageable: waits
        while len(row.pages) < full:
            row.pages.append(self._block())
        for layer in range(c.n_layer):
            ks, vs = scratch(layer)
            for p, block in enumerate(row.pages):
                rows = slice(p * bs, (p + 1) * bs)
                self.swap.offload_block_on_stream(s, layer, block, ks + p * self._page_bytes, k[layer, rows],
                                                  v[layer, rows])
            if rest:
                kt, vt = self._tail(layer, lane)
                src, n = full * self._page_bytes, rest * self._row_bytes
                cm.copy_d_to_d_async(kt, ks + src, n, s)
                cm.copy_d_to_d_async(vt, vs + src, n, s)
        self._set_row(lane, row.pages)
        self.step.reset(s, rows=lane)

    def before_step(self, rows: Sequence[Any]) -> None:
        """Raises, changing nothing, when the swap has fewer free block ids than the rows whose page this step
        completes."""
        need = sum(1 for r in rows if (r.pos + 1) % self.block_size == 0)
        if need > self.free_pages:
            raise HssError(f"{need} rows complete a KV page and the swap has {self.free_pages} free: remove() a row, "
                           f"or make the BatchSession with more pages (pages={self.pages})")

    def after_step(self, rows: Sequence[Any]) -> None:
        """Rows whose step wrote the last slot of a page (their ``pos``, advanced, a multiple of bs) offload it from
        their tails (every layer; one host sync for all of them) into a new block, and their table gets its id."""
        done = [r for r in rows if r.pos % self.block_size == 0]
        if not done:
            return
        c, s, pb = self.config, self.stream, self._page_bytes
        hk, hv = self._host_tails()
        for r in done:
            for layer in range(c.n_layer):
                off = (layer * self.max_batch + r.lane) * pb
                cm.copy_d_to_h_async(self._host_k.ptr + off, self.k_tail.ptr + off, pb, s)
                cm.copy_d_to_h_async(self._host_v.ptr + off, self.v_tail.ptr + off, pb, s)
        cm.stream_sync(s)
        for r in done:
            block = self._block()
            for layer in range(c.n_layer):
                self.swap.offload_block_on_stream(s, layer, block, self._tail(layer, r.lane)[0], hk[layer, r.lane],
                                                  hv[layer, r.lane])
            self._set_entry(r.lane, len(r.pages), block)
            r.pages.append(block)

    def _lane_counts(self, lane: int) -> np.ndarray:
        """The device counters of ``lane`` since its last reset: int64 ``[n_layer, 2]`` (hits, misses); waits."""
        got = self.step.counters(self.stream)
        return np.stack([got.hits[lane], got.misses[lane]], axis=1)

    def _fold(self, row: Any) -> None:
        """Add the row's lane counters to its host total (before the lane's residency is reset or given away)."""
        base = row.kv_counts if row.kv_counts is not None else np.zeros((self.config.n_layer, 2), np.int64)
        row.kv_counts = base + self._lane_counts(row.lane)

    def release(self, row: Any) -> None:
        """The row leaves: its counters are kept, its disk block ids go back to the swap."""
        self._fold(row)
        self._done[row.id] = row.kv_counts
        for block in row.pages:
            self.swap.dec_ref(block)
        row.pages = []

    def move(self, row: Any, src: int, dst: int) -> None:
        """The table row and tails of ``row`` move from lane ``src`` into ``dst``, whose residency starts afresh: the
        row reads its selected pages again (its selection, so its attention and tokens, are unchanged)."""
        self._fold(row)
        s = self.stream
        for layer in range(self.config.n_layer):
            for (a, b) in zip(self._tail(layer, dst), self._tail(layer, src)):
                cm.copy_d_to_d_async(a, b, self._page_bytes, s)
        super().move(row, src, dst)
        self.step.reset(s, rows=dst)   # (its counters too: folded into the row's above)

    def counters(self, row: Any, rid: int) -> dict[str, np.ndarray]:
        """A row's page counters since it joined (``row`` its live record, or None for a finished row ``rid``):
        ``hits``, ``misses``, ``bytes_read``, int64 ``[n_layer]`` (waits for the stream while it is live)."""
        if row is None:
            counts = self._done[rid]
        else:
            counts = self._lane_counts(row.lane)
            if row.kv_counts is not None:
                counts = counts + row.kv_counts
        return {"hits": counts[:, 0].copy(), "misses": counts[:, 1].copy(),
                "bytes_read": counts[:, 1] * self.swap.layout.block_bytes}

    def step_ops(self, b: int) -> list[Op]:
        """The step's start (once, before the embedding): the rows' complete pages and tail lengths from their
        visible counts (state word 2) and the device live count."""
        step, tables, live = self.step, self.tables.ptr, self.live
        counts = self.state + 4 * 2 * self.max_batch

        def run(s: int) -> None:
            step.begin_step(s, tables, None, live, token_counts=counts)
        return [("attention", run)]

    def attention_ops(self, layer: int, b: int) -> list[Op]:
        """Layer ``layer`` of ``b`` rows: ``model_rope_kv_paged`` (q rotated, the new token's K/V into each row's
        tail at row pos % bs), the device sparse step over the rows' complete pages (its state kept), then the tail
        tile of each row's ``tail_counts`` tokens, which writes ``fwd.attn``."""
        fwd, step, attn = self.fwd, self.step, self.step.attention
        k, v = self._tail(layer)
        strides = attn.paged_strides()
        rope = fwd.rows_rope_op(b, self.state, self.max_batch, k, v, self._rope_table.ptr, self.entries,
                                self.block_size, strides)
        tail_table, tail_counts, q = self._tail_table.ptr, step.tail_counts.ptr, fwd.q

        def run(s: int) -> None:
            step.attend_layer(s, layer, q)
            attn.step_tile_tokens(s, q, k, v, tail_table, tail_counts, b, *strides, 0, output=fwd.attn)
        return [rope, ("attention", run)]
