"""Benchmark: batched decoding (:class:`~hss.model.batch.BatchSession`, the KV history in HBM, each batch size's step
replayed as a CUDA graph) of SmolLM2-135M-Instruct at several batch sizes.

    python -m hss.bench batch [--prompt-tokens 2048] [--tokens 256] [--batches 1,16,64] [--model smollm2]
                              [--sampling greedy,sampled] [--kv hbm,sparse,swap] [--budget 16] [--resident 0]
    python -m hss.bench batch --smoke      tiny sizes on the tiny random model (runs on the CPU emulator in CI)

For each batch size B: a BatchSession of B rows, each prefilled with its own ``--prompt-tokens`` random token ids
(greedy, no stop token, ``--tokens`` tokens a row), then decode steps timed with :func:`hss.bench._timer.host_us`
after the step's eager first run and its capture: every timed step decodes one token of all B rows (none leaves
while timed) and waits for them, so host wall time per step is the throughput. Rows: decode tokens/s for the batch
(B / time per step), ms per step, the ratio to batch 1's tokens/s; the note gives the prefill's time.

The model: ``--model smollm2`` (default) is SmolLM2-135M-Instruct's GGUF from hss's cache (``python -m hss fetch``
puts it there; never fetched here: when it is missing the suite says so and skips); ``random-smollm2`` is SmolLM2's
shapes with random weights (no file); ``random`` the demo's tiny random model; anything else a model path
(:func:`hss.checkpoint.load_model`).

``--kv``: ``hbm`` (default), ``sparse`` (the device sparse step: ``--budget`` pages + the first 1 / last 4 a
layer, the predictor calibrated once from the first prompt's keys, per-head scores with temperature sqrt(head_dim):
the demo's setting) and/or ``swap`` (the exact swap: every row's complete pages but ``--resident`` (all layers) streamed
from pinned host memory each step), each measured in the same run. The swap rows also give the bytes streamed per step
(averaged over the timed steps and their warm-up), the pinned H2D bandwidth measured in the same run (one copy of up
to 256 MiB from a pinned buffer, timed with events, the best of three) and the floor they set: streamed bytes / that
bandwidth, and the step's time as a multiple of it. ``--sampling``: ``greedy`` (default; ``model_argmax`` ends the
step), ``sampled`` (every row draws with :data:`SAMPLED`, its own seed: the sampler's launch ends the step) and/or
``staged`` (as ``sampled``, the sampler keeping the penalised keys in shared memory where they fit:
``Sampler(stage=None)``, whatever :data:`hss.model.sample.SESSION_STAGE` says), each batch size measured in each, in
the same run.

Targets (printed): batch 16 >= 8x batch 1, batch 64 >= 20x batch 1 (decode tokens/s, greedy); with greedy and
sampled (or staged) rows, a sampled (staged) batch-1 step within 5 % of a greedy one; the swap's batch-16 step within
1.3x its H2D floor (greedy).
"""
from __future__ import annotations

import argparse
import os
import time
from typing import Any

import numpy as np

SMOKE = dict(model="random", prompt_tokens=40, tokens=8, batches="1,2", sampling="greedy,sampled",
             kv="hbm,sparse,swap", budget=1)
TARGETS = ((16, 8.0), (64, 20.0))   # (batch, at least this many times batch 1's decode tokens/s)
TIMED_BATCHES = 3                   # host_us batches of steps: the median of their µs per step
SAMPLING_COST = 0.05                # a sampled batch-1 step within this fraction of a greedy one
SWAP_FLOOR = (16, 1.3)              # (batch, the swap step within this multiple of its H2D floor)
SAMPLINGS = ("greedy", "sampled", "staged")
KV_MODES = ("hbm", "sparse", "swap")


def _sampled(seed: int) -> Any:
    """:data:`SAMPLED`'s parameters with a row's own seed."""
    from hss.model.sample import SamplingParams
    return SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, repetition_penalty=1.1, seed=seed)


