"""Tests for the page gather (``ptx/page_gather.cu``, :mod:`hss.decls.gather`, :mod:`hss.swap.gather`) and the
HostStore reads that use it.

The kernel against the numpy gather of :mod:`hss.reference.gather` on fresh random bytes that are never zero, into a
destination poisoned with zeros (so a byte left unwritten, or written where no page goes, shows), its pairs read from
device memory and from the mapped index ring; the emulator's contract checks. The HostStore: a group of more than
``gather_min_runs`` runs into pool slots is ONE launch and one fence, the others one batched DMA call, both the same
bytes; the index ring and the write-after-read guard are shown to matter (the emulator runs queued work late). The
swap: exact and sparse steps through the kernel give the DMA path's bits, records and pool, and their in-HBM replays.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from test_swap_orchestrator import Setup, check_sparse, check_step, replay, resident_bytes_match

from hss import cuda_min as cm
from hss.cuda import _driver, ptx
from hss.decls import gather as kg
from hss.errors import EmulatorError, MemoryFault
from hss.reference import gather as ref
from hss.swap import GroupLayout, HostStore
from hss.swap.gather import FENCES, GATHER_MIN_RUNS, SPARSE_GATHER_MIN_RUNS, PageGather, gather_fits
from hss.swap.pool import ScratchPool

from helpers import download

LAYOUT = GroupLayout(num_blocks=24, num_kv_heads=2, block_size=8, head_dim=64)   # 16 KiB pages
NEVER = 1 << 30     # a gather_min_runs no group exceeds: the DMA path only


def fresh(rng: np.random.Generator, nbytes: int) -> np.ndarray:
    """Random bytes 1..255: a zero byte in a destination is one no page wrote."""
    return rng.integers(1, 256, nbytes, dtype=np.uint8)


def zeroed(nbytes: int, stream: int) -> cm.DeviceBuffer:
    buf = cm.DeviceBuffer(nbytes)
    cm.memset_d8_async(buf, 0, nbytes, stream)
    return buf


# -- the kernel --------------------------------------------------------------------------------
@given(data=st.data())
def test_page_gather_is_the_numpy_gather(ctx, stream, rng, data) -> None:
    """Pages of 1 vector up to a few CTAs' worth (edges of GATHER_CHUNK included), sources repeating, distinct
    destinations in random order, pairs in device memory (a direct launch) or in the mapped index ring
    (PageGather): exactly the reference's bytes land, nothing else changes."""
    page_vecs = data.draw(st.sampled_from([1, 3, 64, kg.CHUNK - 1, kg.CHUNK, kg.CHUNK + 1, 2 * kg.CHUNK + 17]))
    n_src, n_dst = data.draw(st.integers(1, 10)), data.draw(st.integers(1, 10))
    n = data.draw(st.integers(1, n_dst))
    pages = np.array(data.draw(st.lists(st.integers(0, n_src - 1), min_size=n, max_size=n)), dtype=np.int32)
    slots = rng.permutation(n_dst)[:n].astype(np.int32)
    via_ring = data.draw(st.booleans())
    pb = kg.VECTOR * page_vecs
    src = cm.PinnedBuffer(n_src * pb)
    src.array[:] = fresh(rng, src.bytes)
    dst = zeroed(n_dst * pb, stream)
    pairs = np.stack([pages, slots], axis=1)
    if via_ring:
        gather = PageGather(2, ctx)
        gather.launch(stream, 1, dst.ptr, src.device_ptr(), pairs, page_vecs)
    else:
        module = ptx.load_module(kg.MODULE, ctx)
        on_device = cm.DeviceBuffer(pairs.nbytes)
        cm.copy_h_to_d_async(on_device, pairs, pairs.nbytes, stream)
        g = kg.gather_geometry(n, page_vecs)
        cm.launch_kernel(module.function("page_gather"), g.grid, g.block, g.shared, stream,
                         [dst, src.device_ptr(), on_device, n, page_vecs])
    got = download(dst, (n_dst, pb), np.uint8, stream)
    want = np.zeros((n_dst, pb), dtype=np.uint8)
    ref.scatter_pages(want.reshape(-1), slots, ref.gather_pages(src.array, pages, pb))
    assert np.array_equal(got, want), f"{n} of {n_src} pages of {pb} bytes into {n_dst} slots (ring {via_ring})"
    if via_ring:
        gather.close()
    else:
        on_device.close()
        module.close()
    dst.close()
    src.close()


