"""The subset of ``cuda.bindings.driver`` that hss calls, executed on the CPU.

Every function returns ``(CUresult, *values)`` like the real binding. ``HSS_EMULATOR_DEVICES`` emulated
devices (default 1, at most 8; compute capability 9.0, like an H200), each with one primary context;
``HSS_EMULATOR_MEMORY`` sets each one's memory in bytes (default 8 GiB). The current context is tracked per
thread, and calls that need one fail with ``CUDA_ERROR_INVALID_CONTEXT`` on a thread that has none current, as on
a GPU. All devices share one address space (unified addressing): copies between them work, but a kernel, or the
emulated cuBLAS, reading or writing another device's memory faults (no peer access), and a launch or event record
on a stream of another context is refused (``CUDA_ERROR_INVALID_HANDLE``).
"""
from __future__ import annotations

import enum
import itertools
import os
import threading
from typing import Any

import numpy as np

from .enums import (  # noqa: F401
    CUDA_MEMCPY2D,
    ERROR_STRINGS,
    CUdevice_attribute,
    CUdeviceptr,
    CUmemcpyAttributes,
    CUmemcpySrcAccessOrder,
    CUmemLocationType,
    CUmemorytype,
    CUresult,
    CUstreamCaptureMode,
)
from .memory import Arena, MemoryFault, host_view
from .streams import CaptureGroup, Dep, Event, Graph, GraphExec, Stream

R = CUresult
DRIVER_VERSION = 13000
DEVICE_NAME = b"hss CPU emulator (H200-like, sm_90)"
ATTRIBUTES = {
    CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK: 1024,
    CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK: 48 * 1024,
    CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT: 132,
    CUdevice_attribute.CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING: 1,
    CUdevice_attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: 9,
    CUdevice_attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: 0,
    CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN: 227 * 1024,
}
LEGACY_STREAMS = (0, 1, 2)   # NULL, CU_STREAM_LEGACY, CU_STREAM_PER_THREAD all map to the legacy stream
MAX_DEVICES = 8
CTX_BASE, CTX_STEP = 0xC0_0000, 0x100   # device d's primary context handle: CTX_BASE + d * CTX_STEP


def _device_count() -> int:
    raw = os.environ.get("HSS_EMULATOR_DEVICES", "").strip() or "1"
    n = int(raw) if raw.isdigit() else 0
    if not 1 <= n <= MAX_DEVICES:
        raise ValueError(f"HSS_EMULATOR_DEVICES={raw!r}: the emulator offers 1 to {MAX_DEVICES} devices")
    return n


class CUstreamCaptureStatus(enum.IntEnum):
    CU_STREAM_CAPTURE_STATUS_NONE = 0
    CU_STREAM_CAPTURE_STATUS_ACTIVE = 1
    CU_STREAM_CAPTURE_STATUS_INVALIDATED = 2


class _State:
    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.tls = threading.local()
        self.initialised = False
        self.devices = _device_count()
        self.arena = Arena(int(os.environ.get("HSS_EMULATOR_MEMORY", 8 << 30)), self.devices)
        self.ids = itertools.count(0x1000)
        self.capture_ids = itertools.count(1)   # capture sequence ids, unique over the process (as the driver's)
        self.ctx_handles = tuple(CTX_BASE + d * CTX_STEP for d in range(self.devices))
        self.ctx_device = {h: d for d, h in enumerate(self.ctx_handles)}
        self.ctx_refs = [0] * self.devices
        self.streams: dict[int, Stream] = {}
        self.events: dict[int, Event] = {}
        self.graphs: dict[int, Graph] = {}
        self.execs: dict[int, GraphExec] = {}
        self.modules: dict[int, Any] = {}      # module handle -> emulator.launch.Module
        self.functions: dict[int, Any] = {}    # function handle -> emulator.launch.Function
        self.faults: list[BaseException] = []  # faults of queued work not yet reported
        self.legacy = [Stream(0, h, True, self.faults) for h in self.ctx_handles]   # one per context

    def current(self) -> int:
        return getattr(self.tls, "ctx", 0)

    def device(self) -> int:
        """The ordinal of the current context's device (0 when none is current)."""
        return self.ctx_device.get(self.current(), 0)


