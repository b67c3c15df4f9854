"""fmha_rt's speed over its peers', point by point, computed only within one run.

At a point, fmha_rt and a peer took a turn in every round, adjacent in time. A round's ratio is the peer's
median ms of that round over fmha_rt's (above 1: fmha_rt is faster); a comparison's figure is the median of
those per-round ratios, with their lowest and highest as its spread. Ratios of figures from different rounds,
let alone different runs, are never formed: rows pair only when they carry the same run (the "run" a merged
record gives each row; none in a single run's record) and the same number of rounds.

Verdict. The round-to-round noise of a row is the interquartile range of its round medians over their median;
a comparison's noise is the larger of its two rows'. A comparison whose middle half of per-round ratios (first
to third quartile) straddles 1.0, or whose median is within the noise of 1.0, is "parity"; otherwise "faster"
or "slower". Quartiles rather than the extremes, so that one disturbed round neither makes nor hides a
difference; the spread shown is still the lowest and highest round.

Only rows that passed the correctness gate (correctness.py) and were timed take part; a peer's row of the
same pass is the only counterpart (a peer without a deterministic mode has no bwd_det row to compare). The
best peer at a point is the fastest passing peer by median ms.
"""

import dataclasses
import statistics

from . import flops
from .peers import OWN_VARIANTS, SUBJECT

# A row's point, less its pass: the fields that must agree for two rows to be compared.
SHAPE_KEYS = ("kind", "dtype", "B", "Hq", "Hk", "Sq", "Sk", "D", "causal")
VERDICTS = ("faster", "parity", "slower")


def shape_key(row):
    return tuple(row.get(key) for key in SHAPE_KEYS) + (tuple(row.get("seqlens") or ()),)


def pair_key(row):
    """What two rows must share to be compared: the run, the point and the pass."""
    return row.get("run"), shape_key(row), row["pass"]


def timed(row):
    """Whether a row has a figure that may enter a ratio: timed, no error, the correctness check passed."""
    return "ms" in row and "error" not in row and (row.get("check") or {}).get("passed", True)


def round_ms(row):
    return row.get("round_ms") or [row["ms"]]


def quartiles(values):
    """(first, third) quartile of values, the extremes' inclusive interpolation; (v, v) for a single value."""
    if len(values) < 2:
        return values[0], values[0]
    first, _, third = statistics.quantiles(values, n=4, method="inclusive")
    return first, third


def noise(row):
    """The interquartile range of a row's round medians over their median (0 with a single round)."""
    values = round_ms(row)
    first, third = quartiles(values)
    return (third - first) / statistics.median(values)


@dataclasses.dataclass(frozen=True)
class Comparison:
    """fmha_rt's row and the peer's at one point and pass, of one run."""
    ours: dict
    theirs: dict

    @property
    def pass_name(self):
        return self.ours["pass"]

    @property
    def peer(self):
        return self.theirs["impl"]

    @property
    def round_ratios(self):
        return [theirs / ours for ours, theirs in zip(round_ms(self.ours), round_ms(self.theirs))]

    @property
    def ratio(self):
        return statistics.median(self.round_ratios)

    @property
    def spread(self):
        return min(self.round_ratios), max(self.round_ratios)

    @property
    def noise(self):
        return max(noise(self.ours), noise(self.theirs))

    @property
    def verdict(self):
        low, high = quartiles(self.round_ratios)
        if low <= 1.0 <= high or abs(self.ratio - 1.0) <= self.noise:
            return "parity"
        return "faster" if self.ratio > 1.0 else "slower"

    def text(self):
        """'1.043 [1.021-1.060] faster'."""
        low, high = self.spread
        return f"{self.ratio:.3f} [{low:.3f}-{high:.3f}] {self.verdict}"


def _comparable(ours, theirs):
    return timed(ours) and timed(theirs) and len(round_ms(ours)) == len(round_ms(theirs))


def comparisons(rows, peer):
    """Every (run, point, pass) at which both fmha_rt and `peer` have a passing timed row from the same
    rounds, in the rows' order."""
    theirs = {pair_key(r): r for r in rows if r["impl"] == peer}
    return [Comparison(ours, theirs[pair_key(ours)]) for ours in rows
            if ours["impl"] == SUBJECT and pair_key(ours) in theirs and _comparable(ours, theirs[pair_key(ours)])]


def best_peer(rows, ours):
    """The fastest peer row (by median ms) that passed and was timed at `ours`' run, point and pass, or None;
    fmha_rt's own variants (OWN_VARIANTS) are not peers."""
    candidates = [r for r in rows if r["impl"] != SUBJECT and r["impl"] not in OWN_VARIANTS
                  and pair_key(r) == pair_key(ours) and _comparable(ours, r)]
    return min(candidates, key=lambda r: r["ms"], default=None)


def best_peer_comparisons(rows):
    """A Comparison per fmha_rt row with the best peer at its run, point and pass."""
    found = []
    for ours in rows:
        if ours["impl"] == SUBJECT and timed(ours):
            theirs = best_peer(rows, ours)
            if theirs is not None:
                found.append(Comparison(ours, theirs))
    return found


@dataclasses.dataclass(frozen=True)
class Summary:
    """One pass and dtype of comparisons against one peer (or against the best peer: peer "best peer")."""
    peer: str
    pass_name: str
    dtype: str
    items: tuple

    def count(self, verdict):
        return sum(c.verdict == verdict for c in self.items)

    @property
    def lowest(self):
        return min(self.items, key=lambda c: c.ratio, default=None)

    @property
    def median_ratio(self):
        return statistics.median(c.ratio for c in self.items) if self.items else None

    @property
    def highest_ratio(self):
        return max((c.ratio for c in self.items), default=None)


def summarize(found, peer_name=None):
    """Summaries of comparisons by (peer, pass, dtype), passes in the benchmark's order; `peer_name` names
    them all alike (the best-peer summary)."""
    by_key = {}
    for c in found:
        by_key.setdefault((peer_name or c.peer, c.pass_name, c.ours["dtype"]), []).append(c)
    order = sorted(by_key, key=lambda k: (flops.PASSES.index(k[1]) if k[1] in flops.PASSES else 99, k[2]))
    peers_in_order = list(dict.fromkeys(k[0] for k in by_key))
    order.sort(key=lambda k: peers_in_order.index(k[0]))
    return [Summary(peer, p, d, tuple(by_key[(peer, p, d)])) for peer, p, d in order]


def summaries(rows, peers):
    """A Summary per (peer, pass, dtype) with comparisons, peers in the given order."""
    return [s for peer in peers for s in summarize(comparisons(rows, peer))]
