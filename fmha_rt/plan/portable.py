"""The portable (Triton) kernel family: which variants exist, and how one attention call maps onto them.

Pure Python: importable without Triton, a GPU or NumPy. Two consumers:
- the AOT build (`variants(arch)`): every variant to compile, with its Triton signature, constexprs,
  launch options and traits;
- the runtime (`plan_fwd`, `plan_bwd`, `plan_dropout_mask`, `bwd_workspace`): the ordered launches of
  one call, each a variant key, a grid and the value of every runtime argument.

Pointer arguments take whatever objects the caller put in `tensors` (device addresses, arrays); an
unused pointer is None, which an executor passes as a null pointer (or a dummy array when
interpreting). Strides are explicit ints in `tensors` under '<name>_strides', in elements.

Head dims run in power-of-two tiles (32, 64, 128, 256: Triton block shapes are powers of two, so 96 runs
in the 128 tile and 192 in the 256 tile), with (256, 128) for the (192, 128) query/value pair. Kernels
take head dims in units of 8 (so their column masks allow 16-byte loads): plan_fwd and plan_bwd run a
head dim that is not a multiple of 8 as `padded_head_dim(d)` on tensors of that width, and
`plan_head_padding` gives the copies around them: the caller's q, k, v (and out, dout) into zero-padded
scratch buffers before, the padded outputs back into the caller's [.., d] arrays after (forward
scratch: `fwd_scratch`; backward: regions of `bwd_workspace`).
"""
import math
from dataclasses import dataclass

from fmha_rt.errors import FmhaNotImplementedError, FmhaValueError

# Bias kinds: the BIAS_KIND constexpr of every kernel that adds a score term.
BIAS_NONE, BIAS_TENSOR, BIAS_ALIBI = 0, 1, 2
BIAS_KIND_NAMES = {BIAS_NONE: "nobias", BIAS_TENSOR: "bias", BIAS_ALIBI: "alibi"}

BUILD_ARCHS = ("sm_90", "gfx942", "gfx950")
# Not a build target: small tiles that give many blocks on tiny problems under TRITON_INTERPRET=1.
INTERPRET_ARCH = "interpret"
DTYPES = ("fp16", "bf16")
HEAD_DIM_TILES = (32, 64, 128, 256)
# (query/key tile, value tile) pairs that have kernels.
HEAD_DIM_PAIRS = ((32, 32), (64, 64), (128, 128), (256, 256), (256, 128))
DQ_ATOMIC, DQ_DETERMINISTIC, DQ_FUSED, DQ_SINGLE = "atomic", "deterministic", "fused", "single"
WORKSPACE_ALIGN = 256
MAX_GRID_YZ = 65535
KERNEL_MODULES = {"fwd": "kernels.portable.fmha_fwd", "bwd": "kernels.portable.fmha_bwd",
                  "pad": "kernels.portable.fmha_pad"}

# ------------------------------------------------------------------------------------- signatures


def _signature(spec: str) -> dict:
    """'name type, name type, ...' -> ordered {name: type}; 'T' stands for the element type."""
    pairs = (item.split() for item in spec.replace("\n", " ").split(",") if item.strip())
    return {name: kind for name, kind in pairs}


def _strides(*tensors: str) -> str:
    """Batch and head strides are i64 (they can pass 2**31); row strides are i32 (one tile of rows
    times a row stride stays below 2**31)."""
    return ", ".join(f"stride_{t}_b i64, stride_{t}_s i32, stride_{t}_h i64" for t in tensors)


_VARLEN_PTRS = "CuSeqlensQ *i32, CuSeqlensK *i32, SeqstartQ *i32, SeqstartK *i32"
_SHAPE_ARGS = ("seqlen_q i32, seqlen_k i32, num_heads_q i32, kv_group_size i32, head_dim_qk_div8 i32, "
               "head_dim_v_div8 i32")
_MASK_ARGS = "window_left i32, window_right i32, bottom_right i32, is_varlen i32, has_seqstart i32"
_DROPOUT_ARGS = "drop_threshold i64, drop_scale fp32, philox_seed i64, philox_offset i64, philox_from_ptr i32"
_BIAS_STRIDES = "stride_bias_b i64, stride_bias_h i64, stride_bias_s i32, alibi_stride_b i32"
_TILE = "BLOCK_M constexpr, BLOCK_N constexpr, BLOCK_DQK constexpr, BLOCK_DV constexpr"

