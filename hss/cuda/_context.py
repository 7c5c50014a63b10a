"""Contexts, streams and events (part of :mod:`hss.cuda_min`, which re-exports the public names).

Every owner holds the primary context it was made in: a device's primary context is retained once while any
hss object uses it and released when the last one closes (or is collected). Every call makes its owner's
context current first; a call with only raw handles uses the context current on the thread.
"""
from __future__ import annotations

import threading
import weakref
from typing import Any

from hss import _args
from hss._util import Closeable
from hss.cuda._driver import api, check, cuda_error, driver_status
from hss.errors import CudaError, HssError

__all__ = ["CudaCtx", "CudaStream", "CudaEvent", "stream_sync", "stream_wait_event", "compute_capability",
           "multiprocessor_count", "shared_optin", "stream_handle", "ordinal_of", "device_count"]

_GONE = {"CUDA_ERROR_DEINITIALIZED", "CUDA_ERROR_CONTEXT_IS_DESTROYED", "CUDA_ERROR_INVALID_CONTEXT"}
_EVENT_DISABLE_TIMING = 2


class _TLS(threading.local):
    pctx: PrimaryContext | None = None   # the context hss last made current on this thread


thread_state = _TLS()


class PrimaryContext:
    """One retain of a device's primary context, held while hss objects use it (:meth:`hold` / :meth:`drop`)."""

    _live: dict[int, PrimaryContext] = {}
    _lock = threading.RLock()

    def __init__(self, ordinal: int) -> None:
        status = driver_status()
        if status.kind == "cuda" and not status.found:
            raise CudaError("cuInit", "CUDA_ERROR_NO_DEVICE", status.message)
        check(api.cuInit(0), "cuInit")
        count = int(check(api.cuDeviceGetCount(), "cuDeviceGetCount"))
        if not 0 <= ordinal < count:
            raise HssError(f"ordinal {ordinal} is not a device: this machine has {count} (0..{count - 1})")
        self.device = check(api.cuDeviceGet(ordinal), "cuDeviceGet")
        self.ordinal = ordinal
        self.handle = int(check(api.cuDevicePrimaryCtxRetain(self.device), "cuDevicePrimaryCtxRetain"))
        self.holds = 0
        self.alive = True
        self._join_event = 0           # the event stream joins record and wait on (made on first use)
        self._join_lock = threading.Lock()

    @classmethod
    def get(cls, ordinal: int) -> PrimaryContext:
        """The live primary context of device ``ordinal`` (retained if none is)."""
        with cls._lock:
            pctx = cls._live.get(ordinal)
            if pctx is None:
                pctx = cls._live[ordinal] = cls(ordinal)
                if len(cls._live) > 1:
                    _args.DEVICES.many = True   # from now on, pointers are checked for their device
                cls._changed()
            return pctx

    @classmethod
    def _changed(cls) -> None:
        """A primary context was retained or released: a check remembered while another lived (a stream's, a
        device's) is not trusted after it (hss._args.RANGES.generation changes; docs/design.md §23)."""
        _args.RANGES.bump()

    def hold(self) -> None:
        with self._lock:
            self.holds += 1

    def drop(self) -> None:
        """Give back one hold; the last one releases the retain."""
        with self._lock:
            self.holds -= 1
            if self.holds > 0 or not self.alive:
                return
            self.alive = False
            if PrimaryContext._live.get(self.ordinal) is self:
                del PrimaryContext._live[self.ordinal]
            PrimaryContext._changed()
        ev_err = None
        try:
            if self._join_event:
                self.make_current()
                ev_err = api.cuEventDestroy(self._join_event)[0]
            err = api.cuDevicePrimaryCtxRelease(self.device)[0]
        except Exception:   # interpreter shutdown: the binding may already be gone
            err = None
        finally:
            if thread_state.pctx is self:
                thread_state.pctx = None
        if err and err.name not in _GONE:
            raise cuda_error(err, "cuDevicePrimaryCtxRelease")
        if ev_err and ev_err.name not in _GONE:   # (the context is released either way)
            raise cuda_error(ev_err, "cuEventDestroy", "the context's join event")

    def make_current(self) -> None:
        if thread_state.pctx is not self:
            check(api.cuCtxSetCurrent(self.handle), "cuCtxSetCurrent")
            thread_state.pctx = self

    def join(self, consumer: int, producer: int) -> None:
        """Order later work on stream ``consumer`` after the work queued so far on ``producer`` (no host wait)."""
        with self._join_lock:
            self.make_current()
            if not self._join_event:
                self._join_event = int(check(api.cuEventCreate(_EVENT_DISABLE_TIMING), "cuEventCreate"))
            check(api.cuEventRecord(self._join_event, producer), "cuEventRecord", f"producer stream {producer:#x}")
            check(api.cuStreamWaitEvent(consumer, self._join_event, 0), "cuStreamWaitEvent")


