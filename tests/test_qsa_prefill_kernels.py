"""QSA prefill kernels (docs/design.md §12.5-12.8) against their staged float64 references under the docs/design.md §0
bounds.

One file for both drivers: the emulator in CI (small shapes), the GPU on the device (production-like
shapes, ``ON_GPU``). Every output is NaN-poisoned before its launch; inputs are random (never zeros) at
unit scale (std 1) and at the original's small scale (std 1/sqrt(hd)); every bound is shown to bite.
"""
from __future__ import annotations

import contextlib

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from hss import cuda_min as cm
from hss._util import ceil_div
from hss.cuda import ptx
from hss.decls import qsa_prefill as kq
from hss.reference import qsa_prefill as ref

from conftest import ON_GPU
from helpers import BF16, MASKED, assert_bites, assert_close, download, poisoned, tc_bound, upload, violations

SCALES = ("unit", "small")
THETA, EPS = 1e7, 1e-6
# the tensor-core scorer's derived bound (docs/design.md §0) is helpers.tc_bound, shared with the prefill_select tests


@pytest.fixture(scope="module")
def mod(ctx):
    m = ptx.load_module(kq.MODULE, ctx)
    yield m
    m.close()


def _launch(mod, decl, geom: kq.Geometry, stream, *args) -> None:
    cm.launch_kernel(mod.function(decl.name), geom.grid, geom.block, geom.shared, stream, decl.pack(*args))


def _normal(rng: np.random.Generator, shape, std: float, dtype=BF16) -> np.ndarray:
    x = rng.standard_normal(shape) * std
    x[np.abs(x) < 1e-3 * std] = std          # never zeros (nor values that round to them)
    return x.astype(dtype)


def _std(scale: str, hd: int) -> float:
    return 1.0 if scale == "unit" else hd ** -0.5


# ---------------------------------------------------------------------------------------------
# qsa_qprep_rows
# ---------------------------------------------------------------------------------------------
def _run_qprep(mod, stream, qk, w, first_pos, n_heads, hd, rot):
    rows, qkw = qk.shape
    with contextlib.ExitStack() as es:
        d_qk, d_w = es.enter_context(upload(qk, stream)), es.enter_context(upload(w, stream))
        d_out = es.enter_context(poisoned(4 * (rows + 1) * n_heads * hd, stream))
        _launch(mod, kq.QSA_QPREP_ROWS, kq.qprep_rows_geometry(rows, n_heads, hd), stream,
                d_qk, d_w, d_out, first_pos, qkw, n_heads, hd, rot, THETA, EPS)
        out = download(d_out, (rows + 1, n_heads, hd), np.float32, stream)
    assert np.isnan(out[rows]).all(), "qsa_qprep_rows wrote past its rows"
    return out[:rows]


@pytest.mark.parametrize("scale", SCALES)
def test_qprep_rows_matches_reference(mod, stream, rng, scale):
    rows, n_heads, hd, rot = (300 if ON_GPU else 24), 4, 128, 64
    qkw = (n_heads + 1) * hd
    first_pos = int(rng.integers(2051, 300_000))
    qk = _normal(rng, (rows, qkw), _std(scale, hd))
    w = _normal(rng, (hd,), 0.1)
    got = _run_qprep(mod, stream, qk, w, first_pos, n_heads, hd, rot)
    want = ref.qprep_rows(qk, w, first_pos, n_heads, hd, rot, THETA, EPS)
    assert_close(got, want, "f32", (2,), "qsa_qprep_rows")
    assert_bites(got, ref.qprep_rows(qk, np.zeros(hd), first_pos, n_heads, hd, rot, THETA, EPS), "f32", (2,),
                 "qsa_qprep_rows, (1 + w) dropped")
    assert_bites(got, ref.qprep_rows(qk, w, first_pos + 1, n_heads, hd, rot, THETA, EPS), "f32", (2,),
                 "qsa_qprep_rows, RoPE one position off")


