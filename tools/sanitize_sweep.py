"""Every kernel family once, on small shapes, for compute-sanitizer (tools/sanitize.sh runs it).

Self-test kernels; forward and backward for each head-dim tile (32, 64, 128, 256 and the 192/128 pair)
in fp16 and bf16; tensor bias with its gradient, ALiBi, dropout (seed by value and from device memory)
and its mask kernel, varlen with padded sequence starts, GQA, windows, deterministic and default
backward, workspace from a callback and from the runtime. Lengths are not multiples of any tile, so
that every boundary path runs. Each result is checked against the float64 reference (so a run that
passes the sanitizer also computed the right thing); the last line says what ran.

Run alone: python3 tools/sanitize_sweep.py (needs a GPU and torch).
"""
import sys

import numpy as np
import torch

import fmha_rt
from fmha_rt import reference, selftest

TOL = 2e-2
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
HEAD_DIMS = [(32, 32), (64, 64), (128, 128), (256, 256), (192, 128)]
launched = set()
calls = 0


def rand(shape, dtype, gen):
    return torch.randn(shape, generator=gen, device="cuda", dtype=torch.float32).to(dtype)


def f64(t):
    return t.detach().to("cpu", torch.float64).numpy()


def check(name, got, want):
    err = reference.rel_err(f64(got), want)
    if not err < TOL:
        sys.exit(f"{name}: relative error {err:.2e} against the float64 reference")


def note():
    global calls
    calls += 1
    launched.update(fmha_rt.last_launch_info().get("kernels", ()))


def torch_workspace(nbytes, zero_init):
    return (torch.zeros if zero_init else torch.empty)(nbytes, dtype=torch.uint8, device="cuda")


def attention(name, dtype, b, sq, sk, hq, hk, d, dv, gen, deterministic=True, workspace=True, **opts):
    """Forward and backward of one batched problem, checked against the reference."""
    q, k = rand((b, sq, hq, d), dtype, gen), rand((b, sk, hk, d), dtype, gen)
    v, dout = rand((b, sk, hk, dv), dtype, gen), rand((b, sq, hq, dv), dtype, gen)
    out, lse = fmha_rt.mha_fwd(q, k, v, **opts)
    note()
    grads = fmha_rt.mha_bwd(dout, q, k, v, out, lse, deterministic=deterministic,
                            workspace_alloc=torch_workspace if workspace else None, **opts)
    note()
    ref = {"window": opts.get("window", (-1, -1)), "bottom_right": opts.get("causal_alignment") == "bottom_right"}
    if opts.get("causal"):
        ref["window"] = (ref["window"][0], 0)
    if "bias" in opts:
        ref["bias"] = f64(opts["bias"])
    if "alibi_slopes" in opts:
        ref["alibi_slopes"] = f64(opts["alibi_slopes"])
    if opts.get("dropout_p"):
        keep = fmha_rt.mha_dropout_mask(q, k, dropout_p=opts["dropout_p"], seed=opts["seed"],
                                        offset=opts.get("offset", 0))
        note()
        ref.update(dropout_p=opts["dropout_p"], dropout_keep=f64(keep).astype(bool))
    ro, _ = reference.mha_fwd_ref(f64(q), f64(k), f64(v), **ref)
    check(f"{name} out", out, ro)
    for grad_name, got, want in zip(("dq", "dk", "dv", "dbias"), grads,
                                    reference.mha_bwd_ref(f64(dout), f64(q), f64(k), f64(v), **ref)):
        check(f"{name} {grad_name}", got, want)
    print(f"{name}: ok", flush=True)


