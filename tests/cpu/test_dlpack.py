"""DLPack in and out, against NumPy and torch on the CPU and a hand-made producer for what they never emit."""

import ctypes
import gc
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from numpy.lib.array_utils import byte_bounds

from fmha_rt.runtime import dlpack
from fmha_rt.runtime.dlpack import DLPACK_VERSION, DTYPES, READ_ONLY, DLPackExporter, export_capsule, import_array
from fmha_rt.errors import FmhaTypeError, FmhaValueError

RNG = np.random.default_rng(20240611)


# ------------------------------------------------------------------------------------------------ helpers

def element_address(view, index):
    return view.data_ptr + sum(i * s for i, s in zip(index, view.strides)) * view.itemsize


def element_bytes(view, index):
    return ctypes.string_at(element_address(view, index), view.itemsize)


def brute_span(view):
    """(lowest byte, byte count) over every element's address, the slow way."""
    addresses = [element_address(view, index) for index in np.ndindex(*view.shape)]
    if not addresses:
        return None, 0
    return min(addresses), max(addresses) + view.itemsize - min(addresses)


def assert_same_elements_as_numpy(view, arr):
    for index in np.ndindex(*arr.shape):
        assert element_bytes(view, index) == arr[index].tobytes(), index


def assert_same_elements_as_torch(view, tensor):
    for index in np.ndindex(*tensor.shape):
        expected = tensor[index].reshape(1).view(torch.uint8).numpy().tobytes()
        assert element_bytes(view, index) == expected, index


def collect():
    gc.collect()
    gc.collect()


class CapsuleHolder:
    """A producer that hands out one given capsule (every time)."""

    def __init__(self, capsule, device=(1, 0)):
        self.capsule = capsule
        self.device = device

    def __dlpack_device__(self):
        return self.device

    def __dlpack__(self, *, stream=None, max_version=None):
        return self.capsule


# A producer written against the C structs, reaching what NumPy and torch never emit: byte_offset, NULL
# strides, odd dtypes and devices, other versions. It counts how often its deleter runs.
_hand_made = {}  # managed-struct address -> producer


@dlpack.Deleter
def _hand_made_deleter(address):
    _hand_made[address].deleter_calls += 1


@dlpack.CapsuleDestructor
def _hand_made_capsule_destructor(capsule_address):
    for name in (dlpack.NAME_VERSIONED, dlpack.NAME_LEGACY):
        if dlpack.dying_capsule_is_valid(capsule_address, name):
            _hand_made_deleter(dlpack.dying_capsule_get_pointer(capsule_address, name))


class HandMadeProducer:
    def __init__(self, values, *, strides=True, dtype=None, device=(1, 0), byte_offset=0, version=(1, 0),
                 flags=0, versioned=True):
        self.values = np.ascontiguousarray(values)
        self.memory = (ctypes.c_char * (byte_offset + self.values.nbytes))()
        ctypes.memmove(ctypes.addressof(self.memory) + byte_offset, self.values.ctypes.data, self.values.nbytes)
        self.expected_ptr = ctypes.addressof(self.memory) + byte_offset
        self.device = device
        self.deleter_calls = 0
        self.seen = []  # (stream, max_version) per __dlpack__ call
        shape = self.values.shape
        self.shape_array = (ctypes.c_int64 * len(shape))(*shape)
        self.strides_array = (ctypes.c_int64 * len(shape))(*dlpack.contiguous_strides(shape))
        if dtype is None:
            dtype = next(key + (1,) for key, name in DTYPES.items() if name == self.values.dtype.name)
        tensor = dlpack.DLTensor(
            data=ctypes.addressof(self.memory), device=dlpack.DLDevice(*device), ndim=len(shape),
            dtype=dlpack.DLDataType(*dtype), shape=self.shape_array,
            strides=self.strides_array if strides else None, byte_offset=byte_offset)
        deleter = ctypes.cast(_hand_made_deleter, ctypes.c_void_p).value
        if versioned:
            self.managed = dlpack.DLManagedTensorVersioned(
                version=dlpack.DLPackVersion(*version), deleter=deleter, flags=flags, dl_tensor=tensor)
        else:
            self.managed = dlpack.DLManagedTensor(dl_tensor=tensor, deleter=deleter)
        self.versioned = versioned
        _hand_made[ctypes.addressof(self.managed)] = self

    def __dlpack_device__(self):
        return self.device

    def __dlpack__(self, *, stream=None, max_version=None):
        self.seen.append((stream, max_version))
        name = dlpack.NAME_VERSIONED if self.versioned else dlpack.NAME_LEGACY
        return dlpack.capsule_new(ctypes.addressof(self.managed), name, _hand_made_capsule_destructor)


