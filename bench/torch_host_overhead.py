"""Host microseconds per call of the torch user path: fmha_rt.torch's flash_attn_func and
flash_attn_varlen_func, forward (inputs with and without grad) and a training step (forward, then
`.sum().backward()`), through the eager route (what an eager call takes) and through the registered
ops (torch_eager.registered_ops_only: the route every call took before issue 37, and the ops a compiled
graph runs), against torch's scaled_dot_product_attention called the same way.

    python bench/torch_host_overhead.py [--gpu] [--calls N] [--rounds R] [--profile NAME] [--torch-profile NAME]
        [--backward-on-caller] [--parts] [--out FILE]

Shape as issue 37's table: B=1, S=128, H=2, D=64, bf16, causal (varlen: two sequences of 48 and 80),
so that the host dominates. With --gpu the calls run on GPU 0 and are timed in batches of --batch
calls (default 100) with a synchronize between batches, outside the timed region: a batch fits the
launch queue, so the figure is the host's own time per call. Without --gpu they run on the CPU
stand-in of host_overhead_profile.py (NOT A GPU NUMBER: torch CPU tensors pose as CUDA tensors and
launches do nothing, so a row is the Python and torch work per call) and the SDPA rows, which would
compute on the CPU, are left out. Each round times every row in turn; the minimum over the rounds is
printed. --profile NAME prints a cProfile of that row instead, --torch-profile NAME torch.profiler's
table of its ops and runtime calls; --backward-on-caller runs backwards on the calling thread, not
autograd's device thread (the hand-over's cost: a Python backward needs the GIL there); --parts adds rows
for the pieces of a step (each backward alone, through torch.autograd.grad on a kept graph; the step with
a dense gradient and with its graph kept; SDPA's step through one added Python autograd node; the
adapter's backward without autograd and the allocations it makes); --out FILE (with --gpu) writes the numbers as JSON
with the machine header.
"""
import argparse
import json
import pathlib
import sys

import torch
import torch.nn.functional as F

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]  # this checkout's fmha_rt (the stand-in comes with host_overhead_profile)

import fmha_rt  # noqa: E402
from fmha_rt.bench import machine  # noqa: E402
from fmha_rt.bench.timing import host_us_per_call  # noqa: E402
from fmha_rt import torch_calls, torch_eager  # noqa: E402
from fmha_rt.torch import flash_attn_func, flash_attn_varlen_func  # noqa: E402

from host_overhead_profile import print_profile, real_gpu, stand_in  # noqa: E402

B, S, H, D = 1, 128, 2, 64
SEQLENS = (48, 80)
DTYPE = torch.bfloat16


def _registered(attention):
    """`attention` through the registered ops, the route every call took before issue 37 (and the ops a
    compiled graph runs)."""
    def call():
        with torch_eager.registered_ops_only():
            return attention()
    return call


def _step(attention):
    """A training step of `attention` (a zero-argument forward)."""
    return lambda: attention().sum().backward()


def _backward_alone(out, inputs):
    """A backward of a kept graph through autograd's engine: the step without its forward and sum."""
    grad = torch.ones_like(out)
    return lambda: torch.autograd.grad(out, inputs, grad, retain_graph=True)


