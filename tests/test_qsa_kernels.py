"""The four decode kernels of ``ptx/qsa_indexer.cu`` against their staged float64 references (docs/design.md §0,
§12.1-12.4).

Bounds (docs/design.md §0), max|ref| per output row:
* bf16 outputs (qsa_block_pool): |err| <= 2^-7 |ref| + 1e-5 max|ref| per block row;
* f32 outputs (qsa_qprep per head, qsa_score over the score vector): |err| <= 1e-4 max|ref|. Both kernels use
  ``rsqrtf`` (the original's), whose error is at most 2 ulp, i.e. 2.4e-7 relative: it scales the whole row by
  1 + O(2.4e-7), far inside 1e-4 max|ref|, so no wider bound is needed;
* qsa_gather is a copy: bit-exact.
Every bound is shown to bite with a reference that drops one term. Inputs are unit-scale (std 1) and the
original's small scale (std 1/sqrt(hd)), never zero; outputs are NaN-poisoned before each launch and the
entries a kernel must not write are checked to keep the poison. The original's looser §14 checks
(max error <= max(0.05 RMS, 1e-3), cosine > 0.9999) are recorded too.
"""
from __future__ import annotations

import numpy as np
import pytest

from hss import cuda_min as cm
from hss.decls import qsa as kq
from hss.reference import qsa as ref

from conftest import ON_GPU
from helpers import BF16, assert_bites, assert_close, download, poisoned, upload

EPS = 1e-6


def std_of(scale: str, hd: int) -> float:
    return 1.0 if scale == "unit" else hd ** -0.5


def normal(rng, shape, std, dtype=BF16) -> np.ndarray:
    return (rng.standard_normal(shape) * std).astype(dtype)


def f32(x: float) -> float:
    """The value a kernel receives for an f32 parameter."""
    return float(np.float32(x))


def parity_14(got, want, what: str, rel: float = 0.05) -> None:
    """The original's recorded check (docs/design.md §14): max error <= max(rel * RMS(want), 1e-3) and cosine >
    0.9999."""
    g, w = np.asarray(got, np.float64).ravel(), np.asarray(want, np.float64).ravel()
    tol = max(rel * float(np.sqrt(np.mean(w * w))), 1e-3)
    err = float(np.max(np.abs(g - w))) if w.size else 0.0
    cos = float(g @ w / (np.linalg.norm(g) * np.linalg.norm(w))) if w.any() else 1.0
    assert err <= tol and cos > 0.9999, f"{what}: §14 parity max err {err:.3g} (tol {tol:.3g}), cosine {cos:.7f}"


def as_f32(x: np.ndarray) -> np.ndarray:
    return np.asarray(x).astype(np.float32)


# -- qsa_block_pool -----------------------------------------------------------------------------------
POOL_CASES = [   # hd, rot, ratio, first_block, n_new, theta
    (128, 64, 4, 0, 37, 1e7),
    (128, 64, 4, 5, 300, 1e7),
    (64, 64, 1, 3, 20, 1e4),
    (96, 32, 3, 1, 9, 1e6),
    (128, 0, 4, 0, 8, 1e7),
    (32, 32, 2, 2, 5, 1e4),
    (128, 128, 4, 32000, 3, 1e7),   # positions near 128K
]


