"""fmha_rt.jax's custom calls on XLA's CPU platform, computed by the float64 reference.

fmha_rt's kernels run on GPUs only. So that programs built around fmha_rt.jax (sharded ones above all:
jax_sharding partitions these very calls) can be compiled and checked on a machine without one, each
call ('fwd', 'bwd', 'varlen_fwd', 'varlen_bwd') has a second implementation here: an FFI target of
XLA's CPU platform (fmha_rt/xla_cpu_handler.py) running fmha_rt.reference, rounded to the call's dtypes.
It is opt-in (enable()) and serves only when jax has no GPU platform; the call is staged for the CPU
platform alone (jax.lax.platform_dependent with no other branch), so a program that holds it cannot be
lowered for a GPU at all.

Every sequence and head is computed on its own in float64, so a call over a slice of the batch or of
the heads gives bitwise the rows of the whole call: the property the sharding tests rely on. Dropout is
refused: the reference draws no random numbers, and the kernels' Philox mask is drawn on a GPU.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from . import reference, xla_cpu_handler
from .errors import FmhaNotImplementedError
from .replay.xla_program import ATTENTION_DTYPES
from .plan.problem import AttentionProblem

ARCH = "cpu-reference"  # the `arch` fmha_rt.jax plans for when this implementation serves

_enabled = False


def enable() -> None:
    """Let fmha_rt.jax run on jax's CPU platform through the float64 reference (a machine with a GPU
    platform still runs the kernels)."""
    global _enabled
    _enabled = True


def enabled() -> bool:
    """Whether enable() has made the CPU implementation the one fmha_rt.jax lowers to without a GPU."""
    return _enabled


def _options(problem: AttentionProblem) -> dict:
    return {"softmax_scale": problem.softmax_scale, "window": (problem.window_left, problem.window_right),
            "bottom_right": problem.bottom_right}


def _result_shapes(kind: str, problem: AttentionProblem, q, k, v, bias):
    dtype = jnp.dtype(ATTENTION_DTYPES[problem.dtype])
    if kind.endswith("fwd"):
        lse = (problem.heads_q, problem.total_q) if problem.varlen else \
            (problem.batch, problem.heads_q, problem.seqlen_q)
        return [jax.ShapeDtypeStruct((*q.shape[:-1], v.shape[-1]), dtype), jax.ShapeDtypeStruct(lse, jnp.float32)]
    grads = [jax.ShapeDtypeStruct(x.shape, dtype) for x in (q, k, v)]
    return grads + ([jax.ShapeDtypeStruct(bias.shape, dtype)] if problem.bias_grad else [])


def _reference(kind: str, problem: AttentionProblem, has_bias: bool, has_alibi: bool, operands, results):
    """The host side of a call: the reference on the operands (NumPy, in `kind`'s order), rounded into
    the results."""
    operands = list(operands)
    dout = operands.pop(0) if kind.endswith("bwd") else None
    q, k, v = operands[:3]
    rest = operands[3:] if kind.endswith("fwd") else operands[5:]  # a backward's out and lse are recomputed
    cu = (rest.pop(0), rest.pop(0)) if problem.varlen else ()
    terms = {"bias": rest.pop(0) if has_bias else None, "alibi_slopes": rest.pop(0) if has_alibi else None}
    if kind.endswith("fwd"):
        fn = reference.mha_varlen_fwd_ref if problem.varlen else reference.mha_fwd_ref
        values = fn(q, k, v, *cu, **_options(problem), **terms)
    else:
        fn = reference.mha_varlen_bwd_ref if problem.varlen else reference.mha_bwd_ref
        values = fn(dout, q, k, v, *cu, **_options(problem), **terms)
    for result, value in zip(results, values):
        result[...] = value.astype(result.dtype)


_targets: dict[tuple, str] = {}


def _target(kind: str, problem: AttentionProblem, has_bias: bool, has_alibi: bool) -> str:
    """The CPU FFI target of one call (registered on first use): one per kind and problem, so that the
    handler needs no attribute to know what to compute."""
    key = (kind, problem, has_bias, has_alibi)
    if key not in _targets:
        name = f"fmha_rt_cpu_reference_{len(_targets)}"
        xla_cpu_handler.register(name, functools.partial(_reference, *key))
        _targets[key] = name
    return _targets[key]


def call(kind: str, problem: AttentionProblem, arrays):
    """The call `kind` on `arrays` (fmha_rt.jax's operand order, None where absent) on the CPU platform:
    the forwards return (out, lse), the backwards (dq, dk, dv) and dbias when the problem has bias_grad."""
    if problem.has_dropout:
        raise FmhaNotImplementedError("fmha_rt.jax on the CPU platform (the float64 reference) has no dropout: "
                                      "the kernels' Philox mask is drawn on a GPU")
    forward = kind.endswith("fwd")
    q, k, v = arrays[:3] if forward else arrays[1:4]
    bias, alibi = arrays[-3], arrays[-2]
    target = _target(kind, problem, bias is not None, alibi is not None)
    shapes = _result_shapes(kind, problem, q, k, v, bias)

    def on_cpu(*operands):
        return tuple(jax.ffi.ffi_call(target, shapes)(*operands))

    return jax.lax.platform_dependent(*(x for x in arrays if x is not None), cpu=on_cpu)
