"""The device sampler (``ptx/sample.cu`` through :class:`hss.model.sample.Sampler`) against
:mod:`hss.reference.sample`, on the emulator here and on a GPU alike.

A GPU's token may differ from the float64 reference's only where a decision lies within the f32 rounding of a
boundary (docs/design.md §0 "Selections"): the drawn point, the top-p target or the min-p threshold within the
masses' rounding, or a top-k cut between two logits within their rounding. A mass is ``floor(expf(d) 2^40)``
with ``d = (z - M) / T`` in f32: ``z - M`` and ``/ T`` each round by at most 2^-24 relative (|d| 2^-23 together), a
penalised ``z`` carries up to two more roundings (2^-23 |z| + 2^-24 |presence|, scaled by 1 / T in d), and
``expf`` is within 2 ulp (2^-22 relative); the fixed point truncates by at most 1 of 2^40. So each mass is within
``eps = |d| 2^-23 + (2^-23 |z| + 2^-24 |pp|) / T + 2^-22`` relative, plus 1 unit; a cumulative over the kept
tokens and its total within ``max eps`` each, so a normalised boundary within ``2 max eps + 2 n / W``.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from hss import cuda_min as cm
from hss.cuda._context import shared_optin
from hss.decls import model as km
from hss.decls import sample as ks
from hss.errors import HssError
from hss.model.sample import Sampler
from hss.reference import model as ref_model
from hss.reference import sample as ref

from helpers import BF16, Recording, download, poisoned, upload

SEEDS = st.integers(0, 2**32 - 1)


def randn(rng: np.random.Generator, shape: tuple[int, ...], std: float) -> np.ndarray:
    """N(0, std^2) bf16 data with no zeros."""
    x = (rng.standard_normal(shape) * std).astype(np.float32).astype(BF16)
    x[x == 0] = BF16(std)
    return x


class Mirror:
    """The host's copy of a sampler's per-row parameters, seeds, counters and history rings."""

    def __init__(self, rows: int, cap: int) -> None:
        self.params = [{"temperature": 0.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "repetition_penalty": 1.0,
                        "presence_penalty": 0.0, "seed": 0} for _ in range(rows)]
        self.step, self.count = [0] * rows, [0] * rows
        self.history = np.zeros((rows, cap), np.int32)
        self.cap = cap

    def set(self, sampler: Sampler, stream, row: int, **kw) -> None:
        sampler.set_params(row, stream, **kw)
        self.params[row].update({k: (np.float32(v) if k != "top_k" else v) for k, v in kw.items()})

    def reset(self, sampler: Sampler, stream, row: int, seed: int, prompt=()) -> None:
        sampler.reset(row, seed, stream, prompt)
        tail = np.asarray(prompt, np.int32)[-self.cap:] if self.cap else np.zeros(0, np.int32)
        self.params[row]["seed"] = seed
        self.step[row], self.count[row] = 0, tail.size
        self.history[row, : tail.size] = tail

    def expect(self, row: int, logits: np.ndarray, h=None, weight=None) -> ref.RowDraw:
        """The reference's draw of ``row`` now, and the counters and ring advanced as the kernel does."""
        out = ref.sample_row(logits, self.params[row], self.history[row], self.count[row], self.step[row], h, weight)
        if self.cap:
            self.history[row, self.count[row] % self.cap] = out.token
        self.step[row] += 1
        self.count[row] += 1
        return out


def launch(sampler: Sampler, stream, logits: np.ndarray, h=None, weight=None, advance=-1,
           state_init=None) -> np.ndarray:
    """One sampler launch over ``logits [m, vocab]``; the token words start poisoned. Returns the state words."""
    m = logits.shape[0]
    bufs = [upload(logits, stream)]
    extra = {}
    if h is not None:
        bufs += [upload(h, stream), upload(weight, stream)]
        extra = {"h": bufs[1].ptr, "weight": bufs[2].ptr, "dim": h.shape[1]}
    words = km.STATE_WORDS * m if advance >= 0 else m   # model state: word w of row r at w m + r
    state = poisoned(4 * words, stream)
    if state_init is not None:
        cm.copy_h_to_d_async(state, state_init, state_init.nbytes, stream)
    _, run = sampler.op(bufs[0].ptr, state=state.ptr, m=m, state_stride=m, advance=advance, stream=stream, **extra)
    run(stream)
    got = download(state.ptr, (words,), np.int32, stream)
    for b in (*bufs, state):
        b.close()
    return got


