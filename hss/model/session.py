"""A decoder on the device (:class:`DeviceModel`) and one sequence decoded on it (:class:`Session`): prefill,
decode steps (greedy, or drawn by the device sampler; eager, or replayed as CUDA graphs), teacher forcing, per-stage
timing.

A decode step is a program of prepared operations (:mod:`hss.model.forward`) with the KV mode's attention between
them. In the ``hbm`` and exact ``swap`` modes the attention is capturable, so the whole step (every layer, the LM
head and the argmax or sampler launch that feeds the next step) is one CUDA graph (the swap's copy stream forks from
and joins back into it); so is the ``sparse`` mode's device step (the default; with ``device_step=False`` the host
step waits for the predictor's scores, so each stretch between two attentions is a graph, the attentions eager). A
KV mode's ``graph_epoch`` changes when its step's work does (the swap: a page completed, every ``block_size`` tokens);
the step is then captured again before its next replay. Tokens are copied to pinned memory behind each step and read
by the host a few steps later (:meth:`Session.generate`), so the host never stalls the device to print.
"""
from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from hss import cuda_min as cm
from hss._util import Closeable
from hss.checkpoint import Weights
from hss.cuda.gpu import CudaBackend
from hss.decls import model as km
from hss.errors import HssError
from hss.model import sample as _sample
from hss.model.forward import Forward, Op
from hss.model.kv import HbmKV, SwapKV
from hss.model.sample import GREEDY, Sampler, SamplingParams
from hss.model.staged import RING
from hss.model.weights import BF16, DeviceWeights

__all__ = ["DeviceModel", "Session", "StageTimer", "KV_MODES"]

KV_MODES = ("hbm", "swap", "sparse")
AHEAD = 8   # decode steps queued ahead of the host's token reads


class DeviceModel(Closeable):
    """``weights`` on the device: bf16 matrices uploaded once (:class:`~hss.model.weights.DeviceWeights`), the
    ``model`` kernels and a cuBLAS handle (:class:`~hss.cuda.gpu.CudaBackend`). ``ctx``: a CudaCtx (None: a new one on
    ``device``, closed with this model). :meth:`session` starts a sequence."""

    def __init__(self, weights: Weights, ctx: cm.CudaCtx | None = None, device: int = 0) -> None:
        if ctx is not None and not isinstance(ctx, cm.CudaCtx):
            raise TypeError(f"ctx must be a CudaCtx or None, got {type(ctx).__name__}")
        self._owned = contextlib.ExitStack()
        try:
            self.ctx = ctx if ctx is not None else self._owned.enter_context(cm.CudaCtx(device))
            self.weights = self._owned.enter_context(DeviceWeights(weights, self.ctx.stream, self.ctx))
            self.config = self.weights.config
            self.gpu = self._owned.enter_context(CudaBackend(self.ctx))
        except BaseException:
            self._owned.close()
            raise

    def session(self, kv: str = "hbm", **options: Any) -> Session:
        """A :class:`Session` on this model (see its options)."""
        return Session(self, kv, **options)

    def close(self) -> None:
        self._owned.close()


class StageTimer:
    """Timing events after every operation of the steps it profiles; :meth:`collect` sums the GPU time between
    consecutive marks per stage (waits for the last mark)."""

    def __init__(self) -> None:
        self.ms: dict[str, float] = {}
        self.steps = 0
        self._marks: list[tuple[str, cm.CudaEvent]] = []

    def mark(self, stage: str, stream: int) -> None:
        ev = cm.CudaEvent(timing=True)
        ev.record(stream)
        self._marks.append((stage, ev))

    def collect(self) -> None:
        if not self._marks:
            return
        self._marks[-1][1].synchronize()
        for (_, a), (stage, b) in zip(self._marks, self._marks[1:]):
            if stage != "start":
                self.ms[stage] = self.ms.get(stage, 0.0) + a.elapsed_ms(b)
        for _, ev in self._marks:
            ev.close()
        self._marks.clear()


