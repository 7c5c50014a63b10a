"""Benchmark: tiled decode attention over a long context held in HBM, against PyTorch SDPA decode.

    python -m hss.bench.attention [--tokens 32768] [--tiles 1,8,64] [--iters 20]
    python -m hss.bench.attention --smoke      tiny sizes, no PyTorch (runs on the CPU emulator in CI)

One sequence, 32 q / 8 kv heads, head_dim 128, block_size 16, pages in a shuffled NHD pool. A tiled step
is begin_step + one step_tile per tile (the last one writing the output), timed with CUDA events on one
stream; SDPA (``torch.nn.functional.scaled_dot_product_attention`` on the same data, contiguous [1, heads, tokens, 128])
is timed the same way on the same stream. Effective bandwidth = K and V bytes / time. Every tiling's
output is compared with the single tile's (max abs; other tiles round differently) and the single tile's
with SDPA (max abs).
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import numpy as np

SMOKE = dict(tokens=64, num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16, tiles="1,2", iters=2, warmup=1)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=32768, help="context length (rounded up to whole pages)")
    p.add_argument("--num-q-heads", type=int, default=32)
    p.add_argument("--num-kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--tiles", default="1,8,64", help="comma-separated numbers of tiles to split the pages into")
    p.add_argument("--iters", type=int, default=20, help="timed repetitions per variant")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--no-torch", action="store_true", help="skip the PyTorch SDPA comparison")
    p.add_argument("--smoke", action="store_true", help="tiny sizes and no PyTorch: an import/launch check")
    args = p.parse_args(argv)
    if args.smoke:
        for key, value in SMOKE.items():
            setattr(args, key, value)
        args.no_torch = True
    return args


def run(args: argparse.Namespace) -> list[dict]:
    """Time every variant; one dict per row (variant, us, GB/s, check)."""
    if args.smoke:
        os.environ.setdefault("HSS_DRIVER", "emulator")
    import ml_dtypes

    from hss import cuda_min as cm
    from hss.attention import TiledAttention, TiledAttentionDims
    from hss.bench._timer import gpu_us

    nq, nkv, hd, bs = args.num_q_heads, args.num_kv_heads, args.head_dim, args.block_size
    pages = -(-args.tokens // bs)
    n_tok = pages * bs
    tile_counts = sorted({max(1, min(pages, int(t))) for t in args.tiles.split(",")})
    kv_bytes = 2 * n_tok * nkv * hd * 2
    rng = np.random.default_rng(0)
    bf16 = ml_dtypes.bfloat16
    k = (rng.standard_normal((pages, bs, nkv, hd), dtype=np.float32) / np.sqrt(hd)).astype(bf16)
    v = rng.standard_normal((pages, bs, nkv, hd), dtype=np.float32).astype(bf16)
    q = rng.standard_normal((1, nq, hd), dtype=np.float32).astype(bf16)
    order = rng.permutation(pages).astype(np.int32)     # logical page i lives in pool page order[i]

    ctx = cm.CudaCtx(0)
    stream = ctx.stream
    owned: list[Any] = []

    def dev(arr: np.ndarray) -> Any:
        buf = cm.DeviceBuffer(max(arr.nbytes, 1))
        cm.copy_h_to_d_async(buf, np.ascontiguousarray(arr), arr.nbytes, stream)
        owned.append(buf)
        return buf

    rows: list[dict] = []
    try:
        k_dev, v_dev, q_dev = dev(k), dev(v), dev(q)
        cap = -(-pages // tile_counts[0])
        ta = TiledAttention(ctx, TiledAttentionDims(1, nq, nkv, hd, bs, cap))
        owned.append(ta)
        strides = ta.paged_strides()
        outputs = {}
        for nt in tile_counts:
            per = -(-pages // nt)
            tiles = []
            for t in range(0, pages, per):
                ids = order[t:t + per]
                tiles.append((dev(np.pad(ids, (0, cap - ids.size))[None]), dev(np.array([ids.size], np.int32))))
            out = dev(np.zeros((1, nq, hd), dtype=bf16))

            def step(tiles: list = tiles, out: Any = out) -> None:
                ta.begin_step(stream, 1)
                for i, (blocks, count) in enumerate(tiles):   # the last tile writes the output (no finalize)
                    ta.step_tile(stream, q_dev, k_dev, v_dev, blocks, count, 1, *strides, bs,
                                 output=out if i == len(tiles) - 1 else None)

            us = gpu_us(stream, step, batch=args.iters, warmup=args.warmup).us
            got = np.empty((1, nq, hd), dtype=bf16)
            cm.copy_d_to_h_async(got, out, got.nbytes, stream)
            cm.stream_sync(stream)
            outputs[nt] = got
            diff = np.abs(got.astype(np.float32) - outputs[tile_counts[0]].astype(np.float32)).max()
            rows.append(dict(variant=f"hss tiled, {len(tiles)} tile(s) of <= {per} pages", us=us,
                             **{"GB/s": kv_bytes / us / 1e3}, check=f"max abs vs first row {diff:.1e}"))
        rows += _sdpa(args, stream, q, k, v, order, outputs[tile_counts[0]], kv_bytes)
    finally:
        for obj in reversed(owned):
            obj.close()
        ctx.close()
    return rows


def _sdpa(args: argparse.Namespace, stream: int, q: np.ndarray, k: np.ndarray, v: np.ndarray, order: np.ndarray,
          tiled: np.ndarray, kv_bytes: int) -> list[dict]:
    """PyTorch SDPA decode on the same data and stream (skipped with a note when torch is absent)."""
    if args.no_torch:
        return []
    try:
        import torch
        import torch.nn.functional as F
    except ImportError:
        return [dict(variant="torch SDPA: skipped (PyTorch is not installed)", us=float("nan"),
                     **{"GB/s": float("nan")}, check="-")]
    from hss.bench._timer import gpu_us
    nq, nkv, hd = q.shape[1], k.shape[2], k.shape[3]
    bf = torch.bfloat16

    def tensor(a: np.ndarray) -> Any:
        return torch.from_numpy(np.ascontiguousarray(a).view(np.int16)).view(bf).cuda()

    # logical token order, [1, heads, tokens, hd] as SDPA wants it
    kt = tensor(k[order].reshape(-1, nkv, hd).transpose(1, 0, 2)[None])
    vt = tensor(v[order].reshape(-1, nkv, hd).transpose(1, 0, 2)[None])
    qt = tensor(q.reshape(1, nq, 1, hd))
    torch.cuda.synchronize()
    ext = torch.cuda.ExternalStream(stream)
    rows = []
    with torch.cuda.stream(ext):
        try:
            def sdpa() -> Any:
                return F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)
            out = sdpa()
            label = "torch SDPA (enable_gqa)"
        except TypeError:   # torch < 2.5: expand the kv heads first (not timed)
            kt, vt = kt.repeat_interleave(nq // nkv, 1), vt.repeat_interleave(nq // nkv, 1)

            def sdpa() -> Any:
                return F.scaled_dot_product_attention(qt, kt, vt)
            out = sdpa()
            label = "torch SDPA (kv heads expanded)"
        us = gpu_us(stream, sdpa, batch=args.iters, warmup=args.warmup).us
        got = out.float().reshape(1, nq, hd).cpu().numpy()
    diff = float(np.abs(got - tiled.astype(np.float32)).max())
    rows.append(dict(variant=f"{label}, torch {torch.__version__}", us=us, **{"GB/s": kv_bytes / us / 1e3},
                     check=f"max |tiled - sdpa| = {diff:.2e}"))
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| variant | µs | GB/s (K+V bytes / time) | check |", "|---|---:|---:|---|"]
    for r in rows:
        lines.append(f"| {r['variant']} | {r['us']:.1f} | {r['GB/s']:.1f} | {r['check']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rows = run(args)
    from hss.cuda_min import driver_status
    pages = -(-args.tokens // args.block_size)
    print(f"driver: {driver_status().message}")
    print(f"{pages * args.block_size} tokens ({pages} pages of {args.block_size}), {args.num_q_heads} q / "
          f"{args.num_kv_heads} kv heads, head_dim {args.head_dim}, bf16; mean of {args.iters} steps")
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
