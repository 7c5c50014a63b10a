"""Backing stores for KV pages (SPEC §7.1-7.3): :class:`HostStore` (pinned host memory) and :class:`FileStore`
(one preallocated file per layer), behind one small interface, :class:`BackingStore`.

Both keep every layer in the :class:`~hss.swap.layout.GroupLayout` page layout, so a page is one
contiguous ``block_bytes`` range in the store and in a scratch slot, and consecutive pages read with one
transfer. Writes are synchronous host operations; ``read_pages`` queues host-to-device copies on the
caller's stream and returns without waiting for them (a HostStore can read a scattered group into the swap's
pool slots with one ``page_gather`` launch instead: a sparse swap step's scattered misses, or any group into pool slots
where ``gather_min_runs`` opts in: :mod:`hss.swap.gather`).
``prepare_reads`` checks and plans many reads at once (a decode step's tiles) into :class:`PreparedReads`, whose
groups then issue with almost no host work.

Validity: a per-group bitmap. A write clears the bits of the groups it covers, writes the data, and sets
them only after the data is fully written, so a failed or partial write never leaves a group readable with
partial bytes. A write is all or nothing: where a group it covers was readable, its bytes are read back first and,
if the write fails, written back with their bits, so the group reads as before the call (only if writing them back
fails too is the group left unreadable, which the error says). A per-page flag (every group valid) keeps the
read-side check to one lookup. Reading a page with any group not valid raises :class:`StoreError` before anything
is queued. A short read or an I/O error raises :class:`StoreIOError` naming the layer, the page and the kind (K/V)
and kv head of the first byte that could not be read.

A store refuses, before any work, destinations of reads that overlap its own memory (the pinned buffer, the bounce
ring, the gather index ring) or each other, and, once the process uses several devices, a stream of another
device's context than the store's.
"""
from __future__ import annotations

import collections
import contextlib
import errno
import mmap
import os
import shutil
import stat
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from hss import _args
from hss import cuda_min as cm
from hss.errors import HssError, StoreError, StoreIOError
from hss.swap._checks import StreamCheck
from hss.swap.gather import FENCES, GATHER_MIN_RUNS, PageGather, ReadFences, gather_fits
from hss.swap.layout import GroupLayout, host_bytes

__all__ = ["BackingStore", "HostStore", "FileStore", "PreparedReads", "StoreError", "StoreIOError", "layer_path"]

O_DIRECT = getattr(os, "O_DIRECT", 0)


def layer_path(directory: str | os.PathLike, layer: int) -> Path:
    """``<dir>/layer_{layer:05}.kv`` (SPEC §7.2)."""
    return Path(directory) / f"layer_{layer:05}.kv"


def _what_is(path: Path) -> str:
    """What ``path`` is, for an error: "a directory", "a FIFO", "a device", ..."""
    try:
        mode = path.stat().st_mode
    except OSError:
        return "unreadable"
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISREG, "a regular file"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


def _run_starts(pages: np.ndarray, dsts: np.ndarray, block_bytes: int, cap: int, bounds: np.ndarray) -> np.ndarray:
    """Where the runs start (bool ``[n + 1]``, ``[n]`` the end): runs of requests whose pages and destinations are
    both consecutive, <= ``cap`` pages each, none crossing a group boundary ``bounds`` (sorted, in 0..n). One
    vectorized pass, no loop over runs; :func:`_runs` lists them."""
    n = pages.size
    start = np.empty(n + 1, dtype=bool)
    start[0] = start[n] = True
    inner = start[1:n]
    np.not_equal(pages[1:], pages[:-1] + 1, out=inner)
    inner |= dsts[1:] != dsts[:-1] + block_bytes
    start[bounds] = True
    if cap < n:     # split runs longer than cap: every cap-th request of a run starts a new one
        edges = start.nonzero()[0]
        pos = np.arange(n + 1) - edges[np.cumsum(start) - 1]
        start |= pos % cap == 0
    return start


def _runs(start: np.ndarray, bounds: list[int]) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """The runs :func:`_run_starts` marked: the first request of each, its page count, and the first run of each
    bound (group i's runs are ``at[i]:at[i + 1]``)."""
    edges = start.nonzero()[0]
    return edges[:-1], edges[1:] - edges[:-1], edges.searchsorted(bounds).tolist()


class _Saved(NamedTuple):
    """What a store write replaced (:meth:`BackingStore._put`): ``old``, the bytes at ``offset`` of (layer, page)
    before it (None where none of its groups was readable, or they could not be read), and ``was``, the validity of
    the groups ``groups`` it covered."""
    layer: int
    page: int
    offset: int
    groups: slice
    was: np.ndarray
    old: np.ndarray | None


