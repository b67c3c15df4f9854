"""The portable Triton kernels under the CPU interpreter, checked against the float64 reference.

Kernels run with the 'interpret' tile table (16-32 row tiles), so that tiny problems still span several
blocks and exercise the mask-free / boundary split. Inputs are fp16 (the interpreter mishandles bf16).
Outputs are poisoned with NaN before each run; every element a kernel owns must be written. Errors are
bounded for the whole tensor, per head and per row.
"""
import dataclasses
import importlib
import json
import math
import os
import subprocess
import sys
import zlib

import numpy as np
import pytest
import torch

import interpret_exec as ie
from error_bounds import assert_close, assert_lse_close
from fmha_rt.plan import portable as pp
from fmha_rt.plan import abi
from fmha_rt.plan.args import philox_counters
from fmha_rt.errors import FmhaNotImplementedError, FmhaValueError
from fmha_rt.plan.problem import BIAS_SHAPES, AttentionProblem
from fmha_rt.reference import mha_bwd_ref, mha_fwd_ref, mha_varlen_bwd_ref, mha_varlen_fwd_ref

TOL = 5e-3  # fp16 inputs, fp32 accumulation: observed errors are ~3e-4
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _randn(gen, *shape):
    return torch.randn(*shape, generator=gen).to(torch.float16)


def _np(t):
    return t.double().numpy() if isinstance(t, torch.Tensor) else t


def _close(name, got, want, tol=TOL):
    """Whole tensor, per head and per row (tests/error_bounds.py); LSE rows are its elements, dbias has
    its heads third from last."""
    if name == "lse":
        assert_lse_close(name, _np(got), want, tol)
    else:
        assert_close(name, _np(got), want, tol, head_axis=-3 if name == "dbias" else -2)


def _inputs(gen, b, sq, sk, hq, hk, dqk, dv):
    return {"q": _randn(gen, b, sq, hq, dqk), "k": _randn(gen, b, sk, hk, dqk), "v": _randn(gen, b, sk, hk, dv)}


def _ref_options(problem, **extra):
    return dict(softmax_scale=problem.softmax_scale, window=(problem.window_left, problem.window_right),
                bottom_right=problem.bottom_right, **extra)


def _check_fwd_bwd(problem, inputs, gen, ref_extra=None, strategy=None, grad_of=("q", "k", "v")):
    """Runs forward and backward, compares everything with the reference; returns the outputs."""
    ref_extra = ref_extra or {}
    arrays = {n: _np(t) for n, t in inputs.items() if n in ("q", "k", "v")}
    out, lse = ie.forward(problem, inputs)
    ref_out, ref_lse = mha_fwd_ref(arrays["q"], arrays["k"], arrays["v"], **_ref_options(problem, **ref_extra))
    _close("out", out, ref_out)
    _close("lse", lse, ref_lse)
    dout = _randn(gen, *out.shape)
    grads = ie.backward(problem, inputs, out, lse, dout, dq_strategy=strategy)
    ref = mha_bwd_ref(_np(dout), arrays["q"], arrays["k"], arrays["v"], **_ref_options(problem, **ref_extra))
    for name, got, want in zip(("dq", "dk", "dv", "dbias"), grads, ref):
        if want is not None:
            _close(name, got, want)
    return out, lse, grads


# ----------------------------------------------------------------------------- shapes and masks

MASK_CASES = {
    # name: (B, Sq, Sk, Hq, Hk, Dqk, Dv, window, bottom_right, dq strategy)
    "mha_d64_nomask": (2, 48, 40, 2, 2, 64, 64, (-1, -1), False, pp.DQ_ATOMIC),
    "gqa_d40_causal_topleft": (1, 40, 56, 4, 2, 40, 40, (-1, 0), False, pp.DQ_DETERMINISTIC),
    "mqa_d8_causal_bottomright_sq_gt_sk": (1, 56, 40, 3, 1, 8, 8, (-1, 0), True, pp.DQ_ATOMIC),
    "d128_causal_bottomright_sq_lt_sk": (1, 24, 70, 2, 2, 128, 128, (-1, 0), True, pp.DQ_DETERMINISTIC),
    "d192_v128_sliding_window": (1, 45, 45, 2, 1, 192, 128, (7, 3), False, pp.DQ_DETERMINISTIC),
    "gqa_d256_causal_flat_dkdv_loop": (1, 40, 48, 4, 2, 256, 256, (-1, 0), False, pp.DQ_DETERMINISTIC),
    "d32_left_window_bottomright": (1, 50, 40, 2, 2, 32, 32, (16, -1), True, pp.DQ_ATOMIC),
    "d16_narrow_window_rows_masked": (1, 40, 20, 2, 2, 16, 16, (2, 1), False, pp.DQ_ATOMIC),
    # Head dims that are not multiples of 8 run on zero-padded copies (plan_head_padding).
    "padded_d1_nomask": (1, 40, 37, 2, 2, 1, 1, (-1, -1), False, pp.DQ_ATOMIC),
    "padded_gqa_d5_causal_topleft": (2, 40, 33, 4, 2, 5, 5, (-1, 0), False, pp.DQ_DETERMINISTIC),
    "padded_mqa_d13_causal_bottomright": (1, 45, 60, 3, 1, 13, 13, (-1, 0), True, pp.DQ_ATOMIC),
    "padded_d36_window": (1, 40, 40, 2, 2, 36, 36, (9, 4), False, pp.DQ_DETERMINISTIC),
    "padded_d100_causal_bottomright_sq_gt_sk": (1, 48, 30, 2, 1, 100, 100, (-1, 0), True, pp.DQ_DETERMINISTIC),
    "padded_d13_v40_only_qk_pads": (1, 36, 36, 2, 2, 13, 40, (-1, -1), False, pp.DQ_DETERMINISTIC),
    "padded_d40_v5_only_v_pads": (1, 36, 44, 2, 1, 40, 5, (-1, 0), True, pp.DQ_ATOMIC),
    # the FUSED strategy: dK/dV and dQ programs in one grid after the Delta/Lse2 pre-pass
    "fused_gqa_d64_causal_topleft": (1, 40, 56, 4, 2, 64, 64, (-1, 0), False, pp.DQ_FUSED),
    "fused_d128_causal_bottomright_sq_lt_sk": (2, 24, 70, 2, 2, 128, 128, (-1, 0), True, pp.DQ_FUSED),
    "fused_mqa_d32_sliding_window": (1, 45, 45, 3, 1, 32, 32, (7, 3), False, pp.DQ_FUSED),
}
# the ORDERED strategy (the persistent dK/dV pass adding dQ in key-block order, test_ordered_dq.py) on the
# shapes and masks of these cases
MASK_CASES.update({f"ordered_{name}": MASK_CASES[name][:-1] + (pp.DQ_ORDERED,) for name in (
    "mha_d64_nomask", "gqa_d40_causal_topleft", "mqa_d8_causal_bottomright_sq_gt_sk",
    "d128_causal_bottomright_sq_lt_sk", "d192_v128_sliding_window", "gqa_d256_causal_flat_dkdv_loop",
    "d16_narrow_window_rows_masked", "padded_mqa_d13_causal_bottomright", "d32_left_window_bottomright")})


