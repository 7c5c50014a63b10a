"""hss.cuda_min on whatever driver this process has: the emulator in CI, the GPU on the device."""
from __future__ import annotations

import threading

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from hss import CudaError, HssError, inject_fault
from hss import cuda_min as cm
from hss._util import ceil_div
from hss.cuda import _driver, _memory, ptx
from hss.decls.selftest import SELFTEST_AXPY, SELFTEST_BLOCK_SUM, SELFTEST_EMPTY, SELFTEST_FILL
from hss.reference import selftest as ref

from conftest import ON_GPU
from helpers import assert_bites, assert_close, download, poisoned, upload


@pytest.fixture(scope="module")
def selftest(ctx):
    mod = ptx.load_module("selftest", ctx)
    yield mod
    mod.close()


@given(data=st.data())
def test_round_trip_at_random_sizes_and_offsets(ctx, stream, data):
    size = data.draw(st.integers(1, 1 << 16), label="size")
    off = data.draw(st.integers(0, 4096), label="offset")
    host = np.frombuffer(np.random.default_rng(size ^ off).bytes(size), np.uint8).copy()
    with cm.DeviceBuffer(size + off + 64) as buf:
        cm.memset_d8_async(buf, 0xAB, buf.bytes, stream)
        cm.copy_h_to_d_async(buf.ptr + off, host, size, stream)
        back = download(buf.ptr, buf.bytes, np.uint8, stream)
    assert (back[off:off + size] == host).all()
    assert (back[:off] == 0xAB).all() and (back[off + size:] == 0xAB).all()


def test_device_to_device_and_pinned_round_trip(ctx, stream, rng):
    n = 3000
    x = rng.standard_normal(n).astype(np.float32)
    pin = cm.PinnedBuffer(4 * n)
    pin.view(np.float32)[:] = x
    with cm.DeviceBuffer(4 * n) as a, cm.DeviceBuffer(4 * n) as b:
        cm.copy_h_to_d_async(a, pin, 4 * n, stream)
        cm.copy_d_to_d_async(b, a, 4 * n, stream)
        out = cm.PinnedBuffer(4 * n)
        out.array.fill(0xFF)
        cm.copy_d_to_h_async(out, b, 4 * n, stream)
        cm.stream_sync(stream)
        assert (out.view(np.float32) == x).all()
        assert pin.device_ptr() != 0
    pin.close()
    out.close()
    out.close()  # idempotent


@given(rows=st.integers(1, 40), width=st.integers(1, 300), spad=st.integers(0, 64), dpad=st.integers(0, 64))
def test_2d_copy(ctx, stream, rows, width, spad, dpad):
    sp, dp = width + spad, width + dpad
    src = np.random.default_rng(rows * width).integers(0, 255, size=rows * sp, dtype=np.uint8)
    with upload(src, stream) as s, cm.DeviceBuffer(rows * dp) as d:
        cm.memset_d8_async(d, 0x5A, d.bytes, stream)
        cm.copy_2d_d_to_d_async(d, dp, s, sp, width, rows, stream)
        got = download(d.ptr, rows * dp, np.uint8, stream).reshape(rows, dp)
    assert (got[:, :width] == src.reshape(rows, sp)[:, :width]).all()
    assert (got[:, width:] == 0x5A).all()


def test_memsets(ctx, stream):
    with cm.DeviceBuffer(4096) as buf:
        cm.memset_d8_async(buf, 0x11, 4096, stream)
        cm.memset_d32_async(buf.ptr + 16, 0xFF800000, 8, stream)
        got = download(buf.ptr, 1024, np.uint32, stream)
    assert (got[:4] == 0x11111111).all()
    assert np.isneginf(got[4:12].view(np.float32)).all()
    assert (got[12:] == 0x11111111).all()
    with pytest.raises(HssError, match="aligned"):
        cm.memset_d32_async(3, 0, 1, stream)
    with pytest.raises(HssError, match="0..255"):
        cm.memset_d8_async(buf, 256, 1, stream)


def test_sizes_checked_against_owned_buffers(ctx, stream):
    with cm.DeviceBuffer(100) as buf:
        host = np.zeros(200, np.uint8)
        with pytest.raises(HssError, match="run past the end"):
            cm.copy_h_to_d_async(buf.ptr + 50, host, 51, stream)
        with cm.DeviceBuffer(1000) as big, pytest.raises(HssError, match="holds 200 bytes"):
            cm.copy_h_to_d_async(big, host, 300, stream)
        with pytest.raises(HssError, match="read-only"):
            cm.copy_d_to_h_async(bytes(100), buf, 100, stream)
        with pytest.raises(HssError):
            cm.copy_2d_d_to_d_async(buf, 10, buf, 10, 11, 2, stream)
    with pytest.raises(HssError, match="nbytes = 0 must be >= 1"):
        cm.DeviceBuffer(0)
    with pytest.raises(TypeError, match="stream is required"):
        cm.stream_sync(None)


@given(n=st.integers(1, 5000), a=st.floats(-4, 4, allow_nan=False, width=32),
       mul=st.integers(0, 2**32 - 1), add=st.integers(-2**63, 2**63 - 1), grid=st.integers(1, 8))
