"""Launch overhead: µs per launch of an empty 3-argument kernel, hss against its peers, same run.

Peers: raw ``cuda.bindings`` with a pre-built ``void**`` (the floor), ``cuda.bindings`` with
``(values, types)``, ``cuda.core.launch``, CuPy ``RawKernel``; a missing peer is skipped and named.
Each variant is timed on the host over batches of launches (the stream is synchronised between
batches); the median batch gives µs/launch. Target: prepared pack <= 1.10x the floor.
"""
from __future__ import annotations

import argparse
import ctypes
from collections.abc import Callable
from typing import Any

import numpy as np

from hss import cuda_min as cm
from hss.bench._timer import Case, host_us
from hss.cuda import ptx
from hss.cuda._driver import api, check
from hss.decls.selftest import SELFTEST_EMPTY


def raw_launch(func: cm.CudaFunction, stream: int, a: int, b: int, n: int) -> Callable[[], None]:
    """The floor: ``selftest_empty(a, b, n)`` through the binding called directly with a pre-built ``void**``
    and no checks beyond the status."""
    slots = (ctypes.c_uint64 * 3)(a, b, n)
    base = ctypes.addressof(slots)
    vp = (ctypes.c_void_p * 3)(base, base + 8, base + 16)
    raw_params = ctypes.addressof(vp)
    fh = func.handle
    launch_raw = api.cuLaunchKernel

    def raw(_keep: Any = (slots, vp)) -> None:   # _keep: the parameter arrays live as long as the call
        err = launch_raw(fh, 1, 1, 1, 1, 1, 1, 0, stream, raw_params, 0)[0]
        if err:
            raise RuntimeError(err)

    return raw


def _peers(ctx: cm.CudaCtx, text: str, a: int, b: int, n: int) -> dict[str, Callable[[], None] | str]:
    peers: dict[str, Callable[[], None] | str] = {}
    s = ctx.stream
    try:
        try:
            from cuda.core import Device, LaunchConfig, ObjectCode, launch  # cuda.core >= 0.4 / 1.x
        except ImportError:
            from cuda.core.experimental import Device, LaunchConfig, ObjectCode, launch
        dev = Device(ctx.device)
        dev.set_current()
        kern = ObjectCode.from_ptx(text.encode()).get_kernel("selftest_empty")
        cstream = dev.create_stream()
        cfg = LaunchConfig(grid=1, block=1)
        ua, ub, nn = np.uint64(a), np.uint64(b), np.int32(n)
        peers["cuda.core launch"] = lambda k=kern: launch(cstream, cfg, k, ua, ub, nn)
        peers["_cuda.core sync"] = cstream.sync
    except Exception as exc:   # report why it is missing
        peers["cuda.core launch"] = f"skipped: {type(exc).__name__}: {exc}"
    try:
        import os
        import tempfile

        import cupy
        with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
            f.write(text)
        kern = cupy.RawModule(path=f.name).get_function("selftest_empty")
        os.unlink(f.name)
        cs = cupy.cuda.ExternalStream(s)
        ua, ub, nn = np.uint64(a), np.uint64(b), np.int32(n)
        peers["CuPy RawKernel"] = lambda k=kern: k((1,), (1,), (ua, ub, nn), stream=cs)
    except Exception as exc:
        peers["CuPy RawKernel"] = f"skipped: {type(exc).__name__}: {exc}"
    return peers


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    batch, batches = (20, 3) if args.smoke else (2000, 25)
    ctx = cm.CudaCtx(0)
    s = ctx.stream
    mod = ptx.load_module("selftest", ctx)
    func = mod.function("selftest_empty")
    _, path = ptx.choose("selftest", ctx.compute_capability)
    text = path.read_text()
    buf_a, buf_b = cm.DeviceBuffer(256), cm.DeviceBuffer(256)
    a, b, n = buf_a.ptr, buf_b.ptr, 64
    pack = SELFTEST_EMPTY.pack(a, b, n)
    na, nb, nn = np.uint64(a), np.uint64(b), np.int32(n)
    sync = lambda: cm.stream_sync(s)  # noqa: E731

    raw = raw_launch(func, s, a, b, n)
    fh, launch_raw = func.handle, api.cuLaunchKernel
    tuple_params = ((a, b, n), (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int32))
    variants: dict[str, Callable[[], None] | str] = {
        "raw cuda.bindings, pre-built void** (floor)": raw,
        "hss launch_kernel, prepared ParamPack": lambda: cm.launch_kernel(func, (1, 1, 1), (1, 1, 1), 0, s, pack),
        "hss launch_kernel, numpy scalars": lambda: cm.launch_kernel(func, 1, 1, 0, s, [na, nb, nn]),
    }
    if cm.driver_status().kind == "cuda":   # the emulator decodes only packed void** arrays
        variants["cuda.bindings, (values, types)"] = lambda: check(
            launch_raw(fh, 1, 1, 1, 1, 1, 1, 0, s, tuple_params, 0), "cuLaunchKernel")
    if not args.smoke:
        variants.update(_peers(ctx, text, a, b, n))
    peer_sync = variants.pop("_cuda.core sync", None)
    timed = {name: Case(fn, peer_sync if name == "cuda.core launch" and callable(peer_sync) else sync)
             for name, fn in variants.items() if callable(fn)}
    us = {name: t.us for name, t in host_us(timed, batch=batch, batches=batches, timed_sync=True).items()}
    floor = next(iter(us.values()))
    rows = []
    for name, fn in variants.items():
        if isinstance(fn, str):
            rows.append({"variant": name, "us_per_launch": None, "ratio_to_floor": None, "note": fn})
        else:
            rows.append({"variant": name, "us_per_launch": us[name], "ratio_to_floor": us[name] / floor, "note": ""})
    mod.close()
    buf_a.close()
    buf_b.close()
    ctx.close()
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    out = ["| launch variant | µs / launch | × floor | note |", "|---|---:|---:|---|"]
    for r in rows:
        us = f"{r['us_per_launch']:.2f}" if r["us_per_launch"] is not None else "—"
        ratio = f"{r['ratio_to_floor']:.2f}" if r["ratio_to_floor"] is not None else "—"
        out.append(f"| {r['variant']} | {us} | {ratio} | {r['note']} |")
    prepared = next(r for r in rows if "prepared" in r["variant"])
    target = "met" if prepared["ratio_to_floor"] <= 1.10 else "NOT met"
    out.append(f"\nTarget prepared pack <= 1.10x floor: {target} ({prepared['ratio_to_floor']:.2f}x)")
    return "\n".join(out)
