"""The torch adapter on the GPU: autograd against the float64 reference, dropout with the adapter's own
Philox state, deterministic backward, torch.library.opcheck, torch.compile and CUDA graphs.

Inputs are fresh random draws; errors are relative, ||got - ref|| / ||ref|| < 1e-2 (bf16). The ops
allocate their outputs, so before the reference-checked calls the blocks they will get from torch's
caching allocator are filled with NaN (see `poison_allocator`): an element the kernels skip shows as NaN.
Errors are bounded for the whole tensor, per head and per row (tests/error_bounds.py); seeds are printed.
"""
import numpy as np
import pytest

from gpu_presence import require

torch = require("torch")

import fmha_rt
import philox_reference
from error_bounds import assert_close, assert_lse_close
from fmha_rt import reference
from fmha_rt import torch as fmha_torch
from fmha_rt.torch import flash_attn_func, flash_attn_varlen_func
from gpu_tensors import differing_bits, f64, generator, poison_for


def rand(shape, gen, dtype=torch.bfloat16, requires_grad=False):
    x = torch.randn(shape, generator=gen, device="cuda", dtype=torch.float32).to(dtype)
    return x.requires_grad_(requires_grad)




# name, B, Sq, Sk, Hq, Hk, D, Dv, options
CASES = [
    ("mha_d64", 2, 256, 256, 4, 4, 64, 64, {}),
    ("gqa_causal_sq_lt_sk", 2, 130, 300, 8, 2, 64, 64, {"causal": True}),
    ("gqa_causal_sq_gt_sk", 1, 300, 130, 4, 2, 128, 128, {"causal": True}),
    ("mqa_window", 1, 100, 257, 4, 1, 64, 64, {"window_size": (16, 16)}),
    ("causal_window_left", 2, 192, 192, 2, 2, 96, 96, {"causal": True, "window_size": (40, -1)}),
    ("d192_dv128_scale", 1, 256, 256, 2, 2, 192, 128, {"causal": True, "softmax_scale": 0.1}),
    ("d256_gqa", 1, 160, 160, 4, 2, 256, 256, {}),
]


def reference_options(options, alibi_slopes=None):
    """fmha_rt.reference's keywords for flash-attn options: every mask bottom-right."""
    left, right = options.get("window_size", (-1, -1))
    if options.get("causal"):
        right = 0
    ref = {"window": (left, right), "bottom_right": True, "softmax_scale": options.get("softmax_scale")}
    if alibi_slopes is not None:
        ref["alibi_slopes"] = f64(alibi_slopes)
    return ref


def run_batch(B, Sq, Sk, Hq, Hk, D, Dv, options, seed, alibi=False):
    gen = generator(seed)
    q, k = rand((B, Sq, Hq, D), gen, requires_grad=True), rand((B, Sk, Hk, D), gen, requires_grad=True)
    v, dout = rand((B, Sk, Hk, Dv), gen, requires_grad=True), rand((B, Sq, Hq, Dv), gen)
    slopes = torch.rand(Hq, generator=gen, device="cuda") * 0.5 if alibi else None
    poison_for(q, k, v, (B, Hq, Sq))
    out, lse, probs = flash_attn_func(q, k, v, alibi_slopes=slopes, return_attn_probs=True, **options)
    assert probs is None and lse.shape == (B, Hq, Sq) and lse.dtype == torch.float32
    out.backward(dout)
    return q, k, v, dout, out, lse, reference_options(options, slopes)


def check_against_reference(q, k, v, dout, out, lse, ref):
    ro, rl = reference.mha_fwd_ref(f64(q), f64(k), f64(v), **ref)
    assert_close("out", out, ro)
    assert_lse_close("lse", lse, rl)
    rdq, rdk, rdv, _ = reference.mha_bwd_ref(f64(dout), f64(q), f64(k), f64(v), **ref)
    for name, got, want in (("dq", q.grad, rdq), ("dk", k.grad, rdk), ("dv", v.grad, rdv)):
        assert got.shape == want.shape and got.dtype == q.dtype
        assert_close(name, got, want)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_autograd_matches_reference(case):
    name, B, Sq, Sk, Hq, Hk, D, Dv, options = case
    check_against_reference(*run_batch(B, Sq, Sk, Hq, Hk, D, Dv, options, seed=sum(map(ord, name))))


