"""fmha_rt.jax jitted over a mesh of every visible GPU (one GPU: a 1-device mesh), through the real
kernels: batch and heads split as the inputs are, deterministic backward bitwise the unsharded call's,
values against the float64 reference; with several GPUs the compiled program has no collective."""
import os
import random
import re

import numpy as np
import pytest

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # leave GPU memory to the other tests
jax = pytest.importorskip("jax")
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import fmha_rt.jax as fj
from fmha_rt import reference

COLLECTIVES = r"\b(all-gather|all-to-all|collective-permute|all-reduce|reduce-scatter)(-start)?\("


def test_a_jitted_step_over_the_gpu_mesh_is_bitwise_the_unsharded_call():
    gpus = jax.devices("gpu")
    n = len(gpus)
    seed = random.randrange(2**31)
    print(f"seed {seed}, {n} GPUs")
    rng = np.random.default_rng(seed)
    b, s, hq, hk, d = 2 * n, 256, 4 * n, 2 * n, 64
    q, dout = (jnp.asarray(rng.standard_normal((b, s, hq, d)), jnp.bfloat16) for _ in range(2))
    k, v = (jnp.asarray(rng.standard_normal((b, s, hk, d)), jnp.bfloat16) for _ in range(2))

    def step(q, k, v, dout):
        attention = lambda q, k, v: fj.flash_attention(q, k, v, causal=True, deterministic=True)  # noqa: E731
        out, vjp = jax.vjp(attention, q, k, v)
        return (out, *vjp(dout))

    want = jax.jit(step)(q, k, v, dout)
    mesh = jax.make_mesh((n,), ("model",), axis_types=(AxisType.Auto,), devices=gpus)
    with jax.set_mesh(mesh):
        placed = [jax.device_put(x, NamedSharding(mesh, P(None, None, "model", None))) for x in (q, k, v, dout)]
        compiled = jax.jit(step).lower(*placed).compile()
        got = compiled(*placed)
    assert not re.search(COLLECTIVES, compiled.as_text())
    for g, w in zip(got, want):
        assert tuple(g.sharding.spec) == (None, None, "model", None)
        assert np.array_equal(np.asarray(g).view(np.uint16), np.asarray(w).view(np.uint16))
    out_ref = reference.mha_fwd_ref(q, k, v, window=(-1, 0))[0]
    assert reference.rel_err(np.asarray(got[0], np.float64), out_ref) < 1e-2
