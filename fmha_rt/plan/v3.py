"""The v3 kernel family (Hopper, written in Gluon: kernels/v3/): which variants exist and which calls
they serve.

A v3 kernel takes the signature of its function (abi.SIGNATURES), so a v3 launch is
the portable plan's launch with another variant key and grid, plus one argument the portable kernels
never need: Triton's `global_scratch`, the memory in which each program makes its TMA descriptors
(`fwd_global_scratch` and `bwd_global_scratch` bytes a program, which the build checks against the
compiler's figure). It is a region of the call's scratch buffer: the forward's (`fwd_scratch`) or the
backward's workspace.

The forward serves sm_90, fp16 and bf16, head dims in the 64, 128 or 256 tile (both of them in the same one,
or 192 or 256 for queries and keys with 128 for values: `fwd_pair`), MHA, GQA and MQA, no mask, causal and sliding
windows in either alignment, batch and varlen; not score terms or dropout. The backward serves those calls
in every tile: non-deterministic ones by the portable atomic strategy (pre-pass, dK/dV with dQ
added into a zeroed fp32 accumulator, conversion of dQ) with the v3 dK/dV kernel and the pre-pass and
conversion built under this family's keys; deterministic ones, on the archs of ORDERED_FOR_DETERMINISTIC, by
the ORDERED strategy (the same passes, dQ added in key-block order by fmha_bwd_dkdv_ordered). MODE says
where it runs: 'measured' (the default) where the benchmark showed it faster than the portable family, 'all'
everywhere it serves, 'off' nowhere (FMHA_RT_V3 unset, '1', '0'; read at import, `refresh_mode()` re-reads
it); the plan cache does not key on the mode, so clear it after changing it.
"""
import os

from . import backward
from .abi import (BIAS_NONE, DKDV_ACCUMULATING_SIGNATURE, DQ_ATOMIC, DQ_ORDERED, DTYPES, Tile, dq_convert_variant, head_dim_tiles,
                  make_variant, pair_name, preprocess_variant, problem_features)
from .args import forward_launch, has_work
from .layout import Scratch, Workspace, backward_workspace, dq_order_region, fwd_scratch as padding_scratch, padded_head_dim

FAMILY = "v3"
ARCHS = ("sm_90",)
KERNEL_MODULES = {"fwd": "kernels.v3.fmha_fwd", "bwd": "kernels.v3.fmha_bwd"}
# 64 query rows a consumer warpgroup, 128 a program (two consumers); the default partition's 4 warps (the
# rest come from the kernel's warp_specialize: the other consumer and two loader warps). Keys come 128 a
# block, 64 at D=256: there Q's two tiles and a 2-deep ring of K and V fill 192 KiB of the 227 KiB a program
# may have, and each consumer's 64 x 256 fp32 accumulator takes 128 of its 240 registers; the (256, 128) pair
# (queries and keys of 193..256, values of 65..128) takes the same tile, O in the first half of Q's tiles.
# At D=64 the 128 tile (candidate v3.15): its 128 keys a block give a step 3.3 instructions a key against
# 4.3 in FlashAttention-3's 192 x 64 tile of three consumers, which was slower than the portable forward at
# every length. The (192, 128) pair (LATENT_PAIR) takes 128 keys a block again: Q's 48 KiB and a 2-deep ring
# of 128 x 192 K and 128 x 128 V tiles fill 208 KiB, and a consumer holds the 128 tile's accumulators (64 x
# 128 for S and for O); the kernel holds its Q and K tiles in two parts, 128 and 64 columns wide.
FWD_TILES = {(64, 64): Tile(128, 128, 4, 1), (128, 128): Tile(128, 128, 4, 1), (256, 256): Tile(128, 64, 4, 1),
             (256, 128): Tile(128, 64, 4, 1), (192, 128): Tile(128, 128, 4, 1)}
