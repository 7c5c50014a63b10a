"""Declaration of ``ptx/sample.cu`` (the next token of each batch row: penalties, temperature, top-k, top-p, min-p
and a Philox draw, or the greedy token), its launch geometry, and its emulation through :mod:`hss.reference.sample`
(docs/design.md §22).

``params`` is u32 ``[m, PARAM_WORDS]`` (the words ``P_*``); ``history`` i32 ``[m, history_cap]`` (each row's ring of
its last tokens); ``state`` i32: the token of row r at ``state[r]``, and with ``advance >= 0`` the model state's
position words at ``state_stride + r`` and ``2 state_stride + r`` (as ``model_argmax``). The emulation reads them
when it runs, as the kernel does, so a replayed graph draws with the counters the last replay left.

Geometry (:func:`sample_geometry`; the ``check`` holds emulated launches to it): grid (m), block (``THREADS``),
dynamic shared memory ``4 ceil(vocab / 32)`` bytes (the history bitmap), and with ``stage`` the penalised keys,
``4 stage_words(vocab)`` bytes more (:func:`stage_fits`: whether they fit a device's opt-in shared memory; past 48
KiB the function needs ``set_max_dynamic_shared``).
"""
from __future__ import annotations

from types import SimpleNamespace

import ml_dtypes
import numpy as np

from hss._util import ceil_div
from hss.decls._decl import Launch, declare
from hss.decls.qsa_prefill import Geometry
from hss.reference import sample as ref

__all__ = ["MODULE", "THREADS", "CANDIDATES", "MASS_BITS", "PARAM_WORDS", "MAX_VOCAB", "RADIX_BINS", "FLAG_NAN",
           "FLAG_INF", "FLAG_EMPTY", "P_TEMPERATURE", "P_TOP_K", "P_TOP_P", "P_MIN_P", "P_REPETITION",
           "P_PRESENCE", "P_SEED_LO", "P_SEED_HI", "P_STEP", "P_COUNT", "P_FLAGS", "sample_geometry", "stage_words",
           "stage_fits", "STATIC_SHARED",
           "SAMPLE_TOKENS"]

BF16 = ml_dtypes.bfloat16
MODULE = "sample"
THREADS = 1024             # SAMPLE_THREADS
CANDIDATES = ref.CANDIDATES   # SAMPLE_CANDIDATES: top_k's cap (and the greedy near-tie cap)
MASS_BITS = ref.MASS_BITS  # SAMPLE_MASS_BITS
PARAM_WORDS = 16           # SAMPLE_PARAM_WORDS
MAX_VOCAB = 262144         # SAMPLE_MAX_VOCAB
RADIX_BINS = 2048          # SAMPLE_RADIX_BINS
FLAG_NAN, FLAG_INF, FLAG_EMPTY = ref.FLAG_NAN, ref.FLAG_INF, ref.FLAG_EMPTY   # SAMPLE_FLAG_*
# the words of a params row
P_TEMPERATURE, P_TOP_K, P_TOP_P, P_MIN_P, P_REPETITION, P_PRESENCE = range(6)
P_SEED_LO, P_SEED_HI, P_STEP, P_COUNT, P_FLAGS = range(6, 11)


STATIC_SHARED = 10 * 1024  # room kept for the kernel's static shared memory (8,896 bytes built for sm_90)


def stage_words(vocab: int) -> int:
    """u32 words of the staged keys: ``THREADS`` rows of ``8 cpt + 1`` (``cpt`` chunks of 8 tokens a thread)."""
    cpt = ceil_div(ceil_div(vocab, 8), THREADS)
    return THREADS * (8 * cpt + 1)


def stage_fits(vocab: int, shared_optin: int) -> bool:
    """Whether the staged keys and the bitmap fit ``shared_optin`` bytes of shared memory a block (a device's
    opt-in limit; 227 KiB on an H100 or H200: vocabularies up to 49,152)."""
    return 4 * ceil_div(vocab, 32) + 4 * stage_words(vocab) + STATIC_SHARED <= shared_optin


def sample_geometry(m: int, vocab: int, stage: bool = False) -> Geometry:
    """``sample_tokens``: one CTA per row; the history bitmap (and with ``stage`` the keys) in dynamic shared
    memory."""
    return Geometry((m, 1, 1), (THREADS, 1, 1), 4 * ceil_div(vocab, 32) + (4 * stage_words(vocab) if stage else 0))


# -- emulation ------------------------------------------------------------------------------------
def _live(a: SimpleNamespace) -> int:
    return a.m if a.rows is None else max(0, min(a.m, int(a.rows[:4].view(np.int32)[0])))


