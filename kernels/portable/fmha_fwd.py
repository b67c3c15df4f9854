"""Portable attention forward: one program per (query block, query head, batch entry).

Online softmax over the visible key blocks: the blocks visible to every row of the query block run a
mask-free body, the few boundary blocks (window edges, causal diagonal, the sequence end) run the same
body with the element mask. Fully masked key blocks are never visited, so causal masking does about half
the work. Writes O (0 for rows that see no key) and LSE in natural log (-inf for those rows).
"""
import triton
import triton.language as tl

from kernels.portable.fmha_common import (KIND_ALIBI, LN2, LOG2E, dropout_draws, dropout_row_counters, key_blocks,
                                          masked_block, philox_seed_offset, scores, sequence_extent, window_sides)


@triton.jit
def _attend_key_block(acc, l_i, m_i, q, K_rows, V_rows, n0, rows, q_ok, offs_n, offs_dqk, offs_dv,
                      dqk_ok, dv_ok, stride_k_s, stride_v_s, sk, off, left, right, scale_log2,
                      Bias_rows, stride_bias_s, q_local, slope_log2, seed, row_counters, drop_threshold,
                      MASKED: tl.constexpr, BIAS_KIND: tl.constexpr, DROPOUT: tl.constexpr,
                      BLOCK_N: tl.constexpr):
    keys = n0 + offs_n
    K_blk = K_rows + tl.cast(n0, tl.int64) * stride_k_s + offs_n[None, :] * stride_k_s + offs_dqk[:, None]
    V_blk = V_rows + tl.cast(n0, tl.int64) * stride_v_s + offs_n[:, None] * stride_v_s + offs_dv[None, :]
    if MASKED:
        kT = tl.load(K_blk, mask=(keys < sk)[None, :] & dqk_ok[:, None], other=0.0)
    else:
        kT = tl.load(K_blk, mask=dqk_ok[:, None], other=0.0)
    s, scale = scores(tl.dot(q, kT), rows[:, None], keys[None, :], q_ok[:, None], off, left, right, sk, Bias_rows,
                      stride_bias_s, q_local[:, None], slope_log2, scale_log2, MASKED, BIAS_KIND)
    m_new = tl.maximum(m_i, tl.max(s, 1) * scale)
    # Rows that have seen no visible key yet keep m = -inf; shifting them by 0 avoids inf - inf.
    m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s * scale - m_shift[:, None])
    alpha = tl.exp2(m_i - m_shift)
    l_i = l_i * alpha + tl.sum(p, 1)
    if DROPOUT:
        p = tl.where(dropout_draws(seed, row_counters, n0, BLOCK_N) >= drop_threshold.to(tl.uint32), p, 0.0)
    if MASKED:
        v = tl.load(V_blk, mask=(keys < sk)[:, None] & dv_ok[None, :], other=0.0)
    else:
        v = tl.load(V_blk, mask=dv_ok[None, :], other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return acc, l_i, m_new


@triton.jit
def fmha_fwd(
    Q, K, V, Out, Lse, Bias, Alibi, PhiloxSeedOffset,
    CuSeqlensQ, CuSeqlensK, SeqstartQ, SeqstartK,
    stride_q_b, stride_q_s, stride_q_h,
    stride_k_b, stride_k_s, stride_k_h,
    stride_v_b, stride_v_s, stride_v_h,
    stride_o_b, stride_o_s, stride_o_h,
    lse_stride_b, lse_stride_h,
    stride_bias_b, stride_bias_h, stride_bias_s,
    alibi_stride_b,
    seqlen_q, seqlen_k, num_heads_q, kv_group_size, head_dim_qk_div8, head_dim_v_div8,
    scale_log2, window_left, window_right, bottom_right, is_varlen, has_seqstart,
    drop_threshold, drop_scale, philox_seed, philox_offset, philox_from_ptr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
    BIAS_KIND: tl.constexpr, DROPOUT: tl.constexpr,
):
    # Heaviest query blocks (last, under causal masking) start first: a shorter tail.
    m_block = tl.num_programs(0) - 1 - tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)
    q_start, sq = sequence_extent(CuSeqlensQ, SeqstartQ, b, seqlen_q, is_varlen, has_seqstart)
    k_start, sk = sequence_extent(CuSeqlensK, SeqstartK, b, seqlen_k, is_varlen, has_seqstart)
    m0 = m_block * BLOCK_M
    if m0 >= sq:
        return
    off = tl.where(bottom_right != 0, sk - sq, 0)
    left, right = window_sides(window_left, window_right, sq, sk)
    hk = h // kv_group_size
    b64 = b.to(tl.int64)

    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_dqk = tl.arange(0, BLOCK_DQK)
    offs_dv = tl.arange(0, BLOCK_DV)
    rows = m0 + offs_m
    q_ok = rows < sq
    # Head dims arrive divided by 8 so the compiler knows the column mask is constant over 8 columns
    # (16-byte loads); the caller pads other head dims with zeros.
    dqk_ok = offs_dqk < head_dim_qk_div8 * 8
    dv_ok = offs_dv < head_dim_v_div8 * 8

    q_row0 = (q_start + m0).to(tl.int64)
    Q_rows = Q + b64 * stride_q_b + q_row0 * stride_q_s + h.to(tl.int64) * stride_q_h
    q = tl.load(Q_rows + offs_m[:, None] * stride_q_s + offs_dqk[None, :],
                mask=q_ok[:, None] & dqk_ok[None, :], other=0.0)
    K_rows = K + b64 * stride_k_b + k_start.to(tl.int64) * stride_k_s + hk.to(tl.int64) * stride_k_h
    V_rows = V + b64 * stride_v_b + k_start.to(tl.int64) * stride_v_s + hk.to(tl.int64) * stride_v_h

    Bias_rows = Bias + b64 * stride_bias_b + h.to(tl.int64) * stride_bias_h + m0.to(tl.int64) * stride_bias_s
    slope_log2 = 0.0
    if BIAS_KIND == KIND_ALIBI:
        slope_log2 = tl.load(Alibi + b64 * alibi_stride_b + h) * LOG2E
    seed, row_counters = 0, rows
    if DROPOUT:
        seed, philox_off = philox_seed_offset(philox_seed, philox_offset, PhiloxSeedOffset, philox_from_ptr)
        row_counters = dropout_row_counters(philox_off, b * num_heads_q + h, seqlen_q, seqlen_k, rows)

    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    lo, full_lo, full_hi, hi = key_blocks(m0, sk, off, left, right, BLOCK_M, BLOCK_N)
    for blk in range(full_lo, full_hi):
        acc, l_i, m_i = _attend_key_block(
            acc, l_i, m_i, q, K_rows, V_rows, blk * BLOCK_N, rows, q_ok, offs_n, offs_dqk, offs_dv,
            dqk_ok, dv_ok, stride_k_s, stride_v_s, sk, off, left, right, scale_log2, Bias_rows,
            stride_bias_s, offs_m, slope_log2, seed, row_counters, drop_threshold,
            False, BIAS_KIND, DROPOUT, BLOCK_N)
    for t in range(0, (full_lo - lo) + (hi - full_hi)):
        blk = masked_block(t, lo, full_lo, full_hi)
        acc, l_i, m_i = _attend_key_block(
            acc, l_i, m_i, q, K_rows, V_rows, blk * BLOCK_N, rows, q_ok, offs_n, offs_dqk, offs_dv,
            dqk_ok, dv_ok, stride_k_s, stride_v_s, sk, off, left, right, scale_log2, Bias_rows,
            stride_bias_s, offs_m, slope_log2, seed, row_counters, drop_threshold,
            True, BIAS_KIND, DROPOUT, BLOCK_N)

    seen = l_i > 0.0
    l_safe = tl.where(seen, l_i, 1.0)
    out = acc * (drop_scale / l_safe)[:, None]
    O_rows = Out + b64 * stride_o_b + q_row0 * stride_o_s + h.to(tl.int64) * stride_o_h
    tl.store(O_rows + offs_m[:, None] * stride_o_s + offs_dv[None, :], out.to(Out.dtype.element_ty),
             mask=q_ok[:, None] & dv_ok[None, :])
    lse = tl.where(seen, m_i * LN2 + tl.log(l_safe), float("-inf"))
    Lse_rows = Lse + b64 * lse_stride_b + h.to(tl.int64) * lse_stride_h + q_row0
    tl.store(Lse_rows + offs_m, lse, mask=q_ok)


