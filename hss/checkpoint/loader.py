"""Load a Llama-architecture model (SmolLM2-135M-Instruct by default) into float32 numpy :class:`Weights` and a
:class:`Tokenizer`, from a GGUF file, a Hugging Face checkpoint directory, or ``hf:ORG/NAME`` from the Hub.

Both formats are read by hss itself (:mod:`hss.checkpoint.gguf`, :mod:`hss.checkpoint.safetensors`), bounds-checked
and memory-mapped, with no optional package; a damaged or unsuitable file is an :class:`~hss.errors.HssError` that
names it. The default model is found by :func:`hss.checkpoint.fetch.find_default_gguf`.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from hss.checkpoint._files import describe_start
from hss.checkpoint.gguf import MAGIC, GgufFile
from hss.checkpoint.gguf_model import (
    permute_rope_rows,
    read_config,
    tokenizer_from_gguf,
    unpermute_rope_rows,
    weights_from_gguf,
)
from hss.checkpoint.hf import download, load_hf, load_hf_tokenizer
from hss.checkpoint.model import SMOLLM2_135M, Config, Weights
from hss.checkpoint.tokenizer import Tokenizer
from hss.errors import HssError

__all__ = ["Model", "gguf_path", "model_path", "permute_rope_rows", "unpermute_rope_rows", "read_config",
           "load_weights", "load_tokenizer", "load_model", "INSTALL_HINT"]

INSTALL_HINT = "python -m hss fetch"


@dataclass(frozen=True)
class Model:
    """A loaded model: its float32 weights (with the config), its tokenizer, and the file or directory it came
    from."""

    weights: Weights
    tokenizer: Tokenizer
    path: Path

    @property
    def config(self) -> Config:
        return self.weights.config


def gguf_path(path: str | Path | None = None) -> Path:
    """The GGUF file: ``path`` when given, else SmolLM2-135M-Instruct
    (:func:`hss.checkpoint.fetch.find_default_gguf`)."""
    if path is not None:
        found = Path(path)
        if not found.is_file():
            raise HssError(f"{found}: no such GGUF file (pass an existing path, or None for SmolLM2-135M from "
                           f"{INSTALL_HINT})")
        return found
    from hss.checkpoint.fetch import find_default_gguf  # lazily: the lookup of caches and packages is its own

    return find_default_gguf()


def model_path(path: str | Path | None = None) -> Path:
    """What :func:`load_model` reads: a GGUF file or a checkpoint directory (``hf:ORG/NAME``: downloaded first)."""
    if path is None:
        return gguf_path(None)
    if isinstance(path, str) and path.startswith("hf:"):
        return download(path)
    found = Path(path)
    if found.is_dir():
        return found
    if not found.exists():
        raise HssError(f"{found}: no such file or directory (pass a .gguf file, a Hugging Face checkpoint directory, "
                       f"hf:ORG/NAME, or None for SmolLM2-135M from {INSTALL_HINT})")
    return found


def _open_gguf(path: Path) -> GgufFile:
    """The GGUF at ``path``; a file of another format is named as such."""
    if not path.is_file():
        raise HssError(f"{path}: not a regular file, so not a GGUF file")
    try:
        with open(path, "rb") as f:
            head = f.read(16)
    except OSError as e:
        raise HssError(f"{path}: cannot read it: {e.strerror or e}") from None
    if head[:4] != MAGIC and (path.suffix in (".safetensors", ".json") or path.name.startswith("tokenizer")):
        raise HssError(f"{path}: a file of a Hugging Face checkpoint ({describe_start(head)}): pass its directory "
                       f"({path.parent})")
    return GgufFile(path)


def load_tokenizer(path: str | Path | None = None) -> Tokenizer:
    """The :class:`Tokenizer` of the model at ``path`` (as :func:`load_model`); reads no tensors."""
    found = model_path(path)
    if found.is_dir():
        return load_hf_tokenizer(found)
    with _open_gguf(found) as f:
        return tokenizer_from_gguf(f)


def _check_vocabulary(tokenizer: Tokenizer, config: Config, where: Path) -> None:
    if len(tokenizer) != config.vocab_size:
        raise HssError(f"{where}: the tokenizer has {len(tokenizer)} tokens but the model's vocabulary has "
                       f"{config.vocab_size} (the embedding's rows): they must match")


def load_model(path: str | Path | None = None) -> Model:
    """Weights and tokenizer of the model at ``path``: a GGUF file, a Hugging Face Llama checkpoint directory
    (config.json, safetensors, tokenizer.json), or ``hf:ORG/NAME[@REVISION]`` (``huggingface_hub``). ``None``
    loads SmolLM2-135M-Instruct's GGUF and checks its metadata against :data:`~hss.checkpoint.model.SMOLLM2_135M`."""
    found = model_path(path)
    if found.is_dir():
        weights, tokenizer = load_hf(found)
        return Model(weights=weights, tokenizer=tokenizer, path=found)
    with _open_gguf(found) as f:
        config = read_config(f)
        if path is None and config != SMOLLM2_135M:
            raise HssError(f"{found}: metadata gives {config}, expected {SMOLLM2_135M}")
        tokenizer = tokenizer_from_gguf(f)
        _check_vocabulary(tokenizer, config, found)
        weights = weights_from_gguf(f, config)
    return Model(weights=weights, tokenizer=tokenizer, path=found)


def load_weights(path: str | Path | None = None) -> Weights:
    """Float32 :class:`Weights` of the model at ``path`` (as :func:`load_model`)."""
    return load_model(path).weights

