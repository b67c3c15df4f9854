"""Hopper attention forward (family v3), written in Gluon: warp specialisation, TMA copies, mbarriers
and asynchronous warpgroup MMAs (wgmma), the structure of FlashAttention-3's forward.

It takes the portable forward's arguments (fmha_rt/plan/portable.py, SIGNATURES["fmha_fwd"]), so one
plan serves both families, and serves the calls without score terms or dropout: BIAS_KIND 0, DROPOUT
False (the unused arguments are never read). One program per (BLOCK_M query rows, query head, batch
entry), or per two query blocks of one (head, batch entry) (TILES = 2), or per run of TILES > 2 of them,
in partitions:
- two consumers (the default partition and a worker, 4 warps each: one warpgroup), 64 query rows each
  (FlashAttention-3's 192-row tile of three at D=64 was slower than the 128 tile: NOTES.md, v3.15);
  a consumer issues S_{j+1} = Q K_{j+1}^T on the tensor core before
  the softmax of key block j, so the two overlap, then O += P_j V_j with P_j from registers (the build
  choices SOFTMAX_TURNS and PINGPONG order the consumers: fmha_rt/plan/v3.py, FWD_SCHEDULE);
- two loaders (1 warp each, 24 registers, in one warpgroup): TMA copies of the consumers' Q tiles then
  of V, and of K, each through a ring of STAGES buffers released by every consumer.
Shared-memory tiles and TMA boxes are powers of two wide: Q and K tiles of the 192 head dims are held in two
parts, their first 128 columns and the last 64 (the "rest"), S = Q K^T being the sum of two products.
Tensor descriptors are made on the device, per (sequence, head), so their bounds are the sequence's and
the head dims': TMA fills rows and columns past them with zeros and clips O's stores. Each partition makes
the ones it uses (one loader Q's and V's, the other K's, each consumer O's), so that the first product's
copies wait for one descriptor, not four: making one takes about a microsecond, and the 128 tile's program
at 2k keys about 30 (NOTES.md, v3.11 and v3.12). They take Triton's global scratch memory (manifest
`global_scratch`, per program), which the runtime provides.

Sequences, windows and masks are the portable family's (kernels/portable/fmha_common.py, compiled as
Gluon functions in kernels/v3/common.py): key j is visible from query i iff i + off - left <= j <= i + off +
right and j < Sk. The mask-free key blocks of the program's rows come first, then the masked ones; rows
that see no key get O = 0 and LSE = -inf.

The barrier protocol (the K/V ring, the softmax turns, the ping-pong) is modelled in tests/cpu/test_barrier_protocols.py,
which runs it under random interleavings: a change to a wait, an arrival or a parity here changes it there.
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

from kernels.v3.common import (copy_in_parts, key_blocks, masked_block, rows_descriptor, sequence_extent, visible,
                               whole_width, window_sides)

STAGES = gl.constexpr(2)  # K/V ring depth: 2 x (K + V) fill 128 KiB beside Q's 32 KiB (D=128), 64 KiB (D=256)
LN2 = gl.constexpr(0.6931471805599453)
ROWS = gl.constexpr(64)  # query rows of one consumer: one warpgroup's wgmma M


@gluon.jit
def _key_block(t, n_free, lo, full_lo, full_hi):
    """The t-th key block a program visits: the mask-free [full_lo, full_hi) first, then the masked
    [lo, full_lo) and [full_hi, hi)."""
    return gl.where(t < n_free, full_lo + t, masked_block(t - n_free, lo, full_lo, full_hi))


@gluon.jit
def _copy_q_tiles(q_desc, m0, q_ready, q_free, q_phase, q_smem, q_rest_smem, CONSUMERS: gl.constexpr, WAIT: gl.constexpr):
    """Each consumer's Q tile of the tile at query row m0; WAIT: once the consumer has given its Q buffer
    back (`q_free`, phase q_phase ^ 1: a fresh barrier's previous phase counts as complete)."""
    for c in gl.static_range(CONSUMERS):
        if WAIT:
            mbarrier.wait(q_free.index(c), q_phase ^ 1)
        copy_in_parts(q_desc, m0 + c * ROWS, 0, q_ready.index(c), q_smem.index(c), q_rest_smem.index(c))


@gluon.jit
def _kv_ring(kv_desc, kv_smem, kv_rest_smem, kv_ready, kv_empty, r0, n_blocks, n_free, lo, full_lo, full_hi,
             BLOCK_N: gl.constexpr):
    """A tile's K or V blocks into the ring, whose slots r0, r0 + 1, ... they take."""
    for t in range(n_blocks):
        r = r0 + t
        stage = r % STAGES
        free_phase = ((r // STAGES) & 1) ^ 1  # a fresh barrier's previous phase counts as complete
        n0 = _key_block(t, n_free, lo, full_lo, full_hi) * BLOCK_N
        mbarrier.wait(kv_empty.index(stage), free_phase)
        copy_in_parts(kv_desc, n0, 0, kv_ready.index(stage), kv_smem.index(stage), kv_rest_smem.index(stage))


@gluon.jit
def _loader(KEYS: gl.constexpr, q_rows, kv_rows, stride_q_s, stride_kv_s, sq, sk, dqk, kv_dims, q_smem, q_rest_smem, kv_smem,
            kv_rest_smem, q_ready, q_free, kv_ready, kv_empty, first_tile, m_first, m_second, n_tiles, off, left, right,
            CONSUMERS: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, TILES: gl.constexpr):
    """One of the two loader warps: KEYS, the ring of K tiles; otherwise Q's tiles, then the ring of V tiles.
    Each makes the descriptors it uses just before its first copy, so that Q's and K's, the first product's
    operands, are made at the same time: making one takes about a microsecond (its tensormap written to
    global memory, fenced, then fetched). A tile held in two parts (Q and K at 192) comes in boxes of its
    rest's width. With several tiles (TILES > 1) they follow each other in the ring; a tile's Q copies wait
    until its consumer has given the Q buffer back (`q_free`)."""
    dtype: gl.constexpr = kv_smem.dtype
    q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ROWS, q_smem.shape[2]], dtype)
    Q_BOX: gl.constexpr = q_rest_smem.shape[2]
    kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, kv_smem.shape[2]], dtype)
    KV_BOX: gl.constexpr = kv_rest_smem.shape[2]
    if not KEYS:
        q_desc = rows_descriptor(q_rows, stride_q_s, sq, dqk, [ROWS, Q_BOX], q_layout)
    if TILES == 1:  # the ring from its first slot: constants, so that the loop carries no offsets
        m0, active, lo, full_lo, full_hi, n_blocks, n_free = first_tile
        if not KEYS:
            _copy_q_tiles(q_desc, m0, q_ready, q_free, 0, q_smem, q_rest_smem, CONSUMERS, False)
        kv_desc = rows_descriptor(kv_rows, stride_kv_s, sk, kv_dims, [BLOCK_N, KV_BOX], kv_layout)
        _kv_ring(kv_desc, kv_smem, kv_rest_smem, kv_ready, kv_empty, 0, n_blocks, n_free, lo, full_lo, full_hi, BLOCK_N)
    else:
        kv_desc = rows_descriptor(kv_rows, stride_kv_s, sk, kv_dims, [BLOCK_N, KV_BOX], kv_layout)
        r0 = n_tiles * 0
        q_phase = n_tiles * 0
        for i in range(n_tiles):
            m0, active, lo, full_lo, full_hi, n_blocks, n_free = _program_tile(i, m_first, m_second, sq, sk, off, left,
                                                                              right, BLOCK_M, BLOCK_N, TILES)
            if active:
                if not KEYS:
                    _copy_q_tiles(q_desc, m0, q_ready, q_free, q_phase, q_smem, q_rest_smem, CONSUMERS, True)
                _kv_ring(kv_desc, kv_smem, kv_rest_smem, kv_ready, kv_empty, r0, n_blocks, n_free, lo, full_lo, full_hi,
                         BLOCK_N)
                r0 += n_blocks
                q_phase ^= 1


