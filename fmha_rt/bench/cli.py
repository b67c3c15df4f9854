"""`python -m fmha_rt bench`: time fmha_rt against every attention implementation found here, or
rebuild the Markdown and plots of a recorded run (--report, no GPU needed)."""

import argparse
import os
import sys

from . import grid, machine, overhead, peers, report, sweep, timing

DEFAULT_OUT = os.path.join("out", "bench")
RECORD_NAME = "results.json"
MEASURE_DEFAULTS = {"repeats": 30, "warmup_ms": 50.0, "overhead_calls": 2000}
QUICK_MEASURE_DEFAULTS = {"repeats": 10, "warmup_ms": 10.0, "overhead_calls": 500}

EXAMPLES = """\
examples:
  python -m fmha_rt bench --quick                 smoke run: a few points, every implementation found
  python -m fmha_rt bench --dtype bf16 --hdim 128 --pass fwd bwd --impl fmha_rt fa4
  python -m fmha_rt bench --gqa only --causal 1   only the GQA rows, causal
  python -m fmha_rt bench --hdim 128 --seqlen 16k --causal 0 --pass bwd --rounds 10
                                                  close comparisons: 10 rounds (rounded up to a multiple of
                                                  the implementations at each point)
  python -m fmha_rt bench --list                  whether there is a GPU, which implementations are here
  python -m fmha_rt bench --overhead-only --impl fmha_rt sdpa_cudnn fa4
                                                  host cost per call only, on the path a user takes
  python -m fmha_rt bench --report out/bench/results.json
                                                  Markdown and PNGs again from a recorded run
  python -m fmha_rt bench --report a.json b.json --out merged
                                                  one report from a sweep split over runs of the same
                                                  settings (disjoint points; ratios stay within each run)
"""


def parse_seqlen(text):
    """A sequence length written 2048 or 2k."""
    value = text.strip().lower()
    try:
        return int(value[:-1]) * 1024 if value.endswith("k") else int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a sequence length: {text!r} (write e.g. 2048 or 2k)") from None


def positive_int(text):
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {text!r}")
    return value


def _non_negative_float(text):
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text!r}")
    return value


def build_parser():
    parser = argparse.ArgumentParser(
        prog="python -m fmha_rt bench", description=__doc__, epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    pick = parser.add_argument_group("what to run (each flag narrows the full sweep)")
    pick.add_argument("--dtype", nargs="+", choices=grid.DTYPES)
    pick.add_argument("--hdim", nargs="+", type=int, choices=grid.HEAD_DIMS, metavar="D",
                      help=f"head dims, from {', '.join(map(str, grid.HEAD_DIMS))} "
                           f"({', '.join(f'{d}: {d}/{dv}' for d, dv in grid.VALUE_HEAD_DIMS.items())}, queries/values)")
    pick.add_argument("--seqlen", nargs="+", type=parse_seqlen, choices=grid.SEQLENS, metavar="S",
                      help="sequence lengths, from " + ", ".join(f"{s // 1024}k" if s >= 1024 else str(s)
                                                                 for s in grid.SEQLENS))
    pick.add_argument("--causal", choices=("0", "1", "both"), default="both")
    pick.add_argument("--pass", dest="passes", nargs="+", choices=grid.PASSES)
    pick.add_argument("--impl", nargs="+", choices=peers.PEER_NAMES, metavar="IMPL",
                      help=f"implementations, from {', '.join(peers.PEER_NAMES)} (default: all found)")
    pick.add_argument("--gqa", choices=("0", "1", "only"), default="1",
                      help="GQA rows (Hq/Hk = 8 at D = 128): leave out, include (default), or run only them")
    pick.add_argument("--varlen", choices=("0", "1", "only"), default="1",
                      help="varlen rows: leave out, include (default), or run only them")
    pick.add_argument("--quick", action="store_true",
                      help="smoke run: bf16, D=128, S=4k unless given, fewer repeats")
    how = parser.add_argument_group("how to measure")
    how.add_argument("--repeats", type=positive_int, help=f"timed calls per point (default "
                     f"{MEASURE_DEFAULTS['repeats']}, quick {QUICK_MEASURE_DEFAULTS['repeats']})")
    how.add_argument("--warmup-ms", type=_non_negative_float, help="warm-up per point in ms (default "
                     f"{MEASURE_DEFAULTS['warmup_ms']:g}, quick {QUICK_MEASURE_DEFAULTS['warmup_ms']:g})")
    how.add_argument("--rounds", type=positive_int, default=1,
                     help="times each implementation of a point takes its turn (a warm-up and --repeats calls); "
                          "rounded up at each point to a multiple of its implementations, round r starting with "
                          "implementation r mod n; the ratios are medians of per-round ratios (default 1, i.e. n)")
    how.add_argument("--separate-det-turns", action="store_true",
                     help="time the deterministic backward in turns of its own, not in the backward's rounds")
    how.add_argument("--device", type=int, default=0, help="CUDA device index (default 0)")
    how.add_argument("--no-extras", action="store_true", help="skip the host-overhead and cold-start measurements")
    how.add_argument("--overhead-only", action="store_true",
                     help="measure only the host overhead (repeated, plan-cache-cleared and first calls): no sweep, "
                          "no cold start")
    parser.add_argument("--out", metavar="DIR", help=f"where results go (default {DEFAULT_OUT}; "
                        "with --report, beside the JSON)")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--report", nargs="+", metavar="JSON",
                      help="write Markdown and PNGs from recorded JSON (several files are merged into --out)")
    mode.add_argument("--list", action="store_true", help="list the implementations found and exit")
    return parser


