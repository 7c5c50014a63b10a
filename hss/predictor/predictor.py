"""The block predictor (docs/design.md §4): P, the per-token K_lr store A_g, and its three kernels.

``Predictor`` owns P (``[head_dim, r]`` bf16, immutable: the original's seeded matrix for every layer and head, or,
docs/design.md §17.5, a caller's ``[num_layers, num_kv_heads, head_dim, r]`` such as
:func:`hss.predictor.calibrate_projection` gives) and A_g (``[num_layers, max_blocks, num_kv_heads, block_size, r]``
bf16, zero-filled at construction, so unwritten slots score 0), and
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
import functools
import math
from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np

from hss import _args, cuda_min
from hss._util import Closeable, ceil_div
from hss.cuda._launch import launcher
from hss.cuda.ptx import load_module
from hss.cuda_min import CudaCtx, DeviceBuffer, copy_d_to_h_async, copy_h_to_d_async, memset_d8_async, stream_sync
from hss.decls.predictor import (
    HEAD_THREADS,
    KV_LOWRANK_PROJECT,
    PREDICTOR_HEAD_COMBINE,
    PREDICTOR_HEAD_MAX,
    PREDICTOR_SCORE,
    PREDICTOR_SCORE_HEADS,
    Q_LOWRANK_PROJECT,
    lowrank_rows,
    q_lowrank_geometry,
    score_warps,
)
from hss.errors import HssError
from hss.predictor.projection import PredictorShape, build_projection

__all__ = ["PredictorDims", "Predictor", "preflight_a_g", "check_projection", "read_k_lr_slot", "A_G_BUDGET_PERCENT"]

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
        limits = (("head_dim", 256, "the projection's limit (docs/design.md §2.1)"),
                  ("r", 128, "the projection's limit (docs/design.md §2.1)"),
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
        + (f"  - r: {d.r} -> {d.r // 2} halves A_g ({fits(r_fit, 'r')}; lower r predicts less sharply)\n" if d.r > 1
           else "  - r: 1 is already the lowest rank (no lower r to try)\n") +
        f"  - max_blocks: {d.max_blocks} -> {fits(blocks_fit, 'max_blocks')} (max_blocks × block_size is the "
        f"longest context: {d.max_blocks * d.block_size} tokens now)\n"
        f"  - num_layers: {d.num_layers} -> {fits(layers_fit, 'num_layers')} (predict for fewer layers)\n"
        "or free device memory before constructing the Predictor.")


def check_projection(projection: Any, dims: PredictorDims) -> np.ndarray:
    """A caller's projection (docs/design.md §17.5) checked against ``dims``: returned as a read-only C-contiguous copy.

    ``projection``: ``[num_layers, num_kv_heads, head_dim, r]`` ``ml_dtypes.bfloat16`` (a numpy array), all finite;
    q head h of layer l is projected with ``projection[l, h // gqa_ratio]``, the keys of kv head j with
    ``projection[l, j]``. ``TypeError`` for anything but a bf16 numpy array; :class:`HssError` for the wrong shape
    or a NaN/inf entry.
    """
    if not isinstance(projection, np.ndarray):
        raise TypeError(f"projection must be a numpy array of ml_dtypes.bfloat16, got {type(projection).__name__}")
    if projection.dtype != ml_dtypes.bfloat16:
        raise TypeError(f"projection must hold bfloat16, got {projection.dtype}; round it with "
                        "projection.astype(ml_dtypes.bfloat16) (hss.predictor.calibrate_projection returns bf16)")
    d = dims
    want = (d.num_layers, d.num_kv_heads, d.head_dim, d.r)
    if projection.shape != want:
        raise HssError(f"projection has shape {projection.shape}; these dims need [num_layers, num_kv_heads, "
                       f"head_dim, r] = {list(want)} (one [head_dim, r] matrix per layer and kv head)")
    out = np.array(projection, dtype=ml_dtypes.bfloat16, order="C", copy=True)
    if not np.isfinite(out.astype(np.float32)).all():
        raise HssError("projection holds NaN or inf; every entry must be finite")
    out.setflags(write=False)
    return out


class Predictor(Closeable):
    """P, A_g and the predictor kernels for one model shape (docs/design.md §4).

    ``Predictor(ctx, dims, projection_seed)`` works on ``ctx.stream``;
    :meth:`new_on_stream` on a caller's stream in the current context. Construction validates
    ``dims``, runs :func:`preflight_a_g` against free device memory before allocating anything, loads
    the three PTX modules, uploads P (docs/design.md §2, bit-exact with the original for ``projection_seed``),
    zero-fills A_g (one memset) and then **synchronizes the stream**, as the original did.
    ``close()`` (or leaving a ``with`` block) frees A_g, P and the modules once.

    ``projection=`` (keyword, instead of ``projection_seed``; docs/design.md §17.5): a ``[num_layers, num_kv_heads,
    head_dim, r]`` bf16 projection (:func:`check_projection`), e.g. :func:`hss.predictor.calibrate_projection`'s. Then
    ``project_q`` needs ``layer=``; ``project_kv_block`` uses its layer's matrices. A projection whose every
    matrix is the seeded P gives the default's bits.

    ``head_temperature=`` (keyword; docs/design.md §17.5): ``None`` (the default) scores a block by the max over q heads
    and tokens, as the original; a positive ``c`` scores it by per-head normalised scores instead: with ``s[b, h]`` the
    max over the block's tokens of head h's dot, ``score[b] = sum_h exp((s[b, h] - max_b' s[b', h]) / c)`` over the
    n blocks of the call (each head's best block adds 1; ``c = sqrt(head_dim)`` is the attention's own scale), so
    no head's offset or scale dominates the others. Three launches per call instead of one, through a scratch of
    ``4 * num_q_heads * (max_blocks + 1)`` bytes; at most max_blocks blocks per call.

    Each kernel has two names, the original's: ``project_q(ctx, ...)`` and ``project_q_on_stream(stream, ...)``
    are one method, whose first argument is any stream form (a ``CudaCtx`` means its stream); likewise
    ``project_kv_block``, ``score_blocks`` and ``score_layer``.
    """

    def __init__(self, ctx: CudaCtx, dims: PredictorDims, projection_seed: int | None = None, *,
                 projection: np.ndarray | None = None, head_temperature: float | None = None) -> None:
        if not isinstance(ctx, CudaCtx):
            raise TypeError(f"ctx must be a CudaCtx, got {type(ctx).__name__}; Predictor.new_on_stream takes a stream")
        self._build(ctx, _args.stream(ctx, "ctx"), dims, projection_seed, projection, head_temperature)

    @classmethod
    def new_on_stream(cls, stream: Any, dims: PredictorDims, projection_seed: int | None = None, *,
                      projection: np.ndarray | None = None, head_temperature: float | None = None) -> Predictor:
        """A Predictor in the thread's current context (device 0's if none), set up on ``stream``."""
        self = cls.__new__(cls)
        self._build(None, _args.stream(stream), dims, projection_seed, projection, head_temperature)
        return self

    def _build(self, ctx: CudaCtx | None, stream: int, dims: PredictorDims, seed: Any, projection: Any,
               temperature: Any) -> None:
        self._closed = True
        self._owned = contextlib.ExitStack()
        if not isinstance(dims, PredictorDims):
            raise TypeError(f"dims must be a PredictorDims, got {type(dims).__name__}")
        dims.validate()
        if seed is not None and projection is not None:
            raise HssError("pass projection_seed (the original's seeded P for every layer and head) or projection= "
                           "(a [num_layers, num_kv_heads, head_dim, r] bf16 array), not both")
        if projection is None:
            seed = _args.as_int("projection_seed", seed, 0, 2**64 - 1, "a u64")
            p_host = build_projection(PredictorShape(dims.head_dim, dims.r), seed)
            p_host.setflags(write=False)
        else:
            p_host = check_projection(projection, dims)
        if temperature is not None:
            temperature = _args.as_float("head_temperature", temperature)
            if not temperature > 0 or math.log2(math.e) / temperature > float(np.finfo(np.float32).max):
                raise HssError(f"head_temperature = {temperature!r} must be a positive number, at least 1e-38 (in "
                               "the dot's units; sqrt(head_dim) is the attention's own scale), or None for the "
                               "original max over heads")
        self._temperature = temperature
        if ctx is not None:
            ctx.make_current()
        a_g_bytes = preflight_a_g(dims, cuda_min.mem_info()[0])
        self._p_host = p_host
        self._dims = dims
        own = self._owned.enter_context
        try:
            decls = [Q_LOWRANK_PROJECT, KV_LOWRANK_PROJECT, PREDICTOR_SCORE]
            if temperature is not None:
                decls += [PREDICTOR_SCORE_HEADS, PREDICTOR_HEAD_MAX, PREDICTOR_HEAD_COMBINE]
            modules = {m: own(load_module(m, ctx)) for m in dict.fromkeys(decl.module for decl in decls)}
            funcs = [modules[decl.module].function(decl.name) for decl in decls]
            self._p = own(DeviceBuffer(p_host.nbytes, ctx))
            self._a_g = own(DeviceBuffer(a_g_bytes, ctx))
            # per-head scores [max_blocks, num_q_heads] f32, then each head's best [num_q_heads] f32
            self._heads = (own(DeviceBuffer(4 * dims.num_q_heads * (dims.max_blocks + 1), ctx))
                           if temperature is not None else None)
            copy_h_to_d_async(self._p, p_host, p_host.nbytes, stream)
            memset_d8_async(self._a_g, 0, a_g_bytes, stream)
            stream_sync(stream)
            self._prepare(*funcs)
        except BaseException:
            self._owned.close()
            raise
        self._closed = False

    def _prepare(self, f_q: Any, f_kv: Any, f_score: Any, *f_heads: Any) -> None:
        """The hot paths' prepared state: packs (refilled by slot), launchers, pointer checks and the geometry."""
        ptr_arg = functools.partial(_args.pointer_arg, device=self._p.device)   # refuses other devices' memory
        d, p = self._dims, self._p.ptr
        nq, nkv, hd, r, bs = d.num_q_heads, d.num_kv_heads, d.head_dim, d.r, d.block_size
        self._slot = d.slot_bytes()
        self._a_g_base = self._a_g.ptr
        self._a_g_end = self._a_g_base + self._a_g.bytes
        self._num_layers, self._max_blocks = d.num_layers, d.max_blocks
        bf16 = "bf16"
        # one P for every head (the original's launch: stride 0, one matrix serving all q heads), or docs/design.md
        # §17.5's matrix per (layer, kv head): layer l's at p + l * layer bytes, kv head j's head_dim * r elements
        # further
        self._layered = self._p_host.ndim == 4
        self._p_base, self._p_layer_bytes = p, (2 * nkv * hd * r if self._layered else 0)
        stride, heads_per_p = (hd * r, d.gqa_ratio()) if self._layered else (0, nq)
        # project_q: grid.x covers a matrix's q heads (block.y per CTA), grid.y the matrices
        block_q, self._q_grid = q_lowrank_geometry(r, nq, heads_per_p)
        self._q_pack = pack = Q_LOWRANK_PROJECT.pack(p=p, num_q_heads=nq, head_dim=hd, r=r, heads_per_p=heads_per_p,
                                                     p_stride=stride)
        self._q_in, self._q_out, self._q_p = pack.slot("q"), pack.slot("q_proj"), pack.slot("p")
        self._run_q = launcher(f_q, block_q, 0, pack)
        self._q_arg = ptr_arg("q", 2 * nq * hd, 2, bf16, what="the [num_q_heads, head_dim] bf16 query")
        self._q_proj_out_arg = ptr_arg("q_proj", 2 * nq * r, 2, bf16, write=True,
                                                 what="a [num_q_heads, r] bf16 output")
        # project_kv_block: grid (kv heads, token groups), block.y tokens per CTA
        ky = lowrank_rows(r, bs)
        self._kv_pack = pack = KV_LOWRANK_PROJECT.pack(p=p, block_size=bs, num_kv_heads=nkv, head_dim=hd, r=r,
                                                       p_stride=stride)
        self._kv_in, self._kv_out, self._kv_p = pack.slot("k_block"), pack.slot("k_lr"), pack.slot("p")
        self._run_kv = launcher(f_kv, (r, ky, 1), 0, pack)
        self._kv_grid = (nkv, ceil_div(bs, ky))
        self._k_block_arg = ptr_arg("k_block", 2 * bs * nkv * hd, 2, bf16,
                                              what="one [block_size, num_kv_heads, head_dim] bf16 KV page")
        # predictor_score: one K_lr block per warp
        self._warps = score_warps()
        self._score_pack = pack = PREDICTOR_SCORE.pack(num_q_heads=nq, num_kv_heads=nkv, block_size=bs, r=r,
                                                       gqa_ratio=d.gqa_ratio())
        self._sc_q, self._sc_k = pack.slot("q_proj"), pack.slot("k_lr")
        self._sc_out, self._sc_n = pack.slot("scores"), pack.slot("num_blocks")
        self._run_score = launcher(f_score, (32 * self._warps, 1, 1), 0, pack)
        self._q_proj_arg = ptr_arg("q_proj", 2 * nq * r, 2, bf16,
                                             what="the [num_q_heads, r] bf16 projected query")
        self._k_lr_arg = ptr_arg("k_lr_seq", None, 2, bf16,
                                           what="n slots of [num_kv_heads, block_size, r] bf16")
        self._scores_arg = ptr_arg("scores_out", None, 4, "f32", write=True, what="an [n] f32 output")
        if f_heads:
            self._prepare_heads(*f_heads)

    def _prepare_heads(self, f_heads: Any, f_max: Any, f_combine: Any) -> None:
        """The per-head normalised scores' three prepared launches (``head_temperature``)."""
        d, nq = self._dims, self._dims.num_q_heads
        hs = self._heads.ptr
        self._hm = hs + 4 * nq * d.max_blocks
        # the packs stay referenced: a launcher holds only their address
        self._hs_pack = pack = PREDICTOR_SCORE_HEADS.pack(
            head_scores=hs, num_q_heads=nq, num_kv_heads=d.num_kv_heads, block_size=d.block_size, r=d.r,
            gqa_ratio=d.gqa_ratio())
        self._hs_q, self._hs_k, self._hs_n = pack.slot("q_proj"), pack.slot("k_lr"), pack.slot("num_blocks")
        self._run_heads = launcher(f_heads, (32 * self._warps, 1, 1), 0, pack)
        self._hm_pack = pack = PREDICTOR_HEAD_MAX.pack(head_scores=hs, head_max=self._hm, num_q_heads=nq)
        self._hm_n = pack.slot("num_blocks")
        self._run_max = launcher(f_max, (HEAD_THREADS, 1, 1), 0, pack)
        self._hc_pack = pack = PREDICTOR_HEAD_COMBINE.pack(
            head_scores=hs, head_max=self._hm, num_q_heads=nq, exp2_scale=math.log2(math.e) / self._temperature)
        self._hc_out, self._hc_n = pack.slot("scores"), pack.slot("num_blocks")
        self._run_combine = launcher(f_combine, (HEAD_THREADS, 1, 1), 0, pack)

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
    def projection_dev_ptr(self) -> int:
        """Device address of P as the projection kernels read it: the seeded ``[head_dim, r]`` bf16, or the caller's
        ``[num_layers, num_kv_heads, head_dim, r]`` (layer l's matrices ``2 * num_kv_heads * head_dim * r`` bytes
        apart)."""
        self._live()
        return self._p_base

    @property
    def projection(self) -> np.ndarray:
        """The host copy of P that was uploaded (read-only bf16): the seeded ``[head_dim, r]``, or the caller's
        ``[num_layers, num_kv_heads, head_dim, r]``."""
        return self._p_host

    @property
    def head_temperature(self) -> float | None:
        """None: blocks score the max over heads (the original); else the per-head normalisation's temperature."""
        return self._temperature

    @property
    def layered(self) -> bool:
        """Whether P is per layer and kv head (``projection=``): then ``project_q`` needs ``layer=``."""
        return self._layered

    def projection_of(self, layer: int, kv_head: int) -> np.ndarray:
        """The ``[head_dim, r]`` bf16 matrix that projects ``layer``'s kv head ``kv_head`` and its q heads."""
        layer = _args.as_index("layer", layer, self._num_layers, "layers")
        kv_head = _args.as_index("kv_head", kv_head, self._dims.num_kv_heads, "kv heads")
        return self._p_host[layer, kv_head] if self._layered else self._p_host

    def slot_ptr(self, layer: int, block: int) -> int:
        """Device address of A_g slot (layer, block): ``[num_kv_heads, block_size, r]`` bf16."""
        self._live()
        layer = _args.as_index("layer", layer, self._num_layers, "layers")
        block = _args.as_index("block", block, self._max_blocks, "blocks per layer (max_blocks)")
        return self._a_g_base + (layer * self._max_blocks + block) * self._slot

    # -- kernels --------------------------------------------------------------------------------
    def project_q_on_stream(self, stream: Any, q: Any, q_proj: Any, *, layer: int | None = None) -> None:
        """Queue ``q_proj = bf16(q @ P)`` on ``stream`` (or a CudaCtx's stream: this is also ``project_q(ctx, ...)``).

        q: device ``[num_q_heads, head_dim]`` bf16 (the decode query, post-RoPE);
        q_proj: device ``[num_q_heads, r]`` bf16 output;
        layer: the query's layer. Needed with a per-layer projection (q head h then goes through
        ``P[layer, h // gqa_ratio]``); optional with the seeded P (checked when given, else ignored).
        """
        if self._closed:
            self._live()
        s = _args.stream(stream)
        if layer is not None or self._layered:
            self._q_p.value = self._p_base + self._q_layer(layer) * self._p_layer_bytes
        qp = self._q_arg(q, s)
        op = self._q_proj_out_arg(q_proj, s)
        self._q_in.value = qp
        self._q_out.value = op
        self._run_q(s, *self._q_grid)

    def _q_layer(self, layer: Any) -> int:
        if layer is None:
            raise HssError("project_q: this Predictor has a per-layer projection; pass layer= (the query's layer)")
        if type(layer) is not int or not 0 <= layer < self._num_layers:
            layer = _args.as_index("layer", layer, self._num_layers, "layers")
        return layer

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
        self._kv_p.value = self._p_base + layer * self._p_layer_bytes
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
        if self._heads is not None:
            self._score_heads(s, qp, k_lr, sp, n)
            return
        self._sc_q.value = qp
        self._sc_k.value = k_lr
        self._sc_out.value = sp
        self._sc_n.value = n
        self._run_score(s, ceil_div(n, self._warps))

    def _score_heads(self, s: int, qp: int, k_lr: int, sp: int, n: int) -> None:
        """Per-head normalised scores: per-(block, head) maxima, each head's best, then the sum of exp."""
        heads = self._heads
        if n > self._max_blocks:
            raise HssError(f"n = {n} blocks: with head_temperature a call scores at most max_blocks "
                           f"({self._max_blocks}) blocks (the per-head scratch's size); split the call")
        if sp < heads.ptr + heads.bytes and heads.ptr < sp + 4 * n:
            raise HssError("scores_out overlaps the Predictor's per-head scratch; pass a separate [n] f32 buffer")
        self._hs_q.value, self._hs_k.value, self._hs_n.value = qp, k_lr, n
        self._hm_n.value = self._hc_n.value = n
        self._hc_out.value = sp
        self._run_heads(s, ceil_div(n, self._warps))
        self._run_max(s, self._dims.num_q_heads)
        self._run_combine(s, ceil_div(n, HEAD_THREADS))

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

    def __repr__(self) -> str:
        dims = getattr(self, "_dims", None)
        state = "closed" if self._closed else f"A_g {self._a_g_end - self._a_g_base} bytes at {self._a_g_base:#x}"
        return f"Predictor({dims}, {state})"


def read_k_lr_slot(ctx: Any, pred: Predictor, layer: int, block: int) -> np.ndarray:
    """The original's test helper: ``pred.read_k_lr_slot(ctx, layer, block)`` (bounds-checked)."""
    return pred.read_k_lr_slot(ctx, layer, block)
