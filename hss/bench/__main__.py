"""``python -m hss.bench [SUITE ...] [--smoke] [--json FILE]``: device benchmarks, tables printed last;
``python -m hss.bench SUITE [its options]`` passes the options to that one suite.

Suites: launch, overhead, predictor, attention, qsa, qsa_prefill, swap (each a module of this package with
``run(args)`` and ``table(rows)``; all time through :mod:`hss.bench._timer`). ``--smoke`` runs tiny sizes (also on
the emulator) to check the code paths only: its numbers mean nothing.
"""
from __future__ import annotations

import argparse
import datetime
import importlib
import json
import pkgutil
import sys

import hss.bench

ORDER = ("launch", "overhead", "predictor", "attention", "qsa", "qsa_prefill", "qsa_device", "swap", "recall")
_found = {m.name for m in pkgutil.iter_modules(hss.bench.__path__) if not m.name.startswith("_")}
SUITES = tuple(sorted(_found, key=lambda n: (ORDER.index(n) if n in ORDER else len(ORDER), n)))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m hss.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("suites", nargs="*", help=f"which suites (default: all of {', '.join(SUITES)})")
    p.add_argument("--smoke", action="store_true", help="tiny sizes, any driver: checks code paths only")
    p.add_argument("--json", help="also write all rows to this JSON file")
    args, extra = p.parse_known_args(argv)
    if extra and len(args.suites) != 1:
        p.error(f"options {' '.join(extra)} belong to one suite: name exactly one (python -m hss.bench SUITE ...)")
    from hss import cuda_min as cm
    status = cm.driver_status()
    with cm.CudaCtx(0) as ctx:
        device = ctx.name
    stamp = datetime.date.today().isoformat()
    smoke = " -- SMOKE: numbers are meaningless" if args.smoke else ""
    print(f"hss bench {stamp} on {device} ({status.kind}){smoke}")
    results = {}
    for suite in args.suites or SUITES:
        if suite not in SUITES:
            p.error(f"unknown suite {suite}; choose from {', '.join(SUITES)}")
    for suite in args.suites or SUITES:
        mod = importlib.import_module(f"hss.bench.{suite}")
        if extra and not hasattr(mod, "parse_args"):
            p.error(f"suite {suite} takes no options (got {' '.join(extra)})")
        # a suite with its own options runs with their defaults (python -m hss.bench.SUITE --help lists them)
        # (options after one named suite go to it: python -m hss.bench swap --tp 2)
        suite_args = mod.parse_args((["--smoke"] if args.smoke else []) + extra) if hasattr(mod, "parse_args") \
            else args
        results[suite] = rows = mod.run(suite_args)
        # each table as soon as its suite ends, so a run stopped by a time limit keeps what it measured
        print(f"\n### {suite} ({stamp}, {device})\n\n{mod.table(rows)}", flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"date": stamp, "device": device, "driver": status.kind, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
