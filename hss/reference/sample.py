"""Float64 reference of ``ptx/sample.cu``'s token sampler (docs of the rule: the ``.cu`` header and
:mod:`hss.model.sample`), with the Philox4x32-10 generator in integer numpy, bit-exact with the kernel's draws.

One row: bf16 logits ``[vocab]`` → penalised logits ``z`` (NaN → -inf; tokens in the row's history: positive
divided by ``repetition_penalty``, others multiplied, then ``presence_penalty`` subtracted) → greedy (temperature 0,
or a +inf logit) by model_argmax's rule over ``z``, or sampled: the ``k = top_k`` (0: ``CANDIDATES``) largest ``z``
in the order (descending ``z``, ascending id) are the candidates (``top_k = 0``: the other tokens form the *tail*);
integer masses ``w = floor(exp((z - max) / T) * 2^MASS_BITS)``; top-p keeps the shortest prefix of the candidates
whose mass reaches ``ceil(top_p * W)`` (``W`` = candidates' + tail's mass; the tail stays only when no prefix
reaches it); min-p cuts the prefix at the first candidate with ``exp((z - max) / T) < min_p`` (and drops tail
tokens below it); the draw ``t = floor(W_kept * x / 2^32)``, ``x`` the first Philox word, picks the first kept
token (candidates in their order, then the tail in ascending id) whose cumulative mass exceeds ``t``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

__all__ = ["CANDIDATES", "MASS_BITS", "FLAG_NAN", "FLAG_INF", "FLAG_EMPTY", "philox4x32", "draw_word",
           "history_mask", "penalize", "greedy", "RowDraw", "sample_row"]

CANDIDATES = 1024   # SAMPLE_CANDIDATES: the most candidates (top_k's cap; top_k = 0 adds the tail)
MASS_BITS = 40      # SAMPLE_MASS_BITS: masses are fixed point, the most likely token's is 2^40
FLAG_NAN = 1        # a NaN logit was seen (it counted as -inf)
FLAG_INF = 2        # a +inf logit (after penalties): the row took the greedy token
FLAG_EMPTY = 4      # no logit above -inf: token 0

_M0, _M1 = 0xD2511F53, 0xCD9E8D57
_W0, _W1 = 0x9E3779B9, 0xBB67AE85
_U32 = 0xFFFFFFFF


def philox4x32(counter: tuple[int, int, int, int], key: tuple[int, int], rounds: int = 10) -> tuple[int, ...]:
    """Philox4x32 (Salmon et al. 2011) of one 128-bit counter under a 64-bit key: four u32 words."""
    c0, c1, c2, c3 = (int(v) & _U32 for v in counter)
    k0, k1 = (int(v) & _U32 for v in key)
    for r in range(rounds):
        if r:
            k0, k1 = (k0 + _W0) & _U32, (k1 + _W1) & _U32
        p0, p1 = _M0 * c0, _M1 * c2
        c0, c1, c2, c3 = (p1 >> 32) ^ c1 ^ k0, p1 & _U32, (p0 >> 32) ^ c3 ^ k1, p0 & _U32
    return c0, c1, c2, c3


def draw_word(seed: int, step: int) -> int:
    """The u32 a row draws at ``step``: word 0 of Philox4x32-10, key = the u64 seed (low word first), counter =
    (step, 0, 0, 0): the same for the same seed and step in any batch row."""
    return philox4x32((step, 0, 0, 0), (seed & _U32, (seed >> 32) & _U32))[0]


def history_mask(history: np.ndarray, count: int, vocab: int) -> np.ndarray:
    """bool ``[vocab]``: the tokens among the ring's first ``min(count, len(history))`` entries (ids outside
    ``[0, vocab)`` ignored)."""
    ids = np.asarray(history, dtype=np.int64)[: min(int(count), np.asarray(history).size)]
    mask = np.zeros(vocab, bool)
    mask[ids[(ids >= 0) & (ids < vocab)]] = True
    return mask


def penalize(x: np.ndarray, present: np.ndarray, repetition: float, presence: float) -> np.ndarray:
    """The penalised logits (float64): NaN → -inf; where ``present``, ``x / repetition`` if ``x > 0`` else
    ``x * repetition``, then ``- presence``."""
    x = np.where(np.isnan(x), -np.inf, np.asarray(x, dtype=np.float64))
    pen = np.where(x > 0, x / repetition, x * repetition) - presence
    return np.where(present, pen, x)


def _ulp_bf16(v: float) -> float:
    e = int((np.array(v, np.float32).view(np.uint32) >> 23) & 0xFF) - 127
    return 2.0 ** max(e - 7, -126)


def greedy(z: np.ndarray, h: np.ndarray | None, weight: np.ndarray | None, present: np.ndarray,
           repetition: float, presence: float) -> int:
    """model_argmax's rule over the penalised logits ``z``: the candidates ``z >= M - 2 ulp_bf16(M)``, recomputed as
    the penalised float64 dot of ``h`` and ``weight[i]`` (the first on equal values); one candidate, more than
    ``CANDIDATES``, or no ``h``: the first index of ``M``; ``M = -inf``: 0."""
    top = float(z.max()) if z.size else -np.inf
    if top == -np.inf:
        return 0
    with np.errstate(invalid="ignore"):
        cand = np.flatnonzero(z >= top - 2 * _ulp_bf16(top))
    first = int(np.flatnonzero(z == top)[0])
    if h is None or cand.size < 2 or cand.size > CANDIDATES:
        return first
    dots = np.asarray(weight)[cand].astype(np.float64) @ np.asarray(h, dtype=np.float64)
    refined = penalize(dots, present[cand], repetition, presence)
    return int(cand[int(np.argmax(refined))])


@dataclass
class RowDraw:
    """One row's outcome and the decisions behind it (for tests that judge near-boundary draws)."""
    token: int
    flags: int
    greedy: bool
    order: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))   # kept tokens, draw order
    cum: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))     # their cumulative masses
    target: int = 0          # the drawn point in [0, cum[-1])
    top_p_target: int = 0    # ceil(top_p * W) (0: top-p off)
    cand_cum: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))   # every candidate's cumulative
    cand_e: np.ndarray = field(default_factory=lambda: np.zeros(0))               # exp((z - max) / T) of each
    cand_z: np.ndarray = field(default_factory=lambda: np.zeros(0))               # z of candidates then tail


