"""Host memory posing as GPU memory, so that the public API validates and plans on a machine without a GPU.

`FakeGpuArray` exports host memory through DLPack as a CUDA (or any other device's) array, and a GPU
one also through the CUDA Array Interface (version 3, as CuPy exports it). `StandInRuntime` describes
two sm_90 devices and serves the runtime's own allocations and memsets from host memory, and the
driver's pointer queries and events, so a call runs exactly as on a GPU machine up to the launch,
where the test puts its own executor.

The shim keeps fmha_rt's own workspaces per stream (workspaces.c), and the ones a stand-in allocated
are its host memory: they must be released while it is alive (tests/cpu/conftest.py does so after
every test; whoever uses a stand-in outside a test calls fmha_rt.release_workspaces()), and so must the
launch graphs of cached calls (the same call frees them), which are the stand-in's tokens: a graph's
launch runs its nodes' launches in order through the same path as launches one by one.
"""
import contextlib
import ctypes
import itertools
import math

from fmha_rt.runtime import backend, kernel_launch
from fmha_rt.runtime.backend import ffi
from fmha_rt.runtime.dlpack import DLPackExporter
from fmha_rt.errors import DriverError

ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8, "int8": 1, "int32": 4, "int64": 8, "uint8": 1}
# The interface's typestr of each dtype, as NumPy spells it; bfloat16 (ml_dtypes') is a two-byte void.
TYPESTR = {"float16": "<f2", "bfloat16": "<V2", "float32": "<f4", "float64": "<f8", "int8": "|i1", "int32": "<i4",
           "int64": "<i8", "uint8": "|u1"}
DLPACK_DEVICE_TYPES = {"cuda": 2, "rocm": 10}
MEMORY_TYPE_DEVICE = 2  # CU_MEMORYTYPE_DEVICE
# Where every fake GPU array's data pointer lives, (DLPack device type, ordinal): what the driver answers
# for a pointer. Each array enters its own pointer when it is made (a later array at a freed array's
# address replaces the entry).
LOCATIONS = {}
# (device, producer stream, consumer stream) of every ordering a fake array's DLPack export did.
DLPACK_ORDERS = []
# Every stand-in's table of driver calls stays allocated (its callbacks go with the stand-in): the shim's
# event pool knows events by the table's address, which must not come back for another stand-in.
_ALL_OPS = []
ALIGN = 256  # device allocations start on 256 bytes
POISON = 0xFF  # NaN in every float dtype: an element written with anything else shows


def span_elements(shape, strides) -> int:
    """Elements from the first to one past the last element a view touches (non-negative strides)."""
    if 0 in shape:
        return 0
    if strides is None:
        return math.prod(shape)
    return 1 + sum((n - 1) * s for n, s in zip(shape, strides))


def host_buffer(nbytes: int):
    """Poisoned host memory with room to start on an ALIGN boundary."""
    buf = (ctypes.c_char * (nbytes + ALIGN))()
    ctypes.memset(buf, POISON, ctypes.sizeof(buf))
    return buf


