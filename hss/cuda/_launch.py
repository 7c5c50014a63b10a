"""PTX modules, kernel launches and graphs (part of :mod:`hss.cuda_min`, which re-exports them)."""
from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from hss import _args
from hss._params import KIND_SIZES, ParamPack
from hss.cuda._context import Owner, PrimaryContext, ensure_context, owner_context, stream_context, thread_state
from hss.cuda._driver import api, check, cuda_error
from hss.decls import DECLARATIONS
from hss.errors import CudaError, HssError

__all__ = ["CudaModule", "CudaFunction", "CudaGraph", "launch_kernel", "launcher", "begin_capture", "end_capture",
           "on_replay", "is_capturing"]


class CudaModule(Owner):
    """A loaded PTX module (JIT-compiled by the driver at load). ``name`` labels its errors; ``variant`` is the
    arch variant :func:`hss.cuda.ptx.load_module` served (e.g. ``"sm_90"``), None for the base PTX or other text."""

    variant: str | None = None

    def __init__(self, handle: int, pctx: PrimaryContext, name: str) -> None:
        self.handle, self.name = handle, name
        self._own("cuModuleUnload", handle, pctx)

    @classmethod
    def from_ptx(cls, text: str | bytes, name: str = "<ptx>", ctx: Any = None) -> CudaModule:
        """Load PTX ``text`` (no NUL inside) into ``ctx``'s context (the current device's if None)."""
        if not isinstance(text, (str, bytes, bytearray)):
            raise TypeError(f"PTX text must be str or bytes, got {type(text).__name__}")
        data = text.encode() if isinstance(text, str) else bytes(text)
        if b"\0" in data:
            raise HssError(f"PTX module {name} contains a NUL byte; pass the PTX text itself")
        pctx = owner_context(ctx)
        handle = check(api.cuModuleLoadData(data + b"\0"), "cuModuleLoadData", f"module {name}")
        return cls(int(handle), pctx, name)

    def function(self, name: str) -> CudaFunction:
        """The kernel ``name`` of this module (an error names the function and the module)."""
        if not isinstance(name, str):
            raise TypeError(f"a kernel name is a str, got {type(name).__name__}")
        self._live_pctx().make_current()
        handle = check(api.cuModuleGetFunction(self.handle, name.encode()), "cuModuleGetFunction",
                       f"function {name} in module {self.name}")
        return CudaFunction(int(handle), self, name)

    def __repr__(self) -> str:
        return f"CudaModule({self.name}{', closed' if self.closed else ''})"


