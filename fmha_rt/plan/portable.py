"""The portable (Triton) kernel family: which variants exist, and how one attention call maps onto them.

Pure Python: importable without Triton, a GPU or NumPy. Two consumers:
- the AOT build (`variants(arch)`): every variant to compile, with its Triton signature, constexprs,
  launch options and traits (abi.make_variant);
- the runtime (`plan_fwd`, `plan_bwd`, `plan_dropout_mask`, `bwd_workspace`, `fwd_scratch`): the ordered
  launches of one call, each a variant key, a grid and the value of every runtime argument.

Every head dim up to 256 runs here, in power-of-two tiles (32, 64, 128, 256: Triton block shapes are
powers of two, so 96 runs in the 128 tile and 192 in the 256 tile), with (256, 128) for the (192, 128)
query/value pair. A head dim that is not a multiple of 8 runs at layout.padded_head_dim(d) on copies
that head_padding.py plans around these launches.
"""

from fmha_rt.errors import FmhaNotImplementedError, FmhaValueError

from . import backward, head_padding, layout
from .abi import (BIAS_ALIBI, BIAS_KIND_NAMES, BIAS_NONE, BIAS_TENSOR, DQ_ATOMIC, DQ_DETERMINISTIC, DQ_FUSED, DQ_ORDERED,
                  DQ_SINGLE,
                  DTYPES, HEAD_DIM_PAIRS, HEAD_DIM_TILES, Tile, dq_convert_variant, head_dim_tiles, make_variant,
                  ordered, pair_name, preprocess_variant, problem_features)
from .args import Args, Launch, cdiv, dropout_threshold, forward_launch, has_work, launch_grid
from .layout import Workspace

BUILD_ARCHS = ("sm_90", "gfx942", "gfx950")
# Not a build target: small tiles that give many blocks on tiny problems under TRITON_INTERPRET=1.
INTERPRET_ARCH = "interpret"

# -------------------------------------------------------------------------------------- tile configs


def _tiles(small, large, wide_v):
    """Per head-dim pair: `small` for tiles up to 64, `large` for 128, `wide_v` for 256-wide pairs."""
    return {(32, 32): small, (64, 64): small, (128, 128): large, (256, 256): wide_v, (256, 128): wide_v}


