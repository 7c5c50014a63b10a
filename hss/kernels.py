"""Every hss kernel declared once: module, name, parameters in the ``.cu`` order, pointer extents.

A declaration serves three users: typed packing (``decl.pack(...)`` gives a
:class:`~hss.cuda_min.ParamPack` whose values were range-checked at their exact widths), the
emulator (which decodes a launch's packed parameters with the same declaration, checks the
bytes each pointer may read and write against the allocations, then runs ``emulate``), and
a test that compares each declaration with the ``.entry`` signature in the committed PTX.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Callable

import numpy as np

from hss.cuda_min import ParamPack
from hss.reference import selftest as ref_selftest

Extent = Callable[[SimpleNamespace], "int | None"]   # bytes from the pointer; None = to the allocation's end


@dataclass(frozen=True)
class Launch:
    """Geometry of one launch, as the emulator hands it to ``emulate`` and ``check``."""
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    shared: int


@dataclass(frozen=True)
class KernelDecl:
    module: str
    name: str
    names: tuple[str, ...]
    kinds: tuple[str, ...]
    reads: dict[str, Extent] = field(default_factory=dict)
    writes: dict[str, Extent] = field(default_factory=dict)
    emulate: Callable[[SimpleNamespace, Launch], None] | None = None
    check: Callable[[SimpleNamespace, Launch], "str | None"] | None = None

    def pack(self, *values: Any, **named: Any) -> ParamPack:
        """A :class:`ParamPack` holding ``values`` (positional, then by name), each range-checked."""
        pack = ParamPack(self.kinds, self.names, self.name)
        if values:
            pack.fill(*values)
        for key, value in named.items():
            pack.set(key, value)
        return pack

    def extent(self, name: str, args: SimpleNamespace) -> tuple[int | None, int | None]:
        """(read bytes, write bytes) of pointer ``name`` for these scalars (None where undeclared)."""
        r, w = self.reads.get(name), self.writes.get(name)
        return (r(args) if r else None, w(args) if w else None)


DECLARATIONS: dict[str, KernelDecl] = {}


def declare(module: str, name: str, signature: str, **kw: Any) -> KernelDecl:
    """Register kernel ``name`` of PTX ``module``; ``signature`` is "kind name, kind name, ..."."""
    kinds, names = [], []
    for item in signature.split(","):
        kind, pname = item.split()
        if kind not in ParamPack.KINDS:
            raise ValueError(f"{name}: unknown parameter kind {kind!r}")
        kinds.append(kind)
        names.append(pname)
    for pname in (*kw.get("reads", {}), *kw.get("writes", {})):
        if pname not in names or kinds[names.index(pname)] != "ptr":
            raise ValueError(f"{name}: extent for {pname!r}, which is not a pointer parameter")
    decl = KernelDecl(module, name, tuple(names), tuple(kinds), **kw)
    if name in DECLARATIONS:
        raise ValueError(f"kernel {name} declared twice")
    DECLARATIONS[name] = decl
    return decl


def f32(view: np.ndarray) -> np.ndarray:
    return view.view(np.float32)


# -- selftest (ptx/selftest.cu) -----------------------------------------------------------------
def _emulate_fill(a: SimpleNamespace, launch: Launch) -> None:
    a.out.view(np.uint32)[:] = ref_selftest.fill_u32(a.n, a.value)


def _emulate_axpy(a: SimpleNamespace, launch: Launch) -> None:
    out, index = ref_selftest.axpy(f32(a.x), f32(a.y), a.a, a.n, a.mul, a.add)
    f32(a.out)[:] = out.astype(np.float32)
    a.index_out.view(np.int64)[:] = index


def _emulate_block_sum(a: SimpleNamespace, launch: Launch) -> None:
    f32(a.out)[:] = ref_selftest.block_sums(f32(a.x), a.n, launch.block[0]).astype(np.float32)


def _check_block_sum(a: SimpleNamespace, launch: Launch) -> str | None:
    bx = launch.block[0]
    if bx & (bx - 1) or launch.block[1:] != (1, 1):
        return f"block must be (power of two, 1, 1), got {launch.block}"
    if launch.shared < 4 * bx:
        return f"needs {4 * bx} bytes of dynamic shared memory, got {launch.shared}"
    if launch.grid != (-(-a.n // bx), 1, 1):
        return f"grid must be (ceil(n / block.x), 1, 1) = ({-(-a.n // bx)}, 1, 1), got {launch.grid}"
    return None


SELFTEST_EMPTY = declare("selftest", "selftest_empty", "ptr a, ptr b, i32 n")
SELFTEST_FILL = declare(
    "selftest", "selftest_fill_u32", "ptr out, u32 value, i32 n",
    writes={"out": lambda a: 4 * max(a.n, 0)}, emulate=_emulate_fill)
SELFTEST_AXPY = declare(
    "selftest", "selftest_axpy", "ptr out, ptr index_out, ptr x, ptr y, f32 a, i32 n, u32 mul, i64 add",
    reads={"x": lambda a: 4 * max(a.n, 0), "y": lambda a: 4 * max(a.n, 0)},
    writes={"out": lambda a: 4 * max(a.n, 0), "index_out": lambda a: 8 * max(a.n, 0)},
    emulate=_emulate_axpy)
SELFTEST_BLOCK_SUM = declare(
    "selftest", "selftest_block_sum", "ptr x, ptr out, i32 n",
    reads={"x": lambda a: 4 * max(a.n, 0)}, writes={"out": lambda a: 4 * a.grid[0]},
    emulate=_emulate_block_sum, check=_check_block_sum)