SIGNATURES = {
    "fmha_fwd": _signature(f"""
        Q *T, K *T, V *T, Out *T, Lse *fp32, Bias *T, Alibi *fp32, PhiloxSeedOffset *i64, {_VARLEN_PTRS},
        {_strides("q", "k", "v", "o")}, lse_stride_b i64, lse_stride_h i64, {_BIAS_STRIDES}, {_SHAPE_ARGS},
        scale_log2 fp32, {_MASK_ARGS}, {_DROPOUT_ARGS},
        {_TILE}, BIAS_KIND constexpr, DROPOUT constexpr"""),
    "fmha_dropout_mask": _signature("""
        Mask *u8, PhiloxSeedOffset *i64, mask_stride_b i64, mask_stride_h i64, mask_stride_s i32,
        seqlen_q i32, seqlen_k i32, num_heads_q i32, drop_threshold i64, philox_seed i64, philox_offset i64,
        philox_from_ptr i32, BLOCK_M constexpr, BLOCK_N constexpr"""),
    "fmha_bwd_preprocess": _signature(f"""
        Out *T, dO *T, Lse *fp32, Delta *fp32, Lse2 *fp32, CuSeqlensQ *i32, SeqstartQ *i32, {_strides("o", "do")},
        lse_stride_b i64, lse_stride_h i64, stride_delta_b i64, stride_delta_h i64, seqlen_q i32,
        head_dim_v_div8 i32, is_varlen i32, has_seqstart i32, BLOCK_M constexpr, BLOCK_DV constexpr"""),
    "fmha_bwd_dkdv": _signature(f"""
        Q *T, K *T, V *T, dO *T, Lse2 *fp32, Delta *fp32, dK *T, dV *T, DqAcc *fp32, Bias *T, dS *fp32,
        Alibi *fp32, PhiloxSeedOffset *i64, {_VARLEN_PTRS},
        {_strides("q", "k", "v", "do", "dk", "dv", "dqacc")},
        stride_ds_b i64, stride_ds_h i64, stride_ds_s i32,
        stride_delta_b i64, stride_delta_h i64, {_BIAS_STRIDES},
        {_SHAPE_ARGS}, softmax_scale fp32, scale_log2 fp32, {_MASK_ARGS}, write_dbias i32, {_DROPOUT_ARGS},
        {_TILE}, BIAS_KIND constexpr, DROPOUT constexpr, DQ_ATOMIC constexpr, FLAT_LOOP constexpr,
        GROUP_LOOP constexpr, DP_FIRST constexpr"""),
    "fmha_bwd_dq": _signature(f"""
        Q *T, K *T, V *T, Out *T, dO *T, Lse *fp32, Delta *fp32, Lse2 *fp32, dQ *T, Bias *T, Alibi *fp32,
        PhiloxSeedOffset *i64, {_VARLEN_PTRS}, {_strides("q", "k", "v", "o", "do", "dq")},
        lse_stride_b i64, lse_stride_h i64, stride_delta_b i64, stride_delta_h i64, {_BIAS_STRIDES},
        {_SHAPE_ARGS}, softmax_scale fp32, scale_log2 fp32, {_MASK_ARGS}, {_DROPOUT_ARGS},
        {_TILE}, BIAS_KIND constexpr, DROPOUT constexpr"""),
    "fmha_bwd_fused": _signature(f"""
        Q *T, K *T, V *T, Out *T, dO *T, Lse *fp32, Delta *fp32, Lse2 *fp32, dQ *T, dK *T, dV *T, Bias *T,
        dS *fp32, Alibi *fp32, PhiloxSeedOffset *i64, {_VARLEN_PTRS},
        {_strides("q", "k", "v", "o", "do", "dq", "dk", "dv")}, stride_ds_b i64, stride_ds_h i64, stride_ds_s i32,
        lse_stride_b i64, lse_stride_h i64, stride_delta_b i64, stride_delta_h i64, {_BIAS_STRIDES},
        {_SHAPE_ARGS}, softmax_scale fp32, scale_log2 fp32, {_MASK_ARGS}, write_dbias i32, {_DROPOUT_ARGS},
        BLOCK_M1 constexpr, BLOCK_N1 constexpr, BLOCK_M2 constexpr, BLOCK_N2 constexpr, BLOCK_DQK constexpr,
        BLOCK_DV constexpr, BIAS_KIND constexpr, DROPOUT constexpr, GROUP_LOOP constexpr,
        DELTA_INLINE constexpr"""),
    "fmha_bwd_dq_convert": _signature(f"""
        DqAcc *fp32, dQ *T, CuSeqlensQ *i32, SeqstartQ *i32, {_strides("dqacc", "dq")},
        seqlen_q i32, head_dim_qk_div8 i32, softmax_scale fp32, is_varlen i32, has_seqstart i32,
        BLOCK_M constexpr, BLOCK_DQK constexpr"""),
    "fmha_bwd_dbias": _signature("""
        dS *fp32, dBias *T, stride_ds_b i64, stride_ds_h i64, stride_ds_s i32,
        stride_dbias_b i64, stride_dbias_h i64, stride_dbias_s i32, seqlen_q i32, seqlen_k i32,
        reduce_batch i32, reduce_heads i32, BLOCK_M constexpr, BLOCK_N constexpr"""),
    # The caller's side of a padding copy carries no alignment promise: an Unaligned* pointer and
    # pitch_* strides (kernels/portable/fmha_pad.py).
    "fmha_pad": _signature("""
        UnalignedArray *T, Padded *T, CuSeqlens *i32, Seqstart *i32, pitch_b i64, pitch_s i64, pitch_h i64,
        stride_padded_b i64, stride_padded_s i64, seqlen i32, num_heads i32, head_dim i32,
        padded_dim_div8 i32, is_varlen i32, has_seqstart i32, BLOCK_R constexpr, NARROW_MAX constexpr,
        NARROW_COLUMNS constexpr, WIDE_ROWS constexpr, WIDE_COLUMNS constexpr, WIDEN constexpr"""),
}
KERNEL_SOURCE = {
    "fmha_fwd": "fwd", "fmha_dropout_mask": "fwd", "fmha_bwd_preprocess": "bwd", "fmha_bwd_dkdv": "bwd",
    "fmha_bwd_dq": "bwd", "fmha_bwd_fused": "bwd", "fmha_bwd_dq_convert": "bwd", "fmha_bwd_dbias": "bwd", "fmha_pad": "pad",
}

# -------------------------------------------------------------------------------------- tile configs


@dataclass(frozen=True)
class Tile:
    block_m: int  # query rows per tile
    block_n: int  # key rows per tile
    num_warps: int
    num_stages: int


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
ROWS_TILE = Tile(64, 0, 4, 1)  # preprocess, dq_convert
DBIAS_TILE = Tile(32, 64, 4, 1)
MASK_TILE = Tile(32, 64, 4, 1)
# Padding copies: 256 (row, head) pairs per program, moved in [256, 8] steps where the padded width is
# at most 32 and in [128, 32] steps otherwise. H200, bf16, B*S = 8k, H = 16, GPU time of a forward's
# copies: d = 5 36 -> 14 us and d = 13 37 -> 22 us against [128, 32] steps throughout; d = 100 141 us
# ([64, 64] steps: 175 us).
PAD_TILE = Tile(256, 0, 4, 1)
PAD_CONSTEXPRS = {"BLOCK_R": PAD_TILE.block_m, "NARROW_MAX": 32, "NARROW_COLUMNS": 8, "WIDE_ROWS": 128,
                  "WIDE_COLUMNS": 32}
# Which dQ strategy a non-deterministic problem gets on each arch, and which strategies are built.
# On the H200 the deterministic dQ kernel was never slower than fp32 atomics (NOTES.md: 301 vs 294
# TFLOP/s dense, 224 vs 188 GQA causal at S=4k, D=128), so the shipped archs build only it; the
# atomic path stays for the interpreter tests and for archs where it measures faster.
DEFAULT_DQ_STRATEGY = {"sm_90": DQ_DETERMINISTIC, "gfx942": DQ_DETERMINISTIC, "gfx950": DQ_DETERMINISTIC,
                       INTERPRET_ARCH: DQ_ATOMIC}