def test_causal_is_bottom_right_and_rows_without_keys_are_zero():
    # Sq > Sk: with bottom-right alignment the first Sq - Sk query rows see no key at all
    q, k, v, dout, out, lse, ref = run_batch(1, 200, 64, 2, 2, 64, 64, {"causal": True}, seed=3)
    check_against_reference(q, k, v, dout, out, lse, ref)
    assert torch.all(out[:, :136] == 0) and torch.all(torch.isneginf(lse[:, :, :136]))
    assert torch.all(q.grad[:, :136] == 0)
    # Sq < Sk: the last query row sees every key, the first sees Sk - Sq + 1 of them
    q, k, v, dout, out, lse, ref = run_batch(1, 64, 200, 2, 2, 64, 64, {"causal": True}, seed=4)
    check_against_reference(q, k, v, dout, out, lse, ref)
    top_left = reference.mha_fwd_ref(f64(q), f64(k), f64(v), window=(-1, 0), bottom_right=False)[0]
    assert reference.rel_err(f64(out), top_left) > 0.1


def test_alibi_slopes():
    check_against_reference(*run_batch(2, 128, 160, 4, 4, 64, 64, {"causal": True}, seed=5, alibi=True))


def test_sum_loss_gradient_with_zero_strides():
    # out.sum() hands the backward an expanded (all strides 0) gradient
    gen = generator(6)
    q, k, v = (rand((2, 128, 4, 64), gen, requires_grad=True) for _ in range(3))
    out = flash_attn_func(q, k, v, causal=True)
    out.sum().backward()
    ones = np.ones(out.shape)
    rdq, rdk, rdv, _ = reference.mha_bwd_ref(ones, f64(q), f64(k), f64(v), window=(-1, 0), bottom_right=True)
    for name, got, want in (("dq", q.grad, rdq), ("dk", k.grad, rdk), ("dv", v.grad, rdv)):
        assert_close(name, got, want)


def test_varlen_autograd_matches_reference():
    lens_q, lens_k = [37, 0, 1, 128, 64, 90], [50, 3, 1, 128, 0, 40]
    Hq, Hk, D = 4, 2, 64
    cu_q = torch.tensor([0, *np.cumsum(lens_q)], device="cuda", dtype=torch.int32)
    cu_k = torch.tensor([0, *np.cumsum(lens_k)], device="cuda", dtype=torch.int32)
    gen = generator(7)
    tq, tk = sum(lens_q), sum(lens_k)
    q, k, v = (rand(s, gen, requires_grad=True) for s in ((tq, Hq, D), (tk, Hk, D), (tk, Hk, D)))
    dout = rand((tq, Hq, D), gen)
    poison_for(q, k, v, (Hq, tq))
    out, lse, _ = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=True,
                                         return_attn_probs=True)
    assert lse.shape == (Hq, tq)
    out.backward(dout)
    ref = {"window": (-1, 0), "bottom_right": True}
    cq, ck = cu_q.cpu().numpy(), cu_k.cpu().numpy()
    ro, rl = reference.mha_varlen_fwd_ref(f64(q), f64(k), f64(v), cq, ck, **ref)
    assert_close("out", out, ro)
    assert_lse_close("lse", lse, rl)
    rdq, rdk, rdv, _ = reference.mha_varlen_bwd_ref(f64(dout), f64(q), f64(k), f64(v), cq, ck, **ref)
    for name, got, want in (("dq", q.grad, rdq), ("dk", k.grad, rdk), ("dv", v.grad, rdv)):
        assert_close(name, got, want)


