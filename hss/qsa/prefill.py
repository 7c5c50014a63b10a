"""Prefill selection (docs/design.md §11.5, "stage 2"): rows of a prefill chunk past the inert bound attend their own
selected token set instead of every earlier token.

``QsaIndexer.prefill_select`` delegates here. Per slab of up to ``SELECT_SLAB`` (2048) selective rows:
project the rows' attention inputs to ``qk`` (cuBLAS), normalize and rope the indexer queries
(``qsa_qprep_rows``), score every complete block per row (``qsa_score_rows_tc`` when available and the shape
is 4 x 128, else ``qsa_score_rows``), pick each row's top ``budget // ratio`` blocks on the host (a blocking
D2H of the scores; lists kept in score-descending order), and attend the listed blocks' tokens plus the row's
tail (``qsa_prefill_attn_tc`` when ``prefill_attn_tc_supported``, else ``qsa_prefill_attn``), overwriting the
dense attention output of those rows.

The caller provides one scratch buffer, laid out as (``ROWS = SELECT_SLAB``; each part starts on a
``SCRATCH_ALIGN``-byte boundary): ``qk_buf [ROWS, qkw]`` bf16 | ``qpost [ROWS, n_heads, hd]`` f32 |
``scores [ROWS, stride]`` f32 | ``lists [ROWS, topk]`` i32, ``stride = ceil(total / ratio)``;
:func:`prefill_scratch_bytes` gives its size.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from hss import _args
from hss._util import ceil_div
from hss.decls import qsa_prefill as kp
from hss.errors import HssError
from hss.qsa.select import top_blocks
from hss.qsa.settings import block_size_arg, f32_arg

if TYPE_CHECKING:
    from hss.qsa.indexer import QsaIndexer, QsaSeqState

__all__ = ["SELECT_SLAB", "SCRATCH_ALIGN", "ScratchLayout", "scratch_layout", "prefill_scratch_bytes",
           "prefill_select", "row_lists", "PrefillKernels"]

SELECT_SLAB = 2048     # selective rows per slab (the original's ROWS); read at call time
SCRATCH_ALIGN = 256    # each scratch part starts on this boundary (the kernels need 16 B)
_VEC = 16              # the prefill kernels load q, attn_ctx, the pools and the scratch in 16-byte vectors
_I32 = 2**31 - 1


class ScratchLayout(NamedTuple):
    """Byte offsets of the scratch parts, the score row stride (floats) and the total size."""
    stride: int
    qk_buf: int
    qpost: int
    scores: int
    lists: int
    nbytes: int


def _align(n: int) -> int:
    return ceil_div(n, SCRATCH_ALIGN) * SCRATCH_ALIGN


def scratch_layout(total: int, qkw: int, n_heads: int, hd: int, ratio: int, topk: int) -> ScratchLayout:
    """The scratch layout for a sequence of ``total`` tokens (``SELECT_SLAB`` rows per part)."""
    rows = SELECT_SLAB
    stride = ceil_div(total, ratio)
    qpost = _align(rows * qkw * 2)
    scores = _align(qpost + rows * n_heads * hd * 4)
    lists = _align(scores + rows * stride * 4)
    return ScratchLayout(stride, 0, qpost, scores, lists, lists + rows * topk * 4)


def prefill_scratch_bytes(total: int, qkw: int, n_heads: int, hd: int, ratio: int, topk: int) -> int:
    """Bytes of scratch ``prefill_select`` needs when the sequence holds ``total`` tokens (grows with total:
    size it for the longest sequence)."""
    return scratch_layout(total, qkw, n_heads, hd, ratio, topk).nbytes


class PrefillKernels:
    """The prefill kernels of one indexer, their prepared parameter packs (refilled per launch) and the host buffer
    a slab's scores are read into (:meth:`scores_host`).

    ``score_tc`` / ``attn_tc`` are falsy handles where the backend lacks the optional kernels."""

    def __init__(self, idx: QsaIndexer) -> None:
        gpu = idx.gpu
        self.qprep = gpu.kernel(kp.MODULE, "qsa_qprep_rows")
        self.score = gpu.kernel(kp.MODULE, "qsa_score_rows")
        self.attn = gpu.kernel(kp.MODULE, "qsa_prefill_attn")
        self.score_tc = gpu.try_kernel(kp.MODULE, "qsa_score_rows_tc")
        self.attn_tc = gpu.try_kernel(kp.MODULE, "qsa_prefill_attn_tc")
        # what the indexer fixes is filled here, by name; each slab sets the rest by name
        self.qprep_pack = self.qprep.pack(q_norm_w=idx.q_norm_w, qkw=idx.qk_width, n_heads=idx.n_heads, hd=idx.hd,
                                          rot=idx.rot, theta=idx.theta, eps=idx.eps)
        self.score_pack = self.score.pack(ratio=idx.ratio, n_heads=idx.n_heads, hd=idx.hd)
        self.score_tc_pack = self.score_tc.pack(ratio=idx.ratio) if self.score_tc else None
        # qsa_prefill_attn_tc has the same signature: one pack serves both
        self.attn_pack = self.attn.pack(topk=idx.block_topk, ratio=idx.ratio, nkv=idx.nkv_attn, hd=idx.hd_attn)
        self._scores = np.empty(0, dtype=np.float32)   # a slab's scores, grown on demand

    def scores_host(self, n: int) -> np.ndarray:
        """A reused host f32 buffer of at least ``n`` entries (grown on demand), its first ``n`` as a view."""
        if self._scores.size < n:
            self._scores = np.empty(n, dtype=np.float32)
        return self._scores[:n]


# -- argument checks (all before any device work) -----------------------------------------------------
def _host_table(table: Any, pages: int, total: int, block_size: int) -> np.ndarray:
    """The first ``pages`` entries of the host block table as int32, each in [0, 2^31)."""
    try:
        arr = np.asarray(table)
    except Exception:
        raise TypeError(f"QsaIndexer: seq_block_table must be a sequence of ints, not {type(table).__name__}") \
            from None
    if arr.ndim != 1:
        raise HssError(f"QsaIndexer: seq_block_table must be one-dimensional (got shape {arr.shape})")
    if arr.size < pages:
        raise HssError(f"QsaIndexer: seq_block_table has {arr.size} pages but {total} tokens in pages of "
                       f"{block_size} need {pages}; pass the sequence's whole block table (logical -> physical page)")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"QsaIndexer: seq_block_table must hold integers (got dtype {arr.dtype})")
    head = arr[:pages].astype(np.int64)
    if head.size and (head.min() < 0 or head.max() > _I32):
        bad = int(np.flatnonzero((head < 0) | (head > _I32))[0])
        raise HssError(f"QsaIndexer: seq_block_table[{bad}] = {int(head[bad])} is not a physical page id "
                       f"in [0, 2^31)")
    return head.astype(np.int32)


def _scratch(obj: Any, need: int, total: int, s: int) -> int:
    """The scratch's address, checked to hold ``need`` bytes. Its size must be one hss knows: an address outside
    every hss buffer is refused, since an undersized scratch (it grows with the sequence) would be overrun."""
    base = _args.pointer(obj, "scratch", need, _VEC, write=True, stream=s,
                         what=f"prefill_select's scratch for {total} tokens: allocate idx.prefill_scratch_bytes("
                              f"{total}) bytes, or for the longest sequence")
    if isinstance(obj, (int, np.integer)) and _args.RANGES.find(base) is None:
        raise HssError("QsaIndexer: the size of scratch (an address outside every hss buffer) is unknown, so it "
                       "cannot be checked; pass a DeviceBuffer (or a view of one, or an address inside one), a torch "
                       "tensor, or an array with __cuda_array_interface__ or __dlpack__")
    return base


class _Checked(NamedTuple):
    """prefill_select's arguments once every check passed."""
    seq_start: int
    total: int
    first_sel: int
    nq: int
    block_size: int
    inv: float
    table: np.ndarray
    layout: ScratchLayout
    scratch: int
    x: int
    q: int
    out: int
    kc: int
    vc: int
    stream: int


