"""The bf16 projection GEMM through cuBLAS (``nvmath.bindings.cublas`` / ``cublasLt``), or the emulator's stand-in.

``out[m, n] = act[m, k] · weight[n, k]ᵀ`` row-major, bf16 in and out, f32 compute (docs/design.md §9).
In cuBLAS's column-major terms: C[n, m] = Aᵀ B with A = weight as a column-major [k, n] matrix (ld k,
transposed), B = act as column-major [k, m] (ld k), C = out as column-major [n, m] (ld n).

Each shape of at most :data:`LT_MAX_M` rows (decode: launch-bound, where the choice pays) at its first call outside
a stream capture times ``cublasGemmEx``'s default against up to :data:`LT_CANDIDATES` of cuBLASLt's heuristic
algorithms (each as a CUDA graph of :data:`LT_REPS` back-to-back calls, the least of :data:`LT_ROUNDS` replays
between CUDA events; the stream is synchronised) and keeps the fastest for that shape; a shape first met inside a
capture runs ``cublasGemmEx`` (nothing can be timed there). Every choice is an exact bf16 GEMM with f32
accumulation; the algorithms differ in their tiling and split-K, so in the rounding of the f32 sums.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from hss.cuda._driver import CudaError, is_emulator

LT_MAX_M = 16               # rows up to which a shape's algorithm is chosen by timing (decode); more: GemmEx
LT_CANDIDATES = 8            # cuBLASLt heuristic algorithms timed per shape
LT_REPS = 20                 # back-to-back calls in a candidate's timing graph
LT_ROUNDS = 4                # timed replays of that graph (the least counts)
LT_WORKSPACE = 4 << 20       # bytes of device workspace the cuBLASLt algorithms may use
CUDA_R_32F = 0

CUDA_R_16BF = 14          # cudaDataType
CUBLAS_COMPUTE_32F = 68   # cublasComputeType_t
CUBLAS_OP_N, CUBLAS_OP_T = 0, 1
CUBLAS_GEMM_DEFAULT = -1


class Blas:
    """One cuBLAS handle (created by :meth:`prepare` or the first GEMM, in the current context), bound to each
    call's stream. Create it before a stream capture: cublasCreate allocates, which a capture forbids."""

    def __init__(self) -> None:
        self._handle: int | None = None
        self._scalars = np.array([1.0, 0.0], dtype=np.float32)   # alpha, beta (host pointer mode)
        self._emulated = is_emulator()
        self._plans: dict[tuple[int, int, int], _LtPlan | None] = {}   # shape -> its cuBLASLt plan (None: GemmEx)
        self._lt: int | None = None          # the cuBLASLt handle
        self._workspace: Any = None          # cm.DeviceBuffer of LT_WORKSPACE bytes

    def prepare(self) -> None:
        """Create the handle now (in the current context), if there is none yet."""
        if self._emulated or self._handle is not None:
            return
        cublas = _cublas()
        try:
            self._handle = cublas.create()
        except cublas.cuBLASError as exc:
            raise CudaError("cublasCreate", type(exc).__name__, str(exc)) from None

    def proj_dense(self, act: int, weight: int, out: int, m: int, n: int, k: int, stream: int) -> None:
        if self._emulated:
            from hss.cuda._driver import check
            from hss.emulator.blas import proj_dense_bf16
            check(proj_dense_bf16(act, weight, out, m, n, k, stream), "cublas_bf16_proj_dense (emulated)")
            return
        plan = self._plans.get((m, n, k), _UNSET) if m <= LT_MAX_M else None
        if plan is _UNSET:
            plan = self._choose(act, weight, out, m, n, k, stream)
        if plan is not None:
            plan.run(self._lt, self._scalars.ctypes.data, act, weight, out, self._workspace.ptr, stream)
            return
        self._gemm_ex(act, weight, out, m, n, k, stream)

    def _gemm_ex(self, act: int, weight: int, out: int, m: int, n: int, k: int, stream: int) -> None:
        cublas = _cublas()
        try:
            if self._handle is None:
                self._handle = cublas.create()
            cublas.set_stream(self._handle, stream)
            alpha = self._scalars.ctypes.data
            cublas.gemm_ex(self._handle, CUBLAS_OP_T, CUBLAS_OP_N, n, m, k, alpha,
                           weight, CUDA_R_16BF, k, act, CUDA_R_16BF, k, alpha + 4,
                           out, CUDA_R_16BF, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT)
        except cublas.cuBLASError as exc:
            raise CudaError("cublasGemmEx", type(exc).__name__, str(exc), f"m={m} n={n} k={k}") from None

    def _choose(self, act: int, weight: int, out: int, m: int, n: int, k: int, stream: int) -> _LtPlan | None:
        """Time GemmEx and cuBLASLt's candidates for this shape on ``stream`` (not capturing: else GemmEx, not
        remembered) and remember the fastest; the calls write ``out`` (the real call follows)."""
        from hss import cuda_min as cm
        if cm.is_capturing(stream):
            return None
        if self._lt is None:
            lt = _cublaslt()
            try:
                self._lt = lt.create()
            except lt.cuBLASLtError as exc:
                raise CudaError("cublasLtCreate", type(exc).__name__, str(exc)) from None
            self._workspace = cm.DeviceBuffer(LT_WORKSPACE)
        try:
            plans = _LtPlan.candidates(self._lt, m, n, k)
        except CudaError:   # no heuristic for this shape: GemmEx it is
            plans = []
        events: list[Any] = []
        try:
            events.append(cm.CudaEvent(timing=True))
            events.append(cm.CudaEvent(timing=True))

            def timed(run: Any) -> float:
                # in a graph: back-to-back calls queued from the host would time the host, not the GPU
                run()   # (first use: whatever the algorithm sets up, outside the capture)
                cm.begin_capture(stream)
                try:
                    for _ in range(LT_REPS):
                        run()
                finally:
                    graph = cm.end_capture(stream)
                times = []
                try:
                    graph.launch(stream)
                    for _ in range(LT_ROUNDS):   # the least of a few: the choice must not follow the noise
                        events[0].record(stream)
                        graph.launch(stream)
                        events[1].record(stream)
                        events[1].synchronize()
                        times.append(events[0].elapsed_ms(events[1]))
                finally:
                    graph.close()
                return min(times)
            scal, ws = self._scalars.ctypes.data, self._workspace.ptr
            best, best_t = None, timed(lambda: self._gemm_ex(act, weight, out, m, n, k, stream))
            for plan in plans:
                try:
                    t = timed(lambda: plan.run(self._lt, scal, act, weight, out, ws, stream))
                except CudaError as exc:
                    if exc.call in _TIMING_CALLS:   # the timing's own driver calls failed, not the algorithm
                        raise
                    continue   # an algorithm the heuristic offered but this device refuses: not a candidate
                if t < best_t:
                    best, best_t = plan, t
        except BaseException:
            for plan in plans:
                plan.close()
            raise
        finally:
            for ev in events:
                ev.close()
        for plan in plans:
            if plan is not best:
                plan.close()
        self._plans[(m, n, k)] = best
        return best

    def close(self) -> None:
        for plan in self._plans.values():
            if plan is not None:
                plan.close()
        self._plans.clear()
        if self._lt is not None:
            lt, self._lt = self._lt, None
            try:
                _cublaslt().destroy(lt)
            except Exception:   # context already gone at shutdown
                pass
        if self._workspace is not None:
            self._workspace.close()
            self._workspace = None
        if self._handle is not None:
            handle, self._handle = self._handle, None
            try:
                _cublas().destroy(handle)
            except Exception:   # context already gone at shutdown
                pass