@given(data=st.data())
def test_qprep_rows_shapes(mod, stream, data):
    hd = data.draw(st.sampled_from([32, 64, 96, 128, 256]), label="hd")
    n_heads = data.draw(st.integers(1, 5), label="n_heads")
    rot = 2 * data.draw(st.integers(0, hd // 2), label="rot/2")
    rows = data.draw(st.integers(1, 40 if ON_GPU else 5), label="rows")
    qkw = n_heads * hd + data.draw(st.integers(0, 40), label="extra columns")
    first_pos = data.draw(st.integers(0, 1 << 20), label="first_pos")
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="seed"))
    qk = _normal(rng, (rows, qkw), _std(data.draw(st.sampled_from(SCALES)), hd))
    w = _normal(rng, (hd,), 0.2)
    got = _run_qprep(mod, stream, qk, w, first_pos, n_heads, hd, rot)
    assert_close(got, ref.qprep_rows(qk, w, first_pos, n_heads, hd, rot, THETA, EPS), "f32", (2,), "qsa_qprep_rows")


# ---------------------------------------------------------------------------------------------
# qsa_score_rows / qsa_score_rows_tc
# ---------------------------------------------------------------------------------------------
def _run_scores(mod, stream, q, keys, first_pos, ratio, n_blocks, stride, tc: bool, chunk_groups=None):
    """Launch one scorer; returns the whole poisoned [rows + 1, stride] buffer as written."""
    rows, n_heads, hd = q.shape
    with contextlib.ExitStack() as es:
        d_q, d_k = es.enter_context(upload(q, stream)), es.enter_context(upload(keys, stream))
        d_s = es.enter_context(poisoned(4 * (rows + 1) * stride, stream))
        if tc:
            _launch(mod, kq.QSA_SCORE_ROWS_TC, kq.score_rows_tc_geometry(rows, n_blocks, chunk_groups), stream,
                    d_q, d_k, d_s, first_pos, stride, ratio, n_blocks, rows)
        else:
            _launch(mod, kq.QSA_SCORE_ROWS, kq.score_rows_geometry(rows, n_blocks), stream,
                    d_q, d_k, d_s, first_pos, stride, ratio, n_heads, hd, rows, n_blocks)
        return download(d_s, (rows + 1, stride), np.float32, stream)


def _check_score_layout(full, rows, n_blocks, first_pos, ratio, what) -> tuple[np.ndarray, np.ndarray]:
    """Masked entries exactly -1e30, nothing written past n_blocks or past the rows; returns (scores, valid)."""
    got = full[:rows, :n_blocks]
    valid = np.arange(n_blocks)[None, :] < ref.complete_counts(first_pos, rows, ratio)[:, None]
    assert (got[~valid] == MASKED).all(), f"{what}: a masked entry is not exactly -1e30"
    assert np.isnan(full[:rows, n_blocks:]).all() and np.isnan(full[rows:]).all(), f"{what}: wrote past n_blocks/rows"
    return got, valid


def _assert_bites_tol(got, mutated, tol, valid, what):
    if not violations(got, mutated, "f32", (1,), valid, tol=tol).any():
        raise AssertionError(f"{what}: the bound does not bite (a mutated reference also passes)")


def _score_case(rng, rows, first_pos, ratio, n_heads, hd, std, extra=5):
    n_blocks = (first_pos + rows) // ratio
    q = (rng.standard_normal((rows, n_heads, hd)) * std).astype(np.float32)
    keys = _normal(rng, (max(n_blocks, 1), hd), std)
    return q, keys, n_blocks, n_blocks + extra


@pytest.mark.parametrize("scale", SCALES)
def test_score_rows_matches_reference(mod, stream, rng, scale):
    rows, first_pos, ratio, n_heads, hd = (300, 8191, 4, 4, 128) if ON_GPU else (70, 190, 4, 3, 96)
    q, keys, n_blocks, stride = _score_case(rng, rows, first_pos, ratio, n_heads, hd, _std(scale, hd))
    full = _run_scores(mod, stream, q, keys, first_pos, ratio, n_blocks, stride, tc=False)
    got, valid = _check_score_layout(full, rows, n_blocks, first_pos, ratio, "qsa_score_rows")
    want = ref.score_rows(q, keys, first_pos, ratio, n_blocks)
    # f32 rule: dots are f32 fma chains of hd terms (~1e-6 relative), rsqrtf adds 2 ulp: far inside 1e-4 max|ref|
    assert_close(got, want, "f32", (1,), "qsa_score_rows", valid=valid)
    assert_bites(got, ref.score_rows(q[:, 1:], keys, first_pos, ratio, n_blocks), "f32", (1,),
                 "qsa_score_rows, one head dropped", valid=valid)


