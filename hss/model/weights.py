"""A decoder's weights on the device, uploaded once: matrices and the embedding as bf16, norm gains and the RoPE
tables as f32 (:class:`DeviceWeights`), and :func:`bf16_rounded`, the host weights the device computes with.

Per layer the projections that read the same input are one matrix: ``wqkv`` = ``wq | wk | wv`` rows (``[(n_head +
2 n_kv_head) head_dim, dim]``) and ``wgu`` = ``w_gate | w_up`` rows (``[2 ffn_dim, dim]``), so a layer is four GEMMs.
Every matrix keeps the ``[out, in]`` layout of :class:`hss.checkpoint.Weights`, which is what
``cublas_bf16_proj_dense`` takes as ``weight [n, k]``.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import ml_dtypes
import numpy as np

from hss import cuda_min as cm
from hss._util import Closeable
from hss.checkpoint import Config, Weights
from hss.checkpoint.forward import rope_cos_sin
from hss.errors import HssError

__all__ = ["DeviceWeights", "LayerBuffers", "bf16_rounded"]

BF16 = ml_dtypes.bfloat16


def bf16_rounded(weights: Weights) -> Weights:
    """``weights`` with every matrix and the embedding rounded once to bf16 (returned as float32): the values the
    device computes with. Norm gains stay float32, as :class:`DeviceWeights` keeps them."""
    def r(a: np.ndarray) -> np.ndarray:
        return np.asarray(a, np.float32).astype(BF16).astype(np.float32)

    layers = tuple(dataclasses.replace(layer, wq=r(layer.wq), wk=r(layer.wk), wv=r(layer.wv), wo=r(layer.wo),
                                       w_gate=r(layer.w_gate), w_up=r(layer.w_up), w_down=r(layer.w_down))
                   for layer in weights.layers)
    return dataclasses.replace(weights, embed=r(weights.embed), layers=layers,
                               lm_head=None if weights.lm_head is None else r(weights.lm_head))


@dataclasses.dataclass(frozen=True)
class LayerBuffers:
    """One layer's device addresses: ``wqkv``, ``wo``, ``wgu``, ``wdown`` bf16; ``attn_norm``, ``ffn_norm`` f32."""
    wqkv: int
    wo: int
    wgu: int
    wdown: int
    attn_norm: int
    ffn_norm: int


class DeviceWeights(Closeable):
    """``weights`` on the device of ``ctx``, uploaded on ``stream`` (asynchronously: the host copies may be dropped
    at once, the driver stages pageable memory). ``layers[l]``: :class:`LayerBuffers`; ``embed`` bf16 ``[vocab,
    dim]``; ``output`` the LM head bf16 ``[vocab, dim]`` (``embed`` when tied); ``final_norm`` f32 ``[dim]``;
    ``rope_cos`` / ``rope_sin`` f32 ``[context_length, head_dim / 2]`` (angles in float64, as
    :func:`hss.checkpoint.forward.rope_cos_sin`). ``bytes``: device bytes held. ``close()`` frees them (idempotent).
    """

    def __init__(self, weights: Weights, stream: Any, ctx: cm.CudaCtx | None = None) -> None:
        if not isinstance(weights, Weights):
            raise TypeError(f"weights must be a hss.checkpoint.Weights, got {type(weights).__name__}")
        self.config: Config = weights.config
        c = self.config
        if c.dim > 2**16 or c.vocab_size >= 2**31 or c.context_length >= 2**31:
            raise HssError(f"DeviceWeights: {c} is outside what the kernels index with int32")
        self._owned = contextlib.ExitStack()
        self.bytes = 0
        try:
            up = lambda a, dtype: self._upload(np.ascontiguousarray(a, dtype=dtype), stream, ctx)   # noqa: E731
            self.layers = tuple(LayerBuffers(
                wqkv=up(np.concatenate([layer.wq, layer.wk, layer.wv]), BF16), wo=up(layer.wo, BF16),
                wgu=up(np.concatenate([layer.w_gate, layer.w_up]), BF16), wdown=up(layer.w_down, BF16),
                attn_norm=up(layer.attn_norm, np.float32), ffn_norm=up(layer.ffn_norm, np.float32))
                for layer in weights.layers)
            self.embed = up(weights.embed, BF16)
            self.output = self.embed if weights.lm_head is None else up(weights.lm_head, BF16)
            self.final_norm = up(weights.final_norm, np.float32)
            cos, sin = rope_cos_sin(np.arange(c.context_length), c.head_dim, c.rope_theta, np.float32)
            self.rope_cos, self.rope_sin = up(cos, np.float32), up(sin, np.float32)
        except BaseException:
            self._owned.close()
            raise

    def _upload(self, arr: np.ndarray, stream: Any, ctx: cm.CudaCtx | None) -> int:
        buf = self._owned.enter_context(cm.DeviceBuffer(arr.nbytes, ctx))
        cm.copy_h_to_d_async(buf, arr, arr.nbytes, stream)
        self.bytes += arr.nbytes
        return buf.ptr

    def close(self) -> None:
        """Free every buffer (idempotent)."""
        self._owned.close()
