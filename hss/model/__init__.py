"""A Llama-style decoder (SmolLM2) run on the GPU through hss: cuBLAS GEMMs, the ``ptx/model.cu`` kernels, and its
KV history in HBM or behind the high-speed swap.

- :class:`DeviceModel` (weights uploaded once as bf16) → :meth:`DeviceModel.session` → :class:`Session`:
  ``prefill(ids)``, ``generate(n, on_token)``, ``step`` / ``feed`` / ``logits`` (teacher forcing), ``capture``
  (decode steps replayed as CUDA graphs).
- KV modes (:mod:`hss.model.kv`): ``hbm`` (:class:`HbmKV`), ``swap`` / ``sparse`` (:class:`SwapKV`).
- :mod:`hss.demo.model`: ``python -m hss demo``.
"""
from hss.model.forward import STAGES, Forward
from hss.model.kv import HbmKV, SwapKV, sparse_support, swap_block_size
from hss.model.session import KV_MODES, DeviceModel, Session, StageTimer
from hss.model.weights import DeviceWeights, bf16_rounded

__all__ = ["DeviceModel", "Session", "StageTimer", "KV_MODES", "Forward", "STAGES", "HbmKV", "SwapKV",
           "sparse_support", "swap_block_size", "DeviceWeights", "bf16_rounded"]
