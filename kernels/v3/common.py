"""What the v3 kernels share: the portable family's scalar and mask helpers, compiled as Gluon
functions (their bodies are scalar loads, arithmetic and broadcasts), the TMA descriptors of a sequence
of a [B, S, H, D] or varlen [total, H, D] array (one head, or every head), the bulk TMA addition, the
waits and fences that order bulk additions against other programs, and what both backward kernels take:
the Q/dO ring's loader and the ORDERED strategy's rank and counters (kernels/portable/dq_order.py)."""
from triton._C.libtriton import ir
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma

from kernels.portable import dq_order, fmha_common

sequence_extent = gluon.jit(fmha_common.sequence_extent.fn)
window_sides = gluon.jit(fmha_common.window_sides.fn)
key_blocks = gluon.jit(fmha_common.key_blocks.fn)
query_blocks = gluon.jit(fmha_common.query_blocks.fn)
masked_block = gluon.jit(fmha_common.masked_block.fn)
row_stats_start = gluon.jit(fmha_common.row_stats_start.fn)
visible = gluon.jit(fmha_common.visible.fn)


@gluon.jit
def rows_descriptor(rows_base, stride_s, rows, dims, block_shape: gl.constexpr, layout: gl.constexpr):
    """`rows` rows of one head from `rows_base` (the sequence's first row of the head), `dims` wide, in tiles
    of `block_shape`: TMA fills what lies past `rows` or `dims` with zeros and clips stores there."""
    return tma.make_tensor_descriptor(rows_base, [rows, dims], [stride_s, 1], block_shape, layout)


@gluon.jit
def heads_descriptor(rows_base, stride_s, stride_h, rows, heads, dims, block_rows: gl.constexpr, block_dims: gl.constexpr,
                     layout: gl.constexpr):
    """`rows` rows of every head from `rows_base` (the sequence's first row of head 0) by (row, head, dim), in
    [block_rows, 1, block_dims] tiles: one descriptor serves every query head of a group, with the same bounds
    as above."""
    return tma.make_tensor_descriptor(rows_base, [rows, heads, dims], [stride_s, stride_h, 1],
                                      [block_rows, 1, block_dims], layout)


