"""Predictor benchmark (device): ``python -m hss.bench.predictor [--tokens 4096 131072 ...] [--smoke]``.

Llama-3-8B-like dims (32 layers, 32 q / 8 kv heads, head_dim 128, r 32, block_size 16: each block's
K_lr slot is 8 KiB). For each context length, per layer:

* ``score_blocks``: median device time (launches captured in a CUDA graph, replays timed with CUDA
  events after warm-up, so host launch cost is excluded) and bandwidth (K_lr bytes + q_proj +
  scores, per second) against a device-to-device copy of the same byte count in the same run
  (bandwidth counted as bytes read + written). Windows of A_g and of the copy's buffers rotate so each
  sample streams from HBM, not the 50-60 MB L2;
* PyTorch eager on the same bytes (``einsum`` + ``amax`` in bf16), as a time ratio (skipped, with a
  note, without torch);
* once: ``project_kv_block`` pages per second, ``project_q`` microseconds, and one decode step of all
  layers (``project_q`` + ``score_layer`` each) at the shortest context launched eagerly vs captured
  once in a CUDA graph and replayed (host wall time per step).

Prints a markdown table with the targets (score_blocks >= 80 % of copy bandwidth and >= 5x torch at
>= 128K tokens; graph replay >= 3x eager at 4K) and returns the rows. ``--smoke`` runs tiny sizes
without torch (CI import check under ``HSS_DRIVER=emulator``).
"""
from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from typing import Any

import ml_dtypes
import numpy as np

from hss import cuda_min as cm
from hss._util import ceil_div
from hss.bench._timer import Case, gpu_us, host_us, rotating
from hss.predictor import Predictor, PredictorDims

LLAMA = dict(num_q_heads=32, num_kv_heads=8, head_dim=128, r=32, block_size=16)
TOKENS = (4096, 32768, 131072, 1 << 20)
ROTATE_BYTES = 256 << 20     # distinct bytes a timing cycles through: several times the L2
SAMPLE_BYTES = 256 << 20     # bytes streamed per timed sample (short kernels are batched)


def _eager_us(stream: int, launch: Callable[[int], None], reps: int, warmup: int, inner: int) -> float:
    """Median time per launch of ``inner`` launches issued from Python (host launch cost included)."""
    return gpu_us(stream, rotating(launch), batch=inner, batches=reps, warmup=warmup * inner).us


def _graph_us(stream: int, launch: Callable[[int], None], reps: int, warmup: int, inner: int) -> float:
    """Median device time per launch: launches 0 .. inner-1 captured once in a CUDA graph, replays timed
    (so the host's launch cost is out of the number)."""
    cm.begin_capture(stream)
    try:
        for k in range(inner):
            launch(k)
    finally:
        graph = cm.end_capture(stream)
    with graph:
        return gpu_us(stream, lambda: graph.launch(stream), batches=reps, warmup=warmup).us / inner


def _fill_random(stream: int, ptr: int, nbytes: int, rng: np.random.Generator, chunk: int = 64 << 20) -> None:
    """Fill ``nbytes`` at ``ptr`` with bf16 N(0, 1/128) data (never time on zeros): one random chunk,
    copied around."""
    n = min(chunk, nbytes) // 2
    host = (rng.standard_normal(n, dtype=np.float32) / math.sqrt(128)).astype(ml_dtypes.bfloat16)
    src = cm.DeviceBuffer(host.nbytes)
    cm.copy_h_to_d_async(src, host, host.nbytes, stream)
    for off in range(0, nbytes, host.nbytes):
        cm.copy_d_to_d_async(ptr + off, src, min(host.nbytes, nbytes - off), stream)
    cm.stream_sync(stream)
    src.close()


def _torch_scorer(pred: Predictor, stream: int) -> tuple[Any, Any] | tuple[None, str]:
    """(torch, score function) for the eager baseline, or (None, why not)."""
    try:
        import torch
    except ImportError:
        return None, "torch is not installed"
    if not torch.cuda.is_available():
        return None, "torch sees no GPU"
    d = pred.dims

    class _Raw:   # zero-copy view of device memory (as int16: the CAI protocol has no bf16)
        def __init__(self, ptr: int, count: int) -> None:
            self.__cuda_array_interface__ = {"shape": (count,), "typestr": "<i2", "data": (ptr, False),
                                             "version": 3, "strides": None, "stream": None}

    def score(q_ptr: int, k_ptr: int, n: int) -> Any:
        q = torch.as_tensor(_Raw(q_ptr, d.num_q_heads * d.r), device="cuda").view(torch.bfloat16)
        k = torch.as_tensor(_Raw(k_ptr, n * d.per_layer_block_floats()), device="cuda").view(torch.bfloat16)
        q = q.view(d.num_kv_heads, d.gqa_ratio(), d.r)
        k = k.view(n, d.num_kv_heads, d.block_size, d.r)
        return torch.einsum("hgr,nhtr->nhgt", q, k).amax(dim=(1, 2, 3))

    return torch, score


