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
# (device, kernel key) -> the C kernel handle fmha_kernel_get returned: a cached launch's one dict lookup
loaded_handles: dict[tuple[int, str], object] = {}


def _log_config_from_environment() -> bool:
    return os.environ.get("FMHA_RT_LOG_CONFIG", "") not in ("", "0")


LOG_CONFIG = _log_config_from_environment()  # whether every launch and every API call (call_log.py) is logged


def refresh_log_config() -> bool:
    """Read FMHA_RT_LOG_CONFIG again (it is read once at import); returns whether launches and calls are logged."""
    global LOG_CONFIG
    LOG_CONFIG = _log_config_from_environment()
    return LOG_CONFIG


def log_config_enabled() -> bool:
    return LOG_CONFIG


def kernel_handle(device: int, entry: KernelEntry):
    handle = loaded_handles.get((device, entry.key))
    if handle is None:
        backend.device(device)  # initialises the runtime and checks the ordinal
        image = registry().image(entry)
        out = ffi.new("fmha_kernel **")
        backend.check(lib.fmha_kernel_get(device, entry.key.encode(), image, len(image), entry.symbol.encode(),
                                          entry.shared, out), "fmha_kernel_get", kernel=entry.key, device=device)
        handle = loaded_handles.setdefault((device, entry.key), out[0])
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
        status = launch_prepared(self.config, stream)
        if status:
            backend.check(status, "fmha_launch", kernel=self.entry.key, device=self.device)


# The C launch of a PreparedLaunch's configuration (a stand-in runtime replaces it to record launches).
launch_prepared = lib.fmha_launch_prepared


class Ready:
    """A cached plan's launches bound to one call (plan_cache.BoundLaunches): `launch(stream)` checks and
    launches them in order, `keys` names their kernels. executor.run launches these as they are and
    plans anything else first."""

    __slots__ = ()


# The driver calls of a cached plan's replay (replay.c): the shim's own (a stand-in runtime swaps them).
REPLAY_OPS = lib.fmha_replay_native_ops()


def with_scratch(args: dict) -> dict:
    """`args` with Triton's scratch pointers added where they are left out: they are always NULL (a
    family whose kernels take global scratch passes its region)."""
    return {**_NULL_SCRATCH, **args}


_NULL_SCRATCH = dict.fromkeys(SCRATCH_POINTERS, NULL)


def launch(device: int, entry: KernelEntry, grid, args: dict, stream: int = 0) -> None:
    """Pack `args` by the kernel's typed layout and launch it on `device` and `stream`. Triton's
    scratch pointers may be left out (with_scratch)."""
    args = with_scratch(args)
    packed = entry.packer.pack(args)
    if LOG_CONFIG:
        log_launch(device, entry, grid, args, stream)
    PreparedLaunch(device, entry, grid, packed)(stream)


def logger() -> logging.Logger:
    """The "fmha_rt" logger, made to print when FMHA_RT_LOG_CONFIG asks for logs and nothing is configured."""
    if not log.hasHandlers():
        log.addHandler(logging.StreamHandler())
        log.setLevel(logging.INFO)
    return log


def log_launch(device: int, entry: KernelEntry, grid, args: dict, stream: int) -> None:
    lines = [f"kernel: {entry.key}", f"family: {entry.family}", f"device: {device}",
             f"grid: {tuple(grid)}", f"block: ({entry.threads}, 1, 1)", f"shared: {entry.shared}",
             f"stream: 0x{stream:x}"]
    lines += [f"{name}: {args[name]!r}" for name in entry.packer.names]
    logger().info("launch\n%s", "\n".join(lines))
