"""``python -m hss demo-qsa``: a decode loop on one Qwen3.8-Flash-Next-like attention layer.

Seeded synthetic weights, hidden states and paged KV (pages in a shuffled order, as a real pool).
Prefill ingests the indexer keys and projects every KV page into the predictor's low-rank store;
each decode step then runs the predictor over the KV pages (``project_q`` + ``score_layer``), the
QSA indexer's selection (``decode_select``: ingest, score, host top-k, gather), attention over the
selected tokens (``TiledAttention`` over the gathered scratch with its identity table) and over all
tokens (dense, the real block table), and prints per-stage time, selection size and the cosine
between sparse and dense attention outputs. On the CPU emulator the sizes are smaller and every
time printed is marked as no hardware measurement.

The main demo, SmolLM2 decoded through hss, is :mod:`hss.demo.model` (``python -m hss demo``).
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import ml_dtypes
import numpy as np

from hss import cuda_min as cm
from hss._util import ceil_div
from hss.attention import TiledAttention, TiledAttentionDims
from hss.cuda.gpu import CudaBackend
from hss.demo.model import NOT_MEASURED, int_at_least
from hss.predictor import Predictor, PredictorDims
from hss.qsa import QsaIndexer

__all__ = ["HELP", "add_arguments", "run"]

BF16 = ml_dtypes.bfloat16
N_HEADS, HD, RATIO, BUDGET, ROT, THETA, EPS = 4, 128, 4, 2048, 64, 1e7, 1e-6
NQ, NKV, HD_ATTN, BS, RANK = 24, 2, 256, 16, 32
HELP = "decode loop on a synthetic Qwen3.8-Flash-Next-like layer: predictor, QSA selection, sparse vs dense attention"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``demo-qsa`` on ``p`` (range-checked by argparse)."""
    p.add_argument("--prefill", type=int_at_least(1), metavar="N",
                   help="tokens ingested before decoding (default 4096; emulator 2052)")
    p.add_argument("--steps", type=int_at_least(1), metavar="N", help="decode steps (default 8; emulator 3)")
    p.add_argument("--hidden", type=int_at_least(1), metavar="N",
                   help="hidden size (default 2560, the model's; emulator 256)")
    p.add_argument("--seed", type=int_at_least(0), default=0, metavar="N",
                   help="seed of the synthetic weights and data (default 0)")
    p.add_argument("--device", type=int_at_least(0), default=0, metavar="N", help="CUDA device ordinal (default 0)")


def _upload(arr: np.ndarray, stream: int) -> cm.DeviceBuffer:
    buf = cm.DeviceBuffer(arr.nbytes)
    cm.copy_h_to_d_async(buf, np.ascontiguousarray(arr), arr.nbytes, stream)
    return buf


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


class _Timer:
    """CUDA timing events around the stages of one step (read after the step's sync)."""

    def __init__(self, names: list[str]) -> None:
        self.events = {n: (cm.CudaEvent(timing=True), cm.CudaEvent(timing=True)) for n in names}
        self.ms: dict[str, list[float]] = {n: [] for n in names}

    def start(self, name: str, stream: int) -> None:
        self.events[name][0].record(stream)

    def stop(self, name: str, stream: int) -> None:
        self.events[name][1].record(stream)

    def collect(self, names: list[str]) -> None:
        for n in names:
            a, b = self.events[n]
            self.ms[n].append(a.elapsed_ms(b))


