"""fmha_rt.jax on the GPU: values and gradients under jit against the float64 reference, one compile for
repeated calls, vmap, varlen, a bitwise-repeatable training loop, and the handler's own errors; bias (every
broadcast shape, dbias in its shape), ALiBi and dropout (against the reference with the mask of an
independent Philox, tests/philox_reference.py, which fmha_rt.mha_dropout_mask must equal), also under vmap
and in varlen calls.

Inputs are fresh random draws; errors are relative, ||got - ref|| / ||ref|| < 1e-2, for the whole tensor,
per head and per row. XLA allocates the
outputs (they cannot be poisoned beforehand), so every output is also checked for NaN.
"""
import os

import numpy as np
import pytest

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # leave GPU memory to the other tests
from gpu_presence import require

jax = require("jax")
import jax.numpy as jnp

import error_bounds
import fmha_rt
import philox_reference
from fmha_rt import reference
from fmha_rt.plan.problem import AttentionProblem
from fmha_rt.replay import xla_program

fj = require("fmha_rt.jax")

TOL = 1e-2
DTYPES = {"bf16": jnp.bfloat16, "fp16": jnp.float16}


@pytest.fixture(scope="module", autouse=True)
def jax_gpu():
    try:
        jax.devices("gpu")
    except RuntimeError as exc:
        pytest.fail(f"a GPU is present but jax has no GPU platform: {exc}")


def rand(key, shape, dtype):
    return jax.random.normal(key, shape, jnp.float32).astype(dtype)


def inputs(seed, b, sq, sk, hq, hk, d, dv, dtype):
    keys = jax.random.split(jax.random.PRNGKey(seed), 4)
    return (rand(keys[0], (b, sq, hq, d), dtype), rand(keys[1], (b, sk, hk, d), dtype),
            rand(keys[2], (b, sk, hk, dv), dtype), rand(keys[3], (b, sq, hq, dv), dtype))


def f64(x):
    return np.asarray(x.astype(jnp.float32), dtype=np.float64)


def assert_close(name, got, want, tol=TOL):
    """Whole tensor, per head and per row (tests/error_bounds.py): LSE rows are its elements, dbias has
    its heads third from last."""
    rows = "elements" if name.endswith("lse") else "vectors"
    error_bounds.assert_close(name, f64(got), want, tol, head_axis=-3 if name == "dbias" else -2, rows=rows)


def ref_options(kw):
    window = (-1, 0) if kw.get("causal") else kw.get("window", (-1, -1))
    if kw.get("causal") and "window" in kw:
        window = (kw["window"][0], 0)
    return {"softmax_scale": kw.get("softmax_scale"), "window": window,
            "bottom_right": kw.get("causal_alignment") == "bottom_right"}


