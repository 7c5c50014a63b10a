"""Benchmark: the sparse swap step on the device (:class:`~hss.swap.device_step.DeviceSparseStep`, docs/design.md §17.8)
next to the host sparse step and the exact step of the same :class:`~hss.swap.HighSpeedSwap`.

    python -m hss.bench.sparse_step [--tokens 32768] [--batches 1,8,32] [--budget 256] [--iters 20]
    python -m hss.bench.sparse_step --smoke      tiny sizes (runs on the CPU emulator in CI)

One layer: 32 q / 8 kv heads, head_dim 128, block_size 16, each sequence ``--tokens`` long (complete pages) in a
HostStore (pinned host memory). Rows, all in one run:

* pinned H2D bandwidth (the floor of a step's reads);
* the exact HostStore step (``attend_layer`` over every page, 1/8 of them resident) and the host sparse step
  (``attend_layer(..., budget_pages=, keep_first=, keep_recent=)``), batch 1, host wall time per step, with the
  same query every step and a new one every step;
* the device step at each batch R (each sequence its own pages and query, so its own selection): GPU time per
  step eager (events around a batch of steps) and replayed from one CUDA graph, with the same queries every step
  (every page a hit once settled) and new queries every step (a device copy of the next queries from a bank
  before each step, in every variant alike); the host µs to queue one eager step; pages read per step and the
  floor (bytes read / pinned H2D bandwidth).

Targets (printed): batch 1 same query <= 40 µs of GPU time; batch 1 new query <= 1.2x its floor; host <= 15 µs per
eager layer step; batch 32 <= 8x batch 1.
"""
from __future__ import annotations

import argparse
import os
import tempfile
from typing import Any

import numpy as np

SMOKE = dict(tokens=512, batches="1,2", budget=4, num_q_heads=4, num_kv_heads=2, head_dim=64, iters=2, warmup=1,
             distinct=2)
TARGET_SAME_US = 40.0
TARGET_FLOOR = 1.2
TARGET_HOST_US = 15.0
TARGET_BATCH = 8.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=32768, help="tokens per sequence")
    p.add_argument("--batches", default="1,8,32", help="comma-separated batch sizes of the device step")
    p.add_argument("--budget", type=int, default=256, help="budget_pages")
    p.add_argument("--keep-first", type=int, default=1)
    p.add_argument("--keep-recent", type=int, default=4)
    p.add_argument("--num-q-heads", type=int, default=32)
    p.add_argument("--num-kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--iters", type=int, default=20, help="steps per timed batch")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--distinct", type=int, default=8, help="sequences with distinct pages (larger batches reuse "
                                                            "them, each row with its own query and residency)")
    p.add_argument("--smoke", action="store_true", help="tiny sizes: a code-path check")
    args = p.parse_args(argv)
    if args.smoke:
        for key, value in SMOKE.items():
            setattr(args, key, value)
    return args


def run(args: argparse.Namespace) -> list[dict]:
    if args.smoke:
        os.environ.setdefault("HSS_DRIVER", "emulator")
    from hss import cuda_min as cm
    with cm.CudaCtx(0) as ctx, tempfile.TemporaryDirectory(prefix="hss-sparse-") as tmp:
        return _rows(args, ctx, tmp)


def _bf16(rng: np.random.Generator, shape: tuple[int, ...], std: float) -> np.ndarray:
    import ml_dtypes
    x = (rng.standard_normal(shape, dtype=np.float32) * std).astype(ml_dtypes.bfloat16)
    x[x == 0] = ml_dtypes.bfloat16(std)
    return x


