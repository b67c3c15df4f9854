"""The v3 family (Hopper, Gluon) through the public API on the GPU, against the float64 reference: its
forward, and its backward (not deterministic).

The fixture has v3 run everything it serves (fmha_rt/plan/v3.py, mode 'all'); each test checks that
the call really ran in the v3 family. Outputs are poisoned with NaN before a call, inputs are fresh
random draws from printed seeds, errors are relative (below 1e-2; LSE below 1e-3) for the whole tensor,
per head and per row (tests/error_bounds.py); repeats are compared on raw bits.
"""
import pytest

from gpu_presence import require

torch = require("torch")

import fmha_rt
from error_bounds import assert_close, assert_lse_close
from fmha_rt import reference
from fmha_rt.plan import v3
from gpu_tensors import attention_f64, f64, generator, nan_like, rand, seed_of, varlen_inputs
from repeat_runs import assert_bitwise, reference_run, repeat
from test_attention import DTYPES, mask_kwargs, varlen_round_trip


@pytest.fixture(autouse=True)
def v3_enabled(monkeypatch):
    monkeypatch.setattr(v3, "MODE", "all")
    fmha_rt.clear_plan_cache()
    yield
    fmha_rt.clear_plan_cache()


def forward(q, k, v, **opts):
    B, Sq, Hq = q.shape[:3]
    out, lse = nan_like((B, Sq, Hq, v.shape[-1]), q.dtype), nan_like((B, Hq, Sq), torch.float32)
    fmha_rt.mha_fwd(q, k, v, out=out, lse=lse, **opts)
    assert fmha_rt.last_launch_info()["family"] == v3.FAMILY
    return out, lse


def backward(dout, q, k, v, out, lse, family=v3.FAMILY, **opts):
    dq, dk, dv = nan_like(q.shape, q.dtype), nan_like(k.shape, k.dtype), nan_like(v.shape, v.dtype)
    fmha_rt.mha_bwd(dout, q, k, v, out, lse, dq=dq, dk=dk, dv=dv, **opts)
    assert fmha_rt.last_launch_info()["family"] == family
    return dq, dk, dv


def case_inputs(case, dtype_name):
    """A case's q, k, v, fresh random and seeded by its name, and the generator that draws its dO next."""
    name, B, Sq, Sk, Hq, Hk, Dqk, Dv = case[:8]
    dtype = DTYPES[dtype_name]
    gen = generator(seed_of(name))
    return gen, rand((B, Sq, Hq, Dqk), dtype, gen), rand((B, Sk, Hk, Dqk), dtype, gen), rand((B, Sk, Hk, Dv), dtype, gen)


def assert_backward_close(grads, dout, q, k, v, opts):
    """dQ, dK and dV against the float64 reference of the same call."""
    ref = dict(mask_kwargs(opts, q.shape[1], k.shape[1]), softmax_scale=opts.get("softmax_scale"))
    rdq, rdk, rdv, _ = reference.mha_bwd_ref(f64(dout), f64(q), f64(k), f64(v), **ref)
    for n, got, want in zip(("dq", "dk", "dv"), grads, (rdq, rdk, rdv)):
        assert_close(n, got, want)


