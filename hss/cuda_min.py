"""The minimal CUDA driver layer (SPEC §1 as amended by §0): contexts, streams, memory, copies,
PTX modules, launches, events and graphs over :mod:`hss._driver`.

Device addresses are plain ints (offsets are ``ptr + nbytes``). Streams are explicit everywhere
and nothing synchronises unless its name or docstring says so. Owners (:class:`CudaCtx`,
:class:`CudaStream`, :class:`DeviceBuffer`, :class:`PinnedBuffer`, :class:`CudaModule`,
:class:`CudaEvent`, :class:`CudaGraph`) free exactly once: an idempotent ``close()``, ``with``
support and a ``weakref.finalize`` safety net that holds only raw handles. Every owner keeps the
primary context it was made in alive, and every call makes that context current first.
"""
from __future__ import annotations

import bisect
import threading
import weakref
from typing import Any, Sequence

import numpy as np

from hss._driver import CudaError, HssError, api, check, cuda_error, driver_status
from hss._params import ParamPack, device_ptr

__all__ = [
    "CudaCtx", "CudaStream", "CudaModule", "CudaFunction", "DeviceBuffer", "PinnedBuffer", "CudaEvent",
    "CudaGraph", "ParamPack", "HostToDeviceBatch", "copy_h_to_d_async", "copy_h_to_d_batch_async",
    "copy_d_to_h_async", "copy_d_to_d_async", "copy_2d_d_to_d_async", "memset_d8_async", "memset_d32_async",
    "launch_kernel", "stream_sync", "mem_info", "multiprocessor_count", "begin_capture", "end_capture",
    "driver_status", "device_ptr", "stream_handle", "stream_wait_event",
    "CudaError", "HssError",
]

_GONE = {"CUDA_ERROR_DEINITIALIZED", "CUDA_ERROR_CONTEXT_IS_DESTROYED", "CUDA_ERROR_INVALID_CONTEXT"}


class _TLS(threading.local):
    ctx = 0  # the context hss last made current on this thread


_tls = _TLS()


# -- contexts ---------------------------------------------------------------------------------
class _PrimaryContext:
    """One retain of a device's primary context, released when no hss object uses it any more."""

    _live: dict[int, "weakref.ref[_PrimaryContext]"] = {}
    _lock = threading.Lock()

    def __init__(self, ordinal: int) -> None:
        status = driver_status()
        if status.kind == "cuda" and not status.found:
            raise CudaError("cuInit", "CUDA_ERROR_NO_DEVICE", status.message)
        check(api.cuInit(0), "cuInit")
        count = check(api.cuDeviceGetCount(), "cuDeviceGetCount")
        if not 0 <= ordinal < int(count):
            raise HssError(f"ordinal {ordinal} is not a device: this machine has {int(count)} (0..{int(count) - 1})")
        self.device = check(api.cuDeviceGet(ordinal), "cuDeviceGet")
        self.ordinal = ordinal
        self.handle = int(check(api.cuDevicePrimaryCtxRetain(self.device), "cuDevicePrimaryCtxRetain"))
        self._finalizer = weakref.finalize(self, _release_primary, self.device)

    @classmethod
    def get(cls, ordinal: int) -> "_PrimaryContext":
        with cls._lock:
            ref = cls._live.get(ordinal)
            pctx = ref() if ref is not None else None
            if pctx is None:
                pctx = cls(ordinal)
                cls._live[ordinal] = weakref.ref(pctx)
            return pctx

    def make_current(self) -> None:
        if _tls.ctx != self.handle:
            check(api.cuCtxSetCurrent(self.handle), "cuCtxSetCurrent")
            _tls.ctx = self.handle


def _release_primary(device: Any) -> None:
    try:
        api.cuDevicePrimaryCtxRelease(device)
    except Exception:   # interpreter shutdown: the binding may already be gone
        pass
    _tls.ctx = 0


def _context(ctx: "CudaCtx | _PrimaryContext | None") -> _PrimaryContext:
    """The primary context an owner is made in: ``ctx``'s, or the current device's (device 0 if none)."""
    if isinstance(ctx, CudaCtx):
        pctx = ctx._pctx
    elif isinstance(ctx, _PrimaryContext):
        pctx = ctx
    elif ctx is None:
        ordinal = 0
        status = driver_status()
        if status.found or status.kind == "emulator":
            check(api.cuInit(0), "cuInit")
            if int(check(api.cuCtxGetCurrent(), "cuCtxGetCurrent") or 0):
                ordinal = int(check(api.cuCtxGetDevice(), "cuCtxGetDevice"))
        pctx = _PrimaryContext.get(ordinal)
    else:
        raise TypeError(f"ctx must be a CudaCtx or None, not {type(ctx).__name__}")
    pctx.make_current()
    return pctx


