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
        backend.device(device)  # initialises the runtime and checks the ordinal
        image = registry().image(entry)
        out = ffi.new("fmha_kernel **")
        backend.check(lib.fmha_kernel_get(device, entry.key.encode(), image, len(image), entry.symbol.encode(),
                                          entry.shared, out), "fmha_kernel_get", kernel=entry.key, device=device)
        handle = _handles.setdefault((device, entry.key), out[0])
    return handle


class PreparedLaunch:
    """One kernel, grid and packed argument buffer, ready to launch again and again: the hot path of
    cached plans. The launch configuration lives in C, so a launch is one call with two arguments."""

    __slots__ = ("device", "entry", "grid", "buffer", "config")

    def __init__(self, device: int, entry: KernelEntry, grid, packed: bytes):
        self.device, self.entry, self.grid = device, entry, tuple(int(g) for g in grid)
        self.buffer = ffi.new("char[]", packed)
        self.config = ffi.new("fmha_launch_config *", {
            "kernel": kernel_handle(device, entry), "grid": self.grid, "block": (entry.threads, 1, 1),
            "dynamic_shared_bytes": entry.shared, "args": self.buffer, "args_size": len(packed)})

    def __call__(self, stream: int = 0) -> None:
        status = _launch(self.config, stream)
        if status:
            backend.check(status, "fmha_launch", kernel=self.entry.key, device=self.device)


_launch = lib.fmha_launch_prepared


class LaunchPool:
    """Launches of one kernel and grid on one device whose packed arguments change from call to call
    (a cached plan's). Each launch configuration owns a C argument buffer; a call takes one from the
    pool, copies its arguments in, launches and puts it back. The driver copies the arguments when the
    launch is queued, so a configuration is free again as soon as the launch call returns, and
    concurrent calls never share one (list.pop and list.append are atomic). The pool holds at most as
    many configurations as calls ever ran at once."""

    __slots__ = ("_free", "device", "entry", "grid", "size")

    def __init__(self, device: int, entry: KernelEntry, grid, size: int):
        self.device, self.entry, self.grid, self.size = device, entry, tuple(int(g) for g in grid), size
        self._free = []

    def _new(self):
        buffer = ffi.new("char[]", self.size)
        config = ffi.new("fmha_launch_config *", {
            "kernel": kernel_handle(self.device, self.entry), "grid": self.grid, "block": (self.entry.threads, 1, 1),
            "dynamic_shared_bytes": self.entry.shared, "args": buffer, "args_size": self.size})
        return buffer, config

    def __call__(self, packed, stream: int) -> None:
        try:
            slot = self._free.pop()
        except IndexError:
            slot = self._new()
        ffi.memmove(slot[0], packed, self.size)
        status = _launch(slot[1], stream)
        self._free.append(slot)
        if status:
            backend.check(status, "fmha_launch", kernel=self.entry.key, device=self.device)


def launch(device: int, entry: KernelEntry, grid, args: dict, stream: int = 0) -> None:
    """Pack `args` by the kernel's typed layout and launch it on `device` and `stream`. Triton's
    scratch pointers may be left out: they are always NULL."""
    args = {**dict.fromkeys(SCRATCH_POINTERS, NULL), **args}
    packed = entry.packer.pack(args)
    if log_config_enabled():
        log_launch(device, entry, grid, args, stream)
    PreparedLaunch(device, entry, grid, packed)(stream)


def log_launch(device: int, entry: KernelEntry, grid, args: dict, stream: int) -> None:
    if not log.hasHandlers():  # asked for by the environment: print even without logging configured
        log.addHandler(logging.StreamHandler())
        log.setLevel(logging.INFO)
    lines = [f"kernel: {entry.key}", f"family: {entry.family}", f"device: {device}",
             f"grid: {tuple(grid)}", f"block: ({entry.threads}, 1, 1)", f"shared: {entry.shared}",
             f"stream: 0x{stream:x}"]
    lines += [f"{name}: {args[name]!r}" for name in entry.packer.names]
    log.info("launch\n%s", "\n".join(lines))
