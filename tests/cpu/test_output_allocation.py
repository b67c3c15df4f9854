"""Outputs fmha_rt allocates with the caller's framework (arrays.allocate), through stand-ins of torch's
and CuPy's allocation and stream API: an array for kernels on a stream other than the framework's
current one is tied to that stream (torch: record_stream; CuPy: allocated with it current), so that its
memory is reused only after the kernels; on the current stream nothing extra happens. The real
allocators are exercised on a GPU by tests/gpu/test_output_streams.py."""
import contextlib
import types

import pytest

from fmha_rt import arrays


class StandInTensor:
    def __init__(self, shape, device_index):
        self.shape, self.device = shape, types.SimpleNamespace(type="cuda", index=device_index)
        self.is_cuda = True
        self.recorded = []

    def record_stream(self, stream):
        self.recorded.append(stream)

    def __getitem__(self, index):
        return self

    def data_ptr(self):
        return 0x7000


def stand_in_torch(current: int, raw_getter=True):
    created = []

    class ExternalStream:
        def __init__(self, handle, device=None):
            self.handle, self.device = handle, device
            created.append(self)

    torch = types.SimpleNamespace(
        float16="float16", float32="float32",
        empty=lambda shape, dtype, device: StandInTensor(shape, device.index),
        cuda=types.SimpleNamespace(ExternalStream=ExternalStream,
                                   default_stream=lambda device: ("default stream", device),
                                   current_stream=lambda index: types.SimpleNamespace(cuda_stream=current)),
        _C=types.SimpleNamespace(**({"_cuda_getCurrentRawStream": lambda index: current} if raw_getter else {})),
        created=created)
    return torch


def stand_in_cupy(current: int):
    state = {"current": current}
    allocated = []

    class ExternalStream:
        def __init__(self, handle, device):
            self.ptr, self.device = handle, device

        def __enter__(self):
            self.previous, state["current"] = state["current"], self.ptr

        def __exit__(self, *exc):
            state["current"] = self.previous

    class Array:
        def __init__(self, shape):
            self.shape, self.stream = shape, state["current"]  # the pool this memory goes back to
            self.data = types.SimpleNamespace(ptr=0x9000)
            allocated.append(self)

        def __getitem__(self, index):
            return self

    cupy = types.SimpleNamespace(
        empty=lambda shape, dtype: Array(shape),
        cuda=types.SimpleNamespace(Device=lambda device: contextlib.nullcontext(), ExternalStream=ExternalStream,
                                   get_current_stream=lambda: types.SimpleNamespace(ptr=state["current"])),
        allocated=allocated, state=state)
    return cupy


@pytest.fixture(autouse=True)
def fresh_stream_cache(monkeypatch):
    monkeypatch.setattr(arrays, "framework_streams", {})


def template(device_index=1):
    return types.SimpleNamespace(device=types.SimpleNamespace(index=device_index))


@pytest.mark.parametrize("raw_getter", [True, False], ids=["C getter", "public API"])
def test_torch_array_on_the_current_stream_records_nothing(monkeypatch, raw_getter):
    torch = stand_in_torch(current=0x55, raw_getter=raw_getter)
    monkeypatch.setitem(arrays.sys.modules, "torch", torch)
    array, ptr = arrays.allocate("torch", template(), (2, 3), "float16", 1, 0x55)
    assert array.recorded == [] and ptr == 0x7000


@pytest.mark.parametrize("raw_getter", [True, False], ids=["C getter", "public API"])
def test_torch_array_for_another_stream_is_recorded_on_it_once_wrapped(monkeypatch, raw_getter):
    torch = stand_in_torch(current=0x55, raw_getter=raw_getter)
    monkeypatch.setitem(arrays.sys.modules, "torch", torch)
    first, _ = arrays.allocate("torch", template(), (2, 3), "float32", 1, 0x77, pitch=8)
    second, _ = arrays.allocate("torch", template(), (4,), "float32", 1, 0x77)
    (stream,) = first.recorded
    assert (stream.handle, stream.device) == (0x77, 1) and second.recorded == [stream]
    assert len(torch.created) == 1  # one wrapper per (device, handle)
    third, _ = arrays.allocate("torch", template(), (4,), "float32", 1, 0)  # the default stream, by handle 0
    assert third.recorded == [("default stream", 1)]


def test_cupy_array_for_another_stream_is_allocated_with_it_current(monkeypatch):
    cupy = stand_in_cupy(current=0x10)
    monkeypatch.setitem(arrays.sys.modules, "cupy", cupy)
    _, ptr = arrays.allocate("cupy", None, (2, 3), "float32", 0, 0x10)
    arrays.allocate("cupy", None, (2, 3), "float32", 0, 0x20, pitch=8)
    assert [a.stream for a in cupy.allocated] == [0x10, 0x20] and ptr == 0x9000
    assert cupy.state["current"] == 0x10  # the caller's current stream is restored


def test_stream_wrappers_are_kept_within_a_bound(monkeypatch):
    torch = stand_in_torch(current=0)
    monkeypatch.setitem(arrays.sys.modules, "torch", torch)
    for handle in range(1, arrays.MAX_FRAMEWORK_STREAMS + 10):
        arrays.allocate("torch", template(), (1,), "float32", 1, handle)
    assert len(arrays.framework_streams) <= arrays.MAX_FRAMEWORK_STREAMS