def test_reference_gather_refuses_what_is_outside() -> None:
    src = np.arange(64, dtype=np.uint8)
    assert ref.gather_pages(src, np.array([3, 0, 3]), 16).tolist() == [list(range(48, 64)), list(range(16)),
                                                                        list(range(48, 64))]
    with pytest.raises(IndexError, match="page 4 of 16 bytes is outside"):
        ref.gather_pages(src, np.array([0, 4]), 16)
    dst = np.zeros(48, dtype=np.uint8)
    with pytest.raises(ValueError, match="repeat"):
        ref.scatter_pages(dst, np.array([1, 1]), np.ones((2, 16), np.uint8))
    with pytest.raises(IndexError, match="slot -1"):
        ref.scatter_pages(dst, np.array([-1]), np.ones((1, 16), np.uint8))
    assert not dst.any()


@pytest.mark.emulator
def test_emulator_holds_page_gather_to_its_contract(ctx, stream, rng) -> None:
    """A page or slot outside its allocation, or two requests into one slot, is a MemoryFault at the next sync
    (nothing written); a launch off its geometry or misaligned is refused at the launch."""
    pb = 4 * kg.VECTOR
    src = cm.PinnedBuffer(3 * pb)
    src.array[:] = fresh(rng, src.bytes)
    dst = zeroed(2 * pb, stream)
    gather = PageGather(1, ctx)
    for pairs, words in [([[3, 0]], "parameter src .* page 3 of 64 bytes is outside"),
                         ([[0, 2]], "parameter dst .* slot 2 of 64 bytes is outside"),
                         ([[0, 1], [2, 1]], "parameter dst: destination slots repeat")]:
        gather.launch(stream, 0, dst.ptr, src.device_ptr(), np.array(pairs, np.int32), 4)
        with pytest.raises(MemoryFault, match=words):
            cm.stream_sync(stream)
    assert not download(dst, (2 * pb,), np.uint8, stream).any()
    fn = gather.function
    for grid, ptrs, words in [((1, 2, 1), (dst.ptr, src.ptr), "needs grid"),
                              ((1, 1, 1), (dst.ptr + 8, src.ptr), "16-byte aligned")]:
        ring = cm.DeviceBuffer(8)
        with pytest.raises(EmulatorError, match=words):
            cm.launch_kernel(fn, grid, kg.THREADS, 0, stream, [*ptrs, ring, 1, 4])
        ring.close()
    gather.close()
    dst.close()
    src.close()


def test_gather_fits_only_whole_vectors_and_launchable_pages() -> None:
    assert gather_fits(LAYOUT.block_bytes, LAYOUT.num_blocks) and gather_fits(16, 1)
    assert not gather_fits(24, 1) and not gather_fits(0, 1)
    assert not gather_fits(16 * kg.CHUNK * (kg.MAX_CHUNKS + 1), 1) and not gather_fits(16, 2**31)


# -- the HostStore -----------------------------------------------------------------------------
def written_store(ctx, rng, layers: int = 2) -> tuple[HostStore, np.ndarray]:
    """A HostStore of LAYOUT whose every page holds fresh bytes: (store, images uint8 [layers, pages, bytes])."""
    store = HostStore(LAYOUT, layers, ctx=ctx)
    imgs = fresh(rng, layers * LAYOUT.num_blocks * LAYOUT.block_bytes).reshape(layers, LAYOUT.num_blocks, -1)
    for layer in range(layers):
        for page in range(LAYOUT.num_blocks):
            store.write_page(layer, page, imgs[layer, page])
    return store, imgs