#: the sampled rows' parameters (llama.cpp's defaults: temperature 0.8, top-k 40, top-p 0.95, min-p 0.05, repeat
#: penalty 1.1); each row its own seed
SAMPLED = "temperature 0.8, top-k 40, top-p 0.95, min-p 0.05, repetition penalty 1.1"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m hss.bench batch", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2", help="smollm2 (the cached GGUF, default), random-smollm2 "
                   "(SmolLM2's shapes, random weights), random (the demo's tiny random model) or a model path")
    p.add_argument("--prompt-tokens", type=int, default=2048, help="prompt tokens per row")
    p.add_argument("--tokens", type=int, default=256, help="tokens generated per row (the first from its prefill)")
    p.add_argument("--batches", default="1,16,64", help="comma-separated batch sizes")
    p.add_argument("--graph", action=argparse.BooleanOptionalAction, default=True,
                   help="replay each step as a CUDA graph (default)")
    p.add_argument("--sampling", default="greedy", help="comma-separated: greedy (model_argmax), sampled "
                   f"({SAMPLED}; each row its own seed) and/or staged (sampled, the keys staged in shared memory)")
    p.add_argument("--kv", default="hbm", help="comma-separated: hbm, sparse (the device sparse step) and/or swap "
                   "(the exact swap)")
    p.add_argument("--budget", type=int, default=16, help="sparse: pages attended a layer besides the first 1 / last 4")
    p.add_argument("--resident", type=int, default=0, help="swap: pages a row keeps in HBM, all layers (default 0: "
                   "every complete page streamed each step)")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts and of the random models")
    p.add_argument("--smoke", action="store_true", help="tiny sizes: a code-path check")
    args = p.parse_args(argv)
    if args.smoke:
        for key, value in SMOKE.items():
            setattr(args, key, value)
    try:
        args.batch_list = sorted({int(b) for b in args.batches.split(",")})
    except ValueError:
        p.error(f"--batches {args.batches!r}: comma-separated positive integers, e.g. 1,16,64")
    args.sampling_list = [m.strip() for m in args.sampling.split(",") if m.strip()]
    bad = [m for m in args.sampling_list if m not in SAMPLINGS]
    if bad or not args.sampling_list:
        p.error(f"--sampling {args.sampling!r}: comma-separated, each one of {', '.join(SAMPLINGS)}")
    args.sampling_list = list(dict.fromkeys(args.sampling_list))
    args.kv_list = list(dict.fromkeys(m.strip() for m in args.kv.split(",") if m.strip()))
    if not args.kv_list or any(m not in KV_MODES for m in args.kv_list):
        p.error(f"--kv {args.kv!r}: comma-separated, each one of {', '.join(KV_MODES)}")
    if args.budget < 0:
        p.error(f"--budget {args.budget}: at least 0")
    if args.resident < 0:
        p.error(f"--resident {args.resident}: at least 0")
    if not args.batch_list or args.batch_list[0] < 1:
        p.error(f"--batches {args.batches!r}: batch sizes must be >= 1")
    if args.prompt_tokens < 1:
        p.error(f"--prompt-tokens {args.prompt_tokens}: at least 1")
    warmup = 2 if args.graph else 1
    if args.tokens < warmup + 3:
        p.error(f"--tokens {args.tokens}: at least {warmup + 3} (the first token is the prefill's, then {warmup} "
                "untimed step(s), a timed one, and the last step, where the rows leave)")
    return args


def _weights(args: argparse.Namespace) -> tuple[Any, str, str | None]:
    """(weights or None, the model's label, why it is skipped or None)."""
    if args.model == "random":
        from hss.demo.model import random_model
        return random_model(args.seed), "random (tiny)", None
    if args.model == "random-smollm2":
        from hss.checkpoint.model import SMOLLM2_135M, random_weights
        return random_weights(SMOLLM2_135M, args.seed), "random-smollm2", None
    from hss.checkpoint import load_model
    if args.model == "smollm2":
        from hss.checkpoint.fetch import locate_default_gguf
        path, reasons = locate_default_gguf()
        if path is None:
            return None, "SmolLM2-135M", (f"SmolLM2-135M-Instruct's GGUF is not on this machine ({'; '.join(reasons)}):"
                                          " python -m hss fetch puts it in hss's cache, or --model random-smollm2 "
                                          "runs its shapes with random weights")
        return load_model(path).weights, "SmolLM2-135M", None
    return load_model(args.model).weights, os.path.basename(args.model.rstrip("/")), None


def run(args: argparse.Namespace) -> list[dict]:
    if args.smoke:
        os.environ.setdefault("HSS_DRIVER", "emulator")
    from hss import cuda_min as cm
    from hss.errors import HssError
    from hss.model.session import DeviceModel

    weights, label, skip = _weights(args)
    if skip is not None:
        print(f"batch: skipped: {skip}", flush=True)
        return [dict(model=label, batch=None, tokens_s=None, ms=None, ratio=None, note=f"skipped: {skip}")]
    c = weights.config
    if args.prompt_tokens + args.tokens + 1 > c.context_length:
        raise HssError(f"{args.prompt_tokens} prompt + {args.tokens} tokens exceed the model's context length "
                       f"{c.context_length}")
    emulated = cm.driver_status().kind == "emulator"
    rows: list[dict] = []
    with cm.CudaCtx(0) as ctx, DeviceModel(weights, ctx) as model:
        h2d = _h2d_gbps(ctx, (1 << 20) if emulated else (256 << 20)) if "swap" in args.kv_list else None
        for kv in args.kv_list:
            opts = (_sparse_options(args, model) if kv == "sparse" else {"resident": args.resident} if kv == "swap"
                    else {})
            for mode in args.sampling_list:
                for b in args.batch_list:
                    rows.append(_measure(args, model, b, label, emulated, mode, kv, opts, h2d))
    for kv in args.kv_list:
        for mode in args.sampling_list:
            base = next((r for r in rows if r["batch"] == 1 and r["sampling"] == mode and r["kv"] == kv), None)
            for r in rows:
                if r["sampling"] == mode and r["kv"] == kv:
                    r["ratio"] = r["tokens_s"] / base["tokens_s"] if base else None
    rows += _targets(rows, label)
    return rows


