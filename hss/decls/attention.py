"""Declarations of ``ptx/paged_decode_attn_tiled.cu`` (split, per-unit partials and a two-level fold, one launch; an
entry point per padded head dim, and a rope entry point per padded head dim: the token-count tile with the decode
step's RoPE and KV write inside) and
``ptx/attention_finalize.cu``, their geometry, and their emulation through :mod:`hss.reference.attention`.

The pools are addressed through page ids that live in device memory, so their extents are declared "to
the end of the allocation" and the emulation bounds-checks every page it reads itself.
"""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import ml_dtypes
import numpy as np

from hss._util import ceil_div
from hss.decls._decl import KernelDecl, Launch, declare, f32
from hss.errors import MemoryFault
from hss.reference import attention as ref
from hss.reference.model import rope_kv
from hss.reference.numerics import to_bf16

STEP_THREADS = 256       # block of paged_decode_attn_tiled_* (ptx/paged_decode_attn_tiled.cu)
FINALIZE_THREADS = 128   # block of attention_finalize
MAX_HEAD_DIM = 256
STEP_ROWS = 8            # ATT_ROWS: tokens per warp step
HEAD_GROUP = 16          # ATT_HG: query heads per CTA (the mma tiles' 16 rows)
UNIT_MIN = 128           # ATT_UNIT_MIN: the smallest unit (tokens per partial state) at HDP 64 and 256
UNIT_MIN_128 = 256       # ATT_UNIT_MIN_128: the smallest unit at HDP 128
UNIT_STEP = 64           # ATT_WARPS * ATT_ROWS: units are multiples of a step for each warp
MAX_UNITS = 64           # ATT_MAX_UNITS: units of one tile at most
FOLD_GROUP = 8           # ATT_GROUP: units per first-level fold group
FOLD_DIRECT = 16384      # ATT_FOLD_DIRECT: units x query heads x HDP at most for a one-level fold
COUNTERS = 9             # ATT_COUNTERS: fold counters per (sequence, CTA row)
PADDED_HEAD_DIMS = (64, 128, 256)


def padded_head_dim(head_dim: int) -> int:
    """The kernel's row width for ``head_dim``: 64, 128 or 256."""
    return 64 if head_dim <= 64 else 128 if head_dim <= 128 else 256


def step_kernel_name(head_dim: int) -> str:
    """The entry point for ``head_dim``: ``paged_decode_attn_tiled_<padded head dim>``."""
    return f"paged_decode_attn_tiled_{padded_head_dim(head_dim)}"


def stages(hdp: int) -> int:
    """Cfg<HDP>::STAGES: warp steps staged ahead per warp."""
    return 4 if hdp == 64 else 2


def target_ctas(hdp: int) -> int:
    """Cfg<HDP>::TARGET: the CTAs a launch aims at when it picks its unit size (one wave of 132 SMs at one CTA per
    SM for HDP 256, two otherwise)."""
    return 128 if hdp == 256 else 256


def step_shared_bytes(head_dim: int) -> int:
    """Dynamic shared memory of the step kernel (its Cfg<HDP>::BYTES): Q bf16 [16][HDP+8], per warp a ring of
    ``stages`` (K, V) bf16 [8][HDP+8] steps, the fold's (m, l) f32 [MAX_UNITS][16][2], per head f32 [16][4], the
    warps' weights f32 [8][16], a flag, the newest token's row pointers (the rope entry points)."""
    hdp = padded_head_dim(head_dim)
    rs = hdp + 8
    ring = stages(hdp) * 2 * STEP_ROWS * rs * 2
    fold = MAX_UNITS * HEAD_GROUP * 2 * 4 + HEAD_GROUP * 4 * 4 + 8 * HEAD_GROUP * 4
    return HEAD_GROUP * rs * 2 + 8 * ring + fold + 16 + 64   # + the flag, the rope entry points' RopeRow


def head_groups(gqa_ratio: int) -> int:
    """CTAs per (sequence, kv head) along grid.y: one per HEAD_GROUP query heads."""
    return ceil_div(gqa_ratio, HEAD_GROUP)


def unit_min(hdp: int) -> int:
    """Cfg<HDP>::UNIT_MIN: the smallest unit in tokens (UNIT_MIN_128 at HDP 128, else UNIT_MIN)."""
    return UNIT_MIN_128 if hdp == 128 else UNIT_MIN