@pytest.mark.parametrize("case", sorted(MASK_CASES))
def test_shapes_and_masks_match_reference(case):
    b, sq, sk, hq, hk, dqk, dv, (left, right), bottom_right, strategy = MASK_CASES[case]
    problem = AttentionProblem(b, sq, sk, hq, hk, dqk, dv, "fp16", window_left=left, window_right=right,
                               bottom_right=bottom_right)
    gen = _gen(zlib.crc32(case.encode()))
    _check_fwd_bwd(problem, _inputs(gen, b, sq, sk, hq, hk, dqk, dv), gen, strategy=strategy)


def test_fully_masked_rows_are_zero_with_minus_inf_lse():
    # Causal bottom-right with Sq > Sk: the first Sq - Sk queries see no key.
    b, sq, sk, h, d = 1, 40, 24, 2, 32
    problem = AttentionProblem(b, sq, sk, h, h, d, d, "fp16", window_left=-1, window_right=0, bottom_right=True)
    gen = _gen(3)
    inputs = _inputs(gen, b, sq, sk, h, h, d, d)
    out, lse, (dq, _, _, _) = _check_fwd_bwd(problem, inputs, gen)
    blind = sq - sk
    assert torch.equal(out[:, :blind], torch.zeros_like(out[:, :blind]))
    assert bool(torch.all(lse[:, :, :blind] == float("-inf")))
    assert torch.equal(dq[:, :blind], torch.zeros_like(dq[:, :blind]))
    assert bool(torch.isfinite(lse[:, :, blind:]).all())


def test_window_sides_reaching_past_both_sequences_act_as_unbounded():
    """A side of 2^31 - 1 (valid by the API) made the kernels' int32 window arithmetic wrap, and every row
    saw no key. The problem now takes such a side as the unbounded one it equals; the outputs match the
    reference computed with the side as given."""
    b, sq, sk, h, d = 1, 40, 44, 2, 32
    given = (3, 2**31 - 1)
    problem = AttentionProblem(b, sq, sk, h, h, d, d, "fp16", window_left=given[0], window_right=given[1])
    assert (problem.window_left, problem.window_right) == (3, -1)
    gen = _gen(6)
    inputs = _inputs(gen, b, sq, sk, h, h, d, d)
    out, lse = ie.forward(problem, inputs)
    arrays = [_np(inputs[n]) for n in ("q", "k", "v")]
    ref_out, ref_lse = mha_fwd_ref(*arrays, softmax_scale=problem.softmax_scale, window=given, bottom_right=False)
    _close("out", out, ref_out)
    _close("lse", lse, ref_lse)
    edge = AttentionProblem(b, sq, sk, h, h, d, d, "fp16", window_left=sq + sk - 1, window_right=sq + sk)
    assert (edge.window_left, edge.window_right) == (sq + sk - 1, -1)
    with pytest.raises(FmhaNotImplementedError, match="2\\^30"):
        AttentionProblem(1, 2**29, 2**29, h, h, d, d, "fp16")


def test_empty_key_sequence_gives_zero_output():
    problem = AttentionProblem(1, 20, 0, 2, 2, 32, 32, "fp16")
    gen = _gen(4)
    out, lse = ie.forward(problem, _inputs(gen, 1, 20, 0, 2, 2, 32, 32))
    assert torch.equal(out, torch.zeros_like(out))
    assert bool(torch.all(lse == float("-inf")))


# ----------------------------------------------------------------------------------- bias, ALiBi


