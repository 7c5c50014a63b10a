"""The PTX table: which modules hss ships, how each is built, its stamp, and loading it.

Each module ``ptx/<name>.ptx`` is compiled (by ``build_ptx.py``) from ``ptx/<name>.cu`` for the base virtual
arch, plus optional variants ``ptx/<name>.<arch>.ptx`` (e.g. ``sm_90a``) that the loader serves under the base
name on devices that support them. A module may instead be another module's source built with other flags (a
``-D`` switch: ``paged_decode_attn_pdl`` is ``paged_decode_attn_tiled.cu`` with ``ATT_PDL``), loaded under its own
name by the callers that ask for it. The first line of every ``.ptx`` is a stamp:
a hash of the source, of every file it includes from ``ptx/``, and of the flags. The sources
ship with the package, so an installed copy can still tell fresh from stale without nvcc.
"""
from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hss.errors import HssError

DEFAULT_ARCH = "compute_80"
STAMP_PREFIX = "// hss-stamp:"
# PTX ISA version -> the oldest driver that loads it (CUDA release notes).
MIN_DRIVER = {(9, 0): 580, (8, 8): 575, (8, 7): 570, (8, 6): 560, (8, 5): 555, (8, 4): 550, (8, 3): 545,
              (8, 2): 535, (8, 1): 530, (8, 0): 525}


@dataclass(frozen=True)
class ModuleSpec:
    """How one PTX module is built: fast-math as in the original, extra nvcc flags, extra variants, the arch of
    its base PTX (DEFAULT_ARCH unless the module needs newer instructions: then only such devices load it), and
    its source ``ptx/<source>.cu`` (the module's own name unless it is another module's source, built with flags)."""
    name: str
    fast_math: bool = False
    extra_flags: tuple[str, ...] = ()
    variants: tuple[str, ...] = ()
    base_arch: str = DEFAULT_ARCH
    source: str = ""

    @property
    def source_name(self) -> str:
        """The stem of the ``.cu`` this module is built from."""
        return self.source or self.name

    def flags(self, arch: str) -> list[str]:
        """Every nvcc flag for this module at ``arch`` (all compiler flags live here)."""
        return ["--ptx", f"-arch={arch}", "-O3", *(["--use_fast_math"] if self.fast_math else []),
                *self.extra_flags]


MODULES: dict[str, ModuleSpec] = {m.name: m for m in (
    ModuleSpec("selftest", variants=("sm_90a",)),
    # storage: predictor kernels (docs/design.md §3: built with --use_fast_math, as the original)
    ModuleSpec("q_lowrank_project", fast_math=True),
    ModuleSpec("kv_lowrank_project", fast_math=True),
    ModuleSpec("predictor_score", fast_math=True),
    # storage: tiled attention kernels (docs/design.md §3: built with --use_fast_math, as the original)
    ModuleSpec("paged_decode_attn_tiled", fast_math=True),
    # the same source with programmatic dependent launch (ATT_PDL: griddepcontrol, sm_90), for overlapped tiles
    ModuleSpec("paged_decode_attn_pdl", fast_math=True, extra_flags=("-DATT_PDL",), base_arch="sm_90",
               source="paged_decode_attn_tiled"),
    ModuleSpec("attention_finalize", fast_math=True),
    # qsa: indexer kernels (docs/design.md §3: no --use_fast_math, as the original)
    ModuleSpec("qsa_indexer"),
    # qsa: the device decode step (docs/design.md §17.2-§17.4), built like qsa_indexer; its sm_90 variant adds
    # programmatic dependent launch (griddepcontrol) between the step's kernels
    ModuleSpec("qsa_device", variants=("sm_90",)),
    # model: the decoder forward's small kernels (hss.model; no --use_fast_math)
    ModuleSpec("model"),
    # swap: HostStore reads of scattered pages from mapped pinned memory (hss.swap.gather; no --use_fast_math)
    ModuleSpec("page_gather"),
    # swap: the device sparse step's selection, residency and reads (hss.swap.device_step; no --use_fast_math)
    ModuleSpec("sparse_step"),
    # model: the next token of each row (penalties, temperature, top-k/p, min-p, Philox; hss.model.sample)
    ModuleSpec("sample"),
)}


def ptx_dir() -> Path:
    """``ptx/`` beside ``hss/`` in a source checkout, else the package data ``hss/_ptx``."""
    here = Path(__file__).resolve().parent.parent   # hss/
    checkout = here.parent / "ptx"
    if (checkout / "hss_common.cuh").is_file():
        return checkout
    return here / "_ptx"


def spec(name: str) -> ModuleSpec:
    try:
        return MODULES[name]
    except KeyError:
        raise HssError(f"unknown PTX module {name!r}; hss ships {', '.join(sorted(MODULES))}") from None


