"""Several GPUs driven from one process.

- Threads on every GPU, each with its own stream, make their first calls at once on a cold kernel map
  (forward and backward, batch and varlen, deterministic or not) and get bitwise the results of the
  same calls made serially on GPU 0; the map then holds each (device, kernel) used exactly once.
- A call runs on its arrays' GPU whatever device the caller has current, and leaves that one current.

Needs two GPUs or more and skips, saying why, on fewer. The race runs in a fresh process (this file
run as a script), so that the C kernel map and the Python handle cache both start empty.
"""
import collections
import concurrent.futures
import dataclasses
import json
import os
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch

import fmha_rt  # noqa: E402
from fmha_rt.runtime import backend
from fmha_rt.plan import portable
from fmha_rt import reference  # noqa: E402
from fmha_rt.errors import FmhaError  # noqa: E402

MIN_GPUS = 2
THREADS_PER_GPU = 8  # two threads per kind of call, so that two threads load the same kernel at once
ROUNDS = 2  # the second round of calls is still concurrent, on a warm map
TOL, LSE_TOL = 1e-2, 1e-3
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Batch calls are causal GQA; varlen calls are GQA over sequences of unequal lengths, q shorter than k
# in some, so that padding and per-sequence offsets matter.
BATCH, SEQLEN, HEADS_Q, HEADS_K, HEAD_DIM = 2, 256, 4, 2, 64
VARLEN_Q, VARLEN_K = (37, 128, 1, 90), (50, 128, 3, 200)
KINDS = [(layout, deterministic) for layout in ("batch", "varlen") for deterministic in (False, True)]
OUTPUTS = ("out", "lse", "dq", "dk", "dv")


def multi_gpu_skip_reason():
    """None where these tests can run, else why they cannot."""
    try:
        rt = backend.runtime()
    except FmhaError as exc:
        return f"needs {MIN_GPUS} or more GPUs; there is no GPU runtime: {exc}"
    if len(rt.devices) < MIN_GPUS:
        return f"needs {MIN_GPUS} or more GPUs; the {rt.backend} runtime ({rt.library}) sees {len(rt.devices)}"
    archs = sorted({d.arch for d in rt.devices})
    if len(archs) > 1:
        return f"needs GPUs of one arch (results are compared bitwise with GPU 0's); found {', '.join(archs)}"
    return None


SKIP_REASON = multi_gpu_skip_reason()
pytestmark = pytest.mark.skipif(SKIP_REASON is not None, reason=str(SKIP_REASON))


@dataclasses.dataclass(frozen=True)
class Task:
    """The calls one thread makes: which GPU, which kind of call, and its own inputs (by seed)."""

    device: int
    thread: int
    layout: str
    deterministic: bool

    @property
    def seed(self):
        return 1000 * self.device + self.thread

    def __str__(self):
        kind = "deterministic" if self.deterministic else "non-deterministic"
        return f"GPU {self.device} thread {self.thread} ({self.layout}, {kind} backward)"


def cumulative(lengths):
    return torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32)


