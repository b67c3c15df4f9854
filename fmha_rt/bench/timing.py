"""How a call is timed, so that no number is flattered by caches, allocation or launch queues.

- Inputs are rotated among enough copies that one sweep through them spans several L2 caches (60 MB
  on an H200): every timed call reads its operands from HBM, as it would inside a model.
- Outputs are allocated once per copy before timing (where the implementation accepts them), so no
  allocator work falls inside the timed region.
- The first call is timed on its own (it includes any JIT compile), then a warm-up of at least
  `warmup_ms` of synchronised calls, then `repeats` calls, each between two CUDA events on the current
  stream; the figure reported is their median.
- The implementations of a point take turns in rounds, the first turn rotating (sweep.turn_order), after
  an untimed warm turn of each; the figure is the median over every round's calls, and each round's
  median is kept for the ratios (versus.py).
- A backward is timed alone: the forward it needs runs once per copy before timing.
- The SM clock and power while each implementation's turn ran are sampled beside it (clocks.py, NVML
  every 5 ms), since at the power limit the clock moves with the kernel and with what ran before.

Device access goes through `CudaDevice`, the few operations the harness needs, so that the logic above
also runs (untimed) in tests on a CPU.
"""

import dataclasses
import json
import math
import os
import statistics
import subprocess
import sys
import time

from . import clocks

DEFAULT_L2_BYTES = 60 * 1024**2
L2_SPAN = 4          # a sweep over all copies touches at least this many L2s' worth of bytes
MIN_COPIES = 2       # never time a copy right after itself: its output would still sit in L2
MAX_COPIES = 64      # tiny problems cannot leave L2 through copies alone; cap the memory spent trying
ELEMENT_BYTES = 2    # fp16 and bf16
LSE_BYTES = 4


@dataclasses.dataclass(frozen=True)
class Timing:
    ms: float
    ms_min: float
    ms_max: float
    repeats: int

    def fields(self):
        return dataclasses.asdict(self)


def summarize(samples_ms):
    """The median and range of per-call times in milliseconds."""
    if not samples_ms:
        raise ValueError("no timing samples")
    return Timing(ms=statistics.median(samples_ms), ms_min=min(samples_ms), ms_max=max(samples_ms),
                  repeats=len(samples_ms))


def working_set_bytes(point):
    """Bytes one call of `point` reads and writes: q, k, v and out (plus dout, dq, dk, dv for a
    backward) in 16-bit floats, and the fp32 LSE."""
    tokens_q = sum(point.seqlens) if point.varlen else point.batch * point.seqlen_q
    tokens_k = sum(point.seqlens) if point.varlen else point.batch * point.seqlen_k
    q_bytes = tokens_q * point.heads_q * point.head_dim * ELEMENT_BYTES
    out_bytes = tokens_q * point.heads_q * point.dv * ELEMENT_BYTES  # out, and dout for a backward
    kv_bytes = tokens_k * point.heads_k * (point.head_dim + point.dv) * ELEMENT_BYTES
    lse_bytes = tokens_q * point.heads_q * LSE_BYTES
    forward = q_bytes + out_bytes + kv_bytes + lse_bytes
    return forward + q_bytes + out_bytes + kv_bytes if point.backward else forward


def copies_needed(bytes_per_copy, l2_bytes=DEFAULT_L2_BYTES):
    """How many input copies to rotate among so that one round spans L2_SPAN caches."""
    if bytes_per_copy <= 0:
        raise ValueError(f"bytes_per_copy must be positive, got {bytes_per_copy}")
    return min(MAX_COPIES, max(MIN_COPIES, math.ceil(L2_SPAN * l2_bytes / bytes_per_copy)))


def first_call(call, device):
    """(wall-clock ms, result) of one synchronised call: the cost a new shape pays, compile included."""
    device.synchronize()
    start = time.perf_counter()
    result = call()
    device.synchronize()
    return (time.perf_counter() - start) * 1e3, result


def first_call_ms(call, device):
    """first_call's milliseconds alone."""
    return first_call(call, device)[0]