def mass_eps(z: np.ndarray, top: float, temp: float, pp: float) -> float:
    """The largest relative rounding of one f32 mass (the module docstring's eps), over finite ``z``."""
    z = z[np.isfinite(z)]
    d = np.abs((z - top) / temp)
    return float(np.max(d * 2.0**-23 + (2.0**-23 * np.abs(z) + 2.0**-24 * abs(pp)) / temp + 2.0**-22))


def near_boundary(out: ref.RowDraw, params: dict) -> bool:
    """Whether an f32 rounding may move one of the reference's decisions (the module docstring's bound)."""
    if out.greedy or not out.cum.size:
        return False
    temp, pp = float(params["temperature"]), float(params["presence_penalty"])
    zs = out.cand_z
    top = float(zs.max())
    eps = mass_eps(zs, top, temp, pp)
    w = float(out.cum[-1])
    tol = 2 * eps + 2 * (out.cum.size + 1) / w
    if np.min(np.abs(out.cum.astype(np.float64) - out.target)) <= tol * w:
        return True
    if out.top_p_target and np.min(np.abs(out.cand_cum.astype(np.float64) - out.top_p_target)) <= \
            tol * max(out.top_p_target, 1):
        return True
    if np.min(np.abs(out.cand_e - float(params["min_p"]))) <= eps + 2.0**-40:
        return True
    k = out.cand_cum.size   # a top-k cut between two logits within their rounding
    if k < zs.size:
        gap = abs(zs[k - 1] - zs[k])
        if gap <= 2.0**-22 * (abs(zs[k - 1]) + abs(pp)):
            return True
    return False


def test_philox_known_answers():
    """Philox4x32-10's published known-answer vectors (Random123)."""
    assert ref.philox4x32((0, 0, 0, 0), (0, 0)) == (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)
    assert ref.philox4x32((2**32 - 1,) * 4, (2**32 - 1,) * 2) == (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)
    assert ref.philox4x32((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0)) == \
        (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)


PARAMS = st.fixed_dictionaries({
    "temperature": st.sampled_from([0.0, 0.3, 0.7, 1.0, 1.6]),
    "top_k": st.sampled_from([0, 0, 1, 5, 40, 1024]),
    "top_p": st.sampled_from([1.0, 0.95, 0.5, 0.1]),
    "min_p": st.sampled_from([0.0, 0.0, 0.05, 0.3]),
    "repetition_penalty": st.sampled_from([1.0, 1.0, 1.3, 0.8]),
    "presence_penalty": st.sampled_from([0.0, 0.0, 0.5, -0.25]),
})


@given(m=st.integers(1, 4), vocab=st.sampled_from([7, 64, 1000, 1025, 3000]), cap=st.sampled_from([0, 5, 32]),
       rows=st.lists(PARAMS, min_size=4, max_size=4), steps=st.integers(1, 3), std=st.sampled_from([1.0, 3.0]),
       stage=st.booleans(), seed=SEEDS)
