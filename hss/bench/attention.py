"""Benchmark: tiled decode attention over KV pages in HBM, against a device copy of the same bytes and PyTorch SDPA.

    python -m hss.bench.attention [--shapes 32/8/128,24/2/256] [--contexts 8192,32768,131072,524288]
                                  [--batches 8x8192,32x4096,64x2048,8x32768] [--tiles 1,8,64] [--iters 20]
    python -m hss.bench.attention --smoke      tiny sizes, no PyTorch (runs on the CPU emulator in CI)

For each shape (q heads / kv heads / head_dim, bf16, pages of 16) and each case (batch 1 at every context, then
every ``BxT`` batch): the pages of every sequence shuffled in one NHD pool; a step is ``begin_tiles`` + one
``TileStep.tile`` (the last tile writing the output). Columns:

* ``hss µs``: GPU time per step (CUDA events around ``--iters`` back-to-back steps queued behind a large memset, so
  the host's issue time is hidden), and its effective bandwidth (K + V bytes / time);
* ``copy µs``: a device-to-device copy of the same K + V bytes (``cuMemcpyDtoDAsync``, the same way), and its
  bandwidth counted as read + write; ``× copy`` = hss's read bandwidth / the copy's read + write bandwidth;
* ``SDPA µs``: ``torch.nn.functional.scaled_dot_product_attention(enable_gqa=True)`` on contiguous
  [B, heads, T, hd] K/V, timed the same way, with the backend PyTorch picks for it (``torch._fused_sdp_choice``);
* ``host µs``: host time per step (median over batches of steps, no sync inside a batch);
* ``max |hss - SDPA|`` over the outputs.
Then the 1-, 8- and 64-tile splits of the 32K batch-1 case of each shape (GPU and host time per step), each split
also with ``overlap_tiles=True`` (the step's later tiles launched programmatically: each streams while the tile
before it folds; its output compared bitwise with the plain launches'; ``--no-overlap`` skips it, and devices
older than compute capability 9.0 do).
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import numpy as np

from hss._util import ceil_div

SMOKE = dict(shapes="4/2/64", contexts="64", batches="2x32", tiles="1,2", iters=2, warmup=1, split_tokens=64)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="32/8/128,24/2/256", help="q heads/kv heads/head_dim, comma-separated")
    p.add_argument("--contexts", default="8192,32768,131072,524288", help="batch-1 context lengths")
    p.add_argument("--batches", default="8x8192,32x4096,64x2048,8x32768", help="batched cases BxT")
    p.add_argument("--tiles", default="1,8,64", help="tile splits of the --split-tokens batch-1 case")
    p.add_argument("--split-tokens", type=int, default=32768)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--iters", type=int, default=20, help="steps per timed batch")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--no-torch", action="store_true", help="skip the PyTorch SDPA comparison")
    p.add_argument("--no-overlap", action="store_true", help="skip the overlapped (overlap_tiles) tile splits")
    p.add_argument("--smoke", action="store_true", help="tiny sizes and no PyTorch: an import/launch check")
    args = p.parse_args(argv)
    if args.smoke:
        for key, value in SMOKE.items():
            setattr(args, key, value)
        args.no_torch = True
    return args


def _shapes(text: str) -> list[tuple[int, int, int]]:
    return [tuple(int(x) for x in s.split("/")) for s in text.split(",") if s]   # type: ignore[misc]


def _cases(args: argparse.Namespace) -> list[tuple[int, int]]:
    one = [(1, int(t)) for t in args.contexts.split(",") if t]
    many = [tuple(int(x) for x in c.split("x")) for c in args.batches.split(",") if c]
    return one + many   # type: ignore[return-value]


class _Setup:
    """One (shape, batch, tokens) case on the device: pool, q, page tables, a TiledAttention, the output."""

    def __init__(self, ctx: Any, stream: int, shape: tuple[int, int, int], batch: int, tokens: int, bs: int,
                 tiles: int, rng: np.random.Generator) -> None:
        import ml_dtypes

        from hss import cuda_min as cm
        from hss.attention import TiledAttention, TiledAttentionDims
        bf16 = ml_dtypes.bfloat16
        nq, nkv, hd = shape
        self.cm, self.shape, self.batch, self.stream, self.bs = cm, shape, batch, stream, bs
        self.pages = ceil_div(tokens, bs)
        self.tokens = self.pages * bs
        total = batch * self.pages
        self.owned: list[Any] = []
        self.k = (rng.standard_normal((total, bs, nkv, hd), dtype=np.float32) / np.sqrt(hd)).astype(bf16)
        self.v = rng.standard_normal((total, bs, nkv, hd), dtype=np.float32).astype(bf16)
        self.q = rng.standard_normal((batch, nq, hd), dtype=np.float32).astype(bf16)
        self.order = rng.permutation(total).astype(np.int32).reshape(batch, self.pages)   # logical -> pool page
        self.kv_bytes = 2 * batch * self.tokens * nkv * hd * 2
        self.k_dev, self.v_dev, self.q_dev = self.dev(self.k), self.dev(self.v), self.dev(self.q)
        per = ceil_div(self.pages, tiles)
        self.ta = TiledAttention(ctx, TiledAttentionDims(batch, nq, nkv, hd, bs, per))
        self.owned.append(self.ta)
        self.tables = []
        for t in range(0, self.pages, per):
            ids = self.order[:, t:t + per]
            self.tables.append((self.dev(np.ascontiguousarray(np.pad(ids, ((0, 0), (0, per - ids.shape[1]))))),
                                self.dev(np.full(batch, ids.shape[1], np.int32))))
        self.out = self.dev(np.zeros((batch, nq, hd), dtype=bf16))
        self.strides = self.ta.paged_strides()

    def dev(self, arr: np.ndarray) -> Any:
        buf = self.cm.DeviceBuffer(max(arr.nbytes, 1))
        self.owned.append(buf)
        self.cm.copy_h_to_d_async(buf, np.ascontiguousarray(arr), arr.nbytes, self.stream)
        return buf

    def step(self) -> None:
        st = self.ta.begin_tiles(self.stream, self.q_dev, self.k_dev, self.v_dev, self.batch, *self.strides)
        last = len(self.tables) - 1
        for i, (blocks, counts) in enumerate(self.tables):   # the last tile writes the output (no finalize)
            st.tile(blocks, counts, self.bs, output=self.out if i == last else None)

    def output(self) -> np.ndarray:
        import ml_dtypes
        got = np.empty((self.batch, self.shape[0], self.shape[2]), dtype=ml_dtypes.bfloat16)
        self.cm.copy_d_to_h_async(got, self.out, got.nbytes, self.stream)
        self.cm.stream_sync(self.stream)
        return got

    def close(self) -> None:
        for obj in reversed(self.owned):
            obj.close()


def _gpu(stream: int, fn: Any, args: argparse.Namespace, flush: Any) -> float:
    from hss.bench._timer import gpu_us
    return gpu_us(stream, fn, batch=args.iters, batches=3, warmup=args.warmup, prepare=flush).us


def _host(fn: Any, sync: Any, args: argparse.Namespace) -> float:
    from hss.bench._timer import Case, host_us
    return host_us({"step": Case(fn, sync)}, batch=args.iters, batches=5, warmup=args.warmup)["step"].us


def run(args: argparse.Namespace) -> list[dict]:
    """Every case of every shape, then the tile splits; one dict per row."""
    if args.smoke:
        os.environ.setdefault("HSS_DRIVER", "emulator")
    from hss import cuda_min as cm
    from hss.bench._timer import Flush

    ctx = cm.CudaCtx(0)
    stream = ctx.stream
    flush = Flush(stream, 4 << 20 if args.smoke else 256 << 20)
    rows: list[dict] = []
    rng = np.random.default_rng(0)
    try:
        for shape in _shapes(args.shapes):
            for batch, tokens in _cases(args):
                rows.append(_case(ctx, stream, shape, batch, tokens, 1, args, rng, flush, peers=True))
            for nt in sorted({int(t) for t in args.tiles.split(",") if t}):
                rows.append(_case(ctx, stream, shape, 1, args.split_tokens, nt, args, rng, flush, peers=False))
    finally:
        flush.close()
        ctx.close()
    return rows


def _case(ctx: Any, stream: int, shape: tuple[int, int, int], batch: int, tokens: int, tiles: int,
          args: argparse.Namespace, rng: np.random.Generator, flush: Any, peers: bool) -> dict:
    from hss import cuda_min as cm
    row: dict = dict(shape="/".join(map(str, shape)), batch=batch, tokens=tokens, tiles=tiles)
    try:
        c = _Setup(ctx, stream, shape, batch, tokens, args.block_size, tiles, rng)
    except Exception as exc:   # e.g. out of device memory: the row says why
        row["note"] = f"skipped: {type(exc).__name__}: {exc}"
        return row
    try:
        row["tiles"] = len(c.tables)
        row["hss_us"] = _gpu(stream, c.step, args, flush)
        row["hss_GBs"] = c.kv_bytes / row["hss_us"] / 1e3
        row["host_us"] = _host(c.step, lambda: cm.stream_sync(stream), args)
        got = c.output()
        if not peers:   # the tile splits: also as one CUDA graph (no host issue time), and overlapped
            row["graph_us"] = _graph_us(c, stream, args, flush)
        if not peers and len(c.tables) > 1 and not args.no_overlap and cm.compute_capability(ctx) >= (9, 0):
            from hss.attention import TiledAttention
            plain = c.ta
            c.ta = TiledAttention(ctx, plain.dims, overlap_tiles=True)
            c.owned.append(c.ta)
            try:
                row["overlap_us"] = _gpu(stream, c.step, args, flush)
                row["overlap_host_us"] = _host(c.step, lambda: cm.stream_sync(stream), args)
                row["overlap_bitwise"] = bool(np.array_equal(c.output().view(np.uint16), got.view(np.uint16)))
                row["overlap_graph_us"] = _graph_us(c, stream, args, flush)
                row["overlap_bitwise"] &= bool(np.array_equal(c.output().view(np.uint16), got.view(np.uint16)))
            finally:
                c.ta = plain
        if peers:
            dst = cm.DeviceBuffer(c.k.nbytes)
            try:
                def copy() -> None:
                    cm.copy_d_to_d_async(dst, c.k_dev, c.k.nbytes, stream)
                    cm.copy_d_to_d_async(dst, c.v_dev, c.v.nbytes, stream)
                row["copy_us"] = _gpu(stream, copy, args, flush)
            finally:
                dst.close()
            row["copy_GBs"] = 2 * c.kv_bytes / row["copy_us"] / 1e3
            row["x_copy"] = row["hss_GBs"] / row["copy_GBs"]
            if not args.no_torch:
                row.update(_sdpa(c, stream, got, args, flush))
    finally:
        c.close()
    return row


def _graph_us(c: _Setup, stream: int, args: argparse.Namespace, flush: Any) -> float:
    """GPU µs per step of the step captured once as a CUDA graph and replayed (the host's issue time out of it)."""
    from hss import cuda_min as cm
    cm.begin_capture(stream)
    try:
        c.step()
    finally:
        graph = cm.end_capture(stream)
    try:
        return _gpu(stream, lambda: graph.launch(stream), args, flush)
    finally:
        graph.close()


def _sdpa(c: _Setup, stream: int, got: np.ndarray, args: argparse.Namespace, flush: Any) -> dict:
    """PyTorch SDPA decode on the same data and stream (a note when torch is absent)."""
    try:
        import torch
        import torch.nn.functional as F
    except ImportError:
        return {"note": "torch SDPA skipped (PyTorch is not installed)"}
    nq, nkv, hd = c.shape
    bf = torch.bfloat16

    def tensor(a: np.ndarray) -> Any:
        return torch.from_numpy(np.ascontiguousarray(a).view(np.int16)).view(bf).cuda()

    # logical token order per sequence, [B, kv heads, tokens, hd] as SDPA wants it
    kt = tensor(c.k[c.order].reshape(c.batch, -1, nkv, hd).transpose(0, 2, 1, 3))
    vt = tensor(c.v[c.order].reshape(c.batch, -1, nkv, hd).transpose(0, 2, 1, 3))
    qt = tensor(c.q.reshape(c.batch, nq, 1, hd))
    torch.cuda.synchronize()
    out: dict = {}
    with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
        def sdpa() -> Any:
            return F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)
        res = sdpa()
        try:
            choice = torch._fused_sdp_choice(qt, kt, vt, enable_gqa=True)
            out["sdpa_backend"] = torch.nn.attention.SDPBackend(choice).name
        except Exception:   # a private API: absent or changed in this torch
            out["sdpa_backend"] = "?"
        out["sdpa_us"] = _gpu(stream, sdpa, args, flush)
        ref = res.float().reshape(c.batch, nq, hd).cpu().numpy()
    out["sdpa_GBs"] = c.kv_bytes / out["sdpa_us"] / 1e3
    out["max_diff"] = float(np.abs(ref - got.astype(np.float32)).max())
    return out