@pytest.mark.parametrize("shape", BIAS_SHAPES)
def test_bias_and_its_gradient_in_every_broadcast_shape(shape):
    b, sq, sk, h, d = 2, 24, 40, 2, 32
    problem = AttentionProblem(b, sq, sk, h, h, d, d, "fp16", window_left=-1, window_right=0, bottom_right=True,
                               bias_shape=shape, bias_grad=True)
    gen = _gen(10 + BIAS_SHAPES.index(shape))
    bias = _randn(gen, b if shape[0] == "B" else 1, h if shape[1] == "H" else 1, sq, sk)
    inputs = dict(_inputs(gen, b, sq, sk, h, h, d, d), bias=bias)
    _check_fwd_bwd(problem, inputs, gen, ref_extra={"bias": _np(bias)},
                   strategy=pp.DQ_ATOMIC if shape[0] == "B" else pp.DQ_DETERMINISTIC)


@pytest.mark.parametrize("slopes_shape", ["H", "BH"])
def test_alibi_slopes_per_head_and_per_batch(slopes_shape):
    b, sq, sk, hq, hk, d = 2, 30, 44, 4, 2, 32
    problem = AttentionProblem(b, sq, sk, hq, hk, d, d, "fp16", window_left=-1, window_right=0, bottom_right=True,
                               alibi=slopes_shape)
    gen = _gen(20)
    slopes = torch.rand((hq,) if slopes_shape == "H" else (b, hq), generator=gen) * 0.5
    inputs = dict(_inputs(gen, b, sq, sk, hq, hk, d, d), alibi=slopes)
    _check_fwd_bwd(problem, inputs, gen, ref_extra={"alibi_slopes": slopes.double().numpy()})


# --------------------------------------------------------------------------------------- dropout

DROP_P = 0.25


def _dropout_problem(**kw):
    return AttentionProblem(2, 36, 44, 2, 1, 32, 32, "fp16", dropout_p=DROP_P, **kw)


def test_dropout_matches_reference_given_the_kernel_mask():
    problem = _dropout_problem(window_left=-1, window_right=0, bottom_right=True)
    philox = {"philox_seed": 1234, "philox_offset": 77}
    keep = ie.dropout_mask(problem, philox).numpy()
    gen = _gen(30)
    inputs = dict(_inputs(gen, 2, 36, 44, 2, 1, 32, 32), **philox)
    _check_fwd_bwd(problem, inputs, gen, ref_extra={"dropout_p": DROP_P, "dropout_keep": keep})


@pytest.mark.parametrize("strategy", [pp.DQ_FUSED, pp.DQ_ORDERED])
@pytest.mark.parametrize("heads", [(4, 2), (2, 2)], ids=["gqa", "mha"])
@pytest.mark.parametrize("extra", [{"bias_shape": "1HSS", "bias_grad": True}, {"alibi": "BH"},
                                   {"dropout_p": DROP_P}], ids=["bias", "alibi", "dropout"])
def test_fused_and_ordered_backwards_match_reference_with_every_score_term(extra, heads, strategy):
    """The FUSED strategy's dK/dV and dQ programs with each score term, in both forms of its key-block
    programs (GQA: one loop over the group's (head, block) steps; MHA: the nest of one head); the ORDERED
    strategy's persistent dK/dV pass likewise (GQA: the loop over the group's heads; MHA: one head)."""
    (hq, hk), b, sq, sk, d = heads, 2, 36, 48, 32
    problem = AttentionProblem(b, sq, sk, hq, hk, d, d, "fp16", window_left=-1, window_right=0, bottom_right=True,
                               **extra)
    gen = _gen(50)
    inputs = _inputs(gen, b, sq, sk, hq, hk, d, d)
    ref_extra = {}
    if "bias_shape" in extra:
        inputs["bias"] = _randn(gen, 1, hq, sq, sk)
        ref_extra["bias"] = _np(inputs["bias"])
    if "alibi" in extra:
        inputs["alibi"] = torch.rand((b, hq), generator=gen) * 0.5
        ref_extra["alibi_slopes"] = _np(inputs["alibi"])
    if "dropout_p" in extra:
        philox = {"philox_seed": 321, "philox_offset": 8}
        inputs.update(philox)
        ref_extra.update(dropout_p=DROP_P, dropout_keep=ie.dropout_mask(problem, philox).numpy())
    _check_fwd_bwd(problem, inputs, gen, ref_extra=ref_extra, strategy=strategy)


@pytest.mark.parametrize("heads,window,bottom_right", [((4, 2), (-1, 0), True), ((3, 3), (9, 4), False),
                                                       ((4, 1), (-1, -1), False)], ids=["gqa_causal_br", "mha_window", "mqa"])
def test_one_launch_backward_matches_reference(heads, window, bottom_right):
    """The SINGLE strategy (one launch: the fused grid with every program computing its rows' Delta and
    Lse2 from O, dO and the LSE); small problems take it by default."""
    (hq, hk), b, sq, sk, d = heads, 2, 40, 52, 64
    problem = AttentionProblem(b, sq, sk, hq, hk, d, d, "fp16", window_left=window[0], window_right=window[1],
                               bottom_right=bottom_right)
    assert pp.dq_strategy(problem, pp.INTERPRET_ARCH) == pp.DQ_SINGLE
    x = torch.zeros(b, sq, hq, d)
    tensors = ie.operands_of(q=x, k=x, v=x, out=x, dout=x, dq=x, dk=x, dv=x, lse=torch.zeros(b, hq, sq), delta=x, lse2=x)
    assert [launch.variant for launch in pp.plan_bwd(problem, pp.INTERPRET_ARCH, tensors)] == [
        pp.fused_key("fp16", (64, 64), pp.BIAS_NONE, False, hq == hk and pp.single_head_dkdv(pp.INTERPRET_ARCH, (64, 64)),
                     pp.DQ_SINGLE)], "one launch"
    gen = _gen(51)
    _check_fwd_bwd(problem, _inputs(gen, b, sq, sk, hq, hk, d, d), gen)