class LegacyOnly:
    """A producer from before DLPack 1.0: its __dlpack__ knows no max_version."""

    def __init__(self, inner):
        self.inner = inner

    def __dlpack_device__(self):
        return self.inner.__dlpack_device__()

    def __dlpack__(self, stream=None):
        return self.inner.__dlpack__(stream=stream)


class HostBuffer(DLPackExporter):
    """Host memory owned by a Python object, exported like the runtime's device buffers."""

    def __init__(self, values, *, shape=None, strides=None, read_only=False, device=("cpu", 0)):
        values = np.ascontiguousarray(values)
        self.memory = (ctypes.c_char * max(values.nbytes, 1)).from_buffer_copy(values.tobytes() or b"\0")
        self.ptr = ctypes.addressof(self.memory)
        self.shape = values.shape if shape is None else shape
        self.strides = strides
        self.dtype = values.dtype.name
        self.device = device
        self.read_only = read_only
        self.consumer_streams = []

    def order_before_consumer(self, consumer_stream):
        self.consumer_streams.append(consumer_stream)

    def host_values(self, count):
        return np.frombuffer(ctypes.string_at(self.ptr, count * np.dtype(self.dtype).itemsize), self.dtype)


# ------------------------------------------------------------------------------------------- numpy -> view

def _numpy_cases():
    base = RNG.standard_normal((6, 8)).astype(np.float32)
    cube = RNG.standard_normal((3, 4, 5))
    return {
        "contiguous": base,
        "transposed": base.T,
        "sliced": base[1:5, ::3],
        "negative_strides": base[::-1, ::-2],
        "3d_mixed": cube[:, ::-1, 1::2].transpose(2, 0, 1),
        "scalar": np.array(3.25),
        "broadcast": np.broadcast_to(base[:1], (4, 8)),
        "float16": RNG.standard_normal((3, 7)).astype(np.float16)[:, 1:],
        "int32": RNG.integers(-1000, 1000, (5, 5), dtype=np.int32).T,
        "int64": RNG.integers(-10**12, 10**12, (9,), dtype=np.int64)[::2],
        "uint8": RNG.integers(0, 255, (4, 6), dtype=np.uint8),
        "bool": RNG.random((4, 3)) > 0.5,
        "complex64": (RNG.standard_normal((3, 3)) + 1j * RNG.standard_normal((3, 3))).astype(np.complex64),
    }


NUMPY_CASES = _numpy_cases()


