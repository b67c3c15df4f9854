"""The float64 reference against an independent loop-by-loop attention and against finite differences."""

import math
import warnings
import zlib
from dataclasses import dataclass

import numpy as np
import pytest

from fmha_rt.errors import FmhaNotImplementedError, FmhaTypeError, FmhaValueError
from fmha_rt.reference import (
    mha_bwd_ref,
    mha_fwd_ref,
    mha_varlen_bwd_ref,
    mha_varlen_fwd_ref,
    rel_err,
)

BATCH = 2


@pytest.fixture(autouse=True)
def no_warnings_or_float_errors():
    """Masked rows must come out clean: any NumPy warning or invalid operation fails the test."""
    with warnings.catch_warnings(), np.errstate(all="raise"):
        warnings.simplefilter("error")
        yield


def seeded_rng(name):
    """A generator seeded by the case's name, so each case draws its own inputs, the same every run."""
    return np.random.default_rng(zlib.crc32(name.encode()))


@dataclass(frozen=True)
class Case:
    """A shape and a set of options; the arrays are drawn from a seeded generator by make()."""

    name: str
    sq: int = 4
    sk: int = 4
    hq: int = 2
    hk: int = 2
    d: int = 3
    dv: int = 3
    softmax_scale: float | None = None
    window: tuple = (-1, -1)
    bottom_right: bool = False
    bias_shape: str | None = None  # which leading dims are full: "11", "B1", "1H", "BH"
    alibi_shape: str | None = None  # "H" or "BH"
    dropout_p: float = 0.0

    def make(self):
        rng = seeded_rng(self.name)
        inputs = {
            "q": rng.standard_normal((BATCH, self.sq, self.hq, self.d)),
            "k": rng.standard_normal((BATCH, self.sk, self.hk, self.d)),
            "v": rng.standard_normal((BATCH, self.sk, self.hk, self.dv)),
        }
        opts = {"softmax_scale": self.softmax_scale, "window": self.window, "bottom_right": self.bottom_right}
        if self.bias_shape is not None:
            lead = (BATCH if self.bias_shape[0] == "B" else 1, self.hq if self.bias_shape[1] == "H" else 1)
            opts["bias"] = rng.standard_normal(lead + (self.sq, self.sk))
        if self.alibi_shape is not None:
            shape = (self.hq,) if self.alibi_shape == "H" else (BATCH, self.hq)
            opts["alibi_slopes"] = rng.uniform(0.1, 1.0, shape)
        if self.dropout_p:
            opts["dropout_p"] = self.dropout_p
            opts["dropout_keep"] = rng.random((BATCH, self.hq, self.sq, self.sk)) >= self.dropout_p
        dout = rng.standard_normal((BATCH, self.sq, self.hq, self.dv))
        return inputs, opts, dout


CASES = [
    Case("plain"),
    Case("shorter_queries", sq=3, sk=5),
    Case("longer_queries", sq=5, sk=3),
    Case("custom_scale_and_dv", d=4, dv=2, softmax_scale=0.7),
    Case("causal_top_left", sq=3, sk=5, window=(-1, 0)),
    Case("causal_top_left_long_q", sq=5, sk=3, window=(-1, 0)),
    Case("causal_bottom_right", sq=3, sk=5, window=(-1, 0), bottom_right=True),
    Case("causal_bottom_right_masked_rows", sq=5, sk=3, window=(-1, 0), bottom_right=True),
    Case("window_both_top_left", sq=5, sk=5, window=(1, 1)),
    Case("window_left_bottom_right", sq=3, sk=6, window=(2, 0), bottom_right=True),
    Case("window_right_bottom_right", sq=4, sk=3, window=(0, 2), bottom_right=True),
    Case("window_left_only", sq=5, sk=4, window=(1, -1)),
    Case("window_diagonal_only", sq=4, sk=4, window=(0, 0)),
    Case("gqa_2_to_1", hq=4, hk=2),
    Case("gqa_4_to_1_causal", hq=4, hk=1, sq=3, sk=5, window=(-1, 0), bottom_right=True),
    Case("bias_11", bias_shape="11"),
    Case("bias_B1", bias_shape="B1", sq=3, sk=5),
    Case("bias_1H", bias_shape="1H", hq=4, hk=2),
    Case("bias_BH", bias_shape="BH", window=(-1, 0)),
    Case("alibi_H", alibi_shape="H", sq=3, sk=5),
    Case("alibi_BH", alibi_shape="BH", sq=3, sk=5, bottom_right=True, window=(-1, 0)),
    Case("dropout", dropout_p=0.3),
    Case("dropout_causal_gqa", dropout_p=0.25, hq=4, hk=2, window=(-1, 0)),
    Case("everything", sq=5, sk=3, hq=4, hk=2, d=4, dv=2, window=(1, 0), bottom_right=True,
         bias_shape="BH", alibi_shape="BH", dropout_p=0.2),
]