def _ensure_context() -> None:
    """Make some context current on this thread (the current device's primary) before a raw-handle call."""
    if not _tls.ctx:
        _context(None)


class CudaCtx:
    """Device ``ordinal``'s primary context (shared with PyTorch, CuPy, cuda.core) and a stream.

    ``stream`` is non-blocking unless ``non_blocking=False`` (the original's blocking stream).
    ``close()`` destroys the stream and drops this object's hold on the context.
    """

    def __init__(self, ordinal: int = 0, *, non_blocking: bool = True) -> None:
        self._pctx = _PrimaryContext.get(ordinal)
        self._pctx.make_current()
        self.device = ordinal
        self.ctx = self._pctx.handle
        self._stream = CudaStream(self, non_blocking=non_blocking)
        self.stream = self._stream.handle

    @property
    def name(self) -> str:
        raw = check(api.cuDeviceGetName(256, self._pctx.device), "cuDeviceGetName")
        return bytes(raw).split(b"\0", 1)[0].decode()

    @property
    def compute_capability(self) -> tuple[int, int]:
        return compute_capability(self._pctx)

    def make_current(self) -> None:
        """Bind this context to the calling thread (hss calls do this themselves)."""
        self._pctx.make_current()

    def synchronize(self) -> None:
        """Block until all work in this context has finished (cuCtxSynchronize)."""
        self._pctx.make_current()
        check(api.cuCtxSynchronize(), "cuCtxSynchronize")

    def close(self) -> None:
        self._stream.close()

    def __enter__(self) -> "CudaCtx":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def compute_capability(ctx: "CudaCtx | _PrimaryContext | None" = None) -> tuple[int, int]:
    """(major, minor) of the device of ``ctx`` (or of the current device)."""
    pctx = _context(ctx)
    attr = api.CUdevice_attribute
    major = check(api.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, pctx.device),
                  "cuDeviceGetAttribute")
    minor = check(api.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, pctx.device),
                  "cuDeviceGetAttribute")
    return int(major), int(minor)


def multiprocessor_count(ctx: "CudaCtx | _PrimaryContext | None" = None) -> int:
    """Number of SMs of the device of ``ctx`` (or of the current device)."""
    pctx = _context(ctx)
    attr = api.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT
    return int(check(api.cuDeviceGetAttribute(attr, pctx.device), "cuDeviceGetAttribute"))


# -- owners -----------------------------------------------------------------------------------
def _destroy(call: str, handle: int, pctx: _PrimaryContext, raising: bool) -> None:
    """Free one driver object; a destroyed context is tolerated, other failures raise only when asked."""
    try:
        pctx.make_current()
        err = getattr(api, call)(handle)[0]
    except Exception:
        if raising:
            raise
        return
    if err and raising and err.name not in _GONE:
        raise cuda_error(err, call)


class _Owner:
    """Idempotent close / context manager / finalizer, shared by every owner class."""

    _finalizer: weakref.finalize

    def _own(self, call: str, handle: int, pctx: _PrimaryContext) -> None:
        self._pctx = pctx
        self._finalizer = weakref.finalize(self, _destroy, call, handle, pctx, False)

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def close(self) -> None:
        """Free the driver object now; later calls do nothing."""
        info = self._finalizer.detach()
        if info is not None:
            _, func, args, _ = info
            self._on_close()
            func(*args[:-1], True)

    def _on_close(self) -> None:
        pass

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class CudaStream(_Owner):
    """A stream of ``ctx`` (non-blocking by default); has ``handle`` and ``__cuda_stream__``."""

    def __init__(self, ctx: "CudaCtx | None" = None, *, non_blocking: bool = True) -> None:
        pctx = _context(ctx)
        self.handle = int(check(api.cuStreamCreate(1 if non_blocking else 0), "cuStreamCreate"))
        self._own("cuStreamDestroy", self.handle, pctx)

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.handle)

    def synchronize(self) -> None:
        stream_sync(self.handle)

    def wait(self, event: "CudaEvent") -> None:
        """Order later work on this stream after ``event``'s last record (no host wait)."""
        stream_wait_event(self.handle, event)


