"""The launch-program model: a call's launches as the C replay (replay.c, fmha_replay) runs them.

A program is its per-call values (for an XLA call its buffers, operands first; for a plan-cache hit
the call's array addresses, the workspace's and the Philox values by value), the scratch bytes that
must start at zero, and its launches: each one's kernel, grid, block, dynamic shared bytes and packed
argument bytes (the template), plus the per-call slots of the template (patches): an 8-byte slot gets
a value plus an addend, checked against the alignment the kernel requires. A plan-cache program also
names the pairs of values that must not overlap and the value its own workspace takes.

`build` is the one function that makes a program, from planned launches and a caller's way of telling
which value each slot takes: the plan cache keeps one per signature (plan_cache.CallPlan), fmha_rt.jax
serialises one into an XLA custom call (xla_program.py). Both reach the C replay the same way: the
shim loads the encoded words into a replay plan (program.c: fmha_program_load, fmha_program_bind), once
per signature for the plan cache, on every call in the XLA handler, which cannot keep state between calls.

The wire format is an int64 array. `bytes` below is a length word followed by the bytes packed eight
to a word, little-endian:

    magic "FMHAPRG1", format version, value count, operand count, zero-fill count, launch count,
    overlap count, workspace value (-1: none), workspace bytes,
    label (bytes: names the call in error messages),
    per value: XLA dtype number (0: no XLA buffer), size in bytes (0 where it is no buffer),
    per zero fill: value, byte offset, byte count,
    per launch: kernel key (bytes), grid x y z, block x y z, dynamic shared bytes,
                argument template (bytes), patch count,
                per patch: byte offset in the template, value, addend, the alignment in bytes the
                sum must have (the kernel's, executor.pointer_alignment),
    per overlap: output value, other value, low, high (they overlap when low < other - output < high).
"""
from __future__ import annotations

import dataclasses

import numpy as np

from ..errors import FmhaValueError
from ..runtime import backend
from ..runtime.backend import ffi, lib
from ..runtime.executor import check_alignment, pointer_alignment
from ..runtime.kernel_launch import with_scratch

PATCH_BYTES = 8  # what a patch writes: an address, or the dropout seed or offset
MAGIC = int.from_bytes(b"FMHAPRG1", "little")
FORMAT = 3
NO_WORKSPACE = -1
# The shim's limits (program.h)
MAX_VALUES = 32
MAX_LAUNCHES = 16
MAX_PATCHES = 256
MAX_OVERLAPS = 128
MAX_LABEL_BYTES = 255
MAX_TEMPLATE_BYTES = lib.FMHA_REPLAY_MAX_ARGS
# XLA's PrimitiveType numbers (xla_data.proto), which the FFI reports as a buffer's dtype.
XLA_DTYPES = {"bool": 1, "int8": 2, "int16": 3, "int32": 4, "int64": 5, "uint8": 6, "uint32": 8, "float16": 10,
              "float32": 11, "bfloat16": 16}
_DTYPE_NAMES = {number: name for name, number in XLA_DTYPES.items()}
_WHY_BYTES = 512


@dataclasses.dataclass(frozen=True)
class Value:
    """A per-call value: a plan-cache value (no dtype) or an XLA buffer as the wire holds it."""

    name: str
    dtype: str | None = None  # NumPy name of an XLA buffer's dtype
    nbytes: int = 0


@dataclasses.dataclass(frozen=True)
class Patch:
    arg_offset: int  # byte offset of a per-call slot in the template
    value: int  # which per-call value it gets
    addend: int  # bytes added to the value (a region's offset in the workspace, or into the buffer)
    align: int  # the sum must be a multiple of this


@dataclasses.dataclass(frozen=True)
class ZeroFill:
    value: int  # the value (a workspace's address, or a buffer) the bytes are counted from
    offset: int
    nbytes: int


@dataclasses.dataclass(frozen=True)
class Overlap:
    output: int  # values
    other: int
    low: int  # they overlap when low < value(other) - value(output) < high
    high: int


