"""A Llama-style decoder (SmolLM2) run on the GPU through hss: cuBLAS GEMMs, the ``ptx/model.cu`` kernels, and its
KV history in HBM or behind the high-speed swap.

- :class:`DeviceModel` (weights uploaded once as bf16) → :meth:`DeviceModel.session` → :class:`Session`:
  ``prefill(ids)``, ``generate(n, on_token)``, ``step`` / ``feed`` / ``logits`` (teacher forcing), ``capture``
  (decode steps replayed as CUDA graphs).
- :class:`BatchSession` (:mod:`hss.model.batch`): up to ``max_batch`` sequences of ragged lengths decoded together
  (rows join with ``add``, leave when they finish or on ``remove``; ``step`` decodes one token per row; one CUDA
  graph per batch size), KV pages from a shared pool; ``hbm`` and ``sparse`` modes (:mod:`hss.model.batch_kv`) and
  the exact ``swap`` (:mod:`hss.model.batch_swap`).
- Sampling (:mod:`hss.model.sample`): ``Session(sampling=SamplingParams(temperature=0.8, top_p=0.95, seed=7))`` or
  ``BatchSession.add(ids, sampling=...)`` (each row its own parameters and seed); None: greedy (``model_argmax``).
  :class:`Sampler` is the device sampler both use.
- KV modes (:mod:`hss.model.kv`): ``hbm`` (:class:`HbmKV`), ``swap`` / ``sparse`` (:class:`SwapKV`).
- :mod:`hss.demo.model`: ``python -m hss demo``.
"""
from hss.model.batch import BatchSession, Finished
from hss.model.forward import STAGES, Forward
from hss.model.kv import HbmKV, SwapKV, sparse_support, swap_block_size
from hss.model.sample import Sampler, SamplingParams
from hss.model.session import KV_MODES, DeviceModel, Session, StageTimer
from hss.model.weights import DeviceWeights, bf16_rounded

__all__ = ["DeviceModel", "Session", "BatchSession", "Finished", "StageTimer", "KV_MODES", "Forward", "STAGES",
           "HbmKV", "SwapKV", "sparse_support", "swap_block_size", "DeviceWeights", "bf16_rounded",
           "Sampler", "SamplingParams"]
