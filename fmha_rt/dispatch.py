"""Which kernel family runs a call: the v3 family where it serves the problem (v3_plan.serves_fwd and
serves_bwd), the portable family everywhere else. The forward's scratch buffer and the backward's
workspace follow the same choice."""
from . import portable_plan, v3_plan


def fwd_scratch(problem, arch) -> portable_plan.Scratch:
    if v3_plan.serves_fwd(problem, arch):
        return v3_plan.fwd_scratch(problem)
    return portable_plan.fwd_scratch(problem)


def plan_fwd(problem, arch, tensors) -> list:
    if v3_plan.serves_fwd(problem, arch):
        return v3_plan.plan_fwd(problem, tensors)
    return portable_plan.plan_fwd(problem, arch, tensors)


def bwd_workspace(problem, arch, dq_strategy_request=None) -> portable_plan.Workspace:
    if v3_plan.serves_bwd(problem, arch, dq_strategy_request):
        return v3_plan.bwd_workspace(problem)
    return portable_plan.bwd_workspace(problem, arch, dq_strategy_request)


def plan_bwd(problem, arch, tensors, dq_strategy_request=None) -> list:
    if v3_plan.serves_bwd(problem, arch, dq_strategy_request):
        return v3_plan.plan_bwd(problem, tensors)
    return portable_plan.plan_bwd(problem, arch, tensors, dq_strategy_request)
