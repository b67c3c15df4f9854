"""Host microseconds per cached call of mha_fwd, mha_bwd, mha_varlen_fwd and mha_varlen_bwd on torch
tensors and on arrays with a CUDA Array Interface, whole and piece by piece, on the GPU (--gpu) or on
the CPU stand-in.

On the stand-in (the default; NOT A GPU NUMBER) the runtime is tests/cpu/fake_gpu.py's two-device sm_90
stand-in: torch CPU tensors pose as CUDA tensors, allocations and memsets are host memory, and the
replay's launches call back into Python and do nothing, so the numbers are fmha_rt's own Python work
per call without the driver's. The rows "... cai" take fake_gpu.py's GPU arrays, which export the
CUDA Array Interface as CuPy does (a new dict per read, on the legacy default stream, the call's
stream): their pointers' devices are asked of the stand-in driver, a Python callback per pointer that
the real driver answers in C. Use the numbers to compare versions of the cached path on one machine.
With --gpu the calls run on GPU 0 with CUDA tensors, and with CuPy arrays (rows "... cupy") when cupy
can be imported: what `python -m fmha_rt bench --overhead-only` measures, plus where it goes (with
--pieces also what describing CuPy arrays costs: CuPy's interface dict, the driver's pointer query,
and five arrays described from their attributes against the same through their interface).

    python bench/host_overhead_profile.py [--gpu] [--calls N] [--rounds R] [--profile NAME] [--pieces]
                                          [--out FILE]

Shape as the GPU bench's overhead point: B=1 H=1 S=128 D=64 fp16, varlen as two sequences (48, 80);
the rows "mha_bwd 2 launches" at S=1056, past the one-launch backward's limit (SINGLE_MAX_SCORES).
Outputs (out/lse, dq/dk/dv) are given, as fmha_rt.torch gives them, except in the rows "mha_fwd alloc"
(fmha_rt has the arrays' framework allocate them, asking it for its current stream) and, with --gpu,
"mha_fwd alloc side stream" (the call on another stream: each output is also tied to it); the backward's workspace comes
from fmha_rt's own allocator (the buffer the shim keeps for the stream, taken in the replay), and in the row
"mha_bwd torch ws" from fmha_rt.torch.caching_workspace, as fmha_rt.torch's backward takes it
(torch's caching allocator). --out FILE (with --gpu) writes the numbers as JSON with the machine header (date, GPU,
driver, versions).
Each round times N calls of every function in turn (so a loaded machine slows all of them alike); the
minimum over R rounds is printed. With --gpu the calls are timed in batches of --batch (default 100)
with a synchronize between batches, outside the timed region: a batch's launches fit the driver's
launch queue, so the figure is the host's own time per call. Back to back (N calls, one synchronize
at the end, also printed) the queue fills whenever the GPU takes longer per call than the host, and
a call then waits for the GPU: that figure is the larger of host time and GPU time per call.
--profile NAME prints a cProfile of NAME's cached call; --pieces times the parts of a cached call of
each function: the key, the lookup, the replay, and the C replay alone (checks, workspace, zero fills
and launches: CallPlan.launch).
"""
import argparse
import contextlib
import cProfile
import json
import pathlib
import pstats
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "cpu")]  # this checkout's fmha_rt, and the stand-in

import fmha_rt
from fmha_rt import arrays, call_keys
from fmha_rt.runtime import backend, kernel_launch
from fmha_rt.replay import plan_cache
from fmha_rt.runtime import registry as registry_module
from fmha_rt.runtime.backend import ffi
from fmha_rt.bench import machine
from fmha_rt.bench.timing import host_us_per_call
from fmha_rt.torch import caching_workspace

from fake_gpu import FakeGpuArray, StandInRuntime

B, S, H, D = 1, 128, 1, 64
SEQLENS = (48, 80)
S_TWO_LAUNCHES = 1056  # B*H*S*S past portable.SINGLE_MAX_SCORES: the backward is two launches


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
        m.setattr(kernel_launch, "kernel_handle", lambda device, entry: ffi.NULL)
        m.setattr(kernel_launch, "launch_prepared", lambda config, stream: 0)
        fmha_rt.clear_plan_cache()
        try:
            yield
        finally:
            fmha_rt.release_workspaces()  # the stand-in's host memory, while the stand-in is alive
            fmha_rt.clear_plan_cache()
            registry_module.reset()


