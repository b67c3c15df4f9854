"""The torch adapter without a GPU: shapes, registration, tracing and argument errors.

Fake CUDA tensors (FakeTensorMode) and meta tensors run the ops' fake implementations, so everything
but the kernels is exercised here: output metadata, the autograd formula (meta tensors; autograd on
fake CUDA tensors needs a CUDA build of torch), torch.library.opcheck (meta tensors: it checks the
registration, not the kernels), make_fx and torch.compile traces, and fmha_rt's errors for bad options.
tests/gpu/test_torch_adapter.py checks the numbers.
"""
import pytest

torch = pytest.importorskip("torch")

from functorch.compile import make_boxed_func  # noqa: E402
from torch._dynamo.backends.common import aot_autograd  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402
from torch.fx.experimental.proxy_tensor import make_fx  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from fmha_rt import torch as fmha_torch  # noqa: E402
from fmha_rt.errors import FmhaError, FmhaTypeError, FmhaValueError  # noqa: E402

FWD = torch.ops.fmha_rt.fwd.default
BWD = torch.ops.fmha_rt.bwd.default

# name, B, Sq, Sk, Hq, Hk, D, Dv
BATCH_CASES = [
    ("mha", 2, 128, 128, 4, 4, 64, 64),
    ("gqa_dv_ne_d", 3, 100, 257, 8, 2, 192, 128),
    ("mqa_sq_gt_sk", 1, 300, 40, 6, 1, 32, 64),
]
# name, lens_q, lens_k, Hq, Hk, D, Dv
VARLEN_CASES = [
    ("mha", [5, 0, 17], [9, 3, 17], 2, 2, 64, 64),
    ("gqa_dv_ne_d", [33, 1], [20, 70], 8, 4, 128, 64),
]


def batch_inputs(device, B, Sq, Sk, Hq, Hk, D, Dv, dtype=torch.bfloat16, requires_grad=False):
    shapes = [(B, Sq, Hq, D), (B, Sk, Hk, D), (B, Sk, Hk, Dv)]
    return [torch.empty(s, device=device, dtype=dtype, requires_grad=requires_grad) for s in shapes]


def varlen_inputs(device, lens_q, lens_k, Hq, Hk, D, Dv, dtype=torch.float16, requires_grad=False):
    tq, tk = sum(lens_q), sum(lens_k)
    q, k, v = (torch.empty(s, device=device, dtype=dtype, requires_grad=requires_grad)
               for s in ((tq, Hq, D), (tk, Hk, D), (tk, Hk, Dv)))
    cu_q, cu_k = (torch.empty(len(lens) + 1, device=device, dtype=torch.int32) for lens in (lens_q, lens_k))
    return q, k, v, cu_q, cu_k, max(lens_q), max(lens_k)


