"""Float64 NumPy attention: the oracle every kernel test compares against.

Plain, vectorised NumPy with no GPU and no framework behind it, so that a disagreement between a kernel
and this module is always the kernel's to explain. Each sequence is handled on its own (the batched and
the varlen entry points only differ in how they cut the inputs into sequences), with the softmax kept in
probability space and gradients written out analytically.

Masking convention: key j is visible from query i iff i + off - left <= j <= i + off + right, where a
negative window side is unbounded and off is 0 (top-left) or Sk - Sq (bottom-right). A query that sees no
key gets output 0 and LSE -inf, and contributes no gradient.
"""

from dataclasses import dataclass

import numpy as np

from fmha_rt.errors import FmhaNotImplementedError, FmhaTypeError, FmhaValueError


@dataclass(frozen=True)
class _Options:
    softmax_scale: float
    window: tuple
    bottom_right: bool
    dropout_p: float


@dataclass(frozen=True)
class _Sequence:
    """One sequence's inputs, heads second: q [Sq, Hq, Dqk], k [Sk, Hk, Dqk], v [Sk, Hk, Dv]."""

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    bias: np.ndarray | None  # broadcastable to [Hq, Sq, Sk]
    alibi_slopes: np.ndarray | None  # [Hq]
    keep: np.ndarray | None  # bool [Hq, Sq, Sk]


# ----------------------------------------------------------------------------------------- inputs


def _as_float64(name, x):
    arr = np.asarray(x)
    if arr.dtype.kind in "biuc":
        raise FmhaTypeError(f"{name} must hold real floating-point values, got dtype {arr.dtype}")
    return arr.astype(np.float64)


def _options(q_head_dim, softmax_scale, window, bottom_right, dropout_p):
    scale = 1.0 / np.sqrt(q_head_dim) if softmax_scale is None else float(softmax_scale)
    try:
        left, right = (int(side) for side in window)
    except (TypeError, ValueError):
        raise FmhaValueError(f"window must be a pair of ints (left, right), got {window!r}") from None
    if left < -1 or right < -1:
        raise FmhaValueError(f"window sides must be >= 0, or -1 for unbounded; got {window!r}")
    dropout_p = float(dropout_p)
    if not 0.0 <= dropout_p < 1.0:
        raise FmhaValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    return _Options(scale, (left, right), bool(bottom_right), dropout_p)


def _check_heads(q, k, v, seq_axis):
    """Check the shapes shared by the batched and the varlen layouts; return (Hq, Hk)."""
    hq, hk = q.shape[seq_axis + 1], k.shape[seq_axis + 1]
    if k.shape[:-1] != v.shape[:-1]:
        raise FmhaValueError(f"k {k.shape} and v {v.shape} must agree in all but the last dim")
    if q.shape[-1] != k.shape[-1]:
        raise FmhaValueError(f"q {q.shape} and k {k.shape} must share the head dim (last)")
    if q.shape[-1] == 0:
        raise FmhaValueError(f"head dim of q must be >= 1, got q {q.shape}")
    if hk == 0 or hq % hk:
        raise FmhaValueError(f"query heads ({hq}) must be a multiple of key/value heads ({hk})")
    return hq, hk


def _check_dout(dout, expected_shape):
    dout = _as_float64("dout", dout)
    if dout.shape != expected_shape:
        raise FmhaValueError(f"dout must have shape {expected_shape}, got {dout.shape}")
    return dout


def _check_keep(keep, shape, where="dropout_keep"):
    keep = np.asarray(keep)
    if keep.dtype != np.bool_:
        raise FmhaTypeError(f"{where} must be a bool array (True = kept), got dtype {keep.dtype}")
    if keep.shape != shape:
        raise FmhaValueError(f"{where} must have shape {shape}, got {keep.shape}")
    return keep


