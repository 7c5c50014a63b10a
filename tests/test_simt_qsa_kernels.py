"""``ptx/qsa_device.cu``'s ``qsa_dev_qk``, ``qsa_dev_prep``, ``qsa_dev_score`` and ``qsa_sparse_merge`` compiled for the
CPU and run through the SIMT harness (tests/simt) against their references, under the rules of
test_qsa_device_kernels:

* ``qsa_dev_qk``: the projection within the bf16 bound of the float64 reference; a row's bits the same in any batch
  and under any schedule; nothing past the R rows written;

* ``qsa_dev_prep``: q_post within the f32 bound of qsa_qprep's reference, the raw key stored bit for bit, the block
  completed by this token within the bf16 bound of the pooled reference; and the bits of the host path's
  ``qsa_qprep`` / ``qsa_block_pool`` (``ptx/qsa_indexer.cu`` on the harness too);
* ``qsa_dev_score``: qsa_score's reference under the f32 bound, and ``qsa_score``'s bits, for any grid.x;
* ``qsa_sparse_merge``: split partials (the float64 ``split_partials`` stored as f32) folded to the direct float64
  attention under the bf16 rule, whatever the block; no token gives zeros.
Every bound is shown to bite. Outputs start as 0xFF (NaN); the per-slot buffers ``desc`` points at sit between
0xFF margins that must stay so. Rows left alone (a negative slot or position, a position at max_tokens, a row past
score_stride) touch nothing, and a broken launch contract leaves all memory untouched. ``qsa_sparse_attn`` runs on
the harness in test_simt_qsa_attn.
"""
from __future__ import annotations

import numpy as np
import pytest
import simt
from hypothesis import given, settings
from hypothesis import strategies as st
from test_qsa_device_kernels import EPS, THETA, f32, nan_bf16, normal

from hss.decls import qsa as kq
from hss.decls import qsa_device as kd
from hss.reference import qsa as ref
from hss.reference import qsa_device as dref
from hss.reference.numerics import to_f32

from helpers import BF16, assert_bites, assert_close

MARGIN = 4   # rows of 0xFF on each side of a per-slot buffer
LEFT_ALONE = ("live", "live", "negative slot", "at max_tokens")


@pytest.fixture(scope="module")
def device() -> simt.Program:
    simt.require()
    return simt.build(simt.PTX_DIR / "qsa_device.cu")


@pytest.fixture(scope="module")
def host() -> simt.Program:
    simt.require()
    return simt.build(simt.PTX_DIR / "qsa_indexer.cu")


def nan_f32(shape) -> np.ndarray:
    return np.full(shape, 0xFFFFFFFF, np.uint32).view(np.float32)


class Framed:
    """bf16 rows [n, hd] at a 64-byte aligned address inside MARGIN rows of 0xFF on each side (a kernel reaches
    them only through ``desc``, so no guard page: the margins show a stray write)."""

    def __init__(self, rows: np.ndarray) -> None:
        n, hd = rows.shape
        self._raw = np.full((n + 2 * MARGIN) * hd * 2 + 64, 0xFF, np.uint8)
        off = -self._raw.ctypes.data % 64
        self.whole = self._raw[off:off + (n + 2 * MARGIN) * hd * 2].view(BF16).reshape(n + 2 * MARGIN, hd)
        self.rows = self.whole[MARGIN:MARGIN + n]
        self.rows[:] = rows
        self.hd = hd

    def address(self, first_row: int = 0) -> int:
        """The address desc holds so that logical row ``first_row`` is the buffer's first row."""
        return self.rows.ctypes.data - first_row * self.hd * 2

    def bits(self) -> np.ndarray:
        return self.rows.view(np.uint16).copy()

    def check_margins(self, what: str) -> None:
        edges = np.concatenate([self.whole[:MARGIN], self.whole[-MARGIN:]]).view(np.uint16)
        assert (edges == 0xFFFF).all(), f"{what}: a write outside the buffer"


def slots_and_left_alone(data, rng, rows: int) -> tuple[np.ndarray, str]:
    """Distinct slots of rows + 1 (permuted) and what the last row is (a live row always stays first)."""
    slots = rng.permutation(rows + 1)[:rows].astype(np.int32)
    return slots, data.draw(st.sampled_from(LEFT_ALONE)) if rows > 1 else "live"


