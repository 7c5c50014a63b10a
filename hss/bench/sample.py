"""Benchmark: the device sampler's ``sample_tokens`` launch (:class:`hss.model.sample.Sampler`) against
``model_argmax`` on the same logits, and PyTorch's usual sampling pipeline.

    python -m hss.bench sample [--vocabs 49152,262144] [--rows 1,16,64] [--dim 576] [--iters 50] [--step-us US]
    python -m hss.bench sample --smoke      tiny sizes, no PyTorch (runs on the CPU emulator in CI)

For each vocabulary size V and row count R: bf16 logits ``[R, V]`` (N(0, 3²): a spread like a small model's), an LM
head ``[V, dim]`` and ``h [R, dim]`` (both launches recompute greedy near ties from them, as the model step does)
and the model state layout of a batch step (positions advance by one per launch). Settings: ``greedy``
(temperature 0), ``top-k/p/min-p`` (temperature 0.8, top-k 40, top-p 0.95, min-p 0.05), ``+ rep 1.1`` (the same
with a repetition penalty of 1.1 over each row's 64-token history: llama.cpp's defaults, the batch bench's sampled
rows) and ``temp 1.0`` (plain temperature 1, the whole vocabulary), each with the Sampler's default ``stage``.
Where the keys fit the device's shared memory, the two filtered settings are timed again with the other ``stage``
(``staged`` rows: the penalised keys kept in shared memory after the first pass; ``unstaged``: recomputed from
the logits at every pass). Columns:

* ``sample µs``: GPU time per ``sample_tokens`` launch (CUDA events around ``--iters`` back-to-back launches queued
  behind a large memset, so the host's issue time is hidden; median of 5 batches);
* ``argmax µs``: ``model_argmax`` over the same logits, timed the same way, and ``× argmax`` = sample / argmax;
* ``torch µs``: on the same logits and stream, ``torch.argmax`` (greedy), softmax + ``torch.topk`` + min-p + cumsum
  top-p + ``torch.multinomial`` (top-k/p/min-p; with a gather / scatter repetition penalty first, as Hugging
  Face's ``RepetitionPenaltyLogitsProcessor``, for ``+ rep 1.1``), softmax + ``torch.multinomial`` (temp 1.0);
  ``× torch`` = sample / torch (skipped with a note when PyTorch or its CUDA is missing, and with ``--no-torch``).
The greedy rows also check that the sampler's tokens are ``model_argmax``'s (a ``CHECK FAILED`` note if not).

The target line: sampling within 5 % of a batch-1 SmolLM2-135M decode step, the top-k/p/min-p launch at V = 49,152,
R = 1 over ``--step-us`` (default 1,000 µs, about SmolLM2's batch-1 step on an H100: an assumption unless given).
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import numpy as np

SETTINGS = {"greedy": {"temperature": 0.0},
            "top-k/p/min-p": {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05},
            "+ rep 1.1": {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05, "repetition_penalty": 1.1},
            "temp 1.0": {"temperature": 1.0}}
TARGET_SETTING, TARGET_VOCAB, TARGET_FRACTION, ASSUMED_STEP_US = "top-k/p/min-p", 49152, 0.05, 1000.0
OTHER_STAGE = ("top-k/p/min-p", "+ rep 1.1")   # timed again with the other stage where the keys fit
HISTORY = 64   # tokens of each row's history
SMOKE = dict(vocabs="3000", rows="1,3", dim=8, iters=2, warmup=1, batches=2)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocabs", default="49152,262144", help="vocabulary sizes V, comma-separated")
    p.add_argument("--rows", default="1,16,64", help="batch rows R, comma-separated")
    p.add_argument("--dim", type=int, default=576, help="the LM head's width (SmolLM2-135M: 576)")
    p.add_argument("--iters", type=int, default=50, help="launches per timed batch")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--batches", type=int, default=5, help="timed batches (the median is reported)")
    p.add_argument("--step-us", type=float, default=None,
                   help=f"the batch-1 decode step's time in µs for the target (default: {ASSUMED_STEP_US:g}, assumed)")
    p.add_argument("--no-torch", action="store_true", help="skip the PyTorch pipeline")
    p.add_argument("--smoke", action="store_true", help="tiny sizes and no PyTorch: an import/launch check")
    args = p.parse_args(argv)
    if args.smoke:
        for key, value in SMOKE.items():
            setattr(args, key, value)
        args.no_torch = True
    return args


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


class _Case:
    """One (V, R) case on the device: logits, h, LM head, a state for each launch, a Sampler and the argmax."""

    def __init__(self, gpu: Any, stream: int, vocab: int, rows: int, dim: int, rng: np.random.Generator) -> None:
        import ml_dtypes

        from hss import cuda_min as cm
        from hss.cuda._context import shared_optin
        from hss.cuda.gpu import launcher
        from hss.decls import model as km
        from hss.decls.sample import stage_fits
        from hss.model.sample import Sampler
        bf16 = ml_dtypes.bfloat16
        self.cm, self.stream, self.vocab, self.rows = cm, stream, vocab, rows
        self.owned: list[Any] = []
        self.logits = (rng.standard_normal((rows, vocab), dtype=np.float32) * 3).astype(bf16)
        self.h = rng.standard_normal((rows, dim), dtype=np.float32).astype(bf16)
        weight = (rng.standard_normal((vocab, dim), dtype=np.float32) * 0.05).astype(bf16)
        self.logits_dev, h_dev, w_dev = self.dev(self.logits), self.dev(self.h), self.dev(weight)
        state = np.zeros((km.STATE_WORDS, rows), np.int32)
        state[2] = 1
        self.states = {name: self.dev(state) for name in ("sample", "argmax")}
        self.history = rng.integers(0, vocab, (rows, HISTORY)).astype(np.int32)
        self.samplers = {"default": Sampler(gpu, rows, vocab, history=HISTORY)}
        self.owned.append(self.samplers["default"])
        other = not self.samplers["default"].stage
        self.other = None   # the other stage's row label, where it runs
        if not other or stage_fits(vocab, shared_optin(gpu.ctx)):
            self.samplers["other"] = Sampler(gpu, rows, vocab, history=HISTORY, stage=other)
            self.owned.append(self.samplers["other"])
            self.other = "staged" if other else "unstaged"
        self._sample = {}
        for which, sampler in self.samplers.items():
            for r in range(rows):   # a history to read (penalised by the + rep setting only)
                sampler.reset(r, 1000 + r, stream, prompt=self.history[r])
            _, self._sample[which] = sampler.op(self.logits_dev.ptr, state=self.states["sample"].ptr, m=rows,
                                                 h=h_dev.ptr, weight=w_dev.ptr, dim=dim, state_stride=rows,
                                                 advance=1)
        geom = km.argmax_geometry(rows)
        pack = km.MODEL_ARGMAX.pack(logits=self.logits_dev.ptr, h=h_dev.ptr, weight=w_dev.ptr, vocab=vocab, dim=dim,
                                    state=self.states["argmax"].ptr, advance=1, m=rows, state_stride=rows, rows=0)
        run = launcher(gpu, gpu.kernel(km.MODULE, km.MODEL_ARGMAX.name), geom.block, geom.shared, pack)
        grid = geom.grid
        self._argmax = lambda s, _pack=pack: run(s, *grid)

    def dev(self, arr: np.ndarray) -> Any:
        buf = self.cm.DeviceBuffer(max(arr.nbytes, 1))
        self.owned.append(buf)
        self.cm.copy_h_to_d_async(buf, np.ascontiguousarray(arr), arr.nbytes, self.stream)
        return buf

    def set(self, params: dict) -> None:
        for sampler in self.samplers.values():
            for r in range(self.rows):
                sampler.set_params(r, self.stream, **params)

    def sample(self, which: str = "default") -> None:
        """One launch of the sampler with the default ``stage`` ("default") or the other one ("other")."""
        self._sample[which](self.stream)

    def argmax(self) -> None:
        self._argmax(self.stream)

    def tokens(self, which: str) -> np.ndarray:
        got = np.empty(self.rows, np.int32)
        self.cm.copy_d_to_h_async(got, self.states[which], got.nbytes, self.stream)
        self.cm.stream_sync(self.stream)
        return got

    def close(self) -> None:
        for obj in reversed(self.owned):
            obj.close()


def _gpu(stream: int, fn: Any, args: argparse.Namespace, flush: Any) -> float:
    from hss.bench._timer import gpu_us
    return gpu_us(stream, fn, batch=args.iters, batches=args.batches, warmup=args.warmup, prepare=flush).us


def run(args: argparse.Namespace) -> list[dict]:
    """Every (V, R) case and setting; one dict per row."""
    if args.smoke:
        os.environ.setdefault("HSS_DRIVER", "emulator")
    from hss import cuda_min as cm
    from hss.bench._timer import Flush
    from hss.cuda.gpu import CudaBackend

    ctx = cm.CudaCtx(0)
    stream = ctx.stream
    gpu = CudaBackend(ctx)
    flush = Flush(stream, 4 << 20 if args.smoke else 256 << 20)
    torch_why = "skipped (--no-torch)" if args.no_torch else _torch_missing()
    rows: list[dict] = []
    rng = np.random.default_rng(0)
    try:
        for vocab in _ints(args.vocabs):
            for r in _ints(args.rows):
                rows += _case(gpu, stream, vocab, r, args, rng, flush, torch_why)
    finally:
        flush.close()
        gpu.close()
        ctx.close()
    return rows


def _case(gpu: Any, stream: int, vocab: int, r: int, args: argparse.Namespace, rng: np.random.Generator,
          flush: Any, torch_why: str | None) -> list[dict]:
    base = dict(vocab=vocab, rows=r, step_us=args.step_us)   # step_us: for the target line
    try:
        c = _Case(gpu, stream, vocab, r, args.dim, rng)
    except Exception as exc:   # e.g. out of device memory: the row says why
        return [dict(base, setting="—", note=f"skipped: {type(exc).__name__}: {exc}")]
    out = []
    try:
        argmax_us = _gpu(stream, c.argmax, args, flush)
        torch_data = _torch_logits(c) if torch_why is None else None
        for name, params in SETTINGS.items():
            c.set(params)
            row = dict(base, setting=name, sample_us=_gpu(stream, c.sample, args, flush), argmax_us=argmax_us,
                       note="")
            got = c.tokens("sample")
            if name == "greedy" and not np.array_equal(got, c.tokens("argmax")):
                row["note"] = "CHECK FAILED: greedy tokens differ from model_argmax's"
            elif ((got < 0) | (got >= vocab)).any():
                row["note"] = "CHECK FAILED: a token outside the vocabulary"
            if torch_data is not None:
                row["torch_us"] = _gpu(stream, _torch_pipeline(torch_data, params, stream), args, flush)
            else:
                row["note"] = "; ".join(x for x in (row["note"], f"torch {torch_why}") if x)
            out.append(row)
            if c.other and name in OTHER_STAGE:
                out.append(dict(base, setting=f"{name}, {c.other}", argmax_us=argmax_us,
                                note=f"stage={c.other == 'staged'}",
                                sample_us=_gpu(stream, lambda: c.sample("other"), args, flush)))
    finally:
        c.close()
    return out


# -- PyTorch's usual pipeline --------------------------------------------------------------------------------
def _torch_missing() -> str | None:
    """None when PyTorch with CUDA is here, else why not."""
    try:
        import torch
    except ImportError:
        return "skipped (PyTorch is not installed)"
    return None if torch.cuda.is_available() else "skipped (PyTorch has no CUDA device)"


def _torch_logits(c: _Case) -> Any:
    """(logits, history) as CUDA tensors."""
    import torch
    logits = torch.from_numpy(np.ascontiguousarray(c.logits).view(np.int16)).view(torch.bfloat16).cuda()
    return logits, torch.from_numpy(c.history.astype(np.int64)).cuda()


def _torch_pipeline(data: Any, params: dict, stream: int) -> Any:
    """One sampling call on ``stream`` as a PyTorch serving loop writes it for ``params``."""
    import torch
    logits, history = data
    ext = torch.cuda.ExternalStream(stream)
    temp = params["temperature"]
    gen = torch.Generator(device=logits.device)
    gen.manual_seed(0)

    def greedy() -> Any:
        return torch.argmax(logits, dim=-1)

    def plain() -> Any:
        probs = torch.softmax(logits.float() / temp, dim=-1)
        return torch.multinomial(probs, 1, generator=gen)

    def filtered() -> Any:
        x = logits.float()
        if "repetition_penalty" in params:   # Hugging Face's RepetitionPenaltyLogitsProcessor
            score = torch.gather(x, 1, history)
            rp = params["repetition_penalty"]
            x = x.scatter(1, history, torch.where(score < 0, score * rp, score / rp))
        probs = torch.softmax(x / temp, dim=-1)
        top, idx = torch.topk(probs, params["top_k"], dim=-1)
        top = top.masked_fill(top < params["min_p"] * top[:, :1], 0.0)
        cum = torch.cumsum(top, dim=-1)
        top = top.masked_fill(cum - top > params["top_p"] * cum[:, -1:], 0.0)   # keep the prefix reaching top_p
        return idx.gather(-1, torch.multinomial(top, 1, generator=gen))

    fn = greedy if temp == 0 else filtered if "top_k" in params else plain

    def call() -> None:
        with torch.cuda.stream(ext):
            fn()
    return call


# -- the table ------------------------------------------------------------------------------------------------
def _f(v: Any, fmt: str = ".1f") -> str:
    return "—" if v is None else format(v, fmt)


def target_line(rows: list[dict]) -> str:
    """The target: the top-k/p/min-p launch at V = 49,152, R = 1 within 5 % of a batch-1 decode step (the rows'
    ``step_us``, from ``--step-us``; None: :data:`ASSUMED_STEP_US`)."""
    step_us = next((r["step_us"] for r in rows if r.get("step_us") is not None), None)
    step = ASSUMED_STEP_US if step_us is None else step_us
    where = "assumed: pass --step-us to give the measured step" if step_us is None else "given by --step-us"
    head = (f"- target: sampling <= {TARGET_FRACTION * 100:g} % of a batch-1 SmolLM2 decode step ({step:,.0f} µs, "
            f"{where}): the {TARGET_SETTING} launch at V = {TARGET_VOCAB:,}, R = 1")
    timed = [r for r in rows if r.get("setting") == TARGET_SETTING and r["rows"] == 1 and "sample_us" in r]
    if not timed:
        return f"{head}: not measured (no R = 1 row)"
    exact = [r for r in timed if r["vocab"] == TARGET_VOCAB]
    r = exact[0] if exact else min(timed, key=lambda x: x["vocab"])
    stand_in = "" if exact else f" (measured at V = {r['vocab']:,} instead)"
    ratio = r["sample_us"] / step
    verdict = "met" if ratio <= TARGET_FRACTION else "NOT met"
    return f"{head}{stand_in}: {r['sample_us']:.1f} µs = {ratio * 100:.1f} % of the step: {verdict}"


def table(rows: list[dict]) -> str:
    out = ["| V | R | setting | sample µs | argmax µs | × argmax | torch µs | × torch | note |",
           "|---:|---:|---|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        s, a, t = r.get("sample_us"), r.get("argmax_us"), r.get("torch_us")
        out.append(f"| {r['vocab']:,} | {r['rows']} | {r['setting']} | {_f(s)} | {_f(a)} | "
                   f"{_f(s / a if s and a else None, '.2f')} | {_f(t)} | {_f(s / t if s and t else None, '.2f')} | "
                   f"{r.get('note', '')} |")
    out += ["", target_line(rows)]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rows = run(args)
    from hss.cuda_min import driver_status
    print(f"driver: {driver_status().message}")
    print(f"bf16 logits N(0, 3²), LM head width {args.dim}; GPU time per launch over batches of {args.iters}")
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