def test_every_parameter_kind_through_axpy(ctx, stream, selftest, n, a, mul, add, grid):
    rng = np.random.default_rng(n)
    x = rng.standard_normal(n).astype(np.float32)
    y = rng.standard_normal(n).astype(np.float32)
    f = selftest.function("selftest_axpy")
    with upload(x, stream) as dx, upload(y, stream) as dy, poisoned(4 * n, stream) as out, \
            poisoned(8 * n, stream) as idx:
        pack = SELFTEST_AXPY.pack(out, idx, dx, dy, a, n, mul, add)
        cm.launch_kernel(f, (grid, 1, 1), (128, 1, 1), 0, stream, pack)
        got = download(out.ptr, n, np.float32, stream)
        got_idx = download(idx.ptr, n, np.int64, stream)
    want, want_idx = ref.axpy(x, y, np.float32(a), n, mul, add)
    assert_close(got, want, "f32", (0,), "axpy")
    assert (got_idx == want_idx).all()
    if n > 1 and np.abs(y).max() > 0:
        assert_bites(got, want - np.where(np.arange(n) == np.argmax(np.abs(y)), y, 0), "f32", (0,), "axpy")


def test_untyped_launch_and_prepared_refill(ctx, stream, selftest):
    f = selftest.function("selftest_fill_u32")
    with poisoned(4 * 1000, stream) as out:
        cm.launch_kernel(f, 4, 256, 0, stream, [out.ptr, np.uint32(7), np.int32(1000)])
        assert (download(out.ptr, 1000, np.uint32, stream) == 7).all()
        pack = SELFTEST_FILL.pack(out, 0, 1000)
        for value in (1, 2, 3):
            pack.set("value", value)
            cm.launch_kernel(f, (4, 1, 1), (256, 1, 1), 0, stream, pack)
            assert (download(out.ptr, 1000, np.uint32, stream) == value).all()
        with pytest.raises(TypeError, match=r"value \(u32\) needs an integer, got float"):   # declared: plain ints
            cm.launch_kernel(f, 1, 1, 0, stream, [out.ptr, 7.0, 1])
        with pytest.raises(HssError, match="takes 3 parameters, got 2"):
            cm.launch_kernel(f, 1, 1, 0, stream, [out.ptr, 7])


@given(n=st.integers(1, 3000), log_block=st.integers(5, 9))
def test_shared_memory_block_sum(ctx, stream, selftest, n, log_block):
    block = 1 << log_block
    nb = ceil_div(n, block)
    x = np.random.default_rng(n).standard_normal(n).astype(np.float32)
    with upload(x, stream) as dx, poisoned(4 * nb, stream) as out:
        cm.launch_kernel(selftest.function("selftest_block_sum"), nb, block, 4 * block, stream,
                         SELFTEST_BLOCK_SUM.pack(dx, out, n))
        got = download(out.ptr, nb, np.float32, stream)
    want = ref.block_sums(x, n, block)
    tol = 1e-6 * block * np.abs(x).max() + 0 * want   # f32 tree sum of `block` terms of size <= max|x|
    assert_close(got, want, "f32", (0,), "block_sum", tol=tol)


def test_bad_function_name_names_function_and_module(ctx, selftest):
    with pytest.raises(CudaError, match="function no_such_kernel in module selftest") as info:
        selftest.function("no_such_kernel")
    assert info.value.name == "CUDA_ERROR_NOT_FOUND"


def test_bad_ptx_is_a_cuda_error(ctx):
    with pytest.raises(CudaError, match="cuModuleLoadData"):
        cm.CudaModule.from_ptx(".version 9.0\n.target sm_80\n.address_size 64\n garbage {", name="junk")
    with pytest.raises(HssError, match="NUL"):
        cm.CudaModule.from_ptx("abc\0def")


def test_launch_error_reports_grid_and_block(ctx, stream, selftest):
    f = selftest.function("selftest_empty")
    with pytest.raises(CudaError, match=r"grid \(1, 1, 1\), block \(2048, 1, 1\)"):
        cm.launch_kernel(f, 1, 2048, 0, stream, SELFTEST_EMPTY.pack(0, 0, 0))


def test_injected_driver_error_surfaces_as_cuda_error(ctx):
    with inject_fault("cuMemAlloc", "CUDA_ERROR_OUT_OF_MEMORY"):
        with pytest.raises(CudaError) as info:
            cm.DeviceBuffer(1024)
    assert info.value.call == "cuMemAlloc" and info.value.name == "CUDA_ERROR_OUT_OF_MEMORY"
    assert "out of memory" in str(info.value)
    cm.DeviceBuffer(1024).close()   # the fault was one-shot


