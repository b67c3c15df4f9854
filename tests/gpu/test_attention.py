"""The portable FMHA kernels through the public API on the GPU, against the float64 reference.

Every output is poisoned with NaN before the call (so an unwritten element fails), inputs are fresh
random draws from printed seeds, and errors are bounded for the whole tensor (||out - ref|| / ||ref||
below 1e-2, bf16/fp16 inputs), per head and per row (tests/error_bounds.py). Repeats are compared on
raw bits, into outputs re-poisoned before each run (tests/gpu/repeat_runs.py).
"""
import numpy as np
import pytest

from gpu_presence import require

torch = require("torch")

import fmha_rt
import philox_reference
from error_bounds import TOL, assert_close, assert_lse_close
from fmha_rt import reference
from fmha_rt.plan import v3
from gpu_tensors import attention_f64, f64, generator, nan_like, rand, seed_of, varlen_inputs
from repeat_runs import assert_bitwise, reference_run, repeat

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


CASES = [
    # name, B, Sq, Sk, Hq, Hk, Dqk, Dv, opts
    ("d64", 2, 256, 256, 4, 4, 64, 64, {}),
    ("d128_causal", 2, 384, 384, 4, 4, 128, 128, {"causal": True}),
    ("d32_gqa", 2, 200, 300, 8, 2, 32, 32, {}),
    ("d256_mqa_causal_br", 1, 160, 330, 4, 1, 256, 256, {"causal": True, "causal_alignment": "bottom_right"}),
    ("d96_causal_tl_sq_gt_sk", 2, 300, 130, 2, 2, 96, 96, {"causal": True}),
    ("d192_128", 1, 256, 256, 2, 2, 192, 128, {"causal": True}),
    ("d80_window", 2, 333, 333, 3, 3, 80, 80, {"window": (40, 7)}),
    ("d64_window_br", 1, 100, 257, 2, 2, 64, 64, {"window": (16, 16), "causal_alignment": "bottom_right"}),
    ("d40_masktype2", 1, 65, 190, 2, 1, 40, 40, {"mask_type": 2}),
    ("d128_large_scale", 1, 512, 512, 2, 2, 128, 128, {"softmax_scale": 0.3}),
]


def mask_kwargs(opts, sq, sk):
    """The reference's (window, bottom_right) for the API options."""
    window = list(opts.get("window", (-1, -1)))
    bottom_right = opts.get("causal_alignment") == "bottom_right"
    if opts.get("causal"):
        window[1] = 0
    if opts.get("mask_type") == 2:
        window, bottom_right = [window[0], 0], True
    return {"window": tuple(window), "bottom_right": bottom_right}


def run_case(dtype_name, B, Sq, Sk, Hq, Hk, Dqk, Dv, opts, seed, deterministic=False, extra=None):
    dtype = DTYPES[dtype_name]
    gen = generator(seed)
    q, k = rand((B, Sq, Hq, Dqk), dtype, gen), rand((B, Sk, Hk, Dqk), dtype, gen)
    v, dout = rand((B, Sk, Hk, Dv), dtype, gen), rand((B, Sq, Hq, Dv), dtype, gen)
    extra = extra or {}
    out, lse = nan_like((B, Sq, Hq, Dv), dtype), nan_like((B, Hq, Sq), torch.float32)
    fmha_rt.mha_fwd(q, k, v, out=out, lse=lse, **opts, **extra)
    dq, dk, dv = nan_like(q.shape, dtype), nan_like(k.shape, dtype), nan_like(v.shape, dtype)
    fmha_rt.mha_bwd(dout, q, k, v, out, lse, dq=dq, dk=dk, dv=dv, deterministic=deterministic, **opts, **extra)
    return q, k, v, dout, out, lse, dq, dk, dv


