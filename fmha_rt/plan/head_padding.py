"""Head dims that are not multiples of 8: the copies around a call's attention launches.

The kernels take head dims in units of 8, so such a call runs on zero-padded copies: the inputs are
widened into scratch buffers before the attention launches and the padded outputs narrowed back into
the caller's arrays after them. The caller's arrays may have any strides (last dim contiguous) and
need only be aligned to their element. The copies are the '<name>_padded' regions of the forward's
scratch or the backward's workspace (layout.padded_tensors); the API puts them into the regions of the
call's operands, like the backward's other workspace regions, so that cached calls allocate them in the
replay.
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

from fmha_rt.errors import FmhaNotImplementedError

from .abi import Tile, make_variant, ordered
from .args import MAX_GRID_YZ, Args, Launch, cdiv, has_work
from .layout import contiguous_strides, padded_head_dim, padded_shape, padded_tensors
from .operands import Operand, Operands

# Padding copies: 256 (row, head) pairs per program, moved in [256, 8] steps where the padded width is
# at most 32 and in [128, 32] steps otherwise. H200, bf16, B*S = 8k, H = 16, GPU time of a forward's
# copies: d = 5 36 -> 14 us and d = 13 37 -> 22 us against [128, 32] steps throughout; d = 100 141 us
# ([64, 64] steps: 175 us).
PAD_TILE = Tile(256, 0, 4, 1)
PAD_CONSTEXPRS = {"BLOCK_R": PAD_TILE.block_m, "NARROW_MAX": 32, "NARROW_COLUMNS": 8, "WIDE_ROWS": 128,
                  "WIDE_COLUMNS": 32}


class HeadPadding(NamedTuple):
    """What a call adds around its attention launches: run `before + attention + after`, with the
    attention planned on `operands`."""

    before: list  # widen the inputs into their padded buffers
    after: list  # narrow the padded outputs into the caller's arrays
    operands: Operands  # the call's, with each padded tensor's buffer in place of the caller's array


def pad_key(dtype, widen):
    """The copy into a zero-padded buffer (widen) or out of one (narrow)."""
    return f"fmha_pad_{'widen' if widen else 'narrow'}_{dtype}"


def variants(dtype) -> list[dict]:
    """The copies' variants for `dtype`, which every arch builds: widen and narrow."""
    return [make_variant(pad_key(dtype, widen), "fmha_pad", dtype, PAD_TILE, dict(PAD_CONSTEXPRS, WIDEN=widen),
                         {"pass": "pad_widen" if widen else "pad_narrow", "block_m": PAD_TILE.block_m})
            for widen in (True, False)]


def for_pass(problem, operands: Operands, pass_name) -> HeadPadding:
    """The copies around a forward ('fwd') or backward ('bwd').

    operands: the call's (caller's arrays, cu_seqlens/seqstarts in varlen mode), whose regions hold one
    '<name>_padded' buffer per padded tensor (a region of the forward's scratch or the backward's
    workspace). `before` widens the inputs into their buffers, `after` narrows the outputs back into
    the caller's arrays; `operands` of the result has the buffers (with their strides) in place of the
    caller's arrays, for the attention plan. No copies, and the call's operands, when both head dims
    are multiples of 8.
    """
    before, after, substitutes = [], [], {}
    a = Args(problem, operands)
    varlen = a.varlen()
    for t in padded_tensors(problem, pass_name):
        q_side = t.side == "q"
        given = getattr(a.need, t.name)
        padded = Operand(t.name, operands.region(t.region), contiguous_strides(padded_shape(problem, t)))
        substitutes[t.name] = padded
        if problem.varlen:
            (pitch_s, pitch_h, _), pitch_b = a.given_strides(given, 3), 0
            stride_padded_b, stride_padded_s = 0, padded.strides[0]
        else:
            pitch_b, pitch_s, pitch_h, _ = a.given_strides(given, 4)
            stride_padded_b, stride_padded_s = padded.strides[:2]
        seqlen, heads = (problem.seqlen_q, problem.heads_q) if q_side else (problem.seqlen_k, problem.heads_k)
        args = {"UnalignedArray": given.pointer, "Padded": padded.pointer,
                "CuSeqlens": varlen["CuSeqlensQ" if q_side else "CuSeqlensK"],
                "Seqstart": varlen["SeqstartQ" if q_side else "SeqstartK"],
                "pitch_b": pitch_b, "pitch_s": pitch_s, "pitch_h": pitch_h,
                "stride_padded_b": stride_padded_b, "stride_padded_s": stride_padded_s,
                "seqlen": seqlen, "num_heads": heads, "head_dim": t.head_dim,
                "padded_dim_div8": padded_head_dim(t.head_dim) // 8,
                "is_varlen": varlen["is_varlen"], "has_seqstart": varlen["has_seqstart"]}
        blocks = cdiv(seqlen * heads, PAD_TILE.block_m)
        if not (has_work(problem) and blocks):
            continue
        if blocks >= 2 ** 31 or problem.batch > MAX_GRID_YZ:
            raise FmhaNotImplementedError(f"{t.name}: {seqlen} rows x {heads} heads in {problem.batch} sequences "
                                          "exceed the grid of the padding copy")
        key = pad_key(problem.dtype, not t.is_output)
        launch = Launch(key, (blocks, problem.batch, 1), ordered(key, "fmha_pad", args))
        (after if t.is_output else before).append(launch)
    return HeadPadding(before, after, dataclasses.replace(operands, **substitutes) if substitutes else operands)
