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
input, alignment, the workspace), allocates what is missing, writes its values into a slot of the
plan's launch pool (whose buffer holds the bytes that never change already) and hands those
launches to executor.run. Whatever follows from the signature alone is worked out once, when the
plan is recorded: the pairs of arrays to compare and the distances between their addresses at which
they would overlap, the pointers to check grouped by alignment, where each per-call value goes.

Anything record cannot trace to a per-call value (a pointer that is not one of the call's arrays or
workspace regions, say) leaves the call uncached: a cached launch never carries a stale value.
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import operator
import struct
import threading

from . import backend, executor
from .arrays import JAX_KINDS, acquire_workspace, allocate, check_spans, finish_outputs, overlap_error, overlap_pairs
from .errors import FmhaError
from .launch import LaunchPool, PooledLaunches
from .packing import NULL, SLOT_TYPES, Pointer
from .registry import SCRATCH_POINTERS

DEFAULT_CAPACITY = 256
_SCRATCH = dict.fromkeys(SCRATCH_POINTERS, NULL)
WORKSPACE = "workspace"  # the value name of the workspace's base address


def philox_values(seed: int, offset: int) -> dict:
    """The kernels' philox_seed and philox_offset arguments for a seed and offset given by value, as
    portable_plan packs them (record checks each cached plan against the planner's own values)."""
    return {"philox_seed": seed % 2**63, "philox_offset": offset}


def region_value(region: str) -> str:
    """The value name of a workspace region's address (the workspace's base plus the region's offset)."""
    return f"{WORKSPACE}.{region}"


def _getter(names) -> callable:
    """values -> (values[name] for name in names), as a tuple even for one name (itemgetter's is bare)."""
    get = operator.itemgetter(*names)
    return get if len(names) > 1 else lambda values: (get(values),)


class LaunchTemplate:
    """One launch of a cached plan: its packed bytes as the first call packed them, and the runs of
    consecutive argument slots whose values change per call, each written with one struct call."""

    __slots__ = ("args", "entry", "grid", "packed", "pointers", "runs", "sources", "variant")

    def __init__(self, entry, launch, sources: dict):
        """`sources`: {slot name: value name} for every per-call slot."""
        self.entry, self.variant, self.grid = entry, launch.variant, tuple(int(g) for g in launch.grid)
        self.args = dict(launch.args)
        args = {**_SCRATCH, **launch.args}
        executor.check_alignment(entry, args)  # what stays constant must pass as it would on every call
        self.packed = entry.packer.pack(args)
        self.sources = sources
        self.runs = []  # (struct layout, byte offset, value names)
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
        self.pointers = tuple((slot.name, sources[slot.name], executor.pointer_alignment(entry, slot.name))
                              for slot in entry.packer.slots if slot.type == "ptr" and slot.name in sources)

    def _run(self, slots):
        layout = struct.Struct("<" + "".join(SLOT_TYPES[s.type][0] for s in slots))
        return layout, slots[0].offset, tuple(self.sources[s.name] for s in slots)

    def check_pointers(self, values: dict) -> None:
        """Raise for the first pointer of this launch that `values` misalign, as the executor would."""
        for slot, name, align in self.pointers:
            executor.check_pointer(self.entry, slot, values[name], align)


class BoundLaunch:
    """One launch of a BoundLaunches, read like a planned launch (variant, grid, args) by whoever
    inspects launches (logging, tests)."""

    __slots__ = ("bound", "index", "template")

    def __init__(self, bound: BoundLaunches, index: int):
        self.bound, self.index, self.template = bound, index, bound.plan.launches[index]

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
    def packed(self) -> bytes:
        """The argument bytes it launches (until it is launched: then its slot is reused)."""
        start = self.bound.pool.offsets[self.index]
        return bytes(self.bound.slot[0][start:start + len(self.template.packed)])

    @property
    def args(self) -> dict:
        """Arguments by name, as the planner would give them for this call."""
        args = dict(self.template.args)
        for slot, name in self.template.sources.items():
            value = self.bound.values[name]
            args[slot] = Pointer(value) if isinstance(args[slot], Pointer) else value
        return args


class BoundLaunches(PooledLaunches):
    """A cached plan's launches with one call's values written into a slot of the plan's pool: a
    sequence of BoundLaunch, which executor.run launches together."""

    __slots__ = ("plan", "values")

    def __init__(self, plan: CallPlan, values: dict):
        slot = plan.pool.take()
        view = slot[0]
        for layout, at, get in plan.writes:
            layout.pack_into(view, at, *get(values))
        super().__init__(plan.pool, slot)
        self.plan, self.values = plan, values

    @property
    def keys(self) -> tuple:
        return self.plan.keys

    def __len__(self) -> int:
        return len(self.plan.launches)

    def __getitem__(self, index: int) -> BoundLaunch:
        if not 0 <= index < len(self):
            raise IndexError(index)
        return BoundLaunch(self, index)


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
    pool: LaunchPool  # launch configurations of all of them together
    writes: tuple  # (struct layout, byte offset in a pool slot, values -> the values it packs) per run
    alignment: tuple  # (alignment, values -> the per-call pointers that must have it)
    outputs: tuple  # OutputSpec, in return order
    output_names: tuple  # the names of `outputs`
    allocated: tuple  # (index, OutputSpec) of the outputs to allocate
    # (output, other, low, high) for every pair that check_spans would compare among the given outputs
    # and the inputs, in its order: they overlap when low < address(other) - address(output) < high
    overlaps: tuple
    spans: tuple  # (name, first byte, end byte) of the inputs, then the outputs, relative to their addresses
    workspace_bytes: int
    workspace_zero_init: bool
    regions: tuple  # (value name, offset) of every workspace region
    zeroed: tuple  # (offset, nbytes) of the workspace regions that must start at zero
    philox_by_value: bool

    def bind(self, values: dict) -> BoundLaunches:
        """The launches with `values` (every array's and workspace region's address by name, philox
        values) written in, once every pointer they get is checked for alignment."""
        for align, get in self.alignment:
            # alignments are powers of two: the bits below one are clear in each address if in their OR
            if functools.reduce(operator.or_, get(values)) % align:
                for template in self.launches:  # the error the executor gives for the first in launch order
                    template.check_pointers(values)
        return BoundLaunches(self, values)


