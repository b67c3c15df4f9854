"""Device helpers shared by the portable forward and backward kernels.

Conventions every kernel of the family follows:
- Scores live in the log2 domain: s = (q . k) * scale * log2(e) (+ bias * log2(e)), so the softmax uses
  exp2. LSE is stored in natural log.
- Masking: key j is visible from query i iff i + off - left <= j <= i + off + right, off = Sk - Sq for
  bottom-right alignment (per sequence) and 0 otherwise; a negative window side is unbounded.
- Offsets that can pass 2**31 elements (batch, head and sequence starts, rows times a row stride) are
  formed in int64 once per tile; offsets inside a tile stay int32.
- Dropout counters: one Philox call yields four 32-bit numbers, used for four neighbouring keys. The
  counter of (b, h, i, j) is offset + ((b * Hq + h) * Sq + i) * ceil(Sk / 4) + j // 4 (Sq, Sk the
  problem's, the maximum lengths in varlen mode) and lane j % 4 picks one of the four outputs.
"""
import triton
import triton.language as tl

from fmha_rt.plan.abi import BIAS_ALIBI, BIAS_TENSOR

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)
KIND_TENSOR = tl.constexpr(BIAS_TENSOR)
KIND_ALIBI = tl.constexpr(BIAS_ALIBI)
DROPOUT_LANES = tl.constexpr(4)


@triton.jit
def sequence_extent(CuSeqlens, Seqstart, b, seqlen, is_varlen, has_seqstart):
    """(first physical row, logical length) of sequence b: the whole dim in batched mode, cu_seqlens
    (and the optional padded seqstart) in varlen mode."""
    start = b * 0
    length = seqlen
    if is_varlen:
        start = tl.load(CuSeqlens + b)
        length = tl.load(CuSeqlens + b + 1) - start
        if has_seqstart:
            start = tl.load(Seqstart + b)
    return start, length


