"""The QSA indexer (SPEC §10, §11): ``QsaIndexer``, ``QsaSeqState``, ``QsaSelection``.

The attention layer's input is projected to ``n_heads`` query heads and one raw key per token; the visible
prefix is cut into blocks of ``ratio`` tokens whose keys are mean-pooled, RMS-normed and roped at the
block's first position; a decode query attends the top ``budget // ratio`` blocks by
``sum_h relu(q_h . k_b) / sqrt(hd)`` plus the incomplete tail. While ``visible <= inert_bound()``
(``budget + ratio - 1``) every token is selected, so ``decode_select`` returns ``None`` and the caller runs
dense attention; past it, the selected tokens' K/V rows are gathered into a contiguous scratch that the
ordinary paged decode attention reads through an identity block table. ``prefill_select`` (in
:mod:`hss.qsa.prefill`) rewrites the selective rows of a prefill chunk's attention output;
``snapshot_aux`` / ``restore_aux`` (in :mod:`hss.qsa.snapshot`) save and restore a sequence.

The device-resident batched decode (SPEC §17.2-§17.4; host code in :mod:`hss.qsa.device`):
``decode_select_batch`` runs ingest and selection for R sequences with the positions on the device (no host sync,
graph-capturable) and ``sparse_decode_attention`` attends each sequence's selected tokens through its page table.
Every state holds a slot of the indexer's device arrays; every host path keeps ``pos_dev[slot]`` equal to
``st.ingested`` in stream order.

Differences from the original (SPEC §0): methods use the indexer's own ``gpu`` (no ``gpu`` argument);
every argument is read by :mod:`hss._args` (ints, floats, device pointers checked against the bytes the call
reads or writes, streams) and every input error (an :class:`~hss.errors.HssError`, a ``TypeError`` for a wrong
type) is raised before any device work or state change; ``block_size < 8`` is rejected (the identity table holds
``ceil((budget + ratio) / 8)`` pages); ``QsaSelection.tokens`` carries the host copy of the selection; an
unparsable ``HSS_QSA_MAX_TOKENS`` (or a flag other than 0/1) is an error rather than silently the default. The
prefill kernels ``qsa_qprep_rows``, ``qsa_score_rows`` and ``qsa_prefill_attn`` are required; the tensor-core
scorer ``qsa_score_rows_tc`` and the fast attention ``qsa_prefill_attn_tc`` are optional (``try_kernel``).
"""
from __future__ import annotations

import functools
import math
import os
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np

from hss import _args
from hss import cuda_min as cm
from hss._context import owner_context, stream_context
from hss.errors import CudaError, HssError
from hss.gpu import DevicePtr, GpuBackend, launcher, proj_dense
from hss.kernels import qsa as kq
from hss.kernels import qsa_prefill as kp
from hss.qsa import device, prefill, snapshot
from hss.qsa.device import QsaDeviceSelection
from hss.qsa.select import _select_tokens

__all__ = ["QsaIndexer", "QsaSeqState", "QsaSelection", "QsaDeviceSelection", "INGEST_SLAB", "MIN_BLOCK_SIZE",
           "DEFAULT_MAX_TOKENS", "env_flag"]

INGEST_SLAB = 2048          # prefill GEMM slab (rows), bounding qk_scratch
DEFAULT_MAX_TOKENS = 32768
MIN_BLOCK_SIZE = 8          # the identity and prefill tables are sized for pages of at least 8 tokens
MODULE = kq.MODULE
_SMEM_LIMIT = 48 * 1024     # qsa_score stages q in shared memory without the opt-in attribute
_I32 = 2**31 - 1
_SEL_HEAD = 4               # i32 slots before the selection in the seq_len / selection upload
_ASCII_SPACE = " \t\n\r\v\f"   # what an environment setting may carry around its value


def env_flag(name: str, value: bool | None) -> bool:
    """``value`` if given, else env ``name``: "1" is on, "" / "0" / unset off, anything else an error."""
    if value is not None:
        if not isinstance(value, (bool, np.bool_)):
            raise TypeError(f"QsaIndexer: the {name} override must be a bool or None, got {type(value).__name__}")
        return bool(value)
    raw = os.environ.get(name, "").strip(_ASCII_SPACE)
    if raw in ("", "0"):
        return False
    if raw == "1":
        return True
    raise HssError(f"{name}={raw!r} is not a flag; set it to 1 (on) or 0 / unset (off)")


def f32_arg(name: str, value: Any, positive: bool) -> float:
    """A real argument (:func:`hss._args.as_float`) at the float32 value the kernels take: finite there, and
    > 0 (``positive``) or >= 0."""
    v = _args.as_float(name, value)
    with np.errstate(over="ignore"):
        v32 = float(np.float32(v))
    if not math.isfinite(v32) or (v32 <= 0 if positive else v32 < 0):
        need = "> 0" if positive else ">= 0"
        raise HssError(f"{name} = {value!r} must be finite and {need} as a float32 (the kernels take it as f32)")
    return v32


@dataclass(frozen=True)
class QsaSelection:
    """One decode step's selection: contiguous NHD K/V scratch ``[n_sel, nkv_attn, hd_attn]`` bf16, an
    identity block table (``max_blocks`` i32 pages) and ``seq_len`` (one i32 = n_sel) on the device, for the
    standard paged decode attention. ``tokens`` (hss addition) is the host copy of the selected positions."""
    k_scratch: DevicePtr
    v_scratch: DevicePtr
    table_dev: DevicePtr
    seq_len_dev: DevicePtr
    n_sel: int
    max_blocks: int
    tokens: np.ndarray


class QsaSeqState:
    """One sequence's indexer carry: counters and the raw / pooled key buffers (free with
    ``QsaIndexer.release_seq_state``; dropping the object frees nothing, as in the original; the indexer's
    ``close()``, or its collection, frees every state it still has and marks it released).

    ``ingested``: tokens whose raw keys are stored (contiguous from 0); ``pooled``: complete blocks pooled;
    ``table_len``: identity-table pages uploaded; ``raw_keys`` ``[max_tokens, hd]`` bf16;
    ``block_keys`` ``[max_tokens // ratio, hd]`` bf16; ``slot``: its row of the indexer's device arrays (the
    position ``pos_dev[slot]`` is the device's copy of ``ingested``; -1 once released).
    """

    __slots__ = ("ingested", "pooled", "table_len", "raw_keys", "block_keys", "_owner", "_slot", "__weakref__")

    def __init__(self, raw_keys: DevicePtr, block_keys: DevicePtr, owner: QsaIndexer, slot: int = -1) -> None:
        self.ingested = 0
        self.pooled = 0
        self.table_len = 0
        self.raw_keys = raw_keys
        self.block_keys = block_keys
        self._owner = weakref.ref(owner)
        self._slot = slot

    @property
    def released(self) -> bool:
        return self.raw_keys.is_null() and self.block_keys.is_null()

    @property
    def slot(self) -> int:
        """This state's row of the indexer's device arrays (``pos_dev``, ``desc_dev``, ...); -1 once released."""
        return self._slot

    def sync(self, stream: Any) -> int:
        """Refresh ``ingested`` (and ``pooled``) from the device position after the work queued on ``stream``, and
        return it. Blocking (a 4-byte D2H, then a wait). Needed only where device steps ran without hss seeing
        them: replays of a ``torch.cuda.graph`` capture (hss's own eager steps and ``CudaGraph.launch`` replays keep
        the mirrors current)."""
        owner = self._owner()
        if owner is None:
            raise HssError("QsaSeqState.sync: the indexer of this state is gone")
        owner._check_state(self, "QsaSeqState.sync")
        s = owner._stream(stream, "QsaSeqState.sync")
        n = owner._dev.read_pos(self, s)
        if n != self.ingested:
            self.ingested, self.pooled = n, n // owner.ratio
        return n

    def __repr__(self) -> str:
        state = "released" if self.released else f"raw_keys={self.raw_keys!r}, block_keys={self.block_keys!r}"
        return f"QsaSeqState(ingested={self.ingested}, pooled={self.pooled}, table_len={self.table_len}, {state})"


