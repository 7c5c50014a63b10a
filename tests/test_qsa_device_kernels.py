"""The device decode-step kernels of ``ptx/qsa_device.cu`` (docs/design.md §17.1-§17.4), launched directly through
:mod:`hss.cuda_min` with declaration packs, against their references (docs/design.md §0).

* ``qsa_dev_topk``: the token list equals the host ``select_tokens`` (docs/design.md §17.1, NaN lowest) and the float64
  reference exactly (sets, order, expansion, tail, counts); nothing past counts is written; pos advances by 1.
* ``qsa_dev_qk``: the projection within the bf16 bound of the float64 reference (f32 accumulation of k products: far
  inside it, as cuBLAS's); a row's bits do not depend on R, the act alignment or the grid; rows past R untouched.
* ``qsa_dev_prep``: q_post within the f32 bound of qsa_qprep's reference (rsqrtf: 2 ulp, far inside 1e-4 max|ref|,
  see test_qsa_kernels), the raw key stored bit for bit, the block completed by this token within the bf16 bound of
  qsa_block_pool's reference; and bit for bit what the host path's qsa_qprep / qsa_block_pool compute.
* ``qsa_dev_score``: qsa_score's reference under the f32 bound, and qsa_score's bits.
* ``qsa_sparse_attn`` + ``qsa_sparse_merge``: a float64 reference over the same token set under the bf16 rule
  (|err| <= 2^-7 |ref| + 1e-5 max|ref| per (row, head)); dropping the heaviest token breaks it; the bits of a request
  do not depend on R.
Every bound is shown to bite. Outputs are poisoned (0xFF) before each launch.
"""
from __future__ import annotations

import contextlib
import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from hss import cuda_min as cm
from hss.cuda import ptx
from hss.decls import qsa as kq
from hss.decls import qsa_device as kd
from hss.qsa.select import select_tokens
from hss.reference import qsa as ref
from hss.reference import qsa_device as dref

from conftest import ON_GPU
from helpers import BF16, assert_bites, assert_close, download, poisoned, upload

THETA, EPS = 1e7, 1e-6
POISON = -1   # 0xFFFFFFFF as i32
NAMES = ("qsa_dev_qk", "qsa_dev_prep", "qsa_dev_score", "qsa_dev_topk", "qsa_sparse_attn", "qsa_sparse_merge")


@pytest.fixture(scope="module")
def fns(ctx):
    """The five kernels (one handle each, so a raised shared-memory limit sticks) and the host path's kernels."""
    dev = ptx.load_module(kd.MODULE, ctx)
    host = ptx.load_module(kq.MODULE, ctx)
    funcs = {n: dev.function(n) for n in NAMES}
    funcs.update({n: host.function(n) for n in ("qsa_qprep", "qsa_block_pool", "qsa_score")})
    yield funcs
    dev.close()
    host.close()


def launch(fns, decl, geom, stream, **args) -> None:
    func = fns[decl.name]
    if geom.shared > 48 * 1024:
        func.set_max_dynamic_shared(geom.shared)
    cm.launch_kernel(func, geom.grid, geom.block, geom.shared, stream, decl.pack(**args))


def f32(x: float) -> float:
    return float(np.float32(x))


def normal(rng, shape, std=1.0, dtype=BF16) -> np.ndarray:
    x = rng.standard_normal(shape) * std
    x[np.abs(x) < 1e-3 * std] = std   # never zeros
    return x.astype(dtype)


def nan_bf16(shape) -> np.ndarray:
    return np.full(shape, 0xFFFF, np.uint16).view(BF16)


# ---------------------------------------------------------------------------------------------
# qsa_dev_topk
# ---------------------------------------------------------------------------------------------
SPECIALS = np.concatenate([np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-45, -1e-45, 1e-40, -3e-39, 1.0, -1.0,
                                     3.4e38, -3.4e38], np.float32),
                           np.array([0xFFC00001, 0x7F800001], np.uint32).view(np.float32)])   # -NaN, signalling NaN
KINDS = ("normal", "relu", "ties", "equal", "special", "mixed")


def make_scores(rng, kind: str, n: int) -> np.ndarray:
    if kind == "normal":
        return rng.standard_normal(n).astype(np.float32)
    if kind == "relu":   # what qsa_score produces: non-negative, a few binades
        return (np.abs(rng.standard_normal(n)) * 3).astype(np.float32)
    if kind == "ties":
        return rng.integers(0, 4, n).astype(np.float32)
    if kind == "equal":
        return np.full(n, 0.75, np.float32)
    if kind == "special":
        return rng.choice(SPECIALS, n)
    x = rng.standard_normal(n).astype(np.float32)
    m = rng.random(n) < 0.1
    x[m] = rng.choice(SPECIALS, int(m.sum()))
    return x


