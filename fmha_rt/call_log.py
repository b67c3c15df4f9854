"""Call-level configuration logging: with FMHA_RT_LOG_CONFIG set, every API call logs one line to the
"fmha_rt" logger, as `call name=value name=value ...` (no value holds a space):

    function family kernels device arch <array>=<dtype>[shape]:[strides] ... softmax_scale window
    causal_alignment mask_type dropout_p seed offset bias_shape alibi_shape deterministic
    workspace_bytes dq_splits

Arrays are the ones the kernels see, named as in the call (q, k, v, out, lse, dout, dq, dk, dv, bias,
dbias, alibi, cu_seqlens_*, seqstart_*, mask), strides in elements. mask_type is the AITER /
TransformerEngine integer of the mask the call resolved to (validation.MASK_TYPES); seed and offset are
the Philox values given by value, "device" when they are read from a device array, "none" without
dropout. dq_splits is the backward's (BwdLauncher.dq_acc_splits), "none" for other calls.

The switch is kernel_launch's (read once at import, refresh_log_config() re-reads it), which also logs
each launch. A CallConfig is what a call logs apart from its kernels and Philox values; a cached plan
keeps its recording call's, so that a hit logs without planning.
"""
from __future__ import annotations

import dataclasses

from .plan.operands import Operands
from .plan.problem import AttentionProblem
from .runtime import kernel_launch
from .runtime.executor import family_of

NONE = "none"
DEVICE_SEED = "device"  # Philox seed and offset read from a device array when the kernels run


@dataclasses.dataclass(frozen=True)
class CallConfig:
    function: str
    problem: AttentionProblem
    device: int | str  # an ordinal, or what stands for one (the JAX handler's "xla")
    arch: str
    strides: tuple  # (array name, strides in elements), in the order of Operands' fields
    workspace_bytes: int
    dq_splits: int | None
    seed: tuple | str | None  # (seed, offset) given by value, DEVICE_SEED, or None without dropout


def strides_of(operands: Operands) -> tuple:
    """(name, strides) of the arrays in a call's operands."""
    return tuple((o.name, tuple(o.strides)) for o in operands.arrays())


def seed_of(operands: Operands):
    """The Philox seed of a call's operands, as CallConfig.seed takes it."""
    philox = operands.philox
    if philox is None:
        return None
    return (philox.seed, philox.offset) if philox.by_value else DEVICE_SEED


def config(function: str, problem: AttentionProblem, device, arch: str, operands: Operands, workspace_bytes: int = 0,
           dq_splits: int | None = None) -> CallConfig:
    """The CallConfig of a call on `operands` (plan.operands.Operands)."""
    return CallConfig(function, problem, device, arch, strides_of(operands), workspace_bytes, dq_splits,
                      seed_of(operands))


def log_call(cfg: CallConfig, kernels) -> None:
    """Log one call of `cfg` that launched `kernels` (variant keys, in order)."""
    kernel_launch.logger().info("call %s", line(cfg, kernels))


def line(cfg: CallConfig, kernels) -> str:
    p = cfg.problem
    shapes, dtypes = _array_shapes(p), _array_dtypes(p)
    seed, offset = cfg.seed if isinstance(cfg.seed, tuple) else (cfg.seed or NONE,) * 2
    fields = {
        "function": cfg.function, "family": family_of(cfg.arch, kernels), "kernels": ",".join(kernels),
        "device": cfg.device, "arch": cfg.arch,
        **{name: f"{dtypes.get(name, p.dtype)}{_ints(shapes[name])}:{_ints(strides)}"
           for name, strides in cfg.strides if name in shapes},
        "softmax_scale": repr(p.softmax_scale), "window": f"({p.window_left},{p.window_right})",
        "causal_alignment": "bottom_right" if p.bottom_right else "top_left", "mask_type": mask_type(p),
        "dropout_p": repr(p.dropout_p), "seed": seed, "offset": offset, "bias_shape": p.bias_shape or NONE,
        "alibi_shape": p.alibi or NONE, "deterministic": p.deterministic, "workspace_bytes": cfg.workspace_bytes,
        "dq_splits": NONE if cfg.dq_splits is None else cfg.dq_splits,
    }
    return " ".join(f"{name}={value}" for name, value in fields.items())


def mask_type(p: AttentionProblem) -> int:
    """The AITER mask integer of a problem's window: 0 none, 1/2 causal (top-left/bottom-right aligned,
    with or without a left window), 3 any other window."""
    if (p.window_left, p.window_right) == (-1, -1):
        return 0
    if p.window_right == 0:
        return 2 if p.bottom_right else 1
    return 3


def _ints(values) -> str:
    return "[" + ",".join(str(int(v)) for v in values) + "]"


def _array_shapes(p: AttentionProblem) -> dict:
    """The shape of every array a call of `p` may have, by name: validation checked the call's arrays
    against these."""
    q, out = p.query_shape(p.head_dim_qk), p.query_shape(p.head_dim_v)
    k, v = p.key_shape(p.head_dim_qk), p.key_shape(p.head_dim_v)
    shapes = {"q": q, "dq": q, "out": out, "dout": out, "k": k, "dk": k, "v": v, "dv": v, "lse": p.lse_shape(),
              "mask": (p.batch, p.heads_q, p.seqlen_q, p.seqlen_k)}
    shapes.update(dict.fromkeys(("cu_seqlens_q", "cu_seqlens_k", "seqstart_q", "seqstart_k"), (p.batch + 1,)))
    if p.bias_shape is not None:
        bias = tuple(full if c in "BHS" else 1 for c, full in zip(p.bias_shape, (p.batch, p.heads_q, p.seqlen_q,
                                                                                  p.seqlen_k)))
        shapes["bias"] = shapes["dbias"] = bias
    if p.alibi is not None:
        shapes["alibi"] = (p.heads_q,) if p.alibi == "H" else (p.batch, p.heads_q)
    return shapes


def _array_dtypes(p: AttentionProblem) -> dict:
    """Dtypes of the arrays that are not in the attention's dtype."""
    return {"lse": "fp32", "alibi": "fp32", "mask": "uint8",
            **dict.fromkeys(("cu_seqlens_q", "cu_seqlens_k", "seqstart_q", "seqstart_k"), "int32")}
