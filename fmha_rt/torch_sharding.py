"""DTensor sharding rules of torch.ops.fmha_rt.fwd and bwd (torch.distributed.tensor's register_sharding).

Attention is independent across batch entries and across heads (each query head with its key/value
group), so on each mesh dim an op runs on local tensors split one of these ways, with no collective:

- replicated: every tensor whole;
- batch (batch layout only): q, k, v, out, dout and the gradients Shard(0), lse Shard(0), slopes
  [B, Hq] Shard(0) and [Hq] replicated;
- heads: the head dim of q, k, v, out, dout and the gradients Shard (2, varlen 1), lse Shard(1)
  (varlen 0), slopes Shard on their Hq dim, cu_seqlens replicated. Offered only where the key/value
  heads divide by the mesh's size, so that a shard of query heads holds its whole key/value group.

A call with dropout is offered the replicated form alone: its Philox mask follows global batch and head
indices. DTensor redistributes inputs that arrive otherwise (a sequence split, say) to the cheapest of
these. Registered on import of fmha_rt.torch when torch.distributed is available.
"""
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.experimental import register_sharding

_FWD_TENSORS = ("q", "k", "v", "cu_q", "cu_k", "alibi", "rng_state")
_BWD_TENSORS = ("dout", "q", "k", "v", "out", "lse", "cu_q", "cu_k", "alibi", "rng_state")


def _placement(name, how, spec, varlen):
    """The placement of tensor `name` (its DTensorSpec `spec`, None when absent) split `how`."""
    if spec is None:
        return None
    if how == "replicate" or name in ("cu_q", "cu_k", "rng_state"):
        return Replicate()
    if name == "alibi":  # [Hq] or [B, Hq]
        if how == "heads":
            return Shard(len(spec.shape) - 1)
        return Shard(0) if len(spec.shape) == 2 else Replicate()
    if name == "lse":  # [B, Hq, Sq], varlen [Hq, total_q]
        return Shard(0) if how == "batch" or varlen else Shard(1)
    return Shard(0) if how == "batch" else Shard(1 if varlen else 2)


def _strategies(tensor_names, output_names, specs, scalars):
    """register_sharding's list of (output placements, input placements) for one call."""
    named = dict(zip(tensor_names, specs))
    varlen, dropout_p = named["cu_q"] is not None, scalars[5]
    ways = ["replicate"]
    if dropout_p == 0:
        ways += ["heads"] if varlen else ["batch", "heads"]
    k = named["k"]
    if "heads" in ways and k.shape[1 if varlen else 2] % k.mesh.size():
        ways.remove("heads")
    return [([_placement(n, how, named.get(n, named["q"]), varlen) for n in output_names],
             [_placement(n, how, s, varlen) for n, s in named.items()] + [None] * len(scalars))
            for how in ways]


def register(fwd_op, bwd_op) -> None:
    @register_sharding(fwd_op)
    def _fwd(*args):
        return _strategies(_FWD_TENSORS, ("out", "lse"), args[:7], args[7:])

    @register_sharding(bwd_op)
    def _bwd(*args):
        return _strategies(_BWD_TENSORS, ("q", "k", "v"), args[:10], args[10:])
