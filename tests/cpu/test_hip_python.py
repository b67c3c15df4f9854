"""hip-python's own objects (the real package, the `hip` extra) where a HIP user passes them: its
streams (`hip.ihipStream_t`) as `stream=`, its device memory (`DeviceArray`, what hipMalloc returns,
which offers the CUDA Array Interface) as arrays and as a workspace. On the stand-in runtime presenting
the HIP backend they launch exactly what DLPack twins and int handles launch; on the real HIP runtime
of a machine without a GPU the call fails with one line saying so.

hip-python's objects are made over stand-in memory with its own `DeviceArray.fromObj(address)`: its
driver calls (hipMalloc, hipStreamCreate) need a GPU, and hip-python looks for the unversioned
libamdhip64.so, which the HIP runtime package alone does not install."""
import dataclasses
import re

import pytest

import fmha_rt
from fmha_rt.errors import FmhaTypeError
from fmha_rt.runtime.streams import stream_handle

from fake_gpu import FakeGpuArray
from test_api_validation import _bwd_ws
from test_backend import run_on_hip
from test_interface_only_arrays import forward, forward_arrays
from test_plan_cache import uncached

hip_package = pytest.importorskip("hip")
from hip import _util, hip  # noqa: E402 - after the importorskip

HANDLE = 0x5A00


def hip_python_array(fake: FakeGpuArray, stream=None):
    """hip-python's DeviceArray over the memory of `fake`, configured as a HIP user configures what
    hipMalloc returned: shape, NumPy typestr and itemsize (and the producer's stream, if any)."""
    interface = fake.__cuda_array_interface__
    array = _util.types.DeviceArray.fromObj(interface["data"][0])
    itemsize = int(interface["typestr"][2:])
    array.configure(shape=fake.shape, typestr=interface["typestr"], itemsize=itemsize, stream=stream, _force=True)
    return array


@pytest.fixture
def hip_rt(rt):
    """The stand-in runtime presenting the HIP backend."""
    rt.runtime = dataclasses.replace(rt.runtime, backend="hip")
    return rt


def test_the_package_is_hip_pythons():
    assert hip.ihipStream_t.__name__ == "ihipStream_t" and callable(hip.hipMalloc)
    assert not hasattr(_util.types.DeviceArray, "__dlpack__")  # its memory comes through the interface alone


def test_a_hip_python_stream_gives_its_handle_on_hip_only():
    assert stream_handle(hip.ihipStream_t.fromObj(HANDLE), backend="hip") == HANDLE
    assert stream_handle(hip.ihipStream_t.fromObj(None), backend="hip") == 0  # hip-python's null stream
    with pytest.raises(FmhaTypeError, match=r"for backend 'cuda'; got ihipStream_t$"):
        stream_handle(hip.ihipStream_t.fromObj(HANDLE), backend="cuda")


def test_hip_python_arrays_and_stream_launch_what_dlpack_and_an_int_handle_launch(monkeypatch, hip_rt, driver):
    twins = forward_arrays(device=1, device_type="rocm")
    wrapped = tuple(hip_python_array(a) for a in twins)
    want = uncached(monkeypatch, driver, lambda: forward(twins, causal=True, stream=HANDLE))
    assert want and all(launch[3] == HANDLE for launch in want)
    stream = hip.ihipStream_t.fromObj(HANDLE)
    assert uncached(monkeypatch, driver, lambda: forward(wrapped, causal=True, stream=stream)) == want
    for _ in range(3):  # a miss, the signature recorded, then hits: every one launches the same bytes
        forward(wrapped, causal=True, stream=stream)
        assert driver.take() == want
    assert fmha_rt.plan_cache_info()["hits"] >= 1


def test_the_calls_stream_waits_for_a_hip_python_arrays_stream(monkeypatch, hip_rt, driver):
    producer = 0x20
    wrapped = tuple(hip_python_array(a, stream=producer) for a in forward_arrays(device=1, device_type="rocm"))
    uncached(monkeypatch, driver, lambda: forward(wrapped, stream=hip.ihipStream_t.fromObj(HANDLE)))
    assert set(hip_rt.orderings()) == {(1, producer, HANDLE)}


def test_a_raw_hip_python_allocation_serves_as_the_workspace(hip_rt, driver):
    """hipMalloc's DeviceArray before any configure: bytes, typestr "B"."""
    given = []

    def alloc(nbytes, zero_init):
        memory = hip_rt.workspace(nbytes)
        raw = _util.types.DeviceArray.fromObj(memory.ptr)
        raw.configure(shape=(nbytes,), _force=True)
        assert raw.__cuda_array_interface__["typestr"] == "B"
        given.append((memory, raw))
        return raw

    _bwd_ws(alloc)
    assert len(given) == 1 and driver.take()
    assert given[0][0].ptr in hip_rt.pointer_queries


NO_DEVICE_PROBE = r"""
import json
import fmha_rt
from hip import _util, hip
q = _util.types.DeviceArray.fromObj(0x7F0000100000)
q.configure(shape=(1, 128, 2, 64), typestr="<f2", itemsize=2, _force=True)
try:
    fmha_rt.mha_fwd(q, q, q, stream=hip.ihipStream_t.fromObj(0x5A00))
    print(json.dumps({"error": None}))
except Exception as exc:
    print(json.dumps({"error": [type(exc).__name__, str(exc)]}))
"""


def test_on_the_hip_runtime_without_a_gpu_the_call_says_so_in_one_line():
    kind, message = run_on_hip(NO_DEVICE_PROBE)["error"]
    assert kind == "FmhaValueError" and re.fullmatch(
        r"q: the driver knows no GPU memory at its __cuda_array_interface__ data pointer 0x7f0000100000 "
        r"\(the hip driver, libamdhip64\.so[.\d]*, sees no GPU device\)", message), message
