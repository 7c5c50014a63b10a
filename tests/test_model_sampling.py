"""Sampling in the model sessions: ``Session(sampling=...)`` and ``BatchSession.add(..., sampling=...)`` with the
device sampler (:class:`hss.model.sample.Sampler`) in place of ``model_argmax``.

Greedy (None or a greedy :class:`SamplingParams`) keeps the argmax op and its tokens bit for bit; a sampling
session's tokens are the reference's draws (:func:`hss.reference.sample.sample_row`) from its own logits, with the
prompt's tail as the penalties' history; the sampler's launch is inside the captured step graph (replay equals eager);
a batch row draws what it draws alone, whatever its lane, its neighbours or its moves between lanes. On the
emulator bit for bit; on a GPU (where cuBLAS may pick another algorithm per m) token for token while the two runs'
logits agree bit for bit. The tiny random model of tests/test_model.py.
"""
from __future__ import annotations

import numpy as np
import pytest
from test_model_batch import assert_decodes_alone, prompt_of, run_schedule
from test_sample import Mirror, near_boundary

from hss.decls import sample as ks
from hss.demo.model import random_model
from hss.errors import HssError
from hss.model import BatchSession, DeviceModel
from hss.model.sample import GREEDY, Sampler, SamplingParams
from hss.model.weights import BF16

from conftest import ON_GPU
from helpers import download, upload

TOP_P = SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, seed=11)
PLAIN = SamplingParams(temperature=1.0, seed=2**63 + 5)
PENALISED = SamplingParams(temperature=0.7, top_p=0.9, repetition_penalty=1.3, presence_penalty=0.4, seed=3)
GREEDY_PENALISED = SamplingParams(repetition_penalty=50.0, presence_penalty=2.0)   # temperature 0: argmax after


@pytest.fixture(scope="module")
def model(ctx):
    with DeviceModel(random_model(3), ctx) as m:
        yield m


def state_token(sess) -> int:
    return int(download(sess.fwd.state, (1,), np.int32, sess.stream)[0])


def same_draws(got: list[int], got_logits: list[np.ndarray], want: list[int], want_logits: list[np.ndarray],
               what: str) -> None:
    """Token for token while the logits that chose them agree bit for bit (all of them on the emulator)."""
    assert len(got) == len(want), what
    for i, (a, b) in enumerate(zip(got, want)):
        if i < min(len(got_logits), len(want_logits)) and not np.array_equal(got_logits[i].view(np.uint32),
                                                                               want_logits[i].view(np.uint32)):
            assert ON_GPU, f"{what}: the logits of token {i} differ on the emulator"
            return
        assert a == b, f"{what}: token {i}: {a} != {b} ({got} vs {want})"


# -- the params type and the sampler's row API ----------------------------------------------------------------
def test_sampling_params_are_checked_when_made():
    assert SamplingParams() == GREEDY and GREEDY.greedy and SamplingParams(top_k=5, top_p=0.5, seed=9).greedy
    assert not TOP_P.greedy and not GREEDY_PENALISED.greedy and not SamplingParams(presence_penalty=-1.0).greedy
    assert TOP_P.kernel_params() == {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05,
                                     "repetition_penalty": 1.0, "presence_penalty": 0.0}
    assert type(SamplingParams(top_k=np.int64(3), seed=np.uint64(2**64 - 1)).seed) is int
    bad = [({"temperature": -0.5}, HssError), ({"top_k": ks.CANDIDATES + 1}, HssError), ({"top_k": 1.0}, TypeError),
           ({"top_p": 0.0}, HssError), ({"min_p": 2.0}, HssError), ({"repetition_penalty": 0.0}, HssError),
           ({"presence_penalty": float("inf")}, HssError), ({"seed": -1}, HssError), ({"seed": 2**64}, HssError),
           ({"seed": 1.0}, TypeError), ({"temperature": "hot"}, TypeError)]
    for kw, exc in bad:
        with pytest.raises(exc, match=next(iter(kw))):
            SamplingParams(**kw)
    with pytest.raises(AttributeError):
        TOP_P.seed = 1   # frozen


