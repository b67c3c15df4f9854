"""Whether this machine has a GPU, asked of the operating system (its device nodes) as well as of fmha_rt:
the GPU tests skip only where there is none. Where one is present but fmha_rt's runtime cannot use it (a
broken shim, a driver that fails to initialise), every GPU test fails with the runtime's error, and the
frameworks the GPU tests use (torch, CuPy, JAX) are required rather than skipped."""
import glob
import importlib
import os

import pytest

from fmha_rt.runtime import backend
from fmha_rt.errors import FmhaError


def _hidden(variable):
    """True where the environment hides every device of a vendor (an empty or -1 *_VISIBLE_DEVICES)."""
    value = os.environ.get(variable)
    return value is not None and value.strip() in ("", "-1")


def device_nodes():
    """The GPU device nodes the operating system shows (NVIDIA's or AMD's), less those hidden."""
    nodes = []
    if not _hidden("CUDA_VISIBLE_DEVICES"):
        nodes += glob.glob("/dev/nvidia[0-9]*")
    if not _hidden("HIP_VISIBLE_DEVICES") and os.path.exists("/dev/kfd"):
        nodes += glob.glob("/dev/dri/renderD*")
    return nodes


def _status():
    """(skip reason, failure reason): at most one of them is not None."""
    try:
        rt = backend.runtime()
        problem = None if rt.devices else f"the {rt.backend} runtime {rt.library} sees no GPU device"
    except FmhaError as exc:
        problem = f"no GPU runtime: {exc}"
    if problem is None:
        return None, None
    nodes = device_nodes()
    if nodes:
        return None, f"this machine has GPU device nodes ({', '.join(sorted(nodes)[:4])}) but {problem}"
    return f"no GPU device ({problem})", None


SKIP_REASON, FAILURE = _status()


def require(module_name):
    """The module, imported; skips (the test or, at import time, the whole file) only where there is no
    GPU. On a GPU machine a missing module fails."""
    if SKIP_REASON:
        pytest.skip(SKIP_REASON, allow_module_level=True)
    return importlib.import_module(module_name)