def test_dropout_uses_the_state_it_reports_in_forward_and_backward():
    B, S, H, D, p = 2, 192, 2, 64, 0.2
    gen = generator(8)
    q, k, v = (rand((B, S, H, D), gen, requires_grad=True) for _ in range(3))
    dout = rand((B, S, H, D), gen)
    torch.manual_seed(1234)
    out = flash_attn_func(q, k, v, dropout_p=p, causal=True)
    state = fmha_torch.last_dropout_state()
    assert state.shape == (2,) and state.dtype == torch.int64 and state.device == q.device
    first_state = state.clone()
    out.backward(dout)
    keep = philox_reference.keep_mask(*state.tolist(), B, H, S, S, p)  # independent of the kernels
    assert abs(keep.mean() - (1 - p)) < 0.01
    ref = {"window": (-1, 0), "bottom_right": True, "dropout_p": p, "dropout_keep": keep}
    assert_close("out", out, reference.mha_fwd_ref(f64(q), f64(k), f64(v), **ref)[0])
    rdq, rdk, rdv, _ = reference.mha_bwd_ref(f64(dout), f64(q), f64(k), f64(v), **ref)
    for name, got, want in (("dq", q.grad, rdq), ("dk", k.grad, rdk), ("dv", v.grad, rdv)):
        assert_close(name, got, want)
    # each call draws a new state from torch's generator; reseeding draws the same one again
    again = flash_attn_func(q, k, v, dropout_p=p, causal=True)
    assert not torch.equal(fmha_torch.last_dropout_state(), first_state) and not torch.equal(again, out)
    torch.manual_seed(1234)
    repeat = flash_attn_func(q, k, v, dropout_p=p, causal=True)
    assert torch.equal(fmha_torch.last_dropout_state(), first_state) and int(differing_bits([repeat], [out])) == 0


@pytest.mark.parametrize("dropout_p", [0.0, 0.1], ids=["nodrop", "drop"])
def test_deterministic_backward_is_bitwise_equal_over_runs(dropout_p):
    """Every run's gradients stay alive, so that no run is handed a block holding an earlier result, and
    the blocks it gets are poisoned first; the first run matches float64 (dropout by the independent
    Philox mask of the state the forward reports), the others equal it bit for bit."""
    B, S, Hq, Hk, D = 2, 1024, 8, 2, 128
    gen = generator(9)
    q = rand((B, S, Hq, D), gen, requires_grad=True)
    k, v = (rand((B, S, Hk, D), gen, requires_grad=True) for _ in range(2))
    dout = rand((B, S, Hq, D), gen)
    out = flash_attn_func(q, k, v, dropout_p=dropout_p, causal=True, deterministic=True)
    ref = reference_options({"causal": True})
    if dropout_p:
        state = fmha_torch.last_dropout_state().tolist()
        ref.update(dropout_p=dropout_p, dropout_keep=philox_reference.keep_mask(*state, B, Hq, S, S, dropout_p))
    runs = []
    for _ in range(5):
        poison_for(q, k, v, (B, Hq, S))
        runs.append(torch.autograd.grad(out, (q, k, v), dout, retain_graph=True))
    want = reference.mha_bwd_ref(f64(dout), f64(q), f64(k), f64(v), **ref)
    for name, got, w in zip(("dq", "dk", "dv"), runs[0], want):
        assert_close(name, got, w)
    counts = [int(differing_bits(run, runs[0])) for run in runs[1:]]
    assert not any(counts), f"elements whose bits differ from the first run, by run: {counts}"


@pytest.mark.parametrize("varlen", [False, True], ids=["batch", "varlen"])
def test_opcheck_with_cuda_tensors(varlen):
    gen = generator(10)
    if varlen:
        lens_q, lens_k = [40, 7, 66], [33, 90, 66]
        q = rand((sum(lens_q), 4, 64), gen, requires_grad=True)
        k, v = (rand((sum(lens_k), 2, 64), gen, requires_grad=True) for _ in range(2))
        cu_q, cu_k = (torch.tensor([0, *np.cumsum(lens)], device="cuda", dtype=torch.int32)
                      for lens in (lens_q, lens_k))
        max_q, max_k = max(lens_q), max(lens_k)
        dropout_p, rng_state = 0.0, None
    else:
        q = rand((2, 96, 4, 64), gen, requires_grad=True)
        k, v = (rand((2, 160, 2, 64), gen, requires_grad=True) for _ in range(2))
        cu_q = cu_k = None
        max_q = max_k = 0
        dropout_p, rng_state = 0.1, torch.tensor([987654321, 12345], device="cuda", dtype=torch.int64)
    # deterministic=True: opcheck compares gradients of repeated runs
    args = (q, k, v, cu_q, cu_k, None, rng_state, max_q, max_k, None, -1, 0, dropout_p, True)
    torch.library.opcheck(torch.ops.fmha_rt.fwd.default, args)


