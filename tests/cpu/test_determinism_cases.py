"""Each case of tests/gpu/test_determinism.py still launches the kernel it is about, planned here on the
stand-in runtime: a default that moves (a family taking over a length, a new tile) shows on the CPU rather
than as a failure of the GPU suite."""
import pytest

import fmha_rt
from determinism_cases import CASES, set_mode
from fake_gpu import FakeGpuArray


def arrays(case):
    """The case's arrays as its GPU test makes them (bf16, Q [B, S, Hq, D], K [B, S, Hk, D], V [B, S, Hk, Dv]),
    in stand-in memory."""
    dv = case.dv or case.d
    q = FakeGpuArray((case.b, case.s, case.hq, case.d), "bfloat16")
    k = FakeGpuArray((case.b, case.s, case.hk, case.d), "bfloat16")
    v = FakeGpuArray((case.b, case.s, case.hk, dv), "bfloat16")
    out = FakeGpuArray((case.b, case.s, case.hq, dv), "bfloat16")
    lse = FakeGpuArray((case.b, case.hq, case.s), "float32")
    return q, k, v, out, lse


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_each_case_launches_the_kernel_it_is_about(case, rt, driver, monkeypatch):
    set_mode(monkeypatch, case)
    q, k, v, out, lse = arrays(case)
    if case.pass_name == "fwd":
        fmha_rt.mha_fwd(q, k, v, out=out, lse=lse, causal=True)
    else:
        dq, dk, dv = (FakeGpuArray(t.shape, "bfloat16") for t in (q, k, v))
        dout = FakeGpuArray(out.shape, "bfloat16")
        fmha_rt.mha_bwd(dout, q, k, v, out, lse, dq=dq, dk=dk, dv=dv, causal=True, deterministic=case.deterministic)
    keys = [key for key, *_ in driver.take()]
    assert fmha_rt.last_launch_info()["family"] == case.family
    assert any(key.startswith(case.kernel_prefix) for key in keys), keys