def test_events_order_streams_and_time(ctx, stream, selftest):
    other = cm.CudaStream(ctx)
    done = cm.CudaEvent()
    t0, t1 = cm.CudaEvent(timing=True), cm.CudaEvent(timing=True)
    n = 1 << 16
    with poisoned(4 * n, stream) as buf:
        t0.record(stream)
        cm.launch_kernel(selftest.function("selftest_fill_u32"), 64, 256, 0, stream, SELFTEST_FILL.pack(buf, 9, n))
        done.record(stream)
        t1.record(stream)
        other.wait(done)
        host = cm.PinnedBuffer(4 * n)
        cm.copy_d_to_h_async(host, buf, 4 * n, other)
        other.synchronize()
        assert (host.view(np.uint32) == 9).all()
        t1.synchronize()
        assert done.query()
        assert t0.elapsed_ms(t1) >= 0.0
    with pytest.raises(HssError, match="timing=True"):
        done.elapsed_ms(t1)
    for obj in (other, done, t0, t1, host):
        obj.close()


def test_capture_and_replay(ctx, selftest):
    s = cm.CudaStream(ctx)
    f = selftest.function("selftest_fill_u32")
    n = 4096
    with poisoned(4 * n, s.handle) as buf:
        s.synchronize()
        pack = SELFTEST_FILL.pack(buf, 5, n)
        cm.begin_capture(s)
        cm.launch_kernel(f, 8, 256, 0, s, pack)
        cm.memset_d32_async(buf, 77, 16, s)
        graph = cm.end_capture(s)
        pack.set("value", 6)      # captured by value: replays still write 5
        host = cm.PinnedBuffer(4 * n)
        for _ in range(3):
            host.array.fill(0)
            graph.launch(s)
            cm.copy_d_to_h_async(host, buf, 4 * n, s)
            s.synchronize()
            got = host.view(np.uint32)
            assert (got[:16] == 77).all() and (got[16:] == 5).all()
        graph.close()
        host.close()
    s.close()


def test_on_replay_runs_now_or_at_each_replay(ctx):
    """hss.cuda._launch.on_replay: eager -> at once; inside a capture -> kept by the graph, run after every launch, in
    registration order; a capture that fails or that hss does not end keeps nothing."""
    s = cm.CudaStream(ctx)
    log = []
    assert not cm.is_capturing(s)
    assert cm.on_replay(s, lambda: log.append("eager")) is False and log == ["eager"]
    with cm.DeviceBuffer(64) as buf:
        cm.begin_capture(s)
        assert cm.is_capturing(s)
        cm.memset_d32_async(buf, 7, 16, s)
        assert cm.on_replay(s, lambda: log.append("a")) is True
        assert cm.on_replay(s.handle, lambda: log.append("b")) is True
        assert log == ["eager"], "nothing runs while capturing"
        graph = cm.end_capture(s)
        assert not cm.is_capturing(s) and len(graph.replay_callbacks) == 2
        for _ in range(3):
            graph.launch(s)
        assert log == ["eager"] + ["a", "b"] * 3
        s.synchronize()
        assert (download(buf, 16, np.uint32, s.handle) == 7).all()
        # a second capture on the same stream starts empty
        cm.begin_capture(s)
        cm.memset_d32_async(buf, 8, 16, s)
        plain = cm.end_capture(s)
        assert plain.replay_callbacks == ()
        plain.launch(s)
        assert log == ["eager"] + ["a", "b"] * 3
        # a broken capture: its callbacks are dropped with it
        cm.begin_capture(s)
        cm.on_replay(s, lambda: log.append("lost"))
        with pytest.raises(CudaError):
            cm.stream_sync(s)
        with pytest.raises(CudaError):
            cm.end_capture(s)
        # a capture ended outside hss (as torch.cuda.graph does): its callbacks never run, and go at the next one
        _driver.api.cuStreamBeginCapture(s.handle, _driver.api.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_GLOBAL)
        cm.on_replay(s, lambda: log.append("foreign"))
        err, foreign = _driver.api.cuStreamEndCapture(s.handle)
        assert not err
        _driver.api.cuGraphDestroy(foreign)
        cm.begin_capture(s)
        cm.on_replay(s, lambda: log.append("c"))
        from hss.cuda import _launch
        assert [len(fns) for _, fns in _launch._replay_fns.values()] == [1], "the ended capture's entry is pruned"
        g2 = cm.end_capture(s)
        g2.launch(s)
        assert log == ["eager"] + ["a", "b"] * 3 + ["c"]
        for g in (graph, plain, g2):
            g.close()
    with pytest.raises(TypeError, match="callable"):
        cm.on_replay(s, 5)
    with pytest.raises(TypeError, match="a stream is required"):
        cm.on_replay(None, lambda: None)
    s.close()


def _fork_join_step(s, c, ev, slot, out, host, n, join=True, wait_copy=True):
    """Two "layers" through one device slot: c copies host[i] into the slot, s copies the slot to out[i]; c waits for
    s's read of the slot before the next copy (write after read) and s for each copy (read after write)."""
    fork, copied, read = ev
    fork.record(s)
    cm.stream_wait_event(c, fork)
    for i in range(2):
        if i:
            cm.stream_wait_event(c, read)
        cm._h_to_d_planned(slot.ptr, host.ptr + i * n, n, c.handle)
        copied.record(c)
        if wait_copy and (join or i == 0):
            cm.stream_wait_event(s, copied)
        cm.copy_d_to_d_async(out.ptr + i * n, slot, n, s)
        read.record(s)


