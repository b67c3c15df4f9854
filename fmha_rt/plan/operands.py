"""A call's operands as the planners read them: one typed record instead of a dict keyed by strings.

Each array the kernels read or write is an Operand (its name for messages, its address, its strides in
elements) in a named field of Operands, so that a misspelt operand is an AttributeError where it is
read or written, not a missing key found later. Only the regions of a call's scratch or workspace are
kept by name (`regions`), because layout.py names them and a family may add its own. The dropout's
Philox seed and offset are one Philox: given by value, or read from a device array.

An address is whatever the caller plans with: a runtime.packing.Pointer on a GPU, a placeholder of
an XLA buffer (replay/xla_program.py), an array when kernels are interpreted on a CPU. The plan
cache finds a call's values in its launches by the identity of these objects.
"""
from __future__ import annotations

import dataclasses

from fmha_rt.errors import FmhaValueError


@dataclasses.dataclass(frozen=True, slots=True)
class Operand:
    """One array as the kernels see it."""

    name: str  # as error messages and the call log name it
    pointer: object
    strides: tuple  # in elements


@dataclasses.dataclass(frozen=True, slots=True)
class Philox:
    """The dropout's Philox seed and offset: `seed` and `offset` by value, or `pointer` the address of a
    device int64 array [seed, offset] read when the kernels run (CUDA graph capture, JAX)."""

    seed: int | None = None
    offset: int = 0
    pointer: object = None

    @property
    def by_value(self) -> bool:
        return self.pointer is None


@dataclasses.dataclass(slots=True)
class Operands:
    """A call's operands: inputs, outputs, the Philox values and the scratch regions. Unused ones are None."""

    q: Operand | None = None
    k: Operand | None = None
    v: Operand | None = None
    cu_seqlens_q: Operand | None = None
    cu_seqlens_k: Operand | None = None
    seqstart_q: Operand | None = None
    seqstart_k: Operand | None = None
    bias: Operand | None = None
    alibi: Operand | None = None
    out: Operand | None = None
    lse: Operand | None = None
    dout: Operand | None = None
    dq: Operand | None = None
    dk: Operand | None = None
    dv: Operand | None = None
    dbias: Operand | None = None
    mask: Operand | None = None  # the dropout keep mask (mha_dropout_mask)
    philox: Philox | None = None
    regions: dict = dataclasses.field(default_factory=dict)  # scratch region name (layout.py) -> its address

    @classmethod
    def of_arrays(cls, arrays: dict, address=lambda array: array) -> Operands:
        """The operands of strided arrays by name (torch tensors, say), for tools and tests that plan on
        arrays of their own: an operand field's name takes address(array) and the array's strides, any
        other name is a scratch region at address(array)."""
        operands = cls()
        for name, array in arrays.items():
            if name in ARRAY_FIELDS:
                setattr(operands, name, Operand(name, address(array), tuple(array.stride())))
            else:
                operands.regions[name] = address(array)
        return operands

    def arrays(self) -> tuple:
        """The Operands present, in field order."""
        return tuple(o for f in ARRAY_FIELDS if (o := getattr(self, f)) is not None)

    def region(self, name: str):
        """The address of scratch region `name`, which the caller carved out of its scratch buffer."""
        address = self.regions.get(name)
        if address is None:
            raise FmhaValueError(f"scratch region {name!r} is required for this call, and it has none")
        return address

    @property
    def need(self) -> Required:
        return Required(self)


ARRAY_FIELDS = tuple(f.name for f in dataclasses.fields(Operands) if f.type == "Operand | None")


class Required:
    """Operands read where a launch cannot go without them: `operands.need.q` is q's Operand. An operand
    the call lacks raises FmhaValueError; a name that is no operand raises AttributeError, as on Operands."""

    __slots__ = ("_operands",)

    def __init__(self, operands: Operands):
        self._operands = operands

    def __getattr__(self, name: str) -> Operand:
        operand = getattr(self._operands, name)
        if operand is None:
            raise FmhaValueError(f"operand {name} is required for this call, and it has none")
        return operand