# fwd: one program per query block; dkdv: one per key block (block_n keys, block_m query rows per step);
# dq: one per query block.
TILES = {
    # sm_90: the fastest of bench/tune_tiles.py's candidates on an H200, causal and not, S=4k
    # (bench/results/h200_tile_search_v2_s4k.json, NOTES.md).
    "sm_90": {
        "fwd": _tiles(Tile(128, 64, 8, 3), Tile(128, 128, 8, 3), Tile(128, 64, 8, 2)),
        "bwd_dkdv": _tiles(Tile(32, 128, 4, 3), Tile(32, 64, 4, 3), Tile(64, 64, 8, 1)),
        "bwd_dq": _tiles(Tile(64, 64, 4, 3), Tile(128, 64, 8, 3), Tile(128, 64, 8, 1)),
    },
    # gfx942/gfx950 (not measured on hardware): tiles that fit 64 KiB of LDS and compile without
    # scratch spills in every feature variant (16-row dkdv steps at 128 and 256 wide).
    "gfx942": {
        "fwd": _tiles(Tile(128, 64, 4, 2), Tile(128, 64, 4, 2), Tile(64, 64, 4, 1)),
        "bwd_dkdv": _tiles(Tile(32, 128, 4, 1), Tile(16, 128, 4, 1), Tile(16, 64, 4, 1)),
        "bwd_dq": _tiles(Tile(128, 32, 4, 1), Tile(128, 32, 4, 1), Tile(64, 32, 4, 1)),
    },
    INTERPRET_ARCH: {
        "fwd": _tiles(*[Tile(16, 16, 4, 1)] * 3),
        "bwd_dkdv": _tiles(*[Tile(16, 32, 4, 1)] * 3),
        "bwd_dq": _tiles(*[Tile(32, 16, 4, 1)] * 3),
    },
}
TILES["gfx950"] = TILES["gfx942"]
# Head-dim pairs whose dK/dV kernel runs its (query head, query block) steps as one flat loop with a
# runtime mask branch instead of the nest of a loop per head, mask-free and masked blocks. H200, bf16,
# S=4k: the flat loop runs 256-wide dK/dV at 204 TFLOP/s against the nest's best 149 (the nest spills
# its 256-wide fp32 accumulators), and loses where the nest fits the registers: 226 vs 285 at 64 wide,
# 295 vs 318 at 128 wide (nest: bench/results/h200_tile_search_v2_s4k.json, flat: ..._v3.json).
DKDV_FLAT_LOOP = {"sm_90": ((256, 256), (256, 128)), INTERPRET_ARCH: ((256, 256), (256, 128))}
# Head-dim pairs whose two-kernel dK/dV objects without bias or dropout issue dO V^T before the
# exponentials (DP_FIRST, as the fused grid's dK/dV programs do; NOTES.md v12). On sm_90 it adds reloads
# (D=128 32x64: 0 -> 5 per step) and still wins, the tensor cores busy while the MUFU runs: H200, bf16,
# +0.4..4% at D=64/128 1k/4k, +4% at D=128 1k GQA (bench/results/h200_v12/ab_bwd_dp_all.json).
DKDV_DP_FIRST = {"sm_90": ((64, 64), (128, 128)), INTERPRET_ARCH: ((64, 64), (128, 128))}
# Archs that also build, for the nested dK/dV kernels, a variant for one query head per key head
# (Hq == Hk, key suffix "_mha"): without the loop over a group's query heads around the two inner loops
# the kernel spills less and runs 7-17% faster (H200, bf16, D=128, the shipped tile:
# bench/results/h200_tile_search_v5_dkdv_mha.json). GQA/MQA problems take the variant with the loop.
DKDV_SINGLE_HEAD = frozenset({"sm_90", INTERPRET_ARCH})
# Memory-bound helper passes: one configuration everywhere.
DBIAS_TILE = Tile(32, 64, 4, 1)
MASK_TILE = Tile(32, 64, 4, 1)
# Which dQ strategy a non-deterministic problem gets on each arch, and which strategies are built.
# On the H200 the deterministic dQ kernel was never slower than fp32 atomics (NOTES.md: 301 vs 294
# TFLOP/s dense, 224 vs 188 GQA causal at S=4k, D=128), so the shipped archs build no atomic dK/dV; the
# atomic path stays for the interpreter tests and for archs where it measures faster. Every arch builds
# the ORDERED strategy's persistent dK/dV pass (with the pre-pass and the conversion it shares with ATOMIC).
DEFAULT_DQ_STRATEGY = {"sm_90": DQ_DETERMINISTIC, "gfx942": DQ_DETERMINISTIC, "gfx950": DQ_DETERMINISTIC,
                       INTERPRET_ARCH: DQ_ATOMIC}
BUILT_DQ_STRATEGIES = {"sm_90": (DQ_DETERMINISTIC, DQ_ORDERED), "gfx942": (DQ_DETERMINISTIC, DQ_ORDERED),
                       "gfx950": (DQ_DETERMINISTIC, DQ_ORDERED), INTERPRET_ARCH: (DQ_ATOMIC, DQ_DETERMINISTIC, DQ_ORDERED)}
# The switch for deterministic calls: on these archs they take the ORDERED strategy (5 block products per
# (query block, key block) pair, dQ added in key-block order) wherever the one-launch backward (SINGLE) does
# not serve them; elsewhere, or with the strategy requested by name, FUSED or DETERMINISTIC (7 block
# products, dQ recomputed by programs of its own) as before. Only the interpreter takes it by default until
# it has run on a GPU: its tests there (tests/gpu/test_ordered_dq.py, which turn it on) and an A/B against
# FUSED and DETERMINISTIC decide which GPU archs join (NOTES.md, the ORDERED strategy).
ORDERED_FOR_DETERMINISTIC = frozenset({INTERPRET_ARCH})
# Persistent programs of the ORDERED dK/dV pass, unless FMHA_RT_BWD_PROGRAMS forces a number: the
# multiprocessors of the arch's parts (H100 SXM and H200: 132; MI300X: 304; MI355X: 256), two programs each
# on sm_90, where two of the dK/dV tile's programs fit one (128 threads, at most 83 KB of shared memory at
# head dims up to 128). Never more than the work items. Programs take items by ticket, so any number gives
# the same bits and makes progress (kernels/portable/dq_order.py); too many only wait for a slot and find
# the items taken.
ORDERED_PROGRAMS = {"sm_90": 2 * 132, "gfx942": 304, "gfx950": 256, INTERPRET_ARCH: 1}
BWD_PROGRAMS_ENV = backward.BWD_PROGRAMS_ENV