def make_inputs(layout, seed):
    """Fresh random inputs on the CPU: the same seed gives the same values wherever they are copied."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(shape, generator=gen).to(torch.bfloat16)

    if layout == "batch":
        rows_q = rows_k = (BATCH, SEQLEN)
        extra = {}
    else:
        rows_q, rows_k = (sum(VARLEN_Q),), (sum(VARLEN_K),)
        extra = {"cu_seqlens_q": cumulative(VARLEN_Q), "cu_seqlens_k": cumulative(VARLEN_K)}
    return {"q": rand(*rows_q, HEADS_Q, HEAD_DIM), "k": rand(*rows_k, HEADS_K, HEAD_DIM),
            "v": rand(*rows_k, HEADS_K, HEAD_DIM), "dout": rand(*rows_q, HEADS_Q, HEAD_DIM), **extra}


def to_device(inputs, device):
    return {name: t.to(f"cuda:{device}") for name, t in inputs.items()}


def to_host(outputs):
    return {name: t.cpu() for name, t in outputs.items()}


def f64(t):
    return t.to(torch.float64).numpy()


def fwd_bwd(layout, x, deterministic, stream):
    """One forward and one backward on the arrays' GPU and `stream`, into NaN-poisoned outputs.
    Returns the outputs and the (device, kernel) of every launch, as the runtime reports them."""
    q, k, v, dout = x["q"], x["k"], x["v"], x["dout"]
    nan = float("nan")
    out, dq, dk, dv = (torch.full_like(t, nan) for t in (q, q, k, v))
    if layout == "batch":
        forward, backward, varlen, opts = fmha_rt.mha_fwd, fmha_rt.mha_bwd, (), {"causal": True}
        lse_shape = (BATCH, HEADS_Q, SEQLEN)
    else:
        forward, backward, opts = fmha_rt.mha_varlen_fwd, fmha_rt.mha_varlen_bwd, {}
        varlen = (x["cu_seqlens_q"], x["cu_seqlens_k"], max(VARLEN_Q), max(VARLEN_K))
        lse_shape = (HEADS_Q, sum(VARLEN_Q))
    lse = torch.full(lse_shape, nan, dtype=torch.float32, device=q.device)
    launches = []
    forward(q, k, v, *varlen, out=out, lse=lse, stream=stream, **opts)
    launches += launched()
    backward(dout, q, k, v, out, lse, *varlen, deterministic=deterministic, dq=dq, dk=dk, dv=dv, stream=stream,
             **opts)
    launches += launched()
    return dict(zip(OUTPUTS, (out, lse, dq, dk, dv))), launches


def launched():
    info = fmha_rt.last_launch_info()
    return [(info["device"], key) for key in info["kernels"]]


def reference_problems(what, layout, inputs, got):
    """Where `got` (host tensors) is off the float64 reference, as messages."""
    q, k, v, dout = (f64(inputs[name]) for name in ("q", "k", "v", "dout"))
    if layout == "batch":
        ref = dict(window=(-1, 0))
        out, lse = reference.mha_fwd_ref(q, k, v, **ref)
        dq, dk, dv, _ = reference.mha_bwd_ref(dout, q, k, v, **ref)
    else:
        cu = (inputs["cu_seqlens_q"].numpy(), inputs["cu_seqlens_k"].numpy())
        out, lse = reference.mha_varlen_fwd_ref(q, k, v, *cu)
        dq, dk, dv, _ = reference.mha_varlen_bwd_ref(dout, q, k, v, *cu)
    problems = []
    for name, want in zip(OUTPUTS, (out, lse, dq, dk, dv)):
        err = reference.rel_err(f64(got[name]), want)
        tol = LSE_TOL if name == "lse" else TOL
        if not err < tol:
            problems.append(f"{what}: {name} relative error {err:.2e} against the float64 reference (limit {tol})")
    return problems


def bitwise_backward(deterministic, arch):
    """Whether a backward must repeat bit for bit: always when deterministic, otherwise when the arch's
    default dQ strategy is the deterministic one (fp32 atomics would add in a varying order)."""
    return deterministic or portable.DEFAULT_DQ_STRATEGY[arch] == portable.DQ_DETERMINISTIC


def raw_bits(t):
    """The tensor's elements as integers of their width (torch.equal compares values: -0.0 == 0.0)."""
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def mismatches(what, got, want, bitwise_bwd):
    """How `got` differs from `want` (host tensors), as messages: unwritten (NaN) elements, and any
    bit that differs where results must repeat exactly."""
    problems = []
    for name in OUTPUTS:
        g, w = got[name], want[name]
        if torch.isnan(g).any():
            problems.append(f"{what}: {name} has {int(torch.isnan(g).sum())} NaN (unwritten) elements")
        elif name in ("out", "lse") or bitwise_bwd:
            differ = int((raw_bits(g) != raw_bits(w)).sum())
            if differ:
                problems.append(f"{what}: {name} differs bitwise from the run it must repeat in "
                                f"{differ} of {g.numel()} elements")
        else:
            err = reference.rel_err(f64(g), f64(w))
            if not err < TOL:
                problems.append(f"{what}: {name} relative error {err:.2e} against the run it must repeat")
    return problems


def race_worker(task, barrier):
    """One thread: inputs on its GPU, on its own stream, then ROUNDS of calls, the first at the barrier."""
    # torch exports a tensor by DLPack only while the tensor's device is current.
    with torch.cuda.device(task.device):
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            try:
                x = to_device(make_inputs(task.layout, task.seed), task.device)
                stream.synchronize()
            except BaseException:
                barrier.abort()  # the other threads fail at once instead of waiting for this one
                raise
            barrier.wait()
            rounds = [fwd_bwd(task.layout, x, task.deterministic, stream) for _ in range(ROUNDS)]
            stream.synchronize()
            return [(to_host(outputs), launches) for outputs, launches in rounds]