class CudaFunction:
    """A kernel handle; it keeps its module (and so its context) alive.

    ``param_kinds`` are the kinds of its parameters when hss declares the kernel; ``param_sizes`` their sizes
    in bytes (from the declaration, else the driver's cuFuncGetParamInfo; None where neither knows)."""

    __slots__ = ("handle", "module", "name", "_pctx", "_kinds", "_sizes", "_checked")

    def __init__(self, handle: int, module: CudaModule, name: str) -> None:
        self.handle, self.module, self.name = handle, module, name
        self._pctx = module._pctx
        self._kinds: tuple[str, ...] | None = None
        self._sizes: Any = False   # not looked up yet
        self._checked: Any = None  # the kinds tuple of the last ParamPack checked against this function

    def __int__(self) -> int:
        return self.handle

    def __repr__(self) -> str:
        return f"CudaFunction({self.name} in {self.module.name})"

    @property
    def param_kinds(self) -> tuple[str, ...] | None:
        """The declared kinds of an hss kernel (None for a kernel hss does not declare)."""
        if self._sizes is False:
            self._layout()
        return self._kinds

    @property
    def param_sizes(self) -> tuple[int, ...] | None:
        """Parameter sizes in bytes (the driver's where it can tell, else the declaration's; None if neither)."""
        if self._sizes is False:
            self._layout()
        return self._sizes

    def _layout(self) -> None:
        decl = DECLARATIONS.get(self.name)
        kinds = decl.kinds if decl is not None else None
        sizes = self._driver_sizes()
        if kinds is not None and sizes is not None and tuple(KIND_SIZES[k] for k in kinds) != sizes:
            kinds = None   # a kernel of the same name that is not hss's
        if sizes is None and kinds is not None:
            sizes = tuple(KIND_SIZES[k] for k in kinds)
        self._kinds, self._sizes = kinds, sizes

    def _driver_sizes(self) -> tuple[int, ...] | None:
        info = getattr(api, "cuFuncGetParamInfo", None)
        if info is None:
            return None
        self.module._live_pctx().make_current()
        sizes: list[int] = []
        while True:
            try:
                result = info(self.handle, len(sizes))
            except Exception:   # a binding that cannot make the call
                return None
            if result[0]:
                if result[0].name == "CUDA_ERROR_INVALID_VALUE" and sizes:   # past the last parameter
                    return tuple(sizes)
                return None if result[0].name != "CUDA_ERROR_INVALID_VALUE" else ()
            sizes.append(int(result[2]))

    def set_max_dynamic_shared(self, nbytes: int) -> None:
        """Allow launches with up to ``nbytes`` of dynamic shared memory (the opt-in past 48 KiB;
        cuFuncSetAttribute MAX_DYNAMIC_SHARED_SIZE_BYTES)."""
        n = _args.as_int("nbytes", nbytes, 0)
        self.module._live_pctx().make_current()
        attr = api.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        check(api.cuFuncSetAttribute(self.handle, attr, n), "cuFuncSetAttribute",
              f"{self.name}: {n} bytes of dynamic shared memory")

    def check_pack(self, pack: ParamPack) -> None:
        """Raise unless ``pack``'s parameters have this kernel's count and sizes (where known)."""
        if pack.kinds is self._checked:
            return
        sizes = self.param_sizes
        if sizes is not None:
            have = tuple(KIND_SIZES[k] for k in pack.kinds)
            if len(have) != len(sizes):
                raise HssError(f"{self.name} takes {len(sizes)} parameters, the pack holds {len(have)} "
                               f"({', '.join(pack.names)})")
            bad = [i for i, (a, b) in enumerate(zip(have, sizes)) if a != b]
            if bad:
                i = bad[0]
                raise HssError(f"{self.name} parameter #{i} is {sizes[i]} bytes; the pack's {pack.names[i]} "
                               f"({pack.kinds[i]}) is {have[i]}")
        self._checked = pack.kinds

    def pack_values(self, values: Sequence[Any]) -> ParamPack:
        """A pack of ``values`` for this kernel: at the declared kinds for an hss kernel; otherwise numpy scalars
        at their own widths and ints / device arrays as 8-byte pointers, checked against the driver's sizes."""
        if not isinstance(values, (list, tuple)):
            raise TypeError(f"params must be a ParamPack or a list of values, got {type(values).__name__}")
        kinds = self.param_kinds
        if kinds is not None:
            if len(values) != len(kinds):
                raise HssError(f"{self.name} takes {len(kinds)} parameters, got {len(values)}")
            decl = DECLARATIONS[self.name]
            return ParamPack(kinds, decl.names, self.name).fill(*values)
        pack = ParamPack(tuple(_untyped_kind(i, v) for i, v in enumerate(values)), label=self.name).fill(*values)
        self.check_pack(pack)
        return pack


_NUMPY_KINDS = {np.int32: "i32", np.uint32: "u32", np.int64: "i64", np.uint64: "ptr", np.float32: "f32"}


def _untyped_kind(i: int, v: Any) -> str:
    kind = _NUMPY_KINDS.get(type(v))
    if kind is not None:
        return kind
    if isinstance(v, (bool, np.bool_, float, np.floating, np.integer)):
        raise TypeError(f"kernel parameter #{i}: {type(v).__name__} {v!r} has no kernel width; pass np.int32, "
                        "np.uint32, np.int64, np.float32, or an int or device array for a pointer")
    return "ptr"


_DIM = 2**31   # launch dimensions are 1 .. 2^31 - 1 (the driver narrows further per axis)


def _dims(value: Any, name: str) -> tuple[int, int, int]:
    """:func:`hss._args.dims3` with the common case (a 3-tuple of valid ints) decided inline."""
    if type(value) is tuple and len(value) == 3:
        x, y, z = value
        if type(x) is int and type(y) is int and type(z) is int and 0 < x < _DIM and 0 < y < _DIM and 0 < z < _DIM:
            return value
    return _args.dims3(name, value)


def launch_kernel(func: CudaFunction, grid: Any, block: Any, shared_bytes: int, stream: Any,
                  params: ParamPack | Sequence[Any]) -> None:
    """Launch ``func`` on ``stream`` with explicit geometry and packed parameters (cuLaunchKernel).

    ``grid``/``block``: an int or a 1-3 tuple of ints. ``params``: a :class:`ParamPack` (prepared; refill it in
    place for hot loops; its count and sizes are checked against the kernel once) or a list of values (see
    :meth:`CudaFunction.pack_values`: hss kernels take plain ints at their declared kinds; other kernels take
    numpy scalars, and ints or device arrays for pointers, checked against the driver's parameter sizes).
    """
    if type(func) is not CudaFunction:
        raise TypeError(f"func must be a CudaFunction (CudaModule.function(name)), got {type(func).__name__}")
    gx, gy, gz = _dims(grid, "grid")
    bx, by, bz = _dims(block, "block")
    shared = shared_bytes if type(shared_bytes) is int and shared_bytes >= 0 else \
        _args.as_int("shared_bytes", shared_bytes, 0)
    s = stream if type(stream) is int and stream >= 0 else _args.stream(stream)
    if type(params) is ParamPack:
        if params.kinds is not func._checked:
            func.check_pack(params)
        p = params
    else:
        p = func.pack_values(params)
    if thread_state.pctx is not func._pctx:
        func.module._live_pctx().make_current()
    err = api.cuLaunchKernel(func.handle, gx, gy, gz, bx, by, bz, shared, s, p.address, 0)[0]
    if err:
        raise _launch_error(err, func, (gx, gy, gz), (bx, by, bz), shared)