def test_one_launch_backward_is_built_for_mha_only_on_measured_archs():
    """On sm_90 the one-launch backward exists for one query head per key head: with GQA/MQA its dK/dV
    programs each loop over the group's heads and it measured slower than two launches, so a small GQA
    problem takes the two-kernel backward, and asking for SINGLE names what is built."""
    mha = AttentionProblem(2, 128, 128, 4, 4, 64, 64, "bf16")
    gqa = AttentionProblem(2, 128, 128, 8, 2, 64, 64, "bf16")
    assert pp.dq_strategy(mha, "sm_90") == pp.DQ_SINGLE
    assert pp.dq_strategy(gqa, "sm_90") == pp.DQ_DETERMINISTIC
    assert pp.dq_strategy(gqa, pp.INTERPRET_ARCH) == pp.DQ_SINGLE  # the interpreter builds every form
    with pytest.raises(FmhaNotImplementedError, match="one-launch backward is not built .* one query head per key"):
        pp.dq_strategy(gqa, "sm_90", pp.DQ_SINGLE)
    assert all(k.endswith("_mha") for k in pp.variant_map("sm_90") if k.startswith("fmha_bwd_single_"))


def test_dropout_mask_depends_on_seed_and_offset_only():
    problem = _dropout_problem()
    first = ie.dropout_mask(problem, {"philox_seed": 5, "philox_offset": 0})
    again = ie.dropout_mask(problem, {"philox_seed": 5, "philox_offset": 0})
    assert torch.equal(first, again)
    kept = first.float().mean().item()
    assert abs(kept - (1 - DROP_P)) < 0.02, f"kept fraction {kept:.3f}, expected {1 - DROP_P}"
    assert not torch.equal(first, ie.dropout_mask(problem, {"philox_seed": 6, "philox_offset": 0}))
    # Advancing the offset by the counters a call consumes gives a fresh, non-overlapping stream.
    shifted = ie.dropout_mask(problem, {"philox_seed": 5, "philox_offset": philox_counters(problem)})
    assert 0.3 < (shifted == first).float().mean().item() < 0.9


def test_dropout_seed_and_offset_read_from_device_memory():
    problem = _dropout_problem()
    by_value = {"philox_seed": 99, "philox_offset": 4}
    by_pointer = {"philox_seed_offset": torch.tensor([99, 4], dtype=torch.int64)}
    assert torch.equal(ie.dropout_mask(problem, by_value), ie.dropout_mask(problem, by_pointer))
    gen = _gen(31)
    inputs = _inputs(gen, 2, 36, 44, 2, 1, 32, 32)
    out_value, _ = ie.forward(problem, dict(inputs, **by_value))
    out_pointer, _ = ie.forward(problem, dict(inputs, **by_pointer))
    assert torch.equal(out_value, out_pointer)


# ---------------------------------------------------------------------------------------- varlen


def _varlen_case(gen, lens_q, lens_k, hq, hk, d, gaps):
    """Packed q/k/v with `gaps` padding rows before each sequence; returns physical and compact data."""
    starts_q, starts_k, pos_q, pos_k = [], [], 0, 0
    for lq, lk, gap in zip(lens_q, lens_k, gaps):
        pos_q += gap
        pos_k += gap
        starts_q.append(pos_q)
        starts_k.append(pos_k)
        pos_q += lq
        pos_k += lk
    cu = lambda lens: torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int32)  # noqa: E731
    tensors = {"q": _randn(gen, pos_q, hq, d), "k": _randn(gen, pos_k, hk, d), "v": _randn(gen, pos_k, hk, d),
               "cu_seqlens_q": cu(lens_q), "cu_seqlens_k": cu(lens_k)}
    rows_q = np.concatenate([np.arange(s, s + n) for s, n in zip(starts_q, lens_q)]).astype(np.int64)
    rows_k = np.concatenate([np.arange(s, s + n) for s, n in zip(starts_k, lens_k)]).astype(np.int64)
    if any(gaps):
        tensors["seqstart_q"] = torch.tensor(starts_q + [pos_q], dtype=torch.int32)
        tensors["seqstart_k"] = torch.tensor(starts_k + [pos_k], dtype=torch.int32)
    return tensors, torch.from_numpy(rows_q), torch.from_numpy(rows_k)