def _positive(name: str, value: Any, low: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < low:
        raise HssError(f"{name} must be >= {low}, got {value}")
    return int(value)


def prompt_ids(ids: Any, vocab: int, max_tokens: int) -> np.ndarray:
    """A prompt as i32 token ids, checked: a non-empty 1-D sequence of ints in ``[0, vocab)``, shorter than
    ``max_tokens`` (a session's room for the prompt and at least one new token)."""
    arr = np.asarray(ids)
    if arr.ndim != 1 or not arr.size or arr.dtype.kind not in "iu":
        raise HssError(f"ids must be a non-empty 1-D sequence of ints, got shape {arr.shape} dtype {arr.dtype}")
    if arr.min() < 0 or arr.max() >= vocab:
        raise HssError(f"token ids must lie in [0, {vocab}), got [{arr.min()}, {arr.max()}]")
    if arr.size >= max_tokens:
        raise HssError(f"{arr.size} prompt tokens leave no room: max_tokens is {max_tokens}")
    return arr.astype(np.int32)


class Session(Closeable):
    """One sequence on a :class:`DeviceModel`: ``prefill(ids)``, then ``generate(n)`` (or ``step()`` /
    ``feed(token)`` / ``logits()`` for teacher forcing).

    ``kv``: ``"hbm"`` (:class:`~hss.model.kv.HbmKV`), ``"swap"`` (:class:`~hss.model.kv.SwapKV`, exact) or
    ``"sparse"`` (SwapKV with ``budget`` pages). ``max_tokens``: prompt + generated tokens the session may hold
    (at most the model's context length). ``graph``: replay decode steps as CUDA graphs (captured after the first
    eager step). ``prefill_chunk``: prompt rows per forward pass. Swap options: ``resident`` (resident pages, all
    layers; exact swap: the first ``resident // n_layer`` pages of every layer), ``tile`` (sparse: pages per streamed
    tile), ``ring`` (exact swap: staging slots, layers whose copies run ahead), ``rank`` (predictor rank),
    ``budget``, ``keep_first``, ``keep_recent`` (sparse pages), ``projection``, ``head_temperature`` (the swap
    predictor's). ``sampling``: how tokens are drawn (:class:`~hss.model.sample.SamplingParams`; None or a greedy one:
    ``model_argmax``, the greedy token; otherwise :attr:`sampler`'s launch takes its place, in the step and its graph
    and for the prefill's token, with the prompt's tail as the penalties' history; ``seed`` fixes the draws), e.g.
    ``model.session("hbm", max_tokens=512, sampling=SamplingParams(temperature=0.8, top_p=0.95, seed=7))``.
    ``fuse_rope``: where the KV mode can (``hbm``), the decode step's RoPE and cache write run inside
    its attention launch (:meth:`~hss.attention.TileStep.tile_tokens_rope`: the same bits, one launch fewer per
    layer); False keeps the separate ``model_rope_kv``. ``device_step``: the sparse mode's selection, residency and
    reads run on the device (:class:`~hss.swap.device_step.DeviceSparseStep`: the step is capturable, ``resident``
    and ``tile`` unused: each layer keeps ``keep_first + keep_recent + budget`` slots); False: the host sparse step
    (``HighSpeedSwap.attend_layer``, the reference; not capturable).
    Everything is checked before device work; a bad argument raises ``TypeError`` / :class:`HssError`.
    """

    def __init__(self, model: DeviceModel, kv: str = "hbm", *, max_tokens: int, graph: bool = False,
                 prefill_chunk: int = 2048, resident: int = 512, tile: int = 64, ring: int = RING, rank: int = 32,
                 budget: int | None = None, keep_first: int = 1, keep_recent: int = 4,
                 projection: np.ndarray | None = None, head_temperature: float | None = None,
                 fuse_rope: bool = True, device_step: bool = True, sampling: SamplingParams | None = None) -> None:
        if not isinstance(model, DeviceModel):
            raise TypeError(f"model must be a DeviceModel, got {type(model).__name__}")
        if sampling is not None and not isinstance(sampling, SamplingParams):
            raise TypeError(f"sampling must be a SamplingParams or None, got {type(sampling).__name__}")
        if kv not in KV_MODES:
            raise HssError(f"kv must be one of {', '.join(KV_MODES)}, got {kv!r}")
        c = model.config
        self.max_tokens = _positive("max_tokens", max_tokens, 2)
        if self.max_tokens > c.context_length:
            raise HssError(f"max_tokens ({max_tokens}) exceeds the model's context length ({c.context_length})")
        if not isinstance(graph, bool):
            raise TypeError(f"graph must be a bool, got {type(graph).__name__}")
        if not isinstance(fuse_rope, bool):
            raise TypeError(f"fuse_rope must be a bool, got {type(fuse_rope).__name__}")
        chunk = min(_positive("prefill_chunk", prefill_chunk), self.max_tokens, 65535)
        if kv == "sparse":
            if budget is None:
                raise HssError("the sparse KV mode needs budget= (pages attended per layer)")
            _positive("budget", budget)
        elif budget is not None:
            raise HssError(f"budget= is for the sparse KV mode, not {kv!r}")
        if kv != "hbm":
            _positive("resident", resident, 0)
            _positive("tile", tile)
            _positive("ring", ring)
            _positive("rank", rank)
        self.model, self.mode, self.graph, self.fuse_rope = model, kv, graph, fuse_rope
        self.sampling = GREEDY if sampling is None else sampling
        self.sampler: Sampler | None = None   # the device sampler (row 0), made unless the sampling is greedy
        self.config = c
        s = self.stream = model.ctx.stream
        self._stacks: dict[str, contextlib.ExitStack] = {}   # "current" / "next": the graphs of a capture
        self._next: tuple[int, list[tuple[str, Any]]] | None = None   # (epoch, graphs) captured ahead
        self._owned = contextlib.ExitStack()
        own = self._owned.enter_context
        try:
            self.fwd = own(contextlib.closing(Forward(model.gpu, model.weights, chunk, model.ctx)))
            if kv == "hbm":
                self.kv: HbmKV | SwapKV = own(contextlib.closing(HbmKV(model.ctx, c, self.max_tokens, s)))
            else:
                self.kv = own(contextlib.closing(SwapKV(
                    model.ctx, c, self.max_tokens, s, resident=resident, tile=tile, rank=rank, budget=budget,
                    keep_first=keep_first, keep_recent=keep_recent, projection=projection,
                    head_temperature=head_temperature, ring=ring, device_step=device_step)))
            self._owned.callback(self._drop_graphs, "current", "next")
            self._ring = own(cm.PinnedBuffer(4 * AHEAD, model.ctx))
            self._ring_events = [own(cm.CudaEvent(ctx=model.ctx)) for _ in range(AHEAD)]
            if not self.sampling.greedy:
                self.sampler = own(Sampler(model.gpu, 1, c.vocab_size, stage=_sample.SESSION_STAGE, ctx=model.ctx))
                self.sampler.start(0, self.sampling, s)
        except BaseException:
            self._owned.close()
            raise
        self.pos = 0              # host mirror of state.pos: the position the next step writes
        self.prompt_tokens = 0
        self.steps = 0
        self._program: list[tuple[str, Any]] | None = None
        self._graphs: list[tuple[str, Any]] | None = None
        self._graph_epoch = 0
        self.captures = 0             # captures of the decode step so far (the first, ahead, and again)
        self.capture_seconds = 0.0    # host time they took
        self.graph_switches: list[tuple[int, bool]] = []   # (pos, captured ahead) where the replayed graphs changed
        self.prefill_seconds = (0.0, 0.0)   # (forward, KV hand-off) of the last prefill, host wall time
        self.decode_stats: dict[str, Any] = {}

    # -- prefill -------------------------------------------------------------------------------------
    def prefill(self, ids: Sequence[int] | np.ndarray, *, progress: Callable[[int, int], None] | None = None,
                all_logits: bool = False) -> np.ndarray | None:
        """Run the prompt ``ids`` through the model (in chunks of ``prefill_chunk`` rows) and leave its greedy next
        token in the device state; waits for the device. ``progress(done, total)`` is called as layers finish.
        ``all_logits``: return the logits of every prompt row (float32 ``[T, vocab]``; the prompt must fit one
        chunk). With a sampler, that token is its first draw (step 0), the prompt's tail its history."""
        if self.pos:
            raise HssError("prefill of a session that already holds tokens: start a new session")
        ids = prompt_ids(ids, self.config.vocab_size, self.max_tokens)
        t, chunk, fwd, kv, s = ids.size, self.fwd.max_m, self.fwd, self.kv, self.stream
        if all_logits and t > chunk:
            raise HssError(f"all_logits needs the prompt ({t} tokens) in one chunk (prefill_chunk {chunk})")
        t0 = time.perf_counter()
        if self.sampler is not None:
            self.sampler.start(0, self.sampling, s, prompt=ids)
        kv.begin_prefill(s, t)
        events: list[cm.CudaEvent] = []
        for start in range(0, t, chunk):
            m = min(chunk, t - start)
            cm.copy_h_to_d_async(fwd.ids, ids[start:start + m], 4 * m, s)
            cm.copy_h_to_d_async(fwd.state, np.array([0, start, start + 1, 0], np.int32), 4 * km.STATE_WORDS, s)
            self._run(fwd.embed_ops(fwd.ids, m))
            for layer in range(self.config.n_layer):
                k, v, rows = kv.prefill_cache(layer)
                self._run(fwd.pre_ops(layer, m, k, v, rows) + [fwd.prefill_attn_op(m, k, v, start)]
                          + fwd.post_ops(layer, m))
                events.append(cm.CudaEvent(ctx=self.model.ctx))
                events[-1].record(s)
            if start + m == t:
                self._run(fwd.head_ops(m, m, all_rows=all_logits, sampler=self.sampler))
        for i, ev in enumerate(events):
            ev.synchronize()
            if progress is not None:
                progress(i + 1, len(events))
        for ev in events:
            ev.close()
        t1 = self.sync()
        kv.end_prefill(s, t)
        self.prefill_seconds = (t1 - t0, self.sync() - t1)
        self.pos = self.prompt_tokens = t
        if not all_logits:
            return None
        out = np.empty((t, self.config.vocab_size), BF16)
        cm.copy_d_to_h_async(out, fwd.all_logits(), out.nbytes, s)
        cm.stream_sync(s)
        return out.astype(np.float32)

    # -- decode ---------------------------------------------------------------------------------------
    def _build_program(self) -> list[tuple[str, Any]]:
        """The decode step: ("ops", [Op, ...]) stretches and ("host", Op) attentions (swap modes)."""
        fwd, kv, c = self.fwd, self.kv, self.config
        items: list[tuple[str, Any]] = []
        ops: list[Op] = kv.step_begin_ops() + fwd.embed_ops(fwd.state, 1)
        for layer in range(c.n_layer):
            if getattr(kv, "fuses_rope", False) and self.fuse_rope:   # the RoPE inside the attention launch
                ops.append(fwd.qkv_op(layer, 1))
                attend = kv.decode_attention_rope(layer, fwd.qkv, fwd.w.rope_cos, fwd.w.rope_sin, c.context_length,
                                                  fwd.attn, fwd.state + 8)
            else:
                ops += fwd.pre_ops(layer, 1, *kv.decode_cache(layer))
                attend = kv.decode_attention(layer, fwd.q, fwd.attn, fwd.state + 8)   # state.visible: the count
            if kv.capturable:
                ops.append(attend)
            else:
                items += [("ops", ops), ("host", attend)]
                ops = []
            ops += fwd.post_ops(layer, 1)
        items.append(("ops", ops + fwd.head_ops(1, 1, sampler=self.sampler) + kv.step_end_ops()))
        return items

    def _run(self, ops: Iterable[Op], timer: StageTimer | None = None) -> None:
        s = self.stream
        for stage, run in ops:
            run(s)
            if timer is not None:
                timer.mark(stage, s)

    def step(self, timer: StageTimer | None = None) -> None:
        """Queue one decode step: the token in the device state at position ``pos`` in, the next token out (into the
        state; greedy, or the sampler's next draw). ``timer``: profile it (eager only)."""
        if not self.pos:
            raise HssError("decode step before prefill")
        if self.pos >= self.max_tokens:
            raise HssError(f"the session is full: max_tokens is {self.max_tokens}")
        if self._program is None:
            self._program = self._build_program()
        s = self.stream
        if self._graphs is not None and timer is None:
            if self.kv.graph_epoch != self._graph_epoch:   # the step's work changed: its graphs too
                self._next_graphs()
            for kind, item in self._graphs:
                if kind == "graph":
                    item.launch(s)
                else:
                    item[1](s)
        else:
            if timer is not None:
                timer.mark("start", s)
            for kind, item in self._program:
                self._run(item if kind == "ops" else [item], timer)
            if timer is not None:
                timer.steps += 1
        self.kv.after_step(s, self.pos)
        self.pos += 1
        self.steps += 1

    def capture(self) -> None:
        """Capture the decode step's stretches as CUDA graphs (after at least one eager step: cuBLAS and the
        attention's first-use setup must not happen inside a capture); :meth:`step` replays them from then on, and
        captures them again when the KV mode's ``graph_epoch`` changes (unless :meth:`capture_ahead` did)."""
        if not self.steps:
            raise HssError("capture before any eager decode step (run step() once first)")
        self._graphs = None
        self._drop_graphs("current", "next")   # (replays already queued keep theirs: the driver frees them later)
        epoch = self.kv.graph_epoch
        graphs = self._capture_program("current")
        self._graphs, self._graph_epoch = graphs, epoch

    def capture_ahead(self) -> bool:
        """Capture the step of the KV mode's next ``graph_epoch`` now, while the device runs the steps queued (no
        device work; the host's time that :meth:`step` would otherwise spend at the epoch change). False when there
        is nothing to do: no graphs yet, already captured, or a KV mode whose epoch never changes."""
        plan = getattr(self.kv, "next_epoch", None)
        if self._graphs is None or self._next is not None or plan is None:
            return False
        if self.kv.graph_epoch != self._graph_epoch:   # the next step's work changed already: capture it as it is
            self._next = (self.kv.graph_epoch, self._capture_program("next"))
            return True
        ahead = plan()
        if ahead is None:
            return False
        with ahead as epoch:
            graphs = self._capture_program("next")
        self._next = (epoch, graphs)
        return True

    def _next_graphs(self) -> None:
        """The KV mode's epoch changed: replay the graphs captured ahead for it, else capture again."""
        nxt, self._next = self._next, None
        ahead = nxt is not None and nxt[0] == self.kv.graph_epoch
        self.graph_switches.append((self.pos, ahead))
        if not ahead:
            self.capture()
            return
        self._drop_graphs("current")
        self._stacks["current"] = self._stacks.pop("next")
        self._graphs, self._graph_epoch = nxt[1], nxt[0]

    def _capture_program(self, which: str) -> list[tuple[str, Any]]:
        """The program's stretches captured as graphs, owned by ``self._stacks[which]``; counted and timed."""
        t0 = time.perf_counter()
        self._drop_graphs(which)
        stack = self._stacks[which] = contextlib.ExitStack()
        s, graphs = self.stream, []
        for kind, item in self._program:
            if kind == "host":
                graphs.append((kind, item))
                continue
            cm.begin_capture(s)
            try:
                self._run(item)
            except BaseException:
                with contextlib.suppress(Exception):
                    cm.end_capture(s).close()
                self._drop_graphs(which)
                raise
            graphs.append(("graph", stack.enter_context(cm.end_capture(s))))
        self.captures += 1
        self.capture_seconds += time.perf_counter() - t0
        return graphs

    def _drop_graphs(self, *which: str) -> None:
        for w in which:
            stack = self._stacks.pop(w, None)
            if stack is not None:
                if w == "next":
                    self._next = None
                stack.close()

    def _read(self, i: int) -> None:
        """Queue the copy of the state's token (step i's output) into ring slot i % AHEAD."""
        slot = i % AHEAD
        cm.copy_d_to_h_async(self._ring.ptr + 4 * slot, self.fwd.state, 4, self.stream)
        self._ring_events[slot].record(self.stream)

    def _consume(self, i: int) -> int:
        slot = i % AHEAD
        self._ring_events[slot].synchronize()
        return int(self._ring.view(np.int32)[slot])

    def generate(self, n: int, on_token: Callable[[int], None] | None = None, stop: Iterable[int] = (),
                 eager_steps: int = 1, timer: StageTimer | None = None) -> list[int]:
        """Up to ``n`` tokens after the prompt (the first from the prefill; greedy, or drawn as ``sampling`` says),
        ``on_token(id)`` as each arrives;
        stops after a token in ``stop`` (included). The first ``eager_steps`` (>= 1) steps run eagerly (profiled by
        ``timer``); with ``graph`` the rest replay graphs captured after them."""
        n = _positive("n", n, 0)
        eager_steps = _positive("eager_steps", eager_steps)   # >= 1: a capture needs one eager step first
        stop = frozenset(int(t) for t in stop)
        out: list[int] = []
        if not n:
            return out
        done, queued, consumed = False, 1, 0
        timed_from = eager_steps + 1 if n - 1 > eager_steps else 1   # the steps timed: after the eager ones
        start = end = None

        def consume_next() -> None:
            nonlocal done, consumed
            tok = self._consume(consumed)
            consumed += 1
            out.append(tok)
            if on_token is not None:
                on_token(tok)
            done = tok in stop

        self._read(0)
        while queued < n and not done:
            if queued - consumed >= AHEAD:   # the ring is full: read the oldest token first
                self.capture_ahead()         # (host time while the device runs the queued steps)
                consume_next()
                continue
            if self.graph and self._graphs is None and queued > eager_steps:
                self.capture()
            if queued == timed_from:
                start = cm.CudaEvent(timing=True, ctx=self.model.ctx)
                start.record(self.stream)
                self.decode_stats = {"kv0": self.kv.stats(), "steps0": self.steps}
            self.step(timer if queued <= eager_steps else None)
            self._read(queued)
            queued += 1
        if start is not None:
            end = cm.CudaEvent(timing=True, ctx=self.model.ctx)
            end.record(self.stream)
        while consumed < queued and not done:
            consume_next()
        if start is not None:
            end.synchronize()
            self.decode_stats.update(steps=self.steps - self.decode_stats["steps0"],
                                     seconds=start.elapsed_ms(end) * 1e-3, eager_excluded=timed_from > 1)
            start.close()
            end.close()
        if timer is not None:
            timer.collect()
        return out

    # -- teacher forcing ------------------------------------------------------------------------------
    def feed(self, token: int) -> None:
        """Replace the state's next input token by ``token`` (queued; teacher forcing). A sampler's penalty history
        keeps the token it drew, not ``token``."""
        t = _positive("token", token, 0)
        if t >= self.config.vocab_size:
            raise HssError(f"token {t} is outside the vocabulary ({self.config.vocab_size})")
        cm.copy_h_to_d_async(self.fwd.state, np.array([t], np.int32), 4, self.stream)

    def logits(self) -> np.ndarray:
        """The last step's (or the prefill's last row's) logits, float32 ``[vocab]`` (waits for the device)."""
        out = np.empty(self.config.vocab_size, BF16)
        cm.copy_d_to_h_async(out, self.fwd.logits, out.nbytes, self.stream)
        cm.stream_sync(self.stream)
        return out.astype(np.float32)

    def sync(self) -> float:
        """Wait for the device; returns the host time (perf_counter) after the wait."""
        cm.stream_sync(self.stream)
        return time.perf_counter()

    def close(self) -> None:
        """Wait for queued work, then free the session's memory (idempotent)."""
        if self._owned is not None:
            with contextlib.suppress(Exception):
                cm.stream_sync(self.stream)
            owned, self._owned = self._owned, None
            owned.close()
