"""QSA prefill kernels: per-2048-row-slab times for 16K and 32K-token prefills, and where selective attention
crosses dense causal attention.

Per slab (the last slab of the prefill: rows at positions L-2048 .. L-1; n_heads 4 x 128 indexer, nq 24,
nkv 2, hd 256 attention, topk 512, ratio 4, block_size 16): qsa_qprep_rows, qsa_score_rows (scalar) and
qsa_score_rows_tc, with the tensor-core scorer's logical TFLOP/s (2 * rows * blocks * 4 * 128 / t) against a
large bf16 torch.matmul measured in the same run; qsa_prefill_attn (general) and qsa_prefill_attn_tc in µs/row
against dense causal torch SDPA (bottom-right causal mask, K/V repeated to 24 heads) over the same rows and
tokens. Then a sweep from 16K upward (to 256K, or further down when selective already wins at 16K) for the
crossing. CUDA events time every kernel (median of several runs after a warm-up). Data is random (never
zeros); lists are plausible top-k sets (a shared core of blocks in per-row order, 10 % row-specific, the row's
newest block). Targets: TC scorer >= 20 % of the measured bf16 rate; selective attention per row <= dense SDPA
per row at 32K. ``--smoke`` runs tiny sizes on any driver without torch: its numbers mean nothing.
"""
from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import ml_dtypes
import numpy as np

from hss import cuda_min as cm
from hss._util import ceil_div
from hss.bench._timer import gpu_us
from hss.cuda import ptx
from hss.decls import qsa_prefill as kq

BF16 = ml_dtypes.bfloat16
TC_SCORE_TARGET = 0.20   # logical TC scorer rate / measured bf16 matmul rate
SLAB = 2048


def _cfg(smoke: bool) -> dict[str, Any]:
    if smoke:
        return dict(contexts=(256,), sweep=(), rows=32, n_heads=4, hd=128, nq=4, nkv=2, hd_attn=64, topk=8,
                    ratio=4, bs=16, reps=1, warmup=0)
    return dict(contexts=(16384, 32768), sweep=(16384, 32768, 65536, 131072, 262144), rows=SLAB, n_heads=4,
                hd=128, nq=24, nkv=2, hd_attn=256, topk=512, ratio=4, bs=16, reps=10, warmup=2)


class _Dev:
    """Device arrays for one run: random data through torch when present (fast, on device), else numpy."""

    def __init__(self, torch: Any, rng: np.random.Generator, stream: int) -> None:
        self.torch, self.rng, self.stream, self.keep = torch, rng, stream, []

    def randn(self, shape: tuple[int, ...], std: float = 1.0, dtype: Any = BF16) -> int:
        if self.torch is not None:
            tdt = self.torch.bfloat16 if dtype is BF16 else self.torch.float32
            t = self.torch.randn(*shape, device="cuda", dtype=tdt) * std
            t = self.torch.where(t == 0, std, t)   # never zeros
            self.keep.append(t)
            return int(t.data_ptr())
        x = self.rng.standard_normal(shape) * std
        x[x == 0] = std
        return self.array(x.astype(dtype))

    def array(self, host: np.ndarray) -> int:
        buf = cm.DeviceBuffer(max(host.nbytes, 1))
        cm.copy_h_to_d_async(buf, np.ascontiguousarray(host), host.nbytes, self.stream)
        self.keep.append(buf)
        return buf.ptr

    def empty(self, nbytes: int) -> int:
        buf = cm.DeviceBuffer(max(nbytes, 1))
        cm.memset_d8_async(buf, 0xFF, buf.bytes, self.stream)
        self.keep.append(buf)
        return buf.ptr

    def ready(self) -> None:
        """Inputs made on torch's stream or uploaded on ours are complete before kernels on ours use them."""
        if self.torch is not None:
            self.torch.cuda.synchronize()
        cm.stream_sync(self.stream)

    def close(self) -> None:
        self.ready()
        for b in self.keep:
            if isinstance(b, cm.DeviceBuffer):
                b.close()
        self.keep.clear()


def _time_ms(fn: Callable[[], None], stream: int, reps: int, warmup: int, inner: int = 5) -> float:
    """Median ms of one ``fn``: ``inner`` back-to-back launches between two timing events on ``stream`` (so
    host launch gaps do not count), ``reps`` times after ``warmup`` calls."""
    inner = inner if reps > 1 else 1
    return gpu_us(stream, fn, batch=inner, batches=max(reps, 1), warmup=warmup, sync_each=True).us / 1e3


