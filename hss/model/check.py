"""The device forward against the numpy forward of :mod:`hss.checkpoint`: the stated logit bound and a check of greedy
tokens that tells real disagreements from near ties.

The device computes with bf16 weights and bf16 activations between its kernels (f32 residual stream, f32
accumulation), the numpy forward in float32 with the same bf16-rounded weights (:func:`~hss.model.bf16_rounded`), so
they differ by the rounding of every activation, compounded over the layers. The bound per logit is

    |device - numpy| <= 2^-7 |numpy| + LOGIT_REL * max_row |numpy|

(the final bf16 rounding of the logit, plus the pipeline's error as a fraction of the row's largest logit).
``LOGIT_REL`` = 0.04: measured on SmolLM2-135M (30 layers) on the emulator, the worst row reached 0.023, and 0.005 on
the tiny random test models; a model missing one layer misses the bound by far (the tests' mutation check).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from hss.checkpoint import Weights, forward
from hss.model.weights import bf16_rounded

__all__ = ["LOGIT_REL", "logit_bound", "GreedyCheck", "check_greedy"]

LOGIT_REL = 0.04


def logit_bound(ref: np.ndarray) -> np.ndarray:
    """The per-entry bound above for numpy logits ``ref [..., vocab]``."""
    a = np.abs(np.asarray(ref, np.float64))
    return 2.0 ** -7 * a + LOGIT_REL * a.max(axis=-1, keepdims=True)


@dataclass(frozen=True)
class GreedyCheck:
    """``exact``: tokens that are the numpy forward's argmax; ``near_ties``: the others whose numpy logit is within
    the two tokens' bounds of the max (the device may rank them first); ``wrong``: positions of the rest."""
    tokens: int
    exact: int
    near_ties: int
    wrong: tuple[int, ...]

    @property
    def ok(self) -> bool:
        return not self.wrong

    def __str__(self) -> str:
        return (f"{self.exact}/{self.tokens} tokens are the numpy forward's argmax, {self.near_ties} near ties, "
                f"{len(self.wrong)} wrong{f' (at {list(self.wrong)})' if self.wrong else ''}")


def check_greedy(weights: Weights, prompt: Sequence[int], tokens: Sequence[int], rounded: bool = False) -> GreedyCheck:
    """Teacher-force ``prompt + tokens`` through the numpy forward (one pass; ``weights`` rounded to bf16 first
    unless ``rounded``) and judge each greedy ``tokens[i]`` against the logits that predicted it."""
    w = weights if rounded else bf16_rounded(weights)
    if not tokens:
        return GreedyCheck(0, 0, 0, ())
    ids = list(prompt) + list(tokens)
    ref = forward(w, ids[:-1])[len(prompt) - 1:].astype(np.float64)   # row i predicted tokens[i]
    tol = logit_bound(ref)
    exact, near, wrong = 0, 0, []
    for i, t in enumerate(tokens):
        row, top = ref[i], int(np.argmax(ref[i]))
        if t == top:
            exact += 1
        elif row[t] >= row[top] - tol[i, top] - tol[i, t]:
            near += 1
        else:
            wrong.append(i)
    return GreedyCheck(len(tokens), exact, near, tuple(wrong))
