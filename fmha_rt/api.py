"""The public attention API: mha_fwd / mha_bwd, their varlen forms, and the backward launcher.

Framework-agnostic: arrays come in by DLPack (CuPy, JAX, anything with __dlpack__; torch tensors are
read from their attributes) and outputs that are not given are allocated as the same kind of array as
`q` (torch, CuPy, JAX; anything else gets a DeviceBuffer). Every argument is validated before the first
launch, so on error nothing has been written.

A call whose signature (every array's kind, shape, strides, dtype and device, every option) the plan
cache holds (plan_cache.py: a signature is recorded the second time it is seen) runs from it: its arrays
are described in one C call (describe.c: torch tensors, CuPy arrays, CUDA Array Interface arrays), only
what depends on this call's pointers is checked again, and its launches are the cached ones with its
pointers written in.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from .runtime import backend, executor
from .plan import dispatch, head_padding, portable
from .replay import plan_cache
from .arrays import (ATTN_DTYPES, Arg, acquire_workspace, allocate_like, check_overlap, check_shape, finish_outputs,
                     framework, gpu_array, signatures)
from .runtime.buffers import DeviceBuffer
from .errors import FmhaNotImplementedError, FmhaTypeError, FmhaValueError
from .runtime.kernel_launch import Ready
from .runtime.packing import Pointer
from .plan.problem import AttentionProblem
from .runtime.registry import registry
from .runtime.streams import stream_handle

INT32_LIMIT = 2**31  # lengths, window sides and small strides reach the kernels as int32

# AITER / TransformerEngine mask integers: 0 none, 1 causal top-left, 2 causal bottom-right, 3 window.
MASK_TYPES = {0: "none", 1: "causal_top_left", 2: "causal_bottom_right", 3: "window"}
ALIGNMENTS = ("top_left", "bottom_right")


@dataclasses.dataclass(frozen=True)
class MaskSpec:
    window_left: int
    window_right: int
    bottom_right: bool


def resolve_mask(causal, window, mask_type, causal_alignment) -> MaskSpec:
    """One mask from flash-attn style (causal, window) or AITER style (mask_type + window)."""
    if causal_alignment not in ALIGNMENTS:
        raise FmhaValueError(f"causal_alignment must be one of {ALIGNMENTS}, got {causal_alignment!r}")
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise FmhaTypeError(f"window must be a pair (left, right), got {window!r}")
    left, right = window
    for name, value in (("window[0]", left), ("window[1]", right)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise FmhaTypeError(f"{name} must be an int, got {type(value).__name__}")
        if not -1 <= value < INT32_LIMIT:
            raise FmhaValueError(f"{name}={value}: window sides are in [0, 2^31), or -1 for unbounded")
    if not isinstance(causal, bool):
        raise FmhaTypeError(f"causal must be a bool, got {type(causal).__name__}")
    bottom_right = causal_alignment == "bottom_right"
    if mask_type is not None:
        if type(mask_type) is not int or mask_type not in MASK_TYPES:
            raise FmhaValueError(f"mask_type must be one of {sorted(MASK_TYPES)} ({MASK_TYPES}), got {mask_type!r}")
        if causal:
            raise FmhaValueError("give either causal=True or mask_type, not both")
        if mask_type == 0:
            if (left, right) != (-1, -1):
                raise FmhaValueError(f"mask_type 0 (no mask) takes no window, got {tuple(window)}")
            return MaskSpec(-1, -1, False)
        if mask_type in (1, 2):
            return MaskSpec(left, 0, mask_type == 2)
        return MaskSpec(left, right, bottom_right)
    if causal:
        return MaskSpec(left, 0, bottom_right)
    return MaskSpec(left, right, bottom_right)


def _dtype(q: Arg, k: Arg, v: Arg) -> str:
    for other in (k, v):
        if other.dtype != q.dtype:
            raise FmhaTypeError(f"{other.name} has dtype {other.dtype} but q has {q.dtype}: they must match")
    return ATTN_DTYPES[q.dtype]


def _same_device(args) -> int:
    args = [a for a in args if a is not None]
    device = args[0].device
    for a in args[1:]:
        if a.device != device:
            raise FmhaValueError(f"{a.name} is on GPU {a.device} but {args[0].name} is on GPU {device}: "
                                 "all arrays of a call must be on one device")
    return device


def batch_dims(q_shape, k_shape, v_shape):
    """(B, Sq, Sk, Hq, Hk, Dqk, Dv) of batch-mode q [B, Sq, Hq, D], k [B, Sk, Hk, D], v [B, Sk, Hk, Dv]."""
    (batch, sq, hq, dqk), (bk, sk, hk, dk), v_shape = tuple(q_shape), tuple(k_shape), tuple(v_shape)
    if bk != batch or v_shape[:3] != (bk, sk, hk) or dk != dqk:
        raise FmhaValueError(f"q {tuple(q_shape)}, k {tuple(k_shape)}, v {v_shape} disagree: expected "
                             f"k [{batch}, Sk, Hk, {dqk}] and v [{batch}, Sk, Hk, Dv]")
    return batch, sq, sk, hq, hk, dqk, v_shape[3]


def check_sizes(sq, sk, hq, hk, dqk, dv):
    """Sequence lengths within int32, query heads a multiple of the kv heads, head dims supported."""
    for name, value in (("query sequence length", sq), ("key sequence length", sk)):
        if value >= INT32_LIMIT:
            raise FmhaValueError(f"{name} {value} must be below 2^31")
    if hk == 0 or hq % hk:
        raise FmhaValueError(f"q has {hq} heads, k/v have {hk}: the query heads must be a multiple of the kv heads")
    _check_head_dims(dqk, dv)


def _check_head_dims(dqk, dv):
    for name, d in (("head_dim (q/k)", dqk), ("head_dim (v)", dv)):
        if not 1 <= d <= 256:
            raise FmhaNotImplementedError(f"{name}={d}: supported head dims are 1..256")


def bias_shape_name(shape, b: int, h: int, sq: int, sk: int) -> str:
    """The AttentionProblem.bias_shape ('11SS', '1HSS', 'B1SS', 'BHSS') of a bias of `shape`."""
    shape = tuple(shape)
    if len(shape) != 4 or shape[2:] != (sq, sk) or shape[0] not in (1, b) or shape[1] not in (1, h):
        raise FmhaValueError(f"bias must broadcast from [1|{b}, 1|{h}, {sq}, {sk}], got {shape}")
    return ("B" if shape[0] == b and b > 1 else "1") + ("H" if shape[1] == h and h > 1 else "1") + "SS"


def alibi_shape_name(shape, b: int, h: int) -> str:
    """The AttentionProblem.alibi ('H' or 'BH') of ALiBi slopes of `shape`."""
    if tuple(shape) not in ((h,), (b, h)):
        raise FmhaValueError(f"alibi_slopes must have shape [{h}] or [{b}, {h}], got {tuple(shape)}")
    return "H" if len(shape) == 1 else "BH"


def check_one_score_term(bias, alibi_slopes) -> None:
    if bias is not None and alibi_slopes is not None:
        raise FmhaNotImplementedError("bias and alibi_slopes together are not supported; add the ALiBi term to the bias")


def check_dropout_p(value, name="dropout_p") -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
        raise FmhaValueError(f"{name} must be a number in [0, 1), got {value!r}")
    return float(value)


def _dropout(dropout_p, seed, offset, stream, imported=None):
    """Dropout options -> tensors entries. seed: an int, or a device array of two int64 (seed, offset)
    for graph capture; offset: the Philox offset (ignored when seed is an array)."""
    if check_dropout_p(dropout_p) == 0.0:
        return {}, []
    if seed is None:
        raise FmhaValueError("dropout_p > 0 needs seed= (an int, or a device int64 array [seed, offset]); "
                             "pass the same seed and offset to the backward")
    if isinstance(seed, int) and not isinstance(seed, bool):
        if isinstance(offset, bool) or not isinstance(offset, int) or not 0 <= offset < 2**63:
            raise FmhaValueError(f"offset must be an int in [0, 2^63), got {offset!r}")
        return {"philox_seed": seed, "philox_offset": offset}, []
    arg = gpu_array("seed", seed, stream, dtypes=("int64",), arg=(imported or {}).get("seed"))
    if tuple(arg.shape) != (2,):
        raise FmhaValueError(f"a seed array must hold two int64 (seed, offset), got shape {tuple(arg.shape)}")
    return {"philox_seed_offset": arg.pointer}, [arg]


def _put(tensors, name, arg):
    tensors[name] = arg.pointer
    tensors[f"{name}_strides"] = tuple(arg.strides)


class HostSeqlens:
    """Sequence offsets given as NumPy arrays: checked on the host (monotone, inside the packed tensors,
    no sequence longer than max_seqlen), then copied to the device. Device arrays are taken as they
    are: checking them would force a device-to-host copy on every call."""

    NAMES = ("cu_seqlens_q", "cu_seqlens_k", "seqstart_q", "seqstart_k")

    def __init__(self, cu_q, cu_k, start_q, start_k, total_q, total_k, max_q, max_k):
        given = dict(zip(self.NAMES, (cu_q, cu_k, start_q, start_k)))
        host = {n: isinstance(a, np.ndarray) for n, a in given.items() if a is not None}
        self.given = any(host.values())
        if self.given and not all(host.values()):
            raise FmhaValueError("give cu_seqlens (and seqstarts) either all as NumPy arrays or all as GPU arrays")
        if not self.given:
            return
        self.arrays = {n: self._int32(n, a) for n, a in given.items() if a is not None}
        for side, total, longest in (("q", total_q, max_q), ("k", total_k, max_k)):
            cu = self.arrays[f"cu_seqlens_{side}"]
            if cu.size < 2:
                raise FmhaValueError(f"cu_seqlens_{side} must have B + 1 >= 2 entries, got {cu.size}")
            lengths = np.diff(cu.astype(np.int64))
            if (lengths < 0).any():
                raise FmhaValueError(f"cu_seqlens_{side} must be non-decreasing, got {cu.tolist()}")
            if lengths.size and lengths.max() > longest:
                raise FmhaValueError(f"cu_seqlens_{side} has a sequence of {lengths.max()} rows, more than "
                                     f"max_seqlen_{side}={longest}")
            starts = self.arrays.get(f"seqstart_{side}", cu)
            if starts.shape != cu.shape:
                raise FmhaValueError(f"seqstart_{side} must have {cu.shape[0]} entries like cu_seqlens_{side}")
            ends = starts[:-1].astype(np.int64) + lengths
            if cu[0] < 0 or (starts < 0).any() or (ends.size and ends.max() > total):
                raise FmhaValueError(f"sequences of {'cu_seqlens' if starts is cu else 'seqstart'}_{side} reach row "
                                     f"{int(ends.max()) if ends.size else 0}, beyond the {total} rows of "
                                     f"{'q' if side == 'q' else 'k/v'}")

    @staticmethod
    def _int32(name, a):
        if a.ndim != 1 or a.dtype.kind not in "iu":
            raise FmhaTypeError(f"{name} must be a 1-D integer array, got {a.dtype} of shape {a.shape}")
        if a.size and (a.min() < -(2**31) or a.max() >= 2**31):
            raise FmhaValueError(f"{name} values must fit int32")
        return np.ascontiguousarray(a, dtype=np.int32)

    def upload(self, name, device, stream) -> Arg:
        host = self.arrays[name]
        buf = DeviceBuffer(device, host.shape, "int32", stream)
        backend.copy_to_device(device, buf.ptr, host, stream)
        return Arg(name, buf, stream)


@dataclasses.dataclass
class _Call:
    """A validated call: the problem, the device, the kernels' tensors and the caller's arrays."""

    problem: AttentionProblem
    device: int
    arch: str
    stream: int
    tensors: dict
    inputs: list
    template: object
    imported: dict  # Args the plan-cache key imported already, by argument name

    def array(self, name, obj, **checks) -> Arg:
        return gpu_array(name, obj, self.stream, arg=self.imported.get(name), **checks)


def _prepare(q, k, v, *, varlen, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqstart_q, seqstart_k,
             softmax_scale, causal, window, mask_type, causal_alignment, bias, alibi_slopes, dropout_p, seed,
             offset, deterministic, stream, bias_grad=False, handle=None, imported=None) -> _Call:
    """Validate a call. `handle`: its stream's handle, when the caller has it; `imported`: arrays the
    caller imported already (plan_cache key), by argument name."""
    if handle is None:
        handle = stream_handle(stream, backend=backend.runtime().backend)
    imported = imported or {}

    def array(name, obj, **checks):
        return gpu_array(name, obj, handle, arg=imported.get(name), **checks)

    rank = 3 if varlen else 4
    qa, ka, va = (array(n, x, rank=rank, dtypes=tuple(ATTN_DTYPES)) for n, x in (("q", q), ("k", k), ("v", v)))
    dtype = _dtype(qa, ka, va)
    mask = resolve_mask(causal, window, mask_type, causal_alignment)
    inputs = [qa, ka, va]
    tensors = {}
    if varlen:
        (tq, hq, dqk), (tk, hk, dk_), (tv, hv, dv) = qa.shape, ka.shape, va.shape
        if (tv, hv) != (tk, hk) or dk_ != dqk:
            raise FmhaValueError(f"k {tuple(ka.shape)} and v {tuple(va.shape)} must agree on rows and heads, "
                                 f"and k's head dim must equal q's ({dqk})")
        for name, value in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < INT32_LIMIT:
                raise FmhaValueError(f"{name} must be an int in [0, 2^31), got {value!r}")
        if (seqstart_q is None) != (seqstart_k is None):
            raise FmhaValueError("seqstart_q and seqstart_k must be given together")
        host = HostSeqlens(cu_seqlens_q, cu_seqlens_k, seqstart_q, seqstart_k, tq, tk, max_seqlen_q, max_seqlen_k)
        cq = host.upload("cu_seqlens_q", qa.device, handle) if host.given else \
            array("cu_seqlens_q", cu_seqlens_q, rank=1, dtypes=("int32",))
        ck = host.upload("cu_seqlens_k", qa.device, handle) if host.given else \
            array("cu_seqlens_k", cu_seqlens_k, rank=1, dtypes=("int32",))
        if cq.shape != ck.shape or cq.shape[0] < 2:
            raise FmhaValueError(f"cu_seqlens_q {tuple(cq.shape)} and cu_seqlens_k {tuple(ck.shape)} must both "
                                 "have B + 1 >= 2 entries")
        batch = cq.shape[0] - 1
        sq, sk = max_seqlen_q, max_seqlen_k
        _put(tensors, "cu_seqlens_q", cq)
        _put(tensors, "cu_seqlens_k", ck)
        inputs += [cq, ck]
        if seqstart_q is not None:
            for name, value in (("seqstart_q", seqstart_q), ("seqstart_k", seqstart_k)):
                arg = host.upload(name, qa.device, handle) if host.given else \
                    array(name, value, rank=1, dtypes=("int32",))
                check_shape(arg, cq.shape, " (B + 1 entries, like cu_seqlens)")
                _put(tensors, name, arg)
                inputs.append(arg)
    else:
        batch, sq, sk, hq, hk, dqk, dv = batch_dims(qa.shape, ka.shape, va.shape)
        tq = tk = None
    check_sizes(sq, sk, hq, hk, dqk, dv)
    bias_shape = alibi = None
    check_one_score_term(bias, alibi_slopes)
    if bias is not None:
        ba = array("bias", bias, rank=4, dtypes=(qa.dtype,))
        bias_shape = bias_shape_name(ba.shape, batch, hq, sq, sk)
        _put(tensors, "bias", ba)
        inputs.append(ba)
    if alibi_slopes is not None:
        aa = array("alibi_slopes", alibi_slopes, rank=(1, 2), dtypes=("float32",))
        alibi = alibi_shape_name(aa.shape, batch, hq)
        if alibi == "BH" and not 0 <= aa.strides[0] < INT32_LIMIT:
            raise FmhaValueError(f"alibi_slopes batch stride {aa.strides[0]} must be in [0, 2^31)")
        _put(tensors, "alibi", aa)
        inputs.append(aa)
    drop, drop_args = _dropout(dropout_p, seed, offset, handle, imported)
    tensors.update(drop)
    inputs += drop_args
    if softmax_scale is not None:
        if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)):
            raise FmhaTypeError(f"softmax_scale must be a float or None, got {type(softmax_scale).__name__}")
        if not 0.0 < softmax_scale <= 1e38:  # the kernels take scale * log2(e) as a float32
            raise FmhaValueError(f"softmax_scale must be in (0, 1e38], got {softmax_scale!r}")
    if not isinstance(deterministic, bool):
        raise FmhaTypeError(f"deterministic must be a bool, got {type(deterministic).__name__}")
    problem = AttentionProblem(
        batch=batch, seqlen_q=sq, seqlen_k=sk, heads_q=hq, heads_k=hk, head_dim_qk=dqk, head_dim_v=dv, dtype=dtype,
        softmax_scale=softmax_scale, window_left=mask.window_left, window_right=mask.window_right,
        bottom_right=mask.bottom_right, bias_shape=bias_shape, bias_grad=bias_grad and bias is not None, alibi=alibi,
        dropout_p=float(dropout_p), varlen=varlen, total_q=tq, total_k=tk, deterministic=deterministic)
    device = _same_device(inputs)
    for name, a in (("q", qa), ("k", ka), ("v", va)):
        _put(tensors, name, a)
    return _Call(problem, device, backend.device(device).arch, handle, tensors, inputs, q, imported)


def _outputs(call: _Call, specs, inputs):
    """Outputs (name, given array or None, shape, dtype) -> (arrays for the caller, [(Arg, given, shape,
    dtype, pitch)]). Outputs the caller gave are checked (kind, shape, writable, no overlap with inputs
    or each other) before any missing one is allocated like q, so a bad call allocates nothing."""
    args = {}
    for name, given, shape, dtype in specs:
        if given is not None:
            args[name] = call.array(name, given, dtypes=(dtype,), writable=True)
            check_shape(args[name], shape)
    check_overlap(list(args.values()), inputs)
    arrays, records = [], []
    for name, given, shape, dtype in specs:
        pitch = None
        if given is None:
            # Kernels need row strides in multiples of 8 elements: pad the rows of a dbias whose key
            # count is not (outputs that end in another head dim are written by the padding copies,
            # which take any strides).
            pitch = -(-shape[-1] // 8) * 8 if name == "dbias" else None
            array, args[name] = allocate_like(call.template, shape, dtype, call.device, call.stream, pitch)
            args[name].name = name
        arrays.append(given if given is not None else array)
        records.append((args[name], given is not None, shape, dtype, pitch))
        _put(call.tensors, name, args[name])
    return arrays, records


def carve(scratch, buf, tensors: dict) -> None:
    """Put the regions of `scratch` (layout.Scratch: a forward's padding scratch or a backward's
    workspace) into the call's tensors, as addresses inside `buf` (None when there are no bytes)."""
    base = buf.pointer.address if buf is not None else 0
    for region in scratch.regions:
        tensors[region.name] = Pointer(base + region.offset)