# The FUSED strategy (fmha_bwd_fused after the Delta/Lse2 pre-pass): (dK/dV tile, dQ tile) per head-dim
# pair where it is built; both tiles take one warp count and stage count (the first tile's). Like the
# two-kernel strategy it has no atomics, so it is deterministic. On the archs of MEASURED_ONLY it is
# built and chosen only where it measured faster than the two-kernel backward: on sm_90 D=128 without
# bias or dropout, from FUSED_MIN_SEQLEN_K keys (pass alone, bench/results/h200_tile_search_v8_fused.json:
# +4% at S=4k and 16k without a mask, +2% at 16k causal, even at 4k causal, -6% at 1k causal; D=64
# 10-25% slower). GQA/MQA too since its key-block programs come first in the grid (whole backward, GQA
# 16/2, bench/results/h200_v10_gqa_fused_ab.json: +5% at 4k, +14% at 4k causal, +1% at 16k; in grid
# order, v8, 4-12% slower). The interpreter builds it for every feature and head count, for the tests
# against the two-kernel strategy.
FUSED_TILES = {
    "sm_90": {(128, 128): (Tile(64, 128, 8, 3), Tile(128, 64, 8, 3))},
    INTERPRET_ARCH: {pair: (Tile(16, 32, 4, 1), Tile(32, 16, 4, 1)) for pair in ((32, 32), (64, 64), (128, 128))},
}
# Archs where FUSED and SINGLE are built only for the problems where they measured faster.
MEASURED_ONLY = {"sm_90"}
FUSED_MIN_SEQLEN_K = 4096


# The SINGLE strategy: the whole backward as one launch of fmha_bwd_fused with DELTA_INLINE (every
# program computes Delta and Lse2 of the rows it visits; the dK/dV programs load O once more per step).
# For problems too small to fill the GPU, where a call's cost is the host's and a second launch is ~4 µs
# of it: up to SINGLE_MAX_SCORES score elements (B * Hq * Sq * Sk), no bias or dropout, head dims up to
# 128. Tiles: the two-kernel strategy's where both passes take one warp count, else FUSED's. The limit
# is the largest measured point where it was faster (bench/results/h200_single_launch_crossover.json,
# GPU time per call: 0.83-0.95x the two-kernel backward up to 2^20 scores, 1.01-1.24x at 2^22). On the
# archs of MEASURED_ONLY, one query head per key head only: with GQA/MQA each dK/dV program loops over
# the group's heads at the wider tile, and the one launch took 1.2-1.9x the GPU time of the two-kernel
# backward (bench/results/h200_single_launch_gqa.json), far more than the launch it saves.
SINGLE_TILES = {
    "sm_90": {(32, 32): (Tile(32, 128, 4, 3), Tile(64, 64, 4, 3)), (64, 64): (Tile(32, 128, 4, 3), Tile(64, 64, 4, 3)),
              (128, 128): (Tile(64, 128, 8, 3), Tile(128, 64, 8, 3))},
    INTERPRET_ARCH: {pair: (Tile(16, 32, 4, 1), Tile(32, 16, 4, 1)) for pair in ((32, 32), (64, 64), (128, 128))},
}
SINGLE_MAX_SCORES = 1 << 20


def single_built(arch, pair, bias_kind, dropout, single_head) -> bool:
    """Whether `arch` has the SINGLE strategy's kernel for this head-dim pair, these features and this
    dK/dV form (single_head: one query head per key head)."""
    if pair not in SINGLE_TILES.get(arch, {}) or bias_kind != BIAS_NONE or dropout:
        return False
    return arch not in MEASURED_ONLY or single_head


