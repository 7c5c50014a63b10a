"""The backing stores for KV pages (docs/design.md §7.1-7.3): :class:`HostStore` (pinned host memory, here) and
:class:`~hss.swap.file_store.FileStore` (one preallocated file per layer), behind one small interface,
:class:`~hss.swap.backing.BackingStore` (validity, all-or-nothing writes, prepared reads: see
:mod:`hss.swap.backing`). This module is also where the store names are imported from: it re-exports
``BackingStore``, ``PreparedReads``, ``FileStore``, ``layer_path`` and the store errors.
"""
from __future__ import annotations

import contextlib
from typing import Any, NamedTuple

import numpy as np

from hss import cuda_min as cm
from hss.errors import StoreError, StoreIOError
from hss.swap.backing import BackingStore, PreparedReads
from hss.swap.file_store import FileStore, layer_path
from hss.swap.gather import FENCES, GATHER_MIN_RUNS, PageGather, ReadFences, gather_fits
from hss.swap.layout import GroupLayout

__all__ = ["BackingStore", "HostStore", "FileStore", "PreparedReads", "StoreError", "StoreIOError", "layer_path"]


class _Gathered(NamedTuple):
    """A HostStore's groups of reads into pool slots that ``page_gather`` copies (``via``): ``kernel[i]`` whether
    group i goes through the kernel, each request's page in the layer and pool slot (``pages``, ``slots``: int64, the
    index pairs a launch writes), the pool's and the layer's device addresses, the 16-byte vectors of a page."""
    via: PageGather
    kernel: list
    pages: np.ndarray
    slots: np.ndarray
    dst: int
    src: int
    page_vecs: int


