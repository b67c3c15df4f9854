"""Host overhead per call, measured on the path a user takes, like for like.

At a problem so small that the GPU is idle most of the time (grid.OVERHEAD_SHAPE: B=1, S=128, H=2, D=64,
bf16, causal), the wall clock of many back-to-back calls is the host's own cost. Each implementation is called
as its users call it, outputs allocated by the implementation every call:

    fwd       the forward alone (fmha_rt: fmha_rt.torch.flash_attn_func; SDPA: F.scaled_dot_product_attention
              on [B, H, S, D] tensors; the flash-attn family: flash_attn_func)
    fwd+bwd   the forward on inputs that require grad, then torch.autograd.grad of its output: the graph,
              the backward and the three gradients allocated, as a training step pays them

and, as rows of their own, fmha_rt's raw API with its outputs given (mha_fwd with out and lse; mha_bwd with
dq, dk, dv on a saved forward): what a caller that manages its own buffers pays, not comparable with the rows
above.

The entries take turns as the sweep's implementations do (sweep.turn_order, rounds rounded up to a multiple of
the entries, an untimed warm turn first); the figure is the median over rounds of each round's µs per call.
"""

import statistics
import warnings

from . import grid, peers, sweep, timing

USER_PATHS = ("fwd", "fwd+bwd")
RAW_PATHS = {"raw fwd, outputs given": "fwd", "raw bwd, outputs given": "bwd"}


def entries(adapters, device):
    """[(impl, path, call or None, error or None)] of every measurement: the user paths of each adapter, then
    fmha_rt's raw API."""
    found = []
    for name, adapter in adapters.items():
        for path in USER_PATHS:
            found.append(_entry(name, path, adapter, device,
                                lambda case, a=adapter, p=path: a.user_step(case, backward=p != "fwd")))
    subject = adapters.get(peers.SUBJECT)
    if subject is not None:
        for path, pass_name in RAW_PATHS.items():
            found.append(_entry(peers.SUBJECT, path, subject, device,
                                lambda case, a=subject, p=pass_name: sweep.prepare_call(a, _point(p), case),
                                pass_name=pass_name))
    return found


def _point(pass_name):
    return peers.small_point(grid.OVERHEAD_SHAPE, pass_name)


def _entry(name, path, adapter, device, make_call, pass_name="bwd"):
    """(name, path, the bound call, None) or (name, path, None, the error that binding or a first call raised)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with adapter.context():
                call = make_call(peers.make_case(_point(pass_name), device.name, seed=0))
                call()
                device.synchronize()
        except Exception as exc:  # recorded like any other failed measurement
            return name, path, None, sweep.describe_error(exc, caught)
    return name, path, call, None


def measure_host_overhead(adapters, device, settings):
    """A row per entry: impl, path, the shape, calls per round, us_per_call (median over rounds) and round_us,
    or error."""
    found = entries(adapters, device)
    shape = {**grid.OVERHEAD_SHAPE, "dtype": "bf16"}
    rows = {(name, path): {"impl": name, "path": path, **shape, "calls": settings.overhead_calls}
            for name, path, _, _ in found}
    calls = {(name, path): call for name, path, call, error in found if call is not None}
    for name, path, _, error in found:
        if error is not None:
            rows[(name, path)]["error"] = error
    keys = list(calls)
    rounds = sweep.equal_turn_rounds(settings.rounds, len(keys))
    samples = {key: [] for key in keys}
    for round_index in [None] + list(range(rounds)):  # None: the untimed warm turn
        for key in sweep.turn_order(keys, round_index or 0):
            if key not in calls:
                continue
            try:
                with adapters[key[0]].context():
                    us = timing.host_overhead_us(calls[key], device, calls=settings.overhead_calls)
            except Exception as exc:  # a failure in a later round ends that entry's measurement
                rows[key]["error"] = sweep.describe_error(exc)
                del calls[key]
                continue
            if round_index is not None:
                samples[key].append(us)
    for key, values in samples.items():
        if values and "error" not in rows[key]:
            rows[key].update(us_per_call=statistics.median(values), round_us=values)
    return list(rows.values())
