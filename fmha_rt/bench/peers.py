"""The implementations the benchmark compares, behind one small adapter interface.

Every adapter takes a `Case` (one copy of a point's tensors, flash-attn layout [B, S, H, D], or
[total, H, D] for varlen) and returns a zero-argument closure that runs one call:

    forward(case)                  -> closure for the forward
    backward(case, deterministic)  -> closure for the backward alone; the forward it needs has run
    context()                      -> a context manager held around a point's whole measurement
    launch_info()                  -> extra JSON fields for the row (fmha_rt: kernel family, kernel)
    workspace_bytes(case, det)     -> workspace a backward needs, where the API says so, else None
    outputs(case, result)          -> what a closure returned as {"out"} or {"dq", "dk", "dv"}, flash-attn
                                      layout, for the correctness gate (correctness.py)
    user_step(case, backward)      -> one call as a user makes it, outputs allocated by the implementation:
                                      the forward, or forward and backward through autograd (host overhead)
    has_varlen                     -> whether varlen rows are run at all
    deterministic_mode             -> how a bwd_det row asks for a bitwise-repeatable backward, or None
                                      where the implementation has no such mode (its bwd_det rows are
                                      not run and say so; they are never timed with its plain backward)

How each backward is timed:
- fmha_rt: `mha_bwd` (or `mha_varlen_bwd`) on the out and lse of a forward run before timing, with
  dq, dk, dv preallocated.
- torch SDPA, FlexAttention and the flash-attn family: `torch.autograd.grad` over a graph saved by one
  forward before timing (retain_graph=True), so the timed region holds the backend's backward kernels
  plus autograd's own per-call work, as a training step pays it. Their outputs (and the gradients)
  come from torch's caching allocator, which hands back the same blocks each call.

Deterministic modes: fmha_rt and the flash-attn family take `deterministic=True`; torch SDPA's backends
run their backward under `torch.use_deterministic_algorithms(True)` (the flash backend then runs its
deterministic kernels; a backend that has none refuses, and its row holds the error); FlexAttention has
none. The correctness gate calls every bwd_det row twice and fails it unless both agree bit for bit.

`PEERS` is the table of every implementation: adding one is an adapter (or a reuse of a family below)
and one line there. Heavy imports happen only when an adapter is made, so importing this module costs
nothing and works without torch.
"""

import contextlib
import dataclasses
import functools
import importlib
import importlib.metadata
import json

from . import grid, timing

DTYPES = {"bf16": "bfloat16", "fp16": "float16"}


@dataclasses.dataclass
class Case:
    point: grid.Point
    q: object
    k: object
    v: object
    dout: object            # None for a forward point
    cu_seqlens: object      # int32 [B + 1] for a varlen point (shared by q and k), else None


def make_case(point, device, seed):
    """Fresh normal-distributed inputs for `point` on `device` (e.g. "cuda:0"), seeded."""
    import torch

    gen = torch.Generator(device=device).manual_seed(seed)
    dtype = getattr(torch, DTYPES[point.dtype])
    if point.varlen:
        lead_q = lead_k = (sum(point.seqlens),)
    else:
        lead_q, lead_k = (point.batch, point.seqlen_q), (point.batch, point.seqlen_k)

    def normal(lead, heads, dim):
        return torch.randn(*lead, heads, dim, generator=gen, device=device, dtype=dtype)

    q, k = normal(lead_q, point.heads_q, point.head_dim), normal(lead_k, point.heads_k, point.head_dim)
    v = normal(lead_k, point.heads_k, point.dv)
    dout = normal(lead_q, point.heads_q, point.dv) if point.backward else None
    cu_seqlens = None
    if point.varlen:
        offsets = [0]
        for length in point.seqlens:
            offsets.append(offsets[-1] + length)
        cu_seqlens = torch.tensor(offsets, dtype=torch.int32, device=device)
    return Case(point, q, k, v, dout, cu_seqlens)


def _stream_of(tensor):
    import torch

    return torch.cuda.current_stream(tensor.device) if tensor.is_cuda else None


def _first_if_tuple(result):
    """The attention output of a call that returns it alone or first in a tuple (out, lse, ...)."""
    return result[0] if isinstance(result, tuple) else result


def _itself(result):
    return result


