"""Throughput of several GPUs driven from one process, against one GPU.

    python bench/multi_gpu_scaling.py [--gpus 1 2 4 8] [--batch 4] [--seqlen 4k] [--heads 16] [--head-dim 128]
                                      [--causal] [--deterministic] [--seconds 3] [--repeats 3] [--out FILE]

One thread per GPU, each with its own stream and its own copy of one fixed bf16 problem, loops mha_fwd
followed by mha_bwd; one call is that pair. A round starts every thread at a barrier and ends when the
last thread's stream has drained (each thread synchronises its stream before it reads the clock), so a
round's wall time covers all the GPU work it queued. Throughput on N GPUs is the calls of all N threads
over the round's wall time; scaling efficiency is throughput_N / (N * throughput_1). Rounds of every GPU
count are interleaved, `--repeats` times, and each count reports its median round.
"""
import argparse
import concurrent.futures
import json
import math
import pathlib
import threading
import time

import torch

import fmha_rt
from fmha_rt.runtime import backend
from fmha_rt.bench import flops, machine
from fmha_rt.bench.cli import parse_seqlen

HERE = pathlib.Path(__file__).resolve().parent
DEFAULT_OUT = HERE / "results" / "multi_gpu_scaling.json"
CALIBRATION_CALLS = 3
MIN_CALLS_PER_ROUND = 5
UNIT = "calls per second; one call is one mha_fwd and one mha_bwd"


def _positive(parse):
    def checked(text):
        value = parse(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be positive, got {text!r}")
        return value

    checked.__name__ = parse.__name__  # argparse names the type in its messages
    return checked


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=_positive(int), nargs="+",
                        help="GPU counts to measure (default: 1, 2, ..., every GPU); 1 is always measured, "
                             "it is the baseline")
    parser.add_argument("--batch", type=_positive(int), default=4)
    parser.add_argument("--seqlen", type=_positive(parse_seqlen), default=4096, help="e.g. 4096 or 4k")
    parser.add_argument("--heads", type=_positive(int), default=16)
    parser.add_argument("--head-dim", type=_positive(int), default=128)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--deterministic", action="store_true", help="time the deterministic backward")
    parser.add_argument("--seconds", type=_positive(float), default=3.0, help="target length of one timed round")
    parser.add_argument("--repeats", type=_positive(int), default=3, help="timed rounds per GPU count")
    parser.add_argument("--warmup", type=_positive(int), default=3, help="untimed calls per GPU before timing")
    parser.add_argument("--out", type=pathlib.Path, default=DEFAULT_OUT,
                        help=f"JSON record (default {DEFAULT_OUT.relative_to(HERE.parent)})")
    args = parser.parse_args(argv)
    if args.gpus is not None:
        args.gpus = sorted(set(args.gpus) | {1})
    return args


def problem_of(args):
    shape = (args.batch, args.heads, args.seqlen, args.seqlen, args.head_dim, args.causal)
    backward = "bwd_det" if args.deterministic else "bwd"
    return {"dtype": "bf16", "batch": args.batch, "seqlen": args.seqlen, "heads": args.heads,
            "head_dim": args.head_dim, "causal": args.causal, "deterministic": args.deterministic,
            "flops_per_call": flops.pass_flops("fwd", *shape) + flops.pass_flops(backward, *shape)}


class GpuWorker:
    """One GPU's copy of the problem: inputs and outputs allocated once, on a stream of its own."""

    def __init__(self, device, problem):
        self.device, self.problem = device, problem
        b, s, h, d = (problem[key] for key in ("batch", "seqlen", "heads", "head_dim"))
        with torch.cuda.device(device):
            self.stream = torch.cuda.Stream()
            with torch.cuda.stream(self.stream):
                gen = torch.Generator(device=f"cuda:{device}").manual_seed(device)
                self.q, self.k, self.v, self.dout = (
                    torch.randn((b, s, h, d), generator=gen, device=f"cuda:{device}", dtype=torch.bfloat16)
                    for _ in range(4))
                self.out, self.dq, self.dk, self.dv = (torch.empty_like(self.q) for _ in range(4))
                self.lse = torch.empty((b, h, s), device=f"cuda:{device}", dtype=torch.float32)

    def _call(self):
        causal, stream = self.problem["causal"], self.stream
        fmha_rt.mha_fwd(self.q, self.k, self.v, causal=causal, out=self.out, lse=self.lse, stream=stream)
        fmha_rt.mha_bwd(self.dout, self.q, self.k, self.v, self.out, self.lse, causal=causal,
                        deterministic=self.problem["deterministic"], dq=self.dq, dk=self.dk, dv=self.dv,
                        stream=stream)

    def run(self, calls, barrier=None):
        """`calls` calls back to back, after `barrier` if given; returns the wall-clock (start, end),
        the end read only once this GPU has finished them."""
        # torch exports a tensor by DLPack only while the tensor's device is current.
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            self.stream.synchronize()
            if barrier is not None:
                barrier.wait()
            start = time.perf_counter()
            for _ in range(calls):
                self._call()
            self.stream.synchronize()
            return start, time.perf_counter()


