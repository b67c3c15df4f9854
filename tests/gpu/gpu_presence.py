"""Whether this machine has a GPU, asked of the operating system (its device nodes) as well as of fmha_rt:
the GPU tests skip only where there is none. Where one is present but fmha_rt's runtime cannot use it (a
broken shim, a driver that fails to initialise), every GPU test fails with the runtime's error, and the
frameworks the GPU tests use (torch, CuPy, JAX) are required rather than skipped."""
import glob
import importlib
import os

import pytest

from fmha_rt.gpu_presence import NoGpu, require_gpu


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
    """(skip reason, failure reason): at most one of them is not None. What fmha_rt finds missing is the
    command line's answer (fmha_rt.gpu_presence); the device nodes tell a machine without a GPU from one
    whose GPU fmha_rt cannot use."""
    try:
        require_gpu(needed_for="the GPU test suite")
        return None, None
    except NoGpu as exc:
        problem = str(exc)
    nodes = device_nodes()
    if nodes:
        return None, f"this machine has GPU device nodes ({', '.join(sorted(nodes)[:4])}), but {problem}"
    return f"no GPU device: {problem}", None


SKIP_REASON, FAILURE = _status()


def require(module_name):
    """The module, imported; skips (the test or, at import time, the whole file) only where there is no
    GPU. On a GPU machine a missing module fails."""
    if SKIP_REASON:
        pytest.skip(SKIP_REASON, allow_module_level=True)
    return importlib.import_module(module_name)
