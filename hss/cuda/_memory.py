"""Device and pinned memory, typed views, copies and memsets (part of :mod:`hss.cuda_min`).

Device addresses are plain ints (offsets are ``ptr + nbytes``). Every copy and memset checks its arguments
through :mod:`hss._args` before it queues anything: pointers into live hss buffers are bounds-checked, hss
buffers and views carry their own size, foreign arrays (torch, CuPy, JAX, the CUDA array interface, DLPack)
say theirs.
"""
from __future__ import annotations

import ctypes
import functools
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from hss import _args, _dlpack
from hss._args import RANGES, DeviceArg
from hss.cuda._context import Owner, ensure_context, owner_context, thread_state
from hss.cuda._driver import api, check
from hss.errors import HssError

__all__ = ["DeviceBuffer", "DeviceView", "PinnedBuffer", "HostToDeviceBatch", "PointerTable", "copy_h_to_d_async",
           "copy_h_to_d_batch_async", "copy_d_to_h_async", "copy_d_to_d_async", "copy_2d_d_to_d_async",
           "memset_d8_async", "memset_d32_async", "mem_info"]


class DeviceBuffer(Owner):
    """``nbytes`` of device memory (cuMemAlloc; NOT zeroed). ``ptr`` is the address, ``bytes`` the size.

    Exports ``__cuda_array_interface__`` (v3, bytes) and ``__dlpack__`` (uint8), so torch, CuPy and JAX take it
    zero-copy; :meth:`view` gives a typed view. Using a closed buffer (``ptr`` included) raises "closed"."""

    _memo_key: object = _args.NO_KEY   # names this open buffer in remembered checks (hss._args.memo_key)

    def __init__(self, nbytes: int, ctx: Any = None) -> None:
        nbytes = _args.as_int("nbytes", nbytes, 1, why="a DeviceBuffer holds at least one byte")
        pctx = owner_context(ctx)
        self._ptr = int(check(api.cuMemAlloc(nbytes), "cuMemAlloc", f"{nbytes} bytes"))
        self._bytes = nbytes
        self._own("cuMemFree", self._ptr, pctx,
                  functools.partial(RANGES.remove, RANGES.add(self._ptr, nbytes, pctx.ordinal)))
        self._memo_key = object()

    @property
    def ptr(self) -> int:
        if not self._open:
            raise HssError(f"this DeviceBuffer ({self._bytes} bytes) is closed")
        return self._ptr

    @property
    def bytes(self) -> int:
        """The size in bytes (fixed: a remembered check of this buffer relies on it)."""
        return self._bytes

    def _on_close(self) -> None:
        self._memo_key = _args.NO_KEY   # a check remembered under the old key is never found again

    @property
    def device(self) -> int:
        """The ordinal of the device this memory is on."""
        return self._pctx.ordinal

    def view(self, dtype: Any, shape: int | Sequence[int] | None = None, offset: int = 0) -> DeviceView:
        """A typed, C-contiguous view of ``shape`` elements of ``dtype`` from byte ``offset`` (default: all that
        fit). ``dtype``: 'bf16', 'f32', 'i32', ... or a numpy / ml_dtypes / torch dtype."""
        return DeviceView(self, dtype, shape, offset)

    @property
    def __cuda_array_interface__(self) -> dict:
        return {"shape": (self.bytes,), "typestr": "|u1", "data": (self.ptr, False), "version": 3,
                "strides": None, "stream": None}

    def __dlpack__(self, *, stream: Any = None, max_version: tuple[int, int] | None = None, dl_device: Any = None,
                   copy: bool | None = None) -> Any:
        """A DLPack capsule of the bytes (``stream`` is not used: hss orders nothing, as with a raw pointer)."""
        _dlpack_checks(dl_device, copy, self.device)
        return _dlpack.export(self, self.ptr, (self.bytes,), "u8", self.device, max_version=max_version)

    def __dlpack_device__(self) -> tuple[int, int]:
        return (_dlpack.KDL_CUDA, self.device)

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"{self._ptr:#x}"
        return f"DeviceBuffer({self.bytes} bytes at {state})"


