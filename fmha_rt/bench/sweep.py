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

from . import correctness, flops, peers, timing

ERROR_CHARS = 1000


@dataclasses.dataclass(frozen=True)
class Settings:
    repeats: int = 30
    warmup_ms: float = 50.0
    overhead_calls: int = 2000
    # rounds asked for; each point takes this many rounded up to a multiple of its implementations
    rounds: int = 1
    # A shape's backward and deterministic backward take turns in the same rounds (turn_groups); False
    # gives each its own.
    backward_turns_together: bool = True

    def fields(self):
        return dataclasses.asdict(self)


class DeviceLost(RuntimeError):
    """The device context broke during the sweep; rows measured before it were handed to on_point."""


def planned_pairs(points, adapters):
    """The (point, impl name) pairs the sweep will run: implementations skip modes they lack."""
    return [(point, name) for point in points for name, adapter in adapters.items()
            if peers.unsupported(adapter, point) is None]


def skipped_rows(points, adapters):
    """A row per (point, impl) pair not run for a mode the implementation lacks, saying which: a peer without
    a deterministic mode has no bwd_det figure, rather than its plain backward's under that name."""
    return [{"impl": name, **point.fields(), "skipped": peers.unsupported(adapter, point)}
            for point in points for name, adapter in adapters.items() if peers.unsupported(adapter, point)]


