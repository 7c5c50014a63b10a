"""State-machine fuzzing of HighSpeedSwap: random sequences of disk block allocations and reference counts, offloads
(with and without the predictor), decode steps over random page lists, hostile arguments, store faults (a failing
pread of the FileStore; a store write that fails at once or part way: the FileStore's pwrite, the HostStore's copy),
driver faults during an offload (the projection's launch, after the store write) and driver faults or interrupts at
any driver call of a step, against a plain-Python model (the allocator's ids and counts, which pages of which layer
are readable, their K/V).

After every rule: the allocator, the store's validity and the diagnostic counts equal the model; every page resident
in the scratch pool holds exactly the bytes of its (readable) page; a step's output equals, bit for bit, in-HBM tiled
attention over the tiles it recorded, and float64 attention over its pages under the bf16 bound; a failed rule
changed nothing: a failed offload leaves the page's stored bytes, its A_g slot and the pool as they were, and a retry
of it works (only where the page's old bytes cannot be written back either is that one page unreadable, and the model
says so). Steps run exact or in the sparse mode (docs/design.md §17.6): the model picks the attended pages from the
predictor's own scores, and only those that were not resident are read. At teardown the swap is closed: ``mem_info`` is
back to its start value, the files are gone.
"""
from __future__ import annotations

import errno
import gc
import os
import shutil
import tempfile
from contextlib import contextmanager

import numpy as np
import pytest
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from test_fuzz_qsa import live_buffers
from test_qsa_indexer import driver_calls

from hss import cuda_min as cm
from hss import inject_fault
from hss.attention import TiledAttention, TiledAttentionDims
from hss.cuda._driver import CudaError, HssError
from hss.reference import attention as ref
from hss.swap import HighSpeedSwap, HighSpeedSwapConfig, HostStore, ModelDims, StoreError, StoreIOError

from helpers import BF16, assert_close, download, upload

LAYERS, BLOCKS, NQ, NKV, HD, BS = 2, 10, 4, 2, 64, 16
PAGE = (BS, NKV, HD)
RUNS = {"emulator": dict(max_examples=20, stateful_step_count=20), "gpu": dict(max_examples=20, stateful_step_count=25),
        "sanitize": dict(max_examples=2, stateful_step_count=8)}


SPARSE = st.none() | st.tuples(st.integers(0, 6), st.integers(0, 3), st.integers(0, 3))   # (K, F, R) or exact


def sparse_kw(sparse: tuple[int, int, int] | None) -> dict:
    return {} if sparse is None else dict(budget_pages=sparse[0], keep_first=sparse[1], keep_recent=sparse[2])


class Allocator:
    """The model of the disk block-id allocator (docs/design.md §8.4): LIFO free list, then never-used ids."""

    def __init__(self) -> None:
        self.next, self.free, self.refs = 0, [], {}

    def alloc(self) -> int | None:
        if self.free:
            b = self.free.pop()
        elif self.next < BLOCKS:
            b, self.next = self.next, self.next + 1
        else:
            return None
        self.refs[b] = 1
        return b


@contextmanager
def failing(name: str, at: int, err: int):
    """``os.<name>`` fails with ``err`` at its ``at``-th call (from 0) inside the block."""
    real = getattr(os, name)
    count = [0]

    def call(*a, **kw):
        count[0] += 1
        if count[0] - 1 == at:
            raise OSError(err, os.strerror(err))
        return real(*a, **kw)

    setattr(os, name, call)
    try:
        yield count
    finally:
        setattr(os, name, real)