def _current() -> PrimaryContext:
    """The context for a call with only raw handles: hss's current one on this thread, else the current device's
    primary context (held for the rest of the process: raw handles say nothing about their lifetime)."""
    pctx = thread_state.pctx
    if pctx is not None and pctx.alive:
        return pctx
    ordinal = 0
    status = driver_status()
    if status.found or status.kind == "emulator":
        check(api.cuInit(0), "cuInit")
        if int(check(api.cuCtxGetCurrent(), "cuCtxGetCurrent") or 0):
            err, dev = api.cuCtxGetDevice()
            if not err:   # a context destroyed while current (its last owner closed) says nothing: device 0
                ordinal = int(dev)
    with PrimaryContext._lock:
        pctx = PrimaryContext.get(ordinal)
        if not getattr(pctx, "_ambient", False):
            pctx._ambient = True   # type: ignore[attr-defined]
            pctx.hold()
    pctx.make_current()
    return pctx


def ensure_context(stream: int | None = None) -> None:
    """Make some context current on this thread before a raw-handle call: once several devices are in use, the
    context ``stream`` (a raw handle; not a legacy one) belongs to."""
    pctx = thread_state.pctx
    if pctx is None or not pctx.alive:
        pctx = _current()
    if stream is not None and stream > 2 and _args.DEVICES.many:
        handle, owner = stream_context(stream)
        if pctx.handle != handle and owner is not None:
            owner.make_current()


def stream_context(stream: int) -> tuple[int, PrimaryContext | None]:
    """The context handle of (non-legacy) raw stream ``stream`` and the live hss primary context it is, if any."""
    handle = int(check(api.cuStreamGetCtx(stream), "cuStreamGetCtx", f"stream {stream:#x}"))
    return handle, next((p for p in list(PrimaryContext._live.values()) if p.handle == handle and p.alive), None)


def owner_context(ctx: CudaCtx | PrimaryContext | None) -> PrimaryContext:
    """The primary context an owner is made in (``ctx``'s, or the current one), made current."""
    if isinstance(ctx, CudaCtx):
        pctx = ctx._live_pctx()
    elif isinstance(ctx, PrimaryContext):
        pctx = ctx
    elif ctx is None:
        pctx = _current()
    else:
        raise TypeError(f"ctx must be a CudaCtx or None, not {type(ctx).__name__}")
    pctx.make_current()
    return pctx


def ordinal_of(ctx: CudaCtx | PrimaryContext | None) -> int:
    """The device ordinal of ``ctx`` (None: of the current context, as :func:`owner_context` takes it)."""
    return owner_context(ctx).ordinal


def _join(consumer: int, producer: int) -> None:
    _current().join(consumer, producer)


_args.set_stream_join(_join)


# -- owners -----------------------------------------------------------------------------------
def _destroy(call: str | None, handle: int, pctx: PrimaryContext, forget: Any, raising: bool) -> None:
    """Free one driver object and give back its context hold; ``forget()`` (if any) first drops what hss knows of
    the object. A destroyed context is tolerated; other failures raise when ``raising`` (a close), and are kept
    by the emulator for its next sync when not (a finalizer)."""
    try:
        if forget is not None:
            forget()
        if call is not None:
            try:
                pctx.make_current()
                err = getattr(api, call)(handle)[0]
            except CudaError:
                if raising:
                    raise
                err = None
            except Exception as exc:   # an emulated fault of queued work, reported by the free
                keep = getattr(api, "keep_fault", None)
                if raising or keep is None:
                    raise
                keep(exc)
                err = None
            if err and raising and err.name not in _GONE:
                raise cuda_error(err, call)
    finally:
        pctx.drop()


