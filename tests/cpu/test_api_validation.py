"""The bad-input matrix of the public API, on the CPU.

Arrays here are host memory that claims, through DLPack, to live on CUDA device 0 or 1, and the runtime
is a stand-in with two sm_90 devices: validation runs exactly as on a GPU machine, and a call that
passed it would reach the executor, which here fails the test. So each case shows a precise error
raised before any launch, with every output left as it was.
"""
import contextlib
import ctypes
import re

import numpy as np
import pytest

import fmha_rt
from fmha_rt.arrays import Arg
from fmha_rt.call import HostSeqlens
from fmha_rt.validation import resolve_mask
from fmha_rt.runtime import backend, executor
from fmha_rt.plan import portable
from fmha_rt.runtime.dlpack import DLPackExporter
from fmha_rt.errors import FmhaNotImplementedError, FmhaTypeError, FmhaValueError

NP_DTYPES = {"float16": np.float16, "float32": np.float32, "int32": np.int32, "int64": np.int64, "uint8": np.uint8}


class FakeGpuArray(DLPackExporter):
    """Host memory exported as a CUDA array; `strides`/`offset` make views, `read_only` marks it. A new
    buffer is filled with 0xA5 bytes (not zeros, which a stray write could leave unchanged); `untouched`
    compares every byte of the array's span with what it held when made."""

    def __init__(self, shape, dtype="float16", *, device=0, strides=None, offset=0, base=None, read_only=False,
                 device_type="cuda"):
        self.shape, self.dtype, self.strides = tuple(shape), dtype, strides
        itemsize = 2 if dtype in ("float16", "bfloat16") else np.dtype(NP_DTYPES.get(dtype, np.uint8)).itemsize
        span = 1 + sum((n - 1) * s for n, s in zip(shape, strides)) if strides else int(np.prod(shape))
        self.base = base if base is not None else (ctypes.c_char * max(1, (span + offset) * itemsize + 64))()
        start = (ctypes.addressof(self.base) + 15) // 16 * 16  # 16-byte aligned, like a device allocation
        self.ptr = start + offset * itemsize
        self.device = (device_type, device)
        self.read_only = read_only
        self.nbytes = span * itemsize
        if base is None:
            ctypes.memset(self.ptr, 0xA5, self.nbytes)
        self.poison = bytes(ctypes.string_at(self.ptr, self.nbytes))

    def untouched(self):
        return bytes(ctypes.string_at(self.ptr, self.nbytes)) == self.poison

    def view(self, shape, strides, offset=0):
        return FakeGpuArray(shape, self.dtype, strides=strides, offset=offset, base=self.base)


@pytest.fixture(autouse=True)
def fake_runtime(monkeypatch):
    devices = tuple(backend.Device(i, "stand-in", "sm_90", "sm_90", 132, 232448, 2**37) for i in range(2))
    rt = backend.Runtime("cuda", "stand-in", 13000, devices)
    monkeypatch.setattr(backend, "runtime", lambda: rt)
    monkeypatch.setattr(backend, "device_scope", lambda ordinal: contextlib.nullcontext())

    def no_launch(*args, **kwargs):
        raise AssertionError("validation let a bad call reach the launch")

    monkeypatch.setattr(executor, "run", no_launch)


def qkv(B=2, Sq=64, Sk=64, Hq=4, Hk=4, D=64, Dv=None, dtype="float16"):
    return (FakeGpuArray((B, Sq, Hq, D), dtype), FakeGpuArray((B, Sk, Hk, D), dtype),
            FakeGpuArray((B, Sk, Hk, Dv or D), dtype))


def call_fwd(**over):
    q, k, v = over.pop("qkv", None) or qkv()
    return fmha_rt.mha_fwd(q, k, v, **over)


