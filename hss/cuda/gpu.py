"""spark-runtime's GPU surface as the QSA indexer uses it (docs/design.md §9): ``DevicePtr``, ``KernelHandle``,
the ``GpuBackend`` protocol, ``CudaBackend``, its one implementation over :mod:`hss.cuda_min`, and the
prepared hot-path operations :func:`launcher` and :func:`proj_dense`.

Argument orders are the original's: ``GpuBackend`` copies take the *source first*
(``copy_d2d_async(src, dst, bytes, stream)``), unlike ``cuda_min`` (destination first). Every ``CudaBackend``
method reads its arguments through :mod:`hss._args` (streams, device pointers with the bytes the call touches,
host buffers, integers), itself or through the :mod:`hss.cuda_min` call it makes, and raises before queueing
anything.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from hss import _args
from hss import cuda_min as cm
from hss._params import ParamPack
from hss._util import Closeable
from hss.cuda import _launch, ptx
from hss.cuda._blas import Blas
from hss.cuda._context import ensure_context
from hss.decls import DECLARATIONS, KernelDecl
from hss.errors import CudaError, HssError

__all__ = ["DevicePtr", "KernelHandle", "GpuBackend", "CudaBackend", "launcher", "proj_dense"]

_I32 = 2**31 - 1


class DevicePtr(int):
    """A device address (an ``int``); ``offset`` adds bytes, with no scaling and no bounds check."""

    def offset(self, nbytes: int) -> DevicePtr:
        return DevicePtr(int(self) + int(nbytes))

    def is_null(self) -> bool:
        return int(self) == 0

    def __repr__(self) -> str:
        return f"DevicePtr({int(self):#x})"


class KernelHandle:
    """A kernel found by ``GpuBackend.kernel``/``try_kernel``; falsy when absent (``try_kernel`` miss)."""

    __slots__ = ("func", "decl")

    def __init__(self, func: cm.CudaFunction | None = None, decl: KernelDecl | None = None) -> None:
        self.func, self.decl = func, decl

    def __bool__(self) -> bool:
        return self.func is not None

    def is_null(self) -> bool:
        return self.func is None

    def pack(self, *values: Any, **named: Any) -> ParamPack:
        """A range-checked parameter pack for this kernel (refill it in place on hot paths)."""
        if self.decl is None:
            raise HssError("this kernel is absent (try_kernel found none): check the handle before use")
        return self.decl.pack(*values, **named)

    def __repr__(self) -> str:
        return f"KernelHandle({self.func!r})" if self.func else "KernelHandle(absent)"


class GpuBackend(Protocol):
    """What the indexer needs from a GPU. Every method is asynchronous on ``stream`` unless its name
    says otherwise (``copy_d2h_on_stream`` and ``synchronize`` block)."""

    def kernel(self, module: str, func: str) -> KernelHandle: ...
    def try_kernel(self, module: str, func: str) -> KernelHandle: ...
    def alloc(self, nbytes: int) -> DevicePtr: ...
    def free(self, ptr: DevicePtr) -> None: ...
    def copy_d2d_async(self, src: Any, dst: Any, nbytes: int, stream: Any) -> None: ...
    def copy_d2d_2d_async(self, src: Any, src_pitch: int, dst: Any, dst_pitch: int, width_bytes: int,
                          height: int, stream: Any) -> None: ...
    def copy_h2d_async(self, src: Any, dst: Any, stream: Any) -> None: ...
    def copy_d2h_on_stream(self, src: Any, dst: Any, stream: Any) -> None: ...
    def launch(self, kernel: KernelHandle, grid: Any, block: Any, shared_bytes: int, stream: Any,
               params: ParamPack) -> None: ...
    def synchronize(self, stream: Any) -> None: ...
    def cublas_bf16_proj_dense(self, act: Any, weight: Any, out: Any, m: int, n: int, k: int,
                               stream: Any) -> None: ...


def _host_nbytes(obj: Any, name: str) -> int:
    """The bytes a host buffer says it holds (numpy array, PinnedBuffer, bytes-like); :func:`_args.host_buffer`
    then checks it."""
    if isinstance(obj, np.ndarray):
        return obj.nbytes
    if isinstance(obj, cm.PinnedBuffer):
        return obj.bytes
    try:
        return memoryview(obj).nbytes
    except TypeError:
        raise TypeError(f"{name} must be a host buffer (numpy array, bytes-like or PinnedBuffer), got "
                        f"{type(obj).__name__}") from None


class CudaBackend(Closeable):
    """``GpuBackend`` over ``hss.cuda_min``: PTX modules loaded once, allocations tracked by address
    (``free`` of an unknown address is an error; ``close`` frees what is left), one cuBLAS handle.

    ``ctx``: the :class:`~hss.cuda_min.CudaCtx` it works in (None: the context current at each call)."""

    def __init__(self, ctx: cm.CudaCtx | None = None) -> None:
        if ctx is not None and not isinstance(ctx, cm.CudaCtx):
            raise TypeError(f"ctx must be a CudaCtx or None, not {type(ctx).__name__}")
        self.ctx = ctx
        self._modules: dict[str, cm.CudaModule] = {}
        self._buffers: dict[int, cm.DeviceBuffer] = {}
        self._blas = Blas()
        self._gemm_args = tuple(_args.pointer_arg(f"cublas_bf16_proj_dense {name}", None, 2, "bf16",
                                                  write=name == "out", what=f"{shape} bf16")
                                for name, shape in (("act", "[m, k]"), ("weight", "[n, k]"), ("out", "[m, n]")))

    # -- kernels --------------------------------------------------------------------------------
    def _module(self, module: str) -> cm.CudaModule:
        mod = self._modules.get(module)
        if mod is None:
            mod = self._modules[module] = ptx.load_module(module, self.ctx)
        return mod

    def kernel(self, module: str, func: str) -> KernelHandle:
        """The kernel ``func`` of PTX module ``module``; an error if either is absent."""
        decl = DECLARATIONS.get(func)
        if decl is None or decl.module != module:
            raise HssError(f"kernel {func} is not declared in hss.decls for module {module}")
        return KernelHandle(self._module(module).function(func), decl)

    def try_kernel(self, module: str, func: str) -> KernelHandle:
        """Like ``kernel`` but an absent module or function gives a falsy handle instead of an error."""
        try:
            return self.kernel(module, func)
        except (HssError, CudaError):
            return KernelHandle()

    def launch(self, kernel: KernelHandle, grid: Any, block: Any, shared_bytes: int, stream: Any,
               params: ParamPack) -> None:
        """Queue ``kernel`` on ``stream``: ``grid`` / ``block`` an int or 1-3 ints, ``params`` its ParamPack
        (checked against the kernel once); see :func:`hss.cuda_min.launch_kernel`."""
        if not isinstance(kernel, KernelHandle):
            raise TypeError(f"kernel must be a KernelHandle (from kernel()), got {type(kernel).__name__}")
        if not kernel:
            raise HssError("launch of an absent kernel (try_kernel found none)")
        cm.launch_kernel(kernel.func, grid, block, shared_bytes, stream, params)

    # -- memory ---------------------------------------------------------------------------------
    def alloc(self, nbytes: int) -> DevicePtr:
        """``nbytes`` (>= 1) of device memory (not zeroed); the error says how much is free."""
        n = _args.as_int("alloc nbytes", nbytes, 1, why="an allocation holds at least one byte")
        try:
            buf = cm.DeviceBuffer(n, self.ctx)
        except CudaError as exc:
            free, total = cm.mem_info()
            raise CudaError(exc.call, exc.name, exc.message,
                            f"{n} bytes requested, {free} of {total} free") from None
        self._buffers[buf.ptr] = buf
        return DevicePtr(buf.ptr)

    def free(self, ptr: Any) -> None:
        """Free memory from ``alloc`` (its address: an int or DevicePtr); a null pointer is a no-op."""
        addr = _args.as_int("free ptr", ptr, 0, 2**64 - 1, why="the address alloc returned")
        if addr == 0:
            return
        buf = self._buffers.pop(addr, None)
        if buf is None:
            raise HssError(f"free({addr:#x}): not an allocation of this backend (double free?)")
        buf.close()

    def copy_d2d_async(self, src: Any, dst: Any, nbytes: int, stream: Any) -> None:
        """Queue a copy of ``nbytes`` from device ``src`` to device ``dst``."""
        cm.copy_d_to_d_async(dst, src, nbytes, stream)

    def copy_d2d_2d_async(self, src: Any, src_pitch: int, dst: Any, dst_pitch: int, width_bytes: int,
                          height: int, stream: Any) -> None:
        """Queue a pitched copy: ``height`` rows of ``width_bytes``, rows ``*_pitch`` bytes apart."""
        cm.copy_2d_d_to_d_async(dst, dst_pitch, src, src_pitch, width_bytes, height, stream)

    def copy_h2d_async(self, src: Any, dst: Any, stream: Any) -> None:
        """Queue all of host ``src`` (numpy array, bytes-like or PinnedBuffer) into device ``dst``; a pageable
        ``src`` may be reused at once (the driver stages it)."""
        cm.copy_h_to_d_async(dst, src, _host_nbytes(src, "copy_h2d_async src"), stream)

    def copy_d2h_on_stream(self, src: Any, dst: Any, stream: Any) -> None:
        """Copy as many bytes as host ``dst`` holds from device ``src`` after prior work on ``stream``, then wait
        (blocking)."""
        s = _args.stream(stream)
        cm.copy_d_to_h_async(dst, src, _host_nbytes(dst, "copy_d2h_on_stream dst"), s)
        cm.stream_sync(s)

    def synchronize(self, stream: Any) -> None:
        """Block until the work queued on ``stream`` has finished."""
        cm.stream_sync(_args.stream(stream))

    def cublas_bf16_proj_dense(self, act: Any, weight: Any, out: Any, m: int, n: int, k: int,
                               stream: Any) -> None:
        """Row-major ``out[m, n] = act[m, k] · weight[n, k]ᵀ``, bf16 in/out, f32 compute (cuBLAS GemmEx)."""
        m = _args.as_int("cublas_bf16_proj_dense m", m, 1, _I32, why="a positive int32")
        n = _args.as_int("cublas_bf16_proj_dense n", n, 1, _I32, why="a positive int32")
        k = _args.as_int("cublas_bf16_proj_dense k", k, 1, _I32, why="a positive int32")
        s = _args.stream(stream)
        a, w, o = self._gemm_args
        self._gemm(a(act, s, 2 * m * k), w(weight, s, 2 * n * k), o(out, s, 2 * m * n), m, n, k, s)

    def _gemm(self, act: int, weight: int, out: int, m: int, n: int, k: int, stream: int) -> None:
        """The GEMM on checked ints, in this backend's context."""
        self._make_current()
        self._blas.proj_dense(act, weight, out, m, n, k, stream)

    def _prepare_gemm(self) -> None:
        """Create the cuBLAS handle now, in this backend's context (a GEMM inside a capture needs one)."""
        self._make_current()
        self._blas.prepare()

    def _make_current(self) -> None:
        if self.ctx is not None:
            self.ctx.make_current()
        else:   # no CudaCtx to name: the context current on this thread (made so if there is none)
            ensure_context()

    # -- lifetime -------------------------------------------------------------------------------
    def close(self) -> None:
        """Free every allocation still held, the cuBLAS handle and the modules (idempotent)."""
        self._blas.close()
        for buf in self._buffers.values():
            buf.close()
        self._buffers.clear()
        for mod in self._modules.values():
            mod.close()
        self._modules.clear()


