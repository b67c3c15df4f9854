"""The public attention API: mha_fwd / mha_bwd, their varlen forms, and the backward launcher.

Framework-agnostic: arrays come in by DLPack (CuPy, JAX, anything with __dlpack__; torch tensors are
read from their attributes) and outputs that are not given are allocated as the same kind of array as
`q` (torch, CuPy, JAX; anything else gets a DeviceBuffer). Every argument is validated before the first
launch, so on error nothing has been written.

A call whose signature (every array's kind, shape, strides, dtype and device, every option) the plan
cache holds (plan_cache.py: a signature is recorded the second time it is seen) runs from it: its arrays
are described in one C call (describe.c: torch tensors, CuPy arrays, CUDA Array Interface arrays), only
what depends on this call's pointers is checked again, and its launches are the cached ones with its
pointers written in.
"""
from __future__ import annotations

import dataclasses

from . import call_log
from .arrays import Arg, acquire_workspace, check_overlap, check_shape, finish_outputs, framework
from .call import Call, dropout_values, operand, place_regions, prepare, resolve_outputs
from . import call_keys
from .call_keys import DEFAULT_OPTIONS, Site, merged_options
from .plan import dispatch, head_padding, portable
from .plan.args import with_work
from .plan.operands import Operands
from .plan.problem import AttentionProblem
from .replay import plan_cache
from .runtime import backend, executor, kernel_launch
from .runtime.kernel_launch import Ready
from .runtime.registry import registry
from .runtime.streams import stream_handle
from .validation import same_device


def _recorded(record, call: Call, config, launches, inputs, outputs, workspace=None, layout=None):
    """(CallPlan or None, the launches to run): when `record` (the call's array names in key order, or
    None) asks and the call can be cached, the plan's launches bound to this call's values, so that the
    recording call runs what later calls will. `config`: the call's call_log.CallConfig, which a hit logs."""
    recorded = plan_cache.record(
        runtime=backend.runtime(), registry=registry(), device=call.device, arch=call.arch,
        kind=framework(call.template), names=record, launches=launches, operands=call.operands, inputs=inputs,
        outputs=outputs, workspace=workspace, layout=layout, config=config) if record is not None else None
    if recorded is None:
        return None, launches
    plan, values = recorded
    return plan, plan_cache.BoundLaunches(plan, values.array)


def _forward(call: Call, out, lse, record):
    """Run a validated forward; returns ((out, lse), its CallPlan when `record` asks and it can be cached)."""
    p = call.problem
    arrays, outputs = resolve_outputs(call, [("out", out, p.query_shape(p.head_dim_v), call.inputs[0].dtype),
                                      ("lse", lse, p.lse_shape(), "float32")], call.inputs)
    # Head dims that are not multiples of 8 run on zero-padded copies in a scratch buffer, carved into
    # regions as the backward's workspace is (so a cached call has the replay allocate it).
    scratch = dispatch.fwd_scratch(p, call.arch)
    keep_alive, scratch_arg = acquire_workspace(call.device, call.stream, scratch.total_bytes, False, None)
    place_regions(scratch, scratch_arg, call.operands)
    padding = head_padding.for_pass(p, call.operands, "fwd")
    attention = dispatch.plan_fwd(p, call.arch, padding.operands)
    config = _config("mha_varlen_fwd" if p.varlen else "mha_fwd", call, scratch.total_bytes)
    plan, launches = _recorded(record, call, config, with_work(padding.before + attention + padding.after),
                               call.inputs, outputs, scratch_arg, scratch)
    _logged(config, executor.run(call.device, call.arch, launches, call.stream))
    del keep_alive  # the scratch is freed stream-ordered, after the launches
    return finish_outputs(call.template, tuple(arrays), call.stream), plan


