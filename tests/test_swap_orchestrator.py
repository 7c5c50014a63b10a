"""Tests for hss.swap.config and hss.swap.orchestrator (docs/design.md §8; bounds of docs/design.md §0).

The central promise: a step streamed through HighSpeedSwap (resident set + double-buffered stream, reads on
a copy stream) gives bit for bit what in-HBM TiledAttention gives over the same pages in the same tiles,
which each step records. Every schedule is also checked to attend every page once (the last one with its
valid slots) and the output against float64 attention with the bf16 bound, shown to bite. Eviction is
checked against the predictor's own scores; a missing cross-stream wait is shown to change results on the
emulator. Both stores run everything; files go to tmp_path. The sparse mode (docs/design.md §17.6) is checked against a
plain-Python model of its page choice over the predictor's own scores, with the same bounds over exactly the pages it
attends, its store reads counted, its resident set's preference for high scores, and a covering budget's bits against
an exact step's.
"""
from __future__ import annotations

import dataclasses
import errno
import os
from dataclasses import replace

import numpy as np
import pytest

from hss import cuda_min as cm
from hss._util import ceil_div
from hss.attention import TiledAttention, TiledAttentionDims
from hss.cuda import _driver
from hss.cuda._driver import HssError
from hss.reference import attention as ref
from hss.swap import (
    HighSpeedSwap,
    HighSpeedSwapConfig,
    ModelDims,
    PreparedReads,
    StepRecord,
    StoreError,
    StoreIOError,
    TileRecord,
    layer_path,
)

import conftest
from helpers import BF16, assert_bites, assert_close, download, upload

ON_GPU = conftest.ON_GPU
LAYER_STEPS = (0, 0, 1, 0, 1) * (4 if ON_GPU else 1)   # the e2e test's steps (layer of each): more on a GPU
SEED = 0xCAFE_F00D
ORIGINAL = dict(num_q_heads=32, num_kv_heads=8, head_dim=128, block_size=16)   # high_speed_swap_e2e.rs
STORES = [("host", None), ("file", None), ("file", False)]
STORE_IDS = ["host", "file-auto", "file-buffered"]


def randn(rng: np.random.Generator, shape: tuple[int, ...], std: float) -> np.ndarray:
    x = (rng.standard_normal(shape) * std).astype(np.float32).astype(BF16)
    x[x == 0] = BF16(std)
    return x


class Setup:
    """A HighSpeedSwap plus the host truth: k, v bf16 [layers, max_blocks, bs, nkv, hd] of every offloaded page."""

    def __init__(self, ctx, tmp_path, rng, store: str, direct=None, *, layers: int = 1, max_blocks: int = 40,
                 resident_blocks: int = 8, tile: int = 2, dims: dict = ORIGINAL, rank: int = 32, **cfg) -> None:
        self.ctx, self.stream, self.rng = ctx, ctx.stream, rng
        self.cfg = HighSpeedSwapConfig(tmp_path / f"kv-{store}", 1 << 36, resident_blocks, rank, 2, False, SEED,
                                       store=store, stream_tile_blocks=tile, direct=direct, **cfg)
        self.model = ModelDims(layers, max_blocks, **dims)
        self.h = HighSpeedSwap(ctx, self.cfg, self.model)
        d = self.model
        shape = (layers, max_blocks, d.block_size, d.num_kv_heads, d.head_dim)
        self.k = np.full(shape, np.nan, dtype=BF16)
        self.v = np.full(shape, np.nan, dtype=BF16)
        self.std = 1.0 / np.sqrt(d.head_dim)
        self.out = cm.DeviceBuffer(2 * d.num_q_heads * d.head_dim)

    def offload(self, layer: int, blocks: list[int], predict: bool = True, k: np.ndarray | None = None) -> None:
        """Offload fresh random pages (or K = ``k`` for all of them)."""
        d = self.model
        page = (d.block_size, d.num_kv_heads, d.head_dim)
        for b in blocks:
            self.k[layer, b] = randn(self.rng, page, self.std) if k is None else k
            self.v[layer, b] = randn(self.rng, page, 1.0)
            if predict:
                kdev = upload(self.k[layer, b], self.stream)
                self.h.offload_block(self.ctx, layer, b, kdev, self.k[layer, b], self.v[layer, b])
                cm.stream_sync(self.stream)
                kdev.close()
            else:
                self.h.offload_block_no_predict_on_stream(self.stream, layer, b, self.k[layer, b], self.v[layer, b])

    def query(self) -> tuple[np.ndarray, cm.DeviceBuffer]:
        d = self.model
        q = randn(self.rng, (d.num_q_heads, d.head_dim), 1.0)
        return q, upload(q, self.stream)

    def step(self, layer: int, ids: list[int], q_dev, **kw) -> tuple[StepRecord, np.ndarray]:
        rec = self.h.attend_layer(self.ctx, layer, ids, q_dev, self.out, **kw)
        d = self.model
        return rec, download(self.out, (d.num_q_heads, d.head_dim), BF16, self.stream)

    def close(self) -> None:
        self.out.close()
        self.h.close()


def replay(s: Setup, layer: int, rec: StepRecord, q_dev) -> np.ndarray:
    """In-HBM tiled attention over an NHD pool indexed by block id, with ``rec``'s tiles and valid slots."""
    d = s.model
    cap = max([len(t.block_ids) for t in rec.tiles] + [1])
    keep = [upload(s.k[layer], s.stream), upload(s.v[layer], s.stream)]
    out = cm.DeviceBuffer(2 * d.num_q_heads * d.head_dim)
    with TiledAttention(s.ctx, TiledAttentionDims(1, d.num_q_heads, d.num_kv_heads, d.head_dim, d.block_size,
                                                  cap)) as ta:
        ta.begin_step(s.stream, 1)
        for tile in rec.tiles:
            blocks = np.zeros(cap, np.int32)
            blocks[:len(tile.block_ids)] = tile.block_ids
            keep += [upload(blocks, s.stream), upload(np.array([len(tile.block_ids)], np.int32), s.stream)]
            ta.step_tile(s.stream, q_dev, keep[0], keep[1], keep[-2], keep[-1], 1, *ta.paged_strides(),
                         tile.last_block_valid_slots)
        ta.finalize(s.stream, out, 1)
        got = download(out, (d.num_q_heads, d.head_dim), BF16, s.stream)
    for b in keep + [out]:
        b.close()
    return got


def check_step(s: Setup, layer: int, ids: list[int], q: np.ndarray, q_dev, rec: StepRecord, got: np.ndarray,
               lbvs: int, what: str) -> None:
    """Bitwise = the replay; every page once, the last one last in its tile with ``lbvs``; float64 bound."""
    bs = s.model.block_size
    flat = [b for t in rec.tiles for b in t.block_ids]
    assert sorted(flat) == sorted(ids), f"{what}: the schedule must attend every page exactly once"
    for t in rec.tiles:
        if ids and ids[-1] in t.block_ids:
            assert t.block_ids[-1] == ids[-1] and t.last_block_valid_slots == lbvs, what
        else:
            assert t.last_block_valid_slots == bs, what
        assert len(t.slots) == len(t.block_ids) <= max(s.h.resident_capacity, s.h.tile_blocks)
    assert [t.streamed for t in rec.tiles] == sorted(t.streamed for t in rec.tiles), "resident tile goes first"
    assert set(rec.hits) | set(rec.misses) == set(ids) and not set(rec.hits) & set(rec.misses)
    want_bits = replay(s, layer, rec, q_dev)
    assert np.array_equal(got.view(np.uint16), want_bits.view(np.uint16)), \
        f"{what}: streamed output differs from in-HBM tiled attention over the same schedule"
    keep = [bs] * len(ids)
    if ids:
        keep[-1] = min(max(lbvs, 0), bs)
    kt = np.concatenate([s.k[layer, b, :n] for b, n in zip(ids, keep)]) if ids else s.k[layer, :0, 0]
    vt = np.concatenate([s.v[layer, b, :n] for b, n in zip(ids, keep)]) if ids else s.v[layer, :0, 0]
    want = ref.attention(q, kt, vt)
    assert_close(got, want, "bf16", (1,), what)
    if len(kt) > 1:
        drop = int(np.argmax(ref.logits(q, kt)[:, 0]))
        assert_bites(got, ref.attention(q, np.delete(kt, drop, 0), np.delete(vt, drop, 0)), "bf16", (1,), what)


# -- config ------------------------------------------------------------------------------------
def test_config_and_dims_validation(tmp_path) -> None:
    good = HighSpeedSwapConfig(tmp_path / "a" / "b", 1 << 20, 8, 32, 4, False, 7)
    good.validate()
    assert (good.tile_blocks, good.resident_capacity) == (2, 4)
    assert good.validate_and_prepare() == tmp_path / "a" / "b" and (tmp_path / "a" / "b").is_dir()
    assert replace(good, stream_tile_blocks=4).resident_capacity == 0
    for change, err, words in [
        (dict(bytes=0), HssError, r"bytes must be >= 1"), (dict(resident_blocks=0), HssError, "resident_blocks"),
        (dict(rank=0), HssError, r"rank must be in 1..128 \(got 0\)"), (dict(rank=129), HssError, "rank"),
        (dict(qd=65), HssError, r"qd must be in 1..64"), (dict(qd=0), HssError, "qd"),
        (dict(projection_seed=2**64), HssError, "projection_seed"), (dict(projection_seed=-1), HssError, "seed"),
        (dict(graph=1), TypeError, "graph must be a bool"), (dict(dir=""), HssError, "dir must be a non-empty"),
        (dict(store="disk"), HssError, r"store must be one of \('file', 'host'\)"),
        (dict(direct="auto"), TypeError, "direct"), (dict(rank=3.0), TypeError, "rank must be an int"),
        (dict(stream_tile_blocks=5), HssError, r"stream_tile_blocks \(5\) must be in 1..resident_blocks // 2 \(4\)"),
        (dict(stream_tile_blocks=0), HssError, "stream_tile_blocks"),
        (dict(resident_blocks=1), HssError, r"stream_tile_blocks \(1\) must be in 1..resident_blocks // 2 \(0\)")]:
        with pytest.raises(err, match=words):
            replace(good, **change).validate()
    dims = ModelDims(2, 64, 32, 8, 128, 16, model_fp="x")
    dims.validate()
    for change, err, words in [
        (dict(num_kv_heads=6), HssError, r"num_q_heads \(32\) must be a multiple of num_kv_heads \(6\)"),
        (dict(head_dim=257), HssError, r"head_dim must be in 1..256"), (dict(block_size=65536), HssError, "block_size"),
        (dict(num_layers=0), HssError, "num_layers"), (dict(max_blocks_per_layer=2**31), HssError, "max_blocks"),
        (dict(model_fp=3), TypeError, "model_fp"), (dict(head_dim=True), TypeError, "head_dim")]:
        with pytest.raises(err, match=words):
            replace(dims, **change).validate()


def test_construction_errors(ctx, tmp_path) -> None:
    cfg = HighSpeedSwapConfig(tmp_path, 1000, 8, 32, 1, False, 1)
    with pytest.raises(HssError, match=r"the backing store needs 1048576 bytes \(2 layers x 8 pages x 65536 bytes\) "
                                       r"but HighSpeedSwapConfig.bytes is 1000"):
        HighSpeedSwap(ctx, cfg, ModelDims(2, 8, 32, 8, 128, 16))
    with pytest.raises(TypeError, match="new_on_stream takes a stream"):
        HighSpeedSwap(ctx.stream, cfg, ModelDims(2, 8, 32, 8, 128, 16))
    with pytest.raises(TypeError, match="cfg must be a HighSpeedSwapConfig"):
        HighSpeedSwap(ctx, dataclasses.asdict(cfg), ModelDims(2, 8, 32, 8, 128, 16))


