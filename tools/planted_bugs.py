"""Plants known bugs, one at a time, in a temporary copy of the repository and runs the tests that must
catch each; prints which test failed for which bug and exits 0 only if every planted bug was caught.

    python3 tools/planted_bugs.py            # every bug (the GPU ones need a GPU)
    python3 tools/planted_bugs.py --cpu      # only the bugs the CPU interpreter tests must catch

Kernel bugs are planted in the Triton sources, which the CPU tests run under the interpreter (the GPU
runs the same sources compiled ahead of time); runtime bugs are planted in fmha_rt and caught by GPU
tests. The working tree is never modified. Some bugs also run, for contrast, a test that predates the
independent checks and is expected to pass in spite of the bug.
"""
import argparse
import dataclasses
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
PYTEST = [sys.executable, "-m", "pytest", "-q", "-x", "-rf", "-p", "no:cacheprovider"]


@dataclasses.dataclass(frozen=True)
class Plant:
    name: str
    path: str  # relative to the repository root
    old: str  # must occur exactly once
    new: str
    tests: tuple  # pytest node ids or paths (with -k expressions as "path::-k::expr")
    gpu: bool
    contrast: tuple = ()  # tests that miss the bug: they pass with it planted


DROPOUT_TESTS = ("tests/cpu/test_dropout_philox.py",)
# judges the kernels' dropout by the mask kernel's own mask
KERNEL_MASK_TEST = ("tests/cpu/test_portable_kernels.py::test_dropout_matches_reference_given_the_kernel_mask",)
PLANTS = [
    Plant("one dropout mask for every batch and head (the Philox counter ignores (b, h))",
          "kernels/portable/fmha_common.py",
          "return philox_offset + (bh.to(tl.int64) * seqlen_q + rows) * groups_per_row",
          "return philox_offset + (0 * bh.to(tl.int64) * seqlen_q + rows) * groups_per_row",
          DROPOUT_TESTS, gpu=False, contrast=KERNEL_MASK_TEST),
    Plant("dropout lanes in another order (key j reads draw (j % 4) in 0, 2, 1, 3 order)",
          "kernels/portable/fmha_common.py",
          "tl.join(tl.join(r0, r2), tl.join(r1, r3))",
          "tl.join(tl.join(r0, r1), tl.join(r2, r3))",
          DROPOUT_TESTS, gpu=False, contrast=KERNEL_MASK_TEST),
    Plant("the forward kernel skips writing one row of every query block",
          "kernels/portable/fmha_fwd.py",
          "out.to(Out.dtype.element_ty),\n             mask=q_ok[:, None] & dv_ok[None, :])",
          "out.to(Out.dtype.element_ty),\n             mask=(q_ok & (offs_m != 5))[:, None] & dv_ok[None, :])",
          ("tests/cpu/test_portable_kernels.py::test_shapes_and_masks_match_reference",), gpu=False),
    Plant("every launch goes to the default stream, whatever stream= says",
          "fmha_rt/runtime/streams.py",
          "    if stream is None:\n        return 0\n",
          "    if True:\n        return 0\n",
          ("tests/gpu/test_determinism.py::-k::portable_fwd",), gpu=True),
    Plant("the forward never writes the last query row (seqlen_q - 1 passed to the kernel)",
          "fmha_rt/plan/args.py",
          "    args = ordered(key, \"fmha_fwd\", forward_args(problem, operands))\n",
          "    args = ordered(key, \"fmha_fwd\", forward_args(problem, operands))\n    args['seqlen_q'] -= 1\n",
          ("tests/gpu/test_attention.py::test_long_sequence_64k",), gpu=True),
    Plant("deterministic backwards in the v3 family take its atomic form, which adds dQ in any order",
          "fmha_rt/plan/v3.py",
          "def _bwd_strategy(problem) -> str:\n    return DQ_ORDERED if problem.deterministic else DQ_ATOMIC\n",
          "def _bwd_strategy(problem) -> str:\n    return DQ_ATOMIC\n",
          ("tests/gpu/test_determinism.py::-k::v3_bwd_ordered",), gpu=True),
]


def copy_repository(dest: pathlib.Path) -> None:
    """The repository without .git and the benchmark records (the built shim comes along)."""
    def ignore(folder, names):
        skip = {".git", "__pycache__"} | ({"bench"} if pathlib.Path(folder) == ROOT else set())
        return [n for n in names if n in skip]

    shutil.copytree(ROOT, dest, ignore=ignore)
    if not list((dest / "fmha_rt").glob("_shim*.so")):  # an installed build (not in the tree): bring its shim
        import fmha_rt._shim
        shutil.copy2(fmha_rt._shim.__file__, dest / "fmha_rt")


def plant(copy: pathlib.Path, p: Plant) -> None:
    target = copy / p.path
    text = target.read_text()
    if text.count(p.old) != 1:
        raise SystemExit(f"planted bug '{p.name}': the text to replace occurs {text.count(p.old)} times in {p.path}; "
                         "update tools/planted_bugs.py")
    target.write_text(text.replace(p.old, p.new))


def pytest_args(test: str) -> list:
    path, _, expression = test.partition("::-k::")
    return [path, "-k", expression] if expression else [test]


def run_tests(copy: pathlib.Path, tests) -> tuple:
    """(pytest exit code, the FAILED lines) of the tests in the copy."""
    # the copy first, then whatever the caller's PYTHONPATH holds (dependencies installed to a folder of their own)
    path = os.pathsep.join(filter(None, [str(copy), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path, "PYTHONDONTWRITEBYTECODE": "1"}
    args = [a for test in tests for a in pytest_args(test)]
    done = subprocess.run(PYTEST + args, cwd=copy, env=env, capture_output=True, text=True, timeout=600)
    failed = [line for line in done.stdout.splitlines() if line.startswith(("FAILED", "ERROR"))]
    if done.returncode not in (0, 1):
        failed.append(done.stdout[-1500:] + done.stderr[-1500:])
    return done.returncode, failed


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="only the bugs that CPU tests must catch")
    args = parser.parse_args(argv)
    missed = []
    for p in PLANTS:
        if args.cpu and p.gpu:
            continue
        start = time.monotonic()
        with tempfile.TemporaryDirectory(prefix="fmha_rt_planted_") as folder:
            copy = pathlib.Path(folder) / "repo"
            copy_repository(copy)
            plant(copy, p)
            code, failed = run_tests(copy, p.tests)
            contrast = run_tests(copy, p.contrast)[0] if p.contrast else None
        caught = code == 1
        print(f"\n{'CAUGHT' if caught else 'MISSED'}: {p.name} ({p.path}; {time.monotonic() - start:.0f} s)")
        for line in failed[:3]:
            print("   ", re.sub(r"\s+", " ", line)[:300])
        if contrast is not None:
            print(f"    for contrast, {', '.join(p.contrast)}: {'passed (misses it)' if contrast == 0 else 'failed'}")
        if not caught:
            missed.append(p.name)
    print(f"\n{len(missed)} planted bug(s) missed" + (": " + "; ".join(missed) if missed else ""))
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
