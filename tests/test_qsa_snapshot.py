"""QsaIndexer.snapshot_aux / restore_aux (docs/design.md §11.6): the blob format, a round trip that restores
bit-identical raw and block keys and identical later decode selections (also when rolling back a speculative draft), and
every kind of bad blob rejected before anything is written (poisoned state buffers stay poisoned, counters unchanged,
no device call).
"""
from __future__ import annotations

import math
import struct
import zlib

import numpy as np
import pytest
from test_qsa_indexer import driver_calls

from hss import cuda_min as cm
from hss._util import ceil_div
from hss.cuda._driver import CudaError, HssError
from hss.qsa import QsaIndexer, snapshot

from conftest import ON_GPU
from helpers import BF16, Recording, download, upload

HIDDEN = 2560 if ON_GPU else 256
N_HEADS, HD, RATIO, BUDGET, ROT, THETA, EPS = 4, 128, 4, 2048, 64, 1e7, 1e-6
NKV, HD_ATTN, BS = 2, 64, 16
QKW = (N_HEADS + 1) * HD


@pytest.fixture(scope="module")
def weights(ctx):
    rng = np.random.default_rng(11)
    w = (rng.standard_normal((QKW, HIDDEN)) / math.sqrt(HIDDEN)).astype(BF16)
    norms = [(rng.standard_normal(HD) * 0.1).astype(BF16) for _ in range(2)]
    s = ctx.stream
    bufs = (upload(w, s), upload(norms[0], s), upload(norms[1], s))
    cm.stream_sync(s)
    return bufs


def indexer(gpu, weights, **kw) -> QsaIndexer:
    args = dict(n_heads=N_HEADS, hd=HD, ratio=RATIO, budget=BUDGET, rot=ROT, theta=THETA, eps=EPS, hidden=HIDDEN,
                nkv_attn=NKV, hd_attn=HD_ATTN, gpu=gpu, max_tokens=4096)
    args.update(kw)
    return QsaIndexer(*weights, **args)


def hidden_rows(rng, n: int, stream) -> cm.DeviceBuffer:
    return upload((rng.standard_normal((n, HIDDEN)) * 0.5).astype(BF16), stream)


def row(buf, i: int) -> int:
    return buf.ptr + i * HIDDEN * 2


def pools(rng, tokens: int, stream) -> tuple:
    pages = ceil_div(tokens, BS)
    k = rng.standard_normal((pages, BS, NKV, HD_ATTN)).astype(BF16)
    v = rng.standard_normal((pages, BS, NKV, HD_ATTN)).astype(BF16)
    return upload(k, stream), upload(v, stream), upload(np.arange(pages, dtype=np.int32), stream)


def keys(idx: QsaIndexer, st, stream) -> tuple[bytes, bytes]:
    """(raw keys of the ingested tokens, block keys of the pooled blocks) as bytes."""
    raw = download(st.raw_keys, (st.ingested, HD), np.uint16, stream)
    blocks = download(st.block_keys, (st.pooled, HD), np.uint16, stream)
    return raw.tobytes(), blocks.tobytes()