def _launch_error(err: Any, func: CudaFunction, grid: tuple, block: tuple, shared: int,
                  call: str = "cuLaunchKernel") -> CudaError:
    return cuda_error(err, call, f"{func.name}, grid {grid}, block {block}, shared {shared} bytes")


def launcher(func: CudaFunction, block: Any, shared_bytes: int, pack: ParamPack,
             programmatic: bool = False) -> Callable[..., None]:
    """A prepared launch of ``func`` with ``pack`` (refilled in place by the caller): ``run(stream, gx, gy=1,
    gz=1)`` queues it on a raw stream handle with no argument conversion (the caller checked everything).
    ``programmatic``: through cuLaunchKernelEx with programmatic stream serialization, so the launch may start
    before the stream's previous kernel ends (the kernel must wait for it, griddepcontrol.wait, before it reads
    what that kernel writes).

    The block, shared size and pack are checked here, once."""
    if type(func) is not CudaFunction:
        raise TypeError(f"func must be a CudaFunction, got {type(func).__name__}")
    bx, by, bz = _args.dims3("block", block)
    shared = _args.as_int("shared_bytes", shared_bytes, 0)
    func.check_pack(pack)
    handle, address, pctx, module = func.handle, pack.address, func._pctx, func.module
    many, own_streams = _args.DEVICES, set()   # streams seen to be this context's (once several devices are used)

    def run(stream: int, gx: int, gy: int = 1, gz: int = 1) -> None:
        if thread_state.pctx is not pctx:
            module._live_pctx().make_current()
        if many.many and stream not in own_streams:
            _check_stream_context(stream, pctx, func.name)
            own_streams.add(stream)
        err = api.cuLaunchKernel(handle, gx, gy, gz, bx, by, bz, shared, stream, address, 0)[0]
        if err:
            raise _launch_error(err, func, (gx, gy, gz), (bx, by, bz), shared)

    if not programmatic:
        return run
    attr = api.CUlaunchAttribute()
    attr.id = api.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    attr.value.programmaticStreamSerializationAllowed = 1
    cfg = api.CUlaunchConfig()
    cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ, cfg.sharedMemBytes = bx, by, bz, shared
    cfg.attrs, cfg.numAttrs = [attr], 1

    def run_ex(stream: int, gx: int, gy: int = 1, gz: int = 1) -> None:
        if thread_state.pctx is not pctx:
            module._live_pctx().make_current()
        if many.many and stream not in own_streams:
            _check_stream_context(stream, pctx, func.name)
            own_streams.add(stream)
        cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ, cfg.hStream = gx, gy, gz, stream
        err = api.cuLaunchKernelEx(cfg, handle, address, 0)[0]
        if err:
            raise _launch_error(err, func, (gx, gy, gz), (bx, by, bz), shared, "cuLaunchKernelEx")

    return run_ex


def _check_stream_context(stream: int, pctx: PrimaryContext, what: str) -> None:
    """Raise :class:`HssError` if ``stream`` is a stream of another context than ``pctx`` (the legacy handles name
    the current context's, so they pass)."""
    if stream in (0, 1, 2):
        return
    ctx, owner = stream_context(stream)
    if ctx != pctx.handle:
        where = f"device {owner.ordinal}" if owner is not None else "another context"
        raise HssError(f"{what}: stream {stream:#x} belongs to {where}, but this work runs on device {pctx.ordinal}; "
                       f"pass a stream of device {pctx.ordinal}")


def begin_capture(stream: Any) -> None:
    """Start capturing ``stream``'s work into a graph (thread-local mode): nothing runs until replay."""
    s = _args.stream(stream)
    owner_context(None)
    ensure_context(s)   # several devices: the stream's own context
    mode = api.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL
    check(api.cuStreamBeginCapture(s, mode), "cuStreamBeginCapture")


