"""Outputs fmha_rt allocates for a call on a stream that is not the framework's current one: their
memory must not go to another allocation until the call's kernels are done with it. Each test keeps the
call's stream busy (a GPU sleep queued before the call), frees an output at once, and allocates the same
size on the current stream: the freed block must not come back while the call's stream is still busy.
Values are then checked against the float64 reference, so a block handed out early would show as
overwritten results too.

Each test first makes the same call once and waits for it, so that the call under test finds its kernels
loaded and its plan made: a process's first call loads code objects, which can take longer than the sleep,
and the stream would then be idle again before the output is freed. Each test asserts it is not, right after
allocating in the freed memory's place and before writing there: a process's first launch of a kernel can
wait for every stream (loading its module), and the writes are only the check of what came back."""
import numpy as np

from gpu_presence import require

torch = require("torch")

import fmha_rt
from fmha_rt import reference
from gpu_tensors import f64, generator, rand

SLEEP_CYCLES = 200_000_000  # ~0.1 s at the H200's clock: far longer than the host needs below


def _busy_stream():
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(SLEEP_CYCLES)
    return stream


def _warmed(call, *args, **kwargs):
    """call(*args, **kwargs) once on the current stream, finished: later identical calls are host-cheap."""
    call(*args, **kwargs)
    torch.cuda.synchronize()


def _inputs(seed, b=2, s=256, h=4, d=64, dtype=torch.bfloat16):
    gen = generator(seed)
    return [rand((b, s, h, d), dtype, gen) for _ in range(3)]


def test_torch_outputs_are_tied_to_the_calls_stream():
    q, k, v = _inputs(1)
    _warmed(fmha_rt.mha_fwd, q, k, v, causal=True)
    side = _busy_stream()
    out, lse = fmha_rt.mha_fwd(q, k, v, causal=True, stream=side)
    lse_ptr, lse_shape = lse.data_ptr(), lse.shape
    del lse  # freed while the side stream still sleeps, before the kernel has run
    probe = torch.empty(lse_shape, dtype=torch.float32, device="cuda")  # on the current stream
    assert not side.query(), "the side stream finished its sleep before lse was freed: the test proves nothing"
    probe.fill_(7.0)
    assert probe.data_ptr() != lse_ptr, "lse's memory was handed out while its kernel was still queued"
    side.synchronize()
    torch.cuda.synchronize()
    want, _ = reference.mha_fwd_ref(f64(q), f64(k), f64(v), window=(-1, 0))
    err = np.linalg.norm(f64(out) - want) / np.linalg.norm(want)
    assert err < 1e-2, err
    assert bool((probe == 7.0).all())


def test_a_dropped_lse_does_not_take_memory_from_the_current_stream():
    """return_lse=False: fmha_rt drops the lse it allocated as soon as the launch is queued."""
    q, k, v = _inputs(2)
    _warmed(fmha_rt.mha_fwd, q, k, v, return_lse=False)
    side = _busy_stream()
    out = fmha_rt.mha_fwd(q, k, v, stream=side, return_lse=False)
    b, s, h, _ = q.shape
    probes = [torch.empty((b, h, s), dtype=torch.float32, device="cuda") for _ in range(4)]
    assert not side.query(), "the side stream finished its sleep before the probes were allocated"
    for probe in probes:
        probe.fill_(3.0)
    side.synchronize()
    torch.cuda.synchronize()
    assert all(bool((p == 3.0).all()) for p in probes), "an lse write landed in memory handed out meanwhile"
    want, _ = reference.mha_fwd_ref(f64(q), f64(k), f64(v))
    assert np.linalg.norm(f64(out) - want) / np.linalg.norm(want) < 1e-2


def test_cupy_outputs_are_tied_to_the_calls_stream():
    cupy = require("cupy")
    q, k, v = (cupy.asarray(x) for x in _inputs(3, dtype=torch.float16))  # CuPy has no bfloat16
    _warmed(fmha_rt.mha_fwd, q, k, v)
    side = _busy_stream()
    out, lse = fmha_rt.mha_fwd(q, k, v, stream=side.cuda_stream)
    lse_ptr, lse_shape = lse.data.ptr, lse.shape
    del lse
    probe = cupy.empty(lse_shape, dtype=cupy.float32)  # CuPy's current stream
    assert not side.query(), "the side stream finished its sleep before lse was freed: the test proves nothing"
    probe.fill(5.0)
    assert probe.data.ptr != lse_ptr, "lse's memory was handed out while its kernel was still queued"
    side.synchronize()
    cupy.cuda.Device().synchronize()
    assert bool((probe == 5.0).all())
    want, _ = reference.mha_fwd_ref(*(cupy.asnumpy(x).astype(np.float64) for x in (q, k, v)))
    got = cupy.asnumpy(out).astype(np.float64)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-2