def _with_work(launches):
    """Launches that have blocks to run: a grid with a zero dimension (no keys, say, so dK and dV are
    empty) does nothing, and the drivers refuse it."""
    return [launch for launch in launches if all(launch.grid)]


def _lse_shape(p: AttentionProblem):
    return (p.heads_q, p.total_q) if p.varlen else (p.batch, p.heads_q, p.seqlen_q)


def _out_shape(p: AttentionProblem, head_dim):
    return (p.total_q, p.heads_q, head_dim) if p.varlen else (p.batch, p.seqlen_q, p.heads_q, head_dim)


def _kv_shape(p: AttentionProblem, head_dim):
    return (p.total_k, p.heads_k, head_dim) if p.varlen else (p.batch, p.seqlen_k, p.heads_k, head_dim)


def _recorded(record, call: _Call, launches, inputs, outputs, workspace=None, layout=None):
    """(CallPlan or None, the launches to run): when `record` (the call's array names in key order, or
    None) asks and the call can be cached, the plan's launches bound to this call's values, so that the
    recording call runs what later calls will."""
    recorded = plan_cache.record(
        runtime=backend.runtime(), registry=registry(), device=call.device, arch=call.arch,
        kind=framework(call.template), names=record, launches=launches, tensors=call.tensors, inputs=inputs,
        outputs=outputs, workspace=workspace, layout=layout) if record is not None else None
    if recorded is None:
        return None, launches
    plan, values = recorded
    return plan, plan_cache.BoundLaunches(plan, values.array)


