"""Device-side reads of a :class:`~hss.swap.stores.HostStore`: :class:`PageGather` (one ``page_gather`` launch copies a
group of scattered pages from the store's mapped pinned buffer into pool slots) and :class:`ReadFences` (the events
that say when queued reads have run, so that what they read is not rewritten early).

A group of reads is either one batched DMA call (``cuMemcpyBatchAsync``: each run of consecutive pages one copy,
~1-2 µs of driver time per copy) or one kernel launch whatever its runs; the HostStore picks per group with
:data:`GATHER_MIN_RUNS` (a sparse swap step's misses: :data:`SPARSE_GATHER_MIN_RUNS`). The kernel reads its (page,
slot) index pairs from mapped pinned memory too, so a launch needs no upload: index slot k is guarded by fence k, both
taken round robin, and rewritten only once the launch that read it has run (the host waits for it, unless the
caller said it had: :meth:`ReadFences.reached`).
"""
from __future__ import annotations

import contextlib
from typing import Any

import numpy as np

from hss import cuda_min as cm
from hss._util import ceil_div
from hss.cuda._launch import launcher
from hss.cuda.ptx import load_module
from hss.decls.gather import CHUNK, MAX_CHUNKS, MODULE, PAGE_GATHER, THREADS, VECTOR
from hss.errors import HssError

__all__ = ["GATHER_MIN_RUNS", "SPARSE_GATHER_MIN_RUNS", "FENCES", "PageGather", "ReadFences", "gather_fits"]

# A group of more than GATHER_MIN_RUNS runs is read by the kernel, the others by the copy engine: a DMA copy costs
# ~1-2 µs of driver time on the host (measured on an H200: 407 µs of host for two batches of ~113 copies), a launch
# plus its fence ~5 µs whatever the pages, and one long run is what the copy engine does best.
# GATHER_MIN_RUNS applies to every group a HostStore plans into pool slots, and is off (HostStore.gather_min_runs = 0
# or a small count opts in): on the H200 (2026-12-01) with the kernel taking every group of more than 4 runs, the
# EXACT HostStore step measured 1.27x its floor (1.11-1.14x by DMA): its tiles are few long runs, and the kernel's
# reads compete with its attention for the SMs. SPARSE_GATHER_MIN_RUNS is what a sparse swap step asks for its
# misses (HighSpeedSwap.sparse_gather_min_runs): a tile of scattered pages (one run each, ~100 runs) is one launch
# instead of ~100 DMA copies; a tile that is one contiguous run stays one DMA copy. Measured with the kernel on, the
# new-query sparse step ran 0.301x the exact step (0.404x by DMA).
GATHER_MIN_RUNS = 1 << 30
SPARSE_GATHER_MIN_RUNS = 1
FENCES = 8             # fences (and index slots) of a store: a fence is re-recorded FENCES groups after its last record
_FIRST_CAPACITY = 256  # pairs per index slot at first; grown to the widest gathered group


def gather_fits(block_bytes: int, num_blocks: int) -> bool:
    """Whether pages of ``block_bytes`` (``num_blocks`` of them in a layer) can go through ``page_gather``: whole
    16-byte vectors, indices and the vector count within int32, at most ``MAX_CHUNKS`` CTAs per page."""
    vecs, rest = divmod(block_bytes, VECTOR)
    return not rest and 0 < vecs < 2**31 and ceil_div(vecs, CHUNK) <= MAX_CHUNKS and num_blocks < 2**31


class ReadFences:
    """``count`` events of one context, each recorded after one group of reads: :meth:`take` gives the index of the
    next (the host first waits for the reads it was last recorded after, unless those are known to have run),
    :meth:`record` records it after a group just queued on a stream, :meth:`wait_all` waits for every group recorded
    so far. :meth:`last` and :meth:`reached` let a caller that waited for later work say which records have completed,
    so that their fences are taken with no host wait.

    A record that fails waits (host) for its stream instead, before its error propagates: a group's reads are never
    left unfenced while queued (unless that wait fails too: the context is then broken)."""

    def __init__(self, count: int, ctx: Any = None) -> None:
        self._owned = contextlib.ExitStack()
        try:
            self.events = [self._owned.enter_context(cm.CudaEvent(ctx=ctx)) for _ in range(count)]
        except BaseException:
            self._owned.close()
            raise
        self._held = [False] * count       # whether event k holds a record the host has not waited for
        self._turn = 0
        self._records = 0                   # records made so far; event k's last record is number _serial[k]
        self._serial = [0] * count
        self._stream = [0] * count          # the stream of event k's last record
        self._last: tuple[int, int] = (0, 0)    # (stream, n) of the last record: n - 1 is its number
        self._ran: tuple[int, int] = (0, 0)     # (stream, n): that stream's records numbered below n have completed

    def take(self) -> int:
        """The index of the next fence, once the reads it guarded have run (a host wait unless :meth:`reached` says
        they have; they ran long ago in a decode loop: ``count`` groups were queued since)."""
        k = self._turn
        if self._held[k]:
            stream, ran = self._ran
            if self._serial[k] >= ran or self._stream[k] != stream:
                self.events[k].synchronize()
            self._held[k] = False
        return k

    def record(self, k: int, stream: int) -> cm.CudaEvent:
        """Record fence ``k`` (from :meth:`take`) on ``stream`` after the group just queued there; returns its event,
        which keeps this record until ``count - 1`` more groups have been queued."""
        self._turn = (k + 1) % len(self.events)
        ev = self.events[k]
        try:
            ev.record(stream)
        except BaseException:
            try:
                cm.stream_sync(stream)        # no fence: the group's reads have run once this returns
            except Exception:  # noqa: BLE001 (the record's error is the one to report)
                pass
            raise
        self._held[k] = True
        self._serial[k], self._stream[k] = self._records, stream
        self._records += 1
        self._last = (stream, self._records)
        return ev

    def last(self) -> tuple[int, int]:
        """(stream, n) of the last record made: n - 1 is its number (n = 0: none yet). Pass it to :meth:`reached`
        once that record has completed."""
        return self._last

    def reached(self, mark: tuple[int, int]) -> None:
        """The record :meth:`last` gave ``mark`` for has completed (the caller waited for work ordered after it): so
        have the earlier ones on its stream, which :meth:`take` and :meth:`wait_all` then do not wait for."""
        stream, ran = self._ran
        if mark[1] > ran or mark[0] != stream:
            self._ran = mark

    def wait_all(self) -> None:
        """Wait (host) until every group recorded so far has run."""
        stream, ran = self._ran
        for k, held in enumerate(self._held):
            if held:
                if self._serial[k] >= ran or self._stream[k] != stream:
                    self.events[k].synchronize()
                self._held[k] = False

    def close(self) -> None:
        """Destroy the events (the caller waited for what they guard)."""
        self._owned.close()


