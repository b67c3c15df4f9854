"""Property-based fuzzing of the public API's argument validation, on the CPU.

Arrays are host memory exported by DLPack as CUDA arrays and the runtime is a stand-in with two sm_90
devices (tests/cpu/fake_gpu.py), as in test_api_validation.py. Hypothesis draws calls of mha_fwd, mha_bwd,
mha_varlen_fwd and mha_varlen_bwd: shapes, dtypes, strides, offsets, devices and every option, mostly
valid with a few things wrong. The property, for every call:

- either it passes validation and reaches the executor, and then every launch's arguments pack into
  the typed layout of that kernel's sm_90 entry in the shipped manifest (and its grid is launchable);
- or it raises an FmhaError subclass (never another exception) and every output it was given still
  holds its bytes.

The executor here packs and checks instead of launching; its alignment check may refuse a call, as the
real one does before any launch. Shapes no host could hold (2**31 rows, 65536 heads, strides near the
i32 limit) use arrays that are bare addresses: nothing here ever touches their memory.
FMHA_RT_FUZZ_EXAMPLES scales the examples per function (default below).
"""
import collections
import gc
import math
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import fmha_rt
from fmha_rt.runtime import executor, kernel_launch
from fmha_rt.runtime import registry as registry_module
from fmha_rt.errors import FmhaError
from fmha_rt.runtime.packing import Pointer
from fmha_rt.plan.args import MAX_GRID_YZ

from fake_gpu import FakeGpuArray, StandInRuntime

EXAMPLES = int(os.environ.get("FMHA_RT_FUZZ_EXAMPLES", "500"))
# No shrinking unless asked (FMHA_RT_FUZZ_SHRINK=1): with a hundred draws per call it takes minutes, and
# the failing call's draws are printed either way.
PHASES = tuple(Phase) if os.environ.get("FMHA_RT_FUZZ_SHRINK") == "1" else (Phase.explicit, Phase.generate)
FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True, phases=PHASES,
                suppress_health_check=list(HealthCheck))
ARCH = "sm_90"
ATTN_DTYPES = ("float16", "bfloat16")
WRONG_DTYPES = ("float32", "int32", "uint8", "float64")
HEAD_DIMS = [(8, 8), (32, 32), (40, 40), (64, 64), (72, 72), (96, 96), (128, 128), (160, 160), (192, 128),
             (256, 256), (64, 32), (32, 256)]
BAD_HEAD_DIMS = [(12, 12), (264, 264), (256, 260), (0, 0)]
# Values at the edges of the kernels' i32/i64 slots and the grid limits.
EDGE_INTS = [2**31 - 1, 2**31, 2**32, 2**63 - 1, 2**63, 2**64, 2**70]
HUGE_ROWS = [2**31 - 1, 2**31, 2**31 + 7, 2**24]
HUGE_COUNTS = [MAX_GRID_YZ, MAX_GRID_YZ + 1, 2**20]
HUGE_STRIDES = [2**31 - 8, 2**31, 2**31 + 8, 2**40]