def _rows(args: argparse.Namespace, ctx: Any, tmp: str) -> list[dict]:
    from hss import cuda_min as cm
    from hss.bench._timer import gpu_us, host_us
    from hss.swap import HighSpeedSwap, HighSpeedSwapConfig, ModelDims
    from hss.swap.device_step import DeviceSparseStep

    nq, nkv, hd, bs = args.num_q_heads, args.num_kv_heads, args.head_dim, args.block_size
    pages = args.tokens // bs
    batches = sorted({int(b) for b in args.batches.split(",")})
    distinct = max(1, min(args.distinct, max(batches)))
    s = ctx.stream
    rng = np.random.default_rng(1)
    model = ModelDims(1, distinct * pages, nq, nkv, hd, bs)
    resident = max(pages // 8, 1)
    tile = max(min(128, pages // 4), 1)
    cfg = HighSpeedSwapConfig(tmp, 1 << 40, resident + 2 * tile, 32, 4, False, 0x5EED, store="host",
                              stream_tile_blocks=tile)
    owned: list[Any] = []
    keep = lambda obj: owned.append(obj) or obj   # noqa: E731
    rows: list[dict] = []
    label = f"{args.tokens // 1024}K" if args.tokens >= 1024 else str(args.tokens)

    def row(variant: str, batch: int, us: float, **extra: Any) -> None:
        rows.append(dict(tokens=label, batch=batch, variant=variant, us=us, **extra))

    try:
        h = keep(HighSpeedSwap(ctx, cfg, model))
        # the pages: `distinct` sequences of `pages` pages each (K scaled as a real model's, V unit)
        k_seq = _bf16(rng, (pages, bs, nkv, hd), 1.0 / np.sqrt(hd))
        v_seq = _bf16(rng, (pages, bs, nkv, hd), 1.0)
        k_dev = keep(cm.DeviceBuffer(k_seq.nbytes))
        page_bytes = k_seq[0].nbytes
        for d in range(distinct):
            k = k_seq if d == 0 else _bf16(rng, k_seq.shape, 1.0 / np.sqrt(hd))
            v = v_seq if d == 0 else _bf16(rng, v_seq.shape, 1.0)
            cm.copy_h_to_d_async(k_dev, k, k.nbytes, s)
            for p in range(pages):
                h.offload_block_on_stream(s, 0, d * pages + p, k_dev.ptr + p * page_bytes, k[p], v[p])
            cm.stream_sync(s)
        # pinned H2D bandwidth: the floor of the reads
        h2d = min(64 << 20, distinct * pages * h.layout.block_bytes)
        src, dst = keep(cm.PinnedBuffer(h2d)), keep(cm.DeviceBuffer(h2d))
        us = gpu_us(s, lambda: cm.copy_h_to_d_async(dst, src, h2d, s), batch=args.iters, warmup=args.warmup).us
        bw = h2d / us / 1e3   # GB/s
        row(f"pinned H2D ({h2d >> 20} MiB)", 1, us, note=f"{bw:.1f} GB/s, the floor's bandwidth")
        # the host steps, batch 1: exact, and sparse with the same / a new query each step
        out1 = keep(cm.DeviceBuffer(2 * nq * hd))
        bank = _bf16(rng, (args.iters + args.warmup + 1, max(batches), nq, hd), 1.0)
        bank_dev = keep(cm.DeviceBuffer(bank.nbytes))
        cm.copy_h_to_d_async(bank_dev, bank, bank.nbytes, s)
        qbytes = 2 * nq * hd
        ids = list(range(pages))
        sparse = dict(budget_pages=args.budget, keep_first=args.keep_first, keep_recent=args.keep_recent)
        counter = iter(range(1 << 30))

        def host_step(new: bool, **kw: Any) -> None:
            q = bank_dev.ptr + (next(counter) % bank.shape[0] if new else 0) * max(batches) * qbytes
            h.attend_layer_on_stream(s, 0, ids, q, out1, **kw)
        for name, fn in (("exact host step", lambda: host_step(False)),
                         ("host sparse step, same query", lambda: host_step(False, **sparse)),
                         ("host sparse step, new query", lambda: host_step(True, **sparse))):
            t = host_us({name: fn}, batch=args.iters, batches=3, warmup=args.warmup, timed_sync=True,
                        ).get(name)
            cm.stream_sync(s)
            row(name, 1, t.us, note="host wall time per step (synchronised)")
        exact_us = rows[-3]["us"]
        # the device step at each batch
        per_batch: dict[int, dict[str, float]] = {}
        for R in batches:
            per_batch[R] = _device_rows(args, ctx, h, DeviceSparseStep, R, distinct, pages, bank_dev, bank.shape[0],
                                        qbytes * max(batches), bw, row, keep)
        rows.append(dict(tokens=label, batch=1, variant="(exact host step, for the ratios)", us=exact_us, note=""))
        _targets(rows, per_batch, label)
    finally:
        cm.stream_sync(s)
        for obj in reversed(owned):
            obj.close()
    return rows


def _device_rows(args: argparse.Namespace, ctx: Any, h: Any, cls: Any, R: int, distinct: int, pages: int,
                 bank_dev: Any, bank_n: int, bank_stride: int, bw: float, row: Any, keep: Any) -> dict[str, float]:
    from hss import cuda_min as cm
    from hss.bench._timer import gpu_us, host_us

    s = ctx.stream
    m = h.model
    step = keep(cls(h, s, max_seqs=R, budget_pages=args.budget, keep_first=args.keep_first,
                    keep_recent=args.keep_recent, max_pages=pages))
    tables = np.stack([np.arange(pages, dtype=np.int32) + (r % distinct) * pages for r in range(R)])
    tdev = keep(cm.DeviceBuffer(tables.nbytes))
    cdev = keep(cm.DeviceBuffer(4 * R))
    cm.copy_h_to_d_async(tdev, tables, tables.nbytes, s)
    cm.copy_h_to_d_async(cdev, np.full(R, pages, np.int32), 4 * R, s)
    qrow = 2 * R * m.num_q_heads * m.head_dim
    q = keep(cm.DeviceBuffer(qrow))
    out = keep(cm.DeviceBuffer(qrow))
    counter = iter(range(1 << 30))

    def new_query() -> None:
        cm.copy_d_to_d_async(q, bank_dev.ptr + (next(counter) % bank_n) * bank_stride, qrow, s)

    def same_query() -> None:
        cm.copy_d_to_d_async(q, bank_dev.ptr, qrow, s)

    def eager() -> None:
        step.begin_step(s, tdev, cdev, R)
        step.attend_layer(s, 0, q, out)

    cm.begin_capture(s)
    eager()
    graph = keep(cm.end_capture(s))
    results: dict[str, float] = {}
    for kind, prep in (("same query", same_query), ("new query", new_query)):
        for how, fn in (("eager", eager), ("graph", lambda: graph.launch(s))):
            step.reset(s)
            body = lambda: (prep(), fn())   # noqa: E731
            for _ in range(max(args.warmup, 1)):   # the first step reads every page of S: settled after it
                body()
            before = step.counters(s)
            t = gpu_us(s, body, batch=args.iters, batches=3)
            after = step.counters(s)
            n_steps = args.iters * 3
            read = int((after.bytes_read - before.bytes_read).sum()) / n_steps
            misses = int((after.misses - before.misses).sum()) / n_steps
            floor = read / bw / 1e3 if read else 0.0
            ratio = t.us / floor if floor else float("nan")
            results[f"{kind} {how}"] = t.us
            results[f"{kind} {how} floor"] = ratio
            row(f"device step, {kind}, {how}", R, t.us, pages_read=round(misses, 1),
                note=f"GPU time per step; {read / 2**20:.2f} MiB read a step" +
                     (f", {ratio:.2f}x its floor ({floor:.1f} us)" if floor else ""))
    cm.stream_sync(s)
    step.begin_step(s, tdev, cdev, R)
    t = host_us({"begin": lambda: step.begin_step(s, tdev, cdev, R), "layer": lambda: step.attend_layer(s, 0, q, out)},
                batch=args.iters, batches=3, warmup=args.warmup)
    cm.stream_sync(s)
    results["host"] = t["layer"].us
    row("device step, host to queue attend_layer", R, t["layer"].us, note="host µs per layer step (5 launches)")
    row("device step, host to queue begin_step", R, t["begin"].us, note="host µs per token (a memset, a launch)")
    return results


def _targets(rows: list[dict], per: dict[int, dict[str, float]], label: str) -> None:
    def verdict(ok: bool) -> str:
        return "met" if ok else "not met"
    if 1 in per:
        b1 = per[1]
        same = min(b1["same query eager"], b1["same query graph"])
        rows.append(dict(tokens=label, batch=1, variant="target: same query <= 40 us", us=same,
                         note=verdict(same <= TARGET_SAME_US)))
        ratio = b1["new query graph floor"]
        rows.append(dict(tokens=label, batch=1, variant="target: new query <= 1.2x floor", us=b1["new query graph"],
                         note=f"{ratio:.2f}x: {verdict(ratio <= TARGET_FLOOR)}"))
        rows.append(dict(tokens=label, batch=1, variant="target: host <= 15 us a layer step", us=b1["host"],
                         note=verdict(b1["host"] <= TARGET_HOST_US)))
        if 32 in per:
            r = per[32]["new query graph"] / b1["new query graph"]
            rows.append(dict(tokens=label, batch=32, variant="target: batch 32 <= 8x batch 1 (new query, graph)",
                             us=per[32]["new query graph"], note=f"{r:.2f}x: {verdict(r <= TARGET_BATCH)}"))


def table(rows: list[dict]) -> str:
    lines = ["| tokens | batch | variant | µs | pages read | note |", "|---|---:|---|---:|---:|---|"]
    for r in rows:
        lines.append(f"| {r['tokens']} | {r['batch']} | {r['variant']} | {r['us']:.1f} | {r.get('pages_read', '')} | "
                     f"{r.get('note', '')} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    print(table(run(args)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