def run(args: argparse.Namespace) -> list[dict]:
    """Run the benchmark described in the module docstring; returns one dict per table row."""
    smoke = args.smoke
    tokens = sorted(args.tokens or ((256, 1024) if smoke else TOKENS))
    layers = 2 if smoke else args.layers
    reps, warmup = (3, 1) if smoke else (args.reps, args.warmup)
    dims = PredictorDims(num_layers=layers, max_blocks=max(tokens) // LLAMA["block_size"], **LLAMA)
    rng = np.random.default_rng(0)
    rows: list[dict] = []
    ctx = cm.CudaCtx(0)
    stream = ctx.stream
    pred = Predictor(ctx, dims, 0xCAFE_F00D)
    slot = dims.slot_bytes()
    try:
        _fill_random(stream, pred.a_g_dev_ptr, dims.a_g_bytes(), rng)
        q = cm.DeviceBuffer(2 * dims.num_q_heads * dims.head_dim)
        _fill_random(stream, q.ptr, q.bytes, rng)
        q_proj = cm.DeviceBuffer(2 * dims.num_q_heads * dims.r)
        pred.project_q(ctx, q, q_proj)
        torch, torch_score = (None, "--smoke") if smoke or args.no_torch else _torch_scorer(pred, stream)
        if torch is None:
            print(f"note: PyTorch eager baseline skipped ({torch_score})")

        for t in tokens:
            n = t // dims.block_size
            nbytes = n * slot
            per_layer = dims.max_blocks // n
            windows = [(layer, w * n) for w in range(per_layer) for layer in range(layers)]
            windows = windows[:max(2, ceil_div(ROTATE_BYTES, nbytes))]
            inner = max(1, min(64, SAMPLE_BYTES // nbytes))
            scores = cm.DeviceBuffer(4 * n)

            def score(i: int) -> None:
                layer, first = windows[i % len(windows)]
                pred.score_layer_on_stream(stream, q_proj, layer, first, n, scores)

            us = _graph_us(stream, score, reps, warmup, inner)
            copy_windows = len(windows)
            dst = cm.DeviceBuffer(copy_windows * nbytes)

            def copy(i: int) -> None:
                layer, first = windows[i % len(windows)]
                cm.copy_d_to_d_async(dst.ptr + (i % copy_windows) * nbytes, pred.slot_ptr(layer, first), nbytes,
                                     stream)

            # The best of graph-replayed copies (no host cost; small sizes) and stream-ordered ones (a graph's
            # memcpy node may run on a copy engine, slower than the driver's copy kernel for large sizes).
            copy_us = min(_graph_us(stream, copy, reps, warmup, inner), _eager_us(stream, copy, reps, warmup, inner))
            dst.close()
            moved = nbytes + 4 * n + 2 * dims.num_q_heads * dims.r
            row = {"bench": "score_blocks", "tokens": t, "blocks": n, "MiB": nbytes / 2**20, "us": us,
                   "GB/s": moved / us / 1e3, "copy GB/s": 2 * nbytes / copy_us / 1e3}
            row["of copy"] = row["GB/s"] / row["copy GB/s"]
            if torch is not None:
                pred.score_layer(ctx, q_proj, *windows[0], n, scores)
                ours = np.empty(n, np.float32)
                cm.copy_d_to_h_async(ours, scores, 4 * n, stream)
                cm.stream_sync(stream)   # torch runs on its own stream: our writes must be done
                theirs = torch_score(q_proj.ptr, pred.slot_ptr(*windows[0]), n).float().cpu().numpy()
                row["torch max rel diff"] = float(np.abs(ours - theirs).max() / np.abs(ours).max())
                torch_stream = torch.cuda.current_stream().cuda_stream

                def eager(i: int) -> None:
                    layer, first = windows[i % len(windows)]
                    torch_score(q_proj.ptr, pred.slot_ptr(layer, first), n)

                row["torch us"] = _eager_us(torch_stream, eager, reps, warmup, inner)
                row["x torch"] = row["torch us"] / us
            scores.close()
            rows.append(row)
            print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()})

        rows += _projections(ctx, pred, q, q_proj, rng, reps, warmup, smoke)
        rows.append(_decode_step(ctx, pred, q, tokens[0], reps, warmup))
        print(rows[-1])
    finally:
        pred.close()
        ctx.close()
    print(table(rows))
    return rows


def _projections(ctx: cm.CudaCtx, pred: Predictor, q: cm.DeviceBuffer, q_proj: cm.DeviceBuffer,
                 rng: np.random.Generator, reps: int, warmup: int, smoke: bool) -> list[dict]:
    stream, d = ctx.stream, pred.dims
    page_bytes = 2 * d.block_size * d.num_kv_heads * d.head_dim
    pages = cm.DeviceBuffer(64 * page_bytes)
    _fill_random(stream, pages.ptr, pages.bytes, rng)
    count = 64 if smoke else 4096

    def kv(i: int) -> None:
        pred.project_kv_block_on_stream(stream, i % d.num_layers, (i // d.num_layers) % d.max_blocks,
                                        pages.ptr + (i % 64) * page_bytes)

    per_launch_us = _graph_us(stream, kv, reps, warmup, 64)
    loop = Case(rotating(kv), lambda: cm.stream_sync(stream))
    loop_us = host_us({"loop": loop}, batch=count, batches=1, warmup=0, timed_sync=True)["loop"].us
    pages.close()
    q_us = _graph_us(stream, lambda i: pred.project_q_on_stream(stream, q, q_proj), reps, warmup, 64)
    return [{"bench": "project_kv_block", "us": per_launch_us, "pages/s (device)": 1e6 / per_launch_us,
             "pages/s (python loop)": 1e6 / loop_us},
            {"bench": "project_q", "us": q_us}]


def _decode_step(ctx: cm.CudaCtx, pred: Predictor, q: cm.DeviceBuffer, tokens: int, reps: int,
                 warmup: int) -> dict:
    """One decode step over every layer (project_q + score_layer), eager vs one CUDA graph replay."""
    stream, d = ctx.stream, pred.dims
    n = tokens // d.block_size
    q_proj = [cm.DeviceBuffer(2 * d.num_q_heads * d.r) for _ in range(d.num_layers)]
    scores = [cm.DeviceBuffer(4 * n) for _ in range(d.num_layers)]

    def step() -> None:
        for layer in range(d.num_layers):
            pred.project_q_on_stream(stream, q, q_proj[layer])
            pred.score_layer_on_stream(stream, q_proj[layer], layer, 0, n, scores[layer])

    step()   # warm, then one capture; eager steps and replays are timed in interleaved batches
    cm.stream_sync(stream)
    cm.begin_capture(stream)
    step()
    graph = cm.end_capture(stream)
    sync = lambda: cm.stream_sync(stream)  # noqa: E731
    t = host_us({"eager": Case(step, sync), "graph": Case(lambda: graph.launch(stream), sync)}, batch=1,
                batches=reps, warmup=warmup, timed_sync=True)
    eager, replay = t["eager"].us, t["graph"].us
    graph.close()
    for buf in q_proj + scores:
        buf.close()
    return {"bench": f"decode step, {d.num_layers} layers", "tokens": tokens, "eager us": eager,
            "graph us": replay, "x eager": eager / replay}


TARGETS = ("targets: score_blocks >= 80 % of copy bandwidth and >= 5x torch eager at >= 128K tokens; "
           "graph replay of the decode step >= 3x eager at 4K")


def table(rows: list[dict]) -> str:
    """A compact markdown table of ``rows`` (one column per key seen, in first-seen order)."""
    keys: list[str] = []
    for row in rows:
        keys += [k for k in row if k not in keys]

    def cell(v: Any) -> str:
        if v is None:
            return ""
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}"
        return str(v)

    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(cell(row.get(k)) for k in keys) + " |" for row in rows]
    return "\n".join(lines) + "\n" + TARGETS


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="*", help=f"context lengths (default {' '.join(map(str, TOKENS))})")
    p.add_argument("--layers", type=int, default=32, help="model layers (default 32)")
    p.add_argument("--reps", type=int, default=50, help="timed samples per measurement (median)")
    p.add_argument("--warmup", type=int, default=5, help="untimed launches first")
    p.add_argument("--no-torch", action="store_true", help="skip the PyTorch eager baseline")
    p.add_argument("--smoke", action="store_true", help="tiny sizes, no torch (emulator import check)")
    args = p.parse_args(argv)
    for t in args.tokens or ():
        if t <= 0 or t % LLAMA["block_size"]:
            p.error(f"--tokens {t}: must be a positive multiple of block_size ({LLAMA['block_size']})")
    return args


def main(argv: list[str] | None = None) -> int:
    run(parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