def fused_built(arch, pair, bias_kind, dropout) -> bool:
    """Whether `arch` has the FUSED strategy's kernel for this head-dim pair and these features (both
    dK/dV forms: one query head per key head, and the loop over a group's heads)."""
    if pair not in FUSED_TILES.get(arch, {}):
        return False
    return arch not in MEASURED_ONLY or (bias_kind == BIAS_NONE and not dropout)


# Variants with a tensor bias or dropout hold one more score-sized tile per key block (bias loads are
# pipelined like K and V; dropout draws are interleaved through shared memory). Where the plain tile
# would then overflow shared memory (227 KiB on sm_90), they take this one instead.
FEATURE_TILES = {
    "sm_90": {"fwd": {(128, 128): Tile(128, 64, 8, 3)}},
}


# The forward of short causal key sequences, where a program's start (Q and the first K/V blocks) and end
# (O's stores) are a large share of its work, the more so as causal rows end early: a tile small enough for
# two programs on an SM (one warpgroup, 234 registers, 112 KiB of shared memory on sm_90), so that one
# program's start and end overlap the other's key loop, where the 128-row tile fills the SM alone. Causal,
# without bias or dropout, up to SHORT_FWD_MAX_SEQLEN_K keys. H200, bf16, D=128, S=1k (NOTES.md v12,
# bench/results/h200_v12/ab_fwd.json): causal +9% MHA (278 -> 304 TFLOP/s), +12% GQA 16/2; without a mask
# it lost 3-4% (411 -> 400), so unmasked problems keep the regular tile.
SHORT_FWD_TILES = {"sm_90": {(128, 128): Tile(64, 64, 4, 3)},
                   INTERPRET_ARCH: {(32, 32): Tile(16, 16, 4, 1), (128, 128): Tile(16, 16, 4, 1)}}
SHORT_FWD_MAX_SEQLEN_K = 2048


def short_fwd(problem, arch) -> bool:
    """Whether `problem`'s forward takes the short-keys tile on `arch`."""
    return (head_dim_tiles(problem) in SHORT_FWD_TILES.get(arch, {}) and problem_features(problem) == (BIAS_NONE, False)
            and problem.causal and problem.seqlen_k <= SHORT_FWD_MAX_SEQLEN_K)


def _arch_tiles(arch):
    if arch not in TILES:
        raise FmhaValueError(f"arch must be one of {sorted(TILES)}, got {arch!r}")
    return TILES[arch]


def tile_for(arch, pass_name, pair, bias_kind, dropout) -> Tile:
    """The tile of one attention variant: pass_name 'fwd', 'bwd_dkdv' or 'bwd_dq'."""
    tile = _arch_tiles(arch)[pass_name][pair]
    if bias_kind == BIAS_TENSOR or dropout:
        return FEATURE_TILES.get(arch, {}).get(pass_name, {}).get(pair, tile)
    return tile


# ------------------------------------------------------------------------------------------ variants


def _feature_name(bias_kind, dropout):
    return f"{BIAS_KIND_NAMES[bias_kind]}_{'drop' if dropout else 'nodrop'}"


def fwd_key(dtype, pair, bias_kind, dropout, short=False):
    key = f"fmha_fwd_{dtype}_{pair_name(*pair)}_{_feature_name(bias_kind, dropout)}"
    return key + "_short" if short else key


def dkdv_key(dtype, pair, bias_kind, dropout, strategy, single_head=False):
    key = f"fmha_bwd_dkdv_{dtype}_{pair_name(*pair)}_{_feature_name(bias_kind, dropout)}_{strategy}"
    return key + "_mha" if single_head else key


def single_head_dkdv(arch, pair) -> bool:
    """Whether `arch` builds the dK/dV variant for one query head per key head of `pair`."""
    return arch in DKDV_SINGLE_HEAD and pair not in DKDV_FLAT_LOOP.get(arch, ())


# The dK/dV pass's function: fmha_bwd_dkdv (one program per key block), or for the ORDERED strategy the
# persistent fmha_bwd_dkdv_ordered.
DKDV_FUNCTIONS = {False: "fmha_bwd_dkdv", True: "fmha_bwd_dkdv_ordered"}


