"""GPT-2-style byte-level BPE, as SmolLM2 uses it (GGUF ``tokenizer.ggml.model = gpt2``, ``pre = smollm``).

Encoding runs in three stages, as Hugging Face ``tokenizers`` does for SmolLM2:

1. special tokens (GGUF token types CONTROL and USER_DEFINED, e.g. ``<|im_start|>``) are cut out of the text;
2. the pre-tokenizer splits off every digit on its own (``Digits(individual_digits=True)``), then splits the rest
   with the GPT-2 pattern ``'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+``;
3. each piece's UTF-8 bytes are mapped to GPT-2's printable byte alphabet and merged by BPE rank.

``re`` has no ``\\p{L}`` / ``\\p{N}``: the classes are built once from :mod:`unicodedata` (categories ``L*``,
``N*``), so they are exact for the Unicode version of the running Python.
"""
from __future__ import annotations

import functools
import re
import sys
import unicodedata
from collections.abc import Callable, Sequence

from hss.errors import HssError

__all__ = ["Tokenizer", "bytes_to_unicode", "pre_tokenize", "DEFAULT_SYSTEM_PROMPT", "CONTROL", "USER_DEFINED"]

# GGUF token types (llama.cpp's llama_token_type).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

DEFAULT_SYSTEM_PROMPT = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


@functools.cache
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte → printable character table (printable Latin-1 bytes map to themselves)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _char_class(predicate: Callable[[str], bool]) -> str:
    """The body of a ``re`` character class holding every code point for which ``predicate(category)`` holds."""
    ranges: list[tuple[int, int]] = []
    for cp in range(sys.maxunicode + 1):
        if predicate(unicodedata.category(chr(cp))):
            if ranges and ranges[-1][1] == cp - 1:
                ranges[-1] = (ranges[-1][0], cp)
            else:
                ranges.append((cp, cp))
    return "".join(re.escape(chr(a)) if a == b else f"{re.escape(chr(a))}-{re.escape(chr(b))}" for a, b in ranges)


@functools.cache
def _patterns() -> tuple[re.Pattern[str], re.Pattern[str]]:
    letters = _char_class(lambda cat: cat.startswith("L"))
    numbers = _char_class(lambda cat: cat.startswith("N"))
    digit = re.compile(f"([{numbers}])")
    word = re.compile(rf"'s|'t|'re|'ve|'m|'ll|'d| ?[{letters}]+| ?[{numbers}]+| ?[^\s{letters}{numbers}]+"
                      rf"|\s+(?!\S)|\s+")
    return digit, word


def pre_tokenize(text: str) -> list[str]:
    """SmolLM2's pre-tokenizer: every digit alone, then the GPT-2 pattern on the text between digits."""
    digit, word = _patterns()
    pieces: list[str] = []
    for i, segment in enumerate(digit.split(text)):
        if i % 2:
            pieces.append(segment)
        elif segment:
            pieces.extend(word.findall(segment))
    return pieces