def row_params(words: np.ndarray) -> dict:
    """The parameters of one ``params`` row (u32 ``[PARAM_WORDS]``) as :func:`hss.reference.sample.sample_row`
    takes them."""
    f = words.view(np.float32)
    return {"temperature": f[P_TEMPERATURE], "top_k": int(words.view(np.int32)[P_TOP_K]), "top_p": f[P_TOP_P],
            "min_p": f[P_MIN_P], "repetition_penalty": f[P_REPETITION], "presence_penalty": f[P_PRESENCE],
            "seed": int(words[P_SEED_LO]) | int(words[P_SEED_HI]) << 32}


def _emulate(a: SimpleNamespace, launch: Launch) -> None:
    m, vocab, dim, cap = a.m, a.vocab, a.dim, max(a.history_cap, 0)
    live = _live(a)
    if live <= 0 or not 1 <= vocab <= MAX_VOCAB:
        return
    params = a.params[: 4 * m * PARAM_WORDS].view(np.uint32).reshape(m, PARAM_WORDS)
    history = a.history[: 4 * m * cap].view(np.int32).reshape(m, cap) if cap else np.zeros((m, 0), np.int32)
    logits = a.logits[: 2 * m * vocab].view(BF16).reshape(m, vocab)
    h = a.h[: 2 * m * dim].view(BF16).reshape(m, dim) if a.h is not None else None
    weight = a.weight[: 2 * vocab * dim].view(BF16).reshape(vocab, dim) if a.h is not None else None
    state = a.state.view(np.int32)
    for r in range(live):
        words = params[r]
        p = row_params(words)
        top_k = int(np.clip(p["top_k"], 0, CANDIDATES))
        count, step = int(words[P_COUNT]), int(words[P_STEP])
        out = ref.sample_row(logits[r], {**p, "top_k": top_k}, history[r], count, step,
                             None if h is None else h[r], weight)
        state[r] = out.token
        if a.advance >= 0:
            pos = np.int32(state[a.state_stride + r]) + np.int32(a.advance)   # int32 arithmetic, as the kernel's
            state[a.state_stride + r], state[2 * a.state_stride + r] = pos, pos + np.int32(1)
        if cap:
            history[r, count % cap] = out.token
        words[P_STEP] = np.uint32((step + 1) & 0xFFFFFFFF)
        words[P_COUNT] = np.uint32((count + 1) & 0xFFFFFFFF)
        words[P_FLAGS] |= np.uint32(out.flags)


def _check(a: SimpleNamespace, launch: Launch) -> str | None:
    if a.stage not in (0, 1):
        return f"stage must be 0 or 1 (got {a.stage})"
    want = sample_geometry(a.m, a.vocab, bool(a.stage))
    if (launch.grid, launch.block, launch.shared) != (want.grid, want.block, want.shared):
        return f"needs grid {want.grid}, block {want.block} and {want.shared} bytes of dynamic shared memory"
    if a.advance >= 0 and a.state_stride < a.m:
        return f"needs state_stride >= m with advance >= 0 (got {a.state_stride} for m = {a.m})"
    return None


# -- declaration -----------------------------------------------------------------------------------
def _state(a: SimpleNamespace) -> int:
    m = max(a.m, 0)
    return 4 * (2 * max(a.state_stride, 0) + m) if a.advance >= 0 and m else 4 * m


def _refine(a: SimpleNamespace, per_row: int) -> int:
    return per_row if a.h else 0   # h null: no near-tie recomputation, weight unread


SAMPLE_TOKENS = declare(
    MODULE, "sample_tokens",
    "ptr logits, ptr h, ptr weight, ptr params, ptr history, ptr state, ptr rows, i32 vocab, i32 dim, "
    "i32 history_cap, i32 m, i32 state_stride, i32 advance, i32 stage",
    reads={"logits": lambda a: 2 * max(a.m, 0) * max(a.vocab, 0),
           "h": lambda a: _refine(a, 2 * max(a.m, 0) * max(a.dim, 0)),
           "weight": lambda a: _refine(a, 2 * max(a.vocab, 0) * max(a.dim, 0)),
           "params": lambda a: 4 * PARAM_WORDS * max(a.m, 0),
           "history": lambda a: 4 * max(a.m, 0) * max(a.history_cap, 0), "state": _state,
           "rows": lambda a: 4 if a.rows else 0},
    writes={"params": lambda a: 4 * PARAM_WORDS * max(a.m, 0),
            "history": lambda a: 4 * max(a.m, 0) * max(a.history_cap, 0), "state": _state},
    emulate=_emulate, check=_check)
