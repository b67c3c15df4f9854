"""Arrays in and out through DLPack, with no framework imported.

`import_array` borrows any ``__dlpack__`` producer's memory as an `ArrayView`; `export_capsule` and the
`DLPackExporter` mixin hand our buffers to any consumer (torch, NumPy, CuPy, JAX). The C structs follow the
DLPack 1.x header; both the versioned and the legacy capsule are spoken.
"""

import ctypes
import threading
import weakref
from ctypes import POINTER, c_char_p, c_int, c_int32, c_int64, c_uint8, c_uint16, c_uint32, c_uint64, c_void_p

from ..errors import FmhaTypeError, FmhaValueError
from .streams import dlpack_stream_arg

# Major 1 is the ABI; minor 1 added the float8 type codes listed below.
DLPACK_VERSION = (1, 1)

READ_ONLY = 1
IS_COPIED = 2

DEVICE_TYPES = {
    1: "cpu", 2: "cuda", 3: "cuda_host", 4: "opencl", 7: "vulkan", 8: "metal", 9: "vpi", 10: "rocm",
    11: "rocm_host", 12: "ext_dev", 13: "cuda_managed", 14: "oneapi", 15: "webgpu", 16: "hexagon", 17: "maia",
}
_DEVICE_CODES = {name: code for code, name in DEVICE_TYPES.items()}

# (type code, bits) -> name; lanes must be 1.
DTYPES = {
    (0, 8): "int8", (0, 16): "int16", (0, 32): "int32", (0, 64): "int64",
    (1, 8): "uint8", (1, 16): "uint16", (1, 32): "uint32", (1, 64): "uint64",
    (2, 16): "float16", (2, 32): "float32", (2, 64): "float64",
    (4, 16): "bfloat16",
    (5, 64): "complex64", (5, 128): "complex128",
    (6, 8): "bool",
    (10, 8): "float8_e4m3fn", (11, 8): "float8_e4m3fnuz", (12, 8): "float8_e5m2", (13, 8): "float8_e5m2fnuz",
}
_DTYPE_CODES = {name: key for key, name in DTYPES.items()}


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", c_int32), ("device_id", c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", c_uint8), ("bits", c_uint8), ("lanes", c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", c_void_p),
        ("device", DLDevice),
        ("ndim", c_int32),
        ("dtype", DLDataType),
        ("shape", POINTER(c_int64)),
        ("strides", POINTER(c_int64)),
        ("byte_offset", c_uint64),
    ]


# The deleters are C function pointers `void (*)(self*)`; held as plain addresses so that reading a
# producer's deleter and storing our own take no ctypes wrapper objects.
class DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", DLTensor), ("manager_ctx", c_void_p), ("deleter", c_void_p)]


class DLPackVersion(ctypes.Structure):
    _fields_ = [("major", c_uint32), ("minor", c_uint32)]


class DLManagedTensorVersioned(ctypes.Structure):
    _fields_ = [
        ("version", DLPackVersion),
        ("manager_ctx", c_void_p),
        ("deleter", c_void_p),
        ("flags", c_uint64),
        ("dl_tensor", DLTensor),
    ]


CapsuleDestructor = ctypes.CFUNCTYPE(None, c_void_p)
Deleter = ctypes.CFUNCTYPE(None, c_void_p)
# A producer's deleter is called with the GIL held, as a capsule destructor would call it: deleters that
# touch Python objects without taking the GIL themselves stay safe.
_ProducerDeleter = ctypes.PYFUNCTYPE(None, c_void_p)


def _capsule_api(name, restype, *argtypes):
    # A private prototype per use: setting argtypes on ctypes.pythonapi.<name> would change that function
    # for every other module in the process.
    return ctypes.PYFUNCTYPE(restype, *argtypes)((name, ctypes.pythonapi))


