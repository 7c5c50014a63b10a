"""A real model for the predictor studies: a Llama-architecture decoder (SmolLM2-135M-Instruct by default) in float32
numpy.

- :func:`load_model` → :class:`Model` (``.weights``: :class:`Weights` with its :class:`Config`; ``.tokenizer``:
  :class:`Tokenizer`) from a GGUF file (``path=None``: SmolLM2-135M-Instruct), a Hugging Face checkpoint directory
  (config.json, safetensors, tokenizer.json) or ``hf:ORG/NAME``; both formats are read by hss's own bounds-checked
  readers (:mod:`~hss.checkpoint.gguf`, :mod:`~hss.checkpoint.safetensors`). :func:`save_hf` writes a checkpoint
  directory that Hugging Face ``transformers`` loads.
- :func:`forward` (whole sequence, or appended to a :class:`KVCache`; per-layer post-RoPE Q/K and V captured as
  :class:`LayerQKV`), :func:`greedy_generate`, :func:`cross_entropy`.
- :func:`~hss.checkpoint.check.self_check` (``python -m hss.checkpoint check``): a greedy continuation and the
  cross-entropy on English text from the Python standard library (:mod:`hss.checkpoint.texts`).

Imports only numpy, ml_dtypes and :mod:`hss.errors`; ``huggingface_hub`` is imported only for ``hf:`` names.
"""
from hss.checkpoint.check import self_check
from hss.checkpoint.export import save_hf
from hss.checkpoint.forward import KVCache, LayerQKV, apply_rope, cross_entropy, forward, greedy_generate
from hss.checkpoint.loader import Model, gguf_path, load_model, load_tokenizer, load_weights
from hss.checkpoint.model import SMOLLM2_135M, Config, LayerWeights, Weights, random_weights
from hss.checkpoint.texts import english_text
from hss.checkpoint.tokenizer import Tokenizer

__all__ = ["Config", "LayerWeights", "Weights", "SMOLLM2_135M", "random_weights", "Model", "gguf_path",
           "load_model", "load_weights", "load_tokenizer", "save_hf", "Tokenizer", "KVCache", "LayerQKV",
           "apply_rope", "forward", "cross_entropy", "greedy_generate", "english_text", "self_check"]
