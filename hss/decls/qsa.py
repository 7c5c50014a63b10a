"""Declarations of the QSA indexer kernels (``ptx/qsa_indexer.cu``, docs/design.md §12.1-12.4) and their emulation
through :mod:`hss.reference.qsa` (float64, stored rounded to bf16 / f32 once).

Launch geometry (the contract each ``check`` enforces on the emulator; the kernels return untouched on a
broken contract):

* ``qsa_block_pool``: grid (n_new), block (hd), dynamic smem ``row_smem_bytes(hd)``;
* ``qsa_qprep``: grid (n_heads), block (hd), dynamic smem ``row_smem_bytes(hd)``;
* ``qsa_score``: grid ``score_grid(n_blocks, hd)``, block (``SCORE_THREADS``), dynamic smem
  ``score_smem_bytes(n_heads, hd)``;
* ``qsa_gather``: grid (n_sel), block (``GATHER_THREADS``), no shared memory.
"""
from __future__ import annotations

from types import SimpleNamespace

import ml_dtypes
import numpy as np

from hss._util import ceil_div
from hss.decls._decl import Launch, declare, f32
from hss.errors import MemoryFault
from hss.reference import qsa as ref
from hss.reference.numerics import to_bf16, to_f32

BF16 = ml_dtypes.bfloat16
MODULE = "qsa_indexer"
SCORE_THREADS = 256      # QSA_SCORE_THREADS in the .cu
SCORE_STEPS = 4          # QSA_SCORE_STEPS in the .cu: tile steps per warp
GATHER_THREADS = 256


def row_smem_bytes(hd: int) -> int:
    """Dynamic shared memory of ``qsa_block_pool`` / ``qsa_qprep``: the normed row and 32 warp sums."""
    return (hd + 32) * 4


def score_smem_bytes(n_heads: int, hd: int) -> int:
    """Dynamic shared memory of ``qsa_score``: q staged as f32 ``[n_heads, hd]``."""
    return n_heads * hd * 4