capsule_new = _capsule_api("PyCapsule_New", ctypes.py_object, c_void_p, c_char_p, CapsuleDestructor)
_capsule_is_valid = _capsule_api("PyCapsule_IsValid", c_int, ctypes.py_object, c_char_p)
_capsule_get_pointer = _capsule_api("PyCapsule_GetPointer", c_void_p, ctypes.py_object, c_char_p)
_capsule_set_name = _capsule_api("PyCapsule_SetName", c_int, ctypes.py_object, c_char_p)
# A capsule destructor runs when the reference count is already zero: handing the capsule to ctypes as an
# object would revive it, so the destructor sees it as a bare address.
dying_capsule_is_valid = _capsule_api("PyCapsule_IsValid", c_int, c_void_p, c_char_p)
dying_capsule_get_pointer = _capsule_api("PyCapsule_GetPointer", c_void_p, c_void_p, c_char_p)

# A capsule keeps a pointer to its name, not a copy: the names live as long as the module.
NAME_VERSIONED = c_char_p(b"dltensor_versioned")
NAME_LEGACY = c_char_p(b"dltensor")
_USED_VERSIONED = c_char_p(b"used_dltensor_versioned")
_USED_LEGACY = c_char_p(b"used_dltensor")


# ---------------------------------------------------------------------------------------------- consuming


class StridedSpan:
    """The bytes a strided array touches, from its data_ptr, shape, strides (elements) and itemsize:
    [span_start, span_start + nbytes_span), for aliasing checks."""

    __slots__ = ()

    @property
    def span_start(self):
        return self.data_ptr + sum(min(0, (n - 1) * s) for n, s in zip(self.shape, self.strides)) * self.itemsize

    @property
    def nbytes_span(self):
        if 0 in self.shape:
            return 0
        return (sum((n - 1) * abs(s) for n, s in zip(self.shape, self.strides)) + 1) * self.itemsize


class ArrayView(StridedSpan):
    """What the runtime needs of one producer's array; the producer's memory stays valid until `close()`.

    `data_ptr` already includes DLPack's byte_offset, `strides` count elements, and
    [`span_start`, `span_start + nbytes_span`) is every byte an element touches (for aliasing checks).
    Closing twice, or closing and then being collected, runs the producer's deleter once.
    """

    def __init__(self, *, source, data_ptr, shape, strides, dtype, itemsize, device_type, device_id, read_only,
                 release):
        self.source = source
        self.data_ptr = data_ptr
        self.shape = shape
        self.strides = strides
        self.dtype = dtype
        self.itemsize = itemsize
        self.device_type = device_type
        self.device_id = device_id
        self.read_only = read_only
        self._release = weakref.finalize(self, *release)

    @property
    def closed(self):
        return not self._release.alive

    def close(self):
        self._release()

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()

    def __repr__(self):
        return (f"ArrayView({self.dtype}{list(self.shape)}, strides={self.strides}, "
                f"{self.device_type}:{self.device_id}, data_ptr={self.data_ptr:#x}"
                f"{', read_only' if self.read_only else ''}{', closed' if self.closed else ''})")


def import_array(obj, *, stream=None, name="array"):
    """Borrow `obj`'s memory through its ``__dlpack__``.

    `stream` is the raw handle (see `streams.stream_handle`) the runtime will use the array on; a CUDA or
    ROCm producer is asked to make the data ready on it. None leaves the producer at the DLPack default
    (the legacy default stream). `name` is the argument's name in error messages.
    """
    if not hasattr(obj, "__dlpack__") or not hasattr(obj, "__dlpack_device__"):
        raise FmhaTypeError(f"{name} must support DLPack (__dlpack__ and __dlpack_device__) or the CUDA Array "
                            f"Interface (__cuda_array_interface__); got {type(obj).__qualname__}")
    device_code, _ = obj.__dlpack_device__()
    device_type = DEVICE_TYPES.get(int(device_code))
    dlpack_stream = None if stream is None else dlpack_stream_arg(stream, device_type)
    try:
        try:
            capsule = obj.__dlpack__(max_version=DLPACK_VERSION, stream=dlpack_stream)
        except TypeError:  # a producer from before DLPack 1.0 knows no max_version
            capsule = obj.__dlpack__(stream=dlpack_stream)
    except BufferError as exc:
        raise FmhaValueError(f"{name} ({type(obj).__qualname__}) refused DLPack export: {exc}") from exc
    return _consume(capsule, obj, name)


