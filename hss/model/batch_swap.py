"""The exact swap mode of a :class:`~hss.model.batch.BatchSession` (``kv="swap"``, docs/design.md §21.8):
:class:`BatchSwapKV`, the batched form of :class:`~hss.model.staged.StagedPages`.

Each row's complete pages (of :func:`~hss.model.kv.swap_block_size` tokens) live in ONE pinned host store in the
swap's page layout (:class:`~hss.swap.GroupLayout`, ``[K|V][kv head][stripe]``, docs/design.md §7.1), ``pages`` block
ids per layer shared by the rows (page ``b`` of layer ``l`` at ``l * bytes_per_layer + b * block_bytes``); its newest,
still-open page (its *tail*) per layer in HBM. HBM holds one pool of pages in that layout:

* the **resident** part: per lane and layer, the row's first ``R = resident // n_layer`` complete pages (copied once,
  as they complete), lane-major (lane r's pages of every layer back to back);
* a **staging ring** of ``S`` layer slots, each with room for every lane's other pages (``entries - R`` a lane);
* the **tails**: one page per lane and layer, lane-major.

Per layer, a page table i32 ``[max_batch, entries]`` (lane r's row: its resident pages, then its part of slot
``layer % S``, entry ``full`` = its complete pages: its tail) feeds ONE token-count tile of the step's rows
(``TileStep.tile_tokens_rope``, each row's count its visible tokens, state word 2): the same token list, page layout
and tile as a lone ``Session(kv="swap")``, so the same bits. A step, in queue order, as StagedPages' for one row:

* at its start: the compute stream records ``fork``, the copy stream waits for it and copies layers 0 .. S - 1 (or,
  when the step before copied them already, ``prefetched``, only the one it could not: ``(n_layer - 1) % S``): per
  layer one ``cuMemcpyHtoDAsync`` per run of consecutive block ids of each live row's staged pages (R .. full - 1)
  into the row's part of slot ``layer % S``, then records ``copied[layer]``;
* layer l's attention waits for ``copied[l]`` (when this step copies it), runs the tile, records ``read[l]``; the
  copy stream waits for it and copies the slot's next user (layer l + S, or the next step's layer l % S);
* at its end: the compute stream waits for the copy stream (a capture joins every stream it forked).

The copies' sizes and addresses change when the rows' staged pages do (a row completes a page, or one with staged
pages joins, leaves or changes lanes) and with ``prefetched``: :attr:`BatchSwapKV.graph_epoch` is a fresh number after
each change of the step's work (the copies, and whether the step before made the first ones), so a step graph
captured under one epoch replays exactly while it holds; :meth:`BatchSwapKV.next_epoch` queues the next epoch's step
ahead of time (the rows completing a page this step take their block id before it, in :meth:`before_step`). Block
ids come from a pool that gives a joining row a free run of ``entries`` ids when it can, and a growing row the id
after its last, so a row's pages stay one run: one copy per row and layer.
"""
from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from hss import _args
from hss import cuda_min as cm
from hss._util import Closeable, ceil_div
from hss.attention import TiledAttention, TiledAttentionDims
from hss.checkpoint import Config
from hss.errors import HssError
from hss.model.forward import Forward, Op
from hss.model.kv import swap_block_size
from hss.model.staged import RING
from hss.model.weights import BF16
from hss.swap import GroupLayout

__all__ = ["BatchSwapKV", "swap_options", "RESIDENT"]

RESIDENT = 512   # resident pages a row keeps in HBM, all layers (Session's swap default)
_I32 = np.int32
Scratch = Any    # layer -> (K, V) positional prefill caches, bf16 [max_tokens, n_kv, hd]