# -- streamed == in-HBM ------------------------------------------------------------------------
@pytest.mark.parametrize("store,direct", STORES, ids=STORE_IDS)
def test_streamed_equals_in_hbm_with_forced_eviction(ctx, tmp_path, rng, store: str, direct) -> None:
    """The original's e2e (32 pages, 8 scratch slots, forced eviction), two layers sharing the pool."""
    s = Setup(ctx, tmp_path, rng, store, direct, layers=2)
    ids = [s.h.alloc_disk_block() for _ in range(32)]
    order = [int(i) for i in rng.permutation(ids)]          # token order need not follow id order
    for layer in (0, 1):
        s.offload(layer, ids)
    evictions = 0
    for n, layer in enumerate(LAYER_STEPS):
        q, q_dev = s.query()
        rec, got = s.step(layer, order, q_dev)
        check_step(s, layer, order, q, q_dev, rec, got, 16, f"{store} step {n} (layer {layer})")
        assert len(rec.misses) >= 32 - s.h.resident_capacity and len(rec.promoted) <= s.h.resident_capacity
        assert all(s.h.pool.key_of(slot) == (layer, b) or (layer, b) not in s.h.pool.residents()
                   for b, slot in rec.promoted)
        evictions += len(rec.evicted)
        q_dev.close()
    assert evictions > 0, "the test must force evictions"
    diag = s.h.diagnostic_summary()
    steps = len(LAYER_STEPS)
    assert diag.steps == steps and diag.hits + diag.misses == steps * 32 and diag.evictions == evictions
    assert diag.bytes_read == diag.misses * s.h.layout.block_bytes and diag.resident_pages == 4
    assert diag.read_stall_ms >= 0 and diag.host_read_ms > 0 and diag.score_wait_ms > 0
    assert diag.store.startswith(store) and diag.scratch_pool_resident == 8 and diag.scratch_pool_free == 0
    assert (diag.num_layers, diag.active_disk_blocks, diag.disk_block_capacity) == (2, 32, 40)
    assert 0 < diag.hit_rate < 1
    s.close()


@pytest.mark.parametrize("store", ["host", "file"])
def test_eviction_follows_predictor_scores(ctx, tmp_path, rng, store: str) -> None:
    """Cold step: the best-scoring pages fill the resident set. Next query: lower-scoring residents are
    evicted lowest first, each for a streamed page scoring at least as high, until the set is the top pages."""
    s = Setup(ctx, tmp_path, rng, store, resident_blocks=12, tile=2, max_blocks=24)     # 8 resident slots
    ids = list(range(20))
    s.offload(0, ids)
    R = s.h.resident_capacity
    q1, q1_dev = s.query()
    rec1, _ = s.step(0, ids, q1_dev)
    # the scores are the predictor's own: the same kernels run directly give the same bits
    q_proj, scores = cm.DeviceBuffer(2 * 32 * 32), cm.DeviceBuffer(4 * 20)
    s.h.predictor.project_q_on_stream(s.stream, q1_dev, q_proj)
    s.h.predictor.score_layer_on_stream(s.stream, q_proj, 0, 0, 20, scores)
    direct = download(scores, 20, np.float32, s.stream)
    assert [rec1.scores[b] for b in ids] == direct.tolist() and len(set(direct.tolist())) == 20
    top = sorted(ids, key=lambda b: -rec1.scores[b])[:R]
    assert rec1.hits == () and set(b for b, _ in rec1.promoted) == set(top) and rec1.evicted == ()
    assert set(p for _, p in s.h.pool.residents()) == set(top)
    total = 0
    for _ in range(4):
        q, q_dev = s.query()
        before = {p: s.h.eviction.last_score[slot] for (_, p), slot in s.h.pool.residents().items()}
        rec, got = s.step(0, ids, q_dev)
        check_step(s, 0, ids, q, q_dev, rec, got, 16, "eviction step")
        sc = rec.scores
        assert set(rec.hits) == set(before)
        evicted = [page for (_, page), _ in rec.evicted]
        assert [sc[p] for p in evicted] == sorted(sc[p] for p in evicted), "lowest score evicted first"
        for (page, _slot), (old, _) in zip(rec.promoted, rec.evicted):
            assert sc[old[1]] <= sc[page]
        resident = set(p for _, p in s.h.pool.residents())
        assert resident == set(sorted(ids, key=lambda b: -sc[b])[:R]), "the resident set is the top-scoring pages"
        total += len(evicted)
        q_dev.close()
    assert total > 0
    for b in (q1_dev, q_proj, scores):
        b.close()
    s.close()


@pytest.mark.parametrize("last", ["streamed", "resident"])
@pytest.mark.parametrize("store", ["host", "file"])
def test_partial_last_page(ctx, tmp_path, rng, store: str, last: str) -> None:
    """The last page's valid slots, whether it streams (scored lowest: never resident) or is resident (scored
    highest: promoted on the first step); any other page's position in its tile gets full pages."""
    s = Setup(ctx, tmp_path, rng, store, resident_blocks=8, tile=1, max_blocks=12,
              dims=dict(num_q_heads=8, num_kv_heads=2, head_dim=128, block_size=16))
    ids = [7, 2, 9, 0, 4, 11, 5]
    s.offload(0, ids)
    q, q_dev = s.query()
    # the predictor scores max over q heads and tokens: K along the sum of each kv head's queries ranks page 5
    # first; K a thousand times smaller than the other pages' ranks it last
    if last == "resident":
        k5 = (0.25 * q.astype(np.float32).reshape(2, 4, 128).sum(1))[None].repeat(16, 0).astype(BF16)
    else:
        k5 = randn(rng, (16, 2, 128), 1e-3 * s.std)
    s.offload(0, [5], k=k5)
    for n, (kw, lbvs) in enumerate([(dict(q_pos=6 * 16 + 4), 5), (dict(q_pos=6 * 16 + 4), 5),
                                    (dict(last_block_valid_slots=16), 16), (dict(last_block_valid_slots=1), 1),
                                    (dict(last_block_valid_slots=0), 0), (dict(last_block_valid_slots=-2), -2),
                                    (dict(q_pos=15, last_block_valid_slots=16), 16), (dict(), 16)]):
        rec, got = s.step(0, ids, q_dev, **kw)
        assert (5 in rec.hits) == (last == "resident" and n > 0)
        check_step(s, 0, ids, q, q_dev, rec, got, lbvs, f"{kw} (last page {last})")
    q_dev.close()
    s.close()


@pytest.mark.parametrize("block_size,head_dim", [(8, 128), (16, 64)])
@pytest.mark.parametrize("store", ["host", "file"])
def test_padded_stripes(ctx, tmp_path, rng, store: str, block_size: int, head_dim: int) -> None:
    """2 KiB stripes padded to 4 KiB in the stores and in the scratch: the kernel's strides follow."""
    s = Setup(ctx, tmp_path, rng, store, resident_blocks=7, tile=2, max_blocks=16,
              dims=dict(num_q_heads=8, num_kv_heads=4, head_dim=head_dim, block_size=block_size))
    assert s.h.layout.group_bytes == 2048 and s.h.layout.group_stride == 4096
    ids = [3, 1, 4, 15, 9, 2, 6, 5, 8]
    s.offload(0, ids)
    for _ in range(2):
        q, q_dev = s.query()
        rec, got = s.step(0, ids, q_dev, q_pos=8 * block_size + 2)
        check_step(s, 0, ids, q, q_dev, rec, got, 3, f"bs {block_size} hd {head_dim}")
        q_dev.close()
    s.close()


@pytest.mark.emulator
def test_a_missing_cross_stream_wait_changes_results(ctx, tmp_path, rng, monkeypatch) -> None:
    """Without the events between the copy stream and the attention stream the emulator (which runs a
    stream's work only when something waits for it) attends pages that were never loaded."""
    s = Setup(ctx, tmp_path, rng, "host", resident_blocks=6, tile=2, max_blocks=10,
              dims=dict(num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16))
    ids = list(range(8))
    s.offload(0, ids)
    q, q_dev = s.query()
    rec, got = s.step(0, ids, q_dev)
    check_step(s, 0, ids, q, q_dev, rec, got, 16, "with the waits")
    monkeypatch.setattr(cm, "stream_wait_event", lambda stream, event: None)
    rec, got = s.step(0, ids, q_dev)
    assert not np.array_equal(got.view(np.uint16), replay(s, 0, rec, q_dev).view(np.uint16))
    monkeypatch.undo()
    s.close()


def test_queue_order_reads_first_host_waits_late(ctx, tmp_path, rng, monkeypatch) -> None:
    """The first two tiles' reads are issued before anything else of the step, and everything not needing the
    scores (the resident tile, tile 0) is queued before the host waits for them; then reads stay two ahead."""
    s = Setup(ctx, tmp_path, rng, "host", resident_blocks=6, tile=1, max_blocks=10,
              dims=dict(num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16))
    ids = list(range(8))
    s.offload(0, ids)
    q, q_dev = s.query()
    s.step(0, ids, q_dev)                                     # fills the resident set: 4 hits, 4 streamed tiles
    order: list[str] = []

    def trace(obj, name: str, label: str) -> None:
        real = getattr(obj, name)
        monkeypatch.setattr(obj, name, lambda *a, **kw: (order.append(label), real(*a, **kw))[1])

    trace(s.h.attn, "step_tile", "attend")
    trace(s.h.attn, "_next_tile", "attend")
    trace(s.h._step.ev_scores, "synchronize", "wait")
    trace(PreparedReads, "issue", "read")
    rec, got = s.step(0, ids, q_dev)
    assert [t.streamed for t in rec.tiles] == [False, True, True, True, True]
    assert order == ["read", "read", "attend", "attend", "wait", "read", "attend", "read", "attend", "attend"]
    monkeypatch.undo()
    check_step(s, 0, ids, q, q_dev, rec, got, 16, "reordered step")
    q_dev.close()
    s.close()


def test_a_step_failing_before_its_score_wait_leaves_the_next_exact(ctx, tmp_path, rng, monkeypatch) -> None:
    """A step that fails after queueing its tables and some attention: the next step waits for that upload before
    refilling the pinned tables, and is exact."""
    s = Setup(ctx, tmp_path, rng, "host", resident_blocks=6, tile=1, max_blocks=10,
              dims=dict(num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16))
    ids = list(range(8))
    s.offload(0, ids)
    q, q_dev = s.query()
    s.step(0, ids, q_dev)

    def broken(stream) -> None:
        raise HssError("injected")

    monkeypatch.setattr(s.h._step.timer, "begin", broken)    # fails at tile 0, after the resident tile
    with pytest.raises(HssError, match="injected"):
        s.step(0, ids, q_dev)
    monkeypatch.undo()
    assert s.h._step.tables_pending
    for _ in range(2):
        rec, got = s.step(0, ids[::-1], q_dev)
        check_step(s, 0, ids[::-1], q, q_dev, rec, got, 16, "after a failed step")
    q_dev.close()
    s.close()


