"""Hostile memory at every QSA entry point: a device-memory argument at any byte offset inside memory the indexer owns
(its scratch, tables, pinned staging, device-decode arrays, a state's raw and block keys), and a written argument at
any byte offset inside another argument of the same call, are refused with an HssError before any device work; the
states (counters, device positions, keys) and the last batched selection stay as they were, and a valid call works
afterwards.

Dims: test_qsa_device's (small on the emulator, the model's on a GPU); two states, one past the inert bound.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import test_qsa_device as tq
from hypothesis import given
from hypothesis import strategies as st
from test_qsa_indexer import driver_calls

from hss import _args
from hss import cuda_min as cm
from hss._util import ceil_div
from hss.errors import HssError

from conftest import ON_GPU
from helpers import BF16, download

D, BS, BOUND = tq.D, tq.BS, tq.BOUND
H, HD, NKV, NQ, HDA = D["hidden"], D["hd"], D["nkv"], D["nq"], D["hd_attn"]
MAX_TOKENS = 8192 if ON_GPU else 512
LENGTHS = (BOUND + 6, 9)
R = len(LENGTHS)
MP = MAX_TOKENS // BS                  # page-table row length
ROW = R * NQ * HDA * 2                 # bytes of the batch's q and out
PAGE = BS * NKV * HDA * 2
CHUNK = 2                              # prefill_select's chunk: the last two tokens of the first state
ATTN = CHUNK * NQ * HDA * 2            # bytes of the chunk's q_roped and attn_ctx
PAD = max(ROW, ATTN) + 256             # every argument buffer has room for a written argument anywhere inside it
ALIGN = {"normed": 2, "hidden": 2, "block_tables": 4, "block_table_dev": 4, "q": 16, "q_roped": 16, "out": 2,
         "attn_ctx": 16, "scratch": 16}


def padded(arr: np.ndarray, stream) -> cm.DeviceBuffer:
    buf = cm.DeviceBuffer(arr.nbytes + PAD)
    cm.memset_d8_async(buf, 0, buf.bytes, stream)
    cm.copy_h_to_d_async(buf, np.ascontiguousarray(arr), arr.nbytes, stream)
    return buf


class World:
    """One indexer with two prefilled states and a batched selection, every argument of every entry point, and each
    entry point as a call of those arguments (any of them overridden)."""

    def __init__(self, gpu, s) -> None:
        rng = np.random.default_rng(41)
        self.s = s
        self.layer = tq.make_layer(rng, s)
        self.idx = idx = self.layer.indexer(gpu, max_tokens=MAX_TOKENS, max_seqs=4, nq_attn=NQ)
        self.states, rows = tq.start(idx, LENGTHS, rng, s)
        pages = R * MP + 3
        self.tables = rng.permutation(pages)[:R * MP].reshape(R, MP).astype(np.int32)
        self.prefill_table = np.arange(MP)   # prefill_select reads the first pages of the pools: they reach further
        pool = (pages, BS, NKV, HDA)
        self.bufs = [padded(a, s) for a in (
            rng.standard_normal(pool).astype(BF16), rng.standard_normal(pool).astype(BF16), self.tables,
            np.stack([rows[r][LENGTHS[r]] for r in range(R)]), rng.standard_normal((R, NQ, HDA)).astype(BF16),
            rows[1][:CHUNK], rows[0][:CHUNK], rng.standard_normal((CHUNK, NQ, HDA)).astype(BF16),
            np.zeros((CHUNK, NQ * HDA), BF16))]
        self.k, self.v, self.t, x, q, self.hidden, normed, q_roped, attn_ctx = self.bufs
        self.tv, self.x, self.q = self.t.view("i32", (R, MP)), x.view("bf16", (R, H)), q.view("bf16", (R, NQ, HDA))
        self.normed, self.q_roped = normed.view("bf16", (CHUNK, H)), q_roped.view("bf16", (CHUNK, NQ, HDA))
        self.attn_ctx = attn_ctx.view("bf16", (CHUNK, NQ * HDA))
        self.out = cm.DeviceBuffer(ROW)
        self.scratch = cm.DeviceBuffer(idx.prefill_scratch_bytes(MAX_TOKENS))
        self.bufs += [self.out, self.scratch]
        self.sel = idx.decode_select_batch(self.states, self.x, self.tv, BS, s)
        cm.stream_sync(s)

    # -- the entry points, each with valid defaults ---------------------------------------------------------
    def decode_select_batch(self, normed=None, block_tables=None) -> None:
        self.sel = self.idx.decode_select_batch(self.states, self.x if normed is None else normed,
                                                self.tv if block_tables is None else block_tables, BS, self.s,
                                                max_pages=MP)

    def sparse_decode_attention(self, q=None, k_pool=None, v_pool=None, block_tables=None, out=None) -> None:
        self.idx.sparse_decode_attention(self.q if q is None else q, self.k if k_pool is None else k_pool,
                                         self.v if v_pool is None else v_pool, block_tables, self.sel,
                                         self.out if out is None else out, self.s, nq=NQ)

    def decode_select(self, normed=None, k_pool=None, v_pool=None, block_table_dev=None) -> None:
        st = self.states[0]
        self.idx.decode_select(st, self.x if normed is None else normed, st.ingested,
                               self.k if k_pool is None else k_pool, self.v if v_pool is None else v_pool,
                               self.t if block_table_dev is None else block_table_dev, BS, self.s)

    def prefill_ingest(self, hidden=None) -> None:
        st = self.states[1]
        self.idx.prefill_ingest(st, self.hidden if hidden is None else hidden, CHUNK, st.ingested, self.s)

    def prefill_select(self, normed=None, q_roped=None, attn_ctx=None, k_pool=None, v_pool=None,
                       scratch=None) -> None:
        st, n = self.states[0], self.states[0].ingested
        self.idx.prefill_select(st, self.normed if normed is None else normed,
                                self.q_roped if q_roped is None else q_roped,
                                self.attn_ctx if attn_ctx is None else attn_ctx, self.k if k_pool is None else k_pool,
                                self.v if v_pool is None else v_pool, self.prefill_table, n - CHUNK, CHUNK, NQ, BS,
                                HDA ** -0.5, self.scratch if scratch is None else scratch, self.s)

    def need(self, call: str, name: str) -> int:
        """The bytes the call reads or writes at argument ``name``'s address."""
        n = self.states[0].ingested
        return {("decode_select_batch", "normed"): R * H * 2, ("decode_select", "normed"): H * 2,
                ("prefill_select", "normed"): CHUNK * H * 2, ("prefill_ingest", "hidden"): CHUNK * H * 2,
                ("decode_select_batch", "block_tables"): 4 * R * MP, ("sparse_decode_attention", "block_tables"):
                4 * R * MP, ("decode_select", "block_table_dev"): 4 * ceil_div(n + 1, BS),
                ("prefill_select", "scratch"): self.idx.prefill_scratch_bytes(n),
                ("prefill_select", "k_pool"): self.prefill_pool(), ("prefill_select", "v_pool"): self.prefill_pool(),
                }.get((call, name), {"q": ROW, "out": ROW, "q_roped": ATTN, "attn_ctx": ATTN}.get(name, PAGE))

    def prefill_pool(self) -> int:
        return ceil_div(self.states[0].ingested, BS) * PAGE

    def observed(self) -> list:
        """What a failed call must leave alone: each state's counters, device position and keys; the selection."""
        s, got = self.s, []
        for st_ in self.states:
            raw = download(st_.raw_keys, (st_.ingested, HD), np.uint16, s).tobytes()
            blocks = download(st_.block_keys, (st_.pooled, HD), np.uint16, s).tobytes()
            got.append((st_.ingested, st_.pooled, st_.table_len, st_.sync(s), raw, blocks))
        sel = self.sel
        got.append((download(sel.counts_dev, (R,), np.int32, s).tobytes(),
                    download(sel.tokens_dev, (R, sel.sel_cap), np.int32, s).tobytes()))
        return got

    def close(self) -> None:
        for st_ in self.states:
            self.idx.release_seq_state(st_)
        self.idx.close()
        for b in (*self.bufs, *self.layer.bufs):
            b.close()


