"""fmha_rt.jax without a GPU: the handler in the built shim, target registration, launch programs (their
serialisation, what they hold against the plan, and the C handler reading them on XLA's CPU backend),
lowering for CUDA, and the custom_vjp / vmap / jit plumbing with the custom calls replaced by a jnp
reference."""
import ctypes
import math
import pathlib
import re

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp

import fmha_rt.jax as fj
from fmha_rt import _shim, launch_program, portable_plan
from fmha_rt.errors import (
    FmhaNotImplementedError,
    FmhaRuntimeError,
    FmhaTypeError,
    FmhaValueError,
)
from fmha_rt.packing import NULL, pointer_value
from fmha_rt.problem import AttentionProblem
from fmha_rt.registry import SCRATCH_POINTERS, registry

ARCH = "sm_90"


def problem(**kw):
    base = {"batch": 2, "seqlen_q": 192, "seqlen_k": 160, "heads_q": 4, "heads_k": 2, "head_dim_qk": 64,
            "head_dim_v": 64, "dtype": "bf16"}
    return AttentionProblem(**{**base, **kw})


PROBLEMS = {
    "gqa": problem(),
    "causal_d128": problem(head_dim_qk=128, head_dim_v=128, window_left=-1, window_right=0, heads_k=4),
    "window_br_fp16": problem(dtype="fp16", window_left=32, window_right=8, bottom_right=True),
    "d192_dv128": problem(head_dim_qk=192, head_dim_v=128, heads_k=1),
    "varlen": problem(varlen=True, total_q=300, total_k=280, batch=3),
    "mha_one_launch": problem(heads_k=4),  # small enough for the one-launch backward, which has no workspace
}


# ---------------------------------------------------------------------------------- the shim


def test_handler_is_built_into_the_shim():
    """jaxlib is importable here, so the build must have found its header (the build log says which)."""
    assert fj.handler_built()
    so = ctypes.CDLL(_shim.__file__)
    for symbol in ("fmha_xla_run_program", "fmha_xla_ffi_api_version", "fmha_image_register", "fmha_image_kernel"):
        assert hasattr(so, symbol), symbol


def test_handler_api_version_is_the_installed_jaxlibs():
    header = (pathlib.Path(jax.ffi.include_dir()) / "xla/ffi/api/c_api.h").read_text()
    major, minor = (re.search(rf"#define XLA_FFI_API_{n} (\d+)", header).group(1) for n in ("MAJOR", "MINOR"))
    assert fj._handler_api_version() == f"{major}.{minor}"


def test_image_register_keeps_one_image_per_key():
    lib, ffi = _shim.lib, _shim.ffi
    count = ffi.new("size_t *")
    lib.fmha_image_count(count)
    before = count[0]
    key, image = b"test_image_register_key", b"\x7fELF-not-really"
    assert lib.fmha_image_register(key, image, len(image), b"sym", 0) == 0
    assert lib.fmha_image_register(key, image, len(image), b"sym", 0) == 0  # same bytes: nothing to do
    assert lib.fmha_image_register(key, b"other", 5, b"sym", 0) == lib.FMHA_ERR_BAD_ARGUMENT
    assert b"different image" in ffi.string(lib.fmha_last_error())
    lib.fmha_image_count(count)
    assert count[0] == before + 1


def test_a_shim_built_without_the_handler_says_so(monkeypatch):
    monkeypatch.setattr(fj, "handler_built", lambda: False)
    with pytest.raises(FmhaRuntimeError, match="built without the XLA FFI handler.*no-build-isolation"):
        fj.register_targets("CUDA")


def test_register_targets_for_gpu_platforms():
    for platform in ("CUDA", "ROCM"):
        fj.register_targets(platform)
        fj.register_targets(platform)  # idempotent
    assert {"CUDA", "ROCM"} <= fj._registered_platforms


# --------------------------------------------------------------------------- launch programs