@pytest.mark.parametrize("case", sorted(NUMPY_CASES))
def test_numpy_view_matches_the_array(case):
    arr = NUMPY_CASES[case]
    with import_array(arr) as view:
        assert view.data_ptr == arr.__array_interface__["data"][0] == arr.ctypes.data
        assert view.shape == arr.shape
        assert view.strides == tuple(s // arr.itemsize for s in arr.strides)
        assert view.dtype == arr.dtype.name
        assert view.itemsize == arr.itemsize
        assert (view.device_type, view.device_id) == ("cpu", 0)
        assert view.read_only == (not arr.flags.writeable)
        low, high = byte_bounds(arr)
        assert (view.span_start, view.nbytes_span) == (low, high - low) == brute_span(view)
        assert_same_elements_as_numpy(view, arr)
        assert view.source is arr


@settings(max_examples=60, deadline=None)
@given(shape=st.lists(st.integers(1, 6), min_size=1, max_size=3), data=st.data())
def test_numpy_random_slicings_span(shape, data):
    base = np.arange(np.prod(shape), dtype=np.float64).reshape(shape)
    index = tuple(slice(data.draw(st.integers(0, n - 1)), None, data.draw(st.sampled_from([-3, -2, -1, 1, 2, 3])))
                  for n in shape)
    arr = base[index]
    with import_array(arr) as view:
        low, high = byte_bounds(arr)
        assert (view.span_start, view.nbytes_span) == (low, high - low) == brute_span(view)
        assert_same_elements_as_numpy(view, arr)


def test_zero_size_array_spans_nothing():
    arr = np.zeros((0, 4), np.float32)
    with import_array(arr) as view:
        assert view.shape == (0, 4)
        assert view.nbytes_span == 0


def test_read_only_numpy_is_flagged():
    arr = RNG.standard_normal((3, 4))
    with import_array(arr) as view:
        assert not view.read_only
    arr.flags.writeable = False
    with import_array(arr) as view:
        assert view.read_only
        assert_same_elements_as_numpy(view, arr)


def test_view_keeps_numpy_memory_alive():
    arr = RNG.standard_normal((64, 16))
    expected = arr[3:].copy()
    view = import_array(arr[3:])
    del arr
    collect()
    assert_same_elements_as_numpy(view, expected)
    view.close()


@pytest.mark.parametrize("versioned", [True, False])
def test_capsule_is_renamed_when_consumed(versioned):
    arr = RNG.standard_normal(5)
    capsule = arr.__dlpack__(max_version=(1, 0)) if versioned else arr.__dlpack__()
    holder = CapsuleHolder(capsule)
    with import_array(holder) as view:
        assert view.data_ptr == arr.ctypes.data
        assert f'"used_dltensor{"_versioned" if versioned else ""}"' in repr(capsule)
        with pytest.raises(FmhaValueError, match="not an unused DLPack capsule"):
            import_array(holder)


def test_legacy_producer_is_asked_without_max_version():
    arr = RNG.standard_normal((2, 3))
    with import_array(LegacyOnly(arr)) as view:
        assert view.data_ptr == arr.ctypes.data
        assert_same_elements_as_numpy(view, arr)


# ------------------------------------------------------------------------------------------- torch -> view

def _torch_cases():
    gen = torch.Generator().manual_seed(7)
    base = torch.randn(6, 8, generator=gen)
    return {
        "contiguous": base,
        "column_slice": base[:, 1:4],
        "transposed": base.T,
        "stepped": base[1::2, ::3],
        "expanded": torch.randn(1, 5, generator=gen).expand(4, 5),
        "permuted": torch.randn(2, 3, 4, generator=gen).permute(2, 0, 1),
        "bfloat16": torch.randn(5, 6, generator=gen).to(torch.bfloat16)[:, 2:],
        "float16": torch.randn(4, 6, generator=gen).to(torch.float16).T,
        "int64": torch.randint(-10**9, 10**9, (7,), generator=gen)[1:],
    }


TORCH_CASES = _torch_cases()


@pytest.mark.parametrize("case", sorted(TORCH_CASES))
def test_torch_view_matches_the_tensor(case):
    tensor = TORCH_CASES[case]
    with import_array(tensor) as view:
        assert view.data_ptr == tensor.data_ptr()
        assert view.shape == tuple(tensor.shape)
        assert view.strides == tensor.stride()
        assert view.dtype == str(tensor.dtype).removeprefix("torch.")
        assert view.itemsize == tensor.element_size()
        assert (view.device_type, view.device_id) == ("cpu", 0)
        assert not view.read_only
        assert (view.span_start, view.nbytes_span) == brute_span(view)
        assert_same_elements_as_torch(view, tensor)


def test_torch_slice_points_inside_its_storage():
    tensor = TORCH_CASES["column_slice"]
    with import_array(tensor) as view:
        assert view.data_ptr == tensor.untyped_storage().data_ptr() + tensor.storage_offset() * 4
        assert tensor.storage_offset() > 0


def test_view_keeps_torch_memory_alive():
    tensor = torch.randn(128, 8)
    expected = tensor[5:].clone()
    view = import_array(tensor[5:])
    del tensor
    collect()
    assert_same_elements_as_torch(view, expected)
    view.close()


def test_producer_refusal_names_the_argument():
    with pytest.raises(FmhaValueError, match=r"^q \(Tensor\) refused DLPack export.*gradient"):
        import_array(torch.randn(2, requires_grad=True), name="q")


@pytest.mark.parametrize("obj", [[1.0, 2.0], 3.0, None])
def test_non_dlpack_object_is_a_type_error(obj):
    with pytest.raises(FmhaTypeError, match=f"^k must support DLPack.*{type(obj).__qualname__}"):
        import_array(obj, name="k")


# ------------------------------------------------------------------------------------ hand-made producer

def test_byte_offset_is_added_to_the_pointer():
    values = RNG.standard_normal((3, 4)).astype(np.float32)
    producer = HandMadeProducer(values, byte_offset=24)
    with import_array(producer) as view:
        assert view.data_ptr == producer.expected_ptr
        assert_same_elements_as_numpy(view, values)


def test_null_strides_mean_c_contiguous():
    values = RNG.standard_normal((2, 3, 4))
    producer = HandMadeProducer(values, strides=False)
    with import_array(producer) as view:
        assert view.strides == (12, 4, 1)
        assert_same_elements_as_numpy(view, values)


def test_deleter_runs_exactly_once():
    producer = HandMadeProducer(RNG.standard_normal(4))
    view = import_array(producer)
    collect()
    assert producer.deleter_calls == 0
    view.close()
    assert producer.deleter_calls == 1 and view.closed
    view.close()
    del view
    collect()
    assert producer.deleter_calls == 1


@pytest.mark.parametrize("versioned", [True, False])
def test_dropped_view_runs_the_deleter(versioned):
    producer = HandMadeProducer(RNG.standard_normal(4), versioned=versioned)
    view = import_array(producer)
    assert not view.read_only
    del view
    collect()
    assert producer.deleter_calls == 1


def test_read_only_flag_of_a_versioned_capsule():
    producer = HandMadeProducer(RNG.standard_normal(4), flags=READ_ONLY)
    with import_array(producer) as view:
        assert view.read_only


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(dtype=(2, 32, 4)), FmhaTypeError, "lanes=4"),
    (dict(dtype=(3, 64, 1)), FmhaTypeError, "code=3"),
    (dict(dtype=(2, 8, 1)), FmhaTypeError, "bits=8"),
    (dict(device=(99, 0)), FmhaValueError, "device type 99"),
    (dict(version=(2, 0)), FmhaValueError, "version 2.0"),
])
def test_rejected_capsule_is_left_to_its_producer(kwargs, error, message):
    producer = HandMadeProducer(RNG.standard_normal(4).astype(np.float32), **kwargs)
    with pytest.raises(error, match=f"^v: .*{message}"):
        import_array(producer, name="v")
    collect()
    assert producer.deleter_calls == 1  # by the capsule's destructor: the capsule was never consumed