@triton.jit
def fmha_dropout_mask(
    Mask, PhiloxSeedOffset,
    mask_stride_b, mask_stride_h, mask_stride_s,
    seqlen_q, seqlen_k, num_heads_q, drop_threshold, philox_seed, philox_offset, philox_from_ptr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Writes the keep mask (uint8 [B, Hq, Sq, Sk], 1 = kept) that fmha_fwd and the backward draw for
    the same seed and offset, so that tests can hand it to a reference implementation."""
    h = tl.program_id(1)
    b = tl.program_id(2)
    m0 = tl.program_id(0) * BLOCK_M
    rows = m0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    seed, philox_off = philox_seed_offset(philox_seed, philox_offset, PhiloxSeedOffset, philox_from_ptr)
    row_counters = dropout_row_counters(philox_off, b * num_heads_q + h, seqlen_q, seqlen_k, rows)
    Mask_rows = (Mask + b.to(tl.int64) * mask_stride_b + h.to(tl.int64) * mask_stride_h
                 + tl.cast(m0, tl.int64) * mask_stride_s + tl.arange(0, BLOCK_M)[:, None] * mask_stride_s)
    for n0 in range(0, seqlen_k, BLOCK_N):
        keep = dropout_draws(seed, row_counters, n0, BLOCK_N) >= drop_threshold.to(tl.uint32)
        keys = n0 + offs_n
        tl.store(Mask_rows + keys[None, :], keep.to(tl.uint8), mask=(rows < seqlen_q)[:, None] & (keys < seqlen_k)[None, :])