def _run(site: Site, objects: tuple, opts: dict, scalars: tuple, workspace_alloc=None, cacheable=True, handle=None,
         keyed=None):
    """Run a call from the plan cache when its signature is there, else through site.planned, keeping
    the plan it recorded. `handle` (opts' stream as a handle) and `keyed` (call_keys.function_key), when
    the caller has them already."""
    runtime = backend.runtime()
    if handle is None:
        stream = opts["stream"]
        handle = 0 if stream is None else stream_handle(stream, backend=runtime.backend)
    buffers = plan_cache.thread_buffers()
    request = call_keys.key_request(site, objects, opts, scalars, handle, buffers, keyed) if cacheable else None
    imported = {}
    if request is not None:
        key, objects, names, imported = request
        try:
            plan = call_keys.PLANS.get(key, runtime, registry())
        except TypeError:  # an unhashable option value
            plan = request = None
        if plan is not None:
            if plan.philox_by_value:
                _write_philox(plan, buffers.values, opts, handle)
            outputs = plan_cache.replay(plan, objects, buffers.values, buffers.failed, handle, workspace_alloc)
            if kernel_launch.LOG_CONFIG:
                _log_hit(plan, opts)
            return outputs
    record = request is not None and call_keys.PLANS.admit(key)
    outputs, plan = site.planned(objects, scalars, opts, workspace_alloc, handle, imported, names if record else None)
    if plan is not None:
        call_keys.PLANS.put(key, plan)
    return outputs


def _config(function: str, call: Call, workspace_bytes: int = 0, dq_splits=None) -> call_log.CallConfig:
    return call_log.config(function, call.problem, call.device, call.arch, call.operands, workspace_bytes, dq_splits)


def _logged(config: call_log.CallConfig, keys):
    """`keys` (the kernels a call launched), the call's line logged first when FMHA_RT_LOG_CONFIG asks."""
    if kernel_launch.LOG_CONFIG:
        call_log.log_call(config, keys)
    return keys


def _log_hit(plan, opts: dict) -> None:
    """Log a call the plan cache serves: its recording call's configuration with this call's Philox
    values when they are given by value (they are not in the key)."""
    config = plan.config
    if plan.philox_by_value:
        config = dataclasses.replace(config, seed=(opts["seed"], opts["offset"]))
    call_log.log_call(config, plan.keys)


def _write_philox(plan, values, opts: dict, handle: int) -> None:
    """A seed and offset given by value: validated again (they are not in the key), then written in."""
    philox, _ = dropout_values(opts["dropout_p"], opts["seed"], opts["offset"], handle)
    by_name = plan_cache.CallValues(values, plan.index)
    for name, value in plan_cache.philox_values(philox.seed, philox.offset).items():
        by_name[name] = value


# ------------------------------------------------------------------------------------------ public API

def _fwd_planned(objects, scalars, opts, workspace_alloc, handle, imported, record):
    """mha_fwd validated and planned; `objects` in _FWD's order."""
    q, k, v, out, lse = objects[:5]
    call = prepare(q, k, v, varlen=False, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
                    seqstart_q=None, seqstart_k=None, deterministic=False, handle=handle, imported=imported, **opts)
    return _forward(call, out, lse, record)


def _varlen_fwd_planned(objects, scalars, opts, workspace_alloc, handle, imported, record):
    """mha_varlen_fwd validated and planned; `objects` in _VARLEN_FWD's order, `scalars` the max seqlens."""
    q, k, v, cu_seqlens_q, cu_seqlens_k, seqstart_q, seqstart_k, out, lse = objects[:9]
    max_seqlen_q, max_seqlen_k = scalars
    call = prepare(q, k, v, varlen=True, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                    max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, seqstart_q=seqstart_q,
                    seqstart_k=seqstart_k, deterministic=False, handle=handle, imported=imported, **opts)
    return _forward(call, out, lse, record)


_OFFSETS = ("cu_seqlens_q", "cu_seqlens_k", "seqstart_q", "seqstart_k")
_SCORE_TERMS = ("bias", "alibi_slopes")
_FWD = Site("mha_fwd", ("q", "k", "v", "out", "lse", *_SCORE_TERMS), _fwd_planned)
_VARLEN_FWD = Site("mha_varlen_fwd", ("q", "k", "v", *_OFFSETS, "out", "lse", *_SCORE_TERMS), _varlen_fwd_planned,
                    (3, 4, 5, 6))


