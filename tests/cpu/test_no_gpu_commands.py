"""The command line on a machine without a GPU: the commands that need one say in one line what is
missing (the driver library, or a device) and exit with status 2, never a traceback; the quickstart
first does what needs no GPU. Driver cases run in a fresh process (the runtime initialises once)."""
import os
import subprocess
import sys

import pytest

from fmha_rt import cli
from fmha_rt.gpu_presence import NO_GPU_EXIT, NoGpu, require_gpu

from fake_gpu import StandInRuntime
from test_backend import have_library

HIP_NAMES = ("amdhip64", "libamdhip64.so.5", "libamdhip64.so.6", "libamdhip64.so")


def run_cli(backend_name, *args):
    env = dict(os.environ, FMHA_RT_BACKEND=backend_name)
    return subprocess.run([sys.executable, "-m", "fmha_rt", *args], env=env, capture_output=True, text=True, timeout=300)


def assert_one_line_no_gpu(done, missing):
    assert done.returncode == NO_GPU_EXIT, (done.returncode, done.stdout, done.stderr)
    assert "Traceback" not in done.stderr + done.stdout
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and missing in lines[0], done.stderr
    return lines[0]


@pytest.mark.skipif(have_library("cuda", "libcuda.so.1"), reason="this machine has the CUDA driver")
def test_selftest_without_a_driver_library_says_so_in_one_line():
    line = assert_one_line_no_gpu(run_cli("cuda", "selftest"), "this machine has no GPU driver library")
    assert line.startswith("fmha_rt: the self-test needs a GPU") and "libcuda.so.1" in line


def test_selftest_with_the_hip_library_and_no_device_says_so_in_one_line():
    if not have_library(*HIP_NAMES):
        pytest.fail("the HIP runtime library is not installed: .ci/run installs Debian's libamdhip64-5")
    line = assert_one_line_no_gpu(run_cli("hip", "selftest"), "sees no GPU device")
    assert "the hip driver (libamdhip64.so" in line


@pytest.mark.skipif(have_library("cuda", "libcuda.so.1"), reason="this machine has the CUDA driver")
def test_quickstart_without_a_gpu_checks_what_it_can_then_names_what_needs_the_gpu():
    done = run_cli("cuda", "quickstart")
    assert done.returncode == NO_GPU_EXIT and "Traceback" not in done.stderr + done.stdout, done.stderr
    lines = done.stdout.strip().splitlines()
    assert lines[0].startswith("fmha_rt 0.1.0 on Python ")
    assert any(line.startswith("  torch: ") for line in lines) and any(line.startswith("  jax: ") for line in lines)
    assert any(line.startswith("ABI checks: all pass") for line in lines), done.stdout
    assert lines[-1].startswith("GPU: the rest (the self-test and an attention problem) needs a GPU, and this machine "
                                "has no GPU driver library"), lines[-1]


def test_a_runtime_without_devices_is_named(monkeypatch):
    StandInRuntime(monkeypatch, devices=0)
    with pytest.raises(NoGpu, match=r"^the self-test needs a GPU, and the cuda driver \(stand-in\) sees no GPU device$"):
        require_gpu(0, "the self-test")


def test_a_missing_ordinal_is_named_with_the_ones_present(monkeypatch):
    rt = StandInRuntime(monkeypatch, devices=2)
    assert require_gpu(1, "x") is rt.runtime.devices[1]
    with pytest.raises(NoGpu, match=r"^x needs GPU device 2, and 2 device\(s\) are present \(0\.\.1\)$"):
        require_gpu(2, "x")


def test_cli_selftest_on_a_runtime_without_devices_exits_2_with_one_line(monkeypatch, capsys):
    StandInRuntime(monkeypatch, devices=0)
    assert cli.main(["selftest"]) == NO_GPU_EXIT
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == "fmha_rt: the self-test needs a GPU, and the cuda driver (stand-in) sees no GPU device\n"
