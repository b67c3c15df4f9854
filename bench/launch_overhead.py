"""Host cost of one cached launch through fmha_rt, side by side with the floor (a C loop calling the
driver's launch with the same kernel and argument path) and torch's cost for a tiny SDPA call.

    python bench/launch_overhead.py [--launches N] [--out results.json]

Wall clock per launch over N back-to-back launches of the self-test axpy on one 128-thread block, and
per call of the same kernel launched as a graph of one and of two nodes whose arguments are set per call.
"""
import argparse
import datetime
import gzip
import json
import pathlib
import subprocess
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # this checkout's fmha_rt
from fmha_rt.bench.timing import host_us_per_call  # noqa: E402

HERE = pathlib.Path(__file__).resolve().parent


# Launches between untimed synchronizes in the *_batched figures: few enough that the launch queue never
# fills, so they are the host's own cost; the others are back to back and wait whenever the GPU runs
# the tiny kernel slower than the host issues it.
BATCH = 100
# The floor of a cached call launched as a graph (fmha_rt/csrc/launch_graphs.c): set the arguments of a graph's
# N kernel nodes and launch it, per call; against N times c_floor_batched for N launches one by one.
GRAPH_NODES = (1, 2)


def per_call_us(fn, n, batch=0, sync=None):
    for _ in range(1000):
        fn()
    return host_us_per_call(fn, n, batch, sync)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--launches", type=int, default=20000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=pathlib.Path)
    args = parser.parse_args()

    import numpy as np
    import torch

    from fmha_rt.runtime import backend, kernel_launch
    from fmha_rt.runtime.registry import registry
    from fmha_rt.selftest import DeviceArray

    dev = backend.device(0)
    entry = registry().entry(dev.arch, "selftest_axpy_f32")
    x, y, out = (DeviceArray(0, np.ones(1024, np.float32)) for _ in range(3))
    kernel_args = dict(x=x, y=y, out=out, alpha=2.0, n=1024)
    prepared = kernel_launch.PreparedLaunch(0, entry, (1, 1, 1), entry.packer.pack(
        {**dict.fromkeys(("global_scratch", "profile_scratch"), None), **kernel_args}))

    results = {"packed": [], "packed_batched": [], "pack_and_launch": [], "c_floor": [], "c_floor_batched": [],
               **{f"c_floor_graph_{n}_nodes_batched": [] for n in GRAPH_NODES}, "torch_sdpa_tiny": []}
    with tempfile.TemporaryDirectory() as tmp:
        cubin = pathlib.Path(tmp) / "axpy.cubin"
        cubin.write_bytes(gzip.decompress((registry().root / entry.file).read_bytes()))
        exe = pathlib.Path(tmp) / "launch_floor"
        subprocess.run(["gcc", "-O2", "-o", str(exe), str(HERE / "launch_floor.c"), "-ldl"], check=True)
        q = torch.randn(1, 1, 128, 64, device="cuda", dtype=torch.bfloat16)
        for _ in range(args.repeats):
            results["packed"].append(per_call_us(prepared, args.launches))
            backend.synchronize(0)
            results["packed_batched"].append(per_call_us(prepared, args.launches, BATCH, lambda: backend.synchronize(0)))
            results["pack_and_launch"].append(
                per_call_us(lambda: kernel_launch.launch(0, entry, (1, 1, 1), kernel_args, 0), args.launches))
            backend.synchronize(0)
            floor = subprocess.run([str(exe), str(cubin), entry.symbol, str(args.launches)], check=True,
                                   capture_output=True, text=True)
            results["c_floor"].append(float(floor.stdout))
            floor = subprocess.run([str(exe), str(cubin), entry.symbol, str(args.launches), str(BATCH)], check=True,
                                   capture_output=True, text=True)
            results["c_floor_batched"].append(float(floor.stdout))
            for nodes in GRAPH_NODES:
                floor = subprocess.run([str(exe), str(cubin), entry.symbol, str(args.launches), str(BATCH), str(nodes)],
                                       check=True, capture_output=True, text=True)
                results[f"c_floor_graph_{nodes}_nodes_batched"].append(float(floor.stdout))
            sdpa = torch.nn.functional.scaled_dot_product_attention
            results["torch_sdpa_tiny"].append(per_call_us(lambda: sdpa(q, q, q), args.launches // 4))
            torch.cuda.synchronize()
    median = {k: sorted(v)[len(v) // 2] for k, v in results.items()}
    record = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "gpu": dev.name, "driver_version": backend.runtime().driver_version, "python": sys.version.split()[0],
              "torch": torch.__version__, "launches_per_repeat": args.launches, "unit": "microseconds per call",
              "median_us": median, "all_us": results,
              "batch": BATCH, "fmha_rt_minus_floor_us": round(median["packed"] - median["c_floor"], 3),
              "fmha_rt_minus_floor_batched_us": round(median["packed_batched"] - median["c_floor_batched"], 3)}
    print(json.dumps(record, indent=1))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
