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
        """(rounds in which fmha_rt's median time was at most the peer's, rounds) where both rows were timed
        in the same rounds (implementations of a point take adjacent turns, so round i of one row and of
        the other ran under the same conditions); None otherwise."""
        ours, theirs = self.ours.get("round_ms"), self.theirs.get("round_ms")
        if (self.stand_in and not self.stand_in_shared_rounds) or not ours or not theirs or len(ours) != len(theirs):
            return None
        return sum(a <= b for a, b in zip(ours, theirs)), len(ours)


def shape_key(row):
    return tuple(row.get(key) for key in SHAPE_KEYS) + (tuple(row.get("seqlens") or ()),)


def _counterparts(rows, peer):
    """[(fmha_rt's row, the peer's timed row it is compared with)] for every fmha_rt row, timed or not, that
    has one: the peer's row of the same point and pass, or, where the peer has no row of that pass (a
    failed one counts as a row), of STAND_IN_PASS's pass."""
    timed = {(shape_key(r), r["pass"], r["impl"]): r for r in rows if r.get("tflops")}
    has_pass = {(shape_key(r), r["pass"], r["impl"]) for r in rows}
    found = []
    for ours in rows:
        if ours["impl"] != SUBJECT:
            continue
        shape, pass_name = shape_key(ours), ours["pass"]
        key = (shape, pass_name, peer)
        theirs = timed.get(key) if key in has_pass else timed.get((shape, STAND_IN_PASS.get(pass_name), peer))
        if theirs is not None:
            found.append((ours, theirs))
    return found


def comparisons(rows, peer, backward_turns_together=False):
    """Every (point, pass) at which both fmha_rt and `peer` have a timed row, in the rows' order;
    `backward_turns_together`: the run's setting of that name (whether a stand-in row shared our rounds)."""
    return [Comparison(ours["pass"], ours, theirs, backward_turns_together)
            for ours, theirs in _counterparts(rows, peer) if ours.get("tflops")]


@dataclasses.dataclass(frozen=True)
class Summary:
    """One pass and dtype of comparisons against one peer."""
    peer: str
    pass_name: str
    dtype: str
    items: tuple
    # fmha_rt's rows of this pass and dtype without a figure (an error) where the peer has one: a target of
    # "at least the peer on every point" is not met there, whatever the other points say
    failed: tuple = ()

    @property
    def at_or_above(self):
        return sum(c.ratio >= 1 for c in self.items)

    @property
    def lowest(self):
        return min(self.items, key=lambda c: c.ratio, default=None)

    @property
    def median_ratio(self):
        return statistics.median(c.ratio for c in self.items) if self.items else None

    @property
    def highest_ratio(self):
        return max((c.ratio for c in self.items), default=None)

    @property
    def stand_in(self):
        """'all', 'some' or '' of the comparisons against the peer's row of another pass."""
        count = sum(c.stand_in for c in self.items)
        return "all" if count and count == len(self.items) else "some" if count else ""


def summaries(rows, peers, backward_turns_together=False):
    """A Summary per (peer, pass, dtype) that has comparisons, peers in the given order and passes in
    the benchmark's order."""
    found = []
    for peer in peers:
        by_pass, failed = {}, {}
        for ours, theirs in _counterparts(rows, peer):
            key = (ours["pass"], ours["dtype"])
            if ours.get("tflops"):
                by_pass.setdefault(key, []).append(Comparison(ours["pass"], ours, theirs, backward_turns_together))
            else:
                failed.setdefault(key, []).append(ours)
        order = sorted(set(by_pass) | set(failed),
                       key=lambda k: (flops.PASSES.index(k[0]) if k[0] in flops.PASSES else 99, k[1]))
        found += [Summary(peer, p, d, tuple(by_pass.get((p, d), ())), tuple(failed.get((p, d), ()))) for p, d in order]
    return found
