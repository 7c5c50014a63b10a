"""Tests for hss.predictor.calibrate (docs/design.md §17.5): the uncentered principal directions of calibration keys,
per layer and kv head, as a Predictor projection. Pure numpy; the Predictor end of it runs on any driver."""
from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

from hss.errors import HssError
from hss.predictor import Predictor, PredictorDims
from hss.predictor.calibrate import calibrate_projection, principal_directions
from hss.reference import predictor as ref
from hss.reference.numerics import to_bf16

from helpers import BF16, download, poisoned, upload

ULP = 2.0 ** -8   # a bf16 rounding: half an ulp relative, so two roundings of nearby values differ by <= 2^-8


def keys_with_spectrum(rng: np.random.Generator, t: int, hd: int, sigmas: np.ndarray,
                       offset: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``[t, hd]`` keys U diag(sigmas) V^T (+ a constant offset row) with known right singular vectors V."""
    u = np.linalg.qr(rng.standard_normal((t, len(sigmas))))[0]
    v = np.linalg.qr(rng.standard_normal((hd, len(sigmas))))[0]
    k = (u * sigmas) @ v.T
    return (k if offset is None else k + offset), v


def eig_directions(k: np.ndarray, r: int) -> np.ndarray:
    """An independent reference: the top-r eigenvectors of K^T K (float64), sign-fixed as docs/design.md §17.5 says."""
    w, v = np.linalg.eigh(k.T @ k)
    v = v[:, np.argsort(w)[::-1][:r]]
    lead = v[np.abs(v).argmax(axis=0), np.arange(r)]
    return v * np.where(lead < 0, -1.0, 1.0)


def test_directions_are_the_right_singular_vectors(rng) -> None:
    """Distinct singular values: the columns are V's (up to the sign rule), ordered by singular value."""
    hd, r = 48, 6
    sigmas = np.array([40.0, 20, 10, 7, 5, 3, 2, 1])
    k, v = keys_with_spectrum(rng, 300, hd, sigmas)
    got = principal_directions(k, r)
    want = v[:, :r] * np.sign(v[np.abs(v[:, :r]).argmax(axis=0), np.arange(r)])
    assert np.allclose(got, want, atol=1e-10)
    assert np.allclose(got, eig_directions(k, r), atol=1e-8)
    lead = got[np.abs(got).argmax(axis=0), np.arange(r)]
    assert (lead > 0).all(), "each direction's largest-magnitude component must be positive"
    assert np.allclose(got.T @ got, np.eye(r), atol=1e-12)


def test_uncentered_finds_the_mean_direction(rng) -> None:
    """Keys sharing a large common offset: the first direction is the offset's (centered PCA would drop it and find
    the noise's strongest direction w, 3x the std of the rest and orthogonal to the offset, instead). With isotropic
    noise the centered direction is a random one, whose |cosine| with the offset passed 0.5 on 1 seed in 300; here,
    over 3000 seeds, |first . mu| stayed >= 0.99968, |centered . mu| <= 0.062 and |centered . w| >= 0.990."""
    hd = 32
    offset = 5.0 * rng.standard_normal(hd)
    mu = offset / np.linalg.norm(offset)
    w = rng.standard_normal(hd)
    w -= (w @ mu) * mu
    w /= np.linalg.norm(w)
    noise = rng.standard_normal((500, hd))
    noise += 2.0 * (noise @ w)[:, None] * w
    k = offset + noise
    first = principal_directions(k, 1)[:, 0]
    assert abs(first @ mu) > 0.999
    centered = principal_directions(k - k.mean(axis=0), 1)[:, 0]
    assert abs(centered @ mu) < 0.2 and abs(centered @ w) > 0.95


def test_calibrate_projection_layout_rounding_and_independence(rng) -> None:
    """``[num_layers, num_kv_heads, head_dim, r]`` bf16, C-contiguous; entry [l, j] is one RNE rounding of layer l /
    kv head j's directions and depends on those keys only; lists and 4-D arrays agree; deterministic."""
    nl, t, nkv, hd, r = 3, 200, 2, 40, 5
    keys = rng.standard_normal((nl, t, nkv, hd)) * rng.uniform(0.5, 3, size=(1, 1, 1, hd)) + rng.standard_normal(hd)
    keys = keys.astype(np.float32)
    p = calibrate_projection(keys, r)
    assert p.shape == (nl, nkv, hd, r) and p.dtype == ml_dtypes.bfloat16 and p.flags.c_contiguous
    for layer in range(nl):
        for j in range(nkv):
            want = to_bf16(principal_directions(keys[layer, :, j].astype(np.float64), r))
            assert np.array_equal(p[layer, j].view(np.uint16), want.view(np.uint16)), (layer, j)
            close = eig_directions(keys[layer, :, j].astype(np.float64), r)
            assert np.all(np.abs(p[layer, j].astype(np.float64) - close) <= ULP * np.abs(close) + 1e-6)
    as_list = calibrate_projection([keys[i] for i in range(nl)], r)
    assert np.array_equal(as_list.view(np.uint16), p.view(np.uint16))
    flipped = calibrate_projection(keys[::-1].copy(), r)
    assert np.array_equal(flipped[::-1].view(np.uint16), p.view(np.uint16))
    other = keys.copy()
    other[1, :, 0] = rng.standard_normal((t, hd))
    changed = calibrate_projection(other, r)
    same = np.ones((nl, nkv), bool)
    same[1, 0] = False
    assert np.array_equal(changed[same].view(np.uint16), p[same].view(np.uint16))
    assert not np.array_equal(changed[1, 0].view(np.uint16), p[1, 0].view(np.uint16))
    assert np.array_equal(calibrate_projection(keys, r).view(np.uint16), p.view(np.uint16))
    bf = calibrate_projection(keys.astype(BF16), r)   # any real dtype, bf16 included
    assert bf.shape == p.shape


def test_the_calibrated_subspace_keeps_the_most_of_the_keys(rng) -> None:
    """||K P||_F^2 is the sum of the top r squared singular values (up to bf16 rounding of P), more than any other
    r-dimensional projection keeps, e.g. the seeded random P's orthonormalised span."""
    hd, r = 64, 8
    sigmas = np.geomspace(50, 0.5, 20)
    k, _ = keys_with_spectrum(rng, 400, hd, sigmas, offset=0.0)
    p = calibrate_projection(k[:, None, :][None], r)[0, 0].astype(np.float64)
    kept = np.linalg.norm(k @ p) ** 2
    top = (sigmas[:r] ** 2).sum()
    assert abs(kept - top) <= 4 * ULP * top
    for _ in range(5):
        basis = np.linalg.qr(rng.standard_normal((hd, r)))[0]
        assert np.linalg.norm(k @ basis) ** 2 < kept


@pytest.mark.parametrize("keys,r,err,words", [
    (np.zeros((2, 10, 1, 8)), 0, HssError, "r must be > 0"),
    (np.zeros((2, 10, 1, 8)), 129, HssError, "r must be <= 128"),
    (np.ones((2, 10, 1, 8)), 9, HssError, r"r \(9\) must be <= head_dim \(8\)"),
    (np.ones((2, 3, 1, 8)), 4, HssError, r"keys\[0\] has 3 tokens; calibrating r = 4 directions needs at least r"),
    (np.ones((10, 1, 8)), 2, HssError, r"an array must be \[num_layers, tokens, num_kv_heads, head_dim\]"),
    ([np.ones((10, 1, 8)), np.ones((10, 2, 8))], 2, HssError,
     r"keys\[1\] has 2 kv heads x head_dim 8, keys\[0\] 1 x 8"),
    ([np.ones((10, 8))], 2, HssError, r"keys\[0\] must be \[tokens, num_kv_heads, head_dim\]"),
    ([], 2, HssError, "no layers given"),
    ([np.full((10, 1, 8), "a")], 2, TypeError, "must hold real numbers"),
    ("keys", 2, TypeError, "keys must be a numpy array or a list"),
    (np.ones((2, 10, 1, 8)), 2.0, TypeError, "r must be an int"),
])
def test_bad_calibration_input(keys, r, err, words) -> None:
    with pytest.raises(err, match=words):
        calibrate_projection(keys, r)


def test_non_finite_keys_are_refused() -> None:
    keys = np.ones((2, 10, 1, 8))
    keys[1, 4, 0, 2] = np.inf
    with pytest.raises(HssError, match=r"keys\[1\] holds NaN or inf"):
        calibrate_projection(keys, 2)


def test_a_calibrated_predictor_ranks_pages_better(ctx, stream, rng) -> None:
    """End to end on the predictor's kernels: keys with a strong shared low-rank structure (as a model's are), a
    projection calibrated on other keys of the same kind; at r = 4 its top pages hold more attention mass than the
    seeded P's, averaged over 4 page sets x 8 queries (enough that the means sit far from the bounds on any seed:
    over 200 seeds the calibrated mean stayed >= 0.838 and led the seeded one by >= 0.19)."""
    nq, nkv, hd, r, bs, n = 4, 2, 64, 4, 16, 48
    basis = np.linalg.qr(rng.standard_normal((hd, 6)))[0]

    def keys(count: int) -> np.ndarray:
        coef = rng.standard_normal((count, nkv, 6)) * np.array([6, 5, 4, 3, 0.3, 0.3])
        return coef @ basis.T + 0.2 * rng.standard_normal((count, nkv, hd))

    proj = calibrate_projection(keys(400)[None], r)
    dims = PredictorDims(num_layers=1, num_q_heads=nq, num_kv_heads=nkv, head_dim=hd, r=r, block_size=bs,
                         max_blocks=n)
    mass = {"seeded": [], "calibrated": []}
    for _ in range(4):
        pages = keys(n * bs).reshape(n, bs, nkv, hd).astype(np.float32).astype(BF16)
        queries = [((rng.standard_normal((nq, 6)) * 2) @ basis.T).astype(np.float32).astype(BF16) for _ in range(8)]
        for name, kw in (("seeded", dict(projection_seed=0xCAFE_F00D)), ("calibrated", dict(projection=proj))):
            with Predictor(ctx, dims, **kw) as pred:
                k_dev = upload(pages, stream)
                for b in range(n):
                    pred.project_kv_block(ctx, 0, b, k_dev.ptr + b * pages[0].nbytes)
                for q in queries:
                    truth = ref.ground_truth_block_weights(q, pages)
                    q_proj = poisoned(2 * nq * r, stream)
                    pred.project_q(ctx, upload(q, stream), q_proj, layer=0)
                    out = poisoned(4 * n, stream)
                    pred.score_layer(ctx, q_proj, 0, 0, n, out)
                    scores = download(out, (n,), np.float32, stream)
                    top = np.argsort(-scores, kind="stable")[:n // 8]
                    mass[name].append(truth[top].sum() / np.sort(truth)[::-1][:n // 8].sum())
    seeded, calibrated = (float(np.mean(v)) for v in mass.values())
    print(f"top-{n // 8} attention mass vs the oracle's: seeded {seeded:.3f}, calibrated {calibrated:.3f}")
    assert calibrated > seeded and calibrated > 0.8 and math.isfinite(seeded)
