"""JAX adapter: attention under jit, grad and vmap, through XLA's FFI.

    from fmha_rt.jax import flash_attention, flash_attention_varlen
    out = flash_attention(q, k, v, causal=True)        # q [B, Sq, Hq, D], k/v [B, Sk, Hk, D]: jax arrays

How it runs. Shapes are static under jit, so when a call is traced fmha_rt validates it, plans its
kernels for the GPU's arch and packs their arguments with placeholder pointers into a launch program
(fmha_rt.launch_program), which becomes an attribute of an XLA custom call. When XLA runs the call, the
shim's FFI handler (fmha_rt/xla_ffi.c) writes the buffers' addresses into the packed arguments and
launches on XLA's stream and device: no Python runs then, and the GIL is never taken. The backward is
a second custom call, through jax.custom_vjp; its workspace is an extra result of that call (XLA
allocates it), and the handler zeroes the regions that must start at zero. Under vmap the mapped axis
of a batch call is folded into its batch, so a vmapped call is one custom call, not a loop (varlen calls
run one after another). The kernel images are
registered with the shim at trace time; the handler loads them into the kernel map on first use, per
device.

Semantics follow mha_fwd: masks align top-left unless causal_alignment="bottom_right" (as in
jax.nn.dot_product_attention); window=(left, right) with -1 for unbounded; softmax_scale defaults to
1/sqrt(D). The backward is deterministic by construction (bitwise equal across runs).
"""
from __future__ import annotations

import dataclasses
import functools
import threading

import jax
import jax.numpy as jnp

from . import backend, launch_program
from .api import INT32_LIMIT, MaskSpec, batch_dims, check_sizes, resolve_mask
from .arrays import ATTN_DTYPES
from .backend import ffi, lib
from .errors import (
    FmhaNotImplementedError,
    FmhaRuntimeError,
    FmhaTypeError,
    FmhaValueError,
)
from .problem import AttentionProblem
from .registry import registry

__all__ = ["flash_attention", "flash_attention_varlen", "handler_built", "register_targets"]

HANDLER = "fmha_xla_run_program"
# One handler runs every program; the targets differ in name only, so that HLO dumps and profiles
# say which call is which.
TARGETS = {"fwd": "fmha_rt_fwd", "bwd": "fmha_rt_bwd", "varlen_fwd": "fmha_rt_varlen_fwd",
           "varlen_bwd": "fmha_rt_varlen_bwd"}
JAX_PLATFORMS = {"cuda": "CUDA", "hip": "ROCM"}

_lock = threading.Lock()
_registered_platforms: set[str] = set()
_registered_images: set[str] = set()


# ----------------------------------------------------------------------------------- registration


def handler_built() -> bool:
    """Whether the shim was built with the XLA FFI handler (jaxlib's headers found at build time)."""
    return hasattr(lib, HANDLER)


def _handler_api_version() -> str:
    major, minor = ffi.new("int *"), ffi.new("int *")
    lib.fmha_xla_ffi_api_version(major, minor)
    return f"{major[0]}.{minor[0]}"


def register_targets(platform: str | None = None) -> None:
    """Register fmha_rt's FFI targets with jax for `platform` ("CUDA" or "ROCM"; default: the one of
    fmha_rt's GPU backend). flash_attention does this on first use; idempotent."""
    if not handler_built():
        raise FmhaRuntimeError(
            "fmha_rt's C shim was built without the XLA FFI handler: jaxlib's headers "
            "(xla/ffi/api/c_api.h) were not found at build time. Install jax, then rebuild fmha_rt in the "
            "same environment: pip install --no-build-isolation -e . (or set FMHA_RT_XLA_FFI_INCLUDE)")
    if platform is None:
        platform = JAX_PLATFORMS[backend.runtime().backend]
    with _lock:
        if platform in _registered_platforms:
            return
        capsule = jax.ffi.pycapsule(int(ffi.cast("uintptr_t", ffi.addressof(lib, HANDLER))))
        try:
            for target in TARGETS.values():
                jax.ffi.register_ffi_target(target, capsule, platform=platform)
        except Exception as exc:  # jax's own error types vary across versions
            raise FmhaRuntimeError(
                f"registering fmha_rt's XLA FFI targets for {platform} failed: {exc}. The handler was built "
                f"against XLA FFI API {_handler_api_version()}; rebuild fmha_rt against the installed jax "
                "(pip install --no-build-isolation -e .)") from exc
        _registered_platforms.add(platform)


