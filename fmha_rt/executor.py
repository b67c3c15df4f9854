"""Running a plan's launches on the GPU: look each variant up, check and pack every launch first (so
that a bad argument raises before anything is written), then launch them in order on one stream."""
from __future__ import annotations

import threading

from .errors import FmhaValueError
from .launch import PreparedLaunch, log_config_enabled, log_launch
from .packing import NULL, pointer_value
from .registry import SCRATCH_POINTERS, registry

_SCRATCH = dict.fromkeys(SCRATCH_POINTERS, NULL)
_local = threading.local()


def check_alignment(entry, args: dict) -> None:
    """The build promised the compiler 16-byte aligned pointers and strides that are multiples of 8
    elements (that is what lets loads vectorise); refuse arguments that break the promise."""
    for slot in entry.params:
        value = args[slot.name]
        if slot.type == "ptr":
            address = pointer_value(slot.name, value)
            if address % 16:
                raise FmhaValueError(f"{entry.key}: pointer {slot.name}=0x{address:x} is not 16-byte aligned; "
                                     "pass arrays whose data starts on a 16-byte boundary")
        elif slot.name.startswith("stride_") and value % 8:
            raise FmhaValueError(f"{entry.key}: stride {slot.name}={value} must be a multiple of 8 elements")


def prepare(device: int, arch: str, launches) -> list[PreparedLaunch]:
    reg = registry()
    prepared = []
    for launch in launches:
        entry = reg.entry(arch, launch.variant)
        args = {**_SCRATCH, **launch.args}
        check_alignment(entry, args)
        prepared.append(PreparedLaunch(device, entry, launch.grid, entry.packer.pack(args)))
        if log_config_enabled():
            log_launch(device, entry, launch.grid, args, 0)
    return prepared


def run(device: int, arch: str, launches, stream: int, before_launch=None) -> list[str]:
    """Launch every kernel of `launches` on `stream`; returns their variant keys. `before_launch` runs
    once every launch is checked and packed, right before the first (e.g. zeroing a workspace)."""
    prepared = prepare(device, arch, launches)
    if before_launch is not None:
        before_launch()
    for p in prepared:
        p(stream)
    keys = [p.entry.key for p in prepared]
    _local.last = {"family": "portable", "kernels": keys, "kernel": keys[-1] if keys else None, "device": device}
    return keys


def last_launch_info() -> dict:
    """Family and kernels of the most recent call on this thread."""
    return dict(getattr(_local, "last", {}) or {})
