"""Runs portable-plan launches under the Triton interpreter with torch CPU tensors.

The interpreter has to be chosen before Triton is first imported, and a process that has imported
Triton for ahead-of-time compilation (other tests do) cannot interpret. So the kernels run in a child
process, started once with TRITON_INTERPRET=1; tensors travel through torch's shared-memory pickling,
so what a kernel writes in the child lands in the caller's tensors. Sending a tensor the first time moves
its storage into shared memory: NumPy views taken before that point at freed memory, so take them after.
"""
import atexit
import importlib
import os
import queue
import traceback

import torch
import torch.multiprocessing

from fmha_rt.plan import portable as pp
from fmha_rt.plan import head_padding
from fmha_rt.plan.operands import Operands, Philox

TORCH_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32, "i32": torch.int32}
_POINTER_DTYPES = {"*fp16": torch.float16, "*bf16": torch.bfloat16, "*fp32": torch.float32, "*i32": torch.int32,
                   "*i64": torch.int64, "*u8": torch.uint8}
_RUN_TIMEOUT_S = 600


def _null(kind):
    """Stands in for a null pointer: a one-element array the kernel never touches."""
    return torch.zeros(1, dtype=_POINTER_DTYPES[kind])


def _execute(launches, arch):
    """Runs each launch as variant.function[grid](**args, **constexprs) (in the interpreting child)."""
    variants = pp.variant_map(arch)
    for launch in launches:
        variant = variants[launch.variant]
        kernel = getattr(importlib.import_module(variant["module"]), variant["function"])
        args = {name: _null(variant["signature"][name]) if value is None else value
                for name, value in launch.args.items()}
        kernel[launch.grid](**args, **variant["constexprs"])


def _serve(requests, replies):
    os.environ["TRITON_INTERPRET"] = "1"
    while (job := requests.get()) is not None:
        try:
            _execute(*job)
            replies.put(None)
        except BaseException:  # the caller re-raises it, with the child's traceback
            replies.put(traceback.format_exc())


class _Interpreter:
    """The child process and its two queues."""

    def __init__(self):
        context = torch.multiprocessing.get_context("spawn")
        self.requests, self.replies = context.Queue(), context.Queue()
        self.process = context.Process(target=_serve, args=(self.requests, self.replies), daemon=True)
        self.process.start()
        atexit.register(self.close)

    def run(self, launches, arch):
        self.requests.put((launches, arch))
        for _ in range(_RUN_TIMEOUT_S):
            try:
                failure = self.replies.get(timeout=1)
                break
            except queue.Empty:
                if not self.process.is_alive():
                    raise RuntimeError(f"interpreter process died (exit code {self.process.exitcode})") from None
        else:
            raise TimeoutError(f"interpreted launches took over {_RUN_TIMEOUT_S} s")
        if failure is not None:
            raise RuntimeError(f"kernel failed under the interpreter:\n{failure}")

    def close(self):
        if self.process.is_alive():
            self.requests.put(None)
            self.process.join(timeout=10)


_interpreter = None


def run(launches, arch=pp.INTERPRET_ARCH):
    """Runs the launches (in order) under the interpreter; outputs are written into the callers' tensors."""
    global _interpreter
    if _interpreter is None or not _interpreter.process.is_alive():
        _interpreter = _Interpreter()
    _interpreter.run(list(launches), arch)


def operands_of(**arrays) -> Operands:
    """The Operands that plan_* take, of tensors by name (Operands.of_arrays); philox_seed and
    philox_offset (ints) or philox_seed_offset (a tensor) are the Philox values."""
    seed, offset = arrays.pop("philox_seed", None), arrays.pop("philox_offset", 0)
    pointer = arrays.pop("philox_seed_offset", None)
    operands = Operands.of_arrays(arrays)
    if seed is not None or pointer is not None:
        operands.philox = Philox(seed=seed, offset=offset, pointer=pointer)
    return operands


def poisoned(shape, dtype):
    return torch.full(shape, float("nan"), dtype=dtype)


