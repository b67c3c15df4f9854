"""How fmha_rt.jax's custom calls split over a device mesh (jax.experimental.custom_partitioning).

Attention is independent across batch entries and across heads (each query head with its key/value
group), so under jax.jit over a mesh each call runs on every device on that device's slice, planned
for the slice's shapes, with no collective. What is split is read from q's sharding (the operand the
partitioner hands over, after Shardy's propagation through the rule below):

- batch calls: the batch dim and the head dim, over whichever mesh axes shard them in q; k/v's heads
  follow q's (a shard of Hq / n query heads reads its Hk / n key/value heads), so the head split needs
  Hk divisible by the axes' size. A bias or slopes are split along their dims of size B or Hq.
- varlen calls: the head dim only (the packed rows and cu_seqlens stay whole on every device).

Everything else runs gathered, documented and exact: XLA gathers the operands along the dims that do
not split, and the call computes the same values as the unsharded call. That covers a sharded
sequence or head dim (the context-parallel, ring form is the user's own loop around fmha_rt, see
docs/scaling-out.md), a head split that does not divide Hk, a batch split that does not divide B, any
split of a call with dropout (the Philox mask is drawn from global batch and head indices), and a
split along a dim over which a differentiated bias is broadcast (its dbias would need a sum across
devices).

Shardy gets a sharding rule per call: batch 'b', key/value heads 'k', query heads the compound '(k g)'
with g = Hq / Hk (so that q's head split is k's), every other dim a factor that needs replication.
Under vmap the partitioned call runs the instances one after another (custom_partitioning has no
batching rule; batch calls never get there, fmha_rt.jax folds their mapped axis into the batch first).
"""
from __future__ import annotations

import dataclasses
import math

import jax
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec

from .plan.problem import AttentionProblem

# The operands and results of each call, in fmha_rt.jax's order (absent ones are dropped, _present).
OPERANDS = {
    "fwd": ("q", "k", "v", "bias", "alibi", "seed"),
    "bwd": ("dout", "q", "k", "v", "out", "lse", "bias", "alibi", "seed"),
    "varlen_fwd": ("q", "k", "v", "cu_q", "cu_k", "bias", "alibi", "seed"),
    "varlen_bwd": ("dout", "q", "k", "v", "out", "lse", "cu_q", "cu_k", "bias", "alibi", "seed"),
}
RESULTS = {"fwd": ("out", "lse"), "bwd": ("dq", "dk", "dv", "dbias"),
           "varlen_fwd": ("out", "lse"), "varlen_bwd": ("dq", "dk", "dv", "dbias")}
_QUERY_ROWS = {"q", "dout", "out", "dq"}
_KEY_ROWS = {"k", "v", "dk", "dv"}
BATCH, HEADS, KV_HEADS = "batch", "heads", "kv_heads"


def _present(names, problem: AttentionProblem):
    absent = {"bias": problem.bias_shape is None, "dbias": not problem.bias_grad, "alibi": problem.alibi is None,
              "seed": not problem.has_dropout}
    return tuple(n for n in names if not absent.get(n, False))


def _roles(name: str, problem: AttentionProblem) -> tuple:
    """What each dim of buffer `name` is: BATCH, HEADS (query heads), KV_HEADS, or None (never split)."""
    varlen = problem.varlen
    if name in _QUERY_ROWS or name in _KEY_ROWS:
        heads = HEADS if name in _QUERY_ROWS else KV_HEADS
        return (None, heads, None) if varlen else (BATCH, None, heads, None)
    if name == "lse":
        return (HEADS, None) if varlen else (BATCH, HEADS, None)
    if name in ("bias", "dbias"):  # [1|B, 1|Hq, Sq, Sk]
        return (BATCH if problem.bias_shape[0] == "B" else None, HEADS if problem.bias_shape[1] == "H" else None,
                None, None)
    if name == "alibi":  # [Hq] or [B, Hq]
        return (HEADS,) if problem.alibi == "H" else (BATCH, HEADS)
    return (None,)  # seed, cu_seqlens


# ------------------------------------------------------------------------------- the split


