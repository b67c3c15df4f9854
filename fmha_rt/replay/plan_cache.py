"""Plans of repeated calls, kept: the plan cache behind mha_fwd, mha_bwd and their varlen forms.

A call is described by its signature: for every array its kind, shape, strides, dtype and device, and
every option (api.py builds the key). A call of a new signature is validated, planned and packed as
usual. So is the second call of a signature, and then `record` keeps what it found out as a CallPlan
(recording costs about what planning does, so signatures that never repeat skip it): each launch's
packed argument bytes, which of those bytes hold a value that changes per call (a pointer, the
dropout seed and offset given by value), the byte spans of the arrays relative to their pointers,
the outputs to allocate and the workspace layout. The recording call launches the plan's launches
with its own values written in (so what later calls launch is what it launched, byte for byte), and
the plan is kept once they are launched. A later call of that signature skips validation, planning
and packing: `replay` reads its pointers, allocates the outputs that are missing (and takes the
workspace from the caller's workspace_alloc, if given) and launches the plan with one C call
(replay.c): that checks what depends on the pointers (no output overlapping an input, alignment), takes
our own workspace (kept per stream: workspaces.c), writes the values into copies of the templates,
zeroes the regions that must start at zero and launches, as one CUDA graph kept per plan and stream
(launch_graphs.c) where it can. A hit builds no launch objects: BoundLaunches,
the plan's launches read like planned ones, are made only where launches are logged. Whatever
follows from the signature alone is worked out once, when the plan is recorded: the pairs of arrays to
compare and the distances between their addresses at which they would overlap, each per-call slot's
byte offset, value, addend and alignment. The plan keeps it as a launch program (program.py: the
model whose programs fmha_rt.jax serialises, made by the same function), which the shim loads into
its replay plan once, when the plan is recorded (program.c); a hit only runs that plan.

Anything record cannot trace to a per-call value (a pointer that is not one of the call's arrays or
workspace regions, say) leaves the call uncached: a cached launch never carries a stale value.
"""
from __future__ import annotations

import collections
import dataclasses
import itertools
import operator
import struct
import threading

from ..runtime import backend, executor
from ..runtime import kernel_launch
from ..arrays import JAX_KINDS, acquire_workspace, allocate, check_spans, finish_outputs, overlap_error, overlap_pairs
from ..runtime.backend import ffi, lib
from ..errors import FmhaError, FmhaRuntimeError, FmhaValueError
from ..runtime.kernel_launch import Ready
from ..runtime.packing import NULL, Pointer
from ..plan.args import philox_seed_argument
from . import program as launch_program
from .program import LoadedProgram, Overlap, Value, ZeroFill

DEFAULT_CAPACITY = 256
WORKSPACE = "workspace"  # the value name of the workspace's base address
# The per-call values that are not a call's array addresses, after those in every call's value array.
EXTRA_VALUES = (WORKSPACE, "philox_seed", "philox_offset")


def philox_values(seed: int, offset: int) -> dict:
    """The kernels' philox_seed and philox_offset arguments for a seed and offset given by value, as
    the planner packs them (record checks each cached plan against the planner's own values)."""
    return {"philox_seed": philox_seed_argument(seed), "philox_offset": offset}


def value_array(count: int):
    """A zeroed uint64 array for one call's values: `count` array addresses, then EXTRA_VALUES."""
    return ffi.new("uint64_t[]", count + len(EXTRA_VALUES))


class CallBuffers:
    """One thread's buffers for its cached calls, made once: the call's value array (arrays.signatures
    writes the addresses and zeroes the rest) and its address, and where a refused replay says what
    failed. A thread runs one call at a time, and the C replay copies the values before it launches, so
    a call made from inside a launch may take them over."""

    __slots__ = ("values", "address", "failed")

    def __init__(self):
        self.values = ffi.new("uint64_t[]", lib.FMHA_REPLAY_MAX_VALUES)
        self.address = int(ffi.cast("uintptr_t", self.values))
        self.failed = ffi.new("size_t *")


class _ThreadBuffers(threading.local):
    """Each thread's CallBuffers, made when the thread first asks."""

    def __init__(self):
        self.buffers = CallBuffers()


_thread = _ThreadBuffers()


def thread_buffers() -> CallBuffers:
    return _thread.buffers


