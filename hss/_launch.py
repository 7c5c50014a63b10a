"""PTX modules, kernel launches, events and graphs (part of :mod:`hss.cuda_min`, which re-exports them)."""
from __future__ import annotations

from typing import Any, Sequence

from hss._driver import HssError, api, check, cuda_error
from hss._params import ParamPack
from hss.cuda_min import _context, _Owner, _PrimaryContext, _tls, stream_handle


class CudaModule(_Owner):
    """A loaded PTX module (JIT-compiled by the driver at load). ``name`` labels its errors."""

    def __init__(self, handle: int, pctx: _PrimaryContext, name: str) -> None:
        self.handle, self.name = handle, name
        self._own("cuModuleUnload", handle, pctx)

    @classmethod
    def from_ptx(cls, text: str | bytes, name: str = "<ptx>", ctx: Any = None) -> "CudaModule":
        """Load PTX ``text`` (no NUL inside) into ``ctx``'s context (the current device's if None)."""
        data = text.encode() if isinstance(text, str) else bytes(text)
        if b"\0" in data:
            raise HssError(f"PTX module {name} contains a NUL byte; pass the PTX text itself")
        pctx = _context(ctx)
        handle = check(api.cuModuleLoadData(data + b"\0"), "cuModuleLoadData", f"module {name}")
        return cls(int(handle), pctx, name)

    def function(self, name: str) -> "CudaFunction":
        """The kernel ``name`` of this module (an error names the function and the module)."""
        if self.closed:
            raise HssError(f"module {self.name} is closed")
        self._pctx.make_current()
        handle = check(api.cuModuleGetFunction(self.handle, name.encode()), "cuModuleGetFunction",
                       f"function {name} in module {self.name}")
        return CudaFunction(int(handle), self, name)


class CudaFunction:
    """A kernel handle; it keeps its module (and so its context) alive."""

    __slots__ = ("handle", "module", "name", "_ctx", "_ctxh")

    def __init__(self, handle: int, module: CudaModule, name: str) -> None:
        self.handle, self.module, self.name = handle, module, name
        self._ctx = module._pctx
        self._ctxh = module._pctx.handle

    def __int__(self) -> int:
        return self.handle

    def __repr__(self) -> str:
        return f"CudaFunction({self.name} in {self.module.name})"

    def set_max_dynamic_shared(self, nbytes: int) -> None:
        """Allow launches with up to ``nbytes`` of dynamic shared memory (the opt-in past 48 KiB;
        cuFuncSetAttribute MAX_DYNAMIC_SHARED_SIZE_BYTES)."""
        self._ctx.make_current()
        attr = api.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        check(api.cuFuncSetAttribute(self.handle, attr, int(nbytes)), "cuFuncSetAttribute",
              f"{self.name}: {nbytes} bytes of dynamic shared memory")


def _dim3(v: Any, what: str) -> tuple[int, int, int]:
    if isinstance(v, int):
        v = (v,)
    t = tuple(int(x) for x in v)
    if not 1 <= len(t) <= 3:
        raise HssError(f"{what} needs 1 to 3 dimensions, got {v!r}")
    return (t + (1, 1))[:3]


def launch_kernel(func: CudaFunction | int, grid: Any, block: Any, shared_bytes: int, stream: Any,
                  params: ParamPack | Sequence[Any]) -> None:
    """Launch ``func`` on ``stream`` with explicit geometry and packed parameters (cuLaunchKernel).

    ``grid``/``block``: an int or a 1-3 tuple. ``params``: a :class:`ParamPack` (prepared; refill it in
    place for hot loops) or a sequence of numpy scalars (np.int32/np.uint32/np.int64/np.float32) and
    ints or device objects for pointers; a Python float has no width and is refused.
    """
    if type(func) is CudaFunction:
        if _tls.ctx != func._ctxh:
            func._ctx.make_current()
        h = func.handle
    else:
        h = int(func)
    gx, gy, gz = grid if type(grid) is tuple and len(grid) == 3 else _dim3(grid, "grid")
    bx, by, bz = block if type(block) is tuple and len(block) == 3 else _dim3(block, "block")
    p = params if type(params) is ParamPack else ParamPack.untyped(params)
    err = api.cuLaunchKernel(h, gx, gy, gz, bx, by, bz, shared_bytes,
                             stream if type(stream) is int else stream_handle(stream), p.address, 0)[0]
    if err:
        name = getattr(func, "name", f"function {h:#x}")
        raise cuda_error(err, "cuLaunchKernel", f"{name}, grid ({gx}, {gy}, {gz}), block ({bx}, {by}, {bz}), "
                                                f"shared {shared_bytes} bytes")


