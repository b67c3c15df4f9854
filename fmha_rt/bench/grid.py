"""The points the benchmark sweeps, and the filters the command line applies to them.

Every point holds the work per call fixed: B * S = 16k tokens and Hq * Dv = 2048 (a 2048-wide model), so
a longer sequence means a smaller batch and a larger head dim means fewer heads. The value head dim Dv is
the head dim D but at D = 192, which stands for the 192/128 shape of latent-attention models (queries and
keys 192 wide, values 128; 16 heads). Three kinds of rows:

- dense:  every (dtype, D, S, causal, pass);
- gqa:    grouped-query attention, Hq / Hk = 8 at D = 128, over the same sequence lengths;
- varlen: one packed batch of sequences whose lengths are drawn once from a fixed seed and sum to 16k,
          at each head dim (Sq = Sk = the longest sequence in the row; `seqlens` lists them all).
"""

import dataclasses
import random

from . import flops

TOTAL_TOKENS = 16 * 1024
MODEL_WIDTH = 2048
DTYPES = ("bf16", "fp16")
HEAD_DIMS = (64, 128, 192, 256)
VALUE_HEAD_DIMS = {192: 128}  # the grid's head dims whose values are narrower than queries and keys
SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)
PASSES = flops.PASSES
KINDS = ("dense", "gqa", "varlen")
GQA_RATIO = 8
GQA_HEAD_DIM = 128
VARLEN_SEED = 20240601
VARLEN_MIN, VARLEN_MAX = 64, 4096

QUICK = {"dtypes": ("bf16",), "head_dims": (128,), "seqlens": (4096,)}

# The shapes of the two measurements outside the sweep: host overhead wants a problem so small that
# the GPU is idle most of the time (bf16, causal); cold start a problem a user might run first.
OVERHEAD_SHAPE = {"batch": 1, "heads": 2, "seqlen": 128, "head_dim": 64, "causal": True}
COLD_START_SHAPE = {"batch": 1, "heads": 16, "seqlen": 1024, "head_dim": 128}


@dataclasses.dataclass(frozen=True)
class Point:
    kind: str
    pass_name: str
    dtype: str
    batch: int
    heads_q: int
    heads_k: int
    seqlen_q: int
    seqlen_k: int
    head_dim: int
    causal: bool
    seqlens: tuple = None
    head_dim_v: int = None  # None: head_dim

    @property
    def dv(self):
        """The value (and output) head dim."""
        return self.head_dim if self.head_dim_v is None else self.head_dim_v

    @property
    def backward(self):
        return self.pass_name != "fwd"

    @property
    def deterministic(self):
        return self.pass_name == "bwd_det"

    @property
    def varlen(self):
        return self.seqlens is not None

    def flops(self):
        if self.varlen:
            return flops.varlen_pass_flops(self.pass_name, self.seqlens, self.heads_q, self.head_dim,
                                           self.causal, self.dv)
        return flops.pass_flops(self.pass_name, self.batch, self.heads_q, self.seqlen_q, self.seqlen_k,
                                self.head_dim, self.causal, self.dv)

    def fields(self):
        """The point as the JSON keys of a result row."""
        row = {"kind": self.kind, "pass": self.pass_name, "dtype": self.dtype, "B": self.batch,
               "Hq": self.heads_q, "Hk": self.heads_k, "Sq": self.seqlen_q, "Sk": self.seqlen_k,
               "D": self.head_dim, "causal": self.causal}
        if self.dv != self.head_dim:
            row["Dv"] = self.dv
        if self.varlen:
            row["seqlens"] = list(self.seqlens)
        return row

    def label(self):
        heads = f"H={self.heads_q}" if self.heads_q == self.heads_k else f"H={self.heads_q}/{self.heads_k}"
        dims = f"{self.head_dim}/{self.dv}" if self.dv != self.head_dim else f"{self.head_dim}"
        shape = f"B={self.batch} S={self.seqlen_q} {heads} D={dims}"
        return f"{self.kind} {self.pass_name} {self.dtype} {shape}{' causal' if self.causal else ''}"


def varlen_seqlens(total=TOTAL_TOKENS, lo=VARLEN_MIN, hi=VARLEN_MAX, seed=VARLEN_SEED):
    """Sequence lengths in [lo, hi] (the last one may be shorter) that sum to `total`, the same on
    every machine: Python's own generator, seeded, so numpy's version cannot change them."""
    rng = random.Random(seed)
    lengths = []
    while sum(lengths) < total:
        lengths.append(min(rng.randint(lo, hi), total - sum(lengths)))
    return tuple(lengths)


def build_grid(*, dtypes=DTYPES, head_dims=HEAD_DIMS, seqlens=SEQLENS, causals=(False, True),
               passes=PASSES, kinds=KINDS):
    """Every point of the chosen subsets, in sweep order (shape-major, passes innermost, so the
    passes of one shape run back to back)."""
    points = []
    for kind in KINDS:
        if kind not in kinds:
            continue
        for dtype in dtypes:
            for shape in _shapes(kind, head_dims, seqlens):
                for causal in causals:
                    points.extend(Point(kind=kind, pass_name=p, dtype=dtype, causal=causal, **shape)
                                  for p in passes)
    return points


def _shapes(kind, head_dims, seqlens):
    if kind == "dense":
        return [_dense_shape(d, s, 1) for d in head_dims for s in seqlens]
    if kind == "gqa":
        # GQA rows exist at one head dim only; a filter that leaves it out leaves them out.
        return [_dense_shape(GQA_HEAD_DIM, s, GQA_RATIO) for s in seqlens] if GQA_HEAD_DIM in head_dims else []
    lengths = varlen_seqlens()
    return [dict(batch=len(lengths), heads_q=_heads(d), heads_k=_heads(d), seqlen_q=max(lengths),
                 seqlen_k=max(lengths), seqlens=lengths, **_head_dims(d)) for d in head_dims]


def _head_dims(head_dim):
    """The Point fields of a grid head dim: head_dim, and head_dim_v where the values are narrower."""
    dv = VALUE_HEAD_DIMS.get(head_dim)
    return {"head_dim": head_dim} if dv is None else {"head_dim": head_dim, "head_dim_v": dv}


def _heads(head_dim):
    return MODEL_WIDTH // VALUE_HEAD_DIMS.get(head_dim, head_dim)


def _dense_shape(head_dim, seqlen, group):
    heads = _heads(head_dim)
    return dict(batch=TOTAL_TOKENS // seqlen, heads_q=heads, heads_k=heads // group, seqlen_q=seqlen,
                seqlen_k=seqlen, **_head_dims(head_dim))