def _require_keep_for_dropout(dropout_p, dropout_keep):
    # The reference draws no random numbers: the caller passes the kernel's keep mask.
    if dropout_p > 0.0 and dropout_keep is None:
        raise FmhaValueError("dropout_p > 0 needs dropout_keep, the mask of kept probabilities")


def _alibi_per_batch(alibi_slopes, batch, hq):
    """Slopes as [B, Hq] float64 (or None)."""
    if alibi_slopes is None:
        return None
    slopes = _as_float64("alibi_slopes", alibi_slopes)
    if slopes.shape == (hq,):
        return np.broadcast_to(slopes, (batch, hq))
    if slopes.shape == (batch, hq):
        return slopes
    raise FmhaValueError(f"alibi_slopes must have shape ({hq},) or ({batch}, {hq}), got {slopes.shape}")


# ------------------------------------------------------------------------------- one sequence


def _visible(sq, sk, window, bottom_right):
    """bool [Sq, Sk]: which keys each query may attend to."""
    left, right = window
    off = sk - sq if bottom_right else 0
    rel = np.arange(sk)[None, :] - (np.arange(sq)[:, None] + off)  # j - (i + off)
    visible = np.ones((sq, sk), dtype=bool)
    if left >= 0:
        visible &= rel >= -left
    if right >= 0:
        visible &= rel <= right
    return visible


def _alibi_bias(slopes, sq, sk, bottom_right):
    """[Hq, Sq, Sk]: -slope * |i + off - j|."""
    off = sk - sq if bottom_right else 0
    distance = np.abs(np.arange(sq)[:, None] + off - np.arange(sk)[None, :])
    return -slopes[:, None, None] * distance[None, :, :]


