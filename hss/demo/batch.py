"""``python -m hss demo --batch N``: N prompts decoded together through :class:`~hss.model.batch.BatchSession`, the
KV history in HBM (``--kv hbm``, the default), behind the device sparse step (``--kv sparse``: each row's complete
pages in one pinned host store, with the single-sequence demo's sparse settings, :func:`hss.demo.model.sparse_options`:
``--budget``, ``--keep-first``, ``--keep-recent``, ``--rank``, the projection calibrated once before the batch and the
per-head temperature; ``--resident`` and ``--tile`` are the single sequence's) or behind the exact swap (``--kv swap``:
each row's complete pages in one pinned host store, all but its first ``--resident`` (all layers; default 0, as the
single sequence's) streamed into HBM every step through ``--ring`` layer slots), greedily or sampled as the demo's
sampling flags say (row i draws with ``--seed`` + i: the rows differ, a run repeats).

The rows' prompts: one per non-empty line of ``--prompt-file`` (cycled when the file has fewer lines than N, the
first N when it has more), else ``--prompt`` in every row, else N of :data:`PROMPTS` (cycled past eight);
``--chat`` and ``--prompt-tokens`` apply to each row (the built-in prompts are short: the emulator runs them as
they are). Each row is prefilled as it joins the batch, then every step
decodes one token of every live row; a row leaves after ``--tokens`` tokens or at the end-of-text token (unless
``--ignore-eos``), and its text is printed then as ``[row i] ...``. While it runs, one line on stderr (a terminal
only) shows the step, the live rows and the tokens so far.

The report: the prefill's time and tokens/s; the decode's steps and wall time, then the timed steps (graph replays,
or eager steps after each batch size's first: the first step of a batch size and its capture are excluded) as
tokens/s for the batch, ms per step and tokens/s of each row (its timed steps over their time); in the sparse mode
also the pages the rows attended, summed over rows and layers (:meth:`~hss.model.batch.BatchSession.counters`: hits
in their HBM slots, misses read from the host store, the bytes read); in the swap mode the same sums (hits: the
resident pages, misses: the pages streamed) and the step's captures (one per change of the rows' pages). On the
emulator every time and rate is marked as no hardware measurement.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hss import cuda_min as cm
from hss.checkpoint import Tokenizer, Weights
from hss.demo._common import EMULATOR_TOKENS, NOT_MEASURED, model_line, prompt_ids, prompt_text, weights_line, where
from hss.demo.sampling import sampling_params, sampling_text
from hss.errors import HssError
from hss.model.batch import BatchSession
from hss.model.check import check_greedy
from hss.model.sample import SamplingParams
from hss.model.session import DeviceModel

__all__ = ["run", "prompts", "sampling", "PROMPTS"]

PROMPTS = (   # continuations, not instructions: without --chat an instruct model answers an instruction with its end
    "The lighthouse keeper climbed the spiral stairs one last time and",
    "Here is a short poem about a cat who wants to fly:\n\n",
    "The sky looks blue during the day because",
    "The three things to pack for a week of hiking in the mountains are",
    "Once upon a time, in a village at the edge of a great forest,",
    "To make a simple tomato soup, first",
    "The capital of Australia is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
)


def prompts(args: argparse.Namespace, tok: Tokenizer | None, vocab: int) -> list[list[int]]:
    """The ``args.batch`` rows' prompts as token ids (see the module's docstring for where they come from)."""
    n = args.batch
    if args.prompt_file:
        texts = [line for line in prompt_text(args).splitlines() if line.strip()]
        if not texts:
            raise HssError(f"--prompt-file {args.prompt_file} has no non-empty line (with --batch it holds one "
                           "prompt per line)")
    elif args.prompt is not None:
        texts = [args.prompt]
    else:
        texts = list(PROMPTS)
    return [prompt_ids(text, tok, args.prompt_tokens, vocab, args.chat)
            for text in itertools.islice(itertools.cycle(texts), n)]


def sampling(args: argparse.Namespace, row: int) -> SamplingParams:
    """How ``row``'s tokens are drawn, for its ``BatchSession.add(..., sampling=)``: the demo's sampling flags
    (:func:`hss.demo.sampling.sampling_params`) with the seed ``--seed + row`` (modulo 2**64)."""
    p = sampling_params(args)
    return dataclasses.replace(p, seed=(p.seed + row) % (1 << 64))


@dataclass
class _Stats:
    """Decode bookkeeping: every step's wall time, the timed steps' (see the module's docstring), per row."""
    steps: int = 0
    seconds: float = 0.0
    timed_steps: int = 0
    timed_seconds: float = 0.0
    timed_tokens: int = 0
    row_steps: dict[int, int] = field(default_factory=dict)
    row_seconds: dict[int, float] = field(default_factory=dict)


class _Rows:
    """Prints each row's text once it finished (``[row i] ...``) and the live progress line on stderr."""

    def __init__(self, tok: Tokenizer | None, live: bool) -> None:
        self.tok, self.live, self.printed = tok, live, set()

    def progress(self, text: str) -> None:
        if self.live:
            sys.stderr.write(f"\r\033[K{text}")
            sys.stderr.flush()

    def finished(self, sess: BatchSession) -> None:
        for rid in sorted(set(sess.finished) - self.printed):
            self.printed.add(rid)
            self.progress("")
            tokens = sess.finished[rid].tokens
            head = f"[row {rid}] "
            text = ("token ids: " + " ".join(map(str, tokens))) if self.tok is None else self.tok.decode(tokens)
            lines = [line.rstrip() for line in text.rstrip().split("\n")]   # continuation lines under the text
            print(head + ("\n" + " " * len(head)).join(lines), flush=True)


SparseOptions = Callable[[DeviceModel, Tokenizer | None, argparse.Namespace, int], dict[str, Any]]


def run(args: argparse.Namespace, weights: Weights, tok: Tokenizer | None, name: str, emulated: bool,
        sparse_options: SparseOptions | None = None) -> int:
    """The batched demo (``args`` from :func:`hss.demo.model.add_arguments`, the model loaded, ``args.kv`` hbm,
    sparse or swap): exit status 0, or 1 when ``--check`` finds a wrong token in a row. ``sparse_options``: for ``--kv
    sparse``, :func:`hss.demo.model.sparse_options` (called once, the model on the device, with the batch's
    max_tokens)."""
    c = weights.config
    rows = prompts(args, tok, c.vocab_size)
    n_tokens = args.tokens if args.tokens is not None else (EMULATOR_TOKENS if emulated else 128)
    graph = args.graph if args.graph is not None else not emulated
    longest = max(len(ids) for ids in rows)
    max_tokens = longest + n_tokens + 1
    if max_tokens > c.context_length:
        raise HssError(f"{longest} prompt + {n_tokens} generated tokens exceed the model's context length "
                       f"{c.context_length} (lower --prompt-tokens or --tokens)")
    stop = () if args.ignore_eos or tok is None or tok.eos_id is None else (tok.eos_id,)
    ctx = cm.CudaCtx(args.device)
    lengths = sorted(len(ids) for ids in rows)
    span = f"{lengths[0]}" if lengths[0] == lengths[-1] else f"{lengths[0]} to {lengths[-1]}"
    print(f"hss demo on {where(ctx, emulated)}: {name}")
    kv = args.kv if args.kv in ("sparse", "swap") else "hbm"
    if kv == "sparse" and sparse_options is None:
        raise TypeError("--kv sparse needs sparse_options (hss.demo.model.sparse_options)")
    resident = args.resident if args.resident is not None else 0
    mode = {"sparse": f"kv sparse (budget {args.budget}, first {args.keep_first}, recent {args.keep_recent} pages)",
            "swap": f"kv swap ({resident} resident pages a row, all layers; ring {args.ring})"}.get(kv, "kv hbm")
    print(f"{model_line(c)}; {mode}; batch {len(rows)} (BatchSession); graph {'on' if graph else 'off'}; prompts "
          f"{span} tokens{' (chat)' if args.chat else ''}; up to {n_tokens} tokens per row")
    print(f"sampling: {sampling_text(sampling_params(args), len(rows))}")
    t0 = time.perf_counter()
    out = _Rows(tok, sys.stderr.isatty())
    with contextlib.closing(ctx), DeviceModel(weights, ctx) as model:
        weights_line(model, t0, emulated)
        opts = ({"resident": resident, "ring": args.ring} if kv == "swap" else
                sparse_options(model, tok, args, max_tokens) if kv == "sparse" and sparse_options else {})
        with BatchSession(model, kv, max_batch=len(rows), max_tokens=max_tokens, graph=graph,
                          fuse_rope=args.fuse_rope, **opts) as sess:
            print("--- generated ---", flush=True)
            t1 = time.perf_counter()
            for i, ids in enumerate(rows):
                out.progress(f"prefill: row {i + 1}/{len(rows)}")
                sess.add(ids, max_new=n_tokens, stop=stop, sampling=sampling(args, i))
                out.finished(sess)
            prefill_s = time.perf_counter() - t1
            stats = _decode(sess, out, graph)
            out.progress("")
            print("--- end ---")
            tokens = {rid: f.tokens for rid, f in sorted(sess.finished.items())}
            reasons = {rid: f.reason for rid, f in sess.finished.items()}
            pages = _pages(sess) if kv != "hbm" else None
            captures = sess.captures
    if args.print_ids and tok is not None:
        for rid, toks in tokens.items():
            print(f"[row {rid}] token ids: {' '.join(map(str, toks))}")
    _report(rows, tokens, reasons, prefill_s, stats, graph, emulated)
    if pages is not None and kv == "swap":
        attended = pages["hits"] + pages["misses"]
        print(f"KV: each row's complete pages in a pinned host store, all but its resident ones streamed into HBM "
              f"every step (the exact swap); pages attended (all rows and layers) {attended:,}: {pages['hits']:,} "
              f"resident in HBM, {pages['misses']:,} streamed from the host, {pages['bytes_read'] / 1e6:.3f} MB "
              f"streamed; the step captured {captures} time(s) (again whenever the rows' pages change)")
    elif pages is not None:
        attended = pages["hits"] + pages["misses"]
        print(f"KV: each row's complete pages in a pinned host store, attended through the device sparse step; pages "
              f"attended (all rows and layers) {attended:,}: {pages['hits']:,} hits in HBM, {pages['misses']:,} "
              f"misses read from the host (hit rate {pages['hits'] / max(attended, 1):.3f}), "
              f"{pages['bytes_read'] / 1e6:.3f} MB read")
    if not args.check:
        return 0
    ok = True
    for rid, toks in tokens.items():
        result = check_greedy(weights, rows[rid], toks)
        ok &= result.ok
        print(f"check against the numpy forward (bf16 weights): row {rid}: {result}")
    return 0 if ok else 1


def _pages(sess: BatchSession) -> dict[str, int]:
    """The swap batch's ``hits`` / ``misses`` / ``bytes_read``, summed over its rows and layers."""
    rows = [sess.counters(rid) for rid in sorted(sess.finished)]
    return {k: sum(int(r[k].sum()) for r in rows) for k in ("hits", "misses", "bytes_read")}


def _decode(sess: BatchSession, out: _Rows, graph: bool) -> _Stats:
    """Step until every row has left, timing each step (host wall time: a step waits for its tokens)."""
    st, seen = _Stats(), set()
    produced = sum(len(f.tokens) for f in sess.finished.values()) + len(sess.rows)
    while sess.rows:
        b, captures = sess.batch_size(), sess.captures
        warm = b in sess.graph_sizes if graph else b in seen   # a replay, or an eager step after the first
        t0 = time.perf_counter()
        got = sess.step()
        dt = time.perf_counter() - t0
        seen.add(b)
        st.steps += 1
        st.seconds += dt
        if warm and sess.captures == captures:
            st.timed_steps += 1
            st.timed_seconds += dt
            st.timed_tokens += len(got)
            for rid in got:
                st.row_steps[rid] = st.row_steps.get(rid, 0) + 1
                st.row_seconds[rid] = st.row_seconds.get(rid, 0.0) + dt
        produced += len(got)
        out.finished(sess)
        out.progress(f"decode: step {st.steps}, {len(sess.rows)} rows live, {len(sess.finished)} finished, "
                     f"{produced} tokens")
    return st


def _report(rows: list[list[int]], tokens: dict[int, list[int]], reasons: dict[int, str], prefill_s: float,
            st: _Stats, graph: bool, emulated: bool) -> None:
    note = f" {NOT_MEASURED}" if emulated else ""
    n_prompt = sum(len(ids) for ids in rows)
    rate = n_prompt / max(prefill_s, 1e-9)
    print(f"prefill: {len(rows)} rows, {n_prompt} tokens in {prefill_s:.3f} s = {rate:,.0f} tokens/s (one row at a "
          f"time as it joins the batch){note}")
    generated = sum(len(t) for t in tokens.values())
    print(f"decode: {generated} tokens in all rows (the first of each from its prefill); {st.steps} steps in "
          f"{st.seconds:.3f} s wall{note}")
    if not st.timed_steps or st.timed_seconds <= 0:
        print("decode: no timed steps (every step was a batch size's first or its capture: raise --tokens)")
        return
    how = "graph replay" if graph else "eager"
    print(f"decode: {st.timed_steps} timed steps ({how}; each batch size's first step and capture excluded) in "
          f"{st.timed_seconds:.3f} s = {st.timed_tokens / st.timed_seconds:,.1f} tokens/s for the batch, "
          f"{st.timed_seconds / st.timed_steps * 1e3:.3f} ms/step{note}")
    for rid, toks in tokens.items():
        n, dt = st.row_steps.get(rid, 0), st.row_seconds.get(rid, 0.0)
        rate = f"{n / dt:,.1f} tokens/s over {n} timed steps" if n and dt > 0 else "no timed steps"
        print(f"  row {rid}: {len(rows[rid])} prompt + {len(toks)} tokens ({reasons[rid]}); decode {rate}"
              f"{note if n else ''}")