class DeviceView:
    """A typed, C-contiguous view of part of a :class:`DeviceBuffer` (which it keeps alive).

    ``ptr``, ``nbytes``, ``dtype`` (hss's short name), ``shape``; exports ``__cuda_array_interface__`` (dtypes the
    interface can describe: not bf16) and ``__dlpack__`` (bf16 included). Closed with its buffer."""

    __slots__ = ("buffer", "offset", "dtype", "shape", "nbytes")

    def __init__(self, buffer: DeviceBuffer, dtype: Any, shape: int | Sequence[int] | None = None,
                 offset: int = 0) -> None:
        if not isinstance(buffer, DeviceBuffer):
            raise TypeError(f"buffer must be a DeviceBuffer, got {type(buffer).__name__}")
        name = _args.dtype_name(dtype)
        item = _args.DTYPE_SIZES[name]
        offset = _args.as_int("offset", offset, 0, buffer.bytes)
        if offset % item:
            raise HssError(f"offset {offset} is not a multiple of the {name} item size ({item})")
        if shape is None:
            shape = ((buffer.bytes - offset) // item,)
        elif not isinstance(shape, (tuple, list)):
            shape = (shape,)
        dims = tuple(_args.as_int(f"shape[{i}]", d, 0) for i, d in enumerate(shape))
        nbytes = math.prod(dims) * item
        if offset + nbytes > buffer.bytes:
            raise HssError(f"a {name} view of shape {dims} at offset {offset} needs {offset + nbytes} bytes; the "
                           f"buffer has {buffer.bytes}")
        self.buffer, self.offset, self.dtype, self.shape, self.nbytes = buffer, offset, name, dims, nbytes

    @property
    def ptr(self) -> int:
        return self.buffer.ptr + self.offset

    @property
    def _memo_key(self) -> Any:
        """What this view's checks read (hss._args.memo_key): its buffer's key and its own extent; NO_KEY closed."""
        key = getattr(self.buffer, "_memo_key", _args.NO_KEY)
        return key if key is _args.NO_KEY else (key, self.offset, self.nbytes, self.dtype)

    @property
    def __cuda_array_interface__(self) -> dict:
        typestr = next((k for k, v in _args._TYPESTR.items() if v == self.dtype and k != "|b1"), None)
        if typestr is None:
            raise TypeError(f"the CUDA array interface cannot describe {self.dtype}; use DLPack (torch.from_dlpack)")
        return {"shape": self.shape, "typestr": typestr, "data": (self.ptr, False), "version": 3, "strides": None,
                "stream": None}

    def __dlpack__(self, *, stream: Any = None, max_version: tuple[int, int] | None = None, dl_device: Any = None,
                   copy: bool | None = None) -> Any:
        _dlpack_checks(dl_device, copy, self.buffer.device)
        return _dlpack.export(self, self.ptr, self.shape, self.dtype, self.buffer.device, max_version=max_version)

    def __dlpack_device__(self) -> tuple[int, int]:
        return (_dlpack.KDL_CUDA, self.buffer.device)

    def __repr__(self) -> str:
        return f"DeviceView({self.dtype} {self.shape} at offset {self.offset} of {self.buffer!r})"


def _dlpack_checks(dl_device: Any, copy: bool | None, device: int) -> None:
    if dl_device is not None and tuple(dl_device) != (_dlpack.KDL_CUDA, device):
        raise BufferError(f"hss device memory is on (kDLCUDA, {device}); it cannot be exported to {dl_device}")
    if copy:
        raise BufferError("hss exports device memory without copying (copy=True is not supported)")


def _read_buffer(buf: DeviceBuffer, name: str, stream: int | None) -> DeviceArg:
    if not buf._open:
        raise HssError(f"{name} is a closed DeviceBuffer ({buf._bytes} bytes)")
    return DeviceArg(buf._ptr, buf._bytes)


def _read_view(view: DeviceView, name: str, stream: int | None) -> DeviceArg:
    buf = view.buffer
    if buf.closed:
        raise HssError(f"{name} is a view of a closed DeviceBuffer")
    return DeviceArg(buf._ptr + view.offset, view.nbytes, view.dtype)


def _quick_buffer(buf: DeviceBuffer) -> tuple[int, int, None] | None:
    return (buf._ptr, buf._bytes, None) if buf._open else None


def _quick_view(view: DeviceView) -> tuple[int, int, str] | None:
    buf = view.buffer
    return (buf._ptr + view.offset, view.nbytes, view.dtype) if buf._open else None


_args.register_pointer_type(DeviceBuffer, _read_buffer, _quick_buffer, remembered=True)
_args.register_pointer_type(DeviceView, _read_view, _quick_view, remembered=True)


class PinnedBuffer(Owner):
    """``nbytes`` of page-locked host memory (cuMemAllocHost): truly asynchronous copies.

    ``array`` is a uint8 numpy view; ``view(dtype)`` reinterprets it; ``ptr`` is the host address (also its
    device address under unified addressing)."""

    def __init__(self, nbytes: int, ctx: Any = None) -> None:
        nbytes = _args.as_int("nbytes", nbytes, 1, why="a PinnedBuffer holds at least one byte")
        pctx = owner_context(ctx)
        self._ptr = int(check(api.cuMemAllocHost(nbytes), "cuMemAllocHost", f"{nbytes} bytes"))
        self.bytes = nbytes
        self.array = np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(self._ptr))
        self._own("cuMemFreeHost", self._ptr, pctx, functools.partial(RANGES.remove, RANGES.add(self._ptr, nbytes)))

    @property
    def ptr(self) -> int:
        if self.closed:
            raise HssError(f"this PinnedBuffer ({self.bytes} bytes) is closed")
        return self._ptr

    def _on_close(self) -> None:
        self.array = np.empty(0, dtype=np.uint8)   # no view may outlive the memory

    def view(self, dtype: Any) -> np.ndarray:
        return self.array.view(dtype)

    def device_ptr(self) -> int:
        """The device address of this memory (cuMemHostGetDevicePointer; equal to ``ptr`` with UVA)."""
        self._live_pctx().make_current()
        return int(check(api.cuMemHostGetDevicePointer(self._ptr, 0), "cuMemHostGetDevicePointer"))

    def __repr__(self) -> str:
        return f"PinnedBuffer({self.bytes} bytes{' closed' if self.closed else ''})"