@contextlib.contextmanager
def real_gpu():
    fmha_rt.clear_plan_cache()
    try:
        yield
    finally:
        fmha_rt.clear_plan_cache()


class TorchArrays:
    """The arrays of the torch rows, on `device`."""

    def __init__(self, device: str):
        self.device = device

    def randn(self, *shape):
        return torch.randn(*shape, dtype=torch.float16, device=self.device)

    def empty(self, *shape, dtype="float16"):
        return torch.empty(*shape, dtype=getattr(torch, dtype), device=self.device)

    def offsets(self, values):
        return torch.tensor(values, dtype=torch.int32, device=self.device)


class InterfaceArrays:
    """The stand-in's GPU arrays, read through their CUDA Array Interface (their memory is never read)."""

    def randn(self, *shape):
        return self.empty(*shape)

    def empty(self, *shape, dtype="float16"):
        return FakeGpuArray(shape, dtype, stream=1)  # CuPy's stream entry on its default stream

    def offsets(self, values):
        return self.empty(len(values), dtype="int32")


class CupyArrays:
    """CuPy arrays on GPU 0, read through their CUDA Array Interface."""

    def __init__(self, cupy):
        self.cupy = cupy

    def randn(self, *shape):
        return self.cupy.random.standard_normal(shape, dtype=self.cupy.float32).astype(self.cupy.float16)

    def empty(self, *shape, dtype="float16"):
        return self.cupy.empty(shape, dtype=dtype)

    def offsets(self, values):
        return self.cupy.asarray(values, dtype=self.cupy.int32)


def rows(make, suffix: str = "", workspace=None) -> dict:
    """name + suffix -> a zero-argument cached call on the arrays `make` makes; with `workspace`
    (q -> a workspace_alloc) also the backward on that workspace, "mha_bwd torch ws"."""
    q, k, v, dout = (make.randn(B, S, H, D) for _ in range(4))
    out, lse = make.randn(B, S, H, D), make.empty(B, H, S, dtype="float32")
    dq, dk, dv = (make.randn(B, S, H, D) for _ in range(3))
    total = sum(SEQLENS)
    vq, vk, vv, vdout, vout, vdq, vdk, vdv = (make.randn(total, H, D) for _ in range(8))
    vlse = make.empty(H, total, dtype="float32")
    cu = make.offsets([0, SEQLENS[0], total])
    longest = max(SEQLENS)
    bq, bk, bv, bdout, bout, bdq, bdk, bdv = (make.randn(B, S_TWO_LAUNCHES, H, D) for _ in range(8))
    blse = make.empty(B, H, S_TWO_LAUNCHES, dtype="float32")
    table = {
        f"mha_fwd{suffix}": lambda: fmha_rt.mha_fwd(q, k, v, out=out, lse=lse),
        f"mha_bwd{suffix}": lambda: fmha_rt.mha_bwd(dout, q, k, v, out, lse, dq=dq, dk=dk, dv=dv),
        f"mha_bwd 2 launches{suffix}": lambda: fmha_rt.mha_bwd(bdout, bq, bk, bv, bout, blse, dq=bdq, dk=bdk, dv=bdv),
    }
    if workspace is not None:
        table["mha_bwd torch ws"] = lambda: fmha_rt.mha_bwd(dout, q, k, v, out, lse, dq=dq, dk=dk, dv=dv,
                                                            workspace_alloc=workspace(q))
    table[f"mha_varlen_fwd{suffix}"] = lambda: fmha_rt.mha_varlen_fwd(vq, vk, vv, cu, cu, longest, longest, out=vout,
                                                                      lse=vlse)
    table[f"mha_varlen_bwd{suffix}"] = lambda: fmha_rt.mha_varlen_bwd(vdout, vq, vk, vv, vout, vlse, cu, cu, longest,
                                                                      longest, dq=vdq, dk=vdk, dv=vdv)
    return table


