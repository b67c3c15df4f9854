"""What both v3 kernels share: the portable family's scalar and mask helpers, compiled as Gluon
functions (their bodies are scalar loads, arithmetic and broadcasts), and the 2-D TMA descriptor of one
(sequence, head) of a [B, S, H, D] or varlen [total, H, D] array."""
from triton.experimental import gluon
from triton.experimental.gluon.language.nvidia.hopper import tma

from kernels.portable import fmha_common

sequence_extent = gluon.jit(fmha_common.sequence_extent.fn)
window_sides = gluon.jit(fmha_common.window_sides.fn)
key_blocks = gluon.jit(fmha_common.key_blocks.fn)
query_blocks = gluon.jit(fmha_common.query_blocks.fn)
masked_block = gluon.jit(fmha_common.masked_block.fn)
row_stats_start = gluon.jit(fmha_common.row_stats_start.fn)
visible = gluon.jit(fmha_common.visible.fn)


@gluon.jit
def rows_descriptor(Base, b64, stride_b, row0, stride_s, head64, stride_h, rows, dims, block_shape, layout):
    """Rows [row0, row0 + rows) of head `head64` of batch entry `b64`, `dims` wide, in tiles of
    `block_shape`: TMA fills what lies past `rows` or `dims` with zeros and clips stores there."""
    return tma.make_tensor_descriptor(Base + b64 * stride_b + row0 * stride_s + head64 * stride_h, [rows, dims],
                                      [stride_s, 1], block_shape, layout)