def _forward(call: _Call, out, lse, record):
    """Run a validated forward; returns ((out, lse), its CallPlan when `record` asks and it can be cached)."""
    p = call.problem
    arrays, outputs = _outputs(call, [("out", out, _out_shape(p, p.head_dim_v), call.inputs[0].dtype),
                                      ("lse", lse, _lse_shape(p), "float32")], call.inputs)
    # Head dims that are not multiples of 8 run on zero-padded copies in a scratch buffer, carved into
    # regions as the backward's workspace is (so a cached call has the replay allocate it).
    scratch = dispatch.fwd_scratch(p, call.arch)
    keep_alive, scratch_arg = acquire_workspace(call.device, call.stream, scratch.total_bytes, False, None)
    carve(scratch, scratch_arg, call.tensors)
    padding = head_padding.for_pass(p, call.tensors, "fwd")
    attention = dispatch.plan_fwd(p, call.arch, {**call.tensors, **padding.substitutes})
    plan, launches = _recorded(record, call, _with_work(padding.before + attention + padding.after),
                               call.inputs, outputs, scratch_arg, scratch)
    executor.run(call.device, call.arch, launches, call.stream)
    del keep_alive  # the scratch is freed stream-ordered, after the launches
    return finish_outputs(call.template, tuple(arrays), call.stream), plan