# Each row: (case, what to call, expected exception, message fragment). Counted in test_matrix_size.
def _cases():
    q, k, v = qkv()
    out = FakeGpuArray((2, 64, 4, 64))
    lse = FakeGpuArray((2, 4, 64), "float32")
    rows = [
        ("q not an array", lambda: fmha_rt.mha_fwd([1, 2], k, v), FmhaTypeError, "q"),
        ("q None", lambda: fmha_rt.mha_fwd(None, k, v), FmhaTypeError, "q is required"),
        ("q on the host", lambda: fmha_rt.mha_fwd(np.zeros((2, 64, 4, 64), np.float16), k, v), FmhaValueError, "GPU arrays"),
        ("q fp32", lambda: call_fwd(qkv=qkv(dtype="float32")), FmhaTypeError, "allowed: float16, bfloat16"),
        ("k dtype differs", lambda: fmha_rt.mha_fwd(q, FakeGpuArray(k.shape, "bfloat16"), v), FmhaTypeError, "must match"),
        ("q rank 3", lambda: fmha_rt.mha_fwd(FakeGpuArray((64, 4, 64)), k, v), FmhaValueError, "rank 4"),
        ("batch mismatch", lambda: call_fwd(qkv=(q, FakeGpuArray((3, 64, 4, 64)), FakeGpuArray((3, 64, 4, 64)))),
         FmhaValueError, "disagree"),
        ("k/v seqlen mismatch", lambda: fmha_rt.mha_fwd(q, k, FakeGpuArray((2, 65, 4, 64))), FmhaValueError, "disagree"),
        ("head dim mismatch", lambda: fmha_rt.mha_fwd(q, FakeGpuArray((2, 64, 4, 32)), v), FmhaValueError, "disagree"),
        ("GQA not dividing", lambda: call_fwd(qkv=qkv(Hq=6, Hk=4)), FmhaValueError, "multiple of the kv heads"),
        ("head dim 512", lambda: call_fwd(qkv=qkv(D=512)), FmhaNotImplementedError, "1..256"),
        ("head dim 0", lambda: call_fwd(qkv=qkv(D=0)), FmhaNotImplementedError, "1..256"),
        ("last dim strided", lambda: fmha_rt.mha_fwd(q.view((2, 64, 4, 32), (16384, 256, 64, 2)), k, v),
         FmhaValueError, "contiguous in its last dim"),
        ("on two devices", lambda: fmha_rt.mha_fwd(q, FakeGpuArray(k.shape, device=1), v), FmhaValueError,
         "all arrays of a call must be on one device"),
        ("window not a pair", lambda: call_fwd(window=3), FmhaTypeError, "pair"),
        ("window float", lambda: call_fwd(window=(1.5, 0)), FmhaTypeError, "window[0]"),
        ("window below -1", lambda: call_fwd(window=(-2, 0)), FmhaValueError, "window[0]=-2"),
        ("window bool", lambda: call_fwd(window=(True, 0)), FmhaTypeError, "window[0]"),
        ("causal not bool", lambda: call_fwd(causal=1), FmhaTypeError, "causal must be a bool"),
        ("bad alignment", lambda: call_fwd(causal=True, causal_alignment="middle"), FmhaValueError, "causal_alignment"),
        ("mask_type 7", lambda: call_fwd(mask_type=7), FmhaValueError, "mask_type"),
        ("mask_type and causal", lambda: call_fwd(mask_type=1, causal=True), FmhaValueError, "not both"),
        ("mask_type 0 with window", lambda: call_fwd(mask_type=0, window=(3, 3)), FmhaValueError, "takes no window"),
        ("dropout 1.0", lambda: call_fwd(dropout_p=1.0, seed=1), FmhaValueError, "dropout_p"),
        ("dropout negative", lambda: call_fwd(dropout_p=-0.1, seed=1), FmhaValueError, "dropout_p"),
        ("dropout without seed", lambda: call_fwd(dropout_p=0.1), FmhaValueError, "needs seed"),
        ("dropout negative offset", lambda: call_fwd(dropout_p=0.1, seed=1, offset=-3), FmhaValueError, "offset"),
        ("seed array wrong shape", lambda: call_fwd(dropout_p=0.1, seed=FakeGpuArray((3,), "int64")), FmhaValueError,
         "two int64"),
        ("softmax_scale string", lambda: call_fwd(softmax_scale="0.1"), FmhaTypeError, "softmax_scale"),
        ("unknown keyword", lambda: call_fwd(causual=True), FmhaTypeError, "causual"),
        ("bias wrong shape", lambda: call_fwd(bias=FakeGpuArray((2, 4, 64, 32))), FmhaValueError, "broadcast"),
        ("bias batch 3", lambda: call_fwd(bias=FakeGpuArray((3, 1, 64, 64))), FmhaValueError, "broadcast"),
        ("bias dtype", lambda: call_fwd(bias=FakeGpuArray((1, 1, 64, 64), "float32")), FmhaTypeError, "bias"),
        ("bias and alibi", lambda: call_fwd(bias=FakeGpuArray((1, 1, 64, 64)), alibi_slopes=FakeGpuArray((4,), "float32")),
         FmhaNotImplementedError, "together"),
        ("alibi wrong shape", lambda: call_fwd(alibi_slopes=FakeGpuArray((3,), "float32")), FmhaValueError, "alibi_slopes"),
        ("alibi fp16", lambda: call_fwd(alibi_slopes=FakeGpuArray((4,), "float16")), FmhaTypeError, "alibi_slopes"),
        ("out wrong shape", lambda: fmha_rt.mha_fwd(q, k, v, out=FakeGpuArray((2, 64, 4, 32))), FmhaValueError,
         "out must have shape"),
        ("out wrong dtype", lambda: fmha_rt.mha_fwd(q, k, v, out=FakeGpuArray(out.shape, "bfloat16")), FmhaTypeError, "out"),
        ("out read-only", lambda: fmha_rt.mha_fwd(q, k, v, out=FakeGpuArray(out.shape, read_only=True)), FmhaValueError,
         "read-only"),
        ("out overlaps itself", lambda: fmha_rt.mha_fwd(q, k, v, out=out.view((2, 64, 4, 64), (0, 256, 64, 1))),
         FmhaValueError, "share memory"),
        ("out aliases q", lambda: fmha_rt.mha_fwd(q, k, v, out=q), FmhaValueError, "overlaps q"),
        ("out overlaps v", lambda: fmha_rt.mha_fwd(q, k, v, out=v.view((2, 64, 4, 64), (16384, 256, 64, 1), offset=8)),
         FmhaValueError, "overlaps v"),
        ("lse wrong shape", lambda: fmha_rt.mha_fwd(q, k, v, lse=FakeGpuArray((2, 64, 4), "float32")), FmhaValueError, "lse"),
        ("lse fp16", lambda: fmha_rt.mha_fwd(q, k, v, lse=FakeGpuArray((2, 4, 64))), FmhaTypeError, "lse"),
        ("bwd lse shape", lambda: fmha_rt.mha_bwd(FakeGpuArray(out.shape), q, k, v, out, FakeGpuArray((2, 64), "float32")),
         FmhaValueError, "lse"),
        ("bwd dout shape", lambda: fmha_rt.mha_bwd(FakeGpuArray((2, 64, 4, 32)), q, k, v, out, lse), FmhaValueError, "dout"),
        ("bwd dq aliases dout", lambda: _bwd_alias(q, k, v, out, lse), FmhaValueError, "overlaps"),
        ("bwd deterministic int", lambda: fmha_rt.mha_bwd(FakeGpuArray(out.shape), q, k, v, out, lse, deterministic=1),
         FmhaTypeError, "deterministic"),
        ("bwd workspace callback raises", lambda: _bwd_ws(lambda n, z: 1 / 0), FmhaValueError,
         "workspace_alloc"),
        ("bwd workspace too small", lambda: _bwd_ws(lambda n, z: FakeGpuArray((8,), "uint8")),
         FmhaValueError, "bytes"),
        ("bwd workspace on another device", lambda: _bwd_ws(lambda n, z: FakeGpuArray((n,), "uint8", device=1)),
         FmhaValueError, "GPU 1"),
        ("varlen cu_seqlens int64", lambda: _varlen(cu_dtype="int64"), FmhaTypeError, "cu_seqlens_q"),
        ("varlen cu_seqlens half on host", lambda: _varlen(cu_host=True), FmhaValueError, "all as NumPy arrays"),
        ("varlen host cu_seqlens decreasing", lambda: _host_varlen([0, 40, 30], [0, 30, 90]), FmhaValueError,
         "non-decreasing"),
        ("varlen host cu_seqlens beyond q", lambda: _host_varlen([0, 31, 71], [0, 30, 90]), FmhaValueError,
         "beyond the 70 rows of q"),
        ("varlen host sequence over max_seqlen", lambda: _host_varlen([0, 10, 70], [0, 30, 90]), FmhaValueError,
         "more than max_seqlen_q=40"),
        ("varlen host cu_seqlens 2-D", lambda: _host_varlen([[0, 30, 70]], [0, 30, 90]), FmhaTypeError, "1-D integer"),
        ("varlen host cu_seqlens float", lambda: _host_varlen([0.0, 30, 70], [0, 30, 90]), FmhaTypeError, "integer"),
        ("varlen host seqstart past k", lambda: _host_varlen([0, 30, 70], [0, 30, 90], ([0, 30, 70], [0, 40, 60])),
         FmhaValueError, "seqstart_k reach row 100"),
        ("varlen cu_seqlens lengths differ", lambda: _varlen(cu_k_len=4), FmhaValueError, "B + 1"),
        ("varlen max_seqlen negative", lambda: _varlen(max_q=-1), FmhaValueError, "max_seqlen_q"),
        ("varlen max_seqlen float", lambda: _varlen(max_q=3.0), FmhaValueError, "max_seqlen_q"),
        ("varlen seqstart alone", lambda: _varlen(seqstart_q=FakeGpuArray((3,), "int32")), FmhaValueError, "together"),
        ("varlen rank 4", lambda: fmha_rt.mha_varlen_fwd(q, k, v, FakeGpuArray((3,), "int32"), FakeGpuArray((3,), "int32"),
                                                          64, 64), FmhaValueError, "rank 3"),
    ]
    return rows


