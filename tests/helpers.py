"""Test helpers: device round trips, NaN poisoning, a recording GpuBackend, a foreign CUDA array, and the docs/design.md
§0 error bounds with their mutation checks."""
from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

from hss import cuda_min as cm
from hss._params import ParamPack

BF16 = ml_dtypes.bfloat16
MASKED = np.float32(-1e30)


def upload(arr: np.ndarray, stream: int) -> cm.DeviceBuffer:
    """A new device buffer holding ``arr`` (copied on ``stream``)."""
    arr = np.ascontiguousarray(arr)
    buf = cm.DeviceBuffer(max(arr.nbytes, 1))
    cm.copy_h_to_d_async(buf, arr, arr.nbytes, stream)
    return buf


def download(ptr, shape, dtype, stream: int) -> np.ndarray:
    """Copy ``shape`` elements of ``dtype`` from ``ptr`` to the host (waits for the stream)."""
    out = np.empty(shape, dtype=dtype)
    cm.copy_d_to_h_async(out, ptr, out.nbytes, stream)
    cm.stream_sync(stream)
    return out


def poisoned(nbytes: int, stream: int) -> cm.DeviceBuffer:
    """A device buffer of ``nbytes`` filled with 0xFF (NaN as f32 and bf16, -1 as ints)."""
    buf = cm.DeviceBuffer(max(nbytes, 1))
    cm.memset_d8_async(buf, 0xFF, buf.bytes, stream)
    return buf


class CudaArray:
    """A foreign device array that speaks ``__cuda_array_interface__`` v3 as torch does: the interface is built at every
    read from fields a test may change in place between calls (as ``resize_`` changes a tensor's shape): ``ptr`` (an
    address, or a DeviceBuffer's), ``shape``, ``typestr`` (bf16 as ``<V2``: the interface has no bf16), ``readonly``,
    ``stream`` (the producer's; None: none)."""

    def __init__(self, ptr: Any, shape: tuple, typestr: str, readonly: bool = False, stream: int | None = None) -> None:
        self.ptr = ptr if isinstance(ptr, int) else ptr.ptr
        self.shape, self.typestr, self.readonly, self.stream = shape, typestr, readonly, stream

    @property
    def __cuda_array_interface__(self) -> dict:
        return {"shape": self.shape, "typestr": self.typestr, "data": (self.ptr, self.readonly), "version": 3,
                "strides": None, "stream": self.stream}


DEVICE_WORK = {"kernel", "try_kernel", "alloc", "free", "launch", "copy_d2d_async", "copy_d2d_2d_async",
               "copy_h2d_async", "copy_d2h_on_stream", "cublas_bf16_proj_dense", "synchronize"}


class Recording:
    """A GpuBackend that records every device call it forwards: (name, args)."""

    def __init__(self, gpu: Any) -> None:
        self._gpu, self.calls = gpu, []
        self.ctx = gpu.ctx

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._gpu, name)
        if name not in DEVICE_WORK:
            return attr

        def call(*args: Any, **kw: Any) -> Any:   # a parameter pack is recorded by its values at call time
            self.calls.append((name, tuple(a.values() if isinstance(a, ParamPack) else a for a in args)))
            return attr(*args, **kw)
        return call


def bound(ref: np.ndarray, kind: str, row_axes: tuple[int, ...], valid: np.ndarray | None = None) -> np.ndarray:
    """docs/design.md §0 per-element bound: bf16 -> 2^-7|ref| + 1e-5 max|ref|, f32 -> 1e-4 max|ref| (max per row)."""
    a = np.abs(np.asarray(ref, dtype=np.float64))
    if valid is not None:
        a = np.where(valid, a, 0.0)
    rowmax = a.max(axis=row_axes, keepdims=True) if a.size else a
    if kind == "bf16":
        return 2.0 ** -7 * a + 1e-5 * rowmax
    if kind == "f32":
        return 1e-4 * rowmax + 0 * a
    raise ValueError(kind)