@contextlib.contextmanager
def _deterministic_algorithms():
    """torch.use_deterministic_algorithms(True) (errors, not warnings, where an op has no such algorithm)
    for the block, the caller's setting restored after it."""
    import torch

    enabled, warn_only = torch.are_deterministic_algorithms_enabled(), \
        torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(enabled, warn_only=warn_only)


def _deterministically(call):
    def run():
        with _deterministic_algorithms():
            return call()
    return run


class Adapter:
    """Defaults for an implementation without varlen, deterministic mode, launch info or workspace
    query. Closures are bound with everything resolved up front (functools.partial), so the harness
    adds no per-call work of its own to the host overhead measured."""

    has_varlen = False
    deterministic_mode = None
    # what a forward call returned -> its attention output, flash-attn layout [B, S, H, D]
    output = staticmethod(_first_if_tuple)

    @property
    def has_deterministic(self):
        return self.deterministic_mode is not None

    def outputs(self, case, result):
        if case.point.backward:
            return dict(zip(("dq", "dk", "dv"), result[:3]))
        return {"out": self.output(result)}

    def user_bind(self, case, requires_grad):
        """(q, k, v leaves, dout, the user's call on them, what the call returned -> the output paired with
        dout), tensors in the layout the implementation's users hold."""
        raise NotImplementedError

    def user_step(self, case, backward):
        import torch

        leaves, dout, call, output = self.user_bind(case, requires_grad=backward)
        if not backward:
            return call
        return lambda: torch.autograd.grad(output(call()), leaves, dout)

    def context(self):
        return contextlib.nullcontext()

    def launch_info(self):
        return {}

    def workspace_bytes(self, case, deterministic):
        return None

    has_plan_cache = False

    def clear_plan_cache(self):
        """Forget what repeated calls reuse (nothing, for implementations without a plan cache)."""


class FmhaRtAdapter(Adapter):
    has_varlen = True
    deterministic_mode = "deterministic=True"
    has_plan_cache = True

    def __init__(self):
        import fmha_rt

        missing = [name for name in ("mha_fwd", "mha_bwd", "mha_varlen_fwd", "mha_varlen_bwd",
                                     "last_launch_info", "bwd_workspace_bytes") if not hasattr(fmha_rt, name)]
        if missing:
            raise ImportError(f"fmha_rt has no {', '.join(missing)}")
        self.rt = fmha_rt

    def _forward_call(self, case):
        p = case.point
        if p.varlen:
            return functools.partial(self.rt.mha_varlen_fwd, case.q, case.k, case.v, case.cu_seqlens,
                                     case.cu_seqlens, p.seqlen_q, p.seqlen_k, causal=p.causal,
                                     stream=_stream_of(case.q))
        return functools.partial(self.rt.mha_fwd, case.q, case.k, case.v, causal=p.causal,
                                 stream=_stream_of(case.q))

    def forward(self, case):
        """Timed with out and lse given: the documented [B, S, H, D] out and fp32 [B, Hq, Sq] LSE for
        dense points; for varlen, buffers shaped like one untimed call's (the API owns that layout)."""
        import torch

        call = self._forward_call(case)
        p = case.point
        if p.varlen:
            out, lse = (torch.empty_like(t) for t in call())
        else:
            out = case.q.new_empty(case.q.shape[:-1] + case.v.shape[-1:])  # [B, S, Hq, Dv]
            lse = torch.empty(p.batch, p.heads_q, p.seqlen_q, dtype=torch.float32, device=case.q.device)
        return functools.partial(call, out=out, lse=lse)

    def backward(self, case, deterministic):
        import torch

        p = case.point
        out, lse = self._forward_call(case)()
        args = (case.dout, case.q, case.k, case.v, out, lse)
        if p.varlen:
            args += (case.cu_seqlens, case.cu_seqlens, p.seqlen_q, p.seqlen_k)
        return functools.partial(self.rt.mha_varlen_bwd if p.varlen else self.rt.mha_bwd, *args,
                                 causal=p.causal, deterministic=deterministic, dq=torch.empty_like(case.q),
                                 dk=torch.empty_like(case.k), dv=torch.empty_like(case.v),
                                 stream=_stream_of(case.q))

    def clear_plan_cache(self):
        self.rt.clear_plan_cache()

    def user_bind(self, case, requires_grad):
        import fmha_rt.torch

        q, k, v = (t.detach().requires_grad_(requires_grad) for t in (case.q, case.k, case.v))
        call = functools.partial(fmha_rt.torch.flash_attn_func, q, k, v, causal=case.point.causal)
        return (q, k, v), case.dout, call, _itself

    def launch_info(self):
        info = self.rt.last_launch_info() or {}
        return {key: _jsonable(info.get(key)) for key in ("family", "kernel")}

    def workspace_bytes(self, case, deterministic):
        # The workspace query takes dense q, k, v; varlen rows leave the column empty.
        if case.point.varlen:
            return None
        return int(self.rt.bwd_workspace_bytes(case.q, case.k, case.v, causal=case.point.causal,
                                               deterministic=deterministic))