class _LiveRanges:
    """Address ranges of live hss buffers, so copies into them are bounds-checked."""

    def __init__(self) -> None:
        self.starts: list[int] = []
        self.ends: list[int] = []
        self.tokens: list[object] = []
        self.arrays: tuple[np.ndarray, np.ndarray] | None = None    # starts, ends for check_many; None: stale
        self.lock = threading.Lock()

    def add(self, start: int, size: int) -> object:
        """Register ``[start, start + size)``; the returned token removes exactly this entry."""
        token = object()
        with self.lock:
            i = bisect.bisect_left(self.starts, start)
            self.starts.insert(i, start)
            self.ends.insert(i, start + size)
            self.tokens.insert(i, token)
            self.arrays = None
        return token

    def remove(self, token: object) -> None:
        with self.lock:
            for i, t in enumerate(self.tokens):
                if t is token:
                    del self.starts[i], self.ends[i], self.tokens[i]
                    self.arrays = None
                    return

    def check(self, ptr: int, nbytes: int, what: str) -> None:
        i = bisect.bisect_right(self.starts, ptr) - 1
        if i >= 0 and ptr < self.ends[i] and ptr + nbytes > self.ends[i]:
            raise HssError(f"{what}: {nbytes} bytes at offset {ptr - self.starts[i]} run past the end of "
                           f"its {self.ends[i] - self.starts[i]}-byte buffer; copy fewer bytes or use a larger buffer")

    def check_many(self, ptrs: np.ndarray, nbytes: np.ndarray, what: str) -> None:
        """:meth:`check` of every ``(ptrs[i], nbytes[i])`` (int64 arrays) at once; raises for the first bad one."""
        with self.lock:
            if self.arrays is None:
                self.arrays = np.array(self.starts, dtype=np.int64), np.array(self.ends, dtype=np.int64)
            starts, ends = self.arrays
        if not starts.size or not ptrs.size:
            return
        i = np.searchsorted(starts, ptrs, side="right") - 1
        end = ends[np.maximum(i, 0)]
        bad = np.flatnonzero((i >= 0) & (ptrs < end) & (ptrs + nbytes > end))
        if bad.size:
            b = int(bad[0])
            self.check(int(ptrs[b]), int(nbytes[b]), what)


_ranges = _LiveRanges()


class DeviceBuffer(_Owner):
    """``nbytes`` of device memory (cuMemAlloc; NOT zeroed). ``ptr`` is the address, ``bytes`` the size."""

    def __init__(self, nbytes: int, ctx: "CudaCtx | None" = None) -> None:
        nbytes = int(nbytes)
        if nbytes <= 0:
            raise HssError(f"nbytes must be > 0 (got {nbytes})")
        pctx = _context(ctx)
        self.ptr = int(check(api.cuMemAlloc(nbytes), "cuMemAlloc", f"{nbytes} bytes"))
        self.bytes = nbytes
        self._own("cuMemFree", self.ptr, pctx)
        self._range = _ranges.add(self.ptr, nbytes)
        weakref.finalize(self, _ranges.remove, self._range)

    def _on_close(self) -> None:
        _ranges.remove(self._range)

    @property
    def __cuda_array_interface__(self) -> dict:
        return {"shape": (self.bytes,), "typestr": "|u1", "data": (self.ptr, False), "version": 3,
                "strides": None, "stream": None}

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"{self.ptr:#x}"
        return f"DeviceBuffer({self.bytes} bytes at {state})"


