"""Tensor helpers shared by the GPU tests: fresh random inputs, NaN-poisoned outputs, float64 copies."""
import itertools

import torch


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