def violations(got: np.ndarray, ref: np.ndarray, kind: str, row_axes: tuple[int, ...],
               valid: np.ndarray | None = None, tol: np.ndarray | None = None) -> np.ndarray:
    """Boolean mask of valid entries where |got - ref| exceeds the bound (NaN counts as a violation)."""
    g = np.asarray(got, dtype=np.float64)
    r = np.asarray(ref, dtype=np.float64)
    b = bound(r, kind, row_axes, valid) if tol is None else tol
    bad = ~(np.abs(g - r) <= b)
    return bad if valid is None else bad & valid


def assert_close(got, ref, kind: str, row_axes: tuple[int, ...], what: str, valid=None, tol=None) -> None:
    bad = violations(got, ref, kind, row_axes, valid, tol)
    if bad.any():
        idx = np.argwhere(bad)[:5]
        g, r = np.asarray(got, np.float64), np.asarray(ref, np.float64)
        detail = ", ".join(f"{tuple(i)}: got {g[tuple(i)]!r} ref {r[tuple(i)]!r}" for i in idx)
        raise AssertionError(f"{what}: {int(bad.sum())} of {bad.size} entries outside the {kind} bound; {detail}")


def assert_bites(got, mutated_ref, kind: str, row_axes: tuple[int, ...], what: str, valid=None) -> None:
    """The mutation check: the same comparison against a reference with a term dropped must fail."""
    if not violations(got, mutated_ref, kind, row_axes, valid).any():
        raise AssertionError(f"{what}: the bound does not bite (a mutated reference also passes)")


# Tensor-core scorer bound (docs/design.md §0: derived for the split-q kernel, stated here). Per score entry (r, b):
#   |tc - ref| <= (TC_SPLIT + TC_ACC) * S_rb + TC_FINAL * |ref_rb|,   S_rb = sum_h sum_d |q_rhd| |k_bd| / sqrt(128)
# TC_SPLIT: q = hi + lo + delta with hi = bf16(q) (|q - hi| <= 2^-8 |q|) and lo = bf16(q - hi) (<= 2^-8 of that),
#   so |delta| <= 2^-16 |q| per element; the bf16 x bf16 products are exact, so this is the whole input error.
# TC_ACC: each head's dot sums 256 exact products (128 hi + 128 lo; sum of their magnitudes <= (1 + 2^-7) S) in the
#   f32 accumulator of 16 mma steps; the tensor cores truncate rather than round, so each addition costs at most
#   one f32 ulp (2^-23) of a partial sum bounded by that magnitude: the standard n*u bound with u = 2^-23.
# TC_FINAL: relu is 1-Lipschitz; the head sum (3 additions of non-negative terms), rsqrtf(128) (<= 2 ulp) and the
#   final product add at most 8 * 2^-24 = 2^-21 relative.
# This is wider than the f32 rule 1e-4 * max|ref| on unit data by about 2x (S is ~5x the row max there), but it is
# what the 17-bit split and tensor-core accumulation support, no more; dropping one head misses it by orders.
TC_SPLIT, TC_ACC, TC_FINAL = 2.0 ** -16, 256 * 2.0 ** -23 * (1 + 2.0 ** -7), 2.0 ** -21


def tc_bound(q: np.ndarray, keys: np.ndarray, want: np.ndarray) -> np.ndarray:
    """The derived per-entry bound of qsa_score_rows_tc (see TC_SPLIT above) for ``want [rows, n_blocks]``."""
    n = want.shape[1]
    kk = np.abs(keys[:n].astype(np.float64))
    s = np.einsum("rhd,bd->rb", np.abs(q.astype(np.float64)), kk) / np.sqrt(128) if n else np.zeros(want.shape)
    return (TC_SPLIT + TC_ACC) * s + TC_FINAL * np.abs(np.where(want == MASKED, 0.0, want))