def aligned_start(buf) -> int:
    return -(-ctypes.addressof(buf) // ALIGN) * ALIGN


class FakeGpuArray(DLPackExporter):
    """Host memory exported as a GPU array. `strides` (elements) and `offset` make views of `base`.
    With `address`, the array is a bare device address with no memory behind it: for shapes and strides
    no host could hold, in calls that must never touch the memory. `stream` is the producer's stream
    (the interface's `stream` entry; None: ready on every stream), which its DLPack export orders
    before a consumer's other stream, as CuPy does."""

    def __init__(self, shape, dtype="float16", *, device=0, strides=None, offset=0, base=None, read_only=False,
                 device_type="cuda", address=None, stream=None):
        self.shape, self.dtype = tuple(shape), dtype
        self.strides = None if strides is None else tuple(strides)
        itemsize = ITEMSIZE[dtype]
        if address is not None:
            self.base, start = None, address
        else:
            nbytes = (span_elements(self.shape, self.strides) + offset) * itemsize
            self.base = base if base is not None else host_buffer(nbytes)
            start = aligned_start(self.base)
            assert start + nbytes <= ctypes.addressof(self.base) + ctypes.sizeof(self.base), "view past its base"
        self.ptr = start + offset * itemsize
        self.device = (device_type, device)
        self.read_only = read_only
        self.stream = stream
        self.snapshot = self.contents()
        if device_type in DLPACK_DEVICE_TYPES:
            LOCATIONS[self.ptr] = (DLPACK_DEVICE_TYPES[device_type], device)

    @property
    def __cuda_array_interface__(self):
        """A new dict on every read, as CuPy's; GPU arrays only (hasattr is False for the others)."""
        if self.device[0] not in DLPACK_DEVICE_TYPES:
            raise AttributeError(f"a {self.device[0]} array has no __cuda_array_interface__")
        itemsize = ITEMSIZE[self.dtype]
        return {"shape": self.shape, "typestr": TYPESTR[self.dtype], "data": (self.ptr, self.read_only), "version": 3,
                "strides": None if self.strides is None else tuple(s * itemsize for s in self.strides),
                "stream": self.stream}

    def order_before_consumer(self, consumer_stream):
        """As CuPy's export: the consumer's stream waits for the producer's unless they are one. Its
        interface spells the default stream 1 on either driver, DLPack on ROCm 0."""
        producer = 0 if self.device[0] == "rocm" and self.stream == 1 else self.stream
        if producer is not None and producer != consumer_stream:
            DLPACK_ORDERS.append((self.device[1], self.stream, consumer_stream))

    def contents(self) -> bytes:
        """Every byte of the memory behind the array (its whole base; nothing for a bare address)."""
        return b"" if self.base is None else ctypes.string_at(self.base, ctypes.sizeof(self.base))

    def untouched(self) -> bool:
        return self.contents() == self.snapshot

    def view(self, shape, strides, offset=0, dtype=None):
        return FakeGpuArray(shape, dtype or self.dtype, strides=strides, offset=offset, base=self.base,
                            device=self.device[1], stream=self.stream)


def launch_shape(config) -> tuple:
    """What a graph node fixes of a launch: its kernel, grid, block and shared memory."""
    return (int(ffi.cast("uintptr_t", config.kernel)), tuple(config.grid), tuple(config.block),
            config.dynamic_shared_bytes)


class StandInRuntime:
    """Two sm_90 devices whose memory is host memory. Allocations up to `limit` bytes succeed; larger ones
    fail as the driver fails when out of memory. A memset must land inside memory this object handed out
    (its allocations or `workspace` arrays): anywhere else is a test failure."""

    def __init__(self, monkeypatch, *, devices=2, limit=64 << 20):
        gpus = tuple(backend.Device(i, "stand-in", "sm_90", "sm_90", 132, 232448, 2**37) for i in range(devices))
        self.runtime = backend.Runtime("cuda", "stand-in", 13000, gpus)
        self.limit = limit
        self.allocations = {}  # start address -> (buffer, nbytes, device)
        self.lent = []  # (start, nbytes, device) of workspace arrays given to callers
        self.memsets = []  # (device, address, nbytes)
        self.frees = []  # (device, address, stream) of every free, in order
        self.capturing = set()  # streams being captured into a graph, as the capture query reports them
        self.capture_queries = []  # (device, stream) of every capture query
        self.pointer_queries = []  # every pointer asked where it lives
        self.stream_events = []  # ("create", device, event), ("record", device, event, stream), ("wait", device,
        # stream, event) in order
        self._events = itertools.count(0xE0000)  # event tokens
        self.problems = []  # bad frees: recorded, since buffers free themselves in __del__, which swallows errors
        monkeypatch.setattr(backend, "runtime", lambda: self.runtime)
        monkeypatch.setattr(backend, "mem_alloc", self.mem_alloc)
        monkeypatch.setattr(backend, "mem_free", self.mem_free)
        monkeypatch.setattr(backend, "memset", self.memset)
        monkeypatch.setattr(backend, "device_scope", self.device_scope)
        monkeypatch.setattr(backend, "copy_to_device", self.copy_to_device)
        self.callback_errors = []  # exceptions raised inside the replay's calls back into Python
        self.graphs = {}  # token -> (device, the launch shape of each node) of every live launch graph
        self.graph_events = []  # ("create", token, device, nodes), ("launch", token, stream), ("destroy", token)
        self.graph_failures = {"create": 0, "launch": 0}  # how many of the next such calls fail
        self._graph_tokens = itertools.count(0x6A0000)
        monkeypatch.setattr(kernel_launch, "REPLAY_OPS", self._replay_ops())

    def _replay_ops(self):
        """The cached plans' C replay calls back into Python for its launches, memsets, workspace and
        capture queries: launches go to kernel_launch.launch_prepared (which tests replace to record them), the rest to
        this stand-in."""
        def failed(exc_type, exc, tb):
            self.callback_errors.append(exc)
            return 1  # FMHA_ERR_DRIVER: the call fails as a driver failure would

        @ffi.callback("int(fmha_launch_config *, uint64_t)", onerror=failed)
        def replay_launch(config, stream):
            return kernel_launch.launch_prepared(config, stream)

        @ffi.callback("int(int, uint64_t, unsigned char, size_t, uint64_t)", onerror=failed)
        def replay_memset(device, ptr, value, nbytes, stream):
            backend.memset(device, ptr, value, nbytes, stream)
            return 0

        @ffi.callback("int(int, size_t, uint64_t, uint64_t *)", onerror=failed)
        def replay_alloc(device, nbytes, stream, ptr):
            ptr[0] = backend.mem_alloc(device, nbytes, stream)
            return 0

        @ffi.callback("int(int, uint64_t, uint64_t)", onerror=failed)
        def replay_free(device, ptr, stream):
            backend.mem_free(device, ptr, stream)
            return 0

        @ffi.callback("int(int, uint64_t, int *)", onerror=failed)
        def replay_capture_status(device, stream, status):
            status[0] = self.capture_status(device, stream)
            return 0

        @ffi.callback("int(uint64_t, int *, int *, int *)", onerror=failed)
        def replay_pointer_location(ptr, device_type, device, memory_type):
            return self.pointer_location(ptr, device_type, device, memory_type)

        @ffi.callback("int(int, uint64_t *)", onerror=failed)
        def replay_event_create(device, event):
            event[0] = self.event_create(device)
            return 0

        @ffi.callback("int(int, uint64_t, uint64_t)", onerror=failed)
        def replay_event_record(device, event, stream):
            self.note_event("record", device, event, stream)
            return 0

        @ffi.callback("int(int, uint64_t, uint64_t)", onerror=failed)
        def replay_stream_wait_event(device, stream, event):
            self.note_event("wait", device, stream, event)
            return 0

        @ffi.callback("int(int, fmha_launch_config *, size_t, void **)", onerror=failed)
        def replay_graph_create(device, launches, count, graph):
            if self.take_failure("create"):
                return 1
            token = next(self._graph_tokens)
            self.graphs[token] = (device, [launch_shape(launches[i]) for i in range(count)])
            self.graph_events.append(("create", token, device, count))
            graph[0] = ffi.cast("void *", token)
            return 0

        @ffi.callback("int(void *, fmha_launch_config *, size_t, uint64_t, size_t *)", onerror=failed)
        def replay_graph_launch(graph, launches, count, stream, failed_node):
            token = int(ffi.cast("uintptr_t", graph))
            if [launch_shape(launches[i]) for i in range(count)] != self.graphs[token][1]:
                raise AssertionError("a graph launched with launches it was not made from")
            self.graph_events.append(("launch", token, stream))
            if self.take_failure("launch"):
                failed_node[0] = 0
                return 1
            for i in range(count):  # the nodes, in order, as the launches a test's executor sees
                status = kernel_launch.launch_prepared(launches[i], stream)
                if status:
                    failed_node[0] = i
                    return status
            return 0

        @ffi.callback("int(void *)", onerror=failed)
        def replay_graph_destroy(graph):
            token = int(ffi.cast("uintptr_t", graph))
            del self.graphs[token]
            self.graph_events.append(("destroy", token))
            return 0

        # alive while the ops point here
        self._callbacks = (replay_launch, replay_memset, replay_alloc, replay_free, replay_capture_status,
                           replay_pointer_location, replay_event_create, replay_event_record, replay_stream_wait_event,
                           replay_graph_create, replay_graph_launch, replay_graph_destroy)
        fields = ("launch", "memset_d8", "mem_alloc", "mem_free", "stream_capture_status", "pointer_location",
                  "event_create", "event_record", "stream_wait_event", "graph_create", "graph_launch", "graph_destroy")
        _ALL_OPS.append(ffi.new("fmha_replay_ops *", dict(zip(fields, self._callbacks))))
        return _ALL_OPS[-1]

    def take_failure(self, call) -> bool:
        """Whether this graph call fails (graph_failures[call] more of them do)."""
        if self.graph_failures[call] == 0:
            return False
        self.graph_failures[call] -= 1
        return True

    def graph_launches(self) -> list:
        """(token, stream) of every graph launch, in order."""
        return [event[1:] for event in self.graph_events if event[0] == "launch"]

    def pointer_location(self, ptr, device_type, device, memory_type) -> int:
        """The driver's answer for `ptr`: where a fake GPU array put it, or 1 (an error) for any other."""
        self.pointer_queries.append(ptr)
        if ptr not in LOCATIONS:
            return 1
        (device_type[0], device[0]), memory_type[0] = LOCATIONS[ptr], MEMORY_TYPE_DEVICE
        return 0

    def event_create(self, ordinal) -> int:
        """A new event token of device `ordinal`."""
        event = next(self._events)
        self.note_event("create", ordinal, event)
        return event

    def note_event(self, what, ordinal, *handles):
        backend.device(ordinal)  # refuses an ordinal that does not exist, as the driver does
        self.stream_events.append((what, ordinal, *handles))

    def orderings(self) -> list:
        """(device, producer stream, consumer stream) of each record that a wait on the same event
        followed, in order, from stream_events."""
        recorded, pairs = {}, []
        for entry in self.stream_events:
            if entry[0] == "record":
                recorded[entry[2]] = (entry[1], entry[3])
            elif entry[0] == "wait":
                device, producer = recorded.pop(entry[3])
                pairs.append((device, producer, entry[2]))
        return pairs

    def capture_status(self, ordinal, stream) -> int:
        """The driver's answer: 1 (active) for a stream in `capturing`, else 0 (none)."""
        backend.device(ordinal)
        self.capture_queries.append((ordinal, stream))
        return int(stream in self.capturing)

    @contextlib.contextmanager
    def device_scope(self, ordinal):
        backend.device(ordinal)  # refuses an ordinal that does not exist, as the driver does
        yield

    def mem_alloc(self, ordinal, nbytes, stream=0):
        backend.device(ordinal)
        if nbytes > self.limit:
            raise DriverError(f"fmha_mem_alloc: mem_alloc_async failed with CUDA_ERROR_OUT_OF_MEMORY ({nbytes} bytes)",
                              code=2, error_name="CUDA_ERROR_OUT_OF_MEMORY", call="fmha_mem_alloc", device=ordinal)
        buf = host_buffer(max(int(nbytes), 1))
        self.allocations[aligned_start(buf)] = (buf, int(nbytes), ordinal)
        return aligned_start(buf)

    def mem_free(self, ordinal, ptr, stream=0):
        self.frees.append((ordinal, ptr, stream))
        entry = self.allocations.pop(ptr, None)
        if entry is None or entry[2] != ordinal:
            self.problems.append(f"free of 0x{ptr:x} on device {ordinal}: not an allocation there")

    def _writable(self, what, ordinal, ptr, nbytes):
        regions = [(start, n, dev) for start, (_, n, dev) in self.allocations.items()] + self.lent
        if not any(dev == ordinal and start <= ptr and ptr + nbytes <= start + n for start, n, dev in regions):
            raise AssertionError(f"{what} of {nbytes} bytes at 0x{ptr:x} on device {ordinal} is outside every "
                                 "allocation and workspace")

    def memset(self, ordinal, ptr, value, nbytes, stream=0):
        if nbytes == 0:  # writes nothing, wherever it points
            return
        self._writable("memset", ordinal, ptr, nbytes)
        ctypes.memset(ptr, value, nbytes)
        self.memsets.append((ordinal, ptr, nbytes))

    def copy_to_device(self, ordinal, dst, data, stream=0):
        data = bytes(memoryview(data).cast("B"))
        if data:
            self._writable("copy to the device", ordinal, dst, len(data))
            ctypes.memmove(dst, data, len(data))

    def workspace(self, nbytes, device=0) -> FakeGpuArray:
        """A uint8 array for a workspace callback to return: memory the runtime may clear."""
        array = FakeGpuArray((nbytes,), "uint8", device=device)
        self.lent.append((array.ptr, nbytes, device))
        return array

    def reset(self):
        self.lent.clear()
        self.memsets.clear()
        self.frees.clear()
        self.capture_queries.clear()
        self.pointer_queries.clear()
        self.stream_events.clear()
