"""Emulated device memory: page-aligned allocations at real, bounds-checked addresses.

Device allocations live at addresses in a range no host pointer uses, each followed by an
unmapped guard page, so an access that runs off an allocation hits no neighbour and is
reported naming the allocation it came from. Pinned host allocations are real host memory
(numpy buffers) registered at their own addresses, so unified addressing holds as on a GPU.
"""
from __future__ import annotations

import bisect
import ctypes
from dataclasses import dataclass, field

import numpy as np

from hss._util import ceil_div
from hss.errors import MemoryFault

__all__ = ["Arena", "Allocation", "MemoryFault", "host_view", "PAGE"]

PAGE = 4096
DEVICE_BASE = 0x1000_0000_0000   # 16 TiB: far from the heap and mmap ranges of a Linux process
POISON_LIMIT = 64 << 20          # fresh allocations up to this size are filled with 0xFF garbage


@dataclass
class Allocation:
    base: int
    size: int
    kind: str                      # "device" or "pinned"
    data: np.ndarray = field(repr=False)   # uint8 view of exactly `size` bytes
    label: str = ""
    device: int = 0                # the ordinal whose context made it (device memory lives on that device)

    def describe(self) -> str:
        where = f" of device {self.device}" if self.kind == "device" else ""
        return f"{self.kind} allocation {self.base:#x}{where} of {self.size} bytes" \
               f"{' ' + self.label if self.label else ''}"


class Arena:
    """All live allocations of the emulated devices (one address space, as with unified addressing), looked up by
    address; ``total`` bytes of device memory per device, ``used_on[d]`` in use on device d, ``used`` on all."""

    def __init__(self, total_bytes: int, devices: int = 1) -> None:
        self.total = total_bytes
        self.used_on = [0] * devices
        self._bases: list[int] = []
        self._allocs: list[Allocation] = []
        self._next = DEVICE_BASE

    @property
    def used(self) -> int:
        return sum(self.used_on)

    # -- allocation ---------------------------------------------------------------------------
    def alloc_device(self, size: int, device: int = 0) -> int | None:
        rounded = _round_up(max(size, 1), PAGE)
        if self.used_on[device] + rounded > self.total:
            return None
        data = np.empty(rounded, dtype=np.uint8)
        if rounded <= POISON_LIMIT:
            data.fill(0xFF)   # cuMemAlloc does not zero: reads of unwritten memory see NaN / -1
        base = self._next
        self._next += rounded + PAGE   # guard page
        self._insert(Allocation(base, size, "device", data[:size], device=device))
        self.used_on[device] += rounded
        return base

    def alloc_pinned(self, size: int, device: int = 0) -> int:
        rounded = _round_up(max(size, 1), PAGE)
        raw = np.empty(rounded + PAGE, dtype=np.uint8)
        start = (-raw.ctypes.data) % PAGE
        data = raw[start:start + size]
        data.fill(0xFF)
        alloc = Allocation(data.ctypes.data, size, "pinned", data, device=device)
        alloc._keep = raw  # type: ignore[attr-defined]
        self._insert(alloc)
        return alloc.base

    def free(self, base: int, kind: str) -> bool:
        i = bisect.bisect_left(self._bases, base)
        if i == len(self._bases) or self._bases[i] != base or self._allocs[i].kind != kind:
            return False
        alloc = self._allocs.pop(i)
        self._bases.pop(i)
        if kind == "device":
            self.used_on[alloc.device] -= _round_up(max(alloc.size, 1), PAGE)
        return True

    def _insert(self, alloc: Allocation) -> None:
        i = bisect.bisect_left(self._bases, alloc.base)
        self._bases.insert(i, alloc.base)
        self._allocs.insert(i, alloc)

    # -- lookup -------------------------------------------------------------------------------
    def find(self, addr: int) -> Allocation | None:
        """The allocation containing ``addr`` (start of a range), or None."""
        i = bisect.bisect_right(self._bases, addr) - 1
        if i >= 0:
            a = self._allocs[i]
            if addr < a.base + max(a.size, 1):
                return a
        return None

    def is_pinned(self, addr: int) -> bool:
        a = self.find(addr)
        return a is not None and a.kind == "pinned"

    def view(self, addr: int, nbytes: int, what: str) -> np.ndarray:
        """uint8 view of ``[addr, addr + nbytes)``; raises :class:`MemoryFault` naming the allocation."""
        if nbytes == 0:
            return np.empty(0, dtype=np.uint8)
        a = self.find(addr)
        if a is None:
            near = self._nearest(addr)
            raise MemoryFault(f"{what}: address {addr:#x} (+{nbytes} bytes) is in no allocation{near}")
        off = addr - a.base
        if off + nbytes > a.size:
            raise MemoryFault(f"{what}: [{addr:#x}, +{nbytes}) runs {off + nbytes - a.size} bytes past the end "
                              f"of {a.describe()} (offset {off})")
        return a.data[off:off + nbytes]

    def _nearest(self, addr: int) -> str:
        i = bisect.bisect_right(self._bases, addr) - 1
        if i >= 0:
            a = self._allocs[i]
            return f" (it is {addr - a.base - a.size} bytes past the end of {a.describe()})"
        return ""

    def live(self) -> list[Allocation]:
        return list(self._allocs)


def host_view(addr: int, nbytes: int) -> np.ndarray:
    """uint8 view of real host memory at ``addr`` (a numpy/pinned buffer the caller keeps alive)."""
    if nbytes == 0:
        return np.empty(0, dtype=np.uint8)
    return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(addr))


def _round_up(n: int, m: int) -> int:
    return ceil_div(n, m) * m