@dataclasses.dataclass(frozen=True)
class ProgramLaunch:
    key: str
    grid: tuple
    block: tuple
    shared: int
    template: bytes  # the packed arguments, as the planned values packed (the patches overwrite their slots)
    patches: tuple  # Patch, in slot order


@dataclasses.dataclass(frozen=True)
class LaunchProgram:
    label: str
    buffers: tuple  # the values, each with a name, dtype and nbytes (xla_program.Buffer or Value); operands first
    operands: int
    zero_fills: tuple
    launches: tuple  # ProgramLaunch
    overlaps: tuple = ()  # Overlap
    workspace: int = NO_WORKSPACE  # the value the replay's own workspace takes
    workspace_bytes: int = 0

    @property
    def results(self) -> tuple:
        return self.buffers[self.operands:]

    def encode(self) -> np.ndarray:
        words = [MAGIC, FORMAT, len(self.buffers), self.operands, len(self.zero_fills), len(self.launches),
                 len(self.overlaps), self.workspace, self.workspace_bytes]
        _put_bytes(words, self.label.encode())
        for b in self.buffers:
            words += [XLA_DTYPES.get(b.dtype, 0), b.nbytes]
        for f in self.zero_fills:
            words += [f.value, f.offset, f.nbytes]
        for launch in self.launches:
            _put_bytes(words, launch.key.encode())
            words += [*launch.grid, *launch.block, launch.shared]
            _put_bytes(words, launch.template)
            words.append(len(launch.patches))
            for p in launch.patches:
                words += [p.arg_offset, p.value, p.addend, p.align]
        for o in self.overlaps:
            words += [o.output, o.other, o.low, o.high]
        return np.array(words, dtype=np.int64)

    @classmethod
    def decode(cls, words) -> LaunchProgram:
        """The program `encode` wrote. Values come back as what the wire holds: a dtype and a size (no name)."""
        r = _Reader(np.asarray(words, dtype=np.int64))
        if r.word() != MAGIC or r.word() != FORMAT:
            raise FmhaValueError("not a launch program of this format")
        values, operands, fills, launches, overlaps, workspace, workspace_bytes = (r.word() for _ in range(7))
        label = r.bytes().decode()
        buffers = tuple(Value("", _DTYPE_NAMES.get(r.word()), r.word()) for _ in range(values))
        zero_fills = tuple(ZeroFill(r.word(), r.word(), r.word()) for _ in range(fills))
        decoded = []
        for _ in range(launches):
            key = r.bytes().decode()
            grid, block, shared = tuple(r.word() for _ in range(3)), tuple(r.word() for _ in range(3)), r.word()
            template = r.bytes()
            patches = tuple(Patch(r.word(), r.word(), r.word(), r.word()) for _ in range(r.word()))
            decoded.append(ProgramLaunch(key, grid, block, shared, template, patches))
        bounds = tuple(Overlap(r.word(), r.word(), r.word(), r.word()) for _ in range(overlaps))
        if r.next != len(r.words):
            raise FmhaValueError("launch program has words past its end")
        return cls(label, buffers, operands, zero_fills, tuple(decoded), bounds, workspace, workspace_bytes)


def _put_bytes(words: list, data: bytes) -> None:
    words.append(len(data))
    padded = data + b"\0" * (-len(data) % 8)
    words.extend(int(w) for w in np.frombuffer(padded, dtype="<i8"))


