"""Stress and numerics at the edges, on one GPU.

- 64 threads, each with its own torch stream, make a few thousand mixed calls (forward, deterministic
  backward, varlen, bias, ALiBi, dropout, GQA, several head dims, fp16 and bf16, outputs given or
  allocated, workspace from a callback or not); every result is bitwise the one the same call gave
  when run serially first, and that serial run matches the float64 reference (dropout by the
  independent Philox mask, tests/philox_reference.py). Device memory (torch's, the workspaces fmha_rt keeps,
  and what the driver reports beyond torch's where this process has the GPU to itself) and host memory (peak
  RSS, Python allocations) stay flat over the second half of the calls.
  FMHA_RT_STRESS_CALLS sets the number of calls (default below).
- Scores of magnitude ~1e4 do not overflow and match the float64 reference; NaN and Inf in the inputs
  spread exactly as in the reference, and the calls finish; a 128k-token forward matches float64 on
  sampled rows.
"""
import concurrent.futures
import dataclasses
import gc
import math
import os
import resource
import threading
import tracemalloc

import numpy as np
import pytest

from gpu_presence import require

torch = require("torch")

import fmha_rt
import philox_reference
from error_bounds import LSE_TOL, TOL, assert_close, assert_lse_close
from fmha_rt import reference
from fmha_rt.runtime.backend import ffi, lib
from gpu_tensors import attention_f64, differing_bits, f64, generator, nan_like, rand

THREADS = 64
CALLS = int(os.environ.get("FMHA_RT_STRESS_CALLS", "4096"))
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
DEVICE_SLACK = 32 << 20  # driver-side growth allowed over the second half (allocator rounding)
RSS_SLACK_KB = 64 << 10
TRACED_BYTES_PER_CALL = 64  # Python allocations a call may leave behind, on average, after warm-up
HANG_S = 120


# ------------------------------------------------------------------------------------------ the mix


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    kind: str  # "fwd", "bwd", "varlen_fwd", "varlen_bwd"
    dtype: str
    b: int
    sq: int
    sk: int
    hq: int
    hk: int
    d: int
    dv: int
    opts: tuple = ()  # keyword options as (name, value) pairs
    given_outputs: bool = False  # outputs come from the caller (NaN-poisoned buffers of its own)
    torch_workspace: bool = False  # the backward's workspace comes from a callback (torch memory)


VARLEN_Q, VARLEN_K = (37, 128, 1, 90), (50, 128, 3, 200)
DROPOUT = (("dropout_p", 0.15), ("seed", 2024), ("offset", 96))
CASES = [
    Case("fwd_bf16_d64_causal", "fwd", "bf16", 2, 256, 256, 4, 4, 64, 64, (("causal", True),)),
    Case("fwd_fp16_d128_gqa_window", "fwd", "fp16", 2, 300, 200, 8, 2, 128, 128, (("window", (64, 16)),), True),
    Case("fwd_bf16_d32_mqa_br", "fwd", "bf16", 1, 100, 260, 4, 1, 32, 32,
         (("causal", True), ("causal_alignment", "bottom_right"))),
    Case("fwd_fp16_d256_alibi", "fwd", "fp16", 1, 128, 128, 2, 2, 256, 256, (("alibi", "H"),)),
    Case("fwd_bf16_d64_dropout", "fwd", "bf16", 2, 160, 160, 2, 2, 64, 64, DROPOUT, True),
    Case("fwd_bf16_d192v128_bias", "fwd", "bf16", 1, 128, 192, 2, 2, 192, 128, (("bias", (1, 2)),)),
    Case("bwd_bf16_d64_causal", "bwd", "bf16", 2, 256, 256, 4, 4, 64, 64, (("causal", True),)),
    Case("bwd_fp16_d128_gqa", "bwd", "fp16", 1, 200, 300, 8, 2, 128, 128, (), True, True),
    Case("bwd_bf16_d64_bias_dbias", "bwd", "bf16", 2, 128, 128, 2, 2, 64, 64, (("bias", (2, 1)),), False, True),
    Case("bwd_bf16_d96_dropout_window", "bwd", "bf16", 1, 192, 192, 2, 1, 96, 96,
         DROPOUT + (("window", (40, 40)),), True),
    Case("bwd_fp16_d256v128_alibi_bh", "bwd", "fp16", 2, 96, 96, 2, 2, 256, 128, (("alibi", "BH"),)),
    Case("varlen_fwd_bf16_d64_causal_br", "varlen_fwd", "bf16", 4, 0, 0, 4, 2, 64, 64,
         (("causal", True), ("causal_alignment", "bottom_right")), True),
    Case("varlen_bwd_fp16_d128", "varlen_bwd", "fp16", 4, 0, 0, 4, 2, 128, 128, (), False, True),
    Case("varlen_bwd_bf16_d64_causal", "varlen_bwd", "bf16", 4, 0, 0, 2, 2, 64, 64, (("causal", True),), True),
]