FWD_PAIRS = tuple(FWD_TILES)
# 192/128 heads (multi-head latent attention's) in a tile of their own rather than padded to 256 for queries
# and keys. The forward's alone: the portable kernels need power-of-two tiles (abi.HEAD_DIM_PAIRS), and the
# backward keeps the (256, 128) pair.
LATENT_PAIR = (192, 128)
# How a tile's consumers share the tensor cores (kernels/v3/fmha_fwd.py): FREE, each at its own pace; TURNS,
# they take turns at their softmax (SOFTMAX_TURNS); PINGPONG, at issuing their products, FlashAttention-3's
# schedule (PINGPONG). PINGPONG measured 1.02-1.03x FREE at D=128 and 1.04-1.15x TURNS at D=256 (NOTES.md, v3.9).
FREE, TURNS, PINGPONG = "free", "turns", "pingpong"
FWD_SCHEDULE = {(64, 64): PINGPONG, (128, 128): PINGPONG, (256, 256): PINGPONG, (256, 128): PINGPONG,
                (192, 128): PINGPONG}
# The build choices of each schedule: constexprs beyond the signature's
SCHEDULE_CONSTEXPRS = {FREE: {}, TURNS: {"SOFTMAX_TURNS": True}, PINGPONG: {"PINGPONG": True}}
# Causal forwards whose programs run two query blocks each: block M - 1 - p with block p of a (head, batch
# entry) (the kernel's TILES = 2, a variant of its own: fwd_key(..., paired=True)), so that every program has
# the same work and one prologue serves two tiles. Key lengths [from, below): two blocks a program measured
# 1.04-1.10x one on an H100 there, 0.95-0.98x at 16k keys (its loop spills more) and at 256 below 2048 keys,
# and at 192/128 0.90-0.95x but at 4096 keys; without a mask 0.94-1.01x (NOTES.md, v3.14).
FWD_PAIRED_CAUSAL_SEQLEN_K = {(128, 128): (0, 8192), (256, 256): (2048, 8192)}
# GQA calls without a mask whose programs run a run of FWD_RUN_TILES consecutive query blocks (the kernel's
# TILES > 2, a variant of its own: fwd_key(..., run=True)), so that one prologue (descriptors, the first copies)
# serves them all and each tile's Q lands under the tile before it. Key lengths [from, below) by (tile pair, GQA):
# on an H100 GQA 16/2 at D=128 took 1.04x, 1.05x and 1.03x at 1k, 2k and 4k keys, MHA 1.00x (NOTES.md, v3.21).
FWD_RUN_TILES = {(128, 128): 4}
FWD_RUN_SEQLEN_K = {((128, 128), True): (0, 8192)}
# Query rows a step of the backward's 64 tile: 128, FlashAttention-3's shape at head dim 64, so that a step's
# fixed costs (the waits, the statistics' loads, dQ's bulk addition) serve twice the work, the step's products
# being small at D=64. A consumer holds S and dP as 128 x 64 (64 registers each) beside dK and dV (32 each);
# shared memory 225 KiB. On an H100 1.04-1.08x the 64-row tile at 1k-16k keys (NOTES.md, v3.22).
BWD_D64_ROWS = 128
# The backward's dK/dV tiles, 64 query rows a step (the 64 tile BWD_D64_ROWS): 128 keys a program (two
# consumer warpgroups of 64 keys, kernels/v3/fmha_bwd.py) in the 64, 128 and 192/128 tiles; 64 keys shared by the two
# consumers, each with half of the head dims (kernels/v3/fmha_bwd_wide.py, behind fmha_bwd.py's entries), in
# the 256 tiles, where a consumer could not hold whole dK and dV rows. The (192, 128) tile (LATENT_PAIR) is the
# 128 tile's program with Q and K held as 128 + 64 columns (v3.32; its ORDERED form v3.33, whose consumers add
# dQ themselves: NOTES.md), 1.28-1.39x the wide program's (192, 128) tile that it replaced. Each has its ATOMIC
# and its ORDERED (deterministic) form.
BWD_TILES = {(64, 64): Tile(BWD_D64_ROWS, 128, 4, 1), (128, 128): Tile(64, 128, 4, 1), (256, 256): Tile(64, 64, 4, 1),
             (256, 128): Tile(64, 64, 4, 1), (192, 128): Tile(64, 128, 4, 1)}
