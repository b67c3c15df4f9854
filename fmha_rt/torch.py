"""PyTorch adapter: flash-attn compatible autograd functions over fmha_rt.

    from fmha_rt.torch import flash_attn_func, flash_attn_varlen_func
    out = flash_attn_func(q, k, v, causal=True)            # q [B, Sq, Hq, D], k/v [B, Sk, Hk, D]

The forward and the backward are torch.library custom ops (`torch.ops.fmha_rt.fwd`, `torch.ops.fmha_rt.bwd`)
with fake implementations and an autograd formula, so torch.compile traces them into its graph and
AOTAutograd puts the backward op in the backward graph. An eager call that nothing traces or intercepts
(torch_eager.takes_eager_route) skips the ops' wrappers and runs the same forward and backward
(torch_calls.py) from an autograd function of its own, at a fraction of the host cost.

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

Memory and streams: every launch goes on torch's current stream of q's device. Both routes allocate, with
torch's caching allocator on that stream, out and lse (forward), dq, dk, dv and the backward workspace
(backward), plus a contiguous copy of any input whose last dim is not contiguous. fmha_rt then launches
into these preallocated buffers without any host synchronisation, so forward and backward can be captured
in a CUDA graph (after one warm-up call has loaded the kernels).
"""
import threading
from typing import Optional

import torch

from . import torch_calls, torch_eager
from .errors import FmhaValueError
from .validation import resolve_mask
from .torch_calls import caching_workspace, lse_shape, out_shape

__all__ = ["caching_workspace", "flash_attn_func", "flash_attn_varlen_func", "last_dropout_state"]

Tensor = torch.Tensor
OptTensor = Optional[Tensor]  # the spelling custom_op schema inference maps to "Tensor?"

# Offsets stay below 2**62 so that the kernels' per-row Philox counters (offset plus at most
# B*H*Sq*Sk/4) never leave int64.
_PHILOX_BOUND = 2**62
_last_dropout = threading.local()


# -------------------------------------------------------------------------------------- custom ops
# Tensors first, then the scalars, in the same order in both ops: the autograd formula forwards the
# forward's optional tensors and scalars to the backward unchanged. Batch inputs pass None cu_seqlens
# (max_seqlen_* are then unused).


@torch.library.custom_op("fmha_rt::fwd", mutates_args=())
def fwd_op(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: OptTensor, cu_seqlens_k: OptTensor,
            alibi_slopes: OptTensor, rng_state: OptTensor, max_seqlen_q: int, max_seqlen_k: int,
            softmax_scale: Optional[float], window_left: int, window_right: int, dropout_p: float,
            deterministic: bool) -> tuple[Tensor, Tensor]:
    """Attention forward -> (out, lse). `deterministic` is a backward option, kept for the autograd formula."""
    return torch_calls.forward(q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, rng_state, max_seqlen_q,
                               max_seqlen_k, softmax_scale, window_left, window_right, dropout_p)


@fwd_op.register_fake
def _fwd_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, rng_state, max_seqlen_q, max_seqlen_k,
              softmax_scale, window_left, window_right, dropout_p, deterministic):
    return q.new_empty(out_shape(q, v)), q.new_empty(lse_shape(q, cu_seqlens_q is not None), dtype=torch.float32)


@torch.library.custom_op("fmha_rt::bwd", mutates_args=())
def _bwd_op(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, cu_seqlens_q: OptTensor,
            cu_seqlens_k: OptTensor, alibi_slopes: OptTensor, rng_state: OptTensor, max_seqlen_q: int,
            max_seqlen_k: int, softmax_scale: Optional[float], window_left: int, window_right: int, dropout_p: float,
            deterministic: bool) -> tuple[Tensor, Tensor, Tensor]:
    """Attention backward -> (dq, dk, dv), with the forward's options."""
    return torch_calls.backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes, rng_state,
                                max_seqlen_q, max_seqlen_k, softmax_scale, window_left, window_right, dropout_p,
                                deterministic)


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


fwd_op.register_autograd(_backward, setup_context=_setup_context)


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
    # Eager calls that nothing traces or intercepts skip the registered op's wrappers (issue 37); both
    # routes run torch_calls' forward and backward.
    eager = torch_eager.takes_eager_route(q, k, v, cu_seqlens_q, alibi_slopes, rng_state)
    out, lse = (torch_eager.attention if eager else fwd_op)(
        q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, rng_state, max_seqlen_q, max_seqlen_k, softmax_scale,
        mask.window_left, mask.window_right, float(dropout_p), deterministic)
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


if torch.distributed.is_available():  # DTensor sharding rules: batch and heads (fmha_rt/torch_sharding.py)
    from . import torch_sharding

    torch_sharding.register(torch.ops.fmha_rt.fwd.default, torch.ops.fmha_rt.bwd.default)