def _mass(e: np.ndarray) -> np.ndarray:
    return np.floor(e * 2.0 ** MASS_BITS).astype(np.int64)


def sample_row(logits: np.ndarray, params: dict, history: np.ndarray, count: int, step: int,
               h: np.ndarray | None = None, weight: np.ndarray | None = None) -> RowDraw:
    """The kernel's token for one row. ``params``: temperature, top_k, top_p, min_p, repetition_penalty,
    presence_penalty (as the device stores them, f32 / i32) and seed (u64); ``history`` the row's ring, ``count``
    its appended-token count; ``step`` the row's counter."""
    x = np.asarray(logits, dtype=np.float64)
    vocab = x.size
    flags = FLAG_NAN if np.isnan(x).any() else 0
    rp, pres = float(np.float32(params["repetition_penalty"])), float(np.float32(params["presence_penalty"]))
    present = history_mask(history, count, vocab)
    z = penalize(x, present, rp, pres)
    top = float(z.max()) if vocab else -np.inf
    temp = float(np.float32(params["temperature"]))
    if top == -np.inf:
        return RowDraw(0, flags | FLAG_EMPTY, True)
    if top == np.inf or temp == 0.0:
        return RowDraw(greedy(z, h, weight, present, rp, pres), flags | (FLAG_INF if top == np.inf else 0), True)
    top_k = int(params["top_k"])
    k = min(top_k if top_k > 0 else CANDIDATES, vocab)
    order = np.lexsort((np.arange(vocab), -z))
    cand, tail = order[:k], (np.sort(order[k:]) if top_k == 0 else order[:0])
    e_all = np.exp((z - top) / temp)
    e_c, w_c = e_all[cand], _mass(e_all[cand])
    cum_c = np.cumsum(w_c)
    min_p, top_p = float(np.float32(params["min_p"])), float(np.float32(params["top_p"]))
    e_t = e_all[tail]
    w_t = _mass(e_t)
    tail_minp = tail[e_t >= min_p]
    w_tail_minp = w_t[e_t >= min_p]
    n = k
    lp, tail_p, tp_target = n, True, 0
    if top_p < 1.0:
        w_all = int(cum_c[-1]) + int(w_t.sum())
        tp_target = math.ceil(float(w_all) * top_p)
        hit = np.flatnonzero(cum_c >= tp_target)
        if hit.size:
            lp, tail_p = int(hit[0]) + 1, False
    low = np.flatnonzero(e_c < min_p)
    lm = int(low[0]) if low.size else n
    keep = max(1, min(n, lp, lm))
    keep_tail = top_k == 0 and keep == n and tail_p and lm == n and tail.size > 0
    kept = cand[:keep]
    cum = cum_c[:keep]
    if keep_tail:
        kept = np.concatenate([kept, tail_minp])
        cum = np.concatenate([cum, int(cum[-1]) + np.cumsum(w_tail_minp)])
    seed = int(params["seed"])
    target = (int(cum[-1]) * draw_word(seed, step)) >> 32
    pick = int(np.searchsorted(cum, target, side="right"))
    return RowDraw(int(kept[pick]), flags, False, kept, cum, target, tp_target, cum_c, e_c,
                   np.concatenate([z[cand], z[tail]]))