BWD_PAIRS = tuple(BWD_TILES)
BWD_WIDE_PAIRS = ((256, 256), (256, 128))
# Whether 192/128 heads' backward takes the (192, 128) tile rather than the (256, 128) one: on an H100 it was
# 1.11-1.24x the padded (256, 128) tile at 1k-16k keys (NOTES.md, v3.18).
LATENT_BWD_TILE = True
# GQA calls whose atomic dK/dV runs a program per query head (fmha_bwd_dkdv's ONE_HEAD, FlashAttention-3's and -4's
# form: dK and dV added into zeroed fp32 accumulators of the workspace, then converted) rather than per key
# head, by tile and masking (causal or not): the key lengths [from, below) that take it. On an H100 (v3.31,
# NOTES.md; GQA 16/2) causal: 1.19x the per-key-head program at 1k, 1.06x at 2k (where that program walked its
# steps down, v3.20, whose variants this retired), 1.35x at 4k, 1.23x at 8k, 1.09x at 16k; without a mask
# 0.83-0.97x, the per-key-head program reading K and V once for the group's 8 heads.
BWD_HEADS_PAIRS = ((128, 128),)
BWD_HEADS_GQA_SEQLEN_K = {((128, 128), True): (1024, 1 << 31)}
# Key blocks an atomic dK/dV program runs (the kernel's TILES): 2 pairs key block p with N - 1 - p of a (key
# head, batch entry), so that causal programs have equal steps and one prologue serves two key blocks. The
# ORDERED form takes one block a ticket, and the wide program one block.
BWD_TILES_PER_PROGRAM = {pair: 1 if pair in BWD_WIDE_PAIRS else 2 for pair in BWD_TILES}
# 128-byte TMA descriptors a program, each made by the partition that uses it: in the forward Q's, K's and
# V's (the loaders') and one of O for each consumer (fwd_global_scratch); in the backward K's, V's, Q's, dO's,
# Lse2's and Delta's (the loaders': the statistics come with dO, or in the wide tiles Lse2 with Q) and dK's,
# dV's and the dQ accumulator's for each of the two consumers, but for the ORDERED form's 64 and 128 tiles,
# where one dQ writer adds dQ (bwd_global_scratch).
DESCRIPTOR_BYTES = 128
GLOBAL_SCRATCH_ALIGN = 128
DESCRIPTOR_REGION = "tma_descriptors"


def _read_mode() -> str:
    """FMHA_RT_V3: unset or empty 'measured' (where measured faster), '0' 'off', anything else 'all'."""
    value = os.environ.get("FMHA_RT_V3", "")
    return {"": "measured", "0": "off"}.get(value, "all")