class PinnedBuffer(_Owner):
    """``nbytes`` of page-locked host memory (cuMemAllocHost): truly asynchronous copies.

    ``array`` is a uint8 numpy view; ``view(dtype)`` reinterprets it; ``ptr`` is the host address.
    """

    def __init__(self, nbytes: int, ctx: "CudaCtx | None" = None) -> None:
        nbytes = int(nbytes)
        if nbytes <= 0:
            raise HssError(f"nbytes must be > 0 (got {nbytes})")
        pctx = _context(ctx)
        self.ptr = int(check(api.cuMemAllocHost(nbytes), "cuMemAllocHost", f"{nbytes} bytes"))
        self.bytes = nbytes
        self._own("cuMemFreeHost", self.ptr, pctx)
        import ctypes
        self.array = np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(self.ptr))
        self._range = _ranges.add(self.ptr, nbytes)
        weakref.finalize(self, _ranges.remove, self._range)

    def _on_close(self) -> None:
        _ranges.remove(self._range)
        self.array = np.empty(0, dtype=np.uint8)   # no view may outlive the memory

    def view(self, dtype: Any) -> np.ndarray:
        return self.array.view(dtype)

    def device_ptr(self) -> int:
        """The device address of this memory (cuMemHostGetDevicePointer; equal to ``ptr`` with UVA)."""
        self._pctx.make_current()
        return int(check(api.cuMemHostGetDevicePointer(self.ptr, 0), "cuMemHostGetDevicePointer"))


# -- handles ----------------------------------------------------------------------------------
def stream_handle(stream: Any) -> int:
    """The raw handle of an ``int``, ``CUstream``, :class:`CudaStream` or ``__cuda_stream__`` object."""
    if type(stream) is int:
        return stream
    if isinstance(stream, CudaStream):
        return stream.handle
    proto = getattr(stream, "__cuda_stream__", None)
    if proto is not None:
        return int(proto()[1])
    if stream is None or isinstance(stream, (bool, float)):
        raise TypeError("a stream is required: pass an int handle (0 = legacy default stream), a CudaStream, "
                        "a CUstream or an object with __cuda_stream__")
    return int(stream)


def _host(obj: Any, nbytes: int, writable: bool, what: str) -> int:
    """Address of a host buffer holding at least ``nbytes`` (ints are trusted addresses)."""
    if type(obj) is int:
        return obj
    if isinstance(obj, PinnedBuffer):
        arr = obj.array
    elif isinstance(obj, np.ndarray):
        if not obj.flags.c_contiguous:
            raise HssError(f"{what} must be C-contiguous; pass np.ascontiguousarray(...)")
        arr = obj
    else:
        arr = np.frombuffer(obj, dtype=np.uint8)
    if writable and not arr.flags.writeable:
        raise HssError(f"{what} is read-only")
    if arr.nbytes < nbytes:
        raise HssError(f"{what} holds {arr.nbytes} bytes but {nbytes} are to be copied")
    return arr.__array_interface__["data"][0]


def _nbytes(n: Any, what: str = "nbytes") -> int:
    if isinstance(n, (bool, float)) or not isinstance(n, (int, np.integer)):
        raise TypeError(f"{what} must be an integer, got {type(n).__name__}")
    n = int(n)
    if n < 0:
        raise HssError(f"{what} must be >= 0 (got {n})")
    return n


# -- copies, memsets, sync --------------------------------------------------------------------
def copy_h_to_d_async(dst: Any, src: Any, nbytes: int, stream: Any) -> None:
    """Queue a host-to-device copy on ``stream``. From pageable memory the driver stages ``src``
    before returning (reuse it at once); from a :class:`PinnedBuffer` keep it unchanged until the
    stream reaches the copy."""
    n = _nbytes(nbytes)
    d = device_ptr(dst)
    _ranges.check(d, n, "copy_h_to_d_async dst")
    s = _host(src, n, False, "copy_h_to_d_async src")
    if n:
        _ensure_context()
        check(api.cuMemcpyHtoDAsync(d, s, n, stream_handle(stream)), "cuMemcpyHtoDAsync")


_batch_attrs: dict[int, Any] = {}   # context handle -> CUmemcpyAttributes of host-to-device batches (None: unsupported)


def _int64s(values: Any, what: str) -> np.ndarray:
    arr = np.asarray(values)
    if arr.size and arr.dtype.kind not in "iu":
        raise TypeError(f"host-to-device batch: {what} must be integers, got {arr.dtype}")
    return arr.astype(np.int64, copy=False).reshape(-1)


