"""Tests for hss.swap.stores (docs/design.md §7.1-7.3): file layout at the design's offsets, O_DIRECT and buffered
paths, reads into device memory (runs, bounce-ring reuse, a thread pool), the validity bitmap, short reads and I/O
errors naming layer / page / kind, and the host store's write-after-queued-read guard.
"""
from __future__ import annotations

import errno
import os

import numpy as np
import pytest

from hss import cuda_min as cm
from hss.cuda import _driver, _memory
from hss.cuda._driver import HssError
from hss.swap import FileStore, GroupLayout, HostStore, StoreError, StoreIOError, layer_path

from helpers import BF16, download

LAYOUT = GroupLayout(num_blocks=12, num_kv_heads=2, block_size=8, head_dim=64)   # 1 KiB stripes padded to 4 KiB
LAYERS = 2


def images(rng: np.random.Generator, n: int, layout: GroupLayout = LAYOUT) -> list[np.ndarray]:
    shape = (layout.block_size, layout.num_kv_heads, layout.head_dim)
    return [layout.pack_page(rng.standard_normal(shape).astype(np.float32).astype(BF16),
                             rng.standard_normal(shape).astype(np.float32).astype(BF16)) for _ in range(n)]


def make(kind: str, tmp_path, ctx, **kw):
    if kind == "host":
        return HostStore(LAYOUT, LAYERS, ctx=ctx)
    return FileStore(tmp_path / "kv", LAYOUT, LAYERS, ctx=ctx, **kw)


STORES = [("host", {}), ("file", dict(direct=True)), ("file", dict(direct=False)),
          ("file", dict(direct=None, qd=4, bounce_pages=3)), ("file", dict(direct=False, bounce_pages=2, qd=2))]
IDS = ["host", "file-direct", "file-buffered", "file-auto-qd4-ring3", "file-buffered-ring2"]


