"""Benchmark: a decode step of one layer whose KV history lives in a backing store (HighSpeedSwap).

    python -m hss.bench.swap [--tokens 32768,131072] [--resident 0.125] [--tile 128] [--iters 5] [--dir DIR]
    python -m hss.bench.swap --smoke      tiny sizes, no PyTorch (runs on the CPU emulator in CI)
    python -m hss.bench.swap --tp 2       the step split over two devices by kv heads (hss.bench._swap_tp)

One layer: 32 q / 8 kv heads, head_dim 128, block_size 16, pages 0..n-1 in token order. Per context length,
all in one run:

* pinned H2D bandwidth (a pinned buffer -> device, CUDA events) and device copy bandwidth (K and V copied
  device to device; bytes read + written per second);
* in-HBM tiled attention (begin_step, one tile over the NHD pool that writes the output; events): time,
  K+V bytes / time, and that as a fraction of the copy bandwidth; PyTorch SDPA decode on the same data
  (skipped with a note without torch);
* the disk's own read bandwidth under the FileStore's directory: a file of the layer file's size written with
  O_DIRECT, then read whole with O_DIRECT by each of ``--disk-threads`` threads counts x ``--disk-sizes`` request
  sizes (thread t reads requests t, t + threads, ...), the best of them kept (buffered reads after dropping the
  file's cached pages where the filesystem refuses O_DIRECT, noted);
* a HighSpeedSwap step from a HostStore and from a FileStore (resident set = ``--resident`` of the pages,
  streamed tiles of ``--tile`` pages; the FileStore reads with the best disk configuration's threads and request
  size unless ``--qd`` / ``--run-cap`` say otherwise): host wall time per step (attend_layer + stream sync, after
  the resident set settled), hit rate, bytes read, device stall on reads, and the floor
  max(non-resident bytes / H2D bandwidth, all K+V bytes / copy bandwidth) -- for the FileStore also
  non-resident bytes / the best disk bandwidth. The last timed step's recorded tile schedule is replayed with
  in-HBM tiled attention: the outputs must agree bit for bit;
* the HostStore's two ways of reading a group of scattered pages (a tile of every other page into pool slots, one
  run per page, as a sparse step's misses): one ``page_gather`` launch (zero-copy from the mapped pinned buffer) and
  one batched DMA call: device time (bandwidth) and host µs per group (the driver's share of a sparse step);
  ``--gather-min-runs N`` sets the swaps' choice between them for every step, exact and sparse (default: the
  library's: a sparse step's tiles of more than one run through the kernel, the rest batched copies; 0: every group
  into pool slots through the kernel; a large N: batched copies only);
* the sparse swap mode (docs/design.md §17.6) on the HostStore swap, right after its exact steps: ``--sparse-steps``
  consecutive steps attending the first ``--keep-first`` and last ``--keep-recent`` pages plus ``--budget`` of the
  pages by predictor score, with the exact step's query every step (the resident set settles on what the query
  picks) and with a new random query every step (the worst case for the resident set: random keys make each
  query's picks independent). Per row: host wall time per step and its ratio to the exact HostStore step, hit rate,
  the host µs of a step split into its parts (``HighSpeedSwap.host_profile``: argument checks, the sparse step's
  score launches, score wait, page choice, read planning, tiles up to the first streamed one, the other tiles, the
  record) and, over a few more untimed steps, the driver calls per step (by name) and the host µs inside them,
  pages read, pages attended, the last step's output against the exact step's for the same query (relative L2:
  random keys spread attention evenly, so this measures nothing about quality; see ``python -m hss.bench
  recall``), and the last step's tiles replayed in HBM (bitwise).

Targets (printed with met / not met): in-HBM tiled attention >= 50 % of copy bandwidth at 32K; HostStore and
FileStore steps within 1.25x of their floors; the sparse step (1/8 budget, a new query every step) at 32K within
0.2x of the exact HostStore step. FileStore reads go through the page cache unless the store runs O_DIRECT (shown).
"""
from __future__ import annotations

import argparse
import errno
import functools
import mmap
import os
import sys
import tempfile
import threading
import time
from typing import Any

import numpy as np

from hss._util import ceil_div

SMOKE = dict(tokens="256,512", num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16, tile=2, iters=1, warmup=1,
             disk_threads="1,2", disk_sizes="64K,256K", sparse_steps=4)
TARGET_ATTN = 0.5      # in-HBM tiled attention bandwidth / copy bandwidth at 32K
TARGET_FLOOR = 1.25    # HostStore and FileStore step time / floor
TARGET_SPARSE = 0.2    # sparse step (1/8 budget, a new query each step) / exact HostStore step at 32K
O_DIRECT = getattr(os, "O_DIRECT", 0)
_CHUNK = 4 << 20       # the disk probe's write size