def _free_all(gpu: Any, owned: list[DevicePtr], states: weakref.WeakSet, raising: bool = False) -> None:
    """Free every allocation in ``owned`` (emptying it) and mark ``states`` released: ``QsaIndexer.close``, and its
    finalizer (which holds only these, never the indexer). Attempts every free; ``raising``: raise the first error."""
    first: BaseException | None = None
    for st in list(states):
        st.raw_keys = st.block_keys = DevicePtr(0)
        st._slot = -1
    states.clear()
    while owned:
        ptr = owned.pop()
        try:
            gpu.free(ptr)
        except Exception as exc:   # keep freeing the rest
            first = first or exc
    if raising and first is not None:
        raise first


def max_tokens_setting(max_tokens: int | None) -> int:
    """``max_tokens`` if given, else ``HSS_QSA_MAX_TOKENS`` from the environment, else 32768."""
    if max_tokens is not None:
        return max_tokens
    raw = os.environ.get("HSS_QSA_MAX_TOKENS", "").strip(_ASCII_SPACE)
    if not raw:
        return DEFAULT_MAX_TOKENS
    if raw.isascii() and raw.isdigit():   # ASCII decimal digits only, as the original read it (no sign, no "_")
        try:
            return int(raw)
        except ValueError:   # more digits than int() converts
            raise HssError(f"HSS_QSA_MAX_TOKENS has {len(raw)} digits; at most {_I32} tokens (int32 token ids): "
                           "set it to the longest context in tokens or pass max_tokens=") from None
    raise HssError(f"HSS_QSA_MAX_TOKENS={raw!r} is not an integer (ASCII decimal digits); set it to the longest "
                   f"context in tokens (default {DEFAULT_MAX_TOKENS}) or pass max_tokens=")