def _read_pinned(buf: PinnedBuffer, name: str, stream: int | None) -> DeviceArg:
    if buf.closed:
        raise HssError(f"{name} is a closed PinnedBuffer ({buf.bytes} bytes)")
    return DeviceArg(buf._ptr, buf.bytes)


_args.register_pointer_type(PinnedBuffer, _read_pinned)   # mapped: a device may read it (UVA)
_args.register_host_type(PinnedBuffer, _read_pinned)


# -- copies, memsets --------------------------------------------------------------------------
def copy_h_to_d_async(dst: Any, src: Any, nbytes: int, stream: Any) -> None:
    """Queue a host-to-device copy on ``stream``. From pageable memory the driver stages ``src``
    before returning (reuse it at once); from a :class:`PinnedBuffer` keep it unchanged until the
    stream reaches the copy."""
    n = _args.as_count("nbytes", nbytes)
    s = _args.stream(stream)
    d = _args.pointer(dst, "copy_h_to_d_async dst", n, write=True, stream=s)
    h = _args.host_buffer(src, n, False, "copy_h_to_d_async src")
    if n:
        ensure_context(s)
        check(api.cuMemcpyHtoDAsync(d, h, n, s), "cuMemcpyHtoDAsync")


def copy_d_to_h_async(dst: Any, src: Any, nbytes: int, stream: Any) -> None:
    """Queue a device-to-host copy on ``stream``. Into pageable memory the driver completes it
    before returning (it is synchronous); into a :class:`PinnedBuffer` it is truly asynchronous:
    wait (``stream_sync`` or an event) before reading."""
    n = _args.as_count("nbytes", nbytes)
    s = _args.stream(stream)
    d = _args.host_buffer(dst, n, True, "copy_d_to_h_async dst")
    p = _args.pointer(src, "copy_d_to_h_async src", n, stream=s)
    if n:
        ensure_context(s)
        check(api.cuMemcpyDtoHAsync(d, p, n, s), "cuMemcpyDtoHAsync")


def _h_to_d_planned(dst: int, src: int, nbytes: int, stream: int) -> None:
    """:func:`copy_h_to_d_async` of values the caller checked (ints: a device address, a pinned host address, a size
    > 0 that fits both, a raw stream handle): hss's own hot loops."""
    ensure_context(stream)
    check(api.cuMemcpyHtoDAsync(dst, src, nbytes, stream), "cuMemcpyHtoDAsync")


def _d_to_h_planned(dst: int, src: int, nbytes: int, stream: int) -> None:
    """:func:`copy_d_to_h_async` of values the caller checked (ints: a pinned host address, a device address, a size
    > 0 that fits both, a raw stream handle): hss's own hot loops."""
    ensure_context(stream)
    check(api.cuMemcpyDtoHAsync(dst, src, nbytes, stream), "cuMemcpyDtoHAsync")


