"""The indexer's settings and scalar argument rules (docs/design.md §11.1): environment flags, ``max_tokens``, float32
reals, page sizes, and the layer's dimensions checked together (:func:`layer_dims`)."""
from __future__ import annotations

import math
import os
from typing import Any, NamedTuple

import numpy as np

from hss import _args
from hss.decls import qsa as kq
from hss.errors import HssError

__all__ = ["DEFAULT_MAX_TOKENS", "MIN_BLOCK_SIZE", "env_flag", "max_tokens_setting", "f32_arg", "block_size_arg",
           "LayerDims", "layer_dims"]

DEFAULT_MAX_TOKENS = 32768
MIN_BLOCK_SIZE = 8          # the identity and prefill tables are sized for pages of at least 8 tokens
_SMEM_LIMIT = 48 * 1024     # qsa_score stages q in shared memory without the opt-in attribute
_I32 = 2**31 - 1
_ASCII_SPACE = " \t\n\r\v\f"   # what an environment setting may carry around its value


def env_flag(name: str, value: bool | None) -> bool:
    """``value`` if given, else env ``name``: "1" is on, "" / "0" / unset off, anything else an error."""
    if value is not None:
        if not isinstance(value, (bool, np.bool_)):
            raise TypeError(f"QsaIndexer: the {name} override must be a bool or None, got {type(value).__name__}")
        return bool(value)
    raw = os.environ.get(name, "").strip(_ASCII_SPACE)
    if raw in ("", "0"):
        return False
    if raw == "1":
        return True
    raise HssError(f"{name}={raw!r} is not a flag; set it to 1 (on) or 0 / unset (off)")


def max_tokens_setting(max_tokens: int | None) -> int:
    """``max_tokens`` if given, else ``HSS_QSA_MAX_TOKENS`` from the environment, else 32768."""
    if max_tokens is not None:
        return max_tokens
    raw = os.environ.get("HSS_QSA_MAX_TOKENS", "").strip(_ASCII_SPACE)
    if not raw:
        return DEFAULT_MAX_TOKENS
    if raw.isascii() and raw.isdigit():   # ASCII decimal digits only, as the original read it (no sign, no "_")
        try:
            return int(raw)
        except ValueError:   # more digits than int() converts
            raise HssError(f"HSS_QSA_MAX_TOKENS has {len(raw)} digits; at most {_I32} tokens (int32 token ids): "
                           "set it to the longest context in tokens or pass max_tokens=") from None
    raise HssError(f"HSS_QSA_MAX_TOKENS={raw!r} is not an integer (ASCII decimal digits); set it to the longest "
                   f"context in tokens (default {DEFAULT_MAX_TOKENS}) or pass max_tokens=")


def f32_arg(name: str, value: Any, positive: bool) -> float:
    """A real argument (:func:`hss._args.as_float`) at the float32 value the kernels take: finite there, and
    > 0 (``positive``) or >= 0."""
    v = _args.as_float(name, value)
    with np.errstate(over="ignore"):
        v32 = float(np.float32(v))
    if not math.isfinite(v32) or (v32 <= 0 if positive else v32 < 0):
        need = "> 0" if positive else ">= 0"
        raise HssError(f"{name} = {value!r} must be finite and {need} as a float32 (the kernels take it as f32)")
    return v32


def block_size_arg(block_size: Any) -> int:
    """A paged cache's tokens per page (>= MIN_BLOCK_SIZE: the identity and prefill tables are sized so)."""
    return _args.as_int("block_size", block_size, MIN_BLOCK_SIZE, _I32,
                        why=f"tokens per page; the identity and prefill tables are sized for pages of at least "
                            f"{MIN_BLOCK_SIZE} tokens")


class LayerDims(NamedTuple):
    """One layer's checked dimensions (Python ints; theta and eps at their float32 values), and what follows from
    them: ``block_topk = budget // ratio``, ``qk_width = (n_heads + 1) * hd``, ``sel_cap = budget + ratio``,
    ``kv_row``: bytes of one token's K (or V) row of the main attention."""
    n_heads: int
    hd: int
    ratio: int
    budget: int
    rot: int
    theta: float
    eps: float
    hidden: int
    nkv_attn: int
    hd_attn: int
    max_tokens: int
    block_topk: int
    qk_width: int
    sel_cap: int
    kv_row: int


def layer_dims(n_heads: Any, hd: Any, ratio: Any, budget: Any, rot: Any, theta: Any, eps: Any, hidden: Any,
               nkv_attn: Any, hd_attn: Any, max_tokens: Any) -> LayerDims:
    """Check the layer's dimensions (each error names the argument and the fix)."""
    ratio = _args.as_int("ratio", ratio, 1, _I32, why="tokens per QSA block (the model uses 4)")
    budget = _args.as_int("budget", budget, None, _I32, why="the token budget (the model uses 2048)")
    if budget % ratio != 0 or budget <= 0:
        raise HssError(f"QsaIndexer: budget ({budget}) must be a positive multiple of ratio ({ratio}): the "
                       f"selection keeps budget // ratio whole blocks; pass e.g. budget="
                       f"{max(ratio, budget // ratio * ratio)}")
    n_heads = _args.as_int("n_heads", n_heads, 1, _I32, why="indexer query heads (the model uses 4)")
    hd = _args.as_int("hd", hd, 32, 1024, why="the indexer head dim (the model uses 128)")
    if hd % 32:
        raise HssError(f"QsaIndexer: hd ({hd}) must be a multiple of 32 (at most 1024): the pool and qprep "
                       "kernels run one thread per dim in whole warps (the model uses 128)")
    if kq.score_smem_bytes(n_heads, hd) > _SMEM_LIMIT:
        raise HssError(f"QsaIndexer: n_heads * hd ({n_heads * hd}) must be at most {_SMEM_LIMIT // 4}: qsa_score "
                       "stages q in 48 KiB of shared memory")
    rot = _args.as_int("rot", rot, 0, hd, why="the rotary dims, at most hd")
    if rot % 2:
        raise HssError(f"QsaIndexer: rot ({rot}) must be even: rotate-half RoPE pairs dim j with j + rot/2")
    theta = f32_arg("theta", theta, positive=True)
    eps = f32_arg("eps", eps, positive=False)
    hidden = _args.as_int("hidden", hidden, 1, _I32, why="the attention input width")
    nkv_attn = _args.as_int("nkv_attn", nkv_attn, 1, _I32, why="the attention's KV heads")
    hd_attn = _args.as_int("hd_attn", hd_attn, 1, _I32, why="the attention's head dim")
    max_tokens = _args.as_int("max_tokens", max_tokens_setting(max_tokens), ratio, _I32,
                              why="the longest sequence in tokens: at least one block, int32 token ids "
                                  "(argument max_tokens= or env HSS_QSA_MAX_TOKENS)")
    return LayerDims(n_heads, hd, ratio, budget, rot, theta, eps, hidden, nkv_attn, hd_attn, max_tokens,
                     budget // ratio, (n_heads + 1) * hd, budget + ratio, nkv_attn * hd_attn * 2)