_COMMON = dict(softmax_scale=None, causal=False, window=(-1, -1), mask_type=None, causal_alignment="top_left",
               bias=None, alibi_slopes=None, dropout_p=0.0, seed=None, offset=0, stream=None)


def _options(given: dict) -> dict:
    if not given:
        return _COMMON  # never written to: every call merges into a dict of its own
    if not _COMMON.keys() >= given.keys():
        unknown = set(given) - set(_COMMON)
        raise FmhaTypeError(f"unexpected keyword argument(s): {', '.join(sorted(unknown))}")
    return {**_COMMON, **given}


# ------------------------------------------------------------------------------------------ plan cache

PLANS = plan_cache.PlanCache()
# Option values of these types are keys as they are (with their type: True and 1 validate differently);
# a call with an option of any other type is validated and planned every time.
_KEY_TYPES = frozenset({int, float, bool, str, type(None)})


def clear_plan_cache() -> None:
    """Forget every cached plan (the next call of each signature validates and plans again)."""
    PLANS.clear()


def plan_cache_info() -> dict:
    """Entries, capacity, hits and misses of the plan cache."""
    return PLANS.info()


def _option_values(opts: dict) -> tuple:
    window = opts["window"]
    return (opts["softmax_scale"], opts["causal"], window[0], window[1], opts["mask_type"], opts["causal_alignment"],
            opts["dropout_p"])


