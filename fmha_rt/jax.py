"""JAX adapter: attention under jit, grad and vmap, through XLA's FFI.

    from fmha_rt.jax import flash_attention, flash_attention_varlen
    out = flash_attention(q, k, v, causal=True)        # q [B, Sq, Hq, D], k/v [B, Sk, Hk, D]: jax arrays
    out = flash_attention(q, k, v, bias=bias)          # bias [1|B, 1|Hq, Sq, Sk]: jax.grad gives dbias too
    out = flash_attention(q, k, v, dropout_rate=0.1, dropout_rng=jax.random.key(0))
    out, lse = flash_attention(q, k, v, return_lse=True)  # lse [B, Hq, Sq] float32, without a gradient

How it runs. Shapes are static under jit, so when a call is traced fmha_rt validates it, plans its
kernels for the GPU's arch and packs their arguments with placeholder pointers into a launch program
(fmha_rt.replay.xla_program), which becomes an attribute of an XLA custom call. When XLA runs the call, the
shim's FFI handler (fmha_rt/csrc/xla_ffi.c) writes the buffers' addresses into the packed arguments and
launches on XLA's stream and device: no Python runs then, and the GIL is never taken. The backward is
a second custom call, through jax.custom_vjp. A call's workspace is an extra result (XLA allocates it;
fmha_rt.jax drops it): the backward's, whose regions that must start at zero the handler zeroes, and
the v3 forward's, where its programs make their TMA descriptors (the handler checks that address
against the alignment the kernel was compiled for, as every pointer). Under vmap the mapped axis
of a batch call is folded into its batch, so a vmapped call is one custom call, not a loop (varlen calls
run one after another). The kernel images are
registered with the shim at trace time; the handler loads them into the kernel map on first use, per
device.

Under jit over a device mesh, each call splits over batch and heads by a custom_partitioning rule
(fmha_rt/jax_sharding.py, docs/scaling-out.md); without a GPU, fmha_rt.jax_cpu_reference.enable() lets
the calls run on the CPU platform through the float64 reference (for tests).

Score terms and dropout. A bias (q's dtype, [1|B, 1|Hq, Sq, Sk]) is an operand of both custom calls;
the backward returns dbias in the bias's shape, and only when the bias is differentiated (custom_vjp's
`perturbed`), so a constant bias costs the backward no dS workspace. ALiBi slopes (float32 [Hq] or
[B, Hq]) are an operand without a gradient. Dropout's Philox seed and offset are drawn from dropout_rng
with jax.random inside the traced function: two int64 in [0, 2^62), carried as four little-endian
uint32 words (so that no jax_enable_x64 is needed), one operand that both custom calls take, so the
backward drops what the forward dropped. philox_seed_offset(key) gives that pair as ints, and
fmha_rt.mha_dropout_mask(q, k, dropout_p=rate, seed=seed, offset=offset) the mask it draws.

Under vmap (_fold_vmap) an unmapped [1, ..] bias and unmapped [Hq] slopes go to the folded call as they
are; other biases and slopes are broadcast to the folded batch (an unmapped [1, ..] bias too, in a
backward that returns dbias: each instance needs its own), and each instance's dbias is summed back to
its bias's shape. An unmapped key seeds the one folded call: instance i draws rows i*B..(i+1)*B of the
mask for the [V * B, ..] shapes (not the mask a separate call with that key draws). A mapped key runs
the instances one after another (jax.lax.map), each with its own key.

Semantics follow mha_fwd: masks align top-left unless causal_alignment="bottom_right" (as in
jax.nn.dot_product_attention); window=(left, right) with -1 for unbounded; softmax_scale defaults to
1/sqrt(D). The backward is bitwise repeatable unless deterministic=False meets the v3 family's backward
(FMHA_RT_V3=1, fmha_rt/plan/v3.py), whose dQ additions come in varying order. Head dims that
are not multiples of 8 are zero-padded around the custom calls (_padded_head_dims), whose programs
carry no padding copies.
"""
from __future__ import annotations

import dataclasses
import functools
import threading

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import SymbolicZero