def test_a_failed_template_destroy_fails_the_capture_and_frees_the_graph(ctx, monkeypatch):
    """end_capture checks the template graph's cuGraphDestroy: a failure raises naming it, after the executable
    graph it instantiated is destroyed (nothing leaks); the next capture works."""
    s = ctx.stream
    destroyed = []
    real = _driver.api.cuGraphExecDestroy
    monkeypatch.setattr(_driver.api, "cuGraphExecDestroy", lambda h: (destroyed.append(int(h)), real(h))[1])
    buf = cm.DeviceBuffer(64)
    cm.begin_capture(s)
    cm.memset_d8_async(buf, 1, 64, s)
    with inject_fault("cuGraphDestroy", "CUDA_ERROR_INVALID_VALUE"):
        with pytest.raises(CudaError, match="cuGraphDestroy failed.*template"):
            cm.end_capture(s)
    assert len(destroyed) == 1
    cm.begin_capture(s)
    cm.memset_d8_async(buf, 2, 64, s)
    graph = cm.end_capture(s)
    graph.launch(s)
    assert (download(buf, 64, np.uint8, s) == 2).all()
    graph.close()
    buf.close()


def test_capture_forks_and_joins_a_second_stream(ctx):
    """A stream that waits for an event recorded in a capture joins it (the fork); the origin's wait for its last
    event joins it back; the graph replays both streams' work in their order, reading pinned memory at replay time.
    Work left unjoined fails the capture; on the emulator, a missing wait inside the graph leaves the work unrun."""
    s, c = cm.CudaStream(ctx), cm.CudaStream(ctx)
    n = 4096
    ev = [cm.CudaEvent(ctx=ctx) for _ in range(3)]
    host = cm.PinnedBuffer(2 * n, ctx)
    with cm.DeviceBuffer(n, ctx) as slot, cm.DeviceBuffer(2 * n, ctx) as out:
        host.array[:] = np.arange(2 * n) % 251
        _fork_join_step(s, c, ev, slot, out, host, n)        # eager
        assert (download(out, 2 * n, np.uint8, s.handle) == host.array).all()
        cm.begin_capture(s)
        _fork_join_step(s, c, ev, slot, out, host, n)
        assert cm.is_capturing(c), "the copy stream joined the capture"
        graph = cm.end_capture(s)
        assert not cm.is_capturing(c)
        for k in range(3):
            host.array[:] = (np.arange(2 * n) * (k + 3)) % 253
            cm.memset_d8_async(out, 0, 2 * n, s)
            graph.launch(s)
            assert (download(out, 2 * n, np.uint8, s.handle) == host.array).all(), k
        graph.close()
        cm.begin_capture(s)          # the last copy is never waited for: unjoined
        _fork_join_step(s, c, ev, slot, out, host, n, join=False)
        with pytest.raises(CudaError, match="cuStreamEndCapture"):
            cm.end_capture(s)
        assert not cm.is_capturing(s) and not cm.is_capturing(c)
        if not ON_GPU:   # the emulator runs a lane only when waited for: without the wait the slot is stale
            cm.memset_d8_async(slot, 7, n, s)
            cm.begin_capture(s)
            _fork_join_step(s, c, ev, slot, out, host, n, wait_copy=False)
            cm.stream_wait_event(s, ev[1])     # joined at the end only
            graph = cm.end_capture(s)
            graph.launch(s)
            assert (download(out, n, np.uint8, s.handle) == 7).all(), "the missing wait went unseen"
            graph.close()
    for obj in (*ev, host, c, s):
        obj.close()


def test_sync_inside_capture_is_refused(ctx):
    s = cm.CudaStream(ctx)
    cm.begin_capture(s)
    with pytest.raises(CudaError, match="cuStreamSynchronize"):
        cm.stream_sync(s)
    with pytest.raises(CudaError):
        cm.end_capture(s)
    s.close()


def test_context_from_a_second_thread(ctx, stream, selftest):
    errors, results = [], []
    buf = cm.DeviceBuffer(4 * 256)

    def work():
        try:   # a fresh thread has no current context: hss must make it current itself
            s = cm.CudaStream(ctx)
            cm.launch_kernel(selftest.function("selftest_fill_u32"), 1, 256, 0, s,
                             SELFTEST_FILL.pack(buf, 42, 256))
            results.append(download(buf.ptr, 256, np.uint32, s.handle))
            s.close()
        except Exception as exc:  # surfaced in the main thread
            errors.append(exc)

    t = threading.Thread(target=work)
    t.start()
    t.join()
    buf.close()
    assert not errors, errors
    assert (results[0] == 42).all()


def test_owners_free_exactly_once(ctx):
    buf = cm.DeviceBuffer(1 << 20)
    free0, _ = cm.mem_info()
    buf.close()
    buf.close()
    assert buf.closed
    with cm.DeviceBuffer(256) as b:
        assert b.__cuda_array_interface__["data"][0] == b.ptr
    assert b.closed and "closed" in repr(b)
    del free0