def _expand_kv_heads(x, hq):
    """[Sk, Hk, D] -> [Sk, Hq, D]: query head h reads kv head h // (Hq // Hk)."""
    return np.repeat(x, hq // x.shape[1], axis=1)


def _sum_kv_groups(x, hk):
    """[Sk, Hq, D] -> [Sk, Hk, D]: the adjoint of _expand_kv_heads."""
    sk, hq, d = x.shape
    return x.reshape(sk, hk, hq // hk, d).sum(axis=2)


def _probabilities(seq, opts):
    """Softmax probabilities P [Hq, Sq, Sk] and natural-log LSE [Hq, Sq], masked rows all zero / -inf."""
    sq, hq = seq.q.shape[:2]
    sk = seq.k.shape[0]
    k = _expand_kv_heads(seq.k, hq)
    scores = opts.softmax_scale * np.einsum("ihd,jhd->hij", seq.q, k)
    if seq.bias is not None:
        scores = scores + seq.bias
    if seq.alibi_slopes is not None:
        scores = scores + _alibi_bias(seq.alibi_slopes, sq, sk, opts.bottom_right)
    scores = np.where(_visible(sq, sk, opts.window, opts.bottom_right), scores, -np.inf)

    row_max = scores.max(axis=-1, initial=-np.inf, keepdims=True)
    # A row with no visible key has max -inf; shifting by 0 instead keeps exp() at 0 with no NaN.
    shift = np.where(np.isfinite(row_max), row_max, 0.0)
    unnormalised = np.exp(scores - shift)
    row_sum = unnormalised.sum(axis=-1, keepdims=True)
    has_keys = row_sum > 0.0
    safe_sum = np.where(has_keys, row_sum, 1.0)
    probs = unnormalised / safe_sum
    lse = np.where(has_keys, shift + np.log(safe_sum), -np.inf)[..., 0]
    return probs, lse


def _dropout_factor(seq, opts):
    """Per-probability multiplier of dropout: keep / (1 - p), or None without dropout."""
    if seq.keep is None:
        return None
    return seq.keep / (1.0 - opts.dropout_p)


def _forward(seq, opts):
    probs, lse = _probabilities(seq, opts)
    factor = _dropout_factor(seq, opts)
    dropped = probs if factor is None else probs * factor
    out = np.einsum("hij,jhd->ihd", dropped, _expand_kv_heads(seq.v, seq.q.shape[1]))
    return out, lse


def _backward(dout, seq, opts):
    """Gradients (dq, dk, dv, dscores) of sum(out * dout); dscores [Hq, Sq, Sk] is also dbias."""
    hq, hk = seq.q.shape[1], seq.k.shape[1]
    k, v = _expand_kv_heads(seq.k, hq), _expand_kv_heads(seq.v, hq)
    probs, _ = _probabilities(seq, opts)
    factor = _dropout_factor(seq, opts)
    dropped = probs if factor is None else probs * factor

    d_dropped = np.einsum("ihd,jhd->hij", dout, v)
    d_probs = d_dropped if factor is None else d_dropped * factor
    # rowsum(P * dP) equals rowsum(dO * O) even with dropout, because O = P_dropped V.
    out = np.einsum("hij,jhd->ihd", dropped, v)
    row_dot = np.einsum("ihd,ihd->hi", dout, out)[..., None]
    dscores = probs * (d_probs - row_dot)

    dq = opts.softmax_scale * np.einsum("hij,jhd->ihd", dscores, k)
    dk = opts.softmax_scale * np.einsum("hij,ihd->jhd", dscores, seq.q)
    dv = np.einsum("hij,ihd->jhd", dropped, dout)
    return dq, _sum_kv_groups(dk, hk), _sum_kv_groups(dv, hk), dscores


# ----------------------------------------------------------------------------------- batched


def _batched_sequences(q, k, v, bias, alibi_slopes, dropout_p, dropout_keep):
    """Validate the batched layout and yield one _Sequence per batch entry."""
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise FmhaValueError(
            f"q, k, v must be 4-D [B, S, H, D]; got q {q.shape}, k {k.shape}, v {v.shape}"
        )
    if not q.shape[0] == k.shape[0] == v.shape[0]:
        raise FmhaValueError(f"batch sizes differ: q {q.shape}, k {k.shape}, v {v.shape}")
    batch, sq, _, _ = q.shape
    sk = k.shape[1]
    hq, _ = _check_heads(q, k, v, seq_axis=1)
    full = (batch, hq, sq, sk)
    if bias is not None:
        try:
            bias = np.broadcast_to(bias, full)
        except ValueError:
            raise FmhaValueError(f"bias {bias.shape} does not broadcast to [B, Hq, Sq, Sk] {full}") from None
    slopes = _alibi_per_batch(alibi_slopes, batch, hq)
    _require_keep_for_dropout(dropout_p, dropout_keep)
    keep = None if dropout_keep is None else _check_keep(dropout_keep, full)
    for b in range(batch):
        yield _Sequence(
            q[b], k[b], v[b],
            None if bias is None else bias[b],
            None if slopes is None else slopes[b],
            None if keep is None else keep[b],
        )


def _sum_to_shape(x, shape):
    """Sum a broadcast gradient back down to the shape of the array that was broadcast."""
    lead = x.ndim - len(shape)
    x = x.sum(axis=tuple(range(lead)))
    return x.sum(axis=tuple(a for a, n in enumerate(shape) if n == 1), keepdims=True).reshape(shape)


def mha_fwd_ref(q, k, v, *, softmax_scale=None, window=(-1, -1), bottom_right=False, bias=None,
                alibi_slopes=None, dropout_p=0.0, dropout_keep=None):
    """Attention forward in float64.

    q [B, Sq, Hq, Dqk], k [B, Sk, Hk, Dqk], v [B, Sk, Hk, Dv], any float dtype (or objects with __array__).
    bias broadcasts to [B, Hq, Sq, Sk] and is added to the scaled scores; alibi_slopes [Hq] or [B, Hq]
    adds -slope * |i + off - j|; dropout_keep bool [B, Hq, Sq, Sk] keeps probabilities (scaled by
    1 / (1 - dropout_p)). Returns out [B, Sq, Hq, Dv] and lse [B, Hq, Sq] of the undropped scores.
    """
    q, k, v = _as_float64("q", q), _as_float64("k", k), _as_float64("v", v)
    bias = None if bias is None else _as_float64("bias", bias)
    opts = _options(q.shape[-1], softmax_scale, window, bottom_right, dropout_p)
    sequences = list(_batched_sequences(q, k, v, bias, alibi_slopes, opts.dropout_p, dropout_keep))
    batch, sq, hq = q.shape[:3]
    out = np.zeros((batch, sq, hq, v.shape[-1]))
    lse = np.zeros((batch, hq, sq))
    for b, seq in enumerate(sequences):
        out[b], lse[b] = _forward(seq, opts)
    return out, lse


def mha_bwd_ref(dout, q, k, v, *, softmax_scale=None, window=(-1, -1), bottom_right=False, bias=None,
                alibi_slopes=None, dropout_p=0.0, dropout_keep=None):
    """Gradients of sum(mha_fwd_ref(...)[0] * dout): (dq, dk, dv, dbias), all float64.

    dk and dv have k's and v's shapes (summed over each GQA group); dbias has the bias's own shape, or is
    None when no bias was given.
    """
    q, k, v = _as_float64("q", q), _as_float64("k", k), _as_float64("v", v)
    bias = None if bias is None else _as_float64("bias", bias)
    opts = _options(q.shape[-1], softmax_scale, window, bottom_right, dropout_p)
    sequences = list(_batched_sequences(q, k, v, bias, alibi_slopes, opts.dropout_p, dropout_keep))
    dout = _check_dout(dout, q.shape[:3] + v.shape[-1:])
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    dscores = np.zeros((q.shape[0], q.shape[2], q.shape[1], k.shape[1]))
    for b, seq in enumerate(sequences):
        dq[b], dk[b], dv[b], dscores[b] = _backward(dout[b], seq, opts)
    dbias = None if bias is None else _sum_to_shape(dscores, bias.shape)
    return dq, dk, dv, dbias


# ------------------------------------------------------------------------------------- varlen


def _check_cu_seqlens(name, cu_seqlens, total):
    cu = np.asarray(cu_seqlens)
    if cu.dtype.kind not in "iu":
        raise FmhaTypeError(f"{name} must be an integer array, got dtype {cu.dtype}")
    if cu.ndim != 1 or cu.size < 1:
        raise FmhaValueError(f"{name} must be 1-D [B + 1], got shape {cu.shape}")
    cu = cu.astype(np.int64)
    if cu[0] != 0 or cu[-1] != total or np.any(np.diff(cu) < 0):
        raise FmhaValueError(
            f"{name} must start at 0, never decrease and end at the total length {total}; got {cu.tolist()}"
        )
    return cu


def _varlen_sequences(q, k, v, cu_seqlens_q, cu_seqlens_k, bias, alibi_slopes, dropout_p, dropout_keep):
    """Validate the packed layout and yield (query rows, key rows, _Sequence) per sequence."""
    if bias is not None:
        raise FmhaNotImplementedError("bias is not supported with variable-length sequences")
    if q.ndim != 3 or k.ndim != 3 or v.ndim != 3:
        raise FmhaValueError(
            f"varlen q, k, v must be 3-D [total, H, D]; got q {q.shape}, k {k.shape}, v {v.shape}"
        )
    hq, _ = _check_heads(q, k, v, seq_axis=0)
    cu_q = _check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.shape[0])
    cu_k = _check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, k.shape[0])
    if cu_q.size != cu_k.size:
        raise FmhaValueError(f"cu_seqlens_q ({cu_q.size}) and cu_seqlens_k ({cu_k.size}) differ in length")
    batch = cu_q.size - 1
    slopes = _alibi_per_batch(alibi_slopes, batch, hq)
    _require_keep_for_dropout(dropout_p, dropout_keep)
    if dropout_keep is not None and len(dropout_keep) != batch:
        raise FmhaValueError(
            f"dropout_keep must list one mask per sequence ({batch}), got {len(dropout_keep)}"
        )
    for b in range(batch):
        rows_q, rows_k = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        keep = None
        if dropout_keep is not None:
            shape = (hq, cu_q[b + 1] - cu_q[b], cu_k[b + 1] - cu_k[b])
            keep = _check_keep(dropout_keep[b], shape, where=f"dropout_keep[{b}]")
        yield rows_q, rows_k, _Sequence(
            q[rows_q], k[rows_k], v[rows_k], None, None if slopes is None else slopes[b], keep
        )