# -- offload, ids, errors ----------------------------------------------------------------------
@pytest.mark.parametrize("store", ["host", "file"])
def test_reoffload_and_freed_ids_never_serve_stale_pages(ctx, tmp_path, rng, store: str) -> None:
    s = Setup(ctx, tmp_path, rng, store, resident_blocks=6, tile=1, max_blocks=8,
              dims=dict(num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16))
    ids = [s.h.alloc_disk_block() for _ in range(6)]
    s.offload(0, ids)
    q, q_dev = s.query()
    rec, _ = s.step(0, ids, q_dev)
    resident = [b for b, _ in rec.promoted]
    s.offload(0, resident[:1])                            # new data for a resident page: it must be re-read
    rec, got = s.step(0, ids, q_dev)
    assert resident[0] in rec.misses
    check_step(s, 0, ids, q, q_dev, rec, got, 16, "after re-offload")
    s.offload(0, ids[:2], predict=False)                  # no projection: stale scores, data still exact
    rec, got = s.step(0, ids, q_dev)
    check_step(s, 0, ids, q, q_dev, rec, got, 16, "no-predict offload")
    victim = resident[1]
    s.h.inc_ref(victim)
    assert s.h.dec_ref(victim) is False and s.h.dec_ref(victim) is True
    assert (0, victim) not in s.h.pool.residents() and s.h.disk_free_count() == 3
    with pytest.raises(StoreError, match=rf"layer 0 blocks \[{victim}\] were never offloaded"):
        s.step(0, ids, q_dev)
    assert s.h.alloc_disk_block() == victim
    s.offload(0, [victim])
    rec, got = s.step(0, ids, q_dev)
    check_step(s, 0, ids, q, q_dev, rec, got, 16, "recycled id")
    rec, got = s.step(0, [], q_dev)                       # no pages: l == 0, the output is 0
    assert rec.tiles == () and not got.view(np.uint16).any()
    s.close()


@pytest.mark.parametrize("direct", [None, False])
def test_a_read_error_mid_step_names_the_page_and_the_swap_recovers(ctx, tmp_path, rng, direct) -> None:
    """A layer file truncated under the store: the step fails at the first page it cannot read (after earlier
    tiles were queued); the pool keeps only pages whose copies were queued; rewriting the pages heals it."""
    s = Setup(ctx, tmp_path, rng, "file", direct, resident_blocks=6, tile=2, max_blocks=16,
              dims=dict(num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16))
    ids = list(range(12))
    s.offload(0, ids)
    q, q_dev = s.query()
    os.truncate(layer_path(s.cfg.dir, 0), 9 * s.h.layout.block_bytes + 5000)
    with pytest.raises(StoreIOError, match=r"layer 0 page 9 \(K stripe of kv_head 1\): short read"):
        s.step(0, ids, q_dev)
    for (layer, page), slot in s.h.pool.residents().items():       # promoted pages were all readable
        assert page < 9 and s.h.pool.lookup((layer, page)) == slot
    s.offload(0, ids)                                               # pwrite extends the file again
    for _ in range(2):
        rec, got = s.step(0, ids, q_dev)
        check_step(s, 0, ids, q, q_dev, rec, got, 16, "after the read error")
    assert s.h.diagnostic_summary().steps == 2
    q_dev.close()
    s.close()


DEVICE_WORK = ("cuLaunchKernel", "cuMemcpyHtoDAsync", "cuMemcpyDtoHAsync", "cuMemcpyDtoDAsync", "cuMemcpyBatchAsync",
               "cuMemsetD8Async", "cuMemsetD32Async", "cuEventRecord", "cuStreamWaitEvent")


def record_device_work(monkeypatch) -> list[str]:
    """Every driver call that queues device work or orders streams, recorded at the driver seam (then made)."""
    calls: list[str] = []
    for name in DEVICE_WORK:
        real = getattr(_driver.api, name)
        monkeypatch.setattr(_driver.api, name, lambda *a, _r=real, _n=name: (calls.append(_n), _r(*a))[1])
    return calls


def test_argument_errors_queue_nothing(ctx, tmp_path, rng, monkeypatch) -> None:
    s = Setup(ctx, tmp_path, rng, "host", resident_blocks=4, tile=1, max_blocks=8,
              dims=dict(num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16))
    s.offload(0, [0, 1, 2])
    q, q_dev = s.query()
    kpage = upload(s.k[0, 0], s.stream)
    cm.stream_sync(s.stream)
    launched = record_device_work(monkeypatch)
    small = cm.DeviceBuffer(64)
    for call, err, words in [
        (lambda: s.step(0, [0, 1, 0, 2, 1], q_dev), HssError, r"seq_block_ids repeats block ids \[0, 1\]"),
        (lambda: s.step(0, [0, 8], q_dev), HssError, r"seq_block_ids holds \[8\], out of range 0..7"),
        (lambda: s.step(0, [-1, 3], q_dev), HssError, r"seq_block_ids holds \[-1\], out of range 0..7"),
        (lambda: s.step(0, [3, -1], q_dev), HssError, r"seq_block_ids holds \[-1\], out of range 0..7"),
        (lambda: s.step(0, [5, 2, 5], q_dev), HssError, r"seq_block_ids repeats block ids \[5\]"),
        (lambda: s.step(0, [[0, 1]], q_dev), HssError, "1-D"),
        (lambda: s.step(0, [0.0], q_dev), TypeError, "seq_block_ids must hold ints"),
        (lambda: s.step(1, [0], q_dev), HssError, "layer 1 is out of range: the model has 1 layers"),
        (lambda: s.step(0, [0, 3], q_dev), StoreError, r"layer 0 blocks \[3\] were never offloaded"),
        (lambda: s.step(0, [0], q_dev, q_pos=3, last_block_valid_slots=3),
         HssError, r"last_block_valid_slots \(3\) disagrees with q_pos 3 .* = 4"),
        (lambda: s.step(0, [0], q_dev, q_pos=-1), HssError, "q_pos must be >= 0"),
        (lambda: s.step(0, [0], q_dev, last_block_valid_slots=2**31), HssError, "int32"),
        (lambda: s.step(0, [0], small), HssError, "q_dev holds 64 bytes but 512 are needed"),
        (lambda: s.h.attend_layer(ctx, 0, [0], q_dev, 0), HssError, "out_dev is a null pointer"),
        (lambda: s.h.offload_block(ctx, 0, 3, kpage, s.k[0, 0], s.v[0, 0, :8]), HssError, "v_host holds 2048 bytes"),
        (lambda: s.h.offload_block(ctx, 0, 3, q_dev, s.k[0, 0], s.v[0, 0]), HssError,
         r"k_block_dev holds 512 bytes but 4096 are needed \(one bf16 \[block_size, num_kv_heads, head_dim\] KV "
         r"page\)"),
        (lambda: s.h.offload_block(ctx, 0, 8, q_dev, s.k[0, 0], s.v[0, 0]), HssError, r"block 8 is out of range 0..7"),
        (lambda: s.h.offload_block(ctx, -1, 0, q_dev, s.k[0, 0], s.v[0, 0]), HssError, "layer -1")]:
        with pytest.raises(err, match=words):
            call()
    assert launched == [] and not s.h.store.page_valid(0, 3)
    s.h.offload_block(ctx, 0, 3, kpage, s.k[0, 0], s.v[0, 0])          # the control: a good call launches
    assert launched == ["cuLaunchKernel"] and s.h.store.page_valid(0, 3)
    monkeypatch.undo()
    kpage.close()
    assert s.h.diagnostic_summary().steps == 0
    s.h.attend_layer_on_stream_with_q_pos(s.stream, 0, [2, 0], q_dev, s.out, 7)
    assert s.h.last_step.tiles[-1].last_block_valid_slots == 7 and s.h.last_step.tiles[-1].block_ids[-1] == 0
    assert "resident" in repr(s.h)
    s.close()
    s.h.close()
    assert s.h.closed and repr(s.h) == "HighSpeedSwap(closed)"
    with pytest.raises(HssError, match="this HighSpeedSwap is closed"):
        s.h.attend_layer(ctx, 0, [0], q_dev, small)
    for b in (small, q_dev):
        b.close()


def test_new_on_stream_and_no_resident_set(ctx, tmp_path, rng) -> None:
    """The original's constructor; with resident_blocks = 2*T every page streams."""
    s = Setup(ctx, tmp_path, rng, "file", resident_blocks=4, tile=2, max_blocks=8,
              dims=dict(num_q_heads=4, num_kv_heads=1, head_dim=64, block_size=16))
    s.h.close()
    s.h = HighSpeedSwap.new_on_stream(ctx.stream, s.cfg, s.model)
    assert s.h.resident_capacity == 0
    ids = [4, 0, 6, 1, 7]
    s.offload(0, ids)
    q, q_dev = s.query()
    for _ in range(2):
        rec, got = s.step(0, ids, q_dev, q_pos=4 * 16 + 9)
        assert rec.hits == () and rec.promoted == () and all(t.streamed for t in rec.tiles)
        check_step(s, 0, ids, q, q_dev, rec, got, 10, "stream only")
    q_dev.close()
    s.close()


# -- hostile arguments ---------------------------------------------------------------------------
class ReadOnlyCAI:
    """A read-only CUDA array interface over ``nbytes`` of ``buf`` (bytes: the interface has no bf16)."""

    def __init__(self, buf: cm.DeviceBuffer, nbytes: int) -> None:
        self.__cuda_array_interface__ = dict(version=3, shape=(nbytes,), typestr="|u1", data=(buf.ptr, True),
                                             strides=None, stream=None)


def test_config_and_dims_convert_numpy_ints_and_refuse_others(tmp_path) -> None:
    """Fields become Python ints at construction (np.int32 never wraps later); float, bool, str, NaN are a
    TypeError naming the field; validate() keeps its range checks."""
    cfg = HighSpeedSwapConfig(tmp_path, np.int64(1 << 40), np.int32(8), np.uint8(32), np.int16(4), False,
                              np.uint64(2**64 - 1), stream_tile_blocks=np.int8(2))
    assert all(type(getattr(cfg, f)) is int for f in ("bytes", "resident_blocks", "rank", "qd", "projection_seed",
                                                      "stream_tile_blocks"))
    assert cfg.projection_seed == 2**64 - 1 and cfg.tile_blocks == 2
    cfg.validate()
    dims = ModelDims(*(np.int32(v) for v in (2, 40000, 32, 8, 128, 16)))
    assert all(type(getattr(dims, f.name)) is int for f in dataclasses.fields(dims) if f.name != "model_fp")
    # 2 layers x 40000 pages x 64 KiB: an np.int32 product would wrap
    with pytest.raises(HssError, match=r"the backing store needs 5242880000 bytes \(2 layers x 40000 pages"):
        HighSpeedSwap(cm.CudaCtx(0), replace(cfg, bytes=1 << 20), dims)
    good = dict(dir=tmp_path, bytes=1 << 20, resident_blocks=8, rank=32, qd=4, graph=False, projection_seed=7)
    for change, words in [(dict(bytes=True), "HighSpeedSwapConfig.bytes must be an int, got bool"),
                          (dict(resident_blocks=8.0), "HighSpeedSwapConfig.resident_blocks must be an int, got float"),
                          (dict(rank=float("nan")), "HighSpeedSwapConfig.rank must be an int, got float nan"),
                          (dict(qd="4"), "HighSpeedSwapConfig.qd must be an int, got str"),
                          (dict(projection_seed=np.float64(1)), "HighSpeedSwapConfig.projection_seed must be an int"),
                          (dict(stream_tile_blocks=2.0), "HighSpeedSwapConfig.stream_tile_blocks must be an int"),
                          (dict(stream_tile_blocks=np.bool_(True)), "stream_tile_blocks must be an int, got bool")]:
        with pytest.raises(TypeError, match=words):
            HighSpeedSwapConfig(**{**good, **change})
    for i, name in enumerate(("num_layers", "max_blocks_per_layer", "num_q_heads", "num_kv_heads", "head_dim",
                              "block_size")):
        for bad, kind in ((2.0, "float"), (True, "bool"), ("2", "str"), (float("nan"), "float")):
            args = [2, 64, 32, 8, 128, 16]
            args[i] = bad
            with pytest.raises(TypeError, match=rf"ModelDims.{name} must be an int, got {kind}"):
                ModelDims(*args)