class PreparedReads:
    """Reads checked and planned at once by :meth:`BackingStore.prepare_reads`, in groups: ``issue(i, stream)``
    queues group i (requests ``bounds[i]:bounds[i + 1]``) like :meth:`BackingStore.read_pages`.

    ``pages``, ``dsts``: the requests (int64); ``bounds``: the group edges (a list); ``run_starts``,
    ``run_counts``: the transfers in order (first request, pages), group i's being ``run_bounds[i]`` up to
    ``run_bounds[i + 1]`` (planned when first read: a group read by ``page_gather`` needs only whether there are more
    than a few). Groups may be issued in any order, each any number of times.

    ``fence``: after an ``issue``, an event recorded on its stream right after the group's reads (a HostStore's),
    which keeps that record until the store has issued ``hss.swap.gather.FENCES - 1`` more groups: wait for it
    (``stream_wait_event``) before then. None where the store has none (a FileStore) or nothing was queued: a caller
    that orders other work after the reads records its own event.
    """

    __slots__ = ("store", "layer", "pages", "dsts", "bounds", "copies", "gather", "fence", "_block_bytes", "_epoch",
                 "_edges", "_cap", "_start", "_runs")

    def __init__(self, store: BackingStore, layer: int, pages: np.ndarray, dsts: np.ndarray, bounds: list[int],
                 edges: np.ndarray) -> None:
        self.store, self.layer, self.pages, self.dsts, self.bounds = store, layer, pages, dsts, bounds
        self._edges, self._cap = edges, store.run_cap_pages     # the bounds as an int64 array; the longest run
        self._start: np.ndarray | None = None      # where runs start (_run_starts), once marked
        self._runs: tuple | None = None            # the runs, once listed
        self.copies: Any = None     # HostStore: the transfers as one HostToDeviceBatch (see _prepared; None where
        #                             every group goes through page_gather)
        self.gather: _Gathered | None = None     # HostStore: the groups read by page_gather, if any
        self.fence: cm.CudaEvent | None = None
        self._block_bytes, self._epoch = store.layout.block_bytes, store._epoch

    def __len__(self) -> int:
        return max(len(self.bounds) - 1, 0)

    def _marked(self) -> np.ndarray:
        if self._start is None:
            self._start = _run_starts(self.pages, self.dsts, self._block_bytes, self._cap, self._edges)
        return self._start

    def _listed(self) -> tuple[np.ndarray, np.ndarray, list[int]]:
        if self._runs is None:
            self._runs = _runs(self._marked(), self.bounds)
        return self._runs

    @property
    def run_starts(self) -> np.ndarray:
        return self._listed()[0]

    @property
    def run_counts(self) -> np.ndarray:
        return self._listed()[1]

    @property
    def run_bounds(self) -> list[int]:
        return self._listed()[2]

    def _more_runs(self, i: int, n: int) -> bool:
        """Whether group i's reads are more than ``n`` transfers (``run_bounds[i + 1] - run_bounds[i] > n``)."""
        lo, hi = self.bounds[i], self.bounds[i + 1]
        if hi - lo <= n:
            return False
        if n == 1:      # the usual scattered group: its first two requests are two runs already
            p, d = self.pages, self.dsts
            if p[lo + 1] != p[lo] + 1 or d[lo + 1] != d[lo] + self._block_bytes:
                return True
        return int(np.count_nonzero(self._marked()[lo:hi])) > n

    def _group(self, i: Any) -> int:
        if type(i) is not int:
            i = _args.as_int("group", i)
        if not 0 <= i < len(self.bounds) - 1:
            raise IndexError(f"group {i} is out of range: {len(self)} groups were prepared")
        return i

    def nbytes(self, i: int) -> int:
        """Bytes that group i reads."""
        i = self._group(i)
        return (self.bounds[i + 1] - self.bounds[i]) * self._block_bytes

    def issue(self, i: int, stream: Any) -> int:
        """Queue group i's reads on ``stream``; returns the bytes queued. A group issued after the store was
        written or invalidated is checked again (:class:`StoreError`, nothing queued). May block the host
        like ``read_pages``, never on ``stream`` itself."""
        if type(i) is not int or not 0 <= i < len(self.bounds) - 1:   # the hot path: one check of an int
            i = self._group(i)
        store = self.store
        s = store._stream(stream)
        lo, hi = self.bounds[i], self.bounds[i + 1]
        if store._closed or store._epoch != self._epoch:
            store._live()
            store._check_valid(self.layer, self.pages[lo:hi])
        self.fence = None
        if hi == lo:
            return 0
        store._issue(self, i, s)
        return (hi - lo) * self._block_bytes

    def __repr__(self) -> str:
        return (f"PreparedReads(layer {self.layer}, {self.pages.size} pages in {len(self)} groups, "
                f"{self.run_starts.size} transfers)")


