"""State-machine fuzzing of QsaIndexer: random sequences of prefill chunks (continuing and restarting), decode steps
on the host path and batched on the device (``decode_select_batch``, then ``sparse_decode_attention``), prefill
selections, snapshots and restores, new and released states, hostile arguments, and injected driver faults and
interrupts at any driver call of a valid call, against a plain-Python model of every sequence.

After every rule: each live state's counters, device position, raw keys (the reference projection of the hidden
rows the model says it ingested) and block keys (the reference pooling of those raw keys) equal the model; a
rule's outputs equal the reference (a decode step's selection is the host top-k of its scores, the scores are the
reference's, the gathered K/V rows exactly the pool's; a batched step's token lists are the device top-k rule of
``hss.reference.qsa_device`` on its scores, its sparse attention the float64 reference over those tokens); a failed
rule (hostile or faulted) changed nothing (nor the last batched selection, which stays usable) and a hostile one did
no device work. At teardown every state is released and the indexers and backend closed: ``mem_info`` is back to
its start value.

Run length: the hypothesis profile's (tests/conftest.py) examples, with the step counts below.
"""
from __future__ import annotations

import gc
import math
import os
from dataclasses import dataclass, field

import numpy as np
import pytest
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from test_qsa_indexer import driver_calls

from hss import _args
from hss import cuda_min as cm
from hss._util import ceil_div
from hss.cuda._driver import CudaError, HssError
from hss.cuda.gpu import CudaBackend
from hss.qsa import QsaIndexer, select_tokens
from hss.reference import qsa as ref
from hss.reference import qsa_device as rd
from hss.reference.linear import proj_dense

from conftest import ON_GPU
from helpers import BF16, assert_close, download, upload

HIDDEN, N_HEADS, HD, RATIO, BUDGET, ROT, THETA, EPS = 64, 4, 128, 4, 8, 64, 1e7, 1e-6
NKV, HD_ATTN, NQ, BS, MAX_TOKENS, MAX_SEQS = 2, 64, 4, 16, 64, 3
BOUND = BUDGET + RATIO - 1                 # inert_bound(): 11
K_BLOCKS = BUDGET // RATIO
ROWS = 3 * MAX_TOKENS                      # the hidden rows every chunk and step is drawn from
PAGES = MAX_TOKENS // BS + 2
TH32, EPS32 = float(np.float32(THETA)), float(np.float32(EPS))
RUNS = {"emulator": dict(max_examples=20, stateful_step_count=20), "gpu": dict(max_examples=20, stateful_step_count=25),
        "sanitize": dict(max_examples=2, stateful_step_count=8)}


@dataclass
class Seq:
    """The model of one sequence: the hidden row each ingested position came from, blocks pooled, table pages."""
    rows: list[int] = field(default_factory=list)
    pooled: int = 0
    table_len: int = 0

    def copy(self) -> Seq:
        return Seq(list(self.rows), self.pooled, self.table_len)


