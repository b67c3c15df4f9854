"""Arrays described through their CUDA Array Interface (fmha_rt/csrc/describe.c, version 3), on the CPU: a call
of fake GPU arrays (fake_gpu.py, which export the interface as CuPy does) is keyed in one C call, with
each pointer's device asked of the stand-in driver; equal signatures give equal keys and every
difference a different one; what the describer cannot describe exactly goes to the DLPack path, which
raises what it raised before; the call's stream waits for an array's producer stream (one event record
and one wait per producer stream, none when it is the call's stream or the interface names none),
as the producer's DLPack export orders it on an uncached call; the event pool hands an event to one
call at a time. (test_plan_cache.py's arrays take this path too: what a hit checks is tested there.)
"""
import struct
import threading
import time

import pytest

import fmha_rt
from fmha_rt import arrays
from fmha_rt.runtime import kernel_launch
from fmha_rt.replay import plan_cache
from fmha_rt.runtime.backend import ffi, lib
from fmha_rt.runtime.buffers import DeviceBuffer
from fmha_rt.errors import FmhaTypeError, FmhaValueError

import fake_gpu
from fake_gpu import FakeGpuArray
from test_plan_cache import B, D, H, S, hits, run_threads, uncached, unpack, warm

NAMES = ("q", "k", "v", "out", "lse")
DROP = object()  # an entry Odd leaves out of the interface