class CallValues:
    """One call's value array (what the C replay reads) addressed by value name, for those who read or
    write single values (recording, logging, error reports)."""

    __slots__ = ("array", "index")

    def __init__(self, array, index: dict):
        self.array, self.index = array, index

    def __getitem__(self, name: str) -> int:
        return self.array[self.index[name]]

    def __setitem__(self, name: str, value: int) -> None:
        self.array[self.index[name]] = value % 2**64


class LaunchTemplate:
    """One launch of a cached plan: its program launch (program.ProgramLaunch: the bytes the first call
    packed, and the per-call slots, each a value array position plus an addend: a workspace region is
    the workspace's address plus the region's offset), the kernel it runs and the planned arguments by
    name, which BoundLaunch reads back."""

    __slots__ = ("args", "entry", "launch", "slot_names")

    def __init__(self, entry, planned, launch):
        """`planned`: the plan.args.Launch that `launch` (its program launch) was packed from."""
        self.entry, self.args, self.launch = entry, dict(planned.args), launch
        names = {slot.offset: slot.name for slot in entry.packer.slots}
        self.slot_names = tuple(names[p.arg_offset] for p in self.launch.patches)


class BoundLaunch:
    """One launch of a BoundLaunches, read like a planned launch (variant, grid, args) by whoever
    inspects launches (logging, tests)."""

    __slots__ = ("bound", "template")

    def __init__(self, bound: BoundLaunches, template: LaunchTemplate):
        self.bound, self.template = bound, template

    @property
    def entry(self):
        return self.template.entry

    @property
    def variant(self) -> str:
        return self.template.launch.key

    @property
    def grid(self) -> tuple:
        return self.template.launch.grid

    @property
    def packed(self) -> bytes:
        """The argument bytes it launches."""
        packed = bytearray(self.template.launch.template)
        values = self.bound.array
        for p in self.template.launch.patches:
            struct.pack_into("<Q", packed, p.arg_offset, (values[p.value] + p.addend) % 2**64)
        return bytes(packed)

    @property
    def args(self) -> dict:
        """Arguments by name, as the planner would give them for this call."""
        args = dict(self.template.args)
        values = self.bound.array
        for slot, p in zip(self.template.slot_names, self.template.launch.patches):
            address = values[p.value] + p.addend
            args[slot] = Pointer(address) if isinstance(args[slot], Pointer) else address
        return args


class BoundLaunches(Ready):
    """A cached plan's launches with one call's values: a sequence of BoundLaunch, which executor.run
    launches together through one C call (replay.c) that checks the values, writes them in and launches."""

    __slots__ = ("allocate", "array", "plan")

    def __init__(self, plan: CallPlan, array, allocate: bool = False):
        """`array`: the call's value array; `allocate`: the replay allocates the workspace itself (and
        frees it after the launches)."""
        self.plan, self.array, self.allocate = plan, array, allocate

    @property
    def values(self) -> CallValues:
        return CallValues(self.array, self.plan.index)

    @property
    def keys(self) -> tuple:
        return self.plan.keys

    def __len__(self) -> int:
        return len(self.plan.launches)

    def __getitem__(self, index: int) -> BoundLaunch:
        return BoundLaunch(self, self.plan.launches[index])

    def launch(self, stream: int) -> None:
        self.plan.launch(self.array, stream, self.allocate, thread_buffers().failed)


# Names of the replay plans' launch graphs (launch_graphs.c): never reused in a process, so a graph kept
# for a plan that is gone is never launched for another. next() on a count is atomic under the GIL.
_GRAPH_IDS = itertools.count(1)


@dataclasses.dataclass(frozen=True)
class OutputSpec:
    name: str
    given: bool  # the caller passed it (else it is allocated like q)
    shape: tuple
    dtype: str
    pitch: int | None
    span: tuple  # (first byte, end byte) relative to its address


