"""Run under TRITON_INTERPRET=1 by test_ordered_dq.py: for each mask and tile case on stdin (JSON lines), every
key block records, for every query block it visits (query_blocks, as the dK/dV programs loop), the rank
key_block_rank gives it there; prints one JSON line per case: {"ranks": [[key block, query block, rank]...]}.
A line {"tickets": [key blocks, slots, chunk]} instead gets every ticket's (key block, slot) from ticket_item:
{"items": [[key block, slot]...]} in ticket order.
"""
import json
import sys

import torch
import triton
import triton.language as tl

from kernels.portable.dq_order import key_block_rank, ticket_item
from kernels.portable.fmha_common import query_blocks, window_sides


@triton.jit
def _record_ranks(Ranks, sq, sk, window_left, window_right, bottom_right, max_query_blocks,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    n = tl.program_id(0)
    off = tl.where(bottom_right != 0, sk - sq, 0)
    left, right = window_sides(window_left, window_right, sq, sk)
    lo, _, _, hi = query_blocks(n * BLOCK_N, sq, off, left, right, BLOCK_N, BLOCK_M)
    for m in range(lo, hi):
        tl.store(Ranks + n * max_query_blocks + m, key_block_rank(n * BLOCK_N, m * BLOCK_M, off, left, BLOCK_N))


@triton.jit
def _record_tickets(Items, key_blocks, slots, CHUNK: tl.constexpr):
    item = tl.program_id(0)
    n_block, slot = ticket_item(item, key_blocks, slots, CHUNK)
    tl.store(Items + 2 * item, n_block)
    tl.store(Items + 2 * item + 1, slot)


def tickets(key_blocks, slots, chunk) -> list:
    items = torch.full((key_blocks * slots, 2), -1, dtype=torch.int32)
    _record_tickets[(key_blocks * slots,)](items, key_blocks, slots, CHUNK=chunk)
    return items.tolist()


def ranks(case) -> list:
    sq, sk, left, right, bottom_right, block_m, block_n = case
    key_blocks, query_blocks_ = -(-sk // block_n), max(-(-sq // block_m), 1)
    table = torch.full((max(key_blocks, 1), query_blocks_), -1, dtype=torch.int32)
    if key_blocks:
        _record_ranks[(key_blocks,)](table, sq, sk, left, right, int(bottom_right), query_blocks_,
                                     BLOCK_M=block_m, BLOCK_N=block_n)
    return [[n, m, int(table[n, m])] for n in range(key_blocks) for m in range(query_blocks_) if table[n, m] >= 0]


if __name__ == "__main__":
    for line in sys.stdin:
        case = json.loads(line)
        if isinstance(case, dict):
            print(json.dumps({"items": tickets(*case["tickets"])}), flush=True)
        else:
            print(json.dumps({"ranks": ranks(case)}), flush=True)