def mha_fwd(q, k, v, *, return_lse=True, out=None, lse=None, **options):
    """Attention forward. q [B, Sq, Hq, D], k [B, Sk, Hk, D], v [B, Sk, Hk, Dv] (fp16 or bf16, last dim
    contiguous). Returns (out [B, Sq, Hq, Dv], lse fp32 [B, Hq, Sq]), or out alone with return_lse=False.

    Options: softmax_scale (default 1/sqrt(D)), causal, window=(left, right) (-1 unbounded),
    causal_alignment 'top_left' | 'bottom_right', mask_type (AITER/TE integers 0..3 instead of causal),
    bias [1|B, 1|Hq, Sq, Sk], alibi_slopes fp32 [Hq] or [B, Hq], dropout_p with seed (int or a device
    int64 [seed, offset]) and offset, stream (None, an int handle, or a stream object).
    """
    opts = merged_options(options)
    out_arr, lse_arr = _run(_FWD, (q, k, v, out, lse, opts["bias"], opts["alibi_slopes"]), opts, ())
    return (out_arr, lse_arr) if return_lse else out_arr


def mha_varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, seqstart_q=None,
                   seqstart_k=None, return_lse=True, out=None, lse=None, **options):
    """Variable-length forward: q [total_q, Hq, D], k/v [total_k, Hk, D], cu_seqlens int32 [B + 1] on the
    GPU (logical lengths; or NumPy integer arrays, checked on the host and copied), optional seqstart_q/k
    [B + 1] like them (physical starts in padded layouts).
    max_seqlen_q/k must bound every sequence. Returns (out [total_q, Hq, Dv], lse fp32 [Hq, total_q])."""
    opts = merged_options(options)
    objects = (q, k, v, cu_seqlens_q, cu_seqlens_k, seqstart_q, seqstart_k, out, lse, opts["bias"], opts["alibi_slopes"])
    out_arr, lse_arr = _run(_VARLEN_FWD, objects, opts, (max_seqlen_q, max_seqlen_k),
                                 cacheable=_ints(max_seqlen_q, max_seqlen_k))
    return (out_arr, lse_arr) if return_lse else out_arr


class BwdLauncher:
    """The backward of one problem: what it needs (workspace bytes, zeroing, dQ splits) is known on the
    host from the problem alone; `run` launches it.

    dq_acc_splits: the fp32 dQ accumulators the workspace holds (zeroed), from the strategy the problem
    plans, never from the device: 1 for the atomic strategy (added by atomics) and the ordered one (added in
    key-block order, deterministic), 0 where dQ is written directly in its dtype. The workspace is bounded by
    dq_acc_splits fp32 dQ ([B, Sq, Hq, ceil8(Dqk)]) + Delta and Lse2 (fp32 [B, Hq, ceil8(Sq)] each) + for
    the ordered strategy 4 * (1 + B * Hq * ceil(Sq / block_m)) bytes of counters + dS (a bias gradient) +
    the v3 family's TMA descriptors + the head-dim padding copies, each region rounded up to 256 bytes."""

    def __init__(self, problem: AttentionProblem, arch: str):
        self.problem, self.arch = problem, arch
        self.workspace = dispatch.bwd_workspace(problem, arch)

    @property
    def workspace_size(self) -> int:
        return self.workspace.total_bytes

    @property
    def needs_zero_init(self) -> bool:
        return self.workspace.needs_zeroing

    @property
    def dq_acc_splits(self) -> int:
        return self.workspace.dq_splits

    def prepare_workspace(self, buf: Arg, operands: Operands) -> None:
        """Carve the workspace regions out of `buf` into the regions of the call's operands."""
        place_regions(self.workspace, buf, operands)

    def plan(self, operands: Operands) -> list:
        """The launches of this backward on `operands` (arrays and workspace regions), with the copies
        into and out of zero-padded workspace buffers for head dims that are not multiples of 8."""
        padding = head_padding.for_pass(self.problem, operands, "bwd")
        attention = dispatch.plan_bwd(self.problem, self.arch, padding.operands)
        return with_work(padding.before + attention + padding.after)

    def run(self, device: int, operands: Operands, stream: int, launches=None) -> list[str]:
        """Plan (unless `launches` are planned already), check and pack every launch; only then zero the
        regions that must start at zero (so a refused call writes no memory at all) and launch. Returns
        the variant keys launched."""
        keys = self.launch(device, operands, stream, launches)
        if kernel_launch.LOG_CONFIG:
            call_log.log_call(call_log.config("BwdLauncher.run", self.problem, device, self.arch, operands,
                                              self.workspace_size, self.dq_acc_splits), keys)
        return keys

    def launch(self, device: int, operands: Operands, stream: int, launches=None) -> list[str]:
        """`run` without logging the call (for a caller that logs it as its own)."""
        launches = self.plan(operands) if launches is None else launches

        def zero_regions():
            for region in self.workspace.regions:
                if region.zero_init:
                    backend.memset(device, operands.regions[region.name].address, 0, region.nbytes, stream)

        # a cached plan's launches zero the regions themselves, after their own checks
        ready = isinstance(launches, Ready)
        return list(executor.run(device, self.arch, launches, stream, before_launch=None if ready else zero_regions))


