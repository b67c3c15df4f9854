"""The SM clock and board power while the benchmark times a turn: NVML read by a background thread every
PERIOD_S.

Under a long attention kernel an H200 runs at its power limit and below its idle clock (NOTES.md v11:
1825-1843 MHz against 1980, at 646-690 W), and the clock a figure was measured at moves with the kernel,
the temperature and what ran before. A turn's reading is the median of the samples taken while it ran, and
only of those: a turn that no sample fell in has no reading (nothing is borrowed from the next turn). Power
is NVML's instantaneous field (NVML_FI_DEV_POWER_INSTANT), not the one-second average nvmlDeviceGetPowerUsage
gives on recent GPUs; where the driver lacks that field, power is not reported. Without pynvml (the
nvidia-ml-py package) or a driver there are no samples and no fields, never an exception.
"""

import statistics
import threading
import time

PERIOD_S = 0.005     # at most 10 ms between samples, so that a turn of tens of ms holds several
POWER_INSTANT = 186  # NVML_FI_DEV_POWER_INSTANT, in mW


def window_reading(samples, start, end):
    """Medians of the (time, MHz, W or None) samples taken from `start` to `end` (monotonic seconds), or {}
    where none was: {"sm_mhz"} and, where every sample had one, "power_w"."""
    inside = [s for s in samples if start <= s[0] <= end]
    if not inside:
        return {}
    reading = {"sm_mhz": statistics.median(s[1] for s in inside)}
    if all(s[2] is not None for s in inside):
        reading["power_w"] = statistics.median(s[2] for s in inside)
    return reading


class NvmlSource:
    """One GPU's SM clock and instantaneous power through pynvml."""

    def __init__(self, nvml, uuid, index):
        self._nvml = nvml
        nvml.nvmlInit()
        handle = None
        if uuid:
            try:
                handle = nvml.nvmlDeviceGetHandleByUUID(f"GPU-{str(uuid).removeprefix('GPU-')}")
            except nvml.NVMLError:
                handle = None
        self._handle = handle if handle is not None else nvml.nvmlDeviceGetHandleByIndex(index)

    def read(self):
        """(SM MHz, W or None)."""
        nvml = self._nvml
        mhz = float(nvml.nvmlDeviceGetClockInfo(self._handle, nvml.NVML_CLOCK_SM))
        try:
            (field,) = nvml.nvmlDeviceGetFieldValues(self._handle, [POWER_INSTANT])
            watts = field.value.uiVal / 1000.0 if field.nvmlReturn == 0 else None
        except (nvml.NVMLError, AttributeError, TypeError, ValueError):
            watts = None
        return mhz, watts

    def close(self):
        self._nvml.nvmlShutdown()


def nvml_source(uuid, index):
    """An NvmlSource for the GPU with this UUID (or index), or None where pynvml or the driver is missing."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        return NvmlSource(pynvml, uuid, index)
    except Exception:  # pynvml raises NVMLError subclasses (no driver, no such GPU), or OSError on load
        return None


class Sampler:
    """A daemon thread appending (time.monotonic(), MHz, W) from `source` every `period_s` until close()."""

    def __init__(self, source, period_s=PERIOD_S):
        self._samples, self._lock, self._source = [], threading.Lock(), source
        self._stop = threading.Event()
        self._thread = None
        if source is not None:
            self._thread = threading.Thread(target=self._run, args=(period_s,), daemon=True)
            self._thread.start()

    def _run(self, period_s):
        while not self._stop.is_set():
            try:
                mhz, watts = self._source.read()
            except Exception:  # a failed read is a missing sample, not a failed benchmark
                pass
            else:
                with self._lock:
                    self._samples.append((time.monotonic(), mhz, watts))
            self._stop.wait(period_s)

    def reading(self, start, end):
        """window_reading of the samples so far."""
        with self._lock:
            return window_reading(list(self._samples), start, end)

    def close(self):
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join(timeout=10)
        self._source.close()
        self._thread = None