def read_back(store, stream, layer: int, pages: list[int], order: list[int] | None = None) -> np.ndarray:
    """Read ``pages`` into slots ``order`` (default 0..n-1) of a poisoned device buffer; return all slots."""
    bb = store.layout.block_bytes
    n = len(pages)
    order = list(range(n)) if order is None else order
    dev = cm.DeviceBuffer(bb * max(order + [0]) + bb)
    cm.memset_d8_async(dev, 0xAB, dev.bytes, stream)
    got = store.read_pages(stream, layer, pages, [dev.ptr + bb * o for o in order])
    assert got == n * bb
    out = download(dev, (dev.bytes // bb, bb), np.uint8, stream)
    dev.close()
    return out


@pytest.mark.parametrize("kind,kw", STORES, ids=IDS)
def test_round_trip_into_device(ctx, stream, rng, tmp_path, kind: str, kw: dict) -> None:
    imgs = images(rng, 2 * 12)
    with make(kind, tmp_path, ctx, **kw) as store:
        for layer in range(LAYERS):
            for page in range(12):
                store.write_page(layer, page, imgs[layer * 12 + page])
        pages = [3, 4, 5, 6, 0, 11, 10, 7, 8, 9]        # runs, a backward step, more pages than any bounce ring
        out = read_back(store, stream, 1, pages)
        for i, p in enumerate(pages):
            assert np.array_equal(out[i], imgs[12 + p]), f"slot {i} (page {p})"
        out = read_back(store, stream, 0, [2, 3, 4], order=[4, 0, 1])   # consecutive pages, scattered slots
        assert [np.array_equal(out[o], imgs[p]) for o, p in ((4, 2), (0, 3), (1, 4))] == [True] * 3
        assert (out[2:4] == 0xAB).all(), "slots that were not read must keep their poison"
        for _ in range(3):                               # the ring is reused across calls
            out = read_back(store, stream, 0, [1, 0])
            assert np.array_equal(out[0], imgs[1]) and np.array_equal(out[1], imgs[0])
        assert store.read_pages(stream, 0, [], []) == 0


@pytest.mark.parametrize("direct", [True, False])
def test_file_layout_at_spec_offsets(ctx, stream, rng, tmp_path, direct: bool) -> None:
    g = GroupLayout(num_blocks=5, num_kv_heads=3, block_size=16, head_dim=128)    # 4 KiB stripes, no padding
    shape = (16, 3, 128)
    k = rng.standard_normal(shape).astype(np.float32).astype(BF16)
    v = rng.standard_normal(shape).astype(np.float32).astype(BF16)
    with FileStore(tmp_path, g, 3, direct=direct, ctx=ctx) as store:
        assert store.direct is direct
        for layer in range(3):
            path = layer_path(tmp_path, layer)
            assert path.name == f"layer_{layer:05}.kv" and store.path(layer) == path
            assert path.stat().st_size == g.bytes_per_layer == 2 * 5 * 3 * 4096        # preallocated
        store.write_page(2, 3, g.pack_page(k, v))
        group = b"\x5a" * g.group_bytes
        store.write_group(1, 4, 1, 2, group)
    raw = layer_path(tmp_path, 2).read_bytes()
    for kind, src in ((0, k), (1, v)):
        for h in range(3):
            at = 3 * (2 * 3 * 4096) + kind * (3 * 4096) + h * 4096                    # docs/design.md §7.1
            assert raw[at:at + 4096] == np.ascontiguousarray(src[:, h, :]).tobytes()
    raw1 = layer_path(tmp_path, 1).read_bytes()
    at = g.group_offset(4, 1, 2)
    assert at == 4 * 24576 + 12288 + 8192 and raw1[at:at + 4096] == group


def test_direct_auto_falls_back_when_the_filesystem_refuses(ctx, stream, rng, tmp_path, monkeypatch) -> None:
    real_open = os.open

    def no_direct(path, flags, *a):
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *a)

    monkeypatch.setattr(os, "open", no_direct)
    with pytest.raises(HssError, match=r"refuses O_DIRECT \(Invalid argument\); pass direct=False"):
        FileStore(tmp_path / "a", LAYOUT, 2, direct=True, ctx=ctx)
    with FileStore(tmp_path / "b", LAYOUT, 2, ctx=ctx) as store:
        assert store.direct is False
        img = images(rng, 1)[0]
        store.write_page(1, 5, img)
        assert np.array_equal(read_back(store, stream, 1, [5])[0], img)
    monkeypatch.undo()
    real_preadv = os.preadv

    def probe_refused(fd, bufs, offset):                 # accepted at open, refused at the first read
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(os, "preadv", probe_refused)
    store = FileStore(tmp_path / "c", LAYOUT, 1, ctx=ctx)
    monkeypatch.setattr(os, "preadv", real_preadv)
    assert store.direct is False
    store.close()


def test_validity_bitmap(ctx, stream, rng, tmp_path, monkeypatch) -> None:
    img = images(rng, 1)[0]
    with FileStore(tmp_path, LAYOUT, LAYERS, direct=False, ctx=ctx) as store:
        sink = cm.DeviceBuffer(LAYOUT.block_bytes)
        with pytest.raises(StoreError, match=r"layer 0 pages \[3\] were never written"):
            store.read_pages(stream, 0, [3], [sink.ptr])
        g = LAYOUT.group_bytes
        for kind in (0, 1):
            for h in range(2):
                assert not store.page_valid(0, 3)
                at = LAYOUT.group_offset(0, kind, h)
                store.write_group(0, 3, kind, h, img[at:at + g])
        assert store.page_valid(0, 3) and store.missing_pages(0, [3, 4]).tolist() == [4]
        assert np.array_equal(read_back(store, stream, 0, [3])[0], img)

        def failing(fd, data, offset):
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(os, "pwrite", failing)
        with pytest.raises(StoreIOError, match=r"layer 0 page 3 \(K stripe of kv_head 0\): write failed after 0 of "
                                               r"16384 bytes .*No space left") as info:
            store.write_page(0, 3, img)
        assert info.value.errno == errno.ENOSPC and (info.value.layer, info.value.page) == (0, 3)
        assert not store.page_valid(0, 3), "a failed write must not leave the page readable"
        with pytest.raises(StoreIOError, match=r"page 3 \(V stripe of kv_head 1\): write failed"):
            store.write_group(0, 3, 1, 1, b"\0" * g)
        monkeypatch.undo()
        real_pwrite, calls = os.pwrite, []

        def partial(fd, data, off):                    # 5000 bytes land, then the device fills up
            calls.append(off)
            if len(calls) > 1:
                raise OSError(errno.ENOSPC, "No space left on device")
            return real_pwrite(fd, bytes(data)[:5000], off)

        monkeypatch.setattr(os, "pwrite", partial)
        with pytest.raises(StoreIOError, match=r"layer 1 page 2 \(K stripe of kv_head 1\): write failed after 5000 of "
                                               r"16384 bytes"):
            store.write_page(1, 2, img)
        assert calls == [2 * 16384, 2 * 16384 + 5000] and not store.page_valid(1, 2)
        monkeypatch.undo()
        store.write_page(0, 3, img)
        assert store.page_valid(0, 3)
        store.invalidate_page(0, 3)
        assert not store.page_valid(0, 3)
        store.write_page(0, 3, img)
        store.write_page(1, 3, img)
        store.invalidate_block(3)
        assert not store.page_valid(0, 3) and not store.page_valid(1, 3)
        sink.close()


@pytest.mark.parametrize("kind", ["host", "file"])
def test_write_and_read_argument_errors(ctx, stream, tmp_path, kind: str) -> None:
    store = make(kind, tmp_path, ctx)
    img = np.zeros(LAYOUT.block_bytes, np.uint8)
    sink = cm.DeviceBuffer(2 * LAYOUT.block_bytes)
    for call, err, words in [
        (lambda: store.write_page(0, 0, img[:-1]), StoreError,
         r"a page image is block_bytes = .* = 16384 bytes, got 16383"),
        (lambda: store.write_page(2, 0, img), StoreError, "layer 2 is out of range: this store has 2 layers"),
        (lambda: store.write_page(0, 12, img), StoreError, r"page 12 is out of range 0..11"),
        (lambda: store.write_group(0, 0, 0, 0, b"\0" * 4096), StoreError, "a group is .* = 1024 bytes, got 4096"),
        (lambda: store.write_group(0, 0, 2, 0, b"\0" * 1024), HssError, "kind 2 must be 0"),
        (lambda: store.read_pages(stream, 0, [0, 1], [sink.ptr]), HssError, "2 pages but 1 destinations"),
        (lambda: store.read_pages(stream, 0, [0.5], [0]), TypeError, "pages must be integers"),
        (lambda: store.read_pages(stream, -1, [0], [0]), StoreError, "layer -1 is out of range")]:
        with pytest.raises(err, match=words):
            call()
    sink.close()
    store.close()
    store.close()
    with pytest.raises(HssError, match=f"this {type(store).__name__} is closed"):
        store.write_page(0, 0, img)
    if kind == "file":
        with pytest.raises(HssError, match=r"qd \(65\) must be in 1..64"):
            FileStore(tmp_path, LAYOUT, 1, qd=65)
        with pytest.raises(TypeError, match="direct must be None"):
            FileStore(tmp_path, LAYOUT, 1, direct="yes")


@pytest.mark.parametrize("direct", [True, False])
@pytest.mark.parametrize("cut,page,what", [(3 * 16384 + 8192 + 100, 3, r"V stripe of kv_head 0"),
                                           (3 * 16384 + 4096, 3, r"K stripe of kv_head 1"),
                                           (2 * 16384, 2, r"K stripe of kv_head 0")])
def test_short_read_names_layer_page_and_kind(ctx, stream, rng, tmp_path, direct: bool, cut: int, page: int,
                                              what: str) -> None:
    imgs = images(rng, 5)
    with FileStore(tmp_path, LAYOUT, LAYERS, direct=direct, ctx=ctx) as store:
        for p in range(5):
            store.write_page(1, p, imgs[p])
        os.truncate(layer_path(tmp_path, 1), cut)
        assert np.array_equal(read_back(store, stream, 1, [1])[0], imgs[1])            # before the cut: fine
        bb = LAYOUT.block_bytes
        sink = cm.DeviceBuffer(5 * bb)
        with pytest.raises(StoreIOError, match=rf"layer 1 page {page} \({what}\): short read: got \d+ of \d+ bytes "
                                               rf"at offset \d+ of .*layer_00001.kv, which ends at {cut} bytes but "
                                               rf"its layout needs {LAYOUT.bytes_per_layer} \(truncated\?\)") as info:
            store.read_pages(stream, 1, [0, 1, 2, 3, 4], [sink.ptr + i * bb for i in range(5)])
        sink.close()
        assert info.value.layer == 1 and info.value.page == page and info.value.kind == what[0]


def test_io_error_names_layer_page_and_kind(ctx, stream, rng, tmp_path, monkeypatch) -> None:
    with FileStore(tmp_path, LAYOUT, LAYERS, direct=False, qd=3, ctx=ctx) as store:
        for p in range(4):
            store.write_page(0, p, images(rng, 1)[0])

        def eio(fd, bufs, offset):
            raise OSError(errno.EIO, "Input/output error")

        monkeypatch.setattr(os, "preadv", eio)
        sink = cm.DeviceBuffer(2 * LAYOUT.block_bytes)
        with pytest.raises(StoreIOError, match=r"layer 0 page 2 \(K stripe of kv_head 0\): read failed after 0 of "
                                               r"16384 bytes at offset 32768 .*Input/output error") as info:
            store.read_pages(stream, 0, [2], [sink.ptr])
        assert info.value.errno == errno.EIO
        with pytest.raises(StoreIOError, match="layer 0 page 0"):
            store.read_pages(stream, 0, [0, 2], [sink.ptr, sink.ptr + LAYOUT.block_bytes])   # two runs, thread pool
        sink.close()


def test_host_store_layout_and_write_after_queued_read(ctx, stream, rng) -> None:
    """A write waits for queued copies out of the bytes it replaces: the device sees the OLD page (on the
    emulator the copy only runs when something waits for it, so a missing guard shows)."""
    old, new = images(rng, 2)
    with HostStore(LAYOUT, LAYERS, ctx=ctx) as store:
        assert store.buffer.bytes == LAYERS * LAYOUT.bytes_per_layer and store.kind == "host"
        store.write_page(1, 7, old)
        at = store.offset(1, 7)
        assert at == LAYOUT.bytes_per_layer + 7 * LAYOUT.block_bytes
        assert np.array_equal(store.buffer.array[at:at + LAYOUT.block_bytes], old)
        dev = cm.DeviceBuffer(LAYOUT.block_bytes)
        store.read_pages(stream, 1, [7], [dev.ptr])
        store.write_page(1, 7, new)
        assert np.array_equal(download(dev, LAYOUT.block_bytes, np.uint8, stream), old)
        assert np.array_equal(store.buffer.array[at:at + LAYOUT.block_bytes], new)
        dev.close()


@pytest.mark.parametrize("kind,kw", STORES, ids=IDS)
def test_prepared_reads_equal_read_pages(ctx, stream, rng, tmp_path, kind: str, kw: dict) -> None:
    """Groups issued in any order land exactly where read_pages puts the same requests."""
    imgs = images(rng, 12)
    bb = LAYOUT.block_bytes
    with make(kind, tmp_path, ctx, **kw) as store:
        for page in range(12):
            store.write_page(1, page, imgs[page])
        pages = [3, 4, 5, 6, 7, 0, 11, 10, 1, 2, 8, 9]
        slots = [0, 1, 2, 3, 4, 6, 5, 8, 9, 10, 11, 7]      # consecutive pages into scattered slots too
        bounds = [0, 2, 2, 7, 11, 12]                        # an empty group, edges inside runs
        want = read_back(store, stream, 1, pages, slots)
        dev = cm.DeviceBuffer(12 * bb)
        cm.memset_d8_async(dev, 0xAB, dev.bytes, stream)
        reads = store.prepare_reads(1, pages, [dev.ptr + bb * o for o in slots], bounds)
        assert len(reads) == 5 and [reads.nbytes(i) for i in range(5)] == [2 * bb, 0, 5 * bb, 4 * bb, bb]
        assert [reads.issue(i, stream) for i in (3, 1, 0, 4, 2)] == [4 * bb, 0, 2 * bb, bb, 5 * bb]
        got = download(dev, (12, bb), np.uint8, stream)
        assert np.array_equal(got, want)
        assert all(np.array_equal(got[o], imgs[p]) for p, o in zip(pages, slots))
        dev.close()
        assert len(store.prepare_reads(0, [], [], [0, 0])) == 1 and len(store.prepare_reads(0, [], [], [])) == 0


def test_prepared_runs_never_cross_a_group_edge(ctx, stream, rng, tmp_path, monkeypatch) -> None:
    """One vectorized plan: runs break where a page or a destination is not consecutive, at every group edge
    and every run_cap_pages; each group is one batched driver call of its runs."""
    bb = LAYOUT.block_bytes
    batches: list = []
    real = _driver.api.cuMemcpyBatchAsync
    monkeypatch.setattr(_driver.api, "cuMemcpyBatchAsync", lambda *a: (batches.append(list(a[2])), real(*a))[1])
    imgs = images(rng, 12)
    for cap, want_starts in [(1 << 30, [0, 3, 5, 7, 9]), (2 * bb, [0, 2, 3, 5, 7, 9, 11])]:
        with HostStore(LAYOUT, 1, ctx=ctx, run_cap_bytes=cap) as store:
            for page in range(12):
                store.write_page(0, page, imgs[page])
            dev = cm.DeviceBuffer(13 * bb)
            slots = list(range(5)) + list(range(6, 13))      # the destinations skip slot 5: a break at request 5
            reads = store.prepare_reads(0, list(range(12)), [dev.ptr + bb * o for o in slots], [0, 3, 3, 7, 9, 12])
            assert reads.run_starts.tolist() == want_starts
            assert reads.run_counts.tolist() == np.diff(want_starts + [12]).tolist()
            assert reads.run_bounds == [want_starts.index(b) if b < 12 else len(want_starts) for b in reads.bounds]
            batches.clear()
            for i in range(len(reads)):
                reads.issue(i, stream)
            per_group = [reads.run_counts[reads.run_bounds[i]:reads.run_bounds[i + 1]].tolist()
                         for i in range(len(reads))]
            if None not in _memory._batch_attrs.values():       # (a driver without batches: one call per copy)
                assert batches == [[n * bb for n in g] for g in per_group if g]
            got = download(dev, (13, bb), np.uint8, stream)
            assert all(np.array_equal(got[o], imgs[p]) for p, o in enumerate(slots))
            dev.close()


def test_host_store_batches_reuse_the_binding_pointer_objects(ctx, stream, rng, monkeypatch) -> None:
    """The batched reads of a HostStore hand the driver one CUdeviceptr object per address, made once and reused by
    later batches (not one made per copy per step); the copies land as planned."""
    bb = LAYOUT.block_bytes
    seen: list = []
    real = _driver.api.cuMemcpyBatchAsync
    monkeypatch.setattr(_driver.api, "cuMemcpyBatchAsync",
                        lambda *a: (seen.append((list(a[0]), list(a[1]))), real(*a))[1])
    imgs = images(rng, 12)
    with HostStore(LAYOUT, 1, ctx=ctx) as store:
        for page in range(12):
            store.write_page(0, page, imgs[page])
        dev = cm.DeviceBuffer(12 * bb)
        pages, slots = [5, 1, 9, 3, 7], [0, 2, 4, 6, 9]
        dsts = [dev.ptr + bb * o for o in slots]
        for _ in range(2):
            reads = store.prepare_reads(0, pages, dsts, [0, 2, 5])
            for i in range(len(reads)):
                reads.issue(i, stream)
        got = download(dev, (12, bb), np.uint8, stream)
        assert all(np.array_equal(got[o], imgs[p]) for p, o in zip(pages, slots))
        if None not in _memory._batch_attrs.values():       # (a driver without batches: one call per copy)
            assert len(seen) == 4 and [int(d) for d in seen[0][0] + seen[1][0]] == dsts
            assert [int(x) for x in seen[0][1] + seen[1][1]] == [store.buffer.ptr + p * bb for p in pages]
            first, again = seen[0][0] + seen[0][1] + seen[1][0] + seen[1][1], \
                seen[2][0] + seen[2][1] + seen[3][0] + seen[3][1]
            assert all(a is b for a, b in zip(first, again))
        dev.close()


@pytest.mark.parametrize("kind", ["host", "file"])
def test_prepare_reads_checks_everything_first(ctx, stream, rng, tmp_path, monkeypatch, kind: str) -> None:
    """Every error of a step's reads is raised by prepare_reads, before anything is queued; a group issued
    after the store changed is checked again."""
    bb = LAYOUT.block_bytes
    img = images(rng, 1)[0]
    store = make(kind, tmp_path, ctx)
    for page in (0, 1, 2, 4):
        store.write_page(0, page, img)
    queued: list = []
    for call in ("cuMemcpyBatchAsync", "cuMemcpyHtoDAsync", "cuEventRecord"):
        real = getattr(_driver.api, call)
        monkeypatch.setattr(_driver.api, call, lambda *a, _r=real, _c=call: (queued.append(_c), _r(*a))[1])
    dev = cm.DeviceBuffer(4 * bb)
    dsts = [dev.ptr + bb * i for i in range(4)]
    for args, err, words in [
        ((0, [0, 1, 3, 4], dsts, [0, 2, 4]), StoreError, r"layer 0 pages \[3\] were never written"),
        ((0, [0, 12], dsts[:2], [0, 2]), StoreError, r"pages \[12\] are out of range 0..11"),
        ((2, [0], dsts[:1], [0, 1]), StoreError, "layer 2 is out of range"),
        ((0, [0, 1], dsts[:1], [0, 2]), HssError, "2 pages but 1 destinations"),
        ((0, [0, 1], dsts[:2], [0, 3]), HssError, r"bounds \[0, 3\] must be non-decreasing request indices in 0..2"),
        ((0, [0, 1], dsts[:2], [0, 2, 1]), HssError, "non-decreasing"),
        ((0, [0, 1], dsts[:2], [0.0, 2.0]), TypeError, "bounds must be integers")]:
        with pytest.raises(err, match=words) as info:
            store.prepare_reads(*args)
    assert queued == []
    with pytest.raises(StoreError) as info:
        store.prepare_reads(0, [3, 0, 5], dsts[:3], [0, 3])
    assert info.value.pages.tolist() == [3, 5]
    if kind == "host":
        with pytest.raises(HssError, match="run past the end"):
            store.prepare_reads(0, [1, 2], [dev.ptr + 3 * bb, dev.ptr + 4 * bb], [0, 2])   # one run
        assert queued == []
    reads = store.prepare_reads(0, [0, 1, 2, 4], dsts, [0, 2, 4])
    store.invalidate_page(0, 4)
    with pytest.raises(StoreError, match=r"layer 0 pages \[4\] were never written"):
        reads.issue(1, stream)
    assert queued == []
    with pytest.raises(IndexError, match="group 2 is out of range: 2 groups"):
        reads.issue(2, stream)
    assert reads.issue(0, stream) == 2 * bb                  # its pages are still valid
    store.write_page(0, 4, img)
    assert reads.issue(1, stream) == 2 * bb
    got = download(dev, (4, bb), np.uint8, stream)
    assert all(np.array_equal(g, img) for g in got)
    store.close()
    with pytest.raises(HssError, match="is closed"):
        reads.issue(0, stream)
    dev.close()


@pytest.mark.parametrize("kind", ["host", "file"])
def test_hostile_store_arguments(ctx, stream, rng, tmp_path, monkeypatch, kind: str) -> None:
    """Writes, reads and prepared groups: a wrong type is a TypeError naming the parameter; closed, null, too
    small, host or device-instead-of-host buffers an HssError naming it; none of it reaches the device or
    changes what is valid. numpy integers are ids like any other."""
    bb = LAYOUT.block_bytes
    img = images(rng, 1)[0]
    store = make(kind, tmp_path, ctx)
    store.write_page(0, 0, img)
    sink, small, closed, gone = cm.DeviceBuffer(2 * bb), cm.DeviceBuffer(100), cm.DeviceBuffer(bb), \
        cm.PinnedBuffer(bb)
    closed.close()
    gone.close()
    reads = store.prepare_reads(0, [0], [sink.ptr], [0, 1])
    cm.stream_sync(stream)
    work: list = []
    for call in ("cuMemcpyBatchAsync", "cuMemcpyHtoDAsync", "cuEventRecord", "cuStreamWaitEvent"):
        real = getattr(_driver.api, call)
        monkeypatch.setattr(_driver.api, call, lambda *a, _r=real, _c=call: (work.append(_c), _r(*a))[1])
    group = img[:LAYOUT.group_bytes]
    for call, err, words in [
        (lambda: store.write_page(0.0, 1, img), TypeError, "layer must be an int, got float"),
        (lambda: store.write_page(0, True, img), TypeError, "page must be an int, got bool"),
        (lambda: store.write_page(0, float("nan"), img), TypeError, "page must be an int, got float nan"),
        (lambda: store.write_page(0, "1", img), TypeError, "page must be an int, got str"),
        (lambda: store.write_page(0, 1, "abc"), TypeError, "image must be a host buffer"),
        (lambda: store.write_page(0, 1, 12345), TypeError, "image must be host data .* not an address"),
        (lambda: store.write_page(0, 1, gone), HssError, "image is a closed PinnedBuffer"),
        (lambda: store.write_page(0, 1, sink), HssError, "image is device memory"),
        (lambda: store.write_page(0, 1, img.reshape(4, -1)[:, ::2]), HssError, "image must be C-contiguous"),
        (lambda: store.write_group(0, 1, 0.0, 0, group), TypeError, "kind must be an int, got float"),
        (lambda: store.write_group(0, 1, 0, True, group), TypeError, "kv_head must be an int, got bool"),
        (lambda: store.write_group(0, np.float32(1), 0, 0, group), TypeError, "page must be an int, got float32"),
        (lambda: store.write_group(0, 1, 0, 0, None), TypeError, "data must be a host buffer"),
        (lambda: store.read_pages(None, 0, [0], [sink.ptr]), TypeError, "stream: a stream is required"),
        (lambda: store.read_pages(stream, 0, [True], [sink.ptr]), TypeError, "pages must be integers, got bool"),
        (lambda: store.read_pages(stream, 0, ["0"], [sink.ptr]), TypeError, "pages must be integers"),
        (lambda: store.read_pages(stream, 0, [0], [1.5]), TypeError, r"dsts\[0\]: cannot use float"),
        (lambda: store.read_pages(stream, 0, [0], np.array([1.5])), TypeError,
         r"dsts must be device addresses \(integers\), got float64"),
        (lambda: store.read_pages(stream, 0, [0], sink), TypeError, "dsts must be a sequence of device addresses"),
        (lambda: store.read_pages(stream, 0, [0], [closed]), HssError, r"dsts\[0\] is a closed DeviceBuffer"),
        (lambda: store.read_pages(stream, 0, [0], [small]), HssError,
         r"dsts\[0\] holds 100 bytes but 16384 are needed \(room for one page\)"),
        (lambda: store.read_pages(stream, 0, [0], [small.ptr]), HssError, r"dsts\[0\]: 16384 bytes .* run past"),
        (lambda: store.read_pages(stream, 0, [0], [0]), HssError, r"dsts\[0\] is a null pointer"),
        (lambda: store.read_pages(stream, 0, [0], [np.zeros(bb, np.uint8)]), HssError,
         r"dsts\[0\] is a host numpy array"),
        (lambda: store.read_pages(stream, 0, [0], np.array([0])), HssError, "dsts holds 0, not a device address"),
        (lambda: store.read_pages(stream, 0, [0], np.array([small.ptr])), HssError, "run past the end"),
        (lambda: store.prepare_reads(0, [0], [sink.ptr], [0, 0.5]), TypeError, "bounds must be integers"),
        (lambda: reads.issue(0.0, stream), TypeError, "group must be an int, got float"),
        (lambda: reads.issue(True, stream), TypeError, "group must be an int, got bool"),
        (lambda: reads.issue(0, None), TypeError, "stream: a stream is required"),
        (lambda: reads.issue(0, "s"), TypeError, "stream: a stream is required"),
        (lambda: reads.issue(-1, stream), IndexError, "group -1 is out of range: 1 groups"),
        (lambda: reads.nbytes(-1), IndexError, "group -1 is out of range"),
        (lambda: reads.nbytes(0.0), TypeError, "group must be an int"),
        (lambda: store.page_valid(0, 1.5), TypeError, "page must be an int, got float"),
        (lambda: store.page_valid(np.float64(0), 1), TypeError, "layer must be an int, got float64"),
        (lambda: store.invalidate_page(0, True), TypeError, "page must be an int, got bool"),
        (lambda: store.invalidate_block("3"), TypeError, "page must be an int, got str"),
        (lambda: store.missing_pages(0, [1.0]), TypeError, "pages must be integers")]:
        with pytest.raises(err, match=words):
            call()
        assert work == [], f"{words}: device work was queued before the error"
    assert store.page_valid(0, 0) and store.missing_pages(0, range(12)).tolist() == list(range(1, 12))
    for call, words in [(lambda: HostStore(LAYOUT, 2.0, ctx=ctx), "num_layers must be an int, got float"),
                        (lambda: FileStore(tmp_path / "x", LAYOUT, True), "num_layers must be an int, got bool"),
                        (lambda: FileStore(tmp_path / "y", LAYOUT, 1, qd=2.5), "qd must be an int, got float"),
                        (lambda: FileStore(tmp_path / "z", LAYOUT, 1, bounce_pages=True),
                         "bounce_pages must be an int, got bool")]:
        with pytest.raises(TypeError, match=words):
            call()
    monkeypatch.undo()
    # numpy integers, a PinnedBuffer image, numpy addresses and an issued numpy group index
    pin = cm.PinnedBuffer(bb)
    pin.array[:] = img
    store.write_page(np.int64(1), np.uint8(3), pin)
    assert store.page_valid(np.int32(1), np.int16(3))
    assert store.read_pages(stream, np.int64(1), np.array([3], np.uint16), [np.int64(sink.ptr + bb)]) == bb
    assert reads.issue(np.int64(0), stream) == bb and reads.nbytes(np.uint8(0)) == bb
    got = download(sink, (2, bb), np.uint8, stream)
    assert np.array_equal(got[0], img) and np.array_equal(got[1], img)
    if kind == "host":
        assert store.offset(np.int8(1), np.uint16(3)) == LAYOUT.bytes_per_layer + 3 * bb
        with pytest.raises(TypeError, match="page must be an int"):
            store.offset(0, 1.0)
    store.close()
    for call in (lambda: store.write_page(0, 0, img), lambda: store.read_pages(stream, 0, [0], [sink.ptr]),
                 lambda: store.prepare_reads(0, [0], [sink.ptr], [0, 1]), lambda: reads.issue(0, stream)):
        with pytest.raises(HssError, match="is closed"):
            call()
    for b in (sink, small, pin):
        b.close()


# -- construction failures and finalizers ---------------------------------------------------------------
@pytest.mark.parametrize("existing", [False, True], ids=["new-dir", "existing-dir"])
def test_a_disk_too_full_names_path_layer_and_bytes_and_cleans_up(ctx, tmp_path, monkeypatch, existing) -> None:
    """posix_fallocate runs out of space at the third layer: the OSError names the file, the layer and the bytes
    needed (and free); every file (and directory) the store created is removed, what was there stays."""
    real = os.posix_fallocate
    count = [0]

    def fallocate(fd, offset, length):
        count[0] += 1
        if count[0] == 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, offset, length)

    target = tmp_path / "pre" if existing else tmp_path / "new" / "deeper"
    if existing:
        target.mkdir()
        (target / "mine.txt").write_text("keep")
        layer_path(target, 0).write_bytes(b"old")          # a file the store reuses is not its to remove
    monkeypatch.setattr(os, "posix_fallocate", fallocate)
    need = LAYOUT.bytes_per_layer
    with pytest.raises(OSError, match=rf"FileStore: cannot preallocate {need} bytes for layer 2's file "
                                      rf".*layer_00002\.kv: No space left on device; the store needs {need} bytes "
                                      rf"per layer x 4 layers = {4 * need} bytes, \d+ bytes are free there") as exc:
        FileStore(target, LAYOUT, 4, ctx=ctx)
    assert exc.value.errno == errno.ENOSPC
    left = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*"))
    assert left == (["pre", "pre/layer_00000.kv", "pre/mine.txt"] if existing else [])
    monkeypatch.setattr(os, "open", lambda *a, **k: (_ for _ in ()).throw(OSError(errno.EACCES, "Permission denied")))
    with pytest.raises(OSError, match=r"cannot open layer 0's file .*layer_00000\.kv: Permission denied; the store "
                                      r"needs"):
        FileStore(tmp_path / "other", LAYOUT, 2, ctx=ctx)
    monkeypatch.undo()
    assert not (tmp_path / "other").exists()


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts open descriptors through /proc/self/fd")
def test_a_dropped_file_store_closes_its_files(ctx, stream, rng, tmp_path) -> None:
    import gc
    gc.collect()
    before = len(os.listdir("/proc/self/fd"))
    store = FileStore(tmp_path, LAYOUT, LAYERS, qd=2, ctx=ctx)
    img = images(rng, 2)
    for p in range(2):
        store.write_page(0, p, img[p])
    read_back(store, stream, 0, [0, 1])                       # starts the read thread pool too
    assert len(os.listdir("/proc/self/fd")) >= before + LAYERS
    del store
    gc.collect()
    assert len(os.listdir("/proc/self/fd")) == before