def _backward(call: Call, dout, out, lse, dq, dk, dv, dbias, workspace_alloc, record):
    """Run a validated backward; returns ((dq, dk, dv[, dbias]), its CallPlan when `record` asks)."""
    p = call.problem
    dtype = call.inputs[0].dtype
    do_arg = call.array("dout", dout, dtypes=(dtype,))
    check_shape(do_arg, p.query_shape(p.head_dim_v))
    o_arg = call.array("out", out, dtypes=(dtype,))
    check_shape(o_arg, p.query_shape(p.head_dim_v))
    l_arg = call.array("lse", lse, dtypes=("float32",))
    check_shape(l_arg, p.lse_shape())
    same_device(call.inputs + [do_arg, o_arg, l_arg])
    o = call.operands
    o.dout, o.out, o.lse = operand("dout", do_arg), operand("out", o_arg), operand("lse", l_arg)
    inputs = call.inputs + [do_arg, o_arg, l_arg]
    specs = [("dq", dq, p.query_shape(p.head_dim_qk), dtype), ("dk", dk, p.key_shape(p.head_dim_qk), dtype),
             ("dv", dv, p.key_shape(p.head_dim_v), dtype)]
    if p.bias_grad:
        bias_arg = next(a for a in call.inputs if a.name == "bias")
        specs.append(("dbias", dbias, tuple(bias_arg.shape), dtype))
    arrays, outputs = resolve_outputs(call, specs, inputs)
    launcher = BwdLauncher(p, call.arch)
    keep_alive, ws_arg = acquire_workspace(call.device, call.stream, launcher.workspace_size, launcher.needs_zero_init,
                                           workspace_alloc)
    if ws_arg is not None:
        check_overlap([ws_arg], inputs + [o[0] for o in outputs])
    launcher.prepare_workspace(ws_arg, call.operands)
    config = _config("mha_varlen_bwd" if p.varlen else "mha_bwd", call, launcher.workspace_size,
                     launcher.dq_acc_splits)
    plan, launches = _recorded(record, call, config, launcher.plan(call.operands), inputs, outputs, ws_arg,
                               launcher.workspace)
    _logged(config, launcher.launch(call.device, call.operands, call.stream, launches))
    del keep_alive  # a workspace we allocated is freed stream-ordered, after the launches
    return finish_outputs(call.template, tuple(arrays), call.stream), plan


def _run_backward(site, arrays, opts, scalars, workspace_alloc, cacheable):
    """_run for a backward: its key adds whether a workspace_alloc is given."""
    return _run(site, (*arrays, opts["bias"], opts["alibi_slopes"]), opts, (*scalars, workspace_alloc is None),
                     workspace_alloc, cacheable)


def _ints(*values) -> bool:
    """Whether scalars that validation takes as ints are keyable: of type int exactly (True == 1 and
    1.0 == 1 would key alike; an int subclass is just validated every time)."""
    return all(type(value) is int for value in values)


def _bwd_planned(objects, scalars, opts, workspace_alloc, handle, imported, record):
    """mha_bwd validated and planned; `objects` in _BWD's order, `scalars` (deterministic, ...)."""
    dout, q, k, v, out, lse, dq, dk, dv, dbias = objects[:10]
    call = prepare(q, k, v, varlen=False, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
                    seqstart_q=None, seqstart_k=None, deterministic=scalars[0], bias_grad=True, handle=handle,
                    imported=imported, **opts)
    return _backward(call, dout, out, lse, dq, dk, dv, dbias, workspace_alloc, record)


