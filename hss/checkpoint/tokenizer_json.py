"""A :class:`~hss.checkpoint.tokenizer.Tokenizer` from and to Hugging Face's ``tokenizer.json`` (+
``tokenizer_config.json``): byte-level BPE with SmolLM2's pre-tokenizer, the only kind the Tokenizer implements.

What is read: ``model`` (``BPE``: ``vocab`` token → id, ``merges`` as ``"a b"`` strings or ``[a, b]`` pairs),
``added_tokens`` (special ones become CONTROL tokens, the others USER_DEFINED: both are matched verbatim), and from
``tokenizer_config.json`` the BOS / EOS tokens and the chat template. Anything that would make the Hugging Face
tokenizer encode differently (a normalizer, another pre-tokenizer, byte fallback, dropout, stripped added tokens)
is refused with an :class:`~hss.errors.HssError`.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hss.checkpoint.tokenizer import CONTROL, NORMAL, USER_DEFINED, Tokenizer
from hss.errors import HssError

__all__ = ["tokenizer_from_hf", "tokenizer_to_hf", "PRE_TOKENIZER"]

# SmolLM2's pre-tokenizer: every digit alone, then GPT-2's byte-level split (hss.checkpoint.tokenizer.pre_tokenize)
PRE_TOKENIZER = {"type": "Sequence", "pretokenizers": [
    {"type": "Digits", "individual_digits": True},
    {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}]}
_BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True}


def _is_smollm_pre(pre: Any) -> bool:
    if not isinstance(pre, dict) or pre.get("type") != "Sequence" or not isinstance(pre.get("pretokenizers"), list):
        return False
    parts = pre["pretokenizers"]
    return (len(parts) == 2 and isinstance(parts[0], dict) and isinstance(parts[1], dict)
            and parts[0].get("type") == "Digits" and parts[0].get("individual_digits") is True
            and parts[1].get("type") == "ByteLevel" and parts[1].get("add_prefix_space") is False
            and parts[1].get("use_regex", True) is True)


def _vocabulary(data: dict[str, Any]) -> tuple[list[str], list[int]]:
    """Tokens by id (the model's vocab and the added tokens) and their GGUF-style token types."""
    vocab = data["model"].get("vocab")
    if not isinstance(vocab, dict) or not all(type(i) is int and i >= 0 for i in vocab.values()):
        raise HssError("model.vocab must map tokens to non-negative int ids")
    by_id: dict[int, str] = {}
    for token, i in vocab.items():
        if by_id.setdefault(i, token) != token:
            raise HssError(f"model.vocab gives id {i} to both {by_id[i]!r} and {token!r}")
    kinds: dict[int, int] = {}
    added = data.get("added_tokens") or []
    if not isinstance(added, list):
        raise HssError("added_tokens must be a list")
    for entry in added:
        if not (isinstance(entry, dict) and type(entry.get("id")) is int and entry["id"] >= 0
                and isinstance(entry.get("content"), str)):
            raise HssError(f"added token {entry!r:.120} needs an int id and a str content")
        for flag in ("lstrip", "rstrip", "single_word"):
            if entry.get(flag):
                raise HssError(f"added token {entry['content']!r} has {flag}: the Tokenizer matches added tokens "
                               f"verbatim only")
        i, content = entry["id"], entry["content"]
        if by_id.setdefault(i, content) != content:
            raise HssError(f"added token {content!r} has id {i}, which the vocab gives to {by_id[i]!r}")
        kinds[i] = CONTROL if entry.get("special", False) else USER_DEFINED
    n = max(by_id, default=-1) + 1
    if len(by_id) != n:
        missing = next(i for i in range(n) if i not in by_id)
        raise HssError(f"the vocabulary has {len(by_id)} tokens but ids up to {n - 1}: no token has id {missing}")
    return [by_id[i] for i in range(n)], [kinds.get(i, NORMAL) for i in range(n)]


def _merges(model: dict[str, Any]) -> list[str]:
    merges = model.get("merges", [])
    if not isinstance(merges, list):
        raise HssError("model.merges must be a list")
    out = []
    for rank, m in enumerate(merges):
        if isinstance(m, list) and len(m) == 2 and all(isinstance(p, str) for p in m):
            m = f"{m[0]} {m[1]}"
        if not isinstance(m, str):
            raise HssError(f"merge {rank} ({m!r:.80}) is neither an 'a b' string nor a pair of strings")
        out.append(m)
    return out


def _check_model(data: Any) -> None:
    if not isinstance(data, dict) or not isinstance(data.get("model"), dict):
        raise HssError("not a tokenizer.json: no 'model' object")
    model = data["model"]
    if model.get("type", "BPE") != "BPE":
        raise HssError(f"the tokenizer model is {model.get('type')!r}; the Tokenizer implements byte-level BPE only")
    refused = {"dropout": model.get("dropout") not in (None, 0, 0.0), "byte_fallback": bool(model.get(
        "byte_fallback")), "continuing_subword_prefix": bool(model.get("continuing_subword_prefix")),
        "end_of_word_suffix": bool(model.get("end_of_word_suffix")), "ignore_merges": bool(model.get(
            "ignore_merges")), "normalizer": data.get("normalizer") is not None}
    for name, bad in refused.items():
        if bad:
            value = data.get(name) if name == "normalizer" else model.get(name)
            raise HssError(f"the tokenizer sets {name} = {value!r:.80}, which the Tokenizer does not implement")
    if not _is_smollm_pre(data.get("pre_tokenizer")):
        raise HssError(f"the pre-tokenizer {data.get('pre_tokenizer')!r:.200} is not SmolLM2's (Digits with "
                       f"individual_digits, then ByteLevel without a prefix space), the only one the Tokenizer has")
    decoder = data.get("decoder")
    if decoder is not None and (not isinstance(decoder, dict) or decoder.get("type") != "ByteLevel"):
        raise HssError(f"the decoder {decoder!r:.120} is not ByteLevel")


def _token_id(tokens: list[str], value: Any, what: str) -> int | None:
    if isinstance(value, dict):
        value = value.get("content")
    if value is None:
        return None
    if not isinstance(value, str):
        raise HssError(f"{what} must be a token string, got {value!r:.80}")
    try:
        return tokens.index(value)
    except ValueError:
        raise HssError(f"{what} {value!r} is not in the vocabulary") from None


def _config_id(model_config: Mapping[str, Any], key: str) -> int | None:
    value = model_config.get(key)
    if isinstance(value, list):
        value = value[0] if value else None
    if value is not None and type(value) is not int:
        raise HssError(f"config.json: {key} must be an int, got {value!r:.80}")
    return value


def _template(config: Mapping[str, Any]) -> str | None:
    template = config.get("chat_template")
    if isinstance(template, list):   # named templates: [{"name": "default", "template": "..."}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if template is not None and not isinstance(template, str):
        raise HssError(f"tokenizer_config.json: chat_template must be a string, got {type(template).__name__}")
    return template


def tokenizer_from_hf(data: Any, config: Mapping[str, Any] | None = None,
                      model_config: Mapping[str, Any] | None = None, chat_template: str | None = None) -> Tokenizer:
    """A Tokenizer from parsed ``tokenizer.json`` ``data``, ``tokenizer_config.json`` ``config`` (BOS / EOS
    tokens, chat template) and ``config.json`` ``model_config`` (``bos_token_id`` / ``eos_token_id`` where the
    tokenizer config names none). ``chat_template``: a separate ``chat_template.jinja``, which wins."""
    _check_model(data)
    tokens, types = _vocabulary(data)
    config = config if isinstance(config, Mapping) else {}
    model_config = model_config if isinstance(model_config, Mapping) else {}
    bos = _token_id(tokens, config.get("bos_token"), "tokenizer_config.json: bos_token")
    eos = _token_id(tokens, config.get("eos_token"), "tokenizer_config.json: eos_token")
    bos = _config_id(model_config, "bos_token_id") if bos is None else bos
    eos = _config_id(model_config, "eos_token_id") if eos is None else eos
    template = chat_template if chat_template is not None else _template(config)
    return Tokenizer(tokens, _merges(data["model"]), types, bos_id=bos, eos_id=eos, chat_template=template)


def tokenizer_to_hf(tok: Tokenizer, model_max_length: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(tokenizer.json, tokenizer_config.json)`` documents of ``tok`` (SmolLM2's layout)."""
    added = [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
              "special": kind == CONTROL}
             for i, (t, kind) in enumerate(zip(tok.tokens, tok.token_types)) if kind in (CONTROL, USER_DEFINED)]
    tokenizer = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": None,
                 "pre_tokenizer": PRE_TOKENIZER, "post_processor": dict(_BYTE_LEVEL, trim_offsets=False),
                 "decoder": dict(_BYTE_LEVEL),
                 "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                           "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                           "vocab": {t: i for i, t in enumerate(tok.tokens)}, "merges": list(tok.merges)}}
    name = (lambda i: None if i is None else tok.tokens[i])   # noqa: E731
    config: dict[str, Any] = {
        "add_prefix_space": False, "clean_up_tokenization_spaces": False, "model_max_length": model_max_length,
        "tokenizer_class": "GPT2Tokenizer", "bos_token": name(tok.bos_id), "eos_token": name(tok.eos_id),
        "unk_token": name(tok.eos_id), "pad_token": name(tok.eos_id),
        "added_tokens_decoder": {str(a["id"]): {k: v for k, v in a.items() if k != "id"} for a in added},
        "additional_special_tokens": [a["content"] for a in added if a["special"]]}
    if tok.chat_template is not None:
        config["chat_template"] = tok.chat_template
    return tokenizer, config