def copy_d_to_d_async(dst: Any, src: Any, nbytes: int, stream: Any) -> None:
    """Queue a device-to-device copy of ``nbytes`` on ``stream``."""
    n = _args.as_count("nbytes", nbytes)
    s = _args.stream(stream)
    d = _args.pointer(dst, "copy_d_to_d_async dst", n, write=True, stream=s)
    p = _args.pointer(src, "copy_d_to_d_async src", n, stream=s)
    if n:
        ensure_context(s)
        check(api.cuMemcpyDtoDAsync(d, p, n, s), "cuMemcpyDtoDAsync")


def copy_2d_d_to_d_async(dst: Any, dst_pitch: int, src: Any, src_pitch: int, width_bytes: int,
                         height: int, stream: Any) -> None:
    """Queue a pitched device-to-device copy: ``height`` rows of ``width_bytes``, rows ``*_pitch`` apart."""
    w, h = _args.as_count("width_bytes", width_bytes), _args.as_count("height", height)
    dp, sp = _args.as_count("dst_pitch", dst_pitch), _args.as_count("src_pitch", src_pitch)
    if h and (w > dp or w > sp):
        raise HssError(f"width_bytes ({w}) exceeds a pitch (dst_pitch {dp}, src_pitch {sp})")
    s = _args.stream(stream)
    if not (w and h):
        return
    d = _args.pointer(dst, "copy_2d_d_to_d_async dst", (h - 1) * dp + w, write=True, stream=s)
    p = _args.pointer(src, "copy_2d_d_to_d_async src", (h - 1) * sp + w, stream=s)
    desc = api.CUDA_MEMCPY2D()
    desc.srcMemoryType = desc.dstMemoryType = api.CUmemorytype.CU_MEMORYTYPE_DEVICE
    desc.srcDevice, desc.srcPitch, desc.dstDevice, desc.dstPitch = p, sp, d, dp
    desc.WidthInBytes, desc.Height = w, h
    ensure_context(s)
    check(api.cuMemcpy2DAsync(desc, s), "cuMemcpy2DAsync", f"{h} rows of {w} bytes")


def memset_d8_async(dst: Any, value: int, count: int, stream: Any) -> None:
    """Queue setting ``count`` bytes at ``dst`` to ``value`` (0..255)."""
    n = _args.as_count("count", count)
    v = _args.as_int("value", value, 0, 0xFF)
    s = _args.stream(stream)
    d = _args.pointer(dst, "memset_d8_async dst", n, write=True, stream=s)
    if n:
        ensure_context(s)
        check(api.cuMemsetD8Async(d, v, n, s), "cuMemsetD8Async")


def memset_d32_async(dst: Any, value: int, count: int, stream: Any) -> None:
    """Queue setting ``count`` 32-bit words at ``dst`` (4-byte aligned) to ``value`` (0..2^32-1: pass the bit
    pattern, e.g. of a float)."""
    n = _args.as_count("count", count)
    v = _args.as_int("value", value, 0, 0xFFFFFFFF, "pass the bit pattern, e.g. of a float")
    s = _args.stream(stream)
    d = _args.pointer(dst, "memset_d32_async dst", 4 * n, 4, write=True, stream=s)
    if n:
        ensure_context(s)
        check(api.cuMemsetD32Async(d, v, n, s), "cuMemsetD32Async")


def mem_info() -> tuple[int, int]:
    """(free, total) bytes of the current device (cuMemGetInfo)."""
    ensure_context()
    free, total = check(api.cuMemGetInfo(), "cuMemGetInfo")
    return int(free), int(total)


# -- host-to-device batches -------------------------------------------------------------------
_batch_attrs: dict[int, Any] = {}   # context handle -> CUmemcpyAttributes of host-to-device batches (None: unsupported)


def _int64s(values: Any, what: str) -> np.ndarray:
    arr = np.asarray(values)
    if arr.size and arr.dtype.kind not in "iu":
        raise TypeError(f"host-to-device batch: {what} must be integers, got {arr.dtype}")
    return arr.astype(np.int64, copy=False).reshape(-1)