def _varlen_bwd_planned(objects, scalars, opts, workspace_alloc, handle, imported, record):
    """mha_varlen_bwd validated and planned; `objects` in _VARLEN_BWD's order, `scalars` (deterministic,
    max_seqlen_q, max_seqlen_k, ...)."""
    dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqstart_q, seqstart_k, dq, dk, dv = objects[:13]
    deterministic, max_seqlen_q, max_seqlen_k = scalars[:3]
    call = prepare(q, k, v, varlen=True, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                    max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, seqstart_q=seqstart_q,
                    seqstart_k=seqstart_k, deterministic=deterministic, handle=handle, imported=imported, **opts)
    return _backward(call, dout, out, lse, dq, dk, dv, None, workspace_alloc, record)


_BWD = Site("mha_bwd", ("dout", "q", "k", "v", "out", "lse", "dq", "dk", "dv", "dbias", *_SCORE_TERMS), _bwd_planned)
_VARLEN_BWD = Site("mha_varlen_bwd", ("dout", "q", "k", "v", "out", "lse", *_OFFSETS, "dq", "dk", "dv", *_SCORE_TERMS),
                    _varlen_bwd_planned, (6, 7, 8, 9))


def mha_bwd(dout, q, k, v, out, lse, *, deterministic=False, dq=None, dk=None, dv=None, dbias=None,
            workspace_alloc=None, **options):
    """Attention backward: (dq, dk, dv), plus dbias (in the bias's shape) when a bias is given.

    Takes the forward's options (the same mask, bias, dropout seed/offset). deterministic=True gives
    bitwise-identical results across runs, streams and thread counts. workspace_alloc(nbytes, zero_init)
    may supply the scratch memory (an array or fmha_rt.Pointer, possibly uninitialised): fmha_rt zeroes
    the parts that must start at zero on the call's stream, which zero_init announces.
    """
    # deterministic keys as a bool: validation refuses anything else
    return _run_backward(_BWD, (dout, q, k, v, out, lse, dq, dk, dv, dbias), merged_options(options), (deterministic,),
                              workspace_alloc, type(deterministic) is bool)


def mha_varlen_bwd(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                   seqstart_q=None, seqstart_k=None, deterministic=False, dq=None, dk=None, dv=None,
                   workspace_alloc=None, **options):
    """Variable-length backward: arrays as in mha_varlen_fwd; returns (dq, dk, dv)."""
    arrays = (dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqstart_q, seqstart_k, dq, dk, dv)
    return _run_backward(_VARLEN_BWD, arrays, merged_options(options), (deterministic, max_seqlen_q, max_seqlen_k),
                              workspace_alloc, type(deterministic) is bool and _ints(max_seqlen_q, max_seqlen_k))


class Bound:
    """One of the public functions with its scalars and options fixed (bind), for an adapter that makes
    many calls with the same ones (fmha_rt.torch): the keyword handling and the plan-cache key's part
    that the function, its scalars and its options make (call_keys.function_key) are done once, here.
    A call runs exactly what the public function runs on the same arguments."""

    __slots__ = ("site", "scalars", "opts", "keyed")

    def __init__(self, site: Site, scalars: tuple, options: dict, cacheable: bool):
        self.site, self.scalars, self.opts = site, scalars, merged_options(options)
        # None: every call is validated and planned (as the public function leaves such calls uncached)
        self.keyed = call_keys.function_key(site, self.opts, scalars) if cacheable else None

    def __call__(self, arrays: tuple, handle: int, alibi_slopes=None, seed=None, workspace_alloc=None):
        """The outputs of the call on `arrays` (the function's arrays in its signature's order, outputs
        included, None for one to allocate) on the stream `handle`; alibi_slopes and seed (a device
        array: with dropout, a seed by value leaves the call uncached) are the call's own options."""
        opts = self.opts
        if alibi_slopes is not None or seed is not None:
            opts = {**opts, "alibi_slopes": alibi_slopes, "seed": seed}
        return _run(self.site, (*arrays, opts["bias"], alibi_slopes), opts, self.scalars, workspace_alloc,
                    self.keyed is not None, handle, self.keyed)


