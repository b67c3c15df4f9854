"""Typed argument packing: layouts, conversions and the errors that name the argument."""
import struct

import numpy as np
import pytest

from fmha_rt.errors import FmhaTypeError, FmhaValueError
from fmha_rt.runtime.packing import ArgPacker, Pointer, Slot

LAYOUT = [Slot("q", "ptr", 0, 8), Slot("n", "i32", 8, 4), Slot("scale", "f32", 12, 4),
          Slot("stride", "i64", 16, 8), Slot("flags", "u32", 24, 4), Slot("out", "ptr", 32, 8)]


class FakeArray:
    def __init__(self, ptr):
        self.device_ptr = ptr


def packer():
    return ArgPacker(LAYOUT, 40)


def good_args(**over):
    args = dict(q=FakeArray(0x7F0000001000), n=-5, scale=0.125, stride=2**40 + 3, flags=2**32 - 1,
                out=Pointer(0xDEAD0000))
    args.update(over)
    return args


def test_pack_matches_struct_layout_byte_for_byte():
    packed = packer().pack(good_args())
    assert len(packed) == 40
    q, n, scale, stride, flags, pad, out = struct.unpack("<QifqIIQ", packed)
    assert (q, n, scale, stride, flags, pad, out) == (0x7F0000001000, -5, 0.125, 2**40 + 3, 2**32 - 1, 0, 0xDEAD0000)


def test_f32_slot_rounds_explicitly_to_float32():
    packed = packer().pack(good_args(scale=0.1))
    assert struct.unpack_from("<f", packed, 12)[0] == float(np.float32(0.1))
    assert struct.unpack_from("<f", packer().pack(good_args(scale=3)), 12)[0] == 3.0


def test_none_is_null_pointer():
    assert struct.unpack_from("<Q", packer().pack(good_args(out=None)), 32)[0] == 0


@pytest.mark.parametrize("name,value,error,fragment", [
    ("q", 0x1000, FmhaTypeError, "argument 'q' is a pointer"),          # bare int where a pointer belongs
    ("q", 1.5, FmhaTypeError, "argument 'q' is a pointer"),
    ("n", np.zeros(3), FmhaTypeError, "argument 'n' is i32"),            # array where a scalar belongs
    ("n", FakeArray(16), FmhaTypeError, "argument 'n' is i32"),          # pointer-like where a scalar belongs
    ("n", True, FmhaTypeError, "argument 'n' is i32"),                   # bools are not ints here
    ("n", 2.0, FmhaTypeError, "argument 'n' is i32"),                    # no silent float -> int
    ("n", np.int32(3), FmhaTypeError, "argument 'n' is i32"),            # numpy scalars must be converted
    ("n", 2**31, FmhaValueError, "outside the i32 range"),
    ("n", -(2**31) - 1, FmhaValueError, "outside the i32 range"),
    ("flags", -1, FmhaValueError, "outside the u32 range"),
    ("stride", 2**63, FmhaValueError, "outside the i64 range"),
    ("scale", "0.5", FmhaTypeError, "argument 'scale' is f32"),
    ("scale", np.ones(1), FmhaTypeError, "argument 'scale' is f32"),
    ("scale", 1e39, FmhaValueError, "outside the float32 range"),
])
def test_bad_values_name_the_argument(name, value, error, fragment):
    with pytest.raises(error, match=fragment):
        packer().pack(good_args(**{name: value}))


def test_missing_and_unexpected_arguments_are_listed():
    args = good_args()
    del args["stride"]
    args["bogus"] = 1
    with pytest.raises(FmhaValueError, match=r"missing \['stride'\], unexpected \['bogus'\]"):
        packer().pack(args)


def test_pointer_rejects_out_of_range_addresses():
    with pytest.raises(FmhaValueError):
        Pointer(-1)
    with pytest.raises(FmhaValueError):
        Pointer(2**64)


@pytest.mark.parametrize("slots,total", [
    ([Slot("a", "i32", 0, 8)], 8),                          # size disagrees with type
    ([Slot("a", "i64", 0, 8), Slot("b", "i32", 4, 4)], 16),  # overlap
    ([Slot("a", "i64", 0, 8)], 4),                           # beyond declared total
    ([Slot("a", "f64", 0, 8)], 8),                           # unknown type
])
def test_inconsistent_layouts_are_refused(slots, total):
    with pytest.raises(FmhaValueError):
        ArgPacker(slots, total)
