"""The cases of tests/gpu/test_determinism.py: each names the kernel its call is meant to run, and
tests/cpu/test_determinism_cases.py checks on the CPU that the plan still launches it there, so that a
changed default shows before a GPU run does."""
import dataclasses

import fmha_rt
from fmha_rt.plan import portable, v3


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    pass_name: str  # "fwd" or "bwd"
    b: int
    s: int
    hq: int
    hk: int
    d: int
    family: str
    kernel_prefix: str  # of one of the call's kernels: the path the case is about
    deterministic: bool = True  # the backward's option; the forward is always deterministic
    v3_everywhere: bool = False  # FMHA_RT_V3=1: the v3 family serves every call it can
    # deterministic calls take the ORDERED dQ strategy (turned on for the case in
    # portable.ORDERED_FOR_DETERMINISTIC); off, the default: two kernels, or FUSED from 4096 keys
    ordered: bool = True
    # deterministic calls the v3 family serves take its ORDERED form (v3.ORDERED_FOR_DETERMINISTIC)
    v3_ordered: bool = False
    dv: int = 0  # V's head dim where it is not d


CASES = [
    Case("portable_fwd_d64_gqa", "fwd", 2, 512, 4, 2, 64, "portable", "fmha_fwd_bf16_d64"),
    Case("v3_fwd_d128_4096_keys_default", "fwd", 1, 4096, 4, 2, 128, "v3", "fmha_fwd_v3_bf16_d128"),
    Case("v3_fwd_d64", "fwd", 1, 2048, 4, 2, 64, "v3", "fmha_fwd_v3_bf16_d64",
         v3_everywhere=True),
    Case("portable_bwd_two_kernels_gqa", "bwd", 2, 512, 4, 2, 64, "portable",
         "fmha_bwd_dkdv_bf16_d64_nobias_nodrop_deterministic", ordered=False),
    Case("portable_bwd_ordered_gqa", "bwd", 2, 512, 4, 2, 64, "portable",
         "fmha_bwd_dkdv_bf16_d64_nobias_nodrop_ordered"),
    Case("portable_bwd_ordered_d128_4096_keys", "bwd", 1, 4096, 2, 1, 128, "portable",
         "fmha_bwd_dkdv_bf16_d128_nobias_nodrop_ordered"),
    Case("portable_bwd_one_launch", "bwd", 2, 256, 4, 4, 64, "portable", "fmha_bwd_single_bf16_d64"),
    Case("portable_bwd_fused_4096_keys", "bwd", 1, 4096, 2, 1, 128, "portable", "fmha_bwd_fused_bf16_d128",
         ordered=False),
    Case("v3_bwd_d128", "bwd", 1, 1024, 4, 4, 128, "v3", "fmha_bwd_dkdv_v3_bf16_d128", deterministic=False,
         v3_everywhere=True),
    # causal GQA: programs of one query head adding dK and dV into fp32 accumulators
    Case("v3_bwd_heads_d128_gqa", "bwd", 1, 1024, 4, 2, 128, "v3", "fmha_bwd_dkdv_heads_v3_bf16_d128",
         deterministic=False, v3_everywhere=True),
    Case("v3_bwd_latent_192_128", "bwd", 1, 1024, 4, 4, 192, "v3", "fmha_bwd_dkdv_v3_bf16_d192v128",
         deterministic=False, v3_everywhere=True, dv=128),
    Case("v3_bwd_wide_d256_gqa", "bwd", 1, 1024, 4, 2, 256, "v3", "fmha_bwd_dkdv_v3_bf16_d256", deterministic=False,
         v3_everywhere=True),
    Case("v3_bwd_ordered_d128_gqa", "bwd", 2, 1024, 8, 2, 128, "v3", "fmha_bwd_dkdv_ordered_v3_bf16_d128",
         v3_ordered=True),
    Case("v3_bwd_ordered_d64_4096_keys", "bwd", 1, 4096, 4, 4, 64, "v3", "fmha_bwd_dkdv_ordered_v3_bf16_d64",
         v3_ordered=True),
    Case("v3_bwd_ordered_latent_192_128", "bwd", 2, 1024, 4, 4, 192, "v3", "fmha_bwd_dkdv_ordered_v3_bf16_d192v128",
         v3_ordered=True, dv=128),
    Case("v3_bwd_ordered_wide_d256_gqa", "bwd", 1, 1024, 4, 2, 256, "v3", "fmha_bwd_dkdv_ordered_v3_bf16_d256",
         v3_ordered=True),
]


def set_mode(monkeypatch, case):
    """The modes `case` runs under, as FMHA_RT_V3 and the ORDERED switches would set them (a case about a
    portable path keeps it wherever v3's defaults move), with the plan cache cleared."""
    if case.v3_everywhere or case.family == "portable":
        monkeypatch.setattr(v3, "MODE", "off" if case.family == "portable" else "all")
    # every arch each family's ORDERED form is built for, or none
    monkeypatch.setattr(portable, "ORDERED_FOR_DETERMINISTIC",
                        frozenset(portable.BUILT_DQ_STRATEGIES) if case.ordered else frozenset())
    monkeypatch.setattr(v3, "ORDERED_FOR_DETERMINISTIC", frozenset(v3.ARCHS) if case.v3_ordered else frozenset())
    fmha_rt.clear_plan_cache()
