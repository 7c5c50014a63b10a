"""Recall of page selection on a real model: ``python -m hss.bench recall [--smoke]``, or with options
``python -m hss.bench.recall [--texts 3] [--tokens 4096] [--queries 64] [--layers 0-29] [--ranks 8 16 32] ...``.

What it measures: SmolLM2-135M (``hss.checkpoint``, numpy float32 forward) reads each text; every layer's post-RoPE
keys are the KV cache (16-token pages) and the queries of its last ``--queries`` positions are decode steps. For a
query at position t (pages 0 .. t // 16 visible, the last one partly), a method scores the visible pages and keeps
a budget of ``round(fraction x visible pages)``; the recall of that (text, layer, query) is the share of the true
attention mass it keeps: the mean over the q heads of the softmax mass (over tokens 0 .. t, float64) inside the kept
pages. ``+F/R``: the first page and the 4 most recent (``--first 1 --recent 4``; the current one included) are kept,
inside the same budget. Reported: the mean and the worst decile (10th percentile) over every (text, layer, query), and
per group of layers.

Methods. Through hss's own kernels (``Predictor.project_kv_block`` / ``project_q`` / ``score_layer``: a GPU, or the
CPU emulator): ``original`` (the seeded P, r 8/16/32), ``calibrated`` (docs/design.md §17.5's uncentered principal
directions of the keys of a separate calibration text: never the text evaluated) and ``calibrated +norm`` (the same with
``head_temperature = sqrt(head_dim)``: per-head normalised scores summed over heads). Baselines in numpy: ``oracle``
(the true mass: the best any page set of that size can do), ``exact max q.k`` (the predictor's rule on full keys),
``Quest min/max`` (per page and kv head the elementwise min and max key, bf16: 4 x head_dim / 16 = 16 bytes per token
at head_dim 64, as r = 8; score = sum_i max(q_i min_i, q_i max_i), max over heads; ``+norm`` the same per-head
normalisation) and ``recency`` (the newest pages). The current page's future tokens are NaN for the predictor (its
kernels skip NaN dots) and absent for the baselines, so no method sees a key after its query.

The sparse swap section (docs/design.md §17.6): per text, every measured layer (``--swap-layers``) in a
:class:`~hss.swap.HighSpeedSwap` (HostStore, one shared resident set of ``--swap-resident`` of the pages, the original
P at ``--swap-rank``) runs the ``--queries`` positions as consecutive decode steps, the page being written offloaded
again at each, in the sparse mode (budget ``--swap-budget`` of the visible pages with the same +F/R pages) beside a
second, exact swap. Reported per layer group: the output's relative L2 error against float64 attention over every
visible token (sparse, and the exact step's for scale), the attention mass of the pages attended, the hit rate, the
host wall time of a sparse and an exact step and their ratio, and whether each layer's last sparse step equals its
in-HBM replay bit for bit (:func:`swap_decode`; ``--no-swap`` skips it).

Texts: the Python documentation's help topics (``pydoc_data.topics``, in every CPython's standard library), sorted by
name and cut into ``--texts + 1`` runs of topics; each text is the first ``--tokens`` tokens of its run and the last
run's first ``--calibration-tokens`` (4096) calibrate (``--calibration prose``: the ~1300 tokens of
``hss.checkpoint.english_text('python')`` instead). Where a run is shorter the text is, and the output says so (without
``pydoc_data``: the short ``english_text`` texts). ``--smoke``: tiny synthetic keys, no model (code paths only; its
numbers mean nothing). The numpy forward is the slow part: the full default run (3 texts and the calibration text,
4096 tokens each, 30 layers, 64 queries) took 11.5 minutes on 2 CPU cores with the emulator (forward 379 s, kernels
67 s, numpy baselines 39 s), before the sparse swap section, which adds about 80 s per 4096-token text over 30 layers
on the emulator (two swaps x 30 layers x 64 steps); ``--layers``, ``--swap-layers``, ``--tokens`` and ``--queries`` cut
it down, ``--no-swap`` skips it.
"""
from __future__ import annotations

import argparse
import contextlib
import math
import sys
import tempfile
import time
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

import ml_dtypes
import numpy as np

from hss import cuda_min as cm
from hss._util import ceil_div
from hss.errors import HssError
from hss.predictor import Predictor, PredictorDims
from hss.predictor.calibrate import calibrate_projection

BF16 = ml_dtypes.bfloat16
SEED = 0xCAFE_F00D
BUDGETS = ("1/16", "1/8", "1/4", "1/2")
TARGET = dict(method="calibrated", r=8, budget="1/8", mean=0.83, p10=0.62)


@dataclass
class LayerData:
    """One layer of one text: keys ``[T, nkv, hd]`` and the decode queries ``[nQ, nq, hd]`` at ``positions``; the
    values ``[T, nkv, hd]`` where the sparse swap section runs that layer (else None)."""
    keys: np.ndarray
    queries: np.ndarray
    positions: np.ndarray
    values: np.ndarray | None = None


@dataclass
class Workload:
    """The texts' layers (only those measured), the calibration keys per measured layer, and notes for the output."""
    layers: list[int]               # model layer indices measured
    model_layers: int
    texts: list[tuple[str, list[LayerData]]]
    calibration: list[np.ndarray]   # [T_cal, nkv, hd] per measured layer
    notes: list[str] = field(default_factory=list)
    forward_s: float = 0.0


