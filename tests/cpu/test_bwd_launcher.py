"""BwdLauncher's contract for every dQ strategy: dq_acc_splits counts the fp32 dQ accumulators the workspace
holds, workspace_size is the regions' extent, needs_zero_init says whether any must start at zero (and
exactly the accumulators, the ORDERED strategy's counters and dS do), prepare_workspace places every
region, and the workspace stays within its stated bound."""
import math
import types

import pytest

import fmha_rt
from fmha_rt.plan import layout, v3
from fmha_rt.plan import portable as pp
from fmha_rt.plan.operands import Operands
from fmha_rt.plan.problem import AttentionProblem

ZEROED = {"dq_acc", "dq_order", "ds", "dk_acc", "dv_acc"}  # every region that must hold zeros when the backward starts


def _problem(sk=512, hk=2, d=64, **extra):
    return AttentionProblem(2, 384, sk, 8, hk, d, d, "bf16", window_left=-1, window_right=0, **extra)


# (problem, arch, strategy BwdLauncher plans for it, family)
CASES = {
    "ordered_deterministic": (_problem(deterministic=True), "sm_90", pp.DQ_ORDERED, "portable"),
    "ordered_with_dbias": (_problem(deterministic=True, bias_shape="1HSS", bias_grad=True), "gfx942", pp.DQ_ORDERED,
                           "portable"),
    "single_tiny": (AttentionProblem(1, 64, 64, 2, 2, 64, 64, "bf16", deterministic=True), "sm_90", pp.DQ_SINGLE,
                    "portable"),
    "deterministic_gqa": (_problem(), "sm_90", pp.DQ_DETERMINISTIC, "portable"),
    "deterministic_default_sm_90": (_problem(deterministic=True), "sm_90", pp.DQ_DETERMINISTIC, "portable"),
    "atomic_interpret": (_problem(d=32), pp.INTERPRET_ARCH, pp.DQ_ATOMIC, "portable"),
    "fused_interpret": (_problem(sk=4096, d=32, hk=8), pp.INTERPRET_ARCH, pp.DQ_FUSED, "portable"),
    "v3_atomic": (AttentionProblem(2, 384, 4096, 8, 8, 128, 128, "bf16"), "sm_90", pp.DQ_ATOMIC, "v3"),
    # causal GQA's dK/dV by query head: fp32 dK and dV accumulators too
    "v3_atomic_gqa": (AttentionProblem(2, 384, 4096, 8, 2, 128, 128, "bf16", window_left=-1, window_right=0), "sm_90",
                      pp.DQ_ATOMIC, "v3"),
    "v3_ordered": (AttentionProblem(2, 384, 4096, 8, 2, 128, 128, "bf16", deterministic=True), "sm_90", pp.DQ_ORDERED,
                   "v3"),
}


def _fp32_dq_bytes(p):
    return 4 * p.batch * p.seqlen_q * p.heads_q * layout.padded_head_dim(p.head_dim_qk)


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_launcher_reports_what_its_workspace_holds(case, monkeypatch):
    monkeypatch.setattr(v3, "MODE", "measured")
    problem, arch, strategy, family = CASES[case]
    if strategy == pp.DQ_ORDERED:  # switched on for the case's arch (by default only the interpreter's)
        monkeypatch.setattr(v3 if family == "v3" else pp, "ORDERED_FOR_DETERMINISTIC", frozenset({arch}))
    launcher = fmha_rt.BwdLauncher(problem, arch)
    ws = launcher.workspace
    assert ws.dq_strategy == strategy and v3.serves_bwd(problem, arch) == (family == "v3")
    regions = {r.name: r for r in ws.regions}
    accumulators = [r for r in ws.regions if r.name == "dq_acc"]
    assert launcher.dq_acc_splits == len(accumulators) == (1 if strategy in (pp.DQ_ATOMIC, pp.DQ_ORDERED) else 0)
    for acc in accumulators:  # one fp32 dQ: [B, Sq, Hq, ceil8(Dqk)]
        assert acc.dtype == "fp32" and acc.nbytes == _fp32_dq_bytes(problem)
    assert ("dq_order" in regions) == (strategy == pp.DQ_ORDERED)
    heads = family == "v3" and v3.bwd_heads(problem)
    assert heads == (case == "v3_atomic_gqa")
    for name, dim in (("dk_acc", problem.head_dim_qk), ("dv_acc", problem.head_dim_v)):  # [B, Sk, Hk, ceil8(D)]
        assert (name in regions) == heads
        if heads:
            keys = problem.batch * problem.seqlen_k * problem.heads_k
            assert regions[name].dtype == "fp32" and regions[name].nbytes == 4 * keys * layout.padded_head_dim(dim)
    assert {r.name for r in ws.regions if r.zero_init} == ZEROED & set(regions)
    assert launcher.needs_zero_init == bool(ZEROED & set(regions))
    end = max((r.offset + r.nbytes for r in ws.regions), default=0)
    assert launcher.workspace_size == ws.total_bytes and end <= ws.total_bytes < end + layout.WORKSPACE_ALIGN
    base = 1 << 20
    operands = Operands()
    launcher.prepare_workspace(types.SimpleNamespace(pointer=types.SimpleNamespace(address=base)), operands)
    assert {name: t.address for name, t in operands.regions.items()} == {r.name: base + r.offset for r in ws.regions}