def count_calls(monkeypatch, names: tuple[str, ...]) -> list[str]:
    calls: list[str] = []
    for name in names:
        real = getattr(_driver.api, name)
        monkeypatch.setattr(_driver.api, name, lambda *a, _r=real, _n=name: (calls.append(_n), _r(*a))[1])
    return calls


CALLS = ("cuLaunchKernel", "cuMemcpyBatchAsync", "cuMemcpyHtoDAsync", "cuEventRecord")


def test_host_store_gathers_scattered_groups_and_copies_the_others(ctx, stream, rng, monkeypatch) -> None:
    """Reads into pool slots, planned once, groups issued in any order and again: a group of more than
    gather_min_runs runs is one page_gather launch, the others one batched call, each followed by one fence
    (PreparedReads.fence; None after an empty group); every slot holds its page's bytes whichever path read it."""
    assert HostStore.gather_min_runs == GATHER_MIN_RUNS
    store, imgs = written_store(ctx, rng)
    pool = ScratchPool(LAYOUT, 20, num_layers=2, ctx=ctx)
    bb = LAYOUT.block_bytes
    pages = np.array([3, 4, 5, 9, 11, 0, 20, 21, 22, 23, 7, 1], dtype=np.int64)
    base = int(rng.integers(0, 18))           # group 0: pages 3, 4, 5 into consecutive slots, one run; 3 runs in all
    slots = np.array([base, base + 1, base + 2] + rng.permutation([x for x in range(20) if not 0 <= x - base < 3])
                     [:9].tolist(), dtype=np.int64)
    bounds = np.array([0, 5, 5, 12])          # group 1 empty; group 2 mostly one-page runs
    for min_runs in (NEVER, 0, 4):
        store.gather_min_runs = min_runs
        cm.memset_d8_async(pool.ptr, 0, pool.buffer.bytes, stream)
        reads = store.plan_reads(1, pages, pool.ptr + bb * slots, bounds, bounds.tolist(), (pool.slot_table, slots))
        runs = np.diff(reads.run_bounds)
        for i in (2, 0, 1, 2):
            calls = count_calls(monkeypatch, CALLS)
            assert reads.issue(i, stream) == reads.nbytes(i)
            monkeypatch.undo()
            kernel = runs[i] > min_runs
            if not runs[i]:
                assert calls == [] and reads.fence is None
                continue
            assert calls == (["cuLaunchKernel"] if kernel else ["cuMemcpyBatchAsync"]) + ["cuEventRecord"], calls
            assert isinstance(reads.fence, cm.CudaEvent)
        got = download(pool.ptr, (20, bb), np.uint8, stream)
        assert runs[0] == 3 and runs[1] == 0
        assert np.array_equal(got[slots], imgs[1, pages]), f"gather_min_runs {min_runs}"
        assert not np.delete(got, slots, axis=0).any(), "a slot no page goes to was written"
    pool.close()
    store.close()


def test_host_store_public_reads_stay_batched_copies(ctx, stream, rng, monkeypatch) -> None:
    """prepare_reads / read_pages into arbitrary device addresses never launch the kernel (it writes pool slots)."""
    store, imgs = written_store(ctx, rng, 1)
    store.gather_min_runs = 0
    bb = LAYOUT.block_bytes
    dev = zeroed(8 * bb, stream)
    calls = count_calls(monkeypatch, CALLS)
    store.read_pages(stream, 0, [1, 5, 9, 13, 17, 21], [dev.ptr + bb * o for o in (7, 0, 2, 4, 6, 1)])
    monkeypatch.undo()
    assert "cuLaunchKernel" not in calls
    got = download(dev, (8, bb), np.uint8, stream)
    assert np.array_equal(got[[7, 0, 2, 4, 6, 1]], imgs[0, [1, 5, 9, 13, 17, 21]])
    dev.close()
    store.close()


