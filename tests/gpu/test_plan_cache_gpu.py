"""Cached calls on the GPU: a call that hits the plan cache runs through the shim's C replay, so its
results must be bitwise those of the same call planned from scratch, for every path the replay has
(given and allocated outputs, the backward's zeroed workspace, deterministic and atomic dQ, dropout by
value, varlen), with fresh inputs on every call (the cached launches get this call's pointers) and
outputs poisoned before each run. Errors a hit must still raise (overlap, alignment) write nothing.
"""
import pytest

from gpu_presence import require

torch = require("torch")

import fmha_rt
from fmha_rt import call_keys, reference
from gpu_tensors import differing_bits, f64, generator, nan_like, rand

B, S, H, D = 2, 320, 4, 64


def inputs(seed, dtype=torch.bfloat16, d=D):
    gen = generator(seed)
    return [rand((B, S, H, d), dtype, gen) for _ in range(4)]  # q, k, v, dout


def uncached(monkeypatch, call):
    with monkeypatch.context() as m:
        m.setattr(call_keys, "key_request", lambda *_: None)
        return call()


def run(q, k, v, dout, opts, bwd_opts, allocate):
    if allocate:
        out, lse = fmha_rt.mha_fwd(q, k, v, **opts)
        grads = fmha_rt.mha_bwd(dout, q, k, v, out, lse, **opts, **bwd_opts)
    else:
        out, lse = nan_like(q.shape, q.dtype), nan_like((B, H, S), torch.float32)
        fmha_rt.mha_fwd(q, k, v, out=out, lse=lse, **opts)
        grads = tuple(nan_like(t.shape, t.dtype) for t in (q, k, v))
        fmha_rt.mha_bwd(dout, q, k, v, out, lse, dq=grads[0], dk=grads[1], dv=grads[2], **opts, **bwd_opts)
    torch.cuda.synchronize()
    return (out, lse, *grads)


CASES = {
    "causal det given": ({"causal": True}, {"deterministic": True}, False, D),
    "window atomic allocated": ({"window": (64, 16)}, {}, True, D),
    "dropout by value": ({"dropout_p": 0.2, "seed": 11, "offset": 4}, {"deterministic": True}, False, D),
    # padded copies in a scratch buffer (forward) and workspace regions (backward), allocated by the replay
    "head dim 60 det": ({"causal": True}, {"deterministic": True}, False, 60),
}


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_hits_are_bitwise_the_uncached_calls(monkeypatch, case):
    opts, bwd_opts, allocate, d = CASES[case]
    fmha_rt.clear_plan_cache()
    first = inputs(1, d=d)
    run(*first, opts, bwd_opts, allocate)
    run(*first, opts, bwd_opts, allocate)  # the second sighting records
    hits = fmha_rt.plan_cache_info()["hits"]
    for seed in (2, 3, 4):  # fresh inputs: every hit writes its own pointers
        fresh = inputs(seed, d=d)
        got = run(*fresh, opts, bwd_opts, allocate)
        want = uncached(monkeypatch, lambda: run(*fresh, opts, bwd_opts, allocate))
        for name, g, w in zip(("out", "lse", "dq", "dk", "dv"), got, want):
            assert not torch.isnan(g).any(), f"{name}: unwritten elements on a hit"
            if bwd_opts.get("deterministic") or name in ("out", "lse"):
                assert int(differing_bits([g], [w])) == 0, f"{name}: a hit differs from the uncached call"
            else:  # atomic dQ adds in any order: equal up to rounding
                assert reference.rel_err(f64(g), f64(w)) < 1e-3, name
    assert fmha_rt.plan_cache_info()["hits"] == hits + 6


def test_varlen_hits_match_the_reference():
    fmha_rt.clear_plan_cache()
    lengths = (100, 257, 31)
    total = sum(lengths)
    cu = torch.tensor([0, 100, 357, total], dtype=torch.int32, device="cuda")
    for seed in range(3):
        gen = generator(seed)
        q, k, v, dout = (rand((total, H, D), torch.float16, gen) for _ in range(4))
        out, lse = fmha_rt.mha_varlen_fwd(q, k, v, cu, cu, 257, 257, causal=True)
        dq, dk, dv = fmha_rt.mha_varlen_bwd(dout, q, k, v, out, lse, cu, cu, 257, 257, causal=True,
                                            deterministic=True)
        start = 0
        for n in lengths:
            rows = slice(start, start + n)
            one = [f64(t[rows]).reshape(1, n, H, D) for t in (q, k, v, dout)]
            ro, _ = reference.mha_fwd_ref(*one[:3], window=(-1, 0))
            rdq, rdk, rdv, _ = reference.mha_bwd_ref(one[3], *one[:3], window=(-1, 0))
            for name, got, want in (("out", out, ro), ("dq", dq, rdq), ("dk", dk, rdk), ("dv", dv, rdv)):
                err = reference.rel_err(f64(got[rows]).reshape(want.shape), want)
                assert err < 1e-2, f"seed {seed}, sequence of {n}: {name} relative error {err:.2e}"
            start += n
    assert fmha_rt.plan_cache_info()["hits"] == 2  # the third round's two calls (the first sees, the second records)