# -- workloads ------------------------------------------------------------------------------------------------------
def _layer_list(spec: str | None, n: int) -> list[int]:
    if not spec:
        return list(range(n))
    out: list[int] = []
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        out += range(int(lo), int(hi or lo) + 1)
    if not out or min(out) < 0 or max(out) >= n:
        raise HssError(f"--layers {spec}: the model has layers 0..{n - 1}")
    return sorted(set(out))


def _doc_texts(tokenizer: Any, count: int, tokens: int, calibration: str,
               calib_tokens: int) -> tuple[list, list[int], list[str]]:
    """``count`` documents of the Python docs' help topics and the calibration text, as token ids, plus notes."""
    from hss.checkpoint import english_text
    notes = []
    try:
        import pydoc_data.topics as topics
    except ImportError:
        topics = None
    if topics is None:   # a trimmed standard library: the short stdlib texts, calibrated on another of them
        docs = [(n, tokenizer.encode(english_text(n))[:tokens]) for n in ("heapq", "zen")[:count]]
        notes.append("pydoc_data is missing: evaluated english_text('heapq') and ('zen') (short), calibrated on "
                     "english_text('license')")
        return docs, tokenizer.encode(english_text("license")), notes
    keys = sorted(topics.topics)
    runs = np.array_split(np.arange(len(keys)), count + 1)
    docs = []
    for i, run in enumerate(runs):
        want = tokens if i < count else calib_tokens
        ids: list[int] = []
        last = run[0]
        for last in run:
            ids += tokenizer.encode(topics.topics[keys[last]] + "\n\n")
            if len(ids) >= want:
                break
        docs.append((f"Python docs topics {keys[run[0]]!r}..{keys[last]!r}", ids[:want]))
        if len(ids) < want:
            notes.append(f"text {i} has only {len(ids)} tokens (its topics run out)")
    calib = docs.pop()
    if calibration == "prose":
        calib = ("english_text('python')", tokenizer.encode(english_text("python")))
    notes.append(f"calibration text: {calib[0]}, {len(calib[1])} tokens")
    return docs, calib[1], notes


def real_workload(args: argparse.Namespace) -> Workload:
    """SmolLM2-135M over the texts: forward once per text, keep the measured layers' keys and last queries."""
    from hss.checkpoint import forward, load_model
    model = load_model()
    layers = _layer_list(args.layers, model.config.n_layer)
    swap = set(_swap_layers(args, layers))
    docs, calib_ids, notes = _doc_texts(model.tokenizer, args.texts, args.tokens, args.calibration,
                                        args.calibration_tokens)
    start = time.perf_counter()
    texts = []
    for name, ids in docs:
        capture: list = []
        forward(model.weights, ids, capture=capture)
        nq = min(args.queries, len(ids))
        texts.append((f"{name} ({len(ids)} tokens)",
                      [LayerData(capture[li].k, capture[li].q[-nq:].copy(), capture[li].positions[-nq:],
                                 capture[li].v if li in swap else None) for li in layers]))
    capture = []
    forward(model.weights, calib_ids, capture=capture)
    calibration = [capture[li].k for li in layers]
    return Workload(layers, model.config.n_layer, texts, calibration, notes, time.perf_counter() - start)


def synthetic_workload(args: argparse.Namespace) -> Workload:
    """Tiny keys with structure (a shared mean, a few strong directions, noise) for ``--smoke``: no model."""
    nl, nq, nkv, hd, t, nqry = 2, 4, 2, 32, 160, 4
    rng = np.random.default_rng(7)
    basis = np.linalg.qr(rng.standard_normal((hd, 6)))[0]

    def keys(n: int) -> np.ndarray:
        coef = rng.standard_normal((n, nkv, 6)) * np.array([4, 3, 2, 1.5, 1, 1])
        return (coef @ basis.T + 2 * basis[:, 0] + 0.3 * rng.standard_normal((n, nkv, hd))).astype(np.float32)

    texts = []
    for i in range(2):
        layers = [LayerData(keys(t), (rng.standard_normal((nqry, nq, 6)) @ basis.T * 2).astype(np.float32),
                            np.arange(t - nqry, t), rng.standard_normal((t, nkv, hd)).astype(np.float32))
                  for _ in range(nl)]
        texts.append((f"synthetic {i} ({t} tokens)", layers))
    return Workload(list(range(nl)), nl, texts, [keys(96) for _ in range(nl)], ["--smoke: synthetic keys, no model"])


# -- scores ---------------------------------------------------------------------------------------------------------
def _pages(x: np.ndarray, bs: int, fill: float) -> np.ndarray:
    """``x [..., T]`` padded with ``fill`` to whole pages: ``[..., n_pages, bs]``."""
    t = x.shape[-1]
    n = ceil_div(t, bs)
    pad = np.full((*x.shape[:-1], n * bs - t), fill)
    return np.concatenate([x, pad], axis=-1).reshape(*x.shape[:-1], n, bs)


def _visible(positions: np.ndarray, t: int) -> np.ndarray:
    """``[nQ, T]``: token s is visible to the query at position p when s <= p."""
    return np.arange(t)[None, :] <= positions[:, None]