# -- prepared hot-path operations ------------------------------------------------------------------
def _own_method(gpu: Any, name: str) -> bool:
    """Whether ``gpu`` is a CudaBackend whose method ``name`` is CudaBackend's own (not overridden)."""
    return isinstance(gpu, CudaBackend) and getattr(type(gpu), name) is getattr(CudaBackend, name)


def launcher(gpu: GpuBackend, kernel: KernelHandle, block: Any, shared_bytes: int,
             pack: ParamPack, programmatic: bool = False) -> Callable[..., None]:
    """A prepared launch of ``kernel`` with ``pack`` (refilled in place by the caller, e.g. through
    ``pack.slot(name)``): ``run(stream, gx, gy=1, gz=1)``, ``stream`` a raw handle and the grid positive ints, both
    already checked by the caller.

    On a :class:`CudaBackend` it is :func:`hss.cuda._launch.launcher` (block, shared size and pack checked once, here;
    no conversion per run; ``programmatic``: with programmatic stream serialization, for kernels that wait for the
    launch before them, see there); on any other backend each run calls its ``launch`` (in stream order)."""
    if not isinstance(kernel, KernelHandle) or not kernel:
        raise HssError("a launcher needs a present KernelHandle (try_kernel found none)")
    if type(pack) is not ParamPack:
        raise TypeError(f"pack must be a ParamPack (kernel.pack(...)), got {type(pack).__name__}")
    if _own_method(gpu, "launch"):
        return _launch.launcher(kernel.func, block, shared_bytes, pack, programmatic)
    dims = _args.dims3("block", block)
    shared = _args.as_int("shared_bytes", shared_bytes, 0)

    def run(stream: int, gx: int, gy: int = 1, gz: int = 1) -> None:
        gpu.launch(kernel, (gx, gy, gz), dims, shared, stream, pack)

    return run