CASES = [
    # name, B, Sq, Sk, Hq, Hk, Dqk, Dv, opts
    ("d128", 2, 512, 512, 4, 4, 128, 128, {}),
    ("d128_causal_gqa", 2, 640, 640, 8, 2, 128, 128, {"causal": True}),
    ("d128_causal", 2, 640, 640, 4, 4, 128, 128, {"causal": True}),
    ("d128_causal_tl_keys_no_query_sees", 1, 130, 300, 2, 2, 128, 128, {"causal": True}),
    ("d64_mqa_partial_blocks", 1, 333, 777, 4, 1, 64, 64, {}),
    ("d64_causal_br_sq_lt_sk", 2, 200, 650, 2, 2, 64, 64, {"causal": True, "causal_alignment": "bottom_right"}),
    ("d96_causal_tl_sq_gt_sk", 2, 300, 130, 2, 2, 96, 96, {"causal": True}),
    ("d80_window", 2, 333, 333, 3, 3, 80, 80, {"window": (40, 7)}),
    ("d64_window_br", 1, 100, 257, 2, 2, 64, 64, {"window": (16, 16), "causal_alignment": "bottom_right"}),
    ("d64_128", 1, 256, 384, 2, 2, 64, 128, {"causal": True}),
    ("d56_short", 3, 17, 9, 2, 1, 56, 56, {}),
    # the 64 tile over many key blocks and the group's heads, a partial last query block in both passes
    ("d64_causal_gqa_long", 1, 1100, 1100, 8, 2, 64, 64, {"causal": True}),
    ("d128_large_scale", 1, 512, 512, 2, 2, 128, 128, {"softmax_scale": 0.3}),
    # the 256 tiles: the backward is the wide kernel (two consumers sharing 64 keys, each with half the head dims)
    ("d256", 2, 512, 700, 2, 2, 256, 256, {}),
    ("d256_causal_gqa", 2, 333, 333, 4, 2, 256, 256, {"causal": True}),
    ("d192_window_br", 1, 200, 450, 2, 1, 192, 192, {"window": (50, 10), "causal_alignment": "bottom_right"}),
    # the 256/128 pair: O narrower than Q, in the first half of Q's shared-memory tile
    ("d192_128_causal_gqa", 2, 300, 300, 4, 2, 192, 128, {"causal": True}),
]


