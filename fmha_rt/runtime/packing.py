"""Typed packing of kernel arguments into the byte buffer a launch passes through the driver.

The layout comes from the manifest (names, types, offsets, sizes), which the build wrote from the
kernel's signature and the runtime checked against the binary's own parameter table. Packing is
strict: a pointer slot takes only a pointer-like object (never a bare int, which would silently pass
a number as an address), an integer slot takes only an int within its range, and an f32 slot converts
a Python float explicitly. Every error names the argument.
"""
from __future__ import annotations

import dataclasses
import math
import struct

from ..errors import FmhaTypeError, FmhaValueError

# type name in the manifest -> (struct code, size, integer range or None)
SLOT_TYPES = {
    "ptr": ("Q", 8, None),
    "i32": ("i", 4, (-(2**31), 2**31 - 1)),
    "u32": ("I", 4, (0, 2**32 - 1)),
    "i64": ("q", 8, (-(2**63), 2**63 - 1)),
    "u64": ("Q", 8, (0, 2**64 - 1)),
    "f32": ("f", 4, None),
}
F32_MAX = 3.4028234663852886e38


@dataclasses.dataclass(frozen=True)
class Slot:
    name: str
    type: str
    offset: int
    size: int


class Pointer:
    """A device address given explicitly. Arrays from DLPack carry their own pointer; this wrapper is
    for raw addresses (workspace regions, pointers from other libraries)."""

    __slots__ = ("address",)

    def __init__(self, address: int):
        if type(address) is not int or not 0 <= address < 2**64:
            raise FmhaValueError(f"Pointer address must be an int in [0, 2**64), got {address!r}")
        self.address = address

    def __repr__(self):
        return f"Pointer(0x{self.address:x})"


NULL = Pointer(0)


def pointer_value(name: str, value) -> int:
    """The address of a pointer-like value: Pointer, None (NULL), or an object with `device_ptr`."""
    if value is None:
        return 0
    if isinstance(value, Pointer):
        return value.address
    address = getattr(value, "device_ptr", None)
    if type(address) is int:
        return address
    raise FmhaTypeError(
        f"argument '{name}' is a pointer: pass an array, fmha_rt.Pointer(address) or None, "
        f"not {type(value).__name__}"
    )


def _scalar_value(slot: Slot, value):
    if slot.type == "f32":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise FmhaTypeError(f"argument '{slot.name}' is f32: expected a Python float, got {type(value).__name__}")
        value = float(value)
        if math.isfinite(value) and abs(value) > F32_MAX:
            raise FmhaValueError(f"argument '{slot.name}'={value!r} is outside the float32 range")
        return value
    if type(value) is not int:  # bool, float, numpy scalars and arrays are refused: no silent casts
        raise FmhaTypeError(f"argument '{slot.name}' is {slot.type}: expected an int, got {type(value).__name__}")
    lo, hi = SLOT_TYPES[slot.type][2]
    if not lo <= value <= hi:
        raise FmhaValueError(f"argument '{slot.name}'={value} is outside the {slot.type} range [{lo}, {hi}]")
    return value


class ArgPacker:
    """Packs a dict of named arguments into the layout of one kernel."""

    def __init__(self, slots: list[Slot], total_bytes: int):
        self.slots = sorted(slots, key=lambda s: s.offset)
        self.total_bytes = total_bytes
        fmt, cursor = "<", 0
        for slot in self.slots:
            if slot.type not in SLOT_TYPES:
                raise FmhaValueError(f"parameter '{slot.name}' has unknown type {slot.type!r}")
            code, size, _ = SLOT_TYPES[slot.type]
            if size != slot.size or slot.offset < cursor:
                raise FmhaValueError(f"parameter '{slot.name}': {slot.type} at offset {slot.offset} size "
                                     f"{slot.size} does not fit the layout")
            fmt += "x" * (slot.offset - cursor) + code
            cursor = slot.offset + size
        if cursor > total_bytes:
            raise FmhaValueError(f"parameters end at byte {cursor}, beyond the declared {total_bytes}")
        self.struct = struct.Struct(fmt + "x" * (total_bytes - cursor))
        self.names = [s.name for s in self.slots]

    def values(self, args: dict) -> list:
        missing = [n for n in self.names if n not in args]
        extra = [n for n in args if n not in self.names]
        if missing or extra:
            raise FmhaValueError(f"kernel arguments do not match its layout: missing {missing}, unexpected {extra}")
        return [pointer_value(s.name, args[s.name]) if s.type == "ptr" else _scalar_value(s, args[s.name])
                for s in self.slots]

    def pack(self, args: dict) -> bytes:
        return self.struct.pack(*self.values(args))

    def offset_of(self, name: str) -> int:
        for slot in self.slots:
            if slot.name == name:
                return slot.offset
        raise KeyError(name)
