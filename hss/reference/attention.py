"""References for tiled decode attention (docs/design.md §6.3-6.5): the original's online-softmax tile step, the
split + merge form the kernels compute (per-chunk partial states folded into the running state), finalize,
and plain softmax attention.

Shapes: ``q`` [num_q_heads, head_dim]; ``k``, ``v`` [num_tokens, num_kv_heads, head_dim] (the tokens in
the order the kernel consumes them); q head ``h`` reads kv head ``h // (num_q_heads // num_kv_heads)``.
The logit scale is 1/sqrt(head_dim). Everything is computed in float64.
"""
from __future__ import annotations

import numpy as np

__all__ = ["logits", "step_tile", "chunk_partials", "merge_partials", "finalize", "attention", "gather_tokens"]


def logits(q: np.ndarray, k: np.ndarray) -> np.ndarray:
    """``[num_tokens, num_q_heads]`` scaled dot products of every q head with its kv head's keys."""
    q = np.asarray(q, dtype=np.float64)
    k = np.asarray(k, dtype=np.float64)
    nq, hd = q.shape
    n, nkv = k.shape[:2]
    x = np.einsum("nkd,kgd->nkg", k, q.reshape(nkv, nq // nkv, hd))
    return x.reshape(n, nq) / np.sqrt(hd)


def step_tile(q: np.ndarray, k: np.ndarray, v: np.ndarray, m: np.ndarray, l: np.ndarray, o: np.ndarray,
              *, state_dtype: type | None = np.float32) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Apply tokens ``k``/``v`` to the running state ``(m, l, o)`` ([nq], [nq], [nq, hd]) token by token.

    Per token: ``m' = max(m, x)``, ``s_old = exp(m - m')``, ``s_new = exp(x - m')``,
    ``l' = l*s_old + s_new``, ``o' = o*s_old + v*s_new``, in float64. With ``state_dtype`` (the device's
    float32) the state is rounded to it after every token, as the kernel holds it, so any split of the
    tokens into tiles gives the same bits; ``None`` carries float64 throughout. Returns the new state.
    """
    x = logits(q, k)
    nq, hd = np.shape(q)
    nkv = np.shape(k)[1]
    v = np.asarray(v, dtype=np.float64)
    m = np.asarray(m, dtype=np.float64).copy()
    l = np.asarray(l, dtype=np.float64).copy()
    o = np.asarray(o, dtype=np.float64).reshape(nkv, nq // nkv, hd).copy()
    rnd = (lambda a: a.astype(state_dtype).astype(np.float64)) if state_dtype is not None else (lambda a: a)
    with np.errstate(invalid="ignore"):      # exp(-inf - -inf) never happens once a finite logit arrived
        for t in range(x.shape[0]):
            m_new = np.maximum(m, x[t])
            s_old = np.exp(m - m_new)
            s_new = np.exp(x[t] - m_new)
            l = rnd(l * s_old + s_new)
            o = rnd(o * s_old.reshape(nkv, -1, 1) + v[t][:, None, :] * s_new.reshape(nkv, -1, 1))
            m = rnd(m_new)
    return m, l, o.reshape(nq, hd)


def _rounder(state_dtype: type | None):
    return (lambda a: np.asarray(a).astype(state_dtype).astype(np.float64)) if state_dtype is not None else \
        (lambda a: np.asarray(a, dtype=np.float64))


def chunk_partials(q: np.ndarray, k: np.ndarray, v: np.ndarray, chunk: int, *,
                   state_dtype: type | None = np.float32) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Partial softmax states of consecutive ``chunk``-token pieces of ``k``/``v``.

    Returns ``m`` [C, nq] (max logit of the chunk), ``l`` [C, nq] (sum of p = exp(x - m)) and ``o``
    [C, nq, hd] (sum of p*v), C = ceil(num_tokens / chunk). With ``state_dtype`` (the device's float32), m is
    rounded before p is formed and l, o are rounded once, as the kernel stores them.
    """
    x = logits(q, k)                                    # [N, nq]
    nq, hd = np.shape(q)
    n, nkv = np.shape(k)[:2]
    rnd = _rounder(state_dtype)
    vv = np.asarray(v, dtype=np.float64)
    c = -(-n // chunk)
    m, l, o = np.empty((c, nq)), np.empty((c, nq)), np.empty((c, nq, hd))
    for i in range(c):
        xs = x[i * chunk:(i + 1) * chunk]
        m[i] = rnd(xs.max(axis=0))
        p = np.exp(xs - m[i])
        l[i] = rnd(p.sum(axis=0))
        o[i] = rnd(np.einsum("nkg,nkd->kgd", p.reshape(-1, nkv, nq // nkv),
                             vv[i * chunk:(i + 1) * chunk]).reshape(nq, hd))
    return m, l, o


def merge_partials(m: np.ndarray, l: np.ndarray, o: np.ndarray, pm: np.ndarray, pl: np.ndarray, po: np.ndarray,
                   *, state_dtype: type | None = np.float32) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Fold partial states ``pm``/``pl`` [C, nq], ``po`` [C, nq, hd] into the running state ``(m, l, o)``:
    M = max(m, pm), l' = l*exp(m - M) + sum_c pl_c*exp(pm_c - M), o' likewise. No chunks: the state as is."""
    m = np.asarray(m, dtype=np.float64)
    if len(pm) == 0:
        return m, np.asarray(l, dtype=np.float64), np.asarray(o, dtype=np.float64)
    rnd = _rounder(state_dtype)
    big = np.maximum(m, np.max(pm, axis=0))
    s_old = np.exp(m - big)                             # m = -inf (fresh state): 0
    w = np.exp(np.asarray(pm, dtype=np.float64) - big)  # [C, nq]
    l2 = rnd(np.asarray(l, dtype=np.float64) * s_old + (np.asarray(pl, dtype=np.float64) * w).sum(axis=0))
    o2 = rnd(np.asarray(o, dtype=np.float64) * s_old[:, None] + np.einsum("cn,cnd->nd", w, np.asarray(po, np.float64)))
    return rnd(big), l2, o2


def finalize(l: np.ndarray, o: np.ndarray) -> np.ndarray:
    """``o / l`` per row, 0 where ``l`` is 0 (no token was attended); float64 ``[..., head_dim]``."""
    l = np.asarray(l, dtype=np.float64)
    inv = np.divide(1.0, l, out=np.zeros_like(l), where=l > 0)
    return np.asarray(o, dtype=np.float64) * inv[..., None]


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Plain softmax attention of ``q`` over all ``k``/``v`` tokens: ``[num_q_heads, head_dim]`` float64
    (zeros when there are no tokens)."""
    q = np.asarray(q, dtype=np.float64)
    nq, hd = q.shape
    n, nkv = k.shape[:2]
    if n == 0:
        return np.zeros((nq, hd))
    x = logits(q, k)                                   # [N, nq]
    w = np.exp(x - x.max(axis=0, keepdims=True))
    w /= w.sum(axis=0, keepdims=True)
    out = np.einsum("nkg,nkd->kgd", w.reshape(n, nkv, nq // nkv), np.asarray(v, dtype=np.float64))
    return out.reshape(nq, hd)


def gather_tokens(pool: np.ndarray, pages: np.ndarray, slots: np.ndarray, strides: tuple[int, int, int],
                  num_kv_heads: int, head_dim: int) -> np.ndarray:
    """``[len(pages), num_kv_heads, head_dim]`` rows of a flat ``pool`` at ``(pages[i], slots[i])``.

    ``strides`` = (blk, tok, kvh) in elements: element (page, tok, kv_head, d) is at
    page*blk + tok*tok + kv_head*kvh + d. Raises IndexError when a row falls outside ``pool``.
    """
    blk, tok, kvh = (int(s) for s in strides)
    base = np.asarray(pages, dtype=np.int64) * blk + np.asarray(slots, dtype=np.int64) * tok
    idx = base[:, None, None] + (np.arange(num_kv_heads) * kvh)[None, :, None] + np.arange(head_dim)[None, None, :]
    if idx.size and (idx.min() < 0 or idx.max() >= pool.size):
        raise IndexError(f"rows reach elements [{idx.min()}, {idx.max()}] of a {pool.size}-element pool")
    return pool[idx]
