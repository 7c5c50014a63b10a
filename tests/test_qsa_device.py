"""The batched device decode (docs/design.md §17.2-§17.4): ``QsaIndexer.decode_select_batch`` and
``sparse_decode_attention`` against the single-sequence host path and the float64 references, graph capture and
replay (``begin_capture`` / ``end_capture``; ``torch.cuda.graph`` on a GPU), the device positions behind every host
path, and every argument error (raised before any device work).

Dims: on the emulator small ones (hidden 64, indexer 2 x 32, ratio 4, budget 16: inert bound 19) so CI stays fast;
on a GPU Qwen3.8's (hidden 2560, indexer 4 x 128, ratio 4, budget 2048: inert bound 2051; attention 24 q / 2 kv x
256, page size 16).
"""
from __future__ import annotations

import contextlib
import math
import pydoc
from dataclasses import dataclass

import numpy as np
import pytest

from hss import cuda_min as cm
from hss._util import ceil_div
from hss.cuda import _driver
from hss.errors import CudaError, HssError
from hss.qsa import QsaDeviceSelection, QsaIndexer, device
from hss.reference import qsa as ref
from hss.reference import qsa_device as rd

from conftest import ON_GPU
from helpers import BF16, Recording, assert_bites, assert_close, bound, download, upload

if ON_GPU:
    D = dict(hidden=2560, n_heads=4, hd=128, ratio=4, budget=2048, rot=64, theta=1e7, eps=1e-6, nkv=2, hd_attn=256,
             nq=24, bs=16, max_tokens=8192)
else:
    D = dict(hidden=64, n_heads=2, hd=32, ratio=4, budget=16, rot=16, theta=1e4, eps=1e-6, nkv=2, hd_attn=64, nq=4,
             bs=8, max_tokens=160)
RATIO, BUDGET, BS = D["ratio"], D["budget"], D["bs"]
BOUND = BUDGET + RATIO - 1          # inert bound: visible <= BOUND selects every token
QKW = (D["n_heads"] + 1) * D["hd"]


@dataclass
class Layer:
    """One layer's random indexer weights (host and device)."""
    w: np.ndarray
    qn: np.ndarray
    kn: np.ndarray
    bufs: tuple

    def indexer(self, gpu, **kw) -> QsaIndexer:
        args = dict(n_heads=D["n_heads"], hd=D["hd"], ratio=RATIO, budget=BUDGET, rot=D["rot"], theta=D["theta"],
                    eps=D["eps"], hidden=D["hidden"], nkv_attn=D["nkv"], hd_attn=D["hd_attn"], gpu=gpu,
                    max_tokens=D["max_tokens"], max_seqs=8)
        args.update(kw)
        return QsaIndexer(*self.bufs, **args)


def make_layer(rng, stream) -> Layer:
    H, hd = D["hidden"], D["hd"]
    w = (rng.standard_normal((QKW, H)) / math.sqrt(H)).astype(BF16)
    qn = (rng.standard_normal(hd) * 0.1).astype(BF16)
    kn = (rng.standard_normal(hd) * 0.1).astype(BF16)
    return Layer(w, qn, kn, (upload(w, stream), upload(qn, stream), upload(kn, stream)))


@pytest.fixture(scope="module")
def layer(ctx):
    return make_layer(np.random.default_rng(12), ctx.stream)


def hidden_rows(rng, n: int) -> np.ndarray:
    return (rng.standard_normal((n, D["hidden"])) * 0.5).astype(BF16)


@dataclass
class Cache:
    """Paged NHD K/V pools and one page table row per sequence (distinct, shuffled physical pages)."""
    k: np.ndarray
    v: np.ndarray
    tables: np.ndarray
    dev: tuple      # (k_pool, v_pool, tables) device buffers


def kv_cache(rng, R: int, max_pages: int, stream, nkv: int = D["nkv"], hd: int = D["hd_attn"]) -> Cache:
    pages = R * max_pages + 3
    k = rng.standard_normal((pages, BS, nkv, hd)).astype(BF16)
    v = rng.standard_normal((pages, BS, nkv, hd)).astype(BF16)
    tables = rng.permutation(pages)[:R * max_pages].reshape(R, max_pages).astype(np.int32)
    return Cache(k, v, tables, (upload(k, stream), upload(v, stream), upload(tables, stream)))


def table_view(cache: Cache):
    """The device page tables as an i32 [R, max_pages] view (its shape gives max_pages)."""
    return cache.dev[2].view("i32", cache.tables.shape)


def start(idx: QsaIndexer, lengths, rng, stream) -> tuple[list, list]:
    """States of ``idx`` prefilled to ``lengths`` tokens (random rows); returns (states, hidden rows of each)."""
    states, rows = [], []
    for n in lengths:
        st = idx.new_seq_state()
        h = hidden_rows(rng, n + 80)
        if n:
            d = upload(h, stream)
            idx.prefill_ingest(st, d, n, 0, stream)
            cm.stream_sync(stream)
            d.close()
        states.append(st)
        rows.append(h)
    return states, rows