class BackingStore:
    """Pages of ``num_layers`` layers in ``layout``; subclasses move the bytes.

    ``write_page(layer, page, image)`` / ``write_group(layer, page, kind, kv_head, data)``: synchronous host
    writes, all or nothing (see the module docstring). ``read_pages(stream, layer, pages, dsts)``: queue pages[i]
    -> device dsts[i] on ``stream``; ``prepare_reads(layer, pages, dsts, bounds)``: the same, checked and planned
    once for many groups. ``ctx``: the context the store works in (None: the current one); its streams must be that
    context's. A subclass moves the bytes (``_write``, ``_read_back``, ``_issue``) and registers the memory it owns
    in ``_memory`` (an :class:`hss._args.OwnedRanges`), which no read may write into.
    """

    kind = "?"

    def __init__(self, layout: GroupLayout, num_layers: int, run_cap_bytes: int = 1 << 20, *,
                 ctx: cm.CudaCtx | None = None) -> None:
        if not isinstance(layout, GroupLayout):
            raise TypeError(f"layout must be a GroupLayout, not {type(layout).__name__}")
        nl = _args.as_int("num_layers", num_layers)
        if nl < 1:
            raise HssError(f"num_layers must be >= 1 (got {nl})")
        self.layout, self.num_layers = layout, nl
        self.run_cap_pages = max(1, _args.as_int("run_cap_bytes", run_cap_bytes) // layout.block_bytes)
        self._valid = np.zeros((nl, layout.num_blocks, 2 * layout.num_kv_heads), dtype=bool)
        self._page_ok = np.zeros((nl, layout.num_blocks), dtype=bool)   # every group of the page valid
        self._epoch = 0       # bumped whenever a page may stop being valid: prepared reads then check again
        self._closed = False
        self._stream = StreamCheck(ctx, f"this {type(self).__name__}")
        self._memory = _args.OwnedRanges()      # what this store owns: no read's destination may overlap it
        self._spans: dict[int, tuple[int, int]] = {}     # the same ranges: start -> (start, end)

    @property
    def device(self) -> int:
        """The ordinal of the device whose context the store works in."""
        return self._stream.device

    # -- validity --------------------------------------------------------------------------------
    def _layer(self, layer: Any) -> int:
        layer = _args.as_int("layer", layer)
        if not 0 <= layer < self.num_layers:
            raise StoreError(f"layer {layer} is out of range: this store has {self.num_layers} layers")
        return layer

    def _page(self, page: Any) -> int:
        page = _args.as_int("page", page)
        if not 0 <= page < self.layout.num_blocks:
            raise StoreError(f"page {page} is out of range 0..{self.layout.num_blocks - 1}")
        return page

    def _pages(self, pages: Any) -> np.ndarray:
        arr = np.asarray(pages)
        if arr.dtype.kind not in "iu":
            if arr.size:
                raise TypeError(f"pages must be integers, got {arr.dtype}")
            arr = arr.astype(np.int64)
        arr = arr.astype(np.int64).reshape(-1)
        if arr.size and arr.view(np.uint64).max() >= self.layout.num_blocks:     # a negative page wraps to a huge one
            bad = arr[(arr < 0) | (arr >= self.layout.num_blocks)]
            raise StoreError(f"pages {bad[:8].tolist()} are out of range 0..{self.layout.num_blocks - 1}")
        return arr

    def page_valid(self, layer: int, page: int) -> bool:
        """Whether every group of (layer, page) has been written completely."""
        return bool(self._page_ok[self._layer(layer), self._page(page)])

    def missing_pages(self, layer: int, pages: Any) -> np.ndarray:
        """Those of ``pages`` with a group never (or not completely) written."""
        arr = self._pages(pages)
        return arr[~self._page_ok[self._layer(layer), arr]]

    def _missing_planned(self, layer: int, pages: np.ndarray) -> np.ndarray:
        """:meth:`missing_pages` of values the caller checked (``layer`` in range; ``pages`` int64, in range)."""
        ok = self._page_ok[layer].take(pages)
        return pages[~ok] if np.count_nonzero(ok) != ok.size else pages[:0]

    def invalidate_page(self, layer: int, page: int) -> None:
        layer, page = self._layer(layer), self._page(page)
        self._epoch += 1
        self._valid[layer, page] = self._page_ok[layer, page] = False

    def invalidate_block(self, page: int) -> None:
        """Invalidate ``page`` in every layer (its disk block id was freed)."""
        page = self._page(page)
        self._epoch += 1
        self._valid[:, page] = False
        self._page_ok[:, page] = False

    def _check_valid(self, layer: int, pages: np.ndarray) -> None:
        ok = self._page_ok[layer, pages]
        if np.count_nonzero(ok) != ok.size:
            missing = pages[~ok]
            raise StoreError(f"layer {layer} pages {missing[:8].tolist()} were never written (or their last write "
                             "failed): offload them before reading", missing)

    # -- writes ----------------------------------------------------------------------------------
    def write_page(self, layer: int, page: int, image: Any) -> None:
        """Write one page image (``block_bytes``; see :meth:`GroupLayout.pack_page`). All or nothing: a write that
        fails (:class:`StoreIOError`) leaves the page as it was (see the module docstring)."""
        self._live()
        layer, page = self._layer(layer), self._page(page)
        raw = host_bytes("image", image)
        if raw.nbytes != self.layout.block_bytes:
            raise StoreError(f"a page image is block_bytes = 2*num_kv_heads*group_stride = {self.layout.block_bytes} "
                             f"bytes, got {raw.nbytes}")
        self._put(layer, page, 0, raw, slice(None))

    def write_group(self, layer: int, page: int, kind: int, kv_head: int, data: Any) -> None:
        """Write one group (the original's ``write_from_host``): exactly ``group_bytes`` bytes, zero-padded
        to ``group_stride``. All or nothing, like :meth:`write_page`."""
        self._live()
        layer, page = self._layer(layer), self._page(page)
        kind, kv_head = _args.as_int("kind", kind), _args.as_int("kv_head", kv_head)
        off = self.layout.group_offset(page, kind, kv_head) - page * self.layout.block_bytes
        raw = host_bytes("data", data)
        if raw.nbytes != self.layout.group_bytes:
            raise StoreError(f"a group is block_size*head_dim*elem_bytes = {self.layout.group_bytes} bytes, "
                             f"got {raw.nbytes}")
        buf = np.zeros(self.layout.group_stride, dtype=np.uint8)
        buf[:raw.nbytes] = raw
        g = kind * self.layout.num_kv_heads + kv_head
        self._put(layer, page, off, buf, slice(g, g + 1))

    def _put(self, layer: int, page: int, offset: int, data: np.ndarray, groups: slice) -> _Saved:
        """Write ``data`` at ``offset`` of (layer, page), which covers the groups ``groups`` of the page (values the
        caller checked), all or nothing; returns what :meth:`_undo` needs to put the old bytes back."""
        self._live()
        was = self._valid[layer, page, groups].copy()
        old = self._read_back(layer, page, offset, data.nbytes) if was.any() else None
        saved = _Saved(layer, page, offset, groups, was, old)
        self._epoch += 1
        self._valid[layer, page, groups] = self._page_ok[layer, page] = False
        try:
            self._write(layer, page, offset, data)
        except BaseException as exc:
            self._restore(saved, exc)
            raise
        self._valid[layer, page, groups] = True
        self._page_ok[layer, page] = self._valid[layer, page].all()
        return saved

    def _undo(self, saved: _Saved) -> None:
        """Put back what :meth:`_put` replaced (its caller's next step failed): the old bytes and validity of the
        groups it covered. Raises :class:`StoreIOError` if the old bytes cannot be put back (those groups are then
        unreadable)."""
        self._epoch += 1
        self._valid[saved.layer, saved.page, saved.groups] = self._page_ok[saved.layer, saved.page] = False
        self._restore(saved, None)

    def _restore(self, saved: _Saved, failure: BaseException | None) -> None:
        """Write ``saved``'s old bytes back where a group they cover was readable, then set its old validity bits
        (the caller cleared them). ``failure``: the write's own error (None: the write succeeded and is undone).
        Where the old bytes cannot be put back, those groups stay unreadable and a StoreIOError says so."""
        layer, page = saved.layer, saved.page
        if saved.was.any():
            why = ""
            if saved.old is None:
                why = "they could not be read before the write"
            else:
                try:
                    self._write(layer, page, saved.offset, saved.old)
                except OSError as exc:
                    text = str(exc).split("): ", 1)[-1] if isinstance(exc, StoreIOError) else str(exc)
                    why = f"writing them back failed: {text}"
            if why:
                raise self._lost(saved, failure, why)
        self._valid[layer, page, saved.groups] = saved.was
        self._page_ok[layer, page] = self._valid[layer, page].all()

    def _lost(self, saved: _Saved, failure: BaseException | None, why: str) -> BaseException:
        """The error of a write (``failure``; None: an undo) that left groups which were readable unreadable."""
        tail = f"the page's previous bytes are lost ({why}): it is unreadable until it is written again"
        if isinstance(failure, StoreIOError):
            head = f"layer {failure.layer} page {failure.page} ({failure.kind} stripe of kv_head {failure.kv_head}): "
            text = failure.strerror[len(head):] if failure.strerror.startswith(head) else failure.strerror
            err = StoreIOError(saved.layer, saved.page, StoreIOError.KIND_NAMES.index(failure.kind), failure.kv_head,
                               f"{text}; {tail}", failure.errno)
        elif failure is None:
            kind, kh = self.layout.locate(saved.offset)
            err = StoreIOError(saved.layer, saved.page, kind, kh, f"the write was undone, but {tail}")
        else:           # an interrupt or a driver error: raised as it is (the groups stay unreadable)
            return failure
        err.__cause__ = failure
        return err

    def _read_back(self, layer: int, page: int, offset: int, nbytes: int) -> np.ndarray | None:
        """A copy of ``nbytes`` at ``offset`` of (layer, page) as the store holds them now, or None where they cannot
        be read (values the caller checked)."""
        raise NotImplementedError

    # -- reads -----------------------------------------------------------------------------------
    def read_pages(self, stream: Any, layer: int, pages: Any, dsts: Any) -> int:
        """Queue copies of (layer, pages[i]) into device addresses ``dsts[i]`` (``block_bytes`` each) on
        ``stream``; returns the bytes queued. May block the host (file reads, buffer reuse), never on
        ``stream`` itself. Raises :class:`StoreError` (nothing queued) if a page is not valid."""
        s = self._stream(stream)
        return self.prepare_reads(layer, pages, dsts, [0, np.size(pages)]).issue(0, s)

    def prepare_reads(self, layer: int, pages: Any, dsts: Any, bounds: Any) -> PreparedReads:
        """Check and plan reads of (layer, pages[i]) into device addresses ``dsts[i]`` once, in groups
        ``[bounds[i], bounds[i + 1])`` (non-decreasing request indices in 0..len(pages)); ``issue(i, stream)``
        of the result then queues group i like :meth:`read_pages`. Everything is checked here (layer, page
        range, destinations, pages never written: :class:`StoreError` naming them) and no transfer crosses a
        group edge. Destinations may overlap neither each other nor the store's own memory (:class:`HssError`). Keep
        the destinations alive until the groups are issued."""
        self._live()
        layer = self._layer(layer)
        pages = self._pages(pages)
        dsts = self._dsts(dsts)
        if dsts.size != pages.size:
            raise HssError(f"{pages.size} pages but {dsts.size} destinations")
        self._disjoint_dsts(dsts)
        b = np.asarray(bounds)
        if b.size and b.dtype.kind not in "iu":
            raise TypeError(f"bounds must be integers, got {b.dtype}")
        b = b.astype(np.int64, copy=False).reshape(-1)
        edges = b.tolist()
        if edges and (edges[0] < 0 or edges[-1] > pages.size or any(x > y for x, y in zip(edges, edges[1:]))):
            raise HssError(f"bounds {edges[:8]} must be non-decreasing request indices in 0..{pages.size}")
        self._check_valid(layer, pages)
        return self._plan_reads(layer, pages, dsts, b, edges)

    def _plan_reads(self, layer: int, pages: np.ndarray, dsts: np.ndarray, bounds: np.ndarray, edges: list[int],
                    slots: tuple[cm.PointerTable, np.ndarray] | None = None,
                    gather_min_runs: int | None = None) -> PreparedReads:
        """:meth:`prepare_reads` of values the caller checked or computed: ``pages`` (int64, our own) readable pages
        of ``layer``; ``dsts`` (int64, our own) into live hss memory with room for a page each; ``bounds`` (int64)
        and ``edges`` (the same as a list) non-decreasing in 0..len(pages). ``slots``: every destination is a slot
        of the swap's scratch pool, ``dsts[i]`` entry ``slots[1][i]`` of its pointer table ``slots[0]`` (then the
        planned runs need no range check; ``slots[1]``, our own too, is kept like the pages). ``gather_min_runs``: a
        HostStore reads those groups (into pool slots) of more runs than this or its own
        :attr:`HostStore.gather_min_runs`, the smaller, with ``page_gather`` (a sparse swap step's scattered misses)."""
        reads = PreparedReads(self, layer, pages, dsts, edges, bounds)
        self._prepared(reads, slots, gather_min_runs)
        return reads

    def _dsts(self, dsts: Any) -> np.ndarray:
        """Destination addresses as int64 (a copy, like the pages: issued later, as prepared): an int array, each
        non-null (its ranges are checked against the live hss buffers with the planned runs), or a sequence of
        anything :func:`hss._args.pointer` takes, each with room for one page."""
        if isinstance(dsts, np.ndarray):
            if dsts.size and dsts.dtype.kind not in "iu":
                raise TypeError(f"dsts must be device addresses (integers), got {dsts.dtype}")
            arr = dsts.astype(np.int64).reshape(-1)
            if arr.size and arr.min() <= 0:
                raise HssError(f"dsts holds {int(arr.min())}, not a device address: pass non-null device addresses")
            return arr
        try:
            items = list(dsts)
        except TypeError:
            raise TypeError(f"dsts must be a sequence of device addresses, got {type(dsts).__name__}") from None
        bb = self.layout.block_bytes
        return np.array([_args.pointer(d, f"dsts[{i}]", bb, write=True, what="room for one page")
                         for i, d in enumerate(items)], dtype=np.int64)

    def _disjoint_dsts(self, dsts: np.ndarray) -> None:
        """HssError where two destinations (a page each) overlap, or one overlaps memory this store owns."""
        bb = self.layout.block_bytes
        if dsts.size > 1:
            order = dsts.argsort(kind="stable")
            at = dsts[order]
            close = np.flatnonzero(at[1:] - at[:-1] < bb)
            if close.size:
                i, j = sorted(order[close[0]:close[0] + 2].tolist())
                raise HssError(f"dsts[{i}] ({int(dsts[i]):#x}) and dsts[{j}] ({int(dsts[j]):#x}) overlap: each "
                               f"destination receives a whole page ({bb} bytes); pass distinct, non-overlapping "
                               "destinations")
        for start, end in self._spans.values():
            hit = np.flatnonzero((dsts < end) & (dsts + bb > start))
            if hit.size:
                i = int(hit[0])
                self._memory.check(int(dsts[i]), bb, f"dsts[{i}]", f"this {type(self).__name__}")

    def _own_memory(self, ptr: int, nbytes: int, label: str) -> None:
        """Register memory the store owns (no read may write into it; :attr:`_memory` for its users' checks)."""
        self._memory.add(ptr, nbytes, label)
        self._spans[ptr] = (ptr, ptr + nbytes)

    def _disown_memory(self, ptr: int) -> None:
        self._memory.remove(ptr)
        self._spans.pop(ptr, None)

    # -- subclass hooks, lifetime ----------------------------------------------------------------
    def _write(self, layer: int, page: int, offset_in_page: int, data: np.ndarray) -> None:
        raise NotImplementedError

    def _prepared(self, reads: PreparedReads, slots: tuple[cm.PointerTable, np.ndarray] | None,
                  gather_min_runs: int | None = None) -> None:
        """Prebuild whatever issuing ``reads``' groups needs (``slots``, ``gather_min_runs``: see
        :meth:`_plan_reads`)."""

    def _issue(self, reads: PreparedReads, group: int, stream: int) -> None:
        raise NotImplementedError

    def _read_mark(self) -> Any:
        """A mark of the reads issued so far (None where the store keeps no fences): pass it to :meth:`_reads_ran`
        once work ordered after the last of them (on their stream) has completed."""
        return None

    def _reads_ran(self, mark: Any) -> None:
        """The reads up to ``mark`` (:meth:`_read_mark`; None: nothing known) have run: later reads and writes need
        not wait for them."""

    def _live(self) -> None:
        if self._closed:
            raise HssError(f"this {type(self).__name__} is closed")

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        self._closed = True

    def __enter__(self) -> BackingStore:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


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
            k = reads._more_runs(i, min_runs)
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

    def _read_mark(self) -> Any:
        return self._fences.last()

    def _reads_ran(self, mark: Any) -> None:
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


class _Ahead(NamedTuple):
    """A read-ahead: group ``group`` of ``reads``, its first ``window`` (request start, count, bounce page) from
    absolute bounce page ``w_start``, the preads' futures, the store epoch it was started in."""
    reads: PreparedReads
    group: int
    window: list
    w_start: int
    pending: list
    epoch: int


class _Files:
    """A FileStore's OS resources (layer file descriptors, the read thread pool), shared with its finalizer, which
    must not hold the store itself."""

    __slots__ = ("fds", "executor")

    def __init__(self) -> None:
        self.fds: list[int] = []
        self.executor: ThreadPoolExecutor | None = None

    def close(self, wait: bool = True) -> None:
        executor, self.executor = self.executor, None
        if executor is not None:
            executor.shutdown(wait=wait)
        fds, self.fds = self.fds, []
        for fd in fds:
            try:
                os.close(fd)
            except OSError:
                pass


class FileStore(BackingStore):
    """One file per layer, ``<dir>/layer_{layer:05}.kv``, preallocated to ``bytes_per_layer`` (SPEC §7.2).

    ``direct``: True opens with O_DIRECT (raises if the filesystem refuses it), False uses buffered I/O,
    None (default) tries O_DIRECT and falls back to buffered I/O; :attr:`direct` says which is in use.
    Reads go through a ring of ``bounce_pages`` pages of pinned, 4 KiB-aligned host memory: pread (``qd``
    reads in flight on a thread pool when qd > 1), then an H2D copy on the caller's stream; a bounce page
    is reused only after its copy has run (a host wait on an event). With qd > 1, issuing a group of
    :class:`PreparedReads` also starts the reads of the next group's first window (as much of it as the ring
    holds beside the group being read), so the disk is not idle while the host attends between groups; the
    next ``issue`` of that group takes them, anything else (another group, a write, close) waits for them
    and drops them. Writes go through a page-aligned staging buffer when direct. Existing file contents
    are never trusted: only pages written through this store are readable. An existing layer file is reused: a
    shorter one is extended to ``bytes_per_layer``, a longer one keeps its tail, which the store never reads; a
    layer path that is not a regular file (a directory, a FIFO, a device), or a store directory that is not a
    directory, is refused with an :class:`HssError` naming it.

    A construction that fails (the directory cannot be made, a file cannot be opened or preallocated: a disk too
    full for ``num_layers * bytes_per_layer`` bytes) raises an ``OSError`` naming the path, the layer and the bytes
    needed, after removing the files (and directories) it created. A store dropped without ``close()`` closes its
    files when it is collected (a finalizer); ``close()`` also waits for queued copies out of the bounce ring.
    """

    kind = "file"

    def __init__(self, directory: str | os.PathLike, layout: GroupLayout, num_layers: int, *,
                 direct: bool | None = None, qd: int = 1, bounce_pages: int = 16, run_cap_bytes: int = 1 << 20,
                 ctx: cm.CudaCtx | None = None) -> None:
        super().__init__(layout, num_layers, run_cap_bytes, ctx=ctx)
        if direct not in (None, True, False):
            raise TypeError(f"direct must be None (auto), True or False, not {direct!r}")
        qd, bounce_pages = _args.as_int("qd", qd), _args.as_int("bounce_pages", bounce_pages)
        if not 1 <= qd <= 64:
            raise HssError(f"qd ({qd}) must be in 1..64")
        if bounce_pages < 1:
            raise HssError(f"bounce_pages must be >= 1 (got {bounce_pages})")
        if not isinstance(directory, (str, os.PathLike)) or not str(directory):
            raise TypeError(f"directory must be a non-empty path, not {directory!r}")
        self.dir = Path(directory)
        self.qd = qd
        self.ring = bounce_pages
        self.run_cap_pages = min(self.run_cap_pages, bounce_pages)
        self._files = _Files()
        self._finalizer = weakref.finalize(self, self._files.close, False)
        self._created: list[Path] = []                          # what a failed construction removes
        self._stage = mmap.mmap(-1, layout.block_bytes)       # page-aligned: O_DIRECT writes
        self._back = mmap.mmap(-1, layout.block_bytes)        # and reads of what a write replaces
        try:
            self._make_dir()
            self.direct = self._open_all(direct)
            self.bounce = cm.PinnedBuffer(bounce_pages * layout.block_bytes, ctx)
        except BaseException:
            self._finalizer.detach()
            self._files.close()
            self._stage.close()
            self._back.close()
            self._remove_created()
            raise
        self._own_memory(self.bounce.ptr, self.bounce.bytes, "the FileStore's bounce ring")
        self._created = []
        self._ctx = ctx
        self._head = 0                                          # absolute bounce page counter
        self._inflight: collections.deque[tuple[int, cm.CudaEvent]] = collections.deque()
        self._spare: list[cm.CudaEvent] = []
        self._ahead: _Ahead | None = None                       # the next group's first window, being read
        self._outstanding: list[Future] = []                    # preads started and not yet waited for

    # -- files -----------------------------------------------------------------------------------
    def path(self, layer: int) -> Path:
        return layer_path(self.dir, self._layer(layer))

    @property
    def _fds(self) -> list[int]:
        return self._files.fds

    def _setup_error(self, exc: OSError, action: str, path: Path, layer: int | None) -> OSError:
        """``exc`` as an OSError naming the path, the layer and the bytes the store needs (and has free there)."""
        per = self.layout.bytes_per_layer
        what = f"layer {layer}'s file {path}" if layer is not None else f"the store directory {path}"
        text = (f"FileStore: cannot {action} {what}: {exc.strerror or exc}; the store needs {per} bytes per layer "
                f"x {self.num_layers} layers = {per * self.num_layers} bytes")
        try:
            free = shutil.disk_usage(self.dir if self.dir.exists() else self.dir.parent).free
            text += f", {free} bytes are free there"
        except OSError:
            pass
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            text += ": free space, or put the store on a larger filesystem (HighSpeedSwapConfig.dir)"
        return OSError(exc.errno, text)

    def _make_dir(self) -> None:
        missing = []
        d = self.dir
        while not d.exists() and d != d.parent:
            missing.append(d)
            d = d.parent
        self._created += missing          # (those that exist at a failure are removed, if empty)
        if not missing and not self.dir.is_dir():
            raise HssError(f"FileStore: the store directory {self.dir} exists but is {_what_is(self.dir)}, not a "
                           "directory: pass a directory (HighSpeedSwapConfig.dir)")
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise self._setup_error(exc, "create", self.dir, None) from exc

    def _remove_created(self) -> None:
        """Remove the files and directories a failed construction created (files first, then the directories)."""
        for path in sorted(self._created, key=lambda p: (p.is_dir(), -len(p.parts))):
            try:
                if path.is_dir():
                    path.rmdir()          # only if empty: never anything the caller put there
                else:
                    path.unlink()
            except OSError:
                pass
        self._created = []

    def _open_all(self, direct: bool | None) -> bool:
        if direct is True and not O_DIRECT:
            raise HssError("O_DIRECT is not available on this platform; pass direct=False or None")
        use = direct is not False and O_DIRECT != 0
        for layer in range(self.num_layers):
            fd = self._open(layer, use, direct)
            if fd is None:          # auto: the filesystem refused O_DIRECT; open every layer buffered
                self._files.close()
                return self._open_all(False)
            self._files.fds.append(fd)
        return use

    def _open(self, layer: int, use_direct: bool, asked: bool | None) -> int | None:
        path = layer_path(self.dir, layer)
        flags = os.O_RDWR | os.O_CREAT | (O_DIRECT if use_direct else 0)
        existed = path.exists()
        if existed and not path.is_file():
            self._not_a_file(path, layer)
        try:
            fd = os.open(path, flags, 0o644)
        except OSError as exc:
            if use_direct and exc.errno == errno.EINVAL:
                return self._refused(path, exc, asked)
            raise self._setup_error(exc, "open", path, layer) from exc
        if not existed and path not in self._created:
            self._created.append(path)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):     # (replaced since the check above)
                self._not_a_file(path, layer)
            self._preallocate(fd, path, layer)
            if use_direct:     # some filesystems accept the flag at open and refuse the I/O
                probe = mmap.mmap(-1, 4096)
                try:
                    os.preadv(fd, [probe], 0)
                finally:
                    probe.close()
        except OSError as exc:
            os.close(fd)
            if use_direct and exc.errno == errno.EINVAL:
                return self._refused(path, exc, asked)
            if exc.__cause__ is not None:
                raise                       # already named by _preallocate
            raise self._setup_error(exc, "read", path, layer) from exc
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _not_a_file(self, path: Path, layer: int) -> None:
        raise HssError(f"FileStore: layer {layer}'s file {path} exists but is {_what_is(path)}, not a regular file: "
                       "remove it, or put the store in another directory (HighSpeedSwapConfig.dir)")

    def _refused(self, path: Path, exc: OSError, asked: bool | None) -> None:
        if asked is True:
            raise HssError(f"the filesystem holding {path} refuses O_DIRECT ({exc.strerror}); pass direct=False "
                           "(buffered I/O) or direct=None (O_DIRECT where possible)") from exc
        return None

    def _preallocate(self, fd: int, path: Path, layer: int) -> None:
        need = self.layout.bytes_per_layer
        if os.fstat(fd).st_size >= need:
            return
        try:
            try:
                os.posix_fallocate(fd, 0, need)
            except (OSError, AttributeError) as exc:   # e.g. EOPNOTSUPP: the filesystem cannot preallocate
                if isinstance(exc, OSError) and exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                    raise
                os.ftruncate(fd, need)
        except OSError as exc:
            raise self._setup_error(exc, f"preallocate {need} bytes for", path, layer) from exc

    # -- writes ----------------------------------------------------------------------------------
    def _write(self, layer: int, page: int, offset_in_page: int, data: np.ndarray) -> None:
        self._drain()                  # no read (ahead) of the old bytes may still be running
        fd = self._fds[layer]
        off = page * self.layout.block_bytes + offset_in_page
        n = data.nbytes
        if self.direct:
            self._stage[:n] = data.tobytes()
            src = memoryview(self._stage)
        else:
            src = memoryview(np.ascontiguousarray(data).reshape(-1).view(np.uint8))
        done = 0
        chunk: memoryview | None = None
        try:
            while done < n:
                chunk = src[done:n]
                w = os.pwrite(fd, chunk, off + done)
                chunk.release()
                if w <= 0:
                    raise OSError(errno.EIO, "pwrite wrote nothing")
                done += w
        except OSError as exc:
            kind, kh = self.layout.locate(offset_in_page + done)
            raise StoreIOError(layer, page, kind, kh, f"write failed after {done} of {n} bytes at offset {off} "
                               f"of {self.path(layer)}: {exc.strerror or exc}", exc.errno) from exc
        finally:       # (a traceback may keep the views: released, the staging buffer can still be closed)
            if chunk is not None:
                chunk.release()
            src.release()

    def _read_back(self, layer: int, page: int, offset: int, nbytes: int) -> np.ndarray | None:
        fd = self._fds[layer]
        off = page * self.layout.block_bytes + offset
        got = 0
        whole = memoryview(self._back)
        chunk: memoryview | None = None
        try:
            while got < nbytes:
                chunk = whole[got:nbytes]
                r = os.preadv(fd, [chunk], off + got)
                chunk.release()
                if r <= 0 or (self.direct and got + r < nbytes):   # (O_DIRECT: short only at the end of the file)
                    return None
                got += r
        except OSError:
            return None
        finally:       # (released as in _write)
            if chunk is not None:
                chunk.release()
            whole.release()
        return np.frombuffer(self._back, np.uint8, nbytes).copy()

    # -- reads -----------------------------------------------------------------------------------
    def _prepared(self, reads: PreparedReads, slots: tuple[cm.PointerTable, np.ndarray] | None,
                  gather_min_runs: int | None = None) -> None:
        # every transfer's destination range against the live hss buffers, at once (HostStore's batch does this)
        if slots is None:
            first = reads.run_starts
            _args.RANGES.check_many(reads.dsts[first], reads.run_counts * self.layout.block_bytes, "dsts")

    def _issue(self, reads: PreparedReads, group: int, stream: int) -> None:
        layer, pages, dsts = reads.layer, reads.pages, reads.dsts
        r0, r1 = reads.run_bounds[group], reads.run_bounds[group + 1]
        ahead = self._claim(reads, group)
        if ahead is not None:            # the first window of this group is being read already
            done = r0 + len(ahead.window) == r1
            if done:
                self._read_ahead(reads, group + 1, ahead.w_start)
            self._finish(ahead.pending, stream, dsts, ahead.window, ahead.w_start)
            if done:
                return
            r0 += len(ahead.window)
        window: list[tuple[int, int, int]] = []     # (request start, count, bounce page)
        w_start = 0
        for s, n in zip(reads.run_starts[r0:r1].tolist(), reads.run_counts[r0:r1].tolist()):
            h = self._head
            if h % self.ring + n > self.ring:        # a run needs contiguous bounce memory
                h += self.ring - h % self.ring
            if window and h + n - self.ring > w_start:
                self._finish(self._start(layer, pages, window), stream, dsts, window, w_start)
                window = []
            self._reuse(h + n - self.ring)
            if not window:
                w_start = h
            window.append((s, n, h % self.ring))
            self._head = h + n
        if window:
            pending = self._start(layer, pages, window)
            self._read_ahead(reads, group + 1, w_start)   # the next group's reads queue behind this window's
            self._finish(pending, stream, dsts, window, w_start)

    def _reuse(self, below: int) -> None:
        """Wait until the copies out of every bounce page before absolute page ``below`` have run."""
        while self._inflight and self._inflight[0][0] < below:
            _, ev = self._inflight.popleft()
            ev.synchronize()                      # its copies out of these bounce pages have run
            self._spare.append(ev)

    def _start(self, layer: int, pages: np.ndarray, window: list[tuple[int, int, int]]) -> list:
        """Start the preads of a window's runs: futures on the thread pool (qd > 1), else their results now."""
        jobs = [(layer, int(pages[s]), n, b) for s, n, b in window]
        if self.qd > 1:
            files = self._files
            if files.executor is None:
                files.executor = ThreadPoolExecutor(self.qd, thread_name_prefix="hss-filestore")
            futures = [files.executor.submit(self._pread, *j) for j in jobs]
            self._outstanding += futures
            return futures
        return [self._pread(*j) for j in jobs]

    def _finish(self, pending: list, stream: int, dsts: np.ndarray, window: list[tuple[int, int, int]],
                w_start: int) -> None:
        """Wait for a window's preads, raise the first error, else queue its H2D copies and one event."""
        results = [p.result() if isinstance(p, Future) else p for p in pending]
        if pending and isinstance(pending[0], Future):
            done = set(map(id, pending))
            self._outstanding = [f for f in self._outstanding if id(f) not in done]
        for err in results:
            if err is not None:
                raise err
        bb = self.layout.block_bytes
        for s, n, b in window:
            cm.copy_h_to_d_async(int(dsts[s]), self.bounce.ptr + b * bb, n * bb, stream)
        ev = self._spare.pop() if self._spare else cm.CudaEvent(ctx=self._ctx)
        ev.record(stream)
        self._inflight.append((w_start, ev))

    # -- read-ahead: while a group's last window is read, the next group's first window is started too, so the disk
    # never waits for the host between the groups of a step (the next issue() of the same PreparedReads claims it)
    def _read_ahead(self, reads: PreparedReads, group: int, busy_from: int) -> None:
        """Start the first window of ``reads``' group ``group`` (qd > 1), in bounce pages that neither the unfinished
        window from absolute page ``busy_from`` nor a queued copy still needs."""
        if self.qd <= 1 or group >= len(reads) or self._ahead is not None:
            return
        r0, r1 = reads.run_bounds[group], reads.run_bounds[group + 1]
        window: list[tuple[int, int, int]] = []
        head, w_start = self._head, 0
        for s, n in zip(reads.run_starts[r0:r1].tolist(), reads.run_counts[r0:r1].tolist()):
            h = head
            if h % self.ring + n > self.ring:
                h += self.ring - h % self.ring
            if h + n - self.ring > busy_from or (window and h + n - self.ring > w_start):
                break                              # it would overwrite pages still being read
            self._reuse(h + n - self.ring)
            if not window:
                w_start = h
            window.append((s, n, h % self.ring))
            head = h + n
        if window:
            self._head = head
            self._ahead = _Ahead(reads, group, window, w_start, self._start(reads.layer, reads.pages, window),
                                 self._epoch)

    def _claim(self, reads: PreparedReads, group: int) -> _Ahead | None:
        """The read-ahead of this group, if that is what was started; any other is waited for and dropped (its bounce
        pages were never copied from), as is any read a failed or interrupted issue left running."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead.reads is reads and ahead.group == group and ahead.epoch == self._epoch:
            mine = set(map(id, ahead.pending))
            self._drain(keep=mine)
            return ahead
        self._drain()
        return None

    def _drain(self, keep: set[int] | None = None) -> None:
        """Wait for the preads still running (but those in ``keep``); their results are dropped."""
        if self._ahead is not None:
            ahead, self._ahead = self._ahead, None
            for f in ahead.pending:
                f.result()
        left = []
        for f in self._outstanding:
            if keep is not None and id(f) in keep:
                left.append(f)
            else:
                try:
                    f.result()
                except BaseException:   # noqa: BLE001 (a dropped read: nothing waits for it)
                    pass
        self._outstanding = left

    def _pread(self, layer: int, page: int, n: int, bounce_page: int) -> StoreIOError | None:
        """Read n pages starting at ``page`` into the bounce ring; returns the error instead of raising."""
        bb = self.layout.block_bytes
        want = n * bb
        off = page * bb
        view = memoryview(self.bounce.array)[bounce_page * bb: bounce_page * bb + want]
        got = 0
        try:
            while got < want:
                r = os.preadv(self._fds[layer], [view[got:]], off + got)
                if r <= 0:
                    break
                got += r
                if self.direct:
                    break                 # O_DIRECT: a short read is at end of file; do not retry unaligned
        except OSError as exc:
            p, kind, kh = self._where(page, got)
            return StoreIOError(layer, p, kind, kh, f"read failed after {got} of {want} bytes at offset {off} of "
                                f"{self.path(layer)}: {exc.strerror or exc}", exc.errno)
        if got < want:
            p, kind, kh = self._where(page, got)
            size = os.fstat(self._fds[layer]).st_size
            return StoreIOError(layer, p, kind, kh, f"short read: got {got} of {want} bytes at offset {off} of "
                                f"{self.path(layer)}, which ends at {size} bytes but its layout needs "
                                f"{self.layout.bytes_per_layer} (truncated?)")
        return None

    def _where(self, first_page: int, got: int) -> tuple[int, int, int]:
        bb = self.layout.block_bytes
        kind, kh = self.layout.locate(got % bb)
        return first_page + got // bb, kind, kh

    # -- lifetime --------------------------------------------------------------------------------
    def _close_files(self) -> None:
        self._files.close()

    def close(self) -> None:
        """Wait for queued copies out of the bounce ring, free it and close the files; later calls do nothing."""
        if self._closed:
            return
        self._closed = True
        self._finalizer.detach()
        try:
            self._drain()
            while self._inflight:
                ev = self._inflight.popleft()[1]
                ev.synchronize()
                self._spare.append(ev)
        finally:
            for ev in self._spare + [e for _, e in self._inflight]:
                ev.close()
            self._files.close()
            self.bounce.close()
            self._stage.close()
            self._back.close()
