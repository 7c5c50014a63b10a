"""QsaIndexer.prefill_select (docs/design.md §11.5): only rows at global positions >= the inert bound (2051) are
rewritten; every slab's stages against their staged float64 references (qk projection, q prep, scores under the scalar
or the tensor-core bound, the host top-k exactly, the selection under docs/design.md §0's near-tie rule, the attention
under the bf16 rule with a mutation check); chunked prefill equals one shot; both scorers and both attention kernels;
the switches; every error raised before any device work.

Dims are the model's indexer (4 heads x 128, ratio 4, budget 2048, rot 64, theta 1e7). On a GPU: hidden 2560 and
the model's attention (24 q / 2 kv heads x 256); on the emulator: hidden 256 and 4 q / 2 kv heads x 64.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import pytest

from hss import cuda_min as cm
from hss._util import ceil_div
from hss.cuda._driver import HssError
from hss.cuda.gpu import KernelHandle
from hss.qsa import QsaIndexer
from hss.qsa import prefill as prefill_mod
from hss.reference import qsa_prefill as ref
from hss.reference.linear import proj_dense

from conftest import ON_GPU
from helpers import BF16, MASKED, Recording, assert_bites, assert_close, download, poisoned, tc_bound, upload

HIDDEN = 2560 if ON_GPU else 256
N_HEADS, HD, RATIO, BUDGET, ROT, THETA, EPS = 4, 128, 4, 2048, 64, 1e7, 1e-6
NQ, NKV, HD_ATTN = (24, 2, 256) if ON_GPU else (4, 2, 64)
BS = 16
QKW = (N_HEADS + 1) * HD
BOUND = BUDGET + RATIO - 1
MAX_TOKENS = 8192 if ON_GPU else 4096
TH32, EPS32 = float(np.float32(THETA)), float(np.float32(EPS))
PREFILL_KERNELS = {"qsa_qprep_rows", "qsa_score_rows", "qsa_score_rows_tc", "qsa_prefill_attn", "qsa_prefill_attn_tc"}


@dataclass
class Layer:
    w: np.ndarray
    qn: np.ndarray
    kn: np.ndarray
    bufs: tuple

    def indexer(self, gpu, **kw) -> QsaIndexer:
        args = dict(n_heads=N_HEADS, hd=HD, ratio=RATIO, budget=BUDGET, rot=ROT, theta=THETA, eps=EPS,
                    hidden=HIDDEN, nkv_attn=NKV, hd_attn=HD_ATTN, gpu=gpu, max_tokens=MAX_TOKENS)
        args.update(kw)
        return QsaIndexer(*self.bufs, **args)


@pytest.fixture(scope="module")
def layer(ctx):
    rng = np.random.default_rng(7)
    w = (rng.standard_normal((QKW, HIDDEN)) / math.sqrt(HIDDEN)).astype(BF16)
    qn = (rng.standard_normal(HD) * 0.1).astype(BF16)
    kn = (rng.standard_normal(HD) * 0.1).astype(BF16)
    s = ctx.stream
    bufs = (upload(w, s), upload(qn, s), upload(kn, s))
    cm.stream_sync(s)
    return Layer(w, qn, kn, bufs)


@dataclass
class Case:
    """One prefill: attention inputs, roped queries, paged K/V, the host block table and a dense attn_ctx."""
    hidden: np.ndarray      # [T, HIDDEN] bf16
    q: np.ndarray           # [T, nq, hd_attn] bf16
    k: np.ndarray           # [pages, BS, NKV, hd_attn] bf16
    v: np.ndarray
    table: np.ndarray       # [ceil(T / BS)] int32
    dense: np.ndarray       # [T, nq * hd_attn] bf16: what the dense attention wrote
    nq: int
    hd_attn: int
    dev: dict = field(default_factory=dict)

    @property
    def inv(self) -> float:
        return float(np.float32(self.hd_attn ** -0.5))

    def rows(self, name: str, start: int) -> int:
        """Device address of row ``start`` of ``name`` (hidden, q, ctx)."""
        width = {"hidden": HIDDEN, "q": self.nq * self.hd_attn, "ctx": self.nq * self.hd_attn}[name]
        return self.dev[name].ptr + start * width * 2


def make_case(rng, T: int, stream, nq: int = NQ, hd_attn: int = HD_ATTN, dense: str = "values") -> Case:
    logical = ceil_div(T, BS)
    physical = logical + 3
    c = Case(hidden=(rng.standard_normal((T, HIDDEN)) * 0.5).astype(BF16),
             q=rng.standard_normal((T, nq, hd_attn)).astype(BF16),
             k=rng.standard_normal((physical, BS, NKV, hd_attn)).astype(BF16),
             v=rng.standard_normal((physical, BS, NKV, hd_attn)).astype(BF16),
             table=rng.permutation(physical)[:logical].astype(np.int32),
             dense=(rng.standard_normal((T, nq * hd_attn)) if dense == "values"
                    else np.full((T, nq * hd_attn), np.nan)).astype(BF16),
             nq=nq, hd_attn=hd_attn)
    c.dev = {name: upload(arr, stream) for name, arr in
             (("hidden", c.hidden), ("q", c.q), ("k", c.k), ("v", c.v), ("ctx", c.dense))}
    return c


class Spy(Recording):
    """Records device calls and captures each slab's intermediates: qk_buf, qpost and the scores when the scores
    come back to the host (the stream is idle then), the lists when they go up."""

    def __init__(self, gpu) -> None:
        super().__init__(gpu)
        self.slabs: list[dict] = []
        self.scratch: int | None = None
        self.layout: prefill_mod.ScratchLayout | None = None

    def copy_d2h_on_stream(self, src, dst, stream) -> None:
        self.calls.append(("copy_d2h_on_stream", (src, dst, stream)))
        self._gpu.copy_d2h_on_stream(src, dst, stream)
        lay = self.layout
        if self.scratch is not None and int(src) == self.scratch + lay.scores:
            rows = dst.size // lay.stride
            self.slabs.append(dict(rows=rows, stride=lay.stride, scores=dst.reshape(rows, lay.stride).copy(),
                                   qk=download(self.scratch + lay.qk_buf, (rows, QKW), BF16, stream),
                                   qpost=download(self.scratch + lay.qpost, (rows, N_HEADS, HD), np.float32, stream)))

    def copy_h2d_async(self, src, dst, stream) -> None:
        self.calls.append(("copy_h2d_async", (src, dst, stream)))
        self._gpu.copy_h2d_async(src, dst, stream)
        if self.scratch is not None and int(dst) == self.scratch + self.layout.lists:
            self.slabs[-1]["lists"] = np.array(src, copy=True)

    def launched(self) -> list[str]:
        return [args[0].func.name for name, args in self.calls if name == "launch"]


def select(idx: QsaIndexer, spy: Spy, st, case: Case, a: int, b: int, scratch, stream) -> int:
    """prefill_select of chunk [a, b) (already ingested), its slabs annotated with their first positions."""
    spy.scratch = scratch.ptr
    spy.layout = prefill_mod.scratch_layout(b, QKW, N_HEADS, HD, RATIO, idx.block_topk)
    before = len(spy.slabs)
    n = idx.prefill_select(st, case.rows("hidden", a), case.rows("q", a), case.rows("ctx", a), case.dev["k"],
                           case.dev["v"], case.table, a, b - a, case.nq, BS, case.inv, scratch, stream)
    first = max(idx.inert_bound(), a)
    for i, slab in enumerate(spy.slabs[before:]):
        slab["first_pos"] = first + i * prefill_mod.SELECT_SLAB
    assert n == max(0, b - first) and sum(s["rows"] for s in spy.slabs[before:]) == n
    return n


def run(idx: QsaIndexer, spy: Spy, case: Case, cuts: list[int], scratch, stream):
    """Ingest and select the chunks between ``cuts``; returns the state."""
    st = idx.new_seq_state()
    for a, b in zip(cuts, cuts[1:]):
        idx.prefill_ingest(st, case.rows("hidden", a), b - a, a, stream)
        select(idx, spy, st, case, a, b, scratch, stream)
    return st


def near_ties(got_lists, want_lists, want, tol, first_pos: int, topk: int, what: str) -> int:
    """docs/design.md §0: a block in one list but not the other lies within 2x the score bound of the row's cutoff (the
    topk-th largest staged-reference score). Returns the number of rows whose sets differ."""
    comp = ref.complete_counts(first_pos, want.shape[0], RATIO)
    differ = 0
    for r in range(want.shape[0]):
        diff = set(got_lists[r].tolist()) ^ set(want_lists[r].tolist())
        if not diff:
            continue
        differ += 1
        cutoff = np.sort(want[r, :comp[r]])[::-1][topk - 1]
        margin = 2 * tol[r, :comp[r]].max()
        far = [b for b in diff if abs(want[r, b] - cutoff) > margin]
        assert not far, f"{what}: row {first_pos + r} selects blocks {far} away from the cutoff {cutoff:.6g}"
    return differ


def check_slabs(idx: QsaIndexer, layer: Layer, st, case: Case, slabs: list[dict], stream, mutate: bool = True):
    """Every captured slab against its staged references; the attention rows read back from attn_ctx."""
    topk = idx.block_topk
    ctx = download(case.dev["ctx"], case.dense.shape, BF16, stream).reshape(-1, case.nq, case.hd_attn)
    for n, slab in enumerate(slabs):
        p, rows = slab["first_pos"], slab["rows"]
        what = f"slab at {p} (+{rows})"
        assert_close(slab["qk"], proj_dense(case.hidden[p:p + rows], layer.w), "bf16", (1,),
                     f"{what}: qk rows (projection)")
        assert_close(slab["qpost"], ref.qprep_rows(slab["qk"], layer.qn, p, N_HEADS, HD, ROT, TH32, EPS32), "f32",
                     (2,), f"{what}: qpost")
        n_blocks = (p + rows) // RATIO
        keys = download(st.block_keys, (n_blocks, HD), BF16, stream)
        got = slab["scores"][:, :n_blocks]
        want = ref.score_rows(slab["qpost"], keys, p, RATIO, n_blocks)
        valid = want != MASKED
        assert (got[~valid] == MASKED).all(), f"{what}: a masked score is not exactly -1e30"
        if idx.uses_tc_scorer:
            tol = tc_bound(slab["qpost"], keys, want)
        else:
            tol = 1e-4 * np.where(valid, np.abs(want), 0).max(axis=1, keepdims=True) * np.ones_like(want)
        assert_close(got, want, "f32", (1,), f"{what}: scores", valid=valid, tol=tol)
        # the host top-k: exactly (score desc, index asc) of the engine's scores, in that order
        assert np.array_equal(slab["lists"], ref.topk_lists(got, p, RATIO, topk)), f"{what}: host top-k"
        near_ties(slab["lists"], ref.topk_lists(want, p, RATIO, topk), want, tol, p, topk, f"{what}: selection")
        # attention over the engine's lists, staged
        want_out = ref.prefill_attn(case.q[p:p + rows], case.k, case.v, case.table, slab["lists"], p, RATIO, case.inv)
        got_out = ctx[p:p + rows]
        assert_close(got_out, want_out, "bf16", (2,), f"{what}: attention")
        if mutate and n == 0:   # the bound bites: drop the heaviest token of a few rows
            m = min(rows, 3)
            dropped = drop_heaviest(case, slab["lists"][:m], p)
            assert_bites(got_out[:m], dropped, "bf16", (2,), f"{what}: attention, heaviest token dropped")


def drop_heaviest(case: Case, lists, first_pos: int) -> np.ndarray:
    out = np.empty((len(lists), case.nq, case.hd_attn))
    for r, lst in enumerate(lists):
        pos = first_pos + r
        tok = ref.selected_tokens(lst, pos, RATIO)
        k = ref.gather_rows(case.k.astype(np.float64), case.table, tok)
        v = ref.gather_rows(case.v.astype(np.float64), case.table, tok)
        keep = np.arange(tok.size) != int(np.argmax(k[:, 0] @ case.q[pos, 0].astype(np.float64)))
        out[r] = ref.attend(case.q[pos], k[keep], v[keep], case.inv)
    return out


def ctx_bytes(case: Case, stream) -> np.ndarray:
    return download(case.dev["ctx"], case.dense.shape, np.uint16, stream)


# -- one shot past the bound ----------------------------------------------------------------------------
@pytest.mark.parametrize("scorer", ["tc", "scalar"])
def test_2200_tokens_against_staged_references(gpu, stream, rng, layer, monkeypatch, scorer):
    """2200 tokens in one chunk: rows 0..2050 keep the NaN poison bit for bit, rows 2051..2199 are rewritten and
    meet every staged reference; the selection differs from the float64 one only at near ties."""
    if scorer == "scalar":
        monkeypatch.setenv("HSS_QSA_SCORE_SCALAR", "1")
    T = 2200
    case = make_case(rng, T, stream, dense="nan")
    spy = Spy(gpu)
    with layer.indexer(spy) as idx, cm.DeviceBuffer(idx.prefill_scratch_bytes(T)) as scratch:
        assert idx.uses_tc_scorer == (scorer == "tc") and idx.inert_bound() == BOUND
        before = ctx_bytes(case, stream)
        st = run(idx, spy, case, [0, T], scratch, stream)
        after = ctx_bytes(case, stream)
        assert after[:BOUND].tobytes() == before[:BOUND].tobytes(), "a row below the inert bound was written"
        assert not np.isnan(after[BOUND:].view(BF16).astype(np.float32)).any(), "a selective row was not written"
        launched = spy.launched()
        assert ("qsa_score_rows_tc" in launched) == (scorer == "tc") and ("qsa_score_rows" in launched) == (
            scorer == "scalar")
        assert ("qsa_prefill_attn_tc" in launched) and "qsa_prefill_attn" not in launched   # tc-supported shape
        pages = ceil_div(T, BS)
        assert download(idx.prefill_table_dev, (pages,), np.int32, stream).tolist() == case.table.tolist()
        assert len(spy.slabs) == 1 and spy.slabs[0]["rows"] == T - BOUND
        check_slabs(idx, layer, st, case, spy.slabs, stream)
        lists = spy.slabs[0]["lists"]
        assert lists.shape == (T - BOUND, BUDGET // RATIO)
        assert all(len(set(r)) == BUDGET // RATIO for r in lists.tolist()), "a list repeats a block"
        complete = (BOUND + np.arange(T - BOUND) + 1) // RATIO
        assert (lists < complete[:, None]).all(), "a list names a block past the row's complete count"
        idx.release_seq_state(st)


def test_chunks_equal_one_shot(gpu, stream, rng, layer):
    """Chunks that end below, straddle and start past the bound give the one-shot result (bitwise on the
    emulator; on a GPU, where cuBLAS may pick another algorithm per m, every slab meets its staged references)."""
    T = 2300 if ON_GPU else 2150
    case = make_case(rng, T, stream)
    cuts = [0, 1700, 2040, 2051, 2060, 2061, 2100, T]   # inert, inert, inert (ends at the bound), straddles, ...
    spy = Spy(gpu)
    with layer.indexer(spy) as idx, cm.DeviceBuffer(idx.prefill_scratch_bytes(T)) as scratch:
        one = run(idx, spy, case, [0, T], scratch, stream)
        one_ctx = ctx_bytes(case, stream)
        idx.release_seq_state(one)
        cm.copy_h_to_d_async(case.dev["ctx"], case.dense, case.dense.nbytes, stream)   # the dense output again
        del spy.slabs[:], spy.calls[:]
        st = run(idx, spy, case, cuts, scratch, stream)
        got = ctx_bytes(case, stream)
        assert got[:BOUND].tobytes() == case.dense.view(np.uint16)[:BOUND].tobytes(), "a dense row was overwritten"
        assert (got[BOUND:] != case.dense.view(np.uint16)[BOUND:]).any(axis=1).all(), "a selective row kept dense"
        assert [s["first_pos"] for s in spy.slabs] == [2051, 2060, 2061, 2100]
        if ON_GPU:
            check_slabs(idx, layer, st, case, spy.slabs, stream)
        else:
            assert got.tobytes() == one_ctx.tobytes(), "chunked prefill selection differs from one shot"
            check_slabs(idx, layer, st, case, spy.slabs[-1:], stream, mutate=False)
        idx.release_seq_state(st)


@pytest.mark.parametrize("hd_attn, optional", [(HD_ATTN, True), (96, True), (HD_ATTN, False)],
                         ids=["tc-attention", "general-attention", "no-optional-kernels"])
def test_small_budget_many_slabs(gpu, stream, rng, layer, monkeypatch, hd_attn, optional):
    """budget 32 (bound 35) and 16-row slabs: many slabs per chunk, each against its staged references, with the
    general attention kernel where the tensor-core one does not cover the shape or is absent."""
    monkeypatch.setattr(prefill_mod, "SELECT_SLAB", 16)
    T = 150
    case = make_case(rng, T, stream, hd_attn=hd_attn)
    backend = gpu if optional else WithoutOptional(gpu)
    spy = Spy(backend)
    with layer.indexer(spy, budget=32, hd_attn=hd_attn, max_tokens=256) as idx, \
            cm.DeviceBuffer(idx.prefill_scratch_bytes(T)) as scratch:
        assert idx.inert_bound() == 35 and idx.uses_tc_scorer == optional
        st = run(idx, spy, case, [0, 20, 60, 61, T], scratch, stream)
        assert [s["first_pos"] for s in spy.slabs] == [35, 51, 60, 61, 77, 93, 109, 125, 141]
        launched = spy.launched()
        tc_attn = optional and hd_attn in (64, 128, 256)
        assert ("qsa_prefill_attn_tc" in launched) == tc_attn and ("qsa_prefill_attn" in launched) != tc_attn
        assert ("qsa_score_rows_tc" in launched) == optional
        got = ctx_bytes(case, stream)
        assert got[:35].tobytes() == case.dense.view(np.uint16)[:35].tobytes()
        check_slabs(idx, layer, st, case, spy.slabs, stream)
        idx.release_seq_state(st)


@pytest.mark.skipif(not ON_GPU, reason="two 2048-row slabs at full size run on a GPU (the emulator covers slabs "
                                       "with 16-row slabs above)")
def test_two_full_slabs(gpu, stream, rng, layer):
    T = 4400
    case = make_case(rng, T, stream)
    spy = Spy(gpu)
    with layer.indexer(spy) as idx, cm.DeviceBuffer(idx.prefill_scratch_bytes(T)) as scratch:
        st = run(idx, spy, case, [0, T], scratch, stream)
        assert [(s["first_pos"], s["rows"]) for s in spy.slabs] == [(2051, 2048), (4099, T - 4099)]
        check_slabs(idx, layer, st, case, spy.slabs, stream)
        idx.release_seq_state(st)


class WithoutOptional:
    """A backend that lacks the optional tensor-core kernels (and, if asked, a required one)."""

    def __init__(self, gpu, missing_required: str | None = None) -> None:
        self._gpu, self.missing, self.ctx = gpu, missing_required, gpu.ctx

    def __getattr__(self, name):
        return getattr(self._gpu, name)

    def kernel(self, module, func):
        if func == self.missing:
            raise HssError(f"kernel {func} is absent from module {module}")
        return self._gpu.kernel(module, func)

    def try_kernel(self, module, func):
        if func in ("qsa_score_rows_tc", "qsa_prefill_attn_tc"):
            return KernelHandle()
        return self._gpu.try_kernel(module, func)


@pytest.mark.parametrize("name", ["qsa_qprep_rows", "qsa_score_rows", "qsa_prefill_attn"])
def test_required_kernels(gpu, layer, name):
    rec = Recording(WithoutOptional(gpu, missing_required=name))
    with pytest.raises(HssError, match=name):
        layer.indexer(rec)
    allocs = [args for n, args in rec.calls if n == "alloc"]
    assert len(allocs) == len([1 for n, _ in rec.calls if n == "free"]), "a failed construction leaked memory"


# -- switches -------------------------------------------------------------------------------------------
def test_no_prefill_select(gpu, stream, rng, layer, monkeypatch):
    T = 2060
    case = make_case(rng, T, stream)
    monkeypatch.setenv("HSS_QSA_NO_PREFILL_SELECT", "1")
    spy = Spy(gpu)
    with layer.indexer(spy) as idx, cm.DeviceBuffer(idx.prefill_scratch_bytes(T)) as scratch:
        assert not idx.prefill_select_enabled
        st = idx.new_seq_state()
        idx.prefill_ingest(st, case.dev["hidden"], T, 0, stream)
        del spy.calls[:]
        n = idx.prefill_select(st, case.dev["hidden"], case.dev["q"], case.dev["ctx"], case.dev["k"], case.dev["v"],
                               case.table, 0, T, case.nq, BS, case.inv, scratch, stream)
        assert n == 0 and spy.calls == []
        assert ctx_bytes(case, stream).tobytes() == case.dense.view(np.uint16).tobytes()
        # the argument wins over the environment, and arguments are still checked when switched off
        with pytest.raises(HssError, match="seq_block_table"):
            idx.prefill_select(st, case.dev["hidden"], case.dev["q"], case.dev["ctx"], case.dev["k"],
                               case.dev["v"], case.table[:3], 0, T, case.nq, BS, case.inv, scratch, stream)
        idx.release_seq_state(st)
    with layer.indexer(gpu, no_prefill_select=False, score_scalar=True) as idx:
        assert idx.prefill_select_enabled and not idx.uses_tc_scorer
    monkeypatch.setenv("HSS_QSA_NO_PREFILL_SELECT", "yes")
    rec = Recording(gpu)
    with pytest.raises(HssError, match="HSS_QSA_NO_PREFILL_SELECT='yes' is not a flag"):
        layer.indexer(rec)
    assert rec.calls == []
    monkeypatch.setenv("HSS_QSA_NO_PREFILL_SELECT", "0")
    monkeypatch.setenv("HSS_QSA_SCORE_SCALAR", "0")
    with layer.indexer(gpu) as idx:
        assert idx.prefill_select_enabled and idx.uses_tc_scorer


def test_inert_calls_do_no_device_work(gpu, stream, rng, layer):
    T = 2051   # the last inert count: position 2050 is the last dense row
    case = make_case(rng, T, stream)
    rec = Recording(gpu)
    with layer.indexer(rec) as idx, cm.DeviceBuffer(idx.prefill_scratch_bytes(T)) as scratch:
        st = idx.new_seq_state()
        idx.prefill_ingest(st, case.dev["hidden"], T, 0, stream)
        del rec.calls[:]
        assert idx.prefill_select(st, case.dev["hidden"], case.dev["q"], case.dev["ctx"], case.dev["k"],
                                  case.dev["v"], case.table, 0, T, case.nq, BS, case.inv, scratch, stream) == 0
        assert rec.calls == []
        idx.prefill_ingest(st, 0, 0, T, stream)   # an empty chunk
        assert idx.prefill_select(st, 0, 0, 0, 0, 0, case.table, T, 0, case.nq, BS, case.inv, scratch, stream) == 0
        idx.release_seq_state(st)


# -- scratch --------------------------------------------------------------------------------------------
def test_scratch_layout_and_forms(gpu, stream, rng, layer):
    with layer.indexer(gpu) as idx:
        rows, topk = prefill_mod.SELECT_SLAB, idx.block_topk
        last = 0
        for total in (0, 1, 2051, 2052, 4095, MAX_TOKENS):
            lay = prefill_mod.scratch_layout(total, QKW, N_HEADS, HD, RATIO, topk)
            assert lay.stride == ceil_div(total, RATIO)
            assert lay.qk_buf == 0 and lay.qpost >= rows * QKW * 2 and lay.scores >= lay.qpost + rows * N_HEADS * HD * 4
            assert lay.lists >= lay.scores + rows * lay.stride * 4 and lay.nbytes == lay.lists + rows * topk * 4
            assert all(off % prefill_mod.SCRATCH_ALIGN == 0 for off in lay[1:5])
            assert idx.prefill_scratch_bytes(total) == lay.nbytes >= last
            last = lay.nbytes
        with pytest.raises(HssError, match="total_tokens"):
            idx.prefill_scratch_bytes(MAX_TOKENS + 1)
        # a scratch is accepted in every form whose size hss knows: a DeviceBuffer, a view of one, an address inside
        # one, a __cuda_array_interface__ object (and torch tensors / DLPack producers, see test_interop)
        T = 40
        case = make_case(rng, T, stream)
        st = idx.new_seq_state()
        idx.prefill_ingest(st, case.dev["hidden"], T, 0, stream)
        need = idx.prefill_scratch_bytes(T)

        class Cai:
            def __init__(self, ptr, n):
                self.__cuda_array_interface__ = {"shape": (n // 4,), "typestr": "<f4", "data": (ptr, False),
                                                 "version": 3, "strides": None}
        call = lambda scratch: idx.prefill_select(st, case.dev["hidden"], case.dev["q"], case.dev["ctx"],  # noqa
                                                  case.dev["k"], case.dev["v"], case.table, 0, T, case.nq, BS,
                                                  case.inv, scratch, stream)
        with cm.DeviceBuffer(need + 256) as buf:
            for form in (buf, buf.view("u8"), buf.ptr, buf.ptr + 256, Cai(buf.ptr, need)):
                assert call(form) == 0
            for form, match in ((buf.view("u8", need - 4), f"scratch holds {need - 4} bytes but {need} are needed"),
                                (Cai(buf.ptr, need - 4), "scratch holds"),
                                (buf.ptr + 512, f"scratch: {need} bytes at offset 512 run past the end"),
                                (4096, "size of scratch .* is unknown"),   # an address outside every hss buffer
                                (0, "scratch is a null"), (buf.ptr + 8, "scratch .* must be 16-byte aligned")):
                with pytest.raises(HssError, match=match):
                    call(form)
            with pytest.raises(TypeError, match="scratch: cannot use tuple"):   # no (pointer, nbytes) pairs
                call((buf.ptr, need))
        with pytest.raises(HssError, match="scratch is a closed DeviceBuffer"):
            call(buf)
        idx.release_seq_state(st)


# -- errors: each raised before any device work -----------------------------------------------------------
def test_errors_before_device_work(gpu, stream, rng, layer):
    T = 60
    case = make_case(rng, T, stream)
    rec = Recording(gpu)
    other = layer.indexer(gpu)
    foreign = other.new_seq_state()
    closed = cm.DeviceBuffer(case.q.nbytes)
    closed.close()
    with layer.indexer(rec) as idx, cm.DeviceBuffer(idx.prefill_scratch_bytes(T)) as scratch:
        st = idx.new_seq_state()
        idx.prefill_ingest(st, case.dev["hidden"], 40, 0, stream)   # 40 of the 60 tokens ingested
        d = case.dev
        good = dict(st=st, normed=d["hidden"], q_roped=d["q"], attn_ctx=d["ctx"], k_pool=d["k"], v_pool=d["v"],
                    seq_block_table=case.table, seq_start=0, num_tokens=40, nq=case.nq, block_size=BS,
                    inv_sqrt_d=case.inv, scratch=scratch, stream=stream)
        assert idx.prefill_select(**good) == 0
        small = idx.prefill_scratch_bytes(40) - 1
        attn_row = case.nq * case.hd_attn   # bf16 elements of a q_roped / attn_ctx row
        page = BS * NKV * case.hd_attn      # bf16 elements of a K / V page
        short_pool = int(case.table[:3].max()) * page   # one page short of the last page the table names
        cases = [
            (dict(num_tokens=30), HssError, "prefill_select for positions 0..29 but 40 tokens are ingested"),
            (dict(seq_start=20, num_tokens=40), HssError, "positions 20..59 but 40"),
            (dict(seq_start=40, num_tokens=10), HssError, "call prefill_ingest"),
            (dict(seq_block_table=case.table[:2]), HssError, "seq_block_table has 2 pages but 40 tokens in pages of "
                                                             "16 need 3"),
            (dict(seq_block_table=[]), HssError, "has 0 pages"),
            (dict(seq_block_table=np.zeros((3, 1), np.int32)), HssError, "one-dimensional"),
            (dict(seq_block_table=[0.0, 1.0, 2.0]), TypeError, "integers"),
            (dict(seq_block_table=[0, -1, 2]), HssError, r"seq_block_table\[1\] = -1"),
            (dict(seq_block_table=[0, 1, 2**31]), HssError, r"seq_block_table\[2\]"),
            (dict(scratch=scratch.view("u8", small)), HssError, f"scratch holds {small} bytes but {small + 1} are "
                                                                "needed .*prefill_scratch_bytes"),
            (dict(scratch=4096), HssError, "size of scratch"),
            (dict(scratch=scratch.view("u8", small, 8)), HssError, "scratch holds"),
            (dict(scratch=scratch.view("u8", small + 1, 8)), HssError, "scratch .* must be 16-byte aligned"),
            (dict(scratch=d["ctx"]), HssError, "scratch holds"),
            (dict(k_pool=d["k"].ptr + 2), HssError, "k_pool .* must be 16-byte aligned"),
            (dict(attn_ctx=d["ctx"].ptr + 4), HssError, "attn_ctx .* must be 16-byte aligned"),
            # every device array against the bytes the call reads or writes
            (dict(normed=d["hidden"].view("bf16", 39 * HIDDEN)), HssError,
             f"normed holds {39 * HIDDEN * 2} bytes but {40 * HIDDEN * 2} are needed"),
            (dict(normed=d["hidden"].ptr + 21 * HIDDEN * 2), HssError, "normed: .* run past the end"),
            (dict(q_roped=d["q"].view("bf16", 39 * attn_row)), HssError, "q_roped holds"),
            (dict(attn_ctx=d["ctx"].view("bf16", 39 * attn_row)), HssError,
             f"attn_ctx holds {39 * attn_row * 2} bytes but {40 * attn_row * 2} are needed"),
            (dict(attn_ctx=d["ctx"].ptr + 21 * attn_row * 2), HssError, "attn_ctx: .* run past the end"),
            (dict(attn_ctx=d["ctx"].view("f32")), HssError, "attn_ctx holds f32 but bf16 is needed"),
            (dict(k_pool=d["k"].view("bf16", short_pool)), HssError, "k_pool holds .* every page seq_block_table"),
            (dict(v_pool=d["v"].view("bf16", short_pool)), HssError, "v_pool holds"),
            (dict(v_pool=d["v"].ptr + (case.v.shape[0] - 1) * page * 2), HssError, "v_pool: .* run past the end"),
            (dict(nq=0), HssError, "nq = 0"),
            (dict(nq=NKV + 1), HssError, f"nq \\({NKV + 1}\\) must be a multiple of nkv_attn \\({NKV}\\)"),
            (dict(nq=2.0), TypeError, "nq must be an int, got float"),
            (dict(nq=True), TypeError, "nq must be an int, got bool"),
            (dict(block_size=4), HssError, r"block_size = 4 must be in 8\.\."),
            (dict(block_size=0), HssError, "block_size = 0"),
            (dict(block_size=np.float64(16)), TypeError, "block_size must be an int"),
            (dict(seq_start=False), TypeError, "seq_start must be an int, got bool"),
            (dict(num_tokens=40.0), TypeError, "num_tokens must be an int"),
            (dict(inv_sqrt_d=0.0), HssError, "inv_sqrt_d"),
            (dict(inv_sqrt_d=math.nan), HssError, "inv_sqrt_d"),
            (dict(inv_sqrt_d=1e-50), HssError, "inv_sqrt_d = 1e-50 must be finite and > 0 as a float32"),
            (dict(inv_sqrt_d=True), TypeError, "inv_sqrt_d must be a number, got bool"),
            (dict(stream=None), TypeError, "stream: a stream is required"),
            (dict(normed=0), HssError, "normed is a null"),
            (dict(q_roped=0), HssError, "q_roped is a null"),
            (dict(attn_ctx=0), HssError, "attn_ctx is a null"),
            (dict(k_pool=0), HssError, "k_pool is a null"),
            (dict(v_pool=0), HssError, "v_pool is a null"),
            (dict(q_roped=closed), HssError, "q_roped is a closed DeviceBuffer"),
            (dict(attn_ctx="ctx"), TypeError, "attn_ctx: cannot use str"),
            (dict(num_tokens=-1), HssError, "num_tokens = -1"),
            (dict(st=foreign), HssError, "belongs to another indexer"),
            (dict(st=None), TypeError, "QsaSeqState"),
        ]
        before = (st.ingested, st.pooled, st.table_len)
        del rec.calls[:]
        for kw, exc, match in cases:
            with pytest.raises(exc, match=match):
                idx.prefill_select(**{**good, **kw})
            assert rec.calls == [], f"device work before the error {match!r}"
            assert (st.ingested, st.pooled, st.table_len) == before
        idx.release_seq_state(st)
        del rec.calls[:]
        with pytest.raises(HssError, match="released"):
            idx.prefill_select(**good)
        assert rec.calls == []
    with layer.indexer(rec, hd_attn=80) as idx, cm.DeviceBuffer(idx.prefill_scratch_bytes(T)) as scratch:
        st = idx.new_seq_state()
        idx.prefill_ingest(st, case.dev["hidden"], 40, 0, stream)
        del rec.calls[:]
        with pytest.raises(HssError, match=r"hd_attn \(80\) a multiple of 32"):
            idx.prefill_select(**{**good, "st": st, "scratch": scratch})
        assert rec.calls == []
        idx.release_seq_state(st)
    other.release_seq_state(foreign)
    other.close()


def test_small_attn_ctx_raises_before_scratch_is_written(gpu, stream, rng, layer):
    """A selective chunk (budget 8: rows 11.. are rewritten) whose attn_ctx is one row short: the error comes before
    any device work, so the poisoned scratch and attn_ctx keep every byte; with the whole attn_ctx (and numpy scalars
    for the ints and the scale) the same call writes both, so the check is what kept them."""
    T = 40
    case = make_case(rng, T, stream)
    rec = Recording(gpu)
    with layer.indexer(rec, budget=8, max_tokens=64) as idx, \
            poisoned(idx.prefill_scratch_bytes(T), stream) as scratch:
        st = idx.new_seq_state()
        idx.prefill_ingest(st, case.dev["hidden"], T, 0, stream)
        d = case.dev
        row_elems = case.nq * case.hd_attn
        args = [st, d["hidden"], d["q"], d["ctx"], d["k"], d["v"], case.table, 0, T, case.nq, BS, case.inv, scratch,
                stream]
        del rec.calls[:]
        for short in (d["ctx"].view("bf16", (T - 1) * row_elems), d["ctx"].ptr + row_elems * 2):
            args[3] = short
            with pytest.raises(HssError, match="attn_ctx(:| holds) .* (run past the end|are needed)"):
                idx.prefill_select(*args)
            assert rec.calls == [], "device work before the attn_ctx error"
        cm.stream_sync(stream)
        assert (download(scratch, (scratch.bytes,), np.uint8, stream) == 0xFF).all(), "scratch was written"
        assert ctx_bytes(case, stream).tobytes() == case.dense.view(np.uint16).tobytes(), "attn_ctx was written"
        args[3] = d["ctx"]   # numpy integers and a numpy float are read as Python numbers
        args[7:12] = [np.int64(0), np.int32(T), np.int16(case.nq), np.uint8(BS), np.float32(case.inv)]
        assert idx.prefill_select(*args) == T - idx.inert_bound()
        assert (download(scratch, (scratch.bytes,), np.uint8, stream) != 0xFF).any()
        assert (ctx_bytes(case, stream)[idx.inert_bound():] != case.dense.view(np.uint16)[idx.inert_bound():]).any()
        idx.release_seq_state(st)


def test_written_arguments_may_not_overlap_own_memory_or_each_other(gpu, stream, rng, layer):
    """scratch and attn_ctx are written: neither may lie in the indexer's memory (a state's keys, its scratch) nor
    overlap another argument (scratch over q_roped, attn_ctx over the K pool, ...). Refused before any device work:
    the poisoned scratch and the dense attn_ctx keep every byte."""
    T = 40
    case = make_case(rng, T, stream)
    rec = Recording(gpu)
    with layer.indexer(rec, budget=8, max_tokens=4096) as idx, \
            poisoned(idx.prefill_scratch_bytes(T), stream) as scratch:
        st, other = idx.new_seq_state(), idx.new_seq_state()
        idx.prefill_ingest(st, case.dev["hidden"], T, 0, stream)
        d = case.dev
        good = dict(st=st, normed=d["hidden"], q_roped=d["q"], attn_ctx=d["ctx"], k_pool=d["k"], v_pool=d["v"],
                    seq_block_table=case.table, seq_start=0, num_tokens=T, nq=case.nq, block_size=BS,
                    inv_sqrt_d=case.inv, scratch=scratch, stream=stream)
        pool = case.k.nbytes
        with cm.DeviceBuffer(idx.prefill_scratch_bytes(T) + case.dense.nbytes) as both, \
                cm.DeviceBuffer(pool + case.dense.nbytes) as kv_and_out:
            cases = [
                (dict(attn_ctx=other.raw_keys), "attn_ctx .* overlaps a sequence state's raw keys, memory that this "
                 "QsaIndexer owns"),
                (dict(attn_ctx=idx.qk_scratch), "attn_ctx .* overlaps the indexer's qk scratch"),
                (dict(normed=st.raw_keys), "normed .* overlaps a sequence state's raw keys"),
                (dict(scratch=both, attn_ctx=both.ptr + idx.prefill_scratch_bytes(T) - 256),
                 "QsaIndexer.prefill_select: scratch overlaps attn_ctx"),
                (dict(attn_ctx=d["q"]), "prefill_select: attn_ctx overlaps q_roped"),
                (dict(k_pool=kv_and_out, attn_ctx=kv_and_out.ptr + 256), "prefill_select: attn_ctx overlaps "
                 "k_pool"),
            ]
            del rec.calls[:]
            for change, match in cases:
                with pytest.raises(HssError, match=match):
                    idx.prefill_select(**{**good, **change})
                assert rec.calls == [], f"device work before the error {match!r}"
        cm.stream_sync(stream)
        assert (download(scratch, (scratch.bytes,), np.uint8, stream) == 0xFF).all(), "scratch was written"
        assert ctx_bytes(case, stream).tobytes() == case.dense.view(np.uint16).tobytes(), "attn_ctx was written"
        assert idx.prefill_select(**good) == T - idx.inert_bound()
