"""Launch programs for XLA: a call's program (program.py, the model the plan cache keeps too), built at
trace time and serialised so that C can run it without Python.

Under jax.jit the shapes of a call are known when it is traced, but its buffers exist only when XLA
runs it. So at trace time fmha_rt.jax plans the call with placeholder pointers, builds its program
(program.build: every launch's arguments packed as usual) and records which argument bytes hold which
buffer's address (a patch's value is a buffer, its addend a byte offset into it); at run time the XLA
FFI handler (fmha_rt/csrc/xla_ffi.c) loads the program's words (program.c), writes the real addresses
in, zeroes the workspace regions that must start at zero, and launches.

A program's values are the call's buffers, numbered operands first, then results, as XLA passes them
to the handler.
"""
from __future__ import annotations

import dataclasses
import math


from ..errors import FmhaValueError
from ..plan import dispatch, layout
from ..plan.operands import Operand, Operands, Philox
from ..runtime.packing import NULL, Pointer, pointer_value
from ..runtime.registry import registry
from . import program
from .program import LaunchProgram, ZeroFill

ITEM_BYTES = {"bool": 1, "int8": 1, "int16": 2, "int32": 4, "int64": 8, "uint8": 1, "uint32": 4, "float16": 2,
              "float32": 4, "bfloat16": 2}
ATTENTION_DTYPES = {"fp16": "float16", "bf16": "bfloat16"}
# A placeholder pointer is (buffer + 1) << 40 | offset: never NULL, 16-byte aligned when the offset is,
# and it decodes back to (buffer, offset). 2**40 bytes is far above any buffer of one call.
_PLACEHOLDER_SHIFT = 40
_OFFSET_MASK = (1 << _PLACEHOLDER_SHIFT) - 1
MAX_BUFFERS = program.MAX_VALUES  # a call's buffers are its program's values


def placeholder(buffer: int, offset: int = 0) -> Pointer:
    """The pointer that stands for byte `offset` of buffer `buffer` while planning."""
    if not 0 <= buffer < MAX_BUFFERS or not 0 <= offset <= _OFFSET_MASK:
        raise FmhaValueError(f"placeholder for buffer {buffer} + {offset} is out of range")
    return Pointer((buffer + 1) << _PLACEHOLDER_SHIFT | offset)


def resolve_placeholder(address: int, buffers: int, where: str) -> tuple[int, int]:
    buffer, offset = (address >> _PLACEHOLDER_SHIFT) - 1, address & _OFFSET_MASK
    if not 0 <= buffer < buffers:
        raise FmhaValueError(f"{where}: pointer 0x{address:x} is not a placeholder of one of the call's "
                             f"{buffers} buffers")
    return buffer, offset


@dataclasses.dataclass(frozen=True)
class Buffer:
    """One operand or result of the call: C-contiguous (XLA's default layout)."""

    name: str
    shape: tuple
    dtype: str  # NumPy name: "bfloat16", "float32", "int32", ...

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * ITEM_BYTES[self.dtype]

    @property
    def strides(self) -> tuple:
        """In elements."""
        return tuple(math.prod(self.shape[i + 1:]) for i in range(len(self.shape)))


# ------------------------------------------------------------------ the calls fmha_rt.jax makes


