"""Score terms (tensor bias with dbias, ALiBi) and dropout at every head-dim tile of the portable kernels
(64, 128, 256 and the 256/128 pair), against the float64 reference; dropout's keep mask comes from an
independent Philox (tests/philox_reference.py), never from the kernels, so that a mistake the mask kernel
shares with the attention kernels (one mask for every head, a counter cut to 32 bits) fails. The mask
API itself must draw that mask too. Outputs are poisoned with NaN before each call; errors are bounded
for the whole tensor, per head and per row (tests/error_bounds.py). Seeds are in the test ids or printed.
"""
import numpy as np
import pytest

from gpu_presence import require

torch = require("torch")

import fmha_rt
import philox_reference
from error_bounds import assert_close, assert_lse_close
from fmha_rt import reference
from gpu_tensors import f64, generator, nan_like, rand, seed_of, varlen_inputs
from test_attention import mask_kwargs, run_case

# name, B, Sq, Sk, Hq, Hk, Dqk, Dv, mask options: one shape per head-dim tile (96 runs in the 128 tile,
# 192/128 in the 256/128 pair)
TILES = [
    ("d64", 2, 200, 232, 4, 2, 64, 64, {"causal": True}),  # key counts a multiple of 8: the bias's row stride
    ("d96_window", 1, 192, 192, 2, 1, 96, 96, {"window": (40, 40)}),
    ("d256", 1, 130, 152, 2, 2, 256, 256, {"causal": True, "causal_alignment": "bottom_right"}),
    ("d192v128", 1, 128, 192, 2, 2, 192, 128, {}),
]
TERMS = ["bias", "alibi", "dropout"]
DROPOUT_P = 0.2
# (seed, offset) of each tile's dropout case: counters that cross 2^32 and seeds that fill the key's high word
PHILOX = {"d64": (1234, 77), "d96_window": (2**32 + 9, 2**32 - 5000), "d256": (7, 2**40), "d192v128": (2**62 + 3, 0)}


def term_options(term, tile_name, b, sq, sk, hq, gen):
    """(options for fmha_rt, options for the float64 reference) of one score term."""
    if term == "bias":
        bias = rand((1, hq, sq, sk), torch.bfloat16, gen)
        return {"bias": bias}, {"bias": f64(bias)}
    if term == "alibi":
        slopes = torch.rand((b, hq), generator=gen, device="cuda") * 0.3
        return {"alibi_slopes": slopes}, {"alibi_slopes": f64(slopes)}
    seed, offset = PHILOX[tile_name]
    print(f"philox seed {seed}, offset {offset}")
    keep = philox_reference.keep_mask(seed, offset, b, hq, sq, sk, DROPOUT_P)
    return ({"dropout_p": DROPOUT_P, "seed": seed, "offset": offset},
            {"dropout_p": DROPOUT_P, "dropout_keep": keep})


@pytest.mark.parametrize("term", TERMS)
@pytest.mark.parametrize("tile", TILES, ids=[t[0] for t in TILES])
def test_score_term_at_every_head_dim_tile(tile, term):
    name, b, sq, sk, hq, hk, dqk, dv, opts = tile
    gen = generator(seed_of(f"{name}_{term}"))
    extra, ref_extra = term_options(term, name, b, sq, sk, hq, gen)
    q, k, v, dout, out, lse, dq, dk, dv_ = run_case("bf16", b, sq, sk, hq, hk, dqk, dv, opts,
                                                     seed=seed_of(name), extra=extra)
    assert fmha_rt.last_launch_info()["family"] == "portable"
    ref = dict(mask_kwargs(opts, sq, sk), **ref_extra)
    want_out, want_lse = reference.mha_fwd_ref(f64(q), f64(k), f64(v), **ref)
    assert_close("out", out, want_out)
    assert_lse_close("lse", lse, want_lse)
    want = reference.mha_bwd_ref(f64(dout), f64(q), f64(k), f64(v), **ref)
    for grad_name, got, w in zip(("dq", "dk", "dv"), (dq, dk, dv_), want):
        assert_close(grad_name, got, w)
    if term == "bias":
        dbias = nan_like(extra["bias"].shape, torch.bfloat16)
        fmha_rt.mha_bwd(dout, q, k, v, out, lse, dq=dq, dk=dk, dv=dv_, dbias=dbias, **opts, **extra)
        assert_close("dbias", dbias, want[3], head_axis=-3)