@dataclasses.dataclass(frozen=True)
class CallPlan:
    """What replay needs of a signature's first call."""

    runtime: object  # the backend.runtime() and registry it was planned under
    registry: object
    device: int
    arch: str
    kind: str  # arrays.framework(q): what outputs are allocated as
    launches: tuple  # LaunchTemplate
    keys: tuple  # their variant keys
    outputs: tuple  # OutputSpec, in return order
    output_names: tuple  # the names of `outputs`
    pick_outputs: callable  # a call's arrays (in key order) -> the tuple of its outputs, in return order
    index: dict  # value name -> its position in a call's value array (an array's is also its position in the key)
    template_position: int  # q's: outputs are allocated like it
    allocated: tuple  # (index, OutputSpec, value position) of the outputs to allocate
    # (output, other, low, high) for every pair that check_spans would compare among the given outputs
    # and the inputs, in its order: they overlap when low < address(other) - address(output) < high
    overlaps: tuple
    spans: tuple  # (name, value position, first byte, end byte) of the inputs, then the outputs, relative
    # to their addresses
    workspace_bytes: int
    workspace_zero_init: bool
    zeroed: tuple  # program.ZeroFill of the workspace regions that must start at zero
    philox_by_value: bool
    launch_program: launch_program.LaunchProgram  # what the shim replays, as fmha_rt.jax would serialise it
    loaded: LoadedProgram  # launch_program loaded by the shim on `device`
    program: object  # loaded's fmha_replay_plan *
    config: object  # call_log.CallConfig of the recording call: what a hit logs

    def launch(self, values, stream: int, allocate: bool, failed) -> None:
        """The C replay of this plan with a call's value array on `stream`; `allocate`: it takes fmha_rt's
        own workspace; `failed`: a size_t * for what a refused replay names."""
        status = lib.fmha_replay(self.program, kernel_launch.REPLAY_OPS, values, stream, allocate, failed)
        if status:
            self.raise_for(status, failed[0], CallValues(values, self.index))

    def raise_for(self, status: int, failed: int, values: CallValues):
        """Raise what the replay refused or what failed, as an uncached call would report it."""
        if status == lib.FMHA_ERR_OVERLAP:
            output, other, _, _ = self.overlaps[failed]
            raise overlap_error(output, other)
        if status == lib.FMHA_ERR_MISALIGNED:  # patches are numbered in launch order, as the C program has them
            entry, slot, p = [(t.entry, *sp) for t in self.launches for sp in zip(t.slot_names, t.launch.patches)][failed]
            executor.check_pointer(entry, slot, values.array[p.value] + p.addend, p.align)
        if failed == lib.FMHA_REPLAY_FAILED_ALLOC:
            backend.check(status, "fmha_mem_alloc", device=self.device)
        if failed < len(self.zeroed):
            backend.check(status, "fmha_memset_d8", device=self.device)
        failed -= len(self.zeroed)
        backend.check(status, "fmha_launch", kernel=self.keys[failed] if failed < len(self.keys) else None,
                      device=self.device)
        raise FmhaRuntimeError(f"fmha_replay returned {status}")  # pragma: no cover - check raised


def _relative_span(arg):
    lo, hi = arg.span()
    return arg.name, lo - arg.pointer.address, hi - arg.pointer.address


def _overlap_bounds(pairs) -> tuple:
    """(output, other, low, high) of check_spans' pairs of relative spans: with d the other's address
    less the output's, other + olo < output + hi and output + lo < other + ohi read lo - ohi < d < hi - olo."""
    return tuple((name, other, lo - ohi, hi - olo) for (name, lo, hi), (other, olo, ohi) in pairs)


