"""Tensor helpers shared by the GPU tests: fresh random inputs, NaN-poisoned outputs, float64 copies."""
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