@given(data=st.data())
def test_score_rows_shapes(mod, stream, data):
    rows = data.draw(st.integers(1, 150 if ON_GPU else 70), label="rows")
    ratio = data.draw(st.integers(1, 5), label="ratio")
    first_pos = data.draw(st.integers(0, 600), label="first_pos")
    n_heads = data.draw(st.integers(1, 5), label="n_heads")
    hd = data.draw(st.sampled_from([8, 40, 64, 100, 128, 200]), label="hd")
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="seed"))
    std = _std(data.draw(st.sampled_from(SCALES), label="scale"), hd)
    q, keys, n_max, _ = _score_case(rng, rows, first_pos, ratio, n_heads, hd, std)
    n_blocks = data.draw(st.integers(1, max(n_max, 1)), label="n_blocks")
    stride = n_blocks + data.draw(st.integers(0, 6), label="stride extra")
    full = _run_scores(mod, stream, q, keys, first_pos, ratio, n_blocks, stride, tc=False)
    got, valid = _check_score_layout(full, rows, n_blocks, first_pos, ratio, "qsa_score_rows")
    assert_close(got, ref.score_rows(q, keys, first_pos, ratio, n_blocks), "f32", (1,), "qsa_score_rows", valid=valid)


@pytest.mark.parametrize("scale", SCALES)
def test_score_rows_tc_matches_reference(mod, stream, rng, scale):
    rows, first_pos, ratio = (300, 8191, 4) if ON_GPU else (37, 150, 4)
    q, keys, n_blocks, stride = _score_case(rng, rows, first_pos, ratio, kq.TC_HEADS, kq.TC_HD, _std(scale, kq.TC_HD))
    full = _run_scores(mod, stream, q, keys, first_pos, ratio, n_blocks, stride, tc=True)
    again = _run_scores(mod, stream, q, keys, first_pos, ratio, n_blocks, stride, tc=True, chunk_groups=1)
    assert np.array_equal(full.view(np.uint32), again.view(np.uint32)), "qsa_score_rows_tc is not deterministic"
    check_score_tc(full, q, keys, first_pos, ratio, n_blocks)


def check_score_tc(full, q, keys, first_pos, ratio, n_blocks) -> None:
    """qsa_score_rows_tc's output [rows + 1, stride] against the staged reference under the derived split-q bound
    (its layout checked), and the bound shown to bite (one head dropped)."""
    got, valid = _check_score_layout(full, q.shape[0], n_blocks, first_pos, ratio, "qsa_score_rows_tc")
    want = ref.score_rows(q, keys, first_pos, ratio, n_blocks)
    tol = tc_bound(q, keys, want)
    assert_close(got, want, "f32", (1,), "qsa_score_rows_tc (derived split-q bound)", valid=valid, tol=tol)
    _assert_bites_tol(got, ref.score_rows(q[:, 1:], keys, first_pos, ratio, n_blocks), tol, valid,
                      "qsa_score_rows_tc, one head dropped")


def draw_score_tc_case(data, max_rows: int, max_first_pos: int) -> tuple:
    """A random tensor-core scorer case: (q, keys, first_pos, ratio, n_blocks, stride, grid.y)."""
    rows = data.draw(st.integers(1, max_rows), label="rows")
    ratio = data.draw(st.integers(1, 5), label="ratio")
    first_pos = data.draw(st.integers(0, max_first_pos), label="first_pos")
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="seed"))
    q, keys, n_max, _ = _score_case(rng, rows, first_pos, ratio, kq.TC_HEADS, kq.TC_HD,
                                    _std(data.draw(st.sampled_from(SCALES)), kq.TC_HD))
    n_blocks = data.draw(st.integers(1, max(n_max, 1)), label="n_blocks")
    stride = n_blocks + data.draw(st.integers(0, 6), label="stride extra")
    groups = data.draw(st.integers(1, ceil_div(n_blocks, kq.TC_BLOCKS)), label="grid.y")
    return q, keys, first_pos, ratio, n_blocks, stride, groups


