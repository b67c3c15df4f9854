"""The two routes of fmha_rt.torch on the CPU stand-in (fake_gpu.py: torch CPU tensors pose as CUDA
tensors, the driver records each launch's kernel, grid and argument bytes): which calls take the eager
route, and that it launches what the registered ops launch, byte for byte with every address read as
the tensor it points into, both when the ops are called eagerly and from a torch.compile graph. The
kernels are deterministic functions of their arguments (the backward with deterministic=True), so equal
launches on equal inputs give bitwise-equal results; tests/gpu/test_torch_eager_path.py checks the
results themselves on a GPU.
"""
import contextlib
import logging

import pytest

torch = pytest.importorskip("torch")

from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402
from torch.fx.experimental.proxy_tensor import make_fx  # noqa: E402
from torch.overrides import TorchFunctionMode  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from fmha_rt.runtime import registry as registry_module  # noqa: E402
from fmha_rt import torch as fmha_torch  # noqa: E402
from fmha_rt import torch_calls, torch_eager  # noqa: E402
from fmha_rt.errors import FmhaTypeError  # noqa: E402

from log_lines import logged_calls  # noqa: E402

ARCH = "sm_90"  # the stand-in's
WORKSPACE = "workspace"  # what a pointer into no recorded tensor points into


def randn(gen, *shape, dtype=torch.bfloat16, grad=True):
    return torch.randn(*shape, generator=gen, dtype=torch.float32).to(dtype).requires_grad_(grad)


def takes_eager(q, k, v, cu=None, alibi=None, rng=None) -> bool:
    return torch_eager.takes_eager_route(q, k, v, cu, alibi, rng)


# ------------------------------------------------------------------------------------- route choice


def test_plain_tensors_and_parameters_take_the_eager_route():
    gen = torch.Generator().manual_seed(1)
    q, k, v = (randn(gen, 1, 8, 2, 64) for _ in range(3))
    assert takes_eager(q, k, v)
    assert takes_eager(torch.nn.Parameter(q.detach()), k, v, torch.zeros(2, dtype=torch.int32), torch.ones(2),
                       torch.zeros(2, dtype=torch.int64))


class Sub(torch.Tensor):
    """A tensor subclass, as DTensor and FakeTensor are."""


