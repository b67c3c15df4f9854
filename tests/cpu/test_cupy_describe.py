"""CuPy arrays described from their attributes (fmha_rt/csrc/describe.c), on the CPU: an array of the
describer's CuPy type is keyed from shape, strides, dtype.str, data.ptr and data.device_id, with no
driver query for its pointer, and only the call's first CuPy array makes its interface dict, whose
stream entry orders the call's stream as the interface path orders it; a hit launches what the same
call of interface arrays launches; what the attributes cannot say exactly is described per array (DLPack).

FakeCupyArray shows a fake GPU array (fake_gpu.py) as CuPy's ndarray shows itself; the tests make the
describer take its type for cupy.ndarray.
"""
import struct
import types

import numpy as np
import pytest

from fmha_rt import arrays

from fake_gpu import ITEMSIZE, TYPESTR, FakeGpuArray
from test_array_interface import describe, forward
from test_plan_cache import B, D, H, S, hits, uncached, warm

KIND_CUPY = 3


class FakeCupyArray:
    """`array` with CuPy's attributes: shape, strides in bytes, a NumPy dtype, data (ptr, device_id),
    besides its interface (each dict made is counted in `interface_reads`) and its DLPack export."""

    interface_reads = 0

    def __init__(self, shape, dtype="float16", *, stream=None, device=0, strides=None, **kwargs):
        self.array = FakeGpuArray(shape, dtype, stream=stream, device=device, strides=strides, **kwargs)
        itemsize = ITEMSIZE[dtype]
        compact = [int(np.prod(shape[i + 1:])) for i in range(len(shape))]
        self.shape = tuple(shape)
        self.strides = tuple(s * itemsize for s in (strides or compact))
        self.dtype = np.dtype(TYPESTR[dtype])
        self.data = types.SimpleNamespace(ptr=self.array.ptr, device_id=device)

    @property
    def __cuda_array_interface__(self):
        FakeCupyArray.interface_reads += 1
        return self.array.__cuda_array_interface__

    def __dlpack__(self, **kwargs):
        return self.array.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self.array.__dlpack_device__()


@pytest.fixture(autouse=True)
def cupy_type(monkeypatch):
    """The describer takes FakeCupyArray for cupy.ndarray (made again with it on the next call)."""
    monkeypatch.setattr(arrays, "cupy_array_type", lambda: FakeCupyArray)
    monkeypatch.setattr(arrays, "DESCRIBER", (None, None, None))
    FakeCupyArray.interface_reads = 0


def cupy_arrays_of(kind=FakeCupyArray, stream=None, **kwargs):
    """q, k, v, out, lse of one forward, produced on `stream`."""
    q, k, v, out = (kind((B, S, H, D), stream=stream, **kwargs) for _ in range(4))
    return q, k, v, out, kind((B, H, S), "float32", stream=stream, **kwargs)


def test_words_hold_kind_dtype_device_shape_and_strides_in_elements(rt, driver):
    q = FakeCupyArray((2, 8, 4, 16), device=1, strides=(1024, 64, 16, 1))
    description, values = describe((q,))
    words = list(struct.unpack(f"<{len(description) // 8}q", description))
    assert words[0] == KIND_CUPY | 4 << 8 | 2 << 16 | 16 << 24 | 1 << 32 | 2 << 48  # float16, CUDA
    assert words[1:] == [1, 2, 8, 4, 16, 1024, 64, 16, 1] and values[0] == q.data.ptr
    assert rt.pointer_queries == [] and FakeCupyArray.interface_reads == 1
    for dtype, code, bits in (("float32", 2, 32), ("int32", 0, 32), ("float16", 2, 16), ("uint8", 1, 8)):
        description, _ = describe((FakeCupyArray((3,), dtype),))  # each dtype's type read once, then remembered
        header = struct.unpack("<q", description[:8])[0]
        assert header == KIND_CUPY | 1 << 8 | code << 16 | bits << 24 | 1 << 32 | 2 << 48


def test_a_hit_reads_one_interface_asks_the_driver_nothing_and_launches_what_interface_arrays_launch(
        monkeypatch, rt, driver):
    call = cupy_arrays_of(stream=1)
    twins = tuple(a.array for a in call)  # the same memory, as interface arrays
    expected = uncached(monkeypatch, driver, lambda: forward(twins, causal=True))
    warm(lambda: forward(call, causal=True))
    driver.take()
    rt.reset()
    rt.pointer_queries.clear()
    FakeCupyArray.interface_reads = 0
    forward(call, causal=True)
    assert hits() == 1 and driver.take() == expected
    assert rt.pointer_queries == [] and FakeCupyArray.interface_reads == 1 and rt.stream_events == []


@pytest.mark.parametrize("producer, call_stream, orderings", [
    (0x20, 0x10, [(0, 0x20, 0x10)]),
    (None, 0x10, []),  # CuPy's interface without a stream (CUPY_CUDA_ARRAY_INTERFACE_SYNC off)
    (1, None, []),  # the legacy default stream is the call's
    (0x10, 0x10, []),
])
def test_the_first_arrays_stream_orders_the_call_as_the_interface_path_does(rt, driver, producer, call_stream,
                                                                            orderings):
    call = cupy_arrays_of(stream=producer)
    warm(lambda: forward(call, stream=call_stream))
    rt.reset()
    forward(call, stream=call_stream)
    assert hits() == 1 and rt.orderings() == orderings
    twins = tuple(a.array for a in call)
    warm(lambda: forward(twins, stream=call_stream))
    rt.reset()
    forward(twins, stream=call_stream)
    assert rt.orderings() == orderings, "the interface path orders the same streams"


def test_cupy_and_interface_arrays_of_one_call_are_each_described_their_way(rt, driver):
    q, k, v, out, lse = cupy_arrays_of(stream=0x20)
    mixed = (q, k.array, v, out.array, lse)
    description, _ = describe(mixed, stream=0x10)
    assert description[0] == KIND_CUPY and len(rt.pointer_queries) == 2  # k's and out's
    assert rt.orderings() == [(0, 0x20, 0x10)], "one producer, waited for once"


def test_a_subclass_reads_its_interface_and_a_bfloat16_array_is_described_per_array(rt, driver):
    class Sub(FakeCupyArray):
        pass

    description, _ = describe(cupy_arrays_of(Sub))
    assert description[0] == 2, "a subclass is read through its interface"
    description, _ = describe((FakeCupyArray((B, S, H, D), "bfloat16"),))
    assert isinstance(description, tuple), "a void typestr says nothing of the dtype: described per array"


def test_an_empty_array_is_described_per_array(rt, driver):
    empty = FakeCupyArray((0, S, H, D))
    empty.data.ptr = 0
    description, _ = describe((empty,))
    assert isinstance(description, tuple), "described per array, by its DLPack import"