MASKS = [
    # seed, offset, B, Hq, Sq, Sk
    (0, 0, 1, 1, 64, 64),
    (1234, 77, 2, 3, 130, 257),
    (2**32 + 5, 2**32 - 3000, 2, 4, 333, 18),
    (2**63 - 1, 2**40 + 3, 3, 2, 17, 611),
    (-(2**40) - 7, 3, 1, 2, 100, 77),  # a negative int64 seed: its two's-complement words
]


@pytest.mark.parametrize("by_pointer", [False, True], ids=["by_value", "by_pointer"])
@pytest.mark.parametrize("case", MASKS, ids=[f"seed{c[0]}_offset{c[1]}_b{c[2]}h{c[3]}_{c[4]}x{c[5]}" for c in MASKS])
def test_mask_api_draws_the_independent_philox_mask(case, by_pointer):
    seed, offset, b, h, sq, sk = case
    gen = generator(seed_of(str(case)))
    q, k = rand((b, sq, h, 64), torch.float16, gen), rand((b, sk, h, 64), torch.float16, gen)
    mask = torch.full((b, h, sq, sk), 7, dtype=torch.uint8, device="cuda")  # neither 0 nor 1
    if by_pointer:
        state = torch.tensor([seed, offset], dtype=torch.int64, device="cuda")
        fmha_rt.mha_dropout_mask(q, k, dropout_p=DROPOUT_P, seed=state, out=mask)
    else:
        fmha_rt.mha_dropout_mask(q, k, dropout_p=DROPOUT_P, seed=seed, offset=offset, out=mask)
    want = philox_reference.keep_mask(seed, offset, b, h, sq, sk, DROPOUT_P)
    got = mask.cpu().numpy()
    differ = np.argwhere(got != want)
    assert not differ.size, (f"{len(differ)} of {got.size} keep decisions differ, first at [b, h, i, j] = "
                             f"{differ[0].tolist()} (got {got[tuple(differ[0])]})")


@pytest.mark.parametrize("d", [64, 128])
def test_varlen_dropout_and_alibi_draw_the_independent_mask(d):
    """Packed sequences draw from the rows and keys of the call's maximum lengths, counted from each
    sequence's start; ALiBi slopes per sequence and head."""
    lens_q, lens_k, hq, hk = [37, 0, 1, 200, 64], [50, 3, 1, 129, 70], 4, 2
    seed, offset = 31337 + d, 2**32 - 777
    print(f"philox seed {seed}, offset {offset}")
    cu_q, cu_k, q, k, v, dout = varlen_inputs(lens_q, lens_k, hq, hk, d, seed=seed_of(f"varlen_dropout_{d}"))
    slopes = torch.rand((len(lens_q), hq), generator=generator(d), device="cuda") * 0.3
    opts = {"causal": True, "causal_alignment": "bottom_right", "dropout_p": DROPOUT_P, "seed": seed,
            "offset": offset, "alibi_slopes": slopes}
    args = (cu_q, cu_k, max(lens_q), max(lens_k))
    out, lse = nan_like(q.shape, q.dtype), nan_like((hq, q.shape[0]), torch.float32)
    fmha_rt.mha_varlen_fwd(q, k, v, *args, out=out, lse=lse, **opts)
    dq, dk, dv = nan_like(q.shape, q.dtype), nan_like(k.shape, k.dtype), nan_like(v.shape, v.dtype)
    fmha_rt.mha_varlen_bwd(dout, q, k, v, out, lse, *args, dq=dq, dk=dk, dv=dv, **opts)
    keep = philox_reference.varlen_keep_masks(seed, offset, hq, lens_q, lens_k, DROPOUT_P)
    ref = {"window": (-1, 0), "bottom_right": True, "alibi_slopes": f64(slopes), "dropout_p": DROPOUT_P,
           "dropout_keep": keep}
    cq, ck = cu_q.cpu().numpy(), cu_k.cpu().numpy()
    want_out, want_lse = reference.mha_varlen_fwd_ref(f64(q), f64(k), f64(v), cq, ck, **ref)
    assert_close("out", out, want_out)
    assert_lse_close("lse", lse, want_lse)
    want = reference.mha_varlen_bwd_ref(f64(dout), f64(q), f64(k), f64(v), cq, ck, **ref)
    for name, got, w in zip(("dq", "dk", "dv"), (dq, dk, dv), want):
        assert_close(name, got, w)
