"""Head dims that are not multiples of 8: the runtime's side of portable_plan.plan_head_padding.

The kernels take head dims in units of 8, so such a call runs on zero-padded copies: the inputs are
widened into scratch buffers before the attention launches and the padded outputs narrowed back into
the caller's arrays after them. The caller's arrays may have any strides (last dim contiguous) and
need only be aligned to their element. The forward's buffers live in a scratch allocation of
`fwd_scratch_bytes(problem)` bytes; the backward's are regions of its workspace (bwd_workspace), which
BwdLauncher.prepare_workspace has already put into the call's tensors.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from . import portable_plan
from .packing import Pointer, pointer_value


@dataclass(frozen=True)
class HeadPadding:
    """What a call adds around its attention launches: run `before + attention + after`, with the
    attention planned on `{**tensors, **substitutes}`, and keep `scratch` alive until all are queued."""

    before: list = field(default_factory=list)  # widen the inputs into their padded buffers
    after: list = field(default_factory=list)  # narrow the padded outputs into the caller's arrays
    substitutes: dict = field(default_factory=dict)  # padded buffers (and strides) for the caller's arrays
    scratch: object = None  # the forward's scratch allocation, if any


def fwd_scratch_bytes(problem) -> int:
    """Scratch bytes a forward of `problem` needs (0 when both head dims are multiples of 8)."""
    return portable_plan.fwd_scratch(problem).total_bytes


def for_forward(problem, arch, tensors, alloc) -> HeadPadding:
    """Padding of a forward. alloc(nbytes) returns device memory (an array, a DeviceBuffer or a
    Pointer) of at least nbytes, 256-byte aligned, on the call's stream; it is called only when the
    problem pads, and nothing needs to be zeroed."""
    scratch = portable_plan.fwd_scratch(problem)
    if not scratch.regions:
        return HeadPadding()
    buffer = alloc(scratch.total_bytes) if scratch.total_bytes else None
    base = pointer_value("forward scratch", buffer)
    regions = {r.name: Pointer(base + r.offset) for r in scratch.regions}
    before, after, substitutes = portable_plan.plan_head_padding(problem, arch, {**tensors, **regions}, "fwd")
    return HeadPadding(before, after, substitutes, buffer)


def for_backward(problem, arch, tensors) -> HeadPadding:
    """Padding of a backward; its buffers are the '<name>_padded' workspace regions in `tensors`."""
    return HeadPadding(*portable_plan.plan_head_padding(problem, arch, tensors, "bwd"))
