"""Where the one-launch backward (SINGLE: the fused grid computing Delta in every program) stops paying:
GPU time of mha_bwd with it and with the default multi-launch strategy, side by side, on growing problems.

    python bench/single_launch_crossover.py [--out FILE]

Each point times `--calls` back-to-back cached calls between two CUDA events (so launch gaps count, as
they do in a model) after a warm-up, median of `--repeats`; bf16, causal off, B*Hq*Sq*Sk from 2^14 to
2^27. fmha_rt.plan.portable.SINGLE_MAX_SCORES is the largest score count that takes SINGLE by default.
"""
import argparse
import json
import pathlib
import statistics
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # this checkout's fmha_rt
import fmha_rt  # noqa: E402
from fmha_rt.plan import portable  # noqa: E402
from fmha_rt.bench import machine  # noqa: E402

SHAPES = [(1, 1, 128), (1, 4, 256), (2, 8, 256), (2, 8, 512), (4, 16, 512), (4, 16, 1024), (8, 16, 1024)]


def gpu_us_per_call(call, calls, repeats):
    for _ in range(10):
        call()
    samples = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(calls):
            call()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(samples)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", type=pathlib.Path)
    args = parser.parse_args()
    limit = portable.SINGLE_MAX_SCORES
    rows = []
    for d in (64, 128):
        for b, h, s in SHAPES:
            gen = torch.Generator(device="cuda").manual_seed(b * h * s + d)
            q, k, v, dout = (torch.randn(b, s, h, d, generator=gen, device="cuda").to(torch.bfloat16) for _ in range(4))
            out, lse = fmha_rt.mha_fwd(q, k, v)
            grads = [torch.empty_like(t) for t in (q, k, v)]
            row = {"B": b, "H": h, "S": s, "D": d, "scores": b * h * s * s}
            for name, cap in (("single", 1 << 62), ("default_without_single", -1)):
                portable.SINGLE_MAX_SCORES = cap
                fmha_rt.clear_plan_cache()
                call = lambda: fmha_rt.mha_bwd(dout, q, k, v, out, lse, dq=grads[0], dk=grads[1], dv=grads[2])  # noqa: E731
                call()
                row[name + "_kernels"] = fmha_rt.last_launch_info()["kernels"]
                row[name + "_us"] = gpu_us_per_call(call, args.calls, args.repeats)
            portable.SINGLE_MAX_SCORES = limit
            row["single_over_default"] = row["single_us"] / row["default_without_single_us"]
            rows.append(row)
            print(f"D={d:3d} B={b} H={h:2d} S={s:4d} scores=2^{row['scores'].bit_length() - 1:2d}  single "
                  f"{row['single_us']:8.1f} µs  default {row['default_without_single_us']:8.1f} µs  "
                  f"ratio {row['single_over_default']:.2f}", flush=True)
    if args.out:
        record = {**machine.header(0, {}, {"calls": args.calls, "repeats": args.repeats, "dtype": "bf16"}),
                  "single_max_scores": limit, "rows": rows}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
