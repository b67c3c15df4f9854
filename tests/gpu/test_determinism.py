"""Every kernel family and pass, repeated on a side stream and from 8 threads at once (each thread on
its own stream), into outputs re-poisoned with NaN before every run (tests/gpu/repeat_runs.py).

A reference run on the current stream is checked against the float64 attention (whole tensor, per head,
per row); the repeats of a deterministic call must equal it bit for bit (raw bits: -0.0 and 0.0
differ), and the repeats of the v3 backward (which adds dQ in any order) must each pass the float64 check.
A GPU sleep ahead of each repeat's poison makes a launch that misses the call's stream show as NaN.
"""
import dataclasses

import pytest

from gpu_presence import require

torch = require("torch")

import fmha_rt
from error_bounds import assert_close, assert_lse_close
from fmha_rt.plan import portable, v3
from gpu_tensors import attention_f64, generator, rand, seed_of
from repeat_runs import assert_bitwise, reference_run, repeat, repeat_from_threads

SIDE_STREAM_REPEATS = 3


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    pass_name: str  # "fwd" or "bwd"
    b: int
    s: int
    hq: int
    hk: int
    d: int
    family: str
    kernel_prefix: str  # of one of the call's kernels: the path the case is about
    deterministic: bool = True  # the backward's option; the forward is always deterministic
    v3_everywhere: bool = False  # FMHA_RT_V3=1: the v3 family serves every call it can
    # deterministic calls take the ORDERED dQ strategy (turned on for the case in
    # portable.ORDERED_FOR_DETERMINISTIC); off, the default: two kernels, or FUSED from 4096 keys
    ordered: bool = True
    # deterministic calls the v3 family serves take its ORDERED form (v3.ORDERED_FOR_DETERMINISTIC)
    v3_ordered: bool = False
    dv: int = 0  # V's head dim where it is not d


CASES = [
    Case("portable_fwd_d64_gqa", "fwd", 2, 512, 4, 2, 64, "portable", "fmha_fwd_bf16_d64"),
    Case("v3_fwd_d128_4096_keys_default", "fwd", 1, 4096, 4, 2, 128, "v3", "fmha_fwd_v3_bf16_d128"),
    Case("v3_fwd_d64", "fwd", 1, 2048, 4, 2, 64, "v3", "fmha_fwd_v3_bf16_d64",
         v3_everywhere=True),
    Case("portable_bwd_two_kernels_gqa", "bwd", 2, 512, 4, 2, 64, "portable",
         "fmha_bwd_dkdv_bf16_d64_nobias_nodrop_deterministic", ordered=False),
    Case("portable_bwd_ordered_gqa", "bwd", 2, 512, 4, 2, 64, "portable",
         "fmha_bwd_dkdv_bf16_d64_nobias_nodrop_ordered"),
    Case("portable_bwd_ordered_d128_4096_keys", "bwd", 1, 4096, 2, 1, 128, "portable",
         "fmha_bwd_dkdv_bf16_d128_nobias_nodrop_ordered"),
    Case("portable_bwd_one_launch", "bwd", 2, 256, 4, 4, 64, "portable", "fmha_bwd_single_bf16_d64"),
    Case("portable_bwd_fused_4096_keys", "bwd", 1, 4096, 2, 1, 128, "portable", "fmha_bwd_fused_bf16_d128",
         ordered=False),
    Case("v3_bwd_d128", "bwd", 1, 1024, 4, 4, 128, "v3", "fmha_bwd_dkdv_v3_bf16_d128", deterministic=False,
         v3_everywhere=True),
    # causal GQA: programs of one query head adding dK and dV into fp32 accumulators
    Case("v3_bwd_heads_d128_gqa", "bwd", 1, 1024, 4, 2, 128, "v3", "fmha_bwd_dkdv_heads_v3_bf16_d128",
         deterministic=False, v3_everywhere=True),
    Case("v3_bwd_latent_192_128", "bwd", 1, 1024, 4, 4, 192, "v3", "fmha_bwd_dkdv_v3_bf16_d192v128",
         deterministic=False, v3_everywhere=True, dv=128),
    Case("v3_bwd_wide_d256_gqa", "bwd", 1, 1024, 4, 2, 256, "v3", "fmha_bwd_dkdv_v3_bf16_d256", deterministic=False,
         v3_everywhere=True),
    Case("v3_bwd_ordered_d128_gqa", "bwd", 2, 1024, 8, 2, 128, "v3", "fmha_bwd_dkdv_ordered_v3_bf16_d128",
         v3_ordered=True),
    Case("v3_bwd_ordered_d64_4096_keys", "bwd", 1, 4096, 4, 4, 64, "v3", "fmha_bwd_dkdv_ordered_v3_bf16_d64",
         v3_ordered=True),
    Case("v3_bwd_ordered_latent_192_128", "bwd", 2, 1024, 4, 4, 192, "v3", "fmha_bwd_dkdv_ordered_v3_bf16_d192v128",
         v3_ordered=True, dv=128),
    Case("v3_bwd_ordered_wide_d256_gqa", "bwd", 1, 1024, 4, 2, 256, "v3", "fmha_bwd_dkdv_ordered_v3_bf16_d256",
         v3_ordered=True),
]