@pytest.fixture(scope="module", autouse=True)
def shipped_manifest():
    """The registry the executor would use: the checkout's hsa/ (the shipped manifest)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("FMHA_RT_ASM_DIR", raising=False)
        registry_module.reset()
        reg = registry_module.registry()
        assert reg.root.resolve() == registry_module.PACKAGE_DIR.parent.joinpath("hsa").resolve()
        assert reg.kernels_for(ARCH), "the manifest ships no sm_90 kernels"
        yield reg
    registry_module.reset()


class CheckingExecutor:
    """Stands in for executor.run: every launch must name a kernel the manifest ships for sm_90, pack into
    its typed layout and have a grid the driver accepts; then the executor's own alignment check runs,
    which may refuse the call (the real executor does so before its first launch)."""

    def __init__(self):
        self.calls = []
        self.aligning = False  # inside the alignment check: a refusal there is the executor's

    def __call__(self, device, arch, launches, stream, before_launch=None):
        assert arch == ARCH and device in (0, 1)
        reg = registry_module.registry()
        checked = []
        for launch in launches:
            try:
                entry = reg.entry(arch, launch.variant)
            except FmhaError as exc:
                raise AssertionError(f"a validated call plans a kernel the manifest lacks: {exc}") from None
            args = kernel_launch.with_scratch(launch.args)
            try:
                entry.packer.pack(args)
            except FmhaError as exc:
                raise AssertionError(f"validation let through an argument that does not fit {launch.variant}'s "
                                     f"layout: {exc}") from None
            grid = launch.grid
            assert (all(type(g) is int for g in grid) and 1 <= grid[0] < 2**31
                    and all(1 <= g <= MAX_GRID_YZ for g in grid[1:])), f"{launch.variant}: grid {grid} cannot launch"
            checked.append((entry, args))
        self.aligning = True
        for entry, args in checked:
            executor.check_alignment(entry, args)
        self.aligning = False
        if before_launch is not None:  # as the executor: only after every launch is checked
            before_launch()
        self.calls.append([launch.variant for launch in launches])
        return self.calls[-1]


@pytest.fixture
def harness(monkeypatch):
    rt = StandInRuntime(monkeypatch)
    exe = CheckingExecutor()
    monkeypatch.setattr(executor, "run", exe)
    return rt, exe


# ------------------------------------------------------------------------------------------- drawing


class Draw:
    """Draws the arrays and options of one call.

    `maybe(p, what)` includes an optional part with probability p; `spoil(p, what)` breaks a part with
    probability p times the call's wildness, which is 0 for half the calls (valid then, but for chance
    clashes). In `huge` mode arrays are bare addresses, far apart so that their spans do not overlap,
    and one size or stride sits at a slot or grid limit."""

    def __init__(self, data, rt):
        self.data, self.rt = data, rt
        self.wildness = data.draw(st.sampled_from([0, 0, 0, 0.5, 1, 2]), label="wildness")
        self.huge = data.draw(st.integers(0, 99), label="huge") < 12
        self.outputs = []  # given outputs with memory behind them: they must come back untouched
        self.address = 0

    def __call__(self, strategy, label=None):
        return self.data.draw(strategy, label=label)

    def maybe(self, p, what):
        return self(st.integers(0, 99).map(lambda x: x < p * 100), label=what + "?")

    def spoil(self, p, what):
        chance = p * self.wildness * 100
        return chance > 0 and self(st.integers(0, 99).map(lambda x: x < chance), label=what + "?")

    def bare_address(self, offset_bytes=0):
        self.address += 1 << 48
        return self.address + offset_bytes

    def array(self, name, shape, dtype, *, output=False):
        """An array of `shape`: valid in some layout (dims permuted in memory, padded, offset), or broken:
        wrong dtype, strided last dim, negative, zero or unaligned strides, misaligned start, another
        device, host memory, read-only output."""
        shape = tuple(shape)
        if self.spoil(0.03, f"{name}: wrong dtype"):
            dtype = self(st.sampled_from(WRONG_DTYPES + ATTN_DTYPES), label=f"{name} dtype")
        rank = len(shape)
        order = list(range(rank - 1))
        if rank > 1 and self.maybe(0.3, f"{name}: dims permuted"):
            order = list(self(st.permutations(order), label=f"{name} order"))
        pads = [self(st.sampled_from([0, 0, 0, 8, 16]), label=f"{name} pad") for _ in range(rank)]
        if self.spoil(0.04, f"{name}: unaligned pad"):
            pads[self(st.integers(0, rank - 1))] = self(st.sampled_from([1, 3, 5]), label=f"{name} odd pad")
        strides = [0] * rank
        step = 1
        for dim in [rank - 1] + order[::-1]:  # innermost first
            strides[dim] = step
            step *= shape[dim] + pads[dim]
        strides[-1] = 1
        if self.huge and rank > 1 and self.maybe(0.4, f"{name}: huge stride"):
            strides[self(st.integers(0, rank - 2))] = self(st.sampled_from(HUGE_STRIDES), label=f"{name} stride")
        offset = self(st.sampled_from([0, 0, 0, 8, 64]), label=f"{name} offset")
        defect = None
        if self.spoil(0.06, f"{name}: defect"):
            defect = self(st.sampled_from(["last strided", "negative", "zero", "misaligned", "other device", "host",
                                           "read-only"]), label=f"{name} defect")
        if defect == "last strided" and rank:
            strides[-1] = 2
        elif defect == "negative" and rank > 1:
            strides[0] = -max(strides[0], 1)
        elif defect == "zero" and rank > 1:
            strides[0] = 0
        elif defect == "misaligned":
            offset = self(st.sampled_from([1, 3, 5]))
        kwargs = dict(strides=tuple(strides), device=1 if defect == "other device" else 0,
                      device_type="cpu" if defect == "host" else "cuda", read_only=output and defect == "read-only")
        if self.huge or defect == "negative":
            return FakeGpuArray(shape, dtype, address=self.bare_address(offset * 2), **kwargs)
        array = FakeGpuArray(shape, dtype, offset=offset, **kwargs)
        if output:
            self.outputs.append((name, array))
        return array

    def argument(self, name, shape, dtype, *, output=False, optional=False):
        """The array (None half the time for an optional output: the runtime allocates it, which fails for
        most huge shapes, so those are given more often), or broken: a wrong shape, or not an array."""
        if optional and self.maybe(0.2 if self.huge else 0.5, f"{name}: not given"):
            return None
        if self.spoil(0.05, f"{name}: not an array"):
            return self(st.sampled_from([[1, 2], 3.0, "q", (), None]), label=f"{name} not an array")
        if self.spoil(0.05, f"{name}: wrong shape") and shape:
            shape = list(shape)
            shape[self(st.integers(0, len(shape) - 1))] += self(st.sampled_from([1, -1, 8]))
            shape = [max(n, 0) for n in shape]
        return self.array(name, shape, dtype, output=output)

    def sizes(self, varlen):
        """(B, Sq, Sk, Hq, Hk, Dqk, Dv); in huge mode one of them at a limit."""
        b = self(st.integers(1, 3), label="B")
        hk = self(st.integers(1, 3), label="Hk")
        hq = hk * self(st.sampled_from([1, 2, 3]), label="group")
        if self.spoil(0.1, "heads not a multiple"):
            hq = self(st.integers(1, 7), label="Hq (any)")
        dqk, dv = self.value("head dims", st.sampled_from(HEAD_DIMS), odd=BAD_HEAD_DIMS, p_odd=0.06)
        limit = 40 if self.huge or dqk * hq > 512 else 130
        sq, sk = (self.value(name, st.integers(2, limit), edge=[0, 1]) for name in ("Sq", "Sk"))
        if self.huge:
            which = self(st.sampled_from(["Sq", "Sk", "Hq", "B", "strides"]), label="at the limit")
            dqk, dv = min(dqk, 64), min(dv, 64)
            if which in ("Sq", "Sk") and not varlen:  # varlen takes its limits in max_seqlen
                value = self(st.sampled_from(HUGE_ROWS))
                sq, sk = (value, sk) if which == "Sq" else (sq, value)
            elif which == "Hq":
                hq = self(st.sampled_from(HUGE_COUNTS))
                hk = self(st.sampled_from([1, hq]))
            elif which == "B":
                b = self(st.sampled_from(HUGE_COUNTS))
        return b, sq, sk, hq, hk, dqk, dv

    def value(self, name, good, odd=None, edge=None, p_odd=0.2, p_edge=0.1):
        """A value for option `name`: from `good`, sometimes from `edge` (the right kind, at a limit) or,
        when spoiling, from `odd`."""
        if odd is not None and self.spoil(p_odd, f"{name} odd"):
            return self(st.sampled_from(odd), label=name)
        if edge is not None and self.maybe(p_edge, f"{name} at a limit"):
            return self(st.sampled_from(edge), label=name)
        return self(good, label=name)

    def options(self, batch, hq, sq, sk, dtype):
        """Keyword options shared by forward and backward: mask, score terms, dropout, stream."""
        o = {}
        if self.maybe(0.4, "causal given"):
            o["causal"] = self.value("causal", st.booleans(), odd=[1, None, "yes"], p_odd=0.1)
        if self.maybe(0.4, "window given"):
            o["window"] = self.value("window", st.tuples(st.integers(-1, 300), st.integers(-1, 300)),
                                     odd=[(-2, 0), (1.5, 0), (True, 0), (0,), (1, 2, 3), None, 3, ("1", 0)],
                                     edge=[(2**31, 0), (0, 2**31 - 1), (2**40, -1), (-1, 2**64), (2**31 - 1,) * 2])
        if self.maybe(0.25, "mask_type given"):
            o["mask_type"] = self.value("mask_type", st.sampled_from([0, 1, 2, 3]),
                                        odd=[4, -1, True, 1.0, "1", [1], {}, None])
        if self.maybe(0.3, "alignment given"):
            o["causal_alignment"] = self.value("causal_alignment", st.sampled_from(["top_left", "bottom_right"]),
                                               odd=["middle", None, 0, ["top_left"]], p_odd=0.15)
        if self.maybe(0.3, "softmax_scale given"):
            o["softmax_scale"] = self.value("softmax_scale", st.floats(1e-3, 10.0),
                                            odd=[0.0, -1.0, math.nan, math.inf, True, "0.1", None],
                                            edge=[1e300, 1e-300, 3e38, 4e38, 2, 10**400], p_odd=0.3, p_edge=0.15)
        if self.maybe(0.2, "bias given"):
            o["bias"] = self.bias(batch, hq, sq, sk, dtype)
        if self.maybe(0.2, "alibi given"):
            shape = self.value("alibi shape", st.sampled_from([(hq,), (batch, hq)]),
                               odd=[(hq + 1,), (batch, hq, 1), (batch + 1, hq)])
            o["alibi_slopes"] = self.array("alibi_slopes", shape, "float32")
        if self.maybe(0.3, "dropout given"):
            o.update(self.dropout())
        if self.maybe(0.2, "stream given"):
            o["stream"] = self.value("stream", st.sampled_from([None, 0, 7, 2**64 - 1, CudaStream(5)]),
                                     odd=[2**64, -1, True, "s", CudaStream("x"), CudaStream(-3)], p_odd=0.3)
        if self.spoil(0.02, "misspelt keyword"):
            o["causual"] = True
        return o

    def bias(self, batch, hq, sq, sk, dtype):
        bb = self(st.sampled_from([1, batch]), label="bias batch")
        bh = self(st.sampled_from([1, hq]), label="bias heads")
        shape = self.value("bias shape", st.just((bb, bh, sq, sk)),
                           odd=[(bb, bh, sq), (bb, bh, sq, sk + 1), (batch + 1, bh, sq, sk), (bb, hq + 1, sq, sk)])
        return self.array("bias", shape, dtype)

    def dropout(self):
        o = {"dropout_p": self.value("dropout_p", st.floats(0.0, 0.95),
                                     odd=[1.0, -0.1, math.nan, True, "0.1", 1, 10**400], p_odd=0.15)}
        kind = self(st.sampled_from(["int", "int", "array", "none"]), label="seed kind")
        if kind == "int":
            o["seed"] = self.value("seed", st.integers(0, 2**64), odd=[-1, 2**70, True, 1.5, None, "1"], p_odd=0.15)
            if self.maybe(0.7, "offset given"):
                o["offset"] = self.value("offset", st.integers(0, 2**40), odd=[-1, 1.0, True, None],
                                         edge=[2**63 - 1, 2**63, 2**64], p_odd=0.15)
        elif kind == "array":
            shape = self.value("seed shape", st.just((2,)), odd=[(3,), (1, 2)])
            o["seed"] = self.array("seed", shape, "int64")
        return o


class CudaStream:
    """An object speaking the CUDA stream protocol, possibly wrongly."""

    def __init__(self, handle):
        self.handle = handle

    def __cuda_stream__(self):
        return (0, self.handle)


# ------------------------------------------------------------------------------------------ the calls


def problem(d: Draw, varlen: bool):
    """(dtype, options, positional varlen arguments, the shape of every array) of one call."""
    b, sq, sk, hq, hk, dqk, dv = d.sizes(varlen)
    dtype = d(st.sampled_from(ATTN_DTYPES), label="dtype")
    opts = d.options(b, hq, sq, sk, dtype)
    if not varlen:
        shapes = dict(q=(b, sq, hq, dqk), k=(b, sk, hk, dqk), v=(b, sk, hk, dv), out=(b, sq, hq, dv), lse=(b, hq, sq))
        return dtype, opts, (), shapes
    tq, tk, seq_args, seq_opts = varlen_args(d, b, sq, sk)
    opts.update(seq_opts)
    return dtype, opts, seq_args, dict(q=(tq, hq, dqk), k=(tk, hk, dqk), v=(tk, hk, dv), out=(tq, hq, dv), lse=(hq, tq))


def fwd_call(d: Draw, varlen: bool):
    dtype, opts, seq_args, shapes = problem(d, varlen)
    q, k, v = (d.argument(name, shapes[name], dtype) for name in "qkv")
    out = d.argument("out", shapes["out"], dtype, output=True, optional=True)
    opts["out"] = q if d.spoil(0.03, "out aliases q") else out
    opts["lse"] = d.argument("lse", shapes["lse"], "float32", output=True, optional=True)
    if d.maybe(0.2, "return_lse given"):
        opts["return_lse"] = d(st.booleans())
    fn = fmha_rt.mha_varlen_fwd if varlen else fmha_rt.mha_fwd
    return lambda: fn(q, k, v, *seq_args, **opts)


def bwd_call(d: Draw, varlen: bool):
    dtype, opts, seq_args, shapes = problem(d, varlen)
    q, k, v = (d.argument(name, shapes[name], dtype) for name in "qkv")
    dout, out = d.argument("dout", shapes["out"], dtype), d.argument("out", shapes["out"], dtype)
    lse = d.argument("lse", shapes["lse"], "float32")
    for name in ("dq", "dk", "dv"):
        opts[name] = d.argument(name, shapes[name[1]], dtype, output=True, optional=True)
    if not varlen and isinstance(opts.get("bias"), FakeGpuArray):
        opts["dbias"] = d.argument("dbias", opts["bias"].shape, dtype, output=True, optional=True)
    if d.spoil(0.03, "dq aliases dout"):
        opts["dq"] = dout
    if d.maybe(0.3, "deterministic given"):
        opts["deterministic"] = d.value("deterministic", st.booleans(), odd=[1, None, "yes"], p_odd=0.1)
    if d.maybe(0.5, "workspace_alloc given"):
        opts["workspace_alloc"] = workspace_callback(d)
    fn = fmha_rt.mha_varlen_bwd if varlen else fmha_rt.mha_bwd
    return lambda: fn(dout, q, k, v, out, lse, *seq_args, **opts)


def varlen_args(d: Draw, b, sq, sk):
    """(total_q, total_k, the positional cu_seqlens and max_seqlen arguments, seqstart options), with
    the offsets on the device (values unseen by the runtime) or in NumPy arrays (checked on the host)."""
    if d.maybe(0.4, "seqlens on the host"):
        (tq, tk), arrays = host_seqlens(d, b, sq, sk)
        cu_q, cu_k = arrays.pop("cu_seqlens_q"), arrays.pop("cu_seqlens_k")
        opts = arrays
    else:
        tq = d(st.integers(0, sq * b), label="total_q")
        tk = d(st.integers(0, sk * b), label="total_k")
        cu_q = d.argument("cu_seqlens_q", (b + 1,), "int32")
        cu_k = d.argument("cu_seqlens_k", (b + 2,) if d.spoil(0.03, "cu_seqlens_k too long") else (b + 1,), "int32")
        opts = {}
        if d.maybe(0.2, "seqstart given"):
            opts["seqstart_q"] = d.argument("seqstart_q", (b + 1,), "int32")
            seqstart_k = d.argument("seqstart_k", (b + 1,), "int32")
            opts["seqstart_k"] = None if d.spoil(0.1, "seqstart_k missing") else seqstart_k
    max_q, max_k = sq, sk
    if d.huge or d.spoil(0.1, "max_seqlen odd"):
        edge = st.sampled_from(HUGE_ROWS + EDGE_INTS + [-1, 1.0, True, None])
        if d.maybe(0.5, "max_seqlen_q odd (else k)"):
            max_q = d(edge, label="max_seqlen_q")
        else:
            max_k = d(edge, label="max_seqlen_k")
    return tq, tk, (cu_q, cu_k, max_q, max_k), opts


def host_seqlens(d: Draw, b, sq, sk):
    """((total_q, total_k), NumPy cu_seqlens_q/k and maybe seqstart_q/k) for sequences of at most sq/sk
    rows, padded or not; when spoiling, one array is broken (values or kind)."""
    gap = d(st.sampled_from([0, 0, 3]), label="padding rows")
    arrays, totals = {}, []
    for side, longest in (("q", sq), ("k", sk)):
        lens = [d(st.integers(0, longest), label=f"len_{side}") for _ in range(b)]
        ends = np.cumsum([gap + n for n in lens])
        arrays[f"cu_seqlens_{side}"] = np.concatenate([[0], np.cumsum(lens)])
        if gap:
            arrays[f"seqstart_{side}"] = np.concatenate([ends - np.array(lens), ends[-1:]])
        totals.append(int(ends[-1]))
    dtype = d(st.sampled_from(["int32", "int32", "int64", "uint16"]), label="seqlens dtype")
    arrays = {name: a.astype(dtype) for name, a in arrays.items()}
    if d.spoil(0.3, "host seqlens broken"):
        name = d(st.sampled_from(sorted(arrays)), label="broken array")
        a = arrays[name].astype(np.int64)
        how = d(st.sampled_from(["bump", "decrease", "negative", "huge", "float", "empty", "2-D", "bool",
                                 "one entry", "longer"]), label="how")
        i = d(st.integers(0, len(a) - 1), label="entry")
        if how in ("bump", "decrease", "negative", "huge"):
            a[i] = {"bump": a[i] + 1000, "decrease": a[i] - 1, "negative": -5, "huge": 2**40}[how]
        arrays[name] = {"float": a.astype(np.float32), "empty": a[:0], "2-D": a[None, :], "bool": a > 0,
                        "one entry": a[:1], "longer": np.append(a, a[-1])}.get(how, a)
    return totals, arrays


def workspace_callback(d: Draw):
    """A workspace_alloc: memory of the size asked (an array or a Pointer), or broken: too little, an
    exception, not an array, on another device, read-only, host memory."""
    kind = d(st.sampled_from(["array", "pointer"]), label="workspace")
    if d.spoil(0.3, "workspace broken"):
        kind = d(st.sampled_from(["small", "raises", "none", "int", "other device", "read-only", "host"]),
                 label="bad workspace")
    rt = d.rt

    def alloc(nbytes, zero_init):
        if nbytes > rt.limit and kind in ("array", "pointer"):
            raise MemoryError(f"{nbytes} bytes")
        if kind == "array":
            return rt.workspace(nbytes)
        if kind == "pointer":
            return Pointer(rt.workspace(nbytes).ptr)
        if kind == "small":
            return rt.workspace(nbytes // 2)
        if kind == "raises":
            raise RuntimeError("allocator refused")
        if kind in ("none", "int"):
            return None if kind == "none" else 4096
        if kind == "other device":
            return rt.workspace(min(nbytes, rt.limit), device=1)
        return FakeGpuArray((min(nbytes, rt.limit),), "uint8", read_only=kind == "read-only",
                            device_type="cpu" if kind == "host" else "cuda")

    return alloc


# ------------------------------------------------------------------------------------------ the property

def check(call, outputs, exe, rt) -> str:
    """Run `call` and check the property; returns its outcome. `outputs` are (name, array) pairs of the
    outputs given to the call that have memory behind them. Every call is validated and planned: a
    repeated signature would run from the plan cache, past this executor (test_plan_cache.py checks
    what a hit checks)."""
    fmha_rt.clear_plan_cache()
    rt.reset()
    exe.calls.clear()
    exe.aligning = False
    before = set(rt.allocations)
    try:
        call()
        outcome = "reached the launch"
        assert len(exe.calls) == 1, "a call that returned normally never reached the executor"
    except FmhaError as exc:
        outcome = type(exc).__name__ + (" (executor's alignment check)" if exe.aligning else "")
    for name, array in outputs:
        assert array.untouched(), f"{outcome}: given output {name} was written"
    if set(rt.allocations) - before:
        gc.collect()
    leaked = set(rt.allocations) - before
    assert not leaked, f"{outcome}: {len(leaked)} runtime allocation(s) outlived the call"
    assert not rt.problems, rt.problems
    return outcome


def fuzz(name, make_call, harness, record_property):
    rt, exe = harness
    tally = collections.Counter()

    @FUZZ
    @given(st.data())
    def one_call(data):
        d = Draw(data, rt)
        tally[check(make_call(d), d.outputs, exe, rt)] += 1

    one_call()
    total = sum(tally.values())
    summary = ", ".join(f"{k} {v}" for k, v in tally.most_common())
    print(f"\n{name}: {total} fuzzed calls: {summary}")
    record_property("fuzzed_calls", total)
    record_property("outcomes", dict(tally))
    assert total >= EXAMPLES
    # Both sides of the property must be exercised, or the fuzzing says nothing.
    assert tally["reached the launch"] >= total // 10, tally
    assert total - tally["reached the launch"] >= total // 10, tally


def test_fuzz_mha_fwd(harness, record_property):
    fuzz("mha_fwd", lambda d: fwd_call(d, varlen=False), harness, record_property)


def test_fuzz_mha_bwd(harness, record_property):
    fuzz("mha_bwd", lambda d: bwd_call(d, varlen=False), harness, record_property)


def test_fuzz_mha_varlen_fwd(harness, record_property):
    fuzz("mha_varlen_fwd", lambda d: fwd_call(d, varlen=True), harness, record_property)


def test_fuzz_mha_varlen_bwd(harness, record_property):
    fuzz("mha_varlen_bwd", lambda d: bwd_call(d, varlen=True), harness, record_property)


# ------------------------------------------------------------------------------- calls fuzzing found
# Each once broke the property; kept as plain cases so that a regression names itself.


def _attention(b=1, sq=64, sk=64, h=2, d=64, bare_kv=False):
    """q, k, v and given forward outputs; with `bare_kv`, k and v are bare addresses (Sk beyond memory)."""
    q = FakeGpuArray((b, sq, h, d))
    if bare_kv:
        k, v = (FakeGpuArray((b, sk, h, d), address=n << 48) for n in (1, 2))
    else:
        k, v = FakeGpuArray((b, sk, h, d)), FakeGpuArray((b, sk, h, d))
    return (q, k, v), {"out": FakeGpuArray((b, sq, h, d)), "lse": FakeGpuArray((b, h, sq), "float32")}


def _fwd(inputs=None, **options):
    (q, k, v), outputs = inputs or _attention()
    return lambda rt: fmha_rt.mha_fwd(q, k, v, **outputs, **options), outputs


def _bwd(sq=64, sk=64, **options):
    (q, k, v), fwd_outputs = _attention(sq=sq, sk=sk)
    grads = {"dq": FakeGpuArray(q.shape), "dk": FakeGpuArray(k.shape), "dv": FakeGpuArray(v.shape)}
    dout = FakeGpuArray(q.shape)

    def call(rt):
        return fmha_rt.mha_bwd(dout, q, k, v, fwd_outputs["out"], fwd_outputs["lse"], **grads,
                               workspace_alloc=lambda nbytes, zero_init: rt.workspace(nbytes), **options)
    return call, grads


def _varlen_fwd(max_seqlen_q, cu=None):
    q, k, v = (FakeGpuArray((64, 2, 64)) for _ in range(3))
    cu = cu or [FakeGpuArray((2,), "int32") for _ in range(2)]
    outputs = {"out": FakeGpuArray((64, 2, 64)), "lse": FakeGpuArray((2, 64), "float32")}
    return lambda rt: fmha_rt.mha_varlen_fwd(q, k, v, *cu, max_seqlen_q, 64, **outputs), outputs


FOUND = {
    "mask_type a list (unhashable)": lambda: _fwd(mask_type=[1]),
    "softmax_scale an int beyond the float range": lambda: _fwd(softmax_scale=10**400),
    "softmax_scale * log2(e) beyond float32": lambda: _fwd(softmax_scale=3e38),
    "backward softmax_scale beyond float32": lambda: _bwd(softmax_scale=4e38),
    "window side beyond i32": lambda: _fwd(window=(2**31, 0)),
    "dropout offset beyond i64": lambda: _fwd(dropout_p=0.1, seed=1, offset=2**63),
    "Sk beyond i32": lambda: _fwd(_attention(h=1, d=8, sk=2**31, bare_kv=True)),
    "varlen max_seqlen_q beyond i32": lambda: _varlen_fwd(2**31),
    "NumPy cu_seqlens that are empty": lambda: _varlen_fwd(64, [np.zeros(0, np.int32)] * 2),
    "ALiBi batch stride beyond i32": lambda: _fwd(_attention(b=2), alibi_slopes=FakeGpuArray(
        (2, 2), "float32", strides=(2**31, 1), address=1 << 50)),
    "backward with no keys (Sk = 0)": lambda: _bwd(sk=0),
}


@pytest.mark.parametrize("name", FOUND)
def test_calls_found_by_fuzzing_keep_the_property(harness, name):
    rt, exe = harness
    call, outputs = FOUND[name]()
    check(lambda: call(rt), [(n, a) for n, a in outputs.items() if a.base is not None], exe, rt)