def test_batched_host_to_device_copies(ctx, stream, rng):
    """Scattered pinned pieces into a device buffer in one batch; the batch keeps stream order."""
    page = 4096
    src = cm.PinnedBuffer(16 * page)
    src.array[:] = rng.integers(0, 256, src.bytes, dtype=np.uint8)
    order = [7, 2, 3, 11, 0]
    sizes = [page, 2 * page, page, 3 * page, page]
    with cm.DeviceBuffer(16 * page) as dev:
        cm.memset_d8_async(dev, 0xAB, dev.bytes, stream)
        dsts, at = [], 0
        for n in sizes:
            dsts.append(dev.ptr + at)
            at += n
        cm.copy_h_to_d_batch_async(dsts, [src.ptr + p * page for p in order], sizes, stream)
        got = np.empty(dev.bytes, np.uint8)
        cm.copy_d_to_h_async(got, dev, dev.bytes, stream)
        cm.stream_sync(stream)
        want = np.concatenate([src.array[p * page:p * page + n] for p, n in zip(order, sizes)])
        assert np.array_equal(got[:at], want) and (got[at:] == 0xAB).all()
        with pytest.raises(HssError, match="2 destinations, 1 sources"):
            cm.copy_h_to_d_batch_async(dsts[:2], [src.ptr], sizes[:2], stream)
        with pytest.raises(HssError, match="sizes must be > 0"):
            cm.copy_h_to_d_batch_async(dsts[:1], [src.ptr], [0], stream)
        with pytest.raises(HssError, match="run past the end"):
            cm.copy_h_to_d_batch_async([dev.ptr + 15 * page], [src.ptr], [2 * page], stream)
        cm.copy_h_to_d_batch_async([], [], [], stream)   # nothing to do
    src.close()
    assert cm.multiprocessor_count(ctx) > 0


def test_batched_copies_fall_back_where_the_driver_has_no_batch_call(ctx, stream, rng):
    page = 4096
    src = cm.PinnedBuffer(4 * page)
    src.array[:] = rng.integers(0, 256, src.bytes, dtype=np.uint8)
    saved = dict(_memory._batch_attrs)
    _memory._batch_attrs.clear()
    try:
        with cm.DeviceBuffer(4 * page) as dev:
            halves = ([dev.ptr + 2 * page, dev.ptr], [src.ptr, src.ptr + 2 * page], [2 * page, 2 * page])
            with inject_fault("cuMemcpyBatchAsync", "CUDA_ERROR_NOT_SUPPORTED"):
                cm.copy_h_to_d_batch_async(*halves, stream)          # one call per copy instead
            assert list(_memory._batch_attrs.values()) == [None]          # and so from now on in this context
            cm.copy_h_to_d_batch_async(*halves, stream)
            got = np.empty(dev.bytes, np.uint8)
            cm.copy_d_to_h_async(got, dev, dev.bytes, stream)
            cm.stream_sync(stream)
            assert np.array_equal(got, np.concatenate([src.array[2 * page:], src.array[:2 * page]]))
            _memory._batch_attrs.clear()
            with inject_fault("cuMemcpyBatchAsync", "CUDA_ERROR_INVALID_VALUE"):
                with pytest.raises(CudaError, match="cuMemcpyBatchAsync.*CUDA_ERROR_INVALID_VALUE"):
                    cm.copy_h_to_d_batch_async(*halves, stream)
    finally:
        _memory._batch_attrs.clear()
        _memory._batch_attrs.update(saved)
        src.close()


def test_planned_host_to_device_batch_through_pointer_tables(ctx, stream, rng, monkeypatch):
    """HostToDeviceBatch._planned (hss.swap's reads): table entries give the same copies as the checked batch of
    their addresses, whole or in parts, by batch call or one call per copy; PointerTable.take makes each entry's
    CUdeviceptr once (repeats included) and keeps it."""
    page = 4096
    src = cm.PinnedBuffer(16 * page)
    src.array[:] = rng.integers(0, 256, src.bytes, dtype=np.uint8)
    try:
        with cm.DeviceBuffer(16 * page) as dev:
            dst_table, src_table = cm.PointerTable(dev.ptr, page, 16), cm.PointerTable(src.ptr, page, 16)
            first = dst_table.take(np.array([3, 3, 5]))
            assert [int(p) for p in first] == [dev.ptr + 3 * page] * 2 + [dev.ptr + 5 * page]
            assert dst_table.take(np.array([3]))[0] is first[0], "made once, then kept"
            assert all(type(p) is _driver.api.CUdeviceptr for p in first)
            dst_slots, src_pages = np.array([9, 0, 4, 12]), np.array([7, 2, 11, 0])
            sizes = np.array([page, 2 * page, page, 3 * page])
            want = np.full(dev.bytes, 0xAB, np.uint8)
            for d, s_, n in zip(dst_slots, src_pages, sizes):
                want[d * page:d * page + n] = src.array[s_ * page:s_ * page + n]
            calls: list = []
            real = _driver.api.cuMemcpyBatchAsync
            monkeypatch.setattr(_driver.api, "cuMemcpyBatchAsync", lambda *a: (calls.append(a[3]), real(*a))[1])
            for parts, fault in (([(0, None)], None), ([(2, 4), (0, 2)], None), ([(0, 3), (3, 4)], "unsupported")):
                batch = cm.HostToDeviceBatch._planned(sizes, dst_table, dst_slots, src_table, src_pages)
                assert len(batch) == 4 and batch.nbytes == 7 * page
                cm.memset_d8_async(dev, 0xAB, dev.bytes, stream)
                saved = dict(_memory._batch_attrs)
                try:
                    if fault:
                        _memory._batch_attrs.clear()
                        with inject_fault("cuMemcpyBatchAsync", "CUDA_ERROR_NOT_SUPPORTED"):
                            for start, stop in parts:
                                batch.queue(stream, start, stop)
                    else:
                        for start, stop in parts:
                            batch.queue(stream, start, stop)
                finally:
                    _memory._batch_attrs.clear()
                    _memory._batch_attrs.update(saved)
                assert np.array_equal(download(dev, dev.bytes, np.uint8, stream), want), parts
    finally:
        src.close()