class _Reader:
    def __init__(self, words):
        self.words, self.next = words, 0

    def word(self) -> int:
        if self.next >= len(self.words):
            raise FmhaValueError("launch program is truncated")
        self.next += 1
        return int(self.words[self.next - 1])

    def bytes(self) -> bytes:
        n = self.word()
        count = -(-n // 8)
        chunk = self.words[self.next:self.next + count]
        if len(chunk) != count:
            raise FmhaValueError("launch program is truncated")
        self.next += count
        return chunk.astype("<i8").tobytes()[:n]


def pack_launch(entry, launch, sources: dict) -> ProgramLaunch:
    """`launch` (plan.args.Launch) checked and packed as the executor would pack it, with `sources`
    {slot name: (value, addend)} for each slot that a call writes."""
    args = with_scratch(launch.args)
    check_alignment(entry, args)  # what stays constant must pass as it would on every call
    patches = []
    for slot in entry.packer.slots:
        if slot.name not in sources:
            continue
        if slot.size != PATCH_BYTES:
            raise FmhaValueError(f"{entry.key}: per-call argument {slot.name} is {slot.size} bytes wide")
        value, addend = sources[slot.name]
        align = pointer_alignment(entry, slot.name) if slot.type == "ptr" else 1
        patches.append(Patch(slot.offset, value, addend, align))
    return ProgramLaunch(entry.key, tuple(int(g) for g in launch.grid), (entry.threads, 1, 1), entry.shared,
                         entry.packer.pack(args), tuple(patches))


def build(label: str, entries, launches, sources_of, buffers, operands: int, zero_fills=(), overlaps=(),
          workspace: int = NO_WORKSPACE, workspace_bytes: int = 0) -> LaunchProgram:
    """The program of `launches` (plan.args.Launch, with work) run by their registry `entries`: each one
    checked and packed exactly as the executor would (pack_launch), its per-call slots those
    sources_of(entry, launch) names ({slot name: (value, addend)}). Raises FmhaValueError when the
    program is beyond what the shim takes."""
    label = label.encode()[:MAX_LABEL_BYTES].decode(errors="ignore")  # it only names the call in messages
    built = tuple(pack_launch(entry, launch, sources_of(entry, launch)) for entry, launch in zip(entries, launches))
    limits = {"values": (len(buffers), MAX_VALUES), "launches": (len(built), MAX_LAUNCHES),
              "patches": (sum(len(b.patches) for b in built), MAX_PATCHES), "overlap bounds": (len(overlaps), MAX_OVERLAPS),
              "argument bytes of a launch": (max((len(b.template) for b in built), default=0), MAX_TEMPLATE_BYTES)}
    for what, (count, limit) in limits.items():
        if count > limit:
            raise FmhaValueError(f"{label}: {count} {what}, a launch program takes at most {limit}")
    if any(not -2**63 <= bound < 2**63 for o in overlaps for bound in (o.low, o.high)):
        raise FmhaValueError(f"{label}: an overlap bound is beyond int64")
    return LaunchProgram(label, tuple(buffers), operands, tuple(zero_fills), built, tuple(overlaps), workspace,
                         workspace_bytes)


class LoadedProgram:
    """A LaunchProgram as the shim loaded it (program.c) for one device: `plan` is the fmha_replay_plan
    that fmha_replay runs; it lives as long as this object."""

    __slots__ = ("handle", "plan")

    def __init__(self, program: LaunchProgram, device: int, kernels, graph_id: int):
        """`kernels`: each launch's kernel handle (kernel_launch.kernel_handle), in launch order."""
        words = program.encode()
        out, why = ffi.new("fmha_program **"), ffi.new("char[]", _WHY_BYTES)
        status = lib.fmha_program_load(ffi.from_buffer("int64_t[]", words), len(words), out, why, _WHY_BYTES)
        if status == lib.FMHA_ERR_BAD_ARGUMENT:
            raise FmhaValueError(f"{program.label}: {ffi.string(why).decode()}")
        backend.check(status, "fmha_program_load")
        self.handle = ffi.gc(out[0], lib.fmha_program_free)
        handles = ffi.new("fmha_kernel *[]", list(kernels) or [ffi.NULL])
        backend.check(lib.fmha_program_bind(self.handle, device, handles, graph_id, why, _WHY_BYTES),
                      "fmha_program_bind", device=device)
        self.plan = lib.fmha_program_plan(self.handle)

    def templates(self) -> list[bytes]:
        """The argument templates the loaded plan launches from (the replay copies them, never writes them)."""
        return [bytes(ffi.buffer(self.plan.launches[i].args, self.plan.launches[i].args_size))
                for i in range(self.plan.launch_count)]