def test_the_ordered_workspace_is_one_fp32_dq_the_row_statistics_and_the_counters(monkeypatch):
    """The bound docs/api.md states: fp32 dQ + Delta and Lse2 (fp32 [B, Hq, ceil8(Sq)] each) + 4 bytes per
    (batch entry, query head, query block of the dK/dV tile) and one, each region rounded up to 256 bytes."""
    monkeypatch.setattr(pp, "ORDERED_FOR_DETERMINISTIC", frozenset(pp.BUILD_ARCHS))
    for arch in pp.BUILD_ARCHS:
        p = _problem(sk=1000, deterministic=True)
        block_m = pp.tile_for(arch, "bwd_dkdv", (64, 64), pp.BIAS_NONE, False).block_m
        rounded = lambda n: -(-n // layout.WORKSPACE_ALIGN) * layout.WORKSPACE_ALIGN  # noqa: E731
        rows = 4 * p.batch * p.heads_q * layout.ceil8(p.seqlen_q)
        counters = 4 * (1 + p.batch * p.heads_q * math.ceil(p.seqlen_q / block_m))
        ws = pp.bwd_workspace(p, arch)
        assert [(r.name, r.nbytes, r.zero_init) for r in ws.regions] == [
            ("delta", rows, False), ("lse2", rows, False), ("dq_acc", _fp32_dq_bytes(p), True),
            ("dq_order", counters, True)]
        assert ws.total_bytes == 2 * rounded(rows) + rounded(_fp32_dq_bytes(p)) + rounded(counters)
        assert ws.total_bytes < 1.2 * _fp32_dq_bytes(p)  # the statistics and counters are small beside dQ


@pytest.mark.parametrize("deterministic", [False, True])
def test_the_varlen_workspace_query_is_what_the_varlen_backward_asks_for(rt, driver, deterministic):
    """varlen_bwd_workspace_bytes launches nothing and gives the bytes mha_varlen_bwd then asks its
    workspace_alloc for (two sequences of at most 40 queries and 70 keys, GQA 4/2, causal)."""
    from fake_gpu import FakeGpuArray

    total_q, total_k, hq, hk, d = 60, 120, 4, 2, 64
    q, out, dout, dq = (FakeGpuArray((total_q, hq, d)) for _ in range(4))
    k, v, dk, dv = (FakeGpuArray((total_k, hk, d)) for _ in range(4))
    lse = FakeGpuArray((hq, total_q), "float32")
    cu_q, cu_k = FakeGpuArray((3,), "int32"), FakeGpuArray((3,), "int32")
    nbytes = fmha_rt.varlen_bwd_workspace_bytes(q, k, v, cu_q, cu_k, 40, 70, deterministic=deterministic, causal=True)
    assert driver.take() == []
    asked = []

    def workspace_alloc(n, zero_init):
        asked.append(n)
        return rt.workspace(n)

    fmha_rt.mha_varlen_bwd(dout, q, k, v, out, lse, cu_q, cu_k, 40, 70, dq=dq, dk=dk, dv=dv, deterministic=deterministic,
                           causal=True, workspace_alloc=workspace_alloc)
    assert driver.take() and asked == [nbytes] and nbytes >= 2 * 4 * hq * total_q  # Delta and Lse2 at least