def test_sampler_rows_move_and_launch_alone(gpu, stream, rng):
    """``start`` = reset + set_params; ``op(row=)`` draws with one row of a larger sampler; ``move`` carries a row's
    parameters, seed, counters and history to another lane: its draws go on as if it had stayed."""
    vocab, prompt = 300, rng.integers(0, 300, 20).astype(np.int32)
    logits = (rng.standard_normal((1, vocab)) * 2).astype(np.float32).astype(BF16)
    buf, state = upload(logits, stream), upload(np.zeros(1, np.int32), stream)

    def draw(s: Sampler, row: int) -> int:
        s.op(buf.ptr, state=state.ptr, m=1, row=row)[1](stream)
        return int(download(state.ptr, (1,), np.int32, stream)[0])
    try:
        with Sampler(gpu, 1, vocab, history=8) as s:
            s.start(0, PENALISED, stream, prompt)
            alone = [draw(s, 0) for _ in range(5)]
        with Sampler(gpu, 3, vocab, history=8) as s:
            s.start(0, TOP_P, stream)
            s.start(2, PENALISED, stream, prompt)
            got = [draw(s, 2), draw(s, 2)]
            s.move(2, 0, stream)
            got += [draw(s, 0) for _ in range(3)]
            step, count = s.counters(stream)
            assert step.tolist() == [5, 0, 2] and count.tolist() == [8 + 5, 0, 8 + 2]
            hist = download(s.history, (3, 8), np.int32, stream)
            assert hist[0, :5].tolist() == got and (hist[0, 5:] == prompt[-3:]).all()   # the ring moved along
            with pytest.raises(HssError, match="row"):
                s.op(buf.ptr, state=state.ptr, m=2, row=2)
            with pytest.raises(TypeError, match="SamplingParams"):
                s.start(1, {"temperature": 1.0}, stream)
        mirror = Mirror(1, 8)
        mirror.params[0].update({k: (np.float32(v) if k != "top_k" else v) for k, v in
                                 PENALISED.kernel_params().items()}, seed=PENALISED.seed)
        mirror.count[0], mirror.history[0] = 8, prompt[-8:]
        want = [mirror.expect(0, logits[0]) for _ in range(5)]
        assert all(g == w.token or near_boundary(w, mirror.params[0]) for g, w in zip(alone, want))
        assert got == alone
    finally:
        buf.close()
        state.close()


# -- Session ------------------------------------------------------------------------------------------------
def test_greedy_sessions_keep_the_argmax_op(model):
    """None and every greedy SamplingParams (whatever its seed, top-k or top-p) decode with model_argmax: no
    sampler, the same tokens and logits bits as before."""
    ids, tokens, logits = prompt_of(30, 3), {}, {}
    for name, sampling in (("none", None), ("default", GREEDY), ("seeded", SamplingParams(top_p=0.5, seed=77))):
        with model.session("hbm", max_tokens=48, graph=True, sampling=sampling) as sess:
            assert sess.sampler is None and sess.sampling.greedy
            sess.prefill(ids)
            tokens[name] = sess.generate(10)
            logits[name] = sess.logits()
            stages = [stage for stage, _ in sess._program[-1][1]]
            assert "argmax" in stages and "sample" not in stages
    assert tokens["none"] == tokens["default"] == tokens["seeded"]
    assert np.array_equal(logits["none"].view(np.uint32), logits["seeded"].view(np.uint32))


@pytest.mark.parametrize("sampling", [TOP_P, PLAIN, PENALISED, GREEDY_PENALISED], ids=["top_p", "plain",
                                                                                      "penalised", "greedy_penalised"])
