"""Runs every (point, implementation) pair of a sweep into result rows, and the measurements made
beside it (host overhead, cold start).

A failure at one pair becomes that row's "error" string (with the warnings raised on the way, which
is where torch says why it found no kernel) and the sweep goes on. Only a broken device context stops
it, since every later call would fail the same way.
"""

import contextlib
import dataclasses
import statistics
import sys
import time
import warnings

from . import flops, grid, peers, timing, versus

ERROR_CHARS = 1000


@dataclasses.dataclass(frozen=True)
class Settings:
    repeats: int = 30
    warmup_ms: float = 50.0
    overhead_calls: int = 2000
    rounds: int = 1
    # A shape's backward and deterministic backward take turns in the same rounds (turn_groups); False
    # gives each its own, as records before this setting did.
    backward_turns_together: bool = True
    # Points where fmha_rt and the `settle` peer are within `settle_within` of each other after `rounds`
    # are timed to `settle_rounds` rounds in all: the decision is taken once, on closeness alone, so
    # that it favours neither side (extending until one side pulls ahead would).
    settle: str | None = None
    settle_within: float = 0.03
    settle_rounds: int = 8

    def fields(self):
        return dataclasses.asdict(self)


class DeviceLost(RuntimeError):
    """The device context broke during the sweep; rows measured before it were handed to on_point."""


def planned_pairs(points, adapters):
    """The (point, impl name) pairs the sweep will run: implementations skip modes they lack."""
    return [(point, name) for point in points for name, adapter in adapters.items()
            if peers.unsupported(adapter, point) is None]


def turn_order(names, round_index):
    """Who is timed when in round `round_index`: the list rotated by one place per round, so that no
    implementation always runs right after the same one (the GPU's clock under its power limit, and
    its temperature, carry over from one implementation's calls to the next one's)."""
    shift = round_index % len(names) if names else 0
    return list(names[shift:]) + list(names[:shift])


def turn_groups(pairs, backward_together=True):
    """`pairs` split into the groups whose members take turns in the same rounds: the pairs of one point,
    except that (with `backward_together`) a shape's backward and deterministic backward form one group.
    Timed alone, back to back, a deterministic backward held the GPU at its power limit longer than a
    backward whose turns alternate with other implementations', and ran at a lower clock (H200, 16k
    tokens, D=128: 1808 MHz against 1853 for the same kernels in the backward's group), which a
    comparison of it against the peers' backward would count against it. Groups in the order of their
    first pair; pairs in `pairs`' order."""
    groups = {}
    for point, name in pairs:
        key = dataclasses.replace(point, pass_name="bwd") if backward_together and point.backward else point
        groups.setdefault(key, []).append((point, name))
    return list(groups.values())


def run_sweep(points, adapters, device, settings, *, on_point=None, progress_stream=sys.stderr):
    """Measure every supported pair; `adapters` maps impl names to adapters. The pairs of each turn group
    are prepared, then timed in `settings.rounds` rounds (turn_order). After each group, on_point(rows so
    far) runs (the CLI saves partial results there)."""
    pairs = planned_pairs(points, adapters)
    progress = Progress(len(pairs) * settings.rounds, progress_stream)
    rows = []
    try:
        for group in turn_groups(pairs, settings.backward_turns_together):
            group_rows, lost = measure_group(group, adapters, device, settings, progress)
            rows.extend(group_rows)
            if on_point:
                on_point(rows)
            if lost:
                raise DeviceLost(f"the device stopped working after {lost['impl']} at {lost['label']}: "
                                 f"{lost['error']}")
    finally:
        progress.close()
    return rows


