"""hss with torch, CuPy and JAX on a real GPU: each consumes hss device memory zero-copy (CUDA array interface and
DLPack), and hss consumes theirs (torch's fast path, CuPy's CUDA array interface with its stream, JAX's DLPack),
streams included. The emulator-side rules of the same protocols are in tests/test_args.py."""
from __future__ import annotations

import os

import numpy as np
import pytest

from hss import _args
from hss import cuda_min as cm
from hss.errors import HssError

from helpers import download, upload

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")   # JAX must not take the GPU's memory

pytestmark = pytest.mark.gpu


def _torch():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device")
    return torch


# -- torch ------------------------------------------------------------------------------------
def test_torch_consumes_hss_memory_zero_copy(ctx, stream):
    torch = _torch()
    data = np.arange(64, dtype=np.float32)
    with upload(data, stream) as buf:
        cm.stream_sync(stream)
        t = torch.as_tensor(buf.view("f32", (8, 8)), device="cuda")          # CUDA array interface
        assert t.data_ptr() == buf.ptr and t.shape == (8, 8) and t.dtype == torch.float32
        assert torch.equal(t.flatten().cpu(), torch.from_numpy(data))
        b = torch.from_dlpack(buf.view("bf16", (128,)))                       # DLPack, bf16 included
        assert b.data_ptr() == buf.ptr and b.dtype == torch.bfloat16
        raw = torch.from_dlpack(buf)
        assert raw.data_ptr() == buf.ptr and raw.dtype == torch.uint8 and raw.numel() == 256
        t.mul_(2)                                                             # torch writes, hss reads
        torch.cuda.synchronize()
        assert (download(buf, 64, np.float32, stream) == 2 * data).all()
        del t, b, raw


def test_hss_consumes_torch_tensors(ctx, stream):
    torch = _torch()
    src = torch.arange(256, dtype=torch.float32, device="cuda")
    dst = torch.full((256,), -1.0, dtype=torch.float32, device="cuda")
    torch.cuda.synchronize()
    cm.copy_d_to_d_async(dst, src, 1024, stream)
    cm.stream_sync(stream)
    assert torch.equal(dst, src)
    check = _args.pointer_arg("q", 512, 2, "bf16")
    bf = torch.zeros(256, dtype=torch.bfloat16, device="cuda")
    assert check(bf) == bf.data_ptr()                                         # the fast path
    assert check(torch.zeros(512, dtype=torch.uint8, device="cuda")) > 0      # bytes match any dtype
    for bad, match in ((torch.zeros(256, dtype=torch.float32, device="cuda"), "holds f32 but bf16"),
                       (torch.zeros(255, dtype=torch.bfloat16, device="cuda"), "holds 510 bytes but 512"),
                       (torch.zeros(512, dtype=torch.bfloat16, device="cuda")[::2], "non-contiguous"),
                       (torch.zeros(256, dtype=torch.bfloat16), "on cpu")):
        with pytest.raises(HssError, match=match):
            check(bad)
    with pytest.raises(HssError, match="holds 16 bytes but 1024"):
        cm.copy_d_to_d_async(dst, torch.zeros(4, device="cuda"), 1024, stream)


def test_torch_streams(ctx):
    torch = _torch()
    s = torch.cuda.Stream()
    assert _args.stream(s) == s.cuda_stream
    with cm.DeviceBuffer(64) as buf:
        cm.memset_d8_async(buf, 5, 64, s)
        s.synchronize()
        assert (download(buf, 64, np.uint8, 0) == 5).all()


# -- CuPy -------------------------------------------------------------------------------------
def _cupy():
    cupy = pytest.importorskip("cupy")
    try:
        cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:
        pytest.skip(f"CuPy has no device: {exc}")
    return cupy


def test_cupy_consumes_hss_memory_zero_copy(ctx, stream):
    cupy = _cupy()
    data = np.arange(64, dtype=np.float32)
    with upload(data, stream) as buf:
        cm.stream_sync(stream)
        a = cupy.asarray(buf.view("f32", (64,)))                              # CUDA array interface: a view
        assert a.data.ptr == buf.ptr and (cupy.asnumpy(a) == data).all()
        d = cupy.from_dlpack(buf.view("i32", (64,)))
        assert d.data.ptr == buf.ptr and d.dtype == cupy.int32
        a *= 3
        cupy.cuda.Device().synchronize()
        assert (download(buf, 64, np.float32, stream) == 3 * data).all()


def test_hss_consumes_cupy_arrays_in_their_stream_order(ctx, stream):
    """CuPy's interface names its current stream; hss orders its own stream after it (no host wait)."""
    cupy = _cupy()
    producer = cupy.cuda.Stream(non_blocking=True)
    dst = cm.DeviceBuffer(4 << 20)
    with producer:
        src = cupy.arange(1 << 20, dtype=cupy.float32)   # queued on the producer stream
        src *= 2
        cm.copy_d_to_d_async(dst, src, 4 << 20, stream)   # the interface says "producer": the copy waits for it
    got = download(dst, 1 << 20, np.float32, stream)
    assert (got == 2 * np.arange(1 << 20, dtype=np.float32)).all()
    assert _args.stream(producer) == producer.ptr
    with pytest.raises(HssError, match="holds 4194304 bytes but 4194308"):
        cm.copy_d_to_d_async(dst, src, (4 << 20) + 4, stream)
    with pytest.raises(HssError, match="holds f32 but i32"):
        _args.pointer(src, "x", 4, dtype="i32")
    dst.close()


# -- JAX --------------------------------------------------------------------------------------
def _jax():
    jax = pytest.importorskip("jax")
    try:
        if not jax.devices("gpu"):
            pytest.skip("JAX has no GPU")
    except RuntimeError as exc:
        pytest.skip(f"JAX has no GPU: {exc}")
    return jax


def test_hss_consumes_jax_arrays(ctx, stream):
    jax = _jax()
    jnp = jax.numpy
    x = jnp.arange(256, dtype=jnp.float32)
    x.block_until_ready()
    ptr = _args.pointer(x, "x", 1024, 4, "f32")
    assert ptr == x.unsafe_buffer_pointer()
    host = np.empty(256, np.float32)
    cm.copy_d_to_h_async(host, x, 1024, stream)
    assert (host == np.arange(256)).all()
    b = jnp.ones(64, dtype=jnp.bfloat16)
    b.block_until_ready()
    assert _args.pointer(b, "b", 128, 2, "bf16") == b.unsafe_buffer_pointer()   # bf16: DLPack
    with pytest.raises(HssError, match="holds 128 bytes but 256"):
        _args.pointer(b, "b", 256)


def test_jax_consumes_hss_memory(ctx, stream):
    jax = _jax()
    data = np.arange(64, dtype=np.float32)
    with upload(data, stream) as buf:
        cm.stream_sync(stream)
        y = jax.dlpack.from_dlpack(buf.view("f32", (64,)))
        assert (np.asarray(y) == data).all()
        assert y.unsafe_buffer_pointer() == buf.ptr, "JAX copied instead of viewing"
        del y
