"""Rounding helpers shared by the references: float64 -> bf16 / f32 with a single rounding."""
from __future__ import annotations

import ml_dtypes
import numpy as np

BF16 = ml_dtypes.bfloat16


def to_bf16(x: np.ndarray) -> np.ndarray:
    """Round float64 to bf16 once (RNE). ml_dtypes goes through float32 and can round twice;
    rounding to float32 *to odd* first keeps the final bf16 rounding exact."""
    x = np.asarray(x, dtype=np.float64)
    with np.errstate(over="ignore"):
        f = x.astype(np.float32)
    back = f.astype(np.float64)
    inexact = (back != x) & np.isfinite(x) & np.isfinite(f)
    if inexact.any():
        away = inexact & (np.abs(back) > np.abs(x))
        f = np.where(away, np.nextafter(f, np.float32(0)), f)
        f = (f.view(np.uint32) | inexact.astype(np.uint32)).view(np.float32)   # sticky bit: round to odd
    return f.astype(BF16)


def to_f32(x: np.ndarray) -> np.ndarray:
    """Round float64 to float32 (numpy's cast is a single RNE rounding)."""
    return np.asarray(x, dtype=np.float64).astype(np.float32)