def measure_group(group, adapters, device, settings, progress):
    """(rows of the (point, impl name) pairs of `group`, in its order; the failure that left the device
    broken, as {impl, label, error}, or None). A failure in preparation or in the planned rounds ends that
    pair's measurement and becomes its row's error; one in the settle rounds ends its turns there, keeps
    its figures from the rounds before and is noted as the row's settle_error."""
    rows = {pair: {"impl": pair[1], **pair[0].fields(), "flops": pair[0].flops()} for pair in group}
    calls, samples, readings = {}, {pair: [] for pair in group}, {pair: [] for pair in group}

    def lost(pair, field):
        return {"impl": pair[1], "label": pair[0].label(), "error": rows[pair][field]}

    def finish(failure=None):
        for pair in group:
            if "error" in rows[pair] or not samples[pair]:
                continue
            measured = timing.summarize([ms for turn in samples[pair] for ms in turn])
            rows[pair].update(measured.fields(), tflops=flops.tflops(rows[pair]["flops"], measured.ms))
            rows[pair].update(_clock_fields(readings[pair]))
            if len(samples[pair]) > 1:
                rows[pair]["round_ms"] = [statistics.median(turn) for turn in samples[pair]]
        if failure is None:  # a broken context would fail this too
            device.release_cached()
        return list(rows.values()), failure

    def take_turns(first, last, field):
        """Rounds first..last-1, each pair still timed once per round in turn_order, a failure recorded in its
        row's `field`; the failure that left the device broken, or None."""
        for round_index in range(first, last):
            for pair in turn_order(list(calls), round_index):
                point, name = pair
                if round_index:
                    progress.start(f"{name} {point.label()} (round {round_index + 1}/{last})")
                failed = {}
                with _failure_recorded(failed, adapters[name]):
                    start = time.monotonic()
                    samples[pair].append(timing.sample_calls(calls[pair], device, warmup_ms=settings.warmup_ms,
                                                             repeats=settings.repeats))
                    readings[pair].append(device.clock_reading(start, time.monotonic()))
                if failed:
                    rows[pair][field] = failed["error"]
                    del calls[pair]
                    progress.advance(last - round_index)
                    if not device.healthy():
                        return lost(pair, field)
                else:
                    progress.advance()
        return None

    for pair in group:
        point, name = pair
        progress.start(f"{name} {point.label()}")
        with _failure_recorded(rows[pair], adapters[name]):
            calls[pair] = _prepare_point(adapters[name], point, device, rows[pair])
        if pair not in calls:
            progress.advance(settings.rounds)
            if not device.healthy():
                return finish(lost(pair, "error"))
    failure = take_turns(0, settings.rounds, "error")
    if failure is None and settles(group, calls, samples, settings):
        progress.extend(len(calls) * (settings.settle_rounds - settings.rounds))
        failure = take_turns(settings.rounds, settings.settle_rounds, "settle_error")
    return finish(failure)


def settles(group, calls, samples, settings):
    """Whether `group` takes the settle rounds: fmha_rt and the settle peer both still timed, and at some
    pass their median times so far within settle_within (the peer's backward standing in for a
    deterministic backward it has no pair of, as versus.comparisons compares them)."""
    if not settings.settle or settings.settle_rounds <= settings.rounds:
        return False
    passes = {(point.pass_name, name) for point, name in group}
    medians = {(point.pass_name, name): statistics.median(ms for turn in samples[(point, name)] for ms in turn)
               for point, name in group if (point, name) in calls}
    for (pass_name, name), ours in medians.items():
        if name != peers.SUBJECT:
            continue
        peer_pass = pass_name if (pass_name, settings.settle) in passes else versus.STAND_IN_PASS.get(pass_name)
        theirs = medians.get((peer_pass, settings.settle))
        if theirs is not None and abs(theirs / ours - 1) < settings.settle_within:
            return True
    return False


def _clock_fields(readings):
    """sm_mhz and power_w, the medians over a row's turns (round_sm_mhz, each turn's clock, with several
    turns); nothing where no turn had a reading."""
    clocks = [r["sm_mhz"] for r in readings if r]
    if not clocks:
        return {}
    fields = {"sm_mhz": statistics.median(clocks), "power_w": statistics.median(r["power_w"] for r in readings if r)}
    if len(readings) > 1:
        fields["round_sm_mhz"] = [r.get("sm_mhz") for r in readings]
    return fields