def unit_tokens(n: int, ctas: int, hdp: int) -> int:
    """Tokens per unit for a tile of ``n`` >= 1 tokens in a launch of ``ctas`` = num_seqs * grid.y CTAs per unit
    index (the kernel's unit_tokens): ``want`` = min(MAX_UNITS, ceil(target / ctas)) units, the unit
    ceil(n / want) rounded up to a multiple of UNIT_STEP, at least :func:`unit_min`."""
    want = min(MAX_UNITS, max(1, ceil_div(target_ctas(hdp), max(ctas, 1))))
    need = ceil_div(n, want)
    u = ceil_div(need, UNIT_STEP) * UNIT_STEP
    return max(u, unit_min(hdp))


def step_grid_z(max_units_: int, ctas_yx: int, hdp: int) -> int:
    """grid.z of the step kernel: as many CTAs per (sequence, CTA row) as a tile of the launch can have units
    (``want`` of :func:`unit_tokens`, at most ``max_units_``); any value in 1..max_units gives the same bits."""
    want = min(MAX_UNITS, max(1, ceil_div(target_ctas(hdp), max(ctas_yx, 1))))
    return max(1, min(max_units_, want))


def max_units(tile_capacity: int, block_size: int, hdp: int) -> int:
    """Partial states per (sequence, query head) a tile can need at padded head dim ``hdp``: min(MAX_UNITS,
    ceil(tile_capacity*block_size / unit_min(hdp))), at least 1."""
    return max(1, min(MAX_UNITS, ceil_div(tile_capacity * block_size, unit_min(hdp))))


def counters(num_seqs: int, num_kv_heads: int, gqa_ratio: int) -> int:
    """Fold counters (u32) of a launch: COUNTERS per (sequence, kv head, group of 16 query heads)."""
    return num_seqs * num_kv_heads * head_groups(gqa_ratio) * COUNTERS


