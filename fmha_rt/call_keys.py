"""The plan cache's keys of public calls. A call is keyed by its function, its scalars, every array's
description (not its address: arrays.signatures) and every option that decides validation or the plan;
a call that cannot be keyed is validated and planned every time, which raises any error precisely.
`PLANS` holds the plans of the public functions (api.py runs a call from it, or plans and records it).
"""
from __future__ import annotations

import numpy as np

from .arrays import signatures
from .errors import FmhaTypeError
from .replay import plan_cache


DEFAULT_OPTIONS = dict(softmax_scale=None, causal=False, window=(-1, -1), mask_type=None, causal_alignment="top_left",
                       bias=None, alibi_slopes=None, dropout_p=0.0, seed=None, offset=0, stream=None)


def merged_options(given: dict) -> dict:
    if not given:
        return DEFAULT_OPTIONS  # never written to: every call merges into a dict of its own
    if not DEFAULT_OPTIONS.keys() >= given.keys():
        unknown = set(given) - set(DEFAULT_OPTIONS)
        raise FmhaTypeError(f"unexpected keyword argument(s): {', '.join(sorted(unknown))}")
    return {**DEFAULT_OPTIONS, **given}


PLANS = plan_cache.PlanCache()
# Option values of these types are keys as they are (with their type: True and 1 validate differently);
# a call with an option of any other type is validated and planned every time.
KEY_TYPES = frozenset({int, float, bool, str, type(None)})


def clear_plan_cache() -> None:
    """Forget every cached plan (the next call of each signature validates and plans again)."""
    PLANS.clear()


def plan_cache_info() -> dict:
    """Entries, capacity, hits and misses of the plan cache."""
    return PLANS.info()


def option_values(opts: dict) -> tuple:
    window = opts["window"]
    return (opts["softmax_scale"], opts["causal"], window[0], window[1], opts["mask_type"], opts["causal_alignment"],
            opts["dropout_p"])


class Site:
    """A public function as the plan cache sees it: its name, which starts every key it makes, the names
    of the arrays it passes (in the order it passes them, which is the key's and the value array's), the
    positions among them of varlen offsets (NumPy offsets are checked on the host every call) and its
    planned path, planned(objects, scalars, opts, workspace_alloc, handle, imported, record) ->
    (outputs, CallPlan or None), which validates and plans a call the cache cannot run."""

    __slots__ = ("name", "names", "offsets", "planned")

    def __init__(self, name: str, names: tuple, planned, offsets: tuple = ()):
        self.name, self.names, self.planned, self.offsets = name, names, planned, offsets


def function_key(site: Site, opts: dict, scalars: tuple):
    """(the key's function part, whether a seed array joins the call's arrays), or None when an option
    cannot be keyed: what key_request takes from the function, its scalars and its options."""
    if opts is DEFAULT_OPTIONS:
        return ((site.name, scalars) if scalars else site.name), False
    window, dropout_p, seed = opts["window"], opts["dropout_p"], opts["seed"]
    if type(window) not in (tuple, list) or len(window) != 2:
        return None
    values = option_values(opts)
    types = tuple(map(type, values))
    if not KEY_TYPES.issuperset(types):
        return None
    seed_kind = None if dropout_p == 0 else "value" if type(seed) is int else "array"
    return (site.name, scalars, (type(window), seed_kind, values, types)), seed_kind == "array"


def key_request(site: Site, objects: tuple, opts: dict, scalars: tuple, handle: int, buffers, keyed=None):
    """(key, objects, their names, imported Args) of a call for the plan cache, or None when the call
    cannot be keyed (then it is validated and planned every time, which raises any error precisely).
    The objects and names are `objects` and site.names, with a seed array after them when one is given;
    buffers.values gets their addresses in that order (arrays.signatures). `keyed`: the call's
    function_key, when the caller made it once for many calls.

    The key holds the function, its scalars (each of the one type validation accepts at its position:
    the caller leaves other calls uncached), every array's description (not its address) and every
    option that decides validation or the plan, each with its type. Left out are the stream, return_lse
    and, when dropout is off, seed and offset (none of them reach validation or the plan); with
    dropout on, a seed by value and the offset are per-call values (replay validates them again). A
    call that gives no option keys by the function (and scalars) alone: a string, whose hash Python
    keeps, or a pair."""
    names = site.names
    try:
        keyed = keyed or function_key(site, opts, scalars)
        if keyed is None:
            return None
        function, seeded = keyed
        if seeded:
            objects, names = (*objects, opts["seed"]), (*names, "seed")
        description, imported = signatures(objects, names, handle, buffers.values, buffers.address)
        # the shim describes GPU arrays alone (torch tensors, interface arrays): only a tuple can hold NumPy offsets
        if site.offsets and type(description) is not bytes and host_seqlens(*(objects[i] for i in site.offsets)):
            return None
        return (function, description), objects, names, imported
    except Exception:  # noqa: BLE001 - a value no signature describes: the slow path says what is wrong
        return None


def host_seqlens(*arrays) -> bool:
    """NumPy offsets are checked on the host and uploaded on every call: such calls are never cached."""
    return any(isinstance(a, np.ndarray) for a in arrays)