def test_session_draws_the_reference_tokens_from_its_logits(model, sampling):
    """Each token (the prefill's, then every step's) is the reference's draw from the session's own logits at that
    step, with the prompt's tail and the tokens so far as the penalties' history; the sampler's counters and ring
    say the same."""
    c, prompt, n = model.config, prompt_of(90, 8), 12   # a prompt longer than the history window
    weight = download(model.weights.output, (c.vocab_size, c.dim), BF16, model.ctx.stream)
    with model.session("hbm", max_tokens=128, sampling=sampling) as sess:
        s, cap = sess.stream, sess.sampler.history_cap
        mirror = Mirror(1, cap)
        mirror.params[0].update({k: (np.float32(v) if k != "top_k" else v) for k, v in
                                 sampling.kernel_params().items()}, seed=sampling.seed)
        mirror.count[0], mirror.history[0] = cap, np.asarray(prompt[-cap:], np.int32)
        sess.prefill(prompt)
        h_at = sess.fwd.h + 2 * (len(prompt) - 1) * c.dim
        got = []
        for i in range(n):
            if i:
                sess.step()
                h_at = sess.fwd.h
            lg = sess.logits().astype(BF16)
            h = download(h_at, (c.dim,), BF16, s)
            tok = state_token(sess)
            want = mirror.expect(0, lg, h, weight)
            assert tok == want.token or near_boundary(want, mirror.params[0]), (i, tok, want.token)
            mirror.history[0, (mirror.count[0] - 1) % cap] = tok
            got.append(tok)
        step, count = sess.sampler.counters(s)
        assert step.tolist() == [n] and count.tolist() == [cap + n]
        ring = download(sess.sampler.history, (cap,), np.int32, s)
        assert (ring == mirror.history[0]).all()
        assert sess.sampler.flags(s).tolist() == [0]
    with model.session("hbm", max_tokens=128) as greedy:
        greedy.prefill(prompt)
        assert greedy.generate(n) != got, "sampling changed nothing"


@pytest.mark.parametrize("kv", ["hbm", "swap"])
def test_session_graph_replay_equals_eager(model, kv):
    """The sampler's launch is inside the captured step graph: replays draw the eager steps' tokens (the device step
    counter advances in the graph) and leave the same logits bits; another seed draws other tokens."""
    ids, tokens, logits = prompt_of(30, 3), {}, {}
    for graph, seed in ((False, 11), (True, 11), (True, 12)):
        p = SamplingParams(**{**TOP_P.kernel_params(), "seed": seed})
        with model.session(kv, max_tokens=64, graph=graph, sampling=p, resident=2) as sess:
            sess.prefill(ids)
            tokens[graph, seed] = sess.generate(24, eager_steps=2)
            logits[graph, seed] = sess.logits()
            assert (sess._graphs is not None) == graph
            assert [stage for stage, _ in sess._program[-1][1] if stage == "sample"] == ["sample"]
            assert sess.sampler.counters(sess.stream)[0].tolist() == [24]
    assert tokens[True, 11] == tokens[False, 11] != tokens[True, 12]
    assert np.array_equal(logits[True, 11].view(np.uint32), logits[False, 11].view(np.uint32))


def test_bad_sampling_arguments(model):
    for bad in ({"temperature": 1.0}, 0.8, "greedy"):
        with pytest.raises(TypeError, match="sampling"):
            model.session("hbm", max_tokens=16, sampling=bad)
    with BatchSession(model, max_batch=2, max_tokens=16) as b:
        with pytest.raises(TypeError, match="sampling"):
            b.add([1, 2], sampling={"temperature": 1.0})
        assert b.rows == () and b.sampler is None and b.free_pages == b.pages


# -- BatchSession -----------------------------------------------------------------------------------------
def run_rows(model, schedule, max_tokens: int = 96, **opts) -> tuple[dict, dict]:
    """Run ``schedule`` (as test_model_batch's run_schedule) and step until every row finished. Returns ({name:
    tokens}, {name: the logits that chose each token}; a row's last token's logits are missing when a step
    finished it)."""
    ids, logits = {}, {}
    with BatchSession(model, max_tokens=max_tokens, **opts) as b:
        def step() -> None:
            b.step()
            for name, r in ids.items():
                if r in b.rows:
                    logits[name].append(b.logits(r))
        for action, *args in schedule:
            if action == "add":
                name, prompt, kw = args
                r = ids[name] = b.add(prompt, **kw)
                logits[name] = [b.logits(r)] if r in b.rows else []
            elif action == "step":
                for _ in range(args[0]):
                    if b.rows:
                        step()
            else:
                b.remove(ids[args[0]])
        while b.rows:
            step()
        return {name: b.finished[r].tokens for name, r in ids.items()}, logits


# greedy rows first (steps before any row samples: the argmax step, then built again with the sampler), rows that
# sample in lanes 1..3, a removal that moves the last lane's row into lane 0, a greedy row with penalties
SCHEDULE = [("add", "g1", prompt_of(9, 21), {"max_new": 14}), ("step", 2),
            ("add", "s1", prompt_of(16, 22), {"max_new": 16, "sampling": TOP_P}),
            ("add", "s2", prompt_of(33, 23), {"max_new": 18, "sampling": PENALISED}), ("step", 3),
            ("remove", "g1"), ("step", 2), ("add", "g2", prompt_of(5, 24), {"max_new": 10}),
            ("add", "s3", prompt_of(70, 25), {"max_new": 12, "sampling": GREEDY_PENALISED}), ("step", 1),
            ("add", "s4", prompt_of(12, 26), {"max_new": 20, "sampling": PLAIN})]