# ---------------------------------------------------------------------------------------------
# qsa_dev_prep
# ---------------------------------------------------------------------------------------------
def host_qprep(host, q_in: np.ndarray, wq: np.ndarray, p: int, rot: int) -> np.ndarray:
    n_heads, hd = q_in.shape
    out = nan_f32((n_heads, hd))
    host.kernel("qsa_qprep", kq.QSA_QPREP)(n_heads, hd, kq.row_smem_bytes(hd), np.ascontiguousarray(q_in), wq, out,
                                           hd, rot, p, THETA, EPS)
    return out


def host_block_pool(host, raw: Framed, base: int, wk: np.ndarray, b: int, ratio: int, rot: int) -> np.ndarray:
    """qsa_block_pool's key of block b, raw keys read where qsa_dev_prep reads them (row t at raw.address(base))."""
    hd = raw.hd
    out = nan_bf16((1, hd))
    host.kernel("qsa_block_pool")(1, hd, kq.row_smem_bytes(hd), raw.address(base), wk, out.ctypes.data - b * hd * 2,
                                  b, ratio, hd, rot, THETA, EPS)
    return out[0]


@settings(max_examples=4 * settings().max_examples)
@given(n_heads=st.integers(1, 3), hd=st.sampled_from([32, 64, 96, 128, 256]), ratio=st.sampled_from([1, 2, 3, 4]),
       rows=st.integers(1, 3), scale=st.sampled_from(["unit", "small"]), data=st.data())
