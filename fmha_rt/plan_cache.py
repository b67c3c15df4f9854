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
and packing: `replay` reads its pointers, checks what depends on them (no output overlapping an
input, alignment, the workspace), allocates what is missing, writes its values into a copy of each
launch's bytes and hands those launches to executor.run.

Anything record cannot trace to a per-call value (a pointer that is not one of the call's arrays or
workspace regions, say) leaves the call uncached: a cached launch never carries a stale value.
"""
from __future__ import annotations

import collections
import dataclasses
import struct
import threading

from . import backend, executor
from .arrays import acquire_workspace, allocate, check_spans, finish_outputs
from .errors import FmhaError
from .launch import LaunchPool
from .packing import NULL, SLOT_TYPES, Pointer
from .registry import SCRATCH_POINTERS

DEFAULT_CAPACITY = 256
_SCRATCH = dict.fromkeys(SCRATCH_POINTERS, NULL)
WORKSPACE = "workspace"  # the value name of the workspace's base address


def philox_values(seed: int, offset: int) -> dict:
    """The kernels' philox_seed and philox_offset arguments for a seed and offset given by value, as
    portable_plan packs them (record checks each cached plan against the planner's own values)."""
    return {"philox_seed": seed % 2**63, "philox_offset": offset}


class LaunchTemplate:
    """One launch of a cached plan: its packed bytes as the first call packed them, and the runs of
    consecutive argument slots whose values change per call, each written with one struct call."""

    __slots__ = ("args", "entry", "grid", "packed", "pointers", "pool", "runs", "sources", "variant")

    def __init__(self, device: int, entry, launch, sources: dict):
        """`sources`: {slot name: (value name, byte offset added to it)} for every per-call slot."""
        self.entry, self.variant, self.grid = entry, launch.variant, tuple(int(g) for g in launch.grid)
        self.args = dict(launch.args)
        args = {**_SCRATCH, **launch.args}
        executor.check_alignment(entry, args)  # what stays constant must pass as it would on every call
        self.packed = entry.packer.pack(args)
        self.sources = sources
        self.runs = []
        run = []
        for slot in entry.packer.slots:
            if slot.name not in sources:
                continue
            if run and slot.offset != run[-1].offset + run[-1].size:
                self.runs.append(self._run(run))
                run = []
            run.append(slot)
        if run:
            self.runs.append(self._run(run))
        self.pointers = tuple((slot.name, *sources[slot.name], executor.pointer_alignment(entry, slot.name))
                              for slot in entry.packer.slots if slot.type == "ptr" and slot.name in sources)
        self.pool = LaunchPool(device, entry, self.grid, len(self.packed))

    def _run(self, slots):
        layout = struct.Struct("<" + "".join(SLOT_TYPES[s.type][0] for s in slots))
        return layout, slots[0].offset, tuple(self.sources[s.name] for s in slots)

    def bind(self, values: dict) -> BoundLaunch:
        packed = bytearray(self.packed)
        for layout, at, sources in self.runs:
            layout.pack_into(packed, at, *[values[name] + offset for name, offset in sources])
        return BoundLaunch(self, packed, values)


class BoundLaunch:
    """A cached launch with one call's values written in. It reads like a planned launch (variant,
    grid, args) for whoever inspects launches (logging, tests), and launches its packed bytes."""

    __slots__ = ("packed", "template", "values")

    def __init__(self, template: LaunchTemplate, packed: bytearray, values: dict):
        self.template, self.packed, self.values = template, packed, values

    @property
    def entry(self):
        return self.template.entry

    @property
    def variant(self) -> str:
        return self.template.variant

    @property
    def grid(self) -> tuple:
        return self.template.grid

    @property
    def args(self) -> dict:
        """Arguments by name, as the planner would give them for this call."""
        args = dict(self.template.args)
        for slot, (name, offset) in self.template.sources.items():
            value = self.values[name] + offset
            args[slot] = Pointer(value) if isinstance(args[slot], Pointer) else value
        return args

    def check_alignment(self) -> None:
        for slot, name, offset, align in self.template.pointers:
            address = self.values[name] + offset
            if address % align:
                executor.check_pointer(self.entry, slot, address, align)

    def __call__(self, stream: int) -> None:
        self.template.pool(self.packed, stream)


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
    inputs: tuple  # (name, first byte, end byte) relative to each input's address, in check order
    outputs: tuple  # OutputSpec, in return order
    given: tuple  # (name, first byte, end byte) of the outputs the caller passes, relative to their addresses
    workspace_bytes: int
    workspace_zero_init: bool
    zeroed: tuple  # (offset, nbytes) of the workspace regions that must start at zero
    philox_by_value: bool

    def bind(self, values: dict) -> list:
        """The launches with `values` (every array's address by name, philox values) written in."""
        return [t.bind(values) for t in self.launches]


def _relative_span(arg):
    lo, hi = arg.span()
    return lo - arg.pointer.address, hi - arg.pointer.address


def record(*, runtime, registry, device, arch, kind, launches, tensors, inputs, outputs, workspace=None,
           layout=None) -> tuple[CallPlan, dict] | None:
    """(CallPlan, this call's values) of a call about to launch `launches`, or None when it cannot be
    cached (a pointer it cannot trace, a value that does not pack or is misaligned: the executor then
    gets the planned launches and reports what is wrong).

    inputs: the Args the kernels read, in the order the call checked overlaps against them; outputs:
    (Arg, given, shape, dtype, pitch) in return order; workspace: its Arg, and layout the backward's
    workspace layout (portable_plan.Workspace), whose regions the call put into `tensors`."""
    arrays = list(inputs) + [o[0] for o in outputs] + ([workspace] if workspace is not None else [])
    values = {WORKSPACE: 0, **{arg.name: arg.pointer.address for arg in arrays}}
    traced = {id(arg.pointer): (arg.name, 0) for arg in arrays}  # Pointer objects in tensors -> their source
    regions = layout.regions if layout is not None else ()
    for region in regions:
        traced[id(tensors[region.name])] = (WORKSPACE, region.offset)
    by_value = "philox_seed" in tensors
    philox = philox_values(tensors["philox_seed"], tensors["philox_offset"]) if by_value else {}
    values.update(philox)
    templates = []
    for launch in launches:
        entry = registry.entry(arch, launch.variant)
        sources = {}
        for name, value in launch.args.items():
            if value is None or value is NULL:
                continue
            if type(value) in (int, float):
                if name in philox:
                    if value != philox[name]:
                        return None
                    sources[name] = (name, 0)
                continue
            source = traced.get(id(value))  # anything else is an address
            if source is None:
                return None  # an address this call cannot trace to its arrays: plan every time
            sources[name] = source
        try:
            templates.append(LaunchTemplate(device, entry, launch, sources))
        except FmhaError:
            return None
    return CallPlan(
        runtime=runtime, registry=registry, device=device, arch=arch, kind=kind, launches=tuple(templates),
        inputs=tuple((a.name, *_relative_span(a)) for a in inputs),
        outputs=tuple(OutputSpec(a.name, given, tuple(shape), dtype, pitch, _relative_span(a))
                      for a, given, shape, dtype, pitch in outputs),
        given=tuple((a.name, *_relative_span(a)) for a, given, *_ in outputs if given),
        workspace_bytes=layout.total_bytes if layout is not None else 0,
        workspace_zero_init=layout.needs_zeroing if layout is not None else False,
        zeroed=tuple((r.offset, r.nbytes) for r in regions if r.zero_init), philox_by_value=by_value), values


def _spans(values, relative):
    return [(name, values[name] + lo, values[name] + hi) for name, lo, hi in relative]


def replay(plan: CallPlan, template, given: dict, values: dict, stream: int, workspace_alloc):
    """Run a call of `plan`'s signature: `given` maps output names to the arrays the caller passed,
    `values` (extended here) holds every array's data address by name and the per-call philox values.
    Returns the outputs, finished as the slow path finishes them."""
    if plan.given:
        check_spans(_spans(values, plan.given), _spans(values, plan.inputs))
    arrays = []
    for o in plan.outputs:
        if o.given:
            arrays.append(given[o.name])
        else:
            array, values[o.name] = allocate(plan.kind, template, o.shape, o.dtype, plan.device, stream, o.pitch)
            arrays.append(array)
    keep_alive, ws = acquire_workspace(plan.device, stream, plan.workspace_bytes, plan.workspace_zero_init,
                                       workspace_alloc)
    before_launch = None
    values[WORKSPACE] = 0  # no workspace (nothing to hold): its regions are empty and point at 0, as planned
    if ws is not None:
        check_spans([(ws.name, *ws.span())],
                    _spans(values, plan.inputs) + [(o.name, values[o.name] + o.span[0], values[o.name] + o.span[1])
                                                   for o in plan.outputs])
        base = values[WORKSPACE] = ws.pointer.address

        def before_launch():
            for offset, nbytes in plan.zeroed:
                backend.memset(plan.device, base + offset, 0, nbytes, stream)

    executor.run(plan.device, plan.arch, plan.bind(values), stream, before_launch=before_launch)
    del keep_alive  # a workspace we allocated is freed stream-ordered, after the launches
    return finish_outputs(template, tuple(arrays), stream)


class PlanCache:
    """Signature -> CallPlan, least recently used first out. A signature is recorded the second time it
    is seen (`admit`): a call whose shapes never repeat (varlen batches of changing lengths, say) pays
    no recording and pushes out no plan of the calls that do. Safe under concurrent calls: a lock
    guards both dicts; plans are immutable once recorded (their launch pools are thread-safe)."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY):
        self.capacity = capacity
        self._plans: collections.OrderedDict = collections.OrderedDict()
        self._seen: collections.OrderedDict = collections.OrderedDict()  # signatures seen once, not recorded
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def get(self, key, runtime, registry_of) -> CallPlan | None:
        """The plan of `key` if it was made under this runtime and registry (tests swap both)."""
        with self._lock:
            plan = self._plans.get(key)
            if plan is not None and plan.runtime is runtime and plan.registry is registry_of():
                self._plans.move_to_end(key)
                self.hits += 1
                return plan
            self.misses += 1
            return None

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
            self._plans[key] = plan
            self._plans.move_to_end(key)
            while len(self._plans) > self.capacity:
                self._plans.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._plans.clear()
            self._seen.clear()
            self.hits = self.misses = 0

    def info(self) -> dict:
        with self._lock:
            return {"entries": len(self._plans), "capacity": self.capacity, "hits": self.hits, "misses": self.misses}
