"""The QSA indexer (docs/design.md §10, §11): ``QsaIndexer`` (the ``QsaSeqState`` and ``QsaSelection`` it hands out are
in :mod:`hss.qsa.state`).

The attention layer's input is projected to ``n_heads`` query heads and one raw key per token; the visible
prefix is cut into blocks of ``ratio`` tokens whose keys are mean-pooled, RMS-normed and roped at the
block's first position; a decode query attends the top ``budget // ratio`` blocks by
``sum_h relu(q_h . k_b) / sqrt(hd)`` plus the incomplete tail. While ``visible <= inert_bound()``
(``budget + ratio - 1``) every token is selected, so ``decode_select`` returns ``None`` and the caller runs
dense attention; past it, the selected tokens' K/V rows are gathered into a contiguous scratch that the
ordinary paged decode attention reads through an identity block table. ``prefill_select`` (in
:mod:`hss.qsa.prefill`) rewrites the selective rows of a prefill chunk's attention output;
``snapshot_aux`` / ``restore_aux`` (in :mod:`hss.qsa.snapshot`) save and restore a sequence.

The device-resident batched decode (docs/design.md §17.2-§17.4; host code in :mod:`hss.qsa.device`):
``decode_select_batch`` runs ingest and selection for R sequences with the positions on the device (no host sync,
graph-capturable) and ``sparse_decode_attention`` attends each sequence's selected tokens through its page table.
Every state holds a slot of the indexer's device arrays; every host path keeps ``pos_dev[slot]`` equal to
``st.ingested`` in stream order.

The indexer's other parts live beside it: :mod:`hss.qsa.settings` (its scalar rules and dimensions),
:mod:`hss.qsa.resources` (the memory it owns; the checks of caller memory and streams), :mod:`hss.qsa.keys` (raw
keys written, blocks pooled, counters committed). They and the modules above reach the indexer only through its
internal API (``resources``, ``check_open``, ``check_state``, ``device_state``, ``pool_new_blocks``).

Differences from the original (docs/design.md §0): methods use the indexer's own ``gpu`` (no ``gpu`` argument);
every argument is read by :mod:`hss._args` (ints, floats, device pointers checked against the bytes the call
reads or writes, streams) and every input error (an :class:`~hss.errors.HssError`, a ``TypeError`` for a wrong
type) is raised before any device work or state change; ``block_size < 8`` is rejected (the identity table holds
``ceil((budget + ratio) / 8)`` pages); ``QsaSelection.tokens`` carries the host copy of the selection; an
unparsable ``HSS_QSA_MAX_TOKENS`` (or a flag other than 0/1) is an error rather than silently the default. The
prefill kernels ``qsa_qprep_rows``, ``qsa_score_rows`` and ``qsa_prefill_attn`` are required; the tensor-core
scorer ``qsa_score_rows_tc`` and the fast attention ``qsa_prefill_attn_tc`` are optional (``try_kernel``).
"""
from __future__ import annotations

import weakref
from typing import Any

import numpy as np

from hss import _args
from hss import cuda_min as cm
from hss._util import Closeable, ceil_div
from hss.cuda._context import owner_context
from hss.cuda.gpu import DevicePtr, GpuBackend, launcher, proj_dense
from hss.decls import qsa as kq
from hss.decls import qsa_prefill as kp
from hss.errors import HssError
from hss.qsa import device, prefill, settings, snapshot
from hss.qsa.device import QsaDeviceSelection
from hss.qsa.keys import INGEST_SLAB, KeyWriter
from hss.qsa.resources import IndexerResources
from hss.qsa.select import select_tokens_unchecked
from hss.qsa.settings import DEFAULT_MAX_TOKENS, MIN_BLOCK_SIZE, block_size_arg, env_flag
from hss.qsa.state import QsaSelection, QsaSeqState