# name, B, Sq, Sk, Hq, Hk, D, Dv, options
CASES = [
    ("mha_d64", 2, 256, 256, 4, 4, 64, 64, {}),
    ("mha_d64_causal", 2, 256, 256, 4, 4, 64, 64, {"causal": True}),
    ("gqa_causal_sq_lt_sk_br", 2, 130, 300, 8, 2, 64, 64, {"causal": True, "causal_alignment": "bottom_right"}),
    ("gqa_causal_top_left", 1, 300, 130, 4, 2, 128, 128, {"causal": True}),
    ("mqa_window", 1, 100, 257, 4, 1, 64, 64, {"window": (16, 16)}),
    ("d128_causal_scale", 2, 512, 512, 4, 2, 128, 128, {"causal": True, "softmax_scale": 0.1}),
    ("d192_dv128", 1, 256, 256, 2, 2, 192, 128, {}),
    ("d256_gqa", 1, 160, 160, 4, 2, 256, 256, {"causal": True}),
    # head dims that are not multiples of 8: zero-padded around the custom calls
    ("d13_dv20_gqa_causal", 2, 200, 180, 4, 2, 13, 20, {"causal": True}),
    ("d100_mqa_window", 1, 256, 256, 4, 1, 100, 100, {"window": (32, 8)}),
    ("d1_mha", 1, 64, 64, 2, 2, 1, 1, {}),
]


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_values_and_gradients_match_the_reference(case, dtype):
    _, b, sq, sk, hq, hk, d, dv, kw = case
    q, k, v, dout = inputs(CASES.index(case), b, sq, sk, hq, hk, d, dv, DTYPES[dtype])

    @jax.jit
    def run(q, k, v, dout):
        out, vjp = jax.vjp(lambda q, k, v: fj.flash_attention(q, k, v, **kw), q, k, v)
        return (out, *vjp(dout))

    out, dq, dk, dv_ = run(q, k, v, dout)
    opts = ref_options(kw)
    want_out, _ = reference.mha_fwd_ref(f64(q), f64(k), f64(v), **opts)
    want = reference.mha_bwd_ref(f64(dout), f64(q), f64(k), f64(v), **opts)
    assert out.dtype == q.dtype and out.shape == (b, sq, hq, dv)
    assert_close("out", out, want_out)
    for name, got, ref in zip(("dq", "dk", "dv"), (dq, dk, dv_), want[:3]):
        assert got.shape == ref.shape
        assert_close(name, got, ref)


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_return_lse_matches_the_reference(dtype):
    """return_lse=True: lse float32 [B, Hq, Sq] of the kernels against the float64 reference; out unchanged;
    varlen lse [Hq, total_q]; a gradient through lse is refused when jax traces the backward."""
    q, k, v, _ = inputs(41, 2, 300, 260, 4, 2, 64, 64, DTYPES[dtype])
    out, lse = jax.jit(lambda q, k, v: fj.flash_attention(q, k, v, causal=True, return_lse=True))(q, k, v)
    want_out, want_lse = reference.mha_fwd_ref(f64(q), f64(k), f64(v), window=(-1, 0))
    assert lse.dtype == jnp.float32 and lse.shape == (2, 4, 300)
    assert_close("out", out, want_out)
    assert_close("lse", lse, want_lse)
    cu_q, cu_k = jnp.array([0, 300, 600], jnp.int32), jnp.array([0, 260, 520], jnp.int32)
    packed = [x.reshape(-1, *x.shape[2:]) for x in (q, k, v)]  # the batch's two sequences, one after the other
    _, varlen_lse = fj.flash_attention_varlen(*packed, cu_q, cu_k, 300, 260, causal=True, return_lse=True)
    assert varlen_lse.shape == (4, 600)
    assert_close("varlen lse", varlen_lse, np.concatenate([want_lse[0], want_lse[1]], axis=1))
    with pytest.raises(fmha_rt.FmhaNotImplementedError, match="carries no gradient"):
        jax.grad(lambda q: fj.flash_attention(q, k, v, return_lse=True)[1].sum())(q)


@pytest.mark.parametrize("kw", [{}, {"causal": True}], ids=["full", "causal"])
def test_the_v3_forward_through_xla_matches_the_reference(kw):
    """From 4096 keys at D=128 the forward runs the v3 kernel (the default on sm_90; causal, its paired
    variant; this GQA call without a mask, its runs of query blocks), its TMA descriptors in the call's
    workspace result: out and lse against the float64 reference."""
    b, s, hq, hk, d = 1, 4096, 2, 1, 128
    p = AttentionProblem(batch=b, seqlen_q=s, seqlen_k=s, heads_q=hq, heads_k=hk, head_dim_qk=d, head_dim_v=d,
                         dtype="bf16", window_right=0 if kw else -1)
    fj.register_targets()
    program = xla_program.forward(p, fj.gpu_arch())
    assert [launch.key for launch in program.launches] == ["fmha_fwd_v3_bf16_d128" + ("_paired" if kw else "_run4")]
    assert program.results[-1].name == "workspace"
    q, k, v, _ = inputs(77, b, s, s, hq, hk, d, d, jnp.bfloat16)
    out, lse = jax.jit(lambda q, k, v: fj.flash_attention(q, k, v, return_lse=True, **kw))(q, k, v)
    want_out, want_lse = reference.mha_fwd_ref(f64(q), f64(k), f64(v), **ref_options(kw))
    assert_close("out", out, want_out)
    assert_close("lse", lse, want_lse)