def swap_options(c: Config, kv: str, max_tokens: int, pages: int | None, resident: int | None,
                 ring: int | None) -> dict[str, int] | None:
    """:class:`BatchSwapKV`'s ``resident`` (pages a row keeps in HBM, all layers; default :data:`RESIDENT`) and
    ``ring`` (staging slots; default :data:`~hss.model.staged.RING`) checked before any device work; None for the
    other modes, which take neither (``TypeError`` / :class:`HssError` naming the option)."""
    if kv != "swap":
        for name, value in (("resident", resident), ("ring", ring)):
            if value is not None:
                raise HssError(f"{name}= is for the exact swap mode (kv='swap'), not kv={kv!r}")
        return None
    resident = RESIDENT if resident is None else _args.as_count("resident", resident, None,
                                                               "resident pages a row keeps in HBM, all layers")
    ring = RING if ring is None else _args.as_int("ring", ring, 1, None, "staging slots (layers copied ahead)")
    bs = swap_block_size(c.head_dim)
    if pages is not None and pages < ceil_div(max_tokens, bs):
        raise HssError(f"pages ({pages}, the host store's block ids) must cover one row of max_tokens: at least "
                       f"{ceil_div(max_tokens, bs)} pages of {bs} tokens")
    return {"resident": resident, "ring": ring}


