"""The capturable exact swap step (hss.model.staged through SwapKV and Session): greedy tokens equal hbm's across
page boundaries for every resident / ring split, graph replay equals eager bit for bit, the HBM pool holds the
store's bytes, the step graphs change exactly at page boundaries (captured ahead where the host had time), the copy
stream's ordering holds when it races ahead, one attention tile per layer, and bad options fail before device work.
The tiny random model of tests/test_model.py (2 layers, head_dim 64: 32-token pages) on the emulator in CI, the GPU
on the device."""
from __future__ import annotations

import types

import numpy as np
import pytest

import hss.model.staged as staged_mod
from hss import cuda_min as cm
from hss._util import ceil_div
from hss.demo.model import random_model
from hss.errors import HssError
from hss.model import DeviceModel, swap_block_size
from hss.model.kv import SwapKV
from hss.model.staged import RING

from conftest import ON_GPU


@pytest.fixture(scope="module")
def model(ctx):
    with DeviceModel(random_model(3), ctx) as m:
        yield m


@pytest.fixture(scope="module")
def bs(model):
    return swap_block_size(model.config.head_dim)


def prompt_of(n: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(0, 512, n).tolist()


def decode(model, kv: str, ids: list[int], n: int, **opts) -> tuple[list[int], np.ndarray, dict]:
    with model.session(kv, max_tokens=len(ids) + n + 1, **opts) as sess:
        sess.prefill(ids)
        tokens = sess.generate(n)
        info = {"switches": list(sess.graph_switches), "stats": sess.kv.stats(), "captures": sess.captures,
                "page_bytes": getattr(getattr(sess.kv, "staged", None), "page_bytes", 0)}
        return tokens, sess.logits(), info


@pytest.fixture(scope="module")
def hbm(model, bs):
    """hbm's greedy tokens for a prompt 3 tokens short of a page boundary, decoded across three more."""
    ids = prompt_of(2 * bs - 3, 11)
    n = 3 * bs + 5
    return ids, n, decode(model, "hbm", ids, n, graph=True)[0]


def forced(model, kv: str, ids: list[int], tokens: list[int], **opts) -> tuple[list[int], list[np.ndarray], dict]:
    """Teacher forcing along ``tokens`` (``tokens[0]`` the prefill's greedy token): the device's greedy token and
    the logits after the prefill and after each step fed ``tokens[i]`` (graphs from the second step on, if asked)."""
    out, logits = [], []
    with model.session(kv, max_tokens=len(ids) + len(tokens) + 1, **opts) as sess:
        sess.prefill(ids)
        word = np.zeros(1, np.int32)
        for t in [None, *tokens[:-1]]:
            if t is not None:
                sess.feed(t)
                sess.step()
                if sess.graph and sess._graphs is None:
                    sess.capture()
            cm.copy_d_to_h_async(word, sess.fwd.state, 4, sess.stream)
            out.append(int(word[0]))
            logits.append(sess.logits())
        info = {"switches": list(sess.graph_switches), "stats": sess.kv.stats(), "captures": sess.captures,
                "page_bytes": getattr(getattr(sess.kv, "staged", None), "page_bytes", 0)}
    return out, logits, info


@pytest.mark.parametrize("resident, ring", [(0, 1), (0, 2), (2, 2), (4, 1), (100, 2)])
def test_swap_graph_tokens_equal_hbm_across_page_boundaries(model, bs, hbm, resident, ring):
    """Resident pages per layer 0, 1, 2 and all (resident // 2 layers), one or two staging slots, step graphs
    switched at three page boundaries: teacher forced along hbm's greedy tokens, every step's token is hbm's, or a
    near tie of the swap's own logits (within one bf16 step of their max: swap and hbm attend the same tokens in
    other tiles, so f32 sums round differently); the stats count every complete page of every step once."""
    ids, n, want = hbm
    tokens, logits, info = forced(model, "swap", ids, want, graph=True, resident=resident, ring=ring)
    for i, (got, w, lg) in enumerate(zip(tokens, want, logits)):
        assert got == w or lg[w] >= lg.max() - 2.0 ** -7 * abs(lg.max()) - 1e-3, (i, got, w)
    assert sum(a == b for a, b in zip(tokens, want)) >= 0.95 * n
    assert [p for p, _ in info["switches"]] == switches(len(ids) + 2, len(ids) + n - 1, bs, ring)
    st, layers = info["stats"], model.config.n_layer
    r = min(resident // layers, ceil_div(len(ids) + n + 1, bs))
    pages = sum((len(ids) + i) // bs for i in range(n - 1))      # complete pages per layer over the steps
    hits = sum(min((len(ids) + i) // bs, r) for i in range(n - 1))
    assert st["steps"] == n - 1
    assert (st["hits"], st["misses"]) == (layers * hits, layers * (pages - hits))
    assert st["bytes_read"] == st["misses"] * info["page_bytes"]
    assert info["page_bytes"] == 2 * model.config.n_kv_head * 2 * bs * model.config.head_dim   # 4 KiB stripes


def switches(lo: int, hi: int, bs: int, ring: int) -> list[int]:
    """Positions in lo .. hi - 1 where the step graphs change: each page boundary and, with more than one staging
    slot, the step after it (the first one whose first layers the step before copied)."""
    bounds = [p for p in range(lo, hi) if p % bs == 0]
    return sorted(bounds + [p + 1 for p in bounds if ring > 1 and p + 1 < hi])


def test_swap_graph_replay_equals_eager_bitwise(model, bs):
    ids, n = prompt_of(bs + 30, 12), bs + 6
    eager = decode(model, "swap", ids, n, graph=False, resident=2)
    graph = decode(model, "swap", ids, n, graph=True, resident=2)
    assert graph[0] == eager[0]
    assert np.array_equal(graph[1].view(np.uint32), eager[1].view(np.uint32))
    assert eager[2]["captures"] == 0 and graph[2]["captures"] >= 2


def test_step_graphs_change_exactly_at_page_boundaries(model, bs, hbm):
    """A switch at each boundary crossed (a position that is a multiple of the page size) and at the step after it;
    every one after the first boundary's two was captured ahead (the host had AHEAD steps queued); a stale graph (no
    switch) gives other tokens."""
    ids, n, want = hbm
    _, _, info = decode(model, "swap", ids, n, graph=True, resident=2)
    start, end = len(ids), len(ids) + n - 1
    assert [p for p, _ in info["switches"]] == switches(start + 1, end, bs, RING)
    assert all(ahead for _, ahead in info["switches"][2:])   # (the first boundary comes before the ring fills)
    if ON_GPU:     # a stale graph skips copies: its slots hold whatever HBM held (poison on the emulator)
        return
    with pytest.MonkeyPatch.context() as mp:   # the mutation: replay the first epoch's graphs throughout
        mp.setattr(SwapKV, "graph_epoch", property(lambda self: 0))
        try:
            stale = decode(model, "swap", ids, n, graph=True, resident=2)[0]
        except Exception:      # e.g. the tail tile reading past its buffer
            stale = None
    assert stale != want, "the boundary switch does not bite"


def test_pool_holds_the_stores_pages(model, bs):
    """After the steps: every layer's resident pages and each staging slot (the last layer copied through it) equal
    the store's bytes of those pages."""
    ids, n = prompt_of(3 * bs + 7, 13), bs + 2
    c = model.config
    with model.session("swap", max_tokens=len(ids) + n + 1, graph=True, resident=2, ring=1) as sess:
        sess.prefill(ids)
        sess.generate(n)
        sess.sync()
        st, store = sess.kv.staged, sess.kv.swap.store
        pool = st.read_pages(sess.stream)
        full, r, bb = st.full, st.resident, st.page_bytes
        assert full == (len(ids) + n - 1) // bs and r == 1
        page = lambda layer, p: store.buffer.array[store.offset(layer, p):store.offset(layer, p) + bb]  # noqa: E731
        for layer in range(c.n_layer):
            for p in range(r):
                assert np.array_equal(st.resident_view(pool, layer)[p], page(layer, p)), (layer, p)
        last = c.n_layer - 1            # ring 1: the one slot holds the last layer's pages r .. full - 1
        slot = st.slot_view(pool, 0)
        for p in range(r, full):
            assert np.array_equal(slot[p - r], page(last, p)), p
        assert not np.array_equal(slot[0], page(0, r)), "layers differ: the comparison bites"


def racing_copies(monkeypatch) -> None:
    """Make the copy stream run each copy as soon as it is queued (as a fast copy engine may)."""
    copy = staged_mod.StagedPages._copy

    def racing(self, layer):
        copy(self, layer)
        self.copy_stream.synchronize()
    monkeypatch.setattr(staged_mod.StagedPages, "_copy", racing)


def test_copy_stream_racing_ahead_changes_nothing(model, bs, hbm, monkeypatch):
    """Eager steps whose copy stream runs each copy as soon as it is queued: the waits for the attention's reads
    keep every slot until it is read, so the tokens stay hbm's."""
    ids, n, want = hbm
    n = bs + 8
    racing_copies(monkeypatch)
    assert decode(model, "swap", ids, n, graph=False, ring=1, resident=0)[0] == want[:n]


@pytest.mark.emulator
def test_copy_stream_racing_without_the_read_waits_breaks(model, bs, hbm, monkeypatch):
    """The mutation of the test above: without the write-after-read waits a racing copy overwrites a slot before
    its layer reads it, so the tokens change. Emulator only: the emulator runs a synchronized copy at once, a real
    GPU may still not lose the race (the compute stream's reads may come first)."""
    ids, n, want = hbm
    n = bs + 8
    racing_copies(monkeypatch)
    real = cm.stream_wait_event
    with model.session("swap", max_tokens=len(ids) + n + 1, ring=1, resident=0) as sess:
        reads = sess.kv.staged._read
        proxy = types.SimpleNamespace(**{k: getattr(cm, k) for k in dir(cm) if not k.startswith("__")})
        proxy.stream_wait_event = lambda stream, ev: None if ev in reads else real(stream, ev)
        monkeypatch.setattr(staged_mod, "cm", proxy)
        sess.prefill(ids)
        assert sess.generate(n) != want[:n], "the write-after-read waits do not bite"


def test_the_host_sparse_step_stays_a_host_path_and_the_device_step_is_one_graph(model, bs):
    ids = prompt_of(2 * bs, 14)
    with model.session("sparse", max_tokens=len(ids) + 4, budget=1, resident=2, tile=1, graph=True,
                       device_step=False) as sess:
        assert not sess.kv.capturable and sess.kv.staged is None and sess.kv.next_epoch() is None
        sess.prefill(ids)
        assert len(sess.generate(3)) == 3
        assert any(kind == "host" for kind, _ in sess._graphs)
    with model.session("sparse", max_tokens=len(ids) + 2 * bs, budget=1, graph=True) as sess:
        assert sess.kv.capturable and sess.kv.sparse_step is not None and sess.kv.graph_epoch == 0
        sess.prefill(ids)
        assert len(sess.generate(bs + 3)) == bs + 3   # across a page boundary: the same graph replays
        assert all(kind == "graph" for kind, _ in sess._graphs) and sess.captures == 1
    with model.session("swap", max_tokens=len(ids) + 4) as sess:
        assert sess.kv.capturable and sess.kv.staged is not None


def test_bad_options_fail_before_device_work(model, bs):
    for exc, opts in ((HssError, {"ring": 0}), (TypeError, {"ring": 1.5}), (HssError, {"resident": -1}),
                      (TypeError, {"resident": "4"})):
        with pytest.raises(exc):
            model.session("swap", max_tokens=64, **opts)
    ids = prompt_of(bs + 3, 15)
    with model.session("swap", max_tokens=len(ids) + 4) as sess:
        sess.kv.swap.alloc_disk_block()        # page 0 would get block 1: the one-copy layout needs block p = page p
        with pytest.raises(HssError, match="page order"):
            sess.prefill(ids)


def test_one_attention_tile_per_layer(model, bs, monkeypatch):
    """An exact decode step queues one token-count tile per layer (complete pages and the tail page together, the
    RoPE inside it), none of the page-count kind; across a page boundary too."""
    import hss.attention as attention
    calls = {"tile": 0, "tile_tokens": 0, "tile_tokens_rope": 0}
    for name in calls:
        real = getattr(attention.TileStep, name)

        def counted(self, *a, _real=real, _name=name, **k):
            calls[_name] += 1
            return _real(self, *a, **k)
        monkeypatch.setattr(attention.TileStep, name, counted)
    ids, n = prompt_of(bs - 2, 16), 4       # steps at positions bs - 2 .. bs + 1: one boundary
    with model.session("swap", max_tokens=len(ids) + n + 1, graph=False, resident=0) as sess:
        sess.prefill(ids)
        sess.generate(n)
        steps = sess.steps
    assert calls == {"tile": 0, "tile_tokens": 0, "tile_tokens_rope": steps * model.config.n_layer}
