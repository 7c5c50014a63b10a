"""References for ``ptx/selftest.cu``: fill, axpy with an integer index stream, per-block sums."""
from __future__ import annotations

import numpy as np


def fill_u32(n: int, value: int) -> np.ndarray:
    """``out[i] = value`` for i < n."""
    return np.full(max(n, 0), value, dtype=np.uint32)


def axpy(x: np.ndarray, y: np.ndarray, a: float, n: int, mul: int, add: int) -> tuple[np.ndarray, np.ndarray]:
    """``out[i] = a*x[i] + y[i]`` in float64 and ``index[i] = i*mul + add`` wrapped to int64."""
    out = float(a) * x[:n].astype(np.float64) + y[:n].astype(np.float64)
    i = np.arange(max(n, 0), dtype=np.uint64)
    index = (i * np.uint64(mul) + np.uint64(add % (1 << 64))).view(np.int64)
    return out, index


def block_sums(x: np.ndarray, n: int, block: int) -> np.ndarray:
    """Sum of each consecutive chunk of ``block`` elements of ``x[:n]`` (the last chunk may be short)."""
    nb = -(-n // block)
    padded = np.zeros(nb * block, dtype=np.float64)
    padded[:n] = x[:n]
    return padded.reshape(nb, block).sum(axis=1)