def _size(text: str) -> int:
    """'256K', '1M', '4096' -> bytes."""
    t = text.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(t[-1:], 1)
    return int(t[:-1] if mult > 1 else t) * mult


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default="32768,131072", help="comma-separated context lengths")
    p.add_argument("--num-q-heads", type=int, default=32)
    p.add_argument("--num-kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--resident", type=float, default=0.125, help="fraction of the pages in the resident set")
    p.add_argument("--tile", type=int, default=128, help="pages per streamed tile")
    p.add_argument("--qd", type=int, default=None, help="FileStore reads in flight (default: the best disk thread "
                                                          "count)")
    p.add_argument("--run-cap", default=None, help="FileStore's largest read, e.g. 1M (default: the best disk "
                                                   "request size)")
    p.add_argument("--disk-threads", default="1,4,8,16", help="thread counts of the disk read probe")
    p.add_argument("--disk-sizes", default="256K,1M,4M", help="request sizes of the disk read probe")
    p.add_argument("--dir", default=None, help="where FileStore puts its layer file (default: a temp dir)")
    p.add_argument("--iters", type=int, default=5, help="timed steps per variant")
    p.add_argument("--budget", type=float, default=0.125, help="sparse mode: budget_pages as a fraction of the pages "
                                                               "(0: no sparse rows)")
    p.add_argument("--keep-first", type=int, default=1, help="sparse mode: first pages always attended")
    p.add_argument("--keep-recent", type=int, default=4, help="sparse mode: last pages always attended")
    p.add_argument("--sparse-steps", type=int, default=64, help="sparse mode: consecutive timed steps per variant")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--gather-min-runs", type=int, default=None, help="HostStore reads: groups of more runs go "
                   "through page_gather, exact and sparse steps alike (default: the library's choice; 0: all; a "
                   "large number: none)")
    p.add_argument("--no-torch", action="store_true", help="skip the PyTorch SDPA comparison")
    p.add_argument("--smoke", action="store_true", help="tiny sizes and no PyTorch: a code-path check")
    p.add_argument("--device-step", default="32768", metavar="TOKENS", help="also the device sparse step "
                   "(hss.bench.sparse_step: same / new query, batch 1 / 8 / 32, eager and in a graph, beside the host "
                   "sparse and exact steps and the floors) at this length; 'off': not")
    p.add_argument("--device-step-batches", default="1,8,32", help="the device step's batch sizes")
    p.add_argument("--tp", type=int, default=1, help="N > 1: only the step split over N devices by kv heads against "
                   "one device (hss.bench._swap_tp)")
    args = p.parse_args(argv)
    if args.smoke:
        for key, value in SMOKE.items():
            setattr(args, key, value)
        args.no_torch = True
    return args


def run(args: argparse.Namespace) -> list[dict]:
    """Every measurement at every context length; one dict per row (tokens, variant, us, GB/s, note)."""
    if args.smoke:
        os.environ.setdefault("HSS_DRIVER", "emulator")
    if args.tp > 1:
        from hss.bench import _swap_tp
        return _swap_tp.tp_rows(args)
    from hss import cuda_min as cm
    rows: list[dict] = []
    ctx = cm.CudaCtx(0)
    try:
        for tokens in sorted({int(t) for t in args.tokens.split(",")}):
            rows += _one_length(args, ctx, tokens)
    finally:
        ctx.close()
    if args.device_step != "off":
        rows += [dict(r, part="device step") for r in _device_step_rows(args)]
    return rows