@pytest.mark.parametrize("kw", [{}, {"causal": True}], ids=["full", "causal"])
def test_the_v3_backward_through_xla_matches_the_reference(kw):
    """A non-deterministic backward at D=128 from 4096 keys runs the v3 dK/dV kernel (the default on sm_90),
    its TMA descriptors in the call's workspace: dq, dk, dv against the float64 reference."""
    b, s, h, d = 1, 4096, 2, 128
    p = AttentionProblem(batch=b, seqlen_q=s, seqlen_k=s, heads_q=h, heads_k=h, head_dim_qk=d, head_dim_v=d,
                         dtype="bf16", window_right=0 if kw else -1, deterministic=False)
    fj.register_targets()
    program = xla_program.backward(p, fj.gpu_arch())
    assert "fmha_bwd_dkdv_v3_bf16_d128" in [launch.key for launch in program.launches]
    q, k, v, dout = inputs(78, b, s, s, h, h, d, d, jnp.bfloat16)

    def loss(q, k, v):
        out = fj.flash_attention(q, k, v, deterministic=False, **kw)
        return (out.astype(jnp.float32) * dout.astype(jnp.float32)).sum()

    dq, dk, dv = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    want = reference.mha_bwd_ref(f64(dout), f64(q), f64(k), f64(v), **ref_options(kw))
    for name, got, ref in zip(("dq", "dk", "dv"), (dq, dk, dv), want[:3]):
        assert_close(name, got, ref)


def test_jit_compiles_once_and_reruns():
    traces = []

    @jax.jit
    def step(q, k, v, dout):
        traces.append(1)
        out, vjp = jax.vjp(lambda q, k, v: fj.flash_attention(q, k, v, causal=True), q, k, v)
        return (out, *vjp(dout))

    for seed in range(3):
        q, k, v, dout = inputs(seed, 2, 256, 256, 8, 2, 64, 64, jnp.bfloat16)
        out, dq, dk, dv = step(q, k, v, dout)
        want_out, _ = reference.mha_fwd_ref(f64(q), f64(k), f64(v), window=(-1, 0))
        assert_close("out", out, want_out)
        want = reference.mha_bwd_ref(f64(dout), f64(q), f64(k), f64(v), window=(-1, 0))
        for name, got, ref in zip(("dq", "dk", "dv"), (dq, dk, dv), want[:3]):
            assert_close(name, got, ref)
    assert len(traces) == 1


def test_vmap_equals_separate_calls():
    """The mapped axis is folded into the batch: each (batch, head) is computed exactly as alone."""
    stacked = [jnp.stack(xs) for xs in zip(*(inputs(s, 2, 192, 160, 4, 2, 64, 64, jnp.bfloat16) for s in range(3)))]
    qs, ks, vs, douts = stacked

    def fwd_bwd(q, k, v, dout):
        out, vjp = jax.vjp(lambda q, k, v: fj.flash_attention(q, k, v, causal=True), q, k, v)
        return (out, *vjp(dout))

    batched = jax.jit(jax.vmap(fwd_bwd))(qs, ks, vs, douts)
    single = jax.jit(fwd_bwd)
    for i in range(3):
        for got, want in zip(batched, single(qs[i], ks[i], vs[i], douts[i])):
            np.testing.assert_array_equal(np.asarray(got[i]), np.asarray(want))
    out_only_q = jax.jit(jax.vmap(fj.flash_attention, in_axes=(0, None, None)))(qs, ks[0], vs[0])
    np.testing.assert_array_equal(np.asarray(out_only_q[2]), np.asarray(jax.jit(fj.flash_attention)(qs[2], ks[0], vs[0])))


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_varlen_values_and_gradients(dtype):
    lengths_q, lengths_k = [100, 0, 257, 64], [90, 17, 257, 128]
    cu_q = np.concatenate([[0], np.cumsum(lengths_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lengths_k)]).astype(np.int32)
    keys = jax.random.split(jax.random.PRNGKey(7), 4)
    hq, hk, d = 4, 2, 64
    q, k, v = (rand(keys[0], (cu_q[-1], hq, d), DTYPES[dtype]), rand(keys[1], (cu_k[-1], hk, d), DTYPES[dtype]),
               rand(keys[2], (cu_k[-1], hk, d), DTYPES[dtype]))
    dout = rand(keys[3], (cu_q[-1], hq, d), DTYPES[dtype])
    kw = {"causal": True, "causal_alignment": "bottom_right"}

    @jax.jit
    def run(q, k, v, dout, cu_q, cu_k):
        f = lambda q, k, v: fj.flash_attention_varlen(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), **kw)
        out, vjp = jax.vjp(f, q, k, v)
        return (out, *vjp(dout))

    out, dq, dk, dv = run(q, k, v, dout, jnp.asarray(cu_q), jnp.asarray(cu_k))
    opts = ref_options(kw)
    want_out, _ = reference.mha_varlen_fwd_ref(f64(q), f64(k), f64(v), cu_q, cu_k, **opts)
    want = reference.mha_varlen_bwd_ref(f64(dout), f64(q), f64(k), f64(v), cu_q, cu_k, **opts)
    assert_close("out", out, want_out)
    for name, got, ref in zip(("dq", "dk", "dv"), (dq, dk, dv), want[:3]):
        assert_close(name, got, ref)