def _gpu_arch() -> str:
    """The arch to plan for, once jax's GPU platform and fmha_rt's driver are known to be there and the
    targets are registered. Plans are per arch, so a process with GPUs of two archs is refused."""
    try:
        gpus = jax.devices("gpu")
    except RuntimeError:
        gpus = []
    if not gpus:
        have = ", ".join(sorted({d.platform for d in jax.devices()}))
        raise FmhaRuntimeError(f"fmha_rt.jax runs on a GPU, but jax has no GPU platform here (only: {have}); "
                               "install jax with CUDA or ROCm support")
    archs = {d.arch for d in backend.runtime().devices}
    if len(archs) != 1:
        raise FmhaNotImplementedError(f"fmha_rt.jax plans for one GPU arch per process; found {sorted(archs) or 'none'}")
    register_targets()
    return archs.pop()


def _register_images(program, arch) -> None:
    """Give the shim every kernel image `program` launches, so that the handler can load them."""
    reg = registry()
    for launch in program.launches:
        if launch.key in _registered_images:
            continue
        entry = reg.entry(arch, launch.key)
        image = reg.image(entry)
        backend.check(lib.fmha_image_register(entry.key.encode(), image, len(image), entry.symbol.encode(),
                                              entry.shared), "fmha_image_register", kernel=entry.key)
        _registered_images.add(launch.key)


# ------------------------------------------------------------------------------------- validation


@dataclasses.dataclass(frozen=True)
class _Options:
    """Everything static about a call besides its shapes: the key of its cached jax functions."""

    softmax_scale: float | None
    mask: MaskSpec
    deterministic: bool
    arch: str
    max_seqlen_q: int = 0  # varlen only
    max_seqlen_k: int = 0


def _static_options(causal, window, causal_alignment, softmax_scale, deterministic) -> tuple:
    mask = resolve_mask(causal, tuple(window) if isinstance(window, list) else window, None, causal_alignment)
    if softmax_scale is not None:
        if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)):
            raise FmhaTypeError(f"softmax_scale must be a Python float or None (it is static under jit), "
                                f"got {type(softmax_scale).__name__}")
        if not 0.0 < softmax_scale <= 1e38:  # the kernels take scale * log2(e) as a float32
            raise FmhaValueError(f"softmax_scale must be in (0, 1e38], got {softmax_scale!r}")
        softmax_scale = float(softmax_scale)
    if not isinstance(deterministic, bool):
        raise FmhaTypeError(f"deterministic must be a bool, got {type(deterministic).__name__}")
    return softmax_scale, mask, deterministic


def _dtype(q, k, v) -> str:
    names = [jnp.dtype(x.dtype).name for x in (q, k, v)]
    if names[0] not in ATTN_DTYPES:
        raise FmhaTypeError(f"q has dtype {names[0]}: fmha_rt takes {' or '.join(ATTN_DTYPES)}")
    for name, dtype in zip(("k", "v"), names[1:]):
        if dtype != names[0]:
            raise FmhaTypeError(f"{name} has dtype {dtype} but q has {names[0]}: they must match")
    return ATTN_DTYPES[names[0]]


def _rank(rank, **arrays) -> None:
    for name, x in arrays.items():
        if jnp.ndim(x) != rank:
            raise FmhaValueError(f"{name} must have {rank} dims, got shape {tuple(jnp.shape(x))}")


def _problem(dtype, batch, sq, sk, hq, hk, dqk, dv, opts: _Options, **varlen) -> AttentionProblem:
    check_sizes(sq, sk, hq, hk, dqk, dv)
    if dqk % 8 or dv % 8:  # the launch programs carry no head-padding copies
        raise FmhaNotImplementedError(f"fmha_rt.jax: head dims must be multiples of 8, got {dqk} and {dv} (pad "
                                      "the last dim with zeros to the next multiple of 8)")
    m = opts.mask
    return AttentionProblem(batch=batch, seqlen_q=sq, seqlen_k=sk, heads_q=hq, heads_k=hk, head_dim_qk=dqk,
                            head_dim_v=dv, dtype=dtype, softmax_scale=opts.softmax_scale, window_left=m.window_left,
                            window_right=m.window_right, bottom_right=m.bottom_right,
                            deterministic=opts.deterministic, **varlen)