@pytest.mark.parametrize("dtype_name", ["bf16", "fp16"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_forward_and_backward_match_reference(dtype_name, case):
    Sq, Sk, opts = case[2], case[3], case[-1]
    gen, q, k, v = case_inputs(case, dtype_name)
    out, lse = forward(q, k, v, **opts)
    ref = dict(mask_kwargs(opts, Sq, Sk), softmax_scale=opts.get("softmax_scale"))
    ro, rl = reference.mha_fwd_ref(f64(q), f64(k), f64(v), **ref)
    assert_close("out", out, ro)
    assert_lse_close("lse", lse, rl)
    dout = rand(out.shape, q.dtype, gen)
    assert_backward_close(backward(dout, q, k, v, out, lse, **opts), dout, q, k, v, opts)


HEADS_CASES = [c for c in CASES if c[0] == "d128_causal_gqa"] + [
    # name, B, Sq, Sk, Hq, Hk, Dqk, Dv, opts: partial blocks, heads padded into the 128 tile, a call without a
    # mask, a sliding window, more queries than keys, an 80 head padded in the tile
    ("d96_causal_gqa_br_partial", 1, 333, 777, 6, 2, 96, 96, {"causal": True, "causal_alignment": "bottom_right"}),
    ("d128_mqa_partial_blocks", 1, 333, 777, 4, 1, 128, 128, {}),
    ("d128_gqa_window", 2, 333, 500, 8, 2, 128, 128, {"window": (60, 20)}),
    ("d80_causal_gqa_tl_sq_gt_sk", 1, 400, 200, 4, 2, 80, 80, {"causal": True}),
]


@pytest.fixture
def heads_everywhere(monkeypatch):
    """GQA's dK/dV by query head (v3.BWD_HEADS_GQA_SEQLEN_K) at every length, with and without a mask."""
    monkeypatch.setattr(v3, "BWD_HEADS_GQA_SEQLEN_K",
                        {(pair, causal): (0, 1 << 31) for pair in v3.BWD_HEADS_PAIRS for causal in (False, True)})
    fmha_rt.clear_plan_cache()


def ran_heads(expected=True):
    assert any(key.startswith("fmha_bwd_dkdv_heads") for key in fmha_rt.last_launch_info()["kernels"]) == expected


@pytest.mark.parametrize("dtype_name", ["bf16", "fp16"])
@pytest.mark.parametrize("case", HEADS_CASES, ids=[c[0] for c in HEADS_CASES])
def test_gqa_programs_of_one_query_head_match_reference(case, dtype_name, heads_everywhere):
    """GQA's dK/dV by query head (the `heads` objects): dK and dV added over the group's heads into fp32
    accumulators, then converted, against float64 (the poisoned outputs show that the conversion wrote every
    element)."""
    opts = case[-1]
    gen, q, k, v = case_inputs(case, dtype_name)
    out, lse = forward(q, k, v, **opts)
    dout = rand(out.shape, q.dtype, gen)
    grads = backward(dout, q, k, v, out, lse, **opts)
    ran_heads(q.shape[2] != k.shape[2])
    assert_backward_close(grads, dout, q, k, v, opts)


def test_gqa_programs_of_one_query_head_over_varlen_with_empty_and_single_token_sequences(heads_everywhere):
    def ran_in_v3():
        assert fmha_rt.last_launch_info()["family"] == v3.FAMILY

    varlen_round_trip([37, 0, 1, 300, 64], [50, 3, 1, 129, 0], 8, 2, 128, seed=16, after_each_call=ran_in_v3)
    ran_heads()


LATENT_CASES = [
    # name, B, Sq, Sk, Hq, Hk, Dqk, Dv, opts: heads the (192, 128) backward tile holds, dims below it zero-filled
    ("d192_128", 2, 512, 700, 4, 4, 192, 128, {}),
    ("d192_128_causal_gqa", 2, 333, 333, 4, 2, 192, 128, {"causal": True}),
    ("d160_96_window_br", 1, 200, 450, 2, 1, 160, 96, {"window": (50, 10), "causal_alignment": "bottom_right"}),
]


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "ordered"])
@pytest.mark.parametrize("dtype_name", ["bf16", "fp16"])
@pytest.mark.parametrize("case", LATENT_CASES, ids=[c[0] for c in LATENT_CASES])
def test_the_192_128_backward_tile_matches_reference(case, dtype_name, deterministic, monkeypatch):
    """The (192, 128) backward tile (v3.LATENT_BWD_TILE) of two consumers of keys, both strategies (the ORDERED
    form's consumers adding dQ themselves, v3.33), whose ORDERED repeats are bitwise equal to its first run."""
    assert v3.LATENT_BWD_TILE  # the default
    monkeypatch.setattr(v3, "ORDERED_FOR_DETERMINISTIC", frozenset(v3.ARCHS) if deterministic else frozenset())
    fmha_rt.clear_plan_cache()
    name, Sq, Sk, opts = case[0], case[2], case[3], case[-1]
    gen, q, k, v = case_inputs(case, dtype_name)
    out, lse = forward(q, k, v, **opts)
    dout = rand(out.shape, q.dtype, gen)

    def call(outputs, stream):
        dq, dk, dv = outputs
        fmha_rt.mha_bwd(dout, q, k, v, out, lse, dq=dq, dk=dk, dv=dv, deterministic=deterministic, stream=stream, **opts)
        strategy = v3.DQ_ORDERED if deterministic else v3.DQ_ATOMIC
        assert v3.dkdv_key(dtype_name, v3.LATENT_PAIR, strategy) in fmha_rt.last_launch_info()["kernels"]

    specs = [(t.shape, t.dtype) for t in (q, k, v)]
    first = reference_run(call, specs)
    ref = dict(mask_kwargs(opts, Sq, Sk), softmax_scale=opts.get("softmax_scale"))
    rdq, rdk, rdv, _ = reference.mha_bwd_ref(f64(dout), f64(q), f64(k), f64(v), **ref)
    for n, got, want in zip(("dq", "dk", "dv"), first, (rdq, rdk, rdv)):
        assert_close(f"{name} {n}", got, want)
    if deterministic:
        assert_bitwise(f"{name} ordered", repeat(call, specs, torch.cuda.Stream(), 3), first)