def dq_key(dtype, pair, bias_kind, dropout):
    return f"fmha_bwd_dq_{dtype}_{pair_name(*pair)}_{_feature_name(bias_kind, dropout)}"


def fused_key(dtype, pair, bias_kind, dropout, single_head=False, strategy=DQ_FUSED):
    """fmha_bwd_fused's variants: 'fmha_bwd_fused_...' (FUSED) or 'fmha_bwd_single_...' (SINGLE)."""
    key = f"fmha_bwd_{strategy}_{dtype}_{pair_name(*pair)}_{_feature_name(bias_kind, dropout)}"
    return key + "_mha" if single_head else key


def preprocess_key(dtype, dv_tile):
    return f"fmha_bwd_preprocess_{dtype}_v{dv_tile}"


def dq_convert_key(dtype, dqk_tile):
    return f"fmha_bwd_dq_convert_{dtype}_d{dqk_tile}"


def dbias_key(dtype):
    return f"fmha_bwd_dbias_{dtype}"


DROPOUT_MASK_KEY = "fmha_dropout_mask"


def _attention_variants(arch, dtype, pair, bias_kind, dropout):
    features = {"BIAS_KIND": bias_kind, "DROPOUT": dropout}
    common = {"head_dim_qk_tile": pair[0], "head_dim_v_tile": pair[1],
              "bias": BIAS_KIND_NAMES[bias_kind], "dropout": dropout}

    def tiled(pass_name, tile):
        return ({"BLOCK_M": tile.block_m, "BLOCK_N": tile.block_n, "BLOCK_DQK": pair[0], "BLOCK_DV": pair[1]},
                dict(common, block_m=tile.block_m, block_n=tile.block_n, **{"pass": pass_name}))

    out = []
    tile = tile_for(arch, "fwd", pair, bias_kind, dropout)
    constexprs, traits = tiled("fwd", tile)
    out.append(make_variant(fwd_key(dtype, pair, bias_kind, dropout), "fmha_fwd", dtype, tile,
                            dict(constexprs, **features), dict(traits, deterministic=True)))
    short = SHORT_FWD_TILES.get(arch, {}).get(pair)
    if short and bias_kind == BIAS_NONE and not dropout:
        constexprs, traits = tiled("fwd", short)
        out.append(make_variant(fwd_key(dtype, pair, bias_kind, dropout, short=True), "fmha_fwd", dtype, short,
                                dict(constexprs, **features), dict(traits, deterministic=True, short_keys=True)))
    tile = tile_for(arch, "bwd_dkdv", pair, bias_kind, dropout)
    for strategy in BUILT_DQ_STRATEGIES[arch]:
        for single_head in (False, True) if single_head_dkdv(arch, pair) else (False,):
            constexprs, traits = tiled("bwd_main", tile)
            constexprs.update(FLAT_LOOP=pair in DKDV_FLAT_LOOP.get(arch, ()), GROUP_LOOP=not single_head,
                              DP_FIRST=pair in DKDV_DP_FIRST.get(arch, ()) and bias_kind == BIAS_NONE and not dropout,
                              **features)
            if strategy != DQ_ORDERED:  # the ordered pass is a function of its own, always adding dQ
                constexprs["DQ_ATOMIC"] = strategy == DQ_ATOMIC
            out.append(make_variant(dkdv_key(dtype, pair, bias_kind, dropout, strategy, single_head),
                                    DKDV_FUNCTIONS[strategy == DQ_ORDERED], dtype, tile, constexprs,
                                    dict(traits, dq_strategy=strategy, deterministic=strategy != DQ_ATOMIC,
                                         single_head=single_head)))
    tile = tile_for(arch, "bwd_dq", pair, bias_kind, dropout)
    constexprs, traits = tiled("bwd_dq", tile)
    out.append(make_variant(dq_key(dtype, pair, bias_kind, dropout), "fmha_bwd_dq", dtype, tile,
                            dict(constexprs, **features), dict(traits, dq_strategy=DQ_DETERMINISTIC, deterministic=True)))
    for strategy, tiles in ((DQ_FUSED, FUSED_TILES), (DQ_SINGLE, SINGLE_TILES)):
        if pair not in tiles.get(arch, {}):
            continue
        kv, q = tiles[arch][pair]
        constexprs = {"BLOCK_M1": kv.block_m, "BLOCK_N1": kv.block_n, "BLOCK_M2": q.block_m, "BLOCK_N2": q.block_n,
                      "BLOCK_DQK": pair[0], "BLOCK_DV": pair[1], "DELTA_INLINE": strategy == DQ_SINGLE, **features}
        traits = dict(common, block_m=kv.block_m, block_n=kv.block_n, dq_block_m=q.block_m, dq_block_n=q.block_n,
                      dq_strategy=strategy, deterministic=True, **{"pass": f"bwd_{strategy}"})
        for single_head in (False, True) if single_head_dkdv(arch, pair) else (False,):
            built = (fused_built(arch, pair, bias_kind, dropout) if strategy == DQ_FUSED
                     else single_built(arch, pair, bias_kind, dropout, single_head))
            if built:
                key = fused_key(dtype, pair, bias_kind, dropout, single_head, strategy)
                out.append(make_variant(key, "fmha_bwd_fused", dtype, kv, dict(constexprs, GROUP_LOOP=not single_head),
                                        dict(traits, single_head=single_head)))
    return out


