"""Tile search for the portable kernels on the local GPU (a development tool: it JIT-compiles the same
Triton sources the build compiles ahead of time, times each candidate tile and prints the best).

    python bench/tune_tiles.py [--dims 64 128 256] [--seqlen 4096] [--out tiles.json]

Each pass (fwd, bwd_dkdv, bwd_dq) is timed alone, on a bf16 problem with B*S = 16k tokens and
H*D = 2048, inputs from a real forward (so the softmax sees realistic values). Candidates that fail to
compile or run (too much shared memory) are reported and skipped. The result feeds TILES in
fmha_rt/portable_plan.py; NOTES.md records the numbers.
"""
import argparse
import dataclasses
import importlib
import json
import pathlib
import sys

import torch
import triton

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from fmha_rt import portable_plan as pp  # noqa: E402
from fmha_rt.problem import AttentionProblem  # noqa: E402

T = pp.Tile
CANDIDATES = {
    "fwd": {
        64: [T(128, 128, 4, 3), T(128, 64, 4, 3), T(128, 128, 8, 3), T(128, 64, 4, 4), T(64, 128, 4, 3)],
        128: [T(128, 128, 8, 3), T(128, 64, 4, 3), T(128, 128, 8, 2), T(128, 64, 8, 3), T(128, 128, 4, 3)],
        256: [T(128, 64, 8, 2), T(64, 64, 4, 2), T(128, 32, 8, 2), T(64, 128, 8, 2), T(128, 64, 8, 1)],
    },
    "bwd_dkdv": {
        64: [T(64, 128, 8, 2), T(32, 128, 4, 2), T(64, 128, 4, 2), T(64, 64, 4, 2), T(128, 128, 8, 2), T(32, 128, 4, 3)],
        128: [T(64, 128, 8, 2), T(32, 128, 4, 2), T(64, 128, 4, 2), T(32, 128, 8, 2), T(64, 64, 4, 2), T(128, 128, 8, 1)],
        256: [T(32, 64, 4, 1), T(32, 64, 8, 2), T(64, 64, 8, 1), T(16, 64, 4, 2), T(32, 128, 8, 1), T(16, 128, 4, 1)],
    },
    "bwd_dq": {
        64: [T(128, 64, 8, 2), T(128, 128, 8, 2), T(64, 64, 4, 2), T(128, 32, 4, 2), T(64, 128, 4, 2), T(128, 64, 4, 3)],
        128: [T(128, 64, 8, 2), T(128, 128, 8, 2), T(64, 64, 4, 2), T(128, 32, 4, 2), T(64, 128, 4, 2), T(128, 64, 4, 3)],
        256: [T(64, 64, 8, 1), T(64, 32, 4, 2), T(32, 64, 4, 2), T(128, 32, 8, 1), T(64, 64, 8, 2), T(64, 32, 8, 1)],
    },
}
ARCH = "sm_90"
POINTER_DTYPES = {"*fp16": torch.float16, "*bf16": torch.bfloat16, "*fp32": torch.float32, "*i32": torch.int32,
                  "*i64": torch.int64, "*u8": torch.uint8}


def strided(**arrays):
    out = {}
    for name, a in arrays.items():
        out[name] = a
        if isinstance(a, torch.Tensor):
            out[f"{name}_strides"] = tuple(a.stride())
    return out


def run_launch(launch, variants):
    variant = variants[launch.variant]
    fn = getattr(importlib.import_module(variant["module"]), variant["function"])
    args = {n: (torch.zeros(1, device="cuda", dtype=POINTER_DTYPES[variant["signature"][n]]) if v is None else v)
            for n, v in launch.args.items()}
    fn[launch.grid](**args, **variant["constexprs"], num_warps=variant["num_warps"], num_stages=variant["num_stages"])


def problem_tensors(d, s, causal):
    h, b = 2048 // d, 16384 // s
    p = AttentionProblem(batch=b, seqlen_q=s, seqlen_k=s, heads_q=h, heads_k=h, head_dim_qk=d, head_dim_v=d,
                         dtype="bf16", window_right=0 if causal else -1, deterministic=True)
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn((b, s, h, d), generator=g, device="cuda").to(torch.bfloat16) for _ in range(4))
    out, lse = torch.empty_like(q), torch.empty((b, h, s), device="cuda")
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    ws = pp.bwd_workspace(p, ARCH)
    buf = torch.zeros(ws.total_bytes // 4 + 1, device="cuda")
    regions = {r.name: buf[r.offset // 4: (r.offset + r.nbytes) // 4].view(r.shape) for r in ws.regions}
    tensors = strided(q=q, k=k, v=v, out=out, lse=lse, dout=do, dq=dq, dk=dk, dv=dv, **regions)
    return p, tensors


def time_pass(pass_name, d, s, causal):
    p, tensors = problem_tensors(d, s, causal)
    pair = pp.head_dim_tiles(p)
    saved = pp.TILES[ARCH][pass_name][pair]
    # a real forward and preprocess first, with the shipped tiles
    for launch in pp.plan_fwd(p, ARCH, tensors) + pp.plan_bwd(p, ARCH, tensors)[:1]:
        run_launch(launch, pp.variant_map(ARCH))
    flops = 4 * p.batch * p.heads_q * s * s * d * (0.5 if causal else 1.0)
    flops *= {"fwd": 1.0, "bwd_dkdv": 1.6, "bwd_dq": 0.9}[pass_name]  # matmuls each pass does
    results = []
    for tile in CANDIDATES[pass_name][pair[0]]:
        pp.TILES[ARCH][pass_name][pair] = tile
        variants = pp.variant_map(ARCH)
        plan = pp.plan_fwd(p, ARCH, tensors) if pass_name == "fwd" else pp.plan_bwd(p, ARCH, tensors)
        prefix = {"fwd": "fmha_fwd_", "bwd_dkdv": "fmha_bwd_dkdv_", "bwd_dq": "fmha_bwd_dq_"}[pass_name]
        launch = next(x for x in plan if x.variant.startswith(prefix) and "convert" not in x.variant)
        try:
            ms = triton.testing.do_bench(lambda: run_launch(launch, variants), warmup=25, rep=100, return_mode="median")
            results.append({"tile": dataclasses.asdict(tile), "ms": ms, "tflops": flops / ms / 1e9})
        except Exception as exc:  # too much shared memory, too many registers: not a candidate
            results.append({"tile": dataclasses.asdict(tile), "error": f"{type(exc).__name__}: {str(exc)[:120]}"})
        print(pass_name, d, s, causal, results[-1], flush=True)
    pp.TILES[ARCH][pass_name][pair] = saved
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dims", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--seqlen", type=int, default=4096)
    parser.add_argument("--passes", nargs="+", default=list(CANDIDATES))
    parser.add_argument("--out", type=pathlib.Path)
    args = parser.parse_args()
    table = {}
    for pass_name in args.passes:
        for d in args.dims:
            res = time_pass(pass_name, d, args.seqlen, causal=False)
            ok = [r for r in res if "ms" in r]
            best = min(ok, key=lambda r: r["ms"]) if ok else None
            table[f"{pass_name}/d{d}"] = {"best": best, "all": res}
            print(f"BEST {pass_name} d{d}: {best}", flush=True)
    if args.out:
        args.out.write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "seqlen": args.seqlen,
                                        "triton": triton.__version__, "results": table}, indent=1))
    for key, v in table.items():
        b = v["best"]
        print(f"{key:16s} {b['tile'] if b else None} {b['tflops'] if b else 0:.0f} TFLOP/s")


if __name__ == "__main__":
    main()