def test_the_192_128_backward_tile_over_varlen_with_empty_and_single_token_sequences():
    """The atomic (192, 128) tile's key blocks and pieces of dQ cut at each sequence's end, sequences of no and
    of one token among them, GQA 4/2."""
    def ran_the_tile():
        launched = fmha_rt.last_launch_info()
        assert launched["family"] == v3.FAMILY
        backward = any(key.startswith("fmha_bwd") for key in launched["kernels"])
        assert (v3.dkdv_key("bf16", v3.LATENT_PAIR) in launched["kernels"]) == backward

    varlen_round_trip([37, 0, 1, 300, 64], [50, 3, 1, 260, 0], 4, 2, 192, seed=17, after_each_call=ran_the_tile,
                      head_dim_v=128)


RUN_CASES = [
    # name, B, Sq, Sk, Hq, Hk, Dqk, Dv: runs of 4 query blocks cut at the sequence's end (6 and 9 blocks), GQA, MQA
    ("d128_six_blocks_gqa", 2, 700, 900, 4, 2, 128, 128),
    ("d100_nine_blocks_mqa", 1, 1100, 333, 4, 1, 100, 100),
]


def set_runs(monkeypatch, on):
    """The forward's runs of query blocks (v3.FWD_RUN_TILES; by default GQA calls without a mask below 8k keys)
    at every length with and without GQA, or nowhere."""
    lengths = {(pair, gqa): (0, float("inf")) for pair in v3.FWD_RUN_TILES for gqa in (False, True)} if on else {}
    monkeypatch.setattr(v3, "FWD_RUN_SEQLEN_K", lengths)
    fmha_rt.clear_plan_cache()


@pytest.fixture
def runs_on(monkeypatch):
    set_runs(monkeypatch, True)


def ran_in_runs(expected=True):
    kernels = fmha_rt.last_launch_info()["kernels"]
    assert any("_run" in name for name in kernels) == expected, kernels


@pytest.mark.parametrize("dtype_name", ["bf16", "fp16"])
@pytest.mark.parametrize("case", RUN_CASES, ids=[c[0] for c in RUN_CASES])
def test_runs_of_query_blocks_match_reference_and_one_block_programs(case, dtype_name, monkeypatch):
    """A program per run of FWD_RUN_TILES query blocks (calls without a mask): against float64, and bit for
    bit the output of a program per block (each tile takes the same steps in the same order)."""
    _, q, k, v = case_inputs(case, dtype_name)
    set_runs(monkeypatch, False)
    one_block = forward(q, k, v)
    ran_in_runs(False)
    set_runs(monkeypatch, True)
    out, lse = forward(q, k, v)
    ran_in_runs()
    ro, rl = reference.mha_fwd_ref(f64(q), f64(k), f64(v))
    assert_close("out", out, ro)
    assert_lse_close("lse", lse, rl)
    assert_bitwise("runs against one block a program", [[out, lse]], list(one_block))


def test_runs_of_query_blocks_over_varlen_with_empty_and_single_token_sequences(runs_on):
    lens_q, lens_k = [700, 0, 1, 513, 64], [300, 5, 1, 7, 129]
    cu_q, cu_k, q, k, v, _ = varlen_inputs(lens_q, lens_k, 4, 2, 128, seed=41)
    tq = sum(lens_q)
    out, lse = nan_like((tq, 4, 128), q.dtype), nan_like((4, tq), torch.float32)
    fmha_rt.mha_varlen_fwd(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), out=out, lse=lse)
    ran_in_runs()
    ro, rl = reference.mha_varlen_fwd_ref(f64(q), f64(k), f64(v), cu_q.cpu().numpy(), cu_k.cpu().numpy())
    assert_close("out", out, ro)
    assert_lse_close("lse", lse, rl)