@pytest.fixture
def v3_mode(monkeypatch):
    """Sets the v3 family's mode for a test (as FMHA_RT_V3 would), and whether deterministic calls take the
    ORDERED strategy, and clears the plan cache around it."""
    def set_mode(everywhere, ordered=True, v3_ordered=False, portable_only=False):
        if everywhere or portable_only:  # a case about a portable path keeps it wherever v3's defaults move
            monkeypatch.setattr(v3, "MODE", "off" if portable_only else "all")
        # every arch it is built for, or none
        monkeypatch.setattr(portable, "ORDERED_FOR_DETERMINISTIC",
                            frozenset(portable.BUILT_DQ_STRATEGIES) if ordered else frozenset())
        monkeypatch.setattr(v3, "ORDERED_FOR_DETERMINISTIC", frozenset(v3.ARCHS) if v3_ordered else frozenset())
        fmha_rt.clear_plan_cache()

    yield set_mode
    monkeypatch.undo()
    fmha_rt.clear_plan_cache()


def prepare(case):
    """(call, output specs, float64 reference outputs) of a causal bf16 case with fresh inputs."""
    gen = generator(seed_of(case.name))
    dtype = torch.bfloat16
    q = rand((case.b, case.s, case.hq, case.d), dtype, gen)
    k = rand((case.b, case.s, case.hk, case.d), dtype, gen)
    v = rand((case.b, case.s, case.hk, case.dv or case.d), dtype, gen)

    def ran_as_intended():
        info = fmha_rt.last_launch_info()  # this thread's last call
        assert info["family"] == case.family, info
        assert any(name.startswith(case.kernel_prefix) for name in info["kernels"]), info

    if case.pass_name == "fwd":
        def call(outputs, stream):
            fmha_rt.mha_fwd(q, k, v, out=outputs[0], lse=outputs[1], causal=True, stream=stream)
            ran_as_intended()

        specs = [((*q.shape[:3], v.shape[3]), dtype), ((case.b, case.hq, case.s), torch.float32)]
        return call, specs, attention_f64(q, k, v, causal=True)

    dout = rand((*q.shape[:3], v.shape[3]), dtype, gen)
    out, lse = fmha_rt.mha_fwd(q, k, v, causal=True)

    def call(outputs, stream):
        dq, dk, dv = outputs
        fmha_rt.mha_bwd(dout, q, k, v, out, lse, dq=dq, dk=dk, dv=dv, causal=True,
                        deterministic=case.deterministic, stream=stream)
        ran_as_intended()

    specs = [(t.shape, dtype) for t in (q, k, v)]
    return call, specs, attention_f64(q, k, v, causal=True, dout=dout)[2:]


def check_against_float64(case, outputs, want):
    names = ("out", "lse") if case.pass_name == "fwd" else ("dq", "dk", "dv")
    for name, got, w in zip(names, outputs, want, strict=True):
        (assert_lse_close if name == "lse" else assert_close)(f"{case.name} {name}", got, w)


def check_repeats(case, snapshots, first, want):
    if case.deterministic:
        assert_bitwise(case.name, snapshots, first)
    else:
        for snapshot in snapshots:
            check_against_float64(case, snapshot, want)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_repeats_on_a_side_stream_and_from_8_threads(case, v3_mode):
    v3_mode(case.v3_everywhere, case.ordered, case.v3_ordered, portable_only=case.family == "portable")
    call, specs, want = prepare(case)
    first = reference_run(call, specs)
    check_against_float64(case, first, want)
    check_repeats(case, repeat(call, specs, torch.cuda.Stream(), SIDE_STREAM_REPEATS), first, want)
    check_repeats(case, repeat_from_threads(call, specs, threads=8, repeats=2), first, want)
