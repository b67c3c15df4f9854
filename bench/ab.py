"""A/B of kernel builds on one machine: `python -m fmha_rt bench` runs once per variant and round, the
order rotating from round to round (A B, then B A) so that neither variant always runs first on a warm
GPU, and one record keeps every run's TFLOP/s per point with the median ratio to the first variant.

    python bench/ab.py --variant base=hsa --variant split=out/split --rounds 2 \\
        --record bench/results/NAME.json --what "what changed" \\
        -- --dtype bf16 --hdim 128 --seqlen 4k 16k --causal both --pass bwd --gqa 1 --varlen 0 --repeats 10

A variant is NAME=PATH, where PATH is
  - this checkout's hsa/: the package and code objects as they are;
  - a partial build (`python -m kernels.build --arch sm_90 --only REGEX --out DIR`): its kernels laid over
    a copy of hsa/, everything else as it is;
  - another checkout of the package (fmha_rt/ and hsa/, e.g. `git archive main | tar -x -C DIR`): its
    Python, C shim and code objects, for a change that reaches the host side too (a workspace layout, a
    kernel argument); without a built shim it borrows this checkout's where their C sources are the same.
Everything after `--` goes to the benchmark, which this tool runs with --impl fmha_rt --no-extras.
"""
import argparse
import dataclasses
import json
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run as a script from anywhere: the checkout's fmha_rt and kernels

from fmha_rt.bench import cli, report, sweep  # noqa: E402
from kernels.build import merge_partial  # noqa: E402

FORMAT = "fmha_rt-ab/1"
# Flags this tool sets for every run: only fmha_rt is timed, and only the sweep.
OWNED_FLAGS = ("--impl", "--out", "--report", "--list", "--no-extras", "--overhead-only")
HEADER_FIELDS = ("gpu", "driver", "cuda", "torch", "triton", "fmha_rt_commit")


class AbError(Exception):
    pass


@dataclasses.dataclass
class Variant:
    name: str
    kind: str  # "checkout", "partial build" or "package"
    source: str  # PATH as given
    env: dict  # added to the benchmark's environment
    cwd: pathlib.Path  # where the benchmark runs: `python -m` imports fmha_rt from there first
    kernels: list  # the kernel keys a partial build swaps in

    def describe(self) -> dict:
        out = {"name": self.name, "kind": self.kind, "path": self.source}
        if self.kernels:
            out["kernels"] = self.kernels
        return out


def resolve_variant(spec: str, workdir: pathlib.Path, checkout_hsa: pathlib.Path = REPO / "hsa") -> Variant:
    """The Variant for NAME=PATH; a partial build is laid over a copy of checkout_hsa under workdir."""
    name, sep, source = spec.partition("=")
    if not sep or not name.isidentifier() or not source:
        raise AbError(f"--variant {spec!r}: write NAME=PATH with NAME a plain word (e.g. base=hsa)")
    path = pathlib.Path(source).resolve()
    if path == checkout_hsa.resolve():
        return Variant(name, "checkout", source, {}, REPO, [])
    if (path / "fmha_rt" / "__init__.py").is_file():
        if not (path / "hsa" / "manifest.json").is_file():
            raise AbError(f"--variant {name}: {source} has no hsa/manifest.json")
        package_root = path
        if not list((path / "fmha_rt").glob("_shim*.so")):
            package_root = with_this_shim(name, source, path, workdir)
        # the package goes first on the path; what was there stays (e.g. where cffi was installed)
        python_path = os.pathsep.join([str(package_root), *filter(None, [os.environ.get("PYTHONPATH")])])
        return Variant(name, "package", source,
                       {"PYTHONPATH": python_path, "FMHA_RT_ASM_DIR": str(path / "hsa")}, package_root, [])
    manifest = path / "manifest.json"
    if not manifest.is_file():
        raise AbError(f"--variant {name}: {source} is neither hsa/, a build folder with manifest.json, nor a "
                      "checkout of the package")
    try:
        kernels = sorted(f"{e['arch']}/{e['key']}" for e in json.loads(manifest.read_text())["kernels"])
    except (ValueError, KeyError, TypeError) as exc:
        raise AbError(f"--variant {name}: {manifest} is not a build manifest ({exc})") from None
    dest = workdir / name / "hsa"
    shutil.copytree(checkout_hsa, dest)
    merge_partial(path, dest, whole_families=False)
    return Variant(name, "partial build", source, {"FMHA_RT_ASM_DIR": str(dest)}, REPO, kernels)


def _shim_sources(root: pathlib.Path) -> dict:
    files = [*(root / "fmha_rt").rglob("*.c"), root / "fmha_rt" / "shim_build.py", *(root / "include").glob("*.h")]
    return {f.relative_to(root).as_posix(): f.read_bytes() for f in files if f.is_file()}


def with_this_shim(name, source, path, workdir, checkout=REPO) -> pathlib.Path:
    """A copy of the other checkout's package with this checkout's built shim, where the C sources they
    are built from are the same; its folder."""
    shims = list((checkout / "fmha_rt").glob("_shim*.so"))
    if not shims or _shim_sources(path) != _shim_sources(checkout):
        raise AbError(f"--variant {name}: {source}/fmha_rt has no built shim (_shim*.so) and its C sources "
                      "differ from this checkout's (or this one has none built); run `pip install "
                      "--no-build-isolation --no-deps -e .` there")
    root = workdir / name / "package"
    shutil.copytree(path / "fmha_rt", root / "fmha_rt")
    for shim in shims:
        shutil.copy(shim, root / "fmha_rt" / shim.name)
    return root


