"""Float64 references for the QSA indexer (docs/design.md §10, §12.1-12.4).

Two kinds of reference live here:

* **staged kernel references** (``block_pool``, ``qprep``, ``score``, ``gather``): each starts from the
  inputs a kernel actually reads (bf16 or f32 arrays as stored on the device) and computes in float64,
  unrounded, so a test judges one kernel at a time (docs/design.md §0);
* **the model** (``indexer_step``): docs/design.md §10's forward for one query, run end to end in float64 from the
  weights and hidden states (projection, RMS norm with ``(1 + w)``, RoPE with double-precision angles,
  block pooling, relu-summed scores, top-k by (score desc, index asc), tokens + tail).

Imports only numpy and ml_dtypes. Layouts are the kernels': row-major, outermost first.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["rope_inv_freq", "rope", "rms_norm", "block_pool", "qprep", "score", "gather", "select_blocks",
           "expand_tokens", "IndexerStep", "indexer_step"]


def _f64(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, dtype=np.float64)


def rope_inv_freq(rot: int, theta: float) -> np.ndarray:
    """``[rot // 2]`` inverse frequencies ``theta^(-2j/rot)`` = ``exp(-(2j/rot) ln theta)``, float64."""
    j = np.arange(rot // 2, dtype=np.float64)
    return np.exp(-(2.0 * j / rot) * np.log(float(theta)))


def rope(x: np.ndarray, pos, rot: int, theta: float) -> np.ndarray:
    """Rotate-half RoPE on the first ``rot`` dims of ``x [..., hd]`` at ``pos`` (a scalar, or an array
    broadcasting against ``x[..., 0]``); dims ``rot..hd-1`` pass through. Angles in float64."""
    x = _f64(x)
    out = x.copy()
    if rot == 0:
        return out
    half = rot // 2
    ang = np.asarray(pos, dtype=np.float64)[..., None] * rope_inv_freq(rot, theta)   # [..., half]
    c, s = np.cos(ang), np.sin(ang)
    x1, x2 = x[..., :half], x[..., half:rot]
    out[..., :half] = x1 * c - x2 * s
    out[..., half:rot] = x2 * c + x1 * s
    return out


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """``x * 1/sqrt(mean(x^2) + eps) * (1 + w)`` over the last axis (the Qwen4Exp RMS norm; w is an offset from 1)."""
    x = _f64(x)
    ms = np.mean(x * x, axis=-1, keepdims=True)
    return x / np.sqrt(ms + float(eps)) * (1.0 + _f64(w))


def block_pool(raw_keys: np.ndarray, k_norm_w: np.ndarray, first_block: int, n_new: int, ratio: int, rot: int,
               theta: float, eps: float) -> np.ndarray:
    """``qsa_block_pool``: keys of blocks ``first_block .. first_block + n_new - 1`` -> ``[n_new, hd]``.

    ``raw_keys [tokens, hd]`` (bf16 as stored, at least ``(first_block + n_new) * ratio`` rows). Block b: the
    mean of its ``ratio`` raw keys, RMS-normed with ``(1 + k_norm_w)``, roped at its first token ``b * ratio``.
    """
    hd = raw_keys.shape[-1]
    rows = _f64(raw_keys[first_block * ratio:(first_block + n_new) * ratio]).reshape(n_new, ratio, hd)
    mean = rows.sum(axis=1) / ratio
    pos = (first_block + np.arange(n_new, dtype=np.float64)) * ratio
    return rope(rms_norm(mean, k_norm_w, eps), pos, rot, theta)


def qprep(q_in: np.ndarray, q_norm_w: np.ndarray, pos: int, rot: int, theta: float, eps: float) -> np.ndarray:
    """``qsa_qprep``: ``q_in [n_heads, hd]`` (bf16 as stored) -> normed, roped queries ``[n_heads, hd]``."""
    return rope(rms_norm(q_in, q_norm_w, eps), pos, rot, theta)


def score(q: np.ndarray, block_keys: np.ndarray) -> np.ndarray:
    """``qsa_score``: ``[n]`` = sum over heads of relu(q[h] . k[b]) / sqrt(hd).

    ``q [n_heads, hd]`` (f32 as stored), ``block_keys [n, hd]`` (bf16 as stored). The relu is ``fmax(dot, 0)``
    as in the kernel (a NaN dot counts as 0)."""
    q, k = _f64(q), _f64(block_keys)
    dots = k @ q.T                                   # [n, n_heads]
    return np.fmax(dots, 0.0).sum(axis=1) / np.sqrt(q.shape[-1])


def gather(k_cache: np.ndarray, v_cache: np.ndarray, block_table: np.ndarray, sel: np.ndarray,
           block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """``qsa_gather``: rows of the paged NHD caches ``[pages, block_size, nkv, hd]`` for tokens ``sel``,
    through ``block_table`` (logical page -> physical page) -> ``(k_out, v_out)`` ``[n_sel, nkv, hd]``
    (exact copies)."""
    sel = np.asarray(sel, dtype=np.int64)
    pages = np.asarray(block_table, dtype=np.int64)[sel // block_size]
    slots = sel % block_size
    return k_cache[pages, slots].copy(), v_cache[pages, slots].copy()


def select_blocks(scores: np.ndarray, block_topk: int) -> np.ndarray:
    """Top ``min(block_topk, n)`` block ids of ``scores [n]`` by (score desc, index asc), sorted ascending
    (no NaN handling: the reference's scores are finite)."""
    s = _f64(scores)
    order = np.lexsort((np.arange(s.size), -s))
    return np.sort(order[:min(block_topk, s.size)])


def expand_tokens(blocks: np.ndarray, ratio: int, visible: int) -> np.ndarray:
    """Tokens of ``blocks`` (ascending) followed by the tail ``complete*ratio .. visible-1``, int64."""
    complete = visible // ratio
    toks = (np.asarray(blocks, dtype=np.int64)[:, None] * ratio + np.arange(ratio)).ravel()
    return np.concatenate([toks, np.arange(complete * ratio, visible, dtype=np.int64)])


@dataclass
class IndexerStep:
    """docs/design.md §10 for one query: every intermediate in float64, and the allowed token set."""
    qk: np.ndarray           # [visible, (n_heads + 1) * hd] projections of the visible tokens
    raw_keys: np.ndarray     # [visible, hd]
    block_keys: np.ndarray   # [complete, hd]
    q: np.ndarray            # [n_heads, hd] normed, roped query
    scores: np.ndarray       # [complete]
    blocks: np.ndarray       # selected block ids, ascending (all blocks in the inert regime)
    tokens: np.ndarray       # allowed tokens, ascending (int64)
    inert: bool              # complete <= block_topk: every visible token is allowed


def indexer_step(hidden: np.ndarray, qk_proj_w: np.ndarray, q_norm_w: np.ndarray, k_norm_w: np.ndarray, pos: int,
                 n_heads: int, hd: int, ratio: int, budget: int, rot: int, theta: float, eps: float) -> IndexerStep:
    """The indexer forward (docs/design.md §10) for the query at 0-based ``pos`` from ``hidden [>= pos + 1, H]`` (the
    attention layer's input rows) and ``qk_proj_w [(n_heads + 1) * hd, H]``; no intermediate rounding."""
    visible = pos + 1
    qk = _f64(hidden[:visible]) @ _f64(qk_proj_w).T
    raw = qk[:, n_heads * hd:(n_heads + 1) * hd]
    complete = visible // ratio
    block_keys = block_pool(raw, k_norm_w, 0, complete, ratio, rot, theta, eps)
    q = qprep(qk[pos, :n_heads * hd].reshape(n_heads, hd), q_norm_w, pos, rot, theta, eps)
    scores = score(q, block_keys)
    block_topk = budget // ratio
    blocks = select_blocks(scores, block_topk)
    return IndexerStep(qk, raw, block_keys, q, scores, blocks, expand_tokens(blocks, ratio, visible),
                       complete <= block_topk)