S = _State()


def _needs_ctx() -> R | None:
    if not S.initialised:
        return R.CUDA_ERROR_NOT_INITIALIZED
    d = S.ctx_device.get(S.current())
    if d is None or S.ctx_refs[d] == 0:
        return R.CUDA_ERROR_INVALID_CONTEXT
    return None


def stream_of(handle: Any) -> Stream | None:
    """The stream of ``handle``; the legacy handles name the current context's legacy stream."""
    h = int(handle)
    if h in LEGACY_STREAMS:
        return S.legacy[S.device()]
    return S.streams.get(h)


def view_on(device: int, addr: int, nbytes: int, what: str) -> np.ndarray:
    """``S.arena.view`` for work running on ``device``: another device's memory faults (no peer access); pinned
    host memory is reachable from every device."""
    view = S.arena.view(addr, nbytes, what)
    if nbytes:
        a = S.arena.find(addr)
        if a is not None and a.kind == "device" and a.device != device:
            raise MemoryFault(f"{what}: address {addr:#x} is device {a.device}'s memory, but the work runs on "
                              f"device {device} (peer access is not enabled)")
    return view


def enqueue(stream: Stream, op: Any) -> None:
    """Queue ``op`` on ``stream`` (or its capture), with the legacy-stream ordering of blocking streams."""
    if stream.capture is not None:
        stream.capture.append(op)
        if stream.capture_group is not None:
            stream.capture_group.work[stream.capture_lane] = len(stream.capture)
        return
    legacy = S.legacy[S.ctx_device[stream.ctx]]   # the legacy stream orders the blocking streams of its context
    if stream is legacy:
        for other in list(S.streams.values()):
            if other.ctx == stream.ctx and other.blocking and other.submitted > other.done:
                pos = other.submitted
                stream.push(lambda o=other, p=pos: o.run_to(p))
    elif stream.blocking and legacy.submitted > legacy.done:
        pos = legacy.submitted
        stream.push(lambda p=pos: legacy.run_to(p))
    stream.push(op)


def drain_all(ctx: int | None = None) -> None:
    """Run every queued operation (of context ``ctx``'s streams only, when given)."""
    for st in [*S.legacy, *S.streams.values()]:
        if ctx is None or st.ctx == ctx:
            st.drain()


def report_faults() -> None:
    """Raise the first fault of queued work not yet reported (the rest were consequences or repeats)."""
    if S.faults:
        first = S.faults[0]
        S.faults.clear()
        raise first


def keep_fault(exc: BaseException) -> None:
    """Put back a fault that a caller could not report (a finalizer): the next synchronising call raises it."""
    S.faults.insert(0, exc)


# -- init, device, context --------------------------------------------------------------------
def cuInit(flags: int) -> tuple:
    S.initialised = True
    return (R.CUDA_SUCCESS,)


def cuDriverGetVersion() -> tuple:
    return (R.CUDA_SUCCESS, DRIVER_VERSION)


def cuDeviceGetCount() -> tuple:
    return (R.CUDA_SUCCESS, S.devices) if S.initialised else (R.CUDA_ERROR_NOT_INITIALIZED, 0)


def _is_dev(dev: Any) -> bool:
    return 0 <= int(dev) < S.devices


def cuDeviceGet(ordinal: int) -> tuple:
    if not S.initialised:
        return (R.CUDA_ERROR_NOT_INITIALIZED, None)
    return (R.CUDA_SUCCESS, int(ordinal)) if _is_dev(ordinal) else (R.CUDA_ERROR_INVALID_DEVICE, None)


def cuDeviceGetName(length: int, dev: int) -> tuple:
    if not _is_dev(dev):
        return (R.CUDA_ERROR_INVALID_DEVICE, None)
    return (R.CUDA_SUCCESS, DEVICE_NAME[: length - 1].ljust(length, b"\0"))


