"""QsaIndexer end to end (docs/design.md §10, §11.1-11.4): every stage against its staged float64 reference, the
selection under docs/design.md §0's near-tie rule, the float64 model of docs/design.md §10 reported, the inert bound,
chunked ingest, and every error path (raised before any device work).

Dims are the model's (4 indexer heads x 128, ratio 4, budget 2048, rot 64, theta 1e7; attention 2 kv heads x
256, page size 16) except ``hidden``, 2560 on a GPU and 256 on the emulator.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import numpy as np
import pytest

from hss import cuda_min as cm
from hss._util import ceil_div
from hss.cuda._driver import CudaError, HssError, inject_fault
from hss.qsa import INGEST_SLAB, QsaIndexer, QsaSelection
from hss.reference import qsa as ref
from hss.reference.linear import proj_dense

from conftest import ON_GPU
from helpers import BF16, Recording, assert_close, bound, download, upload

HIDDEN = 2560 if ON_GPU else 256
N_HEADS, HD, RATIO, BUDGET, ROT, THETA, EPS = 4, 128, 4, 2048, 64, 1e7, 1e-6
NKV, HD_ATTN, BS = 2, 256, 16
QKW = (N_HEADS + 1) * HD
TH32, EPS32 = float(np.float32(THETA)), float(np.float32(EPS))

@dataclass
class Layer:
    """Random indexer weights at a realistic scale, on the host and the device."""
    w: np.ndarray
    qn: np.ndarray
    kn: np.ndarray
    bufs: tuple

    def indexer(self, gpu, **kw) -> QsaIndexer:
        args = dict(n_heads=N_HEADS, hd=HD, ratio=RATIO, budget=BUDGET, rot=ROT, theta=THETA, eps=EPS,
                    hidden=HIDDEN, nkv_attn=NKV, hd_attn=HD_ATTN, gpu=gpu)
        args.update(kw)
        return QsaIndexer(*self.bufs, **args)


@pytest.fixture(scope="module")
def layer(ctx):
    rng = np.random.default_rng(20240531)
    w = (rng.standard_normal((QKW, HIDDEN)) / math.sqrt(HIDDEN)).astype(BF16)
    qn = (rng.standard_normal(HD) * 0.1).astype(BF16)
    kn = (rng.standard_normal(HD) * 0.1).astype(BF16)
    s = ctx.stream
    bufs = (upload(w, s), upload(qn, s), upload(kn, s))
    cm.stream_sync(s)
    return Layer(w, qn, kn, bufs)


def hidden_states(rng, n: int) -> np.ndarray:
    """bf16-rounded N(0, 0.5^2) rows, as the original's golden data."""
    return (rng.standard_normal((n, HIDDEN)) * 0.5).astype(BF16)


@dataclass
class Pool:
    k: np.ndarray
    v: np.ndarray
    table: np.ndarray
    dev: tuple


def kv_pool(rng, tokens: int, stream) -> Pool:
    logical = ceil_div(tokens, BS)
    physical = logical + 5
    k = (rng.standard_normal((physical, BS, NKV, HD_ATTN))).astype(BF16)
    v = (rng.standard_normal((physical, BS, NKV, HD_ATTN))).astype(BF16)
    table = rng.permutation(physical)[:logical].astype(np.int32)
    return Pool(k, v, table, (upload(k, stream), upload(v, stream), upload(table, stream)))


def row(buf, i: int) -> int:
    return buf.ptr + i * HIDDEN * 2


