"""Declarations of the predictor kernels (``ptx/{q,kv}_lowrank_project.cu``, ``ptx/predictor_score.cu``)
and their emulation through :mod:`hss.reference.predictor` (float64, stored rounded to bf16 / f32)."""
from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace

import ml_dtypes
import numpy as np

from hss._util import ceil_div
from hss.decls._decl import Extent, Launch, declare, f32
from hss.errors import MemoryFault
from hss.reference import predictor as ref

BF16 = ml_dtypes.bfloat16
LOWRANK_ROWS = 8        # {q,kv}_lowrank_project: input rows (block.y) per CTA at most
LOWRANK_HEAD_DIM = 256  # {q,kv}_lowrank_project: longest input row


def lowrank_rows(r: int, rows: int) -> int:
    """block.y of the projection kernels as hss launches them: rows per CTA (r * rows <= 256 threads)."""
    return max(1, min(LOWRANK_ROWS, 256 // r, rows))


def score_warps() -> int:
    """Warps (one K_lr block each) per CTA of predictor_score as hss launches it, at every block count.

    One: single-warp CTAs spread short contexts over every SM and retire independently, which measured
    fastest on an H200 at every size (Llama-like dims, 1 vs 8 warps per CTA: 128K tokens 19.1 vs 21.1 us,
    1M tokens 121.7 vs 125.0 us, 4K tokens 3.2 vs 3.3 us)."""
    return 1


def _bf16(view: np.ndarray, *shape: int) -> np.ndarray:
    return view.view(BF16).reshape(shape)


def _pos(*values: int) -> bool:
    return all(v > 0 for v in values)


# -- q_lowrank_project -------------------------------------------------------------------------
def _matrices(a: SimpleNamespace, count: int) -> np.ndarray:
    """The ``count`` [head_dim, r] matrices the kernel reads: matrix g at element g * p_stride of ``p``."""
    size = a.head_dim * a.r
    flat = a.p.view(BF16)
    return np.stack([flat[g * a.p_stride:g * a.p_stride + size] for g in range(count)]).reshape(count, a.head_dim,
                                                                                                 a.r)


def _p_reads(count: Callable[[SimpleNamespace], int]) -> Extent:
    """Bytes of ``p`` read when ``count(a)`` matrices p_stride elements apart are used."""
    def extent(a: SimpleNamespace) -> int:
        n = count(a)
        if n <= 0 or a.head_dim <= 0 or a.r <= 0 or a.p_stride < 0:
            return 0
        return 2 * ((n - 1) * a.p_stride + a.head_dim * a.r)
    return extent


def _q_groups(a: SimpleNamespace) -> int:
    """Matrices q_lowrank_project reads: ceil(num_q_heads / heads_per_p)."""
    return ceil_div(a.num_q_heads, a.heads_per_p) if a.heads_per_p > 0 and a.num_q_heads > 0 else 0


def _emulate_q(a: SimpleNamespace, launch: Launch) -> None:
    if not _pos(a.num_q_heads, a.head_dim, a.r, a.heads_per_p) or a.p_stride < 0:
        return
    out = ref.project_q(_bf16(a.q, a.num_q_heads, a.head_dim), _matrices(a, _q_groups(a)), a.heads_per_p)
    a.q_proj.view(BF16)[:] = out.astype(np.float32).astype(BF16).ravel()


def _check_rows(block: tuple[int, int, int], r: int, head_dim: int) -> str | None:
    if block[0] < r or not 1 <= block[1] <= LOWRANK_ROWS or block[2] != 1:
        return f"needs block (>= r ({r}), 1..{LOWRANK_ROWS}, 1)"
    if head_dim > LOWRANK_HEAD_DIM:
        return f"head_dim ({head_dim}) must be <= {LOWRANK_HEAD_DIM}"
    return None


def _check_q(a: SimpleNamespace, launch: Launch) -> str | None:
    per = min(a.heads_per_p, a.num_q_heads)
    if launch.grid[0] * launch.block[1] < per or launch.grid[1] < _q_groups(a):
        return (f"needs grid.x * block.y >= min(heads_per_p, num_q_heads) ({per}) and grid.y >= "
                f"ceil(num_q_heads / heads_per_p) ({_q_groups(a)})")
    return _check_rows(launch.block, a.r, a.head_dim)


def q_lowrank_geometry(r: int, num_q_heads: int, heads_per_p: int) -> tuple[tuple[int, int, int], tuple[int, int]]:
    """(block, (grid.x, grid.y)) of q_lowrank_project as hss launches it: heads_per_p q heads share a matrix."""
    rows = lowrank_rows(r, heads_per_p)
    return (r, rows, 1), (ceil_div(heads_per_p, rows), ceil_div(num_q_heads, heads_per_p))


Q_LOWRANK_PROJECT = declare(
    "q_lowrank_project", "q_lowrank_project",
    "ptr q, ptr p, ptr q_proj, i32 num_q_heads, i32 head_dim, i32 r, i32 heads_per_p, i32 p_stride",
    reads={"q": lambda a: 2 * max(a.num_q_heads, 0) * max(a.head_dim, 0), "p": _p_reads(_q_groups)},
    writes={"q_proj": lambda a: 2 * max(a.num_q_heads, 0) * max(a.r, 0)},
    emulate=_emulate_q, check=_check_q)


# -- kv_lowrank_project ------------------------------------------------------------------------
def _emulate_kv(a: SimpleNamespace, launch: Launch) -> None:
    if not _pos(a.block_size, a.num_kv_heads, a.head_dim, a.r) or a.p_stride < 0:
        return
    out = ref.project_kv_block(_bf16(a.k_block, a.block_size, a.num_kv_heads, a.head_dim),
                               _matrices(a, a.num_kv_heads))
    a.k_lr.view(BF16)[:] = out.astype(np.float32).astype(BF16).ravel()


def _check_kv(a: SimpleNamespace, launch: Launch) -> str | None:
    if launch.grid[0] < a.num_kv_heads or launch.grid[1] * launch.block[1] < a.block_size:
        return (f"needs grid.x >= num_kv_heads ({a.num_kv_heads}) and grid.y * block.y >= block_size "
                f"({a.block_size})")
    return _check_rows(launch.block, a.r, a.head_dim)


KV_LOWRANK_PROJECT = declare(
    "kv_lowrank_project", "kv_lowrank_project",
    "ptr k_block, ptr p, ptr k_lr, i32 block_size, i32 num_kv_heads, i32 head_dim, i32 r, i32 p_stride",
    reads={"k_block": lambda a: 2 * max(a.block_size, 0) * max(a.num_kv_heads, 0) * max(a.head_dim, 0),
           "p": _p_reads(lambda a: a.num_kv_heads if a.block_size > 0 else 0)},
    writes={"k_lr": lambda a: 2 * max(a.num_kv_heads, 0) * max(a.block_size, 0) * max(a.r, 0)},
    emulate=_emulate_kv, check=_check_kv)


# -- predictor_score ---------------------------------------------------------------------------
def _score_params_ok(a: SimpleNamespace) -> bool:
    return _pos(a.num_kv_heads, a.block_size, a.r, a.gqa_ratio) and a.num_q_heads == a.gqa_ratio * a.num_kv_heads


def _emulate_score(a: SimpleNamespace, launch: Launch) -> None:
    if a.num_blocks <= 0 or not _score_params_ok(a):
        return   # the kernel writes nothing for inconsistent heads
    q = _bf16(a.q_proj, a.num_q_heads, a.r)
    k = _bf16(a.k_lr, a.num_blocks, a.num_kv_heads, a.block_size, a.r)
    f32(a.scores)[:] = ref.predictor_score(q, k, a.gqa_ratio).astype(np.float32)


def _check_score(a: SimpleNamespace, launch: Launch) -> str | None:
    bx = launch.block[0]
    if bx % 32 or launch.block[1:] != (1, 1) or launch.grid[1:] != (1, 1):
        return "needs block (32 * W, 1, 1) and grid (G, 1, 1)"
    if launch.grid[0] * (bx // 32) < a.num_blocks:
        return f"grid.x * warps per CTA ({launch.grid[0]} * {bx // 32}) must cover num_blocks ({a.num_blocks})"
    return None


def _score_reads_k(a: SimpleNamespace) -> int:
    return 2 * max(a.num_blocks, 0) * max(a.num_kv_heads, 0) * max(a.block_size, 0) * max(a.r, 0)


def _score_signature(out: str) -> str:
    """The parameters predictor_score and predictor_score_heads share (``out``: their output's name)."""
    return (f"ptr q_proj, ptr k_lr, ptr {out}, i32 num_q_heads, i32 num_kv_heads, i32 block_size, i32 r, "
            "i32 gqa_ratio, i32 num_blocks")


_SCORE_READS = {"q_proj": lambda a: 2 * max(a.num_q_heads, 0) * max(a.r, 0) if a.num_blocks > 0 else 0,
                "k_lr": _score_reads_k}

PREDICTOR_SCORE = declare(
    "predictor_score", "predictor_score", _score_signature("scores"), reads=_SCORE_READS,
    writes={"scores": lambda a: 4 * max(a.num_blocks, 0)},
    emulate=_emulate_score, check=_check_score)


# -- per-head normalised scores (docs/design.md §17.5): predictor_score_heads -> _head_max -> _head_combine ---------
HEAD_THREADS = 256   # predictor_head_max / predictor_head_combine: threads per CTA (HSS_PRED_HEAD_THREADS)


def _emulate_score_heads(a: SimpleNamespace, launch: Launch) -> None:
    if a.num_blocks <= 0 or not _score_params_ok(a):
        return
    q = _bf16(a.q_proj, a.num_q_heads, a.r)
    k = _bf16(a.k_lr, a.num_blocks, a.num_kv_heads, a.block_size, a.r)
    f32(a.head_scores)[:] = ref.predictor_score_heads(q, k, a.gqa_ratio).astype(np.float32).ravel()


PREDICTOR_SCORE_HEADS = declare(
    "predictor_score", "predictor_score_heads", _score_signature("head_scores"), reads=_SCORE_READS,
    writes={"head_scores": lambda a: 4 * max(a.num_blocks, 0) * max(a.num_q_heads, 0)},
    emulate=_emulate_score_heads, check=_check_score)


def _head_scores(a: SimpleNamespace) -> np.ndarray:
    return f32(a.head_scores).reshape(a.num_blocks, a.num_q_heads)


def _emulate_head_max(a: SimpleNamespace, launch: Launch) -> None:
    if a.num_q_heads <= 0:
        return
    if a.num_blocks <= 0:
        f32(a.head_max)[:] = -np.inf
        return
    f32(a.head_max)[:] = ref.head_max(_head_scores(a)).astype(np.float32)


def _check_head_max(a: SimpleNamespace, launch: Launch) -> str | None:
    if launch.block != (HEAD_THREADS, 1, 1) or launch.grid[1:] != (1, 1) or launch.grid[0] < a.num_q_heads:
        return f"needs block ({HEAD_THREADS}, 1, 1) and grid (>= num_q_heads ({a.num_q_heads}), 1, 1)"
    return None


def _head_scores_bytes(a: SimpleNamespace) -> int:
    return 4 * max(a.num_blocks, 0) * max(a.num_q_heads, 0)


PREDICTOR_HEAD_MAX = declare(
    "predictor_score", "predictor_head_max", "ptr head_scores, ptr head_max, i32 num_q_heads, i32 num_blocks",
    reads={"head_scores": _head_scores_bytes},
    writes={"head_max": lambda a: 4 * max(a.num_q_heads, 0)},
    emulate=_emulate_head_max, check=_check_head_max)


def _emulate_head_combine(a: SimpleNamespace, launch: Launch) -> None:
    if a.num_blocks <= 0:
        return
    m = f32(a.head_max)[:a.num_q_heads] if a.num_q_heads > 0 else np.zeros(0, np.float32)
    hs = _head_scores(a) if a.num_q_heads > 0 else np.zeros((a.num_blocks, 0), np.float32)
    f32(a.scores)[:] = ref.head_combine(hs, m, a.exp2_scale).astype(np.float32)


def _check_head_combine(a: SimpleNamespace, launch: Launch) -> str | None:
    if launch.block != (HEAD_THREADS, 1, 1) or launch.grid[1:] != (1, 1) or \
            launch.grid[0] * HEAD_THREADS < a.num_blocks:
        return f"needs block ({HEAD_THREADS}, 1, 1) and grid (>= ceil(num_blocks / {HEAD_THREADS}), 1, 1)"
    return None


PREDICTOR_HEAD_COMBINE = declare(
    "predictor_score", "predictor_head_combine",
    "ptr head_scores, ptr head_max, ptr scores, i32 num_q_heads, i32 num_blocks, f32 exp2_scale",
    reads={"head_scores": _head_scores_bytes,
           "head_max": lambda a: 4 * max(a.num_q_heads, 0) if a.num_blocks > 0 else 0},
    writes={"scores": lambda a: 4 * max(a.num_blocks, 0)},
    emulate=_emulate_head_combine, check=_check_head_combine)


# -- the batched entry points of the device sparse step (docs/design.md §17.8) -----------------------------------------
def _rows(a: SimpleNamespace) -> int:
    """The real row count a batched launch reads from ``rows`` (i32 [1]) when it runs."""
    return int(a.rows[:4].view(np.int32)[0])


def _emulate_q_rows(a: SimpleNamespace, launch: Launch) -> None:
    if not _pos(a.num_q_heads, a.head_dim, a.r, a.heads_per_p) or a.p_stride < 0:
        return
    n = min(_rows(a), launch.grid[2])
    if n <= 0:
        return
    p = _matrices(a, _q_groups(a))
    R = launch.grid[2]
    q = _bf16(a.q[:2 * R * a.num_q_heads * a.head_dim], R, a.num_q_heads, a.head_dim)
    out = a.q_proj[:2 * R * a.num_q_heads * a.r].view(BF16).reshape(R, a.num_q_heads * a.r)
    for s in range(n):
        out[s] = ref.project_q(q[s], p, a.heads_per_p).astype(np.float32).astype(BF16).ravel()


def _check_q_rows(a: SimpleNamespace, launch: Launch) -> str | None:
    return _check_q(a, Launch((launch.grid[0], launch.grid[1], 1), launch.block, launch.shared))


def q_rows_geometry(r: int, num_q_heads: int, heads_per_p: int, rows: int) -> tuple[tuple[int, int, int],
                                                                                     tuple[int, int, int]]:
    """(block, grid) of q_lowrank_project_rows: q_lowrank_project's, grid.z = ``rows`` (the capacity)."""
    block, (gx, gy) = q_lowrank_geometry(r, num_q_heads, heads_per_p)
    return block, (gx, gy, rows)


Q_LOWRANK_PROJECT_ROWS = declare(
    "q_lowrank_project", "q_lowrank_project_rows",
    "ptr q, ptr p, ptr q_proj, ptr rows, i32 num_q_heads, i32 head_dim, i32 r, i32 heads_per_p, i32 p_stride",
    reads={"q": lambda a: None, "p": _p_reads(_q_groups), "rows": lambda a: 4},   # q: rows x [num_q_heads, head_dim]
    writes={"q_proj": lambda a: None},
    emulate=_emulate_q_rows, check=_check_q_rows)


def _emulate_score_table(a: SimpleNamespace, launch: Launch) -> None:
    if not _score_params_ok(a) or a.table_stride <= 0:
        return
    R = launch.grid[1]
    n_rows = min(_rows(a), R)
    if n_rows <= 0:
        return
    stride = a.table_stride
    counts = a.counts[:4 * R].view(np.int32)
    table = a.table[:4 * R * stride].view(np.int32).reshape(R, stride)
    q = _bf16(a.q_proj[:2 * R * a.num_q_heads * a.r], R, a.num_q_heads, a.r)
    slot = a.num_kv_heads * a.block_size * a.r
    k_all = a.k_lr.view(BF16)
    out = f32(a.scores[:4 * R * stride]).reshape(R, stride)
    for s in range(n_rows):
        n = min(max(int(counts[s]), 0), stride)
        ids = table[s, :n].astype(np.int64)
        ok = (ids >= 0) & (ids < a.max_blocks)
        if (ids[ok] + 1).max(initial=0) * slot > k_all.size:
            raise MemoryFault(f"predictor_score_table parameter k_lr: block {int(ids[ok].max())} runs past the "
                              "allocation's end")
        got = np.full(n, np.nan, np.float32)
        if ok.any():
            k = k_all[:(int(ids[ok].max()) + 1) * slot].reshape(-1, a.num_kv_heads, a.block_size, a.r)[ids[ok]]
            got[ok] = ref.predictor_score(q[s], k, a.gqa_ratio).astype(np.float32)
        out[s, :n] = got


def _check_score_table(a: SimpleNamespace, launch: Launch) -> str | None:
    bx = launch.block[0]
    if bx % 32 or launch.block[1:] != (1, 1) or launch.grid[2] != 1:
        return "needs block (32 * W, 1, 1) and grid (G, R, 1)"
    if launch.grid[0] * (bx // 32) < a.table_stride:
        return f"grid.x * warps per CTA must cover table_stride ({a.table_stride})"
    return None


PREDICTOR_SCORE_TABLE = declare(
    "predictor_score", "predictor_score_table",
    "ptr q_proj, ptr k_lr, ptr table, ptr counts, ptr rows, ptr scores, i32 num_q_heads, i32 num_kv_heads, "
    "i32 block_size, i32 r, i32 gqa_ratio, i32 table_stride, i32 max_blocks",
    reads={"q_proj": lambda a: None, "k_lr": lambda a: None, "table": lambda a: None, "counts": lambda a: None,
           "rows": lambda a: 4},
    writes={"scores": lambda a: None},
    emulate=_emulate_score_table, check=_check_score_table)


def _table_rows(a: SimpleNamespace, R: int) -> tuple[int, np.ndarray, np.ndarray]:
    """(real rows, counts i32 [R] clamped to 0..table_stride, table i32 [R, table_stride]) of a batched launch."""
    n_rows = min(_rows(a), R)
    counts = np.clip(a.counts[:4 * R].view(np.int32).astype(np.int64), 0, a.table_stride)
    table = a.table[:4 * R * a.table_stride].view(np.int32).reshape(R, a.table_stride) \
        if hasattr(a, "table") else np.zeros((R, 0), np.int32)
    return n_rows, counts, table


def _emulate_heads_table(a: SimpleNamespace, launch: Launch) -> None:
    if not _score_params_ok(a) or a.table_stride <= 0:
        return
    R, nq, stride = launch.grid[1], a.num_q_heads, a.table_stride
    n_rows, counts, table = _table_rows(a, R)
    q = _bf16(a.q_proj[:2 * R * nq * a.r], R, nq, a.r)
    slot = a.num_kv_heads * a.block_size * a.r
    k_all = a.k_lr.view(BF16)
    out = f32(a.head_scores[:4 * R * stride * nq]).reshape(R, stride, nq)
    for s in range(n_rows):
        ids = table[s, :counts[s]].astype(np.int64)
        ok = (ids >= 0) & (ids < a.max_blocks)
        got = np.full((ids.size, nq), np.nan, np.float32)
        if ok.any():
            top = int(ids[ok].max()) + 1
            if top * slot > k_all.size:
                raise MemoryFault(f"predictor_score_heads_table parameter k_lr: block {top - 1} runs past the "
                                  "allocation's end")
            k = k_all[:top * slot].reshape(top, a.num_kv_heads, a.block_size, a.r)[ids[ok]]
            got[ok] = ref.predictor_score_heads(q[s], k, a.gqa_ratio).astype(np.float32)
        out[s, :ids.size] = got


PREDICTOR_SCORE_HEADS_TABLE = declare(
    "predictor_score", "predictor_score_heads_table",
    "ptr q_proj, ptr k_lr, ptr table, ptr counts, ptr rows, ptr head_scores, i32 num_q_heads, i32 num_kv_heads, "
    "i32 block_size, i32 r, i32 gqa_ratio, i32 table_stride, i32 max_blocks",
    reads={"q_proj": lambda a: None, "k_lr": lambda a: None, "table": lambda a: None, "counts": lambda a: None,
           "rows": lambda a: 4},
    writes={"head_scores": lambda a: None},
    emulate=_emulate_heads_table, check=_check_score_table)


def _emulate_head_max_rows(a: SimpleNamespace, launch: Launch) -> None:
    R, nq, stride = launch.grid[1], a.num_q_heads, a.table_stride
    if nq <= 0 or stride <= 0:
        return
    n_rows, counts, _ = _table_rows(a, R)
    hs = f32(a.head_scores[:4 * R * stride * nq]).reshape(R, stride, nq)
    out = f32(a.head_max[:4 * R * nq]).reshape(R, nq)
    for s in range(n_rows):
        out[s] = ref.head_max(hs[s, :counts[s]]).astype(np.float32) if counts[s] else -np.inf


def _check_rows_launch(a: SimpleNamespace, launch: Launch) -> str | None:
    if launch.block != (HEAD_THREADS, 1, 1) or launch.grid[2] != 1:
        return f"needs block ({HEAD_THREADS}, 1, 1) and grid (G, R, 1)"
    return None


PREDICTOR_HEAD_MAX_ROWS = declare(
    "predictor_score", "predictor_head_max_rows",
    "ptr head_scores, ptr counts, ptr rows, ptr head_max, i32 num_q_heads, i32 table_stride",
    reads={"head_scores": lambda a: None, "counts": lambda a: None, "rows": lambda a: 4},
    writes={"head_max": lambda a: None},
    emulate=_emulate_head_max_rows, check=_check_rows_launch)


def _emulate_head_combine_rows(a: SimpleNamespace, launch: Launch) -> None:
    R, nq, stride = launch.grid[1], a.num_q_heads, a.table_stride
    if stride <= 0:
        return
    n_rows, counts, table = _table_rows(a, R)
    hs = f32(a.head_scores[:4 * R * stride * max(nq, 0)]).reshape(R, stride, max(nq, 0))
    hm = f32(a.head_max[:4 * R * max(nq, 0)]).reshape(R, max(nq, 0))
    out = f32(a.scores[:4 * R * stride]).reshape(R, stride)
    for s in range(n_rows):
        n = int(counts[s])
        if not n:
            continue
        got = ref.head_combine(hs[s, :n], hm[s], a.exp2_scale).astype(np.float32)
        ids = table[s, :n]
        got[(ids < 0) | (ids >= a.max_blocks)] = np.nan
        out[s, :n] = got


PREDICTOR_HEAD_COMBINE_ROWS = declare(
    "predictor_score", "predictor_head_combine_rows",
    "ptr head_scores, ptr head_max, ptr table, ptr counts, ptr rows, ptr scores, i32 num_q_heads, i32 table_stride, "
    "i32 max_blocks, f32 exp2_scale",
    reads={"head_scores": lambda a: None, "head_max": lambda a: None, "table": lambda a: None,
           "counts": lambda a: None, "rows": lambda a: 4},
    writes={"scores": lambda a: None},
    emulate=_emulate_head_combine_rows, check=_check_rows_launch)
