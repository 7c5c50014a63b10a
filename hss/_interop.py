"""Reading foreign arrays and streams: torch, CuPy, ``__cuda_array_interface__``, ``__dlpack__``, ``__cuda_stream__``.

Each array reader turns one kind of foreign object into a :class:`DeviceArg` (what the object says about itself:
address, bytes, dtype, read-only, the producer's stream) or raises an error naming the parameter; each stream
reader turns a foreign stream object into a raw handle. The rules applied to what they read (sizes, alignment,
dtypes, stream order) live in :mod:`hss._args`, which asks :func:`reader_for` / :func:`stream_reader_for` once per
type it has not seen. This module imports only :mod:`hss.errors`: torch and CuPy are never imported here, only
found in ``sys.modules`` once the caller has imported them. DLPack export of hss's own memory is :mod:`hss._dlpack`.

- torch tensors (no protocol dictionary): CUDA, contiguous; size and dtype from the tensor. A CPU tensor is host
  memory (:func:`read_host_torch`).
- CuPy arrays: as their ``__cuda_array_interface__`` says, without building the dictionary.
- ``__cuda_array_interface__`` (v2, v3): size, C-contiguity, dtype and read-only; v3's ``stream`` is the producer's.
- ``__dlpack__`` producers (JAX, CuPy, ...), read with cuda.core's ``StridedMemoryView``, which hands the callee's
  stream to the producer as the protocol says.
"""
from __future__ import annotations

import math
import operator
import sys
from collections.abc import Callable
from typing import Any

import numpy as np

from hss.errors import HssError

__all__ = ["DeviceArg", "Reader", "StreamReader", "TYPESTR", "reader_for", "stream_reader_for", "refuse",
           "is_torch_tensor", "torch_dtypes", "read_torch", "read_host_torch", "read_cupy", "read_cai", "read_dlpack",
           "contiguous_bytes"]


class DeviceArg:
    """What a device-array argument says about itself: address, bytes (None: unknown), dtype name (None:
    unknown or untyped), read-only, the producer's stream (CAI; None: no ordering asked)."""

    __slots__ = ("ptr", "nbytes", "dtype", "readonly", "stream")

    def __init__(self, ptr: int, nbytes: int | None, dtype: str | None = None, readonly: bool = False,
                 stream: int | None = None) -> None:
        self.ptr, self.nbytes, self.dtype, self.readonly, self.stream = ptr, nbytes, dtype, readonly, stream


# A reader turns an object of one type into a DeviceArg (raising HssError/TypeError naming `name`).
Reader = Callable[[Any, str, "int | None"], DeviceArg]
StreamReader = Callable[[Any], int]

# numpy / CAI typestr -> hss's short dtype name
TYPESTR = {"<f2": "f16", "<f4": "f32", "<f8": "f64", "|i1": "i8", "|u1": "u8", "<i2": "i16", "<u2": "u16",
           "<i4": "i32", "<u4": "u32", "<i8": "i64", "<u8": "u64", "|b1": "u8"}


def reader_for(cls: type, obj: Any) -> Reader | None:
    """The reader of foreign array type ``cls`` (``obj`` one of them), :func:`refuse` for a host numpy array, None
    when it is no array hss can read."""
    if is_torch_tensor(cls):
        return read_torch
    if cls.__name__ == "ndarray" and cls.__module__.startswith("cupy") and hasattr(obj, "data"):
        return read_cupy
    if issubclass(cls, np.ndarray):
        return refuse
    if hasattr(obj, "__cuda_array_interface__"):   # an instance attribute counts too
        return read_cai
    if hasattr(obj, "__dlpack__"):
        return read_dlpack
    return None


def refuse(obj: Any, name: str, stream: int | None) -> DeviceArg:
    """The reader of what is no device array: always raises, saying what to pass instead."""
    if isinstance(obj, np.ndarray):
        raise HssError(f"{name} is a host numpy array; pass device memory (a DeviceBuffer, a CUDA tensor or an "
                       "address)")
    raise TypeError(f"{name}: cannot use {type(obj).__name__} {obj!r:.60} as a device pointer; pass an int address, "
                    "a DeviceBuffer, a torch / CuPy / JAX array, or an object with __cuda_array_interface__ or "
                    "__dlpack__")


# -- torch ------------------------------------------------------------------------------------------------
def is_torch_tensor(cls: type) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and issubclass(cls, torch.Tensor)


_TORCH: dict[Any, str] | None = None