def _train(steps=5, seed=0):
    """A small attention layer (qkv projection, attention, output projection) trained by SGD; returns
    the loss of every step and the final parameters."""
    b, s, h, d = 2, 256, 4, 64
    width = h * d
    keys = jax.random.split(jax.random.PRNGKey(seed), 4)
    params = {"qkv": jax.random.normal(keys[0], (width, 3 * width), jnp.float32) / np.sqrt(width),
              "out": jax.random.normal(keys[1], (width, width), jnp.float32) / np.sqrt(width)}
    x = jax.random.normal(keys[2], (b, s, width), jnp.float32)
    target = jax.random.normal(keys[3], (b, s, width), jnp.float32)

    def loss(params):
        qkv = (x @ params["qkv"]).astype(jnp.bfloat16).reshape(b, s, 3, h, d)
        att = fj.flash_attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], causal=True, deterministic=True)
        y = att.reshape(b, s, width).astype(jnp.float32) @ params["out"]
        return jnp.mean((y - target) ** 2)

    @jax.jit
    def step(params):
        value, grads = jax.value_and_grad(loss)(params)
        return value, jax.tree_util.tree_map(lambda p, g: p - 0.5 * g, params, grads)

    losses = []
    for _ in range(steps):
        value, params = step(params)
        losses.append(float(value))
    return losses, params


def test_deterministic_training_repeats_bitwise():
    first, params_a = _train()
    second, params_b = _train()
    assert all(np.isfinite(first)) and first[-1] < first[0]
    assert first == second
    for name in params_a:
        np.testing.assert_array_equal(np.asarray(params_a[name]), np.asarray(params_b[name]))


# ------------------------------------------------------------------------ bias, ALiBi, dropout


def fwd_bwd(**kw):
    """(q, k, v, bias, dout) -> (out, dq, dk, dv, dbias) of flash_attention with options `kw`, jitted;
    dbias is None when bias is."""
    @jax.jit
    def run(q, k, v, bias, dout):
        out, vjp = jax.vjp(lambda q, k, v, bias: fj.flash_attention(q, k, v, bias=bias, **kw), q, k, v, bias)
        return (out, *vjp(dout))
    return run


def check_against_reference(q, k, v, dout, got, keep=None, **opts):
    """got = (out, dq, dk, dv, dbias) against mha_fwd_ref / mha_bwd_ref with `opts` (bias and slopes as
    jax arrays, the rest as the reference takes them) and the dropout keep mask `keep`."""
    opts = {name: f64(x) if name in ("bias", "alibi_slopes") else x for name, x in opts.items()}
    want_out, _ = reference.mha_fwd_ref(f64(q), f64(k), f64(v), dropout_keep=keep, **opts)
    want = reference.mha_bwd_ref(f64(dout), f64(q), f64(k), f64(v), dropout_keep=keep, **opts)
    out, *grads = got
    assert out.shape == want_out.shape and out.dtype == q.dtype
    assert_close("out", out, want_out)
    for name, g, ref in zip(("dq", "dk", "dv", "dbias"), grads, want):
        if ref is None:
            assert g is None, name
        else:
            assert g.shape == ref.shape, name
            assert_close(name, g, ref)


