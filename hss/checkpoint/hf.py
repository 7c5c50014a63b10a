"""A Hugging Face Llama checkpoint directory as a :class:`Config`, float32 :class:`Weights` and a :class:`Tokenizer`.

The directory holds ``config.json`` (``LlamaForCausalLM`` / ``model_type`` ``llama``), the weights as
``model.safetensors`` or shards named by ``model.safetensors.index.json`` (F32, F16 or BF16; Hugging Face layout,
so no RoPE row permutation), and ``tokenizer.json`` with an optional ``tokenizer_config.json`` /
``chat_template.jinja`` (:mod:`hss.checkpoint.tokenizer_json`). A config asking for what the forward does not
implement (RoPE scaling, biases, another activation) is refused, naming the key. :func:`download` fetches
``hf:ORG/NAME[@REVISION]`` with ``huggingface_hub`` when that package is installed.
"""
from __future__ import annotations

import contextlib
import math
import re
from pathlib import Path
from typing import Any

from hss.checkpoint._assemble import TensorNames, assemble
from hss.checkpoint._files import about, read_json
from hss.checkpoint.model import Config, Weights
from hss.checkpoint.safetensors import FLOATS, SafetensorsFile, TensorEntry
from hss.checkpoint.tokenizer import Tokenizer
from hss.checkpoint.tokenizer_json import tokenizer_from_hf
from hss.errors import HssError

__all__ = ["HF_NAMES", "ARCHITECTURE", "read_hf_config", "load_hf", "load_hf_tokenizer", "download", "HUB_FILES"]

ARCHITECTURE = "LlamaForCausalLM"
HF_NAMES = TensorNames(
    embed="model.embed_tokens.weight", final_norm="model.norm.weight", lm_head="lm_head.weight",
    layer={"attn_norm": "model.layers.{i}.input_layernorm.weight", "wq": "model.layers.{i}.self_attn.q_proj.weight",
           "wk": "model.layers.{i}.self_attn.k_proj.weight", "wv": "model.layers.{i}.self_attn.v_proj.weight",
           "wo": "model.layers.{i}.self_attn.o_proj.weight",
           "ffn_norm": "model.layers.{i}.post_attention_layernorm.weight",
           "w_gate": "model.layers.{i}.mlp.gate_proj.weight", "w_up": "model.layers.{i}.mlp.up_proj.weight",
           "w_down": "model.layers.{i}.mlp.down_proj.weight"},
    ignored=lambda name: name.endswith(".rotary_emb.inv_freq"))   # a buffer some old checkpoints saved
INDEX = "model.safetensors.index.json"
HUB_FILES = ["config.json", "*.safetensors", INDEX, "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"]
_MISSING = object()


def _number(config: dict[str, Any], key: str, kind: type, default: Any = _MISSING) -> Any:
    value = config.get(key, default)
    if value is _MISSING or value is None and default is _MISSING:
        raise HssError(f"no {key!r}: a Llama config.json needs it")
    if value is None:
        return default
    ok = type(value) is int if kind is int else type(value) in (int, float) and math.isfinite(value)
    if not ok or value <= 0:
        raise HssError(f"{key} is {value!r:.60}; it must be a positive {kind.__name__}")
    return value


def _refuse_features(config: dict[str, Any]) -> None:
    """Raise for every config.json setting that would change the Llama forward hss implements."""
    rope = config.get("rope_scaling")
    if rope is not None and not (isinstance(rope, dict) and rope.get("rope_type", rope.get("type")) == "default"):
        raise HssError(f"rope_scaling is {rope!r:.120}: the forward implements plain RoPE only (no linear, dynamic, "
                       f"yarn or llama3 scaling)")
    params = config.get("rope_parameters")
    if params is not None and not (isinstance(params, dict) and params.get("rope_type", "default") == "default"):
        raise HssError(f"rope_parameters is {params!r:.120}: the forward implements plain RoPE only")
    refused = {"attention_bias": True, "mlp_bias": True, "rope_interleaved": True}
    for key, bad in refused.items():
        if config.get(key) == bad:
            raise HssError(f"{key} is {bad}: the forward implements none")
    act = config.get("hidden_act", "silu")
    if act != "silu":
        raise HssError(f"hidden_act is {act!r}: the forward implements SwiGLU with silu only")
    if config.get("partial_rotary_factor", 1) != 1:
        raise HssError(f"partial_rotary_factor is {config['partial_rotary_factor']!r}: only full-head RoPE is read")
    if config.get("quantization_config") is not None:
        raise HssError("the checkpoint is quantised (quantization_config): only F32, F16 and BF16 weights are read")


