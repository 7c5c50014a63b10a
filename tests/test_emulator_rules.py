"""Where the emulator stands in for a driver rule, the rule is tested at its edge and one past it, both ways.

The dynamic shared memory rule runs on a GPU too (the same assertions hold for the real driver); the byte-exact
bounds of emulated memory are the emulator's own (a GPU does not fault on a one-byte overrun).
"""
from __future__ import annotations

import pytest

from hss import cuda_min as cm
from hss.cuda import ptx
from hss.cuda._driver import api, check
from hss.decls.selftest import SELFTEST_AXPY
from hss.errors import CudaError

SHARED_DEFAULT = 48 * 1024   # dynamic shared memory a launch may ask for without cuFuncSetAttribute


@pytest.fixture
def axpy(ctx):
    mod = ptx.load_module("selftest", ctx)
    yield mod.function("selftest_axpy")
    mod.close()


def _optin_limit(ctx) -> int:
    attr = api.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN
    return int(check(api.cuDeviceGetAttribute(attr, ctx.device), "cuDeviceGetAttribute"))


def _launch(fn, stream, shared: int, n: int = 64) -> None:
    with cm.DeviceBuffer(4 * n) as out, cm.DeviceBuffer(8 * n) as idx, cm.DeviceBuffer(4 * n) as x:
        cm.memset_d8_async(x, 0, 4 * n, stream)
        cm.launch_kernel(fn, 1, 64, shared, stream, SELFTEST_AXPY.pack(out, idx, x, x, 1.0, n, 1, 0))
        cm.stream_sync(stream)


def test_dynamic_shared_memory_up_to_48_kib_needs_no_opt_in(ctx, stream, axpy):
    _launch(axpy, stream, SHARED_DEFAULT)
    with pytest.raises(CudaError) as info:
        _launch(axpy, stream, SHARED_DEFAULT + 1)
    assert info.value.name == "CUDA_ERROR_INVALID_VALUE"


def test_the_opt_in_raises_the_limit_to_exactly_what_it_sets(ctx, stream, axpy):
    axpy.set_max_dynamic_shared(SHARED_DEFAULT + 16)
    try:
        _launch(axpy, stream, SHARED_DEFAULT + 16)
        with pytest.raises(CudaError) as info:
            _launch(axpy, stream, SHARED_DEFAULT + 17)
        assert info.value.name == "CUDA_ERROR_INVALID_VALUE"
    finally:
        axpy.set_max_dynamic_shared(0)


def test_the_opt_in_stops_at_the_device_limit(ctx, stream, axpy):
    limit = _optin_limit(ctx)
    axpy.set_max_dynamic_shared(limit)
    try:
        _launch(axpy, stream, limit)
    finally:
        axpy.set_max_dynamic_shared(0)
    with pytest.raises(CudaError) as info:
        axpy.set_max_dynamic_shared(limit + 1)
    assert info.value.name == "CUDA_ERROR_INVALID_VALUE"


@pytest.mark.emulator
@pytest.mark.parametrize("size", [1, 399, 400, 4093, 4096, 4097])
def test_emulated_memory_is_bounded_to_the_byte(ctx, size):
    """A view of exactly an allocation's bytes is allowed; one byte more faults (allocations are page-aligned,
    so only the recorded size can catch it)."""
    from hss.emulator.driver import S
    from hss.errors import MemoryFault
    with cm.DeviceBuffer(size) as buf:
        arena = S.arena
        assert arena.view(buf.ptr, size, "x").size == size
        assert arena.view(buf.ptr + size - 1, 1, "x").size == 1
        with pytest.raises(MemoryFault, match="runs 1 bytes past the end"):
            arena.view(buf.ptr, size + 1, "x")
        with pytest.raises(MemoryFault, match="runs 1 bytes past the end"):
            arena.view(buf.ptr + size - 1, 2, "x")


@pytest.mark.emulator
def test_a_kernel_reading_one_byte_past_its_buffer_faults(ctx, stream, axpy):
    from hss.errors import MemoryFault
    n = 100
    with cm.DeviceBuffer(4 * n) as out, cm.DeviceBuffer(8 * n) as idx, cm.DeviceBuffer(4 * n) as x, \
            cm.DeviceBuffer(4 * n - 1) as short:
        cm.memset_d8_async(x, 0, 4 * n, stream)
        cm.launch_kernel(axpy, 1, 128, 0, stream, SELFTEST_AXPY.pack(out, idx, x, x, 1.0, n, 1, 0))
        cm.stream_sync(stream)
        with pytest.raises(MemoryFault, match=r"parameter y.*runs 1 bytes past the end"):
            cm.launch_kernel(axpy, 1, 128, 0, stream, SELFTEST_AXPY.pack(out, idx, x, short, 1.0, n, 1, 0))
            cm.stream_sync(stream)
