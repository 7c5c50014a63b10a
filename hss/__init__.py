"""hss: the high-speed-swap predictor and the QSA sparse-attention indexer over the CUDA driver API.

Raw device pointers in, raw device pointers out, explicit streams, no hidden syncs. Set ``HSS_DRIVER=emulator`` to
run everything on the CPU emulator (chosen automatically where no CUDA driver is installed). The command line:
``python -m hss {info,demo,demo-qsa,fetch,bench}`` (``python -m hss --help``).

The main objects (imported on first use, so ``import hss`` stays cheap):

- ``CudaCtx``: a CUDA context on one device, with its ``.stream`` (:mod:`hss.cuda_min`, the driver surface:
  ``DeviceBuffer``, ``PinnedBuffer``, ``CudaEvent``, copies, launches).
- ``DeviceBuffer``: device memory that frees itself once; ``.ptr`` is a plain int address.
- ``Predictor``, ``PredictorDims``: the HSS predictor: low-rank page keys and page scores (:mod:`hss.predictor`).
- ``TiledAttention``, ``TiledAttentionDims``: exact decode attention over paged KV, tile by tile
  (:mod:`hss.attention`).
- ``HighSpeedSwap``, ``HighSpeedSwapConfig``: the KV history in host memory or files, streamed back page by page
  for each layer's attention (:mod:`hss.swap`).
- ``QsaIndexer``: the QSA sparse-attention indexer: prefill ingest and per-step token selection (:mod:`hss.qsa`).
- ``CudaBackend``: the ``GpuBackend`` the indexer runs on (cuBLAS GEMMs plus hss kernels, :mod:`hss.cuda.gpu`).
- ``load_model``: a Llama-architecture model (SmolLM2-135M-Instruct by default) as float32 numpy weights and a
  tokenizer (:mod:`hss.checkpoint`); ``fetch_default_gguf``: that default model into hss's cache.
- ``DeviceModel``, ``Session``: such a model on the device and one sequence decoded on it, its KV history in HBM
  or behind the high-speed swap (:mod:`hss.model`).
- ``HssError``, ``CudaError``: bad input (naming the parameter and the fix); a failed driver call (:mod:`hss.errors`).
- ``driver_status``, ``inject_fault``: which driver hss runs on and why; fault injection for tests.
"""
from __future__ import annotations

import importlib
from typing import Any

from hss._version import __version__ as __version__
from hss.cuda._driver import driver_status, inject_fault
from hss.errors import CudaError, HssError

_LAZY = {
    "CudaCtx": "hss.cuda_min", "DeviceBuffer": "hss.cuda_min",
    "Predictor": "hss.predictor", "PredictorDims": "hss.predictor",
    "TiledAttention": "hss.attention", "TiledAttentionDims": "hss.attention",
    "HighSpeedSwap": "hss.swap", "HighSpeedSwapConfig": "hss.swap",
    "QsaIndexer": "hss.qsa",
    "CudaBackend": "hss.cuda.gpu",
    "load_model": "hss.checkpoint", "fetch_default_gguf": "hss.checkpoint.fetch",
    "DeviceModel": "hss.model", "Session": "hss.model",
}

__all__ = ["CudaCtx", "DeviceBuffer", "Predictor", "PredictorDims", "TiledAttention", "TiledAttentionDims",
           "HighSpeedSwap", "HighSpeedSwapConfig", "QsaIndexer", "CudaBackend", "load_model", "fetch_default_gguf",
           "DeviceModel", "Session", "CudaError", "HssError", "driver_status", "inject_fault"]


def __getattr__(name: str) -> Any:
    """The main objects, imported when first asked for (PEP 562)."""
    if name not in _LAZY:
        raise AttributeError(f"module 'hss' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
