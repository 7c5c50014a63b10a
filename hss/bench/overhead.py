"""Host overhead per call of hss's hot APIs in every argument form, against the raw launch floor and torch's own
tiny op, all in one run.

    python -m hss.bench overhead [--smoke]
    python -m hss.bench.overhead [--batch 256] [--batches 31] [--no-torch] [--no-cupy] [--smoke]

Calls: ``Predictor.project_q_on_stream``, ``Predictor.score_layer_on_stream`` (16 blocks), ``TiledAttention.
begin_step_on_stream`` + ``step_tile_on_stream(..., output=)`` (one call pair, one launch), with Llama-like shapes
(32 q / 8 kv heads x 128, r 32, block 16); ``QsaIndexer.decode_select`` with the QSA bench's layer at 8K tokens;
``HighSpeedSwap.attend_layer_on_stream`` with the swap bench's layer, a HostStore and every page streamed in tiles
of one page. Forms: int addresses, hss DeviceBuffers, torch tensors, CuPy arrays (each form with its own memory,
filled with the same bytes; torch and CuPy only where importable and on a real GPU). Peers in the same run: the
raw ``cuLaunchKernel`` floor (the binding called with a pre-built ``void**`` of the empty selftest kernel) and
torch's ``x.add_(1)`` on a small CUDA tensor.

Host µs per call: the median of interleaved batches (:func:`hss.bench._timer.host_us`), nothing synchronised
between the calls of a batch, the stream synchronised between batches outside their time. Before timing, every
call runs once in every form and its output is compared with the int form's (same bits expected). Each timed call
repeats one argument set, as a decode loop does, so ``step_tile`` runs its remembered checks (docs/design.md §23):
its full checks ran in that first call.
Targets: every single-launch call with int pointers <= 1.5x the floor; with torch tensors <= 1.25x the same call
with ints; begin_step + step_tile(output=) with torch tensors <= 12 µs. ``--smoke``: tiny sizes on any driver
(the CPU emulator in CI): the code paths only, its numbers mean nothing.
"""
from __future__ import annotations

import argparse
import itertools
import math
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack
from typing import Any

import ml_dtypes
import numpy as np

from hss import cuda_min as cm
from hss._util import ceil_div
from hss.bench._timer import Case, Timing, host_us
from hss.bench.launch import raw_launch
from hss.cuda import ptx
from hss.cuda._blas import Blas
from hss.cuda._driver import api

BF16 = ml_dtypes.bfloat16
FORMS = ("int", "DeviceBuffer", "torch", "CuPy")
LLAMA = dict(num_q_heads=32, num_kv_heads=8, head_dim=128, r=32, block_size=16, blocks=16)
SMOKE_LLAMA = dict(num_q_heads=4, num_kv_heads=2, head_dim=64, r=16, block_size=16, blocks=4)
QSA_CONTEXT, SMOKE_QSA_CONTEXT = 8192, 40
SWAP = dict(num_q_heads=32, num_kv_heads=8, head_dim=128, block_size=16, pages=128)
SMOKE_SWAP = dict(num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16, pages=8)
TARGET_FLOOR, TARGET_TORCH, TARGET_PAIR_US = 1.5, 1.25, 12.0
SINGLE = ("project_q_on_stream", "score_layer_on_stream", "begin_step + step_tile(output=)")
# driver calls that queue work (counted in one untimed step) and that block the host (timed while measuring)
QUEUEING = ("cuLaunchKernel", "cuMemcpyHtoDAsync", "cuMemcpyDtoHAsync", "cuMemcpyDtoDAsync", "cuMemcpy2DAsync",
            "cuMemsetD8Async", "cuMemsetD32Async", "cuEventRecord", "cuStreamWaitEvent")
BLOCKING = ("cuStreamSynchronize", "cuEventSynchronize", "cuCtxSynchronize", "cuMemcpyDtoH", "cuMemcpyHtoD")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=256, help="calls per batch of a single-launch call")
    p.add_argument("--batches", type=int, default=31, help="interleaved batches per variant (median)")
    p.add_argument("--no-torch", action="store_true", help="skip the torch forms and torch's add_")
    p.add_argument("--no-cupy", action="store_true", help="skip the CuPy forms")
    p.add_argument("--smoke", action="store_true", help="tiny sizes, any driver: checks the code paths only")
    return p.parse_args(argv)


