"""Where a decoder's KV history lives and how a decode step attends it: :class:`HbmKV` (in HBM) and
:class:`SwapKV` (in a :class:`~hss.swap.HighSpeedSwap` host store, exact or sparse).

Both give the forward pass the cache rows its ``rope_kv`` writes (``prefill_cache`` / ``decode_cache``: bf16
``[rows, n_kv_head, head_dim]`` with row ``pos % rows``), attend a decode step's query (``decode_attention``) and
keep their history up to date (``end_prefill``, ``after_step``). The prefill always attends positional caches in
HBM (``model_prefill_attn``); a swap mode hands them to its store at ``end_prefill`` and frees them.
"""
from __future__ import annotations

import contextlib
import dataclasses
import inspect
import shutil
import tempfile
from typing import Any

import ml_dtypes
import numpy as np

from hss import cuda_min as cm
from hss._util import ceil_div
from hss.attention import TiledAttention, TiledAttentionDims
from hss.checkpoint import Config
from hss.errors import HssError
from hss.model.forward import Op
from hss.model.staged import RING, StagedPages
from hss.swap import GroupLayout, HighSpeedSwap, HighSpeedSwapConfig, ModelDims
from hss.swap.device_step import DeviceSparseStep

__all__ = ["HbmKV", "SwapKV", "host_swap", "sparse_support", "swap_block_size"]

BF16 = ml_dtypes.bfloat16


HBM_PAGE = 16   # tokens per page of HbmKV's positional caches as TiledAttention sees them