def _batch_problem(q, k, v, opts: _Options) -> AttentionProblem:
    _rank(4, q=q, k=k, v=v)
    dtype = _dtype(q, k, v)
    b, sq, sk, hq, hk, dqk, dv = batch_dims(q.shape, k.shape, v.shape)
    return _problem(dtype, b, sq, sk, hq, hk, dqk, dv, opts)


def _varlen_problem(q, k, v, cu_seqlens_q, cu_seqlens_k, opts: _Options) -> AttentionProblem:
    _rank(3, q=q, k=k, v=v)
    _rank(1, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
    dtype = _dtype(q, k, v)
    (tq, hq, dqk), (tk, hk, dk), (tv, hv, dv) = q.shape, k.shape, v.shape
    if (tv, hv) != (tk, hk) or dk != dqk:
        raise FmhaValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must agree on rows and heads, and k's "
                             f"head dim must equal q's ({dqk})")
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if jnp.dtype(cu.dtype) != jnp.int32:
            raise FmhaTypeError(f"{name} must be int32, got {jnp.dtype(cu.dtype).name}")
    if cu_seqlens_q.shape != cu_seqlens_k.shape or cu_seqlens_q.shape[0] < 2:
        raise FmhaValueError(f"cu_seqlens_q {tuple(cu_seqlens_q.shape)} and cu_seqlens_k "
                             f"{tuple(cu_seqlens_k.shape)} must both have B + 1 >= 2 entries")
    return _problem(dtype, cu_seqlens_q.shape[0] - 1, opts.max_seqlen_q, opts.max_seqlen_k, hq, hk, dqk, dv, opts,
                    varlen=True, total_q=tq, total_k=tk)


