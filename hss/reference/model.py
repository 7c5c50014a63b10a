"""float64 references of the decoder-forward kernels (``ptx/model.cu``, :mod:`hss.decls.model`).

Each takes the kernel's inputs as stored (bf16 / f32 arrays read back) and returns float64 results; the caller
rounds once to the kernel's output dtype. Shapes row-major; q head ``h`` reads kv head ``h // (n_head //
n_kv_head)`` (Hugging Face ``repeat_kv`` order), RoPE is rotate-half (element ``j`` pairs with ``j + head_dim/2``).
"""
from __future__ import annotations

import numpy as np

__all__ = ["rms_norm", "embed_norm", "add_norm", "rope", "rope_kv", "paged_slots", "silu_mul", "argmax", "bf16_ulp",
           "argmax_candidates", "argmax_refined", "argmax_rows", "causal_attention"]


def rms_norm(x: np.ndarray, gain: np.ndarray, eps: float) -> np.ndarray:
    """``x / sqrt(mean(x^2) + eps) * gain`` over the last axis, float64."""
    x = np.asarray(x, dtype=np.float64)
    ms = np.mean(x * x, axis=-1, keepdims=True)
    return x / np.sqrt(ms + float(eps)) * np.asarray(gain, dtype=np.float64)


def embed_norm(ids: np.ndarray, embed: np.ndarray, gain: np.ndarray, eps: float) -> tuple[np.ndarray, np.ndarray]:
    """(x, h): the embedding rows ``embed[ids]`` ``[m, dim]`` and their RMSNorm."""
    x = np.asarray(embed)[np.asarray(ids, dtype=np.int64)].astype(np.float64)   # the rows only: embed may be big
    return x, rms_norm(x, gain, eps)


def add_norm(x: np.ndarray, delta: np.ndarray, gain: np.ndarray, eps: float) -> tuple[np.ndarray, np.ndarray]:
    """(x + delta, RMSNorm of it); the kernel rounds the sum to f32 once and normalises the rounded sum, so pass
    that (``np.float32(x + delta)``) to :func:`rms_norm` for a staged reference of ``h``."""
    s = np.asarray(x, dtype=np.float64) + np.asarray(delta, dtype=np.float64)
    return s, rms_norm(s.astype(np.float32), gain, eps)


def rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotate-half RoPE of ``x [T, heads, head_dim]`` with tables ``cos``/``sin`` ``[T, head_dim // 2]``."""
    x = np.asarray(x, dtype=np.float64)
    half = x.shape[-1] // 2
    c = np.asarray(cos, dtype=np.float64)[:, None, :]
    s = np.asarray(sin, dtype=np.float64)[:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


def rope_kv(qkv: np.ndarray, cos: np.ndarray, sin: np.ndarray, pos0: int, n_head: int, n_kv_head: int,
            head_dim: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(q, k, v) of ``qkv [m, (n_head + 2 n_kv_head) head_dim]`` at positions ``pos0 ...``: q ``[m, n_head,
    head_dim]`` and k ``[m, n_kv_head, head_dim]`` rotated with the table rows ``pos0 .. pos0 + m - 1``, v as is."""
    qkv = np.asarray(qkv, dtype=np.float64)
    m = qkv.shape[0]
    q = qkv[:, :n_head * head_dim].reshape(m, n_head, head_dim)
    k = qkv[:, n_head * head_dim:(n_head + n_kv_head) * head_dim].reshape(m, n_kv_head, head_dim)
    v = qkv[:, (n_head + n_kv_head) * head_dim:].reshape(m, n_kv_head, head_dim)
    rows = slice(pos0, pos0 + m)
    return rope(q, cos[rows], sin[rows]), rope(k, cos[rows], sin[rows]), v


def paged_slots(tables: np.ndarray, pos: np.ndarray, block_size: int,
                max_pos: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(page, slot, live) of each batch row's token at position ``pos[r]`` in that row's pages ``tables[r]``
    (``[rows, entries]`` page ids in position order, ``block_size`` tokens a page): page ``tables[r, pos //
    block_size]``, slot ``pos % block_size``; ``live`` is False (page and slot 0) where the position is outside
    ``[0, max_pos)``, past the row's entries, or its page is negative: a row that is not written."""
    tables = np.asarray(tables, dtype=np.int64)
    pos = np.asarray(pos, dtype=np.int64)
    entries = tables.shape[1]
    at = np.where(pos >= 0, pos // block_size, -1)
    live = (pos >= 0) & (pos < max_pos) & (at < entries)
    page = np.where(live, tables[np.arange(pos.size), np.clip(at, 0, max(entries - 1, 0))] if entries else -1, -1)
    live &= page >= 0
    return np.where(live, page, 0), np.where(live, pos % block_size, 0), live


def silu_mul(gu: np.ndarray, ffn: int) -> np.ndarray:
    """``silu(gate) * up`` of ``gu [m, 2 ffn]`` (gate | up)."""
    gu = np.asarray(gu, dtype=np.float64)
    g, u = gu[:, :ffn], gu[:, ffn:2 * ffn]
    with np.errstate(over="ignore"):
        return g / (1.0 + np.exp(-g)) * u


def argmax(logits: np.ndarray) -> int:
    """The first index of the largest value (NaN never wins; all -inf or NaN: 0)."""
    x = np.asarray(logits, dtype=np.float64)
    x = np.where(np.isnan(x), -np.inf, x)
    if not x.size or not (x > -np.inf).any():
        return 0
    return int(np.argmax(x))


def bf16_ulp(v: float) -> float:
    """``2^(floor(log2 |v|) - 7)`` from ``v``'s f32 exponent bits, at least 2^-126 (model_argmax's ulp)."""
    e = int((np.array(v, np.float32).view(np.uint32) >> 23) & 0xFF) - 127
    return 2.0 ** max(e - 7, -126)


def argmax_candidates(logits: np.ndarray) -> np.ndarray:
    """The tokens whose unrounded logit may be the largest: ``logits >= M - 2 ulp(M)`` (ascending; empty when every
    logit is -inf or NaN)."""
    x = np.asarray(logits, dtype=np.float64)
    x = np.where(np.isnan(x), -np.inf, x)
    if not x.size or not (x > -np.inf).any():
        return np.zeros(0, np.int64)
    top = x.max()
    return np.flatnonzero(x >= top - 2 * bf16_ulp(top))


def argmax_refined(logits: np.ndarray, h: np.ndarray, weight: np.ndarray, cap: int) -> int:
    """model_argmax's token: among :func:`argmax_candidates` of the bf16 ``logits [vocab]``, the largest float64 dot
    of ``h [dim]`` with ``weight[i] [dim]`` (the first on equal values); more than ``cap`` candidates: the first
    index of the largest logit; none: 0."""
    cand = argmax_candidates(logits)
    if not cand.size:
        return 0
    if cand.size > cap:
        return argmax(logits)
    refined = np.asarray(weight)[cand].astype(np.float64) @ np.asarray(h, dtype=np.float64)
    return int(cand[int(np.argmax(refined))])


def argmax_rows(logits: np.ndarray, h: np.ndarray, weight: np.ndarray, cap: int) -> np.ndarray:
    """:func:`argmax_refined` of each row: logits ``[m, vocab]``, h ``[m, dim]`` → int64 tokens ``[m]``."""
    return np.array([argmax_refined(lg, hr, weight, cap) for lg, hr in zip(logits, h)], np.int64)


def causal_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, q_start: int) -> np.ndarray:
    """Causal GQA attention of ``q [m, n_head, hd]`` (positions ``q_start ...``) over ``k``, ``v`` ``[S, n_kv_head,
    hd]`` (cache rows = positions): row i attends rows ``0 .. q_start + i``. Returns ``[m, n_head, hd]``."""
    q = np.asarray(q, dtype=np.float64)
    k = np.asarray(k, dtype=np.float64)
    v = np.asarray(v, dtype=np.float64)
    m, n_head, hd = q.shape
    n_kv = k.shape[1]
    rep = n_head // n_kv
    qg = q.reshape(m, n_kv, rep, hd).transpose(1, 2, 0, 3)                 # [kv, rep, m, hd]
    kg, vg = k.transpose(1, 0, 2)[:, None], v.transpose(1, 0, 2)[:, None]  # [kv, 1, S, hd]
    x = (qg @ kg.swapaxes(-1, -2)) / np.sqrt(hd)                           # [kv, rep, m, S]
    future = np.arange(k.shape[0])[None, :] > (q_start + np.arange(m))[:, None]
    x = np.where(future, -np.inf, x)
    p = np.exp(x - x.max(axis=-1, keepdims=True))
    out = (p @ vg) / p.sum(axis=-1, keepdims=True)
    return out.transpose(2, 0, 1, 3).reshape(m, n_head, hd)
