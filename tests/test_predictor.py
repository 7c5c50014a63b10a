"""Tests for hss.predictor and its kernels (docs/design.md §4, §5; bounds of docs/design.md §0).

Every kernel is compared with the staged float64 reference (its inputs are the bf16 values actually
uploaded or read back), on unit-scale and small-scale data, outputs NaN-poisoned before each launch, and
every bound is shown to bite. On the emulator shapes are capped so the file runs in seconds.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import hss.predictor.predictor as hp
from hss import cuda_min as cm
from hss._util import ceil_div
from hss.cuda import _driver
from hss.errors import HssError
from hss.predictor import Predictor, PredictorDims, preflight_a_g, read_k_lr_slot
from hss.reference import predictor as ref

import conftest
from helpers import BF16, assert_bites, assert_close, download, poisoned, upload, violations

ON_GPU = conftest.ON_GPU
SEED = 0xCAFE_F00D
LLAMA = PredictorDims(num_layers=4, num_q_heads=32, num_kv_heads=8, head_dim=128, r=32, block_size=16, max_blocks=64)
MAX_BLOCKS = 4096 if ON_GPU else 48          # blocks per score launch in the hypothesis tests
MAX_ELEMS = 1 << 25 if ON_GPU else 1 << 20   # K_lr elements per score launch (host reference memory)


# -- data --------------------------------------------------------------------------------------
def randn(rng: np.random.Generator, shape: tuple[int, ...], std: float) -> np.ndarray:
    """bf16 N(0, std^2) data with no zeros (zeros hide unwritten outputs and wrong indexing)."""
    x = (rng.standard_normal(shape) * std).astype(np.float32).astype(BF16)
    x[x == 0] = BF16(std)
    return x


def scale_of(kind: str, head_dim: int) -> float:
    return 1.0 if kind == "unit" else 1.0 / math.sqrt(head_dim)


@st.composite
def model_shapes(draw: st.DrawFn) -> dict:
    gqa = draw(st.integers(1, 8))
    nkv = draw(st.integers(1, 8 if ON_GPU else 4))
    return dict(num_q_heads=gqa * nkv, num_kv_heads=nkv, head_dim=draw(st.sampled_from([64, 96, 128, 256])),
                r=draw(st.one_of(st.sampled_from([32, 64, 96, 128]), st.integers(8, 128))),
                block_size=draw(st.one_of(st.sampled_from([16, 32, 64]), st.integers(1, 64))))


def dims_of(shape: dict, num_layers: int = 1, max_blocks: int = 2) -> PredictorDims:
    return PredictorDims(num_layers=num_layers, max_blocks=max_blocks, **shape)


@pytest.fixture
def launches(monkeypatch: pytest.MonkeyPatch) -> list:
    """Records (and forwards) every kernel launch that reaches the driver: the function handles, in order."""
    seen: list = []
    real = _driver.api.cuLaunchKernel

    def counting(func, *args):
        seen.append(int(func))
        return real(func, *args)

    monkeypatch.setattr(_driver.api, "cuLaunchKernel", counting)
    return seen


class Array:
    """A minimal ``__cuda_array_interface__`` holder (bf16 is ``<V2``: the interface has no bf16 typestr)."""

    def __init__(self, buf: cm.DeviceBuffer | int, shape: tuple, typestr: str, readonly: bool = False,
                 stream: int | None = None) -> None:
        ptr = buf if isinstance(buf, int) else buf.ptr
        self.__cuda_array_interface__ = {"shape": shape, "typestr": typestr, "data": (ptr, readonly),
                                         "version": 3, "strides": None, "stream": stream}


# -- PredictorDims and the preflight (pure) ----------------------------------------------------
def test_dims_arithmetic() -> None:
    d = LLAMA
    d.validate()
    assert d.gqa_ratio() == 4
    assert d.per_layer_block_floats() == 8 * 16 * 32
    assert d.slot_bytes() == 8192
    assert d.a_g_bytes() == 4 * 64 * 8 * 16 * 32 * 2
    assert d.p_bytes() == 128 * 32 * 2


@pytest.mark.parametrize("field,value,words", [
    ("num_kv_heads", 6, "multiple of num_kv_heads"), ("r", 0, "r must be >= 1"), ("r", 129, "r (129) must be <= 128"),
    ("head_dim", 257, "head_dim (257) must be <= 256"), ("max_blocks", -1, "max_blocks must be >= 1"),
    ("block_size", 70000, "grid.y")])
def test_dims_validate_rejects(field: str, value: int, words: str) -> None:
    d = PredictorDims(**{**LLAMA.__dict__, field: value})
    with pytest.raises(HssError, match=words.replace("(", r"\(").replace(")", r"\)")):
        d.validate()


@pytest.mark.parametrize("field", ["num_layers", "num_q_heads", "num_kv_heads", "head_dim", "r", "block_size",
                                   "max_blocks"])
@pytest.mark.parametrize("bad", [32.0, float("nan"), True, np.bool_(False), "32", None, np.float32(32)])
def test_dims_types_refused_at_construction(field: str, bad) -> None:
    with pytest.raises(TypeError, match=f"PredictorDims.{field} must be an int"):
        PredictorDims(**{**LLAMA.__dict__, field: bad})


def test_dims_numpy_ints_become_python_ints() -> None:
    """np.int32 fields must not wrap: 32 layers x 65536 blocks x 8 kv heads x 16 tokens x r 64 x 2 bytes is 32 GiB
    (in int32 arithmetic it would wrap to 0)."""
    d = PredictorDims(num_layers=np.int32(32), num_q_heads=np.int32(32), num_kv_heads=np.int32(8),
                      head_dim=np.int64(128), r=np.int32(64), block_size=np.int16(16), max_blocks=np.int32(65536))
    assert all(type(getattr(d, f)) is int for f in d.__dataclass_fields__)
    d.validate()
    assert d.a_g_bytes() == 32 * 65536 * 8 * 16 * 64 * 2 == 34359738368
    assert type(d.a_g_bytes()) is int
    assert d == PredictorDims(32, 32, 8, 128, 64, 16, 65536)
    assert preflight_a_g(d, 40 << 30) == 34359738368
    with pytest.raises(HssError, match="needs 32.00 GiB"):
        preflight_a_g(d, np.int64(8 << 30))


BIG = PredictorDims(num_layers=80, num_q_heads=64, num_kv_heads=8, head_dim=128, r=64, block_size=16,
                    max_blocks=(1 << 20) // 16)   # 80 layers, 1M tokens, r = 64: A_g = 80 GiB


def test_preflight_message() -> None:
    free = 20 << 30
    with pytest.raises(HssError) as info:
        preflight_a_g(BIG, free)
    msg = str(info.value)
    assert "needs 80.00 GiB" in msg and "only 19.00 GiB" in msg and "20.00 GiB free" in msg
    assert ("num_layers (80) × max_blocks (65536) × num_kv_heads (8) × block_size (16) × r (64) × 2 bytes "
            "= 85899345920 bytes") in msg
    for advice in ("r: 64 -> 32", "max_blocks: 65536 -> at most 15564", "num_layers: 80 -> at most 19"):
        assert advice in msg, advice
    assert preflight_a_g(LLAMA, free) == LLAMA.a_g_bytes()
    assert preflight_a_g(LLAMA, LLAMA.a_g_bytes() * 100 // 95 + 100) == LLAMA.a_g_bytes()
    with pytest.raises(HssError, match="no r fits"):
        preflight_a_g(BIG, 1 << 20)
    rank1 = dataclasses.replace(BIG, r=1)
    with pytest.raises(HssError) as info:
        preflight_a_g(rank1, 1 << 20)
    msg = str(info.value)
    assert "r: 1 is already the lowest rank" in msg and "1 -> " not in msg and "halves" not in msg


def test_construction_fails_preflight_before_any_allocation(ctx, monkeypatch: pytest.MonkeyPatch) -> None:
    def forbidden(*a, **k):
        raise AssertionError("allocated or loaded before the preflight")

    monkeypatch.setattr(cm, "mem_info", lambda: (20 << 30, 141 << 30))
    monkeypatch.setattr(hp, "DeviceBuffer", forbidden)
    monkeypatch.setattr(hp, "load_module", forbidden)
    with pytest.raises(HssError, match="needs 80.00 GiB"):
        Predictor(ctx, BIG, SEED)
    with pytest.raises(HssError, match="needs 80.00 GiB"):
        Predictor.new_on_stream(ctx.stream, BIG, SEED)
    with pytest.raises(HssError, match="multiple of num_kv_heads"):
        Predictor(ctx, PredictorDims(**{**LLAMA.__dict__, "num_kv_heads": 6}), SEED)
    with pytest.raises(HssError, match="projection_seed"):
        Predictor(ctx, LLAMA, -1)


def test_lifetime(ctx) -> None:
    pred = Predictor(ctx, LLAMA, SEED)
    assert pred.dims == LLAMA and pred.a_g_dev_ptr % 256 == 0
    assert pred.projection.shape == (128, 32)
    pred.close()
    pred.close()
    assert pred.closed
    with pytest.raises(HssError, match="closed"):
        _ = pred.a_g_dev_ptr
    assert "closed" in repr(pred)
    with Predictor.new_on_stream(ctx.stream, LLAMA, SEED) as p2:
        assert not p2.closed
        assert np.array_equal(p2.projection.view(np.uint16), pred.projection.view(np.uint16))
    assert p2.closed


# -- kernels vs staged references --------------------------------------------------------------
def drop_worst_row(a: np.ndarray, p: np.ndarray, bound_of) -> np.ndarray:
    """P with the row whose single term is most visible against the bound zeroed (one term dropped)."""
    terms = np.abs(a.astype(np.float64))[..., :, None] * np.abs(p.astype(np.float64))  # [..., head_dim, r]
    b = bound_of()
    worst = (terms / b[..., None, :]).reshape(-1, *terms.shape[-2:]).max(axis=(0, 2)).argmax()
    mutated = p.astype(np.float64)
    mutated[worst] = 0.0
    return mutated


@given(shape=model_shapes(), scale=st.sampled_from(["unit", "small"]), seed=st.integers(0, 2**32 - 1))
def test_project_q(ctx, stream, shape: dict, scale: str, seed: int) -> None:
    rng = np.random.default_rng(seed)
    d = dims_of(shape)
    with Predictor(ctx, d, seed) as pred:
        q = randn(rng, (d.num_q_heads, d.head_dim), scale_of(scale, d.head_dim))
        q_dev = upload(q, stream)
        out = poisoned(2 * d.num_q_heads * d.r, stream)
        pred.project_q(ctx, q_dev, out)
        got = download(out, (d.num_q_heads, d.r), BF16, stream)
        want = ref.project_q(q, pred.projection)
        assert_close(got, want, "bf16", (1,), "q_proj")
        mutated = ref.project_q(q, drop_worst_row(q, pred.projection,
                                                  lambda: np.maximum(np.abs(want), 1e-30)))
        assert_bites(got, mutated, "bf16", (1,), "q_proj with one P row dropped")


@given(shape=model_shapes(), scale=st.sampled_from(["unit", "small"]), seed=st.integers(0, 2**32 - 1))
def test_project_kv_block(ctx, stream, shape: dict, scale: str, seed: int) -> None:
    rng = np.random.default_rng(seed)
    d = dims_of(shape, num_layers=2, max_blocks=3)
    with Predictor(ctx, d, seed) as pred:
        page = randn(rng, (d.block_size, d.num_kv_heads, d.head_dim), scale_of(scale, d.head_dim))
        layer, block = int(rng.integers(2)), int(rng.integers(3))
        pred.project_kv_block(ctx, layer, block, upload(page, stream))
        got = read_k_lr_slot(ctx, pred, layer, block)
        want = ref.project_kv_block(page, pred.projection)
        assert_close(got, want, "bf16", (2,), "K_lr slot")
        kt = page.transpose(1, 0, 2)   # [kv head, token, head_dim]: rows of the projection
        mutated = ref.project_kv_block(page, drop_worst_row(kt, pred.projection,
                                                            lambda: np.maximum(np.abs(want), 1e-30)))
        assert_bites(got, mutated, "bf16", (2,), "K_lr with one P row dropped")


@pytest.mark.parametrize("head_dim,r,offset", [(100, 24, 0), (7, 9, 0), (256, 128, 0), (64, 8, 0), (128, 32, 2),
                                             (96, 40, 2)])
def test_projection_odd_shapes_and_alignment(ctx, stream, rng, head_dim: int, r: int, offset: int) -> None:
    """The projections' element-copy staging path: a shape that is not a multiple of 8, or inputs that are
    not 16-byte aligned (``offset`` bytes into their buffers); r = 128 with head_dim 256 stages P in two chunks."""
    d = PredictorDims(num_layers=1, num_q_heads=6, num_kv_heads=3, head_dim=head_dim, r=r, block_size=5, max_blocks=1)
    with Predictor(ctx, d, SEED) as pred:
        q = randn(rng, (6, head_dim), 1.0)
        q_buf = cm.DeviceBuffer(q.nbytes + offset)
        cm.copy_h_to_d_async(q_buf.ptr + offset, q, q.nbytes, stream)
        out = poisoned(2 * 6 * r, stream)
        pred.project_q(ctx, q_buf.ptr + offset, out)
        assert_close(download(out, (6, r), BF16, stream), ref.project_q(q, pred.projection), "bf16", (1,), "q_proj")
        page = randn(rng, (5, 3, head_dim), 1.0)
        k_buf = cm.DeviceBuffer(page.nbytes + offset)
        cm.copy_h_to_d_async(k_buf.ptr + offset, page, page.nbytes, stream)
        pred.project_kv_block(ctx, 0, 0, k_buf.ptr + offset)
        assert_close(read_k_lr_slot(ctx, pred, 0, 0), ref.project_kv_block(page, pred.projection), "bf16", (2,),
                     "K_lr slot")
        q_buf.close()
        k_buf.close()


def score_tolerance(q: np.ndarray, k: np.ndarray, gqa: int, want: np.ndarray) -> np.ndarray:
    """The f32 bound for a max of dots, derived.

    A score is max over dots; max is 1-Lipschitz in the sup norm, so |score error| <= the largest dot
    error. Products of bf16 are exact in f32, and an r-term f32 accumulation (sequential fma, or the
    tensor-core path's blocked sums) errs by at most r * 2^-22 * sum_i |q_i k_i| (two ulps per addition,
    covering the tensor cores' truncating alignment). Both paths meet docs/design.md §0's 1e-4 * max|ref| (max over
    the valid scores of the launch) whenever that cancellation term is smaller; the bound used is the
    larger of the two, per block: 1e-4 * max|ref| + r * 2^-22 * max over the block's dots of sum |q k|.
    """
    n, nkv, bs, r = k.shape
    qa, ka = (np.nan_to_num(np.abs(x.astype(np.float64)), nan=0.0) for x in (q, k))   # NaN dots are skipped
    abs_max = np.zeros(n)
    for h in range(nkv):
        abs_max = np.maximum(abs_max, (ka[:, h] @ qa[h * gqa:(h + 1) * gqa].T).reshape(n, -1).max(axis=1))
    finite = np.isfinite(want)
    rowmax = np.abs(want[finite]).max() if finite.any() else 0.0
    return 1e-4 * rowmax + r * 2.0 ** -22 * abs_max


def drop_argmax_key(q: np.ndarray, k: np.ndarray, gqa: int, want: np.ndarray, tol: np.ndarray,
                    rng: np.random.Generator) -> np.ndarray:
    """The reference with one token's key dropped from the max of the block where that changes most."""
    n, nkv, bs, r = k.shape
    cand = rng.choice(n, size=min(n, 64), replace=False)
    best_gap, best = -1.0, None
    for b in cand:
        if not np.isfinite(want[b]):
            continue
        dots = np.stack([k[b, qh // gqa].astype(np.float64) @ q[qh].astype(np.float64) for qh in range(q.shape[0])])
        qh, t = np.unravel_index(np.nanargmax(dots), dots.shape)
        keep = np.ones_like(dots, dtype=bool)
        keep[(np.arange(q.shape[0]) // gqa) == qh // gqa, t] = False
        rest = dots[keep & ~np.isnan(dots)]
        dropped = rest.max() if rest.size else -np.inf
        gap = (want[b] - dropped) / tol[b]
        if gap > best_gap:
            best_gap, best = gap, (b, dropped)
    mutated = want.copy()
    mutated[best[0]] = best[1]
    return mutated


def check_scores(got: np.ndarray, q: np.ndarray, k: np.ndarray, gqa: int, rng: np.random.Generator,
                 what: str) -> None:
    want = ref.predictor_score(q, k, gqa)
    finite = np.isfinite(want)
    assert np.array_equal(got[~finite], want[~finite].astype(np.float32)), f"{what}: infinite scores differ"
    tol = score_tolerance(q, k, gqa, want)
    assert_close(np.where(finite, got, 0), np.where(finite, want, 0), "f32", (0,), what, valid=finite, tol=tol)
    mutated = drop_argmax_key(q, k, gqa, want, tol, rng)
    both = np.isfinite(mutated) & finite
    bites = not np.array_equal(np.isfinite(mutated), finite) or violations(
        np.where(both, got, 0), np.where(both, mutated, 0), "f32", (0,), valid=both, tol=tol).any()
    assert bites, f"{what}: the bound does not bite (a reference with one key dropped also passes)"


def score_external(ctx, stream, pred: Predictor, q: np.ndarray, k: np.ndarray, offset: int = 0) -> np.ndarray:
    """Score ``k`` (uploaded ``offset`` bytes into its buffer) with ``q``; returns the f32 scores."""
    n = k.shape[0]
    q_dev = upload(q, stream)
    k_buf = cm.DeviceBuffer(k.nbytes + offset)
    cm.copy_h_to_d_async(k_buf.ptr + offset, np.ascontiguousarray(k), k.nbytes, stream)
    out = poisoned(4 * n, stream)
    pred.score_blocks(ctx, q_dev, k_buf.ptr + offset, out, n)
    got = download(out, (n,), np.float32, stream)
    k_buf.close()
    return got


@given(shape=model_shapes(), scale=st.sampled_from(["unit", "small"]), seed=st.integers(0, 2**32 - 1),
       n=st.integers(1, MAX_BLOCKS))
def test_score_blocks(ctx, stream, shape: dict, scale: str, seed: int, n: int) -> None:
    rng = np.random.default_rng(seed)
    d = dims_of(shape)
    n = max(1, min(n, MAX_ELEMS // d.per_layer_block_floats()))
    std = scale_of(scale, d.head_dim)   # q_proj and K_lr of projected data keep the input's scale
    q = randn(rng, (d.num_q_heads, d.r), std)
    k = randn(rng, (n, d.num_kv_heads, d.block_size, d.r), std)
    with Predictor(ctx, d, seed) as pred:
        got = score_external(ctx, stream, pred, q, k)
    check_scores(got, q, k, d.gqa_ratio(), rng, "scores")


# The tensor-core path's shapes (block_size % 16 == 0, r % 32 == 0, gqa <= 8, 16-byte aligned), its
# fallback for the same data at a 2-byte offset, and gqa > 8 (general path).
FAST_SHAPES = [(32, 8, 32, 16), (8, 8, 64, 32), (16, 2, 96, 16), (64, 8, 128, 64), (24, 3, 32, 48),
               (32, 2, 32, 16), (4, 4, 128, 16)]


@pytest.mark.parametrize("nq,nkv,r,bs", FAST_SHAPES)
@pytest.mark.parametrize("offset", [0, 2], ids=["aligned", "misaligned"])
def test_score_fast_path_shapes(ctx, stream, rng, nq: int, nkv: int, r: int, bs: int, offset: int) -> None:
    d = PredictorDims(1, nq, nkv, 128, r, bs, 2)
    n = 1000 if ON_GPU else 9
    for std in (1.0, 1 / math.sqrt(128)):
        q = randn(rng, (nq, r), std)
        k = randn(rng, (n, nkv, bs, r), std)
        with Predictor(ctx, d, SEED) as pred:
            got = score_external(ctx, stream, pred, q, k, offset)
        check_scores(got, q, k, d.gqa_ratio(), rng, f"scores (std {std:.3g}, offset {offset})")


def test_score_nan_semantics(ctx, stream, rng) -> None:
    """NaN dots are skipped; a block whose dots are all NaN scores -inf (docs/design.md §5.3), on both paths."""
    for bs, r in ((16, 32), (5, 24)):
        d = PredictorDims(1, 8, 2, 64, r, bs, 2)
        q = randn(rng, (8, r), 1.0)
        k = randn(rng, (6, 2, bs, r), 1.0)
        k[0] = np.nan                           # every key NaN: -inf
        k[1, 0, 3] = np.nan                     # one key NaN: skipped
        k[2, 1, :, 5] = np.nan                  # every key of kv head 1 NaN: kv head 0 decides
        with Predictor(ctx, d, SEED) as pred:
            got = score_external(ctx, stream, pred, q, k)
        assert got[0] == -np.inf
        assert np.isfinite(got[1:]).all()
        check_scores(got, q, k, 4, rng, f"scores with NaN keys (bs {bs}, r {r})")


# -- A_g semantics -----------------------------------------------------------------------------
SMALL = PredictorDims(num_layers=2, num_q_heads=8, num_kv_heads=2, head_dim=64, r=32, block_size=16, max_blocks=5)


def test_a_g_zeroed_and_unwritten_slots_score_zero(ctx, stream, rng) -> None:
    with Predictor(ctx, SMALL, SEED) as pred:
        assert not read_k_lr_slot(ctx, pred, 1, 4).view(np.uint16).any()
        q = upload(randn(rng, (8, 32), 1.0), stream)
        out = poisoned(4 * 5, stream)
        pred.score_layer(ctx, q, 1, 0, 5, out)
        assert np.array_equal(download(out, (5,), np.float32, stream), np.zeros(5, np.float32))


def test_project_kv_block_writes_only_its_slot(ctx, stream, rng) -> None:
    d = SMALL
    with Predictor(ctx, d, SEED) as pred:
        pages = {}
        for layer in range(d.num_layers):
            for block in range(d.max_blocks):
                pages[layer, block] = randn(rng, (d.block_size, d.num_kv_heads, d.head_dim), 1.0)
                pred.project_kv_block(ctx, layer, block, upload(pages[layer, block], stream))
        before = {key: read_k_lr_slot(ctx, pred, *key) for key in pages}
        new = randn(rng, (d.block_size, d.num_kv_heads, d.head_dim), 1.0)
        pred.project_kv_block_on_stream(stream, 1, 2, upload(new, stream))
        for key, old in before.items():
            now = read_k_lr_slot(stream, pred, *key)
            if key == (1, 2):
                assert_close(now, ref.project_kv_block(new, pred.projection), "bf16", (2,), "rewritten slot")
            else:
                assert np.array_equal(now.view(np.uint16), old.view(np.uint16)), f"slot {key} changed"
                assert_close(now, ref.project_kv_block(pages[key], pred.projection), "bf16", (2,), f"slot {key}")


def test_score_layer_equals_score_blocks_bitwise(ctx, stream, rng) -> None:
    d = SMALL
    with Predictor(ctx, d, SEED) as pred:
        for block in range(d.max_blocks):
            pred.project_kv_block(ctx, 1, block, upload(randn(rng, (16, 2, 64), 1.0), stream))
        q_host = randn(rng, (8, 32), 1.0)
        q = upload(q_host, stream)
        a, b = poisoned(16, stream), poisoned(16, stream)
        pred.score_layer(ctx, q, 1, 1, 4, a)
        pred.score_blocks(ctx, q, pred.slot_ptr(1, 1), b, 4)
        got_a, got_b = download(a, (4,), np.float32, stream), download(b, (4,), np.float32, stream)
        assert np.array_equal(got_a.view(np.uint32), got_b.view(np.uint32))
        k = np.stack([read_k_lr_slot(ctx, pred, 1, blk) for blk in range(1, 5)])
        check_scores(got_a, q_host, k, d.gqa_ratio(), rng, "score_layer")


def test_n_zero_is_a_no_op(ctx, stream, rng, launches: list) -> None:
    with Predictor(ctx, SMALL, SEED) as pred:
        out = poisoned(16, stream)
        q = upload(randn(rng, (8, 32), 1.0), stream)
        pred.score_blocks(ctx, q, pred.a_g_dev_ptr, out, 0)
        pred.score_layer(ctx, q, 0, SMALL.max_blocks, 0, out)
        pred.score_layer_on_stream(stream, q, 1, 0, 0, out)
        assert launches == []
        assert np.isnan(download(out, (4,), np.float32, stream)).all()


# -- errors before any launch ------------------------------------------------------------------
def test_bad_arguments_raise_before_any_launch(ctx, stream, rng, launches: list) -> None:
    d = SMALL
    with Predictor(ctx, d, SEED) as pred:
        q = upload(randn(rng, (8, 64), 1.0), stream)
        q_proj = poisoned(2 * 8 * 32, stream)
        page = upload(randn(rng, (16, 2, 64), 1.0), stream)
        scores = poisoned(4 * 8, stream)
        slot = d.slot_bytes()
        small = cm.DeviceBuffer(8)
        cases = [
            (lambda: pred.project_kv_block(ctx, 2, 0, page), "layer 2 is out of range"),
            (lambda: pred.project_kv_block(ctx, -1, 0, page), "layer -1 is out of range"),
            (lambda: pred.project_kv_block(ctx, 0, 5, page), "block_id 5 is out of range"),
            (lambda: pred.project_kv_block(ctx, 0, 0, 0), "k_block is a null pointer"),
            (lambda: pred.project_kv_block(ctx, 0, 0, small), "k_block holds 8 bytes"),
            (lambda: pred.project_q(ctx, 0, q_proj), "q is a null pointer"),
            (lambda: pred.project_q(ctx, q, 0), "q_proj is a null pointer"),
            (lambda: pred.project_q(ctx, q, q_proj.ptr + 1), "q_proj .* must be 2-byte aligned"),
            (lambda: pred.project_q(ctx, small, q_proj), "q holds 8 bytes"),
            (lambda: pred.score_layer(ctx, q_proj, 2, 0, 1, scores), "layer 2 is out of range"),
            (lambda: pred.score_layer(ctx, q_proj, 0, 3, 3, scores), "outside this layer"),
            (lambda: pred.score_layer(ctx, q_proj, 0, -1, 1, scores), "outside this layer"),
            (lambda: pred.score_layer(ctx, q_proj, 0, 0, 1, 0), "scores_out is a null pointer"),
            (lambda: pred.score_layer(ctx, 0, 0, 0, 1, scores), "q_proj is a null pointer"),
            (lambda: pred.score_layer(ctx, q_proj, 0, 0, 3, small), "scores_out holds 8 bytes"),
            (lambda: pred.score_layer(ctx, q_proj, 0, 0, 1, scores.ptr + 2), "4-byte aligned"),
            (lambda: pred.score_blocks(ctx, q_proj, pred.slot_ptr(1, 3), scores, 3),
             f"k_lr_seq: {3 * slot} bytes at offset {8 * slot} run past the end of its {10 * slot}-byte buffer"),
            (lambda: pred.score_blocks(ctx, q_proj, Array(pred.slot_ptr(1, 3), (3 * slot,), "|u1"), scores, 3),
             r"k_lr_seq \+ n slots runs past the end of A_g: slot 8 \+ 3 > 10 slots"),   # an array says its own size
            (lambda: pred.score_blocks(ctx, q_proj, pred.a_g_dev_ptr + slot // 2, scores, 1), "not the start"),
            (lambda: pred.score_blocks(ctx, q_proj, 0, scores, 1), "k_lr_seq is a null pointer"),
            (lambda: pred.score_blocks(ctx, q_proj, pred.a_g_dev_ptr, scores, -1), "n = -1 must be in 0.."),
            (lambda: pred.score_blocks(ctx, q_proj, pred.a_g_dev_ptr, pred.slot_ptr(1, 0), 1), "overlaps A_g"),
            (lambda: read_k_lr_slot(ctx, pred, 0, 5), "block 5 is out of range"),
            (lambda: pred.score_layer_on_stream(stream, q_proj, 0, 0, 1.0, scores), "n must be an int"),
        ]
        for call, words in cases:
            with pytest.raises((HssError, TypeError), match=words):
                call()
        assert launches == []
        assert np.isnan(download(q_proj, (8, 32), BF16, stream).astype(np.float32)).all()
        assert np.isnan(download(scores, (8,), np.float32, stream)).all()
        assert not read_k_lr_slot(ctx, pred, 0, 0).view(np.uint16).any()
        small.close()
    with pytest.raises(HssError, match="closed"):
        pred.score_layer(ctx, q_proj, 0, 0, 1, scores)


BAD_INTS = [1.0, float("nan"), True, np.bool_(True), "1", None, np.float64(1)]


@pytest.mark.parametrize("bad", BAD_INTS, ids=repr)
def test_non_int_arguments_are_type_errors(ctx, stream, launches: list, bad) -> None:
    """Every int parameter (and every pointer and stream) refuses float, NaN, bool, str, None: TypeError naming it."""
    with Predictor(ctx, SMALL, SEED) as pred:
        q, q_proj = poisoned(2 * 8 * 64, stream), poisoned(2 * 8 * 32, stream)
        page, scores = poisoned(2 * 16 * 2 * 64, stream), poisoned(4 * 8, stream)
        cases = [
            ("layer", lambda: pred.project_kv_block(stream, bad, 0, page)),
            ("block_id", lambda: pred.project_kv_block_on_stream(stream, 0, bad, page)),
            ("layer", lambda: pred.score_layer(stream, q_proj, bad, 0, 1, scores)),
            ("first_block", lambda: pred.score_layer(stream, q_proj, 0, bad, 1, scores)),
            ("n", lambda: pred.score_layer_on_stream(stream, q_proj, 0, 0, bad, scores)),
            ("n", lambda: pred.score_blocks(stream, q_proj, pred.a_g_dev_ptr, scores, bad)),
            ("layer", lambda: pred.slot_ptr(bad, 0)),
            ("block", lambda: pred.read_k_lr_slot(stream, 0, bad)),
            ("q", lambda: pred.project_q(stream, bad, q_proj)),
            ("q_proj", lambda: pred.project_q_on_stream(stream, q, bad)),
            ("k_block", lambda: pred.project_kv_block(stream, 0, 0, bad)),
            ("q_proj", lambda: pred.score_layer(stream, bad, 0, 0, 1, scores)),
            ("scores_out", lambda: pred.score_layer(stream, q_proj, 0, 0, 1, bad)),
            ("k_lr_seq", lambda: pred.score_blocks(stream, q_proj, bad, scores, 1)),
            ("stream", lambda: pred.project_q(bad, q, q_proj)),
            ("stream", lambda: pred.score_layer_on_stream(bad, q_proj, 0, 0, 1, scores)),
        ]
        for name, call in cases:
            with pytest.raises(TypeError, match=rf"^{name}\b"):
                call()
        assert launches == []
        with pytest.raises(TypeError, match="projection_seed must be an int"):
            Predictor(ctx, SMALL, bad)
        assert np.isnan(download(q_proj, (8, 32), BF16, stream).astype(np.float32)).all()
        assert np.isnan(download(scores, (8,), np.float32, stream)).all()
        for buf in (q, q_proj, page, scores):
            buf.close()


def test_bad_device_arrays_raise_before_any_launch(ctx, stream, launches: list) -> None:
    """Closed buffers, too-small buffers (DeviceBuffer, DeviceView, CUDA array interface, an address inside a
    live buffer), wrong dtypes and read-only outputs are refused by name before anything is queued."""
    d = SMALL
    slot = d.slot_bytes()
    with Predictor(ctx, d, SEED) as pred:
        q, q_proj = poisoned(2 * 8 * 64, stream), poisoned(2 * 8 * 32, stream)
        page, scores = poisoned(2 * 16 * 2 * 64, stream), poisoned(4 * 8, stream)
        k_lr = poisoned(2 * slot, stream)
        closed, small = cm.DeviceBuffer(1 << 16), cm.DeviceBuffer(16)
        closed_view = closed.view("bf16")
        closed.close()
        cases = [
            # closed buffers and views of them
            (lambda: pred.project_q(stream, closed, q_proj), "q is a closed DeviceBuffer"),
            (lambda: pred.project_q(stream, q, closed_view), "q_proj is a view of a closed DeviceBuffer"),
            (lambda: pred.project_kv_block(stream, 0, 0, closed), "k_block is a closed"),
            (lambda: pred.score_layer(stream, closed, 0, 0, 1, scores), "q_proj is a closed"),
            (lambda: pred.score_layer(stream, q_proj, 0, 0, 1, closed), "scores_out is a closed"),
            (lambda: pred.score_blocks(stream, q_proj, closed_view, scores, 1), "k_lr_seq is a view of a closed"),
            # too small
            (lambda: pred.project_q(stream, q.view("bf16", (8, 63)), q_proj), "q holds 1008 bytes but 1024 are needed"),
            (lambda: pred.project_q(stream, q, Array(q_proj, (8, 31), "<V2")), "q_proj holds 496 bytes but 512"),
            (lambda: pred.project_q(stream, small.ptr, q_proj), "q: 1024 bytes at offset 0 run past the end of its "
                                                                 "16-byte buffer"),
            (lambda: pred.project_kv_block(stream, 1, 4, page.view("bf16", (16, 2, 63))), "k_block holds 4032 bytes"),
            (lambda: pred.project_kv_block(stream, 1, 4, Array(page, (15, 2, 64), "<V2")), "k_block holds 3840"),
            (lambda: pred.score_layer(stream, Array(q_proj, (8, 16), "<V2"), 0, 0, 1, scores), "q_proj holds 256"),
            (lambda: pred.score_layer(stream, q_proj, 0, 0, 5, scores.view("f32", (4,))),
             "scores_out holds 16 bytes but 20 are needed"),
            (lambda: pred.score_layer(stream, q_proj, 0, 0, 5, small), "scores_out holds 16 bytes but 20"),
            (lambda: pred.score_blocks(stream, q_proj, k_lr, scores, 3), f"k_lr_seq holds {2 * slot} bytes but "
                                                                         f"{3 * slot} are needed"),
            (lambda: pred.score_blocks(stream, q_proj, k_lr.ptr + slot, scores, 2), "k_lr_seq: .* run past the end"),
            # wrong dtypes
            (lambda: pred.project_q(stream, q.view("f32"), q_proj), "q holds f32 but bf16 is needed"),
            (lambda: pred.project_q(stream, q, q_proj.view("f16")), "q_proj holds f16 but bf16 is needed"),
            (lambda: pred.project_kv_block(stream, 0, 0, Array(page, (1024,), "<f4")), "k_block holds f32 but bf16"),
            (lambda: pred.score_layer(stream, q_proj.view("i32"), 0, 0, 1, scores), "q_proj holds i32 but bf16"),
            (lambda: pred.score_layer(stream, q_proj, 0, 0, 1, scores.view("bf16")), "scores_out holds bf16 but f32"),
            (lambda: pred.score_blocks(stream, q_proj, k_lr.view("f32"), scores, 1), "k_lr_seq holds f32 but bf16"),
            # read-only outputs
            (lambda: pred.project_q(stream, q, Array(q_proj, (8, 32), "<V2", readonly=True)), "q_proj is read-only"),
            (lambda: pred.score_layer(stream, q_proj, 0, 0, 1, Array(scores, (8,), "<f4", readonly=True)),
             "scores_out is read-only"),
        ]
        for call, words in cases:
            with pytest.raises(HssError, match=words):
                call()
        assert launches == []
        assert np.isnan(download(q_proj, (8, 32), BF16, stream).astype(np.float32)).all()
        assert np.isnan(download(scores, (8,), np.float32, stream)).all()
        # the controls: read-only inputs, raw-byte buffers and typed views of the right dtype are fine
        pred.project_q(stream, Array(q, (8, 64), "<V2", readonly=True), q_proj.view("bf16", (8, 32)))
        pred.score_layer(stream, Array(q_proj, (8, 32), "<V2", readonly=True), 0, 0, 2, scores.view("f32", (2,)))
        pred.score_blocks(stream, q_proj, k_lr.view("bf16"), scores, 2)
        assert len(launches) == 3
        for buf in (q, q_proj, page, scores, k_lr, small):
            buf.close()


def test_closed_predictor_refuses_every_call(ctx, stream, launches: list) -> None:
    pred = Predictor(ctx, SMALL, SEED)
    q, q_proj = poisoned(2 * 8 * 64, stream), poisoned(2 * 8 * 32, stream)
    page, scores = poisoned(2 * 16 * 2 * 64, stream), poisoned(4 * 8, stream)
    a_g = pred.a_g_dev_ptr
    pred.close()
    for call in (lambda: pred.project_q(ctx, q, q_proj), lambda: pred.project_q_on_stream(stream, q, q_proj),
                 lambda: pred.project_kv_block(ctx, 0, 0, page),
                 lambda: pred.project_kv_block_on_stream(stream, 0, 0, page),
                 lambda: pred.score_blocks(ctx, q_proj, a_g, scores, 1),
                 lambda: pred.score_layer(ctx, q_proj, 0, 0, 1, scores),
                 lambda: pred.score_layer_on_stream(stream, q_proj, 0, 0, 0, scores), lambda: pred.slot_ptr(0, 0),
                 lambda: read_k_lr_slot(ctx, pred, 0, 0), lambda: pred.a_g_dev_ptr):
        with pytest.raises(HssError, match="this Predictor is closed"):
            call()
    assert launches == []
    for buf in (q, q_proj, page, scores):
        buf.close()


def test_stream_forms_and_the_two_names(ctx, stream, rng) -> None:
    """``project_q(ctx, ...)`` and ``project_q_on_stream(stream, ...)`` are one method (likewise the others); any
    stream form works in either; the constructor needs a CudaCtx (new_on_stream takes a stream)."""
    for a, b in (("project_q", "project_q_on_stream"), ("project_kv_block", "project_kv_block_on_stream"),
                 ("score_blocks", "score_blocks_on_stream"), ("score_layer", "score_layer_on_stream")):
        assert getattr(Predictor, a) is getattr(Predictor, b)
    with pytest.raises(TypeError, match="ctx must be a CudaCtx"):
        Predictor(ctx.stream, SMALL, SEED)
    with cm.CudaStream(ctx) as s, Predictor(ctx, SMALL, SEED) as pred:
        q_host = randn(rng, (8, 64), 1.0)
        q = upload(q_host, stream)
        outs = [poisoned(2 * 8 * 32, stream) for _ in range(3)]
        cm.stream_sync(stream)
        pred.project_q(ctx, q, outs[0])
        pred.project_q(s, q, outs[1])
        pred.project_q_on_stream(s.handle, q, outs[2])
        got = [download(o, (8, 32), BF16, h).view(np.uint16) for o, h in zip(outs, (stream, s.handle, s.handle))]
        assert np.array_equal(got[0], got[1]) and np.array_equal(got[0], got[2])
        with pytest.raises(HssError, match="stream = -1 is not a stream handle"):
            pred.project_q(-1, q, outs[0])
        for b in (q, *outs):
            b.close()


def test_pointer_kinds(ctx, stream, rng) -> None:
    """Streams and pointers may be ints, CudaStream / DeviceBuffer, or protocol objects."""

    with cm.CudaStream(ctx) as s, Predictor.new_on_stream(s, SMALL, SEED) as pred:
        q_host = randn(rng, (8, 64), 1.0)
        q = upload(q_host, s.handle)
        out = poisoned(2 * 8 * 32, s.handle)
        pred.project_q_on_stream(s, Array(q, (8, 64), "<V2"), Array(out, (8, 32), "<V2"))
        got = download(out, (8, 32), BF16, s.handle)
        assert_close(got, ref.project_q(q_host, pred.projection), "bf16", (1,), "q_proj")
        with pytest.raises(HssError, match="q holds 64 bytes"):
            pred.project_q_on_stream(s, Array(q, (4, 8), "<V2"), out)
        with pytest.raises(HssError, match="q holds i16 but bf16 is needed"):   # a typed array must say bf16
            pred.project_q_on_stream(s, Array(q, (8, 64), "<i2"), out)
        cm.memset_d8_async(out, 0xFF, out.bytes, s)
        pred.project_q(s, q.view("bf16", (8, 64)), out.view("bf16"))           # typed views; any stream form
        assert np.array_equal(download(out, (8, 32), BF16, s.handle).view(np.uint16), got.view(np.uint16))


def test_array_interface_streams_are_ordered_before_the_call(ctx, stream, rng, monkeypatch) -> None:
    """An input's ``__cuda_array_interface__`` stream is ordered before the call's stream (an event wait)."""
    waits: list = []
    real = _driver.api.cuStreamWaitEvent

    def wait(consumer, event, flags):
        waits.append(int(consumer))
        return real(consumer, event, flags)

    monkeypatch.setattr(_driver.api, "cuStreamWaitEvent", wait)
    with cm.CudaStream(ctx) as producer, Predictor(ctx, SMALL, SEED) as pred:
        q_host = randn(rng, (8, 64), 1.0)
        q, out = upload(q_host, producer.handle), poisoned(2 * 8 * 32, stream)
        cm.stream_sync(stream)
        pred.project_q(stream, Array(q, (8, 64), "<V2", stream=producer.handle), out)
        assert waits == [stream]
        assert_close(download(out, (8, 32), BF16, stream), ref.project_q(q_host, pred.projection), "bf16", (1,),
                     "q_proj after a stream join")
        pred.score_layer(stream, Array(out, (8, 32), "<V2", stream=stream), 0, 0, 1, poisoned(4, stream))
        assert waits == [stream]   # the same stream: nothing to order
        q.close()
        out.close()


# -- the original's parity test (docs/design.md §5.5), recorded and asserted -----------------------------
def test_original_parity_tolerances(ctx, stream, record_property) -> None:
    d = LLAMA
    rng = np.random.default_rng(SEED)
    std = 1 / math.sqrt(128)
    with Predictor(ctx, d, SEED) as pred:
        q = randn(rng, (32, 128), std)
        q_proj = poisoned(2 * 32 * 32, stream)
        pred.project_q(ctx, upload(q, stream), q_proj)
        got_q = download(q_proj, (32, 32), BF16, stream).astype(np.float64)
        q_diff = np.abs(got_q - ref.project_q(q, pred.projection).astype(np.float32).astype(BF16)).max()
        page = randn(rng, (16, 8, 128), std)
        pred.project_kv_block(ctx, 1, 3, upload(page, stream))
        kv_want = ref.project_kv_block(page, pred.projection).astype(np.float32).astype(BF16).astype(np.float64)
        kv_diff = np.abs(read_k_lr_slot(ctx, pred, 1, 3).astype(np.float64) - kv_want).max()
        qp = randn(rng, (32, 32), std)
        k = randn(rng, (16, 8, 16, 32), std)
        got = score_external(ctx, stream, pred, qp, k)
        want = ref.predictor_score(qp, k, 4)
        score_rel = np.abs(got - want).max() / np.abs(want).max()
    record_property("parity_q_max_abs", float(q_diff))
    record_property("parity_kv_max_abs", float(kv_diff))
    record_property("parity_score_rel", float(score_rel))
    print(f"original parity: q {q_diff:.3g}, kv {kv_diff:.3g}, score rel {score_rel:.3g} (all must be < 5e-2)")
    assert q_diff < 5e-2 and kv_diff < 5e-2 and score_rel < 5e-2


# -- docs/design.md §17.5: a projection per layer and kv head ----------------------------------------------------------
def layered_projection(rng: np.random.Generator, d: PredictorDims) -> np.ndarray:
    """A random ``[num_layers, num_kv_heads, head_dim, r]`` bf16 projection (N(0, 1/head_dim), no zeros)."""
    return randn(rng, (d.num_layers, d.num_kv_heads, d.head_dim, d.r), 1 / math.sqrt(d.head_dim))


def seeded_everywhere(d: PredictorDims, seed: int) -> np.ndarray:
    """The seeded P repeated for every layer and kv head: a layered projection that must give the default's bits."""
    from hss.predictor.projection import PredictorShape, build_projection
    p = build_projection(PredictorShape(d.head_dim, d.r), seed)
    return np.ascontiguousarray(np.broadcast_to(p, (d.num_layers, d.num_kv_heads, d.head_dim, d.r)))


def drop_worst_row_of(a: np.ndarray, p: np.ndarray, head: int, bound_of) -> np.ndarray:
    """The layered P ``[nkv, head_dim, r]`` with the row of matrix ``head`` whose term is most visible zeroed."""
    mutated = p.astype(np.float64)
    mutated[head] = drop_worst_row(a, p[head], bound_of)
    return mutated


@given(shape=model_shapes(), scale=st.sampled_from(["unit", "small"]), seed=st.integers(0, 2**32 - 1))
def test_project_q_layered(ctx, stream, shape: dict, scale: str, seed: int) -> None:
    """q head h of layer l goes through P[l, h // gqa_ratio]: staged reference, bf16 bound, one row dropped bites."""
    rng = np.random.default_rng(seed)
    d = dims_of(shape, num_layers=3)
    proj = layered_projection(rng, d)
    with Predictor(ctx, d, projection=proj) as pred:
        assert pred.layered and pred.projection.shape == proj.shape
        q = randn(rng, (d.num_q_heads, d.head_dim), scale_of(scale, d.head_dim))
        q_dev = upload(q, stream)
        layer = int(rng.integers(3))
        out = poisoned(2 * d.num_q_heads * d.r, stream)
        pred.project_q(ctx, q_dev, out, layer=layer)
        got = download(out, (d.num_q_heads, d.r), BF16, stream)
        want = ref.project_q(q, proj[layer])
        assert_close(got, want, "bf16", (1,), "q_proj (layered)")
        head = int(rng.integers(d.num_kv_heads))
        rows = slice(head * d.gqa_ratio(), (head + 1) * d.gqa_ratio())
        mutated = ref.project_q(q, drop_worst_row_of(q[rows], proj[layer], head,
                                                     lambda: np.maximum(np.abs(want[rows]), 1e-30)))
        assert_bites(got, mutated, "bf16", (1,), "q_proj with one row of one kv head's P dropped")
        other = (layer + 1) % 3   # another layer's matrices give other values
        assert_bites(got, ref.project_q(q, proj[other]), "bf16", (1,), "q_proj through another layer's P")


@given(shape=model_shapes(), scale=st.sampled_from(["unit", "small"]), seed=st.integers(0, 2**32 - 1))
def test_project_kv_block_layered(ctx, stream, shape: dict, scale: str, seed: int) -> None:
    """The keys of kv head j of layer l go through P[l, j], written to that layer's slot only."""
    rng = np.random.default_rng(seed)
    d = dims_of(shape, num_layers=2, max_blocks=3)
    proj = layered_projection(rng, d)
    with Predictor(ctx, d, projection=proj) as pred:
        page = randn(rng, (d.block_size, d.num_kv_heads, d.head_dim), scale_of(scale, d.head_dim))
        layer, block = int(rng.integers(2)), int(rng.integers(3))
        pred.project_kv_block(ctx, layer, block, upload(page, stream))
        got = read_k_lr_slot(ctx, pred, layer, block)
        want = ref.project_kv_block(page, proj[layer])
        assert_close(got, want, "bf16", (2,), "K_lr slot (layered)")
        head = int(rng.integers(d.num_kv_heads))
        kt = page.transpose(1, 0, 2)[head]
        mutated = ref.project_kv_block(page, drop_worst_row_of(kt, proj[layer], head,
                                                               lambda: np.maximum(np.abs(want[head]), 1e-30)))
        assert_bites(got, mutated, "bf16", (2,), "K_lr with one row of one kv head's P dropped")
        assert not read_k_lr_slot(ctx, pred, 1 - layer, block).view(np.uint16).any()


@pytest.mark.parametrize("shape", [
    dict(num_q_heads=9, num_kv_heads=3, head_dim=64, r=8, block_size=16),      # SmolLM2, r 8: 3 heads per CTA
    dict(num_q_heads=32, num_kv_heads=8, head_dim=128, r=32, block_size=16),   # Llama-like
    dict(num_q_heads=6, num_kv_heads=3, head_dim=100, r=24, block_size=5),     # element-copy staging
    dict(num_q_heads=4, num_kv_heads=1, head_dim=256, r=128, block_size=16),   # P staged in two chunks
    dict(num_q_heads=7, num_kv_heads=7, head_dim=7, r=9, block_size=3)])       # gqa 1, odd everything
def test_seeded_projection_everywhere_gives_the_default_bits(ctx, stream, rng, shape: dict) -> None:
    """docs/design.md §17.5: a layered projection whose every matrix is the seeded P gives the default's bits, for
    project_q (any layer), project_kv_block and the scores (the kernels run the same fma chain per output; only the
    matrix addressing and the q heads per CTA differ)."""
    d = dims_of(shape, num_layers=3, max_blocks=4)
    page = randn(rng, (4, d.block_size, d.num_kv_heads, d.head_dim), 1.0)
    q = randn(rng, (d.num_q_heads, d.head_dim), 1.0)
    got = []
    for kw in (dict(projection_seed=SEED), dict(projection=seeded_everywhere(d, SEED))):
        with Predictor(ctx, d, **kw) as pred:
            k_dev, q_dev = upload(page, stream), upload(q, stream)
            for b in range(4):
                pred.project_kv_block(ctx, 2, b, k_dev.ptr + b * page[0].nbytes)
            q_proj = poisoned(2 * d.num_q_heads * d.r, stream)
            pred.project_q(ctx, q_dev, q_proj, layer=2)
            scores = poisoned(16, stream)
            pred.score_layer(ctx, q_proj, 2, 0, 4, scores)
            got.append((download(q_proj, (d.num_q_heads, d.r), BF16, stream).view(np.uint16),
                        np.stack([read_k_lr_slot(ctx, pred, 2, b) for b in range(4)]).view(np.uint16),
                        download(scores, (4,), np.float32, stream).view(np.uint32)))
    for a, b, what in zip(got[0], got[1], ("q_proj", "K_lr", "scores"), strict=True):
        assert np.array_equal(a, b), f"{what}: the seeded P everywhere differs from the default"
    assert_close(got[0][0].view(BF16), ref.project_q(q, seeded_everywhere(d, SEED)[2]), "bf16", (1,), "q_proj")


def test_project_q_layer_keyword(ctx, stream, rng, launches: list) -> None:
    """The seeded P takes project_q with or without layer= (checked when given); a layered one needs it."""
    d = SMALL
    q_host = randn(rng, (8, 64), 1.0)
    q = upload(q_host, stream)
    with Predictor(ctx, d, SEED) as pred:
        outs = [poisoned(2 * 8 * 32, stream) for _ in range(2)]
        pred.project_q(ctx, q, outs[0])
        pred.project_q(ctx, q, outs[1], layer=1)
        a, b = (download(o, (8, 32), BF16, stream).view(np.uint16) for o in outs)
        assert np.array_equal(a, b) and not pred.layered
        assert np.array_equal(pred.projection_of(1, 1).view(np.uint16), pred.projection.view(np.uint16))
        with pytest.raises(HssError, match="layer 2 is out of range"):
            pred.project_q(ctx, q, outs[0], layer=2)
    proj = layered_projection(rng, d)
    with Predictor(ctx, d, projection=proj) as pred:
        assert np.array_equal(pred.projection_of(1, 0).view(np.uint16), proj[1, 0].view(np.uint16))
        before = len(launches)
        out = poisoned(2 * 8 * 32, stream)
        for call, err, words in [
                (lambda: pred.project_q(ctx, q, out), HssError, "per-layer projection; pass layer="),
                (lambda: pred.project_q_on_stream(stream, q, out, layer=-1), HssError, "layer -1 is out of range"),
                (lambda: pred.project_q(ctx, q, out, layer=1.0), TypeError, "layer must be an int"),
                (lambda: pred.projection_of(0, 2), HssError, "kv_head 2 is out of range")]:
            with pytest.raises(err, match=words):
                call()
        assert len(launches) == before
        assert np.isnan(download(out, (8, 32), BF16, stream).astype(np.float32)).all()
        pred.project_q(ctx, q, out, layer=np.int64(1))
        assert_close(download(out, (8, 32), BF16, stream), ref.project_q(q_host, proj[1]), "bf16", (1,), "q_proj")


def test_bad_projection_raises_before_any_allocation(ctx, monkeypatch: pytest.MonkeyPatch, rng) -> None:
    """A projection of the wrong type, dtype, shape or with NaN is refused by name, with the fix, before anything is
    allocated or loaded; so are both a seed and a projection, and a bad head_temperature."""
    def forbidden(*a, **k):
        raise AssertionError("allocated or loaded before the arguments were checked")

    monkeypatch.setattr(hp, "DeviceBuffer", forbidden)
    monkeypatch.setattr(hp, "load_module", forbidden)
    d = SMALL
    good = layered_projection(rng, d)
    nan = good.copy()
    nan[1, 0, 3, 4] = np.nan
    cases = [
        (dict(projection=good.astype(np.float32)), TypeError, r"projection must hold bfloat16, got float32; round it "
                                                             r"with projection.astype\(ml_dtypes.bfloat16\)"),
        (dict(projection=good.tolist()), TypeError, "projection must be a numpy array of ml_dtypes.bfloat16"),
        (dict(projection=good[:1]), HssError, r"projection has shape \(1, 2, 64, 32\); these dims need \[num_layers, "
                                              r"num_kv_heads, head_dim, r\] = \[2, 2, 64, 32\]"),
        (dict(projection=good[..., :16]), HssError, r"\[2, 2, 64, 32\]"),
        (dict(projection=good[0, 0]), HssError, r"has shape \(64, 32\)"),
        (dict(projection=nan), HssError, "projection holds NaN or inf"),
        (dict(projection_seed=SEED, projection=good), HssError, "not both"),
        (dict(projection_seed=SEED, head_temperature=0.0), HssError, "head_temperature = 0.0 must be a positive"),
        (dict(projection_seed=SEED, head_temperature=-8.0), HssError, "must be a positive"),
        (dict(projection_seed=SEED, head_temperature=1e-300), HssError, "must be a positive"),
        (dict(projection_seed=SEED, head_temperature=float("nan")), HssError, "head_temperature = nan must be finite"),
        (dict(projection_seed=SEED, head_temperature="8"), TypeError, "head_temperature must be a number"),
        (dict(projection_seed=SEED, head_temperature=True), TypeError, "head_temperature must be a number"),
    ]
    for kw, err, words in cases:
        with pytest.raises(err, match=words):
            Predictor(ctx, d, **kw)
        with pytest.raises(err, match=words):
            Predictor.new_on_stream(ctx.stream, d, **kw)
    assert good.flags.writeable   # the caller's array is copied, never frozen


def test_projection_is_copied_at_construction(ctx, stream, rng) -> None:
    """The Predictor keeps its own read-only copy: changing the caller's array afterwards changes nothing."""
    d = SMALL
    proj = layered_projection(rng, d)
    keep = proj.copy()
    with Predictor(ctx, d, projection=proj) as pred:
        proj[:] = BF16(1.0)
        assert np.array_equal(pred.projection.view(np.uint16), keep.view(np.uint16))
        assert not pred.projection.flags.writeable
        q = randn(rng, (8, 64), 1.0)
        out = poisoned(2 * 8 * 32, stream)
        pred.project_q(ctx, upload(q, stream), out, layer=0)
        assert_close(download(out, (8, 32), BF16, stream), ref.project_q(q, keep[0]), "bf16", (1,), "q_proj")


# -- docs/design.md §17.5: per-head normalised scores (head_temperature) -----------------------------------------------
LOG2E = math.log2(math.e)


def heads_tolerance(q: np.ndarray, k: np.ndarray, gqa: int, want: np.ndarray) -> np.ndarray:
    """The per-(block, head) bound of predictor_score_heads, derived as score_tolerance's: 1e-4 * max|ref| over the
    launch's finite entries + r * 2^-22 * the largest sum |q k| among that entry's dots."""
    n, nkv, bs, r = k.shape
    qa, ka = (np.nan_to_num(np.abs(x.astype(np.float64)), nan=0.0) for x in (q, k))
    abs_max = np.empty(want.shape)
    for h in range(nkv):
        cols = slice(h * gqa, (h + 1) * gqa)
        abs_max[:, cols] = (ka[:, h] @ qa[cols].T).max(axis=1)
    finite = np.isfinite(want)
    rowmax = np.abs(want[finite]).max() if finite.any() else 0.0
    return 1e-4 * rowmax + r * 2.0 ** -22 * abs_max


def launch_heads(ctx, stream, q: np.ndarray, k: np.ndarray, gqa: int) -> np.ndarray:
    """predictor_score_heads launched directly (one warp per block) into a poisoned [n, nq] f32 output."""
    from hss.cuda.ptx import load_module
    from hss.decls.predictor import PREDICTOR_SCORE_HEADS
    n, nkv, bs, r = k.shape
    nq = q.shape[0]
    with load_module("predictor_score", ctx) as mod:
        q_dev, k_dev, out = upload(q, stream), upload(k, stream), poisoned(4 * n * nq, stream)
        cm.launch_kernel(mod.function("predictor_score_heads"), (n, 1, 1), (32, 1, 1), 0, stream,
                         PREDICTOR_SCORE_HEADS.pack(q_dev, k_dev, out, nq, nkv, bs, r, gqa, n))
        return download(out, (n, nq), np.float32, stream)


def drop_best_key_heads(q: np.ndarray, k: np.ndarray, gqa: int, want: np.ndarray, tol: np.ndarray) -> np.ndarray:
    """``want`` with one entry's deciding key dropped: the entry whose best dot leads its runner-up by the most."""
    best_gap, pick = -1.0, None
    for b in range(k.shape[0]):
        for h in range(q.shape[0]):
            dots = k[b, h // gqa].astype(np.float64) @ q[h].astype(np.float64)
            dots = np.sort(dots[~np.isnan(dots)])[::-1]
            if not dots.size:
                continue
            second = dots[1] if dots.size > 1 else -np.inf
            gap = (dots[0] - second) / tol[b, h]
            if gap > best_gap:
                best_gap, pick = gap, (b, h, second)
    mutated = want.copy()
    mutated[pick[0], pick[1]] = pick[2]
    return mutated


@given(shape=model_shapes(), scale=st.sampled_from(["unit", "small"]), seed=st.integers(0, 2**32 - 1),
       n=st.integers(1, 40), nan_keys=st.booleans())
def test_score_heads_kernel(ctx, stream, shape: dict, scale: str, seed: int, n: int, nan_keys: bool) -> None:
    """predictor_score_heads against ref.predictor_score_heads (NaN keys skipped, a head left with none: -inf)."""
    rng = np.random.default_rng(seed)
    d = dims_of(shape)
    n = max(1, min(n, MAX_ELEMS // d.per_layer_block_floats()))
    std = scale_of(scale, d.head_dim)
    q = randn(rng, (d.num_q_heads, d.r), std)
    k = randn(rng, (n, d.num_kv_heads, d.block_size, d.r), std)
    if nan_keys:
        k[rng.integers(n), rng.integers(d.num_kv_heads), rng.integers(d.block_size)] = np.nan   # one key skipped
        if n > 1:
            k[rng.integers(n), rng.integers(d.num_kv_heads)] = np.nan                             # a head's whole page
    got = launch_heads(ctx, stream, q, k, d.gqa_ratio())
    want = ref.predictor_score_heads(q, k, d.gqa_ratio())
    finite = np.isfinite(want)
    assert np.array_equal(got[~finite], want[~finite].astype(np.float32)), "infinite head scores differ"
    tol = heads_tolerance(q, k, d.gqa_ratio(), want)
    assert_close(np.where(finite, got, 0), np.where(finite, want, 0), "f32", (0, 1), "head scores", valid=finite,
                 tol=tol)
    assert np.array_equal(np.fmax.reduce(want, axis=1, initial=-np.inf), ref.predictor_score(q, k, d.gqa_ratio()))
    if not finite.any():   # n = nkv = block_size = 1 with its one key NaN: all -inf, compared exactly above
        return
    # the bound bites: drop the key that decides the entry with the widest gap (in bounds) to its runner-up
    mutated = drop_best_key_heads(q, k, d.gqa_ratio(), want, tol)
    both = np.isfinite(mutated) & finite
    bites = not np.array_equal(np.isfinite(mutated), finite) or violations(
        np.where(both, got, 0), np.where(both, mutated, 0), "f32", (0, 1), valid=both, tol=tol).any()
    assert bites, "head scores: the bound does not bite (a reference with one key dropped also passes)"


def launch_head_max_and_combine(ctx, stream, hs: np.ndarray, best: np.ndarray | None,
                                exp2_scale: float) -> tuple[np.ndarray, np.ndarray]:
    """predictor_head_max then predictor_head_combine launched directly; ``best`` overrides the max kernel's
    output as the combine's input when given. Returns (head_max, scores)."""
    from hss.cuda.ptx import load_module
    from hss.decls.predictor import HEAD_THREADS, PREDICTOR_HEAD_COMBINE, PREDICTOR_HEAD_MAX
    n, nq = hs.shape
    with load_module("predictor_score", ctx) as mod:
        hs_dev, m_dev, out = upload(hs, stream), poisoned(4 * nq, stream), poisoned(4 * n, stream)
        cm.launch_kernel(mod.function("predictor_head_max"), (nq, 1, 1), (HEAD_THREADS, 1, 1), 0, stream,
                         PREDICTOR_HEAD_MAX.pack(hs_dev, m_dev, nq, n))
        m = download(m_dev, (nq,), np.float32, stream)
        if best is not None:
            cm.copy_h_to_d_async(m_dev, np.ascontiguousarray(best, np.float32), 4 * nq, stream)
        cm.launch_kernel(mod.function("predictor_head_combine"), (ceil_div(n, HEAD_THREADS), 1, 1),
                         (HEAD_THREADS, 1, 1), 0, stream,
                         PREDICTOR_HEAD_COMBINE.pack(hs_dev, m_dev, out, nq, n, exp2_scale))
        return m, download(out, (n,), np.float32, stream)


@given(n=st.integers(1, 700), nq=st.integers(1, 64), spread=st.sampled_from([0.5, 4.0, 40.0]),
       scale=st.floats(0.05, 2.0), seed=st.integers(0, 2**32 - 1), holes=st.booleans())
def test_head_max_and_combine_kernels(ctx, stream, n: int, nq: int, spread: float, scale: float, seed: int,
                                      holes: bool) -> None:
    """predictor_head_max equals the reference bit for bit (a max is exact); predictor_head_combine meets docs/design.md
    §0's f32 rule, 1e-4 * max|ref|, against the float64 reference from the max kernel's actual output.

    Derivation of why the f32 rule holds: each term is exp2(x) with x = (s - m) * exp2_scale rounded twice in f32
    (relative 2^-23: 2^x moves by at most 2^-x * |x| * ln2 * 2^-23 <= 2^-23 absolute) and ex2.approx (relative
    <= 2^-22); the f32 sum of nq terms adds nq * 2^-24 of the total. With m the true per-head max some block scores
    >= 1, so for nq <= 64 the error is below 1.2e-5 * max|ref|. Dropping one head's term (1 at its best block)
    misses by orders of magnitude."""
    rng = np.random.default_rng(seed)
    hs = (rng.standard_normal((n, nq)) * spread).astype(np.float32)
    hs[hs == 0] = np.float32(spread)
    if holes:   # blocks without a valid dot for a head (-inf), and a head without any (its terms drop out)
        hs[rng.random((n, nq)) < 0.2] = -np.inf
        hs[:, rng.integers(nq)] = -np.inf
    scale = float(np.float32(scale))
    m, got = launch_head_max_and_combine(ctx, stream, hs, None, scale)
    assert np.array_equal(m.view(np.uint32), ref.head_max(hs).astype(np.float32).view(np.uint32)), "head_max"
    want = ref.head_combine(hs, m, scale)
    assert_close(got, want, "f32", (0,), "combined scores")
    live = np.flatnonzero(np.isfinite(m))
    if live.size:
        h = live[0]
        b = int(np.argmax(hs[:, h]))
        mutated = want.copy()
        mutated[b] -= 1.0   # head h's term at its best block
        assert_bites(got, mutated, "f32", (0,), "combined scores with one head's term dropped")
    else:
        assert np.array_equal(got, np.zeros(n, np.float32))


def test_head_max_of_no_blocks_and_combine_overflow_rules(ctx, stream) -> None:
    """n = 0 gives head_max -inf; an exponent that is NaN (inf - inf, -inf - -inf) drops its term."""
    hs = np.array([[np.inf, -np.inf, 1.0], [2.0, -np.inf, -np.inf]], np.float32)
    m, got = launch_head_max_and_combine(ctx, stream, hs, None, 1.0)
    assert m.tolist() == [np.inf, -np.inf, 1.0]
    want = ref.head_combine(hs, m, 1.0)
    assert want.tolist() == [1.0, 0.0]                # inf - inf and -inf - -inf drop out; 2 - inf gives 0
    assert np.array_equal(got, want.astype(np.float32))


def test_head_normalised_scores_end_to_end(ctx, stream, rng) -> None:
    """Predictor(head_temperature=c).score_layer against the staged reference from the q_proj and K_lr the engine
    stored. Bound: each term's exponent errs by at most (tol of its head score + tol of that head's max) * scale
    (heads_tolerance), so the term by at most that power of two minus one, relatively; plus the f32 rule."""
    for shape, c in ((dict(num_q_heads=9, num_kv_heads=3, head_dim=64, r=8, block_size=16), 8.0),
                     (dict(num_q_heads=32, num_kv_heads=8, head_dim=128, r=32, block_size=16), 11.3),
                     (dict(num_q_heads=6, num_kv_heads=2, head_dim=40, r=12, block_size=5), 0.5)):
        d = dims_of(shape, num_layers=2, max_blocks=24 if ON_GPU else 12)
        n = d.max_blocks - 1
        proj = layered_projection(rng, d)
        with Predictor(ctx, d, projection=proj, head_temperature=c) as pred:
            assert pred.head_temperature == c
            pages = randn(rng, (n, d.block_size, d.num_kv_heads, d.head_dim), 1.0)
            k_dev = upload(pages, stream)
            for b in range(n):
                pred.project_kv_block(ctx, 1, b + 1, k_dev.ptr + b * pages[0].nbytes)
            q = upload(randn(rng, (d.num_q_heads, d.head_dim), 1.0), stream)
            q_proj = poisoned(2 * d.num_q_heads * d.r, stream)
            pred.project_q(ctx, q, q_proj, layer=1)
            out = poisoned(4 * n, stream)
            pred.score_layer(ctx, q_proj, 1, 1, n, out)
            got = download(out, (n,), np.float32, stream)
            qp = download(q_proj, (d.num_q_heads, d.r), BF16, stream)
            k = np.stack([read_k_lr_slot(ctx, pred, 1, b + 1) for b in range(n)])
        scale = float(np.float32(LOG2E / c))
        hs = ref.predictor_score_heads(qp, k, d.gqa_ratio())
        want = ref.head_combine(hs, ref.head_max(hs), scale)
        assert np.allclose(want, ref.head_normalised_score(qp, k, d.gqa_ratio(), c), rtol=1e-6)
        tol_h = heads_tolerance(qp, k, d.gqa_ratio(), hs)
        tol_m = tol_h[np.argmax(hs, axis=0), np.arange(d.num_q_heads)]
        terms = np.exp2((hs - hs.max(axis=0)) * scale)
        tol = (terms * (np.exp2((tol_h + tol_m) * scale) - 1)).sum(axis=1) + 1e-4 * np.abs(want).max()
        assert_close(got, want, "f32", (0,), f"head-normalised scores (c {c})", tol=tol)
        h = 0
        mutated = want - np.exp2((hs[:, h] - hs[:, h].max()) * scale)
        assert violations(got, mutated, "f32", (0,), tol=tol).any(), "the bound does not bite (one head dropped)"
        assert 1.0 <= want.max() <= d.num_q_heads


def test_head_normalised_scores_api(ctx, stream, rng, launches: list) -> None:
    """Three launches per call; n = 0 none; n above max_blocks and outputs overlapping the scratch are refused before
    any launch; the default (None) keeps the original single launch and its max over heads."""
    d = SMALL
    with Predictor(ctx, d, SEED, head_temperature=8.0) as pred:
        q = poisoned(2 * 8 * 32, stream)
        cm.memset_d8_async(q, 0x3F, q.bytes, stream)   # a finite q_proj (bf16 0x3F3F = 0.746)
        out = poisoned(4 * 2 * d.max_blocks, stream)
        before = len(launches)
        pred.score_layer(ctx, q, 0, 0, 0, out)
        assert len(launches) == before
        with pytest.raises(HssError, match=r"n = 6 blocks: with head_temperature a call scores at most max_blocks"):
            pred.score_blocks(ctx, q, pred.a_g_dev_ptr, out, d.max_blocks + 1)
        with pytest.raises(HssError, match="overlaps the Predictor's per-head scratch"):
            pred.score_layer(ctx, q, 0, 0, 2, pred._heads.ptr + 8)
        assert len(launches) == before
        pred.score_layer(ctx, q, 1, 0, d.max_blocks, out)
        assert len(launches) == before + 3
        got = download(out, (d.max_blocks,), np.float32, stream)
        assert np.array_equal(got, np.full(d.max_blocks, 8.0, np.float32))   # zeroed A_g: every block ties every head
    with Predictor(ctx, d, SEED) as pred:
        assert pred.head_temperature is None
        before = len(launches)
        pred.score_layer(ctx, q, 1, 0, d.max_blocks, out)
        assert len(launches) == before + 1