def test_hostile_arguments_raise_before_any_device_work(ctx, tmp_path, rng, monkeypatch) -> None:
    """Every entry point: a wrong type is a TypeError naming the parameter, a closed, too small, misaligned,
    read-only, host or wrongly typed buffer an HssError naming it; nothing reaches the device, nothing changes."""
    s = Setup(ctx, tmp_path, rng, "host", resident_blocks=4, tile=1, max_blocks=8,
              dims=dict(num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16))
    s.offload(0, [0, 1, 2])
    q, q_dev = s.query()
    kpage = upload(s.k[0, 0], s.stream)
    closed, small, pinned = cm.DeviceBuffer(512), cm.DeviceBuffer(64), cm.PinnedBuffer(64)
    closed.close()
    pinned.close()
    f32 = s.out.view(np.float32)
    cm.stream_sync(s.stream)
    work = record_device_work(monkeypatch)
    h, k, v = s.h, s.k[0, 0], s.v[0, 0]
    step = lambda *a, **kw: h.attend_layer(ctx, *a, **kw)                     # noqa: E731
    for call, err, words in [
        (lambda: step(0.0, [0], q_dev, s.out), TypeError, "layer must be an int, got float 0.0"),
        (lambda: step(True, [0], q_dev, s.out), TypeError, "layer must be an int, got bool"),
        (lambda: step("0", [0], q_dev, s.out), TypeError, "layer must be an int, got str"),
        (lambda: step(float("nan"), [0], q_dev, s.out), TypeError, "layer must be an int, got float nan"),
        (lambda: step(0, [0, float("nan")], q_dev, s.out), TypeError, "seq_block_ids must hold ints, got float64"),
        (lambda: step(0, [True, False], q_dev, s.out), TypeError, "seq_block_ids must hold ints, got bool"),
        (lambda: step(0, "01", q_dev, s.out), TypeError, "seq_block_ids must hold ints"),
        (lambda: step(0, [0, None], q_dev, s.out), TypeError, "seq_block_ids must hold ints, got object"),
        (lambda: step(0, [0], q_dev, s.out, 3.0), TypeError, "last_block_valid_slots must be an int, got float"),
        (lambda: step(0, [0], q_dev, s.out, True), TypeError, "last_block_valid_slots must be an int, got bool"),
        (lambda: step(0, [0], q_dev, s.out, q_pos=float("nan")), TypeError, "q_pos must be an int, got float nan"),
        (lambda: step(0, [0], q_dev, s.out, q_pos="3"), TypeError, "q_pos must be an int, got str"),
        (lambda: h.attend_layer_on_stream(None, 0, [0], q_dev, s.out), TypeError, "stream: a stream is required"),
        (lambda: h.attend_layer_on_stream(1.5, 0, [0], q_dev, s.out), TypeError, "stream: a stream is required"),
        (lambda: h.attend_layer("ctx", 0, [0], q_dev, s.out), TypeError, "ctx: a stream is required"),
        (lambda: step(0, [0], closed, s.out), HssError, "q_dev is a closed DeviceBuffer"),
        (lambda: step(0, [0], q_dev, closed), HssError, "out_dev is a closed DeviceBuffer"),
        (lambda: step(0, [0], q_dev, small), HssError,
         r"out_dev holds 64 bytes but 512 are needed \(a bf16 \[num_q_heads, head_dim\] output\)"),
        (lambda: step(0, [0], q_dev, small.ptr), HssError,
         "out_dev: 512 bytes at offset 0 run past the end of its 64-byte buffer"),
        (lambda: step(0, [0], q_dev, s.out.ptr + 1), HssError, "out_dev .* must be 2-byte aligned"),
        (lambda: step(0, [0], q_dev, ReadOnlyCAI(s.out, 512)), HssError, "out_dev is read-only but is written"),
        (lambda: step(0, [0], q_dev, np.zeros(256, BF16)), HssError, "out_dev is a host numpy array"),
        (lambda: step(0, [0], f32, s.out), HssError, "q_dev holds f32 but bf16 is needed"),
        (lambda: step(0, [0], 2.5, s.out), TypeError, "q_dev: cannot use float"),
        (lambda: step(0, [0], None, s.out), TypeError, "q_dev: cannot use NoneType"),
        (lambda: h.offload_block(ctx, 0, 1.0, kpage, k, v), TypeError, "block must be an int, got float"),
        (lambda: h.offload_block(ctx, 0, True, kpage, k, v), TypeError, "block must be an int, got bool"),
        (lambda: h.offload_block(ctx, "0", 3, kpage, k, v), TypeError, "layer must be an int, got str"),
        (lambda: h.offload_block(ctx, 0, 3, closed, k, v), HssError, "k_block_dev is a closed DeviceBuffer"),
        (lambda: h.offload_block(ctx, 0, 3, small, k, v), HssError, "k_block_dev holds 64 bytes but 4096"),
        (lambda: h.offload_block(ctx, 0, 3, kpage, kpage, v), HssError, "k_host is device memory"),
        (lambda: h.offload_block(ctx, 0, 3, kpage, "abc", v), TypeError, "k_host must be a host buffer"),
        (lambda: h.offload_block(ctx, 0, 3, kpage, k, 7), TypeError, "v_host must be host data .* not an address"),
        (lambda: h.offload_block(ctx, 0, 3, kpage, pinned, v), HssError, "k_host is a closed PinnedBuffer"),
        (lambda: h.offload_block(ctx, 0, 3, kpage, k, np.asfortranarray(v.reshape(16, 128))), HssError,
         "v_host must be C-contiguous"),
        (lambda: h.offload_block_on_stream(None, 0, 3, kpage, k, v), TypeError, "stream: a stream is required"),
        (lambda: h.offload_block_no_predict_on_stream("s", 0, 3, k, v), TypeError, "stream: a stream is required"),
        (lambda: h.offload_block_no_predict_on_stream(s.stream, 0, 3.0, k, v), TypeError, "block must be an int"),
        (lambda: h.inc_ref(0.5), TypeError, "block must be an int, got float"),
        (lambda: h.dec_ref(True), TypeError, "block must be an int, got bool")]:
        with pytest.raises(err, match=words):
            call()
        assert work == [], f"{words}: device work was queued before the error"
    assert not h.store.page_valid(0, 3) and h.diagnostic_summary().steps == 0 and h.last_step is None
    # numpy integers are ids like any other
    s.k[0, 3], s.v[0, 3], s.k[0, 4], s.v[0, 4] = k, v, k, v          # the host truth of what is offloaded
    h.offload_block(ctx, np.int32(0), np.uint16(3), kpage, k, v)
    h.offload_block_no_predict_on_stream(s.stream, np.int64(0), np.uint8(4), k, v)
    assert h.store.page_valid(0, 3) and h.store.page_valid(0, 4)
    rec = step(np.int64(0), np.array([2, 0, 3], np.int32), q_dev, s.out, np.int16(7))
    assert rec.layer == 0 and type(rec.layer) is int and rec.tiles[-1].last_block_valid_slots == 7
    rec = step(np.uint8(0), np.array([4, 1], np.uint64), q_dev, s.out, q_pos=np.int64(16 + 2))
    assert rec.tiles[-1].block_ids[-1] == 1 and rec.tiles[-1].last_block_valid_slots == 3
    monkeypatch.undo()
    check_step(s, 0, [4, 1], q, q_dev, rec, download(s.out, (4, 64), BF16, s.stream), 3, "numpy ids")
    s.close()
    for call in (lambda: h.alloc_disk_block(), lambda: h.inc_ref(0), lambda: h.dec_ref(0),
                 lambda: h.offload_block(ctx, 0, 3, kpage, k, v), lambda: step(0, [0], q_dev, s.out)):
        with pytest.raises(HssError, match="this HighSpeedSwap is closed"):
            call()
    for b in (kpage, small, q_dev):
        b.close()


# -- own memory, page forms, cleanup -------------------------------------------------------------------------
def test_pointers_into_the_swaps_memory_and_mistyped_pages_are_refused(ctx, tmp_path, rng, monkeypatch) -> None:
    """out_dev (and q_dev, k_block_dev) may not point into memory the swap owns -- the scratch pool (a resident page
    would be overwritten and later steps attend the damaged page), the predictor's A_g, the attention state, its
    tables -- nor may out_dev overlap q_dev; a host page carrying a dtype or shape must be bf16 NHD. All refused
    before any device work; the next step is exact."""
    s = Setup(ctx, tmp_path, rng, "host", resident_blocks=4, tile=1, max_blocks=8,
              dims=dict(num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16))
    s.offload(0, [0, 1, 2])
    q, q_dev = s.query()
    s.step(0, [0, 1, 2], q_dev)
    kpage = upload(s.k[0, 0], s.stream)
    cm.stream_sync(s.stream)
    h, k, v = s.h, s.k[0, 0], s.v[0, 0]
    resident = next(iter(h.pool.residents().values()))
    both = cm.DeviceBuffer(1024)
    work = record_device_work(monkeypatch)
    for call, words in [
        (lambda: h.attend_layer(ctx, 0, [0], q_dev, h.pool.slot_ptr(resident)), "out_dev .* overlaps the scratch pool, "
         "memory that this HighSpeedSwap owns"),
        (lambda: h.attend_layer(ctx, 0, [0], q_dev, h.predictor._a_g), "out_dev .* overlaps the predictor's A_g store"),
        (lambda: h.attend_layer(ctx, 0, [0], q_dev, h.attn.o), "out_dev .* overlaps the tiled attention's state"),
        (lambda: h.attend_layer(ctx, 0, [0], h.pool.slot_ptr(h.pool.num_slots - 1), s.out), "q_dev .* overlaps the "
         "scratch pool"),
        (lambda: h.attend_layer(ctx, 0, [0], both.ptr, both.ptr + 256), r"attend_layer: out_dev overlaps q_dev"),
        (lambda: h.offload_block(ctx, 0, 3, h.predictor._a_g, k, v), "k_block_dev .* overlaps the predictor's A_g"),
        (lambda: h.offload_block(ctx, 0, 3, kpage, k.astype(np.float16), v), r"k_host holds f16 but a KV page is bf16 "
         r"\[16, 2, 64\]"),
        (lambda: h.offload_block(ctx, 0, 3, kpage, k, v.astype(np.float32)[:8]), "v_host holds f32 but a KV page"),
        (lambda: h.offload_block(ctx, 0, 3, kpage, np.ascontiguousarray(k.transpose(1, 0, 2)), v),
         r"k_host has shape \[2, 16, 64\] but a KV page is NHD \[block_size, num_kv_heads, head_dim\] = \[16, 2, 64\]"),
        (lambda: h.offload_block(ctx, 0, 3, kpage, k, v.reshape(16, 128)), r"v_host has shape \[16, 128\]"),
        (lambda: h.offload_block_no_predict_on_stream(s.stream, 0, 3, k.view(np.int16), v), "k_host holds i16")]:
        with pytest.raises(HssError, match=words):
            call()
        assert work == [], f"{words}: device work was queued before the error"
    assert not h.store.page_valid(0, 3)
    h.offload_block(ctx, 0, 3, kpage, k.view(np.uint16), v.reshape(-1))   # bf16 bits as uint16, a flat page: taken
    s.k[0, 3], s.v[0, 3] = k, v
    monkeypatch.undo()
    rec, got = s.step(0, [0, 1, 2, 3], q_dev)
    check_step(s, 0, [0, 1, 2, 3], q, q_dev, rec, got, 16, "after the refused calls")
    for b in (kpage, q_dev, both):
        b.close()
    s.close()