def check_bench_args(bench_args):
    """Refuses the flags this tool owns and any the benchmark would refuse, before anything runs."""
    for arg in bench_args:
        if arg.split("=")[0] in OWNED_FLAGS:
            raise AbError(f"{arg.split('=')[0]} is set by this tool (it runs --impl fmha_rt --no-extras "
                          "with an --out of its own); leave it out")
    try:
        cli.build_parser().parse_args(list(bench_args))
    except SystemExit:  # argparse has printed why
        raise AbError(f"the benchmark refuses the arguments after --: {' '.join(bench_args)}") from None


def bench_command(bench_args, out_dir):
    return [sys.executable, "-m", "fmha_rt", "bench", *bench_args, "--impl", "fmha_rt", "--no-extras",
            "--out", str(out_dir)]


def run_rounds(variants, rounds, bench_args, workdir, runner=subprocess.run, log=sys.stderr):
    """{variant name: [benchmark record of each round]}."""
    docs = {v.name: [] for v in variants}
    for r in range(rounds):
        for v in sweep.turn_order(variants, r):  # A B, then B A for two
            out = workdir / f"{v.name}_round{r + 1}"
            print(f"ab: round {r + 1}/{rounds}, {v.name}", file=log, flush=True)
            done = runner(bench_command(bench_args, out), env={**os.environ, **v.env}, cwd=str(v.cwd))
            if done.returncode != 0:
                raise AbError(f"the benchmark of {v.name} (round {r + 1}) exited with status {done.returncode}")
            docs[v.name].append(report.load(str(out / cli.RECORD_NAME)))
    return docs


def compare(docs, names):
    """Per point: every run's TFLOP/s per variant, and each later variant's median over the first's."""
    points = {}
    for name in names:
        for doc in docs[name]:
            for row in doc["rows"]:
                if row.get("impl") != "fmha_rt":
                    continue
                entry = points.setdefault(report.point_key(row), {
                    "point": {k: row[k] for k in report.POINT_KEYS if k in row}, "tflops": {}})
                if "tflops" in row:
                    entry["tflops"].setdefault(name, []).append(round(row["tflops"], 1))
                elif "error" in row:
                    entry.setdefault("errors", {})[name] = row["error"]
    base = names[0]
    for entry in points.values():
        runs = entry["tflops"]
        if base in runs:
            entry["median_ratio"] = {n: round(statistics.median(runs[n]) / statistics.median(runs[base]), 4)
                                     for n in names[1:] if n in runs}
    return list(points.values())


def make_record(docs, variants, points, argv, what):
    header = docs[variants[0].name][0]["header"]
    record = {"format": FORMAT, "date": header.get("date"), **{k: header.get(k) for k in HEADER_FIELDS}}
    record.update(what=what, command=["bench/ab.py", *cli.path_by_name(argv, "--record")],
                  variants=[v.describe() for v in variants], rounds=len(docs[variants[0].name]), points=points)
    return record


def table(points, names) -> str:
    lines = ["point | " + " | ".join(names), "--- | " + " | ".join("---" for _ in names)]
    for entry in points:
        label = report.point_text(entry["point"])
        cells = []
        for i, name in enumerate(names):
            runs = entry["tflops"].get(name)
            if not runs:
                cells.append(entry.get("errors", {}).get(name, "-"))
                continue
            cell = f"{statistics.median(runs):.1f}"
            if i and name in entry.get("median_ratio", {}):
                cell += f" ({entry['median_ratio'][name]:.3f}x)"
            cells.append(cell)
        lines.append(f"{label} | " + " | ".join(cells))
    return "\n".join(lines)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    own, bench_args = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variant", action="append", required=True, metavar="NAME=PATH",
                        help="a build to time; the first is the one the others are compared with")
    parser.add_argument("--rounds", type=cli.positive_int, default=2, help="runs per variant (default 2)")
    parser.add_argument("--record", metavar="JSON", help="write the record here")
    parser.add_argument("--what", default="", help="what the variants are, for the record")
    args = parser.parse_args(own)
    try:
        names = [spec.partition("=")[0] for spec in args.variant]
        if len(args.variant) < 2 or len(set(names)) != len(names):
            raise AbError("give two or more --variant NAME=PATH, each NAME once")
        check_bench_args(bench_args)
        with tempfile.TemporaryDirectory(prefix="fmha_rt_ab_") as tmp:
            workdir = pathlib.Path(tmp)
            variants = [resolve_variant(spec, workdir) for spec in args.variant]
            docs = run_rounds(variants, args.rounds, bench_args, workdir)
    except AbError as exc:
        print(f"bench/ab.py: {exc}", file=sys.stderr)
        return 2
    points = compare(docs, names)
    print(table(points, names))
    if args.record:
        report.save(make_record(docs, variants, points, argv, args.what), args.record)
        print(args.record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
