"""Tile search for the portable kernels, through the same ahead-of-time path that ships them.

    python bench/tune_tiles.py build DIR [--passes fwd bwd_dkdv bwd_dq] [--dims 64 128 256] [--jobs N]
    python bench/tune_tiles.py time DIR [--seqlen 1024 4096] [--causal 0 1] [--out tiles.json]

`build` (no GPU needed) compiles every candidate tile of CANDIDATES for sm_90 with kernels/build.py's
own compile step, as a bf16 variant without bias or dropout whose key carries the tile
(`<key>@<m>x<n>w<warps>s<stages>`), and writes DIR/hsa: the shipped sm_90 kernels plus the candidates,
with a manifest. It also records each candidate's registers, stack (spilled registers) and shared
memory, read from the cubin with cuobjdump, and lists the shipped kernel of each pass first
(`shipped_build`), so that `time` compares the candidates with what hsa/ holds now.

Pass `bwd_fused` builds the FUSED strategy's kernel for (dK/dV tile, dQ tile) pairs and its pre-pass,
and times pre-pass plus fused grid against the shipped two-kernel backward (dQ, then dK/dV).

`time` (GPU) plans a bf16 problem with B*S = 16k tokens and H*D = 2048 for each candidate, swaps the
candidate's kernel into the pass it belongs to, checks that the pass's outputs agree with the shipped
tile's (relative error below 1e-2), and times the pass alone on CUDA events (median of repeats). Inputs
come from a real forward, so the softmax sees realistic values. The best tile per pass, head dim and
mask feeds TILES in fmha_rt/plan/portable.py; NOTES.md records the numbers.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import dataclasses
import datetime
import json
import os
import pathlib
import shutil
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from fmha_rt.plan import abi, portable as pp
from fmha_rt.runtime.packing import Pointer
from fmha_rt.plan.operands import Operands
from fmha_rt.plan.problem import AttentionProblem

import sass_loops  # bench/sass_loops.py (this script's folder): cuobjdump and its resource report

ARCH = "sm_90"
T = pp.Tile
CANDIDATES = {
    "fwd": {
        64: [T(128, 64, 4, 3), T(128, 128, 8, 3), T(128, 64, 8, 3), T(128, 128, 4, 2), T(64, 64, 4, 4)],
        # the last two fit two programs on an SM (one warpgroup, <= 112 KiB of shared memory), so that one
        # program's start and end overlap the other's key loop: for short sequences (8 key blocks at 1k)
        128: [T(128, 128, 8, 3), T(128, 64, 4, 3), T(128, 64, 8, 3), T(128, 128, 8, 2), T(64, 128, 4, 3),
              T(64, 64, 4, 3), T(64, 64, 4, 2)],
        256: [T(128, 64, 8, 2), T(64, 64, 4, 2), T(128, 32, 8, 2), T(64, 64, 8, 2), T(64, 128, 8, 1)],
    },
    "bwd_dkdv": {
        # Compile stats of the two-loop kernel (sm_90, bf16, no bias/dropout; registers/stack bytes):
        # d64: 32x128w4s3 255/216, 64x128w8s3 255/0, 64x64w4s3 255/0, 64x128w8s2 221/0, 128x128w8s2 255/424.
        # d128: 32x64w4s3 255/64, 64x128w8s2 255/0, 32x128w8s3 255/0, 32x128w8s2 246/0, 64x128w8s3 255/168,
        # 64x64w8s3 255/56 (32x128w4 and 128x128w8 spill 1 KiB: left out).
        64: [T(32, 128, 4, 3), T(64, 128, 8, 3), T(64, 64, 4, 3), T(64, 128, 8, 2), T(128, 128, 8, 2)],
        128: [T(32, 64, 4, 3), T(64, 128, 8, 2), T(32, 128, 8, 3), T(32, 128, 8, 2), T(64, 128, 8, 3),
              T(64, 64, 8, 3)],
        256: [T(32, 64, 8, 2), T(64, 64, 8, 1), T(32, 64, 4, 2), T(64, 64, 4, 2), T(32, 128, 8, 1)],
    },
    "bwd_dq": {
        64: [T(64, 64, 4, 3), T(128, 64, 8, 3), T(128, 128, 8, 3), T(64, 128, 4, 3), T(128, 64, 4, 3)],
        128: [T(64, 32, 4, 3), T(128, 64, 8, 3), T(128, 128, 8, 2), T(128, 64, 4, 3), T(64, 64, 4, 3),
              T(128, 32, 4, 3)],
        256: [T(128, 32, 8, 1), T(64, 64, 4, 2), T(128, 64, 8, 1), T(64, 32, 4, 2)],
    },
}
# The ATOMIC dQ strategy as a whole: dK/dV kernel adding dS K into a zeroed fp32 dQ workspace, then the
# conversion pass; compared with bwd_dkdv + bwd_dq of the deterministic strategy.
CANDIDATES["bwd_atomic"] = {
    64: [T(32, 128, 4, 3), T(32, 128, 4, 2), T(16, 128, 4, 3), T(64, 128, 8, 2)],
    128: [T(32, 64, 4, 3), T(64, 128, 8, 2), T(16, 64, 4, 3), T(32, 128, 8, 3)],
    256: [T(32, 64, 8, 2), T(64, 64, 8, 1)],
}
# The FUSED strategy as a whole (the Delta/Lse2 pre-pass, then one grid of dK/dV and dQ programs): each
# candidate a (dK/dV tile, dQ tile) pair sharing the first one's warps and stages, timed against the
# shipped two-kernel backward (dQ, then dK/dV), which `time` lists first.
CANDIDATES["bwd_fused"] = {
    64: [(T(64, 128, 8, 3), T(128, 64, 8, 3))],
    128: [(T(64, 128, 8, 3), T(128, 64, 8, 3)), (T(64, 128, 8, 2), T(128, 64, 8, 2))],
}
TILE_PASS = {"fwd": "fwd", "bwd_dkdv": "bwd_dkdv", "bwd_dq": "bwd_dq", "bwd_atomic": "bwd_dkdv"}
OUTPUTS = {"fwd": ("out", "lse"), "bwd_dkdv": ("dk", "dv"), "bwd_dq": ("dq",), "bwd_atomic": ("dk", "dv", "dq"),
           "bwd_fused": ("dq", "dk", "dv")}
# Block products each pass does, in units of the forward's FLOPs (the backward as a whole is 2.5).
FLOP_SHARE = {"fwd": 1.0, "bwd_dkdv": 1.6, "bwd_dq": 0.9, "bwd_atomic": 2.5, "bwd_fused": 2.5}


def tile_name(tile) -> str:
    """'64x128w8s3'; a fused candidate's pair as '64x128w8s3+128x64'."""
    if isinstance(tile, tuple):
        return f"{tile_name(tile[0])}+{tile[1].block_m}x{tile[1].block_n}"
    return f"{tile.block_m}x{tile.block_n}w{tile.num_warps}s{tile.num_stages}"


