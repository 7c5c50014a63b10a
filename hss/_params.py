"""Kernel parameter packing: values checked at their exact widths, held in a reusable ``void**`` array.

The driver copies parameters when ``cuLaunchKernel`` returns, so a :class:`ParamPack` may be
refilled in place and launched again: hot loops prepare one pack and only ``set`` what changes.
"""
from __future__ import annotations

import ctypes
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from hss._args import as_int, device_ptr
from hss.errors import HssError

__all__ = ["ParamPack", "convert", "as_int", "KIND_SIZES"]

_F32_MAX = float(np.finfo(np.float32).max)
_CTYPES = {"ptr": ctypes.c_uint64, "i32": ctypes.c_int32, "u32": ctypes.c_uint32,
           "i64": ctypes.c_int64, "f32": ctypes.c_float}
_RANGES = {"ptr": (0, 2**64 - 1), "i32": (-2**31, 2**31 - 1), "u32": (0, 2**32 - 1),
           "i64": (-2**63, 2**63 - 1)}
KIND_SIZES = {"ptr": 8, "i32": 4, "u32": 4, "i64": 8, "f32": 4}


def convert(kind: str, value: Any, label: str) -> int | float:
    """``value`` as a Python number for a parameter of ``kind``, range-checked; errors name ``label``."""
    if kind == "f32":
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
            raise TypeError(f"{label} (f32) needs a number, got {type(value).__name__}")
        v = float(value)
        if math.isfinite(v) and abs(v) > _F32_MAX:
            raise HssError(f"{label} (f32) = {v!r} overflows float32")
        return v
    if kind == "ptr":
        v = int(value) if isinstance(value, np.integer) else device_ptr(value, label)
    elif type(value) is int:
        v = value
    elif isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{label} ({kind}) needs an integer, got {type(value).__name__} {value!r}")
    else:
        v = int(value)
    lo, hi = _RANGES[kind]
    if not lo <= v <= hi:
        raise HssError(f"{label} ({kind}) = {v} is out of range [{lo}, {hi}]")
    return v


class ParamPack:
    """Kernel arguments at their declared widths, packed once into a ``void**`` array.

    ``kinds`` are 'ptr' (u64 address), 'i32', 'u32', 'i64', 'f32'; ``names`` label errors.
    ``address`` is what ``cuLaunchKernel`` takes as ``kernelParams``.
    """

    KINDS = tuple(_CTYPES)
    __slots__ = ("kinds", "names", "label", "address", "_buf", "_ptrs", "_slots", "_index")

    def __init__(self, kinds: Sequence[str], names: Sequence[str] | None = None, label: str = "kernel") -> None:
        self.kinds = tuple(kinds)
        self.names = tuple(names) if names is not None else tuple(f"#{i}" for i in range(len(self.kinds)))
        if len(self.names) != len(self.kinds):
            raise ValueError("names and kinds differ in length")
        self.label = label
        n = len(self.kinds)
        self._buf = (ctypes.c_uint64 * max(n, 1))()
        base = ctypes.addressof(self._buf)
        self._ptrs = (ctypes.c_void_p * max(n, 1))(*[base + 8 * i for i in range(n)])
        self.address = ctypes.addressof(self._ptrs)
        self._slots = [_CTYPES[k].from_buffer(self._buf, 8 * i) for i, k in enumerate(self.kinds)]
        self._index = {name: i for i, name in enumerate(self.names)}

    def set(self, key: int | str, value: Any) -> None:
        """Store ``value`` into parameter ``key`` (index or name), checked for its kind."""
        i = self._index[key] if isinstance(key, str) else key
        kind = self.kinds[i]
        self._slots[i].value = convert(kind, value, f"{self.label} parameter {self.names[i]}")

    def fill(self, *values: Any) -> ParamPack:
        """Store all parameters positionally (exactly one value per parameter)."""
        if len(values) != len(self.kinds):
            raise TypeError(f"{self.label} takes {len(self.kinds)} parameters ({', '.join(self.names)}), "
                            f"got {len(values)}")
        for i, value in enumerate(values):
            self.set(i, value)
        return self

    def slot(self, key: int | str) -> Any:
        """The ctypes slot of parameter ``key``, for hot paths that store an already-checked value with
        ``slot.value = v`` (no conversion, no range check)."""
        return self._slots[self._index[key] if isinstance(key, str) else key]

    def values(self) -> tuple:
        """The stored values (for tests and error messages)."""
        return tuple(s.value for s in self._slots)