_BINDABLE = {site.name: site for site in (_FWD, _VARLEN_FWD, _BWD, _VARLEN_BWD)}


def bind(function: str, *, max_seqlen_q=None, max_seqlen_k=None, deterministic=False, workspace_alloc=False,
         **options) -> Bound:
    """`function` ("mha_fwd", "mha_varlen_fwd", "mha_bwd" or "mha_varlen_bwd") with its scalars (varlen:
    max_seqlen_q/k; backward: deterministic, and whether its calls give a workspace_alloc) and its
    options other than stream, alibi_slopes and seed fixed; see Bound."""
    site = _BINDABLE[function]
    seqlens = (max_seqlen_q, max_seqlen_k) if site.offsets else ()
    if site in (_BWD, _VARLEN_BWD):  # the scalars as _run_backward keys them
        return Bound(site, (deterministic, *seqlens, not workspace_alloc), options,
                     type(deterministic) is bool and _ints(*seqlens))
    return Bound(site, seqlens, options, _ints(*seqlens))


def bwd_workspace_bytes(q, k, v, *, deterministic=False, **options) -> int:
    """Workspace bytes mha_bwd would request for these inputs (nothing is launched)."""
    return _workspace_bytes(q, k, v, deterministic, options, varlen=False)


def varlen_bwd_workspace_bytes(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, seqstart_q=None,
                               seqstart_k=None, deterministic=False, **options) -> int:
    """Workspace bytes mha_varlen_bwd would request for these inputs, arrays as it takes them (nothing is
    launched)."""
    return _workspace_bytes(q, k, v, deterministic, options, varlen=True, cu_seqlens_q=cu_seqlens_q,
                            cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                            seqstart_q=seqstart_q, seqstart_k=seqstart_k)


def _workspace_bytes(q, k, v, deterministic, options, *, varlen, cu_seqlens_q=None, cu_seqlens_k=None,
                     max_seqlen_q=None, max_seqlen_k=None, seqstart_q=None, seqstart_k=None) -> int:
    call = prepare(q, k, v, varlen=varlen, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                   max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, seqstart_q=seqstart_q, seqstart_k=seqstart_k,
                   deterministic=deterministic, bias_grad=True, **merged_options(options))
    return BwdLauncher(call.problem, call.arch).workspace_size


def release_workspaces() -> None:
    """Free what fmha_rt keeps per stream: the workspaces of backwards without a workspace_alloc (each
    on its own stream, after the work queued there, so its streams must still exist; the next such
    call on a stream allocates anew) and the launch graphs of cached calls (made again on next use).
    Call it before destroying a stream such calls ran on: a later stream may get the same handle, and
    its calls would take the buffer without waiting for the old stream's."""
    backend.check(backend.lib.fmha_workspaces_release(), "fmha_workspaces_release")
    backend.check(backend.lib.fmha_launch_graphs_release(), "fmha_launch_graphs_release")


def mha_dropout_mask(q, k, *, dropout_p, seed, offset=0, stream=None, out=None):
    """The dropout keep mask (uint8 [B, Hq, Sq, Sk], 1 = kept) that mha_fwd/mha_bwd use for these
    shapes, seed and offset: for tests and debugging (never cached)."""
    rt = backend.runtime()
    handle = stream_handle(stream, backend=rt.backend)
    call = prepare(q, k, k, varlen=False, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
                    seqstart_q=None, seqstart_k=None, deterministic=False,
                    **{**DEFAULT_OPTIONS, "dropout_p": dropout_p, "seed": seed, "offset": offset, "stream": stream})
    p = call.problem
    (mask_arr,), _ = resolve_outputs(call, [("mask", out, (p.batch, p.heads_q, p.seqlen_q, p.seqlen_k), "uint8")],
                              call.inputs)
    keys = executor.run(call.device, call.arch, with_work(portable.plan_dropout_mask(p, call.arch, call.operands)), handle)
    _logged(_config("mha_dropout_mask", call), keys)
    return finish_outputs(call.template, (mask_arr,), handle)[0]