def plan_singles(store: HostStore, pool: ScratchPool, layer: int, pages: list[int], slots: list[int]) -> list:
    """One planned read of one page per group (each through the kernel when gather_min_runs is 0)."""
    bb = LAYOUT.block_bytes
    out = []
    for p, s in zip(pages, slots):
        sl = np.array([s], dtype=np.int64)
        out.append(store.plan_reads(layer, np.array([p], dtype=np.int64), pool.ptr + bb * sl, np.array([0, 1]),
                                    [0, 1], (pool.slot_table, sl)))
    return out


@pytest.mark.emulator
def test_an_index_slot_is_rewritten_only_after_its_launch_ran(ctx, stream, rng, monkeypatch) -> None:
    """FENCES + 3 launches queued back to back (the emulator runs them only at the sync): each reads its own pairs,
    because reusing index slot k first waits for fence k; without that wait the first launches read the pairs
    written over theirs."""
    store, imgs = written_store(ctx, rng, 1)
    store.gather_min_runs = 0
    n = FENCES + 3
    pool = ScratchPool(LAYOUT, n, ctx=ctx)
    pages, slots = rng.permutation(LAYOUT.num_blocks)[:n].tolist(), rng.permutation(n).tolist()
    for broken in (False, True):
        cm.memset_d8_async(pool.ptr, 0, pool.buffer.bytes, stream)
        cm.stream_sync(stream)
        if broken:
            monkeypatch.setattr(store._fences, "take", lambda: store._fences._turn)
        for reads in plan_singles(store, pool, 0, pages, slots):
            reads.issue(0, stream)
        monkeypatch.undo()
        got = download(pool.ptr, (n, LAYOUT.block_bytes), np.uint8, stream)
        same = np.array_equal(got[slots], imgs[0, pages])
        assert same != broken, "broken" if broken else "with the fences"
    pool.close()
    store.close()


@pytest.mark.emulator
def test_a_write_waits_for_the_gathers_that_read_the_old_bytes(ctx, stream, rng, monkeypatch) -> None:
    """A page rewritten while a launch that reads it is queued: the launch copies the old bytes (the write waited for
    its fence); without the wait it would copy the new ones."""
    store, imgs = written_store(ctx, rng, 1)
    store.gather_min_runs = 0
    pool = ScratchPool(LAYOUT, 2, ctx=ctx)
    new = fresh(rng, LAYOUT.block_bytes)
    for broken in (False, True):
        store.write_page(0, 5, imgs[0, 5])
        (reads,) = plan_singles(store, pool, 0, [5], [1])
        reads.issue(0, stream)
        if broken:
            monkeypatch.setattr(store._fences, "wait_all", lambda: None)
        store.write_page(0, 5, new)
        monkeypatch.undo()
        got = download(pool.slot_ptr(1), (LAYOUT.block_bytes,), np.uint8, stream)
        assert np.array_equal(got, new if broken else imgs[0, 5])
    pool.close()
    store.close()


def test_the_index_ring_grows_to_the_widest_group(ctx, stream, rng) -> None:
    """A gathered group wider than the index slots grows them (after the queued launches ran); its pages land."""
    layout = GroupLayout(num_blocks=600, num_kv_heads=1, block_size=1, head_dim=8)   # 8 KiB pages (4 KiB stripes)
    store = HostStore(layout, 1, ctx=ctx)
    store.gather_min_runs = 0
    imgs = fresh(rng, 600 * layout.block_bytes).reshape(600, -1)
    for page in range(600):
        store.write_page(0, page, imgs[page])
    pool = ScratchPool(layout, 600, ctx=ctx)
    pages = rng.permutation(600)[:520].astype(np.int64)
    slots = rng.permutation(600)[:520].astype(np.int64)
    cap = store._gather.capacity
    reads = store.plan_reads(0, pages, pool.ptr + layout.block_bytes * slots, np.array([0, 520]), [0, 520],
                             (pool.slot_table, slots))
    assert cap < 520 <= store._gather.capacity and reads.gather is not None and reads.gather.kernel == [True]
    reads.issue(0, stream)
    got = download(pool.ptr, (600, layout.block_bytes), np.uint8, stream)
    assert np.array_equal(got[slots], imgs[pages])
    pool.close()
    store.close()


