"""Head dims that are not multiples of 8 through the public API on the GPU, against the float64 reference.

Such calls run on zero-padded copies (fmha_rt/plan/head_padding.py): the inputs are widened into scratch
buffers, the kernels run at the padded width, and the outputs are narrowed back into the caller's arrays,
which may have any strides (a contiguous [.., H, 5] array has rows 5H elements apart) and start on any
element. Outputs are NaN-poisoned, inputs fresh random draws, errors relative (< 1e-2 for bf16/fp16);
outputs given as views of wider buffers must leave the columns past the head dim untouched. Errors are
bounded for the whole tensor, per head and per row (tests/error_bounds.py).
"""
import numpy as np
import pytest

from gpu_presence import require

torch = require("torch")

import fmha_rt
from error_bounds import assert_close, assert_lse_close
from fmha_rt import reference
from gpu_tensors import attention_f64, f64, generator, nan_like, rand
from repeat_runs import assert_bitwise, reference_run, repeat
from test_attention import DTYPES, assert_grads_close, backward_call, check_against_reference, run_case

HEAD_DIMS = (1, 5, 13, 100)


@pytest.mark.parametrize("causal", [False, True], ids=["nomask", "causal"])
@pytest.mark.parametrize("dtype_name", ["bf16", "fp16"])
@pytest.mark.parametrize("d", HEAD_DIMS)
def test_forward_and_backward_match_reference(d, dtype_name, causal):
    opts = {"causal": True} if causal else {}
    case = run_case(dtype_name, 2, 200, 257, 4, 2, d, d, opts, seed=100 * d + causal)
    check_against_reference(case, opts)


MIXED = [
    # name, B, Sq, Sk, Hq, Hk, Dqk, Dv, opts
    ("d13_v40_only_qk_pads", 2, 150, 150, 4, 4, 13, 40, {}),
    ("d40_v5_only_v_pads", 1, 300, 130, 4, 1, 40, 5, {"causal": True}),
    ("d100_v13_bottom_right", 1, 90, 333, 2, 2, 100, 13, {"causal": True, "causal_alignment": "bottom_right"}),
    ("d5_window", 2, 257, 257, 3, 3, 5, 5, {"window": (32, 7)}),
]


@pytest.mark.parametrize("case", MIXED, ids=[c[0] for c in MIXED])
def test_head_dims_that_differ(case):
    name, B, Sq, Sk, Hq, Hk, Dqk, Dv, opts = case
    check_against_reference(run_case("bf16", B, Sq, Sk, Hq, Hk, Dqk, Dv, opts, seed=len(name)), opts)


def _view(gen, shape, width, dtype, lead=1):
    """The first shape[-1] columns of `width`-wide rows, starting `lead` sequence rows in: no stride is
    a multiple of 8 and the data starts off any 16-byte boundary."""
    b, s, h, d = shape
    return rand((b, s + lead, h, width), dtype, gen)[:, lead:, :, :d]


@pytest.mark.parametrize("dtype_name", ["bf16", "fp16"])
def test_strided_inputs_and_outputs_inside_wider_buffers(dtype_name):
    dtype, d, B, Sq, Sk, H = DTYPES[dtype_name], 5, 2, 190, 70, 3
    gen = generator(7)
    q, k, v, dout = (_view(gen, (B, s, H, d), w, dtype) for s, w in ((Sq, 7), (Sk, 9), (Sk, 6), (Sq, 11)))
    assert q.data_ptr() % 16 and q.stride(1) % 8
    wide = {name: nan_like((B, s, H, d + 3), dtype) for name, s in (("out", Sq), ("dq", Sq), ("dk", Sk), ("dv", Sk))}
    out, dq, dk, dv = (w[..., :d] for w in wide.values())
    lse = nan_like((B, H, Sq), torch.float32)
    fmha_rt.mha_fwd(q, k, v, out=out, lse=lse, causal=True)
    fmha_rt.mha_bwd(dout, q, k, v, out, lse, dq=dq, dk=dk, dv=dv, causal=True)
    check_against_reference((q, k, v, dout, out, lse, dq, dk, dv), {"causal": True})
    for name, w in wide.items():
        assert bool(w[..., d:].isnan().all()), f"{name}: a column past the head dim was written"