class PageGather:
    """``page_gather`` launches in one context, with ``slots`` index slots of (page, slot) int32 pairs in mapped pinned
    memory, each :attr:`capacity` pairs (:meth:`reserve` grows them). Index slot k may be rewritten only once the last
    launch that read it has run: the caller's to ensure (a :class:`ReadFences` of as many fences)."""

    def __init__(self, slots: int, ctx: Any = None) -> None:
        self._ctx, self._slots = ctx, slots
        self._owned = contextlib.ExitStack()
        self._ring: cm.PinnedBuffer | None = None
        self._table: np.ndarray | None = None      # int32 [slots, capacity, 2]: a view of the ring
        self.capacity = 0
        try:
            fn = self.function = self._owned.enter_context(load_module(MODULE, ctx)).function(PAGE_GATHER.name)
            pack = self._pack = PAGE_GATHER.pack(0, 0, 0, 1, 1)
            self._dst, self._src, self._pairs, self._n, self._vecs = (
                pack.slot(name) for name in ("dst", "src", "pairs", "n_pages", "page_vecs"))
            self._run = launcher(fn, (THREADS, 1, 1), 0, pack)
            self.reserve(_FIRST_CAPACITY)
        except BaseException:
            self.close()
            raise

    def reserve(self, pages: int) -> None:
        """Make every index slot hold at least ``pages`` pairs. Growing frees the old slots: no launch may still read
        them (the caller waited)."""
        if pages <= self.capacity:
            return
        cap = max(_FIRST_CAPACITY, 1 << (int(pages) - 1).bit_length())
        ring = cm.PinnedBuffer(8 * self._slots * cap, self._ctx)
        try:
            ring_dev = ring.device_ptr()          # where the kernel reads it (cuMemHostGetDevicePointer)
        except BaseException:
            ring.close()
            raise
        old, self._ring = self._ring, ring
        self._ring_dev, self.capacity = ring_dev, cap
        self._table = ring.view(np.int32).reshape(self._slots, cap, 2)
        if old is not None:
            old.close()

    @property
    def ring(self) -> cm.PinnedBuffer | None:
        """The mapped pinned memory of the index slots (None once closed); replaced when :meth:`reserve` grows it."""
        return self._ring

    def launch(self, stream: int, slot: int, dst: int, src: int, pairs: np.ndarray | tuple, page_vecs: int) -> None:
        """Queue on ``stream`` the copies of page ``pairs[r, 0]`` of ``src`` into page ``pairs[r, 1]`` of ``dst``
        (``page_vecs`` 16-byte vectors each), its pairs written into index slot ``slot`` first. Values the caller
        checked: 16-byte aligned device addresses (``src`` mapped host memory), int32 pairs in range (an int
        ``[n, 2]`` array, or a tuple of the two ``[n]`` columns, written into the slot as they are), at most
        :attr:`capacity` of them (>= 1), distinct destinations, ``gather_fits`` pages, a raw stream handle."""
        if self._ring is None:
            raise HssError("this PageGather is closed")
        if type(pairs) is tuple:
            pages, slots = pairs
            n = pages.shape[0]
            row = self._table[slot, :n]
            row[:, 0] = pages
            row[:, 1] = slots
        else:
            n = pairs.shape[0]
            self._table[slot, :n] = pairs
        self._dst.value, self._src.value, self._n.value, self._vecs.value = dst, src, n, page_vecs
        self._pairs.value = self._ring_dev + 8 * slot * self.capacity
        self._run(stream, n, ceil_div(page_vecs, CHUNK))

    def close(self) -> None:
        """Free the index slots and the module (the caller waited for the launches); later calls do nothing."""
        ring, self._ring, self._table = self._ring, None, None
        try:
            if ring is not None:
                ring.close()
        finally:
            self._owned.close()