class _DevicePointers(dict):
    """The binding's ``CUdeviceptr`` of each address (its batch call takes only those), made once per address and
    kept: the same pool slots and host pages are copied step after step. Bounded: emptied when it reaches
    ``limit`` entries (some 25 MB)."""

    limit = 1 << 18

    def __init__(self, kind: Any) -> None:
        super().__init__()
        self.kind = kind

    def __missing__(self, address: int) -> Any:
        if len(self) >= self.limit:
            self.clear()
        ptr = self[address] = self.kind(address)
        return ptr


_device_ptrs: dict[Any, _DevicePointers] = {}   # the binding's CUdeviceptr type -> its pointer cache


def _pointers(addresses: list[int]) -> list:
    """``CUdeviceptr`` objects of ``addresses`` (ints), from the cache of the binding in use."""
    kind = api.CUdeviceptr
    cache = _device_ptrs.get(kind)
    if cache is None:
        cache = _device_ptrs[kind] = _DevicePointers(kind)
    return list(map(cache.__getitem__, addresses))


class PointerTable:
    """The binding's ``CUdeviceptr`` of each address ``base + i * stride`` (i in 0..count-1), each made on first use
    and kept: :meth:`take` converts table indices (an int64 array, each in range: the caller's) at numpy speed, where
    the process-wide cache costs a dictionary lookup per address. For hss.swap's pool slots and store pages, copied
    step after step."""

    __slots__ = ("base", "stride", "_objs", "_made", "_kind")

    def __init__(self, base: int, stride: int, count: int) -> None:
        self.base, self.stride = int(base), int(stride)
        self._objs = np.empty(_args.as_count("count", count), dtype=object)
        self._made = np.zeros(self._objs.size, dtype=bool)
        self._kind: Any = None

    def take(self, index: np.ndarray) -> list:
        """The ``CUdeviceptr`` of entries ``index`` (int64, each in 0..count-1), as a list."""
        kind = api.CUdeviceptr
        if kind is not self._kind:        # first use (or another binding): nothing made for it yet
            self._made[:] = False
            self._kind = kind
        made = self._made[index]
        if np.count_nonzero(made) != made.size:
            new = index[~made]
            base, stride = self.base, self.stride
            self._objs[new] = [kind(base + i * stride) for i in new.tolist()]
            self._made[new] = True
        return self._objs[index].tolist()


def _check_ranges(ptrs: np.ndarray, nbytes: np.ndarray, lowest: int, name: str) -> None:
    """``RANGES.check_many(ptrs, nbytes, name)`` (``lowest``: ``ptrs.min()``), at once where every range lies in the
    live buffer holding the lowest address (a batch into one pool from one pinned buffer)."""
    live = RANGES.find(lowest)
    if live is None or int((ptrs + nbytes).max()) > live[1]:
        RANGES.check_many(ptrs, nbytes, name)


