"""User arrays in, arrays out: import by DLPack with checks that name the argument, and allocate
outputs as the same kind of array as the inputs (torch in, torch out; cupy in, cupy out). Also what
the plan cache keys a call's arrays by (`signatures`): one C call where the shim can describe them
all (torch tensors, arrays with a CUDA Array Interface), else per array."""
from __future__ import annotations

import contextlib
import sys

from .runtime import backend, kernel_launch
from .runtime.buffers import DeviceBuffer
from .cuda_array_interface import import_interface, offers_only_the_interface
from .runtime.dlpack import StridedSpan, import_array
from .errors import FmhaTypeError, FmhaValueError
from .runtime.packing import Pointer

GPU_DEVICE_TYPES = ("cuda", "rocm")
ATTN_DTYPES = {"float16": "fp16", "bfloat16": "bf16"}


class TorchView(StridedSpan):
    """What the runtime needs of a torch tensor, read from its attributes: a DLPack round trip costs
    ~30 µs per array, this ~2 µs. Ordering is the caller's: the tensor is used on the call's stream
    as it is (DLPack would make torch's current stream wait; torch's default stream and the legacy
    default stream fmha_rt uses without `stream=` are ordered anyway)."""

    __slots__ = ("data_ptr", "shape", "strides", "dtype", "itemsize", "device_type", "device_id", "read_only")

    def __init__(self, t):
        self.data_ptr = t.data_ptr()
        self.shape, self.strides = tuple(t.shape), tuple(t.stride())
        self.dtype = str(t.dtype).rpartition(".")[2]
        self.itemsize = t.element_size()
        device = t.device
        hip = device.type == "cuda" and getattr(sys.modules["torch"].version, "hip", None)
        self.device_type = "rocm" if hip else device.type
        self.device_id = device.index if device.index is not None else 0
        self.read_only = False


TORCH_TENSOR_TYPES: tuple = ()


def _torch_tensor_types() -> tuple:
    """torch.Tensor and Parameter once torch is imported (this module never imports it)."""
    global TORCH_TENSOR_TYPES
    if not TORCH_TENSOR_TYPES and (torch := sys.modules.get("torch")) is not None and hasattr(torch, "nn"):
        TORCH_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)
    return TORCH_TENSOR_TYPES


def cupy_array_type():
    """cupy.ndarray once cupy is imported (this module never imports it), else None: the describer reads
    its arrays' attributes instead of their CUDA Array Interface."""
    cupy = sys.modules.get("cupy")
    return getattr(cupy, "ndarray", None) if cupy is not None else None


def is_plain_torch_tensor(obj) -> bool:
    """Whether `obj` is a torch.Tensor or Parameter (no subclass) that is strided and holds its values as
    stored (not a lazy conjugate or negation): one whose attributes describe it fully."""
    torch = sys.modules.get("torch")
    return (torch is not None and type(obj) in (torch.Tensor, torch.nn.Parameter) and obj.layout == torch.strided
            and not obj.is_conj() and not obj.is_neg())


class Arg:
    """One imported array: its view (DLPack's, a torch tensor's own attributes, or the CUDA Array
    Interface's for an object that offers nothing else) and the pointer the kernels get."""

    __slots__ = ("name", "view", "pointer", "source", "_span")

    def __init__(self, name: str, obj, stream: int):
        self.name, self.source, self._span = name, obj, None
        if is_plain_torch_tensor(obj):
            self.view = TorchView(obj)
        elif offers_only_the_interface(obj):
            self.view = import_interface(obj, stream=stream, name=name)
        elif (device := _gpu_device_of(obj)) is not None:
            # frameworks export only from their current device: make the array's device current
            with backend.device_scope(device):
                self.view = import_array(obj, stream=stream, name=name)
        else:
            self.view = import_array(obj, stream=stream, name=name)
        self.pointer = Pointer(self.view.data_ptr)

    @property
    def shape(self):
        return self.view.shape

    @property
    def strides(self):
        return self.view.strides

    @property
    def dtype(self):
        return self.view.dtype

    @property
    def device(self):
        return self.view.device_id

    def span(self):
        """[first, last) byte this array touches, computed once (overlap checks ask many times)."""
        if self._span is None:
            start = self.view.span_start
            self._span = (start, start + self.view.nbytes_span)
        return self._span


_DLPACK_CUDA, _DLPACK_ROCM = 2, 10
_GPU_DLPACK_DEVICES = (_DLPACK_CUDA, _DLPACK_ROCM)