@builtin
def tma_add_shared_to_global(tensor_desc, coord, src, _semantic=None):
    """Adds the shared-memory tile `src` to global memory at `coord` of `tensor_desc` in one bulk TMA
    reduction (fp32 adds done by the memory system, elements past the descriptor's bounds left alone).
    Like tma.async_copy_shared_to_global it is asynchronous: tma.store_wait before `src` is written again.
    Triton 3.6 builds the operation for Gluon but gives it no function, hence this one."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle)


@gluon.jit
def bulk_writes_wait(PENDING: gl.constexpr, token):
    """Waits until at most PENDING of this thread's bulk groups (0, 2, 3 or 4) are unfinished, their writes to
    global memory included: tma.store_wait waits only until their shared-memory sources are read. Returns
    `token` (an int32 scalar), so that calls can be chained. Threads that issued no bulk group pass at once."""
    gl.static_assert((PENDING == 0) | (PENDING == 2) | (PENDING == 3) | (PENDING == 4),
                     "bulk_writes_wait takes 0, 2, 3 or 4 groups")
    if PENDING == 0:
        out = gl.inline_asm_elementwise("cp.async.bulk.wait_group 0; mov.b32 $0, $1;", "=r,r", [token], gl.int32,
                                        False, 1)
    elif PENDING == 3:
        out = gl.inline_asm_elementwise("cp.async.bulk.wait_group 3; mov.b32 $0, $1;", "=r,r", [token], gl.int32,
                                        False, 1)
    elif PENDING == 2:
        out = gl.inline_asm_elementwise("cp.async.bulk.wait_group 2; mov.b32 $0, $1;", "=r,r", [token], gl.int32,
                                        False, 1)
    else:
        out = gl.inline_asm_elementwise("cp.async.bulk.wait_group 4; mov.b32 $0, $1;", "=r,r", [token], gl.int32,
                                        False, 1)
    return out


@gluon.jit
def fence_async_global(token):
    """Orders this thread's global memory accesses in the generic proxy (loads, atomics) against those of
    the async proxy (TMA copies and reductions) in both directions. Returns `token`, as above."""
    return gl.inline_asm_elementwise("fence.proxy.async.global; mov.b32 $0, $1;", "=r,r", [token], gl.int32, False, 1)


@gluon.jit
def complete_and_release(c: gl.constexpr, counter, dq_done, step, token):
    """The ORDERED form where two consumers add dQ themselves (the wide program, fmha_bwd.py's 192 tile), once
    this consumer's additions of `step` are complete (the caller waited): they are
    made visible (async proxy before generic), and once both consumers' are, consumer 0 counts the key block
    in at `counter` (a releasing increment, which carries consumer 1's additions through the barrier)."""
    token = fence_async_global(token)
    mbarrier.arrive(dq_done)
    if c == 0:
        mbarrier.wait(dq_done, step & 1)
        gl.atomic_add(counter, 1, sem="release")
    return token


@gluon.constexpr_function
def whole_width(block_d):
    """The columns of a Q or K tile held in one shared-memory tile: the largest power of two within the
    tile's head dim (128 of 192, whose last 64, the "rest", are held apart: shared-memory tiles and TMA
    boxes are powers of two wide)."""
    return 1 << (block_d.bit_length() - 1)


@gluon.jit
def _at(row, head, col, DIM: gl.constexpr):
    """A TMA coordinate: (row, col) of a rows_descriptor's tile (DIM 1), (row, head, col) of a heads_descriptor's."""
    if DIM == 1:
        return row, col
    else:
        return row, head, col


@gluon.jit
def copy_in_parts(desc, row, head, ready, dst, rest, EXTRA_BYTES: gl.constexpr = 0):
    """TMA copy of the tile at `row` (and query head `head`, for a [rows, 1, dims] tile of a heads_descriptor)
    into `dst`, announced to `ready`. Where the tile is held in two parts (`rest` narrower than `dst`), in
    boxes of the rest's width: `dst`'s columns, then the rest's. `ready` also expects EXTRA_BYTES from copies
    the caller issues after this one (a thread arrives on a barrier once a phase, with all its bytes)."""
    DIM: gl.constexpr = len(dst.shape) - 1
    if rest.shape[DIM] < dst.shape[DIM]:
        BOX: gl.constexpr = rest.shape[DIM]
        mbarrier.expect(ready, (dst.shape[DIM] // BOX + 1) * desc.block_type.nbytes + EXTRA_BYTES)
        for i in gl.static_range(dst.shape[DIM] // BOX):
            tma.async_copy_global_to_shared(desc, _at(row, head, i * BOX, DIM), ready, dst.slice(i * BOX, BOX, dim=DIM))
        tma.async_copy_global_to_shared(desc, _at(row, head, dst.shape[DIM], DIM), ready, rest)
    else:
        mbarrier.expect(ready, desc.block_type.nbytes + EXTRA_BYTES)
        tma.async_copy_global_to_shared(desc, _at(row, head, 0, DIM), ready, dst)


@gluon.jit
def store_in_parts(desc, row, src, rest):
    """TMA store of the [rows, dims] tile `src` (a rows_descriptor's) to `row`, where it is held in two parts
    (`rest` narrower than `src`) in boxes of the rest's width, as copy_in_parts loads it."""
    if rest.shape[1] < src.shape[1]:
        BOX: gl.constexpr = rest.shape[1]
        for i in gl.static_range(src.shape[1] // BOX):
            tma.async_copy_shared_to_global(desc, [row, i * BOX], src.slice(i * BOX, BOX, dim=1))
        tma.async_copy_shared_to_global(desc, [row, src.shape[1]], rest)
    else:
        tma.async_copy_shared_to_global(desc, [row, 0], src)


@gluon.constexpr_function
def row_stats_layout():
    """Shared memory of a query block's Lse2 or Delta row ([1, BLOCK_M] fp32, as TMA copies it): unswizzled,
    so that the consumers read it as the row vector of their scores' layout."""
    return gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)


key_block_rank = gluon.jit(dq_order.key_block_rank.fn)
order_counters = gluon.jit(dq_order.order_counters.fn)
ticket_item = gluon.jit(dq_order.ticket_item.fn)

STAGES = gl.constexpr(2)  # the backward's Q/dO ring depth


@gluon.jit
def query_step(t, lo, blocks, kv_group_size, DESCENDING: gl.constexpr):
    """Step t of a backward program's walk over (query head of the group, query block of [lo, lo + blocks)):
    heads outermost and blocks ascending (the atomic form), or DESCENDING (the ORDERED form) blocks outermost
    from the last, every head of the group at each block. Under a causal mask a head's key blocks see the
    same last query blocks and different first ones, so walking down from the last, the programs that add
    into a dQ tile in key-block order reach it at the same step and each adds right after the one before it;
    walking up, key block n would reach the tiles that key block 0 reaches n steps later first, and wait."""
    if DESCENDING:
        g = t % kv_group_size
        block = lo + blocks - 1 - t // kv_group_size
    else:
        g = t // blocks
        block = lo + t - g * blocks
    return g, block


@gluon.jit
def load_keys_and_query_blocks(kv_rows, stride_kv_s, kv_dims, qo_rows, stride_qo_s, stride_qo_h, qo_dims, kv_smem,
                               kv_rest_smem, qo_smem, qo_rest_smem, kv_ready, kv_free, q_ready, q_empty, sq, sk, num_heads_q,
                               kv_group_size, window_left, window_right, bottom_right, n_first, n_second, n_tiles, h0,
                               lse2_rows, delta_rows, stride_stats_h, stats_smem, BLOCK_M: gl.constexpr,
                               BLOCK_N: gl.constexpr, DESCENDING: gl.constexpr):
    """One of the backward's two loader warps (fmha_bwd.py's and fmha_bwd_wide.py's): one copies K and Q, the
    other V and dO. Each makes its two descriptors, each before its first copy: its key tile's (the
    program's rows of the key head), and its query tiles', by (row, query head, dim) so that one serves
    every head of the group. Making a descriptor takes about a microsecond, so the first step waits for two
    of them, not seven made in a row. Both loaders arrive on `kv_ready` and `q_ready` (count 2), each
    expecting its own bytes.

    A program runs the key blocks n_first and, if n_tiles is 2, n_second (pairs of the atomic form's 64 and
    128 tiles: TILES): each key tile once the consumers have given its buffer back (`kv_free`: dK and dV of
    the block before left through it), then the tile's query tiles through the ring of STAGES buffers, which
    runs on from block to block, in query_step's order (DESCENDING: the ORDERED form's). Tiles held in two
    parts (K and Q of the 192 tile: `kv_rest_smem` and `qo_rest_smem` narrower than the others; elsewhere the
    same memory) come in boxes of the rest's width (copy_in_parts). With its query tile a loader also copies
    the block's Lse2 row, if given `lse2_rows`, and its Delta row, if given `delta_rows` (of the group's
    heads), into the stage's two buffers of `stats_smem`: read by the consumers with their own loads, they
    were back a long while after S (the memory system is busy with dQ's additions) and the exponentials
    waited for them (v3.25). In the 64 and 128 tiles the dO loader copies both and the K/Q loader neither
    (None for the four); in the wide tiles the Q loader copies Lse2 and the dO loader Delta (NOTES.md,
    v3.26-v3.27: that split measured 0.98-1.05x there, but 0.94-0.98x at causal GQA in the 128 tile)."""
    kv_box: gl.constexpr = kv_rest_smem.shape
    kv_layout: gl.constexpr = kv_smem.layout
    qo_box: gl.constexpr = qo_rest_smem.shape[3]
    qo_layout: gl.constexpr = qo_smem.layout
    kv_desc = rows_descriptor(kv_rows, stride_kv_s, sk, kv_dims, kv_box, kv_layout)
    qo_desc = heads_descriptor(qo_rows, stride_qo_s, stride_qo_h, sq, num_heads_q, qo_dims, BLOCK_M, qo_box, qo_layout)
    # the statistics by [heads of the group, rows of the sequence] (a head a "row"): zeros past its end
    if lse2_rows is not None:
        lse2_desc = rows_descriptor(lse2_rows, stride_stats_h, kv_group_size, sq, [1, BLOCK_M], row_stats_layout())
        LSE2_BYTES: gl.constexpr = lse2_desc.block_type.nbytes
    else:
        LSE2_BYTES: gl.constexpr = 0
    if delta_rows is not None:
        delta_desc = rows_descriptor(delta_rows, stride_stats_h, kv_group_size, sq, [1, BLOCK_M], row_stats_layout())
        DELTA_BYTES: gl.constexpr = delta_desc.block_type.nbytes
    else:
        DELTA_BYTES: gl.constexpr = 0
    r0 = n_tiles * 0
    kv_phase = n_tiles * 0
    for i in range(n_tiles):
        n0, off, left, right, lo, full_lo, full_hi, blocks, n_steps = program_key_block(
            i, n_first, n_second, sq, sk, kv_group_size, window_left, window_right, bottom_right, BLOCK_M, BLOCK_N)
        if n0 < sk:
            mbarrier.wait(kv_free, kv_phase ^ 1)  # a fresh barrier's last phase is done
            copy_in_parts(kv_desc, n0, 0, kv_ready, kv_smem, kv_rest_smem)
            for t in range(n_steps):
                r = r0 + t
                stage = r % STAGES
                mbarrier.wait(q_empty.index(stage), ((r // STAGES) & 1) ^ 1)
                g, block = query_step(t, lo, blocks, kv_group_size, DESCENDING)
                copy_in_parts(qo_desc, block * BLOCK_M, h0 + g, q_ready.index(stage), qo_smem.index(stage),
                              qo_rest_smem.index(stage), LSE2_BYTES + DELTA_BYTES)
                if lse2_rows is not None:
                    tma.async_copy_global_to_shared(lse2_desc, [g, block * BLOCK_M], q_ready.index(stage),
                                                    stats_smem.index(2 * stage))
                if delta_rows is not None:
                    tma.async_copy_global_to_shared(delta_desc, [g, block * BLOCK_M], q_ready.index(stage),
                                                    stats_smem.index(2 * stage + 1))
            r0 += n_steps
            kv_phase ^= 1


@gluon.jit
def backward_rows(Q, K, V, dO, dK, dV, DqAcc, Lse2, Delta, b, hk, h0, q_start, k_start, is_varlen, stride_q_b, stride_q_s,
                  stride_k_b, stride_k_s, stride_k_h, stride_v_b, stride_v_s, stride_v_h, stride_do_b, stride_do_s,
                  stride_dk_b, stride_dk_s, stride_dk_h, stride_dv_b, stride_dv_s, stride_dv_h, stride_dqacc_b,
                  stride_dqacc_s, stride_delta_b, stride_delta_h):
    """The sequence's first rows in a dK/dV program's arrays (fmha_bwd.py's and fmha_bwd_wide.py's): of key
    head hk in K, V, dK and dV; of every head in Q, dO and the fp32 dQ accumulator (whose rows are the head
    dim rounded up to 8, not the tile, so the column bound of its descriptor keeps additions off the next
    head); then the row statistics Lse2 and Delta of the group's first query head h0. The partitions make
    their descriptors from them."""
    b64 = b.to(gl.int64)
    hk64 = hk.to(gl.int64)
    h0_64 = h0.to(gl.int64)
    q_row0 = q_start.to(gl.int64)
    k_row0 = k_start.to(gl.int64)
    k_rows = K + b64 * stride_k_b + k_row0 * stride_k_s + hk64 * stride_k_h
    v_rows = V + b64 * stride_v_b + k_row0 * stride_v_s + hk64 * stride_v_h
    dk_rows = dK + b64 * stride_dk_b + k_row0 * stride_dk_s + hk64 * stride_dk_h
    dv_rows = dV + b64 * stride_dv_b + k_row0 * stride_dv_s + hk64 * stride_dv_h
    q_rows = Q + b64 * stride_q_b + q_row0 * stride_q_s
    do_rows = dO + b64 * stride_do_b + q_row0 * stride_do_s
    dq_rows = DqAcc + b64 * stride_dqacc_b + q_row0 * stride_dqacc_s
    stats = b64 * stride_delta_b + h0_64 * stride_delta_h + row_stats_start(q_start, b, is_varlen)
    return k_rows, v_rows, dk_rows, dv_rows, q_rows, do_rows, dq_rows, Lse2 + stats, Delta + stats


@gluon.jit
def key_block_steps(n0, sq, sk, kv_group_size, window_left, window_right, bottom_right, BLOCK_M: gl.constexpr,
                    BLOCK_N: gl.constexpr):
    """The query blocks that see the key block at n0 of a backward program, and its steps: (off, left,
    right, lo, full_lo, full_hi, blocks, n_steps), a step being a (query head of the group, query block),
    heads outermost."""
    off = gl.where(bottom_right != 0, sk - sq, 0)
    left, right = window_sides(window_left, window_right, sq, sk)
    lo, full_lo, full_hi, hi = query_blocks(n0, sq, off, left, right, BLOCK_N, BLOCK_M)
    blocks = hi - lo
    return off, left, right, lo, full_lo, full_hi, blocks, blocks * kv_group_size


@gluon.jit
def program_key_block(i, n_first, n_second, sq, sk, kv_group_size, window_left, window_right, bottom_right,
                      BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """The i-th key block of a program that runs blocks n_first then n_second (TILES = 2): its first key n0,
    then key_block_steps' (off, left, right, lo, full_lo, full_hi, blocks, n_steps). The block holds keys of
    the sequence where n0 < sk."""
    n0 = gl.where(i == 0, n_first, n_second) * BLOCK_N
    off, left, right, lo, full_lo, full_hi, blocks, n_steps = key_block_steps(n0, sq, sk, kv_group_size, window_left,
                                                                             window_right, bottom_right, BLOCK_M, BLOCK_N)
    return n0, off, left, right, lo, full_lo, full_hi, blocks, n_steps
