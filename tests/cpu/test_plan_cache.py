"""The plan cache on the CPU: a repeated call of a signature launches, byte for byte, what an uncached call
of the same arrays would launch, with its own pointers written in; anything that changes the plan misses;
what depends on pointers (overlaps, alignment, the workspace) is still checked on a hit, before anything
is launched or written; concurrent calls never share a launch buffer; the cache stays within its bound.

Arrays are host memory exported as CUDA arrays and the runtime is the two-device sm_90 stand-in of
fake_gpu.py. The real executor runs; only the driver is replaced: kernel handles are tokens and each
launch records its kernel, grid, stream and the argument bytes from the C launch configuration.
"""
import dataclasses
import gc
import logging
import os
import subprocess
import sys
import threading
import time
import weakref

import numpy as np
import pytest

import fmha_rt
from fmha_rt import api
from fmha_rt.arrays import Arg
from fmha_rt.call import HostSeqlens
from fmha_rt import call_keys
from fmha_rt.runtime import executor, kernel_launch
from fmha_rt.replay import plan_cache, program as program_model, xla_program
from fmha_rt.plan import portable
from fmha_rt.runtime import registry as registry_module
from fmha_rt.runtime.backend import ffi, lib
from fmha_rt.errors import DriverError, FmhaTypeError, FmhaValueError
from fmha_rt.runtime.packing import Pointer
from fmha_rt.plan.problem import AttentionProblem

from fake_gpu import FakeGpuArray, StandInRuntime

B, S, H, D = 2, 64, 4, 64


@pytest.fixture(autouse=True)
def two_launch_backward(monkeypatch):
    """These problems are small enough for the one-launch backward; the tests here replay the two-kernel
    one (dQ, then dK/dV: patched pointers in two launches, logging, per-stream buffers), except
    test_one_launch_backward_hit_launches_what_an_uncached_call_launches, which sets the limit back."""
    monkeypatch.setattr(portable, "SINGLE_MAX_SCORES", -1)


def unpack(key, packed):
    entry = registry_module.registry().entry("sm_90", key)
    return dict(zip(entry.packer.names, entry.packer.struct.unpack(packed)))


def uncached(monkeypatch, driver, call):
    """What `call` launches planned from scratch: the cache is never asked, the executor packs."""
    with monkeypatch.context() as m:
        m.setattr(call_keys, "key_request", lambda *_: None)
        call()
    return driver.take()


def hits():
    return fmha_rt.plan_cache_info()["hits"]


def warm(call):
    """Call twice: a signature is recorded the second time it is seen."""
    call()
    call()


# ------------------------------------------------------------------------------------- call factories

