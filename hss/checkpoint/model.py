"""A Llama-architecture decoder's shape (:class:`Config`) and its float32 weights (:class:`Weights`).

Matrices keep the Hugging Face ``nn.Linear`` layout ``[out_features, in_features]`` (a layer computes
``x @ w.T``), and the rows of ``wq`` / ``wk`` are in Hugging Face order: each head's ``head_dim`` rows split
in two halves that rotate-half RoPE pairs (row ``i`` with row ``i + head_dim // 2``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from hss.errors import HssError

__all__ = ["Config", "LayerWeights", "Weights", "SMOLLM2_135M", "random_weights"]


@dataclass(frozen=True)
class Config:
    """The shape of a Llama-style decoder: ``n_head`` query heads share ``n_kv_head`` key/value heads (GQA)."""

    n_layer: int
    dim: int
    n_head: int
    n_kv_head: int
    head_dim: int
    ffn_dim: int
    vocab_size: int
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    context_length: int = 2048

    def __post_init__(self) -> None:
        for name in ("n_layer", "dim", "n_head", "n_kv_head", "head_dim", "ffn_dim", "vocab_size", "context_length"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
                raise HssError(f"Config.{name} must be a positive int, got {value!r}")
            object.__setattr__(self, name, int(value))
        if self.n_head % self.n_kv_head:
            raise HssError(f"Config: n_head ({self.n_head}) must be a multiple of n_kv_head ({self.n_kv_head})")
        if self.head_dim % 2:
            raise HssError(f"Config: head_dim ({self.head_dim}) must be even for RoPE")
        for name, positive in (("rope_theta", True), ("norm_eps", False)):
            value = getattr(self, name)
            number = not isinstance(value, bool) and isinstance(value, (int, float, np.integer, np.floating))
            if not number or not math.isfinite(value) or value < 0 or (positive and value == 0):
                raise HssError(f"Config.{name} must be a finite number {'> 0' if positive else '>= 0'}, got "
                               f"{value!r}")
            object.__setattr__(self, name, float(value))

    @property
    def q_dim(self) -> int:
        return self.n_head * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_head * self.head_dim


# What the SmolLM2-135M GGUF must say (the loader checks its metadata against this).
SMOLLM2_135M = Config(n_layer=30, dim=576, n_head=9, n_kv_head=3, head_dim=64, ffn_dim=1536, vocab_size=49152,
                      rope_theta=100000.0, norm_eps=1e-5, context_length=8192)


@dataclass(frozen=True)
class LayerWeights:
    """One decoder block, float32: RMSNorm gains ``[dim]``; matrices ``[out, in]``."""

    attn_norm: np.ndarray   # [dim]
    wq: np.ndarray          # [n_head * head_dim, dim], rows in rotate-half (HF) order
    wk: np.ndarray          # [n_kv_head * head_dim, dim], rows in rotate-half (HF) order
    wv: np.ndarray          # [n_kv_head * head_dim, dim]
    wo: np.ndarray          # [dim, n_head * head_dim]
    ffn_norm: np.ndarray    # [dim]
    w_gate: np.ndarray      # [ffn_dim, dim]
    w_up: np.ndarray        # [ffn_dim, dim]
    w_down: np.ndarray      # [dim, ffn_dim]

    @staticmethod
    def shapes(config: Config) -> dict[str, tuple[int, ...]]:
        """The shape of each field for ``config``."""
        c = config
        return {"attn_norm": (c.dim,), "wq": (c.q_dim, c.dim), "wk": (c.kv_dim, c.dim), "wv": (c.kv_dim, c.dim),
                "wo": (c.dim, c.q_dim), "ffn_norm": (c.dim,), "w_gate": (c.ffn_dim, c.dim),
                "w_up": (c.ffn_dim, c.dim), "w_down": (c.dim, c.ffn_dim)}

    def check(self, config: Config, index: int) -> None:
        """Raise :class:`HssError` naming the first array whose shape disagrees with ``config``."""
        for name, shape in self.shapes(config).items():
            got = getattr(self, name).shape
            if got != shape:
                raise HssError(f"layer {index} {name}: shape {got}, the config needs {shape}")


@dataclass(frozen=True)
class Weights:
    """A whole model: token embedding ``[vocab, dim]``, the blocks, the final RMSNorm and the output head.

    ``lm_head`` is ``None`` for tied embeddings (the output projection is ``embed``); :attr:`output` gives
    the matrix either way.
    """

    config: Config
    embed: np.ndarray                   # [vocab_size, dim]
    layers: tuple[LayerWeights, ...]
    final_norm: np.ndarray              # [dim]
    lm_head: np.ndarray | None = None   # [vocab_size, dim]; None: tied to embed

    def __post_init__(self) -> None:
        c = self.config
        if len(self.layers) != c.n_layer:
            raise HssError(f"Weights: {len(self.layers)} layers, the config says {c.n_layer}")
        if self.embed.shape != (c.vocab_size, c.dim):
            raise HssError(f"Weights.embed: shape {self.embed.shape}, the config needs {(c.vocab_size, c.dim)}")
        if self.final_norm.shape != (c.dim,):
            raise HssError(f"Weights.final_norm: shape {self.final_norm.shape}, the config needs {(c.dim,)}")
        if self.lm_head is not None and self.lm_head.shape != self.embed.shape:
            raise HssError(f"Weights.lm_head: shape {self.lm_head.shape}, the config needs {self.embed.shape}")
        for i, layer in enumerate(self.layers):
            layer.check(c, i)

    @property
    def output(self) -> np.ndarray:
        """The output projection ``[vocab_size, dim]`` (``embed`` when tied)."""
        return self.embed if self.lm_head is None else self.lm_head


def random_weights(config: Config, seed: int = 0, scale: float = 0.5) -> Weights:
    """Random float32 weights of ``config``'s shapes (for tests and demos without a model file).

    Matrices are normal with standard deviation ``scale / sqrt(in_features)``; norm gains are near 1.
    """
    rng = np.random.default_rng(seed)
    c = config

    def matrix(out: int, inp: int) -> np.ndarray:
        return (rng.standard_normal((out, inp)) * (scale / np.sqrt(inp))).astype(np.float32)

    def gain() -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(c.dim)).astype(np.float32)

    layers = tuple(LayerWeights(attn_norm=gain(), wq=matrix(c.q_dim, c.dim), wk=matrix(c.kv_dim, c.dim),
                                wv=matrix(c.kv_dim, c.dim), wo=matrix(c.dim, c.q_dim), ffn_norm=gain(),
                                w_gate=matrix(c.ffn_dim, c.dim), w_up=matrix(c.ffn_dim, c.dim),
                                w_down=matrix(c.dim, c.ffn_dim))
                   for _ in range(c.n_layer))
    embed = rng.standard_normal((c.vocab_size, c.dim)).astype(np.float32)
    return Weights(config=c, embed=embed, layers=layers, final_norm=gain())
