"""The v3 kernel family (Hopper, written in Gluon: kernels/v3/): which variants exist and which calls
they serve.

A v3 kernel takes the portable signature of its function (portable_plan.SIGNATURES), so a v3 launch is
the portable plan's launch with another variant key and grid, plus one argument the portable kernels
never need: Triton's `global_scratch`, the memory in which each program makes its TMA descriptors
(GLOBAL_SCRATCH bytes a program, which the build checks against the compiler's figure). The forward
takes it from a region of the call's scratch buffer (`fwd_scratch`).

Served: sm_90, fp16 and bf16, head dims in the 64 or 128 tile (both of them in the same one), MHA, GQA
and MQA, no mask, causal and sliding windows in either alignment, batch and varlen; not score terms or
dropout. Chosen only where the benchmark shows it faster than the portable family; until then only
where the environment asks for it (FMHA_RT_V3=1, read at import: `refresh_enabled()` re-reads it).
"""
import os

from . import portable_plan as pp

FAMILY = "v3"
ARCHS = ("sm_90",)
KERNEL_MODULES = {"fwd": "kernels.v3.fmha_fwd"}
# 128 query rows (two consumer warpgroups of 64), 128 keys a block; the default partition's 4 warps
# (the kernel's 12 in all come from its warp_specialize: a second consumer warpgroup and a loader warp).
FWD_TILE = pp.Tile(128, 128, 4, 1)
FWD_PAIRS = ((64, 64), (128, 128))
# Four 128-byte TMA descriptors (Q, K, V, O) a program.
GLOBAL_SCRATCH = {"fmha_fwd": 512}
GLOBAL_SCRATCH_ALIGN = 128
DESCRIPTOR_REGION = "tma_descriptors"


def _read_enabled() -> bool:
    return os.environ.get("FMHA_RT_V3", "") not in ("", "0")


ENABLED = _read_enabled()


def refresh_enabled() -> None:
    """Re-read FMHA_RT_V3 (for a process that sets it after importing fmha_rt)."""
    global ENABLED
    ENABLED = _read_enabled()


def fwd_key(dtype, pair):
    return f"fmha_fwd_v3_{dtype}_{pp.pair_name(*pair)}"


def variants(arch: str) -> list[dict]:
    """The v3 variants to build for `arch` (none but on sm_90), in the form of portable_plan.variants,
    with language 'gluon' and the global scratch each program needs."""
    if arch not in ARCHS:
        return []
    out = []
    for dtype in pp.DTYPES:
        for pair in FWD_PAIRS:
            constexprs = {"BLOCK_M": FWD_TILE.block_m, "BLOCK_N": FWD_TILE.block_n, "BLOCK_DQK": pair[0],
                          "BLOCK_DV": pair[1], "BIAS_KIND": pp.BIAS_NONE, "DROPOUT": False}
            traits = {"pass": "fwd", "head_dim_qk_tile": pair[0], "head_dim_v_tile": pair[1], "bias": "nobias",
                      "dropout": False, "block_m": FWD_TILE.block_m, "block_n": FWD_TILE.block_n,
                      "deterministic": True}
            variant = pp.make_variant(fwd_key(dtype, pair), "fmha_fwd", dtype, FWD_TILE, constexprs, traits,
                                      module=KERNEL_MODULES["fwd"])
            variant.update(language="gluon", global_scratch=GLOBAL_SCRATCH["fmha_fwd"],
                           global_scratch_align=GLOBAL_SCRATCH_ALIGN)
            out.append(variant)
    return out


def serves_fwd(problem, arch) -> bool:
    """Whether the v3 forward runs `problem` on `arch`."""
    return (ENABLED and arch in ARCHS and problem.dtype in pp.DTYPES and pp.head_dim_tiles(problem) in FWD_PAIRS
            and pp.problem_features(problem) == (pp.BIAS_NONE, False))


def fwd_scratch(problem) -> pp.Scratch:
    """The scratch of a forward the v3 family serves: portable_plan.fwd_scratch's padding regions, then
    one region for its programs' descriptors."""
    wanted = pp.padding_regions(problem, "fwd")
    if pp.has_work(problem):
        nbytes = GLOBAL_SCRATCH["fmha_fwd"] * _programs(problem)
        wanted.append((DESCRIPTOR_REGION, (nbytes // 4,), False, "fp32"))
    return pp.Scratch(*pp.carve(wanted))


def _programs(problem) -> int:
    blocks = -(-problem.seqlen_q // FWD_TILE.block_m)
    return blocks * problem.heads_q * problem.batch


def plan_fwd(problem, tensors) -> list:
    """The launch of a forward the v3 family serves; tensors as portable_plan.plan_fwd's, plus the
    DESCRIPTOR_REGION of fwd_scratch."""
    if not pp.has_work(problem):
        return []
    key = fwd_key(problem.dtype, pp.head_dim_tiles(problem))
    args = dict(pp.ordered(key, "fmha_fwd", pp.fwd_args(problem, tensors)),
                global_scratch=pp.Args(problem, tensors).required(DESCRIPTOR_REGION))
    return [pp.Launch(key, pp.launch_grid(-(-problem.seqlen_q // FWD_TILE.block_m), problem), args)]
