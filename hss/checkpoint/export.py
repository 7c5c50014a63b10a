"""Write a model as a Hugging Face Llama checkpoint directory (:func:`save_hf`) that ``transformers`` and
:func:`hss.checkpoint.load_model` both load: ``config.json``, ``model.safetensors`` (Hugging Face names and layout),
``tokenizer.json`` and ``tokenizer_config.json`` (with the chat template)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from hss.checkpoint._files import write_atomic
from hss.checkpoint.hf import ARCHITECTURE, HF_NAMES, INDEX
from hss.checkpoint.model import Config, Weights
from hss.checkpoint.safetensors import write_safetensors
from hss.checkpoint.tokenizer import Tokenizer
from hss.checkpoint.tokenizer_json import tokenizer_to_hf
from hss.errors import HssError

__all__ = ["save_hf", "hf_config", "hf_tensors", "SAVE_DTYPES"]

# dtype argument → (numpy dtype, config.json torch_dtype)
SAVE_DTYPES: dict[str, tuple[Any, str]] = {"bf16": (ml_dtypes.bfloat16, "bfloat16"), "f16": (np.float16, "float16"),
                                           "f32": (np.float32, "float32")}


def hf_config(config: Config, tied: bool, dtype: str = "bf16", tokenizer: Tokenizer | None = None) -> dict[str, Any]:
    """The ``config.json`` of a Llama checkpoint of ``config`` (``tied``: no separate LM head)."""
    c = config
    return {"architectures": [ARCHITECTURE], "model_type": "llama", "hidden_size": c.dim,
            "intermediate_size": c.ffn_dim, "num_hidden_layers": c.n_layer, "num_attention_heads": c.n_head,
            "num_key_value_heads": c.n_kv_head, "head_dim": c.head_dim, "hidden_act": "silu",
            "max_position_embeddings": c.context_length, "rms_norm_eps": c.norm_eps, "rope_theta": c.rope_theta,
            "rope_scaling": None, "attention_bias": False, "attention_dropout": 0.0, "mlp_bias": False,
            "pretraining_tp": 1, "tie_word_embeddings": tied, "vocab_size": c.vocab_size,
            "bos_token_id": None if tokenizer is None else tokenizer.bos_id,
            "eos_token_id": None if tokenizer is None else tokenizer.eos_id,
            "torch_dtype": SAVE_DTYPES[dtype][1], "use_cache": True}


def hf_tensors(weights: Weights, dtype: str = "bf16") -> dict[str, np.ndarray]:
    """``weights`` under their Hugging Face names, rounded once to ``dtype`` (bf16, f16 or f32)."""
    if dtype not in SAVE_DTYPES:
        raise HssError(f"save_hf: dtype must be one of {', '.join(SAVE_DTYPES)}, got {dtype!r}")
    cast = SAVE_DTYPES[dtype][0]

    def r(a: np.ndarray) -> np.ndarray:
        return np.asarray(a, np.float32).astype(cast)

    out = {HF_NAMES.embed: r(weights.embed), HF_NAMES.final_norm: r(weights.final_norm)}
    if weights.lm_head is not None:
        out[HF_NAMES.lm_head] = r(weights.lm_head)
    for i, layer in enumerate(weights.layers):
        for field, pattern in HF_NAMES.layer.items():
            out[pattern.format(i=i)] = r(getattr(layer, field))
    return out


def save_hf(model: Any, tokenizer: Tokenizer | None, directory: str | Path, dtype: str = "bf16") -> Path:
    """Write ``model`` (a :class:`~hss.checkpoint.Model`, or :class:`Weights`) and ``tokenizer`` (None: the
    Model's) into ``directory`` (created if needed) as a Llama checkpoint with ``dtype`` (``"bf16"``, ``"f16"`` or
    ``"f32"``) weights; returns the directory. Each file is written atomically; a directory holding a sharded
    checkpoint is refused (its index would shadow the new file)."""
    weights = getattr(model, "weights", model)
    if not isinstance(weights, Weights):
        raise TypeError(f"save_hf: model must be a hss.checkpoint Model or Weights, got {type(model).__name__}")
    tokenizer = tokenizer if tokenizer is not None else getattr(model, "tokenizer", None)
    if not isinstance(tokenizer, Tokenizer):
        raise TypeError(f"save_hf: tokenizer must be a hss.checkpoint Tokenizer, got {type(tokenizer).__name__}")
    if len(tokenizer) > weights.config.vocab_size:
        raise HssError(f"save_hf: the tokenizer has {len(tokenizer)} tokens, the model's vocabulary "
                       f"{weights.config.vocab_size}")
    tensors = hf_tensors(weights, dtype)
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    stale = [p.name for p in out.iterdir() if p.name == INDEX or (p.suffix == ".safetensors"
                                                                   and p.name != "model.safetensors")]
    if stale:
        raise HssError(f"{out}: already holds {', '.join(sorted(stale))}, which would shadow the new weights: save "
                       f"into an empty directory")
    tok_json, tok_config = tokenizer_to_hf(tokenizer, weights.config.context_length)
    config = hf_config(weights.config, weights.lm_head is None, dtype, tokenizer)
    write_safetensors(out / "model.safetensors", tensors, {"format": "pt"})
    write_atomic(out / "config.json", json.dumps(config, indent=2) + "\n")
    write_atomic(out / "tokenizer.json", json.dumps(tok_json, ensure_ascii=False, indent=2) + "\n")
    write_atomic(out / "tokenizer_config.json", json.dumps(tok_config, ensure_ascii=False, indent=2) + "\n")
    return out