class HostToDeviceBatch:
    """Host-to-device copies ``dsts[i] <- srcs[i]`` (``nbytes[i]`` each; device addresses and pinned host
    addresses, as int sequences or arrays), checked once, then queued by :meth:`queue` as one
    ``cuMemcpyBatchAsync`` (whole, or in consecutive parts).

    A batch runs in stream order, its copies in any order, so they must not overlap. Construction checks the
    counts, that every size is > 0 and every destination range against the live hss buffers, vectorized;
    ``queue`` only builds the driver's argument lists and makes the call, so keep the destinations alive until
    then. Where the driver or binding has no batch call, ``queue`` makes one ``cuMemcpyHtoDAsync`` per copy.
    """

    __slots__ = ("_d", "_s", "_n")

    def __init__(self, dsts: Any, srcs: Any, nbytes: Any) -> None:
        d, s, n = _int64s(dsts, "destinations"), _int64s(srcs, "sources"), _int64s(nbytes, "sizes")
        if not d.size == s.size == n.size:
            raise HssError(f"host-to-device batch: {d.size} destinations, {s.size} sources, {n.size} sizes")
        if n.size and n.min() <= 0:
            raise HssError(f"host-to-device batch: sizes must be > 0 (got {int(n[n <= 0][0])})")
        _ranges.check_many(d, n, "host-to-device batch dst")
        self._d, self._s, self._n = d.tolist(), s.tolist(), n.tolist()

    def __len__(self) -> int:
        return len(self._d)

    @property
    def nbytes(self) -> int:
        """Bytes of all the copies."""
        return sum(self._n)

    def queue(self, stream: Any, start: int = 0, stop: int | None = None) -> None:
        """Queue copies ``[start, stop)`` (default: all) on ``stream`` as one batch; nothing when that is empty."""
        d, x, n = self._d[start:stop], self._s[start:stop], self._n[start:stop]
        count = len(d)
        if not count:
            return
        s = stream_handle(stream)
        _ensure_context()
        key = _tls.ctx
        attr = _batch_attrs.get(key, False)   # False: not tried in this context yet; None: no batch call here
        batch = getattr(api, "cuMemcpyBatchAsync", None)
        if batch is not None and attr is not None:
            if attr is False:
                attr = api.CUmemcpyAttributes()
                attr.srcAccessOrder = api.CUmemcpySrcAccessOrder.CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
                attr.srcLocHint.type = api.CUmemLocationType.CU_MEM_LOCATION_TYPE_HOST
                attr.dstLocHint.type = api.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
                attr.dstLocHint.id = int(check(api.cuCtxGetDevice(), "cuCtxGetDevice"))
            ptr = api.CUdeviceptr
            err = batch([ptr(v) for v in d], [ptr(v) for v in x], n, count, [attr], [0], 1, s)[0]
            if not err:
                _batch_attrs[key] = attr
                return
            if getattr(err, "name", "") != "CUDA_ERROR_NOT_SUPPORTED" or key in _batch_attrs:
                check((err,), "cuMemcpyBatchAsync", f"{count} host-to-device copies")
            _batch_attrs[key] = None   # not supported here: one call per copy from now on
        for dv, xv, nv in zip(d, x, n):
            check(api.cuMemcpyHtoDAsync(dv, xv, nv, s), "cuMemcpyHtoDAsync")

    def __repr__(self) -> str:
        return f"HostToDeviceBatch({len(self._d)} copies, {self.nbytes} bytes)"


def copy_h_to_d_batch_async(dsts: Sequence[int], srcs: Sequence[int], nbytes: Sequence[int], stream: Any) -> None:
    """Queue host-to-device copies ``dsts[i] <- srcs[i]`` (``nbytes[i]`` each; ints: device addresses and
    pinned host addresses) as ONE batch (cuMemcpyBatchAsync): the batch runs in stream order, its copies in
    any order, so they must not overlap. Far cheaper on the host than one call per copy, and the DMA engine
    keeps its bandwidth on mid-size copies. Falls back to one cuMemcpyHtoDAsync per copy where the driver
    or binding has no batch call. :class:`HostToDeviceBatch` checks once and queues later, in parts."""
    HostToDeviceBatch(dsts, srcs, nbytes).queue(stream)


def copy_d_to_h_async(dst: Any, src: Any, nbytes: int, stream: Any) -> None:
    """Queue a device-to-host copy on ``stream``. Into pageable memory the driver completes it
    before returning (it is synchronous); into a :class:`PinnedBuffer` it is truly asynchronous:
    wait (``stream_sync`` or an event) before reading."""
    n = _nbytes(nbytes)
    s = device_ptr(src)
    _ranges.check(s, n, "copy_d_to_h_async src")
    d = _host(dst, n, True, "copy_d_to_h_async dst")
    if n:
        _ensure_context()
        check(api.cuMemcpyDtoHAsync(d, s, n, stream_handle(stream)), "cuMemcpyDtoHAsync")