def test_prep_matches_reference_and_the_host_kernels(device, host, n_heads, hd, ratio, rows, scale, data):
    """R rows on permuted slots (the last may be left alone), each at its own position (near 2^20 through windowed
    buffers, as test_prep), with and without a completed block; two schedules and shared poisons give one result."""
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    std = 1.0 if scale == "unit" else hd ** -0.5
    rot = data.draw(st.sampled_from(sorted({0, hd // 2, hd})))
    window = data.draw(st.booleans())
    slots, last = slots_and_left_alone(data, rng, rows)
    if window:
        max_tokens, n_rows = 2**31 - 1, 4 * ratio
        pos = (2**20 + rng.integers(-2 * ratio, 2 * ratio, rows + 1)).astype(np.int32)
        last = "negative slot" if last == "at max_tokens" else last
    else:
        max_tokens = n_rows = ratio * data.draw(st.integers(2, 6)) + data.draw(st.integers(0, ratio - 1))
        pos = rng.integers(0, max_tokens, rows + 1).astype(np.int32)
    pos[slots[0]] = data.draw(st.sampled_from([int(pos[slots[0]]), ratio - 1, 2 * ratio - 1]))   # block 0 or 1 done
    if last == "negative slot":
        slots[-1] = -1
    elif last == "at max_tokens":
        pos[slots[-1]] = max_tokens
    qkw = (n_heads + 1) * hd + data.draw(st.sampled_from([0, 8, 16]))
    qk = normal(rng, (rows, qkw), std)
    wq, wk = normal(rng, hd, 0.1), normal(rng, hd, 0.1)
    base, raw_host, raws, keys = [], [], [], []
    for p in pos:
        b0 = max(0, (int(p) // ratio - 1) * ratio) if window else 0
        raw = nan_bf16((n_rows, hd))
        written = int(np.clip(p - b0, 0, n_rows))
        raw[:written] = normal(rng, (written, hd), std)
        base.append(b0)
        raw_host.append(raw)
        raws.append(Framed(raw))
        keys.append(Framed(nan_bf16((n_rows // ratio, hd))))
    desc = np.array([[raws[s].address(base[s]), keys[s].address(base[s] // ratio)] for s in range(rows + 1)],
                    np.uint64)
    kernel, g = device.kernel("qsa_dev_prep", kd.QSA_DEV_PREP), kd.prep_geometry(rows, n_heads, hd)
    outs = []
    for poison, schedule in ((0xA5, "ascending"), (0x00, int(rng.integers(2**31)))):
        q_post = nan_f32((rows, n_heads, hd))
        kernel(g.grid, g.block, g.shared, qk=qk, q_norm_w=wq, k_norm_w=wk, desc=desc, pos=pos, slots=slots,
               q_post=q_post, qkw=qkw, n_heads=n_heads, hd=hd, ratio=ratio, rot=rot, theta=THETA, eps=EPS,
               max_tokens=max_tokens, poison=poison, schedule=schedule)
        outs.append((q_post.tobytes(), *(k.bits().tobytes() for k in keys), *(r.bits().tobytes() for r in raws)))
    assert outs[0] == outs[1], "the result depends on the schedule or the shared-memory poison"

    expect = [r.copy() for r in raw_host]
    completed = {}
    for r, s in enumerate(slots):
        if s < 0 or pos[s] >= max_tokens:
            assert np.isnan(q_post[r]).all(), f"row {r} is left alone but wrote q_post"
            continue
        p, b0 = int(pos[s]), base[s]
        q_in = qk[r, :n_heads * hd].reshape(n_heads, hd)
        assert_close(q_post[r], ref.qprep(q_in, wq, p, rot, f32(THETA), f32(EPS)), "f32", (1,), f"q_post row {r}")
        if rot:
            assert_bites(q_post[r], ref.qprep(q_in, wq, p + 1, rot, f32(THETA), f32(EPS)), "f32", (1,),
                         "q_post at p + 1")
        assert host_qprep(host, q_in, wq, p, rot).tobytes() == q_post[r].tobytes(), f"row {r}: not qsa_qprep's bits"
        expect[s][p - b0] = qk[r, n_heads * hd:(n_heads + 1) * hd]
        if (p + 1) % ratio == 0:
            completed[s] = (p + 1) // ratio - 1
    for s in range(rows + 1):
        assert raws[s].bits().tobytes() == expect[s].view(np.uint16).tobytes(), f"raw_keys of slot {s}: only row p"
        raws[s].check_margins(f"raw_keys of slot {s}")
        keys[s].check_margins(f"block_keys of slot {s}")
        got = keys[s].rows.astype(np.float32)
        if s not in completed:
            assert np.isnan(got).all(), f"slot {s}: no block completes, yet block_keys changed"
            continue
        b, b0 = completed[s], base[s]
        kb = b - b0 // ratio
        assert np.isnan(np.delete(got, kb, axis=0)).all(), "wrote a block other than the completed one"
        rows_b = expect[s][b * ratio - b0:(b + 1) * ratio - b0]
        want = (ref.block_pool(expect[s], wk, b, 1, ratio, rot, f32(THETA), f32(EPS))[0] if b0 == 0 else
                dref.pool_block(rows_b, wk, b, rot, f32(THETA), f32(EPS)))
        assert_close(got[kb], want, "bf16", (0,), f"block {b} of slot {s}")
        dropped = rows_b.copy()
        dropped[-1] = 0   # this token's own key left out of the mean
        assert_bites(got[kb], dref.pool_block(dropped, wk, b, rot, f32(THETA), f32(EPS)), "bf16", (0,),
                     "block key without this token")
        raw_after = Framed(expect[s])
        assert host_block_pool(host, raw_after, b0, wk, b, ratio, rot).view(np.uint16).tolist() == \
            keys[s].rows[kb].view(np.uint16).tolist(), f"slot {s}: block {b} is not qsa_block_pool's bits"


# ---------------------------------------------------------------------------------------------
# qsa_dev_score
# ---------------------------------------------------------------------------------------------
SCORE_LEFT_ALONE = ("live", "live", "negative slot", "negative position", "past the row")


@settings(max_examples=4 * settings().max_examples)
@given(n_heads=st.integers(1, 4), hd=st.sampled_from([32, 64, 96, 128, 256]), ratio=st.sampled_from([1, 2, 4]),
       rows=st.integers(1, 3), scale=st.sampled_from(["unit", "small"]), data=st.data())
def test_score_matches_reference_and_the_host_kernel(device, host, n_heads, hd, ratio, rows, scale, data):
    """R rows on permuted slots, selective (the smallest: complete = k_blocks + 1) or inert, the last perhaps left
    alone; launched on score_geometry's grid and on a smaller one under a random schedule, the same bits."""
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    std = 1.0 if scale == "unit" else hd ** -0.5
    stride = data.draw(st.one_of(st.integers(2, 300), st.sampled_from([1000, 3000])))
    max_tokens = stride * ratio + data.draw(st.integers(0, ratio - 1))
    k_blocks = data.draw(st.one_of(st.integers(0, stride - 1), st.sampled_from([0, 1, stride - 1])))
    slots = rng.permutation(rows + 1)[:rows].astype(np.int32)
    last = data.draw(st.sampled_from(SCORE_LEFT_ALONE)) if rows > 1 else "live"
    pos = rng.integers(0, max_tokens, rows + 1).astype(np.int32)
    pos[slots[0]] = data.draw(st.sampled_from([max_tokens - 1, (k_blocks + 1) * ratio - 1,
                                               int(rng.integers(0, max_tokens))]))
    if last == "negative slot":
        slots[-1] = -1
    elif last == "negative position":
        pos[slots[-1]] = -1 - int(rng.integers(0, 5))
    elif last == "past the row":
        pos[slots[-1]] = (stride + 1) * ratio + int(rng.integers(0, ratio))
    q = normal(rng, (rows, n_heads, hd), std, np.float32)
    keys = [Framed(normal(rng, (stride, hd), std)) for _ in range(rows + 1)]
    before = [k.bits() for k in keys]
    desc = np.array([[0, k.address()] for k in keys], np.uint64)
    kernel, g = device.kernel("qsa_dev_score", kd.QSA_DEV_SCORE), kd.score_geometry(rows, stride, n_heads, hd)
    outs = []
    for gx, schedule in ((g.grid[0], "ascending"), (data.draw(st.integers(1, 3)), int(rng.integers(2**31)))):
        scores = nan_f32((rows, stride))
        kernel((gx, rows, 1), g.block, g.shared, q_post=q, desc=desc, pos=pos, slots=slots, scores=scores,
               score_stride=stride, n_heads=n_heads, hd=hd, ratio=ratio, k_blocks=k_blocks, schedule=schedule)
        outs.append(scores)
    assert outs[0].tobytes() == outs[1].tobytes(), "the bits depend on the grid or the schedule"
    got = outs[0]
    for s, k in enumerate(keys):
        assert k.bits().tobytes() == before[s].tobytes()
        k.check_margins(f"block_keys of slot {s}")
    for r, s in enumerate(slots):
        complete = (int(pos[s]) + 1) // ratio if s >= 0 and pos[s] >= 0 else 0
        if complete <= k_blocks or complete > stride:
            assert np.isnan(got[r]).all(), f"row {r} is inert or left alone: nothing to write"
            continue
        assert np.isnan(got[r, complete:]).all(), "wrote past the complete blocks"
        kr = keys[s].rows[:complete]
        assert_close(got[r, :complete], ref.score(q[r], kr), "f32", (0,), f"scores row {r}")
        dots = np.maximum(kr.astype(np.float64) @ q[r].T.astype(np.float64), 0)
        h = int(np.argmax(dots.sum(axis=0)))
        dropped = ref.score(np.delete(q[r], h, axis=0), kr) if n_heads > 1 else np.zeros(complete)
        if dots.any():   # a few blocks may all score 0 (relu): then no head contributes
            assert_bites(got[r, :complete], dropped, "f32", (0,), "scores, one head dropped")
        want = nan_f32(complete)
        host.kernel("qsa_score", kq.QSA_SCORE)(kq.score_grid(complete, hd), kq.SCORE_THREADS,
                                               kq.score_smem_bytes(n_heads, hd), q[r], np.ascontiguousarray(kr),
                                               want, complete, n_heads, hd)
        assert want.tobytes() == got[r, :complete].tobytes(), f"row {r}: not qsa_score's bits"


# ---------------------------------------------------------------------------------------------
# qsa_sparse_merge
# ---------------------------------------------------------------------------------------------
class MergeCase:
    """Per request: queries, n K/V rows (some invalid), and the split partials qsa_sparse_attn would leave: the float64
    split_partials stored as f32 for the first ceil(n / SPLIT) splits, 0xFF past them (never read)."""

    def __init__(self, rng, nq: int, nkv: int, hd: int, counts: list[int], sel_cap: int, std: float,
                 invalid: float) -> None:
        self.nq, self.nkv, self.hd, self.sel_cap = nq, nkv, hd, sel_cap
        self.counts = np.asarray(counts, np.int32)
        self.scale = f32(hd ** -0.5)
        R, ns = len(counts), kd.splits(sel_cap)
        self.part_ml = nan_f32((R, nq, ns, 2))
        self.part_o = nan_f32((R, nq, ns, hd))
        self.q, self.k, self.v, self.valid = [], [], [], []
        for r, c in enumerate(counts):
            n = min(max(c, 0), sel_cap)
            q, k, v = normal(rng, (nq, hd), std), normal(rng, (n, nkv, hd), std), normal(rng, (n, nkv, hd), std)
            valid = rng.random(n) >= invalid
            if n > kd.SPLIT and invalid:
                valid[:kd.SPLIT] = False   # a split without a valid token: (-inf, 0), o 0
            m, l, o = dref.split_partials(q, k, v, valid, self.scale, kd.SPLIT)
            c_used = m.shape[0]
            self.part_ml[r, :, :c_used, 0] = to_f32(m.T)
            self.part_ml[r, :, :c_used, 1] = to_f32(l.T)
            self.part_o[r, :, :c_used] = to_f32(o.transpose(1, 0, 2))
            self.q.append(q)
            self.k.append(k)
            self.v.append(v)
            self.valid.append(valid)

    def want(self, r: int, drop: int | None = None) -> np.ndarray:
        """The direct float64 attention over the valid rows (through a one-token-a-page table)."""
        n = self.valid[r].size
        table = np.where(self.valid[r], np.arange(n), -1)
        tokens = np.arange(n) if drop is None else np.delete(np.arange(n), drop)
        return dref.sparse_attention(self.q[r], self.k[r][:, None], self.v[r][:, None], table, tokens, 1,
                                     self.scale)

    def heaviest(self, r: int) -> int:
        """The valid row with the largest softmax weight of any head."""
        idx = np.flatnonzero(self.valid[r])
        x = dref.logits(self.q[r], self.k[r][idx].astype(np.float64), self.scale)
        w = np.exp(x - x.max(axis=0))
        return int(idx[np.argmax((w / w.sum(axis=0)).max(axis=1))])

    def run(self, kernel: simt.Kernel, block: int | None = None, schedule: str | int = "ascending") -> np.ndarray:
        R = len(self.counts)
        g = kd.merge_geometry(R, self.nq, self.hd)
        out = nan_bf16((R, self.nq, self.hd))
        kernel(g.grid, g.block if block is None else block, g.shared, part_ml=self.part_ml, part_o=self.part_o,
               counts=self.counts, out=out, sel_cap=self.sel_cap, nq=self.nq, hd=self.hd, schedule=schedule)
        return out


@settings(max_examples=2 * settings().max_examples)
@given(nkv=st.integers(1, 2), group=st.integers(1, 3), hd=st.sampled_from([16, 40, 64, 96, 128, 160]),
       rows=st.integers(1, 3), scale=st.sampled_from(["unit", "small"]), data=st.data())
def test_merge_matches_the_direct_attention(device, nkv, group, hd, rows, scale, data):
    """Counts over split edges (1, 127 .. 129, up to sel_cap), 0, negative and past sel_cap (clamped); some tokens
    invalid (a whole split, at times); any block (a warp striding over hd under a random schedule) the same bits."""
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    nq = nkv * group
    sel_cap = data.draw(st.sampled_from([1, 64, 128, 129, 260]))
    pick = st.one_of(st.integers(1, sel_cap), st.sampled_from(sorted({1, sel_cap, min(127, sel_cap),
                                                                       min(129, sel_cap)})))
    counts = [data.draw(pick) for _ in range(rows)]
    if rows > 1:
        counts[-1] = data.draw(st.sampled_from([counts[-1], 0, -3, sel_cap + kd.SPLIT + 1]))
    invalid = data.draw(st.sampled_from([0.0, 0.0, 0.2]))
    case = MergeCase(rng, nq, nkv, hd, counts, sel_cap, 1.0 if scale == "unit" else hd ** -0.5, invalid)
    kernel = device.kernel("qsa_sparse_merge", kd.QSA_SPARSE_MERGE)
    got = case.run(kernel)
    other = case.run(device.kernel("qsa_sparse_merge"), 32, int(rng.integers(2**31)))
    assert other.view(np.uint16).tobytes() == got.view(np.uint16).tobytes(), "the bits depend on the block"
    for r in range(rows):
        g = got[r].astype(np.float32)
        if not case.valid[r].any():
            assert (g == 0).all() and not np.signbit(g).any(), f"request {r}: no token -> zeros"
            continue
        assert_close(g, case.want(r), "bf16", (1,), f"request {r} ({counts[r]} tokens)")
        assert_bites(g, case.want(r, drop=case.heaviest(r)), "bf16", (1,), f"request {r}, heaviest token dropped")


def test_merge_clamps_counts_to_sel_cap(device, rng):
    """A count past sel_cap reads the sel_cap tokens' splits only: the bits of count = sel_cap."""
    kernel = device.kernel("qsa_sparse_merge", kd.QSA_SPARSE_MERGE)
    case = MergeCase(rng, 4, 2, 64, [260, 260, 100], 260, 1.0, 0.0)
    want = case.run(kernel)
    case.counts[:] = [260 + kd.SPLIT + 1, 2**31 - 1, 100]
    assert case.run(kernel).view(np.uint16).tobytes() == want.view(np.uint16).tobytes()
    for r in range(3):
        assert_close(want[r].astype(np.float32), case.want(r), "bf16", (1,), f"request {r}")


# ---------------------------------------------------------------------------------------------
# qsa_dev_qk
# ---------------------------------------------------------------------------------------------
def qk_launch(kernel: simt.Kernel, act: np.ndarray, w: np.ndarray, rows: int | None = None, grid: int | None = None,
              schedule: str | int = "ascending") -> np.ndarray:
    R, k = act.shape
    n = w.shape[0]
    g = kd.qk_geometry(n)
    out = nan_bf16((R + 1, n))
    kernel(g.grid if grid is None else grid, g.block, g.shared, act=act, w=w, out=out, rows=R if rows is None else rows,
           n=n, k=k, schedule=schedule)
    return out


@given(R=st.integers(1, kd.QK_MAX_ROWS), n=st.sampled_from([1, 4, 5, 9]),
       k=st.sampled_from([8, 13, 64, 300, 2560, 6408]), data=st.data())
def test_qk_matches_the_float64_reference(device, R, n, k, data):
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    act, w = normal(rng, (R, k)), normal(rng, (n, k), k ** -0.5)
    out = qk_launch(device.kernel("qsa_dev_qk", kd.QSA_DEV_QK), act, w)
    assert np.isnan(out[R].astype(np.float32)).all(), "wrote past row R"
    got = out[:R].astype(np.float64)
    assert_close(got, act.astype(np.float64) @ w.astype(np.float64).T, "bf16", (1,), f"qsa_dev_qk R={R} n={n} k={k}")
    j = int(np.argmax(np.abs(act[0].astype(np.float64) * w[0].astype(np.float64))))
    dropped = np.delete(act, j, axis=1).astype(np.float64) @ np.delete(w, j, axis=1).astype(np.float64).T
    assert_bites(got, dropped, "bf16", (1,), "qsa_dev_qk, one term dropped")
    # a row's bits: the same alone, under another schedule
    kernel = device.kernel("qsa_dev_qk")
    alone = qk_launch(kernel, act[-1:], w, schedule=int(rng.integers(2**31)))
    assert alone[0].view(np.uint16).tobytes() == out[R - 1].view(np.uint16).tobytes(), "row bits depend on R"


def test_qk_broken_contracts_leave_memory_untouched(device, rng):
    kernel = device.kernel("qsa_dev_qk")
    act, w = normal(rng, (2, 64)), normal(rng, (12, 64))
    for change in (dict(rows=0), dict(rows=kd.QK_MAX_ROWS + 1), dict(grid=kd.qk_geometry(12).grid[0] - 1)):
        out = qk_launch(kernel, act, w, **change)
        assert np.isnan(out.astype(np.float32)).all(), f"{change}: wrote"


# ---------------------------------------------------------------------------------------------
# broken launch contracts: the kernels return before any access
# ---------------------------------------------------------------------------------------------
def test_prep_broken_contracts_leave_memory_untouched(device, rng):
    """Undeclared (no harness check): a wrong grid or block, too little shared memory, qkw too small, rot odd or past
    hd, ratio 0; and a row at max_tokens."""
    kernel = device.kernel("qsa_dev_prep")
    n_heads, hd, ratio = 2, 64, 4
    qk, wq, wk = normal(rng, (1, 3 * hd)), normal(rng, hd, 0.1), normal(rng, hd, 0.1)
    raw_host = nan_bf16((16, hd))
    raw_host[:3] = normal(rng, (3, hd))
    raw, keys = Framed(raw_host), Framed(nan_bf16((4, hd)))
    desc = np.array([[raw.address(), keys.address()]], np.uint64)
    base = dict(qkw=3 * hd, n_heads=n_heads, hd=hd, ratio=ratio, rot=hd, theta=THETA, eps=EPS, max_tokens=16)
    g = kd.prep_geometry(1, n_heads, hd)
    for grid, block, shared, change, p in [
            ((1, n_heads + 1, 1), g.block, g.shared, {}, 3), ((1, n_heads + 2, 2), g.block, g.shared, {}, 3),
            (g.grid, (hd // 2, 1, 1), g.shared, {}, 3), (g.grid, (hd, 2, 1), g.shared, {}, 3),
            (g.grid, g.block, g.shared - 4, {}, 3), (g.grid, g.block, g.shared, {"qkw": 3 * hd - 1}, 3),
            (g.grid, g.block, g.shared, {"rot": 63}, 3), (g.grid, g.block, g.shared, {"rot": hd + 2}, 3),
            (g.grid, g.block, g.shared, {"ratio": 0}, 3), (g.grid, g.block, g.shared, {}, 16),
            (g.grid, g.block, g.shared, {}, 99)]:
        q_post = nan_f32((1, n_heads, hd))
        kernel(grid, block, shared, qk, wq, wk, desc, np.array([p], np.int32), np.array([0], np.int32), q_post,
               *{**base, **change}.values())
        assert np.isnan(q_post).all(), (grid, block, shared, change, p)
        assert raw.bits().tobytes() == raw_host.view(np.uint16).tobytes() and np.isnan(keys.rows.astype(float)).all()
        raw.check_margins("raw_keys")
        keys.check_margins("block_keys")
    with pytest.raises(simt.SimtError, match="invalid memory access"):   # raw_keys at no allocation
        kernel(g.grid, g.block, g.shared, qk, wq, wk, np.array([[0x1234, 0x1234]], np.uint64),
               np.array([3], np.int32), np.array([0], np.int32), nan_f32((1, n_heads, hd)), *base.values())


def test_score_broken_contracts_leave_memory_untouched(device, rng):
    """Undeclared: too little shared memory, a block not of whole warps or past SCORE_THREADS or not flat, grid.z
    past 1, hd / n_heads / ratio 0."""
    kernel = device.kernel("qsa_dev_score")
    n_heads, hd, ratio, stride = 2, 64, 4, 20
    q = normal(rng, (1, n_heads, hd), 1.0, np.float32)
    keys = Framed(normal(rng, (stride, hd)))
    desc = np.array([[0, keys.address()]], np.uint64)
    base = dict(score_stride=stride, n_heads=n_heads, hd=hd, ratio=ratio, k_blocks=2)
    shared = kd.score_smem_bytes(n_heads, hd)
    for grid, block, smem, change in [((1, 1, 1), (256, 1, 1), 100, {}), ((1, 1, 1), (48, 1, 1), shared, {}),
                                      ((1, 1, 1), (512, 1, 1), shared, {}), ((1, 1, 1), (128, 2, 1), shared, {}),
                                      ((1, 1, 2), (256, 1, 1), shared, {}), ((1, 1, 1), (256, 1, 1), 0, {"hd": 0}),
                                      ((1, 1, 1), (256, 1, 1), shared, {"n_heads": 0}),
                                      ((1, 1, 1), (256, 1, 1), shared, {"ratio": 0})]:
        scores = nan_f32((1, stride))
        kernel(grid, block, smem, q, desc, np.array([4 * stride - 1], np.int32), np.array([0], np.int32), scores,
               *{**base, **change}.values())
        assert np.isnan(scores).all(), (grid, block, smem, change)
    keys.check_margins("block_keys")


def test_merge_broken_contracts_leave_memory_untouched(device, rng):
    """Undeclared: grid.y not nq, grid.z past 1, a block not flat, sel_cap / nq / hd 0."""
    kernel = device.kernel("qsa_sparse_merge")
    case = MergeCase(rng, 4, 2, 64, [200], 260, 1.0, 0.0)
    base = dict(sel_cap=260, nq=4, hd=64)
    for grid, block, change in [((1, 3, 1), (64, 1, 1), {}), ((1, 5, 1), (64, 1, 1), {}),
                                ((1, 4, 2), (64, 1, 1), {}), ((1, 4, 1), (32, 2, 1), {}),
                                ((1, 4, 1), (64, 1, 1), {"sel_cap": 0}), ((1, 4, 1), (64, 1, 1), {"nq": 0}),
                                ((1, 4, 1), (64, 1, 1), {"hd": 0})]:
        out = nan_bf16((1, 4, 64))
        kernel(grid, block, 0, case.part_ml, case.part_o, case.counts, out, *{**base, **change}.values())
        assert np.isnan(out.astype(np.float32)).all(), (grid, block, change)