def cuDeviceTotalMem(dev: int) -> tuple:
    return (R.CUDA_SUCCESS, S.arena.total) if _is_dev(dev) else (R.CUDA_ERROR_INVALID_DEVICE, None)


def cuDeviceGetAttribute(attrib: Any, dev: int) -> tuple:
    if not _is_dev(dev):
        return (R.CUDA_ERROR_INVALID_DEVICE, None)
    value = ATTRIBUTES.get(int(attrib))
    return (R.CUDA_SUCCESS, value) if value is not None else (R.CUDA_ERROR_INVALID_VALUE, None)


def cuDevicePrimaryCtxRetain(dev: int) -> tuple:
    if not S.initialised:
        return (R.CUDA_ERROR_NOT_INITIALIZED, None)
    if not _is_dev(dev):
        return (R.CUDA_ERROR_INVALID_DEVICE, None)
    with S.lock:
        S.ctx_refs[int(dev)] += 1
    return (R.CUDA_SUCCESS, S.ctx_handles[int(dev)])


def cuDevicePrimaryCtxRelease(dev: int) -> tuple:
    if not _is_dev(dev):
        return (R.CUDA_ERROR_INVALID_DEVICE,)
    d = int(dev)
    with S.lock:
        if S.ctx_refs[d] == 0:
            return (R.CUDA_ERROR_INVALID_CONTEXT,)
        S.ctx_refs[d] -= 1
        if S.ctx_refs[d] == 0:      # the primary context is destroyed: everything made in it goes
            h = S.ctx_handles[d]
            drain_all(h)
            for a in S.arena.live():
                if a.device == d:
                    S.arena.free(a.base, a.kind)
            for table in (S.streams, S.events, S.modules):
                for k in [k for k, v in table.items() if v.ctx == h]:
                    del table[k]
            for k in [k for k, f in S.functions.items() if f.module.ctx == h]:
                del S.functions[k]
    report_faults()
    return (R.CUDA_SUCCESS,)


def cuDevicePrimaryCtxGetState(dev: int) -> tuple:
    """(flags, active): active while the primary context is retained."""
    if not _is_dev(dev):
        return (R.CUDA_ERROR_INVALID_DEVICE, None, None)
    return (R.CUDA_SUCCESS, 0, 1 if S.ctx_refs[int(dev)] else 0)


def cuCtxSetCurrent(ctx: Any) -> tuple:
    h = int(ctx) if ctx is not None else 0
    if h and h not in S.ctx_device:
        return (R.CUDA_ERROR_INVALID_CONTEXT,)
    S.tls.ctx = h
    return (R.CUDA_SUCCESS,)


def cuCtxGetCurrent() -> tuple:
    return (R.CUDA_SUCCESS, S.current())


def cuCtxGetDevice() -> tuple:
    err = _needs_ctx()
    return (err, None) if err else (R.CUDA_SUCCESS, S.device())


def cuCtxSynchronize() -> tuple:
    err = _needs_ctx()
    if err:
        return (err,)
    with S.lock:
        drain_all(S.current())
    report_faults()
    return (R.CUDA_SUCCESS,)


def cuGetErrorName(err: Any) -> tuple:
    try:
        return (R.CUDA_SUCCESS, R(int(err)).name.encode())
    except ValueError:
        return (R.CUDA_ERROR_INVALID_VALUE, None)


def cuGetErrorString(err: Any) -> tuple:
    try:
        return (R.CUDA_SUCCESS, ERROR_STRINGS[R(int(err))].encode())
    except (ValueError, KeyError):
        return (R.CUDA_ERROR_INVALID_VALUE, None)


# -- memory -----------------------------------------------------------------------------------
def cuMemGetInfo() -> tuple:
    err = _needs_ctx()
    if err:
        return (err, None, None)
    return (R.CUDA_SUCCESS, S.arena.total - S.arena.used_on[S.device()], S.arena.total)