def read_hf_config(config: Any) -> tuple[Config, bool]:
    """``(Config, tied)`` from a parsed Llama ``config.json``; ``tied``: the LM head is the embedding."""
    if not isinstance(config, dict):
        raise HssError(f"config.json holds a {type(config).__name__}, not an object")
    arch, model_type = config.get("architectures"), config.get("model_type")
    if arch is None and model_type is None:
        raise HssError("config.json names no architecture (neither 'architectures' nor 'model_type')")
    if model_type not in (None, "llama") or arch not in (None, [ARCHITECTURE]):
        raise HssError(f"the checkpoint's architecture is {arch!r} (model_type {model_type!r}); only {ARCHITECTURE} "
                       f"('llama') is read")
    _refuse_features(config)
    params = config.get("rope_parameters") if isinstance(config.get("rope_parameters"), dict) else {}
    dim, n_head = _number(config, "hidden_size", int), _number(config, "num_attention_heads", int)
    head_dim = config.get("head_dim")
    if head_dim is None:
        if dim % n_head:
            raise HssError(f"hidden_size {dim} is not a multiple of num_attention_heads {n_head} and there is no "
                           f"head_dim")
        head_dim = dim // n_head
    theta = params.get("rope_theta") if params.get("rope_theta") is not None else config.get("rope_theta")
    config = dict(config, head_dim=head_dim, rope_theta=theta)
    tied = config.get("tie_word_embeddings", False)
    if type(tied) is not bool:
        raise HssError(f"tie_word_embeddings is {tied!r:.40}; it must be true or false")
    return Config(n_layer=_number(config, "num_hidden_layers", int), dim=dim, n_head=n_head,
                  n_kv_head=_number(config, "num_key_value_heads", int, n_head),
                  head_dim=_number(config, "head_dim", int), ffn_dim=_number(config, "intermediate_size", int),
                  vocab_size=_number(config, "vocab_size", int),
                  rope_theta=float(_number(config, "rope_theta", float, 10000.0)),
                  norm_eps=float(_number(config, "rms_norm_eps", float, 1e-6)),
                  context_length=_number(config, "max_position_embeddings", int, 2048)), tied


def _shard_names(directory: Path) -> dict[str, Path] | list[Path]:
    """Tensor name → shard (from the index), or the safetensors files of a checkpoint without one."""
    index = directory / INDEX
    if index.exists():
        data = read_json(index, "safetensors index")
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise HssError(f"{index}: no 'weight_map' object of tensor name → shard file name")
        shards: dict[str, Path] = {}
        for name, shard in weight_map.items():
            if shard != Path(shard).name or shard in ("", ".", ".."):
                raise HssError(f"{index}: tensor {name!r} names shard {shard!r}, which is not a file name in the "
                               f"checkpoint's directory")
            path = directory / shard
            if not path.is_file():
                raise HssError(f"{index}: names shard {shard!r} (for {name!r}), which is missing from {directory}")
            shards[name] = path
        return shards
    single = directory / "model.safetensors"
    if single.is_file():
        return [single]
    found = sorted(p for p in directory.glob("*.safetensors") if p.is_file())
    if not found:
        hint = " (pytorch_model.bin is not read: save the checkpoint as safetensors)" if any(
            directory.glob("*.bin")) else ""
        raise HssError(f"{directory}: no model.safetensors, {INDEX} or other *.safetensors file{hint}")
    return found


