"""Tests for hss.attention and its kernels (docs/design.md §6; bounds of docs/design.md §0).

Outputs are compared with plain float64 softmax attention over exactly the tokens the tile schedule
consumes, computed from the staged bf16 pool and query; every bound is shown to bite (one token dropped
from the reference must fail it). A tile's result depends only on its tokens: the same schedule gives the
same bits whatever the pool layout, tile_capacity, grid or other sequences; another split into tiles only has
to meet the bound. The finalize output and the m/l/o state are NaN-poisoned before every run, and rows past num_seqs
must keep their poison. On the emulator shapes are capped so the file runs in seconds.
"""
from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from hss import _args as cm_args
from hss import cuda_min as cm
from hss._util import ceil_div
from hss.attention import TiledAttention, TiledAttentionDims
from hss.cuda import _driver
from hss.errors import HssError
from hss.reference import attention as ref

import conftest
from helpers import BF16, CudaArray, assert_bites, assert_close, download, poisoned, upload

ON_GPU = conftest.ON_GPU
ORIGINAL = TiledAttentionDims(max_seqs=1, num_q_heads=32, num_kv_heads=8, head_dim=128, block_size=16,
                              tile_capacity=16)   # tiled_attention_parity.rs
REF_ELEMS = 1 << 25 if ON_GPU else 1 << 20   # tokens * q heads * head_dim per sequence (host reference cost)


# -- data and runs -----------------------------------------------------------------------------
def randn(rng: np.random.Generator, shape: tuple[int, ...], std: float) -> np.ndarray:
    """bf16 N(0, std^2) data with no zeros (zeros hide unwritten outputs and wrong indexing)."""
    x = (rng.standard_normal(shape) * std).astype(np.float32).astype(BF16)
    x[x == 0] = BF16(std)
    return x


def std_of(kind: str, head_dim: int) -> float:
    return 1.0 if kind == "unit" else 1.0 / math.sqrt(head_dim)


class Pool:
    """A K/V page pool: host copies ``k``, ``v`` bf16 [pages, block_size, nkv, hd] and their device image,
    either the NHD layout (two buffers) or HSS scratch slots ``[slot][K|V][kv_head][stripe]`` (one buffer,
    stripes ``group_stride`` bytes apart, padding filled with NaN so that reading it shows)."""

    def __init__(self, ta: TiledAttention, rng: np.random.Generator, num_pages: int, std: float, stream: int,
                 group_stride: int | None = None, data: tuple[np.ndarray, np.ndarray] | None = None) -> None:
        d = ta.dims
        shape = (num_pages, d.block_size, d.num_kv_heads, d.head_dim)
        self.k, self.v = data if data is not None else (randn(rng, shape, std), randn(rng, shape, std))
        if group_stride is None:
            self.bufs = [upload(self.k, stream), upload(self.v, stream)]
            self.k_ptr, self.v_ptr = self.bufs[0].ptr, self.bufs[1].ptr
            self.strides = ta.paged_strides()
        else:
            blk, tok, kvh, v_off = ta.scratch_pool_strides(group_stride)
            flat = np.full(num_pages * blk, 0xFFFF, dtype=np.uint16)       # bf16 NaN everywhere
            for kind, src in ((0, self.k), (1, self.v)):
                for h in range(d.num_kv_heads):
                    for p in range(num_pages):
                        at = p * blk + kind * v_off + h * kvh
                        flat[at: at + d.block_size * d.head_dim] = src[p, :, h, :].view(np.uint16).reshape(-1)
            self.bufs = [upload(flat, stream)]
            self.k_ptr, self.v_ptr = self.bufs[0].ptr, self.bufs[0].ptr + 2 * v_off
            self.strides = (blk, tok, kvh)

    def close(self) -> None:
        for b in self.bufs:
            b.close()


def schedule(pages: list[np.ndarray], tile: int, capacity: int, block_size: int, last_valid: int) -> list:
    """Tiles of ``tile`` pages per sequence: (blocks i32 [ns, capacity], counts i32 [ns], lbvs) each; the
    final tile gets ``last_valid``, the others full pages. Unused entries hold -1, which must never be read."""
    ns = len(pages)
    ntiles = max([1] + [ceil_div(len(p), tile) for p in pages])
    out = []
    for t in range(ntiles):
        blocks = np.full((ns, capacity), -1, dtype=np.int32)
        counts = np.zeros(ns, dtype=np.int32)
        for s, p in enumerate(pages):
            part = p[t * tile:(t + 1) * tile]
            blocks[s, :len(part)] = part
            counts[s] = len(part)
        out.append((blocks, counts, last_valid if t == ntiles - 1 else block_size))
    return out


