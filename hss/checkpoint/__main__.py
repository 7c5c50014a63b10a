"""``python -m hss.checkpoint check [--path GGUF|DIR|hf:ORG/NAME] [--text python|license|heapq|zen] [--tokens N]``."""
from __future__ import annotations

import argparse
import sys

from hss.checkpoint.check import self_check
from hss.checkpoint.texts import SOURCES
from hss.errors import HssError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hss.checkpoint", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    check = sub.add_parser("check", help="greedy continuation and cross-entropy of SmolLM2-135M (numpy, CPU)")
    check.add_argument("--path", help="a GGUF file, a Hugging Face checkpoint directory or hf:ORG/NAME (default: "
                       "SmolLM2-135M-Instruct's GGUF)")
    check.add_argument("--text", default="python", choices=sorted(SOURCES), help="the English text to score")
    check.add_argument("--tokens", type=int, default=512, help="how many tokens of it to score")
    args = parser.parse_args(argv)
    try:
        self_check(args.path, text=args.text, n_tokens=args.tokens)
    except HssError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
