"""The interface of the backing stores for KV pages (docs/design.md §7.1-7.3): :class:`BackingStore` and the reads it
plans, :class:`PreparedReads`. The stores themselves: :class:`~hss.swap.stores.HostStore` (pinned host memory) and
:class:`~hss.swap.file_store.FileStore` (one preallocated file per layer).

Every store keeps every layer in the :class:`~hss.swap.layout.GroupLayout` page layout, so a page is one
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

The unchecked ``*_planned`` calls, :meth:`BackingStore.plan_reads`, :meth:`~BackingStore.read_mark` /
:meth:`~BackingStore.reads_ran`, :attr:`~BackingStore.epoch` and :attr:`~BackingStore.owned_memory` are internal API
of the swap (:mod:`hss.swap.orchestrator`, :mod:`hss.swap.step`): values it checked or planned itself.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from hss import _args
from hss import cuda_min as cm
from hss._util import Closeable
from hss.errors import HssError, StoreError, StoreIOError
from hss.swap._checks import StreamCheck
from hss.swap.layout import GroupLayout, host_bytes

if TYPE_CHECKING:
    from hss.swap.stores import _Gathered

__all__ = ["BackingStore", "PreparedReads", "StoreError", "StoreIOError"]


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

    def more_runs(self, i: int, n: int) -> bool:
        """Whether group i's reads are more than ``n`` transfers (``run_bounds[i + 1] - run_bounds[i] > n``), found
        without listing the runs where it can be. Internal API: the HostStore's choice of ``page_gather``."""
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


class BackingStore(Closeable):
    """Pages of ``num_layers`` layers in ``layout``; subclasses move the bytes.

    ``write_page(layer, page, image)`` / ``write_group(layer, page, kind, kv_head, data)``: synchronous host
    writes, all or nothing (see the module docstring). ``read_pages(stream, layer, pages, dsts)``: queue pages[i]
    -> device dsts[i] on ``stream``; ``prepare_reads(layer, pages, dsts, bounds)``: the same, checked and planned
    once for many groups. ``ctx``: the context the store works in (None: the current one); its streams must be that
    context's. A subclass moves the bytes (``_write``, ``_read_back``, ``_issue``) and registers the memory it owns
    in :attr:`owned_memory` (an :class:`hss._args.OwnedRanges`), which no read may write into.
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

    @property
    def owned_memory(self) -> _args.OwnedRanges:
        """The memory this store owns (its pinned pages, bounce ring, gather index ring: no read may write into it).
        Internal API: the swap refuses a caller's pointer into it."""
        return self._memory

    @property
    def epoch(self) -> int:
        """A count bumped whenever a page may stop being readable (every write and invalidation). Internal API: the swap
        step keeps the pages it found readable until it changes."""
        return self._epoch

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

    def missing_planned(self, layer: int, pages: np.ndarray) -> np.ndarray:
        """:meth:`missing_pages` of values the caller checked (``layer`` in range; ``pages`` int64, in range). Internal
        API: the swap step's check that every page it reads was offloaded."""
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

    def write_planned(self, layer: int, page: int, image: np.ndarray) -> _Saved:
        """:meth:`write_page` of values the caller checked (``layer``, ``page`` in range; ``image`` one page's uint8
        bytes, :meth:`GroupLayout.pack_page`); returns what :meth:`undo_write` needs to put the old bytes back.
        Internal API: the swap's offload, which undoes the write when its projection fails."""
        return self._put(layer, page, 0, image, slice(None))

    def _put(self, layer: int, page: int, offset: int, data: np.ndarray, groups: slice) -> _Saved:
        """Write ``data`` at ``offset`` of (layer, page), which covers the groups ``groups`` of the page (values the
        caller checked), all or nothing; returns what :meth:`undo_write` needs to put the old bytes back."""
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

    def undo_write(self, saved: _Saved) -> None:
        """Put back what :meth:`write_planned` replaced (its caller's next step failed): the old bytes and validity of
        the groups it covered. Raises :class:`StoreIOError` if the old bytes cannot be put back (those groups are then
        unreadable). Internal API: the swap's offload."""
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
        return self.plan_reads(layer, pages, dsts, b, edges)

    def plan_reads(self, layer: int, pages: np.ndarray, dsts: np.ndarray, bounds: np.ndarray, edges: list[int],
                   slots: tuple[cm.PointerTable, np.ndarray] | None = None,
                   gather_min_runs: int | None = None) -> PreparedReads:
        """:meth:`prepare_reads` of values the caller checked or computed: ``pages`` (int64, our own) readable pages
        of ``layer``; ``dsts`` (int64, our own) into live hss memory with room for a page each; ``bounds`` (int64)
        and ``edges`` (the same as a list) non-decreasing in 0..len(pages). ``slots``: every destination is a slot
        of the swap's scratch pool, ``dsts[i]`` entry ``slots[1][i]`` of its pointer table ``slots[0]`` (then the
        planned runs need no range check; ``slots[1]``, our own too, is kept like the pages). ``gather_min_runs``: a
        HostStore reads those groups (into pool slots) of more runs than this or its own
        :attr:`HostStore.gather_min_runs`, the smaller, with ``page_gather`` (a sparse swap step's scattered misses).
        Internal API: the swap step plans its tiles' reads with it."""
        reads = PreparedReads(self, layer, pages, dsts, edges, bounds)
        self._prepared(reads, slots, gather_min_runs)
        return reads

    def _plan_reads(self, *args: Any, **kw: Any) -> PreparedReads:
        """:meth:`plan_reads` under the name :mod:`hss.bench.swap` still uses."""
        return self.plan_reads(*args, **kw)

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
        """Register memory the store owns (no read may write into it; :attr:`owned_memory` for its users' checks)."""
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
        :meth:`plan_reads`)."""

    def _issue(self, reads: PreparedReads, group: int, stream: int) -> None:
        raise NotImplementedError

    def read_mark(self) -> Any:
        """A mark of the reads issued so far (None where the store keeps no fences): pass it to :meth:`reads_ran`
        once work ordered after the last of them (on their stream) has completed. Internal API: the swap step, whose
        score wait covers the reads of the steps before it."""
        return None

    def reads_ran(self, mark: Any) -> None:
        """The reads up to ``mark`` (:meth:`read_mark`; None: nothing known) have run: later reads and writes need
        not wait for them. Internal API: the swap step."""

    def _live(self) -> None:
        if self._closed:
            raise HssError(f"this {type(self).__name__} is closed")

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        self._closed = True