__all__ = ["QsaIndexer", "QsaSeqState", "QsaSelection", "QsaDeviceSelection", "INGEST_SLAB", "MIN_BLOCK_SIZE",
           "DEFAULT_MAX_TOKENS", "env_flag"]

MODULE = kq.MODULE
_I32 = 2**31 - 1
_SEL_HEAD = 4               # i32 slots before the selection in the seq_len / selection upload


def _free_all(res: IndexerResources, states: weakref.WeakSet, raising: bool = False) -> None:
    """Mark ``states`` released and free every allocation of ``res``: ``QsaIndexer.close``, and its finalizer (which
    holds only these, never the indexer). Attempts every free; ``raising``: raise the first error."""
    for st in list(states):
        st.raw_keys = st.block_keys = DevicePtr(0)
        st.drop_slot()
    states.clear()
    res.free_all(raising)


class QsaIndexer(Closeable):
    """One full-attention layer's QSA indexer (docs/design.md §11.1).

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
        # the live states, to mark them released when the indexer closes or is collected
        self._states: weakref.WeakSet[QsaSeqState] = weakref.WeakSet()
        self._finalizer: weakref.finalize | None = None
        self._pinned: cm.PinnedBuffer | None = None
        self._dev: device.DeviceState | None = None
        # every check first: nothing touches the device before they pass
        dims = settings.layer_dims(n_heads, hd, ratio, budget, rot, theta, eps, hidden, nkv_attn, hd_attn, max_tokens)
        (self.n_heads, self.hd, self.ratio, self.budget, self.rot, self.theta, self.eps, self.hidden, self.nkv_attn,
         self.hd_attn, self.max_tokens, self.block_topk, self.qk_width, self.sel_cap, self.kv_row) = dims
        self.max_seqs = _args.as_int("max_seqs", max_seqs, 1, device.MAX_SEQS,
                                     why="live sequence states (and so the largest batch) of decode_select_batch")
        if nq_attn is not None:
            nq_attn = _args.as_int("nq_attn", nq_attn, 1, _I32, why="the attention's query heads")
            if nq_attn % self.nkv_attn:
                raise HssError(f"QsaIndexer: nq_attn ({nq_attn}) must be a multiple of nkv_attn ({self.nkv_attn})")
        score_scalar = env_flag("HSS_QSA_SCORE_SCALAR", score_scalar)
        self.prefill_select_enabled = not env_flag("HSS_QSA_NO_PREFILL_SELECT", no_prefill_select)
        # the device step's opt-ins (docs/design.md §17.2): programmatic launches, qsa_dev_qk for small batches
        step_options = (env_flag("HSS_QSA_PDL", None), env_flag("HSS_QSA_QK_KERNEL", None))
        hd, qkw = self.hd, self.qk_width
        self.qk_proj_w = DevicePtr(_args.pointer(qk_proj_w, "qk_proj_w", qkw * self.hidden * 2, 2, "bf16",
                                                 what=f"[(n_heads + 1) * hd, hidden] = [{qkw}, {self.hidden}] bf16"))
        self.q_norm_w = DevicePtr(_args.pointer(q_norm_w, "q_norm_w", hd * 2, 2, "bf16", what=f"[hd] = [{hd}] bf16"))
        self.k_norm_w = DevicePtr(_args.pointer(k_norm_w, "k_norm_w", hd * 2, 2, "bf16", what=f"[hd] = [{hd}] bf16"))
        pctx = owner_context(getattr(gpu, "ctx", None))
        device_id = pctx.ordinal
        for name, obj, ptr in (("qk_proj_w", qk_proj_w, self.qk_proj_w), ("q_norm_w", q_norm_w, self.q_norm_w),
                               ("k_norm_w", k_norm_w, self.k_norm_w)):
            where = _args.device_of(obj, int(ptr))
            if where is not None and where != device_id:
                raise HssError(f"QsaIndexer: {name} is memory of device {where}, but the backend (gpu) works on "
                               f"device {device_id}; pass weights of device {device_id}, or a backend of "
                               f"device {where}")
        self.gpu = gpu
        # every allocation (the indexer's and its states') and the pinned staging, shared with the finalizer, which
        # frees what close() did not; caller pointers into any of it are refused, and streams of another context
        self.resources = res = IndexerResources(gpu, device_id, pctx.handle)
        self._closed = False
        self._finalizer = weakref.finalize(self, _free_all, res, self._states)
        try:
            self._prepare(score_scalar)
            self._dev = device.DeviceState(self, res, self._gemm, self.max_seqs, nq_attn, *step_options)
            self._keys = KeyWriter(self, res, self._gemm, self._k_pool, self._dev)
        except BaseException:
            self.close()
            raise

    def _prepare(self, score_scalar: bool) -> None:
        """Kernels, device and host buffers, and the decode stages' prepared launches (named slots)."""
        gpu = self.gpu
        self._k_pool = gpu.kernel(MODULE, "qsa_block_pool")
        self._k_qprep = gpu.kernel(MODULE, "qsa_qprep")
        self._k_score = gpu.kernel(MODULE, "qsa_score")
        self._k_gather = gpu.kernel(MODULE, "qsa_gather")
        # prefill selection (docs/design.md §11.5): three kernels required, the tensor-core variants optional
        self._prefill = prefill.PrefillKernels(self)
        self.uses_tc_scorer = (bool(self._prefill.score_tc) and not score_scalar
                               and (self.n_heads, self.hd) == (kp.TC_HEADS, kp.TC_HD))
        self._allocate()
        self._prepare_decode()

    def _allocate(self) -> None:
        """The layer's device buffers (freed by close) and host staging."""
        gpu, hd, n_heads, max_tokens, ratio = self.gpu, self.hd, self.n_heads, self.max_tokens, self.ratio
        alloc = self.resources.alloc
        self.qk_scratch = alloc(INGEST_SLAB * self.qk_width * 2, "the indexer's qk scratch")
        self.q_post = alloc(n_heads * hd * 4, "the indexer's q_post")
        self.scores_dev = alloc(max_tokens // ratio * 4, "the indexer's block scores")
        # seq_len (one i32) and the selection share one allocation, so that a step uploads both at once:
        # [n_sel, 3 unused | selected tokens], the tokens 16-byte aligned
        self.seq_len_dev = alloc((_SEL_HEAD + self.sel_cap) * 4, "the indexer's seq_len and selection")
        self.sel_dev = self.seq_len_dev.offset(_SEL_HEAD * 4)
        self.k_scratch = alloc(self.sel_cap * self.kv_row, "the indexer's gathered K scratch")
        self.v_scratch = alloc(self.sel_cap * self.kv_row, "the indexer's gathered V scratch")
        self.table_dev = alloc(ceil_div(self.sel_cap, MIN_BLOCK_SIZE) * 4, "the indexer's identity table")
        self.prefill_table_dev = alloc(ceil_div(max_tokens, MIN_BLOCK_SIZE) * 4, "the indexer's prefill table")
        # host side: pinned scores (the blocking D2H of every selective step), pageable uploads
        self._pinned = cm.PinnedBuffer(max_tokens // ratio * 4, getattr(gpu, "ctx", None))
        self.resources.own(self._pinned.ptr, self._pinned.bytes, "the indexer's pinned scores")   # the D2H writes it
        self._scores_host = self._pinned.view(np.float32)
        self._upload = np.zeros(_SEL_HEAD + self.sel_cap, dtype=np.int32)   # what a step uploads to seq_len_dev
        self._sel_host = self._upload[_SEL_HEAD:]   # the host top-k writes the selection here
        self._staged: np.ndarray | None = None      # the selection _host_select left in _sel_host
        self._ident = np.arange(ceil_div(self.sel_cap, MIN_BLOCK_SIZE), dtype=np.int32)

    def _prepare_decode(self) -> None:
        """The per-token stages' prepared work: packs filled once by name (per call only the named slots that change
        are stored, as already-checked Python ints, and one prepared launch runs), the GEMM, the argument checks."""
        ptr_arg = self.resources.pointer_arg   # refuses other devices' memory
        gpu, hd, n_heads = self.gpu, self.hd, self.n_heads
        self._gemm = proj_dense(gpu, self.qk_proj_w, self.qk_scratch, self.qk_width, self.hidden, INGEST_SLAB)
        # plain ints of the addresses the decode stages pass on (an int is _args's fast path; a DevicePtr is not)
        self._scores_addr, self._upload_addr, self._table_addr = (int(p) for p in (self.scores_dev, self.seq_len_dev,
                                                                                  self.table_dev))
        self._qprep_pack = self._k_qprep.pack(q_in=self.qk_scratch, q_norm_w=self.q_norm_w, q_out=self.q_post, hd=hd,
                                              rot=self.rot, pos=0, theta=self.theta, eps=self.eps)
        self._score_pack = self._k_score.pack(q=self.q_post, block_keys=0, scores=self.scores_dev, n_blocks=0,
                                              n_heads=n_heads, hd=hd)
        self._gather_pack = self._k_gather.pack(k_cache=0, v_cache=0, block_table=0, sel=self.sel_dev,
                                                k_out=self.k_scratch, v_out=self.v_scratch, block_size=MIN_BLOCK_SIZE,
                                                nkv=self.nkv_attn, hd=self.hd_attn)
        qprep, score, gather = self._qprep_pack, self._score_pack, self._gather_pack
        self._qprep_pos = qprep.slot("pos")
        self._score_keys, self._score_n = score.slot("block_keys"), score.slot("n_blocks")
        self._gather_k, self._gather_v, self._gather_table, self._gather_bs = (
            gather.slot(n) for n in ("k_cache", "v_cache", "block_table", "block_size"))
        row_smem = kq.row_smem_bytes(hd)
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
            _free_all(self.resources, self._states, raising=True)
        except Exception as exc:   # every free was attempted
            first = first or exc
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

    def __repr__(self) -> str:
        return (f"QsaIndexer(n_heads={self.n_heads}, hd={self.hd}, ratio={self.ratio}, budget={self.budget}, "
                f"rot={self.rot}, max_tokens={self.max_tokens}{', closed' if self._closed else ''})")

    # -- sequence state -------------------------------------------------------------------------------
    def new_seq_state(self) -> QsaSeqState:
        """A fresh sequence (counters 0) with its raw-key and block-key buffers (not zeroed) and a free slot of the
        device arrays (an error when all ``max_seqs`` are taken). Blocking, briefly: the slot's descriptor and
        position 0 are written on a private stream of the indexer, and waited for (never call it while this
        thread captures a graph). A failure frees what it allocated."""
        self.check_open("new_seq_state")
        dev = self._dev
        dev.check_free_slot()
        made: list[DevicePtr] = []
        res = self.resources
        try:
            made.append(res.alloc(self.max_tokens * self.hd * 2, "a sequence state's raw keys"))
            made.append(res.alloc(self.max_tokens // self.ratio * self.hd * 2, "a sequence state's block keys"))
            st = QsaSeqState(made[0], made[1], self, dev.take_slot(made[0], made[1]))
        except BaseException:
            for ptr in made:
                res.release(ptr)
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
        if st.owner is not self:
            raise HssError("QsaIndexer.release_seq_state: this QsaSeqState belongs to another indexer; release it "
                           "with the indexer whose new_seq_state made it")
        first: BaseException | None = None
        if st.slot >= 0 and self._dev is not None:
            self._dev.give_slot(st.slot)   # cached batches holding st can never match again: they age out
        st.drop_slot()
        self._states.discard(st)
        for name in ("raw_keys", "block_keys"):
            ptr = getattr(st, name)
            if ptr.is_null():
                continue
            setattr(st, name, DevicePtr(0))
            try:
                self.resources.release(ptr)
            except Exception as exc:
                first = first or exc
        if first is not None:
            raise first

    def inert_bound(self) -> int:
        """``budget + ratio - 1`` (2051): the largest count of visible tokens whose selection is provably
        every token (decode_select returns None while visible <= this); the first selective 0-based position
        is ``inert_bound()`` itself (visible ``inert_bound() + 1``)."""
        return self.budget + self.ratio - 1

    # -- internal API of hss.qsa (the device path, prefill selection, snapshots, QsaSeqState.sync), beside
    # ``resources``: the memory this indexer owns and the checks of caller memory and streams against it
    def check_open(self, what: str) -> None:
        """Raise :class:`HssError` naming entry point ``what`` once the indexer is closed."""
        if self._closed:
            raise HssError(f"QsaIndexer.{what}: the indexer is closed")

    def check_state(self, st: Any, what: str) -> None:
        """Raise unless the indexer is open and ``st`` is a live state of it (``TypeError`` for another type)."""
        self.check_open(what)
        if not isinstance(st, QsaSeqState):
            raise TypeError(f"QsaIndexer.{what} needs a QsaSeqState (from new_seq_state), not {type(st).__name__}")
        if st.owner is not self:
            raise HssError(f"QsaIndexer.{what}: this QsaSeqState belongs to another indexer; use the state that "
                           "this indexer's new_seq_state returned")
        if not (st.raw_keys and st.block_keys):
            raise HssError(f"QsaIndexer.{what}: the QsaSeqState was released; make a new one with new_seq_state()")

    def device_state(self, what: str) -> device.DeviceState:
        """The device-resident decode state; :class:`HssError` naming ``what`` once the indexer is closed."""
        dev = self._dev
        if dev is None:
            self.check_open(what)
        return dev   # type: ignore[return-value]

    def pool_new_blocks(self, st: QsaSeqState, s: int) -> None:
        """Pool the blocks of ``st`` complete by ``st.ingested`` but not yet pooled (a partial restore leaves some)."""
        self._keys.pool_new_blocks(st, s)

    # -- prefill ingest (docs/design.md §11.3) -----------------------------------------------------------------
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
        self.check_state(st, "prefill_ingest")
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
        s = self.resources.stream(stream, "prefill_ingest")
        with _args.deferred_joins():
            src = self._hidden_arg(hidden, s, num_tokens * row)
            self.resources.check_caller("prefill_ingest", (("hidden", src, num_tokens * row, False),))
        self._keys.ingest(st, src, num_tokens, seq_start, s)

    # -- prefill selection (docs/design.md §11.5) ------------------------------------------------------------------
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
        return prefill.prefill_select(self, self._prefill, st, normed, q_roped, attn_ctx, k_pool, v_pool,
                                      seq_block_table, seq_start, num_tokens, nq, block_size, inv_sqrt_d, scratch,
                                      stream)

    # -- snapshots (docs/design.md §11.6, §17.7) ---------------------------------------------------------------------
    def snapshot_aux(self, st: QsaSeqState, stream: Any) -> bytes:
        """``st`` as a blob: ``ingested`` u64 LE | ``pooled`` u64 LE | raw keys of tokens 0..ingested-1 (bf16) --
        the original's layout -- then a 20-byte hss trailer (magic ``HSSQ``, version, config fingerprint, CRC32 of
        the rest; docs/design.md §17.7).

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
        ingested, pooled, raw, s = snapshot.checked_restore(self, st, blob, stream)
        self._keys.restore(st, ingested, pooled, raw, s)

    # -- decode (docs/design.md §11.4) -----------------------------------------------------------------------------
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
        self.check_state(st, "decode_select")
        pos = _args.as_int("pos", pos, 0, _I32)
        if pos != st.ingested:
            raise HssError(f"QSA: decode at pos {pos} but {st.ingested} tokens ingested: the indexer cache lost sync "
                           "(prefix-cache skip or a rewound sequence); ingest every earlier token first")
        if pos >= self.max_tokens:
            raise HssError(f"QSA: pos {pos} >= max_tokens = {self.max_tokens}; construct the indexer with a larger "
                           "max_tokens= (or env HSS_QSA_MAX_TOKENS)")
        block_size = block_size_arg(block_size)
        visible = pos + 1
        page = block_size * self.kv_row
        table_bytes = 4 * ceil_div(visible, block_size)
        s = self.resources.stream(stream, "decode_select")
        with _args.deferred_joins():
            x = self._normed_arg(normed, s)
            kc = self._k_pool_arg(k_pool, s, page)
            vc = self._v_pool_arg(v_pool, s, page)
            table = self._table_arg(block_table_dev, s, table_bytes)
            self.resources.check_caller("decode_select", (("normed", x, self.hidden * 2, False),
                                                 ("k_pool", kc, _args.extent(k_pool, kc, page), False),
                                                 ("v_pool", vc, _args.extent(v_pool, vc, page), False),
                                                 ("block_table_dev", table, table_bytes, False)))
        keys = self._keys
        pooled = keys.token(st, x, pos, s)
        complete = visible // self.ratio
        if complete <= self.block_topk:
            keys.commit(st, visible, pooled, s)
            return None   # provably every token: dense attention is exact
        self._score_blocks(st, pos, complete, s)
        tokens = self._host_select(complete, visible, s)
        sel = self._queue_gather(tokens, kc, vc, table, block_size, st.table_len, s)
        keys.commit(st, visible, pooled, s)
        st.table_len = max(st.table_len, sel.max_blocks)
        return sel

    # -- batched device decode (docs/design.md §17.2-§17.4) ------------------------------------------------
    def decode_select_batch(self, states: list[QsaSeqState] | tuple[QsaSeqState, ...], normed: Any, block_tables: Any,
                            block_size: int, stream: Any, *, max_pages: int | None = None) -> QsaDeviceSelection:
        """One decode step of R sequences on the device: ingest each one's token at its device position, pool a
        block it completes, and select what it attends (docs/design.md §17.1: the inert regime selects every visible
        token).

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
        return self.device_state("decode_select_batch").select_batch(states, normed, block_tables, block_size, stream,
                                                                    max_pages)

    def sparse_decode_attention(self, q: Any, k_pool: Any, v_pool: Any, block_tables: Any,
                                selection: QsaDeviceSelection, out: Any, stream: Any, scale: float | None = None, *,
                                nq: int | None = None) -> None:
        """Attention of each sequence's queries over exactly its selected tokens, read through its page table (no
        gather; docs/design.md §17.4): ``out[r, h] = softmax_t(q[r, h] . K[t, h // (nq / nkv_attn)] * scale) V[t,
        ...]``.

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
        self.device_state("sparse_decode_attention").sparse_attention(q, k_pool, v_pool, block_tables, selection, out,
                                                                      stream, scale, nq)

    # The decode stages, separately callable so the benchmark can time each one; they take checked ints.
    def _ingest_token(self, st: QsaSeqState, normed: int, pos: int, s: int) -> None:
        """The token's qk GEMV, raw key and any block it completes, then its commit (the counters and the device
        position): :meth:`hss.qsa.keys.KeyWriter.token`, then ``commit``."""
        keys = self._keys
        keys.commit(st, pos + 1, keys.token(st, normed, pos, s), s)

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
        self._staged = select_tokens_unchecked(host, self.block_topk, self.ratio, visible, self._sel_host)
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
        pages = ceil_div(n_sel, block_size)
        if table_len < pages:
            gpu.copy_h2d_async(self._ident[:pages], self._table_addr, s)
        return QsaSelection(self.k_scratch, self.v_scratch, self.table_dev, self.seq_len_dev, n_sel, pages,
                            tokens.copy())