def _gpu_device_of(obj):
    """The GPU ordinal a DLPack producer says it lives on, or None (host arrays, non-producers)."""
    try:
        device_type, device_id = obj.__dlpack_device__()
    except Exception:  # import_array reports non-producers precisely
        return None
    return int(device_id) if int(device_type) in _GPU_DLPACK_DEVICES else None


def make_describer(ops, tensor_types=(), cupy_type=None):
    """The shim's describe(objects, addresses, capacity, stream) builtin (describe.c) making its driver
    calls through `ops` (an fmha_replay_ops pointer): torch tensors of `tensor_types` (torch.Tensor and
    Parameter, or none) through their DLPack C exchange API when the first type has one, arrays of
    `cupy_type` (cupy.ndarray, or None) from their attributes, everything else through its CUDA Array
    Interface."""
    namespace = {}
    first, second = (*(id(t) for t in tensor_types), 0, 0)[:2]
    cupy_device_type = _DLPACK_ROCM if backend.runtime().backend == "hip" else _DLPACK_CUDA
    status = backend.lib.fmha_describer_init(backend.ffi.new("fmha_describer *"), ops, first, second,
                                             id(cupy_type) if cupy_type is not None else 0, cupy_device_type,
                                             id(namespace))
    backend.check(status, "fmha_describer_init")
    return namespace["describe"]


# (the driver calls it makes, the CuPy array type it knows, the describer): made again when those calls
# change (a stand-in driver swaps them), when cupy is imported after it was made, or torch (it knows
# their types from then on).
DESCRIBER: tuple = (None, None, None)


def _describer():
    global DESCRIBER
    ops, cupy_type = kernel_launch.REPLAY_OPS, cupy_array_type()
    DESCRIBER = (ops, cupy_type, make_describer(ops, _torch_tensor_types(), cupy_type))
    return DESCRIBER[2]


def signatures(objects: tuple, names: tuple, stream: int, values, values_address: int):
    """What the plan cache keys a call's arrays by: (description, imported) for `objects` (arrays or None,
    named by `names`) used on the stream handle `stream`. `values` (a uint64 array at `values_address`)
    gets every array's data address at its position (0 for None) and zeros after them. A description
    holds everything of the arrays that the checks and the plan read (their kind, shape, strides, dtype
    and device), never an address. When every array is a plain torch tensor, a CuPy array, an array
    with a CUDA Array Interface (version 3) or None, the shim describes them all in one call
    (describe.c), as one bytes object, and orders `stream` after the interfaces' producer streams.
    Otherwise it is a tuple: a torch tensor is described from its attributes (~0.5 µs) and anything
    else is imported as gpu_array would import it (DLPack, which asks the producer to order its work
    before `stream`), and `imported` keeps that Arg by name so that a call which goes on to validate
    need not import it twice. Raises whatever an import raises."""
    ops, cupy_type, describe = DESCRIBER
    if ops is not kernel_launch.REPLAY_OPS or (cupy_type is None and "cupy" in sys.modules):
        describe = _describer()
    description = describe(objects, values_address, len(values), stream)
    if description is not None:
        return description, _NOTHING_IMPORTED
    if not TORCH_TENSOR_TYPES and _torch_tensor_types():  # torch came after the describer was made
        _describer()
        return signatures(objects, names, stream, values, values_address)
    return _per_array(objects, names, stream, values)


def _per_array(objects: tuple, names: tuple, stream: int, values):
    """signatures' tuple: one description per array, from torch's attributes or a DLPack import."""
    torch_types = TORCH_TENSOR_TYPES
    descriptions, imported = [], {}
    for i, (name, obj) in enumerate(zip(names, objects)):
        if obj is None:
            descriptions.append(None)
            values[i] = 0
        elif type(obj) in torch_types and not obj.is_neg():  # stride() raises for non-strided layouts
            descriptions.append((obj.shape, obj.stride(), obj.dtype, obj.device))  # a Parameter keys as a Tensor
            values[i] = obj.data_ptr()
        else:
            arg = imported[name] = Arg(name, obj, stream)
            v = arg.view
            descriptions.append((type(obj), v.shape, v.strides, v.dtype, v.device_type, v.device_id, v.read_only))
            values[i] = v.data_ptr
    values[len(objects):len(values)] = [0] * (len(values) - len(objects))
    return tuple(descriptions), imported


_NOTHING_IMPORTED: dict = {}  # what a call described by the shim imported: never written to