def record(*, runtime, registry, device, arch, kind, names, launches, operands, inputs, outputs, workspace=None,
           layout=None, config=None) -> tuple[CallPlan, CallValues] | None:
    """(CallPlan, this call's values) of a call about to launch `launches`, or None when it cannot be
    cached (a pointer it cannot trace, a value that does not pack or is misaligned: the executor then
    gets the planned launches and reports what is wrong).

    names: the call's array names in the order the key describes them (their addresses lead every
    call's value array); inputs: the Args the kernels read, in the order the call checked overlaps
    against them; outputs: (Arg, given, shape, dtype, pitch) in return order; workspace: its Arg, and
    layout the backward's workspace layout (plan.layout.Workspace), whose regions the call put into
    `operands` (plan.operands.Operands); config: the call's call_log.CallConfig, which FMHA_RT_LOG_CONFIG logs on every hit."""
    arrays = list(inputs) + [o[0] for o in outputs] + ([workspace] if workspace is not None else [])
    index = {name: i for i, name in enumerate((*names, *EXTRA_VALUES))}
    if any(arg.name not in index for arg in arrays) or len(index) > lib.FMHA_REPLAY_MAX_VALUES:
        return None  # an array the key does not describe, or more values than a replay takes: plan every time
    values = CallValues(value_array(len(names)), index)
    for arg in arrays:
        values[arg.name] = arg.pointer.address
    traced = {id(arg.pointer): (arg.name, 0) for arg in arrays}  # Pointer objects in operands -> their source
    regions = layout.regions if layout is not None else ()
    for region in regions:
        traced[id(operands.regions[region.name])] = (WORKSPACE, region.offset)
    by_value = operands.philox is not None and operands.philox.by_value
    philox = philox_values(operands.philox.seed, operands.philox.offset) if by_value else {}
    for name, value in philox.items():
        values[name] = value

    def sources_of(entry, launch) -> dict:
        """{slot name: (value position, addend)} of every per-call slot of `launch`."""
        sources = {}
        for name, value in launch.args.items():
            if value is None or value is NULL:
                continue
            if type(value) in (int, float):
                if name in philox:
                    if value != philox[name]:
                        raise FmhaValueError(f"{entry.key}: {name} is not the call's")
                    sources[name] = (index[name], 0)
                continue
            source = traced.get(id(value))  # anything else is an address
            if source is None:
                raise FmhaValueError(f"{entry.key}: {name} is no address of the call's arrays")
            sources[name] = (index[source[0]], source[1])
        return sources

    specs = tuple(OutputSpec(a.name, given, tuple(shape), dtype, pitch, _relative_span(a)[1:])
                  for a, given, shape, dtype, pitch in outputs)
    input_spans = [_relative_span(a) for a in inputs]
    given_spans = [(o.name, *o.span) for o in specs if o.given]
    overlaps = _overlap_bounds(overlap_pairs(given_spans, input_spans))
    zeroed = tuple(ZeroFill(index[WORKSPACE], r.offset, r.nbytes) for r in regions if r.zero_init)
    workspace_bytes = layout.total_bytes if layout is not None else 0
    entries = [registry.entry(arch, launch.variant) for launch in launches]
    values_named = tuple(Value(name) for name in index)
    try:
        program = launch_program.build(
            config.function if config is not None else "cached call", entries, launches, sources_of, values_named,
            len(values_named), zeroed, tuple(Overlap(index[o], index[other], low, high) for o, other, low, high in overlaps),
            index[WORKSPACE], workspace_bytes)
    except FmhaError:
        return None  # a value it cannot trace, or a launch that does not pack: plan every time
    templates = tuple(LaunchTemplate(entry, planned, launch)
                      for entry, planned, launch in zip(entries, launches, program.launches))
    loaded = LoadedProgram(program, device, [kernel_launch.kernel_handle(device, entry) for entry in entries],
                           next(_GRAPH_IDS))
    spans = (*input_spans, *((o.name, *o.span) for o in specs))
    output_names = tuple(o.name for o in specs)
    pick = operator.itemgetter(*(index[name] for name in output_names))
    return CallPlan(
        runtime=runtime, registry=registry, device=device, arch=arch, kind=kind, launches=templates,
        keys=tuple(t.entry.key for t in templates), outputs=specs, output_names=output_names,
        pick_outputs=pick if len(output_names) > 1 else lambda given: (pick(given),), index=index,
        template_position=index["q"], allocated=tuple((i, o, index[o.name]) for i, o in enumerate(specs) if not o.given),
        overlaps=overlaps, spans=tuple((name, index[name], lo, hi) for name, lo, hi in spans),
        workspace_bytes=workspace_bytes,
        workspace_zero_init=layout.needs_zeroing if layout is not None else False, zeroed=zeroed,
        philox_by_value=by_value, launch_program=program, loaded=loaded, program=loaded.plan, config=config), values


def replay(plan: CallPlan, objects: tuple, values, failed, stream: int, workspace_alloc):
    """Run a call of `plan`'s signature: `objects` are the call's arrays in key order (None for outputs to
    allocate), `values` its value array (arrays.signatures wrote the addresses; completed here) and
    `failed` a size_t * for what a refused replay names. Returns the outputs, finished as the slow path
    finishes them."""
    arrays = plan.pick_outputs(objects)
    if plan.allocated:
        arrays = _allocate_outputs(plan, objects[plan.template_position], arrays, values, stream)
    # fmha_rt's own workspace is taken by the C replay, unless launches are logged (the log shows every
    # address, so the workspace must have one before the replay starts).
    logged = kernel_launch.LOG_CONFIG
    in_replay = bool(plan.workspace_bytes) and workspace_alloc is None and not logged
    # Without a workspace its value stays the 0 signatures wrote: its regions are empty and point at 0, as planned.
    keep_alive = None
    if plan.workspace_bytes and not in_replay:
        keep_alive = _python_workspace(plan, values, stream, workspace_alloc)
    if logged:
        executor.run(plan.device, plan.arch, BoundLaunches(plan, values), stream)
    else:
        plan.launch(values, stream, in_replay, failed)
        executor.note_launched(plan.keys, plan.device)
    del keep_alive  # a workspace we allocated is freed stream-ordered, after the launches
    return finish_outputs(objects[plan.template_position], arrays, stream) if plan.kind in JAX_KINDS else arrays