def test_kernel_matches_reference(gpu, stream, m, vocab, cap, rows, steps, std, stage, seed):
    """Tokens, counters, the history ring and flags after several launches, rows with their own parameters, the
    keys staged in shared memory or read from the logits at every pass."""
    rng = np.random.default_rng(seed)
    with Sampler(gpu, 4, vocab, history=cap, stage=stage) as s:
        mirror = Mirror(4, cap)
        for r in range(4):
            mirror.reset(s, stream, r, int(rng.integers(0, 2**64, dtype=np.uint64)),
                         rng.integers(0, vocab, int(rng.integers(0, 40))).astype(np.int32))
            mirror.set(s, stream, r, **rows[r])
        for _ in range(steps):
            logits = randn(rng, (m, vocab), std)
            got = launch(s, stream, logits)
            for r in range(m):
                out = mirror.expect(r, logits[r])
                assert got[r] == out.token or near_boundary(out, mirror.params[r]), (r, got[r], out.token)
                if cap:   # the ring holds the kernel's token
                    mirror.history[r, (mirror.count[r] - 1) % cap] = got[r]
        step, count = s.counters(stream)
        assert step[:m].tolist() == mirror.step[:m] and count[:m].tolist() == mirror.count[:m]
        assert step[m:].tolist() == [0] * (4 - m)   # rows past m untouched
        if cap:
            hist = download(s.history, (4, cap), np.int32, stream)
            for r in range(m):   # the ring's written entries (the rest was never initialised)
                n = min(mirror.count[r], cap)
                assert (hist[r, :n] == mirror.history[r, :n]).all()
        assert (s.flags(stream) == 0).all()


def ties_logits(rng, m, vocab, dim, kind):
    h = randn(rng, (m, dim), 1.0)
    weight = randn(rng, (vocab, dim), 0.3)
    logits = (h.astype(np.float64) @ weight.astype(np.float64).T).astype(np.float32).astype(BF16)
    if kind == "ties":   # exact bf16 ties of the maximum: recomputed in f32
        for r in range(m):
            logits[r, rng.integers(0, vocab, int(rng.integers(2, 60)))] = logits[r].max()
    if kind == "many":   # more near ties than the cap: the first maximum
        logits[:] = BF16(1.0)
    return h, weight, logits


@given(m=st.integers(1, 3), vocab=st.sampled_from([100, 2048, 5003]), dim=st.sampled_from([8, 40]),
       kind=st.sampled_from(["plain", "ties", "many"]), stage=st.booleans(), seed=SEEDS)
def test_temperature_zero_is_model_argmax(gpu, stream, m, vocab, dim, kind, stage, seed):
    """Greedy rows take model_argmax's token (run on the same logits, h and LM head), bit for bit, and advance
    the model state the same way (staged keys or not)."""
    rng = np.random.default_rng(seed)
    h, weight, logits = ties_logits(rng, m, vocab, dim, kind)
    init = np.concatenate([np.full(m, -5), rng.integers(0, 100, m), np.zeros(2 * m)]).astype(np.int32)
    init[2 * m:3 * m] = init[m:2 * m] + 1
    with Sampler(gpu, m, vocab, history=8, stage=stage) as s:
        for r in range(m):
            s.reset(r, int(rng.integers(2**63)), stream)
        got = launch(s, stream, logits, h, weight, advance=1, state_init=init)
    bufs = [upload(a, stream) for a in (logits, h, weight, init)]
    gpu.launch(gpu.kernel(km.MODULE, "model_argmax"), km.argmax_geometry(m).grid, km.argmax_geometry(m).block, 0,
               stream, km.MODEL_ARGMAX.pack(logits=bufs[0].ptr, h=bufs[1].ptr, weight=bufs[2].ptr, vocab=vocab,
                                            dim=dim, state=bufs[3].ptr, advance=1, m=m, state_stride=m, rows=0))
    want = download(bufs[3].ptr, (km.STATE_WORDS * m,), np.int32, stream)
    for b in bufs:
        b.close()
    assert got.tolist() == want.tolist()


def test_top_k_one_is_the_first_maximum(gpu, stream, rng):
    vocab = 500
    logits = randn(rng, (2, vocab), 1.0)
    logits[1, [7, 300]] = BF16(float(logits[1].max()) + 1)   # a tie: the lower id
    with Sampler(gpu, 2, vocab) as s:
        for r in range(2):
            s.reset(r, int(rng.integers(2**32)), stream)
            s.set_params(r, stream, temperature=1.5, top_k=1)
        got = [launch(s, stream, logits)[:2].tolist() for _ in range(5)]
    assert got == [[ref_model.argmax(logits[0]), 7]] * 5


