"""Ahead-of-time build of every kernel variant into hsa/<arch>/<family>/ and hsa/manifest.json.

Usage (through build_hsaco.sh): python -m kernels.build [--out DIR] [--check] [--family F] [--arch A]

Each variant (from the families' `variants(arch)` lists) is compiled with the pinned Triton for each
target arch. The manifest records, per kernel, its typed parameter layout: names and types from the
signature, offsets and sizes from the binary's own parameter table, so the runtime can check both.
Code objects are stored gzip-compressed (deterministic: no timestamp) and hashed.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import gzip
import hashlib
import importlib
import json
import os
import pathlib
import re
import shutil
import sys
import tempfile
import time

TRITON_VERSION = "3.6.0"
ARCHS = ("sm_90", "gfx942", "gfx950")
ROOT = pathlib.Path(__file__).resolve().parent.parent
FAMILIES = {
    "selftest": "kernels.selftest.selftest",
    "portable": "fmha_rt.plan.portable",
    "v3": "fmha_rt.plan.v3",
}
# Shared memory (LDS) one block may use: Hopper's opt-in maximum, MI300's 64 KiB, MI355's 160 KiB.
SHARED_LIMIT = {"sm_90": 232448, "gfx942": 65536, "gfx950": 163840}
SLOT_TYPE = {"i32": "i32", "i64": "i64", "u32": "u32", "u64": "u64", "fp32": "f32"}


def slot_type(sig_type: str) -> str:
    return "ptr" if sig_type.startswith("*") else SLOT_TYPE[sig_type]


def target(arch: str):
    from triton.backends.compiler import GPUTarget

    if arch.startswith("sm_"):
        return GPUTarget("cuda", int(arch[3:]), 32)
    return GPUTarget("hip", arch, 64)


def divisibility_attrs(signature: dict) -> dict:
    """Alignment promises that let loads vectorise; the runtime checks them before every launch:
    pointers are 16-byte aligned (but `Unaligned*` ones) and `stride_*` arguments are multiples of 8
    elements (fmha_rt/runtime/registry.py states the naming rule)."""
    from fmha_rt.runtime.registry import ALIGNED_STRIDE_PREFIX, UNALIGNED_POINTER_PREFIX

    attrs = {}
    for index, (name, kind) in enumerate(signature.items()):
        if kind.startswith("*"):
            if not name.startswith(UNALIGNED_POINTER_PREFIX):
                attrs[(index,)] = [["tt.divisibility", 16]]
        elif name.startswith(ALIGNED_STRIDE_PREFIX):
            attrs[(index,)] = [["tt.divisibility", 8]]
    return attrs


def compile_variant(arch: str, variant: dict) -> dict:
    """Compile one variant for one arch; returns the binary and what the manifest needs."""
    os.environ.setdefault("TRITON_DISABLE_LINE_INFO", "1")  # a third of the size, no run-time cost
    import triton
    from triton.compiler import ASTSource
    from triton.experimental.gluon._runtime import GluonASTSource

    if triton.__version__ != TRITON_VERSION:
        raise SystemExit(f"build needs triton=={TRITON_VERSION}, found {triton.__version__}")
    fn = getattr(importlib.import_module(variant["module"]), variant["function"])
    # Gluon kernels (family v3) lay out their own shared memory and pipelines: num_stages does not apply.
    source_class = GluonASTSource if variant.get("language") == "gluon" else ASTSource
    source = source_class(fn, signature=variant["signature"], constexprs=variant["constexprs"],
                          attrs=divisibility_attrs(variant["signature"]))
    started = time.perf_counter()
    # The deepest software pipeline that fits the shared memory a block may have: features such as a
    # bias tile or dropout bits take shared memory of their own, so a tile's stages are an upper bound.
    for stages in range(variant["num_stages"], 0, -1):
        kernel = triton.compile(source, target=target(arch),
                                options={"num_warps": variant["num_warps"], "num_stages": stages})
        if kernel.metadata.shared <= SHARED_LIMIT[arch]:
            break
    else:
        raise SystemExit(f"{variant['key']} on {arch} needs {kernel.metadata.shared} bytes of shared memory even "
                         f"with one stage, above the {SHARED_LIMIT[arch]} a block can have: choose a smaller tile")
    md = kernel.metadata
    # The runtime provides global scratch where the plan declares it (the v3 family's TMA descriptors),
    # so the compiler's figure must be the plan's; profile scratch it never provides.
    scratch = (getattr(md, "global_scratch_size", 0), getattr(md, "global_scratch_align", 1))
    declared = (variant.get("global_scratch", 0), variant.get("global_scratch_align", 1))
    if scratch[0] != declared[0] or (scratch[0] and declared[1] % scratch[1]):
        raise SystemExit(f"{variant['key']} on {arch} needs {scratch[0]} bytes of global scratch a program "
                         f"(aligned to {scratch[1]}), its plan provides {declared[0]} (aligned to {declared[1]})")
    if getattr(md, "profile_scratch_size", 0):
        raise SystemExit(f"{variant['key']} on {arch} needs Triton profile scratch, which the runtime does not provide")
    binary = kernel.asm["cubin" if arch.startswith("sm_") else "hsaco"]
    return {"binary": binary, "symbol": md.name, "num_stages": stages, "shared": md.shared, "threads": md.num_warps * md.warp_size,
            "seconds": time.perf_counter() - started, "n_regs": getattr(kernel, "n_regs", None),
            "n_spills": getattr(kernel, "n_spills", None)}


def typed_layout(arch: str, variant: dict, binary: bytes) -> tuple[list[dict], int]:
    """Names and types from the signature, offsets and sizes from the binary's parameter table."""
    from fmha_rt.runtime import codeobj
    from fmha_rt.runtime.registry import SCRATCH_POINTERS

    obj = codeobj.read_code_object(binary, name=variant["key"])
    (info,) = obj.kernels.values()
    names = [(n, slot_type(t)) for n, t in variant["signature"].items() if t != "constexpr"]
    names += [(n, "ptr") for n in SCRATCH_POINTERS]
    params = [p for p in info.params if not str(getattr(p, "kind", "") or "").startswith("hidden_")]
    if len(params) != len(names):
        raise SystemExit(f"{variant['key']} on {arch}: binary has {len(params)} parameters, signature gives {len(names)}")
    layout = [{"name": n, "type": t, "offset": p.offset, "size": p.size} for (n, t), p in zip(names, params)]
    end = max(s["offset"] + s["size"] for s in layout)
    # CUDA declares its parameter bank size; HIP appends runtime-filled hidden arguments after ours.
    total = info.param_bytes if arch.startswith("sm_") and info.param_bytes else end
    return layout, total