@dataclasses.dataclass(frozen=True)
class Planned:
    """A call planned with placeholder pointers, before `build` packs it: launches are
    plan.args.Launch (every argument by name)."""

    label: str
    buffers: tuple  # Buffer, operands first
    operands: int
    zero_fills: tuple
    launches: tuple

    @property
    def results(self) -> tuple:
        return self.buffers[self.operands:]

    def build(self, arch: str) -> LaunchProgram:
        """The program of these launches (those with an empty grid left out: the drivers refuse them), each
        pointer slot's value the buffer its placeholder names."""
        if len(self.buffers) > MAX_BUFFERS:
            raise FmhaValueError(f"{self.label}: {len(self.buffers)} buffers, the handler takes at most {MAX_BUFFERS}")
        reg = registry()
        launches = [launch for launch in self.launches if all(launch.grid)]
        entries = [reg.entry(arch, launch.variant) for launch in launches]

        def sources_of(entry, launch) -> dict:
            return {slot.name: resolve_placeholder(address, len(self.buffers), f"{entry.key} {slot.name}")
                    for slot in entry.params if slot.type == "ptr"
                    for address in (pointer_value(slot.name, launch.args.get(slot.name, NULL)),) if address}

        return program.build(self.label, entries, launches, sources_of, self.buffers, self.operands, self.zero_fills)


def placeholder_operands(buffers) -> Operands:
    """Plan inputs: each buffer's placeholder as the operand of its name (the Philox buffer as the
    dropout's device [seed, offset]); the workspace's regions are _workspace_result's."""
    operands = Operands()
    for i, b in enumerate(buffers):
        if b.name == PHILOX_BUFFER:
            operands.philox = Philox(pointer=placeholder(i))
        elif b.name != WORKSPACE_BUFFER:
            setattr(operands, b.name, Operand(b.name, placeholder(i), b.strides))  # a buffer is named as its field
    return operands


def _inputs(problem) -> list:
    dtype = ATTENTION_DTYPES[problem.dtype]
    q_shape = problem.query_shape(problem.head_dim_qk)
    buffers = [Buffer("q", q_shape, dtype), Buffer("k", problem.key_shape(problem.head_dim_qk), dtype),
               Buffer("v", problem.key_shape(problem.head_dim_v), dtype)]
    if problem.varlen:
        buffers += [Buffer(f"cu_seqlens_{s}", (problem.batch + 1,), "int32") for s in ("q", "k")]
    return buffers


def bias_shape(problem) -> tuple:
    """The bias buffer (and dbias result) of a problem with a bias: [1|B, 1|Hq, Sq, ceil8(Sk)]. Rows are
    padded to a multiple of 8 keys (the kernels' row strides are multiples of 8 elements); the caller
    pads the bias's rows and cuts the padding off dbias, whose padding columns are never written."""
    p = problem
    return (p.batch if p.bias_shape[0] == "B" else 1, p.heads_q if p.bias_shape[1] == "H" else 1, p.seqlen_q,
            layout.ceil8(p.seqlen_k))


PHILOX_WORDS = 4  # the int64 pair [seed, offset] as four little-endian uint32 words: no int64 in JAX needed
PHILOX_BUFFER = "philox_seed_offset"  # the operand buffer of those words
WORKSPACE_BUFFER = "workspace"  # the result buffer of the call's scratch


def _score_terms(problem) -> list:
    """Operands after the inputs: bias (in q's dtype), ALiBi slopes (float32 [Hq] or [B, Hq]) and the
    dropout's Philox [seed, offset], each when the problem has it."""
    p = problem
    buffers = []
    if p.bias_shape is not None:
        buffers.append(Buffer("bias", bias_shape(p), ATTENTION_DTYPES[p.dtype]))
    if p.alibi is not None:
        buffers.append(Buffer("alibi", (p.heads_q,) if p.alibi == "H" else (p.batch, p.heads_q), "float32"))
    if p.has_dropout:
        buffers.append(Buffer(PHILOX_BUFFER, (PHILOX_WORDS,), "uint32"))
    return buffers


def label(problem, pass_name: str) -> str:
    p = problem
    shape = f"total_q={p.total_q} total_k={p.total_k} B={p.batch}" if p.varlen else f"B={p.batch}"
    mask = f" window=({p.window_left}, {p.window_right}){' bottom_right' if p.bottom_right else ''}"
    terms = (f"{f' bias={p.bias_shape}' if p.bias_shape else ''}{f' alibi={p.alibi}' if p.alibi else ''}"
             f"{f' dropout={p.dropout_p:g}' if p.has_dropout else ''}")
    return (f"{'varlen ' if p.varlen else ''}{pass_name} {p.dtype} {shape} Sq={p.seqlen_q} Sk={p.seqlen_k} "
            f"Hq={p.heads_q} Hk={p.heads_k} D={p.head_dim_qk} Dv={p.head_dim_v}{mask}{terms}")