def gpu_array(name: str, obj, stream: int, *, rank=None, dtypes=None, writable=False, arg=None) -> Arg:
    """Import `obj` and check it is a GPU array of the given rank and dtypes, last dim contiguous.
    `arg`: `obj` imported already (by `signature`)."""
    if obj is None:
        raise FmhaTypeError(f"{name} is required, got None")
    arg = arg if arg is not None else Arg(name, obj, stream)
    view = arg.view
    if view.device_type not in GPU_DEVICE_TYPES:
        raise FmhaValueError(f"{name} is on the {view.device_type} device; fmha_rt needs GPU arrays (cuda or rocm)")
    if rank is not None and len(view.shape) not in ((rank,) if isinstance(rank, int) else rank):
        raise FmhaValueError(f"{name} must have rank {rank}, got shape {tuple(view.shape)}")
    if dtypes is not None and view.dtype not in dtypes:
        raise FmhaTypeError(f"{name} has dtype {view.dtype}; allowed: {', '.join(dtypes)}")
    if view.shape and view.strides[-1] != 1 and view.shape[-1] > 1:
        raise FmhaValueError(f"{name} must be contiguous in its last dim, got strides {tuple(view.strides)}")
    if any(s < 0 for s in view.strides):
        raise FmhaValueError(f"{name} has negative strides {tuple(view.strides)}; fmha_rt needs non-negative strides")
    if writable and view.read_only:
        raise FmhaValueError(f"{name} is read-only; outputs must be writable")
    if writable and _overlaps_itself(view.shape, view.strides):
        raise FmhaValueError(f"{name} has strides {tuple(view.strides)} under which elements share memory; "
                             "outputs need one location per element")
    return arg


def _overlaps_itself(shape, strides) -> bool:
    """Whether two elements may share an address: dims taken from the smallest stride up, each stride
    must reach past everything the smaller dims span (conservative for exotic interleavings)."""
    extent = 1
    for size, stride in sorted(((n, abs(s)) for n, s in zip(shape, strides) if n > 1), key=lambda d: d[1]):
        if stride < extent:
            return True
        extent = stride * size
    return False


def check_overlap(outputs, inputs) -> None:
    """Refuse an output whose bytes overlap an input's or another output's: the kernels read inputs
    while writing outputs, so any overlap gives wrong results."""
    check_spans([(a.name, *a.span()) for a in outputs if a is not None],
                [(a.name, *a.span()) for a in inputs if a is not None])


def overlap_pairs(outputs, inputs) -> list:
    """The pairs check_spans compares, in its order: (output, other) for every output that spans bytes
    and every input, then every later output (each an item of `outputs` or `inputs`)."""
    pairs = []
    for i, output in enumerate(outputs):
        if output[2] > output[1]:
            pairs += [(output, other) for other in (*inputs, *outputs[i + 1:])]
    return pairs


def check_spans(outputs, inputs) -> None:
    """check_overlap on (name, first byte, end byte) triples."""
    for (name, lo, hi), (other, olo, ohi) in overlap_pairs(outputs, inputs):
        if olo < hi and lo < ohi:
            raise overlap_error(name, other)


def overlap_error(output: str, other: str) -> FmhaValueError:
    return FmhaValueError(f"output {output} overlaps {other} in memory; give outputs their own buffers")


def check_shape(arg: Arg, expected, what: str = "") -> None:
    if arg is not None and tuple(arg.shape) != tuple(expected):
        raise FmhaValueError(f"{arg.name} must have shape {tuple(expected)}{what}, got {tuple(arg.shape)}")


def framework(obj) -> str:
    """The kind of array outputs are allocated as for a call whose q is `obj`."""
    module = type(obj).__module__.split(".")[0]
    return module if module in ("torch", "cupy", "jax", "jaxlib") else "buffer"


def allocate(kind: str, template, shape, dtype: str, device: int, stream: int, pitch: int | None = None):
    """A new GPU array of `shape`/`dtype` on `device`, of `kind` (framework(template), the caller's
    array), for kernels on `stream`. `pitch` pads each row of the last dim to that many elements (the
    array is then a view of the first shape[-1] of them). Returns (array for the caller, its data address).

    torch and CuPy hand freed memory to later allocations on the stream it was allocated on, without
    waiting for other streams. When the call's stream is not the framework's current one, the array is
    tied to the call's stream too (torch: record_stream; CuPy: allocated with it current), so that its
    memory is reused only after the call's kernels: an lse dropped at once (return_lse=False) or an
    output the caller frees early would otherwise be handed out while the kernels still write it."""
    stored = tuple(shape) if pitch is None else tuple(shape[:-1]) + (pitch,)
    if kind == "torch":
        torch = sys.modules["torch"]
        array = torch.empty(stored, dtype=getattr(torch, dtype), device=template.device)
        # `device` is the array's ordinal: no torch.device objects built on this per-call path
        if array.is_cuda and stream != _torch_current_stream(torch, device):
            array.record_stream(_framework_stream(torch, "torch", stream, device))
        if pitch is not None:
            array = array[..., :shape[-1]]
        return array, array.data_ptr()
    if kind == "cupy":
        cupy = sys.modules["cupy"]
        with cupy.cuda.Device(device):
            other = stream != cupy.cuda.get_current_stream().ptr
            with _framework_stream(cupy, "cupy", stream, device) if other else contextlib.nullcontext():
                array = cupy.empty(stored, dtype=dtype)[..., :shape[-1]]
        return array, array.data.ptr
    # JAX arrays are immutable and anything else has no allocator we know: our own buffer
    array = DeviceBuffer(device, shape, dtype, stream, pitch=pitch)
    return array, array.ptr


