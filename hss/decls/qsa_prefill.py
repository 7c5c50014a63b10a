"""Declarations of the QSA prefill kernels (``ptx/qsa_prefill.cuh``; docs/design.md §12.5-12.8 as amended by §0), their
launch geometry, and their emulation through :mod:`hss.reference.qsa_prefill` (float64, stored rounded to
f32 / bf16 once)."""
from __future__ import annotations

from types import SimpleNamespace
from typing import NamedTuple

import ml_dtypes
import numpy as np

from hss._util import ceil_div
from hss.decls._decl import Launch, declare, f32
from hss.errors import MemoryFault
from hss.reference import qsa_prefill as ref
from hss.reference.numerics import to_bf16, to_f32

MODULE = "qsa_indexer"   # the prefill kernels are part of the qsa_indexer PTX module

BF16 = ml_dtypes.bfloat16
SCORE_TILE = 64                                   # qsa_score_rows: rows x blocks per CTA
TC_ROWS, TC_BLOCKS, TC_HEADS, TC_HD = 32, 64, 4, 128   # qsa_score_rows_tc: CTA rows, chunk blocks, hard-coded shape
TC_CHUNKS_PER_CTA = 16                            # default run of 64-block chunks per TC CTA: 1024 blocks (grid.y)
ATTN_THREADS, ATTN_HEAD_GROUP = 256, 4            # qsa_prefill_attn: 8 warps, query heads per CTA
ATTN_TC_THREADS, ATTN_TC_HD, ATTN_TC_MAX_GROUP = 64, (64, 128, 256), 16   # qsa_prefill_attn_tc


class Geometry(NamedTuple):
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    shared: int


# -- geometry (one place; the emulator's checks hold launches to it) --------------------------------
def qprep_rows_geometry(rows: int, n_heads: int, hd: int) -> Geometry:
    return Geometry((rows, n_heads, 1), (hd, 1, 1), (hd + 32) * 4)


def score_rows_geometry(rows: int, n_blocks: int) -> Geometry:
    return Geometry((ceil_div(n_blocks, SCORE_TILE), ceil_div(rows, SCORE_TILE), 1), (256, 1, 1), 0)


def score_rows_tc_geometry(rows: int, n_blocks: int, chunk_groups: int | None = None) -> Geometry:
    """grid (ceil(rows/32), ``chunk_groups``, 1): grid.y defaults to runs of TC_CHUNKS_PER_CTA 64-block chunks;
    any value in [1, ceil(n_blocks/64)] is valid, ceil(n_blocks/64) being one chunk per CTA."""
    chunks = max(ceil_div(n_blocks, TC_BLOCKS), 1)
    gy = chunk_groups if chunk_groups is not None else ceil_div(chunks, TC_CHUNKS_PER_CTA)
    return Geometry((ceil_div(rows, TC_ROWS), max(1, min(gy, chunks)), 1), (256, 1, 1), 0)