def cuMemAlloc(nbytes: int) -> tuple:
    err = _needs_ctx()
    if err:
        return (err, None)
    if int(nbytes) == 0:
        return (R.CUDA_ERROR_INVALID_VALUE, None)
    with S.lock:
        base = S.arena.alloc_device(int(nbytes), S.device())
    return (R.CUDA_SUCCESS, base) if base is not None else (R.CUDA_ERROR_OUT_OF_MEMORY, None)


def cuMemFree(ptr: Any) -> tuple:
    err = _needs_ctx()
    if err:
        return (err,)
    with S.lock:
        drain_all()   # cuMemFree waits for work in flight, as the real driver does
        ok = S.arena.free(int(ptr), "device")
    report_faults()   # after the free: a fault never keeps memory allocated
    return (R.CUDA_SUCCESS,) if ok else (R.CUDA_ERROR_INVALID_VALUE,)


def cuMemAllocHost(nbytes: int) -> tuple:
    err = _needs_ctx()
    if err:
        return (err, None)
    with S.lock:
        return (R.CUDA_SUCCESS, S.arena.alloc_pinned(int(nbytes), S.device()))


def cuMemFreeHost(ptr: Any) -> tuple:
    with S.lock:
        drain_all()
        ok = S.arena.free(int(ptr), "pinned")
    report_faults()
    return (R.CUDA_SUCCESS,) if ok else (R.CUDA_ERROR_INVALID_VALUE,)


def cuMemHostGetDevicePointer(ptr: Any, flags: int) -> tuple:
    """The device address of pinned memory: its own address (unified addressing; the device reads it in place)."""
    if int(flags) != 0 or not S.arena.is_pinned(int(ptr)):     # the driver takes flags 0 only
        return (R.CUDA_ERROR_INVALID_VALUE, None)
    return (R.CUDA_SUCCESS, int(ptr))


def _host_addr(obj: Any) -> int:
    if isinstance(obj, int):
        return obj
    return np.frombuffer(obj, dtype=np.uint8).ctypes.data


def _is_device(addr: int) -> bool:
    a = S.arena.find(addr)
    return a is not None and a.kind == "device"


def _copy_op(dst: np.ndarray, src: np.ndarray) -> Any:
    def op() -> None:
        dst[:] = src
    return op


def _stream_or_err(hstream: Any) -> tuple[Stream | None, R | None]:
    err = _needs_ctx()
    if err:
        return None, err
    st = stream_of(hstream)
    return (st, None) if st is not None else (None, R.CUDA_ERROR_INVALID_HANDLE)


def cuMemcpyHtoDAsync(dst: Any, src: Any, nbytes: int, hstream: Any) -> tuple:
    st, err = _stream_or_err(hstream)
    if err:
        return (err,)
    n, saddr = int(nbytes), _host_addr(src)
    if _is_device(saddr):
        return (R.CUDA_ERROR_INVALID_VALUE,)   # a device address passed as the host source
    with S.lock:
        dview = S.arena.view(int(dst), n, "cuMemcpyHtoDAsync destination")
        if S.arena.is_pinned(saddr):
            sview = S.arena.view(saddr, n, "cuMemcpyHtoDAsync pinned source")   # read when the copy runs
        else:
            if st.capture is not None:
                return (R.CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED,)
            sview = host_view(saddr, n).copy()   # pageable: the driver stages it before returning
        enqueue(st, _copy_op(dview, sview))
    return (R.CUDA_SUCCESS,)