def check_selection(tokens: np.ndarray, ref_scores: np.ndarray, visible: int, what: str, budget: int = BUDGET) -> None:
    """docs/design.md §0: an engine block may differ from the reference's only at a near tie, |score - cutoff| <= 2x the
    score bound (scores from the staged reference)."""
    complete = visible // RATIO
    k = min(budget // RATIO, complete)
    tail = visible % RATIO
    assert tokens.dtype == np.int32 and tokens.size == k * RATIO + tail
    assert tokens[k * RATIO:].tolist() == list(range(complete * RATIO, visible)), f"{what}: tail"
    blocks = tokens[:k * RATIO].reshape(k, RATIO)
    assert (blocks == blocks[:, :1] + np.arange(RATIO)).all() and (blocks[:, 0] % RATIO == 0).all()
    engine = blocks[:, 0] // RATIO
    want = ref.select_blocks(ref_scores, k)
    cutoff = np.sort(ref_scores)[::-1][k - 1]
    tol = 2 * bound(ref_scores, "f32", (0,))[0]
    flips = np.setxor1d(engine, want)
    far = [int(b) for b in flips if abs(ref_scores[b] - cutoff) > tol]
    assert not far, f"{what}: blocks {far} differ from the reference selection and are not near ties " \
                    f"(cutoff {cutoff:.6g}, tolerance {tol:.3g})"


def check_gather(sel: QsaSelection, pool: Pool, stream) -> None:
    n = sel.n_sel
    got_k = download(sel.k_scratch, (n, NKV, HD_ATTN), np.uint16, stream)
    got_v = download(sel.v_scratch, (n, NKV, HD_ATTN), np.uint16, stream)
    want_k, want_v = ref.gather(pool.k, pool.v, pool.table, sel.tokens, BS)
    assert np.array_equal(got_k, want_k.view(np.uint16)) and np.array_equal(got_v, want_v.view(np.uint16))
    assert download(sel.table_dev, (sel.max_blocks,), np.int32, stream).tolist() == list(range(sel.max_blocks))
    assert sel.max_blocks == ceil_div(n, BS)
    assert download(sel.seq_len_dev, (1,), np.int32, stream)[0] == n


def parity_14(got, want, what: str) -> tuple[float, float]:
    """The original's recorded bar (docs/design.md §14): max err <= max(0.05 RMS(want), 1e-3), cosine > 0.9999."""
    g, w = np.asarray(got, np.float64).ravel(), np.asarray(want, np.float64).ravel()
    tol = max(0.05 * float(np.sqrt(np.mean(w * w))), 1e-3)
    err = float(np.max(np.abs(g - w)))
    cos = float(g @ w / (np.linalg.norm(g) * np.linalg.norm(w)))
    assert err <= tol and cos > 0.9999, f"{what}: max err {err:.3g} > {tol:.3g} or cosine {cos:.7f}"
    return err, cos


# -- the 2200-token run ---------------------------------------------------------------------------------
def test_2200_tokens_every_stage(gpu, stream, rng, layer):
    T = 2200
    hidden = hidden_states(rng, T)
    d_hidden = upload(hidden, stream)
    pool = kv_pool(rng, T, stream)
    with layer.indexer(gpu) as idx:
        st = idx.new_seq_state()
        idx.prefill_ingest(st, d_hidden, T - 1, 0, stream)          # 2199 rows: two GEMM slabs
        sel = idx.decode_select(st, row(d_hidden, T - 1), T - 1, *pool.dev, BS, stream)
        assert isinstance(sel, QsaSelection)
        assert (st.ingested, st.pooled) == (T, T // RATIO)
        complete = T // RATIO
        raw = download(st.raw_keys, (T, HD), BF16, stream)
        qk0 = download(idx.qk_scratch, (N_HEADS + 1, HD), BF16, stream)
        bk = download(st.block_keys, (complete, HD), BF16, stream)
        q_post = download(idx.q_post, (N_HEADS, HD), np.float32, stream)
        scores = download(idx.scores_dev, (complete,), np.float32, stream)

        qk_all = proj_dense(hidden, layer.w)
        assert_close(raw, qk_all[:, N_HEADS * HD:], "bf16", (1,), "raw keys (projection)")
        assert_close(qk0, qk_all[T - 1].reshape(N_HEADS + 1, HD), "bf16", (1,), "decode qk row (projection)")
        assert_close(bk, ref.block_pool(raw, layer.kn, 0, complete, RATIO, ROT, TH32, EPS32), "bf16", (1,),
                     "block keys")
        assert_close(q_post, ref.qprep(qk0[:N_HEADS], layer.qn, T - 1, ROT, TH32, EPS32), "f32", (1,), "q_post")
        ref_scores = ref.score(q_post, bk)
        assert_close(scores, ref_scores, "f32", (0,), "scores")
        check_selection(sel.tokens, ref_scores, T, "selection at pos 2199")
        check_gather(sel, pool, stream)
        assert sel.n_sel == BUDGET

        # docs/design.md §10's float64 model from the same weights and hidden states: the original's parity bar
        # (asserted) and the selection difference (reported).
        model = ref.indexer_step(hidden, layer.w, layer.qn, layer.kn, T - 1, N_HEADS, HD, RATIO, BUDGET, ROT,
                                 TH32, EPS32)
        report = [f"{name}: max err {e:.3g}, cosine {c:.8f}" for name, (e, c) in (
            ("raw_keys", parity_14(raw, model.raw_keys, "raw_keys vs model")),
            ("block_keys", parity_14(bk, model.block_keys, "block_keys vs model")),
            ("q_post", parity_14(q_post, model.q, "q_post vs model")),
            ("scores", parity_14(scores, model.scores, "scores vs model")))]
        engine = sel.tokens[:BUDGET:RATIO] // RATIO
        cutoff = np.sort(model.scores)[::-1][BUDGET // RATIO - 1]
        flips = np.setxor1d(engine, model.blocks)
        report.append(f"selection vs the float64 model: {flips.size // 2} block(s) swapped, cutoff {cutoff:.6g}")
        report += [f"  block {b}: {'engine only' if b in engine else 'model only'}, model score "
                   f"{model.scores[b]:.6g}, distance to cutoff {model.scores[b] - cutoff:+.3g}" for b in flips]
        print("\n" + "\n".join(report))
        idx.release_seq_state(st)


# -- the inert bound ------------------------------------------------------------------------------------
def test_inert_bound_and_selection_sizes(gpu, stream, rng, layer):
    first, last = 2046, 2057
    hidden = hidden_states(rng, last + 1)
    d_hidden = upload(hidden, stream)
    pool = kv_pool(rng, last + 1, stream)
    with layer.indexer(gpu) as idx:
        assert idx.inert_bound() == 2051 == BUDGET + RATIO - 1
        st = idx.new_seq_state()
        idx.prefill_ingest(st, d_hidden, first, 0, stream)
        for pos in range(first, last + 1):
            visible = pos + 1
            sel = idx.decode_select(st, row(d_hidden, pos), pos, *pool.dev, BS, stream)
            if visible <= idx.inert_bound():
                assert sel is None, f"pos {pos} (visible {visible}) is inert"
                continue
            assert sel is not None, f"pos {pos} (visible {visible}) is selective"
            # docs/design.md §10: allowed-set size budget + visible % ratio; "2052 visible masks 4"
            assert sel.n_sel == BUDGET + visible % RATIO
            assert visible - sel.n_sel == RATIO * (visible // RATIO - BUDGET // RATIO)
            if pos == 2051:
                assert visible - sel.n_sel == 4
            bk = download(st.block_keys, (visible // RATIO, HD), BF16, stream)
            q_post = download(idx.q_post, (N_HEADS, HD), np.float32, stream)
            check_selection(sel.tokens, ref.score(q_post, bk), visible, f"pos {pos}")
            check_gather(sel, pool, stream)
        assert st.ingested == last + 1 and st.pooled == (last + 1) // RATIO
        idx.release_seq_state(st)


# -- chunked ingest -------------------------------------------------------------------------------------
def test_chunked_ingest_matches_one_shot(gpu, stream, rng, layer):
    T = 2300 if ON_GPU else 2100       # one-shot crosses the 2048-row GEMM slab
    hidden = hidden_states(rng, T)
    d_hidden = upload(hidden, stream)
    with layer.indexer(gpu) as idx:
        one = idx.new_seq_state()
        idx.prefill_ingest(one, d_hidden, T, 0, stream)
        raw1 = download(one.raw_keys, (T, HD), BF16, stream)
        bk1 = download(one.block_keys, (T // RATIO, HD), BF16, stream)
        assert_close(raw1, proj_dense(hidden, layer.w)[:, N_HEADS * HD:], "bf16", (1,), "one-shot raw keys")
        idx.release_seq_state(one)
    rec = Recording(gpu)
    with layer.indexer(rec) as idx:
        st = idx.new_seq_state()
        for _trial in range(3):
            cuts = np.sort(rng.integers(0, T + 1, rng.integers(1, 7)))
            bounds = [0, *cuts.tolist(), T]
            del rec.calls[:]
            for a, b in zip(bounds, bounds[1:]):
                idx.prefill_ingest(st, row(d_hidden, a), b - a, a, stream)
                assert (st.ingested, st.pooled) == (b, b // RATIO)
            pooled = [(args[5][3], args[1][0]) for name, args in rec.calls
                      if name == "launch" and args[0] is idx._k_pool]
            covered = [blk for first, n in pooled for blk in range(first, first + n)]
            assert covered == list(range(T // RATIO)), f"chunks {bounds}: each complete block pooled exactly once"
            raw = download(st.raw_keys, (T, HD), BF16, stream)
            bk = download(st.block_keys, (T // RATIO, HD), BF16, stream)
            if ON_GPU:   # cuBLAS may pick another algorithm per m: staged references instead of bits
                assert_close(raw, proj_dense(hidden, layer.w)[:, N_HEADS * HD:], "bf16", (1,), f"raw {bounds}")
                assert_close(bk, ref.block_pool(raw, layer.kn, 0, T // RATIO, RATIO, ROT, TH32, EPS32), "bf16",
                             (1,), f"block keys {bounds}")
            else:
                assert raw.tobytes() == raw1.tobytes(), f"chunks {bounds}: raw keys differ from one-shot ingest"
                assert bk.tobytes() == bk1.tobytes(), f"chunks {bounds}: block keys differ from one-shot ingest"
        idx.release_seq_state(st)


def test_slab_geometry(gpu, stream, rng, layer):
    """prefill_ingest projects in slabs of 2048 rows and copies the raw-key columns with one pitched copy each."""
    T = INGEST_SLAB + 5
    d_hidden = upload(hidden_states(rng, T), stream)
    rec = Recording(gpu)
    with layer.indexer(rec) as idx:
        st = idx.new_seq_state()
        del rec.calls[:]
        idx.prefill_ingest(st, d_hidden, T, 0, stream)
        gemms = [a for n, a in rec.calls if n == "cublas_bf16_proj_dense"]
        copies = [a for n, a in rec.calls if n == "copy_d2d_2d_async"]
        assert [a[3] for a in gemms] == [INGEST_SLAB, 5] and all(a[4:6] == (QKW, HIDDEN) for a in gemms)
        assert [a[0] for a in gemms] == [d_hidden.ptr, row(d_hidden, INGEST_SLAB)]
        assert [a[1:] for a in copies] == [(QKW * 2, st.raw_keys, HD * 2, HD * 2, INGEST_SLAB, stream),
                                           (QKW * 2, st.raw_keys + INGEST_SLAB * HD * 2, HD * 2, HD * 2, 5, stream)]
        assert all(a[0] == idx.qk_scratch + N_HEADS * HD * 2 for a in copies)
        idx.release_seq_state(st)


# -- lifetimes ------------------------------------------------------------------------------------------
def test_release_close_and_prefill_kernels(gpu, stream, layer):
    rec = Recording(gpu)
    idx = layer.indexer(rec)
    # the prefill kernels (docs/design.md §11.1): three required (kernel), the tensor-core ones optional (try_kernel)
    looked_up = {(name, args[1]) for name, args in rec.calls if name in ("kernel", "try_kernel")}
    assert {("kernel", "qsa_qprep_rows"), ("kernel", "qsa_score_rows"), ("kernel", "qsa_prefill_attn"),
            ("try_kernel", "qsa_score_rows_tc"), ("try_kernel", "qsa_prefill_attn_tc")} <= looked_up
    assert idx._prefill.score_tc and idx._prefill.attn_tc and idx.uses_tc_scorer and idx.prefill_select_enabled
    st = idx.new_seq_state()
    idx.release_seq_state(st)
    assert st.released and st.raw_keys == 0 and st.block_keys == 0
    idx.release_seq_state(st)   # idempotent
    st = idx.new_seq_state()
    block_keys = int(st.block_keys)
    with inject_fault("cuMemFree", "CUDA_ERROR_INVALID_VALUE"):
        with pytest.raises(CudaError, match="CUDA_ERROR_INVALID_VALUE"):
            idx.release_seq_state(st)
    assert st.released and block_keys not in gpu._buffers, "the second free was attempted after the first failed"
    idx.close()
    idx.close()
    assert idx.closed
    with pytest.raises(HssError, match="closed"):
        idx.new_seq_state()


def test_max_tokens_from_env(gpu, layer, monkeypatch):
    monkeypatch.setenv("HSS_QSA_MAX_TOKENS", "4096")
    with layer.indexer(gpu) as idx:
        assert idx.max_tokens == 4096
    with layer.indexer(gpu, max_tokens=64) as idx:
        assert idx.max_tokens == 64
    monkeypatch.delenv("HSS_QSA_MAX_TOKENS")
    with layer.indexer(gpu) as idx:
        assert idx.max_tokens == 32768


@pytest.mark.parametrize("raw", ["1_000", "\uff11\uff10\uff12\uff14", "\u0664\u0660\u0669\u0666", "+4096",
                                 "\u20034096", "4096\u3000"])
def test_env_settings_take_ascii_digits_only(gpu, layer, monkeypatch, raw):
    """HSS_QSA_MAX_TOKENS is ASCII decimal digits (with ASCII blanks around), as the original read it: what Python's
    int() also takes (underscores, full-width or Arabic-Indic digits, a sign, Unicode blanks) is an error, before any
    device work; so is a flag wrapped in Unicode blanks."""
    rec = Recording(gpu)
    monkeypatch.setenv("HSS_QSA_MAX_TOKENS", raw)
    with pytest.raises(HssError, match="HSS_QSA_MAX_TOKENS=.* is not an integer .ASCII decimal digits."):
        layer.indexer(rec)
    monkeypatch.setenv("HSS_QSA_MAX_TOKENS", " \t4096\n")
    monkeypatch.setenv("HSS_QSA_SCORE_SCALAR", raw.replace("4096", "1"))
    if not raw.isascii():   # a flag: "1" wrapped in Unicode blanks, or non-ASCII digits
        with pytest.raises(HssError, match="HSS_QSA_SCORE_SCALAR=.* is not a flag"):
            layer.indexer(rec)
    assert rec.calls == []


# -- errors: each raised before any device work -----------------------------------------------------------
CONSTRUCTOR_ERRORS = [
    (dict(ratio=0), HssError, r"ratio = 0 must be in 1\.\.2147483647: tokens per QSA block"),
    (dict(budget=2050), HssError, r"budget \(2050\) must be a positive multiple of ratio \(4\)"),
    (dict(budget=0), HssError, "positive multiple of ratio"),
    (dict(hd=100), HssError, "multiple of 32"),
    (dict(hd=2048), HssError, "hd = 2048"),
    (dict(n_heads=0), HssError, "n_heads"),
    (dict(n_heads=100), HssError, "shared memory"),
    (dict(rot=63), HssError, "rot .63. must be even"),
    (dict(rot=256), HssError, "rot = 256"),
    (dict(theta=0.0), HssError, "theta"),
    (dict(theta=math.inf), HssError, "theta"),
    (dict(theta=1e39), HssError, "theta"),
    (dict(eps=-1.0), HssError, "eps"),
    (dict(eps=math.nan), HssError, "eps"),
    (dict(hidden=0), HssError, "hidden"),
    (dict(nkv_attn=0), HssError, "nkv_attn"),
    (dict(hd_attn=0), HssError, "hd_attn"),
    (dict(max_tokens=2), HssError, "max_tokens"),
    (dict(max_tokens=2**31), HssError, "max_tokens"),
    (dict(n_heads=4.0), TypeError, "n_heads must be an int, got float 4.0"),
    (dict(hd=np.float32(128)), TypeError, "hd must be an int, got float32"),
    (dict(ratio=True), TypeError, "ratio must be an int, got bool"),
    (dict(budget="2048"), TypeError, "budget must be an int, got str"),
    (dict(max_tokens=4096.0), TypeError, "max_tokens must be an int, got float"),
    (dict(theta="1e7"), TypeError, "theta must be a number, got str"),
    (dict(eps=True), TypeError, "eps must be a number, got bool"),
    (dict(score_scalar=1), TypeError, "HSS_QSA_SCORE_SCALAR override must be a bool or None"),
]


@pytest.mark.parametrize("kw, exc, match", CONSTRUCTOR_ERRORS)
def test_constructor_errors_before_device_work(gpu, layer, kw, exc, match):
    rec = Recording(gpu)
    with pytest.raises(exc, match=match):
        layer.indexer(rec, **kw)
    assert rec.calls == []


def test_constructor_pointer_and_env_errors(gpu, layer, monkeypatch):
    rec = Recording(gpu)
    args = dict(n_heads=N_HEADS, hd=HD, ratio=RATIO, budget=BUDGET, rot=ROT, theta=THETA, eps=EPS, hidden=HIDDEN,
                nkv_attn=NKV, hd_attn=HD_ATTN, gpu=rec)
    w, qn, kn = layer.bufs
    closed = cm.DeviceBuffer(QKW * HIDDEN * 2)
    closed.close()
    with cm.DeviceBuffer(16) as tiny:
        cases = [
            ((0, qn, kn), HssError, "qk_proj_w is a null pointer"),
            ((tiny, qn, kn), HssError, f"qk_proj_w holds 16 bytes but {QKW * HIDDEN * 2} are needed"),
            ((tiny.ptr, qn, kn), HssError, "qk_proj_w: .* run past the end of its 16-byte buffer"),
            ((w.view("bf16", (QKW - 1) * HIDDEN), qn, kn), HssError, "qk_proj_w holds"),
            ((closed, qn, kn), HssError, "qk_proj_w is a closed DeviceBuffer"),
            ((w.view("f32"), qn, kn), HssError, "qk_proj_w holds f32 but bf16 is needed"),
            ((w.ptr + 1, qn, kn), HssError, "qk_proj_w .* must be 2-byte aligned"),
            ((w, qn.view("bf16", HD - 1), kn), HssError, f"q_norm_w holds {(HD - 1) * 2} bytes but {HD * 2}"),
            ((w, qn, 0), HssError, "k_norm_w is a null pointer"),
            ((w, qn, 1.5), TypeError, "k_norm_w: cannot use float"),
            ((w, qn, np.zeros(HD, BF16)), HssError, "k_norm_w is a host numpy array"),
        ]
        for weights, exc, match in cases:
            with pytest.raises(exc, match=match):
                QsaIndexer(*weights, **args)
    assert rec.calls == []
    monkeypatch.setenv("HSS_QSA_MAX_TOKENS", "lots")
    with pytest.raises(HssError, match="HSS_QSA_MAX_TOKENS='lots' is not an integer"):
        QsaIndexer(*layer.bufs, **args)
    monkeypatch.delenv("HSS_QSA_MAX_TOKENS")
    for flag in ("HSS_QSA_PDL", "HSS_QSA_QK_KERNEL"):   # the device step's opt-ins: "1" or "0" / unset
        monkeypatch.setenv(flag, "yes")
        with pytest.raises(HssError, match=f"{flag}='yes' is not a flag; set it to 1"):
            QsaIndexer(*layer.bufs, **args)
        monkeypatch.delenv(flag)
    assert rec.calls == []


def test_method_errors_before_device_work(gpu, stream, rng, layer):
    hidden = hidden_states(rng, 70)
    d_hidden = upload(hidden, stream)
    pool = kv_pool(rng, 70, stream)
    rec = Recording(gpu)
    other = layer.indexer(gpu, max_tokens=64)
    foreign = other.new_seq_state()
    short = cm.DeviceBuffer(9 * HIDDEN * 2)   # nine rows where ten are read
    closed = cm.DeviceBuffer(HIDDEN * 2 * 70)
    closed.close()
    tiny = cm.DeviceBuffer(4)
    k, v, table = pool.dev
    with layer.indexer(rec, max_tokens=64, budget=8) as idx:   # selective from visible 12 on
        st = idx.new_seq_state()
        idx.prefill_ingest(st, d_hidden, 10, 0, stream)
        before = (st.ingested, st.pooled, st.table_len)
        del rec.calls[:]
        cases = [
            (lambda: idx.prefill_ingest(st, row(d_hidden, 5), 3, 5, stream), "prefill chunk starts at 5 but 10"),
            (lambda: idx.prefill_ingest(st, row(d_hidden, 10), 60, 10, stream), "70 tokens exceed max_tokens = 64"),
            (lambda: idx.prefill_ingest(st, d_hidden, 65, 0, stream), "65 tokens exceed max_tokens"),
            (lambda: idx.prefill_ingest(st, 0, 3, 10, stream), "hidden is a null pointer"),
            (lambda: idx.prefill_ingest(st, d_hidden, -1, 10, stream), "num_tokens = -1"),
            (lambda: idx.prefill_ingest(foreign, d_hidden, 1, 0, stream), "belongs to another indexer"),
            # seq_start 0 would start the sequence over: a too-small hidden must not (it used to reset the state,
            # then fault in the GEMM)
            (lambda: idx.prefill_ingest(st, short, 10, 0, stream),
             f"hidden holds {9 * HIDDEN * 2} bytes but {10 * HIDDEN * 2} are needed"),
            (lambda: idx.prefill_ingest(st, short.view("bf16"), 10, 0, stream), "hidden holds"),
            (lambda: idx.prefill_ingest(st, short.ptr, 10, 0, stream), "hidden: .* run past the end"),
            (lambda: idx.prefill_ingest(st, row(d_hidden, 60), 11, 10, stream), "hidden: .* run past the end"),
            (lambda: idx.prefill_ingest(st, closed, 3, 0, stream), "hidden is a closed DeviceBuffer"),
            (lambda: idx.prefill_ingest(st, d_hidden.view("f32"), 3, 0, stream), "hidden holds f32 but bf16"),
            (lambda: idx.prefill_ingest(st, row(d_hidden, 10) + 1, 3, 10, stream), "hidden .* must be 2-byte aligned"),
            (lambda: idx.decode_select(st, row(d_hidden, 9), 9, *pool.dev, BS, stream), "decode at pos 9 but 10"),
            (lambda: idx.decode_select(st, row(d_hidden, 11), 11, *pool.dev, BS, stream), "lost sync"),
            (lambda: idx.decode_select(st, row(d_hidden, 10), 10, *pool.dev, 4, stream),
             r"block_size = 4 must be in 8\.\."),
            (lambda: idx.decode_select(st, 0, 10, *pool.dev, BS, stream), "normed is a null"),
            (lambda: idx.decode_select(st, short.view("bf16", HIDDEN - 1), 10, *pool.dev, BS, stream),
             f"normed holds {(HIDDEN - 1) * 2} bytes but {HIDDEN * 2} are needed"),
            (lambda: idx.decode_select(st, closed, 10, *pool.dev, BS, stream), "normed is a closed DeviceBuffer"),
            (lambda: idx.decode_select(st, row(d_hidden, 69) + 2, 10, *pool.dev, BS, stream), "normed: .* run past"),
            # the pools and the table are checked at inert positions too (visible 11 here)
            (lambda: idx.decode_select(st, row(d_hidden, 10), 10, tiny, v, table, BS, stream),
             f"k_pool holds 4 bytes but {BS * NKV * HD_ATTN * 2} are needed"),
            (lambda: idx.decode_select(st, row(d_hidden, 10), 10, k, closed, table, BS, stream), "v_pool is a closed"),
            (lambda: idx.decode_select(st, row(d_hidden, 10), 10, k, v, tiny, 8, stream),
             "block_table_dev holds 4 bytes but 8 are needed"),
            (lambda: idx.decode_select(st, row(d_hidden, 10), 10, k, v, table.ptr + 2, BS, stream),
             "block_table_dev .* must be 4-byte aligned"),
            (lambda: idx.decode_select(st, row(d_hidden, 10), 10, k, v, table.view("f32"), BS, stream),
             "block_table_dev holds f32 but i32 is needed"),
        ]
        for call, match in cases:
            with pytest.raises(HssError, match=match):
                call()
            assert rec.calls == [], f"device work before the error {match!r}"
            assert (st.ingested, st.pooled, st.table_len) == before
        type_cases = [
            (lambda: idx.prefill_ingest(st, d_hidden, 3.0, 10, stream), "num_tokens must be an int, got float"),
            (lambda: idx.prefill_ingest(st, d_hidden, 3, np.float64(10), stream), "seq_start must be an int"),
            (lambda: idx.prefill_ingest(st, d_hidden, 3, False, stream), "seq_start must be an int, got bool"),
            (lambda: idx.prefill_ingest(st, d_hidden, 3, 10, None), "stream: a stream is required"),
            (lambda: idx.prefill_ingest(st, "hidden", 3, 10, stream), "hidden: cannot use str"),
            (lambda: idx.decode_select(st, row(d_hidden, 10), 10.0, *pool.dev, BS, stream), "pos must be an int"),
            (lambda: idx.decode_select(st, row(d_hidden, 10), 10, *pool.dev, True, stream),
             "block_size must be an int, got bool"),
            (lambda: idx.decode_select(st, row(d_hidden, 10), 10, *pool.dev, 16.0, stream), "block_size must be"),
            (lambda: idx.decode_select(st, row(d_hidden, 10), 10, *pool.dev, BS, 1.5), "stream: a stream is required"),
            (lambda: idx.decode_select(st, 1.5, 10, *pool.dev, BS, stream), "normed: cannot use float"),
            (lambda: idx.decode_select(st, row(d_hidden, 10), 10, k, v, [0, 1], BS, stream),
             "block_table_dev: cannot use list"),
        ]
        for call, match in type_cases:
            with pytest.raises(TypeError, match=match):
                call()
            assert rec.calls == [], f"device work before the error {match!r}"
            assert (st.ingested, st.pooled, st.table_len) == before
        with pytest.raises(TypeError, match="QsaSeqState"):
            idx.decode_select(None, row(d_hidden, 10), 10, *pool.dev, BS, stream)
        # selective positions check the pool pointers too
        idx.decode_select(st, row(d_hidden, 10), 10, *pool.dev, BS, stream)   # visible 11: inert
        before = (st.ingested, st.pooled, st.table_len)
        del rec.calls[:]
        with pytest.raises(HssError, match="k_pool is a null"):
            idx.decode_select(st, row(d_hidden, 11), 11, 0, pool.dev[1], pool.dev[2], BS, stream)
        with pytest.raises(HssError, match="block_table_dev is a null"):
            idx.decode_select(st, row(d_hidden, 11), 11, pool.dev[0], pool.dev[1], 0, BS, stream)
        with pytest.raises(HssError, match="block_table_dev holds 4 bytes but 8 are needed"):
            idx.decode_select(st, row(d_hidden, 11), 11, pool.dev[0], pool.dev[1], tiny, 8, stream)
        assert rec.calls == [] and (st.ingested, st.pooled, st.table_len) == before
        # pos >= max_tokens
        idx.prefill_ingest(st, row(d_hidden, 11), 53, 11, stream)
        del rec.calls[:]
        with pytest.raises(HssError, match="pos 64 >= max_tokens = 64"):
            idx.decode_select(st, row(d_hidden, 64), 64, *pool.dev, BS, stream)
        assert rec.calls == []
        # a released state
        idx.release_seq_state(st)
        del rec.calls[:]
        with pytest.raises(HssError, match="released"):
            idx.prefill_ingest(st, d_hidden, 1, 0, stream)
        with pytest.raises(HssError, match="released"):
            idx.decode_select(st, d_hidden, 0, *pool.dev, BS, stream)
        assert rec.calls == []
    other.release_seq_state(foreign)
    other.close()
    for buf in (short, tiny):
        buf.close()


def test_small_budget_selection_end_to_end(gpu, stream, rng, layer):
    """budget 8 (block_topk 2) and max_tokens 64: every selective step against the staged references."""
    n = 40
    hidden = hidden_states(rng, n)
    d_hidden = upload(hidden, stream)
    pool = kv_pool(rng, n, stream)
    with layer.indexer(gpu, max_tokens=64, budget=8) as idx:
        assert idx.inert_bound() == 11
        st = idx.new_seq_state()
        for pos in range(n):
            sel = idx.decode_select(st, row(d_hidden, pos), pos, *pool.dev, BS, stream)
            assert (sel is None) == (pos + 1 <= 11)
            if sel is not None:
                complete = (pos + 1) // RATIO
                bk = download(st.block_keys, (complete, HD), BF16, stream)
                q_post = download(idx.q_post, (N_HEADS, HD), np.float32, stream)
                scores = download(idx.scores_dev, (complete,), np.float32, stream)
                assert_close(scores, ref.score(q_post, bk), "f32", (0,), f"scores at pos {pos}")
                check_selection(sel.tokens, ref.score(q_post, bk), pos + 1, f"pos {pos}", budget=8)
                check_gather(sel, pool, stream)
        idx.release_seq_state(st)


def test_numpy_integer_arguments(gpu, stream, rng, layer):
    """numpy integers (and a numpy float theta / eps) are read as Python ints / floats before any arithmetic:
    the same selections as Python ints, and the stored dims are Python ints (so nothing wraps later)."""
    n = 30
    hidden = hidden_states(rng, n)
    d_hidden = upload(hidden, stream)
    pool = kv_pool(rng, n, stream)
    np_dims = dict(n_heads=np.int32(N_HEADS), hd=np.int64(HD), ratio=np.uint8(RATIO), budget=np.int16(8),
                   rot=np.int32(ROT), theta=np.float32(THETA), eps=np.float64(EPS), hidden=np.int64(HIDDEN),
                   nkv_attn=np.int32(NKV), hd_attn=np.int64(HD_ATTN), max_tokens=np.int32(64))
    runs = []
    for dims in (np_dims, {**np_dims, **{k: v.item() for k, v in np_dims.items()}}):
        with layer.indexer(gpu, **dims) as idx:
            assert all(type(getattr(idx, k)) is int for k in ("n_heads", "hd", "ratio", "budget", "rot", "hidden",
                                                               "nkv_attn", "hd_attn", "max_tokens", "block_topk"))
            assert type(idx.theta) is float and idx.theta == TH32
            numpy_args = dims is np_dims
            cast = np.int64 if numpy_args else int
            st = idx.new_seq_state()
            idx.prefill_ingest(st, d_hidden, cast(20), np.int32(0) if numpy_args else 0, stream)
            assert type(st.ingested) is int and type(st.pooled) is int
            tokens = []
            for pos in range(20, n):
                sel = idx.decode_select(st, row(d_hidden, pos), cast(pos), *pool.dev,
                                        np.int32(BS) if numpy_args else BS, stream)
                tokens.append(sel.tokens)
                assert type(sel.n_sel) is int and type(st.ingested) is int
            runs.append((tokens, download(st.raw_keys, (n, HD), np.uint16, stream)))
            idx.release_seq_state(st)
    (t_np, raw_np), (t_int, raw_int) = runs
    assert all(np.array_equal(a, b) for a, b in zip(t_np, t_int)) and np.array_equal(raw_np, raw_int)


# -- all or nothing ----------------------------------------------------------------------------
DEVICE_CALLS = ("cuLaunchKernel", "cuMemcpyDtoDAsync", "cuMemcpy2DAsync", "cuMemcpyHtoDAsync", "cuMemcpyDtoHAsync",
                "cuMemsetD32Async", "cuMemsetD8Async", "cuStreamSynchronize", "cuMemAlloc", "cuEventRecord",
                "cuStreamWaitEvent", "cuEventSynchronize", "cuMemcpyBatchAsync")


@contextlib.contextmanager
def driver_calls(fail_at: int | None = None, interrupt: bool = False):
    """Count the driver calls that queue, wait for or allocate device work, at the driver seam (yields the list of
    their names); the ``fail_at``-th of them (from 0) returns a CUresult error instead, or raises KeyboardInterrupt
    (``interrupt``)."""
    from hss.cuda import _driver
    seen: list[str] = []
    code = _driver.api.CUresult.CUDA_ERROR_INVALID_VALUE
    saved = {name: getattr(_driver.api, name) for name in DEVICE_CALLS}

    def wrap(name, real):
        def call(*a, **kw):
            seen.append(name)
            if fail_at is not None and len(seen) - 1 == fail_at:
                if interrupt:
                    raise KeyboardInterrupt(f"interrupted at {name}")
                return (code, None)
            return real(*a, **kw)
        return call

    for name, real in saved.items():
        setattr(_driver.api, name, wrap(name, real))
    try:
        yield seen
    finally:
        for name, real in saved.items():
            setattr(_driver.api, name, real)


def snapshot_state(idx, st, stream) -> tuple:
    """Everything of a sequence a failed call must leave alone: counters, the device position, its keys' bytes."""
    raw = download(st.raw_keys, (st.ingested, HD), np.uint16, stream).tobytes()
    blocks = download(st.block_keys, (st.pooled, HD), np.uint16, stream).tobytes()
    return st.ingested, st.pooled, st.table_len, st.sync(stream), raw, blocks


def test_a_failed_decode_step_changes_nothing_and_is_retried(gpu, stream, rng, layer):
    """Every driver call of a selective decode step fails in turn (and an interrupt lands in the scores' wait): the
    sequence keeps its counters, device position and keys, and the retried step selects and gathers exactly what a
    twin sequence that never failed does (a token ingested before the scores' wait would make the
    retry fail with 'lost sync')."""
    n = 20
    d_hidden = upload(hidden_states(rng, n + 4), stream)
    pool = kv_pool(rng, n + 4, stream)
    with layer.indexer(gpu, max_tokens=64, budget=8) as idx:
        st, twin = idx.new_seq_state(), idx.new_seq_state()
        for s_ in (st, twin):
            idx.prefill_ingest(s_, d_hidden, n, 0, stream)
        want = idx.decode_select(twin, row(d_hidden, n), n, *pool.dev, BS, stream)
        probe = idx.new_seq_state()
        idx.prefill_ingest(probe, d_hidden, n, 0, stream)
        cm.stream_sync(stream)
        with driver_calls() as step:
            idx.decode_select(probe, row(d_hidden, n), n, *pool.dev, BS, stream)
        assert "cuMemcpyDtoHAsync" in step and "cuStreamSynchronize" in step
        for i in range(len(step)):
            for interrupt in (False, True):
                before = snapshot_state(idx, st, stream)
                with driver_calls(i, interrupt), pytest.raises(KeyboardInterrupt if interrupt else CudaError):
                    idx.decode_select(st, row(d_hidden, n), n, *pool.dev, BS, stream)
                assert snapshot_state(idx, st, stream) == before, f"{'interrupt' if interrupt else 'fault'} at " \
                                                                  f"{step[i]} (call {i}) changed the sequence"
        got = idx.decode_select(st, row(d_hidden, n), n, *pool.dev, BS, stream)   # the retry
        assert np.array_equal(got.tokens, want.tokens) and (st.ingested, st.pooled) == (n + 1, (n + 1) // RATIO)
        check_gather(got, pool, stream)
        assert st.sync(stream) == n + 1


@pytest.mark.emulator
def test_a_decode_step_faulting_on_a_freed_pool_changes_nothing(gpu, stream, rng, layer):
    """The issue's example: a freed k_pool passed as an address (hss cannot know its size) faults in the gather, past
    the inert bound and after the scores' wait: the sequence is as before and the retry with the live pool works."""
    n = 20
    d_hidden = upload(hidden_states(rng, n + 1), stream)
    pool = kv_pool(rng, n + 1, stream)
    from hss.errors import MemoryFault
    with layer.indexer(gpu, max_tokens=64, budget=8) as idx:
        st = idx.new_seq_state()
        idx.prefill_ingest(st, d_hidden, n, 0, stream)
        gone = cm.DeviceBuffer(pool.k.nbytes)
        addr = gone.ptr
        gone.close()
        before = snapshot_state(idx, st, stream)
        with pytest.raises(MemoryFault, match="qsa_gather"):
            idx.decode_select(st, row(d_hidden, n), n, addr, pool.dev[1], pool.dev[2], BS, stream)
        assert snapshot_state(idx, st, stream) == before
        sel = idx.decode_select(st, row(d_hidden, n), n, *pool.dev, BS, stream)
        check_gather(sel, pool, stream)


@pytest.mark.parametrize("restart", [False, True], ids=["next-chunk", "restart"])
def test_a_failed_prefill_ingest_changes_nothing(gpu, stream, rng, layer, restart):
    """Every driver call of a two-slab prefill_ingest fails in turn: the sequence is as before (a restart over a
    sequence of 2100 tokens puts back the raw keys it overwrote and re-pools their blocks: the same bits), and the
    retry equals a twin that never failed."""
    T = INGEST_SLAB + 52
    hidden = upload(hidden_states(rng, 2 * T), stream)
    with layer.indexer(gpu, max_tokens=4 * T) as idx:
        st, twin = idx.new_seq_state(), idx.new_seq_state()
        for s_ in (st, twin):
            idx.prefill_ingest(s_, hidden, T, 0, stream)
        start, src = (0, row(hidden, T)) if restart else (T, row(hidden, T))
        idx.prefill_ingest(twin, src, T, start, stream)   # (a restart allocates the indexer's backup here)
        cm.stream_sync(stream)
        want = snapshot_state(idx, twin, stream)
        probe = idx.new_seq_state()
        idx.prefill_ingest(probe, hidden, T, 0, stream)
        cm.stream_sync(stream)
        with driver_calls() as seen:
            idx.prefill_ingest(probe, src, T, start, stream)
        assert seen.count("cuMemcpy2DAsync") == 2
        for i in range(len(seen)):
            before = snapshot_state(idx, st, stream)
            with driver_calls(i), pytest.raises(CudaError):
                idx.prefill_ingest(st, src, T, start, stream)
            assert snapshot_state(idx, st, stream) == before, f"a fault at {seen[i]} (call {i}) changed the sequence"
        idx.prefill_ingest(st, src, T, start, stream)
        assert snapshot_state(idx, st, stream)[:2] == want[:2]
        assert snapshot_state(idx, st, stream)[3:] == want[3:]


# -- own memory, ownership, finalizers ----------------------------------------------------------
def test_caller_pointers_into_the_indexers_memory_are_refused(gpu, stream, rng, layer):
    """No argument may point into memory the indexer owns (it would be read while being written, or written over the
    indexer's own state): refused before any device work, the sequence unchanged."""
    d_hidden = upload(hidden_states(rng, 12), stream)
    pool = kv_pool(rng, 12, stream)
    rec = Recording(gpu)
    with layer.indexer(rec, max_tokens=256, budget=8) as idx:
        st, other = idx.new_seq_state(), idx.new_seq_state()
        idx.prefill_ingest(st, d_hidden, 10, 0, stream)
        k, v, table = pool.dev
        del rec.calls[:]
        cases = [
            (lambda: idx.decode_select(st, idx.qk_scratch, 10, k, v, table, BS, stream), "normed .* overlaps the "
             "indexer's qk scratch, memory that this QsaIndexer owns"),
            (lambda: idx.decode_select(st, row(d_hidden, 10), 10, k, idx.qk_scratch, table, BS, stream),
             "v_pool .* overlaps the indexer's qk scratch"),
            (lambda: idx.decode_select(st, row(d_hidden, 10), 10, k, v, idx.k_scratch, BS, stream),
             "block_table_dev .* overlaps the indexer's gathered K scratch"),
            (lambda: idx.decode_select(st, row(d_hidden, 10), 10, k, v, idx.table_dev, BS, stream),
             "block_table_dev .* overlaps the indexer's identity table"),
            (lambda: idx.decode_select(st, other.raw_keys, 10, k, v, table, BS, stream),
             "normed .* overlaps a sequence state's raw keys"),
            (lambda: idx.prefill_ingest(st, other.block_keys, 1, 10, stream), "hidden .* overlaps a sequence "
             "state's block keys"),
            (lambda: idx.prefill_ingest(st, idx.qk_scratch, 1, 0, stream), "hidden .* overlaps the indexer's qk "
             "scratch"),
        ]
        before = (st.ingested, st.pooled, st.table_len)
        for call, match in cases:
            with pytest.raises(HssError, match=match):
                call()
            assert rec.calls == [] and (st.ingested, st.pooled, st.table_len) == before, match


def test_release_checks_the_owner_and_close_frees_live_states(gpu, stream, layer):
    """release_seq_state refuses (and frees nothing of) another indexer's state; close() frees every state still
    live, which then reads as released (a later release is a no-op); the backend ends with what it started with."""
    start = len(gpu._buffers)
    a, b = layer.indexer(gpu, max_tokens=64), layer.indexer(gpu, max_tokens=64)
    sa, sb = a.new_seq_state(), b.new_seq_state()
    held = len(gpu._buffers)
    with pytest.raises(HssError, match="belongs to another indexer; release it with the indexer whose"):
        a.release_seq_state(sb)
    assert not sb.released and len(gpu._buffers) == held and int(sb.raw_keys) in gpu._buffers
    b.release_seq_state(sb)
    b.release_seq_state(sb)   # idempotent
    a.close()
    assert sa.released and sa.slot == -1
    a.release_seq_state(sa)   # no-op after close
    with pytest.raises(HssError, match="closed"):
        a.prefill_ingest(sa, 0, 0, 0, stream)
    b.close()
    assert len(gpu._buffers) == start


def test_a_dropped_indexer_frees_its_memory(gpu, layer):
    """An indexer (and its states) dropped without close() gives its device memory back when collected, like the
    driver owners (a weakref.finalize holding the backend and the allocations, never the indexer)."""
    import gc
    gc.collect()
    start, free0 = len(gpu._buffers), cm.mem_info()[0]
    idx = layer.indexer(gpu, max_tokens=64)
    st = idx.new_seq_state()
    assert len(gpu._buffers) > start
    del idx
    gc.collect()
    assert len(gpu._buffers) == start and st.released
    if not ON_GPU:   # the emulator's arena is exact; a GPU's free memory moves with other processes
        assert cm.mem_info()[0] == free0
