"""One planned launch (a variant key, a grid and every runtime argument by name) and the builder of its
arguments from the call's operands (operands.Operands).

Pointer arguments take whatever objects the caller's operands hold (device addresses, arrays); an
unused pointer is None, which an executor passes as a null pointer (or a dummy array when
interpreting). Strides are each operand's, in elements.
"""
import math
from dataclasses import dataclass

from fmha_rt.errors import FmhaNotImplementedError, FmhaValueError

from .abi import ordered
from .layout import padded_head_dim
from .operands import Operand, Operands

MAX_GRID_YZ = 65535


@dataclass(frozen=True)
class Launch:
    """One kernel launch: the variant key, the grid and every runtime argument by name."""

    variant: str
    grid: tuple
    args: dict


def cdiv(a, b):
    return -(-a // b)


def has_work(problem):
    return problem.batch > 0 and problem.seqlen_q > 0


def launch_grid(blocks, problem):
    """(blocks, query heads, batch), within the grid's limits."""
    if problem.heads_q > MAX_GRID_YZ or problem.batch > MAX_GRID_YZ:
        raise FmhaNotImplementedError(f"heads ({problem.heads_q}) and batch ({problem.batch}) must be <= "
                                      f"{MAX_GRID_YZ} (grid limits)")
    return (blocks, problem.heads_q, problem.batch)


def philox_counters(problem) -> int:
    """Philox counters one call consumes: advance the offset by this much between calls."""
    return problem.batch * problem.heads_q * problem.seqlen_q * -(-problem.seqlen_k // 4)


def dropout_threshold(p: float) -> int:
    """uint32 draws below this are dropped: keep probability 1 - threshold / 2**32."""
    return min(round(p * 2 ** 32), 2 ** 32 - 1)


class Args:
    """Builds the runtime argument dict of one launch from the call's operands."""

    def __init__(self, problem, operands: Operands):
        self.problem = problem
        self.operands = operands
        self.need = operands.need  # the operands a launch cannot go without

    @staticmethod
    def given_strides(operand: Operand, rank):
        strides = operand.strides
        if strides is None or len(strides) != rank:
            raise FmhaValueError(f"{operand.name} must have {rank} strides, got {strides!r}")
        strides = tuple(int(s) for s in strides)
        if strides[-1] != 1:
            raise FmhaValueError(f"{operand.name} must be contiguous in its last dim, got strides {strides}")
        return strides

    def rows(self, operand: Operand, arg):
        """Batch/row/head strides of a [B, S, H, D] (or varlen [T, H, D]) tensor, as stride_<arg>_*."""
        if self.problem.varlen:
            s, h, _ = self.given_strides(operand, 3)
            b = 0
        else:
            b, s, h, _ = self.given_strides(operand, 4)
        return self.checked_strides({f"stride_{arg}_b": b, f"stride_{arg}_s": s, f"stride_{arg}_h": h}, operand.name)

    @staticmethod
    def checked_strides(strides, name):
        for arg, value in strides.items():
            if value % 8:
                raise FmhaValueError(f"{name}: stride {value} ({arg}) must be a multiple of 8 elements; pad or copy "
                                     "the tensor so that every stride but the last is a multiple of 8")
            limit = 2 ** 31 if arg.endswith("_s") else 2 ** 63
            if not -limit <= value < limit:
                raise FmhaValueError(f"{name}: stride {value} ({arg}) is out of range")
        return strides

    def lse_like(self, operand: Operand, prefix):
        """[B, Hq, Sq] (or varlen [Hq, total_q]) fp32 strides as <prefix>_stride_b/_h."""
        if self.problem.varlen:
            h, _ = self.given_strides(operand, 2)
            b = 0
        else:
            b, h, _ = self.given_strides(operand, 3)
        return {f"{prefix}_stride_b": b, f"{prefix}_stride_h": h}

    def shape(self):
        p = self.problem
        return {"seqlen_q": p.seqlen_q, "seqlen_k": p.seqlen_k, "num_heads_q": p.heads_q,
                "kv_group_size": p.kv_group_size, "head_dim_qk_div8": padded_head_dim(p.head_dim_qk) // 8,
                "head_dim_v_div8": padded_head_dim(p.head_dim_v) // 8}

    def varlen(self):
        p = self.problem
        if not p.varlen:
            return {"CuSeqlensQ": None, "CuSeqlensK": None, "SeqstartQ": None, "SeqstartK": None,
                    "is_varlen": 0, "has_seqstart": 0}
        o = self.operands
        if (o.seqstart_q is None) != (o.seqstart_k is None):
            raise FmhaValueError("seqstart_q and seqstart_k must be given together")
        return {"CuSeqlensQ": self.need.cu_seqlens_q.pointer, "CuSeqlensK": self.need.cu_seqlens_k.pointer,
                "SeqstartQ": _pointer(o.seqstart_q), "SeqstartK": _pointer(o.seqstart_k),
                "is_varlen": 1, "has_seqstart": int(o.seqstart_q is not None)}

    def mask(self):
        p = self.problem
        return {"window_left": p.window_left, "window_right": p.window_right, "bottom_right": int(p.bottom_right)}

    def score_terms(self):
        """Bias and ALiBi pointers and strides (broadcast dims get stride 0)."""
        p = self.problem
        args = {"Bias": None, "Alibi": None, "stride_bias_b": 0, "stride_bias_h": 0, "stride_bias_s": 0,
                "alibi_stride_b": 0}
        if p.bias_shape is not None:
            bias = self.need.bias
            b, h, s, _ = self.given_strides(bias, 4)
            args.update(self.checked_strides({"stride_bias_b": b if p.bias_shape[0] == "B" else 0,
                                              "stride_bias_h": h if p.bias_shape[1] == "H" else 0,
                                              "stride_bias_s": s}, "bias"))
            args["Bias"] = bias.pointer
        if p.alibi is not None:
            alibi = self.need.alibi
            args["Alibi"] = alibi.pointer
            if p.alibi == "BH":
                args["alibi_stride_b"] = self.given_strides(alibi, 2)[0]
        return args

    def dropout(self):
        p = self.problem
        args = {"drop_threshold": 0, "drop_scale": 1.0, "philox_seed": 0, "philox_offset": 0,
                "PhiloxSeedOffset": None, "philox_from_ptr": 0}
        if p.has_dropout:
            args.update(drop_threshold=dropout_threshold(p.dropout_p), drop_scale=1.0 / (1.0 - p.dropout_p))
            args.update(self.philox())
        return args

    def philox(self):
        philox = self.operands.philox
        if philox is None or (philox.by_value and philox.seed is None):
            raise FmhaValueError("dropout needs the Philox seed and offset (by value, or the address of a device "
                                 "int64 array [seed, offset])")
        if not philox.by_value:
            return {"PhiloxSeedOffset": philox.pointer, "philox_from_ptr": 1, "philox_seed": 0, "philox_offset": 0}
        return {"PhiloxSeedOffset": None, "philox_from_ptr": 0, "philox_seed": philox_seed_argument(int(philox.seed)),
                "philox_offset": int(philox.offset)}


def philox_seed_argument(seed: int) -> int:
    """A seed given by value as the kernels' int64 argument: its low 64 bits, the bits they read from a device
    array [seed, offset], so one seed draws one mask either way (the sign bit included)."""
    return (seed + 2 ** 63) % 2 ** 64 - 2 ** 63


def _pointer(operand: Operand | None):
    return None if operand is None else operand.pointer


def forward_args(problem, operands: Operands) -> dict:
    """The runtime arguments of fmha_fwd for `problem` (operands as a family's plan_fwd takes them), by name."""
    a = Args(problem, operands)
    n = a.need
    args = {"Q": n.q.pointer, "K": n.k.pointer, "V": n.v.pointer, "Out": n.out.pointer, "Lse": n.lse.pointer}
    args.update(a.score_terms())
    args.update(a.dropout())
    args.update(a.varlen())
    for operand, arg in ((n.q, "q"), (n.k, "k"), (n.v, "v"), (n.out, "o")):
        args.update(a.rows(operand, arg))
    args.update(a.lse_like(n.lse, "lse"))
    args.update(a.shape())
    args.update(a.mask())
    args["scale_log2"] = problem.softmax_scale * math.log2(math.e)
    return args


def forward_launch(key, problem, operands: Operands, block_m, extra=None) -> Launch:
    """The launch of fmha_fwd variant `key` with `block_m` query rows a program; `extra` the arguments a
    family's kernels take beyond the signature (the v3 kernels' global scratch)."""
    args = ordered(key, "fmha_fwd", forward_args(problem, operands))
    return Launch(key, launch_grid(cdiv(problem.seqlen_q, block_m), problem), {**args, **(extra or {})})


def with_work(launches) -> list:
    """Launches that have blocks to run: a grid with a zero dimension (no keys, say, so dK and dV are
    empty) does nothing, and the drivers refuse it."""
    return [launch for launch in launches if all(launch.grid)]