@pytest.mark.parametrize("direct", [True, False])
def test_read_ahead_serves_only_current_bytes_where_they_belong(ctx, stream, rng, tmp_path, monkeypatch,
                                                               direct) -> None:
    """With qd > 1, issuing a group starts the next group's first window on the thread pool: groups issued in order
    equal read_pages; a page rewritten between two issues, groups issued out of order or again, and a read error in
    the read-ahead (reported by the issue of its own group, naming its page) never put stale or misplaced bytes into
    a destination; a dropped read-ahead is waited for, so no pread outlives the store."""
    bb = LAYOUT.block_bytes
    imgs = images(rng, 24)
    with FileStore(tmp_path, LAYOUT, 1, qd=3, bounce_pages=6, direct=direct, ctx=ctx) as store:
        for page in range(12):
            store.write_page(0, page, imgs[page])
        pages = list(range(12))
        bounds = [0, 2, 4, 6, 8, 10, 12]
        dev = cm.DeviceBuffer(12 * bb)

        def issue(order, change=None):
            cm.memset_d8_async(dev, 0xAB, dev.bytes, stream)
            reads = store.prepare_reads(0, pages, [dev.ptr + bb * p for p in pages], bounds)
            for i in order:
                reads.issue(i, stream)
                if change is not None and i == change[0]:
                    store.write_page(0, change[1], imgs[12 + change[1]])
            return download(dev, (12, bb), np.uint8, stream)

        truth = list(imgs[:12])
        got = issue(range(6))
        assert all(np.array_equal(got[p], truth[p]) for p in pages)
        assert store._ahead is None and store._outstanding == []
        got = issue(range(6), change=(1, 5))             # page 5 (group 2, being read ahead) rewritten after group 1
        truth[5] = imgs[17]
        assert all(np.array_equal(got[p], truth[p]) for p in pages), "a read-ahead served the page's old bytes"
        got = issue([3, 0, 1, 1, 5, 4, 2])
        assert all(np.array_equal(got[p], truth[p]) for p in pages)
        real = os.preadv

        def failing(fd, bufs, offset):                    # the read of pages 6-7 (group 3, read ahead by group 2)
            if offset == 6 * bb:
                raise OSError(errno.EIO, "Input/output error")
            return real(fd, bufs, offset)

        monkeypatch.setattr(os, "preadv", failing)
        reads = store.prepare_reads(0, pages, [dev.ptr + bb * p for p in pages], bounds)
        for i in range(3):
            reads.issue(i, stream)                        # group 2's issue started group 3's read: no error yet
        assert store._ahead is not None and store._ahead.group == 3
        with pytest.raises(StoreIOError, match=r"layer 0 page 6 \(K stripe of kv_head 0\): read failed"):
            reads.issue(3, stream)
        monkeypatch.undo()
        assert reads.issue(3, stream) == 2 * bb
        got = download(dev, (12, bb), np.uint8, stream)
        assert all(np.array_equal(got[p], truth[p]) for p in range(8))
        dev.close()
    assert store._outstanding == [] and store._ahead is None


