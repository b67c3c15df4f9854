"""stream_handle and dlpack_stream_arg against fake stream objects of every accepted kind."""

import pytest

from fmha_rt.errors import FmhaTypeError, FmhaValueError
from fmha_rt.runtime.streams import dlpack_stream_arg, stream_handle


class CudaProtocolStream:
    def __init__(self, answer):
        self.answer = answer

    def __cuda_stream__(self):
        return self.answer


class HipProtocolStream:
    def __init__(self, answer):
        self.answer = answer

    def __hip_stream__(self):
        return self.answer


class TorchLikeStream:
    """torch.cuda.Stream exposes its handle as .cuda_stream (on ROCm builds too)."""

    def __init__(self, handle):
        self.cuda_stream = handle


class CupyLikeStream:
    def __init__(self, handle):
        self.ptr = handle

    def synchronize(self):
        pass


class CupyLikeMemoryPointer:
    """Has .ptr like a CuPy stream but is memory, not a stream."""

    def __init__(self, address):
        self.ptr = address


class ihipStream_t:  # noqa: N801 - named like hip-python's class, which is recognised by name and module
    __module__ = "hip.hip"

    def __init__(self, handle):
        self.handle = handle

    def __int__(self):
        return self.handle


class NotHipPython(ihipStream_t):
    __module__ = "elsewhere"


HANDLE = 0x7F00_1234_5670


@pytest.mark.parametrize("backend", ["cuda", "hip"])
def test_none_is_the_default_stream(backend):
    assert stream_handle(None, backend=backend) == 0


@pytest.mark.parametrize("handle", [0, 1, 2, HANDLE, 2**64 - 1])
def test_int_handles_pass_through(handle):
    assert stream_handle(handle) == handle
    assert stream_handle(handle, backend="hip") == handle


@pytest.mark.parametrize("bad", [-1, 2**64])
def test_out_of_range_int_is_a_value_error(bad):
    with pytest.raises(FmhaValueError, match="stream handle"):
        stream_handle(bad)


@pytest.mark.parametrize("bad", [True, False, 1.0, "0", object()])
def test_other_kinds_are_a_type_error_listing_what_is_accepted(bad):
    with pytest.raises(FmhaTypeError) as info:
        stream_handle(bad)
    assert isinstance(info.value, TypeError)
    for accepted in ("None", "int", "__cuda_stream__", "cuda_stream", ".ptr", "ihipStream_t"):
        assert accepted in str(info.value)


def test_cuda_stream_protocol():
    assert stream_handle(CudaProtocolStream((0, HANDLE))) == HANDLE
    assert stream_handle(CudaProtocolStream((0, 0))) == 0


def test_cuda_stream_protocol_is_not_a_hip_stream():
    with pytest.raises(FmhaTypeError, match="CudaProtocolStream"):
        stream_handle(CudaProtocolStream((0, HANDLE)), backend="hip")


def test_hip_stream_protocol():
    assert stream_handle(HipProtocolStream((0, HANDLE)), backend="hip") == HANDLE
    with pytest.raises(FmhaTypeError):
        stream_handle(HipProtocolStream((0, HANDLE)), backend="cuda")


@pytest.mark.parametrize("answer, error", [
    ((1, HANDLE), FmhaValueError),   # unknown protocol version
    (HANDLE, FmhaTypeError),         # not a pair
    ((0, HANDLE, 0), FmhaTypeError),
    ((0, -5), FmhaValueError),
    ((0, 1.5), FmhaTypeError),
    ((0, True), FmhaTypeError),
])
def test_malformed_protocol_answers(answer, error):
    with pytest.raises(error, match="CudaProtocolStream"):
        stream_handle(CudaProtocolStream(answer))


@pytest.mark.parametrize("backend", ["cuda", "hip"])
def test_torch_and_cupy_streams(backend):
    assert stream_handle(TorchLikeStream(HANDLE), backend=backend) == HANDLE
    assert stream_handle(TorchLikeStream(0), backend=backend) == 0
    assert stream_handle(CupyLikeStream(HANDLE), backend=backend) == HANDLE


def test_framework_handle_must_be_an_int():
    with pytest.raises(FmhaTypeError, match="TorchLikeStream"):
        stream_handle(TorchLikeStream("0x10"))
    with pytest.raises(FmhaValueError, match="CupyLikeStream"):
        stream_handle(CupyLikeStream(-2))


def test_cupy_memory_pointer_is_not_a_stream():
    with pytest.raises(FmhaTypeError, match="CupyLikeMemoryPointer"):
        stream_handle(CupyLikeMemoryPointer(HANDLE))


def test_hip_python_stream():
    assert stream_handle(ihipStream_t(HANDLE), backend="hip") == HANDLE
    with pytest.raises(FmhaTypeError):
        stream_handle(ihipStream_t(HANDLE), backend="cuda")
    with pytest.raises(FmhaTypeError):
        stream_handle(NotHipPython(HANDLE), backend="hip")


def test_unknown_backend():
    with pytest.raises(FmhaValueError, match="backend"):
        stream_handle(None, backend="opencl")


@pytest.mark.parametrize("handle, expected", [(0, 1), (1, 1), (2, 2), (HANDLE, HANDLE)])
def test_dlpack_stream_arg_cuda(handle, expected):
    assert dlpack_stream_arg(handle, "cuda") == expected


@pytest.mark.parametrize("handle", [0, HANDLE])
def test_dlpack_stream_arg_rocm(handle):
    assert dlpack_stream_arg(handle, "rocm") == handle


@pytest.mark.parametrize("handle", [1, 2])
def test_dlpack_stream_arg_rocm_has_no_special_handles(handle):
    with pytest.raises(FmhaValueError, match="ROCm"):
        dlpack_stream_arg(handle, "rocm")


@pytest.mark.parametrize("device_type", ["cpu", "cuda_host", "cuda_managed", "rocm_host"])
def test_dlpack_stream_arg_streamless_devices(device_type):
    assert dlpack_stream_arg(HANDLE, device_type) is None
    assert dlpack_stream_arg(0, device_type) is None
