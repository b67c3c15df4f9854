"""The eager route of fmha_rt.torch: an autograd function that runs the adapter's forward and backward
(torch_calls.py) itself, for calls that nothing traces or intercepts.

A call through a registered torch.library custom op pays for the op's wrappers on every call (its
schema's argument defaults filled in, a dispatch through the autograd key and back into Python, an
autograd function of its own): several times what fmha_rt's cached call costs (issue 37). Those ops
are what tracing needs, so every call that some tracer or interceptor could be watching still takes
them; `takes_eager_route` says when none can be. Both routes run the same torch_calls functions, so
they launch the same kernels on the same arguments.
"""
import contextlib

import torch

from . import torch_calls, torch_cpu_reference

_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)
_C = torch._C
_functorch_wrapped = _C._functorch.is_functorch_wrapped_tensor
_enabled = True  # registered_ops_only turns the eager route off


@contextlib.contextmanager
def registered_ops_only():
    """Every call in the block (in any thread) takes the registered ops, as every call did before
    issue 37: for comparing the two routes (tests, benchmarks)."""
    global _enabled
    _enabled, before = False, _enabled
    try:
        yield
    finally:
        _enabled = before


def takes_eager_route(q, k, v, cu_seqlens_q, alibi_slopes, rng_state) -> bool:
    """Whether a call can skip the registered ops: nothing compiles, exports or traces it (torch.compile,
    torch.export, make_fx, torch.jit.trace), no torch function or dispatch mode (FakeTensorMode, a
    user's recording mode, DTensor's) and no functorch transform (vmap, grad) is active, and its
    tensors are plain torch tensors off the meta device (subclasses such as DTensor and FakeTensor
    dispatch through the op; meta tensors take its fake implementation; q, k and v are no functorch
    wrappers left over from a finished transform, which Function.apply would unwrap), and no
    registered_ops_only block is open, and the tensors are not CPU tensors while the CPU reference
    kernels are registered (torch_cpu_reference: the ops dispatch those to it). is_compiling comes
    first: under torch.compile it is the constant True, so nothing after it is traced. cu_seqlens_k
    goes wherever cu_seqlens_q goes."""
    return (not torch.compiler.is_compiling() and _enabled
            and type(q) in _PLAIN_TENSORS and type(k) in _PLAIN_TENSORS and type(v) in _PLAIN_TENSORS
            and (cu_seqlens_q is None or type(cu_seqlens_q) in _PLAIN_TENSORS)
            and (alibi_slopes is None or type(alibi_slopes) in _PLAIN_TENSORS)
            and (rng_state is None or type(rng_state) in _PLAIN_TENSORS)
            and not q.is_meta
            and not (_functorch_wrapped(q) or _functorch_wrapped(k) or _functorch_wrapped(v))
            and not (torch_cpu_reference.enabled() and q.device.type == "cpu")
            and not _C._len_torch_dispatch_stack() and not _C._is_torch_function_mode_enabled()
            and _C._get_tracing_state() is None and _C._functorch.peek_interpreter_stack() is None)


class EagerAttention(torch.autograd.Function):
    """_apply(q, k, v, rest) -> (out, lse), lse not differentiable: the registered op fmha_rt::fwd with its
    autograd formula, as one autograd function. `rest` is the tuple of the op's other arguments
    (cu_seqlens_q, cu_seqlens_k, alibi_slopes, rng_state, max_seqlen_q, max_seqlen_k, softmax_scale,
    window_left, window_right, dropout_p, deterministic): none takes a gradient, and one argument in
    their place keeps apply's per-argument work to four."""

    @staticmethod
    def forward(ctx, q, k, v, rest):
        out, lse = torch_calls.forward(q, k, v, *rest[:-1])  # `deterministic` is the backward's
        cu_seqlens_q, _, alibi_slopes, rng_state = optional = rest[:_OPTIONAL_TENSORS]
        # Most calls have none of the optional tensors (cu_seqlens_k goes with cu_seqlens_q): saving
        # their four Nones would cost a saved slot each.
        none = cu_seqlens_q is None and alibi_slopes is None and rng_state is None
        ctx.save_for_backward(q, k, v, out, lse, *(() if none else optional))
        ctx.scalars = rest[_OPTIONAL_TENSORS:]
        ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)  # lse's gradient stays None: no tensor of zeros is made for it
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        if dout is None:  # out's gradient is undefined (not materialised): so are q's, k's and v's
            return None, None, None, None
        saved = ctx.saved_tensors
        if len(saved) == 5:  # q, k, v, out, lse
            saved += _NO_OPTIONAL_TENSORS
        return (*torch_calls.backward(dout, *saved, *ctx.scalars), None)


_OPTIONAL_TENSORS = 4  # cu_seqlens_q, cu_seqlens_k, alibi_slopes, rng_state lead `rest`
_NO_OPTIONAL_TENSORS = (None,) * _OPTIONAL_TENSORS
# Function.apply less its Python wrapper, which serves functorch transforms (none is active on the
# eager route, and no leftover wrapper takes it) and setup_context (EagerAttention has none).
_apply = super(torch.autograd.Function, EagerAttention).apply


def attention(q, k, v, *rest):
    """(out, lse) of an eager call, arguments as the registered op takes them; without autograd (grad
    mode off, or no input that requires grad) torch_calls.forward alone."""
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return _apply(q, k, v, rest)
    return torch_calls.forward(q, k, v, *rest[:-1])