def selection(args):
    """build_grid's keyword arguments for parsed `args`."""
    quick = grid.QUICK if args.quick else {}
    return {
        "dtypes": _unique(args.dtype or quick.get("dtypes", grid.DTYPES)),
        "head_dims": _unique(args.hdim or quick.get("head_dims", grid.HEAD_DIMS)),
        "seqlens": _unique(args.seqlen or quick.get("seqlens", grid.SEQLENS)),
        "causals": {"0": (False,), "1": (True,), "both": (False, True)}[args.causal],
        "passes": _unique(args.passes or grid.PASSES),
        "kinds": selected_kinds(args.gqa, args.varlen),
    }


def selected_kinds(gqa, varlen):
    """Row kinds for the --gqa and --varlen settings: "only" on either drops every kind not so marked."""
    flags = {"gqa": gqa, "varlen": varlen}
    only = tuple(kind for kind, flag in flags.items() if flag == "only")
    return only or ("dense",) + tuple(kind for kind, flag in flags.items() if flag == "1")


def settings_for(args):
    defaults = QUICK_MEASURE_DEFAULTS if args.quick else MEASURE_DEFAULTS
    return sweep.Settings(repeats=args.repeats or defaults["repeats"],
                          warmup_ms=defaults["warmup_ms"] if args.warmup_ms is None else args.warmup_ms,
                          overhead_calls=defaults["overhead_calls"], rounds=args.rounds,
                          backward_turns_together=not args.separate_det_turns)


def _unique(values):
    return tuple(dict.fromkeys(values))


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.report:
        return _write_reports(parser, args)
    if args.overhead_only and args.no_extras:
        parser.error("--overhead-only measures one of the extras that --no-extras skips")
    points = grid.build_grid(**selection(args))
    if not points:
        parser.error(f"no point matches these flags (GQA rows exist at D={grid.GQA_HEAD_DIM} only)")
    discovered = peers.discover(_unique(args.impl or peers.PEER_NAMES))
    has_gpu, gpu_line = machine.gpu_presence()
    print_discovery(discovered, has_gpu, gpu_line)
    if args.list:
        return 0
    problem = gpu_problem(args.device)
    if problem:
        print(f"fmha_rt bench: {problem}. Nothing was measured; `--report FILE` rebuilds the reports of a "
              "recorded run without a GPU.", file=sys.stderr)
        return 1
    adapters = {name: found.adapter for name, found in discovered.items() if found.adapter is not None}
    if not adapters:
        print("fmha_rt bench: none of the chosen implementations is available here.", file=sys.stderr)
        return 1
    return _run(argv, args, points, discovered, adapters)


def print_discovery(discovered, has_gpu, gpu_line):
    """The GPU line, then a line per implementation: "found" only where there is also a GPU to run it on;
    "no GPU" where it is installed and there is none."""
    print(gpu_line)
    width = max(len(name) for name in discovered)
    for name, found in discovered.items():
        detail = found.version if found.status == "found" else found.reason
        status = "no GPU" if found.status == "found" and not has_gpu else found.status
        print(f"{name:<{width}}  {status:<14}  {detail}")