BUILT_DQ_STRATEGIES = {"sm_90": (DQ_DETERMINISTIC,), "gfx942": (DQ_DETERMINISTIC,), "gfx950": (DQ_DETERMINISTIC,),
                       INTERPRET_ARCH: (DQ_ATOMIC, DQ_DETERMINISTIC)}


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


def pair_name(dqk, dv):
    return f"d{dqk}" if dqk == dv else f"d{dqk}v{dv}"


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


def pad_key(dtype, widen):
    """The copy into a zero-padded buffer (widen) or out of one (narrow)."""
    return f"fmha_pad_{'widen' if widen else 'narrow'}_{dtype}"


DROPOUT_MASK_KEY = "fmha_dropout_mask"


def make_variant(key, function, dtype, tile, constexprs, traits, module=None):
    """A variant of `function` (a SIGNATURES name) in the form variants() lists; `module` the source's
    (default: the portable family's module of that function)."""
    signature = {name: (f"*{dtype}" if kind == "*T" else kind) for name, kind in SIGNATURES[function].items()}
    return {
        "key": key, "module": module or KERNEL_MODULES[KERNEL_SOURCE[function]], "function": function,
        "signature": signature, "constexprs": constexprs, "num_warps": tile.num_warps,
        "num_stages": tile.num_stages, "traits": dict(traits, dtype=dtype),
    }


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
            out.append(make_variant(dkdv_key(dtype, pair, bias_kind, dropout, strategy, single_head), "fmha_bwd_dkdv",
                                    dtype, tile, dict(constexprs, DQ_ATOMIC=strategy == DQ_ATOMIC,
                                                      FLAT_LOOP=pair in DKDV_FLAT_LOOP.get(arch, ()),
                                                      GROUP_LOOP=not single_head,
                                                      DP_FIRST=(pair in DKDV_DP_FIRST.get(arch, ())
                                                                and bias_kind == BIAS_NONE and not dropout),
                                                      **features),
                                    dict(traits, dq_strategy=strategy, deterministic=strategy == DQ_DETERMINISTIC,
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
        for d in HEAD_DIM_TILES:
            rows = {"BLOCK_M": ROWS_TILE.block_m}
            if DQ_ATOMIC in BUILT_DQ_STRATEGIES[arch] or any(p[1] == d for p in FUSED_TILES.get(arch, {})):
                # the two-kernel strategy's dQ kernel computes Delta and Lse2 itself
                out.append(make_variant(preprocess_key(dtype, d), "fmha_bwd_preprocess", dtype, ROWS_TILE,
                                        dict(rows, BLOCK_DV=d), {"pass": "bwd_pre", "head_dim_v_tile": d,
                                                                 "block_m": ROWS_TILE.block_m}))
            if DQ_ATOMIC in BUILT_DQ_STRATEGIES[arch]:
                out.append(make_variant(dq_convert_key(dtype, d), "fmha_bwd_dq_convert", dtype, ROWS_TILE,
                                        dict(rows, BLOCK_DQK=d), {"pass": "bwd_post", "head_dim_qk_tile": d,
                                                                  "block_m": ROWS_TILE.block_m,
                                                                  "dq_strategy": DQ_ATOMIC}))
        out.append(make_variant(dbias_key(dtype), "fmha_bwd_dbias", dtype, DBIAS_TILE,
                                {"BLOCK_M": DBIAS_TILE.block_m, "BLOCK_N": DBIAS_TILE.block_n},
                                {"pass": "bwd_dbias", "block_m": DBIAS_TILE.block_m, "block_n": DBIAS_TILE.block_n,
                                 "deterministic": True}))
        for widen in (True, False):
            out.append(make_variant(pad_key(dtype, widen), "fmha_pad", dtype, PAD_TILE,
                                    dict(PAD_CONSTEXPRS, WIDEN=widen),
                                    {"pass": "pad_widen" if widen else "pad_narrow", "block_m": PAD_TILE.block_m}))
    mask = make_variant(DROPOUT_MASK_KEY, "fmha_dropout_mask", "u8", MASK_TILE,
                        {"BLOCK_M": MASK_TILE.block_m, "BLOCK_N": MASK_TILE.block_n},
                        {"pass": "dropout_mask", "block_m": MASK_TILE.block_m, "block_n": MASK_TILE.block_n})
    out.append(mask)
    return out


def variant_map(arch: str) -> dict:
    """{key: variant} for `arch`."""
    return {v["key"]: v for v in variants(arch)}


# ------------------------------------------------------------------------------------------ planning


@dataclass(frozen=True)
class Launch:
    """One kernel launch: the variant key, the grid and every runtime argument by name."""

    variant: str
    grid: tuple
    args: dict


@dataclass(frozen=True)
class WorkspaceRegion:
    name: str
    offset: int  # bytes from the workspace start, a multiple of WORKSPACE_ALIGN
    nbytes: int
    zero_init: bool  # must hold zeros when the backward starts
    shape: tuple  # elements of dtype, C-contiguous
    dtype: str = "fp32"


@dataclass(frozen=True)
class Scratch:
    """One scratch buffer carved into regions: the forward's padding scratch, or the backward's workspace."""

    regions: tuple
    total_bytes: int

    @property
    def needs_zeroing(self) -> bool:
        return any(r.zero_init for r in self.regions)

    def region(self, name):
        for r in self.regions:
            if r.name == name:
                return r
        raise KeyError(name)


@dataclass(frozen=True)
class Workspace(Scratch):
    dq_strategy: str
    dq_splits: int  # fp32 dQ partial buffers (0: dQ is written directly in its dtype)


def ceil8(n: int) -> int:
    """n rounded up to a multiple of 8."""
    return -(-n // 8) * 8


def padded_head_dim(d: int) -> int:
    """The width a head dim of d runs at: the next multiple of 8."""
    return ceil8(d)


def head_dim_tiles(problem) -> tuple:
    """(query/key tile, value tile) of the kernels that serve `problem`: the smallest tiles that hold
    both head dims; a pair without its own kernels runs in the square tile of the wider one."""
    tile = lambda d: next(t for t in HEAD_DIM_TILES if t >= d)  # noqa: E731
    pair = (tile(problem.head_dim_qk), tile(problem.head_dim_v))
    return pair if pair in HEAD_DIM_PAIRS else (max(pair), max(pair))


def philox_counters(problem) -> int:
    """Philox counters one call consumes: advance the offset by this much between calls."""
    return problem.batch * problem.heads_q * problem.seqlen_q * -(-problem.seqlen_k // 4)


def dropout_threshold(p: float) -> int:
    """uint32 draws below this are dropped: keep probability 1 - threshold / 2**32."""
    return min(round(p * 2 ** 32), 2 ** 32 - 1)


def dq_strategy(problem, arch, requested=None) -> str:
    """`requested` when given (FUSED, SINGLE or DETERMINISTIC for a deterministic problem); else SINGLE where
    it is built for the problem and the problem has at most SINGLE_MAX_SCORES score elements, FUSED where
    it is built and the keys reach FUSED_MIN_SEQLEN_K (both deterministic too), DETERMINISTIC when the
    problem asks for it, or the arch's default."""
    if requested not in (None, DQ_ATOMIC, DQ_DETERMINISTIC, DQ_FUSED, DQ_SINGLE):
        raise FmhaValueError(f"dq strategy must be {DQ_ATOMIC!r}, {DQ_DETERMINISTIC!r}, {DQ_FUSED!r} or "
                             f"{DQ_SINGLE!r}, got {requested!r}")
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
    if requested is None and fused and problem.seqlen_k >= FUSED_MIN_SEQLEN_K:
        return DQ_FUSED
    if problem.deterministic:
        if requested == DQ_ATOMIC:
            raise FmhaValueError("a deterministic backward cannot use the atomic dQ strategy")
        return DQ_DETERMINISTIC
    _arch_tiles(arch)
    strategy = requested or DEFAULT_DQ_STRATEGY[arch]
    if strategy not in BUILT_DQ_STRATEGIES[arch]:
        raise FmhaNotImplementedError(f"the {strategy} dQ strategy is not built for {arch} "
                                      f"(built: {', '.join(BUILT_DQ_STRATEGIES[arch])})")
    return strategy


def _rows_shape(problem, per_row):
    """fp32 workspace shaped like q's rows: [B, Sq, Hq, per_row] or [total_q, Hq, per_row]."""
    lead = (problem.total_q,) if problem.varlen else (problem.batch, problem.seqlen_q)
    return lead + (problem.heads_q, per_row)


def _delta_shape(problem):
    """Per-row statistics: [B, Hq, ceil8(Sq)], or [Hq, ceil8(total_q) + 8 * B] in varlen mode, where sequence b
    starts at row 8 * (q_start // 8 + b) (the kernels' row_stats_start): every sequence starts at a multiple
    of 8 rows, so that the kernels' loads of a block's rows vectorise."""
    if problem.varlen:
        return (problem.heads_q, ceil8(problem.total_q) + 8 * problem.batch)
    return (problem.batch, problem.heads_q, ceil8(problem.seqlen_q))


def _ds_shape(problem):
    """dS of the bias gradient, rows padded to 8 keys: [B, Hq, Sq, ceil8(Sk)]."""
    return (problem.batch, problem.heads_q, problem.seqlen_q, ceil8(problem.seqlen_k))


ELEMENT_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}


def carve(wanted):
    """(name, shape, zero_init, dtype) -> (regions at WORKSPACE_ALIGN-aligned offsets, total bytes)."""
    regions, offset = [], 0
    for name, shape, zero, dtype in wanted:
        nbytes = ELEMENT_BYTES[dtype] * math.prod(shape)
        regions.append(WorkspaceRegion(name, offset, nbytes, zero, shape, dtype))
        offset += -(-nbytes // WORKSPACE_ALIGN) * WORKSPACE_ALIGN
    return tuple(regions), offset


def bwd_workspace(problem, arch, dq_strategy_request=None) -> Workspace:
    """Workspace of plan_bwd and plan_head_padding: regions at 256-byte aligned offsets.

    fp32: delta and lse2 [B, Hq, ceil8(Sq)] (Delta = rowsum(dO * O) and the LSE in the log2 domain, which the
    first pass writes for dK/dV; every strategy but SINGLE, whose programs keep their own; _delta_shape), dq_acc
    [B, Sq, Hq, ceil8(Dqk)] (ATOMIC strategy, zeroed),
    ds [B, Hq, Sq, ceil8(Sk)] (tensor bias with gradient, zeroed: masked blocks are never written).
    Then, in the problem's dtype, one '<name>_padded' buffer per tensor of padded_tensors(problem,
    'bwd') (head dims that are not multiples of 8).
    """
    return workspace_for(problem, dq_strategy(problem, arch, dq_strategy_request))


def workspace_for(problem, strategy, extra=()) -> Workspace:
    """bwd_workspace's layout for `strategy`, whether or not this family builds it (the v3 family runs the
    atomic strategy with kernels of its own), with `extra` regions (name, shape, zero_init, dtype) after
    the strategy's and before the padding buffers."""
    wanted = []
    if strategy != DQ_SINGLE:
        wanted += [("delta", _delta_shape(problem), False, "fp32"), ("lse2", _delta_shape(problem), False, "fp32")]
    if strategy == DQ_ATOMIC:
        wanted.append(("dq_acc", _rows_shape(problem, padded_head_dim(problem.head_dim_qk)), True, "fp32"))
    if problem.bias_grad:
        wanted.append(("ds", _ds_shape(problem), True, "fp32"))
    wanted += list(extra)
    wanted += padding_regions(problem, "bwd")
    regions, total = carve(wanted)
    return Workspace(regions, total, strategy, 1 if strategy == DQ_ATOMIC else 0)


# ------------------------------------------------------------------------------ head-dim padding


@dataclass(frozen=True)
class PaddedTensor:
    """A tensors entry that the attention kernels read or write at the padded head dim."""

    name: str  # the entry it stands in for: 'q', 'dout', 'dk', ...
    head_dim: int
    side: str  # 'q': rows and heads of q (Sq, Hq); 'k': of k and v (Sk, Hk)
    is_output: bool  # written by the attention kernels, then narrowed into the caller's array

    @property
    def region(self) -> str:
        return f"{self.name}_padded"


# (name, head dim 'qk' or 'v', side, is_output) of every tensor a pass reads or writes at its head dim.
_HEAD_DIM_TENSORS = {
    "fwd": (("q", "qk", "q", False), ("k", "qk", "k", False), ("v", "v", "k", False), ("out", "v", "q", True)),
    "bwd": (("q", "qk", "q", False), ("k", "qk", "k", False), ("v", "v", "k", False), ("out", "v", "q", False),
            ("dout", "v", "q", False), ("dq", "qk", "q", True), ("dk", "qk", "k", True), ("dv", "v", "k", True)),
}


def padded_tensors(problem, pass_name) -> list[PaddedTensor]:
    """The tensors of pass 'fwd' or 'bwd' whose head dim is not a multiple of 8 (q, k, dq, dk follow
    Dqk; v, out, dout, dv follow Dv): these run on zero-padded copies."""
    if pass_name not in _HEAD_DIM_TENSORS:
        raise FmhaValueError(f"pass_name must be 'fwd' or 'bwd', got {pass_name!r}")
    dims = {"qk": problem.head_dim_qk, "v": problem.head_dim_v}
    return [PaddedTensor(name, dims[dim], side, is_output)
            for name, dim, side, is_output in _HEAD_DIM_TENSORS[pass_name] if dims[dim] % 8]


def _padded_shape(problem, t):
    """[B, S, H, Dp] (varlen: [total, H, Dp]) with the rows and heads of t's side."""
    q_side = t.side == "q"
    heads = problem.heads_q if q_side else problem.heads_k
    if problem.varlen:
        lead = (problem.total_q if q_side else problem.total_k,)
    else:
        lead = (problem.batch, problem.seqlen_q if q_side else problem.seqlen_k)
    return lead + (heads, padded_head_dim(t.head_dim))


def padding_regions(problem, pass_name):
    return [(t.region, _padded_shape(problem, t), False, problem.dtype) for t in padded_tensors(problem, pass_name)]


def fwd_scratch(problem, extra=()) -> Scratch:
    """Scratch memory of a forward: one '<name>_padded' region per tensor of padded_tensors(problem,
    'fwd'), then the `extra` regions (name, shape, zero_init, dtype) a family's kernels take; no regions
    (0 bytes) when both head dims are multiples of 8 and there is no extra. Nothing needs zeroing."""
    return Scratch(*carve(padding_regions(problem, "fwd") + list(extra)))


def plan_head_padding(problem, arch, tensors, pass_name) -> tuple[list, list, dict]:
    """(before, after, substitutes) around plan_fwd ('fwd') or plan_bwd ('bwd').

    tensors: the call's tensors (caller's arrays with their strides, cu_seqlens/seqstarts in varlen
    mode) plus one '<name>_padded' entry per padded tensor (a region of fwd_scratch or bwd_workspace).
    `before` widens the inputs into their buffers, `after` narrows the outputs back into the caller's
    arrays; `substitutes` are the tensors entries (buffers and their strides) that the attention plan
    takes in place of the caller's arrays. All empty when both head dims are multiples of 8.
    """
    _arch_tiles(arch)
    before, after, substitutes = [], [], {}
    a = Args(problem, tensors)
    varlen = a.varlen()
    for t in padded_tensors(problem, pass_name):
        q_side = t.side == "q"
        shape = _padded_shape(problem, t)
        padded_strides = _contiguous_strides(shape)
        substitutes[t.name] = a.required(t.region)
        substitutes[f"{t.name}_strides"] = padded_strides
        if problem.varlen:
            (pitch_s, pitch_h, _), pitch_b = a._given_strides(t.name, 3), 0
            stride_padded_b, stride_padded_s = 0, padded_strides[0]
        else:
            pitch_b, pitch_s, pitch_h, _ = a._given_strides(t.name, 4)
            stride_padded_b, stride_padded_s = padded_strides[:2]
        seqlen, heads = (problem.seqlen_q, problem.heads_q) if q_side else (problem.seqlen_k, problem.heads_k)
        args = {"UnalignedArray": a.required(t.name), "Padded": substitutes[t.name],
                "CuSeqlens": varlen["CuSeqlensQ" if q_side else "CuSeqlensK"],
                "Seqstart": varlen["SeqstartQ" if q_side else "SeqstartK"],
                "pitch_b": pitch_b, "pitch_s": pitch_s, "pitch_h": pitch_h,
                "stride_padded_b": stride_padded_b, "stride_padded_s": stride_padded_s,
                "seqlen": seqlen, "num_heads": heads, "head_dim": t.head_dim,
                "padded_dim_div8": padded_head_dim(t.head_dim) // 8,
                "is_varlen": varlen["is_varlen"], "has_seqstart": varlen["has_seqstart"]}
        blocks = _cdiv(seqlen * heads, PAD_TILE.block_m)
        if not (has_work(problem) and blocks):
            continue
        if blocks >= 2 ** 31 or problem.batch > MAX_GRID_YZ:
            raise FmhaNotImplementedError(f"{t.name}: {seqlen} rows x {heads} heads in {problem.batch} sequences "
                                          "exceed the grid of the padding copy")
        key = pad_key(problem.dtype, not t.is_output)
        launch = Launch(key, (blocks, problem.batch, 1), ordered(key, "fmha_pad", args))
        (after if t.is_output else before).append(launch)
    return before, after, substitutes


def _contiguous_strides(shape):
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= n
    return tuple(reversed(strides))


def _cdiv(a, b):
    return -(-a // b)


class Args:
    """Builds the runtime argument dict of one launch from the call's tensors and strides."""

    def __init__(self, problem, tensors):
        self.problem = problem
        self.tensors = tensors

    def ptr(self, name):
        return self.tensors.get(name)

    def required(self, name):
        if self.tensors.get(name) is None:
            raise FmhaValueError(f"tensors[{name!r}] is required for this call")
        return self.tensors[name]

    def _given_strides(self, name, rank):
        strides = self.tensors.get(f"{name}_strides")
        if strides is None or len(strides) != rank:
            raise FmhaValueError(f"tensors[{name + '_strides'!r}] must list {rank} strides, got {strides!r}")
        strides = tuple(int(s) for s in strides)
        if strides[-1] != 1:
            raise FmhaValueError(f"{name} must be contiguous in its last dim, got strides {strides}")
        return strides

    def rows(self, name, arg):
        """Batch/row/head strides of a [B, S, H, D] (or varlen [T, H, D]) tensor, as stride_<arg>_*."""
        if self.problem.varlen:
            s, h, _ = self._given_strides(name, 3)
            b = 0
        else:
            b, s, h, _ = self._given_strides(name, 4)
        return self.checked_strides({f"stride_{arg}_b": b, f"stride_{arg}_s": s, f"stride_{arg}_h": h}, name)

    @staticmethod
    def checked_strides(strides, name):
        for arg, value in strides.items():
            if value % 8:
                raise FmhaValueError(f"{name}: stride {value} ({arg}) must be a multiple of 8 elements; pad or copy "
                                     "the tensor so that every stride but the last is a multiple of 8")
            limit = 2 ** 31 if arg.endswith("_s") else 2 ** 63
            if not -limit <= value < limit:
                raise FmhaValueError(f"{name}: stride {value} ({arg}) is out of range")
        return strides

    def lse_like(self, name, prefix):
        """[B, Hq, Sq] (or varlen [Hq, total_q]) fp32 strides as <prefix>_stride_b/_h."""
        if self.problem.varlen:
            h, _ = self._given_strides(name, 2)
            b = 0
        else:
            b, h, _ = self._given_strides(name, 3)
        return {f"{prefix}_stride_b": b, f"{prefix}_stride_h": h}

    def shape(self):
        p = self.problem
        return {"seqlen_q": p.seqlen_q, "seqlen_k": p.seqlen_k, "num_heads_q": p.heads_q,
                "kv_group_size": p.kv_group_size, "head_dim_qk_div8": padded_head_dim(p.head_dim_qk) // 8,
                "head_dim_v_div8": padded_head_dim(p.head_dim_v) // 8}

    def varlen(self):
        p = self.problem
        if not p.varlen:
            return {"CuSeqlensQ": None, "CuSeqlensK": None, "SeqstartQ": None, "SeqstartK": None,
                    "is_varlen": 0, "has_seqstart": 0}
        has_q, has_k = (self.tensors.get(n) is not None for n in ("seqstart_q", "seqstart_k"))
        if has_q != has_k:
            raise FmhaValueError("seqstart_q and seqstart_k must be given together")
        return {"CuSeqlensQ": self.required("cu_seqlens_q"), "CuSeqlensK": self.required("cu_seqlens_k"),
                "SeqstartQ": self.ptr("seqstart_q"), "SeqstartK": self.ptr("seqstart_k"),
                "is_varlen": 1, "has_seqstart": int(has_q)}

    def mask(self):
        p = self.problem
        return {"window_left": p.window_left, "window_right": p.window_right, "bottom_right": int(p.bottom_right)}

    def score_terms(self):
        """Bias and ALiBi pointers and strides (broadcast dims get stride 0)."""
        p = self.problem
        args = {"Bias": None, "Alibi": None, "stride_bias_b": 0, "stride_bias_h": 0, "stride_bias_s": 0,
                "alibi_stride_b": 0}
        if p.bias_shape is not None:
            b, h, s, _ = self._given_strides("bias", 4)
            args.update(self.checked_strides({"stride_bias_b": b if p.bias_shape[0] == "B" else 0,
                                              "stride_bias_h": h if p.bias_shape[1] == "H" else 0,
                                              "stride_bias_s": s}, "bias"))
            args["Bias"] = self.required("bias")
        if p.alibi is not None:
            args["Alibi"] = self.required("alibi")
            if p.alibi == "BH":
                args["alibi_stride_b"] = self._given_strides("alibi", 2)[0]
        return args

    def dropout(self):
        p = self.problem
        args = {"drop_threshold": 0, "drop_scale": 1.0, "philox_seed": 0, "philox_offset": 0,
                "PhiloxSeedOffset": None, "philox_from_ptr": 0}
        if p.has_dropout:
            args.update(drop_threshold=dropout_threshold(p.dropout_p), drop_scale=1.0 / (1.0 - p.dropout_p))
            args.update(self.philox())
        return args

    def philox(self):
        if self.tensors.get("philox_seed_offset") is not None:
            return {"PhiloxSeedOffset": self.tensors["philox_seed_offset"], "philox_from_ptr": 1,
                    "philox_seed": 0, "philox_offset": 0}
        seed, offset = self.tensors.get("philox_seed"), self.tensors.get("philox_offset", 0)
        if seed is None:
            raise FmhaValueError("dropout needs tensors['philox_seed'] (and 'philox_offset'), or "
                                 "tensors['philox_seed_offset'], a device pointer to two int64")
        return {"PhiloxSeedOffset": None, "philox_from_ptr": 0, "philox_seed": int(seed) % 2 ** 63,
                "philox_offset": int(offset)}


def launch_grid(blocks, problem):
    if problem.heads_q > MAX_GRID_YZ or problem.batch > MAX_GRID_YZ:
        raise FmhaNotImplementedError(f"heads ({problem.heads_q}) and batch ({problem.batch}) must be <= "
                                      f"{MAX_GRID_YZ} (grid limits)")
    return (blocks, problem.heads_q, problem.batch)


def problem_features(problem):
    if problem.bias_shape is not None:
        kind = BIAS_TENSOR
    elif problem.alibi is not None:
        kind = BIAS_ALIBI
    else:
        kind = BIAS_NONE
    return kind, problem.has_dropout


def has_work(problem):
    return problem.batch > 0 and problem.seqlen_q > 0


def plan_fwd(problem, arch, tensors) -> list:
    """Launches of the forward: fmha_fwd writing out [.., Hq, Dv] and lse (with the short-keys tile where
    short_fwd says so).

    tensors: q, k, v, out, lse (+ '<name>_strides'), optional bias, alibi, cu_seqlens_q/k, seqstart_q/k,
    and for dropout philox_seed and philox_offset (ints) or philox_seed_offset (device pointer).
    """
    pair = head_dim_tiles(problem)
    kind, dropout = problem_features(problem)
    short = short_fwd(problem, arch)
    tile = SHORT_FWD_TILES[arch][pair] if short else tile_for(arch, "fwd", pair, kind, dropout)
    if not has_work(problem):
        return []
    key = fwd_key(problem.dtype, pair, kind, dropout, short)
    args = ordered(key, "fmha_fwd", fwd_args(problem, tensors))
    return [Launch(key, launch_grid(_cdiv(problem.seqlen_q, tile.block_m), problem), args)]


def fwd_args(problem, tensors) -> dict:
    """The runtime arguments of fmha_fwd for `problem` (plan_fwd's tensors), by name."""
    a = Args(problem, tensors)
    args = {"Q": a.required("q"), "K": a.required("k"), "V": a.required("v"), "Out": a.required("out"),
            "Lse": a.required("lse")}
    args.update(a.score_terms())
    args.update(a.dropout())
    args.update(a.varlen())
    for name, arg in (("q", "q"), ("k", "k"), ("v", "v"), ("out", "o")):
        args.update(a.rows(name, arg))
    args.update(a.lse_like("lse", "lse"))
    args.update(a.shape())
    args.update(a.mask())
    args["scale_log2"] = problem.softmax_scale * math.log2(math.e)
    return args


def plan_dropout_mask(problem, arch, tensors) -> list:
    """Launch writing the dropout keep mask tensors['mask'] (uint8 [B, Hq, Sq, Sk], strides in
    'mask_strides'; Sq/Sk the maximum lengths in varlen mode) for the call's seed and offset."""
    if not problem.has_dropout:
        raise FmhaValueError("the problem has no dropout (dropout_p == 0)")
    _arch_tiles(arch)
    a = Args(problem, tensors)
    b, h, s, _ = a._given_strides("mask", 4)
    args = {"Mask": a.required("mask"), "mask_stride_b": b, "mask_stride_h": h, "mask_stride_s": s,
            "seqlen_q": problem.seqlen_q, "seqlen_k": problem.seqlen_k, "num_heads_q": problem.heads_q,
            "drop_threshold": dropout_threshold(problem.dropout_p)}
    args.update(a.philox())
    if not has_work(problem):
        return []
    return [Launch(DROPOUT_MASK_KEY, launch_grid(_cdiv(problem.seqlen_q, MASK_TILE.block_m), problem),
                   ordered(DROPOUT_MASK_KEY, "fmha_dropout_mask", args))]


@dataclass(frozen=True)
class AtomicKernels:
    """The kernels of the atomic strategy: the portable family's by default; the v3 family's backward
    gives its own dK/dV kernel (its keys block size and extra arguments, such as its global scratch)."""

    preprocess: str
    dkdv: str
    dkdv_block_n: int
    dkdv_extra: dict
    dq_convert: str


def plan_bwd(problem, arch, tensors, dq_strategy_request=None, *, workspace=None, atomic=None) -> list:
    """Launches of the backward, in order: dQ (which also writes Delta and Lse2), dK/dV, dbias for the
    deterministic strategy; preprocess (Delta), dK/dV with atomic dQ, dQ conversion, dbias for the atomic
    one; preprocess, the fused grid, dbias for the fused one; the fused grid alone for the single one.

    tensors: as plan_fwd plus dout, dq, dk, dv, optional dbias (+ strides), and one entry per region of
    bwd_workspace(problem, arch) named after it (delta, lse2, dq_acc, ds): the caller carves them out of one
    workspace buffer and zeroes the regions marked zero_init. `workspace` and `atomic`: a workspace laid
    out by workspace_for and the atomic strategy's kernels, for a family that runs that strategy itself.
    """
    pair = head_dim_tiles(problem)
    kind, dropout = problem_features(problem)
    workspace = workspace or bwd_workspace(problem, arch, dq_strategy_request)
    strategy = workspace.dq_strategy
    single_head = problem.heads_q == problem.heads_k and single_head_dkdv(arch, pair)
    if strategy == DQ_ATOMIC and atomic is None:
        atomic = AtomicKernels(preprocess_key(problem.dtype, pair[1]),
                               dkdv_key(problem.dtype, pair, kind, dropout, strategy, single_head),
                               tile_for(arch, "bwd_dkdv", pair, kind, dropout).block_n, {},
                               dq_convert_key(problem.dtype, pair[0]))
    if not has_work(problem):
        return []
    a = Args(problem, tensors)
    varlen, shape, mask = a.varlen(), a.shape(), a.mask()
    rows = {arg: a.rows(name, arg) for name, arg in (("q", "q"), ("k", "k"), ("v", "v"), ("out", "o"),
                                                      ("dout", "do"), ("dq", "dq"), ("dk", "dk"), ("dv", "dv"))}
    if strategy == DQ_SINGLE:  # its programs compute Delta and Lse2 and keep them: no workspace
        delta_args = {"Delta": None, "Lse2": None, "stride_delta_b": 0, "stride_delta_h": 0}
    else:
        delta_strides = _contiguous_strides(workspace.region("delta").shape)
        # lse2 has delta's shape, so one pair of strides serves both
        delta_args = {"Delta": a.required("delta"), "Lse2": a.required("lse2"),
                      "stride_delta_b": 0 if problem.varlen else delta_strides[0], "stride_delta_h": delta_strides[-2]}
    lse_args = dict(a.lse_like("lse", "lse"), Lse=a.required("lse"))
    launches = []

    attention = {"Q": a.required("q"), "K": a.required("k"), "V": a.required("v"), "dO": a.required("dout"),
                 **lse_args, **delta_args, **a.score_terms(), **a.dropout(), **varlen, **shape, **mask,
                 **rows["q"], **rows["k"], **rows["v"], **rows["do"],
                 "softmax_scale": problem.softmax_scale, "scale_log2": problem.softmax_scale * math.log2(math.e)}
    dqacc_args = {"DqAcc": None, "stride_dqacc_b": 0, "stride_dqacc_s": 0, "stride_dqacc_h": 0}
    if strategy == DQ_ATOMIC:
        acc = workspace.region("dq_acc")
        st = _contiguous_strides(acc.shape)
        b, s, h = (0, st[0], st[1]) if problem.varlen else st[:3]
        dqacc_args = {"DqAcc": a.required("dq_acc"), "stride_dqacc_b": b, "stride_dqacc_s": s, "stride_dqacc_h": h}
    ds_args = {"dS": None, "stride_ds_b": 0, "stride_ds_h": 0, "stride_ds_s": 0, "write_dbias": 0}
    if problem.bias_grad:
        st = _contiguous_strides(workspace.region("ds").shape)
        ds_args = {"dS": a.required("ds"), "stride_ds_b": st[0], "stride_ds_h": st[1], "stride_ds_s": st[2],
                   "write_dbias": 1}

    if strategy in (DQ_ATOMIC, DQ_FUSED):
        pre = {"Out": a.required("out"), "dO": a.required("dout"), "CuSeqlensQ": varlen["CuSeqlensQ"],
               "SeqstartQ": varlen["SeqstartQ"], **rows["o"], **rows["do"], **lse_args, **delta_args,
               "seqlen_q": problem.seqlen_q, "head_dim_v_div8": shape["head_dim_v_div8"],
               "is_varlen": varlen["is_varlen"], "has_seqstart": varlen["has_seqstart"]}
        key = atomic.preprocess if strategy == DQ_ATOMIC else preprocess_key(problem.dtype, pair[1])
        launches.append(Launch(key, launch_grid(_cdiv(problem.seqlen_q, ROWS_TILE.block_m), problem),
                               ordered(key, "fmha_bwd_preprocess", pre)))
    elif strategy == DQ_DETERMINISTIC:  # first: the dQ kernel writes the Delta and Lse2 that dK/dV reads
        tile = tile_for(arch, "bwd_dq", pair, kind, dropout)
        dq = {**attention, **rows["o"], **rows["dq"], "Out": a.required("out"), "dQ": a.required("dq")}
        key = dq_key(problem.dtype, pair, kind, dropout)
        launches.append(Launch(key, launch_grid(_cdiv(problem.seqlen_q, tile.block_m), problem),
                               ordered(key, "fmha_bwd_dq", dq)))

    outputs = {**ds_args, **rows["dk"], **rows["dv"], "dK": a.required("dk"), "dV": a.required("dv")}
    if strategy in (DQ_FUSED, DQ_SINGLE):
        kv, q = (FUSED_TILES if strategy == DQ_FUSED else SINGLE_TILES)[arch][pair]
        fused = {**attention, **outputs, **rows["dq"], **rows["o"], "Out": a.required("out"), "dQ": a.required("dq")}
        key = fused_key(problem.dtype, pair, kind, dropout, single_head, strategy)
        blocks = _cdiv(problem.seqlen_k, kv.block_n) + _cdiv(problem.seqlen_q, q.block_m) * problem.kv_group_size
        grid = launch_grid(blocks, problem)
        launches.append(Launch(key, (grid[0], problem.heads_k, grid[2]), ordered(key, "fmha_bwd_fused", fused)))
    else:
        dkdv = {**attention, **dqacc_args, **outputs}
        if strategy == DQ_ATOMIC:
            key, block_n, extra = atomic.dkdv, atomic.dkdv_block_n, atomic.dkdv_extra
        else:
            key, extra = dkdv_key(problem.dtype, pair, kind, dropout, strategy, single_head), {}
            block_n = tile_for(arch, "bwd_dkdv", pair, kind, dropout).block_n
        grid = launch_grid(_cdiv(problem.seqlen_k, block_n), problem)
        launches.append(Launch(key, (grid[0], problem.heads_k, grid[2]),
                               {**ordered(key, "fmha_bwd_dkdv", dkdv), **extra}))

    if strategy == DQ_ATOMIC:
        convert = {**dqacc_args, **rows["dq"], "dQ": a.required("dq"), "CuSeqlensQ": varlen["CuSeqlensQ"],
                   "SeqstartQ": varlen["SeqstartQ"], "seqlen_q": problem.seqlen_q,
                   "head_dim_qk_div8": shape["head_dim_qk_div8"], "softmax_scale": problem.softmax_scale,
                   "is_varlen": varlen["is_varlen"], "has_seqstart": varlen["has_seqstart"]}
        key = atomic.dq_convert
        launches.append(Launch(key, launch_grid(_cdiv(problem.seqlen_q, ROWS_TILE.block_m), problem),
                               ordered(key, "fmha_bwd_dq_convert", convert)))

    if problem.bias_grad:
        b, h, s, _ = a._given_strides("dbias", 4)
        batch_bcast, head_bcast = problem.bias_shape[0] == "1", problem.bias_shape[1] == "1"
        dbias = {"dS": ds_args["dS"], "stride_ds_b": ds_args["stride_ds_b"], "stride_ds_h": ds_args["stride_ds_h"],
                 "stride_ds_s": ds_args["stride_ds_s"], "dBias": a.required("dbias"),
                 **a.checked_strides({"stride_dbias_b": b if not batch_bcast else 0,
                                      "stride_dbias_h": h if not head_bcast else 0, "stride_dbias_s": s}, "dbias"),
                 "seqlen_q": problem.seqlen_q, "seqlen_k": problem.seqlen_k,
                 "reduce_batch": problem.batch if batch_bcast else 1,
                 "reduce_heads": problem.heads_q if head_bcast else 1}
        key = dbias_key(problem.dtype)
        grid = (_cdiv(problem.seqlen_q, DBIAS_TILE.block_m), 1 if head_bcast else problem.heads_q,
                1 if batch_bcast else problem.batch)
        launches.append(Launch(key, grid, ordered(key, "fmha_bwd_dbias", dbias)))
    return launches


def ordered(key, function, args):
    """The runtime arguments of `function` in signature order; every one must be present."""
    names = [n for n, kind in SIGNATURES[function].items() if kind != "constexpr"]
    missing = [n for n in names if n not in args]
    if missing:
        raise AssertionError(f"{key}: plan is missing arguments {missing}")
    return {n: args[n] for n in names}