class OpRecorder(TorchDispatchMode):
    """Records the fmha_rt ops that run, with their arguments."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (FWD, BWD):
            self.calls.append((func, args))
        return func(*args, **(kwargs or {}))


def graph_targets(gm):
    return [node.target for node in gm.graph.nodes if node.op == "call_function"]


# ------------------------------------------------------------------------------------ fake outputs


@pytest.mark.parametrize("case", BATCH_CASES, ids=[c[0] for c in BATCH_CASES])
def test_fake_batch_outputs_have_flash_attn_shapes(case):
    _, B, Sq, Sk, Hq, Hk, D, Dv = case
    with FakeTensorMode():
        q, k, v = batch_inputs("cuda", B, Sq, Sk, Hq, Hk, D, Dv)
        out = fmha_torch.flash_attn_func(q, k, v, causal=True)
        out2, lse, probs = fmha_torch.flash_attn_func(q, k, v, dropout_p=0.1, return_attn_probs=True)
    for o in (out, out2):
        assert (o.shape, o.dtype, o.device) == ((B, Sq, Hq, Dv), torch.bfloat16, torch.device("cuda", 0))
        assert o.is_contiguous()
    assert (lse.shape, lse.dtype, lse.device) == ((B, Hq, Sq), torch.float32, torch.device("cuda", 0))
    assert probs is None


@pytest.mark.parametrize("case", VARLEN_CASES, ids=[c[0] for c in VARLEN_CASES])
def test_fake_varlen_outputs_have_flash_attn_shapes(case):
    _, lens_q, lens_k, Hq, Hk, D, Dv = case
    with FakeTensorMode():
        q, k, v, cu_q, cu_k, mq, mk = varlen_inputs("cuda", lens_q, lens_k, Hq, Hk, D, Dv)
        out, lse, probs = fmha_torch.flash_attn_varlen_func(q, k, v, cu_q, cu_k, mq, mk, causal=True,
                                                            return_attn_probs=True)
    assert (out.shape, out.dtype, out.device) == ((sum(lens_q), Hq, Dv), torch.float16, torch.device("cuda", 0))
    assert (lse.shape, lse.dtype) == ((Hq, sum(lens_q)), torch.float32)
    assert probs is None


def test_options_reach_the_forward_op_as_flash_attn_means_them():
    recorder = OpRecorder()
    with FakeTensorMode(), recorder:
        q, k, v = batch_inputs("cuda", 1, 64, 96, 2, 2, 64, 64)
        slopes = torch.empty(2, device="cuda", dtype=torch.float32)
        fmha_torch.flash_attn_func(q, k, v, softmax_scale=0.25, causal=True, window_size=(16, 7))
        fmha_torch.flash_attn_func(q, k, v, window_size=[5, 3], alibi_slopes=slopes, deterministic=True)
        fmha_torch.flash_attn_func(q, k, v, dropout_p=0.3)
        state = fmha_torch.last_dropout_state()
    (_, causal), (_, window), (_, dropout) = recorder.calls
    # args: q k v cu_q cu_k alibi rng max_q max_k scale left right p deterministic
    assert causal[7:] == (0, 0, 0.25, 16, 0, 0.0, False)  # causal keeps the left side and closes the right
    assert window[5] is slopes and window[9:] == (None, 5, 3, 0.0, True)
    rng = dropout[6]
    assert rng is state and (rng.shape, rng.dtype, rng.device) == ((2,), torch.int64, torch.device("cuda", 0))
    assert dropout[12] == 0.3 and causal[6] is None and window[6] is None


# -------------------------------------------------------------------------------------- autograd


@pytest.mark.parametrize("case", BATCH_CASES, ids=[c[0] for c in BATCH_CASES])
def test_meta_backward_gives_gradients_shaped_like_the_inputs(case):
    _, B, Sq, Sk, Hq, Hk, D, Dv = case
    q, k, v = batch_inputs("meta", B, Sq, Sk, Hq, Hk, D, Dv, requires_grad=True)
    out, lse, _ = fmha_torch.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    assert out.requires_grad and not lse.requires_grad
    out.sum().backward()
    for x in (q, k, v):
        assert (x.grad.shape, x.grad.dtype, x.grad.device) == (x.shape, x.dtype, x.device)


def test_meta_varlen_backward_gives_gradients_shaped_like_the_inputs():
    q, k, v, cu_q, cu_k, mq, mk = varlen_inputs("meta", [7, 40], [3, 90], 4, 2, 64, 32, requires_grad=True)
    fmha_torch.flash_attn_varlen_func(q, k, v, cu_q, cu_k, mq, mk).sum().backward()
    for x in (q, k, v):
        assert (x.grad.shape, x.grad.dtype) == (x.shape, x.dtype)


def test_backward_op_gets_the_forwards_dropout_state_and_options():
    recorder = OpRecorder()
    q, k, v, cu_q, cu_k, mq, mk = varlen_inputs("meta", [7, 40], [3, 90], 4, 2, 64, 32, requires_grad=True)
    with recorder:
        out = fmha_torch.flash_attn_varlen_func(q, k, v, cu_q, cu_k, mq, mk, dropout_p=0.2, softmax_scale=0.5,
                                                window_size=(4, 9), deterministic=True)
        out.backward(torch.empty_like(out))
    (fwd, fwd_args), (bwd, bwd_args) = recorder.calls
    assert (fwd, bwd) == (FWD, BWD)
    # the backward's tensors after dout: q k v out lse, then the forward's cu_q cu_k alibi rng and scalars
    assert bwd_args[1:4] == fwd_args[:3] and bwd_args[6:10] == fwd_args[3:7]
    assert bwd_args[10:] == fwd_args[7:] == (mq, mk, 0.5, 4, 9, 0.2, True)
    assert fwd_args[6] is fmha_torch.last_dropout_state()


@pytest.mark.parametrize("varlen", [False, True], ids=["batch", "varlen"])
def test_opcheck_on_meta_tensors(varlen):
    if varlen:
        q, k, v, cu_q, cu_k, mq, mk = varlen_inputs("meta", [7, 40], [3, 90], 4, 2, 64, 32, requires_grad=True)
        lse_shape = (4, 47)
    else:
        q, k, v = batch_inputs("meta", 2, 48, 80, 4, 2, 64, 32, requires_grad=True)
        cu_q = cu_k = None
        mq = mk = 0
        lse_shape = (2, 4, 48)
    rng = torch.empty(2, device="meta", dtype=torch.int64)
    options = (mq, mk, None, -1, 0, 0.1, True)
    torch.library.opcheck(FWD, (q, k, v, cu_q, cu_k, None, rng) + options)
    q, k, v = (x.detach() for x in (q, k, v))
    out = torch.empty(q.shape[:-1] + v.shape[-1:], device="meta", dtype=q.dtype)
    lse = torch.empty(lse_shape, device="meta", dtype=torch.float32)
    torch.library.opcheck(BWD, (torch.empty_like(out), q, k, v, out, lse, cu_q, cu_k, None, rng) + options)


# --------------------------------------------------------------------------------------- tracing


def small_attention(q, k, v):
    return fmha_torch.flash_attn_func(q * 0.5, k, v, dropout_p=0.1, causal=True, window_size=(32, -1)).sum(-1)


def test_make_fx_traces_one_graph_with_the_forward_op():
    with FakeTensorMode():
        q, k, v = batch_inputs("cuda", 2, 64, 80, 8, 2, 64, 32)
        gm = make_fx(small_attention, tracing_mode="fake")(q, k, v)
    targets = graph_targets(gm)
    assert targets.count(FWD) == 1
    assert targets.index(torch.ops.aten.randint.default) < targets.index(FWD)


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_torch_compile_traces_into_one_graph_with_fake_cuda_inputs(dynamic):
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    with FakeTensorMode():
        q, k, v = batch_inputs("cuda", 2, 64, 80, 8, 2, 64, 32)
        out = torch.compile(small_attention, backend=record, fullgraph=True, dynamic=dynamic)(q, k, v)
        explained = torch._dynamo.explain(small_attention)(q, k, v)
    assert len(graphs) == 1 and graph_targets(graphs[0]).count(FWD) == 1
    assert (out.shape, out.device) == ((2, 64, 8), torch.device("cuda", 0))
    assert explained.graph_count == 1 and explained.graph_break_count == 0


def test_torch_compile_puts_the_backward_op_in_the_backward_graph():
    forward_graphs, backward_graphs = [], []

    def recorder(store):
        def compile_graph(gm, example_inputs):
            store.append(gm)
            return make_boxed_func(gm.forward)
        return compile_graph

    backend = aot_autograd(fw_compiler=recorder(forward_graphs), bw_compiler=recorder(backward_graphs))
    torch._dynamo.reset()
    q, k, v = batch_inputs("meta", 2, 64, 80, 8, 2, 64, 32, requires_grad=True)
    torch.compile(small_attention, backend=backend, fullgraph=True)(q, k, v).sum().backward()
    assert [graph_targets(g).count(FWD) for g in forward_graphs] == [1]
    assert [graph_targets(g).count(BWD) for g in backward_graphs] == [1]
    assert q.grad.shape == q.shape and v.grad.shape == v.shape


# ---------------------------------------------------------------------------------------- errors

BAD_OPTIONS = [
    ({"window_size": (-2, 0)}, FmhaValueError, "window"),
    ({"window_size": (4, -5)}, FmhaValueError, "window"),
    ({"window_size": (4,)}, FmhaTypeError, "pair"),
    ({"window_size": (1.5, 0)}, FmhaTypeError, "window"),
    ({"causal": 1}, FmhaTypeError, "causal"),
    ({"dropout_p": 1.0}, FmhaValueError, "dropout_p"),
    ({"dropout_p": -0.1}, FmhaValueError, "dropout_p"),
    ({"dropout_p": True}, FmhaValueError, "dropout_p"),
    ({"dropout_p": "0.1"}, FmhaValueError, "dropout_p"),
]


@pytest.mark.parametrize("options, error, word", BAD_OPTIONS, ids=[str(o) for o, *_ in BAD_OPTIONS])
def test_bad_options_raise_fmha_errors_before_any_op(options, error, word):
    recorder = OpRecorder()
    with FakeTensorMode(), recorder:
        q, k, v = batch_inputs("cuda", 1, 32, 32, 2, 2, 64, 64)
        with pytest.raises(error, match=word):
            fmha_torch.flash_attn_func(q, k, v, **options)
        varlen = varlen_inputs("cuda", [32], [32], 2, 2, 64, 64)
        with pytest.raises(error, match=word):
            fmha_torch.flash_attn_varlen_func(*varlen, **options)
    assert recorder.calls == []


def test_bad_option_under_torch_compile_is_still_an_fmha_error():
    torch._dynamo.reset()
    with FakeTensorMode():
        q, k, v = batch_inputs("cuda", 1, 32, 32, 2, 2, 64, 64)
        with pytest.raises(FmhaValueError, match="dropout_p"):
            torch.compile(lambda q, k, v: fmha_torch.flash_attn_func(q, k, v, dropout_p=1.5), backend="eager")(q, k, v)


def test_cpu_tensors_reach_fmha_rt_and_raise_its_error():
    gen = torch.Generator().manual_seed(0)
    q = torch.randn((1, 16, 2, 64), generator=gen, dtype=torch.float16, requires_grad=True)
    with pytest.raises(FmhaError):
        fmha_torch.flash_attn_func(q, q, q, causal=True)
