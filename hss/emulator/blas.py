"""Emulated cuBLAS projection: float64 accumulation rounded to bf16, queued on the stream like a launch.

Deterministic in m, so chunked and one-shot projections agree bit for bit on the emulator.
"""
from __future__ import annotations

import ml_dtypes

from hss.reference.linear import proj_dense
from hss.reference.numerics import to_bf16

from .driver import S, _needs_ctx, enqueue, stream_of, view_on
from .enums import CUresult as R


def proj_dense_bf16(act: int, weight: int, out: int, m: int, n: int, k: int, stream: int) -> tuple:
    """``out[m, n] = bf16(act[m, k] @ weight[n, k].T)``, all row-major bf16 device memory."""
    err = _needs_ctx()
    if err:
        return (err,)
    st = stream_of(stream)
    if st is None or st.ctx != S.current():
        return (R.CUDA_ERROR_INVALID_HANDLE,)
    bf, d = ml_dtypes.bfloat16, S.device()
    with S.lock:
        a = view_on(d, act, 2 * m * k, "cublas_bf16_proj_dense act").view(bf).reshape(m, k)
        w = view_on(d, weight, 2 * n * k, "cublas_bf16_proj_dense weight").view(bf).reshape(n, k)
        o = view_on(d, out, 2 * m * n, "cublas_bf16_proj_dense out").view(bf).reshape(m, n)

        def op() -> None:
            o[:] = to_bf16(proj_dense(a, w))
        enqueue(st, op)
    return (R.CUDA_SUCCESS,)