def kernel_keep(q, k, rate, rng):
    """The keep mask (bool [B, Hq, Sq, Sk]) that flash_attention(q, k, .., dropout_rate=rate,
    dropout_rng=rng) must draw: the independent Philox's (tests/philox_reference.py) for the key's seed
    and offset; fmha_rt.mha_dropout_mask must agree."""
    seed, offset = (int(x) for x in fj.philox_seed_offset(rng))
    (b, sq, hq, _), sk = q.shape, k.shape[1]
    keep = philox_reference.keep_mask(seed, offset, b, hq, sq, sk, rate)
    assert np.array_equal(np.asarray(fmha_rt.mha_dropout_mask(q, k, dropout_p=rate, seed=seed, offset=offset)), keep)
    return keep


def slopes_of(seed, shape):
    return jax.random.uniform(jax.random.PRNGKey(seed), shape, jnp.float32, 0.05, 0.5)


BIAS_ROWS = {"11SS": (1, 1), "1HSS": (1, 4), "B1SS": (2, 1), "BHSS": (2, 4)}


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("shape", sorted(BIAS_ROWS))
def test_bias_and_dbias_in_every_broadcast_shape(shape, dtype):
    b, sq, sk, hq, hk, d = 2, 192, 160, 4, 2, 64
    q, k, v, dout = inputs(31, b, sq, sk, hq, hk, d, d, DTYPES[dtype])
    bias = rand(jax.random.PRNGKey(32), (*BIAS_ROWS[shape], sq, sk), DTYPES[dtype])
    got = fwd_bwd(causal=True)(q, k, v, bias, dout)
    assert got[4].shape == bias.shape and got[4].dtype == bias.dtype
    check_against_reference(q, k, v, dout, got, window=(-1, 0), bias=bias)


def test_bias_with_a_key_count_that_is_not_a_multiple_of_8():
    """Sk = 90: the bias goes to the kernels in rows padded to 96 keys, dbias comes back [.., 70, 90]."""
    b, sq, sk, h, d = 2, 70, 90, 2, 64
    q, k, v, dout = inputs(33, b, sq, sk, h, h, d, d, jnp.bfloat16)
    bias = rand(jax.random.PRNGKey(34), (1, h, sq, sk), jnp.bfloat16)
    check_against_reference(q, k, v, dout, fwd_bwd()(q, k, v, bias, dout), bias=bias)


def test_a_constant_bias_needs_no_dbias():
    """Gradients of q, k, v only: the backward has no dbias to compute, and the values are the same."""
    b, s, h, d = 2, 128, 4, 64
    q, k, v, dout = inputs(35, b, s, s, h, h, d, d, jnp.bfloat16)
    bias = rand(jax.random.PRNGKey(36), (b, 1, s, s), jnp.bfloat16)

    @jax.jit
    def run(q, k, v, dout):
        out, vjp = jax.vjp(lambda q, k, v: fj.flash_attention(q, k, v, bias=bias), q, k, v)
        return (out, *vjp(dout))  # no dbias: the reference's is not compared

    check_against_reference(q, k, v, dout, run(q, k, v, dout), bias=bias)


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("per_batch", [False, True], ids=["H", "BH"])
def test_alibi(per_batch, dtype):
    b, s, hq, hk, d = 2, 256, 4, 2, 64
    q, k, v, dout = inputs(37, b, s, s, hq, hk, d, d, DTYPES[dtype])
    slopes = slopes_of(38, (b, hq) if per_batch else (hq,))
    got = fwd_bwd(causal=True, causal_alignment="bottom_right", alibi_slopes=slopes)(q, k, v, None, dout)
    check_against_reference(q, k, v, dout, got, window=(-1, 0), bottom_right=True, alibi_slopes=slopes)


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_dropout_matches_the_reference_with_the_kernels_own_mask(dtype):
    b, s, hq, hk, d, rate = 2, 200, 4, 2, 64, 0.2
    q, k, v, dout = inputs(39, b, s, s, hq, hk, d, d, DTYPES[dtype])
    rng = jax.random.key(40)
    got = fwd_bwd(dropout_rate=rate, dropout_rng=rng)(q, k, v, None, dout)
    keep = kernel_keep(q, k, rate, rng)
    assert keep.shape == (b, hq, s, s) and abs(keep.mean() - (1 - rate)) < 0.01
    assert np.array_equal(keep, kernel_keep(q, k, rate, rng))
    assert not np.array_equal(keep, kernel_keep(q, k, rate, jax.random.key(41)))
    check_against_reference(q, k, v, dout, got, keep=keep, dropout_p=rate)


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_dropout_with_a_bias_and_its_gradient(dtype):
    b, sq, sk, h, d, rate = 2, 160, 192, 4, 128, 0.1
    q, k, v, dout = inputs(42, b, sq, sk, h, h, d, d, DTYPES[dtype])
    bias = rand(jax.random.PRNGKey(43), (b, h, sq, sk), DTYPES[dtype])
    rng = jax.random.key(44)
    got = fwd_bwd(causal=True, causal_alignment="bottom_right", dropout_rate=rate, dropout_rng=rng)(q, k, v, bias, dout)
    check_against_reference(q, k, v, dout, got, keep=kernel_keep(q, k, rate, rng), window=(-1, 0), bottom_right=True,
                            bias=bias, dropout_p=rate)