class HostStore(BackingStore):
    """Every layer in ONE pinned host buffer (layer-major, each layer laid out like its file).

    Reads go straight from the buffer, a group (``prepare_reads``) at a time: as H2D copies, consecutive pages in one
    copy, the group's copies in one batched driver call (its copy list built once by ``prepare_reads``); or, for a
    group into the swap's pool slots of more than :attr:`gather_min_runs` runs (or of more than the planning call's
    ``gather_min_runs``: a sparse step's scattered misses, see :data:`~hss.swap.gather.SPARSE_GATHER_MIN_RUNS`), as
    ONE ``page_gather`` launch that reads the pages through the buffer's device mapping (cuMemHostGetDevicePointer),
    its (page, slot) pairs written into a small mapped ring (:mod:`hss.swap.gather`). Either way the group then
    records a fence event (its :attr:`PreparedReads.fence`). A write first waits (on the host) for the reads already
    queued from the buffer, so it never changes bytes a queued read has yet to read.
    """

    kind = "host"
    gather_min_runs = GATHER_MIN_RUNS   # per instance too: 0 sends every group into pool slots through the kernel
    #                                     (a planning call's own, smaller gather_min_runs still applies to its groups)

    def __init__(self, layout: GroupLayout, num_layers: int, *, ctx: cm.CudaCtx | None = None,
                 run_cap_bytes: int = 1 << 30) -> None:
        super().__init__(layout, num_layers, run_cap_bytes, ctx=ctx)
        self._parts = contextlib.ExitStack()
        own = self._parts.enter_context
        try:
            self.buffer = own(cm.PinnedBuffer(self.num_layers * layout.bytes_per_layer, ctx))
            self._own_memory(self.buffer.ptr, self.buffer.bytes, "the HostStore's pages")
            # page (layer, p) is entry layer * num_blocks + p (each layer laid out like its file)
            self._page_ptrs = cm.PointerTable(self.buffer.ptr, layout.block_bytes,
                                              self.num_layers * layout.num_blocks)
            self._fences = ReadFences(FENCES, ctx)
            self._parts.callback(self._fences.close)
            self._gather: PageGather | None = None
            self._ring_at = 0       # where the gather index ring is registered (it moves when it grows)
            if gather_fits(layout.block_bytes, layout.num_blocks):
                self._mapped = self.buffer.device_ptr()    # where the device reads the buffer (page_gather)
                if self._mapped != self.buffer.ptr:
                    self._own_memory(self._mapped, self.buffer.bytes, "the HostStore's pages (device mapping)")
                self._gather = PageGather(FENCES, ctx)
                self._parts.callback(self._gather.close)
                self._track_ring()
        except BaseException:
            self._parts.close()
            raise

    def _track_ring(self) -> None:
        """Register the gather index ring where it is now (it is replaced when it grows)."""
        ring = self._gather.ring if self._gather is not None else None
        if self._ring_at:
            self._disown_memory(self._ring_at)
        self._ring_at = 0
        if ring is not None:
            self._own_memory(ring.ptr, ring.bytes, "the HostStore's gather index ring")
            self._ring_at = ring.ptr

    def offset(self, layer: int, page: int) -> int:
        """Byte offset of (layer, page) in :attr:`buffer`."""
        return self._layer(layer) * self.layout.bytes_per_layer + self._page(page) * self.layout.block_bytes

    def _write(self, layer: int, page: int, offset_in_page: int, data: np.ndarray) -> None:
        self._fences.wait_all()
        at = layer * self.layout.bytes_per_layer + page * self.layout.block_bytes + offset_in_page
        self.buffer.array[at:at + data.nbytes] = data

    def _read_back(self, layer: int, page: int, offset: int, nbytes: int) -> np.ndarray | None:
        at = layer * self.layout.bytes_per_layer + page * self.layout.block_bytes + offset
        return self.buffer.array[at:at + nbytes].copy()

    def _prepared(self, reads: PreparedReads, slots: tuple[cm.PointerTable, np.ndarray] | None,
                  gather_min_runs: int | None = None) -> None:
        # one batched driver call per group (the DMA keeps its bandwidth on many mid-size copies): every transfer
        # checked here at once (unless they are pool slots), in one batch that each group queues its part of
        bb = self.layout.block_bytes
        if slots is None:
            first = reads.run_starts
            base = self.buffer.ptr + reads.layer * self.layout.bytes_per_layer
            reads.copies = cm.HostToDeviceBatch(reads.dsts[first], base + reads.pages[first] * bb,
                                                reads.run_counts * bb)
            return
        # into the pool, from this buffer: in range by construction
        table, index = slots
        pages = reads.pages
        if table.stride == bb:
            min_runs = self.gather_min_runs if gather_min_runs is None else min(gather_min_runs, self.gather_min_runs)
            if self._plan_gather(reads, table.base, index, min_runs):
                return       # every group through the kernel: no copy list
        first = reads.run_starts
        if first.size != pages.size:       # (else every run is one page: first is 0, 1, ...)
            index, pages = index[first], pages[first]
        reads.copies = cm.HostToDeviceBatch._planned(reads.run_counts * bb, table, index, self._page_ptrs,
                                                     pages + reads.layer * self.layout.num_blocks)

    def _plan_gather(self, reads: PreparedReads, pool: int, slots: np.ndarray, min_runs: int) -> bool:
        """Mark the groups of more than ``min_runs`` runs for ``page_gather`` (pool slots ``slots`` of the pool at
        ``pool``, kept with the pages: a launch writes its index pairs from them); the index ring grows to the widest
        (after waiting for every queued read: rare, the first steps). Returns whether every non-empty group goes
        through the kernel."""
        gather = self._gather
        b = reads.bounds
        if gather is None or min_runs >= b[-1] - b[0]:      # (no group has more runs than requests)
            return False
        kernel, every = [], True        # a few groups: plain ints
        for i, (lo, hi) in enumerate(zip(b, b[1:])):
            k = reads.more_runs(i, min_runs)
            kernel.append(k)
            every = every and (k or lo == hi)
        if not any(kernel):
            return False
        if b[-1] - b[0] > gather.capacity:       # (no group is wider than all of them)
            widest = max(hi - lo for lo, hi, k in zip(b, b[1:], kernel) if k)
            if widest > gather.capacity:
                self._fences.wait_all()              # no launch may still read the old index slots
                gather.reserve(widest)
                self._track_ring()
        src = self._mapped + reads.layer * self.layout.bytes_per_layer
        reads.gather = _Gathered(gather, kernel, reads.pages, slots, pool, src, self.layout.block_bytes // 16)
        return every

    def _issue(self, reads: PreparedReads, group: int, stream: int) -> None:
        k = self._fences.take()     # fence k guards index slot k: free once the group it fenced has run
        g = reads.gather
        if g is not None and g.kernel[group]:
            lo, hi = reads.bounds[group], reads.bounds[group + 1]
            g.via.launch(stream, k, g.dst, g.src, (g.pages[lo:hi], g.slots[lo:hi]), g.page_vecs)
        else:
            reads.copies.queue(stream, reads.run_bounds[group], reads.run_bounds[group + 1])
        reads.fence = self._fences.record(k, stream)

    def read_mark(self) -> Any:
        return self._fences.last()

    def reads_ran(self, mark: Any) -> None:
        if mark is not None:
            self._fences.reached(mark)

    def close(self) -> None:
        """Wait for queued reads, then free the pinned buffer; later calls do nothing."""
        if self._closed:
            return
        self._closed = True
        try:
            self._fences.wait_all()
        finally:
            self._parts.close()