def _bf16(view: np.ndarray) -> np.ndarray:
    return view[: view.size // 2 * 2].view(ml_dtypes.bfloat16)


def _rows(a: SimpleNamespace) -> int:
    return a.grid[0] * max(a.num_q_heads, 0)


def _check_step(a: SimpleNamespace, launch: Launch, hdp: int) -> str | None:
    if not 0 < a.head_dim <= MAX_HEAD_DIM:
        return f"head_dim {a.head_dim} is outside 1..{MAX_HEAD_DIM}"
    if padded_head_dim(a.head_dim) != hdp:
        return f"head_dim {a.head_dim} needs {step_kernel_name(a.head_dim)}, not the HDP {hdp} entry point"
    if launch.block != (STEP_THREADS, 1, 1) or launch.shared < step_shared_bytes(a.head_dim):
        return (f"needs block ({STEP_THREADS}, 1, 1) and {step_shared_bytes(a.head_dim)} bytes of dynamic shared "
                "memory")
    if a.block_size <= 0 or a.tile_capacity < 0:
        return "block_size must be > 0 and tile_capacity >= 0"
    if a.max_units != max_units(a.tile_capacity, a.block_size, hdp):
        return f"max_units must be min({MAX_UNITS}, ceil(tile_capacity*block_size/{unit_min(hdp)})) = " \
               f"{max_units(a.tile_capacity, a.block_size, hdp)}"
    if a.num_kv_heads <= 0 or a.gqa_ratio <= 0 or a.num_kv_heads * a.gqa_ratio != a.num_q_heads:
        return f"num_kv_heads ({a.num_kv_heads}) * gqa_ratio ({a.gqa_ratio}) must equal num_q_heads ({a.num_q_heads})"
    y = a.num_kv_heads * head_groups(a.gqa_ratio)
    if launch.grid[1] != y or not 1 <= launch.grid[2] <= a.max_units:
        return f"grid must be (num_seqs, num_kv_heads * ceil(gqa_ratio/16) = {y}, 1..max_units = {a.max_units})"
    return None


def _tile_tokens(blocks: np.ndarray, count: int, block_size: int, last_valid: int) -> tuple[np.ndarray, np.ndarray]:
    """(page id, slot) of every token one sequence's tile consumes, in order."""
    n = min(max(int(count), 0), blocks.size)
    if n == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    limits = np.full(n, block_size, dtype=np.int64)
    limits[-1] = min(max(int(last_valid), 0), block_size)
    pages = np.repeat(blocks[:n].astype(np.int64), limits)
    slots = np.concatenate([np.arange(t) for t in limits])
    return pages, slots


def _tile_tokens_counted(blocks: np.ndarray, count: int, block_size: int, offset: int) -> tuple[np.ndarray, np.ndarray]:
    """(page id, slot) of every token of a token-mode tile: the first clamp(count - offset, 0, pages * block_size)."""
    n = min(max(int(count) - int(offset), 0), blocks.size * block_size)
    t = np.arange(n, dtype=np.int64)
    return blocks[t // block_size].astype(np.int64), t % block_size


def _pool_rows(pool: np.ndarray, pages: np.ndarray, slots: np.ndarray, a: SimpleNamespace, what: str,
               seq: int) -> np.ndarray:
    strides = (a.blk_stride, a.tok_stride, a.kvh_stride)
    try:
        return ref.gather_tokens(pool, pages, slots, strides, a.num_kv_heads, a.head_dim)
    except IndexError:
        for p, t in zip(pages.tolist(), slots.tolist()):
            try:
                ref.gather_tokens(pool, np.array([p]), np.array([t]), strides, a.num_kv_heads, a.head_dim)
            except IndexError as exc:
                raise MemoryFault(f"paged_decode_attn_tiled parameter {what}: page {p} (sequence {seq}, slot {t}) "
                                  f"is outside the pool allocation: {exc}") from None
        raise


def _emulate_step(a: SimpleNamespace, launch: Launch) -> None:
    ns, nq, hd = launch.grid[0], a.num_q_heads, a.head_dim
    _step_seqs(a, launch, _bf16(a.q)[: ns * nq * hd].reshape(ns, nq, hd), range(ns), a.fresh)


def _emulate_rope_step(a: SimpleNamespace, launch: Launch) -> None:
    """The rope entry points: per sequence with tokens, the newest one's position (the offset + its count - 1); a
    sequence whose position has no table row is left as it is (nothing written); the others get q and the newest
    k rotated (bf16, as model_rope_kv rounds them), that token's K/V rows written into the pools, then the
    token-count tile."""
    ns, nq, nkv, hd = launch.grid[0], a.num_q_heads, a.num_kv_heads, a.head_dim
    width, half = (nq + 2 * nkv) * hd, hd // 2
    qkv = _bf16(a.q)[: ns * width].reshape(ns, width)
    blocks = a.tile_blocks.view(np.int32).reshape(ns, a.tile_capacity)
    counts = a.tile_block_counts.view(np.int32)
    q = np.zeros((ns, nq, hd), ml_dtypes.bfloat16)
    kpool, vpool = _bf16(a.k_pool), _bf16(a.v_pool)
    live = []
    for s in range(ns):
        pages, slots = _tile_tokens_counted(blocks[s], counts[s], a.block_size, a.last_block_valid_slots)
        if pages.size:
            pos = a.last_block_valid_slots + pages.size - 1
            if not 0 <= pos < a.max_pos:
                continue
            cos = f32(a.cos_t)[pos * half:(pos + 1) * half][None]
            sin = f32(a.sin_t)[pos * half:(pos + 1) * half][None]
            rq, rk, rv = rope_kv(qkv[s:s + 1], cos, sin, 0, nq, nkv, hd)
            q[s] = to_bf16(rq[0])
            at = (int(pages[-1]) * a.blk_stride + int(slots[-1]) * a.tok_stride
                  + np.arange(nkv)[:, None] * a.kvh_stride + np.arange(hd)[None, :])
            if at.min() < 0 or at.max() >= kpool.size or at.max() >= vpool.size:
                raise MemoryFault(f"paged_decode_attn_rope parameter k_pool / v_pool: the newest token's page "
                                  f"{int(pages[-1])} (sequence {s}, slot {int(slots[-1])}) is outside the pool")
            kpool[at] = to_bf16(rk[0])
            vpool[at] = to_bf16(rv[0])
        live.append(s)
    _step_seqs(a, launch, q, live, a.fresh | 2)


def _step_seqs(a: SimpleNamespace, launch: Launch, q: np.ndarray, seqs: Any, fresh: int) -> None:
    """The step over the sequences ``seqs`` of the launch (queries ``q [num_seqs, num_q_heads, head_dim]``)."""
    ns, nq, hd, mu = launch.grid[0], a.num_q_heads, a.head_dim, a.max_units
    kpool, vpool = _bf16(a.k_pool), _bf16(a.v_pool)
    blocks = a.tile_blocks.view(np.int32).reshape(ns, a.tile_capacity)
    counts = a.tile_block_counts.view(np.int32)
    hdp = padded_head_dim(hd)
    part_ml = f32(a.part_ml).reshape(ns, nq, mu, 2)
    part_o = f32(a.part_o).reshape(ns, nq, mu, hdp)
    m = f32(a.m).reshape(ns, nq)
    l = f32(a.l).reshape(ns, nq)
    o = f32(a.o).reshape(ns, nq, hd)
    for s in seqs:
        if fresh & 1:   # the state begin_step asked for, not what the buffers hold
            m[s], l[s], o[s] = -np.inf, 0.0, 0.0
        if fresh & 2:   # token mode: the device counts tokens, last_block_valid_slots is their offset
            pages, slots = _tile_tokens_counted(blocks[s], counts[s], a.block_size, a.last_block_valid_slots)
        else:
            pages, slots = _tile_tokens(blocks[s], counts[s], a.block_size, a.last_block_valid_slots)
        if pages.size:
            k = _pool_rows(kpool, pages, slots, a, "k_pool", s)
            v = _pool_rows(vpool, pages, slots, a, "v_pool", s)
            unit = unit_tokens(pages.size, launch.grid[0] * launch.grid[1], hdp)
            pm, pl, po = ref.chunk_partials(q[s], k, v, unit)
            c = pm.shape[0]
            part_ml[s, :, :c, 0], part_ml[s, :, :c, 1] = pm.T, pl.T
            part_o[s, :, :c, :hd] = po.transpose(1, 0, 2)
            part_o[s, :, :c, hd:] = 0.0
            m[s], l[s], o[s] = ref.merge_partials(m[s], l[s], o[s], pm, pl, po)
    if a.out is not None:
        out = _bf16(a.out)[: ns * nq * hd].reshape(ns, nq, hd)
        for s in seqs:
            out[s] = ref.finalize(l[s], o[s]).astype(np.float32).astype(ml_dtypes.bfloat16)


def _check_finalize(a: SimpleNamespace, launch: Launch) -> str | None:
    if launch.block != (FINALIZE_THREADS, 1, 1) or launch.shared != 0:
        return f"needs block ({FINALIZE_THREADS}, 1, 1) and no dynamic shared memory"
    if launch.grid[1:] != (a.num_q_heads, 1):
        return f"grid must be (num_seqs, num_q_heads = {a.num_q_heads}, 1)"
    return None


def _emulate_finalize(a: SimpleNamespace, launch: Launch) -> None:
    rows, hd = _rows(a), a.head_dim
    out = ref.finalize(f32(a.l)[:rows], f32(a.o)[: rows * hd].reshape(rows, hd))
    _bf16(a.out)[: rows * hd] = out.astype(np.float32).astype(ml_dtypes.bfloat16).reshape(-1)


def _parts(a: SimpleNamespace, per: int) -> int:
    return 4 * _rows(a) * max(a.max_units, 0) * per


def _state(a: SimpleNamespace) -> int:
    return 4 * _rows(a) * max(a.head_dim, 0)


def _counts(a: SimpleNamespace) -> int:
    return 4 * counters(a.grid[0], max(a.num_kv_heads, 0), max(a.gqa_ratio, 1))


_STEP_PARAMS = ("ptr q, ptr k_pool, ptr v_pool, ptr tile_blocks, ptr tile_block_counts, ptr part_ml, ptr part_o, "
                "ptr m, ptr l, ptr o, ptr out, ptr merge_count, i32 num_q_heads, i32 num_kv_heads, i32 head_dim, "
                "i32 block_size, i32 tile_capacity, i32 gqa_ratio, i32 max_units, i64 blk_stride, i64 tok_stride, "
                "i64 kvh_stride, i32 last_block_valid_slots, i32 fresh")


def _check_rope(a: SimpleNamespace, launch: Launch, hdp: int) -> str | None:
    if a.head_dim % 2:
        return f"head_dim {a.head_dim} is odd: rotate-half RoPE pairs element j with j + head_dim / 2"
    return _check_step(a, launch, hdp)


def _declare_rope(hdp: int) -> KernelDecl:
    """The rope entry point: q is qkv [num_seqs, num_q_heads + 2 num_kv_heads, head_dim]; cos_t / sin_t f32
    [max_pos, head_dim / 2]; the newest token's K/V rows are written into the pools (page ids decide)."""
    def table(a: SimpleNamespace) -> int:
        return 4 * max(a.max_pos, 0) * max(a.head_dim // 2, 0)
    return declare(
        "paged_decode_attn_tiled", f"paged_decode_attn_rope_{hdp}",
        _STEP_PARAMS + ", ptr cos_t, ptr sin_t, i32 max_pos",
        reads={"q": lambda a: 2 * a.grid[0] * (a.num_q_heads + 2 * a.num_kv_heads) * a.head_dim,
               "k_pool": lambda a: None, "v_pool": lambda a: None,
               "tile_blocks": lambda a: 4 * a.grid[0] * max(a.tile_capacity, 0),
               "tile_block_counts": lambda a: 4 * a.grid[0],
               "m": lambda a: 4 * _rows(a), "l": lambda a: 4 * _rows(a), "o": _state, "merge_count": _counts,
               "cos_t": table, "sin_t": table},
        writes={"k_pool": lambda a: None, "v_pool": lambda a: None,
                "part_ml": lambda a: _parts(a, 2), "part_o": lambda a: _parts(a, padded_head_dim(max(a.head_dim, 1))),
                "m": lambda a: 4 * _rows(a), "l": lambda a: 4 * _rows(a), "o": _state,
                "out": lambda a: _state(a) // 2 if a.out else 0, "merge_count": _counts},
        emulate=_emulate_rope_step, check=lambda a, launch: _check_rope(a, launch, hdp))


def _declare_step(hdp: int) -> KernelDecl:
    name = f"paged_decode_attn_tiled_{hdp}"
    return declare(
        "paged_decode_attn_tiled", name, _STEP_PARAMS,
        reads={"q": lambda a: 2 * _rows(a) * a.head_dim,
               "k_pool": lambda a: None, "v_pool": lambda a: None,           # page ids decide: checked per page
               "tile_blocks": lambda a: 4 * a.grid[0] * max(a.tile_capacity, 0),
               "tile_block_counts": lambda a: 4 * a.grid[0],
               "m": lambda a: 4 * _rows(a), "l": lambda a: 4 * _rows(a), "o": _state, "merge_count": _counts},
        writes={"part_ml": lambda a: _parts(a, 2), "part_o": lambda a: _parts(a, padded_head_dim(max(a.head_dim, 1))),
                "m": lambda a: 4 * _rows(a), "l": lambda a: 4 * _rows(a), "o": _state,
                "out": lambda a: _state(a) // 2 if a.out else 0,   # optional: null = no output
                "merge_count": _counts},
        emulate=_emulate_step, check=lambda a, launch: _check_step(a, launch, hdp))


# one entry point per padded head dim, the same parameters and contract
PAGED_DECODE_ATTN_TILED = {hdp: _declare_step(hdp) for hdp in PADDED_HEAD_DIMS}


PAGED_DECODE_ATTN_ROPE = {hdp: _declare_rope(hdp) for hdp in PADDED_HEAD_DIMS}


def step_declaration(head_dim: int) -> KernelDecl:
    """The step kernel's declaration for ``head_dim``."""
    return PAGED_DECODE_ATTN_TILED[padded_head_dim(head_dim)]


def rope_declaration(head_dim: int) -> KernelDecl:
    """The rope entry point's declaration for ``head_dim`` (the step with the newest token rotated in)."""
    return PAGED_DECODE_ATTN_ROPE[padded_head_dim(head_dim)]


ATTENTION_FINALIZE = declare(
    "attention_finalize", "attention_finalize", "ptr o, ptr l, ptr out, i32 num_q_heads, i32 head_dim",
    reads={"o": lambda a: 4 * _rows(a) * max(a.head_dim, 0), "l": lambda a: 4 * _rows(a)},
    writes={"out": lambda a: 2 * _rows(a) * max(a.head_dim, 0)},
    emulate=_emulate_finalize, check=_check_finalize)