@triton.jit
def row_stats_start(q_start, b, is_varlen):
    """Where sequence b's rows start in the backward's per-row statistics (Delta and Lse2, fp32 in the
    workspace, [B, Hq, ceil8(Sq)] batched or [Hq, ceil8(total_q) + 8 * B] in varlen mode), past the head
    and batch strides: 0 batched, 8 * (q_start // 8 + b) in varlen mode, which lies past the end of
    sequence b - 1. Always a multiple of 8 rows, which the compiler can see, so a block's loads
    vectorise; at an arbitrary q_start they were one 4-byte copy per row (NOTES.md v11)."""
    return tl.where(is_varlen != 0, 8 * (q_start // 8 + b).to(tl.int64), 0)


@triton.jit
def window_sides(window_left, window_right, sq, sk):
    """The window with unbounded (-1) sides replaced by a reach no query can exceed."""
    unbounded = sq + sk
    left = tl.where(window_left < 0, unbounded, window_left)
    right = tl.where(window_right < 0, unbounded, window_right)
    return left, right


@triton.jit
def visible(q_idx, k_idx, off, left, right, sk):
    """Broadcast predicate: key k_idx exists and lies in the window of query q_idx."""
    diag = q_idx + off
    return (k_idx >= diag - left) & (k_idx <= diag + right) & (k_idx < sk)


@triton.jit
def key_blocks(m0, sk, off, left, right, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Key blocks that query rows [m0, m0 + BLOCK_M) can see, in block indices:
    [lo, full_lo) and [full_hi, hi) need the element mask, [full_lo, full_hi) are visible to every row.
    All quantities are clamped to be >= 0 before dividing (integer division truncates on the GPU)."""
    first_key = tl.maximum(m0 + off - left, 0)
    end_key = tl.minimum(tl.maximum(m0 + BLOCK_M - 1 + off + right + 1, 0), sk)
    lo = first_key // BLOCK_N
    hi = tl.maximum(tl.cdiv(end_key, BLOCK_N), lo)
    # A block is mask-free when its first key is visible from the block's last query (left side) and
    # its last key from the block's first query (right side), and it lies inside the sequence.
    full_lo = tl.minimum(tl.maximum(tl.cdiv(tl.maximum(m0 + BLOCK_M - 1 + off - left, 0), BLOCK_N), lo), hi)
    full_hi = tl.minimum(tl.maximum(tl.minimum(tl.maximum(m0 + off + right + 1, 0), sk) // BLOCK_N, full_lo), hi)
    return lo, full_lo, full_hi, hi


@triton.jit
def query_blocks(n0, sq, off, left, right, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr):
    """Query blocks that see some key of [n0, n0 + BLOCK_N), split like key_blocks: a mask-free block
    [full_lo, full_hi) also lies inside the sequence, so its loads need no row mask (the block that
    holds row sq - 1 and rows past it is a masked one)."""
    first_query = tl.maximum(n0 - off - right, 0)
    end_query = tl.minimum(tl.maximum(n0 + BLOCK_N - 1 - off + left + 1, 0), sq)
    lo = first_query // BLOCK_M
    hi = tl.maximum(tl.cdiv(end_query, BLOCK_M), lo)
    full_lo = tl.minimum(tl.maximum(tl.cdiv(tl.maximum(n0 + BLOCK_N - 1 - off - right, 0), BLOCK_M), lo), hi)
    full_hi = tl.minimum(tl.maximum(tl.minimum(tl.maximum(n0 - off + left + 1, 0), sq) // BLOCK_M, full_lo), hi)
    return lo, full_lo, full_hi, hi


@triton.jit
def unhoisted(offsets, m0):
    """`offsets` (a query block's loop-invariant tile offsets) made to depend on the block start m0 >= 0
    without changing them: (m0 >> 31) is 0 but opaque to the compiler, and times 16 it keeps the
    offsets' 16-element alignment, so loads still vectorise. Without it the backend hoists the tiles'
    64-bit byte offsets out of the query-block loop, where they stay live across it and spill."""
    return offsets + (m0 >> 31) * 16


@triton.jit
def masked_block(t, lo, full_lo, full_hi):
    """The t-th block needing the element mask: first the leading ones [lo, full_lo), then the trailing
    ones [full_hi, hi). One loop serves both, so the masked body is compiled once."""
    leading = full_lo - lo
    return tl.where(t < leading, lo + t, full_hi + t - leading)


@triton.jit
def bias_tile(Bias_rows, stride_row, q_local, k_idx, q_ok, sk):
    """A bias tile in the log2 domain. Bias_rows points at the tile's first query row; q_local and
    k_idx are broadcast-shaped (rows of the tile, absolute keys)."""
    ok = q_ok & (k_idx < sk)
    return tl.load(Bias_rows + q_local * stride_row + k_idx, mask=ok, other=0.0).to(tl.float32) * LOG2E


@triton.jit
def alibi_tile(slope_log2, q_idx, k_idx, off):
    """-slope * |i + off - j| in the log2 domain, broadcast-shaped like its index arguments."""
    distance = tl.abs(q_idx + off - k_idx).to(tl.float32)
    return -slope_log2 * distance


@triton.jit
def scores(qk, q_idx, k_idx, q_ok, off, left, right, sk, Bias_rows, stride_bias_s, q_local, slope_log2,
           scale_log2, MASKED: tl.constexpr, BIAS_KIND: tl.constexpr):
    """(s, scale) with log2-domain logits s * scale, masked to -inf on boundary blocks.

    Index arguments are broadcast-shaped like the tile (q_local: rows relative to Bias_rows). Without
    a bias term s is the raw product and the caller folds the scale into the exponent (one FMA per
    element); with one, s is already scaled and scale is 1."""
    if BIAS_KIND == KIND_TENSOR:
        s = qk * scale_log2 + bias_tile(Bias_rows, stride_bias_s, q_local, k_idx, q_ok, sk)
        scale = 1.0
    elif BIAS_KIND == KIND_ALIBI:
        s = qk * scale_log2 + alibi_tile(slope_log2, q_idx, k_idx, off)
        scale = 1.0
    else:
        s = qk
        scale = scale_log2
    if MASKED:
        s = tl.where(visible(q_idx, k_idx, off, left, right, sk), s, float("-inf"))
    return s, scale


@triton.jit
def dropout_row_counters(philox_offset, bh, seqlen_q, seqlen_k, rows):
    """int64 Philox counter of key 0 for each query row (rows: logical indices in the sequence)."""
    groups_per_row = tl.cdiv(seqlen_k, DROPOUT_LANES).to(tl.int64)
    return philox_offset + (bh.to(tl.int64) * seqlen_q + rows) * groups_per_row


@triton.jit
def dropout_draws(seed, row_counters, n0, BLOCK_N: tl.constexpr):
    """uint32 [rows, BLOCK_N]: the Philox draws of keys [n0, n0 + BLOCK_N) (n0 a multiple of 4). A
    probability is kept when its draw is >= the threshold p * 2**32."""
    groups = n0 // DROPOUT_LANES + tl.arange(0, BLOCK_N // DROPOUT_LANES)
    r0, r1, r2, r3 = tl.randint4x(seed, row_counters[:, None] + groups[None, :])
    # join(join(r0, r2), join(r1, r3)) puts r[2x + y] at [..., x, y]: lane j % 4 reads r[j % 4].
    return tl.reshape(tl.join(tl.join(r0, r2), tl.join(r1, r3)), (row_counters.shape[0], BLOCK_N))


@triton.jit
def philox_seed_offset(philox_seed, philox_offset, PhiloxSeedOffset, philox_from_ptr):
    """Seed and offset by value, or read from device memory (two int64) for CUDA-graph capture."""
    seed = philox_seed
    offset = philox_offset
    if philox_from_ptr:
        seed = tl.load(PhiloxSeedOffset)
        offset = tl.load(PhiloxSeedOffset + 1)
    return seed, offset
