"""Repeated runs of one call for determinism and concurrency tests, each into outputs poisoned with NaN
just before it, on a given stream and from several threads.

`call(outputs, stream)` launches fmha_rt on `stream` (a torch stream), writing into the list `outputs`
(given arrays, never allocated ones: a block torch's allocator recycles may already hold an identical
result). On each stream, in order: a GPU sleep, the poison, the call and a snapshot of the outputs; the
stream first waits for the current stream, where the inputs were written. A launch that misses the call's
stream then leaves NaN or stale values in the snapshot: one on an idle stream runs during the sleep,
before the poison; one on the legacy default stream (or on a stream waiting for it) runs after another
sleep queued there for each run, after the snapshot.
The snapshots are returned after the stream is synchronised: compare them bitwise with a reference run
(gpu_tensors.differing_bits) or with the float64 reference (error_bounds).
"""
import concurrent.futures
import threading

from gpu_presence import require
from gpu_tensors import differing_bits, nan_like

torch = require("torch")

SLEEP_CYCLES = 20_000_000  # about 10 ms at an H100's or H200's clock
HANG_S = 300


def poisoned(specs):
    """NaN-filled outputs of these (shape, dtype) on the current stream."""
    return [nan_like(shape, dtype) for shape, dtype in specs]


def reference_run(call, specs):
    """One run on the current stream, synchronised: the outputs the repeats are compared with."""
    outputs = poisoned(specs)
    call(outputs, torch.cuda.current_stream())
    torch.cuda.synchronize()
    return outputs


def repeat(call, specs, stream, repeats):
    """`repeats` runs on `stream`, each into re-poisoned outputs; their snapshots, once the stream is done."""
    stream.wait_stream(torch.cuda.current_stream())
    snapshots = []
    with torch.cuda.stream(stream):
        outputs = poisoned(specs)
        for _ in range(repeats):
            torch.cuda._sleep(SLEEP_CYCLES)
            with torch.cuda.stream(torch.cuda.default_stream()):
                torch.cuda._sleep(SLEEP_CYCLES)
            for out in outputs:
                out.fill_(float("nan"))
            call(outputs, stream)
            snapshots.append([out.clone() for out in outputs])
    stream.synchronize()
    return snapshots


def repeat_from_threads(call, specs, threads=8, repeats=2):
    """Every thread makes `repeats` runs on its own stream, all threads at once; the snapshots of all."""
    barrier = threading.Barrier(threads, timeout=HANG_S)
    streams = [torch.cuda.Stream() for _ in range(threads)]

    def worker(stream):
        barrier.wait()
        return repeat(call, specs, stream, repeats)

    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        per_thread = list(pool.map(worker, streams, timeout=HANG_S))
    torch.cuda.synchronize()
    return [snapshot for snapshots in per_thread for snapshot in snapshots]


def assert_bitwise(name, snapshots, want):
    """Every snapshot bitwise equal to `want` (a list of tensors), NaN and signed zeros included."""
    counts = [int(differing_bits(snapshot, want)) for snapshot in snapshots]
    assert not any(counts), f"{name}: elements whose bits differ from the reference run, by run: {counts}"
