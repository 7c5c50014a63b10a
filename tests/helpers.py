"""Test helpers: device round trips, NaN poisoning, and the SPEC §0 error bounds with their mutation checks."""
from __future__ import annotations

import numpy as np
import ml_dtypes

from hss import cuda_min as cm

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


def bound(ref: np.ndarray, kind: str, row_axes: tuple[int, ...], valid: np.ndarray | None = None) -> np.ndarray:
    """SPEC §0 per-element bound: bf16 -> 2^-7|ref| + 1e-5 max|ref|, f32 -> 1e-4 max|ref| (max per row)."""
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
