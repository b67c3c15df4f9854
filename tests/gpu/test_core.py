"""Runtime core on a real GPU: self-test kernels exact, many threads and streams on a cold kernel
map, FMHA_RT_LOG_CONFIG output."""
import concurrent.futures
import logging
import threading

import numpy as np
import pytest

from fmha_rt import selftest
from fmha_rt.runtime import backend, kernel_launch
from fmha_rt.runtime.registry import registry
from gpu_presence import require


def test_selftest_kernels_are_exact():
    got, want = selftest.run_strided_copy(0, 123_457, 3, 5, seed=1)
    assert np.array_equal(got, want, equal_nan=True)  # strided slots copied, every other slot still NaN
    got, want = selftest.run_axpy(0, 3_000_001, -1.25, seed=2)
    assert not np.isnan(got).any()
    assert selftest.max_ulp_difference(got, want) <= 1


def test_32_threads_each_with_its_own_stream_race_on_a_cold_map():
    torch = require("torch")
    kernel_launch.loaded_handles.clear()  # Python-side cache cold; the C map may already hold the entries
    barrier = threading.Barrier(32)

    def worker(i):
        stream = torch.cuda.Stream()
        barrier.wait()  # every thread's first call at once
        got, want = selftest.run_axpy(0, 50_000 + i, 0.5 + i, stream=stream.cuda_stream, seed=100 + i)
        copy_got, copy_want = selftest.run_strided_copy(0, 40_000 + i, 2, 3, stream=stream.cuda_stream, seed=i)
        return selftest.max_ulp_difference(got, want) <= 1 and np.array_equal(copy_got, copy_want, equal_nan=True)

    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        results = list(pool.map(worker, range(32)))
    assert all(results)
    entries = backend.kernel_map_entries()
    assert len(entries) == len(set(entries))  # exactly one entry per (device, kernel)
    assert {(0, "selftest_axpy_f32"), (0, "selftest_strided_copy_f32")} <= set(entries)


def test_current_device_is_restored_after_calls():
    before = backend.current_device()
    selftest.run_axpy(0, 1000, 2.0)
    assert backend.current_device() == before


def test_log_config_prints_every_argument(monkeypatch, caplog):
    try:
        with monkeypatch.context() as m:
            m.setenv("FMHA_RT_LOG_CONFIG", "1")
            assert kernel_launch.refresh_log_config()  # the runtime reads it once
            with caplog.at_level(logging.INFO, logger="fmha_rt"):
                selftest.run_axpy(0, 4096, 1.5)
    finally:
        kernel_launch.refresh_log_config()  # as the environment is again
    text = caplog.text
    for line in ("kernel: selftest_axpy_f32", "device: 0", "grid: (4, 1, 1)", "block: (128, 1, 1)",
                 "alpha: 1.5", "n: 4096", "global_scratch: Pointer(0x0)"):
        assert line in text, line


def test_driver_error_names_call_kernel_and_device():
    from fmha_rt.errors import DriverError

    entry = registry().entry(backend.device(0).arch, "selftest_axpy_f32")
    handle = kernel_launch.kernel_handle(0, entry)
    from fmha_rt.runtime.backend import lib

    # a grid dimension of zero is invalid for every driver
    status = lib.fmha_launch(handle, 0, 1, 1, entry.threads, 1, 1, 0, 0, backend.ffi.new("char[64]"), 64)
    with pytest.raises(DriverError) as info:
        backend.check(status, "fmha_launch", kernel=entry.key, device=0)
    message = str(info.value)
    assert "cuLaunchKernel" in message or "hipModuleLaunchKernel" in message
    assert "selftest_axpy_f32" in message and "device 0" in message
    assert info.value.error_name and info.value.error_name != "unknown driver error"


def test_cli_selftest_sweep_passes(capsys):
    assert selftest.run_selftest(0) == 0
    table = capsys.readouterr().out
    assert table.count("PASS") == 2 + len(selftest.ATTENTION_CASES) and "FAIL" not in table
