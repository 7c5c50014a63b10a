"""Prefill selection (SPEC §11.5, "stage 2"): rows of a prefill chunk past the inert bound attend their own
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

from hss import cuda_min as cm
from hss.errors import HssError
from hss.kernels import qsa_prefill as kp
from hss.qsa._args import MIN_BLOCK_SIZE, count, pointer, real
from hss.qsa.select import top_blocks

if TYPE_CHECKING:
    from hss.qsa.indexer import QsaIndexer, QsaSeqState

__all__ = ["SELECT_SLAB", "SCRATCH_ALIGN", "ScratchLayout", "scratch_layout", "prefill_scratch_bytes",
           "prefill_select", "row_lists", "PrefillKernels"]

SELECT_SLAB = 2048     # selective rows per slab (the original's ROWS); read at call time
SCRATCH_ALIGN = 256    # each scratch part starts on this boundary (the kernels need 16 B)
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
    return -(-n // SCRATCH_ALIGN) * SCRATCH_ALIGN


def scratch_layout(total: int, qkw: int, n_heads: int, hd: int, ratio: int, topk: int) -> ScratchLayout:
    """The scratch layout for a sequence of ``total`` tokens (``SELECT_SLAB`` rows per part)."""
    rows = SELECT_SLAB
    stride = -(-total // ratio)
    qpost = _align(rows * qkw * 2)
    scores = _align(qpost + rows * n_heads * hd * 4)
    lists = _align(scores + rows * stride * 4)
    return ScratchLayout(stride, 0, qpost, scores, lists, lists + rows * topk * 4)


def prefill_scratch_bytes(total: int, qkw: int, n_heads: int, hd: int, ratio: int, topk: int) -> int:
    """Bytes of scratch ``prefill_select`` needs when the sequence holds ``total`` tokens (grows with total:
    size it for the longest sequence)."""
    return scratch_layout(total, qkw, n_heads, hd, ratio, topk).nbytes


class PrefillKernels:
    """The prefill kernels of one indexer and their prepared parameter packs (refilled per launch).

    ``score_tc`` / ``attn_tc`` are falsy handles where the backend lacks the optional kernels."""

    def __init__(self, idx: "QsaIndexer") -> None:
        gpu = idx.gpu
        self.qprep = gpu.kernel(kp.MODULE, "qsa_qprep_rows")
        self.score = gpu.kernel(kp.MODULE, "qsa_score_rows")
        self.attn = gpu.kernel(kp.MODULE, "qsa_prefill_attn")
        self.score_tc = gpu.try_kernel(kp.MODULE, "qsa_score_rows_tc")
        self.attn_tc = gpu.try_kernel(kp.MODULE, "qsa_prefill_attn_tc")
        self.qprep_pack = self.qprep.pack(0, idx.q_norm_w, 0, 0, idx.qk_width, idx.n_heads, idx.hd, idx.rot,
                                          idx.theta, idx.eps)
        self.score_pack = self.score.pack()
        self.score_tc_pack = self.score_tc.pack() if self.score_tc else None
        self.attn_pack = self.attn.pack()   # qsa_prefill_attn_tc has the same signature: one pack serves both


# -- argument checks (all before any device work) -----------------------------------------------------
def _sized(name: str, obj: Any) -> tuple[int, int]:
    """(address, bytes) of a device buffer whose size is known: a ``(pointer, nbytes)`` pair, a DeviceBuffer,
    a contiguous ``__cuda_array_interface__`` object, or a tensor with ``data_ptr()`` and ``nbytes``."""
    if isinstance(obj, tuple) and len(obj) == 2:
        return pointer(name, obj[0]), count(f"{name} size", obj[1], 0, 2**63 - 1)
    if isinstance(obj, cm.DeviceBuffer):
        return pointer(name, obj), int(obj.bytes)
    try:
        cai = getattr(obj, "__cuda_array_interface__", None)
    except TypeError:   # torch refuses bf16 here; its nbytes below still works
        cai = None
    if cai is not None:
        shape, itemsize = tuple(cai["shape"]), int(cai["typestr"][2:])
        strides = cai.get("strides")
        if strides is not None and tuple(strides) != tuple(
                int(np.prod(shape[i + 1:], dtype=np.int64)) * itemsize for i in range(len(shape))):
            raise HssError(f"QsaIndexer: {name} must be contiguous")
        return pointer(name, obj), int(np.prod(shape, dtype=np.int64)) * itemsize
    nbytes = getattr(obj, "nbytes", None)
    if callable(getattr(obj, "data_ptr", None)) and isinstance(nbytes, (int, np.integer)):
        return pointer(name, obj), int(nbytes)
    raise HssError(f"QsaIndexer: the size of {name} ({type(obj).__name__}) is unknown, so it cannot be checked; "
                   f"pass a DeviceBuffer, an array with __cuda_array_interface__, or a (pointer, nbytes) pair")


def _aligned(name: str, ptr: int) -> None:
    if ptr % 16:
        raise HssError(f"QsaIndexer: {name} ({ptr:#x}) must be 16-byte aligned: the prefill kernels load it in 16-byte "
                       "vectors (device allocations are; offset views by whole rows)")


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


# -- the stage ------------------------------------------------------------------------------------
def prefill_select(idx: "QsaIndexer", st: "QsaSeqState", normed: Any, q_roped: Any, attn_ctx: Any, k_pool: Any,
                   v_pool: Any, seq_block_table: Any, seq_start: int, num_tokens: int, nq: int, block_size: int,
                   inv_sqrt_d: float, scratch: Any, stream: Any) -> int:
    """See :meth:`QsaIndexer.prefill_select`; returns the number of rows rewritten."""
    idx._check_state(st, "prefill_select")
    num_tokens = count("num_tokens", num_tokens, 0, _I32)
    seq_start = count("seq_start", seq_start, 0, _I32)
    total = seq_start + num_tokens
    if st.ingested != total:
        raise HssError(f"QSA: prefill_select for positions {seq_start}..{total - 1} but {st.ingested} tokens are "
                       f"ingested; call prefill_ingest(st, hidden, {num_tokens}, {seq_start}, stream) for this chunk "
                       "first, then select it")
    nkv, hd_attn = idx.nkv_attn, idx.hd_attn
    nq = count("nq", nq, 1, _I32, why="the attention's query heads")
    if nq % nkv:
        raise HssError(f"QsaIndexer: nq ({nq}) must be a multiple of nkv_attn ({nkv}): each KV head serves "
                       f"nq // nkv_attn query heads")
    if hd_attn % 32 or hd_attn > 256:
        raise HssError(f"QsaIndexer: prefill_select needs hd_attn ({hd_attn}) a multiple of 32, at most 256 "
                       "(qsa_prefill_attn's lanes hold hd_attn / 32 dims each)")
    block_size = count("block_size", block_size, MIN_BLOCK_SIZE,
                       why=f"the prefill table is sized for pages of at least {MIN_BLOCK_SIZE} tokens")
    inv = real("inv_sqrt_d", inv_sqrt_d, positive=True)
    pages = -(-total // block_size)
    table = _host_table(seq_block_table, pages, total, block_size)
    layout = scratch_layout(total, idx.qk_width, idx.n_heads, idx.hd, idx.ratio, idx.block_topk)
    base, have = _sized("scratch", scratch)
    if have < layout.nbytes:
        raise HssError(f"QsaIndexer: scratch holds {have} bytes but prefill_select needs {layout.nbytes} for "
                       f"{total} tokens; allocate idx.prefill_scratch_bytes({total}) bytes (or for the longest "
                       "sequence)")
    _aligned("scratch", base)
    if num_tokens:
        ptrs = [pointer(n, v) for n, v in (("normed", normed), ("q_roped", q_roped), ("attn_ctx", attn_ctx),
                                          ("k_pool", k_pool), ("v_pool", v_pool))]
        for name, p in zip(("q_roped", "attn_ctx", "k_pool", "v_pool"), ptrs[1:]):
            _aligned(name, p)
    s = cm.stream_handle(stream)
    first_sel = max(idx.inert_bound(), seq_start)
    if total <= first_sel or not idx.prefill_select_enabled:
        return 0   # every row is inert (dense attention is exact), or selection is switched off
    x, q, out, kc, vc = ptrs
    gpu, k = idx.gpu, idx._prefill
    gpu.copy_h2d_async(table, idx.prefill_table_dev, s)   # pageable: staged before the call returns
    qk_buf, qpost, scores, lists = (base + off for off in layout[1:5])
    qkw, h, hd, ratio, topk = idx.qk_width, idx.n_heads, idx.hd, idx.ratio, idx.block_topk
    attn_tc = bool(k.attn_tc) and kp.prefill_attn_tc_supported(nq, nkv, hd_attn)
    attn_row = nq * hd_attn * 2
    k.attn_pack.fill(0, kc, vc, idx.prefill_table_dev, lists, 0, 0, topk, ratio, block_size, nq, nkv, hd_attn, inv)
    slab = SELECT_SLAB
    for first_pos in range(first_sel, total, slab):
        rows = min(slab, total - first_pos)
        first_row = first_pos - seq_start
        n_blocks = (first_pos + rows) // ratio      # the last row's complete count
        # a. qk rows, b. indexer queries
        gpu.cublas_bf16_proj_dense(x + first_row * idx.hidden * 2, idx.qk_proj_w, qk_buf, rows, qkw, idx.hidden, s)
        pack = k.qprep_pack
        pack.set(0, qk_buf)
        pack.set(2, qpost)
        pack.set(3, first_pos)
        g = kp.qprep_rows_geometry(rows, h, hd)
        gpu.launch(k.qprep, g.grid, g.block, g.shared, s, pack)
        # c. block scores
        if idx.uses_tc_scorer:
            pack = k.score_tc_pack
            pack.fill(qpost, st.block_keys, scores, first_pos, layout.stride, ratio, n_blocks, rows)
            g = kp.score_rows_tc_geometry(rows, n_blocks)
            gpu.launch(k.score_tc, g.grid, g.block, g.shared, s, pack)
        else:
            pack = k.score_pack
            pack.fill(qpost, st.block_keys, scores, first_pos, layout.stride, ratio, h, hd, rows, n_blocks)
            g = kp.score_rows_geometry(rows, n_blocks)
            gpu.launch(k.score, g.grid, g.block, g.shared, s, pack)
        # d. host top-k per row, lists in score-descending order
        host = _host_scores(idx, rows * layout.stride)
        gpu.copy_d2h_on_stream(scores, host, s)
        lists_host = row_lists(host.reshape(rows, layout.stride), first_pos, ratio, topk)
        gpu.copy_h2d_async(lists_host, lists, s)   # pageable: staged before the call returns
        # e. attention over the lists' tokens and each row's tail
        pack = k.attn_pack
        pack.set(0, q + first_row * attn_row)
        pack.set(5, out + first_row * attn_row)
        pack.set(6, first_pos)
        if attn_tc:
            g = kp.prefill_attn_tc_geometry(rows, nkv)
            gpu.launch(k.attn_tc, g.grid, g.block, g.shared, s, pack)
        else:
            g = kp.prefill_attn_geometry(rows, nq, nkv, hd_attn)
            gpu.launch(k.attn, g.grid, g.block, g.shared, s, pack)
    return total - first_sel


def _host_scores(idx: "QsaIndexer", n: int) -> np.ndarray:
    """A reused host f32 buffer of at least ``n`` entries (grown on demand), its first ``n`` as a view."""
    buf = idx._prefill_scores_host
    if buf.size < n:
        buf = idx._prefill_scores_host = np.empty(n, dtype=np.float32)
    return buf[:n]


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
