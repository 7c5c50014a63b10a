"""The device sparse step's scores are the predictor's, bit for bit: the max over heads and, with a per-layer
projection and ``head_temperature``, the per-head normalised scores (docs/design.md §17.5), row by row through each
sequence's block table; so the device step selects the pages the host sparse mode would (docs/design.md §17.8)."""
from __future__ import annotations

import numpy as np
import pytest

from hss import cuda_min as cm
from hss.swap import HighSpeedSwap, HighSpeedSwapConfig, ModelDims
from hss.swap.device_step import DeviceSparseStep
from hss.swap.sparse import SparseBudget, select_pages

from helpers import BF16, download, upload

DIMS = dict(num_q_heads=8, num_kv_heads=2, head_dim=64, block_size=16)


def _pages(rng, n, d):
    k = (rng.standard_normal((n, d["block_size"], d["num_kv_heads"], d["head_dim"])) / 8).astype(BF16)
    v = rng.standard_normal(k.shape).astype(BF16)
    return k, v


@pytest.mark.parametrize("temperature", [None, 8.0])
def test_device_scores_and_selection_are_the_host_modes(ctx, tmp_path, temperature):
    rng = np.random.default_rng(3 if temperature else 4)
    L, nb, R = 2, 24, 2
    d = ModelDims(L, nb, **DIMS)
    projection = rng.standard_normal((L, 2, 64, 16)).astype(BF16) if temperature else None
    cfg = HighSpeedSwapConfig(tmp_path, 1 << 34, 8, 16, 2, False, 7, store="host", stream_tile_blocks=2,
                              projection=projection, head_temperature=temperature)
    s = ctx.stream
    with HighSpeedSwap(ctx, cfg, d) as h:
        for layer in range(L):
            k, v = _pages(rng, nb, DIMS)
            kd = upload(k, s)
            for b in range(nb):
                h.offload_block_on_stream(s, layer, b, kd.ptr + b * k[0].nbytes, k[b], v[b])
            cm.stream_sync(s)
            kd.close()
        budget = SparseBudget(3, 1, 2)
        tables = np.stack([rng.permutation(nb).astype(np.int32) for _ in range(R)])
        tables[0] = np.arange(nb, dtype=np.int32)   # row 0: pages 0..n-1, as score_layer(0, n) normalises them
        tables[1, 5] = nb + 7   # a block id outside A_g scores NaN: ranked below every page
        counts = np.array([20, 17], np.int32)
        q = rng.standard_normal((R, 8, 64)).astype(BF16)
        with DeviceSparseStep(h, s, max_seqs=R, budget_pages=3, keep_first=1, keep_recent=2) as step:
            td, cd, qd = upload(tables, s), upload(counts, s), upload(q, s)
            step.begin_step(s, td, cd, R)
            for layer in range(L):
                step.attend_layer(s, layer, qd)
                got = download(step.scores, (R, nb), np.float32, s)
                att, cnt = step.selection(s)
                for r in range(R):
                    n = int(counts[r])
                    ids = [int(b) for b in tables[r, :n]]
                    qr = upload(q[r], s)
                    proj = cm.DeviceBuffer(2 * 8 * 16)
                    out = cm.DeviceBuffer(4 * nb)
                    h.predictor.project_q_on_stream(s, qr, proj, layer=layer)
                    span = n if r == 0 else nb
                    h.predictor.score_layer_on_stream(s, proj, layer, 0, span, out)
                    host = download(out, (nb,), np.float32, s)[:span]
                    for b in (qr, proj, out):
                        b.close()
                    want = np.array([host[b] if b < span else np.nan for b in ids], np.float32)
                    if temperature is None or r == 0:   # normalised over the same pages only
                        nan = np.isnan(want)   # (any NaN: bit patterns of NaN differ between paths)
                        assert np.array_equal(np.isnan(got[r, :n]), nan), (layer, r)
                        assert np.array_equal(got[r, :n][~nan].view(np.uint32), want[~nan].view(np.uint32)), (layer, r)
                    assert np.isnan(got[r, :n][np.array(ids) >= nb]).all()
                    chosen = select_pages(got[r, :n], budget)
                    _, sp, _, _ = step.residency(s, layer, r)
                    base = (layer * R + r) * step.slots
                    assert sorted(sp[att[r, :cnt[r]] - base].tolist()) == chosen.tolist(), (layer, r)
            for b in (td, cd, qd):
                b.close()
