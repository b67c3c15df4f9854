"""The kernels' ABI as both families build and call it: every kernel function's signature (the
parameters in order, with their types), the tile a variant is built with, the traits that name a
variant's features, and the form of a variant as the AOT build lists it.

Pure Python: importable without Triton, a GPU or NumPy (the kernel sources import it at build time).
A kernel family (portable.py, v3.py) picks variants of these functions and plans their launches; a
launch's runtime arguments are put in signature order by `ordered`.
"""
from dataclasses import dataclass


# Bias kinds: the BIAS_KIND constexpr of every kernel that adds a score term.
BIAS_NONE, BIAS_TENSOR, BIAS_ALIBI = 0, 1, 2
BIAS_KIND_NAMES = {BIAS_NONE: "nobias", BIAS_TENSOR: "bias", BIAS_ALIBI: "alibi"}
DTYPES = ("fp16", "bf16")
HEAD_DIM_TILES = (32, 64, 128, 256)
# (query/key tile, value tile) pairs that have kernels.
HEAD_DIM_PAIRS = ((32, 32), (64, 64), (128, 128), (256, 256), (256, 128))
# The backward's dQ strategies: the names its variants carry in their traits and its workspace follows.
DQ_ATOMIC, DQ_DETERMINISTIC, DQ_FUSED, DQ_SINGLE = "atomic", "deterministic", "fused", "single"
# ORDERED: the dK/dV pass adds dQ into one fp32 accumulator in key-block order (deterministic).
DQ_ORDERED = "ordered"
# Where each function's source lives (the portable family's; a family with its own source of a function
# names that module in its variants).
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



def _dkdv_signature(form: str) -> dict:
    """fmha_bwd_dkdv's signature (form ''), fmha_bwd_dkdv_ordered's ('ordered': the same with the order
    region after the dQ accumulator and the batch size after the dropout arguments, and no DQ_ATOMIC), or
    fmha_bwd_dkdv's where dK and dV are fp32 accumulators ('accumulating': DKDV_ACCUMULATING_SIGNATURE)."""
    ordered_form = form == "ordered"
    dkv = "fp32" if form == "accumulating" else "T"
    return _signature(f"""
        Q *T, K *T, V *T, dO *T, Lse2 *fp32, Delta *fp32, dK *{dkv}, dV *{dkv}, DqAcc *fp32,
        {"DqOrder *i32," if ordered_form else ""} Bias *T, dS *fp32, Alibi *fp32, PhiloxSeedOffset *i64, {_VARLEN_PTRS},
        {_strides("q", "k", "v", "do", "dk", "dv", "dqacc")},
        stride_ds_b i64, stride_ds_h i64, stride_ds_s i32,
        stride_delta_b i64, stride_delta_h i64, {_BIAS_STRIDES},
        {_SHAPE_ARGS}, softmax_scale fp32, scale_log2 fp32, {_MASK_ARGS}, write_dbias i32, {_DROPOUT_ARGS},
        {"batch i32," if ordered_form else ""} {_TILE}, BIAS_KIND constexpr, DROPOUT constexpr,
        {"" if ordered_form else "DQ_ATOMIC constexpr,"} FLAT_LOOP constexpr, GROUP_LOOP constexpr,
        DP_FIRST constexpr""")


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
    "fmha_bwd_dkdv": _dkdv_signature(""),
    # The ORDERED strategy's persistent dK/dV pass: its int32 order region (work-item ticket and one counter
    # per dQ tile) and the batch size, from which it numbers its work items.
    "fmha_bwd_dkdv_ordered": _dkdv_signature("ordered"),
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
# fmha_bwd_dkdv as the v3 family's variants of GQA's dK/dV by query head take it (their ONE_HEAD): the same
# arguments, dK and dV being fp32 accumulators of the workspace that every query head's programs add to.
DKDV_ACCUMULATING_SIGNATURE = _dkdv_signature("accumulating")
KERNEL_SOURCE = {
    "fmha_fwd": "fwd", "fmha_dropout_mask": "fwd", "fmha_bwd_preprocess": "bwd", "fmha_bwd_dkdv": "bwd",
    "fmha_bwd_dkdv_ordered": "bwd", "fmha_bwd_dq": "bwd", "fmha_bwd_fused": "bwd",
    "fmha_bwd_dq_convert": "bwd", "fmha_bwd_dbias": "bwd", "fmha_pad": "pad",
}