def cuMemcpyBatchAsync(dsts: Any, srcs: Any, sizes: Any, count: int, attrs: Any, attrs_idxs: Any, num_attrs: int,
                       hstream: Any) -> tuple:
    """Host-to-device batches only (what hss queues); each copy as cuMemcpyHtoDAsync, in order."""
    count = int(count)
    if not (len(dsts) == len(srcs) == len(sizes) == count) or count == 0 or int(num_attrs) != len(attrs) \
            or not 1 <= len(attrs) <= count or list(attrs_idxs)[:1] != [0]:
        return (R.CUDA_ERROR_INVALID_VALUE,)
    if any(a.srcAccessOrder != CUmemcpySrcAccessOrder.CU_MEMCPY_SRC_ACCESS_ORDER_STREAM for a in attrs):
        return (R.CUDA_ERROR_NOT_SUPPORTED,)
    for d, s, n in zip(dsts, srcs, sizes):
        err = cuMemcpyHtoDAsync(int(d), int(s), int(n), hstream)[0]
        if err:
            return (err,)
    return (R.CUDA_SUCCESS,)


def cuMemcpyDtoHAsync(dst: Any, src: Any, nbytes: int, hstream: Any) -> tuple:
    st, err = _stream_or_err(hstream)
    if err:
        return (err,)
    n, daddr = int(nbytes), _host_addr(dst)
    if _is_device(daddr):
        return (R.CUDA_ERROR_INVALID_VALUE,)
    with S.lock:
        sview = S.arena.view(int(src), n, "cuMemcpyDtoHAsync source")
        if S.arena.is_pinned(daddr):
            enqueue(st, _copy_op(S.arena.view(daddr, n, "cuMemcpyDtoHAsync pinned destination"), sview))
        else:
            if st.capture is not None:
                return (R.CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED,)
            st.drain()        # pageable destination: the real driver completes the copy before returning
            host_view(daddr, n)[:] = sview
            report_faults()
    return (R.CUDA_SUCCESS,)


def cuMemcpyDtoDAsync(dst: Any, src: Any, nbytes: int, hstream: Any) -> tuple:
    st, err = _stream_or_err(hstream)
    if err:
        return (err,)
    n = int(nbytes)
    with S.lock:
        dview = S.arena.view(int(dst), n, "cuMemcpyDtoDAsync destination")
        sview = S.arena.view(int(src), n, "cuMemcpyDtoDAsync source")
        enqueue(st, lambda: dview.__setitem__(slice(None), sview.copy()))
    return (R.CUDA_SUCCESS,)


def cuMemcpy2DAsync(p: Any, hstream: Any) -> tuple:
    st, err = _stream_or_err(hstream)
    if err:
        return (err,)
    dev = int(CUmemorytype.CU_MEMORYTYPE_DEVICE)
    if int(p.srcMemoryType) != dev or int(p.dstMemoryType) != dev:
        return (R.CUDA_ERROR_NOT_SUPPORTED,)   # hss only issues device-to-device 2-D copies
    w, h = int(p.WidthInBytes), int(p.Height)
    sp, dp = int(p.srcPitch), int(p.dstPitch)
    if h and (w > sp or w > dp):
        return (R.CUDA_ERROR_INVALID_VALUE,)
    if w == 0 or h == 0:
        return (R.CUDA_SUCCESS,)
    src0 = int(p.srcDevice) + int(p.srcXInBytes) + int(p.srcY) * sp
    dst0 = int(p.dstDevice) + int(p.dstXInBytes) + int(p.dstY) * dp
    with S.lock:
        sview = S.arena.view(src0, (h - 1) * sp + w, "cuMemcpy2DAsync source")
        dview = S.arena.view(dst0, (h - 1) * dp + w, "cuMemcpy2DAsync destination")

        def op() -> None:
            rows = np.lib.stride_tricks.as_strided(sview, (h, w), (sp, 1)).copy()
            np.lib.stride_tricks.as_strided(dview, (h, w), (dp, 1))[:] = rows
        enqueue(st, op)
    return (R.CUDA_SUCCESS,)


def _memset(dst: Any, value: int, count: int, hstream: Any, dtype: type, call: str) -> tuple:
    st, err = _stream_or_err(hstream)
    if err:
        return (err,)
    n = int(count)
    item = np.dtype(dtype).itemsize
    if int(dst) % item:
        return (R.CUDA_ERROR_INVALID_VALUE,)
    with S.lock:
        view = S.arena.view(int(dst), n * item, f"{call} destination").view(dtype)
        enqueue(st, lambda: view.fill(dtype(int(value))))
    return (R.CUDA_SUCCESS,)


