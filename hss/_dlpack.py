"""DLPack export of hss device memory: ``__dlpack__`` capsules built with ctypes (no C extension).

:func:`export` makes a ``"dltensor"`` capsule (or ``"dltensor_versioned"``, DLPack 1.x, when the consumer asks for
it) over a C-contiguous device array. The capsule keeps the exporting object alive until the consumer calls the
tensor's deleter (or, when never consumed, until the capsule is collected), as the protocol requires.
"""
from __future__ import annotations

import ctypes
import threading
from typing import Any

from hss._args import DTYPE_SIZES

__all__ = ["export", "KDL_CUDA", "DLPACK_VERSION"]

KDL_CUDA = 2                 # DLDeviceType kDLCUDA
DLPACK_VERSION = (1, 0)
_READ_ONLY = 1               # DLPACK_FLAG_BITMASK_READ_ONLY
_CODES = {"i": 0, "u": 1, "f": 2, "bf": 4}


class _Device(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _Tensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _Device), ("ndim", ctypes.c_int32), ("dtype", _DataType),
                ("shape", ctypes.POINTER(ctypes.c_int64)), ("strides", ctypes.POINTER(ctypes.c_int64)),
                ("byte_offset", ctypes.c_uint64)]


_DELETER = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


class _Managed(ctypes.Structure):
    _fields_ = [("dl_tensor", _Tensor), ("manager_ctx", ctypes.c_void_p), ("deleter", _DELETER)]


class _Version(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class _ManagedVersioned(ctypes.Structure):
    _fields_ = [("version", _Version), ("manager_ctx", ctypes.c_void_p), ("deleter", _DELETER),
                ("flags", ctypes.c_uint64), ("dl_tensor", _Tensor)]


_live: dict[int, tuple[Any, ...]] = {}   # address of a managed tensor -> what it keeps alive
_lock = threading.Lock()


@_DELETER
def _delete(address: int) -> None:
    with _lock:
        _live.pop(address, None)


_CAPSULE_DESTRUCTOR = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_py = ctypes.pythonapi
_py.PyCapsule_New.restype = ctypes.py_object
_py.PyCapsule_New.argtypes = [ctypes.c_void_p, ctypes.c_char_p, _CAPSULE_DESTRUCTOR]
_py.PyCapsule_IsValid.restype = ctypes.c_int
_py.PyCapsule_IsValid.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
_py.PyCapsule_GetPointer.restype = ctypes.c_void_p
_py.PyCapsule_GetPointer.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
_NAME, _NAME_V = b"dltensor", b"dltensor_versioned"


@_CAPSULE_DESTRUCTOR
def _capsule_gone(capsule: int) -> None:
    """A capsule nobody consumed (its name unchanged) still owns its tensor: delete it."""
    for name in (_NAME, _NAME_V):
        if _py.PyCapsule_IsValid(capsule, name):
            _delete(_py.PyCapsule_GetPointer(capsule, name))
            return


def export(owner: Any, ptr: int, shape: tuple[int, ...], dtype: str, device_id: int, readonly: bool = False,
           max_version: tuple[int, int] | None = None) -> Any:
    """A DLPack capsule over ``shape`` (C-contiguous) elements of ``dtype`` at device address ``ptr``, keeping
    ``owner`` alive while a consumer holds it. Versioned (DLPack 1.0) when ``max_version`` allows it."""
    kind = dtype.rstrip("0123456789")
    code, bits = _CODES[kind], 8 * DTYPE_SIZES[dtype]
    ndim = len(shape)
    shape_arr = (ctypes.c_int64 * max(ndim, 1))(*shape)
    versioned = max_version is not None and tuple(max_version) >= DLPACK_VERSION
    managed = _ManagedVersioned() if versioned else _Managed()
    t = managed.dl_tensor
    t.data, t.device = ptr, _Device(KDL_CUDA, device_id)
    t.ndim, t.dtype = ndim, _DataType(code, bits, 1)
    t.shape, t.strides, t.byte_offset = shape_arr, None, 0   # strides NULL: C-contiguous
    managed.deleter = _delete
    if versioned:
        managed.version = _Version(*DLPACK_VERSION)
        managed.flags = _READ_ONLY if readonly else 0
    address = ctypes.addressof(managed)
    with _lock:
        _live[address] = (managed, shape_arr, owner)
    return _py.PyCapsule_New(address, _NAME_V if versioned else _NAME, _capsule_gone)