def variants(arch: str) -> list[dict]:
    """Every variant to build for `arch` ('sm_90', 'gfx942', 'gfx950'; 'interpret' for CPU tests).

    Each is a dict: key (unique name, the kernel map key), module, function, signature (every kernel
    parameter in order, 'constexpr' for compile-time ones), constexprs, num_warps, num_stages, traits.
    """
    _arch_tiles(arch)
    out = []
    for dtype in DTYPES:
        for pair in HEAD_DIM_PAIRS:
            for bias_kind in (BIAS_NONE, BIAS_TENSOR, BIAS_ALIBI):
                for dropout in (False, True):
                    out.extend(_attention_variants(arch, dtype, pair, bias_kind, dropout))
        accumulated = {DQ_ATOMIC, DQ_ORDERED} & set(BUILT_DQ_STRATEGIES[arch])
        for d in HEAD_DIM_TILES:
            if accumulated or any(p[1] == d for p in FUSED_TILES.get(arch, {})):
                # the two-kernel strategy's dQ kernel computes Delta and Lse2 itself
                out.append(preprocess_variant(preprocess_key(dtype, d), dtype, d))
            if accumulated:
                out.append(dq_convert_variant(dq_convert_key(dtype, d), dtype, d))
        out.append(make_variant(dbias_key(dtype), "fmha_bwd_dbias", dtype, DBIAS_TILE,
                                {"BLOCK_M": DBIAS_TILE.block_m, "BLOCK_N": DBIAS_TILE.block_n},
                                {"pass": "bwd_dbias", "block_m": DBIAS_TILE.block_m, "block_n": DBIAS_TILE.block_n,
                                 "deterministic": True}))
        out += head_padding.variants(dtype)
    mask = make_variant(DROPOUT_MASK_KEY, "fmha_dropout_mask", "u8", MASK_TILE,
                        {"BLOCK_M": MASK_TILE.block_m, "BLOCK_N": MASK_TILE.block_n},
                        {"pass": "dropout_mask", "block_m": MASK_TILE.block_m, "block_n": MASK_TILE.block_n})
    out.append(mask)
    return out


def variant_map(arch: str) -> dict:
    """{key: variant} for `arch`."""
    return {v["key"]: v for v in variants(arch)}


# ------------------------------------------------------------------------------------------ planning


