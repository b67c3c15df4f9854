"""PyTorch adapter: flash-attn compatible autograd functions over fmha_rt.

    from fmha_rt.torch import flash_attn_func, flash_attn_varlen_func
    out = flash_attn_func(q, k, v, causal=True)            # q [B, Sq, Hq, D], k/v [B, Sk, Hk, D]

The forward and the backward are torch.library custom ops (`torch.ops.fmha_rt.fwd`, `torch.ops.fmha_rt.bwd`)
with fake implementations and an autograd formula, so torch.compile traces them into its graph and
AOTAutograd puts the backward op in the backward graph.

Semantics follow flash-attn: causal masks and sliding windows are aligned bottom-right (the last query
row sees the last key), `window_size=(left, right)` with -1 for unbounded, `softmax_scale` defaults to
1/sqrt(D), `alibi_slopes` is fp32 [Hq] or [B, Hq]. `return_attn_probs=True` returns `(out, lse, None)`:
fmha_rt never materialises the probabilities, so the third element is always None; lse is fp32
[B, Hq, Sq] (varlen: [Hq, total_q]) and not differentiable.

Dropout draws a fresh Philox (seed, offset) pair per call as a device int64 tensor from torch's CUDA
generator for q's device (so `torch.manual_seed` makes runs repeatable and CUDA-graph replays draw new
numbers); the backward reuses the pair saved by the forward. `last_dropout_state()` returns the pair of
this thread's last eager call, which `fmha_rt.mha_dropout_mask(q, k, dropout_p=p, seed=state)` turns
into the keep mask.

Memory and streams: every launch goes on torch's current stream of q's device. The ops allocate, with
torch's caching allocator on that stream, out and lse (forward), dq, dk, dv and the backward workspace
(backward), plus a contiguous copy of any input whose last dim is not contiguous. fmha_rt then launches
into these preallocated buffers without any host synchronisation, so both ops can be captured in a CUDA
graph (after one warm-up call has loaded the kernels).
"""
import threading
from typing import Optional

import torch

from .api import mha_bwd, mha_fwd, mha_varlen_bwd, mha_varlen_fwd
from .errors import FmhaValueError
from .runtime.packing import Pointer
from .validation import resolve_mask

__all__ = ["caching_workspace", "flash_attn_func", "flash_attn_varlen_func", "last_dropout_state"]

Tensor = torch.Tensor
OptTensor = Optional[Tensor]  # the spelling custom_op schema inference maps to "Tensor?"

# Offsets stay below 2**62 so that the kernels' per-row Philox counters (offset plus at most
# B*H*Sq*Sk/4) never leave int64.
_PHILOX_BOUND = 2**62
_last_dropout = threading.local()


# ------------------------------------------------------------------------------------------ helpers


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


def _lse_shape(q: Tensor, varlen: bool):
    return (q.shape[1], q.shape[0]) if varlen else (q.shape[0], q.shape[2], q.shape[1])


def _out_shape(q: Tensor, v: Tensor):
    return (*q.shape[:-1], v.shape[-1])


def _kernel_layout(x: OptTensor) -> OptTensor:
    """Detached (DLPack refuses tensors that require grad) and contiguous in the last dim, which the
    kernels need; gradients such as the ones of `out.sum()` arrive with zero strides."""
    if x is None:
        return None
    x = x.detach()
    return x if x.stride(-1) == 1 else x.contiguous()


def _torch_stream(t: Tensor):
    """Torch's current stream on t's device, where the launches belong. Tensors not on a GPU go on to
    fmha_rt unchanged so that its error names the argument."""
    return torch.cuda.current_stream(t.device).cuda_stream if t.is_cuda else None


def _fmha_options(softmax_scale, window_left, window_right, alibi_slopes, dropout_p, rng_state, stream):
    return dict(softmax_scale=softmax_scale, window=(window_left, window_right), causal_alignment="bottom_right",
                alibi_slopes=alibi_slopes, dropout_p=dropout_p, seed=rng_state if dropout_p > 0 else None,
                stream=stream)


# -------------------------------------------------------------------------------------- custom ops
# Tensors first, then the scalars, in the same order in both ops: the autograd formula forwards the
# forward's optional tensors and scalars to the backward unchanged. Batch inputs pass None cu_seqlens
# (max_seqlen_* are then unused).


@torch.library.custom_op("fmha_rt::fwd", mutates_args=())
def _fwd_op(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: OptTensor, cu_seqlens_k: OptTensor,
            alibi_slopes: OptTensor, rng_state: OptTensor, max_seqlen_q: int, max_seqlen_k: int,
            softmax_scale: Optional[float], window_left: int, window_right: int, dropout_p: float,
            deterministic: bool) -> tuple[Tensor, Tensor]:
    """Attention forward -> (out, lse). `deterministic` is a backward option, kept for the autograd formula."""
    varlen = cu_seqlens_q is not None
    q, k, v = _kernel_layout(q), _kernel_layout(k), _kernel_layout(v)
    out = q.new_empty(_out_shape(q, v))
    lse = q.new_empty(_lse_shape(q, varlen), dtype=torch.float32)
    options = _fmha_options(softmax_scale, window_left, window_right, _kernel_layout(alibi_slopes), dropout_p,
                            rng_state, _torch_stream(q))
    if varlen:
        mha_varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, out=out, lse=lse, **options)
    else:
        mha_fwd(q, k, v, out=out, lse=lse, **options)
    return out, lse


