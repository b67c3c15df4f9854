"""Every kernel family and pass, repeated on a side stream and from 8 threads at once (each thread on
its own stream), into outputs re-poisoned with NaN before every run (tests/gpu/repeat_runs.py).

A reference run on the current stream is checked against the float64 attention (whole tensor, per head,
per row); the repeats of a deterministic call must equal it bit for bit (raw bits: -0.0 and 0.0
differ), and the repeats of the v3 backward (which adds dQ in any order) must each pass the float64 check.
A GPU sleep ahead of each repeat's poison makes a launch that misses the call's stream show as NaN.
"""
import pytest

from gpu_presence import require

torch = require("torch")

import fmha_rt
from determinism_cases import CASES, set_mode
from error_bounds import assert_close, assert_lse_close
from gpu_tensors import attention_f64, generator, rand, seed_of
from repeat_runs import assert_bitwise, reference_run, repeat, repeat_from_threads

SIDE_STREAM_REPEATS = 3


@pytest.fixture
def case_mode(monkeypatch):
    """set_mode for a test, the plan cache cleared again afterwards."""
    yield lambda case: set_mode(monkeypatch, case)
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
def test_repeats_on_a_side_stream_and_from_8_threads(case, case_mode):
    case_mode(case)
    call, specs, want = prepare(case)
    first = reference_run(call, specs)
    check_against_float64(case, first, want)
    check_repeats(case, repeat(call, specs, torch.cuda.Stream(), SIDE_STREAM_REPEATS), first, want)
    check_repeats(case, repeat_from_threads(call, specs, threads=8, repeats=2), first, want)