def mha_varlen_fwd_ref(q, k, v, cu_seqlens_q, cu_seqlens_k, *, softmax_scale=None, window=(-1, -1),
                       bottom_right=False, bias=None, alibi_slopes=None, dropout_p=0.0, dropout_keep=None):
    """Forward over packed sequences: q [total_q, Hq, Dqk], k/v [total_k, Hk, D], cu_seqlens [B + 1].

    Each sequence is masked and aligned on its own lengths. alibi_slopes is [Hq] or [B, Hq];
    dropout_keep lists one bool [Hq, sq_b, sk_b] mask per sequence. Returns out [total_q, Hq, Dv] and
    lse [Hq, total_q].
    """
    q, k, v = _as_float64("q", q), _as_float64("k", k), _as_float64("v", v)
    opts = _options(q.shape[-1], softmax_scale, window, bottom_right, dropout_p)
    out = np.zeros(q.shape[:2] + v.shape[-1:])
    lse = np.full((q.shape[1], q.shape[0]), -np.inf)
    for rows_q, _, seq in _varlen_sequences(q, k, v, cu_seqlens_q, cu_seqlens_k, bias, alibi_slopes,
                                            opts.dropout_p, dropout_keep):
        out[rows_q], lse[:, rows_q] = _forward(seq, opts)
    return out, lse


