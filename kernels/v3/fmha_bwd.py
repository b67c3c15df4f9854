"""Hopper attention backward, dK and dV with dQ added into an fp32 accumulator (family v3), written in Gluon.

It takes the portable dK/dV kernel's arguments (fmha_rt/plan/portable.py, SIGNATURES["fmha_bwd_dkdv"])
and runs as its atomic strategy: after the portable pre-pass has written Delta = rowsum(dO * O) and the
LSE in the log2 domain (Lse2), and before the portable conversion of the fp32 dQ accumulator. It serves
the calls without score terms or dropout (the constexprs say so; the rest of the arguments are never
read), and is not deterministic (the order of the additions varies).

One program per (BLOCK_N keys, key head, batch entry); it walks, for each query head of the group in
turn, the query blocks (BLOCK_M rows) that see its keys, as kernels/portable/fmha_common.query_blocks
lists them. Q and dO are copied through 3-D descriptors (row, query head, dim), so one serves the whole
group. Three partitions:
- two consumers (the default partition and a worker, a warpgroup each) own BLOCK_N / 2 keys each. Per
  query block: S = Q K_c^T and dP = dO V_c^T as two asynchronous products, P = exp2(S - Lse2) while dP
  runs, dS = P (dP - Delta); P and dS go to shared memory, where dV_c += P^T dO and dK_c += dS^T Q take
  them as transposed operands, and where dS, once both consumers' halves are in, gives dQ = dS K for
  this consumer's half of the head dim, added to the accumulator from shared memory by one bulk TMA
  reduction. In the 192/128 tile (the atomic form's; BLOCK_N 128) Q and K are held as their first 128
  columns and the rest, S adds the rest's product, and a consumer's 96 columns of dQ go in three pieces of
  32; dP is issued once P is written, P held in the inputs' type meanwhile, which keeps the step's 224
  accumulator registers from spilling (NOTES.md, v3.32);
- two loaders (1 warp each, one warpgroup): K, and V, of the program once, then Q, and dO with the block's
  Lse2 and Delta rows, of each (query head, query block) through a ring of STAGES buffers that both
  consumers release (v3.25: the consumers' own loads of the two rows came back long after S, and the
  exponentials waited for them).
The ORDERED form (fmha_bwd_dkdv_ordered, deterministic) differs in three places. A program takes its (key
block, key head, batch entry) from a ticket, by chunks of KEY_BLOCK_CHUNK key blocks of a (key head, batch
entry) (dq_order.ticket_item), so that the programs running at once share Q, dO and dQ tiles in L2; it walks
its query blocks down from the last one, every head of the group at each (common.query_step), so that the
key blocks of a head reach each dQ tile at the same step; and its dQ tiles are added in key-block
order (kernels/portable/dq_order.py: the protocol, and why every program finishes): the consumers leave
their dQ halves in shared memory, and another partition, the dQ writer (1 warp), waits for the tile's
counter to reach this key block's rank, adds both halves by bulk TMA reductions, frees the buffers once
they are read, and counts the key block in once the additions are complete, one step later, so that the
round trip to memory overlaps the next step.
dK (times the softmax scale) and dV leave through shared memory by TMA. Descriptors are made on the
device in Triton's global scratch, with the sequence's rows and the head dims as bounds, each by the
partition that uses it (the loaders K's, V's, Q's, dO's, Lse2's and Delta's; each consumer its dK's,
dV's and dQ's, the dQ writer its dQ's): the first step waits for the dO loader's four, not all of them
made in a row (NOTES.md, v3.13).
The ORDERED form's protocol (the dQ hand-over, the writer's counters) is modelled in
tests/cpu/test_barrier_protocols.py: a change to a wait, an arrival or a parity here changes it there.
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

import triton.language as tl

from kernels.v3.common import (STAGES, backward_rows, bulk_writes_wait, complete_and_release, fence_async_global,
                               heads_descriptor, key_block_rank, key_block_steps, load_keys_and_query_blocks, order_counters,
                               program_key_block, query_step, row_stats_layout, rows_descriptor, sequence_extent,
                               store_in_parts, ticket_item, tma_add_shared_to_global, visible, whole_width)
from kernels.v3.fmha_bwd_wide import wide_program

@gluon.jit
def _step(t, r0, dk, dk_rest, dv, token, previous, c: gl.constexpr, k_c, k_rest_c, v_c, k_smem, k_rest_smem, p_c, q_smem,
          q_rest_smem, do_smem, ds_smem, dq_c, q_ready, q_empty, ds_full, ds_empty, dq_full, dq_empty, counters,
          counters_per_head, dq_done, stats_smem, dq_desc, h0, n0, lo, blocks, full_lo, full_hi, sk,
          kv_group_size, off, left, right, scale_log2,
          BLOCK_M: gl.constexpr, HALF_N: gl.constexpr, BLOCK_DQK: gl.constexpr, ORDERED: gl.constexpr,
          DESCENDING: gl.constexpr):
    """Step t: one query block of one query head of the group against this consumer's keys, the program's
    step r0 + t in the Q/dO ring and the dS buffers (r0: the steps of its key blocks before this one). dK and
    dV accumulate, dQ gets its share (added here, or handed to the dQ writer in the ORDERED form). Where Q and
    K are held in two parts (the 192 tile: `k_rest_smem` narrower than `k_smem`), S adds the rest's product,
    dK's rest columns accumulate in dk_rest, and dQ's share goes in pieces (_add_dq_piece); its ORDERED form has
    no dQ writer (no shared memory left for one): the consumers wait for the tile's counter and add their
    pieces themselves, and count the key block in one step later, once the additions are complete (`token`
    orders the waits, `previous` is the last step's counter), as the wide program does."""
    K_WHOLE: gl.constexpr = k_smem.shape[1]
    K_REST: gl.constexpr = k_rest_smem.shape[1]
    SPLIT: gl.constexpr = K_REST < K_WHOLE
    DQ_COLS: gl.constexpr = dq_c.shape[2]
    PIECES: gl.constexpr = (BLOCK_DQK // 2) // DQ_COLS
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HALF_N, 16])
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, DQ_COLS, 16])
    dtype: gl.constexpr = q_smem.dtype
    r = r0 + t
    stage = r % STAGES
    buf = r % 2
    g, block = query_step(t, lo, blocks, kv_group_size, DESCENDING)
    m0 = block * BLOCK_M
    queries = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
    mbarrier.wait(q_ready.index(stage), (r // STAGES) & 1)
    # The block's Lse2 and Delta came with dO (load_keys_and_query_blocks): S and dP are [queries, keys], so
    # they are row vectors, two values a thread. Zeros past the sequence's end, where Q and dO are zeros too:
    # P is 1 there and dS 0, which adds nothing to dV and dK.
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    lse2 = stats_smem.index(2 * stage).reshape([BLOCK_M]).load(row_layout)
    delta = stats_smem.index(2 * stage + 1).reshape([BLOCK_M]).load(row_layout)
    # the [BLOCK_M, 1, D] tiles of the 3-D (rows, heads, dims) copies, as the [BLOCK_M, D] the products take
    q_j = q_smem.index(stage).reshape([BLOCK_M, K_WHOLE])
    q_rest_j = q_rest_smem.index(stage).reshape([BLOCK_M, K_REST])
    do_j = do_smem.index(stage).reshape([BLOCK_M, do_smem.shape[3]])
    s = warpgroup_mma(q_j, k_c.permute((1, 0)), gl.zeros([BLOCK_M, HALF_N], gl.float32, s_layout),
                      use_acc=False, is_async=True)
    if SPLIT:  # the rest's columns added; dP waits for P (below)
        s = warpgroup_mma(q_rest_j, k_rest_c.permute((1, 0)), s, is_async=True)
        s = warpgroup_mma_wait(0, deps=(s,))
    else:
        dp = warpgroup_mma(do_j, v_c.permute((1, 0)), gl.zeros([BLOCK_M, HALF_N], gl.float32, s_layout),
                           use_acc=False, is_async=True)
        s = warpgroup_mma_wait(1, deps=(s,))
    if (block < full_lo) | (block >= full_hi):  # a block on a window edge or the sequence's end
        keys = n0 + c * HALF_N + gl.arange(0, HALF_N, layout=gl.SliceLayout(0, s_layout))
        s = gl.where(visible(queries[:, None], keys[None, :], off, left, right, sk), s, float("-inf"))
    p = gl.exp2(s * scale_log2 - lse2[:, None])
    if SPLIT:  # P held in the inputs' type while dP is waited for (as P V takes it): 16 registers fewer
        p = p.to(dtype)
        p_c.store(p)
        dp = warpgroup_mma(do_j, v_c.permute((1, 0)), gl.zeros([BLOCK_M, HALF_N], gl.float32, s_layout),
                           use_acc=False, is_async=True)
        dp = warpgroup_mma_wait(0, deps=(dp,))
        ds = (p.to(gl.float32) * (dp - delta[:, None])).to(dtype)
    else:
        p_c.store(p.to(dtype))
        dp = warpgroup_mma_wait(0, deps=(dp,))
        ds = (p * (dp - delta[:, None])).to(dtype)
    mbarrier.wait(ds_empty.index(buf), ((r // 2) & 1) ^ 1)  # the other consumer is done with this buffer
    ds_buf = ds_smem.index(buf)
    ds_c = ds_buf.slice(c * HALF_N, HALF_N, dim=1)
    ds_c.store(ds)
    fence_async_shared()
    mbarrier.arrive(ds_full.index(buf))
    dv = warpgroup_mma(p_c.permute((1, 0)), do_j, dv, is_async=True)
    dk = warpgroup_mma(ds_c.permute((1, 0)), q_j, dk, is_async=True)
    if SPLIT:
        dk_rest = warpgroup_mma(ds_c.permute((1, 0)), q_rest_j, dk_rest, is_async=True)
    mbarrier.wait(ds_full.index(buf), (r // 2) & 1)
    dq = warpgroup_mma(ds_buf, _dq_source(k_smem, k_rest_smem, c, 0, BLOCK_DQK, DQ_COLS),
                       gl.zeros([BLOCK_M, DQ_COLS], gl.float32, dq_layout), use_acc=False, is_async=True)
    if SPLIT:
        dv, dk, dk_rest, dq = warpgroup_mma_wait(0, deps=(dv, dk, dk_rest, dq))
        mbarrier.arrive(q_empty.index(stage))
        if ORDERED:  # the tile's smaller key blocks are in (kernels/portable/dq_order.py)
            counter = counters + g * counters_per_head + block
            while gl.atomic_add(counter, 0, sem="acquire") != key_block_rank(n0, m0, off, left, 2 * HALF_N):
                pass
            token = fence_async_global(token)
        for i in gl.static_range(1, PIECES):  # each piece's product runs while the one before is added
            following = warpgroup_mma(ds_buf, _dq_source(k_smem, k_rest_smem, c, i, BLOCK_DQK, DQ_COLS),
                                      gl.zeros([BLOCK_M, DQ_COLS], gl.float32, dq_layout), use_acc=False, is_async=True)
            _add_dq_piece(dq, dq_c, dq_desc, m0, h0 + g, c * (BLOCK_DQK // 2) + (i - 1) * DQ_COLS)
            dq = warpgroup_mma_wait(0, deps=(following,))
        mbarrier.arrive(ds_empty.index(buf))
    else:
        dv, dk, dq = warpgroup_mma_wait(0, deps=(dv, dk, dq))
        mbarrier.arrive(ds_empty.index(buf))
        mbarrier.arrive(q_empty.index(stage))
    if ORDERED and not SPLIT:  # the writer adds the tile when its turn comes; it must have read the previous one
        mbarrier.wait(dq_empty, (r & 1) ^ 1)
        dq_c.reshape([BLOCK_M, BLOCK_DQK // 2]).store(dq)
        fence_async_shared()
        mbarrier.arrive(dq_full)
    else:
        _add_dq_piece(dq, dq_c, dq_desc, m0, h0 + g, c * (BLOCK_DQK // 2) + (PIECES - 1) * DQ_COLS)
    if ORDERED and SPLIT:
        if t > 0:  # the previous step's additions, both consumers', are complete: count that key block in
            token = complete_and_release(c, previous, dq_done, t - 1, bulk_writes_wait(PIECES, token))
        previous = counter
    return dk, dk_rest, dv, token, previous


@gluon.jit
def _dq_source(k_smem, k_rest_smem, c: gl.constexpr, i: gl.constexpr, BLOCK_DQK: gl.constexpr, DQ_COLS: gl.constexpr):
    """K's columns of consumer c's dQ piece i (dQ's columns c * BLOCK_DQK / 2 + i * DQ_COLS on), in K's whole
    part or its rest."""
    K_WHOLE: gl.constexpr = k_smem.shape[1]
    COL: gl.constexpr = c * (BLOCK_DQK // 2) + i * DQ_COLS
    if COL < K_WHOLE:
        return k_smem.slice(COL, DQ_COLS, dim=1)
    else:
        return k_rest_smem.slice(COL - K_WHOLE, DQ_COLS, dim=1)


@gluon.jit
def _add_dq_piece(dq, dq_c, dq_desc, m0, head, col):
    """dQ's piece at (m0, head, col) to the accumulator through shared memory, one bulk TMA addition (the
    memory system adds; rows past the sequence and columns past the head dim are clipped by the descriptor):
    element-wise atomics, 16 a thread a step, held the warps until the LSU queue drained them (NOTES.md,
    v3.1 attempt). The previous addition must have read the buffer first."""
    tma.store_wait(0)
    dq_c.reshape([dq.shape[0], dq.shape[1]]).store(dq)
    fence_async_shared()
    tma_add_shared_to_global(dq_desc, [m0, head, col], dq_c)


@gluon.jit
def _consumer(c: gl.constexpr, k_smem, k_rest_smem, v_smem, q_smem, q_rest_smem, do_smem, ds_smem, p_smem, dq_smem, kv_ready,
              kv_free, q_ready, q_empty,
              ds_full, ds_empty, dq_full, dq_empty, counters, counters_per_head, dq_done, stats_smem, dq_rows, stride_dq_s,
              stride_dq_h, num_heads_q, h0, dk_rows, stride_dk_s, dv_rows, stride_dv_s, dqk, dv_dims, n_first, n_second,
              n_tiles, sq, sk, kv_group_size, window_left, window_right, bottom_right, scale_log2, softmax_scale,
              BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_DQK: gl.constexpr, BLOCK_DV: gl.constexpr,
              ORDERED: gl.constexpr, DESCENDING: gl.constexpr, DKV_ADD: gl.constexpr = False):
    """Consumer c (BLOCK_N / 2 keys of each of the program's key blocks): per key block, its steps, then its
    dK and dV out through K's and V's memory, which it then gives back to the loaders (`kv_free`). dK's
    columns in two parts where K is held so (the 192 tile). DKV_ADD (fmha_bwd_dkdv's ONE_HEAD): dK and dV are one
    query head's shares, added to fp32 accumulators (_add_dkdv)."""
    HALF_N: gl.constexpr = BLOCK_N // 2
    K_WHOLE: gl.constexpr = k_smem.shape[1]
    K_REST: gl.constexpr = k_rest_smem.shape[1]
    SPLIT: gl.constexpr = K_REST < K_WHOLE
    dk_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, K_WHOLE, 16])
    dk_rest_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, K_REST, 16])
    dv_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, BLOCK_DV, 16])
    k_c = k_smem.slice(c * HALF_N, HALF_N)
    k_rest_c = k_rest_smem.slice(c * HALF_N, HALF_N)
    v_c = v_smem.slice(c * HALF_N, HALF_N)
    p_c = p_smem.index(c)
    dq_c = dq_smem.index(c)
    # This consumer's descriptors, made while the loaders' first copies fly: its halves of dK and dV, and
    # the fp32 dQ accumulator by (row, query head, dim) in its half of the columns (the ORDERED form's
    # writer makes its own)
    dtype: gl.constexpr = q_smem.dtype
    if DKV_ADD:
        # by (row, head, dim) with the key head's rows as the only head (its stride any valid one), so that the
        # dQ buffers' [HALF_N, 1, 64] fp32 tiles serve: _add_dkdv
        acc_layout: gl.constexpr = dq_smem.layout
        dk_desc = heads_descriptor(dk_rows, stride_dk_s, stride_dk_s, sk, 1, dqk, HALF_N, DKV_COLUMNS, acc_layout)
        dv_desc = heads_descriptor(dv_rows, stride_dv_s, stride_dv_s, sk, 1, dv_dims, HALF_N, DKV_COLUMNS, acc_layout)
    else:
        dk_desc = rows_descriptor(dk_rows, stride_dk_s, sk, dqk, [HALF_N, K_REST],
                                  gl.NVMMASharedLayout.get_default_for([HALF_N, K_REST], dtype))
        dv_desc = rows_descriptor(dv_rows, stride_dv_s, sk, dv_dims, [HALF_N, BLOCK_DV],
                                  gl.NVMMASharedLayout.get_default_for([HALF_N, BLOCK_DV], dtype))
    if ORDERED and not SPLIT:  # the dQ writer makes its own
        dq_desc = None
    else:
        dq_layout: gl.constexpr = dq_smem.layout
        dq_desc = heads_descriptor(dq_rows, stride_dq_s, stride_dq_h, sq, num_heads_q, dqk, BLOCK_M, dq_smem.shape[3],
                                   dq_layout)
    dk_out = k_smem.slice(c * HALF_N, HALF_N)
    dk_rest_out = k_rest_smem.slice(c * HALF_N, HALF_N)
    dv_out = v_smem.slice(c * HALF_N, HALF_N)
    r0 = n_tiles * 0
    kv_phase = n_tiles * 0
    for i in range(n_tiles):
        n0, off, left, right, lo, full_lo, full_hi, blocks, n_steps = program_key_block(
            i, n_first, n_second, sq, sk, kv_group_size, window_left, window_right, bottom_right, BLOCK_M, BLOCK_N)
        if n0 < sk:
            dk = gl.zeros([HALF_N, K_WHOLE], gl.float32, dk_layout)
            dk_rest = gl.zeros([HALF_N, K_REST], gl.float32, dk_rest_layout)  # (left alone but in the 192 tile)
            dv = gl.zeros([HALF_N, BLOCK_DV], gl.float32, dv_layout)
            token = n0  # the ORDERED 192 tile's: orders its waits and fences,
            if ORDERED and SPLIT:
                previous = counters  # and the counter of its last step
            else:
                previous = n0  # (left alone)
            mbarrier.wait(kv_ready, kv_phase)
            for t in tl.range(n_steps, disable_licm=True):
                dk, dk_rest, dv, token, previous = _step(
                    t, r0, dk, dk_rest, dv, token, previous, c, k_c, k_rest_c, v_c, k_smem, k_rest_smem, p_c, q_smem,
                    q_rest_smem, do_smem, ds_smem, dq_c, q_ready, q_empty, ds_full, ds_empty, dq_full, dq_empty, counters,
                    counters_per_head, dq_done, stats_smem, dq_desc, h0, n0, lo, blocks, full_lo, full_hi, sk,
                    kv_group_size, off, left, right, scale_log2, BLOCK_M, HALF_N, BLOCK_DQK, ORDERED, DESCENDING)
            if ORDERED and SPLIT and n_steps > 0:  # the last step's key block counted in
                complete_and_release(c, previous, dq_done, n_steps - 1, bulk_writes_wait(0, token))
            if n_steps > 0:
                # The other consumer's last dQ product reads every row of K: wait for it before K's tile takes dK.
                last = r0 + n_steps - 1
                mbarrier.wait(ds_empty.index(last % 2), (last // 2) & 1)
            if DKV_ADD:
                _add_dkdv(dk * softmax_scale, dv, c, k_smem, v_smem, dq_c, dk_desc, dv_desc, n0 + c * HALF_N)
            else:
                dk_out.store((dk * softmax_scale).to(dtype))  # keys no query sees get zeros
                if SPLIT:
                    dk_rest_out.store((dk_rest * softmax_scale).to(dtype))
                dv_out.store(dv.to(dtype))
                fence_async_shared()
                store_in_parts(dk_desc, n0 + c * HALF_N, dk_out, dk_rest_out)
                tma.async_copy_shared_to_global(dv_desc, [n0 + c * HALF_N, 0], dv_out)
            tma.store_wait(0)
            mbarrier.arrive(kv_free)  # K's and V's memory is the loaders' again
            r0 += n_steps
            kv_phase ^= 1


DKV_COLUMNS = gl.constexpr(64)  # ONE_HEAD: dK's and dV's columns an fp32 addition carries


@gluon.jit
def _column_halves(x):
    """x [rows, 2 * n] as its two [rows, n] column halves (the wgmma accumulator holds both in each thread's
    registers: no data moves)."""
    rows: gl.constexpr = x.shape[0]
    half: gl.constexpr = x.shape[1] // 2
    return x.reshape([rows, 2, half]).permute((0, 2, 1)).split()


@gluon.jit
def _add_dkdv(dk, dv, c: gl.constexpr, k_smem, v_smem, dq_buf, dk_desc, dv_desc, row):
    """The ONE_HEAD epilogue: consumer c's fp32 dK and dV ([HALF_N, 128] each, one query head's shares) added
    to the accumulators at `row` by four bulk reductions of [HALF_N, 64] column halves, staged in three 16 KiB
    buffers: half c of K's memory and of V's (by address: a swizzled tile keeps 64 columns of every row
    together, so a consumer's rows are not one piece), which no product reads once both consumers' last dQ
    products are done (the caller waited), and its dQ buffer, which takes dK's first half, then dV's last once
    read."""
    rows: gl.constexpr = dk.shape[0]
    layout: gl.constexpr = dq_buf.layout
    k_buf = k_smem._reinterpret(gl.float32, [2, rows, 1, DKV_COLUMNS], layout).index(c)
    v_buf = v_smem._reinterpret(gl.float32, [2, rows, 1, DKV_COLUMNS], layout).index(c)
    dk0, dk1 = _column_halves(dk)
    dv0, dv1 = _column_halves(dv)
    tma.store_wait(0)  # the last step's dQ addition has read the dQ buffer
    dq_buf.reshape([rows, DKV_COLUMNS]).store(dk0)
    k_buf.reshape([rows, DKV_COLUMNS]).store(dk1)
    v_buf.reshape([rows, DKV_COLUMNS]).store(dv0)
    fence_async_shared()
    tma_add_shared_to_global(dk_desc, [row, 0, 0], dq_buf)
    tma_add_shared_to_global(dk_desc, [row, 0, DKV_COLUMNS], k_buf)
    tma_add_shared_to_global(dv_desc, [row, 0, 0], v_buf)
    tma.store_wait(2)  # the first has read the dQ buffer
    dq_buf.reshape([rows, DKV_COLUMNS]).store(dv1)
    fence_async_shared()
    tma_add_shared_to_global(dv_desc, [row, 0, DKV_COLUMNS], dq_buf)


@gluon.jit
def _release(counter, token):
    """Counts this key block in at `counter` once this thread's bulk additions before it are complete (the
    caller waited for them): the async proxy's writes ordered before the releasing increment, which the
    warp's lane 0 makes after the barrier."""
    token = fence_async_global(token)
    gl.thread_barrier()
    gl.atomic_add(counter, 1, sem="release")
    return token


@gluon.jit
def _dq_writer(dq_smem, dq_full, dq_empty, dq_rows, stride_dq_s, stride_dq_h, sq, num_heads_q, dqk, Counters,
               counters_per_head, h0, n0, lo, blocks, n_steps, kv_group_size, off, left, BLOCK_M: gl.constexpr,
               BLOCK_N: gl.constexpr, BLOCK_DQK: gl.constexpr):
    """The ORDERED form's dQ writer: step t's tile, once both consumers have left their halves and the
    tile's counter equals this key block's rank, goes to the accumulator by two bulk TMA reductions. The
    counter is released one step later, after the next tile's reductions are issued, once these are
    complete: the wait for completion overlaps the next step instead of adding to it. Holding it that
    long cannot deadlock: only larger key blocks (later tickets) wait for this one."""
    dq_layout: gl.constexpr = dq_smem.layout
    dq_desc = heads_descriptor(dq_rows, stride_dq_s, stride_dq_h, sq, num_heads_q, dqk, BLOCK_M, BLOCK_DQK // 2,
                               dq_layout)
    token = n0
    previous = Counters
    for t in range(n_steps):
        g, block = query_step(t, lo, blocks, kv_group_size, True)
        m0 = block * BLOCK_M
        counter = Counters + g * counters_per_head + block
        rank = key_block_rank(n0, m0, off, left, BLOCK_N)
        while gl.atomic_add(counter, 0, sem="acquire") != rank:  # the smaller key blocks are in
            pass
        token = fence_async_global(token)  # their additions are seen by ours
        mbarrier.wait(dq_full, t & 1)
        tma_add_shared_to_global(dq_desc, [m0, h0 + g, 0], dq_smem.index(0))
        tma_add_shared_to_global(dq_desc, [m0, h0 + g, BLOCK_DQK // 2], dq_smem.index(1))
        tma.store_wait(0)  # read: the consumers may write the next tile
        mbarrier.arrive(dq_empty)
        if t > 0:
            token = _release(previous, bulk_writes_wait(2, token))  # all but this step's two are complete
        previous = counter
    if n_steps > 0:
        _release(previous, bulk_writes_wait(0, token))


@gluon.jit
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
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_DQK: gl.constexpr, BLOCK_DV: gl.constexpr,
    BIAS_KIND: gl.constexpr, DROPOUT: gl.constexpr, DQ_ATOMIC: gl.constexpr, FLAT_LOOP: gl.constexpr,
    GROUP_LOOP: gl.constexpr, DP_FIRST: gl.constexpr, TILES: gl.constexpr = 1, ONE_HEAD: gl.constexpr = False,
):
    """A program per (key block, key head, batch entry), the key block the grid's fastest dimension: a head's
    key blocks start together. (Key blocks slowest was measured 0.54-0.96x at D=128 without GQA: each resident
    program on a head of its own, so that nothing is shared in L2, the cause v3.19 found for the ORDERED form;
    NOTES.md.) TILES (a build choice of the 64, 128 and 192 tiles): 2 gives a program key blocks p and N - 1 - p of
    its (key head, batch entry), N blocks in all, so that under a causal mask every program has about the
    same steps and one prologue serves two key blocks (the 64, 128 and 192 tiles). ONE_HEAD (the `heads`
    variants, v3.31), for causal GQA: GQA's dK/dV by query head, as FlashAttention-3 and -4 run it: a program per (key block,
    query head, batch entry), the grid's second dimension the query heads, each walking its one head's query
    blocks as an MHA program does, so that the programs running at once share Q, dO and dQ tiles in L2 as
    MHA's do, where a program of the whole group walks 8 heads'; dK and dV are then fp32 accumulators [rows,
    key heads, dims] (zeroed), to which each program adds its head's shares, and a conversion pass follows."""
    gl.static_assert(DQ_ATOMIC and GROUP_LOOP, "the v3 backward adds dQ by atomics and loops over the group's heads")
    n_block = gl.program_id(0)
    b = gl.program_id(2)
    if ONE_HEAD:
        h0 = gl.program_id(1)  # the program's query head
        hk = h0 // kv_group_size
    else:
        hk = gl.program_id(1)
        h0 = hk * kv_group_size  # the group's first query head
    _dkdv_program(
        n_block, hk, h0, b, None,
        Q, K, V, dO, Lse2, Delta, dK, dV, DqAcc, CuSeqlensQ, CuSeqlensK, SeqstartQ, SeqstartK, stride_q_b, stride_q_s,
        stride_q_h, stride_k_b, stride_k_s, stride_k_h, stride_v_b, stride_v_s, stride_v_h, stride_do_b, stride_do_s,
        stride_do_h, stride_dk_b, stride_dk_s, stride_dk_h, stride_dv_b, stride_dv_s, stride_dv_h, stride_dqacc_b,
        stride_dqacc_s, stride_dqacc_h, stride_delta_b, stride_delta_h, seqlen_q, seqlen_k, num_heads_q,
        kv_group_size, head_dim_qk_div8, head_dim_v_div8, softmax_scale, scale_log2, window_left, window_right,
        bottom_right, is_varlen, has_seqstart, BLOCK_M, BLOCK_N, BLOCK_DQK, BLOCK_DV, BIAS_KIND, DROPOUT, False, TILES,
        ONE_HEAD)


@gluon.jit
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
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_DQK: gl.constexpr, BLOCK_DV: gl.constexpr,
    BIAS_KIND: gl.constexpr, DROPOUT: gl.constexpr, FLAT_LOOP: gl.constexpr,
    GROUP_LOOP: gl.constexpr, DP_FIRST: gl.constexpr, KEY_BLOCK_CHUNK: gl.constexpr,
):
    """The deterministic form: one program per work item (key block, key head, batch entry), which it
    takes by ticket in chunks of KEY_BLOCK_CHUNK key blocks (dq_order.ticket_item: within a (key head, batch
    entry) the longest first under a causal mask, and an order that lets every program finish); its dQ tiles
    go into the accumulator in key-block order."""
    gl.static_assert(GROUP_LOOP, "the v3 backward loops over the group's heads")
    heads_k = num_heads_q // kv_group_size
    slots = heads_k * batch
    item = gl.atomic_add(DqOrder, 1, sem="relaxed")
    n_block, slot = ticket_item(item, gl.cdiv(seqlen_k, BLOCK_N), slots, KEY_BLOCK_CHUNK)
    _dkdv_program(
        n_block, slot % heads_k, (slot % heads_k) * kv_group_size, slot // heads_k, DqOrder,
        Q, K, V, dO, Lse2, Delta, dK, dV, DqAcc, CuSeqlensQ, CuSeqlensK, SeqstartQ, SeqstartK, stride_q_b, stride_q_s,
        stride_q_h, stride_k_b, stride_k_s, stride_k_h, stride_v_b, stride_v_s, stride_v_h, stride_do_b, stride_do_s,
        stride_do_h, stride_dk_b, stride_dk_s, stride_dk_h, stride_dv_b, stride_dv_s, stride_dv_h, stride_dqacc_b,
        stride_dqacc_s, stride_dqacc_h, stride_delta_b, stride_delta_h, seqlen_q, seqlen_k, num_heads_q,
        kv_group_size, head_dim_qk_div8, head_dim_v_div8, softmax_scale, scale_log2, window_left, window_right,
        bottom_right, is_varlen, has_seqstart, BLOCK_M, BLOCK_N, BLOCK_DQK, BLOCK_DV, BIAS_KIND, DROPOUT, True, 1)


@gluon.jit
def _dkdv_program(
    n_block, hk, h0, b, DqOrder,
    Q, K, V, dO, Lse2, Delta, dK, dV, DqAcc, CuSeqlensQ, CuSeqlensK, SeqstartQ, SeqstartK,
    stride_q_b, stride_q_s, stride_q_h, stride_k_b, stride_k_s, stride_k_h, stride_v_b, stride_v_s, stride_v_h,
    stride_do_b, stride_do_s, stride_do_h, stride_dk_b, stride_dk_s, stride_dk_h, stride_dv_b, stride_dv_s, stride_dv_h,
    stride_dqacc_b, stride_dqacc_s, stride_dqacc_h, stride_delta_b, stride_delta_h,
    seqlen_q, seqlen_k, num_heads_q, kv_group_size, head_dim_qk_div8, head_dim_v_div8,
    softmax_scale, scale_log2, window_left, window_right, bottom_right, is_varlen, has_seqstart,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_DQK: gl.constexpr, BLOCK_DV: gl.constexpr,
    BIAS_KIND: gl.constexpr, DROPOUT: gl.constexpr, ORDERED: gl.constexpr, TILES: gl.constexpr,
    ONE_HEAD: gl.constexpr = False,
):
    """Key block n_block of key head hk of batch entry b (the module docstring), and with TILES = 2 the
    block paired with it; DqOrder the order region of the ORDERED form, None otherwise. h0: the first query
    head of the group, which the program walks, or with ONE_HEAD its only query head, dK and dV then being
    added to fp32 accumulators (fmha_bwd_dkdv). The 256 tiles run fmha_bwd_wide.py's program instead."""
    gl.static_assert(BIAS_KIND == 0, "the v3 backward has no score terms")
    gl.static_assert(not ONE_HEAD or (BLOCK_DQK == 128 and BLOCK_DV == 128 and not ORDERED),
                     "programs of one query head: the atomic form of the 128 tile")
    gl.static_assert(not DROPOUT, "the v3 backward has no dropout")
    gl.static_assert(TILES == 1 or (TILES == 2 and not ORDERED and BLOCK_N == 128),
                     "pairs of key blocks: the atomic form of the tiles of two consumers of keys")
    if BLOCK_DQK == 256:
        wide_program(
            n_block, hk, b, DqOrder, Q, K, V, dO, Lse2, Delta, dK, dV, DqAcc, CuSeqlensQ, CuSeqlensK, SeqstartQ,
            SeqstartK, stride_q_b, stride_q_s, stride_q_h, stride_k_b, stride_k_s, stride_k_h, stride_v_b, stride_v_s,
            stride_v_h, stride_do_b, stride_do_s, stride_do_h, stride_dk_b, stride_dk_s, stride_dk_h, stride_dv_b,
            stride_dv_s, stride_dv_h, stride_dqacc_b, stride_dqacc_s, stride_dqacc_h, stride_delta_b, stride_delta_h,
            seqlen_q, seqlen_k, num_heads_q, kv_group_size, head_dim_qk_div8, head_dim_v_div8, softmax_scale,
            scale_log2, window_left, window_right, bottom_right, is_varlen, has_seqstart, BLOCK_M, BLOCK_N,
            BLOCK_DQK, BLOCK_DV, ORDERED)
    else:  # the 64, 128 and 192 tiles: two consumers of BLOCK_N / 2 keys each (the module docstring)
        HALF_N: gl.constexpr = BLOCK_N // 2
        # the 192 tile holds Q and K as their first 128 columns and the rest (shared-memory tiles are powers of
        # two wide); K_REST = K_WHOLE elsewhere, the rest being the same memory
        K_WHOLE: gl.constexpr = whole_width(BLOCK_DQK)
        SPLIT: gl.constexpr = K_WHOLE < BLOCK_DQK
        K_REST: gl.constexpr = BLOCK_DQK - K_WHOLE if SPLIT else K_WHOLE
        # dQ's share of a consumer goes in pieces of DQ_COLS columns where its 96 would be no power of two
        DQ_COLS: gl.constexpr = 32 if SPLIT else BLOCK_DQK // 2
        q_start, sq = sequence_extent(CuSeqlensQ, SeqstartQ, b, seqlen_q, is_varlen, has_seqstart)
        k_start, sk = sequence_extent(CuSeqlensK, SeqstartK, b, seqlen_k, is_varlen, has_seqstart)
        n_first = n_block  # the heavier of a pair under a causal mask (more query blocks see it)
        if TILES == 2:
            n_second = gl.cdiv(seqlen_k, BLOCK_N) - 1 - n_block
            n_tiles = gl.where(n_first < n_second, 2, 1)
        else:
            n_second = n_first
            n_tiles = n_block * 0 + 1
        if n_first * BLOCK_N >= sk:  # n_second is past it too
            return
        if ONE_HEAD:
            group = 1  # the query heads a program walks
        else:
            group = kv_group_size

        dqk = head_dim_qk_div8 * 8
        dv = head_dim_v_div8 * 8
        dtype: gl.constexpr = Q.dtype.element_ty
        k_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, K_WHOLE], dtype)
        v_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_DV], dtype)
        q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, 1, K_WHOLE], dtype)
        do_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, 1, BLOCK_DV], dtype)
        k_rows, v_rows, dk_rows, dv_rows, q_rows, do_rows, dq_rows, Lse2_head0, Delta_head0 = backward_rows(
            Q, K, V, dO, dK, dV, DqAcc, Lse2, Delta, b, hk, h0, q_start, k_start, is_varlen, stride_q_b, stride_q_s,
            stride_k_b, stride_k_s, stride_k_h, stride_v_b, stride_v_s, stride_v_h, stride_do_b, stride_do_s, stride_dk_b,
            stride_dk_s, stride_dk_h, stride_dv_b, stride_dv_s, stride_dv_h, stride_dqacc_b, stride_dqacc_s, stride_delta_b,
            stride_delta_h)
        dq_acc_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, 1, DQ_COLS], gl.float32)

        ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N], dtype)
        p_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HALF_N], dtype)
        k_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, K_WHOLE], k_layout)
        v_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, BLOCK_DV], v_layout)
        q_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, 1, K_WHOLE], q_layout)
        if SPLIT:
            k_rest_smem = gl.allocate_shared_memory(
                dtype, [BLOCK_N, K_REST], gl.NVMMASharedLayout.get_default_for([BLOCK_N, K_REST], dtype))
            q_rest_smem = gl.allocate_shared_memory(
                dtype, [STAGES, BLOCK_M, 1, K_REST], gl.NVMMASharedLayout.get_default_for([BLOCK_M, 1, K_REST], dtype))
        else:
            k_rest_smem = k_smem
            q_rest_smem = q_smem
        do_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, 1, BLOCK_DV], do_layout)
        ds_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_M, BLOCK_N], ds_layout)
        p_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_M, HALF_N], p_layout)
        dq_smem = gl.allocate_shared_memory(gl.float32, [2, BLOCK_M, 1, DQ_COLS], dq_acc_layout)  # one a consumer
        stats_smem = gl.allocate_shared_memory(gl.float32, [2 * STAGES, 1, BLOCK_M], row_stats_layout())  # Lse2, Delta
        kv_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        kv_free = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        q_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        q_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        ds_full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        ds_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        mbarrier.init(kv_ready, count=2)  # both loaders' key tiles are in
        mbarrier.init(kv_free, count=2)  # both consumers' dK and dV have left K's and V's memory
        for i in gl.static_range(STAGES):
            mbarrier.init(q_ready.index(i), count=2)  # both loaders' query tiles are in
            mbarrier.init(q_empty.index(i), count=2)  # both consumers release a stage
        for i in gl.static_range(2):
            mbarrier.init(ds_full.index(i), count=2)  # both halves of dS are in
            mbarrier.init(ds_empty.index(i), count=2)  # both consumers' dQ products are done

        # (the argument tuples are written out: a tuple built by concatenation turns constexprs into tensors)
        if ORDERED and not SPLIT:  # a dQ writer adds the consumers' tiles
            dq_full = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
            dq_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
            mbarrier.init(dq_full, count=2)  # both consumers' halves are in
            mbarrier.init(dq_empty, count=1)  # the writer has read them
            counters = order_counters(DqOrder, b * num_heads_q + h0, seqlen_q, BLOCK_M)  # the group's first head's
            n0 = n_first * BLOCK_N  # one key block a program
            off, left, right, lo, full_lo, full_hi, blocks, n_steps = key_block_steps(
                n0, sq, sk, group, window_left, window_right, bottom_right, BLOCK_M, BLOCK_N)
            gl.warp_specialize([
                (_consumer, (0, k_smem, k_rest_smem, v_smem, q_smem, q_rest_smem, do_smem, ds_smem, p_smem, dq_smem,
                             kv_ready, kv_free, q_ready, q_empty, ds_full, ds_empty, dq_full, dq_empty, None, None, None,
                             stats_smem, dq_rows,
                             stride_dqacc_s, stride_dqacc_h, num_heads_q, h0, dk_rows, stride_dk_s, dv_rows, stride_dv_s,
                             dqk, dv, n_first, n_second, n_tiles, sq, sk, group, window_left, window_right, bottom_right,
                             scale_log2, softmax_scale, BLOCK_M, BLOCK_N, BLOCK_DQK, BLOCK_DV, True, True)),
                (_consumer, (1, k_smem, k_rest_smem, v_smem, q_smem, q_rest_smem, do_smem, ds_smem, p_smem, dq_smem,
                             kv_ready, kv_free, q_ready, q_empty, ds_full, ds_empty, dq_full, dq_empty, None, None, None,
                             stats_smem, dq_rows,
                             stride_dqacc_s, stride_dqacc_h, num_heads_q, h0, dk_rows, stride_dk_s, dv_rows, stride_dv_s,
                             dqk, dv, n_first, n_second, n_tiles, sq, sk, group, window_left, window_right, bottom_right,
                             scale_log2, softmax_scale, BLOCK_M, BLOCK_N, BLOCK_DQK, BLOCK_DV, True, True)),
                (load_keys_and_query_blocks, (k_rows, stride_k_s, dqk, q_rows, stride_q_s, stride_q_h, dqk, k_smem,
                                              k_rest_smem, q_smem, q_rest_smem, kv_ready, kv_free, q_ready, q_empty, sq, sk,
                                              num_heads_q, group, window_left, window_right, bottom_right, n_first, n_second,
                                              n_tiles, h0, None, None, None, None, BLOCK_M, BLOCK_N, True)),
                (load_keys_and_query_blocks, (v_rows, stride_v_s, dv, do_rows, stride_do_s, stride_do_h, dv, v_smem, v_smem,
                                              do_smem, do_smem, kv_ready, kv_free, q_ready, q_empty, sq, sk, num_heads_q,
                                              group, window_left, window_right, bottom_right, n_first, n_second,
                                              n_tiles, h0, Lse2_head0, Delta_head0, stride_delta_h, stats_smem,
                                              BLOCK_M, BLOCK_N, True)),
                (_dq_writer, (dq_smem, dq_full, dq_empty, dq_rows, stride_dqacc_s, stride_dqacc_h, sq, num_heads_q, dqk,
                              counters, gl.cdiv(seqlen_q, BLOCK_M), h0, n0, lo, blocks, n_steps, group, off,
                              left, BLOCK_M, BLOCK_N, BLOCK_DQK)),
            ], [4, 1, 1, 1], [240, 24, 24, 24])
        else:  # the consumers add dQ themselves: the atomic form, and the ORDERED form of the 192 tile
            if ORDERED:  # (a name bound to None cannot be a partition's argument: `x if ORDERED else None` below)
                dq_done = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
                mbarrier.init(dq_done, count=2)  # both consumers' additions of a step are complete
                counters = order_counters(DqOrder, b * num_heads_q + h0, seqlen_q, BLOCK_M)
            gl.warp_specialize([
                (_consumer, (0, k_smem, k_rest_smem, v_smem, q_smem, q_rest_smem, do_smem, ds_smem, p_smem, dq_smem,
                             kv_ready, kv_free, q_ready, q_empty, ds_full, ds_empty, None, None,
                             counters if ORDERED else None, gl.cdiv(seqlen_q, BLOCK_M), dq_done if ORDERED else None,
                             stats_smem, dq_rows,
                             stride_dqacc_s, stride_dqacc_h, num_heads_q, h0, dk_rows, stride_dk_s, dv_rows, stride_dv_s, dqk,
                             dv, n_first, n_second, n_tiles, sq, sk, group, window_left, window_right, bottom_right,
                             scale_log2, softmax_scale, BLOCK_M, BLOCK_N, BLOCK_DQK, BLOCK_DV, ORDERED, ORDERED, ONE_HEAD)),
                (_consumer, (1, k_smem, k_rest_smem, v_smem, q_smem, q_rest_smem, do_smem, ds_smem, p_smem, dq_smem,
                             kv_ready, kv_free, q_ready, q_empty, ds_full, ds_empty, None, None,
                             counters if ORDERED else None, gl.cdiv(seqlen_q, BLOCK_M), dq_done if ORDERED else None,
                             stats_smem, dq_rows,
                             stride_dqacc_s, stride_dqacc_h, num_heads_q, h0, dk_rows, stride_dk_s, dv_rows, stride_dv_s, dqk,
                             dv, n_first, n_second, n_tiles, sq, sk, group, window_left, window_right, bottom_right,
                             scale_log2, softmax_scale, BLOCK_M, BLOCK_N, BLOCK_DQK, BLOCK_DV, ORDERED, ORDERED, ONE_HEAD)),
                (load_keys_and_query_blocks, (k_rows, stride_k_s, dqk, q_rows, stride_q_s, stride_q_h, dqk, k_smem,
                                              k_rest_smem, q_smem, q_rest_smem, kv_ready, kv_free, q_ready, q_empty, sq, sk,
                                              num_heads_q, group, window_left, window_right, bottom_right, n_first, n_second,
                                              n_tiles, h0, None, None, None, None, BLOCK_M, BLOCK_N,
                                              ORDERED)),
                (load_keys_and_query_blocks, (v_rows, stride_v_s, dv, do_rows, stride_do_s, stride_do_h, dv, v_smem, v_smem,
                                              do_smem, do_smem, kv_ready, kv_free, q_ready, q_empty, sq, sk, num_heads_q,
                                              group, window_left, window_right, bottom_right, n_first, n_second,
                                              n_tiles, h0, Lse2_head0, Delta_head0, stride_delta_h, stats_smem,
                                              BLOCK_M, BLOCK_N, ORDERED)),
            ], [4, 1, 1], [240, 24, 24])