def test_bias_and_dropout_repeat_bitwise():
    """The same inputs and key give the same bits, in one jitted function and in a second one."""
    b, s, h, d = 2, 256, 4, 64
    q, k, v, dout = inputs(45, b, s, s, h, h, d, d, jnp.bfloat16)
    bias = rand(jax.random.PRNGKey(46), (1, h, s, s), jnp.bfloat16)
    kw = dict(causal=True, deterministic=True, dropout_rate=0.15, dropout_rng=jax.random.key(47))
    first = fwd_bwd(**kw)(q, k, v, bias, dout)
    for run in (fwd_bwd(**kw), fwd_bwd(**kw)):
        again = run(q, k, v, bias, dout)
        for name, a, b_ in zip(("out", "dq", "dk", "dv", "dbias"), first, again):
            assert not np.isnan(f64(a)).any(), name
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b_), err_msg=name)


VMAP_TERMS = {
    # name: (term, shape per instance, mapped)
    "bias_1hss_shared": ("bias", (1, 4), False),
    "bias_11ss_mapped": ("bias", (1, 1), True),
    "bias_bhss_mapped": ("bias", (2, 4), True),
    "alibi_h_mapped": ("alibi", (4,), True),
    "alibi_bh_shared": ("alibi", (2, 4), False),
}


@pytest.mark.parametrize("name", sorted(VMAP_TERMS))
def test_vmap_with_bias_or_slopes_matches_the_reference(name):
    """One folded call over V * B; every instance against the reference, dbias in its own bias's shape."""
    term, shape, mapped = VMAP_TERMS[name]
    count, b, s, hq, hk, d = 3, 2, 128, 4, 2, 64
    qs, ks, vs, douts = (jnp.stack(xs) for xs in zip(*(inputs(50 + i, b, s, s, hq, hk, d, d, jnp.bfloat16)
                                                        for i in range(count))))
    lead = (count,) if mapped else ()
    if term == "bias":
        x = rand(jax.random.PRNGKey(49), (*lead, *shape, s, s), jnp.bfloat16)
        run = jax.vmap(fwd_bwd(causal=True), in_axes=(0, 0, 0, 0 if mapped else None, 0))
        got = run(qs, ks, vs, x, douts)
    else:
        x = slopes_of(49, (*lead, *shape))
        one = lambda q, k, v, slopes, dout: fwd_bwd(causal=True, alibi_slopes=slopes)(q, k, v, None, dout)
        got = jax.jit(jax.vmap(one, in_axes=(0, 0, 0, 0 if mapped else None, 0)))(qs, ks, vs, x, douts)
    for i in range(count):
        xi = x[i] if mapped else x
        opts = {"bias": xi} if term == "bias" else {"alibi_slopes": xi}
        check_against_reference(qs[i], ks[i], vs[i], douts[i], [g if g is None else g[i] for g in got],
                                window=(-1, 0), **opts)