def prefill_attn_geometry(rows: int, nq: int, nkv: int, hd: int) -> Geometry:
    groups = ceil_div(nq // nkv, ATTN_HEAD_GROUP)
    return Geometry((rows, nkv * groups, 1), (ATTN_THREADS, 1, 1), 128 * hd + 256)


def prefill_attn_tc_geometry(rows: int, nkv: int) -> Geometry:
    return Geometry((rows, nkv, 1), (ATTN_TC_THREADS, 1, 1), 0)


def prefill_attn_tc_supported(nq: int, nkv: int, hd: int) -> bool:
    """Whether ``qsa_prefill_attn_tc`` covers this shape (else use ``qsa_prefill_attn``)."""
    return nkv > 0 and nq % nkv == 0 and 1 <= nq // nkv <= ATTN_TC_MAX_GROUP and hd in ATTN_TC_HD


def _geometry_mismatch(launch: Launch, want: Geometry, shared_at_least: bool = True) -> str | None:
    if launch.grid != want.grid or launch.block != want.block:
        return f"needs grid {want.grid} and block {want.block}"
    if shared_at_least and launch.shared < want.shared:
        return f"needs {want.shared} bytes of dynamic shared memory"
    return None


# -- views ------------------------------------------------------------------------------------------
def _strided(flat: np.ndarray, rows: int, width: int, stride: int) -> np.ndarray:
    """Rows of ``width`` elements, ``stride`` apart, over a 1-D array (a view, writable if ``flat`` is)."""
    s = flat.strides[0]
    return np.lib.stride_tricks.as_strided(flat, shape=(rows, width), strides=(stride * s, s))


def _bf16(view: np.ndarray) -> np.ndarray:
    return view[:view.size - view.size % 2].view(BF16)


# -- qsa_qprep_rows ----------------------------------------------------------------------------------
def _emulate_qprep(a: SimpleNamespace, launch: Launch) -> None:
    rows = launch.grid[0]
    if not (rows and a.n_heads and a.hd):
        return
    qk = _strided(_bf16(a.qk), rows, a.n_heads * a.hd, a.qkw)
    out = ref.qprep_rows(qk, _bf16(a.q_norm_w), a.first_pos, a.n_heads, a.hd, a.rot, a.theta, a.eps)
    f32(a.q_out)[:] = to_f32(out).ravel()


def _check_qprep(a: SimpleNamespace, launch: Launch) -> str | None:
    if a.hd == 0 or a.hd % 32 or a.hd > 1024:
        return f"hd ({a.hd}) must be a positive multiple of 32, at most 1024"
    if a.rot % 2 or a.rot > a.hd:
        return f"rot ({a.rot}) must be even and <= hd ({a.hd})"
    if a.n_heads * a.hd > a.qkw:
        return f"n_heads * hd ({a.n_heads * a.hd}) exceeds qkw ({a.qkw})"
    return _geometry_mismatch(launch, qprep_rows_geometry(launch.grid[0], a.n_heads, a.hd))


def _qprep_reads_qk(a: SimpleNamespace) -> int:
    rows = a.grid[0]
    return 2 * ((rows - 1) * a.qkw + a.n_heads * a.hd) if rows and a.n_heads * a.hd else 0


QSA_QPREP_ROWS = declare(
    MODULE, "qsa_qprep_rows",
    "ptr qk, ptr q_norm_w, ptr q_out, u32 first_pos, u32 qkw, u32 n_heads, u32 hd, u32 rot, f32 theta, f32 eps",
    reads={"qk": _qprep_reads_qk, "q_norm_w": lambda a: 2 * a.hd},
    writes={"q_out": lambda a: 4 * a.grid[0] * a.n_heads * a.hd},
    emulate=_emulate_qprep, check=_check_qprep)


# -- qsa_score_rows / qsa_score_rows_tc ------------------------------------------------------------
def _scorable(a: SimpleNamespace) -> int:
    """Blocks some row can score: min(n_blocks, complete of the last row) (what the kernels read)."""
    return min(a.n_blocks, (a.first_pos + a.rows) // a.ratio) if a.ratio and a.rows else 0


def _score_writes(a: SimpleNamespace) -> int:
    return 4 * ((a.rows - 1) * a.score_stride + a.n_blocks) if a.rows and a.n_blocks else 0


def _store_scores(a: SimpleNamespace, scores: np.ndarray) -> None:
    _strided(f32(a.scores), a.rows, a.n_blocks, a.score_stride)[:] = to_f32(scores)


def _emulate_score(a: SimpleNamespace, launch: Launch) -> None:
    if not (a.rows and a.n_blocks and a.ratio):
        return
    q = f32(a.q).reshape(a.rows, a.n_heads, a.hd)
    keys = _bf16(a.block_keys).reshape(-1, a.hd) if a.hd else np.zeros((0, 0), BF16)
    _store_scores(a, ref.score_rows(q, keys, a.first_pos, a.ratio, a.n_blocks))


def _check_score(a: SimpleNamespace, launch: Launch) -> str | None:
    if a.ratio == 0 or a.hd == 0 or a.n_heads == 0:
        return "ratio, hd and n_heads must be positive"
    if a.n_blocks > a.score_stride:
        return f"n_blocks ({a.n_blocks}) exceeds score_stride ({a.score_stride})"
    return _geometry_mismatch(launch, score_rows_geometry(a.rows, a.n_blocks))


QSA_SCORE_ROWS = declare(
    MODULE, "qsa_score_rows",
    "ptr q, ptr block_keys, ptr scores, u32 first_pos, u32 score_stride, u32 ratio, u32 n_heads, u32 hd, "
    "u32 rows, u32 n_blocks",
    reads={"q": lambda a: 4 * a.rows * a.n_heads * a.hd if a.n_blocks else 0,
           "block_keys": lambda a: 2 * _scorable(a) * a.hd},
    writes={"scores": _score_writes},
    emulate=_emulate_score, check=_check_score)


def _emulate_score_tc(a: SimpleNamespace, launch: Launch) -> None:
    if not (a.rows and a.n_blocks and a.ratio):
        return
    hi, lo = ref.split_hi_lo(f32(a.q).reshape(a.rows, TC_HEADS, TC_HD))
    keys = _bf16(a.block_keys).reshape(-1, TC_HD)
    _store_scores(a, ref.score_rows(hi + lo, keys, a.first_pos, a.ratio, a.n_blocks))   # the kernel's ~17-bit q


def _check_score_tc(a: SimpleNamespace, launch: Launch) -> str | None:
    if a.ratio == 0:
        return "ratio must be positive"
    if a.n_blocks > a.score_stride:
        return f"n_blocks ({a.n_blocks}) exceeds score_stride ({a.score_stride})"
    chunks = max(ceil_div(a.n_blocks, TC_BLOCKS), 1)
    if launch.grid[0] != ceil_div(a.rows, TC_ROWS) or not 1 <= launch.grid[1] <= chunks or launch.grid[2] != 1:
        return f"needs grid (ceil(rows/{TC_ROWS}) = {ceil_div(a.rows, TC_ROWS)}, 1..{chunks}, 1)"
    if launch.block != (256, 1, 1):
        return "needs block (256, 1, 1)"
    return None


QSA_SCORE_ROWS_TC = declare(
    MODULE, "qsa_score_rows_tc",
    "ptr q, ptr block_keys, ptr scores, u32 first_pos, u32 score_stride, u32 ratio, u32 n_blocks, u32 rows",
    reads={"q": lambda a: 4 * a.rows * TC_HEADS * TC_HD if a.n_blocks else 0,
           "block_keys": lambda a: 2 * _scorable(a) * TC_HD},
    writes={"scores": _score_writes},
    emulate=_emulate_score_tc, check=_check_score_tc)


# -- qsa_prefill_attn / qsa_prefill_attn_tc -----------------------------------------------------------
ATTN_SIGNATURE = ("ptr q, ptr k_cache, ptr v_cache, ptr block_table, ptr lists, ptr attn_out, u32 first_pos, "
                  "u32 topk, u32 ratio, u32 block_size, u32 nq, u32 nkv, u32 hd, f32 inv_sqrt_d")


def _table_entries(a: SimpleNamespace) -> int:
    return ceil_div(a.first_pos + a.grid[0], a.block_size) if a.block_size else 0


def _gather(flat: np.ndarray, table: np.ndarray, tokens: np.ndarray, a: SimpleNamespace, what: str) -> np.ndarray:
    """Rows [n_tok, nkv, hd] of a paged pool seen as a flat bf16 array, every address checked."""
    if tokens.size and (tokens.min() < 0 or tokens.max() // a.block_size >= table.size):
        raise MemoryFault(f"qsa_prefill_attn {what}: a selected token is outside the block table "
                          f"({table.size} pages of {a.block_size})")
    pages = table[tokens // a.block_size].astype(np.int64)
    width = a.nkv * a.hd
    base = (pages * a.block_size + tokens % a.block_size) * width
    if tokens.size and (pages.min() < 0 or base.max() + width > flat.size):
        raise MemoryFault(f"qsa_prefill_attn {what}: a page id runs past the pool ({flat.size} elements)")
    return flat[base[:, None] + np.arange(width)[None, :]].reshape(-1, a.nkv, a.hd)


def _emulate_attn(a: SimpleNamespace, launch: Launch) -> None:
    rows = launch.grid[0]
    if not rows:
        return
    q = _bf16(a.q).reshape(rows, a.nq, a.hd)
    lists = a.lists.view(np.int32).reshape(rows, a.topk)
    table = a.block_table.view(np.int32)
    kflat, vflat = _bf16(a.k_cache), _bf16(a.v_cache)
    out = np.empty((rows, a.nq, a.hd))
    for r in range(rows):
        tok = ref.selected_tokens(lists[r], a.first_pos + r, a.ratio)
        out[r] = ref.attend(q[r], _gather(kflat, table, tok, a, "k_cache"), _gather(vflat, table, tok, a, "v_cache"),
                            a.inv_sqrt_d)
    a.attn_out.view(BF16)[:] = to_bf16(out).ravel()


def _attn_shape_error(a: SimpleNamespace) -> str | None:
    if a.nkv == 0 or a.nq == 0 or a.nq % a.nkv:
        return f"nq ({a.nq}) must be a positive multiple of nkv ({a.nkv})"
    if a.ratio == 0 or a.block_size == 0:
        return "ratio and block_size must be positive"
    return None


def _check_attn(a: SimpleNamespace, launch: Launch) -> str | None:
    problem = _attn_shape_error(a)
    if problem:
        return problem
    if a.hd == 0 or a.hd % 32 or a.hd > 256:
        return f"hd ({a.hd}) must be a multiple of 32, at most 256"
    return _geometry_mismatch(launch, prefill_attn_geometry(launch.grid[0], a.nq, a.nkv, a.hd))


def _check_attn_tc(a: SimpleNamespace, launch: Launch) -> str | None:
    problem = _attn_shape_error(a)
    if problem:
        return problem
    if not prefill_attn_tc_supported(a.nq, a.nkv, a.hd):
        return f"covers hd in {ATTN_TC_HD} and nq/nkv <= {ATTN_TC_MAX_GROUP} (got hd {a.hd}, group {a.nq // a.nkv})"
    return _geometry_mismatch(launch, prefill_attn_tc_geometry(launch.grid[0], a.nkv))


def _attn_extents() -> dict:
    return dict(
        reads={"q": lambda a: 2 * a.grid[0] * a.nq * a.hd, "k_cache": lambda a: None, "v_cache": lambda a: None,
               "block_table": lambda a: 4 * _table_entries(a), "lists": lambda a: 4 * a.grid[0] * a.topk},
        writes={"attn_out": lambda a: 2 * a.grid[0] * a.nq * a.hd})


QSA_PREFILL_ATTN = declare(MODULE, "qsa_prefill_attn", ATTN_SIGNATURE, **_attn_extents(),
                           emulate=_emulate_attn, check=_check_attn)
QSA_PREFILL_ATTN_TC = declare(MODULE, "qsa_prefill_attn_tc", ATTN_SIGNATURE, **_attn_extents(),
                              emulate=_emulate_attn, check=_check_attn_tc)