def record_tiles(tile) -> dict:
    """A record's tile fields: 'tile', and for a fused candidate also 'dq_tile'."""
    if isinstance(tile, tuple):
        return {"tile": dataclasses.asdict(tile[0]), "dq_tile": dataclasses.asdict(tile[1])}
    return {"tile": dataclasses.asdict(tile)}


def record_tile(record):
    """The tile (or fused pair) a record was built with."""
    return (T(**record["tile"]), T(**record["dq_tile"])) if "dq_tile" in record else T(**record["tile"])


@contextlib.contextmanager
def atomic_dq_strategy():
    """Build and plan the ATOMIC dQ strategy on ARCH (the shipped build has only DETERMINISTIC)."""
    saved = pp.BUILT_DQ_STRATEGIES[ARCH], pp.DEFAULT_DQ_STRATEGY[ARCH]
    pp.BUILT_DQ_STRATEGIES[ARCH], pp.DEFAULT_DQ_STRATEGY[ARCH] = (pp.DQ_ATOMIC, pp.DQ_DETERMINISTIC), pp.DQ_ATOMIC
    try:
        yield
    finally:
        pp.BUILT_DQ_STRATEGIES[ARCH], pp.DEFAULT_DQ_STRATEGY[ARCH] = saved


def strategy_for(pass_name):
    return atomic_dq_strategy() if pass_name == "bwd_atomic" else contextlib.nullcontext()