def test_vmap_with_one_key_draws_the_folded_batchs_mask():
    """An unmapped key seeds one folded call: instance i's mask is rows i*B..(i+1)*B of the mask that
    mha_dropout_mask draws for the [V * B, ..] shapes."""
    count, b, s, hq, hk, d, rate = 2, 2, 192, 4, 2, 64, 0.2
    qs, ks, vs, douts = (jnp.stack(xs) for xs in zip(*(inputs(60 + i, b, s, s, hq, hk, d, d, jnp.bfloat16)
                                                        for i in range(count))))
    rng = jax.random.key(62)
    got = jax.vmap(fwd_bwd(dropout_rate=rate, dropout_rng=rng), in_axes=(0, 0, 0, None, 0))(qs, ks, vs, None, douts)
    keep = kernel_keep(qs.reshape(count * b, s, hq, d), ks.reshape(count * b, s, hk, d), rate, rng)
    for i in range(count):
        check_against_reference(qs[i], ks[i], vs[i], douts[i], [g if g is None else g[i] for g in got],
                                keep=keep[i * b:(i + 1) * b], dropout_p=rate)


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_varlen_with_alibi_and_dropout(dtype):
    """Sequence b's dropout mask is [b, :, :len_q, :len_k] of mha_dropout_mask's for [B, max_seqlen] shapes."""
    lengths_q, lengths_k = [100, 0, 257, 64], [90, 17, 257, 128]
    cu_q = np.concatenate([[0], np.cumsum(lengths_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lengths_k)]).astype(np.int32)
    batch, hq, hk, d, rate = len(lengths_q), 4, 2, 64, 0.15
    max_q, max_k = max(lengths_q), max(lengths_k)
    keys = jax.random.split(jax.random.PRNGKey(63), 4)
    q, k, v = (rand(keys[0], (cu_q[-1], hq, d), DTYPES[dtype]), rand(keys[1], (cu_k[-1], hk, d), DTYPES[dtype]),
               rand(keys[2], (cu_k[-1], hk, d), DTYPES[dtype]))
    dout = rand(keys[3], (cu_q[-1], hq, d), DTYPES[dtype])
    slopes = slopes_of(64, (batch, hq))
    rng = jax.random.key(65)
    kw = dict(causal=True, causal_alignment="bottom_right", alibi_slopes=slopes, dropout_rate=rate, dropout_rng=rng)

    @jax.jit
    def run(q, k, v, dout, cu_q, cu_k):
        out, vjp = jax.vjp(lambda q, k, v: fj.flash_attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, **kw), q, k, v)
        return (out, *vjp(dout))

    out, dq, dk, dv = run(q, k, v, dout, jnp.asarray(cu_q), jnp.asarray(cu_k))
    mask = kernel_keep(jnp.zeros((batch, max_q, hq, d), DTYPES[dtype]), jnp.zeros((batch, max_k, hk, d), DTYPES[dtype]),
                       rate, rng)
    keep = [mask[i, :, :lq, :lk] for i, (lq, lk) in enumerate(zip(lengths_q, lengths_k))]
    opts = dict(window=(-1, 0), bottom_right=True, alibi_slopes=f64(slopes), dropout_p=rate, dropout_keep=keep)
    want_out, _ = reference.mha_varlen_fwd_ref(f64(q), f64(k), f64(v), cu_q, cu_k, **opts)
    want = reference.mha_varlen_bwd_ref(f64(dout), f64(q), f64(k), f64(v), cu_q, cu_k, **opts)
    assert_close("out", out, want_out)
    for name, got, ref in zip(("dq", "dk", "dv"), (dq, dk, dv), want[:3]):
        assert_close(name, got, ref)


def test_handler_errors_name_the_call_kernel_and_device():
    p = AttentionProblem(batch=1, seqlen_q=64, seqlen_k=64, heads_q=2, heads_k=2, head_dim_qk=64, head_dim_v=64,
                         dtype="bf16")
    fj.register_targets()
    program = xla_program.forward(p, fj.gpu_arch())
    launch = program.launches[0]
    unknown = launch.__class__("fmha_no_such_kernel", launch.grid, launch.block, launch.shared, launch.template,
                               launch.patches)
    program = program.__class__(program.label, program.buffers, program.operands, (), (unknown,))
    operands = [jnp.zeros(b.shape, b.dtype) for b in program.buffers[:program.operands]]
    results = [jax.ShapeDtypeStruct(b.shape, jnp.dtype(b.dtype)) for b in program.results]
    with pytest.raises(Exception) as info:
        jax.block_until_ready(jax.ffi.ffi_call("fmha_rt_fwd", results)(*operands, program=program.encode()))
    message = str(info.value)
    assert program.label in message and "fmha_no_such_kernel" in message and "device 0" in message
    assert "never registered" in message
