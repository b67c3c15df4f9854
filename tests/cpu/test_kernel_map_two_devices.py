"""The shim's (device, kernel) map on two devices without two GPUs: a process whose libcuda.so.1 is
the stand-in driver of stand_in_driver.c (two sm_90 devices, slow module loads) races 32 threads to
launch one kernel on both devices from a cold map. The map must end with exactly one entry per device,
the driver must have loaded the module exactly once on each device (and unloaded none), and every
launch must have run its own device's function."""
import json
import os
import shutil
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(os.path.dirname(HERE))


@pytest.fixture(scope="module")
def stand_in_driver_dir(tmp_path_factory):
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.fail("building the stand-in driver needs a C compiler (cc), as building the shim does")
    folder = tmp_path_factory.mktemp("stand_in_driver")
    subprocess.run([compiler, "-shared", "-fPIC", "-O1", "-Wall", "-Werror", "-o", str(folder / "libcuda.so.1"),
                    os.path.join(HERE, "stand_in_driver.c"), "-lpthread"], check=True)
    return folder


def test_threads_racing_on_two_devices_load_each_module_once_per_device(stand_in_driver_dir):
    env = dict(os.environ, LD_LIBRARY_PATH=str(stand_in_driver_dir), FMHA_RT_BACKEND="cuda",
               PYTHONPATH=os.pathsep.join(filter(None, (REPO_ROOT, os.environ.get("PYTHONPATH")))))
    for name in ("FMHA_RT_ASM_DIR", "FMHA_RT_LOG_CONFIG", "CUDA_VISIBLE_DEVICES"):
        env.pop(name, None)
    done = subprocess.run([sys.executable, os.path.join(HERE, "kernel_map_race_worker.py")], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    print(seen)
    assert seen["devices"] == [[0, "sm_90"], [1, "sm_90"]] and seen["errors"] == []
    assert sorted(map(tuple, seen["map"])) == [(0, "selftest_axpy_f32"), (1, "selftest_axpy_f32")]
    assert seen["handles"] == [[0, "selftest_axpy_f32"], [1, "selftest_axpy_f32"]] and seen["distinct_handles"] == 2
    assert seen["loads"] == [1, 1] and seen["unloads"] == [0, 0]
    assert seen["launches"] == [16, 16] and seen["foreign_launches"] == 0