# -- argument forms ---------------------------------------------------------------------------------
class _Forms:
    """Device arrays in every available argument form, each array its own memory, filled from host arrays."""

    def __init__(self, stream: int, args: argparse.Namespace, stack: ExitStack) -> None:
        self.s, self.stack = stream, stack
        self.torch = self.cupy = None
        self.skipped: dict[str, str] = {}
        emulated = cm.driver_status().kind != "cuda"
        for form, flag in (("torch", args.no_torch), ("CuPy", args.no_cupy)):
            why = "--no-" + form.lower() if flag else "the CPU emulator has no GPU memory to share" if emulated \
                else None
            if why is None:
                why = self._import(form)
            if why:
                self.skipped[form] = f"skipped: {why}"
        self.available = tuple(f for f in FORMS if f not in self.skipped)

    def _import(self, form: str) -> str | None:
        try:
            if form == "torch":
                import torch
                if not torch.cuda.is_available():
                    return "torch sees no CUDA device"
                torch.cuda.init()
                self.torch = torch
            else:
                import cupy
                if cupy.cuda.runtime.getDeviceCount() < 1:
                    return "CuPy sees no CUDA device"
                # CuPy's current stream is ours, so the stream its __cuda_array_interface__ names needs no join
                cupy.cuda.ExternalStream(self.s).use()
                self.cupy = cupy
        except Exception as exc:   # ImportError, or a CUDA runtime that cannot start
            return f"{form} unavailable ({type(exc).__name__}: {exc})"
        return None

    def array(self, form: str, host: np.ndarray) -> Any:
        """A device copy of ``host`` (bf16, float32 or int32) in ``form``."""
        if form in ("int", "DeviceBuffer"):
            buf = self.stack.enter_context(cm.DeviceBuffer(max(host.nbytes, 1)))
            obj: Any = buf.ptr if form == "int" else buf
        elif form == "torch":
            t = self.torch
            dtype = {BF16: t.bfloat16, np.float32: t.float32, np.int32: t.int32}[host.dtype.type]
            obj = t.empty(host.shape, dtype=dtype, device="cuda")
        else:   # CuPy has no bf16: raw bytes (u8 matches any dtype), typed arrays for f32 / i32
            c = self.cupy
            obj = c.empty(host.nbytes, dtype=c.uint8) if host.dtype == BF16 else c.empty(host.shape, host.dtype)
        cm.copy_h_to_d_async(address(obj), np.ascontiguousarray(host), host.nbytes, self.s)
        return obj

    def read(self, obj: Any, nbytes: int) -> bytes:
        out = np.empty(nbytes, np.uint8)
        cm.copy_d_to_h_async(out, address(obj), nbytes, self.s)
        cm.stream_sync(self.s)
        return out.tobytes()

    def ready(self) -> None:
        if self.torch is not None:
            self.torch.cuda.synchronize()
        cm.stream_sync(self.s)


def address(obj: Any) -> int:
    """The device address behind an array of any form."""
    if type(obj) is int:
        return obj
    if isinstance(obj, cm.DeviceBuffer):
        return obj.ptr
    if hasattr(obj, "data_ptr"):
        return int(obj.data_ptr())
    return int(obj.data.ptr)   # CuPy


# -- watching the driver seam -----------------------------------------------------------------------
class _Watch:
    """Wrappers over entry points ``names`` of ``target`` while a ``with`` block runs: ``count`` (their calls) and
    ``blocked`` (seconds spent inside them). The target is hss's driver seam (``hss.cuda._driver.api``, every driver
    call) or its cuBLAS seam (``hss.cuda._blas.Blas``). Each wrapper costs ~0.2 µs a call."""

    def __init__(self, names: tuple[str, ...], target: Any = api) -> None:
        self.names, self.target, self.count, self.blocked = names, target, 0, 0.0
        self._real: dict[str, Any] = {}

    def __enter__(self) -> _Watch:
        clock = time.perf_counter
        for name in self.names:
            real = getattr(self.target, name, None)
            if real is None:
                continue
            self._real[name] = real

            def wrapper(*a: Any, _real: Any = real) -> Any:
                t0 = clock()
                try:
                    return _real(*a)
                finally:
                    self.count += 1
                    self.blocked += clock() - t0

            setattr(self.target, name, wrapper)
        return self

    def __exit__(self, *exc: Any) -> None:
        for name, real in self._real.items():
            setattr(self.target, name, real)
        self._real.clear()


