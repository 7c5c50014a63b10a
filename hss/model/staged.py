"""The capturable exact swap step (:class:`StagedPages`): each layer's complete KV pages stream from the swap's pinned
``HostStore`` into HBM in ONE copy per layer, on a copy stream, while the compute stream runs the layers.

HBM holds one page pool in the store's page layout (``[K|V][kv head][stripe]``, docs/design.md §7.1, so a page's bytes
are the store's bytes): a **resident** part, the first ``R`` complete pages of every layer (copied once, as they
complete), then a **staging ring** of ``S`` layer slots, each room for one layer's other pages (up to ``max_pages -
R``), then one **tail** page per layer: the layer's incomplete page, which the decode step's ``model_rope_kv`` writes in
place (:meth:`StagedPages.tail_cache`) and which is offloaded from there when it completes. Table row l lists layer l's
pages 0 .. full - 1 (the resident pages, then slot l % S), then its tail page (entry ``full``, rewritten on the
stream whenever ``full`` changes). A decode step, in queue order:

* at its start (:meth:`StagedPages.begin_op`): the compute stream ``s`` records ``fork``; the copy stream ``c`` waits
  for it and copies the staged pages (R .. full - 1) of layers 0 .. S - 1 (or, when the step before copied them
  already, ``prefetched``, only the one it could not: layer ``(n_layer - 1) % S``, whose slot its last layer read),
  each one ``cuMemcpyHtoDAsync`` from the store's buffer (the layer's pages are consecutive there: block id = page
  index) into slot ``layer % S``, then records ``copied[layer]``;
* layer l's attention (:meth:`StagedPages.attention_op`): ``s`` waits for ``copied[l]`` (when this step copies layer
  l); ONE token-count tile (``TileStep.tile_tokens``, offset 0: the device ``state.visible`` tokens from table row
  l's first page: the complete pages, then the tail) writes the output; ``s`` records ``read[l]``; ``c`` waits for
  it and copies the slot's next user: layer l + S, or past the last layer the NEXT step's layer l % S;
* at its end (:meth:`StagedPages.end_op`): ``s`` waits for ``c`` (a captured step forks and joins inside one capture).

The copy of layer l + S waits only for the attention of layer l, so the copy engine runs up to S layers ahead of
the compute stream, and it keeps streaming across the step's tail into the next step's first layers. The step's
work changes with ``full`` (the complete pages per layer, every ``block_size`` tokens) and with ``prefetched``
(false for the first step after a change): :attr:`StagedPages.epoch` counts those changes, and a step graph captured
under one epoch is valid until the next (:meth:`StagedPages.planning` queues the next epoch's step ahead of time,
for a capture). The same step for the rows of a :class:`~hss.model.batch.BatchSession` (one copy per row and layer,
one tile of every row per layer) is :class:`~hss.model.batch_swap.BatchSwapKV` (docs/design.md §21.8).
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np

from hss import cuda_min as cm
from hss.attention import TiledAttention, TiledAttentionDims
from hss.errors import HssError
from hss.model.forward import Op
from hss.swap.stores import HostStore

__all__ = ["StagedPages", "RING"]

RING = 3   # staging slots (layers in flight on the copy engine)


class StagedPages:
    """The HBM page pool, copy stream, events, tables and attention of the capturable exact swap step (module doc).

    ``store``: the swap's :class:`~hss.swap.stores.HostStore` (page p of layer l at ``offset(l, p)``); ``n_layer``
    layers of ``max_pages`` pages; ``resident`` (>= 0) pages per layer kept in HBM once complete; ``ring`` staging
    slots (clamped to 1..n_layer); ``stream`` the compute stream; kv heads, head_dim and block size are the store
    layout's. The copies read the store's buffer behind its back, in stream order: SwapKV writes a completed tail
    page into the store with a device-to-host copy on the compute stream (:meth:`offload_tails`), never from the
    host while steps are queued. The tail pages start zero."""

    def __init__(self, ctx: cm.CudaCtx, store: HostStore, n_layer: int, num_q_heads: int, max_pages: int,
                 resident: int, stream: int, ring: int = RING) -> None:
        if not isinstance(store, HostStore):
            raise TypeError(f"store must be a HostStore, got {type(store).__name__}")
        lay = store.layout
        self.n_layer, self.max_pages, self.block_size = n_layer, max_pages, lay.block_size
        self.resident = min(resident, max_pages)
        self.ring = max(1, min(ring, n_layer))
        self.page_bytes = lay.block_bytes
        self._slot_pages = max_pages - self.resident
        R, S, bb = self.resident, self.ring, self.page_bytes
        self._store = store
        self._owned = contextlib.ExitStack()
        own = self._owned.enter_context
        try:
            self._tail0 = n_layer * R + S * self._slot_pages     # pool page of layer 0's tail
            self.pages = own(cm.DeviceBuffer((self._tail0 + n_layer) * bb, ctx))
            cm.memset_d32_async(self.pages.ptr + self._tail0 * bb, 0, n_layer * bb // 4, stream)
            self.attn = own(TiledAttention(ctx, TiledAttentionDims(1, num_q_heads, lay.num_kv_heads, lay.head_dim,
                                                                   lay.block_size, max_pages)))
            self.copy_stream = own(cm.CudaStream(ctx))
            ev = lambda: own(cm.CudaEvent(ctx=ctx))   # noqa: E731
            self._fork = ev()
            self._copied = [ev() for _ in range(n_layer)]
            self._read = [ev() for _ in range(n_layer)]
            self._joined = ev()
            # row l: layer l's pages 0 .. max_pages - 1 as pool pages (the resident ones, then slot l % S); entry
            # ``full`` is the layer's tail (set by _put_tables)
            tables = np.empty((n_layer, max_pages), np.int32)
            for layer in range(n_layer):
                tables[layer, :R] = layer * R + np.arange(R)
                tables[layer, R:] = n_layer * R + layer % S * self._slot_pages + np.arange(self._slot_pages)
            self._base_tables = tables
            self.tables = own(cm.DeviceBuffer(tables.nbytes, ctx))
            self._tables_host = own(cm.PinnedBuffer(tables.nbytes, ctx))   # pinned: the upload never syncs
            self._tables_sent = own(cm.CudaEvent(ctx=ctx))
        except BaseException:
            self._owned.close()
            raise
        self._k = self.pages.ptr
        self._v = self.pages.ptr + 2 * self.attn.scratch_pool_strides(lay.group_stride)[3]
        self._src = [store.buffer.ptr + store.offset(layer, 0) + R * bb for layer in range(n_layer)]
        self._dst = [self.pages.ptr + (n_layer * R + j * self._slot_pages) * bb for j in range(S)]
        self._kvh = self.attn.scratch_pool_strides(lay.group_stride)[2]   # elements between a page's stripes
        self.full = 0          # complete pages per layer (the same in every layer)
        self.prefetched = False   # whether the step queued before the next one copies its first layers (module doc)
        self.epoch = 0         # bumped whenever (full, prefetched) changes: a captured step is valid within one epoch
        self._late = (n_layer - 1) % self.ring   # the next step's layer copied at its start (its slot frees last)
        self.counters = dict(steps=0, hits=0, misses=0, bytes_read=0)
        self._put_tables(stream)

    def _put_tables(self, stream: int) -> None:
        """Queue the tables of the current ``full`` on ``stream`` (entry ``full`` of row l: layer l's tail)."""
        self._tables_sent.synchronize()   # the last upload has read the pinned copy (block_size steps ago)
        tables = self._tables_host.view(np.int32).reshape(self._base_tables.shape)
        tables[:] = self._base_tables
        if self.full < self.max_pages:
            tables[:, self.full] = self._tail0 + np.arange(self.n_layer)
        cm.copy_h_to_d_async(self.tables, self._tables_host, tables.nbytes, stream)
        self._tables_sent.record(stream)

    # -- pages -------------------------------------------------------------------------------------
    @property
    def staged(self) -> int:
        """Pages per layer a step copies: the complete pages past the resident ones."""
        return max(self.full - self.resident, 0)

    def set_full(self, full: int, stream: int) -> None:
        """``full`` pages of every layer are in the store now (the earlier ones were given before): queue the copy
        of the newly complete resident pages into HBM on ``stream`` and start a new epoch."""
        if not self.full <= full <= self.max_pages:
            raise HssError(f"StagedPages: {full} complete pages after {self.full} (at most {self.max_pages})")
        lo, hi = min(self.full, self.resident), min(full, self.resident)
        if hi > lo:
            st, bb = self._store, self.page_bytes
            for layer in range(self.n_layer):
                cm._h_to_d_planned(self.pages.ptr + (layer * self.resident + lo) * bb,
                                   st.buffer.ptr + st.offset(layer, lo), (hi - lo) * bb, stream)
        if full != self.full:
            self.full, self.prefetched = full, False
            self.epoch += 1
            self._put_tables(stream)

    def step_queued(self) -> None:
        """A step was queued (graph or eager) in this epoch: it copied the next step's first layers (unless the
        ring has one slot), so the next step of this epoch starts from them (a new epoch if it did not yet)."""
        if not self.prefetched and self.ring > 1:
            self.prefetched = True
            self.epoch += 1

    def tail_cache(self, layer: int) -> tuple[int, int, int, int, int]:
        """Layer ``layer``'s tail page as ``model_rope_kv``'s cache: (k, v, rows = block_size, row_stride,
        kvh_stride) (elements; the page's K stripes, its V stripes)."""
        at = self.pages.ptr + (self._tail0 + layer) * self.page_bytes
        return at, at + self.page_bytes // 2, self.block_size, self._store.layout.head_dim, self._kvh

    def offload_tails(self, page: int, stream: int) -> None:
        """Every layer's tail page is complete as page ``page``: copy each into its store page (device to host, on
        ``stream``, no host wait: the next steps' copies from the store fork from ``stream`` after it), then
        :meth:`set_full` ``page + 1``. The tails are reused as they are (token counts hide their old rows). The store's
        own validity bits and the swap's predictor are not updated: nothing in the exact step reads through them."""
        st, bb = self._store, self.page_bytes
        tails = self.tail_pages()[0]
        for layer in range(self.n_layer):
            cm._d_to_h_planned(st.buffer.ptr + st.offset(layer, page), tails + layer * bb, bb, stream)
        self.set_full(page + 1, stream)

    def tail_pages(self) -> tuple[int, int]:
        """(device address, bytes) of every layer's tail page, layer 0 first, back to back (the store's layout)."""
        return self.pages.ptr + self._tail0 * self.page_bytes, self.n_layer * self.page_bytes

    def next_state(self) -> tuple[int, bool] | None:
        """(full, prefetched) of the next epoch (None: no page left): the same pages prefetched, else one more page."""
        if not self.prefetched and self.ring > 1:
            return self.full, True
        return (self.full + 1, False) if self.full + 1 <= self.max_pages else None

    @contextlib.contextmanager
    def planning(self, full: int, prefetched: bool = False) -> Iterator[int]:
        """Queue steps as they will be with ``full`` complete pages and ``prefetched`` (host state only, restored
        after; no page needs to exist: a capture reads nothing): yields the epoch they will run in."""
        saved = self.full, self.prefetched, self.epoch
        changed = (full, prefetched) != (self.full, self.prefetched)
        self.full, self.prefetched, self.epoch = full, prefetched, self.epoch + changed
        try:
            yield self.epoch
        finally:
            self.full, self.prefetched, self.epoch = saved

    def count_step(self) -> None:
        """Account one decode step in :attr:`counters` (resident pages attended = hits, staged = misses)."""
        n, staged = self.counters, self.staged
        n["steps"] += 1
        n["hits"] += self.n_layer * (self.full - staged)
        n["misses"] += self.n_layer * staged
        n["bytes_read"] += self.n_layer * staged * self.page_bytes

    # -- the step ----------------------------------------------------------------------------------
    def _copy(self, layer: int) -> None:
        c = self.copy_stream.handle
        cm._h_to_d_planned(self._dst[layer % self.ring], self._src[layer], self.staged * self.page_bytes, c)
        self._copied[layer].record(c)

    def begin_op(self) -> Op:
        """The step's first op: fork the copy stream and queue the copies of the first ``ring`` layers."""
        def run(s: int) -> None:
            if not self.staged:
                return
            self._fork.record(s)
            cm.stream_wait_event(self.copy_stream, self._fork)
            for layer in ([self._late] if self.prefetched else range(self.ring)):
                self._copy(layer)
        return "attention", run

    def end_op(self) -> Op:
        """The step's last op: the compute stream waits for the copy stream (the next step's first layers copied at
        the end of this one: a capture joins every stream it forked)."""
        def run(s: int) -> None:
            if not self.staged:
                return
            self._joined.record(self.copy_stream)
            cm.stream_wait_event(s, self._joined)
        return "attention", run

    def attention_op(self, layer: int, q: int, out: int, counts: int, stream: int, rope: tuple | None = None) -> Op:
        """Layer ``layer``'s attention of query ``q`` (bf16 ``[num_q_heads, head_dim]``) into ``out``: one tile over
        its complete pages (resident and staged) and its tail page, up to the device count ``counts`` (i32, the
        visible tokens). ``rope`` (qkv, cos, sin, max_pos): the step's RoPE and tail write inside the launch
        (:meth:`~hss.attention.TileStep.tile_tokens_rope`; ``q`` is then the QKV rows)."""
        attn = self.attn
        tiles = attn.begin_tiles(stream, q, self._k, self._v, 1, *attn.scratch_pool_strides(
            self._store.layout.group_stride)[:3])
        table = self.tables.ptr + 4 * layer * self.max_pages
        S = self.ring
        # the next user of this layer's slot: layer + S in this step, else the next step's layer layer % S (its first
        # layers, copied here unless it is the one copied at the next step's start)
        nxt = layer + S if layer + S < self.n_layer else (layer % S if layer % S != self._late else None)

        def run(s: int) -> None:
            staged = self.staged
            if staged and (layer >= S or layer == self._late or not self.prefetched):   # else copied a step ago
                cm.stream_wait_event(s, self._copied[layer])
            attn.begin_step(s, 1)
            if rope is None:
                tiles.tile_tokens(table, counts, 0, output=out)
            else:
                tiles.tile_tokens_rope(table, counts, *rope, 0, output=out)
            if staged and nxt is not None:
                self._read[layer].record(s)
                cm.stream_wait_event(self.copy_stream, self._read[layer])
                self._copy(nxt)
        return "attention", run

    def read_pages(self, stream: int) -> np.ndarray:
        """The pool's bytes (uint8; waits for ``stream`` and the copy stream): for tests."""
        out = np.empty(self.pages.bytes, np.uint8)
        self.copy_stream.synchronize()
        cm.copy_d_to_h_async(out, self.pages, out.nbytes, stream)
        return out

    def resident_view(self, pages: np.ndarray, layer: int) -> np.ndarray:
        """Layer ``layer``'s resident pages in :meth:`read_pages`' bytes: uint8 ``[R, page_bytes]``."""
        bb, R = self.page_bytes, self.resident
        return pages[layer * R * bb:(layer + 1) * R * bb].reshape(R, bb)

    def slot_view(self, pages: np.ndarray, slot: int) -> np.ndarray:
        """Staging slot ``slot`` in :meth:`read_pages`' bytes: uint8 ``[max_pages - R, page_bytes]``."""
        bb, n = self.page_bytes, self._slot_pages
        at = (self.n_layer * self.resident + slot * n) * bb
        return pages[at:at + n * bb].reshape(n, bb)

    def close(self) -> None:
        self._owned.close()