def test_a_failed_gather_launch_queues_nothing_and_the_next_read_lands(ctx, stream, rng, monkeypatch) -> None:
    """cuLaunchKernel failing for a gathered group: a CudaError naming the call and the kernel, no fence recorded;
    the same group issued again reads its pages."""
    store, imgs = written_store(ctx, rng, 1)
    store.gather_min_runs = 0
    pool = ScratchPool(LAYOUT, 4, ctx=ctx)
    cm.memset_d8_async(pool.ptr, 0, pool.buffer.bytes, stream)
    (reads,) = plan_singles(store, pool, 0, [7], [2])
    calls = count_calls(monkeypatch, ("cuEventRecord",))
    with _driver.inject_fault("cuLaunchKernel", "CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES"):
        with pytest.raises(cm.CudaError, match="cuLaunchKernel.*page_gather"):
            reads.issue(0, stream)
    assert calls == [] and reads.fence is None
    monkeypatch.undo()
    assert not download(pool.ptr, (4 * LAYOUT.block_bytes,), np.uint8, stream).any()
    reads.issue(0, stream)
    assert np.array_equal(download(pool.slot_ptr(2), (LAYOUT.block_bytes,), np.uint8, stream), imgs[0, 7])
    pool.close()
    store.close()


# -- the swap ----------------------------------------------------------------------------------
SMALL = dict(num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16)


def test_swap_steps_through_the_gather_equal_the_batched_copies(ctx, tmp_path, monkeypatch) -> None:
    """Two swaps fed the same pages and queries, one reading every group into pool slots with page_gather
    (gather_min_runs 0), one with batched copies only: exact and sparse steps (new queries, so promotions evict hits)
    give the same output bits, records and resident sets; each step equals its in-HBM replay and meets the float64
    bound; every resident page holds its bytes; the gather swap never queues a batched copy."""
    seed = int(np.random.default_rng().integers(2**32))
    a, b = (Setup(ctx, tmp_path / name, np.random.default_rng(seed), "host", resident_blocks=14, tile=4,
                  max_blocks=40, dims=SMALL) for name in ("gather", "dma"))
    a.h.store.gather_min_runs, b.h.store.gather_min_runs = 0, NEVER
    b.h.sparse_gather_min_runs = NEVER
    ids = [int(x) for x in np.random.default_rng(seed).permutation(36)]
    for s in (a, b):
        s.offload(0, ids)
    steps = [dict(), dict(budget_pages=9, keep_first=1, keep_recent=2), dict(budget_pages=9, keep_first=1,
                                                                                keep_recent=2), dict(),
             dict(budget_pages=5, keep_recent=1), dict(budget_pages=40)] * 2
    launched = 0
    for n, kw in enumerate(steps):
        (q, qa), (q_b, qb) = a.query(), b.query()     # the same random stream: the same query
        assert np.array_equal(q.view(np.uint16), q_b.view(np.uint16))
        calls = count_calls(monkeypatch, CALLS)
        ra, got_a = a.step(0, ids, qa, q_pos=35 * 16 + 6, **kw)
        monkeypatch.undo()
        rb, got_b = b.step(0, ids, qb, q_pos=35 * 16 + 6, **kw)
        what = f"step {n} {kw}"
        assert np.array_equal(got_a.view(np.uint16), got_b.view(np.uint16)), what
        assert (ra.tiles, ra.promoted, ra.evicted, ra.skipped) == (rb.tiles, rb.promoted, rb.evicted, rb.skipped)
        assert a.h.pool.residents() == b.h.pool.residents(), what
        streamed = sum(t.streamed for t in ra.tiles)
        assert "cuMemcpyBatchAsync" not in calls, what
        launched += streamed
        if "budget_pages" in kw and kw["budget_pages"] < 40:
            check_sparse(a, 0, ids, q, qa, ra, got_a, 7, (kw["budget_pages"], kw.get("keep_first", 1),
                                                         kw.get("keep_recent", 4)), what)
        else:
            check_step(a, 0, ids, q, qa, ra, got_a, 7, what)
        resident_bytes_match(a)
        qa.close()
        qb.close()
    assert launched, "no step read through the kernel"
    a.close()
    b.close()


