"""Tiled (streaming) decode attention (docs/design.md §6): online-softmax state carried across tile launches.

A decode step is ``begin_step`` (m := -inf, l := 0, o := 0), one ``step_tile`` per tile of KV pages (the
pages may be streamed into a small scratch pool between tiles), then ``finalize`` (out = o / l in bf16).
A tile is split into units (:func:`hss.decls.attention.unit_tokens`: as even a cut into multiples of 64 tokens
as the launch's CTA count wants for one wave, at least 128 or 256 tokens, at most 64 per tile), each one's partial
softmax state computed by one CTA on the tensor cores (its 8 warps each streaming their own 8-token steps; up to 16
query heads of a kv head share the staged K/V, so each kv head is read once), then folded in two levels (groups of
8 units, then the groups) by the
last CTA to finish, in the same launch (docs/design.md §0 allows split and merge). A tile's result depends only on its
token list and the number of sequences in the launch: the same pages in the same tiles give the same bits
whatever the pool layout, ``tile_capacity``, grid.z or the other sequences' pages; another split into tiles
rounds differently (both exact attention within docs/design.md §0). Every call is asynchronous on the
given stream.

Arguments are checked by :mod:`hss._args` before anything is queued (a bad one raises naming the parameter;
``TypeError`` for a wrong type): streams are any form :func:`hss._args.stream` reads (``int`` handles,
:class:`~hss.cuda_min.CudaStream`, ``__cuda_stream__`` objects, a :class:`~hss.cuda_min.CudaCtx` meaning its
stream); device arrays any form :func:`hss._args.pointer` reads (``int`` addresses,
:class:`~hss.cuda_min.DeviceBuffer` / ``DeviceView``, torch tensors, ``__cuda_array_interface__`` and DLPack
objects), their size, alignment and dtype checked where the object says them (bf16 q, pools and output, i32
tables and counts), the output writable. ``step_tile`` and ``step_tile_tokens`` remember the argument sets whose
checks passed and skip them when one comes again (docs/design.md §23).
"""
from __future__ import annotations

import contextlib
import functools
import itertools
from dataclasses import dataclass
from typing import Any

from hss import _args
from hss import cuda_min as cm
from hss._util import Closeable
from hss.cuda._launch import launcher
from hss.cuda.ptx import load_module
from hss.decls.attention import (
    ATTENTION_FINALIZE,
    FINALIZE_THREADS,
    MAX_HEAD_DIM,
    STEP_THREADS,
    counters,
    head_groups,
    max_units,
    padded_head_dim,
    rope_declaration,
    step_declaration,
    step_grid_z,
    step_shared_bytes,
)
from hss.errors import HssError

__all__ = ["TiledAttentionDims", "TiledAttention", "TileStep"]

NEG_INF_BITS = 0xFF800000   # f32 -inf, the initial running max
_I32_MAX = 2**31 - 1
_STRIDE_MAX = 2**62 - 1   # element strides (i64 parameters; times 2 bytes, addresses stay in range)
_NO_OUTPUT = object()     # output=None's place in a remembered tile's key (no memo key equals it)
_memo, _no_memo, _RANGES = _args.MEMO_KEYS.get, _args.no_memo_key, _args.RANGES
REMEMBERED_TILES = 256    # argument sets a TiledAttention remembers (docs/design.md §23)


@dataclass(frozen=True)
class TiledAttentionDims:
    """Sizes of a :class:`TiledAttention` (docs/design.md §6.1).

    ``max_seqs`` sequences per step, ``num_q_heads`` / ``num_kv_heads`` (GQA), ``head_dim`` (<= 256),
    ``block_size`` tokens per KV page, ``tile_capacity`` pages per sequence per tile.
    """

    max_seqs: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    tile_capacity: int

    def __post_init__(self) -> None:
        _args.int_fields(self)   # numpy integers become Python ints; float, bool, str: TypeError naming the field

    def validate(self) -> None:
        """Raise :class:`HssError` naming the first field that the kernels cannot take (the fields are ints by
        construction)."""
        for name in ("max_seqs", "num_q_heads", "num_kv_heads", "head_dim", "block_size", "tile_capacity"):
            v = getattr(self, name)
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
                           f"* ceil(gqa_ratio/16) too (grid.y)")
        if self.tile_capacity * self.block_size > _I32_MAX:
            raise HssError(f"TiledAttentionDims.tile_capacity * block_size ({self.tile_capacity} * {self.block_size}) "
                           f"must fit in int32: use smaller tiles")
        if self.max_seqs > _I32_MAX:
            raise HssError(f"TiledAttentionDims.max_seqs ({self.max_seqs}) must be < 2^31 (grid.x)")

    @property
    def gqa_ratio(self) -> int:
        """Query heads per KV head."""
        return self.num_q_heads // self.num_kv_heads

    @property
    def max_units(self) -> int:
        """Units (partial states per sequence and query head) a tile can have: at most 64."""
        return max_units(self.tile_capacity, self.block_size, padded_head_dim(self.head_dim))

    @property
    def merge_counters(self) -> int:
        """Fold counters: nine per (sequence, kv head, group of 16 query heads)."""
        return counters(self.max_seqs, self.num_kv_heads, self.gqa_ratio)

    @property
    def workspace_bytes(self) -> int:
        """Device bytes of the partial states and fold counters a :class:`TiledAttention` allocates."""
        rows = self.max_seqs * self.num_q_heads
        return 4 * (rows * self.max_units * (padded_head_dim(self.head_dim) + 2) + self.merge_counters)

    @property
    def stripe_bytes(self) -> int:
        """Bytes of one (page, kind, kv_head) stripe of bf16 [block_size, head_dim]: the unpadded group."""
        return 2 * self.block_size * self.head_dim