def _h2d_gbps(ctx: Any, nbytes: int) -> float:
    """GB/s of one ``nbytes`` host-to-device copy from a pinned buffer (CUDA events, the best of three)."""
    from hss import cuda_min as cm
    from hss.bench._timer import gpu_us
    s = ctx.stream
    with cm.PinnedBuffer(nbytes, ctx) as host, cm.DeviceBuffer(nbytes, ctx) as dev:
        host.array[:] = 1
        t = gpu_us(s, lambda: cm.copy_h_to_d_async(dev, host, nbytes, s), batches=3, warmup=1)
    return nbytes / (min(t.samples) * 1e-6) / 1e9


def _prompts(args: argparse.Namespace, vocab: int, b: int) -> np.ndarray:
    return np.random.default_rng(args.seed + b).integers(0, vocab, (b, args.prompt_tokens), dtype=np.int32)


def _sparse_options(args: argparse.Namespace, model: Any) -> dict[str, Any]:
    """The sparse mode's BatchSession options (see the module's docstring): the projection calibrated from the keys
    of batch 1's prompt, prefilled in hbm mode."""
    import math

    from hss.predictor.calibrate import calibrate_projection
    c = model.config
    ids = _prompts(args, c.vocab_size, 1)[0]
    rank = min(32, c.head_dim, ids.size)   # the demo's rank where the head and the prompt allow it
    with model.session("hbm", max_tokens=ids.size + 1) as sess:
        sess.prefill(ids)
        keys = sess.kv.read_keys(sess.stream, ids.size)
    return dict(budget=args.budget, keep_first=1, keep_recent=4, rank=rank,
                projection=calibrate_projection(keys, rank), head_temperature=math.sqrt(c.head_dim))


def _measure(args: argparse.Namespace, model: Any, b: int, label: str, emulated: bool, mode: str = "greedy",
             kv: str = "hbm", opts: dict[str, Any] | None = None, h2d: float | None = None) -> dict:
    """One batch size in one KV mode and sampling mode: B rows prefilled, then the timed steps (see the module's
    docstring). ``h2d``: the pinned H2D bandwidth (GB/s) for the swap's floor."""
    from hss.model import sample

    prompts = _prompts(args, model.config.vocab_size, b)
    stage = sample.SESSION_STAGE
    if mode == "staged":
        sample.SESSION_STAGE = None
    try:
        return _timed(args, model, b, label, emulated, mode, kv, opts, h2d, prompts)
    finally:
        sample.SESSION_STAGE = stage


