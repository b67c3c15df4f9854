"""The fmha_rt calls behind fmha_rt.torch, on torch tensors: one forward and one backward that both of
the adapter's routes run (the registered ops' implementations, which compiled graphs call, and the
eager autograd function of torch_eager.py), so that the two launch the same kernels on the same
arguments and give bitwise-equal results.

Arguments come as the ops take them: tensors first (batch inputs pass None cu_seqlens, and max_seqlen_*
are then unused), then the scalars, with the mask as bottom-right window sides. Outputs, the backward's
workspace and contiguous copies of inputs whose last dim is not contiguous come from torch's caching
allocator, and every launch goes on torch's current stream of q's device: nothing synchronises the
host, so both calls can be captured in a CUDA graph. Tensors that require grad are passed as they are:
fmha_rt reads a plain torch tensor from its attributes (through DLPack's C exchange API), which
autograd does not guard.
"""
import torch

from . import api
from .runtime.packing import Pointer


class caching_workspace:  # noqa: N801 - used like a function: mha_bwd(..., workspace_alloc=caching_workspace(dev))
    """A workspace_alloc for one mha_bwd call on torch tensors: the workspace comes from torch's caching
    allocator on the current stream (so the call can be captured in a CUDA graph) and is handed over as
    its address, which spares the call importing and checking a tensor it made itself. The tensor is
    held by this object: keep it until the call returns (the launches are queued by then, and torch
    reuses the memory stream-ordered after that)."""

    __slots__ = ("device", "held")

    def __init__(self, device):
        self.device, self.held = device, None

    def __call__(self, nbytes: int, zero_init: bool) -> Pointer:  # fmha_rt zeroes what must start at zero
        self.held = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return Pointer(self.held.data_ptr())


def lse_shape(q, varlen: bool) -> tuple:
    """lse's shape: [B, Hq, Sq] of a batch q [B, Sq, Hq, D], [Hq, total_q] of a varlen q [total_q, Hq, D]."""
    shape = q.shape
    return (shape[1], shape[0]) if varlen else (shape[0], shape[2], shape[1])


def out_shape(q, v) -> tuple:
    return (*q.shape[:-1], v.shape[-1])


def _last_dims_contiguous(*tensors) -> tuple:
    """`tensors` (None for an absent one), each not contiguous in its last dim replaced by a copy that
    is, which the kernels need: gradients such as the ones of `out.sum()` arrive with zero strides.
    Contiguous tensors, nearly all (a backward's dout often is not), pass one cheap check each:
    is_contiguous reads a flag, stride(-1) parses an argument and costs three times as much."""
    for x in tensors:
        if x is not None and not x.is_contiguous():
            return tuple(x if x is None or x.is_contiguous() or x.stride(-1) == 1 else x.contiguous()
                         for x in tensors)
    return tensors


def _stream(t) -> int:
    """The handle of torch's current stream on t's device, where the launches belong (read without
    making a torch Stream object). Tensors not on a GPU go on to fmha_rt with the default stream's, so
    that its error names the argument."""
    return torch._C._cuda_getCurrentRawStream(t.get_device()) if t.is_cuda else 0


# The fmha_rt functions bound to one call's scalars and options (api.bind), by function and those: a
# call with the options of an earlier one skips fmha_rt's keyword handling and the options' part of the
# plan-cache key. Cleared when full (varlen calls bind each max_seqlen pair they see).
_BOUND: dict = {}
_BOUND_CAPACITY = 256


def _bound(function, max_seqlen_q, max_seqlen_k, softmax_scale, window_left, window_right, dropout_p,
           deterministic=False) -> api.Bound:
    # each value with its type: True, 1 and 1.0 are equal keys but not the same option
    key = (function, max_seqlen_q, max_seqlen_k, softmax_scale, type(softmax_scale), window_left, window_right,
           dropout_p, type(dropout_p), deterministic, type(deterministic))
    try:
        return _BOUND[key]
    except KeyError:
        pass
    except TypeError:  # an unhashable value: fmha_rt validates it, the call is not cached
        key = None
    bound = api.bind(function, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, deterministic=deterministic,
                     workspace_alloc=function.endswith("bwd"),  # the backward gives one, the forward none
                     softmax_scale=softmax_scale,
                     window=(window_left, window_right), causal_alignment="bottom_right", dropout_p=dropout_p)
    if key is not None:
        if len(_BOUND) >= _BOUND_CAPACITY:
            _BOUND.clear()
        _BOUND[key] = bound
    return bound


def forward(q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, rng_state, max_seqlen_q, max_seqlen_k,
            softmax_scale, window_left, window_right, dropout_p):
    """Attention forward -> (out, lse)."""
    q, k, v, alibi_slopes = _last_dims_contiguous(q, k, v, alibi_slopes)
    varlen = cu_seqlens_q is not None
    # out is laid out as new_empty lays it (contiguous, as the registered op's fake says); empty_like
    # makes it from q alone when the head dims agree, parsing fewer arguments than a shape
    out = (torch.empty_like(q, memory_format=torch.contiguous_format) if v.shape[-1] == q.shape[-1]
           else q.new_empty(out_shape(q, v)))
    lse = q.new_empty(lse_shape(q, varlen), dtype=torch.float32)
    arrays = (q, k, v, cu_seqlens_q, cu_seqlens_k, None, None, out, lse) if varlen else (q, k, v, out, lse)
    call = _bound("mha_varlen_fwd" if varlen else "mha_fwd", max_seqlen_q, max_seqlen_k, softmax_scale, window_left,
                  window_right, dropout_p)
    call(arrays, _stream(q), alibi_slopes, rng_state if dropout_p > 0 else None)
    return out, lse


def backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes, rng_state, max_seqlen_q,
             max_seqlen_k, softmax_scale, window_left, window_right, dropout_p, deterministic):
    """Attention backward -> (dq, dk, dv), with the forward's options."""
    dout, q, k, v, out, lse, alibi_slopes = _last_dims_contiguous(dout, q, k, v, out, lse, alibi_slopes)
    # each gradient laid out as its input is (where that is dense), as autograd prefers; empty_like
    # also parses fewer arguments than new_empty with a shape
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    varlen = cu_seqlens_q is not None
    # mha_varlen_bwd's arrays: offsets (without seqstarts) after lse; mha_bwd's: dbias (None) after dv
    arrays = ((dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, None, None, dq, dk, dv) if varlen
              else (dout, q, k, v, out, lse, dq, dk, dv, None))
    call = _bound("mha_varlen_bwd" if varlen else "mha_bwd", max_seqlen_q, max_seqlen_k, softmax_scale, window_left,
                  window_right, dropout_p, deterministic)
    workspace = caching_workspace(q.device)  # alive until the launches are queued
    call(arrays, _stream(q), alibi_slopes, rng_state if dropout_p > 0 else None, workspace)
    return dq, dk, dv