def _workspace_result(buffers: list, operands: Operands, scratch) -> list:
    """Appends the call's scratch (a forward's or a backward's workspace) as a last result, uint8, when
    it has bytes, with each region's placeholder in the regions of `operands`; returns the zero fills of
    its regions that must start at zero."""
    if not scratch.total_bytes:
        return []
    index = len(buffers)
    buffers.append(Buffer(WORKSPACE_BUFFER, (scratch.total_bytes,), "uint8"))
    fills = []
    for region in scratch.regions:
        operands.regions[region.name] = placeholder(index, region.offset)
        if region.zero_init:
            fills.append(ZeroFill(index, region.offset, region.nbytes))
    return fills


def planned_forward(problem, arch: str) -> Planned:
    """Operands q, k, v (+ cu_seqlens_q, cu_seqlens_k) (+ bias) (+ alibi) (+ philox_seed_offset);
    results out, lse and, when the plan needs scratch (the v3 forward's TMA descriptors), the workspace
    (uint8)."""
    dtype = ATTENTION_DTYPES[problem.dtype]
    inputs = _inputs(problem) + _score_terms(problem)
    buffers = inputs + [Buffer("out", problem.query_shape(problem.head_dim_v), dtype),
                        Buffer("lse", problem.lse_shape(), "float32")]
    operands = placeholder_operands(buffers)
    fills = _workspace_result(buffers, operands, dispatch.fwd_scratch(problem, arch))
    launches = dispatch.plan_fwd(problem, arch, operands)
    return Planned(label(problem, "forward"), tuple(buffers), len(inputs), tuple(fills), tuple(launches))


def planned_backward(problem, arch: str) -> Planned:
    """Operands dout, q, k, v, out, lse (+ cu_seqlens_q, cu_seqlens_k) (+ bias) (+ alibi)
    (+ philox_seed_offset); results dq, dk, dv, dbias (in the bias buffer's shape) when the problem has
    bias_grad and, when the plan needs one, the workspace (uint8), whose zero_init regions the handler
    zeroes."""
    dtype = ATTENTION_DTYPES[problem.dtype]
    q, k, v, *seqlens = _inputs(problem)
    inputs = [Buffer("dout", problem.query_shape(problem.head_dim_v), dtype), q, k, v,
              Buffer("out", problem.query_shape(problem.head_dim_v), dtype),
              Buffer("lse", problem.lse_shape(), "float32"), *seqlens, *_score_terms(problem)]
    buffers = inputs + [Buffer("dq", problem.query_shape(problem.head_dim_qk), dtype),
                        Buffer("dk", problem.key_shape(problem.head_dim_qk), dtype),
                        Buffer("dv", problem.key_shape(problem.head_dim_v), dtype)]
    if problem.bias_grad:
        buffers.append(Buffer("dbias", bias_shape(problem), dtype))
    operands = placeholder_operands(buffers)
    fills = _workspace_result(buffers, operands, dispatch.bwd_workspace(problem, arch))
    launches = dispatch.plan_bwd(problem, arch, operands)
    return Planned(label(problem, "backward"), tuple(buffers), len(inputs), tuple(fills), tuple(launches))


def forward(problem, arch: str) -> LaunchProgram:
    """The forward's program (planned_forward, packed)."""
    return planned_forward(problem, arch).build(arch)


def backward(problem, arch: str) -> LaunchProgram:
    """The backward's program (planned_backward, packed)."""
    return planned_backward(problem, arch).build(arch)