def _bwd_alias(q, k, v, out, lse):
    dout = FakeGpuArray(out.shape)
    return fmha_rt.mha_bwd(dout, q, k, v, out, lse, dq=dout)


def _bwd_ws(alloc):
    """A backward with workspace_alloc on a problem past SINGLE_MAX_SCORES: the one-launch backward of
    smaller ones needs no workspace and never calls it."""
    q, k, v = qkv(B=1, Sq=1024, Sk=1024)
    assert 4 * 1024 * 1024 > portable.SINGLE_MAX_SCORES
    out, lse = FakeGpuArray(q.shape), FakeGpuArray((1, 4, 1024), "float32")
    return fmha_rt.mha_bwd(FakeGpuArray(out.shape), q, k, v, out, lse, dq=FakeGpuArray(q.shape),
                           dk=FakeGpuArray(k.shape), dv=FakeGpuArray(v.shape), workspace_alloc=alloc)


def _varlen(cu_dtype="int32", cu_host=False, cu_k_len=3, max_q=40, seqstart_q=None):
    q, k, v = FakeGpuArray((70, 4, 64)), FakeGpuArray((90, 2, 64)), FakeGpuArray((90, 2, 64))
    cu_q = np.array([0, 30, 70], np.int32) if cu_host else FakeGpuArray((3,), cu_dtype)
    cu_k = FakeGpuArray((cu_k_len,), "int32")
    return fmha_rt.mha_varlen_fwd(q, k, v, cu_q, cu_k, max_q, 60, seqstart_q=seqstart_q)


