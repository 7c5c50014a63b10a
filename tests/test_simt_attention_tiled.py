"""``ptx/paged_decode_attn_tiled.cu``'s step kernels (the tiled decode attention under ``TiledAttention``) compiled for
the CPU and run through the SIMT harness (tests/simt: ldmatrix / mma.sync / cp.async as warp calls), against the
float64 attention of :mod:`hss.reference.attention` under the bf16 rule (|err| <= 2^-7 |ref| + 1e-5 max|ref| per
(sequence, head)):

* one fresh tile with ``out``: its output, the state (m in log2 units, l, o) it leaves, the fold counters back at 0;
  dropping the heaviest token breaks the bound;
* tiles of many units, folded in one level and in two (units of 8, then the groups), for every grid.z the same bits;
* a step in two tiles: the second tile folds into the state the first left, within the bound of the one-tile result;
* a sequence whose tile is empty keeps (fresh: gets) the initial state; pages past the tile's count are not read.

The harness's mma sums in double and rounds once, and the kernel's ``--use_fast_math`` build is not the harness's,
so bits are compared only between runs on the harness.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import simt

from hss._util import ceil_div
from hss.decls import attention as ka
from hss.reference import attention as ref

from helpers import BF16, assert_bites, assert_close

LOG2E = 1.4426950408889634


@pytest.fixture(scope="module")
def program() -> simt.Program:
    simt.require()
    return simt.build(simt.PTX_DIR / "paged_decode_attn_tiled.cu")


class Tile:
    """Sequences' queries, an NHD pool [pages, bs, nkv, hd] (K and V), per-sequence page lists of one tile."""

    def __init__(self, rng, nq, nkv, hd, bs, pages_per_seq, last_valid, capacity=None):
        self.nq, self.nkv, self.hd, self.bs, self.last_valid = nq, nkv, hd, bs, last_valid
        self.S = len(pages_per_seq)
        self.capacity = capacity or max(max(pages_per_seq), 1)
        total = sum(pages_per_seq) + 3
        self.k = (rng.standard_normal((total, bs, nkv, hd))).astype(BF16)
        self.v = (rng.standard_normal((total, bs, nkv, hd))).astype(BF16)
        self.q = (rng.standard_normal((self.S, nq, hd))).astype(BF16)
        order = rng.permutation(total)
        self.tables = np.full((self.S, self.capacity), 2**30, np.int32)   # past a count: never read
        at = 0
        for s, n in enumerate(pages_per_seq):
            self.tables[s, :n] = order[at:at + n]
            at += n
        self.counts = np.asarray(pages_per_seq, np.int32)

    def tokens(self, s: int, first: int = 0, count: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """K, V rows [n, nkv, hd] of the tile's pages first .. first + count of sequence s (the last page cut)."""
        count = self.counts[s] - first if count is None else count
        ks, vs = [], []
        for j in range(first, first + count):
            keep = self.bs if j < self.counts[s] - 1 else min(max(self.last_valid, 0), self.bs)
            ks.append(self.k[self.tables[s, j], :keep])
            vs.append(self.v[self.tables[s, j], :keep])
        if not ks:
            return np.zeros((0, self.nkv, self.hd)), np.zeros((0, self.nkv, self.hd))
        return np.concatenate(ks).astype(np.float64), np.concatenate(vs).astype(np.float64)

    def want(self, s: int, drop: int | None = None) -> np.ndarray:
        k, v = self.tokens(s)
        if drop is not None:
            k, v = np.delete(k, drop, axis=0), np.delete(v, drop, axis=0)
        return ref.attention(self.q[s], k, v)

    def heaviest(self, s: int) -> int:
        k, _ = self.tokens(s)
        x = ref.logits(self.q[s], k)
        w = np.exp(x - x.max(axis=0))
        return int(np.argmax((w / w.sum(axis=0)).max(axis=1)))


def step(program, t: Tile, tables=None, counts=None, state=None, fresh: int = 1, z: int | None = None,
         last_valid: int | None = None, out: bool = True):
    """One launch of the step kernel over tile ``t`` (or the given page lists); returns (out, m, l, o, counters)."""
    S, nq, nkv, hd, bs = t.S, t.nq, t.nkv, t.hd, t.bs
    tables = t.tables if tables is None else tables
    counts = t.counts if counts is None else counts
    cap = tables.shape[1]
    hdp = ka.padded_head_dim(hd)
    mu = ka.max_units(cap, bs, hdp)
    gy = nkv * ka.head_groups(nq // nkv)
    z = ka.step_grid_z(mu, S * gy, hdp) if z is None else z
    m, l, o = state if state is not None else (np.full(S * nq, np.nan, np.float32),
                                              np.full(S * nq, np.nan, np.float32),
                                              np.full((S * nq, hd), np.nan, np.float32))
    m, l, o = m.copy(), l.copy(), o.copy()
    res = np.full((S, nq, hd), np.nan, np.float32).astype(BF16)
    counters = np.zeros(ka.counters(S, nkv, nq // nkv), np.uint32)
    program.kernel(ka.step_kernel_name(hd), ka.PAGED_DECODE_ATTN_TILED[hdp])(
        (S, gy, z), ka.STEP_THREADS, ka.step_shared_bytes(hd), q=t.q, k_pool=t.k, v_pool=t.v,
        tile_blocks=np.ascontiguousarray(tables), tile_block_counts=np.ascontiguousarray(counts),
        part_ml=np.full((S * nq, mu, 2), np.nan, np.float32), part_o=np.full((S * nq, mu, hdp), np.nan, np.float32),
        m=m, l=l, o=o, out=res if out else None, merge_count=counters, num_q_heads=nq, num_kv_heads=nkv,
        head_dim=hd, block_size=bs, tile_capacity=cap, gqa_ratio=nq // nkv, max_units=mu, blk_stride=bs * nkv * hd,
        tok_stride=nkv * hd, kvh_stride=hd, last_block_valid_slots=t.last_valid if last_valid is None else last_valid,
        fresh=fresh)
    assert (counters == 0).all(), "the fold counters must be back at 0 after a launch"
    return res, m, l, o, counters


def check(t: Tile, got: np.ndarray, what: str) -> None:
    for s in range(t.S):
        g = got[s].astype(np.float32)
        if t.tokens(s)[0].shape[0] == 0:
            assert (g == 0).all(), f"{what}: sequence {s} has no token: zeros"
            continue
        assert_close(g, t.want(s), "bf16", (1,), f"{what}: sequence {s}")


CASES = [   # nq, nkv, hd, bs, pages per sequence, last page's valid slots
    (8, 2, 64, 16, [5, 1, 12], 7),
    (32, 8, 128, 16, [6, 3], 16),      # Llama-like 32 q / 8 kv x 128
    (24, 2, 256, 16, [4], 9),          # Qwen3.8-Flash-Next's 24 q / 2 kv x 256
    (20, 1, 96, 8, [7, 2], 8),         # 20 q heads of one kv head: two CTA rows; hd padded to 128
]


@pytest.mark.parametrize("nq, nkv, hd, bs, pages, last_valid", CASES)
def test_one_fresh_tile_matches_the_float64_attention(program, rng, nq, nkv, hd, bs, pages, last_valid):
    t = Tile(rng, nq, nkv, hd, bs, pages, last_valid)
    out, m, l, o, _ = step(program, t)
    check(t, out, f"{nq}q/{nkv}kv x {hd}")
    assert_bites(out[0].astype(np.float32), t.want(0, drop=t.heaviest(0)), "bf16", (1,), "heaviest token dropped")
    for s in range(t.S):   # the state: m the max logit in log2 units, o / l the output
        k, _ = t.tokens(s)
        x = ref.logits(t.q[s], k)
        rows = slice(s * nq, (s + 1) * nq)
        assert np.allclose(m[rows], x.max(axis=0) * LOG2E, rtol=1e-5, atol=1e-5), f"sequence {s}: m"
        assert_close(ref.finalize(l[rows], o[rows]), t.want(s), "bf16", (1,), f"sequence {s}: o / l")


@pytest.mark.parametrize("hd, pages", [(64, 40), (128, 150)])   # 640 tokens: 5 units, one level; 2,400: 10 in two
def test_many_units_fold_the_same_bits_for_any_grid_z(program, rng, hd, pages):
    t = Tile(rng, 16, 1, hd, 16, [pages], 16)
    hdp = ka.padded_head_dim(hd)
    n = pages * 16
    units = ceil_div(n, ka.unit_tokens(n, 1, hdp))
    two_level = units > ka.FOLD_GROUP and units * 16 * hdp > ka.FOLD_DIRECT
    assert units > 1 and two_level == (hd == 128), (units, two_level)
    first = step(program, t)
    check(t, first[0], f"{units} units")
    mu = ka.max_units(pages, 16, hdp)
    for z in (1, 3, mu):
        again = step(program, t, z=z)
        assert again[0].view(np.uint16).tobytes() == first[0].view(np.uint16).tobytes(), f"grid.z {z}"


def test_a_step_in_two_tiles_folds_into_the_state(program, rng):
    t = Tile(rng, 8, 2, 128, 16, [9, 4], 11)
    whole = step(program, t)[0]
    cut = [5, 2]   # pages of each sequence in the first tile
    first_tables = np.full_like(t.tables, 2**30)
    second_tables = np.full_like(t.tables, 2**30)
    for s, c in enumerate(cut):
        first_tables[s, :c] = t.tables[s, :c]
        second_tables[s, :t.counts[s] - c] = t.tables[s, c:t.counts[s]]
    _, m, l, o, _ = step(program, t, tables=first_tables, counts=np.array(cut, np.int32), last_valid=16, out=False)
    rest = t.counts - np.array(cut)
    out = step(program, t, tables=second_tables, counts=rest.astype(np.int32), state=(m, l, o), fresh=0)[0]
    check(t, out, "two tiles")
    assert np.abs(out.astype(np.float64) - whole.astype(np.float64)).max() <= \
        2 * max(2.0 ** -7 * np.abs(whole.astype(np.float64)).max(), 1e-6), "two tiles vs one"


def test_an_empty_tile_keeps_the_state(program, rng):
    t = Tile(rng, 8, 2, 64, 16, [3, 0, 2], 5)
    out, m, l, o, _ = step(program, t)
    check(t, out, "ragged")
    assert np.isneginf(m[8:16]).all() and (l[8:16] == 0).all() and (o[8:16] == 0).all(), "fresh: the initial state"
    state = (m, l, o)
    again = step(program, t, counts=np.array([0, 0, 0], np.int32), state=state, fresh=0)
    for got, had in zip(again[1:4], state):
        assert got.tobytes() == had.tobytes(), "a tile without tokens changes no state"
    assert math.isfinite(float(m[0]))
