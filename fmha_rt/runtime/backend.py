"""The GPU runtime as Python sees it: initialisation, devices, errors, memory.

Everything here goes through the C shim (fmha_rt._shim). The driver library is found at run time:
CUDA's libcuda.so.1 or HIP's libamdhip64.so under any of its sonames; FMHA_RT_BACKEND=cuda|hip forces
one. Initialisation happens on first use, once per process.
"""
from __future__ import annotations

import atexit
import contextlib
import dataclasses
import os
import threading

from ..errors import DriverError, FmhaRuntimeError, FmhaValueError

try:
    from .._shim import ffi, lib
except ImportError as exc:  # pragma: no cover - only when the package was not built
    raise FmhaRuntimeError(
        "the fmha_rt C shim is not built: install the package with `pip install -e .` (needs a C "
        f"compiler at install time, and cffi then and at run time) ({exc})"
    ) from exc

BACKENDS = {"auto": lib.FMHA_BACKEND_AUTO, "cuda": lib.FMHA_BACKEND_CUDA, "hip": lib.FMHA_BACKEND_HIP}
BACKEND_NAMES = {lib.FMHA_BACKEND_CUDA: "cuda", lib.FMHA_BACKEND_HIP: "hip"}


@dataclasses.dataclass(frozen=True)
class Device:
    ordinal: int
    name: str
    arch: str  # "sm_90" or a bare "gfx942"
    arch_full: str  # "gfx942:sramecc+:xnack-" as the driver says it
    multiprocessors: int
    max_shared_per_block: int
    total_memory: int


@dataclasses.dataclass(frozen=True)
class Runtime:
    backend: str  # "cuda" | "hip"
    library: str  # the soname that was loaded
    driver_version: int
    devices: tuple[Device, ...]


_lock = threading.Lock()
_runtime: Runtime | None = None
_init_error: FmhaRuntimeError | None = None


def last_error() -> str:
    return ffi.string(lib.fmha_last_error()).decode(errors="replace")


def check(status: int, call: str, *, kernel: str | None = None, device: int | None = None) -> None:
    """Turn a shim status into an exception. Driver failures become DriverError with the driver's
    own error name; the shim's message already names the driver call, kernel and device."""
    if status == lib.FMHA_OK:
        return
    message = last_error()
    if status == lib.FMHA_ERR_DRIVER:
        code = lib.fmha_last_driver_code()
        name = message.split(" failed with ", 1)[1].split(" (", 1)[0] if " failed with " in message else None
        raise DriverError(f"{call}: {message}", code=code, error_name=name, call=call, kernel=kernel,
                          device=device)
    if status == lib.FMHA_ERR_BAD_ARGUMENT:
        raise FmhaValueError(f"{call}: {message}")
    raise FmhaRuntimeError(f"{call}: {message}")


def _requested_backend() -> int:
    choice = os.environ.get("FMHA_RT_BACKEND", "auto").strip().lower() or "auto"
    if choice not in BACKENDS:
        raise FmhaValueError(f"FMHA_RT_BACKEND={choice!r}: expected one of {', '.join(BACKENDS)}")
    return BACKENDS[choice]


def _read_device(ordinal: int) -> Device:
    info = ffi.new("fmha_device_info *")
    check(lib.fmha_device_get_info(ordinal, info), "fmha_device_get_info", device=ordinal)
    return Device(
        ordinal=ordinal,
        name=ffi.string(info.name).decode(errors="replace"),
        arch=ffi.string(info.arch).decode(),
        arch_full=ffi.string(info.arch_full).decode(),
        multiprocessors=info.multiprocessor_count,
        max_shared_per_block=info.max_shared_per_block_optin,
        total_memory=info.total_memory,
    )