def naive_attention(q, k, v, *, softmax_scale=None, window=(-1, -1), bottom_right=False, bias=None,
                    alibi_slopes=None, dropout_p=0.0, dropout_keep=None):
    """softmax(scale * Q K^T + bias + alibi) V one score at a time, with Python floats."""
    batch, sq, hq, d = q.shape
    sk, hk, dv = k.shape[1], k.shape[2], v.shape[3]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    off = sk - sq if bottom_right else 0
    left, right = window
    if bias is not None:
        bias = np.broadcast_to(bias, (batch, hq, sq, sk))
    out = np.zeros((batch, sq, hq, dv))
    lse = np.full((batch, hq, sq), -math.inf)
    for b in range(batch):
        for h in range(hq):
            kv_head = h // (hq // hk)
            slope = None
            if alibi_slopes is not None:
                slope = alibi_slopes[h] if alibi_slopes.ndim == 1 else alibi_slopes[b, h]
            for i in range(sq):
                lowest = i + off - left if left >= 0 else -math.inf
                highest = i + off + right if right >= 0 else math.inf
                logits = {}
                for j in range(sk):
                    if not lowest <= j <= highest:
                        continue
                    s = scale * sum(float(q[b, i, h, c]) * float(k[b, j, kv_head, c]) for c in range(d))
                    if bias is not None:
                        s += float(bias[b, h, i, j])
                    if slope is not None:
                        s -= float(slope) * abs(i + off - j)
                    logits[j] = s
                if not logits:
                    continue
                peak = max(logits.values())
                lse[b, h, i] = peak + math.log(sum(math.exp(s - peak) for s in logits.values()))
                for j, s in logits.items():
                    p = math.exp(s - lse[b, h, i])
                    if dropout_keep is not None:
                        p = p / (1.0 - dropout_p) if dropout_keep[b, h, i, j] else 0.0
                    out[b, i, h, :] += p * v[b, j, kv_head, :]
    return out, lse


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_forward_matches_naive_loops(case):
    inputs, opts, _ = case.make()
    out, lse = mha_fwd_ref(**inputs, **opts)
    want_out, want_lse = naive_attention(**inputs, **opts)
    assert out.dtype == np.float64 and lse.dtype == np.float64
    assert out.shape == (BATCH, case.sq, case.hq, case.dv)
    assert lse.shape == (BATCH, case.hq, case.sq)
    assert rel_err(out, want_out) < 1e-13
    assert rel_err(lse, want_lse) < 1e-13
    assert np.abs(out).sum() > 0


