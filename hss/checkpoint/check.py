"""The real-model self-check: a greedy continuation of a fixed prompt and the cross-entropy on English text.

Rotate-half RoPE over correctly un-permuted Q/K rows gives about 2.8 nats on the default text; rows left in the
GGUF's interleaved order give over 5.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from hss.checkpoint.forward import cross_entropy, greedy_generate
from hss.checkpoint.loader import load_model
from hss.checkpoint.texts import english_text

__all__ = ["CheckResult", "self_check", "PROMPT"]

PROMPT = "What is the capital of France?"


@dataclass(frozen=True)
class CheckResult:
    """What :func:`self_check` measured (times in seconds)."""

    continuation: str
    cross_entropy: float
    n_tokens: int
    load_s: float
    generate_s: float
    forward_s: float


def self_check(path: str | Path | None = None, text: str = "python", n_tokens: int = 512, n_generate: int = 32,
               out: Callable[[str], object] | None = print) -> CheckResult:
    """Load the model (``path=None``: SmolLM2-135M-Instruct), greedily answer :data:`PROMPT` as a chat turn, and
    measure the mean next-token cross-entropy (nats) over the first ``n_tokens`` tokens of
    :func:`~hss.checkpoint.texts.english_text` ``(text)``. ``out``: where the report lines go (``None``: nowhere)."""
    say = out if out is not None else (lambda line: None)
    t0 = time.perf_counter()
    model = load_model(path)
    t1 = time.perf_counter()
    say(f"loaded {model.path} in {t1 - t0:.1f} s: {model.config}")
    tok = model.tokenizer
    prompt_ids = tok.encode(tok.chat_prompt(PROMPT))
    new_ids = greedy_generate(model.weights, tok, prompt_ids, n_generate)
    t2 = time.perf_counter()
    continuation = tok.decode(new_ids)
    say(f"greedy ({len(new_ids)} tokens, {t2 - t1:.1f} s): {PROMPT!r} -> {continuation!r}")
    ids = tok.encode(english_text(text))[:n_tokens]
    ce = cross_entropy(model.weights, ids)
    t3 = time.perf_counter()
    say(f"cross-entropy on {len(ids)} tokens of {text!r}: {ce:.3f} nats ({t3 - t2:.1f} s; about 2.5-3 expected, "
        f"about 5-6 means the RoPE pairing is wrong)")
    return CheckResult(continuation=continuation, cross_entropy=ce, n_tokens=len(ids), load_s=t1 - t0,
                       generate_s=t2 - t1, forward_s=t3 - t2)