# ------------------------------------------------------------------------------------------- tiles


@dataclass(frozen=True)
class Tile:
    block_m: int  # query rows per tile
    block_n: int  # key rows per tile
    num_warps: int
    num_stages: int


# The memory-bound row passes of the backward (preprocess: Delta and Lse2; dq_convert: the fp32 dQ
# accumulator into dQ): one configuration everywhere, in every family that runs them.
ROWS_TILE = Tile(64, 0, 4, 1)

# ---------------------------------------------------------------------------------------- variants


def head_dim_tiles(problem) -> tuple:
    """(query/key tile, value tile) of the kernels that serve `problem`: the smallest tiles that hold
    both head dims; a pair without its own kernels runs in the square tile of the wider one."""
    tile = lambda d: next(t for t in HEAD_DIM_TILES if t >= d)  # noqa: E731
    pair = (tile(problem.head_dim_qk), tile(problem.head_dim_v))
    return pair if pair in HEAD_DIM_PAIRS else (max(pair), max(pair))


def problem_features(problem) -> tuple:
    """(bias kind, dropout): the features that select among a function's variants."""
    if problem.bias_shape is not None:
        kind = BIAS_TENSOR
    elif problem.alibi is not None:
        kind = BIAS_ALIBI
    else:
        kind = BIAS_NONE
    return kind, problem.has_dropout


def pair_name(dqk, dv):
    return f"d{dqk}" if dqk == dv else f"d{dqk}v{dv}"


def make_variant(key, function, dtype, tile, constexprs, traits, module=None, signature=None):
    """A variant of `function` (a SIGNATURES name) in the form a family's variants() lists; `module` the
    source's (default: the portable family's module of that function), `signature` another form of the
    function's (default: SIGNATURES[function])."""
    signature = {name: (f"*{dtype}" if kind == "*T" else kind) for name, kind in (signature or SIGNATURES[function]).items()}
    return {
        "key": key, "module": module or KERNEL_MODULES[KERNEL_SOURCE[function]], "function": function,
        "signature": signature, "constexprs": constexprs, "num_warps": tile.num_warps,
        "num_stages": tile.num_stages, "traits": dict(traits, dtype=dtype),
    }


def preprocess_variant(key, dtype, dv_tile):
    """The backward's pre-pass (Delta and Lse2 of every query row) for values in the `dv_tile` tile."""
    return make_variant(key, "fmha_bwd_preprocess", dtype, ROWS_TILE, {"BLOCK_M": ROWS_TILE.block_m, "BLOCK_DV": dv_tile},
                        {"pass": "bwd_pre", "head_dim_v_tile": dv_tile, "block_m": ROWS_TILE.block_m})


def dq_convert_variant(key, dtype, dqk_tile):
    """The atomic strategy's last pass (the fp32 dQ accumulator, scaled, into dQ) in the `dqk_tile` tile."""
    return make_variant(key, "fmha_bwd_dq_convert", dtype, ROWS_TILE, {"BLOCK_M": ROWS_TILE.block_m, "BLOCK_DQK": dqk_tile},
                        {"pass": "bwd_post", "head_dim_qk_tile": dqk_tile, "block_m": ROWS_TILE.block_m,
                         "dq_strategy": DQ_ATOMIC})


def ordered(key, function, args):
    """The runtime arguments of `function` in signature order; every one must be present."""
    names = [n for n, kind in SIGNATURES[function].items() if kind != "constexpr"]
    missing = [n for n in names if n not in args]
    if missing:
        raise AssertionError(f"{key}: plan is missing arguments {missing}")
    return {n: args[n] for n in names}
