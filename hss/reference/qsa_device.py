"""Float64 references for the device decode step (docs/design.md §17.1-§17.4; kernels in ``ptx/qsa_device.cu``).

* :func:`order_keys` / :func:`select_blocks_nan_low`: the §17.1 top-k rule (score descending, block index
  ascending; NaN below every number, -inf above NaN; -0.0 == +0.0);
* :func:`step_tokens`: the token list one step selects at position ``pos`` (the inert regime included);
* :func:`sparse_attention`: softmax attention of one request's queries over a token list read through its page
  table; :func:`split_partials` / :func:`merge_splits`: the same in the split-K form the kernels compute.

Imports only numpy (and the sibling references). Layouts are the kernels': row-major, outermost first; paged pools
are NHD ``[pages, block_size, nkv, hd]``; q head ``h`` reads kv head ``h // (nq // nkv)``.
"""
from __future__ import annotations

import numpy as np

from hss.reference.qsa import expand_tokens, rms_norm, rope

__all__ = ["LOG2E", "pool_block", "order_keys", "select_blocks_nan_low", "step_tokens", "page_rows", "logits",
           "sparse_attention", "split_partials", "merge_splits"]

LOG2E = 1.4426950408889634


def pool_block(rows: np.ndarray, k_norm_w: np.ndarray, block: int, rot: int, theta: float, eps: float) -> np.ndarray:
    """The key of block ``block`` from its ``ratio`` raw keys ``rows [ratio, hd]`` (bf16 as stored): their mean,
    RMS-normed with ``(1 + k_norm_w)``, roped at the block's first token ``block * ratio`` (= ``qsa_block_pool``'s
    reference for one block, from just the rows it reads)."""
    rows = np.asarray(rows, dtype=np.float64)
    return rope(rms_norm(rows.sum(axis=0) / rows.shape[0], k_norm_w, eps), block * rows.shape[0], rot, theta)


def order_keys(scores: np.ndarray) -> np.ndarray:
    """The device's order key of float32 ``scores``: uint32, larger = ranked first (NaN -> 0; -0.0 as +0.0;
    negatives bit-flipped, the rest with the sign bit set). Equal keys are equal ranks."""
    bits = np.ascontiguousarray(scores, dtype=np.float32).view(np.uint32).copy()
    mag = bits & np.uint32(0x7FFFFFFF)
    bits[mag == 0] = 0
    key = np.where(bits & np.uint32(0x80000000), ~bits, bits | np.uint32(0x80000000)).astype(np.uint32)
    key[mag > 0x7F800000] = 0
    return key


def select_blocks_nan_low(scores: np.ndarray, k: int) -> np.ndarray:
    """Ids of the first ``min(k, n)`` of ``scores [n]`` under docs/design.md §17.1, ascending (int64)."""
    with np.errstate(invalid="ignore"):   # a signalling NaN stays a NaN
        s = np.asarray(scores, dtype=np.float64).ravel()
    nan = np.isnan(s)
    order = np.lexsort((np.arange(s.size), -np.where(nan, 0.0, s), nan))   # last key first: NaN after numbers
    return np.sort(order[:min(max(int(k), 0), s.size)])


def step_tokens(scores: np.ndarray, pos: int, ratio: int, k_blocks: int) -> np.ndarray:
    """The tokens the step at 0-based ``pos`` selects (int64, ascending): every visible token while
    ``complete = (pos + 1) // ratio <= k_blocks`` (inert), else the §17.1 top ``k_blocks`` of ``scores[:complete]``
    expanded to their tokens, then the tail ``complete * ratio .. pos``."""
    visible = pos + 1
    complete = visible // ratio
    if complete <= k_blocks:
        return np.arange(visible, dtype=np.int64)
    return expand_tokens(select_blocks_nan_low(np.asarray(scores)[:complete], k_blocks), ratio, visible)


