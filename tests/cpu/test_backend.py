"""Driver discovery on machines without a GPU: each case runs in a fresh process, since the runtime
is initialised once per process."""
import ctypes.util
import json
import os
import subprocess
import sys

import pytest

PROBE = r"""
import json, sys
from fmha_rt.runtime import backend
from fmha_rt.errors import FmhaError
try:
    rt = backend.runtime()
    out = {"backend": rt.backend, "library": rt.library, "devices": len(rt.devices)}
    try:
        backend.device(0)
    except FmhaError as exc:
        out["device0"] = [type(exc).__name__, str(exc)]
except FmhaError as exc:
    out = {"error": [type(exc).__name__, str(exc), isinstance(exc, RuntimeError)]}
print(json.dumps(out))
"""


def probe(backend_name):
    env = dict(os.environ, FMHA_RT_BACKEND=backend_name)
    done = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def have_library(*names):
    return any(ctypes.util.find_library(n) or os.path.exists(f"/usr/lib/x86_64-linux-gnu/{n}") for n in names)


@pytest.mark.skipif(have_library("cuda", "libcuda.so.1"), reason="this machine has the CUDA driver")
def test_missing_cuda_driver_is_a_clear_runtime_error():
    out = probe("cuda")
    kind, message, is_runtime_error = out["error"]
    assert kind == "FmhaRuntimeError" and is_runtime_error
    assert "no GPU runtime library found" in message and "libcuda.so.1" in message


def test_hip_runtime_without_a_gpu_reports_no_device():
    if not have_library("amdhip64", "libamdhip64.so.5", "libamdhip64.so.6", "libamdhip64.so"):
        pytest.fail("the HIP runtime library is not installed: .ci/run installs Debian's libamdhip64-5")
    out = probe("hip")
    assert out["backend"] == "hip" and out["library"].startswith("libamdhip64.so")
    assert out["devices"] == 0
    assert out["device0"][0] == "FmhaValueError" and "0 GPU device(s) present" in out["device0"][1]


def test_unknown_backend_name_is_refused():
    out = probe("opencl")
    assert out["error"][0] == "FmhaValueError" and "FMHA_RT_BACKEND='opencl'" in out["error"][1]


def run_on_hip(script: str) -> dict:
    """The JSON that `script` prints last, run in a fresh process on the HIP runtime (no GPU here)."""
    if not have_library("amdhip64", "libamdhip64.so.5", "libamdhip64.so.6", "libamdhip64.so"):
        pytest.fail("the HIP runtime library is not installed: .ci/run installs Debian's libamdhip64-5")
    env = dict(os.environ, FMHA_RT_BACKEND="hip")
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


CAPTURE_PROBE = r"""
import json
from fmha_rt.runtime import backend
from fmha_rt import release_workspaces
from fmha_rt.runtime.backend import ffi, lib
backend.runtime()
status = ffi.new("int *", 7)
out = {"null": lib.fmha_stream_capture_status(0, 0x10, ffi.NULL),
       "device 0": lib.fmha_stream_capture_status(0, 0x10, status), "message": backend.last_error(),
       "untouched": status[0], "bad argument": lib.FMHA_ERR_BAD_ARGUMENT}
release_workspaces()  # nothing kept: no driver call, no error
print(json.dumps(out))
"""


def test_the_capture_query_is_resolved_from_the_hip_runtime():
    """hipStreamIsCapturing is found (a missing entry point would answer FMHA_ERR_NO_SYMBOL before the
    device check); with no GPU the query stops at the device, leaving the status as it was."""
    out = run_on_hip(CAPTURE_PROBE)
    assert out["null"] == out["device 0"] == out["bad argument"]
    assert "device 0 does not exist" in out["message"] and out["untouched"] == 7


POINTER_PROBE = r"""
import ctypes, json
from fmha_rt import arrays
from fmha_rt.runtime import backend, kernel_launch
from fmha_rt.runtime.backend import ffi, lib
backend.runtime()
host = ctypes.create_string_buffer(64)


class Interface:
    __cuda_array_interface__ = {"shape": (32,), "typestr": "<f2", "data": (ctypes.addressof(host), False), "version": 3}


where = ffi.new("int[3]", [-7, -7, -7])
values = ffi.new("uint64_t[1]")
out = {"pointer": lib.fmha_pointer_location(ctypes.addressof(host), where, where + 1, where + 2),
       "message": backend.last_error(), "where": list(where),
       "create": lib.fmha_event_create(0, ffi.new("uint64_t *")), "record": lib.fmha_event_record(0, 1, 0),
       "wait": lib.fmha_stream_wait_event(0, 0, 1), "order": lib.fmha_stream_order(kernel_launch.REPLAY_OPS, 0, 0x20, 0x10),
       "described": arrays.make_describer(kernel_launch.REPLAY_OPS)((Interface(),), int(ffi.cast("uintptr_t", values)), 1, 0),
       "driver": lib.FMHA_ERR_DRIVER, "bad argument": lib.FMHA_ERR_BAD_ARGUMENT}
print(json.dumps(out))
"""


def test_the_pointer_and_event_calls_are_resolved_from_the_hip_runtime():
    """hipPointerGetAttributes, hipEventCreateWithFlags, hipEventRecord and hipStreamWaitEvent are found
    (a missing one would fail the runtime's start); with no GPU the pointer query fails as a driver
    error naming it, the event calls stop at the device, and the describer refuses the array."""
    out = run_on_hip(POINTER_PROBE)
    assert out["pointer"] == out["driver"] and out["message"].startswith("hipPointerGetAttributes failed with")
    assert out["where"] == [10, -7, -7], "ROCm's DLPack device type, nothing else written"
    assert out["create"] == out["record"] == out["wait"] == out["order"] == out["bad argument"]
    assert out["described"] is None
