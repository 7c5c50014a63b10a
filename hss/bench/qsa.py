"""QSA decode step (``QsaIndexer.decode_select``) at 8K, 32K and 128K visible tokens, stage by stage, against
the same step in PyTorch eager, in the same run.

Dims are Qwen3.8-Flash-Next's: hidden 2560, indexer 4 heads x 128, ratio 4, budget 2048, rot 64, theta 1e7;
attention 2 kv heads x 256, page size 16. Per context:

* GPU time of each stage's kernel (qk GEMV, pool, qprep, score, gather): CUDA timing events around ``REPS``
  launches queued behind a large memset, so they run back to back (no host issue gaps), divided by REPS;
* host wall time of the blocking parts of a step: the scores' D2H (waiting for the GPU, then copying) and
  the host top-k;
* ``decode_select``: wall time of consecutive real decode steps (ingest + selection; the host blocks once per
  step), per step; ``torch eager``: the same step in PyTorch eager (matmul, RMS norm, RoPE, pooling of a
  completed block, scores, ``torch.topk``, sort, token expansion, ``index_select`` of K/V through the page
  table), consecutive steps, synchronised at the end;
* score bandwidth (block-key bytes read / score time) against a device copy of the same bytes (read + written).

Target: ``decode_select`` <= 0.5x PyTorch eager at 32K. ``--smoke`` runs tiny dims on any driver (numbers
meaningless) and skips PyTorch.
"""
from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Callable
from typing import Any

import ml_dtypes
import numpy as np

from hss import cuda_min as cm
from hss._util import ceil_div
from hss.bench._timer import Case, Flush, gpu_us, host_us, rotating
from hss.cuda.gpu import CudaBackend
from hss.decls import qsa as kq
from hss.qsa import QsaIndexer
from hss.qsa.select import select_tokens

BF16 = ml_dtypes.bfloat16
DIMS = dict(hidden=2560, n_heads=4, hd=128, ratio=4, budget=2048, rot=64, theta=1e7, eps=1e-6, nkv_attn=2,
            hd_attn=256, block_size=16)
SMOKE_DIMS = dict(hidden=64, n_heads=2, hd=32, ratio=4, budget=16, rot=16, theta=1e4, eps=1e-6, nkv_attn=1,
                  hd_attn=32, block_size=8)
CONTEXTS = (8192, 32768, 131072)
SMOKE_CONTEXTS = (24, 40)
SLAB = 2048                 # distinct hidden rows (reused cyclically for prefill and decode)


class _Timer:
    """GPU time per launch of a queued operation: REPS launches behind a blocker (a large memset, so they run back
    to back), between timing events; the median of ROUNDS."""

    def __init__(self, stream: int, smoke: bool) -> None:
        self.s = stream
        self.blocker = Flush(stream, 4096 if smoke else 1 << 30)   # ~0.4 ms: the queue fills
        self.reps, self.rounds = (2, 1) if smoke else (40, 5)

    def us(self, fn: Callable[[], None]) -> float:
        return gpu_us(self.s, fn, batch=self.reps, batches=self.rounds, warmup=1, prepare=self.blocker,
                      sync_each=True).us

    def close(self) -> None:
        self.blocker.close()


def _upload(arr: np.ndarray, stream: int) -> cm.DeviceBuffer:
    buf = cm.DeviceBuffer(arr.nbytes)
    cm.copy_h_to_d_async(buf, arr, arr.nbytes, stream)
    return buf


