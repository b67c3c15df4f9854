"""An independent dropout keep mask: Philox4x32-10 in NumPy, written from the published algorithm
(Salmon, Moraes, Dror and Shaw, "Parallel random numbers: as easy as 1, 2, 3", SC 2011), checked against
the algorithm's published known-answer vectors, and the counter layout fmha_rt documents
(kernels/portable/fmha_common.py):

- one Philox call per group of four neighbouring keys; its four outputs are the draws of keys 4g .. 4g+3;
- the counter of query row i, key j of (batch b, query head h) is
  offset + ((b * Hq + h) * Sq + i) * ceil(Sk / 4) + j // 4, a 64-bit number whose low and high words are
  the first two counter words (the last two are 0); Sq and Sk are the call's (in varlen calls the
  maximum lengths, with i and j counted from each sequence's start);
- the 64-bit seed's low and high words are the key;
- a probability is kept when its draw is >= round(p * 2^32) (at most 2^32 - 1).

Nothing here calls fmha_rt's kernels, so a mistake they share (one mask for every head, a counter cut to
32 bits, lanes in another order) shows as a difference from this module.
"""
import numpy as np

MULTIPLIERS = (0xD2511F53, 0xCD9E8D57)
KEY_STEPS = (0x9E3779B9, 0xBB67AE85)
ROUNDS = 10
WORD = np.uint64(0xFFFFFFFF)
LANES = 4

# Random123's kat_vectors: (counter words, key words) -> outputs.
KNOWN_ANSWERS = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


def _mulhilo(multiplier, x):
    """(high word, low word) of the 64-bit product of a 32-bit constant and uint32 words (held in uint64)."""
    product = np.uint64(multiplier) * x
    return product >> np.uint64(32), product & WORD


def philox4x32(counter, key, rounds=ROUNDS):
    """Philox4x32-`rounds` of counter words (four arrays of uint32 values, broadcast together) under key
    words (two ints): four uint32 arrays."""
    c0, c1, c2, c3 = (np.asarray(c, dtype=np.uint64) & WORD for c in counter)
    k0, k1 = np.uint64(key[0] & 0xFFFFFFFF), np.uint64(key[1] & 0xFFFFFFFF)
    for round_index in range(rounds):
        if round_index:  # the key is bumped between rounds
            k0 = (k0 + np.uint64(KEY_STEPS[0])) & WORD
            k1 = (k1 + np.uint64(KEY_STEPS[1])) & WORD
        hi0, lo0 = _mulhilo(MULTIPLIERS[0], c0)
        hi1, lo1 = _mulhilo(MULTIPLIERS[1], c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return tuple(c.astype(np.uint32) for c in (c0, c1, c2, c3))


def keep_threshold(dropout_p):
    return min(round(dropout_p * 2**32), 2**32 - 1)


def draws(seed, counters):
    """uint32 [..., 4]: the four draws of each 64-bit counter (int array) under a 64-bit seed."""
    counters = np.asarray(counters, dtype=np.uint64)
    zero = np.zeros_like(counters)
    seed = int(seed) & 0xFFFFFFFFFFFFFFFF
    out = philox4x32((counters & WORD, counters >> np.uint64(32), zero, zero), (seed & 0xFFFFFFFF, seed >> 32))
    return np.stack(out, axis=-1)


def keep_mask(seed, offset, batch, heads_q, seqlen_q, seqlen_k, dropout_p):
    """bool [batch, heads_q, seqlen_q, seqlen_k]: True where the kernels keep the probability."""
    groups = -(-seqlen_k // LANES)
    bh = np.arange(batch * heads_q, dtype=np.uint64).reshape(batch, heads_q, 1, 1)
    rows = np.arange(seqlen_q, dtype=np.uint64).reshape(1, 1, seqlen_q, 1)
    group = np.arange(groups, dtype=np.uint64).reshape(1, 1, 1, groups)
    counters = np.uint64(offset) + (bh * np.uint64(seqlen_q) + rows) * np.uint64(groups) + group
    values = draws(seed, counters).reshape(batch, heads_q, seqlen_q, groups * LANES)[..., :seqlen_k]
    return values >= np.uint32(keep_threshold(dropout_p))


def varlen_keep_masks(seed, offset, heads_q, lens_q, lens_k, dropout_p):
    """One bool [heads_q, lq, lk] mask per sequence of a varlen call (fmha_rt.reference's dropout_keep
    form): each sequence draws from the rows and keys of the call's maximum lengths."""
    full = keep_mask(seed, offset, len(lens_q), heads_q, max(lens_q), max(lens_k), dropout_p)
    return [full[b, :, :lq, :lk] for b, (lq, lk) in enumerate(zip(lens_q, lens_k))]