@pytest.fixture(scope="module")
def world(gpu, ctx):
    w = World(gpu, ctx.stream)
    yield w
    w.close()


ARGS = {"decode_select_batch": ("normed", "block_tables"),
        "sparse_decode_attention": ("q", "k_pool", "v_pool", "block_tables", "out"),
        "decode_select": ("normed", "k_pool", "v_pool", "block_table_dev"),
        "prefill_ingest": ("hidden",),
        "prefill_select": ("normed", "q_roped", "attn_ctx", "k_pool", "v_pool", "scratch")}


def expect_refused(world: World, call: Any, fits: bool, what: str) -> None:
    """``call`` raises HssError ("overlaps" where the argument fits its buffer) before any device work."""
    with driver_calls() as seen:
        with pytest.raises(HssError, match="overlaps" if fits else None):
            call()
    assert seen == [], f"{what}: device work before the error: {seen}"


def aligned(frac: int, span: int, align: int) -> int:
    """A byte offset in [0, span), a multiple of ``align``, chosen by ``frac``."""
    return frac % max(1, span // align) * align


@pytest.mark.parametrize("call", list(ARGS))
@given(data=st.data())
def test_an_address_inside_the_indexers_memory_is_refused(world, call, data):
    """Each owned range in turn (every allocation of the indexer and of its states, and its pinned staging) at an
    offset hypothesis picks, as one argument of the call."""
    name = data.draw(st.sampled_from(ARGS[call]), label="argument")
    frac = data.draw(st.integers(0, 2**31), label="offset")
    fn = getattr(world, call)
    need, align = world.need(call, name), ALIGN.get(name, 16)
    idx = world.idx
    owned = {(b.ptr, b.ptr + b.bytes): "pinned staging" for b in (idx._pinned, idx._dev.pinned)}
    mine = idx.resources.ranges
    owned.update({(a, b): label for a, b, label in zip(mine._starts, mine._ends, mine._labels)})
    assert len(owned) > 20 and all(any(int(k) == a for a, _ in owned) for st_ in world.states
                                   for k in (st_.raw_keys, st_.block_keys))
    before = world.observed()
    for (start, end), label in owned.items():
        size = end - start
        fits = size >= need
        addr = start + aligned(frac, size - need + 1 if fits else size, align)
        expect_refused(world, lambda: fn(**{name: addr}), fits and _args.RANGES.find(addr) == (start, end),
                       f"{call}({name} inside {label})")
    assert world.observed() == before, "a refused call changed a state or the selection"
    fn()   # a valid call works afterwards
    if call in ("decode_select_batch", "sparse_decode_attention"):
        # the batched calls let the same arrays pass again at once: not once their memory is gone
        name, nbytes = ("normed", R * H * 2) if call == "decode_select_batch" else ("out", ROW)
        tmp = cm.DeviceBuffer(nbytes)
        cm.memset_d8_async(tmp, 0, nbytes, world.s)
        fn(**{name: tmp})
        tmp.close()
        before = world.observed()
        with driver_calls() as seen, pytest.raises(HssError, match=f"{name} is a closed DeviceBuffer"):
            fn(**{name: tmp})
        assert seen == [] and world.observed() == before
    cm.stream_sync(world.s)


WRITTEN = {"sparse_decode_attention": ("out", ROW, ("q", "k_pool", "v_pool", "block_tables", "selection's")),
           "prefill_select": ("attn_ctx", ATTN, ("normed", "q_roped", "k_pool", "v_pool", "scratch"))}


@pytest.mark.parametrize("call", list(WRITTEN))
@given(frac=st.integers(0, 2**31), as_int=st.booleans())
def test_a_written_argument_inside_another_argument_is_refused(world, call, frac, as_int):
    """The written argument at an offset hypothesis picks inside each other argument of the call in turn (the pools
    given as buffers, or as int addresses, which reach the end of their buffer)."""
    written, need, targets = WRITTEN[call]
    fn = getattr(world, call)
    before = world.observed()
    for target in targets:
        kw: dict[str, Any] = {}
        if target in ("k_pool", "v_pool"):
            buf = getattr(world, target[0])
            base, span = buf.ptr, buf.bytes - need + 1
            if as_int:
                kw[target] = buf.ptr
        elif target == "selection's":
            base, span = int(world.sel.block_tables), 4 * R * MP
        elif target == "block_tables":
            base, span = world.tv.ptr, 4 * R * MP
            kw["block_tables"] = world.tv
        elif target == "scratch":   # the part the call uses
            base, span = world.scratch.ptr, world.idx.prefill_scratch_bytes(world.states[0].ingested)
        else:
            view = getattr(world, target)
            base, span = view.ptr, view.nbytes
        kw[written] = base + aligned(frac, span, ALIGN[written])
        expect_refused(world, lambda: fn(**kw), True, f"{call}({written} inside {target})")
    assert world.observed() == before, "a refused call changed a state or the selection"
    fn(**{k: v for k, v in kw.items() if k != written})   # the same arguments with a separate output work
    cm.stream_sync(world.s)


@given(frac=st.integers(0, 2**31), n=st.integers(1, 3))
def test_a_blob_in_the_indexers_pinned_memory_is_refused(world, frac, n):
    """restore_aux's blob inside the indexer's pinned staging (which its later steps overwrite under the upload)."""
    idx, s = world.idx, world.s
    st_ = idx.new_seq_state()
    try:
        idx.prefill_ingest(st_, world.hidden, n, 0, s)
        blob = idx.snapshot_aux(st_, s)
        pinned = idx._pinned.array
        off = frac % (pinned.size - len(blob) + 1)
        pinned[off:off + len(blob)] = np.frombuffer(blob, np.uint8)
        before = world.observed()
        expect_refused(world, lambda: idx.restore_aux(st_, pinned[off:off + len(blob)], s), True,
                       "restore_aux(blob)")
        assert world.observed() == before and (st_.ingested, st_.sync(s)) == (n, n)
        idx.restore_aux(st_, blob, s)   # the same bytes from the caller's memory
        assert (st_.ingested, st_.sync(s)) == (n, n)
    finally:
        idx.release_seq_state(st_)