from . import call_log, jax_cpu_reference, jax_sharding
from .plan import dispatch
from .runtime import backend, kernel_launch
from .replay import xla_program
from .validation import (
    INT32_LIMIT,
    MaskSpec,
    alibi_shape_name,
    batch_dims,
    bias_shape_name,
    check_bool,
    check_dropout_p,
    check_one_score_term,
    check_sizes,
    check_softmax_scale,
    resolve_mask,
)
from .arrays import ATTN_DTYPES
from .runtime.backend import ffi, lib
from .errors import (
    FmhaNotImplementedError,
    FmhaRuntimeError,
    FmhaTypeError,
    FmhaValueError,
)
from .plan.problem import AttentionProblem
from .runtime.registry import registry

__all__ = ["flash_attention", "flash_attention_varlen", "handler_built", "philox_seed_offset", "register_targets"]

HANDLER = "fmha_xla_run_program"
# One handler runs every program; the targets differ in name only, so that HLO dumps and profiles
# say which call is which.
TARGETS = {"fwd": "fmha_rt_fwd", "bwd": "fmha_rt_bwd", "varlen_fwd": "fmha_rt_varlen_fwd",
           "varlen_bwd": "fmha_rt_varlen_bwd"}
JAX_PLATFORMS = {"cuda": "CUDA", "hip": "ROCM"}

_lock = threading.Lock()
registered_platforms: set[str] = set()
_registered_images: set[str] = set()


# ----------------------------------------------------------------------------------- registration


def handler_built() -> bool:
    """Whether the shim was built with the XLA FFI handler (jaxlib's headers found at build time)."""
    return hasattr(lib, HANDLER)


def handler_api_version() -> str:
    """The XLA FFI API version (major.minor) the shim's handler was built against."""
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
        if platform in registered_platforms:
            return
        capsule = jax.ffi.pycapsule(int(ffi.cast("uintptr_t", ffi.addressof(lib, HANDLER))))
        try:
            for target in TARGETS.values():
                jax.ffi.register_ffi_target(target, capsule, platform=platform)
        except Exception as exc:  # jax's own error types vary across versions
            raise FmhaRuntimeError(
                f"registering fmha_rt's XLA FFI targets for {platform} failed: {exc}. The handler was built "
                f"against XLA FFI API {handler_api_version()}; rebuild fmha_rt against the installed jax "
                "(pip install --no-build-isolation -e .)") from exc
        registered_platforms.add(platform)


def gpu_arch() -> str:
    """The arch to plan for, once jax's GPU platform and fmha_rt's driver are known to be there and the
    targets are registered. Plans are per arch, so a process with GPUs of two archs is refused."""
    try:
        gpus = jax.devices("gpu")
    except RuntimeError:
        gpus = []
    if not gpus and jax_cpu_reference.enabled():
        return jax_cpu_reference.ARCH
    if not gpus:
        have = ", ".join(sorted({d.platform for d in jax.devices()}))
        raise FmhaRuntimeError(f"fmha_rt.jax runs on a GPU, but jax has no GPU platform here (only: {have}); "
                               "install jax with CUDA or ROCm support (or, for tests, fmha_rt.jax_cpu_reference.enable())")
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
class CallOptions:
    """Everything static about a call besides its shapes: the key of its cached jax functions."""

    softmax_scale: float | None
    mask: MaskSpec
    deterministic: bool
    arch: str
    dropout_p: float = 0.0
    max_seqlen_q: int = 0  # varlen only
    max_seqlen_k: int = 0


def _static_options(causal, window, causal_alignment, softmax_scale, deterministic, dropout_rate) -> dict:
    """CallOptions' fields (all but arch and the varlen lengths), validated."""
    mask = resolve_mask(causal, tuple(window) if isinstance(window, list) else window, None, causal_alignment)
    check_softmax_scale(softmax_scale, "a Python float or None (it is static under jit)")
    softmax_scale = None if softmax_scale is None else float(softmax_scale)
    check_bool("deterministic", deterministic)
    if isinstance(dropout_rate, bool) or not isinstance(dropout_rate, (int, float)):
        raise FmhaTypeError(f"dropout_rate must be a Python float (it is static under jit), "
                            f"got {type(dropout_rate).__name__}")
    return {"softmax_scale": softmax_scale, "mask": mask, "deterministic": deterministic,
            "dropout_p": check_dropout_p(dropout_rate, "dropout_rate")}