def test_refused_hits_write_nothing():
    fmha_rt.clear_plan_cache()
    q, k, v, dout = inputs(5)
    out, lse = nan_like(q.shape, q.dtype), nan_like((B, H, S), torch.float32)
    for _ in range(2):
        fmha_rt.mha_fwd(q, k, v, out=out, lse=lse)
    base = torch.full((q.numel() + 8,), 7.0, device="cuda", dtype=q.dtype)
    misaligned = base[4:4 + q.numel()].view(q.shape)  # 8 bytes in, q's shape and strides
    poisoned = nan_like(q.shape, q.dtype)
    with pytest.raises(fmha_rt.FmhaValueError, match="16-byte aligned"):
        fmha_rt.mha_fwd(misaligned, k, v, out=poisoned, lse=lse)
    with pytest.raises(fmha_rt.FmhaValueError, match="output out overlaps q"):
        fmha_rt.mha_fwd(poisoned, k, v, out=poisoned, lse=lse)
    torch.cuda.synchronize()
    assert torch.isnan(poisoned).all(), "a refused hit wrote its output"
    assert fmha_rt.plan_cache_info()["hits"] == 2


def test_two_launch_backward_hits_run_as_one_graph_per_stream_bitwise_the_uncached_calls(monkeypatch):
    """A hit launches its plan as a graph kept per (plan, stream) whose nodes get this call's arguments:
    a backward of two launches (past the one-launch limit) on two streams, fresh inputs every call."""
    from fmha_rt.runtime.backend import ffi, lib

    fmha_rt.clear_plan_cache()
    fmha_rt.release_workspaces()
    shape = (1, 1056, 4, 64)  # 1 * 4 * 1056^2 scores: above SINGLE_MAX_SCORES, so dQ then dK/dV
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]

    def backward(q, k, v, dout, stream):
        grads = tuple(nan_like(t.shape, t.dtype) for t in (q, k, v))
        stream.wait_stream(torch.cuda.current_stream())  # the inputs and the poison were written there
        out, lse = fmha_rt.mha_fwd(q, k, v, causal=True, stream=stream)
        fmha_rt.mha_bwd(dout, q, k, v, out, lse, dq=grads[0], dk=grads[1], dv=grads[2], causal=True,
                        deterministic=True, stream=stream)
        stream.synchronize()
        return grads

    def fresh(seed):
        gen = generator(seed)
        return [rand(shape, torch.bfloat16, gen) for _ in range(4)]

    for _ in range(2):  # seen, then recorded
        backward(*fresh(20), streams[0])
    assert len(fmha_rt.last_launch_info()["kernels"]) == 2
    for seed in range(21, 27):
        args = fresh(seed)
        stream = streams[seed % 2]
        got = backward(*args, stream)
        want = uncached(monkeypatch, lambda: backward(*args, stream))
        for name, g, w in zip(("dq", "dk", "dv"), got, want):
            assert not torch.isnan(g).any() and int(differing_bits([g], [w])) == 0, (
                f"seed {seed}: {name} differs from the uncached call")
    kept = ffi.new("size_t *")
    assert lib.fmha_launch_graphs_kept(kept) == lib.FMHA_OK and kept[0] >= 4  # fwd and bwd, on both streams
    fmha_rt.release_workspaces()
    assert lib.fmha_launch_graphs_kept(kept) == lib.FMHA_OK and kept[0] == 0


def test_cupy_hits_are_described_from_their_attributes_and_match_the_reference():
    """CuPy arrays are keyed from their attributes (describe.c), produced on a CuPy stream other than
    the call's: fresh inputs on every hit, each against float64, every output element written."""
    import numpy as np

    from fmha_rt import arrays
    from fmha_rt.replay import plan_cache
    from fmha_rt.runtime.backend import ffi

    cupy = require("cupy")
    fmha_rt.clear_plan_cache()
    rng = np.random.default_rng(30)
    producer = cupy.cuda.Stream(non_blocking=True)
    shape = (2, 192, 4, 64)
    for call in range(5):
        host = [rng.standard_normal(shape).astype(np.float16) for _ in range(4)]
        with producer:  # CuPy's interface names its current stream: the call's (the default) waits for it
            q, k, v, dout = (cupy.asarray(a) for a in host)
            out = cupy.full(shape, cupy.nan, dtype=cupy.float16)
            lse = cupy.full((2, 4, 192), cupy.nan, dtype=cupy.float32)
            dq, dk, dv = (cupy.full(shape, cupy.nan, dtype=cupy.float16) for _ in range(3))
            fmha_rt.mha_fwd(q, k, v, out=out, lse=lse)
            fmha_rt.mha_bwd(dout, q, k, v, out, lse, dq=dq, dk=dk, dv=dv, deterministic=True)
        cupy.cuda.Device().synchronize()
        ro, rl = reference.mha_fwd_ref(*host[:3])
        rdq, rdk, rdv, _ = reference.mha_bwd_ref(host[3], *host[:3])
        for name, got, want in (("out", out, ro), ("lse", lse, rl), ("dq", dq, rdq), ("dk", dk, rdk), ("dv", dv, rdv)):
            got = cupy.asnumpy(got).astype(np.float64)
            assert not np.isnan(got).any(), f"call {call}: {name} has unwritten elements"
            assert reference.rel_err(got, want) < 1e-2, f"call {call}: {name}"
    assert fmha_rt.plan_cache_info()["hits"] == 6  # calls 2..4 of both functions
    with producer:
        values = plan_cache.value_array(3)
        description, _ = arrays.signatures((q, k, v), ("q", "k", "v"), 0, values, int(ffi.cast("uintptr_t", values)))
    assert isinstance(description, bytes) and description[0] == 3, "keyed as CuPy arrays"