def _device_step_rows(args: argparse.Namespace) -> list[dict]:
    """hss.bench.sparse_step's rows with this run's dims and sparse settings (its budget: --budget of the pages)."""
    from hss.bench import sparse_step
    tokens = int(args.device_step)
    budget = max(1, round(args.budget * (tokens // args.block_size)))
    argv = ["--tokens", str(tokens), "--batches", args.device_step_batches, "--budget", str(budget),
            "--keep-first", str(args.keep_first), "--keep-recent", str(args.keep_recent),
            "--num-q-heads", str(args.num_q_heads), "--num-kv-heads", str(args.num_kv_heads),
            "--head-dim", str(args.head_dim), "--block-size", str(args.block_size)]
    return sparse_step.run(sparse_step.parse_args(argv + (["--smoke"] if args.smoke else [])))


def _data(rng: np.random.Generator, shape: tuple[int, ...], std: float) -> np.ndarray:
    import ml_dtypes
    out = np.empty(shape, dtype=ml_dtypes.bfloat16)
    for i in range(0, shape[0], 1024):     # float32 temporaries a few MB at a time
        out[i:i + 1024] = (rng.standard_normal((min(1024, shape[0] - i),) + shape[1:], dtype=np.float32) * std)
    return out


# -- the disk's own read bandwidth -----------------------------------------------------------------------
def _aligned(nbytes: int) -> mmap.mmap:
    return mmap.mmap(-1, nbytes)        # page-aligned anonymous memory: O_DIRECT buffers


def _write_probe(path: str, nbytes: int) -> bool:
    """``nbytes`` (a multiple of _CHUNK) of random bytes at ``path``, with O_DIRECT where the filesystem takes it,
    synced; returns whether O_DIRECT was used."""
    buf = _aligned(_CHUNK)
    buf[:] = os.urandom(_CHUNK)
    direct = bool(O_DIRECT)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (O_DIRECT if direct else 0), 0o644)
    except OSError as exc:
        if not direct or exc.errno != errno.EINVAL:
            raise
        direct = False
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for off in range(0, nbytes, _CHUNK):
            try:
                os.pwrite(fd, buf, off)
            except OSError as exc:            # accepted at open, refused at the first write
                if not direct or exc.errno != errno.EINVAL or off:
                    raise
                os.close(fd)
                fd = os.open(path, os.O_WRONLY, 0o644)
                direct = False
                os.pwrite(fd, buf, off)
        os.fsync(fd)
    finally:
        os.close(fd)
        buf.close()
    return direct


def _read_probe(path: str, nbytes: int, threads: int, size: int, direct: bool) -> float:
    """Seconds to read ``path``'s first ``nbytes`` once: ``threads`` threads, thread t reading requests t, t +
    threads, ... of ``size`` bytes (buffered: the file's cached pages dropped first)."""
    fd = os.open(path, os.O_RDONLY | (O_DIRECT if direct else 0))
    try:
        if not direct and hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        n = nbytes // size
        bufs = [_aligned(size) for _ in range(threads)]
        start = threading.Barrier(threads + 1)
        errors: list[BaseException] = []

        def work(t: int) -> None:
            start.wait()
            try:
                for i in range(t, n, threads):
                    got = os.preadv(fd, [bufs[t]], i * size)
                    if got != size:
                        raise OSError(errno.EIO, f"short read: {got} of {size} bytes at {i * size} of {path}")
            except BaseException as exc:   # noqa: BLE001 (reported by the caller)
                errors.append(exc)

        pool = [threading.Thread(target=work, args=(t,), daemon=True) for t in range(threads)]
        for th in pool:
            th.start()
        start.wait()
        t0 = time.perf_counter()
        for th in pool:
            th.join()
        elapsed = time.perf_counter() - t0
        for b in bufs:
            b.close()
        if errors:
            raise errors[0]
        return elapsed
    finally:
        os.close(fd)


def disk_probe(directory: str, nbytes: int, threads: list[int], sizes: list[int]) -> dict:
    """The disk's read bandwidth under ``directory``: a probe file of about ``nbytes`` read whole for every
    (threads, request size); returns {"direct", "bytes", "runs": [(threads, size, GB/s)], "best": (threads, size,
    GB/s)}. The probe file is removed."""
    sizes = sorted({max(4096, ceil_div(s, 4096) * 4096) for s in sizes})
    unit = max(_CHUNK, max(sizes))
    unit = ceil_div(unit, min(sizes)) * min(sizes)
    nbytes = max(unit, ceil_div(nbytes, unit) * unit)
    fd, path = tempfile.mkstemp(prefix="hss-disk-", suffix=".bin", dir=directory)
    os.close(fd)
    try:
        direct = _write_probe(path, nbytes)
        runs = []
        for t in sorted(set(threads)):
            for size in sizes:
                secs = _read_probe(path, nbytes, t, size, direct)
                runs.append((t, size, (nbytes // size * size) / secs / 1e9))
    finally:
        os.unlink(path)
    return dict(direct=direct, bytes=nbytes, runs=runs, best=max(runs, key=lambda r: r[2]))


def _disk_row(args: argparse.Namespace, directory: str, pages: int, nkv: int, bs: int, hd: int, row: Any) -> dict:
    """The disk probe under ``directory`` over a file the size of the layer file (at most 1 GiB), as a row."""
    from hss.swap import GroupLayout
    layer_bytes = GroupLayout(pages, nkv, bs, hd).bytes_per_layer
    disk = disk_probe(directory, min(layer_bytes, 1 << 30), [int(t) for t in args.disk_threads.split(",")],
                      [_size(x) for x in args.disk_sizes.split(",")])
    t, size, gbs = disk["best"]
    how = "O_DIRECT" if disk["direct"] else "buffered, cached pages dropped (O_DIRECT refused)"
    sweep = ", ".join(f"{th}x{_mib(sz)} {g:.2f}" for th, sz, g in disk["runs"])
    return dict(row(f"disk read ({how}), best of threads x request size", disk["bytes"] / gbs / 1e3, gbs,
                    f"best {t} threads x {_mib(size)}; GB/s by threads x size: {sweep}"), disk=disk)


def _mib(n: int) -> str:
    return f"{n / 2**20:g} MiB" if n >= 1 << 20 else f"{n // 1024} KiB"


def _one_length(args: argparse.Namespace, ctx: Any, tokens: int) -> list[dict]:
    import ml_dtypes

    from hss import cuda_min as cm
    from hss.attention import TiledAttention, TiledAttentionDims
    from hss.bench._timer import gpu_us

    nq, nkv, hd, bs = args.num_q_heads, args.num_kv_heads, args.head_dim, args.block_size
    pages = ceil_div(tokens, bs)
    stream = ctx.stream
    rng = np.random.default_rng(tokens)
    k = _data(rng, (pages, bs, nkv, hd), 1.0 / np.sqrt(hd))
    v = _data(rng, (pages, bs, nkv, hd), 1.0)
    q = _data(rng, (1, nq, hd), 1.0)
    kv_bytes = k.nbytes + v.nbytes
    label = f"{pages * bs // 1024}K" if pages * bs >= 1024 else str(pages * bs)

    def row(variant: str, us: float, gbs: float, note: str) -> dict:
        return dict(tokens=label, variant=variant, us=us, **{"GB/s": gbs}, note=note)

    owned: list[Any] = []

    def keep(obj: Any) -> Any:
        owned.append(obj)
        return obj

    def dev(arr: np.ndarray) -> Any:
        buf = keep(cm.DeviceBuffer(max(arr.nbytes, 1)))
        cm.copy_h_to_d_async(buf, arr, arr.nbytes, stream)
        return buf

    rows: list[dict] = []
    try:
        k_dev, v_dev, q_dev = dev(k), dev(v), dev(q)
        # bandwidths: pinned H2D, device copy (read + write)
        h2d_bytes = min(kv_bytes, 256 << 20)
        pinned = keep(cm.PinnedBuffer(h2d_bytes))
        pinned.array[:] = 1
        h2d_dst = keep(cm.DeviceBuffer(h2d_bytes))
        us = gpu_us(stream, lambda: cm.copy_h_to_d_async(h2d_dst, pinned, h2d_bytes, stream), batch=args.iters,
                    warmup=args.warmup).us
        h2d_bw = h2d_bytes / us / 1e3
        rows.append(row(f"pinned H2D ({h2d_bytes / 2**20:.3g} MiB)", us, h2d_bw, "measured for the floor"))
        k_copy, v_copy = (keep(cm.DeviceBuffer(k.nbytes)) for _ in range(2))

        def copy() -> None:
            cm.copy_d_to_d_async(k_copy, k_dev, k.nbytes, stream)
            cm.copy_d_to_d_async(v_copy, v_dev, v.nbytes, stream)
        us = gpu_us(stream, copy, batch=args.iters, warmup=args.warmup).us
        copy_bw = 2 * kv_bytes / us / 1e3
        rows.append(row("device copy of K+V", us, copy_bw, "bandwidth = bytes read + written"))
        # in-HBM tiled attention, one tile in token order
        ta = keep(TiledAttention(ctx, TiledAttentionDims(1, nq, nkv, hd, bs, pages)))
        table, count = dev(np.arange(pages, dtype=np.int32)[None]), dev(np.array([pages], np.int32))
        hbm_out = dev(np.zeros((1, nq, hd), dtype=ml_dtypes.bfloat16))

        def attend() -> None:
            ta.begin_step(stream, 1)
            ta.step_tile(stream, q_dev, k_dev, v_dev, table, count, 1, *ta.paged_strides(), bs, output=hbm_out)
        us = gpu_us(stream, attend, batch=args.iters, warmup=args.warmup).us
        frac = kv_bytes / us / 1e3 / copy_bw
        rows.append(dict(row("in-HBM tiled attention (1 tile)", us, kv_bytes / us / 1e3,
                             f"{frac:.2f} x copy bandwidth"), attn_fraction=frac))
        tiled = np.empty((1, nq, hd), dtype=ml_dtypes.bfloat16)
        cm.copy_d_to_h_async(tiled, hbm_out, tiled.nbytes, stream)
        cm.stream_sync(stream)
        for r in _sdpa_rows(args, stream, q, k, v, tiled, kv_bytes):
            rows.append(row(r["variant"], r["us"], r["GB/s"], r["check"]))
        step = functools.partial(_swap_step, args, ctx, k=k, v=v, k_dev=k_dev, v_dev=v_dev, q_dev=q_dev,
                                 kv_bytes=kv_bytes, h2d_bw=h2d_bw, copy_bw=copy_bw, row=row)
        host = step(store="host", sparse=args.budget > 0)
        rows += [host, *host.pop("sparse_rows", []), *host.pop("gather_rows", [])]
        with tempfile.TemporaryDirectory(prefix="hss-swap-", dir=args.dir) as tmp:
            disk_row = _disk_row(args, tmp, pages, nkv, bs, hd, row)
            rows += [disk_row, step(store="file", directory=tmp, disk=disk_row["disk"])]
    finally:
        cm.stream_sync(stream)
        for obj in reversed(owned):
            obj.close()
    return rows


def _sdpa_rows(args: argparse.Namespace, stream: int, q: np.ndarray, k: np.ndarray, v: np.ndarray,
               tiled: np.ndarray, kv_bytes: int) -> list[dict]:
    """PyTorch SDPA decode over the same K/V in token order, on ``stream`` (one row; a note without torch / CUDA)."""
    if args.no_torch:
        return []
    name = "torch SDPA decode (enable_gqa)"
    try:
        import torch
        import torch.nn.functional as F
    except ImportError:
        return [dict(variant=name, us=float("nan"), **{"GB/s": float("nan")}, check="skipped: PyTorch not installed")]
    if not torch.cuda.is_available():
        return [dict(variant=name, us=float("nan"), **{"GB/s": float("nan")}, check="skipped: torch sees no CUDA")]
    from hss.bench._timer import gpu_us
    pages, bs, nkv, hd = k.shape
    nq = q.shape[1]

    def tensor(a: np.ndarray) -> Any:
        return torch.from_numpy(np.ascontiguousarray(a).view(np.int16)).view(torch.bfloat16).cuda()

    kt = tensor(k.reshape(1, pages * bs, nkv, hd).transpose(0, 2, 1, 3))
    vt = tensor(v.reshape(1, pages * bs, nkv, hd).transpose(0, 2, 1, 3))
    qt = tensor(q.reshape(1, nq, 1, hd))
    torch.cuda.synchronize()
    with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
        def sdpa() -> Any:
            return F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)
        res = sdpa()
        us = gpu_us(stream, sdpa, batch=args.iters, warmup=args.warmup).us
    torch.cuda.synchronize()
    got = res.float().cpu().numpy().reshape(-1)
    ref = tiled.astype(np.float32).reshape(-1)
    cos = float(got @ ref / (np.linalg.norm(got) * np.linalg.norm(ref) or 1.0))
    return [dict(variant=name, us=us, **{"GB/s": kv_bytes / us / 1e3}, check=f"cosine vs hss tiled {cos:.6f}")]


def _swap_step(args: argparse.Namespace, ctx: Any, *, store: str, k: np.ndarray, v: np.ndarray, k_dev: Any,
               v_dev: Any, q_dev: Any, kv_bytes: int, h2d_bw: float, copy_bw: float, row: Any,
               directory: str | None = None, disk: dict | None = None, sparse: bool = False) -> dict:
    """Offload every page, settle the resident set, time ``args.iters`` steps, replay the last schedule. A FileStore
    (``directory``) reads with ``disk``'s best threads and request size (unless --qd / --run-cap) and its floor also
    counts the bytes read at ``disk``'s best bandwidth. ``sparse``: then the sparse mode's rows (:func:`_sparse_rows`)
    under the row's ``sparse_rows``."""
    from hss import cuda_min as cm
    from hss.bench._timer import Case, host_us
    from hss.swap import HighSpeedSwap, HighSpeedSwapConfig, ModelDims

    pages, bs, nkv, hd = k.shape
    nq = args.num_q_heads
    stream = ctx.stream
    tile = max(1, min(args.tile, pages // 2))
    resident = max(0, int(round(args.resident * pages)))
    best = disk["best"] if disk else (8, 1 << 20, 0.0)
    qd = min(64, args.qd if args.qd is not None else best[0])
    run_cap = _size(args.run_cap) if args.run_cap is not None else best[1]
    cfg = HighSpeedSwapConfig(directory or tempfile.gettempdir(), 1 << 62, resident + 2 * tile, 32, qd, False,
                              0xCAFE_F00D, store=store, stream_tile_blocks=tile, run_cap_bytes=run_cap)
    h = HighSpeedSwap(ctx, cfg, ModelDims(1, pages, nq, nkv, hd, bs))
    if store == "host" and args.gather_min_runs is not None:
        h.store.gather_min_runs = h.sparse_gather_min_runs = args.gather_min_runs
    out = cm.DeviceBuffer(2 * nq * hd)
    try:
        page_bytes = bs * nkv * hd * 2
        for b in range(pages):
            assert h.alloc_disk_block() == b
            h.offload_block(ctx, 0, b, k_dev.ptr + b * page_bytes, k[b], v[b])
        ids = np.arange(pages, dtype=np.int64)
        for _ in range(max(args.warmup, 2)):              # cold step, then a settled resident set
            h.attend_layer(ctx, 0, ids, q_dev, out)
        cm.stream_sync(stream)
        before = h.diagnostic_summary()
        records = []
        step = Case(lambda: records.append(h.attend_layer(ctx, 0, ids, q_dev, out)), lambda: cm.stream_sync(stream))
        us = host_us({"step": step}, batch=args.iters, batches=1, warmup=0, timed_sync=True)["step"].us
        rec = records[-1]
        after = h.diagnostic_summary()
        n = args.iters
        misses = (after.misses - before.misses) / n
        read = (after.bytes_read - before.bytes_read) / n
        floors = {"H2D": read / h2d_bw / 1e3, "device copy": kv_bytes / copy_bw / 1e3}
        if disk:
            floors["disk"] = read / disk["best"][2] / 1e3
        bound = max(floors, key=floors.__getitem__)
        floor_us = floors[bound]
        same = _replay_matches(ctx, h, rec, k_dev, v_dev, q_dev, out)
        kind = after.store
        config = f", {qd} threads x {_mib(run_cap)} reads" if store == "file" else ""
        note = (f"hit rate {(after.hits - before.hits) / n / pages:.3f}, {misses:.0f} pages / {read / 2**20:.1f} MiB "
                f"read{config}, stall {(after.read_stall_ms - before.read_stall_ms) / n * 1e3:.0f} us, host reads "
                f"{(after.host_read_ms - before.host_read_ms) / n * 1e3:.0f} us, floor {floor_us:.0f} us ({bound}; "
                + ", ".join(f"{k} {v:.0f}" for k, v in floors.items() if k != bound)
                + f") = {us / floor_us:.2f}x, replay {'bitwise equal' if same else 'DIFFERS'}")
        result = dict(row(f"HighSpeedSwap step, {kind} store, {resident} resident + 2 x {tile} streamed", us,
                          kv_bytes / us / 1e3, note), store=store, floor_us=floor_us, floor_bound=bound,
                      replay_equal=same)
        if sparse:
            result["sparse_rows"] = _sparse_rows(args, ctx, h, ids, k_dev, v_dev, q_dev, out, us, row)
        if store == "host":
            result["gather_rows"] = _gather_rows(args, ctx, h, row)
        return result
    finally:
        out.close()
        h.close()


def _gather_rows(args: argparse.Namespace, ctx: Any, h: Any, row: Any) -> list[dict]:
    """The HostStore of ``h`` (every page written) reading one tile of every other page of layer 0 into the stream
    buffer slots, planned once: as one page_gather launch and as one batched DMA call. Device µs per group (events
    around ``args.iters`` groups) and host µs per group (the issue alone, then a sync)."""
    from hss import cuda_min as cm
    from hss.bench._timer import Case, gpu_us, host_us
    store, pool, stream = h.store, h.pool, ctx.stream
    n = max(1, min(h.tile_blocks, h.model.max_blocks_per_layer // 2))
    pages = np.arange(0, 2 * n, 2, dtype=np.int64)
    slots = h.resident_capacity + np.arange(n, dtype=np.int64)
    bb = store.layout.block_bytes
    rows, saved = [], store.gather_min_runs
    try:
        for name, min_runs in (("one page_gather launch", 0), ("one batched DMA call", 1 << 30)):
            store.gather_min_runs = min_runs
            reads = store._plan_reads(0, pages, pool.ptr + bb * slots, np.array([0, n]), [0, n],
                                      (pool._slot_ptrs, slots))
            issue = functools.partial(reads.issue, 0, stream)
            dev = gpu_us(stream, issue, batch=args.iters, warmup=args.warmup).us
            host = host_us({"issue": Case(issue, lambda: cm.stream_sync(stream))}, batch=args.iters, batches=3,
                           warmup=args.warmup)["issue"].us
            rows.append(row(f"HostStore read of {n} scattered pages into pool slots ({name})", dev, n * bb / dev / 1e3,
                            f"{_mib(n * bb)} a group; host {host:.1f} us per group"))
    finally:
        store.gather_min_runs = saved
        cm.stream_sync(stream)
    return rows


def _sparse_rows(args: argparse.Namespace, ctx: Any, h: Any, ids: np.ndarray, k_dev: Any, v_dev: Any, q_dev: Any,
                 out: Any, exact_us: float, row: Any) -> list[dict]:
    """The sparse mode on ``h`` (its exact steps done, ``out`` holding the exact output for ``q_dev``): per query mode
    (the exact step's query every step; a new one each step) 2 untimed steps, then ``args.sparse_steps`` timed ones
    (host wall time, sync included)."""
    import ml_dtypes

    from hss import cuda_min as cm
    from hss.bench._timer import Case, host_us, rotating
    d, stream = h.model, ctx.stream
    pages = int(ids.size)
    budget = dict(budget_pages=int(round(args.budget * pages)), keep_first=args.keep_first,
                  keep_recent=args.keep_recent)
    n = max(1, args.sparse_steps)
    rng = np.random.default_rng(pages + 1)
    queries = [cm.DeviceBuffer(2 * d.num_q_heads * d.head_dim) for _ in range(n + 2)]
    mine = cm.DeviceBuffer(2 * d.num_q_heads * d.head_dim)
    exact = np.empty((d.num_q_heads, d.head_dim), ml_dtypes.bfloat16)
    cm.copy_d_to_h_async(exact, out, exact.nbytes, stream)
    rows = []
    try:
        for buf in queries:
            q = _data(rng, (1, d.num_q_heads, d.head_dim), 1.0)
            cm.copy_h_to_d_async(buf, q, q.nbytes, stream)
        cm.stream_sync(stream)
        for mode in ("same query", "new query"):
            query = (lambda i: q_dev) if mode == "same query" else (lambda i: queries[i % len(queries)])
            records = []

            def step(i: int) -> None:
                records.append(h.attend_layer(ctx, 0, ids, query(i), mine, **budget))
            for i in range(2):
                step(i)
            cm.stream_sync(stream)
            before, prof0 = h.diagnostic_summary(), h.host_profile()
            us = host_us({"step": Case(rotating(step, 2), lambda: cm.stream_sync(stream))}, batch=n, batches=1,
                         warmup=0, timed_sync=True)["step"].us
            after, prof1 = h.diagnostic_summary(), h.host_profile()
            rec = records[-1]
            parts = {k: (prof1[k] - prof0[k]) / n * 1e6 for k in prof1}
            census = _driver_census(rotating(step, n + 2), lambda: cm.stream_sync(stream), min(n, 8))
            last_q = query(n + 1)
            h.attend_layer(ctx, 0, ids, last_q, out)                  # the exact step of the last query
            got, want = (np.empty((d.num_q_heads, d.head_dim), ml_dtypes.bfloat16) for _ in range(2))
            cm.copy_d_to_h_async(got, mine, got.nbytes, stream)
            cm.copy_d_to_h_async(want, out, want.nbytes, stream)
            cm.stream_sync(stream)
            g, w = got.astype(np.float64), want.astype(np.float64)
            err = float(np.linalg.norm(g - w) / (np.linalg.norm(w) or 1.0))
            h.attend_layer(ctx, 0, ids, last_q, mine, **budget)       # the sparse step again: replay it in HBM
            same = _replay_matches(ctx, h, h.last_step, k_dev, v_dev, last_q, mine)
            hits, misses = after.hits - before.hits, after.misses - before.misses
            read = (after.bytes_read - before.bytes_read) / n
            attended = (hits + misses) / n
            rate = hits / (hits + misses) if hits + misses else 0.0
            host = sum(v for k, v in parts.items() if k != "sparse_wait")
            note = (f"{exact_us and us / exact_us:.3f}x the exact HostStore step; hit rate {rate:.3f}; "
                    f"{attended:.0f} of {pages} pages attended, {misses / n:.0f} read ({read / 2**20:.1f} MiB); last "
                    f"step vs the exact step: rel. L2 {err:.3g}; replay {'bitwise equal' if same else 'DIFFERS'}; "
                    f"host us/step {host:.0f} besides the score wait ({parts['sparse_wait']:.0f}): "
                    + ", ".join(f"{k} {v:.0f}" for k, v in parts.items() if k != "sparse_wait")
                    + f"; {census['calls']:.1f} driver calls/step ({census['driver_us']:.0f} us in them: "
                    + ", ".join(f"{k} {v:g}" for k, v in census["by_name"].items()) + ")")
            rows.append(dict(row(f"sparse step ({mode}), budget {budget['budget_pages']} + first "
                                 f"{args.keep_first} / recent {args.keep_recent}", us, read / us / 1e3, note),
                             sparse=mode, ratio=us / exact_us if exact_us else float("nan"), hit_rate=rate,
                             replay_equal=same, skipped=len(rec.skipped), host_parts_us=parts, driver=census))
        return rows
    finally:
        cm.stream_sync(stream)
        for buf in [*queries, mine]:
            buf.close()


def _driver_census(step: Any, sync: Any, n: int) -> dict:
    """``n`` untimed calls of ``step`` (then ``sync``, not counted) with every driver call counted and timed at the
    driver seam: {"calls": per step, "driver_us": host µs inside them per step, "by_name": {name: per step}}."""
    from hss.cuda import _driver
    seen: dict[str, int] = {}
    inside = [0.0]
    module = _driver.api._module
    names = [name for name in dir(module) if name.startswith("cu") and callable(getattr(module, name))]
    saved = {name: getattr(_driver.api, name) for name in names}

    def wrap(name: str, real: Any) -> Any:
        def call(*a: Any, **kw: Any) -> Any:
            t = time.perf_counter()
            try:
                return real(*a, **kw)
            finally:
                inside[0] += time.perf_counter() - t
                seen[name] = seen.get(name, 0) + 1
        return call

    spent = 0.0
    try:
        for name, real in saved.items():
            setattr(_driver.api, name, wrap(name, real))
        for _ in range(n):
            at = inside[0]
            step()
            spent += inside[0] - at
            seen_before = dict(seen)
            sync()
            seen.clear()
            seen.update(seen_before)
    finally:
        for name, real in saved.items():
            setattr(_driver.api, name, real)
    by_name = {k: v / n for k, v in sorted(seen.items(), key=lambda kv: -kv[1])}
    return dict(calls=sum(seen.values()) / n, driver_us=spent / n * 1e6, by_name=by_name)


def _replay_matches(ctx: Any, h: Any, rec: Any, k_dev: Any, v_dev: Any, q_dev: Any, out: Any) -> bool:
    """The recorded tiles (block id = pool page) replayed with in-HBM tiled attention: same bits as ``out``?"""
    from hss import cuda_min as cm
    from hss.attention import TiledAttention, TiledAttentionDims
    d, stream = h.model, ctx.stream
    cap = max([len(t.block_ids) for t in rec.tiles] + [1])
    nt = max(len(rec.tiles), 1)
    tables = np.zeros((nt, cap), np.int32)
    for i, t in enumerate(rec.tiles):
        tables[i, :len(t.block_ids)] = t.block_ids
    counts = np.array([len(t.block_ids) for t in rec.tiles] or [0], np.int32)
    tab, cnt = cm.DeviceBuffer(tables.nbytes), cm.DeviceBuffer(counts.nbytes)
    mine = cm.DeviceBuffer(2 * d.num_q_heads * d.head_dim)
    cm.copy_h_to_d_async(tab, tables, tables.nbytes, stream)
    cm.copy_h_to_d_async(cnt, counts, counts.nbytes, stream)
    with TiledAttention(ctx, TiledAttentionDims(1, d.num_q_heads, d.num_kv_heads, d.head_dim, d.block_size,
                                                cap)) as ta:
        ta.begin_step(stream, 1)
        for i, t in enumerate(rec.tiles):
            ta.step_tile(stream, q_dev, k_dev, v_dev, tab.ptr + 4 * i * cap, cnt.ptr + 4 * i, 1, *ta.paged_strides(),
                         t.last_block_valid_slots)
        ta.finalize(stream, mine, 1)
        a, b = np.empty(mine.bytes, np.uint8), np.empty(mine.bytes, np.uint8)
        cm.copy_d_to_h_async(a, mine, mine.bytes, stream)
        cm.copy_d_to_h_async(b, out, mine.bytes, stream)
        cm.stream_sync(stream)
    for buf in (tab, cnt, mine):
        buf.close()
    return bool(np.array_equal(a, b))


def table(rows: list[dict]) -> str:
    if rows and rows[0].get("tp"):
        from hss.bench import _swap_tp
        return _swap_tp.table(rows)
    device = [r for r in rows if r.get("part") == "device step"]
    rows = [r for r in rows if r.get("part") != "device step"]
    lines = ["| tokens | variant | µs | GB/s | note |", "|---|---|---:|---:|---|"]
    for r in rows:
        lines.append(f"| {r['tokens']} | {r['variant']} | {r['us']:.1f} | {r['GB/s']:.1f} | {r['note']} |")
    lines.append("")
    attn = [r for r in rows if "attn_fraction" in r and r["tokens"] == "32K"]
    if attn:
        f = attn[0]["attn_fraction"]
        lines.append(f"- target: in-HBM tiled attention >= {TARGET_ATTN:.0%} of copy bandwidth at 32K: {f:.1%} -> "
                     f"{'met' if f >= TARGET_ATTN else 'not met'}")
    else:
        lines.append(f"- target: in-HBM tiled attention >= {TARGET_ATTN:.0%} of copy bandwidth at 32K: not measured "
                     "(no 32K run)")
    for r in rows:
        if r.get("store") in ("host", "file"):
            x = r["us"] / r["floor_us"]
            name = "HostStore" if r["store"] == "host" else "FileStore"
            lines.append(f"- target: {name} step within {TARGET_FLOOR}x of its floor ({r['floor_bound']}) at "
                         f"{r['tokens']}: {x:.2f}x -> {'met' if x <= TARGET_FLOOR else 'not met'}")
    for r in rows:
        if r.get("sparse") == "new query":
            x = r["ratio"]
            lines.append(f"- target: sparse step (budget {args_budget(r)}, a new query each step) within "
                         f"{TARGET_SPARSE}x of the exact HostStore step at {r['tokens']}: {x:.3f}x -> "
                         f"{'met' if x <= TARGET_SPARSE else 'not met'}" + ("" if r["tokens"] == "32K" else
                                                                            " (the target is set at 32K)"))
    if any(r.get("replay_equal") is False for r in rows):
        lines.append("- CHECK FAILED: a streamed step differs from its in-HBM replay")
    if device:
        from hss.bench import sparse_step
        lines += ["", "The device sparse step (hss.bench.sparse_step, same swap settings):", "",
                  sparse_step.table([{k: v for k, v in r.items() if k != "part"} for r in device])]
    return "\n".join(lines)


def args_budget(r: dict) -> str:
    """The budget words of a sparse row's variant ('budget K + first F / recent R')."""
    return r["variant"].split("budget ", 1)[1]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rows = run(args)
    from hss.cuda_min import driver_status
    print(f"driver: {driver_status().message}")
    print(f"one layer, {args.num_q_heads} q / {args.num_kv_heads} kv heads, head_dim {args.head_dim}, block_size "
          f"{args.block_size}, bf16; resident set {args.resident:.3g} of the pages; mean of {args.iters} steps")
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
