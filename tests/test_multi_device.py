"""Several devices in one process: every component on any ordinal, objects of two devices used
interleaved on one thread and from one thread per device, graphs on either device, and memory or a stream of one
device handed to an object of another refused before any work, naming both devices.

Runs where the driver offers two devices: the emulator (``HSS_EMULATOR_DEVICES``; the suite sets 2) or a machine
with two GPUs. Device 1's results are compared with device 0's bit for bit (the same kernels on the same bytes).
"""
from __future__ import annotations

import threading

import numpy as np
import pytest

from hss import cuda_min as cm
from hss._util import ceil_div
from hss.attention import TiledAttention, TiledAttentionDims
from hss.errors import HssError
from hss.predictor import Predictor, PredictorDims
from hss.swap import HighSpeedSwap, HighSpeedSwapConfig, ModelDims

from helpers import BF16

pytestmark = pytest.mark.skipif(cm.device_count() < 2, reason="needs two devices: two GPUs, or the emulator with "
                                                                "HSS_EMULATOR_DEVICES=2 (the test suite's default)")


@pytest.fixture(scope="module")
def ctxs(ctx):
    """Device 0's context (the suite's) and device 1's."""
    c1 = cm.CudaCtx(1)
    yield ctx, c1
    c1.close()


def up(arr: np.ndarray, c: cm.CudaCtx) -> cm.DeviceBuffer:
    buf = cm.DeviceBuffer(max(arr.nbytes, 1), c)
    cm.copy_h_to_d_async(buf, np.ascontiguousarray(arr), arr.nbytes, c.stream)
    return buf


def down(buf: cm.DeviceBuffer, shape: tuple, dtype, c: cm.CudaCtx) -> np.ndarray:
    out = np.empty(shape, dtype=dtype)
    cm.copy_d_to_h_async(out, buf, out.nbytes, c.stream)
    cm.stream_sync(c.stream)
    return out


def bits(a: np.ndarray) -> np.ndarray:
    return a.view(np.uint16 if a.dtype.itemsize == 2 else np.uint32)


def test_buffers_live_on_their_device_and_copy_across(ctxs, rng) -> None:
    c0, c1 = ctxs
    data = rng.integers(0, 256, 4096, dtype=np.uint8)
    b1 = up(data, c1)
    b0 = cm.DeviceBuffer(4096, c0)
    assert (b0.device, b1.device) == (0, 1) and cm.ordinal_of(c1) == 1
    assert b1.__dlpack_device__() == (2, 1)
    cm.copy_d_to_d_async(b0, b1, 4096, c1.stream)   # unified addressing: a copy between devices
    cm.stream_sync(c1.stream)
    assert np.array_equal(down(b0, (4096,), np.uint8, c0), data)
    if cm.driver_status().kind == "emulator":
        from hss.cuda._driver import api
        assert api.state.arena.find(b1.ptr).device == 1 and api.state.arena.find(b0.ptr).device == 0
    b0.close()
    b1.close()


class Attn:
    """One TiledAttention step (two sequences, a shuffled NHD pool) on one device, from the same host data."""

    def __init__(self, c: cm.CudaCtx, q: np.ndarray, k: np.ndarray, v: np.ndarray, table: np.ndarray,
                 counts: np.ndarray) -> None:
        self.c = c
        ns, nq, hd = q.shape
        self.ta = TiledAttention(c, TiledAttentionDims(ns, nq, k.shape[2], hd, k.shape[1], table.shape[1]))
        self.bufs = [up(x, c) for x in (q, k, v, table, counts)]
        self.out = cm.DeviceBuffer(q.nbytes, c)
        self.shape = q.shape

    def step(self, stream=None) -> None:
        q, k, v, table, counts = self.bufs
        st = self.ta.begin_tiles(stream or self.c.stream, q, k, v, self.shape[0], *self.ta.paged_strides())
        st.tile(table, counts, 16, output=self.out)

    def result(self) -> np.ndarray:
        return down(self.out, self.shape, BF16, self.c)

    def close(self) -> None:
        for b in (*self.bufs, self.out, self.ta):
            b.close()


