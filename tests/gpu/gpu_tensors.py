"""Tensor helpers shared by the GPU tests: fresh random inputs, NaN-poisoned outputs (given, or from torch's
caching allocator), float64 copies and the comparison with the float64 reference."""
import itertools

import numpy as np
import torch

from fmha_rt import reference


def rand(shape, dtype, gen, scale=1.0):
    """Standard-normal values drawn in float32 on the GPU from `gen`, then cast to `dtype`."""
    return (torch.randn(shape, generator=gen, device="cuda", dtype=torch.float32) * scale).to(dtype)


def nan_like(shape, dtype):
    """An output buffer filled with NaN, so that any element a kernel leaves unwritten shows."""
    return torch.full(shape, float("nan"), device="cuda", dtype=dtype)


def f64(t):
    """A float64 NumPy copy of a tensor (on any device), for the float64 reference."""
    return t.detach().to("cpu", torch.float64).numpy()


def varlen_inputs(lens_q, lens_k, heads_q, heads_k, head_dim, seed, dtype=torch.bfloat16):
    """cu_seqlens_q, cu_seqlens_k (int32 on the GPU) and fresh packed q, k, v, dout for those lengths."""
    cu_q, cu_k = (torch.tensor([0, *itertools.accumulate(lens)], device="cuda", dtype=torch.int32)
                  for lens in (lens_q, lens_k))
    gen = torch.Generator(device="cuda").manual_seed(seed)
    tq, tk = sum(lens_q), sum(lens_k)
    q, k, v = rand((tq, heads_q, head_dim), dtype, gen), rand((tk, heads_k, head_dim), dtype, gen), \
        rand((tk, heads_k, head_dim), dtype, gen)
    return cu_q, cu_k, q, k, v, rand((tq, heads_q, head_dim), dtype, gen)


def poison_allocator(*specs):
    """Leave NaN-filled blocks of these (shape, dtype) sizes in torch's caching allocator, which hands
    a freed block of the requested size back first: the adapter's next allocations of these sizes
    start as NaN. Best effort (other allocations may take a block), which the reference check backs."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    blocks = [torch.full(shape, float("nan"), device="cuda", dtype=dtype) for shape, dtype in specs]
    del blocks


def poison_for(q, k, v, lse_shape):
    """poison_allocator for what fmha_rt.torch allocates in a step on q, k, v: out, lse, dq, dk, dv."""
    out_shape = (*q.shape[:-1], v.shape[-1])
    poison_allocator((out_shape, q.dtype), (lse_shape, torch.float32), (q.shape, q.dtype), (k.shape, k.dtype),
                     (v.shape, v.dtype))


def assert_close(name, got, want, tol):
    """A tensor against its float64 reference: no NaN (no element unwritten), relative error below tol."""
    got = f64(got)
    assert not np.isnan(got).any(), f"{name}: NaN in output (unwritten or invalid)"
    err = reference.rel_err(got, want)
    assert err < tol, f"{name}: relative error {err:.2e} >= {tol}"
