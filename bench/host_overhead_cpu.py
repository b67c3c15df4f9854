"""Host microseconds per cached call of mha_fwd, mha_bwd, mha_varlen_fwd and mha_varlen_bwd on torch
tensors, measured on the CPU stand-in.

NOT A GPU NUMBER. The runtime is tests/cpu/fake_gpu.py's two-device sm_90 stand-in: torch CPU tensors
pose as CUDA tensors, allocations and memsets are host memory, and the driver's launch is a no-op, so
the numbers are fmha_rt's own Python work per call without the driver's (about 4 µs per launch on an
H200). Use them to compare versions of the cached path on one machine; `python -m fmha_rt bench
--overhead-only` measures the real thing on a GPU.

    python bench/host_overhead_cpu.py [--calls N] [--rounds R] [--profile NAME]

Shape as the GPU bench's overhead point: B=1 H=1 S=128 D=64 fp16, varlen as two sequences (48, 80).
Outputs (out/lse, dq/dk/dv) are given; the backward's workspace comes from fmha_rt's own allocator.
Each round times N back-to-back calls of every function in turn (so a loaded machine slows all of them
alike); the minimum over R rounds is printed. --profile NAME prints a cProfile of NAME's cached call.
"""
import argparse
import contextlib
import cProfile
import pathlib
import pstats
import sys
import time

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "cpu")]  # this checkout's fmha_rt, and the stand-in

import fmha_rt
from fmha_rt import arrays, launch
from fmha_rt import registry as registry_module
from fmha_rt.backend import ffi

from fake_gpu import StandInRuntime

B, S, H, D = 1, 128, 1, 64
SEQLENS = (48, 80)


@contextlib.contextmanager
def stand_in():
    """The fake runtime, torch CPU tensors read as CUDA tensors and a driver launch that does nothing."""
    with pytest.MonkeyPatch.context() as m:
        m.delenv("FMHA_RT_LOG_CONFIG", raising=False)
        registry_module.reset()
        StandInRuntime(m)
        as_cuda = arrays.TorchView.__init__

        def cuda_view(self, t):
            as_cuda(self, t)
            self.device_type = "cuda"

        m.setattr(arrays.TorchView, "__init__", cuda_view)
        m.setattr(launch, "kernel_handle", lambda device, entry: ffi.NULL)
        m.setattr(launch, "_launch", lambda config, stream: 0)
        fmha_rt.clear_plan_cache()
        try:
            yield
        finally:
            fmha_rt.clear_plan_cache()
            registry_module.reset()


def calls() -> dict:
    """name -> a zero-argument cached call (each is called twice here, so the next call hits)."""
    def randn(*shape):
        return torch.randn(*shape, dtype=torch.float16)

    q, k, v, dout = (randn(B, S, H, D) for _ in range(4))
    out, lse = torch.empty_like(q), torch.empty(B, H, S)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    total = sum(SEQLENS)
    vq, vk, vv, vdout = (randn(total, H, D) for _ in range(4))
    vout, vlse = torch.empty_like(vq), torch.empty(H, total)
    vdq, vdk, vdv = torch.empty_like(vq), torch.empty_like(vk), torch.empty_like(vv)
    cu = torch.tensor([0, SEQLENS[0], total], dtype=torch.int32)
    longest = max(SEQLENS)
    table = {
        "mha_fwd": lambda: fmha_rt.mha_fwd(q, k, v, out=out, lse=lse),
        "mha_bwd": lambda: fmha_rt.mha_bwd(dout, q, k, v, out, lse, dq=dq, dk=dk, dv=dv),
        "mha_varlen_fwd": lambda: fmha_rt.mha_varlen_fwd(vq, vk, vv, cu, cu, longest, longest, out=vout, lse=vlse),
        "mha_varlen_bwd": lambda: fmha_rt.mha_varlen_bwd(vdout, vq, vk, vv, vout, vlse, cu, cu, longest, longest,
                                                         dq=vdq, dk=vdk, dv=vdv),
    }
    for call in table.values():
        call()
        call()
    return table


def per_call_us(call, n: int) -> float:
    start = time.perf_counter()
    for _ in range(n):
        call()
    return (time.perf_counter() - start) / n * 1e6


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=5000, help="calls per timed loop")
    parser.add_argument("--rounds", type=int, default=7, help="timed loops per function; the minimum is printed")
    parser.add_argument("--profile", metavar="NAME", help="print a cProfile of NAME's cached call instead")
    args = parser.parse_args()
    with stand_in():
        table = calls()
        hits = fmha_rt.plan_cache_info()["hits"]
        if args.profile:
            profile = cProfile.Profile()
            profile.runcall(per_call_us, table[args.profile], args.calls)
            pstats.Stats(profile).sort_stats("tottime").print_stats(25)
            return
        best = dict.fromkeys(table, float("inf"))
        for _ in range(args.rounds):
            for name, call in table.items():
                best[name] = min(best[name], per_call_us(call, args.calls))
        cached = fmha_rt.plan_cache_info()["hits"] - hits
        assert cached == args.rounds * args.calls * len(table), "a timed call missed the plan cache"
    print("cached call, µs (CPU stand-in, not a GPU number; min of "
          f"{args.rounds} rounds of {args.calls} calls)")
    for name, us in best.items():
        print(f"  {name:16s} {us:6.2f}")


if __name__ == "__main__":
    main()
