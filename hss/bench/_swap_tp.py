"""``python -m hss.bench swap --tp N``: a HighSpeedSwap decode step of one layer split over N devices by kv heads
(:func:`hss.swap.shard_kv_heads`; one swap per device, each streaming its own heads from its own HostStore, the
ranks stepping at once from one thread each) against one device doing all heads, in the same run.

Per context length: host wall time per step (attend_layer + stream sync on every rank, after the resident sets
settled; median of ``--iters`` steps), the ratio TP / one device (target <= 0.6 at 2 ranks), and whether every rank's
output rows equal the one-device rows (they do when the tiles match: with every page streamed; with a resident set
each rank's predictor picks its own, so the rows are exact but may round differently).
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
from typing import Any

import numpy as np

from hss._util import ceil_div

TARGET_TP = 0.6   # a 2-rank step / the one-device step


class _Rank:
    """One device's HighSpeedSwap over some heads of the layer, every page offloaded, a query and an output."""

    def __init__(self, args: argparse.Namespace, ordinal: int, model: Any, k: np.ndarray, v: np.ndarray,
                 q: np.ndarray) -> None:
        from hss import cuda_min as cm
        from hss.swap import HighSpeedSwap, HighSpeedSwapConfig
        self.cm, self.ctx = cm, cm.CudaCtx(ordinal)
        pages = k.shape[0]
        tile = max(1, min(args.tile, pages // 2))
        resident = max(0, int(round(args.resident * pages)))
        cfg = HighSpeedSwapConfig(tempfile.gettempdir(), 1 << 62, resident + 2 * tile, 32, 8, False, 0xCAFE_F00D,
                                  store="host", stream_tile_blocks=tile)
        self.h = HighSpeedSwap(self.ctx, cfg, model)
        self.bufs = [self._up(x) for x in (k, q)]
        self.out = cm.DeviceBuffer(q.nbytes, self.ctx)
        page = k[0].nbytes
        for b in range(pages):
            self.h.offload_block(self.ctx, 0, b, self.bufs[0].ptr + b * page, k[b], v[b])
        self.ids = np.arange(pages, dtype=np.int64)
        self.shape = q.shape

    def _up(self, arr: np.ndarray) -> Any:
        buf = self.cm.DeviceBuffer(arr.nbytes, self.ctx)
        self.cm.copy_h_to_d_async(buf, np.ascontiguousarray(arr), arr.nbytes, self.ctx.stream)
        return buf

    def step(self) -> None:
        self.h.attend_layer(self.ctx, 0, self.ids, self.bufs[1], self.out)
        self.cm.stream_sync(self.ctx.stream)

    def output(self) -> np.ndarray:
        import ml_dtypes
        got = np.empty(self.shape, dtype=ml_dtypes.bfloat16)
        self.cm.copy_d_to_h_async(got, self.out, got.nbytes, self.ctx.stream)
        self.cm.stream_sync(self.ctx.stream)
        return got

    def close(self) -> None:
        for b in (*self.bufs, self.out, self.h, self.ctx):
            b.close()


def _timed_steps(ranks: list[_Rank], iters: int, warmup: int) -> float:
    """Median wall µs of a step of every rank at once (one thread per rank, a barrier before and after)."""
    gate = threading.Barrier(len(ranks) + 1)
    errors: list[BaseException] = []
    total = warmup + iters

    def work(r: _Rank) -> None:
        for _ in range(total):
            gate.wait()
            try:
                r.step()
            except BaseException as exc:   # reported by the main thread
                errors.append(exc)
            gate.wait()

    threads = [threading.Thread(target=work, args=(r,), daemon=True) for r in ranks]
    for t in threads:
        t.start()
    times = []
    for i in range(total):
        t0 = time.perf_counter()
        gate.wait()
        gate.wait()
        if i >= warmup:
            times.append((time.perf_counter() - t0) * 1e6)
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return statistics.median(times)


def tp_rows(args: argparse.Namespace) -> list[dict]:
    """The one-device step and the ``args.tp``-rank step at every context length."""
    import ml_dtypes

    from hss import cuda_min as cm
    from hss.swap import ModelDims, shard_kv_heads
    n, have = args.tp, cm.device_count()
    nq, nkv, hd, bs = args.num_q_heads, args.num_kv_heads, args.head_dim, args.block_size
    rows: list[dict] = []
    for tokens in sorted({int(t) for t in args.tokens.split(",")}):
        row = dict(tokens=tokens, tp=n, variant=f"HighSpeedSwap step, kv heads over {n} devices vs 1")
        if have < n:
            rows.append(dict(row, note=f"skipped: the driver offers {have} device(s), --tp {n} needs {n}"))
            continue
        pages = ceil_div(tokens, bs)
        rng = np.random.default_rng(tokens)
        k = (rng.standard_normal((pages, bs, nkv, hd), dtype=np.float32) / np.sqrt(hd)).astype(ml_dtypes.bfloat16)
        v = rng.standard_normal((pages, bs, nkv, hd), dtype=np.float32).astype(ml_dtypes.bfloat16)
        q = rng.standard_normal((nq, hd), dtype=np.float32).astype(ml_dtypes.bfloat16)
        model = ModelDims(1, pages, nq, nkv, hd, bs)
        one = _Rank(args, 0, model, k, v, q)
        try:
            one_us = _timed_steps([one], args.iters, max(args.warmup, 2))
            whole = one.output()
        finally:
            one.close()
        shards = shard_kv_heads(model, n)
        ranks = [_Rank(args, s.rank, s.model, np.ascontiguousarray(k[:, :, s.kv_heads.start:s.kv_heads.stop]),
                       np.ascontiguousarray(v[:, :, s.kv_heads.start:s.kv_heads.stop]), s.take_q(q))
                 for s in shards]
        try:
            tp_us = _timed_steps(ranks, args.iters, max(args.warmup, 2))
            same = all(np.array_equal(r.output().view(np.uint16), whole[s.q_heads.start:s.q_heads.stop].view(np.uint16))
                       for r, s in zip(ranks, shards))
        finally:
            for r in ranks:
                r.close()
        ratio = tp_us / one_us
        verdict = "met" if ratio <= TARGET_TP else "not met"
        rows.append(dict(row, us=tp_us, one_us=one_us, ratio=ratio,
                         note=f"1 device {one_us:.0f} us, {n} devices {tp_us:.0f} us: {ratio:.2f}x (target <= "
                              f"{TARGET_TP}: {verdict}); rows {'bitwise equal' if same else 'exact, rounded apart'}"))
    return rows


def table(rows: list[dict]) -> str:
    out = ["| tokens | variant | µs | note |", "|---:|---|---:|---|"]
    for r in rows:
        us = f"{r['us']:.0f}" if "us" in r else "—"
        out.append(f"| {r['tokens']} | {r['variant']} | {us} | {r['note']} |")
    return "\n".join(out)