def torch_dtypes() -> dict[Any, str] | None:
    """torch dtype -> hss's short name (None while torch is not imported)."""
    global _TORCH
    if _TORCH is None:
        torch = sys.modules.get("torch")
        if torch is None:
            return None
        names = {"bfloat16": "bf16", "float16": "f16", "float32": "f32", "float64": "f64", "int8": "i8",
                 "uint8": "u8", "int16": "i16", "uint16": "u16", "int32": "i32", "uint32": "u32", "int64": "i64",
                 "uint64": "u64", "bool": "u8"}
        _TORCH = {getattr(torch, k): v for k, v in names.items() if hasattr(torch, k)}
    return _TORCH


def read_torch(t: Any, name: str, stream: int | None) -> DeviceArg:
    if not t.is_cuda:
        raise HssError(f"{name} is a torch tensor on {t.device}; pass a CUDA tensor (.cuda())")
    if not t.is_contiguous():
        raise HssError(f"{name} is a non-contiguous torch tensor; pass .contiguous()")
    names = _TORCH if _TORCH is not None else torch_dtypes()
    return DeviceArg(t.data_ptr(), t.nbytes, names.get(t.dtype))   # type: ignore[union-attr]


def read_host_torch(t: Any, nbytes: int, name: str) -> int:
    """The host address of CPU torch tensor ``t`` holding at least ``nbytes``."""
    if not t.is_contiguous():
        raise HssError(f"{name} is a non-contiguous torch tensor; pass .contiguous()")
    if t.nbytes < nbytes:
        raise HssError(f"{name} holds {t.nbytes} bytes but {nbytes} are to be copied")
    return t.data_ptr()


# -- CuPy and the CUDA array interface -------------------------------------------------------------------
_cupy_stream: Callable[[], int | None] | None = None


def read_cupy(a: Any, name: str, stream: int | None) -> DeviceArg:
    """A CuPy array read as its ``__cuda_array_interface__`` says, without building the dictionary: the address,
    C-contiguity, size and dtype, and CuPy's current stream as the producer (unless CUPY_CUDA_ARRAY_INTERFACE_SYNC
    is 0, where CuPy names none)."""
    global _cupy_stream
    if not a.flags.c_contiguous:
        raise HssError(f"{name} is a non-contiguous CuPy array; pass cupy.ascontiguousarray(...)")
    if _cupy_stream is None:
        import os
        cupy = sys.modules["cupy"]
        if os.environ.get("CUPY_CUDA_ARRAY_INTERFACE_SYNC", "1") == "0":
            _cupy_stream = lambda: None   # noqa: E731
        else:
            current = cupy.cuda.get_current_stream
            _cupy_stream = lambda: current().ptr or 1   # noqa: E731  (the null stream is the legacy one: 1)
    return DeviceArg(a.data.ptr, a.nbytes, TYPESTR.get(a.dtype.str), False, _cupy_stream())


def contiguous_bytes(shape: tuple, strides: tuple | None, itemsize: int, name: str) -> int:
    """Bytes of a C-contiguous array (strides in bytes, None meaning C-contiguous); raises otherwise."""
    n = math.prod(shape)
    if strides is not None and n > 1:
        expect = itemsize
        for dim, stride in zip(reversed(shape), reversed(strides)):
            if dim > 1 and stride != expect:
                raise HssError(f"{name} is not C-contiguous (shape {tuple(shape)}, strides {tuple(strides)}); pass a "
                               "contiguous copy")
            expect *= dim
    return n * itemsize


def read_cai(obj: Any, name: str, stream: int | None) -> DeviceArg:
    try:
        cai = obj.__cuda_array_interface__
    except AttributeError:
        if hasattr(obj, "__dlpack__"):
            return read_dlpack(obj, name, stream)
        return refuse(obj, name, stream)
    except Exception as exc:   # e.g. a dtype the interface cannot describe
        if hasattr(obj, "__dlpack__"):
            return read_dlpack(obj, name, stream)
        raise HssError(f"{name}: its __cuda_array_interface__ failed ({exc})") from None
    try:
        version = int(cai.get("version", 0))
        shape = tuple(int(d) for d in cai["shape"])
        typestr = str(cai["typestr"])
        ptr, readonly = cai["data"]
        strides = cai.get("strides")
    except (KeyError, TypeError, ValueError) as exc:
        raise HssError(f"{name}: malformed __cuda_array_interface__ ({exc!r})") from None
    if version < 2 or cai.get("mask") is not None:
        raise HssError(f"{name}: __cuda_array_interface__ version {version} with a mask is not supported (v3 needed)")
    itemsize = int(typestr[2:]) if typestr[2:].isdigit() else 0
    if itemsize <= 0:
        raise HssError(f"{name}: __cuda_array_interface__ typestr {typestr!r} has no item size")
    nbytes = contiguous_bytes(shape, tuple(strides) if strides is not None else None, itemsize, name)
    producer = cai.get("stream") if version >= 3 else None
    if producer is not None:
        producer = int(producer)
        if producer == 0:
            raise HssError(f"{name}: __cuda_array_interface__ stream 0 is disallowed by the protocol (use 1 or 2 for "
                           "the default streams)")
    return DeviceArg(int(ptr or 0), nbytes, TYPESTR.get(typestr), bool(readonly), producer)


