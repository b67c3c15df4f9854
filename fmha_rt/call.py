"""A call validated and made ready to plan: its problem, device, stream, the caller's arrays (imported
through DLPack or read from their attributes) and its operands (plan.operands.Operands: each array's
pointer and strides, the dropout seed and offset, the regions of its scratch). Outputs the caller did
not give are allocated like q, after every check has passed.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from .arrays import ATTN_DTYPES, Arg, allocate_like, check_overlap, check_shape, gpu_array
from .errors import FmhaTypeError, FmhaValueError
from .plan.operands import Operand, Operands, Philox
from .plan.problem import AttentionProblem
from .runtime import backend
from .runtime.buffers import DeviceBuffer
from .runtime.packing import Pointer
from .runtime.streams import stream_handle
from .validation import (INT32_LIMIT, alibi_shape_name, attention_dtype, batch_dims, bias_shape_name, check_bool,
                         check_dropout_p, check_one_score_term, check_sizes, check_softmax_scale, resolve_mask, same_device)


def dropout_values(dropout_p, seed, offset, stream, imported=None) -> tuple[Philox | None, list]:
    """Dropout options -> (the Philox values, None without dropout; the device array they are read
    from, if any). seed: an int, or a device array of two int64 (seed, offset) for graph capture;
    offset: the Philox offset (ignored when seed is an array)."""
    if check_dropout_p(dropout_p) == 0.0:
        return None, []
    if seed is None:
        raise FmhaValueError("dropout_p > 0 needs seed= (an int, or a device int64 array [seed, offset]); "
                             "pass the same seed and offset to the backward")
    if isinstance(seed, int) and not isinstance(seed, bool):
        if isinstance(offset, bool) or not isinstance(offset, int) or not 0 <= offset < 2**63:
            raise FmhaValueError(f"offset must be an int in [0, 2^63), got {offset!r}")
        return Philox(seed=seed, offset=offset), []
    arg = gpu_array("seed", seed, stream, dtypes=("int64",), arg=(imported or {}).get("seed"))
    if tuple(arg.shape) != (2,):
        raise FmhaValueError(f"a seed array must hold two int64 (seed, offset), got shape {tuple(arg.shape)}")
    return Philox(pointer=arg.pointer), [arg]


def operand(name, arg: Arg) -> Operand:
    """An imported array as the operand `name` of the kernels: its pointer and its strides."""
    return Operand(name, arg.pointer, tuple(arg.strides))


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
class Call:
    """A validated call: the problem, the device, its operands and the caller's arrays."""

    problem: AttentionProblem
    device: int
    arch: str
    stream: int
    operands: Operands
    inputs: list
    template: object
    imported: dict  # Args the plan-cache key imported already, by argument name

    def array(self, name, obj, **checks) -> Arg:
        return gpu_array(name, obj, self.stream, arg=self.imported.get(name), **checks)


def prepare(q, k, v, *, varlen, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqstart_q, seqstart_k,
             softmax_scale, causal, window, mask_type, causal_alignment, bias, alibi_slopes, dropout_p, seed,
             offset, deterministic, stream, bias_grad=False, handle=None, imported=None) -> Call:
    """Validate a call. `handle`: its stream's handle, when the caller has it; `imported`: arrays the
    caller imported already (plan_cache key), by argument name."""
    if handle is None:
        handle = stream_handle(stream, backend=backend.runtime().backend)
    imported = imported or {}

    def array(name, obj, **checks):
        return gpu_array(name, obj, handle, arg=imported.get(name), **checks)

    rank = 3 if varlen else 4
    qa, ka, va = (array(n, x, rank=rank, dtypes=tuple(ATTN_DTYPES)) for n, x in (("q", q), ("k", k), ("v", v)))
    dtype = attention_dtype(qa, ka, va)
    mask = resolve_mask(causal, window, mask_type, causal_alignment)
    inputs = [qa, ka, va]
    operands = Operands()
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
        operands.cu_seqlens_q, operands.cu_seqlens_k = operand("cu_seqlens_q", cq), operand("cu_seqlens_k", ck)
        inputs += [cq, ck]
        if seqstart_q is not None:
            starts = []
            for name, value in (("seqstart_q", seqstart_q), ("seqstart_k", seqstart_k)):
                arg = host.upload(name, qa.device, handle) if host.given else \
                    array(name, value, rank=1, dtypes=("int32",))
                check_shape(arg, cq.shape, " (B + 1 entries, like cu_seqlens)")
                starts.append(operand(name, arg))
                inputs.append(arg)
            operands.seqstart_q, operands.seqstart_k = starts
    else:
        batch, sq, sk, hq, hk, dqk, dv = batch_dims(qa.shape, ka.shape, va.shape)
        tq = tk = None
    check_sizes(sq, sk, hq, hk, dqk, dv)
    bias_shape = alibi = None
    check_one_score_term(bias, alibi_slopes)
    if bias is not None:
        ba = array("bias", bias, rank=4, dtypes=(qa.dtype,))
        bias_shape = bias_shape_name(ba.shape, batch, hq, sq, sk)
        operands.bias = operand("bias", ba)
        inputs.append(ba)
    if alibi_slopes is not None:
        aa = array("alibi_slopes", alibi_slopes, rank=(1, 2), dtypes=("float32",))
        alibi = alibi_shape_name(aa.shape, batch, hq)
        if alibi == "BH" and not 0 <= aa.strides[0] < INT32_LIMIT:
            raise FmhaValueError(f"alibi_slopes batch stride {aa.strides[0]} must be in [0, 2^31)")
        operands.alibi = operand("alibi", aa)
        inputs.append(aa)
    operands.philox, drop_args = dropout_values(dropout_p, seed, offset, handle, imported)
    inputs += drop_args
    check_softmax_scale(softmax_scale)
    check_bool("deterministic", deterministic)
    problem = AttentionProblem(
        batch=batch, seqlen_q=sq, seqlen_k=sk, heads_q=hq, heads_k=hk, head_dim_qk=dqk, head_dim_v=dv, dtype=dtype,
        softmax_scale=softmax_scale, window_left=mask.window_left, window_right=mask.window_right,
        bottom_right=mask.bottom_right, bias_shape=bias_shape, bias_grad=bias_grad and bias is not None, alibi=alibi,
        dropout_p=float(dropout_p), varlen=varlen, total_q=tq, total_k=tk, deterministic=deterministic)
    device = same_device(inputs)
    operands.q, operands.k, operands.v = operand("q", qa), operand("k", ka), operand("v", va)
    return Call(problem, device, backend.device(device).arch, handle, operands, inputs, q, imported)


def resolve_outputs(call: Call, specs, inputs):
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
        setattr(call.operands, name, operand(name, args[name]))  # an output's name is its field's
    return arrays, records


def place_regions(scratch, buf, operands: Operands) -> None:
    """Put the regions of `scratch` (plan.layout.Scratch: a forward's padding scratch or a backward's
    workspace) into the call's operands, as addresses inside `buf` (at 0 when there are no bytes)."""
    base = buf.pointer.address if buf is not None else 0
    for region in scratch.regions:
        operands.regions[region.name] = Pointer(base + region.offset)
