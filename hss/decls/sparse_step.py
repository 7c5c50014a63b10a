"""Declarations of ``ptx/sparse_step.cu`` (the device sparse swap step, docs/design.md §17.8: selection, residency,
reads), their launch geometry, and their emulation through :mod:`hss.reference.sparse_step`.

Every count (rows, pages, misses) is read from device memory when the kernel runs, so grids are sized for the worst
case and the emulation reads the same counts; the state arrays are declared to their allocation's end and indexed
by the row.
"""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from hss._util import ceil_div
from hss.decls._decl import Launch, declare
from hss.decls.gather import CHUNK, THREADS, VECTOR
from hss.decls.qsa_prefill import Geometry
from hss.errors import MemoryFault
from hss.reference import gather as gref
from hss.reference import sparse_step as ref

__all__ = ["MODULE", "SELECT_THREADS", "SPARSE_ADVANCE", "SPARSE_COUNTS", "SPARSE_SELECT", "SPARSE_FETCH",
           "select_shared_bytes", "select_geometry", "fetch_geometry", "advance_geometry", "MAX_SLOTS", "MAX_HEADS",
           "SELECT_STATIC_SHARED"]

MODULE = "sparse_step"
SELECT_THREADS = 1024      # SELECT_THREADS: sparse_select's block
ADVANCE_THREADS = 256
MAX_SLOTS = 1 << 24        # a slot index fits the 24 bits of the sort key
MAX_HEADS = 256            # SELECT_MAX_HEADS: q heads of sparse_select's folded per-head scores
SELECT_STATIC_SHARED = 4 * (SELECT_THREADS // 32 + 1 + 256 + 2 + 2 * MAX_HEADS)   # its static shared memory


def select_shared_bytes(stride: int, slots: int, sel_cap: int) -> int:
    """sparse_select's dynamic shared memory: keys u32 [stride] (padded to even), the slots' order u64 [pow2 >=
    slots], misses i32 [sel_cap], chosen u8 [stride], in_s u8 [slots]."""
    cap = 1 << max(slots - 1, 0).bit_length()
    return 4 * ((stride + 1) & ~1) + 8 * cap + 4 * sel_cap + stride + slots


def select_geometry(rows: int, stride: int, slots: int, sel_cap: int) -> Geometry:
    return Geometry((rows, 1, 1), (SELECT_THREADS, 1, 1), select_shared_bytes(stride, slots, sel_cap))


def fetch_geometry(rows: int, sel_cap: int, page_vecs: int) -> Geometry:
    return Geometry((sel_cap, ceil_div(page_vecs, CHUNK), rows), (THREADS, 1, 1), 0)


def advance_geometry(rows: int) -> Geometry:
    return Geometry((ceil_div(rows, ADVANCE_THREADS), 1, 1), (ADVANCE_THREADS, 1, 1), 0)


def _i32(view: np.ndarray, count: int | None = None) -> np.ndarray:
    v = view[:(len(view) // 4) * 4].view(np.int32)
    return v if count is None else v[:count]


def _real_rows(a: SimpleNamespace, R: int) -> int:
    return max(0, min(int(_i32(a.rows, 1)[0]), R))


def _emulate_advance(a: SimpleNamespace, launch: Launch) -> None:
    n = _real_rows(a, a.R)
    _i32(a.step, a.R)[:n] += 1


SPARSE_ADVANCE = declare(
    MODULE, "sparse_advance", "ptr step, ptr rows, i32 R",
    reads={"step": lambda a: 4 * max(a.R, 0), "rows": lambda a: 4}, writes={"step": lambda a: 4 * max(a.R, 0)},
    emulate=_emulate_advance)


def _emulate_counts(a: SimpleNamespace, launch: Launch) -> None:
    n = _real_rows(a, a.R)
    v = _i32(a.visible, a.R)[:n].astype(np.int64)
    full = np.where(v >= 1, (v - 1) // max(a.block_size, 1), 0)
    _i32(a.page_counts, a.R)[:n] = full
    _i32(a.tail_counts, a.R)[:n] = np.where(v >= 1, v - full * a.block_size, 0)


def _check_counts(a: SimpleNamespace, launch: Launch) -> str | None:
    return None if a.block_size >= 1 else f"block_size ({a.block_size}) must be >= 1"


SPARSE_COUNTS = declare(
    MODULE, "sparse_counts", "ptr visible, ptr rows, i32 R, i32 block_size, ptr page_counts, ptr tail_counts",
    reads={"visible": lambda a: 4 * max(a.R, 0), "rows": lambda a: 4},
    writes={"page_counts": lambda a: 4 * max(a.R, 0), "tail_counts": lambda a: 4 * max(a.R, 0)},
    emulate=_emulate_counts, check=_check_counts)


def _emulate_select(a: SimpleNamespace, launch: Launch) -> None:
    R, stride, slots, cap = launch.grid[0], a.stride, a.slots, a.sel_cap
    n_rows = _real_rows(a, R)
    counts = _i32(a.counts, R)
    attend_counts, fetch_counts = _i32(a.attend_counts, R), _i32(a.fetch_counts, R)
    scores = a.scores[:4 * R * stride].view(np.float32).reshape(R, stride)
    table = _i32(a.table, R * stride).reshape(R, stride)
    page_slot = _i32(a.page_slot, R * stride).reshape(R, stride)
    slot_page = _i32(a.slot_page, R * slots).reshape(R, slots)
    slot_stamp = _i32(a.slot_stamp, R * slots).reshape(R, slots)
    step = _i32(a.step, R)
    attend = _i32(a.attend, R * cap).reshape(R, cap)
    fetch = _i32(a.fetch, R * cap * 2).reshape(R, cap, 2)
    stats = a.stats[:16 * R].view(np.int64).reshape(R, 2)
    attend_counts[n_rows:] = 0
    fetch_counts[n_rows:] = 0
    heads = min(max(a.num_heads, 0), MAX_HEADS)
    if heads:
        head_scores = a.head_scores[:4 * R * stride * heads].view(np.float32).reshape(R, stride, heads)
    for s in range(n_rows):
        n = min(max(int(counts[s]), 0), stride)
        if heads and n > a.budget + a.keep_first + a.keep_recent:   # the folded per-head scores (docs/design.md §17.5)
            scores[s, :n] = ref.head_scores(head_scores[s, :n], table[s, :n], a.max_blocks, a.exp2_scale)
        chosen = ref.select(scores[s, :n], n, a.budget, a.keep_first, a.keep_recent)
        if np.any(page_slot[s, :n][chosen] >= slots):
            raise MemoryFault(f"sparse_select: row {s}'s page_slot names a slot past slots ({slots}): corrupt state")
        slots_of, misses, into = ref.residency_step(chosen, page_slot[s], slot_page[s], slot_stamp[s], int(step[s]))
        base = a.slot_base + s * slots
        k, m = slots_of.size, misses.size
        attend[s, :k] = base + slots_of
        ids = table[s, misses].astype(np.int64)
        fetch[s, :m, 0] = np.where((ids >= 0) & (ids < a.max_blocks), a.src_base + ids, -1)
        fetch[s, :m, 1] = base + into
        attend_counts[s], fetch_counts[s] = k, m
        stats[s] += (k - m, m)


def _check_select(a: SimpleNamespace, launch: Launch) -> str | None:
    if launch.block != (SELECT_THREADS, 1, 1) or launch.grid[1:] != (1, 1):
        return f"needs block ({SELECT_THREADS}, 1, 1) and grid (R, 1, 1)"
    if not 0 < a.sel_cap <= a.slots < MAX_SLOTS or a.stride < 1:
        return f"needs 0 < sel_cap ({a.sel_cap}) <= slots ({a.slots}) < 2^24 and stride >= 1"
    if a.sel_cap != a.budget + a.keep_first + a.keep_recent:
        return "sel_cap must be budget + keep_first + keep_recent"
    if not 0 <= a.num_heads <= MAX_HEADS:
        return f"num_heads ({a.num_heads}) must be 0..{MAX_HEADS}"
    if launch.shared < select_shared_bytes(a.stride, a.slots, a.sel_cap):
        return f"needs {select_shared_bytes(a.stride, a.slots, a.sel_cap)} bytes of dynamic shared memory"
    return None


_ROW_STATE = lambda a: None   # noqa: E731  (indexed by the row: to the allocation's end)

SPARSE_SELECT = declare(
    MODULE, "sparse_select",
    "ptr scores, ptr counts, ptr table, ptr rows, ptr page_slot, ptr slot_page, ptr slot_stamp, ptr step, "
    "ptr attend, ptr attend_counts, ptr fetch, ptr fetch_counts, ptr stats, i32 stride, i32 slots, i32 sel_cap, "
    "i32 budget, i32 keep_first, i32 keep_recent, i64 slot_base, i64 src_base, ptr head_scores, i32 num_heads, "
    "i32 max_blocks, f32 exp2_scale",
    reads={n: _ROW_STATE for n in ("scores", "counts", "table", "page_slot", "slot_page", "slot_stamp", "step",
                                   "stats")} | {"rows": lambda a: 4,
                                                "head_scores": lambda a: None if a.num_heads > 0 else 0},
    writes={n: _ROW_STATE for n in ("page_slot", "slot_page", "slot_stamp", "attend", "attend_counts", "fetch",
                                    "fetch_counts", "stats", "scores")},
    emulate=_emulate_select, check=_check_select)


def _emulate_fetch(a: SimpleNamespace, launch: Launch) -> None:
    R = launch.grid[2]
    n_rows = _real_rows(a, R)
    counts = _i32(a.fetch_counts, R)
    fetch = _i32(a.fetch, R * a.sel_cap * 2).reshape(R, a.sel_cap, 2).astype(np.int64)
    page = VECTOR * a.page_vecs
    pairs = np.concatenate([fetch[s, :max(0, min(int(counts[s]), a.sel_cap))] for s in range(n_rows)] or
                           [np.zeros((0, 2), np.int64)])
    ok = (pairs[:, 0] >= 0) & (pairs[:, 0] < a.src_pages) & (pairs[:, 1] >= 0) & (pairs[:, 1] < a.dst_pages)
    pairs = pairs[ok]
    if not pairs.size:
        return
    try:
        rows = gref.gather_pages(a.src, pairs[:, 0], page)
    except IndexError as exc:
        raise MemoryFault(f"sparse_fetch parameter src (its address to its allocation's end): {exc}") from None
    try:
        gref.scatter_pages(a.dst, pairs[:, 1], rows)
    except IndexError as exc:
        raise MemoryFault(f"sparse_fetch parameter dst (its address to its allocation's end): {exc}") from None
    except ValueError as exc:
        raise MemoryFault(f"sparse_fetch parameter dst: {exc} (a race on a GPU)") from None


def _check_fetch(a: SimpleNamespace, launch: Launch) -> str | None:
    if a.page_vecs < 1 or a.dst % VECTOR or a.src % VECTOR:
        return "page_vecs must be >= 1, dst and src 16-byte aligned"
    want = fetch_geometry(launch.grid[2], a.sel_cap, a.page_vecs)
    if (launch.grid[:2], launch.block, launch.shared) != (want.grid[:2], want.block, want.shared):
        return f"needs grid ({want.grid[0]}, {want.grid[1]}, R) and block {want.block}"
    return None


SPARSE_FETCH = declare(
    MODULE, "sparse_fetch",
    "ptr dst, ptr src, ptr fetch, ptr fetch_counts, ptr rows, i32 sel_cap, i32 page_vecs, i32 src_pages, "
    "i64 dst_pages",
    reads={"src": lambda a: None, "fetch": lambda a: None, "fetch_counts": lambda a: None, "rows": lambda a: 4},
    writes={"dst": lambda a: None},
    emulate=_emulate_fetch, check=_check_fetch)
