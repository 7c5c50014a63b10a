"""The file backing store (docs/design.md §7.2): :class:`FileStore`, one preallocated file per layer, read through a
pinned bounce ring (the store interface: :mod:`hss.swap.backing`).
"""
from __future__ import annotations

import collections
import errno
import mmap
import os
import shutil
import stat
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

import numpy as np

from hss import _args
from hss import cuda_min as cm
from hss.errors import HssError, StoreIOError
from hss.swap.backing import BackingStore, PreparedReads
from hss.swap.layout import GroupLayout

__all__ = ["FileStore", "layer_path"]

O_DIRECT = getattr(os, "O_DIRECT", 0)


def layer_path(directory: str | os.PathLike, layer: int) -> Path:
    """``<dir>/layer_{layer:05}.kv`` (docs/design.md §7.2)."""
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
    """One file per layer, ``<dir>/layer_{layer:05}.kv``, preallocated to ``bytes_per_layer`` (docs/design.md §7.2).

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
