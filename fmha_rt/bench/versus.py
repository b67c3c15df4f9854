"""fmha_rt's speed over one peer's, point by point: the form the project's speed targets take
("at least FlexAttention on every point").

A peer without a deterministic backward (none of the torch-based ones has one) is held against
fmha_rt's deterministic backward with its only backward: the work is the same, and a user who needs
bitwise-reproducible gradients would otherwise have nothing to compare.
"""

import dataclasses
import statistics

from . import flops
from .peers import SUBJECT

# The pass a peer's row stands in for where the peer has no row of that pass.
STAND_IN_PASS = {"bwd_det": "bwd"}
# A row's point, less its pass: the fields that must agree for two rows to be compared.
SHAPE_KEYS = ("kind", "dtype", "B", "Hq", "Hk", "Sq", "Sk", "D", "causal")


@dataclasses.dataclass(frozen=True)
class Comparison:
    """fmha_rt's row and the peer's at one point and pass."""
    pass_name: str
    ours: dict
    theirs: dict
    stand_in_shared_rounds: bool = False  # the stand-in row took its turns in the same rounds as ours

    @property
    def stand_in(self):
        """True where the peer's row is of another pass (STAND_IN_PASS)."""
        return self.theirs["pass"] != self.pass_name

    @property
    def ratio(self):
        return self.ours["tflops"] / self.theirs["tflops"]

    @property
    def rounds_ahead(self):
        """(rounds in which fmha_rt's median was at least the peer's, rounds) where both rows were timed in
        the same rounds (implementations of a point take adjacent turns, so round i of one row and of the
        other ran under the same conditions); None otherwise."""
        ours, theirs = self.ours.get("round_ms"), self.theirs.get("round_ms")
        if (self.stand_in and not self.stand_in_shared_rounds) or not ours or not theirs or len(ours) != len(theirs):
            return None
        return sum(a <= b for a, b in zip(ours, theirs)), len(ours)


def shape_key(row):
    return tuple(row.get(key) for key in SHAPE_KEYS) + (tuple(row.get("seqlens") or ()),)


def comparisons(rows, peer, backward_turns_together=False):
    """Every (point, pass) at which both fmha_rt and `peer` have a timed row, in the rows' order;
    `backward_turns_together`: the run's setting of that name (whether a stand-in row shared our rounds)."""
    timed = {(shape_key(r), r["pass"], r["impl"]): r for r in rows if r.get("tflops")}
    # a peer's failed row of a pass it has is no reason to compare with another pass
    has_pass = {(shape_key(r), r["pass"], r["impl"]) for r in rows}
    found = []
    for (shape, pass_name, impl), ours in timed.items():
        if impl != SUBJECT:
            continue
        key = (shape, pass_name, peer)
        theirs = timed.get(key) if key in has_pass else timed.get((shape, STAND_IN_PASS.get(pass_name), peer))
        if theirs is not None:
            found.append(Comparison(pass_name, ours, theirs, backward_turns_together))
    return found


@dataclasses.dataclass(frozen=True)
class Summary:
    """One pass and dtype of comparisons against one peer."""
    peer: str
    pass_name: str
    dtype: str
    items: tuple

    @property
    def at_or_above(self):
        return sum(c.ratio >= 1 for c in self.items)

    @property
    def lowest(self):
        return min(self.items, key=lambda c: c.ratio)

    @property
    def median_ratio(self):
        return statistics.median(c.ratio for c in self.items)

    @property
    def highest_ratio(self):
        return max(c.ratio for c in self.items)

    @property
    def stand_in(self):
        return any(c.stand_in for c in self.items)


def summaries(rows, peers, backward_turns_together=False):
    """A Summary per (peer, pass, dtype) that has comparisons, peers in the given order and passes in
    the benchmark's order."""
    found = []
    for peer in peers:
        by_pass = {}
        for c in comparisons(rows, peer, backward_turns_together):
            by_pass.setdefault((c.pass_name, c.ours["dtype"]), []).append(c)
        order = sorted(by_pass, key=lambda k: (flops.PASSES.index(k[0]) if k[0] in flops.PASSES else 99, k[1]))
        found += [Summary(peer, p, d, tuple(by_pass[(p, d)])) for p, d in order]
    return found