def _check(idx: QsaIndexer, st: QsaSeqState, normed: Any, q_roped: Any, attn_ctx: Any, k_pool: Any, v_pool: Any,
           seq_block_table: Any, seq_start: Any, num_tokens: Any, nq: Any, block_size: Any, inv_sqrt_d: Any,
           scratch: Any, stream: Any) -> _Checked:
    """Every argument of :func:`prefill_select`, in the documented forms and sizes, or an error naming it."""
    idx.check_state(st, "prefill_select")
    num_tokens = _args.as_int("num_tokens", num_tokens, 0, _I32)
    seq_start = _args.as_int("seq_start", seq_start, 0, _I32)
    total = seq_start + num_tokens
    if st.ingested != total:
        raise HssError(f"QSA: prefill_select for positions {seq_start}..{total - 1} but {st.ingested} tokens are "
                       f"ingested; call prefill_ingest(st, hidden, {num_tokens}, {seq_start}, stream) for this chunk "
                       "first, then select it")
    nkv, hd_attn = idx.nkv_attn, idx.hd_attn
    nq = _args.as_int("nq", nq, 1, _I32, why="the attention's query heads")
    if nq % nkv:
        raise HssError(f"QsaIndexer: nq ({nq}) must be a multiple of nkv_attn ({nkv}): each KV head serves "
                       f"nq // nkv_attn query heads")
    if hd_attn % 32 or hd_attn > 256:
        raise HssError(f"QsaIndexer: prefill_select needs hd_attn ({hd_attn}) a multiple of 32, at most 256 "
                       "(qsa_prefill_attn's lanes hold hd_attn / 32 dims each)")
    block_size = block_size_arg(block_size)
    inv = f32_arg("inv_sqrt_d", inv_sqrt_d, positive=True)
    pages = ceil_div(total, block_size)
    table = _host_table(seq_block_table, pages, total, block_size)
    layout = scratch_layout(total, idx.qk_width, idx.n_heads, idx.hd, idx.ratio, idx.block_topk)
    # the chunk's rows (nothing is read of an empty chunk) and every page the table names
    rows_in, rows_attn = num_tokens * idx.hidden * 2, num_tokens * nq * hd_attn * 2
    pool = (int(table.max()) + 1) * block_size * nkv * hd_attn * 2 if num_tokens and table.size else 0
    al = _VEC
    res = idx.resources
    s = res.stream(stream, "prefill_select")
    with _args.deferred_joins():   # a producer's stream is joined only once every argument passed
        base = _scratch(scratch, layout.nbytes, total, s)
        x = _args.pointer(normed, "normed", rows_in, 2, "bf16", stream=s,
                          what=f"the chunk's attention input [num_tokens, hidden] = [{num_tokens}, {idx.hidden}] bf16")
        q = _args.pointer(q_roped, "q_roped", rows_attn, al, "bf16", stream=s,
                          what=f"the roped queries [num_tokens, nq, hd_attn] = [{num_tokens}, {nq}, {hd_attn}] bf16")
        out = _args.pointer(attn_ctx, "attn_ctx", rows_attn, al, "bf16", write=True, stream=s,
                            what=f"the attention output [num_tokens, nq * hd_attn] = [{num_tokens}, {nq * hd_attn}] "
                                 "bf16")
        pool_what = (f"a paged cache [pages, block_size, nkv_attn, hd_attn] bf16 holding every page seq_block_table "
                     f"names: {pool} bytes")
        kc = _args.pointer(k_pool, "k_pool", pool, al, "bf16", stream=s, what=pool_what)
        vc = _args.pointer(v_pool, "v_pool", pool, al, "bf16", stream=s, what=pool_what)
        if _args.DEVICES.many:   # another device's memory (the kernels and cuBLAS run on the indexer's)
            for name, obj, p in (("scratch", scratch, base), ("normed", normed, x), ("q_roped", q_roped, q),
                                 ("attn_ctx", attn_ctx, out), ("k_pool", k_pool, kc), ("v_pool", v_pool, vc)):
                _args.check_device(obj, p, name, res.device)
        # the call writes scratch and attn_ctx: neither may overlap the indexer's memory or another argument
        res.check_caller("prefill_select", (("scratch", base, layout.nbytes, True),
                                            ("attn_ctx", out, rows_attn, True), ("normed", x, rows_in, False),
                                            ("q_roped", q, rows_attn, False),
                                            ("k_pool", kc, _args.extent(k_pool, kc, pool), False),
                                            ("v_pool", vc, _args.extent(v_pool, vc, pool), False)))
    return _Checked(seq_start, total, max(idx.inert_bound(), seq_start), nq, block_size, inv, table, layout, base,
                    x, q, out, kc, vc, s)


