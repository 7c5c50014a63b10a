"""Device-resident batched QSA decode (docs/design.md §17.2-§17.4): the host side of ``decode_select_batch`` and
``sparse_decode_attention``. A :class:`DeviceState` owns everything below (buffers, pinned pool, prepared launches,
cached compositions) and runs both calls; each indexer holds one and delegates to it.

Each :class:`~hss.qsa.QsaSeqState` owns a *slot* ``0 .. max_seqs - 1`` of its indexer's device arrays:

* ``pos_dev`` i32 ``[max_seqs]``: the slot's position, equal to the host mirror ``st.ingested`` in stream order
  (the host paths store it with a memset on their stream; the device step advances it itself);
* ``desc_dev`` u64 ``[max_seqs, 2]``: the slot's (raw_keys, block_keys) addresses; ``new_seq_state`` writes them and
  position 0 on a private stream and waits for that stream alone (so no later capture has to);
* the step's scratch, one row per slot of a batch: ``q_post_b`` f32 ``[max_seqs, n_heads, hd]``, ``scores_b`` f32
  ``[max_seqs, max_tokens // ratio]``, ``tokens_dev`` i32 ``[max_seqs, budget + ratio]``, ``counts_dev`` i32
  ``[max_seqs]`` and the sparse attention's split partials (sized for ``nq`` at the first call, or at construction
  with ``nq_attn=``).

A batch is a tuple of states (its *composition*); its slots are written once into an entry of a pinned pool and
copied into ``slots_dev`` i32 ``[max_seqs]`` by every step (an async copy: a memcpy node when captured, so a graph
replays its own batch whatever ran in between). Compositions are cached (least recently used recycled, never one a
capture used); a steady batch costs one small copy and four launches per step, and no per-state work beyond
reading the mirrors.

The step never reads the device on the host, so it captures into CUDA graphs: the mirror update ("every state
advanced by one") is registered with :func:`hss.cuda._launch.on_replay`, which runs it at once when eager and at each
:meth:`hss.cuda_min.CudaGraph.launch` when captured.
"""
from __future__ import annotations

import collections
import math
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from hss import _args
from hss import cuda_min as cm
from hss.cuda import _launch
from hss.cuda.gpu import DevicePtr, launcher
from hss.decls import qsa_device as kd
from hss.errors import CudaError, HssError
from hss.qsa.settings import block_size_arg, f32_arg

if TYPE_CHECKING:
    from hss.qsa.indexer import QsaIndexer
    from hss.qsa.resources import IndexerResources
    from hss.qsa.state import QsaSeqState

__all__ = ["QsaDeviceSelection", "DeviceState", "MAX_SEQS", "DEFAULT_MAX_SEQS", "COMPOSITIONS"]

DEFAULT_MAX_SEQS = 64
MAX_SEQS = 2048            # the qk GEMM writes one qk_scratch row per sequence (INGEST_SLAB rows)
COMPOSITIONS = 256         # batch compositions cached (pinned slot lists)
_RESERVE = 32              # entries eager steps leave free, so that a capture always finds one
_GONE_STREAM = ("CUDA_ERROR_INVALID_HANDLE", "CUDA_ERROR_INVALID_CONTEXT")   # a destroyed stream's sync
_I32 = 2**31 - 1
_SHARED_DEFAULT = 48 * 1024   # dynamic shared memory a launch may use without the opt-in attribute
_JOINS = _args.deferred_joins()   # its state is per thread, so one instance serves every call
# argument types that never change what they say and whose checks order no producer's stream (addresses, hss's
# arrays): a call of such arrays needs no deferred-join block, and the same objects pass again at once until an hss
# buffer is made or freed (which a closed buffer, a bound or an owned range would show)
_FIXED = frozenset({int, DevicePtr, cm.DeviceBuffer, cm.DeviceView, type(None)})


@dataclass(frozen=True)
class QsaDeviceSelection:
    """One batched step's selection, on the device (docs/design.md §17.3): ``tokens_dev`` i32 ``[R, sel_cap]`` (row r's
    first ``counts_dev[r]`` entries are its selected positions, ascending), ``counts_dev`` i32 ``[R]``; ``sel_cap`` =
    budget + ratio. ``block_tables`` (address of i32 ``[R, max_pages]``) and ``block_size`` are the step's page
    tables, which :meth:`QsaIndexer.sparse_decode_attention` reads by default. Views of the indexer's buffers:
    valid until its next ``decode_select_batch``."""
    tokens_dev: DevicePtr
    counts_dev: DevicePtr
    R: int
    sel_cap: int
    max_pages: int
    block_tables: int
    block_size: int
    _owner: Any = field(default=None, repr=False, compare=False)
    _generation: int = field(default=0, repr=False, compare=False)


