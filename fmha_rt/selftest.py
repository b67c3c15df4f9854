"""`python -m fmha_rt selftest`: exact checks of the self-test kernels, then (where the FMHA kernels
exist) a small attention sweep against the float64 reference, printed as a pass table."""
from __future__ import annotations

import numpy as np

from .runtime import backend, kernel_launch
from .runtime.registry import registry


class DeviceArray:
    """A float32 device allocation filled from / read back into NumPy: enough for the self-test
    kernels, which must run with no array library installed."""

    def __init__(self, device: int, host: np.ndarray, stream: int = 0):
        self.device, self.shape, self.stream = device, host.shape, stream
        self.device_ptr = backend.mem_alloc(device, host.nbytes, stream)
        backend.copy_to_device(device, self.device_ptr, np.ascontiguousarray(host), stream)

    def numpy(self) -> np.ndarray:
        out = np.empty(self.shape, np.float32)
        backend.copy_to_host(self.device, out, self.device_ptr, self.stream)
        return out

    def free(self):
        backend.mem_free(self.device, self.device_ptr, self.stream)
        backend.synchronize(self.device, self.stream)


def run_strided_copy(device: int, n: int, src_stride: int, dst_stride: int, stream: int = 0, seed: int = 0):
    """Copy every src_stride-th element into every dst_stride-th slot; returns (got, expected)."""
    rng = np.random.default_rng(seed)
    src_host = rng.standard_normal(n * src_stride).astype(np.float32)
    dst_host = np.full(n * dst_stride, np.nan, np.float32)  # poisoned: untouched slots stay NaN
    src, dst = DeviceArray(device, src_host, stream), DeviceArray(device, dst_host, stream)
    entry = registry().entry(backend.device(device).arch, "selftest_strided_copy_f32")
    block = entry.traits["block"]
    kernel_launch.launch(device, entry, ((n + block - 1) // block, 1, 1),
                  dict(src=src, dst=dst, n=n, src_stride=src_stride, dst_stride=dst_stride), stream)
    backend.synchronize(device, stream)
    got = dst.numpy()
    src.free()
    dst.free()
    expected = dst_host.copy()
    expected[::dst_stride] = src_host[::src_stride]
    return got, expected


def run_axpy(device: int, n: int, alpha: float, stream: int = 0, seed: int = 0):
    rng = np.random.default_rng(seed)
    x_host, y_host = (rng.standard_normal(n).astype(np.float32) for _ in range(2))
    x, y, out = (DeviceArray(device, a, stream) for a in (x_host, y_host, np.full(n, np.nan, np.float32)))
    entry = registry().entry(backend.device(device).arch, "selftest_axpy_f32")
    block = entry.traits["block"]
    kernel_launch.launch(device, entry, ((n + block - 1) // block, 1, 1),
                  dict(x=x, y=y, out=out, alpha=alpha, n=n), stream)
    backend.synchronize(device, stream)
    got = out.numpy()
    for a in (x, y, out):
        a.free()
    # The kernel's fused multiply-add rounds once; the product of two float32 values is exact in
    # float64, so the float64 result rounded to float32 differs from it by at most one ulp.
    expected = (np.float64(np.float32(alpha)) * x_host.astype(np.float64) + y_host).astype(np.float32)
    return got, expected


def max_ulp_difference(got: np.ndarray, want: np.ndarray) -> int:
    """Largest distance in float32 units in the last place (NaN anywhere counts as infinitely far)."""
    if np.isnan(got).any() or np.isnan(want).any():
        return 2**31

    def ordered(a):  # float32 bit patterns mapped to integers that count ulps monotonically
        bits = a.astype(np.float32).view(np.int32).astype(np.int64)
        return np.where(bits < 0, -(2**31) - bits, bits)

    return int(np.abs(ordered(got) - ordered(want)).max(initial=0))


def _to_device(device: int, host: np.ndarray):
    from .runtime.buffers import DeviceBuffer

    buf = DeviceBuffer(device, host.shape, {np.float16: "float16", np.float32: "float32"}[host.dtype.type])
    backend.copy_to_device(device, buf.ptr, np.ascontiguousarray(host))
    return buf


def _to_host(device: int, buf, dtype) -> np.ndarray:
    out = np.empty(buf.shape, dtype)
    backend.synchronize(device)
    backend.copy_to_host(device, out, buf.ptr)
    return out


# (name, B, Sq, Sk, Hq, Hk, D, options): small fp16 problems covering the main paths.
ATTENTION_CASES = [
    ("fwd+bwd d64", 2, 128, 128, 2, 2, 64, {}),
    ("fwd+bwd d128 causal", 1, 200, 200, 2, 2, 128, {"causal": True}),
    ("fwd+bwd d64 GQA 4:1", 1, 96, 160, 4, 1, 64, {}),
    ("fwd+bwd d256 causal bottom-right", 1, 64, 100, 2, 2, 256, {"causal": True, "causal_alignment": "bottom_right"}),
    ("fwd+bwd d32 window (16, 16)", 1, 150, 150, 2, 2, 32, {"window": (16, 16)}),
]


def attention_case(device: int, B, Sq, Sk, Hq, Hk, D, options, seed=0) -> float:
    """Largest relative error of out, lse, dq, dk, dv against the float64 reference (fp16 inputs)."""
    from . import api, reference

    rng = np.random.default_rng(seed)
    q, k, v = (rng.standard_normal(shape).astype(np.float16) for shape in ((B, Sq, Hq, D), (B, Sk, Hk, D), (B, Sk, Hk, D)))
    dout = rng.standard_normal((B, Sq, Hq, D)).astype(np.float16)
    qd, kd, vd, dod = (_to_device(device, a) for a in (q, k, v, dout))
    out, lse = api.mha_fwd(qd, kd, vd, **options)
    dq, dk, dv = api.mha_bwd(dod, qd, kd, vd, out, lse, deterministic=True, **options)
    window = list(options.get("window", (-1, -1)))
    if options.get("causal"):
        window[1] = 0
    ref = dict(window=tuple(window), bottom_right=options.get("causal_alignment") == "bottom_right")
    r_out, r_lse = reference.mha_fwd_ref(q, k, v, **ref)
    r_dq, r_dk, r_dv, _ = reference.mha_bwd_ref(dout, q, k, v, **ref)
    pairs = [(out, np.float16, r_out), (lse, np.float32, r_lse), (dq, np.float16, r_dq), (dk, np.float16, r_dk),
             (dv, np.float16, r_dv)]
    return max(reference.rel_err(_to_host(device, got, dt).astype(np.float64), want) for got, dt, want in pairs)


def run_selftest(device: int = 0) -> int:
    rows = []
    got, want = run_strided_copy(device, 100_003, 3, 2)
    rows.append(("strided_copy n=100003 strides 3/2", bool(np.array_equal(got, want, equal_nan=True))))
    got, want = run_axpy(device, 1 << 20, 0.75)
    rows.append(("axpy n=2^20 alpha=0.75", max_ulp_difference(got, want) <= 1))
    for name, B, Sq, Sk, Hq, Hk, D, options in ATTENTION_CASES:
        err = attention_case(device, B, Sq, Sk, Hq, Hk, D, options)
        rows.append((f"{name} (rel err {err:.1e})", bool(err < 1e-2)))
    width = max(len(name) for name, _ in rows)
    for name, ok in rows:
        print(f"{name:<{width}}  {'PASS' if ok else 'FAIL'}")
    return 0 if all(ok for _, ok in rows) else 1