class CudaEvent(_Owner):
    """An event; ``timing=False`` (the original's CU_EVENT_DISABLE_TIMING) unless asked for."""

    def __init__(self, timing: bool = False, ctx: Any = None) -> None:
        pctx = _context(ctx)
        self.timing = timing
        self.handle = int(check(api.cuEventCreate(0 if timing else 2), "cuEventCreate"))
        self._own("cuEventDestroy", self.handle, pctx)

    def record(self, stream: Any) -> None:
        """Record this event at the current end of ``stream``'s queue."""
        self._pctx.make_current()
        check(api.cuEventRecord(self.handle, stream_handle(stream)), "cuEventRecord")

    def synchronize(self) -> None:
        """Block the host until the recorded work has finished."""
        self._pctx.make_current()
        check(api.cuEventSynchronize(self.handle), "cuEventSynchronize")

    def query(self) -> bool:
        """True when the recorded work has finished (no wait)."""
        self._pctx.make_current()
        err = api.cuEventQuery(self.handle)[0]
        if err and err.name == "CUDA_ERROR_NOT_READY":
            return False
        check((err,), "cuEventQuery")
        return True

    def elapsed_ms(self, end: "CudaEvent") -> float:
        """Milliseconds from this event to ``end`` (both timing events, both recorded and complete)."""
        if not (self.timing and end.timing):
            raise HssError("elapsed_ms needs two events made with CudaEvent(timing=True)")
        self._pctx.make_current()
        return float(check(api.cuEventElapsedTime(self.handle, end.handle), "cuEventElapsedTime"))


def stream_wait_event(stream: Any, event: CudaEvent) -> None:
    """Order later work on ``stream`` (any stream form) after ``event``'s last record (cuStreamWaitEvent).

    No host wait; ``CudaStream.wait`` does the same for a :class:`~hss.cuda_min.CudaStream`."""
    event._pctx.make_current()
    check(api.cuStreamWaitEvent(stream_handle(stream), event.handle, 0), "cuStreamWaitEvent")


def begin_capture(stream: Any) -> None:
    """Start capturing ``stream``'s work into a graph (thread-local mode): nothing runs until replay."""
    _context(None)
    mode = api.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL
    check(api.cuStreamBeginCapture(stream_handle(stream), mode), "cuStreamBeginCapture")


def end_capture(stream: Any) -> "CudaGraph":
    """Stop capturing ``stream`` and instantiate what was captured as a replayable :class:`CudaGraph`."""
    pctx = _context(None)
    graph = int(check(api.cuStreamEndCapture(stream_handle(stream)), "cuStreamEndCapture"))
    try:
        exe = int(check(api.cuGraphInstantiate(graph, 0), "cuGraphInstantiate"))
    finally:
        api.cuGraphDestroy(graph)   # the executable graph does not need its template
    return CudaGraph(exe, pctx)


class CudaGraph(_Owner):
    """A captured, instantiated graph; ``launch(stream)`` replays it (asynchronously)."""

    def __init__(self, exe: int, pctx: _PrimaryContext) -> None:
        self.handle = exe
        self._own("cuGraphExecDestroy", exe, pctx)

    def launch(self, stream: Any) -> None:
        self._pctx.make_current()
        check(api.cuGraphLaunch(self.handle, stream_handle(stream)), "cuGraphLaunch")