def poison(idx: QsaIndexer, st, stream) -> None:
    cm.memset_d8_async(st.raw_keys, 0xFF, idx.max_tokens * HD * 2, stream)
    cm.memset_d8_async(st.block_keys, 0xFF, idx.max_tokens // RATIO * HD * 2, stream)
    cm.stream_sync(stream)


def test_round_trip_and_later_selections(gpu, weights, stream, rng):
    T, steps = 2101, 4           # 525 complete blocks and a one-token tail; decode positions 2101.. are selective
    hidden = hidden_rows(rng, T + steps, stream)
    pool = pools(rng, T + steps, stream)
    with indexer(gpu, weights) as idx:
        a = idx.new_seq_state()
        idx.prefill_ingest(a, hidden, 1500, 0, stream)
        idx.prefill_ingest(a, row(hidden, 1500), T - 1500, 1500, stream)
        blob = idx.snapshot_aux(a, stream)           # no sync before: the snapshot is ordered after the ingest
        assert len(blob) == 16 + T * HD * 2 + 20 and isinstance(blob, bytes)
        assert struct.unpack_from("<QQ", blob) == (T, T // RATIO)
        raw_a, blocks_a = keys(idx, a, stream)
        assert blob[16:-20] == raw_a                 # the original's layout, then the trailer (docs/design.md §17.7)
        magic, version, fp, crc = struct.unpack_from("<4sIQI", blob, len(blob) - 20)
        assert (magic, version, crc) == (b"HSSQ", 1, zlib.crc32(blob[:-20]))
        assert fp == snapshot.fingerprint(HD, RATIO, 4096, N_HEADS)

        # restore into a state with another history, its buffers poisoned
        b = idx.new_seq_state()
        idx.prefill_ingest(b, hidden_rows(rng, 3000, stream), 3000, 0, stream)
        b.table_len = 7
        poison(idx, b, stream)
        idx.restore_aux(b, bytearray(blob), stream)
        assert (b.ingested, b.pooled, b.table_len) == (T, T // RATIO, 7), "counters restored, table_len untouched"
        assert keys(idx, b, stream) == (raw_a, blocks_a), "raw or block keys differ after the round trip"

        # identical later selections, and a speculative rollback on the original state
        firsts = []
        for pos in range(T, T + steps):
            sa = idx.decode_select(a, row(hidden, pos), pos, *pool, BS, stream)
            sb = idx.decode_select(b, row(hidden, pos), pos, *pool, BS, stream)
            assert sa is not None and np.array_equal(sa.tokens, sb.tokens), f"selections differ at pos {pos}"
            firsts.append(sa.tokens)
        idx.restore_aux(a, blob, stream)            # the draft tokens are rejected
        assert (a.ingested, a.pooled) == (T, T // RATIO)
        assert keys(idx, a, stream) == (raw_a, blocks_a)
        for pos, first in zip(range(T, T + steps), firsts):
            sel = idx.decode_select(a, row(hidden, pos), pos, *pool, BS, stream)
            assert np.array_equal(sel.tokens, first), f"the rolled-back sequence selects differently at pos {pos}"
        for st in (a, b):
            idx.release_seq_state(st)


def test_empty_and_partial_pooling(gpu, weights, stream, rng):
    rec = Recording(gpu)
    with indexer(rec, weights, max_tokens=64) as idx:
        st = idx.new_seq_state()
        empty = idx.snapshot_aux(st, stream)
        assert empty[:16] == struct.pack("<QQ", 0, 0) and len(empty) == 36
        idx.prefill_ingest(st, hidden_rows(rng, 30, stream), 30, 0, stream)
        full = idx.snapshot_aux(st, stream)
        raw, blocks = keys(idx, st, stream)
        del rec.calls[:]
        idx.restore_aux(st, empty, stream)
        assert (st.ingested, st.pooled) == (0, 0) and rec.calls == [], "an empty blob needs no device work"
        # a blob that pooled fewer blocks than complete: exactly those are pooled, the rest on the next ingest
        partial = struct.pack("<QQ", 30, 5) + full[16:-20]   # the original's format: no trailer
        idx.restore_aux(st, np.frombuffer(partial, dtype=np.uint8), stream)
        assert (st.ingested, st.pooled) == (30, 5)
        pools_launched = [args[1][0] for name, args in rec.calls if name == "launch"]
        assert pools_launched == [5]
        assert keys(idx, st, stream) == (raw, blocks[:5 * HD * 2])
        idx.prefill_ingest(st, hidden_rows(rng, 2, stream), 2, 30, stream)   # pools blocks 5..7
        assert st.pooled == 8
        assert download(st.block_keys, (7, HD), np.uint16, stream).tobytes() == blocks
        idx.release_seq_state(st)


def test_bad_blobs_rejected_before_any_write(gpu, weights, stream, rng):
    rec = Recording(gpu)
    other = indexer(gpu, weights, max_tokens=64)
    foreign = other.new_seq_state()
    with indexer(rec, weights, max_tokens=64) as idx:
        st = idx.new_seq_state()
        poison(idx, st, stream)
        st.ingested, st.pooled, st.table_len = 12, 3, 5
        body = lambda n: bytes(n * HD * 2)   # noqa: E731
        head = lambda i, p: struct.pack("<QQ", i, p)   # noqa: E731
        cases = [
            (b"", HssError, "truncated: 0 bytes"),
            (head(0, 0)[:15], HssError, "truncated: 15 bytes"),
            (head(10, 2) + body(10)[:-2], HssError, "size mismatch"),
            (head(10, 2) + body(10) + b"\0\0", HssError, "size mismatch"),
            (head(10, 2) + body(9), HssError, "size mismatch"),
            (head(65, 16) + body(65), HssError, "holds 65 tokens but this indexer keeps at most max_tokens = 64"),
            (head(2**64 - 1, 0), HssError, "max_tokens"),
            (head(10, 3) + body(10), HssError, "3 blocks are pooled but 10 tokens make only 2"),
            (head(0, 1), HssError, "1 blocks are pooled but 0 tokens"),
            ("not bytes", TypeError, "bytes-like"),
            (np.zeros(64, np.uint8)[::2], TypeError, "contiguous"),
        ]
        del rec.calls[:]
        for blob, exc, match in cases:
            with pytest.raises(exc, match=match):
                idx.restore_aux(st, blob, stream)
            assert rec.calls == [], f"device work before the error {match!r}"
            assert (st.ingested, st.pooled, st.table_len) == (12, 3, 5)
        raw = download(st.raw_keys, (idx.max_tokens * HD,), np.uint16, stream)
        blocks = download(st.block_keys, (idx.max_tokens // RATIO * HD,), np.uint16, stream)
        assert (raw == 0xFFFF).all() and (blocks == 0xFFFF).all(), "a rejected blob wrote to the state"
        good = head(8, 2) + body(8)
        for call in (lambda: idx.restore_aux(st, good, None), lambda: idx.snapshot_aux(st, 1.5)):
            with pytest.raises(TypeError, match="stream: a stream is required"):
                call()
        assert rec.calls == [] and (st.ingested, st.pooled, st.table_len) == (12, 3, 5)
        with pytest.raises(HssError, match="another indexer"):
            idx.restore_aux(foreign, good, stream)
        with pytest.raises(HssError, match="another indexer"):
            idx.snapshot_aux(foreign, stream)
        with pytest.raises(TypeError, match="QsaSeqState"):
            idx.snapshot_aux(None, stream)
        idx.release_seq_state(st)
        del rec.calls[:]
        with pytest.raises(HssError, match="released"):
            idx.restore_aux(st, good, stream)
        with pytest.raises(HssError, match="released"):
            idx.snapshot_aux(st, stream)
        assert rec.calls == []
    other.release_seq_state(foreign)
    other.close()


def test_the_trailer_catches_a_flipped_bit_and_a_foreign_config(gpu, weights, stream, rng):
    """A flipped bit anywhere in a blob (counters, keys, trailer) or a blob of an indexer of another configuration is
    an HssError before any write (the state keeps its counters and keys); the same bytes without the trailer (the
    original's format) restore anywhere they fit, as the original did."""
    hidden = hidden_rows(rng, 50, stream)
    rec = Recording(gpu)
    with indexer(rec, weights, max_tokens=64) as idx, indexer(gpu, weights, max_tokens=128) as wide:
        src, st = idx.new_seq_state(), idx.new_seq_state()
        idx.prefill_ingest(src, hidden, 30, 0, stream)
        idx.prefill_ingest(st, row(hidden, 30), 20, 0, stream)
        blob = idx.snapshot_aux(src, stream)
        want = (st.ingested, st.pooled, st.table_len, keys(idx, st, stream))
        tail = 8 * (len(blob) - 20)   # the trailer's first bit: magic, version, fingerprint, CRC
        bits = [0, 3, 8 * 8 + 1, 8 * 16 + 5, 8 * (len(blob) // 2), tail, tail + 33, tail + 70, tail + 130,
                8 * len(blob) - 1, *rng.integers(0, 8 * len(blob), 8).tolist()]
        del rec.calls[:]
        for bit in bits:
            bad = bytearray(blob)
            bad[bit // 8] ^= 1 << (bit % 8)
            with pytest.raises(HssError, match="restore_aux: "):
                idx.restore_aux(st, bytes(bad), stream)
            assert rec.calls == [], f"device work before the error (bit {bit})"
            assert (st.ingested, st.pooled, st.table_len, keys(idx, st, stream)) == want, f"bit {bit} changed st"
        version = bytearray(blob)
        struct.pack_into("<I", version, len(blob) - 16, 2)
        with pytest.raises(HssError, match="trailer has version 2"):
            idx.restore_aux(st, bytes(version), stream)
        other = wide.new_seq_state()
        with pytest.raises(HssError, match="taken from an indexer of another configuration"):
            wide.restore_aux(other, blob, stream)
        assert other.ingested == 0
        wide.restore_aux(other, blob[:-20], stream)          # the original's blob: accepted, no trailer to verify
        assert (other.ingested, other.pooled) == (30, 7) and keys(wide, other, stream) == keys(idx, src, stream)
        idx.restore_aux(st, blob, stream)
        assert keys(idx, st, stream) == keys(idx, src, stream)


def test_a_failed_restore_changes_nothing(gpu, weights, stream, rng):
    """Every driver call of a restore over a state holding other tokens fails in turn: the state keeps its counters,
    device position and keys (the overwritten rows are put back); the retry restores the blob exactly."""
    hidden = hidden_rows(rng, 80, stream)
    with indexer(gpu, weights, max_tokens=128) as idx:
        src, st = idx.new_seq_state(), idx.new_seq_state()
        idx.prefill_ingest(src, hidden, 41, 0, stream)
        idx.prefill_ingest(st, row(hidden, 41), 39, 0, stream)
        blob = idx.snapshot_aux(src, stream)

        def state():
            return st.ingested, st.pooled, st.sync(stream), keys(idx, st, stream)

        probe = idx.new_seq_state()
        for _ in range(2):   # the first allocates the indexer's restart backup; the second's calls are the ones
            idx.prefill_ingest(probe, hidden, 39, 0, stream)
            cm.stream_sync(stream)
            with driver_calls() as seen:
                idx.restore_aux(probe, blob, stream)
        assert "cuMemcpyDtoDAsync" in seen and "cuMemcpyHtoDAsync" in seen
        for i in range(len(seen)):
            before = state()
            with driver_calls(i), pytest.raises(CudaError):
                idx.restore_aux(st, blob, stream)
            assert state() == before, f"a fault at {seen[i]} (call {i}) changed the state"
        idx.restore_aux(st, blob, stream)
        assert state()[:3] == (41, 10, 41) and keys(idx, st, stream) == keys(idx, src, stream)
