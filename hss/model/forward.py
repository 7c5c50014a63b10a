"""The decoder's forward pass on the device as lists of prepared operations (:class:`Forward`).

Every operation is ``(stage, run)``: ``run(stream)`` queues one cuBLAS GEMM (:func:`hss.cuda.gpu.proj_dense`, bf16 in
and out, f32 compute) or one ``ptx/model.cu`` kernel, its parameters packed and checked once when the operation is
built. A layer is

    qkv = h · wqkvᵀ; rope_kv (q → q, k and v → the KV cache at pos); attention (the KV mode's) → attn;
    delta = attn · woᵀ; x += delta, h = RMSNorm(x)·ffn_norm; gu = h · wguᵀ; act = silu(gate)·up;
    delta = act · wdownᵀ; x += delta, h = RMSNorm(x)·(next attn_norm, or final_norm after the last layer)

with the residual stream ``x`` in f32 and every other activation bf16; the step starts with ``embed_norm`` (x =
embed[token], h = RMSNorm(x)·attn_norm[0]) and ends with the LM head GEMM and ``argmax`` (or, given a
:class:`~hss.model.sample.Sampler`, its ``sample`` launch), which writes the next token into the device ``state`` and
advances its position: a decode step reads nothing from the host, so it replays as a CUDA graph.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from hss import cuda_min as cm
from hss.cuda.gpu import CudaBackend, launcher, proj_dense
from hss.decls import model as km
from hss.decls.qsa_prefill import Geometry
from hss.errors import HssError
from hss.model.weights import DeviceWeights

if TYPE_CHECKING:
    from hss.model.sample import Sampler

__all__ = ["Op", "Forward", "STAGES"]

Op = tuple[str, Callable[[int], None]]   # (stage name, run(stream))
STAGES = ("embed", "norm", "gemm qkv", "rope+kv", "attention", "gemm o", "gemm ffn", "silu*up", "lm head", "argmax",
          "sample")
_DECLS = (km.MODEL_EMBED_NORM, km.MODEL_ADD_NORM, km.MODEL_ROPE_KV, km.MODEL_ROPE_KV_PAGED, km.MODEL_SILU_MUL,
          km.MODEL_ARGMAX, km.MODEL_PREFILL_ATTN)


class Forward:
    """The workspace and operations of the forward pass for up to ``max_m`` tokens at a time.

    Buffers (device, row-major): ``x`` f32 ``[max_m, dim]``; ``h``, ``delta`` bf16 ``[max_m, dim]``; ``qkv`` bf16
    ``[max_m, (n_head + 2 n_kv_head) head_dim]``; ``q``, ``attn`` bf16 ``[max_m, n_head, head_dim]``; ``gu`` bf16
    ``[max_m, 2 ffn]``; ``act`` bf16 ``[max_m, ffn]``; ``ids`` i32 ``[max_m]``; ``logits`` bf16 ``[vocab]`` (the
    last row's; :meth:`all_logits` adds ``[max_m, vocab]``); ``state`` i32 ``[4]`` = {token, pos, visible, 0}.
    """

    def __init__(self, gpu: CudaBackend, weights: DeviceWeights, max_m: int, ctx: cm.CudaCtx | None = None) -> None:
        c = weights.config
        if type(max_m) is not int or not 1 <= max_m <= 65535:
            raise HssError(f"Forward: max_m must be an int in 1..65535 (grid.y of silu_mul), got {max_m!r}")
        self.config, self.w, self.gpu, self.max_m = c, weights, gpu, max_m
        self.qkv_dim = (c.n_head + 2 * c.n_kv_head) * c.head_dim
        self._owned = contextlib.ExitStack()
        own = self._owned.enter_context
        try:
            self._kernels = {d.name: gpu.kernel(km.MODULE, d.name) for d in _DECLS}
            buf = lambda n: own(cm.DeviceBuffer(n, ctx)).ptr   # noqa: E731
            self.x, self.h, self.delta = buf(4 * max_m * c.dim), buf(2 * max_m * c.dim), buf(2 * max_m * c.dim)
            self.qkv = buf(2 * max_m * self.qkv_dim)
            self.q, self.attn = buf(2 * max_m * c.q_dim), buf(2 * max_m * c.q_dim)
            self.gu, self.act = buf(4 * max_m * c.ffn_dim), buf(2 * max_m * c.ffn_dim)
            self.ids, self.logits = buf(4 * max_m), buf(2 * c.vocab_size)
            self.state = buf(4 * km.STATE_WORDS)
            self._gemms = [(proj_dense(gpu, lw.wqkv, self.qkv, self.qkv_dim, c.dim, max_m),
                            proj_dense(gpu, lw.wo, self.delta, c.dim, c.q_dim, max_m),
                            proj_dense(gpu, lw.wgu, self.gu, 2 * c.ffn_dim, c.dim, max_m),
                            proj_dense(gpu, lw.wdown, self.delta, c.dim, c.ffn_dim, max_m))
                           for lw in weights.layers]
            self._head = proj_dense(gpu, weights.output, self.logits, c.vocab_size, c.dim, 1)
            self._all_logits: int | None = None
            self._head_all: Callable[[int, int, int], None] | None = None
            self._rows_heads: dict[tuple[int, int], Callable[[int, int, int], None]] = {}
        except BaseException:
            self._owned.close()
            raise

    # -- building blocks ---------------------------------------------------------------------------
    def _op(self, stage: str, decl: Any, geom: Geometry, **values: Any) -> Op:
        pack = decl.pack(**values)   # the launcher reads the pack's memory: the closure keeps it alive
        run = launcher(self.gpu, self._kernels[decl.name], geom.block, geom.shared, pack)
        grid = geom.grid
        return stage, lambda s, _pack=pack: run(s, *grid)

    @staticmethod
    def _gemm(stage: str, run: Callable[[int, int, int], None], act: int, m: int) -> Op:
        return stage, lambda s: run(act, m, s)

    def all_logits(self) -> int:
        """The address of a ``[max_m, vocab]`` bf16 buffer that :meth:`head_ops` ``(all_rows=True)`` fills (made on
        first use)."""
        if self._all_logits is None:
            c = self.config
            self._all_logits = self._owned.enter_context(cm.DeviceBuffer(2 * self.max_m * c.vocab_size)).ptr
            self._head_all = proj_dense(self.gpu, self.w.output, self._all_logits, c.vocab_size, c.dim, self.max_m)
        return self._all_logits

    # -- the pass --------------------------------------------------------------------------------------
    def embed_ops(self, ids: int, m: int) -> list[Op]:
        """x, h of ``m`` tokens whose ids are i32 at device address ``ids`` (``state`` for a decode step)."""
        c = self.config
        return [self._op("embed", km.MODEL_EMBED_NORM, km.row_geometry(m), ids=ids, embed=self.w.embed,
                         gain=self.w.layers[0].attn_norm, x=self.x, h=self.h, m=m, dim=c.dim, vocab=c.vocab_size,
                         eps=c.norm_eps, next_gain=self.w.layers[0].ffn_norm)]

    def pre_ops(self, layer: int, m: int, k_cache: int, v_cache: int, cache_rows: int, row_stride: int | None = None,
                kvh_stride: int | None = None) -> list[Op]:
        """Layer ``layer``'s q/k/v for ``m`` rows at positions state.pos ...: q into ``q``, k and v into the cache
        rows ``pos % cache_rows`` of ``k_cache`` / ``v_cache`` (bf16, element (row, kv head, d) at ``row *
        row_stride + kv_head * kvh_stride + d``; by default positional ``[cache_rows, n_kv_head, head_dim]``)."""
        c = self.config
        strides = km.positional_strides(c.n_kv_head, c.head_dim)
        if row_stride is not None:
            strides["row_stride"] = row_stride
        if kvh_stride is not None:
            strides["kvh_stride"] = kvh_stride
        return [self.qkv_op(layer, m),
                self._op("rope+kv", km.MODEL_ROPE_KV, km.row_geometry(m), qkv=self.qkv, cos_t=self.w.rope_cos,
                         sin_t=self.w.rope_sin, state=self.state, q_out=self.q, k_cache=k_cache, v_cache=v_cache,
                         m=m, n_head=c.n_head, n_kv_head=c.n_kv_head, head_dim=c.head_dim,
                         max_pos=c.context_length, cache_rows=cache_rows, **strides)]

    def qkv_op(self, layer: int, m: int) -> Op:
        """Layer ``layer``'s QKV projection of ``h`` into ``qkv`` (un-rotated rows: a KV mode that fuses the RoPE
        into its attention takes them from there)."""
        return self._gemm("gemm qkv", self._gemms[layer][0], self.h, m)

    def prefill_attn_op(self, m: int, k_cache: int, v_cache: int, q_start: int) -> Op:
        """Causal attention of ``m`` query rows at positions ``q_start ...`` over cache rows ``0 .. q_start + m -
        1`` (positional caches), into ``attn``."""
        c = self.config
        return self._op("attention", km.MODEL_PREFILL_ATTN, km.prefill_attn_geometry(m, c.n_head), q=self.q,
                        k_cache=k_cache, v_cache=v_cache, out=self.attn, m=m, n_head=c.n_head,
                        n_kv_head=c.n_kv_head, head_dim=c.head_dim, q_start=q_start)

    def post_ops(self, layer: int, m: int) -> list[Op]:
        """From ``attn`` to the next layer's normed input ``h`` (the final norm after the last layer)."""
        c, lw = self.config, self.w.layers[layer]
        last = layer + 1 == c.n_layer
        nxt = self.w.final_norm if last else self.w.layers[layer + 1].attn_norm
        _, wo, wgu, wdown = self._gemms[layer]
        norm = lambda gain, then: self._op(   # noqa: E731   (then: the next norm's gain, prefetched)
            "norm", km.MODEL_ADD_NORM, km.row_geometry(m), x=self.x, delta=self.delta, gain=gain, h=self.h, m=m,
            dim=c.dim, eps=c.norm_eps, next_gain=then)
        return [self._gemm("gemm o", wo, self.attn, m), norm(lw.ffn_norm, nxt),
                self._gemm("gemm ffn", wgu, self.h, m),
                self._op("silu*up", km.MODEL_SILU_MUL, km.silu_geometry(m, c.ffn_dim), gu=self.gu, act=self.act, m=m,
                         ffn=c.ffn_dim),
                self._gemm("gemm ffn", wdown, self.act, m), norm(nxt, 0 if last else self.w.layers[layer + 1].ffn_norm)]

    def head_ops(self, rows: int, advance: int, all_rows: bool = False, sampler: Sampler | None = None,
                 sampler_row: int = 0) -> list[Op]:
        """Logits of row ``rows - 1`` of ``h`` (``all_rows``: of every row, into :meth:`all_logits`), then the greedy
        token (bf16 near ties recomputed in f32 from that row of ``h`` and the LM head) into ``state.token`` and
        ``state.pos += advance``. ``sampler``: its draw (with its row ``sampler_row``) in place of the argmax."""
        c = self.config
        h = self.h + 2 * (rows - 1) * c.dim
        if all_rows:
            logits = self.all_logits() + 2 * (rows - 1) * c.vocab_size
            head = self._gemm("lm head", self._head_all, self.h, rows)
        else:
            logits = self.logits
            head = self._gemm("lm head", self._head, h, 1)
        if sampler is not None:
            return [head, sampler.op(logits, state=self.state, m=1, h=h, weight=self.w.output, dim=c.dim,
                                     advance=advance, row=sampler_row)]
        return [head, self._op("argmax", km.MODEL_ARGMAX, km.argmax_geometry(), logits=logits, h=h,
                               weight=self.w.output, vocab=c.vocab_size, dim=c.dim, state=self.state,
                               advance=advance, m=1, state_stride=1, rows=0)]

    # -- a batch of sequences, one decode row each (hss.model.batch) ----------------------------------------
    def rows_rope_op(self, m: int, state: int, state_stride: int, k_pool: int, v_pool: int, tables: int,
                     table_stride: int, block_size: int, strides: tuple[int, int, int]) -> Op:
        """``model_rope_kv_paged`` of ``m`` rows of ``qkv``: row r at its own position (word 1 of its state row:
        ``state`` i32 word-major, ``state_stride`` apart) into ``q`` and its own page of the pools (``tables`` i32
        ``[m, table_stride]``; ``strides`` (blk, tok, kvh) in elements)."""
        c = self.config
        blk, tok, kvh = strides
        return self._op("rope+kv", km.MODEL_ROPE_KV_PAGED, km.row_geometry(m), qkv=self.qkv, cos_t=self.w.rope_cos,
                        sin_t=self.w.rope_sin, state=state, q_out=self.q, k_pool=k_pool, v_pool=v_pool,
                        tables=tables, m=m, n_head=c.n_head, n_kv_head=c.n_kv_head, head_dim=c.head_dim,
                        max_pos=c.context_length, state_stride=state_stride, block_size=block_size,
                        table_stride=table_stride, blk_stride=blk, tok_stride=tok, kvh_stride=kvh)

    def rows_head_ops(self, m: int, logits: int, max_rows: int, state: int, state_stride: int, rows: int,
                      sampler: Sampler | None = None) -> list[Op]:
        """The LM head of the first ``m`` rows of ``h`` (one GEMM) into ``logits`` bf16 ``[max_rows, vocab]``, then
        each row's greedy token into its state row (``model_argmax`` over ``m`` rows; rows at or past the device
        count ``rows`` (i32 [1]) are left alone) and its position advanced by one. ``sampler``: row r's token is
        the draw of the sampler's row r instead (the same rows left alone)."""
        c = self.config
        run = self._rows_heads.get((logits, max_rows))
        if run is None:
            run = self._rows_heads[logits, max_rows] = proj_dense(self.gpu, self.w.output, logits, c.vocab_size,
                                                                  c.dim, max_rows)
        head = self._gemm("lm head", run, self.h, m)
        if sampler is not None:
            return [head, sampler.op(logits, state=state, m=m, h=self.h, weight=self.w.output, dim=c.dim,
                                     state_stride=state_stride, advance=1, rows=rows)]
        return [head,
                self._op("argmax", km.MODEL_ARGMAX, km.argmax_geometry(m), logits=logits, h=self.h,
                         weight=self.w.output, vocab=c.vocab_size, dim=c.dim, state=state, advance=1, m=m,
                         state_stride=state_stride, rows=rows)]

    def close(self) -> None:
        """Free the workspace (idempotent)."""
        self._owned.close()