def varlen(name, dtype, gen, padded):
    lens_q, lens_k, hq, hk, d = [37, 0, 1, 130], [50, 3, 1, 77], 4, 2, 64
    gap = 5 if padded else 0  # rows of padding before each sequence
    starts_q = np.concatenate([[0], np.cumsum(np.array(lens_q) + gap)])[:-1] + gap
    starts_k = np.concatenate([[0], np.cumsum(np.array(lens_k) + gap)])[:-1] + gap
    tq, tk = int(starts_q[-1] + lens_q[-1]), int(starts_k[-1] + lens_k[-1])
    q, k, v = rand((tq, hq, d), dtype, gen), rand((tk, hk, d), dtype, gen), rand((tk, hk, d), dtype, gen)
    dout = rand((tq, hq, d), dtype, gen)
    cu = [torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int32, device="cuda")
          for lens in (lens_q, lens_k)]
    extra = {}
    if padded:
        extra = {"seqstart_q": torch.tensor(np.append(starts_q, tq), dtype=torch.int32, device="cuda"),
                 "seqstart_k": torch.tensor(np.append(starts_k, tk), dtype=torch.int32, device="cuda")}
    args = (*cu, max(lens_q), max(lens_k))
    opts = {"causal": True, "causal_alignment": "bottom_right", **extra}
    out, lse = fmha_rt.mha_varlen_fwd(q, k, v, *args, **opts)
    note()
    dq, dk, dv = fmha_rt.mha_varlen_bwd(dout, q, k, v, out, lse, *args, deterministic=True, **opts)
    note()
    # The reference takes the sequences packed: gather each one's rows, compare those rows only.
    rows_q = np.concatenate([np.arange(s, s + n) for s, n in zip(starts_q, lens_q)])
    rows_k = np.concatenate([np.arange(s, s + n) for s, n in zip(starts_k, lens_k)])
    packed = [np.concatenate([[0], np.cumsum(lens)]) for lens in (lens_q, lens_k)]
    ref = {"window": (-1, 0), "bottom_right": True}
    ro, _ = reference.mha_varlen_fwd_ref(f64(q)[rows_q], f64(k)[rows_k], f64(v)[rows_k], *packed, **ref)
    check(f"{name} out", out[torch.as_tensor(rows_q, device="cuda")], ro)
    rdq, rdk, rdv, _ = reference.mha_varlen_bwd_ref(f64(dout)[rows_q], f64(q)[rows_q], f64(k)[rows_k],
                                                    f64(v)[rows_k], *packed, **ref)
    for grad_name, got, want, rows in (("dq", dq, rdq, rows_q), ("dk", dk, rdk, rows_k), ("dv", dv, rdv, rows_k)):
        check(f"{name} {grad_name}", got[torch.as_tensor(rows, device="cuda")], want)
    print(f"{name}: ok", flush=True)


def main():
    gen = torch.Generator(device="cuda").manual_seed(7)
    got, want = selftest.run_axpy(0, 100_003, 0.75, seed=1)
    if selftest.max_ulp_difference(got, want) > 1:
        sys.exit("selftest axpy: wrong result")
    got, want = selftest.run_strided_copy(0, 50_001, 3, 2, seed=2)
    if not np.array_equal(got, want, equal_nan=True):
        sys.exit("selftest strided copy: wrong result")
    launched.update(("selftest_axpy_f32", "selftest_strided_copy_f32"))
    print("selftest: ok", flush=True)

    for dtype_name, dtype in DTYPES.items():
        for i, (d, dv) in enumerate(HEAD_DIMS):
            attention(f"{dtype_name} d{d}/{dv}", dtype, 2, 77 + 16 * i, 93, 4, 2, d, dv, gen, causal=i % 2 == 1,
                      deterministic=i % 2 == 0, workspace=i != 2)
    bf16 = torch.bfloat16
    for shape in ((1, 1), (2, 4)):
        # Rows padded to 96 elements: the kernels need row strides that are multiples of 8, while the
        # 90 visible keys still end inside a tile.
        bias = rand(shape + (70, 96), bf16, gen)[..., :90]
        attention(f"bias {shape}", bf16, 2, 70, 90, 4, 4, 64, 64, gen, bias=bias, window=(20, 5))
    attention("alibi [H]", bf16, 2, 70, 90, 4, 2, 128, 128, gen, causal=True, causal_alignment="bottom_right",
              alibi_slopes=torch.rand(4, generator=gen, device="cuda"))
    attention("alibi [B, H]", bf16, 2, 70, 90, 4, 4, 64, 64, gen,
              alibi_slopes=torch.rand((2, 4), generator=gen, device="cuda"))
    attention("dropout", bf16, 2, 70, 90, 2, 2, 64, 64, gen, dropout_p=0.2, seed=11, offset=3)
    seed_offset = torch.tensor([12, 5], dtype=torch.int64, device="cuda")
    attention("dropout (seed in device memory)", bf16, 1, 70, 90, 2, 1, 128, 128, gen, dropout_p=0.1, seed=seed_offset)
    varlen("varlen", bf16, gen, padded=False)
    varlen("varlen padded", torch.float16, gen, padded=True)
    torch.cuda.synchronize()
    print(f"sweep: {calls} calls, {len(launched)} distinct kernels, every result matches the float64 reference")


if __name__ == "__main__":
    main()