def finite_difference_grad(loss, x, eps=1e-5):
    """Central differences of loss() with respect to every element of x (perturbed in place)."""
    grad = np.zeros_like(x)
    for idx in np.ndindex(x.shape):
        saved = x[idx]
        x[idx] = saved + eps
        up = loss()
        x[idx] = saved - eps
        down = loss()
        x[idx] = saved
        grad[idx] = (up - down) / (2 * eps)
    return grad


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_gradients_match_finite_differences(case):
    inputs, opts, dout = case.make()
    dq, dk, dv, dbias = mha_bwd_ref(dout, **inputs, **opts)

    def loss():
        return float(np.sum(mha_fwd_ref(**inputs, **opts)[0] * dout))

    analytic = {"q": dq, "k": dk, "v": dv}
    if "bias" in opts:
        analytic["bias"] = dbias
    else:
        assert dbias is None
    # Not every gradient need be non-zero (a one-key window makes dq vanish), but dv always is.
    assert np.abs(dv).sum() > 0
    for name, grad in analytic.items():
        x = opts["bias"] if name == "bias" else inputs[name]
        assert grad.shape == x.shape, name
        numeric = finite_difference_grad(loss, x)
        if not numeric.any():  # a relative error to exact zero would only measure rounding noise
            assert np.abs(grad).max() < 1e-12, name
            continue
        assert rel_err(grad, numeric) < 1e-6, name


def test_fully_masked_rows_are_zero_with_no_gradient():
    # Bottom-right causal with more queries than keys: the first sq - sk queries see nothing.
    case = Case("masked_rows_check", sq=6, sk=2, window=(-1, 0), bottom_right=True, bias_shape="BH",
                alibi_shape="H", dropout_p=0.5)
    inputs, opts, dout = case.make()
    out, lse = mha_fwd_ref(**inputs, **opts)
    dq, dk, dv, dbias = mha_bwd_ref(dout, **inputs, **opts)
    masked = slice(0, case.sq - case.sk)
    assert np.all(out[:, masked] == 0.0)
    assert np.all(lse[:, :, masked] == -np.inf)
    assert np.all(dq[:, masked] == 0.0)
    assert np.all(dbias[:, :, masked] == 0.0)
    assert np.all(np.isfinite(lse[:, :, case.sq - case.sk:]))
    assert not any(np.isnan(a).any() for a in (out, lse, dq, dk, dv, dbias))


@pytest.mark.parametrize("sq, sk", [(0, 3), (3, 0), (0, 0), (1, 1)])
def test_empty_and_single_length_batches(sq, sk):
    case = Case(f"lengths_{sq}_{sk}", sq=sq, sk=sk, window=(-1, 0), bottom_right=True)
    inputs, opts, dout = case.make()
    out, lse = mha_fwd_ref(**inputs, **opts)
    want_out, want_lse = naive_attention(**inputs, **opts)
    assert out.shape == (BATCH, sq, 2, case.dv) and lse.shape == (BATCH, 2, sq)
    assert np.array_equal(out, want_out) or rel_err(out, want_out) < 1e-13
    assert np.array_equal(lse, want_lse) or rel_err(lse, want_lse) < 1e-13
    dq, dk, dv, _ = mha_bwd_ref(dout, **inputs, **opts)
    assert dq.shape == inputs["q"].shape and dk.shape == inputs["k"].shape and dv.shape == inputs["v"].shape


VARLEN_SEQLENS_Q = [3, 0, 1, 4, 2]
VARLEN_SEQLENS_K = [4, 2, 1, 0, 5]

VARLEN_CASES = [
    Case("varlen_plain"),
    Case("varlen_causal_top_left", window=(-1, 0)),
    Case("varlen_causal_bottom_right", window=(-1, 0), bottom_right=True),
    Case("varlen_window", window=(1, 1), bottom_right=True),
    Case("varlen_gqa_alibi_H_dropout", hq=4, hk=2, alibi_shape="H", dropout_p=0.3),
    Case("varlen_alibi_BH_causal", hq=4, hk=1, d=4, dv=2, alibi_shape="BH", window=(-1, 0),
         bottom_right=True),
]