@contextlib.contextmanager
def _failure_recorded(row, adapter):
    """Runs the body in the adapter's context; any exception becomes row["error"] (with the warnings
    raised on the way), not a crash."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with adapter.context():
                yield
        except Exception as exc:  # any failure of any implementation is a result, not a crash
            row["error"] = describe_error(exc, caught)


def _prepare_point(adapter, point, device, row):
    """The timed calls of `point` (one per input copy), after recording what is measured once: the
    first call, the launch info, the peak extra memory and the workspace."""
    copies = timing.copies_needed(timing.working_set_bytes(point), device.l2_bytes())
    cases = [peers.make_case(point, device.name, seed=i) for i in range(copies)]
    calls = [_prepare(adapter, point, case) for case in cases]
    row.update(copies=copies, first_call_ms=timing.first_call_ms(calls[0], device))
    row.update(adapter.launch_info())
    row["peak_extra_bytes"] = device.peak_extra_bytes(calls[0])
    workspace = adapter.workspace_bytes(cases[0], point.deterministic) if point.backward else None
    if workspace is not None:
        row["workspace_bytes"] = workspace
    return calls


def _prepare(adapter, point, case):
    return adapter.backward(case, point.deterministic) if point.backward else adapter.forward(case)


def describe_error(exc, caught_warnings=()):
    text = f"{type(exc).__name__}: {exc}".strip()
    notes = []
    for caught in caught_warnings:
        message = str(caught.message).strip()
        if message and message not in text and message not in notes:
            notes.append(message)
    if notes:
        text += " | warnings: " + " / ".join(notes)
    return text[:ERROR_CHARS]


def overhead_points(adapter):
    """The tiny points of the host-overhead measurement: forward and backward at grid.OVERHEAD_SHAPE,
    and their varlen forms for implementations that have them."""
    points = [peers.small_point(grid.OVERHEAD_SHAPE, p) for p in ("fwd", "bwd")]
    if adapter.has_varlen:
        points += [peers.small_point(grid.OVERHEAD_SHAPE, p, seqlens=grid.OVERHEAD_VARLEN_SEQLENS)
                   for p in ("fwd", "bwd")]
    return points


def measure_host_overhead(name, adapter, device, settings):
    """Host microseconds per call of the tiny overhead points. Each row has `us_per_call` (one call
    repeated: what a training loop pays, plan cache warm), `first_call_us` (the call's first run,
    plan cache cleared just before it) and, for implementations with a plan cache,
    `uncached_us_per_call` (the cache cleared before every call: what a call of a new signature pays,
    kernels already loaded)."""
    rows = []
    for point in overhead_points(adapter):
        row = {"impl": name, **point.fields(), "calls": settings.overhead_calls}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                with adapter.context():
                    call = _prepare(adapter, point, peers.make_case(point, device.name, seed=0))
                    adapter.clear_plan_cache()
                    row["first_call_us"] = timing.one_call_us(call, device)
                    row["us_per_call"] = timing.host_overhead_us(call, device, calls=settings.overhead_calls)
                    if adapter.has_plan_cache:
                        row["uncached_us_per_call"] = timing.host_overhead_us(
                            call, device, calls=settings.overhead_calls, before_each=adapter.clear_plan_cache)
            except Exception as exc:  # recorded like any other failed measurement
                row["error"] = describe_error(exc, caught)
        rows.append(row)
    return rows


class Progress:
    """A tqdm bar when tqdm is installed, else one stderr line per step naming what runs next."""

    def __init__(self, total, stream):
        try:
            from tqdm import tqdm
        except ImportError:
            tqdm = None
        self._bar = tqdm(total=total, file=stream, unit="run", dynamic_ncols=True) if tqdm else None
        self._total, self._done, self._stream = total, 0, stream

    def start(self, label):
        if self._bar is not None:
            self._bar.set_postfix_str(label, refresh=True)
        else:
            print(f"[{self._done + 1}/{self._total}] {label}", file=self._stream, flush=True)

    def extend(self, steps):
        """More steps than the bar was made for (a group that takes the settle rounds)."""
        self._total += steps
        if self._bar is not None:
            self._bar.total += steps
            self._bar.refresh()

    def advance(self, steps=1):
        self._done += steps
        if self._bar is not None:
            self._bar.update(steps)

    def close(self):
        if self._bar is not None:
            self._bar.close()
