"""Declarations of the device decode-step kernels (``ptx/qsa_device.cu``, docs/design.md §17.1-§17.4), their launch
geometry, and their emulation through :mod:`hss.reference.qsa_device` and :mod:`hss.reference.qsa` (float64, stored
rounded to the kernels' dtypes once).

Like the kernels, the emulations read ``slots``, ``pos`` and ``desc`` from device memory when they run (so a
replayed graph follows the positions the step advances), and reach the per-slot ``raw_keys`` / ``block_keys``
(addresses in ``desc``) and the paged pools (page ids in ``block_tables``) through ``Launch.view``: every such
access is bounds-checked and an address outside the allocations is a :class:`~hss.errors.MemoryFault`.

Geometry (``*_geometry`` below; the ``check`` functions hold emulated launches to it, the kernels return untouched
on a broken contract):

* ``qsa_dev_qk``: grid (``qk_geometry(n)``), block (``QK_THREADS``), no shared memory; R <= ``QK_MAX_ROWS``;
* ``qsa_dev_prep``: grid (R, n_heads + 2), block (hd), dynamic smem ``prep_smem_bytes(hd)``;
* ``qsa_dev_score``: grid (``score_grid(max_blocks, hd)``, R) (any grid.x >= 1 works), block (``SCORE_THREADS``),
  dynamic smem ``score_smem_bytes(n_heads, hd)``;
* ``qsa_dev_topk``: grid (R), block (``TOPK_THREADS``), dynamic smem ``topk_smem_bytes(max_blocks)``;
* ``qsa_sparse_attn``: grid (R, nkv, ``splits(sel_cap)``), block (``ATTN_THREADS``), dynamic smem
  ``attn_smem_bytes(hd)`` (past 48 KiB for hd >= 96: the function needs ``set_max_dynamic_shared``);
* ``qsa_sparse_merge``: grid (R, nq), block (``merge_threads(hd)``), no shared memory.
(``*_geometry`` give each as a ``Geometry(grid, block, shared)``.)
"""
from __future__ import annotations

from types import SimpleNamespace

import ml_dtypes
import numpy as np

from hss._util import ceil_div
from hss.decls import qsa as kq
from hss.decls._decl import Launch, declare, f32
from hss.decls.qsa_prefill import Geometry
from hss.errors import EmulatorError, MemoryFault
from hss.reference import linear as lin
from hss.reference import qsa as ref
from hss.reference import qsa_device as dref
from hss.reference.numerics import to_bf16, to_f32

__all__ = ["MODULE", "QK_THREADS", "QK_COLS", "QK_MAX_ROWS", "qk_geometry",
           "SCORE_THREADS", "SCORE_STEPS", "SCORE_MAX_CTAS", "TOPK_THREADS", "TOPK_ITEMS", "TOPK_TILE",
           "TOPK_CACHE_MAX", "SPLIT", "ATTN_THREADS", "ATTN_MAX_GROUP", "ATTN_MAX_HD", "Geometry", "prep_smem_bytes",
           "prep_geometry", "score_smem_bytes", "score_grid", "score_geometry", "topk_smem_bytes", "topk_geometry",
           "splits", "attn_hd_problem", "attn_smem_bytes", "attn_geometry", "merge_threads", "merge_geometry",
           "part_ml_bytes", "part_o_bytes"]

BF16 = ml_dtypes.bfloat16
MODULE = "qsa_device"
SCORE_THREADS, SCORE_STEPS = kq.SCORE_THREADS, kq.SCORE_STEPS   # qsa_common.cuh's, shared with qsa_score
SCORE_MAX_CTAS = 256       # score_geometry's cap on grid.x (the kernel is grid-stride: any G gives the same bits)
TOPK_THREADS = 1024        # QSA_TOPK_THREADS
TOPK_ITEMS = 8             # QSA_TOPK_ITEMS: consecutive blocks per thread
TOPK_TILE = TOPK_THREADS * TOPK_ITEMS   # QSA_TOPK_TILE: rows of at most this many blocks stay in registers
TOPK_CACHE_MAX = 192 * 1024             # the largest key cache topk_smem_bytes asks for (48K blocks)
SPLIT = 128                # QSA_SPLIT: tokens per split of qsa_sparse_attn (fixed: the bits depend on it)
ATTN_THREADS = 256         # QSA_ATTN_THREADS
ATTN_MAX_GROUP = 16        # QSA_ATTN_MAX_G: query heads per kv head
ATTN_MAX_HD = 256          # QSA_ATTN_MAX_HD
QK_THREADS = 128           # QSA_QK_THREADS
QK_COLS = QK_THREADS // 32   # QSA_QK_COLS: output columns per CTA
QK_MAX_ROWS = 8            # QSA_QK_MAX_ROWS: batch rows of one qsa_dev_qk launch at most


