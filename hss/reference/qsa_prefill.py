"""Float64 references for the QSA prefill kernels (docs/design.md §12.5-12.8, §11.5), staged from each kernel's inputs.

Every function takes the values a kernel actually reads (bf16 arrays, f32 arrays, or anything numpy
converts) and computes in float64, unrounded, so a test judges one kernel at a time (docs/design.md §0). Layouts
are the kernels': row-major, outermost first. Scalars that the kernels take as f32 (theta, eps,
inv_sqrt_d) are used at their float32 values.

Self-contained on purpose (the decode-side reference may carry the same norm/RoPE helpers).
"""
from __future__ import annotations

import ml_dtypes
import numpy as np

__all__ = ["MASKED", "rms_norm", "rope", "qprep_rows", "complete_counts", "score_rows", "split_hi_lo",
           "selected_tokens", "gather_rows", "attend", "prefill_attn", "topk_lists", "prefill_select_attention"]

MASKED = float(np.float32(-1e30))   # what the score kernels store for blocks past a row's complete count
BF16 = ml_dtypes.bfloat16


def _f64(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, dtype=np.float64)


def _f32val(x: float) -> float:
    return float(np.float32(x))


# -- norm + RoPE (docs/design.md §10, §12 common RoPE) ---------------------------------------------------
def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """``x [..., hd]`` * rsqrt(mean(x^2) + eps) * (1 + w), the last axis being one group."""
    x = _f64(x)
    ms = np.mean(x * x, axis=-1, keepdims=True)
    return x / np.sqrt(ms + _f32val(eps)) * (1.0 + _f64(w))


def rope(x: np.ndarray, pos: np.ndarray, rot: int, theta: float) -> np.ndarray:
    """Rotate-half RoPE on the first ``rot`` dims of ``x [..., hd]`` at positions ``pos`` (broadcast over
    the leading axes): pairs (j, j + rot/2), inv_freq_j = exp(-(2j/rot) ln theta), angles in float64."""
    x = _f64(x)
    out = x.copy()
    rot = min(int(rot), x.shape[-1])
    half = rot // 2
    if rot == 0:
        return out
    d = np.arange(rot)
    j = np.where(d < half, d, d - half)
    inv_freq = np.exp(-(2.0 * j / rot) * np.log(_f32val(theta)))
    ang = _f64(pos)[..., None] * inv_freq                      # [..., rot]
    s, c = np.sin(ang), np.cos(ang)
    x1, x2 = x[..., j], x[..., j + half]
    out[..., :rot] = np.where(d < half, x1 * c - x2 * s, x2 * c + x1 * s)
    return out


def qprep_rows(qk: np.ndarray, q_norm_w: np.ndarray, first_pos: int, n_heads: int, hd: int, rot: int,
               theta: float, eps: float) -> np.ndarray:
    """``qsa_qprep_rows``: ``qk [rows, qkw]`` (query heads in the first n_heads*hd columns),
    ``q_norm_w [hd]`` -> ``[rows, n_heads, hd]``; row r at position first_pos + r."""
    qk = _f64(qk)
    rows = qk.shape[0]
    x = qk[:, :n_heads * hd].reshape(rows, n_heads, hd)
    pos = (first_pos + np.arange(rows))[:, None] * np.ones((1, n_heads))
    return rope(rms_norm(x, q_norm_w, eps), pos, rot, theta)


# -- scores (docs/design.md §12.6, §12.7) ------------------------------------------------------------------
def complete_counts(first_pos: int, rows: int, ratio: int) -> np.ndarray:
    """complete_r = (first_pos + r + 1) // ratio for r < rows (int64)."""
    return (first_pos + np.arange(rows, dtype=np.int64) + 1) // ratio


def score_rows(q: np.ndarray, block_keys: np.ndarray, first_pos: int, ratio: int, n_blocks: int) -> np.ndarray:
    """Scores ``[rows, n_blocks]``: sum_h relu(q[r,h] . k[b]) / sqrt(hd) where b < complete_r, else MASKED.

    ``q [rows, n_heads, hd]``; ``block_keys [n, hd]`` needs only the blocks some row can score
    (n >= min(n_blocks, complete of the last row)).
    """
    q = _f64(q)
    rows, _, hd = q.shape
    comp = complete_counts(first_pos, rows, ratio)
    nk = int(min(n_blocks, comp.max(initial=0)))
    out = np.full((rows, n_blocks), MASKED)
    if nk > 0 and rows > 0:
        k = _f64(block_keys[:nk])
        dots = np.einsum("rhd,bd->rhb", q, k)
        s = np.maximum(dots, 0.0).sum(axis=1) / np.sqrt(hd)
        valid = np.arange(nk)[None, :] < comp[:, None]
        out[:, :nk] = np.where(valid, s, MASKED)
    return out


