"""Memory a call needs besides its arrays, laid out as data: one scratch buffer carved into regions at
WORKSPACE_ALIGN-aligned offsets (the forward's `fwd_scratch`, the backward's workspace), and the
zero-padded copies of tensors whose head dim is not a multiple of 8 (`padded_tensors`), which are
regions of that buffer.

Head dims run in power-of-two tiles, and the kernels take head dims in units of 8 (so that their column
masks allow 16-byte loads): a head dim that is not a multiple of 8 runs as `padded_head_dim(d)` on
copies of that width (head_padding.py plans the copies).
"""
import math
from dataclasses import dataclass

from fmha_rt.errors import FmhaValueError

from .abi import DQ_ATOMIC, DQ_ORDERED, DQ_SINGLE

WORKSPACE_ALIGN = 256
ELEMENT_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2, "i32": 4}


@dataclass(frozen=True)
class WorkspaceRegion:
    name: str
    offset: int  # bytes from the workspace start, a multiple of WORKSPACE_ALIGN
    nbytes: int
    zero_init: bool  # must hold zeros when the backward starts
    shape: tuple  # elements of dtype, C-contiguous
    dtype: str = "fp32"


@dataclass(frozen=True)
class Scratch:
    """One scratch buffer carved into regions: the forward's padding scratch, or the backward's workspace."""

    regions: tuple
    total_bytes: int

    @property
    def needs_zeroing(self) -> bool:
        return any(r.zero_init for r in self.regions)

    def region(self, name):
        for r in self.regions:
            if r.name == name:
                return r
        raise KeyError(name)


@dataclass(frozen=True)
class Workspace(Scratch):
    dq_strategy: str
    # fp32 dQ accumulators the backward adds into, then converts into dQ: 1 for ATOMIC (added by atomics) and
    # ORDERED (added in key-block order), 0 where dQ is written directly in its dtype
    dq_splits: int