class _PythonNode(torch.autograd.Function):
    """An identity with a Python backward: what one Python autograd node adds to a step."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


def part_calls(q, k, v, sdpa_inputs) -> dict:
    """The pieces of a training step: the step with a dense gradient of out in place of `.sum()`'s
    broadcast one (which the adapter copies), the step keeping its graph (no saved tensor released, no
    node freed at its end), each backward alone, and fmha_rt.torch's backward without
    autograd and the allocations it makes (gradients and workspace); SDPA's step with one Python autograd
    node added (an identity), which is what fmha_rt.torch's node is to torch's engine."""
    out, lse = torch_calls.forward(q, k, v, None, None, None, None, S, S, None, -1, 0, 0.0)
    dout = torch.randn_like(out)
    table = {
        "part: flash_attn_func fwd+bwd(dense)": lambda: flash_attn_func(q, k, v, causal=True).backward(dout),
        "part: flash_attn_func fwd+bwd, graph kept": lambda: flash_attn_func(q, k, v, causal=True).sum().backward(
            retain_graph=True),
        "part: flash_attn_func bwd alone": _backward_alone(flash_attn_func(q, k, v, causal=True), (q, k, v)),
        "part: adapter's backward, no autograd": lambda: torch_calls.backward(
            dout, q, k, v, out, lse, None, None, None, None, S, S, None, -1, 0, 0.0, False),
        "part: three empty_like and an empty": lambda: (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v),
                                                        torch.empty(4096, dtype=torch.uint8, device=q.device)),
    }
    if sdpa_inputs is not None:
        dense = dout.transpose(1, 2).contiguous()
        table["part: SDPA fwd+bwd(dense)"] = lambda: F.scaled_dot_product_attention(*sdpa_inputs,
                                                                                  is_causal=True).backward(dense)
        table["part: SDPA fwd+bwd, graph kept"] = lambda: F.scaled_dot_product_attention(
            *sdpa_inputs, is_causal=True).sum().backward(retain_graph=True)
        table["part: SDPA fwd+bwd through a Python node"] = lambda: _PythonNode.apply(
            F.scaled_dot_product_attention(*sdpa_inputs, is_causal=True)).sum().backward()
        table["part: SDPA bwd alone"] = _backward_alone(F.scaled_dot_product_attention(*sdpa_inputs, is_causal=True),
                                                        sdpa_inputs)
    return table


def calls(device: str, sdpa: bool, parts: bool) -> dict:
    """name -> a zero-argument call, each called twice here (the plan cache records a signature the
    second time it sees it, and the first calls load the kernels)."""
    gen = torch.Generator(device=device).manual_seed(37)

    def randn(*shape, grad=True):
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.float32).to(DTYPE).requires_grad_(grad)

    q, k, v = (randn(B, S, H, D) for _ in range(3))
    nq, nk, nv = (x.detach() for x in (q, k, v))
    total = sum(SEQLENS)
    vq, vk, vv = (randn(total, H, D) for _ in range(3))
    cu = torch.tensor([0, SEQLENS[0], total], dtype=torch.int32, device=device)
    longest = max(SEQLENS)

    def fa():
        return flash_attn_func(q, k, v, causal=True)

    def varlen():
        return flash_attn_varlen_func(vq, vk, vv, cu, cu, longest, longest, causal=True)

    table = {
        "flash_attn_func fwd, no grad": lambda: flash_attn_func(nq, nk, nv, causal=True),
        "flash_attn_func fwd": fa,
        "flash_attn_func fwd+bwd": _step(fa),
        "flash_attn_varlen_func fwd": varlen,
        "flash_attn_varlen_func fwd+bwd": _step(varlen),
        "registered ops: flash_attn_func fwd": _registered(fa),
        "registered ops: flash_attn_func fwd+bwd": _step(_registered(fa)),
        "registered ops: varlen fwd+bwd": _step(_registered(varlen)),
    }
    if sdpa:  # SDPA takes [B, H, S, D]
        tq, tk, tv = (x.detach().transpose(1, 2).contiguous().requires_grad_() for x in (q, k, v))

        def sdpa_fwd():
            return F.scaled_dot_product_attention(tq, tk, tv, is_causal=True)

        table["SDPA fwd, no grad"] = lambda: F.scaled_dot_product_attention(*(x.detach() for x in (tq, tk, tv)),
                                                                            is_causal=True)
        table["SDPA fwd"] = sdpa_fwd
        table["SDPA fwd+bwd"] = _step(sdpa_fwd)
    if parts:
        table.update(part_calls(q, k, v, (tq, tk, tv) if sdpa else None))
    for call in table.values():
        call()
        call()
    return table


def print_torch_profile(call, n: int, gpu: bool):
    """torch.profiler's averages over n calls, by self host time: which ops and runtime calls a call makes."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])
    with profile(activities=activities) as prof:
        for _ in range(n):
            call()
        if gpu:
            torch.cuda.synchronize()
    print(f"{n} calls")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=60))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpu", action="store_true", help="run on GPU 0 (default: the CPU stand-in)")
    parser.add_argument("--calls", type=int, default=2000, help="calls per timed loop")
    parser.add_argument("--rounds", type=int, default=5, help="timed loops per row; the minimum is printed")
    parser.add_argument("--batch", type=int, default=100, help="with --gpu: synchronize every BATCH calls, untimed")
    parser.add_argument("--profile", metavar="NAME", help="print a cProfile of NAME's calls instead")
    parser.add_argument("--torch-profile", metavar="NAME",
                        help="print torch.profiler's table of NAME's calls instead (host time by op and runtime call)")
    parser.add_argument("--backward-on-caller", action="store_true",
                        help="run every backward on the calling thread (autograd's multithreading off): how much of a "
                             "step is the hand-over to autograd's device thread")
    parser.add_argument("--parts", action="store_true", help="add rows for the pieces of a step")
    parser.add_argument("--out", type=pathlib.Path, help="with --gpu: write the numbers here as JSON")
    args = parser.parse_args()
    threads = torch.autograd.set_multithreading_enabled(not args.backward_on_caller)
    with real_gpu() if args.gpu else stand_in(), threads:
        table = calls("cuda" if args.gpu else "cpu", sdpa=args.gpu, parts=args.parts)
        if args.profile:
            print_profile(table[args.profile], args.calls)
            return
        if args.torch_profile:
            print_torch_profile(table[args.torch_profile], args.calls, args.gpu)
            return
        sync, batch = (torch.cuda.synchronize, args.batch) if args.gpu else (None, 0)
        best = dict.fromkeys(table, float("inf"))
        for _ in range(args.rounds):
            for name, call in table.items():
                best[name] = min(best[name], host_us_per_call(call, args.calls, batch, sync))
        if args.gpu:
            torch.cuda.synchronize()
    if args.out is not None and args.gpu:
        settings = {"calls": args.calls, "rounds": args.rounds, "batch": batch, "shape": [B, S, H, D],
                    "varlen_seqlens": list(SEQLENS), "dtype": "bfloat16", "causal": True}
        record = {**machine.header(0, {}, settings), "command": ["python", "bench/torch_host_overhead.py",
                  *(pathlib.Path(a).name if a == str(args.out) else a for a in sys.argv[1:])], "us_per_call": best}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=1) + "\n")
    where = f"GPU 0, synchronized every {batch} calls" if args.gpu else "CPU stand-in, not a GPU number"
    print(f"host µs per call ({where}; min of {args.rounds} rounds of {args.calls} calls; fmha_rt {fmha_rt.__version__})")
    for name, us in best.items():
        print(f"  {name:40s} {us:8.2f}")


if __name__ == "__main__":
    main()
