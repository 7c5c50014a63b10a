"""Argument checks shared by the indexer's modules: each raises naming the parameter and the fix."""
from __future__ import annotations

import math
import os
from typing import Any

import numpy as np

from hss.errors import HssError
from hss._args import device_ptr

U32 = 2**32 - 1
MIN_BLOCK_SIZE = 8   # the identity and prefill tables are sized for pages of at least 8 tokens


def count(name: str, value: Any, lo: int, hi: int = U32, why: str = "") -> int:
    """``value`` as an int in [lo, hi] (TypeError for a non-integer, HssError out of range)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"QsaIndexer: {name} must be an integer, got {type(value).__name__} {value!r}")
    v = int(value)
    if not lo <= v <= hi:
        rng = f">= {lo}" if hi == U32 else f"in [{lo}, {hi}]"
        raise HssError(f"QsaIndexer: {name} = {v} must be {rng}{'; ' + why if why else ''}")
    return v


def real(name: str, value: Any, positive: bool) -> float:
    """``value`` at its float32 value, finite and > 0 (``positive``) or >= 0."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"QsaIndexer: {name} must be a number, got {type(value).__name__} {value!r}")
    with np.errstate(over="ignore"):
        v = float(np.float32(value))   # the kernels take it as f32
    if not math.isfinite(v) or (v <= 0 if positive else v < 0):
        need = "finite and > 0" if positive else "finite and >= 0"
        raise HssError(f"QsaIndexer: {name} = {value!r} must be {need} as a float32")
    return v


def pointer(name: str, value: Any) -> int:
    """A non-null device address."""
    p = device_ptr(value)
    if p == 0:
        raise HssError(f"QsaIndexer: {name} is a null device pointer; pass the device address of the tensor")
    return p


def env_flag(name: str, value: bool | None) -> bool:
    """``value`` if given, else env ``name``: "1" is on, "" / "0" / unset off, anything else an error."""
    if value is not None:
        if not isinstance(value, (bool, np.bool_)):
            raise TypeError(f"QsaIndexer: the {name} override must be a bool or None, got {type(value).__name__}")
        return bool(value)
    raw = os.environ.get(name, "").strip()
    if raw in ("", "0"):
        return False
    if raw == "1":
        return True
    raise HssError(f"{name}={raw!r} is not a flag; set it to 1 (on) or 0 / unset (off)")