MODE = _read_mode()
# Where the 'measured' mode runs the v3 forward, by tile: from how many keys. The 128 tile from 1024 keys: with
# its descriptors made in the partitions (v3.11) it was 1.20x the portable forward at 1024 keys on an H100 and
# level with it causal (471 against 393, 302 against 300 TFLOP/s; NOTES.md, v3.11). The 256 tile was 1.29-1.34x
# the portable forward on an H100 from 1024 keys (NOTES.md, the H100 round of v3.3-v3.6) and runs from 1024
# keys. At D=64 FlashAttention-3's 192 x 64 tile was slower everywhere (0.65-0.93x at 1k and 2k keys after
# v3.11); the 128 tile there (v3.15) was 0.76-0.99x the portable forward up to 4096 keys, 1.01x / 1.03x
# (causal) at 8192 and 1.03x / 1.05x at 16384 (NOTES.md, v3.15): from 8192 keys.
# Heads of 129..192 for queries and keys and up to 128 for values run the (192, 128) tile from 1024 keys: on
# an H100 it was 1.33-1.66x the portable forward at 1k and 2k keys, and 1.08-1.23x the (256, 128) tile that
# served them padded (NOTES.md, v3.10). That (256, 128) tile, wider query/key heads' now, was 1.23-1.38x the
# portable forward at 1k and 2k keys (padded 192/128 heads, the same work): from 1024 keys too.
MEASURED_FWD_MIN_SEQLEN_K = {(64, 64): 8192, (128, 128): 1024, (256, 256): 1024, (192, 128): 1024, (256, 128): 1024}
# Where the 'measured' mode runs the v3 backward (non-deterministic calls only: its dQ is added by bulk TMA
# reductions in whatever order programs finish). On an H100 after v3.13 and v3.16 (NOTES.md, "The H100 round of
# v3.14-v3.16"): at D=128 1.17-1.27x the portable backward at 1k and 2k keys (1.02x at 1k causal), level at 4k;
# causal GQA (16/2) 0.92x at 1k, 1.03x at 2k, 1.11x at 4k. The 64 tile with v3.22's 128-row step (NOTES.md, "The
# H100 round of v3.20-v3.23"): 0.96x / 0.88x (causal) at 1k, 1.04x / 1.00x at 2k, 1.09x / 1.07x at 4k, level at 8k
# and 16k: from 2048 keys. The wide program (v3.6) of the 256 tiles on an H100: 1.10-1.45x the portable backward at
# D=256 from 1024 keys; at 192/128 1.20-1.31x from 4096 keys, at 1024 keys 1.10x without a mask but 0.97x causal: so
# D=256 from 1024 keys and the (256, 128) tile from 4096. The (192, 128) tile (v3.18) was 1.33x / 1.21x (causal) the
# portable backward at 1024 keys: from 1024. Causal GQA of the 128 tile by programs of one query head (v3.31) was
# 1.05x (bf16) / 1.10x (fp16) the portable backward at 1024 keys (bench/results/h100_v28/ab/ab_gqa_1k_v331.json):
# from 1024. Causal GQA calls of the other tiles (unmeasured) take it from 16384 keys, where the H200 had it ahead.
MEASURED_BWD_MIN_SEQLEN_K = {(128, 128): 1024, (64, 64): 2048, (256, 256): 1024, (256, 128): 4096, (192, 128): 1024}
MEASURED_BWD_CAUSAL_GQA_MIN_SEQLEN_K = {(128, 128): 1024}
UNMEASURED_BWD_CAUSAL_GQA_MIN_SEQLEN_K = 16384
# Where deterministic calls take the v3 backward's ORDERED form (one program per (key block, key head,
# batch entry), dQ tiles added in key-block order, the counters' wait and the additions in a writer warp
# of their own: NOTES.md, v3.4). On an H100 (NOTES.md, "The ORDERED backward as the default of long
# deterministic calls") it was 1.07x / 1.11x (causal) the portable deterministic backward at D=128 16k, 1.12-1.14x
# GQA 16/2 without a mask from 4k and 1.10x at D=256 16k without a mask. With v3.19's tickets and walk (NOTES.md,
# v3.19): D=128 without a mask 1.05x at 4k, causal GQA 1.09x at 4k and 1.03x at 16k; still behind at 1k (0.89x,
# causal 0.76x), D=128 causal level at 4k, D=64 and 192/128 behind or level. After v3.22 and v3.25 (NOTES.md, "The
# ORDERED backward's lengths after v3.25"): D=64 1.05x at 4k without a mask (0.94x causal), 1.08-1.15x at 8k and
# 16k; D=128 causal 1.05x at 8k; GQA 16/2 1.10x / 1.11x (causal) at 2k; 192/128 and D=256 still 0.79-1.00x. The
# 192/128 tile's ORDERED form of two consumers of keys (v3.33): 1.37-1.67x without a mask and 1.13-1.73x causal
# at 1k-16k (bench/results/h100_v28/ab/ab_latent_det_v333.json). By (tile pair, GQA, causal): from these key
# lengths, on dense calls without a mask or causal.
MEASURED_ORDERED_MIN_SEQLEN_K = {((64, 64), False, False): 4096, ((64, 64), False, True): 8192,
                                 ((128, 128), False, False): 4096, ((128, 128), False, True): 8192,
                                 ((128, 128), True, False): 2048, ((128, 128), True, True): 2048,
                                 ((256, 256), False, False): 16384,
                                 ((192, 128), False, False): 1024, ((192, 128), False, True): 1024}
# The ORDERED form's tickets go by chunks of this many keys of each (key head, batch entry) (dq_order.ticket_item;
# 4 key blocks of the 64 and 128 tiles, 8 of the wide program's 64-key blocks), so that the programs running at once
# share their heads' Q, dO and dQ tiles in L2. Against key block slowest on an H100 (NOTES.md, v3.19): 512 keys were
# 1.0-1.5x at 1k-4k keys; 1024 keys (8 blocks of 128) gave 0.84-0.92x of that at 1k, 256 keys (4 of 64) 0.87-0.89x at 4k.
ORDERED_CHUNK_KEYS = 512
# Archs where deterministic calls take the ORDERED form at every length (tests/gpu switch it on for themselves).
ORDERED_FOR_DETERMINISTIC = frozenset()


def refresh_mode() -> None:
    """Re-read FMHA_RT_V3 (for a process that sets it after importing fmha_rt); clear the plan cache after."""
    global MODE
    MODE = _read_mode()


