"""Tests for hss.swap.layout, .eviction, .pool and the disk block-id allocator (docs/design.md §7.1, §7.4, §7.5, §8.4).

Pure host logic (layouts, rankings, free lists, refcounts) is checked against hand-computed values and,
for the ranking, a brute-force comparator; the scratch pool's device addressing is checked against
TiledAttention's strides, padded stripes included.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from hss import cuda_min as cm
from hss.attention import TiledAttention, TiledAttentionDims
from hss.cuda._driver import HssError
from hss.swap import DiskBlockAllocator, EvictionPolicy, GroupLayout, PoolExhausted, ScratchPool

from helpers import BF16

LLAMA = GroupLayout(num_blocks=64, num_kv_heads=8, block_size=16, head_dim=128)


# -- GroupLayout -------------------------------------------------------------------------------
def test_layout_sizes_and_offsets() -> None:
    g = LLAMA
    assert (g.group_bytes, g.group_stride, g.block_bytes) == (4096, 4096, 65536)
    assert g.bytes_per_layer == 2 * 64 * 8 * 4096 and g.groups_per_layer == 64 * 16
    assert g.group_offset(0, 0, 0) == 0
    assert g.group_offset(3, 1, 5) == 3 * 65536 + 1 * 8 * 4096 + 5 * 4096
    assert g.page_offset(7) == 7 * 65536
    assert g.group_id(2, 3, 1, 5) == 2 * 1024 + 3 * 16 + 8 + 5
    assert g.locate(0) == (0, 0) and g.locate(8 * 4096 + 4095) == (1, 0) and g.locate(65535) == (1, 7)
    padded = GroupLayout(num_blocks=4, num_kv_heads=2, block_size=8, head_dim=128)     # 2 KiB stripes
    assert (padded.group_bytes, padded.group_stride, padded.block_bytes) == (2048, 4096, 16384)
    assert padded.group_offset(1, 1, 1) == 16384 + 2 * 4096 + 4096
    odd = GroupLayout(num_blocks=1, num_kv_heads=1, block_size=3, head_dim=96, fs_block_size=512)
    assert odd.group_bytes == 576 and odd.group_stride == 1024


@pytest.mark.parametrize("call,words", [
    (lambda: LLAMA.group_offset(64, 0, 0), r"page 64 is out of range"),
    (lambda: LLAMA.group_offset(0, 2, 0), r"kind 2 must be 0 \(K\) or 1 \(V\)"),
    (lambda: LLAMA.group_offset(0, 0, 8), r"kv_head 8 is out of range 0..7"),
    (lambda: LLAMA.group_id(-1, 0, 0, 0), "layer must be >= 0"),
    (lambda: LLAMA.locate(65536), "outside a 65536-byte page"),
    (lambda: GroupLayout(0, 1, 1, 1), r"num_blocks must be >= 1"),
    (lambda: GroupLayout(1, 1, 1, 1, fs_block_size=3000), "power of two")])
def test_layout_errors(call, words: str) -> None:
    with pytest.raises(HssError, match=words):
        call()
    with pytest.raises(TypeError, match="block_size must be an int"):
        GroupLayout(1, 1, 16.0, 1)


def test_pack_page_layout_and_round_trip(rng) -> None:
    g = GroupLayout(num_blocks=2, num_kv_heads=3, block_size=8, head_dim=64)    # 1 KiB stripes padded to 4 KiB
    k = rng.standard_normal((8, 3, 64)).astype(np.float32).astype(BF16)
    v = rng.standard_normal((8, 3, 64)).astype(np.float32).astype(BF16)
    img = g.pack_page(k, v)
    assert img.dtype == np.uint8 and img.nbytes == g.block_bytes
    for kind, src in ((0, k), (1, v)):
        for h in range(3):
            at = g.group_offset(0, kind, h)
            assert img[at:at + g.group_bytes].tobytes() == np.ascontiguousarray(src[:, h, :]).tobytes()
            assert not img[at + g.group_bytes:at + g.group_stride].any(), "padding must be zero"
    k2, v2 = g.unpack_page(img)
    assert np.array_equal(k2.view(np.uint16), k.view(np.uint16))
    assert np.array_equal(v2.view(np.uint16), v.view(np.uint16))
    assert np.array_equal(g.pack_page(k.tobytes(), v.view(np.uint16)), img)      # bytes and uint16 views work too
    with pytest.raises(HssError, match=r"k_host holds 3070 bytes but one page is .* = 3072 bytes "
                                       r"\(\[tok, kv_head, dim\]\)"):
        g.pack_page(k.reshape(-1)[:-1], v)
    with pytest.raises(HssError, match="v_host must be C-contiguous"):
        g.pack_page(k, np.asfortranarray(v.reshape(8, 192)))
    with pytest.raises(TypeError, match="bytes-like"):
        g.pack_page(k, 3.0)
    with pytest.raises(HssError, match="a page image is 24576 bytes"):
        g.unpack_page(img[:-1])


# -- EvictionPolicy ----------------------------------------------------------------------------
def policy(scores: list[float], accesses: list[int]) -> EvictionPolicy:
    p = EvictionPolicy(len(scores))
    p.last_score[:] = scores
    p.last_access[:] = accesses
    return p


def test_rank_lowest_score_first_then_least_recent_then_slot() -> None:
    p = policy([3.0, 1.0, 2.0, 1.0, 1.0], [5, 9, 1, 2, 2])
    assert p.rank().tolist() == [3, 4, 1, 2, 0]
    assert p.rank([3, 0]).tolist() == [4, 1, 2]                 # pinned slots are never candidates
    assert p.rank(range(5)).tolist() == []
    fresh = EvictionPolicy(3)                                   # -inf scores, access 0: slot order
    assert fresh.rank().tolist() == [0, 1, 2]
    assert EvictionPolicy(0).rank().tolist() == []


def test_rank_nan_compares_equal_so_recency_places_it() -> None:
    nan = float("nan")
    # an old NaN goes before every more recent slot; a recent NaN after every older one
    assert policy([1.0, nan, 3.0], [3, 1, 2]).rank().tolist() == [1, 0, 2]
    assert policy([1.0, nan, 3.0], [1, 3, 2]).rank().tolist() == [0, 2, 1]
    assert policy([nan, nan, 0.5], [7, 2, 5]).rank().tolist() == [1, 2, 0]
    assert policy([nan, nan], [4, 4]).rank().tolist() == [0, 1]
    # scores stay ordered among themselves whatever the NaNs do: a non-transitive comparator gets a fixed answer
    assert policy([1.0, nan, 2.0], [3, 2, 1]).rank().tolist() == [1, 0, 2]
    assert EvictionPolicy.yields_to(nan, 0.0) and EvictionPolicy.yields_to(0.0, nan)
    assert EvictionPolicy.yields_to(1.0, 1.0) and EvictionPolicy.yields_to(1.0, 2.0)
    assert not EvictionPolicy.yields_to(2.0, 1.0) and EvictionPolicy.yields_to(float("-inf"), -1e30)


@given(st.lists(st.tuples(st.sampled_from([-1.0, 0.0, 0.5, 2.0, float("-inf")]), st.integers(0, 6)),
                min_size=0, max_size=12), st.data())
def test_rank_matches_the_comparator_without_nan(slots: list, data) -> None:
    scores, accesses = [s for s, _ in slots], [a for _, a in slots]
    p = policy(scores, accesses)
    pinned = data.draw(st.lists(st.integers(0, max(len(slots) - 1, 0)), max_size=3)) if slots else []
    want = sorted((i for i in range(len(slots)) if i not in pinned), key=lambda i: (scores[i], accesses[i], i))
    assert p.rank(pinned).tolist() == want


def test_touch_record_reset_and_epoch_wrap() -> None:
    p = EvictionPolicy(4)
    p.touch(2)
    p.touch_many([0, 3])
    assert p.last_access.tolist() == [2, 0, 1, 3] and p.epoch == 4
    p.record_score(1, 0.25)
    p.record_scores([0, 3], [2.0, -1.0])
    assert p.last_score.tolist() == [2.0, 0.25, float("-inf"), -1.0]
    assert p.rank().tolist() == [2, 3, 1, 0]
    p.epoch = 2**64 - 1
    p.touch_many([1, 2])
    assert p.last_access[1] == 2**64 - 1 and p.last_access[2] == 0 and p.epoch == 1
    p.touch(0)
    assert p.epoch == 2
    p.reset()
    assert p.epoch == 1 and (p.last_access == 0).all() and np.isneginf(p.last_score).all()
    with pytest.raises(HssError, match=r"slot 4 is out of range 0..3"):
        p.touch(4)
    with pytest.raises(HssError, match="pinned must be in 0..3"):
        p.rank([9])
    with pytest.raises(HssError, match="num_slots must be >= 0"):
        EvictionPolicy(-1)


def test_planned_touches_are_touch_many_across_every_epoch() -> None:
    """``touch_planned`` (one arange while the epochs stay below 2^63) gives ``touch_many``'s accesses and epoch at any
    epoch: small, around 2^63, and wrapping at 2^64."""
    for epoch in (1, 2**53 - 1, 2**63 - 3, 2**63 + 7, 2**64 - 2):
        a, b = EvictionPolicy(6), EvictionPolicy(6)
        a.epoch = b.epoch = epoch
        slots = np.array([4, 0, 5, 2], dtype=np.int64)
        a.touch_many(slots.tolist())
        b.touch_planned(slots)
        assert a.last_access.tolist() == b.last_access.tolist() and a.epoch == b.epoch, epoch


def test_scoring_every_slot_at_once_is_record_scores() -> None:
    """``score_all_planned`` (one gather into the scores, a sparse step whose pages fill every slot) records what
    ``record_scores`` of each slot's page would, NaN and infinities included; recency is untouched."""
    rng = np.random.default_rng(4)
    for _ in range(20):
        n = int(rng.integers(1, 9))
        scores = rng.choice(np.array([-np.inf, -1.0, 0.0, 2.5, np.inf, np.nan], np.float32), 3 * n)
        where = rng.permutation(3 * n)[:n].astype(np.int64)      # slot i's page is at position where[i]
        a, b = EvictionPolicy(n), EvictionPolicy(n)
        a.touch_many(rng.permutation(n).tolist())
        b.last_access[:], b.epoch = a.last_access, a.epoch
        a.record_scores(np.arange(n), scores[where])
        b.score_all_planned(scores, where)
        assert np.array_equal(a.last_score, b.last_score, equal_nan=True)
        assert a.last_score.dtype == b.last_score.dtype == np.float32
        assert a.last_access.tolist() == b.last_access.tolist()


