"""A Python function as an XLA FFI handler on the CPU platform (ctypes; no compiler needed).

jax.pure_callback cannot serve inside a custom_partitioning rule: its callback is kept by the module
being lowered, and the partitioner lowers each shard's computation as a module of its own, whose
callbacks nobody keeps. An FFI target lives in XLA's global registry instead. So a function
fn(operands, results) on NumPy views of the call's buffers is registered here as a target of its own:
XLA calls the ctypes trampoline, which takes the GIL, answers XLA's metadata query with the API version
of the installed jaxlib (the one the shim's handler was built against), and turns a Python exception
into an XLA error that names it.

Layouts follow xla/ffi/api/c_api.h (the structs below are its fields, in its order).
"""
from __future__ import annotations

import ctypes
import threading
import traceback

import jax
import numpy as np

from .runtime.backend import ffi, lib
from .replay.program import XLA_DTYPES

_NUMPY_DTYPES = {number: np.dtype(jax.numpy.dtype(name)) for name, number in XLA_DTYPES.items()}
_METADATA_EXTENSION = 1  # XLA_FFI_Extension_Metadata
_EXECUTE = 3  # XLA_FFI_ExecutionStage_EXECUTE
_INTERNAL = 13  # XLA_FFI_Error_Code_INTERNAL


class _ExtensionBase(ctypes.Structure):
    pass


_ExtensionBase._fields_ = [("struct_size", ctypes.c_size_t), ("type", ctypes.c_int),
                           ("next", ctypes.POINTER(_ExtensionBase))]


class _ApiVersion(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("extension_start", ctypes.c_void_p),
                ("major_version", ctypes.c_int), ("minor_version", ctypes.c_int)]


class _Metadata(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("api_version", _ApiVersion), ("traits", ctypes.c_uint32)]


class _MetadataExtension(ctypes.Structure):
    _fields_ = [("extension_base", _ExtensionBase), ("metadata", ctypes.POINTER(_Metadata))]


class _Buffer(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("extension_start", ctypes.c_void_p), ("dtype", ctypes.c_int),
                ("data", ctypes.c_void_p), ("rank", ctypes.c_int64), ("dims", ctypes.POINTER(ctypes.c_int64))]


class _Values(ctypes.Structure):  # XLA_FFI_Args and XLA_FFI_Rets
    _fields_ = [("struct_size", ctypes.c_size_t), ("extension_start", ctypes.c_void_p), ("size", ctypes.c_int64),
                ("types", ctypes.c_void_p), ("values", ctypes.POINTER(ctypes.POINTER(_Buffer)))]


class _Attrs(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("extension_start", ctypes.c_void_p), ("size", ctypes.c_int64),
                ("types", ctypes.c_void_p), ("names", ctypes.c_void_p), ("attrs", ctypes.c_void_p)]


class _CallFrame(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("extension_start", ctypes.POINTER(_ExtensionBase)),
                ("api", ctypes.c_void_p), ("ctx", ctypes.c_void_p), ("stage", ctypes.c_int), ("args", _Values),
                ("rets", _Values), ("attrs", _Attrs), ("future", ctypes.c_void_p)]


class _ErrorCreateArgs(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("extension_start", ctypes.c_void_p), ("message", ctypes.c_char_p),
                ("errc", ctypes.c_int)]


_ErrorCreate = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.POINTER(_ErrorCreateArgs))


class _Api(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("extension_start", ctypes.c_void_p), ("api_version", _ApiVersion),
                ("internal_api", ctypes.c_void_p), ("error_create", _ErrorCreate)]


_Handler = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.POINTER(_CallFrame))
_lock = threading.Lock()
_handlers: dict[str, _Handler] = {}  # kept alive for the process: XLA holds their addresses


def _api_version() -> tuple[int, int]:
    major, minor = ffi.new("int *"), ffi.new("int *")
    lib.fmha_xla_ffi_api_version(major, minor)
    return major[0], minor[0]


def _answer_metadata(frame) -> bool:
    ext = frame.extension_start
    while ext:
        if ext.contents.type == _METADATA_EXTENSION:
            metadata = ctypes.cast(ext, ctypes.POINTER(_MetadataExtension)).contents.metadata.contents
            metadata.api_version.major_version, metadata.api_version.minor_version = _api_version()
            metadata.traits = 0
            return True
        ext = ext.contents.next
    return False


def _arrays(values: _Values) -> list[np.ndarray]:
    """NumPy views (no copies) of a call's buffers."""
    arrays = []
    for i in range(values.size):
        b = values.values[i].contents
        dtype, shape = _NUMPY_DTYPES[b.dtype], tuple(b.dims[d] for d in range(b.rank))
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        raw = (ctypes.c_char * nbytes).from_address(b.data) if nbytes else bytearray()
        arrays.append(np.frombuffer(raw, dtype=dtype).reshape(shape))
    return arrays


def _error(frame, message: str) -> int:
    api = ctypes.cast(frame.api, ctypes.POINTER(_Api)).contents
    args = _ErrorCreateArgs(ctypes.sizeof(_ErrorCreateArgs), None, message.encode(errors="replace"), _INTERNAL)
    return api.error_create(ctypes.byref(args))


def register(target: str, fn) -> None:
    """Make `target` an FFI target of jax's CPU platform running fn(operands, results) on NumPy views of
    the call's buffers; fn writes every element of each result. Idempotent per target name."""
    def handler(frame_pointer):
        frame = frame_pointer.contents
        if _answer_metadata(frame) or frame.stage != _EXECUTE:
            return None
        try:
            fn(_arrays(frame.args), _arrays(frame.rets))
        except Exception as exc:  # any failure becomes the call's error, with its traceback
            return _error(frame, f"{target}: {''.join(traceback.format_exception(exc))}")
        return None

    with _lock:
        if target in _handlers:
            return
        _handlers[target] = _Handler(handler)
        address = ctypes.cast(_handlers[target], ctypes.c_void_p).value
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(address), platform="cpu")