@dataclasses.dataclass
class Prepared:
    """A case's inputs (shared, read-only) and the results of its serial run."""

    case: Case
    args: tuple  # positional arguments
    opts: dict  # keyword options (arrays included)
    output_shapes: dict  # name -> (shape, dtype) of the outputs a caller may give
    expected: tuple = ()


def prepare(case: Case, seed: int) -> Prepared:
    dtype = DTYPES[case.dtype]
    gen = generator(seed)
    opts = {}
    for name, value in case.opts:
        if name == "bias":
            opts["bias"] = rand(value + (case.sq, case.sk), dtype, gen)
        elif name == "alibi":
            shape = (case.hq,) if value == "H" else (case.b, case.hq)
            opts["alibi_slopes"] = torch.rand(shape, generator=gen, device="cuda") * 0.3
        else:
            opts[name] = value
    if case.kind.startswith("varlen"):
        lens_q, lens_k = VARLEN_Q[:case.b], VARLEN_K[:case.b]
        cu_q = torch.tensor([0, *np.cumsum(lens_q)], device="cuda", dtype=torch.int32)
        cu_k = torch.tensor([0, *np.cumsum(lens_k)], device="cuda", dtype=torch.int32)
        rows_q, rows_k = (sum(lens_q),), (sum(lens_k),)
        lse_shape = (case.hq, sum(lens_q))
        varlen = (cu_q, cu_k, max(lens_q), max(lens_k))
    else:
        rows_q, rows_k = (case.b, case.sq), (case.b, case.sk)
        lse_shape = (case.b, case.hq, case.sq)
        varlen = ()
    q = rand(rows_q + (case.hq, case.d), dtype, gen)
    k = rand(rows_k + (case.hk, case.d), dtype, gen)
    v = rand(rows_k + (case.hk, case.dv), dtype, gen)
    out_shape = rows_q + (case.hq, case.dv)
    if case.kind.endswith("fwd"):
        outputs = {"out": (out_shape, dtype), "lse": (lse_shape, torch.float32)}
        return Prepared(case, (q, k, v, *varlen), opts, outputs)
    forward = fmha_rt.mha_varlen_fwd if case.kind.startswith("varlen") else fmha_rt.mha_fwd
    out, lse = forward(q, k, v, *varlen, **opts)
    dout = rand(out_shape, dtype, gen)
    outputs = {"dq": (q.shape, dtype), "dk": (k.shape, dtype), "dv": (v.shape, dtype)}
    if "bias" in opts:
        outputs["dbias"] = (opts["bias"].shape, dtype)
    return Prepared(case, (dout, q, k, v, out, lse, *varlen), opts, outputs)


def torch_workspace(nbytes, zero_init):
    return (torch.zeros if zero_init else torch.empty)(nbytes, dtype=torch.uint8, device="cuda")


def call(p: Prepared, stream, outputs: dict) -> tuple:
    """Run the case once on `stream` (None: the default stream); `outputs` are given outputs or empty."""
    kind = p.case.kind
    function = {"fwd": fmha_rt.mha_fwd, "bwd": fmha_rt.mha_bwd, "varlen_fwd": fmha_rt.mha_varlen_fwd,
                "varlen_bwd": fmha_rt.mha_varlen_bwd}[kind]
    extra = {}
    if kind.endswith("bwd"):
        extra["deterministic"] = True
        if p.case.torch_workspace:
            extra["workspace_alloc"] = torch_workspace
    result = function(*p.args, stream=stream, **p.opts, **outputs, **extra)
    return tuple(result)


def given_outputs(p: Prepared) -> dict:
    if not p.case.given_outputs:
        return {}
    return {name: nan_like(shape, dtype) for name, (shape, dtype) in p.output_shapes.items()}


