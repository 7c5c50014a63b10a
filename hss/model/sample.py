"""Sampling the next token on the device (:class:`Sampler`): per-row penalties, temperature, top-k, top-p, min-p
and a counter-based draw, as one ``ptx/sample.cu`` launch that a captured step graph replays. A request's settings
are one :class:`SamplingParams` (what ``Session(sampling=...)`` and ``BatchSession.add(..., sampling=...)`` take).
The rules: docs/design.md §22.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import numpy as np

from hss import _args
from hss import cuda_min as cm
from hss._util import Closeable
from hss.cuda._context import shared_optin
from hss.cuda.gpu import CudaBackend, launcher
from hss.decls import sample as ks
from hss.errors import HssError

__all__ = ["Sampler", "SamplingParams", "SAMPLING_DEFAULTS", "GREEDY"]

Op = tuple[str, Any]   # (stage name, run(stream)), as hss.model.forward's
SAMPLING_DEFAULTS = {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "repetition_penalty": 1.0,
                     "presence_penalty": 0.0}


def _params_words(temperature: float, top_k: int, top_p: float, min_p: float, repetition_penalty: float,
                  presence_penalty: float) -> np.ndarray:
    """Checked parameters as the u32 words ``P_TEMPERATURE .. P_PRESENCE`` of a params row."""
    t = _args.as_float("temperature", temperature)
    if t < 0:
        raise HssError(f"temperature = {t!r} must be >= 0 (0 = greedy)")
    k = _args.as_int("top_k", top_k, 0, ks.CANDIDATES, "0 (off: the 1024 most likely tokens and the tail) or at "
                     "most the candidate cap")
    p = _args.as_float("top_p", top_p)
    if not 0 < p <= 1:
        raise HssError(f"top_p = {p!r} must be in (0, 1] (1 = off)")
    mp = _args.as_float("min_p", min_p)
    if not 0 <= mp <= 1:
        raise HssError(f"min_p = {mp!r} must be in [0, 1] (0 = off)")
    rp = _args.as_float("repetition_penalty", repetition_penalty)
    if not rp > 0:
        raise HssError(f"repetition_penalty = {rp!r} must be > 0 (1 = off)")
    pp = _args.as_float("presence_penalty", presence_penalty)
    f = np.array([t, 0, p, mp, rp, pp], np.float32)
    if not np.isfinite(f).all() or (t > 0 and f[0] == 0):
        raise HssError("temperature, top_p, min_p and the penalties must be representable as finite f32 "
                       f"(temperature {t!r} would round to 0 or overflow)")
    words = f.view(np.uint32).copy()
    words[ks.P_TOP_K] = k
    return words


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How one request draws its tokens (checked when made: a bad value raises ``TypeError`` / :class:`HssError`).

    ``temperature`` >= 0 (0: greedy, the argmax), ``top_k`` 0..``hss.decls.sample.CANDIDATES`` (0: the ``CANDIDATES``
    most likely tokens and the rest as a tail), ``top_p`` in (0, 1] (1: off), ``min_p`` in [0, 1] (0: off),
    ``repetition_penalty`` > 0 (1: off) and ``presence_penalty`` (0: off) over the request's recent tokens (its prompt's
    tail included), ``seed`` a u64: the same seed, logits and step give the same token, whatever batch row the request
    sits in. ``SamplingParams()`` is greedy."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        _args.int_fields(self)
        _params_words(**self.kernel_params())
        _args.as_int("seed", self.seed, 0, (1 << 64) - 1)
        for f in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty"):
            object.__setattr__(self, f, float(getattr(self, f)))

    def kernel_params(self) -> dict[str, Any]:
        """The keyword arguments of :meth:`Sampler.set_params` (everything but the seed)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "seed"}

    @property
    def greedy(self) -> bool:
        """True when the token is the plain argmax: temperature 0 and both penalties off (top-k, top-p and min-p
        then change nothing); a session keeps ``model_argmax`` for such requests."""
        return self.temperature == 0 and self.repetition_penalty == 1 and self.presence_penalty == 0


GREEDY = SamplingParams()

#: ``stage`` of the samplers that :class:`~hss.model.session.Session` and :class:`~hss.model.batch.BatchSession` make
#: (see :class:`Sampler`): None, staged where the keys fit (measured faster: docs/benchmarks/2026-12-08-h100-*.md)
SESSION_STAGE: bool | None = None