def _dtype(q, k, v) -> str:
    """The dtype of q, k and v (jax's name: 'float16' or 'bfloat16')."""
    names = [jnp.dtype(x.dtype).name for x in (q, k, v)]
    if names[0] not in ATTN_DTYPES:
        raise FmhaTypeError(f"q has dtype {names[0]}: fmha_rt takes {' or '.join(ATTN_DTYPES)}")
    for name, dtype in zip(("k", "v"), names[1:]):
        if dtype != names[0]:
            raise FmhaTypeError(f"{name} has dtype {dtype} but q has {names[0]}: they must match")
    return names[0]


def _rank(rank, **arrays) -> None:
    for name, x in arrays.items():
        if jnp.ndim(x) != rank:
            raise FmhaValueError(f"{name} must have {rank} dims, got shape {tuple(jnp.shape(x))}")


def _score_terms(dtype, batch, sq, sk, hq, bias, alibi, bias_grad) -> dict:
    """AttentionProblem's bias_shape, bias_grad and alibi for a bias (q's dtype, [1|B, 1|Hq, Sq, Sk]) and
    ALiBi slopes (float32 [Hq] or [B, Hq]), each None when absent; validated as mha_fwd does."""
    check_one_score_term(bias, alibi)
    terms = {}
    if bias is not None:
        if jnp.dtype(bias.dtype).name != dtype:
            raise FmhaTypeError(f"bias has dtype {jnp.dtype(bias.dtype).name} but q has {dtype}: they must match")
        terms.update(bias_shape=bias_shape_name(jnp.shape(bias), batch, hq, sq, sk), bias_grad=bias_grad)
    if alibi is not None:
        if jnp.dtype(alibi.dtype) != jnp.float32:
            raise FmhaTypeError(f"alibi_slopes must be float32, got {jnp.dtype(alibi.dtype).name}")
        terms["alibi"] = alibi_shape_name(jnp.shape(alibi), batch, hq)
    return terms


def _problem(dtype, batch, sq, sk, hq, hk, dqk, dv, opts: CallOptions, bias=None, alibi=None, bias_grad=False,
             **varlen) -> AttentionProblem:
    check_sizes(sq, sk, hq, hk, dqk, dv)
    m = opts.mask
    return AttentionProblem(batch=batch, seqlen_q=sq, seqlen_k=sk, heads_q=hq, heads_k=hk, head_dim_qk=dqk,
                            head_dim_v=dv, dtype=ATTN_DTYPES[dtype], softmax_scale=opts.softmax_scale,
                            window_left=m.window_left, window_right=m.window_right, bottom_right=m.bottom_right,
                            dropout_p=opts.dropout_p, deterministic=opts.deterministic,
                            **_score_terms(dtype, batch, sq, sk, hq, bias, alibi, bias_grad), **varlen)


def batch_problem(q, k, v, opts: CallOptions, bias=None, alibi=None, bias_grad=False) -> AttentionProblem:
    _rank(4, q=q, k=k, v=v)
    dtype = _dtype(q, k, v)
    b, sq, sk, hq, hk, dqk, dv = batch_dims(q.shape, k.shape, v.shape)
    return _problem(dtype, b, sq, sk, hq, hk, dqk, dv, opts, bias, alibi, bias_grad)


def _varlen_problem(q, k, v, cu_seqlens_q, cu_seqlens_k, opts: CallOptions, alibi=None) -> AttentionProblem:
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
                    alibi=alibi, varlen=True, total_q=tq, total_k=tk)


