"""Launching one kernel of the registry: load it on the device on first use, pack, launch, log.

The C kernel map (keyed by device and kernel key) owns the loaded modules; this module keeps a
per-process dict of the handles it returned so that a cached launch costs one dict lookup.

FMHA_RT_LOG_CONFIG is read once, when fmha_rt is imported (reading the environment on every launch
cost a cached call ~0.8 µs); after changing it in a running process, call refresh_log_config().
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


def _log_config_from_environment() -> bool:
    return os.environ.get("FMHA_RT_LOG_CONFIG", "") not in ("", "0")


LOG_CONFIG = _log_config_from_environment()  # whether every launch is logged


def refresh_log_config() -> bool:
    """Read FMHA_RT_LOG_CONFIG again (it is read once at import); returns whether launches are logged."""
    global LOG_CONFIG
    LOG_CONFIG = _log_config_from_environment()
    return LOG_CONFIG


def log_config_enabled() -> bool:
    return LOG_CONFIG


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


ARGS_ALIGN = 16  # where each launch's arguments start in a LaunchPool slot's buffer


class LaunchPool:
    """Launch configurations for the launches of a cached plan (kernels and grids on one device) whose
    packed arguments change from call to call. A slot holds one configuration per launch and all
    their arguments in one C buffer, which starts as their `packed` bytes (those that never change
    stay as they are); a call takes a slot (`take`), writes its own values through the slot's
    writable view (each launch's bytes start at `offsets`) and launches the configurations in order
    (`launch`), which puts the slot back. The driver copies the arguments when a launch is queued, so
    a slot is free again as soon as the launch calls return, and concurrent calls never share one
    (list.pop and list.append are atomic). A slot taken and never launched (its call failed in
    between) is dropped. The pool holds at most as many slots as calls ever ran at once."""

    __slots__ = ("_free", "device", "kernels", "offsets", "packed")

    def __init__(self, device: int, kernels):
        """`kernels`: (entry, grid, packed bytes) of each launch, in launch order."""
        self.device = device
        self.kernels = tuple((entry, tuple(int(g) for g in grid), len(packed)) for entry, grid, packed in kernels)
        image, offsets = bytearray(), []
        for _, _, packed in kernels:
            image += bytes(-len(image) % ARGS_ALIGN)
            offsets.append(len(image))
            image += packed
        self.offsets, self.packed, self._free = tuple(offsets), bytes(image), []

    def _new(self) -> tuple:
        buffer = ffi.new("char[]", len(self.packed))
        view = ffi.buffer(buffer)
        view[:] = self.packed
        configs = tuple(ffi.new("fmha_launch_config *", {
            "kernel": kernel_handle(self.device, entry), "grid": grid, "block": (entry.threads, 1, 1),
            "dynamic_shared_bytes": entry.shared, "args": buffer + offset, "args_size": size})
            for (entry, grid, size), offset in zip(self.kernels, self.offsets))
        return view, configs, buffer  # the configurations point into `buffer`: the slot keeps it alive

    def take(self) -> tuple:
        """A slot of this call's own: (writable view of its argument bytes, configurations, buffer)."""
        try:
            return self._free.pop()
        except IndexError:
            return self._new()

    def launch(self, slot: tuple, stream: int) -> None:
        """Launch the slot's configurations in order (up to the first that fails) and give it back."""
        for config, (entry, _, _) in zip(slot[1], self.kernels):
            status = _launch(config, stream)
            if status:
                self._free.append(slot)
                backend.check(status, "fmha_launch", kernel=entry.key, device=self.device)
        self._free.append(slot)


class PooledLaunches:
    """Launches written into a slot of a LaunchPool, checked and packed: `launch` launches them in
    order and gives the slot back. Subclasses say what the launches are (`keys`, iteration)."""

    __slots__ = ("pool", "slot")

    def __init__(self, pool: LaunchPool, slot: tuple):
        self.pool, self.slot = pool, slot

    def launch(self, stream: int) -> None:
        self.pool.launch(self.slot, stream)


def launch(device: int, entry: KernelEntry, grid, args: dict, stream: int = 0) -> None:
    """Pack `args` by the kernel's typed layout and launch it on `device` and `stream`. Triton's
    scratch pointers may be left out: they are always NULL."""
    args = {**dict.fromkeys(SCRATCH_POINTERS, NULL), **args}
    packed = entry.packer.pack(args)
    if LOG_CONFIG:
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