def cuMemsetD8Async(dst: Any, value: int, count: int, hstream: Any) -> tuple:
    return _memset(dst, int(value) & 0xFF, count, hstream, np.uint8, "cuMemsetD8Async")


def cuMemsetD32Async(dst: Any, value: int, count: int, hstream: Any) -> tuple:
    return _memset(dst, int(value) & 0xFFFFFFFF, count, hstream, np.uint32, "cuMemsetD32Async")


# -- streams, events, graphs ------------------------------------------------------------------
def cuStreamCreate(flags: int) -> tuple:
    err = _needs_ctx()
    if err:
        return (err, None)
    with S.lock:
        h = next(S.ids)
        S.streams[h] = Stream(h, S.current(), not (int(flags) & 1), S.faults)
    return (R.CUDA_SUCCESS, h)


def cuStreamGetCtx(hstream: Any) -> tuple:
    """The context of a stream (a legacy handle: the current context's, so one must be current)."""
    st = S.streams.get(int(hstream))
    if st is not None:
        return (R.CUDA_SUCCESS, st.ctx)
    st, err = _stream_or_err(hstream)
    return (err, None) if err else (R.CUDA_SUCCESS, st.ctx)


def cuStreamDestroy(hstream: Any) -> tuple:
    with S.lock:
        st = S.streams.pop(int(hstream), None)
        if st is None:
            return (R.CUDA_ERROR_INVALID_HANDLE,)
        st.drain()   # destroying a stream lets its queued work finish
    report_faults()
    return (R.CUDA_SUCCESS,)


def cuStreamSynchronize(hstream: Any) -> tuple:
    st, err = _stream_or_err(hstream)
    if err:
        return (err,)
    if st.capture is not None:
        st.capture_broken = True
        return (R.CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED,)
    with S.lock:
        st.drain()
    report_faults()
    return (R.CUDA_SUCCESS,)


def cuStreamQuery(hstream: Any) -> tuple:
    st, err = _stream_or_err(hstream)
    if err:
        return (err,)
    return (R.CUDA_SUCCESS,) if st.done == st.submitted else (R.CUDA_ERROR_NOT_READY,)


def cuEventCreate(flags: int) -> tuple:
    err = _needs_ctx()
    if err:
        return (err, None)
    with S.lock:
        h = next(S.ids)
        S.events[h] = Event(h, timing=not (int(flags) & 2), ctx=S.current())
    return (R.CUDA_SUCCESS, h)


def cuEventDestroy(hevent: Any) -> tuple:
    return (R.CUDA_SUCCESS,) if S.events.pop(int(hevent), None) else (R.CUDA_ERROR_INVALID_HANDLE,)


def cuEventRecord(hevent: Any, hstream: Any) -> tuple:
    st, err = _stream_or_err(hstream)
    if err:
        return (err,)
    ev = S.events.get(int(hevent))
    if ev is None or ev.ctx != st.ctx:   # an event records on a stream of its own context only
        return (R.CUDA_ERROR_INVALID_HANDLE,)
    with S.lock:
        ev.time = None
        if st.capture is None:
            enqueue(st, ev.record_op())
            ev.stream, ev.position, ev.captured = st, st.submitted, None
        else:   # a captured record orders nothing outside the graph; inside it, it marks a lane position
            st.capture.append(ev.record_op())      # not work: a lane ending in records is joined
            ev.stream, ev.position = None, 0
            ev.captured = (st.capture_group, st.capture_lane, len(st.capture))
    return (R.CUDA_SUCCESS,)


def cuEventSynchronize(hevent: Any) -> tuple:
    ev = S.events.get(int(hevent))
    if ev is None:
        return (R.CUDA_ERROR_INVALID_HANDLE,)
    with S.lock:
        if ev.stream is not None:
            ev.stream.run_to(ev.position)
    report_faults()
    return (R.CUDA_SUCCESS,)