def runtime() -> Runtime:
    """Initialise the driver on first call and describe it. Raises FmhaRuntimeError (with the names of
    the libraries tried) when there is no GPU runtime; the same error is raised again on later calls."""
    global _runtime, _init_error
    if _runtime is not None:
        return _runtime
    with _lock:
        if _runtime is None and _init_error is None:
            library = ffi.new("char[64]")
            status = lib.fmha_init(_requested_backend(), library, 64)
            try:
                check(status, "fmha_init")
                version = ffi.new("int *")
                check(lib.fmha_driver_version(version), "fmha_driver_version")
                count = ffi.new("int *")
                check(lib.fmha_device_count(count), "fmha_device_count")
                devices = tuple(_read_device(i) for i in range(count[0]))
                _runtime = Runtime(BACKEND_NAMES[lib.fmha_backend()], ffi.string(library).decode(),
                                   version[0], devices)
                atexit.register(lib.fmha_unload_all)
            except FmhaRuntimeError as exc:
                _init_error = exc
        if _init_error is not None:
            raise _init_error
    return _runtime


def device(ordinal: int) -> Device:
    devices = runtime().devices
    if not 0 <= ordinal < len(devices):
        raise FmhaValueError(f"device {ordinal} does not exist: {len(devices)} GPU device(s) present")
    return devices[ordinal]


def current_device() -> int:
    """The device current on the calling thread (-1 when no context is current)."""
    runtime()
    out = ffi.new("int *")
    check(lib.fmha_current_device(out), "fmha_current_device")
    return out[0]


@contextlib.contextmanager
def device_scope(ordinal: int):
    """Make `ordinal` the calling thread's current device inside the block, then restore the caller's."""
    scope = ffi.new("fmha_device_scope *")
    check(lib.fmha_device_scope_enter(ordinal, scope), "fmha_device_scope_enter", device=ordinal)
    try:
        yield
    finally:
        lib.fmha_device_scope_leave(scope)


def kernel_map_entries() -> list[tuple[int, str]]:
    """(device, kernel key) of every loaded kernel, in load order."""
    count = ffi.new("size_t *")
    check(lib.fmha_kernel_map_size(count), "fmha_kernel_map_size")
    dev, key = ffi.new("int *"), ffi.new("char[160]")
    entries = []
    for i in range(count[0]):
        check(lib.fmha_kernel_map_entry(i, dev, key, 160), "fmha_kernel_map_entry")
        entries.append((dev[0], ffi.string(key).decode()))
    return entries


# ---- memory (stream-ordered) ----

def mem_alloc(ordinal: int, nbytes: int, stream: int = 0) -> int:
    runtime()
    ptr = ffi.new("uint64_t *")
    check(lib.fmha_mem_alloc(ordinal, max(int(nbytes), 1), stream, ptr), "fmha_mem_alloc", device=ordinal)
    return ptr[0]


def mem_free(ordinal: int, ptr: int, stream: int = 0) -> None:
    check(lib.fmha_mem_free(ordinal, ptr, stream), "fmha_mem_free", device=ordinal)


def memset(ordinal: int, ptr: int, value: int, nbytes: int, stream: int = 0) -> None:
    check(lib.fmha_memset_d8(ordinal, ptr, value, nbytes, stream), "fmha_memset_d8", device=ordinal)


def copy_to_device(ordinal: int, dst: int, data, stream: int = 0) -> None:
    """Copy a host buffer (bytes-like) to device memory and wait for it: `data` must stay alive."""
    buf = ffi.from_buffer(data)
    check(lib.fmha_memcpy_htod(ordinal, dst, buf, len(buf), stream), "fmha_memcpy_htod", device=ordinal)
    synchronize(ordinal, stream)


def copy_to_host(ordinal: int, dst, src: int, stream: int = 0) -> None:
    """Copy device memory into a writable host buffer and wait for it."""
    buf = ffi.from_buffer(dst, require_writable=True)
    check(lib.fmha_memcpy_dtoh(ordinal, buf, src, len(buf), stream), "fmha_memcpy_dtoh", device=ordinal)
    synchronize(ordinal, stream)


def synchronize(ordinal: int, stream: int = 0) -> None:
    check(lib.fmha_stream_synchronize(ordinal, stream), "fmha_stream_synchronize", device=ordinal)
