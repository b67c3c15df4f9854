"""Command line: python -m fmha_rt info | check | selftest | bench (also installed as `fmha-rt`)."""
from __future__ import annotations

import argparse
import sys
from collections import Counter

from . import __version__


def _registry_lines():
    from .runtime.abi_check import check_all
    from .errors import FmhaError
    from .runtime.registry import registry, search_paths

    try:
        reg = registry()
    except FmhaError as exc:
        return [f"code objects: none ({exc})"], False
    per_arch, problems = check_all(reg)
    families = Counter((e.arch, e.family) for e in reg.entries.values())
    lines = [f"code objects: {reg.root} (triton {reg.triton_version}; searched "
             f"{', '.join(map(str, search_paths()))})"]
    for arch in reg.archs():
        parts = ", ".join(f"{fam} {n}" for (a, fam), n in sorted(families.items()) if a == arch)
        lines.append(f"  {arch}: {per_arch[arch]} kernels ({parts})")
    lines.append(f"ABI checks: {'all pass' if not problems else f'{len(problems)} FAIL'} "
                 f"({sum(per_arch.values())} kernels: sha256, parameter layout, arch)")
    lines += [f"  FAIL {p}" for p in problems]
    return lines, not problems


def cmd_info(args) -> int:
    from .runtime import backend
    from .errors import FmhaError

    print(f"fmha_rt {__version__}")
    try:
        rt = backend.runtime()
        print(f"backend: {rt.backend} ({rt.library}), driver version {rt.driver_version}")
        if not rt.devices:
            print("devices: no GPU device")
        for d in rt.devices:
            print(f"device {d.ordinal}: {d.name}, arch {d.arch} ({d.arch_full}), {d.multiprocessors} "
                  f"multiprocessors, {d.total_memory / 2**30:.1f} GiB")
    except FmhaError as exc:
        print(f"backend: unavailable ({exc})")
        rt = None
    lines, ok = _registry_lines()
    print(*lines, sep="\n")
    if rt is not None and rt.devices:
        from .runtime.registry import registry

        try:
            reg = registry()
            for d in rt.devices:
                print(f"device {d.ordinal} ({d.arch}): {len(reg.kernels_for(d.arch))} code objects")
        except FmhaError:
            pass
    return 0 if ok else 1


def cmd_check(args) -> int:
    lines, ok = _registry_lines()
    print(*lines, sep="\n")
    return 0 if ok else 1


def cmd_selftest(args) -> int:
    from .selftest import run_selftest

    return run_selftest(device=args.device)


def cmd_bench(argv) -> int:
    from .bench.cli import main as bench_main

    return bench_main(argv)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:  # the benchmark has its own, larger argument parser
        return cmd_bench(argv[1:])
    parser = argparse.ArgumentParser(prog="fmha-rt", description="fmha_rt: fused attention runtime")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="backend, devices, code objects and ABI checks")
    sub.add_parser("check", help="verify every code object against the manifest (sha256, layout, arch)")
    p = sub.add_parser("selftest", help="correctness sweep on the local GPU against the float64 reference")
    p.add_argument("--device", type=int, default=0)
    sub.add_parser("bench", help="benchmark against the peers (see `fmha-rt bench --help`)")
    args = parser.parse_args(argv)
    return {"info": cmd_info, "check": cmd_check, "selftest": cmd_selftest}[args.command](args)