def build_one(job):
    arch, variant, out_dir = job
    result = compile_variant(arch, variant)
    layout, total = typed_layout(arch, variant, result["binary"])
    ext = "cubin" if arch.startswith("sm_") else "hsaco"
    rel = f"{arch}/{variant['family']}/{variant['key']}.{ext}.gz"
    stored = gzip.compress(result["binary"], compresslevel=9, mtime=0)
    path = pathlib.Path(out_dir) / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(stored)
    entry = {"key": variant["key"], "family": variant["family"], "arch": arch, "symbol": result["symbol"],
             "file": rel, "sha256": hashlib.sha256(stored).hexdigest(), "compressed": True,
             "threads": result["threads"], "shared": result["shared"], "param_bytes": total, "params": layout,
             "traits": dict(variant.get("traits", {}), num_warps=variant["num_warps"],
                            num_stages=result["num_stages"])}
    if variant.get("global_scratch"):
        entry["traits"]["global_scratch"] = variant["global_scratch"]
        entry["traits"]["global_scratch_align"] = variant["global_scratch_align"]
    stats = {"key": variant["key"], "arch": arch, "seconds": round(result["seconds"], 2), "bytes": len(stored),
             "raw_bytes": len(result["binary"]), "n_regs": result["n_regs"], "n_spills": result["n_spills"]}
    return entry, stats


def all_jobs(families, archs, out_dir, only=None):
    jobs = []
    for family in families:
        module = importlib.import_module(FAMILIES[family])
        for arch in archs:
            for variant in module.variants(arch):
                if only is None or re.search(only, variant["key"]):
                    jobs.append((arch, dict(variant, family=family), str(out_dir)))
    return jobs