def mha_varlen_bwd_ref(dout, q, k, v, cu_seqlens_q, cu_seqlens_k, *, softmax_scale=None, window=(-1, -1),
                       bottom_right=False, bias=None, alibi_slopes=None, dropout_p=0.0, dropout_keep=None):
    """Gradients of sum(mha_varlen_fwd_ref(...)[0] * dout): (dq, dk, dv, None)."""
    q, k, v = _as_float64("q", q), _as_float64("k", k), _as_float64("v", v)
    opts = _options(q.shape[-1], softmax_scale, window, bottom_right, dropout_p)
    sequences = list(_varlen_sequences(q, k, v, cu_seqlens_q, cu_seqlens_k, bias, alibi_slopes,
                                       opts.dropout_p, dropout_keep))
    dout = _check_dout(dout, q.shape[:2] + v.shape[-1:])
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    for rows_q, rows_k, seq in sequences:
        dq[rows_q], dk[rows_k], dv[rows_k], _ = _backward(dout[rows_q], seq, opts)
    return dq, dk, dv, None


# ------------------------------------------------------------------------------------ helpers


def rel_err(a, b):
    """||a - b|| / max(||b||, tiny) in float64; infinities equal in value and position count as equal."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if a.shape != b.shape:
        raise FmhaValueError(f"rel_err needs equal shapes, got {a.shape} and {b.shape}")
    same_inf = np.isinf(a) & (a == b)
    diff = np.subtract(a, b, out=np.zeros_like(a), where=~same_inf)
    # Any other infinity or NaN makes the error unbounded (or undefined), whatever the norm of b.
    if np.isnan(diff).any():
        return float("nan")
    if np.isinf(diff).any():
        return float("inf")
    ref = np.where(same_inf, 0.0, b)
    return float(np.linalg.norm(diff.ravel()) / max(np.linalg.norm(ref.ravel()), np.finfo(np.float64).tiny))