def split_hi_lo(q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The tensor-core scorer's split of f32 ``q``: hi = bf16(q), lo = bf16(q - f32(hi)), as float64."""
    q32 = np.asarray(q, dtype=np.float32)
    hi = q32.astype(BF16).astype(np.float32)       # float32 -> bf16 is one RNE rounding
    lo = (q32 - hi).astype(BF16).astype(np.float32)  # q32 - hi is exact in float32
    return hi.astype(np.float64), lo.astype(np.float64)


# -- selective attention (docs/design.md §12.8) -------------------------------------------------------------
def selected_tokens(list_r: np.ndarray, pos: int, ratio: int) -> np.ndarray:
    """Row tokens in kernel order: each listed block expanded to ``ratio`` tokens (list order, duplicates
    kept), then the tail complete*ratio .. pos."""
    complete = (pos + 1) // ratio
    blocks = np.asarray(list_r, dtype=np.int64)
    head = (blocks[:, None] * ratio + np.arange(ratio)[None, :]).ravel()
    return np.concatenate([head, np.arange(complete * ratio, pos + 1, dtype=np.int64)])


def gather_rows(cache: np.ndarray, block_table: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """Rows ``[n_tok, nkv, hd]`` of paged NHD ``cache [pages, bs, nkv, hd]`` for logical ``tokens``."""
    bs = cache.shape[1]
    pages = np.asarray(block_table, dtype=np.int64)[tokens // bs]
    return cache[pages, tokens % bs]


def attend(q_r: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float) -> np.ndarray:
    """GQA softmax attention of one row: ``q_r [nq, hd]`` over ``k, v [n_tok, nkv, hd]`` -> ``[nq, hd]``;
    query head qh reads kv head qh // (nq // nkv); no tokens -> zeros."""
    q_r, k, v = _f64(q_r), _f64(k), _f64(v)
    nq, hd = q_r.shape
    nkv = k.shape[1]
    group = nq // nkv
    out = np.zeros((nq, hd))
    if k.shape[0] == 0:
        return out
    for kvh in range(nkv):
        qs = q_r[kvh * group:(kvh + 1) * group]
        s = qs @ k[:, kvh].T * _f32val(scale)
        w = np.exp(s - s.max(axis=1, keepdims=True))
        out[kvh * group:(kvh + 1) * group] = (w @ v[:, kvh]) / w.sum(axis=1, keepdims=True)
    return out


def prefill_attn(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, block_table: np.ndarray,
                 lists: np.ndarray, first_pos: int, ratio: int, inv_sqrt_d: float) -> np.ndarray:
    """``qsa_prefill_attn``: ``q [rows, nq, hd]``, caches ``[pages, bs, nkv, hd]``, ``lists [rows, topk]``
    -> ``[rows, nq, hd]`` (row r at position first_pos + r)."""
    q = _f64(q)
    out = np.zeros(q.shape)
    k_cache, v_cache = _f64(k_cache), _f64(v_cache)
    for r in range(q.shape[0]):
        tok = selected_tokens(lists[r], first_pos + r, ratio)
        out[r] = attend(q[r], gather_rows(k_cache, block_table, tok), gather_rows(v_cache, block_table, tok),
                        inv_sqrt_d)
    return out


# -- prefill selection (docs/design.md §11.5 d) and the whole stage ------------------------------------------
def topk_lists(scores: np.ndarray, first_pos: int, ratio: int, topk: int) -> np.ndarray:
    """Per row, the first ``topk`` of blocks 0..complete_r-1 ordered by (score desc, index asc), kept in
    that score-descending order -> int32 ``[rows, topk]``. Needs complete_r >= topk on every row."""
    scores = np.asarray(scores)
    rows = scores.shape[0]
    comp = complete_counts(first_pos, rows, ratio)
    if rows and comp.min() < topk:
        raise ValueError(f"row with {int(comp.min())} complete blocks cannot fill a top-{topk} list")
    out = np.empty((rows, topk), dtype=np.int32)
    for r in range(rows):
        s = _f64(scores[r, :comp[r]])
        order = np.lexsort((np.arange(comp[r]), -s))   # last key primary: score descending, then index
        out[r] = order[:topk]
    return out


def prefill_select_attention(q_post: np.ndarray, block_keys: np.ndarray, q_attn: np.ndarray, k_cache: np.ndarray,
                             v_cache: np.ndarray, block_table: np.ndarray, first_pos: int, ratio: int, topk: int,
                             inv_sqrt_d: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Float64 prefill selection + attention for one slab: scores from ``q_post [rows, H, hd]`` and
    ``block_keys``, per-row top-k lists (score-descending order), attention over list tokens + tail.
    Returns (scores [rows, n_blocks_max], lists [rows, topk], out [rows, nq, hd])."""
    rows = np.asarray(q_post).shape[0]
    n_blocks = int(complete_counts(first_pos, rows, ratio)[-1]) if rows else 0
    scores = score_rows(q_post, block_keys, first_pos, ratio, n_blocks)
    lists = topk_lists(scores, first_pos, ratio, topk)
    out = prefill_attn(q_attn, k_cache, v_cache, block_table, lists, first_pos, ratio, inv_sqrt_d)
    return scores, lists, out