def _torch_current_stream(torch, index: int) -> int:
    """The handle of torch's current stream on device `index` (torch's C getter where it has one: the
    public one builds a Stream object, a few microseconds on every allocation)."""
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    return raw(index) if raw is not None else torch.cuda.current_stream(index).cuda_stream


framework_streams: dict = {}
MAX_FRAMEWORK_STREAMS = 256  # a process cycling through new streams starts over rather than grow


def _framework_stream(module, kind: str, handle: int, device: int):
    """The framework's stream object for a raw handle (kept, so that each handle is wrapped once)."""
    key = (kind, device, handle)
    wrapped = framework_streams.get(key)
    if wrapped is None:
        if len(framework_streams) >= MAX_FRAMEWORK_STREAMS:
            framework_streams.clear()
        if kind == "torch":
            wrapped = (module.cuda.default_stream(device) if handle == 0
                       else module.cuda.ExternalStream(handle, device=device))
        else:
            wrapped = module.cuda.ExternalStream(handle, device)
        wrapped = framework_streams.setdefault(key, wrapped)
    return wrapped


def allocate_like(template, shape, dtype: str, device: int, stream: int, pitch: int | None = None):
    """allocate() of the kind of `template`; returns (array for the caller, Arg for the kernels)."""
    array, _ = allocate(framework(template), template, shape, dtype, device, stream, pitch)
    return array, Arg("output", array, stream)


class AddressArg:
    """Memory known by its address alone: a raw workspace address from the callback (nbytes 0: its size
    is the caller's promise), or a buffer we allocated (no DLPack round trip needed to describe it)."""

    def __init__(self, name: str, address: int, nbytes: int = 0):
        self.name, self.pointer, self.nbytes = name, Pointer(address), nbytes

    def span(self):
        return (self.pointer.address, self.pointer.address + self.nbytes)


def acquire_workspace(device: int, stream: int, nbytes: int, zero_init: bool, workspace_alloc):
    """The workspace of one backward, from the caller's workspace_alloc(nbytes, zero_init) or our own
    allocator, checked to be big enough and on the call's device. Returns (the object to keep alive
    until the launches are queued, its Arg), or (None, None) when nothing is needed."""
    if nbytes == 0:
        return None, None
    if workspace_alloc is None:
        buf = DeviceBuffer(device, (nbytes,), "uint8", stream)
        return buf, AddressArg("workspace", buf.ptr, buf.nbytes)
    try:
        got = workspace_alloc(nbytes, zero_init)
    except Exception as exc:
        raise FmhaValueError(f"workspace_alloc({nbytes}, {zero_init}) raised {type(exc).__name__}: {exc}") from exc
    if isinstance(got, Pointer):
        return got, AddressArg("workspace", got.address)
    arg = gpu_array("workspace", got, stream, writable=True)
    if arg.view.nbytes_span < nbytes:
        raise FmhaValueError(f"workspace_alloc returned {arg.view.nbytes_span} bytes, {nbytes} are needed")
    if arg.device != device:
        raise FmhaValueError(f"workspace is on GPU {arg.device}, the call runs on GPU {device}")
    return got, arg


JAX_KINDS = ("jax", "jaxlib")  # framework() kinds whose outputs finish_outputs converts


def finish_outputs(template, arrays, stream: int):
    """Hand outputs back: our own buffers become the caller's array kind where that kind is JAX."""
    if framework(template) not in JAX_KINDS:
        return arrays
    import jax.dlpack

    backend.synchronize(template_device(template), stream)  # JAX reads on its own stream
    return tuple(jax.dlpack.from_dlpack(a) if isinstance(a, DeviceBuffer) else a for a in arrays)


def template_device(obj) -> int:
    return obj.__dlpack_device__()[1]
