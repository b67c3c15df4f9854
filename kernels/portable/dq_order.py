"""dQ added in key-block order: the protocol of the ORDERED dQ strategy (fmha_bwd_dkdv_ordered).

Every dK/dV program of that strategy adds its share of dQ, one (query block, query head, batch entry)
tile at a time, into one zeroed fp32 accumulator. fp32 addition is not associative, so for the sum to be
the same bits every run the additions into a tile must come in one order, whatever the timing: the order
of the key blocks. Each tile has an int32 counter (zeroed) of the key blocks that have added into it.
Key block n adds into query block m's tile when the counter equals n's rank among the key blocks that
see m (key_block_rank), with plain loads and stores (it is the only writer then), makes those stores
visible and increments the counter. The last word of the same zeroed int32 region hands out work items.

The order region ('dq_order' in the workspace, int32, zeroed): [0] the work-item ticket, then one
counter per (batch entry b, query head h, query block m) at 1 + (b * Hq + h) * cdiv(Sq, BLOCK_M) + m
(Sq the problem's, the longest sequence in varlen mode).

Progress. Work items are (key block, key head, batch entry), numbered key block slowest, and a program
takes its next item from the ticket (an atomic increment), so items are handed out in increasing order
to programs that are running. An item waits only for items of the same key head and batch entry with a
smaller key block, which have smaller numbers. So the smallest unfinished item is held by a running
program and every item it waits for is finished: it never waits, and finishes. By induction every item
finishes, for any number of programs and whether or not they are all resident at once (a static
assignment item = pid + i * P would need all P programs resident: a waiting program holds its slot).
The order of the additions, and so every bit of dQ, does not depend on the number of programs.
"""
import triton
import triton.language as tl


@triton.jit
def key_block_rank(n0, m0, off, left, BLOCK_N: tl.constexpr):
    """The rank of the key block starting at n0 among the key blocks that see the query block starting at
    m0: those form the run [lo, hi) of key_blocks (fmha_common), and lo = max(m0 + off - left, 0) // BLOCK_N
    for every mask (left: the window's left side with unbounded replaced, as window_sides gives it). It
    is also the first key block whose query_blocks range reaches m0's block, so that the two helpers agree
    on who adds into the tile."""
    return n0 // BLOCK_N - tl.maximum(m0 + off - left, 0) // BLOCK_N


@triton.jit
def order_counters(DqOrder, bh, seqlen_q, BLOCK_M: tl.constexpr):
    """The counters of batch-and-head index bh = b * Hq + h (one per query block of BLOCK_M rows)."""
    return DqOrder + 1 + bh.to(tl.int64) * tl.cdiv(seqlen_q, BLOCK_M)


@triton.jit
def ticket_item(item, key_blocks, slots, CHUNK: tl.constexpr):
    """The (key block, slot) of ticket `item` where tickets go by chunks of CHUNK key blocks (the v3 ORDERED
    form's order): chunk slowest, then the slot (key head and batch entry), then the chunk's key blocks
    (the last chunk may hold fewer). CHUNK = 1 is key block slowest, as next_item's users number them. A
    smaller key block of the same slot still has a smaller ticket, so the progress argument above holds,
    and the programs running at once hold about CHUNK key blocks of each slot they work on: they read the
    same Q and dO rows and add into the same dQ tiles while those are in L2, where key block slowest has
    every program on another head and the backward waits on memory."""
    per_chunk = CHUNK * slots
    chunk = item // per_chunk
    first = chunk * CHUNK
    width = tl.minimum(key_blocks - first, CHUNK)
    rest = item - chunk * per_chunk
    return first + rest % width, rest // width


@triton.jit
def next_item(DqOrder):
    """The next work item's number (the ticket at DqOrder[0], one atomic a program per item)."""
    return tl.atomic_add(DqOrder, 1, sem="relaxed")


@triton.jit
def add_in_key_block_order(acc_ptrs, tile, mask, Counter, rank):
    """acc += tile once `rank` key blocks have added into the accumulator tile, then count this one.

    The acquiring reads of the counter make the earlier key blocks' stores visible; the accumulator is read
    through L2 (.cg), where those stores are, never from a stale L1 line. The barrier makes every thread's
    stores part of the program's before the releasing increment publishes them."""
    while tl.atomic_add(Counter, 0, sem="acquire") != rank:
        pass
    acc = tl.load(acc_ptrs, mask=mask, other=0.0, cache_modifier=".cg")
    tl.store(acc_ptrs, acc + tile, mask=mask)
    tl.debug_barrier()
    tl.atomic_add(Counter, 1, sem="release")
