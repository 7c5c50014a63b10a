"""The block predictor (SPEC §4): P, the per-token K_lr store A_g, and its three kernels.

``Predictor`` owns P (``[head_dim, r]`` bf16, immutable) and A_g (``[num_layers, max_blocks,
num_kv_heads, block_size, r]`` bf16, zero-filled at construction, so unwritten slots score 0), and
launches ``project_q`` (per decode step), ``project_kv_block`` (when a KV page is written) and the
block scores (``score_blocks`` over any run of slots, ``score_layer`` over a layer's own slots).
Scores are advisory: they order eviction and prefetch and never gate attention correctness.

Every argument is checked by :mod:`hss._args` before anything is launched: a bad one raises
:class:`HssError` (``TypeError`` for a wrong type) naming the parameter and the fix. Streams take every
form :func:`hss._args.stream` reads (an int handle, ``CudaStream``, a ``CudaCtx`` meaning its stream,
``__cuda_stream__`` objects, ...); device arrays every form :func:`hss._args.pointer` reads (int addresses,
``DeviceBuffer`` / ``DeviceView``, torch tensors, ``__cuda_array_interface__`` and DLPack objects), their
size, alignment and dtype checked where the object says them (bf16 for q, q_proj and K, f32 for scores),
outputs writable. Launches are asynchronous on the given stream. A Predictor refills prepared parameter
packs on every call, so one instance must not be used from several threads at once.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np

from hss import _args, cuda_min
from hss._launch import launcher
from hss.cuda_min import CudaCtx, DeviceBuffer, copy_d_to_h_async, copy_h_to_d_async, memset_d8_async, stream_sync
from hss.errors import HssError
from hss.kernels.predictor import KV_LOWRANK_PROJECT, PREDICTOR_SCORE, Q_LOWRANK_PROJECT, lowrank_rows, score_warps
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

    def __post_init__(self) -> None:
        _args.int_fields(self)   # numpy integers become Python ints (no int32 wrap); float, bool, str: TypeError

    def validate(self) -> None:
        """Raise :class:`HssError` unless the kernels can run these dims (the fields are ints by construction)."""
        for name in ("num_layers", "num_q_heads", "num_kv_heads", "head_dim", "r", "block_size", "max_blocks"):
            if getattr(self, name) < 1:
                raise HssError(f"PredictorDims.{name} must be >= 1 (got {getattr(self, name)})")
        if self.num_q_heads % self.num_kv_heads:
            raise HssError(f"PredictorDims.num_q_heads ({self.num_q_heads}) must be a multiple of num_kv_heads "
                           f"({self.num_kv_heads}): each kv head serves num_q_heads / num_kv_heads q heads")
        limits = (("head_dim", 256, "the projection's limit (SPEC §2.1)"),
                  ("r", 128, "the projection's limit (SPEC §2.1)"),
                  ("block_size", 65535, "kv_lowrank_project puts tokens on grid.y"),
                  ("max_blocks", _I32_MAX, "block counts are i32 kernel parameters"))
        for name, hi, why in limits:
            if getattr(self, name) > hi:
                raise HssError(f"PredictorDims.{name} ({getattr(self, name)}) must be <= {hi}: {why}")
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
    free = max(_args.as_int("free_bytes", free_bytes), 0)
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


class Predictor:
    """P, A_g and the predictor kernels for one model shape (SPEC §4).

    ``Predictor(ctx, dims, projection_seed)`` works on ``ctx.stream``;
    :meth:`new_on_stream` on a caller's stream in the current context. Construction validates
    ``dims``, runs :func:`preflight_a_g` against free device memory before allocating anything, loads
    the three PTX modules, uploads P (SPEC §2, bit-exact with the original for ``projection_seed``),
    zero-fills A_g (one memset) and then **synchronizes the stream**, as the original did.
    ``close()`` (or leaving a ``with`` block) frees A_g, P and the modules once.

    Each kernel has two names, the original's: ``project_q(ctx, ...)`` and ``project_q_on_stream(stream, ...)``
    are one method, whose first argument is any stream form (a ``CudaCtx`` means its stream); likewise
    ``project_kv_block``, ``score_blocks`` and ``score_layer``.
    """

    def __init__(self, ctx: CudaCtx, dims: PredictorDims, projection_seed: int) -> None:
        if not isinstance(ctx, CudaCtx):
            raise TypeError(f"ctx must be a CudaCtx, got {type(ctx).__name__}; Predictor.new_on_stream takes a stream")
        self._build(ctx, _args.stream(ctx, "ctx"), dims, projection_seed)

    @classmethod
    def new_on_stream(cls, stream: Any, dims: PredictorDims, projection_seed: int) -> Predictor:
        """A Predictor in the thread's current context (device 0's if none), set up on ``stream``."""
        self = cls.__new__(cls)
        self._build(None, _args.stream(stream), dims, projection_seed)
        return self

    def _build(self, ctx: CudaCtx | None, stream: int, dims: PredictorDims, seed: Any) -> None:
        self._closed = True
        self._owned = contextlib.ExitStack()
        if not isinstance(dims, PredictorDims):
            raise TypeError(f"dims must be a PredictorDims, got {type(dims).__name__}")
        dims.validate()
        seed = _args.as_int("projection_seed", seed, 0, 2**64 - 1, "a u64")
        if ctx is not None:
            ctx.make_current()
        a_g_bytes = preflight_a_g(dims, cuda_min.mem_info()[0])
        self._p_host = build_projection(PredictorShape(dims.head_dim, dims.r), seed)
        self._p_host.setflags(write=False)
        self._dims = dims
        own = self._owned.enter_context
        try:
            funcs = [own(load_module(decl.module, ctx)).function(decl.name)
                     for decl in (Q_LOWRANK_PROJECT, KV_LOWRANK_PROJECT, PREDICTOR_SCORE)]
            self._p = own(DeviceBuffer(dims.p_bytes(), ctx))
            self._a_g = own(DeviceBuffer(a_g_bytes, ctx))
            copy_h_to_d_async(self._p, self._p_host, dims.p_bytes(), stream)
            memset_d8_async(self._a_g, 0, a_g_bytes, stream)
            stream_sync(stream)
            self._prepare(*funcs)
        except BaseException:
            self._owned.close()
            raise
        self._closed = False

    def _prepare(self, f_q: Any, f_kv: Any, f_score: Any) -> None:
        """The hot paths' prepared state: packs (refilled by slot), launchers, pointer checks and the geometry."""
        d, p = self._dims, self._p.ptr
        nq, nkv, hd, r, bs = d.num_q_heads, d.num_kv_heads, d.head_dim, d.r, d.block_size
        self._slot = d.slot_bytes()
        self._a_g_base = self._a_g.ptr
        self._a_g_end = self._a_g_base + self._a_g.bytes
        self._num_layers, self._max_blocks = d.num_layers, d.max_blocks
        bf16 = "bf16"
        # project_q: grid.x covers the q heads, block.y q heads per CTA
        qy = lowrank_rows(r, nq)
        self._q_pack = pack = Q_LOWRANK_PROJECT.pack(p=p, num_q_heads=nq, head_dim=hd, r=r)
        self._q_in, self._q_out = pack.slot("q"), pack.slot("q_proj")
        self._run_q = launcher(f_q, (r, qy, 1), 0, pack)
        self._q_grid = -(-nq // qy)
        self._q_arg = _args.pointer_arg("q", 2 * nq * hd, 2, bf16, what="the [num_q_heads, head_dim] bf16 query")
        self._q_proj_out_arg = _args.pointer_arg("q_proj", 2 * nq * r, 2, bf16, write=True,
                                                 what="a [num_q_heads, r] bf16 output")
        # project_kv_block: grid (kv heads, token groups), block.y tokens per CTA
        ky = lowrank_rows(r, bs)
        self._kv_pack = pack = KV_LOWRANK_PROJECT.pack(p=p, block_size=bs, num_kv_heads=nkv, head_dim=hd, r=r)
        self._kv_in, self._kv_out = pack.slot("k_block"), pack.slot("k_lr")
        self._run_kv = launcher(f_kv, (r, ky, 1), 0, pack)
        self._kv_grid = (nkv, -(-bs // ky))
        self._k_block_arg = _args.pointer_arg("k_block", 2 * bs * nkv * hd, 2, bf16,
                                              what="one [block_size, num_kv_heads, head_dim] bf16 KV page")
        # predictor_score: one K_lr block per warp
        self._warps = score_warps()
        self._score_pack = pack = PREDICTOR_SCORE.pack(num_q_heads=nq, num_kv_heads=nkv, block_size=bs, r=r,
                                                       gqa_ratio=d.gqa_ratio())
        self._sc_q, self._sc_k = pack.slot("q_proj"), pack.slot("k_lr")
        self._sc_out, self._sc_n = pack.slot("scores"), pack.slot("num_blocks")
        self._run_score = launcher(f_score, (32 * self._warps, 1, 1), 0, pack)
        self._q_proj_arg = _args.pointer_arg("q_proj", 2 * nq * r, 2, bf16,
                                             what="the [num_q_heads, r] bf16 projected query")
        self._k_lr_arg = _args.pointer_arg("k_lr_seq", None, 2, bf16,
                                           what="n slots of [num_kv_heads, block_size, r] bf16")
        self._scores_arg = _args.pointer_arg("scores_out", None, 4, "f32", write=True, what="an [n] f32 output")

    # -- properties -----------------------------------------------------------------------------
    @property
    def dims(self) -> PredictorDims:
        return self._dims

    @property
    def a_g_dev_ptr(self) -> int:
        """Device address of A_g ``[num_layers, max_blocks, num_kv_heads, block_size, r]`` bf16."""
        self._live()
        return self._a_g_base

    @property
    def projection(self) -> np.ndarray:
        """The host copy of P that was uploaded: ``[head_dim, r]`` bf16 (read-only)."""
        return self._p_host

    def slot_ptr(self, layer: int, block: int) -> int:
        """Device address of A_g slot (layer, block): ``[num_kv_heads, block_size, r]`` bf16."""
        self._live()
        layer = _args.as_index("layer", layer, self._num_layers, "layers")
        block = _args.as_index("block", block, self._max_blocks, "blocks per layer (max_blocks)")
        return self._a_g_base + (layer * self._max_blocks + block) * self._slot

    # -- kernels --------------------------------------------------------------------------------
    def project_q_on_stream(self, stream: Any, q: Any, q_proj: Any) -> None:
        """Queue ``q_proj = bf16(q @ P)`` on ``stream`` (or a CudaCtx's stream: this is also ``project_q(ctx, ...)``).

        q: device ``[num_q_heads, head_dim]`` bf16 (the decode query, post-RoPE);
        q_proj: device ``[num_q_heads, r]`` bf16 output.
        """
        if self._closed:
            self._live()
        s = _args.stream(stream)
        qp = self._q_arg(q, s)
        op = self._q_proj_out_arg(q_proj, s)
        self._q_in.value = qp
        self._q_out.value = op
        self._run_q(s, self._q_grid)

    project_q = project_q_on_stream

    def project_kv_block_on_stream(self, stream: Any, layer: int, block_id: int, k_block: Any) -> None:
        """Queue the projection of one KV page into A_g slot (layer, block_id), every token of it (also
        ``project_kv_block(ctx, ...)``).

        k_block: device ``[block_size, num_kv_heads, head_dim]`` bf16 (one NHD page of the KV cache).
        Writes only that slot: ``[num_kv_heads, block_size, r]`` bf16.
        """
        if self._closed:
            self._live()
        s = _args.stream(stream)
        if type(layer) is not int or not 0 <= layer < self._num_layers:
            layer = _args.as_index("layer", layer, self._num_layers, "layers")
        if type(block_id) is not int or not 0 <= block_id < self._max_blocks:
            block_id = _args.as_index("block_id", block_id, self._max_blocks, "blocks per layer (max_blocks)")
        kp = self._k_block_arg(k_block, s)
        self._kv_in.value = kp
        self._kv_out.value = self._a_g_base + (layer * self._max_blocks + block_id) * self._slot
        self._run_kv(s, *self._kv_grid)

    project_kv_block = project_kv_block_on_stream

    def score_blocks_on_stream(self, stream: Any, q_proj: Any, k_lr_seq: Any, scores_out: Any, n: int) -> None:
        """Queue ``scores_out[b]`` = max over q heads and tokens of q_proj . K_lr for n consecutive slots (also
        ``score_blocks(ctx, ...)``).

        q_proj: device ``[num_q_heads, r]`` bf16; k_lr_seq: device ``[n, num_kv_heads, block_size, r]``
        bf16 (n consecutive A_g slots, or any buffer of that layout; inside A_g it must start on a slot
        and the n slots must stay inside A_g); scores_out: device ``[n]`` f32. n = 0 launches nothing.
        """
        if self._closed:
            self._live()
        s = _args.stream(stream)
        if type(n) is not int or not 0 <= n <= _I32_MAX:
            n = _args.as_int("n", n, 0, _I32_MAX, "a block count (i32)")
        kp = self._k_lr_arg(k_lr_seq, s, n * self._slot)
        if self._a_g_base <= kp < self._a_g_end:
            self._check_slots(kp, n)
        self._score(s, q_proj, kp, scores_out, n)

    score_blocks = score_blocks_on_stream

    def _check_slots(self, kp: int, n: int) -> None:
        off = kp - self._a_g_base
        if off % self._slot:
            raise HssError(f"k_lr_seq points {off} bytes into A_g, which is not the start of a slot "
                           f"(slots are {self._slot} bytes); use slot_ptr(layer, block)")
        if kp + n * self._slot > self._a_g_end:
            total = (self._a_g_end - self._a_g_base) // self._slot
            raise HssError(f"k_lr_seq + n slots runs past the end of A_g: slot {off // self._slot} + {n} > "
                           f"{total} slots; lower n")

    def score_layer_on_stream(self, stream: Any, q_proj: Any, layer: int, first_block: int, n: int,
                              scores_out: Any) -> None:
        """Queue the scores of A_g slots ``first_block .. first_block + n - 1`` of ``layer`` (also
        ``score_layer(ctx, ...)``).

        q_proj: device ``[num_q_heads, r]`` bf16; scores_out: device ``[n]`` f32 (scores_out[i] is block
        first_block + i). Needs first_block + n <= max_blocks; n = 0 launches nothing.
        """
        if self._closed:
            self._live()
        s = _args.stream(stream)
        if type(layer) is not int or not 0 <= layer < self._num_layers:
            layer = _args.as_index("layer", layer, self._num_layers, "layers")
        if type(first_block) is not int:
            first_block = _args.as_int("first_block", first_block)
        if type(n) is not int:
            n = _args.as_int("n", n)
        mb = self._max_blocks
        if first_block < 0 or n < 0 or first_block + n > mb:
            raise HssError(f"blocks first_block .. first_block + n - 1 = {first_block} .. {first_block + n - 1} "
                           f"are outside this layer's 0 .. {mb - 1} (max_blocks {mb})")
        self._score(s, q_proj, self._a_g_base + (layer * mb + first_block) * self._slot, scores_out, n)

    score_layer = score_layer_on_stream

    def _score(self, s: int, q_proj: Any, k_lr: int, scores_out: Any, n: int) -> None:
        qp = self._q_proj_arg(q_proj, s)
        sp = self._scores_arg(scores_out, s, 4 * n)
        if n == 0:
            return
        if sp < self._a_g_end and self._a_g_base < sp + 4 * n:
            raise HssError("scores_out overlaps A_g; pass a separate [n] f32 buffer")
        self._sc_q.value = qp
        self._sc_k.value = k_lr
        self._sc_out.value = sp
        self._sc_n.value = n
        self._run_score(s, -(-n // self._warps))

    # -- host helpers, lifetime -----------------------------------------------------------------
    def read_k_lr_slot(self, ctx: Any, layer: int, block: int) -> np.ndarray:
        """Copy A_g slot (layer, block) to the host as ``[num_kv_heads, block_size, r]`` bf16.

        ``ctx``: a CudaCtx (its stream) or a stream. Waits for that stream (a test/debug helper).
        """
        stream = _args.stream(ctx, "ctx")
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
        """Free A_g, P and the modules (waits for work using them; every part is released even if one release
        raises); later calls do nothing."""
        if self._closed:
            return
        self._closed = True
        self._owned.close()

    def __enter__(self) -> Predictor:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        dims = getattr(self, "_dims", None)
        state = "closed" if self._closed else f"A_g {self._a_g_end - self._a_g_base} bytes at {self._a_g_base:#x}"
        return f"Predictor({dims}, {state})"


def read_k_lr_slot(ctx: Any, pred: Predictor, layer: int, block: int) -> np.ndarray:
    """The original's test helper: ``pred.read_k_lr_slot(ctx, layer, block)`` (bounds-checked)."""
    return pred.read_k_lr_slot(ctx, layer, block)
