"""Portable attention backward.

Passes, in launch order, for the DETERMINISTIC dQ strategy (what the shipped archs build):
1. fmha_bwd_dq: one program per query block looping over its visible key blocks in a fixed order. It
   first computes Delta = rowsum(dO * O) of its rows in fp32 and the LSE in the log2 domain (Lse2) and
   writes both for the next pass, then recomputes P and dP and writes dQ in the output dtype.
2. fmha_bwd_dkdv: one program per (key block, kv head, batch entry). It loops over the group's query
   heads and the visible query blocks in a fixed order, so dK and dV (summed over the group) are
   deterministic. It also writes dS for the bias gradient. Variants with GROUP_LOOP off serve one
   query head per key head (MHA) without the loop over the group's heads, which spills less.
3. fmha_bwd_dbias (with a tensor bias): sums dS over the bias's broadcast dims in a fixed order.

The FUSED strategy runs fmha_bwd_preprocess for Delta and Lse2, then fmha_bwd_fused: the dK/dV and dQ
programs of the deterministic strategy in one grid, then fmha_bwd_dbias.

The SINGLE strategy (problems too small to fill the GPU, where a second launch costs more host time
than it saves GPU time) is fmha_bwd_fused alone with DELTA_INLINE: every program computes Delta and
Lse2 of the rows it visits and keeps them in registers, so the backward is one launch and needs no
workspace.

The ATOMIC strategy (built for the interpreter, and for any arch where it measures faster) runs
fmha_bwd_preprocess for Delta and Lse2, then fmha_bwd_dkdv adding dS @ K into a zeroed fp32 dQ workspace with
atomics, then fmha_bwd_dq_convert scaling that workspace into dQ, then fmha_bwd_dbias.

The ORDERED strategy (what deterministic calls run, beyond SINGLE's problems) is the ATOMIC one with
fmha_bwd_dkdv_ordered for the dK/dV pass: persistent programs take (key block, key head, batch entry) items
by ticket, and each adds its dQ shares with plain loads and stores, in key-block order (dq_order.py), so it
is deterministic with the 5 block products of the atomic form.

Why a separate dQ kernel for the DETERMINISTIC strategy: it is bitwise reproducible by construction
(each dQ tile has one owner that accumulates in a fixed order), independent of the number of
multiprocessors and of streams, runs under the CPU interpreter (unlike a serialised in-place
accumulation, it needs no program to wait for another), and needs no dQ workspace at all. Its cost is
recomputing Q K^T and dO V^T: 7 block products per (query block, key block) pair instead of 5, traded
against the atomic variant's fp32 read-modify-write of a BLOCK_M x D tile per pair. On an H200 that
trade came out even or better (see DEFAULT_DQ_STRATEGY in fmha_rt/plan/portable.py). Running it first
lets it produce Delta on the way (its rows of O and dO are the ones it loads anyway), which saves the
pre-pass's launch and its pass over O and dO.
"""
import triton
import triton.language as tl

from kernels.portable.dq_order import add_in_key_block_order, key_block_rank, next_item, order_counters
from kernels.portable.fmha_common import (KIND_ALIBI, KIND_TENSOR, LOG2E, dropout_draws, dropout_row_counters,
                                          key_blocks, masked_block, philox_seed_offset, query_blocks, row_stats_start,
                                          scores, sequence_extent, unhoisted, visible, window_sides)

# How a dK/dV program adds its dQ share (DQ_ADD): not at all (dQ has programs of its own), by fp32 atomics into
# the zeroed accumulator (ATOMIC strategy), or in key-block order into it (ORDERED strategy, dq_order.py).
DQ_ADD_NONE = tl.constexpr(0)
DQ_ADD_ATOMIC = tl.constexpr(1)
DQ_ADD_ORDERED = tl.constexpr(2)


@triton.jit
def _log2_lse(Lse_rows, rows_local, q_ok):
    """LSE rows in the log2 domain; rows that saw no key (-inf) and rows past the end become +inf, so
    that their probabilities exp2(s - lse) are exactly 0."""
    lse = tl.load(Lse_rows + rows_local, mask=q_ok, other=float("inf"))
    return tl.where(lse == float("-inf"), float("inf"), lse * LOG2E)