class _Site:
    """A public function as the plan cache sees it: its name, which starts every key it makes, the names
    of the arrays it passes (in the order it passes them, which is the key's and the value array's), the
    positions among them of varlen offsets (NumPy offsets are checked on the host every call) and its
    planned path, planned(objects, scalars, opts, workspace_alloc, handle, imported, record) ->
    (outputs, CallPlan or None), which validates and plans a call the cache cannot run."""

    __slots__ = ("name", "names", "offsets", "planned")

    def __init__(self, name: str, names: tuple, planned, offsets: tuple = ()):
        self.name, self.names, self.planned, self.offsets = name, names, planned, offsets


def _request(site: _Site, objects: tuple, opts: dict, scalars: tuple, handle: int, buffers):
    """(key, objects, their names, imported Args) of a call for the plan cache, or None when the call
    cannot be keyed (then it is validated and planned every time, which raises any error precisely).
    The objects and names are `objects` and site.names, with a seed array after them when one is given;
    buffers.values gets their addresses in that order (arrays.signatures).

    The key holds the function, its scalars (each of the one type validation accepts at its position:
    the caller leaves other calls uncached), every array's description (not its address) and every
    option that decides validation or the plan, each with its type. Left out are the stream, return_lse
    and, when dropout is off, seed and offset (none of them reach validation or the plan); with
    dropout on, a seed by value and the offset are per-call values (replay validates them again). A
    call that gives no option keys by the function (and scalars) alone: a string, whose hash Python
    keeps, or a pair."""
    names = site.names
    try:
        if opts is _COMMON:
            function = (site.name, scalars) if scalars else site.name
        else:
            window, dropout_p, seed = opts["window"], opts["dropout_p"], opts["seed"]
            if type(window) not in (tuple, list) or len(window) != 2:
                return None
            option_values = _option_values(opts)
            types = tuple(map(type, option_values))
            if not _KEY_TYPES.issuperset(types):
                return None
            seed_kind = None if dropout_p == 0 else "value" if type(seed) is int else "array"
            if seed_kind == "array":
                objects, names = (*objects, seed), (*names, "seed")
            function = (site.name, scalars, (type(window), seed_kind, option_values, types))
        description, imported = signatures(objects, names, handle, buffers.values, buffers.address)
        # the shim describes GPU arrays alone (torch tensors, interface arrays): only a tuple can hold NumPy offsets
        if site.offsets and type(description) is not bytes and _host_seqlens(*(objects[i] for i in site.offsets)):
            return None
        return (function, description), objects, names, imported
    except Exception:  # noqa: BLE001 - a value no signature describes: the slow path says what is wrong
        return None


