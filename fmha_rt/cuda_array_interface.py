"""Arrays that offer only the CUDA Array Interface (version 3, `__cuda_array_interface__`): read as a
view the runtime uses like a DLPack import. The interface says nothing of the device, so the driver is
asked where the data pointer lives; its `stream` entry is the producer's stream, which the call's
stream is made to wait for (an event, no host synchronization), as the shim's describer does for the
cached path (describe.c)."""
from __future__ import annotations

from .runtime import backend, kernel_launch
from .runtime.dlpack import DEVICE_TYPES, StridedSpan, contiguous_strides
from .errors import FmhaTypeError, FmhaValueError

# typestr (byte order, kind, bytes) -> dtype name. An opaque two-byte "V2" (how bfloat16 arrays spell
# themselves) cannot be told from any other two-byte type, so it is refused with a pointer to DLPack.
TYPESTRS = {"f2": "float16", "f4": "float32", "f8": "float64", "i1": "int8", "i2": "int16", "i4": "int32",
            "i8": "int64", "u1": "uint8", "u2": "uint16", "u4": "uint32", "u8": "uint64", "b1": "bool"}
# hip-python describes a raw allocation (hipMalloc's DeviceArray, not yet configured) as "B", NumPy's
# character code for uint8, where the interface's own spelling is "|u1".
CHARACTER_CODES = {"B": "|u1"}
LEGACY_DEFAULT_STREAM = 1  # the interface's (and CUDA's) name for the legacy default stream


class InterfaceView(StridedSpan):
    """What the runtime needs of an interface array: the same fields as dlpack.ArrayView. It borrows
    the producer's memory with nothing to release (the interface has no deleter)."""

    __slots__ = ("source", "data_ptr", "shape", "strides", "dtype", "itemsize", "device_type", "device_id", "read_only")

    def __init__(self, **fields):
        for key, value in fields.items():
            setattr(self, key, value)

    def close(self):
        """Nothing to give back (the caller keeps the producer's object alive)."""


def offers_only_the_interface(obj) -> bool:
    """Whether `obj` has the interface and no DLPack. DLPack is asked first: reading the interface may
    run the producer's code (a property), which a DLPack producer's call must not."""
    return not hasattr(obj, "__dlpack__") and hasattr(obj, "__cuda_array_interface__")


def import_interface(obj, *, stream: int, name: str = "array") -> InterfaceView:
    """Read `obj.__cuda_array_interface__` (version 3) for use on the raw stream handle `stream`, ordering
    that stream after the producer's. Raises, naming `name`, for anything the runtime cannot use exactly."""
    interface = obj.__cuda_array_interface__
    if not isinstance(interface, dict) or interface.get("version") != 3:
        version = interface.get("version") if isinstance(interface, dict) else interface
        raise FmhaValueError(f"{name}: __cuda_array_interface__ version {version!r} is not supported (version 3 "
                             "only: earlier versions say nothing of the producer's stream)")
    if interface.get("mask") is not None:
        raise FmhaValueError(f"{name}: a masked __cuda_array_interface__ is not supported")
    if interface.get("offset", 0):  # not in the interface's spec; hip-python's arrays carry it
        raise FmhaValueError(f"{name}: a __cuda_array_interface__ with offset {interface['offset']!r} is not supported "
                             "(give the data pointer of the first element)")
    dtype, itemsize = _dtype(interface.get("typestr"), name)
    shape = tuple(int(n) for n in interface["shape"])
    strides = _element_strides(interface.get("strides"), shape, itemsize, name)
    ptr, read_only = interface["data"]
    if not ptr:
        raise FmhaValueError(f"{name}: its __cuda_array_interface__ has a NULL data pointer; the device of an "
                             "array without memory cannot be told")
    device_type, device = _locate(int(ptr), name)
    _order_after_producer(interface.get("stream"), device_type, device, stream, name)
    return InterfaceView(source=obj, data_ptr=int(ptr), shape=shape, strides=strides, dtype=dtype, itemsize=itemsize,
                         device_type=device_type, device_id=device, read_only=bool(read_only))


def _dtype(typestr, name):
    typestr = CHARACTER_CODES.get(typestr, typestr)
    if not isinstance(typestr, str) or len(typestr) < 3 or typestr[0] not in "<|=" or typestr[1:] not in TYPESTRS:
        raise FmhaTypeError(f"{name}: __cuda_array_interface__ typestr {typestr!r} is not supported; supported: "
                            f"{', '.join(sorted(TYPESTRS))} little-endian (bfloat16 arrays: pass them through DLPack)")
    return TYPESTRS[typestr[1:]], int(typestr[2:])


def _element_strides(byte_strides, shape, itemsize, name):
    if byte_strides is None:
        return contiguous_strides(shape)
    if len(byte_strides) != len(shape) or any(int(s) % itemsize for s in byte_strides):
        raise FmhaValueError(f"{name}: __cuda_array_interface__ strides {tuple(byte_strides)} (bytes) are not whole "
                             f"elements of {itemsize} bytes for shape {shape}")
    return tuple(int(s) // itemsize for s in byte_strides)


def _locate(ptr: int, name: str):
    """(DLPack device type name, ordinal) of the memory at `ptr`, from the driver."""
    ffi = backend.ffi
    device_type, device, memory_type = ffi.new("int *"), ffi.new("int *"), ffi.new("int *")
    if kernel_launch.REPLAY_OPS.pointer_location(ptr, device_type, device, memory_type) != backend.lib.FMHA_OK:
        rt = backend.runtime()
        why = "" if rt.devices else f" (the {rt.backend} driver, {rt.library}, sees no GPU device)"
        raise FmhaValueError(f"{name}: the driver knows no GPU memory at its __cuda_array_interface__ data pointer "
                             f"0x{ptr:x}{why}")
    return DEVICE_TYPES.get(device_type[0], str(device_type[0])), device[0]


def _order_after_producer(producer, device_type: str, device: int, stream: int, name: str):
    """Make the call's `stream` wait for the interface's `producer` stream (None: ready everywhere)."""
    if producer is None:
        return
    if isinstance(producer, bool) or not isinstance(producer, int) or producer == 0:
        raise FmhaValueError(f"{name}: __cuda_array_interface__ stream {producer!r} is not a stream (0 is invalid; "
                             "None means ready on every stream)")
    rocm = device_type == "rocm"
    producer_handle = 0 if rocm and producer == LEGACY_DEFAULT_STREAM else producer
    call_handle = LEGACY_DEFAULT_STREAM if not rocm and stream == 0 else stream  # the shim launches on 0
    if producer_handle != call_handle:
        backend.check(backend.lib.fmha_stream_order(kernel_launch.REPLAY_OPS, device, producer_handle, stream),
                      "fmha_stream_order", device=device)
