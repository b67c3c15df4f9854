"""Hopper attention backward for wide heads (family v3, the 256 tiles), dK and dV with dQ added into an fp32
accumulator, written in Gluon: the atomic strategy of kernels/v3/fmha_bwd.py for head dims up to 256.

Why a kernel of its own: fmha_bwd.py gives each consumer warpgroup 64 keys with their whole dK and dV
rows, which at D=256 are 2 x 64 x 256 fp32, 256 registers a thread. Here the two consumers share one
block of 64 keys and split the head dims instead: consumer c accumulates dK[:, half c] and dV[:, half c]
(2 x 64 x 128 fp32: 128 registers). The products over the whole head dim are not repeated but divided:
a step (one query block of 64 rows of one query head of the group) goes

- consumer 0: S = Q K^T, P = exp2(S - Lse2) (masked on edge blocks), P to shared memory;
- consumer 1: dP = dO V^T, then, once P is in, dS = P (dP - Delta), dS to shared memory;
- both: dV[:, half] += P^T dO[:, half], dK[:, half] += dS^T Q[:, half] (from shared memory), and
  dQ[:, half] = dS K[:, half] in four [64, 32] quarters, each added to the accumulator by one bulk TMA
  reduction through a [64, 32] fp32 buffer of the consumer's own.

The 192/128 heads run fmha_bwd.py's own tile of two consumers of keys (v3.32-v3.33: 1.28-1.39x this program's
(192, 128) tile, which held Q and K as 128 + 64 columns).

P and dS have one buffer each: consumer 0 writes the next P once both consumers' products have read the
last (an mbarrier of count 2), consumer 1 the next dS likewise. Q and dO come through a ring of STAGES
buffers by (row, query head, dim) descriptors that serve the group, K and V once, all by the backward's loaders
(kernels/v3/common.py). dK (times the softmax scale) and dV leave through the shared memory of K and V by TMA.

fmha_bwd.py's entry points (fmha_bwd_dkdv, and fmha_bwd_dkdv_ordered for the ORDERED form) run this
program in the 256 tiles: one signature, one ticket and one set of checks for both kernels. Shared memory
at D=256: K and V 64 KiB, the Q and dO ring 128 KiB, P and dS 16 KiB, dQ buffers 16 KiB, the ring's Lse2 and Delta
rows (Lse2 comes with Q, Delta with dO: kernels/v3/common.py) 1 KiB. The barrier
protocol is modelled in tests/cpu/test_barrier_protocols.py: a change to a wait, an arrival or a parity here
changes it there.
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

import triton.language as tl

from kernels.v3.common import (STAGES, backward_rows, bulk_writes_wait, complete_and_release, fence_async_global,
                               heads_descriptor, key_block_rank, key_block_steps, load_keys_and_query_blocks, order_counters,
                               query_step, row_stats_layout, rows_descriptor, sequence_extent, tma_add_shared_to_global,
                               visible)

DQ_COLUMNS = gl.constexpr(32)  # a dQ quarter: [BLOCK_M, 32] fp32, one bulk reduction


@gluon.jit
def _add_dq(ds_smem, k_src, COL0: gl.constexpr, COLS: gl.constexpr, DQ_COL0: gl.constexpr, dq_buf, dq_desc, m0, head,
            BLOCK_M: gl.constexpr):
    """dQ[:, DQ_COL0:DQ_COL0 + COLS] = dS K[:, those columns] (held in `k_src` from its column COL0), quarter by
    quarter, each added to the accumulator by one bulk reduction once the previous one has read the buffer."""
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, DQ_COLUMNS, 16])
    for i in gl.static_range(COLS // DQ_COLUMNS):
        dq = warpgroup_mma(ds_smem, k_src.slice(COL0 + i * DQ_COLUMNS, DQ_COLUMNS, dim=1),
                           gl.zeros([BLOCK_M, DQ_COLUMNS], gl.float32, dq_layout), use_acc=False, is_async=True)
        dq = warpgroup_mma_wait(0, deps=(dq,))
        tma.store_wait(0)
        dq_buf.reshape([BLOCK_M, DQ_COLUMNS]).store(dq)
        fence_async_shared()
        tma_add_shared_to_global(dq_desc, [m0, head, DQ_COL0 + i * DQ_COLUMNS], dq_buf)


@gluon.jit
def _consumer(c: gl.constexpr, k_smem, v_smem, q_smem, do_smem, p_smem, ds_smem, dq_smem, kv_ready,
              q_ready, q_empty, p_full, p_empty, ds_full, ds_empty, dq_done, stats_smem, dq_rows, stride_dq_s, stride_dq_h,
              num_heads_q, dk_rows, stride_dk_s, dv_rows, stride_dv_s, dqk, dv_dims, counters,
              counters_per_head, h0, n0, lo, blocks, full_lo, full_hi, n_steps, sq, sk, kv_group_size, off, left, right,
              scale_log2, softmax_scale, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_DQK: gl.constexpr,
              BLOCK_DV: gl.constexpr, ORDERED: gl.constexpr):
    """Consumer c: its share of dK's and dV's columns and of dQ's additions (the module docstring)."""
    DK_COLS: gl.constexpr = BLOCK_DQK // 2
    DK_COL0: gl.constexpr = c * DK_COLS
    HALF_DV: gl.constexpr = BLOCK_DV // 2
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    dk_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, DK_COLS, 16])
    dv_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, HALF_DV, 16])
    rows_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    dtype: gl.constexpr = q_smem.dtype
    dq_buf = dq_smem.index(c)
    QUARTERS: gl.constexpr = DK_COLS // DQ_COLUMNS  # a consumer's dQ additions (bulk groups) a step
    dk = gl.zeros([BLOCK_N, DK_COLS], gl.float32, dk_layout)
    dv = gl.zeros([BLOCK_N, HALF_DV], gl.float32, dv_layout)
    # This consumer's descriptors, made while the loaders' first copies fly: dK by its columns and dV by halves
    # of the head dims, in K's and V's swizzles (they leave through K's and V's memory), and the fp32 dQ accumulator
    dk_out_layout: gl.constexpr = k_smem.layout
    dv_out_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HALF_DV], dtype)
    v_layout: gl.constexpr = v_smem.layout
    gl.static_assert(dv_out_layout.swizzle_byte_width == v_layout.swizzle_byte_width, "dV's tiles take V's swizzle")
    dq_acc_layout: gl.constexpr = dq_smem.layout
    dk_desc = rows_descriptor(dk_rows, stride_dk_s, sk, dqk, [BLOCK_N, DK_COLS], dk_out_layout)
    dv_desc = rows_descriptor(dv_rows, stride_dv_s, sk, dv_dims, [BLOCK_N, HALF_DV], dv_out_layout)
    dq_desc = heads_descriptor(dq_rows, stride_dq_s, stride_dq_h, sq, num_heads_q, dqk, BLOCK_M, DQ_COLUMNS, dq_acc_layout)
    token = n0  # orders the ORDERED form's waits and fences
    previous = counters
    mbarrier.wait(kv_ready, 0)
    for t in tl.range(n_steps, disable_licm=True):
        stage = t % STAGES
        g, block = query_step(t, lo, blocks, kv_group_size, ORDERED)
        m0 = block * BLOCK_M
        mbarrier.wait(q_ready.index(stage), (t // STAGES) & 1)
        # the [BLOCK_M, 1, D] tiles of the 3-D (rows, heads, dims) copies, as the [BLOCK_M, D] the products take
        q_j = q_smem.index(stage).reshape([BLOCK_M, BLOCK_DQK])
        do_j = do_smem.index(stage).reshape([BLOCK_M, BLOCK_DV])
        if c == 0:  # S, P
            # the block's Lse2 came with Q (load_keys_and_query_blocks), Delta with dO; zeros past the sequence's
            # end, where Q and dO are zeros too: P is 1 there and dS 0, which adds nothing to dV and dK
            lse2 = stats_smem.index(2 * stage).reshape([BLOCK_M]).load(rows_layout)
            s = warpgroup_mma(q_j, k_smem.permute((1, 0)), gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout),
                              use_acc=False, is_async=True)
            s = warpgroup_mma_wait(0, deps=(s,))
            if (block < full_lo) | (block >= full_hi):  # a block on a window edge or the sequence's end
                queries = m0 + gl.arange(0, BLOCK_M, layout=rows_layout)
                keys = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
                s = gl.where(visible(queries[:, None], keys[None, :], off, left, right, sk), s, float("-inf"))
            p = gl.exp2(s * scale_log2 - lse2[:, None])
            mbarrier.wait(p_empty, (t & 1) ^ 1)  # both consumers' products have read the last P
            p_smem.store(p.to(dtype))
            fence_async_shared()
            mbarrier.arrive(p_full)
        else:  # dP, then dS once P is in
            delta = stats_smem.index(2 * stage + 1).reshape([BLOCK_M]).load(rows_layout)
            dp = warpgroup_mma(do_j, v_smem.permute((1, 0)), gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout),
                               use_acc=False, is_async=True)
            dp = warpgroup_mma_wait(0, deps=(dp,))
            mbarrier.wait(p_full, t & 1)
            p = p_smem.load(s_layout).to(gl.float32)
            mbarrier.wait(ds_empty, (t & 1) ^ 1)  # both consumers' products have read the last dS
            ds_smem.store((p * (dp - delta[:, None])).to(dtype))
            fence_async_shared()
            mbarrier.arrive(ds_full)
        if c == 0:  # (consumer 1 made dS, after P was in)
            mbarrier.wait(ds_full, t & 1)
        dv = warpgroup_mma(p_smem.permute((1, 0)), do_j.slice(c * HALF_DV, HALF_DV, dim=1), dv, is_async=True)
        dk = warpgroup_mma(ds_smem.permute((1, 0)), q_j.slice(DK_COL0, DK_COLS, dim=1), dk, is_async=True)
        dv, dk = warpgroup_mma_wait(0, deps=(dv, dk))
        mbarrier.arrive(p_empty)
        mbarrier.arrive(q_empty.index(stage))  # Q and dO are read: the loader may bring the step after next
        if ORDERED:  # the tile's smaller key blocks are in (kernels/portable/dq_order.py)
            counter = counters + g * counters_per_head + block
            while gl.atomic_add(counter, 0, sem="acquire") != key_block_rank(n0, m0, off, left, BLOCK_N):
                pass
            token = fence_async_global(token)
        _add_dq(ds_smem, k_smem, DK_COL0, DK_COLS, DK_COL0, dq_buf, dq_desc, m0, h0 + g, BLOCK_M)
        if ORDERED:
            if t > 0:  # the previous step's additions, both consumers', are complete: count this key block in
                token = complete_and_release(c, previous, dq_done, t - 1, bulk_writes_wait(QUARTERS, token))
            previous = counter
        mbarrier.arrive(ds_empty)
    if n_steps > 0:
        if ORDERED:
            complete_and_release(c, previous, dq_done, n_steps - 1, bulk_writes_wait(0, token))
        # The other consumer's last dQ products read every column of K: wait for them before K's memory takes dK.
        last = n_steps - 1
        mbarrier.wait(ds_empty, last & 1)
    tma.store_wait(0)
    # dK and dV leave through K's and V's shared memory, each consumer's columns in a tile of their own
    dk_stage = k_smem._reinterpret(dtype, [2, BLOCK_N, DK_COLS], dk_desc.layout).index(c)
    dv_stage = v_smem._reinterpret(dtype, [2, BLOCK_N, HALF_DV], dv_desc.layout).index(c)
    dk_stage.store((dk * softmax_scale).to(dtype))  # keys no query sees get zeros
    dv_stage.store(dv.to(dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(dk_desc, [n0, DK_COL0], dk_stage)
    tma.async_copy_shared_to_global(dv_desc, [n0, c * HALF_DV], dv_stage)
    tma.store_wait(0)


@gluon.jit
def wide_program(
    n_block, hk, b, DqOrder,
    Q, K, V, dO, Lse2, Delta, dK, dV, DqAcc, CuSeqlensQ, CuSeqlensK, SeqstartQ, SeqstartK,
    stride_q_b, stride_q_s, stride_q_h, stride_k_b, stride_k_s, stride_k_h, stride_v_b, stride_v_s, stride_v_h,
    stride_do_b, stride_do_s, stride_do_h, stride_dk_b, stride_dk_s, stride_dk_h, stride_dv_b, stride_dv_s, stride_dv_h,
    stride_dqacc_b, stride_dqacc_s, stride_dqacc_h, stride_delta_b, stride_delta_h,
    seqlen_q, seqlen_k, num_heads_q, kv_group_size, head_dim_qk_div8, head_dim_v_div8,
    softmax_scale, scale_log2, window_left, window_right, bottom_right, is_varlen, has_seqstart,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_DQK: gl.constexpr, BLOCK_DV: gl.constexpr,
    ORDERED: gl.constexpr,
):
    """Key block n_block of key head hk of batch entry b (the module docstring); DqOrder the order region
    of the ORDERED form, None otherwise. fmha_bwd.py's entries (fmha_bwd_dkdv, fmha_bwd_dkdv_ordered) run it
    in the tiles wider than 128, after their ticket or program ids and their checks of the constexprs."""
    q_start, sq = sequence_extent(CuSeqlensQ, SeqstartQ, b, seqlen_q, is_varlen, has_seqstart)
    k_start, sk = sequence_extent(CuSeqlensK, SeqstartK, b, seqlen_k, is_varlen, has_seqstart)
    n0 = n_block * BLOCK_N
    if n0 >= sk:
        return
    off, left, right, lo, full_lo, full_hi, blocks, n_steps = key_block_steps(
        n0, sq, sk, kv_group_size, window_left, window_right, bottom_right, BLOCK_M, BLOCK_N)
    h0 = hk * kv_group_size  # the group's first query head

    dqk = head_dim_qk_div8 * 8
    dv = head_dim_v_div8 * 8
    dtype: gl.constexpr = Q.dtype.element_ty
    # K in 64-byte swizzle atoms: the dQ quarters read it 32 columns (64 bytes) at a time as an MN-major
    # operand, so a quarter must begin on an atom
    k_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=2 * DQ_COLUMNS, element_bitwidth=16)
    v_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_DV], dtype)
    q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, 1, BLOCK_DQK], dtype)
    do_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, 1, BLOCK_DV], dtype)
    k_rows, v_rows, dk_rows, dv_rows, q_rows, do_rows, dq_rows, Lse2_head0, Delta_head0 = backward_rows(
        Q, K, V, dO, dK, dV, DqAcc, Lse2, Delta, b, hk, h0, q_start, k_start, is_varlen, stride_q_b, stride_q_s,
        stride_k_b, stride_k_s, stride_k_h, stride_v_b, stride_v_s, stride_v_h, stride_do_b, stride_do_s, stride_dk_b,
        stride_dk_s, stride_dk_h, stride_dv_b, stride_dv_s, stride_dv_h, stride_dqacc_b, stride_dqacc_s, stride_delta_b,
        stride_delta_h)
    dq_acc_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, 1, DQ_COLUMNS], gl.float32)

    sp_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N], dtype)
    k_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, BLOCK_DQK], k_layout)
    v_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, BLOCK_DV], v_layout)
    q_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, 1, BLOCK_DQK], q_layout)
    do_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, 1, BLOCK_DV], do_layout)
    p_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, BLOCK_N], sp_layout)
    ds_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, BLOCK_N], sp_layout)
    dq_smem = gl.allocate_shared_memory(gl.float32, [2, BLOCK_M, 1, DQ_COLUMNS], dq_acc_layout)  # one a consumer
    stats_smem = gl.allocate_shared_memory(gl.float32, [2 * STAGES, 1, BLOCK_M], row_stats_layout())  # Lse2, Delta
    kv_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    kv_free = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())  # one key block a program: never waited on
    q_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    p_full = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    p_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ds_full = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ds_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_ready, count=2)  # both loaders' key tiles are in
    mbarrier.init(kv_free, count=2)
    for i in gl.static_range(STAGES):
        mbarrier.init(q_ready.index(i), count=2)  # both loaders' query tiles are in
        mbarrier.init(q_empty.index(i), count=2)  # both consumers release a stage
    mbarrier.init(p_full, count=1)  # consumer 0 made P
    mbarrier.init(p_empty, count=2)  # both consumers' products read it
    mbarrier.init(ds_full, count=1)  # consumer 1 made dS
    mbarrier.init(ds_empty, count=2)  # both consumers' products read it
    dq_done = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())  # ORDERED alone; else no memory
    if ORDERED:
        mbarrier.init(dq_done, count=2)  # both consumers' additions of a step are complete
        counters = order_counters(DqOrder, b * num_heads_q + h0, seqlen_q, BLOCK_M)  # the group's first head's
    else:
        counters = Lse2  # unused

    # (the argument tuples are written out: a tuple built by concatenation turns constexprs into tensors)
    gl.warp_specialize([
        (_consumer, (0, k_smem, v_smem, q_smem, do_smem, p_smem, ds_smem, dq_smem, kv_ready,
                     q_ready, q_empty, p_full, p_empty, ds_full, ds_empty, dq_done, stats_smem, dq_rows, stride_dqacc_s,
                     stride_dqacc_h, num_heads_q, dk_rows, stride_dk_s, dv_rows, stride_dv_s, dqk,
                     dv, counters, gl.cdiv(seqlen_q, BLOCK_M), h0, n0, lo, blocks, full_lo, full_hi, n_steps, sq, sk,
                     kv_group_size, off, left, right, scale_log2, softmax_scale, BLOCK_M, BLOCK_N, BLOCK_DQK, BLOCK_DV, ORDERED)),
        (_consumer, (1, k_smem, v_smem, q_smem, do_smem, p_smem, ds_smem, dq_smem, kv_ready,
                     q_ready, q_empty, p_full, p_empty, ds_full, ds_empty, dq_done, stats_smem, dq_rows, stride_dqacc_s,
                     stride_dqacc_h, num_heads_q, dk_rows, stride_dk_s, dv_rows, stride_dv_s, dqk,
                     dv, counters, gl.cdiv(seqlen_q, BLOCK_M), h0, n0, lo, blocks, full_lo, full_hi, n_steps, sq, sk,
                     kv_group_size, off, left, right, scale_log2, softmax_scale, BLOCK_M, BLOCK_N, BLOCK_DQK, BLOCK_DV, ORDERED)),
        (load_keys_and_query_blocks, (k_rows, stride_k_s, dqk, q_rows, stride_q_s, stride_q_h, dqk, k_smem, k_smem,
                                      q_smem, q_smem, kv_ready, kv_free, q_ready, q_empty, sq, sk, num_heads_q,
                                      kv_group_size, window_left, window_right, bottom_right, n_block, n_block, 1, h0,
                                      Lse2_head0, None, stride_delta_h, stats_smem, BLOCK_M, BLOCK_N, ORDERED)),
        (load_keys_and_query_blocks, (v_rows, stride_v_s, dv, do_rows, stride_do_s, stride_do_h, dv, v_smem, v_smem,
                                      do_smem, do_smem, kv_ready, kv_free, q_ready, q_empty, sq, sk, num_heads_q,
                                      kv_group_size, window_left, window_right, bottom_right, n_block, n_block, 1, h0,
                                      None, Delta_head0, stride_delta_h, stats_smem, BLOCK_M, BLOCK_N, ORDERED)),
    ], [4, 1, 1], [240, 24, 24])