def test_a_failed_construction_removes_what_it_made(ctx, tmp_path, monkeypatch) -> None:
    """A HighSpeedSwap whose FileStore cannot be preallocated (a full disk) raises the store's OSError and leaves no
    directory or file of its own behind."""
    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    cfg = HighSpeedSwapConfig(tmp_path / "a" / "b", 1 << 30, 4, 32, 2, False, SEED, stream_tile_blocks=1)
    with pytest.raises(OSError, match="FileStore: cannot preallocate .* layer 0's file"):
        HighSpeedSwap(ctx, cfg, ModelDims(2, 8, 4, 2, 64, 16))
    assert list(tmp_path.iterdir()) == []


def test_bench_smoke_measures_the_disk_floor(tmp_path) -> None:
    """``python -m hss.bench swap --smoke``: the disk probe (threads x request sizes, the best kept) runs in the same
    run, the FileStore step reads with the best configuration and is reported against max(disk, H2D, copy) floors;
    every streamed step equals its in-HBM replay (numbers meaningless on the emulator)."""
    from hss.bench import swap as bench
    rows = bench.run(bench.parse_args(["--smoke", "--dir", str(tmp_path)]))
    disks = [r for r in rows if "disk" in r]
    assert len(disks) == 2 and all(len(r["disk"]["runs"]) == 4 for r in disks)
    for r in disks:
        assert r["disk"]["best"] == max(r["disk"]["runs"], key=lambda x: x[2]) and r["GB/s"] > 0
    files = [r for r in rows if r.get("store") == "file"]
    assert len(files) == 2 and all(r["replay_equal"] for r in rows if "replay_equal" in r)
    best = disks[0]["disk"]["best"]
    assert f"{best[0]} threads x" in files[0]["note"] and files[0]["floor_bound"] in ("disk", "H2D", "device copy")
    text = bench.table(rows)
    assert "FileStore step within 1.25x of its floor" in text and "HostStore step within 1.25x" in text
    assert list(tmp_path.iterdir()) == [], "the probe file and the store's files are removed"
    # the sparse mode's rows: both query modes at each length, beside the exact HostStore step, replayed bitwise
    sparse = [r for r in rows if "sparse" in r]
    assert [(r["tokens"], r["sparse"]) for r in sparse] == [(n, m) for n in ("256", "512")
                                                             for m in ("same query", "new query")]
    for r in sparse:
        assert r["replay_equal"] and 0 <= r["hit_rate"] <= 1 and r["skipped"] > 0 and r["ratio"] > 0
        exact = next(x for x in rows if x.get("store") == "host" and x["tokens"] == r["tokens"])
        assert np.isclose(r["ratio"], r["us"] / exact["us"]) and "first 1 / recent 4" in r["variant"]
    assert "sparse step (budget 2 + first 1 / recent 4, a new query each step) within 0.2x" in text


# -- the sparse mode (docs/design.md §17.6) ----------------------------------------------------------------------------
def model_attended(ids: list[int], scores: list[float], budget: int, first: int, recent: int) -> list[int]:
    """docs/design.md §17.6 in plain Python: the first ``first`` and last ``recent`` pages, then the ``budget`` others
    ranked by (score descending, earlier page first; NaN below every number), in sequence order."""
    n = len(ids)
    forced = set(range(min(first, n))) | set(range(max(n - recent, 0), n))
    others = sorted((i for i in range(n) if i not in forced),
                    key=lambda i: (np.isnan(scores[i]), 0.0 if np.isnan(scores[i]) else -scores[i], i))
    return [ids[i] for i in sorted(forced | set(others[:budget]))]


def predictor_scores(s: Setup, layer: int, q_dev, ids: list[int]) -> np.ndarray:
    """The swap's predictor kernels run directly over pages 0..max(ids) of ``layer``: the scores of ``ids``."""
    d, r = s.model, s.h.config.rank
    n = max(ids) + 1
    q_proj, scores = cm.DeviceBuffer(2 * d.num_q_heads * r), cm.DeviceBuffer(4 * n)
    s.h.predictor.project_q_on_stream(s.stream, q_dev, q_proj)
    s.h.predictor.score_layer_on_stream(s.stream, q_proj, layer, 0, n, scores)
    got = download(scores, n, np.float32, s.stream)[ids]
    q_proj.close()
    scores.close()
    return got


def count_reads(monkeypatch, s: Setup) -> list[int]:
    """Every page the swap's store is asked to read (its planned reads, the checked prepare_reads' core), in
    order."""
    pages: list[int] = []
    real = s.h.store.plan_reads

    def prepare(layer, p, *rest, **kw):
        pages.extend(np.asarray(p).tolist())
        return real(layer, p, *rest, **kw)
    monkeypatch.setattr(s.h.store, "plan_reads", prepare)
    return pages


def check_sparse(s: Setup, layer: int, ids: list[int], q, q_dev, rec: StepRecord, got: np.ndarray, lbvs: int,
                 sparse: tuple[int, int, int], what: str) -> list[int]:
    """The recorded scores are the predictor's own (bitwise); the attended set is docs/design.md §17.6's over them, the
    rest recorded as skipped; the tiles cover exactly the attended pages (the last page of the sequence, if attended,
    with ``lbvs``) and equal their in-HBM replay bit for bit; the output meets the bf16 bound against float64 attention
    over exactly those pages (and the bound bites). Returns the attended pages."""
    direct = predictor_scores(s, layer, q_dev, ids)
    assert np.array_equal(rec.block_scores.view(np.uint32), direct.view(np.uint32)), what
    assert rec.block_ids.tolist() == ids and rec.sparse == sparse, what
    want = model_attended(ids, direct.tolist(), *sparse)
    assert list(rec.attended) == want, f"{what}: attended {rec.attended}, docs/design.md §17.6 says {want}"
    assert list(rec.skipped) == [b for b in ids if b not in want], what
    check_step(s, layer, want, q, q_dev, rec, got, lbvs if want and want[-1] == ids[-1] else s.model.block_size,
               what)
    return want


@pytest.mark.parametrize("store", ["host", "file"])
def test_sparse_step_attends_reads_and_keeps_what_spec_says(ctx, tmp_path, rng, monkeypatch, store: str) -> None:
    """Sparse steps (various K / F / R, the last page partial) interleaved with exact ones over 24 pages in a
    permuted order: each attends docs/design.md §17.6's pages and only those, reads exactly the attended pages that were
    not resident, and leaves a resident set that prefers high scores (every resident page scores at least as well as
    every attended page left out of it; a cold step keeps the best attended pages)."""
    s = Setup(ctx, tmp_path, rng, store, resident_blocks=10, tile=2, max_blocks=28)     # 6 resident slots
    ids = [int(b) for b in rng.permutation(24)]
    s.offload(0, ids)
    reads = count_reads(monkeypatch, s)
    bb, R = s.h.layout.block_bytes, s.h.resident_capacity
    plan = [(5, 1, 2), (5, 1, 2), None, (3, 0, 0), (8, 2, 1), (0, 1, 4), (7, 0, 3), None, (4, 3, 3), (0, 0, 0)]
    sparse_steps = skipped = 0
    for n, sparse in enumerate(plan):
        q, q_dev = s.query()
        before = set(p for _, p in s.h.pool.residents())
        diag0 = s.h.diagnostic_summary()
        del reads[:]
        kw = dict(q_pos=23 * 16 + 6)
        if sparse is not None:
            kw.update(budget_pages=sparse[0], keep_first=sparse[1], keep_recent=sparse[2])
        rec, got = s.step(0, ids, q_dev, **kw)
        what = f"{store} step {n} {sparse}"
        if sparse is None:
            check_step(s, 0, ids, q, q_dev, rec, got, 7, what)
            att = ids
            assert rec.skipped == () and rec.sparse is None
        else:
            att = check_sparse(s, 0, ids, q, q_dev, rec, got, 7, sparse, what)
            sparse_steps += 1
            skipped += 24 - len(att)
            assert len(att) == min(24, sparse[0] + sparse[1] + sparse[2])
        assert sorted(reads) == sorted(set(att) - before) == sorted(rec.misses), f"{what}: only misses are read"
        assert set(rec.hits) == set(att) & before
        diag = s.h.diagnostic_summary()
        assert diag.bytes_read - diag0.bytes_read == len(rec.misses) * bb
        sc = rec.scores
        resident = set(p for _, p in s.h.pool.residents())
        assert resident <= set(att) | before and len(resident) == min(R, len(resident | set(att)))
        if resident:
            left_out = [sc[b] for b in att if b not in resident]
            assert min(sc[b] for b in resident) >= max(left_out, default=-np.inf), f"{what}: resident set"
        if n == 0:
            assert resident == set(sorted(att, key=lambda b: (-sc[b], ids.index(b)))[:R]), "cold step keeps the best"
        q_dev.close()
    diag = s.h.diagnostic_summary()
    assert (diag.sparse_steps, diag.skipped, diag.steps) == (sparse_steps, skipped, len(plan))
    assert diag.hits + diag.misses == 24 * len(plan) - skipped
    s.close()


def test_sparse_step_with_a_covering_budget_is_the_exact_step(ctx, tmp_path, rng) -> None:
    """Two swaps holding the same pages: steps whose budget covers every other page (K = n - F - R, and larger) give
    the exact step's bits, tiles, hits and promotions, step after step with evictions; one page less skips exactly
    the lowest-scoring other page."""
    a = Setup(ctx, tmp_path / "a", rng, "host", resident_blocks=8, tile=2, max_blocks=20)
    b = Setup(ctx, tmp_path / "b", rng, "host", resident_blocks=8, tile=2, max_blocks=20)
    ids = [int(x) for x in rng.permutation(18)]
    a.offload(0, ids)
    for p in ids:
        b.k[0, p], b.v[0, p] = a.k[0, p], a.v[0, p]
        kdev = upload(a.k[0, p], b.stream)
        b.h.offload_block(ctx, 0, p, kdev, a.k[0, p], a.v[0, p])
        cm.stream_sync(b.stream)
        kdev.close()
    for n, (k, f, r) in enumerate([(18, 0, 0), (16, 1, 1), (17, 0, 1), (0, 9, 9), (100, 3, 2), (13, 2, 3)]):
        q, q_dev = a.query()
        ra, ga = a.step(0, ids, q_dev, q_pos=17 * 16 + 3)
        rb, gb = b.step(0, ids, q_dev, q_pos=17 * 16 + 3, budget_pages=k, keep_first=f, keep_recent=r)
        assert np.array_equal(ga.view(np.uint16), gb.view(np.uint16)), f"step {n}: not the exact step's bits"
        assert (ra.tiles, ra.hits, ra.misses, ra.promoted, ra.evicted) == (rb.tiles, rb.hits, rb.misses, rb.promoted,
                                                                            rb.evicted)
        assert rb.skipped == () and rb.sparse == (k, f, r) and ra.sparse is None
        q_dev.close()
    assert a.h.diagnostic_summary().evictions > 0
    q, q_dev = a.query()
    rec, got = b.step(0, ids, q_dev, budget_pages=15, keep_first=1, keep_recent=1)   # one other page too few
    others = ids[1:-1]
    worst = max(others, key=lambda p: (-rec.scores[p], others.index(p)))
    assert rec.skipped == (worst,)
    check_sparse(b, 0, ids, q, q_dev, rec, got, 16, (15, 1, 1), "one page skipped")
    assert b.h.diagnostic_summary().sparse_steps == 7
    q_dev.close()
    a.close()
    b.close()