def page_rows(tokens: np.ndarray, table: np.ndarray, block_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(page, slot, valid) of each token through one request's page table: a token is valid when it is >= 0, its
    logical page is inside the table and the page id is >= 0 (an invalid token contributes nothing)."""
    t = np.asarray(tokens, dtype=np.int64)
    table = np.asarray(table, dtype=np.int64)
    logical = np.where(t >= 0, t // block_size, -1)
    valid = (logical >= 0) & (logical < table.size)
    page = np.full(t.shape, -1, dtype=np.int64)
    page[valid] = table[logical[valid]]
    valid &= page >= 0
    return page, np.where(t >= 0, t % block_size, 0), valid


def logits(q: np.ndarray, k: np.ndarray, scale: float) -> np.ndarray:
    """``[n, nq]``: ``(q[h] . k[t, h // G]) * scale`` for ``q [nq, hd]``, ``k [n, nkv, hd]``, float64."""
    q = np.asarray(q, dtype=np.float64)
    k = np.asarray(k, dtype=np.float64)
    nq, hd = q.shape
    n, nkv = k.shape[:2]
    x = np.einsum("nkd,kgd->nkg", k, q.reshape(nkv, nq // nkv, hd))
    return x.reshape(n, nq) * float(scale)


def _weighted_v(w: np.ndarray, v: np.ndarray, nq: int) -> np.ndarray:
    n, nkv, hd = v.shape
    return np.einsum("nkg,nkd->kgd", w.reshape(n, nkv, nq // nkv), v).reshape(nq, hd)


def sparse_attention(q: np.ndarray, k_pool: np.ndarray, v_pool: np.ndarray, table: np.ndarray, tokens: np.ndarray,
                     block_size: int, scale: float) -> np.ndarray:
    """docs/design.md §17.4 for one request: ``softmax_t((q[h] . K[t]) * scale) V[t]`` over the valid ``tokens``, K/V
    rows of the NHD pools ``[pages, block_size, nkv, hd]`` read through ``table`` (logical -> physical page). ``q [nq,
    hd]``; returns float64 ``[nq, hd]`` (zeros when no token is valid)."""
    q = np.asarray(q, dtype=np.float64)
    page, slot, valid = page_rows(tokens, table, block_size)
    if not valid.any():
        return np.zeros(q.shape)
    k = np.asarray(k_pool[page[valid], slot[valid]], dtype=np.float64)
    v = np.asarray(v_pool[page[valid], slot[valid]], dtype=np.float64)
    x = logits(q, k, scale)
    w = np.exp(x - x.max(axis=0, keepdims=True))
    return _weighted_v(w / w.sum(axis=0, keepdims=True), v, q.shape[0])


def split_partials(q: np.ndarray, k: np.ndarray, v: np.ndarray, valid: np.ndarray, scale: float,
                   split: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-split softmax partials of ``qsa_sparse_attn`` over rows ``k``, ``v [n, nkv, hd]`` (``valid [n]``: rows
    that contribute): ``m [C, nq]`` = max of x = logit * log2(e) over the split's valid rows (-inf if none),
    ``l [C, nq]`` = sum of 2^(x - m), ``o [C, nq, hd]`` = sum of 2^(x - m) v; C = ceil(n / split), float64."""
    nq = np.shape(q)[0]
    n = np.shape(k)[0]
    x = np.where(np.asarray(valid)[:, None], logits(q, k, scale) * LOG2E, -np.inf) if n else np.zeros((0, nq))
    vv = np.asarray(v, dtype=np.float64)
    c = -(-n // split)
    m, l, o = np.full((c, nq), -np.inf), np.zeros((c, nq)), np.zeros((c, nq, np.shape(q)[1]))
    for i in range(c):
        xs = x[i * split:(i + 1) * split]
        m[i] = xs.max(axis=0)
        live = np.isfinite(m[i])
        p = np.where(live, np.exp2(xs - np.where(live, m[i], 0.0)), 0.0)
        l[i] = p.sum(axis=0)
        o[i] = _weighted_v(p, vv[i * split:(i + 1) * split], nq)
    return m, l, o


def merge_splits(m: np.ndarray, l: np.ndarray, o: np.ndarray) -> np.ndarray:
    """Fold split partials ``m, l [C, nq]`` (m in log2 units), ``o [C, nq, hd]`` (``qsa_sparse_merge``):
    ``sum_s o_s 2^(m_s - M) / sum_s l_s 2^(m_s - M)`` with M = max m_s; zeros where no split has a token."""
    m, l, o = (np.asarray(a, dtype=np.float64) for a in (m, l, o))
    nq, hd = o.shape[1:]
    if m.shape[0] == 0:
        return np.zeros((nq, hd))
    big = m.max(axis=0)
    live = np.isfinite(big)
    w = np.where(live, np.exp2(m - np.where(live, big, 0.0)), 0.0)   # [C, nq]; a split of -inf weighs 0
    den = (l * w).sum(axis=0)
    num = np.einsum("cn,cnd->nd", w, o)
    inv = np.divide(1.0, den, out=np.zeros_like(den), where=den > 0)
    return num * inv[:, None]
