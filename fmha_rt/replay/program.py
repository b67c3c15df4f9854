"""The launch-program model: a call's launches as the C replay (replay.c, fmha_replay) runs them.

Each launch is its kernel, grid, block, dynamic shared bytes and packed argument bytes (the template),
plus the per-call slots of the template (patches): an 8-byte slot gets a per-call value plus an addend,
checked against the alignment the kernel requires. Zero fills name the scratch bytes that must start at
zero. The plan cache keeps one per signature (plan_cache.CallPlan: a value is a position in the call's
value array), and fmha_rt.jax serialises one into an XLA custom call (xla_program.LaunchProgram: a
value is one of the call's buffers); both are packed here, checked as the executor checks a launch.
"""
from __future__ import annotations

import dataclasses

from ..errors import FmhaValueError
from ..runtime.executor import check_alignment, pointer_alignment
from ..runtime.kernel_launch import with_scratch

PATCH_BYTES = 8  # what a patch writes: an address, or the dropout seed or offset


@dataclasses.dataclass(frozen=True)
class Patch:
    arg_offset: int  # byte offset of a per-call slot in the template
    value: int  # which per-call value it gets: a value array position, or a buffer
    addend: int  # bytes added to the value (a region's offset in the workspace, or into the buffer)
    align: int  # the sum must be a multiple of this


@dataclasses.dataclass(frozen=True)
class ZeroFill:
    value: int  # the value (a workspace's address, or a buffer) the bytes are counted from
    offset: int
    nbytes: int


@dataclasses.dataclass(frozen=True)
class ProgramLaunch:
    key: str
    grid: tuple
    block: tuple
    shared: int
    template: bytes  # the packed arguments, as the planned values packed (the patches overwrite their slots)
    patches: tuple  # Patch, in slot order


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