class _Composition:
    """A cached batch: its states, the pinned entry holding their slots, the mirror update a step registers."""

    __slots__ = ("states", "entry", "host", "addr", "nbytes", "advance", "stream", "captured")

    def __init__(self, states: tuple, entry: int, host: np.ndarray, advance: Any) -> None:
        self.states, self.entry, self.host, self.advance = states, entry, host, advance
        self.addr, self.nbytes = host.ctypes.data, host.nbytes   # pinned: the copy reads it when it runs
        self.stream = -1          # the last stream a step of it ran on (an eviction waits for it)
        self.captured = False     # a graph's memcpy node reads its entry: never recycled


def _advance_fn(states: tuple, max_tokens: int, ratio: int) -> Any:
    """The host mirror of one device step: each position advances by one (the device stops at max_tokens)."""
    def advance() -> None:
        for st in states:
            n = st.ingested
            if n < max_tokens:
                st.ingested = n + 1
                st.pooled = (n + 1) // ratio
    return advance


class DeviceState:
    """The device-resident part of one :class:`QsaIndexer`: slots, positions, descriptors, the batched step's
    buffers and prepared launches, and the two batched calls (:meth:`select_batch`, :meth:`sparse_attention`).
    Its device buffers come from the indexer's ``resources`` (freed by ``QsaIndexer.close``); ``gemm`` is the
    indexer's qk projection (m rows of attention inputs into its qk scratch)."""

    def __init__(self, idx: QsaIndexer, resources: IndexerResources, gemm: Any, max_seqs: int,
                 nq_attn: int | None, pdl: bool = False, qk_kernel: bool = False) -> None:
        self.idx = weakref.proxy(idx)
        self.idx_ref = weakref.ref(idx)   # what a selection names as its owner
        self.resources = resources
        self.gemm = gemm
        gpu = idx.gpu
        self.gpu = gpu
        self.max_seqs = max_seqs
        self.max_blocks = idx.max_tokens // idx.ratio
        self.splits = kd.splits(idx.sel_cap)
        self.free_slots = list(range(max_seqs - 1, -1, -1))   # pop() hands out the lowest slot first
        self.generation = 0
        alloc = resources.alloc
        self.pos_dev = alloc(max_seqs * 4)
        self.desc_dev = alloc(max_seqs * 16)
        self.slots_dev = alloc(max_seqs * 4)
        self.counts_dev = alloc(max_seqs * 4)
        self.tokens_dev = alloc(max_seqs * idx.sel_cap * 4)
        self.q_post_b = alloc(max_seqs * idx.n_heads * idx.hd * 4)
        self.scores_b = alloc(max_seqs * self.max_blocks * 4)
        self.part_nq = 0
        self.part_ml = self.part_o = DevicePtr(0)
        # pinned: the descriptors' host mirror, the composition pool, a word for QsaSeqState.sync
        desc_bytes, pool_bytes = max_seqs * 16, COMPOSITIONS * max_seqs * 4
        self.pinned = cm.PinnedBuffer(desc_bytes + pool_bytes + 16, getattr(gpu, "ctx", None))
        self.desc_host = self.pinned.array[:desc_bytes].view(np.uint64).reshape(max_seqs, 2)
        self.pool_host = self.pinned.array[desc_bytes:desc_bytes + pool_bytes].view(np.int32).reshape(
            COMPOSITIONS, max_seqs)
        self.sync_host = self.pinned.array[desc_bytes + pool_bytes:].view(np.int32)[:1]
        resources.own(self.pinned.ptr, self.pinned.bytes, "the indexer's pinned slot lists")   # a step's copy reads it
        # the arguments of the last batched step and attention whose memory passed every check, and what it gave
        self.batch_key: tuple | None = None
        self.attn_key: tuple | None = None
        self.batch_checked: tuple = ()
        self.attn_checked: tuple = ()
        self.free_entries = list(range(COMPOSITIONS - 1, -1, -1))
        self.compositions: collections.OrderedDict[tuple, _Composition] = collections.OrderedDict()
        self.pos_addr, self.desc_addr, self.slots_addr = int(self.pos_dev), int(self.desc_dev), int(self.slots_dev)
        self.init_stream: cm.CudaStream | None = None
        try:
            self.init_stream = cm.CudaStream(getattr(gpu, "ctx", None))
            self._prepare(idx, nq_attn, pdl, qk_kernel)
        except BaseException:
            self.close()
            raise

    def _prepare(self, idx: QsaIndexer, nq_attn: int | None, pdl: bool, qk_kernel: bool) -> None:
        ptr_arg = self.resources.pointer_arg   # refuses other devices' memory
        self.normed_arg = ptr_arg("normed", None, 2, "bf16",
                                  what=f"the batch's attention inputs [R, hidden] = [R, {idx.hidden}] bf16")
        # the sparse attention loads q and K/V rows in 16-byte vectors
        self.q_arg = ptr_arg("q", None, 16, "bf16",
                             what=f"the queries [R, nq, hd_attn] = [R, nq, {idx.hd_attn}] bf16, 16-byte aligned")
        self.out_arg = ptr_arg("out", None, 2, "bf16", write=True,
                               what=f"the output [R, nq, hd_attn] = [R, nq, {idx.hd_attn}] bf16")
        self.table_arg = ptr_arg("block_tables", None, 4, "i32",
                                 what="the batch's i32 page tables [R, max_pages]")
        pool = "a paged cache [pages, block_size, nkv_attn, hd_attn] bf16, 16-byte aligned: at least one page"
        self.k_pool_arg = ptr_arg("k_pool", None, 16, "bf16", what=pool)
        self.v_pool_arg = ptr_arg("v_pool", None, 16, "bf16", what=pool)
        self._kernels(idx, pdl, qk_kernel)
        if nq_attn is not None:
            self.ensure_partials(nq_attn, None)

    # -- kernels and prepared launches ----------------------------------------------------------------
    def _kernels(self, idx: QsaIndexer, pdl: bool, qk_kernel: bool) -> None:
        gpu = self.gpu
        names = ("qsa_dev_qk", "qsa_dev_prep", "qsa_dev_score", "qsa_dev_topk", "qsa_sparse_attn", "qsa_sparse_merge")
        handles = [gpu.try_kernel(kd.MODULE, n) for n in names]
        self.missing = [n for n, h in zip(names, handles) if not h]
        self.attn_ok = False
        self.ready = not self.missing
        if not self.ready:
            return
        qk, prep, score, topk, attn, merge = handles
        n_heads, hd, ratio = idx.n_heads, idx.hd, idx.ratio
        self.qk_pack = qk.pack(act=0, w=idx.qk_proj_w, out=idx.qk_scratch, rows=1, n=idx.qk_width, k=idx.hidden)
        self.qk_act, self.qk_rows = self.qk_pack.slot("act"), self.qk_pack.slot("rows")
        self.qk_gx = kd.qk_geometry(idx.qk_width).grid[0]
        self.prep_pack = prep.pack(qk=idx.qk_scratch, q_norm_w=idx.q_norm_w, k_norm_w=idx.k_norm_w,
                                   desc=self.desc_dev, pos=self.pos_dev, slots=self.slots_dev, q_post=self.q_post_b,
                                   qkw=idx.qk_width, n_heads=n_heads, hd=hd, ratio=ratio, rot=idx.rot,
                                   theta=idx.theta, eps=idx.eps, max_tokens=idx.max_tokens)
        self.score_pack = score.pack(q_post=self.q_post_b, desc=self.desc_dev, pos=self.pos_dev, slots=self.slots_dev,
                                     scores=self.scores_b, score_stride=self.max_blocks, n_heads=n_heads, hd=hd,
                                     ratio=ratio, k_blocks=idx.block_topk)
        self.topk_pack = topk.pack(scores=self.scores_b, pos=self.pos_dev, slots=self.slots_dev,
                                   tokens=self.tokens_dev, counts=self.counts_dev, score_stride=self.max_blocks,
                                   k_blocks=idx.block_topk, ratio=ratio, sel_cap=idx.sel_cap,
                                   max_tokens=idx.max_tokens)
        self.attn_pack = attn.pack(q=0, k_pool=0, v_pool=0, block_tables=0, tokens=self.tokens_dev,
                                   counts=self.counts_dev, part_ml=0, part_o=0, max_pages=1, sel_cap=idx.sel_cap,
                                   block_size=8, nq=idx.nkv_attn, nkv=idx.nkv_attn, hd=idx.hd_attn, scale=1.0)
        self.merge_pack = merge.pack(part_ml=0, part_o=0, counts=self.counts_dev, out=0, sel_cap=idx.sel_cap,
                                     nq=idx.nkv_attn, hd=idx.hd_attn)
        a, m = self.attn_pack, self.merge_pack
        self.attn_slots = tuple(a.slot(n) for n in ("q", "k_pool", "v_pool", "block_tables", "max_pages",
                                                    "block_size", "nq", "scale"))
        self.merge_out, self.merge_nq = m.slot("out"), m.slot("nq")
        self.kernels = handles
        self.attn_ok = kd.attn_hd_problem(idx.hd_attn) is None
        # programmatic dependent launch where the module's sm_90 variant (griddepcontrol) was served, and the
        # qsa_dev_qk projection for small batches: both opt-in until a device run has measured them
        self.pdl_served = getattr(getattr(prep.func, "module", None), "variant", None) == "sm_90"
        self.qk_max_rows = kd.QK_MAX_ROWS if qk_kernel else 0
        self.use_pdl(pdl)

    def use_pdl(self, on: bool) -> None:
        """(Re)build the step's prepared launches: with ``on`` and the module's sm_90 variant served, each kernel
        through programmatic stream serialization (its launch overlaps the kernel before it, which it waits for:
        same bits), else plain (``HSS_QSA_PDL=1`` turns it on at the indexer's construction)."""
        qk, prep, score, topk, attn, merge = self.kernels
        idx, gpu, pdl = self.idx, self.gpu, bool(on) and self.pdl_served
        self.pdl = pdl
        g_qk = kd.qk_geometry(idx.qk_width)
        self.run_qk = launcher(gpu, qk, g_qk.block, g_qk.shared, self.qk_pack, pdl)
        # geometry: the declarations' (the grids' R, and nq for the merge, are the only per-call parts)
        g_prep = kd.prep_geometry(1, idx.n_heads, idx.hd)
        g_score = kd.score_geometry(1, self.max_blocks, idx.n_heads, idx.hd)
        self.score_gx = g_score.grid[0]
        g_topk = kd.topk_geometry(1, self.max_blocks)
        self.run_prep = launcher(gpu, prep, g_prep.block, g_prep.shared, self.prep_pack, pdl)
        self.run_score = launcher(gpu, score, g_score.block, g_score.shared, self.score_pack, pdl)
        self.run_topk = launcher(gpu, _opt_in(topk, g_topk.shared), g_topk.block, g_topk.shared, self.topk_pack,
                                 pdl)
        if self.attn_ok:
            g_attn = kd.attn_geometry(1, idx.nkv_attn, idx.sel_cap, idx.hd_attn)
            g_merge = kd.merge_geometry(1, 1, idx.hd_attn)
            self.run_attn = launcher(gpu, _opt_in(attn, g_attn.shared), g_attn.block, g_attn.shared, self.attn_pack,
                                     pdl)
            self.run_merge = launcher(gpu, merge, g_merge.block, g_merge.shared, self.merge_pack, pdl)

    def qk(self, x: int, R: int, s: int) -> None:
        """The step's qk projection of R checked rows at ``x`` into the qk scratch: ``qsa_dev_qk`` for batches of at
        most ``qk_max_rows`` (0 unless ``HSS_QSA_QK_KERNEL=1``: then ``QK_MAX_ROWS``), else the indexer's cuBLAS
        GEMM."""
        if R <= self.qk_max_rows:
            self.qk_act.value, self.qk_rows.value = x, R
            self.run_qk(s, self.qk_gx)
        else:
            self.gemm(x, R, s)

    def require(self, what: str) -> None:
        """Raise unless the device-decode kernels were found."""
        if not self.ready:
            raise HssError(f"QsaIndexer.{what}: the device-decode kernels {', '.join(self.missing)} are missing "
                           f"from PTX module {kd.MODULE}; run `python build_ptx.py` (or reinstall hss)")

    # -- slots and positions ----------------------------------------------------------------------------
    def check_free_slot(self) -> None:
        if not self.free_slots:
            raise HssError(f"QsaIndexer.new_seq_state: all max_seqs = {self.max_seqs} slots are taken by live "
                           "states; release one (release_seq_state) or construct the indexer with a larger "
                           "max_seqs=")

    def take_slot(self, raw_keys: int, block_keys: int) -> int:
        """A free slot holding (raw_keys, block_keys) at position 0 on the device when this returns (blocking on a
        private stream only)."""
        self.check_free_slot()
        slot = self.free_slots[-1]
        self.desc_host[slot] = (raw_keys, block_keys)
        s = self.init_stream.handle
        cm.copy_h_to_d_async(self.desc_addr + 16 * slot, self.desc_host[slot], 16, s)
        cm.memset_d32_async(self.pos_addr + 4 * slot, 0, 1, s)
        cm.stream_sync(s)
        return self.free_slots.pop()

    def give_slot(self, slot: int) -> None:
        if 0 <= slot < self.max_seqs and slot not in self.free_slots:
            self.free_slots.append(slot)
            self.free_slots.sort(reverse=True)

    def store_pos(self, st: QsaSeqState, s: int) -> None:
        """Make ``pos_dev[st's slot]`` equal the host mirror ``st.ingested``, in stream order on ``s``."""
        cm.memset_d32_async(self.pos_addr + 4 * st.slot, st.ingested, 1, s)

    def read_pos(self, st: QsaSeqState, s: int) -> int:
        """Blocking: ``pos_dev[st's slot]`` after the work queued on ``s``."""
        self.gpu.copy_d2h_on_stream(self.pos_addr + 4 * st.slot, self.sync_host, s)
        return int(self.sync_host[0])

    # -- compositions -----------------------------------------------------------------------------------
    def composition(self, key: tuple, s: int) -> _Composition:
        """The cached composition of the (checked) states ``key``, made if new (recycling the least recently
        used one that no capture holds)."""
        comp = self.compositions.get(key)
        if comp is not None:
            self.compositions.move_to_end(key)
            return comp
        idx = self.idx
        if len(self.free_entries) <= _RESERVE and not _launch.is_capturing(s):
            self._recycle()
        if not self.free_entries:
            raise HssError(f"QsaIndexer.decode_select_batch: {COMPOSITIONS} batch compositions are held by graph "
                           "captures (or cached); capture fewer distinct batches per indexer")
        entry = self.free_entries.pop()
        host = self.pool_host[entry, :len(key)]
        host[:] = [st.slot for st in key]
        comp = _Composition(key, entry, host, _advance_fn(key, idx.max_tokens, idx.ratio))
        self.compositions[key] = comp
        return comp

    def _recycle(self) -> None:
        """Free the least recently used entries no capture holds, down to the reserve, each after its last copy."""
        for key in list(self.compositions):
            if len(self.free_entries) > _RESERVE:
                return
            comp = self.compositions[key]
            if comp.captured:
                continue
            if comp.stream >= 0:
                try:
                    cm.stream_sync(comp.stream)   # its last step's copy read the entry; nearly always long done
                except CudaError as exc:
                    if exc.name not in _GONE_STREAM:   # any other failure fails the call
                        raise
                    # a stream destroyed since: its work ran to the end
            del self.compositions[key]
            self.free_entries.append(comp.entry)

    # -- the batched calls' caller memory ---------------------------------------------------------------
    def batch_memory(self, normed: Any, block_tables: Any, R: int, max_pages: Any, s: int,
                     fixed: bool) -> tuple[int, int, int]:
        """decode_select_batch's arrays checked: (normed, block_tables, max_pages); neither may overlap the indexer's
        memory. ``fixed``: both are of :data:`_FIXED` types, and the same objects as the last call's pass at once
        while no hss buffer was made or freed."""
        key = (normed, block_tables, R, max_pages, _args.RANGES.generation,
               self.resources.generation) if fixed else None
        if key is not None and key == self.batch_key:
            return self.batch_checked
        nx = R * self.idx.hidden * 2
        x = self.normed_arg(normed, s, nx)
        table, pages = _table_arg(self.table_arg, block_tables, R, max_pages, s, "block_tables")
        self.resources.check_caller("decode_select_batch", (("normed", x, nx, False),
                                                            ("block_tables", table, 4 * R * pages, False)))
        self.batch_key, self.batch_checked = key, (x, table, pages)
        return x, table, pages

    def attention_memory(self, sel: QsaDeviceSelection, q: Any, k_pool: Any, v_pool: Any, block_tables: Any,
                         out: Any, row: int, s: int, fixed: bool) -> tuple[int, int, int, int, int]:
        """sparse_decode_attention's arrays checked (``row``: bytes of q and of out): (q, k_pool, v_pool, the page
        tables, out). None may overlap the indexer's memory, nor out another of them; the pools are read through
        page ids, so they count as far as they reach (:func:`hss._args.extent`). ``fixed``: every array is of a
        :data:`_FIXED` type, and the same objects as the last call's pass at once while no hss buffer was made or
        freed."""
        key = (q, k_pool, v_pool, block_tables, out, sel.block_tables, sel.max_pages, sel.block_size, sel.R, row,
               _args.RANGES.generation, self.resources.generation) if fixed else None
        if key is not None and key == self.attn_key:
            return self.attn_checked
        page, pages = sel.block_size * self.idx.kv_row, sel.max_pages
        qp = self.q_arg(q, s, row)
        op = self.out_arg(out, s, row)
        kp = self.k_pool_arg(k_pool, s, page)
        vp = self.v_pool_arg(v_pool, s, page)
        table = sel.block_tables if block_tables is None else self.table_arg(block_tables, s, 4 * sel.R * pages)
        self.resources.check_caller("sparse_decode_attention", (
            ("out", op, row, True), ("q", qp, row, False), ("k_pool", kp, _args.extent(k_pool, kp, page), False),
            ("v_pool", vp, _args.extent(v_pool, vp, page), False), ("block_tables", table, 4 * sel.R * pages, False)))
        self.attn_key, self.attn_checked = key, (qp, kp, vp, table, op)
        return qp, kp, vp, table, op

    # -- partials ------------------------------------------------------------------------------------------
    def ensure_partials(self, nq: int, s: int | None) -> None:
        """Split partials for ``nq`` query heads (grown eagerly only: allocation cannot be captured)."""
        if nq <= self.part_nq:
            return
        if s is not None and _launch.is_capturing(s):
            raise HssError(f"QsaIndexer.sparse_decode_attention: the first call with nq = {nq} is being captured, "
                           "but its split partials must be allocated first; run one step eagerly before the capture, "
                           f"or construct the indexer with nq_attn={nq}")
        idx, res = self.idx, self.resources
        ml = res.alloc(kd.part_ml_bytes(self.max_seqs, nq, idx.sel_cap))
        try:
            o = res.alloc(kd.part_o_bytes(self.max_seqs, nq, idx.sel_cap, idx.hd_attn))
        except BaseException:
            res.release(ml)
            raise
        for old in (self.part_ml, self.part_o):
            if old:
                res.release(old)
        self.part_ml, self.part_o, self.part_nq = ml, o, nq
        if self.ready:
            self.attn_pack.set("part_ml", ml)
            self.attn_pack.set("part_o", o)
            self.merge_pack.set("part_ml", ml)
            self.merge_pack.set("part_o", o)

    # -- the batched calls ------------------------------------------------------------------------------
    def check_batch(self, states: Any) -> tuple:
        """``states`` as a tuple of distinct live states of the indexer (1 .. max_seqs of them)."""
        if not isinstance(states, (list, tuple)):
            raise TypeError(f"QsaIndexer.decode_select_batch: states must be a list or tuple of QsaSeqState, not "
                            f"{type(states).__name__}")
        key = tuple(states)
        if not 1 <= len(key) <= self.max_seqs:
            raise HssError(f"QsaIndexer.decode_select_batch: {len(key)} states; a batch holds 1 .. max_seqs = "
                           f"{self.max_seqs} (construct the indexer with a larger max_seqs=)")
        for r, st in enumerate(key):
            try:
                self.idx.check_state(st, "decode_select_batch")
            except (HssError, TypeError) as exc:
                raise type(exc)(f"states[{r}]: {exc}") from None
        if len({id(st) for st in key}) != len(key):
            dup = next(r for r, st in enumerate(key) if any(x is st for x in key[:r]))
            raise HssError(f"QsaIndexer.decode_select_batch: states[{dup}] appears twice; each sequence advances once "
                           "per step: pass distinct states")
        return key

    def select_batch(self, states: Any, normed: Any, block_tables: Any, block_size: Any, stream: Any,
                     max_pages: Any) -> QsaDeviceSelection:
        """See :meth:`QsaIndexer.decode_select_batch`."""
        idx = self.idx
        key = states if type(states) is tuple else tuple(states) if type(states) is list else None
        try:
            comp = self.compositions.get(key)
        except TypeError:   # unhashable items: check_batch names them
            comp = None
        if comp is None:
            idx.check_open("decode_select_batch")
            key = self.check_batch(states)
        else:
            key = comp.states
        self.require("decode_select_batch")
        R = len(key)
        bs = block_size if type(block_size) is int and 8 <= block_size <= _I32 else block_size_arg(block_size)
        s = self.resources.stream(stream, "decode_select_batch")
        if type(normed) in _FIXED and type(block_tables) in _FIXED and (max_pages is None or type(max_pages) is int):
            x, table, pages = self.batch_memory(normed, block_tables, R, max_pages, s, True)
        else:
            with _JOINS:   # a producer's stream is joined only once every argument passed
                x, table, pages = self.batch_memory(normed, block_tables, R, max_pages, s, False)
        limit = min(idx.max_tokens, pages * bs)   # visible = ingested + 1 must fit the table and max_tokens
        ratio = idx.ratio
        for st in key:
            n = st.ingested
            if n >= limit or st.pooled != n // ratio or st.slot < 0:
                fix = self._slow_states(key, pages, bs)
                break
        else:
            fix = None
        # every check passed: device work from here on
        if comp is None:
            comp = self.composition(key, s)
        if fix:
            for st in fix:
                # blocks a partial restore left unpooled (a capture re-pools them: same bits)
                idx.pool_new_blocks(st, s)
        comp.stream = s
        cm.copy_h_to_d_async(self.slots_addr, comp.addr, comp.nbytes, s)
        self.qk(x, R, s)
        self.run_prep(s, R, idx.n_heads + 2)
        self.run_score(s, self.score_gx, R)
        self.run_topk(s, R)
        if _launch.on_replay(s, comp.advance):
            comp.captured = True
        self.generation += 1
        return QsaDeviceSelection(self.tokens_dev, self.counts_dev, R, idx.sel_cap, pages, table, bs, self.idx_ref,
                                  self.generation)

    def _slow_states(self, key: tuple, pages: int, bs: int) -> list:
        """The per-state checks behind the hot loop (raising the first problem), and the states needing fix-ups."""
        idx, fix = self.idx, []
        for r, st in enumerate(key):
            if st.slot < 0 or not (st.raw_keys and st.block_keys):
                raise HssError(f"QsaIndexer.decode_select_batch: states[{r}] was released; make a new one with "
                               "new_seq_state()")
            n = st.ingested
            if n >= idx.max_tokens:
                raise HssError(f"QSA: states[{r}] holds {n} tokens = max_tokens = {idx.max_tokens}: no room for the "
                               "next; construct the indexer with a larger max_tokens= (or env HSS_QSA_MAX_TOKENS)")
            if n + 1 > pages * bs:
                raise HssError(f"block_tables: states[{r}] decodes position {n} (visible {n + 1}) but a row holds "
                               f"max_pages = {pages} pages of {bs} tokens = {pages * bs}; pass wider page tables")
            if st.pooled != n // idx.ratio:
                fix.append(st)
        return fix

    def sparse_attention(self, q: Any, k_pool: Any, v_pool: Any, block_tables: Any, selection: QsaDeviceSelection,
                         out: Any, stream: Any, scale: Any, nq: Any) -> None:
        """See :meth:`QsaIndexer.sparse_decode_attention`."""
        idx = self.idx
        if type(selection) is not QsaDeviceSelection:
            raise TypeError(f"QsaIndexer.sparse_decode_attention: selection must be the QsaDeviceSelection that "
                            f"decode_select_batch returned, not {type(selection).__name__}")
        if selection._owner is not self.idx_ref:
            idx.check_open("sparse_decode_attention")
            raise HssError("QsaIndexer.sparse_decode_attention: the selection comes from another indexer; pass this "
                           "indexer's decode_select_batch result")
        if selection._generation != self.generation:
            raise HssError("QsaIndexer.sparse_decode_attention: the selection is stale (a later decode_select_batch "
                           "overwrote its buffers); attend right after the step that made it")
        idx.check_open("sparse_decode_attention")
        self.require("sparse_decode_attention")
        R, hd, nkv = selection.R, idx.hd_attn, idx.nkv_attn
        s = self.resources.stream(stream, "sparse_decode_attention")
        if nq is None:
            nq = _heads_from(q, R, hd)
        else:
            nq = _args.as_int("nq", nq, 1, _I32, why="the attention's query heads")
        if not self.attn_ok:
            raise HssError(f"QsaIndexer.sparse_decode_attention: hd_attn = {hd}: {kd.attn_hd_problem(hd)}")
        if nq % nkv or nq // nkv > kd.ATTN_MAX_GROUP:
            raise HssError(f"QsaIndexer.sparse_decode_attention: nq = {nq} must be a multiple of nkv_attn = {nkv}, at "
                           f"most {kd.ATTN_MAX_GROUP} query heads per KV head")
        arrays, row = (q, k_pool, v_pool, block_tables, out), R * nq * hd * 2
        if type(q) in _FIXED and type(k_pool) in _FIXED and type(v_pool) in _FIXED and type(block_tables) in _FIXED \
                and type(out) in _FIXED:
            qp, kp, vp, table, op = self.attention_memory(selection, *arrays, row, s, True)
        else:
            with _JOINS:   # a producer's stream is joined only once every argument passed
                qp, kp, vp, table, op = self.attention_memory(selection, *arrays, row, s, False)
        sc = 1.0 / math.sqrt(hd) if scale is None else f32_arg("scale", scale, positive=True)
        self.ensure_partials(nq, s)
        q_slot, k_slot, v_slot, t_slot, p_slot, b_slot, n_slot, s_slot = self.attn_slots
        q_slot.value, k_slot.value, v_slot.value, t_slot.value = qp, kp, vp, table
        p_slot.value, b_slot.value, n_slot.value, s_slot.value = selection.max_pages, selection.block_size, nq, sc
        self.merge_out.value, self.merge_nq.value = op, nq
        self.run_attn(s, R, nkv, self.splits)
        self.run_merge(s, R, nq)

    def close(self) -> None:
        self.compositions.clear()
        try:
            if self.init_stream is not None:
                self.init_stream.close()
        finally:
            self.pinned.close()


