"""The block predictor (SPEC §4): P, the per-token K_lr store A_g, and its three kernels.

``Predictor`` owns P (``[head_dim, r]`` bf16, immutable) and A_g (``[num_layers, max_blocks,
num_kv_heads, block_size, r]`` bf16, zero-filled at construction, so unwritten slots score 0), and
launches ``project_q`` (per decode step), ``project_kv_block`` (when a KV page is written) and the
block scores (``score_blocks`` over any run of slots, ``score_layer`` over a layer's own slots).
Scores are advisory: they order eviction and prefetch and never gate attention correctness.

Every argument is checked before anything is launched: a bad one raises :class:`HssError` naming the
parameter and the fix. Streams may be ints, ``CudaStream`` or ``__cuda_stream__`` objects; device
pointers ints, ``DeviceBuffer`` or ``__cuda_array_interface__`` objects (sizes are checked where the
object reports one). Launches are asynchronous on the given stream. A Predictor refills prepared
parameter packs on every call, so one instance must not be used from several threads at once.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np

from hss import cuda_min
from hss.errors import HssError
from hss._args import as_int, device_ptr
from hss.cuda_min import (CudaCtx, DeviceBuffer, copy_d_to_h_async, copy_h_to_d_async, launch_kernel,
                          memset_d8_async, stream_handle, stream_sync)
from hss.kernels.predictor import (KV_LOWRANK_PROJECT, PREDICTOR_SCORE, Q_LOWRANK_PROJECT, lowrank_rows,
                                   score_warps)
from hss.projection import PredictorShape, build_projection
from hss.ptx import load_module

__all__ = ["PredictorDims", "Predictor", "preflight_a_g", "read_k_lr_slot", "A_G_BUDGET_PERCENT"]

A_G_BUDGET_PERCENT = 95   # of free device memory; the rest is left for the scratch pool and tiled attention
_I32_MAX = 2**31 - 1
_GIB = float(1 << 30)


@dataclass(frozen=True)
class PredictorDims:
    """Shape of the predictor: model heads, projection rank ``r``, KV page size and A_g capacity."""

    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    r: int
    block_size: int     # tokens per KV page (A_g slot)
    max_blocks: int     # A_g slots per layer (the longest context is max_blocks * block_size tokens)

    def validate(self) -> None:
        """Raise :class:`HssError` (``TypeError`` for non-ints) unless the kernels can run these dims."""
        values = {f.name: as_int(f.name, getattr(self, f.name)) for f in dataclasses.fields(self)}
        for name, v in values.items():
            if v < 1:
                raise HssError(f"PredictorDims.{name} must be >= 1 (got {v})")
        if self.num_q_heads % self.num_kv_heads:
            raise HssError(f"PredictorDims.num_q_heads ({self.num_q_heads}) must be a multiple of num_kv_heads "
                           f"({self.num_kv_heads}): each kv head serves num_q_heads / num_kv_heads q heads")
        limits = (("head_dim", 256, "the projection's limit (SPEC §2.1)"),
                  ("r", 128, "the projection's limit (SPEC §2.1)"),
                  ("block_size", 65535, "kv_lowrank_project puts tokens on grid.y"),
                  ("max_blocks", _I32_MAX, "block counts are i32 kernel parameters"))
        for name, hi, why in limits:
            if values[name] > hi:
                raise HssError(f"PredictorDims.{name} ({values[name]}) must be <= {hi}: {why}")
        if self.num_q_heads * self.block_size > _I32_MAX:
            raise HssError(f"num_q_heads * block_size ({self.num_q_heads * self.block_size}) must fit in i32")

    def gqa_ratio(self) -> int:
        """q heads per kv head (q head h reads kv head h // gqa_ratio)."""
        return self.num_q_heads // self.num_kv_heads

    def a_g_bytes(self) -> int:
        """Bytes of A_g: num_layers * max_blocks * num_kv_heads * block_size * r * 2."""
        return self.num_layers * self.max_blocks * self.num_kv_heads * self.block_size * self.r * 2

    def per_layer_block_floats(self) -> int:
        """Elements (bf16) of one (layer, block) slot: num_kv_heads * block_size * r."""
        return self.num_kv_heads * self.block_size * self.r

    def slot_bytes(self) -> int:
        """Bytes of one (layer, block) slot of A_g."""
        return 2 * self.per_layer_block_floats()

    def p_bytes(self) -> int:
        """Bytes of P: head_dim * r * 2."""
        return self.head_dim * self.r * 2


def preflight_a_g(dims: PredictorDims, free_bytes: int) -> int:
    """Check that A_g fits in ``A_G_BUDGET_PERCENT`` % of ``free_bytes``; return its size in bytes.

    Raises :class:`HssError` saying the needed and usable GiB, the sizing formula with these dims'
    numbers, and which PredictorDims fields to change (and to what) so that it fits.
    """
    need = dims.a_g_bytes()
    free = max(int(free_bytes), 0)
    budget = free * A_G_BUDGET_PERCENT // 100
    if need <= budget:
        return need
    d = dims
    per_r = need // d.r                      # bytes per unit of each field, the others fixed
    per_block = need // d.max_blocks
    per_layer = need // d.num_layers
    r_fit, blocks_fit, layers_fit = budget // per_r, budget // per_block, budget // per_layer

    def fits(n: int, what: str) -> str:
        return f"at most {n} fits now" if n >= 1 else f"no {what} fits with the other fields as they are"

    raise HssError(
        f"HSS predictor A_g needs {need / _GIB:.2f} GiB but only {budget / _GIB:.2f} GiB of device memory is "
        f"usable ({A_G_BUDGET_PERCENT}% of {free / _GIB:.2f} GiB free; the rest is left for the scratch pool and "
        "tiled attention). Nothing was allocated.\n"
        f"A_g sizing = num_layers ({d.num_layers}) × max_blocks ({d.max_blocks}) × num_kv_heads ({d.num_kv_heads}) "
        f"× block_size ({d.block_size}) × r ({d.r}) × 2 bytes = {need} bytes.\n"
        "Change one of these PredictorDims fields:\n"
        f"  - r: {d.r} -> {max(d.r // 2, 1)} halves A_g ({fits(r_fit, 'r')}; lower r predicts less sharply)\n"
        f"  - max_blocks: {d.max_blocks} -> {fits(blocks_fit, 'max_blocks')} (max_blocks × block_size is the "
        f"longest context: {d.max_blocks * d.block_size} tokens now)\n"
        f"  - num_layers: {d.num_layers} -> {fits(layers_fit, 'num_layers')} (predict for fewer layers)\n"
        "or free device memory before constructing the Predictor.")


def _stream_of(ctx: Any) -> int:
    if not isinstance(ctx, CudaCtx):
        raise TypeError(f"ctx must be a CudaCtx, got {type(ctx).__name__}; the *_on_stream variants take a stream")
    return ctx.stream


def _known_size(obj: Any) -> int | None:
    """Bytes the object says it holds (DeviceBuffer, contiguous __cuda_array_interface__), else None."""
    if type(obj) is int:
        return None
    if isinstance(obj, DeviceBuffer):
        return obj.bytes
    try:
        cai = getattr(obj, "__cuda_array_interface__", None)
        if cai is None or cai.get("strides") is not None:
            return None
        return int(np.prod(cai["shape"], dtype=np.int64)) * int(cai["typestr"][2:])
    except Exception:   # an exotic object: trust the caller on the size
        return None


def _pointer(obj: Any, nbytes: int, name: str, align: int, holds: str) -> int:
    """The device address of argument ``name``: non-null, aligned, and big enough where that is known."""
    ptr = device_ptr(obj)
    if ptr == 0:
        raise HssError(f"{name} is a null pointer; pass the device address of {holds}")
    if ptr % align:
        raise HssError(f"{name} ({ptr:#x}) must be {align}-byte aligned ({holds})")
    size = _known_size(obj)
    if size is not None and size < nbytes:
        raise HssError(f"{name} holds {size} bytes but {nbytes} are needed ({holds})")
    return ptr


def _index(value: Any, name: str, hi: int, what: str) -> int:
    v = as_int(name, value)
    if not 0 <= v < hi:
        raise HssError(f"{name} {v} is out of range: this Predictor has {hi} {what} (0..{hi - 1})")
    return v


class Predictor:
    """P, A_g and the predictor kernels for one model shape (SPEC §4).

    ``Predictor(ctx, dims, projection_seed)`` works on ``ctx.stream``;
    :meth:`new_on_stream` on a caller's stream in the current context. Construction validates
    ``dims``, runs :func:`preflight_a_g` against free device memory before allocating anything, loads
    the three PTX modules, uploads P (SPEC §2, bit-exact with the original for ``projection_seed``),
    zero-fills A_g (one memset) and then **synchronizes the stream**, as the original did.
    ``close()`` (or leaving a ``with`` block) frees A_g, P and the modules once.
    """

    def __init__(self, ctx: CudaCtx, dims: PredictorDims, projection_seed: int) -> None:
        self._build(ctx, _stream_of(ctx), dims, projection_seed)

    @classmethod
    def new_on_stream(cls, stream: Any, dims: PredictorDims, projection_seed: int) -> "Predictor":
        """A Predictor in the thread's current context (device 0's if none), set up on ``stream``."""
        self = cls.__new__(cls)
        self._build(None, stream_handle(stream), dims, projection_seed)
        return self

    def _build(self, ctx: CudaCtx | None, stream: int, dims: PredictorDims, seed: Any) -> None:
        self._closed = True
        self._owned: list[Any] = []
        if not isinstance(dims, PredictorDims):
            raise TypeError(f"dims must be a PredictorDims, got {type(dims).__name__}")
        dims.validate()
        seed = as_int("projection_seed", seed)
        if not 0 <= seed < 2**64:
            raise HssError(f"projection_seed must be a u64 (0 <= seed < 2**64), got {seed}")
        if ctx is not None:
            ctx.make_current()
        a_g_bytes = preflight_a_g(dims, cuda_min.mem_info()[0])
        self._p_host = build_projection(PredictorShape(dims.head_dim, dims.r), seed)
        self._p_host.setflags(write=False)
        self._dims = dims
        self._slot = dims.slot_bytes()
        try:
            funcs = []
            for decl in (Q_LOWRANK_PROJECT, KV_LOWRANK_PROJECT, PREDICTOR_SCORE):
                module = load_module(decl.module, ctx)
                self._owned.append(module)
                funcs.append(module.function(decl.name))
            self._f_q, self._f_kv, self._f_score = funcs
            self._p = DeviceBuffer(dims.p_bytes(), ctx)
            self._owned.append(self._p)
            self._a_g = DeviceBuffer(a_g_bytes, ctx)
            self._owned.append(self._a_g)
            copy_h_to_d_async(self._p, self._p_host, dims.p_bytes(), stream)
            memset_d8_async(self._a_g, 0, a_g_bytes, stream)
            stream_sync(stream)
        except BaseException:
            self._closed = False
            self.close()
            raise
        self._closed = False
        d, p = dims, self._p.ptr
        # Prepared once; the hot path only refills the pointers and counts that change per call.
        self._q_pack = Q_LOWRANK_PROJECT.pack(0, p, 0, d.num_q_heads, d.head_dim, d.r)
        self._kv_pack = KV_LOWRANK_PROJECT.pack(0, p, 0, d.block_size, d.num_kv_heads, d.head_dim, d.r)
        self._score_pack = PREDICTOR_SCORE.pack(0, 0, 0, d.num_q_heads, d.num_kv_heads, d.block_size, d.r,
                                                d.gqa_ratio(), 0)
        qy, ky = lowrank_rows(d.r, d.num_q_heads), lowrank_rows(d.r, d.block_size)
        self._q_geom = ((-(-d.num_q_heads // qy), 1, 1), (d.r, qy, 1))
        self._kv_geom = ((d.num_kv_heads, -(-d.block_size // ky), 1), (d.r, ky, 1))

    # -- properties -----------------------------------------------------------------------------
    @property
    def dims(self) -> PredictorDims:
        return self._dims

    @property
    def a_g_dev_ptr(self) -> int:
        """Device address of A_g ``[num_layers, max_blocks, num_kv_heads, block_size, r]`` bf16."""
        self._live()
        return self._a_g.ptr

    @property
    def projection(self) -> np.ndarray:
        """The host copy of P that was uploaded: ``[head_dim, r]`` bf16 (read-only)."""
        return self._p_host

    def slot_ptr(self, layer: int, block: int) -> int:
        """Device address of A_g slot (layer, block): ``[num_kv_heads, block_size, r]`` bf16."""
        self._live()
        d = self._dims
        layer = _index(layer, "layer", d.num_layers, "layers")
        block = _index(block, "block", d.max_blocks, "blocks per layer (max_blocks)")
        return self._a_g.ptr + (layer * d.max_blocks + block) * self._slot

    # -- kernels --------------------------------------------------------------------------------
    def project_q(self, ctx: CudaCtx, q: Any, q_proj: Any) -> None:
        """:meth:`project_q_on_stream` on ``ctx.stream``."""
        self.project_q_on_stream(_stream_of(ctx), q, q_proj)

    def project_q_on_stream(self, stream: Any, q: Any, q_proj: Any) -> None:
        """Queue ``q_proj = bf16(q @ P)``.

        q: device ``[num_q_heads, head_dim]`` bf16 (the decode query, post-RoPE);
        q_proj: device ``[num_q_heads, r]`` bf16 output.
        """
        d = self._live()
        qp = _pointer(q, 2 * d.num_q_heads * d.head_dim, "q", 2, "the [num_q_heads, head_dim] bf16 query")
        op = _pointer(q_proj, 2 * d.num_q_heads * d.r, "q_proj", 2, "a [num_q_heads, r] bf16 output")
        pack = self._q_pack
        pack.set(0, qp)
        pack.set(2, op)
        launch_kernel(self._f_q, *self._q_geom, 0, stream, pack)

    def project_kv_block(self, ctx: CudaCtx, layer: int, block_id: int, k_block: Any) -> None:
        """:meth:`project_kv_block_on_stream` on ``ctx.stream``."""
        self.project_kv_block_on_stream(_stream_of(ctx), layer, block_id, k_block)

    def project_kv_block_on_stream(self, stream: Any, layer: int, block_id: int, k_block: Any) -> None:
        """Queue the projection of one KV page into A_g slot (layer, block_id), every token of it.

        k_block: device ``[block_size, num_kv_heads, head_dim]`` bf16 (one NHD page of the KV cache).
        Writes only that slot: ``[num_kv_heads, block_size, r]`` bf16.
        """
        d = self._live()
        layer = _index(layer, "layer", d.num_layers, "layers")
        block_id = _index(block_id, "block_id", d.max_blocks, "blocks per layer (max_blocks)")
        kp = _pointer(k_block, 2 * d.block_size * d.num_kv_heads * d.head_dim, "k_block", 2,
                      "one [block_size, num_kv_heads, head_dim] bf16 KV page")
        pack = self._kv_pack
        pack.set(0, kp)
        pack.set(2, self._a_g.ptr + (layer * d.max_blocks + block_id) * self._slot)
        launch_kernel(self._f_kv, *self._kv_geom, 0, stream, pack)

    def score_blocks(self, ctx: CudaCtx, q_proj: Any, k_lr_seq: Any, scores_out: Any, n: int) -> None:
        """:meth:`score_blocks_on_stream` on ``ctx.stream``."""
        self.score_blocks_on_stream(_stream_of(ctx), q_proj, k_lr_seq, scores_out, n)

    def score_blocks_on_stream(self, stream: Any, q_proj: Any, k_lr_seq: Any, scores_out: Any, n: int) -> None:
        """Queue ``scores_out[b]`` = max over q heads and tokens of q_proj . K_lr for n consecutive slots.

        q_proj: device ``[num_q_heads, r]`` bf16; k_lr_seq: device ``[n, num_kv_heads, block_size, r]``
        bf16 (n consecutive A_g slots, or any buffer of that layout; inside A_g it must start on a slot
        and the n slots must stay inside A_g); scores_out: device ``[n]`` f32. n = 0 does nothing.
        """
        self._live()
        n = as_int("n", n)
        if not 0 <= n <= _I32_MAX:
            raise HssError(f"n ({n}) must be in 0..{_I32_MAX}")
        if n == 0:
            return
        kp = _pointer(k_lr_seq, n * self._slot, "k_lr_seq", 2, f"{n} slots of [num_kv_heads, block_size, r] bf16")
        base, end = self._a_g.ptr, self._a_g.ptr + self._a_g.bytes
        if base <= kp < end:
            off = kp - base
            if off % self._slot:
                raise HssError(f"k_lr_seq points {off} bytes into A_g, which is not the start of a slot "
                               f"(slots are {self._slot} bytes); use slot_ptr(layer, block)")
            if kp + n * self._slot > end:
                raise HssError(f"k_lr_seq + n slots runs past the end of A_g: slot {off // self._slot} + {n} > "
                               f"{self._a_g.bytes // self._slot} slots; lower n")
        self._score(stream, q_proj, kp, scores_out, n)

    def score_layer(self, ctx: CudaCtx, q_proj: Any, layer: int, first_block: int, n: int, scores_out: Any) -> None:
        """:meth:`score_layer_on_stream` on ``ctx.stream``."""
        self.score_layer_on_stream(_stream_of(ctx), q_proj, layer, first_block, n, scores_out)

    def score_layer_on_stream(self, stream: Any, q_proj: Any, layer: int, first_block: int, n: int,
                              scores_out: Any) -> None:
        """Queue the scores of A_g slots ``first_block .. first_block + n - 1`` of ``layer``.

        q_proj: device ``[num_q_heads, r]`` bf16; scores_out: device ``[n]`` f32 (scores_out[i] is block
        first_block + i). Needs first_block + n <= max_blocks; n = 0 does nothing.
        """
        d = self._live()
        layer = _index(layer, "layer", d.num_layers, "layers")
        first_block = as_int("first_block", first_block)
        n = as_int("n", n)
        if first_block < 0 or n < 0 or first_block + n > d.max_blocks:
            raise HssError(f"blocks first_block .. first_block + n - 1 = {first_block} .. {first_block + n - 1} "
                           f"are outside this layer's 0 .. {d.max_blocks - 1} (max_blocks {d.max_blocks})")
        if n == 0:
            return
        self._score(stream, q_proj, self._a_g.ptr + (layer * d.max_blocks + first_block) * self._slot,
                    scores_out, n)

    def _score(self, stream: Any, q_proj: Any, k_lr: int, scores_out: Any, n: int) -> None:
        d = self._dims
        qp = _pointer(q_proj, 2 * d.num_q_heads * d.r, "q_proj", 2, "the [num_q_heads, r] bf16 projected query")
        sp = _pointer(scores_out, 4 * n, "scores_out", 4, f"a [{n}] f32 output")
        if sp < self._a_g.ptr + self._a_g.bytes and self._a_g.ptr < sp + 4 * n:
            raise HssError("scores_out overlaps A_g; pass a separate [n] f32 buffer")
        pack = self._score_pack
        pack.set(0, qp)
        pack.set(1, k_lr)
        pack.set(2, sp)
        pack.set(8, n)
        w = score_warps(n)
        launch_kernel(self._f_score, (-(-n // w), 1, 1), (32 * w, 1, 1), 0, stream, pack)

    # -- host helpers, lifetime -----------------------------------------------------------------
    def read_k_lr_slot(self, ctx: Any, layer: int, block: int) -> np.ndarray:
        """Copy A_g slot (layer, block) to the host as ``[num_kv_heads, block_size, r]`` bf16.

        ``ctx``: a CudaCtx (its stream) or a stream. Waits for that stream (a test/debug helper).
        """
        stream = ctx.stream if isinstance(ctx, CudaCtx) else stream_handle(ctx)
        src = self.slot_ptr(layer, block)
        d = self._dims
        out = np.empty((d.num_kv_heads, d.block_size, d.r), dtype=ml_dtypes.bfloat16)
        copy_d_to_h_async(out, src, out.nbytes, stream)
        stream_sync(stream)
        return out

    def _live(self) -> PredictorDims:
        if self._closed:
            raise HssError("this Predictor is closed")
        return self._dims

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Free A_g, P and the modules (waits for work using them); later calls do nothing."""
        if self._closed:
            return
        self._closed = True
        owned, self._owned = self._owned, []
        for obj in reversed(owned):
            obj.close()

    def __enter__(self) -> "Predictor":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        dims = getattr(self, "_dims", None)
        state = "closed" if self._closed else f"A_g {self._a_g.bytes} bytes at {self._a_g.ptr:#x}"
        return f"Predictor({dims}, {state})"


def read_k_lr_slot(ctx: Any, pred: Predictor, layer: int, block: int) -> np.ndarray:
    """The original's test helper: ``pred.read_k_lr_slot(ctx, layer, block)`` (bounds-checked)."""
    return pred.read_k_lr_slot(ctx, layer, block)
