"""Command line: python -m fmha_rt quickstart | info | check | selftest | bench (also installed as `fmha-rt`).

A command that needs a GPU and finds none says so in one line and exits with status 2; any other
fmha_rt error ends a command with its one-line message and status 1, never a traceback."""
from __future__ import annotations

import argparse
import sys
from collections import Counter

from . import __version__


def registry_report():
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
    lines, ok = registry_report()
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
    import pathlib

    from .plan.abi import SIGNATURES
    from .runtime.registry import SCRATCH_POINTERS, registry
    from .source_check import check_sources

    lines, ok = registry_report()
    kernels = registry().entries.values() if ok else ()
    source_lines, sources_ok = check_sources(pathlib.Path(__file__).resolve().parent.parent, kernels, SIGNATURES,
                                             SCRATCH_POINTERS)
    print(*lines, *source_lines, sep="\n")
    return 0 if ok and sources_ok else 1


def cmd_selftest(args) -> int:
    from .gpu_presence import require_gpu
    from .selftest import run_selftest

    require_gpu(args.device, "the self-test")
    return run_selftest(device=args.device)


def cmd_quickstart(args) -> int:
    from .quickstart import run_quickstart

    return run_quickstart(device=args.device)


def cmd_bench(argv) -> int:
    from .bench.cli import main as bench_main

    return bench_main(argv)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:  # the benchmark has its own, larger argument parser
        return cmd_bench(argv[1:])
    parser = argparse.ArgumentParser(prog="fmha-rt", description="fmha_rt: fused attention runtime")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("quickstart", help="what works here; on a GPU the self-test and one real problem, timed")
    p.add_argument("--device", type=int, default=0)
    sub.add_parser("info", help="backend, devices, code objects and ABI checks")
    sub.add_parser("check", help="verify every code object against the manifest (sha256, layout, arch), and the "
                   "shim calls, launch-program constants and planned kernel signatures against header and manifest")
    p = sub.add_parser("selftest", help="correctness sweep on the local GPU against the float64 reference")
    p.add_argument("--device", type=int, default=0)
    sub.add_parser("bench", help="benchmark against the peers (see `fmha-rt bench --help`)")
    args = parser.parse_args(argv)
    command = {"quickstart": cmd_quickstart, "info": cmd_info, "check": cmd_check, "selftest": cmd_selftest}[args.command]
    return one_line_errors(command, args)


def one_line_errors(command, args) -> int:
    """Run `command`, turning a missing GPU and fmha_rt's own errors into one line on stderr."""
    from .errors import FmhaError
    from .gpu_presence import NO_GPU_EXIT, NoGpu

    try:
        return command(args)
    except NoGpu as exc:
        print(f"fmha_rt: {exc}", file=sys.stderr)
        return NO_GPU_EXIT
    except FmhaError as exc:
        print(f"fmha_rt: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