def attn_data(rng) -> tuple:
    ns, nq, nkv, hd, bs, pages = 2, 8, 2, 64, 16, 12
    q = rng.standard_normal((ns, nq, hd), dtype=np.float32).astype(BF16)
    k = (rng.standard_normal((pages, bs, nkv, hd), dtype=np.float32) / 8).astype(BF16)
    v = rng.standard_normal((pages, bs, nkv, hd), dtype=np.float32).astype(BF16)
    table = rng.permutation(pages).astype(np.int32).reshape(ns, pages // ns)
    return q, k, v, table, np.array([pages // ns, pages // ns - 1], np.int32)


def test_tiled_attention_interleaved_on_two_devices_gives_the_same_bits(ctxs, rng) -> None:
    data = attn_data(rng)
    a0, a1 = (Attn(c, *data) for c in ctxs)
    for _ in range(2):   # calls of the two objects interleaved on one thread
        a0.step()
        a1.step()
    r0, r1 = a0.result(), a1.result()
    assert np.isfinite(r0.astype(np.float32)).all() and np.array_equal(bits(r0), bits(r1))
    a0.close()
    a1.close()


def test_one_thread_per_device(ctxs, rng) -> None:
    data = attn_data(rng)
    objs = [Attn(c, *data) for c in ctxs]
    results: dict[int, np.ndarray] = {}
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            for _ in range(3):
                objs[i].step()
            results[i] = objs[i].result()
        except BaseException as exc:   # reported on the main thread
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert np.array_equal(bits(results[0]), bits(results[1]))
    for o in objs:
        o.close()


def test_graph_capture_on_device_1(ctxs, rng) -> None:
    c1 = ctxs[1]
    a = Attn(c1, *attn_data(rng))
    a.step()
    eager = a.result()
    s = cm.CudaStream(c1)
    a.step(s)   # eager first on the capture stream (counters zeroed outside the graph)
    cm.stream_sync(s)
    cm.begin_capture(s)
    a.step(s)
    graph = cm.end_capture(s)
    cm.memset_d8_async(a.out, 0xFF, a.out.bytes, c1.stream)
    cm.stream_sync(c1.stream)
    graph.launch(s)
    cm.stream_sync(s)
    assert np.array_equal(bits(a.result()), bits(eager))
    graph.close()
    s.close()
    a.close()


def test_predictor_on_device_1_gives_device_0_bits(ctxs, rng) -> None:
    nq, nkv, hd, r, bs, n = 8, 2, 64, 16, 16, 6
    dims = PredictorDims(num_layers=1, num_q_heads=nq, num_kv_heads=nkv, head_dim=hd, r=r, block_size=bs,
                         max_blocks=n)
    pages = (rng.standard_normal((n, bs, nkv, hd), dtype=np.float32) / 8).astype(BF16)
    q = rng.standard_normal((nq, hd), dtype=np.float32).astype(BF16)
    got = []
    for c in ctxs:
        with Predictor(c, dims, projection_seed=0xCAFE_F00D) as pred:
            k_dev, q_dev = up(pages, c), up(q, c)
            for b in range(n):
                pred.project_kv_block(c, 0, b, k_dev.ptr + b * pages[0].nbytes)
            q_proj, out = cm.DeviceBuffer(2 * nq * r, c), cm.DeviceBuffer(4 * n, c)
            pred.project_q(c, q_dev, q_proj)
            pred.score_layer(c, q_proj, 0, 0, n, out)
            got.append(down(out, (n,), np.float32, c))
            for b in (k_dev, q_dev, q_proj, out):
                b.close()
    assert np.isfinite(got[0]).all() and np.array_equal(bits(got[0]), bits(got[1]))


def test_high_speed_swap_on_device_1_gives_device_0_bits(ctxs, rng, tmp_path) -> None:
    model = ModelDims(1, 8, num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16)
    k = (rng.standard_normal((8, 16, 2, 64), dtype=np.float32) / 8).astype(BF16)
    v = rng.standard_normal((8, 16, 2, 64), dtype=np.float32).astype(BF16)
    q = rng.standard_normal((4, 64), dtype=np.float32).astype(BF16)
    ids = [5, 0, 3, 7, 1, 6]
    got = []
    for c in ctxs:
        cfg = HighSpeedSwapConfig(tmp_path / f"kv{c.device}", 1 << 30, 4, 16, 2, False, 7, store="host",
                                  stream_tile_blocks=2)
        with HighSpeedSwap(c, cfg, model) as h:
            for b in range(8):
                kd = up(k[b], c)
                h.offload_block(c, 0, b, kd, k[b], v[b])
                cm.stream_sync(c.stream)
                kd.close()
            q_dev, out = up(q, c), cm.DeviceBuffer(q.nbytes, c)
            for _ in range(2):   # the second step hits the resident set
                h.attend_layer(c, 0, ids, q_dev, out)
                got.append(down(out, q.shape, BF16, c))
            q_dev.close()
            out.close()
    assert np.isfinite(got[0].astype(np.float32)).all()
    for g in got[1:]:
        assert np.array_equal(bits(g), bits(got[0]))


def test_memory_or_a_stream_of_another_device_is_refused_naming_both(ctxs, rng) -> None:
    c0, c1 = ctxs
    data = attn_data(rng)
    a1 = Attn(c1, *data)
    q0 = up(data[0], c0)
    q, k, v, table, counts = a1.bufs
    strides = a1.ta.paged_strides()
    with pytest.raises(HssError, match="q is memory of device 0, but this call runs on device 1"):
        a1.ta.begin_tiles(c1.stream, q0, k, v, 2, *strides)
    with pytest.raises(HssError, match="q is memory of device 0, but this call runs on device 1"):
        a1.ta.begin_tiles(c1.stream, q0.ptr, k, v, 2, *strides)   # the int address of device 0's buffer
    a1.ta.begin_step(c1.stream, 2)
    with pytest.raises(HssError, match="belongs to device 0, but this work runs on device 1"):
        a1.ta.step_tile(c0.stream, q, k, v, table, counts, 2, *strides, 16, output=a1.out)
    a1.step()   # the object is unharmed
    assert np.isfinite(a1.result().astype(np.float32)).all()
    q0.close()
    a1.close()


@pytest.mark.emulator
def test_the_emulator_faults_a_kernel_reading_another_devices_memory(ctxs) -> None:
    """The emulator's model of no peer access: a launch on device 1 given device 0's memory faults (hss's own
    checks refuse it earlier; this is the raw launch)."""
    from hss import emulator
    from hss.emulator.driver import view_on
    from hss.errors import MemoryFault
    c0, c1 = ctxs
    b0 = cm.DeviceBuffer(64, c0)
    with pytest.raises(MemoryFault, match="device 0's memory, but the work runs on device 1"):
        view_on(1, b0.ptr, 64, "a kernel on device 1")
    assert view_on(0, b0.ptr, 64, "a kernel on device 0").size == 64
    assert cm.device_count() == emulator.state.devices
    b0.close()


def test_high_speed_swap_refuses_another_devices_query(ctxs, rng, tmp_path) -> None:
    c0, c1 = ctxs
    model = ModelDims(1, 4, num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16)
    cfg = HighSpeedSwapConfig(tmp_path / "kv", 1 << 30, 4, 16, 2, False, 7, store="host", stream_tile_blocks=2)
    q0 = up(rng.standard_normal((4, 64), dtype=np.float32).astype(BF16), c0)
    with HighSpeedSwap(c1, cfg, model) as h:
        out = cm.DeviceBuffer(q0.bytes, c1)
        with pytest.raises(HssError, match="q_dev is memory of device 0, but this call runs on device 1"):
            h.attend_layer(c1, 0, [], q0, out)
        out.close()
    q0.close()


def test_raw_stream_calls_use_the_streams_own_context(ctxs, rng) -> None:
    """Copies, memsets, syncs and captures given only a raw stream handle make that stream's context current
    (here device 1's, while device 0's was current)."""
    c0, c1 = ctxs
    data = rng.integers(0, 256, 256, dtype=np.uint8)
    b1 = cm.DeviceBuffer(256, c1)
    c0.make_current()
    cm.memset_d8_async(b1, 7, 256, c1.stream)
    c0.make_current()
    cm.copy_h_to_d_async(b1, data[:128], 128, c1.stream)
    c0.make_current()
    got = np.empty(256, np.uint8)
    cm.copy_d_to_h_async(got, b1, 256, c1.stream)
    c0.make_current()
    cm.stream_sync(c1.stream)
    assert np.array_equal(got[:128], data[:128]) and (got[128:] == 7).all()
    from hss.cuda._context import thread_state
    assert thread_state.pctx.ordinal == 1
    b1.close()


def test_qsa_indexer_on_device_1_selects_what_device_0_selects(ctxs) -> None:
    """The QSA indexer (prefill, batched device decode) on device 1: the same selection as device 0's, step by
    step, from the same weights, rows and cache (the suite's QSA dims; test_qsa_device's helpers, each device's
    context made current before they allocate)."""
    import test_qsa_device as tq

    from hss.cuda.gpu import CudaBackend
    lengths, steps = [tq.BOUND + 9, 5, 3 * tq.BOUND], 3
    got: list[list] = []
    for c in ctxs:
        c.make_current()   # the helpers allocate in the current context
        gpu = CudaBackend(c)
        layer = tq.make_layer(np.random.default_rng(12), c.stream)
        cache = tq.kv_cache(np.random.default_rng(13), len(lengths), ceil_div(tq.D["max_tokens"], tq.BS), c.stream)
        picks = []
        with layer.indexer(gpu) as idx:
            states, rows = tq.start(idx, lengths, np.random.default_rng(7), c.stream)
            normed = cm.DeviceBuffer(len(lengths) * tq.D["hidden"] * 2, c)
            for step in range(steps):
                x = np.stack([rows[r][lengths[r] + step] for r in range(len(lengths))])
                cm.copy_h_to_d_async(normed, x, x.nbytes, c.stream)
                sel = idx.decode_select_batch(states, normed, tq.table_view(cache), tq.BS, c.stream)
                picks.append(tq.selected(sel, c.stream))
            for st in states:
                idx.release_seq_state(st)
            for b in (normed, *cache.dev, *layer.bufs):
                b.close()
        gpu.close()
        got.append(picks)
    for a, b in zip(*got):
        for ra, rb in zip(a, b):
            assert ra.size and np.array_equal(ra, rb)


def test_qsa_indexer_refuses_another_devices_weights_streams_and_memory(ctxs) -> None:
    """Weights of device 0 for a backend of device 1 are refused at construction; an indexer of device 1 refuses a
    stream of device 0 at every entry point, and device 0's memory in prefill_select: each error names both devices
    and comes before any device work, the states unchanged; the indexer then works."""
    import test_qsa_device as tq
    from test_qsa_indexer import driver_calls

    from hss.cuda.gpu import CudaBackend

    from helpers import Recording
    c0, c1 = ctxs
    rng = np.random.default_rng(5)
    c0.make_current()   # the helpers allocate in the current context
    layer0 = tq.make_layer(np.random.default_rng(12), c0.stream)
    h0 = tq.upload(tq.hidden_rows(rng, 16), c0.stream)
    c1.make_current()
    layer1 = tq.make_layer(np.random.default_rng(12), c1.stream)
    gpu = CudaBackend(c1)
    for bad, name in enumerate(("qk_proj_w", "q_norm_w", "k_norm_w")):
        bufs = list(layer1.bufs)
        bufs[bad] = layer0.bufs[bad] if bad else layer0.bufs[bad].ptr   # a buffer, or the int address of one
        rec = Recording(gpu)
        with driver_calls() as seen, pytest.raises(
                HssError, match=f"{name} is memory of device 0, but the backend .gpu. works on device 1"):
            tq.Layer(layer1.w, layer1.qn, layer1.kn, tuple(bufs)).indexer(rec)
        assert rec.calls == [] and seen == [], "device work before the error"
    lengths = [tq.BOUND + 6, 9]
    R, nq, hd = len(lengths), tq.D["nq"], tq.D["hd_attn"]
    cache = tq.kv_cache(rng, R, ceil_div(tq.D["max_tokens"], tq.BS), c1.stream)
    k, v, _ = cache.dev
    s0, s1 = c0.stream, c1.stream
    with layer1.indexer(gpu) as idx:
        states, rows = tq.start(idx, lengths, rng, s1)
        st = states[0]
        x = tq.upload(np.stack([rows[r][lengths[r]] for r in range(R)]), s1)
        h1 = tq.upload(rows[0][:8], s1)
        q = tq.upload(rng.standard_normal((R, nq, hd)).astype(BF16), s1)
        qv, out = q.view("bf16", (R, nq, hd)), cm.DeviceBuffer(R * nq * hd * 2, c1)
        tv = tq.table_view(cache)
        sel = idx.decode_select_batch(states, x, tv, tq.BS, s1)
        blob = idx.snapshot_aux(st, s1)
        n = st.ingested
        chunk = [tq.upload(a, s1) for a in (rows[0][n - 2:n], rng.standard_normal((2, nq, hd)).astype(BF16),
                                            np.zeros((2, nq * hd), BF16))]
        scratch, scratch0 = (cm.DeviceBuffer(idx.prefill_scratch_bytes(n), c) for c in (c1, c0))

        def select(stream, normed=chunk[0], attn_ctx=chunk[2], scr=scratch):
            return idx.prefill_select(st, normed, chunk[1], attn_ctx, k, v, cache.tables[0], n - 2, 2, nq, tq.BS,
                                      hd ** -0.5, scr, stream)
        cm.stream_sync(s1)
        before = [(s.ingested, s.pooled, s.sync(s1)) for s in states]
        stream_calls = {
            "prefill_ingest": lambda: idx.prefill_ingest(st, h1, 8, 0, s0),
            "decode_select": lambda: idx.decode_select(st, x, n, k, v, cache.dev[2], tq.BS, s0),
            "decode_select_batch": lambda: idx.decode_select_batch(states, x, tv, tq.BS, s0),
            "sparse_decode_attention": lambda: idx.sparse_decode_attention(qv, k, v, None, sel, out, s0),
            "prefill_select": lambda: select(s0),
            "snapshot_aux": lambda: idx.snapshot_aux(st, s0),
            "restore_aux": lambda: idx.restore_aux(st, blob, s0),
            "QsaSeqState.sync": lambda: st.sync(s0),
        }
        memory_calls = {"normed": lambda: select(s1, normed=h0), "attn_ctx": lambda: select(s1, attn_ctx=h0),
                        "scratch": lambda: select(s1, scr=scratch0.ptr)}
        for what, call in stream_calls.items():
            with driver_calls() as seen, pytest.raises(
                    HssError, match=f"{what}: stream 0x[0-9a-f]+ belongs to device 0, but this indexer works on "
                                    "device 1"):
                call()
            assert seen == [], f"{what}: device work before the error: {seen}"
        for name, call in memory_calls.items():
            with driver_calls() as seen, pytest.raises(
                    HssError, match=f"{name} is memory of device 0, but this call runs on device 1"):
                call()
            assert seen == [], f"prefill_select's {name}: device work before the error: {seen}"
        assert [(s.ingested, s.pooled, s.sync(s1)) for s in states] == before
        # the indexer is unharmed: its own stream and memory work
        sel = idx.decode_select_batch(states, x, tv, tq.BS, s1)
        idx.sparse_decode_attention(qv, k, v, None, sel, out, s1)
        assert [s.ingested for s in states] == [b[0] + 1 for b in before]
        got = tq.download(out, (R, nq, hd), BF16, s1).astype(np.float64)
        assert np.isfinite(got).all()
        for s in states:
            idx.release_seq_state(s)
        for b in (x, h1, q, out, scratch, scratch0, *chunk):
            b.close()
    for b in (h0, *cache.dev, *layer0.bufs, *layer1.bufs):
        b.close()
    gpu.close()


def test_kv_heads_split_over_two_devices_give_the_one_device_rows(ctxs, rng, tmp_path) -> None:
    """Tensor parallelism (hss.swap.tp): a layer's 4 kv heads (8 q heads) as two HighSpeedSwaps of 2 kv heads, one
    per device, every page streamed (the same tiles as the one-device run): each rank's output rows equal the
    one-device run's rows of its q heads bit for bit."""
    from hss.swap import shard_kv_heads
    model = ModelDims(1, 12, num_q_heads=8, num_kv_heads=4, head_dim=64, block_size=16)
    k = (rng.standard_normal((12, 16, 4, 64), dtype=np.float32) / 8).astype(BF16)
    v = rng.standard_normal((12, 16, 4, 64), dtype=np.float32).astype(BF16)
    q = rng.standard_normal((8, 64), dtype=np.float32).astype(BF16)
    ids = [9, 2, 4, 11, 0, 7, 5]

    def run(c, m, take_kv, qq, name):
        cfg = HighSpeedSwapConfig(tmp_path / name, 1 << 30, 4, 16, 2, False, 7, store="host", stream_tile_blocks=2)
        with HighSpeedSwap(c, cfg, m) as h:
            assert h.resident_capacity == 0   # resident_blocks = 2 * tile: every page streams
            for b in range(12):
                kd = up(take_kv(k[b]), c)
                h.offload_block(c, 0, b, kd, take_kv(k[b]), take_kv(v[b]))
                cm.stream_sync(c.stream)
                kd.close()
            q_dev, out = up(qq, c), cm.DeviceBuffer(qq.nbytes, c)
            h.attend_layer(c, 0, ids, q_dev, out, q_pos=len(ids) * 16 - 1)
            got = down(out, qq.shape, BF16, c)
            q_dev.close()
            out.close()
        return got

    whole = run(ctxs[0], model, lambda page: page, q, "one")
    shards = shard_kv_heads(model, 2)
    assert [(s.kv_heads, s.q_heads) for s in shards] == [(range(0, 2), range(0, 4)), (range(2, 4), range(4, 8))]
    for s, c in zip(shards, ctxs):
        part = run(c, s.model, s.take_kv, s.take_q(q), f"rank{s.rank}")
        assert np.array_equal(bits(part), bits(whole[s.q_heads.start:s.q_heads.stop])), f"rank {s.rank}"
    with pytest.raises(HssError, match="num_kv_heads \\(4\\) must be a multiple of ranks \\(3\\)"):
        shard_kv_heads(model, 3)


def test_the_tp_bench_runs_on_two_devices() -> None:
    """``python -m hss.bench swap --tp 2``'s code path at a tiny size (its numbers mean nothing here)."""
    from hss.bench import _swap_tp
    from hss.bench.swap import parse_args
    args = parse_args(["--smoke", "--tp", "2"])
    args.tokens, args.iters, args.warmup = "64", 1, 0
    rows = _swap_tp.tp_rows(args)
    assert len(rows) == 1 and rows[0]["tp"] == 2 and "bitwise equal" in rows[0]["note"] and rows[0]["us"] > 0
    assert "kv heads over 2 devices" in _swap_tp.table(rows)