@given(data=st.data())
def test_score_rows_tc_shapes(mod, stream, data):
    q, keys, first_pos, ratio, n_blocks, stride, groups = draw_score_tc_case(data, 100 if ON_GPU else 40, 900)
    rows = q.shape[0]
    full = _run_scores(mod, stream, q, keys, first_pos, ratio, n_blocks, stride, tc=True, chunk_groups=groups)
    got, valid = _check_score_layout(full, rows, n_blocks, first_pos, ratio, "qsa_score_rows_tc")
    want = ref.score_rows(q, keys, first_pos, ratio, n_blocks)
    assert_close(got, want, "f32", (1,), "qsa_score_rows_tc", valid=valid, tol=tc_bound(q, keys, want))


def _assert_near_ties(lists_a, lists_b, want, tol, first_pos, ratio, topk, what):
    """docs/design.md §0 selection rule: blocks in one list but not the other lie within 2x the score bound of the
    cutoff (the topk-th largest staged-reference score of the row)."""
    comp = ref.complete_counts(first_pos, want.shape[0], ratio)
    for r in range(want.shape[0]):
        diff = set(lists_a[r].tolist()) ^ set(lists_b[r].tolist())
        if not diff:
            continue
        cutoff = np.sort(want[r, :comp[r]])[::-1][topk - 1]
        margin = 2 * tol[r, :comp[r]].max()
        far = [b for b in diff if abs(want[r, b] - cutoff) > margin]
        assert not far, f"{what}: row {r} selects differently at blocks {far} away from the cutoff {cutoff}"


@pytest.mark.parametrize("scale", SCALES)
def test_tc_and_scalar_topk_differ_only_by_near_ties(mod, stream, rng, scale):
    rows, first_pos, ratio, topk = (256, 8000, 4, 512) if ON_GPU else (40, 200, 4, 16)
    q, keys, n_blocks, stride = _score_case(rng, rows, first_pos, ratio, kq.TC_HEADS, kq.TC_HD, _std(scale, kq.TC_HD))
    sc, _ = _check_score_layout(_run_scores(mod, stream, q, keys, first_pos, ratio, n_blocks, stride, tc=False),
                                rows, n_blocks, first_pos, ratio, "qsa_score_rows")
    tc, _ = _check_score_layout(_run_scores(mod, stream, q, keys, first_pos, ratio, n_blocks, stride, tc=True),
                                rows, n_blocks, first_pos, ratio, "qsa_score_rows_tc")
    want = ref.score_rows(q, keys, first_pos, ratio, n_blocks)
    valid = want != MASKED
    tol_sc = 1e-4 * np.where(valid, np.abs(want), 0).max(axis=1, keepdims=True) * np.ones_like(want)
    tol_tc = tc_bound(q, keys, want)
    lists_ref = ref.topk_lists(want, first_pos, ratio, topk)
    lists_sc = ref.topk_lists(sc, first_pos, ratio, topk)
    lists_tc = ref.topk_lists(tc, first_pos, ratio, topk)
    _assert_near_ties(lists_sc, lists_ref, want, tol_sc, first_pos, ratio, topk, "scalar vs float64")
    _assert_near_ties(lists_tc, lists_ref, want, tol_tc, first_pos, ratio, topk, "tensor-core vs float64")
    _assert_near_ties(lists_tc, lists_sc, want, tol_tc + tol_sc, first_pos, ratio, topk, "tensor-core vs scalar")


# ---------------------------------------------------------------------------------------------
# qsa_prefill_attn / qsa_prefill_attn_tc
# ---------------------------------------------------------------------------------------------
ATTN_KERNELS = ("general", "tc")


