"""Which kernel family runs a call: the v3 family where it serves the problem (v3.serves_fwd and
serves_bwd), the portable family everywhere else. The forward's scratch buffer and the backward's
workspace follow the same choice. Both families take the call's operands (operands.Operands) and
lay their memory out with layout.py; neither reaches into the other."""
from . import portable, v3
from .layout import Scratch, Workspace


def fwd_scratch(problem, arch) -> Scratch:
    if v3.serves_fwd(problem, arch):
        return v3.fwd_scratch(problem)
    return portable.fwd_scratch(problem)


def plan_fwd(problem, arch, operands) -> list:
    if v3.serves_fwd(problem, arch):
        return v3.plan_fwd(problem, operands)
    return portable.plan_fwd(problem, arch, operands)


def bwd_workspace(problem, arch, dq_strategy_request=None) -> Workspace:
    if v3.serves_bwd(problem, arch, dq_strategy_request):
        return v3.bwd_workspace(problem)
    return portable.bwd_workspace(problem, arch, dq_strategy_request)


def plan_bwd(problem, arch, operands, dq_strategy_request=None) -> list:
    if v3.serves_bwd(problem, arch, dq_strategy_request):
        return v3.plan_bwd(problem, operands)
    return portable.plan_bwd(problem, arch, operands, dq_strategy_request)