def cuEventQuery(hevent: Any) -> tuple:
    ev = S.events.get(int(hevent))
    if ev is None:
        return (R.CUDA_ERROR_INVALID_HANDLE,)
    return (R.CUDA_ERROR_NOT_READY,) if ev.pending() else (R.CUDA_SUCCESS,)


def cuEventElapsedTime(start: Any, end: Any) -> tuple:
    a, b = S.events.get(int(start)), S.events.get(int(end))
    if a is None or b is None or not (a.timing and b.timing):
        return (R.CUDA_ERROR_INVALID_HANDLE, None)
    if a.pending() or b.pending() or a.time is None or b.time is None:
        return (R.CUDA_ERROR_NOT_READY, None)
    return (R.CUDA_SUCCESS, (b.time - a.time) * 1000.0)


def cuStreamWaitEvent(hstream: Any, hevent: Any, flags: int) -> tuple:
    st, err = _stream_or_err(hstream)
    if err:
        return (err,)
    ev = S.events.get(int(hevent))
    if ev is None:
        return (R.CUDA_ERROR_INVALID_HANDLE,)
    with S.lock:
        cap = ev.captured
        if cap is not None and cap[0].active:
            return _captured_wait(st, *cap)
        if ev.stream is not None and ev.stream is not st:
            if st.capture is not None:
                return (R.CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED,)
            other, pos = ev.stream, ev.position
            enqueue(st, lambda: other.run_to(pos))
    return (R.CUDA_SUCCESS,)


def _captured_wait(st: Stream, group: CaptureGroup, lane: int, pos: int) -> tuple:
    """``st`` waits for lane ``lane`` of capture ``group`` up to ``pos``: a stream not capturing joins the capture
    (the fork); one of another capture may not."""
    if st.capture is None:
        if st.handle == 0:
            return (R.CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED,)
        group.join(st)
    elif st.capture_group is not group:
        return (R.CUDA_ERROR_STREAM_CAPTURE_ISOLATION,)
    if lane != st.capture_lane:
        st.capture.append(Dep(lane, pos))
        group.work[st.capture_lane] = len(st.capture)
        group.waited[lane] = max(group.waited[lane], pos)
    return (R.CUDA_SUCCESS,)


def cuStreamBeginCapture(hstream: Any, mode: Any) -> tuple:
    st, err = _stream_or_err(hstream)
    if err:
        return (err,)
    if st.handle == 0:   # a legacy stream
        return (R.CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED,)
    CUstreamCaptureMode(int(mode))
    if st.capture is not None:
        return (R.CUDA_ERROR_ILLEGAL_STATE,)
    st.capture, st.capture_broken = [], False
    st.capture_id = next(S.capture_ids)
    st.capture_group, st.capture_lane = CaptureGroup(st.capture_id, st), 0
    return (R.CUDA_SUCCESS,)


def _capture_status(st: Stream) -> CUstreamCaptureStatus:
    if st.capture is None:
        return CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_NONE
    group = st.capture_group
    if st.capture_broken or (group is not None and any(lane.capture_broken for lane in group.lanes)):
        return CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_INVALIDATED
    return CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_ACTIVE


def cuStreamIsCapturing(hstream: Any) -> tuple:
    st, err = _stream_or_err(hstream)
    if err:
        return (err, None)
    return (R.CUDA_SUCCESS, _capture_status(st))


def cuStreamGetCaptureInfo(hstream: Any) -> tuple:
    """(status, id, graph, dependencies, edge data, count) as the 13.x binding returns them; the id is valid while
    the status is ACTIVE (0 otherwise); graph and dependencies are not emulated (None, 0)."""
    st, err = _stream_or_err(hstream)
    if err:
        return (err, None, None, None, None, None, None)
    status = _capture_status(st)
    cid = getattr(st, "capture_id", 0) if status == CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_ACTIVE else 0
    return (R.CUDA_SUCCESS, status, cid, None, None, None, 0)