@pytest.mark.parametrize("device, stream, expected", [
    ((2, 3), None, None),
    ((2, 3), 0, 1),
    ((2, 3), 2, 2),
    ((2, 3), 0xBEEF0, 0xBEEF0),
    ((10, 1), 0, 0),
    ((10, 1), 0xBEEF0, 0xBEEF0),
    ((1, 0), 0xBEEF0, None),
    ((3, 0), 0xBEEF0, None),
])
def test_stream_given_to_the_producer(device, stream, expected):
    producer = HandMadeProducer(RNG.standard_normal(3), device=device)
    with import_array(producer, stream=stream) as view:
        assert producer.seen == [(expected, DLPACK_VERSION)]
        assert (view.device_type, view.device_id) == (dlpack.DEVICE_TYPES[device[0]], device[1])


def test_legacy_producer_gets_the_stream_too():
    producer = HandMadeProducer(RNG.standard_normal(3), device=(2, 0), versioned=False)
    with import_array(LegacyOnly(producer), stream=0xABC0):
        assert producer.seen == [(0xABC0, None)]


# ----------------------------------------------------------------------------------------------- exporting

def test_numpy_takes_our_buffer_without_a_copy():
    values = RNG.standard_normal((3, 5)).astype(np.float32)
    buffer = HostBuffer(values)
    owner = weakref.ref(buffer)
    arr = np.from_dlpack(buffer)
    assert arr.ctypes.data == buffer.ptr
    np.testing.assert_array_equal(arr, values)
    arr[1, 2] = -7.5
    assert buffer.host_values(15)[1 * 5 + 2] == -7.5
    del buffer
    collect()
    assert owner() is not None
    del arr
    collect()
    assert owner() is None


def test_torch_takes_our_buffer_without_a_copy():
    values = RNG.standard_normal((4, 2, 3)).astype(np.float16)
    buffer = HostBuffer(values)
    owner = weakref.ref(buffer)
    tensor = torch.from_dlpack(buffer)
    assert tensor.data_ptr() == buffer.ptr and tensor.dtype == torch.float16
    np.testing.assert_array_equal(tensor.numpy(), values)
    tensor[0, 1, 2] = 3.0
    assert buffer.host_values(24)[5] == 3.0
    del buffer
    collect()
    assert owner() is not None
    del tensor
    collect()
    assert owner() is None