# -- DLPack ----------------------------------------------------------------------------------------------
_StridedMemoryView: Any = None


def _strided_memory_view() -> Any:
    global _StridedMemoryView
    if _StridedMemoryView is None:
        try:
            from cuda.core.utils import StridedMemoryView  # cuda.core >= 0.4
        except ImportError:
            try:
                from cuda.core.experimental.utils import StridedMemoryView
            except ImportError:
                StridedMemoryView = False
        _StridedMemoryView = StridedMemoryView
    return _StridedMemoryView


def read_dlpack(obj: Any, name: str, stream: int | None) -> DeviceArg:
    view_cls = _strided_memory_view()
    if not view_cls:
        raise HssError(f"{name}: reading a __dlpack__ producer needs cuda.core (pip install cuda-core), or pass "
                       "its device address")
    from_dlpack = getattr(view_cls, "from_dlpack", None) or view_cls   # cuda.core >= 0.5; older: the constructor
    # The protocol: ask the producer where its data lives first; a CPU producer takes no stream (numpy refuses one)
    # and is host memory, which no device call can use.
    where = _dlpack_device(obj, name)
    if where[0] in _DLPACK_HOST:
        raise HssError(f"{name} is host memory (DLPack device type {where[0]}, {_DLPACK_HOST[where[0]]}); pass device "
                       "memory (a DeviceBuffer, a CUDA tensor or an address)")
    try:
        try:
            view = from_dlpack(obj, -1 if stream is None else stream)   # -1: the protocol's "no ordering"
        except BufferError:
            raise
        except Exception:
            if stream is not None:
                raise
            view = from_dlpack(obj, 1)   # producers that cannot take -1 (JAX): order before the legacy stream
    except Exception as exc:   # BufferError, or whatever a broken producer or capsule makes the reader raise
        why = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        raise HssError(f"{name}: its DLPack export failed ({why}); pass a CUDA array whose __dlpack__ returns a "
                       "DLPack capsule, or its device address") from None
    if not view.is_device_accessible or view.device_id < 0:
        raise HssError(f"{name} is host memory (DLPack device {view.device_id}); pass device memory")
    shape = tuple(view.shape)
    dtype, itemsize = _view_dtype(view)
    strides = view.strides
    nbytes = contiguous_bytes(shape, None if strides is None else tuple(s * itemsize for s in strides), itemsize,
                              name)
    return DeviceArg(int(view.ptr), nbytes, dtype, bool(view.readonly))


_DLPACK_HOST = {1: "CPU", 7: "Vulkan", 8: "Metal", 9: "VPI"}   # DLPack device types no CUDA kernel can read


def _dlpack_device(obj: Any, name: str) -> tuple[int, int]:
    """``obj.__dlpack_device__()`` as ``(device type, device id)``; (-1, -1) when the producer has none (the
    reader then decides); :class:`HssError` when it fails or answers something else."""
    query = getattr(obj, "__dlpack_device__", None)
    if query is None:
        return (-1, -1)
    try:
        kind, ident = query()
        return int(kind), int(ident)
    except Exception as exc:
        raise HssError(f"{name}: its __dlpack_device__() failed or did not return (device type, id) ({exc!r}); pass "
                       "a CUDA array or its device address") from None


def _view_dtype(view: Any) -> tuple[str | None, int]:
    try:
        dt = np.dtype(view.dtype)
    except Exception:   # a dtype numpy cannot name without ml_dtypes' help (bf16 in older cuda.core)
        raise HssError("a DLPack array's dtype could not be read; pass its device address") from None
    if dt.name == "bfloat16":
        return "bf16", 2
    return TYPESTR.get(dt.str), dt.itemsize


# -- foreign streams -------------------------------------------------------------------------------------
def stream_reader_for(cls: type) -> StreamReader | None:
    """The reader of foreign stream type ``cls`` (``__cuda_stream__``, ``CUstream``, torch or CuPy streams), or
    None."""
    if hasattr(cls, "__cuda_stream__"):
        return _read_stream_protocol
    if cls.__name__ == "CUstream" and cls.__module__.startswith("cuda."):
        return int
    if cls.__module__.startswith("torch") and hasattr(cls, "cuda_stream"):
        return operator.attrgetter("cuda_stream")
    if cls.__module__.startswith("cupy") and hasattr(cls, "ptr"):
        return operator.attrgetter("ptr")
    return None


def _read_stream_protocol(obj: Any) -> int:
    version, handle = obj.__cuda_stream__()
    return int(handle)