class Owner(Closeable):
    """Idempotent close / context manager / finalizer, shared by every owner class.

    ``_own(call, handle, pctx, forget)`` takes a hold on ``pctx`` and arranges ``forget()`` and ``call(handle)``
    (None: nothing to free) to run exactly once: at :meth:`close`, or when the object is collected."""

    _finalizer: weakref.finalize | None = None
    _open = False   # True from _own until close(): the one fact `closed` derives from (a finalizer runs only
    #                 once nothing can reach the object, so it never needs to clear it)
    _pctx: PrimaryContext

    def _own(self, call: str | None, handle: int, pctx: PrimaryContext, forget: Any = None) -> None:
        pctx.hold()
        self._pctx = pctx
        self._finalizer = weakref.finalize(self, _destroy, call, handle, pctx, forget, False)
        self._open = True

    @property
    def closed(self) -> bool:
        return not self._open

    def _live_pctx(self) -> PrimaryContext:
        if self.closed:
            raise HssError(f"this {type(self).__name__} is closed")
        return self._pctx

    def close(self) -> None:
        """Free the driver object now; later calls do nothing."""
        f = self._finalizer
        info = f.detach() if f is not None else None
        self._open = False
        if info is not None:
            _, func, args, _ = info
            try:
                self._on_close()
            finally:
                func(*args[:-1], True)

    def _on_close(self) -> None:
        pass


# -- contexts ---------------------------------------------------------------------------------
class CudaCtx(Owner):
    """Device ``ordinal``'s primary context (shared with PyTorch, CuPy, cuda.core) and a stream.

    ``stream`` is non-blocking unless ``non_blocking=False`` (the original's blocking stream). As a stream
    argument anywhere in hss, a CudaCtx means its stream. ``close()`` destroys the stream and gives back this
    object's hold on the context (the last hss owner's close releases the primary context retain).
    """

    def __init__(self, ordinal: int = 0, *, non_blocking: bool = True) -> None:
        ordinal = _args.as_int("ordinal", ordinal, 0)
        pctx = PrimaryContext.get(ordinal)
        pctx.hold()   # keeps it through the stream's creation
        try:
            pctx.make_current()
            self._stream = CudaStream(pctx, non_blocking=non_blocking)
            self._own(None, 0, pctx)
        finally:
            pctx.drop()
        self.device = ordinal
        self.ctx = pctx.handle

    @property
    def stream(self) -> int:
        """The raw handle of this context's stream."""
        if self.closed:
            raise HssError("this CudaCtx is closed")
        return self._stream.handle

    @property
    def name(self) -> str:
        raw = check(api.cuDeviceGetName(256, self._live_pctx().device), "cuDeviceGetName")
        return bytes(raw).split(b"\0", 1)[0].decode()

    @property
    def compute_capability(self) -> tuple[int, int]:
        return compute_capability(self)

    def make_current(self) -> None:
        """Bind this context to the calling thread (hss calls do this themselves)."""
        self._live_pctx().make_current()

    def synchronize(self) -> None:
        """Block until all work in this context has finished (cuCtxSynchronize)."""
        self._live_pctx().make_current()
        check(api.cuCtxSynchronize(), "cuCtxSynchronize")

    def _on_close(self) -> None:
        self._stream.close()

    def __repr__(self) -> str:
        return f"CudaCtx(device {self.device}{', closed' if self.closed else ''})"


def device_count() -> int:
    """The number of devices the driver offers (0 where there is no driver)."""
    status = driver_status()
    if status.kind == "cuda" and not status.found:
        return 0
    check(api.cuInit(0), "cuInit")
    return int(check(api.cuDeviceGetCount(), "cuDeviceGetCount"))


def compute_capability(ctx: CudaCtx | PrimaryContext | None = None) -> tuple[int, int]:
    """(major, minor) of the device of ``ctx`` (or of the current device)."""
    pctx = owner_context(ctx)
    attr = api.CUdevice_attribute
    major = check(api.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, pctx.device),
                  "cuDeviceGetAttribute")
    minor = check(api.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, pctx.device),
                  "cuDeviceGetAttribute")
    return int(major), int(minor)


def multiprocessor_count(ctx: CudaCtx | PrimaryContext | None = None) -> int:
    """Number of SMs of the device of ``ctx`` (or of the current device)."""
    pctx = owner_context(ctx)
    attr = api.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT
    return int(check(api.cuDeviceGetAttribute(attr, pctx.device), "cuDeviceGetAttribute"))


def shared_optin(ctx: CudaCtx | PrimaryContext | None = None) -> int:
    """The most shared memory a block of the device of ``ctx`` (or of the current device) may opt in to, in bytes
    (static and dynamic together)."""
    pctx = owner_context(ctx)
    attr = api.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN
    return int(check(api.cuDeviceGetAttribute(attr, pctx.device), "cuDeviceGetAttribute"))