CHI2_1E4 = {1: 15.14, 2: 18.42, 3: 21.11, 4: 23.51, 5: 25.74, 6: 27.86, 7: 29.88}   # 1 - 1e-4 quantiles


def test_distribution_over_many_steps(gpu, stream, rng):
    """Counts of 4000 draws (8 rows x 500 replays of one op) against the reference probabilities: a chi-square
    statistic under its 1e-4 quantile, with top-k and top-p cutting tokens that must never appear; the same counts
    against a mutated distribution (one kept token's mass moved to another) fail."""
    vocab, rows, steps = 12, 8, 500
    logits = np.tile(randn(rng, (1, vocab), 1.0), (rows, 1))
    with Sampler(gpu, rows, vocab) as s:
        for r in range(rows):
            s.reset(r, 1000 + r, stream)
            s.set_params(r, stream, temperature=1.0, top_k=8, top_p=0.9)
        buf, state = upload(logits, stream), poisoned(4 * rows, stream)
        _, run = s.op(buf.ptr, state=state.ptr, m=rows)
        counts = np.zeros(vocab, np.int64)
        for _ in range(steps):
            run(stream)
            counts += np.bincount(download(state.ptr, (rows,), np.int32, stream), minlength=vocab)
        buf.close()
        state.close()
    params = {"temperature": 1.0, "top_k": 8, "top_p": np.float32(0.9), "min_p": 0.0, "repetition_penalty": 1.0,
              "presence_penalty": 0.0, "seed": 0}
    out = ref.sample_row(logits[0], params, np.zeros(0, np.int32), 0, 0)
    prob = np.zeros(vocab)
    prob[out.order] = np.diff(np.concatenate([[0], out.cum])) / out.cum[-1]
    assert counts[prob == 0].sum() == 0
    n = rows * steps

    def chi2(p):
        keep = p > 0
        return float((((counts[keep] - n * p[keep]) ** 2) / (n * p[keep])).sum()), int(keep.sum()) - 1
    stat, dof = chi2(prob)
    assert 1 <= dof <= 7
    assert stat < CHI2_1E4[dof], (stat, dof)
    a, b = out.order[0], out.order[-1]   # the mutation: half the top token's mass moved to the last kept one
    moved = prob.copy()
    moved[a], moved[b] = prob[a] / 2, prob[b] + prob[a] / 2
    assert chi2(moved)[0] > CHI2_1E4[dof]


def test_penalties_move_the_greedy_token(gpu, stream, rng):
    vocab = 64
    logits = randn(rng, (1, vocab), 1.0)
    best = int(np.argmax(logits[0].astype(np.float32)))
    logits[0, best] = BF16(4.0)
    second = int(np.argsort(-logits[0].astype(np.float64), kind="stable")[1])
    assert float(logits[0, second]) > 0.04   # 4 / 100 falls below it
    with Sampler(gpu, 1, vocab, history=4) as s:
        s.reset(0, 1, stream, prompt=[best])
        assert launch(s, stream, logits)[0] == best   # penalties off: the history does nothing
        s.reset(0, 1, stream, prompt=[best])
        s.set_params(0, stream, repetition_penalty=100.0)
        assert launch(s, stream, logits)[0] == second
        s.reset(0, 1, stream, prompt=[best])
        s.set_params(0, stream, presence_penalty=4.0 - float(logits[0, second]) + 0.5)
        assert launch(s, stream, logits)[0] == second
    z = ref.penalize(np.array([2.0, -2.0, 2.0]), np.array([True, True, False]), 2.0, 0.5)
    assert z.tolist() == [0.5, -4.5, 2.0]


