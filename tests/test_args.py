"""The argument layer (hss._args): integers, device pointers, streams, host buffers — on any driver."""
from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hss import _args
from hss import cuda_min as cm
from hss.errors import HssError

from helpers import CudaArray, download, upload


class CAI:
    """A foreign array that speaks the CUDA array interface (as CuPy / Numba do)."""

    def __init__(self, ptr: int, shape: tuple, typestr: str, strides=None, readonly=False, stream=None,
                 version=3) -> None:
        self.__cuda_array_interface__ = {"shape": shape, "typestr": typestr, "data": (ptr, readonly),
                                         "version": version, "strides": strides, "stream": stream}


class DLPackOnly:
    """A foreign array that speaks only DLPack (as JAX does for bf16)."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def __dlpack__(self, **kw):
        return self.inner.__dlpack__(**kw)

    def __dlpack_device__(self):
        return self.inner.__dlpack_device__()


# -- integers ---------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [1.5, 2.0, float("nan"), True, np.bool_(True), "3", None, np.float32(1)])
def test_as_int_refuses_what_is_not_an_integer(bad):
    with pytest.raises(TypeError, match="width must be an int"):
        _args.as_int("width", bad)


@given(v=st.integers(-2**70, 2**70))
def test_as_int_gives_python_ints(v):
    for form in (v, *(t(v) for t in (np.int64, np.int32, np.uint32, np.uint64) if _fits(t, v))):
        got = _args.as_int("v", form)
        assert type(got) is int and got == v


def _fits(t, v) -> bool:
    info = np.iinfo(t)
    return info.min <= v <= info.max


def test_as_int_ranges_name_the_parameter_and_reason():
    assert _args.as_int("n", 5, 0, 10) == 5
    with pytest.raises(HssError, match=r"n = 11 must be in 0\.\.10: why not"):
        _args.as_int("n", 11, 0, 10, "why not")
    with pytest.raises(HssError, match="n = -1 must be >= 0"):
        _args.as_count("n", -1)
    with pytest.raises(HssError, match=r"layer 3 is out of range: there are 3 layers \(0\.\.2\)"):
        _args.as_index("layer", 3, 3, "layers")


def test_numpy_int32_products_do_not_wrap():
    a, b = np.int32(65536), np.int32(65536)
    assert _args.as_int("a", a) * _args.as_int("b", b) == 2**32


def test_dims3():
    assert _args.dims3("grid", 4) == (4, 1, 1)
    assert _args.dims3("grid", (np.int64(2), 3)) == (2, 3, 1)
    for bad in ((1.5, 1, 1), (0, 1, 1), (1, 1, 1, 1), (), (True, 1, 1), "4"):
        with pytest.raises((TypeError, HssError)):
            _args.dims3("grid", bad)


def test_as_float():
    assert _args.as_float("eps", np.float32(0.5)) == 0.5
    with pytest.raises(HssError, match="finite"):
        _args.as_float("eps", float("nan"))
    with pytest.raises(TypeError):
        _args.as_float("eps", True)


# -- device pointers --------------------------------------------------------------------------
def test_int_pointers_inside_hss_buffers_are_bounds_checked(ctx):
    with cm.DeviceBuffer(256) as buf:
        base = buf.ptr
        assert _args.pointer(base + 64, "x", 192) == base + 64
        with pytest.raises(HssError, match="x: 193 bytes at offset 64 run past the end of its 256-byte buffer"):
            _args.pointer(base + 64, "x", 193)
        check = _args.pointer_arg("x", 192, 4)
        assert check(base + 64) == base + 64
        with pytest.raises(HssError, match="run past the end"):
            check(base + 68)
        with pytest.raises(HssError, match="4-byte aligned"):
            check(base + 2)
    with pytest.raises(HssError, match="null pointer"):
        _args.pointer(0, "x", 4)
    with pytest.raises(HssError, match="not a device address"):
        _args.pointer(-8, "x", 4)
    assert _args.pointer(0, "x", 0) == 0   # nothing to read: null is fine
    with pytest.raises(HssError, match="null pointer"):
        _args.pointer_arg("x", None)(0)     # size unknown: null is refused


def test_closed_buffers_and_views_say_closed(ctx):
    buf = cm.DeviceBuffer(64)
    view = buf.view("f32")
    buf.close()
    for obj in (buf, view):
        with pytest.raises(HssError, match="closed"):
            _args.pointer(obj, "x", 4)
        with pytest.raises(HssError, match="closed"):
            _args.pointer_arg("x", 4)(obj)
    with pytest.raises(HssError, match="closed"):
        buf.ptr  # noqa: B018 (the stale address is never handed out)


def test_buffers_and_views_carry_size_and_dtype(ctx):
    with cm.DeviceBuffer(64) as buf:
        assert _args.pointer(buf, "x", 64) == buf.ptr
        with pytest.raises(HssError, match="x holds 64 bytes but 65 are needed"):
            _args.pointer(buf, "x", 65)
        assert _args.pointer(buf, "x", 8, dtype="bf16") == buf.ptr          # raw bytes match any dtype
        f = buf.view("f32", (4, 2), offset=16)
        assert (f.ptr, f.nbytes, f.shape, f.dtype) == (buf.ptr + 16, 32, (4, 2), "f32")
        assert _args.pointer(f, "x", 32, 4, "f32") == buf.ptr + 16
        with pytest.raises(HssError, match="x holds f32 but bf16 is needed"):
            _args.pointer(f, "x", 8, dtype="bf16")
        with pytest.raises(HssError, match="needs 72 bytes"):
            buf.view("f32", (4, 2), offset=40)
        with pytest.raises(HssError, match="multiple of the f32 item size"):
            buf.view("f32", offset=2)
        assert buf.view(ml_dtypes.bfloat16).shape == (32,)
        assert buf.view(np.int32, 3).nbytes == 12


def test_cuda_array_interface_is_read_and_checked(ctx):
    with cm.DeviceBuffer(4096) as buf:
        p = buf.ptr
        assert _args.pointer(CAI(p, (4, 8), "<f4"), "x", 128, 4, "f32") == p
        with pytest.raises(HssError, match="x holds 16 bytes but 4096 are needed"):
            _args.pointer(CAI(p, (4,), "<f4"), "x", 4096)
        with pytest.raises(HssError, match="not C-contiguous"):
            _args.pointer(CAI(p, (4, 8), "<f4", strides=(4, 16)), "x", 4)
        assert _args.pointer(CAI(p, (4, 8), "<f4", strides=(32, 4)), "x", 128) == p   # explicit C strides
        assert _args.pointer(CAI(p, (1, 8), "<f4", strides=(999, 4)), "x", 32) == p   # size-1 dims: any stride
        with pytest.raises(HssError, match="holds i32 but f32 is needed"):
            _args.pointer(CAI(p, (4,), "<i4"), "x", 16, dtype="f32")
        assert _args.pointer(CAI(p, (8,), "<V2"), "x", 16, dtype="bf16") == p      # untyped 2-byte items
        with pytest.raises(HssError, match="read-only but is written"):
            _args.pointer(CAI(p, (4,), "<f4", readonly=True), "x", 16, write=True)
        with pytest.raises(HssError, match="stream 0 is disallowed"):
            _args.pointer(CAI(p, (4,), "<f4", stream=0), "x", 16, stream=1)
        with pytest.raises(HssError, match="malformed"):
            _args.pointer(type("Bad", (), {"__cuda_array_interface__": {"shape": (4,)}})(), "x")


def test_a_copy_never_overruns_what_the_interface_says(ctx, stream):
    with cm.DeviceBuffer(4096) as buf:
        small = CAI(buf.ptr, (4,), "<f4")   # says 16 bytes
        with pytest.raises(HssError, match="holds 16 bytes but 4096 are needed"):
            cm.copy_h_to_d_async(small, np.zeros(4096, np.uint8), 4096, stream)


@pytest.mark.emulator
def test_cai_stream_orders_the_consumer_after_the_producer(ctx):
    """A producer's pending work on its stream is ordered before the consumer's copy (the protocol's promise)."""
    producer, consumer = cm.CudaStream(ctx), cm.CudaStream(ctx)
    with cm.DeviceBuffer(64) as src, cm.DeviceBuffer(64) as dst:
        cm.memset_d8_async(src, 7, 64, producer)          # queued on the producer, not run yet (emulator)
        cm.copy_d_to_d_async(dst, CAI(src.ptr, (64,), "|u1", stream=producer.handle), 64, consumer)
        assert (download(dst, 64, np.uint8, consumer) == 7).all()
        cm.memset_d8_async(src, 9, 64, producer)
        cm.copy_d_to_d_async(dst, CAI(src.ptr, (64,), "|u1", stream=None), 64, consumer)   # None: no ordering
        got = download(dst, 64, np.uint8, consumer)
        assert (got == 7).all()   # the memset was not ordered before the copy
    producer.close()
    consumer.close()


def test_dlpack_producers_are_read(ctx, stream):
    with cm.DeviceBuffer(256) as buf:
        view = buf.view("bf16", (8, 16))
        assert _args.pointer(DLPackOnly(view), "x", 256, 2, "bf16") == buf.ptr
        with pytest.raises(HssError, match="holds 256 bytes but 512"):
            _args.pointer(DLPackOnly(view), "x", 512)
        with pytest.raises(HssError, match="holds bf16 but f32"):
            _args.pointer(DLPackOnly(view), "x", 16, dtype="f32")
    with pytest.raises(HssError, match="host numpy array"):
        _args.pointer(np.zeros(4, np.float32), "x")
    with pytest.raises(HssError, match="host memory"):
        _args.pointer(DLPackOnly(np.zeros(4, np.float32)), "x")


def test_host_dlpack_producers_are_host_memory_with_or_without_a_stream(ctx, stream):
    """A CPU producer takes no stream (numpy raises on one): hss asks __dlpack_device__ first and refuses it."""
    s = _args.stream(stream)
    for st_arg in (None, s):
        with pytest.raises(HssError, match="dst is host memory .*CPU"):
            _args.pointer(DLPackOnly(np.zeros(4, np.float32)), "dst", 16, stream=st_arg)


class BrokenDLPack:
    """A producer whose ``__dlpack__`` returns something that is not a capsule, or whose device query fails."""

    def __init__(self, result=42, device=(2, 0)) -> None:
        self.result, self.device = result, device

    def __dlpack__(self, **kw):
        return self.result

    def __dlpack_device__(self):
        if isinstance(self.device, Exception):
            raise self.device
        return self.device


@pytest.mark.parametrize("producer", [BrokenDLPack(), BrokenDLPack(result=None), BrokenDLPack(device="gpu"),
                                      BrokenDLPack(device=RuntimeError("no device"))])
def test_broken_dlpack_producers_are_clear_errors(ctx, stream, producer):
    for st_arg in (None, _args.stream(stream)):
        with pytest.raises(HssError, match="^x: its (DLPack export failed|__dlpack_device__)"):
            _args.pointer(producer, "x", 16, stream=st_arg)


@pytest.mark.parametrize("bad", [1.5, True, "0x10", None, object(), [1, 2]])
def test_non_pointers_are_type_errors(bad):
    with pytest.raises(TypeError, match="x: cannot use"):
        _args.pointer(bad, "x")


def test_numpy_integer_addresses_are_addresses(ctx):
    with cm.DeviceBuffer(64) as buf:
        assert _args.pointer(np.uint64(buf.ptr), "x", 64) == buf.ptr
        with pytest.raises(HssError, match="run past the end"):
            _args.pointer(np.uint64(buf.ptr), "x", 65)


# -- exports ----------------------------------------------------------------------------------
def test_device_memory_exports_the_interfaces(ctx, stream):
    data = np.arange(32, dtype=np.float32)
    with upload(data, stream) as buf:
        cai = buf.__cuda_array_interface__
        assert cai == {"shape": (128,), "typestr": "|u1", "data": (buf.ptr, False), "version": 3, "strides": None,
                       "stream": None}
        view = buf.view("f32", (4, 8))
        assert view.__cuda_array_interface__["typestr"] == "<f4"
        assert view.__cuda_array_interface__["shape"] == (4, 8)
        with pytest.raises(TypeError, match="cannot describe bf16"):
            buf.view("bf16").__cuda_array_interface__  # noqa: B018
        assert buf.__dlpack_device__() == (2, 0) and view.__dlpack_device__() == (2, 0)
        # a DLPack consumer (cuda.core's view) sees the same memory, shape and dtype, zero-copy
        smv = pytest.importorskip("cuda.core.utils").StridedMemoryView.from_dlpack
        v = smv(view, -1)
        assert (v.ptr, tuple(v.shape), np.dtype(v.dtype)) == (buf.ptr, (4, 8), np.float32)
        vb = smv(buf.view("bf16", (64,)), -1)
        assert np.dtype(vb.dtype) == np.dtype(ml_dtypes.bfloat16)
        with pytest.raises(BufferError):
            buf.__dlpack__(dl_device=(1, 0))
        with pytest.raises(BufferError):
            buf.__dlpack__(copy=True)


def test_dlpack_capsules_keep_their_owner_and_are_released():
    import gc

    from hss import _dlpack
    before = len(_dlpack._live)
    with cm.DeviceBuffer(64) as buf:
        for max_version in (None, (1, 0), (0, 8)):
            cap = buf.__dlpack__(max_version=max_version)
            assert len(_dlpack._live) == before + 1
            assert ("versioned" in repr(cap)) == (max_version == (1, 0))
            del cap
            gc.collect()
            assert len(_dlpack._live) == before   # an unconsumed capsule frees its tensor


# -- streams ----------------------------------------------------------------------------------
def test_every_stream_form(ctx):
    s = cm.CudaStream(ctx)

    class Proto:
        def __cuda_stream__(self):
            return (0, s.handle)

    assert _args.stream(s) == s.handle
    assert _args.stream(Proto()) == s.handle
    assert _args.stream(ctx) == ctx.stream
    assert _args.stream(np.uint64(s.handle)) == s.handle
    assert _args.stream(0) == 0
    s.close()
    with pytest.raises(HssError, match="CudaStream is closed"):
        _args.stream(s)
    for bad in (None, 1.5, True, "s", object()):
        with pytest.raises(TypeError, match="stream is required"):
            _args.stream(bad)
    with pytest.raises(HssError, match="not a stream handle"):
        _args.stream(-1)


# -- host buffers -----------------------------------------------------------------------------
def test_host_buffers(ctx):
    a = np.zeros(16, np.float32)
    assert _args.host_buffer(a, 64, True, "h") == a.ctypes.data
    with pytest.raises(HssError, match="holds 64 bytes but 65"):
        _args.host_buffer(a, 65, False, "h")
    with pytest.raises(HssError, match="C-contiguous"):
        _args.host_buffer(a[::2], 4, False, "h")
    ro = a.copy()
    ro.setflags(write=False)
    with pytest.raises(HssError, match="read-only"):
        _args.host_buffer(ro, 4, True, "h")
    with pytest.raises(HssError, match="not a host address"):
        _args.host_buffer(0, 4, False, "h")
    assert _args.host_buffer(b"abcd", 4, False, "h")
    with cm.PinnedBuffer(32) as pin:
        assert _args.host_buffer(pin, 32, True, "h") == pin.ptr
        with pytest.raises(HssError, match="run past the end"):
            _args.host_buffer(pin.ptr + 8, 32, True, "h")
    with pytest.raises(HssError, match="closed"):
        _args.host_buffer(pin, 4, False, "h")
    with cm.DeviceBuffer(32) as dev, pytest.raises(HssError, match="is device memory"):
        _args.host_buffer(dev, 4, False, "h")
    with pytest.raises(TypeError, match="host buffer"):
        _args.host_buffer(1.5, 4, False, "h")


def test_dtype_names():
    assert _args.dtype_name(ml_dtypes.bfloat16) == "bf16"
    assert _args.dtype_name(np.float32) == "f32" and _args.dtype_name("i32") == "i32"
    with pytest.raises(TypeError):
        _args.dtype_name(np.complex64)
    assert math.prod(()) == 1


def test_a_collected_buffer_leaves_the_registry(ctx):
    """A buffer dropped without close() is forgotten with its memory: the driver may hand its address to the next
    allocation, which must not be checked against the old size."""
    import gc
    buf = cm.DeviceBuffer(4096)
    ptr = buf.ptr
    assert _args.RANGES.find(ptr) == (ptr, ptr + 4096)
    del buf
    gc.collect()
    assert _args.RANGES.find(ptr) is None
    with cm.PinnedBuffer(64) as pin:
        p = pin.ptr
    assert _args.RANGES.find(p) is None


def test_prepared_int_checks_remember_only_while_the_buffers_stay():
    """pointer_arg passes an address it already passed at once, but not for more bytes, and not once the live
    buffers changed (a new allocation may now hold that address)."""
    base = 0x7F00_0000_0000
    check = _args.pointer_arg("x", None)
    assert check(base, nbytes=256) == base          # no live buffer there: trusted
    key = _args.RANGES.add(base, 128)               # as if the driver handed that address to a new 128-byte buffer
    try:
        with pytest.raises(HssError, match="256 bytes at offset 0 run past the end of its 128-byte buffer"):
            check(base, nbytes=256)
        assert check(base, nbytes=64) == base
        with pytest.raises(HssError, match="run past the end"):
            check(base, nbytes=129)                 # more than the remembered size: checked again
    finally:
        _args.RANGES.remove(key)
    assert check(base, nbytes=256) == base


# -- stream joins happen only after every check -----------------------------------------------------
@pytest.fixture
def joins(monkeypatch):
    """The (consumer, producer) joins the argument layer asks for, recorded and made."""
    made: list[tuple[int, int]] = []
    real = _args._stream_join

    def record(consumer, producer):
        made.append((consumer, producer))
        real(consumer, producer)

    monkeypatch.setattr(_args, "_stream_join", record)
    return made


def test_joins_wait_for_every_check_of_the_call(ctx, joins):
    """Inside deferred_joins a producer's join is queued only when the block exits normally: a later argument that
    fails drops it; nested blocks join at the outermost exit, once per (consumer, producer)."""
    producer, consumer = cm.CudaStream(ctx), cm.CudaStream(ctx)
    with cm.DeviceBuffer(64) as buf:
        cai = CAI(buf.ptr, (64,), "|u1", stream=producer.handle)
        _args.pointer(cai, "x", 64, stream=consumer.handle)          # outside a block: at once (the old rule)
        assert joins == [(consumer.handle, producer.handle)]
        del joins[:]
        with pytest.raises(HssError, match="y holds 64 bytes but 128"):
            with _args.deferred_joins():
                _args.pointer(cai, "x", 64, stream=consumer.handle)
                _args.pointer(cai, "y", 128, stream=consumer.handle)
        assert joins == [], "a call that failed on a later argument joined a stream"
        with _args.deferred_joins():
            _args.pointer(cai, "x", 64, stream=consumer.handle)
            with _args.deferred_joins():
                _args.pointer(cai, "y", 32, stream=consumer.handle)
                assert joins == []
            with pytest.raises(HssError):
                with _args.deferred_joins():   # an inner block that fails drops only its own joins
                    _args.pointer(CAI(buf.ptr, (64,), "|u1", stream=ctx.stream), "z", 64, stream=consumer.handle)
                    raise HssError("inner")
            assert joins == []
        assert joins == [(consumer.handle, producer.handle)]
        assert _args._joins.marks == [] and _args._joins.pending == []
    producer.close()
    consumer.close()


@pytest.mark.emulator
def test_a_failed_call_orders_nothing_on_the_emulator(ctx, joins, gpu):
    """End to end through a component: decode_select with a CAI ``normed`` (its producer stream pending) and a bad
    k_pool queues no join; the good call joins and then sees the producer's data."""
    import math as m

    from hss.qsa import QsaIndexer
    hidden, hd = 64, 128
    rng = np.random.default_rng(3)
    s = ctx.stream
    w = upload((rng.standard_normal((5 * hd, hidden)) / m.sqrt(hidden)).astype(ml_dtypes.bfloat16), s)
    norms = upload(np.ones(hd, ml_dtypes.bfloat16), s)
    producer = cm.CudaStream(ctx)
    with QsaIndexer(w, norms, norms, 4, hd, 4, 8, 64, 1e7, 1e-6, hidden, 2, 64, gpu, max_tokens=64) as idx, \
            cm.DeviceBuffer(hidden * 2) as x, cm.DeviceBuffer(16 * 2 * 64 * 2) as pool, cm.DeviceBuffer(4) as table:
        seq = idx.new_seq_state()
        cm.stream_sync(s)
        normed = CAI(x.ptr, (hidden * 2,), "|u1", stream=producer.handle)
        with pytest.raises(HssError, match="k_pool holds 4 bytes"):
            idx.decode_select(seq, normed, 0, table, pool, table, 16, s)
        assert joins == [] and seq.ingested == 0
        idx.decode_select(seq, normed, 0, pool, pool, table, 16, s)
        assert joins == [(s, producer.handle)] and seq.ingested == 1
        idx.release_seq_state(seq)
    producer.close()
    for b in (w, norms):
        b.close()


# -- own memory and overlapping arguments -------------------------------------------------------------
ranges = st.lists(st.tuples(st.integers(0, 200), st.integers(1, 40)), max_size=6)


@given(ranges, st.integers(0, 300), st.integers(0, 60))
def test_owned_ranges_find_every_overlap(spans, ptr, n):
    """OwnedRanges.overlap against a brute force over disjoint ranges (made disjoint by construction)."""
    owned = _args.OwnedRanges()
    taken: list[tuple[int, int, str]] = []
    at = 0
    for i, (gap, size) in enumerate(spans):
        at += gap
        owned.add(at, size, f"range {i}")
        taken.append((at, at + size, f"range {i}"))
        at += size
    hits = [label for a, b, label in taken if n > 0 and a < ptr + n and ptr < b]
    got = owned.overlap(ptr, n)
    assert (got is None) == (not hits) and (got is None or got in hits)
    if hits:
        with pytest.raises(HssError, match=rf"x \({ptr:#x}, {n} bytes\) overlaps range \d+, memory that me owns"):
            owned.check(ptr, n, "x", "me")
    else:
        owned.check(ptr, n, "x", "me")
    for a, _, _ in taken:
        owned.remove(a)
    assert len(owned) == 0 and owned.overlap(ptr, n) is None


def test_disjoint_refuses_a_written_argument_over_another():
    _args.disjoint("f", ("a", 0, 16, False), ("b", 8, 16, False))           # two reads may overlap
    _args.disjoint("f", ("out", 0, 16, True), ("b", 16, 16, False), ("c", 0, 0, False))   # touching: fine
    with pytest.raises(HssError, match=r"f: out overlaps q \(16 bytes at 0x8, 16 bytes at 0x0\): out is written"):
        _args.disjoint("f", ("q", 0, 16, False), ("out", 8, 16, True))
    with pytest.raises(HssError, match="f: a overlaps b"):
        _args.disjoint("f", ("a", 0, 16, True), ("b", 0, 16, True))


# -- remembered checks ---------------------------------------------------------------------------------
def test_memo_keys_name_what_the_checks_read(ctx, monkeypatch):
    """An int is its own key; a DeviceBuffer has a key object of its own (None once closed), a view its buffer's key and
    its extent; a foreign array with the CUDA array interface what the interface says now (and, with several devices,
    the device it is on); a torch tensor what its check reads; anything else none."""
    monkeypatch.setattr(_args.DEVICES, "many", False)
    with cm.DeviceBuffer(64) as a, cm.DeviceBuffer(64) as b:
        assert _args.memo_key(a.ptr) == a.ptr
        for other in (True, np.int64(a.ptr), float(a.ptr), None, "x", [a.ptr], DLPackOnly(a)):
            assert _args.memo_key(other) is _args.NO_KEY
        with pytest.raises(TypeError):
            hash((a.ptr, _args.NO_KEY))   # a key holding it is never kept
        key = _args.memo_key(a)
        assert key is not _args.NO_KEY and _args.memo_key(a) is key and _args.memo_key(b) not in (key, _args.NO_KEY)
        v1, v2 = a.view("f32"), a.view("f32")
        assert _args.memo_key(v1) == _args.memo_key(v2)
        for other in (a.view("f32", (8,)), a.view("i32"), a.view("f32", offset=4), b.view("f32")):
            assert _args.memo_key(other) != _args.memo_key(v1)
        v1.offset = 4   # a view changed in place has another key
        assert _args.memo_key(v1) != _args.memo_key(v2)
        x = CudaArray(a, (64,), "|u1")
        _args.device_arg(x, "x")   # a type's reader (and key) is found at its first check
        key = _args.memo_key(x)
        assert key is not _args.NO_KEY and key == _args.memo_key(CudaArray(a, (64,), "|u1"))
        for change in (dict(shape=(32,)), dict(typestr="<f4"), dict(readonly=True), dict(stream=2), dict(ptr=b.ptr)):
            fields = dict(dict(ptr=a.ptr, shape=(64,), typestr="|u1"), **change)
            assert _args.memo_key(CudaArray(**fields)) != key, change
        x.shape = (32,)   # changed in place
        assert _args.memo_key(x) != key
        monkeypatch.setattr(_args.DEVICES, "many", True)   # the device check then reads more than the interface
        assert _args.memo_key(x) not in (_args.NO_KEY, key) and _args.memo_key(x)[-1] == a.device
    assert _args.memo_key(a) is _args.NO_KEY and _args.memo_key(v2) is _args.NO_KEY
    with cm.PinnedBuffer(64) as pin:
        assert _args.memo_key(pin) is _args.NO_KEY


def test_torch_keys_follow_a_tensor_changed_in_place():
    torch = pytest.importorskip("torch")

    def first_read(t):   # a CPU tensor is no device array, but its type's reader and key are found
        with pytest.raises(HssError, match="torch tensor on cpu"):
            _args.device_arg(t, "t")
        return t

    t = first_read(torch.zeros(16))
    assert _args.memo_key(t) == _args.memo_key(t) and hash(_args.memo_key(t)) == hash(_args.memo_key(t))
    same_storage = [
        (lambda: torch.zeros(16), lambda t: t.resize_(8)),                  # fewer bytes, same address
        (lambda: torch.zeros(4, 4), lambda t: t.t_()),                     # not contiguous, same bytes and address
        (lambda: torch.zeros(16), lambda t: setattr(t, "data", t.view(torch.int32))),   # another dtype, same bytes
        (lambda: torch.zeros(16), lambda t: t.set_(torch.zeros(16))),       # another storage
        (lambda: torch.zeros(16), lambda t: setattr(t, "data", torch.zeros(16, dtype=torch.float64)))]
    for make, change in same_storage:
        t = first_read(make())
        before = _args.memo_key(t)
        change(t)
        assert _args.memo_key(t) != before


def _outcome(fn, *args):
    try:
        return ("ok", fn(*args))
    except (HssError, TypeError) as exc:
        return (type(exc).__name__, str(exc))


changes = st.lists(st.sampled_from(["shrink", "grow", "retype", "readonly", "move", "narrow", "close", "alloc",
                                    "reuse"]), min_size=1, max_size=3)
rounds = st.lists(st.tuples(st.sampled_from([0, 1, 2, 3, 3, 4, 4, 5, 5]), st.sampled_from([0, 1, 2, 2, 3]),
                            st.sampled_from([1, 2, 4]), st.sampled_from(["-", "bf16", "f32", "u8"]), st.booleans(),
                            changes), min_size=1, max_size=12)


def _size(obj) -> int:
    if isinstance(obj, CudaArray):
        return math.prod(obj.shape) * int(obj.typestr[2:])
    return obj.nbytes if isinstance(obj, cm.DeviceView) else 1024


@settings(settings.default, max_examples=max(settings.default.max_examples, 60))   # cheap: more rounds
@given(rounds)
def test_a_remembered_check_answers_as_the_full_check(ctx, rounds):
    """Whatever happens between two checks of one argument (a foreign array resized, retyped, made read-only or moved,
    a buffer closed, buffers allocated, a freed address handed to a smaller buffer), a check remembered under
    (RANGES.generation, memo key, the check's parameters) gives what the full check gives."""
    table = _args.Remembered(8)
    bufs = [cm.DeviceBuffer(1024), cm.DeviceBuffer(1024)]
    addresses = [b.ptr for b in bufs]
    objects = [addresses[0], bufs[0], bufs[0].view("bf16"), bufs[1].view("f32", (128,), 256),
               CudaArray(bufs[1], (512,), "<V2"), CudaArray(addresses[0] + 512, (128,), "<f4")]
    for obj in objects:
        _outcome(_args.device_arg, obj, "x")   # every type's reader found
    made, taken = [], []

    def check(obj, need, align, dtype, write):
        args = (obj, "x", need, align, None if dtype == "-" else dtype, write)
        key = (_args.RANGES.generation, _args.memo_key(obj), need, align, dtype, write)
        assert _outcome(table.check, key, _args.pointer, *args) == _outcome(_args.pointer, *args)

    try:
        for i, part, align, dtype, write, change in rounds:
            obj = objects[i]
            need = (0, _size(obj) // 2, _size(obj), 2048)[part]   # none, half, all of what it holds, more
            array = obj if isinstance(obj, CudaArray) else objects[4 + i % 2]
            view = obj if isinstance(obj, cm.DeviceView) else objects[3]
            check(obj, need, align, dtype, write)
            for op in change:
                if op in ("shrink", "grow"):
                    array.shape = (array.shape[0] // 2 if op == "shrink" else array.shape[0] * 2,)
                elif op == "retype":
                    array.typestr = {"<V2": "<f4", "<f4": "|u1", "|u1": "<V2"}[array.typestr]
                elif op == "readonly":
                    array.readonly = not array.readonly
                elif op == "move":
                    array.ptr += 2
                elif op == "narrow":   # a view's fields changed in place
                    view.shape, view.nbytes = (view.shape[0] // 2,), view.nbytes // 2
                elif op == "close":
                    bufs[i % 2].close()
                elif op == "alloc":
                    made.append(cm.DeviceBuffer(64))
                elif bufs[0].closed and not taken:   # reuse: the driver hands the freed address to a smaller buffer
                    taken.append(_args.RANGES.add(addresses[0], 128, 0))
            check(obj, need, align, dtype, write)
    finally:
        for key in taken:
            _args.RANGES.remove(key)
        for b in bufs + made:
            b.close()


def test_a_remembered_table_keeps_at_most_its_size_and_only_what_passed():
    table = _args.Remembered(4)
    for i in range(10):
        assert table.check((0, i), int, i) == i
        assert len(table) <= 4
    assert table.get((0, 9)) == 9
    assert table.check(None, int, 5) == 5 and table.check((0, _args.NO_KEY), int, 6) == 6   # an argument without
    assert table.check((0, [1]), int, 7) == 7                                                # a key; an unhashable one
    with pytest.raises(TypeError):
        table.check((1, 1), int, None)                                                # a check that fails
    assert all(k[1] in range(10) for k in table) and len(table) <= 4
    table.clear()
    assert len(table) == 0


def test_remembered_checks_ask_for_their_joins_again(ctx, joins):
    """An interface's producer stream is joined at every recall of its check, as its check joined it (deferred inside
    deferred_joins, dropped when the call fails later), and such an entry is not found by a plain lookup."""
    producer, consumer = cm.CudaStream(ctx), cm.CudaStream(ctx)
    with cm.DeviceBuffer(64) as buf:
        cai = CudaArray(buf, (64,), "|u1", stream=producer.handle)
        _args.device_arg(cai, "x")
        table = _args.Remembered()
        key = (_args.RANGES.generation, _args.memo_key(cai))
        for _ in range(3):
            assert table.get(key) is None
            assert table.check(key, _args.pointer, cai, "x", 64, 1, None, False, consumer.handle) == buf.ptr
        assert joins == [(consumer.handle, producer.handle)] * 3 and len(table) == 1
        del joins[:]
        with pytest.raises(HssError, match="a later argument"):
            with _args.deferred_joins():
                table.check(key, _args.pointer, cai, "x", 64, 1, None, False, consumer.handle)
                raise HssError("a later argument")
        assert joins == []
    producer.close()
    consumer.close()