def test_sparse_edge_cases(ctx, tmp_path, rng) -> None:
    """A budget of nothing attends nothing (the empty state's zeros), F + R past the sequence attends it all, an empty
    sequence is the exact empty step, the last page skipped leaves every attended page whole; NaN scores rank last."""
    s = Setup(ctx, tmp_path, rng, "host", resident_blocks=6, tile=1, max_blocks=10,
              dims=dict(num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16))
    ids = [3, 0, 7, 5, 1, 8]
    s.offload(0, ids)
    q, q_dev = s.query()
    rec, got = s.step(0, ids, q_dev, budget_pages=0, keep_first=0, keep_recent=0)
    assert rec.tiles == () and rec.skipped == tuple(ids) and rec.attended == () and not got.view(np.uint16).any()
    rec, got = s.step(0, ids, q_dev, q_pos=5, budget_pages=0, keep_first=4, keep_recent=4)
    assert rec.skipped == () and rec.attended == tuple(ids)
    check_step(s, 0, ids, q, q_dev, rec, got, 6, "F + R past the end")
    rec, got = s.step(0, [], q_dev, budget_pages=2, keep_first=0, keep_recent=1)
    assert rec.tiles == () and rec.skipped == () and not got.view(np.uint16).any()
    # the last page only if it scores
    rec, got = s.step(0, ids, q_dev, q_pos=9, budget_pages=2, keep_first=1, keep_recent=0)
    check_sparse(s, 0, ids, q, q_dev, rec, got, 10, (2, 1, 0), "no recent page")
    # a page whose keys are all NaN scores -inf (the predictor skips NaN dots) and is the one left out
    s.offload(0, [7], k=np.full((16, 2, 64), np.nan, BF16))
    rec, got = s.step(0, [3, 0, 7, 5], q_dev, budget_pages=3, keep_first=0, keep_recent=0)
    assert rec.scores[7] == -np.inf and rec.skipped == (7,)
    check_sparse(s, 0, [3, 0, 7, 5], q, q_dev, rec, got, 16, (3, 0, 0), "a -inf page")
    q_dev.close()
    s.close()


def test_select_pages_is_spec_17_6() -> None:
    """select_pages against the plain-Python rule on scores with ties, -inf and NaN, every K / F / R up to past the
    sequence; the covering budget is every page. select_mask (the step's) is the same pages as a mask."""
    from hss.swap import SparseBudget, select_pages
    from hss.swap.sparse import select_mask
    rng = np.random.default_rng(3)
    for _ in range(60):
        n = int(rng.integers(0, 12))
        scores = rng.choice(np.array([0.0, 1.0, 2.5, -1.0, -np.inf, np.inf, np.nan, -0.0], np.float32), n)
        for k in range(n + 2):
            for f, r in ((0, 0), (1, 0), (0, 1), (1, 4), (3, 2), (n, 1), (2, n + 3)):
                got = select_pages(scores, SparseBudget(k, f, r))
                mask = select_mask(scores, SparseBudget(k, f, r))
                assert mask.dtype == bool and mask.nonzero()[0].tolist() == got.tolist(), (scores, k, f, r)
                assert got.dtype == np.int64
                assert got.tolist() == model_attended(list(range(n)), scores.tolist(), k, f, r), (scores, k, f, r)
                assert SparseBudget(k, f, r).covers(n) == (got.size == n)


def test_sparse_arguments_are_checked_before_any_device_work(ctx, tmp_path, rng, monkeypatch) -> None:
    """budget_pages / keep_first / keep_recent: a non-int (bool, float, str) is a TypeError naming the parameter, a
    negative one or keep_* without budget_pages an HssError; a page never offloaded is a StoreError even where it
    would be skipped; all before any device work. numpy integers are taken."""
    s = Setup(ctx, tmp_path, rng, "host", resident_blocks=4, tile=1, max_blocks=8,
              dims=dict(num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16))
    s.offload(0, [0, 1, 2, 4])
    q, q_dev = s.query()
    cm.stream_sync(s.stream)
    work = record_device_work(monkeypatch)
    for kw, err, words in [
        (dict(budget_pages=-1), HssError, "budget_pages = -1 must be >= 0"),
        (dict(budget_pages=1.0), TypeError, "budget_pages must be an int, got float"),
        (dict(budget_pages=True), TypeError, "budget_pages must be an int, got bool"),
        (dict(budget_pages=np.bool_(False)), TypeError, "budget_pages must be an int, got bool"),
        (dict(budget_pages="2"), TypeError, "budget_pages must be an int, got str"),
        (dict(budget_pages=2, keep_first=-1), HssError, "keep_first = -1 must be >= 0"),
        (dict(budget_pages=2, keep_first=False), TypeError, "keep_first must be an int, got bool"),
        (dict(budget_pages=2, keep_recent=0.5), TypeError, "keep_recent must be an int, got float"),
        (dict(budget_pages=2, keep_recent=-3), HssError, "keep_recent = -3 must be >= 0"),
        (dict(budget_pages=2, keep_recent="4"), TypeError, "keep_recent must be an int, got str"),
        (dict(keep_first=1), HssError, r"keep_first \(1\) and keep_recent \(0\) choose pages of the sparse mode: "
                                       "pass budget_pages too"),
        (dict(keep_recent=2), HssError, "pass budget_pages too"),
        (dict(budget_pages=1, keep_first=1, keep_recent=1, ids=[0, 3, 1, 2]), StoreError,
         r"layer 0 blocks \[3\] were never offloaded"),
        (dict(budget_pages=1, ids=[0, 1, 0]), HssError, "seq_block_ids repeats"),
        (dict(budget_pages=1, q_pos=-1), HssError, "q_pos must be >= 0")]:
        ids = kw.pop("ids", [0, 1, 2])
        with pytest.raises(err, match=words):
            s.h.attend_layer(ctx, 0, ids, q_dev, s.out, **kw)
        assert work == [], f"{words}: device work was queued before the error"
    assert s.h.diagnostic_summary().steps == 0 and s.h.last_step is None
    monkeypatch.undo()
    rec, got = s.step(0, [0, 1, 2, 4], q_dev, budget_pages=np.int64(1), keep_first=np.uint8(1),
                      keep_recent=np.int16(1))
    assert rec.sparse == (1, 1, 1) and type(rec.sparse.budget_pages) is int and len(rec.skipped) == 1
    check_sparse(s, 0, [0, 1, 2, 4], q, q_dev, rec, got, 16, (1, 1, 1), "numpy ints")
    q_dev.close()
    s.close()


def test_a_sparse_step_failing_after_its_score_wait_leaves_the_next_exact(ctx, tmp_path, rng, monkeypatch) -> None:
    """A sparse step that fails after the host waited for its scores (in the page choice, then in its tiles): the
    pool keeps only pages whose copies were queued and the next steps, sparse and exact, are exact."""
    s = Setup(ctx, tmp_path, rng, "host", resident_blocks=6, tile=1, max_blocks=12,
              dims=dict(num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16))
    ids = list(range(10))
    s.offload(0, ids)
    q, q_dev = s.query()
    from hss.swap import plans

    def broken(*a, **kw):
        raise HssError("injected")

    s.h.time_sparse_stalls = True     # (its stall timer is where the tiles fail)
    for obj, name in ((plans, "select_mask"), (s.h._step.timer, "begin")):
        monkeypatch.setattr(obj, name, broken)
        with pytest.raises(HssError, match="injected"):
            s.step(0, ids, q_dev, budget_pages=4, keep_first=1, keep_recent=1)
        monkeypatch.undo()
        for sparse in ((4, 1, 1), None, (3, 0, 2)):
            kw = {} if sparse is None else dict(budget_pages=sparse[0], keep_first=sparse[1], keep_recent=sparse[2])
            rec, got = s.step(0, ids, q_dev, **kw)
            if sparse is None:
                check_step(s, 0, ids, q, q_dev, rec, got, 16, f"exact after a failed sparse step ({name})")
            else:
                check_sparse(s, 0, ids, q, q_dev, rec, got, 16, sparse, f"after a failed sparse step ({name})")
    q_dev.close()
    s.close()


def test_a_projection_per_layer_reaches_the_predictor(ctx, tmp_path, rng) -> None:
    """``HighSpeedSwapConfig(projection=)`` builds the swap's predictor with that P per layer and kv head (``project_q``
    gets the step's layer): the seeded P repeated everywhere gives the default swap's scores and output bits; another
    P gives other scores; ``head_temperature`` reaches the predictor."""
    base = Setup(ctx, tmp_path / "a", np.random.default_rng(5), "host", layers=2, max_blocks=12)
    d = base.model
    p = np.broadcast_to(base.h.predictor.projection, (2, d.num_kv_heads, d.head_dim, 32)).copy()
    same = Setup(ctx, tmp_path / "b", np.random.default_rng(5), "host", layers=2, max_blocks=12, projection=p)
    assert same.h.predictor.layered and not base.h.predictor.layered
    other_p = p.copy()
    other_p[1] = other_p[1, :, ::-1]   # layer 1: the head dims reversed
    other = Setup(ctx, tmp_path / "c", np.random.default_rng(5), "host", layers=2, max_blocks=12, projection=other_p,
                  head_temperature=8.0)
    assert other.h.predictor.head_temperature == 8.0
    q_dev = upload(randn(rng, (d.num_q_heads, d.head_dim), 1.0), base.stream)   # the setups' rngs stay in step
    for s in (base, same, other):
        for layer in (0, 1):
            s.offload(layer, list(range(12)))
    for layer in (0, 1):
        (ra, oa), (rb, ob) = base.step(layer, list(range(12)), q_dev), same.step(layer, list(range(12)), q_dev)
        assert np.array_equal(ra.block_scores.view(np.uint32), rb.block_scores.view(np.uint32))
        assert np.array_equal(oa.view(np.uint16), ob.view(np.uint16))
    rc, _ = other.step(1, list(range(12)), q_dev)
    assert not np.array_equal(rc.block_scores, ra.block_scores)
    q_dev.close()
    for s in (base, same, other):
        s.close()