def equal_turn_rounds(requested, implementations):
    """`requested` rounded up to a multiple of `implementations`, so that in turn_order each implementation
    takes the first turn of a round equally often."""
    if implementations < 1:
        return requested
    return -(-requested // implementations) * implementations


def turn_order(names, round_index):
    """Who is timed when in round `round_index`: round r starts with names[r mod n] and goes on in the list's
    order. Over a multiple of n rounds each takes every slot equally often, the first one included (the
    turn after an idle moment, when the GPU is coolest and its clock highest under the power limit)."""
    shift = round_index % len(names) if names else 0
    return list(names[shift:]) + list(names[:shift])


def turn_groups(pairs, backward_together=True):
    """`pairs` split into the groups whose members take turns in the same rounds: the pairs of one point,
    except that (with `backward_together`) a shape's backward and deterministic backward form one group.
    Timed alone, back to back, a deterministic backward held the GPU at its power limit longer than a
    backward whose turns alternate with other implementations', and ran at a lower clock (H200, 16k
    tokens, D=128: 1808 MHz against 1853 for the same kernels in the backward's group). Groups in the order
    of their first pair; pairs in `pairs`' order."""
    groups = {}
    for point, name in pairs:
        key = dataclasses.replace(point, pass_name="bwd") if backward_together and point.backward else point
        groups.setdefault(key, []).append((point, name))
    return list(groups.values())


def run_sweep(points, adapters, device, settings, *, on_point=None, progress_stream=sys.stderr):
    """Measure every supported pair; `adapters` maps impl names to adapters. Each turn group is prepared and
    checked (measure_group), then timed in rounds. After each group, on_point(rows so far) runs (the CLI
    saves partial results there). Pairs an implementation does not run are rows that say why."""
    pairs = planned_pairs(points, adapters)
    progress = Progress(len(pairs), progress_stream)
    rows = skipped_rows(points, adapters)
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


class _Group:
    """The bookkeeping of one turn group: its rows, the timed calls of the pairs still in it, their samples
    and clock readings per turn."""

    def __init__(self, group):
        self.rows = {pair: {"impl": pair[1], **pair[0].fields(), "flops": pair[0].flops()} for pair in group}
        self.calls, self.samples, self.readings = {}, {pair: [] for pair in group}, {pair: [] for pair in group}

    def drop(self, pair, error):
        self.rows[pair]["error"] = error
        self.calls.pop(pair, None)

    def implementations(self):
        """The names still timed, in the group's order; each takes its turn with all its passes."""
        return list(dict.fromkeys(name for _, name in self.calls))

    def finish(self):
        for pair, row in self.rows.items():
            if "error" in row or not self.samples[pair]:
                continue
            measured = timing.summarize([ms for turn in self.samples[pair] for ms in turn])
            row.update(measured.fields(), tflops=flops.tflops(row["flops"], measured.ms),
                       rounds=len(self.samples[pair]), round_ms=[statistics.median(t) for t in self.samples[pair]])
            row.update(_clock_fields(self.readings[pair]))
        return list(self.rows.values())


def measure_group(group, adapters, device, settings, progress):
    """(rows of the (point, impl name) pairs of `group`, in its order; the failure that left the device
    broken, as {impl, label, error}, or None).

    1. Each pair is prepared and its first call checked against the fp32 reference (check_pair); a pair that
       fails is not timed (its row keeps the check), one that raises keeps the error.
    2. A warm turn: every pair's calls once, untimed, so that round 0 starts on a GPU as warm as later ones.
    3. equal_turn_rounds(settings.rounds, implementations) rounds in turn_order: in its turn an implementation
       runs each of its passes in the group (warm-up, then `repeats` timed calls)."""
    state = _Group(group)
    reference = {}
    for pair in group:
        point, name = pair
        progress.start(f"{name} {point.label()} (prepare, check)")
        with _failure_recorded(state.rows[pair], adapters[name]):
            state.calls[pair] = _prepare_point(adapters[name], point, device, state.rows[pair], reference)
        if "error" in state.rows[pair] or not state.rows[pair]["check"]["passed"]:
            state.calls.pop(pair, None)
            progress.advance()
            if not device.healthy():
                return state.finish(), _lost(state, pair)
    reference.clear()
    names = state.implementations()
    rounds = equal_turn_rounds(settings.rounds, len(names))
    for round_index in [None] + list(range(rounds)):  # None: the untimed warm turn
        for name in turn_order(names, round_index or 0):
            for pair in [p for p in state.calls if p[1] == name]:
                failed = _take_turn(state, pair, adapters[name], device, settings, timed=round_index is not None)
                if failed and not device.healthy():
                    return state.finish(), _lost(state, pair)
    for pair in state.calls:
        progress.advance()
    device.release_cached()
    return state.finish(), None


def _take_turn(state, pair, adapter, device, settings, timed):
    """One turn of a pair; True where it failed (the pair then leaves the group, its row holding the error)."""
    failed = {}
    with _failure_recorded(failed, adapter):
        start = time.monotonic()
        samples = timing.sample_calls(state.calls[pair], device, warmup_ms=settings.warmup_ms,
                                      repeats=settings.repeats)
        if timed:
            state.samples[pair].append(samples)
            state.readings[pair].append(device.clock_reading(start, time.monotonic()))
    if failed:
        state.drop(pair, failed["error"])
    return bool(failed)


def _lost(state, pair):
    return {"impl": pair[1], "label": pair[0].label(), "error": state.rows[pair].get("error")}


def _clock_fields(readings):
    """sm_mhz (and power_w where it was sampled), the medians over the turns that had samples of their own,
    and round_sm_mhz, each turn's (None for a turn without one); nothing where no turn had a sample."""
    clocks = [r["sm_mhz"] for r in readings if r]
    if not clocks:
        return {}
    fields = {"sm_mhz": statistics.median(clocks), "round_sm_mhz": [r.get("sm_mhz") for r in readings]}
    power = [r["power_w"] for r in readings if r.get("power_w") is not None]
    if power:
        fields["power_w"] = statistics.median(power)
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


def _prepare_point(adapter, point, device, row, reference):
    """The timed calls of `point` (one per input copy), after recording what is measured once: the
    correctness check of the first call (timed by the wall clock: a first call includes any compile), the
    launch info, the peak extra memory and the workspace. `reference`: the group's fp32 reference, computed
    here by the first pair that needs it (every pair's copy 0 holds the same inputs)."""
    copies = timing.copies_needed(timing.working_set_bytes(point), device.l2_bytes())
    cases = [peers.make_case(point, device.name, seed=i) for i in range(copies)]
    calls = [prepare_call(adapter, point, case) for case in cases]
    row["copies"] = copies
    row["check"], row["first_call_ms"] = check_pair(adapter, cases[0], calls[0], device, reference)
    if not row["check"]["passed"]:
        return calls
    row.update(adapter.launch_info())
    row["peak_extra_bytes"] = device.peak_extra_bytes(calls[0])
    workspace = adapter.workspace_bytes(cases[0], point.deterministic) if point.backward else None
    if workspace is not None:
        row["workspace_bytes"] = workspace
    return calls


def check_pair(adapter, case, call, device, reference):
    """(the correctness check of one call on `case`, the call's wall-clock ms). Outputs the call was given are
    poisoned first; a deterministic backward is called a second time and must repeat its results bit for
    bit."""
    correctness.poison_given_outputs(call)
    first_ms, result = timing.first_call(call, device)
    results = adapter.outputs(case, result)
    if not reference:
        reference.update(correctness.reference(case))
    check = correctness.judge(results, reference)
    if check["passed"] and case.point.deterministic:
        first = {name: tensor.clone() for name, tensor in results.items()}
        correctness.poison_given_outputs(call)
        again = adapter.outputs(case, call())
        device.synchronize()
        if not correctness.bitwise_equal(first, again):
            check.update(passed=False, reason="two calls on the same inputs differ: not bitwise repeatable")
    return check, first_ms


def prepare_call(adapter, point, case):
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

    def advance(self, steps=1):
        self._done += steps
        if self._bar is not None:
            self._bar.update(steps)

    def close(self):
        if self._bar is not None:
            self._bar.close()