class HostToDeviceBatch:
    """Host-to-device copies ``dsts[i] <- srcs[i]`` (``nbytes[i]`` each; device addresses and pinned host
    addresses, as int sequences or arrays), checked once, then queued by :meth:`queue` as one
    ``cuMemcpyBatchAsync`` (whole, or in consecutive parts).

    A batch runs in stream order, its copies in any order, so they must not overlap. Construction checks the
    counts, that every size is > 0, every address is non-zero and every destination range against the live hss
    buffers, vectorized; ``queue`` only builds the driver's argument lists (each address's ``CUdeviceptr`` made once
    per process and reused) and makes the call, so keep the destinations alive until then. Where the driver or
    binding has no batch call, ``queue`` makes one ``cuMemcpyHtoDAsync`` per copy.
    """

    __slots__ = ("_d", "_s", "_n", "_tables", "_lists")

    def __init__(self, dsts: Any, srcs: Any, nbytes: Any) -> None:
        d, s, n = _int64s(dsts, "destinations"), _int64s(srcs, "sources"), _int64s(nbytes, "sizes")
        if not d.size == s.size == n.size:
            raise HssError(f"host-to-device batch: {d.size} destinations, {s.size} sources, {n.size} sizes")
        if n.size and n.min() <= 0:
            raise HssError(f"host-to-device batch: sizes must be > 0 (got {int(n[n <= 0][0])})")
        if d.size:
            low_d, low_s = int(d.min()), int(s.min())
            if low_d <= 0 or low_s <= 0:
                raise HssError("host-to-device batch: addresses must be non-zero (a null pointer was given)")
            _check_ranges(d, n, low_d, "host-to-device batch dst")
            _check_ranges(s, n, low_s, "host-to-device batch src")
        self._d, self._s, self._n = d.copy(), s.copy(), n.copy()   # our own: queued later, as checked
        self._tables: tuple | None = None   # where the CUdeviceptr come from (_planned); None: the process-wide cache
        self._lists: tuple[list, list, list] | None = None    # sizes and the CUdeviceptr of each copy (queue)

    @classmethod
    def _planned(cls, nbytes: np.ndarray, dst_table: PointerTable, dst_index: np.ndarray, src_table: PointerTable,
                 src_index: np.ndarray) -> HostToDeviceBatch:
        """A batch of copies the caller computed inside live hss buffers, with none of the construction's checks
        (hss.swap's reads into its pool): copy i of ``nbytes[i]`` (> 0) from entry ``src_index[i]`` of ``src_table``
        to entry ``dst_index[i]`` of ``dst_table`` (int64 arrays of one size, the caller's: adopted, not copied)."""
        self = cls.__new__(cls)
        self._n, self._tables, self._lists = nbytes, (dst_table, dst_index, src_table, src_index), None
        self._d = self._s = None      # the addresses, made only where a copy is queued by itself (see queue)
        return self

    def __len__(self) -> int:
        return int(self._n.size)

    @property
    def nbytes(self) -> int:
        """Bytes of all the copies."""
        return int(self._n.sum())

    def queue(self, stream: Any, start: int = 0, stop: int | None = None) -> None:
        """Queue copies ``[start, stop)`` (default: all) on ``stream`` as one batch; nothing when that is empty."""
        lists = self._lists
        if lists is None:     # the batch call's arguments of every copy, made once (a part's are slices of them)
            t = self._tables
            if t is None:
                lists = (self._n.tolist(), _pointers(self._d.tolist()), _pointers(self._s.tolist()))
            else:
                lists = (self._n.tolist(), t[0].take(t[1]), t[2].take(t[3]))
            self._lists = lists
        n = lists[0][start:stop]
        count = len(n)
        if not count:
            return
        s = _args.stream(stream)
        ensure_context(s)
        key = thread_state.pctx.handle   # type: ignore[union-attr]
        attr = _batch_attrs.get(key, False)   # False: not tried in this context yet; None: no batch call here
        batch = getattr(api, "cuMemcpyBatchAsync", None)
        if batch is not None and attr is not None:
            if attr is False:
                attr = api.CUmemcpyAttributes()
                attr.srcAccessOrder = api.CUmemcpySrcAccessOrder.CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
                attr.srcLocHint.type = api.CUmemLocationType.CU_MEM_LOCATION_TYPE_HOST
                attr.dstLocHint.type = api.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
                attr.dstLocHint.id = int(check(api.cuCtxGetDevice(), "cuCtxGetDevice"))
            err = batch(lists[1][start:stop], lists[2][start:stop], n, count, [attr], [0], 1, s)[0]
            if not err:
                _batch_attrs[key] = attr
                return
            if getattr(err, "name", "") != "CUDA_ERROR_NOT_SUPPORTED" or key in _batch_attrs:
                check((err,), "cuMemcpyBatchAsync", f"{count} host-to-device copies")
            _batch_attrs[key] = None   # not supported here: one call per copy from now on
        if self._d is None:
            dt, di, st, si = self._tables    # type: ignore[misc]
            self._d, self._s = dt.base + di * dt.stride, st.base + si * st.stride
        for dv, xv, nv in zip(self._d[start:stop].tolist(), self._s[start:stop].tolist(), n):
            check(api.cuMemcpyHtoDAsync(dv, xv, nv, s), "cuMemcpyHtoDAsync")

    def __repr__(self) -> str:
        return f"HostToDeviceBatch({len(self)} copies, {self.nbytes} bytes)"


def copy_h_to_d_batch_async(dsts: Sequence[int], srcs: Sequence[int], nbytes: Sequence[int], stream: Any) -> None:
    """Queue host-to-device copies ``dsts[i] <- srcs[i]`` (``nbytes[i]`` each; ints: device addresses and
    pinned host addresses) as ONE batch (cuMemcpyBatchAsync): the batch runs in stream order, its copies in
    any order, so they must not overlap. Far cheaper on the host than one call per copy, and the DMA engine
    keeps its bandwidth on mid-size copies. Falls back to one cuMemcpyHtoDAsync per copy where the driver
    or binding has no batch call. :class:`HostToDeviceBatch` checks once and queues later, in parts."""
    HostToDeviceBatch(dsts, srcs, nbytes).queue(stream)
