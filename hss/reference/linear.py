"""Reference for the bf16 projection GEMM (docs/design.md §9 ``cublas_bf16_proj_dense``)."""
from __future__ import annotations

import numpy as np


def proj_dense(act: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """Row-major ``act[m, k] @ weight[n, k].T`` accumulated in float64 (round to bf16 afterwards)."""
    return np.asarray(act, dtype=np.float64) @ np.asarray(weight, dtype=np.float64).T