def _torch_time_ms(torch: Any, fn: Callable[[], Any], reps: int, warmup: int) -> float:
    """Median ms of one ``fn`` (torch work) on torch's current stream, ``reps`` times after ``warmup`` calls."""
    return gpu_us(torch.cuda.current_stream().cuda_stream, fn, batches=max(reps, 1), warmup=warmup,
                  sync_each=True).us / 1e3


def plausible_lists(rng: np.random.Generator, rows: int, first_pos: int, ratio: int, topk: int) -> np.ndarray:
    """[rows, topk] int32: distinct blocks < complete_r per row, in a per-row (score-like) order: a core shared
    by all rows, 10 % drawn per row from the other blocks, and the row's newest complete block."""
    comp0 = (first_pos + 1) // ratio
    base = rng.choice(comp0, size=topk, replace=False)
    pool = np.setdiff1d(np.arange(comp0), base)
    n_own = min(topk // 10, pool.size)
    out = np.empty((rows, topk), dtype=np.int64)
    for r in range(rows):
        row = rng.permutation(base)
        if n_own:
            row[rng.choice(topk, size=n_own, replace=False)] = rng.choice(pool, size=n_own, replace=False)
        newest = (first_pos + r + 1) // ratio - 1
        if newest not in row:
            row[rng.integers(topk)] = newest
        out[r] = row
    return out.astype(np.int32)


def _attn_setup(dev: _Dev, c: dict, L: int) -> tuple[list[int], int, int]:
    """Device inputs of one slab's attention at context L: (pointers q..lists, out pointer, first_pos)."""
    rows, nq, nkv, hd, bs, ratio, topk = c["rows"], c["nq"], c["nkv"], c["hd_attn"], c["bs"], c["ratio"], c["topk"]
    first_pos = L - rows
    pages = ceil_div(L, bs)
    q = dev.randn((rows, nq, hd))
    kc = dev.randn((pages, bs, nkv, hd))
    vc = dev.randn((pages, bs, nkv, hd))
    table = dev.array(dev.rng.permutation(pages).astype(np.int32))
    lists = dev.array(plausible_lists(dev.rng, rows, first_pos, ratio, topk))
    out = dev.empty(2 * rows * nq * hd)
    dev.ready()
    return [q, kc, vc, table, lists], out, first_pos


def _attn_ms(mod: Any, stream: int, c: dict, ptrs: list[int], out: int, first_pos: int, tc: bool) -> float:
    rows, nq, nkv, hd = c["rows"], c["nq"], c["nkv"], c["hd_attn"]
    decl = kq.QSA_PREFILL_ATTN_TC if tc else kq.QSA_PREFILL_ATTN
    geom = kq.prefill_attn_tc_geometry(rows, nkv) if tc else kq.prefill_attn_geometry(rows, nq, nkv, hd)
    func = mod.function(decl.name)
    pack = decl.pack(*ptrs, out, first_pos, c["topk"], c["ratio"], c["bs"], nq, nkv, hd, float(np.float32(hd ** -0.5)))
    return _time_ms(lambda: cm.launch_kernel(func, geom.grid, geom.block, geom.shared, stream, pack), stream,
                    c["reps"], c["warmup"])


def _sdpa_ms(torch: Any, c: dict, L: int) -> float:
    """Dense causal SDPA for the slab's rows (positions L-rows .. L-1) over all their causal keys."""
    ms = _sdpa_timed(torch, c, L)
    torch.cuda.empty_cache()   # the inputs are gone with _sdpa_timed's frame
    return ms


def _sdpa_timed(torch: Any, c: dict, L: int) -> float:
    import torch.nn.functional as F
    rows, nq, nkv, hd = c["rows"], c["nq"], c["nkv"], c["hd_attn"]
    q = torch.randn(1, nq, rows, hd, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, nkv, L, hd, device="cuda", dtype=torch.bfloat16).repeat_interleave(nq // nkv, dim=1)
    v = torch.randn(1, nkv, L, hd, device="cuda", dtype=torch.bfloat16).repeat_interleave(nq // nkv, dim=1)
    try:
        from torch.nn.attention.bias import causal_lower_right
        mask = causal_lower_right(rows, L)
    except ImportError:   # older torch: an explicit mask (a slower SDPA backend)
        mask = torch.ones(rows, L, device="cuda", dtype=torch.bool).tril(diagonal=L - rows)
    return _torch_time_ms(torch, lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask), c["reps"],
                          c["warmup"])


def _matmul_tflops(torch: Any, reps: int) -> float:
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    ms = _torch_time_ms(torch, lambda: a @ b, reps, 3)
    return 2 * n ** 3 / (ms * 1e-3) / 1e12


def _slab(mod: Any, stream: int, dev: _Dev, c: dict, L: int, torch: Any) -> dict[str, Any]:
    rows, n_heads, hd, ratio = c["rows"], c["n_heads"], c["hd"], c["ratio"]
    first_pos = L - rows
    reps, warmup = c["reps"], c["warmup"]
    # qprep_rows
    qkw = (n_heads + 1) * hd
    qk, w = dev.randn((rows, qkw)), dev.randn((hd,), 0.1)
    q_post = dev.empty(4 * rows * n_heads * hd)
    g = kq.qprep_rows_geometry(rows, n_heads, hd)
    f = mod.function(kq.QSA_QPREP_ROWS.name)
    p = kq.QSA_QPREP_ROWS.pack(qk, w, q_post, first_pos, qkw, n_heads, hd, hd // 2, 1e7, 1e-6)
    dev.ready()
    qprep = _time_ms(lambda: cm.launch_kernel(f, g.grid, g.block, g.shared, stream, p), stream, reps, warmup)
    # scores over every block the slab can see (q_post holds real qprep output)
    n_blocks = L // ratio
    keys = dev.randn((n_blocks, hd))
    scores = dev.empty(4 * rows * n_blocks)
    dev.ready()
    gs, gt = kq.score_rows_geometry(rows, n_blocks), kq.score_rows_tc_geometry(rows, n_blocks)
    fs, ft = mod.function(kq.QSA_SCORE_ROWS.name), mod.function(kq.QSA_SCORE_ROWS_TC.name)
    ps = kq.QSA_SCORE_ROWS.pack(q_post, keys, scores, first_pos, n_blocks, ratio, n_heads, hd, rows, n_blocks)
    pt = kq.QSA_SCORE_ROWS_TC.pack(q_post, keys, scores, first_pos, n_blocks, ratio, n_blocks, rows)
    scalar = _time_ms(lambda: cm.launch_kernel(fs, gs.grid, gs.block, gs.shared, stream, ps), stream, reps, warmup)
    tc = _time_ms(lambda: cm.launch_kernel(ft, gt.grid, gt.block, gt.shared, stream, pt), stream, reps, warmup)
    # attention
    ptrs, out, fp = _attn_setup(dev, c, L)
    gen = _attn_ms(mod, stream, c, ptrs, out, fp, tc=False)
    tca = _attn_ms(mod, stream, c, ptrs, out, fp, tc=True)
    sdpa = _sdpa_ms(torch, c, L) if torch is not None else None
    dev.close()
    return {"kind": "slab", "context": L, "rows": rows, "n_blocks": n_blocks, "qprep_us": qprep * 1e3,
            "score_scalar_us": scalar * 1e3, "score_tc_us": tc * 1e3,
            "score_tc_tflops": 2 * rows * n_blocks * kq.TC_HEADS * kq.TC_HD / (tc * 1e-3) / 1e12,
            "attn_general_us_per_row": gen * 1e3 / rows, "attn_tc_us_per_row": tca * 1e3 / rows,
            "sdpa_us_per_row": None if sdpa is None else sdpa * 1e3 / rows}


def _sweep(mod: Any, stream: int, dev: _Dev, c: dict, torch: Any) -> list[dict[str, Any]]:
    """Selective (TC) vs dense µs/row from 16K upward until selective wins (or 256K); when it already wins at
    16K, downward by halves until it loses (or 4K)."""
    def point(L: int) -> dict[str, Any]:
        ptrs, out, fp = _attn_setup(dev, c, L)
        sel = _attn_ms(mod, stream, c, ptrs, out, fp, tc=True) * 1e3 / c["rows"]
        dev.close()
        return {"kind": "sweep", "context": L, "attn_tc_us_per_row": sel,
                "sdpa_us_per_row": _sdpa_ms(torch, c, L) * 1e3 / c["rows"]}

    def wins(r: dict[str, Any]) -> bool:
        return r["attn_tc_us_per_row"] <= r["sdpa_us_per_row"]

    out = []
    for L in c["sweep"]:
        out.append(point(L))
        if wins(out[-1]):
            break
    if out and wins(out[0]):
        L = c["sweep"][0] // 2
        while L >= max(4096, 2 * c["rows"]):
            out.append(point(L))
            if not wins(out[-1]):
                break
            L //= 2
    return out


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    c = _cfg(bool(getattr(args, "smoke", False)))
    torch = None
    if not getattr(args, "smoke", False):
        import torch as _torch  # lazily: only the full run compares against torch
        torch = _torch
    ctx = cm.CudaCtx(0)
    stream = ctx.stream
    mod = ptx.load_module(kq.MODULE, ctx)
    dev = _Dev(torch, np.random.default_rng(0), stream)
    rows: list[dict[str, Any]] = []
    if torch is not None:
        rows.append({"kind": "matmul", "tflops": _matmul_tflops(torch, c["reps"])})
    for L in c["contexts"]:
        rows.append(_slab(mod, stream, dev, c, L, torch))
    if torch is not None:
        rows += _sweep(mod, stream, dev, c, torch)
    dev.close()
    mod.close()
    ctx.close()
    return rows


def _f(v: Any, fmt: str = "{:.1f}") -> str:
    return "—" if v is None else fmt.format(v)


def table(rows: list[dict[str, Any]]) -> str:
    mm = next((r["tflops"] for r in rows if r["kind"] == "matmul"), None)
    out = [f"bf16 torch.matmul 8192^3: {_f(mm)} TFLOP/s" if mm else "bf16 torch.matmul: not measured (smoke)", "",
           "| context | rows | qprep µs | score scalar µs | score TC µs | TC TFLOP/s (logical) | % of bf16 | "
           "attn general µs/row | attn TC µs/row | dense SDPA µs/row | TC / dense |",
           "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in (r for r in rows if r["kind"] == "slab"):
        pct = r["score_tc_tflops"] / mm * 100 if mm else None
        ratio = r["attn_tc_us_per_row"] / r["sdpa_us_per_row"] if r["sdpa_us_per_row"] else None
        out.append(f"| {r['context']} | {r['rows']} | {_f(r['qprep_us'])} | {_f(r['score_scalar_us'])} | "
                   f"{_f(r['score_tc_us'])} | {_f(r['score_tc_tflops'])} | {_f(pct)} | "
                   f"{_f(r['attn_general_us_per_row'], '{:.3f}')} | {_f(r['attn_tc_us_per_row'], '{:.3f}')} | "
                   f"{_f(r['sdpa_us_per_row'], '{:.3f}')} | {_f(ratio, '{:.2f}')} |")
    sweep = sorted((r for r in rows if r["kind"] == "sweep"), key=lambda r: r["context"])
    if sweep:
        out += ["", "| context | selective (TC) µs/row | dense SDPA µs/row | selective / dense |",
                "|---:|---:|---:|---:|"]
        for r in sweep:
            out.append(f"| {r['context']} | {r['attn_tc_us_per_row']:.3f} | {r['sdpa_us_per_row']:.3f} | "
                       f"{r['attn_tc_us_per_row'] / r['sdpa_us_per_row']:.2f} |")
        win = [r["attn_tc_us_per_row"] <= r["sdpa_us_per_row"] for r in sweep]
        cross = [(a["context"], b["context"]) for a, b, wa, wb in zip(sweep, sweep[1:], win, win[1:]) if not wa and wb]
        if cross:
            out.append(f"\nSelective attention overtakes dense between {cross[0][0]} and {cross[0][1]} tokens")
        elif all(win):
            out.append(f"\nSelective attention is faster at every measured context (from {sweep[0]['context']})")
        else:
            out.append(f"\nNo crossing up to {sweep[-1]['context']} tokens")
    slabs = [r for r in rows if r["kind"] == "slab"]
    if mm and slabs:
        best = max(r["score_tc_tflops"] for r in slabs)
        out.append(f"Target TC scorer >= {TC_SCORE_TARGET:.0%} of bf16 matmul: "
                   f"{'met' if best >= TC_SCORE_TARGET * mm else 'NOT met'} ({best / mm:.1%})")
    at32 = next((r for r in slabs if r["context"] == 32768 and r["sdpa_us_per_row"]), None)
    if at32:
        met = at32["attn_tc_us_per_row"] <= at32["sdpa_us_per_row"]
        out.append(f"Target selective attention per row <= dense SDPA per row at 32K: {'met' if met else 'NOT met'} "
                   f"({at32['attn_tc_us_per_row']:.3f} vs {at32['sdpa_us_per_row']:.3f} µs/row)")
    return "\n".join(out)
