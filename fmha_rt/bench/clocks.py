"""The SM clock and board power while the benchmark times a point: nvidia-smi sampling in a loop beside it.

Under a long attention kernel an H200 runs at its power limit and below its idle clock (NOTES.md v11:
1825-1843 MHz against 1980, at 646-690 W), and the clock a figure was measured at moves with the kernel,
the temperature and what ran before. A row's `sm_mhz` and `power_w` (and `round_sm_mhz` per round) say
at what clock its figure was taken, so that two figures minutes apart can be told apart from a change in
the kernels. Like the header's probes this tolerates nvidia-smi missing: then there are no samples and no
fields, never an exception.
"""

import statistics
import subprocess
import threading
import time

PERIOD_MS = 50  # nvidia-smi's sampling period; a turn (warm-up of >= 50 ms and its timed calls) spans one or more


def parse_line(line):
    """(SM MHz, power W) from a line of `--query-gpu=clocks.sm,power.draw --format=csv,noheader,nounits`,
    or None for anything else (a header, "[N/A]", an error message)."""
    cells = [cell.strip() for cell in line.split(",")]
    try:
        return float(cells[0]), float(cells[1])
    except (ValueError, IndexError):
        return None


def window_reading(samples, start, end):
    """Medians of the (time, MHz, W) samples taken from `start` to `end` (monotonic seconds); a window
    that no sample fell in takes the first one after its start, up to two periods late; {} if none."""
    inside = [s for s in samples if start <= s[0] <= end]
    if not inside:
        inside = [s for s in samples if start <= s[0] <= end + 2 * PERIOD_MS / 1000][:1]
    if not inside:
        return {}
    return {"sm_mhz": statistics.median(s[1] for s in inside), "power_w": statistics.median(s[2] for s in inside)}


class Sampler:
    """nvidia-smi printing the clock and power of one GPU every PERIOD_MS, read by a daemon thread."""

    def __init__(self, gpu_id, command=None):
        self._samples, self._lock = [], threading.Lock()
        argv = command or ["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits",
                           "-lms", str(PERIOD_MS), "-i", str(gpu_id)]
        try:
            self._proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        except OSError:
            self._proc = None
            return
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        for line in self._proc.stdout:
            reading = parse_line(line)
            if reading is not None:
                with self._lock:
                    self._samples.append((time.monotonic(), *reading))

    def reading(self, start, end):
        """window_reading of the samples so far."""
        with self._lock:  # read in place: the reader thread only appends, under the lock
            return window_reading(self._samples, start, end)

    def close(self):
        if self._proc is None:
            return
        self._proc.terminate()
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._reader.join(timeout=10)


def gpu_id(uuid, index):
    """nvidia-smi's -i for our GPU: its UUID where torch gives one (CUDA and nvidia-smi may number GPUs
    differently), else the index."""
    return f"GPU-{str(uuid).removeprefix('GPU-')}" if uuid else str(index)