def allocating_rows(make, suffix: str = "", side_stream=None) -> dict:
    """The forward with out and lse left to fmha_rt: the arrays' framework allocates them, and fmha_rt asks
    it for its current stream once per output; on `side_stream` (a stream that is not the framework's
    current one) each output is also tied to the call's stream (torch's record_stream)."""
    q, k, v = (make.randn(B, S, H, D) for _ in range(3))
    table = {f"mha_fwd alloc{suffix}": lambda: fmha_rt.mha_fwd(q, k, v)}
    if side_stream is not None:
        table[f"mha_fwd alloc side stream{suffix}"] = lambda: fmha_rt.mha_fwd(q, k, v, stream=side_stream)
    return table


def _cupy():
    """CuPy when it can be imported: the GPU rows need only torch."""
    try:
        import cupy
    except ImportError:
        return None
    return cupy


def calls(gpu: bool) -> dict:
    """name -> a zero-argument cached call (each called twice here: a signature is recorded the second
    time it is seen)."""
    torch_arrays = TorchArrays("cuda" if gpu else "cpu")
    table = rows(torch_arrays, workspace=lambda q: caching_workspace(q.device))
    table.update(allocating_rows(torch_arrays, side_stream=torch.cuda.Stream() if gpu else None))
    if not gpu:
        table.update(rows(InterfaceArrays(), " cai"))
    elif (cupy := _cupy()) is not None:
        cupy_arrays = CupyArrays(cupy)
        table.update(rows(cupy_arrays, " cupy"))
        table.update(allocating_rows(cupy_arrays, " cupy", side_stream=cupy.cuda.Stream(non_blocking=True)))
    for call in table.values():
        call()
        call()
    return table


class Pieces:
    """Catches the internals of one cached call (its key request, plan, replay arguments and the C
    replay's) so that each piece can be timed alone."""

    def __init__(self, call):
        self.seen = {}
        request, replay, launch_plan = call_keys.key_request, plan_cache.replay, plan_cache.CallPlan.launch

        def catch_request(*args):
            self.seen["request"] = args
            return request(*args)

        def catch_replay(*args):
            self.seen["replay"] = args  # the value array too: a replay writes the same positions each time
            return replay(*args)

        def catch_launch(plan, *args):
            self.seen["launch"] = (plan, args)
            return launch_plan(plan, *args)

        with pytest.MonkeyPatch.context() as m:
            m.setattr(call_keys, "key_request", catch_request)
            m.setattr(plan_cache, "replay", catch_replay)
            m.setattr(plan_cache.CallPlan, "launch", catch_launch)
            call()

    def timings(self, n: int, batch: int = 0, sync=None) -> dict:
        request = self.seen["request"]
        key = call_keys.key_request(*request)[0]
        runtime = backend.runtime()
        replay = self.seen["replay"]
        plan, launch_args = self.seen["launch"]
        return {
            "key": host_us_per_call(lambda: call_keys.key_request(*request), n),
            "lookup": host_us_per_call(lambda: call_keys.PLANS.get(key, runtime, registry_module.registry()), n),
            "replay": host_us_per_call(lambda: plan_cache.replay(*replay), n, batch, sync),
            "C replay": host_us_per_call(lambda: plan.launch(*launch_args), n, batch, sync),
        }


def array_pieces(n: int) -> dict:
    """What describing CuPy arrays costs: CuPy making one array's CUDA Array Interface dict, the driver's
    answer to where a pointer lives (asked through cffi, as the interface path asks it in C), and the
    describer on five arrays read from their attributes (how CuPy arrays are described) against the
    same five read through their interface (how they were before, and how other arrays are)."""
    cupy = _cupy()
    if cupy is None:
        return {}
    five = tuple(cupy.empty((B, S, H, D), dtype=cupy.float16) for _ in range(5))
    a, values = five[0], plan_cache.value_array(len(five))
    kind, device, memory = (ffi.new("int *") for _ in range(3))
    ptr, address = a.data.ptr, int(ffi.cast("uintptr_t", values))
    by_attributes = arrays.make_describer(kernel_launch.REPLAY_OPS, (), cupy.ndarray)
    by_interface = arrays.make_describer(kernel_launch.REPLAY_OPS, (), None)
    return {"cupy __cuda_array_interface__": host_us_per_call(lambda: a.__cuda_array_interface__, n),
            "pointer location query": host_us_per_call(
                lambda: backend.lib.fmha_pointer_location(ptr, kind, device, memory), n),
            "describe 5 cupy arrays, attributes": host_us_per_call(lambda: by_attributes(five, address, 5, 0), n),
            "describe 5 cupy arrays, interface": host_us_per_call(lambda: by_interface(five, address, 5, 0), n)}


