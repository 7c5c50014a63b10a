"""Tiled (streaming) decode attention (SPEC §6): online-softmax state carried across tile launches.

A decode step is ``begin_step`` (m := -inf, l := 0, o := 0), one ``step_tile`` per tile of KV pages (the
pages may be streamed into a small scratch pool between tiles), then ``finalize`` (out = o / l in bf16).
A tile is split into fixed 1024-token units, each one's partial softmax state computed by one CTA (its 8
warps each streaming their own rows, 4 query heads of a kv head sharing the staged K/V), then folded in unit
order into the running state by the last CTA to finish, in the same launch (SPEC §0 allows split and
merge). A tile's result depends only on its token list: the same pages in the same
tiles give the same bits whatever the pool layout, ``tile_capacity`` or the other sequences; another split
into tiles rounds differently (both exact attention within SPEC §0). Every call is asynchronous on the
given stream.

Streams are ``int`` handles, :class:`~hss.cuda_min.CudaStream` objects or anything with
``__cuda_stream__``; a :class:`~hss.cuda_min.CudaCtx` in the stream position means its stream. Device
pointers are ``int`` addresses, :class:`~hss.cuda_min.DeviceBuffer` objects or anything with
``__cuda_array_interface__`` (PyTorch / CuPy tensors).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from hss import cuda_min as cm
from hss.errors import HssError
from hss.kernels.attention import (ATTENTION_FINALIZE, FINALIZE_THREADS, MAX_HEAD_DIM, PAGED_DECODE_ATTN_TILED,
                                   STEP_THREADS, UNIT_TOKENS, head_groups, max_units, padded_head_dim, step_grid_z,
                                   step_shared_bytes)
from hss.ptx import load_module
from hss._args import as_int

__all__ = ["TiledAttentionDims", "TiledAttention"]

NEG_INF_BITS = 0xFF800000   # f32 -inf, the initial running max
# parameter indices of paged_decode_attn_tiled that change per call (see its declaration)
_Q, _K, _V, _TABLE, _COUNTS, _OUT, _BLK, _TOK, _KVH, _LBVS, _FRESH = 0, 1, 2, 3, 4, 10, 19, 20, 21, 22, 23
_I32_MAX = 2**31 - 1


@dataclass(frozen=True)
class TiledAttentionDims:
    """Sizes of a :class:`TiledAttention` (SPEC §6.1).

    ``max_seqs`` sequences per step, ``num_q_heads`` / ``num_kv_heads`` (GQA), ``head_dim`` (<= 256),
    ``block_size`` tokens per KV page, ``tile_capacity`` pages per sequence per tile.
    """

    max_seqs: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    tile_capacity: int

    def validate(self) -> None:
        """Raise :class:`HssError` naming the first field that the kernels cannot take."""
        for name in ("max_seqs", "num_q_heads", "num_kv_heads", "head_dim", "block_size", "tile_capacity"):
            v = as_int(name, getattr(self, name))
            if v <= 0:
                raise HssError(f"TiledAttentionDims.{name} must be > 0 (got {v})")
        if self.num_q_heads % self.num_kv_heads:
            raise HssError(f"TiledAttentionDims.num_q_heads ({self.num_q_heads}) must be a multiple of "
                           f"num_kv_heads ({self.num_kv_heads})")
        if self.head_dim > MAX_HEAD_DIM:
            raise HssError(f"TiledAttentionDims.head_dim ({self.head_dim}) must be <= {MAX_HEAD_DIM} "
                           "(the kernel's per-row limit)")
        if self.num_q_heads > 65535 or self.num_kv_heads * head_groups(self.gqa_ratio) > 65535:
            raise HssError(f"TiledAttentionDims.num_q_heads ({self.num_q_heads}) must be <= 65535, and num_kv_heads "
                           f"* ceil(gqa_ratio/4) too (grid.y)")
        if self.tile_capacity * self.block_size > _I32_MAX:
            raise HssError(f"TiledAttentionDims.tile_capacity * block_size ({self.tile_capacity} * {self.block_size}) "
                           f"must fit in int32: use smaller tiles")
        if self.max_units > 65535:
            raise HssError(f"TiledAttentionDims.tile_capacity * block_size ({self.tile_capacity} * {self.block_size}) "
                           f"must be <= {65535 * UNIT_TOKENS} tokens (65535 units of {UNIT_TOKENS} on grid.z): use "
                           "smaller tiles")
        if self.max_seqs > _I32_MAX:
            raise HssError(f"TiledAttentionDims.max_seqs ({self.max_seqs}) must be < 2^31 (grid.x)")

    @property
    def gqa_ratio(self) -> int:
        """Query heads per KV head."""
        return self.num_q_heads // self.num_kv_heads

    @property
    def max_units(self) -> int:
        """1024-token units (partial states per sequence and query head) of a full tile."""
        return max_units(self.tile_capacity, self.block_size)

    @property
    def merge_counters(self) -> int:
        """Fold counters: one per (sequence, kv head, group of 4 query heads)."""
        return self.max_seqs * self.num_kv_heads * head_groups(self.gqa_ratio)

    @property
    def workspace_bytes(self) -> int:
        """Device bytes of the partial states and fold counters a :class:`TiledAttention` allocates."""
        rows = self.max_seqs * self.num_q_heads
        return 4 * (rows * self.max_units * (padded_head_dim(self.head_dim) + 2) + self.merge_counters)

    @property
    def stripe_bytes(self) -> int:
        """Bytes of one (page, kind, kv_head) stripe of bf16 [block_size, head_dim]: the unpadded group."""
        return 2 * self.block_size * self.head_dim


def _stream(stream: Any) -> int:
    return stream.stream if isinstance(stream, cm.CudaCtx) else cm.stream_handle(stream)


def _device_size(obj: Any) -> int | None:
    """Bytes a device object says it holds (DeviceBuffer, contiguous __cuda_array_interface__), else None."""
    if isinstance(obj, cm.DeviceBuffer):
        return obj.bytes
    cai = getattr(obj, "__cuda_array_interface__", None)
    if cai is None:
        return None
    if cai.get("strides") is not None:
        itemsize = int(cai["typestr"][2:])
        expect, strides = itemsize, tuple(cai["strides"])
        for dim, stride in zip(reversed(cai["shape"]), reversed(strides)):
            if dim > 1 and stride != expect:
                return -1
            expect *= dim
    return math.prod(cai["shape"]) * int(cai["typestr"][2:])


def _pointer(obj: Any, name: str, align: int, nbytes: int | None, fix: str) -> int:
    """The address of ``obj`` after checking it is usable for ``nbytes`` (None: unknown) at ``align``."""
    if getattr(obj, "closed", False):
        raise HssError(f"{name} is a closed buffer")
    ptr = cm.device_ptr(obj)
    if ptr == 0:
        raise HssError(f"{name} is a null pointer: pass the device address of {fix}")
    if ptr % align:
        raise HssError(f"{name} ({ptr:#x}) must be {align}-byte aligned ({fix})")
    size = _device_size(obj)
    if size == -1:
        raise HssError(f"{name} must be contiguous ({fix})")
    if nbytes is not None and size is not None and size < nbytes:
        raise HssError(f"{name} holds {size} bytes but {nbytes} are needed ({fix})")
    return ptr


class TiledAttention:
    """Running (m, l, o) state for up to ``dims.max_seqs`` sequences and the kernels that use it.

    ``TiledAttention(ctx, dims)`` (or ``TiledAttention.new(dims)``, the original's name) loads the PTX and
    allocates the state (m, l: f32 [max_seqs*num_q_heads]; o: f32 [max_seqs*num_q_heads, head_dim]; not
    zeroed: ``begin_step`` initialises it) and the split workspace (``dims.workspace_bytes``: one partial
    state per 1024-token unit of a full tile). ``ctx`` None uses the current device's primary context.
    ``close()`` (or leaving a ``with`` block) frees everything once.
    """

    def __init__(self, ctx: cm.CudaCtx | None, dims: TiledAttentionDims) -> None:
        if not isinstance(dims, TiledAttentionDims):
            raise TypeError(f"dims must be a TiledAttentionDims, not {type(dims).__name__}")
        dims.validate()
        self.dims = dims
        self._owned: list[Any] = []
        self._fresh = 0   # sequences begin_step initialised lazily: the next tile's merge writes their state
        self._counts_zeroed = False
        try:
            step_mod = self._own(load_module("paged_decode_attn_tiled", ctx))
            fin_mod = self._own(load_module("attention_finalize", ctx))
            self._step_fn = step_mod.function(PAGED_DECODE_ATTN_TILED.name)
            self._fin_fn = fin_mod.function("attention_finalize")
            self._step_shared = step_shared_bytes(dims.head_dim)
            self._sm_count = cm.multiprocessor_count(ctx)
            if self._step_shared > 48 * 1024:
                self._step_fn.set_max_dynamic_shared(self._step_shared)
            rows = dims.max_seqs * dims.num_q_heads
            self.m = self._own(cm.DeviceBuffer(4 * rows, ctx))
            self.l = self._own(cm.DeviceBuffer(4 * rows, ctx))
            self.o = self._own(cm.DeviceBuffer(4 * rows * dims.head_dim, ctx))
            self._part_ml = self._own(cm.DeviceBuffer(4 * rows * dims.max_units * 2, ctx))
            self._part_o = self._own(cm.DeviceBuffer(4 * rows * dims.max_units * padded_head_dim(dims.head_dim), ctx))
            self._merge_count = self._own(cm.DeviceBuffer(4 * dims.merge_counters, ctx))
        except BaseException:
            self.close()
            raise
        d = dims
        # Prepared once; the hot path only refills the arguments that change per call.
        self._step_pack = PAGED_DECODE_ATTN_TILED.pack(
            part_ml=self._part_ml.ptr, part_o=self._part_o.ptr, m=self.m.ptr, l=self.l.ptr, o=self.o.ptr, out=0,
            merge_count=self._merge_count.ptr, num_q_heads=d.num_q_heads, num_kv_heads=d.num_kv_heads,
            head_dim=d.head_dim, block_size=d.block_size, tile_capacity=d.tile_capacity, gqa_ratio=d.gqa_ratio,
            max_units=d.max_units)
        self._grid_y = d.num_kv_heads * head_groups(d.gqa_ratio)
        self._fin_pack = ATTENTION_FINALIZE.pack(o=self.o.ptr, l=self.l.ptr, num_q_heads=d.num_q_heads,
                                                 head_dim=d.head_dim)

    @classmethod
    def new(cls, dims: TiledAttentionDims, ctx: cm.CudaCtx | None = None) -> "TiledAttention":
        """The original's constructor: allocations only, no stream."""
        return cls(ctx, dims)

    def _own(self, obj: Any) -> Any:
        self._owned.append(obj)
        return obj

    # -- lifetime ------------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return not self._owned

    def close(self) -> None:
        """Free the state buffers and unload the modules; later calls do nothing."""
        owned, self._owned = self._owned, []
        for obj in reversed(owned):
            obj.close()

    def __enter__(self) -> "TiledAttention":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _live(self) -> None:
        if self.closed:
            raise HssError("this TiledAttention is closed")

    def _num_seqs(self, num_seqs: Any) -> int:
        n = as_int("num_seqs", num_seqs)
        if not 0 <= n <= self.dims.max_seqs:
            raise HssError(f"num_seqs ({n}) must be in 0..max_seqs ({self.dims.max_seqs})")
        return n

    # -- layouts -------------------------------------------------------------------------------
    def paged_strides(self) -> tuple[int, int, int]:
        """(blk, tok, kvh) element strides of the NHD page pool bf16 [num_pages, block_size, num_kv_heads, head_dim]."""
        d = self.dims
        return d.block_size * d.num_kv_heads * d.head_dim, d.num_kv_heads * d.head_dim, d.head_dim

    def scratch_pool_strides(self, group_stride_bytes: int | None = None) -> tuple[int, int, int, int]:
        """(blk, tok, kvh, v_offset) element strides of the HSS scratch slots (SPEC §7.4).

        A slot is ``[K|V][kv_head][stripe]``, each stripe ``group_stride_bytes`` long (default: unpadded,
        block_size*head_dim*2; the swap substrate pads it to 4 KiB) holding bf16 [block_size, head_dim].
        Pass ``k_pool`` = the pool base and ``v_pool`` = base + ``v_offset`` elements (2*v_offset bytes).
        """
        d = self.dims
        gs = d.stripe_bytes if group_stride_bytes is None else as_int("group_stride_bytes", group_stride_bytes)
        if gs % 2:
            raise HssError(f"group_stride_bytes ({gs}) must be even (a whole number of bf16 elements)")
        if gs < d.stripe_bytes:
            raise HssError(f"group_stride_bytes ({gs}) is smaller than one stripe (block_size*head_dim*2 = "
                           f"{d.stripe_bytes} bytes)")
        g = gs // 2
        return 2 * d.num_kv_heads * g, d.head_dim, g, d.num_kv_heads * g

    # -- the step ------------------------------------------------------------------------------
    def begin_step(self, stream: Any, num_seqs: int) -> None:
        """Start a decode step for ``num_seqs`` sequences on ``stream`` (or a CudaCtx's stream): their state
        becomes m = -inf, l = 0, o = 0. Nothing is queued here: the step's first ``step_tile`` (on the same
        number of sequences) starts from that state without reading the buffers, else three memsets are
        queued first on the stream of whichever call comes next (``step_tile`` or ``finalize``)."""
        self.begin_step_on_stream(_stream(stream), num_seqs)

    def begin_step_on_stream(self, stream: Any, num_seqs: int) -> None:
        """:meth:`begin_step` on an explicit stream."""
        self._live()
        s = cm.stream_handle(stream)
        self._fresh = self._num_seqs(num_seqs)
        if self._fresh and not self._counts_zeroed:   # the merge leaves its counters at zero; they start there once
            cm.memset_d32_async(self._merge_count, 0, self.dims.merge_counters, s)
            self._counts_zeroed = True

    def _initialise(self, s: int) -> None:
        """Queue the initial state begin_step promised (when no step_tile writes it)."""
        rows, self._fresh = self._fresh * self.dims.num_q_heads, 0
        if rows:
            cm.memset_d32_async(self.m, NEG_INF_BITS, rows, s)
            cm.memset_d32_async(self.l, 0, rows, s)
            cm.memset_d32_async(self.o, 0, rows * self.dims.head_dim, s)

    def step_tile(self, stream: Any, q: Any, k_pool: Any, v_pool: Any, tile_blocks: Any, tile_block_counts: Any,
                  num_seqs: int, blk_stride: int, tok_stride: int, kvh_stride: int,
                  last_block_valid_slots: int, output: Any = None) -> None:
        """Apply one tile of KV pages to every sequence's running state (one launch on ``stream``).

        ``q`` bf16 [num_seqs, num_q_heads, head_dim]; ``k_pool``/``v_pool`` bf16 pools whose element
        (page, tok, kv_head, d) is at page*blk_stride + tok*tok_stride + kv_head*kvh_stride + d (strides in
        elements, >= 0: see :meth:`paged_strides`, :meth:`scratch_pool_strides`); ``tile_blocks`` i32
        [num_seqs, tile_capacity] page ids in order; ``tile_block_counts`` i32 [num_seqs] entries used (the
        device clamps them to 0..tile_capacity; page ids are not checked). Every entry contributes
        block_size tokens except each sequence's last entry of this tile, which contributes
        min(last_block_valid_slots, block_size) (0 or less: nothing).

        ``output`` (optional) bf16 [num_seqs, num_q_heads, head_dim]: the same launch also writes what
        :meth:`finalize` would write after this tile (same bits), so a step whose last tile passes it needs no
        finalize. The state is kept either way: more tiles may follow.
        """
        self.step_tile_on_stream(_stream(stream), q, k_pool, v_pool, tile_blocks, tile_block_counts, num_seqs,
                                 blk_stride, tok_stride, kvh_stride, last_block_valid_slots, output)

    def step_tile_on_stream(self, stream: Any, q: Any, k_pool: Any, v_pool: Any, tile_blocks: Any,
                            tile_block_counts: Any, num_seqs: int, blk_stride: int, tok_stride: int,
                            kvh_stride: int, last_block_valid_slots: int, output: Any = None) -> None:
        """:meth:`step_tile` on an explicit stream."""
        self._live()
        d = self.dims
        s = cm.stream_handle(stream)
        n = self._num_seqs(num_seqs)
        strides = {"blk_stride": blk_stride, "tok_stride": tok_stride, "kvh_stride": kvh_stride}
        for name, value in strides.items():
            v = as_int(name, value)
            if not 0 <= v < 2**62:
                raise HssError(f"{name} ({v}) must be >= 0 (element strides of the pool; see paged_strides() "
                               "and scratch_pool_strides())")
            strides[name] = v
        lbvs = as_int("last_block_valid_slots", last_block_valid_slots)
        if not -2**31 <= lbvs <= _I32_MAX:
            raise HssError(f"last_block_valid_slots ({lbvs}) must fit in int32 (pass block_size for full pages)")
        rows = n * d.num_q_heads
        out = 0 if output is None else _pointer(output, "output", 2, 2 * rows * d.head_dim,
                                                 "bf16 [num_seqs, num_q_heads, head_dim]")
        p = self._step_pack
        p.set(_Q, _pointer(q, "q", 2, 2 * rows * d.head_dim, "bf16 [num_seqs, num_q_heads, head_dim]"))
        p.set(_K, _pointer(k_pool, "k_pool", 2, None, "the bf16 K page pool"))
        p.set(_V, _pointer(v_pool, "v_pool", 2, None, "the bf16 V page pool"))
        p.set(_TABLE, _pointer(tile_blocks, "tile_blocks", 4, 4 * n * d.tile_capacity,
                               "i32 [num_seqs, tile_capacity] page ids"))
        p.set(_COUNTS, _pointer(tile_block_counts, "tile_block_counts", 4, 4 * n, "i32 [num_seqs] entry counts"))
        p.set(_BLK, strides["blk_stride"])
        p.set(_TOK, strides["tok_stride"])
        p.set(_KVH, strides["kvh_stride"])
        p.set(_LBVS, lbvs)
        self._launch(s, n, out)

    def _next_tile(self, s: int, tile_blocks: int, tile_block_counts: int, last_block_valid_slots: int,
                   output: int = 0) -> None:
        """Another tile of ONE sequence with the q, pools and strides of the last ``step_tile`` (hss.swap's hot
        loop: those were checked there); only the tile's table, count, last_block_valid_slots and output
        (an address or 0) change."""
        p = self._step_pack
        p.set(_TABLE, tile_blocks)
        p.set(_COUNTS, tile_block_counts)
        p.set(_LBVS, last_block_valid_slots)
        self._launch(s, 1, output)

    def _launch(self, s: int, n: int, out: int) -> None:
        if n == 0:
            return
        if self._fresh and self._fresh != n:
            self._initialise(s)
        p = self._step_pack
        p.set(_OUT, out)
        p.set(_FRESH, 1 if self._fresh else 0)
        self._fresh = 0
        z = step_grid_z(self.dims.max_units, n * self._grid_y, self._sm_count)
        cm.launch_kernel(self._step_fn, (n, self._grid_y, z), (STEP_THREADS, 1, 1), self._step_shared, s, p)

    def finalize(self, stream: Any, output: Any, num_seqs: int) -> None:
        """Write ``output`` bf16 [num_seqs, num_q_heads, head_dim] = o / l (0 where l == 0) on ``stream``."""
        self.finalize_on_stream(_stream(stream), output, num_seqs)

    def finalize_on_stream(self, stream: Any, output: Any, num_seqs: int) -> None:
        """:meth:`finalize` on an explicit stream."""
        self._live()
        d = self.dims
        s = cm.stream_handle(stream)
        n = self._num_seqs(num_seqs)
        out = _pointer(output, "output", 2, 2 * n * d.num_q_heads * d.head_dim,
                       "bf16 [num_seqs, num_q_heads, head_dim]")
        if self._fresh:
            self._initialise(s)
        if n == 0:
            return
        self._fin_pack.set(2, out)
        cm.launch_kernel(self._fin_fn, (n, d.num_q_heads, 1), (FINALIZE_THREADS, 1, 1), 0, s, self._fin_pack)