# -- ScratchPool -------------------------------------------------------------------------------
@pytest.fixture
def pool(ctx):
    p = ScratchPool(GroupLayout(num_blocks=10, num_kv_heads=2, block_size=4, head_dim=64), 5, num_layers=3,
                    reserved_slots=1, ctx=ctx)
    yield p
    p.close()


def test_pool_fifo_assign_evict_invalidate_clear(pool: ScratchPool) -> None:
    assert pool.poolable_slots == 4 and pool.free_slots() == [0, 1, 2, 3] and pool.free_count == 4
    assert [pool.assign((0, p)) for p in (5, 6, 7, 8)] == [0, 1, 2, 3]
    assert pool.assign((0, 6)) == 1                              # resident: its own slot
    assert pool.lookup((0, 6)) == 1 and pool.lookup((1, 6)) is None and pool.key_of(3) == (0, 8)
    assert pool.lookup_many(0, np.array([8, 9, 5])).tolist() == [3, -1, 0]
    assert pool.assign((1, 0), candidates=[2, 1]) == 2          # first resident candidate is evicted
    assert pool.lookup((0, 7)) is None and pool.residents() == {(0, 5): 0, (0, 6): 1, (1, 0): 2, (0, 8): 3}
    assert pool.invalidate((0, 5)) == 0 and pool.invalidate((0, 5)) is None
    assert pool.invalidate((0, 8)) == 3
    assert pool.free_slots() == [0, 3]                            # invalidated slots go to the BACK
    assert pool.assign((2, 9)) == 0 and pool.resident_count == 3
    assert pool.put((2, 1), 1) == (0, 6)                          # put evicts the occupant
    assert pool.put((2, 2), 3) is None and pool.free_count == 0
    assert pool.invalidate_page(1) == [1] and pool.free_slots() == [1]
    pool.clear()
    assert pool.free_slots() == [0, 1, 2, 3] and pool.residents() == {} and pool.lookup((2, 9)) is None