@contextlib.contextmanager
def tile_override(pass_name, pair, tile):
    tiles = pp.FUSED_TILES.setdefault(ARCH, {}) if pass_name == "bwd_fused" else pp.TILES[ARCH][TILE_PASS[pass_name]]
    saved, tiles[pair] = tiles.get(pair), tile
    try:
        yield
    finally:
        if saved is None:
            del tiles[pair]
        else:
            tiles[pair] = saved


def pass_key(pass_name, pair):
    """The key of the bf16, no-bias, no-dropout variant of one pass (deterministic dQ strategy) that the
    timed problems (one query head per key head) run."""
    if pass_name == "fwd":
        return pp.fwd_key("bf16", pair, pp.BIAS_NONE, False)
    if pass_name == "bwd_fused":
        return pp.fused_key("bf16", pair, pp.BIAS_NONE, False, pp.single_head_dkdv(ARCH, pair))
    if pass_name in ("bwd_dkdv", "bwd_atomic"):
        strategy = pp.DQ_ATOMIC if pass_name == "bwd_atomic" else pp.DQ_DETERMINISTIC
        return pp.dkdv_key("bf16", pair, pp.BIAS_NONE, False, strategy, pp.single_head_dkdv(ARCH, pair))
    return pp.dq_key("bf16", pair, pp.BIAS_NONE, False)


def candidate_jobs(passes, dims, out_dir, shipped):
    """Build jobs for every candidate of `passes` x `dims`, plus the helper passes they need that are not
    among the `shipped` kernel keys."""
    jobs = []
    for pass_name in passes:
        for d in dims:
            pair = (d, d)
            for tile in CANDIDATES[pass_name][d]:
                with strategy_for(pass_name), tile_override(pass_name, pair, tile):
                    variant = dict(pp.variant_map(ARCH)[pass_key(pass_name, pair)], family="portable")
                variant["key"] = f"{variant['key']}@{tile_name(tile)}"
                jobs.append((ARCH, variant, str(out_dir), pass_name, d, tile))
            if pass_name == "bwd_atomic":  # its conversion pass, not shipped for ARCH
                with strategy_for(pass_name):
                    variant = dict(pp.variant_map(ARCH)[pp.dq_convert_key("bf16", d)], family="portable")
                jobs.append((ARCH, variant, str(out_dir), "dq_convert", d, abi.ROWS_TILE))
            if pass_name == "bwd_fused" and pp.preprocess_key("bf16", d) not in shipped:
                # its Delta/Lse2 pre-pass, where ARCH does not ship it
                with tile_override(pass_name, pair, CANDIDATES[pass_name][d][0]):
                    variant = dict(pp.variant_map(ARCH)[pp.preprocess_key("bf16", d)], family="portable")
                jobs.append((ARCH, variant, str(out_dir), "bwd_pre", d, abi.ROWS_TILE))
    return jobs


def _build_candidate(job):
    from kernels import build

    arch, variant, out_dir, pass_name, d, tile = job
    try:
        entry, _stats = build.build_one((arch, variant, out_dir))
    except SystemExit as exc:  # does not fit shared memory even with one stage
        return {"pass": pass_name, "d": d, **record_tiles(tile), "error": str(exc)}, None
    return {"pass": pass_name, "d": d, **record_tiles(tile), "key": entry["key"],
            "num_stages_built": entry["traits"]["num_stages"], "shared": entry["shared"],
            **resource_usage(pathlib.Path(out_dir) / entry["file"])}, entry