def _tensor_entries(directory: Path, files: contextlib.ExitStack) -> dict[str, tuple[SafetensorsFile, TensorEntry]]:
    shards = _shard_names(directory)
    opened: dict[Path, SafetensorsFile] = {}

    def open_(path: Path) -> SafetensorsFile:
        if path not in opened:
            opened[path] = files.enter_context(SafetensorsFile(path))
        return opened[path]

    entries: dict[str, tuple[SafetensorsFile, TensorEntry]] = {}
    if isinstance(shards, dict):
        for name, path in shards.items():
            f = open_(path)
            if name not in f.tensors:
                raise HssError(f"{directory / INDEX}: puts tensor {name!r} in {path.name}, which does not hold it")
            entries[name] = (f, f.tensors[name])
    else:
        for path in shards:
            f = open_(path)
            for name, entry in f.tensors.items():
                if name in entries:
                    raise HssError(f"{path}: tensor {name!r} is also in {entries[name][0].path.name}")
                entries[name] = (f, entry)
    for name, (f, entry) in entries.items():
        if entry.dtype not in FLOATS and not HF_NAMES.ignored(name):
            raise HssError(f"{f.path}: tensor {name!r} is {entry.dtype}; weights must be one of {', '.join(FLOATS)}")
    return entries


def load_hf_config(directory: Path) -> tuple[Config, bool, dict[str, Any]]:
    """``(Config, tied, config.json)`` of the checkpoint in ``directory``."""
    path = directory / "config.json"
    if not path.is_file():
        raise HssError(f"{directory}: no config.json, so not a Hugging Face checkpoint (pass a directory holding "
                       f"config.json, *.safetensors and tokenizer.json, or a .gguf file)")
    data = read_json(path, "config.json")
    with about(path):
        config, tied = read_hf_config(data)
    return config, tied, data


def load_hf_tokenizer(directory: Path, model_config: dict[str, Any] | None = None) -> Tokenizer:
    """The :class:`Tokenizer` of the checkpoint in ``directory`` (``model_config``: its config.json, for the BOS
    and EOS ids where the tokenizer config names no tokens; read from the directory when None)."""
    path = directory / "tokenizer.json"
    if not path.is_file():
        raise HssError(f"{directory}: no tokenizer.json (the fast tokenizer's file; tokenizer.model or vocab.json "
                       f"alone are not read)")
    data = read_json(path, "tokenizer.json")
    extra = directory / "tokenizer_config.json"
    config = read_json(extra, "tokenizer_config.json") if extra.is_file() else None
    if model_config is None and (directory / "config.json").is_file():
        model_config = read_json(directory / "config.json", "config.json")
    jinja = directory / "chat_template.jinja"
    template = None
    if jinja.is_file():
        try:
            template = jinja.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise HssError(f"{jinja}: cannot read the chat template: {e}") from None
    with about(path):
        return tokenizer_from_hf(data, config, model_config, template)


def load_hf(directory: str | Path) -> tuple[Weights, Tokenizer]:
    """Float32 weights and the tokenizer of the Llama checkpoint in ``directory``."""
    directory = Path(directory)
    config, tied, data = load_hf_config(directory)
    with contextlib.ExitStack() as files:
        entries = _tensor_entries(directory, files)
        with about(directory):
            weights = assemble(config, {n: e.shape for n, (_, e) in entries.items()},
                               lambda name: entries[name][0].tensor(name), HF_NAMES, head=not tied)
    tokenizer = load_hf_tokenizer(directory, data)
    if len(tokenizer) > config.vocab_size:
        raise HssError(f"{directory}: the tokenizer has {len(tokenizer)} tokens, more than the model's vocabulary "
                       f"({config.vocab_size} embedding rows)")
    return weights, tokenizer


_REPO = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")


def download(spec: str) -> Path:
    """The local directory of ``hf:ORG/NAME`` (``@REVISION`` optional) via ``huggingface_hub.snapshot_download``
    (only the files :func:`load_hf` reads)."""
    repo, _, revision = spec.removeprefix("hf:").partition("@")
    if not _REPO.fullmatch(repo) or ".." in repo:
        raise HssError(f"{spec!r}: a Hub model is named hf:ORG/NAME or hf:ORG/NAME@REVISION")
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise HssError(f"{spec}: loading from the Hugging Face Hub needs the huggingface_hub package (pip install "
                       f"huggingface_hub), or pass the checkpoint's local directory") from None
    try:
        local = snapshot_download(repo_id=repo, revision=revision or None, allow_patterns=HUB_FILES)
    except Exception as e:   # network, authentication, missing repository: whatever the hub raises
        raise HssError(f"{spec}: the download failed: {type(e).__name__}: {e}") from None
    return Path(local)