def score_blocks_per_cta(hd: int) -> int:
    """Blocks one ``qsa_score`` CTA covers when each warp takes one tile (fast path: 32*8/hd blocks per warp
    step, ``SCORE_STEPS`` steps; other hd: one block per warp)."""
    warps = SCORE_THREADS // 32
    if hd in (32, 64, 128, 256):
        return warps * (256 // hd) * SCORE_STEPS
    return warps


def score_grid(n_blocks: int, hd: int) -> int:
    """grid.x for ``qsa_score`` over ``n_blocks`` (>= 1 even for zero blocks; the kernel is grid-stride)."""
    per = score_blocks_per_cta(hd)
    return max(1, ceil_div(n_blocks, per))


def _bf16(view: np.ndarray, *shape: int) -> np.ndarray:
    return view.view(BF16).reshape(shape)


def _row_contract(a: SimpleNamespace, launch: Launch, rows: str) -> str | None:
    hd, rot = a.hd, a.rot
    if hd <= 0 or hd % 32 or hd > 1024:
        return f"hd ({hd}) must be a positive multiple of 32, at most 1024"
    if rot > hd or rot % 2:
        return f"rot ({rot}) must be even and <= hd ({hd})"
    if launch.block != (hd, 1, 1):
        return f"block must be (hd, 1, 1) = ({hd}, 1, 1)"
    if launch.grid[1:] != (1, 1):
        return f"grid must be ({rows}, 1, 1)"
    if launch.shared < row_smem_bytes(hd):
        return f"needs {row_smem_bytes(hd)} bytes of dynamic shared memory ((hd + 32) * 4)"
    return None


# -- qsa_block_pool ---------------------------------------------------------------------------------
def _emulate_pool(a: SimpleNamespace, launch: Launch) -> None:
    n_new, hd = launch.grid[0], a.hd
    raw = a.raw_keys.view(BF16).reshape(-1, hd)
    out = ref.block_pool(raw, a.k_norm_w.view(BF16), a.first_block, n_new, a.ratio, a.rot, a.theta, a.eps)
    a.block_keys.view(BF16).reshape(-1, hd)[a.first_block:a.first_block + n_new] = to_bf16(out)


def _check_pool(a: SimpleNamespace, launch: Launch) -> str | None:
    if a.ratio <= 0:
        return "ratio must be >= 1"
    return _row_contract(a, launch, "n_new")


QSA_BLOCK_POOL = declare(
    MODULE, "qsa_block_pool",
    "ptr raw_keys, ptr k_norm_w, ptr block_keys, u32 first_block, u32 ratio, u32 hd, u32 rot, f32 theta, f32 eps",
    reads={"raw_keys": lambda a: 2 * (a.first_block + a.grid[0]) * a.ratio * a.hd,
           "k_norm_w": lambda a: 2 * a.hd},
    writes={"block_keys": lambda a: 2 * (a.first_block + a.grid[0]) * a.hd},
    emulate=_emulate_pool, check=_check_pool)


# -- qsa_qprep --------------------------------------------------------------------------------------
def _emulate_qprep(a: SimpleNamespace, launch: Launch) -> None:
    n_heads, hd = launch.grid[0], a.hd
    out = ref.qprep(_bf16(a.q_in, n_heads, hd), a.q_norm_w.view(BF16), a.pos, a.rot, a.theta, a.eps)
    f32(a.q_out)[:] = to_f32(out).ravel()


QSA_QPREP = declare(
    MODULE, "qsa_qprep",
    "ptr q_in, ptr q_norm_w, ptr q_out, u32 hd, u32 rot, u32 pos, f32 theta, f32 eps",
    reads={"q_in": lambda a: 2 * a.grid[0] * a.hd, "q_norm_w": lambda a: 2 * a.hd},
    writes={"q_out": lambda a: 4 * a.grid[0] * a.hd},
    emulate=_emulate_qprep, check=lambda a, launch: _row_contract(a, launch, "n_heads"))


# -- qsa_score --------------------------------------------------------------------------------------
def _emulate_score(a: SimpleNamespace, launch: Launch) -> None:
    if a.n_blocks == 0:
        return
    q = f32(a.q).reshape(a.n_heads, a.hd)
    f32(a.scores)[:] = to_f32(ref.score(q, _bf16(a.block_keys, a.n_blocks, a.hd)))


def _check_score(a: SimpleNamespace, launch: Launch) -> str | None:
    if a.hd <= 0 or a.n_heads <= 0:
        return "hd and n_heads must be >= 1"
    bx = launch.block[0]
    if bx % 32 or bx > SCORE_THREADS or launch.block[1:] != (1, 1) or launch.grid[1:] != (1, 1):
        return f"needs block (32 * W <= {SCORE_THREADS}, 1, 1) and grid (G, 1, 1)"
    if launch.shared < score_smem_bytes(a.n_heads, a.hd):
        return f"needs {score_smem_bytes(a.n_heads, a.hd)} bytes of dynamic shared memory (n_heads * hd * 4)"
    return None


QSA_SCORE = declare(
    MODULE, "qsa_score",
    "ptr q, ptr block_keys, ptr scores, u32 n_blocks, u32 n_heads, u32 hd",
    reads={"q": lambda a: 4 * a.n_heads * a.hd if a.n_blocks else 0,
           "block_keys": lambda a: 2 * a.n_blocks * a.hd},
    writes={"scores": lambda a: 4 * a.n_blocks},
    emulate=_emulate_score, check=_check_score)


# -- qsa_gather -------------------------------------------------------------------------------------
def _whole(view: np.ndarray, item: int) -> np.ndarray:
    """The bytes of ``view`` (to its allocation's end) cut to whole items of ``item`` bytes."""
    return view[:view.size // item * item]


def _emulate_gather(a: SimpleNamespace, launch: Launch) -> None:
    n_sel, bs, row = launch.grid[0], a.block_size, a.nkv * a.hd
    sel = a.sel.view(np.int32).astype(np.int64)
    table = _whole(a.block_table, 4).view(np.int32)
    k_out, v_out = _bf16(a.k_out, n_sel, row), _bf16(a.v_out, n_sel, row)
    k_src, v_src = _whole(a.k_cache, 2).view(BF16), _whole(a.v_cache, 2).view(BF16)
    p = sel[:n_sel]
    ok = p >= 0   # like the kernel: a negative token or page id leaves its row unwritten
    if (p[ok] // bs >= table.size).any():
        raise MemoryFault("qsa_gather: a token's block_table entry lies past the table's allocation")
    page = np.full(n_sel, -1, dtype=np.int64)
    page[ok] = table[p[ok] // bs]
    ok &= page >= 0
    start = (page * bs + p % bs) * row
    if (start[ok] + row > min(k_src.size, v_src.size)).any():
        raise MemoryFault("qsa_gather: a token's row lies past the end of the K/V cache allocation")
    idx = start[ok][:, None] + np.arange(row)
    k_out[ok] = k_src[idx]
    v_out[ok] = v_src[idx]


def _check_gather(a: SimpleNamespace, launch: Launch) -> str | None:
    if a.block_size <= 0:
        return "block_size must be >= 1"
    if launch.block[1:] != (1, 1) or launch.grid[1:] != (1, 1):
        return "needs block (B, 1, 1) and grid (n_sel, 1, 1)"
    return None


QSA_GATHER = declare(
    MODULE, "qsa_gather",
    "ptr k_cache, ptr v_cache, ptr block_table, ptr sel, ptr k_out, ptr v_out, u32 block_size, u32 nkv, u32 hd",
    reads={"k_cache": lambda a: None, "v_cache": lambda a: None, "block_table": lambda a: None,
           "sel": lambda a: 4 * a.grid[0]},
    writes={"k_out": lambda a: 2 * a.grid[0] * a.nkv * a.hd, "v_out": lambda a: 2 * a.grid[0] * a.nkv * a.hd},
    emulate=_emulate_gather, check=_check_gather)