def _dispatch(site: _Site, objects: tuple, opts: dict, scalars: tuple, workspace_alloc=None, cacheable=True):
    """Run a call from the plan cache when its signature is there, else through site.planned, keeping
    the plan it recorded."""
    runtime = backend.runtime()
    stream = opts["stream"]
    handle = 0 if stream is None else stream_handle(stream, backend=runtime.backend)
    buffers = plan_cache.thread_buffers()
    request = _request(site, objects, opts, scalars, handle, buffers) if cacheable else None
    imported = {}
    if request is not None:
        key, objects, names, imported = request
        try:
            plan = PLANS.get(key, runtime, registry())
        except TypeError:  # an unhashable option value
            plan = request = None
        if plan is not None:
            if plan.philox_by_value:
                _write_philox(plan, buffers.values, opts, handle)
            return plan_cache.replay(plan, objects, buffers.values, buffers.failed, handle, workspace_alloc)
    record = request is not None and PLANS.admit(key)
    outputs, plan = site.planned(objects, scalars, opts, workspace_alloc, handle, imported, names if record else None)
    if plan is not None:
        PLANS.put(key, plan)
    return outputs


def _write_philox(plan, values, opts: dict, handle: int) -> None:
    """A seed and offset given by value: validated again (they are not in the key), then written in."""
    drop, _ = _dropout(opts["dropout_p"], opts["seed"], opts["offset"], handle)
    by_name = plan_cache.CallValues(values, plan.index)
    for name, value in plan_cache.philox_values(drop["philox_seed"], drop["philox_offset"]).items():
        by_name[name] = value


def _host_seqlens(*arrays) -> bool:
    """NumPy offsets are checked on the host and uploaded on every call: such calls are never cached."""
    return any(isinstance(a, np.ndarray) for a in arrays)


# ------------------------------------------------------------------------------------------ public API

def _fwd_planned(objects, scalars, opts, workspace_alloc, handle, imported, record):
    """mha_fwd validated and planned; `objects` in _FWD's order."""
    q, k, v, out, lse = objects[:5]
    call = _prepare(q, k, v, varlen=False, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
                    seqstart_q=None, seqstart_k=None, deterministic=False, handle=handle, imported=imported, **opts)
    return _forward(call, out, lse, record)


def _varlen_fwd_planned(objects, scalars, opts, workspace_alloc, handle, imported, record):
    """mha_varlen_fwd validated and planned; `objects` in _VARLEN_FWD's order, `scalars` the max seqlens."""
    q, k, v, cu_seqlens_q, cu_seqlens_k, seqstart_q, seqstart_k, out, lse = objects[:9]
    max_seqlen_q, max_seqlen_k = scalars
    call = _prepare(q, k, v, varlen=True, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                    max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, seqstart_q=seqstart_q,
                    seqstart_k=seqstart_k, deterministic=False, handle=handle, imported=imported, **opts)
    return _forward(call, out, lse, record)


_OFFSETS = ("cu_seqlens_q", "cu_seqlens_k", "seqstart_q", "seqstart_k")
_SCORE_TERMS = ("bias", "alibi_slopes")
_FWD = _Site("mha_fwd", ("q", "k", "v", "out", "lse", *_SCORE_TERMS), _fwd_planned)
_VARLEN_FWD = _Site("mha_varlen_fwd", ("q", "k", "v", *_OFFSETS, "out", "lse", *_SCORE_TERMS), _varlen_fwd_planned,
                    (3, 4, 5, 6))


def mha_fwd(q, k, v, *, return_lse=True, out=None, lse=None, **options):
    """Attention forward. q [B, Sq, Hq, D], k [B, Sk, Hk, D], v [B, Sk, Hk, Dv] (fp16 or bf16, last dim
    contiguous). Returns (out [B, Sq, Hq, Dv], lse fp32 [B, Hq, Sq]), or out alone with return_lse=False.

    Options: softmax_scale (default 1/sqrt(D)), causal, window=(left, right) (-1 unbounded),
    causal_alignment 'top_left' | 'bottom_right', mask_type (AITER/TE integers 0..3 instead of causal),
    bias [1|B, 1|Hq, Sq, Sk], alibi_slopes fp32 [Hq] or [B, Hq], dropout_p with seed (int or a device
    int64 [seed, offset]) and offset, stream (None, an int handle, or a stream object).
    """
    opts = _options(options)
    out_arr, lse_arr = _dispatch(_FWD, (q, k, v, out, lse, opts["bias"], opts["alibi_slopes"]), opts, ())
    return (out_arr, lse_arr) if return_lse else out_arr


def mha_varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, seqstart_q=None,
                   seqstart_k=None, return_lse=True, out=None, lse=None, **options):
    """Variable-length forward: q [total_q, Hq, D], k/v [total_k, Hk, D], cu_seqlens int32 [B + 1] on the
    GPU (logical lengths; or NumPy integer arrays, checked on the host and copied), optional seqstart_q/k
    [B + 1] like them (physical starts in padded layouts).
    max_seqlen_q/k must bound every sequence. Returns (out [total_q, Hq, Dv], lse fp32 [Hq, total_q])."""
    opts = _options(options)
    objects = (q, k, v, cu_seqlens_q, cu_seqlens_k, seqstart_q, seqstart_k, out, lse, opts["bias"], opts["alibi_slopes"])
    out_arr, lse_arr = _dispatch(_VARLEN_FWD, objects, opts, (max_seqlen_q, max_seqlen_k),
                                 cacheable=_ints(max_seqlen_q, max_seqlen_k))
    return (out_arr, lse_arr) if return_lse else out_arr