def proj_dense(gpu: GpuBackend, weight: Any, out: Any, n: int, k: int, max_m: int) -> Callable[[int, int, int], None]:
    """A prepared ``gpu.cublas_bf16_proj_dense`` with a fixed ``weight [n, k]`` and ``out`` (room for ``max_m``
    rows): ``run(act, m, stream)``, ``act`` a checked device address of ``[m, k]`` bf16, ``1 <= m <= max_m`` and
    ``stream`` a raw handle (the caller checked all three). ``weight``, ``out``, ``n`` and ``k`` are checked here,
    once. On a :class:`CudaBackend` a run goes straight to cuBLAS; elsewhere it calls the backend's method."""
    n, k, max_m = (_args.as_int(name, v, 1, _I32, why="a positive int32")
                   for name, v in (("n", n), ("k", k), ("max_m", max_m)))
    w = _args.pointer(weight, "weight", 2 * n * k, 2, "bf16", what="[n, k] bf16")
    o = _args.pointer(out, "out", 2 * max_m * n, 2, "bf16", write=True, what=f"[{max_m}, n] bf16")
    if _own_method(gpu, "cublas_bf16_proj_dense"):
        gemm = gpu._gemm   # type: ignore[attr-defined]
        gpu._prepare_gemm()   # type: ignore[attr-defined]  (the handle exists before any capture)

        def run(act: int, m: int, stream: int) -> None:
            gemm(act, w, o, m, n, k, stream)
    else:
        def run(act: int, m: int, stream: int) -> None:
            gpu.cublas_bf16_proj_dense(act, w, o, m, n, k, stream)

    return run