class FmhaRtV3Adapter(FmhaRtAdapter):
    """fmha_rt with the v3 family running everything it serves (fmha_rt/plan/v3.py, mode 'all', and its
    ORDERED backward for deterministic calls), beside the default in one run."""

    @contextlib.contextmanager
    def context(self):
        from fmha_rt.plan import v3

        # The plan cache does not key on the mode: plans cached under the other one go.
        was = v3.MODE, v3.ORDERED_FOR_DETERMINISTIC
        self.rt.clear_plan_cache()
        v3.MODE, v3.ORDERED_FOR_DETERMINISTIC = "all", frozenset(v3.ARCHS)
        try:
            yield
        finally:
            v3.MODE, v3.ORDERED_FOR_DETERMINISTIC = was
            self.rt.clear_plan_cache()


class AutogradAdapter(Adapter):
    """An implementation differentiated by torch autograd. Subclasses give
    bind(case, q, k, v, deterministic): a zero-argument call of the implementation on those tensors,
    any layout change done once while binding; and output(result): the output it returned, in the
    flash-attn layout of case.dout. With `deterministic_by_flag`, the implementation's deterministic mode is
    torch's global one, set around each deterministic backward call."""

    deterministic_by_flag = False

    def forward(self, case):
        return self.bind(case, case.q, case.k, case.v, False)

    def backward(self, case, deterministic):
        import torch

        q, k, v = (t.detach().requires_grad_() for t in (case.q, case.k, case.v))
        out = self.output(self.bind(case, q, k, v, deterministic)())
        grad = functools.partial(torch.autograd.grad, out, (q, k, v), case.dout, retain_graph=True)
        return _deterministically(grad) if deterministic and self.deterministic_by_flag else grad

    def user_bind(self, case, requires_grad):
        q, k, v = (t.detach().requires_grad_(requires_grad) for t in (case.q, case.k, case.v))
        return (q, k, v), case.dout, self.bind(case, q, k, v, False), self.output


def heads_second(*tensors):
    """[B, S, H, D] views as the [B, H, S, D] torch's attention functions take (no copy)."""
    return [t.transpose(1, 2) for t in tensors]


def heads_third(result):
    """A [B, H, S, D] result of torch's attention functions as the flash-attn [B, S, H, D] layout (no copy)."""
    return result.transpose(1, 2)


class SdpaAdapter(AutogradAdapter):
    output = staticmethod(heads_third)
    deterministic_mode = "torch.use_deterministic_algorithms(True)"
    deterministic_by_flag = True

    def __init__(self, backend):
        from torch.nn.attention import SDPBackend

        self.backend = getattr(SDPBackend, backend)

    def context(self):
        from torch.nn.attention import sdpa_kernel

        return sdpa_kernel(self.backend)

    def bind(self, case, q, k, v, deterministic):
        import torch.nn.functional as F

        p = case.point
        gqa = {"enable_gqa": True} if p.heads_q != p.heads_k else {}
        return functools.partial(F.scaled_dot_product_attention, *heads_second(q, k, v), is_causal=p.causal, **gqa)

    def user_bind(self, case, requires_grad):
        """SDPA's users hold [B, H, S, D] tensors: leaves in that layout, so no transpose runs per call."""
        import torch.nn.functional as F

        p = case.point
        q, k, v = (t.transpose(1, 2).contiguous().requires_grad_(requires_grad) for t in (case.q, case.k, case.v))
        dout = None if case.dout is None else case.dout.transpose(1, 2).contiguous()
        gqa = {"enable_gqa": True} if p.heads_q != p.heads_k else {}
        call = functools.partial(F.scaled_dot_product_attention, q, k, v, is_causal=p.causal, **gqa)
        return (q, k, v), dout, call, _itself