def test_top_p_and_min_p_boundaries(gpu, stream):
    """bf16 logits ln 4, ln 2, 0, 0: e = 1, 0.5008, 0.2509, 0.2509 (probabilities 0.4993, 0.2501, 0.1253, 0.1253).
    top-p keeps the shortest prefix reaching top_p (0.8 splits the tie at 0: token 2 stays, token 3, the higher
    id, goes); min-p keeps e >= min_p."""
    x = np.array([[np.log(4), np.log(2), 0.0, 0.0]], np.float32).astype(BF16)
    cases = [({"top_p": 0.45}, {0}), ({"top_p": 0.7}, {0, 1}), ({"top_p": 0.8}, {0, 1, 2}),
             ({"top_p": 0.9}, {0, 1, 2, 3}), ({"min_p": 0.6}, {0}), ({"min_p": 0.5}, {0, 1}),
             ({"min_p": 0.26}, {0, 1}), ({"min_p": 0.25}, {0, 1, 2, 3})]
    for kw, allowed in cases:
        with Sampler(gpu, 1, 4) as s:
            s.reset(0, 99, stream)
            s.set_params(0, stream, temperature=1.0, **kw)
            seen = {int(launch(s, stream, x)[0]) for _ in range(100)}
        assert seen == allowed, (kw, seen)


@pytest.mark.parametrize("stage", [False, True])
def test_nan_and_inf_rules(gpu, stream, rng, stage):
    vocab = 300
    logits = randn(rng, (3, vocab), 1.0)
    nan_at = rng.integers(0, vocab, 40)
    logits[0, nan_at] = np.nan
    logits[0, nan_at[0]] = np.nan
    logits[1, [5, 200]] = np.inf   # +inf: greedy, the first of them
    logits[2] = np.nan             # nothing above -inf: token 0
    with Sampler(gpu, 3, vocab, stage=stage) as s:
        for r in range(3):
            s.reset(r, r + 5, stream)
            s.set_params(r, stream, temperature=1.0)
        toks = [launch(s, stream, logits)[:3] for _ in range(20)]
        flags = s.flags(stream)
    assert all(t[0] not in set(nan_at.tolist()) for t in toks)
    assert all(t[1] == 5 and t[2] == 0 for t in toks)
    assert flags.tolist() == [ks.FLAG_NAN, ks.FLAG_INF, ks.FLAG_NAN | ks.FLAG_EMPTY]


@pytest.mark.parametrize("vocab", [49152, 151936])
def test_model_sized_vocabularies(gpu, stream, rng, vocab):
    """SmolLM2's vocabulary (the keys staged where they fit) and Qwen's (read from the logits at every pass), rows
    with llama.cpp's defaults and a long history, against the reference."""
    m, cap = 3, 64
    with Sampler(gpu, m, vocab, history=cap, stage=None) as s:
        assert s.stage == ks.stage_fits(vocab, shared_optin())
        mirror = Mirror(m, cap)
        for r in range(m):
            mirror.reset(s, stream, r, 77 + r, rng.integers(0, vocab, 200).astype(np.int32))
            mirror.set(s, stream, r, temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, repetition_penalty=1.1)
        for _ in range(3):
            logits = randn(rng, (m, vocab), 2.0)
            got = launch(s, stream, logits)
            for r in range(m):
                out = mirror.expect(r, logits[r])
                assert got[r] == out.token or near_boundary(out, mirror.params[r]), (r, got[r], out.token)
                mirror.history[r, (mirror.count[r] - 1) % cap] = got[r]


def test_staged_samplers_of_two_sizes(gpu, stream, rng):
    """A staged sampler made after a larger one leaves the larger one's launch room (one limit for the kernel)."""
    with Sampler(gpu, 1, 40000, stage=True) as big, Sampler(gpu, 1, 100, stage=True) as small:
        for s, vocab in ((big, 40000), (small, 100), (big, 40000)):
            s.set_params(0, stream, temperature=1.0, top_k=5)
            assert 0 <= launch(s, stream, randn(rng, (1, vocab), 1.0))[0] < vocab