def run(args: argparse.Namespace) -> int:
    """The decode loop (``args`` from :func:`add_arguments`); exit status 0."""
    status = cm.driver_status()
    emulated = status.kind == "emulator"
    prefill = args.prefill or (2052 if emulated else 4096)
    steps = args.steps or (3 if emulated else 8)
    hidden = args.hidden or (256 if emulated else 2560)
    total = prefill + steps
    pages = ceil_div(total, BS)
    rng = np.random.default_rng(args.seed)
    ctx = cm.CudaCtx(args.device)
    s = ctx.stream
    where = "CPU emulator (no GPU; smaller size: kernels run as numpy references)" if emulated else ctx.name
    print(f"hss demo-qsa on {where}: hidden {hidden}, indexer {N_HEADS}x{HD} (ratio {RATIO}, budget {BUDGET}, "
          f"rot {ROT}), attention {NQ}q/{NKV}kv x {HD_ATTN}, block size {BS}, {prefill} prefill tokens, "
          f"{steps} decode steps, seed {args.seed}")

    owned: list[Any] = []
    keep = owned.append
    w_qk = _upload((rng.standard_normal(((N_HEADS + 1) * HD, hidden)) / np.sqrt(hidden)).astype(BF16), s)
    w_qn = _upload((0.1 * rng.standard_normal(HD)).astype(BF16), s)
    w_kn = _upload((0.1 * rng.standard_normal(HD)).astype(BF16), s)
    hidden_dev = _upload(rng.standard_normal((total, hidden)).astype(BF16), s)
    kv_shape = (pages, BS, NKV, HD_ATTN)
    k_pool = _upload(rng.standard_normal(kv_shape).astype(BF16), s)
    v_pool = _upload(rng.standard_normal(kv_shape).astype(BF16), s)
    table = rng.permutation(pages).astype(np.int32)          # logical page -> physical page
    table_dev = _upload(table, s)
    for b in (w_qk, w_qn, w_kn, hidden_dev, k_pool, v_pool, table_dev):
        keep(b)
    page_bytes = BS * NKV * HD_ATTN * 2

    gpu = CudaBackend(ctx)
    indexer = QsaIndexer(w_qk, w_qn, w_kn, N_HEADS, HD, RATIO, BUDGET, ROT, THETA, EPS, hidden, NKV, HD_ATTN,
                         gpu, max_tokens=max(32768, total + RATIO))
    pred = Predictor(ctx, PredictorDims(1, NQ, NKV, HD_ATTN, RANK, BS, pages), projection_seed=0xCAFE_F00D)
    attn = TiledAttention(ctx, TiledAttentionDims(1, NQ, NKV, HD_ATTN, BS, pages))
    st = indexer.new_seq_state()

    t0 = time.perf_counter()
    indexer.prefill_ingest(st, hidden_dev, prefill, 0, s)
    for b in range(pages):   # the predictor projects each KV page as it is written
        pred.project_kv_block_on_stream(s, 0, b, k_pool.ptr + int(table[b]) * page_bytes)
    cm.stream_sync(s)
    note = f" {NOT_MEASURED}" if emulated else ""
    print(f"prefill: indexer ingest of {prefill} tokens + predictor projection of {pages} pages: "
          f"{(time.perf_counter() - t0) * 1e3:.1f} ms (host wall, includes first-use JIT){note}")

    q_proj = cm.DeviceBuffer(NQ * RANK * 2)
    scores = cm.DeviceBuffer(4 * pages)
    out_sparse, out_dense = cm.DeviceBuffer(NQ * HD_ATTN * 2), cm.DeviceBuffer(NQ * HD_ATTN * 2)
    counts = cm.DeviceBuffer(4)
    q_dev = cm.DeviceBuffer(NQ * HD_ATTN * 2)
    for b in (q_proj, scores, out_sparse, out_dense, counts, q_dev):
        keep(b)
    blk, tok, kvh = attn.paged_strides()
    stages = ["predictor", "decode_select", "sparse attention", "dense attention"]
    timer = _Timer(stages)
    host_select_ms, rows = [], []
    for pos in range(prefill, prefill + steps):
        visible = pos + 1
        n_pages = ceil_div(visible, BS)
        q = rng.standard_normal((NQ, HD_ATTN)).astype(BF16)
        cm.copy_h_to_d_async(q_dev, q, q.nbytes, s)

        timer.start("predictor", s)
        pred.project_q_on_stream(s, q_dev, q_proj)
        pred.score_layer_on_stream(s, q_proj, 0, 0, n_pages, scores)
        timer.stop("predictor", s)

        timer.start("decode_select", s)
        h0 = time.perf_counter()
        sel = indexer.decode_select(st, hidden_dev.ptr + pos * hidden * 2, pos, k_pool, v_pool, table_dev, BS, s)
        host_select_ms.append((time.perf_counter() - h0) * 1e3)
        timer.stop("decode_select", s)

        timer.start("sparse attention", s)
        if sel is not None:
            attn.begin_step_on_stream(s, 1)
            cm.copy_h_to_d_async(counts, np.array([sel.max_blocks], np.int32), 4, s)
            last = sel.n_sel - (sel.max_blocks - 1) * BS
            attn.step_tile_on_stream(s, q_dev, sel.k_scratch, sel.v_scratch, sel.table_dev, counts, 1,
                                     blk, tok, kvh, last)
            attn.finalize_on_stream(s, out_sparse, 1)
        timer.stop("sparse attention", s)

        timer.start("dense attention", s)
        attn.begin_step_on_stream(s, 1)
        cm.copy_h_to_d_async(counts, np.array([n_pages], np.int32), 4, s)
        attn.step_tile_on_stream(s, q_dev, k_pool, v_pool, table_dev, counts, 1, blk, tok, kvh,
                                 visible - (n_pages - 1) * BS)
        attn.finalize_on_stream(s, out_dense, 1)
        timer.stop("dense attention", s)

        cm.stream_sync(s)
        timer.collect(stages)
        dense = np.empty((NQ, HD_ATTN), BF16)
        cm.copy_d_to_h_async(dense, out_dense, dense.nbytes, s)
        if sel is not None:
            sparse = np.empty((NQ, HD_ATTN), BF16)
            cm.copy_d_to_h_async(sparse, out_sparse, sparse.nbytes, s)
            cos, n_sel = _cosine(sparse, dense), sel.n_sel
        else:
            cos, n_sel = 1.0, visible
        rows.append((pos, visible, n_sel, cos))
        print(f"step pos {pos}: visible {visible}, selected {n_sel} tokens"
              f"{'' if sel is not None else ' (inert: dense is exact)'}, cosine(sparse, dense) {cos:.4f}, "
              + ", ".join(f"{n} {timer.ms[n][-1] * 1e3:.0f} us" for n in stages) + note)
    print("median per stage over the steps: " + ", ".join(
        f"{n} {statistics.median(timer.ms[n]) * 1e3:.0f} us" for n in stages)
        + f"; decode_select host wall {statistics.median(host_select_ms) * 1e3:.0f} us{note}")

    indexer.release_seq_state(st)
    for obj in (indexer, pred, attn, gpu, *timer_events(timer), *owned):
        obj.close()
    ctx.close()
    return 0


def timer_events(timer: _Timer) -> list[cm.CudaEvent]:
    return [e for pair in timer.events.values() for e in pair]
