"""CUDA kernel source run on the CPU, so kernel logic is tested without a GPU (the runtime: ``simt.h`` beside this).

:func:`build` compiles a ``.cu`` file (and the headers it includes) with g++ against ``simt.h``: every ``__global__``
becomes a C entry point of a shared library cached under :func:`cache_dir`, keyed on the hash of everything that
went into it. :meth:`Program.kernel` gives a :class:`Kernel`, launched with numpy arrays for its pointers: one CTA
at a time, each thread a fiber. Each array is copied into its own mapping that ends at a guard page (a read or
write past it is a :class:`SimtError` naming the argument; one within the 16-byte pad is found only if it writes),
and copied back after the launch. With a declaration (:class:`hss.decls._decl.KernelDecl`) the parameter names and
kinds are checked against the kernel's signature, its ``check`` against the launch, arrays against the declared
extents, and a write to a pointer the declaration only reads (or past a declared write extent) is an error.

The source goes through one mechanical rewrite first (:func:`rewrite`): ``extern __shared__ T name[];`` becomes a
pointer into the launch's dynamic shared memory, and inline PTX (``asm(...)``) a harness call: hints (prefetch)
do nothing, ``%dynamic_smem_size`` reads the launch's size, hss's ``ldmatrix``, ``mma.sync`` (bf16 -> f32) and
``cp.async`` statements (``ptx/hss_mma.cuh``, ``ptx/hss_async.cuh``) become warp calls and copies of the runtime,
``hss_headscore.cuh``'s .ftz arithmetic its flush-to-zero functions, any other statement fails when a thread reaches
it.
What the runtime models and what not (races show only through :meth:`Kernel.__call__`'s ``schedule``; libm is
glibc's, not CUDA's): ``simt.h``'s header comment.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

from hss._params import ParamPack

__all__ = ["SimtError", "compiler", "skip_reason", "require", "cache_dir", "rewrite", "build", "build_source",
           "Program", "Kernel", "SCHEDULES"]

HERE = Path(__file__).resolve().parent
HEADER = HERE / "simt.h"
PTX_DIR = HERE.parents[1] / "ptx"
STUBS = ("cuda_bf16.h", "cuda_fp16.h", "cuda_runtime.h", "cuda.h")   # CUDA headers: all of it is simt.h
FLAGS = ("-std=c++20", "-O1", "-fno-fast-math", "-ffp-contract=off", "-fno-strict-aliasing", "-fPIC", "-shared",
         "-fvisibility=hidden", "-Wno-unknown-pragmas", "-Wno-attributes")
PAGE = os.sysconf("SC_PAGE_SIZE")
POISON = 0xA5


class SimtError(RuntimeError):
    """A kernel error the harness found (a barrier or warp call reached by part of a CTA or warp, an invalid
    memory access, a write to a read-only argument, unsupported inline PTX), a bad launch, or a failed build."""


def compiler() -> str | None:
    """The C++ compiler the harness uses: ``$CXX`` or g++ on the PATH (None: there is none)."""
    return shutil.which(os.environ.get("CXX") or "g++")


def skip_reason() -> str | None:
    """Why the harness cannot run here (None: it can)."""
    if compiler() is None:
        return "the CPU SIMT harness needs g++ (or $CXX) on the PATH"
    return None


def require() -> None:
    """``pytest.skip`` with :func:`skip_reason` where the harness cannot run (for fixtures that build kernels)."""
    why = skip_reason()
    if why is not None:
        import pytest
        pytest.skip(why)


def cache_dir() -> Path:
    """Where compiled kernels are kept: ``$HSS_CACHE_DIR/simt``, else ``<tmp>/hss-simt-<uid>``."""
    base = os.environ.get("HSS_CACHE_DIR")
    return Path(base) / "simt" if base else Path(tempfile.gettempdir()) / f"hss-simt-{os.getuid()}"


# -- the source rewrite ---------------------------------------------------------------------------------------------
_EXTERN_SHARED = re.compile(r"extern\s+__shared__\s+(?:__align__\s*\(\s*\d+\s*\)\s*)?([A-Za-z_][\w\s:]*?)\s*"
                            r"\b(\w+)\s*\[\s*\]\s*;")
_ASM = re.compile(r"\b(?:asm|__asm__|__asm)\b(?:\s+(?:volatile|__volatile__))?\s*\(")
_CODE_SKIP = re.compile(r"//[^\n]*|/\*.*?\*/|\"(?:\\.|[^\"\\])*\"|'(?:\\.|[^'\\])*'", re.S)
_KERNEL = re.compile(r"__global__\s+void\s+(?:__launch_bounds__\s*\([^)]*\)\s*)?(\w+)\s*\(([^)]*)\)")


def _matching_paren(text: str, open_at: int) -> int:
    """The index of the ``)`` closing the ``(`` at ``open_at`` (string literals skipped)."""
    depth, i = 0, open_at
    while i < len(text):
        c = text[i]
        if c == '"':
            i = _CODE_SKIP.match(text, i).end()
            continue
        depth += c == "("
        depth -= c == ")"
        if depth == 0:
            return i
        i += 1
    raise SimtError(f"unbalanced parentheses in the asm statement at offset {open_at}")


def _split_top(text: str, sep: str) -> list[str]:
    parts, depth, start, i = [], 0, 0, 0
    while i < len(text):
        c = text[i]
        if c == '"':
            i = _CODE_SKIP.match(text, i).end()
            continue
        depth += c in "(["
        depth -= c in ")]"
        if c == sep and depth == 0:
            parts.append(text[start:i])
            start = i + 1
        i += 1
    return [*parts, text[start:]]


_LDMATRIX = re.compile(r"ldmatrix\.sync\.aligned\.m8n8\.x([124])(\.trans)?\.shared\.b16 \{[%0-9, ]+\}, \[%\d+\];")
_MMA = re.compile(r"mma\.sync\.aligned\.m16n8k(16|8)\.row\.col\.f32\.bf16\.bf16\.f32 ")


def _operands(sections: list[str], at: int) -> list[str]:
    """The C expressions of the asm operands in section ``at`` (1: outputs, 2: inputs)."""
    if len(sections) <= at or not sections[at].strip():
        return []
    return [re.sub(r'^\s*"[^"]*"\s*\((.*)\)\s*$', r"\1", o, flags=re.S) for o in _split_top(sections[at], ",")]


def _asm_replacement(inner: str) -> str:
    sections = _split_top(inner, ":")
    template = "".join(re.findall(r'"((?:\\.|[^"\\])*)"', sections[0]))
    outputs, inputs = _operands(sections, 1), _operands(sections, 2)
    t = " ".join(template.replace("\\n", " ").replace("\\t", " ").split())
    site = "::simt::Site{__FILE__, __LINE__}"
    if t.startswith("prefetch."):   # a cache hint
        return "(void)0"
    if t == "mov.u32 %0, %%dynamic_smem_size;":
        return f"(({outputs[0]}) = ::simt::dynamic_smem_size())"
    m = _LDMATRIX.fullmatch(t)
    if m:   # ldmatrix: the warp's row addresses, then each lane's registers
        n = int(m[1])
        stores = " ".join(f"({o}) = simt_r[{i}];" for i, o in enumerate(outputs))
        return (f"do {{ uint32_t simt_r[4]; ::simt::ldmatrix(simt_r, (uint32_t)({inputs[0]}), {n}, "
                f"{'true' if m[2] else 'false'}, {site}); {stores} }} while (0)")
    m = _MMA.match(t)
    if m:   # mma.sync: "+f" accumulators (outputs), then the A and B registers (inputs)
        k = int(m[1])
        na = 4 if k == 16 else 2
        a, b = inputs[:na], inputs[na:]
        stores = " ".join(f"({o}) = simt_d[{i}];" for i, o in enumerate(outputs))
        return (f"do {{ float simt_d[4] = {{{', '.join(outputs)}}}; const uint32_t simt_a[{na}] = {{{', '.join(a)}}}; "
                f"const uint32_t simt_b[{len(b)}] = {{{', '.join(b)}}}; ::simt::mma_bf16(simt_d, simt_a, {na}, "
                f"simt_b, {len(b)}, {k}, {site}); {stores} }} while (0)")
    m = re.fullmatch(r"(sub|mul|add)\.ftz\.f32 %0, %1, %2;", t)
    if m:   # hss_headscore.cuh's flush-to-zero arithmetic
        return f"(({outputs[0]}) = ::simt::{m[1]}_ftz(({inputs[0]}), ({inputs[1]})))"
    if t == "ex2.approx.ftz.f32 %0, %1;":
        return f"(({outputs[0]}) = ::simt::ex2_ftz({inputs[0]}))"
    if t == "cp.async.cg.shared.global [%0], [%1], 16;":
        return f"::simt::cp_async16((uint32_t)({inputs[0]}), ({inputs[1]}))"
    if t == "cp.async.commit_group;" or re.fullmatch(r"cp\.async\.wait_group %0;", t):
        return "(void)0"
    what = t.split(";")[0].replace("\\", "\\\\").replace('"', '\\"')[:60]
    return f'::simt::unsupported("inline PTX `{what}`", __FILE__, __LINE__)'


def rewrite(text: str) -> str:
    """The kernel source as g++ compiles it: dynamic shared arrays as pointers into the launch's buffer, inline PTX
    as harness calls (every line keeps its number)."""
    text = _EXTERN_SHARED.sub(lambda m: f"{m[1].strip()}* const {m[2]} = static_cast<{m[1].strip()}*>"
                                        f"(::simt::dynamic_shared());", text)
    out, i = [], 0
    while True:
        code = _next_code_match(text, _ASM, i)
        if code is None:
            out.append(text[i:])
            return "".join(out)
        end = _matching_paren(text, code.end() - 1)
        inner = text[code.end():end]
        out.append(text[i:code.start()])
        out.append(_asm_replacement(inner) + "\n" * text.count("\n", code.start(), end))
        i = end + 1


def _next_code_match(text: str, pattern: re.Pattern, start: int) -> re.Match | None:
    """The first match of ``pattern`` at or after ``start`` outside comments and literals."""
    i = start
    while True:
        m = pattern.search(text, i)
        if m is None:
            return None
        skip = _CODE_SKIP.search(text, i)
        while skip is not None and skip.end() <= m.start():
            skip = _CODE_SKIP.search(text, skip.end())
        if skip is None or skip.start() > m.start():
            return m
        i = skip.end()


def _includes(path: Path, search: Sequence[Path], seen: dict[str, str]) -> None:
    """Every quoted ``#include`` reachable from ``path``, rewritten: {file name: text}."""
    text = rewrite(path.read_text())
    seen[path.name] = text
    for name in re.findall(r'^\s*#\s*include\s+"([^"]+)"', text, re.M):
        if name in seen:
            continue
        for d in (path.parent, *search):
            if (d / name).is_file():
                _includes(d / name, search, seen)
                break
        else:
            raise SimtError(f"{path.name}: cannot find the included {name!r}")


# -- the build ----------------------------------------------------------------------------------------------------
def build(source: str | os.PathLike, *, include_dirs: Sequence[os.PathLike] = (PTX_DIR,),
          defines: dict[str, Any] | None = None) -> Program:
    """Compile the kernel file ``source`` (the headers it includes are found beside it or in ``include_dirs``) with
    the harness, or load it from the cache; ``defines`` become ``-D`` flags."""
    src = Path(source)
    files: dict[str, str] = {}
    _includes(src, [Path(d) for d in include_dirs], files)
    return _compile(src.name, files, defines or {})


def build_source(text: str, name: str = "kernel.cu", *, include_dirs: Sequence[os.PathLike] = (PTX_DIR,),
                 defines: dict[str, Any] | None = None) -> Program:
    """:func:`build` of kernel source given as text (test kernels); ``name`` is its file name in messages."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / name
        path.write_text(text)
        return build(path, include_dirs=include_dirs, defines=defines)


def _compile(main: str, files: dict[str, str], defines: dict[str, Any]) -> Program:
    cxx = compiler()
    if cxx is None:
        raise SimtError(skip_reason())
    kernels = []   # the main file's, then those of the headers it includes (qsa_indexer.cu's prefill kernels)
    for name in (main, *sorted(set(files) - {main})):
        code = _CODE_SKIP.sub(lambda m: " " * len(m[0]), files[name])   # no kernel found in a comment
        kernels += [(m[1], tuple(_param_name(p) for p in m[2].split(",") if p.strip())) for m in _KERNEL.finditer(code)]
    if not kernels:
        raise SimtError(f"{main}: no __global__ function")
    launcher = "".join([f'#include "{main}"\n', *(f"SIMT_EXPORT({k})\n" for k, _ in kernels)])
    flags = [*FLAGS, *(f"-D{k}={v}" for k, v in sorted(defines.items()))]
    version = subprocess.run([cxx, "-dumpfullversion"], capture_output=True, text=True).stdout.strip()
    h = hashlib.sha256("\0".join([cxx, version, *flags, HEADER.read_text(), launcher,
                                  *(f"{k}\0{v}" for k, v in sorted(files.items()))]).encode()).hexdigest()[:20]
    out = cache_dir() / f"{Path(main).stem}-{h}"
    lib = out / "kernels.so"
    if not lib.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
        try:
            for name, text in files.items():
                (tmp / name).write_text(text)
            for stub in STUBS:
                (tmp / stub).write_text('#include "simt.h"\n')
            shutil.copy(HEADER, tmp / "simt.h")
            (tmp / "launcher.cpp").write_text(launcher)
            cmd = [cxx, *flags, f"-fmacro-prefix-map={tmp}/=", "-include", "simt.h", "-I", str(tmp),
                   "-o", str(tmp / "kernels.so"), str(tmp / "launcher.cpp")]
            res = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp)
            if res.returncode:
                raise SimtError(f"g++ failed on {main}:\n{res.stderr[-6000:]}")
            try:
                os.replace(tmp, out)
            except OSError:   # another process built it first
                pass
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return Program(main, lib, dict(kernels))


def _param_name(decl: str) -> str:
    return re.findall(r"\w+", decl)[-1]


# -- launches -----------------------------------------------------------------------------------------------------
class _Config(ctypes.Structure):
    _fields_ = [("grid", ctypes.c_uint32 * 3), ("block", ctypes.c_uint32 * 3), ("dynamic_shared", ctypes.c_uint64),
                ("poison", ctypes.c_int32), ("schedule", ctypes.c_uint32)]


def _dims(v: int | Sequence[int], what: str) -> tuple[int, int, int]:
    d = (v,) if isinstance(v, (int, np.integer)) else tuple(v)
    if not 1 <= len(d) <= 3 or any(int(x) < 1 for x in d):
        raise SimtError(f"{what} must be 1 to 3 positive sizes, got {v!r}")
    return tuple(int(x) for x in d) + (1,) * (3 - len(d))


SCHEDULES = ("ascending", "descending", "warps", "warps-descending")   # simt.h's sweep: 0 .. 3, then seeds


def _schedule(schedule: str | int) -> int:
    if schedule in SCHEDULES:
        return SCHEDULES.index(schedule)
    if isinstance(schedule, (int, np.integer)) and not isinstance(schedule, bool) and schedule >= 0:
        return len(SCHEDULES) + int(schedule) % (2**32 - len(SCHEDULES))
    raise SimtError(f"schedule must be one of {SCHEDULES} or a seed (an int >= 0), got {schedule!r}")


class _Region:
    """One pointer argument's copy: a mapping whose last page is a guard, the data ending 16-aligned at it."""

    _libc = ctypes.CDLL(None, use_errno=True)
    _libc.mmap.restype = ctypes.c_void_p
    _libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                           ctypes.c_long]
    _libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    _libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]

    def __init__(self, name: str, array: np.ndarray, poison: int) -> None:
        self.name, self.array = name, array
        self.nbytes = array.nbytes
        padded = -(-self.nbytes // 16) * 16
        self.span = -(-padded // PAGE) * PAGE
        base = self._libc.mmap(None, self.span + PAGE, 3, 0x22, -1, 0)   # read | write, private | anonymous
        if base in (None, ctypes.c_void_p(-1).value):
            raise MemoryError(f"mmap of {self.span + PAGE} bytes for {name}")
        self.base = base
        self._libc.mprotect(base + self.span, PAGE, 0)
        self.addr = base + self.span - padded
        self.view = np.ctypeslib.as_array((ctypes.c_uint8 * self.span).from_address(base)) if self.span else \
            np.zeros(0, np.uint8)
        self.data = self.view[self.span - padded:][: self.nbytes]
        self.pad = padded - self.nbytes
        self.view[:] = poison
        self.data[:] = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
        self.before = self.data.copy()
        self.poison = poison

    def guard_of(self, addr: int) -> bool:
        return self.base + self.span <= addr < self.base + self.span + PAGE

    def close(self) -> None:
        if self.base is not None:
            self.view = self.data = None
            self._libc.munmap(self.base, self.span + PAGE)
            self.base = None


@dataclass
class Program:
    """A compiled kernel file: its shared library and kernels ({name: parameter names})."""
    source: str
    path: Path
    kernels: dict[str, tuple[str, ...]]

    def __post_init__(self) -> None:
        self.lib = ctypes.CDLL(str(self.path))
        self.lib.simt_error.restype = ctypes.c_char_p

    def kernel(self, name: str, decl: Any = None) -> Kernel:
        """Kernel ``name``; with ``decl`` (its hss declaration) its launches are checked against the declaration."""
        if name not in self.kernels:
            raise SimtError(f"{self.source} has no kernel {name!r} (it has {', '.join(self.kernels)})")
        return Kernel(self, name, decl)


class Kernel:
    """One ``__global__`` function of a :class:`Program`: ``kernel(grid, block, shared, *args, **named)``."""

    def __init__(self, program: Program, name: str, decl: Any = None) -> None:
        self.program, self.name, self.decl = program, name, decl
        kinds_of = getattr(program.lib, f"simt_kinds_{name}")
        kinds_of.restype = ctypes.c_char_p
        text = kinds_of().decode()
        self.kinds = tuple(text.split(",")) if text else ()
        self.names = program.kernels[name]
        if len(self.names) != len(self.kinds):   # a parameter list spelled through a macro: the declaration names it
            if decl is None:
                raise SimtError(f"{name}: its parameters are written through a macro; pass its declaration "
                                "(program.kernel(name, decl)) for their names")
            self.names = tuple(decl.names)
        self._launch = getattr(program.lib, f"simt_launch_{name}")
        self._launch.argtypes = [ctypes.POINTER(_Config), ctypes.c_void_p]
        unknown = [f"{n} ({k})" for n, k in zip(self.names, self.kinds) if k not in ParamPack.KINDS]
        if unknown:
            raise SimtError(f"{name}: parameters of kinds hss does not pack: {', '.join(unknown)}")
        if decl is not None and (tuple(decl.names), tuple(decl.kinds)) != (self.names, self.kinds):
            raise SimtError(f"{name}: the declaration says {list(zip(decl.names, decl.kinds))}, the source "
                            f"{list(zip(self.names, self.kinds))}")

    def __call__(self, grid: int | Sequence[int], block: int | Sequence[int], shared: int = 0, *args: Any,
                 poison: int = POISON, schedule: str | int = "ascending", **named: Any) -> None:
        """Run the launch to its end. Pointer parameters take numpy arrays (copied in, and back out where the
        array is writable), None (null) or an int address; the others numbers of their kinds. ``poison``: the
        byte static and dynamic shared memory hold when each CTA starts. ``schedule``: the order the threads of a
        CTA run in between barriers and warp calls: thread by thread ("ascending", "descending"), warp by warp,
        each as far as it can go ("warps", "warps-descending"), or an int seed (a random mix, anew at every
        pass); a kernel whose results depend on it has a race."""
        values = dict(zip(self.names, args))
        if len(args) > len(self.names) or set(values) & set(named):
            raise SimtError(f"{self.name} takes the parameters {', '.join(self.names)}")
        values.update(named)
        missing = [n for n in self.names if n not in values]
        if missing or len(values) != len(self.names):
            raise SimtError(f"{self.name}: missing {missing}, unknown {sorted(set(values) - set(self.names))}")
        cfg = _Config((ctypes.c_uint32 * 3)(*_dims(grid, "grid")), (ctypes.c_uint32 * 3)(*_dims(block, "block")),
                      int(shared), int(poison) & 0xFF, _schedule(schedule))
        regions: dict[str, _Region] = {}
        try:
            pack = ParamPack(self.kinds, self.names, self.name)
            for n, k in zip(self.names, self.kinds):
                v = values[n]
                if k == "ptr" and isinstance(v, np.ndarray):
                    if not v.flags.c_contiguous:
                        raise SimtError(f"{self.name}: {n} must be a C-contiguous array")
                    regions[n] = _Region(n, v, cfg.poison)
                    v = regions[n].addr
                pack.set(n, 0 if v is None else v)
            scalars = SimpleNamespace(**dict(zip(self.names, pack.values())), grid=tuple(cfg.grid),
                                      block=tuple(cfg.block))   # as the emulator hands them to a declaration
            self._check_decl(scalars, cfg, regions)
            if self._launch(ctypes.byref(cfg), pack.address):
                raise SimtError(f"{self.name}: {self._explain(self.program.lib.simt_error().decode(), regions)}")
            for n, r in regions.items():
                self._settle(n, r, scalars)
        finally:
            for r in regions.values():
                r.close()

    def _check_decl(self, a: SimpleNamespace, cfg: _Config, regions: dict[str, _Region]) -> None:
        if self.decl is None:
            return
        from hss.decls._decl import Launch
        if self.decl.check is not None:
            why = self.decl.check(a, Launch(tuple(cfg.grid), tuple(cfg.block), int(cfg.dynamic_shared)))
            if why:
                raise SimtError(f"{self.name}: {why}")
        for n, r in regions.items():
            need = max(x or 0 for x in self.decl.extent(n, a))
            if r.nbytes < need:
                raise SimtError(f"{self.name}: {n} holds {r.nbytes} bytes, the launch uses {need}")

    def _settle(self, n: str, r: _Region, a: SimpleNamespace) -> None:
        """Check the pad and the declared writes of argument ``n``, then copy its bytes back."""
        if (r.view[r.span - r.pad:] != r.poison).any():
            raise SimtError(f"{self.name}: a write past the {r.nbytes} bytes of {n}")
        changed = np.flatnonzero(r.data != r.before)
        if changed.size and self.decl is not None:
            w = self.decl.writes.get(n)
            limit = 0 if w is None else w(a)
            if limit is not None and changed[-1] >= limit:
                what = "which its declaration only reads" if limit == 0 else f"past its declared {limit} bytes"
                raise SimtError(f"{self.name}: wrote byte {int(changed[-1])} of {n}, {what}")
        if changed.size and not r.array.flags.writeable:
            raise SimtError(f"{self.name}: wrote to {n}, a read-only array")
        if changed.size:
            r.array.reshape(-1).view(np.uint8)[:] = r.data

    def _explain(self, msg: str, regions: dict[str, _Region]) -> str:
        m = re.search(r"at address 0x([0-9a-f]+)", msg)
        if m:
            addr = int(m[1], 16)
            for n, r in regions.items():
                if r.guard_of(addr):
                    return msg + f" (byte {addr - r.addr} of {n}, which holds {r.nbytes})"
        return msg