@_fwd_op.register_fake
def _fwd_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, rng_state, max_seqlen_q, max_seqlen_k,
              softmax_scale, window_left, window_right, dropout_p, deterministic):
    return q.new_empty(_out_shape(q, v)), q.new_empty(_lse_shape(q, cu_seqlens_q is not None), dtype=torch.float32)


@torch.library.custom_op("fmha_rt::bwd", mutates_args=())
def _bwd_op(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, cu_seqlens_q: OptTensor,
            cu_seqlens_k: OptTensor, alibi_slopes: OptTensor, rng_state: OptTensor, max_seqlen_q: int,
            max_seqlen_k: int, softmax_scale: Optional[float], window_left: int, window_right: int, dropout_p: float,
            deterministic: bool) -> tuple[Tensor, Tensor, Tensor]:
    """Attention backward -> (dq, dk, dv), with the forward's options."""
    dout, q, k, v, out, lse = (_kernel_layout(x) for x in (dout, q, k, v, out, lse))
    dq, dk, dv = q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)
    options = _fmha_options(softmax_scale, window_left, window_right, _kernel_layout(alibi_slopes), dropout_p,
                            rng_state, _torch_stream(q))

    workspace = caching_workspace(q.device)  # alive until the launches are queued
    if cu_seqlens_q is not None:
        mha_varlen_bwd(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                       deterministic=deterministic, dq=dq, dk=dk, dv=dv, workspace_alloc=workspace, **options)
    else:
        mha_bwd(dout, q, k, v, out, lse, deterministic=deterministic, dq=dq, dk=dk, dv=dv,
                workspace_alloc=workspace, **options)
    return dq, dk, dv


@_bwd_op.register_fake
def _bwd_fake(dout, q, k, v, *_):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


_TENSOR_INPUTS = 7  # q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, rng_state


def _setup_context(ctx, inputs, output):
    q, k, v, *optional_tensors = inputs[:_TENSOR_INPUTS]
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, *optional_tensors)
    ctx.scalars = inputs[_TENSOR_INPUTS:]
    ctx.mark_non_differentiable(lse)


def _backward(ctx, dout, _dlse):
    q, k, v, out, lse, *optional_tensors = ctx.saved_tensors
    dq, dk, dv = _bwd_op(dout, q, k, v, out, lse, *optional_tensors, *ctx.scalars)
    return (dq, dk, dv) + (None,) * (_TENSOR_INPUTS - 3 + len(ctx.scalars))


_fwd_op.register_autograd(_backward, setup_context=_setup_context)


# ------------------------------------------------------------------------------------ public API


def last_dropout_state() -> OptTensor:
    """The device int64 tensor [seed, offset] that this thread's last eager call with dropout used (None
    before any); compiled calls do not record it. Read it, never write it: the backward uses it too."""
    return getattr(_last_dropout, "state", None)


def _dropout_state(q: Tensor, dropout_p) -> OptTensor:
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)) or not 0.0 <= dropout_p < 1.0:
        raise FmhaValueError(f"dropout_p must be a number in [0, 1), got {dropout_p!r}")
    if dropout_p == 0:
        return None
    state = torch.randint(_PHILOX_BOUND, (2,), device=q.device, dtype=torch.int64)
    if not torch.compiler.is_compiling():
        _last_dropout.state = state
    return state


def _attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
               window_size, alibi_slopes, deterministic, return_attn_probs):
    # Options are checked here, before tracing reaches the ops, so that errors are fmha_rt's own
    # also under torch.compile; shapes, dtypes and devices are checked by fmha_rt at launch.
    mask = resolve_mask(causal, window_size, None, "bottom_right")
    rng_state = _dropout_state(q, dropout_p)
    out, lse = _fwd_op(q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, rng_state, max_seqlen_q, max_seqlen_k,
                       softmax_scale, mask.window_left, mask.window_right, float(dropout_p), deterministic)
    return (out, lse, None) if return_attn_probs else out


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """Attention with gradients: q [B, Sq, Hq, D], k [B, Sk, Hk, D], v [B, Sk, Hk, Dv] (fp16/bf16, on the
    GPU) -> out [B, Sq, Hq, Dv]; with return_attn_probs, (out, lse fp32 [B, Hq, Sq], None). Masks align
    bottom-right; deterministic=True makes the backward bitwise repeatable."""
    return _attention(q, k, v, None, None, 0, 0, dropout_p, softmax_scale, causal, window_size, alibi_slopes,
                      deterministic, return_attn_probs)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), alibi_slopes=None,
                           deterministic=False, return_attn_probs=False):
    """Attention over packed sequences: q [total_q, Hq, D], k/v [total_k, Hk, D], cu_seqlens int32 [B + 1]
    on the GPU, max_seqlen_q/k ints bounding every sequence -> out [total_q, Hq, Dv]; with
    return_attn_probs, (out, lse fp32 [Hq, total_q], None). Each sequence is masked on its own lengths."""
    return _attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
                      causal, window_size, alibi_slopes, deterministic, return_attn_probs)
