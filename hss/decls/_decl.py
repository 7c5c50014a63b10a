"""A kernel declaration: module, name, parameters in the ``.cu`` order, pointer extents, emulation and contract.

The registry :data:`DECLARATIONS` is filled by the declaration modules of :mod:`hss.decls` as they import.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import numpy as np

from hss._params import ParamPack

Extent = Callable[[SimpleNamespace], "int | None"]   # bytes from the pointer; None = to the allocation's end
MemoryView = Callable[[int, int, str], np.ndarray]   # (address, bytes, what) -> writable uint8 view


@dataclass(frozen=True)
class Launch:
    """Geometry of one launch, as the emulator hands it to ``emulate`` and ``check``.

    ``view(address, nbytes, what)``: a writable uint8 view of emulated device memory at the time the kernel runs,
    bounds-checked against the allocations (:class:`~hss.errors.MemoryFault` naming ``what`` otherwise), for
    emulations that follow addresses found in device memory (e.g. a descriptor table); None outside the emulator.
    """
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    shared: int
    view: MemoryView | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class KernelDecl:
    module: str
    name: str
    names: tuple[str, ...]
    kinds: tuple[str, ...]
    reads: dict[str, Extent] = field(default_factory=dict)
    writes: dict[str, Extent] = field(default_factory=dict)
    emulate: Callable[[SimpleNamespace, Launch], None] | None = None
    check: Callable[[SimpleNamespace, Launch], str | None] | None = None

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
