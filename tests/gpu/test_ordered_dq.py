"""The deterministic backward's ORDERED dQ strategy on a GPU: the persistent dK/dV pass adds dQ into one fp32
accumulator in key-block order, so its bits must not depend on timing nor on the number of persistent
programs (FMHA_RT_BWD_PROGRAMS forces one). Every case: a run checked against float64 at bf16, then 10
runs on a side stream for each forced program count and the default, each bitwise equal to the first run
(outputs re-poisoned with NaN before every run: tests/gpu/repeat_runs.py). Streams and threads: the ORDERED
cases of test_determinism.py. Both families: the portable persistent pass, and the v3 form (a program per
work item, launched in waves of the forced count) on the cases it serves."""
import pytest

from gpu_presence import require

torch = require("torch")

import fmha_rt
from error_bounds import assert_close
from fmha_rt import reference
from fmha_rt.plan import portable, v3
from fmha_rt.plan.problem import AttentionProblem
from fmha_rt.runtime import backend
from gpu_tensors import f64, generator, rand, seed_of, varlen_inputs
from repeat_runs import assert_bitwise, reference_run, repeat

RUNS = 10
# Forced program counts: fewer programs than items (7: each takes many, and items of one head run at once
# and wait for each other) and one per multiprocessor of an H100 or H200; None: the planned default.
PROGRAMS = (7, 132, None)

CASES = {
    # name: (B, Sq, Sk, Hq, Hk, Dqk, Dv, window, bottom_right)
    "mha_d128_causal": (2, 1024, 1024, 4, 4, 128, 128, (-1, 0), False),
    "gqa_d64_no_mask": (2, 777, 777, 8, 2, 64, 64, (-1, -1), False),
    "mqa_d128_causal_bottom_right_sq_lt_sk": (1, 600, 1500, 4, 1, 128, 128, (-1, 0), True),
    "gqa_d64_sliding_window": (1, 1500, 1500, 8, 2, 64, 64, (128, 64), False),
    "d256_causal": (1, 512, 512, 2, 2, 256, 256, (-1, 0), False),
    "gqa_d192_128_causal_partial_blocks": (1, 900, 900, 4, 2, 192, 128, (-1, 0), False),
}


# the v3 form serves every case (head dim 256 by the wide kernel's ordered form, 192/128 by its own tile's
# consumers adding dQ themselves)
V3_CASES = sorted(CASES)


@pytest.fixture
def family(request, monkeypatch):
    """Deterministic calls take the ORDERED strategy of the family (by default only the interpreter's
    portable one does, until it is measured on GPUs): the portable one on every arch it is built for, with
    the v3 form off, or the v3 form where it serves."""
    monkeypatch.setattr(portable, "ORDERED_FOR_DETERMINISTIC", frozenset(portable.BUILT_DQ_STRATEGIES))
    monkeypatch.setattr(v3, "ORDERED_FOR_DETERMINISTIC", frozenset(v3.ARCHS) if request.param == "v3" else frozenset())
    fmha_rt.clear_plan_cache()
    yield request.param
    fmha_rt.clear_plan_cache()


@pytest.fixture
def programs(monkeypatch):
    """Forces the ORDERED pass's program count (None: the default) and clears the plan cache around it."""
    def force(count):
        if count is None:
            monkeypatch.delenv(portable.BWD_PROGRAMS_ENV, raising=False)
        else:
            monkeypatch.setenv(portable.BWD_PROGRAMS_ENV, str(count))
        fmha_rt.clear_plan_cache()

    yield force
    monkeypatch.undo()
    fmha_rt.clear_plan_cache()


def ran_ordered(family):
    info = fmha_rt.last_launch_info()
    if family == "v3":
        assert info["family"] == "v3" and any(k.startswith("fmha_bwd_dkdv_ordered_v3_") for k in info["kernels"]), info
    else:
        assert info["family"] == "portable" and any(k.startswith("fmha_bwd_dkdv_") and k.endswith(("_ordered", "_ordered_mha"))
                                                    for k in info["kernels"]), info




