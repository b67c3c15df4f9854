"""What stands between this machine and a GPU run, said in one line: the command line checks it before
any GPU work, so that a machine without a GPU gets a sentence, not a traceback."""
from __future__ import annotations

from .errors import FmhaError


NO_GPU_EXIT = 2  # the exit status of a command that needs a GPU and finds none
NO_DRIVER_LIBRARY = "no GPU runtime library found"  # the shim's words when neither CUDA's nor HIP's loads


class NoGpu(Exception):
    """The reason a command cannot run on the GPU (its message is the one line the user sees)."""


def require_gpu(device: int = 0, needed_for: str = "this command"):
    """The Device `device` names, or NoGpu saying which is missing: the C shim, the driver library
    (CUDA's libcuda or HIP's libamdhip64), a GPU device, or that ordinal."""
    try:
        from .runtime import backend  # raises when the C shim is not built

        rt = backend.runtime()
    except FmhaError as exc:
        if NO_DRIVER_LIBRARY in str(exc):
            raise NoGpu(f"{needed_for} needs a GPU, and this machine has no GPU driver library ({exc})") from None
        raise NoGpu(f"{needed_for} needs a GPU, and the driver failed: {exc}") from None
    if not rt.devices:
        raise NoGpu(f"{needed_for} needs a GPU, and the {rt.backend} driver ({rt.library}) sees no GPU device")
    if not 0 <= device < len(rt.devices):
        raise NoGpu(f"{needed_for} needs GPU device {device}, and {len(rt.devices)} device(s) are present "
                    f"(0..{len(rt.devices) - 1})")
    return rt.devices[device]
