"""Running a plan's launches on the GPU: look each variant up, check and pack every launch first (so
that a bad argument raises before anything is written), then launch them in order on one stream.

`run` takes planned launches (plan.args.Launch: a variant, a grid, arguments by name) or the
launches of a cached plan bound to one call (plan_cache.BoundLaunches: packed already, with this call's
pointers written in and checked for alignment when they were bound). A plan-cache hit that logs nothing
launches through the C replay directly and notes its kernels here (note_launched)."""
from __future__ import annotations

import threading

from ..errors import FmhaValueError
from . import backend, kernel_launch
from .kernel_launch import PreparedLaunch, Ready, log_config_enabled, log_launch, with_scratch
from .packing import pointer_value
from .registry import ALIGNED_STRIDE_PREFIX, GLOBAL_SCRATCH, UNALIGNED_POINTER_PREFIX, registry

_local = threading.local()
_ELEMENT_BYTES = {"fp16": 2, "bf16": 2, "fp32": 4}


def check_alignment(entry, args: dict) -> None:
    """The build promised the compiler 16-byte aligned pointers and strides that are multiples of 8
    elements (that is what lets loads vectorise); refuse arguments that break the promise. Pointers
    named Unaligned* were promised only element alignment (a misaligned access would fault)."""
    for slot in entry.params:
        value = args[slot.name]
        if slot.type == "ptr":
            check_pointer(entry, slot.name, pointer_value(slot.name, value))
        elif slot.name.startswith(ALIGNED_STRIDE_PREFIX) and value % 8:
            raise FmhaValueError(f"{entry.key}: stride {slot.name}={value} must be a multiple of 8 elements")


def pointer_alignment(entry, name: str) -> int:
    """Bytes the pointer parameter `name` of `entry` must be aligned to: global scratch as the compiler
    asked (the manifest records it: TMA descriptors are made there), other pointers as the build promised."""
    if name.startswith(UNALIGNED_POINTER_PREFIX):
        return _ELEMENT_BYTES.get(entry.traits.get("dtype"), 1)
    if name == GLOBAL_SCRATCH:
        return max(16, entry.traits.get("global_scratch_align", 16))
    return 16


def check_pointer(entry, name: str, address: int, align: int | None = None) -> None:
    align = pointer_alignment(entry, name) if align is None else align
    if address % align:
        raise FmhaValueError(f"{entry.key}: pointer {name}=0x{address:x} is not {align}-byte aligned; "
                             f"pass arrays whose data starts on a {align}-byte boundary")


class Prepared(list):
    """Planned launches checked and packed (a PreparedLaunch each), launched in order by `launch`."""

    def launch(self, stream: int) -> None:
        for p in self:
            p(stream)

    @property
    def keys(self) -> list[str]:
        return [p.entry.key for p in self]


def prepare(device: int, arch: str, launches, stream: int = 0) -> Prepared:
    """Check and pack every planned launch; log them when asked."""
    reg = None
    logging = log_config_enabled()
    prepared = Prepared()
    for launch in launches:
        reg = reg or registry()
        entry = reg.entry(arch, launch.variant)
        args = with_scratch(launch.args)
        check_alignment(entry, args)
        prepared.append(PreparedLaunch(device, entry, launch.grid, entry.packer.pack(args)))
        if logging:
            log_launch(device, entry, launch.grid, args, stream)
    return prepared


def run(device: int, arch: str, launches, stream: int, before_launch=None):
    """Launch every kernel of `launches` on `stream`; returns their variant keys (a sequence).
    `before_launch` runs once every launch is checked and packed, right before the first (e.g. zeroing
    a workspace)."""
    if isinstance(launches, Ready):  # a cached plan's: checked and packed in C as they launch
        if kernel_launch.LOG_CONFIG:
            for launch in launches:
                log_launch(device, launch.entry, launch.grid, with_scratch(launch.args), stream)
        ready = launches
    else:
        ready = prepare(device, arch, launches, stream)
    if before_launch is not None:
        before_launch()
    ready.launch(stream)
    keys = ready.keys
    note_launched(keys, device)
    return keys


def note_launched(keys, device: int) -> None:
    """What last_launch_info reports for this thread (made into its dict when asked, not on every call)."""
    _local.last = (keys, device)


def last_launch_info() -> dict:
    """Family and kernels of the most recent call on this thread. The family is the attention's: a call
    that ran a kernel of another family (v3) names it (family_of)."""
    last = getattr(_local, "last", None)
    if last is None:
        return {}
    keys, device = last
    return {"family": family_of(backend.device(device).arch, keys), "kernels": list(keys),
            "kernel": keys[-1] if keys else None, "device": device}


def family_of(arch: str, keys) -> str:
    """The attention's family of a call that launched `keys`: a kernel of another family than the
    portable one (v3) names it, since the portable family also makes the copies around every family's
    kernels (head padding, the backward's passes)."""
    families = {registry().entry(arch, key).family for key in keys}
    return next((f for f in sorted(families) if f != "portable"), "portable")