def timed_round(workers, calls):
    """Every worker makes `calls` calls at once, one thread each: calls per second over the round, and
    each GPU's own rate."""
    barrier = threading.Barrier(len(workers), timeout=600)
    with concurrent.futures.ThreadPoolExecutor(len(workers)) as pool:
        spans = list(pool.map(lambda w: w.run(calls, barrier), workers))
    wall = max(end for _, end in spans) - min(start for start, _ in spans)
    return {"calls_per_s": len(workers) * calls / wall, "wall_s": wall,
            "per_gpu_calls_per_s": [calls / (end - start) for start, end in spans]}


def calls_per_round(worker, seconds):
    start, end = worker.run(CALIBRATION_CALLS)
    return max(MIN_CALLS_PER_ROUND, math.ceil(seconds / ((end - start) / CALIBRATION_CALLS)))


def scaling_rows(rounds, flops_per_call):
    """Per GPU count (rounds: {N: [timed_round results]}): its median round's figures and the scaling
    efficiency throughput_N / (N * throughput_1)."""
    if 1 not in rounds:
        raise ValueError(f"the one-GPU baseline is missing: rounds for {sorted(rounds)} GPU(s)")
    median = {n: sorted(rs, key=lambda r: r["calls_per_s"])[len(rs) // 2] for n, rs in rounds.items()}
    baseline = median[1]["calls_per_s"]
    return [{"gpus": n, "calls_per_s": median[n]["calls_per_s"],
             "tflops": median[n]["calls_per_s"] * flops_per_call / 1e12,
             "efficiency": median[n]["calls_per_s"] / (n * baseline),
             "per_gpu_calls_per_s": median[n]["per_gpu_calls_per_s"],
             "rounds_calls_per_s": [r["calls_per_s"] for r in rounds[n]]} for n in sorted(rounds)]


def build_record(header, gpu_names, driver_api_version, problem, rounds):
    """The JSON record: the machine header (date, GPU, driver, versions, settings), every GPU's name,
    the problem, and the per-count results."""
    return {**header, "benchmark": "multi_gpu_scaling", "gpu_count": len(gpu_names), "gpus": list(gpu_names),
            "driver_api_version": driver_api_version, "problem": problem, "unit": UNIT,
            "results": scaling_rows(rounds, problem["flops_per_call"])}


def write_record(record, path):
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1) + "\n")


def format_table(record):
    p = record["problem"]
    title = (f"{p['dtype']} B={p['batch']} S={p['seqlen']} H={p['heads']} D={p['head_dim']}"
             f"{' causal' if p['causal'] else ''}, mha_fwd + mha_{'bwd deterministic' if p['deterministic'] else 'bwd'}"
             f" on {record['gpu']} (x{record['gpu_count']})")
    lines = [title, f"{'GPUs':>4}  {'calls/s':>9}  {'TFLOP/s':>8}  {'efficiency':>10}  per-GPU calls/s (min-max)"]
    for row in record["results"]:
        per_gpu = row["per_gpu_calls_per_s"]
        lines.append(f"{row['gpus']:>4}  {row['calls_per_s']:>9.2f}  {row['tflops']:>8.1f}  "
                     f"{row['efficiency'] * 100:>9.1f}%  {min(per_gpu):.2f}-{max(per_gpu):.2f}")
    return "\n".join(lines)


def main(argv=None):
    args = parse_args(argv)
    rt = backend.runtime()
    present = len(rt.devices)
    if not present:
        raise SystemExit(f"no GPU: the {rt.backend} runtime ({rt.library}) sees none")
    counts = args.gpus or list(range(1, present + 1))
    if counts[-1] > present:
        raise SystemExit(f"asked for {counts[-1]} GPUs; {present} present")
    problem = problem_of(args)
    workers = [GpuWorker(device, problem) for device in range(counts[-1])]
    for worker in workers:  # kernels loaded and clocks up on every GPU before anything is timed
        worker.run(args.warmup)
    calls = calls_per_round(workers[0], args.seconds)
    rounds = {n: [] for n in counts}
    for _ in range(args.repeats):  # interleaved, so that a drift in clocks touches every count alike
        for n in counts:
            rounds[n].append(timed_round(workers[:n], calls))
    settings = {"gpu_counts": counts, "calls_per_round": calls, "repeats": args.repeats, "warmup_calls": args.warmup,
                "threads": "one per GPU, one stream each", "clock": "wall, after each stream is synchronised"}
    record = build_record(machine.header(0, {}, settings), [d.name for d in rt.devices], rt.driver_version,
                          problem, rounds)
    write_record(record, args.out)
    print(format_table(record))
    print(f"written: {args.out}")


if __name__ == "__main__":
    main()