class BwdLauncher:
    """The backward of one problem: what it needs (workspace bytes, zeroing, dQ splits) is known on the
    host from the problem alone; `run` launches it."""

    def __init__(self, problem: AttentionProblem, arch: str):
        self.problem, self.arch = problem, arch
        self.workspace = dispatch.bwd_workspace(problem, arch)

    @property
    def workspace_size(self) -> int:
        return self.workspace.total_bytes

    @property
    def needs_zero_init(self) -> bool:
        return self.workspace.needs_zeroing

    @property
    def dq_acc_splits(self) -> int:
        return self.workspace.dq_splits

    def prepare_workspace(self, buf: Arg, tensors: dict) -> None:
        """Carve the workspace regions out of `buf` into the call's tensors."""
        carve(self.workspace, buf, tensors)

    def plan(self, tensors: dict) -> list:
        """The launches of this backward on `tensors` (arrays and workspace regions), with the copies
        into and out of zero-padded workspace buffers for head dims that are not multiples of 8."""
        padding = head_padding.for_pass(self.problem, tensors, "bwd")
        attention = dispatch.plan_bwd(self.problem, self.arch, {**tensors, **padding.substitutes})
        return _with_work(padding.before + attention + padding.after)

    def run(self, device: int, tensors: dict, stream: int, launches=None) -> list[str]:
        """Plan (unless `launches` are planned already), check and pack every launch; only then zero the
        regions that must start at zero (so a refused call writes no memory at all) and launch. Returns
        the variant keys launched."""
        launches = self.plan(tensors) if launches is None else launches

        def zero_regions():
            for region in self.workspace.regions:
                if region.zero_init:
                    backend.memset(device, tensors[region.name].address, 0, region.nbytes, stream)

        # a cached plan's launches zero the regions themselves, after their own checks
        ready = isinstance(launches, Ready)
        return list(executor.run(device, self.arch, launches, stream, before_launch=None if ready else zero_regions))


def _backward(call: _Call, dout, out, lse, dq, dk, dv, dbias, workspace_alloc, record):
    """Run a validated backward; returns ((dq, dk, dv[, dbias]), its CallPlan when `record` asks)."""
    p = call.problem
    dtype = call.inputs[0].dtype
    do_arg = call.array("dout", dout, dtypes=(dtype,))
    check_shape(do_arg, _out_shape(p, p.head_dim_v))
    o_arg = call.array("out", out, dtypes=(dtype,))
    check_shape(o_arg, _out_shape(p, p.head_dim_v))
    l_arg = call.array("lse", lse, dtypes=("float32",))
    check_shape(l_arg, _lse_shape(p))
    _same_device(call.inputs + [do_arg, o_arg, l_arg])
    for name, a in (("dout", do_arg), ("out", o_arg), ("lse", l_arg)):
        _put(call.tensors, name, a)
    inputs = call.inputs + [do_arg, o_arg, l_arg]
    specs = [("dq", dq, _out_shape(p, p.head_dim_qk), dtype), ("dk", dk, _kv_shape(p, p.head_dim_qk), dtype),
             ("dv", dv, _kv_shape(p, p.head_dim_v), dtype)]
    if p.bias_grad:
        bias_arg = next(a for a in call.inputs if a.name == "bias")
        specs.append(("dbias", dbias, tuple(bias_arg.shape), dtype))
    arrays, outputs = _outputs(call, specs, inputs)
    launcher = BwdLauncher(p, call.arch)
    keep_alive, ws_arg = acquire_workspace(call.device, call.stream, launcher.workspace_size, launcher.needs_zero_init,
                                           workspace_alloc)
    if ws_arg is not None:
        check_overlap([ws_arg], inputs + [o[0] for o in outputs])
    launcher.prepare_workspace(ws_arg, call.tensors)
    plan, launches = _recorded(record, call, launcher.plan(call.tensors), inputs, outputs, ws_arg, launcher.workspace)
    launcher.run(call.device, call.tensors, call.stream, launches)
    del keep_alive  # a workspace we allocated is freed stream-ordered, after the launches
    return finish_outputs(call.template, tuple(arrays), call.stream), plan


def _dispatch_backward(site, arrays, opts, scalars, workspace_alloc, cacheable):
    """_dispatch for a backward: its key adds whether a workspace_alloc is given."""
    return _dispatch(site, (*arrays, opts["bias"], opts["alibi_slopes"]), opts, (*scalars, workspace_alloc is None),
                     workspace_alloc, cacheable)


def _ints(*values) -> bool:
    """Whether scalars that validation takes as ints are keyable: of type int exactly (True == 1 and
    1.0 == 1 would key alike; an int subclass is just validated every time)."""
    return all(type(value) is int for value in values)


