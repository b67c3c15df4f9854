"""What of the multi-GPU test and benchmark a CPU can check: the scaling script's arguments, its
efficiency arithmetic, JSON record and table on a synthetic run; and that the multi-GPU test module
imports and says why it skips when the runtime has fewer than two GPUs."""
import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest

from fmha_rt.runtime import backend
from fmha_rt.errors import FmhaRuntimeError

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCALING_SCRIPT = os.path.join(REPO_ROOT, "bench", "multi_gpu_scaling.py")
MULTI_GPU_TESTS = os.path.join(REPO_ROOT, "tests", "gpu", "test_multi_gpu.py")


def load(path, name):
    """Import a file that is not in a package, as a fresh module each time."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def scaling():
    return load(SCALING_SCRIPT, "multi_gpu_scaling_under_test")


def fake_runtime(archs):
    devices = tuple(backend.Device(ordinal=i, name="Stand-in GPU", arch=arch, arch_full=arch, multiprocessors=132,
                                   max_shared_per_block=232448, total_memory=1 << 37) for i, arch in enumerate(archs))
    return backend.Runtime(backend="cuda", library="libcuda.so.1", driver_version=12080, devices=devices)


# ---- the scaling benchmark ----

def test_defaults_are_the_fixed_bf16_problem_and_every_gpu(scaling):
    args = scaling.parse_args([])
    assert (args.batch, args.seqlen, args.heads, args.head_dim) == (4, 4096, 16, 128)
    assert not args.causal and not args.deterministic and args.gpus is None
    assert args.out == scaling.DEFAULT_OUT
    assert args.out.parts[-3:] == ("bench", "results", "multi_gpu_scaling.json")
    assert str(args.out).startswith(REPO_ROOT)  # beside the script, wherever it is run from


def test_gpu_counts_always_include_the_one_gpu_baseline(scaling):
    args = scaling.parse_args(["--gpus", "8", "2", "4", "2", "--seqlen", "2k", "--causal", "--deterministic",
                               "--out", "x.json"])
    assert args.gpus == [1, 2, 4, 8] and args.seqlen == 2048 and args.causal and args.deterministic
    assert str(args.out) == "x.json"


@pytest.mark.parametrize("argv", [["--gpus", "0"], ["--batch", "-1"], ["--seqlen", "0"], ["--seconds", "0"],
                                  ["--repeats", "two"], ["--seqlen", "4q"]])
def test_bad_arguments_are_refused(scaling, argv, capsys):
    with pytest.raises(SystemExit) as info:
        scaling.parse_args(argv)
    assert info.value.code == 2
    assert argv[0] in capsys.readouterr().err


def test_problem_counts_forward_and_backward_flops(scaling):
    problem = scaling.problem_of(scaling.parse_args(["--batch", "2", "--seqlen", "1024", "--heads", "8",
                                                     "--head-dim", "64", "--causal"]))
    forward = 4 * 2 * 8 * 1024 * 1024 * 64 // 2
    assert problem["flops_per_call"] == forward + forward * 5 // 2
    assert problem["dtype"] == "bf16" and problem["causal"] and not problem["deterministic"]


def synthetic_rounds():
    """Three rounds per GPU count, out of order, with per-GPU rates that do not all agree."""
    def round_(total, per_gpu):
        return {"calls_per_s": total, "wall_s": 3.0, "per_gpu_calls_per_s": per_gpu}

    return {
        1: [round_(21.0, [21.0]), round_(20.0, [20.0]), round_(19.0, [19.0])],
        2: [round_(38.0, [19.0, 19.0]), round_(40.0, [20.0, 20.0]), round_(36.0, [18.0, 18.0])],
        4: [round_(70.0, [18.0, 17.0, 17.5, 17.5]), round_(72.0, [18.5, 17.5, 18.0, 18.0]),
            round_(60.0, [15.0, 15.0, 15.0, 15.0])],
    }


def test_efficiency_is_median_throughput_over_n_times_one_gpu(scaling):
    rows = scaling.scaling_rows(synthetic_rounds(), flops_per_call=2e12)
    assert [r["gpus"] for r in rows] == [1, 2, 4]
    assert [r["calls_per_s"] for r in rows] == [20.0, 38.0, 70.0]  # each count's median round
    assert [r["efficiency"] for r in rows] == pytest.approx([1.0, 38.0 / 40.0, 70.0 / 80.0])
    assert [r["tflops"] for r in rows] == pytest.approx([40.0, 76.0, 140.0])
    assert rows[2]["per_gpu_calls_per_s"] == [18.0, 17.0, 17.5, 17.5]  # the median round's, not a mix
    assert rows[1]["rounds_calls_per_s"] == [38.0, 40.0, 36.0]


def test_efficiency_needs_the_one_gpu_baseline(scaling):
    rounds = synthetic_rounds()
    del rounds[1]
    with pytest.raises(ValueError, match="baseline"):
        scaling.scaling_rows(rounds, flops_per_call=1)


def test_record_is_written_as_json_and_tabulated(scaling, tmp_path):
    header = {"date": "2025-01-01T00:00:00+00:00", "gpu": "Stand-in GPU", "driver": "570.00", "cuda": "12.8",
              "python": "3.11", "torch": "2.13.0", "triton": "3.6.0", "fmha_rt": "0.1.0", "settings": {"repeats": 3}}
    problem = scaling.problem_of(scaling.parse_args([]))
    record = scaling.build_record(header, ["Stand-in GPU"] * 4, 12080, problem, synthetic_rounds())
    path = tmp_path / "nested" / "scaling.json"
    scaling.write_record(record, path)
    loaded = json.loads(path.read_text())
    assert loaded == json.loads(json.dumps(record))
    for key in ("date", "gpu", "driver", "cuda", "torch", "triton", "fmha_rt"):
        assert loaded[key] == header[key]
    assert loaded["gpu_count"] == 4 and loaded["gpus"] == ["Stand-in GPU"] * 4
    assert loaded["driver_api_version"] == 12080 and loaded["problem"] == problem
    assert [(r["gpus"], r["efficiency"]) for r in loaded["results"]] == [(1, 1.0), (2, 0.95), (4, 0.875)]
    table = scaling.format_table(record).splitlines()
    assert "B=4 S=4096 H=16 D=128" in table[0] and "Stand-in GPU (x4)" in table[0]
    tflops_1, tflops_4 = (f"{rate * problem['flops_per_call'] / 1e12:.1f}" for rate in (20, 70))
    assert table[2].split() == ["1", "20.00", tflops_1, "100.0%", "20.00-20.00"]
    assert table[4].split() == ["4", "70.00", tflops_4, "87.5%", "17.00-18.00"]


# ---- the multi-GPU test module on fewer than two GPUs ----

@pytest.mark.parametrize("archs", [(), ("sm_90",)], ids=["0_gpus", "1_gpu"])
def test_multi_gpu_tests_skip_saying_how_many_gpus_they_see(monkeypatch, archs):
    monkeypatch.setattr(backend, "runtime", lambda: fake_runtime(archs))
    module = load(MULTI_GPU_TESTS, "multi_gpu_tests_under_test")
    reason = module.SKIP_REASON
    assert reason == f"needs 2 or more GPUs; the cuda runtime (libcuda.so.1) sees {len(archs)}"
    mark = module.pytestmark
    assert mark.name == "skipif" and mark.args == (True,) and mark.kwargs["reason"] == reason
    assert module.test_threads_on_every_gpu_race_on_a_cold_map_and_match_gpu0_bitwise
    assert module.test_a_call_runs_on_its_arrays_gpu_and_leaves_the_callers_current_device


def test_multi_gpu_tests_skip_without_a_runtime(monkeypatch):
    def no_runtime():
        raise FmhaRuntimeError("no GPU runtime library found (tried libcuda.so.1)")

    monkeypatch.setattr(backend, "runtime", no_runtime)
    module = load(MULTI_GPU_TESTS, "multi_gpu_tests_under_test")
    assert module.SKIP_REASON == ("needs 2 or more GPUs; there is no GPU runtime: no GPU runtime library found "
                                  "(tried libcuda.so.1)")
    assert module.pytestmark.args == (True,)


def test_multi_gpu_tests_skip_on_gpus_of_different_archs(monkeypatch):
    monkeypatch.setattr(backend, "runtime", lambda: fake_runtime(("sm_90", "sm_100")))
    module = load(MULTI_GPU_TESTS, "multi_gpu_tests_under_test")
    assert module.SKIP_REASON == ("needs GPUs of one arch (results are compared bitwise with GPU 0's); "
                                  "found sm_100, sm_90")


def test_multi_gpu_tests_run_on_two_gpus_of_one_arch(monkeypatch):
    monkeypatch.setattr(backend, "runtime", lambda: fake_runtime(("sm_90", "sm_90")))
    module = load(MULTI_GPU_TESTS, "multi_gpu_tests_under_test")
    assert module.SKIP_REASON is None and module.pytestmark.args == (False,)


def test_multi_gpu_tests_collect_and_skip_under_pytest_with_no_gpu_visible():
    """The real runtime, every GPU hidden: pytest collects both tests and skips them with the module's
    own reason (a skipif mark is evaluated before the GPU folder's no-GPU skip)."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", HIP_VISIBLE_DEVICES="", ROCR_VISIBLE_DEVICES="")
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", MULTI_GPU_TESTS],
                          cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "2 skipped" in done.stdout, done.stdout
    assert re.search(r"SKIPPED \[2\] \S*test_multi_gpu\.py: needs 2 or more GPUs", done.stdout), done.stdout