def _outside_waits(t: Timing, waits: list[float], warmup: int, batch: int) -> float:
    """Median over batches of (batch time - the batch's blocking waits) per call, in µs (``waits``: seconds per
    call, warm-up calls first, then the batches in timing order)."""
    return statistics.median(us - 1e6 * sum(waits[warmup + k * batch:warmup + (k + 1) * batch]) / batch
                             for k, us in enumerate(t.samples))


def _waiting(fn: Callable[[], Any], watch: _Watch, waits: list[float]) -> Callable[[], Any]:
    """``fn`` that appends the seconds it spent blocked in the driver to ``waits``."""
    def call() -> Any:
        before = watch.blocked
        out = fn()
        waits.append(watch.blocked - before)
        return out
    return call


# -- the calls ----------------------------------------------------------------------------------------
def _rand(rng: np.random.Generator, shape: tuple[int, ...], std: float = 1.0) -> np.ndarray:
    return (rng.standard_normal(shape, dtype=np.float32) * std).astype(BF16)


def _single_calls(ctx: cm.CudaCtx, forms: _Forms, d: dict, rng: np.random.Generator,
                  stack: ExitStack) -> dict[tuple[str, str], tuple[Callable[[], None], Callable[[], bytes]]]:
    """{(call, form): (the call, read its output)} for project_q, score_layer and begin_step + step_tile."""
    from hss.attention import TiledAttention, TiledAttentionDims
    from hss.predictor import Predictor, PredictorDims
    s = ctx.stream
    nq, nkv, hd, r, bs, nb = (d[k] for k in ("num_q_heads", "num_kv_heads", "head_dim", "r", "block_size", "blocks"))
    pdims = PredictorDims(num_layers=1, num_q_heads=nq, num_kv_heads=nkv, head_dim=hd, r=r, block_size=bs,
                          max_blocks=nb)
    pred = stack.enter_context(Predictor(ctx, pdims, 0xCAFE_F00D))
    a_g = _rand(rng, (pdims.a_g_bytes() // 2,), 1 / math.sqrt(hd))
    cm.copy_h_to_d_async(pred.a_g_dev_ptr, a_g, a_g.nbytes, s)
    ta = stack.enter_context(TiledAttention(ctx, TiledAttentionDims(1, nq, nkv, hd, bs, nb)))
    blk, tok, kvh = ta.paged_strides()
    q, q_proj, scores = _rand(rng, (nq, hd)), _rand(rng, (nq, r)), np.zeros(nb, np.float32)
    k, v = _rand(rng, (nb, bs, nkv, hd), 1 / math.sqrt(hd)), _rand(rng, (nb, bs, nkv, hd))
    table, counts = rng.permutation(nb).astype(np.int32)[None], np.array([nb], np.int32)
    out = np.zeros((1, nq, hd), BF16)
    sizes = {"q_proj": q_proj.nbytes, "scores": scores.nbytes, "out": out.nbytes}
    calls = {}
    for form in forms.available:
        a = {name: forms.array(form, host) for name, host in
             dict(q=q, q_proj=q_proj, scores=scores, k=k, v=v, table=table, counts=counts, out=out).items()}

        def project_q(a: dict = a) -> None:
            pred.project_q_on_stream(s, a["q"], a["q_proj"])

        def score_layer(a: dict = a) -> None:
            pred.score_layer_on_stream(s, a["q_proj"], 0, 0, nb, a["scores"])

        def step(a: dict = a) -> None:
            ta.begin_step_on_stream(s, 1)
            ta.step_tile_on_stream(s, a["q"], a["k"], a["v"], a["table"], a["counts"], 1, blk, tok, kvh, bs,
                                   output=a["out"])

        def read(name: str, a: dict = a) -> bytes:
            return forms.read(a[name], sizes[name])

        calls[(SINGLE[0], form)] = (project_q, lambda read=read: read("q_proj"))
        calls[(SINGLE[1], form)] = (score_layer, lambda read=read: read("scores"))
        calls[(SINGLE[2], form)] = (step, lambda read=read: read("out"))
    forms.ready()
    return calls


def _check(calls: dict, forms: _Forms) -> dict[tuple[str, str], str]:
    """Run every call once in every form: its output against the int form's (the same input bytes)."""
    notes, ref = {}, {}
    for (call, form), (fn, read) in calls.items():   # int first: FORMS order
        fn()
        got = read()
        ref.setdefault(call, got)
        notes[(call, form)] = "output = ints' bits" if got == ref[call] else "CHECK FAILED: output differs from ints'"
    forms.ready()
    return notes


def _peers(ctx: cm.CudaCtx, forms: _Forms, stack: ExitStack) -> dict[str, Case | str]:
    """The raw launch floor and torch's ``x.add_(1)`` (or why it is skipped)."""
    s = ctx.stream
    mod = stack.enter_context(ptx.load_module("selftest", ctx))
    a, b = (stack.enter_context(cm.DeviceBuffer(256)) for _ in range(2))
    peers: dict[str, Case | str] = {
        "raw cuLaunchKernel, pre-built void** (floor)": Case(raw_launch(mod.function("selftest_empty"), s, a.ptr,
                                                                        b.ptr, 64), lambda: cm.stream_sync(s))}
    if forms.torch is None:
        peers["torch x.add_(1)"] = forms.skipped.get("torch", "skipped: torch unavailable")
    else:
        x = forms.torch.zeros(16, device="cuda")
        peers["torch x.add_(1)"] = Case(lambda: x.add_(1), forms.torch.cuda.synchronize)
    return peers


def _decode_select(ctx: cm.CudaCtx, forms: _Forms, smoke: bool, rng: np.random.Generator, stack: ExitStack,
                   batches: int) -> list[dict]:
    """decode_select per step in every form: the whole call, and its launch part (see :data:`NOTE_QSA`)."""
    from hss.bench.qsa import DIMS, SLAB, SMOKE_DIMS
    from hss.cuda.gpu import CudaBackend
    from hss.qsa import QsaIndexer
    from hss.qsa.select import select_tokens
    s, d = ctx.stream, SMOKE_DIMS if smoke else DIMS
    n = SMOKE_QSA_CONTEXT if smoke else QSA_CONTEXT
    H, nh, hd, ratio, bs = d["hidden"], d["n_heads"], d["hd"], d["ratio"], d["block_size"]
    batch, warm = (2, 1) if smoke else (8, 8)
    # positions decoded: one check call and the timed ones per form, one counted step, and a margin
    total = n + len(forms.available) * (1 + warm + batch * batches) + 1 + 2 * ratio
    gpu = CudaBackend(ctx)
    stack.callback(gpu.close)
    w = ((rng.standard_normal(((nh + 1) * hd, H)) / math.sqrt(H)).astype(BF16))
    slab = (rng.standard_normal((min(SLAB, n), H)) * 0.5).astype(BF16)
    d_w, d_qn, d_kn, d_slab = (forms.array("DeviceBuffer", a) for a in (w, _rand(rng, (hd,), 0.1),
                                                                        _rand(rng, (hd,), 0.1), slab))
    idx = stack.enter_context(QsaIndexer(d_w, d_qn, d_kn, nh, hd, ratio, d["budget"], d["rot"], d["theta"], d["eps"],
                                         H, d["nkv_attn"], d["hd_attn"], gpu, max_tokens=total))
    st = idx.new_seq_state()
    stack.callback(idx.release_seq_state, st)
    for start in range(0, n - 1, slab.shape[0]):
        idx.prefill_ingest(st, d_slab, min(slab.shape[0], n - 1 - start), start, s)
    pages = ceil_div(total, bs)
    pool = np.ones((pages, bs, d["nkv_attn"], d["hd_attn"]), BF16)
    table = rng.permutation(pages).astype(np.int32)
    pos = itertools.count(n - 1)   # one sequence: every call, whatever its form, decodes the next position
    steps, notes = {}, {}
    for form in forms.available:
        a = [forms.array(form, x) for x in (slab[0], pool, pool, table)]

        def step(a: list = a) -> Any:
            return idx.decode_select(st, a[0], next(pos), a[1], a[2], a[3], bs, s)
        steps[form] = step
    forms.ready()
    for form, step in steps.items():   # each form once: it must select
        sel = step()
        notes[form] = f"selected {sel.n_sel} tokens" if sel is not None else "CHECK FAILED: no selection"
    # one step counted: the GEMMs go to cuBLAS (its kernels bypass the driver seam), the rest through the seam
    with _Watch(("cuLaunchKernel",)) as launches, _Watch(QUEUEING[1:]) as queued, _Watch(BLOCKING) as blocking, \
            _Watch(("proj_dense",), Blas) as gemms:
        steps["int"]()
    ops = launches.count + queued.count + gemms.count
    op_note = (f"{ops} queued operations per step: {launches.count} kernel launches, {queued.count} other queued "
               f"driver calls (copies, memsets, events), {gemms.count} cuBLAS GEMM; {blocking.count} blocking "
               "driver call(s)")
    waits: dict[str, list[float]] = {form: [] for form in steps}
    with _Watch(BLOCKING) as watch:
        t = host_us({form: Case(_waiting(fn, watch, waits[form]), lambda: cm.stream_sync(s)) for form, fn in
                     steps.items()}, batch=batch, batches=batches, warmup=warm)
    visible = n + len(forms.available) * (warm + batch * batches // 2)   # a typical step's context
    scores = rng.standard_normal(visible // ratio).astype(np.float32)
    out = np.empty(idx.sel_cap, np.int32)
    topk = host_us({"topk": lambda: select_tokens(scores, idx.block_topk, ratio, visible, out=out)},
                   batch=2 if smoke else 50, batches=batches)["topk"].us
    rows = [_row("decode_select: host top-k alone (select_tokens, same sizes)", "-", topk,
                 note=f"{visible // ratio} block scores, top {idx.block_topk} blocks")]
    for form in FORMS:
        if form in forms.skipped:
            rows += [_row(f"decode_select: {what}", form, None, note=forms.skipped[form])
                     for what in ("whole call per step", "launch part per step", "launch part per queued operation")]
            continue
        part = _outside_waits(t[form], waits[form], warm, batch) - topk
        rows += [_row("decode_select: whole call per step", form, t[form].us,
                      note=f"includes its blocking D2H wait and host top-k; {notes[form]}"),
                 _row("decode_select: launch part per step", form, part,
                      note="whole call - time blocked in the driver - host top-k"),
                 _row("decode_select: launch part per queued operation", form, part / max(ops, 1), note=op_note)]
    return rows


def _attend_layer(ctx: cm.CudaCtx, forms: _Forms, smoke: bool, rng: np.random.Generator, stack: ExitStack,
                  batches: int) -> list[dict]:
    """attend_layer's host work per streamed tile, every page streamed in tiles of one page (see :data:`NOTE_SWAP`),
    and the marginal cost of a tile against the same step in tiles of several pages."""
    from hss.swap import HighSpeedSwap, HighSpeedSwapConfig, ModelDims
    s, d = ctx.stream, SMOKE_SWAP if smoke else SWAP
    nq, nkv, hd, bs, pages = (d[k] for k in ("num_q_heads", "num_kv_heads", "head_dim", "block_size", "pages"))
    batch, warm = (1, 1) if smoke else (2, 2)
    k, v = _rand(rng, (pages, bs, nkv, hd), 1 / math.sqrt(hd)), _rand(rng, (pages, bs, nkv, hd))
    k_dev = forms.array("int", k)
    model = ModelDims(1, pages, nq, nkv, hd, bs)
    big = max(2, min(16, pages // 2))

    def swap(tile: int) -> HighSpeedSwap:   # resident_blocks = 2 tiles: no resident set, every page streamed
        cfg = HighSpeedSwapConfig(tempfile.gettempdir(), 1 << 62, 2 * tile, 32, 8, False, 0xCAFE_F00D, store="host",
                                  stream_tile_blocks=tile)
        h = stack.enter_context(HighSpeedSwap(ctx, cfg, model))
        for b in range(pages):
            assert h.alloc_disk_block() == b
            h.offload_block(ctx, 0, b, k_dev + b * k[b].nbytes, k[b], v[b])
        return h

    small, large = swap(1), swap(big)
    ids = np.arange(pages, dtype=np.int64)
    q, out = _rand(rng, (nq, hd)), np.zeros((nq, hd), BF16)
    steps, notes, ref = {}, {}, None
    for form in forms.available:
        fq, fo = forms.array(form, q), forms.array(form, out)
        steps[form] = lambda fq=fq, fo=fo: small.attend_layer_on_stream(s, 0, ids, fq, fo)
        forms.ready()
        steps[form]()
        got = forms.read(fo, out.nbytes)
        ref = got if ref is None else ref
        notes[form] = "output = ints' bits" if got == ref else "CHECK FAILED: output differs from ints'"
    q_int, out_int = forms.array("int", q), forms.array("int", out)
    steps["large"] = lambda: large.attend_layer_on_stream(s, 0, ids, q_int, out_int)
    forms.ready()
    waits: dict[str, list[float]] = {name: [] for name in steps}
    with _Watch(BLOCKING) as watch:
        t = host_us({name: Case(_waiting(fn, watch, waits[name]), lambda: cm.stream_sync(s)) for name, fn in
                     steps.items()}, batch=batch, batches=batches, warmup=warm)
    tiles = {h: sum(tile.streamed for tile in h.last_step.tiles) for h in (small, large)}
    host = {name: _outside_waits(t[name], waits[name], warm, batch) for name in steps}
    rows = []
    for form in FORMS:
        if form in forms.skipped:
            rows.append(_row("attend_layer: host work per streamed tile", form, None, note=forms.skipped[form]))
            continue
        rows.append(_row("attend_layer: host work per streamed tile", form, host[form] / tiles[small],
                         note=f"step {t[form].us:.0f} µs on the host, {t[form].us - host[form]:.0f} µs of it blocked "
                              f"(the score wait); ({tiles[small]} tiles of 1 page); {notes[form]}"))
    marginal = (host["int"] - host["large"]) / max(tiles[small] - tiles[large], 1)
    rows.append(_row("attend_layer: marginal host work per tile", "int", marginal,
                     note=f"(step in {tiles[small]} tiles - step in {tiles[large]} tiles of {big} pages) / "
                          f"{tiles[small] - tiles[large]}, both without the blocked time"))
    return rows


# -- rows and the table -------------------------------------------------------------------------------
def _row(call: str, form: str, us: float | None, note: str = "") -> dict:
    return {"call": call, "form": form, "us": us, "x_floor": None, "x_ints": None, "note": note}


def _ratios(rows: list[dict]) -> None:
    """Fill × floor (every timed row) and × the same call with ints."""
    floor = rows[0]["us"]
    ints = {r["call"]: r["us"] for r in rows if r["form"] == "int" and r["us"]}
    for r in rows:
        if r["us"] is None:
            continue
        r["x_floor"] = r["us"] / floor
        if r["call"] in ints:
            r["x_ints"] = r["us"] / ints[r["call"]]


def run(args: argparse.Namespace) -> list[dict]:
    """Every row of the table (call, form, us, x_floor, x_ints, note)."""
    smoke = bool(args.smoke)
    batch, batches = (3, 2) if smoke else (args.batch, args.batches)
    rng = np.random.default_rng(0)
    with ExitStack() as stack:
        ctx = stack.enter_context(cm.CudaCtx(0))
        forms = _Forms(ctx.stream, args, stack)
        if forms.cupy is not None:   # CuPy's current stream back to its default once ours is gone
            stack.callback(forms.cupy.cuda.Stream.null.use)
        peers = _peers(ctx, forms, stack)
        calls = _single_calls(ctx, forms, SMOKE_LLAMA if smoke else LLAMA, rng, stack)
        notes = _check(calls, forms)
        sync = lambda: cm.stream_sync(ctx.stream)  # noqa: E731
        cases: dict[str, Case] = {name: c for name, c in peers.items() if isinstance(c, Case)}
        cases.update({f"{call} | {form}": Case(fn, sync) for (call, form), (fn, _) in calls.items()})
        t = host_us(cases, batch=batch, batches=batches)
        rows = [_row(name, "-", t[name].us if isinstance(c, Case) else None, "" if isinstance(c, Case) else c)
                for name, c in peers.items()]
        for call in SINGLE:
            for form in FORMS:
                key = f"{call} | {form}"
                if form in forms.skipped:
                    rows.append(_row(call, form, None, note=forms.skipped[form]))
                else:
                    one = "one launch; " if call == SINGLE[2] else ""
                    rows.append(_row(call, form, t[key].us, note=one + notes[(call, form)]))
        rows += _decode_select(ctx, forms, smoke, rng, stack, max(3, batches // 3))
        rows += _attend_layer(ctx, forms, smoke, rng, stack, max(3, batches // 3))
        forms.ready()
    _ratios(rows)
    return rows


NOTE = ("Host µs per call: median of interleaved batches, no synchronisation between the calls of a batch (the stream "
        "is synchronised between batches, outside their time). × floor: / the raw cuLaunchKernel row; × ints: / the "
        "same call with int addresses. Forms: int addresses, hss DeviceBuffers, torch tensors (bf16 / f32 / i32 as "
        "the parameter), CuPy arrays (CuPy has no bf16: raw uint8 bytes for bf16 parameters, float32 / int32 arrays "
        "where those are the parameter's dtype; CuPy's current stream is the calls' stream, so the stream its "
        "__cuda_array_interface__ names needs no join). Each form has its own memory, filled with the same bytes.")
NOTE_QSA = ("decode_select blocks the host once per step (the scores' D2H) and runs a host top-k, so its whole call is "
            "not launch overhead. Its launch part = the whole call - the time spent inside the driver's blocking calls "
            "(stream / event synchronise, timed per call by a wrapper at the driver seam, ~0.2 µs each) - the host "
            "top-k timed alone on the same sizes; per queued operation = that / the operations one step queues "
            "(counted in one step at the driver seam and at hss's cuBLAS seam, hss.cuda._blas.Blas).")
NOTE_SWAP = ("attend_layer: a HostStore step with every page streamed (no resident set), tiles of one page: the step's "
             "host time minus the time it blocked in the driver (its one wait, for the predictor scores, which also "
             "waits for the previous step's device work), per streamed tile. A tile queues its page reads, two event "
             "waits, the step_tile launch and an event record. The marginal row compares the same step in tiles of "
             "several pages (int addresses).")


def _f(v: float | None, fmt: str) -> str:
    return "—" if v is None else format(v, fmt)


def table(rows: list[dict]) -> str:
    out = ["| call | form | µs / call | × floor | × ints | note |", "|---|---|---:|---:|---:|---|"]
    for r in rows:
        out.append(f"| {r['call']} | {r['form']} | {_f(r['us'], '.2f')} | {_f(r['x_floor'], '.2f')} | "
                   f"{_f(r['x_ints'], '.2f')} | {r['note']} |")
    out += ["", NOTE, "", NOTE_QSA, "", NOTE_SWAP, ""]
    if any("CHECK FAILED" in r["note"] for r in rows):
        out.append("CHECK FAILED: a form's output differs from the int form's (see the notes)\n")
    out += _targets(rows)
    return "\n".join(out)


def _targets(rows: list[dict]) -> list[str]:
    def find(call: str, form: str) -> dict:
        return next(r for r in rows if r["call"] == call and r["form"] == form)

    def verdict(ok: bool) -> str:
        return "met" if ok else "NOT met"

    lines = []
    for call in SINGLE:
        r = find(call, "int")
        lines.append(f"- target: {call} with int pointers <= {TARGET_FLOOR}x the raw floor: "
                     f"{r['x_floor']:.2f}x -> {verdict(r['x_floor'] <= TARGET_FLOOR)}")
    for call in SINGLE:
        r = find(call, "torch")
        got = f"{r['x_ints']:.2f}x -> {verdict(r['x_ints'] <= TARGET_TORCH)}" if r["us"] is not None else \
            f"not measured ({r['note']})"
        lines.append(f"- target: {call} with torch tensors <= {TARGET_TORCH}x the same call with ints: {got}")
    r = find(SINGLE[2], "torch")
    got = f"{r['us']:.2f} µs -> {verdict(r['us'] <= TARGET_PAIR_US)}" if r["us"] is not None else \
        f"not measured ({r['note']})"
    lines.append(f"- target: begin_step + step_tile(output=) with torch tensors <= {TARGET_PAIR_US:g} µs: {got}")
    return lines


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rows = run(args)
    print(f"driver: {cm.driver_status().message}")
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