# -- streams and events -----------------------------------------------------------------------
class CudaStream(Owner):
    """A stream of ``ctx`` (non-blocking by default); has ``handle`` and ``__cuda_stream__``."""

    def __init__(self, ctx: CudaCtx | None = None, *, non_blocking: bool = True) -> None:
        pctx = owner_context(ctx)
        self._handle = int(check(api.cuStreamCreate(1 if non_blocking else 0), "cuStreamCreate"))
        self._own("cuStreamDestroy", self._handle, pctx)

    @property
    def handle(self) -> int:
        if self.closed:
            raise HssError("this CudaStream is closed")
        return self._handle

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.handle)

    def synchronize(self) -> None:
        stream_sync(self)

    def wait(self, event: CudaEvent) -> None:
        """Order later work on this stream after ``event``'s last record (no host wait)."""
        stream_wait_event(self, event)

    def __repr__(self) -> str:
        return f"CudaStream({'closed' if self.closed else hex(self._handle)})"


def _read_ctx_stream(ctx: CudaCtx) -> int:
    if ctx._open:
        return ctx._stream._handle
    raise HssError("this CudaCtx is closed")


def _read_stream(stream: CudaStream) -> int:
    if stream._open:
        return stream._handle
    raise HssError("this CudaStream is closed")


_args.register_stream_type(CudaStream, _read_stream)
_args.register_stream_type(CudaCtx, _read_ctx_stream)
stream_handle = _args.stream


class CudaEvent(Owner):
    """An event; ``timing=False`` (the original's CU_EVENT_DISABLE_TIMING) unless asked for."""

    def __init__(self, timing: bool = False, ctx: Any = None) -> None:
        if not isinstance(timing, (bool, int)):
            raise TypeError(f"timing must be a bool, got {type(timing).__name__}")
        pctx = owner_context(ctx)
        self.timing = bool(timing)
        self._handle = int(check(api.cuEventCreate(0 if timing else _EVENT_DISABLE_TIMING), "cuEventCreate"))
        self._own("cuEventDestroy", self._handle, pctx)

    @property
    def handle(self) -> int:
        if self.closed:
            raise HssError("this CudaEvent is closed")
        return self._handle

    def record(self, stream: Any) -> None:
        """Record this event at the current end of ``stream``'s queue."""
        s = _args.stream(stream)
        self._live_pctx().make_current()
        check(api.cuEventRecord(self._handle, s), "cuEventRecord")

    def synchronize(self) -> None:
        """Block the host until the recorded work has finished."""
        self._live_pctx().make_current()
        check(api.cuEventSynchronize(self._handle), "cuEventSynchronize")

    def query(self) -> bool:
        """True when the recorded work has finished (no wait)."""
        self._live_pctx().make_current()
        err = api.cuEventQuery(self._handle)[0]
        if err and err.name == "CUDA_ERROR_NOT_READY":
            return False
        check((err,), "cuEventQuery")
        return True

    def elapsed_ms(self, end: CudaEvent) -> float:
        """Milliseconds from this event to ``end`` (both timing events, both recorded and complete)."""
        if not isinstance(end, CudaEvent):
            raise TypeError(f"end must be a CudaEvent, got {type(end).__name__}")
        if not (self.timing and end.timing):
            raise HssError("elapsed_ms needs two events made with CudaEvent(timing=True)")
        self._live_pctx().make_current()
        return float(check(api.cuEventElapsedTime(self._handle, end.handle), "cuEventElapsedTime"))


def stream_wait_event(stream: Any, event: CudaEvent) -> None:
    """Order later work on ``stream`` (any stream form) after ``event``'s last record (cuStreamWaitEvent).

    No host wait; ``CudaStream.wait`` does the same for a :class:`CudaStream`."""
    if not isinstance(event, CudaEvent):
        raise TypeError(f"event must be a CudaEvent, got {type(event).__name__}")
    s = _args.stream(stream)
    event._live_pctx().make_current()
    check(api.cuStreamWaitEvent(s, event.handle, 0), "cuStreamWaitEvent")


def stream_sync(stream: Any) -> None:
    """Block the host until all work queued on ``stream`` has finished (cuStreamSynchronize)."""
    s = _args.stream(stream)
    ensure_context(s)
    check(api.cuStreamSynchronize(s), "cuStreamSynchronize")