def test_pool_put_many_equals_put_one_by_one(ctx) -> None:
    """put_many (vectorized) leaves the pool exactly as put of each (page, slot) in order would: free slots leave the
    free list (the others keep their order), residents are evicted and returned; keys_of / holds see it; a bad call
    (a resident page, repeats, out of range) raises and changes nothing; invalidate_slots frees in order."""
    layout = GroupLayout(num_blocks=30, num_kv_heads=2, block_size=4, head_dim=64)
    for trial in range(40):
        a, b = (ScratchPool(layout, 9, num_layers=2, reserved_slots=1, ctx=ctx) for _ in range(2))
        for p in (a, b):                                # the same history for both pools
            rng = np.random.default_rng(trial)
            for page in rng.permutation(30)[:int(rng.integers(0, 9))].tolist():
                p.assign((page % 2, page))
            for slot in rng.permutation(8)[:2].tolist():
                key = p.key_of(slot)
                if key is not None:
                    p.invalidate(key)
        rng = np.random.default_rng(100 + trial)
        layer = int(rng.integers(0, 2))
        fresh = [pg for pg in rng.permutation(30).tolist() if a.lookup((layer, pg)) is None]
        n = int(rng.integers(0, 9))
        pages, slots = fresh[:n], rng.permutation(8)[:n].tolist()
        olds = [b.put((layer, pg), sl) for pg, sl in zip(pages, slots)]
        got_l, got_p = a.put_many(layer, np.array(pages, dtype=np.int64), np.array(slots))
        assert [None if l < 0 else (l, p) for l, p in zip(got_l.tolist(), got_p.tolist())] == olds
        assert a.residents() == b.residents() and a.free_slots() == b.free_slots(), trial
        assert a.keys_of(np.arange(8))[1].tolist() == [-1 if k is None else k[1] for k in map(b.key_of, range(8))]
        assert a.holds(np.arange(8)).tolist() == [b.key_of(i) is not None for i in range(8)]
        for p in (a, b):
            p.close()
    pool = ScratchPool(layout, 5, num_layers=2, reserved_slots=1, ctx=ctx)
    pool.assign((0, 3))
    state = (pool.residents(), pool.free_slots())
    for args, err, words in [((0, [3], [1]), HssError, r"pages \[3\] of layer 0 are already resident"),
                             ((0, [4, 4], [1, 2]), HssError, "distinct"), ((0, [4, 5], [1, 1]), HssError, "distinct"),
                             ((0, [4], [4]), HssError, "out of range 0..3"), ((2, [4], [1]), HssError, "layer 2"),
                             ((0, [4, 5], [1]), HssError, "2 pages but 1 slots"),
                             ((0, [0.5], [1]), TypeError, "pages must be integers")]:
        with pytest.raises(err, match=words):
            pool.put_many(*args)
        assert (pool.residents(), pool.free_slots()) == state
    pool.put_many(1, [7, 8], [2, 0])
    assert pool.residents() == {(1, 8): 0, (1, 7): 2} and pool.free_slots() == [1, 3]
    pool.invalidate_slots([0, 1, 2])
    assert pool.residents() == {} and pool.free_slots() == [1, 3, 0, 2]
    pool.close()