@pytest.mark.parametrize("name", sorted(PROBLEMS))
@pytest.mark.parametrize("build", [launch_program.forward, launch_program.backward], ids=["fwd", "bwd"])
def test_program_round_trips(name, build):
    program = build(PROBLEMS[name], ARCH)
    words = program.encode()
    assert words.dtype == np.int64 and words[0] == launch_program.MAGIC
    decoded = launch_program.LaunchProgram.decode(words)
    assert (decoded.label, decoded.operands, decoded.zero_fills, decoded.launches) == \
        (program.label, program.operands, program.zero_fills, program.launches)
    assert [(b.dtype, b.nbytes) for b in decoded.buffers] == [(b.dtype, b.nbytes) for b in program.buffers]
    np.testing.assert_array_equal(decoded.encode(), words)


def _plan(build, p):
    """The plan the program was built from, with the same placeholder tensors."""
    program = build(p, ARCH)
    tensors = launch_program._tensors(program.buffers)
    if build is launch_program.backward:
        ws = portable_plan.bwd_workspace(p, ARCH)
        for region in ws.regions:
            tensors[region.name] = launch_program.placeholder(len(program.buffers) - 1, region.offset)
        return program, portable_plan.plan_bwd(p, ARCH, tensors)
    return program, portable_plan.plan_fwd(p, ARCH, tensors)


@pytest.mark.parametrize("name", sorted(PROBLEMS))
@pytest.mark.parametrize("build", [launch_program.forward, launch_program.backward], ids=["fwd", "bwd"])
def test_program_matches_the_plan(name, build):
    """Patching each template the way the handler does, with the placeholders as buffer addresses,
    gives exactly the bytes the Python executor packs for the same plan."""
    p = PROBLEMS[name]
    program, plan = _plan(build, p)
    plan = [launch for launch in plan if all(launch.grid)]
    assert [launch.key for launch in program.launches] == [launch.variant for launch in plan]
    bases = [launch_program.placeholder(i).address for i in range(len(program.buffers))]
    for built, planned in zip(program.launches, plan):
        entry = registry().entry(ARCH, planned.variant)
        assert built.grid == tuple(planned.grid) and built.block == (entry.threads, 1, 1)
        assert built.shared == entry.shared and len(built.template) == entry.param_bytes
        patched = bytearray(built.template)
        for patch in built.patches:
            patched[patch.arg_offset:patch.arg_offset + 8] = (bases[patch.buffer] + patch.offset).to_bytes(8, "little")
        assert bytes(patched) == entry.packer.pack({**dict.fromkeys(SCRATCH_POINTERS, NULL), **planned.args})
        pointers = {s.offset for s in entry.params if s.type == "ptr"
                    and pointer_value(s.name, planned.args.get(s.name))}
        assert {patch.arg_offset for patch in built.patches} == pointers
    if build is launch_program.backward:
        ws = portable_plan.bwd_workspace(p, ARCH)
        # a workspace result only where the plan has one (the one-launch backward has none)
        assert [b.nbytes for b in program.buffers if b.name == "workspace"] == ([ws.total_bytes] if ws.total_bytes else [])
        assert [(f.offset, f.nbytes) for f in program.zero_fills] == \
            [(r.offset, r.nbytes) for r in ws.regions if r.zero_init]


@pytest.mark.parametrize("heads_k,workspace", [(4, []), (2, ["workspace"])], ids=["one_launch_mha", "two_kernels_gqa"])
def test_backward_operands_and_results(heads_k, workspace):
    p = problem(varlen=True, total_q=300, total_k=280, batch=3, heads_k=heads_k)
    assert (portable_plan.dq_strategy(p, ARCH) == portable_plan.DQ_SINGLE) == (not workspace)
    program = launch_program.backward(p, ARCH)
    names = [b.name for b in program.buffers]
    assert names == ["dout", "q", "k", "v", "out", "lse", "cu_seqlens_q", "cu_seqlens_k", "dq", "dk", "dv",
                     *workspace]
    assert program.operands == 8


# ------------------------------------------------------- the C handler, run by XLA's CPU backend

PROBE = "fmha_rt_cpu_probe"  # the real handler under a test-only name, on the CPU platform