def dq_strategy(problem, arch, requested=None) -> str:
    """`requested` when given (FUSED, SINGLE, ORDERED or DETERMINISTIC for a deterministic problem); else
    SINGLE where it is built for the problem and the problem has at most SINGLE_MAX_SCORES score elements,
    ORDERED for a deterministic problem on the archs of ORDERED_FOR_DETERMINISTIC, FUSED where it is built
    and the keys reach FUSED_MIN_SEQLEN_K (all three deterministic too), DETERMINISTIC when the problem asks
    for it, or the arch's default."""
    if requested not in (None, DQ_ATOMIC, DQ_DETERMINISTIC, DQ_FUSED, DQ_SINGLE, DQ_ORDERED):
        raise FmhaValueError(f"dq strategy must be {DQ_ATOMIC!r}, {DQ_DETERMINISTIC!r}, {DQ_FUSED!r}, "
                             f"{DQ_SINGLE!r} or {DQ_ORDERED!r}, got {requested!r}")
    pair = head_dim_tiles(problem)
    single_head = problem.heads_q == problem.heads_k and single_head_dkdv(arch, pair)
    fused = fused_built(arch, pair, *problem_features(problem))
    single = single_built(arch, pair, *problem_features(problem), single_head)
    if requested in (DQ_SINGLE, DQ_FUSED):
        single_asked = requested == DQ_SINGLE
        if not (single if single_asked else fused):
            pairs = ", ".join(pair_name(*p) for p in (SINGLE_TILES if single_asked else FUSED_TILES).get(arch, {}))
            if arch in MEASURED_ONLY:
                what = " without bias or dropout" + (", one query head per key head" if single_asked else "")
            else:
                what = " without bias or dropout" if single_asked else ""
            raise FmhaNotImplementedError(f"the {'one-launch' if single_asked else 'fused'} backward is not built "
                                          f"for this problem on {arch} (built: {pairs or 'none'}{what})")
        return requested
    scores = problem.batch * problem.heads_q * problem.seqlen_q * problem.seqlen_k
    if requested is None and single and scores <= SINGLE_MAX_SCORES:
        return DQ_SINGLE
    if requested is None and problem.deterministic and arch in ORDERED_FOR_DETERMINISTIC:
        requested = DQ_ORDERED
    if requested is None and fused and problem.seqlen_k >= FUSED_MIN_SEQLEN_K:
        return DQ_FUSED
    if problem.deterministic and requested != DQ_ORDERED:
        if requested == DQ_ATOMIC:
            raise FmhaValueError("a deterministic backward cannot use the atomic dQ strategy")
        return DQ_DETERMINISTIC
    _arch_tiles(arch)
    strategy = requested or DEFAULT_DQ_STRATEGY[arch]
    if strategy not in BUILT_DQ_STRATEGIES[arch]:
        raise FmhaNotImplementedError(f"the {strategy} dQ strategy is not built for {arch} "
                                      f"(built: {', '.join(BUILT_DQ_STRATEGIES[arch])})")
    return strategy


def bwd_workspace(problem, arch, dq_strategy_request=None) -> Workspace:
    """Workspace of plan_bwd and of the padding copies around it (layout.backward_workspace for the
    strategy dq_strategy chooses; for ORDERED, after the fp32 dQ accumulator, the int32 order region:
    a work-item ticket and one counter per (batch entry, query head, query block of the dK/dV tile),
    kernels/portable/dq_order.py)."""
    strategy = dq_strategy(problem, arch, dq_strategy_request)
    extra = []
    if strategy == DQ_ORDERED:
        extra.append(layout.dq_order_region(problem, tile_for(arch, "bwd_dkdv", head_dim_tiles(problem),
                                                                *problem_features(problem)).block_m))
    return layout.backward_workspace(problem, strategy, extra)


def ordered_programs(problem, arch) -> int:
    """Programs of the ORDERED dK/dV pass: FMHA_RT_BWD_PROGRAMS when set (a positive integer, to test that
    any number gives the same bits), else ORDERED_PROGRAMS[arch]; at most one per work item (key block,
    key head, batch entry). Read at every plan: the plan cache does not key on it (clear it after a change)."""
    return min(backward.forced_programs() or ORDERED_PROGRAMS[arch], ordered_work_items(problem, arch))


def ordered_work_items(problem, arch) -> int:
    """Work items of the ORDERED dK/dV pass: one per (key block, key head, batch entry)."""
    block_n = tile_for(arch, "bwd_dkdv", head_dim_tiles(problem), *problem_features(problem)).block_n
    return cdiv(problem.seqlen_k, block_n) * problem.heads_k * problem.batch


def fwd_scratch(problem) -> layout.Scratch:
    """Scratch of a forward this family runs: the padding copies' regions alone."""
    return layout.fwd_scratch(problem)