def test_strided_export():
    values = RNG.standard_normal(12).astype(np.float32)
    buffer = HostBuffer(values, shape=(4, 3), strides=(1, 4))
    arr = np.from_dlpack(buffer)
    np.testing.assert_array_equal(arr, values.reshape(3, 4).T)
    assert arr.strides == (4, 16)
    tensor = torch.from_dlpack(buffer)
    assert tensor.stride() == (1, 4)
    np.testing.assert_array_equal(tensor.numpy(), values.reshape(3, 4).T)


def test_read_only_export():
    buffer = HostBuffer(RNG.standard_normal(6), read_only=True)
    arr = np.from_dlpack(buffer)
    assert not arr.flags.writeable
    with import_array(buffer) as view:
        assert view.read_only
    with pytest.raises(BufferError, match="read-only"):
        buffer.__dlpack__()


def test_bfloat16_export_to_torch():
    values = torch.randn(3, 4, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    buffer = HostBuffer(values.view(torch.uint16).numpy())
    buffer.dtype = "bfloat16"
    tensor = torch.from_dlpack(buffer)
    assert tensor.dtype == torch.bfloat16 and tensor.data_ptr() == buffer.ptr
    assert torch.equal(tensor, values)


@pytest.mark.parametrize("versioned", [True, False])
def test_raw_capsules_to_torch(versioned):
    values = RNG.standard_normal(6)
    owner = HostBuffer(values)
    alive = weakref.ref(owner)
    capsule = export_capsule(data_ptr=owner.ptr, shape=(2, 3), strides=None, dtype="float64", device_type="cpu",
                             device_id=0, owner=owner, versioned=versioned)
    del owner
    tensor = torch.utils.dlpack.from_dlpack(capsule)
    np.testing.assert_array_equal(tensor.numpy(), values.reshape(2, 3))
    del capsule
    collect()
    assert alive() is not None
    del tensor
    collect()
    assert alive() is None


@pytest.mark.parametrize("versioned", [True, False])
def test_unconsumed_capsule_releases_its_owner(versioned):
    buffer = HostBuffer(RNG.standard_normal(4))
    owner = weakref.ref(buffer)
    capsule = buffer.__dlpack__(max_version=(1, 0) if versioned else None)
    assert f'"dltensor{"_versioned" if versioned else ""}"' in repr(capsule)
    del buffer
    collect()
    assert owner() is not None
    del capsule
    collect()
    assert owner() is None
    assert not dlpack.exported


def test_round_trip_through_our_own_reader():
    values = RNG.standard_normal((5, 4)).astype(np.float32)
    buffer = HostBuffer(values, shape=(2, 4), strides=(8, 1))
    with import_array(buffer) as view:
        assert (view.data_ptr, view.shape, view.strides) == (buffer.ptr, (2, 4), (8, 1))
        assert_same_elements_as_numpy(view, values[::2])
        assert view.source is buffer


@pytest.mark.parametrize("dtype", sorted(DTYPES.values()))
def test_every_dtype_round_trips(dtype):
    (code, bits), = [key for key, name in DTYPES.items() if name == dtype]
    buffer = HostBuffer(RNG.integers(0, 255, 16, dtype=np.uint8))
    buffer.dtype, buffer.shape = dtype, (16 * 8 // bits,)
    with import_array(buffer) as view:
        assert (view.dtype, view.itemsize, view.shape) == (dtype, bits // 8, buffer.shape)


def test_dlpack_device():
    assert HostBuffer(np.zeros(1)).__dlpack_device__() == (1, 0)
    assert HostBuffer(np.zeros(1), device=("cuda", 3)).__dlpack_device__() == (2, 3)


@pytest.mark.parametrize("kwargs, message", [
    (dict(copy=True), "copy=True"),
    (dict(dl_device=(2, 0)), "without a copy"),
    (dict(dl_device=(1, 1)), "without a copy"),
    (dict(stream=5), "stream must be None"),
])
def test_exporter_refusals(kwargs, message):
    with pytest.raises(BufferError, match=message):
        HostBuffer(np.zeros(2)).__dlpack__(max_version=(1, 0), **kwargs)


def test_exporter_accepts_what_needs_no_copy():
    buffer = HostBuffer(RNG.standard_normal(3))
    for kwargs in (dict(copy=False), dict(dl_device=(1, 0)), dict(stream=-1), dict(stream=None)):
        with import_array(CapsuleHolder(buffer.__dlpack__(max_version=(1, 0), **kwargs))) as view:
            assert view.data_ptr == buffer.ptr
    assert buffer.consumer_streams == []


@pytest.mark.parametrize("device, stream, hook_calls", [
    ("cuda", None, [1]),
    ("cuda", 1, [1]),
    ("cuda", 2, [2]),
    ("cuda", 0xFACE0, [0xFACE0]),
    ("cuda", -1, []),
    ("rocm", None, [0]),
    ("rocm", 0, [0]),
    ("rocm", 0xFACE0, [0xFACE0]),
    ("rocm", -1, []),
])
def test_consumer_stream_reaches_the_hook(device, stream, hook_calls):
    # Device memory is never touched: a capsule only carries the address.
    buffer = HostBuffer(np.zeros(4, np.float32), device=(device, 0))
    capsule = buffer.__dlpack__(stream=stream, max_version=(1, 0))
    assert buffer.consumer_streams == hook_calls
    with import_array(CapsuleHolder(capsule, buffer.__dlpack_device__())) as view:
        assert view.device_type == device


@pytest.mark.parametrize("device, stream", [("cuda", 0), ("cuda", -2), ("rocm", 1), ("rocm", 2), ("cuda", "1")])
def test_invalid_consumer_streams(device, stream):
    buffer = HostBuffer(np.zeros(4, np.float32), device=(device, 0))
    with pytest.raises(BufferError, match="not a DLPack stream value"):
        buffer.__dlpack__(stream=stream, max_version=(1, 0))
    assert buffer.consumer_streams == []


def test_import_orders_our_stream_before_reading():
    buffer = HostBuffer(np.zeros(4, np.float32), device=("cuda", 1))
    with import_array(buffer, stream=0) as view:
        assert (view.device_type, view.device_id, view.data_ptr) == ("cuda", 1, buffer.ptr)
    with import_array(buffer, stream=0x5000):
        pass
    assert buffer.consumer_streams == [1, 0x5000]


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(dtype="float128"), FmhaTypeError, "float128"),
    (dict(device_type="tpu"), FmhaValueError, "tpu"),
    (dict(strides=(1,)), FmhaValueError, "do not match"),
    (dict(versioned=False, read_only=True), FmhaValueError, "read-only"),
])
def test_export_capsule_argument_errors(kwargs, error, message):
    args = dict(data_ptr=0x1000, shape=(2, 2), strides=None, dtype="float32", device_type="cpu", device_id=0,
                owner=None) | kwargs
    with pytest.raises(error, match=message):
        export_capsule(**args)
    assert not dlpack.exported