def selected(sel: QsaDeviceSelection, stream) -> list[np.ndarray]:
    counts = download(sel.counts_dev, (sel.R,), np.int32, stream)
    tokens = download(sel.tokens_dev, (sel.R, sel.sel_cap), np.int32, stream)
    return [tokens[r, :counts[r]].copy() for r in range(sel.R)]


@contextlib.contextmanager
def driver_work():
    """Count the stream work (launches, copies, memsets, graph launches) queued through the driver."""
    calls: list[str] = []
    names = ("cuLaunchKernel", "cuLaunchKernelEx", "cuMemcpyHtoDAsync", "cuMemcpyDtoDAsync", "cuMemcpyDtoHAsync",
             "cuMemcpy2DAsync", "cuMemsetD32Async", "cuMemsetD8Async", "cuGraphLaunch", "cuMemAlloc")
    real = {n: getattr(_driver.api, n) for n in names}
    for n in names:
        setattr(_driver.api, n, lambda *a, _n=n, **k: (calls.append(_n), real[_n](*a, **k))[1])
    try:
        yield calls
    finally:
        for n in names:
            setattr(_driver.api, n, real[n])


def ref_attention(q, cache: Cache, r: int, tokens, scale: float) -> np.ndarray:
    """float64 attention of q [nq, hd] over ``tokens`` of sequence r (through its page table)."""
    return rd.sparse_attention(q, cache.k, cache.v, cache.tables[r], tokens, BS, scale)


# -- device state ---------------------------------------------------------------------------------------------
def test_slots_positions_and_descriptors_follow_every_host_path(gpu, stream, rng, layer):
    with layer.indexer(gpu, max_seqs=3) as idx:
        dev = idx._dev
        a, b, c = (idx.new_seq_state() for _ in range(3))
        assert [a.slot, b.slot, c.slot] == [0, 1, 2]
        with pytest.raises(HssError, match="all max_seqs = 3 slots are taken"):
            idx.new_seq_state()
        idx.release_seq_state(b)
        assert b.slot == -1
        b2 = idx.new_seq_state()
        assert b2.slot == 1, "a released slot is handed out again"

        def pos(st):
            return int(download(dev.pos_dev + 4 * st.slot, (1,), np.int32, stream)[0])

        h = upload(hidden_rows(rng, 60), stream)
        idx.prefill_ingest(a, h, 30, 0, stream)
        assert pos(a) == a.ingested == 30
        desc = download(dev.desc_dev, (3, 2), np.uint64, stream)
        assert desc[a.slot].tolist() == [int(a.raw_keys), int(a.block_keys)], "the descriptor went with the first call"
        idx.prefill_ingest(a, h.ptr + 30 * D["hidden"] * 2, 5, 30, stream)
        assert pos(a) == 35
        k, v, t = kv_cache(rng, 1, ceil_div(D["max_tokens"], BS), stream).dev
        idx.decode_select(a, h.ptr + 35 * D["hidden"] * 2, 35, k, v, t, BS, stream)
        assert pos(a) == a.ingested == 36 and a.sync(stream) == 36
        blob = idx.snapshot_aux(a, stream)
        idx.prefill_ingest(a, h, 7, 0, stream)        # seq_start 0: starts over
        assert pos(a) == 7 and (a.ingested, a.pooled) == (7, 1)
        idx.restore_aux(a, blob, stream)
        assert pos(a) == 36 and a.sync(stream) == 36
        # a fresh state goes straight into a device step (its descriptor and position 0 are there already)
        sel = idx.decode_select_batch([c], h, t, BS, stream, max_pages=ceil_div(D["max_tokens"], BS))
        assert c.ingested == 1 and pos(c) == 1 and sel.R == 1
        assert selected(sel, stream)[0].tolist() == [0]
        # sync() reads the device: a position changed behind the mirror's back is picked up (and pooled follows)
        cm.memset_d32_async(dev.pos_dev + 4 * c.slot, 9, 1, stream)
        assert c.sync(stream) == 9 and (c.ingested, c.pooled) == (9, 2)
        for st in (a, b2, c):
            idx.release_seq_state(st)
        with pytest.raises(HssError, match="released"):
            a.sync(stream)
        h.close()


def test_help_lists_the_batched_api():
    text = pydoc.render_doc(QsaIndexer)
    for needle in ("decode_select_batch", "sparse_decode_attention", "tokens_dev", "[R, hidden]",
                   "[R, nq, hd_attn]", "max_seqs"):
        assert needle in text, needle
    assert "counts_dev" in pydoc.render_doc(QsaDeviceSelection)


# -- batched step vs the host path -------------------------------------------------------------------------------
def lengths_around_the_bound() -> list[int]:
    """Ragged starts: inert, crossing the bound during the run, past it; block boundaries crossed by the steps."""
    return [0, BOUND - 5, BOUND - 1, BOUND + 6, 2 * BUDGET + 1] if not ON_GPU else [5, BOUND - 3, BOUND + 7, 3000,
                                                                                      6001]