def _host_varlen(cu_q, cu_k, seqstarts=None):
    q, k, v = FakeGpuArray((70, 4, 64)), FakeGpuArray((90, 2, 64)), FakeGpuArray((90, 2, 64))
    starts = {} if seqstarts is None else {"seqstart_q": np.array(seqstarts[0]), "seqstart_k": np.array(seqstarts[1])}
    return fmha_rt.mha_varlen_fwd(q, k, v, np.array(cu_q), np.array(cu_k), 40, 60, **starts)


CASES = _cases()


def test_matrix_size():
    print(f"bad-input cases: {len(CASES)}")
    assert len(CASES) >= 55


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input_raises_precisely_before_any_launch(case):
    name, call, error, fragment = case
    with pytest.raises(error) as info:
        call()
    assert fragment in str(info.value), f"{name}: {info.value}"


def _grads():
    return FakeGpuArray((2, 64, 4, 64)), FakeGpuArray((2, 64, 4, 64)), FakeGpuArray((2, 64, 4, 64))


LATE_ERRORS = {
    # name: (call(q, k, v, out, lse, grads), error, message fragment); each fails after some outputs passed
    "bad window": (lambda q, k, v, out, lse, g: fmha_rt.mha_fwd(q, k, v, out=out, lse=lse, window=(-5, 0)),
                   FmhaValueError, "window"),
    "lse dtype": (lambda q, k, v, out, lse, g: fmha_rt.mha_fwd(
        q, k, v, out=out, lse=FakeGpuArray((2, 4, 64), "float16")), FmhaTypeError, "lse has dtype float16"),
    "out overlaps q": (lambda q, k, v, out, lse, g: fmha_rt.mha_fwd(q, k, v, out=q, lse=lse), FmhaValueError,
                       "overlaps q"),
    "dv dtype": (lambda q, k, v, out, lse, g: fmha_rt.mha_bwd(
        q, q, k, v, out, lse, dq=g[0], dk=g[1], dv=FakeGpuArray((2, 64, 4, 64), "float32")), FmhaTypeError,
        "dv has dtype float32"),
    "dbias shape": (lambda q, k, v, out, lse, g: fmha_rt.mha_bwd(
        q, q, k, v, out, lse, dq=g[0], dk=g[1], dv=g[2], bias=FakeGpuArray((1, 1, 64, 64)),
        dbias=FakeGpuArray((1, 1, 64, 32))), FmhaValueError, "dbias must have shape (1, 1, 64, 64)"),
}


