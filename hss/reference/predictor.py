"""Float64 references for the predictor kernels (SPEC §5.1-5.4).

Inputs are the values a kernel actually reads (bf16 arrays, or anything numpy converts); everything is
computed in float64 and returned unrounded, so a test can judge one kernel at a time (SPEC §0, staged
references). Layouts are the kernels': row-major, outermost first.
"""
from __future__ import annotations

import numpy as np

__all__ = ["project_q", "project_kv_block", "predictor_score", "ground_truth_block_weights"]


def _f64(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, dtype=np.float64)


def project_q(q: np.ndarray, p: np.ndarray) -> np.ndarray:
    """``q [num_q_heads, head_dim] @ p [head_dim, r]`` -> ``[num_q_heads, r]`` (no scaling)."""
    return _f64(q) @ _f64(p)


def project_kv_block(k_block: np.ndarray, p: np.ndarray) -> np.ndarray:
    """One NHD page ``k_block [block_size, num_kv_heads, head_dim]`` projected per token through
    ``p [head_dim, r]``, in the A_g slot layout ``[num_kv_heads, block_size, r]``."""
    return np.ascontiguousarray((_f64(k_block) @ _f64(p)).transpose(1, 0, 2))


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


def ground_truth_block_weights(q: np.ndarray, k_pages: np.ndarray, num_kv_heads: int | None = None) -> np.ndarray:
    """The recall oracle (SPEC §5.4): the attention mass of each KV block, max over q heads.

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
