"""Recall of the predictor end to end (project_kv_block -> project_q -> score_layer), SPEC §5.5.

Two checks: the original's needle test (top-32 recall of planted needles, mean >= 0.95), and the
attention mass the predictor's top blocks capture against ``ground_truth_block_weights`` on keys with
structure (a few dominant directions plus noise), for r in {8, 16, 32, 64}. Both run at the original's
sizes on the emulator too (about a second each).
"""
from __future__ import annotations

import math

import numpy as np

from hss.predictor import Predictor, PredictorDims
from hss.reference import predictor as ref

from helpers import BF16, download, poisoned, upload

NEEDLE_SEEDS = (1, 7, 23, 99, 1337)
U64 = (1 << 64) - 1


def predictor_scores(ctx, stream, dims: PredictorDims, seed: int, q: np.ndarray, pages: np.ndarray) -> np.ndarray:
    """Project every page of ``pages [n, block_size, num_kv_heads, head_dim]`` into layer 0, project
    ``q [num_q_heads, head_dim]`` and score the layer's first n blocks."""
    n = pages.shape[0]
    with Predictor(ctx, dims, seed) as pred:
        k_dev = upload(pages, stream)
        page_bytes = pages[0].nbytes
        for b in range(n):
            pred.project_kv_block(ctx, 0, b, k_dev.ptr + b * page_bytes)
        q_proj = poisoned(2 * dims.num_q_heads * dims.r, stream)
        pred.project_q(ctx, upload(q, stream), q_proj)
        scores = poisoned(4 * n, stream)
        pred.score_layer(ctx, q_proj, 0, 0, n, scores)
        return download(scores, (n,), np.float32, stream)


def test_needle_recall_at_32(ctx, stream, record_property) -> None:
    """SPEC §5.5 recall_at_k: one needle per q head in a distinct block; top-32 must find them."""
    dims = PredictorDims(num_layers=1, num_q_heads=32, num_kv_heads=8, head_dim=128, r=32, block_size=16,
                         max_blocks=256)
    std = 1 / math.sqrt(128)
    recalls = []
    for seed in NEEDLE_SEEDS:
        rng = np.random.default_rng(seed)
        q = (rng.standard_normal((32, 128)) * std).astype(np.float32).astype(BF16)
        pages = (rng.standard_normal((256, 16, 8, 128)) * std).astype(np.float32).astype(BF16)
        needles = rng.choice(256, size=32, replace=False)
        for head, block in enumerate(needles):
            pages[block, (head * 7919) % 16, head // 4] = (32 * q[head].astype(np.float32)).astype(BF16)
        scores = predictor_scores(ctx, stream, dims, (seed * 0xCAFEF00D) & U64, q, pages)
        assert np.isfinite(scores).all()
        top = np.argsort(-scores, kind="stable")[:32]
        recalls.append(len(set(top.tolist()) & set(needles.tolist())) / 32)
    mean = float(np.mean(recalls))
    record_property("needle_recall_at_32", mean)
    print(f"needle recall@32 per seed {recalls}, mean {mean:.3f} (must be >= 0.95)")
    assert mean >= 0.95


def structured_keys(rng: np.random.Generator, n: int, bs: int, nkv: int, hd: int,
                    nq: int) -> tuple[np.ndarray, np.ndarray]:
    """Keys with structure and a query that picks part of it.

    Four orthonormal topic directions; block b has a topic and a strength c_b ~ U(0, 12), and each of
    its keys is c_b * (1 + 0.1 noise) * topic + N(0, I) (unit scale). Each q head is 8 * one topic
    (shared by the whole query, so attention concentrates on that topic's strong blocks) + N(0, I).
    """
    topics = np.linalg.qr(rng.standard_normal((hd, 4)))[0].T                      # [4, hd]
    topic = rng.integers(0, 4, size=n)
    strength = rng.uniform(0, 12, size=n)
    coef = strength[:, None, None] * (1 + 0.1 * rng.standard_normal((n, bs, nkv)))
    keys = coef[..., None] * topics[topic][:, None, None, :] + rng.standard_normal((n, bs, nkv, hd))
    q = 8 * topics[rng.integers(0, 4)] + rng.standard_normal((nq, hd))
    return q.astype(np.float32).astype(BF16), keys.astype(np.float32).astype(BF16)


def test_attention_mass_recall_by_rank(ctx, stream, record_property) -> None:
    """Share of the attention mass of the ground truth's top-16 blocks that the predictor's top-16
    capture, mean over 4 queries/key sets; r = 64 must not do worse than r = 8."""
    n, bs, nkv, hd, nq, top_k = 256, 16, 2, 128, 8, 16
    ranks = (8, 16, 32, 64)
    recall = {r: [] for r in ranks}
    for seed in range(4):
        rng = np.random.default_rng(1000 + seed)
        q, pages = structured_keys(rng, n, bs, nkv, hd, nq)
        truth = ref.ground_truth_block_weights(q, pages)
        best_mass = np.sort(truth)[::-1][:top_k].sum()
        for r in ranks:
            dims = PredictorDims(num_layers=1, num_q_heads=nq, num_kv_heads=nkv, head_dim=hd, r=r, block_size=bs,
                                 max_blocks=n)
            scores = predictor_scores(ctx, stream, dims, 0xCAFE_F00D + seed, q, pages)
            picked = np.argsort(-scores, kind="stable")[:top_k]
            recall[r].append(truth[picked].sum() / best_mass)
    means = {r: float(np.mean(v)) for r, v in recall.items()}
    for r, m in means.items():
        record_property(f"attention_mass_recall_r{r}", m)
    print("attention-mass recall@16 by r: " + ", ".join(f"r={r}: {m:.3f}" for r, m in means.items()))
    assert means[64] >= means[8]