class Tokenizer:
    """Byte-level BPE over a GGUF or ``tokenizer.json`` vocabulary: :meth:`encode`, :meth:`decode`,
    :meth:`chat_prompt`.

    ``tokens``: the vocabulary (GPT-2 byte alphabet, id = index); ``merges``: ``"a b"`` pairs, highest
    priority first; ``token_types``: GGUF types per token (CONTROL / USER_DEFINED tokens are special: matched
    verbatim in text); ``chat_template``: the model's Jinja template, read for its default system prompt. The
    arguments are kept as attributes of the same names (lists).
    """

    def __init__(self, tokens: Sequence[str], merges: Sequence[str], token_types: Sequence[int] | None = None,
                 bos_id: int | None = None, eos_id: int | None = None, chat_template: str | None = None) -> None:
        self.tokens = list(tokens)
        self.ids = {t: i for i, t in enumerate(self.tokens)}
        if len(self.ids) != len(self.tokens):
            raise HssError("Tokenizer: the vocabulary has duplicate tokens")
        if token_types is not None and len(token_types) != len(self.tokens):
            raise HssError(f"Tokenizer: {len(token_types)} token types for {len(self.tokens)} tokens")
        self.merges = list(merges)
        self.ranks: dict[tuple[str, str], int] = {}
        for rank, merge in enumerate(self.merges):
            pair = tuple(merge.split(" "))
            if len(pair) != 2:
                raise HssError(f"Tokenizer: merge {rank} ({merge!r}) is not two tokens separated by one space")
            self.ranks.setdefault(pair, rank)
        self.token_types = list(token_types) if token_types is not None else [NORMAL] * len(self.tokens)
        self.special = {t: i for i, (t, kind) in enumerate(zip(self.tokens, self.token_types))
                        if kind in (CONTROL, USER_DEFINED)}
        self.special_ids = frozenset(self.special.values())
        self._special_re = re.compile("(" + "|".join(re.escape(t) for t in sorted(self.special, key=len,
                                                                                   reverse=True)) + ")") \
            if self.special else None
        for name, value in (("bos_id", bos_id), ("eos_id", eos_id)):
            if value is not None and not 0 <= value < len(self.tokens):
                raise HssError(f"Tokenizer: {name} {value} is outside the vocabulary (size {len(self.tokens)})")
        self.bos_id, self.eos_id, self.chat_template = bos_id, eos_id, chat_template
        self._byte_char = bytes_to_unicode()
        self._char_byte = {ch: b for b, ch in self._byte_char.items()}
        self._cache: dict[str, tuple[int, ...]] = {}

    def __len__(self) -> int:
        return len(self.tokens)

    def _bpe(self, piece: str) -> tuple[int, ...]:
        """The ids of one pre-tokenized piece: its bytes as GPT-2 characters, merged lowest rank first."""
        cached = self._cache.get(piece)
        if cached is not None:
            return cached
        word = [self._byte_char[b] for b in piece.encode("utf-8")]
        while len(word) > 1:
            pairs = [self.ranks.get(pair, -1) for pair in zip(word, word[1:])]
            ranked = [r for r in pairs if r >= 0]
            if not ranked:
                break
            at = pairs.index(min(ranked))
            first, second = word[at], word[at + 1]
            merged, i = [], 0
            while i < len(word):
                if i + 1 < len(word) and word[i] == first and word[i + 1] == second:
                    merged.append(first + second)
                    i += 2
                else:
                    merged.append(word[i])
                    i += 1
            word = merged
        try:
            ids = tuple(self.ids[symbol] for symbol in word)
        except KeyError as e:
            raise HssError(f"Tokenizer: BPE of {piece!r} gave {e.args[0]!r}, which is not in the vocabulary") from None
        self._cache[piece] = ids
        return ids

    def encode(self, text: str, special: bool = True) -> list[int]:
        """Token ids of ``text`` (no BOS added, as SmolLM2 does). ``special``: match special tokens in the text
        (else they are encoded as plain text)."""
        if not isinstance(text, str):
            raise TypeError(f"Tokenizer.encode: text must be a str, got {type(text).__name__}")
        parts = self._special_re.split(text) if special and self._special_re else [text]
        ids: list[int] = []
        for i, part in enumerate(parts):
            if i % 2:
                ids.append(self.special[part])
            else:
                for piece in pre_tokenize(part):
                    ids.extend(self._bpe(piece))
        return ids

    def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
        """The text of ``ids`` (invalid UTF-8, e.g. a cut multi-byte character, becomes U+FFFD)."""
        out: list[str] = []
        pending = bytearray()
        for i in ids:
            i = int(i)
            if not 0 <= i < len(self.tokens):
                raise HssError(f"Tokenizer.decode: id {i} is outside the vocabulary (size {len(self.tokens)})")
            if i in self.special_ids:
                out.append(pending.decode("utf-8", errors="replace"))
                pending.clear()
                if not skip_special:
                    out.append(self.tokens[i])
            else:
                pending.extend(self._char_byte[ch] for ch in self.tokens[i])
        out.append(pending.decode("utf-8", errors="replace"))
        return "".join(out)

    def system_prompt(self) -> str:
        """The default system message of the chat template (SmolLM2's own when the model has none)."""
        if self.chat_template is None:
            return DEFAULT_SYSTEM_PROMPT
        found = re.search(r"<\|im_start\|>system\n(.*?)<\|im_end\|>", self.chat_template, re.S)
        if found is None:
            raise HssError("Tokenizer.chat_prompt: the model's chat template is not SmolLM2's ChatML template "
                           "(no '<|im_start|>system' default message)")
        return found.group(1)

    def chat_prompt(self, user_text: str, system: str | None = None) -> str:
        """SmolLM2's ChatML prompt for one user turn, ending where the assistant's reply starts.

        ``system``: the system message (``None``: the template's default). Encode the result with :meth:`encode`.
        """
        system = self.system_prompt() if system is None else system
        return (f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{user_text}<|im_end|>\n"
                f"<|im_start|>assistant\n")