def test_prepared_host_to_device_batch(ctx, stream, rng, monkeypatch):
    """HostToDeviceBatch: every check at construction (nothing queued when one fails), then whole or
    consecutive-part queues, each one driver call (or one call per copy where there is no batch call)."""
    page = 4096
    src = cm.PinnedBuffer(16 * page)
    src.array[:] = rng.integers(0, 256, src.bytes, dtype=np.uint8)
    order, sizes = [7, 2, 3, 11, 0], [page, 2 * page, page, 3 * page, page]
    calls: list = []
    real = _driver.api.cuMemcpyBatchAsync
    monkeypatch.setattr(_driver.api, "cuMemcpyBatchAsync", lambda *a: (calls.append(a[3]), real(*a))[1])
    try:
        with cm.DeviceBuffer(16 * page) as dev:
            dsts = np.cumsum([0] + sizes[:-1]) + dev.ptr
            batch = cm.HostToDeviceBatch(dsts, np.array(order) * page + src.ptr, sizes)
            assert len(batch) == 5 and batch.nbytes == 8 * page and "5 copies" in repr(batch)
            want = np.concatenate([src.array[p * page:p * page + n] for p, n in zip(order, sizes)])
            for parts in ([(0, None)], [(3, 5), (0, 1), (1, 3)], [(0, 2), (2, 2), (2, 5)]):
                cm.memset_d8_async(dev, 0xAB, dev.bytes, stream)
                calls.clear()
                for start, stop in parts:
                    batch.queue(stream, start, stop)
                got = download(dev, dev.bytes, np.uint8, stream)
                assert np.array_equal(got[:8 * page], want) and (got[8 * page:] == 0xAB).all()
                assert calls == [n for n in ((stop or 5) - start for start, stop in parts) if n], "one call per part"
            cm.memset_d8_async(dev, 0xAB, dev.bytes, stream)
            saved = dict(_memory._batch_attrs)
            _memory._batch_attrs.clear()
            try:
                with inject_fault("cuMemcpyBatchAsync", "CUDA_ERROR_NOT_SUPPORTED"):
                    batch.queue(stream, 0, 2)                    # one call per copy instead, from now on
                assert list(_memory._batch_attrs.values()) == [None]
                batch.queue(stream, 2)
                got = download(dev, dev.bytes, np.uint8, stream)
                assert np.array_equal(got[:8 * page], want)
                _memory._batch_attrs.clear()
                with inject_fault("cuMemcpyBatchAsync", "CUDA_ERROR_INVALID_VALUE"):
                    with pytest.raises(CudaError, match="cuMemcpyBatchAsync.*CUDA_ERROR_INVALID_VALUE.*2 host-to"):
                        batch.queue(stream, 1, 3)
            finally:
                _memory._batch_attrs.clear()
                _memory._batch_attrs.update(saved)
            calls.clear()
            for args, err, words in [
                ((dsts[:2], [src.ptr], sizes[:2]), HssError, "2 destinations, 1 sources, 2 sizes"),
                ((dsts[:2], [src.ptr] * 2, [page, 0]), HssError, r"sizes must be > 0 \(got 0\)"),
                ((dsts[:2], [src.ptr] * 2, [page, -5]), HssError, r"sizes must be > 0 \(got -5\)"),
                (([dev.ptr, dev.ptr + 15 * page], [src.ptr] * 2, [page, 2 * page]), HssError,
                 r"dst: 8192 bytes at offset 61440 run past the end of its 65536-byte buffer"),
                (([float(dev.ptr)], [src.ptr], [page]), TypeError, "destinations must be integers")]:
                with pytest.raises(err, match=words):
                    cm.HostToDeviceBatch(*args)
            assert calls == []
            empty = cm.HostToDeviceBatch([], [], [])
            empty.queue(stream)
            batch.queue(stream, 3, 3)
            assert len(empty) == 0 and calls == []
    finally:
        src.close()