def _attn_case(rng, rows, nq, nkv, hd, topk, ratio, bs, first_pos, std, extra_pages=3):
    pages = ceil_div(first_pos + rows, bs)
    table = rng.permutation(pages + extra_pages)[:pages].astype(np.int32)
    k_cache = _normal(rng, (pages + extra_pages, bs, nkv, hd), std)
    v_cache = _normal(rng, (pages + extra_pages, bs, nkv, hd), std)
    q = _normal(rng, (rows, nq, hd), std)
    lists = np.stack([rng.choice((first_pos + r + 1) // ratio, size=topk, replace=False)
                      for r in range(rows)]).astype(np.int32).reshape(rows, topk)
    return q, k_cache, v_cache, table, lists


def _run_attn(mod, stream, kernel, q, k_cache, v_cache, table, lists, first_pos, ratio, inv_sqrt_d):
    rows, nq, hd = q.shape
    _, bs, nkv, _ = k_cache.shape
    topk = lists.shape[1]
    if kernel == "tc":
        decl, geom = kq.QSA_PREFILL_ATTN_TC, kq.prefill_attn_tc_geometry(rows, nkv)
    else:
        decl, geom = kq.QSA_PREFILL_ATTN, kq.prefill_attn_geometry(rows, nq, nkv, hd)
    with contextlib.ExitStack() as es:
        bufs = [es.enter_context(upload(x, stream)) for x in (q, k_cache, v_cache, table, lists)]
        d_out = es.enter_context(poisoned(2 * (rows + 1) * nq * hd, stream))
        _launch(mod, decl, geom, stream, *bufs, d_out, first_pos, topk, ratio, bs, nq, nkv, hd, inv_sqrt_d)
        out = download(d_out, (rows + 1, nq, hd), BF16, stream).astype(np.float64)
    assert np.isnan(out[rows]).all(), f"{decl.name} wrote past its rows"
    return out[:rows]


def _drop_heaviest_token(q, k_cache, v_cache, table, lists, first_pos, ratio, inv_sqrt_d) -> np.ndarray:
    """The mutated reference: each row without its highest-weight token (weights of query head 0)."""
    out = np.empty(q.shape)
    for r in range(q.shape[0]):
        tok = ref.selected_tokens(lists[r], first_pos + r, ratio)
        k = ref.gather_rows(k_cache.astype(np.float64), table, tok)
        v = ref.gather_rows(v_cache.astype(np.float64), table, tok)
        s = k[:, 0] @ q[r, 0].astype(np.float64)
        keep = np.arange(tok.size) != int(np.argmax(s))
        out[r] = ref.attend(q[r], k[keep], v[keep], inv_sqrt_d)
    return out


@pytest.mark.parametrize("kernel", ATTN_KERNELS)
@pytest.mark.parametrize("scale", SCALES)
def test_prefill_attn_gqa_12_to_1(mod, stream, rng, kernel, scale):
    rows, topk, first_pos = (16, 512, 4100) if ON_GPU else (3, 16, 150)
    nq, nkv, hd, ratio, bs = 24, 2, 256, 4, 16
    case = _attn_case(rng, rows, nq, nkv, hd, topk, ratio, bs, first_pos, _std(scale, hd))
    inv = float(np.float32(hd ** -0.5))
    got = _run_attn(mod, stream, kernel, *case, first_pos, ratio, inv)
    want = ref.prefill_attn(*case, first_pos, ratio, inv)
    assert_close(got, want, "bf16", (2,), f"qsa_prefill_attn ({kernel})")
    assert_bites(got, _drop_heaviest_token(*case, first_pos, ratio, inv), "bf16", (2,),
                 f"qsa_prefill_attn ({kernel}), heaviest token dropped")


def _lcg_bf16(n: int, state: int) -> tuple[np.ndarray, int]:
    """docs/design.md §14 data: s = s*1664525 + 1013904223 (mod 2^32); value = (s >> 8)/2^24 - 0.5; bf16 by
    truncation."""
    out = np.empty(n, dtype=np.uint32)
    s = state
    for i in range(n):
        s = (s * 1664525 + 1013904223) & 0xFFFFFFFF
        out[i] = s >> 8
    vals = (out.astype(np.float64) / 2**24 - 0.5).astype(np.float32)
    return (vals.view(np.uint32) >> 16).astype(np.uint16).view(BF16), s


def original_small_case() -> tuple[tuple, int, int, float]:
    """The upstream attention test's inputs (docs/design.md §14): rows 3, nq 24, nkv 2, hd 256, ratio 4, topk 8,
    bs 16, first_pos 41, list_r[i] = (5i + r) mod 10 (duplicates included), identity table, LCG data (seed 1; q,
    then K, then V). Returns ((q, k_cache, v_cache, table, lists), first_pos, ratio, 1/sqrt(hd) as f32)."""
    rows, nq, nkv, hd, ratio, topk, bs, first_pos = 3, 24, 2, 256, 4, 8, 16, 41
    pages = ceil_div(first_pos + rows, bs)
    s = 1
    q, s = _lcg_bf16(rows * nq * hd, s)
    k, s = _lcg_bf16(pages * bs * nkv * hd, s)
    v, s = _lcg_bf16(pages * bs * nkv * hd, s)
    case = (q.reshape(rows, nq, hd), k.reshape(pages, bs, nkv, hd), v.reshape(pages, bs, nkv, hd),
            np.arange(pages, dtype=np.int32),
            np.array([[(5 * i + r) % 10 for i in range(topk)] for r in range(rows)], dtype=np.int32))
    return case, first_pos, ratio, float(np.float32(hd ** -0.5))


@pytest.mark.parametrize("kernel", ATTN_KERNELS)
def test_prefill_attn_original_small_case(mod, stream, kernel):
    """The upstream attention test (docs/design.md §14, :func:`original_small_case`)."""
    case, first_pos, ratio, inv = original_small_case()
    got = _run_attn(mod, stream, kernel, *case, first_pos, ratio, inv)
    want = ref.prefill_attn(*case, first_pos, ratio, inv)
    assert_close(got, want, "bf16", (2,), f"qsa_prefill_attn ({kernel}), docs/design.md §14 case")
    cos = (got * want).sum(-1) / (np.linalg.norm(got, axis=-1) * np.linalg.norm(want, axis=-1))
    assert cos.min() > 0.999, f"recorded parity: worst cosine {cos.min()}"
    assert_bites(got, _drop_heaviest_token(*case, first_pos, ratio, inv), "bf16", (2,),
                 f"qsa_prefill_attn ({kernel}) docs/design.md §14 case, heaviest token dropped")


def draw_attn_case(data, kernel: str, max_nkv: int, block_sizes: list, max_topk: int, max_rows: int,
                   extra_pos: int) -> tuple:
    """A random prefill attention case for ``kernel``: ((q, k_cache, v_cache, table, lists), first_pos, ratio, inv)."""
    if kernel == "tc":
        hd = data.draw(st.sampled_from(kq.ATTN_TC_HD), label="hd")
        group = data.draw(st.integers(1, kq.ATTN_TC_MAX_GROUP), label="group")
    else:
        hd = data.draw(st.sampled_from([32, 64, 96, 128, 160, 224, 256]), label="hd")
        group = data.draw(st.integers(1, 13), label="group")
    nkv = data.draw(st.integers(1, max_nkv), label="nkv")
    ratio = data.draw(st.integers(1, 5), label="ratio")
    bs = data.draw(st.sampled_from(block_sizes), label="block_size")
    topk = data.draw(st.integers(0, max_topk), label="topk")
    rows = data.draw(st.integers(1, max_rows), label="rows")
    first_pos = data.draw(st.integers(max(topk * ratio - 1, 0), topk * ratio + extra_pos), label="first_pos")
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="seed"))
    case = _attn_case(rng, rows, group * nkv, nkv, hd, topk, ratio, bs, first_pos,
                      _std(data.draw(st.sampled_from(SCALES), label="scale"), hd))
    return case, first_pos, ratio, float(np.float32(hd ** -0.5))