def test_host_store_waits_only_for_fences_not_known_run(ctx, stream, rng, monkeypatch) -> None:
    """A HostStore takes a fence again FENCES groups after recording it: the host waits for that record, unless the
    caller said the reads up to a mark (``read_mark``) have run (``reads_ran``: it waited for work ordered after
    them). Such a mark covers neither later reads nor another stream's; a write waits only for reads not known run."""
    from hss.swap.gather import FENCES
    img = images(rng, 1)[0]
    with HostStore(LAYOUT, LAYERS, ctx=ctx) as store, cm.CudaStream(ctx) as other:
        store.write_page(0, 1, img)
        dev = cm.DeviceBuffer(LAYOUT.block_bytes)
        syncs: list = []
        real = _driver.api.cuEventSynchronize
        monkeypatch.setattr(_driver.api, "cuEventSynchronize", lambda *a: (syncs.append(1), real(*a))[1])

        def reads(n: int, on=stream) -> int:
            before = len(syncs)
            for _ in range(n):
                store.read_pages(on, 0, [1], [dev.ptr])
            return len(syncs) - before
        assert reads(FENCES) == 0            # every fence free
        assert reads(1) == 1                 # fence 0 again: its record was not known run
        mark = store.read_mark()
        cm.stream_sync(stream)
        store.reads_ran(mark)
        assert reads(FENCES) == 0            # every record up to the mark ran
        assert reads(1) == 1                 # the first after the mark: not covered
        cm.stream_sync(stream)
        store.reads_ran((other.handle, 1 << 40))      # another stream's reads: says nothing of these
        assert reads(1) == 1
        mark = store.read_mark()
        cm.stream_sync(stream)
        store.reads_ran(mark)
        before = len(syncs)
        store.write_page(0, 1, img)          # every queued read known run: no wait
        assert len(syncs) == before
        reads(1, other)
        store.write_page(0, 1, img)          # one on the other stream: waited for
        assert len(syncs) == before + 1
        monkeypatch.undo()
        assert np.array_equal(download(dev, LAYOUT.block_bytes, np.uint8, stream), img)
        dev.close()