def test_bad_arguments_raise_before_device_work(gpu, stream):
    rec = Recording(gpu)
    with pytest.raises(HssError, match="rows"):
        Sampler(rec, 0, 100)
    with pytest.raises(HssError, match="vocab"):
        Sampler(rec, 1, ks.MAX_VOCAB + 1)
    with pytest.raises(HssError, match="stage=True"):   # the keys of 151,936 tokens fit no device's shared memory
        Sampler(rec, 1, 151936, stage=True)
    with pytest.raises(TypeError, match="stage"):
        Sampler(rec, 1, 100, stage=1)
    assert rec.calls == []
    with Sampler(gpu, 2, 100) as s:
        s.reset(0, 3, stream)
        before = download(s.params, (2, ks.PARAM_WORDS), np.uint32, stream)
        bad = [({"temperature": -1.0}, HssError, "temperature"), ({"top_k": 1025}, HssError, "top_k"),
               ({"top_k": 2.0}, TypeError, "top_k"), ({"top_p": 0.0}, HssError, "top_p"),
               ({"min_p": 1.5}, HssError, "min_p"), ({"repetition_penalty": 0.0}, HssError, "repetition_penalty"),
               ({"presence_penalty": float("nan")}, HssError, "presence_penalty"),
               ({"temperature": True}, TypeError, "temperature"), ({"temperature": 1e-50}, HssError, "temperature")]
        for kw, err, name in bad:
            with pytest.raises(err, match=name):
                s.set_params(1, stream, **kw)
        with pytest.raises(HssError, match="row"):
            s.set_params(2, stream)
        with pytest.raises(HssError, match="seed"):
            s.reset(0, -1, stream)
        with pytest.raises(HssError, match="prompt"):
            s.reset(0, 1, stream, prompt=[100])
        with pytest.raises(HssError, match="state_stride"):
            s.op(0, state=0, m=2, state_stride=1, advance=1)
        assert (download(s.params, (2, ks.PARAM_WORDS), np.uint32, stream) == before).all()


@given(seed=SEEDS, where=st.integers(0, 4))
def test_same_seed_and_step_in_any_row(gpu, stream, seed, where):
    """A request's token depends on its seed, step and logits, not on its batch row or its neighbours."""
    rng = np.random.default_rng(seed)
    vocab = 2000
    mine = randn(rng, (1, vocab), 2.0)
    req_seed = int(rng.integers(0, 2**64, dtype=np.uint64))
    alone = []
    with Sampler(gpu, 1, vocab) as s:
        s.reset(0, req_seed, stream)
        s.set_params(0, stream, temperature=1.2, top_p=0.95)
        alone = [int(launch(s, stream, mine)[0]) for _ in range(3)]
    with Sampler(gpu, 5, vocab) as s:
        for r in range(5):
            s.reset(r, req_seed if r == where else int(rng.integers(2**32)), stream)
            s.set_params(r, stream, temperature=1.2 if r == where else 0.5, top_p=0.95)
        batch = []
        for _ in range(3):
            logits = randn(rng, (5, vocab), 2.0)
            logits[where] = mine[0]
            batch.append(int(launch(s, stream, logits)[where]))
    assert batch == alone


def test_graph_replay_draws_anew_each_step(gpu, stream, rng):
    """A captured launch replays with the device step counter: step i's token is the reference's at step i."""
    vocab, replays = 256, 12
    logits = randn(rng, (1, vocab), 0.5)   # a flat distribution: draws differ
    with Sampler(gpu, 1, vocab) as s:
        s.reset(0, 424242, stream)
        s.set_params(0, stream, temperature=1.0)
        buf, state = upload(logits, stream), poisoned(4, stream)
        _, run = s.op(buf.ptr, state=state.ptr, m=1)
        cm.stream_sync(stream)
        cm.begin_capture(stream)
        run(stream)
        graph = cm.end_capture(stream)
        got = []
        for _ in range(replays):
            graph.launch(stream)
            got.append(int(download(state.ptr, (1,), np.int32, stream)[0]))
        graph.close()
        buf.close()
        state.close()
        assert s.counters(stream)[0][0] == replays
    mirror = Mirror(1, 0)
    mirror.params[0].update(seed=424242, temperature=np.float32(1.0))
    want = [mirror.expect(0, logits[0]) for _ in range(replays)]
    assert all(g == w.token or near_boundary(w, mirror.params[0]) for g, w in zip(got, want))
    assert len(set(got)) > 3
