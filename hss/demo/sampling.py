"""The demo's sampling flags (``python -m hss demo`` and ``--batch N``): ``--temperature``, ``--top-k``, ``--top-p``,
``--min-p``, ``--repeat-penalty``, ``--presence-penalty`` and ``--seed``, each checked by argparse against
:class:`~hss.model.sample.SamplingParams`' own rules, made into one ``SamplingParams`` (:func:`sampling_params`) and
said in the demo's header (:func:`sampling_text`). Greedy by default; with ``--chat`` the flags not given take
llama.cpp's defaults (:data:`CHAT_SAMPLING`) unless ``--temperature 0`` is given. The rules: docs/design.md §22.
"""
from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from hss.decls.sample import CANDIDATES
from hss.errors import HssError
from hss.model.sample import GREEDY, SamplingParams

__all__ = ["add_sampling_arguments", "sampling_value", "sampling_params", "sampling_text", "CHAT_SAMPLING",
           "SAMPLING_FLAGS"]

CHAT_SAMPLING = SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, repetition_penalty=1.1)
"""llama.cpp's default sampling, what ``--chat`` draws with unless flags say otherwise (``--temperature 0``: greedy)."""
SAMPLING_FLAGS = (   # (flag, SamplingParams field, type, metavar, help)
    ("--temperature", "temperature", float, "T", "sampling temperature >= 0 (default 0: greedy, the argmax; with "
     "--chat 0.8); top-k, top-p and min-p apply only above 0"),
    ("--top-k", "top_k", int, "K", f"keep the K most likely tokens, 0..{CANDIDATES} (default 0: off; with --chat 40)"),
    ("--top-p", "top_p", float, "P", "keep the most likely tokens up to probability P, 0 < P <= 1 (default 1: off; "
     "with --chat 0.95)"),
    ("--min-p", "min_p", float, "P", "drop tokens below P times the most likely one's probability, 0..1 (default 0: "
     "off; with --chat 0.05)"),
    ("--repeat-penalty", "repetition_penalty", float, "R", "penalise the recent tokens (the prompt's tail included) "
     "by R > 0: positive logits divided by R, others multiplied (default 1: off; with --chat 1.1)"),
    ("--presence-penalty", "presence_penalty", float, "X", "subtract X from the logits of the recent tokens "
     "(default 0: off)"),
    ("--seed", "seed", int, "S", "seed of the draws, 0..2**64-1 (default 0); with --batch row i draws with S + i"),
)


def sampling_value(field: str, kind: type) -> Any:
    """An argparse ``type``: a number that :class:`SamplingParams` takes as ``field`` (its own check, so the rule is
    said once); anything else is a usage error naming the flag and the rule."""
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
        try:
            SamplingParams(**{field: value})
        except (HssError, TypeError) as e:
            raise argparse.ArgumentTypeError(f"{text} is out of range ({e})") from None
        return value
    parse.__name__ = field   # argparse names the type in its own messages
    return parse


def add_sampling_arguments(p: argparse.ArgumentParser) -> None:
    """The sampling flags on ``p`` (each None unless given, so :func:`sampling_params` can tell what was asked)."""
    for flag, field, kind, metavar, text in SAMPLING_FLAGS:
        p.add_argument(flag, dest=field, type=sampling_value(field, kind), default=None, metavar=metavar, help=text)


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    """The sampling the flags ask for: greedy by default; with ``--chat``, :data:`CHAT_SAMPLING` unless
    ``--temperature 0`` is given; any sampling flag given wins (each was checked by argparse)."""
    given = {field: getattr(args, field) for _, field, *_ in SAMPLING_FLAGS if getattr(args, field) is not None}
    base = CHAT_SAMPLING if args.chat and given.get("temperature") != 0 else GREEDY
    return dataclasses.replace(base, **given)


def sampling_text(p: SamplingParams, rows: int = 1) -> str:
    """``p`` for the demo's header: ``greedy``, or the settings that are on and the seed (``rows`` > 1: each row's,
    the seed + the row)."""
    if p.greedy:
        return "greedy"
    parts = [f"temperature {p.temperature:g}"]
    parts += [f"{name} {value:g}" for name, value, on in (
        ("top-k", p.top_k, p.top_k != 0), ("top-p", p.top_p, p.top_p != 1), ("min-p", p.min_p, p.min_p != 0),
        ("repeat penalty", p.repetition_penalty, p.repetition_penalty != 1),
        ("presence penalty", p.presence_penalty, p.presence_penalty != 0)) if on]
    last = (p.seed + rows - 1) % (1 << 64)
    parts.append(f"seed {p.seed}" if rows == 1 else f"seeds {p.seed} to {last} (--seed + the row)")
    return ", ".join(parts)