def _max_seqlen(name, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < INT32_LIMIT:
        raise FmhaValueError(f"{name} must be a Python int in [0, 2^31) (it is static under jit), got {value!r}")
    return value


def _static_bool(name, value) -> bool:
    if not isinstance(value, bool):
        raise FmhaTypeError(f"{name} must be a Python bool (it is static under jit), got {type(value).__name__}")
    return value


def _array(x):
    """A bias or slopes argument as a jax array (None stays None)."""
    return None if x is None else jnp.asarray(x)


# ---------------------------------------------------------------------------------------- dropout

# Seed and offset are each drawn in [0, 2^62), as the torch adapter draws them: the kernels' Philox
# counters (offset plus at most B * Hq * Sq * Sk / 4) then never leave int64.
_PHILOX_MASKS = (0xFFFFFFFF, 0x3FFFFFFF, 0xFFFFFFFF, 0x3FFFFFFF)


def _dropout_key(dropout_p: float, dropout_rng):
    """The typed PRNG key of a call with dropout (None without: then dropout_rng is not used)."""
    if dropout_p == 0.0:
        return None
    if dropout_rng is None:
        raise FmhaValueError("dropout_rate > 0 needs dropout_rng, a jax PRNG key (jax.random.key(n) or "
                             "jax.random.PRNGKey(n)); split a fresh one for every step")
    return _prng_key(dropout_rng)


def _prng_key(rng):
    """`rng` as one typed PRNG key: a typed key, or the raw uint32 data of one (jax.random.PRNGKey)."""
    dtype = getattr(rng, "dtype", None)
    if dtype is not None and jnp.issubdtype(dtype, jax.dtypes.prng_key):
        key = rng
    else:
        try:
            key = jax.random.wrap_key_data(rng)
        except (TypeError, ValueError) as exc:
            raise FmhaTypeError(f"dropout_rng must be a jax PRNG key (jax.random.key(n) or jax.random.PRNGKey(n)), "
                                f"got {type(rng).__name__} of dtype {dtype} and shape {tuple(jnp.shape(rng))}") from exc
    if jnp.shape(key) != ():
        raise FmhaValueError(f"dropout_rng must be one PRNG key, got an array of keys of shape {jnp.shape(key)}")
    return key


def philox_words(key):
    """The dropout's Philox [seed, offset] drawn from `key`: two int64 as their four little-endian uint32
    words [seed low, seed high, offset low, offset high], the operand both custom calls take (uint32, so
    that no int64 array, and no jax_enable_x64, is needed)."""
    bits = jax.random.bits(key, (xla_program.PHILOX_WORDS,), jnp.uint32)
    return bits & jnp.array(_PHILOX_MASKS, jnp.uint32)


def philox_seed_offset(dropout_rng) -> tuple[int, int]:
    """The Philox (seed, offset) with which flash_attention(..., dropout_rate=p, dropout_rng=dropout_rng)
    draws its dropout mask, as Python ints (call it outside jit). For tests and debugging:
    fmha_rt.mha_dropout_mask(q, k, dropout_p=p, seed=seed, offset=offset) returns that call's keep mask
    (uint8 [B, Hq, Sq, Sk], 1 = kept; for a varlen call, sequence b's mask is [b, :, :len_q, :len_k] of
    the mask for [B, max_seqlen_q, ...] shapes)."""
    words = np.asarray(philox_words(_prng_key(dropout_rng)), dtype="<u4")
    seed, offset = (int(x) for x in words.view("<i8"))
    return seed, offset


# ------------------------------------------------------------------------------------ the calls


@functools.lru_cache(maxsize=512)
def _program(kind: str, problem: AttentionProblem, arch: str):
    """(launch program, its int64 words) of one call, planned once per problem and arch."""
    build = xla_program.backward if kind.endswith("bwd") else xla_program.forward
    program = build(problem, arch)
    _register_images(program, arch)
    words = program.encode()
    words.flags.writeable = False
    return program, words


def _pad_keys(x, width):
    """A bias whose rows are padded with zeros to `width` keys (the row pitch of the program's buffer)."""
    pad = width - x.shape[-1]
    return x if pad == 0 else jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)])


def kernel_call(kind: str, problem: AttentionProblem, arch: str, arrays):
    """The custom call running `kind` ('fwd', 'bwd', 'varlen_fwd', 'varlen_bwd') on `arrays` in the
    program's operand order, None where the call has no bias, slopes or seed: the forwards return
    (out, lse), the backwards (dq, dk, dv) and dbias when the problem has bias_grad. Under jit over a
    device mesh, XLA's partitioner splits it over batch and heads (fmha_rt/jax_sharding.py)."""
    return jax_sharding.sharded_call(_local_call, kind, problem, arch, arrays)