def consumed(sched: list, ns: int, block_size: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """(pages, slots) of the tokens each sequence attends under ``sched`` (docs/design.md §6.3), in order."""
    pages: list[list[int]] = [[] for _ in range(ns)]
    slots: list[list[int]] = [[] for _ in range(ns)]
    for blocks, counts, lbvs in sched:
        for s in range(ns):
            n = int(counts[s])
            for b in range(n):
                lim = block_size if b < n - 1 else min(max(lbvs, 0), block_size)
                pages[s] += [int(blocks[s, b])] * lim
                slots[s] += list(range(lim))
    return [(np.array(p, dtype=np.int64), np.array(t, dtype=np.int64)) for p, t in zip(pages, slots)]


class Result:
    def __init__(self, out: np.ndarray, m: np.ndarray, l: np.ndarray, o: np.ndarray) -> None:
        self.out, self.m, self.l, self.o = out, m, l, o

    def bits(self) -> list[np.ndarray]:
        return [self.out.view(np.uint16), self.m.view(np.uint32), self.l.view(np.uint32), self.o.view(np.uint32)]


def run(ta: TiledAttention, stream, q_dev, pool: Pool, sched: list, num_seqs: int, fused: bool = False) -> Result:
    """Poison everything, then begin_step, one step_tile per tile, finalize (fused: the last step_tile writes
    the output instead); read back all max_seqs rows."""
    d = ta.dims
    for buf in (ta.m, ta.l, ta.o):
        cm.memset_d8_async(buf, 0xFF, buf.bytes, stream)
    rows = d.max_seqs * d.num_q_heads
    out = poisoned(2 * rows * d.head_dim, stream)
    keep = [out]
    ta.begin_step(stream, num_seqs)
    for i, (blocks, counts, lbvs) in enumerate(sched):
        tb, cn = upload(blocks[:num_seqs], stream), upload(counts[:num_seqs], stream)
        keep += [tb, cn]
        last = fused and i == len(sched) - 1
        ta.step_tile(stream, q_dev, pool.k_ptr, pool.v_ptr, tb, cn, num_seqs, *pool.strides, lbvs,
                     output=out if last else None)
    if not (fused and sched):
        ta.finalize(stream, out, num_seqs)
    res = Result(download(out, (d.max_seqs, d.num_q_heads, d.head_dim), BF16, stream),
                 download(ta.m, rows, np.float32, stream), download(ta.l, rows, np.float32, stream),
                 download(ta.o, (rows, d.head_dim), np.float32, stream))
    for b in keep:
        b.close()
    return res


def reference(q: np.ndarray, pool: Pool, tokens: list) -> np.ndarray:
    """Float64 softmax attention of each sequence over its consumed tokens: [ns, nq, hd]."""
    return np.stack([ref.attention(q[s], pool.k[p, t], pool.v[p, t]) for s, (p, t) in enumerate(tokens)])


def check(res: Result, q: np.ndarray, pool: Pool, tokens: list, num_seqs: int, what: str) -> np.ndarray:
    """The docs/design.md §0 bf16 bound per (seq, head) row, its mutation check, and the poison past num_seqs."""
    want = reference(q, pool, tokens)
    got = res.out[:num_seqs].astype(np.float64)
    assert_close(got, want, "bf16", (2,), what)
    with_tokens = [s for s, (p, _) in enumerate(tokens) if p.size]
    if with_tokens:   # drop the heaviest token of head 0 of one sequence: the bound must notice
        s = with_tokens[0]
        p, t = tokens[s]
        drop = int(np.argmax(ref.logits(q[s], pool.k[p, t])[:, 0]))
        mutated = want.copy()
        mutated[s] = ref.attention(q[s], np.delete(pool.k[p, t], drop, 0), np.delete(pool.v[p, t], drop, 0))
        assert_bites(got, mutated, "bf16", (2,), what)
    nq = q.shape[1]
    assert (res.out[num_seqs:].view(np.uint16) == 0xFFFF).all(), f"{what}: output rows past num_seqs were written"
    for name, arr in (("m", res.m), ("l", res.l), ("o", res.o)):
        assert (arr[num_seqs * nq:].view(np.uint32) == 0xFFFFFFFF).all(), f"{what}: {name} rows past num_seqs written"
    return want


def same_bits(a: Result, b: Result, what: str) -> None:
    for name, x, y in zip(("output", "m", "l", "o"), a.bits(), b.bits()):
        if not np.array_equal(x, y):
            n = int((x != y).sum())
            raise AssertionError(f"{what}: {name} differs in {n} of {x.size} entries")


# -- dims, strides, lifetime -------------------------------------------------------------------
@pytest.mark.parametrize("field,value,words", [
    ("num_kv_heads", 6, r"num_q_heads \(32\) must be a multiple of num_kv_heads \(6\)"),
    ("head_dim", 257, r"head_dim \(257\) must be <= 256"), ("max_seqs", 0, r"max_seqs must be > 0"),
    ("block_size", -1, r"block_size must be > 0"), ("tile_capacity", 0, r"tile_capacity must be > 0"),
    ("num_q_heads", 65536 * 8, "grid.y"), ("tile_capacity", 2**28, "must fit in int32")])
def test_dims_validate_rejects(field: str, value: int, words: str) -> None:
    with pytest.raises(HssError, match=words):
        replace(ORIGINAL, **{field: value}).validate()


def test_dims_types_and_ratio() -> None:
    ORIGINAL.validate()
    assert ORIGINAL.gqa_ratio == 4 and ORIGINAL.stripe_bytes == 4096
    assert ORIGINAL.max_units == 1 and ORIGINAL.workspace_bytes == 4 * (32 * 1 * (128 + 2) + 8 * 9)
    assert replace(ORIGINAL, tile_capacity=100, block_size=13).max_units == 6            # ceil(1300 / 256)
    assert replace(ORIGINAL, tile_capacity=100, block_size=13, head_dim=256).max_units == 11   # ceil(1300 / 128)
    assert replace(ORIGINAL, tile_capacity=10**6).max_units == 64                         # at most 64 units
    assert replace(ORIGINAL, num_kv_heads=2).merge_counters == 2 * 9                      # 16 q heads: one CTA row
    assert replace(ORIGINAL, num_kv_heads=1).merge_counters == 2 * 9                      # 32: two CTA rows
    assert replace(ORIGINAL, head_dim=72).workspace_bytes == 4 * (32 * (128 + 2) + 8 * 9)  # rows padded to 128


@given(st.integers(1, 1 << 24), st.integers(1, 4096), st.sampled_from([64, 128, 256]))
def test_units_are_balanced(n: int, ctas: int, hdp: int) -> None:
    """A tile's units: at most the launch's wanted count, multiples of a step for each warp, at least the HDP's
    smallest unit, and within one 64-token step of an even cut (no unit left near empty by rounding)."""
    from hss.decls import attention as ka
    want = min(ka.MAX_UNITS, ceil_div(ka.target_ctas(hdp), ctas))
    u = ka.unit_tokens(n, ctas, hdp)
    assert u % ka.UNIT_STEP == 0 and u >= ka.unit_min(hdp) and ceil_div(n, u) <= want
    assert u == ka.unit_min(hdp) or u - ceil_div(n, want) < ka.UNIT_STEP
    assert ka.unit_tokens(2052, 64, 256) == 1088 and ka.unit_tokens(33000, 8, 128) == 1088   # 2 and 31 units


@pytest.mark.parametrize("field", ["max_seqs", "num_q_heads", "num_kv_heads", "head_dim", "block_size",
                                   "tile_capacity"])
@pytest.mark.parametrize("bad", [128.0, float("nan"), True, np.bool_(True), "128", None, np.float32(1)], ids=repr)
def test_dims_types_refused_at_construction(field: str, bad) -> None:
    with pytest.raises(TypeError, match=f"TiledAttentionDims.{field} must be an int"):
        replace(ORIGINAL, **{field: bad})


def test_dims_numpy_ints_become_python_ints() -> None:
    d = TiledAttentionDims(np.int32(4), np.int16(32), np.int64(8), np.uint8(128), np.int32(16), np.int32(1 << 16))
    assert all(type(getattr(d, f)) is int for f in d.__dataclass_fields__)
    d.validate()
    assert d == replace(ORIGINAL, max_seqs=4, tile_capacity=1 << 16)
    assert d.max_units == 64 and type(d.workspace_bytes) is int
    assert d.workspace_bytes == 4 * (4 * 32 * 64 * (128 + 2) + 4 * 8 * 9)   # at most 64 units


def test_strides(ctx) -> None:
    with TiledAttention(ctx, ORIGINAL) as ta:
        assert ta.paged_strides() == (16 * 8 * 128, 8 * 128, 128)
        assert ta.scratch_pool_strides() == (2 * 8 * 2048, 128, 2048, 8 * 2048)     # unpadded: 4096-byte stripes
        assert ta.scratch_pool_strides(8192) == (2 * 8 * 4096, 128, 4096, 8 * 4096)
        with pytest.raises(HssError, match="must be even"):
            ta.scratch_pool_strides(4097)
        with pytest.raises(HssError, match=r"smaller than one stripe \(block_size\*head_dim\*2 = 4096"):
            ta.scratch_pool_strides(4094)
    with TiledAttention(ctx, replace(ORIGINAL, block_size=8)) as ta:     # 2 KiB stripes padded to 4 KiB
        assert ta.scratch_pool_strides(4096) == (2 * 8 * 2048, 128, 2048, 8 * 2048)


def test_lifetime(ctx) -> None:
    ta = TiledAttention.new(ORIGINAL)
    assert ta.m.bytes == 4 * 32 and ta.o.bytes == 4 * 32 * 128 and not ta.closed
    ta.close()
    ta.close()
    assert ta.closed and ta.m.closed and ta.o.closed
    with pytest.raises(HssError, match="closed"):
        ta.begin_step(ctx, 1)
    with TiledAttention(ctx, ORIGINAL) as ta2:
        pass
    assert ta2.closed
    with pytest.raises(TypeError, match="TiledAttentionDims"):
        TiledAttention(ctx, (1, 32, 8, 128, 16, 16))


DEVICE_WORK = ("cuLaunchKernel", "cuMemsetD8Async", "cuMemsetD32Async", "cuMemcpyHtoDAsync", "cuMemcpyDtoHAsync",
               "cuMemcpyDtoDAsync", "cuEventRecord", "cuStreamWaitEvent")


@pytest.fixture
def launches(monkeypatch: pytest.MonkeyPatch) -> list:
    """Records every launch (its function handle) and every other queued operation (its driver call's name) that
    reaches the driver, and makes none."""
    seen: list = []

    def recorder(name: str):
        def record(*args):
            seen.append(int(args[0]) if name == "cuLaunchKernel" else name)
            return (0,)
        return record

    for name in DEVICE_WORK:
        monkeypatch.setattr(_driver.api, name, recorder(name))
    return seen


class Tensor:
    """What PyTorch / CuPy expose: ``__cuda_array_interface__`` v3 (bf16 as ``<V2``: the interface has no bf16)."""

    def __init__(self, buf: cm.DeviceBuffer, shape: tuple, typestr: str, strides=None, readonly: bool = False,
                 stream: int | None = None) -> None:
        self.__cuda_array_interface__ = {"shape": shape, "typestr": typestr, "data": (buf.ptr, readonly),
                                         "version": 3, "strides": strides, "stream": stream}


def test_bad_arguments_raise_before_any_launch(ctx, stream, launches: list) -> None:
    d = replace(ORIGINAL, max_seqs=2, tile_capacity=4)
    with TiledAttention(ctx, d) as ta:
        q = cm.DeviceBuffer(2 * 2 * 32 * 128)
        pool = cm.DeviceBuffer(1 << 16)
        tb, cn = cm.DeviceBuffer(4 * 2 * 4), cm.DeviceBuffer(4 * 2)
        out = cm.DeviceBuffer(2 * 2 * 32 * 128)
        strides = ta.paged_strides()
        good = (q, pool, pool, tb, cn, 2, *strides, 16)

        def step(**change):
            names = ("q", "k_pool", "v_pool", "tile_blocks", "tile_block_counts", "num_seqs", "blk_stride",
                     "tok_stride", "kvh_stride", "last_block_valid_slots")
            args = dict(zip(names, good), **change)
            ta.step_tile(stream, *args.values())

        for bad, err, words in [
            (dict(num_seqs=3), HssError, r"num_seqs = 3 must be in 0..2: at most max_seqs \(2\)"),
            (dict(num_seqs=-1), HssError, "num_seqs"), (dict(num_seqs=1.0), TypeError, "num_seqs must be an int"),
            (dict(blk_stride=-1), HssError, r"blk_stride = -1 must be in 0..4611686018427387903: element strides"),
            (dict(kvh_stride=-128), HssError, "kvh_stride"), (dict(tok_stride=True), TypeError, "tok_stride"),
            (dict(q=0), HssError, "q is a null pointer"), (dict(k_pool=0), HssError, "k_pool is a null pointer"),
            (dict(v_pool=pool.ptr + 1), HssError, "v_pool .* must be 2-byte aligned"),
            (dict(tile_blocks=tb.ptr + 2), HssError, "tile_blocks .* must be 4-byte aligned"),
            (dict(q=cm.DeviceBuffer(64)), HssError, "q holds 64 bytes but 16384 are needed"),
            (dict(tile_blocks=cm.DeviceBuffer(16)), HssError, "tile_blocks holds 16 bytes but 32 are needed"),
            (dict(last_block_valid_slots=2**31), HssError, "last_block_valid_slots = 2147483648 must be in"),
            (dict(last_block_valid_slots=None), TypeError, "last_block_valid_slots"),
            (dict(q=1.5), TypeError, "device pointer")]:
            with pytest.raises(err, match=words):
                step(**bad)
        with pytest.raises(HssError, match=r"num_seqs = 5 must be in 0..2"):
            ta.begin_step(stream, 5)
        with pytest.raises(TypeError, match="stream"):
            ta.begin_step(None, 1)
        with pytest.raises(HssError, match="output holds 64 bytes"):
            ta.finalize(stream, cm.DeviceBuffer(64), 2)
        with pytest.raises(HssError, match="output is a null pointer"):
            ta.finalize(stream, 0, 1)
        closed = cm.DeviceBuffer(64)
        closed.close()
        with pytest.raises(HssError, match="output is a closed DeviceBuffer"):
            ta.finalize(stream, closed, 1)
        ta.begin_step(stream, 0)            # zero sequences: nothing to do
        step(num_seqs=0)
        ta.finalize(stream, out, 0)
        assert launches == []
        step()                              # the control: the same call with good arguments launches (after the
        assert launches == ["cuMemsetD32Async", ta._step_fn.handle]   # counters' one-time reset, on its stream)


BAD_INTS = [1.0, float("nan"), True, np.bool_(True), "1", None, np.float64(1)]


@pytest.mark.parametrize("bad", BAD_INTS, ids=repr)
def test_non_int_arguments_are_type_errors(ctx, stream, launches: list, bad) -> None:
    """Every int parameter (and every pointer and the stream) refuses float, NaN, bool, str, None: a TypeError
    naming it, before anything is queued."""
    d = replace(ORIGINAL, max_seqs=2, tile_capacity=4)
    with TiledAttention(ctx, d) as ta:
        q, pool, out = cm.DeviceBuffer(2 * 2 * 32 * 128), cm.DeviceBuffer(1 << 16), cm.DeviceBuffer(2 * 2 * 32 * 128)
        tb, cn = cm.DeviceBuffer(4 * 2 * 4), cm.DeviceBuffer(4 * 2)
        names = ("q", "k_pool", "v_pool", "tile_blocks", "tile_block_counts", "num_seqs", "blk_stride", "tok_stride",
                 "kvh_stride", "last_block_valid_slots")
        good = dict(zip(names, (q, pool, pool, tb, cn, 2, *ta.paged_strides(), 16)))
        for name in names:
            with pytest.raises(TypeError, match=rf"^{name}\b"):
                ta.step_tile(stream, *dict(good, **{name: bad}).values())
            with pytest.raises(TypeError, match=rf"^{name}\b"):
                ta.step_tile_on_stream(stream, *dict(good, **{name: bad}).values(), output=out)
        if bad is not None:   # output=None means "no output"
            with pytest.raises(TypeError, match=r"^output\b"):
                ta.step_tile(stream, *good.values(), output=bad)
        cases = [("num_seqs", lambda: ta.begin_step(stream, bad)), ("num_seqs", lambda: ta.finalize(stream, out, bad)),
                 ("output", lambda: ta.finalize_on_stream(stream, bad, 1)), ("stream", lambda: ta.begin_step(bad, 1)),
                 ("stream", lambda: ta.step_tile(bad, *good.values())), ("stream", lambda: ta.finalize(bad, out, 1))]
        if bad is not None:   # group_stride_bytes=None means "unpadded"
            cases.append(("group_stride_bytes", lambda: ta.scratch_pool_strides(bad)))
        for name, call in cases:
            with pytest.raises(TypeError, match=rf"^{name}\b"):
                call()
        assert launches == []
        for b in (q, pool, out, tb, cn):
            b.close()


def test_bad_device_arrays_raise_before_any_launch(ctx, stream, launches: list) -> None:
    """Closed buffers, too-small buffers (DeviceBuffer, DeviceView, CUDA array interface, an address inside a
    live buffer), wrong dtypes and read-only outputs are refused by name before anything is queued."""
    d = replace(ORIGINAL, max_seqs=2, tile_capacity=4)
    qbytes = 2 * 2 * 32 * 128                  # two sequences of bf16 [32, 128]
    pool_min = 2 * (7 * 128 + 128)             # one token row of each of the 8 kv heads at kvh_stride 128
    with TiledAttention(ctx, d) as ta:
        q, pool, out = cm.DeviceBuffer(qbytes), cm.DeviceBuffer(1 << 16), cm.DeviceBuffer(qbytes)
        tb, cn = cm.DeviceBuffer(4 * 2 * 4), cm.DeviceBuffer(4 * 2)
        closed = cm.DeviceBuffer(1 << 16)
        closed_view = closed.view("bf16")
        closed.close()
        names = ("q", "k_pool", "v_pool", "tile_blocks", "tile_block_counts")
        good = dict(zip(names, (q, pool, pool, tb, cn)))
        rest = (2, *ta.paged_strides(), 16)

        def step(output=None, **change):
            ta.step_tile(stream, *dict(good, **change).values(), *rest, output=output)

        cases = [(lambda: step(output=closed), "output is a closed DeviceBuffer"),
                 (lambda: step(output=closed_view), "output is a view of a closed DeviceBuffer"),
                 (lambda: ta.finalize(stream, closed_view, 1), "output is a view of a closed"),
                 (lambda: step(q=pool.view("bf16", (8191,))), f"q holds 16382 bytes but {qbytes} are needed"),
                 (lambda: step(q=Tensor(q, (2, 32, 127), "<V2")), f"q holds 16256 bytes but {qbytes}"),
                 (lambda: step(k_pool=cm.DeviceBuffer(64)), f"k_pool holds 64 bytes but {pool_min} are needed"),
                 (lambda: step(v_pool=pool.view("bf16", (1023,))), f"v_pool holds 2046 bytes but {pool_min}"),
                 (lambda: step(v_pool=pool.ptr + (1 << 16) - 1024), f"v_pool: {pool_min} bytes at offset 64512 run "
                                                                      "past the end of its 65536-byte buffer"),
                 (lambda: step(tile_blocks=tb.view("i32", (7,))), "tile_blocks holds 28 bytes but 32 are needed"),
                 (lambda: step(tile_block_counts=Tensor(cn, (1,), "<i4")), "tile_block_counts holds 4 bytes but 8"),
                 (lambda: step(tile_block_counts=cn.ptr + 4), "tile_block_counts: 8 bytes at offset 4 run past"),
                 (lambda: step(output=out.view("bf16", (2, 32, 100))), f"output holds 12800 bytes but {qbytes}"),
                 (lambda: ta.finalize(stream, Tensor(out, (32, 128), "<V2"), 2), "output holds 8192 bytes but"),
                 (lambda: step(q=q.view("f32")), "q holds f32 but bf16 is needed"),
                 (lambda: step(k_pool=pool.view("f16")), "k_pool holds f16 but bf16 is needed"),
                 (lambda: step(v_pool=Tensor(pool, (16384,), "<f4")), "v_pool holds f32 but bf16"),
                 (lambda: step(tile_blocks=tb.view("f32")), "tile_blocks holds f32 but i32 is needed"),
                 (lambda: step(tile_block_counts=cn.view("u32")), "tile_block_counts holds u32 but i32 is needed"),
                 (lambda: step(output=out.view("f32")), "output holds f32 but bf16 is needed"),
                 (lambda: ta.finalize(stream, out.view("i16"), 2), "output holds i16 but bf16"),
                 (lambda: step(output=Tensor(out, (2, 32, 128), "<V2", readonly=True)), "output is read-only"),
                 (lambda: ta.finalize(stream, Tensor(out, (2, 32, 128), "<V2", readonly=True), 2), "output is read")]
        cases += [(lambda name=name: step(**{name: closed}), f"{name} is a closed DeviceBuffer") for name in names]
        cases += [(lambda name=name: step(**{name: closed_view}), f"{name} is a view of a closed") for name in names]
        for call, words in cases:
            with pytest.raises(HssError, match=words):
                call()
        assert launches == []
        # the controls: read-only inputs and typed views of the right dtype are fine
        ta.begin_step(stream, 2)
        step(q=Tensor(q, (2, 32, 128), "<V2", readonly=True), k_pool=pool.view("bf16"),
             tile_blocks=Tensor(tb, (2, 4), "<i4", readonly=True), tile_block_counts=cn.view("i32"),
             output=out.view("bf16", (2, 32, 128)))
        ta.finalize(stream, Tensor(out, (2, 32, 128), "<V2"), 2)
        assert launches == ["cuMemsetD32Async", ta._step_fn.handle, ta._fin_fn.handle]
        # an array's own stream is ordered before the call's (an event recorded there, waited on here)
        with cm.CudaStream(ctx) as producer:
            launches.clear()
            step(tile_blocks=Tensor(tb, (2, 4), "<i4", stream=producer.handle))
            assert launches == ["cuEventRecord", "cuStreamWaitEvent", ta._step_fn.handle]
        for b in (q, pool, out, tb, cn):
            b.close()


def test_closed_tiled_attention_refuses_every_call(ctx, stream, launches: list) -> None:
    ta = TiledAttention(ctx, replace(ORIGINAL, max_seqs=2, tile_capacity=4))
    q, pool, out = cm.DeviceBuffer(2 * 2 * 32 * 128), cm.DeviceBuffer(1 << 16), cm.DeviceBuffer(2 * 2 * 32 * 128)
    tb, cn = cm.DeviceBuffer(4 * 2 * 4), cm.DeviceBuffer(4 * 2)
    args = (q, pool, pool, tb, cn, 2, *ta.paged_strides(), 16)
    ta.close()
    for call in (lambda: ta.begin_step(stream, 1), lambda: ta.begin_step_on_stream(stream, 1),
                 lambda: ta.step_tile(stream, *args), lambda: ta.step_tile_on_stream(stream, *args, output=out),
                 lambda: ta._next_tile(stream, tb.ptr, cn.ptr, 16, 0), lambda: ta.finalize(stream, out, 2),
                 lambda: ta.finalize_on_stream(stream, out, 0)):
        with pytest.raises(HssError, match="this TiledAttention is closed"):
            call()
    assert launches == []
    for b in (q, pool, out, tb, cn):
        b.close()


def test_the_two_names_and_next_tile(ctx, stream, rng) -> None:
    """``begin_step`` / ``begin_step_on_stream`` (and the others) are one method; ``_next_tile`` (hss.swap's hot
    loop: one sequence, the q, pools and strides of the last step_tile) gives step_tile's bits."""
    for a in ("begin_step", "step_tile", "finalize"):
        assert getattr(TiledAttention, a) is getattr(TiledAttention, a + "_on_stream")
    dims = TiledAttentionDims(max_seqs=1, num_q_heads=8, num_kv_heads=2, head_dim=64, block_size=16, tile_capacity=2)
    ta, q, q_dev, pool = setup(ctx, stream, rng, dims, 6, "unit")
    sched = schedule([rng.permutation(6)[:5]], 2, 2, 16, 9)
    tables = [(upload(b, stream), upload(c, stream), lbvs) for b, c, lbvs in sched]
    outs = [poisoned(2 * 8 * 64, stream) for _ in range(2)]
    for out, fast in zip(outs, (False, True)):
        ta.begin_step(ctx, 1)
        for i, (tb, cn, lbvs) in enumerate(tables):
            last = out if i == len(tables) - 1 else None
            if fast and i:
                ta._next_tile(stream, tb.ptr, cn.ptr, lbvs, 0 if last is None else last.ptr)
            else:
                ta.step_tile(ctx, q_dev, pool.k_ptr, pool.v_ptr, tb, cn, 1, *pool.strides, lbvs, output=last)
    a, b = (download(o, (1, 8, 64), BF16, stream) for o in outs)
    assert np.array_equal(a.view(np.uint16), b.view(np.uint16))
    res = Result(a, *(np.zeros(0, np.float32) for _ in range(3)))
    check(res, q, pool, consumed(sched, 1, 16), 1, "step_tile then _next_tile")
    for x in (*outs, *(t for tb, cn, _ in tables for t in (tb, cn)), ta, pool):
        x.close()


def test_tile_step_gives_step_tile_bits(ctx, stream, rng) -> None:
    """``begin_tiles`` + ``TileStep.tile`` (checked once per step) is the same launch as ``begin_step`` +
    ``step_tile``: the same bits, at Qwen3.8's 24 q / 2 kv heads x 256 (12 query heads of a kv head in one CTA)."""
    dims = TiledAttentionDims(max_seqs=2, num_q_heads=24, num_kv_heads=2, head_dim=256, block_size=16,
                              tile_capacity=8)
    ta, q, q_dev, pool = setup(ctx, stream, rng, dims, 40, "small")
    pages = [rng.permutation(40)[:n] for n in (30, 17)]
    sched = schedule(pages, 8, 8, 16, 11)
    tables = [(upload(b, stream), upload(c, stream), lbvs) for b, c, lbvs in sched]
    outs = [poisoned(2 * 2 * 24 * 256, stream) for _ in range(2)]
    ta.begin_step(stream, 2)
    for i, (tb, cn, lbvs) in enumerate(tables):
        ta.step_tile(stream, q_dev, pool.k_ptr, pool.v_ptr, tb, cn, 2, *pool.strides, lbvs,
                     output=outs[0] if i == len(tables) - 1 else None)
    step = ta.begin_tiles(stream, q_dev, pool.k_ptr, pool.v_ptr, 2, *pool.strides)
    for i, (tb, cn, lbvs) in enumerate(tables):
        step.tile(tb, cn, lbvs, output=outs[1] if i == len(tables) - 1 else None)
    a, b = (download(o, (2, 24, 256), BF16, stream) for o in outs)
    assert np.array_equal(a.view(np.uint16), b.view(np.uint16))
    check(Result(a, *(np.zeros(0, np.float32) for _ in range(3))), q, pool, consumed(sched, 2, 16), 2, "tiles")
    with pytest.raises(HssError, match="tile_blocks holds 16 bytes but 64 are needed"):
        step.tile(cm.DeviceBuffer(16), tables[0][1], 16)
    with pytest.raises(TypeError, match="last_block_valid_slots"):
        step.tile(tables[0][0], tables[0][1], 1.5)
    with pytest.raises(HssError, match="blk_stride"):
        ta.begin_tiles(stream, q_dev, pool.k_ptr, pool.v_ptr, 2, -1, 0, 0)
    for x in (*outs, *(t for tb, cn, _ in tables for t in (tb, cn)), ta, pool):
        x.close()


@pytest.mark.parametrize("head_dim", [128, 256])
def test_overlapped_tiles_give_the_same_bits(ctx, stream, rng, monkeypatch, head_dim: int) -> None:
    """``overlap_tiles=True`` (the paged_decode_attn_pdl module): a TileStep's first tile is a plain launch, every
    later one a cuLaunchKernelEx with programmatic stream serialization; the bits (output, m, l, o) equal the plain
    TiledAttention's, queued directly or replayed from a CUDA graph. (On the emulator the launches run in order; the
    overlap and its waits are the GPU's to show.)"""
    from hss.cuda import _driver
    dims = TiledAttentionDims(max_seqs=2, num_q_heads=24 if head_dim == 256 else 32,
                              num_kv_heads=2 if head_dim == 256 else 8, head_dim=head_dim, block_size=16,
                              tile_capacity=8)
    plain, q, q_dev, pool = setup(ctx, stream, rng, dims, 40, "small")
    over = TiledAttention(ctx, dims, overlap_tiles=True)
    assert over.overlap_tiles and not plain.overlap_tiles
    pages = [rng.permutation(40)[:n] for n in (30, 17)]
    tables = [(upload(b, stream), upload(c, stream), lbvs) for b, c, lbvs in schedule(pages, 8, 8, 16, 11)]
    calls: list = []
    for name in ("cuLaunchKernel", "cuLaunchKernelEx"):
        real = getattr(_driver.api, name)
        monkeypatch.setattr(_driver.api, name, lambda *a, _n=name, _r=real: (calls.append(_n), _r(*a))[1])
    results = []
    for ta in (plain, over):
        outs = poisoned(2 * 2 * dims.num_q_heads * head_dim, stream)
        calls.clear()
        step = ta.begin_tiles(stream, q_dev, pool.k_ptr, pool.v_ptr, 2, *pool.strides)
        for i, (tb, cn, lbvs) in enumerate(tables):
            step.tile(tb, cn, lbvs, output=outs if i == len(tables) - 1 else None)
        want = ["cuLaunchKernel"] + ["cuLaunchKernelEx" if ta.overlap_tiles else "cuLaunchKernel"] * (len(tables) - 1)
        assert calls == want
        rows = 2 * dims.num_q_heads
        results.append(Result(download(outs, (2, dims.num_q_heads, head_dim), BF16, stream),
                              download(ta.m, rows, np.float32, stream), download(ta.l, rows, np.float32, stream),
                              download(ta.o, (rows, head_dim), np.float32, stream)))
        outs.close()
    same_bits(results[0], results[1], "overlapped tiles")
    check(results[1], q, pool, consumed(schedule(pages, 8, 8, 16, 11), 2, 16), 2, "overlapped tiles")
    # a TileStep used again after another begin_step (as the model's layers do): that step's first tile is plain
    # (the stream's last kernel is not this step's); a tile on another stream is plain too
    other = cm.CudaStream()
    for n_tiles in (2, 3):
        calls.clear()
        over.begin_step(stream, 2)
        for tb, cn, lbvs in tables[:n_tiles]:
            step.tile(tb, cn, lbvs)
        assert calls == ["cuLaunchKernel"] + ["cuLaunchKernelEx"] * (n_tiles - 1)
    calls.clear()
    step2 = over.begin_tiles(other, q_dev, pool.k_ptr, pool.v_ptr, 2, *pool.strides)
    step.tile(*tables[0])
    cm.stream_sync(stream)   # (the two streams share the state: ordered)
    step2.tile(*tables[1])
    step2.tile(*tables[2])
    fin = poisoned(2 * 2 * dims.num_q_heads * head_dim, other)
    over.finalize(other, fin, 2)
    step2.tile(*tables[3])
    # step's tile (plain), step2's first on the other stream (plain), its second (Ex), finalize, a tile after it
    assert calls == ["cuLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cuLaunchKernel", "cuLaunchKernel"]
    cm.stream_sync(other)
    fin.close()
    other.close()
    # a step captured into a graph: its first tile is plain again, the replay gives the same bits
    outs = poisoned(2 * 2 * dims.num_q_heads * head_dim, stream)
    calls.clear()
    cm.begin_capture(stream)
    try:
        step = over.begin_tiles(stream, q_dev, pool.k_ptr, pool.v_ptr, 2, *pool.strides)
        for i, (tb, cn, lbvs) in enumerate(tables):
            step.tile(tb, cn, lbvs, output=outs if i == len(tables) - 1 else None)
    finally:
        graph = cm.end_capture(stream)
    assert calls == want
    graph.launch(stream)
    replay = download(outs, (2, dims.num_q_heads, head_dim), BF16, stream)
    assert np.array_equal(replay.view(np.uint16), results[0].out.view(np.uint16))
    graph.close()
    outs.close()
    for x in (*(t for tb, cn, _ in tables for t in (tb, cn)), plain, over, pool):
        x.close()


def test_a_tile_step_refills_what_another_launch_changed(ctx, stream, rng) -> None:
    """A TileStep writes its q, pools and strides into the shared prepared launch only when another call changed
    them since: a ``step_tile`` with another query between two of its tiles does not leak into the next tile (the
    same bits as three ``step_tile`` calls with those arguments)."""
    dims = TiledAttentionDims(max_seqs=2, num_q_heads=8, num_kv_heads=2, head_dim=64, block_size=16, tile_capacity=8)
    ta, q, q_dev, pool = setup(ctx, stream, rng, dims, 24, "small")
    q2 = upload(randn(rng, q.shape, 1.0), stream)
    sched = schedule([rng.permutation(24)[:20] for _ in range(2)], 8, 8, 16, 16)
    tables = [(upload(b, stream), upload(c, stream), lbvs) for b, c, lbvs in sched]
    outs = [poisoned(2 * 2 * 8 * 64, stream) for _ in range(2)]
    queries = [q_dev, q2, q_dev]
    ta.begin_step(stream, 2)
    for i, ((tb, cn, lbvs), qq) in enumerate(zip(tables, queries)):
        ta.step_tile(stream, qq, pool.k_ptr, pool.v_ptr, tb, cn, 2, *pool.strides, lbvs,
                     output=outs[0] if i == 2 else None)
    step = ta.begin_tiles(stream, q_dev, pool.k_ptr, pool.v_ptr, 2, *pool.strides)
    step.tile(*tables[0])
    ta.step_tile(stream, q2, pool.k_ptr, pool.v_ptr, tables[1][0], tables[1][1], 2, *pool.strides, tables[1][2])
    step.tile(*tables[2], output=outs[1])
    a, b = (download(o, (2, 8, 64), BF16, stream) for o in outs)
    assert np.array_equal(a.view(np.uint16), b.view(np.uint16))
    for x in (*outs, q2, *(t for tb, cn, _ in tables for t in (tb, cn)), ta, pool):
        x.close()


@pytest.mark.gpu
@pytest.mark.parametrize("shape,tile", [((32, 8, 128), 4), ((32, 8, 128), 32), ((24, 2, 256), 16)])
def test_overlapped_tiles_stress(ctx, stream, rng, shape, tile: int) -> None:
    """On a GPU, where the overlap is real: many tiles of one step (one-unit tiles folding in their CTA, and
    multi-unit tiles folding in levels), each step queued five times back to back; every overlapped step's output
    and state equal the plain step's bits."""
    nq, nkv, hd = shape
    npages = 256
    dims = TiledAttentionDims(max_seqs=2, num_q_heads=nq, num_kv_heads=nkv, head_dim=hd, block_size=16,
                              tile_capacity=tile)
    plain, q, q_dev, pool = setup(ctx, stream, rng, dims, 2 * npages, "small")
    over = TiledAttention(ctx, dims, overlap_tiles=True)
    perm = rng.permutation(2 * npages)
    sched = schedule([perm[:npages], perm[npages:]], tile, tile, 16, 16)
    tables = [(upload(b, stream), upload(c, stream), lbvs) for b, c, lbvs in sched]
    rows = 2 * nq
    outs = {ta: poisoned(2 * rows * hd, stream) for ta in (plain, over)}
    got = {}
    for ta in (plain, over):
        for _ in range(5):
            step = ta.begin_tiles(stream, q_dev, pool.k_ptr, pool.v_ptr, 2, *pool.strides)
            for i, (tb, cn, lbvs) in enumerate(tables):
                step.tile(tb, cn, lbvs, output=outs[ta] if i == len(tables) - 1 else None)
        got[ta] = Result(download(outs[ta], (2, nq, hd), BF16, stream), download(ta.m, rows, np.float32, stream),
                         download(ta.l, rows, np.float32, stream), download(ta.o, (rows, hd), np.float32, stream))
    same_bits(got[plain], got[over], f"overlapped {len(tables)} tiles of {tile} pages")
    for x in (*outs.values(), *(t for tb, cn, _ in tables for t in (tb, cn)), plain, over, pool):
        x.close()


def test_overlap_tiles_argument(ctx) -> None:
    with pytest.raises(TypeError, match="overlap_tiles must be a bool"):
        TiledAttention(ctx, replace(ORIGINAL, max_seqs=1), overlap_tiles=1)


@given(counts=st.lists(st.integers(-5, 120), min_size=2, max_size=2), offset=st.integers(0, 40),
       seed=st.integers(0, 2**32 - 1))
def test_token_count_tiles(ctx, stream, counts: list[int], offset: int, seed: int) -> None:
    """``TileStep.tile_tokens``: the device's token counts minus a host offset, clamped to the tile, decide its
    tokens (page j holding tokens j * block_size ..); the same bits as the page-count tile of those tokens (two
    sequences of one length), the float64 bound per sequence otherwise, the state fresh or carried."""
    rng = np.random.default_rng(seed)
    dims = TiledAttentionDims(max_seqs=2, num_q_heads=8, num_kv_heads=2, head_dim=64, block_size=16, tile_capacity=6)
    ta, q, q_dev, pool = setup(ctx, stream, rng, dims, 9, "unit")
    pages = [rng.permutation(9)[:6].astype(np.int32) for _ in range(2)]
    blocks = upload(np.stack(pages), stream)
    lens = [min(max(c - offset, 0), 6 * 16) for c in counts]
    cnt = upload(np.array(counts, np.int32), stream)
    outs = [poisoned(2 * 2 * 8 * 64, stream) for _ in range(2)]
    tokens = [(np.repeat(p[:ceil_div(n, 16)].astype(np.int64), 16)[:n], np.arange(n, dtype=np.int64) % 16)
              for p, n in zip(pages, lens)]
    ta.begin_tiles(stream, q_dev, pool.k_ptr, pool.v_ptr, 2, *pool.strides).tile_tokens(blocks, cnt, offset, outs[0])
    got = Result(download(outs[0], (2, 8, 64), BF16, stream), *(np.zeros(0, np.float32) for _ in range(3)))
    for s in range(2):
        if lens[s]:
            assert_close(got.out[s].astype(np.float64), reference(q[s:s + 1], pool, tokens[s:s + 1])[0], "bf16", (1,),
                         f"token tile of {lens[s]} tokens")
        else:   # nothing attended: a fresh state writes 0
            assert not got.out[s].astype(np.float32).any()
    n = lens[0]   # both sequences n tokens: the page-count tile with the same tokens gives the same bits
    same = upload(np.array([counts[0]] * 2, np.int32), stream)
    step = ta.begin_tiles(stream, q_dev, pool.k_ptr, pool.v_ptr, 2, *pool.strides)
    step.tile(blocks, upload(np.full(2, 1, np.int32), stream), 16)   # a first tile: the state is carried
    step.tile_tokens(blocks, same, offset, outs[0])
    step = ta.begin_tiles(stream, q_dev, pool.k_ptr, pool.v_ptr, 2, *pool.strides)
    step.tile(blocks, upload(np.full(2, 1, np.int32), stream), 16)
    step.tile(blocks, upload(np.full(2, ceil_div(n, 16), np.int32), stream), n - 16 * (ceil_div(n, 16) - 1) if n else 0,
              outs[1])
    a, b = (download(o, (2, 8, 64), BF16, stream) for o in outs)
    assert np.array_equal(a.view(np.uint16), b.view(np.uint16)), f"token tile of {n} tokens vs its page tile"
    with pytest.raises(HssError, match="token_offset"):
        step.tile_tokens(blocks, cnt, -1)
    with pytest.raises(TypeError, match="token_offset"):
        step.tile_tokens(blocks, cnt, 1.5)
    for x in (*outs, blocks, cnt, same, ta, pool):
        x.close()


def test_an_output_into_the_attention_state_is_refused(ctx, stream, launches: list) -> None:
    """An output inside TiledAttention's own state or workspace (m, l, o, partials, counters) is refused before any
    device work, by step_tile, TileStep.tile and finalize alike: the step would overwrite what it folds into."""
    d = replace(ORIGINAL, max_seqs=1, tile_capacity=4)
    with TiledAttention(ctx, d) as ta:
        q, pool = cm.DeviceBuffer(2 * 32 * 128), cm.DeviceBuffer(1 << 16)
        tb, cn = cm.DeviceBuffer(16), cm.DeviceBuffer(4)
        ta.begin_step(stream, 1)
        for inside, label in ((ta.o.ptr, "its o"), (ta._part_o.ptr + 64, "its partials")):
            with pytest.raises(HssError, match=f"output .*{label}"):
                ta.step_tile(stream, q, pool, pool, tb, cn, 1, *ta.paged_strides(), 16, output=inside)
            with pytest.raises(HssError, match=f"output .*{label}"):
                ta.begin_tiles(stream, q, pool, pool, 1, *ta.paged_strides()).tile(tb, cn, 16, output=inside)
            with pytest.raises(HssError, match=f"output .*{label}"):
                ta.finalize(stream, inside, 1)
        assert launches == []


def test_tiles_need_begin_step_and_counters_reset_on_the_tile_stream(ctx, stream, launches: list) -> None:
    """A fresh TiledAttention refuses tiles and finalize before any begin_step (they would fold into an
    uninitialised state); the fold counters' one-time reset is queued on the stream of the first tile, not on
    begin_step's (a tile on another stream would not be ordered after it)."""
    d = replace(ORIGINAL, max_seqs=1, tile_capacity=4)
    with TiledAttention(ctx, d) as ta:
        q, pool = cm.DeviceBuffer(2 * 32 * 128), cm.DeviceBuffer(1 << 16)
        tb, cn, out = cm.DeviceBuffer(16), cm.DeviceBuffer(4), cm.DeviceBuffer(2 * 32 * 128)
        args = (q, pool, pool, tb, cn, 1, *ta.paged_strides(), 16)
        with pytest.raises(HssError, match="a tile before any begin_step"):
            ta.step_tile(stream, *args)
        with pytest.raises(HssError, match="finalize before any begin_step"):
            ta.finalize(stream, out, 1)
        assert launches == []
        other = cm.CudaStream()
        memsets = []
        real = _driver.api.cuMemsetD32Async
        _driver.api.cuMemsetD32Async = lambda *a: (memsets.append(int(a[-1])), real(*a))[1]
        try:
            ta.begin_step(stream, 1)
            ta.step_tile(other, *args)
        finally:
            _driver.api.cuMemsetD32Async = real
        assert memsets == [other.handle] and launches[-1] == ta._step_fn.handle
        other.close()


# -- remembered checks (docs/design.md, "Remembered checks") -----------------------------------------
TILE_SLOTS = ("q", "k_pool", "v_pool", "tile_blocks", "tile_block_counts", "out", "blk_stride", "tok_stride",
              "kvh_stride", "last_block_valid_slots", "fresh")
QBYTES = 2 * 2 * 32 * 128                  # two sequences of bf16 [32, 128] (ORIGINAL's heads)
POOL_MIN = 2 * (7 * 128 + 128)             # one token row of each of the 8 kv heads at kvh_stride 128


class Tiles:
    """The tile launches that reach the driver, each as {slot: value} of the watched TiledAttentions' tile slots
    (``watch(ta)``), and every other queued operation by its driver call's name; nothing is launched."""

    def __init__(self) -> None:
        self.seen: list = []
        self._packs: dict = {}

    def watch(self, ta: TiledAttention) -> TiledAttention:
        self._packs[ta._step_pack.address] = ta._step_pack
        return ta

    def recorder(self, name: str):
        def record(*args):
            pack = self._packs.get(int(args[9])) if name == "cuLaunchKernel" else None
            self.seen.append(name if pack is None else dict(
                {k: v for k, v in zip(pack.names, pack.values()) if k in TILE_SLOTS}, grid=args[1:4]))
            return (0,)
        return record

    def launched(self, t: TiledAttention, call) -> list:
        """The tile launches of ``call(t)``, or its error's words."""
        del self.seen[:]
        try:
            call(t)
        except HssError as exc:
            return [str(exc)]
        return [s for s in self.seen if isinstance(s, dict)]


@pytest.fixture
def tiles(monkeypatch: pytest.MonkeyPatch) -> Tiles:
    t = Tiles()
    for name in DEVICE_WORK:
        monkeypatch.setattr(_driver.api, name, t.recorder(name))
    return t


def full_checks(monkeypatch: pytest.MonkeyPatch, ta: TiledAttention) -> list:
    """Counts the tile calls of ``ta`` that ran their full checks (one entry each)."""
    ran: list = []
    real = ta._tile_checks
    monkeypatch.setattr(ta, "_tile_checks", lambda *a: (ran.append(1), real(*a))[1])
    return ran


@pytest.mark.parametrize("form", ["int", "DeviceBuffer", "DeviceView", "interface"])
def test_a_remembered_tile_launches_what_its_checks_launch(ctx, stream, tiles, monkeypatch, form: str) -> None:
    """Repeated tile calls (step_tile and step_tile_tokens, with and without an output, two argument sets in turn, the
    last value and the sequence count changing, other launches between) run their full checks once per argument set
    and launch what the same calls launch on a TiledAttention that remembers nothing."""
    d = replace(ORIGINAL, max_seqs=2, tile_capacity=4)
    with TiledAttention(ctx, d) as ta, TiledAttention(ctx, d) as plain:
        tiles.watch(ta)
        tiles.watch(plain)
        checked = full_checks(monkeypatch, ta)
        bufs = [cm.DeviceBuffer(n) for n in (QBYTES, 1 << 16, 32, 8, QBYTES) * 2]

        def arrays(q, pool, tb, cn, out):
            if form == "int":
                return q.ptr, pool.ptr, pool.ptr, tb.ptr, cn.ptr, out.ptr
            if form == "DeviceBuffer":
                return q, pool, pool, tb, cn, out
            if form == "DeviceView":
                return q.view("bf16"), pool.view("bf16"), pool.view("u8"), tb.view("i32"), cn.view("i32"), out
            return (CudaArray(q, (2, 32, 128), "<V2"), CudaArray(pool, (1 << 15,), "<V2"), pool,
                    CudaArray(tb, (2, 4), "<i4"), CudaArray(cn, (2,), "<i4"), CudaArray(out, (2, 32, 128), "<V2"))

        sets = {"A": arrays(*bufs[:5]), "B": arrays(*bufs[5:])}
        strides = ta.paged_strides()
        raw = (bufs[5].ptr, bufs[6].ptr, bufs[6].ptr, *strides, bufs[7].ptr, bufs[8].ptr, 5)

        others = (lambda t: (t.begin_step(stream, 2), t.queue_checked_tile(stream, 2, *raw)),
                  lambda t: t._next_tile(stream, bufs[7].ptr, bufs[8].ptr, 4),
                  lambda t: t.begin_tiles(stream, *sets["B"][:3], 2, *strides).tile(sets["B"][3], sets["B"][4], 6))

        def same(call) -> None:
            plain._remembered.clear()
            got = tiles.launched(ta, call)
            assert got and got == tiles.launched(plain, call)

        for token in (False, True):
            for with_output in (True, False):
                ta._remembered.clear()
                del checked[:]
                for name, n, last in (("A", 2, 16), ("B", 2, 3), ("A", 2, 7), ("A", 2, 9), ("A", 2, 9), ("B", 1, 3),
                                      ("B", 1, 9), ("B", 1, 9), ("B", 1, 12)):
                    *ins, out = sets[name]

                    def tile(t, n=n, last=last, ins=ins, out=out) -> None:
                        t.begin_step(stream, n)
                        (t.step_tile_tokens if token else t.step_tile)(stream, *ins, n, *strides, last,
                                                                        output=out if with_output else None)
                    same(tile)
                    if last == 9:   # another launch refills the pack between two remembered tiles
                        for other in others:
                            same(other)
                            same(tile)
                assert len(checked) == 3 and len(ta._remembered) == 3   # A, B and B for one sequence
        for b in bufs:
            b.close()


def test_a_remembered_tile_still_refuses_what_its_checks_refuse(ctx, stream, launches: list) -> None:
    """Once a good call is remembered, each change that makes one of its arguments bad (its buffer freed and the
    address handed to a smaller one, closed, a foreign array resized, retyped, made read-only, moved off its
    alignment, onto another device's memory or into the attention's own state) is refused with the full checks'
    words, before anything is queued."""
    d = replace(ORIGINAL, max_seqs=2, tile_capacity=4)
    with TiledAttention(ctx, d) as ta:
        strides = ta.paged_strides()

        def refused(change, words: str, **args) -> None:
            sizes = dict(q=QBYTES, k_pool=1 << 16, v_pool=1 << 16, tile_blocks=32, tile_block_counts=8, output=QBYTES)
            bufs = {name: cm.DeviceBuffer(n, ctx) for name, n in sizes.items()}
            given = {name: args[name](bufs[name]) if name in args else bufs[name] for name in bufs}

            def call() -> None:
                ta.begin_step(stream, 2)
                ta.step_tile(stream, *(given[n] for n in list(bufs)[:5]), 2, *strides, 16, output=given["output"])

            call()
            call()   # remembered
            launches.clear()
            undo = change(given, bufs)
            errors = []
            for _ in range(2):   # with the good call remembered, then with nothing remembered
                with pytest.raises(HssError, match=words) as e:
                    call()
                errors.append(str(e.value))
                ta._remembered.clear()
            assert errors[0] == errors[1] and launches == [], words
            if undo is not None:
                undo()
            for b in bufs.values():
                b.close()

        def reused(given, bufs):   # freed, and the driver hands the address to a smaller buffer
            bufs["k_pool"].close()
            key = cm_args.RANGES.add(given["k_pool"], 1024, 0)
            return lambda: cm_args.RANGES.remove(key)

        def set_field(name, **fields):
            def change(given, bufs):
                for k, v in fields.items():
                    setattr(given[name], k, v(getattr(given[name], k)) if callable(v) else v)
            return change

        whole = lambda shape: lambda b: CudaArray(b, shape, "<V2")   # noqa: E731
        for n, kvh, last, words in ((2, 128, 16, f"q holds 8192 bytes but {QBYTES} are needed"),
                                    (1, 256, 16, f"k_pool holds {POOL_MIN} bytes but 3840 are needed"),
                                    (1, 128, 2**31, "last_block_valid_slots = 2147483648 must be in")):
            q, pool, tb, cn = (cm.DeviceBuffer(b) for b in (QBYTES // 2, POOL_MIN, 32, 8))   # one sequence's
            ta.begin_step(stream, 1)
            ta.step_tile(stream, q, pool, pool, tb, cn, 1, strides[0], strides[1], 128, 16)   # remembered
            launches.clear()
            with pytest.raises(HssError, match=words):
                ta.begin_step(stream, n)
                ta.step_tile(stream, q, pool, pool, tb, cn, n, strides[0], strides[1], kvh, last)
            assert launches == []
            for b in (q, pool, tb, cn):
                b.close()
        refused(reused, f"k_pool: {POOL_MIN} bytes at offset 0 run past the end of its 1024-byte buffer",
                k_pool=lambda b: b.ptr)
        refused(lambda given, bufs: bufs["q"].close(), "q is a closed DeviceBuffer")
        refused(lambda given, bufs: bufs["tile_blocks"].close(), "tile_blocks is a view of a closed DeviceBuffer",
                tile_blocks=lambda b: b.view("i32"))
        refused(set_field("q", shape=(2, 32, 127)), f"q holds 16256 bytes but {QBYTES} are needed",
                q=whole((2, 32, 128)))
        refused(set_field("v_pool", typestr="<f4", shape=(1 << 14,)), "v_pool holds f32 but bf16 is needed",
                v_pool=whole((1 << 15,)))
        refused(set_field("output", readonly=True), "output is read-only", output=whole((2, 32, 128)))
        refused(set_field("q", ptr=lambda p: p + 1), "q .* must be 2-byte aligned", q=whole((2, 32, 128)))
        refused(set_field("output", ptr=ta.m.ptr), "output .* overlaps its ", output=whole((2, 32, 128)))
        if cm.device_count() > 1:
            with cm.CudaCtx(1) as other, cm.DeviceBuffer(8, other) as far:
                refused(set_field("tile_block_counts", ptr=far.ptr), "tile_block_counts is memory of device 1",
                        tile_block_counts=lambda b: CudaArray(b, (2,), "<i4"))


def test_a_remembered_tile_joins_its_producer_every_call(ctx, stream, launches: list) -> None:
    d = replace(ORIGINAL, max_seqs=2, tile_capacity=4)
    with TiledAttention(ctx, d) as ta, cm.CudaStream(ctx) as producer:
        q, pool, tb, cn = (cm.DeviceBuffer(n) for n in (QBYTES, 1 << 16, 32, 8))
        table = CudaArray(tb, (2, 4), "<i4", stream=producer.handle)
        for _ in range(3):
            ta.begin_step(stream, 2)
            ta.step_tile(stream, q, pool, pool, table, cn, 2, *ta.paged_strides(), 16)
        queued = [op for op in launches if op != "cuMemsetD32Async"]   # (the counters' one reset)
        assert queued == ["cuEventRecord", "cuStreamWaitEvent", ta._step_fn.handle] * 3
        assert len(ta._remembered) == 1
        for b in (q, pool, tb, cn):
            b.close()


def test_a_context_made_or_destroyed_drops_the_remembered_tiles(ctx, stream, launches: list, monkeypatch) -> None:
    from hss.cuda._context import PrimaryContext
    if cm.device_count() < 2 or 1 in PrimaryContext._live:
        pytest.skip("needs a second device whose context no one holds")
    with TiledAttention(ctx, replace(ORIGINAL, max_seqs=2, tile_capacity=4)) as ta:
        checked = full_checks(monkeypatch, ta)
        q, pool, tb, cn = (cm.DeviceBuffer(n) for n in (QBYTES, 1 << 16, 32, 8))

        def call() -> None:
            ta.begin_step(stream, 2)
            ta.step_tile(stream, q, pool, pool, tb, cn, 2, *ta.paged_strides(), 16)

        call()
        call()
        assert len(checked) == 1
        generation = cm_args.RANGES.generation
        cm.CudaCtx(1).close()   # device 1's context made and destroyed
        assert cm_args.RANGES.generation >= generation + 2
        call()
        call()
        assert len(checked) == 2
        for b in (q, pool, tb, cn):
            b.close()


def test_the_remembered_tiles_stay_bounded(ctx, stream, launches: list) -> None:
    from hss.attention import REMEMBERED_TILES
    with TiledAttention(ctx, replace(ORIGINAL, max_seqs=1, tile_capacity=4)) as ta:
        big, pool, tb, cn = (cm.DeviceBuffer(n) for n in (1 << 16, 1 << 16, 16, 4))
        for i in range(REMEMBERED_TILES + 44):
            ta.begin_step(stream, 1)
            ta.step_tile(stream, big.ptr + 2 * i, pool, pool, tb, cn, 1, *ta.paged_strides(), 16)
            assert 1 <= len(ta._remembered) <= REMEMBERED_TILES
        for b in (big, pool, tb, cn):
            b.close()


tile_calls = st.lists(st.tuples(st.integers(0, 2), st.integers(0, 2), st.integers(0, 2), st.integers(0, 2),
                                st.integers(0, 3), st.sampled_from([0, 1, 2]), st.booleans(),
                                st.lists(st.sampled_from(["shrink", "grow", "retype", "readonly", "close", "alloc"]),
                                         max_size=2)), min_size=1, max_size=10)


@given(tile_calls)
def test_remembered_tiles_answer_as_the_full_checks(ctx, stream, tiles, calls) -> None:
    """Tile calls drawn from a few argument forms, with arguments changed, closed or allocated between them: every
    call of a TiledAttention that remembers gives what the same call gives one that remembers nothing (the same
    error, or the same launched parameters)."""
    d = replace(ORIGINAL, max_seqs=2, tile_capacity=4)
    with TiledAttention(ctx, d) as ta, TiledAttention(ctx, d) as plain:
        tiles.watch(ta)
        tiles.watch(plain)
        bufs = [cm.DeviceBuffer(n) for n in (QBYTES, 1 << 16, 32, 8, QBYTES)]
        arrays = [CudaArray(bufs[0], (2, 32, 128), "<V2"), CudaArray(bufs[1], (1 << 15,), "<V2"),
                  CudaArray(bufs[2], (2, 4), "<i4"), CudaArray(bufs[3], (2,), "<i4"),
                  CudaArray(bufs[4], (2, 32, 128), "<V2")]
        forms = [(b.ptr, b, a) for b, a in zip(bufs, arrays)]
        made = []

        def outcome(t: TiledAttention, args: tuple, n: int, token: bool, out) -> object:
            del tiles.seen[:]
            try:
                t.begin_step(stream, n)
                (t.step_tile_tokens if token else t.step_tile)(stream, *args, n, *t.paged_strides(), 5, output=out)
            except HssError as exc:
                return str(exc)
            return [s for s in tiles.seen if isinstance(s, dict)]

        for qi, ki, ti, ci, oi, n, token, changes in calls:
            args = (forms[0][qi], forms[1][ki], forms[1][(ki + 1) % 3], forms[2][ti], forms[3][ci])
            out = None if oi == 3 else forms[4][oi]
            got = outcome(ta, args, n, token, out)
            plain._remembered.clear()
            assert got == outcome(plain, args, n, token, out)
            for change in changes:
                a = arrays[(qi + oi) % 5]
                if change in ("shrink", "grow"):
                    a.shape = (a.shape[0] // 2 if change == "shrink" else a.shape[0] * 2,) + a.shape[1:]
                elif change == "retype":
                    a.typestr = {"<V2": "<i4", "<i4": "<V2"}[a.typestr]
                elif change == "readonly":
                    a.readonly = not a.readonly
                elif change == "close":
                    bufs[(qi + ti) % 5].close()
                else:
                    made.append(cm.DeviceBuffer(64))
        for b in bufs + made:
            b.close()


# -- the kernels against the reference ---------------------------------------------------------
def setup(ctx, stream, rng, dims: TiledAttentionDims, num_pages: int, kind: str, group_stride=None):
    ta = TiledAttention(ctx, dims)
    std = std_of(kind, dims.head_dim)
    q = randn(rng, (dims.max_seqs, dims.num_q_heads, dims.head_dim), std)
    return ta, q, upload(q, stream), Pool(ta, rng, num_pages, std, stream, group_stride)


@pytest.mark.parametrize("kind", ["unit", "small"])
def test_every_tiling_meets_the_bound(ctx, stream, rng, kind: str) -> None:
    """The original's parity test (32 q / 8 kv heads, hd 128, bs 16, 16 pages), two sequences; a schedule run
    twice gives the same bits."""
    dims = replace(ORIGINAL, max_seqs=3)
    ns, npages = 2, 16
    ta, q, q_dev, pool = setup(ctx, stream, rng, dims, 24, kind)
    pages = [rng.permutation(24)[:npages] for _ in range(ns)]
    one = schedule(pages, 16, 16, 16, 16)
    single = run(ta, stream, q_dev, pool, one, ns)
    tokens = consumed(one, ns, 16)
    want = check(single, q, pool, tokens, ns, f"single tile ({kind})")
    err = np.abs(single.out[:ns].astype(np.float64) - want)
    assert err.max() < 1e-2                                       # tiled_attention_parity.rs
    for tile in (1, 2, 4, 8):
        sched = schedule(pages, tile, 16, 16, 16)
        assert all(np.array_equal(a[0], b[0]) for a, b in zip(consumed(sched, ns, 16), tokens))
        res = run(ta, stream, q_dev, pool, sched, ns)
        same_bits(run(ta, stream, q_dev, pool, sched, ns), res, f"tiles of {tile} ({kind}), run again")
        check(res, q, pool, tokens, ns, f"tiles of {tile} ({kind})")
        diff = np.abs(res.out[:ns].astype(np.float64) - single.out[:ns].astype(np.float64))
        assert diff.max() < 1e-2 and diff.mean() < 1e-3          # the original's multi-tile tolerance
    ta.close()
    pool.close()


@pytest.mark.parametrize("last_valid", [1, 7, 15, 0, -3, 16, 99])
def test_partial_last_page(ctx, stream, rng, last_valid: int) -> None:
    dims = TiledAttentionDims(max_seqs=2, num_q_heads=8, num_kv_heads=2, head_dim=64, block_size=16, tile_capacity=6)
    ta, q, q_dev, pool = setup(ctx, stream, rng, dims, 8, "small")
    pages = [rng.permutation(8)[:6], rng.permutation(8)[:6]]
    results = []
    for tile in (6, 4, 1):
        sched = schedule(pages, tile, 6, 16, last_valid)
        tokens = consumed(sched, 2, 16)
        assert len(tokens[0][0]) == 5 * 16 + min(max(last_valid, 0), 16)
        res = run(ta, stream, q_dev, pool, sched, 2)
        check(res, q, pool, tokens, 2, f"last_block_valid_slots {last_valid}, tiles of {tile}")
        results.append(res)
    if last_valid <= 0:   # the last page contributes nothing: the same bits as leaving it out
        dropped = run(ta, stream, q_dev, pool, schedule([p[:5] for p in pages], 6, 6, 16, 16), 2)
        same_bits(dropped, results[0], f"last_block_valid_slots {last_valid} vs five pages")
    ta.close()
    pool.close()


@pytest.mark.parametrize("block_size,head_dim,group_stride", [(8, 128, 4096), (16, 64, 4096), (16, 64, 2048),
                                                               (4, 96, 4096)])
def test_scratch_pool_layout_matches_nhd(ctx, stream, rng, block_size: int, head_dim: int, group_stride: int) -> None:
    """HSS scratch slots (stripes padded to group_stride, padding NaN) give the NHD pool's bits."""
    dims = TiledAttentionDims(max_seqs=2, num_q_heads=8, num_kv_heads=4, head_dim=head_dim, block_size=block_size,
                              tile_capacity=5)
    ta, q, q_dev, nhd = setup(ctx, stream, rng, dims, 7, "unit")
    slots = Pool(ta, rng, 7, 1.0, stream, group_stride, data=(nhd.k, nhd.v))
    pages = [rng.permutation(7)[:5], rng.permutation(7)[:3]]
    sched = schedule(pages, 2, 5, block_size, block_size - 1)
    a = run(ta, stream, q_dev, nhd, sched, 2)
    b = run(ta, stream, q_dev, slots, sched, 2)
    check(b, q, slots, consumed(sched, 2, block_size), 2, f"scratch slots gs {group_stride}")
    same_bits(b, a, f"scratch slots gs {group_stride} vs NHD")
    for p in (ta, nhd, slots):
        p.close()


def test_empty_sequence_and_interop(ctx, stream, rng) -> None:
    """A sequence with no pages keeps the initial state and finalizes to 0 (l == 0); streams and pointers
    may be __cuda_stream__ / __cuda_array_interface__ objects."""
    dims = TiledAttentionDims(max_seqs=3, num_q_heads=4, num_kv_heads=1, head_dim=128, block_size=16, tile_capacity=2)
    ta, q, q_dev, pool = setup(ctx, stream, rng, dims, 3, "unit")

    class Stream:
        def __cuda_stream__(self):
            return (0, stream)

    sched = schedule([np.array([2, 0]), np.array([], dtype=np.int64), np.array([1])], 2, 2, 16, 16)
    tb, cn = upload(sched[0][0], stream), upload(sched[0][1], stream)
    out = poisoned(2 * 3 * 4 * 128, stream)
    ta.begin_step(Stream(), 3)
    ta.step_tile_on_stream(Stream(), Tensor(q_dev, (3, 4, 128), "<V2"), pool.k_ptr, pool.v_ptr,
                           Tensor(tb, (3, 2), "<i4"), cn, 3, *pool.strides, 16)
    ta.finalize_on_stream(Stream(), Tensor(out, (3, 4, 128), "<V2"), 3)
    got = download(out, (3, 4, 128), BF16, stream)
    assert (got[1].view(np.uint16) == 0).all()
    assert (download(ta.m, 12, np.uint32, stream)[4:8] == 0xFF800000).all()
    res = Result(got, *(np.zeros(0, np.float32) for _ in range(3)))
    check(res, q, pool, consumed(sched, 3, 16), 3, "empty sequence")
    with pytest.raises(HssError, match=r"output is not C-contiguous \(shape \(3, 4, 128\), strides \(2048, 4, 2\)\)"):
        ta.finalize(stream, Tensor(out, (3, 4, 128), "<V2", strides=(2048, 4, 2)), 3)
    ta.finalize(stream, Tensor(out, (3, 4, 128), "<V2", strides=(1024, 256, 2)), 3)   # contiguous strides
    # the same step with the output written by its tile: the same bits, the empty sequence's 0 included
    fused = poisoned(2 * 3 * 4 * 128, stream)
    with pytest.raises(HssError, match="output holds 64 bytes"):
        ta.step_tile(stream, q_dev, pool.k_ptr, pool.v_ptr, tb, cn, 3, *pool.strides, 16, output=cm.DeviceBuffer(64))
    ta.begin_step(stream, 3)
    ta.step_tile(stream, q_dev, pool.k_ptr, pool.v_ptr, tb, cn, 3, *pool.strides, 16, output=fused)
    assert np.array_equal(download(fused, 3 * 4 * 128, np.uint16, stream), got.view(np.uint16).reshape(-1))
    # an empty tile after a full one: the state is kept, and its output is that state's
    empty = upload(np.zeros(3, np.int32), stream)
    cm.memset_d8_async(fused, 0xFF, fused.bytes, stream)
    ta.step_tile(stream, q_dev, pool.k_ptr, pool.v_ptr, tb, empty, 3, *pool.strides, 16, output=fused)
    assert np.array_equal(download(fused, 3 * 4 * 128, np.uint16, stream), got.view(np.uint16).reshape(-1))
    for b in (tb, cn, out, fused, empty, ta, pool):
        b.close()


def test_begin_step_state_without_a_matching_tile(ctx, stream, rng) -> None:
    """begin_step's state is written by the step's first tile when it covers the same sequences, else by
    memsets before the next call: a step with no tile, or a first tile over fewer sequences."""
    dims = TiledAttentionDims(max_seqs=2, num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16, tile_capacity=3)
    ta, q, q_dev, pool = setup(ctx, stream, rng, dims, 4, "unit")
    out = poisoned(2 * 2 * 4 * 64, stream)
    for buf in (ta.m, ta.l, ta.o):
        cm.memset_d8_async(buf, 0xFF, buf.bytes, stream)
    ta.begin_step(stream, 2)
    ta.finalize(stream, out, 2)                                  # no tile at all
    assert (download(out, 2 * 4 * 64, np.uint16, stream) == 0).all()
    assert (download(ta.m, 8, np.uint32, stream) == 0xFF800000).all()
    sched = schedule([np.array([3, 1, 2])], 3, 3, 16, 16)
    tb, cn = upload(sched[0][0], stream), upload(sched[0][1], stream)
    for _ in range(2):   # the first tile ever (the fold counters' reset), then a later step's (a remembered tile)
        for buf in (ta.m, ta.l, ta.o):
            cm.memset_d8_async(buf, 0xFF, buf.bytes, stream)
        ta.begin_step(stream, 2)
        ta.step_tile(stream, q_dev, pool.k_ptr, pool.v_ptr, tb, cn, 1, *pool.strides, 16)   # one of the two
        ta.finalize(stream, out, 2)
        got = download(out, (2, 4, 64), BF16, stream)
        assert_close(got[:1].astype(np.float64), reference(q[:1], pool, consumed(sched, 1, 16)), "bf16", (2,),
                     "seq 0")
        assert (got[1].view(np.uint16) == 0).all()
    for b in (tb, cn, out, ta, pool):
        b.close()


@st.composite
def cases(draw: st.DrawFn) -> dict:
    gqa = draw(st.integers(1, 8))
    nkv = draw(st.integers(1, 8 if ON_GPU else 3))
    hd = draw(st.sampled_from([64, 96, 128, 256]))
    bs = draw(st.one_of(st.sampled_from([1, 16, 64]), st.integers(1, 64)) if ON_GPU else
              st.one_of(st.sampled_from([1, 16]), st.integers(1, 32)))
    max_pages = max(1, min(300 if ON_GPU else 12, REF_ELEMS // (bs * gqa * nkv * hd)))
    ns = draw(st.integers(1, 3))
    counts = draw(st.lists(st.integers(0, max_pages), min_size=ns, max_size=ns))
    return dict(dims=TiledAttentionDims(max_seqs=ns + draw(st.integers(0, 1)), num_q_heads=gqa * nkv,
                                        num_kv_heads=nkv, head_dim=hd, block_size=bs,
                                        tile_capacity=max(1, max(counts))),
                ns=ns, counts=counts, tile=draw(st.integers(1, max(1, max(counts)))),
                last_valid=draw(st.one_of(st.just(bs), st.integers(-2, bs + 2))),
                kind=draw(st.sampled_from(["unit", "small"])))


@given(case=cases())
def test_shapes(ctx, stream, rng, case: dict) -> None:
    dims, ns = case["dims"], case["ns"]
    npool = max(case["counts"]) + 2
    ta, q, q_dev, pool = setup(ctx, stream, rng, dims, npool, case["kind"])
    pages = [rng.permutation(npool)[:c] for c in case["counts"]]
    cap = dims.tile_capacity
    one = schedule(pages, cap, cap, dims.block_size, case["last_valid"])
    many = schedule(pages, case["tile"], cap, dims.block_size, case["last_valid"])
    what = f"{dims}, {ns} seqs, pages {case['counts']}, tiles of {case['tile']}, lbvs {case['last_valid']}"
    single = run(ta, stream, q_dev, pool, one, ns)
    check(single, q, pool, consumed(one, ns, dims.block_size), ns, f"one tile: {what}")
    tiled = run(ta, stream, q_dev, pool, many, ns)
    check(tiled, q, pool, consumed(many, ns, dims.block_size), ns, what)
    same_bits(run(ta, stream, q_dev, pool, many, ns, fused=True), tiled, f"output of the last tile vs finalize: {what}")
    # the same tiles through a TiledAttention of twice the capacity, sequences reversed, another grid: the same
    # bits per sequence
    wide = replace(dims, tile_capacity=2 * cap)
    with TiledAttention(ctx, wide) as ta2:
        ta2._grid_z[ns] = 1   # one CTA per (sequence, kv head, head group) walks every unit: any grid.z, same bits
        rev = schedule(pages[::-1], case["tile"], 2 * cap, dims.block_size, case["last_valid"])
        q_rev = upload(np.ascontiguousarray(q[:ns][::-1]), stream)
        again = run(ta2, stream, q_rev, pool, rev, ns)
        q_rev.close()
    nq = dims.num_q_heads
    for s in range(ns):
        r = ns - 1 - s
        rows_s, rows_r = slice(s * nq, (s + 1) * nq), slice(r * nq, (r + 1) * nq)
        for name, x, y in (("output", tiled.out[s], again.out[r]), ("m", tiled.m[rows_s], again.m[rows_r]),
                           ("l", tiled.l[rows_s], again.l[rows_r]), ("o", tiled.o[rows_s], again.o[rows_r])):
            assert np.array_equal(x.view(np.uint8), y.view(np.uint8)), \
                f"{what}: sequence {s} {name} changed with tile_capacity and the sequence order"
    ta.close()
    pool.close()


# -- references and emulator-only checks -------------------------------------------------------
def test_reference_recurrence(rng) -> None:
    """The tile-step reference: f32 state is split-invariant bit for bit and close to plain softmax; the
    chunk + merge reference agrees with plain softmax too."""
    q = rng.standard_normal((6, 32))
    k, v = rng.standard_normal((50, 2, 32)), rng.standard_normal((50, 2, 32))
    init = (np.full(6, -np.inf), np.zeros(6), np.zeros((6, 32)))
    whole = ref.step_tile(q, k, v, *init)
    half = ref.step_tile(q, k[20:], v[20:], *ref.step_tile(q, k[:20], v[:20], *init))
    for a, b in zip(whole, half):
        assert np.array_equal(a, b)
    want = ref.attention(q, k, v)
    assert np.abs(ref.finalize(whole[1], whole[2]) - want).max() < 1e-5
    exact = ref.step_tile(q, k, v, *init, state_dtype=None)
    assert np.abs(ref.finalize(exact[1], exact[2]) - want).max() < 1e-12
    assert (ref.finalize(np.zeros(2), np.ones((2, 3))) == 0).all()
    # the split form the kernels compute: chunk partials folded into a running state, two tiles
    state = init
    for part in (slice(0, 37), slice(37, 50)):
        parts = ref.chunk_partials(q, k[part], v[part], 8)
        assert parts[0].shape == (ceil_div(part.stop - part.start, 8), 6)
        state = ref.merge_partials(*state, *parts)
    assert np.abs(ref.finalize(state[1], state[2]) - want).max() < 1e-5
    exact = ref.merge_partials(*init, *ref.chunk_partials(q, k, v, 16, state_dtype=None), state_dtype=None)
    assert np.abs(ref.finalize(exact[1], exact[2]) - want).max() < 1e-12
    assert ref.merge_partials(*whole, np.zeros((0, 6)), np.zeros((0, 6)), np.zeros((0, 6, 32)))[0] is not None
    assert ref.attention(q, k[:0], v[:0]).shape == (6, 32)


@pytest.mark.emulator
def test_emulator_faults_on_a_page_outside_the_pool(ctx, stream, rng) -> None:
    from hss.emulator import MemoryFault
    dims = TiledAttentionDims(max_seqs=1, num_q_heads=2, num_kv_heads=1, head_dim=64, block_size=4, tile_capacity=2)
    ta, q, q_dev, pool = setup(ctx, stream, rng, dims, 3, "unit")
    sched = schedule([np.array([1, 3])], 2, 2, 4, 4)
    with pytest.raises(MemoryFault, match="k_pool: page 3 .*outside the pool"):
        run(ta, stream, q_dev, pool, sched, 1)
    ta.close()
    pool.close()


def test_bench_smoke() -> None:
    from hss.bench import attention as bench
    rows = bench.run(bench.parse_args(["--smoke"]))
    assert [(r["batch"], r["tiles"]) for r in rows] == [(1, 1), (2, 1), (1, 1), (1, 2)]
    assert all({"hss_us", "hss_GBs", "host_us"} <= set(r) for r in rows) and "copy_us" in rows[0]
    text = bench.table(rows)
    assert "| 4/2/64 | 2 × 32 |" in text and "| 4/2/64 | 64 | 2 |" in text
    assert all("graph_us" in r for r in rows[2:])
    assert rows[3]["overlap_bitwise"] is True and "overlap_graph_us" in rows[3]   # the emulator is cc 9.0


@given(shape=st.sampled_from([(8, 2, 64), (9, 3, 64), (32, 8, 128), (24, 2, 256), (34, 2, 40), (4, 1, 72)]),
       counts=st.lists(st.integers(0, 90), min_size=2, max_size=2), offset=st.integers(0, 12),
       seed=st.integers(0, 2**32 - 1))
def test_rope_tile_is_rope_kv_then_the_token_tile(ctx, gpu, stream, shape, counts: list[int], offset: int,
                                                  seed: int) -> None:
    """``TileStep.tile_tokens_rope``: each sequence's newest token (its tile's last, at position offset + length
    - 1) and the query arrive un-rotated in qkv rows; the launch gives the same bits as ``model_rope_kv`` (the q
    rotated, the newest K/V rows written at their page and slot) followed by ``tile_tokens``: output, state and
    both pools bitwise equal; the output within the bf16 bound of float64 attention over the rotated rows. Shapes:
    16-byte and 2-byte q paths (head_dim 40, 72), two CTA rows per kv head (17 q heads a kv head), GQA 3 and 12;
    a sequence whose position has no table row, or no tokens, is left untouched."""
    from hss.checkpoint.forward import rope_cos_sin
    from hss.decls import model as km
    from hss.reference import model as mref
    rng = np.random.default_rng(seed)
    nq, nkv, hd = shape
    bs, cap, max_pos = 16, 6, 80      # positions past 79 have no table row
    dims = TiledAttentionDims(max_seqs=2, num_q_heads=nq, num_kv_heads=nkv, head_dim=hd, block_size=bs,
                              tile_capacity=cap)
    ta = TiledAttention(ctx, dims)
    k0, v0 = (randn(rng, (2 * cap, bs, nkv, hd), 1.0 / math.sqrt(hd)) for _ in range(2))
    qkv = randn(rng, (2, nq + 2 * nkv, hd), 1.0)
    cos, sin = rope_cos_sin(np.arange(max_pos), hd, 1e4, np.float32)
    perm = rng.permutation(2 * cap).astype(np.int32)   # each sequence owns its pages (its newest row is its own)
    pages = [perm[:cap], perm[cap:]]
    lens = [min(max(c - offset, 0), cap * bs) for c in counts]
    bufs = [upload(a, stream) for a in (np.stack(pages), np.array(counts, np.int32), qkv, cos, sin)]
    blocks, cnt, qkv_dev, cos_dev, sin_dev = bufs
    pools = [[upload(k0, stream), upload(v0, stream)] for _ in range(2)]
    outs = [poisoned(2 * 2 * nq * hd, stream) for _ in range(2)]
    q_rot = poisoned(2 * 2 * nq * hd, stream)
    strides = ta.paged_strides()
    # fused: one launch
    ta.begin_tiles(stream, q_rot, pools[0][0], pools[0][1], 2, *strides).tile_tokens_rope(
        blocks, cnt, qkv_dev, cos_dev, sin_dev, max_pos, offset, outs[0])
    fused = [download(outs[0], (2, nq, hd), BF16, stream), download(ta.m, 2 * nq, np.float32, stream),
             download(ta.o, (2 * nq, hd), np.float32, stream)]
    # unfused: model_rope_kv of each sequence's newest token into pool 1 (cache_rows 1: the row is k_cache), then
    # the token-count tile
    live = [n > 0 and offset + n - 1 < max_pos for n in lens]
    for s, n in enumerate(lens):
        if not live[s]:
            continue
        pos = offset + n - 1
        page, slot = int(pages[s][(n - 1) // bs]), (n - 1) % bs
        row = 2 * (page * strides[0] + slot * strides[1])
        st_buf = upload(np.array([0, pos, pos + 1, 0], np.int32), stream)
        geom = km.row_geometry(1)
        gpu.launch(gpu.kernel(km.MODULE, km.MODEL_ROPE_KV.name), geom.grid, geom.block, geom.shared, stream,
                   km.MODEL_ROPE_KV.pack(qkv=qkv_dev.ptr + s * qkv[0].nbytes, cos_t=cos_dev, sin_t=sin_dev,
                                         state=st_buf, q_out=q_rot.ptr + s * 2 * nq * hd,
                                         k_cache=pools[1][0].ptr + row, v_cache=pools[1][1].ptr + row, m=1,
                                         n_head=nq, n_kv_head=nkv, head_dim=hd, max_pos=max_pos, cache_rows=1,
                                         row_stride=0, kvh_stride=strides[2]))
        cm.stream_sync(stream)
        st_buf.close()
    step = ta.begin_tiles(stream, q_rot, pools[1][0], pools[1][1], 2, *strides)
    live_cnt = upload(np.array([c if live[s] else -1 for s, c in enumerate(counts)], np.int32), stream)
    step.tile_tokens(blocks, live_cnt, offset, outs[1])   # (a dead sequence: no tokens, its state fresh)
    plain = [download(outs[1], (2, nq, hd), BF16, stream), download(ta.m, 2 * nq, np.float32, stream),
             download(ta.o, (2 * nq, hd), np.float32, stream)]
    kv = [[download(b, k0.shape, BF16, stream) for b in pair] for pair in pools]
    for s in range(2):
        rows = slice(s * nq, (s + 1) * nq)
        if live[s]:
            for a, b, what in zip(fused, plain, ("output", "m", "o")):
                part = a[s] if what == "output" else a[rows]
                want = b[s] if what == "output" else b[rows]
                assert np.array_equal(part.view(np.uint8), want.view(np.uint8)), f"sequence {s}: {what} bits"
            n = lens[s]
            toks = np.arange(n)
            pg, sl = pages[s][toks // bs], toks % bs
            q_ref = download(q_rot, (2, nq, hd), BF16, stream)[s]
            want = ref.attention(q_ref, kv[1][0][pg, sl], kv[1][1][pg, sl])
            assert_close(fused[0][s].astype(np.float64), want, "bf16", (1,), f"rope tile of {n} tokens")
            pos = offset + n - 1
            rq, rk, rv = mref.rope_kv(qkv[s].reshape(1, -1), cos[pos:pos + 1], sin[pos:pos + 1], 0, nq, nkv, hd)
            assert_close(kv[0][0][pg[-1], sl[-1]], rk[0], "bf16", (1,), "the newest k row, rotated")
        elif lens[s] == 0 or not live[s]:   # nothing written for it: the output keeps its poison
            if lens[s] and not live[s]:
                assert (fused[0][s].view(np.uint16) == 0xFFFF).all(), f"sequence {s} (no table row) was written"
    for p in range(2):   # the pools: identical (the newest rows written alike, nothing else touched)
        assert np.array_equal(kv[0][p].view(np.uint16), kv[1][p].view(np.uint16)), "pools differ"
    for x in (*bufs, *pools[0], *pools[1], *outs, q_rot, live_cnt, ta):
        x.close()
