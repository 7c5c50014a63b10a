"""``python -m hss info``: what this machine offers hss, checked end to end."""
from __future__ import annotations

import argparse
import sys

import numpy as np


def info() -> int:
    """Print driver, device, PTX and a smoke launch; return non-zero if anything is broken."""
    from hss import cuda_min as cm
    from hss import ptx
    from hss._driver import driver_status
    from hss.kernels.selftest import SELFTEST_AXPY
    from hss.reference import selftest as ref

    ok = True
    status = driver_status()
    where = "GPU" if status.kind == "cuda" else "CPU emulator (no GPU: kernels run as numpy references)"
    print(f"driver      : {status.kind}: {status.message}")
    isas = {ptx.min_driver(ptx.ptx_path(m).read_text()) for m in ptx.MODULES if ptx.ptx_path(m).is_file()}
    for isa, drv in sorted(isas):
        print(f"shipped PTX : ISA {isa[0]}.{isa[1]}, needs driver >= {drv}")
    try:
        ctx = cm.CudaCtx(0)
    except Exception as exc:
        print(f"device      : unavailable: {exc}")
        return 1
    major, minor = ctx.compute_capability
    free, total = cm.mem_info()
    print(f"device      : {ctx.name} (compute capability {major}.{minor}) on the {where}")
    print(f"memory      : {free / 2**30:.1f} GiB free of {total / 2**30:.1f} GiB")
    for name in sorted(ptx.MODULES):
        for variant, _ in ptx.targets(name):
            state = ptx.freshness(name, variant)
            ok &= state == "fresh"
            print(f"ptx         : {ptx.ptx_path(name, variant).name:34s} {state}")
        base = ptx.spec(name).base_arch
        if base != ptx.DEFAULT_ARCH and not ptx.variant_supported(base, (major, minor)):
            print(f"load        : {name:34s} not for this device (built for {base} only)")
            continue
        try:
            variant, _ = ptx.choose(name, (major, minor))
            ptx.load_module(name, ctx).close()
            print(f"load        : {name:34s} loaded{f' (serving {variant})' if variant else ''}")
        except Exception as exc:
            ok = False
            print(f"load        : {name:34s} FAILED: {exc}")
    ok &= _smoke(ctx, cm, ptx, SELFTEST_AXPY, ref, where)
    ctx.close()
    print("status      : ok" if ok else "status      : PROBLEMS (see above)")
    return 0 if ok else 1


def _smoke(ctx, cm, ptx, decl, ref, where: str) -> bool:
    n = 1000
    rng = np.random.default_rng()
    x, y = rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)
    try:
        mod = ptx.load_module("selftest", ctx)
        s = ctx.stream
        with cm.DeviceBuffer(4 * n) as dx, cm.DeviceBuffer(4 * n) as dy, cm.DeviceBuffer(4 * n) as out, \
                cm.DeviceBuffer(8 * n) as idx:
            cm.copy_h_to_d_async(dx, x, 4 * n, s)
            cm.copy_h_to_d_async(dy, y, 4 * n, s)
            cm.memset_d8_async(out, 0xFF, 4 * n, s)
            cm.launch_kernel(mod.function("selftest_axpy"), 4, 256, 0, s, decl.pack(out, idx, dx, dy, 2.0, n, 3, 5))
            got = np.empty(n, np.float32)
            cm.copy_d_to_h_async(got, out, 4 * n, s)
            cm.stream_sync(s)
        mod.close()
        want, _ = ref.axpy(x, y, 2.0, n, 3, 5)
        err = float(np.max(np.abs(got - want)))
        good = err <= 1e-4 * float(np.max(np.abs(want)))
        print(f"smoke launch: selftest_axpy on the {where}: max error {err:.2e} {'ok' if good else 'WRONG'}")
        return good
    except Exception as exc:
        print(f"smoke launch: FAILED: {exc}")
        return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hss", description="hss command line")
    sub = parser.add_subparsers(dest="command")
    sub.add_parser("info", help="driver, device, PTX freshness and loading, and a smoke launch")
    from hss import demo
    from hss.model import demo as model_demo
    demo_parser = sub.add_parser("demo", help="SmolLM2 decoded on the GPU with its KV history in HBM or behind the "
                                 "high-speed swap ('demo qsa': the synthetic QSA layer)",
                                 description=model_demo.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    demo.add_arguments(demo_parser)
    args = parser.parse_args(argv)
    if args.command in (None, "info"):
        return info()
    if args.command == "demo":
        return demo.run(args)
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