# -- geometry -----------------------------------------------------------------------------------------------
def prep_smem_bytes(hd: int) -> int:
    """Dynamic shared memory of ``qsa_dev_prep``: the normed row and 32 warp sums."""
    return (hd + 32) * 4


def qk_geometry(n: int) -> Geometry:
    """``qsa_dev_qk``: one warp per output column (any batch of at most ``QK_MAX_ROWS`` rows)."""
    return Geometry((ceil_div(n, QK_COLS), 1, 1), (QK_THREADS, 1, 1), 0)


def prep_geometry(rows: int, n_heads: int, hd: int) -> Geometry:
    """``qsa_dev_prep``: one CTA per (row, query head), one for the raw key, one for the block pool."""
    return Geometry((rows, n_heads + 2, 1), (hd, 1, 1), prep_smem_bytes(hd))


def score_smem_bytes(n_heads: int, hd: int) -> int:
    """Dynamic shared memory of ``qsa_dev_score``: q_post's row staged as f32 ``[n_heads, hd]``."""
    return n_heads * hd * 4


def score_grid(max_blocks: int, hd: int) -> int:
    """grid.x of ``qsa_dev_score`` for rows of up to ``max_blocks`` complete blocks: one warp tile per warp at
    ``max_blocks``, capped at ``SCORE_MAX_CTAS`` (the kernel is grid-stride, so any grid.x >= 1 gives the same bits)."""
    warps = SCORE_THREADS // 32
    per = warps * (256 // hd) * SCORE_STEPS if hd in (32, 64, 128, 256) else warps
    return min(max(1, ceil_div(max_blocks, per)), SCORE_MAX_CTAS)


def score_geometry(rows: int, max_blocks: int, n_heads: int, hd: int) -> Geometry:
    return Geometry((score_grid(max_blocks, hd), rows, 1), (SCORE_THREADS, 1, 1), score_smem_bytes(n_heads, hd))


def topk_smem_bytes(max_blocks: int) -> int:
    """Dynamic shared memory for ``qsa_dev_topk`` over rows of up to ``max_blocks`` blocks: a 4-byte key per block
    when the rows span more than one tile and the keys fit ``TOPK_CACHE_MAX`` (else 0: the keys stay in registers,
    or are re-read from global memory at every pass). Past 48 KiB the function needs ``set_max_dynamic_shared``."""
    return 4 * max_blocks if TOPK_TILE < max_blocks <= TOPK_CACHE_MAX // 4 else 0


def topk_geometry(rows: int, max_blocks: int) -> Geometry:
    """``qsa_dev_topk``: one CTA of ``TOPK_THREADS`` per row."""
    return Geometry((rows, 1, 1), (TOPK_THREADS, 1, 1), topk_smem_bytes(max_blocks))


def splits(sel_cap: int) -> int:
    """Splits of a selection of up to ``sel_cap`` tokens: ceil(sel_cap / SPLIT) (grid.z of qsa_sparse_attn)."""
    return ceil_div(sel_cap, SPLIT)


def attn_hd_problem(hd: int) -> str | None:
    """Why ``qsa_sparse_attn`` cannot take head dim ``hd`` (None: it can)."""
    if not 0 < hd <= ATTN_MAX_HD or hd % 32:
        return f"the sparse attention kernel takes head dims that are multiples of 32 up to {ATTN_MAX_HD}"
    return None


def attn_smem_bytes(hd: int) -> int:
    """Dynamic shared memory of ``qsa_sparse_attn`` (the kernel's QsdAttnSmem<hd>::BYTES): Q [16][hd+8] bf16, K and V
    [SPLIT][hd+8] bf16, S [16][SPLIT+8] f32, token offsets [SPLIT] i64, a SPLIT-bit valid mask. Past 48 KiB
    (hd >= 96) the function needs ``set_max_dynamic_shared``."""
    rs = hd + 8
    return 16 * rs * 2 + 2 * SPLIT * rs * 2 + 16 * (SPLIT + 8) * 4 + SPLIT * 8 + SPLIT // 8


def attn_geometry(rows: int, nkv: int, sel_cap: int, hd: int) -> Geometry:
    """``qsa_sparse_attn``: one CTA per (row, kv head, split of SPLIT tokens)."""
    return Geometry((rows, nkv, splits(sel_cap)), (ATTN_THREADS, 1, 1), attn_smem_bytes(hd))


def merge_threads(hd: int) -> int:
    """Block of ``qsa_sparse_merge``: hd rounded up to a warp, at most 256 (the kernel strides over hd)."""
    return min(ceil_div(hd, 32) * 32, 256)


def merge_geometry(rows: int, nq: int, hd: int) -> Geometry:
    """``qsa_sparse_merge``: one CTA per (row, query head)."""
    return Geometry((rows, nq, 1), (merge_threads(hd), 1, 1), 0)


def part_ml_bytes(rows: int, nq: int, sel_cap: int) -> int:
    """Bytes of ``part_ml`` f32 [rows, nq, splits, 2] (per split: max logit in log2 units, softmax sum)."""
    return 4 * rows * nq * splits(sel_cap) * 2


def part_o_bytes(rows: int, nq: int, sel_cap: int, hd: int) -> int:
    """Bytes of ``part_o`` f32 [rows, nq, splits, hd] (per split: the unnormalised weighted sum of V)."""
    return 4 * rows * nq * splits(sel_cap) * hd


# -- device memory ------------------------------------------------------------------------------------------
def _whole(view: np.ndarray, item: int) -> np.ndarray:
    return view[:view.size // item * item]


def _i32(view: np.ndarray) -> np.ndarray:
    return _whole(view, 4).view(np.int32)


def _bf16(view: np.ndarray) -> np.ndarray:
    return _whole(view, 2).view(BF16)


def _memory(launch: Launch, kernel: str):
    if launch.view is None:
        raise EmulatorError(f"{kernel}: emulating it needs the emulator's device memory (Launch.view)")
    return launch.view


def _position(kernel: str, a: SimpleNamespace, r: int) -> tuple[int, int] | None:
    """(slot, p) of batch row r as the kernels read them (None: slots[r] < 0 or pos < 0, the row is left alone)."""
    slot = int(_i32(a.slots)[r])
    if slot < 0:
        return None
    pos = _i32(a.pos)
    if slot >= pos.size:
        raise MemoryFault(f"{kernel} parameter pos: slots[{r}] = {slot} lies past the pos allocation "
                          f"({pos.size} entries)")
    p = int(pos[slot])
    return None if p < 0 else (slot, p)


def _desc(kernel: str, a: SimpleNamespace, slot: int) -> tuple[int, int]:
    """(raw_keys, block_keys) addresses of ``slot``."""
    desc = _whole(a.desc, 8).view(np.uint64)
    if 2 * slot + 1 >= desc.size:
        raise MemoryFault(f"{kernel} parameter desc: slot {slot} lies past the desc allocation "
                          f"({desc.size // 2} slots)")
    return int(desc[2 * slot]), int(desc[2 * slot + 1])


def _rows_of(view: np.ndarray, rows: int, width: int, stride: int) -> np.ndarray:
    flat = _bf16(view)
    s = flat.strides[0]
    return np.lib.stride_tricks.as_strided(flat, shape=(rows, width), strides=(stride * s, s))


# -- qsa_dev_qk ---------------------------------------------------------------------------------------------
QK = "qsa_dev_qk"


def _emulate_qk(a: SimpleNamespace, launch: Launch) -> None:
    act = _bf16(a.act)[:a.rows * a.k].reshape(a.rows, a.k)
    w = _bf16(a.w)[:a.n * a.k].reshape(a.n, a.k)
    _bf16(a.out)[:a.rows * a.n].reshape(a.rows, a.n)[:] = to_bf16(lin.proj_dense(act, w))


def _check_qk(a: SimpleNamespace, launch: Launch) -> str | None:
    if not 1 <= a.rows <= QK_MAX_ROWS or a.n <= 0 or a.k <= 0:
        return f"needs 1 <= rows <= {QK_MAX_ROWS}, n >= 1 and k >= 1"
    want = qk_geometry(a.n)
    if launch.grid[1:] != (1, 1) or launch.grid[0] < want.grid[0] or launch.block != want.block:
        return f"needs grid (>= {want.grid[0]}, 1, 1) and block {want.block}"
    return None


QSA_DEV_QK = declare(
    MODULE, QK,
    "ptr act, ptr w, ptr out, u32 rows, u32 n, u32 k",
    reads={"act": lambda a: 2 * a.rows * a.k, "w": lambda a: 2 * a.n * a.k},
    writes={"out": lambda a: 2 * a.rows * a.n},
    emulate=_emulate_qk, check=_check_qk)


# -- qsa_dev_prep -------------------------------------------------------------------------------------------
PREP = "qsa_dev_prep"


def _emulate_prep(a: SimpleNamespace, launch: Launch) -> None:
    view = _memory(launch, PREP)
    rows, nh, hd, ratio = launch.grid[0], a.n_heads, a.hd, a.ratio
    qk = _rows_of(a.qk, rows, (nh + 1) * hd, a.qkw)
    q_post = f32(a.q_post).reshape(rows, nh, hd)
    wq, wk = _bf16(a.q_norm_w), _bf16(a.k_norm_w)
    for r in range(rows):
        at = _position(PREP, a, r)
        if at is None or at[1] >= a.max_tokens:
            continue
        slot, p = at
        q_post[r] = to_f32(ref.qprep(qk[r, :nh * hd].reshape(nh, hd), wq, p, a.rot, a.theta, a.eps))
        raw_addr, keys_addr = _desc(PREP, a, slot)
        what = f"{PREP} raw_keys of slot {slot} (desc[{slot}, 0])"
        view(raw_addr + p * hd * 2, hd * 2, f"{what}, row {p}").view(BF16)[:] = qk[r, nh * hd:]
        if (p + 1) % ratio == 0:   # block b completes: pooled from its rows b*ratio .. p (row p just stored)
            b = (p + 1) // ratio - 1
            rows = view(raw_addr + b * ratio * hd * 2, ratio * hd * 2, f"{what}, rows {b * ratio}..{p}").view(BF16)
            key = dref.pool_block(rows.reshape(ratio, hd), wk, b, a.rot, a.theta, a.eps)
            view(keys_addr + b * hd * 2, hd * 2, f"{PREP} block_keys of slot {slot} (desc[{slot}, 1]), row {b}") \
                .view(BF16)[:] = to_bf16(key)


def _check_prep(a: SimpleNamespace, launch: Launch) -> str | None:
    hd, rot = a.hd, a.rot
    if hd <= 0 or hd % 32 or hd > 1024:
        return f"hd ({hd}) must be a positive multiple of 32, at most 1024"
    if rot > hd or rot % 2:
        return f"rot ({rot}) must be even and <= hd ({hd})"
    if a.ratio <= 0:
        return "ratio must be >= 1"
    if (a.n_heads + 1) * hd > a.qkw:
        return f"(n_heads + 1) * hd ({(a.n_heads + 1) * hd}) exceeds qkw ({a.qkw})"
    want = prep_geometry(launch.grid[0], a.n_heads, hd)
    if launch.grid != want.grid or launch.block != want.block:
        return f"needs grid (R, n_heads + 2, 1) = {want.grid} and block {want.block}"
    if launch.shared < want.shared:
        return f"needs {want.shared} bytes of dynamic shared memory ((hd + 32) * 4)"
    return None


QSA_DEV_PREP = declare(
    MODULE, PREP,
    "ptr qk, ptr q_norm_w, ptr k_norm_w, ptr desc, ptr pos, ptr slots, ptr q_post, u32 qkw, u32 n_heads, u32 hd, "
    "u32 ratio, u32 rot, f32 theta, f32 eps, u32 max_tokens",
    reads={"qk": lambda a: 2 * ((a.grid[0] - 1) * a.qkw + (a.n_heads + 1) * a.hd),
           "q_norm_w": lambda a: 2 * a.hd, "k_norm_w": lambda a: 2 * a.hd,
           "desc": lambda a: None, "pos": lambda a: None,            # slot-indexed: checked per row
           "slots": lambda a: 4 * a.grid[0]},
    writes={"q_post": lambda a: 4 * a.grid[0] * a.n_heads * a.hd},
    emulate=_emulate_prep, check=_check_prep)


# -- qsa_dev_score ------------------------------------------------------------------------------------------
SCORE = "qsa_dev_score"


def _emulate_score(a: SimpleNamespace, launch: Launch) -> None:
    view = _memory(launch, SCORE)
    rows, nh, hd = launch.grid[1], a.n_heads, a.hd
    q_post = f32(a.q_post).reshape(rows, nh, hd)
    scores = f32(a.scores)
    for r in range(rows):
        at = _position(SCORE, a, r)
        if at is None:
            continue
        slot, p = at
        complete = (p + 1) // a.ratio
        if complete <= a.k_blocks or complete > a.score_stride:
            continue
        keys_addr = _desc(SCORE, a, slot)[1]
        keys = view(keys_addr, complete * hd * 2, f"{SCORE} block_keys of slot {slot} (desc[{slot}, 1]), "
                    f"{complete} blocks").view(BF16).reshape(complete, hd)
        scores[r * a.score_stride:r * a.score_stride + complete] = to_f32(ref.score(q_post[r], keys))


def _check_score(a: SimpleNamespace, launch: Launch) -> str | None:
    if a.hd <= 0 or a.n_heads <= 0 or a.ratio <= 0:
        return "hd, n_heads and ratio must be >= 1"
    bx = launch.block[0]
    if bx % 32 or bx > SCORE_THREADS or launch.block[1:] != (1, 1) or launch.grid[2] != 1:
        return f"needs block (32 * W <= {SCORE_THREADS}, 1, 1) and grid (G, R, 1)"
    if launch.shared < score_smem_bytes(a.n_heads, a.hd):
        return f"needs {score_smem_bytes(a.n_heads, a.hd)} bytes of dynamic shared memory (n_heads * hd * 4)"
    return None


QSA_DEV_SCORE = declare(
    MODULE, SCORE,
    "ptr q_post, ptr desc, ptr pos, ptr slots, ptr scores, u32 score_stride, u32 n_heads, u32 hd, u32 ratio, "
    "u32 k_blocks",
    reads={"q_post": lambda a: 4 * a.grid[1] * a.n_heads * a.hd, "desc": lambda a: None, "pos": lambda a: None,
           "slots": lambda a: 4 * a.grid[1]},
    writes={"scores": lambda a: 4 * a.grid[1] * a.score_stride},
    emulate=_emulate_score, check=_check_score)


# -- qsa_dev_topk -------------------------------------------------------------------------------------------
TOPK = "qsa_dev_topk"


def _emulate_topk(a: SimpleNamespace, launch: Launch) -> None:
    rows, stride, cap = launch.grid[0], a.score_stride, a.sel_cap
    scores = f32(a.scores)
    tokens, counts = _i32(a.tokens), _i32(a.counts)
    for r in range(rows):
        at = _position(TOPK, a, r)
        if at is None or at[1] >= a.max_tokens:
            counts[r] = 0
            continue
        slot, p = at
        toks = dref.step_tokens(scores[r * stride:(r + 1) * stride], p, a.ratio, a.k_blocks)
        tokens[r * cap:r * cap + toks.size] = toks
        counts[r] = toks.size
        _i32(a.pos)[slot] = p + 1


def _check_topk(a: SimpleNamespace, launch: Launch) -> str | None:
    if a.ratio <= 0:
        return "ratio must be >= 1"
    if a.max_tokens > 2**31 - 1:
        return f"max_tokens ({a.max_tokens}) must be < 2^31 (token ids are i32)"
    if a.score_stride < a.max_tokens // a.ratio:
        return f"score_stride ({a.score_stride}) must hold max_tokens // ratio = {a.max_tokens // a.ratio} blocks"
    if a.sel_cap < (a.k_blocks + 1) * a.ratio - 1:
        return (f"sel_cap ({a.sel_cap}) must hold (k_blocks + 1) * ratio - 1 = {(a.k_blocks + 1) * a.ratio - 1} "
                "tokens (the largest inert selection)")
    if launch.block != (TOPK_THREADS, 1, 1) or launch.grid[1:] != (1, 1):
        return f"needs block ({TOPK_THREADS}, 1, 1) and grid (R, 1, 1)"
    return None


QSA_DEV_TOPK = declare(
    MODULE, TOPK,
    "ptr scores, ptr pos, ptr slots, ptr tokens, ptr counts, u32 score_stride, u32 k_blocks, u32 ratio, "
    "u32 sel_cap, u32 max_tokens",
    reads={"scores": lambda a: 4 * a.grid[0] * a.score_stride, "pos": lambda a: None,
           "slots": lambda a: 4 * a.grid[0]},
    writes={"pos": lambda a: None, "tokens": lambda a: 4 * a.grid[0] * a.sel_cap, "counts": lambda a: 4 * a.grid[0]},
    emulate=_emulate_topk, check=_check_topk)


# -- qsa_sparse_attn / qsa_sparse_merge -------------------------------------------------------------------
ATTN = "qsa_sparse_attn"


def _count(a: SimpleNamespace, r: int) -> int:
    return min(max(int(_i32(a.counts)[r]), 0), a.sel_cap)


def _pool_rows(flat: np.ndarray, page: np.ndarray, slot: np.ndarray, valid: np.ndarray, a: SimpleNamespace,
               what: str, r: int) -> np.ndarray:
    """K or V rows [n, nkv, hd] of kv heads 0..nkv-1 (zeros where not valid), every address checked."""
    width = a.nkv * a.hd
    base = (page * a.block_size + slot) * width
    bad = valid & (base + width > flat.size)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise MemoryFault(f"{ATTN} parameter {what}: row {r}, token #{i} on page {int(page[i])} lies past the pool "
                          f"allocation ({flat.size // width} token rows)")
    rows = np.zeros((page.size, width), dtype=BF16)
    rows[valid] = flat[base[valid][:, None] + np.arange(width)]
    return rows.reshape(-1, a.nkv, a.hd)


def _emulate_attn(a: SimpleNamespace, launch: Launch) -> None:
    rows, nq, hd, ns = launch.grid[0], a.nq, a.hd, splits(a.sel_cap)
    q = _bf16(a.q).reshape(rows, nq, hd)
    tables = _i32(a.block_tables).reshape(rows, a.max_pages)
    tokens = _i32(a.tokens).reshape(rows, a.sel_cap)
    kflat, vflat = _bf16(a.k_pool), _bf16(a.v_pool)
    part_ml = f32(a.part_ml).reshape(rows, nq, ns, 2)
    part_o = f32(a.part_o).reshape(rows, nq, ns, hd)
    for r in range(rows):
        n = _count(a, r)
        if n == 0:
            continue
        page, slot, valid = dref.page_rows(tokens[r, :n], tables[r], a.block_size)
        k = _pool_rows(kflat, page, slot, valid, a, "k_pool", r)
        v = _pool_rows(vflat, page, slot, valid, a, "v_pool", r)
        m, l, o = dref.split_partials(q[r], k, v, valid, a.scale, SPLIT)
        c = m.shape[0]
        part_ml[r, :, :c, 0] = to_f32(m.T)
        part_ml[r, :, :c, 1] = to_f32(l.T)
        part_o[r, :, :c] = to_f32(o.transpose(1, 0, 2))


def _check_attn(a: SimpleNamespace, launch: Launch) -> str | None:
    problem = attn_hd_problem(a.hd)
    if problem:
        return f"hd = {a.hd}: {problem}"
    if a.nkv <= 0 or a.nq % a.nkv or not 1 <= a.nq // a.nkv <= ATTN_MAX_GROUP:
        return f"nq ({a.nq}) must be a multiple of nkv ({a.nkv}) with 1 <= nq / nkv <= {ATTN_MAX_GROUP}"
    if a.block_size <= 0 or a.sel_cap <= 0:
        return "block_size and sel_cap must be >= 1"
    if (a.q | a.k_pool | a.v_pool) % 16 or a.part_o % 8:
        return "q, k_pool and v_pool must be 16-byte aligned, part_o 8-byte aligned"
    want = attn_geometry(launch.grid[0], a.nkv, a.sel_cap, a.hd)
    if launch.grid != want.grid or launch.block != want.block:
        return f"needs grid (R, nkv, ceil(sel_cap / {SPLIT})) = {want.grid} and block {want.block}"
    if launch.shared < want.shared:
        return f"needs {want.shared} bytes of dynamic shared memory (attn_smem_bytes({a.hd}))"
    return None


def _parts(a: SimpleNamespace, per: int) -> int:
    return 4 * a.grid[0] * a.nq * splits(a.sel_cap) * per


QSA_SPARSE_ATTN = declare(
    MODULE, ATTN,
    "ptr q, ptr k_pool, ptr v_pool, ptr block_tables, ptr tokens, ptr counts, ptr part_ml, ptr part_o, "
    "u32 max_pages, u32 sel_cap, u32 block_size, u32 nq, u32 nkv, u32 hd, f32 scale",
    reads={"q": lambda a: 2 * a.grid[0] * a.nq * a.hd, "k_pool": lambda a: None, "v_pool": lambda a: None,
           "block_tables": lambda a: 4 * a.grid[0] * a.max_pages, "tokens": lambda a: 4 * a.grid[0] * a.sel_cap,
           "counts": lambda a: 4 * a.grid[0]},
    writes={"part_ml": lambda a: _parts(a, 2), "part_o": lambda a: _parts(a, a.hd)},
    emulate=_emulate_attn, check=_check_attn)


MERGE = "qsa_sparse_merge"


def _emulate_merge(a: SimpleNamespace, launch: Launch) -> None:
    rows, nq, hd, ns = launch.grid[0], a.nq, a.hd, splits(a.sel_cap)
    part_ml = f32(a.part_ml).reshape(rows, nq, ns, 2)
    part_o = f32(a.part_o).reshape(rows, nq, ns, hd)
    out = _bf16(a.out).reshape(rows, nq, hd)
    for r in range(rows):
        c = _count(a, r)
        c = ceil_div(c, SPLIT)
        out[r] = to_bf16(dref.merge_splits(part_ml[r, :, :c, 0].T, part_ml[r, :, :c, 1].T,
                                           part_o[r, :, :c].transpose(1, 0, 2)))


def _check_merge(a: SimpleNamespace, launch: Launch) -> str | None:
    if a.sel_cap <= 0 or a.nq <= 0 or not 0 < a.hd <= ATTN_MAX_HD:
        return f"sel_cap and nq must be >= 1 and hd in 1..{ATTN_MAX_HD}"
    want = merge_geometry(launch.grid[0], a.nq, a.hd)
    if launch.grid != want.grid or launch.block != want.block:
        return f"needs grid (R, nq, 1) = {want.grid} and block {want.block}"
    return None


QSA_SPARSE_MERGE = declare(
    MODULE, MERGE,
    "ptr part_ml, ptr part_o, ptr counts, ptr out, u32 sel_cap, u32 nq, u32 hd",
    reads={"part_ml": lambda a: _parts(a, 2), "part_o": lambda a: _parts(a, a.hd), "counts": lambda a: 4 * a.grid[0]},
    writes={"out": lambda a: 2 * a.grid[0] * a.nq * a.hd},
    emulate=_emulate_merge, check=_check_merge)