def reference_outputs(p: Prepared) -> tuple:
    """The float64 reference of a case's outputs, in the order `call` returns them."""
    c, opts = p.case, dict(p.case.opts)
    window = list(opts.get("window", (-1, -1)))
    if opts.get("causal"):
        window[1] = 0
    ref = {"window": tuple(window), "bottom_right": opts.get("causal_alignment") == "bottom_right"}
    if "bias" in p.opts:
        ref["bias"] = f64(p.opts["bias"])
    if "alibi_slopes" in p.opts:
        ref["alibi_slopes"] = f64(p.opts["alibi_slopes"])
    if "dropout_p" in opts:  # batched cases only
        ref["dropout_p"] = opts["dropout_p"]
        ref["dropout_keep"] = philox_reference.keep_mask(opts["seed"], opts["offset"], c.b, c.hq, c.sq, c.sk,
                                                         opts["dropout_p"])
    if c.kind == "fwd":
        return reference.mha_fwd_ref(*(f64(t) for t in p.args), **ref)
    if c.kind == "bwd":
        dout, q, k, v = (f64(t) for t in p.args[:4])
        dq, dk, dv, dbias = reference.mha_bwd_ref(dout, q, k, v, **ref)
        return (dq, dk, dv) + ((dbias,) if "bias" in p.opts else ())
    cu_q, cu_k = (t.cpu().numpy() for t in p.args[-4:-2])
    if c.kind == "varlen_fwd":
        return reference.mha_varlen_fwd_ref(*(f64(t) for t in p.args[:3]), cu_q, cu_k, **ref)
    dout, q, k, v = (f64(t) for t in p.args[:4])
    return reference.mha_varlen_bwd_ref(dout, q, k, v, cu_q, cu_k, **ref)[:3]


def check_serial_run(p: Prepared):
    for name, got, want in zip(p.output_shapes, p.expected, reference_outputs(p), strict=True):
        label = f"{p.case.name}: {name}"
        if name == "lse":
            assert_lse_close(label, got, want)
        else:
            assert_close(label, got, want, head_axis=-3 if name == "dbias" else -2)


@pytest.fixture(scope="module")
def prepared():
    cases = []
    for i, case in enumerate(CASES):
        p = prepare(case, seed=100 + i)
        p.expected = call(p, None, given_outputs(p))
        cases.append(p)
    torch.cuda.synchronize()
    for p in cases:
        check_serial_run(p)
    return cases


def run_round(pool, streams, cases, calls_per_thread, start):
    """Every thread makes `calls_per_thread` calls on its own stream, cycling through the cases from a
    thread-specific point. Returns {case name: elements whose bits differ from the serial run}."""
    barrier = threading.Barrier(len(streams), timeout=HANG_S)

    def worker(t):
        stream = streams[t]
        with torch.cuda.stream(stream):
            buffers = {p.case.name: given_outputs(p) for p in cases}
            bad = {p.case.name: torch.zeros((), dtype=torch.int64, device="cuda") for p in cases}
            barrier.wait()  # every thread's calls at once
            for i in range(calls_per_thread):
                p = cases[(start + t * 5 + i * 7) % len(cases)]
                bad[p.case.name] += differing_bits(call(p, stream, buffers[p.case.name]), p.expected)
            return {name: int(count.item()) for name, count in bad.items()}

    totals = {p.case.name: 0 for p in cases}
    for counts in pool.map(worker, range(len(streams))):
        for name, count in counts.items():
            totals[name] += count
    torch.cuda.synchronize()
    return {name: count for name, count in totals.items() if count}


def device_memory():
    """(torch's allocated bytes, bytes of the workspaces fmha_rt keeps, the GPU's used bytes beyond torch's
    reserve: this process's other device memory where it has the GPU to itself)."""
    gc.collect()
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    count, kept = ffi.new("size_t *"), ffi.new("uint64_t *")
    assert lib.fmha_workspaces_kept(count, kept) == lib.FMHA_OK
    return torch.cuda.memory_allocated(), kept[0], total - free - torch.cuda.memory_reserved()


def sharing_the_gpu() -> bool:
    """Whether other test processes run beside this one (pytest-xdist workers on the same GPU): the GPU's
    used memory then includes theirs, and only this process's own accounts can be compared."""
    return int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1


def traced(snapshot):
    return snapshot.filter_traces((tracemalloc.Filter(False, tracemalloc.__file__),))