@pytest.mark.parametrize("name", LATE_ERRORS)
def test_outputs_given_are_untouched_after_an_error(name):
    """Every byte of every given array (inputs too) is as it was, and the error is the precise one, not
    the stand-in launch's: it was raised before any launch."""
    call, error, fragment = LATE_ERRORS[name]
    q, k, v = qkv()
    out, lse = FakeGpuArray((2, 64, 4, 64)), FakeGpuArray((2, 4, 64), "float32")
    grads = _grads()
    with pytest.raises(error, match=re.escape(fragment)):
        call(q, k, v, out, lse, grads)
    for array in (q, k, v, out, lse, *grads):
        assert array.untouched()


def test_a_valid_call_reaches_the_launch_with_a_complete_plan(monkeypatch):
    """The other side of the matrix: a good call passes validation and plans every launch."""
    seen = []
    monkeypatch.setattr(executor, "run", lambda device, arch, launches, stream, **_: seen.append((device, arch, launches)))
    q, k, v = qkv(Hq=8, Hk=2)
    fmha_rt.mha_fwd(q, k, v, out=FakeGpuArray((2, 64, 8, 64)), lse=FakeGpuArray((2, 8, 64), "float32"), causal=True)
    (device, arch, launches), = seen
    assert (device, arch) == (0, "sm_90")
    assert [launch.variant for launch in launches] == ["fmha_fwd_fp16_d64_nobias_nodrop"]
    assert launches[0].args["kv_group_size"] == 4 and launches[0].args["window_right"] == 0


