"""`python -m fmha_rt quickstart`: the first thing a new user runs. What needs no GPU first (the
packages that import, the code objects against the manifest), then on a GPU the self-test and one
real attention problem, forward and backward, against the float64 reference, with its timing.
Without a GPU it stops after the first part with one line saying what is missing."""
from __future__ import annotations

import importlib.util
import platform
import time

import numpy as np

from . import __version__
from .gpu_presence import NO_GPU_EXIT, NoGpu, require_gpu

FRAMEWORKS = ("torch", "jax", "cupy", "hip")  # hip: hip-python's package
# The problem: bf16, B=2, S=2048, H=16, D=128, causal; fwd+bwd. The float64 reference covers the
# first batch's first REFERENCE_HEADS heads (heads are independent; all 32 would take minutes on a CPU).
PROBLEM = dict(batch=2, seqlen=2048, heads=16, head_dim=128)
REFERENCE_HEADS = 2
TOLERANCE = 1e-2  # relative error of bf16 inputs with fp32 accumulation, as the GPU tests allow
TIMED_RUNS = 10


def framework_lines() -> list[str]:
    lines = []
    for name in FRAMEWORKS:
        found = importlib.util.find_spec(name) is not None
        lines.append(f"  {name}: {'installed' if found else 'not installed'}")
    return lines


def run_quickstart(device: int = 0) -> int:
    from .cli import registry_report

    print(f"fmha_rt {__version__} on Python {platform.python_version()}")
    print("array libraries:", *framework_lines(), sep="\n")
    lines, code_objects_ok = registry_report()
    print(*lines, sep="\n")
    try:
        require_gpu(device, "the rest (the self-test and an attention problem)")
    except NoGpu as exc:
        print(f"GPU: {exc}")
        return NO_GPU_EXIT
    from .selftest import run_selftest

    print("self-test:")
    selftest_ok = run_selftest(device) == 0
    attention_ok = run_attention_problem(device)
    return 0 if code_objects_ok and selftest_ok and attention_ok else 1


def run_attention_problem(device: int, seed: int = 0) -> bool:
    """PROBLEM forward and backward through fmha_rt on torch tensors: prints the relative errors against
    the float64 reference and the time and TFLOP/s of each pass; whether every error is in TOLERANCE."""
    if importlib.util.find_spec("torch") is None:
        print("attention problem: needs torch (pip install '.[torch]')")
        return False
    import torch

    import fmha_rt
    from . import reference
    from .bench.flops import pass_flops, tflops

    b, s, h, d = PROBLEM.values()
    print(f"attention: bf16 B={b} S={s} H={h} D={d} causal, forward and deterministic backward (seed {seed})")
    gen = torch.Generator(device=f"cuda:{device}").manual_seed(seed)
    q, k, v, dout = (torch.randn((b, s, h, d), generator=gen, device=f"cuda:{device}").to(torch.bfloat16)
                     for _ in range(4))
    out, lse = fmha_rt.mha_fwd(q, k, v, causal=True)
    dq, dk, dv = fmha_rt.mha_bwd(dout, q, k, v, out, lse, causal=True, deterministic=True)
    torch.cuda.synchronize(device)

    def first_heads(t):
        return t[:1, :, :REFERENCE_HEADS].to("cpu", torch.float64).numpy()

    q64, k64, v64, dout64 = map(first_heads, (q, k, v, dout))
    want_out, want_lse = reference.mha_fwd_ref(q64, k64, v64, window=(-1, 0))
    want_grads = reference.mha_bwd_ref(dout64, q64, k64, v64, window=(-1, 0))[:3]
    got_lse = lse[:1, :REFERENCE_HEADS].to("cpu", torch.float64).numpy()
    errors = {"out": reference.rel_err(first_heads(out), want_out), "lse": reference.rel_err(got_lse, want_lse)}
    errors.update((name, reference.rel_err(first_heads(got), want))
                  for name, got, want in zip(("dq", "dk", "dv"), (dq, dk, dv), want_grads))
    ok = all(np.isfinite(e) and e < TOLERANCE for e in errors.values())
    print("  relative error vs float64 (batch 0, heads 0-1): "
          + ", ".join(f"{name} {err:.1e}" for name, err in errors.items()) + f"  {'PASS' if ok else 'FAIL'}")
    passes = {"fwd": lambda: fmha_rt.mha_fwd(q, k, v, causal=True),
              "bwd": lambda: fmha_rt.mha_bwd(dout, q, k, v, out, lse, causal=True, deterministic=True)}
    for name, call in passes.items():
        ms = time_call(call, device)
        print(f"  {name}: {ms:.3f} ms, {tflops(pass_flops(name, b, h, s, s, d, True), ms):.0f} TFLOP/s "
              f"(mean of {TIMED_RUNS} after a warm-up)")
    return ok


def time_call(call, device: int) -> float:
    """Mean milliseconds of `call` over TIMED_RUNS back-to-back runs after one warm-up run."""
    import torch

    call()
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(TIMED_RUNS):
        call()
    torch.cuda.synchronize(device)
    return (time.perf_counter() - start) * 1e3 / TIMED_RUNS