@pytest.mark.parametrize("d", [32, 13])
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("strategy", [pp.DQ_ATOMIC, pp.DQ_DETERMINISTIC, pp.DQ_FUSED, pp.DQ_ORDERED])
def test_varlen_with_empty_and_single_row_sequences(padded, strategy, d):
    lens_q, lens_k = [0, 1, 37, 20, 9], [6, 0, 44, 20, 1]
    hq, hk = 4, 2
    gaps = [3, 1, 5, 0, 2] if padded else [0] * 5
    gen = _gen(40 + padded)
    tensors, rows_q, rows_k = _varlen_case(gen, lens_q, lens_k, hq, hk, d, gaps)
    problem = AttentionProblem(len(lens_q), max(lens_q), max(lens_k), hq, hk, d, d, "fp16", window_left=-1,
                               window_right=0, bottom_right=True, varlen=True, total_q=tensors["q"].shape[0],
                               total_k=tensors["k"].shape[0])
    q, k, v = (tensors[n][r] for n, r in (("q", rows_q), ("k", rows_k), ("v", rows_k)))
    cu_q, cu_k = (tensors[n].numpy().copy() for n in ("cu_seqlens_q", "cu_seqlens_k"))
    opts = _ref_options(problem)

    out, lse = ie.forward(problem, tensors)
    ref_out, ref_lse = mha_varlen_fwd_ref(_np(q), _np(k), _np(v), cu_q, cu_k, **opts)
    _close("out", out[rows_q], ref_out)
    _close("lse", lse[:, rows_q], ref_lse)
    dout = _randn(gen, *out.shape)
    dq, dk, dv, _ = ie.backward(problem, tensors, out, lse, dout, dq_strategy=strategy)
    ref = mha_varlen_bwd_ref(_np(dout[rows_q]), _np(q), _np(k), _np(v), cu_q, cu_k, **opts)
    for name, got, want in (("dq", dq[rows_q], ref[0]), ("dk", dk[rows_k], ref[1]), ("dv", dv[rows_k], ref[2])):
        _close(name, got, want)
    if padded:  # padding rows belong to no sequence: nothing may write them
        gap_q = torch.ones(out.shape[0], dtype=torch.bool)
        gap_q[rows_q] = False
        gap_k = torch.ones(dk.shape[0], dtype=torch.bool)
        gap_k[rows_k] = False
        assert bool(out[gap_q].isnan().all()) and bool(dq[gap_q].isnan().all())
        assert bool(dk[gap_k].isnan().all()) and bool(dv[gap_k].isnan().all())


def test_varlen_with_dropout_and_alibi():
    lens_q, lens_k = [17, 1, 30], [25, 3, 30]
    hq, hk, d = 2, 2, 32
    gen = _gen(50)
    tensors, rows_q, rows_k = _varlen_case(gen, lens_q, lens_k, hq, hk, d, [0, 0, 0])
    problem = AttentionProblem(3, max(lens_q), max(lens_k), hq, hk, d, d, "fp16", window_left=8, window_right=8,
                               alibi="BH", dropout_p=DROP_P, varlen=True, total_q=sum(lens_q), total_k=sum(lens_k))
    philox = {"philox_seed": 7, "philox_offset": 0}
    slopes = torch.rand(3, hq, generator=gen)
    tensors.update(philox, alibi=slopes)
    keep = ie.dropout_mask(problem, philox).numpy()
    keep = [keep[b, :, :lq, :lk] for b, (lq, lk) in enumerate(zip(lens_q, lens_k))]
    cu_q, cu_k = (tensors[n].numpy().copy() for n in ("cu_seqlens_q", "cu_seqlens_k"))
    opts = _ref_options(problem, alibi_slopes=slopes.double().numpy(), dropout_p=DROP_P, dropout_keep=keep)
    q, k, v = (_np(tensors[n]) for n in ("q", "k", "v"))

    out, lse = ie.forward(problem, tensors)
    ref_out, ref_lse = mha_varlen_fwd_ref(q, k, v, cu_q, cu_k, **opts)
    _close("out", out, ref_out)
    _close("lse", lse, ref_lse)
    dout = _randn(gen, *out.shape)
    grads = ie.backward(problem, tensors, out, lse, dout)
    ref = mha_varlen_bwd_ref(_np(dout), q, k, v, cu_q, cu_k, **opts)
    for name, got, want in zip(("dq", "dk", "dv"), grads, ref):
        _close(name, got, want)


# -------------------------------------------------------------------------------- determinism


def test_deterministic_backward_with_a_bias_gradient_matches_reference():
    """The DETERMINISTIC strategy (dQ by programs of its own, no accumulator) with dbias. Whether its repeats are bitwise equal
    is a GPU question (the interpreter runs programs one at a time): tests/gpu/test_determinism.py."""
    b, sq, sk, hq, hk, d = 1, 40, 40, 4, 1, 32
    problem = AttentionProblem(b, sq, sk, hq, hk, d, d, "fp16", window_left=-1, window_right=0,
                               bias_shape="11SS", bias_grad=True, deterministic=True)
    gen = _gen(60)
    bias = _randn(gen, 1, 1, sq, sk)
    inputs = dict(_inputs(gen, b, sq, sk, hq, hk, d, d), bias=bias)
    _check_fwd_bwd(problem, inputs, gen, ref_extra={"bias": _np(bias)}, strategy=pp.DQ_DETERMINISTIC)


# ------------------------------------------------------------------------- planning and variants