def test_ctx_properties(ctx):
    major, minor = ctx.compute_capability
    assert major >= 7 and isinstance(ctx.name, str) and ctx.name
    free, total = cm.mem_info()
    assert 0 < free <= total
    assert cm.driver_status().kind in ("cuda", "emulator")


@pytest.mark.gpu
def test_ten_thousand_alloc_free_returns_mem_info(ctx):
    cm.stream_sync(ctx.stream)
    start = cm.mem_info()[0]
    for i in range(10_000):
        cm.DeviceBuffer(4096 + (i % 7) * 1024).close()
    assert cm.mem_info()[0] == start


@pytest.mark.gpu
def test_interop_with_torch_pointers(ctx, stream):
    torch = pytest.importorskip("torch")
    t = torch.arange(64, dtype=torch.float32, device="cuda")
    torch.cuda.synchronize()
    host = np.empty(64, np.float32)
    cm.copy_d_to_h_async(host, t, 256, stream)
    assert (host == np.arange(64)).all()


@pytest.mark.emulator
def test_emulator_catches_out_of_bounds(ctx, stream, selftest):
    from hss.emulator import MemoryFault
    with cm.DeviceBuffer(4 * 100) as small, cm.DeviceBuffer(4 * 1000) as big:
        pack = SELFTEST_AXPY.pack(big, big, big, small, 1.0, 200, 1, 0)
        with pytest.raises(MemoryFault, match=r"parameter y.*runs 400 bytes past the end"):
            cm.launch_kernel(selftest.function("selftest_axpy"), 1, 128, 0, stream, pack)


@pytest.mark.emulator
def test_emulator_catches_a_missing_sync(ctx, stream, selftest):
    n = 1024
    with poisoned(4 * n, stream) as buf:
        host = cm.PinnedBuffer(4 * n)
        host.array.fill(0)
        cm.launch_kernel(selftest.function("selftest_fill_u32"), 4, 256, 0, stream, SELFTEST_FILL.pack(buf, 3, n))
        cm.copy_d_to_h_async(host, buf, 4 * n, stream)
        assert (host.view(np.uint32) == 0).all()     # nothing ran: the stream was never waited for
        cm.stream_sync(stream)
        assert (host.view(np.uint32) == 3).all()
        host.close()


@pytest.mark.emulator
def test_emulator_catches_a_missing_cross_stream_wait(ctx, selftest):
    a, b = cm.CudaStream(ctx), cm.CudaStream(ctx)
    n = 1024
    with poisoned(4 * n, a.handle) as buf:
        a.synchronize()
        host = cm.PinnedBuffer(4 * n)
        cm.launch_kernel(selftest.function("selftest_fill_u32"), 4, 256, 0, a, SELFTEST_FILL.pack(buf, 8, n))
        cm.copy_d_to_h_async(host, buf, 4 * n, b)      # no wait on a: b copies the poison
        b.synchronize()
        assert (host.view(np.uint32) == 0xFFFFFFFF).all()
        a.synchronize()
        host.close()
    a.close()
    b.close()


@pytest.mark.emulator
def test_emulator_checks_declared_geometry(ctx, stream, selftest):
    from hss.emulator import EmulatorError
    with cm.DeviceBuffer(4096) as x:
        with pytest.raises(EmulatorError, match="dynamic shared memory"):
            cm.launch_kernel(selftest.function("selftest_block_sum"), 1, 256, 0, stream,
                             SELFTEST_BLOCK_SUM.pack(x, x, 256))


@pytest.mark.emulator
def test_emulator_requires_a_current_context():
    from hss import emulator
    result = {}

    def probe():
        result["err"] = emulator.cuMemAlloc(16)[0]

    t = threading.Thread(target=probe)
    t.start()
    t.join()
    assert result["err"] == emulator.CUresult.CUDA_ERROR_INVALID_CONTEXT


def test_on_gpu_flag_matches_driver():
    assert ON_GPU == (cm.driver_status().kind == "cuda")


# -- hostile input at the driver layer: refused before any device work ----------------------
@pytest.mark.parametrize("call", [
    lambda s, b: cm.DeviceBuffer(3.7),
    lambda s, b: cm.DeviceBuffer(True),
    lambda s, b: cm.PinnedBuffer(2.5),
    lambda s, b: cm.memset_d32_async(b, 1.9, 1, s),
    lambda s, b: cm.memset_d32_async(b, 1, 1.0, s),
    lambda s, b: cm.memset_d8_async(b, 0, np.float32(2), s),
    lambda s, b: cm.copy_d_to_d_async(b, b, 2.0, s),
    lambda s, b: cm.copy_h_to_d_async(b, np.zeros(4, np.uint8), True, s),
    lambda s, b: cm.copy_2d_d_to_d_async(b, 8.0, b, 8, 4, 2, s),
    lambda s, b: cm.CudaCtx(0.0),
    lambda s, b: cm.CudaCtx(True),
    lambda s, b: cm.memset_d8_async(b, 0, 4, None),
    lambda s, b: cm.memset_d8_async(b, 0, 4, 1.5),
    lambda s, b: cm.memset_d8_async(3.0, 0, 4, s),
], ids=["DeviceBuffer float", "DeviceBuffer bool", "PinnedBuffer float", "memset value float",
        "memset count float", "memset8 count np.float32", "d2d nbytes float", "h2d nbytes bool", "2d pitch float",
        "CudaCtx float", "CudaCtx bool", "stream None", "stream float", "dst float"])
