"""The numpy forward pass of a Llama-style decoder (SmolLM2): causal GQA attention, rotate-half RoPE, SwiGLU.

One code path serves a whole sequence and incremental decoding: :func:`forward` appends its tokens to a
:class:`KVCache` (a fresh one when none is given) at positions ``cache.length ...``, so a prefill followed by
one-token steps gives the logits of the full-sequence forward. Math runs in ``dtype`` (float32 by default,
float64 for a reference).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from hss.checkpoint.model import Config, LayerWeights, Weights
from hss.checkpoint.tokenizer import Tokenizer
from hss.errors import HssError

__all__ = ["LayerQKV", "KVCache", "rms_norm", "silu", "rope_cos_sin", "apply_rope", "forward", "log_softmax",
           "cross_entropy", "greedy_generate"]


@dataclass(frozen=True)
class LayerQKV:
    """One layer's attention inputs for the tokens of one :func:`forward` call (queries and keys post-RoPE).

    ``q``: ``[T, n_head, head_dim]``; ``k``, ``v``: ``[T, n_kv_head, head_dim]``; ``positions``: ``[T]``.
    """

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    positions: np.ndarray


@dataclass
class KVCache:
    """Per-layer keys (post-RoPE) and values ``[length, n_kv_head, head_dim]`` of the tokens seen so far."""

    config: Config
    keys: list[np.ndarray] = field(default_factory=list)
    values: list[np.ndarray] = field(default_factory=list)
    length: int = 0

    def __post_init__(self) -> None:
        c = self.config
        if not self.keys:
            empty = np.zeros((0, c.n_kv_head, c.head_dim), np.float32)
            self.keys = [empty] * c.n_layer
            self.values = [empty] * c.n_layer


def rms_norm(x: np.ndarray, gain: np.ndarray, eps: float) -> np.ndarray:
    """``x / rms(x) * gain`` over the last axis (``x``: ``[..., dim]``, ``gain``: ``[dim]``)."""
    ms = np.mean(np.square(x), axis=-1, keepdims=True)
    return x / np.sqrt(ms + x.dtype.type(eps)) * gain.astype(x.dtype, copy=False)


def silu(x: np.ndarray) -> np.ndarray:
    """``x * sigmoid(x)`` (exp overflows to inf for very negative ``x``, which gives the right limit, -0)."""
    with np.errstate(over="ignore"):
        return x / (1 + np.exp(-x))


def rope_cos_sin(positions: np.ndarray, head_dim: int, theta: float, dtype: type = np.float32
                 ) -> tuple[np.ndarray, np.ndarray]:
    """RoPE tables ``[T, head_dim // 2]`` for ``positions`` ``[T]``: angle ``pos * theta ** (-2 i / head_dim)``.

    The angles are computed in float64 and rounded once to ``dtype``.
    """
    inv_freq = float(theta) ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    angles = np.asarray(positions, np.float64)[:, None] * inv_freq[None, :]
    return np.cos(angles).astype(dtype), np.sin(angles).astype(dtype)


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotate-half (NeoX / Hugging Face) RoPE: element ``i`` pairs with ``i + head_dim // 2``.

    ``x``: ``[T, heads, head_dim]``; ``cos``, ``sin``: ``[T, head_dim // 2]``.
    """
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


def _attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, start: int) -> np.ndarray:
    """Causal GQA attention of ``q`` ``[T, H, d]`` (at positions ``start ...``) over ``k``, ``v`` ``[S, Hkv, d]``.

    Query head ``h`` reads key/value head ``h // (H // Hkv)`` (Hugging Face ``repeat_kv`` order). Returns
    ``[T, H * d]``.
    """
    t, n_head, d = q.shape
    s, n_kv, _ = k.shape
    rep = n_head // n_kv
    qg = q.reshape(t, n_kv, rep, d).transpose(1, 2, 0, 3)           # [Hkv, rep, T, d]
    kg = k.transpose(1, 0, 2)[:, None]                              # [Hkv, 1, S, d]
    vg = v.transpose(1, 0, 2)[:, None]
    scores = (qg @ kg.swapaxes(-1, -2)) * q.dtype.type(1.0 / np.sqrt(d))   # [Hkv, rep, T, S]
    future = np.arange(s)[None, :] > (start + np.arange(t))[:, None]
    scores = np.where(future, -np.inf, scores)
    scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
    probs = scores / scores.sum(axis=-1, keepdims=True)
    out = probs @ vg                                                # [Hkv, rep, T, d]
    return out.transpose(2, 0, 1, 3).reshape(t, n_head * d)