def _context_row(gpu: CudaBackend, stream: int, timer: _Timer, n: int, d: dict, rng: np.random.Generator,
                 steps: int, warm: int, torch_note: str | None) -> dict[str, Any]:
    H, nh, hd, ratio, bs = d["hidden"], d["n_heads"], d["hd"], d["ratio"], d["block_size"]
    qkw = (nh + 1) * hd
    total = n + warm + 2 * steps + ratio   # decode steps: warm-up, whole steps, then stage by stage
    w = (rng.standard_normal((qkw, H)) / math.sqrt(H)).astype(BF16)
    qn, kn = (rng.standard_normal(hd) * 0.1).astype(BF16), (rng.standard_normal(hd) * 0.1).astype(BF16)
    slab = (rng.standard_normal((SLAB, H)) * 0.5).astype(BF16)
    pages = ceil_div(total, bs)
    row_bytes = d["nkv_attn"] * d["hd_attn"] * 2
    table = rng.permutation(pages).astype(np.int32)
    bufs = [_upload(a, stream) for a in (w, qn, kn, slab, table)]
    d_w, d_qn, d_kn, d_slab, d_table = bufs
    k_pool, v_pool = cm.DeviceBuffer(pages * bs * row_bytes), cm.DeviceBuffer(pages * bs * row_bytes)
    for pool in (k_pool, v_pool):   # any finite bf16 values do for a copy: 1.0
        cm.memset_d32_async(pool, 0x3F803F80, pool.bytes // 4, stream)
    idx = QsaIndexer(d_w, d_qn, d_kn, nh, hd, ratio, d["budget"], d["rot"], d["theta"], d["eps"], H,
                     d["nkv_attn"], d["hd_attn"], gpu, max_tokens=total)
    st = idx.new_seq_state()
    for start in range(0, n - 1, SLAB):
        idx.prefill_ingest(st, d_slab, min(SLAB, n - 1 - start), start, stream)
    cm.stream_sync(stream)

    def row(pos: int) -> int:
        return d_slab.ptr + (pos % SLAB) * H * 2

    def step(p: int) -> None:
        idx.decode_select(st, row(p), p, k_pool, v_pool, d_table, bs, stream)

    # warm-up steps, then consecutive whole steps (positions n - 1, n, ...), synchronised at the end
    whole = Case(rotating(step, n - 1), lambda: cm.stream_sync(stream))
    step_us = host_us({"step": whole}, batch=steps, batches=1, warmup=warm, timed_sync=True)["step"].us
    pos = n - 1 + warm + steps
    # the blocking host parts, one step at a time
    d2h, topk = [], []
    for _ in range(steps):
        visible = pos + 1
        complete = visible // ratio
        idx._ingest_token(st, row(pos), pos, stream)
        idx._score_blocks(st, pos, complete, stream)
        host = idx._scores_host[:complete]
        t0 = time.perf_counter()
        gpu.copy_d2h_on_stream(idx.scores_dev, host, stream)
        t1 = time.perf_counter()
        tokens = select_tokens(host, idx.block_topk, ratio, visible, out=idx._sel_host)
        t2 = time.perf_counter()
        idx._gather(st, tokens, k_pool.ptr, v_pool.ptr, d_table.ptr, bs, stream)
        d2h.append((t1 - t0) * 1e6)
        topk.append((t2 - t1) * 1e6)
        pos += 1
    cm.stream_sync(stream)
    # GPU time per stage (the last step's parameters)
    complete = pos // ratio
    n_sel = int(tokens.size)
    s = stream
    pool_pack = idx._k_pool.pack(st.raw_keys, d_kn, st.block_keys, complete - 1, ratio, hd, d["rot"], idx.theta,
                                 idx.eps)
    stage = {
        "gemv_us": timer.us(lambda: gpu.cublas_bf16_proj_dense(row(pos), d_w, idx.qk_scratch, 1, qkw, H, s)),
        "pool_us": timer.us(lambda: gpu.launch(idx._k_pool, (1, 1, 1), (hd, 1, 1), kq.row_smem_bytes(hd), s,
                                               pool_pack)),
        "qprep_us": timer.us(lambda: gpu.launch(idx._k_qprep, (nh, 1, 1), (hd, 1, 1), kq.row_smem_bytes(hd), s,
                                                idx._qprep_pack)),
        "score_us": timer.us(lambda: gpu.launch(idx._k_score, (kq.score_grid(complete, hd), 1, 1),
                                                (kq.SCORE_THREADS, 1, 1), kq.score_smem_bytes(nh, hd), s,
                                                idx._score_pack)),
        "gather_us": timer.us(lambda: gpu.launch(idx._k_gather, (n_sel, 1, 1), (kq.GATHER_THREADS, 1, 1), 0, s,
                                                 idx._gather_pack)),
    }
    key_bytes = complete * hd * 2
    copy_dst = cm.DeviceBuffer(key_bytes)
    copy_us = timer.us(lambda: cm.copy_d_to_d_async(copy_dst, st.block_keys, key_bytes, s))
    copy_dst.close()
    out = {"visible": n, "blocks": complete, "n_sel": n_sel, **stage,
           "d2h_us": statistics.median(d2h), "topk_us": statistics.median(topk), "decode_select_us": step_us,
           "score_gbps": key_bytes / stage["score_us"] / 1e3, "copy_gbps": 2 * key_bytes / copy_us / 1e3,
           "torch_us": None, "ratio_to_torch": None, "note": torch_note or ""}
    if torch_note is None:
        try:
            out["torch_us"] = _torch_step_us(w, qn, kn, slab, table, n, d, steps, warm, pages)
            out["ratio_to_torch"] = step_us / out["torch_us"]
        except Exception as exc:   # report why the peer is missing
            out["note"] = f"torch eager skipped: {type(exc).__name__}: {exc}"
    idx.release_seq_state(st)
    idx.close()
    for b in (*bufs, k_pool, v_pool):
        b.close()
    return out


def _torch_step_us(w, qn, kn, slab, table, n, d, steps, warm, pages) -> float:
    """The same decode step in PyTorch eager, per step (consecutive steps, synchronised at the end)."""
    import torch
    dev = torch.device("cuda")
    nh, hd, ratio, bs, rot = d["n_heads"], d["hd"], d["ratio"], d["block_size"], d["rot"]
    topk_blocks, eps, half = d["budget"] // ratio, d["eps"], rot // 2

    def t(a: np.ndarray) -> torch.Tensor:
        if a.dtype == BF16:
            return torch.from_numpy(a.view(np.uint16).astype(np.int16)).view(torch.bfloat16).to(dev)
        return torch.from_numpy(a).to(dev)

    W, QN, KN, X = t(w), t(qn).float(), t(kn).float(), t(slab)
    total = n + warm + steps + ratio
    raw = torch.randn(total, hd, device=dev).to(torch.bfloat16)
    blocks = torch.randn(total // ratio, hd, device=dev).to(torch.bfloat16)
    kpool = torch.ones(pages, bs, d["nkv_attn"], d["hd_attn"], device=dev, dtype=torch.bfloat16)
    vpool = torch.ones_like(kpool)
    tab = t(table).long()
    inv_freq = torch.exp(-(2.0 * torch.arange(half, device=dev, dtype=torch.float64) / rot) * math.log(d["theta"]))
    ar = torch.arange(ratio, device=dev)

    def norm(x, wt):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + wt)

    def rope(x, p: int):
        ang = (p * inv_freq).float()
        c, s = torch.cos(ang), torch.sin(ang)
        x1, x2 = x[..., :half], x[..., half:rot]
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s, x[..., rot:]], dim=-1)

    def step(pos: int) -> None:
        qk = W @ X[pos % SLAB]                                     # [qkw]
        raw[pos] = qk[nh * hd:]
        visible = pos + 1
        complete = visible // ratio
        if visible % ratio == 0:                                   # a block completed: pool it
            b = complete - 1
            v = raw[b * ratio:visible].float().mean(0)
            blocks[b] = rope(norm(v, KN), b * ratio).to(torch.bfloat16)
        q = rope(norm(qk[:nh * hd].float().view(nh, hd), QN), pos)
        scores = torch.relu(blocks[:complete].float() @ q.T).sum(-1) / math.sqrt(hd)
        chosen = torch.sort(torch.topk(scores, topk_blocks).indices).values
        sel = torch.cat([(chosen[:, None] * ratio + ar).flatten(),
                         torch.arange(complete * ratio, visible, device=dev)])
        page, slot = tab[sel // bs], sel % bs
        kpool[page, slot]   # the gathered K and V (index_select through the page table)
        vpool[page, slot]

    # warm-up steps, then consecutive timed steps, synchronised at the end
    case = Case(rotating(step, n - 1), torch.cuda.synchronize)
    return host_us({"torch": case}, batch=steps, batches=1, warmup=warm, timed_sync=True)["torch"].us


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    smoke = bool(getattr(args, "smoke", False))
    dims, contexts = (SMOKE_DIMS, SMOKE_CONTEXTS) if smoke else (DIMS, CONTEXTS)
    steps, warm = (3, 1) if smoke else (200, 20)
    torch_note: str | None = None
    if smoke:
        torch_note = "torch eager skipped: --smoke"
    else:
        try:
            import torch
            if not torch.cuda.is_available():
                torch_note = "torch eager skipped: torch sees no CUDA device"
        except ImportError:
            torch_note = "torch eager skipped: torch is not installed"
    ctx = cm.CudaCtx(0)
    gpu = CudaBackend(ctx)
    timer = _Timer(ctx.stream, smoke)
    rng = np.random.default_rng(0)
    try:
        if not smoke:   # clocks, cuBLAS heuristics and first-call costs: one untimed context first
            _context_row(gpu, ctx.stream, timer, contexts[0], dims, rng, 20, 5, "warm-up")
        rows = [_context_row(gpu, ctx.stream, timer, n, dims, rng, steps, warm, torch_note) for n in contexts]
    finally:
        timer.close()
        gpu.close()
        ctx.close()
    return rows


def _f(v: Any, fmt: str = ".1f") -> str:
    return "—" if v is None else format(v, fmt)


def table(rows: list[dict[str, Any]]) -> str:
    out = ["| visible | GEMV µs | pool µs | qprep µs | score µs | gather µs | D2H µs | top-k µs | "
           "decode_select µs | torch eager µs | × torch | score GB/s | copy GB/s |",
           "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        out.append(f"| {r['visible']} | {_f(r['gemv_us'])} | {_f(r['pool_us'])} | {_f(r['qprep_us'])} | "
                   f"{_f(r['score_us'])} | {_f(r['gather_us'])} | {_f(r['d2h_us'])} | {_f(r['topk_us'])} | "
                   f"{_f(r['decode_select_us'])} | {_f(r['torch_us'])} | {_f(r['ratio_to_torch'], '.2f')} | "
                   f"{_f(r['score_gbps'], '.0f')} | {_f(r['copy_gbps'], '.0f')} |")
    notes = sorted({r["note"] for r in rows if r["note"]})
    out += [f"\n{n}" for n in notes]
    out.append("\nKernel columns: GPU time per launch (back to back); D2H and top-k: host wall time of the blocking "
               "parts; decode_select and torch eager: per step. Score GB/s counts block-key bytes read; copy GB/s "
               "counts bytes read + written by a device copy of the same size.")
    at32 = next((r for r in rows if r["visible"] == 32768), None)
    if at32 is not None and at32["ratio_to_torch"] is not None:
        verdict = "met" if at32["ratio_to_torch"] <= 0.5 else "NOT met"
        out.append(f"\nTarget decode_select <= 0.5x PyTorch eager at 32K: {verdict} ({at32['ratio_to_torch']:.2f}x)")
    return "\n".join(out)
