"""Several sequences decoded together on one :class:`~hss.model.session.DeviceModel` (:class:`BatchSession`): each
row has its own prompt, position, KV pages and stop condition; rows join between steps (``add``) and leave when
they finish (a stop token, their ``max_new`` tokens, ``max_tokens``) or on ``remove``.

A decode step is one program of prepared operations over ``B`` rows, ``B`` the smallest captured batch size that
holds the live rows: the embedding of the rows' tokens, the GEMMs with m = B, per layer the RoPE and KV write at each
row's own position fused into the paged decode attention over each row's own pages (one token-count tile,
:meth:`~hss.attention.TileStep.tile_tokens_rope`; ``fuse_rope=False``: ``model_rope_kv_paged`` then the tile), the
LM head and ``model_argmax`` per row (or, once a row samples, the :class:`~hss.model.sample.Sampler`'s launch with
each row's own parameters and seed), which writes each row's next token into its state and advances its position.
The step reads its shapes from nothing the host writes: the rows' states (i32 ``[STATE_WORDS, max_batch]``,
word-major, see :mod:`hss.decls.model`), their page tables and the live row count live on the device, so each batch
size's step is captured once as a CUDA graph and replayed whatever the rows' lengths. Rows past the live count hold
the idle state (:data:`~hss.decls.model.IDLE_STATE`) that every kernel leaves alone. The KV modes (``hbm``;
``sparse``: the device sparse step over each row's pages in a pinned host store, its newest page in HBM; ``swap``:
the exact swap, every row's complete pages streamed from a pinned host store on a copy stream each step) live in
:mod:`hss.model.batch_kv` and :mod:`hss.model.batch_swap`. The swap's step changes with the rows' page counts: its
``graph_epoch`` says when, and each batch size's graph is captured again (ahead of time, while the device runs the
step before, where the change is known) before its next replay. The rules: docs/design.md §21.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hss import _args
from hss import cuda_min as cm
from hss._util import Closeable
from hss.decls import model as km
from hss.errors import HssError
from hss.model import sample as _sample
from hss.model.batch_kv import BatchHbmKV, BatchSparseKV, sparse_options
from hss.model.batch_swap import BatchSwapKV, swap_options
from hss.model.forward import Forward, Op
from hss.model.sample import GREEDY, Sampler, SamplingParams
from hss.model.session import DeviceModel, prompt_ids
from hss.model.weights import BF16

__all__ = ["BatchSession", "Finished", "BATCH_SIZES"]

BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64)   # the default batch sizes a step is built (and captured) for
_I32 = np.int32


@dataclass(frozen=True)
class Finished:
    """A row that left the batch: its generated ``tokens`` (the first from its prefill) and why it left: ``"stop"``
    (its last token is a stop token), ``"max_new"``, ``"length"`` (its position reached ``max_tokens``) or
    ``"removed"``."""
    tokens: list[int]
    reason: str


@dataclass
class _Row:
    id: int
    lane: int                 # its index in the device arrays (rows are kept in lanes 0 .. live - 1)
    pos: int                  # the position its next step writes (host mirror of its state's pos)
    stop: frozenset[int]
    max_new: int | None
    sampling: SamplingParams
    tokens: list[int] = field(default_factory=list)
    pages: list[int] = field(default_factory=list)   # the KV mode's page ids, position order
    kv_counts: np.ndarray | None = None              # sparse: counters of the lanes it left, int64 [n_layer, 2]


class BatchSession(Closeable):
    """Up to ``max_batch`` sequences on a :class:`~hss.model.session.DeviceModel`, decoded one token per row per
    :meth:`step`; each row decodes what it would alone in a ``Session`` of the same KV mode, options, prompt and
    sampling, wherever the two runs' logits agree (on a GPU cuBLAS may pick another GEMM algorithm for another batch
    size).

    ``kv``: ``"hbm"`` (the KV history in HBM, :class:`~hss.model.batch_kv.BatchHbmKV`), ``"sparse"`` (each row's
    complete pages in one pinned host store, attended through the device sparse step with each row's own selection,
    residency and counters, its newest page in HBM: :class:`~hss.model.batch_kv.BatchSparseKV`, docs/design.md
    §21.7) or ``"swap"`` (the exact swap: each row's complete pages in one pinned host store, streamed into HBM
    every step on a copy stream while the layers run, its newest page in HBM, as a lone ``Session(kv="swap")``:
    :class:`~hss.model.batch_swap.BatchSwapKV`, docs/design.md §21.8).
    ``max_tokens``: prompt + generated tokens a row may hold (at most the model's context length). ``pages``: KV
    pages shared by the rows (hbm: of :data:`~hss.model.kv.HBM_PAGE` tokens in HBM, K and V of every layer for each
    page id; sparse: the swap's disk block ids, swap: the host store's block ids, of
    :func:`~hss.model.kv.swap_block_size` tokens); rows take pages as
    they grow and give them back when they leave, so ragged rows share memory (default ``max_batch * ceil(max_tokens
    / page)``: no row ever waits; fewer oversubscribe, and :meth:`add` / :meth:`step` raise when the pool cannot
    cover them). ``batch_sizes``: the batch sizes a step is built for (``max_batch`` is added; a step of R live rows
    runs the smallest size >= R). ``graph``: replay each batch size's step as a CUDA graph, captured after that
    size's first (eager) step; replays give the eager step's bits. ``prefill_chunk``: prompt rows per forward pass of
    :meth:`add` (its positional scratch caches hold one row of ``max_tokens``). ``fuse_rope``: hbm: the RoPE and KV
    write inside the attention launch (False: ``model_rope_kv_paged`` first; the same bits); the sparse mode always
    runs ``model_rope_kv_paged`` first (the step's scores read the rotated queries).

    Swap options (as ``Session(kv="swap")``'s): ``resident`` (pages a row keeps in HBM, all layers: the first
    ``resident // n_layer`` complete pages of every layer, never streamed; default 512), ``ring`` (staging slots:
    layers whose copies run ahead of the attention; default 3); :meth:`counters` gives each row's pages attended
    from HBM (hits) and streamed (misses).

    Sparse options (as ``Session(kv="sparse")``'s): ``budget`` (pages chosen by score per row and layer, required),
    ``keep_first`` / ``keep_recent`` (pages always attended; default 1 / 4), ``rank`` (the predictor's),
    ``projection`` (a calibrated bf16 ``[n_layer, n_kv_head, head_dim, rank]``; None: the seeded one),
    ``head_temperature`` (per-head normalised scores, docs/design.md §17.5; None: max over heads); :meth:`counters`
    gives each row's hits, misses and bytes read.

    Sampling: ``add(ids, sampling=SamplingParams(temperature=0.8, top_p=0.95, seed=7))`` gives that row its own
    parameters and seed (None: greedy). While every row is greedy the step ends with ``model_argmax``; the first
    row that samples makes :attr:`sampler` (one row per lane; a row's draws follow it when it changes lanes), and
    every step from then on ends with its launch (greedy rows keep ``model_argmax``'s token; each batch size's step
    is built and captured again once). A row's token depends on its seed, step, penalty history and logits only,
    never on its lane or neighbours.

    Integration points: the per-row greedy choice is :meth:`Forward.rows_head_ops
    <hss.model.forward.Forward.rows_head_ops>`'s ``model_argmax`` (logits bf16 ``[max_batch, vocab]`` in
    :attr:`logits_buffer`, the token into each row's state word 0, its position advanced), the op the sampler replaces;
    the KV mode is :attr:`kv` (its ``step_ops`` / ``attention_ops`` / ``step_end_ops`` in the step, ``join`` after a
    prefill, ``before_step`` / ``after_step`` around a step, ``graph_epoch`` / ``next_epoch`` for its graphs).
    Everything is checked before device work; a call that raises ``TypeError`` / :class:`HssError` changes nothing.
    """

    def __init__(self, model: DeviceModel, kv: str = "hbm", *, max_batch: int, max_tokens: int,
                 pages: int | None = None, graph: bool = False, batch_sizes: Iterable[int] = BATCH_SIZES,
                 prefill_chunk: int = 2048, fuse_rope: bool = True, budget: int | None = None, keep_first: int = 1,
                 keep_recent: int = 4, rank: int = 32, projection: np.ndarray | None = None,
                 head_temperature: float | None = None, resident: int | None = None, ring: int | None = None) -> None:
        if not isinstance(model, DeviceModel):
            raise TypeError(f"model must be a DeviceModel, got {type(model).__name__}")
        if kv not in ("hbm", "sparse", "swap"):
            raise HssError(f"kv must be 'hbm', 'sparse' or 'swap', got {kv!r}")
        c = model.config
        self.max_batch = _args.as_int("max_batch", max_batch, 1, 65535, "rows decoded together (grid.y of silu_mul)")
        self.max_tokens = _args.as_int("max_tokens", max_tokens, 2, c.context_length,
                                       "tokens a row may hold, at most the model's context length")
        if pages is not None:
            pages = _args.as_int("pages", pages, 1, 2**31 - 1, "KV pages in the shared pool")
        for name, flag in (("graph", graph), ("fuse_rope", fuse_rope)):
            if type(flag) is not bool:
                raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
        if isinstance(batch_sizes, (str, bytes)) or not isinstance(batch_sizes, Iterable):
            raise TypeError(f"batch_sizes must be an iterable of ints, got {type(batch_sizes).__name__}")
        sizes = {_args.as_int("batch_sizes entry", b, 1, None) for b in batch_sizes}
        sparse = sparse_options(c, kv, self.max_batch, self.max_tokens, pages, budget=budget, keep_first=keep_first,
                                 keep_recent=keep_recent, rank=rank, projection=projection,
                                 head_temperature=head_temperature)
        swap = swap_options(c, kv, self.max_tokens, pages, resident, ring)
        self.batch_sizes = tuple(sorted({b for b in sizes if b < self.max_batch} | {self.max_batch}))
        self.chunk = min(_args.as_int("prefill_chunk", prefill_chunk, 1), self.max_tokens, 65535)
        self.model, self.config, self.graph, self.fuse_rope, self.mode = model, c, graph, fuse_rope, kv
        s = self.stream = model.ctx.stream
        S, ctx = self.max_batch, model.ctx
        self._row_bytes = 2 * c.n_kv_head * c.head_dim            # one token's K (or V) of one layer
        self._owned = contextlib.ExitStack()
        own = self._owned.enter_context
        try:
            self.fwd = own(contextlib.closing(Forward(model.gpu, model.weights, max(self.chunk, S), ctx)))
            buf = lambda n: own(cm.DeviceBuffer(n, ctx))   # noqa: E731
            self.state = buf(4 * km.STATE_WORDS * S)       # word w of row r at w * S + r
            self.live = buf(4)                             # the live row count (model_argmax's rows)
            self._scratch_k, self._scratch_v = (buf(c.n_layer * self.max_tokens * self._row_bytes) for _ in "kv")
            self.logits_buffer = buf(2 * S * c.vocab_size)
            idle = np.repeat(np.array(km.IDLE_STATE, _I32)[:, None], S, axis=1)
            cm.copy_h_to_d_async(self.state, idle, idle.nbytes, s)
            cm.memset_d32_async(self.live, 0, 1, s)
            if sparse is not None:
                self.kv: BatchHbmKV | BatchSparseKV | BatchSwapKV = own(BatchSparseKV(
                    ctx, c, self.fwd, self.state.ptr, self.live, s, max_batch=S, max_tokens=self.max_tokens,
                    pages=pages, **sparse))
            elif swap is not None:
                self.kv = own(BatchSwapKV(ctx, c, self.fwd, self.state.ptr, s, max_batch=S,
                                          max_tokens=self.max_tokens, pages=pages, fuse_rope=fuse_rope, **swap))
            else:
                self.kv = own(BatchHbmKV(ctx, c, self.fwd, self.state.ptr, s, max_batch=S,
                                         max_tokens=self.max_tokens, pages=pages, fuse_rope=fuse_rope))
            self._host_tokens = own(cm.PinnedBuffer(4 * S, ctx))
            self.sampler: Sampler | None = None   # made by the first add() whose sampling is not greedy
            self._graphs: dict[int, tuple[int, cm.CudaGraph]] = {}   # batch size -> (KV epoch, its step's graph)
            self._ahead: dict[int, tuple[int, cm.CudaGraph]] = {}    # ... captured for the next epoch
            self._owned.callback(self._drop_graphs)
        except BaseException:
            self._owned.close()
            raise
        self._rows: dict[int, _Row] = {}
        self._lanes: list[int] = []        # lane -> row id, live rows only
        self._next_row = 0
        self._programs: dict[int, list[Op]] = {}
        self._stepped: set[int] = set()    # batch sizes that ran an eager step (a capture needs one first)
        self.finished: dict[int, Finished] = {}
        self.steps = 0
        self.captures = 0

    # -- rows ------------------------------------------------------------------------------------------
    @property
    def rows(self) -> tuple[int, ...]:
        """The live rows' ids, in lane order."""
        return tuple(self._lanes)

    @property
    def pages(self) -> int:
        """KV pages the rows share (hbm: HBM pages; sparse: the swap's disk block ids; swap: the host store's)."""
        return self.kv.pages

    @property
    def free_pages(self) -> int:
        return self.kv.free_pages

    def tokens(self, row: int) -> list[int]:
        """The tokens ``row`` generated so far (live or finished)."""
        r = self._row_id(row)
        if r in self._rows:
            return list(self._rows[r].tokens)
        if r in self.finished:
            return list(self.finished[r].tokens)
        raise HssError(f"row {r} was never added to this batch")

    def counters(self, row: int) -> dict[str, np.ndarray]:
        """The swap modes' page counters of ``row`` (live or finished) since it joined: ``hits`` / ``misses``
        (complete pages attended from HBM / read from the host store: sparse, the selected pages found in its HBM
        slots; swap, its resident pages and the ones streamed) and ``bytes_read``, int64 ``[n_layer]``; waits for
        the device (sparse). The hbm mode raises :class:`HssError` (it reads no pages)."""
        r = self._row_id(row)
        if r not in self._rows and r not in self.finished:
            raise HssError(f"row {r} was never added to this batch")
        if isinstance(self.kv, BatchHbmKV):
            raise HssError("counters are the swap KV modes' (kv='sparse', kv='swap'); this batch keeps its KV in HBM")
        return self.kv.counters(self._rows.get(r), r)

    def _row_id(self, row: Any) -> int:
        return _args.as_int("row", row, 0, None, "a row id that add() returned")

    def _live_row(self, row: Any) -> _Row:
        r = self._row_id(row)
        if r not in self._rows:
            why = "it finished (see finished)" if r in self.finished else "add() never returned it"
            raise HssError(f"row {r} is not in the batch: {why}")
        return self._rows[r]

    def add(self, ids: Sequence[int] | np.ndarray, *, max_new: int | None = None, stop: Iterable[int] = (),
            sampling: SamplingParams | None = None) -> int:
        """Prefill the prompt ``ids`` as a new row (between steps; waits for the device) and return its id. Its first
        token comes from the prefill; it leaves after a token in ``stop`` (included), after ``max_new`` tokens
        (None: no limit), or when its position reaches ``max_tokens``. ``sampling``: how its tokens are drawn
        (:class:`~hss.model.sample.SamplingParams`, its seed included; None: greedy); the penalties' history starts
        with the prompt's tail."""
        ids = prompt_ids(ids, self.config.vocab_size, self.max_tokens)
        if sampling is not None and not isinstance(sampling, SamplingParams):
            raise TypeError(f"sampling must be a SamplingParams or None, got {type(sampling).__name__}")
        sampling = GREEDY if sampling is None else sampling
        if max_new is not None:
            max_new = _args.as_int("max_new", max_new, 1, None, "tokens to generate, the prefill's first included")
        if isinstance(stop, (str, bytes)) or not isinstance(stop, Iterable):
            raise TypeError(f"stop must be an iterable of token ids, got {type(stop).__name__}")
        stop = frozenset(_args.as_int("stop token", t, 0, self.config.vocab_size - 1) for t in stop)
        if len(self._lanes) >= self.max_batch:
            raise HssError(f"the batch is full ({self.max_batch} rows): step until a row finishes, or remove() one")
        self.kv.check_join(int(ids.size))
        if not sampling.greedy and self.sampler is None:
            self._start_sampling()
        lane, rid = len(self._lanes), self._next_row
        row = _Row(rid, lane, int(ids.size), stop, max_new, sampling)
        self._next_row += 1
        self._rows[rid] = row
        self._lanes.append(rid)
        first = np.empty(1, _I32)
        try:
            if self.sampler is not None:
                self.sampler.start(lane, sampling, self.stream, prompt=ids)
            self._prefill(ids, row)
            self._set_live()
            cm.copy_d_to_h_async(first, self.fwd.state, 4, self.stream)   # pageable: waits
        except BaseException:   # (a driver error) the row was never in the batch
            with contextlib.suppress(Exception):
                self._leave(rid, "failed")
            self.finished.pop(rid, None)
            raise
        self._record(rid, int(first[0]))
        return rid

    def _prefill(self, ids: np.ndarray, row: _Row) -> None:
        """Session.prefill's forward into the positional scratch caches, then the row's KV pages from them (the KV
        mode's ``join``), its state and its logits (queued)."""
        fwd, c, s, t, chunk = self.fwd, self.config, self.stream, ids.size, self.chunk
        for start in range(0, t, chunk):
            m = min(chunk, t - start)
            cm.copy_h_to_d_async(fwd.ids, ids[start:start + m], 4 * m, s)
            cm.copy_h_to_d_async(fwd.state, np.array([0, start, start + 1, 0], _I32), 4 * km.STATE_WORDS, s)
            self._run(fwd.embed_ops(fwd.ids, m))
            for layer in range(c.n_layer):
                k, v = self._scratch(layer)
                self._run(fwd.pre_ops(layer, m, k, v, self.max_tokens) + [fwd.prefill_attn_op(m, k, v, start)]
                          + fwd.post_ops(layer, m))
            if start + m == t:
                self._run(fwd.head_ops(m, m, sampler=self.sampler, sampler_row=row.lane))
        self.kv.join(row, int(t), self._scratch)
        lane, S = row.lane, self.max_batch
        for w in range(3):   # token, pos, visible of the prefill's state into the row's state words
            cm.copy_d_to_d_async(self.state.ptr + 4 * (w * S + lane), fwd.state + 4 * w, 4, s)
        cm.copy_d_to_d_async(self.logits_buffer.ptr + 2 * lane * c.vocab_size, fwd.logits, 2 * c.vocab_size, s)

    def remove(self, row: int) -> list[int]:
        """Take ``row`` out of the batch (between steps): its pages go back to the pool; returns its tokens."""
        r = self._live_row(row)
        rid = self._lanes[r.lane]
        self._leave(rid, "removed")
        return list(r.tokens)

    def _record(self, rid: int, token: int) -> bool:
        """Append ``token`` to the row; True when that finishes it (it then leaves)."""
        r = self._rows[rid]
        r.tokens.append(token)
        reason = ("stop" if token in r.stop else "max_new" if r.max_new is not None and len(r.tokens) >= r.max_new
                  else "length" if r.pos >= self.max_tokens else None)
        if reason is not None:
            self._leave(rid, reason)
        return reason is not None

    def _leave(self, rid: int, reason: str) -> None:
        """The row leaves: its pages return to the pool, the last lane's row moves into its lane (device state words,
        logits row and the KV mode's lane, in stream order), the last lane goes idle."""
        r = self._rows.pop(rid)
        last, s, S = len(self._lanes) - 1, self.stream, self.max_batch
        self.kv.release(r)
        if r.lane != last:
            moved = self._rows[self._lanes[last]]
            for w in range(3):
                cm.copy_d_to_d_async(self.state.ptr + 4 * (w * S + r.lane), self.state.ptr + 4 * (w * S + last), 4, s)
            cm.copy_d_to_d_async(self.logits_buffer.ptr + 2 * r.lane * self.config.vocab_size,
                                 self.logits_buffer.ptr + 2 * last * self.config.vocab_size,
                                 2 * self.config.vocab_size, s)
            self.kv.move(moved, last, r.lane)
            if self.sampler is not None:
                self.sampler.move(last, r.lane, s)
            moved.lane = r.lane
            self._lanes[r.lane] = self._lanes[last]
        self._lanes.pop()
        for w, value in enumerate(km.IDLE_STATE[:3]):
            cm.copy_h_to_d_async(self.state.ptr + 4 * (w * S + last), np.array([value], _I32), 4, s)
        self.kv.clear(last)
        self._set_live()
        self.finished[rid] = Finished(r.tokens, reason)

    def _set_live(self) -> None:
        cm.copy_h_to_d_async(self.live, np.array([len(self._lanes)], _I32), 4, self.stream)

    def _scratch(self, layer: int) -> tuple[int, int]:
        """(K, V) positional prefill caches of ``layer``: bf16 ``[max_tokens, n_kv_head, head_dim]``."""
        off = layer * self.max_tokens * self._row_bytes
        return self._scratch_k.ptr + off, self._scratch_v.ptr + off

    # -- decode ---------------------------------------------------------------------------------------
    def batch_size(self, rows: int | None = None) -> int:
        """The batch size a step of ``rows`` live rows (default: now) runs: the smallest of :attr:`batch_sizes`
        that holds them."""
        n = len(self._lanes) if rows is None else _args.as_int("rows", rows, 1, self.max_batch)
        return next(b for b in self.batch_sizes if b >= n)

    def _program(self, b: int) -> list[Op]:
        prog = self._programs.get(b)
        if prog is None:
            fwd, c, kv = self.fwd, self.config, self.kv
            prog = kv.step_ops(b) + fwd.embed_ops(self.state.ptr, b)   # word 0 of the states: the rows' tokens
            for layer in range(c.n_layer):
                prog += [fwd.qkv_op(layer, b), *kv.attention_ops(layer, b), *fwd.post_ops(layer, b)]
            prog += fwd.rows_head_ops(b, self.logits_buffer.ptr, self.max_batch, self.state.ptr, self.max_batch,
                                      self.live.ptr, sampler=self.sampler)
            prog += kv.step_end_ops(b)
            self._programs[b] = prog
        return prog

    def _run(self, ops: Iterable[Op]) -> None:
        for _, run in ops:
            run(self.stream)

    def step(self) -> dict[int, int]:
        """Decode one token for every live row (waits for the device): {row id: token}. Rows that finish with it
        leave the batch (see :attr:`finished`)."""
        if not self._lanes:
            raise HssError("step with no rows in the batch: add() a prompt first")
        s, live = self.stream, [self._rows[rid] for rid in self._lanes]
        self.kv.before_step(live)   # (raises, changing nothing, when the pages cannot cover the step)
        n = len(self._lanes)
        b = self.batch_size(n)
        graph = self._graph(b)
        if graph is None and self.graph and b in self._stepped:
            graph = self._capture(b)
        if graph is not None:
            graph.launch(s)
            self._capture_ahead(b)   # (host time while the device runs the step)
        else:
            self._run(self._program(b))
            self._stepped.add(b)
        cm.copy_d_to_h_async(self._host_tokens.ptr, self.state, 4 * n, s)
        cm.stream_sync(s)
        got = self._host_tokens.view(_I32)[:n].tolist()
        self.steps += 1
        out = {r.id: got[r.lane] for r in live}
        for r in live:
            r.pos += 1
        self.kv.after_step(live)
        for r in reversed(live):   # the last lanes first: a leaving row moves only rows already recorded
            self._record(r.id, out[r.id])
        return dict(sorted(out.items()))

    def drain(self, max_steps: int | None = None) -> dict[int, Finished]:
        """:meth:`step` until no row is left (or ``max_steps`` steps); returns :attr:`finished`."""
        limit = None if max_steps is None else _args.as_int("max_steps", max_steps, 0)
        done = 0
        while self._lanes and (limit is None or done < limit):
            self.step()
            done += 1
        return self.finished

    def _start_sampling(self) -> None:
        """Make :attr:`sampler` (every lane greedy, as the live rows are) and drop the argmax steps and their graphs:
        each batch size's step is built again with the sampler's launch (eagerly first, then captured)."""
        self.sampler = self._owned.enter_context(Sampler(self.model.gpu, self.max_batch, self.config.vocab_size,
                                                         stage=_sample.SESSION_STAGE, ctx=self.model.ctx))
        self.sampler.reset(0, 0, self.stream)   # uploads every lane's (greedy) parameters
        self._programs.clear()
        self._drop_graphs()
        self._stepped.clear()

    def _graph(self, b: int) -> cm.CudaGraph | None:
        """Size ``b``'s graph for the KV mode's current ``graph_epoch``: the one captured, or the one captured ahead
        for it; None (stale ones closed) when neither holds."""
        epoch = self.kv.graph_epoch
        for store in (self._graphs, self._ahead):
            got = store.get(b)
            if got is not None and got[0] == epoch:
                if store is self._ahead:
                    self._close(self._graphs, b)
                    self._graphs[b] = self._ahead.pop(b)
                return got[1]
        self._close(self._graphs, b)
        return None

    def _capture_ahead(self, b: int) -> None:
        """Capture size ``b``'s step of the KV mode's next epoch (swap: the rows completing a page with this step,
        or the slots prefetched), when it has one: no device work."""
        plan = getattr(self.kv, "next_epoch", None)
        ahead = None if plan is None else plan()
        if ahead is None:
            return
        with ahead as epoch:
            graph = self._captured(b)
        self._close(self._ahead, b)
        self._ahead[b] = (epoch, graph)

    def _capture(self, b: int) -> cm.CudaGraph:
        graph = self._captured(b)
        self._close(self._graphs, b)
        self._graphs[b] = (self.kv.graph_epoch, graph)
        return graph

    def _captured(self, b: int) -> cm.CudaGraph:
        """Size ``b``'s step captured as it is queued now (counted in :attr:`captures`)."""
        s = self.stream
        cm.begin_capture(s)
        try:
            self._run(self._program(b))
        except BaseException:
            with contextlib.suppress(Exception):
                cm.end_capture(s).close()
            raise
        self.captures += 1
        return cm.end_capture(s)

    @staticmethod
    def _close(store: dict[int, tuple[int, cm.CudaGraph]], b: int) -> None:
        got = store.pop(b, None)
        if got is not None:
            got[1].close()

    def _drop_graphs(self) -> None:
        for store in (self._graphs, self._ahead):
            for b in list(store):
                self._close(store, b)

    @property
    def graph_sizes(self) -> tuple[int, ...]:
        """The batch sizes whose step is captured (for the current KV epoch, or an earlier one)."""
        return tuple(sorted(self._graphs))

    def logits(self, row: int) -> np.ndarray:
        """The logits that chose ``row``'s latest token (its prefill's, or its last step's), float32 ``[vocab]``
        (waits for the device)."""
        r = self._live_row(row)
        out = np.empty(self.config.vocab_size, BF16)
        cm.copy_d_to_h_async(out, self.logits_buffer.ptr + out.nbytes * r.lane, out.nbytes, self.stream)
        return out.astype(np.float32)

    def close(self) -> None:
        """Wait for queued work, then free the batch's memory (idempotent)."""
        if self._owned is not None:
            with contextlib.suppress(Exception):
                cm.stream_sync(self.stream)
            owned, self._owned = self._owned, None
            owned.close()
