"""torch.ops.fmha_rt.fwd / bwd on CPU tensors, computed by the float64 reference.

fmha_rt's kernels run on GPUs only. So that programs built around fmha_rt.torch (tensor-parallel ones
with DTensor above all, fmha_rt/torch_sharding.py) can be run and checked on a machine without one,
enable() registers a CPU kernel of both ops: fmha_rt.reference on the inputs, rounded to q's dtype
(lse float32). torch dispatches on the tensors' device, so GPU tensors never reach it. Dropout is
refused: the reference draws no random numbers, and the kernels' Philox mask is drawn on a GPU.
"""
import torch

from . import reference
from .errors import FmhaNotImplementedError

_enabled = False


def _options(window_left, window_right, softmax_scale, dropout_p):
    if dropout_p > 0:
        raise FmhaNotImplementedError("fmha_rt.torch on CPU tensors (the float64 reference) has no dropout: the "
                                      "kernels' Philox mask is drawn on a GPU")
    return {"softmax_scale": softmax_scale, "window": (window_left, window_right), "bottom_right": True}


def _numpy(x):
    return None if x is None else x.detach().to(torch.float64).numpy()


def _fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, rng_state, max_seqlen_q, max_seqlen_k, softmax_scale,
         window_left, window_right, dropout_p, deterministic):
    opts = _options(window_left, window_right, softmax_scale, dropout_p)
    cu = () if cu_seqlens_q is None else (cu_seqlens_q.numpy(), cu_seqlens_k.numpy())
    fn = reference.mha_fwd_ref if not cu else reference.mha_varlen_fwd_ref
    out, lse = fn(_numpy(q), _numpy(k), _numpy(v), *cu, alibi_slopes=_numpy(alibi_slopes), **opts)
    return torch.from_numpy(out).to(q.dtype), torch.from_numpy(lse).to(torch.float32)


def _bwd(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes, rng_state, max_seqlen_q, max_seqlen_k,
         softmax_scale, window_left, window_right, dropout_p, deterministic):
    opts = _options(window_left, window_right, softmax_scale, dropout_p)
    cu = () if cu_seqlens_q is None else (cu_seqlens_q.numpy(), cu_seqlens_k.numpy())
    fn = reference.mha_bwd_ref if not cu else reference.mha_varlen_bwd_ref
    grads = fn(_numpy(dout), _numpy(q), _numpy(k), _numpy(v), *cu, alibi_slopes=_numpy(alibi_slopes), **opts)[:3]
    return tuple(torch.from_numpy(g).to(x.dtype) for g, x in zip(grads, (q, k, v)))


def enabled() -> bool:
    """Whether enable() has registered the CPU kernels (then CPU tensors must go through the ops)."""
    return _enabled


def enable() -> None:
    """Register the CPU kernels of torch.ops.fmha_rt.fwd and bwd (once)."""
    global _enabled
    from . import torch as _adapter  # noqa: F401  (defines the ops)
    if not _enabled:
        torch.library.register_kernel("fmha_rt::fwd", "cpu", _fwd)
        torch.library.register_kernel("fmha_rt::bwd", "cpu", _bwd)
        _enabled = True