class QsaMachine(RuleBasedStateMachine):
    @initialize(seed=st.integers(0, 2**32 - 1))
    def setup(self, seed: int) -> None:
        self.ctx = cm.CudaCtx(0)
        self.stream = self.ctx.stream
        rng = self.rng = np.random.default_rng(seed)
        s = self.stream
        if ON_GPU and not _CUBLAS_LOADED:
            _load_cublas(self.ctx, s)
        gc.collect()   # what earlier tests dropped is freed now, not during this run
        self.free0, self.live0 = cm.mem_info()[0], live_buffers()
        self.gpu = CudaBackend(self.ctx)
        self.w = (rng.standard_normal(((N_HEADS + 1) * HD, HIDDEN)) / math.sqrt(HIDDEN)).astype(BF16)
        self.kn = (rng.standard_normal(HD) * 0.1).astype(BF16)
        self.hidden = (rng.standard_normal((ROWS, HIDDEN)) * 0.5).astype(BF16)
        self.ref_raw = proj_dense(self.hidden, self.w)[:, N_HEADS * HD:]
        self.k = rng.standard_normal((PAGES, BS, NKV, HD_ATTN)).astype(BF16)
        self.v = rng.standard_normal((PAGES, BS, NKV, HD_ATTN)).astype(BF16)
        self.table = rng.permutation(PAGES)[:ceil_div(MAX_TOKENS, BS)].astype(np.int32)
        self.bufs = [upload(a, s) for a in (self.w, (rng.standard_normal(HD) * 0.1).astype(BF16), self.kn,
                                            self.hidden, self.k, self.v, self.table,
                                            np.tile(self.table, (MAX_SEQS, 1)),   # every sequence's page table
                                            *(np.zeros((MAX_SEQS, NQ, HD_ATTN), BF16) for _ in range(2)))]   # q, out
        self.d_w, self.d_qn, self.d_kn, self.d_hidden, self.d_k, self.d_v, self.d_table, self.d_tables, self.d_q, \
            self.d_out = self.bufs
        self.sel = None                         # the last batched selection
        self.released: list = []                # states released (a batch holding one is refused)
        dims = dict(n_heads=N_HEADS, hd=HD, ratio=RATIO, budget=BUDGET, rot=ROT, theta=THETA, eps=EPS, hidden=HIDDEN,
                    nkv_attn=NKV, hd_attn=HD_ATTN, gpu=self.gpu, max_tokens=MAX_TOKENS, max_seqs=MAX_SEQS)
        self.idx = QsaIndexer(self.d_w, self.d_qn, self.d_kn, **dims)
        self.other = QsaIndexer(self.d_w, self.d_qn, self.d_kn, **dims)   # its state is a foreign one
        self.foreign = self.other.new_seq_state()
        self.live: list[tuple] = []             # (QsaSeqState, Seq); one at least (release keeps one)
        self.snaps: list[tuple[bytes, Seq]] = []
        self.small, self.closed = cm.DeviceBuffer(16), cm.DeviceBuffer(HIDDEN * 2)
        self.closed.close()
        self.scratch = cm.DeviceBuffer(self.idx.prefill_scratch_bytes(MAX_TOKENS))
        self.new_state()
        self.ingest(0, True, int(rng.integers(0, 2 * BOUND)), int(rng.integers(0, ROWS - 30)))
        cm.stream_sync(s)

    def teardown(self) -> None:
        if not hasattr(self, "idx"):
            return
        for seq, _ in self.live:
            self.idx.release_seq_state(seq)
        self.other.release_seq_state(self.foreign)
        self.idx.close()
        self.other.close()
        for b in self.bufs + [self.small, self.scratch]:
            b.close()
        self.gpu.close()
        gc.collect()
        assert live_buffers() == self.live0, "an hss buffer (device or pinned) was not freed"
        if os.environ.get("HSS_HYPOTHESIS_PROFILE") != "sanitize":   # compute-sanitizer's own device allocations
            assert cm.mem_info()[0] == self.free0, "device memory was not given back"   # move the free count
        self.ctx.close()

    # -- helpers -------------------------------------------------------------------------------------------
    def pick(self, i: int) -> tuple:
        return self.live[i % len(self.live)]

    def row(self, r: int) -> int:
        return self.d_hidden.ptr + r * HIDDEN * 2

    def model_after_ingest(self, m: Seq, start: int, r0: int, n: int) -> Seq:
        new = Seq(([] if start == 0 else m.rows[:start]) + list(range(r0, r0 + n)), 0, m.table_len)
        new.pooled = len(new.rows) // RATIO
        return new

    def group(self, picks: list[int]) -> list[tuple]:
        """Distinct live states (with their models), in the order ``picks`` names them."""
        seen: dict[int, tuple] = {}
        for p in picks:
            x = self.pick(p)
            seen.setdefault(id(x[0]), x)
        return list(seen.values())

    def tables(self, R: int):
        return self.d_tables.view("i32", (R, self.table.size))

    def batch_call(self, group: list[tuple], r0: int):
        seqs = tuple(seq for seq, _ in group)
        return lambda: self.idx.decode_select_batch(seqs, self.row(r0), self.tables(len(seqs)), BS, self.stream)

    def advance(self, group: list[tuple], r0: int) -> None:
        """The models of a batched step's states: row r ingested row r0 + r."""
        for r, (seq, m) in enumerate(group):
            pos = len(m.rows)
            self.live[self.live.index((seq, m))] = (seq, Seq(m.rows + [r0 + r], (pos + 1) // RATIO, m.table_len))

    def selection_bytes(self) -> bytes:
        """The last batched selection's counts and token lists (what a failed step must leave alone)."""
        sel = self.sel
        if sel is None:
            return b""
        return (download(sel.counts_dev, (sel.R,), np.int32, self.stream).tobytes() +
                download(sel.tokens_dev, (sel.R, sel.sel_cap), np.int32, self.stream).tobytes())

    def attend_call(self, out=None):
        sel = self.sel
        q = self.d_q.view("bf16", (sel.R, NQ, HD_ATTN))
        return lambda: self.idx.sparse_decode_attention(q, self.d_k, self.d_v, None, sel,
                                                        self.d_out if out is None else out, self.stream)

    def expect_failure(self, call, exc, *, device_work: bool = False) -> None:
        """``call`` raises ``exc`` and, unless ``device_work``, queues nothing; the invariants then check that it
        changed nothing."""
        with driver_calls() as seen:
            with pytest.raises(exc):
                call()
        if not device_work:
            assert seen == [], f"device work before the error: {seen}"

    # -- rules ---------------------------------------------------------------------------------------------
    @precondition(lambda self: len(self.live) < MAX_SEQS)
    @rule()
    def new_state(self) -> None:
        self.live.append((self.idx.new_seq_state(), Seq()))

    @precondition(lambda self: len(self.live) > 1)
    @rule(i=st.integers(0, 7))
    def release(self, i: int) -> None:
        seq, m = self.pick(i)
        self.idx.release_seq_state(seq)
        self.live.remove((seq, m))
        assert seq.released
        self.released = [seq]

    @rule(i=st.integers(0, 7), restart=st.booleans(), n=st.integers(0, 30), r0=st.integers(0, ROWS - 30))
    def ingest(self, i: int, restart: bool, n: int, r0: int) -> None:
        seq, m = self.pick(i)
        start = 0 if restart else len(m.rows)
        n = min(n, MAX_TOKENS - start)
        self.idx.prefill_ingest(seq, self.row(r0), n, start, self.stream)
        self.live[self.live.index((seq, m))] = (seq, self.model_after_ingest(m, start, r0, n))

    @rule(i=st.integers(0, 7), r=st.integers(0, ROWS - 1))
    def decode(self, i: int, r: int) -> None:
        seq, m = self.pick(i)
        pos = len(m.rows)
        if pos >= MAX_TOKENS:
            return self.expect_failure(lambda: self.idx.decode_select(seq, self.row(r), pos, self.d_k, self.d_v,
                                                                      self.d_table, BS, self.stream), HssError)
        sel = self.idx.decode_select(seq, self.row(r), pos, self.d_k, self.d_v, self.d_table, BS, self.stream)
        new = Seq(m.rows + [r], (pos + 1) // RATIO, m.table_len)
        visible = pos + 1
        assert (sel is None) == (visible <= BOUND)
        event(f"decode: {'inert' if sel is None else 'selective'}")
        if sel is not None:
            complete = visible // RATIO
            scores = download(self.idx.scores_dev, (complete,), np.float32, self.stream)
            bk = download(seq.block_keys, (complete, HD), BF16, self.stream)
            q_post = download(self.idx.q_post, (N_HEADS, HD), np.float32, self.stream)
            assert_close(scores, ref.score(q_post, bk), "f32", (0,), f"scores at pos {pos}")
            assert np.array_equal(sel.tokens, select_tokens(scores, BUDGET // RATIO, RATIO, visible))
            n = sel.n_sel
            want_k, want_v = ref.gather(self.k, self.v, self.table, sel.tokens, BS)
            assert np.array_equal(download(sel.k_scratch, (n, NKV, HD_ATTN), BF16, self.stream).view(np.uint16),
                                  want_k.view(np.uint16))
            assert np.array_equal(download(sel.v_scratch, (n, NKV, HD_ATTN), BF16, self.stream).view(np.uint16),
                                  want_v.view(np.uint16))
            new.table_len = max(m.table_len, sel.max_blocks)
        self.live[self.live.index((seq, m))] = (seq, new)

    @precondition(lambda self: any(len(m.rows) > BOUND for _, m in self.live))
    @rule(i=st.integers(0, 7), cut=st.integers(0, MAX_TOKENS))
    def prefill_select(self, i: int, cut: int) -> None:
        """The chunk [start, ingested) of a sequence past the bound: rows below the bound keep their dense values,
        the selective ones are rewritten; the sequence is untouched."""
        candidates = [x for x in self.live if len(x[1].rows) > BOUND]
        seq, m = candidates[i % len(candidates)]
        total = len(m.rows)
        start = min(cut, total)
        n = total - start
        s = self.stream
        normed = upload(self.hidden[m.rows[start:]] if n else np.zeros((1, HIDDEN), BF16), s)
        q = upload(self.rng.standard_normal((max(n, 1), NQ, HD_ATTN)).astype(BF16), s)
        dense = self.rng.standard_normal((max(n, 1), NQ * HD_ATTN)).astype(BF16)
        out = upload(dense, s)
        try:
            got = self.idx.prefill_select(seq, normed, q, out, self.d_k, self.d_v, self.table, start, n, NQ, BS,
                                          HD_ATTN ** -0.5, self.scratch, s)
            first = max(BOUND, start)
            assert got == max(0, total - first)
            event(f"prefill_select: {'some' if got else 'no'} rows rewritten")
            after = download(out, dense.shape, np.uint16, s)
            keep = max(0, min(n, first - start))
            assert np.array_equal(after[:keep], dense.view(np.uint16)[:keep]), "an inert row was rewritten"
            assert np.isfinite(after[keep:n].view(BF16).astype(np.float32)).all()
        finally:
            for b in (normed, q, out):
                b.close()

    @rule(picks=st.lists(st.integers(0, 7), min_size=1, max_size=MAX_SEQS), r0=st.integers(0, ROWS - MAX_SEQS))
    def decode_batch(self, picks: list[int], r0: int) -> None:
        """One batched device step of some live states: each one's token list is the reference rule on the step's
        scores (which are the reference's of its q and block keys), and each state advanced by one."""
        group = self.group(picks)
        call = self.batch_call(group, r0)
        if any(len(m.rows) >= MAX_TOKENS for _, m in group):
            return self.expect_failure(call, HssError)   # a full sequence has no room
        sel = call()
        self.sel = sel
        self.sel_bytes = self.selection_bytes()
        s, dev = self.stream, self.idx._dev
        counts = download(sel.counts_dev, (sel.R,), np.int32, s)
        tokens = download(sel.tokens_dev, (sel.R, sel.sel_cap), np.int32, s)
        for r, (seq, m) in enumerate(group):
            pos = len(m.rows)
            complete = (pos + 1) // RATIO
            scores = np.zeros(complete, np.float32)
            if complete > K_BLOCKS:   # selective: the step scored every complete block
                scores = download(dev.scores_b + 4 * r * dev.max_blocks, (complete,), np.float32, s)
                q_post = download(dev.q_post_b + 4 * r * N_HEADS * HD, (N_HEADS, HD), np.float32, s)
                bk = download(seq.block_keys, (complete, HD), BF16, s)
                assert_close(scores, ref.score(q_post, bk), "f32", (0,), f"batched scores at pos {pos}")
            want = rd.step_tokens(scores, pos, RATIO, K_BLOCKS)
            assert np.array_equal(tokens[r, :counts[r]], want), f"row {r} at pos {pos}: another token list"
        selective = any((len(m.rows) + 1) // RATIO > K_BLOCKS for _, m in group)
        event(f"decode_batch: R = {sel.R}, {'some rows selective' if selective else 'inert'}")
        self.advance(group, r0)

    @rule(seed=st.integers(0, 2**32 - 1))
    def attend(self, seed: int) -> None:
        """Sparse attention over the last batched selection (any states since released or restored: it reads only
        the selection and the pools) equals the float64 reference over its token lists."""
        sel, s = self.sel, self.stream
        if sel is None:
            return
        q = np.random.default_rng(seed).standard_normal((sel.R, NQ, HD_ATTN)).astype(BF16)
        cm.copy_h_to_d_async(self.d_q, q, q.nbytes, s)
        self.attend_call()()
        got = download(self.d_out, q.shape, BF16, s).astype(np.float64)
        counts = download(sel.counts_dev, (sel.R,), np.int32, s)
        tokens = download(sel.tokens_dev, (sel.R, sel.sel_cap), np.int32, s)
        want = np.stack([rd.sparse_attention(q[r], self.k, self.v, self.table, tokens[r, :counts[r]], BS,
                                             HD_ATTN ** -0.5) for r in range(sel.R)])
        assert_close(got, want, "bf16", (2,), "sparse attention over the selection")

    @rule(i=st.integers(0, 7))
    def snapshot(self, i: int) -> None:
        seq, m = self.pick(i)
        self.snaps.append((self.idx.snapshot_aux(seq, self.stream), m.copy()))

    @precondition(lambda self: self.snaps)
    @rule(i=st.integers(0, 7), j=st.integers(0, 7), trailer=st.booleans())
    def restore(self, i: int, j: int, trailer: bool) -> None:
        seq, m = self.pick(i)
        blob, snap = self.snaps[j % len(self.snaps)]
        self.idx.restore_aux(seq, blob if trailer else blob[:-20], self.stream)
        self.live[self.live.index((seq, m))] = (seq, Seq(list(snap.rows), snap.pooled, m.table_len))

    @rule(i=st.integers(0, 7), kind=st.integers(0, 23), r=st.integers(0, ROWS - MAX_SEQS))
    def hostile(self, i: int, kind: int, r: int) -> None:
        """A bad argument of some call: an error naming it, before any device work, and nothing changed."""
        seq, m = self.pick(i)
        idx, s, pos = self.idx, self.stream, len(m.rows)
        k, v, t = self.d_k, self.d_v, self.d_table
        blob = self.snaps[r % len(self.snaps)][0] if self.snaps else None
        owned = idx.resources.ranges
        starts, ends = owned._starts, owned._ends   # an address inside memory the indexer owns
        j = r % len(starts)
        mine = starts[j] + (r * 16) % (ends[j] - starts[j]) // 16 * 16
        group = self.group([i, i + 1, i + 2])
        batch = tuple(x for x, _ in group)
        rows = self.row(r)
        attend = self.attend_call if self.sel is not None else \
            lambda out=None: lambda: idx.sparse_decode_attention(self.d_q, k, v, None, "sel", out, s)
        cases = [
            (lambda: idx.decode_select(seq, self.row(r), pos + 1, k, v, t, BS, s), HssError),       # lost sync
            (lambda: idx.decode_select(seq, self.small, pos, k, v, t, BS, s), HssError),           # too small
            (lambda: idx.decode_select(seq, self.closed, pos, k, v, t, BS, s), HssError),          # closed
            (lambda: idx.decode_select(seq, idx.qk_scratch, pos, k, v, t, BS, s), HssError),       # own memory
            (lambda: idx.decode_select(seq, self.row(r), pos, k, v, t, 4, s), HssError),           # block_size
            (lambda: idx.decode_select(seq, self.row(r), pos, k, v, t, BS, None), TypeError),      # no stream
            (lambda: idx.decode_select(self.foreign, self.row(r), 0, k, v, t, BS, s), HssError),   # foreign
            (lambda: idx.prefill_ingest(seq, self.small, 4, 0, s), HssError),     # the 16-byte hidden
            (lambda: idx.prefill_ingest(seq, self.row(r), 1, pos + 1, s), HssError),               # a gap
            (lambda: idx.prefill_ingest(seq, self.row(0), MAX_TOKENS + 1 - pos, pos, s), HssError),  # too long
            (lambda: idx.prefill_ingest(seq, seq.raw_keys, 1, 0, s), HssError),                    # its own keys
            (lambda: idx.release_seq_state(self.foreign), HssError),
            (lambda: idx.restore_aux(seq, blob[:-1] if blob else b"", s), HssError),              # cut short
            (lambda: idx.restore_aux(seq, _flip(blob, r) if blob else b"\0" * 15, s), HssError),  # a flipped bit
            (lambda: idx.snapshot_aux(seq, 1.5), TypeError),
            (lambda: idx.prefill_select(seq, self.row(0), self.small, self.small, k, v, self.table, 0,
                                        pos if pos else 1, NQ, BS, 0.1, self.scratch, s), HssError),  # attn_ctx small
            (lambda: idx.decode_select_batch(batch, mine, self.tables(len(batch)), BS, s), HssError),  # own memory
            (lambda: idx.decode_select_batch(batch, rows, mine, BS, s, max_pages=1), HssError),        # own memory
            (lambda: idx.decode_select_batch(batch + (batch[0],), rows, self.tables(len(batch) + 1), BS, s),
             HssError),                                                                        # a state twice
            (lambda: idx.decode_select_batch((*batch[:-1], *(self.released or [self.foreign])), rows,
                                             self.tables(len(batch)), BS, s), HssError),   # released or foreign
            (lambda: idx.decode_select_batch(batch, rows, self.tables(len(batch)), BS, s, max_pages=0), HssError),
            (attend(seq.raw_keys + (r * 2) % (MAX_TOKENS * HD)), (HssError, TypeError)),     # into a state's keys
            (attend(self.d_q), (HssError, TypeError)),                                       # out == q
            (attend(k.ptr + (r * 2) % (k.bytes - 4096)), (HssError, TypeError)),             # into the K pool
        ]
        call, exc = cases[kind]
        if kind <= 5 and pos >= MAX_TOKENS:   # a full sequence: the position check may come first (also bad input)
            exc = (HssError, TypeError)
        self.expect_failure(call, exc)
        assert not self.foreign.released

    @rule(i=st.integers(0, 7), op=st.sampled_from(["decode", "ingest", "restart", "restore", "batch", "attend"]),
          at=st.integers(0, 12), interrupt=st.booleans(), r=st.integers(0, ROWS - 30))
    def fault(self, i: int, op: str, at: int, interrupt: bool, r: int) -> None:
        """A valid call whose ``at``-th driver call fails (or is interrupted): either it fails and changes nothing (a
        batched step leaves the last selection usable; an attention leaves its output unwritten), or it had fewer
        driver calls and succeeded (the model then moves)."""
        seq, m = self.pick(i)
        pos, s = len(m.rows), self.stream
        group = [x for x in self.group([j for j in range(len(self.live)) if i >> j & 1] or [i])
                 if len(x[1].rows) < MAX_TOKENS]
        new = None
        if op in ("batch", "attend"):
            at %= 5   # a step queues four driver calls (an attention's first also allocates): fail most of them
        if op == "batch" and group:
            call = self.batch_call(group, r)
        elif op == "attend" and self.sel is not None:
            cm.memset_d8_async(self.d_out, 0xFF, self.d_out.bytes, s)
            call = self.attend_call()
        elif op == "decode" and pos < MAX_TOKENS:
            call = lambda: self.idx.decode_select(seq, self.row(r), pos, self.d_k, self.d_v, self.d_table, BS, s)  # noqa: E731
            new = Seq(m.rows + [r], (pos + 1) // RATIO, m.table_len)
            if pos + 1 > BOUND:
                new.table_len = max(m.table_len, ceil_div((pos + 1) % RATIO + BUDGET, BS))
        elif op in ("ingest", "restart"):
            start = 0 if op == "restart" else pos
            n = min(5, MAX_TOKENS - start)
            call = lambda: self.idx.prefill_ingest(seq, self.row(r), n, start, s)  # noqa: E731
            new = self.model_after_ingest(m, start, r, n)
        elif op == "restore" and self.snaps:
            blob, snap = self.snaps[r % len(self.snaps)]
            call = lambda: self.idx.restore_aux(seq, blob, s)  # noqa: E731
            new = Seq(list(snap.rows), snap.pooled, m.table_len)
        else:
            return
        with driver_calls(at, interrupt) as seen:
            try:
                got = call()
            except (CudaError, KeyboardInterrupt):
                assert len(seen) > at, "the call failed before the injected fault"   # (a rollback may call more)
                event(f"fault: {op} failed at {seen[at]}")
                if op == "attend":
                    out = download(self.d_out, (self.d_out.bytes,), np.uint8, s)
                    assert (out == 0xFF).all(), "a failed attention wrote its output"
                return
        event(f"fault: {op} had fewer calls")
        assert len(seen) <= at, "the injected fault did not fail the call"
        if op == "batch":
            self.sel = got
            self.sel_bytes = self.selection_bytes()
            self.advance(group, r)
        elif new is not None:
            self.live[self.live.index((seq, m))] = (seq, new)

    # -- invariants ----------------------------------------------------------------------------------------
    @invariant()
    def sequences_equal_their_models(self) -> None:
        if not hasattr(self, "idx"):
            return
        s = self.stream
        if self.sel is not None:   # the last batched selection: unchanged, and still this indexer's latest
            assert self.selection_bytes() == self.sel_bytes, "the last batched selection changed"
            assert self.sel._generation == self.idx._dev.generation
        for seq, m in self.live:
            n = len(m.rows)
            assert (seq.ingested, seq.pooled, seq.table_len) == (n, m.pooled, m.table_len)
            assert seq.sync(s) == n, "the device position differs from the host mirror"
            raw = download(seq.raw_keys, (n, HD), BF16, s)
            if n:
                assert_close(raw, self.ref_raw[m.rows], "bf16", (1,), "raw keys vs the reference projection")
            if m.pooled:
                bk = download(seq.block_keys, (m.pooled, HD), BF16, s)
                want = ref.block_pool(raw, self.kn, 0, m.pooled, RATIO, ROT, TH32, EPS32)
                assert_close(bk, want, "bf16", (1,), "block keys vs the reference pooling")


_CUBLAS_LOADED: list[bool] = []


def _load_cublas(ctx: cm.CudaCtx, s: int) -> None:
    """Run the indexer's projection GEMM once at every row count the machine can use, before the first memory
    baseline of the process: cuBLAS loads the kernels of a shape into the context on first use and keeps them there
    (library code, not hss memory: its first GEMM would read as ~6 MiB not given back)."""
    rng = np.random.default_rng(0)
    gpu = CudaBackend(ctx)
    norm_w = (rng.standard_normal(HD) * 0.1).astype(BF16)
    bufs = [upload(a, s) for a in ((rng.standard_normal(((N_HEADS + 1) * HD, HIDDEN)) * 0.1).astype(BF16), norm_w,
                                   norm_w, (rng.standard_normal((MAX_TOKENS, HIDDEN)) * 0.5).astype(BF16))]
    try:
        idx = QsaIndexer(*bufs[:3], n_heads=N_HEADS, hd=HD, ratio=RATIO, budget=BUDGET, rot=ROT, theta=THETA,
                         eps=EPS, hidden=HIDDEN, nkv_attn=NKV, hd_attn=HD_ATTN, gpu=gpu, max_tokens=MAX_TOKENS,
                         max_seqs=MAX_SEQS)
        try:
            for m in range(1, MAX_TOKENS + 1):
                idx._gemm(int(bufs[3].ptr), m, s)
            cm.stream_sync(s)
        finally:
            idx.close()
    finally:
        for b in bufs:
            b.close()
        gpu.close()
    _CUBLAS_LOADED.append(True)


def live_buffers() -> list[tuple[int, int]]:
    """The (start, end) of every live hss buffer, device and pinned (the argument layer's registry)."""
    starts, ends = _args.RANGES.snapshot
    return list(zip(starts, ends))


def _flip(blob: bytes, r: int) -> bytes:
    bad = bytearray(blob)
    bad[r % len(bad)] ^= 1 << (r % 8)
    return bytes(bad)


TestQsaIndexerStateMachine = QsaMachine.TestCase
TestQsaIndexerStateMachine.settings = settings(settings.default, **RUNS.get(settings._current_profile,
                                                                           RUNS["emulator"]))