class FlexAdapter(AutogradAdapter):
    """FlexAttention compiled by torch.compile: one compile per new shape (dynamic=False), causal
    through a block mask made once per sequence length, outside the timed region."""

    output = staticmethod(heads_third)

    def __init__(self):
        import torch
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        # Every shape of the sweep is its own compile; the default limit would fall back to eager.
        for limit in ("recompile_limit", "cache_size_limit"):
            if hasattr(torch._dynamo.config, limit):
                setattr(torch._dynamo.config, limit, max(getattr(torch._dynamo.config, limit), 4096))
        self._flex = torch.compile(flex_attention, dynamic=False)
        self._create_block_mask = create_block_mask
        self._masks = {}

    def _block_mask(self, case):
        p = case.point
        key = (p.seqlen_q, p.seqlen_k, str(case.q.device))
        if key not in self._masks:
            self._masks[key] = self._create_block_mask(_causal_mask, None, None, p.seqlen_q, p.seqlen_k,
                                                       device=case.q.device)
        return self._masks[key]

    def bind(self, case, q, k, v, deterministic):
        p = case.point
        mask = self._block_mask(case) if p.causal else None
        return functools.partial(self._flex, *heads_second(q, k, v), block_mask=mask,
                                 enable_gqa=p.heads_q != p.heads_k)


def _causal_mask(batch, head, q_idx, kv_idx):
    return q_idx >= kv_idx


class FlashFamilyAdapter(AutogradAdapter):
    """flash-attn 2, FlashAttention-3 and FlashAttention-4 share one Python interface:
    flash_attn_func / flash_attn_varlen_func with causal= and deterministic=; some versions return
    (out, lse), some out alone."""

    has_varlen = True
    deterministic_mode = "deterministic=True"

    def __init__(self, module):
        mod = importlib.import_module(module)
        self.func, self.varlen_func = mod.flash_attn_func, mod.flash_attn_varlen_func

    def bind(self, case, q, k, v, deterministic):
        p = case.point
        if p.varlen:
            return functools.partial(self.varlen_func, q, k, v, cu_seqlens_q=case.cu_seqlens,
                                     cu_seqlens_k=case.cu_seqlens, max_seqlen_q=p.seqlen_q,
                                     max_seqlen_k=p.seqlen_k, causal=p.causal, deterministic=deterministic)
        return functools.partial(self.func, q, k, v, causal=p.causal, deterministic=deterministic)



@dataclasses.dataclass(frozen=True)
class PeerSpec:
    name: str
    description: str
    module: str         # importing it is the availability probe; its version is reported
    make: object        # () -> adapter


PEERS = (
    PeerSpec("fmha_rt", "fmha_rt (this package)", "fmha_rt", FmhaRtAdapter),
    PeerSpec("fmha_rt_v3", "fmha_rt with the v3 family where it serves", "fmha_rt", FmhaRtV3Adapter),
    PeerSpec("sdpa_cudnn", "torch SDPA, cuDNN backend", "torch", lambda: SdpaAdapter("CUDNN_ATTENTION")),
    PeerSpec("sdpa_flash", "torch SDPA, flash backend", "torch", lambda: SdpaAdapter("FLASH_ATTENTION")),
    PeerSpec("sdpa_efficient", "torch SDPA, memory-efficient backend", "torch",
             lambda: SdpaAdapter("EFFICIENT_ATTENTION")),
    PeerSpec("flex", "torch FlexAttention, torch.compile", "torch.nn.attention.flex_attention", FlexAdapter),
    PeerSpec("fa4", "FlashAttention-4 (flash_attn.cute)", "flash_attn.cute.interface",
             lambda: FlashFamilyAdapter("flash_attn.cute.interface")),
    PeerSpec("fa3", "FlashAttention-3 (flash_attn_interface)", "flash_attn_interface",
             lambda: FlashFamilyAdapter("flash_attn_interface")),
    PeerSpec("fa2", "flash-attn 2 (flash_attn)", "flash_attn", lambda: FlashFamilyAdapter("flash_attn")),
)
PEER_NAMES = tuple(spec.name for spec in PEERS)
SUBJECT = PEERS[0].name  # the implementation under test; the others are its peers
# fmha_rt itself under another setting: measured beside the peers, never counted as one
OWN_VARIANTS = frozenset({"fmha_rt_v3"})
PEER_BY_NAME = {spec.name: spec for spec in PEERS}


