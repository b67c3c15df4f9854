"""Checks of a call's arguments that every entry point shares: the public functions (api.py), the
adapters (fmha_rt.jax, fmha_rt.torch) and the launch programs. Each raises an FmhaError that names the
argument, what was given and what is allowed, before anything is launched.
"""
import dataclasses

from .arrays import ATTN_DTYPES
from .errors import FmhaNotImplementedError, FmhaTypeError, FmhaValueError

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


def attention_dtype(q, k, v) -> str:
    """The kernels' dtype name of q, k and v (imported arrays: Arg), which must agree."""
    for other in (k, v):
        if other.dtype != q.dtype:
            raise FmhaTypeError(f"{other.name} has dtype {other.dtype} but q has {q.dtype}: they must match")
    return ATTN_DTYPES[q.dtype]


def same_device(args) -> int:
    """The one device of a call's arrays (imported: Arg; None for an absent one)."""
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
    check_head_dims(dqk, dv)


def check_head_dims(dqk, dv):
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



def check_softmax_scale(softmax_scale, allowed="a float or None") -> None:
    """None (1/sqrt(D)) or a number the kernels can take; `allowed` says what the caller accepts."""
    if softmax_scale is None:
        return
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)):
        raise FmhaTypeError(f"softmax_scale must be {allowed}, got {type(softmax_scale).__name__}")
    if not 0.0 < softmax_scale <= 1e38:  # the kernels take scale * log2(e) as a float32
        raise FmhaValueError(f"softmax_scale must be in (0, 1e38], got {softmax_scale!r}")


def check_bool(name, value) -> None:
    if not isinstance(value, bool):
        raise FmhaTypeError(f"{name} must be a bool, got {type(value).__name__}")
