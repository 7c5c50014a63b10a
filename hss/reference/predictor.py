"""Float64 references for the predictor kernels (docs/design.md §5.1-5.4).

Inputs are the values a kernel actually reads (bf16 arrays, or anything numpy converts); everything is
computed in float64 and returned unrounded, so a test can judge one kernel at a time (docs/design.md §0, staged
references). Layouts are the kernels': row-major, outermost first.
"""
from __future__ import annotations

import numpy as np

__all__ = ["project_q", "project_kv_block", "predictor_score", "predictor_score_heads", "head_max", "head_combine",
           "head_normalised_score", "ground_truth_block_weights"]


def _f64(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, dtype=np.float64)


def project_q(q: np.ndarray, p: np.ndarray, heads_per_p: int | None = None) -> np.ndarray:
    """``q [num_q_heads, head_dim]`` projected to ``[num_q_heads, r]`` (no scaling).

    ``p``: one ``[head_dim, r]`` for every head (the original), or ``[G, head_dim, r]`` (docs/design.md §17.5): q head h
    uses ``p[h // heads_per_p]``; ``heads_per_p`` defaults to num_q_heads / G (the GQA ratio when G is the
    number of kv heads).
    """
    qq, pp = _f64(q), _f64(p)
    if pp.ndim == 2:
        return qq @ pp
    if heads_per_p is None:
        if qq.shape[0] % pp.shape[0]:
            raise ValueError(f"{qq.shape[0]} q heads do not split evenly over {pp.shape[0]} matrices")
        heads_per_p = qq.shape[0] // pp.shape[0]
    group = np.arange(qq.shape[0]) // heads_per_p
    return np.einsum("hi,hio->ho", qq, pp[group])


def project_kv_block(k_block: np.ndarray, p: np.ndarray) -> np.ndarray:
    """One NHD page ``k_block [block_size, num_kv_heads, head_dim]`` projected per token, in the A_g slot layout
    ``[num_kv_heads, block_size, r]``; ``p`` is one ``[head_dim, r]`` for every kv head (the original) or
    ``[num_kv_heads, head_dim, r]``, kv head j through ``p[j]`` (docs/design.md §17.5)."""
    k, pp = _f64(k_block), _f64(p)
    if pp.ndim == 2:
        return np.ascontiguousarray((k @ pp).transpose(1, 0, 2))
    return np.einsum("thi,hio->hto", k, pp)


def predictor_score(q_proj: np.ndarray, k_lr: np.ndarray, gqa_ratio: int) -> np.ndarray:
    """Block scores ``[n]``: for block b, the max over q head qh and token t of
    ``dot(q_proj[qh], k_lr[b, qh // gqa_ratio, t])``.

    ``q_proj [num_q_heads, r]``, ``k_lr [n, num_kv_heads, block_size, r]``. NaN dots are skipped and a
    block with no non-NaN dot scores -inf (the kernel's semantics), so setting one key row of ``k_lr``
    to NaN drops that token from its block's max.
    """
    q, k = _f64(q_proj), _f64(k_lr)
    n, nkv, _, _ = k.shape
    if q.shape[0] != gqa_ratio * nkv:
        raise ValueError(f"q_proj has {q.shape[0]} heads; expected gqa_ratio ({gqa_ratio}) x num_kv_heads ({nkv})")
    best = np.full(n, -np.inf)
    for h in range(nkv):
        dots = k[:, h] @ q[h * gqa_ratio:(h + 1) * gqa_ratio].T          # [n, block_size, gqa]
        best = np.fmax(best, np.fmax.reduce(dots.reshape(n, -1), axis=1, initial=-np.inf))
    return best


def predictor_score_heads(q_proj: np.ndarray, k_lr: np.ndarray, gqa_ratio: int) -> np.ndarray:
    """Per-head block scores ``[n, num_q_heads]``: entry (b, qh) is the max over token t of
    ``dot(q_proj[qh], k_lr[b, qh // gqa_ratio, t])`` (NaN dots skipped; none left: -inf). The max over qh of a row
    is :func:`predictor_score`."""
    q, k = _f64(q_proj), _f64(k_lr)
    n, nkv, bs, _ = k.shape
    if q.shape[0] != gqa_ratio * nkv:
        raise ValueError(f"q_proj has {q.shape[0]} heads; expected gqa_ratio ({gqa_ratio}) x num_kv_heads ({nkv})")
    out = np.empty((n, q.shape[0]))
    for h in range(nkv):
        dots = k[:, h] @ q[h * gqa_ratio:(h + 1) * gqa_ratio].T          # [n, block_size, gqa]
        out[:, h * gqa_ratio:(h + 1) * gqa_ratio] = np.fmax.reduce(dots, axis=1, initial=-np.inf)
    return out


def head_max(head_scores: np.ndarray) -> np.ndarray:
    """``[num_q_heads]``: each head's best block score over the ``[n, num_q_heads]`` per-head scores (NaN skipped;
    none left: -inf)."""
    return np.fmax.reduce(_f64(head_scores), axis=0, initial=-np.inf)


def head_combine(head_scores: np.ndarray, best: np.ndarray, exp2_scale: float) -> np.ndarray:
    """``[n]``: the sum over q heads of ``2 ** ((head_scores[b, qh] - best[qh]) * exp2_scale)``, a term whose
    exponent is NaN left out (so a head without a finite score adds nothing, and a block with none scores 0)."""
    hs, m = _f64(head_scores), _f64(best)
    with np.errstate(invalid="ignore"):
        x = (hs - m[None, :]) * float(exp2_scale)
    return np.where(np.isnan(x), 0.0, np.exp2(np.where(np.isnan(x), 0.0, x))).sum(axis=1)


def head_normalised_score(q_proj: np.ndarray, k_lr: np.ndarray, gqa_ratio: int, temperature: float) -> np.ndarray:
    """docs/design.md §17.5's per-head normalised block scores ``[n]`` end to end: ``sum over qh of exp((s[b, qh] -
    max_b' s[b', qh]) / temperature)`` with ``s`` = :func:`predictor_score_heads` (each head's best block adds 1)."""
    hs = predictor_score_heads(q_proj, k_lr, gqa_ratio)
    return head_combine(hs, head_max(hs), np.log2(np.e) / temperature)


def ground_truth_block_weights(q: np.ndarray, k_pages: np.ndarray, num_kv_heads: int | None = None) -> np.ndarray:
    """The recall oracle (docs/design.md §5.4): the attention mass of each KV block, max over q heads.

    ``q [num_q_heads, head_dim]`` (one decode query), ``k_pages [n, block_size, num_kv_heads, head_dim]``
    (NHD pages). Per q head qh (kv head qh // gqa): logits over every token = q.k / sqrt(head_dim),
    softmax over all tokens, block weight = the probability mass inside the block. Returns ``[n]``,
    the per-block max over q heads.
    """
    qq, k = _f64(q), _f64(k_pages)
    n, bs, nkv, hd = k.shape
    if num_kv_heads is not None and num_kv_heads != nkv:
        raise ValueError(f"k_pages has {nkv} kv heads, not {num_kv_heads}")
    gqa = qq.shape[0] // nkv
    if gqa * nkv != qq.shape[0]:
        raise ValueError(f"{qq.shape[0]} q heads is not a multiple of {nkv} kv heads")
    best = np.zeros(n)
    for qh in range(qq.shape[0]):
        logits = (k[:, :, qh // gqa, :] @ qq[qh]) / np.sqrt(hd)          # [n, bs]
        w = np.exp(logits - logits.max())
        best = np.maximum(best, w.sum(axis=1) / w.sum())
    return best