def resident_bytes_match(s: Setup) -> None:
    """Every page resident in the scratch pool holds exactly its page image (after the step's work ran)."""
    cm.stream_sync(s.stream)
    s.h.copy_stream.synchronize()
    for (layer, page), slot in s.h.pool.residents().items():
        got = download(s.h.pool.slot_ptr(slot), (s.h.layout.block_bytes,), np.uint8, s.stream)
        assert np.array_equal(got, s.h.layout.pack_page(s.k[layer, page], s.v[layer, page])), (layer, page, slot)


def test_sparse_misses_go_out_as_one_batch_per_tile_straight_into_their_slots(ctx, tmp_path, rng,
                                                                              monkeypatch) -> None:
    """A sparse step plans its promotions before its reads: every streamed tile's misses are one batched copy (one
    cuMemcpyBatchAsync per tile), the promoted ones land straight in their resident slots (no device-to-device copy),
    the tables go up in one copy; the resident pages then hold exactly their bytes, and promotions follow the rule
    (the best attended misses, replacing the lowest-scoring residents). New random queries every step, so resident
    pages attended in the resident tile are evicted by misses of the same step (their slots read into only after the
    resident tile). (Batched copies asked for: by default a HostStore reads a scattered tile with page_gather,
    tests/test_page_gather.py.)"""
    s = Setup(ctx, tmp_path, rng, "host", resident_blocks=10, tile=3, max_blocks=40,
              dims=dict(num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16))     # 4 resident + 2 x 3
    s.h.sparse_gather_min_runs = 1 << 30
    ids = [int(b) for b in rng.permutation(36)]
    s.offload(0, ids)
    T = s.h.tile_blocks
    waited = 0
    for n in range(12):
        q, q_dev = s.query()
        before = s.h.pool.residents()
        calls = record_device_work(monkeypatch)
        rec, got = s.step(0, ids, q_dev, q_pos=35 * 16 + 4, budget_pages=7, keep_first=1, keep_recent=1)
        monkeypatch.undo()
        check_sparse(s, 0, ids, q, q_dev, rec, got, 5, (7, 1, 1), f"step {n}")
        streamed = [t for t in rec.tiles if t.streamed]
        assert len(streamed) == ceil_div(len(rec.misses), T)
        assert calls.count("cuMemcpyBatchAsync") == len(streamed), f"step {n}: {calls}"
        assert calls.count("cuMemcpyDtoDAsync") == 0 and calls.count("cuMemcpyHtoDAsync") == 1, f"step {n}: {calls}"
        promoted = dict(rec.promoted)
        for t in streamed:       # a promoted miss is attended from its resident slot, the others from the buffers
            for b, slot in zip(t.block_ids, t.slots):
                assert slot == promoted[b] if b in promoted else slot >= s.h.resident_capacity, (n, b, slot)
        resident_bytes_match(s)
        for (_, page), slot in rec.evicted:
            assert before[(0, page)] == slot
        hit_slots = {before[(0, b)] for b in rec.hits}
        waited += any(slot in hit_slots for _, slot in rec.promoted)
        sc = rec.scores
        now = {p for _, p in s.h.pool.residents()}
        assert now == (set(p for _, p in before) - {p for (_, p), _ in rec.evicted}) | set(promoted)
        if now:         # the resident set prefers high scores: no attended page left out beats one kept
            left_out = [sc[b] for b in rec.attended if b not in now]
            kept = [sc[p] for p in now if p in set(rec.attended)]
            assert min(kept, default=np.inf) >= max(left_out, default=-np.inf), f"step {n}"
        q_dev.close()
    assert waited, "no step evicted a hit: the resident tile's wait was not exercised"
    diag = s.h.diagnostic_summary()
    assert diag.promotions >= diag.evictions > 0
    s.close()


@pytest.mark.emulator
def test_a_missing_wait_for_the_resident_tile_changes_results(ctx, tmp_path, rng, monkeypatch) -> None:
    """A sparse step whose promotion overwrites the slot of a page attended in its resident tile: without the copy
    stream's wait for that tile the emulator attends the overwritten bytes (the copy stream is run first, as a
    device may), with it the same run is exact."""
    s = Setup(ctx, tmp_path, rng, "host", resident_blocks=10, tile=3, max_blocks=40,
              dims=dict(num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16))     # 4 resident + 2 x 3
    ids = [int(b) for b in rng.permutation(36)]
    s.offload(0, ids)
    d = s.model
    seen = {True: 0, False: 0}
    for n in range(48):
        drop = n % 3 == 2
        q, q_dev = s.query()
        before = s.h.pool.residents()
        real = cm.stream_wait_event
        if drop:
            monkeypatch.setattr(cm, "stream_wait_event",
                                lambda st, ev: None if ev is s.h._step.ev_resident else real(st, ev))
        rec = s.h.attend_layer(ctx, 0, ids, q_dev, s.out, budget_pages=7, keep_first=1, keep_recent=1)
        monkeypatch.undo()
        s.h.copy_stream.synchronize()          # the reads run before the attention stream's work
        got = download(s.out, (d.num_q_heads, d.head_dim), BF16, s.stream)
        hit_slots = {before[(0, b)] for b in rec.hits}
        if any(slot in hit_slots for _, slot in rec.promoted):
            same = np.array_equal(got.view(np.uint16), replay(s, 0, rec, q_dev).view(np.uint16))
            if drop:
                seen[True] += not same
            else:
                assert same, f"step {n}: with the wait"
                check_sparse(s, 0, ids, q, q_dev, rec, got, 16, (7, 1, 1), f"step {n}")
                seen[False] += 1
        if drop:
            s.h.pool.clear()         # forget what the broken step left in the pool
        q_dev.close()
    assert seen[True] and seen[False], f"no step evicted a hit with and without the wait: {seen}"
    s.close()


def test_tile_1_is_read_first_where_only_tile_0_waits_for_the_resident_tile(ctx, tmp_path, rng, monkeypatch) -> None:
    """A sparse step's first two tiles are read before its tables and resident tile, except those with a promotion
    into the slot of a page the resident tile attends: they are read after it (the first of them waiting for its
    event). So where tile 0 alone does, tile 1's reads are queued first. Every step is exact, the pool holds its
    pages' bytes, and both orders occur."""
    from hss.swap import stores
    s = Setup(ctx, tmp_path, rng, "host", resident_blocks=10, tile=3, max_blocks=40,
              dims=dict(num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16))     # 4 resident + 2 x 3
    ids = [int(b) for b in rng.permutation(36)]
    s.offload(0, ids)
    real_issue, real_tile = stores.PreparedReads.issue, s.h.attn.step_tile
    kinds = set()
    for n in range(60):
        q, q_dev = s.query()
        order: list = []
        monkeypatch.setattr(stores.PreparedReads, "issue",
                            lambda self, i, st: (order.append(i), real_issue(self, i, st))[1])
        monkeypatch.setattr(s.h.attn, "step_tile", lambda *a, **kw: (order.append("first"), real_tile(*a, **kw))[1])
        rec, got = s.step(0, ids, q_dev, q_pos=35 * 16 + 4, budget_pages=7, keep_first=1, keep_recent=1)
        monkeypatch.undo()
        check_sparse(s, 0, ids, q, q_dev, rec, got, 5, (7, 1, 1), f"step {n}")
        resident_bytes_match(s)
        streamed = [t for t in rec.tiles if t.streamed]
        hit_slots = set() if rec.tiles[0].streamed else set(rec.tiles[0].slots)
        late = [i for i, t in enumerate(streamed[:2]) if hit_slots & set(t.slots)]
        before = [i for i in range(min(2, len(streamed))) if i not in late]
        want = before + ["first"] + late + list(range(2, len(streamed)))
        assert order == want, (n, order, want)
        kinds.add(tuple(late))
        q_dev.close()
    assert {(), (0,), (1,)} <= kinds, kinds
    s.close()


def test_steps_on_two_streams_wait_for_each_other(ctx, tmp_path, rng) -> None:
    """Consecutive steps on two streams, exact and sparse: a step on another stream than the last one waits for that
    one's end (the same stream needs no wait: it runs in order). The later step is synced first (the emulator runs a
    stream's work only when something waits for it): both outputs exact. A sparse step makes one host wait only,
    for its scores (the reads of earlier steps are known run by then)."""
    s = Setup(ctx, tmp_path, rng, "host", resident_blocks=10, tile=3, max_blocks=40,
              dims=dict(num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16))     # 4 resident + 2 x 3
    ids = [int(b) for b in rng.permutation(36)]
    s.offload(0, ids)
    d = s.model
    sparse = dict(budget_pages=7, keep_first=1, keep_recent=1)
    with cm.CudaStream(ctx) as other:
        out2 = cm.DeviceBuffer(s.out.bytes)
        for n, (kw1, kw2) in enumerate([({}, {}), (sparse, sparse), ({}, sparse), (sparse, {}), (sparse, sparse)]):
            (q1, q1_dev), (q2, q2_dev) = s.query(), s.query()
            r1 = s.h.attend_layer_on_stream(s.stream, 0, ids, q1_dev, s.out, **kw1)
            r2 = s.h.attend_layer_on_stream(other, 0, ids, q2_dev, out2, **kw2)
            g2 = download(out2, (d.num_q_heads, d.head_dim), BF16, other)
            g1 = download(s.out, (d.num_q_heads, d.head_dim), BF16, s.stream)
            for q, q_dev, rec, got, kw in ((q1, q1_dev, r1, g1, kw1), (q2, q2_dev, r2, g2, kw2)):
                if kw:
                    check_sparse(s, 0, ids, q, q_dev, rec, got, 16, (7, 1, 1), f"step {n}")
                else:
                    check_step(s, 0, ids, q, q_dev, rec, got, 16, f"step {n}")
                q_dev.close()
        out2.close()
    waits = []
    real = _driver.api.cuEventSynchronize
    for n in range(4):
        q, q_dev = s.query()
        _driver.api.cuEventSynchronize = lambda *a: (waits.append(n), real(*a))[1]
        try:
            s.step(0, ids, q_dev, **sparse)
        finally:
            _driver.api.cuEventSynchronize = real
        q_dev.close()
    assert waits[-3:] == [1, 2, 3], waits        # one a step: the score wait
    s.close()


def test_sparse_host_profile_counts_its_parts(ctx, tmp_path, rng) -> None:
    """host_profile() sums the host time of each part of a step; a sparse step adds to the sparse parts."""
    s = Setup(ctx, tmp_path, rng, "host", resident_blocks=6, tile=2, max_blocks=10,
              dims=dict(num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16))
    s.offload(0, list(range(8)))
    q, q_dev = s.query()
    p0 = s.h.host_profile()
    s.step(0, list(range(8)), q_dev)
    p1 = s.h.host_profile()
    assert set(p0) == {"checks", "sparse_queue", "sparse_wait", "sparse_select", "sparse_plan", "tiles_queue",
                       "tiles_rest", "record"}
    assert p1["sparse_plan"] == p0["sparse_plan"] and p1["tiles_queue"] > p0["tiles_queue"]
    s.step(0, list(range(8)), q_dev, budget_pages=2, keep_recent=1)
    p2 = s.h.host_profile()
    assert all(p2[k] > p1[k] for k in ("sparse_queue", "sparse_wait", "sparse_select", "sparse_plan", "record"))
    q_dev.close()
    s.close()


