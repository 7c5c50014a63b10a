"""The high-speed swap and its stores under hostile input: a store write that fails (a full disk: ENOSPC at the
write syscall, all at once or part way; a HostStore whose copy fails half way) or a projection that fails after the
write (an injected driver fault) changes nothing observable (the page's stored bytes and validity, its A_g slot, the
scratch pool), and a later valid call works; pointers into the swap's or its store's own memory, overlapping read
destinations, streams and parts of another device, and store files of the wrong kind are refused before any work,
naming what is wrong; a freed block id invalidates reads prepared before it.
"""
from __future__ import annotations

import errno
import os

import numpy as np
import pytest
from test_qsa_indexer import driver_calls

from hss import cuda_min as cm
from hss import inject_fault
from hss.cuda._driver import CudaError, HssError
from hss.swap import (
    FileStore,
    GroupLayout,
    HighSpeedSwap,
    HighSpeedSwapConfig,
    HostStore,
    ModelDims,
    StoreError,
    StoreIOError,
    layer_path,
)
from hss.swap.device_step import DeviceSparseStep

from helpers import BF16, download, upload

LAYERS, BLOCKS, NQ, NKV, HD, BS = 2, 8, 4, 2, 64, 16
PAGE = (BS, NKV, HD)
MODEL = ModelDims(LAYERS, BLOCKS, NQ, NKV, HD, BS)
SWAPS = [("host", None), ("file", False), ("file", True)]
SWAP_IDS = ["host", "file-buffered", "file-direct"]


def make_swap(ctx, tmp_path, store: str, direct=None, **kw) -> HighSpeedSwap:
    cfg = HighSpeedSwapConfig(tmp_path / f"kv-{store}-{direct}", 1 << 30, 6, 16, 2, False, 7, store=store,
                              stream_tile_blocks=1, direct=direct, **kw)
    return HighSpeedSwap(ctx, cfg, MODEL)


def new_page(rng) -> tuple[np.ndarray, np.ndarray]:
    return ((rng.standard_normal(PAGE) / 8).astype(BF16), rng.standard_normal(PAGE).astype(BF16))


def offload(h: HighSpeedSwap, ctx, layer: int, block: int, k: np.ndarray, v: np.ndarray, predict: bool) -> None:
    if predict:
        kd = upload(k, ctx.stream)
        try:
            h.offload_block(ctx, layer, block, kd, k, v)
            cm.stream_sync(ctx.stream)
        finally:
            kd.close()
    else:
        h.offload_block_no_predict_on_stream(ctx.stream, layer, block, k, v)


def stored(store, stream, layer: int, page: int) -> np.ndarray | None:
    """The bytes the store serves for (layer, page), None where it refuses to read the page."""
    if not store.page_valid(layer, page):
        return None
    dev = cm.DeviceBuffer(store.layout.block_bytes)
    try:
        store.read_pages(stream, layer, [page], [dev.ptr])
        return download(dev, (store.layout.block_bytes,), np.uint8, stream)
    finally:
        dev.close()


def state(h: HighSpeedSwap, ctx) -> dict:
    """Everything a failed offload must leave as it was: every page's validity and stored bytes, every A_g slot, the
    pool's residents and free list."""
    cm.stream_sync(ctx.stream)
    return dict(
        pages={(layer, b): stored(h.store, ctx.stream, layer, b) for layer in range(LAYERS) for b in range(BLOCKS)},
        a_g=np.stack([h.predictor.read_k_lr_slot(ctx, layer, b).view(np.uint16) for layer in range(LAYERS)
                      for b in range(BLOCKS)]),
        residents=h.pool.residents(), free=h.pool.free_slots())


def assert_same(before: dict, after: dict, what: str) -> None:
    for key, old in before["pages"].items():
        new = after["pages"][key]
        assert (old is None) == (new is None), f"{what}: page {key} changed validity"
        assert old is None or np.array_equal(old, new), f"{what}: page {key} serves other bytes"
    assert np.array_equal(before["a_g"], after["a_g"]), f"{what}: an A_g slot changed"
    assert before["residents"] == after["residents"], f"{what}: the pool's residents changed"
    assert before["free"] == after["free"], f"{what}: the pool's free list changed"