def _latent_or_tiles(problem, latent: bool) -> tuple:
    """LATENT_PAIR where `latent`, it holds both head dims and the query/key dim is wider than 128;
    abi.head_dim_tiles' choice elsewhere."""
    dqk, dv = LATENT_PAIR
    if latent and 128 < problem.head_dim_qk <= dqk and problem.head_dim_v <= dv:
        return LATENT_PAIR
    return head_dim_tiles(problem)


def fwd_pair(problem) -> tuple:
    """The forward's (query/key, value) tile of `problem`."""
    return _latent_or_tiles(problem, LATENT_PAIR in FWD_TILES)


def bwd_pair(problem) -> tuple:
    """The backward's (query/key, value) tile of `problem` (LATENT_BWD_TILE)."""
    return _latent_or_tiles(problem, LATENT_BWD_TILE)


def dq_tile(pair) -> int:
    """The dQ conversion's head-dim tile for the backward tile `pair`: a power of two (256 for 192)."""
    return 1 << (pair[0] - 1).bit_length()


def fwd_key(dtype, pair, paired=False, run=False):
    """The forward variants: one query block a program, (paired) two, or (run) FWD_RUN_TILES[pair]."""
    suffix = "_paired" if paired else f"_run{FWD_RUN_TILES[pair]}" if run else ""
    return f"fmha_fwd_v3_{dtype}_{pair_name(*pair)}" + suffix


def dkdv_key(dtype, pair, strategy=DQ_ATOMIC):
    """The dK/dV variants: 'fmha_bwd_dkdv_v3_...' (ATOMIC), 'fmha_bwd_dkdv_ordered_v3_...' (ORDERED)."""
    form = "_ordered" if strategy == DQ_ORDERED else ""
    return f"fmha_bwd_dkdv{form}_v3_{dtype}_{pair_name(*pair)}"


def dkdv_heads_key(dtype, pair):
    """The atomic dK/dV variant of programs of one query head ('fmha_bwd_dkdv_heads_v3_...', ONE_HEAD)."""
    return f"fmha_bwd_dkdv_heads_v3_{dtype}_{pair_name(*pair)}"


def preprocess_key(dtype, dv_tile):
    return f"fmha_bwd_preprocess_v3_{dtype}_d{dv_tile}"


def dq_convert_key(dtype, dqk_tile):
    return f"fmha_bwd_dq_convert_v3_{dtype}_d{dqk_tile}"