@gluon.jit
def _issue_scores(q, q_rest, k_smem, k_rest_smem, k_ready, t, s_layout: gl.constexpr, BLOCK_N: gl.constexpr):
    """S_t = Q K_t^T issued on the tensor core once K_t has landed (not waited for): where Q and K are held
    in two parts (`q_rest` narrower than `q`), the rest's product added to the first's."""
    mbarrier.wait(k_ready.index(t % STAGES), (t // STAGES) & 1)
    s = warpgroup_mma(q, k_smem.index(t % STAGES).permute((1, 0)), gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout),
                      use_acc=False, is_async=True)
    if q_rest.shape[1] < q.shape[1]:
        s = warpgroup_mma(q_rest, k_rest_smem.index(t % STAGES).permute((1, 0)), s, is_async=True)
    return s


@gluon.jit
def _issue_product(acc, p, alpha, t, v_smem, v_ready, o_layout: gl.constexpr):
    """O rescaled by alpha, then O += P V_t issued on the tensor core once V_t has landed (not waited for)."""
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
    mbarrier.wait(v_ready.index(t % STAGES), (t // STAGES) & 1)
    return warpgroup_mma(gl.convert_layout(p.to(v_smem.dtype), p_layout), v_smem.index(t % STAGES), acc, is_async=True)


@gluon.jit
def _softmax_step(s, m_i, l_i, masked, n0, rows, off, left, right, sk, scale_log2, s_layout: gl.constexpr,
                  BLOCK_N: gl.constexpr):
    """P (unnormalised), the factor that rescales the running sums, and the new row max and sum."""
    if masked:
        keys = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        s = gl.where(visible(rows[:, None], keys[None, :], off, left, right, sk), s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, 1) * scale_log2)
    # Rows that have seen no visible key yet keep m = -inf; shifting them by 0 avoids inf - inf.
    m_shift = gl.where(m_new == float("-inf"), 0.0, m_new)
    p = gl.exp2(s * scale_log2 - m_shift[:, None])
    alpha = gl.exp2(m_i - m_shift)
    return p, alpha, m_new, l_i * alpha + gl.sum(p, 1)


@gluon.jit
def _wait_turn(turn, k, c: gl.constexpr):
    """Waits until consumer c holds its k-th turn: the previous consumer has passed on its own k-th (consumer
    0: the last consumer its (k-1)-th; its first turn is a fresh barrier's previous phase, complete at once)."""
    if c == 0:
        mbarrier.wait(turn.index(0), (k & 1) ^ 1)
    else:
        mbarrier.wait(turn.index(c), k & 1)


@gluon.jit
def _softmax_in_turn(t, c: gl.constexpr, turn, turn_sums, s, m_i, l_i, masked, n0, rows, off, left, right, sk,
                     scale_log2, s_layout: gl.constexpr, BLOCK_N: gl.constexpr, CONSUMERS: gl.constexpr,
                     TURNS: gl.constexpr):
    """_softmax_step of key block t; with TURNS, consumer c runs it after consumer c - 1 has run its own
    (consumer 0 after the last consumer's of block t - 1) and then passes the turn on: one consumer's
    exponentials at a time, while the others' products keep the tensor cores busy. Without turns the
    consumers drift into step with each other, exponentials together and products together.

    The row sums go to shared memory (`turn_sums`, never read) before the turn is passed: ptxas moves the
    exponentials, which nothing else between here and P V reads, below the mbarrier arrive; the sums
    depend on every exponential, and the arrive (a release) cannot pass the store."""
    if TURNS:
        _wait_turn(turn, t, c)
    p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, masked, n0, rows, off, left, right, sk, scale_log2, s_layout,
                                       BLOCK_N)
    if TURNS:
        turn_sums.slice(c * ROWS, ROWS).store(l_i)
        mbarrier.arrive(turn.index((c + 1) % CONSUMERS))
    return p, alpha, m_i, l_i


@gluon.jit
def _step(t, s, acc, m_i, l_i, c: gl.constexpr, q, q_rest, k_smem, k_rest_smem, v_smem, k_ready, v_ready, k_empty, v_empty, turn,
          turn_sums, rows, sk, off, left, right, n_free, lo, full_lo, full_hi, scale_log2, s_layout: gl.constexpr,
          o_layout: gl.constexpr, BLOCK_N: gl.constexpr, CONSUMERS: gl.constexpr, TURNS: gl.constexpr, MASKED: gl.constexpr):
    """Key block t of the loop: S_{t+1} on the tensor core while block t's softmax runs on the other units,
    then O += P_t V_t. Returns S_{t+1} and the running (O, row max, row sum). MASKED: block t may hold
    keys a row does not see (a build-time choice: see _consumer)."""
    # the stage indices first, as before the _issue helpers existed: that order keeps the measured objects' bytes
    stage = t % STAGES
    nxt = (t + 1) % STAGES
    s_next = _issue_scores(q, q_rest, k_smem, k_rest_smem, k_ready, t + 1, s_layout, BLOCK_N)
    n0 = _key_block(t, n_free, lo, full_lo, full_hi) * BLOCK_N
    p, alpha, m_i, l_i = _softmax_in_turn(t, c, turn, turn_sums, s, m_i, l_i, MASKED, n0, rows, off, left, right,
                                          sk, scale_log2, s_layout, BLOCK_N, CONSUMERS, TURNS)
    acc = _issue_product(acc, p, alpha, t, v_smem, v_ready, o_layout)
    acc, s_next = warpgroup_mma_wait(0, deps=(acc, s_next))
    mbarrier.arrive(v_empty.index(stage))
    mbarrier.arrive(k_empty.index(nxt))
    return s_next, acc, m_i, l_i


@gluon.jit
def _pingpong_step(t, r0, k0, acc, p, alpha, m_i, l_i, c: gl.constexpr, q, q_rest, k_smem, k_rest_smem, v_smem, k_ready, v_ready,
                   k_empty, v_empty, turn, rows, sk, off, left, right, n_free, lo, full_lo, full_hi, scale_log2,
                   s_layout: gl.constexpr, o_layout: gl.constexpr, BLOCK_N: gl.constexpr, CONSUMERS: gl.constexpr,
                   MASKED: gl.constexpr):
    """Step t of the ping-pong (_pingpong_blocks), the ring's block r0 + t and turn k0 + t + 1 of the program
    (r0 and k0: what the program's tiles before this one took): in its turn the consumer issues S_{t+1} and
    O += P_t V_t back to back and passes the turn on; then block t+1's softmax runs beside P_t V_t and the
    other consumers' products. Returns (O, P_{t+1}, alpha_{t+1}, row max, row sum). MASKED: block t+1 may
    hold keys a row does not see.

    ptxas moves P_t V_t's wait up to the row max, above the exponentials, so that the softmax runs beside
    the other consumers' products only. Keeping the wait below them (the row sums stored to shared memory
    before it, as _softmax_in_turn does) measured 0.96-1.0x of this form (NOTES.md, v3.9)."""
    _wait_turn(turn, k0 + t + 1, c)
    s = _issue_scores(q, q_rest, k_smem, k_rest_smem, k_ready, r0 + t + 1, s_layout, BLOCK_N)
    acc = _issue_product(acc, p, alpha, r0 + t, v_smem, v_ready, o_layout)
    mbarrier.arrive(turn.index((c + 1) % CONSUMERS))
    s = warpgroup_mma_wait(1, deps=(s,))  # the older of the two products
    mbarrier.arrive(k_empty.index((r0 + t + 1) % STAGES))
    n0 = _key_block(t + 1, n_free, lo, full_lo, full_hi) * BLOCK_N
    p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, MASKED, n0, rows, off, left, right, sk, scale_log2, s_layout,
                                       BLOCK_N)
    acc = warpgroup_mma_wait(0, deps=(acc,))
    mbarrier.arrive(v_empty.index((r0 + t) % STAGES))
    return acc, p, alpha, m_i, l_i


