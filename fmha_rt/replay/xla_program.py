"""Launch programs for XLA: a call's program (program.py, the model the plan cache keeps too),
serialised so that C can run it without Python.

Under jax.jit the shapes of a call are known when it is traced, but its buffers exist only when XLA
runs it. So at trace time fmha_rt.jax plans the call with placeholder pointers, packs every launch's
arguments as usual (program.pack_launch), and records which argument bytes hold which buffer's address
(a patch's value is a buffer, its addend a byte offset into it); at run time the XLA
FFI handler (fmha_rt/csrc/xla_ffi.c) copies each template, writes the real addresses in, zeroes the
workspace regions that must start at zero, and launches.

The wire format is an int64 array (the custom call's `program` attribute). `bytes` below is a length
word followed by the bytes packed eight to a word, little-endian:

    magic "FMHAPRG1", format version, operand count, result count, zero-fill count, launch count,
    label (bytes: names the call in error messages),
    per buffer, operands first, then results: XLA dtype number, size in bytes,
    per zero fill: buffer (its value), byte offset, byte count,
    per launch: kernel key (bytes), grid x y z, block x y z, dynamic shared bytes,
                argument template (bytes), patch count,
                per patch: byte offset in the template, buffer (its value), byte offset into the buffer
                (its addend), the alignment in bytes the address must have (the kernel's,
                executor.pointer_alignment).

Buffers are numbered operands first, then results, as XLA passes them to the handler.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

from ..errors import FmhaValueError
from ..plan import dispatch, layout
from ..plan.operands import Operand, Operands, Philox
from ..runtime.packing import NULL, Pointer, pointer_value
from ..runtime.registry import registry
from .program import Patch, ProgramLaunch, ZeroFill, pack_launch

MAGIC = int.from_bytes(b"FMHAPRG1", "little")
FORMAT = 2
# XLA's PrimitiveType numbers (xla_data.proto), which the FFI reports as a buffer's dtype.
XLA_DTYPES = {"bool": 1, "int8": 2, "int16": 3, "int32": 4, "int64": 5, "uint8": 6, "uint32": 8, "float16": 10,
              "float32": 11, "bfloat16": 16}
ITEM_BYTES = {"bool": 1, "int8": 1, "int16": 2, "int32": 4, "int64": 8, "uint8": 1, "uint32": 4, "float16": 2,
              "float32": 4, "bfloat16": 2}
ATTENTION_DTYPES = {"fp16": "float16", "bf16": "bfloat16"}
# A placeholder pointer is (buffer + 1) << 40 | offset: never NULL, 16-byte aligned when the offset is,
# and it decodes back to (buffer, offset). 2**40 bytes is far above any buffer of one call.
_PLACEHOLDER_SHIFT = 40
_OFFSET_MASK = (1 << _PLACEHOLDER_SHIFT) - 1
MAX_BUFFERS = 32  # the handler's limits (xla_ffi.c)
MAX_LAUNCHES = 16
MAX_LABEL_BYTES = 255


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


@dataclasses.dataclass(frozen=True)
class _CallBuffers:
    """A call's buffers and launches: a LaunchProgram (launches packed) or a Planned one (not yet)."""

    label: str
    buffers: tuple  # Buffer, operands first
    operands: int
    zero_fills: tuple
    launches: tuple

    @property
    def results(self) -> tuple:
        return self.buffers[self.operands:]