class Watching(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


class WatchingFunctions(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def test_whatever_could_trace_or_intercept_a_call_takes_the_registered_ops():
    gen = torch.Generator().manual_seed(2)
    q, k, v = (randn(gen, 1, 8, 2, 64) for _ in range(3))
    sub = q.detach().as_subclass(Sub)
    assert not takes_eager(sub, k, v) and not takes_eager(q, k, sub)
    assert not takes_eager(q, k, v, cu=sub) and not takes_eager(q, k, v, alibi=sub) and not takes_eager(q, k, v, rng=sub)
    assert not takes_eager(*(torch.empty(1, 8, 2, 64, device="meta") for _ in range(3)))
    with Watching():
        assert not takes_eager(q, k, v)
    with WatchingFunctions():
        assert not takes_eager(q, k, v)
    with FakeTensorMode() as mode:
        assert not takes_eager(*(mode.from_tensor(x) for x in (q, k, v)))
    seen = []

    def record(x):
        seen.append(takes_eager(x, k, v))
        return x

    leaked = []
    torch.func.vmap(record)(q)
    torch.func.grad(lambda x: record(leaked.append(x) or x).sum())(q.detach().float())
    make_fx(record)(q.detach())
    torch.jit.trace(record, (q.detach(),), check_trace=False)
    with torch_eager.registered_ops_only():
        record(q)
    assert seen == [False] * 5 and takes_eager(q, k, v)
    assert not takes_eager(q, leaked[0], v)  # a wrapper of a transform that has finished


# ------------------------------------------------------------------------------- equal launches


class Watch:
    """Records every torch_calls.forward and backward call (its scalars and tensors, and the tensors it
    returns) and every launch, and reads each launch's pointers as the recorded tensor they point into;
    a pointer into no recorded tensor is the backward's workspace (torch's memory, made in the call),
    read relative to the lowest such pointer of the call."""

    def __init__(self, monkeypatch, driver):
        self.driver, self.calls = driver, []
        for name in ("forward", "backward"):
            monkeypatch.setattr(torch_calls, name, self._recording(name, getattr(torch_calls, name)))

    def _recording(self, name, call):
        def recorded(*args):
            results = call(*args)
            self.calls.append((name, args, results, self.driver.take()))
            return results
        return recorded

    def take(self) -> list:
        """Each call since the last take: (name, its scalars, its tensors, its launches with their
        pointers read). A tensor is its contents, or where an earlier call of the take made it: outputs
        hold what the kernels would write, which the stand-in's launches never do."""
        taken, self.calls, made = self.calls, [], {}
        read = []
        for number, (name, args, results, launches) in enumerate(taken):
            read.append(self._read(name, args, results, launches, made))
            made.update({t.data_ptr(): (number, i) for i, t in enumerate(results)})
        return read

    def _read(self, name, args, results, launches, made):
        given = [a for a in args if isinstance(a, torch.Tensor)]
        tensors = given + list(results)
        scalars = tuple(a for a in args if not isinstance(a, torch.Tensor))
        spans = [(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), i) for i, t in enumerate(tensors)]
        read = [(key, grid, stream, self._pointers(key, packed, spans)) for key, grid, packed, stream in launches]
        base = min((p[1] for *_, slots in read for p in slots.values() if type(p) is tuple and p[0] == WORKSPACE),
                   default=0)
        read = [(key, grid, stream, {slot: (WORKSPACE, p[1] - base) if type(p) is tuple and p[0] == WORKSPACE else p
                                     for slot, p in slots.items()})
                for key, grid, stream, slots in read]
        contents = [made.get(t.data_ptr()) or (t.shape, t.stride(), t.dtype,
                                               bytes(t.detach().contiguous().view(torch.uint8).numpy()))
                    for t in given]
        return name, scalars, contents, read

    @staticmethod
    def _pointers(key, packed, spans) -> dict:
        """Every argument of a launch by name: scalars as packed, addresses as (tensor index, offset),
        null as None, any other address as (WORKSPACE, address)."""
        packer = registry_module.registry().entry(ARCH, key).packer
        values = dict(zip(packer.names, packer.struct.unpack(packed)))
        for slot in packer.slots:
            if slot.type == "ptr" and values[slot.name]:
                address = values[slot.name]
                values[slot.name] = next(((i, address - lo) for lo, hi, i in spans if lo <= address < hi),
                                         (WORKSPACE, address))
            elif slot.type == "ptr":
                values[slot.name] = None
        return values


@pytest.fixture
def watch(monkeypatch, rt, driver, torch_as_cuda):
    return Watch(monkeypatch, driver)


def batch_call(gen, options, B=2, Sq=48, Sk=80, Hq=4, Hk=2, D=64):
    q, k, v = randn(gen, B, Sq, Hq, D), randn(gen, B, Sk, Hk, D), randn(gen, B, Sk, Hk, D)
    if options.pop("alibi", False):
        options["alibi_slopes"] = torch.rand(Hq, generator=gen)
    return (lambda q, k, v: fmha_torch.flash_attn_func(q, k, v, **options)), (q, k, v), randn(gen, B, Sq, Hq, D,
                                                                                               grad=False)


def varlen_call(gen, options, lens_q=(30, 0, 17), lens_k=(9, 40, 17), Hq=4, Hk=2, D=64):
    tq, tk = sum(lens_q), sum(lens_k)
    cu_q, cu_k = (torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
                  for lens in (lens_q, lens_k))

    def call(q, k, v):
        return fmha_torch.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), **options)
    return call, (randn(gen, tq, Hq, D), randn(gen, tk, Hk, D), randn(gen, tk, Hk, D)), randn(gen, tq, Hq, D, grad=False)


CASES = [
    ("causal_gqa", batch_call, {"causal": True}),
    ("window_scale_deterministic", batch_call, {"window_size": (16, 8), "softmax_scale": 0.3, "deterministic": True}),
    ("alibi_dropout", batch_call, {"alibi": True, "dropout_p": 0.2, "causal": True, "deterministic": True}),
    ("varlen_causal_dropout", varlen_call, {"causal": True, "dropout_p": 0.1}),
]


def run(route, inputs, dout, seed):
    """out and the gradients of one step of `route`, torch's generator (the dropout state's) seeded first."""
    torch.manual_seed(seed)
    out = route(*inputs)
    return (out, *torch.autograd.grad(out, inputs, dout))


@pytest.mark.parametrize("name, make, options", CASES, ids=[c[0] for c in CASES])
def test_the_eager_route_launches_what_the_registered_ops_launch(watch, name, make, options):
    seed = sum(map(ord, name))
    print(f"seed {seed}")
    call, inputs, dout = make(torch.Generator().manual_seed(seed), dict(options))
    for _ in range(3):  # the first call of a signature is planned, the next ones replay the plan cache's record
        run(call, inputs, dout, seed)
        eager = watch.take()
        with torch_eager.registered_ops_only():
            run(call, inputs, dout, seed)
        registered = watch.take()
        assert [c[0] for c in eager] == ["forward", "backward"]
        assert eager == registered
        assert all(launches for *_, launches in eager)