def test_workspace_sizes_match_hand_computed_values(monkeypatch):
    """delta and lse2 are fp32 [B, Hq, ceil8(Sq)], each rounded up to 256 bytes; the two-kernel dQ needs
    nothing more. The one-launch backward (small problems) keeps Delta and Lse2 in its programs and
    needs no workspace at all, unless a bias gradient asks for dS."""
    q, k, v = qkv(B=3, Sq=100, Sk=64, Hq=4, Hk=4)
    bias = FakeGpuArray((1, 1, 100, 64))
    ds_bytes = 3 * 4 * 100 * 64 * 4  # dS, fp32 [B, Hq, Sq, ceil8(Sk)], zeroed
    assert 3 * 4 * 100 * 64 <= portable.SINGLE_MAX_SCORES
    assert fmha_rt.bwd_workspace_bytes(q, k, v) == 0
    assert fmha_rt.bwd_workspace_bytes(q, k, v, deterministic=True) == 0
    monkeypatch.setattr(portable, "SINGLE_MAX_SCORES", -1)  # the two-kernel backward
    assert fmha_rt.bwd_workspace_bytes(q, k, v) == 2 * -(-3 * 4 * 104 * 4 // 256) * 256 == 10240
    assert fmha_rt.bwd_workspace_bytes(q, k, v, deterministic=True) == 10240  # dQ by programs of its own
    # deterministic with the ORDERED strategy switched on: its fp32 dQ [B, Sq, Hq, 64] and int32 counters, one
    # per (batch entry, query head, query block of the 32-row sm_90 dK/dV tile) and one, rounded up to 256 bytes
    monkeypatch.setattr(portable, "ORDERED_FOR_DETERMINISTIC", frozenset({"sm_90"}))
    dq_acc = 3 * 100 * 4 * 64 * 4
    assert 4 * (1 + 3 * 4 * 4) <= 256
    assert fmha_rt.bwd_workspace_bytes(q, k, v, deterministic=True) == 10240 + dq_acc + 256
    # a tensor bias with gradient adds dS (the one-launch backward takes no bias)
    assert fmha_rt.bwd_workspace_bytes(q, k, v, bias=bias) == 10240 + ds_bytes


@pytest.mark.parametrize("mask_type,causal,window,alignment,expected", [
    (None, False, (-1, -1), "top_left", (-1, -1, False)),
    (None, True, (-1, -1), "top_left", (-1, 0, False)),
    (None, True, (128, -1), "bottom_right", (128, 0, True)),
    (0, False, (-1, -1), "top_left", (-1, -1, False)),
    (1, False, (-1, -1), "bottom_right", (-1, 0, False)),
    (2, False, (-1, -1), "top_left", (-1, 0, True)),
    (3, False, (64, 16), "bottom_right", (64, 16, True)),
])
def test_mask_resolution(mask_type, causal, window, alignment, expected):
    m = resolve_mask(causal, window, mask_type, alignment)
    assert (m.window_left, m.window_right, m.bottom_right) == expected


def test_host_cu_seqlens_are_checked_then_uploaded(monkeypatch):
    uploaded, seen = {}, []

    def upload(self, name, device, stream):
        uploaded[name] = self.arrays[name].copy()
        return Arg(name, FakeGpuArray(self.arrays[name].shape, "int32"), stream)

    monkeypatch.setattr(HostSeqlens, "upload", upload)
    monkeypatch.setattr(executor, "run", lambda device, arch, launches, stream, **_: seen.append(launches))
    q, k, v = FakeGpuArray((70, 4, 64)), FakeGpuArray((90, 2, 64)), FakeGpuArray((90, 2, 64))
    fmha_rt.mha_varlen_fwd(q, k, v, np.array([0, 30, 70], np.int64), np.array([0, 30, 90]), 40, 60,
                           out=FakeGpuArray((70, 4, 64)), lse=FakeGpuArray((4, 70), "float32"))
    assert uploaded["cu_seqlens_q"].dtype == np.int32 and uploaded["cu_seqlens_q"].tolist() == [0, 30, 70]
    assert seen and seen[0][0].args["is_varlen"] == 1
