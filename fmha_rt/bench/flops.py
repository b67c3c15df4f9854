"""FLOP counts behind every TFLOP/s figure the benchmark reports.

Convention (the one attention benchmarks commonly quote, so numbers compare across projects):

    forward  = 4 * B * H * Sq * Sk * D      two matrix products (Q K^T and P V), 2 FLOPs a multiply-add
    causal   = forward / 2
    backward = 2.5 * forward                five matrix products instead of two

H is the number of query heads: with grouped-query attention every query head still does its own
products, whatever the number of key/value heads.

Causal with Sq != Sk. The exact number of (query, key) pairs a bottom-right aligned causal mask keeps
(query i sees keys j <= i + Sk - Sq, the alignment flash-attn uses) is

    Sq <= Sk:  Sq * Sk - Sq * (Sq - 1) / 2
    Sq >  Sk:  Sk * (Sk + 1) / 2            (the first Sq - Sk queries see nothing)

which is not Sq * Sk / 2 in general: for Sq = 1024, Sk = 4096 it keeps 87.5 % of the pairs, not 50 %.
Even for Sq == Sk the exact count is S * (S + 1) / 2, a hair above half. The benchmark nevertheless uses
the plain halving for every causal shape, so that its figures match the convention above; a causal
TFLOP/s at Sq != Sk is therefore a conventional figure, not a count of the work done. Every shape the
standard grid sweeps has Sq == Sk, where the two differ by (S + 1) / S.
"""

PASSES = ("fwd", "bwd", "bwd_det")


def forward_flops(batch, heads_q, seqlen_q, seqlen_k, head_dim, causal, head_dim_v=None):
    """FLOPs of one attention forward by the convention above: 2 (Q K^T) + 2 (P V) per score and head-dim
    element, with the values' head dim where it differs (None: head_dim)."""
    dv = head_dim if head_dim_v is None else head_dim_v
    full = 2 * batch * heads_q * seqlen_q * seqlen_k * (head_dim + dv)
    return full // 2 if causal else full


def pass_flops(pass_name, batch, heads_q, seqlen_q, seqlen_k, head_dim, causal, head_dim_v=None):
    """FLOPs of one call of `pass_name` ("fwd", "bwd" or "bwd_det"); a deterministic backward does
    the same arithmetic as the plain one."""
    if pass_name not in PASSES:
        raise ValueError(f"pass must be one of {PASSES}, got {pass_name!r}")
    fwd = forward_flops(batch, heads_q, seqlen_q, seqlen_k, head_dim, causal, head_dim_v)
    # 2.5 x forward, kept an exact integer: a forward count is always even.
    return fwd if pass_name == "fwd" else fwd * 5 // 2


def varlen_pass_flops(pass_name, seqlens, heads_q, head_dim, causal, head_dim_v=None):
    """FLOPs of a packed variable-length batch: the sum over its sequences (each attends to itself)."""
    return sum(pass_flops(pass_name, 1, heads_q, s, s, head_dim, causal, head_dim_v) for s in seqlens)


def tflops(flops, milliseconds):
    """TFLOP/s of `flops` done in `milliseconds`."""
    return flops / (milliseconds * 1e-3) / 1e12