def check_against_reference(case, opts):
    """run_case's results against the float64 reference for the API options `opts`."""
    q, k, v, dout, out, lse, dq, dk, dv = case
    ref_opts = dict(mask_kwargs(opts, q.shape[1], k.shape[1]), softmax_scale=opts.get("softmax_scale"))
    ro, rl = reference.mha_fwd_ref(f64(q), f64(k), f64(v), **ref_opts)
    assert_close("out", out, ro)
    assert_lse_close("lse", lse, rl)
    rdq, rdk, rdv, _ = reference.mha_bwd_ref(f64(dout), f64(q), f64(k), f64(v), **ref_opts)
    for name, got, want in (("dq", dq, rdq), ("dk", dk, rdk), ("dv", dv, rdv)):
        assert_close(name, got, want)


@pytest.mark.parametrize("dtype_name", ["bf16", "fp16"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_forward_and_backward_match_reference(dtype_name, case):
    name, B, Sq, Sk, Hq, Hk, Dqk, Dv, opts = case
    check_against_reference(run_case(dtype_name, B, Sq, Sk, Hq, Hk, Dqk, Dv, opts, seed=seed_of(name)), opts)


def test_fully_masked_rows_give_zero_output_and_minus_inf_lse():
    # bottom-right causal with Sq > Sk: the first Sq - Sk query rows see no key
    opts = {"causal": True, "causal_alignment": "bottom_right"}
    case = run_case("bf16", 1, 200, 64, 2, 2, 64, 64, opts, seed=5)
    q, k, v, dout, out, lse, dq, dk, dv = case
    assert torch.all(out[:, :136] == 0) and torch.all(torch.isneginf(lse[:, :, :136]))
    assert torch.all(dq[:, :136] == 0)
    check_against_reference(case, opts)  # dK and dV too


@pytest.mark.parametrize("shape", [(1, 1), (2, 1), (1, 4), (2, 4)], ids=["11SS", "B1SS", "1HSS", "BHSS"])
def test_bias_and_dbias_in_every_broadcast_shape(shape):
    B, S, H, D = 2, 192, 4, 64
    gen = generator(11)
    bias = rand((shape[0], shape[1], S, S), torch.bfloat16, gen)
    q, k, v, dout, out, lse, dq, dk, dv = run_case("bf16", B, S, S, H, H, D, D, {"causal": True}, seed=12,
                                                    extra={"bias": bias})
    dbias = nan_like(bias.shape, torch.bfloat16)
    fmha_rt.mha_bwd(dout, q, k, v, out, lse, dq=dq, dk=dk, dv=dv, dbias=dbias, causal=True, bias=bias)
    ref = dict(window=(-1, 0), bias=f64(bias))
    ro, _ = reference.mha_fwd_ref(f64(q), f64(k), f64(v), **ref)
    assert_close("out", out, ro)
    rdq, rdk, rdv, rdb = reference.mha_bwd_ref(f64(dout), f64(q), f64(k), f64(v), **ref)
    for n, got, want in (("dq", dq, rdq), ("dk", dk, rdk), ("dv", dv, rdv)):
        assert_close(n, got, want)
    assert_close("dbias", dbias, rdb, head_axis=-3)


def test_bias_with_unaligned_key_count_gets_a_padded_dbias():
    """Sk = 90: the bias comes in rows padded to 96 elements (strides must be multiples of 8); the dbias
    fmha_rt allocates is padded the same way and returned as a [.., Sq, 90] view."""
    B, Sq, Sk, H, D = 2, 70, 90, 2, 64
    gen = generator(13)
    bias = rand((1, H, Sq, 96), torch.bfloat16, gen)[..., :Sk]
    q, k, v, dout, out, lse, dq, dk, dv = run_case("bf16", B, Sq, Sk, H, H, D, D, {}, seed=14,
                                                    extra={"bias": bias})
    *_, dbias = fmha_rt.mha_bwd(dout, q, k, v, out, lse, dq=dq, dk=dk, dv=dv, bias=bias)
    assert dbias.shape == bias.shape and dbias.stride(-2) == 96
    rdb = reference.mha_bwd_ref(f64(dout), f64(q), f64(k), f64(v), bias=f64(bias))[3]
    assert_close("dbias", dbias, rdb, head_axis=-3)


@pytest.mark.parametrize("per_batch", [False, True])
def test_alibi(per_batch):
    B, S, H, D = 2, 256, 4, 64
    slopes = torch.rand((B, H) if per_batch else (H,), device="cuda", dtype=torch.float32) * 0.5
    q, k, v, dout, out, lse, dq, dk, dv = run_case("bf16", B, S, S, H, H, D, D, {"causal": True}, seed=13,
                                                    extra={"alibi_slopes": slopes})
    ref = dict(window=(-1, 0), alibi_slopes=f64(slopes))
    assert_close("out", out, reference.mha_fwd_ref(f64(q), f64(k), f64(v), **ref)[0])
    rdq, rdk, rdv, _ = reference.mha_bwd_ref(f64(dout), f64(q), f64(k), f64(v), **ref)
    for n, got, want in (("dq", dq, rdq), ("dk", dk, rdk), ("dv", dv, rdv)):
        assert_close(n, got, want)


def test_dropout_matches_reference_with_an_independent_philox_mask():
    """The keep mask comes from tests/philox_reference.py; the kernels' own mask must equal it."""
    B, S, H, D, p = 2, 200, 2, 64, 0.2
    drop = {"dropout_p": p, "seed": 1234, "offset": 77}
    q, k, v, dout, out, lse, dq, dk, dv = run_case("bf16", B, S, S, H, H, D, D, {}, seed=14, extra=drop)
    keep = philox_reference.keep_mask(1234, 77, B, H, S, S, p)
    assert abs(keep.mean() - (1 - p)) < 0.01
    assert np.array_equal(fmha_rt.mha_dropout_mask(q, k, **drop).cpu().numpy(), keep)
    ref = dict(dropout_p=p, dropout_keep=keep)
    assert_close("out", out, reference.mha_fwd_ref(f64(q), f64(k), f64(v), **ref)[0])
    rdq, rdk, rdv, _ = reference.mha_bwd_ref(f64(dout), f64(q), f64(k), f64(v), **ref)
    for n, got, want in (("dq", dq, rdq), ("dk", dk, rdk), ("dv", dv, rdv)):
        assert_close(n, got, want)


def varlen_round_trip(lens_q, lens_k, heads_q, heads_k, head_dim, seed, after_each_call=lambda: None, head_dim_v=None):
    """The varlen forward and backward (causal, bottom-right) of fresh inputs against the float64 reference;
    after_each_call runs after each of the two calls."""
    cu_q, cu_k, q, k, v, dout = varlen_inputs(lens_q, lens_k, heads_q, heads_k, head_dim, seed=seed,
                                              head_dim_v=head_dim_v)
    tq = sum(lens_q)
    out, lse = nan_like((tq, heads_q, v.shape[-1]), q.dtype), nan_like((heads_q, tq), torch.float32)
    args = (cu_q, cu_k, max(lens_q), max(lens_k))
    fmha_rt.mha_varlen_fwd(q, k, v, *args, out=out, lse=lse, causal=True, causal_alignment="bottom_right")
    after_each_call()
    dq, dk, dv = nan_like(q.shape, q.dtype), nan_like(k.shape, k.dtype), nan_like(v.shape, v.dtype)
    fmha_rt.mha_varlen_bwd(dout, q, k, v, out, lse, *args, dq=dq, dk=dk, dv=dv, causal=True,
                           causal_alignment="bottom_right")
    after_each_call()
    ref = dict(window=(-1, 0), bottom_right=True)
    cq, ck = cu_q.cpu().numpy(), cu_k.cpu().numpy()
    ro, rl = reference.mha_varlen_fwd_ref(f64(q), f64(k), f64(v), cq, ck, **ref)
    assert_close("out", out, ro)
    assert_lse_close("lse", lse, rl)
    rdq, rdk, rdv, _ = reference.mha_varlen_bwd_ref(f64(dout), f64(q), f64(k), f64(v), cq, ck, **ref)
    for n, got, want in (("dq", dq, rdq), ("dk", dk, rdk), ("dv", dv, rdv)):
        assert_close(n, got, want)


def test_varlen_with_empty_and_single_token_sequences():
    varlen_round_trip([37, 0, 1, 128, 64], [50, 3, 1, 128, 0], 4, 2, 64, seed=15)


def backward_call(dout, q, k, v, out, lse, **opts):
    """(call, output specs) for repeat_runs: the backward into given dq, dk, dv on the given stream."""
    def call(outputs, stream):
        fmha_rt.mha_bwd(dout, q, k, v, out, lse, dq=outputs[0], dk=outputs[1], dv=outputs[2], stream=stream, **opts)

    return call, [(t.shape, t.dtype) for t in (q, k, v)]


def assert_grads_close(grads, want):
    for name, got, w in zip(("dq", "dk", "dv"), grads, want, strict=True):
        assert_close(name, got, w)


@pytest.mark.parametrize("B,S,H,D,kernel", [(2, 1024, 8, 128, "fmha_bwd_dkdv_"), (2, 256, 4, 64, "fmha_bwd_single_")],
                         ids=["two_kernels", "one_launch"])
def test_deterministic_backward_is_bitwise_equal_over_runs_and_streams(B, S, H, D, kernel):
    gen = generator(16 + D)
    q, k, v, dout = (rand((B, S, H, D), torch.bfloat16, gen) for _ in range(4))
    out, lse = fmha_rt.mha_fwd(q, k, v, causal=True)
    call, specs = backward_call(dout, q, k, v, out, lse, causal=True, deterministic=True)
    first = reference_run(call, specs)
    assert fmha_rt.last_launch_info()["kernel"].startswith(kernel)
    assert_grads_close(first, attention_f64(q, k, v, causal=True, dout=dout)[2:])
    assert_bitwise("current stream", repeat(call, specs, torch.cuda.current_stream(), 4), first)
    for side in (torch.cuda.Stream(), torch.cuda.Stream()):
        assert_bitwise("side stream", repeat(call, specs, side, 3), first)


@pytest.mark.parametrize("Hq,Hk,D,opts", [(4, 4, 64, {}), (8, 8, 128, {"causal": True}), (3, 3, 32, {"window": (20, 5)})],
                         ids=["d64", "d128_causal", "d32_window"])
def test_one_launch_backward_takes_no_workspace(Hq, Hk, D, opts):
    """An MHA problem too small to fill the GPU takes the one-launch backward, whose programs keep Delta
    and Lse2 themselves: workspace_alloc is never asked, and the gradients match the float64 reference."""
    B, Sq, Sk = 2, 200, 232
    asked = []

    def alloc(nbytes, zero_init):
        asked.append(nbytes)
        return torch.empty(nbytes, dtype=torch.uint8, device="cuda")

    q, k, v, dout, out, lse, dq, dk, dv = run_case("bf16", B, Sq, Sk, Hq, Hk, D, D, opts, seed=30 + D)
    assert fmha_rt.bwd_workspace_bytes(q, k, v, **opts) == 0
    grads = [nan_like(t.shape, torch.bfloat16) for t in (q, k, v)]
    fmha_rt.mha_bwd(dout, q, k, v, out, lse, dq=grads[0], dk=grads[1], dv=grads[2], workspace_alloc=alloc, **opts)
    kernels = fmha_rt.last_launch_info()["kernels"]
    assert asked == [] and len(kernels) == 1 and kernels[0].startswith(f"fmha_bwd_single_bf16_d{D}"), kernels
    ref_opts = mask_kwargs(opts, Sq, Sk)
    rdq, rdk, rdv, _ = reference.mha_bwd_ref(f64(dout), f64(q), f64(k), f64(v), **ref_opts)
    for name, got, want in zip(("dq", "dk", "dv"), grads, (rdq, rdk, rdv)):
        assert_close(name, got, want)
    assert_bitwise("with workspace_alloc", [grads], [dq, dk, dv])  # as without the callback


@pytest.fixture
def v3_off(monkeypatch):
    """The portable family alone for a test (as FMHA_RT_V3=0 would), the plan cache cleared around it."""
    monkeypatch.setattr(v3, "MODE", "off")
    fmha_rt.clear_plan_cache()
    yield
    fmha_rt.clear_plan_cache()


@pytest.mark.parametrize("hq, hk", [(3, 3), (6, 2)], ids=["mha", "gqa"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_fused_backward_at_long_keys_matches_float64_and_is_bitwise_reproducible(causal, hq, hk, v3_off):
    """D=128 from 4096 keys takes the portable family's fused backward (one grid of dK/dV and dQ programs; with
    GQA the dK/dV programs loop over the group's heads and come first): against a float64 autograd reference
    computed on the GPU, and bitwise equal over runs and on a second stream. The v3 family is off here: on
    sm_90 deterministic calls take its ORDERED form where that measured faster."""
    B, S, D = 1, 4096, 128
    gen = generator(20 + hq + causal)
    q, k, v, dout = (rand((B, S, h, D), torch.bfloat16, gen) for h in (hq, hk, hk, hq))
    out, lse = fmha_rt.mha_fwd(q, k, v, causal=causal)
    grads = [nan_like(t.shape, torch.bfloat16) for t in (q, k, v)]
    # deterministic=True: non-deterministic calls at these lengths take the v3 backward on sm_90
    fmha_rt.mha_bwd(dout, q, k, v, out, lse, causal=causal, deterministic=True, dq=grads[0], dk=grads[1], dv=grads[2])
    (fused,) = [name for name in fmha_rt.last_launch_info()["kernels"] if name.startswith("fmha_bwd_fused_bf16_d128")]
    assert fused.endswith("_mha") == (hq == hk), fused

    assert_grads_close(grads, attention_f64(q, k, v, causal=causal, dout=dout)[2:])
    call, specs = backward_call(dout, q, k, v, out, lse, causal=causal, deterministic=True)
    assert_bitwise("current stream", repeat(call, specs, torch.cuda.current_stream(), 2), grads)
    assert_bitwise("side stream", repeat(call, specs, torch.cuda.Stream(), 2), grads)


@pytest.mark.parametrize("dtype_name", ["bf16", "fp16"])
def test_short_key_forward_matches_float64_and_writes_every_row(dtype_name):
    """Causal D=128 up to 2048 keys takes the short-keys tile (two programs per SM); lengths that are not
    multiples of its blocks, so the last query and key blocks are partial. Against float64 computed on
    the GPU, outputs poisoned before the call."""
    dtype, B, Sq, Sk, Hq, Hk, D = DTYPES[dtype_name], 2, 1000, 1000, 16, 2, 128
    gen = generator(11)
    q, k, v = rand((B, Sq, Hq, D), dtype, gen), rand((B, Sk, Hk, D), dtype, gen), rand((B, Sk, Hk, D), dtype, gen)
    out, lse = nan_like((B, Sq, Hq, D), dtype), nan_like((B, Hq, Sq), torch.float32)
    fmha_rt.mha_fwd(q, k, v, out=out, lse=lse, causal=True)
    assert fmha_rt.last_launch_info()["kernels"] == [f"fmha_fwd_{dtype_name}_d128_nobias_nodrop_short"]
    want_out, want_lse = attention_f64(q, k, v, causal=True)
    assert_close("out", out, want_out)
    assert_lse_close("lse", lse, want_lse)


def test_outputs_given_are_untouched_after_an_error():
    """Calls refused late in validation (after some of their outputs passed, up to the workspace, the
    last check before the launches) leave every given array bitwise as it was, NaN poison included."""
    B, S, Hq, Hk, D = 2, 128, 4, 2, 64  # GQA: the two-kernel backward, which takes a workspace
    gen = generator(40)
    q, dout = rand((B, S, Hq, D), torch.bfloat16, gen), rand((B, S, Hq, D), torch.bfloat16, gen)
    k, v = rand((B, S, Hk, D), torch.bfloat16, gen), rand((B, S, Hk, D), torch.bfloat16, gen)
    out, lse = fmha_rt.mha_fwd(q, k, v)
    given = {"out": nan_like(q.shape, q.dtype), "lse": nan_like((B, Hq, S), torch.float32),
             "dq": nan_like(q.shape, q.dtype), "dk": nan_like(k.shape, k.dtype), "dv": nan_like(v.shape, v.dtype)}
    grads = {name: given[name] for name in ("dq", "dk", "dv")}
    assert fmha_rt.bwd_workspace_bytes(q, k, v, deterministic=True) > 0
    refused = {
        "lse dtype": (fmha_rt.FmhaTypeError, lambda: fmha_rt.mha_fwd(
            q, k, v, out=given["out"], lse=nan_like((B, Hq, S), torch.float16))),
        "bad window": (fmha_rt.FmhaValueError, lambda: fmha_rt.mha_fwd(
            q, k, v, out=given["out"], lse=given["lse"], window=(-5, 0))),
        "dv dtype": (fmha_rt.FmhaTypeError, lambda: fmha_rt.mha_bwd(
            dout, q, k, v, out, lse, dq=given["dq"], dk=given["dk"], dv=nan_like(v.shape, torch.float32))),
        "workspace too small": (fmha_rt.FmhaValueError, lambda: fmha_rt.mha_bwd(
            dout, q, k, v, out, lse, deterministic=True, **grads,
            workspace_alloc=lambda nbytes, zero_init: torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda"))),
        "workspace overlaps dq": (fmha_rt.FmhaValueError, lambda: fmha_rt.mha_bwd(
            dout, q, k, v, out, lse, deterministic=True, **grads,
            workspace_alloc=lambda nbytes, zero_init: given["dq"].view(torch.uint8).view(-1)[:nbytes])),
    }
    arrays = [q, k, v, dout, out, lse, *given.values()]
    before = [t.clone() for t in arrays]
    for name, (error, call) in refused.items():
        with pytest.raises(error):
            call()
        torch.cuda.synchronize()
        assert_bitwise(f"after '{name}'", [arrays], before)


def test_outputs_are_allocated_as_torch_tensors_on_the_input_device():
    gen = generator(17)
    q, k, v = (rand((1, 128, 2, 64), torch.float16, gen) for _ in range(3))
    out, lse = fmha_rt.mha_fwd(q, k, v)
    assert isinstance(out, torch.Tensor) and out.device == q.device and out.dtype == q.dtype
    assert lse.dtype == torch.float32 and lse.shape == (1, 2, 128)
    info = fmha_rt.last_launch_info()
    assert info["family"] == "portable" and info["kernel"].startswith("fmha_fwd_fp16_d64")


def test_long_sequence_64k():
    """Every output element written (poisoned before), and sampled query rows (block edges among them)
    against the float64 reference computed for exactly those rows, bounded per row."""
    B, S, H, D = 1, 65536, 2, 64
    gen = generator(18)
    q, k, v = (rand((B, S, H, D), torch.bfloat16, gen) for _ in range(3))
    out, lse = nan_like((B, S, H, D), torch.bfloat16), nan_like((B, H, S), torch.float32)
    fmha_rt.mha_fwd(q, k, v, out=out, lse=lse, causal=True)
    assert not out.isnan().any() and not lse.isnan().any(), "unwritten output elements"
    rows = torch.tensor([0, 1, 63, 64, 127, 128, 4097, 33333, 65471, 65472, 65535], device="cuda")
    want_out, want_lse = attention_f64(q, k, v, causal=True, rows=rows)
    assert_close("out (sampled rows)", out[:, rows], want_out)
    assert_lse_close("lse (sampled rows)", lse[:, :, rows], want_lse)


def test_batch_with_more_than_2_pow_31_elements():
    """Batches that start past element 2^31 (the last at 1039 * 2^21): outputs poisoned before the calls
    are written everywhere, and the first, a middle and the last batch match the float64 reference, per
    head and per row (distinct q, k, v, so that a mixed-up pointer shows)."""
    B, S, H, D = 1040, 1024, 16, 128
    assert (B - 1) * S * H * D > 2**31
    gen = generator(19)
    q, k, v, dout = (rand((B, S, H, D), torch.bfloat16, gen) for _ in range(4))
    out, lse = nan_like(q.shape, q.dtype), nan_like((B, H, S), torch.float32)
    fmha_rt.mha_fwd(q, k, v, out=out, lse=lse, causal=True)
    grads = [nan_like(q.shape, q.dtype) for _ in range(3)]
    fmha_rt.mha_bwd(dout, q, k, v, out, lse, dq=grads[0], dk=grads[1], dv=grads[2], causal=True, deterministic=True)
    names = ("out", "lse", "dq", "dk", "dv")
    for name, t in zip(names, (out, lse, *grads)):
        assert not t.isnan().any(), f"{name}: unwritten elements"
    for b in (0, B // 2, B - 1):
        one = slice(b, b + 1)
        want = attention_f64(q[one], k[one], v[one], causal=True, dout=dout[one])
        for name, got, w in zip(names, (out[one], lse[one], *(g[one] for g in grads)), want, strict=True):
            (assert_lse_close if name == "lse" else assert_close)(f"batch {b}: {name}", got, w)


def test_cupy_arrays_in_cupy_arrays_out():
    cupy = require("cupy")
    rng = np.random.default_rng(20)
    q, k, v, dout = (rng.standard_normal((1, 128, 2, 64)).astype(np.float16) for _ in range(4))
    qc, kc, vc, dc = (cupy.asarray(a) for a in (q, k, v, dout))
    out, lse = fmha_rt.mha_fwd(qc, kc, vc, causal=True)
    assert isinstance(out, cupy.ndarray) and isinstance(lse, cupy.ndarray)
    dq, dk, dv = fmha_rt.mha_bwd(dc, qc, kc, vc, out, lse, causal=True)
    assert isinstance(dq, cupy.ndarray)
    ro, rl = reference.mha_fwd_ref(q, k, v, window=(-1, 0))
    rdq, rdk, rdv, _ = reference.mha_bwd_ref(dout, q, k, v, window=(-1, 0))
    for name, got, want in (("out", out, ro), ("lse", lse, rl), ("dq", dq, rdq), ("dk", dk, rdk), ("dv", dv, rdv)):
        got = cupy.asnumpy(got).astype(np.float64)
        assert reference.rel_err(got, want) < TOL, name


def test_jax_arrays_in_eager_mode():
    jax = require("jax")
    assert any(d.platform == "gpu" for d in jax.devices()), "a GPU is present but this JAX has no GPU platform"
    rng = np.random.default_rng(21)
    q, k, v = (rng.standard_normal((1, 128, 2, 64)).astype(np.float16) for _ in range(3))
    gpu = jax.devices("gpu")[0]
    out, lse = fmha_rt.mha_fwd(*(jax.device_put(a, gpu) for a in (q, k, v)))
    assert isinstance(out, jax.Array)
    ro, rl = reference.mha_fwd_ref(q, k, v)
    assert reference.rel_err(np.asarray(out).astype(np.float64), ro) < TOL
    assert reference.rel_err(np.asarray(lse).astype(np.float64), rl) < 1e-3


def test_varlen_with_numpy_cu_seqlens_equals_device_cu_seqlens():
    lens = [17, 64, 1, 40]
    cu = np.array([0] + list(np.cumsum(lens)), np.int32)
    gen = generator(22)
    q, k, v = (rand((int(cu[-1]), 2, 64), torch.float16, gen) for _ in range(3))
    host_out, host_lse = nan_like(q.shape, q.dtype), nan_like((2, int(cu[-1])), torch.float32)
    fmha_rt.mha_varlen_fwd(q, k, v, cu, cu, max(lens), max(lens), out=host_out, lse=host_lse, causal=True)
    want_out, want_lse = reference.mha_varlen_fwd_ref(f64(q), f64(k), f64(v), cu, cu, window=(-1, 0))
    assert_close("out", host_out, want_out)
    assert_lse_close("lse", host_lse, want_lse)
    dev_cu = torch.from_numpy(cu).cuda()
    out, lse = nan_like(q.shape, q.dtype), nan_like((2, int(cu[-1])), torch.float32)
    fmha_rt.mha_varlen_fwd(q, k, v, dev_cu, dev_cu, max(lens), max(lens), out=out, lse=lse, causal=True)
    assert_bitwise("device cu_seqlens", [[out, lse]], [host_out, host_lse])