def serial_on_gpu0(task, inputs):
    with torch.cuda.device(0):
        outputs, launches = fwd_bwd(task.layout, to_device(inputs, 0), task.deterministic, stream=None)
        torch.cuda.synchronize(0)
        return to_host(outputs), launches


def race_report():
    """Run in a fresh process: every GPU's threads race, then GPU 0 makes each thread's calls alone.
    Returns, JSON-ready, what the test asserts."""
    map_before = backend.kernel_map_entries()
    devices = len(backend.runtime().devices)
    arch = backend.device(0).arch
    tasks = [Task(d, t, *KINDS[t % len(KINDS)]) for d in range(devices) for t in range(THREADS_PER_GPU)]
    barrier = threading.Barrier(len(tasks), timeout=300)
    with concurrent.futures.ThreadPoolExecutor(len(tasks)) as pool:
        raced = list(pool.map(lambda task: race_worker(task, barrier), tasks))
    problems, used = [], set()
    for task, rounds in zip(tasks, raced):
        inputs = make_inputs(task.layout, task.seed)
        want, launches = serial_on_gpu0(task, inputs)
        used.update(launches)
        problems += reference_problems(f"{task}, serially on GPU 0", task.layout, inputs, want)
        for i, (got, launches) in enumerate(rounds):
            used.update(launches)
            elsewhere = sorted({d for d, _ in launches} - {task.device})
            problems += [f"{task} round {i}: launched on GPU {d}" for d in elsewhere]
            problems += mismatches(f"{task} round {i}", got, want, bitwise_backward(task.deterministic, arch))
    return {"devices": devices, "map_before": map_before, "map": backend.kernel_map_entries(),
            "used": sorted(used), "problems": problems}


def test_threads_on_every_gpu_race_on_a_cold_map_and_match_gpu0_bitwise():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [REPO_ROOT, os.environ.get("PYTHONPATH")])))
    done = subprocess.run([sys.executable, os.path.abspath(__file__)], env=env, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stderr[-6000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["map_before"] == [], "the kernel map of a fresh process must start empty"
    assert not report["problems"], "\n".join(report["problems"][:40])
    entries = [tuple(e) for e in report["map"]]
    repeated = sorted(e for e, n in collections.Counter(entries).items() if n > 1)
    assert not repeated, f"loaded more than once: {repeated}"
    assert set(entries) == {tuple(e) for e in report["used"]}, "the map holds exactly the (device, kernel) pairs used"
    assert {d for d, _ in entries} == set(range(report["devices"])), "every GPU has its kernels loaded"


def test_a_call_runs_on_its_arrays_gpu_and_leaves_the_callers_current_device():
    inputs = make_inputs("batch", seed=7)
    previous = torch.cuda.current_device()
    try:
        torch.cuda.set_device(1)
        x = to_device(inputs, 1)
        want, _ = fwd_bwd("batch", x, True, stream=None)
        torch.cuda.synchronize(1)
        torch.cuda.set_device(0)
        torch.cuda.synchronize(0)
        assert backend.current_device() == 0, "precondition: GPU 0 current at the driver level too"
        got, launches = fwd_bwd("batch", x, True, stream=None)
        current = (torch.cuda.current_device(), backend.current_device())
        torch.cuda.synchronize(1)
    finally:
        torch.cuda.set_device(previous)
    assert current == (0, 0), f"(torch, driver) current device after the call: {current}"
    assert {d for d, _ in launches} == {1}, f"launched on {sorted({d for d, _ in launches})}, the arrays are on GPU 1"
    assert all(got[name].device == torch.device("cuda:1") for name in OUTPUTS)
    got, want = to_host(got), to_host(want)
    problems = mismatches("inputs on GPU 1, GPU 0 current", got, want, bitwise_bwd=True)
    problems += reference_problems("inputs on GPU 1, GPU 1 current", "batch", inputs, want)
    assert not problems, "\n".join(problems)


if __name__ == "__main__":
    print(json.dumps(race_report()))