def _allocate_outputs(plan: CallPlan, template, arrays: tuple, values, stream: int) -> tuple:
    """The call's outputs with those it did not give allocated like `template`, their addresses in `values`."""
    arrays = list(arrays)
    for i, o, position in plan.allocated:
        arrays[i], values[position] = allocate(plan.kind, template, o.shape, o.dtype, plan.device, stream, o.pitch)
    return tuple(arrays)


def _python_workspace(plan: CallPlan, values, stream: int, workspace_alloc):
    """The workspace from the caller's callback (checked against the call's arrays) or our own allocator,
    its address in `values`; returns what must stay alive until the launches are queued."""
    keep_alive, ws = acquire_workspace(plan.device, stream, plan.workspace_bytes, plan.workspace_zero_init,
                                       workspace_alloc)
    start, end = ws.span()
    # Memory we allocated ourselves overlaps no live array; a bare address (a Pointer) has no extent.
    if workspace_alloc is not None and end > start:
        check_spans([(ws.name, start, end)], [(name, values[position] + lo, values[position] + hi)
                                              for name, position, lo, hi in plan.spans])
    values[plan.index[WORKSPACE]] = ws.pointer.address
    return keep_alive


class PlanCache:
    """Signature -> CallPlan, least recently used first out. A signature is recorded the second time it
    is seen (`admit`): a call whose shapes never repeat (varlen batches of changing lengths, say) pays
    no recording and pushes out no plan of the calls that do. Safe under concurrent calls: plans are
    immutable once recorded (a replay writes only to its own buffers). A hit takes no lock: a dict get
    is atomic under the GIL, and so is its one piece of bookkeeping, a draw from an itertools.count whose
    number stamps the plan's last use; the hit count is the number of stamps hits drew. Whatever adds or
    removes keys, or counts misses, takes the lock."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY):
        self.capacity = capacity
        self._plans: dict = {}  # key -> [plan, stamp of its last use]
        self._seen: collections.OrderedDict = collections.OrderedDict()  # signatures seen once, not recorded
        self._lock = threading.Lock()
        self._reset_counts()

    def _reset_counts(self) -> None:
        self._stamps = itertools.count()
        self._other_stamps = 0  # stamps drawn by put and by reading the hit count, under the lock
        self.misses = 0

    def _stamp(self) -> int:
        """A stamp drawn under the lock, not by a hit."""
        self._other_stamps += 1
        return next(self._stamps)

    def get(self, key, runtime, registry) -> CallPlan | None:
        """The plan of `key` if it was made under this runtime and registry (tests swap both)."""
        entry = self._plans.get(key)
        if entry is not None:
            plan = entry[0]
            if plan.runtime is runtime and plan.registry is registry:
                entry[1] = next(self._stamps)
                return plan
        with self._lock:
            self.misses += 1
        return None

    @property
    def hits(self) -> int:
        with self._lock:
            drawn = self._stamp() + 1  # every stamp drawn so far, this one included
            return drawn - self._other_stamps

    def admit(self, key) -> bool:
        """Whether a call of `key` that missed should record its plan: when the key was seen before."""
        with self._lock:
            if key in self._plans or self._seen.pop(key, None) is not None:
                return True
            self._seen[key] = True
            while len(self._seen) > 4 * self.capacity:
                self._seen.popitem(last=False)
            return False

    def put(self, key, plan: CallPlan) -> None:
        with self._lock:
            self._plans[key] = [plan, self._stamp()]
            while len(self._plans) > self.capacity:  # hits change stamps, never keys: the walk is safe
                del self._plans[min(self._plans, key=lambda k: self._plans[k][1])]

    def clear(self) -> None:
        with self._lock:
            self._plans.clear()
            self._seen.clear()
            self._reset_counts()

    def plans(self) -> tuple:
        """(key, CallPlan) of every plan kept, least recently put first: a snapshot to inspect."""
        with self._lock:
            return tuple((key, entry[0]) for key, entry in self._plans.items())

    @property
    def pending(self) -> int:
        """How many signatures were seen once and not recorded (at most 4 x capacity are remembered)."""
        with self._lock:
            return len(self._seen)

    def info(self) -> dict:
        hits = self.hits
        with self._lock:
            return {"entries": len(self._plans), "capacity": self.capacity, "hits": hits, "misses": self.misses}