@pytest.fixture(scope="module")
def cpu_probe():
    capsule = jax.ffi.pycapsule(int(_shim.ffi.cast("uintptr_t", _shim.ffi.addressof(_shim.lib, fj.HANDLER))))
    jax.ffi.register_ffi_target(PROBE, capsule, platform="cpu")

    def run(program, words=None, operands=None):
        operands = operands or [jnp.zeros(b.shape, b.dtype) for b in program.buffers[:program.operands]]
        results = [jax.ShapeDtypeStruct(b.shape, jnp.dtype(b.dtype)) for b in program.results]
        call = jax.ffi.ffi_call(PROBE, results)
        with pytest.raises(Exception) as info:
            jax.block_until_ready(call(*operands, program=program.encode() if words is None else words))
        return str(info.value)

    return run


def test_handler_reads_a_valid_program_and_needs_a_gpu_stream(cpu_probe):
    program = launch_program.backward(PROBLEMS["gqa"], ARCH)
    message = cpu_probe(program)
    assert program.label in message
    assert "not initialised" in message or "no GPU stream" in message


def test_handler_refuses_malformed_programs(cpu_probe):
    program = launch_program.forward(PROBLEMS["gqa"], ARCH)
    words = program.encode()
    bad_magic = words.copy()
    bad_magic[0] = 1
    assert "does not start with the launch program magic" in cpu_probe(program, bad_magic)
    assert "truncated" in cpu_probe(program, words[:-1])
    assert "words past its end" in cpu_probe(program, np.append(words, 0))
    bad_grid = launch_program.LaunchProgram.decode(words)
    launch = bad_grid.launches[0]
    zero_grid = launch.__class__(launch.key, (0, 1, 1), launch.block, launch.shared, launch.template, launch.patches)
    assert "out of range" in cpu_probe(program, bad_grid.__class__(
        bad_grid.label, bad_grid.buffers, bad_grid.operands, (), (zero_grid,)).encode())


def test_handler_checks_the_buffers_against_the_program(cpu_probe):
    program = launch_program.forward(PROBLEMS["gqa"], ARCH)
    operands = [jnp.zeros(b.shape, b.dtype) for b in program.buffers[:program.operands]]
    operands[1] = jnp.zeros(operands[1].shape, jnp.float16)
    assert "buffer 1 has dtype 10" in cpu_probe(program, operands=operands)
    assert "operands" in cpu_probe(program, operands=operands[:2])


# --------------------------------------------------------------------------------- public API


def qkv(b=2, sq=128, sk=128, hq=4, hk=2, d=64, dv=None, dtype=jnp.bfloat16, seed=0):
    keys = jax.random.split(jax.random.PRNGKey(seed), 3)
    return (jax.random.normal(keys[0], (b, sq, hq, d), jnp.float32).astype(dtype),
            jax.random.normal(keys[1], (b, sk, hk, d), jnp.float32).astype(dtype),
            jax.random.normal(keys[2], (b, sk, hk, dv or d), jnp.float32).astype(dtype))


def test_on_cpu_flash_attention_says_the_gpu_platform_is_absent():
    with pytest.raises(FmhaRuntimeError, match="no GPU platform"):
        fj.flash_attention(*qkv())
    with pytest.raises(FmhaRuntimeError, match="no GPU platform"):
        jax.jit(fj.flash_attention)(*qkv())


@pytest.mark.parametrize("args, kwargs, error, match", [
    (qkv(dtype=jnp.float32), {}, FmhaTypeError, "float16 or bfloat16"),
    (qkv()[:2] + (qkv(dtype=jnp.float16)[2],), {}, FmhaTypeError, "v has dtype float16"),
    (qkv(hq=3, hk=2), {}, FmhaValueError, "multiple of the kv heads"),
    (qkv(d=60), {}, FmhaNotImplementedError, "multiples of 8"),
    (qkv(d=512), {}, FmhaNotImplementedError, "1..256"),
    ((qkv()[0][0],) + qkv()[1:], {}, FmhaValueError, "4 dims"),
    (qkv(), {"softmax_scale": jnp.float32(0.1)}, FmhaTypeError, "static under jit"),
    (qkv(), {"window": (-2, 0)}, FmhaValueError, "window"),
    (qkv(), {"causal_alignment": "middle"}, FmhaValueError, "causal_alignment"),
    (qkv(), {"deterministic": 1}, FmhaTypeError, "deterministic"),
])
def test_validation_comes_before_the_platform(args, kwargs, error, match):
    with pytest.raises(error, match=match):
        fj.flash_attention(*args, **kwargs)