def _local_call(kind: str, problem: AttentionProblem, arch: str, arrays):
    """kernel_call on one device's operands, planned for their shapes (the CPU platform's float64 reference
    when that serves, fmha_rt/jax_cpu_reference.py)."""
    if arch == jax_cpu_reference.ARCH:
        return jax_cpu_reference.call(kind, problem, arrays)
    assert problem.head_dim_qk % 8 == 0 and problem.head_dim_v % 8 == 0, "padded by _padded_head_dims"
    program, _ = _program(kind, problem, arch)
    operands = [x for x in arrays if x is not None]
    assert len(operands) == program.operands, (kind, len(operands), program.operands)
    operands = [_pad_keys(x, b.shape[-1]) if b.name == "bias" else x for x, b in zip(operands, program.buffers)]
    outs = xla_custom_call(kind, problem, arch, operands)
    return tuple(o[..., :problem.seqlen_k] if b.name == "dbias" else o
                 for o, b in zip(outs, program.results) if b.name != "workspace")


def xla_custom_call(kind: str, problem: AttentionProblem, arch: str, operands):
    """XLA's custom call of the launch program of `kind` and `problem` on `operands`: every result of
    the program, the workspace included."""
    program, words = _program(kind, problem, arch)
    if kernel_launch.LOG_CONFIG:
        _log_program(kind, problem, arch, program)
    results = [jax.ShapeDtypeStruct(b.shape, jnp.dtype(b.dtype)) for b in program.results]
    # 'sequential' serves the varlen calls under vmap (a batch call folds the mapped axis instead):
    # the unbatched call keeps the shapes its program was built for.
    return jax.ffi.ffi_call(TARGETS[kind], results, vmap_method="sequential")(*operands, program=words)


def _log_program(kind: str, problem: AttentionProblem, arch: str, program) -> None:
    """FMHA_RT_LOG_CONFIG's line of a custom call, logged when it is traced (the handler that runs it
    is C, and a compiled call runs again without tracing): what XLA will launch, on its buffers."""
    operands = xla_program.placeholder_operands(program.buffers)  # as the call was planned
    workspace = next((b.nbytes for b in program.results if b.name == xla_program.WORKSPACE_BUFFER), 0)
    dq_splits = dispatch.bwd_workspace(problem, arch).dq_splits if kind.endswith("bwd") else None
    config = call_log.config(f"jax.{kind}", problem, "xla", arch, operands, workspace, dq_splits)
    call_log.log_call(config, [launch.key for launch in program.launches])


# ------------------------------------------------------------------------------------------- vmap


