"""Head-dim padding: copies between a caller's [.., H, d] array and a zero-padded [.., H, Dp] buffer.

The attention kernels take head dims in units of 8 (Dp = d rounded up to 8) and strides that are
multiples of 8, so a call whose head dim is not a multiple of 8 runs on padded copies: fmha_pad with
WIDEN copies q, k, v (and out, dout) into their buffers, writing zeros in columns d..Dp; without WIDEN
it copies the d real columns of an output buffer (out; dq, dk, dv) back, writing nothing else of the
caller's array.

One program per (block of BLOCK_R (row, head) pairs of one sequence, sequence): rows are [B, S] in
batched mode (sequence b is batch entry b) and the packed rows of sequence b in varlen mode, where the
buffer has the caller's row layout, so rows outside every sequence (padded seqstarts) are never read or
written on either side. A padded width up to NARROW_MAX moves in [BLOCK_R, NARROW_COLUMNS] steps, a
wider one in [WIDE_ROWS, WIDE_COLUMNS] steps: one variant serves every head dim.

Alignment: the buffer's side keeps the family's promises (a 16-byte aligned pointer, `stride_*` in
multiples of 8, head stride Dp). The caller's side has none: with d = 5 in fp16 a contiguous array
has rows 10 bytes apart and a view may start anywhere, so its pointer is named `Unaligned*` (the build
then promises only element alignment) and its strides `pitch_*` (no divisibility promise).
"""
import triton
import triton.language as tl

from kernels.portable.fmha_common import sequence_extent


@triton.jit
def _copy_pairs(UnalignedArray, Padded, start, b64, r0, pairs, num_heads, pitch_b, pitch_s, pitch_h,
                stride_padded_b, stride_padded_s, head_dim, padded_dim, ROWS: tl.constexpr, COLUMNS: tl.constexpr,
                WIDEN: tl.constexpr):
    """Copies the (row, head) pairs [r0, r0 + ROWS) of a sequence, COLUMNS columns at a time."""
    r = r0 + tl.arange(0, ROWS)
    row_ok = r < pairs
    row = start.to(tl.int64) + r // num_heads
    h = r % num_heads
    caller = UnalignedArray + b64 * pitch_b + row * pitch_s + h * pitch_h
    padded = Padded + b64 * stride_padded_b + row * stride_padded_s + h * padded_dim
    for c0 in range(0, padded_dim, COLUMNS):
        cols = c0 + tl.arange(0, COLUMNS)
        real = row_ok[:, None] & (cols < head_dim)[None, :]
        if WIDEN:
            x = tl.load(caller[:, None] + cols[None, :], mask=real, other=0.0)
            tl.store(padded[:, None] + cols[None, :], x, mask=row_ok[:, None] & (cols < padded_dim)[None, :])
        else:
            x = tl.load(padded[:, None] + cols[None, :], mask=real)
            tl.store(caller[:, None] + cols[None, :], x, mask=real)


@triton.jit
def fmha_pad(
    UnalignedArray, Padded, CuSeqlens, Seqstart,
    pitch_b, pitch_s, pitch_h,
    stride_padded_b, stride_padded_s,
    seqlen, num_heads, head_dim, padded_dim_div8, is_varlen, has_seqstart,
    BLOCK_R: tl.constexpr, NARROW_MAX: tl.constexpr, NARROW_COLUMNS: tl.constexpr, WIDE_ROWS: tl.constexpr,
    WIDE_COLUMNS: tl.constexpr, WIDEN: tl.constexpr,
):
    b = tl.program_id(1)
    start, length = sequence_extent(CuSeqlens, Seqstart, b, seqlen, is_varlen, has_seqstart)
    pairs = length.to(tl.int64) * num_heads
    r0 = tl.program_id(0).to(tl.int64) * BLOCK_R
    if r0 >= pairs:
        return
    b64 = b.to(tl.int64)
    padded_dim = padded_dim_div8 * 8
    # The caller's side moves in scalar accesses (it has no alignment), a warp's access covering a tile
    # row: rows up to NARROW_MAX wide go in narrow tiles (few idle lanes), wider ones in wide tiles
    # (fewer, fuller accesses per row).
    if padded_dim <= NARROW_MAX:
        _copy_pairs(UnalignedArray, Padded, start, b64, r0, pairs, num_heads, pitch_b, pitch_s, pitch_h,
                    stride_padded_b, stride_padded_s, head_dim, padded_dim, BLOCK_R, NARROW_COLUMNS, WIDEN)
    else:
        for sub in tl.static_range(0, BLOCK_R, WIDE_ROWS):
            _copy_pairs(UnalignedArray, Padded, start, b64, r0 + sub, pairs, num_heads, pitch_b, pitch_s, pitch_h,
                        stride_padded_b, stride_padded_s, head_dim, padded_dim, WIDE_ROWS, WIDE_COLUMNS, WIDEN)