def cuStreamEndCapture(hstream: Any) -> tuple:
    st, err = _stream_or_err(hstream)
    if err:
        return (err, None)
    if st.capture is None:
        return (R.CUDA_ERROR_STREAM_CAPTURE_UNMATCHED, None)
    group = st.capture_group
    if group is not None and group.lanes[0] is not st:   # a stream that joined a capture cannot end it
        return (R.CUDA_ERROR_STREAM_CAPTURE_UNMATCHED, None)
    lanes = group.lanes if group is not None else [st]
    ops = [lane.capture for lane in lanes]
    broken = any(lane.capture_broken for lane in lanes)
    unjoined = group is not None and group.unjoined()
    for lane in lanes:   # the capture ends for every lane, joined or not (the driver invalidates it)
        lane.capture, lane.capture_broken, lane.capture_group, lane.capture_lane = None, False, None, 0
    if group is not None:
        group.active = False
    if broken:
        return (R.CUDA_ERROR_STREAM_CAPTURE_INVALIDATED, None)
    if unjoined:
        return (R.CUDA_ERROR_STREAM_CAPTURE_UNJOINED, None)
    with S.lock:
        h = next(S.ids)
        S.graphs[h] = Graph(h, ops[0], ops)
    return (R.CUDA_SUCCESS, h)


def cuGraphInstantiate(hgraph: Any, flags: int = 0) -> tuple:
    g = S.graphs.get(int(hgraph))
    if g is None:
        return (R.CUDA_ERROR_INVALID_HANDLE, None)
    with S.lock:
        h = next(S.ids)
        S.execs[h] = GraphExec(h, g)
    return (R.CUDA_SUCCESS, h)


def cuGraphLaunch(hexec: Any, hstream: Any) -> tuple:
    st, err = _stream_or_err(hstream)
    if err:
        return (err,)
    ex = S.execs.get(int(hexec))
    if ex is None:
        return (R.CUDA_ERROR_INVALID_HANDLE,)
    with S.lock:
        if len(ex.lanes) == 1:
            for op in ex.ops:
                enqueue(st, op)
        else:
            _launch_lanes(st, ex.lanes)
    return (R.CUDA_SUCCESS,)


def _launch_lanes(st: Stream, lanes: list[list]) -> None:
    """Queue a forked graph: lane 0 on ``st``, every other lane on a private stream of its own (run only when a wait
    reaches it, like any stream); each :class:`Dep` becomes a wait for its lane's position."""
    subs = [st] + [Stream(-1, st.ctx, False, S.faults) for _ in lanes[1:]]
    after: list[int] = []   # position of st after each operation of lane 0 (known before any op runs)

    def wait(d: Dep) -> Any:
        if d.lane == 0:
            return lambda: st.run_to(after[d.pos - 1]) if d.pos else None
        sub = subs[d.lane]
        return lambda: sub.run_to(d.pos)

    for sub, lane in zip(subs[1:], lanes[1:]):
        for op in lane:
            sub.push(wait(op) if isinstance(op, Dep) else op)
    for op in lanes[0]:
        enqueue(st, wait(op) if isinstance(op, Dep) else op)
        after.append(st.submitted)


def cuGraphDestroy(hgraph: Any) -> tuple:
    return (R.CUDA_SUCCESS,) if S.graphs.pop(int(hgraph), None) else (R.CUDA_ERROR_INVALID_HANDLE,)


def cuGraphExecDestroy(hexec: Any) -> tuple:
    return (R.CUDA_SUCCESS,) if S.execs.pop(int(hexec), None) else (R.CUDA_ERROR_INVALID_HANDLE,)


__all__ = [n for n in dir() if n.startswith("cu")] + ["keep_fault",
    "CUDA_MEMCPY2D", "CUmemorytype", "CUresult", "CUdevice_attribute", "CUstreamCaptureMode",
    "CUstreamCaptureStatus", "CUdeviceptr",
    "CUmemcpyAttributes", "CUmemcpySrcAccessOrder", "CUmemLocationType"]