def _merge(x):
    """[V, B, ...] -> [V * B, ...]."""
    return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def _split(x, axis_size):
    """[V * B, ...] -> [V, B, ...]."""
    return x.reshape(axis_size, x.shape[0] // axis_size, *x.shape[1:])


def _fold_bias(bias, batched, axis_size, batch, per_instance_grad):
    """The bias of the folded call (batch V * B). An unmapped [1, ..] bias stays as it is, read by every
    entry of the folded batch, unless each instance needs its own dbias; any other bias is folded with the
    batch, broadcast over it where it has one row for it."""
    if bias is None or (not batched and bias.shape[0] == 1 and not per_instance_grad):
        return bias
    stacked = bias if batched else bias[None]  # [V or 1, 1|B, 1|Hq, Sq, Sk]
    return _merge(jnp.broadcast_to(stacked, (axis_size, batch, *stacked.shape[2:])))


def _unfold_dbias(dbias, bias, batched, axis_size):
    """dbias of the folded call ([V * B, ..]) as each instance's, in the shape of its bias ([V, 1|B, ..]):
    summed over the batch (in float32) where the instance's bias has one row for it."""
    rows = bias.shape[1] if batched else bias.shape[0]
    split = _split(dbias, axis_size)
    if split.shape[1] == rows:
        return split
    return split.astype(jnp.float32).sum(axis=1, keepdims=True).astype(dbias.dtype)


def _fold_alibi(alibi, batched, axis_size, batch):
    """The slopes of the folded call: unmapped [Hq] slopes stay, any others become [V * B, Hq]."""
    if alibi is None or (not batched and alibi.ndim == 1):
        return alibi
    stacked = alibi if batched else alibi[None]  # [V or 1, (B,) Hq]
    if stacked.ndim == 2:
        stacked = stacked[:, None]
    return _merge(jnp.broadcast_to(stacked, (axis_size, batch, stacked.shape[-1])))


def _one_by_one(fn, in_batched, args):
    """fn(*args) for each instance in turn (jax.lax.map over the mapped arrays, the others shared)."""
    leaves, tree = jax.tree_util.tree_flatten(args)
    mapped = jax.tree_util.tree_leaves(in_batched)
    assert len(mapped) == len(leaves)

    def one(xs):
        picked = iter(xs)
        return fn(*tree.unflatten([next(picked) if m else x for x, m in zip(leaves, mapped)]))

    return jax.lax.map(one, [x for x, m in zip(leaves, mapped) if m])


def _fold_vmap(fn, dbias=False):
    """fn(arrays, bias, alibi, seed) -> tuple of arrays: `arrays` and the results have the batch leading,
    bias, alibi and seed are the score terms and the dropout seed (each None when absent), and with
    dbias=True the last result is dbias in the bias's shape.

    Under vmap the mapped axis is folded into the batch: one call over V * B, then split again. The
    score terms follow the batch (_fold_bias, _fold_alibi) and each instance gets dbias in its own bias's
    shape. An unmapped seed serves the folded call, which draws one mask over the V * B batch entries;
    a mapped seed (a key per instance) runs the instances one after another instead, each drawing its
    own key's mask."""
    folded = jax.custom_batching.custom_vmap(fn)

    @folded.def_vmap
    def _rule(axis_size, in_batched, arrays, bias, alibi, seed):
        arrays_batched, bias_batched, alibi_batched, seed_batched = in_batched
        if seed_batched:
            outs = _one_by_one(folded, in_batched, (arrays, bias, alibi, seed))
            return tuple(outs), (True,) * len(outs)
        arrays = [x if b else jnp.broadcast_to(x, (axis_size, *x.shape)) for x, b in zip(arrays, arrays_batched)]
        batch = arrays[0].shape[1]
        outs = folded([_merge(x) for x in arrays], _fold_bias(bias, bias_batched, axis_size, batch, dbias),
                      _fold_alibi(alibi, alibi_batched, axis_size, batch), seed)
        outs = [_split(o, axis_size) for o in outs[:len(outs) - dbias]] + \
            ([_unfold_dbias(outs[-1], bias, bias_batched, axis_size)] if dbias else [])
        return tuple(outs), (True,) * len(outs)

    return folded


# ------------------------------------------------------------------------------- differentiation


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class BiasGrad:
    """A static residual: whether the backward returns dbias (the forward saw the bias differentiated)."""

    wanted: bool


def _out_cotangent(cotangent, with_lse: bool):
    """dout of a backward's cotangent (out's, or with_lse (out's, lse's)). The backward kernels take no
    gradient of lse (it would enter as Delta - dlse): one is refused at trace time rather than dropped."""
    if not with_lse:
        return cotangent
    dout, dlse = cotangent
    if not isinstance(dlse, SymbolicZero):
        raise FmhaNotImplementedError(
            "fmha_rt.jax: lse (return_lse=True) carries no gradient: the backward kernels take none for it. "
            "Differentiate through out only, or put lse under jax.lax.stop_gradient")
    return dout


@functools.cache
def batch_attention(opts: CallOptions, with_lse: bool = False):
    """The differentiable attention of one set of options (cached, so jit sees one function):
    attention(q, k, v, bias, alibi, seed) -> out, or (out, lse) with_lse, with None for an absent bias,
    slopes or seed."""
    def call(kind, arrays, bias, alibi, seed, bias_grad=False):
        q, k, v = arrays[:3] if kind == "fwd" else arrays[1:4]
        problem = batch_problem(q, k, v, opts, bias, alibi, bias_grad)
        return kernel_call(kind, problem, opts.arch, (*arrays, bias, alibi, seed))

    fwd = _fold_vmap(functools.partial(call, "fwd"))
    bwd = {grad: _fold_vmap(functools.partial(call, "bwd", bias_grad=grad), dbias=grad) for grad in (False, True)}

    @jax.custom_vjp
    def attention(q, k, v, bias, alibi, seed):
        out, lse = fwd((q, k, v), bias, alibi, seed)
        return (out, lse) if with_lse else out

    def forward(*primals):
        # symbolic_zeros: each argument comes as a CustomVJPPrimal. A bias that is not differentiated (a
        # constant mask, say) needs no dbias, and so no dS workspace and no reduction in the backward.
        bias_grad = primals[3] is not None and primals[3].perturbed
        q, k, v, bias, alibi, seed = (None if x is None else x.value for x in primals)
        out, lse = fwd((q, k, v), bias, alibi, seed)
        return ((out, lse) if with_lse else out), (q, k, v, out, lse, bias, alibi, seed, BiasGrad(bias_grad))

    def backward(residuals, cotangent):
        q, k, v, out, lse, bias, alibi, seed, bias_grad = residuals
        dout = _out_cotangent(cotangent, with_lse)
        if isinstance(dout, SymbolicZero):  # nothing flows back
            return (None,) * 6
        grads = bwd[bias_grad.wanted]((dout, q, k, v, out, lse), bias, alibi, seed)
        # slopes and seed take no gradient (None: a zero cotangent)
        return (*grads[:3], grads[3] if bias_grad.wanted else None, None, None)

    attention.defvjp(forward, backward, symbolic_zeros=True)
    return attention


@functools.cache
def _varlen_attention(opts: CallOptions, with_lse: bool = False):
    """attention(q, k, v, cu_q, cu_k, alibi, seed) -> out, or (out, lse) with_lse, with None for absent
    slopes or seed."""
    def call(kind, arrays, cu_q, cu_k, alibi, seed):
        q, k, v = arrays[:3] if kind == "varlen_fwd" else arrays[1:4]
        problem = _varlen_problem(q, k, v, cu_q, cu_k, opts, alibi)
        return kernel_call(kind, problem, opts.arch, (*arrays, cu_q, cu_k, None, alibi, seed))

    @jax.custom_vjp
    def attention(q, k, v, cu_q, cu_k, alibi, seed):
        out, lse = call("varlen_fwd", (q, k, v), cu_q, cu_k, alibi, seed)
        return (out, lse) if with_lse else out

    def forward(*primals):  # symbolic_zeros: CustomVJPPrimal arguments
        q, k, v, cu_q, cu_k, alibi, seed = (None if x is None else x.value for x in primals)
        out, lse = call("varlen_fwd", (q, k, v), cu_q, cu_k, alibi, seed)
        return ((out, lse) if with_lse else out), (q, k, v, cu_q, cu_k, alibi, seed, out, lse)

    def backward(residuals, cotangent):
        q, k, v, cu_q, cu_k, alibi, seed, out, lse = residuals
        dout = _out_cotangent(cotangent, with_lse)
        if isinstance(dout, SymbolicZero):  # nothing flows back
            return (None,) * 7
        dq, dk, dv = call("varlen_bwd", (dout, q, k, v, out, lse), cu_q, cu_k, alibi, seed)
        return dq, dk, dv, None, None, None, None  # offsets, slopes and seed take no gradient

    attention.defvjp(forward, backward, symbolic_zeros=True)
    return attention


def _padded_head_dims(q, k, v, problem: AttentionProblem, options: dict):
    """((q, k, v) with their head dims zero-padded to multiples of 8, a function cutting out, or (out, lse),
    back to Dv), and `options` given the unpadded default scale. The launch programs carry no head-padding copies
    (mha_fwd's widen and narrow passes), so the padding happens here, where jax differentiates it: the
    zero columns add nothing to Q K^T, give zero output columns, and their gradients are cut off."""
    dqk, dv = problem.head_dim_qk, problem.head_dim_v
    if dqk % 8 == 0 and dv % 8 == 0:
        return (q, k, v), lambda result: result
    options["softmax_scale"] = problem.softmax_scale  # 1/sqrt(D) of the unpadded D unless given

    def widen(x):
        pad = -x.shape[-1] % 8
        return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)]) if pad else x

    def narrow(result):  # out, or (out, lse)
        return (result[0][..., :dv], result[1]) if isinstance(result, tuple) else result[..., :dv]

    return (widen(q), widen(k), widen(v)), narrow


