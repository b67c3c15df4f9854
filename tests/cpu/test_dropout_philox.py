"""The kernels' dropout against an independent Philox (tests/philox_reference.py) under the CPU
interpreter: the mask kernel draws exactly that mask, and the attention kernels (forward and backward,
batched and varlen) drop exactly those probabilities, so a mistake the mask kernel shares with them (one
mask for every head, a counter cut to 32 bits) fails here. Seeds and offsets are in the test ids; offsets
near 2^32 make the counters cross into their high word, seeds past 2^32 use the key's high word.
Inputs are fp16 (the interpreter mishandles bf16), outputs poisoned with NaN before each run.
"""
import numpy as np
import pytest
import torch

import interpret_exec as ie
import philox_reference
from error_bounds import assert_close, assert_lse_close
from fmha_rt.plan.problem import AttentionProblem
from fmha_rt.reference import mha_bwd_ref, mha_fwd_ref, mha_varlen_bwd_ref, mha_varlen_fwd_ref

TOL = 5e-3  # fp16 inputs, fp32 accumulation (as test_portable_kernels)

MASK_CASES = [
    # seed, offset, B, Hq, Sq, Sk, p
    (0, 0, 1, 1, 20, 16, 0.5),
    (1234, 77, 2, 3, 37, 45, 0.25),
    (2**32 + 5, 2**32 - 300, 2, 2, 33, 18, 0.1),  # key high word; counters cross 2^32 mid-call
    (2**63 - 1, 2**40 + 3, 1, 4, 17, 61, 0.8),
    (-1099511627783, 3, 1, 2, 19, 23, 0.5),  # a negative int64 seed: by value and from memory, the same 64 bits
]


def _mask_id(case):
    seed, offset, b, h, sq, sk, p = case
    return f"seed{seed}_offset{offset}_b{b}h{h}_{sq}x{sk}_p{p}"


def test_philox_reference_reproduces_the_published_known_answers():
    for counter, key, want in philox_reference.KNOWN_ANSWERS:
        got = philox_reference.philox4x32(counter, key)
        assert [int(x) for x in got] == list(want), (counter, key)


@pytest.mark.parametrize("case", MASK_CASES, ids=[_mask_id(c) for c in MASK_CASES])
def test_mask_kernel_draws_the_independent_philox_mask(case):
    seed, offset, b, h, sq, sk, p = case
    problem = AttentionProblem(b, sq, sk, h, h, 32, 32, "fp16", dropout_p=p)
    want = philox_reference.keep_mask(seed, offset, b, h, sq, sk, p)
    by_value = ie.dropout_mask(problem, {"philox_seed": seed, "philox_offset": offset}).numpy()
    differ = np.argwhere(by_value != want)
    assert not differ.size, f"{len(differ)} keep decisions differ, first at [b, h, i, j] = {differ[0].tolist()}"
    pointer = {"philox_seed_offset": torch.tensor([seed, offset], dtype=torch.int64)}
    assert np.array_equal(ie.dropout_mask(problem, pointer).numpy(), want), "seed and offset read from memory"


def _fp16(gen, *shape):
    return torch.randn(*shape, generator=gen).to(torch.float16)


def _np(t):
    return t.double().numpy()


@pytest.mark.parametrize("seed,offset", [(99, 5), (2**32 + 17, 2**32 - 1000)], ids=["seed99_offset5",
                                                                                    "seed4294967313_offset4294966296"])
def test_attention_drops_the_independent_mask_batched(seed, offset):
    """GQA (4 query heads on 2 key heads), causal bottom-right, Sk not a multiple of 4."""
    b, sq, sk, hq, hk, d, p = 2, 30, 42, 4, 2, 32, 0.3
    problem = AttentionProblem(b, sq, sk, hq, hk, d, d, "fp16", window_left=-1, window_right=0, bottom_right=True,
                               dropout_p=p)
    gen = torch.Generator().manual_seed(71)
    inputs = {"q": _fp16(gen, b, sq, hq, d), "k": _fp16(gen, b, sk, hk, d), "v": _fp16(gen, b, sk, hk, d),
              "philox_seed": seed, "philox_offset": offset}
    keep = philox_reference.keep_mask(seed, offset, b, hq, sq, sk, p)
    ref = {"window": (-1, 0), "bottom_right": True, "dropout_p": p, "dropout_keep": keep}
    q, k, v = (_np(inputs[n]) for n in ("q", "k", "v"))
    out, lse = ie.forward(problem, inputs)
    want_out, want_lse = mha_fwd_ref(q, k, v, **ref)
    assert_close("out", out, want_out, TOL)
    assert_lse_close("lse", lse, want_lse)
    dout = _fp16(gen, *out.shape)
    grads = ie.backward(problem, inputs, out, lse, dout)
    want = mha_bwd_ref(_np(dout), q, k, v, **ref)
    for name, got, w in zip(("dq", "dk", "dv"), grads, want):
        assert_close(name, got, w, TOL)


def test_attention_drops_the_independent_mask_varlen():
    """Packed sequences draw from the rows and keys of the call's maximum lengths, counted from each
    sequence's start."""
    seed, offset, p = 4242, 2**32 - 64, 0.2
    lens_q, lens_k, hq, hk, d = [17, 1, 30], [25, 3, 30], 2, 1, 32
    gen = torch.Generator().manual_seed(72)
    cu = [torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int32) for lens in (lens_q, lens_k)]
    tensors = {"q": _fp16(gen, sum(lens_q), hq, d), "k": _fp16(gen, sum(lens_k), hk, d),
               "v": _fp16(gen, sum(lens_k), hk, d), "cu_seqlens_q": cu[0], "cu_seqlens_k": cu[1],
               "philox_seed": seed, "philox_offset": offset}
    problem = AttentionProblem(len(lens_q), max(lens_q), max(lens_k), hq, hk, d, d, "fp16", dropout_p=p, varlen=True,
                               total_q=sum(lens_q), total_k=sum(lens_k))
    keep = philox_reference.varlen_keep_masks(seed, offset, hq, lens_q, lens_k, p)
    cu_q, cu_k = (c.numpy().copy() for c in cu)
    ref = {"dropout_p": p, "dropout_keep": keep}
    q, k, v = (_np(tensors[n]) for n in ("q", "k", "v"))
    out, lse = ie.forward(problem, tensors)
    want_out, want_lse = mha_varlen_fwd_ref(q, k, v, cu_q, cu_k, **ref)
    assert_close("out", out, want_out, TOL)
    assert_lse_close("lse", lse, want_lse)
    dout = _fp16(gen, *out.shape)
    grads = ie.backward(problem, tensors, out, lse, dout)
    want = mha_varlen_bwd_ref(_np(dout), q, k, v, cu_q, cu_k, **ref)
    for name, got, w in zip(("dq", "dk", "dv"), grads, want):
        assert_close(name, got, w, TOL)