def ptx_path(name: str, variant: str | None = None, directory: Path | None = None) -> Path:
    d = directory or ptx_dir()
    return d / (f"{name}.{variant}.ptx" if variant else f"{name}.ptx")


def sources(name: str, directory: Path | None = None) -> list[Path]:
    """The module's ``.cu`` and every file it ``#include``s (transitively) from ``ptx/``, sorted."""
    d = directory or ptx_dir()
    seen: dict[str, Path] = {}
    todo = [d / f"{spec(name).source_name}.cu"]
    while todo:
        path = todo.pop()
        if path.name in seen:
            continue
        if not path.is_file():
            raise HssError(f"PTX source {path} is missing")
        seen[path.name] = path
        for inc in re.findall(r'^\s*#\s*include\s+"([^"]+)"', path.read_text(), re.M):
            if (d / inc).is_file():
                todo.append(d / inc)
    return [seen[k] for k in sorted(seen)]


def source_hash(name: str, arch: str, directory: Path | None = None) -> str:
    """sha256 over the flags and each source's name and bytes: what the stamp records."""
    h = hashlib.sha256()
    h.update(" ".join(spec(name).flags(arch)).encode() + b"\n")
    for path in sources(name, directory):
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def stamp_line(name: str, arch: str, nvcc_version: str, directory: Path | None = None) -> str:
    flags = " ".join(spec(name).flags(arch))
    return (f'{STAMP_PREFIX} module={name} arch={arch} hash={source_hash(name, arch, directory)} '
            f'nvcc={nvcc_version} flags="{flags}"')


def read_stamp(path: Path) -> dict[str, str] | None:
    """The key=value fields of a PTX file's stamp line, or None if it has none."""
    try:
        with open(path) as f:
            first = f.readline()
    except OSError:
        return None
    if not first.startswith(STAMP_PREFIX):
        return None
    return dict(re.findall(r'(\w+)=("[^"]*"|\S+)', first[len(STAMP_PREFIX):]))


def targets(name: str) -> list[tuple[str | None, str]]:
    """(variant, arch) pairs to build for module ``name``: the base (variant None) and each variant."""
    return [(None, spec(name).base_arch)] + [(v, v) for v in spec(name).variants]


def freshness(name: str, variant: str | None = None, directory: Path | None = None) -> str:
    """'fresh', 'stale' (sources or flags changed since the build) or 'missing'."""
    path = ptx_path(name, variant, directory)
    if not path.is_file():
        return "missing"
    stamp = read_stamp(path)
    arch = variant or spec(name).base_arch
    if stamp is None or stamp.get("hash") != source_hash(name, arch, directory):
        return "stale"
    return "fresh"


def min_driver(text: str) -> tuple[tuple[int, int], int | None]:
    """The PTX ISA version of ``text`` and the oldest driver (major version) that loads it."""
    m = re.search(r"^\s*\.version\s+(\d+)\.(\d+)", text, re.M)
    if not m:
        raise HssError("PTX text has no .version directive")
    isa = (int(m.group(1)), int(m.group(2)))
    return isa, MIN_DRIVER.get(isa)


def variant_supported(variant: str, cc: tuple[int, int]) -> bool:
    """Whether a device of compute capability ``cc`` runs PTX built for ``variant`` (e.g. sm_90a)."""
    m = re.fullmatch(r"(?:sm|compute)_(\d+)(\d)([af]?)", variant)
    if not m:
        return False
    want = (int(m.group(1)), int(m.group(2)))
    if m.group(3) == "a":
        return cc == want
    if m.group(3) == "f":
        return cc[0] == want[0] and cc >= want
    return cc >= want


def choose(name: str, cc: tuple[int, int] | None, directory: Path | None = None) -> tuple[str | None, Path]:
    """The file the loader serves for ``name`` on a device of ``cc``: a supported variant, else the base."""
    for variant in spec(name).variants:
        path = ptx_path(name, variant, directory)
        if cc is not None and variant_supported(variant, cc) and path.is_file():
            return variant, path
    base = spec(name).base_arch
    if base != DEFAULT_ARCH and cc is not None and not variant_supported(base, cc):
        raise HssError(f"PTX module {name!r} is built for {base} only; this device is compute capability "
                       f"{cc[0]}.{cc[1]}")
    path = ptx_path(name, None, directory)
    if not path.is_file():
        raise HssError(f"PTX module {name!r} is missing ({path}); run `python build_ptx.py` in the hss checkout")
    return None, path


def load_module(name: str, ctx: Any = None) -> Any:
    """Load module ``name`` (its best variant for the device of ``ctx``) as a :class:`CudaModule`."""
    from hss.cuda_min import CudaModule, compute_capability
    variant, path = choose(name, compute_capability(ctx))
    label = f"{name} ({variant})" if variant else name
    module = CudaModule.from_ptx(path.read_text(), name=label, ctx=ctx)
    module.variant = variant
    return module