def test_fully_masked_rows_give_zero_output_and_minus_inf_lse():
    # bottom-right causal with Sq > Sk: the first Sq - Sk query rows see no key
    gen = generator(5)
    q, k, v = rand((1, 200, 2, 64), torch.bfloat16, gen), rand((1, 64, 2, 64), torch.bfloat16, gen), \
        rand((1, 64, 2, 64), torch.bfloat16, gen)
    out, lse = forward(q, k, v, causal=True, causal_alignment="bottom_right")
    assert torch.all(out[:, :136] == 0) and torch.all(torch.isneginf(lse[:, :, :136]))
    assert not torch.isnan(out).any()
    ro, rl = reference.mha_fwd_ref(f64(q), f64(k), f64(v), window=(-1, 0), bottom_right=True)
    assert_close("out", out, ro)
    assert_lse_close("lse", lse, rl)


@pytest.mark.parametrize("head_dim", [128, 256])
def test_varlen_with_empty_and_single_token_sequences(head_dim):
    def ran_in_v3():
        assert fmha_rt.last_launch_info()["family"] == v3.FAMILY

    varlen_round_trip([37, 0, 1, 300, 64], [50, 3, 1, 129, 0], 4, 2, head_dim, seed=15, after_each_call=ran_in_v3)


def test_the_deterministic_backward_stays_portable_and_agrees():
    gen = generator(23)
    q, k, v, dout = (rand((2, 512, 4, 128), torch.bfloat16, gen) for _ in range(4))
    out, lse = forward(q, k, v, causal=True)
    fast = backward(dout, q, k, v, out, lse, causal=True)
    det = [nan_like(t.shape, t.dtype) for t in (q, k, v)]
    fmha_rt.mha_bwd(dout, q, k, v, out, lse, dq=det[0], dk=det[1], dv=det[2], causal=True, deterministic=True)
    assert fmha_rt.last_launch_info()["family"] == "portable"
    want = attention_f64(q, k, v, causal=True, dout=dout)[2:]
    for name, a, b, w in zip(("dq", "dk", "dv"), fast, det, want):
        assert_close(f"v3 {name}", a, w)
        assert_close(f"portable {name}", b, w)


def test_forward_bitwise_equal_over_runs_streams_and_plan_cache_hits():
    """Runs on the current stream and a side stream (given as stream=, ordered against the poison and
    the snapshots), re-poisoned before each, bitwise equal to a reference run that matches float64; the
    third call and later hit the plan cache (its own descriptor scratch)."""
    gen = generator(21)
    q, k, v = (rand((2, 1000, 8, 128), torch.bfloat16, gen) for _ in range(3))

    def call(outputs, stream):
        fmha_rt.mha_fwd(q, k, v, out=outputs[0], lse=outputs[1], causal=True, stream=stream)
        assert fmha_rt.last_launch_info()["family"] == v3.FAMILY

    specs = [(q.shape, q.dtype), ((2, 8, 1000), torch.float32)]
    first = reference_run(call, specs)
    want_out, want_lse = attention_f64(q, k, v, causal=True)
    assert_close("out", first[0], want_out)
    assert_lse_close("lse", first[1], want_lse)
    assert_bitwise("current stream", repeat(call, specs, torch.cuda.current_stream(), 5), first)
    assert_bitwise("side stream", repeat(call, specs, torch.cuda.Stream(), 5), first)
    assert fmha_rt.plan_cache_info()["hits"] >= 9


def test_long_causal_sequence_and_the_rows_it_samples():
    B, S, H, D = 1, 32768, 2, 128
    gen = generator(18)
    q, k, v = (rand((B, S, H, D), torch.bfloat16, gen) for _ in range(3))
    out, lse = forward(q, k, v, causal=True)
    assert not out.isnan().any() and not lse.isnan().any(), "unwritten output elements"
    rows = torch.tensor([0, 1, 127, 128, 4097, 20000, S - 129, S - 128, S - 1], device="cuda")
    want_out, want_lse = attention_f64(q, k, v, causal=True, rows=rows)
    assert_close("out (sampled rows)", out[:, rows], want_out)
    assert_lse_close("lse (sampled rows)", lse[:, :, rows], want_lse)
