"""Calibrated predictor projections (docs/design.md §17.5): the top uncentered principal directions of a model's keys.

:func:`calibrate_projection` turns calibration keys (one ``[tokens, num_kv_heads, head_dim]`` array per layer, e.g.
the post-RoPE keys :func:`hss.checkpoint.forward` captures) into the per-layer, per-kv-head projection that
:class:`hss.predictor.Predictor` takes as ``projection=``: ``[num_layers, num_kv_heads, head_dim, r]`` bf16.
Offline and numpy-only (float64 SVD); it needs no device.

Why uncentered: the predictor ranks pages by ``q . k`` restricted to the span of P, and keys of a real model share a
large common component (the mean) that carries much of that dot product, so the directions that keep the most of
``||K v||`` (the right singular vectors of K itself, not of K minus its mean) keep the most of the score. Measured on
SmolLM2-135M, mean-subtracted PCA captured far less attention mass at the same r.
"""
from __future__ import annotations

from collections.abc import Sequence

import ml_dtypes
import numpy as np

from hss import _args
from hss.errors import HssError
from hss.predictor.projection import PredictorShape
from hss.reference.numerics import to_bf16

__all__ = ["calibrate_projection", "principal_directions"]


def principal_directions(keys: np.ndarray, r: int) -> np.ndarray:
    """The r right singular vectors of largest singular value of the uncentered ``keys [tokens, head_dim]``, as the
    columns of a float64 ``[head_dim, r]``; each column's sign makes its largest-magnitude component positive
    (the first such component where magnitudes tie). Directions of equal singular value are any orthonormal basis
    of their span (LAPACK's choice)."""
    k = np.asarray(keys, dtype=np.float64)
    _, _, vt = np.linalg.svd(k, full_matrices=False)
    v = vt[:r]                                               # [r, head_dim], singular values descending
    lead = v[np.arange(r), np.abs(v).argmax(axis=1)]
    return (v * np.where(lead < 0, -1.0, 1.0)[:, None]).T


def _layers(keys: np.ndarray | Sequence[np.ndarray]) -> list[np.ndarray]:
    """``keys`` as a list of ``[tokens, num_kv_heads, head_dim]`` arrays, all of one kv-head count and head_dim."""
    if isinstance(keys, np.ndarray):
        if keys.ndim != 4:
            raise HssError(f"keys: an array must be [num_layers, tokens, num_kv_heads, head_dim], got shape "
                           f"{keys.shape}; or pass a list of [tokens, num_kv_heads, head_dim] arrays, one per layer")
        layers = list(keys)
    elif isinstance(keys, (list, tuple)):
        layers = [np.asarray(k) for k in keys]
    else:
        raise TypeError(f"keys must be a numpy array or a list of arrays, got {type(keys).__name__}")
    if not layers:
        raise HssError("keys: no layers given")
    for i, k in enumerate(layers):
        if k.ndim != 3:
            raise HssError(f"keys[{i}] must be [tokens, num_kv_heads, head_dim], got shape {k.shape}")
        if k.dtype.kind not in "fiu" and k.dtype != ml_dtypes.bfloat16:
            raise TypeError(f"keys[{i}] must hold real numbers, got dtype {k.dtype}")
        if k.shape[1:] != layers[0].shape[1:]:
            raise HssError(f"keys[{i}] has {k.shape[1]} kv heads x head_dim {k.shape[2]}, keys[0] "
                           f"{layers[0].shape[1]} x {layers[0].shape[2]}: every layer must have the same")
    return layers


def calibrate_projection(keys: np.ndarray | Sequence[np.ndarray], r: int) -> np.ndarray:
    """A per-layer, per-kv-head predictor projection from calibration keys (docs/design.md §17.5).

    keys: one ``[tokens, num_kv_heads, head_dim]`` array per layer (any real dtype; a list, or one
    ``[num_layers, tokens, num_kv_heads, head_dim]`` array), at least r tokens each, all finite; use keys of
    other text than the one the predictor will serve, post-RoPE as the cache stores them.
    r: the rank, 1 .. min(head_dim, 128).
    Returns C-contiguous ``[num_layers, num_kv_heads, head_dim, r]`` ``ml_dtypes.bfloat16``: entry [l, j] is
    :func:`principal_directions` of layer l's keys of kv head j, rounded once to bf16 (round-to-nearest-even).
    """
    layers = _layers(keys)
    _, nkv, hd = layers[0].shape
    r = _args.as_int("r", r)
    try:
        r = PredictorShape(hd, r).r   # the projection's own limits, with its messages
    except ValueError as exc:
        raise HssError(f"calibrate_projection: {exc}") from None
    if r > hd:
        raise HssError(f"calibrate_projection: r ({r}) must be <= head_dim ({hd}): a head has only {hd} directions")
    out = np.empty((len(layers), nkv, hd, r), dtype=ml_dtypes.bfloat16)
    for i, k in enumerate(layers):
        if k.shape[0] < r:
            raise HssError(f"keys[{i}] has {k.shape[0]} tokens; calibrating r = {r} directions needs at least r "
                           "(use more calibration text)")
        k64 = k.astype(np.float64)
        if not np.isfinite(k64).all():
            raise HssError(f"keys[{i}] holds NaN or inf; calibrate on finite keys")
        for j in range(nkv):
            out[i, j] = to_bf16(principal_directions(k64[:, j], r))
    return out