class QsaIndexer:
    """One full-attention layer's QSA indexer (SPEC §11.1).

    ``qk_proj_w`` ``[(n_heads + 1) * hd, hidden]`` bf16 row-major, ``q_norm_w`` / ``k_norm_w`` ``[hd]`` bf16
    (offsets from 1): device arrays in any form :func:`hss._args.pointer` reads (int, DevicePtr, DeviceBuffer,
    torch tensor, ``__cuda_array_interface__`` / ``__dlpack__`` object), checked against those sizes; the caller
    keeps them alive. ``ratio`` tokens per block, ``budget`` tokens selected (a multiple of ``ratio``),
    ``rot`` rotary dims, ``theta`` RoPE base, ``eps`` RMS-norm epsilon, ``nkv_attn`` / ``hd_attn`` the main
    attention's KV heads and head dim (for the gathered scratch). ``max_tokens`` bounds a sequence (default:
    env ``HSS_QSA_MAX_TOKENS``, else 32768). ``score_scalar=True`` makes prefill selection score with
    ``qsa_score_rows`` even where the tensor-core scorer applies (default: env ``HSS_QSA_SCORE_SCALAR=1``);
    ``no_prefill_select=True`` turns ``prefill_select`` into a no-op, leaving prefill rows dense (default: env
    ``HSS_QSA_NO_PREFILL_SELECT=1``); both are read once, here. Device memory comes from ``gpu.alloc`` and is
    freed by ``close()`` (idempotent; also a context manager), which also frees the states still live; sequence
    states are freed by ``release_seq_state``. An indexer dropped without ``close()`` frees all of it when it is
    collected (a ``weakref.finalize`` holding only the backend and the allocations).

    Every call is all or nothing: it checks every argument before any device work -- sizes, alignment, dtypes; that
    no caller memory overlaps memory this indexer owns (device buffers, pinned staging, the states' keys) and no
    written argument another argument of the call (a paged pool counts as far as it reaches: its stated size, else
    to the end of the hss buffer holding it); that weights, memory and streams are of the backend's device -- and
    changes a sequence's counters only once all of its work is queued; a call that fails leaves the sequence,
    counters and keys, as it was.

    Batched device decode (:meth:`decode_select_batch`, :meth:`sparse_decode_attention`): ``max_seqs`` (default
    64, at most 2048) bounds the live states (each holds a slot of the device arrays) and so the batch;
    ``nq_attn`` (optional) sizes the sparse attention's split partials at construction for that many query heads
    (otherwise the first ``sparse_decode_attention`` call allocates them, which must not be a captured one).
    Steps: ``sel = idx.decode_select_batch(states, normed, block_tables, block_size, stream)``, then
    ``idx.sparse_decode_attention(q, k_pool, v_pool, None, sel, out, stream)``; both capture into CUDA graphs
    (``hss.cuda_min.begin_capture`` / ``end_capture``), whose replays advance the states' host mirrors.
    """

    def __init__(self, qk_proj_w: Any, q_norm_w: Any, k_norm_w: Any, n_heads: int, hd: int, ratio: int,
                 budget: int, rot: int, theta: float, eps: float, hidden: int, nkv_attn: int, hd_attn: int,
                 gpu: GpuBackend, max_tokens: int | None = None, *, score_scalar: bool | None = None,
                 no_prefill_select: bool | None = None, max_seqs: int = device.DEFAULT_MAX_SEQS,
                 nq_attn: int | None = None) -> None:
        self._closed = True   # until construction succeeds, close() has nothing of ours to free
        # every live allocation (the indexer's and its states'), shared with the finalizer, which frees what close()
        # did not; the owned ranges refuse caller pointers into any of it; the live states, to mark them released
        self._owned: list[DevicePtr] = []
        self._mine = _args.OwnedRanges()
        self._owned_gen = 0   # changes with every range added to or removed from _mine (cached checks hold until then)
        self._streams_ok: set[int] = set()   # streams seen to be of this indexer's context (several devices in use)
        self._states: weakref.WeakSet[QsaSeqState] = weakref.WeakSet()
        self._finalizer: weakref.finalize | None = None
        self._backup: DevicePtr | None = None   # raw keys a restarted sequence overwrites, kept until it commits
        self._pinned: cm.PinnedBuffer | None = None
        self._dev: device.DeviceState | None = None
        # every check first: nothing touches the device before they pass
        self._check_dims(n_heads, hd, ratio, budget, rot, theta, eps, hidden, nkv_attn, hd_attn, max_tokens)
        self.max_seqs = _args.as_int("max_seqs", max_seqs, 1, device.MAX_SEQS,
                                     why="live sequence states (and so the largest batch) of decode_select_batch")
        if nq_attn is not None:
            nq_attn = _args.as_int("nq_attn", nq_attn, 1, _I32, why="the attention's query heads")
            if nq_attn % self.nkv_attn:
                raise HssError(f"QsaIndexer: nq_attn ({nq_attn}) must be a multiple of nkv_attn ({self.nkv_attn})")
        score_scalar = env_flag("HSS_QSA_SCORE_SCALAR", score_scalar)
        self.prefill_select_enabled = not env_flag("HSS_QSA_NO_PREFILL_SELECT", no_prefill_select)
        hd, qkw = self.hd, self.qk_width
        self.qk_proj_w = DevicePtr(_args.pointer(qk_proj_w, "qk_proj_w", qkw * self.hidden * 2, 2, "bf16",
                                                 what=f"[(n_heads + 1) * hd, hidden] = [{qkw}, {self.hidden}] bf16"))
        self.q_norm_w = DevicePtr(_args.pointer(q_norm_w, "q_norm_w", hd * 2, 2, "bf16", what=f"[hd] = [{hd}] bf16"))
        self.k_norm_w = DevicePtr(_args.pointer(k_norm_w, "k_norm_w", hd * 2, 2, "bf16", what=f"[hd] = [{hd}] bf16"))
        pctx = owner_context(getattr(gpu, "ctx", None))
        self._device, self._ctx_handle = pctx.ordinal, pctx.handle
        for name, obj, ptr in (("qk_proj_w", qk_proj_w, self.qk_proj_w), ("q_norm_w", q_norm_w, self.q_norm_w),
                               ("k_norm_w", k_norm_w, self.k_norm_w)):
            where = _args.device_of(obj, int(ptr))
            if where is not None and where != self._device:
                raise HssError(f"QsaIndexer: {name} is memory of device {where}, but the backend (gpu) works on "
                               f"device {self._device}; pass weights of device {self._device}, or a backend of "
                               f"device {where}")
        self.gpu = gpu
        self._closed = False
        self._finalizer = weakref.finalize(self, _free_all, gpu, self._owned, self._states)
        try:
            self._prepare(score_scalar)
            self._dev = device.DeviceState(self, self.max_seqs, nq_attn)
        except BaseException:
            self.close()
            raise

    def _check_dims(self, n_heads: Any, hd: Any, ratio: Any, budget: Any, rot: Any, theta: Any, eps: Any,
                    hidden: Any, nkv_attn: Any, hd_attn: Any, max_tokens: Any) -> None:
        """Check and store the layer's dimensions (Python ints; theta and eps at their float32 values)."""
        ratio = _args.as_int("ratio", ratio, 1, _I32, why="tokens per QSA block (the model uses 4)")
        budget = _args.as_int("budget", budget, None, _I32, why="the token budget (the model uses 2048)")
        if budget % ratio != 0 or budget <= 0:
            raise HssError(f"QsaIndexer: budget ({budget}) must be a positive multiple of ratio ({ratio}): the "
                           f"selection keeps budget // ratio whole blocks; pass e.g. budget="
                           f"{max(ratio, budget // ratio * ratio)}")
        n_heads = _args.as_int("n_heads", n_heads, 1, _I32, why="indexer query heads (the model uses 4)")
        hd = _args.as_int("hd", hd, 32, 1024, why="the indexer head dim (the model uses 128)")
        if hd % 32:
            raise HssError(f"QsaIndexer: hd ({hd}) must be a multiple of 32 (at most 1024): the pool and qprep "
                           "kernels run one thread per dim in whole warps (the model uses 128)")
        if kq.score_smem_bytes(n_heads, hd) > _SMEM_LIMIT:
            raise HssError(f"QsaIndexer: n_heads * hd ({n_heads * hd}) must be at most {_SMEM_LIMIT // 4}: qsa_score "
                           "stages q in 48 KiB of shared memory")
        rot = _args.as_int("rot", rot, 0, hd, why="the rotary dims, at most hd")
        if rot % 2:
            raise HssError(f"QsaIndexer: rot ({rot}) must be even: rotate-half RoPE pairs dim j with j + rot/2")
        self.theta = f32_arg("theta", theta, positive=True)
        self.eps = f32_arg("eps", eps, positive=False)
        self.hidden = _args.as_int("hidden", hidden, 1, _I32, why="the attention input width")
        self.nkv_attn = _args.as_int("nkv_attn", nkv_attn, 1, _I32, why="the attention's KV heads")
        self.hd_attn = _args.as_int("hd_attn", hd_attn, 1, _I32, why="the attention's head dim")
        self.max_tokens = _args.as_int("max_tokens", max_tokens_setting(max_tokens), ratio, _I32,
                                       why="the longest sequence in tokens: at least one block, int32 token ids "
                                           "(argument max_tokens= or env HSS_QSA_MAX_TOKENS)")
        self.n_heads, self.hd, self.ratio, self.budget, self.rot = n_heads, hd, ratio, budget, rot
        self.block_topk = budget // ratio
        self.qk_width = (n_heads + 1) * hd
        self.sel_cap = budget + ratio
        self._kv_row = self.nkv_attn * self.hd_attn * 2   # bytes of one token's K (or V) row

    def _prepare(self, score_scalar: bool) -> None:
        """Kernels, device and host buffers, and the decode stages' prepared launches (named slots)."""
        gpu = self.gpu
        self._k_pool = gpu.kernel(MODULE, "qsa_block_pool")
        self._k_qprep = gpu.kernel(MODULE, "qsa_qprep")
        self._k_score = gpu.kernel(MODULE, "qsa_score")
        self._k_gather = gpu.kernel(MODULE, "qsa_gather")
        # prefill selection (SPEC §11.5): three kernels required, the tensor-core variants optional
        self._prefill = prefill.PrefillKernels(self)
        self.uses_tc_scorer = (bool(self._prefill.score_tc) and not score_scalar
                               and (self.n_heads, self.hd) == (kp.TC_HEADS, kp.TC_HD))
        self._allocate()
        self._prepare_decode()

    def _allocate(self) -> None:
        """The layer's device buffers (freed by close) and host staging."""
        gpu, hd, n_heads, max_tokens, ratio = self.gpu, self.hd, self.n_heads, self.max_tokens, self.ratio
        self.qk_scratch = self._alloc(INGEST_SLAB * self.qk_width * 2, "the indexer's qk scratch")
        self.q_post = self._alloc(n_heads * hd * 4, "the indexer's q_post")
        self.scores_dev = self._alloc(max_tokens // ratio * 4, "the indexer's block scores")
        # seq_len (one i32) and the selection share one allocation, so that a step uploads both at once:
        # [n_sel, 3 unused | selected tokens], the tokens 16-byte aligned
        self.seq_len_dev = self._alloc((_SEL_HEAD + self.sel_cap) * 4, "the indexer's seq_len and selection")
        self.sel_dev = self.seq_len_dev.offset(_SEL_HEAD * 4)
        self.k_scratch = self._alloc(self.sel_cap * self._kv_row, "the indexer's gathered K scratch")
        self.v_scratch = self._alloc(self.sel_cap * self._kv_row, "the indexer's gathered V scratch")
        self.table_dev = self._alloc(-(-self.sel_cap // MIN_BLOCK_SIZE) * 4, "the indexer's identity table")
        self.prefill_table_dev = self._alloc(-(-max_tokens // MIN_BLOCK_SIZE) * 4, "the indexer's prefill table")
        # host side: pinned scores (the blocking D2H of every selective step), pageable uploads
        self._pinned = cm.PinnedBuffer(max_tokens // ratio * 4, getattr(gpu, "ctx", None))
        self._mine.add(self._pinned.ptr, self._pinned.bytes, "the indexer's pinned scores")   # the D2H writes it
        self._scores_host = self._pinned.view(np.float32)
        self._upload = np.zeros(_SEL_HEAD + self.sel_cap, dtype=np.int32)   # what a step uploads to seq_len_dev
        self._sel_host = self._upload[_SEL_HEAD:]   # the host top-k writes the selection here
        self._staged: np.ndarray | None = None      # the selection _host_select left in _sel_host
        self._ident = np.arange(-(-self.sel_cap // MIN_BLOCK_SIZE), dtype=np.int32)
        self._prefill_scores_host = np.empty(0, dtype=np.float32)   # a prefill slab's scores, grown on demand

    def _prepare_decode(self) -> None:
        """The per-token stages' prepared work: packs filled once by name (per call only the named slots that change
        are stored, as already-checked Python ints, and one prepared launch runs), the GEMM, the argument checks."""
        ptr_arg = functools.partial(_args.pointer_arg, device=self._device)   # refuses other devices' memory
        gpu, hd, n_heads, ratio = self.gpu, self.hd, self.n_heads, self.ratio
        self._gemm = proj_dense(gpu, self.qk_proj_w, self.qk_scratch, self.qk_width, self.hidden, INGEST_SLAB)
        # plain ints of the addresses the decode stages pass on (an int is _args's fast path; a DevicePtr is not)
        self._key_cols = int(self.qk_scratch) + n_heads * hd * 2   # the raw key: the last hd columns of a qk row
        self._scores_addr, self._upload_addr, self._table_addr = (int(p) for p in (self.scores_dev, self.seq_len_dev,
                                                                                  self.table_dev))
        self._pool_pack = self._k_pool.pack(raw_keys=0, k_norm_w=self.k_norm_w, block_keys=0, first_block=0,
                                            ratio=ratio, hd=hd, rot=self.rot, theta=self.theta, eps=self.eps)
        self._qprep_pack = self._k_qprep.pack(q_in=self.qk_scratch, q_norm_w=self.q_norm_w, q_out=self.q_post, hd=hd,
                                              rot=self.rot, pos=0, theta=self.theta, eps=self.eps)
        self._score_pack = self._k_score.pack(q=self.q_post, block_keys=0, scores=self.scores_dev, n_blocks=0,
                                              n_heads=n_heads, hd=hd)
        self._gather_pack = self._k_gather.pack(k_cache=0, v_cache=0, block_table=0, sel=self.sel_dev,
                                                k_out=self.k_scratch, v_out=self.v_scratch, block_size=MIN_BLOCK_SIZE,
                                                nkv=self.nkv_attn, hd=self.hd_attn)
        pool, qprep, score, gather = self._pool_pack, self._qprep_pack, self._score_pack, self._gather_pack
        self._pool_raw, self._pool_keys, self._pool_first = (pool.slot(n) for n in ("raw_keys", "block_keys",
                                                                                     "first_block"))
        self._qprep_pos = qprep.slot("pos")
        self._score_keys, self._score_n = score.slot("block_keys"), score.slot("n_blocks")
        self._gather_k, self._gather_v, self._gather_table, self._gather_bs = (
            gather.slot(n) for n in ("k_cache", "v_cache", "block_table", "block_size"))
        row_smem = kq.row_smem_bytes(hd)
        self._run_pool = launcher(gpu, self._k_pool, (hd, 1, 1), row_smem, pool)
        self._run_qprep = launcher(gpu, self._k_qprep, (hd, 1, 1), row_smem, qprep)
        self._run_score = launcher(gpu, self._k_score, (kq.SCORE_THREADS, 1, 1), kq.score_smem_bytes(n_heads, hd),
                                   score)
        self._run_gather = launcher(gpu, self._k_gather, (kq.GATHER_THREADS, 1, 1), 0, gather)
        # the decode call's device-array arguments, prepared (sizes given per call where they vary)
        self._normed_arg = ptr_arg("normed", self.hidden * 2, 2, "bf16",
                                             what=f"the token's attention input [hidden] = [{self.hidden}] bf16")
        self._hidden_arg = ptr_arg("hidden", None, 2, "bf16",
                                             what=f"the chunk's attention input [num_tokens, {self.hidden}] bf16")
        pool_what = "a paged cache [pages, block_size, nkv_attn, hd_attn] bf16: at least one page"
        self._k_pool_arg = ptr_arg("k_pool", None, 2, "bf16", what=pool_what)
        self._v_pool_arg = ptr_arg("v_pool", None, 2, "bf16", what=pool_what)
        self._table_arg = ptr_arg("block_table_dev", None, 4, "i32",
                                            what="the sequence's i32 page table: ceil((pos + 1) / block_size) entries")

    # -- lifetime -------------------------------------------------------------------------------------
    def _alloc(self, nbytes: int, label: str = "the indexer's device-decode buffers") -> DevicePtr:
        """``nbytes`` from the backend, freed by close (or the finalizer); ``label`` names it when a caller's pointer
        overlaps it."""
        ptr = DevicePtr(self.gpu.alloc(nbytes))
        self._owned.append(ptr)
        self._mine.add(int(ptr), nbytes, label)
        self._owned_gen += 1
        return ptr

    def _release(self, ptr: DevicePtr) -> None:
        """Free one buffer of ``_alloc`` before close (a grown scratch's old one, a released state's keys); freed
        once even if the free fails."""
        self._owned.remove(ptr)
        self._mine.remove(int(ptr))
        self._owned_gen += 1
        self.gpu.free(ptr)

    # -- the checks every entry point makes of caller memory and streams, before any device work -------------
    def _check_caller(self, what: str, ranges: tuple[tuple[str, int, int, bool], ...]) -> None:
        """The caller memory of one call, each ``(name, address, bytes, written)``: none may overlap memory this
        indexer owns (its scratch, tables, pinned staging, the sequences' keys), and no written one another argument
        of the call (:func:`hss._args.disjoint`). A pool read through page ids spans :func:`hss._args.extent`."""
        mine, wrote = self._mine, False
        for name, p, n, w in ranges:
            try:
                mine.check(p, n, name, "this QsaIndexer")
            except HssError as exc:
                raise HssError(f"QsaIndexer.{what}: {exc}") from None
            wrote = wrote or w
        if wrote:
            _args.disjoint(f"QsaIndexer.{what}", *ranges)

    def _stream(self, stream: Any, what: str) -> int:
        """The raw handle of a stream argument, refused when it is a stream of another context than this indexer's
        (its memory and kernels live there); a stream that passed once passes at once later."""
        s = stream if type(stream) is int and stream >= 0 else _args.stream(stream)
        if _args.DEVICES.many and s not in self._streams_ok:
            self._check_stream(s, what)
        return s

    def _check_stream(self, s: int, what: str) -> None:
        """Raise unless raw stream ``s`` is of this indexer's context (remembered once it is)."""
        if s in (0, 1, 2):   # the legacy and per-thread default streams: the current context's, this indexer's
            return
        try:
            handle, owner = stream_context(s)
        except CudaError as exc:
            raise HssError(f"QsaIndexer.{what}: stream {s:#x} is not a live stream ({exc.name}); pass a stream of "
                           f"device {self._device}") from None
        if handle != self._ctx_handle:
            where = f"device {owner.ordinal}" if owner is not None else "another context"
            raise HssError(f"QsaIndexer.{what}: stream {s:#x} belongs to {where}, but this indexer works on device "
                           f"{self._device}; pass a stream of device {self._device}")
        self._streams_ok.add(s)

    def close(self) -> None:
        """Free the layer's device and pinned buffers and every live state's key buffers (those states read as
        released). Idempotent; attempts every free, raises the first error. An indexer dropped without close()
        frees its device memory when it is collected (a finalizer)."""
        first: BaseException | None = None
        if self._dev is not None:
            dev, self._dev = self._dev, None
            try:
                dev.close()
            except Exception as exc:
                first = exc
        finalizer, self._finalizer = self._finalizer, None
        if finalizer is not None:
            finalizer.detach()
        try:
            _free_all(self.gpu, self._owned, self._states, raising=True)
        except Exception as exc:   # every free was attempted
            first = first or exc
        self._mine.clear()
        self._backup = None
        if self._pinned is not None:
            pinned, self._pinned = self._pinned, None
            try:
                pinned.close()
            except Exception as exc:
                first = first or exc
        self._closed = True
        if first is not None:
            raise first

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> QsaIndexer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"QsaIndexer(n_heads={self.n_heads}, hd={self.hd}, ratio={self.ratio}, budget={self.budget}, "
                f"rot={self.rot}, max_tokens={self.max_tokens}{', closed' if self._closed else ''})")

    # -- sequence state -------------------------------------------------------------------------------
    def new_seq_state(self) -> QsaSeqState:
        """A fresh sequence (counters 0) with its raw-key and block-key buffers (not zeroed) and a free slot of the
        device arrays (an error when all ``max_seqs`` are taken). Blocking, briefly: the slot's descriptor and
        position 0 are written on a private stream of the indexer, and waited for (never call it while this
        thread captures a graph). A failure frees what it allocated."""
        self._check_open("new_seq_state")
        dev = self._dev
        dev.check_free_slot()
        made: list[DevicePtr] = []
        try:
            made.append(self._alloc(self.max_tokens * self.hd * 2, "a sequence state's raw keys"))
            made.append(self._alloc(self.max_tokens // self.ratio * self.hd * 2, "a sequence state's block keys"))
            st = QsaSeqState(made[0], made[1], self, dev.take_slot(made[0], made[1]))
        except BaseException:
            for ptr in made:
                self._release(ptr)
            raise
        self._states.add(st)
        return st

    def release_seq_state(self, st: QsaSeqState) -> None:
        """Free ``st``'s buffers, nulling each pointer, and its slot. ``st`` must be a state of this indexer (an
        :class:`HssError` otherwise: it frees nothing). Idempotent (a state already released, or freed by this
        indexer's close, is a no-op); attempts both frees even if the first fails, then raises the first error."""
        if not isinstance(st, QsaSeqState):
            raise TypeError(f"release_seq_state needs a QsaSeqState, not {type(st).__name__}")
        if st.released:
            return
        if st._owner() is not self:
            raise HssError("QsaIndexer.release_seq_state: this QsaSeqState belongs to another indexer; release it "
                           "with the indexer whose new_seq_state made it")
        first: BaseException | None = None
        if st._slot >= 0 and self._dev is not None:
            self._dev.give_slot(st._slot)   # cached batches holding st can never match again: they age out
        st._slot = -1
        self._states.discard(st)
        for name in ("raw_keys", "block_keys"):
            ptr = getattr(st, name)
            if ptr.is_null():
                continue
            setattr(st, name, DevicePtr(0))
            try:
                self._release(ptr)
            except Exception as exc:
                first = first or exc
        if first is not None:
            raise first

    def inert_bound(self) -> int:
        """``budget + ratio - 1`` (2051): the largest count of visible tokens whose selection is provably
        every token (decode_select returns None while visible <= this); the first selective 0-based position
        is ``inert_bound()`` itself (visible ``inert_bound() + 1``)."""
        return self.budget + self.ratio - 1

    # -- argument checks shared by the entry points ----------------------------------------------------
    _f32 = staticmethod(f32_arg)

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise HssError(f"QsaIndexer.{what}: the indexer is closed")

    def _check_state(self, st: Any, what: str) -> None:
        self._check_open(what)
        if not isinstance(st, QsaSeqState):
            raise TypeError(f"QsaIndexer.{what} needs a QsaSeqState (from new_seq_state), not {type(st).__name__}")
        if st._owner() is not self:
            raise HssError(f"QsaIndexer.{what}: this QsaSeqState belongs to another indexer; use the state that "
                           "this indexer's new_seq_state returned")
        if not (st.raw_keys and st.block_keys):
            raise HssError(f"QsaIndexer.{what}: the QsaSeqState was released; make a new one with new_seq_state()")

    def _block_size(self, block_size: Any) -> int:
        """A paged cache's tokens per page (>= MIN_BLOCK_SIZE: the identity and prefill tables are sized so)."""
        return _args.as_int("block_size", block_size, MIN_BLOCK_SIZE, _I32,
                            why=f"tokens per page; the identity and prefill tables are sized for pages of at least "
                                f"{MIN_BLOCK_SIZE} tokens")

    # -- prefill ingest (SPEC §11.3) -----------------------------------------------------------------
    def prefill_ingest(self, st: QsaSeqState, hidden: Any, num_tokens: int, seq_start: int, stream: Any) -> None:
        """Project ``num_tokens`` rows of ``hidden`` (``[num_tokens, hidden]`` bf16, the attention layer's input
        for positions ``seq_start ..``), store their raw keys and pool every newly complete block, on ``stream``.

        ``seq_start == 0`` starts the sequence over; otherwise it must equal ``st.ingested``. Every argument is
        checked (``hidden`` against ``num_tokens * hidden * 2`` bytes, and against the indexer's own memory) before
        any device work. All or nothing: the counters change only once every operation is queued; a call that fails
        (a driver error, an interrupt) leaves the sequence as it was, counters and keys, and can be retried. A
        restart (``seq_start == 0``) of a state holding tokens first saves the raw keys it overwrites (a device copy
        into a buffer of the indexer, allocated at the first such restart) and restores them if it fails.
        """
        self._check_state(st, "prefill_ingest")
        num_tokens = _args.as_int("num_tokens", num_tokens, 0, _I32)
        seq_start = _args.as_int("seq_start", seq_start, 0, _I32)
        ingested = 0 if seq_start == 0 else st.ingested
        if seq_start != ingested:
            raise HssError(f"QSA: prefill chunk starts at {seq_start} but {st.ingested} tokens are ingested: a "
                           "prefix-cache skip bypassed the indexer. Feed every prefill chunk through prefill_ingest "
                           "in order (or disable the prefix cache) until QSA learns to re-ingest cached prefixes")
        if seq_start + num_tokens > self.max_tokens:
            raise HssError(f"QSA: {seq_start + num_tokens} tokens exceed max_tokens = {self.max_tokens}; construct "
                           "the indexer with a larger max_tokens= (or env HSS_QSA_MAX_TOKENS)")
        row = self.hidden * 2
        s = self._stream(stream, "prefill_ingest")
        with _args.deferred_joins():
            src = self._hidden_arg(hidden, s, num_tokens * row)
            self._check_caller("prefill_ingest", (("hidden", src, num_tokens * row, False),))
        total = seq_start + num_tokens
        old = (st.ingested, st.pooled)
        first_block = 0 if seq_start == 0 else st.pooled
        # a restart overwrites the state's first rows: keep them until the call commits
        keep = min(old[0], num_tokens) * self.hd * 2 if seq_start == 0 else 0
        saved = False
        try:
            if keep:
                backup = self._backup_buffer()
                self.gpu.copy_d2d_async(st.raw_keys, backup, keep, s)
                saved = True
            self._queue_ingest(st, src, num_tokens, seq_start, s)
            self._launch_pool(st, first_block, total // self.ratio - first_block, s)
            self._commit(st, total, total // self.ratio, s)
        except BaseException:
            if saved:
                self._restore_rows(st, keep, old, total // self.ratio, s)
            raise

    def _queue_ingest(self, st: QsaSeqState, src: int, num_tokens: int, seq_start: int, s: int) -> None:
        """The qk GEMM of ``num_tokens`` rows at ``src`` in slabs, each slab's raw-key columns copied into
        ``st.raw_keys`` from row ``seq_start`` (no state change)."""
        row, hd, qkw = self.hidden * 2, self.hd, self.qk_width
        for off in range(0, num_tokens, INGEST_SLAB):
            rows = min(INGEST_SLAB, num_tokens - off)
            self._gemm(src + off * row, rows, s)
            self.gpu.copy_d2d_2d_async(self._key_cols, qkw * 2, st.raw_keys + (seq_start + off) * hd * 2, hd * 2,
                                       hd * 2, rows, s)

    def _commit(self, st: QsaSeqState, ingested: int, pooled: int, s: int) -> None:
        """The last step of a call: the counters, then the device position (undone on the host if it fails)."""
        old = st.ingested, st.pooled
        st.ingested, st.pooled = ingested, pooled
        try:
            self._dev.store_pos(st, s)
        except BaseException:
            st.ingested, st.pooled = old
            raise

    def _backup_buffer(self) -> DevicePtr:
        if self._backup is None:
            self._backup = self._alloc(self.max_tokens * self.hd * 2, "the indexer's restart backup")
        return self._backup

    def _restore_rows(self, st: QsaSeqState, keep: int, old: tuple[int, int], complete: int, s: int) -> None:
        """Undo a failed restart: the saved raw keys back, the blocks it may have pooled over pooled again (the same
        kernel on the same keys: the same bits). If even that fails the sequence is left empty (a consistent state:
        restart it), and the original error is raised."""
        try:
            self.gpu.copy_d2d_async(self._backup, st.raw_keys, keep, s)
            self._launch_pool(st, 0, min(old[1], complete), s)
        except BaseException:
            st.ingested = st.pooled = 0
            try:
                self._dev.store_pos(st, s)
            except BaseException:
                pass

    def _pool_new_blocks(self, st: QsaSeqState, s: int) -> None:
        complete = st.ingested // self.ratio
        if complete > st.pooled:
            self._launch_pool(st, st.pooled, complete - st.pooled, s)
            st.pooled = complete

    def _launch_pool(self, st: QsaSeqState, first: int, n_new: int, s: int) -> None:
        """qsa_block_pool of blocks first .. first + n_new - 1 of ``st`` (nothing when n_new is 0)."""
        if n_new:
            self._pool_raw.value = st.raw_keys
            self._pool_keys.value = st.block_keys
            self._pool_first.value = first
            self._run_pool(s, n_new)

    # -- prefill selection (SPEC §11.5) ------------------------------------------------------------------
    def prefill_scratch_bytes(self, total_tokens: int) -> int:
        """Bytes of the scratch ``prefill_select`` needs while the sequence holds ``total_tokens`` tokens (it
        grows with the sequence; size it for the longest, e.g. ``max_tokens``). Layout in :mod:`hss.qsa.prefill`."""
        total = _args.as_int("total_tokens", total_tokens, 0, self.max_tokens)
        return prefill.prefill_scratch_bytes(total, self.qk_width, self.n_heads, self.hd, self.ratio, self.block_topk)

    def prefill_select(self, st: QsaSeqState, normed: Any, q_roped: Any, attn_ctx: Any, k_pool: Any, v_pool: Any,
                       seq_block_table: Any, seq_start: int, num_tokens: int, nq: int, block_size: int,
                       inv_sqrt_d: float, scratch: Any, stream: Any) -> int:
        """Rewrite the rows of a prefill chunk at global positions >= ``inert_bound()`` with attention over
        exactly their selected tokens; rows below the bound keep the dense output. Returns the rows rewritten.

        Call after ``prefill_ingest`` of this chunk (``st.ingested == seq_start + num_tokens``), once the chunk's
        K/V are in the paged cache and its dense attention has written ``attn_ctx``. Chunk-local rows, bf16:
        ``normed [num_tokens, hidden]`` (the attention input), ``q_roped [num_tokens, nq, hd_attn]`` (the main
        attention's roped queries), ``attn_ctx [num_tokens, nq * hd_attn]`` (pre-gate, pre-o_proj; rewritten in
        place). ``k_pool`` / ``v_pool``: paged NHD ``[pages, block_size, nkv_attn, hd_attn]``, holding every page
        the table names; ``seq_block_table``: the host block table (ints, logical -> physical page), at least
        ``ceil((seq_start + num_tokens) / block_size)`` entries, uploaded here; ``block_size`` >= 8;
        ``inv_sqrt_d``: the attention scale; ``scratch``: a device buffer whose size hss knows (a DeviceBuffer or
        a view of one, an address inside one, a torch tensor, a ``__cuda_array_interface__`` or ``__dlpack__``
        object) of at least ``prefill_scratch_bytes(seq_start + num_tokens)`` bytes. The device arrays are
        checked against those sizes (16-byte aligned where the kernels load vectors), every argument before any
        device work; ``scratch`` and ``attn_ctx`` (written) may overlap neither the indexer's own memory nor another
        argument. The sequence is never changed: a call that fails part way (a driver error, an interrupt during a
        scores' wait) may have rewritten the rows of its earlier slabs, with their final values, and can be retried.
        A no-op (returning 0) while ``seq_start + num_tokens <= inert_bound()`` or when prefill
        selection is switched off (``no_prefill_select`` / ``HSS_QSA_NO_PREFILL_SELECT=1``). Blocks the host
        once per slab of 2048 selective rows (the scores' D2H on ``stream``).
        """
        return prefill.prefill_select(self, st, normed, q_roped, attn_ctx, k_pool, v_pool, seq_block_table,
                                      seq_start, num_tokens, nq, block_size, inv_sqrt_d, scratch, stream)

    # -- snapshots (SPEC §11.6, §17.7) ---------------------------------------------------------------------
    def snapshot_aux(self, st: QsaSeqState, stream: Any) -> bytes:
        """``st`` as a blob: ``ingested`` u64 LE | ``pooled`` u64 LE | raw keys of tokens 0..ingested-1 (bf16) --
        the original's layout -- then a 20-byte hss trailer (magic ``HSSQ``, version, config fingerprint, CRC32 of
        the rest; SPEC §17.7).

        Blocking, as the original: the raw keys' D2H is ordered after prior work on ``stream`` and waited for."""
        return snapshot.snapshot_aux(self, st, stream)

    def restore_aux(self, st: QsaSeqState, blob: Any, stream: Any) -> None:
        """Make ``st`` the sequence ``blob`` (from ``snapshot_aux``) describes: its raw keys uploaded and its
        ``pooled`` blocks pooled again on ``stream`` (bit-identical block keys); ``table_len`` untouched.

        A blob shorter than its 16-byte header, of a length other than ``16 + ingested * hd * 2`` (+ 20 with the hss
        trailer), with ingested > max_tokens or pooled > ingested // ratio, or whose trailer does not verify (another
        magic or version, another indexer configuration, a CRC mismatch) is rejected before any device write; the
        original's blob without a trailer is accepted. All or nothing, like ``prefill_ingest``: a restore that fails
        leaves ``st`` as it was. The blob may be dropped when this returns (the upload is staged)."""
        snapshot.restore_aux(self, st, blob, stream)

    def _restore(self, st: QsaSeqState, ingested: int, pooled: int, raw: Any, s: int) -> None:
        """restore_aux's device part on checked values: the rows it overwrites saved first, committed last."""
        old = (st.ingested, st.pooled)
        keep = min(old[0], ingested) * self.hd * 2
        saved = False
        try:
            if keep:
                self.gpu.copy_d2d_async(st.raw_keys, self._backup_buffer(), keep, s)
                saved = True
            if ingested:
                self.gpu.copy_h2d_async(raw, st.raw_keys, s)   # pageable: staged before the call returns
            self._launch_pool(st, 0, pooled, s)
            self._commit(st, ingested, pooled, s)   # the device position follows the mirror (SPEC §17.2)
        except BaseException:
            if saved:
                self._restore_rows(st, keep, old, pooled, s)
            raise

    # -- decode (SPEC §11.4) -----------------------------------------------------------------------------
    def decode_select(self, st: QsaSeqState, normed: Any, pos: int, k_pool: Any, v_pool: Any, block_table_dev: Any,
                      block_size: int, stream: Any) -> QsaSelection | None:
        """Ingest the token at 0-based ``pos`` and, past the inert bound, select what it attends.

        Call after the token's K/V are in the paged cache. ``normed``: the token's attention input ``[hidden]``
        bf16. ``k_pool`` / ``v_pool``: paged NHD caches ``[pages, block_size, nkv_attn, hd_attn]`` bf16 (at least
        one page); ``block_table_dev``: the sequence's i32 logical -> physical page table (at least
        ``ceil((pos + 1) / block_size)`` entries); ``block_size`` >= 8. Every argument is checked before any device
        work (none may overlap the indexer's own memory). Returns None while ``pos + 1 <= inert_bound()`` (dense
        attention is exact), else a :class:`QsaSelection`. Blocks the host once per selective step (the scores' D2H on
        ``stream``). All or nothing: the token counts as ingested only once the whole step is queued; a step that
        fails (a driver error, an interrupt during the scores' wait) leaves the sequence as it was and can be retried.
        """
        self._check_state(st, "decode_select")
        pos = _args.as_int("pos", pos, 0, _I32)
        if pos != st.ingested:
            raise HssError(f"QSA: decode at pos {pos} but {st.ingested} tokens ingested: the indexer cache lost sync "
                           "(prefix-cache skip or a rewound sequence); ingest every earlier token first")
        if pos >= self.max_tokens:
            raise HssError(f"QSA: pos {pos} >= max_tokens = {self.max_tokens}; construct the indexer with a larger "
                           "max_tokens= (or env HSS_QSA_MAX_TOKENS)")
        block_size = self._block_size(block_size)
        visible = pos + 1
        page = block_size * self._kv_row
        table_bytes = 4 * -(-visible // block_size)
        s = self._stream(stream, "decode_select")
        with _args.deferred_joins():
            x = self._normed_arg(normed, s)
            kc = self._k_pool_arg(k_pool, s, page)
            vc = self._v_pool_arg(v_pool, s, page)
            table = self._table_arg(block_table_dev, s, table_bytes)
            self._check_caller("decode_select", (("normed", x, self.hidden * 2, False),
                                                 ("k_pool", kc, _args.extent(k_pool, kc, page), False),
                                                 ("v_pool", vc, _args.extent(v_pool, vc, page), False),
                                                 ("block_table_dev", table, table_bytes, False)))
        pooled = self._queue_token(st, x, pos, s)
        complete = visible // self.ratio
        if complete <= self.block_topk:
            self._commit(st, visible, pooled, s)
            return None   # provably every token: dense attention is exact
        self._score_blocks(st, pos, complete, s)
        tokens = self._host_select(complete, visible, s)
        sel = self._queue_gather(tokens, kc, vc, table, block_size, st.table_len, s)
        self._commit(st, visible, pooled, s)
        st.table_len = max(st.table_len, sel.max_blocks)
        return sel

    # -- batched device decode (SPEC §17.2-§17.4) ------------------------------------------------
    def decode_select_batch(self, states: list[QsaSeqState] | tuple[QsaSeqState, ...], normed: Any, block_tables: Any,
                            block_size: int, stream: Any, *, max_pages: int | None = None) -> QsaDeviceSelection:
        """One decode step of R sequences on the device: ingest each one's token at its device position, pool a
        block it completes, and select what it attends (SPEC §17.1: the inert regime selects every visible token).

        ``states``: R distinct live states of this indexer (1 <= R <= max_seqs; a tuple is cached fastest), each
        with ``ingested < max_tokens``; ``normed`` bf16 ``[R, hidden]``: row r is sequence r's attention input for
        its position ``states[r].ingested``; ``block_tables`` i32 ``[R, max_pages]``: row r is sequence r's logical
        -> physical page table (``max_pages`` from the array's shape, or ``max_pages=``; a row must hold the
        sequence's visible tokens), kept in the selection for :meth:`sparse_decode_attention`; ``block_size`` >= 8
        tokens per page. Every argument is checked before any device work or state change (neither array may overlap
        the indexer's memory).

        Queues on ``stream``: the slots' copy, the qk GEMM (m = R), ``qsa_dev_prep``, ``qsa_dev_score``,
        ``qsa_dev_topk`` (which advances the device positions). Nothing blocks or reads the device, so it can be
        captured; the host mirrors (``ingested``, ``pooled``) advance by one now, or, inside an hss capture, at
        each replay of the graph (``torch.cuda.graph``: call :meth:`QsaSeqState.sync` after replays). Returns a
        :class:`QsaDeviceSelection` (``tokens_dev`` i32 ``[R, budget + ratio]``, ``counts_dev`` i32 ``[R]``), views
        of this indexer's buffers valid until its next ``decode_select_batch``.

        Batches are cached by their tuple of states (256 compositions per indexer): a new one past that recycles the
        least recently used one no capture holds, after waiting for the stream of its last step (long finished in
        practice). A captured batch keeps its entry for the indexer's lifetime (the graph's copy reads it).
        """
        return device.select_batch(self, states, normed, block_tables, block_size, stream, max_pages)

    def sparse_decode_attention(self, q: Any, k_pool: Any, v_pool: Any, block_tables: Any,
                                selection: QsaDeviceSelection, out: Any, stream: Any, scale: float | None = None, *,
                                nq: int | None = None) -> None:
        """Attention of each sequence's queries over exactly its selected tokens, read through its page table (no
        gather; SPEC §17.4): ``out[r, h] = softmax_t(q[r, h] . K[t, h // (nq / nkv_attn)] * scale) V[t, ...]``.

        ``q`` bf16 ``[R, nq, hd_attn]`` (the main attention's roped queries; ``nq`` from its shape or ``nq=``, a
        multiple of ``nkv_attn``, at most 16 per KV head); ``k_pool`` / ``v_pool``: paged NHD caches ``[pages,
        block_size, nkv_attn, hd_attn]`` bf16 holding every page the tables name (a negative page id contributes
        nothing); ``block_tables``: None for the selection's, else i32 ``[R, selection.max_pages]``; ``selection``:
        this indexer's latest :meth:`decode_select_batch` result; ``out`` bf16 ``[R, nq, hd_attn]`` (written; a
        sequence with no selected token gets zeros); ``scale``: default ``1 / sqrt(hd_attn)``. Two launches on
        ``stream`` (split-K partials of 128 tokens, then a log-sum-exp merge in split order: the bits depend only on
        each sequence's token list); capturable. Every argument is checked before any device work: none may overlap
        the indexer's memory, nor ``out`` another argument (a pool as far as it reaches: its stated size, else to the
        end of the hss buffer holding the address).
        """
        device.sparse_attention(self, q, k_pool, v_pool, block_tables, selection, out, stream, scale, nq)

    # The decode stages, separately callable so the benchmark can time each one; they take checked ints.
    def _ingest_token(self, st: QsaSeqState, normed: int, pos: int, s: int) -> None:
        """:meth:`_queue_token`, then commit the token (the counters and the device position)."""
        self._commit(st, pos + 1, self._queue_token(st, normed, pos, s), s)

    def _queue_token(self, st: QsaSeqState, normed: int, pos: int, s: int) -> int:
        """qk GEMV of the token into qk_scratch row 0; its raw key into raw_keys[pos]; pool a block it completes.
        Changes no counter (what it writes lies past the sequence's rows and blocks); returns the pooled count."""
        hd2 = self.hd * 2
        self._gemm(normed, 1, s)
        self.gpu.copy_d2d_async(self._key_cols, st.raw_keys + pos * hd2, hd2, s)
        complete = (pos + 1) // self.ratio
        self._launch_pool(st, st.pooled, complete - st.pooled, s)
        return max(complete, st.pooled)

    def _score_blocks(self, st: QsaSeqState, pos: int, complete: int, s: int) -> None:
        """q prep at ``pos`` into q_post, then the scores of blocks 0..complete-1 into scores_dev."""
        self._qprep_pos.value = pos
        self._run_qprep(s, self.n_heads)
        self._score_keys.value = st.block_keys
        self._score_n.value = complete
        self._run_score(s, kq.score_grid(complete, self.hd))

    def _host_select(self, complete: int, visible: int, s: int) -> np.ndarray:
        """Blocking D2H of the scores, then the host top-k: the selected tokens (a view of a reused buffer)."""
        host = self._scores_host[:complete]
        self.gpu.copy_d2h_on_stream(self._scores_addr, host, s)
        self._staged = _select_tokens(host, self.block_topk, self.ratio, visible, self._sel_host)
        return self._staged

    def _gather(self, st: QsaSeqState, tokens: np.ndarray, k_pool: int, v_pool: int, table: int, block_size: int,
                s: int) -> QsaSelection:
        """:meth:`_queue_gather` for ``st`` (its identity table grown when needed)."""
        sel = self._queue_gather(tokens, k_pool, v_pool, table, block_size, st.table_len, s)
        st.table_len = max(st.table_len, sel.max_blocks)
        return sel

    def _queue_gather(self, tokens: np.ndarray, k_pool: int, v_pool: int, table: int, block_size: int,
                      table_len: int, s: int) -> QsaSelection:
        """Upload seq_len and the selection (one copy), gather its K/V rows, upload the identity table when it needs
        more than ``table_len`` pages."""
        n_sel = tokens.size
        gpu, up = self.gpu, self._upload
        if tokens is not self._staged:   # a selection made elsewhere (the benchmark times the top-k alone)
            up[_SEL_HEAD:_SEL_HEAD + n_sel] = tokens
        up[0] = n_sel
        gpu.copy_h2d_async(up[:_SEL_HEAD + n_sel], self._upload_addr, s)   # pageable: staged before it returns
        self._gather_k.value = k_pool
        self._gather_v.value = v_pool
        self._gather_table.value = table
        self._gather_bs.value = block_size
        self._run_gather(s, n_sel)
        pages = -(-n_sel // block_size)
        if table_len < pages:
            gpu.copy_h2d_async(self._ident[:pages], self._table_addr, s)
        return QsaSelection(self.k_scratch, self.v_scratch, self.table_dev, self.seq_len_dev, n_sel, pages,
                            tokens.copy())