@pytest.mark.parametrize("timed", [False, True])
def test_a_sparse_step_queues_few_events(ctx, tmp_path, rng, monkeypatch, timed: bool) -> None:
    """A sparse step's event records: the scores, one fence per streamed tile (a HostStore's, no second one of the
    swap's), the stall timer's two only where ``time_sparse_stalls`` (off by default), the step's end, and the
    resident tile's when a promotion waits for it; no ``done`` for the last two tiles (the next step waits for the
    step's end), no ``go`` after the first step."""
    s = Setup(ctx, tmp_path, rng, "host", resident_blocks=10, tile=3, max_blocks=40, dims=SMALL)
    assert s.h.time_sparse_stalls is False
    s.h.time_sparse_stalls = timed
    per_tile = 3 if timed else 1
    ids = [int(b) for b in rng.permutation(36)]
    s.offload(0, ids)
    for n in range(6):
        q, q_dev = s.query()
        calls = count_calls(monkeypatch, ("cuEventRecord",))
        rec, got = s.step(0, ids, q_dev, q_pos=35 * 16 + 4, budget_pages=7, keep_first=1, keep_recent=1)
        monkeypatch.undo()
        ns = sum(t.streamed for t in rec.tiles)
        extra = 1 if n == 0 else 0     # the first step's go
        assert len(calls) <= 1 + per_tile * ns + 1 + 1 + extra + max(ns - 2, 0), (n, ns, calls)
        assert len(calls) >= 1 + per_tile * ns + 1 + extra + max(ns - 2, 0), (n, ns, calls)
        check_sparse(s, 0, ids, q, q_dev, rec, got, 5, (7, 1, 1), f"step {n}")
        q_dev.close()
    s.close()


def test_by_default_only_a_sparse_steps_scattered_tiles_go_through_the_kernel(ctx, tmp_path, rng,
                                                                             monkeypatch) -> None:
    """The defaults: an exact step's tiles are batched copies (HostStore.gather_min_runs: off), a sparse step's tiles
    of more than one run are one page_gather launch each (HighSpeedSwap.sparse_gather_min_runs), one of a single run
    one batched copy; the steps are right either way."""
    s = Setup(ctx, tmp_path, rng, "host", resident_blocks=10, tile=3, max_blocks=40, dims=SMALL)
    assert s.h.store.gather_min_runs == GATHER_MIN_RUNS == NEVER and s.h.sparse_gather_min_runs == 1
    assert SPARSE_GATHER_MIN_RUNS == 1
    ids = [int(b) for b in rng.permutation(36)]
    s.offload(0, ids)
    real = s.h.store.plan_reads
    kinds = set()
    for n in range(10):
        q, q_dev = s.query()
        kw = dict(budget_pages=7, keep_first=1, keep_recent=1) if n % 2 else {}
        plans: list = []
        monkeypatch.setattr(s.h.store, "plan_reads", lambda *a: plans.append(real(*a)) or plans[-1])
        calls = count_calls(monkeypatch, ("cuMemcpyBatchAsync",))
        rec, got = s.step(0, ids, q_dev, q_pos=35 * 16 + 4, **kw)
        monkeypatch.undo()
        reads, = plans
        runs = np.diff(reads.run_bounds).tolist()
        kernel = [bool(kw) and r > 1 for r in runs]
        assert (reads.gather.kernel if reads.gather else [False] * len(runs)) == kernel, (n, runs)
        assert len(calls) == sum(r > 0 and not k for r, k in zip(runs, kernel)), (n, runs, calls)
        kinds.update(zip(kernel, [bool(kw)] * len(kernel)))
        if kw:
            check_sparse(s, 0, ids, q, q_dev, rec, got, 5, (7, 1, 1), f"step {n}")
        else:
            check_step(s, 0, ids, q, q_dev, rec, got, 5, f"step {n}")
        resident_bytes_match(s)
        q_dev.close()
    assert (True, True) in kinds and (False, False) in kinds, kinds
    s.close()


