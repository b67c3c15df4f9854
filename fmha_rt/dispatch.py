"""Which kernel family runs a call: the v3 family where it serves the problem (v3_plan.serves_fwd), the
portable family everywhere else. The forward's scratch buffer follows the same choice."""
from . import portable_plan, v3_plan


def fwd_scratch(problem, arch) -> portable_plan.Scratch:
    if v3_plan.serves_fwd(problem, arch):
        return v3_plan.fwd_scratch(problem)
    return portable_plan.fwd_scratch(problem)


def plan_fwd(problem, arch, tensors) -> list:
    if v3_plan.serves_fwd(problem, arch):
        return v3_plan.plan_fwd(problem, tensors)
    return portable_plan.plan_fwd(problem, arch, tensors)
