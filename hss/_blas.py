"""The bf16 projection GEMM through cuBLAS (``nvmath.bindings.cublas``), or the emulator's stand-in.

``out[m, n] = act[m, k] · weight[n, k]ᵀ`` row-major, bf16 in and out, f32 compute (SPEC §9).
In cuBLAS's column-major terms: C[n, m] = Aᵀ B with A = weight as a column-major [k, n] matrix (ld k,
transposed), B = act as column-major [k, m] (ld k), C = out as column-major [n, m] (ld n).
"""
from __future__ import annotations

import numpy as np

from hss._driver import CudaError, is_emulator

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
            from hss._driver import check
            from hss.emulator.blas import proj_dense_bf16
            check(proj_dense_bf16(act, weight, out, m, n, k, stream), "cublas_bf16_proj_dense (emulated)")
            return
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

    def close(self) -> None:
        if self._handle is not None:
            handle, self._handle = self._handle, None
            try:
                _cublas().destroy(handle)
            except Exception:   # context already gone at shutdown
                pass


def _cublas():
    try:
        from nvmath.bindings import cublas
    except ImportError as exc:
        raise CudaError("import nvmath.bindings.cublas", "ImportError",
                        f"{exc}; install nvmath-python (and cuBLAS: pip install 'nvmath-python[cu13]')") from None
    return cublas