def _binding(name: str) -> Any:
    """``nvmath.bindings.<name>`` (``cublas`` or ``cublasLt``); a CudaError that says what to install if absent."""
    import importlib
    try:
        return importlib.import_module(f"nvmath.bindings.{name}")
    except ImportError as exc:
        raise CudaError(f"import nvmath.bindings.{name}", "ImportError",
                        f"{exc}; install nvmath-python (and cuBLAS: pip install 'nvmath-python[cu13]')") from None


def _cublas() -> Any:
    return _binding("cublas")


_UNSET = object()


_TIMING_CALLS = frozenset({"cuEventRecord", "cuEventSynchronize", "cuEventElapsedTime"})   # _choose's own waits


class _LtPlan:
    """One shape's cuBLASLt matmul (descriptors, layouts, one algorithm), run as ``out = act · weightᵀ``."""

    def __init__(self, desc: int, layouts: tuple[int, int, int], algo: np.ndarray, m: int, n: int, k: int) -> None:
        self.desc, self.layouts, self.algo, self.shape = desc, layouts, algo, (m, n, k)

    @classmethod
    def candidates(cls, handle: int, m: int, n: int, k: int) -> list[_LtPlan]:
        """Up to LT_CANDIDATES plans from cuBLASLt's heuristic for this shape (each its own descriptors)."""
        lt = _cublaslt()
        results = np.zeros(LT_CANDIDATES, dtype=lt.matmul_heuristic_result_dtype)
        count = np.zeros(1, dtype=np.int32)
        desc, layouts, pref = cls._describe(m, n, k)
        try:
            ws = np.array([LT_WORKSPACE], dtype=np.uint64)
            _lt_call("cublasLtMatmulPreferenceSetAttribute", lt.matmul_preference_set_attribute, pref,
                     int(lt.MatmulPreferenceAttribute.MAX_WORKSPACE_BYTES), ws.ctypes.data, 8)
            _lt_call("cublasLtMatmulAlgoGetHeuristic", lt.matmul_algo_get_heuristic, handle, desc, *layouts,
                     layouts[2], pref, LT_CANDIDATES, results.ctypes.data, count.ctypes.data)
        finally:
            lt.matmul_preference_destroy(pref)
            cls._destroy(desc, layouts)
        plans = []
        try:
            for r in results[:int(count[0])]:
                if int(r["state"]) != 0 or int(r["workspace_size"]) > LT_WORKSPACE:
                    continue
                d, lay, p = cls._describe(m, n, k)
                lt.matmul_preference_destroy(p)
                plans.append(cls(d, lay, np.array(r["algo"]["data_"], dtype=np.uint64), m, n, k))
        except BaseException:
            for plan in plans:
                plan.close()
            raise
        return plans

    @staticmethod
    def _describe(m: int, n: int, k: int) -> tuple[int, tuple[int, int, int], int]:
        lt = _cublaslt()
        desc = _lt_call("cublasLtMatmulDescCreate", lt.matmul_desc_create, CUBLAS_COMPUTE_32F, CUDA_R_32F)
        trans = np.array([CUBLAS_OP_T], dtype=np.int32)
        _lt_call("cublasLtMatmulDescSetAttribute", lt.matmul_desc_set_attribute, desc,
                 int(lt.MatmulDescAttribute.TRANSA), trans.ctypes.data, 4)
        layouts = (_lt_call("cublasLtMatrixLayoutCreate", lt.matrix_layout_create, CUDA_R_16BF, k, n, k),   # weight
                   _lt_call("cublasLtMatrixLayoutCreate", lt.matrix_layout_create, CUDA_R_16BF, k, m, k),   # act
                   _lt_call("cublasLtMatrixLayoutCreate", lt.matrix_layout_create, CUDA_R_16BF, n, m, n))   # out
        pref = _lt_call("cublasLtMatmulPreferenceCreate", lt.matmul_preference_create)
        return desc, layouts, pref

    @staticmethod
    def _destroy(desc: int, layouts: tuple[int, ...]) -> None:
        lt = _cublaslt()
        for lay in layouts:
            lt.matrix_layout_destroy(lay)
        lt.matmul_desc_destroy(desc)

    def run(self, handle: int, scalars: int, act: int, weight: int, out: int, workspace: int, stream: int) -> None:
        lt = _cublaslt()
        a, b, c = self.layouts
        try:
            lt.matmul(handle, self.desc, scalars, weight, a, act, b, scalars + 4, out, c, out, c, self.algo.ctypes.data,
                      workspace, LT_WORKSPACE, stream)
        except lt.cuBLASLtError as exc:
            m, n, k = self.shape
            raise CudaError("cublasLtMatmul", type(exc).__name__, str(exc), f"m={m} n={n} k={k}") from None

    def close(self) -> None:
        if self.desc:
            desc, self.desc = self.desc, 0
            try:
                self._destroy(desc, self.layouts)
            except Exception:   # context already gone at shutdown
                pass


def _lt_call(name: str, fn: Any, *args: Any) -> Any:
    lt = _cublaslt()
    try:
        return fn(*args)
    except lt.cuBLASLtError as exc:
        raise CudaError(name, type(exc).__name__, str(exc)) from None


def _cublaslt() -> Any:
    return _binding("cublasLt")