def copy_d_to_d_async(dst: Any, src: Any, nbytes: int, stream: Any) -> None:
    """Queue a device-to-device copy of ``nbytes`` on ``stream``."""
    n = _nbytes(nbytes)
    d, s = device_ptr(dst), device_ptr(src)
    _ranges.check(d, n, "copy_d_to_d_async dst")
    _ranges.check(s, n, "copy_d_to_d_async src")
    if n:
        _ensure_context()
        check(api.cuMemcpyDtoDAsync(d, s, n, stream_handle(stream)), "cuMemcpyDtoDAsync")


def copy_2d_d_to_d_async(dst: Any, dst_pitch: int, src: Any, src_pitch: int, width_bytes: int,
                         height: int, stream: Any) -> None:
    """Queue a pitched device-to-device copy: ``height`` rows of ``width_bytes``, rows ``*_pitch`` apart."""
    w, h = _nbytes(width_bytes, "width_bytes"), _nbytes(height, "height")
    dp, sp = _nbytes(dst_pitch, "dst_pitch"), _nbytes(src_pitch, "src_pitch")
    if h and (w > dp or w > sp):
        raise HssError(f"width_bytes ({w}) exceeds a pitch (dst_pitch {dp}, src_pitch {sp})")
    if not (w and h):
        return
    d, s = device_ptr(dst), device_ptr(src)
    _ranges.check(d, (h - 1) * dp + w, "copy_2d_d_to_d_async dst")
    _ranges.check(s, (h - 1) * sp + w, "copy_2d_d_to_d_async src")
    p = api.CUDA_MEMCPY2D()
    p.srcMemoryType = p.dstMemoryType = api.CUmemorytype.CU_MEMORYTYPE_DEVICE
    p.srcDevice, p.srcPitch, p.dstDevice, p.dstPitch = s, sp, d, dp
    p.WidthInBytes, p.Height = w, h
    _ensure_context()
    check(api.cuMemcpy2DAsync(p, stream_handle(stream)), "cuMemcpy2DAsync", f"{h} rows of {w} bytes")


def memset_d8_async(dst: Any, value: int, count: int, stream: Any) -> None:
    """Queue setting ``count`` bytes at ``dst`` to ``value`` (0..255)."""
    n = _nbytes(count, "count")
    if not 0 <= int(value) <= 0xFF:
        raise HssError(f"value must be in 0..255 (got {value})")
    d = device_ptr(dst)
    _ranges.check(d, n, "memset_d8_async dst")
    if n:
        _ensure_context()
        check(api.cuMemsetD8Async(d, int(value), n, stream_handle(stream)), "cuMemsetD8Async")


def memset_d32_async(dst: Any, value: int, count: int, stream: Any) -> None:
    """Queue setting ``count`` 32-bit words at ``dst`` (4-byte aligned) to ``value`` (0..2^32-1)."""
    n = _nbytes(count, "count")
    if not 0 <= int(value) <= 0xFFFFFFFF:
        raise HssError(f"value must be in 0..2^32-1 (got {value}); pass the bit pattern, e.g. of a float")
    d = device_ptr(dst)
    if d % 4:
        raise HssError(f"memset_d32_async dst {d:#x} is not 4-byte aligned")
    _ranges.check(d, 4 * n, "memset_d32_async dst")
    if n:
        _ensure_context()
        check(api.cuMemsetD32Async(d, int(value), n, stream_handle(stream)), "cuMemsetD32Async")


def stream_sync(stream: Any) -> None:
    """Block the host until all work queued on ``stream`` has finished (cuStreamSynchronize)."""
    _ensure_context()
    check(api.cuStreamSynchronize(stream_handle(stream)), "cuStreamSynchronize")


def mem_info() -> tuple[int, int]:
    """(free, total) bytes of the current device (cuMemGetInfo)."""
    _ensure_context()
    free, total = check(api.cuMemGetInfo(), "cuMemGetInfo")
    return int(free), int(total)


from hss._launch import (CudaEvent, CudaFunction, CudaGraph, CudaModule, begin_capture,  # noqa: E402
                         end_capture, launch_kernel, stream_wait_event)