def test_workspace_layout_matches_hand_computed_sizes():
    # B=2, Sq=100, Sk=77, Hq=8, Dqk=40, tensor bias with gradient.
    problem = AttentionProblem(2, 100, 77, 8, 2, 40, 40, "bf16", bias_shape="B1SS", bias_grad=True)
    rows = 4 * 2 * 8 * 104  # delta and lse2: fp32 [B, Hq, ceil8(Sq) = 104] = 6656 bytes each (26 * 256)
    dq_acc = 4 * 2 * 100 * 8 * 40  # fp32 [B, Sq, Hq, 40]
    ds = 4 * 2 * 8 * 100 * 80  # fp32 [B, Hq, Sq, ceil8(77) = 80]
    ws = pp.bwd_workspace(problem, pp.INTERPRET_ARCH, pp.DQ_ATOMIC)
    assert [(r.name, r.offset, r.nbytes, r.zero_init) for r in ws.regions] == [
        ("delta", 0, rows, False), ("lse2", 6656, rows, False), ("dq_acc", 13312, dq_acc, True),
        ("ds", 13312 + dq_acc, ds, True)]
    assert ws.total_bytes == 13312 + dq_acc + ds and ws.needs_zeroing and ws.dq_splits == 1
    ws = pp.bwd_workspace(problem, pp.INTERPRET_ARCH, pp.DQ_DETERMINISTIC)
    assert [(r.name, r.offset, r.nbytes) for r in ws.regions] == [
        ("delta", 0, rows), ("lse2", 6656, rows), ("ds", 13312, ds)]
    assert ws.dq_splits == 0 and ws.total_bytes == 13312 + ds
    # Varlen Delta and Lse2 are [Hq, ceil8(total_q) + 8 * B] = [3, 104 + 24] (every sequence starts at a
    # multiple of 8 rows); offsets and the total stay 256-aligned.
    varlen = AttentionProblem(3, 50, 50, 3, 3, 64, 64, "fp16", varlen=True, total_q=101, total_k=90,
                              deterministic=True)
    for arch in pp.BUILD_ARCHS:
        ws = pp.bwd_workspace(varlen, arch, pp.DQ_DETERMINISTIC)
        assert [(r.name, r.offset, r.nbytes) for r in ws.regions] == [("delta", 0, 4 * 3 * 128),
                                                                      ("lse2", 1536, 4 * 3 * 128)]
        assert ws.total_bytes == 3072 and not ws.needs_zeroing and ws.dq_splits == 0
        # by default a problem this small takes the one-launch backward where it is built: no workspace
        single = pp.dq_strategy(varlen, arch) == pp.DQ_SINGLE
        assert single == (arch == "sm_90") and (pp.bwd_workspace(varlen, arch).total_bytes == 0) == single
    with pytest.raises(FmhaValueError):
        pp.bwd_workspace(varlen, pp.INTERPRET_ARCH, pp.DQ_ATOMIC)


def test_every_variant_matches_its_kernel_signature():
    for name, source in abi.KERNEL_SOURCE.items():
        fn = getattr(importlib.import_module(abi.KERNEL_MODULES[source]), name)
        assert list(abi.SIGNATURES[name]) == list(fn.arg_names), name
    for arch in pp.BUILD_ARCHS:
        variants = pp.variants(arch)
        assert len({v["key"] for v in variants}) == len(variants)
        for v in variants:
            constexpr_names = [n for n, kind in v["signature"].items() if kind == "constexpr"]
            assert sorted(constexpr_names) == sorted(v["constexprs"]), v["key"]
            assert not any(kind == "*T" for kind in v["signature"].values())


def test_plans_pick_head_dim_tiles_and_reject_unaligned_strides():
    problem = AttentionProblem(1, 64, 64, 2, 2, 192, 128, "bf16")
    assert abi.head_dim_tiles(problem) == (256, 128)
    assert abi.head_dim_tiles(AttentionProblem(1, 8, 8, 1, 1, 96, 96, "fp16")) == (128, 128)
    assert abi.head_dim_tiles(AttentionProblem(1, 8, 8, 1, 1, 64, 128, "fp16")) == (128, 128)
    q = torch.zeros(1, 64, 2, 192, dtype=torch.float16)
    tensors = ie.operands_of(q=q, k=q, v=q[..., :128], out=q[..., :128], lse=torch.zeros(1, 2, 64))
    (launch,) = pp.plan_fwd(problem, "sm_90", tensors)
    assert launch.variant == "fmha_fwd_bf16_d256v128_nobias_nodrop" and launch.grid == (1, 2, 1)
    assert launch.args["head_dim_qk_div8"] == 24 and launch.args["stride_q_s"] == 384
    tensors.k = dataclasses.replace(tensors.k, strides=(64 * 2 * 190, 2 * 190, 190, 1))
    with pytest.raises(FmhaValueError, match="multiple of 8"):
        pp.plan_fwd(problem, "sm_90", tensors)