def test_both_routes_log_one_line_per_call(watch, caplog, log_config):
    """FMHA_RT_LOG_CONFIG: the eager route and the registered ops each log the forward and the backward
    once, with the same line (the options as the adapter passes them: a bottom-right window)."""
    name, make, options = CASES[1]
    seed = sum(map(ord, name)) + 2
    print(f"seed {seed}")
    call, inputs, dout = make(torch.Generator().manual_seed(seed), dict(options))
    lines = []
    for route in (contextlib.nullcontext, torch_eager.registered_ops_only):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="fmha_rt"), route():
            run(call, inputs, dout, seed)
        lines.append(logged_calls(caplog.records))
    eager, registered = lines
    assert eager == registered and [line["function"] for line in eager] == ["mha_fwd", "mha_bwd"]
    assert all((line["window"], line["causal_alignment"], line["mask_type"], line["softmax_scale"])
               == ("(16,8)", "bottom_right", "3", "0.3") for line in eager)
    assert eager[1]["deterministic"] == "True" and eager[1]["k"] == "bf16[2,80,2,64]:[10240,128,64,1]"


@pytest.mark.parametrize("name, make, options", [CASES[2], CASES[3]], ids=[CASES[2][0], CASES[3][0]])
def test_the_eager_route_launches_what_a_compiled_graph_launches(watch, name, make, options):
    seed = sum(map(ord, name)) + 1
    print(f"seed {seed}")
    call, inputs, dout = make(torch.Generator().manual_seed(seed), dict(options))
    torch._dynamo.reset()
    compiled = torch.compile(call, backend="aot_eager", fullgraph=True)
    run(compiled, inputs, dout, seed)  # compiles: the recording starts after
    watch.take()
    run(call, inputs, dout, seed)
    eager = watch.take()
    run(compiled, inputs, dout, seed)
    assert watch.take() == eager


def test_an_eager_call_runs_no_registered_op_and_saves_what_its_backward_needs(monkeypatch, watch):
    def refuse(*_):
        raise AssertionError("an eager call reached the registered op")

    monkeypatch.setattr(fmha_torch, "fwd_op", refuse)
    gen = torch.Generator().manual_seed(3)
    q, k, v = (randn(gen, 1, 32, 2, 64) for _ in range(3))
    out, lse, probs = fmha_torch.flash_attn_func(q, k, v, dropout_p=0.25, return_attn_probs=True)
    assert type(out.grad_fn).__name__ == "EagerAttentionBackward" and probs is None
    assert not lse.requires_grad and lse.shape == (1, 2, 32) and lse.dtype == torch.float32
    assert out.shape == q.shape and out.dtype == q.dtype
    (_, forward_scalars, _, _), = watch.take()
    out.backward(randn(gen, 1, 32, 2, 64, grad=False))
    (_, backward_scalars, _, _), = watch.take()
    # cu_seqlens_q, cu_seqlens_k, alibi_slopes, max_seqlen_q/k, softmax_scale, window, dropout_p (, deterministic)
    assert forward_scalars == (None, None, None, 0, 0, None, -1, -1, 0.25)
    assert backward_scalars == forward_scalars + (False,)
    assert all(x.grad is not None and x.grad.shape == x.shape for x in (q, k, v))


# Each differs from the one before in one thing: (flash_attn_func's options, dtype, sequence length).
OPTION_SEQUENCE = [
    ({"softmax_scale": 0.5}, torch.bfloat16, 16),
    ({"softmax_scale": 1}, torch.bfloat16, 16),
    ({"softmax_scale": 1.0, "causal": True}, torch.bfloat16, 16),
    ({"softmax_scale": 1.0, "window_size": (3, 2)}, torch.bfloat16, 16),
    ({"softmax_scale": 1.0, "window_size": (3, 2), "deterministic": True}, torch.bfloat16, 16),
    ({"softmax_scale": 1.0, "window_size": (3, 2), "deterministic": True}, torch.float16, 16),
    ({"softmax_scale": 1.0, "window_size": (3, 2), "deterministic": True}, torch.float16, 24),
]


