"""What one :class:`~hss.qsa.QsaIndexer` owns on its device, and the checks every entry point makes against it.

:class:`IndexerResources` is shared by the indexer and the parts that work for it (the device path, prefill
selection, snapshots): device memory from the backend (:meth:`~IndexerResources.alloc`, freed by
:meth:`~IndexerResources.release` or all at once by :meth:`~IndexerResources.free_all`), pinned staging registered
with :meth:`~IndexerResources.own`, each range labelled so that a caller's pointer into any of it is refused
(:meth:`~IndexerResources.check_caller`), and the context the indexer works in (:meth:`~IndexerResources.stream`
refuses another context's streams). It holds no reference to the indexer, so the indexer's finalizer may hold it.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hss import _args
from hss.cuda._context import stream_context
from hss.cuda.gpu import DevicePtr
from hss.errors import CudaError, HssError

__all__ = ["IndexerResources"]


class IndexerResources:
    """The device memory, pinned staging and context of one indexer (internal API of :mod:`hss.qsa`).

    ``gpu``: the backend the memory comes from; ``device`` / ``ctx_handle``: the ordinal and context the indexer
    works on. ``buffers``: every live allocation (the indexer's and its states'), freed by :meth:`free_all`;
    ``ranges``: those and the pinned staging, labelled; ``generation`` changes with every range added or removed
    (a cached check of caller memory holds until it changes)."""

    def __init__(self, gpu: Any, device: int, ctx_handle: Any) -> None:
        self.gpu = gpu
        self.device = device
        self.ctx_handle = ctx_handle
        self.buffers: list[DevicePtr] = []
        self.ranges = _args.OwnedRanges()
        self.generation = 0
        self._streams_ok: set[int] = set()   # streams seen to be of this context (several devices in use)

    # -- memory ---------------------------------------------------------------------------------------------
    def alloc(self, nbytes: int, label: str = "the indexer's device-decode buffers") -> DevicePtr:
        """``nbytes`` from the backend, freed by :meth:`free_all` (or :meth:`release`); ``label`` names it when a
        caller's pointer overlaps it."""
        ptr = DevicePtr(self.gpu.alloc(nbytes))
        self.buffers.append(ptr)
        self.own(int(ptr), nbytes, label)
        return ptr

    def release(self, ptr: DevicePtr) -> None:
        """Free one buffer of :meth:`alloc` early (a grown scratch's old one, a released state's keys); freed once
        even if the free fails."""
        self.buffers.remove(ptr)
        self.ranges.remove(int(ptr))
        self.generation += 1
        self.gpu.free(ptr)

    def own(self, start: int, nbytes: int, label: str) -> None:
        """Count ``nbytes`` at ``start`` (pinned staging the indexer's copies read or write) as the indexer's."""
        self.ranges.add(start, nbytes, label)
        self.generation += 1

    def free_all(self, raising: bool = False) -> None:
        """Free every buffer of :meth:`alloc` (emptying ``buffers``) and forget every range. Attempts every free;
        ``raising``: raise the first error."""
        first: BaseException | None = None
        buffers = self.buffers
        while buffers:
            ptr = buffers.pop()
            try:
                self.gpu.free(ptr)
            except Exception as exc:   # keep freeing the rest
                first = first or exc
        self.ranges.clear()
        if raising and first is not None:
            raise first

    # -- the checks every entry point makes of caller memory and streams, before any device work -------------
    def check_caller(self, what: str, ranges: tuple[tuple[str, int, int, bool], ...]) -> None:
        """The caller memory of one call, each ``(name, address, bytes, written)``: none may overlap memory this
        indexer owns (its scratch, tables, pinned staging, the sequences' keys), and no written one another argument
        of the call (:func:`hss._args.disjoint`). A pool read through page ids spans :func:`hss._args.extent`."""
        mine, wrote = self.ranges, False
        for name, p, n, w in ranges:
            try:
                mine.check(p, n, name, "this QsaIndexer")
            except HssError as exc:
                raise HssError(f"QsaIndexer.{what}: {exc}") from None
            wrote = wrote or w
        if wrote:
            _args.disjoint(f"QsaIndexer.{what}", *ranges)

    def stream(self, stream: Any, what: str) -> int:
        """The raw handle of a stream argument, refused when it is a stream of another context than this indexer's
        (its memory and kernels live there); a stream that passed once passes at once later."""
        s = stream if type(stream) is int and stream >= 0 else _args.stream(stream)
        if _args.DEVICES.many and s not in self._streams_ok:
            self._check_stream(s, what)
        return s

    def _check_stream(self, s: int, what: str) -> None:
        """Raise unless raw stream ``s`` is of this indexer's context (remembered once it is)."""
        if s in (0, 1, 2):   # the legacy and per-thread default streams: the current context's, this indexer's
            return
        try:
            handle, owner = stream_context(s)
        except CudaError as exc:
            raise HssError(f"QsaIndexer.{what}: stream {s:#x} is not a live stream ({exc.name}); pass a stream of "
                           f"device {self.device}") from None
        if handle != self.ctx_handle:
            where = f"device {owner.ordinal}" if owner is not None else "another context"
            raise HssError(f"QsaIndexer.{what}: stream {s:#x} belongs to {where}, but this indexer works on device "
                           f"{self.device}; pass a stream of device {self.device}")
        self._streams_ok.add(s)

    def pointer_arg(self, name: str, nbytes: int | None, align: int = 1, dtype: str | None = None,
                    write: bool = False, what: str = "") -> Callable[..., int]:
        """:func:`hss._args.pointer_arg` on this indexer's device (it refuses other devices' memory)."""
        return _args.pointer_arg(name, nbytes, align, dtype, write, what, device=self.device)