class Attention(torch.nn.Module):
    """A GQA self-attention block whose k and v are strided views of one projection."""

    def __init__(self, dim=512, heads=8, kv_heads=2, head_dim=64):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.wq = torch.nn.Linear(dim, heads * head_dim, bias=False)
        self.wkv = torch.nn.Linear(dim, 2 * kv_heads * head_dim, bias=False)
        self.wo = torch.nn.Linear(heads * head_dim, dim, bias=False)

    def forward(self, x):
        B, S, _ = x.shape
        q = self.wq(x).view(B, S, self.heads, self.head_dim)
        k, v = self.wkv(x).view(B, S, 2, self.kv_heads, self.head_dim).unbind(2)
        out = flash_attn_func(q, k, v, causal=True, deterministic=True)
        return self.wo(out.reshape(B, S, -1))


def test_torch_compile_fullgraph_matches_eager():
    from torch._dynamo.testing import CompileCounterWithBackend

    torch.manual_seed(11)
    module = Attention().to(device="cuda", dtype=torch.bfloat16)
    gen = generator(12)
    x = rand((2, 256, 512), gen, requires_grad=True)
    dy = rand((2, 256, 512), gen)
    explained = torch._dynamo.explain(module)(x)
    assert explained.graph_count == 1 and explained.graph_break_count == 0
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(module, backend=counter, fullgraph=True)
    results = []
    for fn in (module, compiled):
        module.zero_grad(set_to_none=True)
        x.grad = None
        y = fn(x)
        y.backward(dy)
        results.append([y.detach().clone(), x.grad.clone()] + [p.grad.clone() for p in module.parameters()])
    assert counter.frame_count == 1
    for name, eager, comp in zip(["y", "dx", "dwq", "dwkv", "dwo"], *results):
        assert_close(name, comp, f64(eager))


def capture(step):
    """Warm up `step` on a side stream (kernels loaded, allocator primed), then capture it."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = step()
    return graph, static


def test_cuda_graph_replay_matches_eager():
    B, S, Hq, Hk, D = 2, 256, 8, 2, 64
    q = torch.empty((B, S, Hq, D), device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.empty((B, S, Hk, D), device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    dout = torch.empty((B, S, Hq, D), device="cuda", dtype=torch.bfloat16)

    def fill(seed):
        gen = generator(seed)
        with torch.no_grad():
            for x in (q, k, v, dout):
                x.copy_(rand(x.shape, gen))

    def step():
        out = flash_attn_func(q, k, v, causal=True, window_size=(100, -1), deterministic=True)
        return (out, *torch.autograd.grad(out, (q, k, v), dout))

    fill(13)
    graph, static = capture(step)
    for seed in (14, 15):
        fill(seed)
        graph.replay()
        eager = step()
        for name, got, want in zip(["out", "dq", "dk", "dv"], static, eager):
            assert not torch.isnan(got).any()
            assert int(differing_bits([got], [want])) == 0, f"{name}: replay differs from eager"
    ref = reference.mha_fwd_ref(f64(q), f64(k), f64(v), window=(100, 0), bottom_right=True)[0]
    assert_close("out", static[0], ref)


def test_cuda_graph_replays_draw_fresh_dropout_states():
    B, S, H, D, p = 1, 256, 4, 64, 0.25
    gen = generator(16)
    q, k, v = (rand((B, S, H, D), gen) for _ in range(3))

    def step():
        return flash_attn_func(q, k, v, dropout_p=p)

    graph, out = capture(step)
    state = fmha_torch.last_dropout_state()  # recorded at capture: the graph's own [seed, offset] tensor
    seen = []
    for _ in range(2):
        graph.replay()
        keep = fmha_rt.mha_dropout_mask(q, k, dropout_p=p, seed=state).bool()
        ref = reference.mha_fwd_ref(f64(q), f64(k), f64(v), dropout_p=p, dropout_keep=keep.cpu().numpy())[0]
        assert_close("out", out, ref)
        seen.append(state.clone())
    assert not torch.equal(seen[0], seen[1])