def test_wrong_types_are_type_errors(ctx, stream, call):
    with cm.DeviceBuffer(64) as buf:
        before = cm.mem_info()[0]
        with pytest.raises(TypeError):
            call(stream, buf)
        assert cm.mem_info()[0] == before


def test_launch_geometry_and_parameters_are_checked(ctx, stream, selftest):
    f = selftest.function("selftest_fill_u32")
    with cm.DeviceBuffer(4 * 64) as out:
        pack = SELFTEST_FILL.pack(out, 1, 64)
        for grid in ((1.5, 1, 1), (0, 1, 1), (1, 1, 1, 1), "1"):
            with pytest.raises((TypeError, HssError)):
                cm.launch_kernel(f, grid, 64, 0, stream, pack)
        with pytest.raises(TypeError, match="shared_bytes must be an int"):
            cm.launch_kernel(f, 1, 64, 0.5, stream, pack)
        with pytest.raises(HssError, match="takes 3 parameters, the pack holds 2"):
            cm.launch_kernel(f, 1, 64, 0, stream, cm.ParamPack(("ptr", "u32"), ("a", "b")))
        with pytest.raises(HssError, match="parameter #2 is 4 bytes"):
            cm.launch_kernel(f, 1, 64, 0, stream, cm.ParamPack(("ptr", "u32", "i64"), ("a", "b", "c")))
        with pytest.raises(TypeError, match="CudaFunction"):
            cm.launch_kernel(f.handle, 1, 64, 0, stream, pack)
        assert f.param_kinds == ("ptr", "u32", "i32") and f.param_sizes == (8, 4, 4)


def test_closed_objects_say_closed(ctx, stream):
    buf = cm.DeviceBuffer(64)
    ptr = buf.ptr
    buf.close()
    with pytest.raises(HssError, match="closed"):
        buf.ptr  # noqa: B018
    for call in (lambda: cm.memset_d8_async(buf, 0, 4, stream), lambda: cm.copy_d_to_h_async(np.zeros(4), buf, 4, 0)):
        with pytest.raises(HssError, match="closed"):
            call()
    assert "closed" in repr(buf) and ptr
    c = cm.CudaCtx(0)
    s = cm.CudaStream(c)
    ev = cm.CudaEvent(ctx=c)
    for obj in (s, ev, c):
        obj.close()
        obj.close()   # idempotent
    for call in (lambda: c.stream, lambda: s.handle, lambda: ev.record(stream), lambda: cm.stream_sync(s),
                 lambda: cm.DeviceBuffer(16, c), lambda: c.synchronize()):
        with pytest.raises(HssError, match="closed"):
            call()


LAST_OWNER = r"""
import sys
from hss import cuda_min as cm
from hss.cuda._driver import api
ctx = cm.CudaCtx(0)
buf = cm.DeviceBuffer(1 << 20, ctx)
mod_ctx = ctx._pctx
def active():
    if cm.driver_status().kind == "emulator":
        return api.state.ctx_refs[0]
    return api.cuDevicePrimaryCtxGetState(mod_ctx.device)[2]
assert active(), "retained while owners live"
ctx.close()
assert active(), "the buffer still holds the context"
buf.close()
print("released" if not active() else "still retained")
"""


def test_the_last_owner_releases_the_primary_context(tmp_path):
    """CudaCtx.close() and the other owners give back their holds; the last one releases the retain (a fresh
    process, so that nothing else holds the device)."""
    import os
    import subprocess
    import sys
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(__import__("pathlib").Path(__file__).parent.parent),
                                                         os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", LAST_OWNER], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "released"


@pytest.mark.emulator
def test_a_fault_in_queued_work_surfaces_at_the_next_sync_and_frees(ctx):
    from hss import emulator
    from hss.emulator.driver import enqueue, stream_of
    from hss.errors import MemoryFault
    s = cm.CudaStream(ctx)

    def fault():
        raise MemoryFault("planted fault")

    buf = cm.DeviceBuffer(1 << 20, ctx)
    used = emulator.state.arena.used
    enqueue(stream_of(s.handle), fault)
    with pytest.raises(MemoryFault, match="planted"):
        buf.close()                         # the free drains the queue: the fault is reported...
    assert emulator.state.arena.used == used - (1 << 20) and buf.closed   # ...and the memory is freed anyway
    cm.stream_sync(s)                       # reported once
    # a fault met by a finalizer (which cannot raise) is kept for the next sync
    buf = cm.DeviceBuffer(4096, ctx)
    enqueue(stream_of(s.handle), fault)
    del buf
    import gc
    gc.collect()
    with pytest.raises(MemoryFault, match="planted"):
        cm.stream_sync(s)
    s.close()