# ------------------------------------------------------------------------------------------------- threads

def test_many_threads_export_and_consume():
    threads, rounds = 8, 120
    owners = []
    start = threading.Barrier(threads)

    def work(seed):
        rng = np.random.default_rng(seed)
        start.wait()
        for i in range(rounds):
            values = rng.standard_normal((4, 8)).astype(np.float32)
            buffer = HostBuffer(values)
            owners.append(weakref.ref(buffer))
            way = (i + seed) % 5
            if way == 0:
                got = np.from_dlpack(buffer).copy()
            elif way == 1:
                got = torch.from_dlpack(buffer).numpy().copy()
            elif way == 2:
                with import_array(buffer) as view:
                    got = np.frombuffer(ctypes.string_at(view.data_ptr, view.nbytes_span), np.float32).reshape(4, 8)
            elif way == 3:
                buffer.__dlpack__(max_version=None if i % 2 else (1, 0))  # dropped unconsumed
                got = values
            else:
                with import_array(values) as view, import_array(torch.from_numpy(values)) as again:
                    assert view.data_ptr == again.data_ptr == values.ctypes.data
                got = values
            del buffer
            np.testing.assert_array_equal(got, values)

    with ThreadPoolExecutor(threads) as pool:
        for future in [pool.submit(work, seed) for seed in range(threads)]:
            future.result()
    collect()
    assert len(owners) == threads * rounds
    assert sum(owner() is not None for owner in owners) == 0
    assert not dlpack.exported


def test_many_threads_close_one_view():
    producer = HandMadeProducer(RNG.standard_normal(8))
    view = import_array(producer)
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda _: view.close(), range(64)))
    assert producer.deleter_calls == 1