class TiledAttention(Closeable):
    """Running (m, l, o) state for up to ``dims.max_seqs`` sequences and the kernels that use it.

    ``TiledAttention(ctx, dims)`` (or ``TiledAttention.new(dims)``, the original's name) loads the PTX and
    allocates the state (m, l: f32 [max_seqs*num_q_heads]; o: f32 [max_seqs*num_q_heads, head_dim]; not
    zeroed: ``begin_step`` initialises it) and the split workspace (``dims.workspace_bytes``: one partial
    state per unit of a full tile, at most 64). ``ctx`` None uses the current device's primary context.
    ``close()`` (or leaving a ``with`` block) frees everything once.

    ``begin_step`` / ``begin_step_on_stream`` (and ``step_tile``, ``finalize``) are one method each under the
    original's two names: the stream may be any stream form, a CudaCtx meaning its stream.

    ``overlap_tiles=True`` (opt-in; compute capability 9.0 or newer: module ``paged_decode_attn_pdl``): a step's
    tiles after its first (since ``begin_step``, on the same stream, with no finalize between) are launched with
    programmatic stream serialization, so each may stream its K/V while the tile before it is still folding; it
    waits for that tile to complete before it touches the workspace, the counters, the state or the output (the
    same bits as without). The contract that buys: between two tiles of one step the stream runs no kernel of
    yours that writes what a later tile of the step reads (its pages, table, counts, q); copies and event waits in
    between are fine.
    """

    def __init__(self, ctx: cm.CudaCtx | None, dims: TiledAttentionDims, overlap_tiles: bool = False) -> None:
        if not isinstance(dims, TiledAttentionDims):
            raise TypeError(f"dims must be a TiledAttentionDims, not {type(dims).__name__}")
        if type(overlap_tiles) is not bool:
            raise TypeError(f"overlap_tiles must be a bool, not {type(overlap_tiles).__name__}")
        dims.validate()
        self.dims = dims
        self.overlap_tiles = overlap_tiles
        self._closed = True
        self._owned = contextlib.ExitStack()
        self._fresh = 0   # sequences begin_step initialised lazily: the next tile's merge writes their state
        self._counts_zeroed = False   # the fold counters are zeroed once, on the stream of the first launch
        self._begun = False           # tiles and finalize need a begin_step first
        own = self._owned.enter_context
        try:
            self._step_decl, self._rope_decl = step_declaration(dims.head_dim), rope_declaration(dims.head_dim)
            module = own(load_module("paged_decode_attn_pdl" if overlap_tiles else "paged_decode_attn_tiled", ctx))
            self._step_fn = module.function(self._step_decl.name)
            self._rope_fn = module.function(self._rope_decl.name)
            self._fin_fn = own(load_module("attention_finalize", ctx)).function(ATTENTION_FINALIZE.name)
            self._step_shared = step_shared_bytes(dims.head_dim)
            if self._step_shared > 48 * 1024:
                self._step_fn.set_max_dynamic_shared(self._step_shared)
                self._rope_fn.set_max_dynamic_shared(self._step_shared)
            rows = dims.max_seqs * dims.num_q_heads
            self.m = own(cm.DeviceBuffer(4 * rows, ctx))
            self.l = own(cm.DeviceBuffer(4 * rows, ctx))
            self.o = own(cm.DeviceBuffer(4 * rows * dims.head_dim, ctx))
            self._part_ml = own(cm.DeviceBuffer(4 * rows * dims.max_units * 2, ctx))
            self._part_o = own(cm.DeviceBuffer(4 * rows * dims.max_units * padded_head_dim(dims.head_dim), ctx))
            self._merge_count = own(cm.DeviceBuffer(4 * dims.merge_counters, ctx))
            self._own = _args.OwnedRanges()   # an output into these would overwrite the state or the workspace
            for buf, label in ((self.m, "m"), (self.l, "l"), (self.o, "o"), (self._part_ml, "partials"),
                               (self._part_o, "partials"), (self._merge_count, "fold counters")):
                self._own.add(buf.ptr, buf.bytes, f"its {label}")
            self._prepare()
        except BaseException:
            self._owned.close()
            raise
        self._closed = False

    def _prepare(self) -> None:
        """The hot paths' prepared state: packs (refilled by slot), launchers and pointer checks."""
        ptr_arg = functools.partial(_args.pointer_arg, device=self.m.device)   # refuses other devices' memory
        d = self.dims
        self._step_pack = pack = self._step_decl.pack(
            part_ml=self._part_ml.ptr, part_o=self._part_o.ptr, m=self.m.ptr, l=self.l.ptr, o=self.o.ptr,
            merge_count=self._merge_count.ptr, num_q_heads=d.num_q_heads, num_kv_heads=d.num_kv_heads,
            head_dim=d.head_dim, block_size=d.block_size, tile_capacity=d.tile_capacity, gqa_ratio=d.gqa_ratio,
            max_units=d.max_units)
        (self._q_slot, self._k_slot, self._v_slot, self._table_slot, self._counts_slot, self._out_slot,
         self._blk_slot, self._tok_slot, self._kvh_slot, self._lbvs_slot, self._fresh_slot) = (
            pack.slot(name) for name in ("q", "k_pool", "v_pool", "tile_blocks", "tile_block_counts", "out",
                                         "blk_stride", "tok_stride", "kvh_stride", "last_block_valid_slots",
                                         "fresh"))
        self._run_step = launcher(self._step_fn, (STEP_THREADS, 1, 1), self._step_shared, pack)
        # overlap_tiles: the launch of a step's later tiles on one stream (None: every tile plain)
        self._run_step_after = launcher(self._step_fn, (STEP_THREADS, 1, 1), self._step_shared, pack,
                                        programmatic=True) if self.overlap_tiles else None
        self._rope_pack = rpack = self._rope_decl.pack(
            part_ml=self._part_ml.ptr, part_o=self._part_o.ptr, m=self.m.ptr, l=self.l.ptr, o=self.o.ptr,
            merge_count=self._merge_count.ptr, num_q_heads=d.num_q_heads, num_kv_heads=d.num_kv_heads,
            head_dim=d.head_dim, block_size=d.block_size, tile_capacity=d.tile_capacity, gqa_ratio=d.gqa_ratio,
            max_units=d.max_units)
        self._rope_slots = tuple(rpack.slot(name) for name in (
            "q", "k_pool", "v_pool", "blk_stride", "tok_stride", "kvh_stride", "tile_blocks", "tile_block_counts",
            "last_block_valid_slots", "out", "fresh", "cos_t", "sin_t", "max_pos"))
        self._run_rope = launcher(self._rope_fn, (STEP_THREADS, 1, 1), self._step_shared, rpack)
        self._run_rope_after = launcher(self._rope_fn, (STEP_THREADS, 1, 1), self._step_shared, rpack,
                                        programmatic=True) if self.overlap_tiles else None
        self._grid_y = d.num_kv_heads * head_groups(d.gqa_ratio)
        self._hdp = padded_head_dim(d.head_dim)
        self._grid_z: dict[int, int] = {}   # num_seqs -> grid.z, filled at each count's first launch
        self._remembered = _args.Remembered(REMEMBERED_TILES)   # tile calls' checked arguments, by their keys
        self._recall = self._remembered.get
        self._packed: tuple | None = None   # the remembered tile whose values the pack's tile slots hold (None: other)
        self._filled_by = 0                 # the serial of the TileStep whose q, pools, strides the pack holds
        self._tile_stream = -1              # the stream of this step's last tile (-1: none since begin_step)
        self._fin_pack = pack = ATTENTION_FINALIZE.pack(o=self.o.ptr, l=self.l.ptr, num_q_heads=d.num_q_heads,
                                                        head_dim=d.head_dim)
        self._fin_out_slot = pack.slot("out")
        self._run_fin = launcher(self._fin_fn, (FINALIZE_THREADS, 1, 1), 0, pack)
        # per-call sizes: bytes per sequence of q / output and of a table row; a pool needs one token row of
        # every kv head at least (page 0, slot 0: (num_kv_heads - 1) * kvh_stride + head_dim elements)
        self._max_seqs = d.max_seqs
        self._row_bytes, self._table_bytes = 2 * d.num_q_heads * d.head_dim, 4 * d.tile_capacity
        self._pool_heads, self._head_dim = d.num_kv_heads - 1, d.head_dim
        shape = "bf16 [num_seqs, num_q_heads, head_dim]"
        self._q_arg = ptr_arg("q", None, 2, "bf16", what=f"the {shape} query")
        self._out_arg = ptr_arg("output", None, 2, "bf16", write=True, what=f"a {shape} output")
        self._k_arg = ptr_arg("k_pool", None, 2, "bf16",
                                        what="the bf16 K page pool (at least one token row of every kv head)")
        self._v_arg = ptr_arg("v_pool", None, 2, "bf16",
                                        what="the bf16 V page pool (at least one token row of every kv head)")
        self._table_arg = ptr_arg("tile_blocks", None, 4, "i32",
                                            what="i32 [num_seqs, tile_capacity] page ids")
        self._counts_arg = ptr_arg("tile_block_counts", None, 4, "i32", what="i32 [num_seqs] entry counts")
        self._qkv_bytes = 2 * (d.num_q_heads + 2 * d.num_kv_heads) * d.head_dim   # per sequence
        self._qkv_arg = ptr_arg("qkv", None, 2, "bf16",
                                what="bf16 [num_seqs, num_q_heads + 2 num_kv_heads, head_dim] rows (q | k | v)")
        self._cos_arg = ptr_arg("cos", None, 4, "f32", what="the f32 [max_pos, head_dim / 2] cos table")
        self._sin_arg = ptr_arg("sin", None, 4, "f32", what="the f32 [max_pos, head_dim / 2] sin table")
        self._kw_arg = ptr_arg("k_pool", None, 2, "bf16", write=True,
                               what="the bf16 K page pool (the rope tile writes its newest token's rows)")
        self._vw_arg = ptr_arg("v_pool", None, 2, "bf16", write=True,
                               what="the bf16 V page pool (the rope tile writes its newest token's rows)")

    @classmethod
    def new(cls, dims: TiledAttentionDims, ctx: cm.CudaCtx | None = None) -> TiledAttention:
        """The original's constructor: allocations only, no stream."""
        return cls(ctx, dims)

    # -- lifetime ------------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Free the state buffers and unload the modules (every part, even if one release raises); later calls
        do nothing."""
        self._closed = True
        self._remembered.clear()
        self._owned.close()

    def _live(self) -> None:
        if self._closed:
            raise HssError("this TiledAttention is closed")

    # -- argument checks off the fast paths ----------------------------------------------------
    def _num_seqs(self, num_seqs: Any) -> int:
        return _args.as_int("num_seqs", num_seqs, 0, self._max_seqs, f"at most max_seqs ({self._max_seqs}) per step")

    @staticmethod
    def _strides(blk: Any, tok: Any, kvh: Any) -> tuple[int, int, int]:
        why = "element strides of the pool; see paged_strides() and scratch_pool_strides()"
        return (_args.as_int("blk_stride", blk, 0, _STRIDE_MAX, why),
                _args.as_int("tok_stride", tok, 0, _STRIDE_MAX, why),
                _args.as_int("kvh_stride", kvh, 0, _STRIDE_MAX, why))

    @staticmethod
    def _lbvs(value: Any) -> int:
        return _args.as_int("last_block_valid_slots", value, -2**31, _I32_MAX,
                            "an int32 (pass block_size for full pages)")

    # -- layouts -------------------------------------------------------------------------------
    def paged_strides(self) -> tuple[int, int, int]:
        """(blk, tok, kvh) element strides of the NHD page pool bf16 [num_pages, block_size, num_kv_heads, head_dim]."""
        d = self.dims
        return d.block_size * d.num_kv_heads * d.head_dim, d.num_kv_heads * d.head_dim, d.head_dim

    def scratch_pool_strides(self, group_stride_bytes: int | None = None) -> tuple[int, int, int, int]:
        """(blk, tok, kvh, v_offset) element strides of the HSS scratch slots (docs/design.md §7.4).

        A slot is ``[K|V][kv_head][stripe]``, each stripe ``group_stride_bytes`` long (default: unpadded,
        block_size*head_dim*2; the swap substrate pads it to 4 KiB) holding bf16 [block_size, head_dim].
        Pass ``k_pool`` = the pool base and ``v_pool`` = base + ``v_offset`` elements (2*v_offset bytes).
        """
        d = self.dims
        gs = d.stripe_bytes if group_stride_bytes is None else _args.as_int("group_stride_bytes", group_stride_bytes)
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
        queued first on the stream of whichever call comes next (``step_tile`` or ``finalize``).
        (Also ``begin_step_on_stream``.)"""
        if self._closed:
            self._live()
        if type(stream) is not int or stream < 0:   # (an int handle >= 0 passes hss._args.stream as it is)
            _args.stream(stream)   # checked (nothing is queued on it)
        n = num_seqs if type(num_seqs) is int and 0 <= num_seqs <= self._max_seqs else self._num_seqs(num_seqs)
        self._fresh = n
        self._begun = True
        self._tile_stream = -1   # no tile of this step yet: its first launch is a plain one

    begin_step_on_stream = begin_step

    def begin_tiles(self, stream: Any, q: Any, k_pool: Any, v_pool: Any, num_seqs: int, blk_stride: int,
                    tok_stride: int, kvh_stride: int) -> TileStep:
        """``begin_step`` plus what every tile of the step shares, checked once: returns a :class:`TileStep`
        whose ``tile(tile_blocks, tile_block_counts, last_block_valid_slots, output=None)`` queues one tile with
        one prepared launch, checking only the tile's own arguments. The same bits as ``step_tile`` with the same
        arguments (it is the same launch)."""
        if self._closed:
            self._live()
        s = _args.stream(stream)
        n = num_seqs if type(num_seqs) is int and 0 <= num_seqs <= self._max_seqs else self._num_seqs(num_seqs)
        blk, tok, kvh = self._strides(blk_stride, tok_stride, kvh_stride)
        q_bytes = n * self._row_bytes
        qp = self._q_arg(q, s, q_bytes)
        pool_bytes = 2 * (self._pool_heads * kvh + self._head_dim)
        kp = self._k_arg(k_pool, s, pool_bytes)
        vp = self._v_arg(v_pool, s, pool_bytes)
        self.begin_step(s, n)
        return TileStep(self, s, n, qp, kp, vp, blk, tok, kvh, (k_pool, v_pool, pool_bytes))

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
        """Apply one tile of KV pages to every sequence's running state (one launch on ``stream``; also
        ``step_tile_on_stream``).

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
        if self._closed:
            self._live()
        s = stream if type(stream) is int and stream >= 0 else _args.stream(stream)
        self._tile(s, num_seqs, q, k_pool, v_pool, tile_blocks, tile_block_counts, blk_stride, tok_stride, kvh_stride,
                   last_block_valid_slots, output, 0)

    step_tile_on_stream = step_tile

    def step_tile_tokens(self, stream: Any, q: Any, k_pool: Any, v_pool: Any, tile_blocks: Any, token_counts: Any,
                         num_seqs: int, blk_stride: int, tok_stride: int, kvh_stride: int, token_offset: int = 0,
                         output: Any = None) -> None:
        """:meth:`step_tile` whose length the device holds (:meth:`TileStep.tile_tokens`, without starting a step):
        sequence i attends the first clamp(token_counts[i] - token_offset, 0, tile_capacity * block_size) tokens of
        its listed pages. A tile of a step that another call began (e.g. the newest, still-open page after a tile
        of complete pages): capturable while the counts change."""
        if self._closed:
            self._live()
        s = stream if type(stream) is int and stream >= 0 else _args.stream(stream)
        self._tile(s, num_seqs, q, k_pool, v_pool, tile_blocks, token_counts, blk_stride, tok_stride, kvh_stride,
                   token_offset, output, 2)

    def queue_checked_tile(self, s: int, n: int, q: int, k_pool: int, v_pool: int, blk: int, tok: int, kvh: int,
                           tile_blocks: int, counts: int, lbvs: int, output: int = 0,
                           token_counts: bool = False) -> None:
        """Internal API for components that checked a tile's arguments once and reuse them (hss.swap's device step):
        :meth:`step_tile` (or, with ``token_counts``, :meth:`step_tile_tokens`, ``lbvs`` the token offset) on a raw
        stream handle with every argument an int the caller has checked as those methods check them."""
        if self._closed:
            self._live()
        self._fill(q, k_pool, v_pool, blk, tok, kvh, tile_blocks, counts, lbvs)
        self._launch(s, n, output, 2 if token_counts else 0)

    def _tile(self, s: int, n: Any, q: Any, k_pool: Any, v_pool: Any, tile_blocks: Any, counts: Any, blk: Any, tok: Any,
              kvh: Any, last: Any, output: Any, mode: int) -> None:
        """step_tile's (mode 0) and step_tile_tokens' (mode 2: ``last`` is the token offset) checks and launch.

        The checks but ``last``'s (it changes from token to token: checked every call) are remembered (docs/design.md
        §23) under a key of the scalars, exact ints only (a bool or float equal to one is refused by the checks), and
        the device arrays' memo keys (an int address its own, decided here without the call); the two modes check the
        same, so they share it."""
        if type(n) is int and type(blk) is int and type(tok) is int and type(kvh) is int:
            key: tuple | None = (   # (hss._args.memo_key of each device array, spelled out for speed)
                _RANGES.generation, s, n, blk, tok, kvh, q if type(q) is int else _memo(type(q), _no_memo)(q),
                k_pool if type(k_pool) is int else _memo(type(k_pool), _no_memo)(k_pool),
                v_pool if type(v_pool) is int else _memo(type(v_pool), _no_memo)(v_pool),
                tile_blocks if type(tile_blocks) is int else _memo(type(tile_blocks), _no_memo)(tile_blocks),
                counts if type(counts) is int else _memo(type(counts), _no_memo)(counts),
                _NO_OUTPUT if output is None else output if type(output) is int else
                _memo(type(output), _no_memo)(output))
            try:
                checked = self._recall(key)
            except TypeError:   # an argument without a memo key (NO_KEY), or an interface's list: not remembered
                key = checked = None
        else:
            key = checked = None
        if checked is None:
            checked = self._remembered.check(key, self._tile_checks, s, n, q, k_pool, v_pool, tile_blocks, counts, blk,
                                             tok, kvh, last, output, mode)
        if mode == 2:
            if type(last) is not int or not 0 <= last <= _I32_MAX:
                last = _args.as_int("token_offset", last, 0, _I32_MAX)
        elif type(last) is not int or not -2**31 <= last <= _I32_MAX:
            last = self._lbvs(last)
        if checked is self._packed:   # a repeat of the last tile call: the pack holds its values
            self._lbvs_slot.value = last
        else:
            n, qp, kp, vp, blk, tok, kvh, tp, cp, out = checked
            self._fill(qp, kp, vp, blk, tok, kvh, tp, cp, last)
            self._packed = checked
        self._launch(s, checked[0], checked[9], mode)

    def _tile_checks(self, s: int, n: Any, q: Any, k_pool: Any, v_pool: Any, tile_blocks: Any, counts: Any, blk: Any,
                     tok: Any, kvh: Any, last: Any, output: Any, mode: int) -> tuple:
        """Every check of a tile call, in order (the sequence count, strides, last_block_valid_slots or token offset,
        then the device arrays): (n, q, k, v, blk, tok, kvh, table, counts, output or 0), checked (``last`` is
        checked again by the caller, which remembers no ``last``)."""
        if not (type(n) is int and 0 <= n <= self._max_seqs):
            n = self._num_seqs(n)
        if not (type(blk) is int and type(tok) is int and type(kvh) is int and 0 <= blk <= _STRIDE_MAX
                and 0 <= tok <= _STRIDE_MAX and 0 <= kvh <= _STRIDE_MAX):
            blk, tok, kvh = self._strides(blk, tok, kvh)
        if mode == 2:
            _args.as_int("token_offset", last, 0, _I32_MAX)
        elif type(last) is not int or not -2**31 <= last <= _I32_MAX:
            self._lbvs(last)
        q_bytes = n * self._row_bytes
        out = 0 if output is None else self._out_arg(output, s, q_bytes)
        if out:
            self._own.check(out, q_bytes, "output", "this TiledAttention")
        qp = self._q_arg(q, s, q_bytes)
        pool_bytes = 2 * (self._pool_heads * kvh + self._head_dim)
        kp = self._k_arg(k_pool, s, pool_bytes)
        vp = self._v_arg(v_pool, s, pool_bytes)
        tp = self._table_arg(tile_blocks, s, n * self._table_bytes)
        cp = self._counts_arg(counts, s, 4 * n)
        return n, qp, kp, vp, blk, tok, kvh, tp, cp, out

    def _fill(self, q: int, k: int, v: int, blk: int, tok: int, kvh: int, table: int, counts: int, lbvs: int,
              owner: int = 0) -> None:
        """The step launch's per-tile slots (checked values). ``owner`` (a TileStep's serial): q, the pools and
        strides are that step's, so they are written only when another filled the pack since (0: always)."""
        self._packed = None
        if not owner or self._filled_by != owner:
            self._q_slot.value = q
            self._k_slot.value = k
            self._v_slot.value = v
            self._blk_slot.value = blk
            self._tok_slot.value = tok
            self._kvh_slot.value = kvh
            self._filled_by = owner
        self._table_slot.value = table
        self._counts_slot.value = counts
        self._lbvs_slot.value = lbvs

    def _next_tile(self, s: int, tile_blocks: int, tile_block_counts: int, last_block_valid_slots: int,
                   output: int = 0) -> None:
        """Another tile of ONE sequence with the q, pools and strides of the last ``step_tile`` (hss.swap's hot
        loop: those were checked there); only the tile's table, count, last_block_valid_slots and output
        (an address or 0) change. ``s`` is a raw stream handle and every argument an int the caller checked."""
        if self._closed:
            self._live()
        self._packed = None
        self._table_slot.value = tile_blocks
        self._counts_slot.value = tile_block_counts
        self._lbvs_slot.value = last_block_valid_slots
        self._launch(s, 1, output)

    def _launch(self, s: int, n: int, out: int, mode: int = 0, rope: bool = False) -> None:
        """Queue one tile: with overlap_tiles, programmatically when the stream's last work is this step's
        previous tile (a launch of this TiledAttention since the step's begin_step, on ``s``, nothing queued
        between by this object)."""
        fresh = self._fresh
        if fresh and fresh == n and self._counts_zeroed:   # a step's first tile, on the sequences begin_step named
            self._fresh = 0                                 # (a plain launch: begin_step forgot the last tile's stream)
            flags = 1 | mode
            run = self._run_rope if rope else self._run_step
        else:
            run, flags = self._plan(s, n, mode, rope)
            if run is None:
                return
        z = self._grid_z.get(n)
        if z is None:   # as many as a tile of the launch has units (any value in 1..max_units: the same bits)
            z = self._grid_z[n] = step_grid_z(self.dims.max_units, n * self._grid_y, self._hdp)
        if rope:
            self._rope_slots[9].value, self._rope_slots[10].value = out, flags
        else:
            self._out_slot.value = out
            self._fresh_slot.value = flags
        run(s, n, self._grid_y, z)
        self._tile_stream = s

    def _plan(self, s: int, n: int, mode: int, rope: bool) -> tuple[Any, int]:
        """A tile launch's prepared launch and fresh/mode flags, once what it needs first is queued (the counters'
        one reset, the initial state begin_step promised); (None, 0): nothing to launch (no sequences)."""
        if not self._begun:
            raise HssError("TiledAttention: a tile before any begin_step; call begin_step(stream, num_seqs) (or "
                           "begin_tiles) first: it sets the state the tiles fold into")
        if n == 0:
            return None, 0
        after = self._tile_stream == s
        if not self._counts_zeroed:   # the fold leaves its counters at zero; they start there once, ordered
            cm.memset_d32_async(self._merge_count, 0, self.dims.merge_counters, s)   # before this launch
            self._counts_zeroed = True
            after = False   # a memset in between: a plain launch
        fresh = self._fresh
        if fresh and fresh != n:
            self._initialise(s)
            after = fresh = 0
        self._fresh = 0
        flags = (1 if fresh else 0) | mode   # mode 2: token counts (tile_tokens)
        if after and self._run_step_after is not None:
            return (self._run_rope_after if rope else self._run_step_after), flags
        return (self._run_rope if rope else self._run_step), flags

    def finalize(self, stream: Any, output: Any, num_seqs: int) -> None:
        """Write ``output`` bf16 [num_seqs, num_q_heads, head_dim] = o / l (0 where l == 0) on ``stream`` (also
        ``finalize_on_stream``)."""
        if self._closed:
            self._live()
        s = _args.stream(stream)
        n = num_seqs if type(num_seqs) is int and 0 <= num_seqs <= self._max_seqs else self._num_seqs(num_seqs)
        out = self._out_arg(output, s, n * self._row_bytes)
        self._own.check(out, n * self._row_bytes, "output", "this TiledAttention")
        if not self._begun:
            raise HssError("TiledAttention.finalize before any begin_step; call begin_step(stream, num_seqs) first")
        if self._fresh:
            self._initialise(s)
        if n == 0:
            return
        self._fin_out_slot.value = out
        self._run_fin(s, n, self.dims.num_q_heads)
        self._tile_stream = -1   # a tile after it follows the finalize kernel: a plain launch

    finalize_on_stream = finalize