def build(out_dir: pathlib.Path, families, archs, workers: int, only=None) -> list[dict]:
    jobs = all_jobs(families, archs, out_dir, only)
    entries, stats = [], []
    started = time.perf_counter()
    with concurrent.futures.ProcessPoolExecutor(max_workers=workers) as pool:
        for done, (entry, stat) in enumerate(pool.map(build_one, jobs, chunksize=1), 1):
            entries.append(entry)
            stats.append(stat)
            # a live progress line on a terminal; a line every 50 kernels in a log
            if sys.stderr.isatty():
                print(f"\r[{done}/{len(jobs)}] {stat['arch']:7s} {stat['key']:60s} {stat['seconds']:6.1f}s",
                      end="", file=sys.stderr, flush=True)
            elif done % 50 == 0 or done == len(jobs):
                print(f"[{done}/{len(jobs)}] {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
    print(f"\nbuilt {len(jobs)} code objects in {time.perf_counter() - started:.0f} s", file=sys.stderr)
    entries.sort(key=lambda e: (e["arch"], e["family"], e["key"]))
    manifest = {"format": 1, "triton": TRITON_VERSION, "kernels": entries}
    write_manifest(out_dir / "manifest.json", manifest)
    return stats


def write_manifest(path: pathlib.Path, manifest: dict) -> None:
    """The manifest as JSON with one kernel a line (keys sorted, no spaces): a rebuild that changes one kernel
    changes one line, and at ~930 kernels the file stays ~3.6 MB, where indenting every field doubled it."""
    head = {k: v for k, v in manifest.items() if k != "kernels"}
    compact = dict(sort_keys=True, separators=(",", ":"))
    lines = ",\n".join(json.dumps(entry, **compact) for entry in manifest["kernels"])
    fields = [json.dumps(k) + ":" + json.dumps(v, **compact) for k, v in sorted(head.items())]
    path.write_text("{" + ",".join(fields) + ',"kernels":[\n' + lines + "\n]}\n")


def tree_bytes(root: pathlib.Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="build_hsaco.sh", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=ROOT / "hsa")
    parser.add_argument("--check", action="store_true",
                        help="rebuild into a temporary folder and fail if any committed byte differs")
    parser.add_argument("--family", action="append", choices=sorted(FAMILIES), help="default: all")
    parser.add_argument("--arch", action="append", choices=ARCHS, help="default: all")
    parser.add_argument("--only", metavar="REGEX", help="build only the variants whose key matches (into --out)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--stats", type=pathlib.Path, help="write per-kernel compile statistics (JSON) here")
    args = parser.parse_args(argv)
    families = args.family or list(FAMILIES)
    archs = args.arch or list(ARCHS)
    partial = bool(args.family or args.arch or args.only)
    if partial and args.check:
        parser.error("--check rebuilds everything: do not combine it with --family/--arch/--only")

    with tempfile.TemporaryDirectory(prefix="fmha_rt_build_") as tmp:
        # A private Triton cache makes every build a real rebuild from source.
        os.environ["TRITON_CACHE_DIR"] = str(pathlib.Path(tmp) / "cache")
        out = pathlib.Path(tmp) / "hsa"
        out.mkdir()
        stats = build(out, families, archs, args.jobs, args.only)
        if args.stats:
            args.stats.write_text(json.dumps(stats, indent=1) + "\n")
        if args.check:
            built, committed = tree_bytes(out), tree_bytes(args.out)
            differing = sorted(k for k in built.keys() | committed.keys() if built.get(k) != committed.get(k))
            if differing:
                print(f"{len(differing)} file(s) differ from {args.out}:", *differing[:20], sep="\n  ")
                return 1
            print(f"{len(built)} files identical to {args.out}")
            return 0
        if not partial:
            shutil.rmtree(args.out, ignore_errors=True)
            shutil.copytree(out, args.out)
        else:
            merge_partial(out, args.out, whole_families=not args.only)
    return 0


def merge_partial(built: pathlib.Path, dest: pathlib.Path, whole_families: bool) -> None:
    """Merge a partial build into an existing hsa folder: whole (arch, family) pairs are replaced
    (dropping variants that no longer exist), or with --only just the rebuilt kernels."""
    new = json.loads((built / "manifest.json").read_text())
    old_path = dest / "manifest.json"
    old = json.loads(old_path.read_text()) if old_path.is_file() else {"format": 1, "triton": TRITON_VERSION, "kernels": []}
    if whole_families:
        replaced = {(e["arch"], e["family"]) for e in new["kernels"]}
        for arch, family in replaced:
            shutil.rmtree(dest / arch / family, ignore_errors=True)
        kept = [e for e in old["kernels"] if (e["arch"], e["family"]) not in replaced]
    else:
        replaced = {(e["arch"], e["key"]) for e in new["kernels"]}
        kept = [e for e in old["kernels"] if (e["arch"], e["key"]) not in replaced]
    for entry in new["kernels"]:
        (dest / entry["file"]).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(built / entry["file"], dest / entry["file"])
    new["kernels"] = sorted(kept + new["kernels"], key=lambda e: (e["arch"], e["family"], e["key"]))
    write_manifest(old_path, new)


if __name__ == "__main__":
    sys.exit(main())