def test_short_key_forward_takes_the_two_programs_per_sm_tile():
    """sm_90, D=97..128, causal, without bias or dropout, up to SHORT_FWD_MAX_SEQLEN_K keys: the `_short`
    variant, its grid in its own (64-row) query blocks; no mask or another window, longer keys, a score term,
    another head dim or another arch: the regular tile."""
    def planned(arch="sm_90", sk=1024, d=128, **kw):
        kw = {"window_left": -1, "window_right": 0, **kw}
        problem = AttentionProblem(4, 1000, sk, 16, 2, d, d, "bf16", **kw)
        x, kv = torch.zeros(4, 1000, 16, d), torch.zeros(4, sk, 2, d)
        inputs = {"q": x, "k": kv, "v": kv, "out": x, "lse": torch.zeros(4, 16, 1000)}
        if kw.get("bias_shape"):
            inputs["bias"] = torch.zeros(1, 1, 1000, sk)
        if kw.get("dropout_p"):
            inputs.update(philox_seed=1, philox_offset=0)
        (launch,) = pp.plan_fwd(problem, arch, ie.operands_of(**inputs))
        return launch

    short = pp.SHORT_FWD_TILES["sm_90"][(128, 128)]
    for launch in (planned(), planned(sk=pp.SHORT_FWD_MAX_SEQLEN_K)):
        assert launch.variant == "fmha_fwd_bf16_d128_nobias_nodrop_short"
        assert launch.grid == (-(-1000 // short.block_m), 16, 4)
    assert pp.variant_map("sm_90")[launch.variant]["constexprs"]["BLOCK_M"] == short.block_m
    for launch in (planned(window_right=-1), planned(window_left=64, window_right=64),
                   planned(sk=pp.SHORT_FWD_MAX_SEQLEN_K + 8), planned(bias_shape="11SS"), planned(dropout_p=0.1),
                   planned(d=64), planned("gfx942")):
        assert not launch.variant.endswith("_short"), launch.variant


def test_two_kernel_dkdv_issues_dp_first_only_where_listed():
    """DKDV_DP_FIRST: the two-kernel dK/dV objects of the listed pairs without bias or dropout issue
    dO V^T before the exponentials (the interpreter runs that form in the tests above)."""
    for arch in ("sm_90", "gfx942", pp.INTERPRET_ARCH):
        for key, variant in pp.variant_map(arch).items():
            if variant["function"] != "fmha_bwd_dkdv":
                continue
            c = variant["constexprs"]
            expected = ((c["BLOCK_DQK"], c["BLOCK_DV"]) in pp.DKDV_DP_FIRST.get(arch, ())
                        and c["BIAS_KIND"] == pp.BIAS_NONE and not c["DROPOUT"])
            assert c["DP_FIRST"] is expected, key
    assert (128, 128) in pp.DKDV_DP_FIRST["sm_90"]
    assert any(v["constexprs"].get("DP_FIRST") for v in pp.variant_map(pp.INTERPRET_ARCH).values())


def test_fused_backward_is_chosen_where_it_measured_faster(monkeypatch):
    """sm_90: D=128 without bias or dropout, from FUSED_MIN_SEQLEN_K keys, for MHA
    (the `_mha` kernel) and GQA/MQA (the kernel with the loop over the group's heads); below that length,
    at other head dims and with any bias or dropout the two-kernel strategy. Asking for it where it is
    not built names what is. Deterministic calls take it too, unless ORDERED_FOR_DETERMINISTIC names sm_90."""
    long, short = pp.FUSED_MIN_SEQLEN_K, pp.FUSED_MIN_SEQLEN_K - 1

    def strategy(seqlen_k, d=128, heads_k=4, **extra):
        return pp.dq_strategy(AttentionProblem(2, 512, seqlen_k, 4, heads_k, d, d, "bf16", **extra), "sm_90")

    assert strategy(long) == strategy(long, deterministic=True) == pp.DQ_FUSED
    monkeypatch.setattr(pp, "ORDERED_FOR_DETERMINISTIC", frozenset({"sm_90"}))
    assert strategy(long, deterministic=True) == pp.DQ_ORDERED
    assert pp.dq_strategy(AttentionProblem(2, 512, long, 4, 4, 128, 128, "bf16", deterministic=True), "sm_90",
                          pp.DQ_FUSED) == pp.DQ_FUSED
    assert strategy(long, d=96) == pp.DQ_FUSED  # padded to the 128 tile
    assert strategy(long, heads_k=2) == strategy(long, heads_k=1) == pp.DQ_FUSED
    for other in (strategy(short), strategy(short, heads_k=2), strategy(long, d=64), strategy(long, alibi="H"),
                  strategy(long, bias_shape="11SS"), strategy(long, dropout_p=0.1)):
        assert other == pp.DQ_DETERMINISTIC
    for arch in ("gfx942", "gfx950"):
        assert pp.dq_strategy(AttentionProblem(1, 64, long, 2, 2, 128, 128, "bf16"), arch) == pp.DQ_DETERMINISTIC
    with pytest.raises(FmhaNotImplementedError, match=r"fused backward is not built .*d128 without bias or dropout\)"):
        pp.dq_strategy(AttentionProblem(1, 64, 64, 2, 2, 128, 128, "bf16", alibi="H"), "sm_90", pp.DQ_FUSED)
    problem = AttentionProblem(2, 512, long, 4, 4, 128, 128, "bf16")
    x = torch.zeros(2, long, 4, 128, dtype=torch.float16)
    tensors = ie.operands_of(q=x, k=x, v=x, out=x, dout=x, dq=x, dk=x, dv=x, lse=torch.zeros(2, 4, 512),
                              delta=x, lse2=x)
    assert [launch.variant for launch in pp.plan_bwd(problem, "sm_90", tensors)] == [
        "fmha_bwd_preprocess_bf16_v128", "fmha_bwd_fused_bf16_d128_nobias_nodrop_mha"]
    assert pp.bwd_workspace(problem, "sm_90").dq_splits == 0
    gqa = AttentionProblem(2, 512, long, 4, 2, 128, 128, "bf16")
    kv = torch.zeros(2, long, 2, 128, dtype=torch.float16)
    tensors = ie.operands_of(q=x, k=kv, v=kv, out=x, dout=x, dq=x, dk=kv, dv=kv, lse=torch.zeros(2, 4, 512),
                              delta=x, lse2=x)
    (_, fused) = pp.plan_bwd(gqa, "sm_90", tensors)
    assert fused.variant == "fmha_bwd_fused_bf16_d128_nobias_nodrop" and fused.grid == (long // 128 + 2 * 512 // 128, 2, 2)


@pytest.mark.parametrize("arch", pp.BUILD_ARCHS)
def test_plan_grids_agree_with_the_variants_tiles(arch):
    variants = pp.variant_map(arch)
    x = torch.zeros(2, 300, 4, 128, dtype=torch.float16)
    for extra in ({}, {"bias_shape": "1HSS", "bias_grad": True}, {"alibi": "H", "dropout_p": 0.1}):
        problem = AttentionProblem(2, 300, 300, 4, 4, 128, 128, "fp16", **extra)
        tensors = ie.operands_of(q=x, k=x, v=x, out=x, dout=x, dq=x, dk=x, dv=x, lse=torch.zeros(2, 4, 300),
                                  bias=torch.zeros(1, 4, 300, 304)[..., :300], dbias=torch.zeros(1, 4, 300, 304),
                                  alibi=torch.zeros(4), philox_seed=1, delta=x, lse2=x, ds=x)
        for launch in pp.plan_fwd(problem, arch, tensors) + pp.plan_bwd(problem, arch, tensors):
            ce = variants[launch.variant]["constexprs"]
            if "BLOCK_M1" in ce:  # the fused grid: the key-block programs, then the query-block ones
                assert launch.grid[0] == -(-300 // ce["BLOCK_N1"]) + -(-300 // ce["BLOCK_M2"]), launch.variant
            else:
                rows = ce["BLOCK_N"] if "dkdv" in launch.variant else ce["BLOCK_M"]
                assert launch.grid[0] == -(-300 // rows), launch.variant
            assert list(launch.args) == [n for n, k in variants[launch.variant]["signature"].items()
                                         if k != "constexpr"]


@pytest.mark.parametrize("arch", pp.BUILD_ARCHS)
def test_dkdv_drops_its_query_head_loop_where_one_query_head_shares_each_key_head(arch):
    """MHA problems get the dK/dV variant without the loop over a group's query heads on the archs that
    build it (not for the flat-loop head dims); GQA and MQA problems keep the loop everywhere."""
    variants = pp.variant_map(arch)
    for d, hq, hk in ((64, 4, 4), (128, 4, 4), (128, 4, 2), (128, 4, 1), (256, 4, 4)):
        x, kv = torch.zeros(1, 64, hq, d, dtype=torch.float16), torch.zeros(1, 64, hk, d, dtype=torch.float16)
        problem = AttentionProblem(1, 64, 64, hq, hk, d, d, "fp16")
        tensors = ie.operands_of(q=x, k=kv, v=kv, out=x, dout=x, dq=x, dk=kv, dv=kv, lse=torch.zeros(1, hq, 64),
                                  delta=x, lse2=x)
        (dkdv,) = [launch for launch in pp.plan_bwd(problem, arch, tensors, pp.DQ_DETERMINISTIC) if "dkdv" in launch.variant]
        single = hq == hk and arch in pp.DKDV_SINGLE_HEAD and (d, d) not in pp.DKDV_FLAT_LOOP.get(arch, ())
        assert dkdv.variant.endswith("_mha") == single, (arch, d, hq, hk, dkdv.variant)
        v = variants[dkdv.variant]
        assert v["constexprs"]["GROUP_LOOP"] is not single and v["traits"]["single_head"] is single
    assert any(k.endswith("_mha") for k in variants) == (arch in pp.DKDV_SINGLE_HEAD)


_COMPILE_SCRIPT = r"""
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import importlib
from fmha_rt.plan import portable as pp

def attrs(sig):
    out = {}
    for i, (name, kind) in enumerate(sig.items()):
        if kind.startswith("*"):
            out[(i,)] = [["tt.divisibility", 16]]
        elif name.startswith("stride_"):
            out[(i,)] = [["tt.divisibility", 8]]
    return out

report = {}
for arch, target in (("sm_90", GPUTarget("cuda", 90, 32)), ("gfx942", GPUTarget("hip", "gfx942", 64))):
    variants = pp.variant_map(arch)
    fwd = pp.fwd_key("bf16", (128, 128), pp.BIAS_NONE, False)
    bwd = pp.dkdv_key("fp16", (64, 64), pp.BIAS_NONE, False, pp.DEFAULT_DQ_STRATEGY[arch])
    for key in (fwd, bwd):
        v = variants[key]
        fn = getattr(importlib.import_module(v["module"]), v["function"])
        kernel = triton.compile(ASTSource(fn, v["signature"], v["constexprs"], attrs(v["signature"])), target=target,
                                options={"num_warps": v["num_warps"], "num_stages": v["num_stages"]})
        report[f"{arch}/{key.split('_')[1]}"] = "wgmma" in kernel.asm.get("ptx", "")
print(json.dumps(report))
"""


def test_one_forward_and_one_backward_variant_compile_for_sm90_and_gfx942():
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    done = subprocess.run([sys.executable, "-c", _COMPILE_SCRIPT], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(report) == 4
    assert report["sm_90/fwd"], "sm_90 forward does not use wgmma"


def test_scale_and_flops_defaults():
    problem = AttentionProblem(2, 128, 256, 4, 4, 64, 64, "fp16", window_left=-1, window_right=0)
    assert math.isclose(problem.softmax_scale, 1 / 8) and problem.causal
    assert problem.fwd_flops() == 4 * 2 * 4 * 128 * 256 * 64 // 2
