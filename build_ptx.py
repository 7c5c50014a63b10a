#!/usr/bin/env python3
"""Build ``ptx/*.cu`` into the committed ``ptx/*.ptx`` with nvcc; check or verify what is committed.

    python build_ptx.py                 rebuild what changed (stamps decide), default arch compute_80
    python build_ptx.py --arch compute_90 [MODULE ...]   override the base virtual arch
    python build_ptx.py --force         rebuild everything
    python build_ptx.py --check         name each stale or missing .ptx and exit 1 (needs no nvcc)
    python build_ptx.py --verify sm_90  assemble each base PTX for sm_90 and each variant for its own arch

All flags and the module table live in ``hss/cuda/ptx.py``; outputs are written atomically and only when
their content changes.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from hss.cuda import ptx  # noqa: E402
from hss.errors import BuildError  # noqa: E402

NVCC_CANDIDATES = ("/usr/local/cuda/bin/nvcc", "/usr/local/cuda-13.0/bin/nvcc")


def find_tool(name: str) -> str:
    """Path of ``nvcc``/``ptxas``: the CUDA install first, then PATH; BuildError if absent."""
    for cand in (c.replace("nvcc", name) for c in NVCC_CANDIDATES):
        if os.access(cand, os.X_OK):
            return cand
    found = shutil.which(name)
    if not found:
        raise BuildError([name], f"{name} not found (looked in {', '.join(NVCC_CANDIDATES)} and PATH)")
    return found


def run(cmd: list[str]) -> str:
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as exc:
        raise BuildError(cmd, str(exc)) from None
    if proc.returncode:
        raise BuildError(cmd, proc.stderr or proc.stdout)
    return proc.stdout


def nvcc_version(nvcc: str) -> str:
    m = re.search(r"V(\d+\.\d+\.\d+)", run([nvcc, "--version"]))
    return m.group(1) if m else "unknown"


def write_atomic(path: Path, text: str) -> bool:
    """Write ``text`` to ``path`` via a temp file and os.replace; skip if unchanged. True if written."""
    if path.is_file() and path.read_text() == text:
        return False
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    return True


def build_one(name: str, variant: str | None, arch: str, nvcc: str, version: str, directory: Path,
              force: bool) -> str:
    out = ptx.ptx_path(name, variant, directory)
    stamp = ptx.read_stamp(out)
    if not force and stamp and stamp.get("hash") == ptx.source_hash(name, arch, directory):
        return "up to date"
    with tempfile.TemporaryDirectory() as tmp:
        tmp_out = Path(tmp) / out.name
        spec = ptx.spec(name)
        run([nvcc, *spec.flags(arch), str(directory / f"{spec.source_name}.cu"), "-o", str(tmp_out)])
        body = tmp_out.read_text()
    text = ptx.stamp_line(name, arch, version, directory) + "\n" + body
    return "built" if write_atomic(out, text) else "unchanged"


def build(modules: list[str], arch: str | None = None, force: bool = False, directory: Path | None = None) -> list[str]:
    """Build ``modules`` (all if empty); ``arch`` overrides the base arch. Returns report lines."""
    directory = directory or ptx.ptx_dir()
    nvcc = find_tool("nvcc")
    version = nvcc_version(nvcc)
    lines = []
    for name in modules or sorted(ptx.MODULES):
        for variant, default_arch in ptx.targets(name):
            base = default_arch if default_arch != ptx.DEFAULT_ARCH else arch or default_arch   # (a newer base stays)
            target = variant or base
            state = build_one(name, variant, target, nvcc, version, directory, force)
            lines.append(f"{ptx.ptx_path(name, variant, directory).name}: {state} ({target})")
    return lines


def check(directory: Path | None = None) -> list[str]:
    """Problems with the committed PTX: one line per stale or missing file (empty when all fresh)."""
    problems = []
    for name in sorted(ptx.MODULES):
        for variant, _ in ptx.targets(name):
            state = ptx.freshness(name, variant, directory)
            if state != "fresh":
                problems.append(f"{ptx.ptx_path(name, variant, directory)}: {state} "
                                f"(run `python build_ptx.py {name}`)")
    return problems


def verify(base_arch: str = "sm_90", directory: Path | None = None) -> list[str]:
    """Assemble every PTX with ptxas: the base for ``base_arch``, each variant for its own arch."""
    ptxas = find_tool("ptxas")
    lines = []
    for name in sorted(ptx.MODULES):
        for variant, arch in ptx.targets(name):
            path = ptx.ptx_path(name, variant, directory)
            target = variant or (arch if arch != ptx.DEFAULT_ARCH else base_arch)
            with tempfile.TemporaryDirectory() as tmp:
                run([ptxas, f"-arch={target}", str(path), "-o", str(Path(tmp) / "out.cubin")])
            lines.append(f"{path.name}: assembles for {target}")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("modules", nargs="*", help="modules to build (default: all)")
    p.add_argument("--arch", help=f"base virtual arch (default {ptx.DEFAULT_ARCH})")
    p.add_argument("--force", action="store_true", help="rebuild even when the stamp is fresh")
    p.add_argument("--check", action="store_true", help="report stale or missing PTX; exit 1 if any")
    p.add_argument("--verify", nargs="?", const="sm_90", metavar="ARCH",
                   help="assemble each PTX with ptxas (base for ARCH, default sm_90; variants for their own)")
    args = p.parse_args(argv)
    try:
        if args.check:
            problems = check()
            print("\n".join(problems) if problems else f"all {sum(len(ptx.targets(m)) for m in ptx.MODULES)} "
                  "PTX files are fresh")
            return 1 if problems else 0
        if args.verify:
            print("\n".join(verify(args.verify)))
            return 0
        unknown = [m for m in args.modules if m not in ptx.MODULES]
        if unknown:
            p.error(f"unknown module(s) {', '.join(unknown)}; known: {', '.join(sorted(ptx.MODULES))}")
        print("\n".join(build(args.modules, args.arch, args.force)))
        return 0
    except BuildError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