def _consume(capsule, source, name):
    if _capsule_is_valid(capsule, NAME_VERSIONED):
        versioned, used_name = True, _USED_VERSIONED
        managed = DLManagedTensorVersioned.from_address(_capsule_get_pointer(capsule, NAME_VERSIONED))
        if managed.version.major != DLPACK_VERSION[0]:
            raise FmhaValueError(f"{name}: DLPack version {managed.version.major}.{managed.version.minor} is not "
                                 f"supported (major {DLPACK_VERSION[0]} only)")
    elif _capsule_is_valid(capsule, NAME_LEGACY):
        versioned, used_name = False, _USED_LEGACY
        managed = DLManagedTensor.from_address(_capsule_get_pointer(capsule, NAME_LEGACY))
    else:
        raise FmhaValueError(f"{name}: __dlpack__ returned {capsule!r}, not an unused DLPack capsule")
    # Everything is read before the capsule is renamed: until then a failure leaves the tensor to the
    # capsule's own destructor.
    fields = _describe(managed.dl_tensor, name)
    read_only = versioned and bool(managed.flags & READ_ONLY)
    release = (_call_deleter, managed.deleter, ctypes.addressof(managed))
    _capsule_set_name(capsule, used_name)
    return ArrayView(source=source, read_only=read_only, release=release, **fields)


