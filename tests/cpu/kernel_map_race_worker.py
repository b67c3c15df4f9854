"""Run by test_kernel_map_two_devices.py in a process whose libcuda.so.1 is the stand-in driver
(stand_in_driver.c): 32 threads launch one kernel on both devices from a cold (device, kernel) map;
prints what the map and the driver saw, as JSON."""
import ctypes
import json
import threading

from fmha_rt.runtime import backend, kernel_launch
from fmha_rt.runtime.packing import Pointer
from fmha_rt.runtime.registry import registry

THREADS, KERNEL = 32, "selftest_axpy_f32"


def main():
    runtime = backend.runtime()
    entry = registry().entry(runtime.devices[0].arch, KERNEL)
    driver = ctypes.CDLL("libcuda.so.1")  # the library the shim opened: the same counters
    start = threading.Barrier(THREADS)
    errors = []
    args = {"x": Pointer(0x1000), "y": Pointer(0x2000), "out": Pointer(0x3000), "alpha": 2.0, "n": 1}

    def work(device):
        start.wait()
        try:
            kernel_launch.launch(device, entry, (1, 1, 1), args)
        except Exception as exc:  # noqa: BLE001 - reported
            errors.append(repr(exc))

    threads = [threading.Thread(target=work, args=(i % 2,)) for i in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    devices = range(len(runtime.devices))
    print(json.dumps({
        "devices": [(d.ordinal, d.arch) for d in runtime.devices], "errors": errors,
        "map": backend.kernel_map_entries(),
        "handles": sorted((device, key) for device, key in kernel_launch.loaded_handles),
        "distinct_handles": len(set(int(backend.ffi.cast("uintptr_t", h)) for h in kernel_launch.loaded_handles.values())),
        "loads": [driver.stand_in_loads(d) for d in devices], "unloads": [driver.stand_in_unloads(d) for d in devices],
        "launches": [driver.stand_in_launches(d) for d in devices],
        "foreign_launches": driver.stand_in_foreign_launches()}))


if __name__ == "__main__":
    main()