def _opt_in(kernel: Any, shared: int) -> Any:
    """``kernel`` allowed ``shared`` bytes of dynamic shared memory (the opt-in past 48 KiB)."""
    if shared > _SHARED_DEFAULT:
        kernel.func.set_max_dynamic_shared(shared)
    return kernel


# -- shapes and page tables of the batched calls' arguments ---------------------------------------------
def _shape(obj: Any) -> tuple | None:
    """The shape an array argument states (``.shape``, or its ``__cuda_array_interface__``); None if it states none."""
    shape = getattr(obj, "shape", None)
    if shape is None:
        try:
            shape = obj.__cuda_array_interface__["shape"]
        except Exception:
            return None
    try:
        return tuple(int(d) for d in shape)
    except (TypeError, ValueError):
        return None


def _table_arg(check: Any, obj: Any, R: int, max_pages: Any, s: int, name: str) -> tuple[int, int]:
    """(address, max_pages) of an i32 ``[R, max_pages]`` page table (max_pages from its shape unless given);
    ``check`` is the prepared pointer check."""
    if max_pages is None:
        shape = _shape(obj) if type(obj) is not int else None
        if shape is None or len(shape) != 2 or shape[0] != R or shape[1] < 1:
            got = "an address" if shape is None else f"an array of shape {shape}"
            raise HssError(f"{name}: got {got}; pass an i32 [R, max_pages] = [{R}, max_pages] array, or say the row "
                           "length with max_pages=")
        max_pages = shape[1]
    else:
        max_pages = _args.as_int("max_pages", max_pages, 1, _I32 // max(R, 1), why="the page table's row length")
    return check(obj, s, 4 * R * max_pages), max_pages


def _heads_from(q: Any, R: int, hd: int) -> int:
    """nq from q's shape: ``[R, nq, hd_attn]`` or ``[R, nq * hd_attn]``."""
    shape = _shape(q) if type(q) is not int else None
    if shape is not None and len(shape) == 3 and shape[0] == R and shape[2] == hd and shape[1] >= 1:
        return shape[1]
    if shape is not None and len(shape) == 2 and shape[0] == R and shape[1] % hd == 0 and shape[1] >= hd:
        return shape[1] // hd
    got = "an address" if shape is None else f"an array of shape {shape}"
    raise HssError(f"q: got {got}; pass bf16 [R, nq, hd_attn] = [{R}, nq, {hd}] queries, or say the head count "
                   "with nq=")