def fwd_global_scratch(pair) -> int:
    """The forward's descriptor bytes a program in the tile of `pair`: Q, K and V, and O for each of its
    consumers (64 query rows each)."""
    return DESCRIPTOR_BYTES * (3 + FWD_TILES[pair].block_m // 64)


def bwd_global_scratch(function, pair) -> int:
    """The dK/dV kernel's descriptor bytes a program (`function`: fmha_bwd_dkdv or fmha_bwd_dkdv_ordered) in
    the tile of `pair`."""
    # the ORDERED form of the 64 and 128 tiles has a dQ writer; in the 192 tile and the wide program the consumers add dQ
    dq_writer = function == "fmha_bwd_dkdv_ordered" and pair[0] <= 128
    loaders = 6  # K, V, Q, dO, Lse2, Delta
    consumers = 2 * (2 if dq_writer else 3)  # each consumer's dK, dV and, without a writer, dQ accumulator
    return DESCRIPTOR_BYTES * (loaders + consumers + int(dq_writer))


def _gluon(variant, scratch_bytes):
    return dict(variant, language="gluon", global_scratch=scratch_bytes, global_scratch_align=GLOBAL_SCRATCH_ALIGN)


def variants(arch: str) -> list[dict]:
    """The v3 variants to build for `arch` (none but on sm_90), in the form of portable.variants,
    with language 'gluon' and the global scratch each program needs."""
    if arch not in ARCHS:
        return []
    out = []
    common = {"bias": "nobias", "dropout": False}
    for dtype in DTYPES:
        for pair, tile in FWD_TILES.items():
            constexprs = {"BLOCK_M": tile.block_m, "BLOCK_N": tile.block_n, "BLOCK_DQK": pair[0],
                          "BLOCK_DV": pair[1], "BIAS_KIND": BIAS_NONE, "DROPOUT": False}
            schedule = FWD_SCHEDULE[pair]
            constexprs |= SCHEDULE_CONSTEXPRS[schedule]
            traits = dict(common, head_dim_qk_tile=pair[0], head_dim_v_tile=pair[1], block_m=tile.block_m,
                          block_n=tile.block_n, deterministic=True, schedule=schedule, **{"pass": "fwd"})
            forms = [(False, False, 1)]  # (paired, run, tiles)
            if pair in FWD_PAIRED_CAUSAL_SEQLEN_K:
                forms.append((True, False, 2))
            if pair in FWD_RUN_TILES:
                forms.append((False, True, FWD_RUN_TILES[pair]))
            for paired, run, tiles in forms:
                out.append(_gluon(make_variant(fwd_key(dtype, pair, paired, run), "fmha_fwd", dtype, tile,
                                               constexprs | {"TILES": tiles}, dict(traits, tiles_per_program=tiles),
                                               module=KERNEL_MODULES["fwd"]), fwd_global_scratch(pair)))
        for pair, tile in BWD_TILES.items():
            for strategy, function in ((DQ_ATOMIC, "fmha_bwd_dkdv"), (DQ_ORDERED, "fmha_bwd_dkdv_ordered")):
                constexprs = {"BLOCK_M": tile.block_m, "BLOCK_N": tile.block_n, "BLOCK_DQK": pair[0],
                              "BLOCK_DV": pair[1], "BIAS_KIND": BIAS_NONE, "DROPOUT": False, "FLAT_LOOP": False,
                              "GROUP_LOOP": True, "DP_FIRST": False}
                if strategy == DQ_ATOMIC:  # the ordered function always adds dQ
                    constexprs |= {"DQ_ATOMIC": True, "TILES": BWD_TILES_PER_PROGRAM[pair]}
                else:
                    constexprs |= {"KEY_BLOCK_CHUNK": ORDERED_CHUNK_KEYS // tile.block_n}
                traits = dict(common, head_dim_qk_tile=pair[0], head_dim_v_tile=pair[1], block_m=tile.block_m,
                              block_n=tile.block_n, dq_strategy=strategy, deterministic=strategy == DQ_ORDERED,
                              single_head=False, **{"pass": "bwd_main"})
                out.append(_gluon(make_variant(dkdv_key(dtype, pair, strategy), function, dtype, tile, constexprs, traits,
                                               module=KERNEL_MODULES["bwd"]), bwd_global_scratch(function, pair)))
                if strategy == DQ_ATOMIC and pair in BWD_HEADS_PAIRS:
                    out.append(_gluon(make_variant(dkdv_heads_key(dtype, pair), function, dtype, tile,
                                                   constexprs | {"ONE_HEAD": True}, traits, module=KERNEL_MODULES["bwd"],
                                                   signature=DKDV_ACCUMULATING_SIGNATURE),
                                      bwd_global_scratch(function, pair)))
        # the portable pre-pass and dQ conversion, which the portable family builds for sm_90 only where
        # its own strategies use them
        out += [preprocess_variant(preprocess_key(dtype, d), dtype, d) for d in sorted({p[1] for p in BWD_PAIRS})]
        out += [dq_convert_variant(dq_convert_key(dtype, d), dtype, d) for d in sorted({dq_tile(p) for p in BWD_PAIRS})]
    return out


def serves_fwd(problem, arch) -> bool:
    """Whether the v3 forward runs `problem` on `arch` in the current MODE."""
    pair = fwd_pair(problem)
    if MODE == "off" or not (arch in ARCHS and problem.dtype in DTYPES and pair in FWD_PAIRS
                             and problem_features(problem) == (BIAS_NONE, False)):
        return False
    return MODE == "all" or problem.seqlen_k >= MEASURED_FWD_MIN_SEQLEN_K.get(pair, float("inf"))


def serves_bwd(problem, arch, dq_strategy_request=None) -> bool:
    """Whether the v3 backward runs `problem` on `arch` in the current MODE: non-deterministic calls by
    the ATOMIC strategy, deterministic ones by the ORDERED strategy where ORDERED_FOR_DETERMINISTIC
    holds the arch or from the measured lengths (ordered_min_seqlen_k); a request for another dQ strategy
    keeps the portable family."""
    pair = bwd_pair(problem)
    strategy = _bwd_strategy(problem)
    if (MODE == "off" or arch not in ARCHS or dq_strategy_request not in (None, strategy)
            or problem.dtype not in DTYPES or pair not in BWD_PAIRS
            or problem_features(problem) != (BIAS_NONE, False)):
        return False
    if problem.deterministic:
        return arch in ORDERED_FOR_DETERMINISTIC or problem.seqlen_k >= ordered_min_seqlen_k(problem, pair)
    if MODE == "all":
        return True
    min_keys = MEASURED_BWD_MIN_SEQLEN_K.get(pair)
    if min_keys is not None and problem.causal and problem.kv_group_size > 1:
        min_keys = max(min_keys, MEASURED_BWD_CAUSAL_GQA_MIN_SEQLEN_K.get(pair, UNMEASURED_BWD_CAUSAL_GQA_MIN_SEQLEN_K))
    return min_keys is not None and problem.seqlen_k >= min_keys


def ordered_min_seqlen_k(problem, pair) -> float:
    """The key length from which a deterministic call of the tile pair takes the ORDERED form by default
    (MEASURED_ORDERED_MIN_SEQLEN_K): measured on dense calls without a mask or causal; never elsewhere."""
    if problem.varlen or not (problem.unmasked or problem.causal):
        return float("inf")
    return MEASURED_ORDERED_MIN_SEQLEN_K.get((pair, problem.kv_group_size > 1, problem.causal), float("inf"))


def fwd_scratch(problem) -> Scratch:
    """The scratch of a forward the v3 family serves: the padding copies' regions (layout.fwd_scratch),
    then one region for its programs' descriptors."""
    return padding_scratch(problem, _descriptor_region(fwd_global_scratch(fwd_pair(problem)) * _programs(problem), problem))


def _descriptor_region(nbytes, problem) -> list:
    """The (name, shape, zero_init, dtype) of DESCRIPTOR_REGION: none for a call without programs."""
    return [(DESCRIPTOR_REGION, (nbytes // 4,), False, "fp32")] if has_work(problem) else []


def _keys_within(problem, lengths) -> bool:
    """Whether the call's key length lies in `lengths`, a [from, below) range or None."""
    return lengths is not None and lengths[0] <= problem.seqlen_k < lengths[1]


def fwd_paired(problem) -> bool:
    """Whether a forward program runs two query blocks (FWD_PAIRED_CAUSAL_SEQLEN_K)."""
    return problem.causal and _keys_within(problem, FWD_PAIRED_CAUSAL_SEQLEN_K.get(fwd_pair(problem)))


def fwd_run(problem) -> bool:
    """Whether a forward program runs a run of FWD_RUN_TILES query blocks (FWD_RUN_SEQLEN_K: calls without a mask)."""
    lengths = FWD_RUN_SEQLEN_K.get((fwd_pair(problem), problem.kv_group_size > 1))
    return problem.unmasked and _keys_within(problem, lengths)


def _fwd_tiles(problem) -> int:
    """The query blocks a forward program runs."""
    return 2 if fwd_paired(problem) else FWD_RUN_TILES[fwd_pair(problem)] if fwd_run(problem) else 1


def _fwd_rows(problem) -> int:
    """The query rows a forward program runs: its tiles' rows."""
    return FWD_TILES[fwd_pair(problem)].block_m * _fwd_tiles(problem)


def _programs(problem) -> int:
    blocks = -(-problem.seqlen_q // _fwd_rows(problem))
    return blocks * problem.heads_q * problem.batch


def _bwd_strategy(problem) -> str:
    return DQ_ORDERED if problem.deterministic else DQ_ATOMIC


def _bwd_programs(problem, tiles=1) -> int:
    """The dK/dV programs: one per `tiles` key blocks of a (key head, batch entry), or of a (query head, batch
    entry) where bwd_heads holds."""
    block_n = BWD_TILES[bwd_pair(problem)].block_n * tiles
    heads = problem.heads_q if bwd_heads(problem) else problem.heads_k
    return -(-problem.seqlen_k // block_n) * heads * problem.batch


def _bwd_tiles(problem) -> int:
    """Key blocks a dK/dV program runs: the ORDERED form one a ticket, the atomic one BWD_TILES_PER_PROGRAM.
    The workspace's descriptor count and the launch's grid both come from it."""
    return 1 if problem.deterministic else BWD_TILES_PER_PROGRAM[bwd_pair(problem)]


def bwd_heads(problem) -> bool:
    """Whether an atomic (non-deterministic) GQA call's dK/dV runs a program per query head
    (BWD_HEADS_GQA_SEQLEN_K)."""
    lengths = BWD_HEADS_GQA_SEQLEN_K.get((bwd_pair(problem), problem.causal))
    return not problem.deterministic and problem.kv_group_size > 1 and _keys_within(problem, lengths)


def _key_rows_shape(problem, per_row) -> tuple:
    """fp32 workspace shaped like k's rows: [B, Sk, Hk, per_row] or [total_k, Hk, per_row]."""
    lead = (problem.total_k,) if problem.varlen else (problem.batch, problem.seqlen_k)
    return lead + (problem.heads_k, per_row)


def bwd_workspace(problem) -> Workspace:
    """The workspace of a backward the v3 family serves: the portable atomic or ordered strategy's
    regions (Delta, Lse2, the zeroed fp32 dQ accumulator; for ORDERED the zeroed order region at this
    tile's query blocks), one region for the dK/dV programs' descriptors, then the padding
    buffers."""
    pair = bwd_pair(problem)
    strategy = _bwd_strategy(problem)
    order = [dq_order_region(problem, BWD_TILES[pair].block_m)] if strategy == DQ_ORDERED else []
    function = "fmha_bwd_dkdv_ordered" if strategy == DQ_ORDERED else "fmha_bwd_dkdv"
    descriptors = _descriptor_region(bwd_global_scratch(function, pair) * _bwd_programs(problem, _bwd_tiles(problem)),
                                     problem)
    # programs of one query head add dK and dV into zeroed fp32 accumulators: 2 / (group size) of dQ's
    accumulators = [(f"{name}_acc", _key_rows_shape(problem, padded_head_dim(dim)), True, "fp32")
                    for name, dim in (("dk", problem.head_dim_qk), ("dv", problem.head_dim_v))] if bwd_heads(problem) else []
    return backward_workspace(problem, strategy, order + accumulators + descriptors)


def plan_bwd(problem, operands) -> list:
    """The launches of a backward the v3 family serves: pre-pass, dK/dV adding into the fp32 dQ
    accumulator (ATOMIC, or ORDERED for a deterministic call), conversion of dQ, with this family's
    kernels; operands as backward.py describes them, with the regions of bwd_workspace."""
    if not has_work(problem):
        return []
    pair = bwd_pair(problem)
    workspace = bwd_workspace(problem)
    args = backward.BackwardArgs(problem, operands, workspace)
    scratch = {"global_scratch": operands.region(DESCRIPTOR_REGION)}
    if workspace.dq_strategy == DQ_ORDERED:
        # a program per item; FMHA_RT_BWD_PROGRAMS=P launches them in waves of P (the ticket goes on across
        # launches), so that at most P run at once
        items = _bwd_programs(problem)
        wave = backward.forced_programs() or items
        key = dkdv_key(problem.dtype, pair, DQ_ORDERED)
        main = [backward.dkdv_ordered(args, key, min(wave, items - first), scratch) for first in range(0, items, wave)]
    else:
        keys = BWD_TILES[pair].block_n * _bwd_tiles(problem)  # a program's keys
        if bwd_heads(problem):
            convert = dq_convert_key(problem.dtype, dq_tile(pair))  # the accumulators' widths are dQ's (BWD_HEADS_PAIRS)
            main = [backward.dkdv_heads(args, dkdv_heads_key(problem.dtype, pair), keys, scratch),
                    backward.dkdv_convert(args, convert, "dk"), backward.dkdv_convert(args, convert, "dv")]
        else:
            main = [backward.dkdv(args, dkdv_key(problem.dtype, pair), keys, scratch)]
    return [backward.preprocess(args, preprocess_key(problem.dtype, pair[1])), *main,
            backward.dq_convert(args, dq_convert_key(problem.dtype, dq_tile(pair)))]


def plan_fwd(problem, operands) -> list:
    """The launch of a forward the v3 family serves; operands as a portable forward's, plus the
    DESCRIPTOR_REGION of fwd_scratch in their regions."""
    if not has_work(problem):
        return []
    key = fwd_key(problem.dtype, fwd_pair(problem), fwd_paired(problem), fwd_run(problem))
    scratch = {"global_scratch": operands.region(DESCRIPTOR_REGION)}
    return [forward_launch(key, problem, operands, _fwd_rows(problem), scratch)]