class Odd(FakeGpuArray):
    """A fake GPU array whose interface has `changes` applied (DROP removes an entry); `interface` set
    replaces the dict (or names what reading it raises)."""

    def __init__(self, *args, changes=None, interface=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.changes, self.interface = changes or {}, interface

    @property
    def __cuda_array_interface__(self):
        if isinstance(self.interface, type) and issubclass(self.interface, Exception):
            raise self.interface("the producer refused")
        if self.interface is not None:
            return self.interface
        interface = {**super().__cuda_array_interface__, **self.changes}
        return {name: value for name, value in interface.items() if value is not DROP}


class NoInterface(FakeGpuArray):
    """The same array without the interface: DLPack only, as every non-torch array was before."""

    @property
    def __cuda_array_interface__(self):
        raise AttributeError("no interface")


def arrays_of(stream=None, **kwargs):
    """q, k, v, out, lse of one forward, produced on `stream`."""
    q, k, v, out = (FakeGpuArray((B, S, H, D), stream=stream, **kwargs) for _ in range(4))
    return q, k, v, out, FakeGpuArray((B, H, S), "float32", stream=stream, **kwargs)


def describe(objects, stream=0, names=NAMES):
    """(description, this call's values) of `objects` as the plan cache keys them."""
    values = plan_cache.value_array(len(objects))
    description, _ = arrays.signatures(tuple(objects), names[:len(objects)], stream, values,
                                       int(ffi.cast("uintptr_t", values)))
    return description, list(values)


def words(description) -> list:
    return list(struct.unpack(f"<{len(description) // 8}q", description))


def forward(objects, **options):
    q, k, v, out, lse = objects
    return fmha_rt.mha_fwd(q, k, v, out=out, lse=lse, **options)


# ---------------------------------------------------------------------------------------------- keys

def test_words_hold_kind_dtype_device_memory_type_flags_type_shape_and_strides(rt, driver):
    base = FakeGpuArray((3, 5, 2, 8), read_only=True, device=1)
    view = base.view((3, 4, 2, 8), (5 * 16, 16, 8, 1), offset=16)
    description, values = describe((view, None))
    header, device, memory, type_address, *rest = words(description)[:-1]
    assert header & 0xFF == 2 and header >> 8 & 0xFF == 4, "kind 2 (the interface), rank 4"
    assert (header >> 16 & 0xFF, header >> 24 & 0xFF, header >> 32 & 0xFFFF) == (2, 16, 1), "kDLFloat, 16 bits, 1 lane"
    assert header >> 48 == 2 and device == 1, "kDLCUDA, the device the driver named"
    assert memory == fake_gpu.MEMORY_TYPE_DEVICE and type_address == id(FakeGpuArray), "a view is writable"
    assert rest == [3, 4, 2, 8, 80, 16, 8, 1]
    assert words(description)[-1] == 0, "None is one zero word"
    assert values == [view.ptr, 0, 0, 0, 0]
    read_only = words(describe((base,))[0])
    assert read_only[2] == fake_gpu.MEMORY_TYPE_DEVICE | 1 << 32 and rt.pointer_queries == [view.ptr, base.ptr]


def test_equal_signatures_give_equal_words_and_every_difference_differs(rt, driver):
    base, same = FakeGpuArray((2, 16, 4, 8)), FakeGpuArray((2, 16, 4, 8), stream=0x40)
    assert describe((base,))[0] == describe((same,))[0], "the data, its address and its stream are not keyed"
    contiguous = FakeGpuArray((2, 16, 4, 8)).view((2, 16, 4, 8), (512, 32, 8, 1))
    assert describe((contiguous,))[0] == describe((base,))[0], "strides given or left out alike"
    variants = {
        "dtype": FakeGpuArray(base.shape, "float32"),
        "integer dtype": FakeGpuArray(base.shape, "int32"),
        "shape": FakeGpuArray((2, 8, 4, 8)),
        "rank": FakeGpuArray((2, 16, 32)),
        "strides": FakeGpuArray((2, 16, 4, 16)).view(base.shape, (1024, 64, 16, 1)),
        "transposed": FakeGpuArray(base.shape).view((2, 4, 16, 8), (512, 8, 32, 1)),
        "device": FakeGpuArray(base.shape, device=1),
        "device type": FakeGpuArray(base.shape, device_type="rocm"),
        "read-only": FakeGpuArray(base.shape, read_only=True),
        "type": Odd(base.shape),
    }
    seen = {describe((base,))[0]}
    for name, array in variants.items():
        description = describe((array,))[0]
        assert type(description) is bytes and description not in seen, name
        seen.add(description)
    assert describe((base, None))[0] != describe((None, base))[0], "positions are described"


def test_a_pointer_is_asked_where_it_lives_once_per_call_and_never_remembered(rt, driver):
    x = FakeGpuArray((B, S, H, D))
    lse = FakeGpuArray((B, H, S), "float32")
    warm(lambda: fmha_rt.mha_fwd(x, x, x, out=FakeGpuArray(x.shape), lse=lse))
    out = FakeGpuArray(x.shape)
    rt.reset()
    for _ in range(2):
        fmha_rt.mha_fwd(x, x, x, out=out, lse=lse)
    assert hits() == 2 and rt.pointer_queries == [x.ptr, out.ptr, lse.ptr] * 2


def test_torch_tensors_keep_their_path_and_mix_with_interface_arrays(rt, driver):
    torch = pytest.importorskip("torch")
    tensor = torch.randn(2, 4, dtype=torch.float16)
    description, values = describe((tensor, FakeGpuArray((2, 4))), names=("q", "k"))
    kinds = words(description)
    assert kinds[0] & 0xFF == 1 and kinds[2 + 4] & 0xFF == 2, "torch's words, then the interface's"
    assert values[0] == tensor.data_ptr() and rt.pointer_queries == [values[1]], "torch's pointer is not asked"


def test_a_tensor_subclass_is_described_per_array_without_reading_its_interface(rt, driver):
    torch = pytest.importorskip("torch")

    reads = []

    class Tensor(torch.Tensor):
        @property
        def __cuda_array_interface__(self):
            reads.append(self)
            return FakeGpuArray((2, 4)).__cuda_array_interface__

    tensor = torch.randn(2, 4, dtype=torch.float16).as_subclass(Tensor)
    description, values = describe((tensor, FakeGpuArray((2, 4))), names=("q", "k"))
    assert type(description) is tuple and description[0][0] is Tensor and values[0] == tensor.data_ptr()
    assert reads == []


def test_a_describer_made_before_torch_is_made_again_when_a_tensor_comes(monkeypatch, rt, driver):
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(arrays, "TORCH_TENSOR_TYPES", ())
    monkeypatch.setattr(arrays, "DESCRIBER", (kernel_launch.REPLAY_OPS, None, arrays.make_describer(kernel_launch.REPLAY_OPS)))
    assert type(describe((FakeGpuArray((2, 4)),))[0]) is bytes, "interface arrays need no torch"
    tensor = torch.randn(2, 4, dtype=torch.float16)
    description, _ = describe((tensor,))
    assert type(description) is bytes and words(description)[0] & 0xFF == 1
    assert arrays.TORCH_TENSOR_TYPES == (torch.Tensor, torch.nn.Parameter)


# ------------------------------------------------------------------------------------------ refusals

def odd(**changes):
    return Odd((B, S, H, D), changes=changes)


REFUSED = {
    "version 2": lambda: odd(version=2, stream=DROP),
    "version 4": lambda: odd(version=4),
    "version a bool": lambda: odd(version=True),
    "no version": lambda: odd(version=DROP),
    "a mask": lambda: odd(mask=FakeGpuArray((B, S, H, D), "uint8")),
    "bfloat16 (a void typestr)": lambda: Odd((B, S, H, D), "bfloat16"),
    "big-endian": lambda: odd(typestr=">f2"),
    "complex": lambda: odd(typestr="<c8"),
    "a one-byte float": lambda: odd(typestr="|f1"),
    "typestr not a str": lambda: odd(typestr=b"<f2"),
    "negative strides": lambda: Odd((B, S, H, D), address=0x7F0000100000, strides=(-S * H * D, H * D, D, 1)),
    "strides of half elements": lambda: odd(strides=(S * H * D * 2, H * D * 2, D * 2, 1)),
    "strides of another rank": lambda: odd(strides=(H * D * 2, D * 2, 2)),
    "a shape of floats": lambda: odd(shape=(2.0, S, H, D)),
    "a shape of bools": lambda: odd(shape=(True, S, H, D)),
    "a shape as a list": lambda: odd(shape=[B, S, H, D]),
    "rank 9": lambda: Odd((1,) * 9),
    "stream 0": lambda: odd(stream=0),
    "stream a bool": lambda: odd(stream=True),
    "stream negative": lambda: odd(stream=-1),
    "data not a pair": lambda: odd(data=(0x1000,)),
    "read-only not a bool": lambda: odd(data=(0x1000, 0)),
    "a pointer the driver does not know": lambda: odd(data=(0x7F0000200000, False)),
    "a dict subclass": lambda: Odd((B, S, H, D), interface=type("Interface", (dict,), {})(
        FakeGpuArray((B, S, H, D)).__cuda_array_interface__)),
    "reading it raises": lambda: Odd((B, S, H, D), interface=RuntimeError),
}


@pytest.mark.parametrize("case", REFUSED, ids=list(REFUSED))
def test_what_it_cannot_describe_exactly_goes_the_dlpack_way_and_orders_nothing(rt, driver, case):
    array = REFUSED[case]()
    description, values = describe((array, FakeGpuArray((2, 4), stream=0x20)), stream=0x10, names=("q", "k"))
    assert type(description) is tuple and description[0][0] is type(array), "described by a DLPack import"
    assert values[0] == array.ptr and rt.stream_events == [], "nothing ordered: the DLPack import orders"


@pytest.mark.parametrize("case", ["negative strides", "a mask", "bfloat16 (a void typestr)", "strides of half elements"])
def test_a_refused_interface_raises_or_runs_as_its_dlpack_twin_does(rt, driver, case):
    """The DLPack path decides what is wrong with an array the describer refused, exactly as it did
    before the interface was read (NoInterface arrays: DLPack only)."""
    refused = REFUSED[case]()
    twin = NoInterface(refused.shape, refused.dtype, strides=refused.strides,
                       address=refused.ptr if refused.base is None else None)
    _, k, v, out, lse = arrays_of()

    def outcome(q):
        try:
            fmha_rt.mha_fwd(q, k, v, out=out, lse=lse)
        except (FmhaTypeError, FmhaValueError) as exc:
            return type(exc), str(exc)
        return [(key, grid) for key, grid, *_ in driver.take()]

    expected = outcome(twin)
    assert outcome(refused) == expected and expected != []
    assert rt.stream_events == []


def test_an_array_without_the_interface_or_dlpack_is_refused_as_before(rt, driver):
    _, k, v, out, lse = arrays_of()
    with pytest.raises(FmhaTypeError, match="q must support DLPack"):
        fmha_rt.mha_fwd([1.0, 2.0], k, v, out=out, lse=lse)
    with pytest.raises(FmhaValueError, match="on the cpu device"):
        fmha_rt.mha_fwd(FakeGpuArray(k.shape, device_type="cpu"), k, v, out=out, lse=lse)
    assert driver.take() == [] and out.untouched()


# ----------------------------------------------------------------------------------------- streams

def test_no_producer_stream_means_no_ordering(rt, driver):
    call = arrays_of(stream=None)
    warm(lambda: forward(call, stream=0x10))
    driver.take()
    rt.reset()
    forward(call, stream=0x10)
    assert hits() == 1 and rt.stream_events == [] and len(driver.take()) == 1


@pytest.mark.parametrize("producer, call_stream, device_type", [
    (1, None, "cuda"),  # the legacy default stream is the call's default stream
    (0x10, 0x10, "cuda"),
    (2, 2, "cuda"),  # the per-thread default stream, named alike
    (1, None, "rocm"),  # ROCm's legacy default is its null stream
])
def test_the_calls_own_stream_needs_no_ordering(rt, driver, producer, call_stream, device_type):
    call = arrays_of(stream=producer, device_type=device_type)
    warm(lambda: forward(call, stream=call_stream))
    driver.take()
    rt.reset()
    forward(call, stream=call_stream)
    assert hits() == 1 and rt.stream_events == [] and len(driver.take()) == 1


@pytest.mark.parametrize("producer, call_stream, device_type, recorded_on, waiting", [
    (0x20, 0x10, "cuda", 0x20, 0x10),
    (0x20, None, "cuda", 0x20, 0),
    (2, None, "cuda", 2, 0),  # the per-thread default stream is not the legacy one
    (1, 0x10, "cuda", 1, 0x10),  # CU_STREAM_LEGACY
    (1, 0x10, "rocm", 0, 0x10),  # ROCm's null stream
])
def test_another_stream_is_waited_for_with_one_event_record_and_one_wait(rt, driver, producer, call_stream,
                                                                          device_type, recorded_on, waiting):
    call = arrays_of(stream=producer, device=1, device_type=device_type)
    forward(call, stream=call_stream)  # the first ordering on device 1 makes its event
    (create, record, wait) = rt.stream_events
    event = create[2]
    assert create == ("create", 1, event) and record == ("record", 1, event, recorded_on)
    assert wait == ("wait", 1, waiting, event)
    forward(call, stream=call_stream)
    rt.reset()
    forward(call, stream=call_stream)
    assert hits() == 1 and len(driver.take()) == 3
    assert rt.stream_events == [("record", 1, event, recorded_on), ("wait", 1, waiting, event)], "the event is reused"


def test_each_producer_stream_is_waited_for_once_after_every_array_is_described(rt, driver):
    q, k, v, out, lse = arrays_of(stream=0x20)
    k2, v2 = FakeGpuArray(k.shape, stream=0x30), FakeGpuArray(v.shape, stream=0x30)
    warm(lambda: forward((q, k2, v2, out, lse), stream=0x10))
    rt.reset()
    forward((q, k2, v2, out, lse), stream=0x10)
    assert hits() == 1 and rt.orderings() == [(0, 0x20, 0x10), (0, 0x30, 0x10)]
    rt.reset()
    fake_gpu.DLPACK_ORDERS.clear()
    masked = Odd(lse.shape, "float32", stream=0x40, changes={"mask": lse})  # refused, after four described
    forward((q, k2, v2, out, masked), stream=0x10)
    assert rt.stream_events == [], "the refused call ordered nothing through the interface"
    assert sorted(set(fake_gpu.DLPACK_ORDERS)) == [(0, 0x20, 0x10), (0, 0x30, 0x10), (0, 0x40, 0x10)]


def test_both_paths_order_the_same_streams(monkeypatch, rt, driver):
    """An uncached call imports by DLPack, whose producer orders its stream before the call's; a hit
    orders through the interface: the same producers, before the same stream."""
    cases = [(None, 0x10), (0x20, 0x10), (0x20, None), (1, None), (0x10, 0x10), (2, None)]
    for producer, call_stream in cases:
        call = arrays_of(stream=producer)
        fake_gpu.DLPACK_ORDERS.clear()
        uncached(monkeypatch, driver, lambda: forward(call, stream=call_stream))
        by_dlpack = sorted({(device, stream) for device, stream, _ in fake_gpu.DLPACK_ORDERS})
        consumers = {consumer for *_, consumer in fake_gpu.DLPACK_ORDERS}
        warm(lambda: forward(call, stream=call_stream))
        rt.reset()
        forward(call, stream=call_stream)
        assert by_dlpack == sorted((device, stream) for device, stream, _ in rt.orderings()), (producer, call_stream)
        assert consumers <= {call_stream or 1} and {c for *_, c in rt.orderings()} <= {call_stream or 0}


def test_a_failed_ordering_leaves_the_call_to_the_dlpack_path(monkeypatch, rt, driver):
    call = arrays_of(stream=0x20)
    warm(lambda: forward(call, stream=0x10))
    driver.take()

    def refuse(what, ordinal, *handles):
        raise RuntimeError(f"the driver refused the {what}")

    monkeypatch.setattr(rt, "note_event", refuse)
    fake_gpu.DLPACK_ORDERS.clear()
    forward(call, stream=0x10)
    assert hits() == 0 and len(driver.take()) == 1, "planned again: its key came from the DLPack imports"
    assert sorted(set(fake_gpu.DLPACK_ORDERS)) == [(0, 0x20, 0x10)], "every producer ordered by its export"
    assert [str(e) for e in rt.callback_errors] == ["the driver refused the record"]


# ------------------------------------------------------------------------------------------------ hits

def test_a_hit_imports_nothing_and_launches_what_an_uncached_call_launches(monkeypatch, rt, driver):
    first, second = arrays_of(stream=1), arrays_of(stream=1)
    expected = uncached(monkeypatch, driver, lambda: forward(second, causal=True))
    warm(lambda: forward(first, causal=True))
    driver.take()

    def refuse(*_, **__):
        raise AssertionError("a hit imported an array by DLPack")

    monkeypatch.setattr(FakeGpuArray, "__dlpack__", refuse)
    forward(second, causal=True)
    assert hits() == 1 and driver.take() == expected


def test_outputs_not_given_are_allocated_as_before(monkeypatch, rt, driver):
    q, k, v, _, _ = arrays_of(stream=1)
    warm(lambda: fmha_rt.mha_fwd(q, k, v))
    driver.take()
    out, lse = fmha_rt.mha_fwd(q, k, v)
    assert hits() == 1 and type(out) is DeviceBuffer and type(lse) is DeviceBuffer
    ((key, _, packed, _),) = driver.take()
    assert unpack(key, packed)["Out"] == out.ptr and unpack(key, packed)["Lse"] == lse.ptr


def test_sixteen_threads_each_order_their_own_producer_and_launch_their_own_pointers(rt, driver):
    inputs = [arrays_of(stream=0x100 + i) for i in range(16)]
    warm(lambda: forward(inputs[0], stream=0x10))
    driver.take()
    rt.reset()
    mine = {}

    def work(i, call):
        mine[threading.get_ident()] = call
        for _ in range(20):
            forward(call, stream=0x10)

    errors = run_threads(work, list(enumerate(inputs)))
    assert not errors, errors
    assert len(driver.launches) == 16 * 20 and hits() == 16 * 20
    for key, _, packed, stream, thread in driver.launches:
        args, (q, k, v, out, lse) = unpack(key, packed), mine[thread]
        assert (args["Q"], args["K"], args["V"], args["Out"], args["Lse"], stream) == (
            q.ptr, k.ptr, v.ptr, out.ptr, lse.ptr, 0x10)
    assert sorted(rt.orderings()) == sorted((0, 0x100 + i, 0x10) for i in range(16) for _ in range(20))
    kept = ffi.new("size_t *")
    assert lib.fmha_events_kept(kernel_launch.REPLAY_OPS, kept) == lib.FMHA_OK and 1 <= kept[0] <= 16


def test_the_event_pool_hands_an_event_to_one_holder_at_a_time(monkeypatch, rt):
    """fmha_stream_order from many threads at once (it runs without the GIL): no event is recorded by
    one thread while another holds it, and the pool keeps one event per concurrent holder at most."""
    holders, lock, errors = {}, threading.Lock(), []
    note = rt.note_event

    def watch(what, ordinal, *handles):
        event = handles[0] if what in ("create", "record") else handles[1]
        with lock:
            if what in ("create", "record") and holders.setdefault(event, threading.get_ident()) != threading.get_ident():
                errors.append(f"event {event:#x} held by two threads")
            if what == "wait":
                holders.pop(event, None)
        time.sleep(0)  # let other threads run while this one holds the event
        note(what, ordinal, *handles)

    monkeypatch.setattr(rt, "note_event", watch)

    def work():
        for i in range(200):
            if lib.fmha_stream_order(kernel_launch.REPLAY_OPS, i % 2, 0x20, 0x10) != lib.FMHA_OK:
                errors.append("ordering failed")

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    kept = ffi.new("size_t *")
    lib.fmha_events_kept(kernel_launch.REPLAY_OPS, kept)
    created = sum(what == "create" for what, *_ in rt.stream_events)
    assert errors == [] and created == kept[0] and 2 <= created <= 16, (errors, created, kept[0])
    assert len(rt.orderings()) == 8 * 200 and not rt.callback_errors


def test_the_event_pool_frees_a_failed_creation_and_refuses_when_every_event_is_held(monkeypatch, rt):
    kept = ffi.new("size_t *")
    with monkeypatch.context() as m:
        m.setattr(rt, "event_create", lambda ordinal: 1 / 0)
        assert lib.fmha_stream_order(kernel_launch.REPLAY_OPS, 1, 0x20, 0x10) == lib.FMHA_ERR_DRIVER
    assert lib.fmha_events_kept(kernel_launch.REPLAY_OPS, kept) == lib.FMHA_OK and kept[0] == 0
    assert [type(e) for e in rt.callback_errors] == [ZeroDivisionError] and rt.stream_events == []
    pool = lib.FMHA_EVENT_POOL
    entered, release = threading.Barrier(pool + 1), threading.Event()
    note = rt.note_event

    def hold_on_record(what, ordinal, *handles):
        note(what, ordinal, *handles)
        if what == "record":
            entered.wait()
            release.wait()

    monkeypatch.setattr(rt, "note_event", hold_on_record)
    threads = [threading.Thread(target=lib.fmha_stream_order, args=(kernel_launch.REPLAY_OPS, 0, 0x20, 0x10))
               for _ in range(pool)]
    for t in threads:
        t.start()
    entered.wait()  # every slot is held, the failed creation's too
    try:
        assert lib.fmha_stream_order(kernel_launch.REPLAY_OPS, 0, 0x20, 0x10) == lib.FMHA_ERR_OUT_OF_MEMORY
    finally:
        release.set()
        for t in threads:
            t.join()
    assert lib.fmha_events_kept(kernel_launch.REPLAY_OPS, kept) == lib.FMHA_OK and kept[0] == pool
    monkeypatch.setattr(rt, "note_event", note)
    assert lib.fmha_stream_order(kernel_launch.REPLAY_OPS, 0, 0x20, 0x10) == lib.FMHA_OK, "an idle event serves again"
    assert len(rt.orderings()) == pool + 1
