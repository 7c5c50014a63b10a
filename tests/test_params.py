"""Parameter packing: exact widths, range checks, errors that name the parameter; no GPU needed."""
from __future__ import annotations

import ctypes
import struct

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from hss import HssError
from hss._args import device_ptr
from hss._params import ParamPack, convert
from hss.decls import DECLARATIONS, declare
from hss.decls.selftest import SELFTEST_AXPY


def raw_slots(pack: ParamPack) -> list[bytes]:
    ptrs = (ctypes.c_void_p * len(pack.kinds)).from_address(pack.address)
    sizes = {"ptr": 8, "i64": 8, "i32": 4, "u32": 4, "f32": 4}
    return [ctypes.string_at(ptrs[i], sizes[k]) for i, k in enumerate(pack.kinds)]


@given(i32=st.integers(-2**31, 2**31 - 1), u32=st.integers(0, 2**32 - 1), i64=st.integers(-2**63, 2**63 - 1),
       ptr=st.integers(0, 2**64 - 1), f=st.floats(width=32, allow_nan=False))
def test_values_land_at_their_exact_widths(i32, u32, i64, ptr, f):
    pack = ParamPack(("i32", "u32", "i64", "ptr", "f32"), ("a", "b", "c", "d", "e")).fill(i32, u32, i64, ptr, f)
    raw = raw_slots(pack)
    assert raw == [struct.pack("<i", i32), struct.pack("<I", u32), struct.pack("<q", i64),
                   struct.pack("<Q", ptr), struct.pack("<f", f)]


@pytest.mark.parametrize("kind,value", [("i32", 2**31), ("i32", -2**31 - 1), ("u32", -1), ("u32", 2**32),
                                        ("i64", 2**63), ("ptr", -1), ("ptr", 2**64), ("f32", 1e39)])
def test_out_of_range_names_the_parameter(kind, value):
    with pytest.raises(HssError, match=rf"k parameter n_blocks \({kind}\)"):
        ParamPack((kind,), ("n_blocks",), "k").set("n_blocks", value)


@pytest.mark.parametrize("kind,value", [("i32", 1.5), ("u32", 2.0), ("i64", np.float32(1)), ("i32", True),
                                        ("f32", "1.0"), ("f32", False), ("ptr", 3.0)])
def test_wrong_type_is_refused(kind, value):
    with pytest.raises(TypeError):
        ParamPack((kind,), ("x",), "k").set(0, value)


def test_numpy_scalars_accepted_and_range_checked():
    pack = ParamPack(("i32", "u32", "f32", "ptr"))
    pack.fill(np.int64(-5), np.uint8(7), np.float64(0.25), np.uint64(2**63))
    assert pack.values() == (-5, 7, 0.25, 2**63)
    with pytest.raises(HssError):
        pack.set(0, np.int64(2**40))


def test_refill_in_place_keeps_the_address():
    pack = SELFTEST_AXPY.pack(1, 2, 3, 4, 1.0, 8, 2, -1)
    addr = pack.address
    pack.set("n", 99)
    pack.set("a", -2.5)
    assert pack.address == addr
    assert pack.values()[4:6] == (-2.5, 99)


def test_pack_by_name_and_arity_errors():
    pack = SELFTEST_AXPY.pack(n=3)
    assert pack.values()[5] == 3
    with pytest.raises(TypeError, match="takes 8 parameters"):
        SELFTEST_AXPY.pack(1, 2, 3)


def test_untyped_values_never_guess_a_width():
    from hss.cuda._launch import _untyped_kind
    values = [0x1000, np.int32(-1), np.uint32(5), np.int64(7), np.float32(0.5)]
    assert tuple(_untyped_kind(i, v) for i, v in enumerate(values)) == ("ptr", "i32", "u32", "i64", "f32")
    for bad in (1.0, np.float64(1.0), True, np.int16(3)):
        with pytest.raises(TypeError, match="no kernel width"):
            _untyped_kind(0, bad)


def test_device_ptr_accepts_what_spec_lists():
    class CAI:
        __cuda_array_interface__ = {"data": (0xABC000, False), "shape": (4,), "typestr": "<f4", "version": 3}

    class HasPtr:   # a bare .ptr attribute is no protocol: refused rather than guessed
        ptr = 0x2000

    assert device_ptr(0x10) == 0x10
    assert device_ptr(np.uint64(0x20)) == 0x20
    assert device_ptr(CAI()) == 0xABC000
    for bad in (1.5, "0x10", True, None, HasPtr()):
        with pytest.raises(TypeError):
            device_ptr(bad)
    with pytest.raises(HssError, match="host numpy array"):
        device_ptr(np.zeros(4))


def test_convert_labels():
    with pytest.raises(HssError, match="kern parameter x"):
        convert("u32", -3, "kern parameter x")


def test_declarations_validate_themselves():
    with pytest.raises(ValueError, match="unknown parameter kind"):
        declare("m", "bad_kind_kernel", "ptr a, f64 b")
    with pytest.raises(ValueError, match="not a pointer"):
        declare("m", "bad_extent_kernel", "ptr a, i32 n", reads={"n": lambda a: 4})
    with pytest.raises(ValueError, match="declared twice"):
        declare("selftest", "selftest_axpy", "ptr a")
    assert "bad_kind_kernel" not in DECLARATIONS