def pwrites(monkeypatch, *plan) -> list[int]:
    """``os.pwrite``'s calls follow ``plan`` (then succeed): "fail" raises ENOSPC, an int writes only that many bytes,
    "ok" writes. Returns the list of offsets written, one per call."""
    real, calls = os.pwrite, []

    def call(fd, data, off):
        what = plan[len(calls)] if len(calls) < len(plan) else "ok"
        calls.append(off)
        if what == "fail":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, memoryview(data)[:what] if isinstance(what, int) else data, off)   # (aligned: O_DIRECT)

    monkeypatch.setattr(os, "pwrite", call)
    return calls


def host_writes(monkeypatch, store: HostStore, *plan) -> list[int]:
    """A HostStore whose copies follow ``plan`` (then succeed): "fail" raises StoreIOError (ENOSPC) at once, "half"
    copies half the bytes and then raises, "ok" copies."""
    real, calls = store._write, []

    def write(layer, page, offset, data):
        what = plan[len(calls)] if len(calls) < len(plan) else "ok"
        calls.append(offset)
        if what == "half":
            real(layer, page, offset, data[:data.nbytes // 2])
        if what != "ok":
            raise StoreIOError(layer, page, 0, 0, "injected failure", errno.ENOSPC)
        real(layer, page, offset, data)

    monkeypatch.setattr(store, "_write", write)
    return calls


def fail_writes(monkeypatch, h: HighSpeedSwap, partly: bool, then: str = "ok") -> list[int]:
    """The store's next write fails (all at once, or ``partly``: some bytes land first); its next one (a write-back
    of the old bytes) follows ``then``."""
    if isinstance(h.store, HostStore):
        return host_writes(monkeypatch, h.store, "half" if partly else "fail", then)
    return pwrites(monkeypatch, *((4096, "fail") if partly else ("fail",)), then)   # (4096: O_DIRECT's unit)


def filled(ctx, tmp_path, rng, store: str, direct) -> tuple[HighSpeedSwap, np.ndarray, cm.DeviceBuffer]:
    """A swap with pages 0..5 of both layers offloaded, pages 0..3 of layer 0 resident after one step."""
    h = make_swap(ctx, tmp_path, store, direct)
    for layer in range(LAYERS):
        for b in range(6):
            offload(h, ctx, layer, b, *new_page(rng), predict=bool(b % 2) or layer == 0)
    q = upload(rng.standard_normal((NQ, HD)).astype(BF16), ctx.stream)
    out = cm.DeviceBuffer(2 * NQ * HD)
    h.attend_layer(ctx, 0, [0, 1, 2, 3], q, out)
    assert {(0, b) for b in range(4)} <= set(h.pool.residents()), "the setup keeps pages 0..3 resident"
    return h, download(out, (NQ, HD), BF16, ctx.stream), q


# -- a failed offload changes nothing ------------------------------------------------------------------------------
@pytest.mark.parametrize("predict", [True, False], ids=["offload_block", "no_predict"])
@pytest.mark.parametrize("partly", [False, True], ids=["fails-at-once", "fails-part-way"])
@pytest.mark.parametrize("store,direct", SWAPS, ids=SWAP_IDS)
def test_a_failed_store_write_changes_nothing_and_the_retry_works(ctx, tmp_path, rng, monkeypatch, store, direct,
                                                                 partly, predict) -> None:
    """A page that is stored, projected and resident is offloaded again and the write fails: StoreIOError naming the
    page; its stored bytes, its validity, every A_g slot and the pool are as before (a step over the same pages gives
    the same bits); a never-written page stays unreadable. Then the same offload works."""
    h, first_out, q = filled(ctx, tmp_path, rng, store, direct)
    out = cm.DeviceBuffer(2 * NQ * HD)
    for layer, b in ((0, 2), (1, 7)):        # a resident page, a page never written
        for _ in range(3):   # the page the last retry rewrote is read, then promoted: then every page is resident
            h.attend_layer(ctx, 0, [0, 1, 2, 3], q, out)      # and a step changes no slot
        assert {(0, p) for p in range(4)} <= set(h.pool.residents())
        want = download(out, (NQ, HD), BF16, ctx.stream)
        before = state(h, ctx)
        k, v = new_page(rng)
        fail_writes(monkeypatch, h, partly)
        with pytest.raises(StoreIOError, match=f"layer {layer} page {b} ") as info:
            offload(h, ctx, layer, b, k, v, predict)
        monkeypatch.undo()
        assert info.value.errno == errno.ENOSPC and "lost" not in str(info.value)
        assert_same(before, state(h, ctx), f"a failed write of page {(layer, b)}")
        h.attend_layer(ctx, 0, [0, 1, 2, 3], q, out)
        assert np.array_equal(download(out, (NQ, HD), BF16, ctx.stream).view(np.uint16), want.view(np.uint16))
        a_g = h.predictor.read_k_lr_slot(ctx, layer, b).view(np.uint16).copy()
        offload(h, ctx, layer, b, k, v, predict)       # the retry
        assert np.array_equal(stored(h.store, ctx.stream, layer, b), h.layout.pack_page(k, v))
        assert (layer, b) not in h.pool.residents()
        assert np.array_equal(h.predictor.read_k_lr_slot(ctx, layer, b).view(np.uint16), a_g) != predict
    h.attend_layer(ctx, 0, [0, 1, 2, 3], q, out)      # the new page 2 is read and attended
    assert not np.array_equal(download(out, (NQ, HD), BF16, ctx.stream).view(np.uint16), first_out.view(np.uint16))
    out.close()
    q.close()
    h.close()


@pytest.mark.parametrize("store,direct", SWAPS, ids=SWAP_IDS)
def test_a_write_whose_old_bytes_cannot_be_put_back_leaves_the_page_unreadable(ctx, tmp_path, rng, monkeypatch,
                                                                              store, direct) -> None:
    """The write fails part way and writing the old bytes back fails too: the error says the page's previous bytes
    are lost; that page is unreadable and gone from the pool; nothing else changed (its A_g slot neither)."""
    h, _, q = filled(ctx, tmp_path, rng, store, direct)
    before = state(h, ctx)
    fail_writes(monkeypatch, h, True, "fail")
    with pytest.raises(StoreIOError, match=r"layer 0 page 2 .*the page's previous bytes are lost \(writing them back "
                                           r"failed: .*\): it is unreadable until it is written again"):
        offload(h, ctx, 0, 2, *new_page(rng), predict=True)
    monkeypatch.undo()
    after = state(h, ctx)
    assert after["pages"].pop((0, 2)) is None and (0, 2) not in after["residents"]
    del before["pages"][(0, 2)], before["residents"][(0, 2)]
    assert before["residents"] == after["residents"]
    before["free"] = after["free"]
    assert_same(before, after, "a lost page")
    out = cm.DeviceBuffer(2 * NQ * HD)
    with pytest.raises(StoreError, match=r"layer 0 blocks \[2\] were never offloaded"):
        h.attend_layer(ctx, 0, [0, 1, 2, 3], q, out)
    offload(h, ctx, 0, 2, *new_page(rng), predict=True)
    h.attend_layer(ctx, 0, [0, 1, 2, 3], q, out)
    out.close()
    q.close()
    h.close()


@pytest.mark.parametrize("store,direct", SWAPS, ids=SWAP_IDS)
def test_a_projection_failing_after_the_write_puts_the_old_page_back(ctx, tmp_path, rng, monkeypatch, store,
                                                                     direct) -> None:
    """The store write succeeds, then the projection's launch fails (an injected driver fault): the CudaError
    propagates and the page's previous bytes, its A_g slot and the pool are as before (a never-written page is
    unreadable again). Where the write-back fails too, a StoreIOError says the page is lost. Shown to bite: without
    the undo the new bytes would be served."""
    h, _, q = filled(ctx, tmp_path, rng, store, direct)
    for layer, b in ((0, 2), (1, 7)):
        before = state(h, ctx)
        with inject_fault("cuLaunchKernel", "CUDA_ERROR_LAUNCH_FAILED"):
            with pytest.raises(CudaError, match="CUDA_ERROR_LAUNCH_FAILED"):
                offload(h, ctx, layer, b, *new_page(rng), predict=True)
        assert_same(before, state(h, ctx), f"a failed projection of page {(layer, b)}")
    monkeypatch.setattr(h.store, "undo_write", lambda saved: None)     # the mutation: no undo
    with inject_fault("cuLaunchKernel", "CUDA_ERROR_LAUNCH_FAILED"):
        with pytest.raises(CudaError):
            offload(h, ctx, 0, 2, *new_page(rng), predict=True)
    with pytest.raises(AssertionError, match="serves other bytes"):
        assert_same(before, state(h, ctx), "without the undo")
    monkeypatch.undo()
    offload(h, ctx, 0, 2, *new_page(rng), predict=True)
    before = state(h, ctx)
    if isinstance(h.store, HostStore):
        host_writes(monkeypatch, h.store, "ok", "fail")
    else:
        pwrites(monkeypatch, "ok", "fail")
    with inject_fault("cuLaunchKernel", "CUDA_ERROR_LAUNCH_FAILED"):
        with pytest.raises(StoreIOError, match=r"layer 0 page 2 .*the write was undone, but the page's previous bytes "
                                               r"are lost") as info:
            offload(h, ctx, 0, 2, *new_page(rng), predict=True)
    monkeypatch.undo()
    assert isinstance(info.value.__context__, CudaError)
    after = state(h, ctx)
    assert after["pages"][(0, 2)] is None and (0, 2) not in after["residents"]
    assert np.array_equal(before["a_g"], after["a_g"])
    q.close()
    h.close()


@pytest.mark.parametrize("direct", [False, True], ids=["buffered", "direct"])
def test_store_writes_are_all_or_nothing(ctx, stream, rng, tmp_path, monkeypatch, direct) -> None:
    """write_page and write_group on a FileStore whose pwrite fails (at once, part way): the page keeps its old bytes
    and validity, reads prepared before the failure still issue those bytes, every other page is untouched; a group
    never written stays unreadable; a write-back that fails too leaves the page unreadable, saying so."""
    layout = GroupLayout(6, NKV, BS, HD)
    old = [layout.pack_page(*new_page(rng)) for _ in range(3)]
    with FileStore(tmp_path / "kv", layout, 1, direct=direct, ctx=ctx) as store:
        for p in range(3):
            store.write_page(0, p, old[p])
        dev = cm.DeviceBuffer(layout.block_bytes)
        reads = store.prepare_reads(0, [1], [dev.ptr], [0, 1])
        g = layout.group_bytes
        for call, plan in ((lambda: store.write_page(0, 1, old[0]), ("fail",)),
                           (lambda: store.write_page(0, 1, old[2]), (4096, "fail")),
                           (lambda: store.write_group(0, 1, 1, 0, b"\1" * g), ("fail",)),
                           (lambda: store.write_group(0, 1, 0, 1, b"\1" * g), ("fail",))):
            pwrites(monkeypatch, *plan)
            with pytest.raises(StoreIOError, match="layer 0 page 1 .*No space left on device") as info:
                call()
            monkeypatch.undo()
            assert "lost" not in str(info.value)
            for p in range(3):
                assert np.array_equal(stored(store, stream, 0, p), old[p]), (plan, p)
            assert reads.issue(0, stream) == layout.block_bytes
            assert np.array_equal(download(dev, (layout.block_bytes,), np.uint8, stream), old[1])
        store.write_group(0, 4, 0, 0, old[0][:g])       # one group of page 4 only
        pwrites(monkeypatch, "fail")
        with pytest.raises(StoreIOError):
            store.write_group(0, 4, 1, 1, b"\1" * g)
        monkeypatch.undo()
        assert store._valid[0, 4].tolist() == [True, False, False, False] and not store.page_valid(0, 4)
        pwrites(monkeypatch, 4096, "fail", "fail")
        with pytest.raises(StoreIOError, match=r"layer 0 page 1 .*write failed after 4096 of .*: No space left "
                                               r"on device; the page's previous bytes are lost \(writing them back"):
            store.write_page(0, 1, old[0])
        monkeypatch.undo()
        assert not store.page_valid(0, 1) and np.array_equal(stored(store, stream, 0, 2), old[2])
        with pytest.raises(StoreError, match=r"pages \[1\] were never written"):
            reads.issue(0, stream)
        dev.close()


# -- a freed block id invalidates prepared reads -------------------------------------------------------------------
STORES = [("host", {}), ("host-gather", {}), ("file", dict(direct=False)), ("file", dict(direct=True)),
          ("file", dict(direct=False, qd=3))]
STORE_IDS = ["host", "host-gather", "file-buffered", "file-direct", "file-qd3"]


@pytest.mark.parametrize("kind,kw", STORES, ids=STORE_IDS)
def test_invalidate_block_invalidates_prepared_reads(ctx, stream, rng, tmp_path, kind, kw) -> None:
    """Reads prepared before ``invalidate_block(page)`` (a freed disk block id) are not issued for that page in any
    layer: StoreError, nothing queued, the destination untouched; a group without the page still issues."""
    layout = GroupLayout(6, NKV, BS, HD)
    store = HostStore(layout, 2, ctx=ctx) if kind.startswith("host") else FileStore(tmp_path / "kv", layout, 2,
                                                                                    ctx=ctx, **kw)
    bb = layout.block_bytes
    with store:
        for layer in range(2):
            for p in range(4):
                store.write_page(layer, p, layout.pack_page(*new_page(rng)))
        dev = cm.DeviceBuffer(4 * bb)
        cm.memset_d8_async(dev, 0xAB, dev.bytes, stream)
        prepared = [store.prepare_reads(layer, [1, 3, 2], [dev.ptr + i * bb for i in range(3)], [0, 2, 3])
                    for layer in range(2)]
        if kind == "host-gather":
            table = cm.PointerTable(dev.ptr, bb, 4)
            prepared.append(store.plan_reads(0, np.array([3, 1], np.int64), dev.ptr + bb * np.array([0, 2]),
                                             np.array([0, 2]), [0, 2], (table, np.array([0, 2])), 0))
            assert prepared[-1].gather is not None
        store.invalidate_block(3)
        for reads in prepared:
            with driver_calls() as seen:
                with pytest.raises(StoreError, match=rf"layer {reads.layer} pages \[3\] were never written"):
                    reads.issue(0, stream)
            assert seen == [], seen
        assert (download(dev, (4 * bb,), np.uint8, stream) == 0xAB).all()
        assert prepared[1].issue(1, stream) == bb       # page 2 of layer 1: still valid
        assert np.array_equal(download(dev, (4 * bb,), np.uint8, stream)[2 * bb:3 * bb], stored(store, stream, 1, 2))
        dev.close()


# -- pointers into the swap's and its store's memory, overlapping destinations -------------------------------------
@pytest.mark.parametrize("store,direct", SWAPS[:2], ids=SWAP_IDS[:2])
def test_the_stores_memory_is_refused_as_any_callers_pointer(ctx, tmp_path, rng, store, direct) -> None:
    """attend_layer's q_dev and out_dev, offload's k_block_dev, a store read's destinations and the device sparse
    step's output may not point into the store's own memory (its pinned pages and gather index ring, its bounce
    ring); read destinations may not overlap each other. Each is an HssError naming the argument and the memory,
    before any device work; nothing changes."""
    h, _, q = filled(ctx, tmp_path, rng, store, direct)
    s, st, bb = ctx.stream, h.store, h.layout.block_bytes
    own = [st.buffer.ptr, st.buffer.ptr + 3 * bb + 64, st._gather.ring.ptr] if store == "host" else [st.bounce.ptr]
    what = "the HostStore's (pages|gather index ring)" if store == "host" else "the FileStore's bounce ring"
    out = cm.DeviceBuffer(2 * NQ * HD)
    sink = cm.DeviceBuffer(2 * bb)
    k, v = new_page(rng)
    before = state(h, ctx)
    for p in own:
        for call, name in ((lambda: h.attend_layer(ctx, 0, [0, 1], q, p), "out_dev"),
                           (lambda: h.attend_layer(ctx, 0, [0, 1], p, out), "q_dev"),
                           (lambda: h.offload_block(ctx, 0, 1, p, k, v), "k_block_dev"),
                           (lambda: st.read_pages(s, 0, [0, 1], [sink.ptr, p]), r"dsts\[1\]"),
                           (lambda: st.prepare_reads(0, [0], np.array([p]), [0, 1]), r"dsts\[0\]")):
            with driver_calls() as seen:
                with pytest.raises(HssError, match=rf"{name} \(0x[0-9a-f]+, \d+ bytes\) overlaps {what}, memory that "
                                                   "this (HighSpeedSwap's store|HostStore|FileStore) owns"):
                    call()
            assert seen == [], seen
    for dsts in ([sink.ptr, sink.ptr], [sink.ptr, sink.ptr + bb - 2]):
        with pytest.raises(HssError, match=r"dsts\[0\] \(0x[0-9a-f]+\) and dsts\[1\] \(0x[0-9a-f]+\) overlap: each "
                                           r"destination receives a whole page \(16384 bytes\)"):
            st.read_pages(s, 0, [0, 1], dsts)
    assert_same(before, state(h, ctx), "refused pointers")
    if store == "host":
        with DeviceSparseStep(h, s, max_seqs=1, budget_pages=2, keep_first=1, keep_recent=1) as step:
            tables, counts = upload(np.arange(BLOCKS, dtype=np.int32), s), upload(np.array([4], np.int32), s)
            qd = upload(rng.standard_normal((1, NQ, HD)).astype(BF16), s)
            step.begin_step(s, tables, counts, 1)
            with pytest.raises(HssError, match=rf"out \(0x[0-9a-f]+, \d+ bytes\) overlaps {what}"):
                step.attend_layer(s, 0, qd, st.buffer.ptr + bb)
            step.attend_layer(s, 0, qd, out)
            for b in (tables, counts, qd):
                b.close()
    assert st.read_pages(s, 0, [0, 1], [sink.ptr, sink.ptr + bb]) == 2 * bb      # the store is unharmed
    for b in (out, sink, q):
        b.close()
    h.close()


# -- another device's streams, memory and parts --------------------------------------------------------------------
two_devices = pytest.mark.skipif(cm.device_count() < 2, reason="needs two devices: two GPUs, or the emulator with "
                                                                "HSS_EMULATOR_DEVICES=2 (the test suite's default)")


@two_devices
@pytest.mark.parametrize("store,direct", SWAPS[:2], ids=SWAP_IDS[:2])
def test_streams_memory_and_parts_of_another_device_are_refused(ctx, tmp_path, rng, store, direct) -> None:
    """A swap on device 0 refuses device 1's streams (every call that queues work: offload, offload without the
    projection, attend, its store's reads) and K pages, before any work and naming both devices; a swap set up on
    device 1's stream in device 0's context, and a device sparse step in device 1's context over a device-0 swap,
    are refused before anything is made."""
    c1 = cm.CudaCtx(1)
    h, _, q = filled(ctx, tmp_path, rng, store, direct)
    out, sink = cm.DeviceBuffer(2 * NQ * HD), cm.DeviceBuffer(h.layout.block_bytes)
    k, v = new_page(rng)
    k1 = cm.DeviceBuffer(k.nbytes, c1)
    reads = h.store.prepare_reads(0, [0], [sink.ptr], [0, 1])
    before = state(h, ctx)
    kd = upload(k, ctx.stream)
    cm.stream_sync(ctx.stream)
    other = r"\(0x[0-9a-f]+\) is a stream of device 1, but this {} works on device 0; pass a stream of device 0"
    for call, owner in ((lambda: h.offload_block_on_stream(c1.stream, 0, 1, kd, k, v), "HighSpeedSwap"),
                        (lambda: h.offload_block(c1, 0, 1, kd, k, v), "HighSpeedSwap"),
                        (lambda: h.offload_block_no_predict_on_stream(c1.stream, 0, 1, k, v), "HighSpeedSwap"),
                        (lambda: h.attend_layer_on_stream(c1.stream, 0, [0, 1], q, out), "HighSpeedSwap"),
                        (lambda: h.store.read_pages(c1.stream, 0, [0], [sink.ptr]), type(h.store).__name__),
                        (lambda: reads.issue(0, c1.stream), type(h.store).__name__)):
        with driver_calls() as seen:
            with pytest.raises(HssError, match=other.format(owner)):
                call()
        assert seen == [], seen
    with pytest.raises(HssError, match="k_block_dev is memory of device 1, but this call runs on device 0"):
        h.offload_block(ctx, 0, 1, k1, k, v)
    assert_same(before, state(h, ctx), "another device's stream")
    ctx.make_current()
    cfg = HighSpeedSwapConfig(tmp_path / "never", 1 << 30, 6, 16, 2, False, 7, store=store, stream_tile_blocks=1)
    with pytest.raises(HssError, match="stream " + other.format("HighSpeedSwap")):
        HighSpeedSwap.new_on_stream(c1.stream, cfg, MODEL)
    assert not (tmp_path / "never").exists()
    if store == "host":
        for kw in (dict(ctx=c1), {}):
            c1.make_current()
            with pytest.raises(HssError, match="DeviceSparseStep works on device 1 but is given its HighSpeedSwap on "
                                               "device 0"):
                DeviceSparseStep(h, c1.stream, max_seqs=1, budget_pages=2, **kw)
        with pytest.raises(HssError, match=other.format("DeviceSparseStep")):
            DeviceSparseStep(h, c1.stream, max_seqs=1, budget_pages=2, ctx=ctx)
    ctx.make_current()
    h.attend_layer(ctx, 0, [0, 1], q, out)       # unharmed
    for b in (out, sink, q, kd, k1):
        b.close()
    h.close()
    c1.close()


# -- store files of the wrong kind ---------------------------------------------------------------------------------
def test_store_files_of_the_wrong_kind_are_refused_naming_them(ctx, tmp_path) -> None:
    """A layer path that is a directory or a FIFO, or a store directory that is a regular file: an HssError naming
    the path and what it is, before any file is left behind (what the store created is removed). An existing longer
    file is reused; the store never reads or writes its tail."""
    layout = GroupLayout(4, NKV, BS, HD)
    d = tmp_path / "kv"
    d.mkdir()
    layer_path(d, 1).mkdir()
    with pytest.raises(HssError, match=r"FileStore: layer 1's file .*layer_00001\.kv exists but is a directory, not "
                                       r"a regular file: remove it"):
        FileStore(d, layout, 2, ctx=ctx)
    assert sorted(p.name for p in d.iterdir()) == ["layer_00001.kv"], "the layer-0 file it made is removed"
    layer_path(d, 1).rmdir()
    if hasattr(os, "mkfifo"):
        os.mkfifo(layer_path(d, 0))
        with pytest.raises(HssError, match=r"layer 0's file .*layer_00000\.kv exists but is a FIFO"):
            FileStore(d, layout, 2, ctx=ctx)
        layer_path(d, 0).unlink()
    (tmp_path / "plain").write_text("not a directory")
    with pytest.raises(HssError, match=r"FileStore: the store directory .*plain exists but is a regular file, not a "
                                       r"directory"):
        FileStore(tmp_path / "plain", layout, 1, ctx=ctx)
    with pytest.raises(HssError, match=r"HighSpeedSwapConfig.dir .*plain/deeper: .*plain exists but is not a "
                                       r"directory"):
        HighSpeedSwap(ctx, HighSpeedSwapConfig(tmp_path / "plain" / "deeper", 1 << 30, 6, 16, 2, False, 7,
                                               stream_tile_blocks=1), MODEL)
    tail = bytes(range(256)) * 16
    layer_path(d, 0).write_bytes(b"\0" * layout.bytes_per_layer + tail)
    with FileStore(d, layout, 1, ctx=ctx) as store:
        img = layout.pack_page(*new_page(np.random.default_rng(1)))
        store.write_page(0, 3, img)
        assert np.array_equal(stored(store, ctx.stream, 0, 3), img)
    assert layer_path(d, 0).read_bytes()[layout.bytes_per_layer:] == tail
