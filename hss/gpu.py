"""spark-runtime's GPU surface as the QSA indexer uses it (SPEC §9): ``DevicePtr``, ``KernelHandle``,
the ``GpuBackend`` protocol, and ``CudaBackend``, its one implementation over :mod:`hss.cuda_min`.

Argument orders are the original's: ``GpuBackend`` copies take the *source first*
(``copy_d2d_async(src, dst, bytes, stream)``), unlike ``cuda_min`` (destination first).
"""
from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from hss import cuda_min as cm
from hss import ptx
from hss._blas import Blas
from hss.errors import CudaError, HssError
from hss._args import device_ptr
from hss._context import _ensure_context
from hss._params import ParamPack
from hss.kernels import DECLARATIONS, KernelDecl


class DevicePtr(int):
    """A device address (an ``int``); ``offset`` adds bytes, with no scaling and no bounds check."""

    def offset(self, nbytes: int) -> "DevicePtr":
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


class CudaBackend:
    """``GpuBackend`` over ``hss.cuda_min``: PTX modules loaded once, allocations tracked by address
    (``free`` of an unknown address is an error; ``close`` frees what is left), one cuBLAS handle."""

    def __init__(self, ctx: cm.CudaCtx | None = None) -> None:
        self.ctx = ctx
        self._modules: dict[str, cm.CudaModule] = {}
        self._buffers: dict[int, cm.DeviceBuffer] = {}
        self._blas = Blas()

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
            raise HssError(f"kernel {func} is not declared in hss.kernels for module {module}")
        return KernelHandle(self._module(module).function(func), decl)

    def try_kernel(self, module: str, func: str) -> KernelHandle:
        """Like ``kernel`` but an absent module or function gives a falsy handle instead of an error."""
        try:
            return self.kernel(module, func)
        except (HssError, CudaError):
            return KernelHandle()

    def launch(self, kernel: KernelHandle, grid: Any, block: Any, shared_bytes: int, stream: Any,
               params: ParamPack) -> None:
        if not kernel:
            raise HssError("launch of an absent kernel (try_kernel found none)")
        cm.launch_kernel(kernel.func, grid, block, shared_bytes, stream, params)

    # -- memory ---------------------------------------------------------------------------------
    def alloc(self, nbytes: int) -> DevicePtr:
        """``nbytes`` of device memory (not zeroed); the error says how much is free."""
        try:
            buf = cm.DeviceBuffer(nbytes, self.ctx)
        except CudaError as exc:
            free, total = cm.mem_info()
            raise CudaError(exc.call, exc.name, exc.message,
                            f"{nbytes} bytes requested, {free} of {total} free") from None
        self._buffers[buf.ptr] = buf
        return DevicePtr(buf.ptr)

    def free(self, ptr: Any) -> None:
        """Free memory from ``alloc``; a null pointer is a no-op."""
        addr = device_ptr(ptr)
        if addr == 0:
            return
        buf = self._buffers.pop(addr, None)
        if buf is None:
            raise HssError(f"free({addr:#x}): not an allocation of this backend (double free?)")
        buf.close()

    def copy_d2d_async(self, src: Any, dst: Any, nbytes: int, stream: Any) -> None:
        cm.copy_d_to_d_async(dst, src, nbytes, stream)

    def copy_d2d_2d_async(self, src: Any, src_pitch: int, dst: Any, dst_pitch: int, width_bytes: int,
                          height: int, stream: Any) -> None:
        cm.copy_2d_d_to_d_async(dst, dst_pitch, src, src_pitch, width_bytes, height, stream)

    def copy_h2d_async(self, src: Any, dst: Any, stream: Any) -> None:
        """Queue ``src`` (bytes / numpy array) into ``dst``; pageable ``src`` may be reused at once."""
        n = src.nbytes if isinstance(src, np.ndarray) else len(memoryview(src).cast("B"))
        cm.copy_h_to_d_async(dst, src, n, stream)

    def copy_d2h_on_stream(self, src: Any, dst: Any, stream: Any) -> None:
        """Copy ``len(dst)`` bytes from ``src`` after prior work on ``stream``, then wait (blocking)."""
        n = dst.nbytes if isinstance(dst, np.ndarray) else len(memoryview(dst).cast("B"))
        cm.copy_d_to_h_async(dst, src, n, stream)
        cm.stream_sync(stream)

    def synchronize(self, stream: Any) -> None:
        cm.stream_sync(stream)

    def cublas_bf16_proj_dense(self, act: Any, weight: Any, out: Any, m: int, n: int, k: int,
                               stream: Any) -> None:
        """Row-major ``out[m, n] = act[m, k] · weight[n, k]ᵀ``, bf16 in/out, f32 compute (cuBLAS GemmEx)."""
        for name, v in (("m", m), ("n", n), ("k", k)):
            if not isinstance(v, (int, np.integer)) or v <= 0 or v >= 2**31:
                raise HssError(f"cublas_bf16_proj_dense: {name} must be a positive int32 (got {v!r})")
        ptrs = {"act": device_ptr(act), "weight": device_ptr(weight), "out": device_ptr(out)}
        for name, p in ptrs.items():
            if p == 0:
                raise HssError(f"cublas_bf16_proj_dense: {name} is a null pointer")
        _ensure_context()
        self._blas.proj_dense(ptrs["act"], ptrs["weight"], ptrs["out"], int(m), int(n), int(k),
                              cm.stream_handle(stream))

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

    def __enter__(self) -> "CudaBackend":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