def _describe(tensor, name):
    dtype = DTYPES.get((tensor.dtype.code, tensor.dtype.bits))
    if dtype is None or tensor.dtype.lanes != 1:
        raise FmhaTypeError(f"{name}: DLPack dtype (code={tensor.dtype.code}, bits={tensor.dtype.bits}, "
                            f"lanes={tensor.dtype.lanes}) is not supported; supported: {sorted(_DTYPE_CODES)}")
    device_type = DEVICE_TYPES.get(tensor.device.device_type)
    if device_type is None:
        raise FmhaValueError(f"{name}: unknown DLPack device type {tensor.device.device_type}")
    if tensor.ndim < 0 or (tensor.ndim > 0 and not tensor.shape):
        raise FmhaValueError(f"{name}: malformed DLPack tensor (ndim={tensor.ndim}, shape={tensor.shape})")
    shape = tuple(tensor.shape[i] for i in range(tensor.ndim))
    # DLPack allows NULL strides for a C-contiguous tensor.
    strides = tuple(tensor.strides[i] for i in range(tensor.ndim)) if tensor.strides else contiguous_strides(shape)
    return dict(data_ptr=(tensor.data or 0) + tensor.byte_offset, shape=shape, strides=strides, dtype=dtype,
                itemsize=tensor.dtype.bits // 8, device_type=device_type, device_id=tensor.device.device_id)


def _call_deleter(deleter, managed_address):
    if deleter:
        _ProducerDeleter(deleter)(managed_address)


def contiguous_strides(shape):
    """Element strides of a C-contiguous array of `shape`."""
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


# ---------------------------------------------------------------------------------------------- producing

# Every tensor handed out, keyed by the address of its DLManagedTensor[Versioned]: the entry keeps the
# struct, its shape and strides arrays and the owner alive until the consumer's deleter runs.
exported = {}
_exported_lock = threading.Lock()


def _release_export(managed_address):
    with _exported_lock:
        entry = exported.pop(managed_address, None)
    # The owner is dropped here, outside the lock: its finalizer may export or release other arrays.
    del entry


_DELETER = Deleter(_release_export)
_DELETER_ADDRESS = ctypes.cast(_DELETER, c_void_p).value


@CapsuleDestructor
def _destroy_capsule(capsule_address):
    # A consumer renames the capsule when it takes the tensor; one that still has its first name was never
    # consumed, so its tensor is still ours to release.
    for capsule_name in (NAME_VERSIONED, NAME_LEGACY):
        if dying_capsule_is_valid(capsule_address, capsule_name):
            _release_export(dying_capsule_get_pointer(capsule_address, capsule_name))


def export_capsule(*, data_ptr, shape, strides, dtype, device_type, device_id, owner, versioned=True,
                   read_only=False):
    """A DLPack capsule for memory at `data_ptr`; `owner` is kept alive until the consumer releases it.

    `strides` count elements (None: C-contiguous); `dtype` and `device_type` are names as in `DTYPES` and
    `DEVICE_TYPES`. A legacy (unversioned) capsule cannot say read-only, so that combination is refused.
    """
    if dtype not in _DTYPE_CODES:
        raise FmhaTypeError(f"dtype {dtype!r} cannot be exported; supported: {sorted(_DTYPE_CODES)}")
    if device_type not in _DEVICE_CODES:
        raise FmhaValueError(f"device type {device_type!r} is not a DLPack device; known: {sorted(_DEVICE_CODES)}")
    shape = tuple(shape)
    strides = contiguous_strides(shape) if strides is None else tuple(strides)
    if len(strides) != len(shape):
        raise FmhaValueError(f"strides {strides} do not match shape {shape}")
    if read_only and not versioned:
        raise FmhaValueError("a legacy DLPack capsule cannot mark memory read-only")

    shape_array = (c_int64 * len(shape))(*shape)
    strides_array = (c_int64 * len(shape))(*strides)
    code, bits = _DTYPE_CODES[dtype]
    tensor = DLTensor(data=data_ptr, device=DLDevice(_DEVICE_CODES[device_type], device_id), ndim=len(shape),
                      dtype=DLDataType(code, bits, 1), shape=shape_array, strides=strides_array, byte_offset=0)
    if versioned:
        managed = DLManagedTensorVersioned(version=DLPackVersion(*DLPACK_VERSION), deleter=_DELETER_ADDRESS,
                                           flags=READ_ONLY if read_only else 0, dl_tensor=tensor)
    else:
        managed = DLManagedTensor(dl_tensor=tensor, deleter=_DELETER_ADDRESS)
    address = ctypes.addressof(managed)
    with _exported_lock:
        exported[address] = (managed, shape_array, strides_array, owner)
    return capsule_new(address, NAME_VERSIONED if versioned else NAME_LEGACY, _destroy_capsule)


class DLPackExporter:
    """Mixin giving a buffer class ``__dlpack__`` and ``__dlpack_device__``; the memory is never copied.

    The class provides ``ptr``, ``shape``, ``strides`` (elements; None: C-contiguous), ``dtype`` (a name in
    `DTYPES`) and ``device`` (a pair: a name in `DEVICE_TYPES`, the device ordinal), and may set ``read_only``.
    For CUDA and ROCm it may override `order_before_consumer`, called with the raw handle of the stream
    the consumer will read on, to make that stream wait for the work producing this buffer.
    """

    read_only = False

    def order_before_consumer(self, consumer_stream):
        """Nothing by default: the buffer is assumed ready on every stream."""

    def __dlpack_device__(self):
        device_type, device_id = self.device
        return _DEVICE_CODES[device_type], device_id

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        if copy:
            raise BufferError(f"{type(self).__qualname__} is exported without copying; copy=True is not supported")
        if dl_device is not None and tuple(dl_device) != self.__dlpack_device__():
            raise BufferError(f"{type(self).__qualname__} lives on {self.__dlpack_device__()}, "
                              f"cannot export to {tuple(dl_device)} without a copy")
        versioned = max_version is not None and max_version[0] >= 1
        if self.read_only and not versioned:
            raise BufferError("read-only memory needs a versioned (DLPack >= 1.0) consumer")
        consumer_stream = self._consumer_stream(stream)
        if consumer_stream is not None:
            self.order_before_consumer(consumer_stream)
        device_type, device_id = self.device
        return export_capsule(data_ptr=self.ptr, shape=self.shape, strides=self.strides, dtype=self.dtype,
                              device_type=device_type, device_id=device_id, owner=self, versioned=versioned,
                              read_only=self.read_only)

    def _consumer_stream(self, stream):
        """The raw handle of the consumer's stream per the DLPack stream rules, or None when there is no
        ordering to do (no streams on this device, or the consumer asked for none with -1)."""
        device_type = self.device[0]
        if device_type not in ("cuda", "rocm"):
            if stream not in (None, -1):
                raise BufferError(f"stream must be None for a {device_type} array, got {stream!r}")
            return None
        if stream == -1:
            return None
        if stream is None:
            return 1 if device_type == "cuda" else 0
        if not isinstance(stream, int) or stream < 0 or (device_type == "cuda" and stream == 0) or (
                device_type == "rocm" and stream in (1, 2)):
            raise BufferError(f"stream {stream!r} is not a DLPack stream value for a {device_type} array")
        return stream