def print_profile(call, n: int) -> None:
    """A cProfile of n calls of `call`, the functions that spent most time first."""
    profile = cProfile.Profile()
    profile.runcall(host_us_per_call, call, n)
    pstats.Stats(profile).sort_stats("tottime").print_stats(25)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpu", action="store_true",
                        help="run on GPU 0 with CUDA tensors, and CuPy arrays when cupy imports (default: the CPU stand-in)")
    parser.add_argument("--calls", type=int, default=5000, help="calls per timed loop")
    parser.add_argument("--rounds", type=int, default=7, help="timed loops per function; the minimum is printed")
    parser.add_argument("--profile", metavar="NAME", help="print a cProfile of NAME's cached call instead")
    parser.add_argument("--pieces", action="store_true", help="also time the pieces of each cached call")
    parser.add_argument("--batch", type=int, default=100,
                        help="with --gpu: synchronize every BATCH calls, untimed, so that the launch queue never "
                             "fills (0: back to back only)")
    parser.add_argument("--out", type=pathlib.Path, help="with --gpu: write the numbers here as JSON")
    args = parser.parse_args()
    with real_gpu() if args.gpu else stand_in():
        table = calls(args.gpu)
        hits = fmha_rt.plan_cache_info()["hits"]
        if args.profile:
            print_profile(table[args.profile], args.calls)
            return
        sync, batch = (torch.cuda.synchronize, args.batch) if args.gpu else (None, 0)
        best = dict.fromkeys(table, float("inf"))
        back_to_back = dict.fromkeys(table, float("inf"))
        for _ in range(args.rounds):
            for name, call in table.items():
                best[name] = min(best[name], host_us_per_call(call, args.calls, batch, sync))
                if batch:
                    back_to_back[name] = min(back_to_back[name], host_us_per_call(call, args.calls, 0, sync))
        cached = fmha_rt.plan_cache_info()["hits"] - hits
        loops = 2 if batch else 1
        assert cached == loops * args.rounds * args.calls * len(table), "a timed call missed the plan cache"
        pieces = ({name: Pieces(call).timings(args.calls, batch, sync) for name, call in table.items()}
                  if args.pieces else {})
        per_array = array_pieces(args.calls * 10) if args.pieces and args.gpu else {}
        if args.gpu:
            torch.cuda.synchronize()
    if args.out is not None and args.gpu:
        record = {**machine.header(0, {}, {"calls": args.calls, "rounds": args.rounds, "batch": batch,
                                           "shape": [B, S, H, D],
                                           "varlen_seqlens": list(SEQLENS), "dtype": "float16"}),
                  "command": ["python", "bench/host_overhead_profile.py",
                              *(pathlib.Path(a).name if a == str(args.out) else a for a in sys.argv[1:])],
                  "us_per_call": best, "pieces_us": pieces, "per_array_us": per_array,
                  **({"us_per_call_back_to_back": back_to_back} if batch else {})}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=1) + "\n")
    where = "GPU 0" if args.gpu else "CPU stand-in, not a GPU number"
    queue = f", synchronized every {batch} calls (host time)" if batch else ""
    print(f"cached call, µs ({where}; min of {args.rounds} rounds of {args.calls} calls{queue})")
    for name, us in best.items():
        parts = "".join(f"  {piece} {t:5.2f}" for piece, t in pieces.get(name, {}).items())
        b2b = f"  back to back {back_to_back[name]:6.2f}" if batch else ""
        print(f"  {name:25s} {us:6.2f}{b2b}{parts}")
    for name, us in per_array.items():
        print(f"  per array: {name} {us:.2f}")


if __name__ == "__main__":
    main()
