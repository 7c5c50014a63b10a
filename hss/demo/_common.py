"""What the demo's single-sequence and batched paths share (:mod:`hss.demo.model`, :mod:`hss.demo.batch`): the
built-in paragraph, the emulator's defaults and marking, the prompt's text and ids, and the report's first lines."""
from __future__ import annotations

import argparse
import time

from hss import cuda_min as cm
from hss.checkpoint import Config, Tokenizer, english_text
from hss.errors import HssError
from hss.model.session import DeviceModel

__all__ = ["PARAGRAPH", "EMULATOR_PROMPT", "EMULATOR_TOKENS", "NOT_MEASURED", "prompt_text", "prompt_ids", "where",
           "model_line", "weights_line"]

PARAGRAPH = ("The lighthouse keeper had kept the same routine for thirty years. Every evening he climbed the "
             "spiral stairs, polished the great lens, and lit the lamp before the sun touched the sea. Ships he "
             "would never meet passed safely in the dark because of that small, patient light. One winter night a "
             "storm knocked out the power across the whole coast, and the keeper")
EMULATOR_PROMPT, EMULATOR_TOKENS = 32, 4
NOT_MEASURED = "(emulator: not a hardware measurement)"


def prompt_text(args: argparse.Namespace) -> str:
    """The prompt's text: ``--prompt-file``'s contents, else ``--prompt``, else :data:`PARAGRAPH`."""
    if args.prompt_file:
        try:
            with open(args.prompt_file, encoding="utf-8") as f:
                return f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise HssError(f"--prompt-file {args.prompt_file}: cannot read it as UTF-8 text: "
                           f"{getattr(e, 'strerror', None) or e}") from None
    return args.prompt if args.prompt is not None else PARAGRAPH


def prompt_ids(text: str, tok: Tokenizer | None, n: int | None, vocab: int, chat: bool = False) -> list[int]:
    """``text`` as token ids (the random model: its UTF-8 bytes modulo ``vocab``; ``chat``: in the chat template),
    cut or extended with built-in English text to exactly ``n`` tokens unless ``n`` is None."""
    if tok is None:   # the random model: bytes of the text as ids
        ids = [b % vocab for b in text.encode("utf-8")]
        filler = [b % vocab for b in english_text("heapq").encode("utf-8")]
    else:
        ids = tok.encode(tok.chat_prompt(text) if chat else text)
        # long prose that does not repeat (as much of it as n tokens can need: under 8 characters a token)
        filler = tok.encode("\n\n" + english_text("topics")[:8 * (n or 0) + 1024])
    if n is not None:
        while len(ids) < n:
            ids += filler
        ids = ids[:n]
    if not ids:
        raise HssError("the prompt is empty")
    return ids


def where(ctx: cm.CudaCtx, emulated: bool) -> str:
    """Where the demo runs, for its first line: the device's name, or the emulator and what that means."""
    return ("the CPU emulator (no GPU: kernels run as numpy references; a short prompt and a few tokens)"
            if emulated else f"{ctx.name}")


def model_line(c: Config) -> str:
    """The model's shapes, the start of the demo's second line."""
    return (f"model: {c.n_layer} layers, dim {c.dim}, {c.n_head} q / {c.n_kv_head} kv heads x {c.head_dim}, ffn "
            f"{c.ffn_dim}, vocab {c.vocab_size}")


def weights_line(model: DeviceModel, t0: float, emulated: bool) -> None:
    """Wait for the weights' upload, then print their size and the time since ``t0``."""
    cm.stream_sync(model.ctx.stream)
    print(f"weights: {model.weights.bytes / 1e6:.1f} MB on the device (bf16 matrices) in "
          f"{time.perf_counter() - t0:.2f} s{f' {NOT_MEASURED}' if emulated else ''}")