class _BlockPool:
    """The host store's block ids ``0 .. n - 1``: a joining row takes the first free aligned run of ``extent`` ids
    when there is one (room for all its pages), a growing row the id after its last when free; else the lowest
    free ids."""

    def __init__(self, n: int, extent: int) -> None:
        self.free = np.ones(n, bool)
        self.extent, self.count = extent, n

    def _first_extent(self) -> int | None:
        e = self.extent
        whole = self.free[:self.free.size // e * e].reshape(-1, e).all(axis=1)
        hit = np.flatnonzero(whole)
        return int(hit[0]) * e if hit.size else None

    def _lowest(self, n: int) -> list[int]:
        return np.flatnonzero(self.free)[:n].tolist()

    def take(self, n: int) -> list[int]:
        """``n`` ids (``n <= count``) for a joining row."""
        start = self._first_extent() if 0 < n <= self.extent else None
        ids = list(range(start, start + n)) if start is not None else self._lowest(n)
        self.free[ids] = False
        self.count -= len(ids)
        return ids

    def take_after(self, last: int | None) -> int:
        """One id (``count >= 1``) for a row whose last page is block ``last`` (None: it has none)."""
        if last is not None and last + 1 < self.free.size and self.free[last + 1]:
            block = last + 1
        else:
            start = self._first_extent() if last is None else None
            block = start if start is not None else self._lowest(1)[0]
        self.free[block] = False
        self.count -= 1
        return block

    def give(self, ids: Sequence[int]) -> None:
        self.free[list(ids)] = True
        self.count += len(ids)


class BatchSwapKV(Closeable):
    """The exact swap of ``max_batch`` rows (module doc; docs/design.md §21.8): a pinned host store of ``pages`` block
    ids per layer (default ``max_batch * entries``), each row's first ``resident // n_layer`` complete pages of every
    layer kept in HBM, its other complete pages streamed every step through ``ring`` layer slots on a copy stream, its
    tail page in HBM. ``fuse_rope``: the step's RoPE and tail write inside the attention launch (False:
    ``model_rope_kv_paged`` first; the same bits). Answers the session's calls as the other modes
    (:mod:`hss.model.batch_kv`)."""

    mode = "swap"

    def __init__(self, ctx: cm.CudaCtx, config: Config, fwd: Forward, state: int, stream: int, *, max_batch: int,
                 max_tokens: int, pages: int | None, resident: int, ring: int, fuse_rope: bool) -> None:
        c = self.config = config
        self.fwd, self.state, self.stream, self.fuse_rope = fwd, state, stream, fuse_rope
        self.max_batch, self.max_tokens = max_batch, max_tokens
        bs = self.block_size = swap_block_size(c.head_dim)
        E = self.entries = ceil_div(max_tokens, bs)   # pages a row can need
        self.pages = max_batch * E if pages is None else pages
        self.layout = GroupLayout(self.pages, c.n_kv_head, bs, c.head_dim)
        bb = self.page_bytes = self.layout.block_bytes
        R = self.resident = min(resident // c.n_layer, E)
        S = self.ring = max(1, min(ring, c.n_layer))
        L, room = c.n_layer, E - R
        self._room = room
        self._slot0 = max_batch * L * R                     # pool page of slot 0, lane 0
        self._tail0 = self._slot0 + S * max_batch * room    # pool page of lane 0's tail of layer 0
        self._owned = contextlib.ExitStack()
        own = self._owned.enter_context
        try:
            self.store = own(cm.PinnedBuffer(L * self.layout.bytes_per_layer, ctx))
            self.pool = own(cm.DeviceBuffer((self._tail0 + max_batch * L) * bb, ctx))
            cm.memset_d32_async(self.pool, 0, self.pool.bytes // 4, stream)   # (never-written tail rows: finite)
            self.attn = own(TiledAttention(ctx, TiledAttentionDims(max_batch, c.n_head, c.n_kv_head, c.head_dim, bs,
                                                                   E)))
            self.copy_stream = own(cm.CudaStream(ctx))
            ev = lambda: own(cm.CudaEvent(ctx=ctx))   # noqa: E731
            self._fork, self._joined = ev(), ev()
            self._copied = [ev() for _ in range(L)]
            self._read = [ev() for _ in range(L)]
            # table of layer l, lane r: its resident pages, then its part of slot l % S; entry full: its tail
            lanes, i = np.arange(max_batch)[:, None], np.arange(E)[None, :]
            base = np.empty((L, max_batch, E), _I32)
            for layer in range(L):
                base[layer] = np.where(i < R, (lanes * L + layer) * R + i,
                                       self._slot0 + (layer % S * max_batch + lanes) * room + i - R)
            self._base = base
            self._table = base.copy()
            self._table[:, :, 0] = self._tail_page(np.arange(max_batch)[None, :], np.arange(L)[:, None])
            self.tables = own(cm.DeviceBuffer(self._table.nbytes, ctx))
            cm.copy_h_to_d_async(self.tables, self._table, self._table.nbytes, stream)   # pageable: staged at once
        except BaseException:
            self._owned.close()
            raise
        strides = self.attn.scratch_pool_strides(self.layout.group_stride)
        self._strides = strides[:3]
        self._k, self._v = self.pool.ptr, self.pool.ptr + 2 * strides[3]
        self._slots = [self.pool.ptr + (self._slot0 + j * max_batch * room) * bb for j in range(S)]
        self._late = (L - 1) % S   # the next step's layer copied at its start (its slot frees last)
        self._blocks_free = _BlockPool(self.pages, E)
        self._lanes: dict[int, list[int]] = {}   # lane -> its row's block ids (the row's ``pages``), live lanes
        self._ids: dict[int, int] = {}           # lane -> its row's id, live lanes
        self._pending: dict[int, int] = {}       # row id -> the block the page it completes this step goes to
        self._tally: dict[int, list[int]] = {}   # row id -> [hits, misses] per layer since it joined (all alike)
        self._runs: tuple[tuple[tuple[int, int, int], ...], int] | None = None   # the copies (_plan), None: stale
        self._epochs = itertools.count(1)
        self.graph_epoch = 0
        self._planned: int | None = None   # the epoch next_epoch promised to the change after_step makes
        self.prefetched = False            # whether the step queued before the next one copied its first layers
        self._step: tuple[tuple[tuple[int, int, int], ...], bool] = ((), False)   # the epoch's (copies, prefetched)
        self.counts = dict(steps=0, hits=0, misses=0, bytes_read=0)

    # -- layout ------------------------------------------------------------------------------------
    def _tail_page(self, lane: Any, layer: Any) -> Any:
        return self._tail0 + lane * self.config.n_layer + layer

    def _page_ptr(self, page: int) -> int:
        return self.pool.ptr + page * self.page_bytes

    def _src(self, layer: int, block: int) -> int:
        """Host address of block ``block`` of ``layer`` in the store."""
        return self.store.ptr + layer * self.layout.bytes_per_layer + block * self.page_bytes

    def _put_table(self, lane: int, lo: int, hi: int) -> None:
        """Queue entries ``lo .. hi - 1`` of ``lane``'s row of every layer's table (eager, between steps: the step
        reads the tables when it runs)."""
        for layer in range(self.config.n_layer):
            part = self._table[layer, lane, lo:hi]
            at = self.tables.ptr + 4 * ((layer * self.max_batch + lane) * self.entries + lo)
            cm.copy_h_to_d_async(at, part, part.nbytes, self.stream)   # pageable: staged at once

    def _set_row(self, lane: int, full: int) -> None:
        """``lane``'s table rows for ``full`` complete pages."""
        self._table[:, lane] = self._base[:, lane]
        if full < self.entries:
            self._table[:, lane, full] = self._tail_page(lane, np.arange(self.config.n_layer))
        self._put_table(lane, 0, self.entries)

    @property
    def free_pages(self) -> int:
        return self._blocks_free.count

    # -- the plan: what a step copies --------------------------------------------------------------
    def _plan(self) -> tuple[tuple[tuple[int, int, int], ...], int]:
        """(runs, staged pages): per run of consecutive block ids of a live lane's pages R .. full - 1, (its first
        page in a slot, its first block, its pages); the staged pages of all lanes."""
        if self._runs is None:
            R, runs = self.resident, []
            for lane, blocks in sorted(self._lanes.items()):
                first = R
                for i in range(R + 1, len(blocks) + 1):
                    if i == len(blocks) or blocks[i] != blocks[i - 1] + 1:
                        runs.append((lane * self._room + first - R, blocks[first], i - first))
                        first = i
            self._runs = tuple(runs), sum(n for _, _, n in runs)
        return self._runs

    @property
    def step_bytes(self) -> int:
        """Bytes a step streams from the host store now (all layers, the live rows' staged pages)."""
        return self.config.n_layer * self._plan()[1] * self.page_bytes

    def _key(self, prefetched: bool) -> tuple[tuple[tuple[int, int, int], ...], bool]:
        """What a step queues with the current lanes: their copies, and whether the step before copied its first
        layers (``prefetched``: it did if asked and it had the same copies to make)."""
        self._runs = None
        runs, staged = self._plan()
        return runs, prefetched and staged > 0 and runs == self._step[0]

    def _update(self, prefetched: bool) -> None:
        """The lanes changed (or a step was queued: ``prefetched`` whether it copied the next step's first layers):
        a new epoch when the step's work did (the promised one, if :meth:`next_epoch` promised this change)."""
        key = self._key(prefetched)
        self.prefetched = key[1]
        if key != self._step:
            self._step = key
            self.graph_epoch = self._planned if self._planned is not None else next(self._epochs)
        self._planned = None

    def next_epoch(self) -> contextlib.AbstractContextManager[int] | None:
        """A context in which the ops queue the step as it will be after :meth:`after_step` of the step queued now
        (its rows completing pages, or the slots prefetched), yielding that epoch, for a capture ahead of time; None
        when that step's work is this one's."""
        done = {lane: self._pending[rid] for lane, rid in self._ids.items() if rid in self._pending}
        saved = self._lanes
        self._lanes = {lane: blocks + [done[lane]] if lane in done else blocks for lane, blocks in saved.items()}
        key = self._key(self.ring > 1)
        planned, self._lanes, self._runs = self._lanes, saved, None
        return None if key == self._step else self._planning(planned, key[1])

    @contextlib.contextmanager
    def _planning(self, lanes: dict[int, list[int]], prefetched: bool) -> Iterator[int]:
        saved = self._lanes, self.prefetched, self._runs
        self._lanes, self.prefetched, self._runs = lanes, prefetched, None
        self._planned = next(self._epochs)
        try:
            yield self._planned
        finally:
            self._lanes, self.prefetched, self._runs = saved

    # -- rows --------------------------------------------------------------------------------------
    def check_join(self, tokens: int) -> None:
        need = (tokens + 1) // self.block_size   # the prompt's complete pages and the one its first step may complete
        if need > self.free_pages:
            raise HssError(f"the host store has {self.free_pages} free pages, the prompt needs {need}: remove a row, "
                           f"or make the BatchSession with more pages (pages={self.pages})")

    def join(self, row: Any, tokens: int, scratch: Scratch) -> None:
        """The prompt's complete pages into the host store (the scratch caches read back: waits for the stream), the
        first R of them into the lane's resident pages, its last, partial page into the lane's tails, its table
        rows."""
        c, bs, s, lane = self.config, self.block_size, self.stream, row.lane
        L, R, bb = c.n_layer, self.resident, self.page_bytes
        full, rest = divmod(tokens, bs)
        shape = (L, tokens, c.n_kv_head, c.head_dim)
        kv = np.empty((2, *shape), BF16)
        for layer in range(L):
            for host, dev in zip(kv[:, layer], scratch(layer)):
                cm.copy_d_to_h_async(host, dev, host.nbytes, s)   # pageable: waits
        cm.stream_sync(s)   # (no copy queued before may still write or read the store)
        images = self._images(kv, full + (rest > 0))   # uint8 [L, pages, bb]
        row.pages = self._blocks_free.take(full)
        if full:
            view = self.store.array.reshape(L, self.pages, bb)
            view[:, row.pages] = images[:, :full]
        for layer in range(L):
            r = min(full, R)
            if r:
                at = self._page_ptr((lane * L + layer) * R)
                cm.copy_h_to_d_async(at, images[layer, :r], r * bb, s)   # pageable: staged at once
        if rest:
            tails = np.ascontiguousarray(images[:, full])
            cm.copy_h_to_d_async(self._page_ptr(self._tail_page(lane, 0)), tails, tails.nbytes, s)
        self._set_row(lane, full)
        self._lanes[lane] = row.pages
        self._ids[lane] = row.id
        self._update(self.prefetched)

    def _images(self, kv: np.ndarray, n: int) -> np.ndarray:
        """Page images uint8 ``[n_layer, n, block_bytes]`` (the store's layout, padding zero) of the bf16 K and V rows
        ``kv`` ``[2, n_layer, tokens, n_kv_head, head_dim]`` (the last page zero past the tokens)."""
        c, bs, lay = self.config, self.block_size, self.layout
        L, t = c.n_layer, kv.shape[2]
        rows = np.zeros((2, L, n * bs, c.n_kv_head, c.head_dim), np.uint16)
        rows[:, :, :t] = kv.view(np.uint16)
        stripes = rows.reshape(2, L, n, bs, c.n_kv_head, c.head_dim).transpose(1, 2, 0, 4, 3, 5)
        img = np.zeros((L, n, 2, c.n_kv_head, lay.group_stride // 2), np.uint16)
        img[..., :bs * c.head_dim] = stripes.reshape(L, n, 2, c.n_kv_head, bs * c.head_dim)
        return img.reshape(L, n, -1).view(np.uint8)

    def before_step(self, rows: Sequence[Any]) -> None:
        """The rows whose page this step completes take its block id now (raises first, changing nothing, when the
        store has fewer free)."""
        self._blocks_free.give(list(self._pending.values()))   # (a step that failed after its before_step)
        self._pending.clear()
        grow = [r for r in rows if (r.pos + 1) % self.block_size == 0]
        if len(grow) > self.free_pages:
            raise HssError(f"{len(grow)} rows complete a KV page and the host store has {self.free_pages} free: "
                           f"remove() a row, or make the BatchSession with more pages (pages={self.pages})")
        for r in grow:
            self._pending[r.id] = self._blocks_free.take_after(r.pages[-1] if r.pages else None)

    def after_step(self, rows: Sequence[Any]) -> None:
        """Count the step; rows whose step wrote the last slot of a page (their ``pos``, advanced, a multiple of bs)
        copy their tails into the store (device to host, on the stream, no host wait: the next step's copies fork
        after them) and, for one of the first R pages, into their resident pages; their tables name the new page.
        The next epoch (module doc)."""
        L, R, bb, s = self.config.n_layer, self.resident, self.page_bytes, self.stream
        hits = misses = 0
        for r in rows:   # this step attended len(r.pages) complete pages of every layer
            hit = min(len(r.pages), R)
            tally = self._tally.setdefault(r.id, [0, 0])
            tally[0] += hit
            tally[1] += len(r.pages) - hit
            hits, misses = hits + hit, misses + len(r.pages) - hit
        n = self.counts
        n["steps"] += 1
        n["hits"] += L * hits
        n["misses"] += L * misses
        n["bytes_read"] += L * misses * bb
        done = [r for r in rows if r.pos % self.block_size == 0]
        for r in done:
            block, p, lane = self._pending.pop(r.id), len(r.pages), r.lane
            for layer in range(L):
                tail = self._page_ptr(self._tail_page(lane, layer))
                cm._d_to_h_planned(self._src(layer, block), tail, bb, s)
                if p < R:
                    cm.copy_d_to_d_async(self._page_ptr((lane * L + layer) * R + p), tail, bb, s)
            r.pages.append(block)
            self._table[:, lane, p] = self._base[:, lane, p]
            if p + 1 < self.entries:
                self._table[:, lane, p + 1] = self._tail_page(lane, np.arange(L))
            self._put_table(lane, p, min(p + 2, self.entries))
        self._update(self.ring > 1)

    def release(self, row: Any) -> None:
        """The row leaves: its counters are kept, its block ids go back to the pool."""
        self._blocks_free.give(row.pages + ([self._pending.pop(row.id)] if row.id in self._pending else []))
        row.pages = []
        self._lanes.pop(row.lane, None)
        self._ids.pop(row.lane, None)
        self._update(self.prefetched)

    def move(self, row: Any, src: int, dst: int) -> None:
        """``row`` moves from lane ``src`` into ``dst``: its resident and tail pages (device to device, in stream
        order) and its table rows; its staged pages are copied by the next step."""
        L, R, bb, s = self.config.n_layer, self.resident, self.page_bytes, self.stream
        if R:
            cm.copy_d_to_d_async(self._page_ptr(dst * L * R), self._page_ptr(src * L * R), L * R * bb, s)
        cm.copy_d_to_d_async(self._page_ptr(self._tail_page(dst, 0)), self._page_ptr(self._tail_page(src, 0)),
                             L * bb, s)
        self._set_row(dst, len(row.pages))
        self._lanes[dst] = self._lanes.pop(src)
        self._ids[dst] = self._ids.pop(src)
        self._update(self.prefetched)

    def clear(self, lane: int) -> None:
        """``lane`` goes idle (its table rows are left as they are: an idle lane attends nothing)."""
        self._lanes.pop(lane, None)
        self._ids.pop(lane, None)
        self._update(self.prefetched)

    def counters(self, row: Any, rid: int) -> dict[str, np.ndarray]:
        """A row's page counters since it joined (``row`` its live record, or None for a finished row ``rid``):
        ``hits`` (complete pages attended from its resident pages), ``misses`` (streamed from the host store),
        ``bytes_read``, int64 ``[n_layer]``."""
        hits, misses = self._tally.get(rid, (0, 0))
        layers = self.config.n_layer
        return {"hits": np.full(layers, hits, np.int64), "misses": np.full(layers, misses, np.int64),
                "bytes_read": np.full(layers, misses * self.page_bytes, np.int64)}

    # -- the step ----------------------------------------------------------------------------------
    def _copy(self, layer: int, runs: list[tuple[int, int, int]]) -> None:
        """Queue the copies of ``layer``'s staged pages into slot ``layer % S`` on the copy stream, then
        ``copied[layer]``."""
        c, bb = self.copy_stream.handle, self.page_bytes
        dst, src = self._slots[layer % self.ring], self._src(layer, 0)
        for at, block, n in runs:
            cm._h_to_d_planned(dst + at * bb, src + block * bb, n * bb, c)
        self._copied[layer].record(c)

    def step_ops(self, b: int) -> list[Op]:
        """The step's first op: fork the copy stream and queue the copies of the first ``ring`` layers (or, when
        prefetched, the one the step before could not copy)."""
        def run(s: int) -> None:
            runs, staged = self._plan()
            if not staged:
                return
            self._fork.record(s)
            cm.stream_wait_event(self.copy_stream, self._fork)
            for layer in ([self._late] if self.prefetched else range(self.ring)):
                self._copy(layer, runs)
        return [("attention", run)]

    def step_end_ops(self, b: int) -> list[Op]:
        """The step's last op: the compute stream waits for the copy stream."""
        def run(s: int) -> None:
            if not self._plan()[1]:
                return
            self._joined.record(self.copy_stream)
            cm.stream_wait_event(s, self._joined)
        return [("attention", run)]

    def attention_ops(self, layer: int, b: int) -> list[Op]:
        """Layer ``layer`` of ``b`` rows: the wait for its staged pages, one token-count tile over each row's
        resident, staged and tail pages (``visible`` tokens, state word 2; the RoPE and tail write inside it, or
        ``model_rope_kv_paged`` first), into ``fwd.attn``; then the copy of the slot's next user."""
        fwd, attn, c, S = self.fwd, self.attn, self.config, self.ring
        table = self.tables.ptr + 4 * layer * self.max_batch * self.entries
        counts = self.state + 4 * 2 * self.max_batch
        nxt = layer + S if layer + S < c.n_layer else (layer % S if layer % S != self._late else None)
        ops: list[Op] = []
        if self.fuse_rope:
            tiles = attn.begin_tiles(self.stream, fwd.qkv, self._k, self._v, b, *self._strides)
            rope = (fwd.qkv, fwd.w.rope_cos, fwd.w.rope_sin, c.context_length)
            tile = lambda: tiles.tile_tokens_rope(table, counts, *rope, 0, output=fwd.attn)   # noqa: E731
        else:
            ops.append(fwd.rows_rope_op(b, self.state, self.max_batch, self._k, self._v, table, self.entries,
                                        self.block_size, self._strides))
            tiles = attn.begin_tiles(self.stream, fwd.q, self._k, self._v, b, *self._strides)
            tile = lambda: tiles.tile_tokens(table, counts, 0, output=fwd.attn)   # noqa: E731

        def run(s: int) -> None:
            runs, staged = self._plan()
            if staged and (layer >= S or layer == self._late or not self.prefetched):   # else copied a step ago
                cm.stream_wait_event(s, self._copied[layer])
            attn.begin_step(s, b)
            tile()
            if staged and nxt is not None:
                self._read[layer].record(s)
                cm.stream_wait_event(self.copy_stream, self._read[layer])
                self._copy(nxt, runs)
        return ops + [("attention", run)]

    def read_pool(self) -> np.ndarray:
        """The HBM pool's bytes (uint8 ``[pool pages, block_bytes]``; waits for the stream and the copy stream):
        for tests."""
        out = np.empty(self.pool.bytes, np.uint8)
        self.copy_stream.synchronize()
        cm.copy_d_to_h_async(out, self.pool, out.nbytes, self.stream)
        return out.reshape(-1, self.page_bytes)

    def close(self) -> None:
        self._owned.close()