def _max_seqlen(name, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < INT32_LIMIT:
        raise FmhaValueError(f"{name} must be a Python int in [0, 2^31) (it is static under jit), got {value!r}")
    return value


# ------------------------------------------------------------------------------------ the calls


@functools.lru_cache(maxsize=512)
def _program(kind: str, problem: AttentionProblem, arch: str):
    """(launch program, its int64 words) of one call, planned once per problem and arch."""
    build = launch_program.backward if kind.endswith("bwd") else launch_program.forward
    program = build(problem, arch)
    _register_images(program, arch)
    words = program.encode()
    words.flags.writeable = False
    return program, words


def _call(kind: str, problem: AttentionProblem, arch: str, arrays):
    """The custom call running `kind` ('fwd', 'bwd', 'varlen_fwd', 'varlen_bwd') on `arrays`: the
    forwards return (out, lse), the backwards (dq, dk, dv)."""
    program, words = _program(kind, problem, arch)
    results = [jax.ShapeDtypeStruct(b.shape, jnp.dtype(b.dtype)) for b in program.results]
    # 'sequential' serves the varlen calls under vmap (a batch call folds the mapped axis instead):
    # the unbatched call keeps the shapes its program was built for.
    outs = jax.ffi.ffi_call(TARGETS[kind], results, vmap_method="sequential")(*arrays, program=words)
    return tuple(outs[:2] if kind.endswith("fwd") else outs[:3])


def _fold_vmap(fn):
    """fn(*arrays) -> tuple of arrays, every one with the batch leading. Under vmap the mapped axis is
    folded into that batch: one call over V * B, then split again."""
    folded = jax.custom_batching.custom_vmap(fn)

    @folded.def_vmap
    def _rule(axis_size, in_batched, *arrays):
        arrays = [x if batched else jnp.broadcast_to(x, (axis_size, *x.shape)) for x, batched in zip(arrays, in_batched)]
        outs = folded(*(x.reshape(axis_size * x.shape[1], *x.shape[2:]) for x in arrays))
        return tuple(o.reshape(axis_size, o.shape[0] // axis_size, *o.shape[1:]) for o in outs), (True,) * len(outs)

    return folded


@functools.cache
def _batch_attention(opts: _Options):
    """The differentiable attention of one set of options (cached, so jit sees one function)."""
    fwd = _fold_vmap(lambda q, k, v: _call("fwd", _batch_problem(q, k, v, opts), opts.arch, (q, k, v)))
    bwd = _fold_vmap(lambda dout, q, k, v, out, lse: _call(
        "bwd", _batch_problem(q, k, v, opts), opts.arch, (dout, q, k, v, out, lse)))

    @jax.custom_vjp
    def attention(q, k, v):
        return fwd(q, k, v)[0]

    def forward(q, k, v):
        out, lse = fwd(q, k, v)
        return out, (q, k, v, out, lse)

    def backward(residuals, dout):
        q, k, v, out, lse = residuals
        return tuple(bwd(dout, q, k, v, out, lse))

    attention.defvjp(forward, backward)
    return attention


@functools.cache
def _varlen_attention(opts: _Options):
    def problem(q, k, v, cu_q, cu_k):
        return _varlen_problem(q, k, v, cu_q, cu_k, opts)

    @jax.custom_vjp
    def attention(q, k, v, cu_q, cu_k):
        return _call("varlen_fwd", problem(q, k, v, cu_q, cu_k), opts.arch, (q, k, v, cu_q, cu_k))[0]

    def forward(q, k, v, cu_q, cu_k):
        out, lse = _call("varlen_fwd", problem(q, k, v, cu_q, cu_k), opts.arch, (q, k, v, cu_q, cu_k))
        return out, (q, k, v, cu_q, cu_k, out, lse)

    def backward(residuals, dout):
        q, k, v, cu_q, cu_k, out, lse = residuals
        dq, dk, dv = _call("varlen_bwd", problem(q, k, v, cu_q, cu_k), opts.arch,
                           (dout, q, k, v, out, lse, cu_q, cu_k))
        return dq, dk, dv, None, None  # the offsets are integers: no cotangent

    attention.defvjp(forward, backward)
    return attention


# ------------------------------------------------------------------------------------ public API


def flash_attention(q, k, v, *, causal=False, softmax_scale=None, window=(-1, -1), causal_alignment="top_left",
                    deterministic=False):
    """Attention with gradients, for jit, grad and vmap: q [B, Sq, Hq, D], k [B, Sk, Hk, D],
    v [B, Sk, Hk, Dv] (fp16 or bf16, on a GPU) -> out [B, Sq, Hq, Dv].

    causal=True is window (left, 0); window=(left, right) with -1 for unbounded; causal_alignment
    "top_left" (default, as mha_fwd and jax.nn.dot_product_attention) or "bottom_right" (flash-attn).
    softmax_scale defaults to 1/sqrt(D). deterministic=True asks for a bitwise repeatable backward
    (every shipped backward is). Hq must be a multiple of Hk (GQA/MQA: K/V are never repeated).
    """
    scale, mask, det = _static_options(causal, window, causal_alignment, softmax_scale, deterministic)
    _batch_problem(q, k, v, _Options(scale, mask, det, arch=""))  # shape errors before platform errors
    return _batch_attention(_Options(scale, mask, det, arch=_gpu_arch()))(q, k, v)


def flash_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, causal=False,
                           softmax_scale=None, window=(-1, -1), causal_alignment="top_left", deterministic=False):
    """Attention over packed sequences, with gradients: q [total_q, Hq, D], k/v [total_k, Hk, D],
    cu_seqlens_q/k int32 [B + 1] jax arrays (sequence b is rows cu[b]:cu[b+1]), max_seqlen_q/k Python
    ints bounding every sequence (static under jit) -> out [total_q, Hq, Dv]. The offsets are used as
    they are: under jit they cannot be checked on the host. Masks apply per sequence; options as in
    flash_attention. Under vmap the calls run one after another."""
    scale, mask, det = _static_options(causal, window, causal_alignment, softmax_scale, deterministic)
    seqlens = {"max_seqlen_q": _max_seqlen("max_seqlen_q", max_seqlen_q),
               "max_seqlen_k": _max_seqlen("max_seqlen_k", max_seqlen_k)}
    _varlen_problem(q, k, v, cu_seqlens_q, cu_seqlens_k, _Options(scale, mask, det, arch="", **seqlens))
    opts = _Options(scale, mask, det, arch=_gpu_arch(), **seqlens)
    return _varlen_attention(opts)(q, k, v, cu_seqlens_q, cu_seqlens_k)