@given(data=st.data())
@pytest.mark.parametrize("kernel", ATTN_KERNELS)
def test_prefill_attn_shapes(mod, stream, kernel, data):
    case, first_pos, ratio, inv = draw_attn_case(data, kernel, 3, [1, 3, 8, 16, 32], 40 if ON_GPU else 12, 4, 60)
    got = _run_attn(mod, stream, kernel, *case, first_pos, ratio, inv)
    assert_close(got, ref.prefill_attn(*case, first_pos, ratio, inv), "bf16", (2,), f"qsa_prefill_attn ({kernel})")


# ---------------------------------------------------------------------------------------------
# the stage: qprep -> scores -> host top-k -> attention, against the float64 selection + attention
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("scorer", ("scalar", "tc"))
def test_prefill_stage_against_float64_selection(mod, stream, rng, scorer):
    rows, first_pos, topk = (128, 6000, 512) if ON_GPU else (6, 120, 12)
    n_heads, hd, ratio, nq, nkv, hd_attn, bs = 4, 128, 4, 24, 2, 256, 16
    qk = _normal(rng, (rows, (n_heads + 1) * hd), 1.0)
    w = _normal(rng, (hd,), 0.1)
    n_blocks = (first_pos + rows) // ratio
    block_keys = _normal(rng, (n_blocks, hd), 1.0)
    q_attn, k_cache, v_cache, table, _ = _attn_case(rng, rows, nq, nkv, hd_attn, 1, ratio, bs, first_pos, 1.0)
    inv = float(np.float32(hd_attn ** -0.5))

    q_post = _run_qprep(mod, stream, qk, w, first_pos, n_heads, hd, 2 * hd // 4)
    full = _run_scores(mod, stream, q_post, block_keys, first_pos, ratio, n_blocks, n_blocks, tc=scorer == "tc")
    scores, valid = _check_score_layout(full, rows, n_blocks, first_pos, ratio, scorer)
    lists = ref.topk_lists(scores, first_pos, ratio, topk)   # the host top-k of docs/design.md §11.5 d

    want_scores, want_lists, want_out = ref.prefill_select_attention(
        q_post, block_keys, q_attn, k_cache, v_cache, table, first_pos, ratio, topk, inv)   # staged from q_post
    tol = tc_bound(q_post, block_keys, want_scores) if scorer == "tc" else \
        1e-4 * np.where(valid, np.abs(want_scores), 0).max(axis=1, keepdims=True) * np.ones_like(want_scores)
    assert_close(scores, want_scores, "f32", (1,), f"{scorer} scores", valid=valid, tol=tol)
    _assert_near_ties(lists, want_lists, want_scores, tol, first_pos, ratio, topk, f"{scorer} selection")

    got = _run_attn(mod, stream, "tc", q_attn, k_cache, v_cache, table, lists, first_pos, ratio, inv)
    assert_close(got, ref.prefill_attn(q_attn, k_cache, v_cache, table, lists, first_pos, ratio, inv), "bf16", (2,),
                 "attention over the engine's lists")
    same = np.array([set(a) == set(b) for a, b in zip(lists.tolist(), want_lists.tolist())])
    assert_close(got[same], want_out[same], "bf16", (2,), "attention where the selection matches float64")


def test_topk_lists_order_and_ties():
    scores = np.array([[1.0, 3.0, 3.0, 2.0, 5.0, MASKED],
                       [0.5, 0.5, 0.5, 0.5, 0.5, 0.5]])
    lists = ref.topk_lists(scores, first_pos=4, ratio=1, topk=3)   # complete 5 and 6
    assert lists.tolist() == [[4, 1, 2], [0, 1, 2]]
    assert ref.selected_tokens(np.array([2, 0]), pos=10, ratio=4).tolist() == [8, 9, 10, 11, 0, 1, 2, 3, 8, 9, 10]
    with pytest.raises(ValueError):
        ref.topk_lists(scores, first_pos=0, ratio=4, topk=3)


# ---------------------------------------------------------------------------------------------
# emulator-only contract checks (a GPU would just misbehave)
# ---------------------------------------------------------------------------------------------
@pytest.mark.emulator
def test_contracts_are_enforced(mod, stream, rng):
    from hss.emulator import EmulatorError, MemoryFault
    rows, nq, nkv, hd, topk, ratio, bs, first_pos = 2, 24, 2, 256, 4, 4, 16, 40
    q, k_cache, v_cache, table, lists = _attn_case(rng, rows, nq, nkv, hd, topk, ratio, bs, first_pos, 1.0)
    inv = float(np.float32(hd ** -0.5))
    with pytest.raises(EmulatorError, match="grid"):
        with contextlib.ExitStack() as es:
            bufs = [es.enter_context(upload(x, stream)) for x in (q, k_cache, v_cache, table, lists)]
            out = es.enter_context(poisoned(2 * rows * nq * hd, stream))
            _launch(mod, kq.QSA_PREFILL_ATTN_TC, kq.Geometry((rows, nq, 1), (64, 1, 1), 0), stream,
                    *bufs, out, first_pos, topk, ratio, bs, nq, nkv, hd, inv)
    with pytest.raises(EmulatorError, match="covers hd"):
        _run_attn(mod, stream, "tc", q[..., :96], k_cache[..., :96], v_cache[..., :96], table, lists, first_pos,
                  ratio, inv)
    bad = table.copy()   # a page row 0 surely reads (no row read page 0 with p = 1/196)
    bad[lists[0, 0] * ratio // bs] = 10_000
    with pytest.raises(MemoryFault, match="page id"):
        _run_attn(mod, stream, "tc", q, k_cache, v_cache, bad, lists, first_pos, ratio, inv)
    qs = np.ones((3, 4, 128), np.float32)
    with pytest.raises(EmulatorError, match="score_stride"):
        _run_scores(mod, stream, qs, np.ones((40, 128), BF16), 100, 4, 26, 20, tc=True)
