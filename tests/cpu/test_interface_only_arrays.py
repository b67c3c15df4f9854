"""Objects that offer only the CUDA Array Interface (version 3), with no DLPack, on the stand-in
runtime: a call of them launches exactly what the same memory launches as DLPack arrays (planned
from scratch and through the plan cache, outputs given or allocated), the call's stream waits for the
interface's producer stream, and what the runtime cannot use exactly is refused, naming the argument,
before any launch."""
import pytest

import fmha_rt
from fmha_rt.errors import FmhaTypeError, FmhaValueError

from fake_gpu import FakeGpuArray
from test_plan_cache import B, D, H, S, uncached



class InterfaceOnly:
    """Nothing but `__cuda_array_interface__`, read from a fake GPU array (kept alive here), with
    `changes` applied to the dict."""

    def __init__(self, array, **changes):
        self.array, self.changes = array, changes

    @property
    def __cuda_array_interface__(self):
        return {**self.array.__cuda_array_interface__, **self.changes}


def forward_arrays(stream=None, device=0, device_type="cuda"):
    """q, k, v, out, lse of one forward as fake GPU arrays produced on `stream`."""
    q, k, v, out = (FakeGpuArray((B, S, H, D), stream=stream, device=device, device_type=device_type)
                    for _ in range(4))
    return q, k, v, out, FakeGpuArray((B, H, S), "float32", stream=stream, device=device, device_type=device_type)


def forward(arrays, **options):
    q, k, v, out, lse = arrays
    return fmha_rt.mha_fwd(q, k, v, out=out, lse=lse, **options)


def test_interface_only_arrays_launch_what_their_dlpack_twins_launch(monkeypatch, rt, driver):
    twins = forward_arrays()
    wrapped = tuple(InterfaceOnly(a) for a in twins)
    want = uncached(monkeypatch, driver, lambda: forward(twins, causal=True))
    assert want and uncached(monkeypatch, driver, lambda: forward(wrapped, causal=True)) == want
    for _ in range(3):  # a miss, the signature recorded, then hits: every one launches the same bytes
        forward(wrapped, causal=True)
        assert driver.take() == want
    assert fmha_rt.plan_cache_info()["hits"] >= 1


def test_outputs_of_interface_only_inputs_are_the_runtimes_own_buffers(rt, driver):
    q, k, v, _, _ = (InterfaceOnly(a) for a in forward_arrays(device=1))
    out, lse = fmha_rt.mha_fwd(q, k, v)
    assert (out.shape, lse.shape, out.dtype, lse.dtype) == ((B, S, H, D), (B, H, S), "float16", "float32")
    assert out.__dlpack_device__() == (2, 1) and len(driver.take()) == 1


def test_a_backward_of_interface_only_arrays_launches_what_dlpack_launches(monkeypatch, rt, driver):
    q, k, v, out, lse = forward_arrays()
    dout, dq, dk, dv = (FakeGpuArray((B, S, H, D)) for _ in range(4))
    twins = (dout, q, k, v, out, lse, dq, dk, dv)

    def backward(a):
        return fmha_rt.mha_bwd(*a[:6], dq=a[6], dk=a[7], dv=a[8], deterministic=True)

    want = uncached(monkeypatch, driver, lambda: backward(twins))
    assert want and uncached(monkeypatch, driver, lambda: backward(tuple(InterfaceOnly(a) for a in twins))) == want


@pytest.mark.parametrize("producer, call_stream, device_type, recorded_on, waiting", [
    (0x20, 0x10, "cuda", 0x20, 0x10),
    (0x20, None, "cuda", 0x20, 0),
    (1, 0x10, "rocm", 0, 0x10),  # ROCm's legacy default stream is its null stream
])
def test_the_calls_stream_waits_for_the_producer_stream(monkeypatch, rt, driver, producer, call_stream, device_type,
                                                       recorded_on, waiting):
    wrapped = tuple(InterfaceOnly(a) for a in forward_arrays(stream=producer, device=1, device_type=device_type))
    uncached(monkeypatch, driver, lambda: forward(wrapped, stream=call_stream))
    assert set(rt.orderings()) == {(1, recorded_on, waiting)}


@pytest.mark.parametrize("producer, call_stream", [(None, 0x10), (0x10, 0x10), (1, None)])
def test_no_ordering_when_the_data_is_ready_on_the_calls_stream(monkeypatch, rt, driver, producer, call_stream):
    wrapped = tuple(InterfaceOnly(a) for a in forward_arrays(stream=producer))
    assert len(uncached(monkeypatch, driver, lambda: forward(wrapped, stream=call_stream))) == 1
    assert rt.orderings() == []


@pytest.mark.parametrize("changes, error, message", [
    (dict(version=2), FmhaValueError, r"^q: __cuda_array_interface__ version 2 is not supported \(version 3 only"),
    (dict(mask=object()), FmhaValueError, r"^q: a masked __cuda_array_interface__ is not supported$"),
    (dict(typestr="<V2"), FmhaTypeError, r"^q: __cuda_array_interface__ typestr '<V2' is not supported.*bfloat16 "
                                         r"arrays: pass them through DLPack"),
    (dict(typestr=">f2"), FmhaTypeError, r"^q: __cuda_array_interface__ typestr '>f2' is not supported"),
    (dict(strides=(S * H * D * 2, H * D * 2, D * 2, 3)), FmhaValueError, r"^q: __cuda_array_interface__ strides "
                                                                          r"\(.*, 3\) \(bytes\) are not whole elements"),
    (dict(stream=0), FmhaValueError, r"^q: __cuda_array_interface__ stream 0 is not a stream"),
    (dict(data=(0x1000, False)), FmhaValueError, r"^q: the driver knows no GPU memory at its __cuda_array_interface__ "
                                                 r"data pointer 0x1000$"),
    (dict(data=(0, False)), FmhaValueError, r"^q: its __cuda_array_interface__ has a NULL data pointer"),
    (dict(offset=16), FmhaValueError, r"^q: a __cuda_array_interface__ with offset 16 is not supported \(give the data "
                                      r"pointer of the first element\)$"),
])
def test_what_cannot_be_used_exactly_is_refused_before_any_launch(monkeypatch, rt, driver, changes, error, message):
    q, k, v, out, lse = forward_arrays()
    bad = InterfaceOnly(q, **changes)
    with pytest.raises(error, match=message):
        uncached(monkeypatch, driver, lambda: forward((bad, k, v, out, lse)))
    with pytest.raises(error, match=message):  # the same through the plan cache's describing
        forward((bad, k, v, out, lse))
    assert driver.take() == [] and out.untouched() and lse.untouched()


def test_an_object_with_neither_protocol_is_refused_naming_both(rt, driver):
    _, k, v, out, lse = forward_arrays()
    with pytest.raises(FmhaTypeError, match=r"^q must support DLPack .* or the CUDA Array Interface "
                                            r"\(__cuda_array_interface__\); got list$"):
        forward(([1.0], k, v, out, lse))