@pytest.mark.parametrize("name, family", [(name, "portable") for name in sorted(CASES)] + [(name, "v3") for name in V3_CASES],
                         indirect=["family"])
def test_same_bits_over_runs_and_program_counts(name, family, programs):
    b, sq, sk, hq, hk, d, dv, window, bottom_right = CASES[name]
    gen = generator(seed_of(name))
    q, k, v = rand((b, sq, hq, d), torch.bfloat16, gen), rand((b, sk, hk, d), torch.bfloat16, gen), \
        rand((b, sk, hk, dv), torch.bfloat16, gen)
    dout = rand((b, sq, hq, dv), torch.bfloat16, gen)
    opts = {"window": window, "causal_alignment": "bottom_right" if bottom_right else "top_left"}
    out, lse = fmha_rt.mha_fwd(q, k, v, **opts)
    problem = AttentionProblem(b, sq, sk, hq, hk, d, dv, "bf16", window_left=window[0], window_right=window[1],
                               bottom_right=bottom_right, deterministic=True)
    arch = backend.device(torch.cuda.current_device()).arch

    def call(outputs, stream):
        dq, dk, dv = outputs
        fmha_rt.mha_bwd(dout, q, k, v, out, lse, dq=dq, dk=dk, dv=dv, deterministic=True, stream=stream, **opts)
        ran_ordered(family)

    specs = [(t.shape, t.dtype) for t in (q, k, v)]
    first = None
    for count in PROGRAMS:
        programs(count)
        if count is not None and family == "portable":
            # a forced count above the work items launches one program per item
            assert portable.ordered_programs(problem, arch) == min(count, portable.ordered_work_items(problem, arch))
        run = reference_run(call, specs)
        if first is None:
            first = run
            ref = reference.mha_bwd_ref(f64(dout), f64(q), f64(k), f64(v), window=window, bottom_right=bottom_right)
            for n, got, want in zip(("dq", "dk", "dv"), run, ref):
                assert_close(f"{name} {n}", got, want)
        assert_bitwise(f"{name} programs={count}", [run] + repeat(call, specs, torch.cuda.Stream(), RUNS), first)


@pytest.mark.parametrize("family", ["portable", "v3"], indirect=True)
def test_varlen_with_empty_and_single_token_sequences(family, programs):
    lens_q, lens_k = [37, 0, 1, 128, 64, 300], [50, 3, 1, 128, 0, 290]
    cu_q, cu_k, q, k, v, dout = varlen_inputs(lens_q, lens_k, 4, 2, 64, seed=seed_of("ordered varlen"))
    args = (cu_q, cu_k, max(lens_q), max(lens_k))
    opts = {"causal": True, "causal_alignment": "bottom_right"}
    out, lse = fmha_rt.mha_varlen_fwd(q, k, v, *args, **opts)

    def call(outputs, stream):
        dq, dk, dv = outputs
        fmha_rt.mha_varlen_bwd(dout, q, k, v, out, lse, *args, dq=dq, dk=dk, dv=dv, deterministic=True,
                               stream=stream, **opts)
        ran_ordered(family)

    specs = [(t.shape, t.dtype) for t in (q, k, v)]
    first = None
    for count in PROGRAMS:
        programs(count)
        run = reference_run(call, specs)
        if first is None:
            first = run
            cq, ck = cu_q.cpu().numpy(), cu_k.cpu().numpy()
            ref = reference.mha_varlen_bwd_ref(f64(dout), f64(q), f64(k), f64(v), cq, ck, window=(-1, 0),
                                               bottom_right=True)
            for n, got, want in zip(("dq", "dk", "dv"), run, ref):
                assert_close(f"varlen {n}", got, want)
        assert_bitwise(f"varlen programs={count}", [run] + repeat(call, specs, torch.cuda.Stream(), RUNS), first)
    assert bool(torch.isfinite(first[0]).all())  # rows of the sequences without keys get dQ = 0, not NaN