@pytest.mark.emulator
def test_the_attention_waits_for_the_stores_fence(ctx, tmp_path, rng, monkeypatch) -> None:
    """The attention stream orders each streamed tile after the HostStore's fence of its reads (no event of the
    swap's own): without that wait the emulator attends slots the gather has not written yet."""
    s = Setup(ctx, tmp_path, rng, "host", resident_blocks=10, tile=3, max_blocks=40, dims=SMALL)
    s.h.store.gather_min_runs = 0
    ids = [int(b) for b in rng.permutation(36)]
    s.offload(0, ids)
    real = cm.stream_wait_event
    for broken in (False, True, False):
        q, q_dev = s.query()
        if broken:
            fences = s.h.store._fences.events
            monkeypatch.setattr(cm, "stream_wait_event",
                                lambda st, ev: None if any(ev is f for f in fences) else real(st, ev))
        rec, got = s.step(0, ids, q_dev, budget_pages=9, keep_first=1, keep_recent=1)
        monkeypatch.undo()
        s.h.copy_stream.synchronize()
        same = np.array_equal(got.view(np.uint16), replay(s, 0, rec, q_dev).view(np.uint16))
        assert same != broken, "without the fence wait" if broken else "with it"
        q_dev.close()
    s.close()


@pytest.mark.emulator
def test_the_next_steps_reads_wait_for_the_last_tiles(ctx, tmp_path, rng, monkeypatch) -> None:
    """No ``done`` is recorded after the last two tiles and no ``go`` after the first step: the next step's copy
    stream waits for the previous step's end instead. The copy stream run first (as a device may): without that
    wait the next step's first reads overwrite the stream buffers the previous step's last tiles attend."""
    s = Setup(ctx, tmp_path, rng, "host", resident_blocks=6, tile=2, max_blocks=20, dims=SMALL)   # 2 + 2 x 2
    ids = list(range(16))
    s.offload(0, ids)
    out1 = cm.DeviceBuffer(s.out.bytes)
    c = s.h.copy_stream.handle
    real_wait, real_sync = cm.stream_wait_event, s.h._step.ev_scores.synchronize
    for broken in (False, True, False):
        (_, q1), (_, q2) = s.query(), s.query()
        rec1 = s.h.attend_layer(s.ctx, 0, ids, q1, out1)
        monkeypatch.setattr(s.h._step.ev_scores, "synchronize", lambda: (s.h.copy_stream.synchronize(), real_sync())[1])
        if broken:
            monkeypatch.setattr(cm, "stream_wait_event", lambda st, ev: None if st == c and
                                ev is s.h._step.ev_step_done else real_wait(st, ev))
        s.h.attend_layer(s.ctx, 0, ids[8:] + ids[:8], q2, s.out)
        monkeypatch.undo()
        got = download(out1, (SMALL["num_q_heads"], SMALL["head_dim"]), np.uint16, s.stream)
        same = np.array_equal(got, replay(s, 0, rec1, q1).view(np.uint16))
        assert same != broken, "without the wait" if broken else "with it"
        if broken:
            s.h.pool.clear()         # forget what the broken step left in the pool (promotions copied late)
        q1.close()
        q2.close()
    out1.close()
    s.close()