class TopkCase:
    """Device buffers of one batch: scores [R, stride], pos [max_seqs], slots [R], tokens/counts (poisoned)."""

    def __init__(self, stream, scores: np.ndarray, pos: np.ndarray, slots: np.ndarray, k_blocks: int, ratio: int,
                 max_tokens: int, sel_cap: int | None = None) -> None:
        self.stream, self.k, self.ratio, self.max_tokens = stream, k_blocks, ratio, max_tokens
        self.scores = np.ascontiguousarray(scores, np.float32)
        self.rows, self.stride = self.scores.shape
        self.sel_cap = sel_cap if sel_cap is not None else (k_blocks + 1) * ratio
        self.es = contextlib.ExitStack()
        self.d_scores = self.es.enter_context(upload(self.scores, stream))
        self.d_pos = self.es.enter_context(upload(np.asarray(pos, np.int32), stream))
        self.d_slots = self.es.enter_context(upload(np.asarray(slots, np.int32), stream))
        self.slots = np.asarray(slots, np.int64)
        self.n_slots = len(pos)
        self.tokens = self.es.enter_context(poisoned(4 * self.rows * self.sel_cap, stream))
        self.counts = self.es.enter_context(poisoned(4 * self.rows, stream))

    def launch(self, fns, shared: int | None = None) -> None:
        g = kd.topk_geometry(self.rows, self.stride)
        if shared is not None:
            g = kd.Geometry(g.grid, g.block, shared)
        launch(fns, kd.QSA_DEV_TOPK, g, self.stream, scores=self.d_scores, pos=self.d_pos, slots=self.d_slots,
               tokens=self.tokens, counts=self.counts, score_stride=self.stride, k_blocks=self.k, ratio=self.ratio,
               sel_cap=self.sel_cap, max_tokens=self.max_tokens)

    def poison(self) -> None:
        cm.memset_d8_async(self.tokens, 0xFF, self.tokens.bytes, self.stream)
        cm.memset_d8_async(self.counts, 0xFF, self.counts.bytes, self.stream)

    def read(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return (download(self.tokens, (self.rows, self.sel_cap), np.int32, self.stream),
                download(self.counts, (self.rows,), np.int32, self.stream),
                download(self.d_pos, (self.n_slots,), np.int32, self.stream))

    def check_row(self, r: int, p: int, tokens: np.ndarray, counts: np.ndarray) -> None:
        """Row r after the step at position p: the host select_tokens list (docs/design.md §17.1), exactly, nothing past
        it."""
        visible = p + 1
        want = select_tokens(self.scores[r], self.k, self.ratio, visible)
        assert np.array_equal(want, dref.step_tokens(self.scores[r], p, self.ratio, self.k))
        n = int(counts[r])
        assert n == want.size, f"row {r}: count {n}, want {want.size}"
        got = tokens[r, :n]
        assert np.array_equal(got, want), f"row {r} (p = {p}): {np.flatnonzero(got != want)[:8]} differ"
        assert (np.diff(got) > 0).all()
        tail = visible % self.ratio
        assert got[n - tail:].tolist() == list(range(visible - tail, visible))
        assert (tokens[r, n:] == POISON).all(), f"row {r}: wrote past its count"

    def close(self) -> None:
        self.es.close()


def run_one(fns, stream, scores: np.ndarray, k: int, ratio: int, visible: int, extra_tokens: int = 0) -> None:
    """One row at position visible - 1 (its slot 1 of 2); entries past `complete` are +inf (never read)."""
    complete = visible // ratio
    max_tokens = visible + extra_tokens
    stride = max_tokens // ratio
    row = np.full(stride, np.inf, np.float32)
    row[:complete] = scores[:complete]
    case = TopkCase(stream, row[None], np.array([77, visible - 1], np.int32), np.array([1]), k, ratio, max_tokens)
    try:
        case.launch(fns)
        tokens, counts, pos = case.read()
        case.check_row(0, visible - 1, tokens, counts)
        assert pos.tolist() == [77, visible], "pos must advance by exactly 1 (other slots untouched)"
    finally:
        case.close()


SIZES = st.one_of(st.integers(1, 3000), st.sampled_from([8191, 8192, 8193, 16385, 40000, 49153]),
                  st.integers(1, 262_144))


@given(n=SIZES, kind=st.sampled_from(KINDS), ratio=st.sampled_from([1, 2, 4]), data=st.data())
def test_topk_equals_select_tokens(fns, stream, n, kind, ratio, data):
    k = data.draw(st.one_of(st.integers(1, n), st.sampled_from(sorted({1, min(512, n), max(1, n - 1), n}))))
    tail = data.draw(st.integers(0, ratio - 1))
    seed = data.draw(st.integers(0, 2**32 - 1))
    run_one(fns, stream, make_scores(np.random.default_rng(seed), kind, n), k, ratio, n * ratio + tail,
            extra_tokens=data.draw(st.integers(0, 9)))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n, k", [(8192, 512), (513, 512), (8193, 8192), (20000, 512), (100, 37)])
def test_topk_production_shapes(fns, stream, rng, kind, n, k):
    run_one(fns, stream, make_scores(rng, kind, n), k, 4, n * 4 + 3)


@pytest.mark.parametrize("n, k", [(262_144, 512), (262_144, 262_143), (262_144, 131_072)])
def test_topk_largest_rows(fns, stream, rng, n, k):
    """N = 262,144 blocks (1M tokens): past the shared-memory key cache, so every pass re-reads the scores."""
    run_one(fns, stream, make_scores(rng, "mixed", n), k, 4, n * 4 + 1)


def test_topk_cache_and_global_paths_agree(fns, stream, rng):
    """A multi-tile row with the key cache (topk_smem_bytes) and without it (no dynamic smem): the same list."""
    n, k, ratio = 30_000, 700, 4
    visible = n * ratio + 2
    scores = make_scores(rng, "ties", n)[None]
    results = []
    for shared in (None, 0):
        case = TopkCase(stream, scores, np.array([visible - 1]), np.array([0]), k, ratio, visible)
        try:
            assert kd.topk_geometry(1, case.stride).shared == 4 * case.stride   # the cache fits
            case.launch(fns, shared)
            tokens, counts, _ = case.read()
            case.check_row(0, visible - 1, tokens, counts)
            results.append(tokens.copy())
        finally:
            case.close()
    assert np.array_equal(results[0], results[1])


def test_topk_batch_ragged_rows(fns, stream, rng):
    """Rows of a batch on permuted slots: selective, inert, a full-size tie row, a position at max_tokens (count 0,
    no advance), a negative slot (count 0); pos of slots outside the batch untouched."""
    k, ratio, max_tokens = 64, 4, 4 * 300
    stride = max_tokens // ratio
    kinds = ("relu", "ties", "normal", "special", "relu", "mixed", "equal")
    scores = np.stack([make_scores(rng, kind, stride) for kind in kinds])
    pos = np.array([1000, 40, max_tokens, 259, 4 * 65 - 1, 4 * 65 - 2, 5, 1199], np.int32)  # by slot
    slots = np.array([4, 0, 2, -1, 5, 7, 1])
    case = TopkCase(stream, scores, pos, slots, k, ratio, max_tokens)
    try:
        case.launch(fns)
        tokens, counts, after = case.read()
        for r, s in enumerate(slots):
            if s < 0 or pos[s] >= max_tokens:
                assert counts[r] == 0 and (tokens[r] == POISON).all()
            else:
                case.check_row(r, int(pos[s]), tokens, counts)
        moved = pos.copy()
        moved[[4, 0, 5, 7, 1]] += 1
        assert after.tolist() == moved.tolist()
        assert counts[4] == 4 * 65 - 1 and counts[6] == 41   # inert rows: every visible token
        assert counts[0] == 4 * 64 and counts[1] == 4 * 64 + 1   # the first selective position, then a tail of 1
    finally:
        case.close()


def test_topk_repeated_steps_cross_the_inert_bound(fns, stream, rng):
    """Launched again and again on the same buffers, the step follows the device position: p, p + 1, ... (across
    the inert bound and across block boundaries), re-poisoned each time."""
    k, ratio, max_tokens = 8, 4, 80
    scores = make_scores(rng, "ties", max_tokens // ratio)[None]
    p0 = (k + 1) * ratio - 3
    case = TopkCase(stream, scores, np.array([p0]), np.array([0]), k, ratio, max_tokens)
    try:
        for i in range(7):
            case.poison()
            case.launch(fns)
            tokens, counts, pos = case.read()
            case.check_row(0, p0 + i, tokens, counts)
            assert pos[0] == p0 + i + 1
        # at max_tokens: count 0, no advance
        cm.memset_d32_async(case.d_pos, max_tokens, 1, stream)
        case.launch(fns)
        tokens, counts, pos = case.read()
        assert counts[0] == 0 and pos[0] == max_tokens
    finally:
        case.close()


def test_topk_replayed_from_a_graph_follows_the_device_position(fns, stream, rng):
    """A captured (poison + top-k) step, replayed: each replay reads the position the previous one left, across the
    inert bound (the selection is read on the host only between replays)."""
    k, ratio, max_tokens = 8, 4, 80
    p0 = (k + 1) * ratio - 3
    case = TopkCase(stream, make_scores(rng, "relu", max_tokens // ratio)[None], np.array([p0]), np.array([0]), k,
                    ratio, max_tokens)
    try:
        cm.stream_sync(stream)
        cm.begin_capture(stream)
        case.poison()
        case.launch(fns)
        graph = cm.end_capture(stream)
        with graph:
            for i in range(6):
                graph.launch(stream)
                tokens, counts, pos = case.read()
                case.check_row(0, p0 + i, tokens, counts)
                assert pos[0] == p0 + i + 1
    finally:
        case.close()


def test_topk_k_zero_selects_the_tail_only(fns, stream, rng):
    case = TopkCase(stream, make_scores(rng, "relu", 10)[None], np.array([41]), np.array([0]), 0, 4, 42, sel_cap=3)
    try:
        case.launch(fns)
        tokens, counts, pos = case.read()
        assert counts[0] == 2 and tokens[0, :2].tolist() == [40, 41] and tokens[0, 2] == POISON and pos[0] == 42
    finally:
        case.close()


def test_order_keys_reference():
    s = np.array([np.nan, -np.inf, -1.0, -1e-45, -0.0, 0.0, 1e-45, 1.0, np.inf], np.float32)
    key = dref.order_keys(s)
    assert key[0] == 0 and (np.diff(key[1:].astype(np.int64)) >= 0).all() and key[4] == key[5]
    assert dref.select_blocks_nan_low(s, 3).tolist() == [6, 7, 8]
    assert dref.select_blocks_nan_low(np.array([np.nan, -np.inf]), 1).tolist() == [1]


# ---------------------------------------------------------------------------------------------
# qsa_dev_prep
# ---------------------------------------------------------------------------------------------
class PrepCase:
    """R rows on permuted slots. Slot s holds raw_keys rows base_s .. base_s + n_rows - 1 (rows < p written, the rest
    NaN) and block_keys rows base_s / ratio ..: desc points base_s rows before the allocations (a real indexer
    allocates from row 0; the window keeps a position near 2^20 small), so the kernel may touch only that window."""

    def __init__(self, stream, rng, n_heads, hd, ratio, rot, n_rows, pos, slots, scale=1.0, pad=0, window=False):
        self.stream, self.n_heads, self.hd, self.ratio, self.rot = stream, n_heads, hd, ratio, rot
        self.pos, self.slots = np.asarray(pos, np.int32), np.asarray(slots)
        self.rows, self.n_rows, self.max_tokens = len(slots), n_rows, n_rows
        self.qkw = (n_heads + 1) * hd + pad
        self.qk = normal(rng, (self.rows, self.qkw), scale)
        self.wq, self.wk = normal(rng, hd, 0.1), normal(rng, hd, 0.1)
        self.es = es = contextlib.ExitStack()
        self.base, self.raw_host, self.raw, self.keys, desc = [], [], [], [], []
        for p in self.pos:
            base = max(0, (int(p) // ratio - 1) * ratio) if window else 0
            raw = nan_bf16((n_rows, hd))
            written = int(np.clip(p - base, 0, n_rows))
            raw[:written] = normal(rng, (written, hd), scale)
            self.base.append(base)
            self.raw_host.append(raw)
            self.raw.append(es.enter_context(upload(raw, stream)))
            self.keys.append(es.enter_context(poisoned(n_rows // ratio * hd * 2, stream)))
            desc.append([self.raw[-1].ptr - base * hd * 2, self.keys[-1].ptr - base // ratio * hd * 2])
        self.d = {n: es.enter_context(upload(x, stream)) for n, x in
                  (("qk", self.qk), ("wq", self.wq), ("wk", self.wk), ("desc", np.array(desc, np.uint64)),
                   ("pos", self.pos), ("slots", self.slots.astype(np.int32)))}
        self.q_post = es.enter_context(poisoned(self.rows * n_heads * hd * 4, stream))

    def launch(self, fns) -> None:
        d = self.d
        launch(fns, kd.QSA_DEV_PREP, kd.prep_geometry(self.rows, self.n_heads, self.hd), self.stream,
               qk=d["qk"], q_norm_w=d["wq"], k_norm_w=d["wk"], desc=d["desc"], pos=d["pos"], slots=d["slots"],
               q_post=self.q_post, qkw=self.qkw, n_heads=self.n_heads, hd=self.hd, ratio=self.ratio, rot=self.rot,
               theta=THETA, eps=EPS, max_tokens=self.max_tokens)

    def close(self) -> None:
        self.es.close()


PREP_CASES = [   # n_heads, hd, ratio, rot, max_tokens, pos by slot, slots, pad
    (4, 128, 4, 64, 64, [7, 0, 63, 64, 11], [2, 0, 3, 1, 4], 0),
    (1, 64, 2, 64, 40, [1, 38, 39], [2, 1, 0], 16),
    (3, 96, 3, 32, 30, [2, 5, 29], [0, 1, 2], 0),
    (2, 256, 1, 128, 20, [0, 19], [1, 0], 8),
    (4, 128, 4, 64, 2**31 - 1, [2**20 - 1, 2**20 + 1], [1, 0], 0),   # positions near 2^20 (windowed buffers)
]


@pytest.mark.parametrize("scale", ["unit", "small"])
@pytest.mark.parametrize("n_heads, hd, ratio, rot, max_tokens, pos, slots, pad", PREP_CASES)
def test_prep(fns, stream, rng, scale, n_heads, hd, ratio, rot, max_tokens, pos, slots, pad):
    std = 1.0 if scale == "unit" else hd ** -0.5
    window = max_tokens > 4096
    n_rows = 4 * ratio if window else max_tokens
    case = PrepCase(stream, rng, n_heads, hd, ratio, rot, n_rows, pos, slots, std, pad, window)
    case.max_tokens = max_tokens
    try:
        case.launch(fns)
        q_post = download(case.q_post, (case.rows, n_heads, hd), np.float32, stream)
        for r, s in enumerate(case.slots):
            p, base = int(case.pos[s]), case.base[s]
            raw = download(case.raw[s], (n_rows, hd), BF16, stream)
            keys = download(case.keys[s], (n_rows // ratio, hd), BF16, stream).astype(np.float32)
            if p >= max_tokens:
                assert np.isnan(q_post[r]).all(), "a row at max_tokens wrote q_post"
                assert raw.view(np.uint16).tobytes() == case.raw_host[s].view(np.uint16).tobytes()
                assert np.isnan(keys).all()
                continue
            key = case.qk[r, n_heads * hd:(n_heads + 1) * hd]
            q_in = case.qk[r, :n_heads * hd].reshape(n_heads, hd)
            assert_close(q_post[r], ref.qprep(q_in, case.wq, p, rot, f32(THETA), f32(EPS)), "f32", (1,),
                         f"q_post row {r}")
            if rot:
                assert_bites(q_post[r], ref.qprep(q_in, case.wq, p + 1, rot, f32(THETA), f32(EPS)), "f32", (1,),
                             "q_post at p + 1")
            expect = case.raw_host[s].copy()
            expect[p - base] = key
            assert raw.view(np.uint16).tobytes() == expect.view(np.uint16).tobytes(), "raw_keys: only row p changes"
            if (p + 1) % ratio:
                assert np.isnan(keys).all(), "no block completes at this token"
                continue
            b = (p + 1) // ratio - 1
            kb = b - base // ratio
            assert np.isnan(np.delete(keys, kb, axis=0)).all(), "wrote a block other than the completed one"
            rows = expect[b * ratio - base:(b + 1) * ratio - base]
            want = (ref.block_pool(expect, case.wk, b, 1, ratio, rot, f32(THETA), f32(EPS))[0] if base == 0 else
                    dref.pool_block(rows, case.wk, b, rot, f32(THETA), f32(EPS)))
            assert_close(keys[kb], want, "bf16", (0,), f"block {b} of slot {s}")
            dropped = rows.copy()
            dropped[-1] = 0   # this token's own key (row p) left out of the mean
            assert_bites(keys[kb], dref.pool_block(dropped, case.wk, b, rot, f32(THETA), f32(EPS)), "bf16", (0,),
                         "block key without this token")
    finally:
        case.close()


def test_prep_equals_the_host_path_kernels_bitwise(fns, stream, rng):
    """q_post = qsa_qprep's bits and the pooled block = qsa_block_pool's bits (the same math, docs/design.md
    §12.1-12.2)."""
    n_heads, hd, ratio, rot = 4, 128, 4, 64
    case = PrepCase(stream, rng, n_heads, hd, ratio, rot, 64, [39, 22], [1, 0])
    try:
        case.launch(fns)
        q_post = download(case.q_post, (2, n_heads, hd), np.float32, stream)
        for r, s in enumerate(case.slots):
            p = int(case.pos[s])
            with upload(np.ascontiguousarray(case.qk[r, :n_heads * hd]), stream) as q_in, \
                    poisoned(n_heads * hd * 4, stream) as q_out:
                cm.launch_kernel(fns["qsa_qprep"], (n_heads, 1, 1), (hd, 1, 1), kq.row_smem_bytes(hd), stream,
                                 kq.QSA_QPREP.pack(q_in, case.d["wq"], q_out, hd, rot, p, THETA, EPS))
                host = download(q_out, (n_heads, hd), np.float32, stream)
            assert host.tobytes() == q_post[r].tobytes(), f"row {r}: q_post differs from qsa_qprep's bits"
        s = 0   # position 39: block 9 completes
        b = (int(case.pos[s]) + 1) // ratio - 1
        with poisoned(64 // ratio * hd * 2, stream) as host_keys:
            pack = kq.QSA_BLOCK_POOL.pack(case.raw[s], case.d["wk"], host_keys, b, ratio, hd, rot, THETA, EPS)
            cm.launch_kernel(fns["qsa_block_pool"], (1, 1, 1), (hd, 1, 1), kq.row_smem_bytes(hd), stream, pack)
            want = download(host_keys, (64 // ratio, hd), BF16, stream)[b]
        got = download(case.keys[s], (64 // ratio, hd), BF16, stream)[b]
        assert got.view(np.uint16).tolist() == want.view(np.uint16).tolist()
    finally:
        case.close()


# ---------------------------------------------------------------------------------------------
# qsa_dev_score
# ---------------------------------------------------------------------------------------------
SCORE_CASES = [   # n_heads, hd, k_blocks, ratio, max_tokens, pos by slot, slots
    (4, 128, 512, 4, 4096, [4 * 1000 + 2, 4 * 601 - 1, 100], [1, 2, 0]),
    (1, 64, 16, 2, 600, [599, 33, 34], [0, 1, 2]),
    (3, 96, 8, 4, 400, [399, 200], [1, 0]),          # hd outside the fast path: a warp per block
    (2, 256, 4, 1, 300, [299, 4], [0, 1]),           # complete = 5 > 4: the smallest selective row
    (4, 32, 1, 4, 64, [63], [0]),
]


@pytest.mark.parametrize("scale", ["unit", "small"])
@pytest.mark.parametrize("n_heads, hd, k_blocks, ratio, max_tokens, pos, slots", SCORE_CASES)
def test_score(fns, stream, rng, scale, n_heads, hd, k_blocks, ratio, max_tokens, pos, slots):
    std = 1.0 if scale == "unit" else hd ** -0.5
    R, stride = len(slots), max_tokens // ratio
    q = normal(rng, (R, n_heads, hd), std, np.float32)
    with contextlib.ExitStack() as es:
        keys_host, keys_dev = [], []
        for _ in pos:
            keys = normal(rng, (stride, hd), std)
            keys_host.append(keys)
            keys_dev.append(es.enter_context(upload(keys, stream)))
        desc = np.array([[0, k.ptr] for k in keys_dev], np.uint64)
        d_q, d_desc, d_pos, d_slots = (es.enter_context(upload(x, stream)) for x in
                                       (q, desc, np.array(pos, np.int32), np.array(slots, np.int32)))
        scores = es.enter_context(poisoned(R * stride * 4, stream))
        launch(fns, kd.QSA_DEV_SCORE, kd.score_geometry(R, stride, n_heads, hd), stream, q_post=d_q, desc=d_desc,
               pos=d_pos, slots=d_slots, scores=scores, score_stride=stride, n_heads=n_heads, hd=hd, ratio=ratio,
               k_blocks=k_blocks)
        got = download(scores, (R, stride), np.float32, stream)
        for r, s in enumerate(slots):
            complete = (pos[s] + 1) // ratio
            if complete <= k_blocks:
                assert np.isnan(got[r]).all(), f"row {r} is inert: nothing to write"
                continue
            assert np.isnan(got[r, complete:]).all(), "wrote past the complete blocks"
            keys = keys_host[s][:complete]
            assert_close(got[r, :complete], ref.score(q[r], keys), "f32", (0,), f"scores row {r}")
            dots = np.maximum(keys.astype(np.float64) @ q[r].T.astype(np.float64), 0)
            h = int(np.argmax(dots.sum(axis=0)))
            dropped = ref.score(np.delete(q[r], h, axis=0), keys) if n_heads > 1 else np.zeros(complete)
            assert_bites(got[r, :complete], dropped, "f32", (0,), "scores, one head dropped")
            with upload(q[r], stream) as q1, poisoned(complete * 4, stream) as host:   # the host path's kernel
                cm.launch_kernel(fns["qsa_score"], (kq.score_grid(complete, hd), 1, 1), (kq.SCORE_THREADS, 1, 1),
                                 kq.score_smem_bytes(n_heads, hd), stream,
                                 kq.QSA_SCORE.pack(q1, keys_dev[s], host, complete, n_heads, hd))
                assert download(host, (complete,), np.float32, stream).tobytes() == got[r, :complete].tobytes()


def test_score_any_grid_gives_the_same_bits(fns, stream, rng):
    n_heads, hd, ratio, stride = 4, 128, 4, 3000
    q = normal(rng, (1, n_heads, hd), 1.0, np.float32)
    keys = normal(rng, (stride, hd))
    outs = []
    with contextlib.ExitStack() as es:
        k_dev = es.enter_context(upload(keys, stream))
        host = (q, np.array([[0, k_dev.ptr]], np.uint64), np.array([4 * stride - 1], np.int32), np.array([0], np.int32))
        bufs = [es.enter_context(upload(x, stream)) for x in host]
        for gx in (1, 7, kd.score_grid(stride, hd), 300):
            out = es.enter_context(poisoned(stride * 4, stream))
            launch(fns, kd.QSA_DEV_SCORE, kd.Geometry((gx, 1, 1), (256, 1, 1), n_heads * hd * 4), stream,
                   q_post=bufs[0], desc=bufs[1], pos=bufs[2], slots=bufs[3], scores=out, score_stride=stride,
                   n_heads=n_heads, hd=hd, ratio=ratio, k_blocks=512)
            outs.append(download(out, (stride,), np.float32, stream).tobytes())
    assert len(set(outs)) == 1


# ---------------------------------------------------------------------------------------------
# qsa_dev_qk
# ---------------------------------------------------------------------------------------------
def qk_run(fns, stream, act: np.ndarray, w_dev, n: int, k: int, offset: int = 0, grid: int | None = None,
           rows: int | None = None) -> np.ndarray:
    """qsa_dev_qk of ``act`` [R, k] (placed ``offset`` bytes into its buffer) with ``w_dev`` [n, k]: out [R, n]."""
    R = act.shape[0]
    with cm.DeviceBuffer(act.nbytes + offset + 16) as buf, poisoned((R + 1) * n * 2, stream) as out:
        cm.copy_h_to_d_async(buf.ptr + offset, np.ascontiguousarray(act), act.nbytes, stream)
        geom = kd.qk_geometry(n)
        if grid is not None:
            geom = kd.Geometry((grid, 1, 1), geom.block, geom.shared)
        launch(fns, kd.QSA_DEV_QK, geom, stream, act=buf.ptr + offset, w=w_dev, out=out,
               rows=R if rows is None else rows, n=n, k=k)
        got = download(out, (R + 1, n), BF16, stream)
    assert np.isnan(got[R].astype(np.float32)).all(), "wrote past row R"
    return got[:R]


@given(data=st.data())
def test_qk_matches_the_float64_reference(fns, stream, data):
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="seed"))
    R = data.draw(st.integers(1, kd.QK_MAX_ROWS), label="R")
    n = data.draw(st.sampled_from([1, 3, 4, 5, 64, 131]), label="n")
    k = data.draw(st.sampled_from([8, 13, 64, 256, 264, 300, 1000, 3080, 6408]), label="k")
    std = data.draw(st.sampled_from([1.0, 0.05]), label="std")
    act, w = normal(rng, (R, k), std), normal(rng, (n, k), 1 / math.sqrt(k))
    with upload(w, stream) as w_dev:
        got = qk_run(fns, stream, act, w_dev, n, k).astype(np.float64)
    want = act.astype(np.float64) @ w.astype(np.float64).T
    assert_close(got, want, "bf16", (1,), f"qsa_dev_qk R={R} n={n} k={k}")
    j = int(np.argmax(np.abs(act.astype(np.float64) * w[0].astype(np.float64)).sum(axis=0)))   # heaviest term
    dropped = np.delete(act, j, axis=1).astype(np.float64) @ np.delete(w, j, axis=1).astype(np.float64).T
    assert_bites(got, dropped, "bf16", (1,), "qsa_dev_qk, one term dropped")


def test_qk_bits_do_not_depend_on_the_batch_the_alignment_or_the_grid(fns, stream, rng):
    n, k = 640, 2560   # Qwen3.8-Flash-Next's indexer: (4 + 1) x 128 columns of 2560
    act, w = normal(rng, (kd.QK_MAX_ROWS, k), 0.5), normal(rng, (n, k), 1 / math.sqrt(k))
    with upload(w, stream) as w_dev:
        full = qk_run(fns, stream, act, w_dev, n, k)
        assert_close(full.astype(np.float64), act.astype(np.float64) @ w.astype(np.float64).T, "bf16", (1,),
                     "qsa_dev_qk at production shape")
        for r in (0, 5):
            one = qk_run(fns, stream, act[r:r + 1], w_dev, n, k)
            assert one.tobytes() == full[r:r + 1].tobytes(), f"row {r} alone differs from row {r} of 8"
        shifted = qk_run(fns, stream, act[:3], w_dev, n, k, offset=2)     # act 2 bytes off 16-byte alignment
        assert shifted.tobytes() == full[:3].tobytes(), "scalar loads gave other bits than vector loads"
        wide = qk_run(fns, stream, act[:3], w_dev, n, k, grid=kd.qk_geometry(n).grid[0] + 5)
        assert wide.tobytes() == full[:3].tobytes(), "a larger grid gave other bits"


def test_qk_broken_contracts_write_nothing(fns, stream, rng):
    """The kernel returns untouched (the emulator refuses the launch, naming the contract)."""
    from hss.emulator import EmulatorError
    n, k = 12, 64
    act, w = normal(rng, (2, k)), normal(rng, (n, k))
    with upload(w, stream) as w_dev:
        for bad in (dict(rows=0), dict(rows=kd.QK_MAX_ROWS + 1), dict(grid=kd.qk_geometry(n).grid[0] - 1)):
            if ON_GPU:
                got = qk_run(fns, stream, act, w_dev, n, k, **bad)
                assert np.isnan(got.astype(np.float32)).all(), f"{bad}: wrote"
            else:
                with pytest.raises(EmulatorError, match="needs"):
                    qk_run(fns, stream, act, w_dev, n, k, **bad)


# ---------------------------------------------------------------------------------------------
# qsa_sparse_attn + qsa_sparse_merge
# ---------------------------------------------------------------------------------------------
class AttnCase:
    """Paged pools [pages, bs, nkv, hd], per-request page tables and token lists (ascending), queries."""

    def __init__(self, rng, nq, nkv, hd, bs, counts, max_pages, sel_cap, std=1.0):
        self.nq, self.nkv, self.hd, self.bs, self.sel_cap = nq, nkv, hd, bs, sel_cap
        self.R, self.max_pages = len(counts), max_pages
        pages = max_pages + 3
        self.k = normal(rng, (pages, bs, nkv, hd), std)
        self.v = normal(rng, (pages, bs, nkv, hd), std)
        self.q = normal(rng, (self.R, nq, hd), std)
        self.tables = np.stack([rng.permutation(pages)[:max_pages] for _ in counts]).astype(np.int32)
        self.tokens = np.full((self.R, sel_cap), 2**30, np.int32)   # past counts: never read
        for r, c in enumerate(counts):
            self.tokens[r, :c] = np.sort(rng.choice(max_pages * bs, c, replace=False))
        self.counts = np.asarray(counts, np.int32)
        self.scale = f32(hd ** -0.5)

    def want(self, r: int, drop: int | None = None) -> np.ndarray:
        toks = self.tokens[r, :max(self.counts[r], 0)]
        if drop is not None:
            toks = np.delete(toks, drop)
        return dref.sparse_attention(self.q[r], self.k, self.v, self.tables[r], toks, self.bs, self.scale)

    def heaviest(self, r: int) -> int:
        """Index (in the list) of the token with the largest softmax weight of any head."""
        toks = self.tokens[r, :self.counts[r]]
        page, slot, valid = dref.page_rows(toks, self.tables[r], self.bs)
        x = dref.logits(self.q[r], self.k[page, slot].astype(np.float64), self.scale)
        x = np.where(valid[:, None], x, -np.inf)
        w = np.exp(x - x.max(axis=0))
        return int(np.argmax((w / w.sum(axis=0)).max(axis=1)))

    def run(self, fns, stream, rows=None) -> np.ndarray:
        """out bf16 [R', nq, hd] of the requests ``rows`` (all by default) as one batch."""
        rows = list(range(self.R)) if rows is None else list(rows)
        R, nq, hd, cap = len(rows), self.nq, self.hd, self.sel_cap
        with contextlib.ExitStack() as es:
            d = {n: es.enter_context(upload(np.ascontiguousarray(x), stream)) for n, x in
                 (("q", self.q[rows]), ("k", self.k), ("v", self.v), ("tables", self.tables[rows]),
                  ("tokens", self.tokens[rows]), ("counts", self.counts[rows]))}
            ml = es.enter_context(poisoned(kd.part_ml_bytes(R, nq, cap), stream))
            po = es.enter_context(poisoned(kd.part_o_bytes(R, nq, cap, hd), stream))
            out = es.enter_context(poisoned(2 * R * nq * hd, stream))
            launch(fns, kd.QSA_SPARSE_ATTN, kd.attn_geometry(R, self.nkv, cap, hd), stream, q=d["q"], k_pool=d["k"],
                   v_pool=d["v"], block_tables=d["tables"], tokens=d["tokens"], counts=d["counts"], part_ml=ml,
                   part_o=po, max_pages=self.max_pages, sel_cap=cap, block_size=self.bs, nq=nq, nkv=self.nkv, hd=hd,
                   scale=self.scale)
            launch(fns, kd.QSA_SPARSE_MERGE, kd.merge_geometry(R, nq, hd), stream, part_ml=ml, part_o=po,
                   counts=d["counts"], out=out, sel_cap=cap, nq=nq, hd=hd)
            return download(out, (R, nq, hd), BF16, stream)

    def check(self, got: np.ndarray) -> None:
        for r in range(self.R):
            g = got[r].astype(np.float32)
            if self.counts[r] <= 0:
                assert (g == 0).all() and not np.signbit(g).any(), f"request {r}: no token -> zeros"
                continue
            assert_close(g, self.want(r), "bf16", (1,), f"request {r} ({self.counts[r]} tokens)")
            assert_bites(g, self.want(r, drop=self.heaviest(r)), "bf16", (1,), f"request {r}, heaviest token dropped")


ATTN_CASES = [   # nq, nkv, hd, bs, counts, max_pages, sel_cap
    (24, 2, 256, 16, [2051], 512, 2052),                         # Qwen3.8: 24 q / 2 kv x 256
    (32, 8, 128, 16, [2048, 2050], 256, 2052),
    (8, 2, 128, 8, [0, 1, 127, 128, 129, 300, 2052], 300, 2052),   # ragged, count 0, split edges
    (4, 4, 64, 32, [500, 17], 40, 516),                          # G = 1
    (16, 1, 96, 16, [260, 3], 20, 260),                          # G = 16, hd not a power of two
    (3, 1, 32, 8, [40], 10, 64),
    (6, 2, 224, 16, [129], 12, 136),
]


@pytest.mark.parametrize("scale", ["unit", "small"])
@pytest.mark.parametrize("nq, nkv, hd, bs, counts, max_pages, sel_cap", ATTN_CASES)
def test_sparse_attention(fns, stream, rng, scale, nq, nkv, hd, bs, counts, max_pages, sel_cap):
    case = AttnCase(rng, nq, nkv, hd, bs, counts, max_pages, sel_cap, 1.0 if scale == "unit" else hd ** -0.5)
    case.check(case.run(fns, stream))


def test_sparse_attention_skips_invalid_tokens(fns, stream, rng):
    """A negative page id, a token past the page table and a negative token contribute nothing; a split whose tokens
    are all invalid is an empty partial; a request with only invalid tokens gives zeros."""
    case = AttnCase(rng, 8, 2, 128, 16, [300, 200, 5], 20, 520)
    case.tables[0, case.tokens[0, 3] // 16] = -1                  # a page of request 0 missing
    case.tokens[0, 10] = 20 * 16 + 5                              # past request 0's table (still ascending? no matter)
    case.tokens[1, 128:200] = -3                                  # request 1's second split: nothing valid
    case.tables[2, :] = -1                                        # request 2: nothing at all
    got = case.run(fns, stream)
    for r in range(2):
        assert_close(got[r].astype(np.float32), case.want(r), "bf16", (1,), f"request {r}")
    valid = dref.page_rows(case.tokens[0, :300], case.tables[0], 16)[2]
    assert (~valid).sum() >= 2
    assert (got[2].astype(np.float32) == 0).all()


def test_sparse_attention_bits_do_not_depend_on_the_batch(fns, stream, rng):
    case = AttnCase(rng, 24, 2, 256, 16, [2051, 700, 0, 1500], 300, 2052)
    batch = case.run(fns, stream)
    for r in (0, 1, 3):
        alone = case.run(fns, stream, rows=[r])
        assert alone.view(np.uint16).tobytes() == batch[r:r + 1].view(np.uint16).tobytes(), f"request {r}"
    again = case.run(fns, stream, rows=[3, 1, 0])
    assert again.view(np.uint16).tobytes() == batch[[3, 1, 0]].view(np.uint16).tobytes()


def test_split_reference_equals_the_direct_one(rng):
    q, k, v = rng.standard_normal((6, 32)), rng.standard_normal((300, 2, 32)), rng.standard_normal((300, 2, 32))
    valid = rng.random(300) > 0.1
    m, l, o = dref.split_partials(q, k, v, valid, 0.2, 128)
    x = dref.logits(q, k[valid], 0.2)
    w = np.exp(x - x.max(axis=0))
    want = np.einsum("nkg,nkd->kgd", (w / w.sum(axis=0)).reshape(-1, 2, 3), v[valid]).reshape(6, 32)
    assert np.abs(dref.merge_splits(m, l, o) - want).max() < 1e-12
    assert (dref.merge_splits(m[:0], l[:0], o[:0]) == 0).all()


# ---------------------------------------------------------------------------------------------
# the launch contracts on the emulator (a GPU kernel returns untouched instead)
# ---------------------------------------------------------------------------------------------
@pytest.mark.emulator
def test_contracts_are_enforced(fns, stream, rng):
    from hss.emulator import EmulatorError, MemoryFault
    case = TopkCase(stream, make_scores(rng, "relu", 50)[None], np.array([199]), np.array([0]), 8, 4, 200)
    args = dict(scores=case.d_scores, pos=case.d_pos, slots=case.d_slots, tokens=case.tokens, counts=case.counts,
                score_stride=50, k_blocks=8, ratio=4, sel_cap=36, max_tokens=200)
    g = kd.topk_geometry(1, 50)
    with pytest.raises(EmulatorError, match="needs block"):
        launch(fns, kd.QSA_DEV_TOPK, kd.Geometry(g.grid, (256, 1, 1), 0), stream, **args)
    with pytest.raises(EmulatorError, match="score_stride"):
        launch(fns, kd.QSA_DEV_TOPK, g, stream, **{**args, "max_tokens": 404})
    with pytest.raises(EmulatorError, match="sel_cap"):
        launch(fns, kd.QSA_DEV_TOPK, g, stream, **{**args, "sel_cap": 34})
    with upload(np.array([5], np.int32), stream) as far_slot:   # slot 5 of a 1-slot pos array
        launch(fns, kd.QSA_DEV_TOPK, g, stream, **{**args, "slots": far_slot})
        with pytest.raises(MemoryFault, match="pos"):
            cm.stream_sync(stream)
    case.close()

    prep = PrepCase(stream, rng, 2, 64, 4, 64, 16, [3], [0])
    base = dict(qk=prep.d["qk"], q_norm_w=prep.d["wq"], k_norm_w=prep.d["wk"], desc=prep.d["desc"],
                pos=prep.d["pos"], slots=prep.d["slots"], q_post=prep.q_post, qkw=prep.qkw, n_heads=2, hd=64,
                ratio=4, rot=64, theta=THETA, eps=EPS, max_tokens=16)
    with pytest.raises(EmulatorError, match=r"grid \(R, n_heads \+ 2, 1\)"):
        launch(fns, kd.QSA_DEV_PREP, kd.prep_geometry(1, 1, 64), stream, **base)
    with pytest.raises(EmulatorError, match="exceeds qkw"):
        launch(fns, kd.QSA_DEV_PREP, kd.prep_geometry(1, 2, 64), stream, **{**base, "qkw": 150})
    with upload(np.array([[0x1234, 0x1234]], np.uint64), stream) as bad_desc:   # raw_keys at no allocation
        launch(fns, kd.QSA_DEV_PREP, kd.prep_geometry(1, 2, 64), stream, **{**base, "desc": bad_desc})
        with pytest.raises(MemoryFault, match="raw_keys of slot 0"):
            cm.stream_sync(stream)
    with upload(np.array([99], np.int32), stream) as far:   # p = 99 >= max_tokens: nothing touched
        launch(fns, kd.QSA_DEV_PREP, kd.prep_geometry(1, 2, 64), stream, **{**base, "pos": far})
        cm.stream_sync(stream)
    with pytest.raises(EmulatorError, match="dynamic shared memory"):
        launch(fns, kd.QSA_DEV_SCORE, kd.Geometry((1, 1, 1), (256, 1, 1), 100), stream, q_post=prep.q_post,
               desc=prep.d["desc"], pos=prep.d["pos"], slots=prep.d["slots"], scores=prep.q_post, score_stride=4,
               n_heads=2, hd=64, ratio=4, k_blocks=0)
    prep.close()

    att = AttnCase(rng, 8, 2, 128, 16, [40], 4, 128)
    with pytest.raises(MemoryFault, match="k_pool"):
        att.tables[0, att.tokens[0, 0] // 16] = 10_000   # a page past the pool
        att.run(fns, stream)
    att.tables[0] = np.arange(4)
    for dims, match in (((8, 3, 128), "multiple of nkv"), ((8, 2, 48), "multiples of 32"),
                        ((34, 2, 128), "nq / nkv <= 16")):
        att.nq, att.nkv, att.hd = dims
        with pytest.raises(EmulatorError, match=match):
            att.run(fns, stream)
    with contextlib.ExitStack() as es:
        bufs = [es.enter_context(poisoned(1 << 16, stream)) for _ in range(4)]
        with pytest.raises(EmulatorError, match="dynamic shared memory"):
            launch(fns, kd.QSA_SPARSE_ATTN, kd.Geometry((1, 2, 1), (256, 1, 1), 1024), stream, q=bufs[0],
                   k_pool=bufs[1], v_pool=bufs[1], block_tables=bufs[2], tokens=bufs[2], counts=bufs[2],
                   part_ml=bufs[3], part_o=bufs[3], max_pages=1, sel_cap=kd.SPLIT, block_size=16, nq=8, nkv=2,
                   hd=128, scale=1.0)
        with pytest.raises(EmulatorError, match="block"):
            launch(fns, kd.QSA_SPARSE_MERGE, kd.Geometry((1, 8, 1), (64, 1, 1), 0), stream, part_ml=bufs[3],
                   part_o=bufs[3], counts=bufs[2], out=bufs[0], sel_cap=128, nq=8, hd=128)


def test_geometry_helpers():
    assert kd.splits(2052) == 17 and kd.splits(128) == 1 and kd.splits(129) == 2
    assert kd.attn_smem_bytes(256) == 153_360 and kd.attn_smem_bytes(128) < 96 * 1024
    assert kd.topk_smem_bytes(8192) == 0 and kd.topk_smem_bytes(8193) == 4 * 8193
    assert kd.topk_smem_bytes(kd.TOPK_CACHE_MAX // 4 + 1) == 0
    assert kd.score_grid(8192, 128) == 128 and kd.score_grid(1, 96) == 1 and kd.score_grid(10**6, 128) == 256
    assert kd.merge_threads(96) == 96 and kd.merge_threads(256) == 256 and kd.merge_threads(40) == 64
    assert kd.attn_hd_problem(256) is None and "multiples of 32" in kd.attn_hd_problem(48)
    assert kd.attn_geometry(3, 2, 2052, 256) == kd.Geometry((3, 2, 17), (256, 1, 1), 153_360)
    assert kd.prep_geometry(5, 4, 128) == kd.Geometry((5, 6, 1), (128, 1, 1), 640)
    assert math.isclose(dref.LOG2E, 1 / math.log(2))
    if ON_GPU:
        assert kd.attn_smem_bytes(256) <= 227 * 1024
