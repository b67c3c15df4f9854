"""Turn the stream objects users already hold into the raw handle the driver launches on.

Accepted, for either backend unless noted:

- ``None``: the default stream, handle 0;
- an ``int``: a raw handle (``cudaStream_t`` / ``CUstream`` / ``hipStream_t`` as an integer);
- an object with ``__cuda_stream__()`` (CUDA stream protocol, returns ``(0, handle)``), CUDA only;
- an object with ``__hip_stream__()`` returning ``(0, handle)`` the same way, HIP only;
- a torch stream (``.cuda_stream``; torch calls HIP streams that too) or a CuPy stream (``.ptr``);
- a hip-python ``ihipStream_t`` (its ``int()`` is the handle), HIP only.

Frameworks are recognised by their attributes, so importing this module never imports torch or cupy.
"""

from ..errors import FmhaTypeError, FmhaValueError

BACKENDS = ("cuda", "hip")

ACCEPTED = (
    "None (default stream), an int handle >= 0, an object with __cuda_stream__() (backend 'cuda') or "
    "__hip_stream__() (backend 'hip'), a torch stream (.cuda_stream), a CuPy stream (.ptr), "
    "or a hip-python ihipStream_t (backend 'hip')"
)

_MAX_HANDLE = 2**64 - 1


def stream_handle(stream, *, backend="cuda"):
    """Return the raw stream handle (an int, 0 for the default stream) that `stream` stands for."""
    if backend not in BACKENDS:
        raise FmhaValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if stream is None:
        return 0
    if isinstance(stream, bool):
        raise FmhaTypeError(f"stream must be {ACCEPTED}; got a bool ({stream!r})")
    if isinstance(stream, int):
        return _checked_handle(stream, stream)
    protocol = "__cuda_stream__" if backend == "cuda" else "__hip_stream__"
    if hasattr(stream, protocol):
        return _protocol_handle(stream, protocol)
    if hasattr(stream, "cuda_stream"):
        return _checked_handle(stream.cuda_stream, stream)
    # A CuPy MemoryPointer also has .ptr; only a stream can also be synchronized.
    if hasattr(stream, "ptr") and callable(getattr(stream, "synchronize", None)):
        return _checked_handle(stream.ptr, stream)
    if backend == "hip" and _is_hip_python_stream(stream):
        return _checked_handle(int(stream), stream)
    raise FmhaTypeError(f"stream must be {ACCEPTED} for backend {backend!r}; got {type(stream).__qualname__}")


def dlpack_stream_arg(handle, device_type):
    """The ``stream=`` value to give a producer's ``__dlpack__`` for a kernel launched on `handle`.

    `device_type` is the DLPack device name of the array ('cuda', 'rocm', 'cpu', ...). Only CUDA and ROCm
    arrays take a stream. DLPack forbids 0 for CUDA (it would be ambiguous) and spells the legacy default
    stream 1, which is also the driver's own handle for it (CU_STREAM_LEGACY); on ROCm 0 is the default
    stream and 1 and 2 are not allowed.
    """
    if device_type == "cuda":
        return 1 if handle == 0 else handle
    if device_type == "rocm":
        if handle in (1, 2):
            raise FmhaValueError(f"stream handle {handle} has no DLPack spelling for ROCm arrays")
        return handle
    return None


def _protocol_handle(stream, protocol):
    answer = getattr(stream, protocol)()
    if not (isinstance(answer, tuple) and len(answer) == 2):
        raise FmhaTypeError(f"{type(stream).__qualname__}.{protocol}() must return (version, handle), got {answer!r}")
    version, handle = answer
    if version != 0:
        raise FmhaValueError(f"{type(stream).__qualname__}.{protocol}() speaks version {version!r}; only 0 is known")
    return _checked_handle(handle, stream)


# Where hip-python defines its stream type: ``hip.hip`` in 6.x; in 10.x the bindings live in
# ``rocm.bindings.hip`` and ``from hip import hip`` re-exports that module.
HIP_PYTHON_STREAM_MODULES = ("hip.hip", "rocm.bindings.hip")


def _is_hip_python_stream(stream):
    cls = type(stream)
    return cls.__name__ == "ihipStream_t" and cls.__module__ in HIP_PYTHON_STREAM_MODULES


def _checked_handle(handle, stream):
    if isinstance(handle, bool) or not isinstance(handle, int):
        raise FmhaTypeError(f"stream handle from {type(stream).__qualname__} must be an int, got {handle!r}")
    if not 0 <= handle <= _MAX_HANDLE:
        raise FmhaValueError(f"stream handle must be in [0, 2**64), got {handle} from {type(stream).__qualname__}")
    return handle