def _f(v: Any, fmt: str = ".1f") -> str:
    return "—" if v is None else format(v, fmt)


def table(rows: list[dict]) -> str:
    out = ["| shape | batch × tokens | hss µs | hss TB/s | × copy | copy µs | SDPA µs (backend) | SDPA / hss | "
           "host µs | max abs diff |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if "copy_us" not in r and "note" not in r:
            continue
        if "note" in r and "hss_us" not in r:
            out.append(f"| {r['shape']} | {r['batch']} × {r['tokens']} | {r['note']} | | | | | | | |")
            continue
        sd = f"{_f(r.get('sdpa_us'))} ({r.get('sdpa_backend', '—')})" if "sdpa_us" in r else "—"
        ratio = r["sdpa_us"] / r["hss_us"] if "sdpa_us" in r else None
        out.append(f"| {r['shape']} | {r['batch']} × {r['tokens']} | {_f(r['hss_us'])} | "
                   f"{_f(r['hss_GBs'] / 1e3, '.2f')} | {_f(r['x_copy'], '.2f')} | {_f(r['copy_us'])} | {sd} | "
                   f"{_f(ratio, '.2f')} | {_f(r['host_us'])} | {_f(r.get('max_diff'), '.1e')} |")
    out += ["", "Tile splits: GPU µs per step queued directly (host µs per step) and replayed as one CUDA graph; "
            "× 1 tile against the 1-tile row's same measure; overlapped: overlap_tiles=True, bits compared with the "
            "plain step.",
            "", "| shape | tokens | tiles | GPU µs | × 1 tile | host µs | graph µs | × 1 tile | overlapped µs | "
            "× 1 tile | host µs | overlapped graph µs | × 1 tile | bitwise |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    base: dict = {}
    for r in rows:
        if "copy_us" in r or "hss_us" not in r:
            continue
        one = base.setdefault(r["shape"], (r["hss_us"], r.get("graph_us")))
        ov, gr, og = r.get("overlap_us"), r.get("graph_us"), r.get("overlap_graph_us")
        out.append(f"| {r['shape']} | {r['tokens']} | {r['tiles']} | {_f(r['hss_us'])} | "
                   f"{_f(r['hss_us'] / one[0], '.2f')} | {_f(r['host_us'])} | {_f(gr)} | "
                   f"{_f(gr / one[1] if gr and one[1] else None, '.2f')} | {_f(ov)} | "
                   f"{_f(ov / one[0] if ov else None, '.2f')} | {_f(r.get('overlap_host_us'))} | {_f(og)} | "
                   f"{_f(og / one[1] if og and one[1] else None, '.2f')} | {r.get('overlap_bitwise', '—')} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rows = run(args)
    from hss.cuda_min import driver_status
    print(f"driver: {driver_status().message}")
    print(f"bf16, pages of {args.block_size}, shuffled NHD pool; GPU time per step over batches of {args.iters} steps")
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