# -- the stage ------------------------------------------------------------------------------------
def prefill_select(idx: QsaIndexer, k: PrefillKernels, st: QsaSeqState, normed: Any, q_roped: Any, attn_ctx: Any,
                   k_pool: Any, v_pool: Any, seq_block_table: Any, seq_start: int, num_tokens: int, nq: int,
                   block_size: int, inv_sqrt_d: float, scratch: Any, stream: Any) -> int:
    """See :meth:`QsaIndexer.prefill_select` (``k``: the indexer's prefill kernels); returns the number of rows
    rewritten."""
    c = _check(idx, st, normed, q_roped, attn_ctx, k_pool, v_pool, seq_block_table, seq_start, num_tokens, nq,
               block_size, inv_sqrt_d, scratch, stream)
    if c.total <= c.first_sel or not idx.prefill_select_enabled:
        return 0   # every row is inert (dense attention is exact), or selection is switched off
    gpu, s, layout = idx.gpu, c.stream, c.layout
    seq_start = c.seq_start
    gpu.copy_h2d_async(c.table, idx.prefill_table_dev, s)   # pageable: staged before the call returns
    qk_buf, qpost, scores, lists = (c.scratch + off for off in layout[1:5])
    qkw, h, hd, ratio, topk = idx.qk_width, idx.n_heads, idx.hd, idx.ratio, idx.block_topk
    nkv, hd_attn = idx.nkv_attn, idx.hd_attn
    attn_tc = bool(k.attn_tc) and kp.prefill_attn_tc_supported(c.nq, nkv, hd_attn)
    attn_row = c.nq * hd_attn * 2
    attn = k.attn_pack
    for name, v in (("k_cache", c.kc), ("v_cache", c.vc), ("block_table", idx.prefill_table_dev), ("lists", lists),
                    ("block_size", c.block_size), ("nq", c.nq), ("inv_sqrt_d", c.inv)):
        attn.set(name, v)
    slab = SELECT_SLAB
    for first_pos in range(c.first_sel, c.total, slab):
        rows = min(slab, c.total - first_pos)
        first_row = first_pos - seq_start
        n_blocks = (first_pos + rows) // ratio      # the last row's complete count
        # a. qk rows, b. indexer queries
        gpu.cublas_bf16_proj_dense(c.x + first_row * idx.hidden * 2, idx.qk_proj_w, qk_buf, rows, qkw, idx.hidden, s)
        pack = k.qprep_pack
        pack.set("qk", qk_buf)
        pack.set("q_out", qpost)
        pack.set("first_pos", first_pos)
        g = kp.qprep_rows_geometry(rows, h, hd)
        gpu.launch(k.qprep, g.grid, g.block, g.shared, s, pack)
        # c. block scores
        if idx.uses_tc_scorer:
            pack, kernel, g = k.score_tc_pack, k.score_tc, kp.score_rows_tc_geometry(rows, n_blocks)
        else:
            pack, kernel, g = k.score_pack, k.score, kp.score_rows_geometry(rows, n_blocks)
        for name, v in (("q", qpost), ("block_keys", st.block_keys), ("scores", scores), ("first_pos", first_pos),
                        ("score_stride", layout.stride), ("n_blocks", n_blocks), ("rows", rows)):
            pack.set(name, v)
        gpu.launch(kernel, g.grid, g.block, g.shared, s, pack)
        # d. host top-k per row, lists in score-descending order
        host = k.scores_host(rows * layout.stride)
        gpu.copy_d2h_on_stream(scores, host, s)
        lists_host = row_lists(host.reshape(rows, layout.stride), first_pos, ratio, topk)
        gpu.copy_h2d_async(lists_host, lists, s)   # pageable: staged before the call returns
        # e. attention over the lists' tokens and each row's tail
        attn.set("q", c.q + first_row * attn_row)
        attn.set("attn_out", c.out + first_row * attn_row)
        attn.set("first_pos", first_pos)
        if attn_tc:
            g = kp.prefill_attn_tc_geometry(rows, nkv)
            gpu.launch(k.attn_tc, g.grid, g.block, g.shared, s, attn)
        else:
            g = kp.prefill_attn_geometry(rows, c.nq, nkv, hd_attn)
            gpu.launch(k.attn, g.grid, g.block, g.shared, s, attn)
    return c.total - c.first_sel


def row_lists(scores: np.ndarray, first_pos: int, ratio: int, topk: int) -> np.ndarray:
    """Per row r (position ``first_pos + r``), the first ``topk`` of blocks ``0 .. complete_r - 1`` under
    (score desc, index asc; NaN as in :mod:`hss.qsa.select`), in that order -> int32 ``[rows, topk]``.

    ``scores [rows, >= complete of the last row]``: only each row's first complete_r entries are read (the
    masked ``-1e30`` entries past them never are). Needs ``complete_r >= topk`` on every row."""
    rows = scores.shape[0]
    out = np.empty((rows, topk), dtype=np.int32)
    for r in range(rows):
        complete = (first_pos + r + 1) // ratio
        if complete < topk:
            raise HssError(f"row at position {first_pos + r} has {complete} complete blocks, fewer than topk {topk}")
        out[r] = top_blocks(scores[r, :complete], topk)
    return out
