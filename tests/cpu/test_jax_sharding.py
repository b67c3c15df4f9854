"""fmha_rt.jax over a device mesh, on 8 virtual CPU devices: each device's calls get its slice of the
batch and heads, the compiled program has no collective around attention, and every result is bitwise
the unsharded call's (jax_mesh_worker.py, in a process of its own); plus the split's rules and the CPU
implementation's guards in this process."""
import json
import os
import pathlib
import random
import subprocess
import sys

import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp
from jax.sharding import AbstractMesh, AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import fmha_rt.jax as fj
from fmha_rt import jax_cpu_reference, jax_sharding
from fmha_rt.errors import FmhaNotImplementedError
from fmha_rt.plan.problem import AttentionProblem

WORKER = pathlib.Path(__file__).with_name("jax_mesh_worker.py")
ROOT = WORKER.parents[2]


@pytest.fixture(scope="module")
def mesh_report():
    seed = random.randrange(2**31)
    print(f"jax_mesh_worker seed {seed}")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, str(WORKER), str(seed)], capture_output=True, text=True, env=env,
                          timeout=600)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


# case: (each device's forward results, its backward results, the results' spec)
SPLIT = {
    "batch": ([[1, 16, 8, 16], [1, 8, 16]], [[1, 16, 8, 16], [1, 16, 4, 16], [1, 16, 4, 16]],
              "(('data', 'model'), None, None, None)"),
    "heads_gqa": ([[8, 16, 2, 16], [8, 2, 16]], [[8, 16, 2, 16], [8, 16, 1, 16], [8, 16, 1, 16]],
                  "(None, None, 'model', None)"),
    "batch_and_heads_alibi": ([[4, 16, 2, 16], [4, 2, 16]], [[4, 16, 2, 16], [4, 16, 1, 16], [4, 16, 1, 16]],
                              "('data', None, 'model', None)"),
    "varlen_heads": ([[40, 2, 16], [2, 40]], [[40, 2, 16], [40, 1, 16], [40, 1, 16]], "(None, 'model', None)"),
}


def _shapes(results):
    return [[int(n) for n in r[r.index("[") + 1:-1].split(",")] for r in results]


@pytest.mark.parametrize("case", sorted(SPLIT))
def test_each_device_runs_its_slice_with_no_collective_and_bitwise_the_unsharded_results(mesh_report, case):
    report, (fwd, bwd, spec) = mesh_report[case], SPLIT[case]
    assert report["collectives"] == []
    assert [_shapes(r) for r in report["call_results"]] == [fwd, bwd]
    assert report["specs"] == [spec] * 4  # out, dq, dk, dv stay split as the inputs were
    assert report["bitwise"] == [True] * 4


def test_the_unsharded_call_is_the_float64_reference(mesh_report):
    assert mesh_report["batch"]["out_rel_err"] < 1e-2  # bf16 inputs and output


@pytest.mark.parametrize("case", ["sequence_sharded_gathers", "broadcast_bias_grad_gathers"])
def test_what_does_not_split_is_gathered_and_exact(mesh_report, case):
    """A sharded sequence, and a backward whose dbias sums over a split dim, run on gathered operands."""
    report = mesh_report[case]
    assert report["collectives"] == ["all-gather"]
    assert all(report["bitwise"])
    backward = _shapes(report["call_results"][1])
    assert backward[0] == [8, 16, 8, 16]  # the whole batch and every head on each device


# ------------------------------------------------------------------------ the rules, in-process

MESH = AbstractMesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)


def problem(**kw):
    base = {"batch": 8, "seqlen_q": 16, "seqlen_k": 16, "heads_q": 8, "heads_k": 4, "head_dim_qk": 16,
            "head_dim_v": 16, "dtype": "bf16"}
    return AttentionProblem(**{**base, **kw})


@pytest.mark.parametrize("kw, spec, split", [
    ({}, P("data", None, "model"), jax_sharding.Split(("data",), ("model",))),
    ({"heads_k": 2}, P("data", None, "model"), jax_sharding.Split(("data",), ())),  # 2 kv heads over 4
    ({"batch": 3}, P("data", None, "model"), jax_sharding.Split((), ("model",))),
    ({"dropout_p": 0.1}, P("data", None, "model"), jax_sharding.Split()),  # the mask follows global indices
    ({"bias_shape": "1HSS", "bias_grad": True}, P("data", None, "model"), jax_sharding.Split((), ("model",))),
    ({"bias_shape": "1HSS"}, P("data", None, "model"), jax_sharding.Split(("data",), ("model",))),
    ({"varlen": True, "total_q": 40, "total_k": 40}, P(None, "model"), jax_sharding.Split((), ("model",))),
    ({}, P(None, "data"), jax_sharding.Split()),  # a sequence split is not the call's
])
def test_the_split_follows_q_and_what_the_call_allows(kw, spec, split):
    p = problem(**kw)
    assert jax_sharding.split_of(p, MESH, NamedSharding(MESH, spec)) == split
    local = split.local_problem(p, MESH)
    assert (local.batch, local.heads_q, local.heads_k) == (
        p.batch // (2 if split.batch else 1), p.heads_q // (4 if split.heads else 1),
        p.heads_k // (4 if split.heads else 1))


def test_the_sharding_rule_ties_query_heads_to_their_key_value_group():
    rule, sizes = jax_sharding.sharding_rule(None, "bwd", problem(alibi="BH"), "", MESH, (), ())
    assert rule == ("b r0 (k g) r1, b r2 (k g) r3, b r4 k r5, b r6 k r7, b r8 (k g) r9, b (k g) r10, b (k g) -> "
                    "b r11 (k g) r12, b r13 k r14, b r15 k r16")
    assert sizes == {"need_replication_factors": tuple(f"r{i}" for i in range(17)), "g": 2}


def test_the_cpu_implementation_refuses_dropout_and_any_gpu_lowering(monkeypatch):
    monkeypatch.setattr(jax_cpu_reference, "enabled", lambda: True)
    q = jnp.ones((1, 16, 2, 16), jnp.bfloat16)
    with pytest.raises(FmhaNotImplementedError, match="no dropout"):
        fj.flash_attention(q, q, q, dropout_rate=0.1, dropout_rng=jax.random.key(0))
    lowered = jax.jit(lambda q: fj.flash_attention(q, q, q)).trace(q)
    with pytest.raises(NotImplementedError, match="not found for platform cuda"):
        lowered.lower(lowering_platforms=("cuda",))
