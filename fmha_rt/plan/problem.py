"""One attention call, validated: the sizes and options that decide which kernels run and how.

Pure Python (no NumPy, torch or Triton), so that planning and workspace queries work anywhere. Arrays
are described, never held: the caller validates shapes against these numbers and passes the arrays to
the planner separately.
"""
import math
from dataclasses import dataclass

from fmha_rt.errors import FmhaNotImplementedError, FmhaTypeError, FmhaValueError

DTYPES = ("fp16", "bf16")
MAX_HEAD_DIM = 256
# Bias broadcast shapes over [B, Hq, Sq, Sk]: a '1' in the name is a broadcast dim.
BIAS_SHAPES = ("11SS", "1HSS", "B1SS", "BHSS")
ALIBI_SHAPES = ("H", "BH")


WINDOW_REACH_LIMIT = 2**30  # seqlen_q + seqlen_k: row + offset + an unbounded side stays below 2^31


def _check_int(name, value, minimum):
    if isinstance(value, bool) or not isinstance(value, int):
        raise FmhaTypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise FmhaValueError(f"{name} must be >= {minimum}, got {value}")


@dataclass(frozen=True)
class AttentionProblem:
    """Sizes follow q [B, Sq, Hq, Dqk], k [B, Sk, Hk, Dqk], v [B, Sk, Hk, Dv].

    Varlen (group) mode: q [total_q, Hq, Dqk], k/v [total_k, Hk, D] with cu_seqlens [B + 1];
    seqlen_q / seqlen_k are then the maximum sequence lengths and total_q / total_k the physical row
    counts of q and k (padding included when sequences start at a padded seqstart).
    softmax_scale None means 1 / sqrt(head_dim_qk). A window side of -1 is unbounded; causal is
    window (-1, 0). bias_shape names the broadcast shape of an additive bias ('11SS', '1HSS', 'B1SS',
    'BHSS'), alibi the shape of ALiBi slopes ('H' or 'BH').
    """

    batch: int
    seqlen_q: int
    seqlen_k: int
    heads_q: int
    heads_k: int
    head_dim_qk: int
    head_dim_v: int
    dtype: str
    softmax_scale: float | None = None
    window_left: int = -1
    window_right: int = -1
    bottom_right: bool = False
    bias_shape: str | None = None
    bias_grad: bool = False
    alibi: str | None = None
    dropout_p: float = 0.0
    varlen: bool = False
    total_q: int | None = None
    total_k: int | None = None
    deterministic: bool = False

    def __post_init__(self):
        for name in ("batch", "heads_q", "heads_k", "head_dim_qk", "head_dim_v"):
            _check_int(name, getattr(self, name), 1)
        for name in ("seqlen_q", "seqlen_k"):
            _check_int(name, getattr(self, name), 0)
        for name in ("window_left", "window_right"):
            _check_int(name, getattr(self, name), -1)
        self._bound_window()
        if self.dtype not in DTYPES:
            raise FmhaTypeError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.heads_q % self.heads_k:
            raise FmhaValueError(f"heads_q ({self.heads_q}) must be a multiple of heads_k ({self.heads_k})")
        for name in ("head_dim_qk", "head_dim_v"):
            if getattr(self, name) > MAX_HEAD_DIM:
                raise FmhaNotImplementedError(f"{name} must be <= {MAX_HEAD_DIM}, got {getattr(self, name)}")
        if self.softmax_scale is None:
            object.__setattr__(self, "softmax_scale", 1.0 / math.sqrt(self.head_dim_qk))
        if not (isinstance(self.softmax_scale, (int, float)) and math.isfinite(self.softmax_scale)
                and self.softmax_scale > 0):
            raise FmhaValueError(f"softmax_scale must be a finite number > 0, got {self.softmax_scale!r}")
        object.__setattr__(self, "softmax_scale", float(self.softmax_scale))
        if self.bias_shape is not None and self.bias_shape not in BIAS_SHAPES:
            raise FmhaValueError(f"bias_shape must be one of {BIAS_SHAPES} or None, got {self.bias_shape!r}")
        if self.bias_grad and self.bias_shape is None:
            raise FmhaValueError("bias_grad needs a bias (bias_shape is None)")
        if self.alibi is not None and self.alibi not in ALIBI_SHAPES:
            raise FmhaValueError(f"alibi must be one of {ALIBI_SHAPES} or None, got {self.alibi!r}")
        if self.alibi is not None and self.bias_shape is not None:
            raise FmhaNotImplementedError("a tensor bias and ALiBi slopes together are not supported; "
                                          "fold the ALiBi term into the bias")
        if not (isinstance(self.dropout_p, (int, float)) and 0.0 <= self.dropout_p < 1.0):
            raise FmhaValueError(f"dropout_p must be in [0, 1), got {self.dropout_p!r}")
        object.__setattr__(self, "dropout_p", float(self.dropout_p))
        self._check_varlen()

    def _bound_window(self):
        """The kernels compute a query's window as row + offset -/+ side in int32, an unbounded side standing
        for seqlen_q + seqlen_k: lengths must leave that headroom, and a side that reaches past both sequences
        (which would overflow) is the unbounded side it equals, -1."""
        reach = self.seqlen_q + self.seqlen_k
        if reach >= WINDOW_REACH_LIMIT:
            raise FmhaNotImplementedError(f"seqlen_q + seqlen_k must be < 2^30 (window arithmetic in int32), got {reach}")
        for name in ("window_left", "window_right"):
            if 0 < reach <= getattr(self, name):
                object.__setattr__(self, name, -1)

    def _check_varlen(self):
        if not self.varlen:
            if self.total_q is not None or self.total_k is not None:
                raise FmhaValueError("total_q / total_k describe varlen inputs; pass them only with varlen=True")
            return
        for name in ("total_q", "total_k"):
            if getattr(self, name) is None:
                raise FmhaValueError(f"varlen problems need {name} (rows of the packed tensor)")
            _check_int(name, getattr(self, name), 0)
        if self.bias_shape is not None:
            raise FmhaNotImplementedError("a tensor bias is not supported with variable-length sequences")

    @property
    def kv_group_size(self) -> int:
        """Query heads per key/value head (1 for MHA, heads_q for MQA)."""
        return self.heads_q // self.heads_k

    @property
    def causal(self) -> bool:
        return self.window_left < 0 and self.window_right == 0

    @property
    def unmasked(self) -> bool:
        """No window on either side: every query sees every key."""
        return self.window_left < 0 and self.window_right < 0

    @property
    def has_dropout(self) -> bool:
        return self.dropout_p > 0.0

    @property
    def rows_q(self) -> int:
        """Query rows per head as stored: B * Sq, or total_q in varlen mode."""
        return self.total_q if self.varlen else self.batch * self.seqlen_q

    @property
    def rows_k(self) -> int:
        return self.total_k if self.varlen else self.batch * self.seqlen_k

    def query_shape(self, head_dim) -> tuple:
        """Shape of q, out, dout and dq at `head_dim`: [B, Sq, Hq, D], or [total_q, Hq, D] in varlen mode."""
        return (self.total_q, self.heads_q, head_dim) if self.varlen else (self.batch, self.seqlen_q, self.heads_q, head_dim)

    def key_shape(self, head_dim) -> tuple:
        """Shape of k, v, dk and dv at `head_dim`: [B, Sk, Hk, D], or [total_k, Hk, D] in varlen mode."""
        return (self.total_k, self.heads_k, head_dim) if self.varlen else (self.batch, self.seqlen_k, self.heads_k, head_dim)

    def lse_shape(self) -> tuple:
        """Shape of the fp32 LSE: [B, Hq, Sq], or [Hq, total_q] in varlen mode."""
        return (self.heads_q, self.total_q) if self.varlen else (self.batch, self.heads_q, self.seqlen_q)

    def fwd_flops(self) -> int:
        """Nominal forward FLOPs (4 B H Sq Sk D, halved for causal), the convention for TFLOP/s."""
        flops = 2 * self.batch * self.heads_q * self.seqlen_q * self.seqlen_k * (self.head_dim_qk + self.head_dim_v)
        return flops // 2 if self.causal else flops