class Sampler(Closeable):
    """The device state and launch of the token sampler for up to ``rows`` batch rows of a ``vocab``-token model.

    Owns (device): ``params`` u32 ``[rows, ks.PARAM_WORDS]`` (each row's parameters, seed, step counter, history
    count, flags) and ``history`` i32 ``[rows, history]`` (each row's ring of its last ``history`` tokens, the
    window the penalties see; the sampler appends every token it draws). Every row starts greedy (temperature 0),
    seed 0, empty history.

    The rule (``ptx/sample.cu``'s header has it in full): penalties over the row's history (positive logits divided
    by ``repetition_penalty``, others multiplied, then ``presence_penalty`` subtracted) -> temperature 0: the greedy
    token, exactly ``model_argmax``'s (near ties recomputed in f32 from ``h`` and the LM head) when the penalties
    are off -> else top-k (at most ``hss.decls.sample.CANDIDATES``; 0 = those most likely tokens plus the rest as a
    tail drawn in id order) -> softmax at the temperature in 40-bit fixed point -> top-p -> min-p -> one Philox4x32-10
    draw keyed by the row's seed at its step counter, so the same seed and step give the same token in any batch
    row. NaN logits count as -inf (flag ``FLAG_NAN``); a +inf logit makes the row greedy (``FLAG_INF``); no logit
    above -inf gives token 0 (``FLAG_EMPTY``); :meth:`flags` reads them.

    In the model step, in place of the argmax op (``Forward.head_ops``' last op)::

        head, _argmax = fwd.head_ops(rows, advance)
        ops = [head, sampler.op(fwd.logits, state=fwd.state, m=1, h=h_row, weight=fwd.w.output, dim=c.dim,
                                advance=advance)]

    The op reads everything from the device (parameters, counters, history, ``rows``), so a captured graph replays
    it and each replay draws anew. :meth:`set_params`, :meth:`reset` and :meth:`flags` queue copies on the stream
    they are given: call them outside a capture (between replays).

    ``stage``: whether the launch keeps the penalised keys in shared memory after its first pass over the logits
    (the same tokens, fewer instructions a pass): True (an HssError where they do not fit the device's opt-in shared
    memory, :func:`hss.decls.sample.stage_fits`: vocabularies up to 49,152 on an H100 or H200), None (default:
    where they fit; on an H100 a SmolLM2-sized row with a repetition penalty took 35.8 µs staged, 43.6 µs not) or
    False (every pass reads the logits and the history bitmap).
    """

    def __init__(self, gpu: CudaBackend, rows: int, vocab: int, *, history: int = 64,
                 stage: bool | None = None, ctx: cm.CudaCtx | None = None) -> None:
        self.rows = _args.as_int("rows", rows, 1, 65535, "the grid has one CTA per row")
        self.vocab = _args.as_int("vocab", vocab, 1, ks.MAX_VOCAB, "the history bitmap lives in shared memory")
        self.history_cap = _args.as_int("history", history, 0, 1 << 20)
        if stage is not None and not isinstance(stage, bool):
            raise TypeError(f"stage must be a bool or None (where it fits), got {type(stage).__name__}")
        optin = shared_optin(ctx if ctx is not None else getattr(gpu, "ctx", None))
        fits = ks.stage_fits(self.vocab, optin)
        if stage and not fits:
            raise HssError(f"stage=True: the keys of a {self.vocab}-token vocabulary do not fit the device's "
                           f"{optin} bytes of shared memory a block; pass stage=None or False")
        self.stage = fits if stage is None else stage
        self.gpu = gpu
        self._owned = contextlib.ExitStack()
        self._host = np.zeros((self.rows, ks.PARAM_WORDS), np.uint32)
        self._host[:, : ks.P_PRESENCE + 1] = _params_words(**SAMPLING_DEFAULTS)
        try:
            self._kernel = gpu.kernel(ks.MODULE, ks.SAMPLE_TOKENS.name)
            if self.stage:   # the same limit for every staged sampler (a later one never lowers it)
                self._kernel.func.set_max_dynamic_shared(optin - ks.STATIC_SHARED)
            self.params = self._owned.enter_context(cm.DeviceBuffer(self._host.nbytes, ctx)).ptr
            self.history = self._owned.enter_context(cm.DeviceBuffer(max(4 * self.rows * self.history_cap, 4),
                                                                     ctx)).ptr
        except BaseException:
            self._owned.close()
            raise
        self._uploaded = False

    # -- parameters ------------------------------------------------------------------------------------
    def _row(self, row: int) -> int:
        return _args.as_int("row", row, 0, self.rows - 1, f"the sampler has {self.rows} rows")

    def _upload_all(self, stream: int) -> None:
        if not self._uploaded:
            cm.copy_h_to_d_async(self.params, self._host, self._host.nbytes, stream)
            self._uploaded = True

    def set_params(self, row: int, stream: Any, *, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                   min_p: float = 0.0, repetition_penalty: float = 1.0, presence_penalty: float = 0.0) -> None:
        """Row ``row``'s sampling parameters (checked first; queued on ``stream``); its seed, step and history
        stay. ``temperature`` >= 0 (0: greedy), ``top_k`` 0..``CANDIDATES`` (0: the ``CANDIDATES`` most likely and the
        rest as a tail), ``top_p`` in (0, 1], ``min_p`` in [0, 1], ``repetition_penalty`` > 0 (1: off),
        ``presence_penalty`` (0: off)."""
        r = self._row(row)
        words = _params_words(temperature, top_k, top_p, min_p, repetition_penalty, presence_penalty)
        s = _args.stream(stream)
        self._host[r, : ks.P_PRESENCE + 1] = words
        if not self._uploaded:
            self._upload_all(s)
            return
        cm.copy_h_to_d_async(self.params + 4 * ks.PARAM_WORDS * r, self._host[r, : ks.P_PRESENCE + 1],
                             words.nbytes, s)

    def reset(self, row: int, seed: int, stream: Any, prompt: Any = ()) -> None:
        """Start row ``row`` anew (a new request): its seed (u64), step 0, flags 0, and its history = the last
        ``history`` ids of ``prompt`` (penalties then cover the prompt's last ``history`` tokens; () for none)."""
        r = self._row(row)
        sd = _args.as_int("seed", seed, 0, (1 << 64) - 1)
        ids = np.asarray(prompt if len(prompt) else np.zeros(0, np.int32))
        if ids.ndim != 1 or (ids.size and ids.dtype.kind not in "iu"):
            raise TypeError(f"prompt must be a 1-D sequence of token ids, got {ids.dtype} of shape {ids.shape}")
        if ids.size and (ids.min() < 0 or ids.max() >= self.vocab):
            raise HssError(f"prompt ids must be in 0..{self.vocab - 1} (got {int(ids.min())}..{int(ids.max())})")
        s = _args.stream(stream)
        cap = self.history_cap
        tail = ids[-cap:].astype(np.int32) if cap else np.zeros(0, np.int32)
        self._host[r, ks.P_SEED_LO], self._host[r, ks.P_SEED_HI] = sd & 0xFFFFFFFF, sd >> 32
        self._host[r, ks.P_STEP] = 0
        self._host[r, ks.P_COUNT] = tail.size   # ring entry j holds the token appended at count j: 0..n-1
        self._host[r, ks.P_FLAGS] = 0
        if not self._uploaded:
            self._upload_all(s)
        else:
            at = self.params + 4 * ks.PARAM_WORDS * r
            cm.copy_h_to_d_async(at, self._host[r], 4 * ks.PARAM_WORDS, s)
        if tail.size:
            cm.copy_h_to_d_async(self.history + 4 * cap * r, tail, tail.nbytes, s)

    def start(self, row: int, params: SamplingParams, stream: Any, prompt: Any = ()) -> None:
        """Row ``row`` takes a new request: :meth:`reset` with ``params.seed`` and ``prompt`` (its history), then
        :meth:`set_params` with the rest (queued on ``stream``)."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        self._row(row)
        self.reset(row, params.seed, stream, prompt)
        self.set_params(row, stream, **params.kernel_params())

    def move(self, src: int, dst: int, stream: Any) -> None:
        """Row ``src``'s parameters, seed, counters, flags and history into row ``dst`` (device copies queued on
        ``stream``: a batch row that changes lanes keeps its draws); ``src`` is left as it was."""
        a, b = self._row(src), self._row(dst)
        s = _args.stream(stream)
        self._upload_all(s)
        if a == b:
            return
        self._host[b] = self._host[a]
        words = 4 * ks.PARAM_WORDS
        cm.copy_d_to_d_async(self.params + words * b, self.params + words * a, words, s)
        if self.history_cap:
            row = 4 * self.history_cap
            cm.copy_d_to_d_async(self.history + row * b, self.history + row * a, row, s)

    def flags(self, stream: Any) -> np.ndarray:
        """u32 ``[rows]``: each row's sticky ``FLAG_*`` bits (waits for ``stream``)."""
        s = _args.stream(stream)
        self._upload_all(s)
        got = np.empty((self.rows, ks.PARAM_WORDS), np.uint32)
        cm.copy_d_to_h_async(got, self.params, got.nbytes, s)
        cm.stream_sync(s)
        return got[:, ks.P_FLAGS].copy()

    def counters(self, stream: Any) -> tuple[np.ndarray, np.ndarray]:
        """(step, history count), u32 ``[rows]`` each (waits for ``stream``)."""
        s = _args.stream(stream)
        self._upload_all(s)
        got = np.empty((self.rows, ks.PARAM_WORDS), np.uint32)
        cm.copy_d_to_h_async(got, self.params, got.nbytes, s)
        cm.stream_sync(s)
        return got[:, ks.P_STEP].copy(), got[:, ks.P_COUNT].copy()

    # -- the launch --------------------------------------------------------------------------------------
    def op(self, logits: int, *, state: int, m: int, h: int = 0, weight: int = 0, dim: int = 0,
           state_stride: int = 1, advance: int = -1, rows: int = 0, stream: Any = None, row: int = 0) -> Op:
        """The prepared launch ``("sample", run(stream))`` for rows ``0 .. m - 1`` (checked and packed once),
        launch row r drawing with the sampler's row ``row + r`` (``row``: 0 unless one batch row is sampled alone).

        ``logits`` bf16 ``[m, vocab]`` (device address); ``state`` i32: row r's token to ``state[r]``; ``advance
        >= 0``: ``state`` is the model state (words at ``w * state_stride + r``) and its position advances as
        ``model_argmax``'s; ``-1``: a plain token array. ``h`` bf16 ``[m, dim]`` and ``weight`` bf16 ``[vocab,
        dim]`` (the LM head): the greedy rows' near ties are recomputed in f32 as ``model_argmax`` does (0: the
        first largest logit). ``rows``: i32 ``[1]`` on the device, the live row count (0: all ``m``).
        ``stream``: where the initial parameters are uploaded if nothing was set yet (None: they must have been)."""
        mm = _args.as_int("m", m, 1, self.rows, f"the sampler has {self.rows} rows")
        first = _args.as_int("row", row, 0, self.rows - mm, f"rows row .. row + m - 1 of the sampler's {self.rows}")
        adv = _args.as_int("advance", advance, -1, (1 << 31) - 1, "-1 = a plain token array")
        stride = _args.as_int("state_stride", state_stride, 1, (1 << 31) - 1)
        if adv >= 0 and stride < mm:
            raise HssError(f"state_stride = {stride} must be >= m = {mm} for model state rows (advance >= 0)")
        d = _args.as_int("dim", dim, 0, (1 << 31) - 1)
        if bool(h) != bool(weight) or (bool(h) and d < 1):
            raise HssError("h and weight come together, with dim >= 1 (or all three 0: no near-tie recomputation)")
        if not self._uploaded:
            if stream is None:
                raise HssError("Sampler.op: nothing uploaded yet: pass stream= (or call set_params / reset first)")
            self._upload_all(_args.stream(stream))
        params, history = self.params + 4 * ks.PARAM_WORDS * first, self.history + 4 * self.history_cap * first
        pack = ks.SAMPLE_TOKENS.pack(logits=logits, h=h, weight=weight, params=params, history=history,
                                     state=state, rows=rows, vocab=self.vocab, dim=d, history_cap=self.history_cap,
                                     m=mm, state_stride=stride, advance=adv, stage=int(self.stage))
        geom = ks.sample_geometry(mm, self.vocab, self.stage)
        run = launcher(self.gpu, self._kernel, geom.block, geom.shared, pack)
        grid = geom.grid
        return "sample", lambda s, _pack=pack: run(s, *grid)

    @property
    def closed(self) -> bool:
        return self._owned is None

    def close(self) -> None:
        """Free the device buffers (idempotent)."""
        if self._owned is not None:
            owned, self._owned = self._owned, None
            owned.close()

