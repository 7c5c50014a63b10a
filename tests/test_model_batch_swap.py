"""Tests for hss.model.batch_swap (BatchSession(kv="swap"), the exact swap batched).

Every row decodes what a lone ``Session(kv="swap")`` with the same prompt, sampling and options decodes (on the
emulator bit for bit, on a GPU up to a near tie of the lone run's logits), whatever its lane, through joins, leaves,
lane moves and pages completing while rows decode, for several resident / ring splits, the fused RoPE or not, a pool
of block ids that keeps each row one run or one that scatters them; graph replay equals eager bit for bit, the step
graphs are captured again exactly when the epoch changes (ahead of time where the change was known), a stale graph
or a copy racing past the attention's read bites; the HBM pool holds the store's bytes, the counters add up, one
attention tile per layer, bad options and an exhausted store fail before device work and change nothing. The tiny
random model of tests/test_model.py (2 layers, head_dim 64: 32-token pages) on the emulator in CI, the GPU on the
device.
"""
from __future__ import annotations

import types

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from test_model_batch import SPARSE_SCHEDULE, alone, assert_decodes_alone, prompt_of, run_schedule
from test_model_sampling import same_draws, state_token

import hss.model.batch_swap as swap_mod
from hss import cuda_min as cm
from hss.demo.model import RANDOM_CONFIG, random_model
from hss.errors import HssError
from hss.model import BatchSession, DeviceModel, SamplingParams, swap_block_size
from hss.model.batch_swap import BatchSwapKV, _BlockPool

from conftest import ON_GPU

BS = swap_block_size(RANDOM_CONFIG.head_dim)   # 32 tokens a page
TOKENS = 7 * BS
LAYERS = RANDOM_CONFIG.n_layer
SWAP = {"resident": 2, "ring": 2}              # the first page of every layer resident, two staging slots
DRAWN = SamplingParams(temperature=0.8, top_p=0.95, seed=7)
PROMPTS = {name: prompt for _, name, prompt, _ in (a for a in SPARSE_SCHEDULE if a[0] == "add")}


@pytest.fixture(scope="module")
def model(ctx):
    with DeviceModel(random_model(3), ctx) as m:
        yield m


def play(b: BatchSession, schedule) -> dict[str, int]:
    ids = {}
    for action, *args in schedule:
        if action == "add":
            ids[args[0]] = b.add(args[1], **args[2])
        elif action == "step":
            for _ in range(args[0]):
                b.step()
        else:
            b.remove(ids[args[0]])
    b.drain()
    return ids