def ceil8(n: int) -> int:
    """n rounded up to a multiple of 8."""
    return -(-n // 8) * 8


def padded_head_dim(d: int) -> int:
    """The width a head dim of d runs at: the next multiple of 8."""
    return ceil8(d)


def contiguous_strides(shape) -> tuple:
    """Element strides of a C-contiguous array of `shape`."""
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= n
    return tuple(reversed(strides))


def lay_out(wanted) -> tuple:
    """(name, shape, zero_init, dtype) -> (regions at WORKSPACE_ALIGN-aligned offsets, total bytes)."""
    regions, offset = [], 0
    for name, shape, zero, dtype in wanted:
        nbytes = ELEMENT_BYTES[dtype] * math.prod(shape)
        regions.append(WorkspaceRegion(name, offset, nbytes, zero, shape, dtype))
        offset += -(-nbytes // WORKSPACE_ALIGN) * WORKSPACE_ALIGN
    return tuple(regions), offset


# ------------------------------------------------------------------------------ the backward's


def _rows_shape(problem, per_row):
    """fp32 workspace shaped like q's rows: [B, Sq, Hq, per_row] or [total_q, Hq, per_row]."""
    lead = (problem.total_q,) if problem.varlen else (problem.batch, problem.seqlen_q)
    return lead + (problem.heads_q, per_row)


def _delta_shape(problem):
    """Per-row statistics: [B, Hq, ceil8(Sq)], or [Hq, ceil8(total_q) + 8 * B] in varlen mode, where sequence b
    starts at row 8 * (q_start // 8 + b) (the kernels' row_stats_start): every sequence starts at a multiple
    of 8 rows, so that the kernels' loads of a block's rows vectorise."""
    if problem.varlen:
        return (problem.heads_q, ceil8(problem.total_q) + 8 * problem.batch)
    return (problem.batch, problem.heads_q, ceil8(problem.seqlen_q))


def _ds_shape(problem):
    """dS of the bias gradient, rows padded to 8 keys: [B, Hq, Sq, ceil8(Sk)]."""
    return (problem.batch, problem.heads_q, problem.seqlen_q, ceil8(problem.seqlen_k))


def backward_workspace(problem, strategy, extra=()) -> Workspace:
    """The backward's workspace for dQ strategy `strategy`, with `extra` regions (name, shape,
    zero_init, dtype: a family's own, such as the v3 kernels' descriptors) after the strategy's and
    before the padding buffers. Regions at 256-byte aligned offsets:

    fp32: delta and lse2 [B, Hq, ceil8(Sq)] (Delta = rowsum(dO * O) and the LSE in the log2 domain, which the
    first pass writes for dK/dV; every strategy but SINGLE, whose programs keep their own; _delta_shape), dq_acc
    [B, Sq, Hq, ceil8(Dqk)] (ATOMIC and ORDERED strategies, zeroed; the ORDERED strategy's int32 counters come
    in `extra`, their size depending on the family's tile),
    ds [B, Hq, Sq, ceil8(Sk)] (tensor bias with gradient, zeroed: masked blocks are never written).
    Then, in the problem's dtype, one '<name>_padded' buffer per tensor of padded_tensors(problem,
    'bwd') (head dims that are not multiples of 8).
    """
    wanted = []
    if strategy != DQ_SINGLE:
        wanted += [("delta", _delta_shape(problem), False, "fp32"), ("lse2", _delta_shape(problem), False, "fp32")]
    if strategy in (DQ_ATOMIC, DQ_ORDERED):
        wanted.append(("dq_acc", _rows_shape(problem, padded_head_dim(problem.head_dim_qk)), True, "fp32"))
    if problem.bias_grad:
        wanted.append(("ds", _ds_shape(problem), True, "fp32"))
    wanted += list(extra)
    wanted += padding_regions(problem, "bwd")
    regions, total = lay_out(wanted)
    return Workspace(regions, total, strategy, 1 if strategy in (DQ_ATOMIC, DQ_ORDERED) else 0)


def dq_order_region(problem, block_m) -> tuple:
    """The ORDERED strategy's int32 order region (name, shape, zero_init, dtype), zeroed: a work-item ticket
    and one counter per (batch entry, query head, query block of `block_m` rows, the dK/dV kernel's tile),
    as kernels/portable/dq_order.py lays it out."""
    return ("dq_order", (1 + problem.batch * problem.heads_q * -(-problem.seqlen_q // block_m),), True, "i32")


# ------------------------------------------------------------------------------ head-dim padding


@dataclass(frozen=True)
class PaddedTensor:
    """A tensors entry that the attention kernels read or write at the padded head dim."""

    name: str  # the entry it stands in for: 'q', 'dout', 'dk', ...
    head_dim: int
    side: str  # 'q': rows and heads of q (Sq, Hq); 'k': of k and v (Sk, Hk)
    is_output: bool  # written by the attention kernels, then narrowed into the caller's array

    @property
    def region(self) -> str:
        return f"{self.name}_padded"


# (name, head dim 'qk' or 'v', side, is_output) of every tensor a pass reads or writes at its head dim.
_HEAD_DIM_TENSORS = {
    "fwd": (("q", "qk", "q", False), ("k", "qk", "k", False), ("v", "v", "k", False), ("out", "v", "q", True)),
    "bwd": (("q", "qk", "q", False), ("k", "qk", "k", False), ("v", "v", "k", False), ("out", "v", "q", False),
            ("dout", "v", "q", False), ("dq", "qk", "q", True), ("dk", "qk", "k", True), ("dv", "v", "k", True)),
}


def padded_tensors(problem, pass_name) -> list[PaddedTensor]:
    """The tensors of pass 'fwd' or 'bwd' whose head dim is not a multiple of 8 (q, k, dq, dk follow
    Dqk; v, out, dout, dv follow Dv): these run on zero-padded copies."""
    if pass_name not in _HEAD_DIM_TENSORS:
        raise FmhaValueError(f"pass_name must be 'fwd' or 'bwd', got {pass_name!r}")
    dims = {"qk": problem.head_dim_qk, "v": problem.head_dim_v}
    return [PaddedTensor(name, dims[dim], side, is_output)
            for name, dim, side, is_output in _HEAD_DIM_TENSORS[pass_name] if dims[dim] % 8]


def padded_shape(problem, t: PaddedTensor) -> tuple:
    """[B, S, H, Dp] (varlen: [total, H, Dp]) with the rows and heads of t's side."""
    q_side = t.side == "q"
    heads = problem.heads_q if q_side else problem.heads_k
    if problem.varlen:
        lead = (problem.total_q if q_side else problem.total_k,)
    else:
        lead = (problem.batch, problem.seqlen_q if q_side else problem.seqlen_k)
    return lead + (heads, padded_head_dim(t.head_dim))


def padding_regions(problem, pass_name) -> list:
    return [(t.region, padded_shape(problem, t), False, problem.dtype) for t in padded_tensors(problem, pass_name)]


def fwd_scratch(problem, extra=()) -> Scratch:
    """Scratch memory of a forward: one '<name>_padded' region per tensor of padded_tensors(problem,
    'fwd'), then the `extra` regions (name, shape, zero_init, dtype) a family's kernels take; no regions
    (0 bytes) when both head dims are multiples of 8 and there is no extra. Nothing needs zeroing."""
    return Scratch(*lay_out(padding_regions(problem, "fwd") + list(extra)))