@pytest.mark.parametrize("path", ["dma", "gather"])
def test_a_sparse_step_failing_in_a_later_tile_keeps_the_earlier_tiles_promotions(ctx, tmp_path, rng, monkeypatch,
                                                                                  path) -> None:
    """A sparse step's pool bookkeeping is done at once after its reads are queued: when the reads of a later tile
    fail (its batched copy, or its page_gather launch), the promotions of the tiles before it are in the pool (their
    pages' bytes in their slots), the failing tile's promoted slots are free (their old pages may be overwritten), no
    other page moved; the next steps are exact. Where tile 1 was read first (tile 0 alone waits for the resident
    tile) and tile 0's reads fail, both tiles' promoted slots are free and no promotion is placed."""
    s = Setup(ctx, tmp_path, rng, "host", resident_blocks=10, tile=3, max_blocks=40,
              dims=dict(num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16))     # 4 resident + 2 x 3
    ids = [int(b) for b in rng.permutation(36)]
    s.offload(0, ids)
    s.h.store.gather_min_runs = s.h.sparse_gather_min_runs = 1 << 30 if path == "dma" else 0   # every tile one way
    gather = s.h.store._gather
    real_batch, real_launch, real_put = _driver.api.cuMemcpyBatchAsync, gather.launch, s.h._step.promoter.put
    seen = swapped = 0
    for n in range(120):
        q, q_dev = s.query()
        before = s.h.pool.residents()
        diag0 = s.h.diagnostic_summary()
        calls, puts = [0], []

        def batch(*a):
            calls[0] += 1
            return (_driver.api.CUresult.CUDA_ERROR_INVALID_VALUE,) if calls[0] == 2 else real_batch(*a)

        def launch(*a):
            calls[0] += 1
            if calls[0] == 2:
                raise cm.CudaError("cuLaunchKernel", "CUDA_ERROR_INVALID_VALUE", "injected")
            return real_launch(*a)
        if path == "dma":
            monkeypatch.setattr(_driver.api, "cuMemcpyBatchAsync", batch)
        else:
            monkeypatch.setattr(gather, "launch", launch)
        monkeypatch.setattr(s.h._step.promoter, "put", lambda *a: (puts.append(a), real_put(*a))[1])
        try:
            s.step(0, ids, q_dev, budget_pages=7, keep_first=1, keep_recent=1)
            failed = False
        except cm.CudaError as exc:
            assert ("cuMemcpyBatchAsync" if path == "dma" else "cuLaunchKernel") in str(exc) and calls[0] == 2
            failed = True
        monkeypatch.undo()
        if failed and puts:
            _, promo, miss_ids, tiles, lost = puts[0]
            # two tiles' reads begun, the second failing: tile 0 then 1, or (tile 0 alone waiting for the resident
            # tile) 1 then 0: then neither tile's promotions are placed and both tiles' slots are freed
            assert (tiles, lost) in ((1, (1,)), (0, (1, 0))), (tiles, lost)
            swapped += not tiles
            k = promo.at[tiles]
            if k and promo.at[2] > promo.at[1]:
                seen += 1
            placed = {(0, int(miss_ids[j])): int(slot) for j, slot in zip(promo.take[:k], promo.into[:k])}
            freed = {int(slot) for i in lost for slot in promo.into[promo.at[i]:promo.at[i + 1]]}
            want = {key: slot for key, slot in before.items() if slot not in set(placed.values()) | freed}
            assert s.h.pool.residents() == {**want, **placed}, f"step {n}"
            assert set(s.h.pool.free_slots()) >= freed
            diag = s.h.diagnostic_summary()
            assert diag.promotions - diag0.promotions == k and diag.steps == diag0.steps
            resident_bytes_match(s)
        for sparse in ((7, 1, 1), None):
            kw = {} if sparse is None else dict(budget_pages=7, keep_first=1, keep_recent=1)
            rec, got = s.step(0, ids, q_dev, q_pos=35 * 16 + 4, **kw)
            if sparse is None:
                check_step(s, 0, ids, q, q_dev, rec, got, 5, f"exact after step {n}")
            else:
                check_sparse(s, 0, ids, q, q_dev, rec, got, 5, sparse, f"sparse after step {n}")
            resident_bytes_match(s)
        q_dev.close()
        if seen >= 3 and swapped:
            break
    assert seen, "no failing step had promotions in both its first and its failing tile"
    assert swapped, "no failing step had read tile 1 first"
    s.close()


def test_step_records_are_immutable_records_of_python_values(ctx, tmp_path, rng) -> None:
    """A StepRecord (its tuple fields made from the step's arrays when first read) is a frozen dataclass of tuples of
    Python ints, like any other: dataclasses.replace copies it, assignment is refused."""
    s = Setup(ctx, tmp_path, rng, "host", resident_blocks=10, tile=3, max_blocks=40,
              dims=dict(num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16))
    ids = [int(b) for b in rng.permutation(30)]
    s.offload(0, ids)
    q, q_dev = s.query()
    for kw in ({}, dict(budget_pages=7, keep_first=1, keep_recent=1)):
        for _ in range(3):
            rec, _ = s.step(0, ids, q_dev, **kw)
        assert dataclasses.is_dataclass(rec)
        for name in ("hits", "misses", "skipped"):
            value = getattr(rec, name)
            assert type(value) is tuple and all(type(b) is int for b in value), name
        assert all(type(t) is TileRecord for t in rec.tiles)
        assert all(type(x) is int for t in rec.tiles for x in t.slots + t.block_ids)
        assert all(type(b) is int and type(slot) is int for b, slot in rec.promoted)
        assert all(type(layer) is int and type(page) is int and type(slot) is int
                   for (layer, page), slot in rec.evicted)
        copy = dataclasses.replace(rec, layer=rec.layer)
        assert (copy.tiles, copy.hits, copy.misses, copy.promoted, copy.evicted, copy.skipped, copy.sparse) == \
            (rec.tiles, rec.hits, rec.misses, rec.promoted, rec.evicted, rec.skipped, rec.sparse)
        assert repr(copy) == repr(rec) and "block_scores" not in repr(rec)
        with pytest.raises(dataclasses.FrozenInstanceError):
            rec.hits = ()
        assert len(rec.attended) == len(ids) - len(rec.skipped)
    q_dev.close()
    s.close()


# -- promotion planning against the scalar rule ------------------------------------------------------------------------
def scalar_promotions(policy, held: np.ndarray, free: list[int], miss: np.ndarray) -> tuple[list, list, list]:
    """The promotion rule one miss at a time (best score first, ties to the earlier miss, NaN last): into the front of
    the free list, else into the next victim (``policy.rank`` of the slots not free, held ones) while that one does
    not score above the miss. (take, into, rank: decision ranks) in sequence order."""
    victims = [int(v) for v in policy.rank(free) if held[v]]
    order = sorted(range(miss.size), key=lambda i: (bool(np.isnan(miss[i])), 0.0 if np.isnan(miss[i]) else -miss[i], i))
    picked = []
    for i in order:
        if free:
            picked.append((i, free.pop(0)))
        elif victims and not policy.last_score[victims[0]] > miss[i]:
            picked.append((i, victims.pop(0)))
        else:
            break
    seq = sorted(range(len(picked)), key=lambda r: picked[r][0])
    return [picked[r][0] for r in seq], [picked[r][1] for r in seq], seq


def test_promotion_planning_is_the_scalar_rule(ctx) -> None:
    """``Promoter.plan`` (its vectorized paths: free slots, a full resident set by sorted values, NaN by the
    ranking) against the rule applied one miss at a time, over scores with many ties (-0.0 and 0.0, infinities,
    NaN sometimes) and without ties, full and partly free resident sets, one or several tiles; ``wait_tile`` against
    its definition. Half the trials leave the hits' touch pending (as a sparse step does until its reads are queued):
    the answer is the rule's after that touch, and touching them afterwards leaves the recency of touching first."""
    from hss.swap import EvictionPolicy, GroupLayout, ScratchPool
    from hss.swap.promotion import Promoter
    paths = set()
    for seed in range(40):
        rng = np.random.default_rng(seed)
        R, T, nb = int(rng.integers(1, 12)), int(rng.integers(1, 5)), 40
        values = np.array([-np.inf, -1.0, -0.0, 0.0, 0.5, 2.0, np.inf] + ([np.nan] if seed % 4 == 0 else []),
                          dtype=np.float32)
        pool = ScratchPool(GroupLayout(nb, 1, 4, 64), R + 2 * T, num_layers=2, reserved_slots=2 * T, ctx=ctx)
        try:
            for trial in range(25):
                pool.clear()
                n_held = R if trial % 3 else int(rng.integers(0, R + 1))
                held_slots = rng.permutation(R)[:n_held]
                pool.put_many(int(rng.integers(0, 2)), rng.permutation(nb)[:n_held], held_slots)
                ev = EvictionPolicy(R)
                distinct = seed % 2 == 1        # (no two scores equal: the plain sorts' path)
                ev.last_score[:] = rng.standard_normal(R) if distinct else rng.choice(values, R)
                ev.last_access[:] = rng.integers(0, 4, R)
                m = int(rng.integers(1, 3 * T + 1))
                miss = (rng.standard_normal(m) + 0.5).astype(np.float32) if distinct else rng.choice(values, m)
                ns = ceil_div(m, T)
                hits = rng.permutation(held_slots)[:int(rng.integers(0, n_held + 1))].astype(np.int64)
                pending = trial % 2 == 1 and hits.size > 0
                promoter = Promoter(pool, ev, T, np.arange(0, (ns + 2) * T, T, dtype=np.int64))
                if pending:
                    promoter.defer_touch(hits)
                scores = np.concatenate([miss, rng.choice(values, 3)])     # the misses at positions 0..m-1
                if pending:         # the rule's answer is after the touch
                    touched = EvictionPolicy(R)
                    touched.last_score[:], touched.last_access[:], touched.epoch = ev.last_score, ev.last_access, 9
                    ev.epoch = 9
                    touched.touch_many(hits)
                got = promoter.plan(scores, np.arange(m), ns, hits)
                if pending:
                    promoter.touch_hits()
                    assert np.array_equal(ev.last_access, touched.last_access) and ev.epoch == touched.epoch
                    assert promoter.pending_touch is None
                    paths.add("pending")
                held = pool._layer_of >= 0
                take, into, rank = scalar_promotions(ev, held, pool.free_slots()[:m], miss)
                nan = bool(np.isnan(ev.last_score).any() or np.isnan(miss).any())
                paths.add((bool(pool.free_count), nan, bool(take)))
                what = (seed, trial, ev.last_score.tolist(), ev.last_access.tolist(), held.tolist(), miss.tolist())
                if not take:
                    assert got is None, what
                    continue
                assert got is not None, what
                assert (got.take.tolist(), got.into.tolist(), got.rank.tolist()) == (take, into, rank), what
                assert got.take.dtype == got.into.dtype == got.rank.dtype == np.int64, what
                assert np.array_equal(got.scores, miss[take], equal_nan=True), what
                layers, pages = pool.keys_of(into)
                assert (got.old_layer.tolist(), got.old_page.tolist()) == (layers.tolist(), pages.tolist()), what
                assert got.at == np.searchsorted(take, np.arange(0, (ns + 1) * T, T)).tolist(), what
                over = [t for t, slot in zip(take, into) if slot in hits.tolist()]
                assert got.wait_tile == (over[0] // T if over else ns), what
        finally:
            pool.close()
    want = {(False, False, True), (False, False, False), (True, False, True), (False, True, True), "pending"}
    assert want <= paths, paths