def scratch_tensors(scratch):
    """One buffer carved into the regions of a Scratch or Workspace, each a view in its dtype and
    shape: zero_init regions zeroed, the rest NaN."""
    buffer = torch.empty(max(scratch.total_bytes, 4), dtype=torch.uint8)
    views = {}
    for region in scratch.regions:
        view = buffer[region.offset: region.offset + region.nbytes].view(TORCH_DTYPES[region.dtype]).view(region.shape)
        views[region.name] = view.zero_() if region.zero_init else view.fill_(float("nan"))
    return views


def output_shapes(problem):
    """Shapes of out and lse (batched [B, Sq, Hq, Dv] / [B, Hq, Sq]; varlen [T, Hq, Dv] / [Hq, T])."""
    dv = problem.head_dim_v
    if problem.varlen:
        return (problem.total_q, problem.heads_q, dv), (problem.heads_q, problem.total_q)
    return (problem.batch, problem.seqlen_q, problem.heads_q, dv), (problem.batch, problem.heads_q, problem.seqlen_q)


def run_padded(plan, problem, operands, pass_name, arch=pp.INTERPRET_ARCH):
    """Runs plan(operands with padded buffers in place) between the head-dim padding copies, as the API
    does (the operands' regions hold the '<name>_padded' regions of the pass's scratch)."""
    before, after, padded = head_padding.for_pass(problem, operands, pass_name)
    run(before + plan(padded) + after, arch)


def forward(problem, inputs, arch=pp.INTERPRET_ARCH, out=None):
    """inputs: q, k, v and optional bias, alibi, cu_seqlens_q/k, seqstart_q/k, philox_* entries.
    Returns (out, lse), allocated poisoned with NaN before the run (or `out` as given)."""
    out_shape, lse_shape = output_shapes(problem)
    out = poisoned(out_shape, inputs["q"].dtype) if out is None else out
    lse = poisoned(lse_shape, torch.float32)
    operands = operands_of(**inputs, out=out, lse=lse, **scratch_tensors(pp.fwd_scratch(problem)))
    run_padded(lambda o: pp.plan_fwd(problem, arch, o), problem, operands, "fwd", arch)
    return out, lse


def backward(problem, inputs, out, lse, dout, arch=pp.INTERPRET_ARCH, dq_strategy=None, grads=None, workspace=None):
    """Returns (dq, dk, dv, dbias or None), outputs poisoned with NaN before the run (or `grads` as given).
    `workspace`, a dict when given, receives the workspace regions' views as the kernels left them."""
    q, k, v = inputs["q"], inputs["k"], inputs["v"]
    if grads is None:
        grads = {"dq": poisoned(q.shape, q.dtype), "dk": poisoned(k.shape, k.dtype), "dv": poisoned(v.shape, v.dtype)}
    if problem.bias_grad:
        grads["dbias"] = poisoned(inputs["bias"].shape, inputs["bias"].dtype)
    regions = scratch_tensors(pp.bwd_workspace(problem, arch, dq_strategy))
    if workspace is not None:
        workspace.update(regions)
    operands = operands_of(**inputs, **grads, out=out, lse=lse, dout=dout, **regions)
    run_padded(lambda o: pp.plan_bwd(problem, arch, o, dq_strategy), problem, operands, "bwd", arch)
    return grads["dq"], grads["dk"], grads["dv"], grads.get("dbias")


def dropout_mask(problem, philox, arch=pp.INTERPRET_ARCH):
    """The keep mask (bool [B, Hq, Sq, Sk]) the kernels draw for `philox` (seed/offset entries)."""
    mask = torch.full((problem.batch, problem.heads_q, problem.seqlen_q, problem.seqlen_k), 7, dtype=torch.uint8)
    run(pp.plan_dropout_mask(problem, arch, operands_of(mask=mask, **philox)), arch)
    assert int(mask.max()) <= 1, "dropout mask not fully written"
    return mask.bool()
