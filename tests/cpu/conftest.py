"""Shared by every CPU test: workspaces the shim kept for a stand-in runtime (fake_gpu.py) are its host
memory, reached through its callbacks, so they are released while the test's patches keep it alive.
Also the stand-in runtime and driver of the tests that run calls up to the launch (`rt`, `driver`), torch
CPU tensors posing as CUDA tensors there (`torch_as_cuda`), and, with FMHA_RT_TESTS_NEED_ALL_PACKAGES set
(tools/test.sh), a failure for every test or test file that would skip because a package is missing."""
import os
import threading

import pytest

import fmha_rt
from fmha_rt import arrays
from fmha_rt.runtime import kernel_launch
from fmha_rt.runtime import registry as registry_module
from fmha_rt.runtime.backend import ffi

from fake_gpu import StandInRuntime


MISSING_PACKAGE = "could not import"  # how pytest.importorskip words its skip
_missing_package_skips = []  # (where, why) of every skip for a missing package


def _note_missing_package(report):
    why = report.longrepr[-1] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    if report.skipped and MISSING_PACKAGE in why:
        _missing_package_skips.append((report.nodeid or report.fspath, why))


def pytest_collectreport(report):
    _note_missing_package(report)


def pytest_runtest_logreport(report):
    _note_missing_package(report)


def pytest_terminal_summary(terminalreporter):
    for where, why in _missing_package_skips:
        terminalreporter.write_line(f"skipped for a missing package: {where}: {why}")


def pytest_sessionfinish(session):
    if os.environ.get("FMHA_RT_TESTS_NEED_ALL_PACKAGES") and _missing_package_skips:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture(autouse=True)
def release_kept_workspaces(monkeypatch):
    """Requests monkeypatch so that its undo (which drops a test's stand-in) runs after the release."""
    yield
    fmha_rt.release_workspaces()


class Driver:
    """Stands in for the driver's launch: records (kernel key, grid, argument bytes, stream, thread)."""

    def __init__(self, monkeypatch):
        self.kernels, self.launches, self._lock = [], [], threading.Lock()
        monkeypatch.setattr(kernel_launch, "kernel_handle", self.kernel_handle)
        monkeypatch.setattr(kernel_launch, "launch_prepared", self.launch)

    def kernel_handle(self, device, entry):
        with self._lock:
            self.kernels.append(entry.key)
            return ffi.cast("fmha_kernel *", len(self.kernels))

    def launch(self, config, stream):
        key = self.kernels[int(ffi.cast("uintptr_t", config.kernel)) - 1]
        self.launches.append((key, tuple(config.grid), bytes(ffi.buffer(config.args, config.args_size)), stream,
                              threading.get_ident()))
        return 0

    def take(self):
        """The launches since the last take, without the thread."""
        taken, self.launches = self.launches, []
        return [item[:4] for item in taken]


@pytest.fixture
def rt(monkeypatch):
    monkeypatch.delenv("FMHA_RT_ASM_DIR", raising=False)
    monkeypatch.delenv("FMHA_RT_LOG_CONFIG", raising=False)
    registry_module.reset()
    runtime = StandInRuntime(monkeypatch)
    fmha_rt.clear_plan_cache()
    yield runtime
    fmha_rt.clear_plan_cache()
    registry_module.reset()


@pytest.fixture
def driver(monkeypatch, rt):
    return Driver(monkeypatch)


@pytest.fixture
def log_config(monkeypatch):
    """FMHA_RT_LOG_CONFIG=1 for one test (the runtime reads it once: refresh, and again once unset)."""
    with monkeypatch.context() as m:
        m.setenv("FMHA_RT_LOG_CONFIG", "1")
        assert kernel_launch.refresh_log_config()
        yield
    kernel_launch.refresh_log_config()


@pytest.fixture
def torch_as_cuda(monkeypatch):
    """torch CPU tensors read as CUDA tensors by the validating path (the stand-in's GPU arrays)."""
    as_cuda = arrays.TorchView.__init__

    def cuda_view(self, t):
        as_cuda(self, t)
        self.device_type = "cuda"

    monkeypatch.setattr(arrays.TorchView, "__init__", cuda_view)