def make_varlen(case):
    rng = seeded_rng(case.name)
    batch = len(VARLEN_SEQLENS_Q)
    cu_q = np.concatenate([[0], np.cumsum(VARLEN_SEQLENS_Q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(VARLEN_SEQLENS_K)]).astype(np.int32)
    q = rng.standard_normal((cu_q[-1], case.hq, case.d))
    k = rng.standard_normal((cu_k[-1], case.hk, case.d))
    v = rng.standard_normal((cu_k[-1], case.hk, case.dv))
    dout = rng.standard_normal((cu_q[-1], case.hq, case.dv))
    opts = {"window": case.window, "bottom_right": case.bottom_right}
    if case.alibi_shape is not None:
        shape = (case.hq,) if case.alibi_shape == "H" else (batch, case.hq)
        opts["alibi_slopes"] = rng.uniform(0.1, 1.0, shape)
    if case.dropout_p:
        opts["dropout_p"] = case.dropout_p
        opts["dropout_keep"] = [rng.random((case.hq, sq, sk)) >= case.dropout_p
                                for sq, sk in zip(VARLEN_SEQLENS_Q, VARLEN_SEQLENS_K)]
    return q, k, v, cu_q, cu_k, dout, opts


def sequence_options(opts, b):
    """The batched-call options of sequence b alone."""
    one = dict(opts)
    if "alibi_slopes" in opts and opts["alibi_slopes"].ndim == 2:
        one["alibi_slopes"] = opts["alibi_slopes"][b]
    if "dropout_keep" in opts:
        one["dropout_keep"] = opts["dropout_keep"][b][None]
    return one


@pytest.mark.parametrize("case", VARLEN_CASES, ids=lambda c: c.name)
def test_varlen_equals_per_sequence_batch_calls(case):
    q, k, v, cu_q, cu_k, dout, opts = make_varlen(case)
    out, lse = mha_varlen_fwd_ref(q, k, v, cu_q, cu_k, **opts)
    dq, dk, dv, dbias = mha_varlen_bwd_ref(dout, q, k, v, cu_q, cu_k, **opts)
    assert out.shape == (q.shape[0], case.hq, case.dv) and lse.shape == (case.hq, q.shape[0])
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape and dbias is None
    for b in range(len(cu_q) - 1):
        rq, rk = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        one = sequence_options(opts, b)
        want_out, want_lse = mha_fwd_ref(q[None, rq], k[None, rk], v[None, rk], **one)
        want_dq, want_dk, want_dv, _ = mha_bwd_ref(
            dout[None, rq], q[None, rq], k[None, rk], v[None, rk], **one
        )
        for got, want in [(out[rq], want_out[0]), (lse[:, rq], want_lse[0]), (dq[rq], want_dq[0]),
                          (dk[rk], want_dk[0]), (dv[rk], want_dv[0])]:
            assert got.shape == want.shape
            assert np.array_equal(got, want)
    # The sequence with queries but no keys is fully masked; every other query row has keys.
    empty_k = slice(cu_q[3], cu_q[4])
    assert np.all(out[empty_k] == 0.0) and np.all(lse[:, empty_k] == -np.inf)
    assert np.abs(out).sum() > 0 and np.abs(dq).sum() > 0


def test_varlen_gradients_match_finite_differences():
    case = Case("varlen_fd", hq=4, hk=2, alibi_shape="BH", dropout_p=0.2, window=(-1, 0), bottom_right=True)
    q, k, v, cu_q, cu_k, dout, opts = make_varlen(case)
    dq, dk, dv, _ = mha_varlen_bwd_ref(dout, q, k, v, cu_q, cu_k, **opts)

    def loss():
        return float(np.sum(mha_varlen_fwd_ref(q, k, v, cu_q, cu_k, **opts)[0] * dout))

    for grad, x in [(dq, q), (dk, k), (dv, v)]:
        assert rel_err(grad, finite_difference_grad(loss, x)) < 1e-6


def test_varlen_bias_is_not_implemented():
    q, k, v, cu_q, cu_k, dout, _ = make_varlen(Case("varlen_bias"))
    bias = np.ones((1, 2, q.shape[0], k.shape[0]))
    with pytest.raises(FmhaNotImplementedError):
        mha_varlen_fwd_ref(q, k, v, cu_q, cu_k, bias=bias)
    with pytest.raises(NotImplementedError):
        mha_varlen_bwd_ref(dout, q, k, v, cu_q, cu_k, bias=bias)


class ArrayLike:
    def __init__(self, data):
        self.data = data

    def __array__(self, dtype=None, copy=None):
        return self.data if dtype is None else self.data.astype(dtype)


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_low_precision_and_array_like_inputs_are_upcast(dtype):
    inputs, opts, dout = Case(f"upcast_{np.dtype(dtype).name}", window=(-1, 0)).make()
    low = {name: x.astype(dtype) for name, x in inputs.items()}
    exact = {name: x.astype(np.float64) for name, x in low.items()}
    out, lse = mha_fwd_ref(**{name: ArrayLike(x) for name, x in low.items()}, **opts)
    want_out, want_lse = mha_fwd_ref(**exact, **opts)
    assert out.dtype == np.float64
    assert np.array_equal(out, want_out) and np.array_equal(lse, want_lse)
    grads = mha_bwd_ref(dout.astype(dtype), **low, **opts)
    assert all(g.dtype == np.float64 for g in grads[:3])


def test_rel_err():
    b = np.array([1.0, -np.inf, 2.0, np.inf])
    assert rel_err(b, b.copy()) == 0.0
    assert rel_err(np.array([1.0, -np.inf, 2.0 + 1e-3, np.inf]), b) == pytest.approx(1e-3 / math.sqrt(5))
    assert rel_err(np.array([1.0, 0.0, 2.0, np.inf]), b) == np.inf
    assert rel_err(np.array([1.0, np.inf, 2.0, np.inf]), b) == np.inf
    assert rel_err(np.zeros(3), np.zeros(3)) == 0.0
    assert rel_err(np.full(2, 1e-3), np.zeros(2)) > 1e100
    with pytest.raises(FmhaValueError):
        rel_err(np.zeros(2), np.zeros(3))


def test_invalid_arguments_are_refused():
    inputs, _, _ = Case("refusals", hq=3, hk=2).make()
    with pytest.raises(FmhaValueError, match="multiple"):
        mha_fwd_ref(**inputs)
    inputs, _, _ = Case("refusals_ok").make()
    keep = np.ones((BATCH, 2, 4, 4), dtype=bool)
    with pytest.raises(FmhaValueError, match="dropout_keep"):
        mha_fwd_ref(**inputs, dropout_p=0.1)
    with pytest.raises(FmhaTypeError, match="bool"):
        mha_fwd_ref(**inputs, dropout_p=0.1, dropout_keep=keep.astype(np.float32))
    with pytest.raises(FmhaValueError, match="shape"):
        mha_fwd_ref(**inputs, dropout_p=0.1, dropout_keep=keep[:, :1])
    with pytest.raises(FmhaValueError, match="dropout_p"):
        mha_fwd_ref(**inputs, dropout_p=1.0, dropout_keep=keep)
    with pytest.raises(FmhaValueError, match="window"):
        mha_fwd_ref(**inputs, window=(-2, 0))
    with pytest.raises(FmhaValueError, match="bias"):
        mha_fwd_ref(**inputs, bias=np.ones((BATCH, 2, 4, 5)))
    with pytest.raises(FmhaValueError, match="alibi_slopes"):
        mha_fwd_ref(**inputs, alibi_slopes=np.ones(3))
    with pytest.raises(FmhaTypeError):
        mha_fwd_ref(inputs["q"].astype(np.int32), inputs["k"], inputs["v"])
    with pytest.raises(FmhaValueError, match="dout"):
        mha_bwd_ref(np.ones((BATCH, 4, 2, 2)), **inputs)
    q, k, v, cu_q, cu_k, _, _ = make_varlen(Case("varlen_refusals"))
    with pytest.raises(FmhaValueError, match="cu_seqlens_q"):
        mha_varlen_fwd_ref(q, k, v, cu_q[:-1], cu_k)
    with pytest.raises(FmhaTypeError, match="cu_seqlens_k"):
        mha_varlen_fwd_ref(q, k, v, cu_q, cu_k.astype(np.float64))