def truth_and_baselines(layer: LayerData, bs: int) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """(tot ``[nQ, n_pages]``: the true attention mass per page, mean over q heads; per-head baseline scores
    ``{name: [nQ, nq, n_pages]}`` with -inf on pages a query does not see)."""
    k, q, pos = layer.keys.astype(np.float64), layer.queries.astype(np.float64), layer.positions
    t, nkv, hd = k.shape
    nq = q.shape[1]
    g = nq // nkv
    kh = k[:, np.arange(nq) // g]                                       # [T, nq, hd]: each q head's kv head
    vis = _visible(pos, t)[:, None, :]                                   # [nQ, 1, T]
    logits = np.where(vis, np.einsum("qhd,thd->qht", q, kh) / math.sqrt(hd), -np.inf)
    w = np.exp(logits - logits.max(axis=2, keepdims=True))
    mass = _pages(w / w.sum(axis=2, keepdims=True), bs, 0.0).sum(axis=3)   # [nQ, nq, n_pages]
    kb, qb = layer.keys.astype(BF16).astype(np.float64), layer.queries.astype(BF16).astype(np.float64)
    kbh = kb[:, np.arange(nq) // g]
    dots = np.where(vis, np.einsum("qhd,thd->qht", qb, kbh), -np.inf)
    exact = _pages(dots, bs, -np.inf).max(axis=3)
    # Quest: per (page, kv head) the elementwise min / max key over the page's visible tokens; the complete pages'
    # are every query's, the current page's its own. sum_i max(q_i lo_i, q_i hi_i) = q+ . hi + q- . lo (hi >= lo).
    n_pages = mass.shape[2]
    kp = _pages(np.moveaxis(kb, 0, -1), bs, np.nan)                      # [nkv, hd, n_pages, bs]
    lo_all, hi_all = np.nanmin(kp, axis=3), np.nanmax(kp, axis=3)       # [nkv, hd, n_pages] (no page is all pad)
    kv_of = np.arange(nq) // g
    quest = np.full((len(pos), nq, n_pages), -np.inf)
    for i, p in enumerate(pos):
        cur = int(p) // bs
        lo, hi = lo_all[:, :, :cur + 1].copy(), hi_all[:, :, :cur + 1].copy()
        lo[:, :, cur], hi[:, :, cur] = kb[cur * bs:p + 1].min(axis=0), kb[cur * bs:p + 1].max(axis=0)
        qi = qb[i]
        quest[i, :, :cur + 1] = (np.einsum("hd,hdn->hn", np.maximum(qi, 0), hi[kv_of])
                                 + np.einsum("hd,hdn->hn", np.minimum(qi, 0), lo[kv_of]))
    seen = _pages(_visible(pos, t), bs, False)                          # [nQ, n_pages, bs]
    recency = np.where(seen.any(axis=2), np.arange(n_pages, dtype=np.float64)[None], -np.inf)[:, None, :]
    return mass.mean(axis=1), {"exact": exact, "quest": quest, "recency": recency}


def head_norm(per_head: np.ndarray, temperature: float) -> np.ndarray:
    """The numpy twin of ``Predictor(head_temperature=...)``: ``[nQ, nq, n_pages]`` -> ``[nQ, n_pages]``,
    sum over heads of exp((s - the head's best visible page) / temperature); unseen pages stay -inf."""
    best = per_head.max(axis=2, keepdims=True)
    with np.errstate(invalid="ignore"):
        out = np.exp((per_head - best) / temperature).sum(axis=1)
    return np.where(np.isfinite(per_head).any(axis=1), out, -np.inf)


def kernel_scores(ctx: cm.CudaCtx, layers: list[LayerData], bs: int, r: int, seed: int | None,
                  projection: np.ndarray | None, temperature: float | None) -> list[np.ndarray]:
    """hss's predictor on one text: every page of every measured layer projected into A_g, then for each query
    (newest first) its current page re-projected with the future tokens NaN, ``project_q(layer=)`` and
    ``score_layer`` over the visible pages. Returns ``[nQ, n_pages]`` f32 per layer (-inf where unseen)."""
    s = ctx.stream
    t, nkv, hd = layers[0].keys.shape
    nq, nqry = layers[0].queries.shape[1], len(layers[0].positions)
    n_pages = ceil_div(t, bs)
    dims = PredictorDims(num_layers=len(layers), num_q_heads=nq, num_kv_heads=nkv, head_dim=hd, r=r, block_size=bs,
                         max_blocks=n_pages)
    page_bytes, row_bytes = bs * nkv * hd * 2, nkv * hd * 2
    out = []
    with Predictor(ctx, dims, seed, projection=projection, head_temperature=temperature) as pred:
        q_proj = cm.DeviceBuffer(nqry * nq * r * 2)
        scores = cm.DeviceBuffer(nqry * n_pages * 4)
        for li, layer in enumerate(layers):
            keys = np.full((n_pages * bs, nkv, hd), np.nan, dtype=BF16)
            keys[:t] = layer.keys.astype(BF16)
            k_dev = cm.DeviceBuffer(keys.nbytes)
            q_dev = cm.DeviceBuffer(layer.queries.size * 2)
            cm.copy_h_to_d_async(k_dev, keys, keys.nbytes, s)
            cm.copy_h_to_d_async(q_dev, np.ascontiguousarray(layer.queries.astype(BF16)), q_dev.bytes, s)
            for b in range(n_pages):
                pred.project_kv_block(s, li, b, k_dev.ptr + b * page_bytes)
            masked_from = n_pages * bs
            for i in reversed(range(nqry)):
                p = int(layer.positions[i])
                if p + 1 < masked_from:   # NaN the rows after the query (0xFFFF is a bf16 NaN)
                    cm.memset_d8_async(k_dev.ptr + (p + 1) * row_bytes, 0xFF, (masked_from - p - 1) * row_bytes, s)
                    masked_from = p + 1
                cur = p // bs
                pred.project_kv_block(s, li, cur, k_dev.ptr + cur * page_bytes)
                qp = q_proj.ptr + i * nq * r * 2
                pred.project_q(s, q_dev.ptr + i * nq * hd * 2, qp, layer=li)
                pred.score_layer(s, qp, li, 0, cur + 1, scores.ptr + i * n_pages * 4)
            got = np.empty((nqry, n_pages), np.float32)
            cm.copy_d_to_h_async(got, scores, got.nbytes, s)
            cm.stream_sync(s)
            seen = np.arange(n_pages)[None, :] <= (layer.positions // bs)[:, None]
            out.append(np.where(seen, got, -np.inf))
            k_dev.close()
            q_dev.close()
        q_proj.close()
        scores.close()
    return out


# -- selection and recall -------------------------------------------------------------------------------------------
def recall(scores: np.ndarray, tot: np.ndarray, positions: np.ndarray, bs: int, budgets: list[Fraction],
           first: int, recent: int) -> dict[tuple[str, bool], np.ndarray]:
    """``{(budget, with first/recent): [nQ] captured mass}`` for one layer's queries. A budget keeps
    ``max(1, round(f x visible pages))`` pages ranked by (score descending, page ascending); with first/recent the
    first ``first`` and then the newest ``recent`` pages (newest first) come first, inside the budget."""
    out: dict[tuple[str, bool], np.ndarray] = {(str(f), fr): np.empty(len(positions)) for f in budgets
                                               for fr in (False, True)}
    for i, p in enumerate(positions):
        n = int(p) // bs + 1
        sc, mass = scores[i, :n], tot[i, :n]
        ranked = np.cumsum(mass[np.argsort(-sc, kind="stable")])
        forced = [*range(min(first, n)), *[j for j in range(n - 1, max(n - recent, 0) - 1, -1) if j >= first]]
        rest = np.setdiff1d(np.arange(n), forced)
        ranked_rest = np.concatenate([[0.0], np.cumsum(mass[rest[np.argsort(-sc[rest], kind="stable")]])])
        kept = np.concatenate([[0.0], np.cumsum(mass[forced])])
        for f in budgets:
            b = max(1, round(f * n))
            out[str(f), False][i] = ranked[b - 1]
            k = min(b, len(forced))
            out[str(f), True][i] = kept[k] + ranked_rest[min(b - k, len(rest))]
    return out


# -- the sparse swap mode (docs/design.md §17.6) over the same keys ----------------------------------------------------
def _swap_layers(args: argparse.Namespace, layers: list[int]) -> list[int]:
    """The measured layers the sparse swap section runs (``--swap-layers``, default every measured layer)."""
    if args.no_swap:
        return []
    if not args.swap_layers:
        return list(layers)
    want = _layer_list(args.swap_layers, max(layers) + 1)
    missing = sorted(set(want) - set(layers))
    if missing:
        raise HssError(f"--swap-layers {args.swap_layers}: layers {missing} are not measured (--layers)")
    return want


def _exact_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float64 decode attention of ``q [nq, hd]`` over ``k, v [S, nkv, hd]`` (GQA): (out ``[nq, hd]``, softmax weights
    ``[nq, S]``)."""
    nq, hd = q.shape
    kh = np.arange(nq) // (nq // k.shape[1])
    logits = np.einsum("hd,shd->hs", q, k[:, kh]) / math.sqrt(hd)
    w = np.exp(logits - logits.max(axis=1, keepdims=True))
    w /= w.sum(axis=1, keepdims=True)
    return np.einsum("hs,shd->hd", w, v[:, kh]), w


def swap_decode(ctx: cm.CudaCtx, layers: list[LayerData], bs: int, args: argparse.Namespace) -> list[dict]:
    """Consecutive decode steps of one text through two :class:`~hss.swap.HighSpeedSwap` (HostStore; one layer per
    measured layer, a shared scratch pool): one in the sparse mode, one exact. Every page is offloaded first; at the
    query at position p, for each layer in turn, page p // bs is offloaded again as it then stands (later tokens zero
    on the host, NaN in the device page the predictor projects, so no score sees a future key), then the sparse and
    the exact step attend pages 0 .. p // bs (``q_pos=p``). The sparse budget is docs/design.md §17.6's ``budget_pages =
    max(0, b - F - R)`` with ``b = max(1, round(f x visible pages))`` (the recall tables' +F/R accounting: the first F
    and newest R inside b, whenever b >= F + R). Per layer: each step's output error against float64 attention over
    every visible token (relative L2 over the heads, the swap's bf16 inputs), the attention mass its pages hold, hits,
    misses, host wall time of each step (its stream waited for), the pages attended and budget_pages of each step,
    and the last sparse step replayed in HBM (bitwise)."""
    from hss.bench.swap import _replay_matches
    from hss.swap import HighSpeedSwap, HighSpeedSwapConfig, ModelDims
    s = ctx.stream
    n_layers = len(layers)
    t, nkv, hd = layers[0].keys.shape
    nq = layers[0].queries.shape[1]
    n_pages = ceil_div(t, bs)
    frac, first, recent = Fraction(args.swap_budget), args.first, args.recent
    keys = np.zeros((n_layers, n_pages * bs, nkv, hd), BF16)
    values = np.zeros_like(keys)
    for li, layer in enumerate(layers):
        keys[li, :t], values[li, :t] = layer.keys.astype(BF16), layer.values.astype(BF16)
    tile = max(1, min(args.swap_tile, n_pages))
    resident = max(1, round(Fraction(args.swap_resident) * n_pages * n_layers))
    page_bytes = bs * nkv * hd * 2
    out = [{"steps": 0, "err_sparse": [], "err_exact": [], "mass": [], "attended": [], "visible": [], "hits": 0,
            "misses": 0, "us_sparse": [], "us_exact": [], "replay_equal": None, "pages": [], "budget": []}
           for _ in layers]
    with tempfile.TemporaryDirectory(prefix="hss-recall-swap-") as tmp, contextlib.ExitStack() as stack:
        own = stack.enter_context
        dims = ModelDims(n_layers, n_pages, nq, nkv, hd, bs)
        cfg = HighSpeedSwapConfig(tmp, 1 << 62, resident + 2 * tile, args.swap_rank, 1, False, args.seed, store="host",
                                  stream_tile_blocks=tile)
        sparse, exact = own(HighSpeedSwap(ctx, cfg, dims)), own(HighSpeedSwap(ctx, cfg, dims))
        k_dev, page_dev = own(cm.DeviceBuffer(keys[0].nbytes)), own(cm.DeviceBuffer(page_bytes))
        q_dev, o_sparse, o_exact = (own(cm.DeviceBuffer(2 * nq * hd)) for _ in range(3))
        for li in range(n_layers):
            nan_tail = keys[li].copy()
            nan_tail[t:] = np.nan
            cm.copy_h_to_d_async(k_dev, nan_tail, nan_tail.nbytes, s)
            for b in range(n_pages):
                for h in (sparse, exact):
                    h.offload_block(ctx, li, b, k_dev.ptr + b * page_bytes, keys[li, b * bs:(b + 1) * bs],
                                    values[li, b * bs:(b + 1) * bs])
            cm.stream_sync(s)
        got = np.empty((nq, hd), BF16)
        positions = layers[0].positions
        for i, p in enumerate(positions.tolist()):
            cur, valid = p // bs, p % bs + 1
            n = cur + 1
            ids = np.arange(n)
            budget = max(0, max(1, round(frac * n)) - min(n, first + recent))
            for li, layer in enumerate(layers):
                kp, vp = keys[li, cur * bs:(cur + 1) * bs].copy(), values[li, cur * bs:(cur + 1) * bs].copy()
                kp[valid:], vp[valid:] = 0, 0
                kd = kp.copy()
                kd[valid:] = np.nan
                cm.copy_h_to_d_async(page_dev, kd, kd.nbytes, s)
                q = layer.queries[i].astype(BF16)
                cm.copy_h_to_d_async(q_dev, q, q.nbytes, s)
                for h in (sparse, exact):
                    h.offload_block(ctx, li, cur, page_dev, kp, vp)
                cm.stream_sync(s)
                tick = time.perf_counter()
                rec = sparse.attend_layer(ctx, li, ids, q_dev, o_sparse, q_pos=p, budget_pages=budget,
                                          keep_first=first, keep_recent=recent)
                cm.stream_sync(s)
                tock = time.perf_counter()
                exact.attend_layer(ctx, li, ids, q_dev, o_exact, q_pos=p)
                cm.stream_sync(s)
                done = time.perf_counter()
                want, w = _exact_attention(q.astype(np.float64), keys[li, :p + 1].astype(np.float64),
                                           values[li, :p + 1].astype(np.float64))
                norm = np.linalg.norm(want) or 1.0
                row = out[li]
                for buf, key in ((o_sparse, "err_sparse"), (o_exact, "err_exact")):
                    cm.copy_d_to_h_async(got, buf, got.nbytes, s)
                    cm.stream_sync(s)
                    row[key].append(float(np.linalg.norm(got.astype(np.float64) - want) / norm))
                tokens = np.concatenate([np.arange(b * bs, min((b + 1) * bs, p + 1)) for b in rec.attended] or
                                        [np.zeros(0, np.int64)])
                row["mass"].append(float(w[:, tokens].sum(axis=1).mean()))
                row["attended"].append(len(rec.attended))
                row["pages"].append(rec.attended)
                row["budget"].append(budget)
                row["visible"].append(n)
                row["hits"] += len(rec.hits)
                row["misses"] += len(rec.misses)
                row["us_sparse"].append((tock - tick) * 1e6)
                row["us_exact"].append((done - tock) * 1e6)
                row["steps"] += 1
                if i == len(positions) - 1:    # the pages as offloaded now: the padded arrays (p is the last token)
                    with cm.DeviceBuffer(keys[li].nbytes) as kk, cm.DeviceBuffer(values[li].nbytes) as vv:
                        cm.copy_h_to_d_async(kk, keys[li], keys[li].nbytes, s)
                        cm.copy_h_to_d_async(vv, values[li], values[li].nbytes, s)
                        row["replay_equal"] = _replay_matches(ctx, sparse, rec, kk, vv, q_dev, o_sparse)
    return out


def _groups(layers: list[int], model_layers: int, count: int) -> list[tuple[str, list[int]]]:
    """Contiguous groups of the model's layers (``count`` of them), limited to those measured."""
    out = []
    for part in np.array_split(np.arange(model_layers), min(count, model_layers)):
        idx = [i for i, layer in enumerate(layers) if part[0] <= layer <= part[-1]]
        if idx:
            out.append((f"L{part[0]}-{part[-1]}", idx))
    return out


def run(args: argparse.Namespace) -> list[dict]:
    """Build the workload, score it with every method and return the rows (a meta row first)."""
    meta: dict[str, Any] = {"kind": "meta", "driver": cm.driver_status().kind}
    if args.smoke:
        work = synthetic_workload(args)
    else:
        try:
            work = real_workload(args)
        except HssError as exc:
            if "GGUF" not in str(exc) or "not on this machine" not in str(exc):
                raise
            return [{**meta, "notes": [f"skipped: {exc}"]}]
    bs, budgets = args.block_size, [Fraction(b) for b in args.budgets]
    hd = work.texts[0][1][0].keys.shape[2]
    temperature = math.sqrt(hd)
    ranks = [r for r in args.ranks if r <= hd]
    start = time.perf_counter()
    calibrated = {r: calibrate_projection(work.calibration, r) for r in ranks}
    calibrate_s = time.perf_counter() - start
    configs: list[tuple[str, int, int | None, np.ndarray | None, float | None]] = []
    for r in ranks:
        configs += [("original", r, args.seed, None, None), ("calibrated", r, None, calibrated[r], None)]
        if not args.no_norm:
            configs.append(("calibrated +norm", r, None, calibrated[r], temperature))
    results: dict[tuple[str, int], list[list[dict]]] = {}   # (method, r) -> per text, per layer: recall by budget
    kernel_s = numpy_s = swap_s = 0.0
    swap_layers = _swap_layers(args, work.layers)
    swap_idx = [work.layers.index(layer) for layer in swap_layers]
    swapped: list[list[dict]] = []                            # per text, per swap layer: swap_decode's results
    with cm.CudaCtx(0) as ctx:
        for _, layers in work.texts:
            tick = time.perf_counter()
            scores = {(method, r): kernel_scores(ctx, layers, bs, r, seed, proj, temp)
                      for method, r, seed, proj, temp in configs}
            kernel_s += time.perf_counter() - tick
            tick = time.perf_counter()
            truths = []
            for layer in layers:
                tot, per_head = truth_and_baselines(layer, bs)
                truths.append(tot)
                for key, sc in _baselines(tot, per_head, None if args.no_norm else temperature).items():
                    scores.setdefault(key, []).append(sc)
            for key, per_layer in scores.items():
                results.setdefault(key, []).append(
                    [recall(sc, tot, layer.positions, bs, budgets, args.first, args.recent)
                     for sc, tot, layer in zip(per_layer, truths, layers)])
            numpy_s += time.perf_counter() - tick
            if swap_idx:
                tick = time.perf_counter()
                swapped.append(swap_decode(ctx, [layers[j] for j in swap_idx], bs, args))
                swap_s += time.perf_counter() - tick
    meta.update(layers=work.layers, texts=[name for name, _ in work.texts], queries=len(work.texts[0][1][0].positions),
                block_size=bs, first=args.first, recent=args.recent, temperature=temperature,
                forward_s=round(work.forward_s, 1), kernels_s=round(kernel_s, 1), numpy_s=round(numpy_s, 1),
                calibrate_s=round(calibrate_s, 1), notes=work.notes, swap_layers=swap_layers, swap_s=round(swap_s, 1),
                swap=dict(budget=args.swap_budget, resident=args.swap_resident, rank=args.swap_rank,
                          tile=args.swap_tile, seed=args.seed))
    return [meta, *_rows(results, work, budgets, hd, bs, args.groups),
            *_swap_rows(swapped, swap_layers, work.model_layers, args.groups)]


def _swap_rows(swapped: list[list[dict]], layers: list[int], model_layers: int, groups: int) -> list[dict]:
    """``swap_decode``'s results summed over every (text, layer) of each layer group (and of all): one row each."""
    if not swapped:
        return []
    rows = []
    for label, idx in [("all", list(range(len(layers)))), *_groups(layers, model_layers, groups)]:
        items = [text[j] for text in swapped for j in idx]

        def cat(key: str) -> np.ndarray:
            return np.concatenate([np.asarray(it[key], np.float64) for it in items])

        hits, misses = sum(it["hits"] for it in items), sum(it["misses"] for it in items)
        err, us_s, us_e = cat("err_sparse"), cat("us_sparse"), cat("us_exact")
        rows.append({"kind": "swap", "layers": label, "steps": int(err.size),
                     "steps_per_layer": min(it["steps"] for it in items),
                     "attended": float((cat("attended") / cat("visible")).mean()),
                     "err_mean": float(err.mean()), "err_p90": float(np.percentile(err, 90)),
                     "err_max": float(err.max()),
                     "exact_err_mean": float(cat("err_exact").mean()), "exact_err_max": float(cat("err_exact").max()),
                     "mass_mean": float(cat("mass").mean()), "mass_p10": float(np.percentile(cat("mass"), 10)),
                     "hit_rate": hits / (hits + misses) if hits + misses else 0.0,
                     "us_sparse": float(us_s.mean()), "us_exact": float(us_e.mean()),
                     "ratio": float(us_s.mean() / us_e.mean()),
                     "replay_equal": all(it["replay_equal"] for it in items)})
    return rows


def _baselines(tot: np.ndarray, per_head: dict[str, np.ndarray], temperature: float | None
               ) -> dict[tuple[str, int], np.ndarray]:
    """The numpy methods' page scores ``[nQ, n_pages]`` of one layer."""
    out = {("oracle", 0): tot, ("exact max q.k", 0): per_head["exact"].max(axis=1),
           ("Quest min/max", 0): per_head["quest"].max(axis=1), ("recency", 0): per_head["recency"][:, 0]}
    if temperature is not None:
        out["Quest min/max +norm", 0] = head_norm(per_head["quest"], temperature)
    return out


def _bytes_per_token(method: str, r: int, hd: int, bs: int) -> float | None:
    if method.startswith(("original", "calibrated")):
        return 2.0 * r
    return {"exact max q.k": 2.0 * hd, "Quest min/max": 4.0 * hd / bs, "Quest min/max +norm": 4.0 * hd / bs,
            "recency": 0.0}.get(method)


def _rows(results: dict, work: Workload, budgets: list[Fraction], hd: int, bs: int, groups: int) -> list[dict]:
    rows = []
    for (method, r), per_text in results.items():
        for f in budgets:
            for fr in (False, True):
                items = np.array([[layer[str(f), fr] for layer in text] for text in per_text])   # [texts, L, nQ]
                for label, idx in [("all", list(range(len(work.layers)))),
                                   *_groups(work.layers, work.model_layers, groups)]:
                    v = items[:, idx].ravel()
                    rows.append({"method": method, "r": r or None, "bytes/token": _bytes_per_token(method, r, hd, bs),
                                 "budget": str(f), "first/recent": fr, "layers": label, "mean": float(v.mean()),
                                 "p10": float(np.percentile(v, 10)), "items": int(v.size)})
    return rows


ORDER = ("oracle", "exact max q.k", "original", "calibrated", "calibrated +norm", "Quest min/max",
         "Quest min/max +norm", "recency")


def _sorted(rows: list[dict]) -> list[dict]:
    return sorted(rows, key=lambda row: (ORDER.index(row["method"]) if row["method"] in ORDER else len(ORDER),
                                         row["r"] or 0))


def _pivot(rows: list[dict], column: str, columns: list[str]) -> list[str]:
    """Markdown lines: one row per (method, r), one column per value of ``column``, cells ``mean / p10``."""
    cells: dict[tuple[str, int | None], dict[str, str]] = {}
    info: dict[tuple[str, int | None], Any] = {}
    for row in _sorted(rows):
        key = (row["method"], row["r"])
        cells.setdefault(key, {})[row[column]] = f"{row['mean']:.3f} / {row['p10']:.3f}"
        info[key] = row["bytes/token"]
    lines = ["| method | r | B/token/kv head | " + " | ".join(columns) + " |", "|---" * (3 + len(columns)) + "|"]
    for (method, r), by in cells.items():
        size = info[method, r]
        lines.append(f"| {method} | {r or ''} | {'' if size is None else f'{size:g}'} | "
                     + " | ".join(by.get(c, "") for c in columns) + " |")
    return lines


def _target(rows: list[dict]) -> str:
    t = TARGET

    def pick(method: str, r: int | None) -> dict | None:
        return next((row for row in rows if row["method"] == method and row["r"] == r and row["layers"] == "all"
                     and row["budget"] == t["budget"] and row["first/recent"]), None)

    got, quest = pick(t["method"], t["r"]), pick("Quest min/max", None)
    if got is None:
        return f"target: {t['method']} r = {t['r']} not measured"
    ok = got["mean"] >= t["mean"] and got["p10"] >= t["p10"]
    above = quest is not None and got["mean"] > quest["mean"] and got["p10"] > quest["p10"]
    best = pick("calibrated +norm", t["r"])
    extra = f"; with +norm {best['mean']:.3f} / {best['p10']:.3f}" if best else ""
    return (f"target ({t['method']} r = {t['r']}, +F/R, budget {t['budget']}: mean >= {t['mean']}, worst decile >= "
            f"{t['p10']}, above Quest min/max): {got['mean']:.3f} / {got['p10']:.3f} "
            f"{'MET' if ok else 'MISSED'}, {'above' if above else 'NOT above'} Quest"
            + (f" ({quest['mean']:.3f} / {quest['p10']:.3f})" if quest else "") + extra)


def table(rows: list[dict]) -> str:
    """Markdown: the meta lines, recall by budget (without and with first/recent pages), by layer group at 1/8."""
    meta = next((row for row in rows if row.get("kind") == "meta"), {})
    data = [row for row in rows if row.get("kind") is None]
    lines = [f"- {note}" for note in meta.get("notes", [])]
    if not data:
        return "\n".join(lines)
    lines += [f"- driver {meta['driver']}; texts: {'; '.join(meta['texts'])}; layers {_span(meta['layers'])}; "
              f"last {meta['queries']} positions as queries; {meta['block_size']}-token pages; +F/R = first "
              f"{meta['first']} + newest {meta['recent']} pages; +norm temperature {meta['temperature']:g}",
              f"- time: forward {meta['forward_s']} s (numpy), kernels {meta['kernels_s']} s, numpy baselines "
              f"{meta['numpy_s']} s, calibration {meta['calibrate_s']} s",
              "- cells: mean / worst decile (10th percentile) of the attention mass kept, over every "
              "(text, layer, query); oracle, exact, Quest and recency are numpy baselines, the rest hss's kernels"]
    budgets = list(dict.fromkeys(row["budget"] for row in data))
    groups = list(dict.fromkeys(row["layers"] for row in data if row["layers"] != "all"))
    for fr in (False, True):
        sel = [row for row in data if row["layers"] == "all" and row["first/recent"] is fr]
        lines += ["", f"recall by budget (fraction of the visible pages), {'+F/R' if fr else 'scores only'}:", ""]
        lines += _pivot(sel, "budget", budgets)
    mid = "1/8" if "1/8" in budgets else budgets[0]
    for fr in (False, True):
        sel = [row for row in data if row["layers"] != "all" and row["budget"] == mid and row["first/recent"] is fr]
        lines += ["", f"by layer group, budget {mid}, {'+F/R' if fr else 'scores only'}:", ""]
        lines += _pivot(sel, "layers", groups)
    swap = [row for row in rows if row.get("kind") == "swap"]
    return "\n".join([*lines, "", _target(data), *_swap_table(meta, swap)])


def _swap_table(meta: dict, rows: list[dict]) -> list[str]:
    """Markdown lines of the sparse swap section (none without its rows)."""
    if not rows:
        return []
    sw = meta["swap"]
    lines = ["", f"sparse swap mode (docs/design.md §17.6): HighSpeedSwap, HostStore, the original P at "
             f"r = {sw['rank']} "
             f"(seed {sw['seed']:#x}); budget {sw['budget']} of the visible pages +F/R (first {meta['first']}, newest "
             f"{meta['recent']}); resident set {sw['resident']} of the pages (all swap layers share it), tiles of at "
             f"most {sw['tile']} pages; {rows[0]['steps_per_layer']} consecutive decode steps per (text, layer), "
             f"layers {_span(meta['swap_layers'])}, {meta['swap_s']} s. Error: relative L2 of the step's output "
             "against float64 attention over every visible token (bf16 inputs); mass: the true attention mass of the "
             "pages attended; µs: host wall time of a step, its stream waited for (the emulator's mean nothing).", "",
             "| layers | steps | pages attended | error mean / p90 / max | exact step error mean / max | mass mean / "
             "p10 | hit rate | sparse µs | exact µs | sparse / exact | replay |", "|---" * 11 + "|"]
    for r in rows:
        lines.append(f"| {r['layers']} | {r['steps']} | {r['attended']:.3f} | {r['err_mean']:.4f} / {r['err_p90']:.4f} "
                     f"/ {r['err_max']:.4f} | {r['exact_err_mean']:.4f} / {r['exact_err_max']:.4f} | "
                     f"{r['mass_mean']:.3f} / {r['mass_p10']:.3f} | {r['hit_rate']:.3f} | {r['us_sparse']:.0f} | "
                     f"{r['us_exact']:.0f} | {r['ratio']:.3f} | {'bitwise' if r['replay_equal'] else 'DIFFERS'} |")
    return lines


def _span(layers: list[int]) -> str:
    whole = layers == list(range(layers[0], layers[-1] + 1))
    return f"{layers[0]}-{layers[-1]}" if whole else ",".join(map(str, layers))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--texts", type=int, default=3, help="texts evaluated (default 3)")
    p.add_argument("--tokens", type=int, default=4096, help="tokens per text (default 4096)")
    p.add_argument("--queries", type=int, default=64, help="decode queries: the last N positions (default 64)")
    p.add_argument("--layers", help="model layers measured, e.g. 0-29 or 0,10,20 (default all)")
    p.add_argument("--ranks", type=int, nargs="+", default=[8, 16, 32], help="predictor ranks (default 8 16 32)")
    p.add_argument("--budgets", nargs="+", default=list(BUDGETS), help="page budgets as fractions (default "
                   + " ".join(BUDGETS) + ")")
    p.add_argument("--first", type=int, default=1, help="+F/R: first pages always kept (default 1)")
    p.add_argument("--recent", type=int, default=4, help="+F/R: newest pages always kept (default 4)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per page (default 16)")
    p.add_argument("--groups", type=int, default=3, help="layer groups reported (default 3)")
    p.add_argument("--seed", type=lambda v: int(v, 0), default=SEED, help="the original predictor's projection seed")
    p.add_argument("--calibration", choices=("doc", "prose"), default="doc",
                   help="calibrate on a separate run of the docs' topics (default) or on english_text('python')")
    p.add_argument("--calibration-tokens", type=int, default=4096,
                   help="tokens of the calibration text (default 4096, whatever --tokens is)")
    p.add_argument("--no-norm", action="store_true", help="skip the per-head normalised (+norm) variants")
    p.add_argument("--no-swap", action="store_true", help="skip the sparse swap section")
    p.add_argument("--swap-layers", help="model layers of the sparse swap section (default every measured layer)")
    p.add_argument("--swap-budget", default="1/8", help="sparse swap: page budget as a fraction (default 1/8)")
    p.add_argument("--swap-resident", default="1/8", help="sparse swap: resident set as a fraction of the pages "
                                                          "(default 1/8)")
    p.add_argument("--swap-rank", type=int, default=8, help="sparse swap: the predictor's rank (default 8)")
    p.add_argument("--swap-tile", type=int, default=16, help="sparse swap: pages per streamed tile (default 16)")
    p.add_argument("--smoke", action="store_true", help="tiny synthetic keys, no model: code paths only")
    args = p.parse_args(argv)
    if args.swap_tile < 1:
        p.error("--swap-tile must be >= 1")
    for name in ("swap_budget", "swap_resident"):
        try:
            f = Fraction(getattr(args, name))
        except (ValueError, ZeroDivisionError):
            p.error(f"--{name.replace('_', '-')} {getattr(args, name)}: not a fraction")
        if not 0 < f <= 1:
            p.error(f"--{name.replace('_', '-')} {getattr(args, name)}: must be in (0, 1]")
    for name in ("texts", "tokens", "queries", "block_size", "groups", "calibration_tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    for b in args.budgets:
        try:
            f = Fraction(b)
        except (ValueError, ZeroDivisionError):
            p.error(f"--budgets {b}: not a fraction")
        if not 0 < f <= 1:
            p.error(f"--budgets {b}: must be in (0, 1]")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rows = run(args)
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