def _block(layer: LayerWeights, x: np.ndarray, c: Config, cos: np.ndarray, sin: np.ndarray,
           cache: KVCache, index: int, start: int) -> tuple[np.ndarray, LayerQKV]:
    t = x.shape[0]
    h = rms_norm(x, layer.attn_norm, c.norm_eps)
    q = apply_rope((h @ layer.wq.T).reshape(t, c.n_head, c.head_dim), cos, sin)
    k = apply_rope((h @ layer.wk.T).reshape(t, c.n_kv_head, c.head_dim), cos, sin)
    v = (h @ layer.wv.T).reshape(t, c.n_kv_head, c.head_dim)
    keys = np.concatenate([cache.keys[index].astype(x.dtype, copy=False), k])
    values = np.concatenate([cache.values[index].astype(x.dtype, copy=False), v])
    cache.keys[index], cache.values[index] = keys, values
    x = x + _attention(q, keys, values, start) @ layer.wo.T
    h = rms_norm(x, layer.ffn_norm, c.norm_eps)
    x = x + (silu(h @ layer.w_gate.T) * (h @ layer.w_up.T)) @ layer.w_down.T
    return x, LayerQKV(q=q, k=k, v=v, positions=np.arange(start, start + t))


def forward(weights: Weights, token_ids: Sequence[int] | np.ndarray, *, cache: KVCache | None = None,
            capture: list[LayerQKV] | None = None, dtype: type = np.float32) -> np.ndarray:
    """Logits ``[T, vocab_size]`` (``dtype``) for ``token_ids`` ``[T]``, appended after ``cache``'s tokens.

    ``cache``: updated in place (``None``: a fresh one, so the call is a whole-sequence forward).
    ``capture``: when given, one :class:`LayerQKV` per layer is appended to it (post-RoPE Q and K, and V).
    """
    c = weights.config
    ids = np.asarray(token_ids)
    if ids.ndim != 1 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
        raise HssError(f"forward: token_ids must be a non-empty 1-D sequence of ints, got shape {ids.shape} "
                       f"dtype {ids.dtype}")
    if ids.min() < 0 or ids.max() >= c.vocab_size:
        raise HssError(f"forward: token ids must lie in [0, {c.vocab_size}), got [{ids.min()}, {ids.max()}]")
    cache = KVCache(c) if cache is None else cache
    if cache.config != c:
        raise HssError("forward: the cache was made for another config")
    start = cache.length
    if start + ids.size > c.context_length:
        raise HssError(f"forward: {start} cached + {ids.size} new tokens exceed the context length "
                       f"{c.context_length}")
    cos, sin = rope_cos_sin(np.arange(start, start + ids.size), c.head_dim, c.rope_theta, dtype)
    x = weights.embed[ids].astype(dtype)
    for index, layer in enumerate(weights.layers):
        x, qkv = _block(layer, x, c, cos, sin, cache, index, start)
        if capture is not None:
            capture.append(qkv)
    cache.length = start + ids.size
    return rms_norm(x, weights.final_norm, c.norm_eps) @ weights.output.T.astype(dtype, copy=False)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Log-probabilities over the last axis."""
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def cross_entropy(weights: Weights, token_ids: Sequence[int] | np.ndarray, dtype: type = np.float32) -> float:
    """Mean next-token cross-entropy (nats) of ``token_ids`` ``[T]``: token ``t + 1`` predicted from ``0..t``."""
    ids = np.asarray(token_ids)
    if ids.size < 2:
        raise HssError(f"cross_entropy: need at least 2 tokens, got {ids.size}")
    logp = log_softmax(forward(weights, ids[:-1], dtype=dtype).astype(np.float64))
    return float(-logp[np.arange(ids.size - 1), ids[1:]].mean())


def greedy_generate(weights: Weights, tok: Tokenizer | None, prompt_ids: Sequence[int], n: int) -> list[int]:
    """Up to ``n`` greedily decoded token ids after ``prompt_ids`` (prefill, then one token at a time).

    Stops after ``tok.eos_id`` (included in the result); ``tok=None`` never stops early.
    """
    if n < 0:
        raise HssError(f"greedy_generate: n must be >= 0, got {n}")
    cache = KVCache(weights.config)
    out: list[int] = []
    if n == 0:
        return out
    logits = forward(weights, prompt_ids, cache=cache)[-1]
    while True:
        next_id = int(np.argmax(logits))
        out.append(next_id)
        if len(out) == n or (tok is not None and next_id == tok.eos_id):
            return out
        logits = forward(weights, [next_id], cache=cache)[-1]