@triton.jit
def fmha_bwd_preprocess(
    Out, dO, Lse, Delta, Lse2, CuSeqlensQ, SeqstartQ,
    stride_o_b, stride_o_s, stride_o_h,
    stride_do_b, stride_do_s, stride_do_h,
    lse_stride_b, lse_stride_h, stride_delta_b, stride_delta_h,
    seqlen_q, head_dim_v_div8, is_varlen, has_seqstart,
    BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    h = tl.program_id(1)
    b = tl.program_id(2)
    q_start, sq = sequence_extent(CuSeqlensQ, SeqstartQ, b, seqlen_q, is_varlen, has_seqstart)
    m0 = tl.program_id(0) * BLOCK_M
    if m0 >= sq:
        return
    offs_m = tl.arange(0, BLOCK_M)
    offs_dv = tl.arange(0, BLOCK_DV)
    q_ok = m0 + offs_m < sq
    ok = q_ok[:, None] & (offs_dv < head_dim_v_div8 * 8)[None, :]
    row0 = (q_start + m0).to(tl.int64)
    b64, h64 = b.to(tl.int64), h.to(tl.int64)
    o = tl.load(Out + b64 * stride_o_b + row0 * stride_o_s + h64 * stride_o_h
                + offs_m[:, None] * stride_o_s + offs_dv[None, :], mask=ok, other=0.0)
    do = tl.load(dO + b64 * stride_do_b + row0 * stride_do_s + h64 * stride_do_h
                 + offs_m[:, None] * stride_do_s + offs_dv[None, :], mask=ok, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    rows_out = b64 * stride_delta_b + h64 * stride_delta_h + row_stats_start(q_start, b, is_varlen) + m0 + offs_m
    tl.store(Delta + rows_out, delta, mask=q_ok)
    tl.store(Lse2 + rows_out, _log2_lse(Lse + b64 * lse_stride_b + h64 * lse_stride_h + row0, offs_m, q_ok), mask=q_ok)


@triton.jit
def _dkdv_query_block(dk, dv, k, v, n0, keys, m0, sq, sk, off, left, right, Q_rows, dO_rows, Lse2_rows,
                      Delta_rows, O_rows, DqAcc_rows, Order_rows, Bias_rows, dS_rows, offs_m, offs_dqk, offs_dv, dqk_ok, dv_ok,
                      stride_q_s, stride_do_s, stride_o_s, stride_dqacc_s, stride_bias_s, stride_ds_s, scale_log2,
                      slope_log2, seed, philox_off, dropout_bh, seqlen_q, seqlen_k, drop_threshold, drop_scale,
                      write_dbias, needs_mask,
                      BIAS_KIND: tl.constexpr, DROPOUT: tl.constexpr,
                      DQ_ADD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      ROWS_COMPLETE: tl.constexpr, DELTA_INLINE: tl.constexpr, UNHOISTED: tl.constexpr,
                      DP_FIRST: tl.constexpr):
    """Adds one query block's share to dK, dV of the program's key block (scores transposed:
    keys are rows, queries columns). ROWS_COMPLETE: every row of the block exists (a mask-free block
    of the nested loops), so its loads need no row mask. That mask is the larger part of the loop's
    integer work: one predicate per 16-byte copy, recomputed every step (NOTES.md, v7).
    DELTA_INLINE (the one-launch backward, for problems too small to fill the GPU): Delta comes from
    this block's rows of O and dO, and Lse2 from the LSE, which Lse2_rows then points to.
    UNHOISTED (the fused grid's dK/dV programs): the Q and dO tile offsets stay inside the loop, where the
    backend would hoist their 64-bit forms and spill them (NOTES.md v10).
    DP_FIRST (the fused grid's dK/dV programs, and the two-kernel objects of DKDV_DP_FIRST): dO V^T is
    issued right after K Q^T, so that the tensor cores compute it while the exponentials run, instead of
    after them behind the dV product (NOTES.md v12; in the two-kernel objects it added spills)."""
    rows = m0 + offs_m
    q_ok = rows < sq
    m0_64 = tl.cast(m0, tl.int64)
    if UNHOISTED:
        qT_ptrs = Q_rows + m0_64 * stride_q_s + unhoisted(offs_m[None, :] * stride_q_s + offs_dqk[:, None], m0)
        do_ptrs = dO_rows + m0_64 * stride_do_s + unhoisted(offs_m[:, None] * stride_do_s + offs_dv[None, :], m0)
    else:
        qT_ptrs = Q_rows + m0_64 * stride_q_s + offs_m[None, :] * stride_q_s + offs_dqk[:, None]
        do_ptrs = dO_rows + m0_64 * stride_do_s + offs_m[:, None] * stride_do_s + offs_dv[None, :]
    if ROWS_COMPLETE:
        qT = tl.load(qT_ptrs, mask=dqk_ok[:, None], other=0.0)
        do = tl.load(do_ptrs, mask=dv_ok[None, :], other=0.0)
        lse2 = tl.load(Lse2_rows + rows)
        delta = tl.load(Delta_rows + rows)
    else:  # rows past the end: zero Q and dO, and +inf Lse2 so that their probabilities are 0
        qT = tl.load(qT_ptrs, mask=q_ok[None, :] & dqk_ok[:, None], other=0.0)
        do = tl.load(do_ptrs, mask=q_ok[:, None] & dv_ok[None, :], other=0.0)
        lse2 = tl.load(Lse2_rows + rows, mask=q_ok, other=float("inf"))
        delta = tl.load(Delta_rows + rows, mask=q_ok, other=0.0)
    if DELTA_INLINE:
        o = tl.load(O_rows + m0_64 * stride_o_s + offs_m[:, None] * stride_o_s + offs_dv[None, :],
                    mask=q_ok[:, None] & dv_ok[None, :], other=0.0)
        delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
        lse2 = _log2_lse(Lse2_rows, rows, q_ok)

    qkT = tl.dot(k, qT)
    if DP_FIRST:
        vdoT = tl.dot(v, tl.trans(do))
    sT, scale = scores(qkT, rows[None, :], keys[:, None], q_ok[None, :], off, left, right, sk,
                       Bias_rows + m0_64 * stride_bias_s, stride_bias_s, offs_m[None, :], slope_log2, scale_log2,
                       False, BIAS_KIND)
    if needs_mask:  # a constexpr in the nested loops, a runtime branch in the flat one
        sT = tl.where(visible(rows[None, :], keys[:, None], off, left, right, sk), sT, float("-inf"))
    pT = tl.exp2(sT * scale - lse2[None, :])
    if DROPOUT:
        counters = dropout_row_counters(philox_off, dropout_bh, seqlen_q, seqlen_k, rows)
        keepT = tl.trans(dropout_draws(seed, counters, n0, BLOCK_N)) >= drop_threshold.to(tl.uint32)
        dv += tl.dot(tl.where(keepT, pT * drop_scale, 0.0).to(do.dtype), do)
    else:
        dv += tl.dot(pT.to(do.dtype), do)
    if not DP_FIRST:
        vdoT = tl.dot(v, tl.trans(do))
    if DROPOUT:
        dpT = tl.where(keepT, vdoT * drop_scale, 0.0)
    else:
        dpT = vdoT
    dsT = pT * (dpT - delta[None, :])
    dk += tl.dot(dsT.to(qT.dtype), tl.trans(qT))
    if BIAS_KIND == KIND_TENSOR:
        if write_dbias:
            tl.store(dS_rows + m0_64 * stride_ds_s + offs_m[None, :] * stride_ds_s + keys[:, None], dsT,
                     mask=q_ok[None, :] & (keys < sk)[:, None])
    if DQ_ADD != DQ_ADD_NONE:
        dq = tl.dot(tl.trans(dsT).to(k.dtype), k)
        dq_ptrs = DqAcc_rows + m0_64 * stride_dqacc_s + offs_m[:, None] * stride_dqacc_s + offs_dqk[None, :]
        if DQ_ADD == DQ_ADD_ATOMIC:
            tl.atomic_add(dq_ptrs, dq, mask=q_ok[:, None] & dqk_ok[None, :], sem="relaxed")
        else:
            add_in_key_block_order(dq_ptrs, dq, q_ok[:, None] & dqk_ok[None, :], Order_rows + m0 // BLOCK_M,
                                   key_block_rank(n0, m0, off, left, BLOCK_N))
    return dk, dv


@triton.jit
def _dkdv_head_block(dk, dv, k, v, n0, keys, m0, h, b, b64, q_row0, stats_row0, sq, sk, off, left, right, Q, dO, Lse2,
                     Delta, Out, DqAcc, DqOrder, Bias, dS, Alibi, offs_m, offs_dqk, offs_dv, dqk_ok, dv_ok,
                     stride_q_b, stride_q_s, stride_q_h, stride_do_b, stride_do_s, stride_do_h,
                     stride_o_b, stride_o_s, stride_o_h,
                     stride_dqacc_b, stride_dqacc_s, stride_dqacc_h, stride_ds_b, stride_ds_h, stride_ds_s,
                     stride_delta_b, stride_delta_h, stride_bias_b, stride_bias_h,
                     stride_bias_s, alibi_stride_b, scale_log2, seed, philox_off, num_heads_q, seqlen_q, seqlen_k,
                     drop_threshold, drop_scale, write_dbias, needs_mask,
                     BIAS_KIND: tl.constexpr, DROPOUT: tl.constexpr, DQ_ADD: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, ROWS_COMPLETE: tl.constexpr, DELTA_INLINE: tl.constexpr,
                     UNHOISTED: tl.constexpr, DP_FIRST: tl.constexpr):
    """_dkdv_query_block for query head h: the head's row pointers, then the block."""
    h64 = h.to(tl.int64)
    slope_log2 = 0.0
    if BIAS_KIND == KIND_ALIBI:
        slope_log2 = tl.load(Alibi + b64 * alibi_stride_b + h) * LOG2E
    Order_rows = DqOrder  # None unless the dQ shares are added in key-block order
    if DQ_ADD == DQ_ADD_ORDERED:
        Order_rows = order_counters(DqOrder, b * num_heads_q + h, seqlen_q, BLOCK_M)
    return _dkdv_query_block(
        dk, dv, k, v, n0, keys, m0, sq, sk, off, left, right,
        Q + b64 * stride_q_b + q_row0 * stride_q_s + h64 * stride_q_h,
        dO + b64 * stride_do_b + q_row0 * stride_do_s + h64 * stride_do_h,
        Lse2 + b64 * stride_delta_b + h64 * stride_delta_h + stats_row0,
        Delta + b64 * stride_delta_b + h64 * stride_delta_h + stats_row0,
        Out + b64 * stride_o_b + q_row0 * stride_o_s + h64 * stride_o_h,
        DqAcc + b64 * stride_dqacc_b + q_row0 * stride_dqacc_s + h64 * stride_dqacc_h,
        Order_rows, Bias + b64 * stride_bias_b + h64 * stride_bias_h, dS + b64 * stride_ds_b + h64 * stride_ds_h,
        offs_m, offs_dqk, offs_dv, dqk_ok, dv_ok,
        stride_q_s, stride_do_s, stride_o_s, stride_dqacc_s, stride_bias_s, stride_ds_s, scale_log2, slope_log2,
        seed, philox_off, b * num_heads_q + h, seqlen_q, seqlen_k, drop_threshold, drop_scale, write_dbias,
        needs_mask, BIAS_KIND, DROPOUT, DQ_ADD, BLOCK_M, BLOCK_N, ROWS_COMPLETE, DELTA_INLINE, UNHOISTED, DP_FIRST)


@triton.jit
def _dkdv_head_loops(dk, dv, k, v, n0, keys, lo, full_lo, full_hi, hi, h, b, b64, q_row0, stats_row0, sq, sk, off, left,
                     right, Q, dO, Lse2, Delta, Out, DqAcc, DqOrder, Bias, dS, Alibi, offs_m, offs_dqk, offs_dv, dqk_ok, dv_ok,
                     stride_q_b, stride_q_s, stride_q_h, stride_do_b, stride_do_s, stride_do_h,
                     stride_o_b, stride_o_s, stride_o_h, stride_dqacc_b, stride_dqacc_s, stride_dqacc_h,
                     stride_ds_b, stride_ds_h, stride_ds_s,
                     stride_delta_b, stride_delta_h, stride_bias_b, stride_bias_h,
                     stride_bias_s, alibi_stride_b, scale_log2, seed, philox_off, num_heads_q, seqlen_q, seqlen_k,
                     drop_threshold, drop_scale, write_dbias, BIAS_KIND: tl.constexpr, DROPOUT: tl.constexpr,
                     DQ_ADD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     DELTA_INLINE: tl.constexpr, UNHOISTED: tl.constexpr, DP_FIRST: tl.constexpr):
    """Query head h's share of the key block: the mask-free query blocks, then the masked ones, each
    loop body compiled for its case. Nothing is hoisted out of the two loops (disable_licm): hoisted
    pointers stay live across the loop and spill, and the step's own integer work is cheaper than the
    reloads (sm_90 bf16 two-kernel dK/dV, D=128 one head: 48 -> 0 bytes of stack, 5 -> 0 reloads per
    step; backward +2-5% at D=64, NOTES.md v13). Not in the one-launch backward's objects (DELTA_INLINE),
    which were not timed with it."""
    for blk in tl.range(full_lo, full_hi, disable_licm=not DELTA_INLINE):
        dk, dv = _dkdv_head_block(
            dk, dv, k, v, n0, keys, blk * BLOCK_M, h, b, b64, q_row0, stats_row0, sq, sk, off, left, right, Q, dO, Lse2,
            Delta, Out, DqAcc, DqOrder, Bias, dS, Alibi, offs_m, offs_dqk, offs_dv, dqk_ok, dv_ok, stride_q_b, stride_q_s,
            stride_q_h, stride_do_b, stride_do_s, stride_do_h, stride_o_b, stride_o_s, stride_o_h, stride_dqacc_b,
            stride_dqacc_s, stride_dqacc_h,
            stride_ds_b, stride_ds_h, stride_ds_s, stride_delta_b, stride_delta_h,
            stride_bias_b, stride_bias_h, stride_bias_s, alibi_stride_b, scale_log2, seed, philox_off, num_heads_q,
            seqlen_q, seqlen_k, drop_threshold, drop_scale, write_dbias, False, BIAS_KIND, DROPOUT, DQ_ADD,
            BLOCK_M, BLOCK_N, True, DELTA_INLINE, UNHOISTED, DP_FIRST)
    for t in tl.range(0, (full_lo - lo) + (hi - full_hi), disable_licm=not DELTA_INLINE):
        dk, dv = _dkdv_head_block(
            dk, dv, k, v, n0, keys, masked_block(t, lo, full_lo, full_hi) * BLOCK_M, h, b, b64, q_row0,
            stats_row0, sq, sk, off, left, right, Q, dO, Lse2, Delta, Out, DqAcc, DqOrder, Bias, dS, Alibi, offs_m, offs_dqk,
            offs_dv, dqk_ok, dv_ok, stride_q_b, stride_q_s, stride_q_h, stride_do_b, stride_do_s, stride_do_h,
            stride_o_b, stride_o_s, stride_o_h, stride_dqacc_b, stride_dqacc_s, stride_dqacc_h, stride_ds_b,
            stride_ds_h, stride_ds_s, stride_delta_b, stride_delta_h, stride_bias_b, stride_bias_h, stride_bias_s,
            alibi_stride_b, scale_log2, seed, philox_off, num_heads_q, seqlen_q, seqlen_k, drop_threshold, drop_scale,
            write_dbias, True, BIAS_KIND, DROPOUT, DQ_ADD, BLOCK_M, BLOCK_N, False, DELTA_INLINE, UNHOISTED,
            DP_FIRST)
    return dk, dv


@triton.jit
def _dkdv_group_blocks(dk, dv, k, v, n0, keys, lo, full_lo, full_hi, hi, hk, kv_group_size, b, b64, q_row0, stats_row0,
                       sq, sk, off, left, right, Q, dO, Lse2, Delta, Out, DqAcc, DqOrder, Bias, dS, Alibi, offs_m, offs_dqk,
                       offs_dv, dqk_ok, dv_ok, stride_q_b, stride_q_s, stride_q_h, stride_do_b, stride_do_s,
                       stride_do_h, stride_o_b, stride_o_s, stride_o_h, stride_dqacc_b, stride_dqacc_s, stride_dqacc_h,
                       stride_ds_b, stride_ds_h, stride_ds_s, stride_delta_b, stride_delta_h, stride_bias_b,
                       stride_bias_h, stride_bias_s, alibi_stride_b, scale_log2, seed, philox_off, num_heads_q,
                       seqlen_q, seqlen_k, drop_threshold, drop_scale, write_dbias, BIAS_KIND: tl.constexpr,
                       DROPOUT: tl.constexpr, DQ_ADD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       MASKED: tl.constexpr, DELTA_INLINE: tl.constexpr, UNHOISTED: tl.constexpr,
                       DP_FIRST: tl.constexpr):
    """The key block's mask-free query blocks (MASKED=False) or masked ones, of every query head of the
    group in turn, in one loop: (head, block) are counters carried from step to step, no division."""
    if MASKED:
        blocks = (full_lo - lo) + (hi - full_hi)
    else:
        blocks = full_hi - full_lo
    g = 0
    i = 0
    # The group's row pointers once per program, and nothing else hoisted out of the loop (disable_licm):
    # a step adds only its head's offset g within the group, so few values stay live across the loop
    # (sm_90 bf16 D=128: 10 reloads per step instead of 19, and ptxas then has the registers to run all
    # the exponentials while dO V^T computes; NOTES.md v12). _dkdv_head_block sees batch 0, row 0 and
    # head g of these bases; the batch-and-head index of the dropout counters and the ALiBi slope is
    # b * Hq + the group's first head + g (a "batch" of one head each).
    h0 = hk * kv_group_size
    h0_64 = h0.to(tl.int64)
    Q_group = Q + b64 * stride_q_b + q_row0 * stride_q_s + h0_64 * stride_q_h
    dO_group = dO + b64 * stride_do_b + q_row0 * stride_do_s + h0_64 * stride_do_h
    Lse2_group = Lse2 + b64 * stride_delta_b + h0_64 * stride_delta_h + stats_row0
    Delta_group = Delta + b64 * stride_delta_b + h0_64 * stride_delta_h + stats_row0
    Out_group = Out + b64 * stride_o_b + q_row0 * stride_o_s + h0_64 * stride_o_h
    DqAcc_group = DqAcc + b64 * stride_dqacc_b + q_row0 * stride_dqacc_s + h0_64 * stride_dqacc_h
    Bias_group = Bias + b64 * stride_bias_b + h0_64 * stride_bias_h
    dS_group = dS + b64 * stride_ds_b + h0_64 * stride_ds_h
    Alibi_group = Alibi + b64 * alibi_stride_b + h0
    for _ in tl.range(0, kv_group_size * blocks, disable_licm=True):
        if MASKED:
            blk = masked_block(i, lo, full_lo, full_hi)
        else:
            blk = full_lo + i
        dk, dv = _dkdv_head_block(
            dk, dv, k, v, n0, keys, blk * BLOCK_M, g, b * num_heads_q + h0, 0, 0, 0, sq, sk, off, left, right,
            Q_group, dO_group, Lse2_group, Delta_group, Out_group, DqAcc_group, DqOrder, Bias_group, dS_group, Alibi_group,
            offs_m, offs_dqk, offs_dv, dqk_ok, dv_ok,
            stride_q_b, stride_q_s, stride_q_h, stride_do_b, stride_do_s, stride_do_h, stride_o_b, stride_o_s,
            stride_o_h, stride_dqacc_b, stride_dqacc_s, stride_dqacc_h, stride_ds_b, stride_ds_h, stride_ds_s,
            stride_delta_b, stride_delta_h, stride_bias_b, stride_bias_h, stride_bias_s, alibi_stride_b, scale_log2,
            seed, philox_off, 1, seqlen_q, seqlen_k, drop_threshold, drop_scale, write_dbias, MASKED,
            BIAS_KIND, DROPOUT, DQ_ADD, BLOCK_M, BLOCK_N, not MASKED, DELTA_INLINE, UNHOISTED, DP_FIRST)
        i += 1
        g = tl.where(i == blocks, g + 1, g)
        i = tl.where(i == blocks, 0, i)
    return dk, dv


@triton.jit
def _dkdv_program(
    n_block, hk, b,
    Q, K, V, dO, Lse2, Delta, Out, dK, dV, DqAcc, DqOrder, Bias, dS, Alibi, PhiloxSeedOffset,
    CuSeqlensQ, CuSeqlensK, SeqstartQ, SeqstartK,
    stride_q_b, stride_q_s, stride_q_h,
    stride_k_b, stride_k_s, stride_k_h,
    stride_v_b, stride_v_s, stride_v_h,
    stride_do_b, stride_do_s, stride_do_h,
    stride_o_b, stride_o_s, stride_o_h,
    stride_dk_b, stride_dk_s, stride_dk_h,
    stride_dv_b, stride_dv_s, stride_dv_h,
    stride_dqacc_b, stride_dqacc_s, stride_dqacc_h,
    stride_ds_b, stride_ds_h, stride_ds_s,
    stride_delta_b, stride_delta_h,
    stride_bias_b, stride_bias_h, stride_bias_s,
    alibi_stride_b,
    seqlen_q, seqlen_k, num_heads_q, kv_group_size, head_dim_qk_div8, head_dim_v_div8,
    softmax_scale, scale_log2, window_left, window_right, bottom_right, is_varlen, has_seqstart,
    write_dbias, drop_threshold, drop_scale, philox_seed, philox_offset, philox_from_ptr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
    BIAS_KIND: tl.constexpr, DROPOUT: tl.constexpr, DQ_ADD: tl.constexpr, FLAT_LOOP: tl.constexpr,
    GROUP_LOOP: tl.constexpr, DELTA_INLINE: tl.constexpr, UNHOISTED: tl.constexpr, DP_FIRST: tl.constexpr,
):
    """dK and dV of key block n_block of kv head hk, batch entry b (fmha_bwd_dkdv, and the key-block
    programs of fmha_bwd_fused). With DELTA_INLINE, Lse2 and stride_delta_* are the LSE's, and Out is read."""
    q_start, sq = sequence_extent(CuSeqlensQ, SeqstartQ, b, seqlen_q, is_varlen, has_seqstart)
    k_start, sk = sequence_extent(CuSeqlensK, SeqstartK, b, seqlen_k, is_varlen, has_seqstart)
    n0 = n_block * BLOCK_N
    if n0 >= sk:
        return
    off = tl.where(bottom_right != 0, sk - sq, 0)
    left, right = window_sides(window_left, window_right, sq, sk)
    b64, hk64 = b.to(tl.int64), hk.to(tl.int64)

    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_dqk = tl.arange(0, BLOCK_DQK)
    offs_dv = tl.arange(0, BLOCK_DV)
    keys = n0 + offs_n
    k_ok = keys < sk
    dqk_ok = offs_dqk < head_dim_qk_div8 * 8
    dv_ok = offs_dv < head_dim_v_div8 * 8
    k_row0 = (k_start + n0).to(tl.int64)
    k = tl.load(K + b64 * stride_k_b + k_row0 * stride_k_s + hk64 * stride_k_h
                + offs_n[:, None] * stride_k_s + offs_dqk[None, :], mask=k_ok[:, None] & dqk_ok[None, :], other=0.0)
    v = tl.load(V + b64 * stride_v_b + k_row0 * stride_v_s + hk64 * stride_v_h
                + offs_n[:, None] * stride_v_s + offs_dv[None, :], mask=k_ok[:, None] & dv_ok[None, :], other=0.0)
    seed, philox_off = philox_seed_offset(philox_seed, philox_offset, PhiloxSeedOffset, philox_from_ptr)

    dk = tl.zeros([BLOCK_N, BLOCK_DQK], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)
    lo, full_lo, full_hi, hi = query_blocks(n0, sq, off, left, right, BLOCK_N, BLOCK_M)
    q_row0 = q_start.to(tl.int64)
    if DELTA_INLINE:  # Lse2 is the LSE, whose rows are q's
        stats_row0 = q_row0
    else:
        stats_row0 = row_stats_start(q_start, b, is_varlen)
    if FLAT_LOOP:
        # One loop over (query head of the group, query block), the mask a runtime branch: the nest
        # below keeps three loops' state live and spills dK/dV where they fill the registers (256 wide).
        blocks_per_head = hi - lo
        for t in range(0, kv_group_size * blocks_per_head):
            g = t // blocks_per_head
            blk = lo + (t - g * blocks_per_head)
            dk, dv = _dkdv_head_block(
                dk, dv, k, v, n0, keys, blk * BLOCK_M, hk * kv_group_size + g, b, b64, q_row0, stats_row0, sq, sk, off,
                left, right, Q, dO, Lse2, Delta, Out, DqAcc, DqOrder, Bias, dS, Alibi, offs_m, offs_dqk, offs_dv, dqk_ok, dv_ok,
                stride_q_b, stride_q_s, stride_q_h, stride_do_b, stride_do_s, stride_do_h,
                stride_o_b, stride_o_s, stride_o_h, stride_dqacc_b, stride_dqacc_s, stride_dqacc_h,
                stride_ds_b, stride_ds_h, stride_ds_s,
                stride_delta_b, stride_delta_h, stride_bias_b, stride_bias_h,
                stride_bias_s, alibi_stride_b, scale_log2, seed, philox_off, num_heads_q, seqlen_q, seqlen_k,
                drop_threshold, drop_scale, write_dbias, (blk < full_lo) | (blk >= full_hi),
                BIAS_KIND, DROPOUT, DQ_ADD, BLOCK_M, BLOCK_N, False, DELTA_INLINE, UNHOISTED, DP_FIRST)
    elif UNHOISTED:
        # The fused grid's dK/dV programs (MHA: a group of one head): one loop over the group's mask-free
        # (head, block) steps, one over its masked ones. In the nest below, the fused object's register
        # allocation, which its dQ programs share, spilled inside the hot loop (sm_90 bf16 D=128, GQA:
        # 17 LDL / 9 STL per step, here 10 / 0; MHA: 17 / 0 and 45 / 28 in the masked loop, here 10 / 0
        # and 10 / 0; NOTES.md v12, v13).
        for masked in tl.static_range(2):
            dk, dv = _dkdv_group_blocks(
                dk, dv, k, v, n0, keys, lo, full_lo, full_hi, hi, hk, kv_group_size, b, b64, q_row0, stats_row0, sq,
                sk, off, left, right, Q, dO, Lse2, Delta, Out, DqAcc, DqOrder, Bias, dS, Alibi, offs_m, offs_dqk, offs_dv,
                dqk_ok, dv_ok, stride_q_b, stride_q_s, stride_q_h, stride_do_b, stride_do_s, stride_do_h,
                stride_o_b, stride_o_s, stride_o_h, stride_dqacc_b, stride_dqacc_s, stride_dqacc_h,
                stride_ds_b, stride_ds_h, stride_ds_s, stride_delta_b, stride_delta_h, stride_bias_b, stride_bias_h,
                stride_bias_s, alibi_stride_b, scale_log2, seed, philox_off, num_heads_q, seqlen_q, seqlen_k,
                drop_threshold, drop_scale, write_dbias, BIAS_KIND, DROPOUT, DQ_ADD, BLOCK_M, BLOCK_N,
                masked == 1, DELTA_INLINE, UNHOISTED, DP_FIRST)
    else:
        # Without GROUP_LOOP (Hq == Hk) the loop has one step, which the compiler folds away: no loop around
        # the two inner loops keeps their state live (7-17% faster at 128 wide on the H200: NOTES.md, v5).
        # With it, nothing is hoisted out of the head loop: hoisted values stay live across both inner
        # loops and spill (sm_90 bf16 D=128: 248 -> 56 bytes of stack; GQA backward 0-5% faster, NOTES.md v9).
        for g in tl.range(0, kv_group_size if GROUP_LOOP else 1, disable_licm=GROUP_LOOP):
            dk, dv = _dkdv_head_loops(
                dk, dv, k, v, n0, keys, lo, full_lo, full_hi, hi, hk * kv_group_size + g, b, b64, q_row0, stats_row0,
                sq, sk, off, left, right, Q, dO, Lse2, Delta, Out, DqAcc, DqOrder, Bias, dS, Alibi, offs_m, offs_dqk, offs_dv,
                dqk_ok, dv_ok, stride_q_b, stride_q_s, stride_q_h, stride_do_b, stride_do_s, stride_do_h,
                stride_o_b, stride_o_s, stride_o_h, stride_dqacc_b, stride_dqacc_s, stride_dqacc_h,
                stride_ds_b, stride_ds_h, stride_ds_s,
                stride_delta_b, stride_delta_h, stride_bias_b, stride_bias_h,
                stride_bias_s, alibi_stride_b, scale_log2, seed, philox_off, num_heads_q, seqlen_q, seqlen_k,
                drop_threshold, drop_scale, write_dbias, BIAS_KIND, DROPOUT, DQ_ADD, BLOCK_M, BLOCK_N,
                DELTA_INLINE, UNHOISTED, DP_FIRST)

    tl.store(dK + b64 * stride_dk_b + k_row0 * stride_dk_s + hk64 * stride_dk_h
             + offs_n[:, None] * stride_dk_s + offs_dqk[None, :], (dk * softmax_scale).to(dK.dtype.element_ty),
             mask=k_ok[:, None] & dqk_ok[None, :])
    tl.store(dV + b64 * stride_dv_b + k_row0 * stride_dv_s + hk64 * stride_dv_h
             + offs_n[:, None] * stride_dv_s + offs_dv[None, :], dv.to(dV.dtype.element_ty),
             mask=k_ok[:, None] & dv_ok[None, :])


@triton.jit
def fmha_bwd_dkdv(

    Q, K, V, dO, Lse2, Delta, dK, dV, DqAcc, Bias, dS, Alibi, PhiloxSeedOffset,
    CuSeqlensQ, CuSeqlensK, SeqstartQ, SeqstartK,
    stride_q_b, stride_q_s, stride_q_h,
    stride_k_b, stride_k_s, stride_k_h,
    stride_v_b, stride_v_s, stride_v_h,
    stride_do_b, stride_do_s, stride_do_h,
    stride_dk_b, stride_dk_s, stride_dk_h,
    stride_dv_b, stride_dv_s, stride_dv_h,
    stride_dqacc_b, stride_dqacc_s, stride_dqacc_h,
    stride_ds_b, stride_ds_h, stride_ds_s,
    stride_delta_b, stride_delta_h,
    stride_bias_b, stride_bias_h, stride_bias_s,
    alibi_stride_b,
    seqlen_q, seqlen_k, num_heads_q, kv_group_size, head_dim_qk_div8, head_dim_v_div8,
    softmax_scale, scale_log2, window_left, window_right, bottom_right, is_varlen, has_seqstart,
    write_dbias, drop_threshold, drop_scale, philox_seed, philox_offset, philox_from_ptr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
    BIAS_KIND: tl.constexpr, DROPOUT: tl.constexpr, DQ_ATOMIC: tl.constexpr, FLAT_LOOP: tl.constexpr,
    GROUP_LOOP: tl.constexpr, DP_FIRST: tl.constexpr,
):
    _dkdv_program(
        tl.program_id(0), tl.program_id(1), tl.program_id(2),  # dO stands in for Out, read only with DELTA_INLINE
        Q, K, V, dO, Lse2, Delta, dO, dK, dV, DqAcc, None, Bias, dS, Alibi, PhiloxSeedOffset, CuSeqlensQ, CuSeqlensK,
        SeqstartQ, SeqstartK, stride_q_b, stride_q_s, stride_q_h, stride_k_b, stride_k_s, stride_k_h,
        stride_v_b, stride_v_s, stride_v_h, stride_do_b, stride_do_s, stride_do_h, stride_do_b, stride_do_s,
        stride_do_h, stride_dk_b, stride_dk_s,
        stride_dk_h, stride_dv_b, stride_dv_s, stride_dv_h, stride_dqacc_b, stride_dqacc_s, stride_dqacc_h,
        stride_ds_b, stride_ds_h, stride_ds_s, stride_delta_b, stride_delta_h, stride_bias_b, stride_bias_h,
        stride_bias_s, alibi_stride_b, seqlen_q, seqlen_k, num_heads_q, kv_group_size, head_dim_qk_div8,
        head_dim_v_div8, softmax_scale, scale_log2, window_left, window_right, bottom_right, is_varlen,
        has_seqstart, write_dbias, drop_threshold, drop_scale, philox_seed, philox_offset, philox_from_ptr,
        BLOCK_M, BLOCK_N, BLOCK_DQK, BLOCK_DV, BIAS_KIND, DROPOUT, DQ_ADD_ATOMIC if DQ_ATOMIC else DQ_ADD_NONE,
        FLAT_LOOP, GROUP_LOOP, False, False, DP_FIRST)


@triton.jit
def fmha_bwd_dkdv_ordered(
    Q, K, V, dO, Lse2, Delta, dK, dV, DqAcc, DqOrder, Bias, dS, Alibi, PhiloxSeedOffset,
    CuSeqlensQ, CuSeqlensK, SeqstartQ, SeqstartK,
    stride_q_b, stride_q_s, stride_q_h,
    stride_k_b, stride_k_s, stride_k_h,
    stride_v_b, stride_v_s, stride_v_h,
    stride_do_b, stride_do_s, stride_do_h,
    stride_dk_b, stride_dk_s, stride_dk_h,
    stride_dv_b, stride_dv_s, stride_dv_h,
    stride_dqacc_b, stride_dqacc_s, stride_dqacc_h,
    stride_ds_b, stride_ds_h, stride_ds_s,
    stride_delta_b, stride_delta_h,
    stride_bias_b, stride_bias_h, stride_bias_s,
    alibi_stride_b,
    seqlen_q, seqlen_k, num_heads_q, kv_group_size, head_dim_qk_div8, head_dim_v_div8,
    softmax_scale, scale_log2, window_left, window_right, bottom_right, is_varlen, has_seqstart,
    write_dbias, drop_threshold, drop_scale, philox_seed, philox_offset, philox_from_ptr, batch,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
    BIAS_KIND: tl.constexpr, DROPOUT: tl.constexpr, FLAT_LOOP: tl.constexpr,
    GROUP_LOOP: tl.constexpr, DP_FIRST: tl.constexpr,
):
    """The ORDERED strategy's dK/dV pass, persistent: any number of programs take work items (key block,
    key head, batch entry) by ticket until none is left, and each item's dQ shares go into the fp32
    accumulator DqAcc in key-block order (dq_order.py: the order region DqOrder, and why every item
    finishes). Items are numbered key block slowest, so that programs running at once mostly hold other
    heads' items (no waiting), and the first key blocks, which see the most query blocks under a causal
    mask, come first (longest first). Every output tile has one writer or one order of additions, so the
    result does not depend on the number of programs or on timing."""
    heads_k = num_heads_q // kv_group_size
    slots = heads_k * batch
    items = tl.cdiv(seqlen_k, BLOCK_N) * slots
    item = next_item(DqOrder)
    while item < items:
        slot = item % slots
        _dkdv_program(
            item // slots, slot % heads_k, slot // heads_k,  # dO stands in for Out, as in fmha_bwd_dkdv
            Q, K, V, dO, Lse2, Delta, dO, dK, dV, DqAcc, DqOrder, Bias, dS, Alibi, PhiloxSeedOffset, CuSeqlensQ,
            CuSeqlensK, SeqstartQ, SeqstartK, stride_q_b, stride_q_s, stride_q_h, stride_k_b, stride_k_s,
            stride_k_h, stride_v_b, stride_v_s, stride_v_h, stride_do_b, stride_do_s, stride_do_h, stride_do_b,
            stride_do_s, stride_do_h, stride_dk_b, stride_dk_s, stride_dk_h, stride_dv_b, stride_dv_s,
            stride_dv_h, stride_dqacc_b, stride_dqacc_s, stride_dqacc_h, stride_ds_b, stride_ds_h, stride_ds_s,
            stride_delta_b, stride_delta_h, stride_bias_b, stride_bias_h, stride_bias_s, alibi_stride_b,
            seqlen_q, seqlen_k, num_heads_q, kv_group_size, head_dim_qk_div8, head_dim_v_div8, softmax_scale,
            scale_log2, window_left, window_right, bottom_right, is_varlen, has_seqstart, write_dbias,
            drop_threshold, drop_scale, philox_seed, philox_offset, philox_from_ptr,
            BLOCK_M, BLOCK_N, BLOCK_DQK, BLOCK_DV, BIAS_KIND, DROPOUT, DQ_ADD_ORDERED, FLAT_LOOP, GROUP_LOOP,
            False, False, DP_FIRST)
        item = next_item(DqOrder)


@triton.jit
def _dq_key_block(dq, q, do, lse2, delta, K_rows, V_rows, n0, rows, q_ok, offs_n, offs_dqk, offs_dv,
                  dqk_ok, dv_ok, stride_k_s, stride_v_s, sk, off, left, right, scale_log2, Bias_rows,
                  stride_bias_s, q_local, slope_log2, seed, row_counters, drop_threshold, drop_scale,
                  needs_mask, BIAS_KIND: tl.constexpr, DROPOUT: tl.constexpr, BLOCK_N: tl.constexpr,
                  KEYS_COMPLETE: tl.constexpr):
    """Adds key block n0's share to dQ. KEYS_COMPLETE: every key of the block exists (a mask-free block
    of the split loop), so the K and V loads need no key mask."""
    keys = n0 + offs_n
    K_blk = K_rows + tl.cast(n0, tl.int64) * stride_k_s + offs_n[None, :] * stride_k_s + offs_dqk[:, None]
    V_blk = V_rows + tl.cast(n0, tl.int64) * stride_v_s + offs_n[None, :] * stride_v_s + offs_dv[:, None]
    if KEYS_COMPLETE:
        kT = tl.load(K_blk, mask=dqk_ok[:, None], other=0.0)
        vT = tl.load(V_blk, mask=dv_ok[:, None], other=0.0)
    else:
        kT = tl.load(K_blk, mask=(keys < sk)[None, :] & dqk_ok[:, None], other=0.0)
        vT = tl.load(V_blk, mask=(keys < sk)[None, :] & dv_ok[:, None], other=0.0)
    s, scale = scores(tl.dot(q, kT), rows[:, None], keys[None, :], q_ok[:, None], off, left, right, sk, Bias_rows,
                      stride_bias_s, q_local[:, None], slope_log2, scale_log2, False, BIAS_KIND)
    if needs_mask:  # a runtime branch, as in the dK/dV kernel
        s = tl.where(visible(rows[:, None], keys[None, :], off, left, right, sk), s, float("-inf"))
    p = tl.exp2(s * scale - lse2[:, None])
    dp = tl.dot(do, vT)
    if DROPOUT:
        keep = dropout_draws(seed, row_counters, n0, BLOCK_N) >= drop_threshold.to(tl.uint32)
        dp = tl.where(keep, dp * drop_scale, 0.0)
    ds = p * (dp - delta[:, None])
    return dq + tl.dot(ds.to(kT.dtype), tl.trans(kT))


@triton.jit
def _dq_program(
    m_block, h, b,
    Q, K, V, Out, dO, Lse, Delta, Lse2, dQ, Bias, Alibi, PhiloxSeedOffset,
    CuSeqlensQ, CuSeqlensK, SeqstartQ, SeqstartK,
    stride_q_b, stride_q_s, stride_q_h,
    stride_k_b, stride_k_s, stride_k_h,
    stride_v_b, stride_v_s, stride_v_h,
    stride_o_b, stride_o_s, stride_o_h,
    stride_do_b, stride_do_s, stride_do_h,
    stride_dq_b, stride_dq_s, stride_dq_h,
    lse_stride_b, lse_stride_h, stride_delta_b, stride_delta_h,
    stride_bias_b, stride_bias_h, stride_bias_s,
    alibi_stride_b,
    seqlen_q, seqlen_k, num_heads_q, kv_group_size, head_dim_qk_div8, head_dim_v_div8,
    softmax_scale, scale_log2, window_left, window_right, bottom_right, is_varlen, has_seqstart,
    drop_threshold, drop_scale, philox_seed, philox_offset, philox_from_ptr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
    BIAS_KIND: tl.constexpr, DROPOUT: tl.constexpr,
    DELTA_IN: tl.constexpr, DELTA_OUT: tl.constexpr, SPLIT_KEY_LOOP: tl.constexpr,
):
    """dQ of query block m_block of query head h, batch entry b (fmha_bwd_dq, which computes Delta and
    Lse2 and writes them for its dK/dV pass: DELTA_OUT; and the query-block programs of fmha_bwd_fused,
    which read them from the pre-pass, DELTA_IN, or compute them for themselves with DELTA_INLINE).
    SPLIT_KEY_LOOP: the mask-free key blocks in a loop of their own, without key or element masks, then
    the masked ones (the fused grid: its loop 534 -> 294 instructions on sm_90, +1.7% at D=128 16k with
    one query head per kv head, NOTES.md v11); otherwise one loop whose mask is a runtime branch (in the
    dQ kernel alone the split measured within noise, v7)."""
    q_start, sq = sequence_extent(CuSeqlensQ, SeqstartQ, b, seqlen_q, is_varlen, has_seqstart)
    k_start, sk = sequence_extent(CuSeqlensK, SeqstartK, b, seqlen_k, is_varlen, has_seqstart)
    m0 = m_block * BLOCK_M
    if m0 >= sq:
        return
    off = tl.where(bottom_right != 0, sk - sq, 0)
    left, right = window_sides(window_left, window_right, sq, sk)
    hk = h // kv_group_size
    b64, h64, hk64 = b.to(tl.int64), h.to(tl.int64), hk.to(tl.int64)

    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_dqk = tl.arange(0, BLOCK_DQK)
    offs_dv = tl.arange(0, BLOCK_DV)
    rows = m0 + offs_m
    q_ok = rows < sq
    dqk_ok = offs_dqk < head_dim_qk_div8 * 8
    dv_ok = offs_dv < head_dim_v_div8 * 8
    q_row0 = (q_start + m0).to(tl.int64)
    q = tl.load(Q + b64 * stride_q_b + q_row0 * stride_q_s + h64 * stride_q_h
                + offs_m[:, None] * stride_q_s + offs_dqk[None, :], mask=q_ok[:, None] & dqk_ok[None, :], other=0.0)
    do = tl.load(dO + b64 * stride_do_b + q_row0 * stride_do_s + h64 * stride_do_h
                 + offs_m[:, None] * stride_do_s + offs_dv[None, :], mask=q_ok[:, None] & dv_ok[None, :], other=0.0)
    rows_out = b64 * stride_delta_b + h64 * stride_delta_h + row_stats_start(q_start, b, is_varlen) + m0 + offs_m
    if DELTA_IN:  # written by the pre-pass (the fused grid's dK/dV programs run beside this one)
        delta = tl.load(Delta + rows_out, mask=q_ok, other=0.0)
        lse2 = tl.load(Lse2 + rows_out, mask=q_ok, other=float("inf"))
    else:
        o = tl.load(Out + b64 * stride_o_b + q_row0 * stride_o_s + h64 * stride_o_h
                    + offs_m[:, None] * stride_o_s + offs_dv[None, :], mask=q_ok[:, None] & dv_ok[None, :],
                    other=0.0)
        delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
        lse2 = _log2_lse(Lse + b64 * lse_stride_b + h64 * lse_stride_h + q_row0, offs_m, q_ok)
        if DELTA_OUT:
            tl.store(Delta + rows_out, delta, mask=q_ok)
            tl.store(Lse2 + rows_out, lse2, mask=q_ok)  # the dK/dV pass reads it ready, without the -inf test
    K_rows = K + b64 * stride_k_b + k_start.to(tl.int64) * stride_k_s + hk64 * stride_k_h
    V_rows = V + b64 * stride_v_b + k_start.to(tl.int64) * stride_v_s + hk64 * stride_v_h
    Bias_rows = Bias + b64 * stride_bias_b + h64 * stride_bias_h + tl.cast(m0, tl.int64) * stride_bias_s
    slope_log2 = 0.0
    if BIAS_KIND == KIND_ALIBI:
        slope_log2 = tl.load(Alibi + b64 * alibi_stride_b + h) * LOG2E
    seed, row_counters = 0, rows
    if DROPOUT:
        seed, philox_off = philox_seed_offset(philox_seed, philox_offset, PhiloxSeedOffset, philox_from_ptr)
        row_counters = dropout_row_counters(philox_off, b * num_heads_q + h, seqlen_q, seqlen_k, rows)

    dq = tl.zeros([BLOCK_M, BLOCK_DQK], dtype=tl.float32)
    lo, full_lo, full_hi, hi = key_blocks(m0, sk, off, left, right, BLOCK_M, BLOCK_N)
    if SPLIT_KEY_LOOP:
        for blk in range(full_lo, full_hi):
            dq = _dq_key_block(dq, q, do, lse2, delta, K_rows, V_rows, blk * BLOCK_N, rows, q_ok, offs_n, offs_dqk,
                               offs_dv, dqk_ok, dv_ok, stride_k_s, stride_v_s, sk, off, left, right, scale_log2,
                               Bias_rows, stride_bias_s, offs_m, slope_log2, seed, row_counters, drop_threshold,
                               drop_scale, False, BIAS_KIND, DROPOUT, BLOCK_N, True)
        for t in range(0, (full_lo - lo) + (hi - full_hi)):
            dq = _dq_key_block(dq, q, do, lse2, delta, K_rows, V_rows, masked_block(t, lo, full_lo, full_hi) * BLOCK_N,
                               rows, q_ok, offs_n, offs_dqk,
                               offs_dv, dqk_ok, dv_ok, stride_k_s, stride_v_s, sk, off, left, right, scale_log2,
                               Bias_rows, stride_bias_s, offs_m, slope_log2, seed, row_counters, drop_threshold,
                               drop_scale, True, BIAS_KIND, DROPOUT, BLOCK_N, False)
    else:
        for blk in range(lo, hi):
            dq = _dq_key_block(dq, q, do, lse2, delta, K_rows, V_rows, blk * BLOCK_N, rows, q_ok, offs_n, offs_dqk,
                               offs_dv, dqk_ok, dv_ok, stride_k_s, stride_v_s, sk, off, left, right, scale_log2,
                               Bias_rows, stride_bias_s, offs_m, slope_log2, seed, row_counters, drop_threshold,
                               drop_scale, (blk < full_lo) | (blk >= full_hi), BIAS_KIND, DROPOUT, BLOCK_N, False)
    tl.store(dQ + b64 * stride_dq_b + q_row0 * stride_dq_s + h64 * stride_dq_h
             + offs_m[:, None] * stride_dq_s + offs_dqk[None, :], (dq * softmax_scale).to(dQ.dtype.element_ty),
             mask=q_ok[:, None] & dqk_ok[None, :])


@triton.jit
def fmha_bwd_dq(

    Q, K, V, Out, dO, Lse, Delta, Lse2, dQ, Bias, Alibi, PhiloxSeedOffset,
    CuSeqlensQ, CuSeqlensK, SeqstartQ, SeqstartK,
    stride_q_b, stride_q_s, stride_q_h,
    stride_k_b, stride_k_s, stride_k_h,
    stride_v_b, stride_v_s, stride_v_h,
    stride_o_b, stride_o_s, stride_o_h,
    stride_do_b, stride_do_s, stride_do_h,
    stride_dq_b, stride_dq_s, stride_dq_h,
    lse_stride_b, lse_stride_h, stride_delta_b, stride_delta_h,
    stride_bias_b, stride_bias_h, stride_bias_s,
    alibi_stride_b,
    seqlen_q, seqlen_k, num_heads_q, kv_group_size, head_dim_qk_div8, head_dim_v_div8,
    softmax_scale, scale_log2, window_left, window_right, bottom_right, is_varlen, has_seqstart,
    drop_threshold, drop_scale, philox_seed, philox_offset, philox_from_ptr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
    BIAS_KIND: tl.constexpr, DROPOUT: tl.constexpr,
):
    _dq_program(
        tl.num_programs(0) - 1 - tl.program_id(0), tl.program_id(1), tl.program_id(2),
        Q, K, V, Out, dO, Lse, Delta, Lse2, dQ, Bias, Alibi, PhiloxSeedOffset, CuSeqlensQ, CuSeqlensK,
        SeqstartQ, SeqstartK, stride_q_b, stride_q_s, stride_q_h, stride_k_b, stride_k_s, stride_k_h,
        stride_v_b, stride_v_s, stride_v_h, stride_o_b, stride_o_s, stride_o_h, stride_do_b, stride_do_s,
        stride_do_h, stride_dq_b, stride_dq_s, stride_dq_h, lse_stride_b, lse_stride_h, stride_delta_b,
        stride_delta_h, stride_bias_b, stride_bias_h, stride_bias_s, alibi_stride_b, seqlen_q, seqlen_k,
        num_heads_q, kv_group_size, head_dim_qk_div8, head_dim_v_div8, softmax_scale, scale_log2, window_left,
        window_right, bottom_right, is_varlen, has_seqstart, drop_threshold, drop_scale, philox_seed,
        philox_offset, philox_from_ptr, BLOCK_M, BLOCK_N, BLOCK_DQK, BLOCK_DV, BIAS_KIND, DROPOUT, False,
        True, False)


@triton.jit
def fmha_bwd_fused(
    Q, K, V, Out, dO, Lse, Delta, Lse2, dQ, dK, dV, Bias, dS, Alibi, PhiloxSeedOffset,
    CuSeqlensQ, CuSeqlensK, SeqstartQ, SeqstartK,
    stride_q_b, stride_q_s, stride_q_h,
    stride_k_b, stride_k_s, stride_k_h,
    stride_v_b, stride_v_s, stride_v_h,
    stride_o_b, stride_o_s, stride_o_h,
    stride_do_b, stride_do_s, stride_do_h,
    stride_dq_b, stride_dq_s, stride_dq_h,
    stride_dk_b, stride_dk_s, stride_dk_h,
    stride_dv_b, stride_dv_s, stride_dv_h,
    stride_ds_b, stride_ds_h, stride_ds_s,
    lse_stride_b, lse_stride_h, stride_delta_b, stride_delta_h,
    stride_bias_b, stride_bias_h, stride_bias_s,
    alibi_stride_b,
    seqlen_q, seqlen_k, num_heads_q, kv_group_size, head_dim_qk_div8, head_dim_v_div8,
    softmax_scale, scale_log2, window_left, window_right, bottom_right, is_varlen, has_seqstart,
    write_dbias, drop_threshold, drop_scale, philox_seed, philox_offset, philox_from_ptr,
    BLOCK_M1: tl.constexpr, BLOCK_N1: tl.constexpr, BLOCK_M2: tl.constexpr, BLOCK_N2: tl.constexpr,
    BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr, BIAS_KIND: tl.constexpr, DROPOUT: tl.constexpr,
    GROUP_LOOP: tl.constexpr, DELTA_INLINE: tl.constexpr,
):
    """dK/dV and dQ in one grid, after fmha_bwd_preprocess has written Delta and Lse2 (or, with
    DELTA_INLINE, the whole backward in one launch: each program computes Delta and Lse2 of the rows it
    visits from O, dO and the LSE, which costs the dK/dV programs a load of O per step): per (kv head,
    batch entry), first one program per key block (BLOCK_N1 keys, BLOCK_M1 query rows per step), then
    one per query block of each query head of the group (BLOCK_M2 rows, BLOCK_N2 keys per step). The
    two kinds share the warp count; the hardware fills one kind's last wave with the other's programs,
    where two launches each end in a part-empty wave. The key-block programs visit their group's
    mask-free (query head, block) steps in one loop and the masked ones in another, with the Q and dO
    tile offsets inside the loop (UNHOISTED; one-head programs of the one-launch backward, DELTA_INLINE,
    keep the per-head nest). With GROUP_LOOP (GQA/MQA) they loop over the group's query heads, so are
    the longest, and all come first. Deterministic like the two-kernel strategy:
    every output tile has one program, which accumulates in a fixed order."""
    key_programs = tl.cdiv(seqlen_k, BLOCK_N1)
    if GROUP_LOOP:
        # Longest first: every (kv head, batch entry)'s key-block programs, each looping over the group's
        # query heads, in the grid's first blocks, all the query-block programs after them; in grid order
        # the last kv heads' long programs started late and ran on alone (NOTES.md v10).
        nx, nh, nb = tl.num_programs(0), tl.num_programs(1), tl.num_programs(2)
        linear = tl.program_id(0) + nx * (tl.program_id(1) + nh * tl.program_id(2))
        all_key_programs = key_programs * nh * nb
        if linear < all_key_programs:
            pid = linear % key_programs
            rest = linear // key_programs
        else:
            pid = key_programs + (linear - all_key_programs) % (nx - key_programs)
            rest = (linear - all_key_programs) // (nx - key_programs)
        hk = rest % nh
        b = rest // nh
    else:
        pid = tl.program_id(0)
        hk = tl.program_id(1)
        b = tl.program_id(2)
    if pid < key_programs:
        # dQ stands in for the atomic strategy's accumulator, which DQ_ADD_NONE never touches
        if DELTA_INLINE:
            rows_lse, rows_stride_b, rows_stride_h = Lse, lse_stride_b, lse_stride_h
        else:
            rows_lse, rows_stride_b, rows_stride_h = Lse2, stride_delta_b, stride_delta_h
        _dkdv_program(
            pid, hk, b, Q, K, V, dO, rows_lse, Delta, Out, dK, dV, dQ, None, Bias, dS, Alibi, PhiloxSeedOffset,
            CuSeqlensQ, CuSeqlensK, SeqstartQ, SeqstartK, stride_q_b, stride_q_s, stride_q_h, stride_k_b,
            stride_k_s, stride_k_h, stride_v_b, stride_v_s, stride_v_h, stride_do_b, stride_do_s, stride_do_h,
            stride_o_b, stride_o_s, stride_o_h, stride_dk_b,
            stride_dk_s, stride_dk_h, stride_dv_b, stride_dv_s, stride_dv_h, 0, 0, 0, stride_ds_b, stride_ds_h,
            stride_ds_s, rows_stride_b, rows_stride_h, stride_bias_b, stride_bias_h, stride_bias_s,
            alibi_stride_b, seqlen_q, seqlen_k, num_heads_q, kv_group_size, head_dim_qk_div8, head_dim_v_div8,
            softmax_scale, scale_log2, window_left, window_right, bottom_right, is_varlen, has_seqstart,
            write_dbias, drop_threshold, drop_scale, philox_seed, philox_offset, philox_from_ptr,
            BLOCK_M1, BLOCK_N1, BLOCK_DQK, BLOCK_DV, BIAS_KIND, DROPOUT, DQ_ADD_NONE, False, GROUP_LOOP, DELTA_INLINE,
            GROUP_LOOP or not DELTA_INLINE, not DELTA_INLINE)
    else:
        query_programs = tl.cdiv(seqlen_q, BLOCK_M2)
        t = pid - key_programs
        g = t // query_programs
        # with DELTA_INLINE the dQ program computes Delta and Lse2 as in the two-kernel strategy and keeps
        # them: the one-launch backward has no workspace
        _dq_program(
            query_programs - 1 - (t - g * query_programs), hk * kv_group_size + g, b, Q, K, V, Out, dO, Lse,
            Delta, Lse2, dQ, Bias, Alibi, PhiloxSeedOffset, CuSeqlensQ, CuSeqlensK, SeqstartQ, SeqstartK,
            stride_q_b, stride_q_s, stride_q_h, stride_k_b, stride_k_s, stride_k_h, stride_v_b, stride_v_s,
            stride_v_h, stride_o_b, stride_o_s, stride_o_h, stride_do_b, stride_do_s, stride_do_h,
            stride_dq_b, stride_dq_s, stride_dq_h, lse_stride_b, lse_stride_h, stride_delta_b,
            stride_delta_h, stride_bias_b, stride_bias_h, stride_bias_s, alibi_stride_b, seqlen_q, seqlen_k,
            num_heads_q, kv_group_size, head_dim_qk_div8, head_dim_v_div8, softmax_scale, scale_log2,
            window_left, window_right, bottom_right, is_varlen, has_seqstart, drop_threshold, drop_scale,
            philox_seed, philox_offset, philox_from_ptr, BLOCK_M2, BLOCK_N2, BLOCK_DQK, BLOCK_DV, BIAS_KIND,
            DROPOUT, not DELTA_INLINE, False, True)


@triton.jit
def fmha_bwd_dq_convert(
    DqAcc, dQ, CuSeqlensQ, SeqstartQ,
    stride_dqacc_b, stride_dqacc_s, stride_dqacc_h,
    stride_dq_b, stride_dq_s, stride_dq_h,
    seqlen_q, head_dim_qk_div8, softmax_scale, is_varlen, has_seqstart,
    BLOCK_M: tl.constexpr, BLOCK_DQK: tl.constexpr,
):
    """dQ = softmax_scale * (fp32 workspace of the ATOMIC strategy), in dQ's dtype."""
    h = tl.program_id(1)
    b = tl.program_id(2)
    q_start, sq = sequence_extent(CuSeqlensQ, SeqstartQ, b, seqlen_q, is_varlen, has_seqstart)
    m0 = tl.program_id(0) * BLOCK_M
    if m0 >= sq:
        return
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_DQK)
    ok = (m0 + offs_m < sq)[:, None] & (offs_d < head_dim_qk_div8 * 8)[None, :]
    row0 = (q_start + m0).to(tl.int64)
    b64, h64 = b.to(tl.int64), h.to(tl.int64)
    acc = tl.load(DqAcc + b64 * stride_dqacc_b + row0 * stride_dqacc_s + h64 * stride_dqacc_h
                  + offs_m[:, None] * stride_dqacc_s + offs_d[None, :], mask=ok, other=0.0)
    tl.store(dQ + b64 * stride_dq_b + row0 * stride_dq_s + h64 * stride_dq_h
             + offs_m[:, None] * stride_dq_s + offs_d[None, :], (acc * softmax_scale).to(dQ.dtype.element_ty), mask=ok)


@triton.jit
def fmha_bwd_dbias(
    dS, dBias,
    stride_ds_b, stride_ds_h, stride_ds_s,
    stride_dbias_b, stride_dbias_h, stride_dbias_s,
    seqlen_q, seqlen_k, reduce_batch, reduce_heads,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """dBias[bo, ho] = sum over (b, h) broadcast onto (bo, ho) of dS[b, h], summed batch-major in a
    fixed order (deterministic). reduce_batch / reduce_heads are B and Hq for broadcast dims, else 1."""
    ho = tl.program_id(1)
    bo = tl.program_id(2)
    m0 = tl.program_id(0) * BLOCK_M
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    q_ok = m0 + offs_m < seqlen_q
    m0_64 = tl.cast(m0, tl.int64)
    dS_rows = dS + m0_64 * stride_ds_s + offs_m[:, None] * stride_ds_s
    out_rows = (dBias + bo.to(tl.int64) * stride_dbias_b + ho.to(tl.int64) * stride_dbias_h
                + m0_64 * stride_dbias_s + offs_m[:, None] * stride_dbias_s)
    for n0 in range(0, seqlen_k, BLOCK_N):
        keys = n0 + offs_n
        ok = q_ok[:, None] & (keys < seqlen_k)[None, :]
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for rb in range(0, reduce_batch):
            for rh in range(0, reduce_heads):
                plane = tl.cast(bo + rb, tl.int64) * stride_ds_b + tl.cast(ho + rh, tl.int64) * stride_ds_h
                acc += tl.load(dS_rows + plane + keys[None, :], mask=ok, other=0.0)
        tl.store(out_rows + keys[None, :], acc.to(dBias.dtype.element_ty), mask=ok)