def test_select_pages_on_long_random_sequences() -> None:
    """select_pages (a partition, no sort) against a stable sort of (-score, position) on long sequences with many
    ties, NaN and infinities, every budget from none to past the end."""
    from hss.swap import SparseBudget, select_pages
    rng = np.random.default_rng(17)
    for _ in range(30):
        n = int(rng.integers(1, 3000))
        scores = rng.choice(np.array([0.5, -0.0, 0.0, 1.0, np.nan, np.inf, -np.inf], np.float32), n)
        scores = np.where(rng.random(n) < 0.5, rng.standard_normal(n).astype(np.float32), scores)
        f, r = int(rng.integers(0, 4)), int(rng.integers(0, 6))
        for k in sorted({0, 1, int(rng.integers(0, n + 1)), n // 8, n}):
            got = select_pages(scores, SparseBudget(k, f, r))
            forced = np.zeros(n, bool)
            forced[:f] = True
            forced[max(n - r, 0):] = True
            others = np.flatnonzero(~forced)
            key = np.where(np.isnan(scores[others]), np.inf, -scores[others])
            nan_last = np.isnan(scores[others])
            order = others[np.lexsort((others, key, nan_last))][:k]
            want = np.flatnonzero(forced | np.isin(np.arange(n), order))
            assert got.tolist() == want.tolist(), (n, k, f, r)


def test_pool_exhaustion_and_errors(pool: ScratchPool) -> None:
    for p in range(4):
        pool.assign((0, p))
    with pytest.raises(PoolExhausted, match="no slot available and no eviction candidate is resident.*"
                                            "raise HighSpeedSwapConfig.resident_blocks"):
        pool.assign((0, 9), candidates=[])
    pool.invalidate((0, 1))
    pool.assign((0, 9))
    with pytest.raises(PoolExhausted, match="no slot available"):
        pool.assign((1, 9), candidates=[4, 7])                   # the reserved slot and junk never qualify
    with pytest.raises(HssError, match=r"key \(layer 3, page 0\) is out of range"):
        pool.lookup((3, 0))
    with pytest.raises(TypeError, match=r"a key is \(layer, page\)"):
        pool.lookup(3)
    with pytest.raises(HssError, match="slot 4 is not a poolable slot"):
        pool.put((1, 1), 4)
    with pytest.raises(HssError, match="already resident"):
        pool.put((0, 9), 0)
    with pytest.raises(HssError, match="reserved_slots"):
        ScratchPool(pool.layout, 2, reserved_slots=3)
    with pytest.raises(TypeError, match="GroupLayout"):
        ScratchPool((1, 2), 2)


def test_pool_addresses_follow_tiled_attention_strides(ctx, pool: ScratchPool) -> None:
    g = pool.layout
    assert pool.slot_bytes == g.block_bytes == 2 * 2 * 4096 and pool.buffer.bytes == 5 * g.block_bytes
    assert pool.slot_ptr(4) == pool.ptr + 4 * g.block_bytes              # reserved slots are addressable
    assert pool.stripe_ptr(2, 1, 1) == pool.ptr + 2 * g.block_bytes + 3 * 4096
    with pytest.raises(HssError, match="slot 5 is out of range"):
        pool.slot_ptr(5)
    # 512-byte stripes padded to 4 KiB: the kernel's strides come from the real stride, not the stripe size
    with TiledAttention(ctx, TiledAttentionDims(1, 4, 2, 64, 4, 3)) as ta:
        k, v, blk, tok, kvh = pool.attention_operands(ta)
        assert (blk, tok, kvh) == (2 * 2 * 2048, 64, 2048) and k == pool.ptr and v == pool.ptr + 2 * 4096
        elem = lambda slot, kind, h, t, d: k + 2 * (slot * blk + t * tok + h * kvh + d) + kind * (v - k)  # noqa: E731
        assert elem(3, 1, 1, 2, 5) == pool.stripe_ptr(3, 1, 1) + 2 * (2 * 64 + 5)
    pool.close()
    pool.close()
    assert pool.closed


# -- DiskBlockAllocator ------------------------------------------------------------------------
def test_disk_block_allocator() -> None:
    a = DiskBlockAllocator(3)
    assert a.free_count == 3 and a.active == 0
    assert [a.alloc(), a.alloc()] == [0, 1]
    a.inc_ref(0)
    assert a.refcount(0) == 2 and a.dec_ref(0) is False and a.refcount(0) == 1
    assert a.dec_ref(0) is True and a.free == [0] and a.active == 1 and a.free_count == 2
    assert a.dec_ref(0) is False and a.refcount(0) == 0 and a.free == [0]   # saturates, no double free
    with pytest.raises(HssError, match="inc_ref of disk block id 0, which is free"):
        a.inc_ref(0)
    with pytest.raises(HssError, match="disk block id 2 was never allocated"):
        a.inc_ref(2)
    assert a.dec_ref(1) is True and a.free == [0, 1]
    assert [a.alloc(), a.alloc(), a.alloc(), a.alloc()] == [1, 0, 2, None]   # LIFO reuse, then the tail, then None
    assert a.free_count == 0 and a.active == 3
    assert DiskBlockAllocator(0).alloc() is None
    assert math.isclose(a.refcount(2), 1)


# -- hostile arguments ---------------------------------------------------------------------------
def test_layout_converts_numpy_ints_and_refuses_others(ctx, rng) -> None:
    """GroupLayout's fields become Python ints at construction: an np.int32 layout's sizes never wrap."""
    g = GroupLayout(np.int32(40000), np.int32(8), np.int32(16), np.int32(128))
    assert all(type(getattr(g, f)) is int for f in ("num_blocks", "num_kv_heads", "block_size", "head_dim"))
    assert g.bytes_per_layer == 40000 * 65536 and g.group_offset(np.int64(39999), np.uint8(1), np.int16(7)) == \
        39999 * 65536 + 8 * 4096 + 7 * 4096
    for args, words in [((1, 1, True, 1), "GroupLayout.block_size must be an int, got bool"),
                        ((1, 1, 1, "64"), "GroupLayout.head_dim must be an int, got str"),
                        ((1.0, 1, 1, 1), "GroupLayout.num_blocks must be an int, got float"),
                        ((1, float("nan"), 1, 1), "GroupLayout.num_kv_heads must be an int, got float nan")]:
        with pytest.raises(TypeError, match=words):
            GroupLayout(*args)
    for call, words in [(lambda: LLAMA.group_offset(0, 0.0, 0), "kind must be an int, got float"),
                        (lambda: LLAMA.group_offset(True, 0, 0), "page must be an int, got bool"),
                        (lambda: LLAMA.group_id(0, 0, 0, "1"), "kv_head must be an int, got str"),
                        (lambda: LLAMA.locate(1.5), "offset_in_page must be an int")]:
        with pytest.raises(TypeError, match=words):
            call()
    # host pages by the argument layer's host-buffer rules
    small = GroupLayout(num_blocks=2, num_kv_heads=1, block_size=4, head_dim=64)
    k = rng.standard_normal((4, 1, 64)).astype(np.float32).astype(BF16)
    dev, pinned, gone = cm.DeviceBuffer(512), cm.PinnedBuffer(512), cm.PinnedBuffer(512)
    gone.close()
    pinned.array[:] = k.view(np.uint8).reshape(-1)
    assert np.array_equal(small.pack_page(pinned, memoryview(k.tobytes())), small.pack_page(k, k))
    for call, err, words in [(lambda: small.pack_page(dev, k), HssError, "k_host is device memory"),
                             (lambda: small.pack_page(k, gone), HssError, "v_host is a closed PinnedBuffer"),
                             (lambda: small.pack_page(k, pinned.ptr), TypeError, "v_host must be host data"),
                             (lambda: small.pack_page(k, np.int64(5)), TypeError, "not an address"),
                             (lambda: small.pack_page(k, None), TypeError, "v_host must be a host buffer"),
                             (lambda: small.pack_page(np.full(256, None, object), k), TypeError,
                              "k_host holds Python objects"),
                             (lambda: small.unpack_page("x" * small.block_bytes), TypeError,
                              "image must be a host buffer")]:
        with pytest.raises(err, match=words):
            call()
    dev.close()
    pinned.close()


def test_hostile_policy_arguments() -> None:
    p = EvictionPolicy(4)
    for call, err, words in [(lambda: EvictionPolicy(2.0), TypeError, "num_slots must be an int, got float"),
                             (lambda: EvictionPolicy(True), TypeError, "num_slots must be an int, got bool"),
                             (lambda: p.touch(1.0), TypeError, "slot must be an int, got float"),
                             (lambda: p.touch(float("nan")), TypeError, "slot must be an int, got float nan"),
                             (lambda: p.touch_many([0.5]), TypeError, "slots must be integers, got float64"),
                             (lambda: p.touch_many([True, False]), TypeError, "slots must be integers, got bool"),
                             (lambda: p.touch_many(["1"]), TypeError, "slots must be integers"),
                             (lambda: p.touch_many([-1]), HssError, "slots must be in 0..3"),
                             (lambda: p.touch_many(1.5), TypeError, "slots must be a sequence of slot indices"),
                             (lambda: p.record_scores([0], 2.0), TypeError, "scores must be a sequence of scores"),
                             (lambda: p.record_score(True, 1.0), TypeError, "slot must be an int, got bool"),
                             (lambda: p.record_score(0, "1.0"), TypeError, "score must be a number, got str"),
                             (lambda: p.record_scores([0], ["1.0"]), TypeError, "scores must be numbers"),
                             (lambda: p.record_scores([0, 1], [1.0]), HssError, "2 slots but 1 scores"),
                             (lambda: p.rank([1.5]), TypeError, "pinned must be integers"),
                             (lambda: EvictionPolicy.yields_to("a", 1.0), TypeError, "old_score must be a number")]:
        with pytest.raises(err, match=words):
            call()
    assert p.epoch == 1 and (p.last_access == 0).all() and np.isneginf(p.last_score).all(), "nothing changed"
    p.touch(np.int64(1))
    p.touch_many(np.array([3, 0], np.uint8))
    p.record_score(np.int32(2), np.float32(0.5))
    p.record_score(1, float("nan"))                       # NaN scores are allowed: recency places them
    p.record_scores(np.array([0], np.int16), np.array([2], np.int64))
    assert p.last_access.tolist() == [3, 1, 0, 2] and p.rank(np.array([2], np.uint16)).tolist() == [1, 3, 0]


def test_hostile_pool_arguments(pool: ScratchPool) -> None:
    g = pool.layout
    for call, err, words in [
        (lambda: ScratchPool(g, 5.0), TypeError, "num_slots must be an int, got float"),
        (lambda: ScratchPool(g, 5, reserved_slots=True), TypeError, "reserved_slots must be an int, got bool"),
        (lambda: ScratchPool(g, 5, num_layers="3"), TypeError, "num_layers must be an int, got str"),
        (lambda: pool.lookup((0.0, 1)), TypeError, r"key\[0\] \(layer\) must be an int, got float"),
        (lambda: pool.lookup((0, True)), TypeError, r"key\[1\] \(page\) must be an int, got bool"),
        (lambda: pool.lookup((0, float("nan"))), TypeError, r"key\[1\] \(page\) must be an int, got float nan"),
        (lambda: pool.lookup((0, 1, 2)), TypeError, r"a key is \(layer, page\)"),
        (lambda: pool.assign(("0", 1)), TypeError, r"key\[0\] \(layer\) must be an int, got str"),
        (lambda: pool.put((0, 1), 1.0), TypeError, "slot must be an int, got float"),
        (lambda: pool.put((0, 1), True), TypeError, "slot must be an int, got bool"),
        (lambda: pool.put((0, 1), -1), HssError, r"slot -1 is not a poolable slot \(0..3\)"),
        (lambda: pool.slot_ptr(2.0), TypeError, "slot must be an int, got float"),
        (lambda: pool.stripe_ptr(0, 1.0, 0), TypeError, "kind must be an int, got float"),
        (lambda: pool.stripe_ptr(0, True, 0), TypeError, "kind must be an int, got bool"),
        (lambda: pool.stripe_ptr(0, 0, 0.0), TypeError, "kv_head must be an int, got float"),
        (lambda: pool.key_of(-1), HssError, "slot -1 is not a poolable slot"),
        (lambda: pool.key_of(4), HssError, "slot 4 is not a poolable slot"),       # reserved
        (lambda: pool.key_of(1.0), TypeError, "slot must be an int, got float"),
        (lambda: pool.lookup_many(0.0, [1]), TypeError, "layer must be an int, got float"),
        (lambda: pool.lookup_many(3, [1]), HssError, r"layer 3 is out of range 0..2"),
        (lambda: pool.lookup_many(0, [1.5]), TypeError, "pages must be integers, got float64"),
        (lambda: pool.lookup_many(0, [True]), TypeError, "pages must be integers, got bool"),
        (lambda: pool.lookup_many(0, [10, -1]), HssError, r"pages \[10, -1\] are out of range 0..9"),
        (lambda: pool.holds([0.5]), TypeError, "slots must be integers"),
        (lambda: pool.holds([4]), HssError, r"slots \[4\] are out of range 0..3"),
        (lambda: pool.invalidate((0, 1.0)), TypeError, r"key\[1\] \(page\) must be an int"),
        (lambda: pool.invalidate_page(1.0), TypeError, "page must be an int, got float"),
        (lambda: pool.invalidate_page(10), HssError, r"page 10 is out of range 0..9")]:
        with pytest.raises(err, match=words):
            call()
    assert pool.free_slots() == [0, 1, 2, 3] and pool.residents() == {}, "nothing changed"
    slot = pool.assign((np.int64(0), np.int32(5)))
    assert pool.lookup((np.uint8(0), np.int16(5))) == slot and pool.key_of(np.int64(slot)) == (0, 5)
    assert all(type(x) is int for x in pool.key_of(slot)) and pool.residents() == {(0, 5): slot}
    assert pool.lookup_many(np.int32(0), np.array([5, 6], np.uint16)).tolist() == [slot, -1]
    assert pool.put((0, 6), np.int64(1)) is None and pool.holds(np.array([0, 1, 2], np.uint8)).tolist() == \
        [True, True, False]
    assert pool.slot_ptr(np.int8(1)) == pool.ptr + g.block_bytes
    for p in (7, 8):
        pool.assign((1, p))
    with pytest.raises(TypeError, match=r"candidates\[1\] must be an int, got float"):
        pool.assign((2, 9), candidates=[4, 0.5])                  # full: the candidates are read
    assert pool.assign((2, 9), candidates=[np.int64(9), np.uint8(2)]) == 2 and pool.lookup((1, 7)) is None


def test_hostile_allocator_arguments() -> None:
    a = DiskBlockAllocator(np.int32(3))
    assert type(a.capacity) is int and a.alloc() == 0
    for call, words in [(lambda: DiskBlockAllocator(3.0), "capacity must be an int, got float"),
                        (lambda: a.inc_ref(0.5), "block must be an int, got float"),
                        (lambda: a.dec_ref(True), "block must be an int, got bool"),
                        (lambda: a.refcount("0"), "block must be an int, got str")]:
        with pytest.raises(TypeError, match=words):
            call()
    a.inc_ref(np.int64(0))
    assert a.refcount(np.uint8(0)) == 2 and a.dec_ref(np.int16(0)) is False
