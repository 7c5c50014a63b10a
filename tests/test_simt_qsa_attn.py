"""``ptx/qsa_device.cu``'s ``qsa_sparse_attn`` (then ``qsa_sparse_merge``) compiled for the CPU and run through the SIMT
harness (tests/simt), whose ldmatrix / mma.sync / cp.async stand-ins follow the PTX ISA's fragment layouts, under the
rules of test_qsa_device_kernels: the float64 attention over the same token list under the bf16 rule (|err| <=
2^-7 |ref| + 1e-5 max|ref| per (request, head)), dropping the heaviest token breaks it, a request with no token gives
zeros, invalid tokens (a negative page, a token past the table, a negative token) contribute nothing, and a request's
bits depend neither on the batch nor on the thread schedule. The harness's mma sums in double and rounds once, so
its bits are not a GPU's: the bounds, not the bits, are compared with the references. Every case also runs with
64- and 32-token splits (``-DQSA_SPLIT=64``, ``32``), the other splits the kernel serves.
"""
from __future__ import annotations

import numpy as np
import pytest
import simt
from test_qsa_device_kernels import AttnCase

from hss._util import ceil_div
from hss.decls import qsa_device as kd
from hss.reference import qsa_device as dref

from helpers import BF16, assert_close

SPLITS = (kd.SPLIT, 64, 32)


@pytest.fixture(scope="module", params=SPLITS, ids=lambda v: f"split{v}")
def built(request) -> tuple[simt.Program, int]:
    simt.require()
    split = request.param
    defines = {} if split == kd.SPLIT else {"QSA_SPLIT": split}
    return simt.build(simt.PTX_DIR / "qsa_device.cu", defines=defines), split


def smem_bytes(hd: int, split: int) -> int:
    """``hss.decls.qsa_device.attn_smem_bytes`` for another split."""
    rs = hd + 8
    return 16 * rs * 2 + 2 * split * rs * 2 + 16 * (split + 8) * 4 + split * 8 + split // 8


def run(built, case: AttnCase, rows=None, schedule: str | int = "ascending") -> np.ndarray:
    """out bf16 [R', nq, hd] of the requests ``rows`` (all by default) as one batch, partials poisoned."""
    program, split = built
    rows = list(range(case.R)) if rows is None else list(rows)
    R, nq, hd, cap = len(rows), case.nq, case.hd, case.sel_cap
    n_splits = ceil_div(cap, split)
    ml = np.full((R, nq, n_splits, 2), np.nan, np.float32)
    po = np.full((R, nq, n_splits, hd), np.nan, np.float32)
    out = np.full((R, nq, hd), np.nan, np.float32).astype(BF16)
    counts = np.ascontiguousarray(case.counts[rows])
    program.kernel("qsa_sparse_attn")(
        (R, case.nkv, n_splits), kd.ATTN_THREADS, smem_bytes(hd, split), q=np.ascontiguousarray(case.q[rows]),
        k_pool=case.k, v_pool=case.v, block_tables=np.ascontiguousarray(case.tables[rows]),
        tokens=np.ascontiguousarray(case.tokens[rows]), counts=counts, part_ml=ml, part_o=po,
        max_pages=case.max_pages, sel_cap=cap, block_size=case.bs, nq=nq, nkv=case.nkv, hd=hd, scale=case.scale,
        schedule=schedule)
    program.kernel("qsa_sparse_merge")(
        (R, nq, 1), kd.merge_threads(hd), 0, part_ml=ml, part_o=po, counts=counts, out=out, sel_cap=cap, nq=nq,
        hd=hd, schedule=schedule)
    return out


CASES = [   # nq, nkv, hd, bs, counts, max_pages, sel_cap
    (8, 2, 64, 8, [0, 1, 63, 64, 65, 127, 128, 129, 200], 40, 260),   # ragged, count 0, split edges
    (24, 2, 256, 16, [300], 24, 304),                                 # Qwen3.8's heads: 24 q / 2 kv x 256
    (16, 1, 96, 16, [260, 3], 20, 260),                               # G = 16, hd not a power of two
    (4, 4, 32, 32, [100, 17], 8, 132),                                # G = 1
]


@pytest.mark.parametrize("scale", ["unit", "small"])
@pytest.mark.parametrize("nq, nkv, hd, bs, counts, max_pages, sel_cap", CASES)
def test_sparse_attention_matches_the_float64_reference(built, rng, scale, nq, nkv, hd, bs, counts, max_pages,
                                                        sel_cap):
    case = AttnCase(rng, nq, nkv, hd, bs, counts, max_pages, sel_cap, 1.0 if scale == "unit" else hd ** -0.5)
    case.check(run(built, case))


def test_sparse_attention_skips_invalid_tokens(built, rng):
    case = AttnCase(rng, 8, 2, 64, 16, [300, 200, 5], 20, 320)
    case.tables[0, case.tokens[0, 3] // 16] = -1                  # a page of request 0 missing
    case.tokens[0, 10] = 20 * 16 + 5                              # past request 0's table
    case.tokens[1, 128:200] = -3                                  # request 1's later splits: nothing valid
    case.tables[2, :] = -1                                        # request 2: nothing at all
    got = run(built, case)
    for r in range(2):
        assert_close(got[r].astype(np.float32), case.want(r), "bf16", (1,), f"request {r}")
    assert (~dref.page_rows(case.tokens[0, :300], case.tables[0], 16)[2]).sum() >= 2
    g = got[2].astype(np.float32)
    assert (g == 0).all() and not np.signbit(g).any()


def test_sparse_attention_bits_do_not_depend_on_the_batch_or_the_schedule(built, rng):
    case = AttnCase(rng, 8, 2, 128, 16, [260, 70, 0, 129], 20, 264)
    batch = run(built, case)
    case.check(batch)
    for r in (0, 1, 3):
        alone = run(built, case, rows=[r], schedule=int(rng.integers(2**31)))
        assert alone.view(np.uint16).tobytes() == batch[r:r + 1].view(np.uint16).tobytes(), f"request {r}"
    again = run(built, case, rows=[3, 1, 0], schedule="warps-descending")
    assert again.view(np.uint16).tobytes() == batch[[3, 1, 0]].view(np.uint16).tobytes()