class HbmKV:
    """Paged KV in HBM (the positional caches as pages of :data:`HBM_PAGE` tokens, identity page table), attended by
    :class:`~hss.attention.TiledAttention` in one token-count tile whose length is the device ``state.visible``: a
    decode step queues the same launches whatever the position, so it is capturable. K and V: bf16 ``[n_layer,
    max_tokens, n_kv_head, head_dim]``."""

    mode = "hbm"
    capturable = True
    graph_epoch = 0   # the step's work never changes: one capture replays for the whole session

    def __init__(self, ctx: cm.CudaCtx, config: Config, max_tokens: int, stream: int) -> None:
        c = self.config = config
        self.max_tokens, self._stream = max_tokens, stream
        self._row = 2 * c.n_kv_head * c.head_dim
        self._owned = contextlib.ExitStack()
        own = self._owned.enter_context
        try:
            self.k = own(cm.DeviceBuffer(c.n_layer * max_tokens * self._row, ctx))
            self.v = own(cm.DeviceBuffer(c.n_layer * max_tokens * self._row, ctx))
            pages = ceil_div(max_tokens, HBM_PAGE)
            self.table = own(cm.DeviceBuffer(4 * pages, ctx))
            ids = np.arange(pages, dtype=np.int32)
            cm.copy_h_to_d_async(self.table, ids, ids.nbytes, stream)
            self.attn = own(TiledAttention(ctx, TiledAttentionDims(1, c.n_head, c.n_kv_head, c.head_dim, HBM_PAGE,
                                                                   pages)))
        except BaseException:
            self._owned.close()
            raise

    def cache(self, layer: int) -> tuple[int, int, int]:
        """(k, v, rows) of ``layer``: positional rows."""
        off = layer * self.max_tokens * self._row
        return self.k.ptr + off, self.v.ptr + off, self.max_tokens

    prefill_cache = cache

    def decode_cache(self, layer: int) -> tuple[int, int, int, int, int]:
        """(k, v, rows, row_stride, kvh_stride) of ``layer``: positional rows (``model_rope_kv``'s strides)."""
        c = self.config
        return *self.cache(layer), c.n_kv_head * c.head_dim, c.head_dim

    def begin_prefill(self, stream: int, tokens: int) -> None:
        pass

    def end_prefill(self, stream: int, tokens: int) -> None:
        pass

    def step_begin_ops(self) -> list[Op]:
        return []

    def step_end_ops(self) -> list[Op]:
        return []

    def decode_attention(self, layer: int, q: int, out: int, counts: int) -> Op:
        """A capturable op: one tile over tokens 0 .. counts[0] - 1 of ``layer`` (on this KV's stream)."""
        k, v, _ = self.cache(layer)
        attn, table = self.attn, self.table.ptr
        tiles = attn.begin_tiles(self._stream, q, k, v, 1, *attn.paged_strides())

        def run(s: int) -> None:
            attn.begin_step(s, 1)
            tiles.tile_tokens(table, counts, 0, output=out)
        return "attention", run

    #: the decode step's RoPE runs inside the attention launch (``decode_attention_rope``): no ``model_rope_kv``
    fuses_rope = True

    def decode_attention_rope(self, layer: int, qkv: int, cos: int, sin: int, max_pos: int, out: int,
                              counts: int) -> Op:
        """:meth:`decode_attention` fused with the step's ``model_rope_kv``: the launch rotates q and the newest
        token's k from the QKV rows ``qkv`` (position counts[0] - 1), writes that token's K/V rows into the cache
        and attends tokens 0 .. counts[0] - 1 (the same bits as the two launches)."""
        k, v, _ = self.cache(layer)
        attn, table = self.attn, self.table.ptr
        tiles = attn.begin_tiles(self._stream, qkv, k, v, 1, *attn.paged_strides())

        def run(s: int) -> None:
            attn.begin_step(s, 1)
            tiles.tile_tokens_rope(table, counts, qkv, cos, sin, max_pos, 0, output=out)
        return "attention", run

    def after_step(self, stream: int, pos: int) -> None:
        pass

    def read_keys(self, stream: int, tokens: int) -> np.ndarray:
        """The cached post-RoPE keys of positions ``0 .. tokens - 1``: bf16 ``[n_layer, tokens, n_kv_head, head_dim]``
        (waits for the stream)."""
        c = self.config
        out = np.empty((c.n_layer, tokens, c.n_kv_head, c.head_dim), BF16)
        for layer in range(c.n_layer):
            cm.copy_d_to_h_async(out[layer], self.cache(layer)[0], out[layer].nbytes, stream)
        cm.stream_sync(stream)
        return out

    def stats(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        self._owned.close()


def swap_block_size(head_dim: int) -> int:
    """Tokens per swap page: the smallest page whose bf16 stripes fill whole 4 KiB groups (no padding streamed),
    at least 16 (32 for head_dim 64)."""
    return max(16, 4096 // (2 * head_dim))


def sparse_support() -> str | None:
    """None when :mod:`hss.swap` offers the sparse mode (``attend_layer(..., budget_pages=, keep_first=,
    keep_recent=)`` and a way to hand its predictor a calibrated ``projection=`` / ``head_temperature=``), else a
    sentence saying what is missing."""
    params = inspect.signature(HighSpeedSwap.attend_layer_on_stream).parameters
    missing = [p for p in ("budget_pages", "keep_first", "keep_recent") if p not in params]
    if missing:
        return f"HighSpeedSwap.attend_layer has no {', '.join(missing)} yet"
    if _projection_route() is None:
        return "HighSpeedSwap takes no calibrated projection= yet"
    return None


def _projection_route() -> str | None:
    if {"projection", "head_temperature"} <= {f.name for f in dataclasses.fields(HighSpeedSwapConfig)}:
        return "config"
    if {"projection", "head_temperature"} <= set(inspect.signature(HighSpeedSwap.__init__).parameters):
        return "constructor"
    return None


def host_swap(owned: contextlib.ExitStack, ctx: cm.CudaCtx, config: Config, max_blocks: int, *, resident: int,
              tile: int, rank: int, seed: int, projection: np.ndarray | None = None,
              head_temperature: float | None = None) -> HighSpeedSwap:
    """A :class:`~hss.swap.HighSpeedSwap` of ``config``'s layers over a pinned ``HostStore`` of ``max_blocks`` pages
    per layer of :func:`swap_block_size` tokens, entered into ``owned`` (which also removes its temporary
    directory): ``resident`` + two tiles of ``tile`` scratch slots, predictor rank ``rank`` (the seeded P of
    ``seed``, or the calibrated ``projection``), ``head_temperature`` (the predictor's, docs/design.md §17.5)."""
    c, bs = config, swap_block_size(config.head_dim)
    dims = ModelDims(c.n_layer, max_blocks, c.n_head, c.n_kv_head, c.head_dim, bs)
    layout = GroupLayout(max_blocks, c.n_kv_head, bs, c.head_dim)
    path = tempfile.mkdtemp(prefix="hss-model-swap-")
    owned.callback(shutil.rmtree, path, True)
    cfg = HighSpeedSwapConfig(dir=path, bytes=c.n_layer * layout.bytes_per_layer, resident_blocks=resident + 2 * tile,
                              rank=rank, qd=8, graph=False, projection_seed=seed, store="host",
                              stream_tile_blocks=tile)
    extra: dict[str, Any] = {}
    if projection is not None or head_temperature is not None:
        extra = {"projection": projection, "head_temperature": head_temperature}
        if _projection_route() == "config":
            cfg, extra = dataclasses.replace(cfg, **extra), {}
    return owned.enter_context(HighSpeedSwap(ctx, cfg, dims, **extra))


class SwapKV:
    """The history in a :class:`~hss.swap.HighSpeedSwap` ``HostStore`` (pinned host memory): pages of
    :func:`swap_block_size` tokens, offloaded as they complete (one host sync per ``bs`` tokens, for all layers).
    Only each layer's last, incomplete page stays on the device (the *tail*).

    Exact mode (``budget`` None; :attr:`capturable`): the step of :class:`~hss.model.staged.StagedPages`: the first
    ``resident // n_layer`` complete pages of every layer stay in HBM, each layer's other complete pages stream from
    the store in one copy per layer (a copy stream, a ring of ``ring`` layer slots) while the compute stream runs the
    layers; the tail is a page of StagedPages' pool in the store's layout (``model_rope_kv`` writes it in place), and
    one token-count tile per layer attends the complete pages and the tail. The step queues the
    same work until the page count changes (every ``bs`` tokens: :attr:`graph_epoch` counts the changes), so a step
    captured in one epoch replays until the next. ``tile`` is not used.

    Sparse mode (``budget`` pages; needs :func:`sparse_support`): ``attend_layer`` over the swap's resident set of
    ``resident`` pages (all layers) and two streamed tiles of ``tile`` pages, a host op per layer (it waits for the
    predictor scores), then the tail tile, which writes the output. ``projection`` / ``head_temperature`` go to the
    swap's predictor (a calibrated ``[n_layer, n_kv_head, head_dim, rank]`` bf16 projection)."""

    def __init__(self, ctx: cm.CudaCtx, config: Config, max_tokens: int, stream: int, *, resident: int, tile: int,
                 rank: int = 32, seed: int = 0x5EED, budget: int | None = None, keep_first: int = 1,
                 keep_recent: int = 4, projection: np.ndarray | None = None,
                 head_temperature: float | None = None, ring: int = RING, device_step: bool = True) -> None:
        c = self.config = config
        self.mode = "swap" if budget is None else "sparse"
        exact = budget is None
        if type(device_step) is not bool:
            raise TypeError(f"device_step must be a bool, got {type(device_step).__name__}")
        on_device = device_step and not exact
        self.capturable = exact or on_device
        if exact and (type(ring) is not int or not 1 <= ring):
            raise HssError(f"ring must be an int >= 1 (staging slots), got {ring!r}")
        bs = self.block_size = swap_block_size(c.head_dim)
        self._stream, self._ctx = stream, ctx
        self._sparse: dict[str, int] = {}
        extra: dict[str, Any] = {}
        if budget is not None or projection is not None or head_temperature is not None:
            problem = sparse_support()
            if problem:
                raise HssError(f"the sparse KV mode needs hss.swap's sparse attention: {problem}; use --kv swap "
                               "or --kv hbm")
            if budget is not None:
                self._sparse = {"budget_pages": budget, "keep_first": keep_first, "keep_recent": keep_recent}
            extra = {"projection": projection, "head_temperature": head_temperature}
        swap_resident, swap_tile = (0, 1) if exact else (resident, tile)   # exact: the swap's scratch is unused
        self._owned = contextlib.ExitStack()
        own = self._owned.enter_context
        try:
            self.swap = host_swap(self._owned, ctx, c, ceil_div(max_tokens, bs), resident=swap_resident,
                                  tile=swap_tile, rank=rank, seed=seed, **extra)
            max_blocks = self.swap.model.max_blocks_per_layer
            self._page = 2 * bs * c.n_kv_head * c.head_dim      # bytes of one page's K (or V), NHD
            self.k_tail = own(cm.DeviceBuffer(c.n_layer * self._page, ctx))
            self.v_tail = own(cm.DeviceBuffer(c.n_layer * self._page, ctx))
            cap = self.swap.attn.dims.tile_capacity
            self._table = own(cm.DeviceBuffer(4 * cap, ctx))         # one entry: page 0 of a tail
            self._count = own(cm.DeviceBuffer(4, ctx))
            cm.memset_d32_async(self._table, 0, cap, stream)
            cm.memset_d32_async(self._count, 1, 1, stream)
            self._host_k = own(cm.PinnedBuffer(c.n_layer * self._page, ctx))
            self._host_v = own(cm.PinnedBuffer(c.n_layer * self._page, ctx))
            self.staged: StagedPages | None = None
            self.sparse_step: DeviceSparseStep | None = None
            if on_device:   # the selection, residency and reads on the device: one step graph for the session
                self.sparse_step = own(DeviceSparseStep(self.swap, stream, max_seqs=1, budget_pages=budget,
                                                        keep_first=keep_first, keep_recent=keep_recent,
                                                        max_pages=max_blocks, ctx=ctx))
                self._dev_table = own(cm.DeviceBuffer(4 * max_blocks, ctx))   # block ids, page order
                self._tail_table = own(cm.DeviceBuffer(4 * self.sparse_step.sel_cap, ctx))   # one entry: page 0
                cm.memset_d32_async(self._dev_table, 0, max_blocks, stream)
                cm.memset_d32_async(self._tail_table, 0, self.sparse_step.sel_cap, stream)
                self._skipped = self._dev_steps = 0
            if exact:
                self.staged = own(contextlib.closing(StagedPages(
                    ctx, self.swap.store, c.n_layer, c.n_head, max_blocks, resident // c.n_layer,
                    stream, ring)))
        except BaseException:
            self._owned.close()
            raise
        self._blocks: list[int] = []
        self._ids = np.zeros(0, np.int64)
        self._prefill: contextlib.ExitStack | None = None
        self._prefill_rows = 0
        self._pos = 0   # the position the next decode step writes (host mirror)

    # -- caches ------------------------------------------------------------------------------------
    def begin_prefill(self, stream: int, tokens: int) -> None:
        """Positional HBM caches for the prompt's ``tokens`` rows (freed by :meth:`end_prefill`)."""
        c = self.config
        self._prefill = contextlib.ExitStack()
        row = 2 * c.n_kv_head * c.head_dim
        self._pk = self._prefill.enter_context(cm.DeviceBuffer(c.n_layer * tokens * row, self._ctx))
        self._pv = self._prefill.enter_context(cm.DeviceBuffer(c.n_layer * tokens * row, self._ctx))
        self._prefill_rows = tokens

    def prefill_cache(self, layer: int) -> tuple[int, int, int]:
        if self._prefill is None:
            raise HssError("SwapKV.prefill_cache outside a prefill")
        c, t = self.config, self._prefill_rows
        off = layer * t * 2 * c.n_kv_head * c.head_dim
        return self._pk.ptr + off, self._pv.ptr + off, t

    def decode_cache(self, layer: int) -> tuple[int, int, int, int, int]:
        """``model_rope_kv``'s cache of ``layer``'s decode step: (k, v, rows, row_stride, kvh_stride) of its tail
        (exact mode: the page in StagedPages' pool; sparse: positional rows of ``k_tail`` / ``v_tail``)."""
        if self.staged is not None:
            return self.staged.tail_cache(layer)
        c = self.config
        return (self.k_tail.ptr + layer * self._page, self.v_tail.ptr + layer * self._page, self.block_size,
                c.n_kv_head * c.head_dim, c.head_dim)

    def end_prefill(self, stream: int, tokens: int) -> None:
        """Offload the prompt's complete pages (waits for the stream), move each layer's last partial page into its
        tail, free the prefill caches."""
        c, bs = self.config, self.block_size
        full, rest = divmod(tokens, bs)
        shape = (c.n_layer, tokens, c.n_kv_head, c.head_dim)
        k, v = np.empty(shape, BF16), np.empty(shape, BF16)
        cm.copy_d_to_h_async(k, self._pk, k.nbytes, stream)
        cm.copy_d_to_h_async(v, self._pv, v.nbytes, stream)
        cm.stream_sync(stream)
        self._grow(full)
        page = self._page
        st = self.staged
        if st is not None and rest:   # the tails as page images (rows rest .. bs - 1 zero)
            zeros = np.zeros((bs - rest, c.n_kv_head, c.head_dim), BF16)
            pad = lambda a, layer: np.concatenate([a[layer, full * bs:], zeros])   # noqa: E731
            images = np.stack([self.swap.layout.pack_page(pad(k, layer), pad(v, layer))
                               for layer in range(c.n_layer)])
            cm.copy_h_to_d_async(st.tail_pages()[0], images, images.nbytes, stream)   # pageable: staged at once
        for layer in range(c.n_layer):
            kd = self.prefill_cache(layer)[0]
            for p in range(full):
                rows = slice(p * bs, (p + 1) * bs)
                self.swap.offload_block_on_stream(stream, layer, self._blocks[p], kd + p * page, k[layer, rows],
                                                  v[layer, rows])
            if rest and st is None:
                src = full * page
                kt, vt = self.decode_cache(layer)[:2]
                cm.copy_d_to_d_async(kt, kd + src, rest * page // bs, stream)
                cm.copy_d_to_d_async(vt, self.prefill_cache(layer)[1] + src, rest * page // bs, stream)
        if st is not None:
            st.set_full(full, stream)
        cm.stream_sync(stream)   # the projections and tail copies read the prefill caches
        self._prefill.close()
        self._prefill = None
        self._pos = tokens

    def _grow(self, pages: int) -> None:
        while len(self._blocks) < pages:
            block = self.swap.alloc_disk_block()
            if block is None:
                raise HssError("SwapKV: the swap's disk block ids are exhausted (max_tokens too small)")
            if self.staged is not None and block != len(self._blocks):   # one copy per layer needs page p = block p
                raise HssError(f"SwapKV: the swap gave disk block {block} for page {len(self._blocks)}: the exact "
                               "mode needs a fresh swap (block ids in page order)")
            self._blocks.append(block)
            if self.sparse_step is not None:   # eager, between steps: the step graph reads the table when it runs
                p = len(self._blocks) - 1
                cm.copy_h_to_d_async(self._dev_table.ptr + 4 * p, np.array([block], np.int32), 4, self._stream)
        self._ids = np.asarray(self._blocks, np.int64)

    # -- decode ------------------------------------------------------------------------------------
    @property
    def graph_epoch(self) -> int:
        """Changes exactly when the step's work changes (a page completed, or the step after that): a step graph
        captured under one value replays correctly while it holds (always 0 in the sparse mode, not capturable)."""
        return 0 if self.staged is None else self.staged.epoch

    def next_epoch(self) -> contextlib.AbstractContextManager[int] | None:
        """Exact mode: a context in which the ops queue the step of the next :attr:`graph_epoch` (one more complete
        page), yielding that epoch, for a capture ahead of time; None when there is none (sparse mode, or no page
        left)."""
        st = self.staged
        nxt = None if st is None else st.next_state()
        return None if nxt is None else st.planning(*nxt)

    def step_begin_ops(self) -> list[Op]:
        """Ops queued at the start of every decode step, before the embedding (exact mode: the first copies)."""
        return [] if self.staged is None else [self.staged.begin_op()]

    def step_end_ops(self) -> list[Op]:
        """Ops queued at the end of every decode step (exact mode: the join of the copy stream)."""
        return [] if self.staged is None else [self.staged.end_op()]

    @property
    def fuses_rope(self) -> bool:
        """Exact mode: the decode step's RoPE and tail write run inside the attention launch."""
        return self.staged is not None

    def decode_attention_rope(self, layer: int, qkv: int, cos: int, sin: int, max_pos: int, out: int,
                              counts: int) -> Op:
        """Exact mode: :meth:`decode_attention` with the step's ``model_rope_kv`` inside the launch (the tail page's
        newest row is the tile's last token)."""
        return self.staged.attention_op(layer, qkv, out, counts, self._stream, rope=(qkv, cos, sin, max_pos))

    def decode_attention(self, layer: int, q: int, out: int, counts: int) -> Op:
        """Exact mode: a capturable op (:meth:`StagedPages.attention_op <hss.model.staged.StagedPages.attention_op>`,
        ``counts`` the device visible-token count). Sparse mode: a host op (``attend_layer`` waits for the predictor
        scores): the complete pages through the swap, then the tail tile, which writes ``out``."""
        if self.staged is not None:
            return self.staged.attention_op(layer, q, out, counts, self._stream)
        if self.sparse_step is not None:
            return self._device_sparse_op(layer, q, out, counts)
        swap, attn, bs = self.swap, self.swap.attn, self.block_size
        kt, vt = self.decode_cache(layer)[:2]
        strides = attn.paged_strides()
        table, count, sparse = self._table.ptr, self._count.ptr, self._sparse

        def run(s: int) -> None:
            full = self._pos // bs
            if full:
                swap.attend_layer_on_stream(s, layer, self._ids[:full], q, out, **sparse)
            else:
                attn.begin_step(s, 1)
            attn.step_tile(s, q, kt, vt, table, count, 1, *strides, self._pos % bs + 1, output=out)
        return "attention", run

    def _device_sparse_op(self, layer: int, q: int, out: int, counts: int) -> Op:
        """The device sparse step of ``layer`` (capturable): the first layer begins the token's step (its complete
        pages and tail length from the device count ``counts``), then the selected pages' tile and the tail's
        token-count tile, which writes ``out``."""
        step, table = self.sparse_step, self._dev_table.ptr
        kt, vt = self.decode_cache(layer)[:2]
        attn = step.attention
        strides = attn.paged_strides()
        tail_table, tail_counts = self._tail_table.ptr, step.tail_counts.ptr

        def run(s: int) -> None:
            if layer == 0:
                step.begin_step(s, table, None, 1, token_counts=counts)
            step.attend_layer(s, layer, q)
            attn.step_tile_tokens(s, q, kt, vt, tail_table, tail_counts, 1, *strides, 0, output=out)
        return "attention", run

    def after_step(self, stream: int, pos: int) -> None:
        """After the step that wrote position ``pos``: offload the tails when that completed a page."""
        c, bs = self.config, self.block_size
        self._pos = pos + 1
        if self.staged is not None:
            self.staged.count_step()
            self.staged.step_queued()
        if self.sparse_step is not None:   # pages of this step not attended, every layer (the host's count)
            full = pos // bs
            self._skipped += (full - min(full, self.sparse_step.sel_cap)) * c.n_layer
            self._dev_steps += c.n_layer
        if self._pos % bs:
            return
        p = pos // bs
        self._grow(p + 1)
        if self.staged is not None:   # exact mode: device-to-host copies in stream order, no host wait
            self.staged.offload_tails(p, stream)
            return
        shape = (c.n_layer, bs, c.n_kv_head, c.head_dim)
        hk, hv = self._host_k.view(BF16).reshape(shape), self._host_v.view(BF16).reshape(shape)
        cm.copy_d_to_h_async(self._host_k, self.k_tail, self._host_k.bytes, stream)
        cm.copy_d_to_h_async(self._host_v, self.v_tail, self._host_v.bytes, stream)
        cm.stream_sync(stream)
        for layer in range(c.n_layer):
            self.swap.offload_block_on_stream(stream, layer, self._blocks[p], self.k_tail.ptr + layer * self._page,
                                              hk[layer], hv[layer])

    def stats(self) -> dict[str, Any]:
        """Counters since the start: ``hits`` / ``misses`` (complete pages attended from the resident set / streamed,
        all layers), ``bytes_read`` (streamed), ``steps``; sizes (``resident_capacity`` pages, all layers,
        ``block_size``; sparse mode: ``tile_pages``, ``skipped``; exact mode: ``ring`` slots)."""
        if self.staged is not None:
            st = self.staged
            return {**st.counters, "skipped": 0, "resident_capacity": st.resident * self.config.n_layer,
                    "ring": st.ring, "tile_pages": 0, "block_size": self.block_size}
        if self.sparse_step is not None:
            st = self.sparse_step
            got = st.counters(self._stream)
            return {"hits": int(got.hits.sum()), "misses": int(got.misses.sum()),
                    "bytes_read": int(got.bytes_read.sum()), "steps": self._dev_steps,
                    "skipped": self._skipped, "resident_capacity": st.slots * self.config.n_layer,
                    "tile_pages": st.sel_cap, "block_size": self.block_size, "device_step": True}
        d = self.swap.diagnostic_summary()
        return {"hits": d.hits, "misses": d.misses, "bytes_read": d.bytes_read, "steps": d.steps,
                "skipped": getattr(d, "skipped", 0), "resident_capacity": d.resident_capacity,
                "tile_pages": d.stream_tile_blocks, "block_size": self.block_size}

    def close(self) -> None:
        if self._prefill is not None:
            self._prefill.close()
            self._prefill = None
        self._owned.close()