def shipped_records(passes, dims, hsa, manifest):
    """A record per (pass, head dim) for the kernel as shipped in hsa/ (its build of the sources may be
    older than the candidates'), listed first so that `time` reports it as the shipped tile."""
    entries = {e["key"]: e for e in manifest["kernels"]}
    records = []
    for pass_name in passes:
        if pass_name == "bwd_atomic":  # not shipped on ARCH
            continue
        for d in dims:
            if pass_name == "bwd_fused":  # the reference: the shipped two-kernel backward
                dkdv, dq = (entries[pass_key(p, (d, d))] for p in ("bwd_dkdv", "bwd_dq"))
                tiles = tuple(T(e["traits"]["block_m"], e["traits"]["block_n"], e["traits"]["num_warps"],
                                e["traits"]["num_stages"]) for e in (dkdv, dq))
                records.append({"pass": pass_name, "d": d, **record_tiles(tiles), "key": "two_kernel",
                                "two_kernel": True, "shipped_build": True})
                continue
            entry = entries.get(pass_key(pass_name, (d, d)))
            if entry is None:
                continue
            traits = entry["traits"]
            tile = T(traits["block_m"], traits["block_n"], traits["num_warps"], traits["num_stages"])
            records.append({"pass": pass_name, "d": d, "tile": dataclasses.asdict(tile), "key": entry["key"],
                            "shipped_build": True, "num_stages_built": entry["traits"]["num_stages"],
                            "shared": entry["shared"], **resource_usage(hsa / entry["file"])})
    return records


def resource_usage(cubin_gz: pathlib.Path) -> dict:
    """Registers per thread and stack bytes (registers spilled to local memory) of a compiled cubin."""
    (usage,) = sass_loops.resources(sass_loops.cuobjdump("-res-usage", sass_loops.read_code_object(str(cubin_gz)))).values()
    return {"regs": usage["REG"], "stack": usage["STACK"]}