def test_varlen_with_padded_seqstarts_leaves_gap_rows_alone():
    lens_q, lens_k, gaps = [37, 0, 1, 128, 64], [50, 3, 1, 128, 0], [2, 0, 5, 1, 3]
    H, Hk, D = 4, 2, 13
    gen = generator(21)
    starts_q, starts_k, pos_q, pos_k = [], [], 0, 0
    for lq, lk, gap in zip(lens_q, lens_k, gaps):
        starts_q.append(pos_q + gap)
        starts_k.append(pos_k + gap)
        pos_q, pos_k = pos_q + gap + lq, pos_k + gap + lk
    def as_gpu(values):
        return torch.tensor(values, device="cuda", dtype=torch.int32)

    cu_q, cu_k = (as_gpu([0, *np.cumsum(lens)]) for lens in (lens_q, lens_k))
    seq = {"seqstart_q": as_gpu(starts_q + [pos_q]), "seqstart_k": as_gpu(starts_k + [pos_k])}
    q, dout = rand((pos_q, H, D), torch.bfloat16, gen), rand((pos_q, H, D), torch.bfloat16, gen)
    k, v = rand((pos_k, Hk, D), torch.bfloat16, gen), rand((pos_k, Hk, D), torch.bfloat16, gen)
    out, lse = nan_like(q.shape, q.dtype), nan_like((H, pos_q), torch.float32)
    dq, dk, dv = nan_like(q.shape, q.dtype), nan_like(k.shape, k.dtype), nan_like(v.shape, v.dtype)
    args = (cu_q, cu_k, max(lens_q), max(lens_k))
    fmha_rt.mha_varlen_fwd(q, k, v, *args, **seq, out=out, lse=lse, causal=True)
    fmha_rt.mha_varlen_bwd(dout, q, k, v, out, lse, *args, **seq, dq=dq, dk=dk, dv=dv, causal=True)
    rows_q = torch.cat([torch.arange(s, s + n) for s, n in zip(starts_q, lens_q)]).cuda()
    rows_k = torch.cat([torch.arange(s, s + n) for s, n in zip(starts_k, lens_k)]).cuda()
    cq, ck = cu_q.cpu().numpy(), cu_k.cpu().numpy()
    ref = {"window": (-1, 0)}
    ro, rl = reference.mha_varlen_fwd_ref(f64(q[rows_q]), f64(k[rows_k]), f64(v[rows_k]), cq, ck, **ref)
    assert_close("out", out[rows_q], ro)
    assert_lse_close("lse", lse[:, rows_q], rl)
    grads = reference.mha_varlen_bwd_ref(f64(dout[rows_q]), f64(q[rows_q]), f64(k[rows_k]), f64(v[rows_k]), cq, ck,
                                         **ref)
    for name, got, rows, want in (("dq", dq, rows_q, grads[0]), ("dk", dk, rows_k, grads[1]),
                                  ("dv", dv, rows_k, grads[2])):
        assert_close(name, got[rows], want)
    for name, got, rows in (("out", out, rows_q), ("dq", dq, rows_q), ("dk", dk, rows_k), ("dv", dv, rows_k)):
        gap = torch.ones(got.shape[0], dtype=torch.bool, device="cuda")
        gap[rows] = False
        assert bool(got[gap].isnan().all()), f"{name}: a row outside every sequence was written"


def test_deterministic_backward_is_bitwise_equal():
    """Repeats into re-poisoned outputs, on the current stream and a side stream, bitwise equal to a
    reference run that matches float64."""
    gen = generator(22)
    q, k, v, dout = (rand((2, 512, 4, 13), torch.bfloat16, gen) for _ in range(4))
    out, lse = fmha_rt.mha_fwd(q, k, v, causal=True)
    call, specs = backward_call(dout, q, k, v, out, lse, causal=True, deterministic=True)
    first = reference_run(call, specs)
    assert_grads_close(first, attention_f64(q, k, v, causal=True, dout=dout)[2:])
    assert_bitwise("current stream", repeat(call, specs, torch.cuda.current_stream(), 3), first)
    assert_bitwise("side stream", repeat(call, specs, torch.cuda.Stream(), 3), first)


def test_workspace_holds_the_padded_buffers():
    """The backward's padded copies come from its workspace: the callback is asked for what
    bwd_workspace_bytes says, 8 padded [.., H, 8] buffers more than a head dim of 8 needs."""
    B, S, H, d = 1, 256, 2, 5
    gen = generator(23)
    q, k, v, dout = (rand((B, S, H, d), torch.float16, gen) for _ in range(4))
    out, lse = fmha_rt.mha_fwd(q, k, v)
    asked = []

    def alloc(nbytes, zero_init):
        asked.append(nbytes)
        return torch.full((nbytes,), 0xFF, dtype=torch.uint8, device="cuda")

    dq, dk, dv = fmha_rt.mha_bwd(dout, q, k, v, out, lse, workspace_alloc=alloc)
    assert asked == [fmha_rt.bwd_workspace_bytes(q, k, v)]
    plain = fmha_rt.bwd_workspace_bytes(*(torch.zeros(B, S, H, 8, dtype=torch.float16, device="cuda") for _ in range(3)))
    assert asked[0] == plain + 8 * B * S * H * 8 * 2
    check_against_reference((q, k, v, dout, out, lse, dq, dk, dv), {})


def test_torch_autograd_with_head_dim_13():
    from fmha_rt.torch import flash_attn_func

    gen = generator(24)
    q, k, v = (rand((2, 160, 4, 13), torch.bfloat16, gen).requires_grad_() for _ in range(3))
    dout = rand((2, 160, 4, 13), torch.bfloat16, gen)
    out = flash_attn_func(q, k, v, causal=True)
    out.backward(dout)
    ref = {"window": (-1, 0), "bottom_right": True}
    assert_close("out", out, reference.mha_fwd_ref(f64(q), f64(k), f64(v), **ref)[0])
    rdq, rdk, rdv, _ = reference.mha_bwd_ref(f64(dout), f64(q), f64(k), f64(v), **ref)
    for name, got, want in (("dq", q.grad, rdq), ("dk", k.grad, rdk), ("dv", v.grad, rdv)):
        assert_close(name, got, want)