def end_capture(stream: Any) -> CudaGraph:
    """Stop capturing ``stream`` and instantiate what was captured as a replayable :class:`CudaGraph`; the host
    callbacks registered with :func:`on_replay` during the capture go with it (its ``launch`` runs them)."""
    s = _args.stream(stream)
    owner_context(None)
    capture = _capture_id(s)   # makes the stream's context current (several devices)
    pctx = thread_state.pctx or owner_context(None)
    try:
        graph = int(check(api.cuStreamEndCapture(s), "cuStreamEndCapture"))
    finally:
        with _replay_lock:
            kept = _replay_fns.pop(capture, (0, []))[1] if capture else []
    try:
        exe = int(check(api.cuGraphInstantiate(graph, 0), "cuGraphInstantiate"))
    except BaseException:
        api.cuGraphDestroy(graph)   # (the instantiation's failure is the one reported)
        raise
    err = api.cuGraphDestroy(graph)[0]   # the executable graph does not need its template
    if err:
        api.cuGraphExecDestroy(exe)
        raise cuda_error(err, "cuGraphDestroy", "the captured graph's template")
    return CudaGraph(exe, pctx, kept)


# -- host work that a replay repeats -----------------------------------------------------------
# Host callbacks registered while a stream captures, per capture sequence id: (stream, [fn, ...]). end_capture
# hands its sequence's callbacks to the graph; a capture hss does not end (torch.cuda.graph) leaves its entry,
# pruned when a later capture registers.
_replay_fns: dict[int, tuple[int, list[Callable[[], Any]]]] = {}
_replay_lock = threading.Lock()
_NONE = 0   # CU_STREAM_CAPTURE_STATUS_NONE


def _capture_id(s: int) -> int:
    """The id of the capture sequence ``s`` takes part in (0: ``s`` is not capturing)."""
    ensure_context(s)
    result = api.cuStreamGetCaptureInfo(s)
    check(result[:1], "cuStreamGetCaptureInfo")
    return int(result[2] or 0) if int(result[1]) != _NONE else 0


def is_capturing(stream: Any) -> bool:
    """Whether ``stream`` is capturing into a graph now (an hss capture, torch.cuda.graph's, any other)."""
    s = _args.stream(stream)
    ensure_context(s)
    status = check(api.cuStreamIsCapturing(s), "cuStreamIsCapturing")
    return int(status) != _NONE


def on_replay(stream: Any, fn: Callable[[], Any]) -> bool:
    """Run host callback ``fn()`` when the work queued so far on ``stream`` "happens" for the host.

    While ``stream`` is not capturing that is now: ``fn`` runs at once (returns False). While it captures, ``fn`` is
    kept (returns True): :func:`end_capture` attaches it to the :class:`CudaGraph`, whose every ``launch`` runs it
    after queuing the graph, so host state that mirrors what the captured work does on the device (a sequence
    position, say) advances once per replay. A capture that hss does not end (``torch.cuda.graph``) never runs
    it: such callers refresh their mirrors from the device instead."""
    if not callable(fn):
        raise TypeError(f"on_replay needs a callable, got {type(fn).__name__}")
    s = stream if type(stream) is int and stream >= 0 else _args.stream(stream)
    ensure_context(s)
    status = api.cuStreamIsCapturing(s)
    if status[0]:
        check(status[:1], "cuStreamIsCapturing")
    if int(status[1]) == _NONE:
        fn()
        return False
    capture = _capture_id(s)
    with _replay_lock:
        entry = _replay_fns.get(capture)
        if entry is None:
            _prune_ended()
            entry = _replay_fns[capture] = (s, [])
        entry[1].append(fn)
    return True


def _prune_ended() -> None:
    """Drop the callbacks of capture sequences that ended without end_capture (their stream has moved on)."""
    for capture, (s, _) in list(_replay_fns.items()):
        try:
            result = api.cuStreamGetCaptureInfo(s)
            alive = not result[0] and int(result[1]) != _NONE and int(result[2] or 0) == capture
        except Exception:   # a destroyed stream
            alive = False
        if not alive:
            del _replay_fns[capture]


class CudaGraph(Owner):
    """A captured, instantiated graph; ``launch(stream)`` replays it (asynchronously), then runs the host callbacks
    registered with :func:`on_replay` during its capture (``replay_callbacks``), in registration order."""

    def __init__(self, exe: int, pctx: PrimaryContext, callbacks: Sequence[Callable[[], Any]] = ()) -> None:
        self.handle = exe
        self.replay_callbacks: tuple[Callable[[], Any], ...] = tuple(callbacks)
        self._own("cuGraphExecDestroy", exe, pctx)

    def launch(self, stream: Any) -> None:
        s = stream if type(stream) is int and stream >= 0 else _args.stream(stream)
        self._live_pctx().make_current()
        check(api.cuGraphLaunch(self.handle, s), "cuGraphLaunch")
        for fn in self.replay_callbacks:
            fn()