def test_every_call_runs_with_its_own_options_dtype_and_shapes(watch, caplog, log_config):
    """torch_calls keeps fmha_rt's functions bound per set of scalars and options (api.bind): each call
    logs its own options, dtype and shapes, the first time (planned) and the next (from the plan
    cache), never an earlier call's; values that are equal keys but not the same option (1 and True)
    are told apart, so validation still refuses the bool."""
    gen = torch.Generator().manual_seed(5)
    for options, dtype, seqlen in OPTION_SEQUENCE * 2:
        q, k, v = (randn(gen, 1, seqlen, 2, 64, dtype=dtype) for _ in range(3))
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="fmha_rt"):
            fmha_torch.flash_attn_func(q, k, v, **options).sum().backward()
        window = "(-1,0)" if options.get("causal") else "(3,2)" if "window_size" in options else "(-1,-1)"
        name = {torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]
        for line in logged_calls(caplog.records):
            assert (line["softmax_scale"], line["window"]) == (str(float(options["softmax_scale"])), window)
            assert line["q"].startswith(f"{name}[1,{seqlen},2,64]")
        assert line["function"] == "mha_bwd" and line["deterministic"] == str(options.get("deterministic", False))
    with pytest.raises(FmhaTypeError, match="softmax_scale"):
        fmha_torch.flash_attn_func(q, k, v, softmax_scale=True)
    with pytest.raises(FmhaTypeError, match="deterministic must be a bool"):
        fmha_torch.flash_attn_func(q, k, v, softmax_scale=1.0, window_size=(3, 2), deterministic=1).sum().backward()


def test_gradients_are_laid_out_as_their_inputs(watch):
    """dq, dk and dv take the strides of q, k and v (here [B, H, S, D] tensors seen as [B, S, H, D]),
    the layout autograd keeps for a gradient."""
    gen = torch.Generator().manual_seed(6)
    q, k, v = (randn(gen, 1, 2, 16, 64, grad=False).transpose(1, 2).requires_grad_() for _ in range(3))
    fmha_torch.flash_attn_func(q, k, v).sum().backward()
    assert all(x.grad.stride() == x.stride() != x.contiguous().stride() for x in (q, k, v))


class Cut(torch.autograd.Function):
    """The identity, whose backward gives no gradient (an undefined one)."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return None


def test_an_undefined_gradient_of_out_runs_no_backward(watch):
    """The eager route has autograd materialise no missing gradient (lse's is never used): an undefined
    gradient of out means undefined ones of q, k and v, with nothing launched."""
    gen = torch.Generator().manual_seed(7)
    q, k, v = (randn(gen, 1, 16, 2, 64) for _ in range(3))
    (Cut.apply(fmha_torch.flash_attn_func(q, k, v)).sum() + q.sum()).backward()
    assert [c[0] for c in watch.take()] == ["forward"]
    assert torch.equal(q.grad, torch.ones_like(q)) and k.grad is None and v.grad is None


def test_without_gradients_the_eager_route_builds_no_autograd_node(watch):
    gen = torch.Generator().manual_seed(4)
    q, k, v = (randn(gen, 1, 16, 2, 64) for _ in range(3))
    with torch.no_grad():
        assert fmha_torch.flash_attn_func(q, k, v).grad_fn is None
    out = fmha_torch.flash_attn_func(q.detach(), k.detach(), v.detach())
    assert out.grad_fn is None and not out.requires_grad
    assert [c[0] for c in watch.take()] == ["forward", "forward"]


def test_only_inputs_not_contiguous_in_the_last_dim_are_copied():
    """Contiguous tensors and ones contiguous in the last dim alone (a transposed view) pass as they
    are; any other (a zero-stride gradient, a strided slice) is copied, wherever it stands."""
    gen = torch.Generator().manual_seed(8)
    plain, transposed = randn(gen, 2, 8, 4, 16), randn(gen, 2, 4, 8, 16).transpose(1, 2)
    expanded, strided = torch.ones(1, 1, 1, 1).expand(2, 8, 4, 16), randn(gen, 2, 8, 4, 32)[..., ::2]
    assert torch_calls._last_dims_contiguous(plain, None, transposed) == (plain, None, transposed)
    for odd in (expanded, strided):
        given = (plain, odd, None, transposed)
        passed = torch_calls._last_dims_contiguous(*given)
        assert passed[0] is plain and passed[2] is None and passed[3] is transposed
        assert passed[1].stride(-1) == 1 and torch.equal(passed[1], odd)


@pytest.mark.parametrize("dv", [64, 32])
def test_out_is_contiguous_whatever_the_layout_of_q(watch, dv):
    """out is laid out as the registered op's fake lays it (contiguous) also for a q that is dense but
    not contiguous, with v's head dim equal to q's or not."""
    gen = torch.Generator().manual_seed(9)
    q, k = (randn(gen, 1, 2, 16, 64, grad=False).transpose(1, 2) for _ in range(2))
    v = randn(gen, 1, 16, 2, dv, grad=False)
    out = fmha_torch.flash_attn_func(q, k, v)
    assert out.shape == (1, 16, 2, dv) and out.is_contiguous()
