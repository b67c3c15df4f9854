"""fmha_rt.torch's two routes on the GPU (issue 37): an eager call (the eager autograd function), the
registered ops called eagerly (the route every call took before) and a torch.compile(fullgraph=True)
graph (the registered ops inside inductor's graph) give bitwise-equal outputs, lse and gradients, and
the eager call's match the float64 reference.

The backward is deterministic=True throughout (bitwise repeatable), and torch's generator is seeded
before each step so that every route draws the same dropout state (inductor draws with torch's own
random ops: fallback_random). Inputs are fresh random draws with printed seeds; before each step the
blocks torch's caching allocator will hand out are filled with NaN (gpu_tensors.poison_for).
"""
import contextlib

import pytest

from gpu_presence import require  # noqa: E402

torch = require("torch")

import fmha_rt  # noqa: E402
from fmha_rt import reference, torch_eager  # noqa: E402
from fmha_rt import torch as fmha_torch  # noqa: E402
from error_bounds import assert_close  # noqa: E402
from gpu_tensors import f64, poison_for, rand, varlen_inputs  # noqa: E402
from torch._inductor import config as inductor_config  # noqa: E402

TOL = 1e-2  # bf16, relative to the float64 reference
LSE_TOL = 1e-3

# name, B, Sq, Sk, Hq, Hk, D, options ("alibi": fp32 slopes [Hq])
BATCH_CASES = [
    ("causal_gqa", 2, 256, 256, 8, 2, 64, {"causal": True}),
    ("window_scale_sq_lt_sk", 1, 200, 333, 4, 4, 128, {"window_size": (64, 16), "softmax_scale": 0.2}),
    ("alibi_dropout", 2, 192, 192, 4, 4, 64, {"causal": True, "dropout_p": 0.15, "alibi": True}),
    ("d60_zero_padded", 1, 128, 160, 2, 1, 60, {"causal": True}),
]


def bits(t):
    """The raw bits of a tensor (NaN and -inf compare by value here, never as unequal floats)."""
    return t.detach().contiguous().view(torch.uint8)


def assert_bitwise_equal(route, got, want):
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        assert a.shape == b.shape and a.dtype == b.dtype, f"{route} {name}: {a.shape} {a.dtype} vs {b.shape} {b.dtype}"
        assert torch.equal(bits(a), bits(b)), f"{route}: {name} differs from the eager call's"




def compiled(attention):
    torch._dynamo.reset()
    return torch.compile(attention, fullgraph=True)


def steps(attention, inputs, dout, lse_shape, seed):
    """(out, lse, dq, dk, dv) of one step of `attention` by each route, eager first."""
    results = {}
    routes = {"eager": (attention, contextlib.nullcontext), "registered ops": (attention, torch_eager.registered_ops_only),
              "compiled": (compiled(attention), contextlib.nullcontext)}
    with inductor_config.patch(fallback_random=True):
        for route, (call, context) in routes.items():
            poison_for(*inputs, lse_shape)
            torch.manual_seed(seed)
            with context():
                out, lse, _ = call(*inputs)
                results[route] = (out, lse, *torch.autograd.grad(out, inputs, dout))
            if route == "eager":
                assert type(out.grad_fn).__name__ == "EagerAttentionBackward"
                results["dropout state"] = fmha_torch.last_dropout_state()
    return results


@pytest.mark.parametrize("case", BATCH_CASES, ids=[c[0] for c in BATCH_CASES])
def test_eager_registered_and_compiled_routes_agree_bitwise_and_match_the_reference(case):
    name, B, Sq, Sk, Hq, Hk, D, options = case
    seed = sum(map(ord, name))
    print(f"seed {seed}")
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (rand(s, torch.bfloat16, gen).requires_grad_() for s in ((B, Sq, Hq, D), (B, Sk, Hk, D), (B, Sk, Hk, D)))
    dout = rand((B, Sq, Hq, D), torch.bfloat16, gen)
    options = dict(options, deterministic=True)
    slopes = torch.rand(Hq, generator=gen, device="cuda") * 0.5 if options.pop("alibi", False) else None

    def attention(q, k, v):
        return fmha_torch.flash_attn_func(q, k, v, alibi_slopes=slopes, return_attn_probs=True, **options)

    results = steps(attention, (q, k, v), dout, (B, Hq, Sq), seed)
    for route in ("registered ops", "compiled"):
        assert_bitwise_equal(route, results[route], results["eager"])

    left, right = options.get("window_size", (-1, -1))
    ref = {"window": (left, 0 if options.get("causal") else right), "bottom_right": True,
           "softmax_scale": options.get("softmax_scale")}
    if slopes is not None:
        ref["alibi_slopes"] = f64(slopes)
    if options.get("dropout_p"):
        p = options["dropout_p"]
        keep = fmha_rt.mha_dropout_mask(q.detach(), k.detach(), dropout_p=p, seed=results["dropout state"]).bool()
        ref.update(dropout_p=p, dropout_keep=keep.cpu().numpy())
    out, lse, dq, dk, dv = results["eager"]
    ro, rl = reference.mha_fwd_ref(f64(q), f64(k), f64(v), **ref)
    assert_close("out", out, ro)
    assert_close("lse", lse, rl, tol=LSE_TOL)
    for grad_name, got, want in zip(("dq", "dk", "dv"), (dq, dk, dv),
                                    reference.mha_bwd_ref(f64(dout), f64(q), f64(k), f64(v), **ref)):
        assert_close(grad_name, got, want)


def test_varlen_routes_agree_bitwise_and_match_the_reference():
    lens_q, lens_k, Hq, Hk, D, seed = [37, 0, 128, 64], [50, 3, 128, 40], 4, 2, 64, 371
    print(f"seed {seed}")
    cu_q, cu_k, q, k, v, dout = varlen_inputs(lens_q, lens_k, Hq, Hk, D, seed)
    q, k, v = (x.requires_grad_() for x in (q, k, v))

    def attention(q, k, v):
        return fmha_torch.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=True,
                                                 deterministic=True, return_attn_probs=True)

    results = steps(attention, (q, k, v), dout, (Hq, sum(lens_q)), seed)
    for route in ("registered ops", "compiled"):
        assert_bitwise_equal(route, results[route], results["eager"])
    out, lse, dq, dk, dv = results["eager"]
    cq, ck = cu_q.cpu().numpy(), cu_k.cpu().numpy()
    ref = {"window": (-1, 0), "bottom_right": True}
    ro, rl = reference.mha_varlen_fwd_ref(f64(q), f64(k), f64(v), cq, ck, **ref)
    assert_close("out", out, ro)
    assert_close("lse", lse, rl, tol=LSE_TOL)
    for grad_name, got, want in zip(("dq", "dk", "dv"), (dq, dk, dv),
                                    reference.mha_varlen_bwd_ref(f64(dout), f64(q), f64(k), f64(v), cq, ck, **ref)):
        assert_close(grad_name, got, want)