def test_varlen_validation():
    q, k, v = (x[0] for x in qkv())
    cu = jnp.array([0, 64, 128], jnp.int32)
    with pytest.raises(FmhaTypeError, match="int32"):
        fj.flash_attention_varlen(q, k, v, cu.astype(jnp.float32), cu, 64, 64)
    with pytest.raises(FmhaValueError, match="max_seqlen_q"):
        fj.flash_attention_varlen(q, k, v, cu, cu, 64.0, 64)
    with pytest.raises(FmhaValueError, match="B \\+ 1"):
        fj.flash_attention_varlen(q, k, v, cu, cu[:2], 64, 64)


# ------------------------------------------------ lowering and plumbing, with the GPU pretended


@pytest.fixture
def pretend_gpu(monkeypatch):
    """Plan for sm_90 without a GPU (targets registered for CUDA)."""
    def arch():
        fj.register_targets("CUDA")
        return ARCH
    monkeypatch.setattr(fj, "_gpu_arch", arch)


def _custom_calls(text):
    return re.findall(r"stablehlo\.custom_call @(fmha_rt_\w+)\(", text)


def test_lowering_for_cuda_holds_the_program(pretend_gpu):
    q, k, v = qkv()
    text = jax.jit(lambda q, k, v: fj.flash_attention(q, k, v, causal=True)).trace(q, k, v).lower(
        lowering_platforms=("cuda",)).as_text()
    assert _custom_calls(text) == ["fmha_rt_fwd"]
    p = fj._batch_problem(q, k, v, fj._Options(None, fj.resolve_mask(True, (-1, -1), None, "top_left"), False, ARCH))
    words = launch_program.forward(p, ARCH).encode()
    assert f"dense<[{', '.join(str(w) for w in words)}]> : tensor<{len(words)}xi64>" in text


def test_lowering_of_grad_has_forward_and_backward(pretend_gpu, monkeypatch):
    monkeypatch.setattr(portable_plan, "SINGLE_MAX_SCORES", -1)  # the two-kernel backward, which has a workspace
    q, k, v = qkv()
    loss = lambda q, k, v: fj.flash_attention(q, k, v).astype(jnp.float32).sum()
    text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, k, v).lower(lowering_platforms=("cuda",)).as_text()
    assert sorted(_custom_calls(text)) == ["fmha_rt_bwd", "fmha_rt_fwd"]
    ws = portable_plan.bwd_workspace(fj._batch_problem(q, k, v, fj._Options(
        None, fj.resolve_mask(False, (-1, -1), None, "top_left"), False, ARCH)), ARCH).total_bytes
    assert ws > 0 and f"tensor<{ws}xui8>" in text  # the workspace is a result XLA allocates


def test_vmap_folds_into_one_call_over_the_batch(pretend_gpu):
    q, k, v = qkv(b=2)
    stacked = [jnp.stack([x, x, x]) for x in (q, k, v)]
    text = jax.jit(jax.vmap(fj.flash_attention)).trace(*stacked).lower(lowering_platforms=("cuda",)).as_text()
    assert _custom_calls(text) == ["fmha_rt_fwd"]
    assert "tensor<6x128x4x64xbf16>" in text
    grad = jax.vmap(jax.grad(_loss(fj.flash_attention), argnums=(0, 1, 2)))
    text = jax.jit(grad).trace(*stacked).lower(lowering_platforms=("cuda",)).as_text()
    assert sorted(_custom_calls(text)) == ["fmha_rt_bwd", "fmha_rt_fwd"]
    backward = next(line for line in text.splitlines() if "custom_call @fmha_rt_bwd" in line)
    assert "(tensor<6x128x4x64xbf16>, tensor<6x128x4x64xbf16>" in backward  # dout, q, ... over B = 6


