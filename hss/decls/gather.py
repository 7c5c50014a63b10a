"""Declaration of ``ptx/page_gather.cu`` (whole pages copied from a mapped pinned host buffer into device memory, one
launch for a group of scattered pages), its launch geometry, and its emulation through :mod:`hss.reference.gather`.

The pages and slots are indices read from memory (``pairs``), so ``src`` and ``dst`` are declared "to the end of the
allocation" and the emulation bounds-checks every page it reads or writes itself (:class:`~hss.errors.MemoryFault`
naming the request). On the emulator a mapped host address is the pinned allocation's own address (unified
addressing), reachable from every device, as on a GPU.
"""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from hss._util import ceil_div
from hss.decls._decl import Launch, declare
from hss.decls.qsa_prefill import Geometry
from hss.errors import MemoryFault
from hss.reference import gather as ref

__all__ = ["MODULE", "THREADS", "UNROLL", "CHUNK", "VECTOR", "MAX_CHUNKS", "PAGE_GATHER", "gather_geometry"]

MODULE = "page_gather"
THREADS = 256             # GATHER_THREADS: block size
UNROLL = 8                # GATHER_UNROLL: 16-byte loads in flight per thread
CHUNK = THREADS * UNROLL  # GATHER_CHUNK: 16-byte vectors per CTA
VECTOR = 16               # bytes per load: pages and base addresses are multiples of it
MAX_CHUNKS = 65535        # grid.y: a page of more than MAX_CHUNKS * CHUNK vectors (2 GiB) does not launch


def gather_geometry(n_pages: int, page_vecs: int) -> Geometry:
    """grid (n_pages, ceil(page_vecs / CHUNK)), block (THREADS): a CTA per 32 KiB of each page."""
    return Geometry((n_pages, ceil_div(page_vecs, CHUNK), 1), (THREADS, 1, 1), 0)


def _check(a: SimpleNamespace, launch: Launch) -> str | None:
    if a.n_pages < 1 or a.page_vecs < 1:
        return f"n_pages ({a.n_pages}) and page_vecs ({a.page_vecs}) must be >= 1"
    if a.dst % VECTOR or a.src % VECTOR or a.pairs % 8:
        return "dst and src must be 16-byte aligned, pairs 8-byte aligned"
    want = gather_geometry(a.n_pages, a.page_vecs)
    if (launch.grid, launch.block, launch.shared) != (want.grid, want.block, want.shared):
        return f"needs grid {want.grid}, block {want.block} and no dynamic shared memory"
    return None


def _emulate(a: SimpleNamespace, launch: Launch) -> None:
    n, page_bytes = a.n_pages, VECTOR * a.page_vecs
    pairs = a.pairs[:8 * n].view(np.int32).reshape(n, 2).astype(np.int64)   # read when the kernel runs, as on a GPU
    try:
        rows = ref.gather_pages(a.src, pairs[:, 0], page_bytes)
    except IndexError as exc:
        raise MemoryFault(f"page_gather parameter src (read from its address to its allocation's end): {exc}") from None
    try:
        ref.scatter_pages(a.dst, pairs[:, 1], rows)
    except IndexError as exc:
        raise MemoryFault(f"page_gather parameter dst (written from its address to its allocation's end): {exc}") \
            from None
    except ValueError as exc:
        raise MemoryFault(f"page_gather parameter dst: {exc} (a race on a GPU)") from None


PAGE_GATHER = declare(
    MODULE, "page_gather", "ptr dst, ptr src, ptr pairs, i32 n_pages, i32 page_vecs",
    reads={"src": lambda a: None, "pairs": lambda a: 8 * max(a.n_pages, 0)},   # pages: checked per request
    writes={"dst": lambda a: None},
    emulate=_emulate, check=_check)