@dataclasses.dataclass(frozen=True)
class Split:
    """The mesh axes over which a call's batch and heads are split (empty: not split)."""

    batch: tuple = ()
    heads: tuple = ()

    def spec(self, roles) -> PartitionSpec:
        axes = {BATCH: self.batch, HEADS: self.heads, KV_HEADS: self.heads}
        return PartitionSpec(*(axes.get(r) or None for r in roles))

    def local_problem(self, problem: AttentionProblem, mesh) -> AttentionProblem:
        """The problem each device runs: its slice of the batch and of the heads."""
        nb, nh = _size(mesh, self.batch), _size(mesh, self.heads)
        return dataclasses.replace(problem, batch=problem.batch // nb, heads_q=problem.heads_q // nh,
                                   heads_k=problem.heads_k // nh)


def _axes(entry) -> tuple:
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def _size(mesh, axes) -> int:
    return math.prod(mesh.shape[a] for a in axes)


def split_of(problem: AttentionProblem, mesh, q_sharding) -> Split:
    """The split a call takes when q arrives with `q_sharding` (module docstring: what splits, what not)."""
    if problem.has_dropout or not isinstance(q_sharding, NamedSharding):
        return Split()
    spec = tuple(q_sharding.spec) + (None,) * 4
    batch, heads = ((), _axes(spec[1])) if problem.varlen else (_axes(spec[0]), _axes(spec[2]))
    bias_grad_over = problem.bias_shape if problem.bias_grad else "BH"
    if problem.batch % _size(mesh, batch) or bias_grad_over[0] != "B":
        batch = ()
    if problem.heads_k % _size(mesh, heads) or bias_grad_over[1] != "H":
        heads = ()
    return Split(batch, heads)


def _shardings(split: Split, mesh, names, problem):
    return tuple(NamedSharding(mesh, split.spec(_roles(n, problem))) for n in names)


# ------------------------------------------------------------------ custom_partitioning hooks


def _run(local_call, kind, problem, arch, *operands):
    """local_call(kind, problem, arch, arrays) with the absent operands back as None."""
    given = dict(zip(_present(OPERANDS[kind], problem), operands))
    return tuple(local_call(kind, problem, arch, tuple(given.get(n) for n in OPERANDS[kind])))


def _partition(local_call, kind, problem, arch, mesh, arg_shapes, result_shape):
    names = _present(OPERANDS[kind], problem)
    split = split_of(problem, mesh, arg_shapes[names.index("q")].sharding)
    local = split.local_problem(problem, mesh)

    def lower_fn(*operands):
        return _run(local_call, kind, local, arch, *operands)

    results = _present(RESULTS[kind], problem)
    return mesh, lower_fn, _shardings(split, mesh, results, problem), _shardings(split, mesh, names, problem)


def _infer_sharding_from_operands(local_call, kind, problem, arch, mesh, arg_shapes, result_shape):
    """The results' shardings (used by the GSPMD partitioner; Shardy reads the rule instead)."""
    names = _present(OPERANDS[kind], problem)
    split = split_of(problem, mesh, arg_shapes[names.index("q")].sharding)
    return _shardings(split, mesh, _present(RESULTS[kind], problem), problem)


def sharding_rule(local_call, kind, problem, arch, mesh, operand_types, result_types):
    """Shardy's einsum-like rule: 'b' batch, 'k' key/value heads, '(k g)' query heads, and for every other
    dim a factor of its own that needs replication."""
    group = problem.heads_q // problem.heads_k
    factors = {BATCH: "b", KV_HEADS: "k", HEADS: "(k g)" if group > 1 else "k"}
    others = []

    def mapping(name):
        dims = []
        for role in _roles(name, problem):
            if role is None:
                others.append(f"r{len(others)}")
            dims.append(factors[role] if role else others[-1])
        return " ".join(dims)

    operands = ", ".join(mapping(n) for n in _present(OPERANDS[kind], problem))
    results = ", ".join(mapping(n) for n in _present(RESULTS[kind], problem))
    return f"{operands} -> {results}", {"need_replication_factors": tuple(others),
                                       **({"g": group} if group > 1 else {})}


_partitioned = custom_partitioning(_run, static_argnums=(0, 1, 2, 3))
_partitioned.def_partition(partition=_partition, infer_sharding_from_operands=_infer_sharding_from_operands,
                           sharding_rule=sharding_rule)


def sharded_call(local_call, kind: str, problem: AttentionProblem, arch: str, arrays):
    """local_call(kind, problem, arch, arrays) as one call that XLA's partitioner splits over the mesh of
    a jitted program: each device runs local_call on its slice. Outside a mesh it is local_call."""
    operands = [x for x in arrays if x is not None]
    run = jax.custom_batching.sequential_vmap(lambda *ops: _partitioned(local_call, kind, problem, arch, *ops))
    return run(*operands)