def _reference(q, k, v, p, segments=None):
    """(out, lse) in float32 with jnp, masks as fmha_rt.reference defines them; `segments` gives varlen
    (query positions, key positions, query sequence ids, key sequence ids, query lengths, key lengths)."""
    qf, kf, vf = (x.astype(jnp.float32) for x in (q, k, v))
    group = p.heads_q // p.heads_k
    kf, vf = jnp.repeat(kf, group, axis=-2), jnp.repeat(vf, group, axis=-2)
    s = jnp.einsum("...qhd,...khd->...hqk", qf, kf) * p.softmax_scale
    if segments is None:
        i, j = jnp.arange(p.seqlen_q)[:, None], jnp.arange(p.seqlen_k)[None, :]
        off, same = (p.seqlen_k - p.seqlen_q if p.bottom_right else 0), True
    else:
        pos_q, pos_k, seq_q, seq_k, len_q, len_k = segments
        i, j = pos_q[:, None], pos_k[None, :]
        off = (len_k[None, :] - len_q[:, None]) if p.bottom_right else 0
        same = seq_q[:, None] == seq_k[None, :]
    rel = j - (i + off)
    visible = same & ((p.window_left < 0) | (rel >= -p.window_left)) & ((p.window_right < 0) | (rel <= p.window_right))
    s = jnp.where(visible, s, -jnp.inf)
    lse = jax.nn.logsumexp(s, axis=-1)
    probs = jnp.where(visible, jnp.exp(s - jnp.where(jnp.isfinite(lse), lse, 0)[..., None]), 0)
    out = jnp.einsum("...hqk,...khd->...qhd", probs, vf)
    return out.astype(q.dtype), lse


def _segments(cu_q, cu_k, total_q, total_k):
    def side(cu, total):
        rows = jnp.arange(total)
        seq = jnp.searchsorted(cu, rows, side="right") - 1
        return rows - cu[seq], seq, (cu[1:] - cu[:-1])[seq]
    (pq, sq, lq), (pk, sk, lk) = side(cu_q, total_q), side(cu_k, total_k)
    return pq, pk, sq, sk, lq, lk


@pytest.fixture
def reference_calls(pretend_gpu, monkeypatch):
    """The custom calls replaced by the jnp reference (a backward by its vjp); counts calls by kind."""
    made = []

    def call(kind, p, arch, arrays):
        made.append((kind, p))
        if kind == "fwd":
            return _reference(*arrays, p)
        if kind == "varlen_fwd":
            q, k, v, cu_q, cu_k = arrays
            out, lse = _reference(q, k, v, p, _segments(cu_q, cu_k, p.total_q, p.total_k))
            return out, lse
        dout, q, k, v, *rest = arrays
        segments = _segments(rest[2], rest[3], p.total_q, p.total_k) if kind == "varlen_bwd" else None
        _, vjp = jax.vjp(lambda q, k, v: _reference(q, k, v, p, segments)[0], q, k, v)
        return vjp(dout)

    monkeypatch.setattr(fj, "_call", call)
    return made


def _loss(attention):
    return lambda q, k, v: (attention(q, k, v).astype(jnp.float32) ** 2).sum()


@pytest.mark.parametrize("kwargs", [{}, {"causal": True}, {"window": (16, 8), "causal_alignment": "bottom_right"},
                                    {"softmax_scale": 0.3, "deterministic": True}])
