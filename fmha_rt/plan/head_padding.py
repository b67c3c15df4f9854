"""Head dims that are not multiples of 8: the runtime's side of portable.plan_head_padding.

The kernels take head dims in units of 8, so such a call runs on zero-padded copies: the inputs are
widened into scratch buffers before the attention launches and the padded outputs narrowed back into
the caller's arrays after them. The caller's arrays may have any strides (last dim contiguous) and
need only be aligned to their element. The forward's buffers are regions of a scratch allocation of
`fwd_scratch_bytes(problem)` bytes (portable.fwd_scratch), the backward's are regions of its
workspace (bwd_workspace); either way the API has put the regions into the call's tensors, like
the backward's other workspace regions, so that cached calls allocate them in the replay.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from . import portable


@dataclass(frozen=True)
class HeadPadding:
    """What a call adds around its attention launches: run `before + attention + after`, with the
    attention planned on `{**tensors, **substitutes}`."""

    before: list = field(default_factory=list)  # widen the inputs into their padded buffers
    after: list = field(default_factory=list)  # narrow the padded outputs into the caller's arrays
    substitutes: dict = field(default_factory=dict)  # padded buffers (and strides) for the caller's arrays


def fwd_scratch_bytes(problem) -> int:
    """Scratch bytes a forward of `problem` needs (0 when both head dims are multiples of 8)."""
    return portable.fwd_scratch(problem).total_bytes


def for_pass(problem, arch, tensors, pass_name) -> HeadPadding:
    """Padding of a forward ('fwd') or backward ('bwd'); its buffers are the '<name>_padded' regions
    of the forward's scratch or the backward's workspace, which the caller has put into `tensors`."""
    return HeadPadding(*portable.plan_head_padding(problem, arch, tensors, pass_name))
