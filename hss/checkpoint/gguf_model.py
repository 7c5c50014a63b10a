"""A Llama-architecture GGUF (:class:`~hss.checkpoint.gguf.GgufFile`) as a :class:`Config`, float32 :class:`Weights`
and a :class:`Tokenizer`.

GGUF's ``ne[0]`` is the fastest axis, so a ``[ne0=in, ne1=out]`` matrix reads as numpy ``[out, in]``: the Hugging
Face ``nn.Linear`` layout. llama.cpp's converter stores the rows of ``attn_q`` / ``attn_k`` permuted for its
interleaved RoPE (:func:`permute_rope_rows`); they are put back (:func:`unpermute_rope_rows`), so the forward uses
rotate-half RoPE as Hugging Face does.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from hss.checkpoint._assemble import TensorNames, assemble
from hss.checkpoint._files import about
from hss.checkpoint.gguf import GgufFile
from hss.checkpoint.model import Config, Weights
from hss.checkpoint.tokenizer import Tokenizer
from hss.errors import HssError

__all__ = ["read_config", "weights_from_gguf", "tokenizer_from_gguf", "permute_rope_rows", "unpermute_rope_rows",
           "GGUF_NAMES"]

GGUF_NAMES = TensorNames(
    embed="token_embd.weight", final_norm="output_norm.weight", lm_head="output.weight",
    layer={"attn_norm": "blk.{i}.attn_norm.weight", "wq": "blk.{i}.attn_q.weight", "wk": "blk.{i}.attn_k.weight",
           "wv": "blk.{i}.attn_v.weight", "wo": "blk.{i}.attn_output.weight", "ffn_norm": "blk.{i}.ffn_norm.weight",
           "w_gate": "blk.{i}.ffn_gate.weight", "w_up": "blk.{i}.ffn_up.weight", "w_down": "blk.{i}.ffn_down.weight"})
_MISSING = object()
_INTS = ("UINT8", "INT8", "UINT16", "INT16", "UINT32", "INT32", "UINT64", "INT64")
_KINDS = {"int": _INTS, "float": ("FLOAT32", "FLOAT64", *_INTS), "str": ("STRING",),
          "strings": ("ARRAY[STRING]",), "ints": tuple(f"ARRAY[{t}]" for t in _INTS)}


def permute_rope_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter order: within each head, row ``i`` of the first half and row ``i`` of the second
    half (the rotate-half pair) become rows ``2i`` and ``2i + 1`` (interleaved RoPE). ``w``: ``[n_head * hd, ...]``."""
    hd = w.shape[0] // n_head
    return w.reshape(n_head, 2, hd // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_rope_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """The inverse of :func:`permute_rope_rows`: GGUF (interleaved) row order back to Hugging Face order."""
    hd = w.shape[0] // n_head
    return w.reshape(n_head, hd // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _field(f: GgufFile, key: str, kind: str, default: Any = _MISSING) -> Any:
    """Metadata ``key`` of GGUF type ``kind`` (int, float, str, strings, ints); ``default`` when absent."""
    if key not in f.metadata:
        if default is _MISSING:
            raise HssError(f"{f.path}: no metadata key {key!r}")
        return default
    if f.value_types[key] not in _KINDS[kind]:
        raise HssError(f"{f.path}: metadata {key!r} is {f.value_types[key]}, expected {kind}")
    return f.metadata[key]


def _decimal(value: float) -> float:
    """A float32 metadata value as the shortest decimal that rounds to it (1e-5, not 9.99999974738e-06)."""
    if not abs(value) < 3.4e38:   # also NaN; np.float32 would warn and give inf
        return float(value)
    return float(str(np.float32(value)))


def read_config(f: GgufFile) -> Config:
    """The model shape from GGUF metadata (``general.architecture`` must be ``llama``)."""
    arch = _field(f, "general.architecture", "str")
    if arch != "llama":
        raise HssError(f"{f.path}: the GGUF's architecture is {arch!r}; only 'llama' (as SmolLM2's) is read")
    for key, plain in (("llama.rope.scaling.type", "none"), ("llama.expert_count", 0)):
        value = f.metadata.get(key, plain)
        if value != plain:
            raise HssError(f"{f.path}: metadata {key!r} is {value!r}: the forward implements neither RoPE scaling "
                           f"nor experts")
    dim, n_head = _field(f, "llama.embedding_length", "int"), _field(f, "llama.attention.head_count", "int")
    head_dim = _field(f, "llama.attention.key_length", "int", dim // n_head if n_head else 0)
    if _field(f, "llama.attention.value_length", "int", head_dim) != head_dim:
        raise HssError(f"{f.path}: value heads of {f.metadata['llama.attention.value_length']} and key heads of "
                       f"{head_dim}: the forward needs them equal")
    rope_dims = _field(f, "llama.rope.dimension_count", "int", head_dim)
    if rope_dims != head_dim:
        raise HssError(f"{f.path}: the GGUF rotates {rope_dims} of {head_dim} head dims; only full-head RoPE is read")
    vocab = _field(f, "llama.vocab_size", "int", None)
    if vocab is None:
        vocab = len(_field(f, "tokenizer.ggml.tokens", "strings"))
    with about(f.path):
        return Config(n_layer=_field(f, "llama.block_count", "int"), dim=dim, n_head=n_head,
                      n_kv_head=_field(f, "llama.attention.head_count_kv", "int", n_head), head_dim=head_dim,
                      ffn_dim=_field(f, "llama.feed_forward_length", "int"), vocab_size=vocab,
                      rope_theta=_decimal(_field(f, "llama.rope.freq_base", "float", 10000.0)),
                      norm_eps=_decimal(_field(f, "llama.attention.layer_norm_rms_epsilon", "float", 1e-5)),
                      context_length=_field(f, "llama.context_length", "int", 2048))


def weights_from_gguf(f: GgufFile, config: Config | None = None) -> Weights:
    """Float32 :class:`Weights` of ``f`` (``config``: :func:`read_config` of it when None), Q/K rows un-permuted."""
    c = read_config(f) if config is None else config

    def fix(field: str, a: np.ndarray) -> np.ndarray:
        if field in ("wq", "wk"):
            return unpermute_rope_rows(a, c.n_head if field == "wq" else c.n_kv_head)
        return a

    with about(f.path):
        return assemble(c, {name: t.shape for name, t in f.tensors.items()}, f.tensor, GGUF_NAMES,
                        head=GGUF_NAMES.lm_head in f.tensors, fix=fix)


def tokenizer_from_gguf(f: GgufFile) -> Tokenizer:
    """The byte-level BPE :class:`Tokenizer` of ``f`` (``tokenizer.ggml.model`` ``gpt2``, pre-tokenizer SmolLM2's)."""
    model = _field(f, "tokenizer.ggml.model", "str")
    if model != "gpt2":
        raise HssError(f"{f.path}: the GGUF's tokenizer is {model!r}; only byte-level BPE ('gpt2') is read")
    pre = _field(f, "tokenizer.ggml.pre", "str", "smollm")
    if pre != "smollm":
        raise HssError(f"{f.path}: the GGUF's pre-tokenizer is {pre!r}; the Tokenizer implements SmolLM2's ('smollm')")
    with about(f.path):
        return Tokenizer(tokens=_field(f, "tokenizer.ggml.tokens", "strings"),
                         merges=_field(f, "tokenizer.ggml.merges", "strings"),
                         token_types=_field(f, "tokenizer.ggml.token_type", "ints", None),
                         bos_id=_field(f, "tokenizer.ggml.bos_token_id", "int", None),
                         eos_id=_field(f, "tokenizer.ggml.eos_token_id", "int", None),
                         chat_template=_field(f, "tokenizer.chat_template", "str", None))