# ------------------------------------------------------------------------------------ public API


def flash_attention(q, k, v, *, causal=False, softmax_scale=None, window=(-1, -1), causal_alignment="top_left",
                    deterministic=False, bias=None, alibi_slopes=None, dropout_rate=0.0, dropout_rng=None,
                    return_lse=False):
    """Attention with gradients, for jit, grad and vmap: q [B, Sq, Hq, D], k [B, Sk, Hk, D],
    v [B, Sk, Hk, Dv] (fp16 or bf16, on a GPU) -> out [B, Sq, Hq, Dv].

    causal=True is window (left, 0); window=(left, right) with -1 for unbounded; causal_alignment
    "top_left" (default, as mha_fwd and jax.nn.dot_product_attention) or "bottom_right" (flash-attn).
    softmax_scale defaults to 1/sqrt(D). deterministic=True asks for a bitwise repeatable backward (the
    portable kernels always give one; deterministic=False lets FMHA_RT_V3=1 run the v3 backward, which
    does not). Hq must be a multiple of Hk (GQA/MQA: K/V are never repeated).

    bias: added to the scaled scores, q's dtype, broadcast from [1|B, 1|Hq, Sq, Sk]; jax.grad gives dbias
    in the bias's shape (computed only when the bias is differentiated). alibi_slopes: float32 [Hq] or
    [B, Hq], adding -slope * |i + off - j| (no gradient); not together with a bias. dropout_rate: a
    Python float in [0, 1); with dropout_rate > 0, dropout_rng (a jax PRNG key) seeds the mask, the same
    in the forward and the backward (philox_seed_offset(dropout_rng) gives its seed and offset).

    return_lse=True returns (out, lse): lse float32 [B, Hq, Sq], the log-sum-exp of each row's scaled
    scores (-inf for a row that sees no key). lse carries no gradient: differentiating through it raises
    FmhaNotImplementedError when jax traces the backward.
    """
    options = _static_options(causal, window, causal_alignment, softmax_scale, deterministic, dropout_rate)
    bias, alibi_slopes = _array(bias), _array(alibi_slopes)
    # shape errors before platform errors
    problem = batch_problem(q, k, v, CallOptions(**options, arch=""), bias, alibi_slopes)
    key = _dropout_key(options["dropout_p"], dropout_rng)
    with_lse = _static_bool("return_lse", return_lse)
    (q, k, v), unpad = _padded_head_dims(q, k, v, problem, options)
    attention = batch_attention(CallOptions(**options, arch=gpu_arch()), with_lse)
    return unpad(attention(q, k, v, bias, alibi_slopes, None if key is None else philox_words(key)))