def sample_calls(calls, device, *, warmup_ms, repeats):
    """Per-call times in ms of `repeats` calls after a warm-up, cycling through `calls` (one closure
    per input copy)."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    # Synchronising after every warm-up call keeps the wall clock honest about GPU time; at least one
    # round touches every copy, so no copy's first use is timed.
    device.synchronize()
    start = time.perf_counter()
    done = 0
    while done < len(calls) or (time.perf_counter() - start) * 1e3 < warmup_ms:
        calls[done % len(calls)]()
        device.synchronize()
        done += 1
    return device.time_each([calls[i % len(calls)] for i in range(repeats)])


def time_calls(calls, device, *, warmup_ms, repeats):
    """Median time of `repeats` calls after a warm-up (sample_calls)."""
    return summarize(sample_calls(calls, device, warmup_ms=warmup_ms, repeats=repeats))


def host_overhead_us(call, device, *, calls, before_each=None):
    """Wall-clock microseconds per call over `calls` back-to-back calls of a problem too small to
    keep the GPU busy, so the host side (argument checks, packing, launch) is what is measured.
    `before_each` runs before every call, inside the timed loop (clearing a plan cache, say)."""
    call()
    device.synchronize()
    start = time.perf_counter()
    if before_each is None:
        for _ in range(calls):
            call()
    else:
        for _ in range(calls):
            before_each()
            call()
    device.synchronize()
    return (time.perf_counter() - start) / calls * 1e6


def host_us_per_call(call, n: int, batch: int = 0, sync=None) -> float:
    """Wall-clock µs per call over n calls of a cached call. With batch > 0, `sync` (the GPU's) runs
    every `batch` calls outside the timed region, so the launch queue never fills and the figure is the
    host's own time; back to back (batch 0) a call also waits whenever the GPU is slower than the host."""
    batch = batch or n
    spent = 0.0
    for done in range(0, n, batch):
        if sync is not None:
            sync()
        start = time.perf_counter()
        for _ in range(min(batch, n - done)):
            call()
        spent += time.perf_counter() - start
    return spent / n * 1e6


def one_call_us(call, device):
    """Host microseconds of one call (the GPU's work is waited for outside the timed region)."""
    device.synchronize()
    start = time.perf_counter()
    call()
    elapsed = time.perf_counter() - start
    device.synchronize()
    return elapsed * 1e6


READY_MARKER = "FMHA_BENCH_READY "


def spawn_until_ready(code, *, timeout_s):
    """Run `code` in a fresh interpreter and return the seconds from just before the spawn until the
    child reported its first result (a line READY_MARKER + JSON with the wall-clock time "ready"),
    together with the rest of that JSON. Both ends read the same wall clock of this host."""
    env = dict(os.environ)
    # The child must import the same fmha_rt as this process, installed or not.
    package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")]))
    spawned = time.time()
    try:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              timeout=timeout_s, env=env, check=False)
    except subprocess.TimeoutExpired:
        return {"error": f"no result within {timeout_s} s"}
    for line in proc.stdout.splitlines():
        if line.startswith(READY_MARKER):
            report = json.loads(line[len(READY_MARKER):])
            return {"seconds": report.pop("ready") - spawned, **report}
    tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
    return {"error": f"exit status {proc.returncode}: {tail}"}


class CudaDevice:
    """One CUDA (or ROCm) device as torch sees it."""

    def __init__(self, index=0):
        import torch

        self._torch = torch
        self.index = index
        self.name = f"cuda:{index}"
        torch.cuda.set_device(index)
        uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
        self._clocks = clocks.Sampler(clocks.nvml_source(uuid, index))

    def clock_reading(self, start, end):
        """The SM clock and power between two time.monotonic() readings ({} where NVML is absent)."""
        return self._clocks.reading(start, end)

    def stop_clock_sampling(self):
        """End the sampling thread (before measuring host time, which its wake-ups would share)."""
        self._clocks.close()

    def close(self):
        self._clocks.close()

    def synchronize(self):
        self._torch.cuda.synchronize(self.index)

    def l2_bytes(self):
        props = self._torch.cuda.get_device_properties(self.index)
        return getattr(props, "L2_cache_size", 0) or DEFAULT_L2_BYTES

    def time_each(self, calls):
        """Milliseconds of each call, measured by CUDA events around it on the current stream;
        calls are queued back to back so the GPU never waits for the host between them."""
        cuda = self._torch.cuda
        marks = [(cuda.Event(enable_timing=True), cuda.Event(enable_timing=True)) for _ in calls]
        for call, (begin, end) in zip(calls, marks):
            begin.record()
            call()
            end.record()
        self.synchronize()
        return [begin.elapsed_time(end) for begin, end in marks]

    def peak_extra_bytes(self, call):
        """Device memory one call takes beyond what was allocated before it (torch's allocator only:
        memory an implementation allocates outside torch is invisible here)."""
        cuda = self._torch.cuda
        self.synchronize()
        cuda.reset_peak_memory_stats(self.index)
        before = cuda.memory_allocated(self.index)
        call()
        self.synchronize()
        return cuda.max_memory_allocated(self.index) - before

    def release_cached(self):
        """Return torch's cached blocks to the driver between points, so one point's leftovers (or
        an out-of-memory failure's fragments) do not shape the next point's memory figures."""
        self._torch.cuda.empty_cache()

    def healthy(self):
        """False once the context is broken (an illegal address sticks to every later call)."""
        try:
            self.synchronize()
        except RuntimeError:  # torch raises its CUDA errors as RuntimeError (AcceleratorError too)
            return False
        return True