def attended(prompt_len: int, steps: int, resident: int) -> tuple[int, int]:
    """(resident, streamed) complete pages a row's steps attend per layer."""
    full = [pos // BS for pos in range(prompt_len, prompt_len + steps)]
    return sum(min(f, resident) for f in full), sum(max(f - resident, 0) for f in full)


# -- the rows decode what they decode alone ------------------------------------------------------------------
@pytest.mark.parametrize("opts", [{"resident": 2, "ring": 2}, {"resident": 0, "ring": 1},
                                  {"resident": 6, "ring": 3, "fuse_rope": False}, {"resident": 0, "ring": 2,
                                                                                   "pages": 20}],
                         ids=["resident1-ring2", "resident0-ring1", "resident3-ring3-paged-rope",
                              "scattered-blocks"])
def test_swap_rows_decode_what_they_decode_alone(model, opts):
    """SPARSE_SCHEDULE's rows (a page boundary, one token short of it, several pages; b leaves while d sits in the
    last lane, a leaves with f in the last lane; a, c and e complete pages as they decode) with graphs: each row
    decodes what Session(kv="swap") decodes alone with the same resident / ring options, and its counters add up to
    the complete pages it attended (resident ones hits, streamed ones misses). ``pages`` 20 (two aligned runs of a
    row's 7) makes the pool hand out scattered ids: several copies per row and layer."""
    lone = {k: v for k, v in opts.items() if k in ("resident", "ring")}
    with BatchSession(model, "swap", max_batch=4, max_tokens=TOKENS, graph=True, **opts) as b:
        extra = []   # copies beyond one per row and layer
        real, room = b.kv._plan, b.kv._room

        def plan():
            got = real()
            extra.append(len(got[0]) - len({at // room for at, _, _ in got[0]}))
            return got
        b.kv._plan = plan
        ids = play(b, SPARSE_SCHEDULE)
        assert b.free_pages == b.pages and b.captures > 3
        r = b.kv.resident
        for name, rid in ids.items():
            got, want = b.counters(rid), attended(len(PROMPTS[name]), len(b.finished[rid].tokens) - 1, r)
            assert (got["hits"].tolist(), got["misses"].tolist()) == ([want[0]] * LAYERS, [want[1]] * LAYERS), name
            assert np.array_equal(got["bytes_read"], got["misses"] * b.kv.page_bytes)
    assert (max(extra) > 0) == ("pages" in opts), "only the scattered pool gives a row more than one run"
    for name, rid in ids.items():
        assert_decodes_alone(model, PROMPTS[name], b.finished[rid].tokens, TOKENS, name, "swap", **lone)


def test_swap_graph_replay_equals_eager_bit_for_bit(model):
    """The same schedule eager and replayed: the same tokens and, after every add and step, the same logits bits of
    every live row; the replayed run captured again at epoch changes, most of them ahead of time."""
    eager = run_schedule(model, SPARSE_SCHEDULE, TOKENS, kv="swap", max_batch=4, **SWAP)
    replay = run_schedule(model, SPARSE_SCHEDULE, TOKENS, kv="swap", max_batch=4, graph=True, **SWAP)
    assert eager[0] == replay[0] and eager[3][2] == replay[3][2] and eager[3][0] == 0 and replay[3][0] > 3
    assert len(eager[2]) == len(replay[2])
    for a, b in zip(eager[2], replay[2]):
        assert a.keys() == b.keys()
        for name in a:
            assert np.array_equal(a[name].view(np.uint32), b[name].view(np.uint32)), name


def test_sampling_rows_draw_what_they_draw_alone(model):
    """A sampled row and a greedy one, joining at different steps (the sampled row moves lanes when the first
    leaves) and completing pages as they decode: the greedy row decodes what it decodes alone, the sampled one draws
    what Session(kv="swap", sampling=) draws with its seed (token for token while the logits agree: all of them on
    the emulator)."""
    first, drawn = prompt_of(2 * BS - 2, 41), prompt_of(3 * BS + 5, 42)
    logits = []
    with BatchSession(model, "swap", max_batch=3, max_tokens=TOKENS, graph=True, **SWAP) as b:
        g = b.add(first, max_new=5)
        b.step()
        s = b.add(drawn, max_new=3 * BS // 2, sampling=DRAWN)
        while b.rows:
            if s in b.rows:
                logits.append(b.logits(s))
            b.step()
    got = b.finished[s].tokens
    assert_decodes_alone(model, first, b.finished[g].tokens, TOKENS, "greedy", "swap", **SWAP)
    with model.session("swap", max_tokens=TOKENS, sampling=DRAWN, **SWAP) as sess:
        sess.prefill(drawn)
        want, want_logits = [], []
        for i in range(len(got)):
            if i:
                sess.step()
            want.append(state_token(sess))
            want_logits.append(sess.logits())
    same_draws(got, logits, want, want_logits, "sampled")
    assert got != alone(model, drawn, len(got), TOKENS, "swap", **SWAP), "the row sampled"


@given(lengths=st.lists(st.integers(1, 4 * BS), min_size=1, max_size=4), steps=st.lists(st.integers(0, 40),
       min_size=4, max_size=4), leave=st.integers(0, 3), resident=st.sampled_from([0, 2, 4]),
       ring=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_random_schedules_decode_alone(model, lengths, steps, leave, resident, ring, seed):
    """Random prompts joining after random numbers of steps, one removed: every row decodes what it decodes alone."""
    opts = {"resident": resident, "ring": ring}
    prompts = [prompt_of(n, seed + i) for i, n in enumerate(lengths)]
    with BatchSession(model, "swap", max_batch=4, max_tokens=5 * BS, graph=True, **opts) as b:
        rows = []
        for p, n in zip(prompts, steps):
            rows.append(b.add(p, max_new=24))
            for _ in range(n % 12):
                if b.rows:
                    b.step()
            if len(rows) == leave + 1 and rows[leave] in b.rows:
                b.remove(rows[leave])
        b.drain()
        assert b.free_pages == b.pages
    for p, r in zip(prompts, rows):
        assert_decodes_alone(model, p, b.finished[r].tokens, 5 * BS, str(len(p)), "swap", **opts)


# -- the step's machinery ------------------------------------------------------------------------------------
def test_graphs_change_exactly_with_the_epoch(model):
    """Two rows whose pages complete at different steps: a new capture (ahead of time, while the step before ran) for
    each epoch, none between; a stale graph (the mutation: an epoch that never changes) gives other tokens."""
    prompts = [prompt_of(BS - 3, 51), prompt_of(2 * BS - 9, 52)]

    def run() -> tuple[list[list[int]], int, list[int]]:
        with BatchSession(model, "swap", max_batch=2, max_tokens=4 * BS, graph=True, resident=0, ring=2) as b:
            rows = [b.add(p, max_new=2 * BS) for p in prompts]
            b.step()                         # eager: the size's first step
            counts = [0]
            while b.rows:
                before = b.captures
                b.step()
                counts.append(b.captures - before)
            return [b.finished[r].tokens for r in rows], b.captures, counts
    tokens, captures, counts = run()
    steps = 2 * BS - 1   # step k (1-based) writes position len(p) + k - 1 of each row
    events = [k for k in range(1, steps + 1) if any((len(p) + k) % BS == 0 for p in prompts)]
    assert len(events) == 4 and captures == 1 + 2 * len(events)
    # the first replay's capture (step 2), then at each event the capture of the step after it and of the one
    # after that (the slots prefetched), both queued while the event's step ran
    assert [k for k, n in enumerate(counts, 1) if n] == sorted({2, *events, *(k + 1 for k in events)})
    assert max(counts) == 1
    for p, t in zip(prompts, tokens):
        assert_decodes_alone(model, p, t, 4 * BS, str(len(p)), "swap", resident=0, ring=2)
    if ON_GPU:   # a stale graph copies the wrong sizes: what the slots then hold is HBM's business
        return
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(BatchSwapKV, "graph_epoch", property(lambda self: 0, lambda self, v: None), raising=False)
        try:
            stale = run()[0]
        except Exception:    # e.g. a copy or tile reading past its buffer
            stale = None
    assert stale != tokens, "the epoch does not bite"


def test_the_epoch_follows_the_copies_only(model):
    """A row without staged pages joining and leaving changes no copy: the graph of the batch size and its prefetched
    slots stay; with every page resident nothing is ever copied and one capture serves throughout."""
    long, short = prompt_of(2 * BS + 5, 55), prompt_of(10, 56)
    with BatchSession(model, "swap", max_batch=2, max_tokens=4 * BS, graph=True, batch_sizes=(2,), resident=0,
                      ring=2) as b:
        a = b.add(long, max_new=12)
        b.step()
        b.step()                                     # captured, the slots prefetched
        epoch, captures = b.kv.graph_epoch, b.captures
        assert b.kv.prefetched and captures == 1
        s = b.add(short, max_new=4)
        b.step()
        assert (b.kv.graph_epoch, b.captures, b.kv.prefetched) == (epoch, captures, True)
        b.remove(s)
        b.step()
        assert (b.kv.graph_epoch, b.captures) == (epoch, captures)
        b.drain()
    assert_decodes_alone(model, long, b.finished[a].tokens, 4 * BS, "long", "swap", resident=0, ring=2)
    assert_decodes_alone(model, short, b.finished[s].tokens, 4 * BS, "short", "swap", resident=0, ring=2)
    with BatchSession(model, "swap", max_batch=2, max_tokens=4 * BS, graph=True, batch_sizes=(2,),
                      resident=LAYERS * 4) as b:
        rows = [b.add(long, max_new=3 * BS // 2), b.add(short, max_new=BS)]
        b.drain()
        assert b.captures == 1 and b.kv.graph_epoch == 0
    for p, r in zip((long, short), rows):
        assert_decodes_alone(model, p, b.finished[r].tokens, 4 * BS, str(len(p)), "swap", resident=LAYERS * 4)


def racing(monkeypatch) -> None:
    """Make the copy stream run each copy as soon as it is queued (as a fast copy engine may)."""
    copy = BatchSwapKV._copy

    def fast(self, layer, runs):
        copy(self, layer, runs)
        self.copy_stream.synchronize()
    monkeypatch.setattr(BatchSwapKV, "_copy", fast)


def test_copy_stream_racing_ahead_changes_nothing(model, monkeypatch):
    racing(monkeypatch)
    tokens = run_schedule(model, SPARSE_SCHEDULE[:3], TOKENS, kv="swap", max_batch=2, resident=0, ring=1)[0]
    for name, got in tokens.items():
        assert_decodes_alone(model, PROMPTS[name], got, TOKENS, name, "swap", resident=0, ring=1)


@pytest.mark.emulator
def test_copy_stream_racing_without_the_read_waits_breaks(model, monkeypatch):
    """The mutation of the test above: without the write-after-read waits a racing copy overwrites a slot before
    its layer reads it (emulator only: a real GPU may still not lose the race)."""
    racing(monkeypatch)
    real = cm.stream_wait_event
    with BatchSession(model, "swap", max_batch=2, max_tokens=TOKENS, resident=0, ring=1) as b:
        reads = b.kv._read
        proxy = types.SimpleNamespace(**{k: getattr(cm, k) for k in dir(cm) if not k.startswith("__")})
        proxy.stream_wait_event = lambda stream, ev: None if ev in reads else real(stream, ev)
        monkeypatch.setattr(swap_mod, "cm", proxy)
        rows = [b.add(PROMPTS[n], max_new=9) for n in "ab"]
        b.drain()
        got = [b.finished[r].tokens for r in rows]
    monkeypatch.undo()
    want = run_schedule(model, [("add", n, PROMPTS[n], {"max_new": 9}) for n in "ab"], TOKENS, kv="swap",
                        max_batch=2, resident=0, ring=1)[0]
    assert got != [want["a"], want["b"]], "the write-after-read waits do not bite"


def test_pool_holds_the_stores_pages(model):
    """After the steps: every live row's resident pages and its part of the one staging slot (the last layer copied
    through it) equal the store's bytes of its blocks; the store's pages are the prompt's, packed."""
    ids = [prompt_of(3 * BS + 7, 61), prompt_of(2 * BS + 1, 62)]
    with BatchSession(model, "swap", max_batch=2, max_tokens=TOKENS, resident=2, ring=1) as b:
        rows = [b.add(p) for p in ids]
        for _ in range(BS - 5):
            b.step()
        kv = b.kv
        pool = kv.read_pool()
        store = kv.store.array.reshape(LAYERS, kv.pages, kv.page_bytes)
        last, R = LAYERS - 1, kv.resident
        for rid in rows:
            row = b._rows[rid]
            assert len(row.pages) == b._rows[rid].pos // BS
            for layer in range(LAYERS):
                for p in range(R):
                    assert np.array_equal(pool[(row.lane * LAYERS + layer) * R + p], store[layer, row.pages[p]])
            for p in range(R, len(row.pages)):
                at = kv._slot0 + row.lane * kv._room + p - R
                assert np.array_equal(pool[at], store[last, row.pages[p]]), (rid, p)
        assert not np.array_equal(store[0, 0], store[last, 0]), "layers differ: the comparison bites"
        k, _ = kv.layout.unpack_page(store[0, b._rows[rows[0]].pages[0]])
    with model.session("hbm", max_tokens=len(ids[0]) + 1) as sess:   # the first page's keys: the prefill's
        sess.prefill(ids[0])
        keys = sess.kv.read_keys(sess.stream, BS)
    assert np.array_equal(k.view(np.uint16), keys[0].view(np.uint16))


def test_one_attention_tile_per_layer(model, monkeypatch):
    import hss.attention as attention
    calls = {"tile": 0, "tile_tokens": 0, "tile_tokens_rope": 0}
    for name in calls:
        real = getattr(attention.TileStep, name)

        def counted(self, *a, _real=real, _name=name, **k):
            calls[_name] += 1
            return _real(self, *a, **k)
        monkeypatch.setattr(attention.TileStep, name, counted)
    with BatchSession(model, "swap", max_batch=2, max_tokens=TOKENS, resident=0) as b:
        for p in (prompt_of(BS - 2, 71), prompt_of(3 * BS, 72)):
            b.add(p, max_new=5)
        b.drain()
        steps = b.steps
    assert calls == {"tile": 0, "tile_tokens": 0, "tile_tokens_rope": steps * LAYERS}


def test_one_copy_per_row_and_layer(model):
    """The default pool keeps each row's blocks one run (a free extent of a row's pages at join, the next id as it
    grows): a step copies each row's staged pages of a layer in one cuMemcpyHtoDAsync."""
    with BatchSession(model, "swap", max_batch=3, max_tokens=TOKENS, resident=0) as b:
        rows = [b.add(prompt_of(n, 80 + n)) for n in (BS + 3, 2 * BS - 1, 3 * BS - 2)]
        for _ in range(BS + 2):
            b.step()
        runs, staged = b.kv._plan()
        assert len(runs) == 3 and staged == sum(len(b._rows[r].pages) for r in rows)
        assert b.kv.step_bytes == LAYERS * staged * b.kv.page_bytes
        assert all(p == list(range(p[0], p[0] + len(p))) for p in (b._rows[r].pages for r in rows))


@given(ops=st.lists(st.tuples(st.sampled_from(["take", "grow", "give"]), st.integers(0, 9)), max_size=40))
def test_block_pool_never_gives_an_id_twice(ops):
    """Random joins, growth and leaves: no id held twice, the free count exact, a join of at most ``extent`` pages
    takes the first aligned free run when there is one, a growing row the id after its last when free."""
    pool, held = _BlockPool(23, 5), []
    for op, n in ops:
        if op == "take" and n <= pool.count:
            extent = pool.free[:20].reshape(4, 5).all(axis=1)   # aligned runs of 5 free ids
            got = pool.take(n)
            if 0 < n <= 5 and extent.any():   # the first free run, else the lowest ids
                first = 5 * int(np.flatnonzero(extent)[0])
                assert got == list(range(first, first + n))
            held.append(got)
        elif op == "grow" and held and pool.count:
            row = held[n % len(held)]
            after = row[-1] + 1 if row and row[-1] + 1 < 23 and pool.free[row[-1] + 1] else None
            row.append(pool.take_after(row[-1] if row else None))
            assert after is None or row[-1] == after
        elif op == "give" and held:
            pool.give(held.pop(n % len(held)))
        ids = [i for row in held for i in row]
        assert len(ids) == len(set(ids)) and pool.count == 23 - len(ids)
        assert not pool.free[ids].any()


# -- checks -----------------------------------------------------------------------------------------------------
def test_bad_options_raise_before_device_work(model):
    ok = {"max_batch": 2, "max_tokens": 64}
    cases = [(HssError, "resident", {"resident": -1}), (TypeError, "resident", {"resident": "4"}),
             (HssError, "ring", {"ring": 0}), (TypeError, "ring", {"ring": 1.5}),
             (HssError, "one row of max_tokens", {"pages": 1}), (HssError, "sparse KV mode", {"budget": 1})]
    free = cm.mem_info()[0]
    for exc, match, kw in cases:
        with pytest.raises(exc, match=match):
            BatchSession(model, "swap", **ok, **kw)
    for kv in ("hbm", "sparse"):
        with pytest.raises(HssError, match="exact swap"):
            BatchSession(model, kv, **ok, resident=4, **({"budget": 1} if kv == "sparse" else {}))
    assert cm.mem_info()[0] == free, "a refused BatchSession allocated device memory"
    with BatchSession(model, "swap", **ok) as b:
        with pytest.raises(HssError, match="never added"):
            b.counters(0)
        for bad in ([], [512], list(range(64))):
            with pytest.raises(HssError):
                b.add(bad)
        assert b.rows == () and b.free_pages == b.pages


def test_an_exhausted_store_refuses_before_device_work(model):
    """Three block ids: a prompt that would need more is refused, a step that completes more pages than are free is
    refused, both changing nothing; a removal frees the ids."""
    with BatchSession(model, "swap", max_batch=2, max_tokens=3 * BS, pages=3, resident=0) as b:
        r = b.add(prompt_of(2 * BS - 1, 91))
        assert b.free_pages == 2
        b.step()                                         # completes its second page
        with pytest.raises(HssError, match="free pages"):
            b.add(prompt_of(2 * BS + 6, 92))             # two pages and the one its first step completes
        assert b.rows == (r,) and b.free_pages == 1
        s = b.add(prompt_of(BS - 1, 93))                 # its first step completes a page: the last id
        for _ in range(BS - 1):                          # r then writes position 3 BS - 2
            b.step()
        assert b.free_pages == 0 and b._rows[r].pos == 3 * BS - 1
        before = (b.tokens(r), b.tokens(s), b.steps)
        with pytest.raises(HssError, match="complete a KV page"):   # r's third page, none free
            b.step()
        assert (b.tokens(r), b.tokens(s), b.steps, b.free_pages) == (*before, 0)
        b.remove(r)
        assert b.free_pages == 2
        b.drain()
        assert b.free_pages == 3 and b.finished[s].reason == "length"
    assert_decodes_alone(model, prompt_of(BS - 1, 93), b.finished[s].tokens, 3 * BS, "s", "swap", resident=0)