class Inputs:
    """One set of arrays for every case (fresh memory, so each set has its own pointers)."""

    def __init__(self, rt, *, hq=H, hk=H, d=D, varlen=False, bias=None, alibi=None, seed_array=False):
        lead_q, lead_k = ((3 * S // 2,), (2 * S,)) if varlen else ((B, S), (B, S))
        self.q = FakeGpuArray((*lead_q, hq, d))
        self.k, self.v = FakeGpuArray((*lead_k, hk, d)), FakeGpuArray((*lead_k, hk, d))
        self.out, self.dout = FakeGpuArray((*lead_q, hq, d)), FakeGpuArray((*lead_q, hq, d))
        self.lse = FakeGpuArray((hq, lead_q[0]) if varlen else (B, hq, S), "float32")
        self.dq, self.dk, self.dv = FakeGpuArray(self.q.shape), FakeGpuArray(self.k.shape), FakeGpuArray(self.v.shape)
        self.bias = FakeGpuArray(bias) if bias else None
        self.dbias = FakeGpuArray(bias) if bias else None
        self.alibi = FakeGpuArray(alibi, "float32") if alibi else None
        self.seed = FakeGpuArray((2,), "int64") if seed_array else None
        self.cu_q, self.cu_k = FakeGpuArray((3,), "int32"), FakeGpuArray((3,), "int32")
        self.workspace = rt.workspace(1 << 20)

    def options(self, extra):
        opts = dict(extra)
        if self.bias is not None:
            opts["bias"] = self.bias
        if self.alibi is not None:
            opts["alibi_slopes"] = self.alibi
        if self.seed is not None:
            opts["seed"] = self.seed
        return opts


def fwd(x, **extra):
    return lambda: fmha_rt.mha_fwd(x.q, x.k, x.v, out=x.out, lse=x.lse, **x.options(extra))


def bwd(x, **extra):
    grads = {"dbias": x.dbias} if x.dbias is not None else {}
    return lambda: fmha_rt.mha_bwd(x.dout, x.q, x.k, x.v, x.out, x.lse, dq=x.dq, dk=x.dk, dv=x.dv,
                                   workspace_alloc=lambda n, z: x.workspace, **grads, **x.options(extra))


def varlen_fwd(x, **extra):
    return lambda: fmha_rt.mha_varlen_fwd(x.q, x.k, x.v, x.cu_q, x.cu_k, 40, 70, out=x.out, lse=x.lse,
                                          **x.options(extra))


def varlen_bwd(x, **extra):
    return lambda: fmha_rt.mha_varlen_bwd(x.dout, x.q, x.k, x.v, x.out, x.lse, x.cu_q, x.cu_k, 40, 70, dq=x.dq,
                                          dk=x.dk, dv=x.dv, workspace_alloc=lambda n, z: x.workspace,
                                          **x.options(extra))


CASES = {
    "fwd": (fwd, {}, {}),
    "fwd causal GQA": (fwd, {"hq": 8, "hk": 2}, {"causal": True}),
    "fwd window bottom-right": (fwd, {}, {"window": (16, 8), "causal_alignment": "bottom_right"}),
    "fwd bias": (fwd, {"bias": (1, H, S, S)}, {}),
    "fwd alibi": (fwd, {"alibi": (B, H)}, {"softmax_scale": 0.3}),
    "fwd dropout": (fwd, {}, {"dropout_p": 0.2, "seed": 2**64 + 5, "offset": 12}),
    "fwd dropout seed array": (fwd, {"seed_array": True}, {"dropout_p": 0.2}),
    "bwd": (bwd, {}, {}),
    "bwd deterministic": (bwd, {}, {"deterministic": True, "causal": True}),
    "bwd GQA": (bwd, {"hq": 8, "hk": 2}, {"deterministic": True}),
    "bwd bias grad": (bwd, {"bias": (B, 1, S, S)}, {}),
    "bwd alibi dropout": (bwd, {"alibi": (H,)}, {"dropout_p": 0.1, "seed": 7, "offset": 3}),
    "varlen fwd": (varlen_fwd, {"hq": 8, "hk": 2, "varlen": True}, {"causal": True}),
    "varlen bwd": (varlen_bwd, {"varlen": True}, {"deterministic": True}),
    "bwd head dim 60 (padded)": (bwd, {"d": 60}, {"causal": True}),
}


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_a_hit_launches_what_an_uncached_call_of_its_arrays_launches(monkeypatch, rt, driver, case):
    make, shape, options = CASES[case]
    first, second = Inputs(rt, **shape), Inputs(rt, **shape)
    expected = uncached(monkeypatch, driver, make(second, **options))
    assert expected and fmha_rt.plan_cache_info()["entries"] == 0
    make(first, **options)()  # seen once: planned, not recorded
    assert fmha_rt.plan_cache_info()["entries"] == 0
    make(first, **options)()  # seen again: recorded, and its launches are the recorded plan's
    assert fmha_rt.plan_cache_info()["entries"] == 1
    launched = driver.take()
    assert launched == uncached(monkeypatch, driver, make(first, **options)) * 2, \
        "the recording call launches what a planned call launches"
    make(second, **options)()
    assert hits() == 1
    got = driver.take()
    assert got == expected  # kernels, grids, streams and every argument byte
    # ... and the pointers really are the second call's: they differ from the first call's
    first_args = [unpack(k, b) for k, _, b, _ in uncached(monkeypatch, driver, make(first, **options))]
    second_args = [unpack(k, b) for k, _, b, _ in got]
    # the launch that reads q (the attention, or the copy that widens q when the head dim is padded)
    reads_q = next(i for i, args in enumerate(second_args) if second.q.ptr in (args.get("Q"), args.get("UnalignedArray")))
    assert second.q.ptr not in (first_args[reads_q].get("Q"), first_args[reads_q].get("UnalignedArray"))
    assert all(a != b for a, b in zip(first_args, second_args))


@pytest.mark.parametrize("case", ["bwd", "varlen bwd"])
def test_one_launch_backward_hit_launches_what_an_uncached_call_launches(monkeypatch, rt, driver, case):
    """The small MHA problems of CASES with the one-launch backward (this module's fixture turns it off;
    sm_90 builds it for one query head per key head only): one launch of the fused grid, replayed like
    any other plan."""
    monkeypatch.setattr(portable, "SINGLE_MAX_SCORES", 1 << 20)
    make, shape, options = CASES[case]
    x = Inputs(rt, **shape)
    driver.take()
    launched = uncached(monkeypatch, driver, make(x, **options))
    assert [key[:len("fmha_bwd_single_")] for key, *_ in launched] == ["fmha_bwd_single_"], launched
    fmha_rt.clear_plan_cache()
    test_a_hit_launches_what_an_uncached_call_of_its_arrays_launches(monkeypatch, rt, driver, case)


def test_dropout_by_value_patches_the_seed_and_offset_of_each_call(monkeypatch, rt, driver):
    x = Inputs(rt)
    warm(fwd(x, dropout_p=0.3, seed=1, offset=0))
    driver.take()
    for seed, offset in ((5, 7), (2**63 + 9, 2**62), (0, 0)):
        fwd(x, dropout_p=0.3, seed=seed, offset=offset)()
        (key, _, packed, _), = driver.take()
        args = unpack(key, packed)
        int64_seed = seed - 2**64 if seed >= 2**63 else seed  # the seed's 64 bits, as the device array holds them
        assert (args["philox_seed"], args["philox_offset"]) == (int64_seed, offset)
        assert uncached(monkeypatch, driver, fwd(x, dropout_p=0.3, seed=seed, offset=offset))[0][2] == packed
    assert hits() == 3
    with pytest.raises(FmhaValueError, match="offset"):
        fwd(x, dropout_p=0.3, seed=1, offset=-1)()
    assert driver.take() == []


def test_allocated_outputs_and_workspace_get_this_calls_addresses(rt, driver):
    """The backward allocates dq, dk, dv, dbias and its workspace on every call; the patched launches
    point at this call's allocations, and the zeroed regions are zeroed again."""
    x = Inputs(rt, bias=(1, 1, S, S))
    dbias_shape = (1, 1, S, S)
    for call in range(4):
        rt.reset()
        dq, dk, dv, dbias = fmha_rt.mha_bwd(x.dout, x.q, x.k, x.v, x.out, x.lse, bias=x.bias, deterministic=True)
        assert tuple(dbias.shape) == dbias_shape
        launched = {key: unpack(key, packed) for key, _, packed, _ in driver.take()}
        dq_kernel = next(a for k, a in launched.items() if k.startswith("fmha_bwd_dq_"))
        dkdv = next(a for k, a in launched.items() if k.startswith("fmha_bwd_dkdv_"))
        assert (dq_kernel["dQ"], dkdv["dK"], dkdv["dV"]) == (dq.ptr, dk.ptr, dv.ptr)
        assert launched["fmha_bwd_dbias_fp16"]["dBias"] == dbias.ptr
        assert dkdv["dS"] == launched["fmha_bwd_dbias_fp16"]["dS"] > dkdv["Delta"]
        # the stand-in's memset fails outside its allocations: dS is in this call's workspace, zeroed again
        assert [(dev, ptr) for dev, ptr, _ in rt.memsets] == [(0, dkdv["dS"])]
    assert hits() == 2


def test_a_cached_ordered_backward_zeroes_its_accumulator_and_counters_every_call(monkeypatch, rt, driver):
    """The deterministic backward's ORDERED strategy from the cache: the pre-pass, the persistent dK/dV pass
    and the conversion, with this call's pointers, and the dQ accumulator and the order counters zeroed
    before every call (a hit's counters left at their last values would make the pass wait for ever)."""
    monkeypatch.setattr(portable, "ORDERED_FOR_DETERMINISTIC", frozenset({"sm_90"}))
    x = Inputs(rt)
    for call in range(4):
        rt.reset()
        dq, dk, dv = fmha_rt.mha_bwd(x.dout, x.q, x.k, x.v, x.out, x.lse, deterministic=True)
        launched = {key: unpack(key, packed) for key, _, packed, _ in driver.take()}
        assert [key.split("_fp16")[0] for key in launched] == ["fmha_bwd_preprocess", "fmha_bwd_dkdv",
                                                               "fmha_bwd_dq_convert"]
        dkdv = next(a for k, a in launched.items() if k.startswith("fmha_bwd_dkdv_"))
        convert = next(a for k, a in launched.items() if k.startswith("fmha_bwd_dq_convert_"))
        assert (convert["dQ"], dkdv["dK"], dkdv["dV"], convert["DqAcc"]) == (dq.ptr, dk.ptr, dv.ptr, dkdv["DqAcc"])
        assert [(dev, ptr) for dev, ptr, _ in rt.memsets] == [(0, dkdv["DqAcc"]), (0, dkdv["DqOrder"])]
    assert hits() == 2


def test_torch_tensors_take_the_fast_signature_and_hit(monkeypatch, rt, driver, torch_as_cuda):
    """torch tensors (CPU tensors posing as CUDA ones) are keyed by the shim (describe.c); a hit launches what
    the uncached call launches, and a tensor of other strides misses."""
    torch = pytest.importorskip("torch")
    q, k, v = (torch.randn(B, S, H, D, dtype=torch.float16) for _ in range(3))
    fmha_rt.mha_fwd(q, k, v, causal=True)
    out, _ = fmha_rt.mha_fwd(q, k, v, causal=True)
    assert isinstance(out, torch.Tensor)
    driver.take()
    out2, _ = fmha_rt.mha_fwd(q, k, v, causal=True)
    assert hits() == 1 and out2.data_ptr() != out.data_ptr()
    got = driver.take()
    assert unpack(got[0][0], got[0][2])["Out"] == out2.data_ptr()
    q2, k2, v2 = (torch.randn(B, S, H, D, dtype=torch.float16) for _ in range(3))
    o, lse_given = torch.empty_like(q2), torch.empty(B, H, S)
    warm(lambda: fmha_rt.mha_fwd(q2, k2, v2, out=o, lse=lse_given))
    driver.take()
    fmha_rt.mha_fwd(q, k, v, out=o, lse=lse_given)
    assert driver.take() == uncached(monkeypatch, driver, lambda: fmha_rt.mha_fwd(q, k, v, out=o, lse=lse_given))
    wide = torch.randn(B, S, H, 2 * D, dtype=torch.float16)[..., :D]  # other strides: a miss
    fmha_rt.mha_fwd(wide, k, v, out=o, lse=lse_given)
    assert hits() == 2


# ------------------------------------------------------------------------------------------- misses

def _base(x):
    return {"q": x.q, "k": x.k, "v": x.v, "out": x.out, "lse": x.lse}


def _variants(rt):
    """(what changes, a call differing from the base call in that alone)."""
    x = Inputs(rt)
    a = _base(x)

    def call(**over):
        kw = {**a, **over}
        return lambda: fmha_rt.mha_fwd(kw.pop("q"), kw.pop("k"), kw.pop("v"), **kw)

    strided = FakeGpuArray((B, S, H, D + 8)).view((B, S, H, D), (S * H * (D + 8), H * (D + 8), D + 8, 1))
    return [
        ("shape", call(q=FakeGpuArray((B, S // 2, H, D)), out=FakeGpuArray((B, S // 2, H, D)),
                       lse=FakeGpuArray((B, H, S // 2), "float32"))),
        ("strides", call(q=strided)),
        ("dtype", call(q=FakeGpuArray(x.q.shape, "bfloat16"), k=FakeGpuArray(x.k.shape, "bfloat16"),
                       v=FakeGpuArray(x.v.shape, "bfloat16"), out=FakeGpuArray(x.out.shape, "bfloat16"))),
        ("device", call(**{n: FakeGpuArray(arr.shape, arr.dtype, device=1) for n, arr in a.items()})),
        ("framework kind", call(q=_Subclassed(x.q.shape))),
        ("softmax_scale", call(softmax_scale=0.5)),
        ("softmax_scale int", call(softmax_scale=1)),
        ("causal", call(causal=True)),
        ("window", call(window=(8, 8))),
        ("alignment", call(window=(8, 8), causal_alignment="bottom_right")),
        ("mask_type", call(mask_type=1)),
        ("bias", call(bias=FakeGpuArray((1, 1, S, S)))),
        ("bias broadcast", call(bias=FakeGpuArray((1, H, S, S)))),
        ("alibi", call(alibi_slopes=FakeGpuArray((H,), "float32"))),
        ("dropout", call(dropout_p=0.1, seed=1)),
        ("dropout seed array", call(dropout_p=0.1, seed=FakeGpuArray((2,), "int64"))),
        ("out allocated", call(out=None)),
        ("lse allocated", call(lse=None)),
        ("read-only out", call(out=FakeGpuArray(x.out.shape, read_only=True))),
    ]


class _Subclassed(FakeGpuArray):
    """Another kind of array: outputs are allocated by kind."""


def test_any_change_that_reaches_the_plan_misses(rt, driver):
    x = Inputs(rt)
    for what, variant in _variants(rt):
        fmha_rt.clear_plan_cache()
        fmha_rt.mha_fwd(x.q, x.k, x.v, out=x.out, lse=x.lse)
        try:
            variant()
        except FmhaValueError:
            assert what == "read-only out"
        info = fmha_rt.plan_cache_info()
        assert info["hits"] == 0, f"{what}: a hit"
        assert info["misses"] == 2, what


def test_backward_and_varlen_options_are_keyed(rt, driver):
    x = Inputs(rt)
    base = [lambda: fmha_rt.mha_bwd(x.dout, x.q, x.k, x.v, x.out, x.lse, dq=x.dq, dk=x.dk, dv=x.dv),
            lambda: fmha_rt.mha_varlen_fwd(x.q.view((B * S, H, D), (H * D, D, 1)), x.k.view((B * S, H, D), (H * D, D, 1)),
                                           x.v.view((B * S, H, D), (H * D, D, 1)), x.cu_q, x.cu_k, 40, 70)]
    variants = [
        lambda: fmha_rt.mha_bwd(x.dout, x.q, x.k, x.v, x.out, x.lse, dq=x.dq, dk=x.dk, dv=x.dv, deterministic=True),
        lambda: fmha_rt.mha_bwd(x.dout, x.q, x.k, x.v, x.out, x.lse, dq=x.dq, dk=x.dk, dv=None),
        lambda: fmha_rt.mha_bwd(x.dout, x.q, x.k, x.v, x.out, x.lse, dq=x.dq, dk=x.dk, dv=x.dv,
                                workspace_alloc=lambda n, z: x.workspace),
        lambda: fmha_rt.mha_varlen_fwd(x.q.view((B * S, H, D), (H * D, D, 1)), x.k.view((B * S, H, D), (H * D, D, 1)),
                                       x.v.view((B * S, H, D), (H * D, D, 1)), x.cu_q, x.cu_k, 41, 70),
    ]
    for base_call, variant in zip([base[0]] * 3 + [base[1]], variants):
        fmha_rt.clear_plan_cache()
        base_call()
        variant()
        assert fmha_rt.plan_cache_info()["hits"] == 0


def test_options_are_keyed_with_their_types(rt, driver):
    """True and 1, 0.0 and False hash alike; validation tells them apart, so a hit must not."""
    x = Inputs(rt)
    warm(fwd(x, causal=True))
    with pytest.raises(FmhaTypeError, match="causal must be a bool"):
        fwd(x, causal=1)()
    warm(fwd(x, dropout_p=0.0))
    with pytest.raises(FmhaValueError, match="dropout_p"):
        fwd(x, dropout_p=False)()
    warm(fwd(x, window=(4, 4)))
    with pytest.raises(FmhaTypeError, match="window"):
        fwd(x, window=(True, 4))()
    fwd(x, window=[4, 4])()  # a list is keyed apart from the tuple, and works
    assert hits() == 0 and fmha_rt.plan_cache_info()["entries"] == 3


def test_scalars_are_keyed_only_as_the_one_type_validation_takes(rt, driver):
    """deterministic keys as a bool and max_seqlen as an int: 1 for True (or 1.0) would find their plans,
    so such calls skip the cache and validation says what is wrong."""
    x, v = Inputs(rt), Inputs(rt, varlen=True)
    warm(bwd(x, deterministic=True))
    with pytest.raises(FmhaTypeError, match="deterministic must be a bool"):
        bwd(x, deterministic=1)()
    warm(lambda: fmha_rt.mha_varlen_fwd(v.q, v.k, v.v, v.cu_q, v.cu_k, 1, 70, out=v.out, lse=v.lse))
    for max_seqlen_q in (True, 1.0):
        with pytest.raises(FmhaValueError, match="max_seqlen_q must be an int"):
            fmha_rt.mha_varlen_fwd(v.q, v.k, v.v, v.cu_q, v.cu_k, max_seqlen_q, 70, out=v.out, lse=v.lse)
    assert hits() == 0 and fmha_rt.plan_cache_info()["entries"] == 2
    fmha_rt.mha_varlen_fwd(v.q, v.k, v.v, v.cu_q, v.cu_k, 1, 70, out=v.out, lse=v.lse)
    assert hits() == 1


def test_a_bound_function_keys_its_calls_as_the_public_function_does(rt, driver):
    """api.bind (fmha_rt.torch's calls): a bound function's calls key exactly as the public function's
    calls of the same scalars and options (they share plans), other scalars or options miss, and scalars
    of a type validation refuses are never keyed (validation says what is wrong)."""
    x, v = Inputs(rt, alibi=(H,), seed_array=True), Inputs(rt, varlen=True)
    opts = dict(softmax_scale=0.5, window=(4, 0), causal_alignment="bottom_right")
    warm(varlen_fwd(v, **opts))
    varlen = (v.q, v.k, v.v, v.cu_q, v.cu_k, None, None, v.out, v.lse)
    api.bind("mha_varlen_fwd", max_seqlen_q=40, max_seqlen_k=70, **opts)(varlen, 0)
    assert hits() == 1
    api.bind("mha_varlen_fwd", max_seqlen_q=41, max_seqlen_k=70, **opts)(varlen, 0)
    api.bind("mha_varlen_fwd", max_seqlen_q=40, max_seqlen_k=70, **{**opts, "softmax_scale": 0.25})(varlen, 0)
    assert hits() == 1
    dropout = dict(opts, dropout_p=0.1)
    warm(bwd(x, deterministic=True, **dropout))  # alibi_slopes and the seed array are the call's own
    grads = (x.dout, x.q, x.k, x.v, x.out, x.lse, x.dq, x.dk, x.dv, None)
    bound = api.bind("mha_bwd", deterministic=True, workspace_alloc=True, **dropout)
    bound(grads, 0, x.alibi, x.seed, lambda n, z: x.workspace)
    assert hits() == 2
    api.bind("mha_bwd", deterministic=False, workspace_alloc=True, **dropout)(grads, 0, x.alibi, x.seed,
                                                                              lambda n, z: x.workspace)
    assert hits() == 2
    refused = api.bind("mha_bwd", deterministic=1, workspace_alloc=True, **dropout)
    assert refused.keyed is None
    with pytest.raises(FmhaTypeError, match="deterministic must be a bool"):
        refused(grads, 0, x.alibi, x.seed, lambda n, z: x.workspace)


def test_numpy_offsets_and_unhashable_options_are_never_cached(monkeypatch, rt, driver):
    uploaded = []

    def upload(self, name, device, stream):
        uploaded.append(name)
        return Arg(name, FakeGpuArray(self.arrays[name].shape, "int32"), stream)

    monkeypatch.setattr(HostSeqlens, "upload", upload)
    q, k, v = FakeGpuArray((70, 4, 64)), FakeGpuArray((90, 2, 64)), FakeGpuArray((90, 2, 64))
    for _ in range(2):
        fmha_rt.mha_varlen_fwd(q, k, v, np.array([0, 30, 70]), np.array([0, 30, 90]), 40, 60)
    with pytest.raises(FmhaTypeError):
        fmha_rt.mha_fwd(FakeGpuArray((B, S, H, D)), FakeGpuArray((B, S, H, D)), FakeGpuArray((B, S, H, D)),
                        softmax_scale={})
    assert uploaded == ["cu_seqlens_q", "cu_seqlens_k"] * 2
    assert fmha_rt.plan_cache_info()["entries"] == 0


def test_a_pointer_the_cache_cannot_trace_leaves_the_call_uncached(monkeypatch, rt, driver):
    stray = FakeGpuArray((S,), "float32")  # memory that is none of the call's arrays
    planner = portable.plan_fwd

    def plan_with_a_stray_pointer(problem, arch, tensors):
        launches = planner(problem, arch, tensors)
        return [dataclasses.replace(launch_, args={**launch_.args, "Alibi": Pointer(stray.ptr)}) for launch_ in launches]

    monkeypatch.setattr(portable, "plan_fwd", plan_with_a_stray_pointer)
    x = Inputs(rt)
    fwd(x)()
    fwd(x)()
    assert fmha_rt.plan_cache_info() == {"entries": 0, "capacity": plan_cache.DEFAULT_CAPACITY, "hits": 0,
                                         "misses": 2}
    assert len(driver.take()) == 2


# ------------------------------------------------------------------------------- per-call checks on a hit

def test_overlap_alignment_and_workspace_errors_on_a_hit_launch_and_write_nothing(rt, driver):
    x = Inputs(rt)
    warm(fwd(x))
    warm(bwd(x))
    driver.take()
    rt.reset()
    aliased = FakeGpuArray(x.q.shape, stream=0x20)  # written on another stream: the call's waits for it
    with pytest.raises(FmhaValueError, match="output out overlaps q"):
        fmha_rt.mha_fwd(aliased, x.k, x.v, out=aliased, lse=x.lse)
    assert [what for what, *_ in rt.stream_events][-2:] == ["record", "wait"], "an ordering, which writes no memory"
    with pytest.raises(FmhaValueError, match="output out overlaps lse"):
        fmha_rt.mha_fwd(x.q, x.k, x.v, out=x.out, lse=x.out.view(x.lse.shape, None, dtype="float32"))
    base = FakeGpuArray((B * S * H * D + 64,))
    misaligned = base.view(x.q.shape, None, offset=4)  # 8 bytes in: same shape and strides as q
    with pytest.raises(FmhaValueError, match="is not 16-byte aligned"):
        fmha_rt.mha_fwd(misaligned, x.k, x.v, out=x.out, lse=x.lse)
    with pytest.raises(FmhaValueError, match="output dq overlaps k"):
        fmha_rt.mha_bwd(x.dout, x.q, x.k, x.v, x.out, x.lse, dq=x.k, dk=x.dk, dv=x.dv,
                        workspace_alloc=lambda n, z: x.workspace)
    with pytest.raises(FmhaValueError, match="output workspace overlaps dv"):
        fmha_rt.mha_bwd(x.dout, x.q, x.k, x.v, x.out, x.lse, dq=x.dq, dk=x.dk, dv=x.dv,
                        workspace_alloc=lambda n, z: x.dv.view((n,), None, dtype="uint8"))
    with pytest.raises(FmhaValueError, match="bytes, .* are needed"):
        fmha_rt.mha_bwd(x.dout, x.q, x.k, x.v, x.out, x.lse, dq=x.dq, dk=x.dk, dv=x.dv,
                        workspace_alloc=lambda n, z: rt.workspace(8))
    assert hits() == 6 and all(type(description) is bytes for (_, description), _ in call_keys.PLANS.plans()), \
        "the arrays were described by their CUDA Array Interface"
    assert driver.take() == [] and rt.memsets == []
    for array in (x.out, x.lse, x.dq, x.dk, x.dv, aliased):
        assert array.untouched()


def test_a_hit_launches_through_the_c_replay_alone_and_notes_its_kernels(monkeypatch, rt, driver):
    """A hit that logs nothing makes no launch objects and skips the executor: one C call launches."""
    x = Inputs(rt)
    warm(bwd(x, deterministic=True))
    planned = driver.take()[-2:]
    fwd(x)()  # another call's kernels: the last launch info below is the hit's own
    driver.take()

    def refuse(*_, **__):
        raise AssertionError("a hit built launch objects or went through the executor")

    monkeypatch.setattr(executor, "run", refuse)
    monkeypatch.setattr(plan_cache.BoundLaunches, "__init__", refuse)
    bwd(x, deterministic=True)()
    assert hits() == 1 and driver.take() == [launched[:4] for launched in planned]
    assert fmha_rt.last_launch_info()["kernels"] == [key for key, *_ in planned]


def test_a_logged_hit_goes_through_the_executor_seam_with_launches_that_read_like_planned_ones(monkeypatch, rt, driver,
                                                                                            log_config):
    x = Inputs(rt)
    warm(fwd(x, causal=True))
    seen = []
    monkeypatch.setattr(executor, "run", lambda device, arch, launches, stream, **_: seen.append(launches))
    fwd(x, causal=True)()
    (bound,), = seen
    assert isinstance(bound, plan_cache.BoundLaunch) and bound.variant == "fmha_fwd_fp16_d64_nobias_nodrop"
    assert bound.args["window_right"] == 0 and bound.args["Q"].address == x.q.ptr
    entry = registry_module.registry().entry("sm_90", bound.variant)
    assert entry.packer.pack(kernel_launch.with_scratch(bound.args)) == bytes(bound.packed)


def test_last_launch_info_and_logging_on_a_hit(monkeypatch, rt, driver, caplog, log_config):
    x = Inputs(rt)
    with caplog.at_level(logging.INFO, logger="fmha_rt"):
        with monkeypatch.context() as m:
            m.setattr(call_keys, "key_request", lambda *_: None)
            fmha_rt.mha_bwd(x.dout, x.q, x.k, x.v, x.out, x.lse, dq=x.dq, dk=x.dk, dv=x.dv, deterministic=True,
                            stream=0x1234, workspace_alloc=lambda n, z: x.workspace)
        planned = [r.getMessage() for r in caplog.records]
        caplog.clear()
        for _ in range(3):  # a miss, a miss that records, a hit
            fmha_rt.mha_bwd(x.dout, x.q, x.k, x.v, x.out, x.lse, dq=x.dq, dk=x.dk, dv=x.dv, deterministic=True,
                            stream=0x1234, workspace_alloc=lambda n, z: x.workspace)
            assert [r.getMessage() for r in caplog.records] == planned
            caplog.clear()
    assert hits() == 1
    *launches, call = planned  # a call's line follows its launches', on a hit as on a miss
    assert call.startswith("call function=mha_bwd family=portable ")
    assert len(launches) == 2 and all("stream: 0x1234" in message for message in launches)
    assert f"Q: Pointer(0x{x.q.ptr:x})" in launches[1]
    info, launched = fmha_rt.last_launch_info(), driver.take()
    assert len(launched) == 8 and info["kernels"] == [key for key, *_ in launched[-2:]] and info["device"] == 0
    assert all(stream == 0x1234 for *_, stream in launched)


# ------------------------------------------------------------------------------------ threads and bound

def run_threads(work, args_list) -> list:
    """work(*args) on one thread per entry of args_list, all released at once and switching as often
    as the interpreter allows; the exceptions they raised."""
    start, errors = threading.Barrier(len(args_list)), []

    def run(*args):
        start.wait()
        try:
            work(*args)
        except Exception as exc:  # noqa: BLE001 - returned to the test
            errors.append(exc)

    threads = [threading.Thread(target=run, args=args) for args in args_list]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    return errors


def test_sixteen_threads_each_launch_their_own_pointers(monkeypatch, rt, driver):
    inputs = [Inputs(rt) for _ in range(16)]
    warm(fwd(inputs[0]))
    warm(bwd(inputs[0], deterministic=True))
    driver.take()
    expected = {}

    def work(x):
        expected[threading.get_ident()] = x
        for _ in range(20):
            fwd(x)()
            bwd(x, deterministic=True)()

    errors = run_threads(work, [(x,) for x in inputs])
    assert not errors, errors
    assert len(driver.launches) == 16 * 20 * 3  # a forward and a backward (dQ with Delta, then dK/dV)
    for key, _, packed, _, thread in driver.launches:
        x, args = expected[thread], unpack(key, packed)
        for name, array in (("Q", x.q), ("dO", x.dout), ("dK", x.dk), ("dQ", x.dq), ("Out", x.out)):
            if name in args:
                assert args[name] == array.ptr, (key, name)
    assert hits() == 16 * 20 * 2


def _launch_shape(program):
    """What a program launches, whatever its values are numbered by: kernel, grid, block, shared bytes
    and the template bytes that are patched per call."""
    return [(launch.key, launch.grid, launch.block, launch.shared, [(p.arg_offset, p.align) for p in launch.patches])
            for launch in program.launches]


def test_a_plan_keeps_the_launch_program_jax_serialises_loaded_once_by_the_shim(rt, driver):
    x = Inputs(rt, hk=2)  # GQA, deterministic: a dQ pass writing Delta and Lse2 into the workspace, then dK/dV
    warm(bwd(x, deterministic=True))
    ((_, plan),) = call_keys.PLANS.plans()
    program = plan.launch_program
    assert isinstance(program, program_model.LaunchProgram) and program.workspace == plan.index[plan_cache.WORKSPACE]
    decoded = program_model.LaunchProgram.decode(program.encode())
    assert (decoded.launches, decoded.zero_fills, decoded.overlaps, decoded.workspace, decoded.workspace_bytes) == \
        (program.launches, program.zero_fills, program.overlaps, program.workspace, program.workspace_bytes)
    assert plan.loaded.templates() == [launch.template for launch in program.launches]
    assert plan.program.launch_count == len(program.launches) == len(plan.keys)
    assert plan.program.patch_count == sum(len(launch.patches) for launch in program.launches)
    assert len(program.launches) == 2 and program.workspace_bytes == plan.workspace_bytes > 0
    # the program fmha_rt.jax builds for the same problem launches the same kernels on the same slots
    problem = AttentionProblem(B, S, S, H, 2, D, D, "fp16", deterministic=True)
    assert _launch_shape(xla_program.backward(problem, "sm_90")) == _launch_shape(program)
    bwd(x, deterministic=True)()
    assert hits() == 1 and plan.loaded.templates() == [launch.template for launch in program.launches]


def test_the_shim_refuses_a_program_beyond_its_buffers_or_values(rt, driver):
    problem = AttentionProblem(B, S, S, H, H, D, D, "fp16", deterministic=True)
    program = xla_program.backward(problem, "sm_90")
    launch = program.launches[0]
    stray = dataclasses.replace(launch.patches[0], value=len(program.buffers))
    beyond = dataclasses.replace(program, launches=(dataclasses.replace(launch, patches=(stray,)),))
    with pytest.raises(FmhaValueError, match="malformed: it is truncated or holds a value out of range"):
        program_model.LoadedProgram(beyond, 0, [ffi.NULL], 0)
    fill = program_model.ZeroFill(0, program.buffers[0].nbytes - 8, 16)
    with pytest.raises(FmhaValueError, match="a zeroed region lies outside its buffer"):
        program_model.LoadedProgram(dataclasses.replace(program, zero_fills=(fill,)), 0, [ffi.NULL] * 3, 0)


def test_the_cache_keeps_the_most_recently_used_plans(monkeypatch, rt, driver):
    monkeypatch.setattr(call_keys, "PLANS", plan_cache.PlanCache(capacity=4))
    x = Inputs(rt)
    scales = [0.1, 0.2, 0.3, 0.4, 0.5]
    for scale in scales[:4]:
        warm(fwd(x, softmax_scale=scale))
    fwd(x, softmax_scale=0.1)()  # now the most recent; 0.2 is the least recent
    warm(fwd(x, softmax_scale=0.5))  # evicts 0.2
    assert fmha_rt.plan_cache_info()["entries"] == 4
    before = hits()
    for scale in (0.1, 0.3, 0.4, 0.5):
        fwd(x, softmax_scale=scale)()
    assert hits() == before + 4
    fwd(x, softmax_scale=0.2)()  # seen before, so recorded again (evicting 0.1)
    assert hits() == before + 4 and fmha_rt.plan_cache_info()["entries"] == 4


def test_signatures_seen_once_are_not_recorded_and_evict_nothing(monkeypatch, rt, driver):
    monkeypatch.setattr(call_keys, "PLANS", plan_cache.PlanCache(capacity=2))
    x = Inputs(rt)
    warm(fwd(x, causal=True))
    warm(fwd(x))
    for i in range(12):  # one-off signatures, as varlen batches of changing lengths give
        fwd(x, softmax_scale=0.01 * (i + 1))()
    fwd(x, causal=True)()
    fwd(x)()
    info = fmha_rt.plan_cache_info()
    assert info["hits"] == 2 and info["entries"] == 2
    assert call_keys.PLANS.pending <= 4 * 2


def test_clear_plan_cache(rt, driver):
    x = Inputs(rt)
    warm(fwd(x))
    fwd(x)()
    assert fmha_rt.plan_cache_info()["entries"] == 1 and hits() == 1
    fmha_rt.clear_plan_cache()
    assert fmha_rt.plan_cache_info() == {"entries": 0, "capacity": plan_cache.DEFAULT_CAPACITY, "hits": 0, "misses": 0}
    fwd(x)()
    fwd(x)()
    assert hits() == 0 and fmha_rt.plan_cache_info()["entries"] == 1, "the signature is new again"


def test_the_cache_keeps_no_array_alive(rt, driver):
    x = Inputs(rt, bias=(1, H, S, S))
    warm(fwd(x))
    warm(bwd(x))
    refs = [weakref.ref(a) for a in (x.q, x.k, x.v, x.out, x.lse, x.dout, x.dq, x.dk, x.dv, x.bias, x.workspace)]
    del x
    gc.collect()
    assert fmha_rt.plan_cache_info()["entries"] == 2
    assert all(ref() is None for ref in refs)


def test_a_plan_of_another_runtime_is_not_used(monkeypatch, rt, driver):
    x = Inputs(rt)
    warm(fwd(x))
    StandInRuntime(monkeypatch)  # tests swap the runtime; a process never does
    fwd(x)()
    assert hits() == 0


def call_inside_first_launch(monkeypatch, driver, call):
    """From now on the driver makes `call` from inside the first launch it records after its last take."""
    record = driver.launch

    def reentering(config, stream):
        record(config, stream)
        if len(driver.launches) == 1:
            call()
        return 0

    monkeypatch.setattr(kernel_launch, "launch_prepared", reentering)


def test_a_replay_reentered_from_its_own_launch_writes_each_calls_values(monkeypatch, rt, driver):
    """The replay writes each call's values into its own copy of the templates, from its own copy of the
    values: a cached call made on the same thread while another is inside its first launch (as a launch
    callback could) reuses the thread's value array and launches its own pointers, and the outer call's
    second launch still gets the outer call's."""
    outer, inner = Inputs(rt), Inputs(rt)
    warm(bwd(outer, deterministic=True))
    warm(fwd(inner))
    driver.take()
    call_inside_first_launch(monkeypatch, driver, fwd(inner))
    def templates():
        return [plan.loaded.templates() for _, plan in call_keys.PLANS.plans()]

    before = templates()
    assert before and all(before), "the plans' templates as the shim loaded them"
    bwd(outer, deterministic=True)()
    (dq_kernel, inside, dkdv) = [unpack(key, packed) for key, _, packed, _ in driver.take()]
    assert dq_kernel["Q"] == outer.q.ptr and dq_kernel["dQ"] == outer.dq.ptr
    assert inside["Q"] == inner.q.ptr and inside["Out"] == inner.out.ptr
    assert dkdv["Q"] == outer.q.ptr and dkdv["dK"] == outer.dk.ptr and dkdv["dV"] == outer.dv.ptr
    assert before == templates(), \
        "a replay never writes into the plan's templates"


def test_a_failed_launch_on_a_hit_names_the_call_kernel_and_device(monkeypatch, rt, driver):
    x = Inputs(rt)
    warm(bwd(x, deterministic=True))
    keys = [key for key, *_ in driver.take()[-2:]]
    calls = []

    def fail_second(config, stream):
        calls.append(config)
        return lib.FMHA_ERR_DRIVER if len(calls) == 2 else 0

    monkeypatch.setattr(kernel_launch, "launch_prepared", fail_second)
    with pytest.raises(DriverError) as raised:
        bwd(x, deterministic=True)()
    assert raised.value.call == "fmha_launch" and raised.value.kernel == keys[1] and raised.value.device == 0
    assert len(calls) == 2, "nothing is launched after the failed launch"
    assert hits() == 1


def test_a_padded_forward_hits_with_its_scratch_allocated_by_the_replay(monkeypatch, rt, driver):
    """Head dims that are not multiples of 8 run on padded copies in a scratch buffer; a hit has the
    replay allocate it, and its launches differ from an uncached call's only in the pointers into it."""
    x, y = Inputs(rt, d=60), Inputs(rt, d=60)
    warm(fwd(x, causal=True))
    driver.take()
    allocated = []
    alloc = rt.mem_alloc

    def watch(ordinal, nbytes, stream=0):
        allocated.append((alloc(ordinal, nbytes, stream), nbytes))
        return allocated[-1][0]

    monkeypatch.setattr(fmha_rt.runtime.backend, "mem_alloc", watch)
    fwd(y, causal=True)()
    assert hits() == 1 and len(allocated) == 1 and allocated[0][0] in rt.allocations, "kept for the stream"
    got = driver.take()
    expected = uncached(monkeypatch, driver, fwd(y, causal=True))
    assert [(key, grid) for key, grid, *_ in got] == [(key, grid) for key, grid, *_ in expected]
    assert [key for key, *_ in got] == ["fmha_pad_widen_fp16"] * 3 + ["fmha_fwd_fp16_d64_nobias_nodrop",
                                                                       "fmha_pad_narrow_fp16"]
    start, nbytes = allocated[0]
    for (key, _, packed, _), (_, _, want, _) in zip(got, expected):
        hit, planned = unpack(key, packed), unpack(key, want)
        for name in (n for n in hit if hit[n] != planned[n]):
            assert start <= hit[name] < start + nbytes, (key, name)
    assert unpack(*got[0][::2])["UnalignedArray"] == y.q.ptr and unpack(*got[-1][::2])["UnalignedArray"] == y.out.ptr
    allocations = len(allocated)  # the uncached call allocated a scratch of its own
    fwd(x, causal=True)()
    assert len(allocated) == allocations and unpack(*driver.take()[0][::2])["Padded"] == \
        unpack(*got[0][::2])["Padded"], "the next hit on the stream pads into the same scratch"


def test_a_logged_hit_logs_the_workspace_its_launches_get(monkeypatch, rt, driver, caplog, log_config):
    """With launches logged, a hit allocates fmha_rt's own workspace before the replay (so the log can
    show it): every logged pointer is the one launched."""
    x = Inputs(rt)

    def call():
        return fmha_rt.mha_bwd(x.dout, x.q, x.k, x.v, x.out, x.lse, dq=x.dq, dk=x.dk, dv=x.dv, deterministic=True)

    warm(call)
    driver.take()
    with caplog.at_level(logging.INFO, logger="fmha_rt"):
        call()
    assert hits() == 1
    launched = driver.take()
    *logged, call_line = [r.getMessage() for r in caplog.records]
    assert len(logged) == len(launched) == 2 and call_line.startswith("call function=mha_bwd ")
    for message, (key, _, packed, _) in zip(logged, launched):
        assert f"kernel: {key}" in message
        for name, value in unpack(key, packed).items():
            if name in ("Delta", "dQ", "dK", "Q"):
                assert f"{name}: Pointer(0x{value:x})" in message, (key, name)


def test_a_hit_takes_its_workspace_from_torchs_caching_allocator_by_address(monkeypatch, rt, driver,
                                                                          torch_as_cuda):
    """fmha_rt.torch.caching_workspace hands torch's memory over as an address: a hit launches into the
    tensor it holds, and launches what an uncached call with that workspace launches."""
    torch = pytest.importorskip("torch")
    from fmha_rt.torch import caching_workspace

    q, k, v, out, dout = (torch.randn(B, S, H, D, dtype=torch.float16) for _ in range(5))
    lse = torch.randn(B, H, S)
    dq, dk, dv = (torch.empty_like(q) for _ in range(3))
    workspaces = []

    def call():
        workspaces.append(caching_workspace(q.device))
        return fmha_rt.mha_bwd(dout, q, k, v, out, lse, dq=dq, dk=dk, dv=dv, workspace_alloc=workspaces[-1])

    warm(call)
    driver.take()
    assert call() == (dq, dk, dv) and hits() == 1
    held = workspaces[-1].held
    assert held.dtype == torch.uint8 and held.numel() == fmha_rt.bwd_workspace_bytes(q, k, v)
    launched = driver.take()
    dkdv = next(unpack(key, packed) for key, _, packed, _ in launched if key.startswith("fmha_bwd_dkdv_"))
    assert held.data_ptr() <= dkdv["Delta"] < held.data_ptr() + held.numel(), "the regions are in torch's memory"
    pinned = workspaces[-1]
    with monkeypatch.context() as m:
        m.setattr(call_keys, "key_request", lambda *_: None)
        fmha_rt.mha_bwd(dout, q, k, v, out, lse, dq=dq, dk=dk, dv=dv,
                        workspace_alloc=lambda n, z: fmha_rt.Pointer(pinned.held.data_ptr()))
    assert driver.take() == launched


# ------------------------------------------------------------------- fmha_rt's own workspace, kept per stream

def own_bwd(x, stream=0, **extra):
    """A backward on fmha_rt's own workspace (no workspace_alloc), on `stream` (0: given as no option)."""
    options = {"stream": stream} if stream else {}
    return lambda: fmha_rt.mha_bwd(x.dout, x.q, x.k, x.v, x.out, x.lse, dq=x.dq, dk=x.dk, dv=x.dv, deterministic=True,
                                   **options, **extra)


def kept():
    """(buffers, bytes) the shim keeps."""
    count, nbytes = ffi.new("size_t *"), ffi.new("uint64_t *")
    assert lib.fmha_workspaces_kept(count, nbytes) == lib.FMHA_OK
    return count[0], nbytes[0]


def delta_of(launched) -> int:
    """The Delta region's address in a backward's dK/dV launch: a pointer into its workspace."""
    return next(unpack(key, packed)["Delta"] for key, _, packed, *_ in launched if key.startswith("fmha_bwd_dkdv_"))


def buffer_holding(rt, address) -> int:
    """The stand-in allocation that `address` lies in."""
    (start,) = [s for s, (_, n, _) in rt.allocations.items() if s <= address < s + n]
    return start


class Events:
    """The stand-in's allocations and frees as they happen: ('alloc' | 'free', address, stream)."""

    def __init__(self, monkeypatch, rt):
        self.log = []
        alloc, free = rt.mem_alloc, rt.mem_free

        def watch_alloc(ordinal, nbytes, stream=0):
            self.log.append(("alloc", alloc(ordinal, nbytes, stream), stream))
            return self.log[-1][1]

        def watch_free(ordinal, ptr, stream=0):
            self.log.append(("free", ptr, stream))
            free(ordinal, ptr, stream)

        monkeypatch.setattr(fmha_rt.runtime.backend, "mem_alloc", watch_alloc)
        monkeypatch.setattr(fmha_rt.runtime.backend, "mem_free", watch_free)

    def take(self):
        taken, self.log = self.log, []
        return taken


def test_a_hit_takes_the_workspace_kept_for_its_stream_and_zeroes_it_every_call(monkeypatch, rt, driver):
    x = Inputs(rt, bias=(1, 1, S, S))  # a dbias needs dS zeroed
    call = own_bwd(x, bias=x.bias, dbias=x.dbias)
    warm(call)
    driver.take()
    events = Events(monkeypatch, rt)
    call()
    ((what, buffer, stream),) = events.take()
    assert (what, stream) == ("alloc", 0) and delta_of(driver.take()) in range(buffer, buffer + rt.allocations[buffer][1])
    nbytes = fmha_rt.bwd_workspace_bytes(x.q, x.k, x.v, deterministic=True, bias=x.bias)
    assert kept() == (1, nbytes) == (1, rt.allocations[buffer][1])
    for _ in range(3):
        rt.reset()
        call()
        launched = driver.take()
        assert events.take() == [] and buffer_holding(rt, delta_of(launched)) == buffer, "the same buffer, no alloc or free"
        dkdv = next(unpack(key, packed) for key, _, packed, _ in launched if key.startswith("fmha_bwd_dkdv_"))
        assert [(dev, ptr) for dev, ptr, _ in rt.memsets] == [(0, dkdv["dS"])], "zeroed on every call"
    assert hits() == 4 and not rt.problems


def test_release_frees_the_kept_workspaces_on_their_streams_and_the_next_call_allocates_anew(monkeypatch, rt, driver):
    x = Inputs(rt)
    streams = (0, 0x10, 0x20)
    for stream in streams:
        warm(own_bwd(x, stream))
    fmha_rt.release_workspaces()  # what the warm-up hits kept
    events = Events(monkeypatch, rt)
    for stream in streams * 2:
        own_bwd(x, stream)()
    allocated = events.take()
    assert [(what, stream) for what, _, stream in allocated] == [("alloc", s) for s in streams], "one buffer per stream"
    buffers = {stream: ptr for _, ptr, stream in allocated}
    assert len(set(buffers.values())) == 3 and kept()[0] == 3
    fmha_rt.release_workspaces()
    assert sorted(events.take()) == sorted(("free", ptr, stream) for stream, ptr in buffers.items())
    assert kept() == (0, 0) and not set(buffers.values()) & set(rt.allocations) and not rt.problems
    own_bwd(x, 0x10)()
    assert [(what, stream) for what, _, stream in events.take()] == [("alloc", 0x10)]
    fmha_rt.release_workspaces()
    rt.limit = 0  # the next allocation fails as the driver fails when out of memory
    driver.take()
    with pytest.raises(DriverError, match="fmha_mem_alloc"):
        own_bwd(x, 0x10)()
    assert driver.take() == [] and kept() == (0, 0)


def test_each_call_on_a_stream_uses_that_streams_buffer(monkeypatch, rt, driver):
    x = Inputs(rt)
    for stream in (0, 0x10):
        warm(own_bwd(x, stream))
    driver.take()
    rt.reset()
    for stream in (0x10, 0, 0x10, 0):
        own_bwd(x, stream)()
    launched = driver.take()
    by_stream = {}
    for i in range(0, len(launched), 2):
        stream = launched[i][3]
        by_stream.setdefault(stream, set()).add(buffer_holding(rt, delta_of(launched[i:i + 2])))
    assert len(by_stream[0]) == len(by_stream[0x10]) == 1 and by_stream[0] != by_stream[0x10]
    assert rt.capture_queries == [(0, 0x10)] * 2, "the null stream is never asked whether it captures"


def test_a_bigger_workspace_frees_the_old_one_on_its_stream_before_allocating(monkeypatch, rt, driver):
    small, big = Inputs(rt), Inputs(rt, hq=8, hk=8)
    for x in (small, big):
        warm(own_bwd(x, 0x10))
    events = Events(monkeypatch, rt)
    own_bwd(small, 0x10)()
    ((_, first, _),) = events.take()
    own_bwd(big, 0x10)()
    (freed, allocated) = events.take()
    assert freed == ("free", first, 0x10) and allocated[0] == "alloc" and allocated[2] == 0x10
    own_bwd(small, 0x10)()
    assert events.take() == [], "the bigger buffer serves the smaller call"
    assert kept() == (1, fmha_rt.bwd_workspace_bytes(big.q, big.k, big.v, deterministic=True)) and not rt.problems


def test_a_workspace_above_the_cap_is_allocated_and_freed_around_each_call(rt):
    """The replay takes its workspace through fmha_workspace_take / give with the plan's bytes."""
    cap = lib.FMHA_WORKSPACE_CACHE_MAX_BYTES
    rt.limit = cap + 1
    lease = ffi.new("fmha_workspace_lease *")
    for nbytes, kept_after in ((cap + 1, (0, 0)), (cap, (1, cap))):
        assert lib.fmha_workspace_take(kernel_launch.REPLAY_OPS, 0, 0x10, nbytes, 0, lease) == lib.FMHA_OK
        assert lease.ptr in rt.allocations and (lease.slot == ffi.NULL) == (nbytes > cap)
        lib.fmha_workspace_give(kernel_launch.REPLAY_OPS, 0, 0x10, lease)
        assert kept() == kept_after
    assert [(ptr, stream) for _, ptr, stream in rt.frees] == [(rt.frees[0][1], 0x10)] and not rt.problems


def test_a_stream_being_captured_gets_a_workspace_of_its_own_per_call(monkeypatch, rt, driver):
    """A graph keeps the addresses it captured: the cached buffer stays out of it, and what the capture
    gets is allocated and freed on the stream (stream-ordered, so inside the graph)."""
    x = Inputs(rt)
    warm(own_bwd(x, 0x30))
    own_bwd(x, 0x30)()
    (cached,) = rt.allocations
    nbytes = fmha_rt.bwd_workspace_bytes(x.q, x.k, x.v, deterministic=True)
    events = Events(monkeypatch, rt)
    rt.capturing.add(0x30)
    driver.take()
    for _ in range(2):
        own_bwd(x, 0x30)()
        ((what, fresh, stream), freed) = events.take()
        assert (what, stream) == ("alloc", 0x30) and fresh != cached and freed == ("free", fresh, 0x30)
        assert fresh <= delta_of(driver.take()) < fresh + nbytes
    assert rt.capture_queries[-2:] == [(0, 0x30)] * 2 and kept() == (1, nbytes) and cached in rt.allocations
    rt.capturing.clear()
    own_bwd(x, 0x30)()
    assert events.take() == [] and buffer_holding(rt, delta_of(driver.take())) == cached


def test_a_failed_capture_query_counts_as_a_capture(monkeypatch, rt, driver):
    x = Inputs(rt)
    warm(own_bwd(x, 0x30))

    def query_fails(ordinal, stream):
        raise RuntimeError("the driver refused the query")

    monkeypatch.setattr(rt, "capture_status", query_fails)
    events = Events(monkeypatch, rt)
    own_bwd(x, 0x30)()
    assert [what for what, *_ in events.take()] == ["alloc", "free"] and kept() == (0, 0)
    assert [str(e) for e in rt.callback_errors] == ["the driver refused the query"]


def test_a_release_while_a_call_holds_the_workspace_frees_it_when_the_call_hands_it_back(monkeypatch, rt, driver):
    x = Inputs(rt)
    warm(own_bwd(x, 0x10))
    own_bwd(x, 0x10)()
    (buffer,) = rt.allocations
    record, during = driver.launch, []

    def release_inside(config, stream):
        if not during:
            fmha_rt.release_workspaces()  # from inside the first launch: the call holds the buffer
            during.append((list(rt.frees), kept()))
        return record(config, stream)

    monkeypatch.setattr(kernel_launch, "launch_prepared", release_inside)
    driver.take()
    rt.reset()
    own_bwd(x, 0x10)()
    nbytes = fmha_rt.bwd_workspace_bytes(x.q, x.k, x.v, deterministic=True)
    assert during == [([], (1, nbytes))], "nothing freed while the call holds it"
    assert rt.frees == [(0, buffer, 0x10)] and kept() == (0, 0) and len(driver.take()) == 2


def test_a_refused_hit_on_its_own_workspace_writes_nothing_and_keeps_the_workspace(monkeypatch, rt, driver):
    x = Inputs(rt)
    warm(own_bwd(x))
    own_bwd(x)()
    before = (dict(rt.allocations), kept())
    driver.take()
    rt.reset()
    base = FakeGpuArray((B * S * H * D + 64,))
    misaligned = base.view(x.q.shape, None, offset=4)  # 8 bytes in: same shape and strides as q
    with pytest.raises(FmhaValueError, match="is not 16-byte aligned"):
        fmha_rt.mha_bwd(x.dout, misaligned, x.k, x.v, x.out, x.lse, dq=x.dq, dk=x.dk, dv=x.dv, deterministic=True)
    with pytest.raises(FmhaValueError, match="output dq overlaps k"):
        fmha_rt.mha_bwd(x.dout, x.q, x.k, x.v, x.out, x.lse, dq=x.k, dk=x.dk, dv=x.dv, deterministic=True)
    assert hits() == 3 and driver.take() == [] and rt.memsets == [] and rt.frees == []
    assert (dict(rt.allocations), kept()) == before
    for array in (x.dq, x.dk, x.dv, x.k, base):
        assert array.untouched()
    own_bwd(x)()
    assert len(driver.take()) == 2 and (dict(rt.allocations), kept()) == before


def test_sixteen_threads_on_four_streams_never_share_a_held_workspace(monkeypatch, rt, driver):
    """Calls on one stream from many threads: a buffer goes to one call at a time (a call that finds it
    held gets its own), so each buffer's launches come in whole calls, the dQ kernel then dK/dV of one
    thread with its own pointers; afterwards every buffer not kept is freed."""
    inputs = [Inputs(rt) for _ in range(16)]
    for stream in (1, 2, 3, 4):
        warm(own_bwd(inputs[0], stream))
    driver.take()
    before, mine = hits(), {}

    def work(i, x):
        mine[threading.get_ident()] = x
        for _ in range(20):
            own_bwd(x, 1 + i % 4)()

    errors = run_threads(work, list(enumerate(inputs)))
    assert not errors, errors
    assert len(driver.launches) == 16 * 20 * 2 and hits() == before + 16 * 20
    by_buffer = {}
    for key, _, packed, stream, thread in driver.launches:
        args = unpack(key, packed)
        assert args["Q"] == mine[thread].q.ptr and args["dO"] == mine[thread].dout.ptr
        by_buffer.setdefault(args["Delta"], []).append((key.split("_")[2], thread, stream))
    for launches in by_buffer.values():
        for dq_kernel, dkdv in zip(launches[::2], launches[1::2]):
            assert (dq_kernel[0], dkdv[0]) == ("dq", "dkdv") and dq_kernel[1:] == dkdv[1:], "a held buffer was shared"
    assert kept()[0] == 4 and len(rt.allocations) == 4 and not rt.problems


def test_take_and_give_hand_a_streams_buffer_to_one_holder_at_a_time(rt):
    """The table from many threads at once (take and give run without the GIL): no two leases share a
    buffer, and what was not kept is freed."""
    held, lock, errors = set(), threading.Lock(), []

    def work():
        lease = ffi.new("fmha_workspace_lease *")
        for i in range(300):
            if lib.fmha_workspace_take(kernel_launch.REPLAY_OPS, 0, 0x50, 1024 + i % 3, 0, lease) != lib.FMHA_OK:
                errors.append("take failed")
                return
            with lock:
                if lease.ptr in held:
                    errors.append(f"0x{lease.ptr:x} handed out twice")
                held.add(lease.ptr)
            time.sleep(0)  # let the other threads run while this one holds the buffer
            with lock:
                held.discard(lease.ptr)
            lib.fmha_workspace_give(kernel_launch.REPLAY_OPS, 0, 0x50, lease)

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and kept() == (1, 1026) and len(rt.allocations) == 1 and not rt.problems


EXIT_WITH_A_KEPT_WORKSPACE = r"""
import sys
import pytest
import fmha_rt
from fmha_rt.runtime import kernel_launch
from fmha_rt.runtime.backend import ffi, lib
from fake_gpu import FakeGpuArray, StandInRuntime

patches = pytest.MonkeyPatch()
StandInRuntime(patches)
patches.setattr(kernel_launch, "kernel_handle", lambda device, entry: ffi.NULL)
patches.setattr(kernel_launch, "launch_prepared", lambda config, stream: 0)
# past SINGLE_MAX_SCORES: the one-launch backward of smaller problems needs no workspace
q, k, v, out, dout, dq, dk, dv = (FakeGpuArray((1, 1024, 2, 64)) for _ in range(8))
lse = FakeGpuArray((1, 2, 1024), "float32")
for _ in range(3):
    fmha_rt.mha_bwd(dout, q, k, v, out, lse, dq=dq, dk=dk, dv=dv, stream=0x10)
count, nbytes = ffi.new("size_t *"), ffi.new("uint64_t *")
lib.fmha_workspaces_kept(count, nbytes)
print("kept", count[0], fmha_rt.plan_cache_info()["hits"])
"""


def test_a_process_exits_cleanly_with_a_workspace_kept():
    """Nothing frees kept workspaces at exit (the driver reclaims them with its context): a process that
    ends with one kept, its stand-in driver already gone, exits without a crash or a message."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")]))
    env.pop("FMHA_RT_LOG_CONFIG", None)
    done = subprocess.run([sys.executable, "-c", EXIT_WITH_A_KEPT_WORKSPACE], env=env, capture_output=True, text=True,
                          timeout=120)
    assert (done.returncode, done.stdout.split(), done.stderr) == (0, ["kept", "1", "1"], "")