def cmd_build(args):
    hsa = args.dir / "hsa"
    if hsa.exists():
        shutil.rmtree(hsa)
    shutil.copytree(ROOT / "hsa" / ARCH, hsa / ARCH)
    manifest = json.loads((ROOT / "hsa" / "manifest.json").read_text())
    manifest["kernels"] = [e for e in manifest["kernels"] if e["arch"] == ARCH]
    jobs = candidate_jobs(args.passes, args.dims, hsa, {e["key"] for e in manifest["kernels"]})
    records = shipped_records(args.passes, args.dims, hsa, manifest)
    for record in records:
        print(json.dumps(record), flush=True)
    with tempfile.TemporaryDirectory() as cache:
        os.environ["TRITON_CACHE_DIR"] = cache
        with concurrent.futures.ProcessPoolExecutor(max_workers=args.jobs) as pool:
            for record, entry in pool.map(_build_candidate, jobs):
                records.append(record)
                if entry is not None:
                    manifest["kernels"].append(entry)
                print(json.dumps(record), flush=True)
    (hsa / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    (args.dir / "candidates.json").write_text(json.dumps(records, indent=1) + "\n")


def cmd_time(args):
    import torch

    os.environ["FMHA_RT_ASM_DIR"] = str(args.dir / "hsa")
    from fmha_rt.runtime import executor, registry
    from fmha_rt import reference

    registry.reset()
    records = json.loads((args.dir / "candidates.json").read_text())
    results = []
    for causal in args.causal:
        for s in args.seqlen:
            for d in sorted({r["d"] for r in records} & set(args.dims)):
                benches = {}
                for pass_name in [p for p in args.passes if any(r["pass"] == p and r["d"] == d for r in records)]:
                    atomic = pass_name == "bwd_atomic"
                    if atomic not in benches:
                        benches[atomic] = PassBench(d, s, bool(causal), torch, executor, deterministic=not atomic)
                    bench = benches[atomic]
                    mine = [r for r in records if r["pass"] == pass_name and r["d"] == d]
                    # the reference outputs: the shipped tile's (the atomic strategy ships nowhere: its first tile)
                    shipped = bench.outputs(pass_name, mine[0] if pass_name == "bwd_atomic" else None)
                    for r in mine:
                        row = {**r, "seqlen": s, "causal": bool(causal)}
                        if "error" in r:
                            row["skipped"] = "does not fit"
                        else:
                            got = bench.outputs(pass_name, r)
                            row["rel_err"] = max(reference.rel_err(g, w) for g, w in zip(got, shipped))
                            row["ms"] = bench.time(pass_name, r, args.repeats)
                            row["tflops"] = bench.flops(pass_name) / row["ms"] / 1e9
                        results.append(row)
                        print(json.dumps(row), flush=True)
    table = best_tiles(results)
    for line in table:
        print(line)
    if args.out:
        import triton

        date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        args.out.write_text(json.dumps({"date": date, "gpu": torch.cuda.get_device_name(), "triton": triton.__version__,
                                        "torch": torch.__version__, "results": results}, indent=1) + "\n")


def best_tiles(results):
    lines = []
    groups = {}
    for r in results:
        if "ms" in r and r["rel_err"] < 1e-2:
            groups.setdefault((r["pass"], r["d"], r["seqlen"], r["causal"]), []).append(r)
    for (pass_name, d, s, causal), rows in sorted(groups.items()):
        best = min(rows, key=lambda r: r["ms"])
        first = rows[0]  # the shipped kernel comes first (its build in hsa/, else CANDIDATES' first tile)
        lines.append(f"{pass_name:9s} d{d:<4d} S={s:<6d} causal={int(causal)}  shipped {tile_name(record_tile(first))} "
                     f"{first['tflops']:6.1f}  best {tile_name(record_tile(best))} {best['tflops']:6.1f} TFLOP/s")
    return lines


class PassBench:
    """One bf16 problem, its inputs from a real forward, and the plan of each pass with a swapped tile."""

    def __init__(self, d, s, causal, torch, executor, deterministic=True):
        self.torch, self.executor = torch, executor
        h, b = 2048 // d, 16384 // s
        self.p = AttentionProblem(batch=b, seqlen_q=s, seqlen_k=s, heads_q=h, heads_k=h, head_dim_qk=d,
                                  head_dim_v=d, dtype="bf16", window_right=0 if causal else -1,
                                  deterministic=deterministic)
        self.strategy = contextlib.nullcontext if deterministic else atomic_dq_strategy
        # each strategy by name: the default from FUSED_MIN_SEQLEN_K keys is FUSED
        self.request = pp.DQ_DETERMINISTIC if deterministic else pp.DQ_ATOMIC
        self.pair, self.causal = (d, d), causal
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v, do = (torch.randn((b, s, h, d), generator=g, device="cuda").to(torch.bfloat16) for _ in range(4))
        self.arrays = {"q": q, "k": k, "v": v, "dout": do, "out": torch.empty_like(q), "lse": torch.empty((b, h, s), device="cuda"),
                           "dq": torch.empty_like(q), "dk": torch.empty_like(k), "dv": torch.empty_like(v)}
        with self.strategy():
            ws = pp.bwd_workspace(self.p, ARCH, self.request)
        self.zeroed = [r.name for r in ws.regions if r.zero_init]
        self.workspace = torch.zeros(ws.total_bytes // 4 + 1, device="cuda")
        for r in ws.regions:
            self.arrays[r.name] = self.workspace[r.offset // 4: (r.offset + r.nbytes) // 4].view(r.shape)
        self.operands = Operands.of_arrays(self.arrays, lambda a: Pointer(a.data_ptr()))
        self.run(self.plan("fwd", None) + self.plan("bwd_dkdv", None)[:1])  # forward, then the pass writing Delta

    def plan(self, pass_name, record):
        if pass_name == "bwd_fused":
            if record is None or record.get("two_kernel"):
                return pp.plan_bwd(self.p, ARCH, self.operands, pp.DQ_DETERMINISTIC)
            with tile_override(pass_name, self.pair, record_tile(record)):
                launches = pp.plan_bwd(self.p, ARCH, self.operands, pp.DQ_FUSED)
            fused = pass_key(pass_name, self.pair)
            return [dataclasses.replace(x, variant=record["key"]) if x.variant == fused else x for x in launches]
        def planner():
            if pass_name == "fwd":
                return pp.plan_fwd(self.p, ARCH, self.operands)
            return pp.plan_bwd(self.p, ARCH, self.operands, self.request)

        with self.strategy():
            if record is None:
                return planner()
            with tile_override(pass_name, self.pair, T(**record["tile"])):
                launches = planner()
        return [dataclasses.replace(x, variant=record["key"]) if x.variant == pass_key(pass_name, self.pair) else x
                for x in launches]

    def pass_launch(self, pass_name, record):
        if pass_name == "bwd_fused":  # the whole backward, either strategy
            return self.plan(pass_name, record)
        key = record["key"] if record else pass_key(pass_name, self.pair)
        # bwd_atomic: dK/dV (with dQ atomics) and the dQ conversion
        keys = (key, pp.dq_convert_key("bf16", self.pair[0])) if pass_name == "bwd_atomic" else (key,)
        launches = [x for x in self.plan(pass_name, record) if x.variant in keys]
        if not launches:  # the plan took another strategy: timing nothing would report an absurd speed
            raise SystemExit(f"the plan of {pass_name} at {self.p} launches no {key}")
        return launches

    def zero_workspace(self):
        for name in self.zeroed:
            self.arrays[name].zero_()

    def run(self, launches):
        for prepared in self.executor.prepare(0, ARCH, launches):
            prepared(0)

    def outputs(self, pass_name, record):
        for name in OUTPUTS[pass_name]:
            self.arrays[name].fill_(float("nan"))
        self.zero_workspace()
        self.run(self.pass_launch(pass_name, record))
        self.torch.cuda.synchronize()
        return [self.arrays[name].double().cpu().numpy() for name in OUTPUTS[pass_name]]

    def time(self, pass_name, record, repeats):
        torch = self.torch
        prepared = self.executor.prepare(0, ARCH, self.pass_launch(pass_name, record))
        for _ in range(3):
            for x in prepared:
                x(0)
        times = []
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            self.zero_workspace()  # part of the strategy's cost
            for x in prepared:
                x(0)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return sorted(times)[len(times) // 2]

    def flops(self, pass_name):
        p = self.p
        total = 4 * p.batch * p.heads_q * p.seqlen_q * p.seqlen_k * p.head_dim_qk * (0.5 if self.causal else 1.0)
        return total * FLOP_SHARE[pass_name]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="compile the candidates (no GPU needed)")
    b.add_argument("dir", type=pathlib.Path)
    b.add_argument("--passes", nargs="+", default=list(CANDIDATES), choices=list(CANDIDATES))
    b.add_argument("--dims", nargs="+", type=int, default=[64, 128, 256], choices=[64, 128, 256])
    b.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    t = sub.add_parser("time", help="time the candidates on the GPU")
    t.add_argument("dir", type=pathlib.Path)
    t.add_argument("--seqlen", nargs="+", type=int, default=[4096])
    t.add_argument("--causal", nargs="+", type=int, default=[0], choices=[0, 1])
    t.add_argument("--passes", nargs="+", default=list(CANDIDATES), choices=list(CANDIDATES))
    t.add_argument("--dims", nargs="+", type=int, default=[64, 128, 256], choices=[64, 128, 256])
    t.add_argument("--repeats", type=int, default=30)
    t.add_argument("--out", type=pathlib.Path)
    args = parser.parse_args()
    {"build": cmd_build, "time": cmd_time}[args.command](args)


if __name__ == "__main__":
    main()