def test_batch_equals_single_sequence_host_path(gpu, stream, rng, layer):
    lengths = lengths_around_the_bound()
    R, steps = len(lengths), 9
    max_pages = ceil_div(D["max_tokens"], BS)
    cache = kv_cache(rng, R, max_pages, stream)
    with layer.indexer(gpu) as batch_idx, layer.indexer(gpu) as host_idx:
        states, rows = start(batch_idx, lengths, np.random.default_rng(7), stream)
        host_states, _ = start(host_idx, lengths, np.random.default_rng(7), stream)
        normed = cm.DeviceBuffer(R * D["hidden"] * 2)
        host_rows = [upload(h, stream) for h in rows]
        for step in range(steps):
            x = np.stack([rows[r][lengths[r] + step] for r in range(R)])
            cm.copy_h_to_d_async(normed, x, x.nbytes, stream)
            sel = batch_idx.decode_select_batch(states, normed, table_view(cache), BS, stream)
            got = selected(sel, stream)
            for r in range(R):
                pos = lengths[r] + step
                assert states[r].ingested == pos + 1 and states[r].pooled == (pos + 1) // RATIO
                one = host_idx.decode_select(host_states[r], host_rows[r].ptr + pos * D["hidden"] * 2, pos,
                                             cache.dev[0], cache.dev[1], cache.dev[2].ptr + 4 * r * max_pages, BS,
                                             stream)
                want = np.arange(pos + 1, dtype=np.int32) if one is None else one.tokens
                if ON_GPU and one is not None and not np.array_equal(got[r], want):
                    near_tie(batch_idx, states[r], r, got[r], pos, stream)
                else:
                    assert np.array_equal(got[r], want), f"row {r} at pos {pos}: batch and host path select " \
                                                         f"different tokens"
        # the device positions advanced with the mirrors
        for st in states:
            assert st.sync(stream) == st.ingested
        for st in states:
            batch_idx.release_seq_state(st)
        for st in host_states:
            host_idx.release_seq_state(st)
        for b in (normed, *host_rows, *cache.dev):
            b.close()


def near_tie(idx, st, r: int, got: np.ndarray, pos: int, stream) -> None:
    """GPU only (cuBLAS may round m = R and m = 1 differently): the batch's selection against the staged reference
    of its own inputs, differing only at near ties (docs/design.md §0)."""
    visible = pos + 1
    complete = visible // RATIO
    k = BUDGET // RATIO
    q = download(idx._dev.q_post_b + r * D["n_heads"] * D["hd"] * 4, (D["n_heads"], D["hd"]), np.float32, stream)
    keys = download(st.block_keys, (complete, D["hd"]), BF16, stream)
    scores = ref.score(q, keys)
    engine = got[:k * RATIO:RATIO] // RATIO
    cutoff = np.sort(scores)[::-1][k - 1]
    tol = 2 * bound(scores, "f32", (0,))[0]
    far = [b for b in np.setxor1d(engine, ref.select_blocks(scores, k)) if abs(scores[b] - cutoff) > tol]
    assert not far, f"row {r} at pos {pos}: blocks {far} differ and are not near ties"


# -- sparse attention vs the float64 reference ---------------------------------------------------------------------
@pytest.mark.parametrize("nq, nkv, hd", [(24, 2, 256), (32, 8, 128)])
def test_sparse_attention_matches_the_float64_reference(gpu, stream, rng, layer, nq, nkv, hd):
    lengths = [3, BOUND + 2, 2 * BUDGET + 5] if not ON_GPU else [100, BOUND + 2, 5000]
    R = len(lengths)
    max_pages = ceil_div(D["max_tokens"], BS)
    cache = kv_cache(rng, R, max_pages, stream, nkv, hd)
    cache.tables[1, 0] = -1          # a negative page id: its tokens contribute nothing
    cm.copy_h_to_d_async(cache.dev[2], cache.tables, cache.tables.nbytes, stream)
    with layer.indexer(gpu, nkv_attn=nkv, hd_attn=hd) as idx:
        states, rows = start(idx, lengths, rng, stream)
        x = upload(np.stack([rows[r][lengths[r]] for r in range(R)]), stream)
        qh = rng.standard_normal((R, nq, hd)).astype(BF16)
        q, out = upload(qh, stream), cm.DeviceBuffer(R * nq * hd * 2)
        cm.memset_d8_async(out, 0xFF, out.bytes, stream)
        sel = idx.decode_select_batch(states, x, table_view(cache), BS, stream)
        idx.sparse_decode_attention(q.view("bf16", (R, nq, hd)), *cache.dev[:2], None, sel, out, stream)
        got = download(out, (R, nq, hd), BF16, stream).astype(np.float64)
        tokens = selected(sel, stream)
        scale = 1 / math.sqrt(hd)
        want = np.stack([ref_attention(qh[r], cache, r, tokens[r], scale) for r in range(R)])
        assert_close(got, want, "bf16", (2,), f"sparse attention {nq}q/{nkv}kv x {hd}")
        dropped = np.stack([ref_attention(qh[r], cache, r, tokens[r][1:], scale) for r in range(R)])
        assert_bites(got, dropped, "bf16", (2,), "sparse attention with one token dropped")
        # an explicit scale and explicit tables give the same as the defaults' math
        idx.sparse_decode_attention(q, *cache.dev[:2], cache.dev[2], sel, out, stream, scale=0.5, nq=nq)
        got = download(out, (R, nq, hd), BF16, stream).astype(np.float64)
        want = np.stack([ref_attention(qh[r], cache, r, tokens[r], 0.5) for r in range(R)])
        assert_close(got, want, "bf16", (2,), "sparse attention, scale 0.5")
        for st in states:
            idx.release_seq_state(st)
        for b in (x, q, out, *cache.dev):
            b.close()