def plan_fwd(problem, arch, operands) -> list:
    """Launches of the forward: fmha_fwd writing out [.., Hq, Dv] and lse (with the short-keys tile where
    short_fwd says so).

    operands (operands.Operands): q, k, v, out, lse, optional bias, alibi, cu_seqlens_q/k, seqstart_q/k,
    and for dropout the Philox seed and offset (by value or a device pointer).
    """
    pair = head_dim_tiles(problem)
    kind, dropout = problem_features(problem)
    short = short_fwd(problem, arch)
    tile = SHORT_FWD_TILES[arch][pair] if short else tile_for(arch, "fwd", pair, kind, dropout)
    if not has_work(problem):
        return []
    return [forward_launch(fwd_key(problem.dtype, pair, kind, dropout, short), problem, operands, tile.block_m)]


def plan_dropout_mask(problem, arch, operands) -> list:
    """Launch writing the dropout keep mask operands.mask (uint8 [B, Hq, Sq, Sk]; Sq/Sk the maximum
    lengths in varlen mode) for the call's seed and offset."""
    if not problem.has_dropout:
        raise FmhaValueError("the problem has no dropout (dropout_p == 0)")
    _arch_tiles(arch)
    a = Args(problem, operands)
    mask = a.need.mask
    b, h, s, _ = a.given_strides(mask, 4)
    args = {"Mask": mask.pointer, "mask_stride_b": b, "mask_stride_h": h, "mask_stride_s": s,
            "seqlen_q": problem.seqlen_q, "seqlen_k": problem.seqlen_k, "num_heads_q": problem.heads_q,
            "drop_threshold": dropout_threshold(problem.dropout_p)}
    args.update(a.philox())
    if not has_work(problem):
        return []
    return [Launch(DROPOUT_MASK_KEY, launch_grid(cdiv(problem.seqlen_q, MASK_TILE.block_m), problem),
                   ordered(DROPOUT_MASK_KEY, "fmha_dropout_mask", args))]


def plan_bwd(problem, arch, operands, dq_strategy_request=None) -> list:
    """Launches of the backward for the strategy bwd_workspace's layout carries (backward.py gives the
    order of each); operands as backward.py describes them, with the regions of bwd_workspace(problem,
    arch, dq_strategy_request)."""
    pair = head_dim_tiles(problem)
    kind, dropout = problem_features(problem)
    dtype = problem.dtype
    workspace = bwd_workspace(problem, arch, dq_strategy_request)
    strategy = workspace.dq_strategy
    if not has_work(problem):
        return []
    single_head = problem.heads_q == problem.heads_k and single_head_dkdv(arch, pair)
    args = backward.BackwardArgs(problem, operands, workspace)
    launches = []
    if strategy in (DQ_ATOMIC, DQ_FUSED, DQ_ORDERED):
        launches.append(backward.preprocess(args, preprocess_key(dtype, pair[1])))
    elif strategy == DQ_DETERMINISTIC:  # first: the dQ kernel writes the Delta and Lse2 that dK/dV reads
        launches.append(backward.dq(args, dq_key(dtype, pair, kind, dropout), tile_for(arch, "bwd_dq", pair, kind, dropout)))
    if strategy in (DQ_FUSED, DQ_SINGLE):
        kv, q = (FUSED_TILES if strategy == DQ_FUSED else SINGLE_TILES)[arch][pair]
        launches.append(backward.fused(args, fused_key(dtype, pair, kind, dropout, single_head, strategy), kv, q))
    elif strategy == DQ_ORDERED:
        launches.append(backward.dkdv_ordered(args, dkdv_key(dtype, pair, kind, dropout, strategy, single_head),
                                              ordered_programs(problem, arch)))
    else:
        launches.append(backward.dkdv(args, dkdv_key(dtype, pair, kind, dropout, strategy, single_head),
                                      tile_for(arch, "bwd_dkdv", pair, kind, dropout).block_n))
    if strategy in (DQ_ATOMIC, DQ_ORDERED):
        launches.append(backward.dq_convert(args, dq_convert_key(dtype, pair[0])))
    if problem.bias_grad:
        launches.append(backward.dbias(args, dbias_key(dtype), DBIAS_TILE.block_m))
    return launches