@pytest.mark.parametrize("scale", ["unit", "small"])
@pytest.mark.parametrize("hd, rot, ratio, first, n_new, theta", POOL_CASES)
def test_block_pool(gpu, stream, rng, scale, hd, rot, ratio, first, n_new, theta):
    rows0, rows1 = first * ratio, (first + n_new) * ratio
    raw = np.zeros((rows1 + ratio, hd), BF16)          # lazily allocated; only the pooled rows are real
    raw[rows0:rows1] = normal(rng, (rows1 - rows0, hd), std_of(scale, hd))
    raw[rows1:] = normal(rng, (ratio, hd), 1.0)        # an incomplete block that must not be read
    w = normal(rng, hd, 0.1)
    d_raw = cm.DeviceBuffer(raw.nbytes)
    cm.copy_h_to_d_async(d_raw.ptr + rows0 * hd * 2, raw[rows0:], raw[rows0:].nbytes, stream)
    d_w = upload(w, stream)
    out_rows = first + n_new + 2
    out = poisoned(out_rows * hd * 2, stream)
    k = gpu.kernel("qsa_indexer", "qsa_block_pool")
    gpu.launch(k, (n_new, 1, 1), (hd, 1, 1), kq.row_smem_bytes(hd), stream,
               k.pack(d_raw, d_w, out, first, ratio, hd, rot, theta, EPS))
    got = as_f32(download(out, (out_rows, hd), BF16, stream))
    assert np.isnan(got[:first]).all() and np.isnan(got[first + n_new:]).all(), "wrote rows it does not own"
    got = got[first:first + n_new]
    want = ref.block_pool(raw, w, first, n_new, ratio, rot, f32(theta), f32(EPS))
    assert_close(got, want, "bf16", (1,), "qsa_block_pool")
    dropped = raw.copy()
    dropped[(first + n_new // 2) * ratio + ratio - 1] = 0     # one raw key dropped from a block's mean
    assert_bites(got, ref.block_pool(dropped, w, first, n_new, ratio, rot, f32(theta), f32(EPS)), "bf16", (1,),
                 "qsa_block_pool, one raw key dropped")
    parity_14(got, want, "qsa_block_pool")


# -- qsa_qprep ----------------------------------------------------------------------------------------
QPREP_CASES = [   # n_heads, hd, rot, pos, theta
    (4, 128, 64, 2199, 1e7),
    (4, 128, 64, 0, 1e7),
    (1, 64, 64, 131071, 1e4),
    (8, 96, 32, 7, 1e6),
    (4, 128, 128, 2**32 - 1, 1e7),
    (2, 32, 0, 5, 1e7),
    (3, 256, 64, 40000, 1e7),
]


@pytest.mark.parametrize("scale", ["unit", "small"])
@pytest.mark.parametrize("n_heads, hd, rot, pos, theta", QPREP_CASES)
def test_qprep(gpu, stream, rng, scale, n_heads, hd, rot, pos, theta):
    q_in = normal(rng, (n_heads, hd), std_of(scale, hd))
    w = normal(rng, hd, 0.1)
    d_q, d_w = upload(q_in, stream), upload(w, stream)
    out = poisoned((n_heads + 1) * hd * 4, stream)
    k = gpu.kernel("qsa_indexer", "qsa_qprep")
    gpu.launch(k, (n_heads, 1, 1), (hd, 1, 1), kq.row_smem_bytes(hd), stream,
               k.pack(d_q, d_w, out, hd, rot, pos, theta, EPS))
    got = download(out, (n_heads + 1, hd), np.float32, stream)
    assert np.isnan(got[n_heads]).all(), "wrote past n_heads rows"
    got = got[:n_heads]
    want = ref.qprep(q_in, w, pos, rot, f32(theta), f32(EPS))
    assert_close(got, want, "f32", (1,), "qsa_qprep")
    # mutation: head 0's largest element dropped from its mean square
    x = q_in.astype(np.float64)
    d = int(np.argmax(np.abs(x[0])))
    ms = (x * x).sum(axis=1) / hd
    ms[0] -= x[0, d] ** 2 / hd
    normed = x / np.sqrt(ms + f32(EPS))[:, None] * (1 + w.astype(np.float64))
    assert_bites(got, ref.rope(normed, pos, rot, f32(theta)), "f32", (1,), "qsa_qprep, one term dropped")
    parity_14(got, want, "qsa_qprep")


# -- qsa_score ----------------------------------------------------------------------------------------
SCORE_CASES = [   # n_heads, hd, n_blocks, misaligned keys, grid (None: score_grid)
    (4, 128, 550, False, None),
    (4, 128, 1, False, None),
    (4, 128, 63, False, None),
    (4, 128, 65, False, None),
    (4, 128, 8192, False, None),
    (1, 64, 100, False, None),
    (3, 256, 77, False, None),
    (2, 32, 300, False, None),
    (4, 96, 50, False, None),        # hd outside the fast path: a warp per block
    (4, 128, 200, True, None),       # keys not 16-byte aligned: the same fallback
    (4, 128, 1000, False, 1),        # grid-stride: one CTA covers everything
    (4, 128, 1000, False, 300),      # more CTAs than tiles
]


def _run_score(gpu, stream, q, keys_bytes_offset, keys, grid=None):
    n, hd = keys.shape
    n_heads = q.shape[0]
    d_q = upload(q, stream)
    d_k = cm.DeviceBuffer((n + 1) * hd * 2 + keys_bytes_offset)
    kptr = d_k.ptr + keys_bytes_offset
    if n:
        cm.copy_h_to_d_async(kptr, keys, keys.nbytes, stream)
    out = poisoned((n + 8) * 4, stream)
    k = gpu.kernel("qsa_indexer", "qsa_score")
    g = kq.score_grid(n, hd) if grid is None else grid
    gpu.launch(k, (g, 1, 1), (kq.SCORE_THREADS, 1, 1), kq.score_smem_bytes(n_heads, hd), stream,
               k.pack(d_q, kptr, out, n, n_heads, hd))
    got = download(out, (n + 8,), np.float32, stream)
    assert np.isnan(got[n:]).all(), "wrote past n_blocks"
    return got[:n]


@pytest.mark.parametrize("scale", ["unit", "small"])
@pytest.mark.parametrize("n_heads, hd, n_blocks, misaligned, grid", SCORE_CASES)
def test_score(gpu, stream, rng, scale, n_heads, hd, n_blocks, misaligned, grid):
    std = std_of(scale, hd)
    q = normal(rng, (n_heads, hd), std, np.float32)
    keys = normal(rng, (n_blocks, hd), std)
    dead = (keys.astype(np.float64) @ q.T.astype(np.float64) <= 0).all(axis=1)
    keys[dead] = -keys[dead]   # no block scores 0 by chance, so a dropped head always shows
    got = _run_score(gpu, stream, q, 2 if misaligned else 0, keys, grid)
    want = ref.score(q, keys)
    assert_close(got, want, "f32", (0,), "qsa_score")
    # one head dropped: the one contributing most (a head whose dots are all negative changes nothing)
    h = int(np.argmax(np.maximum(keys.astype(np.float64) @ q.T.astype(np.float64), 0).sum(axis=0)))
    dropped = ref.score(np.delete(q, h, axis=0), keys) if n_heads > 1 else np.zeros(n_blocks)
    assert_bites(got, dropped, "f32", (0,), "qsa_score, one head dropped")
    assert (got >= 0).all()
    parity_14(got, want, "qsa_score")


def test_score_past_the_old_grid_limit(gpu, stream, rng):
    # 70,000 blocks = 280,000 tokens: past the 65,535 blocks (262,140 tokens) of a grid.y launch
    n = 70000 if ON_GPU else 66000
    q = normal(rng, (4, 128), 1.0, np.float32)
    keys = normal(rng, (n, 128), 1.0)
    got = _run_score(gpu, stream, q, 0, keys)
    assert_close(got, ref.score(q, keys), "f32", (0,), "qsa_score, 70k blocks")


def test_score_of_no_blocks_writes_nothing(gpu, stream, rng):
    q = normal(rng, (4, 128), 1.0, np.float32)
    assert _run_score(gpu, stream, q, 0, np.zeros((0, 128), BF16)).size == 0


# -- qsa_gather ---------------------------------------------------------------------------------------
GATHER_CASES = [   # block_size, nkv, hd, n_sel, misaligned
    (16, 2, 256, 2052, False),
    (8, 1, 128, 37, False),
    (32, 2, 64, 300, False),
    (16, 3, 5, 50, False),      # 30-byte rows: the 2-byte path
    (16, 2, 256, 100, True),    # caches not 16-byte aligned: the 2-byte path
]


@pytest.mark.parametrize("block_size, nkv, hd, n_sel, misaligned", GATHER_CASES)
def test_gather(gpu, stream, rng, block_size, nkv, hd, n_sel, misaligned):
    logical = 40
    physical = logical + 7
    k_cache = normal(rng, (physical, block_size, nkv, hd), 1.0)
    v_cache = normal(rng, (physical, block_size, nkv, hd), 1.0)
    table = rng.permutation(physical)[:logical].astype(np.int32)
    table[3] = -1                                   # an unmapped page: its tokens' rows stay unwritten
    sel = rng.integers(0, logical * block_size, n_sel).astype(np.int32)
    sel[::7] = -1                                   # negative ids: rows stay unwritten
    sel[1::11] = 3 * block_size + 1                 # tokens on the unmapped page
    off = 2 if misaligned else 0
    d_k, d_v = cm.DeviceBuffer(k_cache.nbytes + off), cm.DeviceBuffer(v_cache.nbytes + off)
    cm.copy_h_to_d_async(d_k.ptr + off, k_cache, k_cache.nbytes, stream)
    cm.copy_h_to_d_async(d_v.ptr + off, v_cache, v_cache.nbytes, stream)
    d_t, d_s = upload(table, stream), upload(sel, stream)
    row = nkv * hd * 2
    k_out, v_out = poisoned(n_sel * row + 16, stream), poisoned(n_sel * row + 16, stream)
    k = gpu.kernel("qsa_indexer", "qsa_gather")
    gpu.launch(k, (n_sel, 1, 1), (kq.GATHER_THREADS, 1, 1), 0, stream,
               k.pack(d_k.ptr + off, d_v.ptr + off, d_t, d_s, k_out, v_out, block_size, nkv, hd))
    got_k = download(k_out, (n_sel * row + 16,), np.uint8, stream)
    got_v = download(v_out, (n_sel * row + 16,), np.uint8, stream)
    assert (got_k[n_sel * row:] == 0xFF).all() and (got_v[n_sel * row:] == 0xFF).all()
    got_k = got_k[:n_sel * row].view(np.uint16).reshape(n_sel, nkv, hd)
    got_v = got_v[:n_sel * row].view(np.uint16).reshape(n_sel, nkv, hd)
    valid = sel >= 0
    valid[valid] = table[sel[valid] // block_size] >= 0
    want_k, want_v = ref.gather(k_cache, v_cache, table, sel[valid], block_size)
    assert np.array_equal(got_k[valid], want_k.view(np.uint16)), "K rows differ"
    assert np.array_equal(got_v[valid], want_v.view(np.uint16)), "V rows differ"
    assert (got_k[~valid] == 0xFFFF).all() and (got_v[~valid] == 0xFFFF).all(), "wrote a skipped row"
    shifted_k, _ = ref.gather(k_cache, v_cache, table, sel[valid] ^ 1, block_size)   # one token off
    assert not np.array_equal(got_k[valid], shifted_k.view(np.uint16)), "the comparison does not bite"


# -- broken launch contracts ----------------------------------------------------------------------------
def test_broken_contract_writes_nothing(gpu, stream, rng):
    """A pool launched with block != hd: the emulator refuses it; the kernel returns untouched."""
    hd = 128
    d_raw = upload(normal(rng, (8, hd), 1.0), stream)
    d_w = upload(normal(rng, hd, 0.1), stream)
    out = poisoned(2 * hd * 2, stream)
    k = gpu.kernel("qsa_indexer", "qsa_block_pool")
    pack = k.pack(d_raw, d_w, out, 0, 4, hd, 64, 1e7, EPS)
    if ON_GPU:
        gpu.launch(k, (2, 1, 1), (64, 1, 1), kq.row_smem_bytes(hd), stream, pack)
        assert np.isnan(as_f32(download(out, (2, hd), BF16, stream))).all()
        gpu.launch(k, (2, 1, 1), (hd, 1, 1), 4 * hd, stream, pack)   # too little shared memory
        assert np.isnan(as_f32(download(out, (2, hd), BF16, stream))).all()
    else:
        from hss.emulator import EmulatorError
        with pytest.raises(EmulatorError, match="block must be"):
            gpu.launch(k, (2, 1, 1), (64, 1, 1), kq.row_smem_bytes(hd), stream, pack)
        with pytest.raises(EmulatorError, match="shared memory"):
            gpu.launch(k, (2, 1, 1), (hd, 1, 1), 4 * hd, stream, pack)


def test_geometry_helpers():
    assert kq.score_blocks_per_cta(128) == 64 and kq.score_grid(8192, 128) == 128
    assert kq.score_blocks_per_cta(96) == 8 and kq.score_grid(0, 128) == 1
    assert kq.row_smem_bytes(128) == 640 and kq.score_smem_bytes(4, 128) == 2048


# -- CudaBackend: arguments through hss._args, prepared launches --------------------------------------------
def test_backend_memory_and_copy_arguments(gpu, stream):
    """alloc / free / copies read their arguments through hss._args: ints (numpy too; float, bool refused), streams,
    device pointers against the bytes copied, host buffers by what they hold."""
    from hss.cuda.gpu import DevicePtr
    from hss.errors import HssError
    with pytest.raises(HssError, match="alloc nbytes = 0 must be >= 1"):
        gpu.alloc(0)
    with pytest.raises(TypeError, match="alloc nbytes must be an int, got float"):
        gpu.alloc(64.0)
    p = gpu.alloc(np.int64(64))
    assert type(p) is DevicePtr
    host, back = np.arange(16, dtype=np.int32), np.zeros(16, np.int32)
    gpu.copy_h2d_async(host, p, stream)
    gpu.copy_d2h_on_stream(p, back, stream)
    assert back.tolist() == host.tolist()
    with cm.PinnedBuffer(64) as pinned:   # a pinned buffer is a host buffer of its size
        pinned.view(np.int32)[:] = 7
        gpu.copy_h2d_async(pinned, p, stream)
        gpu.synchronize(stream)
    gpu.copy_d2h_on_stream(p, back, stream)
    assert (back == 7).all()
    gpu.copy_d2d_async(p, p + 32, np.int32(16), stream)
    gpu.copy_d2h_on_stream(p + 32, back[:4], stream)
    assert (back[:4] == 7).all()
    readonly = np.zeros(16, np.int32)
    readonly.flags.writeable = False
    cases = [
        (lambda: gpu.copy_h2d_async(np.zeros(32, np.int32), p, stream), HssError, "dst: 128 bytes at offset 0 run"),
        (lambda: gpu.copy_h2d_async([1, 2], p, stream), TypeError, "copy_h2d_async src must be a host buffer"),
        (lambda: gpu.copy_h2d_async(np.zeros(8, np.int32)[::2], p, stream), HssError, "C-contiguous"),
        (lambda: gpu.copy_d2h_on_stream(p, readonly, stream), HssError, "read-only"),
        (lambda: gpu.copy_d2h_on_stream(p + 32, back, stream), HssError, "src: 64 bytes at offset 32 run past"),
        (lambda: gpu.copy_d2d_async(p, p + 32, 64, stream), HssError, "run past the end of its 64-byte buffer"),
        (lambda: gpu.copy_d2d_async(p, p + 32, 16.0, stream), TypeError, "nbytes must be an int, got float"),
        (lambda: gpu.copy_d2d_async(p, p + 32, 16, None), TypeError, "a stream is required"),
        (lambda: gpu.copy_d2d_2d_async(p, 16, p + 32, 16, 8, 3, stream), HssError, "run past the end"),
        (lambda: gpu.copy_d2d_2d_async(p, 16, p + 32, 16, 8, True, stream), TypeError, "height must be an int"),
        (lambda: gpu.synchronize(None), TypeError, "a stream is required"),
        (lambda: gpu.free(1.5), TypeError, "free ptr must be an int, got float"),
        (lambda: gpu.free(p + 16), HssError, "not an allocation of this backend"),
    ]
    for call, exc, match in cases:
        with pytest.raises(exc, match=match):
            call()
    gpu.free(p)
    gpu.free(0)   # a null pointer is a no-op
    closed = cm.DeviceBuffer(64)
    closed.close()
    with pytest.raises(HssError, match="dst is a closed DeviceBuffer"):
        gpu.copy_h2d_async(host, closed, stream)


def test_backend_gemm_arguments(gpu, stream, rng):
    """cublas_bf16_proj_dense: m, n, k positive int32 (numpy ints accepted), act / weight / out checked against the
    m*k, n*k and m*n bf16 elements it reads and writes; the prepared proj_dense checks weight and out once."""
    from hss.cuda.gpu import proj_dense
    from hss.errors import HssError
    from hss.reference.linear import proj_dense as ref_proj
    m, n, k = 3, 40, 64
    a, w = normal(rng, (m, k), 1.0), normal(rng, (n, k), 0.1)
    d_a, d_w = upload(a, stream), upload(w, stream)
    with cm.DeviceBuffer(m * n * 2) as out:
        gpu.cublas_bf16_proj_dense(d_a, d_w, out, np.int32(m), np.int64(n), np.uint16(k), stream)
        want = download(out, (m, n), np.uint16, stream)
        assert_close(download(out, (m, n), BF16, stream), ref_proj(a, w), "bf16", (1,), "proj_dense")
        cases = [
            (dict(m=1.0), TypeError, "cublas_bf16_proj_dense m must be an int, got float"),
            (dict(n=True), TypeError, "cublas_bf16_proj_dense n must be an int, got bool"),
            (dict(k=0), HssError, "cublas_bf16_proj_dense k = 0 must be in 1"),
            (dict(m=2**31), HssError, "cublas_bf16_proj_dense m = 2147483648"),
            (dict(m=4), HssError, f"act holds {m * k * 2} bytes but {4 * k * 2} are needed"),
            (dict(act=d_a.ptr + 2), HssError, "act: .* run past the end"),
            (dict(act=d_a.view("bf16", m * k - 1)), HssError, "act holds"),
            (dict(weight=0), HssError, "weight is a null pointer"),
            (dict(weight=d_w.view("f32")), HssError, "weight holds f32 but bf16 is needed"),
            (dict(out=out.view("bf16", m * n - 1)), HssError, "out holds"),
            (dict(out=out.ptr + 1), HssError, "out .* must be 2-byte aligned"),
            (dict(stream=None), TypeError, "a stream is required"),
        ]
        good = dict(act=d_a, weight=d_w, out=out, m=m, n=n, k=k, stream=stream)
        for kw, exc, match in cases:
            with pytest.raises(exc, match=match):
                gpu.cublas_bf16_proj_dense(**{**good, **kw})
        # the prepared GEMM: the same bits, its fixed arguments checked once
        cm.memset_d8_async(out, 0xFF, out.bytes, stream)
        run = proj_dense(gpu, d_w, out, n, k, m)
        run(d_a.ptr, m, stream)
        assert np.array_equal(download(out, (m, n), np.uint16, stream), want)
        with pytest.raises(HssError, match="weight holds"):
            proj_dense(gpu, d_w.view("bf16", n * k - 1), out, n, k, m)
        with pytest.raises(HssError, match="out: .* run past the end"):
            proj_dense(gpu, d_w, out.ptr, n, k, m + 1)


def test_prepared_launcher(gpu, stream, rng):
    """hss.cuda.gpu.launcher: on a CudaBackend the prepared hss.cuda._launch.launcher (named slots refilled in place
    give the same bits as gpu.launch); on any other backend each run goes through its launch (recorded here)."""
    from hss.cuda.gpu import KernelHandle, launcher
    from hss.errors import HssError

    from helpers import Recording
    hd, ratio, n_new = 128, 4, 6
    d_raw = upload(normal(rng, (n_new * ratio, hd), 1.0), stream)
    d_w = upload(normal(rng, hd, 0.1), stream)
    k = gpu.kernel("qsa_indexer", "qsa_block_pool")
    want, got = poisoned(n_new * hd * 2, stream), poisoned(n_new * hd * 2, stream)
    gpu.launch(k, (n_new, 1, 1), (hd, 1, 1), kq.row_smem_bytes(hd), stream,
               k.pack(d_raw, d_w, want, 0, ratio, hd, 64, 1e7, EPS))
    pack = k.pack(raw_keys=d_raw, k_norm_w=d_w, block_keys=0, first_block=0, ratio=ratio, hd=hd, rot=64, theta=1e7,
                  eps=EPS)
    run = launcher(gpu, k, (hd, 1, 1), kq.row_smem_bytes(hd), pack)
    pack.slot("block_keys").value = got.ptr
    run(stream, n_new)
    assert np.array_equal(download(got, (n_new * hd,), np.uint16, stream), download(want, (n_new * hd,), np.uint16,
                                                                                      stream))
    rec = Recording(gpu)
    run = launcher(rec, k, (hd, 1, 1), kq.row_smem_bytes(hd), pack)
    run(stream, n_new)
    assert [(name, args[1], args[2]) for name, args in rec.calls] == [("launch", (n_new, 1, 1), (hd, 1, 1))]
    with pytest.raises(HssError, match="present KernelHandle"):
        launcher(gpu, KernelHandle(), (hd, 1, 1), 0, pack)
    with pytest.raises(TypeError, match="pack must be a ParamPack"):
        launcher(gpu, k, (hd, 1, 1), 0, [1, 2])
    with pytest.raises(HssError, match="launch of an absent kernel"):
        gpu.launch(KernelHandle(), 1, 1, 0, stream, pack)
    with pytest.raises(TypeError, match="a stream is required"):
        gpu.launch(k, (n_new, 1, 1), (hd, 1, 1), kq.row_smem_bytes(hd), None, pack)