@gluon.jit
def _pingpong_blocks(acc, m_i, l_i, c: gl.constexpr, q, q_rest, k_smem, k_rest_smem, v_smem, k_ready, v_ready, k_empty, v_empty,
                     turn, q_free, rows, sk, off, left, right, r0, k0, n_blocks, n_free, lo, full_lo, full_hi, scale_log2,
                     s_layout: gl.constexpr, o_layout: gl.constexpr, BLOCK_N: gl.constexpr, CONSUMERS: gl.constexpr,
                     OWN_O: gl.constexpr):
    """A consumer's key blocks in FlashAttention-3's schedule (PINGPONG): every product is issued in the
    consumer's turn (S_0 in turn 0, step t's two in turn t + 1, the last P V in turn n_blocks), and the
    turn goes round the consumers (the mbarriers `turn`), so the tensor cores take their products in
    alternation and one consumer's exponentials run beside the others' products, its own P V included.
    The tile's blocks are the ring's r0, r0 + 1, ... and its turns k0, k0 + 1, ... (what the program's tiles
    before this one left). With OWN_O (O leaves through a buffer of its own), Q is given back (`q_free`) once
    the last S product is done, so that the next tile's Q lands under this tile's last P V and epilogue.
    Returns (O, row max, row sum) after every key block."""
    if n_blocks > 0:
        _wait_turn(turn, k0, c)
        s = _issue_scores(q, q_rest, k_smem, k_rest_smem, k_ready, r0, s_layout, BLOCK_N)
        mbarrier.arrive(turn.index((c + 1) % CONSUMERS))
        s = warpgroup_mma_wait(0, deps=(s,))
        mbarrier.arrive(k_empty.index(r0 % STAGES))
        n0 = _key_block(0, n_free, lo, full_lo, full_hi) * BLOCK_N
        p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, n_free <= 0, n0, rows, off, left, right, sk, scale_log2,
                                           s_layout, BLOCK_N)
        # As in _consumer, the steps whose softmax needs no mask (block t + 1 mask-free) and the others as two loops
        free_steps = gl.maximum(n_free - 1, 0)
        for t in range(free_steps):
            acc, p, alpha, m_i, l_i = _pingpong_step(t, r0, k0, acc, p, alpha, m_i, l_i, c, q, q_rest, k_smem, k_rest_smem,
                                                     v_smem, k_ready, v_ready, k_empty, v_empty, turn, rows, sk, off, left,
                                                     right, n_free, lo, full_lo, full_hi, scale_log2, s_layout, o_layout,
                                                     BLOCK_N, CONSUMERS, False)
        for t in range(free_steps, n_blocks - 1):
            acc, p, alpha, m_i, l_i = _pingpong_step(t, r0, k0, acc, p, alpha, m_i, l_i, c, q, q_rest, k_smem, k_rest_smem,
                                                     v_smem, k_ready, v_ready, k_empty, v_empty, turn, rows, sk, off, left,
                                                     right, n_free, lo, full_lo, full_hi, scale_log2, s_layout, o_layout,
                                                     BLOCK_N, CONSUMERS, True)
        if OWN_O:
            mbarrier.arrive(q_free)  # every S product of the tile is done: Q is read no more
        last = r0 + n_blocks - 1
        _wait_turn(turn, k0 + n_blocks, c)
        acc = _issue_product(acc, p, alpha, last, v_smem, v_ready, o_layout)
        mbarrier.arrive(turn.index((c + 1) % CONSUMERS))
        acc = warpgroup_mma_wait(0, deps=(acc,))
        mbarrier.arrive(v_empty.index(last % STAGES))
    return acc, m_i, l_i