@contextmanager
def failing_writes(store, plan: tuple):
    """The store's writes follow ``plan`` (then succeed): "fail" fails at once (ENOSPC), "part" writes some bytes
    first (4096: O_DIRECT's unit), "ok" writes. A FileStore's pwrite fails; a HostStore's copy."""
    calls = [0]

    def step() -> str:
        what = plan[calls[0]] if calls[0] < len(plan) else "ok"
        calls[0] += 1
        return what

    if isinstance(store, HostStore):
        real = store._write

        def write(layer, page, offset, data):
            what = step()
            if what == "part":
                real(layer, page, offset, data[:data.nbytes // 2])
            if what != "ok":
                raise StoreIOError(layer, page, 0, 0, "injected failure", errno.ENOSPC)
            real(layer, page, offset, data)

        store._write = write
        try:
            yield calls
        finally:
            del store._write
        return
    real_pwrite = os.pwrite
    plan = tuple(w for what in plan for w in (("part", "fail") if what == "part" else (what,)))   # (pwrite loops)

    def pwrite(fd, data, off):
        what = step()
        if what == "fail":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        if what == "part":
            return real_pwrite(fd, memoryview(data)[:4096], off)
        return real_pwrite(fd, data, off)

    os.pwrite = pwrite
    try:
        yield calls
    finally:
        os.pwrite = real_pwrite


class SwapMachine(RuleBasedStateMachine):
    @initialize(seed=st.integers(0, 2**32 - 1), store=st.sampled_from(["host", "host-gather", "file"]),
                tile=st.integers(1, 2), resident=st.integers(0, 3))
    def setup(self, seed: int, store: str, tile: int, resident: int) -> None:
        gather = store == "host-gather"     # every HostStore read into the pool through page_gather
        store = "host" if gather else store
        self.ctx = cm.CudaCtx(0)
        self.s = self.ctx.stream
        gc.collect()   # what earlier tests dropped is freed now, not during this run
        self.free0, self.live0 = cm.mem_info()[0], live_buffers()
        self.rng = np.random.default_rng(seed)
        self.dir = tempfile.mkdtemp(prefix="hss-fuzz-")
        self.cfg = HighSpeedSwapConfig(os.path.join(self.dir, "kv"), 1 << 30, resident + 2 * tile, 16, 2, False, seed,
                                       store=store, stream_tile_blocks=tile)
        self.h = HighSpeedSwap(self.ctx, self.cfg, ModelDims(LAYERS, BLOCKS, NQ, NKV, HD, BS))
        if gather:
            self.h.store.gather_min_runs = 0
        self.ids = Allocator()
        self.k = np.zeros((LAYERS, BLOCKS, *PAGE), BF16)
        self.v = np.zeros((LAYERS, BLOCKS, *PAGE), BF16)
        self.valid: set[tuple[int, int]] = set()
        self.out = cm.DeviceBuffer(2 * NQ * HD)
        self.small = cm.DeviceBuffer(64)
        self.q = (self.rng.standard_normal((NQ, HD))).astype(BF16)
        self.q_dev = upload(self.q, self.s)
        for layer in range(LAYERS):    # a few readable pages to start from
            for b in self.rng.permutation(BLOCKS)[:6].tolist():
                self.offload(layer=layer, b=b, predict=bool(b % 2))
        cm.stream_sync(self.s)

    def teardown(self) -> None:
        if not hasattr(self, "h"):
            return
        self.h.close()
        for b in (self.out, self.small, self.q_dev):
            b.close()
        gc.collect()
        assert live_buffers() == self.live0, "an hss buffer (device or pinned) was not freed"
        assert cm.mem_info()[0] == self.free0, "device memory was not given back"
        self.ctx.close()
        shutil.rmtree(self.dir)

    # -- helpers -------------------------------------------------------------------------------------------
    def page(self) -> tuple[np.ndarray, np.ndarray]:
        k = (self.rng.standard_normal(PAGE) / np.sqrt(HD)).astype(BF16)
        v = self.rng.standard_normal(PAGE).astype(BF16)
        return k, v

    def readable(self, layer: int) -> list[int]:
        return sorted(b for (lay, b) in self.valid if lay == layer)

    def scores(self, layer: int, ids: list[int]) -> list[float]:
        """The swap's predictor kernels run directly: the scores of ``ids`` for the machine's query."""
        n = max(ids) + 1
        q_proj, scores = cm.DeviceBuffer(2 * NQ * self.cfg.rank), cm.DeviceBuffer(4 * n)
        self.h.predictor.project_q_on_stream(self.s, self.q_dev, q_proj)
        self.h.predictor.score_layer_on_stream(self.s, q_proj, layer, 0, n, scores)
        got = download(scores, n, np.float32, self.s)[ids]
        q_proj.close()
        scores.close()
        return got.tolist()

    def attended(self, layer: int, ids: list[int], sparse: tuple[int, int, int] | None) -> list[int]:
        """The model of docs/design.md §17.6: every page (exact), or the first F and last R plus the K others that score
        best (ties to the earlier page), in sequence order."""
        if sparse is None or not ids:
            return ids
        k, f, r = sparse
        sc = self.scores(layer, ids)
        forced = set(range(min(f, len(ids)))) | set(range(max(len(ids) - r, 0), len(ids)))
        others = sorted((i for i in range(len(ids)) if i not in forced), key=lambda i: (-sc[i], i))
        return [ids[i] for i in sorted(forced | set(others[:k]))]

    def check_step(self, layer: int, ids: list[int], lbvs: int, rec, sparse: tuple[int, int, int] | None = None
                   ) -> None:
        assert rec.block_ids.tolist() == ids
        want = self.attended(layer, ids, sparse)
        assert list(rec.attended) == want and list(rec.skipped) == [b for b in ids if b not in want]
        if want and want[-1] != ids[-1]:
            lbvs = BS          # the sequence's partial last page is skipped: every attended page is whole
        ids = want
        got = download(self.out, (NQ, HD), BF16, self.s)
        flat = [b for t in rec.tiles for b in t.block_ids]
        assert sorted(flat) == sorted(ids), "the schedule must attend every selected page once"
        # in-HBM replay of the recorded tiles over NHD pools indexed by block id: the same bits
        kd, vd = upload(self.k[layer], self.s), upload(self.v[layer], self.s)
        cap = max([len(t.block_ids) for t in rec.tiles] + [1])
        mine = cm.DeviceBuffer(2 * NQ * HD)
        keep = []
        with TiledAttention(self.ctx, TiledAttentionDims(1, NQ, NKV, HD, BS, cap)) as ta:
            ta.begin_step(self.s, 1)
            for t in rec.tiles:
                table = np.zeros(cap, np.int32)
                table[:len(t.block_ids)] = t.block_ids
                keep += [upload(table, self.s), upload(np.array([len(t.block_ids)], np.int32), self.s)]
                ta.step_tile(self.s, self.q_dev, kd, vd, keep[-2], keep[-1], 1, *ta.paged_strides(),
                             t.last_block_valid_slots)
            ta.finalize(self.s, mine, 1)
            want_bits = download(mine, (NQ, HD), BF16, self.s)
        for b in keep + [kd, vd, mine]:
            b.close()
        assert np.array_equal(got.view(np.uint16), want_bits.view(np.uint16)), "streamed step != in-HBM replay"
        counts = [BS] * len(ids)
        if ids:
            counts[-1] = min(max(lbvs, 0), BS)
        kt = np.concatenate([self.k[layer, b, :n] for b, n in zip(ids, counts)]) if ids else self.k[layer, :0, 0]
        vt = np.concatenate([self.v[layer, b, :n] for b, n in zip(ids, counts)]) if ids else self.v[layer, :0, 0]
        assert_close(got, ref.attention(self.q, kt, vt), "bf16", (1,), "step vs float64 attention")

    def nothing_queued(self, call, exc) -> None:
        with driver_calls() as seen:
            with pytest.raises(exc):
                call()
        assert seen == [], f"device work before the error: {seen}"

    # -- rules ---------------------------------------------------------------------------------------------
    @rule()
    def alloc(self) -> None:
        assert self.h.alloc_disk_block() == self.ids.alloc()

    @rule(b=st.integers(0, BLOCKS - 1))
    def inc_ref(self, b: int) -> None:
        if self.ids.refs.get(b, 0) > 0:
            self.h.inc_ref(b)
            self.ids.refs[b] += 1
        else:
            self.nothing_queued(lambda: self.h.inc_ref(b), HssError)

    @rule(b=st.integers(0, BLOCKS - 1))
    def dec_ref(self, b: int) -> None:
        if b >= self.ids.next:
            return self.nothing_queued(lambda: self.h.dec_ref(b), HssError)
        n = self.ids.refs[b]
        freed = self.h.dec_ref(b)
        assert freed == (n == 1)
        if n:
            self.ids.refs[b] = n - 1
        if freed:
            self.ids.free.append(b)
            self.valid -= {(layer, b) for layer in range(LAYERS)}

    @rule(layer=st.integers(0, LAYERS - 1), b=st.integers(0, BLOCKS - 1), predict=st.booleans())
    def offload(self, layer: int, b: int, predict: bool) -> None:
        k, v = self.page()
        if predict:
            kd = upload(k, self.s)
            self.h.offload_block(self.ctx, layer, b, kd, k, v)
            cm.stream_sync(self.s)
            kd.close()
        else:
            self.h.offload_block_no_predict_on_stream(self.s, layer, b, k, v)
        self.k[layer, b], self.v[layer, b] = k, v
        self.valid.add((layer, b))

    @rule(layer=st.integers(0, LAYERS - 1), data=st.data(), lbvs=st.integers(-1, BS + 1), sparse=SPARSE)
    def step(self, layer: int, data, lbvs: int, sparse: tuple[int, int, int] | None) -> None:
        pages = self.readable(layer)
        ids = data.draw(st.permutations(pages).flatmap(lambda p: st.integers(0, len(p)).map(lambda n: p[:n])))
        before = set(p for (lay, p) in self.h.pool.residents() if lay == layer)
        read0 = self.h.diagnostic_summary().bytes_read
        rec = self.h.attend_layer(self.ctx, layer, ids, self.q_dev, self.out, lbvs, **sparse_kw(sparse))
        event(f"step: {min(len(ids), 4)}{'+' if len(ids) >= 4 else ''} pages, {'some' if rec.hits else 'no'} hits, "
              f"{'some' if rec.promoted else 'no'} promotions, {'exact' if sparse is None else 'sparse'}"
              + (f", {'some' if rec.skipped else 'none'} skipped" if sparse else ""))
        self.check_step(layer, list(ids), lbvs, rec, sparse)
        attended = set(rec.attended)           # only the attended pages that were not resident are read
        assert set(rec.misses) == attended - before and set(rec.hits) == attended & before
        assert self.h.diagnostic_summary().bytes_read - read0 == len(rec.misses) * self.h.layout.block_bytes

    @precondition(lambda self: any((lay, b) not in self.valid for lay in range(LAYERS) for b in range(BLOCKS)))
    @rule(layer=st.integers(0, LAYERS - 1), data=st.data())
    def step_over_an_unreadable_page(self, layer: int, data) -> None:
        """Exact, or sparse with the unreadable page anywhere (one it would skip too): a StoreError, nothing queued."""
        missing = [b for b in range(BLOCKS) if (layer, b) not in self.valid]
        if not missing:
            return
        ids = self.readable(layer)[:3]
        ids.insert(data.draw(st.integers(0, len(ids))), data.draw(st.sampled_from(missing)))
        sparse = data.draw(SPARSE)
        self.nothing_queued(lambda: self.h.attend_layer(self.ctx, layer, ids, self.q_dev, self.out,
                                                        **sparse_kw(sparse)), StoreError)

    @rule(kind=st.integers(0, 16), layer=st.integers(0, LAYERS - 1))
    def hostile(self, kind: int, layer: int) -> None:
        """A bad argument: an error naming it before any device work; nothing changed (the invariants)."""
        h, k, v = self.h, *self.page()
        ids = self.readable(layer)[:2]
        cases = [
            (lambda: h.attend_layer(self.ctx, layer, ids, self.q_dev, h.pool.slot_ptr(0)), HssError),  # its pool
            (lambda: h.attend_layer(self.ctx, layer, ids, self.q_dev, h.predictor._a_g), HssError),    # A_g
            (lambda: h.attend_layer(self.ctx, layer, ids, self.q_dev, self.small), HssError),          # too small
            (lambda: h.attend_layer(self.ctx, layer, ids + ids[:1], self.q_dev, self.out), HssError),  # repeats
            (lambda: h.attend_layer(self.ctx, layer, [BLOCKS], self.q_dev, self.out), HssError),       # range
            (lambda: h.offload_block(self.ctx, layer, 0, self.small, k, v), HssError),                 # k page small
            (lambda: h.offload_block_no_predict_on_stream(self.s, layer, 0, k.astype(np.float16), v), HssError),
            (lambda: h.offload_block_no_predict_on_stream(self.s, layer, 0, np.ascontiguousarray(
                k.transpose(1, 0, 2)), v), HssError),                                                   # HND
            (lambda: h.attend_layer(self.ctx, 1.0, ids, self.q_dev, self.out), TypeError),
            (lambda: h.attend_layer(self.ctx, layer, ids, self.q_dev, self.out, budget_pages=-1), HssError),
            (lambda: h.attend_layer(self.ctx, layer, ids, self.q_dev, self.out, budget_pages=True), TypeError),
            (lambda: h.attend_layer(self.ctx, layer, ids, self.q_dev, self.out, budget_pages=1, keep_recent=1.0),
             TypeError),
            (lambda: h.attend_layer(self.ctx, layer, ids, self.q_dev, self.out, keep_first=1), HssError),
            (lambda: h.attend_layer(self.ctx, layer, ids, self.q_dev, self.store_memory()), HssError),  # the store's
            (lambda: h.offload_block(self.ctx, layer, 0, self.store_memory(), k, v), HssError),
            (lambda: h.store.read_pages(self.s, layer, ids[:1], [self.store_memory()]), HssError),
            (lambda: h.store.read_pages(self.s, layer, ids[:2], [self.out.ptr] * 2), HssError),       # overlap
        ]
        call, exc = cases[kind]
        if (kind == 3 and not ids) or (kind == 15 and not ids) or (kind == 16 and len(ids) < 2):
            return
        self.nothing_queued(call, exc)

    @rule(layer=st.integers(0, LAYERS - 1), at=st.integers(0, 25), interrupt=st.booleans(), data=st.data(),
          sparse=SPARSE)
    def driver_fault(self, layer: int, at: int, interrupt: bool, data, sparse: tuple[int, int, int] | None) -> None:
        """A step (exact or sparse) whose ``at``-th driver call fails or is interrupted: the model does not move; a
        step with fewer driver calls succeeds and is exact."""
        pages = data.draw(st.permutations(self.readable(layer)))
        with driver_calls(at, interrupt) as seen:
            try:
                rec = self.h.attend_layer(self.ctx, layer, pages, self.q_dev, self.out, **sparse_kw(sparse))
            except (CudaError, KeyboardInterrupt):
                assert len(seen) > at
                event(f"driver fault: failed at {seen[at]}")
                return
        event("driver fault: the step had fewer calls")
        self.check_step(layer, list(pages), BS, rec, sparse)

    @precondition(lambda self: self.cfg.store == "file")
    @rule(layer=st.integers(0, LAYERS - 1), at=st.integers(0, 6), data=st.data())
    def read_fault(self, layer: int, at: int, data) -> None:
        """The FileStore's ``at``-th pread fails (EIO): a StoreIOError naming the layer; the model does not move."""
        pages = data.draw(st.permutations(self.readable(layer)))
        with failing("preadv", at, errno.EIO) as count:
            try:
                rec = self.h.attend_layer(self.ctx, layer, pages, self.q_dev, self.out)
            except StoreIOError as exc:
                assert exc.layer == layer and exc.page in pages and count[0] > at
                event("read fault: failed")
                return
        self.check_step(layer, list(pages), BS, rec)

    def store_memory(self) -> int:
        """An address inside memory the swap's store owns (its pinned pages, or its bounce ring)."""
        st = self.h.store
        return st.buffer.ptr + self.h.layout.block_bytes if isinstance(st, HostStore) else st.bounce.ptr

    def offload_state(self, layer: int, b: int) -> tuple:
        """What a failed offload of (layer, b) must leave alone: the bytes the store serves for it (None: unreadable),
        its A_g slot, the pool's residents and free list."""
        cm.stream_sync(self.s)
        data = None
        if self.h.store.page_valid(layer, b):
            dev = cm.DeviceBuffer(self.h.layout.block_bytes)
            self.h.store.read_pages(self.s, layer, [b], [dev.ptr])
            data = download(dev, (self.h.layout.block_bytes,), np.uint8, self.s)
            dev.close()
        a_g = self.h.predictor.read_k_lr_slot(self.ctx, layer, b).view(np.uint16).copy()
        return data, a_g, self.h.pool.residents(), self.h.pool.free_slots()

    def try_offload(self, layer: int, b: int, predict: bool, k: np.ndarray, v: np.ndarray) -> None:
        if predict:
            kd = upload(k, self.s)
            try:
                self.h.offload_block(self.ctx, layer, b, kd, k, v)
                cm.stream_sync(self.s)
            finally:
                kd.close()
        else:
            self.h.offload_block_no_predict_on_stream(self.s, layer, b, k, v)

    def after_failure(self, layer: int, b: int, before: tuple, lost: bool, retry: bool, predict: bool) -> None:
        """Nothing changed (or, ``lost``, the page is unreadable and gone from the pool); a retry then works."""
        data, a_g, residents, free = self.offload_state(layer, b)
        assert np.array_equal(a_g, before[1]), "a failed offload changed the A_g slot"
        if lost:
            assert data is None and (layer, b) not in residents
            self.valid.discard((layer, b))
            before_residents = {key: slot for key, slot in before[2].items() if key != (layer, b)}
            assert residents == before_residents, "a lost page changed other residents"
        else:
            assert (data is None) == (before[0] is None), "a failed offload changed the page's validity"
            assert data is None or np.array_equal(data, before[0]), "a failed offload changed the stored bytes"
            assert (residents, free) == before[2:], "a failed offload changed the pool"
        if retry:
            k, v = self.page()
            self.try_offload(layer, b, predict, k, v)
            self.k[layer, b], self.v[layer, b] = k, v
            self.valid.add((layer, b))

    @rule(layer=st.integers(0, LAYERS - 1), b=st.integers(0, BLOCKS - 1), predict=st.booleans(),
          how=st.sampled_from(["fail", "part"]), twice=st.booleans(), retry=st.booleans())
    def write_fault(self, layer: int, b: int, predict: bool, how: str, twice: bool, retry: bool) -> None:
        """The store's write of a page fails (ENOSPC; at once or part way): a StoreIOError naming it; the page's stored
        bytes, its A_g slot and the pool are as before; ``twice``: writing its old bytes back fails too, so a page that
        was readable is no longer (the error says so). A retry works."""
        before = self.offload_state(layer, b)
        k, v = self.page()
        with failing_writes(self.h.store, (how, "fail" if twice else "ok")):
            with pytest.raises(StoreIOError, match=f"layer {layer} page {b} ") as info:
                self.try_offload(layer, b, predict, k, v)
        lost = twice and before[0] is not None
        assert ("previous bytes are lost" in str(info.value)) == lost
        event(f"write fault: {how}{', page lost' if lost else ''}")
        self.after_failure(layer, b, before, lost, retry, predict)

    @rule(layer=st.integers(0, LAYERS - 1), b=st.integers(0, BLOCKS - 1), undo_fails=st.booleans(),
          retry=st.booleans())
    def projection_fault(self, layer: int, b: int, undo_fails: bool, retry: bool) -> None:
        """The projection's launch fails after the store write (an injected driver fault): the CudaError propagates
        and the page's old bytes are put back (``undo_fails``: that write fails too: a readable page is lost, a
        StoreIOError says so); the A_g slot and the pool are as before. A retry works."""
        before = self.offload_state(layer, b)
        lost = undo_fails and before[0] is not None
        k, v = self.page()
        with failing_writes(self.h.store, ("ok", "fail" if undo_fails else "ok")):
            with inject_fault("cuLaunchKernel", "CUDA_ERROR_LAUNCH_FAILED"):
                with pytest.raises(StoreIOError if lost else CudaError):
                    self.try_offload(layer, b, True, k, v)
        event(f"projection fault{', page lost' if lost else ''}")
        self.after_failure(layer, b, before, lost, retry, True)

    # -- invariants ----------------------------------------------------------------------------------------
    @invariant()
    def swap_equals_its_model(self) -> None:
        if not hasattr(self, "h"):
            return
        h = self.h
        d = h.diagnostic_summary()
        assert h.disk_free_count() == len(self.ids.free) + BLOCKS - self.ids.next
        assert d.active_disk_blocks == self.ids.next - len(self.ids.free)
        for b in range(self.ids.next):
            assert h.disk.refcount(b) == self.ids.refs[b]
        for layer in range(LAYERS):
            for b in range(BLOCKS):
                assert h.store.page_valid(layer, b) == ((layer, b) in self.valid)
        cm.stream_sync(self.s)
        h.copy_stream.synchronize()
        for (layer, b), slot in h.pool.residents().items():
            assert (layer, b) in self.valid, f"an unreadable page {(layer, b)} is resident"
            got = download(h.pool.slot_ptr(slot), (h.layout.block_bytes,), np.uint8, self.s)
            want = h.layout.pack_page(self.k[layer, b], self.v[layer, b])
            assert np.array_equal(got, want), f"resident page {(layer, b)} in slot {slot} holds other bytes"


TestHighSpeedSwapStateMachine = SwapMachine.TestCase
TestHighSpeedSwapStateMachine.settings = settings(settings.default, **RUNS.get(settings._current_profile,
                                                                              RUNS["emulator"]))
