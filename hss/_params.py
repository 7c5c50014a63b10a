"""Kernel parameter packing: values checked at their exact widths, held in a reusable ``void**`` array.

The driver copies parameters when ``cuLaunchKernel`` returns, so a :class:`ParamPack` may be
refilled in place and launched again: hot loops prepare one pack and only ``set`` what changes.
"""
from __future__ import annotations

import ctypes
import math
import operator
from typing import Any, Sequence

import numpy as np

from hss._driver import HssError

_F32_MAX = float(np.finfo(np.float32).max)
_CTYPES = {"ptr": ctypes.c_uint64, "i32": ctypes.c_int32, "u32": ctypes.c_uint32,
           "i64": ctypes.c_int64, "f32": ctypes.c_float}
_RANGES = {"ptr": (0, 2**64 - 1), "i32": (-2**31, 2**31 - 1), "u32": (0, 2**32 - 1),
           "i64": (-2**63, 2**63 - 1)}
# numpy scalar type -> kind, for the untyped launch path (which never guesses a width)
_NUMPY_KINDS = {np.int32: "i32", np.uint32: "u32", np.int64: "i64", np.uint64: "ptr", np.float32: "f32"}


def as_int(name: str, value: Any) -> int:
    """``value`` as a Python int (ints and numpy integers; not bool, not float); errors name ``name``."""
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be an int, got bool {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}") from None


def device_ptr(obj: Any) -> int:
    """The device address of an ``int``, ``DevicePtr``, ``DeviceBuffer`` or ``__cuda_array_interface__`` object."""
    if type(obj) is int:
        return obj
    ptr = getattr(obj, "ptr", None)
    if isinstance(ptr, int):
        return ptr
    try:
        cai = getattr(obj, "__cuda_array_interface__", None)
    except TypeError:   # torch raises for dtypes the interface cannot describe (bf16)
        cai = None
    if cai is not None:
        return int(cai["data"][0])
    data_ptr = getattr(obj, "data_ptr", None)
    if callable(data_ptr):   # a torch tensor of any dtype
        return int(data_ptr())
    if isinstance(obj, (bool, float, np.bool_, np.floating)):
        raise TypeError(f"a device pointer is an int or a device object, not {type(obj).__name__}")
    try:
        return operator.index(obj) if not hasattr(obj, "getPtr") else int(obj)
    except TypeError:
        raise TypeError(f"cannot use {type(obj).__name__} as a device pointer: pass an int, a DeviceBuffer, "
                        "a DevicePtr or an object with __cuda_array_interface__") from None


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
        v = device_ptr(value) if not isinstance(value, np.integer) else int(value)
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

    def fill(self, *values: Any) -> "ParamPack":
        """Store all parameters positionally (exactly one value per parameter)."""
        if len(values) != len(self.kinds):
            raise TypeError(f"{self.label} takes {len(self.kinds)} parameters ({', '.join(self.names)}), "
                            f"got {len(values)}")
        for i, value in enumerate(values):
            self.set(i, value)
        return self

    def values(self) -> tuple:
        """The stored values (for tests and error messages)."""
        return tuple(s.value for s in self._slots)

    @classmethod
    def untyped(cls, values: Sequence[Any]) -> "ParamPack":
        """Pack numpy scalars at their own widths and ints/device objects as pointers; never guess."""
        kinds = []
        for i, v in enumerate(values):
            kind = _NUMPY_KINDS.get(type(v))
            if kind is None:
                if isinstance(v, (bool, np.bool_, float, np.floating, np.integer)):
                    raise TypeError(f"kernel parameter #{i}: {type(v).__name__} {v!r} has no kernel width; "
                                    "pass np.int32, np.uint32, np.int64, np.float32, or an int for a pointer")
                kind = "ptr"
            kinds.append(kind)
        return cls(kinds, label="launch_kernel").fill(*values)