@dataclasses.dataclass(frozen=True)
class LaunchProgram(_CallBuffers):
    """launches: ProgramLaunch, each launch's packed arguments and pointer patches."""

    def encode(self) -> np.ndarray:
        words = [MAGIC, FORMAT, self.operands, len(self.buffers) - self.operands, len(self.zero_fills),
                 len(self.launches)]
        _put_bytes(words, self.label.encode())
        for b in self.buffers:
            words += [XLA_DTYPES[b.dtype], b.nbytes]
        for f in self.zero_fills:
            words += [f.value, f.offset, f.nbytes]
        for launch in self.launches:
            _put_bytes(words, launch.key.encode())
            words += [*launch.grid, *launch.block, launch.shared]
            _put_bytes(words, launch.template)
            words.append(len(launch.patches))
            for p in launch.patches:
                words += [p.arg_offset, p.value, p.addend, p.align]
        return np.array(words, dtype=np.int64)

    @classmethod
    def decode(cls, words) -> LaunchProgram:
        """The program `encode` wrote. Buffers come back as what the wire holds: a dtype and a size
        (shape (elements,), no name)."""
        r = _Reader(np.asarray(words, dtype=np.int64))
        if r.word() != MAGIC or r.word() != FORMAT:
            raise FmhaValueError("not a launch program of this format")
        operands, results, fills, launches = (r.word() for _ in range(4))
        label = r.bytes().decode()
        names = {v: k for k, v in XLA_DTYPES.items()}
        buffers = []
        for _ in range(operands + results):
            dtype, nbytes = names[r.word()], r.word()
            buffers.append(Buffer("", (nbytes // ITEM_BYTES[dtype],), dtype))
        zero_fills = tuple(ZeroFill(r.word(), r.word(), r.word()) for _ in range(fills))
        decoded = []
        for _ in range(launches):
            key = r.bytes().decode()
            grid, block, shared = tuple(r.word() for _ in range(3)), tuple(r.word() for _ in range(3)), r.word()
            template = r.bytes()
            patches = tuple(Patch(r.word(), r.word(), r.word(), r.word()) for _ in range(r.word()))
            decoded.append(ProgramLaunch(key, grid, block, shared, template, patches))
        if r.next != len(r.words):
            raise FmhaValueError("launch program has words past its end")
        return cls(label, tuple(buffers), operands, zero_fills, tuple(decoded))


def _put_bytes(words: list, data: bytes) -> None:
    words.append(len(data))
    padded = data + b"\0" * (-len(data) % 8)
    words.extend(int(w) for w in np.frombuffer(padded, dtype="<i8"))


class _Reader:
    def __init__(self, words):
        self.words, self.next = words, 0

    def word(self) -> int:
        if self.next >= len(self.words):
            raise FmhaValueError("launch program is truncated")
        self.next += 1
        return int(self.words[self.next - 1])

    def bytes(self) -> bytes:
        n = self.word()
        count = -(-n // 8)
        chunk = self.words[self.next:self.next + count]
        if len(chunk) != count:
            raise FmhaValueError("launch program is truncated")
        self.next += count
        return chunk.astype("<i8").tobytes()[:n]


def build(label: str, arch: str, launches, buffers, operands: int, zero_fills=()) -> LaunchProgram:
    """The program of `launches` (plan.args.Launch, planned with `placeholder` pointers into
    `buffers`). Launches with an empty grid are left out (the drivers refuse them); every other one is
    checked and packed exactly as the Python executor would."""
    if len(buffers) > MAX_BUFFERS:
        raise FmhaValueError(f"{label}: {len(buffers)} buffers, the handler takes at most {MAX_BUFFERS}")
    reg = registry()
    built = []
    for launch in launches:
        if not all(launch.grid):
            continue
        entry = reg.entry(arch, launch.variant)
        sources = {slot.name: resolve_placeholder(address, len(buffers), f"{entry.key} {slot.name}")
                   for slot in entry.params if slot.type == "ptr"
                   for address in (pointer_value(slot.name, launch.args.get(slot.name, NULL)),) if address}
        built.append(pack_launch(entry, launch, sources))
    if len(built) > MAX_LAUNCHES:
        raise FmhaValueError(f"{label}: {len(built)} launches, the handler takes at most {MAX_LAUNCHES}")
    label = label.encode()[:MAX_LABEL_BYTES].decode(errors="ignore")  # it only names the call in messages
    return LaunchProgram(label, tuple(buffers), operands, tuple(zero_fills), tuple(built))


# ------------------------------------------------------------------ the calls fmha_rt.jax makes


@dataclasses.dataclass(frozen=True)
class Planned(_CallBuffers):
    """A call planned with placeholder pointers, before `build` packs it: launches are
    plan.args.Launch (every argument by name)."""

    def build(self, arch: str) -> LaunchProgram:
        return build(self.label, arch, self.launches, self.buffers, self.operands, self.zero_fills)


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
