"""Tiled (streaming) decode attention (SPEC §6): online-softmax state carried across tile launches.

A decode step is ``begin_step`` (m := -inf, l := 0, o := 0), one ``step_tile`` per tile of KV pages (the
pages may be streamed into a small scratch pool between tiles), then ``finalize`` (out = o / l in bf16).
A tile is split into fixed 64-token chunks, each one's partial softmax state computed by its own CTA (all
query heads of a kv head sharing the staged K/V), then merged in chunk order into the running state (SPEC
§0 allows split and merge). A tile's result depends only on its token list: the same pages in the same
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
from hss._driver import HssError
from hss.kernels.attention import (ATTENTION_FINALIZE, FINALIZE_THREADS, MAX_HEAD_DIM, MERGE_DIMS, MERGE_THREADS,
                                   PAGED_DECODE_ATTN_MERGE, PAGED_DECODE_ATTN_TILED, STEP_THREADS, max_chunks,
                                   step_grid_z, step_shared_bytes)
from hss.ptx import load_module
from hss._params import as_int

__all__ = ["TiledAttentionDims", "TiledAttention"]

NEG_INF_BITS = 0xFF800000   # f32 -inf, the initial running max
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
        if self.num_q_heads > 65535:
            raise HssError(f"TiledAttentionDims.num_q_heads ({self.num_q_heads}) must be <= 65535 (grid.y)")
        if self.tile_capacity * self.block_size > _I32_MAX:
            raise HssError(f"TiledAttentionDims.tile_capacity * block_size ({self.tile_capacity} * {self.block_size}) "
                           f"must fit in int32: use smaller tiles")
        if self.max_chunks > 65535:
            raise HssError(f"TiledAttentionDims.tile_capacity * block_size ({self.tile_capacity} * {self.block_size}) "
                           f"must be <= {65535 * 64} tokens (65535 chunks of 64 on grid.z): use smaller tiles")
        if self.max_seqs > _I32_MAX:
            raise HssError(f"TiledAttentionDims.max_seqs ({self.max_seqs}) must be < 2^31 (grid.x)")

    @property
    def gqa_ratio(self) -> int:
        """Query heads per KV head."""
        return self.num_q_heads // self.num_kv_heads

    @property
    def max_chunks(self) -> int:
        """64-token chunks (partial states per sequence and query head) of a full tile."""
        return max_chunks(self.tile_capacity, self.block_size)

    @property
    def workspace_bytes(self) -> int:
        """Device bytes of the partial states and merge counters a :class:`TiledAttention` allocates."""
        rows = self.max_seqs * self.num_q_heads
        return 4 * rows * (self.max_chunks * (self.head_dim + 2) + 1)

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
    state per 64-token chunk of a full tile). ``ctx`` None uses the current device's primary context.
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
            self._merge_fn = step_mod.function(PAGED_DECODE_ATTN_MERGE.name)
            self._fin_fn = fin_mod.function("attention_finalize")
            self._step_shared = step_shared_bytes(dims.head_dim)
            self._sm_count = cm.multiprocessor_count(ctx)
            if self._step_shared > 48 * 1024:
                self._step_fn.set_max_dynamic_shared(self._step_shared)
            rows = dims.max_seqs * dims.num_q_heads
            self.m = self._own(cm.DeviceBuffer(4 * rows, ctx))
            self.l = self._own(cm.DeviceBuffer(4 * rows, ctx))
            self.o = self._own(cm.DeviceBuffer(4 * rows * dims.head_dim, ctx))
            self._part_ml = self._own(cm.DeviceBuffer(4 * rows * dims.max_chunks * 2, ctx))
            self._part_o = self._own(cm.DeviceBuffer(4 * rows * dims.max_chunks * dims.head_dim, ctx))
            self._merge_count = self._own(cm.DeviceBuffer(4 * rows, ctx))
        except BaseException:
            self.close()
            raise
        d = dims
        # Prepared once; the hot path only refills the arguments that change per call.
        self._step_pack = PAGED_DECODE_ATTN_TILED.pack(
            part_ml=self._part_ml.ptr, part_o=self._part_o.ptr, num_q_heads=d.num_q_heads,
            num_kv_heads=d.num_kv_heads, head_dim=d.head_dim, block_size=d.block_size, tile_capacity=d.tile_capacity,
            gqa_ratio=d.gqa_ratio, max_chunks=d.max_chunks)
        self._merge_pack = PAGED_DECODE_ATTN_MERGE.pack(
            part_ml=self._part_ml.ptr, part_o=self._part_o.ptr, m=self.m.ptr, l=self.l.ptr, o=self.o.ptr,
            merge_count=self._merge_count.ptr, num_q_heads=d.num_q_heads, head_dim=d.head_dim,
            block_size=d.block_size, tile_capacity=d.tile_capacity, max_chunks=d.max_chunks)
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
            cm.memset_d32_async(self._merge_count, 0, self.dims.max_seqs * self.dims.num_q_heads, s)
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
                  last_block_valid_slots: int) -> None:
        """Apply one tile of KV pages to every sequence's running state (two launches on ``stream``: the
        split kernel, then the merge).

        ``q`` bf16 [num_seqs, num_q_heads, head_dim]; ``k_pool``/``v_pool`` bf16 pools whose element
        (page, tok, kv_head, d) is at page*blk_stride + tok*tok_stride + kv_head*kvh_stride + d (strides in
        elements, >= 0: see :meth:`paged_strides`, :meth:`scratch_pool_strides`); ``tile_blocks`` i32
        [num_seqs, tile_capacity] page ids in order; ``tile_block_counts`` i32 [num_seqs] entries used (the
        device clamps them to 0..tile_capacity; page ids are not checked). Every entry contributes
        block_size tokens except each sequence's last entry of this tile, which contributes
        min(last_block_valid_slots, block_size) (0 or less: nothing).
        """
        self.step_tile_on_stream(_stream(stream), q, k_pool, v_pool, tile_blocks, tile_block_counts, num_seqs,
                                 blk_stride, tok_stride, kvh_stride, last_block_valid_slots)

    def step_tile_on_stream(self, stream: Any, q: Any, k_pool: Any, v_pool: Any, tile_blocks: Any,
                            tile_block_counts: Any, num_seqs: int, blk_stride: int, tok_stride: int,
                            kvh_stride: int, last_block_valid_slots: int) -> None:
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
        p = self._step_pack
        p.set(0, _pointer(q, "q", 2, 2 * rows * d.head_dim, "bf16 [num_seqs, num_q_heads, head_dim]"))
        p.set(1, _pointer(k_pool, "k_pool", 2, None, "the bf16 K page pool"))
        p.set(2, _pointer(v_pool, "v_pool", 2, None, "the bf16 V page pool"))
        p.set(3, _pointer(tile_blocks, "tile_blocks", 4, 4 * n * d.tile_capacity,
                          "i32 [num_seqs, tile_capacity] page ids"))
        counts = _pointer(tile_block_counts, "tile_block_counts", 4, 4 * n, "i32 [num_seqs] entry counts")
        p.set(4, counts)
        p.set(14, strides["blk_stride"])
        p.set(15, strides["tok_stride"])
        p.set(16, strides["kvh_stride"])
        p.set(17, lbvs)
        self._launch(s, n, counts, lbvs)

    def _next_tile(self, s: int, tile_blocks: int, tile_block_counts: int, last_block_valid_slots: int) -> None:
        """Another tile of ONE sequence with the q, pools and strides of the last ``step_tile`` (hss.swap's hot
        loop: those were checked there); only the tile's table, count and last_block_valid_slots change."""
        p = self._step_pack
        p.set(3, tile_blocks)
        p.set(4, tile_block_counts)
        p.set(17, last_block_valid_slots)
        self._launch(s, 1, tile_block_counts, last_block_valid_slots)

    def _launch(self, s: int, n: int, counts: int, lbvs: int) -> None:
        d = self.dims
        mp = self._merge_pack
        mp.set(0, counts)
        mp.set(12, lbvs)
        if n == 0:
            return
        if self._fresh and self._fresh != n:
            self._initialise(s)
        mp.set(13, 1 if self._fresh else 0)
        self._fresh = 0
        z = step_grid_z(d.max_chunks, n * d.num_kv_heads, self._sm_count)
        cm.launch_kernel(self._step_fn, (n, d.num_kv_heads, z), (STEP_THREADS, 1, 1), self._step_shared, s,
                         self._step_pack)
        cm.launch_kernel(self._merge_fn, (n, d.num_q_heads, -(-d.head_dim // MERGE_DIMS)), (MERGE_THREADS, 1, 1), 0,
                         s, mp)

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