def _timed(args: argparse.Namespace, model: Any, b: int, label: str, emulated: bool, mode: str, kv: str,
           opts: dict[str, Any] | None, h2d: float | None, prompts: np.ndarray) -> dict:
    from hss.bench._timer import host_us
    from hss.model.batch import BatchSession

    p, n = args.prompt_tokens, args.tokens
    with BatchSession(model, kv, max_batch=b, max_tokens=p + n + 1, graph=args.graph, batch_sizes=(b,),
                      **(opts or {})) as sess:
        t0 = time.perf_counter()
        for i, ids in enumerate(prompts):
            sess.add(ids, max_new=n, sampling=None if mode == "greedy" else _sampled(args.seed + i))
        prefill_s = time.perf_counter() - t0
        warmup = 2 if args.graph else 1   # the eager first step (and the capture with the second)
        steps = n - 2 - warmup   # the rows leave at the step that makes their n-th token: it is never timed
        per, count = max(1, steps // TIMED_BATCHES), min(TIMED_BATCHES, steps)
        counts = dict(getattr(sess.kv, "counts", {}))
        t = host_us({"step": sess.step}, batch=per, batches=count, warmup=warmup)["step"]
        if kv == "swap":   # the bytes the steps streamed, per step
            done = {k: v - counts[k] for k, v in sess.kv.counts.items()}
            streamed = done["bytes_read"] / max(done["steps"], 1)
        sampler = getattr(sess, "sampler", None)
        stage = None if sampler is None else sampler.stage
        if len(sess.rows) != b or (args.graph and sess.graph_sizes != (b,)):   # the timing would mean another thing
            raise RuntimeError(f"batch {b}: {len(sess.rows)} rows live, graphs of sizes {sess.graph_sizes} after "
                               "the timed steps")
    ms = t.us / 1e3
    how = "graph replay" if args.graph else "eager"
    note = (f"prompts {b} x {p} tokens prefilled in {prefill_s:.2f} s; {how}, host wall time per step (median of "
            f"{count} x {per} steps)")
    out = dict(model=label, batch=b, kv=kv, sampling=mode, tokens_s=b / (ms * 1e-3), ms=ms, ratio=None)
    if stage is not None:
        note += f"; sampler stage={stage}"
    if kv == "sparse":
        note += f"; sparse: budget {opts['budget']} + first 1 / last 4 pages a layer"
    if kv == "swap":
        floor = streamed / (h2d * 1e9) * 1e3 if h2d else None
        out.update(streamed=streamed, floor_ms=floor, floor_ratio=ms / floor if floor else None)
        note += (f"; swap: {opts['resident']} resident pages a row (all layers), {streamed / 1e6:.3f} MB streamed a "
                 f"step, pinned H2D {h2d:.1f} GB/s")
        note += (f", H2D floor {floor:.3f} ms a step = {ms / floor:.2f}x" if floor else
                 ", no H2D floor (nothing streamed)")
    if emulated:
        note += " (emulator: not a hardware measurement)"
    return {**out, "note": note}


def _targets(rows: list[dict], label: str) -> list[dict]:
    hbm = [r for r in rows if r.get("kv", "hbm") == "hbm"]
    by_batch = {r["batch"]: r for r in hbm if r.get("sampling", "greedy") == "greedy"}
    out = []
    for batch, times in TARGETS:
        name = f"target: batch {batch} >= {times:g}x batch 1"
        if batch in by_batch and 1 in by_batch:
            ratio = by_batch[batch]["ratio"]
            verdict = f"{ratio:.2f}x: {'met' if ratio >= times else 'not met'}"
        else:
            ratio, verdict = None, f"not run (needs batches 1 and {batch})"
        out.append(dict(model=label, batch=batch, kv="hbm", sampling="greedy", tokens_s=None, ms=None, ratio=ratio,
                        variant=name, note=verdict))
    greedy = by_batch.get(1)
    modes = ["sampled"] + (["staged"] if any(r.get("sampling") == "staged" for r in hbm) else [])
    for mode in modes:
        sampled = next((r for r in hbm if r["batch"] == 1 and r.get("sampling") == mode), None)
        name = f"target: {mode} batch-1 step <= {1 + SAMPLING_COST:g}x greedy"
        if greedy and sampled:
            cost = sampled["ms"] / greedy["ms"]
            verdict = f"{cost:.3f}x: {'met' if cost <= 1 + SAMPLING_COST else 'not met'}"
            ms = sampled["ms"]
        else:
            cost, ms, verdict = None, None, f"not run (needs batch 1 with --sampling greedy,{mode})"
        out.append(dict(model=label, batch=1, kv="hbm", sampling=mode, tokens_s=None, ms=ms, ratio=cost,
                        variant=name, note=verdict))
    batch, times = SWAP_FLOOR
    name = f"target: swap batch {batch} within {times:g}x its H2D floor"
    swap = next((r for r in rows if r.get("kv") == "swap" and r["batch"] == batch
                 and r.get("sampling", "greedy") == "greedy"), None)
    ratio = None if swap is None else swap.get("floor_ratio")
    if ratio is not None:
        verdict = (f"{ratio:.2f}x ({swap['ms']:.3f} ms a step, floor {swap['floor_ms']:.3f} ms): "
                   f"{'met' if ratio <= times else 'not met'}")
    else:
        verdict = (f"not run (needs --kv swap with batch {batch}, greedy)" if swap is None else
                   "not run (the steps streamed nothing: lower --resident)")
    out.append(dict(model=label, batch=batch, kv="swap", sampling="greedy", tokens_s=None,
                    ms=None if swap is None else swap["ms"], ratio=ratio, variant=name, note=verdict))
    return out


def table(rows: list[dict]) -> str:
    def num(value: float | None, fmt: str) -> str:
        return "" if value is None else format(value, fmt)
    lines = ["| model | batch | kv | sampling | decode tokens/s | ms/step | x batch 1 | note |",
             "|---|---:|---|---|---:|---:|---:|---|"]
    for r in rows:
        batch = r.get("variant") or ("" if r["batch"] is None else str(r["batch"]))
        lines.append(f"| {r['model']} | {batch} | {r.get('kv', '')} | {r.get('sampling', '')} | "
                     f"{num(r['tokens_s'], ',.1f')} | {num(r['ms'], '.3f')} | "
                     f"{num(r['ratio'], '.2f')} | {r['note']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    print(table(run(args)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