@gluon.jit
def _consumer_tile(c: gl.constexpr, q_smem, q_rest_smem, k_smem, k_rest_smem, v_smem, o_buf, q_ready, q_free, k_ready, v_ready,
                   k_empty, v_empty, turn, turn_sums, o_desc, Lse_rows, m0, q_phase, r0, k0, sq, sk, off, left, right,
                   n_blocks, n_free, lo, full_lo, full_hi, scale_log2, BLOCK_N: gl.constexpr, BLOCK_DV: gl.constexpr,
                   CONSUMERS: gl.constexpr, TURNS: gl.constexpr, PINGPONG: gl.constexpr, OWN_O: gl.constexpr,
                   TILES: gl.constexpr):
    """Consumer c's rows of the tile at query row m0: its Q (copy phase q_phase), its key blocks (the ring's
    from r0, the turns from k0: _pingpong_blocks), then O and the LSE out. Q goes back to the loader
    (`q_free`, with two tiles a program) once read no more: after the last S product where O has a buffer of
    its own (OWN_O), else once O has left through Q's memory."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_DV, 16])
    o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)
    rows = m0 + c * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, s_layout))
    q = q_smem.index(c)
    q_rest = q_rest_smem.index(c)
    dtype: gl.constexpr = v_smem.dtype
    m_i = gl.full([ROWS], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([ROWS], gl.float32, gl.SliceLayout(1, s_layout))
    acc = gl.zeros([ROWS, BLOCK_DV], gl.float32, o_layout)
    mbarrier.wait(q_ready.index(c), q_phase)
    if OWN_O:
        if n_blocks == 0:  # no S product reads Q
            mbarrier.arrive(q_free.index(c))
    if PINGPONG:
        acc, m_i, l_i = _pingpong_blocks(acc, m_i, l_i, c, q, q_rest, k_smem, k_rest_smem, v_smem, k_ready, v_ready, k_empty,
                                         v_empty, turn, q_free.index(c), rows, sk, off, left, right, r0, k0, n_blocks,
                                         n_free, lo, full_lo, full_hi, scale_log2, s_layout, o_layout, BLOCK_N, CONSUMERS,
                                         OWN_O)
    elif n_blocks > 0:  # (one tile a program: its blocks are the ring's first, its turns the first)
        s = _issue_scores(q, q_rest, k_smem, k_rest_smem, k_ready, 0, s_layout, BLOCK_N)
        s = warpgroup_mma_wait(0, deps=(s,))
        mbarrier.arrive(k_empty.index(0))
        # Two loops, the mask-free blocks' and the masked ones': with one loop and a run-time `masked`, the
        # compiler turns the mask into selects that every step issues (~350 of the step's 941 instructions
        # at D=128, where two consumers' instructions nearly fill the issue slots of the tensor cores' time).
        free_steps = gl.minimum(n_free, n_blocks - 1)
        for t in range(free_steps):
            s, acc, m_i, l_i = _step(t, s, acc, m_i, l_i, c, q, q_rest, k_smem, k_rest_smem, v_smem, k_ready, v_ready, k_empty,
                                     v_empty, turn, turn_sums, rows, sk, off, left, right, n_free, lo, full_lo, full_hi, scale_log2,
                                     s_layout, o_layout, BLOCK_N, CONSUMERS, TURNS, False)
        for t in range(free_steps, n_blocks - 1):
            s, acc, m_i, l_i = _step(t, s, acc, m_i, l_i, c, q, q_rest, k_smem, k_rest_smem, v_smem, k_ready, v_ready, k_empty,
                                     v_empty, turn, turn_sums, rows, sk, off, left, right, n_free, lo, full_lo, full_hi, scale_log2,
                                     s_layout, o_layout, BLOCK_N, CONSUMERS, TURNS, True)
        last = n_blocks - 1
        n0 = _key_block(last, n_free, lo, full_lo, full_hi) * BLOCK_N
        p, alpha, m_i, l_i = _softmax_in_turn(last, c, turn, turn_sums, s, m_i, l_i, last >= n_free, n0, rows, off, left,
                                              right, sk, scale_log2, s_layout, BLOCK_N, CONSUMERS, TURNS)
        acc = _issue_product(acc, p, alpha, last, v_smem, v_ready, o_layout)
        acc = warpgroup_mma_wait(0, deps=(acc,))
        mbarrier.arrive(v_empty.index(last % STAGES))

    seen = l_i > 0.0
    l_safe = gl.where(seen, l_i, 1.0)
    out = acc / gl.convert_layout(l_safe, o_rows)[:, None]
    # O leaves through its own buffer, or (no room for one) through Q's tile, which is read no more (in its
    # first bytes where O is narrower)
    if OWN_O:
        o_smem = o_buf.index(c)
    elif BLOCK_DV == q.shape[1]:
        o_smem = q
    else:
        o_smem = q._reinterpret(dtype, [ROWS, BLOCK_DV], o_desc.layout)
    o_smem.store(out.to(dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(o_desc, [m0 + c * ROWS, 0], o_smem)
    lse = gl.where(seen, (m_i + gl.log2(l_safe)) * LN2, float("-inf"))
    gl.store(Lse_rows + rows, lse, mask=rows < sq)
    tma.store_wait(0)
    if TILES > 1 and not OWN_O:
        mbarrier.arrive(q_free.index(c))


@gluon.jit
def _program_tile(i, m_first, m_second, sq, sk, off, left, right, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                  TILES: gl.constexpr):
    """The program's i-th tile (TILES = 2: 0 m_first's query rows, 1 m_second's; TILES > 2: query block
    m_first + i): its first row m0, whether the sequence has rows there, and its key blocks (lo, full_lo,
    full_hi, n_blocks, n_free)."""
    if TILES > 2:
        m0 = (m_first + i) * BLOCK_M
    else:
        m0 = gl.where(i == 0, m_first, m_second) * BLOCK_M
    lo, full_lo, full_hi, hi = key_blocks(m0, sk, off, left, right, BLOCK_M, BLOCK_N)
    return m0, m0 < sq, lo, full_lo, full_hi, hi - lo, full_hi - full_lo


@gluon.jit
def _consumer(c: gl.constexpr, q_smem, q_rest_smem, k_smem, k_rest_smem, v_smem, o_buf, q_ready, q_free, k_ready, v_ready,
              k_empty, v_empty, turn, turn_sums, o_base, stride_o_s, dv, Lse_rows, first_tile, m_first, m_second, n_tiles, sq,
              sk, off, left, right, scale_log2, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_DV: gl.constexpr,
              CONSUMERS: gl.constexpr, TURNS: gl.constexpr, PINGPONG: gl.constexpr, OWN_O: gl.constexpr,
              TILES: gl.constexpr):
    """Consumer c through the program's tiles: each takes the ring's blocks and the turns where the tile
    before it left them, and gives its Q tile back to the loader (`q_free`) once it reads it no more."""
    dtype: gl.constexpr = v_smem.dtype
    # O's descriptor, made while Q's copy flies (each consumer its own: the loaders' time is Q's, K's and V's)
    o_desc = rows_descriptor(o_base, stride_o_s, sq, dv, [ROWS, BLOCK_DV],
                             gl.NVMMASharedLayout.get_default_for([ROWS, BLOCK_DV], dtype))
    if TILES == 1:  # Q's first copy, the ring's and the turns' first: constants, so that the steps carry no offsets
        m0, active, lo, full_lo, full_hi, n_blocks, n_free = first_tile
        _consumer_tile(c, q_smem, q_rest_smem, k_smem, k_rest_smem, v_smem, o_buf, q_ready, q_free, k_ready, v_ready, k_empty,
                       v_empty, turn, turn_sums, o_desc, Lse_rows, m0, 0, 0, 0, sq, sk, off, left, right, n_blocks, n_free, lo,
                       full_lo, full_hi, scale_log2, BLOCK_N, BLOCK_DV, CONSUMERS, TURNS, PINGPONG, OWN_O, TILES)
    else:
        r0 = n_tiles * 0
        k0 = n_tiles * 0
        q_phase = n_tiles * 0
        for i in range(n_tiles):
            m0, active, lo, full_lo, full_hi, n_blocks, n_free = _program_tile(i, m_first, m_second, sq, sk, off, left,
                                                                              right, BLOCK_M, BLOCK_N, TILES)
            if active:
                _consumer_tile(c, q_smem, q_rest_smem, k_smem, k_rest_smem, v_smem, o_buf, q_ready, q_free, k_ready,
                               v_ready, k_empty, v_empty, turn, turn_sums, o_desc, Lse_rows, m0, q_phase, r0, k0, sq, sk, off,
                               left, right, n_blocks, n_free, lo, full_lo, full_hi, scale_log2, BLOCK_N, BLOCK_DV, CONSUMERS,
                               TURNS, PINGPONG, OWN_O, TILES)
                r0 += n_blocks
                k0 += gl.where(n_blocks > 0, n_blocks + 1, 0)
                q_phase ^= 1


@gluon.jit
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
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_DQK: gl.constexpr, BLOCK_DV: gl.constexpr,
    BIAS_KIND: gl.constexpr, DROPOUT: gl.constexpr, SOFTMAX_TURNS: gl.constexpr = False,
    PINGPONG: gl.constexpr = False, TILES: gl.constexpr = 1,
):
    """SOFTMAX_TURNS and PINGPONG (build choices of the tile, not arguments; at most one): the consumers take
    turns at their softmax (_softmax_in_turn), or at issuing their products (_pingpong_blocks). TILES (a
    build choice too): 1, a program per query block; 2 (with PINGPONG), a program per pair of query blocks
    of one (head, batch entry), block M - 1 - p with block p (M blocks in all), so that under a causal mask
    every program has about the same work and one prologue serves two tiles; TILES > 2 (with PINGPONG), a
    program per run of TILES consecutive query blocks (for calls without a mask, whose tiles are alike), so
    that one prologue serves them all and each tile's Q lands under the tile before it (v3.21: GQA calls without a mask)."""
    gl.static_assert(BIAS_KIND == 0, "the v3 forward has no score terms")
    gl.static_assert(not DROPOUT, "the v3 forward has no dropout")
    gl.static_assert(not (SOFTMAX_TURNS and PINGPONG), "one schedule of the consumers' turns")
    CONSUMERS: gl.constexpr = BLOCK_M // ROWS
    gl.static_assert(CONSUMERS == 2, "two consumer warpgroups")
    gl.static_assert(TILES == 1 or PINGPONG, "several tiles a program take the ping-pong")
    # Heaviest query blocks (last, under causal masking) start first: a shorter tail.
    pid = gl.program_id(0)
    m_blocks = gl.cdiv(seqlen_q, BLOCK_M)
    m_first = m_blocks - 1 - pid
    if TILES == 2:
        m_second = pid
        n_tiles = gl.where(pid < m_first, 2, 1)
    elif TILES > 2:  # a run of TILES blocks from the first, the last program's cut at the sequence's end
        m_first = pid * TILES
        m_second = m_first
        n_tiles = gl.minimum(m_blocks - m_first, TILES)
    else:
        m_second = m_first
        n_tiles = m_blocks * 0 + 1
    h = gl.program_id(1)
    b = gl.program_id(2)
    q_start, sq = sequence_extent(CuSeqlensQ, SeqstartQ, b, seqlen_q, is_varlen, has_seqstart)
    k_start, sk = sequence_extent(CuSeqlensK, SeqstartK, b, seqlen_k, is_varlen, has_seqstart)
    if gl.minimum(m_first, m_second) * BLOCK_M >= sq:  # no tile of the program holds rows of the sequence
        return
    off = gl.where(bottom_right != 0, sk - sq, 0)
    left, right = window_sides(window_left, window_right, sq, sk)
    # A one-tile program's rows and key blocks, found once here, before the partitions start, rather than by each
    # partition (1.01x over the forward's points, within the noise at the two v3.14 had lost: NOTES.md, v3.17).
    # Two tiles a program find theirs in the partitions' loops.
    first_tile = _program_tile(0, m_first, m_first, sq, sk, off, left, right, BLOCK_M, BLOCK_N, 1)

    b64 = b.to(gl.int64)
    h64 = h.to(gl.int64)
    hk64 = (h // kv_group_size).to(gl.int64)
    q_row0 = q_start.to(gl.int64)
    k_row0 = k_start.to(gl.int64)
    dqk = head_dim_qk_div8 * 8
    dv = head_dim_v_div8 * 8
    dtype: gl.constexpr = Q.dtype.element_ty
    # Q's and K's tiles held whole, QK_WHOLE wide, or in two parts, QK_WHOLE and BLOCK_DQK - QK_WHOLE wide; their
    # TMA boxes the width of the narrower part (64 columns at 192: 128 bytes, the 128-wide part's swizzle)
    QK_WHOLE: gl.constexpr = whole_width(BLOCK_DQK)
    QK_BOX: gl.constexpr = BLOCK_DQK - QK_WHOLE if QK_WHOLE < BLOCK_DQK else BLOCK_DQK
    q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ROWS, QK_WHOLE], dtype)
    k_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, QK_WHOLE], dtype)
    v_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_DV], dtype)
    # The sequence's first row of the program's heads; the partitions make their descriptors from them
    # (_loader, _consumer), so that no one waits for all four to be made
    q_rows = Q + b64 * stride_q_b + q_row0 * stride_q_s + h64 * stride_q_h
    o_base = Out + b64 * stride_o_b + q_row0 * stride_o_s + h64 * stride_o_h
    k_rows = K + b64 * stride_k_b + k_row0 * stride_k_s + hk64 * stride_k_h
    v_rows = V + b64 * stride_v_b + k_row0 * stride_v_s + hk64 * stride_v_h
    Lse_rows = Lse + b64 * lse_stride_b + h64 * lse_stride_h + q_row0

    gl.static_assert(BLOCK_DV <= QK_WHOLE, "O's tile reuses Q's")
    gl.static_assert((QK_BOX == BLOCK_DQK) | (QK_BOX == 64), "a Q or K tile in two parts comes in 128-byte boxes")
    q_smem = gl.allocate_shared_memory(dtype, [CONSUMERS, ROWS, QK_WHOLE], q_layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, QK_WHOLE], k_layout)
    if QK_WHOLE < BLOCK_DQK:
        q_rest_smem = gl.allocate_shared_memory(dtype, [CONSUMERS, ROWS, BLOCK_DQK - QK_WHOLE], q_layout)
        k_rest_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, BLOCK_DQK - QK_WHOLE], k_layout)
    else:  # held whole: the "rest" is the tile itself, never read
        q_rest_smem = q_smem
        k_rest_smem = k_smem
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, BLOCK_DV], v_layout)
    # O's own buffer where shared memory has room (Q and K whole, up to 128 wide: 192 KiB in all at D=128), so
    # that a consumer gives Q back before its last P V; at 192 and 256 O leaves through Q's memory
    OWN_O: gl.constexpr = TILES > 1 and BLOCK_DQK <= 128
    if OWN_O:
        o_buf = gl.allocate_shared_memory(dtype, [CONSUMERS, ROWS, BLOCK_DV],
                                          gl.NVMMASharedLayout.get_default_for([ROWS, BLOCK_DV], dtype))
    else:
        o_buf = q_smem  # (not used)
    q_ready = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
    q_free = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for c in gl.static_range(CONSUMERS):
        mbarrier.init(q_ready.index(c), count=1)
        if TILES > 1:
            mbarrier.init(q_free.index(c), count=1)  # the consumer has given its Q buffer back
    # The turns' barriers (SOFTMAX_TURNS, PINGPONG) and the row sums of SOFTMAX_TURNS; unused,
    # they take no memory
    turn = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
    turn_sums = gl.allocate_shared_memory(gl.float32, [4 * ROWS],  # a power of two, room for every consumer
                                          gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0]))
    if SOFTMAX_TURNS or PINGPONG:  # one barrier a consumer: the turn passed on to it
        for c in gl.static_range(CONSUMERS):
            mbarrier.init(turn.index(c), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=CONSUMERS)  # every consumer releases a stage
        mbarrier.init(v_empty.index(i), count=CONSUMERS)

    # A consumer thread's registers (setmaxnreg): what the register file leaves beside the loaders' warpgroup
    # at 24 a thread (2 x 128 x 240 plus 128 x 24, within 65536).
    gl.warp_specialize([
        (_consumer, (0, q_smem, q_rest_smem, k_smem, k_rest_smem, v_smem, o_buf, q_ready, q_free, k_ready, v_ready,
                     k_empty, v_empty, turn, turn_sums, o_base, stride_o_s, dv, Lse_rows, first_tile, m_first, m_second,
                     n_tiles, sq, sk, off, left, right, scale_log2, BLOCK_M, BLOCK_N, BLOCK_DV, CONSUMERS, SOFTMAX_TURNS, PINGPONG,
                     OWN_O, TILES)),
        (_consumer, (1, q_smem, q_rest_smem, k_smem, k_rest_smem, v_smem, o_buf, q_ready, q_free, k_ready, v_ready,
                     k_empty, v_empty, turn, turn_sums, o_base, stride_o_s, dv, Lse_rows, first_tile, m_first, m_second,
                     n_tiles, sq, sk, off, left, right, scale_log2, BLOCK_M, BLOCK_N, BLOCK_DV, CONSUMERS, SOFTMAX_TURNS, PINGPONG,
                     OWN_O, TILES)),
        (_loader, (False, q_rows, v_rows, stride_q_s, stride_v_s, sq, sk, dqk, dv, q_smem, q_rest_smem, v_smem, v_smem,
                   q_ready, q_free, v_ready, v_empty, first_tile, m_first, m_second, n_tiles, off, left, right, CONSUMERS, BLOCK_M,
                   BLOCK_N, TILES)),
        (_loader, (True, q_rows, k_rows, stride_q_s, stride_k_s, sq, sk, dqk, dqk, q_smem, q_rest_smem, k_smem, k_rest_smem,
                   q_ready, q_free, k_ready, k_empty, first_tile, m_first, m_second, n_tiles, off, left, right, CONSUMERS, BLOCK_M,
                   BLOCK_N, TILES)),
    ], [4, 1, 1], [240, 24, 24])