def gpu_problem(device_index):
    """Why this machine cannot run the sweep, or None."""
    try:
        import torch
    except ImportError:
        return "torch is not installed (the benchmark hands every implementation torch tensors)"
    if not torch.cuda.is_available():
        build = "a CPU-only build" if torch.version.cuda is None and getattr(torch.version, "hip", None) is None \
            else f"built for CUDA {torch.version.cuda}"
        return f"no GPU is visible to torch {torch.__version__} ({build})"
    if not 0 <= device_index < torch.cuda.device_count():
        return f"--device {device_index} does not exist (torch sees {torch.cuda.device_count()} GPUs)"
    return None


def recorded_command(argv) -> list:
    """The command as the record keeps it: the --out folder by its last component only, since where a run
    wrote its files says nothing about the results and may name a private path."""
    return ["bench", *path_by_name(argv, "--out")]


def path_by_name(argv, flag: str) -> list:
    """argv with the path that follows `flag` (or `flag=PATH`) cut to its last component."""
    argv = list(argv)
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            argv[i + 1] = os.path.basename(os.path.normpath(argv[i + 1]))
        elif arg.startswith(flag + "="):
            argv[i] = flag + "=" + os.path.basename(os.path.normpath(arg[len(flag) + 1:]))
    return argv


def _run(argv, args, points, discovered, adapters):
    settings = settings_for(args)
    device = timing.CudaDevice(args.device)
    out_dir = args.out or DEFAULT_OUT
    json_path = os.path.join(out_dir, RECORD_NAME)
    doc = report.new_document(machine.header(args.device, discovered,
                                             {**settings.fields(), "device": args.device, "command": recorded_command(argv)}))
    pairs = [] if args.overhead_only else sweep.planned_pairs(points, adapters)
    print(f"{len(points)} points, {len(pairs)} measurements; results go to {json_path}", file=sys.stderr)
    if pairs:
        print(rounds_note(settings.rounds, len(adapters)), file=sys.stderr)

    def save_rows(rows):
        doc["rows"] = list(rows)
        report.save(doc, json_path)

    try:
        if not args.overhead_only:
            sweep.run_sweep(points, adapters, device, settings, on_point=save_rows)
        if not args.no_extras:
            print("host overhead: " + ", ".join(adapters), file=sys.stderr)
            device.stop_clock_sampling()
            doc["host_overhead"] = overhead.measure_host_overhead(adapters, device, settings)
            for name in adapters if not args.overhead_only else ():
                print(f"cold start: {name}", file=sys.stderr)
                doc["cold_start"].append(peers.measure_cold_start(name, args.device))
    except sweep.DeviceLost as exc:
        print(f"fmha_rt bench: {exc}", file=sys.stderr)
        return _finish(doc, json_path, out_dir, status=1)
    except KeyboardInterrupt:
        print("fmha_rt bench: interrupted; writing what was measured", file=sys.stderr)
        return _finish(doc, json_path, out_dir, status=130)
    finally:
        device.close()
    return _finish(doc, json_path, out_dir, status=0)


def rounds_note(requested, implementations):
    """The line saying how many rounds a point of `implementations` takes for --rounds `requested`."""
    rounds = sweep.equal_turn_rounds(requested, implementations)
    note = f"rounds: {rounds} at a point of {implementations} implementations"
    if rounds != requested:
        note += (f" (--rounds {requested} rounded up to a multiple of the implementations, so that each takes the"
                 " first turn equally often; a point with fewer implementations may take fewer)")
    return note


def _finish(doc, json_path, out_dir, status):
    report.save(doc, json_path)
    for path in [json_path] + report.write_reports(doc, out_dir, say=_say):
        print(path)
    return status


def _say(line):
    print(f"fmha_rt bench: {line}", file=sys.stderr)


def _write_reports(parser, args):
    if len(args.report) > 1 and not args.out:
        parser.error("--report with several files merges them: give --out DIR for the merged record")
    try:
        docs = [report.load(path) for path in args.report]
    except (OSError, ValueError) as exc:
        print(f"fmha_rt bench: {exc}", file=sys.stderr)
        return 1
    try:
        doc = report.merge(docs)
    except report.MergeRefused as exc:
        print(f"fmha_rt bench: {exc}", file=sys.stderr)
        return 1
    if len(docs) > 1:
        out_dir, stem = args.out, os.path.splitext(RECORD_NAME)[0]
        report.save(doc, os.path.join(out_dir, RECORD_NAME))
    else:
        out_dir = args.out or os.path.dirname(os.path.abspath(args.report[0]))
        stem = os.path.splitext(os.path.basename(args.report[0]))[0]
    for path in report.write_reports(doc, out_dir, stem, say=_say):
        print(path)
    return 0