_STEP_SERIALS = itertools.count(1)


class TileStep:
    """The tiles of one decode step at launch speed (:meth:`TiledAttention.begin_tiles`): the stream, q, the pools,
    their strides and the sequence count were checked once; :meth:`tile` checks the tile's table and counts (device
    arrays), ``last_block_valid_slots`` and the optional output, refills the prepared launch and queues it."""

    __slots__ = ("_ta", "_s", "_n", "_q", "_k", "_v", "_blk", "_tok", "_kvh", "_table_bytes", "_row_bytes", "_pools",
                 "_rope", "_serial")

    def __init__(self, ta: TiledAttention, s: int, n: int, q: int, k: int, v: int, blk: int, tok: int,
                 kvh: int, pools: tuple = ()) -> None:
        self._ta, self._s, self._n = ta, s, n
        self._q, self._k, self._v, self._blk, self._tok, self._kvh = q, k, v, blk, tok, kvh
        self._table_bytes, self._row_bytes = n * ta._table_bytes, n * ta._row_bytes
        self._pools = pools    # (k_pool, v_pool, bytes) as given: checked writable by the first rope tile
        self._rope: tuple | None = None   # the last rope tile's checked (qkv, cos, sin, max_pos) objects and values
        self._serial = next(_STEP_SERIALS)   # names this step's q, pools and strides in the prepared pack

    def tile(self, tile_blocks: Any, tile_block_counts: Any, last_block_valid_slots: int, output: Any = None) -> None:
        """One tile: ``step_tile``'s ``tile_blocks``, ``tile_block_counts``, ``last_block_valid_slots`` and
        ``output`` (the same meaning), on the step's stream."""
        ta = self._ta
        if ta._closed:
            ta._live()
        lbvs = last_block_valid_slots
        if type(lbvs) is not int or not -2**31 <= lbvs <= _I32_MAX:
            lbvs = ta._lbvs(lbvs)
        self._queue(tile_blocks, tile_block_counts, lbvs, output, 0)

    def tile_tokens(self, tile_blocks: Any, token_counts: Any, token_offset: int = 0, output: Any = None) -> None:
        """One tile whose length the device holds (capturable while it changes): sequence i attends the first
        clamp(token_counts[i] - token_offset, 0, tile_capacity * block_size) tokens of its listed pages (page j of
        ``tile_blocks`` holding its tokens j * block_size ..). ``token_counts``: a device int32 array [num_seqs];
        ``token_offset``: a host int >= 0. Otherwise :meth:`tile` (the same bits as a ``tile`` with the page count
        and last_block_valid_slots those tokens make)."""
        off = self._offset(token_offset)
        self._queue(tile_blocks, token_counts, off, output, 2)

    def _offset(self, off: Any) -> int:
        """A token-count tile's ``token_offset`` checked (after the step's TiledAttention is found live)."""
        ta = self._ta
        if ta._closed:
            ta._live()
        if type(off) is not int or not 0 <= off <= _I32_MAX:
            off = _args.as_int("token_offset", off)
            if not 0 <= off <= _I32_MAX:
                raise HssError(f"token_offset must be in 0..{_I32_MAX} (got {off})")
        return off

    def tile_tokens_rope(self, tile_blocks: Any, token_counts: Any, qkv: Any, cos: Any, sin: Any, max_pos: int,
                         token_offset: int = 0, output: Any = None) -> None:
        """:meth:`tile_tokens` with the newest token and the query arriving un-rotated (a decode step's fused RoPE):
        ``qkv`` bf16 ``[num_seqs, num_q_heads + 2 num_kv_heads, head_dim]`` (q | k | v heads, the QKV projection's
        rows); ``cos`` / ``sin`` f32 ``[max_pos, head_dim / 2]``. Each sequence's newest token is its tile's last,
        at position ``token_offset + its tile length - 1``: the launch rotates the query heads and that token's k
        heads (rotate-half RoPE, the rounding of ``model_rope_kv``), writes that token's K and V rows into the
        pools at its page and slot, and attends it: the same bits as ``model_rope_kv`` followed by
        :meth:`tile_tokens` (the q given to ``begin_tiles`` is not read). A sequence whose position is outside
        ``0 .. max_pos - 1`` is left untouched (state, output and pools). ``head_dim`` must be even; each
        sequence's newest token must be on a page of its own (two sequences writing one row race)."""
        ta = self._ta
        off = self._offset(token_offset)
        last = self._rope
        if last is None or last[0] is not qkv or last[1] is not cos or last[2] is not sin or last[3] != max_pos:
            last = self._rope = self._rope_args(qkv, cos, sin, max_pos)
        table, counts, out = self._checked(tile_blocks, token_counts, output)
        r = ta._rope_slots
        r[0].value, r[1].value, r[2].value = last[4], self._k, self._v
        r[3].value, r[4].value, r[5].value = self._blk, self._tok, self._kvh
        r[6].value, r[7].value, r[8].value = table, counts, off
        r[11].value, r[12].value, r[13].value = last[5], last[6], last[3]
        ta._launch(self._s, self._n, out, 2, rope=True)

    def _rope_args(self, qkv: Any, cos: Any, sin: Any, max_pos: Any) -> tuple:
        """The rope tile's step-invariant arguments checked: (qkv, cos, sin, max_pos, their three addresses)."""
        ta, s = self._ta, self._s
        hd = ta.dims.head_dim
        if hd % 2:
            raise HssError(f"tile_tokens_rope needs an even head_dim (got {hd}): rotate-half RoPE pairs element j "
                           "with j + head_dim / 2")
        mp = _args.as_int("max_pos", max_pos)
        if not 1 <= mp <= _I32_MAX:
            raise HssError(f"max_pos must be in 1..{_I32_MAX} (got {mp}): the rows of the cos / sin tables")
        table_bytes = 4 * mp * (hd // 2)
        qp = ta._qkv_arg(qkv, s, self._n * ta._qkv_bytes)
        cp = ta._cos_arg(cos, s, table_bytes)
        sp = ta._sin_arg(sin, s, table_bytes)
        if self._pools:   # the pools are written: writable (checked once per step)
            k_pool, v_pool, pool_bytes = self._pools
            ta._kw_arg(k_pool, s, pool_bytes)
            ta._vw_arg(v_pool, s, pool_bytes)
            self._pools = ()
        return qkv, cos, sin, mp, qp, cp, sp

    def _checked(self, table: Any, counts: Any, output: Any) -> tuple[int, int, int]:
        """A tile's device arrays and output checked: (table, counts, output or 0) addresses."""
        ta, s = self._ta, self._s
        tp = ta._table_arg(table, s, self._table_bytes)
        cp = ta._counts_arg(counts, s, 4 * self._n)
        out = 0 if output is None else ta._out_arg(output, s, self._row_bytes)
        if out:
            ta._own.check(out, self._row_bytes, "output", "this TiledAttention")
        return tp, cp, out

    def _queue(self, table: Any, counts: Any, lbvs: int, output: Any, mode: int) -> None:
        """Check the tile's device arrays and output, refill the prepared launch and queue it (``mode`` 2: token
        counts, ``lbvs`` their offset)."""
        ta = self._ta
        tp, cp, out = self._checked(table, counts, output)
        ta._fill(self._q, self._k, self._v, self._blk, self._tok, self._kvh, tp, cp, lbvs, self._serial)
        ta._launch(self._s, self._n, out, mode)