@pytest.mark.emulator
def test_an_exact_step_after_a_sparse_one_waits_for_its_table_upload(ctx, tmp_path, rng, monkeypatch) -> None:
    """A sparse step records no second ``scores`` event after its table upload: an exact step after it waits for its
    end before refilling the pinned tables; waiting for the scores event instead lets the sparse step's queued upload
    copy the exact step's tables (the emulator reads pinned memory when the copy runs)."""
    s = Setup(ctx, tmp_path, rng, "host", resident_blocks=10, tile=3, max_blocks=40, dims=SMALL)
    ids = [int(b) for b in rng.permutation(36)]
    s.offload(0, ids)
    out1 = cm.DeviceBuffer(s.out.bytes)
    for broken in (False, True, False):
        (_, q1), (_, q2) = s.query(), s.query()
        rec1 = s.h.attend_layer(s.ctx, 0, ids, q1, out1, budget_pages=9, keep_first=1, keep_recent=1)
        if broken:
            monkeypatch.setattr(s.h._step, "tables_fence", s.h._step.ev_scores)
        s.h.attend_layer(s.ctx, 0, ids, q2, s.out)
        monkeypatch.undo()
        got = download(out1, (SMALL["num_q_heads"], SMALL["head_dim"]), np.uint16, s.stream)
        same = np.array_equal(got, replay(s, 0, rec1, q1).view(np.uint16))
        assert same != broken, "waiting for the scores event" if broken else "waiting for the step's end"
        if broken:
            s.h.pool.clear()
        q1.close()
        q2.close()
    out1.close()
    s.close()


def test_a_step_whose_end_cannot_be_recorded_keeps_the_pool_honest(ctx, tmp_path, rng, monkeypatch) -> None:
    """A sparse step interrupted at its last driver call (the step's end event): the promotions whose reads were
    queued are in the pool (their slots hold their bytes), and the next step orders its reads after the interrupted
    step's work through ``go`` (its ``step_done`` is stale) and is exact."""
    s = Setup(ctx, tmp_path, rng, "host", resident_blocks=4, tile=1, max_blocks=12, dims=SMALL)   # 2 + 2 x 1
    s.h.store.gather_min_runs = 0
    ids = [int(b) for b in rng.permutation(10)]
    s.offload(0, ids)
    moved = 0
    for n in range(12):
        (_, q_bad), (q, q_dev) = s.query(), s.query()
        before = s.h.pool.residents()

        def interrupted(stream):
            raise KeyboardInterrupt("interrupted at the step's end")
        monkeypatch.setattr(s.h._step.ev_step_done, "record", interrupted)
        with pytest.raises(KeyboardInterrupt):
            s.h.attend_layer(ctx, 0, ids, q_bad, s.out, budget_pages=3, keep_first=0, keep_recent=1)
        monkeypatch.undo()
        moved += s.h.pool.residents() != before
        resident_bytes_match(s)
        rec, got = s.step(0, ids, q_dev, budget_pages=3, keep_first=0, keep_recent=1)
        check_sparse(s, 0, ids, q, q_dev, rec, got, 16, (3, 0, 1), f"step {n}")
        resident_bytes_match(s)
        q_bad.close()
        q_dev.close()
    assert moved, "no interrupted step promoted a page"
    s.close()


@pytest.mark.gpu
def test_page_gather_at_the_benchmark_size(ctx, stream, rng) -> None:
    """The sparse benchmark's group on the device: 226 scattered pages of 64 KiB (8 kv heads x 16 tokens x 128, bf16)
    from a 128 MiB mapped store into pool slots: the reference's bytes."""
    layout = GroupLayout(num_blocks=2048, num_kv_heads=8, block_size=16, head_dim=128)
    src = cm.PinnedBuffer(2048 * layout.block_bytes)
    src.array[:] = fresh(rng, src.bytes)
    pages = np.sort(rng.permutation(2048)[:226]).astype(np.int32)
    slots = rng.permutation(512)[:226].astype(np.int32)
    dst = zeroed(512 * layout.block_bytes, stream)
    gather = PageGather(1, ctx)
    gather.reserve(226)
    gather.launch(stream, 0, dst.ptr, src.device_ptr(), np.stack([pages, slots], axis=1), layout.block_bytes // 16)
    got = download(dst, (512, layout.block_bytes), np.uint8, stream)
    assert np.array_equal(got[slots], src.array.reshape(2048, -1)[pages])
    assert not np.delete(got, slots, axis=0).any()
    gather.close()
    dst.close()
    src.close()