def _relative_span(arg):
    lo, hi = arg.span()
    return arg.name, lo - arg.pointer.address, hi - arg.pointer.address


def _overlap_bounds(pairs) -> tuple:
    """(output, other, low, high) of check_spans' pairs of relative spans: with d the other's address
    less the output's, other + olo < output + hi and output + lo < other + ohi read lo - ohi < d < hi - olo."""
    return tuple((name, other, lo - ohi, hi - olo) for (name, lo, hi), (other, olo, ohi) in pairs)


def _pool_layout(device, templates) -> tuple:
    """(pool, writes) for `templates`: one slot for all of them, and each run at its place in the slot."""
    pool = LaunchPool(device, [(t.entry, t.grid, t.packed) for t in templates])
    writes = tuple((layout, start + at, _getter(names))
                   for t, start in zip(templates, pool.offsets) for layout, at, names in t.runs)
    return pool, writes


def _alignment(templates) -> tuple:
    """(alignment, getter) per alignment, each pointer under the strictest of its uses (a power of two)."""
    strictest = {}
    for t in templates:
        for _, name, align in t.pointers:
            strictest[name] = max(align, strictest.get(name, 1))
    groups = {}
    for name, align in strictest.items():
        groups.setdefault(align, []).append(name)
    return tuple((align, _getter(names)) for align, names in groups.items())


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
    traced = {id(arg.pointer): arg.name for arg in arrays}  # Pointer objects in tensors -> their value name
    regions = layout.regions if layout is not None else ()
    for region in regions:
        traced[id(tensors[region.name])] = region_value(region.name)
        values[region_value(region.name)] = values[WORKSPACE] + region.offset
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
                    sources[name] = name
                continue
            source = traced.get(id(value))  # anything else is an address
            if source is None:
                return None  # an address this call cannot trace to its arrays: plan every time
            sources[name] = source
        try:
            templates.append(LaunchTemplate(entry, launch, sources))
        except FmhaError:
            return None
    specs = tuple(OutputSpec(a.name, given, tuple(shape), dtype, pitch, _relative_span(a)[1:])
                  for a, given, shape, dtype, pitch in outputs)
    input_spans = [_relative_span(a) for a in inputs]
    given_spans = [(o.name, *o.span) for o in specs if o.given]
    pool, writes = _pool_layout(device, templates)
    return CallPlan(
        runtime=runtime, registry=registry, device=device, arch=arch, kind=kind, launches=tuple(templates),
        keys=tuple(t.entry.key for t in templates), pool=pool, writes=writes, alignment=_alignment(templates),
        outputs=specs, output_names=tuple(o.name for o in specs),
        allocated=tuple((i, o) for i, o in enumerate(specs) if not o.given),
        overlaps=_overlap_bounds(overlap_pairs(given_spans, input_spans)),
        spans=(*input_spans, *((o.name, *o.span) for o in specs)),
        workspace_bytes=layout.total_bytes if layout is not None else 0,
        workspace_zero_init=layout.needs_zeroing if layout is not None else False,
        regions=tuple((region_value(r.name), r.offset) for r in regions),
        zeroed=tuple((r.offset, r.nbytes) for r in regions if r.zero_init), philox_by_value=by_value), values


def replay(plan: CallPlan, template, given: dict, values: dict, stream: int, workspace_alloc):
    """Run a call of `plan`'s signature: `given` maps output names to the arrays the caller passed
    (None for those to allocate), `values` (extended here) holds every array's data address by name
    and the per-call philox values. Returns the outputs, finished as the slow path finishes them."""
    for output, other, low, high in plan.overlaps:
        if low < values[other] - values[output] < high:
            raise overlap_error(output, other)
    arrays = [given[name] for name in plan.output_names]
    for i, o in plan.allocated:
        arrays[i], values[o.name] = allocate(plan.kind, template, o.shape, o.dtype, plan.device, stream, o.pitch)
    keep_alive = before_launch = None
    base = 0  # no workspace (nothing to hold): its regions are empty and point at 0, as planned
    if plan.workspace_bytes:
        keep_alive, ws = acquire_workspace(plan.device, stream, plan.workspace_bytes, plan.workspace_zero_init,
                                           workspace_alloc)
        if workspace_alloc is not None:  # memory we allocated ourselves overlaps no live array
            check_spans([(ws.name, *ws.span())], [(name, values[name] + lo, values[name] + hi)
                                                  for name, lo, hi in plan.spans])
        base = ws.pointer.address
        if plan.zeroed:
            def before_launch():
                for offset, nbytes in plan.zeroed:
                    backend.memset(plan.device, base + offset, 0, nbytes, stream)
    values[WORKSPACE] = base
    for name, offset in plan.regions:
        values[name] = base + offset
    executor.run(plan.device, plan.arch, plan.bind(values), stream, before_launch=before_launch)
    del keep_alive  # a workspace we allocated is freed stream-ordered, after the launches
    arrays = tuple(arrays)
    return finish_outputs(template, arrays, stream) if plan.kind in JAX_KINDS else arrays


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