@dataclasses.dataclass
class Discovery:
    name: str
    description: str
    status: str            # "found", "not found" or "failed to load"
    version: str = None
    reason: str = None
    adapter: object = None

    def fields(self):
        mode = self.adapter.deterministic_mode if self.adapter is not None else None
        return {"description": self.description, "status": self.status, "version": self.version,
                "reason": self.reason, "deterministic_mode": mode}


def discover(names=PEER_NAMES):
    """Probe each implementation: import it and make its adapter. Never raises: a missing one is
    "not found", one that imports but breaks while loading is "failed to load", each with the reason."""
    found = {}
    for name in names:
        spec = PEER_BY_NAME[name]
        try:
            importlib.import_module(spec.module)
            adapter = spec.make()
        except ImportError as exc:
            found[name] = Discovery(name, spec.description, "not found", reason=_one_line(exc))
        except Exception as exc:  # a peer's import can fail in any way; the sweep must go on
            found[name] = Discovery(name, spec.description, "failed to load", reason=_one_line(exc))
        else:
            found[name] = Discovery(name, spec.description, "found", module_version(spec.module), adapter=adapter)
    return found


def module_version(module):
    """The __version__ of the module or of its nearest parent package that has one (flash_attn.cute
    has its own, distinct from flash_attn's), else its installed distribution's, else "unknown"."""
    parts = module.split(".")
    for depth in range(len(parts), 0, -1):
        version = getattr(importlib.import_module(".".join(parts[:depth])), "__version__", None)
        if version:
            return str(version)
    top = parts[0]
    dists = importlib.metadata.packages_distributions().get(top, [])
    versions = sorted({f"{d} {importlib.metadata.version(d)}" for d in dists})
    return ", ".join(versions) or "unknown"


def unsupported(adapter, point):
    """Why `adapter` does not run `point` (None if it does): only modes the implementation lacks."""
    if point.varlen and not adapter.has_varlen:
        return "no varlen interface"
    if point.deterministic and not adapter.has_deterministic:
        return "no deterministic mode"
    return None


def _one_line(exc):
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


def _jsonable(value):
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return str(value)
    return value


def cold_start_code(name, device_index=0):
    """Source for `python -c` that imports implementation `name`, runs one forward of the cold-start
    shape and reports when its result is on the host. The harness import is timed separately so a
    reader can see how little of the figure it is."""
    return (
        "import time, json\n"
        "t0 = time.time()\n"
        "from fmha_rt.bench import peers, timing\n"
        "t1 = time.time()\n"
        f"peers.cold_start_child({name!r}, {int(device_index)})\n"
        "print(timing.READY_MARKER + json.dumps({'ready': time.time(), 'harness_import_s': t1 - t0}),"
        " flush=True)\n"
    )


def cold_start_child(name, device_index):
    """The child side of a cold start: everything a first-time user pays before one forward returns."""
    import torch

    spec = PEER_BY_NAME[name]
    importlib.import_module(spec.module)
    adapter = spec.make()
    device = f"cuda:{device_index}"
    torch.cuda.set_device(device)
    case = make_case(small_point(grid.COLD_START_SHAPE, "fwd"), device, seed=0)
    with adapter.context():
        adapter.forward(case)()
    torch.cuda.synchronize(device)


def small_point(shape, pass_name, dtype="bf16", seqlens=None):
    """A point of one of the fixed extra shapes in grid (overhead, cold start): dense, or varlen over
    `seqlens`; causal where the shape says so."""
    if seqlens is not None:
        return grid.Point(kind="varlen", pass_name=pass_name, dtype=dtype, batch=len(seqlens),
                          heads_q=shape["heads"], heads_k=shape["heads"], seqlen_q=max(seqlens),
                          seqlen_k=max(seqlens), head_dim=shape["head_dim"], causal=shape.get("causal", False),
                          seqlens=tuple(seqlens))
    return grid.Point(kind="dense", pass_name=pass_name, dtype=dtype, batch=shape["batch"],
                      heads_q=shape["heads"], heads_k=shape["heads"], seqlen_q=shape["seqlen"],
                      seqlen_k=shape["seqlen"], head_dim=shape["head_dim"], causal=shape.get("causal", False))


def measure_cold_start(name, device_index, *, timeout_s=900):
    code = cold_start_code(name, device_index)
    return {"impl": name, **timing.spawn_until_ready(code, timeout_s=timeout_s)}