def test_gradients_flow_through_the_custom_vjp(reference_calls, kwargs):
    q, k, v = qkv(sq=96, sk=80, dtype=jnp.float16)
    p = fj._batch_problem(q, k, v, fj._Options(kwargs.get("softmax_scale"), fj.resolve_mask(
        kwargs.get("causal", False), kwargs.get("window", (-1, -1)), None, kwargs.get("causal_alignment", "top_left")),
        False, ARCH))
    ours = jax.jit(jax.value_and_grad(_loss(lambda q, k, v: fj.flash_attention(q, k, v, **kwargs)), argnums=(0, 1, 2)))
    want = jax.value_and_grad(_loss(lambda q, k, v: _reference(q, k, v, p)[0]), argnums=(0, 1, 2))
    (value, grads), (want_value, want_grads) = ours(q, k, v), want(q, k, v)
    np.testing.assert_allclose(value, want_value, rtol=1e-6)
    for g, w in zip(grads, want_grads):
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), rtol=1e-3, atol=1e-3)
    assert [kind for kind, _ in reference_calls] == ["fwd", "bwd"]


def test_jit_traces_once_and_reruns(reference_calls):
    traces = []

    @jax.jit
    def step(q, k, v):
        traces.append(1)
        return jax.grad(_loss(fj.flash_attention), argnums=(0, 1, 2))(q, k, v)

    for seed in range(3):
        jax.block_until_ready(step(*qkv(seed=seed)))
    assert len(traces) == 1


def test_vmap_matches_a_loop(reference_calls):
    qs, ks, vs = (jnp.stack(xs) for xs in zip(*(qkv(b=2, sq=64, sk=64, seed=s) for s in range(3))))
    attention = lambda q, k, v: fj.flash_attention(q, k, v, causal=True)
    batched = jax.vmap(attention)(qs, ks, vs)
    for i in range(3):
        np.testing.assert_array_equal(batched[i], attention(qs[i], ks[i], vs[i]))
    # the calls run over the folded batch of 3 * 2 (custom_vmap also traces the unbatched call once,
    # to type it; the lowering test shows that only the folded calls remain)
    del reference_calls[:]
    grads = jax.vmap(jax.grad(_loss(attention), argnums=(0, 1, 2)))(qs, ks, vs)
    assert {("fwd", 6), ("bwd", 6)} <= {(kind, p.batch) for kind, p in reference_calls}
    for i in range(3):
        loop = jax.grad(_loss(attention), argnums=(0, 1, 2))(qs[i], ks[i], vs[i])
        for g, w in zip(grads, loop):
            np.testing.assert_allclose(np.asarray(g[i], np.float32), np.asarray(w, np.float32), rtol=1e-2, atol=1e-2)


def test_vmap_over_q_only_broadcasts_k_and_v(reference_calls):
    qs = jnp.stack([qkv(seed=s)[0] for s in range(2)])
    _, k, v = qkv()
    out = jax.vmap(fj.flash_attention, in_axes=(0, None, None))(qs, k, v)
    assert out.shape == (2, *qs.shape[1:])
    np.testing.assert_array_equal(out[1], fj.flash_attention(qs[1], k, v))


def test_varlen_gradients(reference_calls):
    lengths = [50, 0, 78]
    cu = jnp.array(np.concatenate([[0], np.cumsum(lengths)]), jnp.int32)
    q, k, v = (x[0] for x in qkv(b=1, sq=128, sk=128, dtype=jnp.float16))
    attention = lambda q, k, v: fj.flash_attention_varlen(q, k, v, cu, cu, 78, 78, causal=True)
    got = jax.jit(jax.grad(_loss(attention), argnums=(0, 1, 2)))(q, k, v)
    for b, n in enumerate(lengths):
        rows = slice(int(cu[b]), int(cu[b]) + n)
        if n == 0:
            continue
        single = lambda q, k, v: fj.flash_attention(q[None], k[None], v[None], causal=True)[0]
        want = jax.grad(_loss(single), argnums=(0, 1, 2))(q[rows], k[rows], v[rows])
        for g, w in zip(got, want):
            np.testing.assert_allclose(np.asarray(g[rows], np.float32), np.asarray(w, np.float32), rtol=1e-2, atol=1e-2)
    assert math.prod(got[0].shape) == math.prod(q.shape)