def _bwd_planned(objects, scalars, opts, workspace_alloc, handle, imported, record):
    """mha_bwd validated and planned; `objects` in _BWD's order, `scalars` (deterministic, ...)."""
    dout, q, k, v, out, lse, dq, dk, dv, dbias = objects[:10]
    call = _prepare(q, k, v, varlen=False, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
                    seqstart_q=None, seqstart_k=None, deterministic=scalars[0], bias_grad=True, handle=handle,
                    imported=imported, **opts)
    return _backward(call, dout, out, lse, dq, dk, dv, dbias, workspace_alloc, record)


def _varlen_bwd_planned(objects, scalars, opts, workspace_alloc, handle, imported, record):
    """mha_varlen_bwd validated and planned; `objects` in _VARLEN_BWD's order, `scalars` (deterministic,
    max_seqlen_q, max_seqlen_k, ...)."""
    dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqstart_q, seqstart_k, dq, dk, dv = objects[:13]
    deterministic, max_seqlen_q, max_seqlen_k = scalars[:3]
    call = _prepare(q, k, v, varlen=True, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                    max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, seqstart_q=seqstart_q,
                    seqstart_k=seqstart_k, deterministic=deterministic, handle=handle, imported=imported, **opts)
    return _backward(call, dout, out, lse, dq, dk, dv, None, workspace_alloc, record)


_BWD = _Site("mha_bwd", ("dout", "q", "k", "v", "out", "lse", "dq", "dk", "dv", "dbias", *_SCORE_TERMS), _bwd_planned)
_VARLEN_BWD = _Site("mha_varlen_bwd", ("dout", "q", "k", "v", "out", "lse", *_OFFSETS, "dq", "dk", "dv", *_SCORE_TERMS),
                    _varlen_bwd_planned, (6, 7, 8, 9))


def mha_bwd(dout, q, k, v, out, lse, *, deterministic=False, dq=None, dk=None, dv=None, dbias=None,
            workspace_alloc=None, **options):
    """Attention backward: (dq, dk, dv), plus dbias (in the bias's shape) when a bias is given.

    Takes the forward's options (the same mask, bias, dropout seed/offset). deterministic=True gives
    bitwise-identical results across runs, streams and thread counts. workspace_alloc(nbytes, zero_init)
    may supply the scratch memory (an array or fmha_rt.Pointer, possibly uninitialised): fmha_rt zeroes
    the parts that must start at zero on the call's stream, which zero_init announces.
    """
    # deterministic keys as a bool: validation refuses anything else
    return _dispatch_backward(_BWD, (dout, q, k, v, out, lse, dq, dk, dv, dbias), _options(options), (deterministic,),
                              workspace_alloc, type(deterministic) is bool)


def mha_varlen_bwd(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                   seqstart_q=None, seqstart_k=None, deterministic=False, dq=None, dk=None, dv=None,
                   workspace_alloc=None, **options):
    """Variable-length backward: arrays as in mha_varlen_fwd; returns (dq, dk, dv)."""
    arrays = (dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqstart_q, seqstart_k, dq, dk, dv)
    return _dispatch_backward(_VARLEN_BWD, arrays, _options(options), (deterministic, max_seqlen_q, max_seqlen_k),
                              workspace_alloc, type(deterministic) is bool and _ints(max_seqlen_q, max_seqlen_k))


def bwd_workspace_bytes(q, k, v, *, deterministic=False, **options) -> int:
    """Workspace bytes mha_bwd would request for these inputs (nothing is launched)."""
    opts = _options(options)
    call = _prepare(q, k, v, varlen=False, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
                    seqstart_q=None, seqstart_k=None, deterministic=deterministic, bias_grad=True, **opts)
    return BwdLauncher(call.problem, call.arch).workspace_size


def release_workspaces() -> None:
    """Free what fmha_rt keeps per stream: the workspaces of backwards without a workspace_alloc (each
    on its own stream, after the work queued there, so its streams must still exist; the next such
    call on a stream allocates anew) and the launch graphs of cached calls (made again on next use).
    Call it before destroying a stream such calls ran on: a later stream may get the same handle, and
    its calls would take the buffer without waiting for the old stream's."""
    backend.check(backend.lib.fmha_workspaces_release(), "fmha_workspaces_release")
    backend.check(backend.lib.fmha_launch_graphs_release(), "fmha_launch_graphs_release")


def mha_dropout_mask(q, k, *, dropout_p, seed, offset=0, stream=None, out=None):
    """The dropout keep mask (uint8 [B, Hq, Sq, Sk], 1 = kept) that mha_fwd/mha_bwd use for these
    shapes, seed and offset: for tests and debugging (never cached)."""
    rt = backend.runtime()
    handle = stream_handle(stream, backend=rt.backend)
    call = _prepare(q, k, k, varlen=False, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
                    seqstart_q=None, seqstart_k=None, deterministic=False,
                    **{**_COMMON, "dropout_p": dropout_p, "seed": seed, "offset": offset, "stream": stream})
    p = call.problem
    (mask_arr,), _ = _outputs(call, [("mask", out, (p.batch, p.heads_q, p.seqlen_q, p.seqlen_k), "uint8")],
                              call.inputs)
    executor.run(call.device, call.arch, _with_work(portable.plan_dropout_mask(p, call.arch, call.tensors)), handle)
    return finish_outputs(call.template, (mask_arr,), handle)[0]