def adds(schedule) -> dict:
    return {a[1]: (a[2], a[3]) for a in schedule if a[0] == "add"}


@pytest.mark.parametrize("graph", [False, True])
def test_batch_rows_draw_what_they_draw_alone(model, graph):
    """Every sampling row's tokens equal those of the same prompt and SamplingParams in a batch of its own (lane 0,
    no neighbours) and in a Session; the greedy rows decode what they decode alone greedily, through the sampler's
    temperature-0 rule."""
    tokens, logits = run_rows(model, SCHEDULE, max_batch=5, graph=graph)
    assert len(tokens["g1"]) == 6 and [len(tokens[n]) for n in ("s1", "s2", "g2", "s3", "s4")] == [16, 18, 10, 12, 20]
    for name, (prompt, kw) in adds(SCHEDULE).items():
        if "sampling" not in kw:
            assert_decodes_alone(model, prompt, tokens[name], 96, name)
            continue
        own, own_logits = run_rows(model, [("add", name, prompt, kw)], max_batch=4, graph=graph)
        same_draws(tokens[name], logits[name], own[name], own_logits[name], f"{name} alone")
        with model.session("hbm", max_tokens=96, graph=graph, sampling=kw["sampling"]) as sess:
            sess.prefill(prompt)
            want, want_logits = [], []
            for i in range(len(tokens[name])):
                if i:
                    sess.step()
                want.append(state_token(sess))
                want_logits.append(sess.logits())
        same_draws(tokens[name], logits[name], want, want_logits, f"{name} in a Session")
        if not ON_GPU:
            assert tokens[name] == want


def test_batch_same_request_in_any_lane(model):
    """One request (prompt, SamplingParams) added first, then after two other rows (lane 2), then after a row that
    leaves (it moves to lane 0 mid-decode): the same tokens each time."""
    prompt, kw = prompt_of(20, 31), {"max_new": 15, "sampling": PLAIN}
    runs = [[("add", "x", prompt, kw)],
            [("add", "a", prompt_of(7, 32), {"sampling": TOP_P}), ("add", "b", prompt_of(40, 33), {}),
             ("add", "x", prompt, kw)],
            [("add", "a", prompt_of(7, 32), {"max_new": 4}), ("add", "x", prompt, kw), ("step", 5)]]
    got = [run_rows(model, sched, max_batch=4) for sched in runs]
    for i in (1, 2):
        same_draws(got[i][0]["x"], got[i][1]["x"], got[0][0]["x"], got[0][1]["x"], f"schedule {i}")
    assert len(set(got[0][0]["x"])) > 3   # the draws do differ from step to step


def test_batch_graph_replay_equals_eager(model):
    """The schedule eager and replayed: the same tokens and logits bits after every add and step; the sampler's
    launch is the last op of every step built after the first sampling row, and each batch size is captured again
    with it."""
    eager = run_schedule(model, SCHEDULE, max_batch=5, graph=False)
    replay = run_schedule(model, SCHEDULE, max_batch=5, graph=True)
    assert eager[0] == replay[0] and len(eager[2]) == len(replay[2])
    for a, b in zip(eager[2], replay[2]):
        assert a.keys() == b.keys()
        for name in a:
            assert np.array_equal(a[name].view(np.uint32), b[name].view(np.uint32)), name
    assert replay[3][0] >= 2
    with BatchSession(model, max_batch=4, max_tokens=64, graph=True) as b:
        b.add(prompt_of(8, 41))
        b.step()
        b.step()
        assert b.sampler is None and b._program(1)[-1][0] == "argmax" and b.graph_sizes == (1,)
        b.add(prompt_of(8, 42), sampling=TOP_P)
        assert b.sampler is not None and b.graph_sizes == () and b._program(2)[-1][0] == "sample"
        b.step()
        b.step()
        assert b.graph_sizes == (2,) and b.sampler.counters(b.stream)[0][:2].tolist() == [2, 3]