def test_64_threads_mixed_calls_bitwise_equal_to_serial_and_memory_flat(prepared):
    per_thread = max(4, CALLS // THREADS)
    half, quarter = per_thread // 2, per_thread // 4
    late = per_thread - half - quarter
    streams = [torch.cuda.Stream() for _ in range(THREADS)]
    with concurrent.futures.ThreadPoolExecutor(THREADS) as pool:
        wrong = run_round(pool, streams, prepared, half, start=0)  # warm-up: every case on every stream
        assert not wrong, f"elements differing from the serial run, by case (first half): {wrong}"
        allocated_mid, kept_mid, outside_torch_mid = device_memory()
        rss_mid = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

        # The second half: a quarter to settle under tracing, then the last quarter between snapshots.
        tracemalloc.start()
        try:
            wrong = run_round(pool, streams, prepared, quarter, start=half)
            gc.collect()
            before = traced(tracemalloc.take_snapshot())
            wrong_late = run_round(pool, streams, prepared, late, start=half + quarter)
            gc.collect()
            after = traced(tracemalloc.take_snapshot())
            tracing_kb = tracemalloc.get_tracemalloc_memory() >> 10
        finally:
            tracemalloc.stop()
        allocated_end, kept_end, outside_torch_end = device_memory()
        rss_end = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

    print(f"\n{THREADS * per_thread} calls on {THREADS} threads over {len(prepared)} cases")
    assert not wrong and not wrong_late, f"elements differing from the serial run (second half): {wrong} {wrong_late}"
    assert allocated_end == allocated_mid, f"torch memory {allocated_mid} -> {allocated_end} bytes"
    # a stream's kept workspace grows to the largest call it has met (not every case met every stream in the
    # first half); a leak would grow it with the number of calls
    assert kept_end - kept_mid <= DEVICE_SLACK, f"fmha_rt's kept workspaces {kept_mid} -> {kept_end} bytes"
    assert sharing_the_gpu() or outside_torch_end - outside_torch_mid <= DEVICE_SLACK, (
        f"device memory outside torch grew {outside_torch_mid} -> {outside_torch_end} bytes")
    # Peak RSS includes what tracemalloc itself held.
    assert rss_end - rss_mid <= RSS_SLACK_KB + tracing_kb, f"peak RSS grew {rss_mid} -> {rss_end} KiB"
    growth = after.compare_to(before, "lineno")
    grown, late_calls = sum(s.size_diff for s in growth), THREADS * late
    assert grown <= TRACED_BYTES_PER_CALL * late_calls + (64 << 10), (
        f"Python allocations grew {grown} bytes over {late_calls} calls; most: " +
        "; ".join(str(s) for s in growth[:5]))


# ------------------------------------------------------------------------------------------ numerics


def finish_within(seconds, fn):
    """fn() followed by a device sync, failing (not hanging) if it takes longer than `seconds`."""
    box = {}

    def target():
        try:
            box["result"] = fn()
            torch.cuda.synchronize()
        except BaseException as exc:  # re-raised below, in the test's thread
            box["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"the call did not finish within {seconds} s"
    if "error" in box:
        raise box["error"]
    return box["result"]


@pytest.mark.parametrize("dtype_name", ["bf16", "fp16"])
def test_scores_of_magnitude_1e4_do_not_overflow(dtype_name):
    """q, k ~ N(0, 100^2): scaled scores have a standard deviation of 1e4 and the softmax is nearly
    one-hot. The forward matches float64 (checked on a slice of batches and heads); the backward
    stays finite and its dV, a plain weighted sum, matches too."""
    dtype = DTYPES[dtype_name]
    B, S, H, D = 2, 512, 4, 64
    gen = generator(31)
    q, k = rand((B, S, H, D), dtype, gen, 100.0), rand((B, S, H, D), dtype, gen, 100.0)
    v, dout = rand((B, S, H, D), dtype, gen), rand((B, S, H, D), dtype, gen)
    out, lse = nan_like((B, S, H, D), dtype), nan_like((B, H, S), torch.float32)
    fmha_rt.mha_fwd(q, k, v, out=out, lse=lse, causal=True)
    dq, dk, dv = fmha_rt.mha_bwd(dout, q, k, v, out, lse, causal=True, deterministic=True)
    sl = (slice(1, 2), slice(None), slice(1, 3))  # batch 1, heads 1 and 2
    ro, rl = reference.mha_fwd_ref(f64(q[sl]), f64(k[sl]), f64(v[sl]), window=(-1, 0))
    assert np.abs(rl).max() > 1e4, "the scores are not as large as intended"
    assert_close("out", out[sl], ro)
    assert_lse_close("lse", lse[1:2, 1:3], rl, tol=1e-5)
    _, _, rdv, _ = reference.mha_bwd_ref(f64(dout[sl]), f64(q[sl]), f64(k[sl]), f64(v[sl]), window=(-1, 0))
    for name, t in (("dq", dq), ("dk", dk), ("dv", dv)):
        assert torch.isfinite(t).all(), f"{name} overflowed"
    assert_close("dv", dv[sl], rdv)


def nan_positions_match(name, got, want):
    got = f64(got)
    assert np.array_equal(np.isnan(got), np.isnan(want)), (
        f"{name}: NaN at {np.argwhere(np.isnan(got))[:4].tolist()}..., reference at "
        f"{np.argwhere(np.isnan(want))[:4].tolist()}...")
    finite = ~np.isnan(want)
    if finite.any():
        assert reference.rel_err(got[finite], want[finite]) < TOL, f"{name}: finite part differs"


@pytest.mark.parametrize("poison", ["nan in q", "inf in k", "nan in v", "nan in dout"])
def test_nan_and_inf_spread_as_in_the_reference(poison):
    """One poisoned element (batch 1, row 70, head 1, column 5), no mask: a NaN in a query row poisons
    that output row; an Inf in a key makes NaN the rows whose score becomes +Inf and leaves the -Inf
    ones finite; a NaN value poisons output column 5 of its head; a NaN output gradient poisons its dQ
    row, all of dK and column 5 of dV of its head. Every other element is finite and matches the
    reference, and every call finishes."""
    B, S, H, D = 2, 192, 2, 64
    gen = generator(41)
    q, k, v, dout = (rand((B, S, H, D), torch.bfloat16, gen) for _ in range(4))
    target = {"nan in q": (q, math.nan), "inf in k": (k, math.inf), "nan in v": (v, math.nan),
              "nan in dout": (dout, math.nan)}[poison]
    target[0][1, 70, 1, 5] = target[1]
    out, lse = finish_within(HANG_S, lambda: fmha_rt.mha_fwd(q, k, v))
    ro, rl = reference.mha_fwd_ref(f64(q), f64(k), f64(v))
    nan_positions_match("out", out, ro)
    lse_got = f64(lse)
    assert np.array_equal(np.isfinite(lse_got), np.isfinite(rl)), "lse: non-finite where the reference is not"
    assert reference.rel_err(lse_got[np.isfinite(rl)], rl[np.isfinite(rl)]) < LSE_TOL
    if poison == "inf in k":
        assert np.isnan(f64(out)).any() and np.isfinite(f64(out)[1, :, 1]).any(), "the case tests nothing"
    if poison != "nan in dout":
        return
    grads = finish_within(HANG_S, lambda: fmha_rt.mha_bwd(dout, q, k, v, out, lse, deterministic=True))
    want = reference.mha_bwd_ref(f64(dout), f64(q), f64(k), f64(v))[:3]
    for name, got, w in zip(("dq", "dk", "dv"), grads, want):
        nan_positions_match(name, got, w)


@pytest.mark.parametrize("causal", [True, False])
def test_long_sequence_128k(causal):
    B, S, Hq, Hk, D = 1, 131072, 4, 2, 128
    gen = generator(51)
    q, k, v = rand((B, S, Hq, D), torch.bfloat16, gen), rand((B, S, Hk, D), torch.bfloat16, gen), \
        rand((B, S, Hk, D), torch.bfloat16, gen)
    out, lse = nan_like((B, S, Hq, D), torch.bfloat16), nan_like((B, Hq, S), torch.float32)
    finish_within(HANG_S, lambda: fmha_rt.mha_fwd(q, k, v, out=out, lse=lse, causal=causal))
    assert not torch.isnan(out).any() and not torch.isnan(lse).any(), "unwritten output elements"
    # a sample of query rows against float64 on exactly those rows
    rows = torch.tensor([0, 1, 127, 128, 4097, 65535, 65536, 100003, S - 1], device="cuda")
    want_out, want_lse = attention_f64(q, k, v, causal=causal, rows=rows)
    assert_close("out (sampled rows)", out[:, rows], want_out)
    assert_lse_close("lse (sampled rows)", lse[:, :, rows], want_lse)
