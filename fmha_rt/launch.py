"""Launching one kernel of the registry: load it on the device on first use, pack, launch, log.

The C kernel map (keyed by device and kernel key) owns the loaded modules; this module keeps a
per-process dict of the handles it returned so that a cached launch costs one dict lookup.
"""
from __future__ import annotations

import logging
import os

from . import backend
from .backend import ffi, lib
from .packing import NULL
from .registry import SCRATCH_POINTERS, KernelEntry, registry

log = logging.getLogger("fmha_rt")
_handles: dict[tuple[int, str], object] = {}


def log_config_enabled() -> bool:
    return os.environ.get("FMHA_RT_LOG_CONFIG", "") not in ("", "0")


def kernel_handle(device: int, entry: KernelEntry):
    handle = _handles.get((device, entry.key))
    if handle is None:
        image = registry().image(entry)
        out = ffi.new("fmha_kernel **")
        backend.check(lib.fmha_kernel_get(device, entry.key.encode(), image, len(image), entry.symbol.encode(),
                                          entry.shared, out), "fmha_kernel_get", kernel=entry.key, device=device)
        handle = _handles.setdefault((device, entry.key), out[0])
    return handle


def launch_packed(device: int, entry: KernelEntry, grid, packed: bytes, stream: int) -> None:
    """Launch with an already packed argument buffer (the hot path of cached plans)."""
    handle = kernel_handle(device, entry)
    status = lib.fmha_launch(handle, grid[0], grid[1], grid[2], entry.threads, 1, 1, entry.shared, stream,
                             ffi.from_buffer(packed), len(packed))
    if status:
        backend.check(status, "fmha_launch", kernel=entry.key, device=device)


def launch(device: int, entry: KernelEntry, grid, args: dict, stream: int = 0) -> None:
    """Pack `args` by the kernel's typed layout and launch it on `device` and `stream`. Triton's
    scratch pointers may be left out: they are always NULL."""
    args = {**dict.fromkeys(SCRATCH_POINTERS, NULL), **args}
    packed = entry.packer.pack(args)
    if log_config_enabled():
        log_launch(device, entry, grid, args, stream)
    launch_packed(device, entry, grid, packed, stream)


def log_launch(device: int, entry: KernelEntry, grid, args: dict, stream: int) -> None:
    if not log.hasHandlers():  # asked for by the environment: print even without logging configured
        log.addHandler(logging.StreamHandler())
        log.setLevel(logging.INFO)
    lines = [f"kernel: {entry.key}", f"family: {entry.family}", f"device: {device}",
             f"grid: {tuple(grid)}", f"block: ({entry.threads}, 1, 1)", f"shared: {entry.shared}",
             f"stream: 0x{stream:x}"]
    lines += [f"{name}: {args[name]!r}" for name in entry.packer.names]
    log.info("launch\n%s", "\n".join(lines))