# -- graph capture ---------------------------------------------------------------------------------------------
class World:
    """Several QSA layers (indexers, each with its ragged states) and fixed input / output buffers, so that one
    decode step can run eagerly or be captured once and replayed."""

    def __init__(self, gpu, layers, lengths, stream, seed: int, **kw) -> None:
        self.s = stream
        self.idx = [lay.indexer(gpu, **kw) for lay in layers]
        self.R = R = len(lengths)
        self.lengths = lengths
        self.states = []
        for i, idx in enumerate(self.idx):
            states, _ = start(idx, lengths, np.random.default_rng(seed + i), stream)
            self.states.append(tuple(states))
        rng = np.random.default_rng(seed + 100)
        self.max_pages = ceil_div(D["max_tokens"], BS)
        self.cache = kv_cache(rng, R, self.max_pages, stream)
        self.tables = table_view(self.cache)
        H, nq, hd = D["hidden"], D["nq"], D["hd_attn"]
        self.normed = [cm.DeviceBuffer(R * H * 2) for _ in layers]
        self.q = [cm.DeviceBuffer(R * nq * hd * 2) for _ in layers]
        self.out = [cm.DeviceBuffer(R * nq * hd * 2) for _ in layers]

    def feed(self, normed: list, q: list) -> None:
        """Step inputs into the fixed buffers (outside any graph)."""
        for i in range(len(self.idx)):
            cm.copy_d_to_d_async(self.normed[i], normed[i], self.normed[i].bytes, self.s)
            cm.copy_d_to_d_async(self.q[i], q[i], self.q[i].bytes, self.s)

    def step(self) -> list:
        sels = []
        for i, idx in enumerate(self.idx):
            sel = idx.decode_select_batch(self.states[i], self.normed[i], self.tables, BS, self.s)
            idx.sparse_decode_attention(self.q[i].view("bf16", (self.R, D["nq"], D["hd_attn"])), *self.cache.dev[:2],
                                        None, sel, self.out[i], self.s)
            sels.append(sel)
        return sels

    def results(self, sels) -> list:
        return [(selected(sel, self.s), download(self.out[i], (self.out[i].bytes // 2,), np.uint16, self.s))
                for i, sel in enumerate(sels)]

    def close(self) -> None:
        for idx, states in zip(self.idx, self.states):
            for st in states:
                idx.release_seq_state(st)
            idx.close()
        for b in (*self.normed, *self.q, *self.out, *self.cache.dev):
            b.close()


def step_inputs(rng, n_layers: int, R: int, stream) -> tuple[list, list]:
    normed = [upload(hidden_rows(rng, R), stream) for _ in range(n_layers)]
    q = [upload(rng.standard_normal((R, D["nq"], D["hd_attn"])).astype(BF16), stream) for _ in range(n_layers)]
    return normed, q


def test_graph_replays_equal_eager_steps(gpu, stream, rng):
    n_layers, steps = 3, 50
    layers = [make_layer(rng, stream) for _ in range(n_layers)]
    cm.stream_sync(stream)     # the weights are read on another stream
    lengths = [1, BOUND - 20, BOUND - 2, BOUND + 9] if not ON_GPU else [1, BOUND - 20, BOUND - 2, 4000]
    lengths = [max(n, 0) for n in lengths]
    s = cm.CudaStream()
    eager, graphed = (World(gpu, layers, lengths, s, 5, nq_attn=D["nq"]) for _ in range(2))
    inputs = [step_inputs(rng, n_layers, len(lengths), s) for _ in range(steps)]
    graphed.feed(*inputs[0])
    cm.begin_capture(s)
    sels = graphed.step()
    graph = cm.end_capture(s)
    assert len(graph.replay_callbacks) == n_layers
    assert [st.ingested for st in graphed.states[0]] == lengths, "capturing runs nothing: the mirrors wait"
    for i in range(steps):
        eager.feed(*inputs[i])
        want = eager.results(eager.step())
        graphed.feed(*inputs[i])
        graph.launch(s)
        got = graphed.results(sels)
        for layer_i, ((wt, wo), (gt, go)) in enumerate(zip(want, got)):
            assert all(np.array_equal(a, b) for a, b in zip(wt, gt)), f"step {i} layer {layer_i}: selections differ"
            assert np.array_equal(wo, go), f"step {i} layer {layer_i}: replay output bits differ from eager"
        for w_states, g_states in zip(eager.states, graphed.states):
            assert [st.ingested for st in g_states] == [n + i + 1 for n in lengths], "each replay advances the mirrors"
            assert [st.pooled for st in g_states] == [st.pooled for st in w_states]
    assert any(n <= BOUND < n + steps for n in lengths), "the run crosses the inert bound"
    for states in graphed.states:
        assert [st.sync(s) for st in states] == [n + steps for n in lengths], "device positions = mirrors"
    close_all(graph, (eager, graphed), inputs, layers, s)


def close_all(graph, worlds, inputs, layers, s) -> None:
    """A graph test's teardown: the graph, the worlds, the step inputs, the layers' weights, the stream."""
    graph.close()
    for w in worlds:
        w.close()
    for normed, q in inputs:
        for b in (*normed, *q):
            b.close()
    for lay in layers:
        for b in lay.bufs:
            b.close()
    s.close()


def test_programmatic_and_plain_launches_give_the_same_bits(gpu, stream, rng, monkeypatch):
    """With ``HSS_QSA_PDL=1``, where module qsa_device's sm_90 variant is served (compute capability 9.0 on; the
    emulator's is 9.0), the step's kernels go through programmatic stream serialization, each waiting for the launch
    before it: eager and graph-replayed steps give the bits of plain launches. Both sides project with
    ``qsa_dev_qk`` (``HSS_QSA_QK_KERNEL=1``): one warp a column, the same bits in any batch."""
    n_layers, steps = 2, 6
    layers = [make_layer(rng, stream) for _ in range(n_layers)]
    cm.stream_sync(stream)
    lengths = [BOUND - 2, BOUND + 9] if not ON_GPU else [BOUND - 2, 4000]
    s = cm.CudaStream()
    monkeypatch.setenv("HSS_QSA_QK_KERNEL", "1")
    plain = World(gpu, layers, lengths, s, 5, nq_attn=D["nq"])
    monkeypatch.setenv("HSS_QSA_PDL", "1")
    pdl, graphed = (World(gpu, layers, lengths, s, 5, nq_attn=D["nq"]) for _ in range(2))
    served = cm.compute_capability() >= (9, 0)
    assert not any(idx._dev.pdl for idx in plain.idx)
    assert all(idx._dev.pdl == served and idx._dev.qk_max_rows == 8 for w in (pdl, graphed) for idx in w.idx)
    inputs = [step_inputs(rng, n_layers, len(lengths), s) for _ in range(steps)]
    graphed.feed(*inputs[0])
    cm.begin_capture(s)
    sels = graphed.step()
    graph = cm.end_capture(s)
    for i in range(steps):
        for w in (plain, pdl, graphed):
            w.feed(*inputs[i])
        want = plain.results(plain.step())
        got_eager = pdl.results(pdl.step())
        graph.launch(s)
        got_graph = graphed.results(sels)
        for name, got in (("eager", got_eager), ("graph", got_graph)):
            for layer_i, ((wt, wo), (gt, go)) in enumerate(zip(want, got)):
                assert all(np.array_equal(a, b) for a, b in zip(wt, gt)), f"{name} step {i} layer {layer_i}: tokens"
                assert np.array_equal(wo, go), f"{name} step {i} layer {layer_i}: output bits differ from plain"
    for states in graphed.states:
        assert [st.sync(s) for st in states] == [n + steps for n in lengths]
    with driver_work() as calls:   # the four kernels of a selection, programmatic where served
        pdl.idx[0].decode_select_batch(pdl.states[0], pdl.normed[0], pdl.tables, BS, s)
    launch = "cuLaunchKernelEx" if served else "cuLaunchKernel"
    assert sorted(calls) == [launch] * 4 + ["cuMemcpyHtoDAsync"], calls
    # switched at run time: the same launches rebuilt
    idx = pdl.idx[0]
    idx._dev.use_pdl(False)
    assert not idx._dev.pdl
    idx._dev.use_pdl(True)
    assert idx._dev.pdl == served
    close_all(graph, (plain, pdl, graphed), inputs, layers, s)


def test_replay_stops_at_max_tokens(gpu, stream, rng, layer):
    """A captured step replayed past max_tokens: the device stops (count 0, zeros out), the mirror stays there."""
    mt = 64 if not ON_GPU else 4096
    with layer.indexer(gpu, max_tokens=mt, nq_attn=D["nq"]) as idx:
        states, rows = start(idx, [mt - 2], rng, stream)
        st = states[0]
        cache = kv_cache(rng, 1, ceil_div(mt, BS), stream)
        x = upload(rows[0][:1], stream)
        q = upload(rng.standard_normal((1, D["nq"], D["hd_attn"])).astype(BF16), stream)
        out = cm.DeviceBuffer(D["nq"] * D["hd_attn"] * 2)
        s = cm.CudaStream()
        cm.begin_capture(s)
        sel = idx.decode_select_batch((st,), x, table_view(cache), BS, s)
        idx.sparse_decode_attention(q, *cache.dev[:2], None, sel, out, s, nq=D["nq"])
        graph = cm.end_capture(s)
        for i in range(4):
            graph.launch(s)
            assert st.ingested == min(mt - 2 + i + 1, mt)
        assert st.sync(s) == mt
        assert download(sel.counts_dev, (1,), np.int32, s)[0] == 0
        assert not download(out, (D["nq"] * D["hd_attn"],), np.uint16, s).any(), "no token selected: zeros"
        with pytest.raises(HssError, match="max_tokens"):
            idx.decode_select_batch((st,), x, table_view(cache), BS, s)
        graph.close()
        idx.release_seq_state(st)
        for b in (x, q, out, *cache.dev):
            b.close()
        s.close()


def test_first_capture_needs_partials_and_compositions_are_kept(gpu, stream, rng, layer, monkeypatch):
    monkeypatch.setattr(device, "COMPOSITIONS", 12)
    monkeypatch.setattr(device, "_RESERVE", 3)
    with layer.indexer(gpu) as idx:
        states, rows = start(idx, [3, 8, 21, 30, 2, 9], rng, stream)
        cache = kv_cache(rng, len(states), ceil_div(D["max_tokens"], BS), stream)
        x = upload(hidden_rows(rng, len(states)), stream)
        q = upload(rng.standard_normal((len(states), D["nq"], D["hd_attn"])).astype(BF16), stream)
        out = cm.DeviceBuffer(len(states) * D["nq"] * D["hd_attn"] * 2)
        s = cm.CudaStream()
        pair = (states[1], states[3])
        tables = cache.dev[2]
        mp = cache.tables.shape[1]
        cm.begin_capture(s)
        sel = idx.decode_select_batch(pair, x, tables, BS, s, max_pages=mp)
        with pytest.raises(HssError, match="run one step eagerly before the capture"):
            idx.sparse_decode_attention(q, *cache.dev[:2], None, sel, out, s, nq=D["nq"])
        graph = cm.end_capture(s)
        assert idx._dev.part_nq == 0 and idx._dev.compositions[pair].captured
        sel = idx.decode_select_batch(pair, x, tables, BS, s, max_pages=mp)   # eager: the partials get allocated
        idx.sparse_decode_attention(q, *cache.dev[:2], None, sel, out, s, nq=D["nq"])
        assert idx._dev.part_nq == D["nq"]
        # many other compositions, eagerly: the cache recycles, never the captured one
        import itertools
        combos = [c for n in (1, 2, 3) for c in itertools.combinations(states, n) if c != pair][:30]
        for c in combos:
            idx.decode_select_batch(c, x, tables, BS, s, max_pages=mp)
        assert len(idx._dev.compositions) <= 12 and pair in idx._dev.compositions
        # a failed wait while recycling fails the call (only a destroyed stream's is passed over) and changes nothing
        new, cached = tuple(states[2:6]), dict(idx._dev.compositions)
        before_new = [st.ingested for st in new]
        bad = (_driver.api.CUresult.CUDA_ERROR_INVALID_VALUE,)
        with monkeypatch.context() as mp_sync:
            mp_sync.setattr(_driver.api, "cuStreamSynchronize", lambda h: bad)
            with pytest.raises(CudaError, match="cuStreamSynchronize"):
                idx.decode_select_batch(new, x, tables, BS, s, max_pages=mp)
        assert [st.ingested for st in new] == before_new and new not in idx._dev.compositions
        assert dict(idx._dev.compositions) == cached
        before = [st.ingested for st in pair]
        graph.launch(s)
        assert [st.ingested for st in pair] == [n + 1 for n in before]
        assert [st.sync(s) for st in pair] == [n + 1 for n in before], "the replay used the captured batch's slots"
        # a steady batch: one slots copy, three launches and the GEMM per step, nothing re-validated
        idx.decode_select_batch(pair, x, tables, BS, s, max_pages=mp)
        with driver_work() as calls:
            idx.decode_select_batch(pair, x, tables, BS, s, max_pages=mp)
        assert sorted(calls) == ["cuLaunchKernel"] * 3 + ["cuMemcpyHtoDAsync"], calls
        graph.close()
        for st in states:
            idx.release_seq_state(st)
        for b in (x, q, out, *cache.dev):
            b.close()
        s.close()


@pytest.mark.gpu
def test_torch_graph_capture(gpu, rng):
    torch = pytest.importorskip("torch")
    n_layers, steps = 2, 20
    side = torch.cuda.Stream()
    s = side.cuda_stream
    layers = [make_layer(rng, s) for _ in range(n_layers)]
    cm.stream_sync(s)
    lengths = [7, BOUND - 4, 3000]
    eager = World(gpu, layers, lengths, s, 9, nq_attn=D["nq"])
    graphed = World(gpu, layers, lengths, s, 9, nq_attn=D["nq"])
    inputs = [step_inputs(rng, n_layers, len(lengths), s) for _ in range(steps)]
    graphed.feed(*inputs[0])
    cm.stream_sync(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side):
        with torch.cuda.graph(g, stream=side):
            sels = graphed.step()
    mirrors = [[st.ingested for st in states] for states in graphed.states]
    for i in range(steps):
        eager.feed(*inputs[i])
        want = eager.results(eager.step())
        graphed.feed(*inputs[i])
        with torch.cuda.stream(side):
            g.replay()
        got = graphed.results(sels)
        for (wt, wo), (gt, go) in zip(want, got):
            assert all(np.array_equal(a, b) for a, b in zip(wt, gt)) and np.array_equal(wo, go)
    assert [[st.ingested for st in states] for states in graphed.states] == mirrors, "torch replays call no hss"
    for states in graphed.states:
        assert [st.sync(s) for st in states] == [n + steps for n in lengths]
    for w in (eager, graphed):
        w.close()
    for normed, q in inputs:
        for b in (*normed, *q):
            b.close()
    for lay in layers:
        for b in lay.bufs:
            b.close()


# -- hostile input ---------------------------------------------------------------------------------------------
def test_bad_arguments_raise_before_any_device_work(gpu, stream, rng, layer):
    rec = Recording(gpu)
    other = layer.indexer(gpu)
    foreign = other.new_seq_state()
    H, nq, hd = D["hidden"], D["nq"], D["hd_attn"]
    with layer.indexer(rec, max_seqs=5) as idx:
        states, _ = start(idx, [3, BOUND + 1, 10], rng, stream)
        full, _ = start(idx, [D["max_tokens"]], rng, stream)
        R = len(states)
        mp = ceil_div(D["max_tokens"], BS)
        cache = kv_cache(rng, R, mp, stream)
        k, v, tables = cache.dev
        tv = table_view(cache)
        x = upload(hidden_rows(rng, R), stream)
        q = upload(rng.standard_normal((R, nq, hd)).astype(BF16), stream)
        qv = q.view("bf16", (R, nq, hd))
        out = cm.DeviceBuffer(R * nq * hd * 2)
        closed = cm.DeviceBuffer(R * H * 2)
        closed.close()
        small = cm.DeviceBuffer(4)
        sel = idx.decode_select_batch(states, x, tv, BS, stream)
        cm.stream_sync(stream)
        before = [(st.ingested, st.pooled) for st in (*states, *full)]
        released = idx.new_seq_state()
        idx.release_seq_state(released)
        del rec.calls[:]
        cases = [
            (lambda: idx.decode_select_batch(states, small, tv, BS, stream), HssError, "normed holds 4 bytes"),
            (lambda: idx.decode_select_batch(states, closed, tv, BS, stream), HssError, "normed is a closed"),
            (lambda: idx.decode_select_batch(states, x, small, BS, stream, max_pages=mp), HssError,
             "block_tables holds 4 bytes"),
            (lambda: idx.decode_select_batch(states, x, tables.ptr, BS, stream), HssError,
             "got an address.*max_pages="),
            (lambda: idx.decode_select_batch(states, x, tables.view("i32", (R - 1, mp)), BS, stream), HssError,
             "max_pages="),
            (lambda: idx.decode_select_batch(states, x, tables.view("f32", (R, mp)), BS, stream), HssError,
             "holds f32 but i32"),
            (lambda: idx.decode_select_batch(states, x, tv, BS, stream, max_pages=1), HssError,
             "a row holds max_pages = 1 pages"),
            (lambda: idx.decode_select_batch(states, x, tv, 4, stream), HssError, "block_size = 4"),
            (lambda: idx.decode_select_batch([*states[:2], foreign], x, tv, BS, stream), HssError,
             r"states\[2\].*another indexer"),
            (lambda: idx.decode_select_batch([states[0], states[1], states[0]], x, tv, BS, stream), HssError,
             r"states\[2\] appears twice"),
            (lambda: idx.decode_select_batch([], x, tv, BS, stream), HssError, "0 states"),
            (lambda: idx.decode_select_batch([*states, *full, foreign, foreign], x, tv, BS, stream), HssError,
             "6 states; a batch holds 1 .. max_seqs = 5"),
            (lambda: idx.decode_select_batch([states[0], released], x, tv, BS, stream), HssError, "released"),
            (lambda: idx.decode_select_batch(full, x, tables.view("i32", (1, R * mp)), BS, stream), HssError,
             "max_tokens"),
            (lambda: idx.sparse_decode_attention(small, k, v, None, sel, out, stream), HssError, "shape"),
            (lambda: idx.sparse_decode_attention(q.ptr, k, v, None, sel, out, stream), HssError, "nq="),
            (lambda: idx.sparse_decode_attention(qv, k, v, None, sel, small, stream), HssError, "out holds 4 bytes"),
            (lambda: idx.sparse_decode_attention(qv, small, v, None, sel, out, stream), HssError,
             "k_pool holds 4 bytes"),
            (lambda: idx.sparse_decode_attention(qv, k, closed, None, sel, out, stream), HssError,
             "v_pool is a closed"),
            (lambda: idx.sparse_decode_attention(qv, k, v, small, sel, out, stream), HssError,
             "block_tables holds 4 bytes"),
            (lambda: idx.sparse_decode_attention(q, k, v, None, sel, out, stream, nq=nq + 1), HssError,
             "multiple of nkv_attn"),
            (lambda: idx.sparse_decode_attention(qv, k, v, None, sel, out, stream, scale=0.0), HssError, "scale"),
            (lambda: idx.sparse_decode_attention(qv, k, v, None, sel, out, stream, scale=math.nan), HssError,
             "scale"),
        ]
        type_cases = [
            (lambda: idx.decode_select_batch(states, x, tv, 16.0, stream), "block_size must be an int, got float"),
            (lambda: idx.decode_select_batch(states, x, tv, BS, stream, max_pages=4.0), "max_pages must be an int"),
            (lambda: idx.decode_select_batch(states, x, tv, BS, None), "a stream is required"),
            (lambda: idx.decode_select_batch(states[0], x, tv, BS, stream), "list or tuple of QsaSeqState"),
            (lambda: idx.decode_select_batch([states[0], "x"], x, tv, BS, stream), r"states\[1\].*QsaSeqState"),
            (lambda: idx.decode_select_batch([states[0], [1]], x, tv, BS, stream), r"states\[1\].*QsaSeqState"),
            (lambda: idx.decode_select_batch(states, "x", tv, BS, stream), "normed: cannot use str"),
            (lambda: idx.sparse_decode_attention(q, k, v, None, sel, out, stream, nq=4.0), "nq must be an int"),
            (lambda: idx.sparse_decode_attention(qv, k, v, None, sel, out, stream, scale="1"),
             "scale must be a number"),
            (lambda: idx.sparse_decode_attention(qv, k, v, None, "sel", out, stream), "QsaDeviceSelection"),
            (lambda: idx.sparse_decode_attention(qv, k, v, None, sel, out, 1.5), "a stream is required"),
        ]
        with driver_work() as calls:
            for call, exc, match in cases:
                with pytest.raises(exc, match=match):
                    call()
                assert rec.calls == [] and calls == [], f"device work before the error {match!r}: {rec.calls}{calls}"
                assert [(st.ingested, st.pooled) for st in (*states, *full)] == before
            for call, match in type_cases:
                with pytest.raises(TypeError, match=match):
                    call()
                assert rec.calls == [] and calls == [], f"device work before the error {match!r}"
                assert [(st.ingested, st.pooled) for st in (*states, *full)] == before
        # a selection from another indexer, a stale one
        with other as o:
            ost = o.new_seq_state()
            osel = o.decode_select_batch([ost], x, tables.view("i32", (1, R * mp)), BS, stream)
            cm.stream_sync(stream)
            del rec.calls[:]
            with driver_work() as calls:
                with pytest.raises(HssError, match="another indexer"):
                    idx.sparse_decode_attention(q.view("bf16", (1, nq * 3, hd)), k, v, None, osel, out, stream)
            assert calls == [] and rec.calls == []
            o.release_seq_state(ost)
            o.release_seq_state(foreign)
        idx.decode_select_batch(states, x, tv, BS, stream)
        cm.stream_sync(stream)
        del rec.calls[:]
        with driver_work() as calls:
            with pytest.raises(HssError, match="stale"):
                idx.sparse_decode_attention(qv, k, v, None, sel, out, stream)
        assert calls == [] and rec.calls == []
        for st in (*states, *full):
            idx.release_seq_state(st)
        for b in (x, q, out, small, *cache.dev):
            b.close()
    with pytest.raises(HssError, match="closed"):
        idx.decode_select_batch(states, x, tv, BS, stream)
    for kw, exc, match in [(dict(max_seqs=0), HssError, "max_seqs = 0"), (dict(max_seqs=4096), HssError, "max_seqs"),
                           (dict(max_seqs=8.0), TypeError, "max_seqs must be an int"),
                           (dict(nq_attn=3), HssError, "nq_attn .3. must be a multiple of nkv_attn"),
                           (dict(nq_attn=True), TypeError, "nq_attn must be an int")]:
        rec2 = Recording(gpu)
        with pytest.raises(exc, match=match):
            layer.indexer(rec2, **kw)
        assert rec2.calls == []


def test_bench_smoke():
    """``python -m hss.bench qsa_device --smoke``: every code path of the benchmark runs (numbers meaningless)."""
    from hss.bench import qsa_device as bench
    rows = bench.run(bench.parse_args(["--smoke"]))
    assert [(r["visible"], r["batch"]) for r in rows] == [(40, 1), (40, 3), (72, 1), (72, 3)]
    assert all(r[f"{k}_us"] > 0 for r in rows for k in bench.STAGES)
    text = bench.table(rows)
    assert "graph wall/token" in text and "Targets" in text and "NOT met" not in text