def flash_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, causal=False,
                           softmax_scale=None, window=(-1, -1), causal_alignment="top_left", deterministic=False,
                           bias=None, alibi_slopes=None, dropout_rate=0.0, dropout_rng=None, return_lse=False):
    """Attention over packed sequences, with gradients: q [total_q, Hq, D], k/v [total_k, Hk, D],
    cu_seqlens_q/k int32 [B + 1] jax arrays (sequence b is rows cu[b]:cu[b+1]), max_seqlen_q/k Python
    ints bounding every sequence (static under jit) -> out [total_q, Hq, Dv]. The offsets are used as
    they are: under jit they cannot be checked on the host. Masks apply per sequence; options as in
    flash_attention, with alibi_slopes [Hq] or [B, Hq] (B sequences) and dropout, but no bias (the
    kernels take none with variable-length sequences). Under vmap the calls run one after another.
    return_lse=True returns (out, lse), lse float32 [Hq, total_q], without a gradient (as flash_attention)."""
    options = _static_options(causal, window, causal_alignment, softmax_scale, deterministic, dropout_rate)
    if bias is not None:
        raise FmhaNotImplementedError("a tensor bias is not supported with variable-length sequences "
                                      "(flash_attention_varlen, as mha_varlen_fwd); ALiBi slopes are")
    seqlens = {"max_seqlen_q": _max_seqlen("max_seqlen_q", max_seqlen_q),
               "max_seqlen_k": _max_seqlen("max_seqlen_k", max_seqlen_k)}
    alibi_slopes = _array(alibi_slopes)
    problem = _varlen_problem(q, k, v, cu_seqlens_q, cu_seqlens_k, CallOptions(**options, arch="", **seqlens),
                              alibi_slopes)
    key = _dropout_key(options["dropout_p"], dropout_rng)
    with_lse = _static_bool("return_lse", return_lse)
    (q, k, v), unpad = _padded_head_dims(q, k, v, problem, options)
    attention = _varlen_attention(CallOptions(**options, arch=gpu_arch(), **seqlens), with_lse)
    return unpad(attention(q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes,
                           None if key is None else philox_words(key)))
