"""fmha_rt.jax without a GPU: the handler in the built shim, target registration, launch programs (their
serialisation, what they hold against the plan, and the C handler reading them on XLA's CPU backend),
lowering for CUDA, the custom_vjp / vmap / jit plumbing with the custom calls replaced by a jnp
reference (bias, ALiBi and dropout against the float64 reference), and the sm_90 plans of the launch
programs run by the kernels under the Triton interpreter on the buffers XLA would pass."""
import ctypes
import dataclasses
import functools
import logging
import math
import pathlib
import random
import re

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero

import fmha_rt.jax as fj
from fmha_rt import _shim, reference
from fmha_rt.replay import program as program_model, xla_program
from fmha_rt.runtime import kernel_launch
from fmha_rt.plan import portable, v3
from fmha_rt.plan.args import Launch
from fmha_rt.errors import (
    FmhaNotImplementedError,
    FmhaRuntimeError,
    FmhaTypeError,
    FmhaValueError,
)
from fmha_rt.runtime.packing import Pointer, pointer_value
from fmha_rt.plan.problem import AttentionProblem
from fmha_rt.runtime.registry import registry

from log_lines import logged_calls

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
    "bias_11ss": problem(bias_shape="11SS", bias_grad=True),
    "bias_1hss_causal_unaligned_keys": problem(bias_shape="1HSS", bias_grad=True, seqlen_k=157, window_right=0),
    "bias_b1ss_fp16": problem(bias_shape="B1SS", bias_grad=True, dtype="fp16"),
    "bias_bhss_dropout": problem(bias_shape="BHSS", bias_grad=True, dropout_p=0.1),
    "bias_without_grad": problem(bias_shape="BHSS", heads_k=4),
    "alibi_h": problem(alibi="H", heads_k=4),
    "alibi_bh_window_br": problem(alibi="BH", window_left=32, window_right=8, bottom_right=True),
    "dropout_d128": problem(dropout_p=0.25, head_dim_qk=128, head_dim_v=128),
    "varlen_alibi_dropout": problem(varlen=True, total_q=300, total_k=280, batch=3, alibi="BH", dropout_p=0.2),
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
    assert fj.handler_api_version() == f"{major}.{minor}"


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
    assert {"CUDA", "ROCM"} <= fj.registered_platforms


# --------------------------------------------------------------------------- launch programs


@pytest.mark.parametrize("name", sorted(PROBLEMS))
@pytest.mark.parametrize("build", [xla_program.forward, xla_program.backward], ids=["fwd", "bwd"])
def test_program_round_trips(name, build):
    program = build(PROBLEMS[name], ARCH)
    words = program.encode()
    assert words.dtype == np.int64 and words[0] == program_model.MAGIC
    decoded = program_model.LaunchProgram.decode(words)
    assert (decoded.label, decoded.operands, decoded.zero_fills, decoded.launches) == \
        (program.label, program.operands, program.zero_fills, program.launches)
    assert [(b.dtype, b.nbytes) for b in decoded.buffers] == [(b.dtype, b.nbytes) for b in program.buffers]
    np.testing.assert_array_equal(decoded.encode(), words)


def _plan(build, p):
    """The plan the program was built from, with the same placeholder operands."""
    program = build(p, ARCH)
    operands = xla_program.placeholder_operands(program.buffers)
    if build is xla_program.backward:
        ws = portable.bwd_workspace(p, ARCH)
        for region in ws.regions:
            operands.regions[region.name] = xla_program.placeholder(len(program.buffers) - 1, region.offset)
        return program, portable.plan_bwd(p, ARCH, operands)
    return program, portable.plan_fwd(p, ARCH, operands)


@pytest.mark.parametrize("name", sorted(PROBLEMS))
@pytest.mark.parametrize("build", [xla_program.forward, xla_program.backward], ids=["fwd", "bwd"])
def test_program_matches_the_plan(name, build):
    """Patching each template the way the handler does, with the placeholders as buffer addresses,
    gives exactly the bytes the Python executor packs for the same plan."""
    p = PROBLEMS[name]
    program, plan = _plan(build, p)
    plan = [launch for launch in plan if all(launch.grid)]
    assert [launch.key for launch in program.launches] == [launch.variant for launch in plan]
    bases = [xla_program.placeholder(i).address for i in range(len(program.buffers))]
    for built, planned in zip(program.launches, plan):
        entry = registry().entry(ARCH, planned.variant)
        assert built.grid == tuple(planned.grid) and built.block == (entry.threads, 1, 1)
        assert built.shared == entry.shared and len(built.template) == entry.param_bytes
        patched = bytearray(built.template)
        for patch in built.patches:
            patched[patch.arg_offset:patch.arg_offset + 8] = (bases[patch.value] + patch.addend).to_bytes(8, "little")
        assert bytes(patched) == entry.packer.pack(kernel_launch.with_scratch(planned.args))
        pointers = {s.offset for s in entry.params if s.type == "ptr"
                    and pointer_value(s.name, planned.args.get(s.name))}
        assert {patch.arg_offset for patch in built.patches} == pointers
    if build is xla_program.backward:
        ws = portable.bwd_workspace(p, ARCH)
        # a workspace result only where the plan has one (the one-launch backward has none)
        assert [b.nbytes for b in program.buffers if b.name == "workspace"] == ([ws.total_bytes] if ws.total_bytes else [])
        assert [(f.offset, f.nbytes) for f in program.zero_fills] == \
            [(r.offset, r.nbytes) for r in ws.regions if r.zero_init]


@pytest.mark.parametrize("heads_k,workspace", [(4, []), (2, ["workspace"])], ids=["one_launch_mha", "two_kernels_gqa"])
def test_backward_operands_and_results(heads_k, workspace):
    p = problem(varlen=True, total_q=300, total_k=280, batch=3, heads_k=heads_k)
    assert (portable.dq_strategy(p, ARCH) == portable.DQ_SINGLE) == (not workspace)
    program = xla_program.backward(p, ARCH)
    names = [b.name for b in program.buffers]
    assert names == ["dout", "q", "k", "v", "out", "lse", "cu_seqlens_q", "cu_seqlens_k", "dq", "dk", "dv",
                     *workspace]
    assert program.operands == 8


V3_FORWARD = problem(batch=1, seqlen_q=4096, seqlen_k=4096, heads_q=4, heads_k=2, head_dim_qk=128, head_dim_v=128)


def test_a_forward_the_v3_family_serves_takes_its_descriptors_in_a_workspace_result():
    """Where the v3 forward runs (by default the 128 tile from 1024 keys; this GQA call without a mask in runs
    of four query blocks), its TMA descriptors live in a workspace result that XLA allocates, and the handler
    checks the compiler's alignment for them."""
    assert v3.serves_fwd(V3_FORWARD, ARCH)
    program = xla_program.forward(V3_FORWARD, ARCH)
    scratch = v3.fwd_scratch(V3_FORWARD)
    assert [b.name for b in program.results] == ["out", "lse", "workspace"]
    assert program.results[-1].nbytes == scratch.total_bytes and not program.zero_fills
    (launch,) = program.launches
    assert launch.key == v3.fwd_key("bf16", (128, 128), run=True)
    entry = registry().entry(ARCH, launch.key)
    slots = {s.offset: s.name for s in entry.params}
    aligns = {slots[p.arg_offset]: (p.value, p.addend, p.align) for p in launch.patches}
    region = scratch.region(v3.DESCRIPTOR_REGION)
    assert aligns["global_scratch"] == (len(program.buffers) - 1, region.offset, v3.GLOBAL_SCRATCH_ALIGN)
    assert entry.traits["global_scratch_align"] == v3.GLOBAL_SCRATCH_ALIGN
    assert {a for name, (_, _, a) in aligns.items() if name != "global_scratch"} == {16}
    decoded = program_model.LaunchProgram.decode(program.encode())
    assert decoded.launches == program.launches


def test_without_the_v3_family_the_same_forward_has_no_workspace(monkeypatch):
    monkeypatch.setattr(v3, "MODE", "off")
    program = xla_program.forward(V3_FORWARD, ARCH)
    assert [b.name for b in program.results] == ["out", "lse"]
    assert [launch.key for launch in program.launches] == [portable.plan_fwd(
        V3_FORWARD, ARCH, xla_program.placeholder_operands(program.buffers))[0].variant]


def test_lowering_of_a_v3_forward_returns_out_alone(pretend_gpu):
    q, k, v = qkv(b=1, sq=4096, sk=4096, d=128)
    attention = jax.jit(lambda q, k, v: fj.flash_attention(q, k, v))
    text = attention.trace(q, k, v).lower(lowering_platforms=("cuda",)).as_text()
    assert _custom_calls(text) == ["fmha_rt_fwd"]
    p = fj.batch_problem(q, k, v, fj.CallOptions(None, fj.resolve_mask(False, (-1, -1), None, "top_left"), False, ARCH))
    assert f"tensor<{v3.fwd_scratch(p).total_bytes}xui8>" in text  # the descriptors' workspace
    assert jax.eval_shape(attention, q, k, v).shape == q.shape


def _buffer(program, name):
    return next(i for i, b in enumerate(program.buffers) if b.name == name)


def _reads(planned, name, buffer):
    """Whether every planned launch with a `name` argument points it at `buffer` (and some launch does)."""
    values = [launch.args[name] for launch in planned.launches if name in launch.args]
    return bool(values) and all(xla_program.resolve_placeholder(v.address, len(planned.buffers), name) == (buffer, 0)
                                for v in values)


def test_score_terms_and_seed_follow_the_inputs_and_dbias_follows_dv():
    """Bias (rows padded to 8 keys), then the Philox words; dbias has the bias buffer's shape, its dS
    region is zeroed, and the kernels read the seed and offset from the operand."""
    p = problem(bias_shape="1HSS", bias_grad=True, dropout_p=0.1, seqlen_k=157)
    fwd, bwd = xla_program.planned_forward(p, ARCH), xla_program.planned_backward(p, ARCH)
    assert [b.name for b in fwd.buffers] == ["q", "k", "v", "bias", "philox_seed_offset", "out", "lse"]
    assert fwd.operands == 5
    assert [b.name for b in bwd.buffers] == ["dout", "q", "k", "v", "out", "lse", "bias", "philox_seed_offset",
                                             "dq", "dk", "dv", "dbias", "workspace"]
    assert bwd.operands == 8
    bias, dbias, seed = (bwd.buffers[_buffer(bwd, n)] for n in ("bias", "dbias", "philox_seed_offset"))
    assert bias.shape == dbias.shape == (1, 4, 192, 160) and bias.dtype == dbias.dtype == "bfloat16"
    assert (seed.shape, seed.dtype, seed.nbytes) == ((4,), "uint32", 16)
    for planned in (fwd, bwd):
        assert _reads(planned, "Bias", _buffer(planned, "bias"))
        assert _reads(planned, "PhiloxSeedOffset", _buffer(planned, "philox_seed_offset"))
        assert {launch.args["philox_from_ptr"] for launch in planned.launches if "philox_from_ptr" in launch.args} == {1}
    ds = portable.bwd_workspace(p, ARCH).region("ds")
    assert (bwd.buffers[-1].name, ds.offset, ds.nbytes) in [("workspace", f.offset, f.nbytes) for f in bwd.zero_fills]
    reduce = next(launch for launch in bwd.launches if launch.variant.startswith("fmha_bwd_dbias"))
    assert _reads(bwd, "dBias", _buffer(bwd, "dbias"))
    assert (reduce.args["reduce_batch"], reduce.args["reduce_heads"], reduce.args["stride_dbias_s"]) == (2, 1, 160)


@pytest.mark.parametrize("alibi,shape", [("H", (4,)), ("BH", (2, 4))])
def test_alibi_slopes_are_a_float32_operand_without_a_result(alibi, shape):
    p = problem(alibi=alibi)
    for planned in (xla_program.planned_forward(p, ARCH), xla_program.planned_backward(p, ARCH)):
        slopes = planned.buffers[_buffer(planned, "alibi")]
        assert (slopes.shape, slopes.dtype) == (shape, "float32") and _buffer(planned, "alibi") < planned.operands
        assert _reads(planned, "Alibi", _buffer(planned, "alibi"))
        assert [b.name for b in planned.results][:3] in (["out", "lse"], ["dq", "dk", "dv"])
        assert "dbias" not in [b.name for b in planned.buffers]


def test_a_bias_without_gradient_has_no_dbias_and_no_ds_workspace():
    p = problem(bias_shape="B1SS")
    planned = xla_program.planned_backward(p, ARCH)
    assert "bias" in [b.name for b in planned.buffers[:planned.operands]]
    assert [b.name for b in planned.results] == ["dq", "dk", "dv", "workspace"]
    assert "ds" not in [r.name for r in portable.bwd_workspace(p, ARCH).regions]
    assert not any(launch.variant.startswith("fmha_bwd_dbias") for launch in planned.launches)


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


@pytest.mark.parametrize("name", ["gqa", "bias_bhss_dropout", "alibi_bh_window_br", "varlen_alibi_dropout"])
def test_handler_reads_a_valid_program_and_needs_a_gpu_stream(cpu_probe, name):
    """The buffers pass the handler's checks (the uint32 seed's dtype number is XLA's too)."""
    program = xla_program.backward(PROBLEMS[name], ARCH)
    message = cpu_probe(program)
    assert program.label in message
    assert "not initialised" in message or "no GPU stream" in message


def test_handler_refuses_malformed_programs(cpu_probe):
    program = xla_program.forward(PROBLEMS["gqa"], ARCH)
    words = program.encode()
    bad_magic = words.copy()
    bad_magic[0] = 1
    assert "does not start with the launch program magic" in cpu_probe(program, bad_magic)
    assert "truncated" in cpu_probe(program, words[:-1])
    assert "words past its end" in cpu_probe(program, np.append(words, 0))
    bad_grid = program_model.LaunchProgram.decode(words)
    launch = bad_grid.launches[0]
    zero_grid = launch.__class__(launch.key, (0, 1, 1), launch.block, launch.shared, launch.template, launch.patches)
    assert "out of range" in cpu_probe(program, bad_grid.__class__(
        bad_grid.label, bad_grid.buffers, bad_grid.operands, (), (zero_grid,)).encode())
    for align in (0, 24, 8192):  # not a power of two from 1 to 4096
        patches = (dataclasses.replace(launch.patches[0], align=align),) + launch.patches[1:]
        bad_align = dataclasses.replace(launch, patches=patches)
        assert "out of range" in cpu_probe(program, dataclasses.replace(bad_grid, launches=(bad_align,)).encode())


def test_handler_checks_the_buffers_against_the_program(cpu_probe):
    program = xla_program.forward(PROBLEMS["gqa"], ARCH)
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
    (qkv(d=512), {}, FmhaNotImplementedError, "1..256"),
    ((qkv()[0][0],) + qkv()[1:], {}, FmhaValueError, "4 dims"),
    (qkv(), {"softmax_scale": jnp.float32(0.1)}, FmhaTypeError, "static under jit"),
    (qkv(), {"window": (-2, 0)}, FmhaValueError, "window"),
    (qkv(), {"causal_alignment": "middle"}, FmhaValueError, "causal_alignment"),
    (qkv(), {"deterministic": 1}, FmhaTypeError, "deterministic"),
    (qkv(), {"return_lse": 1}, FmhaTypeError, "return_lse must be a Python bool"),
])
def test_validation_comes_before_the_platform(args, kwargs, error, match):
    with pytest.raises(error, match=match):
        fj.flash_attention(*args, **kwargs)


def rand(shape, dtype=jnp.bfloat16, seed=9):
    return jax.random.normal(jax.random.PRNGKey(seed), shape, jnp.float32).astype(dtype)


KEY = jax.random.key(3)
BROADCAST = r"bias must broadcast from \[1\|2, 1\|4, 128, 128\]"


@pytest.mark.parametrize("kwargs, error, match", [
    ({"bias": rand((1, 4, 128, 64))}, FmhaValueError, BROADCAST + r", got \(1, 4, 128, 64\)"),
    ({"bias": rand((3, 1, 128, 128))}, FmhaValueError, BROADCAST),
    ({"bias": rand((2, 2, 128, 128))}, FmhaValueError, BROADCAST),
    ({"bias": rand((4, 128, 128))}, FmhaValueError, BROADCAST + r", got \(4, 128, 128\)"),
    ({"bias": rand((1, 4, 128, 128), jnp.float32)}, FmhaTypeError, "bias has dtype float32 but q has bfloat16: they must match"),
    ({"bias": rand((1, 4, 128, 128), jnp.float16)}, FmhaTypeError, "bias has dtype float16 but q has bfloat16: they must match"),
    ({"alibi_slopes": rand((3,), jnp.float32)}, FmhaValueError, r"alibi_slopes must have shape \[4\] or \[2, 4\]"),
    ({"alibi_slopes": rand((2, 4, 1), jnp.float32)}, FmhaValueError, r"alibi_slopes must have shape"),
    ({"alibi_slopes": rand((4,))}, FmhaTypeError, "alibi_slopes must be float32, got bfloat16"),
    ({"bias": rand((1, 4, 128, 128)), "alibi_slopes": rand((4,), jnp.float32)}, FmhaNotImplementedError,
     "bias and alibi_slopes together are not supported"),
    ({"dropout_rate": 1.0, "dropout_rng": KEY}, FmhaValueError, r"dropout_rate must be a number in \[0, 1\)"),
    ({"dropout_rate": -0.1, "dropout_rng": KEY}, FmhaValueError, r"dropout_rate must be a number in \[0, 1\)"),
    ({"dropout_rate": jnp.float32(0.1), "dropout_rng": KEY}, FmhaTypeError, "dropout_rate must be a Python float"),
    ({"dropout_rate": True, "dropout_rng": KEY}, FmhaTypeError, "dropout_rate must be a Python float"),
    ({"dropout_rate": 0.1}, FmhaValueError, "dropout_rate > 0 needs dropout_rng"),
    ({"dropout_rate": 0.1, "dropout_rng": 7}, FmhaTypeError, "dropout_rng must be a jax PRNG key"),
    ({"dropout_rate": 0.1, "dropout_rng": jnp.zeros(3, jnp.uint32)}, FmhaTypeError, "dropout_rng must be a jax PRNG key"),
    ({"dropout_rate": 0.1, "dropout_rng": jnp.zeros(2, jnp.float32)}, FmhaTypeError, "dropout_rng must be a jax PRNG key"),
    ({"dropout_rate": 0.1, "dropout_rng": jax.random.split(KEY, 2)}, FmhaValueError, r"one PRNG key, .* shape \(2,\)"),
    ({"dropout_rate": 0.1, "dropout_rng": jax.random.split(jax.random.PRNGKey(0), 2)}, FmhaValueError,
     "one PRNG key"),
])
def test_score_term_and_dropout_validation_comes_before_the_platform(kwargs, error, match):
    with pytest.raises(error, match=match):
        fj.flash_attention(*qkv(), **kwargs)


def test_a_key_is_accepted_raw_or_typed_and_ignored_without_dropout():
    """Valid arguments get as far as the platform (absent on CPU)."""
    for kwargs in ({"dropout_rate": 0.1, "dropout_rng": KEY}, {"dropout_rate": 0.1, "dropout_rng": jax.random.PRNGKey(1)},
                   {"dropout_rate": 0.0, "dropout_rng": "not a key"}, {"bias": np.ones((2, 1, 128, 128), jnp.bfloat16)},
                   {"alibi_slopes": np.ones((2, 4), np.float32)}):
        with pytest.raises(FmhaRuntimeError, match="no GPU platform"):
            fj.flash_attention(*qkv(), **kwargs)


def test_varlen_validation():
    q, k, v = (x[0] for x in qkv())
    cu = jnp.array([0, 64, 128], jnp.int32)
    with pytest.raises(FmhaTypeError, match="int32"):
        fj.flash_attention_varlen(q, k, v, cu.astype(jnp.float32), cu, 64, 64)
    with pytest.raises(FmhaValueError, match="max_seqlen_q"):
        fj.flash_attention_varlen(q, k, v, cu, cu, 64.0, 64)
    with pytest.raises(FmhaValueError, match="B \\+ 1"):
        fj.flash_attention_varlen(q, k, v, cu, cu[:2], 64, 64)
    with pytest.raises(FmhaNotImplementedError, match="tensor bias is not supported with variable-length"):
        fj.flash_attention_varlen(q, k, v, cu, cu, 64, 64, bias=rand((1, 4, 64, 64)))
    with pytest.raises(FmhaValueError, match=r"alibi_slopes must have shape \[4\] or \[2, 4\]"):
        fj.flash_attention_varlen(q, k, v, cu, cu, 64, 64, alibi_slopes=rand((3, 4), jnp.float32))
    with pytest.raises(FmhaValueError, match="needs dropout_rng"):
        fj.flash_attention_varlen(q, k, v, cu, cu, 64, 64, dropout_rate=0.5)
    with pytest.raises(FmhaRuntimeError, match="no GPU platform"):
        fj.flash_attention_varlen(q, k, v, cu, cu, 64, 64, alibi_slopes=rand((2, 4), jnp.float32), dropout_rate=0.5,
                                  dropout_rng=KEY)


# ------------------------------------------------ lowering and plumbing, with the GPU pretended


@pytest.fixture
def pretend_gpu(monkeypatch):
    """Plan for sm_90 without a GPU (targets registered for CUDA)."""
    def arch():
        fj.register_targets("CUDA")
        return ARCH
    monkeypatch.setattr(fj, "gpu_arch", arch)


def _custom_calls(text):
    return re.findall(r"stablehlo\.custom_call @(fmha_rt_\w+)\(", text)


def test_lowering_for_cuda_holds_the_program(pretend_gpu):
    q, k, v = qkv()
    text = jax.jit(lambda q, k, v: fj.flash_attention(q, k, v, causal=True)).trace(q, k, v).lower(
        lowering_platforms=("cuda",)).as_text()
    assert _custom_calls(text) == ["fmha_rt_fwd"]
    p = fj.batch_problem(q, k, v, fj.CallOptions(None, fj.resolve_mask(True, (-1, -1), None, "top_left"), False, ARCH))
    words = xla_program.forward(p, ARCH).encode()
    assert _holds(text, words)


def test_lowering_of_grad_has_forward_and_backward(pretend_gpu, monkeypatch):
    monkeypatch.setattr(portable, "SINGLE_MAX_SCORES", -1)  # the two-kernel backward, which has a workspace
    q, k, v = qkv()
    loss = lambda q, k, v: fj.flash_attention(q, k, v).astype(jnp.float32).sum()
    text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, k, v).lower(lowering_platforms=("cuda",)).as_text()
    assert sorted(_custom_calls(text)) == ["fmha_rt_bwd", "fmha_rt_fwd"]
    ws = portable.bwd_workspace(fj.batch_problem(q, k, v, fj.CallOptions(
        None, fj.resolve_mask(False, (-1, -1), None, "top_left"), False, ARCH)), ARCH).total_bytes
    assert ws > 0 and f"tensor<{ws}xui8>" in text  # the workspace is a result XLA allocates


def test_log_config_logs_each_custom_call_when_it_is_traced(pretend_gpu, monkeypatch, caplog, log_config):
    """The handler runs in C: FMHA_RT_LOG_CONFIG's line of a custom call comes from its tracing, once per
    trace, naming what XLA will launch."""
    monkeypatch.setattr(portable, "SINGLE_MAX_SCORES", -1)  # the two-kernel backward, which has a workspace
    q, k, v = qkv()
    loss = lambda q, k, v: fj.flash_attention(q, k, v, window=(32, 8), dropout_rate=0.25, dropout_rng=jax.random.key(3),
                                              deterministic=True).astype(jnp.float32).sum()
    with caplog.at_level(logging.INFO, logger="fmha_rt"):
        jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, k, v).lower(lowering_platforms=("cuda",))
    fwd, bwd = logged_calls(caplog.records)
    p = problem(seqlen_q=128, seqlen_k=128, window_left=32, window_right=8, dropout_p=0.25, deterministic=True)
    forward, backward = xla_program.forward(p, ARCH), xla_program.backward(p, ARCH)
    assert (fwd["function"], bwd["function"]) == ("jax.fwd", "jax.bwd")
    assert fwd["kernels"] == ",".join(launch.key for launch in forward.launches)
    assert bwd["kernels"] == ",".join(launch.key for launch in backward.launches)
    workspace = next(b.nbytes for b in backward.results if b.name == "workspace")
    assert (bwd["workspace_bytes"], fwd["workspace_bytes"]) == (str(workspace), "0") and workspace > 0
    assert (bwd["dq_splits"], fwd["dq_splits"]) == (str(portable.bwd_workspace(p, ARCH).dq_splits), "none")
    for line in (fwd, bwd):
        assert (line["device"], line["arch"], line["family"]) == ("xla", ARCH, "portable")
        assert line["q"] == "bf16[2,128,4,64]:[32768,256,64,1]" and line["k"] == "bf16[2,128,2,64]:[16384,128,64,1]"
        assert (line["window"], line["mask_type"], line["dropout_p"]) == ("(32,8)", "3", "0.25")
        assert (line["seed"], line["offset"], line["deterministic"]) == ("device", "device", "True")
    assert bwd["dq"] == "bf16[2,128,4,64]:[32768,256,64,1]" and bwd["lse"] == "fp32[2,4,128]:[512,128,1]"


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


def _reference(q, k, v, p, segments=None, bias=None, alibi=None, keep=None):
    """(out, lse) in float32 with jnp, masks, bias, ALiBi and dropout as fmha_rt.reference defines them;
    `segments` gives varlen (query positions, key positions, query sequence ids, key sequence ids, query
    lengths, key lengths); `keep` is the dropout keep mask ([B, Hq, Sq, Sk], varlen [Hq, total_q, total_k])."""
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
    if bias is not None:
        s = s + bias.astype(jnp.float32)
    if alibi is not None:  # [Hq] or [B, Hq]: -slope * |i + off - j|
        if segments is None:
            slopes = alibi[..., None, None]
        else:
            slopes = (alibi[:, None, None] if alibi.ndim == 1 else alibi[seq_q].T[:, :, None])
        s = s - slopes * jnp.abs(rel)
    visible = same & ((p.window_left < 0) | (rel >= -p.window_left)) & ((p.window_right < 0) | (rel <= p.window_right))
    s = jnp.where(visible, s, -jnp.inf)
    lse = jax.nn.logsumexp(s, axis=-1)
    probs = jnp.where(visible, jnp.exp(s - jnp.where(jnp.isfinite(lse), lse, 0)[..., None]), 0)
    if keep is not None:
        probs = jnp.where(keep, probs / (1.0 - p.dropout_p), 0.0)
    out = jnp.einsum("...hqk,...khd->...qhd", probs, vf)
    return out.astype(q.dtype), lse


def _segments(cu_q, cu_k, total_q, total_k):
    def side(cu, total):
        rows = jnp.arange(total)
        seq = jnp.searchsorted(cu, rows, side="right") - 1
        return rows - cu[seq], seq, (cu[1:] - cu[:-1])[seq]
    (pq, sq, lq), (pk, sk, lk) = side(cu_q, total_q), side(cu_k, total_k)
    return pq, pk, sq, sk, lq, lk


def _fake_keep(seed, rate, shape):
    """The reference calls' dropout keep mask: drawn from the seed operand alone, so that a backward
    keeps what its forward kept only when both got the same seed."""
    return jax.random.bernoulli(jax.random.wrap_key_data(seed[:2] ^ seed[2:]), 1.0 - rate, shape)


@pytest.fixture
def reference_calls(pretend_gpu, monkeypatch):
    """The custom calls replaced by the jnp reference (a backward by its vjp, with dbias when the problem
    has bias_grad); records (kind, problem) of every call."""
    made = []

    def call(kind, p, arch, arrays):
        made.append((kind, p))
        *tensors, bias, alibi, seed = arrays
        assert (bias is None) == (p.bias_shape is None) and (alibi is None) == (p.alibi is None)
        assert (seed is None) == (not p.has_dropout) and (seed is None or (seed.shape, seed.dtype) == ((4,), jnp.uint32))
        forward = kind.endswith("fwd")
        q, k, v, *offsets = tensors if forward else tensors[1:4] + tensors[6:]
        segments = _segments(*offsets, p.total_q, p.total_k) if offsets else None
        shape = (p.heads_q, p.total_q, p.total_k) if p.varlen else (p.batch, p.heads_q, p.seqlen_q, p.seqlen_k)
        keep = None if seed is None else _fake_keep(seed, p.dropout_p, shape)

        def attention(q, k, v, bias):
            return _reference(q, k, v, p, segments, bias, alibi, keep)

        if forward:
            return attention(q, k, v, bias)
        _, vjp = jax.vjp(lambda *x: attention(*x)[0], q, k, v, bias)
        dq, dk, dv, dbias = vjp(tensors[0])
        return (dq, dk, dv, dbias) if p.bias_grad else (dq, dk, dv)

    monkeypatch.setattr(fj, "kernel_call", call)
    return made


def _loss(attention):
    return lambda q, k, v: (attention(q, k, v).astype(jnp.float32) ** 2).sum()


@pytest.mark.parametrize("kwargs", [{}, {"causal": True}, {"window": (16, 8), "causal_alignment": "bottom_right"},
                                    {"softmax_scale": 0.3, "deterministic": True}])
def test_gradients_flow_through_the_custom_vjp(reference_calls, kwargs):
    q, k, v = qkv(sq=96, sk=80, dtype=jnp.float16)
    p = fj.batch_problem(q, k, v, fj.CallOptions(kwargs.get("softmax_scale"), fj.resolve_mask(
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


@pytest.mark.parametrize("d, dv, kwargs", [(13, 20, {"causal": True}), (8, 5, {"softmax_scale": 0.3}),
                                            (60, 60, {"window": (9, 3)})])
def test_head_dims_that_are_not_multiples_of_8_run_zero_padded(reference_calls, d, dv, kwargs):
    """The custom calls see q, k and v padded to multiples of 8 (the launch programs have no padding copies)
    with the scale of the unpadded D; out and the gradients come back at the caller's head dims."""
    seed = random.randrange(2**31)
    q, k, v = qkv(sq=72, sk=56, d=d, dv=dv, dtype=jnp.float16, seed=seed)
    mask = fj.resolve_mask(kwargs.get("causal", False), kwargs.get("window", (-1, -1)), None, "top_left")
    p = fj.batch_problem(q, k, v, fj.CallOptions(kwargs.get("softmax_scale"), mask, False, ARCH))
    ours = jax.jit(jax.value_and_grad(_loss(lambda q, k, v: fj.flash_attention(q, k, v, **kwargs)), argnums=(0, 1, 2)))
    want = jax.value_and_grad(_loss(lambda q, k, v: _reference(q, k, v, p)[0]), argnums=(0, 1, 2))
    (value, grads), (want_value, want_grads) = ours(q, k, v), want(q, k, v)
    np.testing.assert_allclose(value, want_value, rtol=1e-5, err_msg=f"seed {seed}")
    for g, w, x in zip(grads, want_grads, (q, k, v)):
        assert g.shape == x.shape
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), rtol=1e-3, atol=1e-3,
                                   err_msg=f"seed {seed}")
    padded = {(call.head_dim_qk, call.head_dim_v, call.softmax_scale) for _, call in reference_calls}
    assert padded == {(-(-d // 8) * 8, -(-dv // 8) * 8, kwargs.get("softmax_scale", 1 / math.sqrt(d)))}
    assert [kind for kind, _ in reference_calls] == ["fwd", "bwd"]
    # under vmap: one folded call over the padded arrays, each instance as a call of its own
    qs, ks, vs = (jnp.stack([x, x[::-1]]) for x in (q, k, v))
    mapped = jax.vmap(lambda q, k, v: fj.flash_attention(q, k, v, **kwargs))(qs, ks, vs)
    assert mapped.shape == (2, *q.shape[:3], dv)
    for i in range(2):
        np.testing.assert_allclose(np.asarray(mapped[i], np.float32),
                                   np.asarray(fj.flash_attention(qs[i], ks[i], vs[i], **kwargs), np.float32))


def test_return_lse_gives_the_reference_lse_without_a_gradient(reference_calls):
    """return_lse=True: (out, lse [B, Hq, Sq]) as the reference has them, also at a padded head dim and
    under vmap; gradients through out as without it; a gradient through lse is refused at trace time,
    and lse under stop_gradient is fine."""
    seed = random.randrange(2**31)
    q, k, v = qkv(sq=72, sk=56, d=12, dv=16, dtype=jnp.float16, seed=seed)
    p = fj.batch_problem(q, k, v, fj.CallOptions(None, fj.resolve_mask(True, (-1, -1), None, "top_left"), False, ARCH))
    out, lse = fj.flash_attention(q, k, v, causal=True, return_lse=True)
    want_out, want_lse = _reference(q, k, v, p)
    assert out.shape == want_out.shape and lse.shape == (2, 4, 72) and lse.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want_out, np.float32), rtol=1e-3, atol=1e-3,
                               err_msg=f"seed {seed}")
    np.testing.assert_allclose(np.asarray(lse), np.asarray(want_lse), rtol=1e-5, atol=1e-6, err_msg=f"seed {seed}")

    def through_out(q, k, v):
        out, lse = fj.flash_attention(q, k, v, causal=True, return_lse=True)
        return (out.astype(jnp.float32) ** 2).sum() + jax.lax.stop_gradient(lse).sum()

    got = jax.grad(through_out, argnums=(0, 1, 2))(q, k, v)
    want = jax.grad(_loss(lambda q, k, v: fj.flash_attention(q, k, v, causal=True)), argnums=(0, 1, 2))(q, k, v)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    with pytest.raises(FmhaNotImplementedError, match="lse .*carries no gradient"):
        jax.grad(lambda q: fj.flash_attention(q, k, v, return_lse=True)[1].sum())(q)
    qs = jnp.stack([q, q[::-1]])
    mapped_out, mapped_lse = jax.vmap(lambda q: fj.flash_attention(q, k, v, causal=True, return_lse=True))(qs)
    assert mapped_out.shape == (2, *out.shape) and mapped_lse.shape == (2, *lse.shape)
    np.testing.assert_array_equal(np.asarray(mapped_lse[0]), np.asarray(lse))


def test_varlen_return_lse(reference_calls):
    lengths = [50, 0, 30]
    cu = jnp.array(np.concatenate([[0], np.cumsum(lengths)]), jnp.int32)
    q, k, v = (x[0, :80] for x in qkv(b=1, sq=128, sk=128, dtype=jnp.float16, seed=random.randrange(2**31)))
    out, lse = fj.flash_attention_varlen(q, k, v, cu, cu, 50, 50, causal=True, return_lse=True)
    assert out.shape == q.shape and lse.shape == (4, 80)
    for b, n in enumerate(lengths):
        rows = slice(int(cu[b]), int(cu[b]) + n)
        if n:
            _, want = fj.flash_attention(q[None, rows], k[None, rows], v[None, rows], causal=True, return_lse=True)
            np.testing.assert_allclose(np.asarray(lse[:, rows]), np.asarray(want[0]), rtol=1e-5, atol=1e-6)
    grad = jax.grad(lambda q: fj.flash_attention_varlen(q, k, v, cu, cu, 50, 50, return_lse=True)[0]
                    .astype(jnp.float32).sum())(q)
    assert grad.shape == q.shape and bool(jnp.isfinite(grad).all())
    with pytest.raises(FmhaNotImplementedError, match="carries no gradient"):
        jax.grad(lambda q: fj.flash_attention_varlen(q, k, v, cu, cu, 50, 50, return_lse=True)[1].sum())(q)


# ------------------------------------------------ bias, ALiBi and dropout through the custom_vjp

TOL = 1e-2  # relative error against the float64 reference, as the GPU tests take it


def _f64(x):
    return None if x is None else np.asarray(jnp.asarray(x).astype(jnp.float32), np.float64)


def _assert_close(name, got, want, tol=TOL):
    got = _f64(got)
    assert got.shape == want.shape, f"{name}: shape {got.shape}, want {want.shape}"
    assert not np.isnan(got).any(), f"{name}: NaN"
    err = reference.rel_err(got, want)
    assert err < tol, f"{name}: relative error {err:.2e} >= {tol}"


def _reference_mask(kw):
    window = tuple(kw.get("window", (-1, -1)))
    if kw.get("causal"):
        window = (window[0], 0)
    return {"softmax_scale": kw.get("softmax_scale"), "window": window,
            "bottom_right": kw.get("causal_alignment") == "bottom_right"}


def _float64(q, k, v, dout, kw, bias=None, alibi=None, keep=None, rate=0.0):
    """(out, (dq, dk, dv, dbias)) of fmha_rt.reference for flash_attention's options `kw`."""
    opts = dict(_reference_mask(kw), bias=_f64(bias), alibi_slopes=_f64(alibi), dropout_p=rate, dropout_keep=keep)
    out, _ = reference.mha_fwd_ref(_f64(q), _f64(k), _f64(v), **opts)
    return out, reference.mha_bwd_ref(_f64(dout), _f64(q), _f64(k), _f64(v), **opts)


def _fwd_bwd(**kw):
    """(q, k, v, bias, dout) -> (out, (dq, dk, dv, dbias)) of flash_attention with options `kw`, jitted."""
    @jax.jit
    def run(q, k, v, bias, dout):
        out, vjp = jax.vjp(lambda q, k, v, bias: fj.flash_attention(q, k, v, bias=bias, **kw), q, k, v, bias)
        return out, vjp(dout)
    return run


def _inputs(seed, b, sq, sk, hq, hk, d, dtype, bias_rows=None, slopes=None):
    """q, k, v, dout, bias [*bias_rows, Sq, Sk] and ALiBi slopes of shape `slopes` (fresh draws; None
    where not asked for)."""
    q, k, v = qkv(b, sq, sk, hq, hk, d, dtype=dtype, seed=seed)
    keys = jax.random.split(jax.random.PRNGKey(seed + 1000), 3)
    dout = jax.random.normal(keys[0], (b, sq, hq, d), jnp.float32).astype(dtype)
    bias = None if bias_rows is None else jax.random.normal(keys[1], (*bias_rows, sq, sk), jnp.float32).astype(dtype)
    alibi = None if slopes is None else jax.random.uniform(keys[2], slopes, jnp.float32, 0.05, 0.5)
    return q, k, v, dout, bias, alibi


SCORE_CASES = {
    # name: (bias rows or None, slopes shape or None, dropout rate, mask options, dtype)
    "bias_11ss_causal": ((1, 1), None, 0.0, {"causal": True}, jnp.bfloat16),
    "bias_1hss": ((1, 4), None, 0.0, {}, jnp.float16),
    "bias_b1ss_window_br": ((2, 1), None, 0.0, {"window": (16, 8), "causal_alignment": "bottom_right"}, jnp.bfloat16),
    "bias_bhss_dropout": ((2, 4), None, 0.2, {"causal": True}, jnp.float16),
    "alibi_h_causal_br": (None, (4,), 0.0, {"causal": True, "causal_alignment": "bottom_right"}, jnp.bfloat16),
    "alibi_bh_dropout": (None, (2, 4), 0.1, {}, jnp.float16),
    "dropout_gqa_scale": (None, None, 0.3, {"softmax_scale": 0.2}, jnp.bfloat16),
}


@pytest.mark.parametrize("name", sorted(SCORE_CASES))
def test_score_terms_and_dropout_match_the_float64_reference(reference_calls, name):
    """jax.vjp through the custom_vjp (with the calls replaced by the jnp reference, whose dropout mask
    comes from the seed operand) against fmha_rt.reference: out, dq, dk, dv and dbias in the bias's
    shape. The backward keeps what the forward kept only if both calls got the seed."""
    bias_rows, slopes, rate, mask, dtype = SCORE_CASES[name]
    b, sq, sk, hq = 2, 96, 80, 4
    q, k, v, dout, bias, alibi = _inputs(sorted(SCORE_CASES).index(name), b, sq, sk, hq, 2, 64, dtype, bias_rows, slopes)
    rng = jax.random.key(sorted(SCORE_CASES).index(name)) if rate else None
    out, (dq, dk, dv, dbias) = _fwd_bwd(**mask, alibi_slopes=alibi, dropout_rate=rate, dropout_rng=rng)(
        q, k, v, bias, dout)
    keep = None
    if rate:
        keep = np.asarray(_fake_keep(fj.philox_words(rng), rate, (b, hq, sq, sk)))
        assert abs(keep.mean() - (1 - rate)) < 0.02
    want_out, want = _float64(q, k, v, dout, mask, bias, alibi, keep, rate)
    _assert_close("out", out, want_out)
    for n, got, ref in zip(("dq", "dk", "dv", "dbias"), (dq, dk, dv, dbias), want):
        if ref is None:
            assert got is None
        else:
            _assert_close(n, got, ref)
    (fwd_kind, fwd), (bwd_kind, bwd) = reference_calls
    assert (fwd_kind, bwd_kind) == ("fwd", "bwd")
    names = {None: None, (1, 1): "11SS", (1, 4): "1HSS", (2, 1): "B1SS", (2, 4): "BHSS"}
    assert fwd.bias_shape == bwd.bias_shape == names[bias_rows]
    assert not fwd.bias_grad and bwd.bias_grad == (bias is not None)
    assert fwd.alibi == bwd.alibi == {None: None, (4,): "H", (2, 4): "BH"}[slopes]
    assert fwd.dropout_p == bwd.dropout_p == rate


def test_a_bias_that_is_not_differentiated_gets_no_dbias(reference_calls):
    """custom_vjp's `perturbed`: a constant bias (closed over, or a jit argument not differentiated)
    plans a backward without dbias, so no dS workspace; differentiating it asks for dbias."""
    q, k, v, dout, bias, _ = _inputs(1, 2, 64, 64, 4, 2, 32, jnp.float16, (1, 1))
    attention = lambda q, k, v, bias: fj.flash_attention(q, k, v, bias=bias, causal=True)
    jax.grad(_loss(lambda q, k, v: attention(q, k, v, bias)), argnums=(0, 1, 2))(q, k, v)
    jax.jit(jax.grad(lambda q, k, v, bias: _loss(lambda *x: attention(*x, bias))(q, k, v), argnums=(0, 1, 2)))(
        q, k, v, bias)
    assert [p.bias_grad for kind, p in reference_calls if kind == "bwd"] == [False, False]
    del reference_calls[:]
    dbias = jax.grad(lambda bias: _loss(lambda *x: attention(*x, bias))(q, k, v))(bias)
    assert [p.bias_grad for kind, p in reference_calls if kind == "bwd"] == [True]
    assert dbias.shape == bias.shape and dbias.dtype == bias.dtype and np.abs(_f64(dbias)).sum() > 0


def test_slopes_and_key_take_no_gradient(reference_calls):
    q, k, v, _, _, alibi = _inputs(2, 2, 64, 64, 4, 2, 32, jnp.bfloat16, slopes=(2, 4))
    loss = lambda alibi: _loss(lambda q, k, v: fj.flash_attention(q, k, v, alibi_slopes=alibi, dropout_rate=0.1,
                                                                  dropout_rng=KEY))(q, k, v)
    dslopes = jax.grad(loss)(alibi)
    assert dslopes.shape == alibi.shape and not np.any(np.asarray(dslopes))


def test_the_seed_is_drawn_from_the_key_inside_the_traced_function(reference_calls):
    """One trace serves every key (the seed is an operand, not a constant of the program); the same key
    gives the same seed, another key another; philox_seed_offset reads it back as two int64 below 2^62."""
    traces = []

    @jax.jit
    def step(q, k, v, key):
        traces.append(1)
        return fj.flash_attention(q, k, v, dropout_rate=0.5, dropout_rng=key)

    q, k, v = qkv(sq=64, sk=64, dtype=jnp.float16)
    first, again, other = (step(q, k, v, key) for key in (KEY, KEY, jax.random.key(4)))
    assert len(traces) == 1
    np.testing.assert_array_equal(first, again)
    assert not np.array_equal(first, other)
    words = np.asarray(fj.philox_words(KEY))
    seed, offset = fj.philox_seed_offset(KEY)
    assert (seed, offset) == fj.philox_seed_offset(jax.random.key_data(KEY))  # a raw key gives the same
    assert seed == int(words[0]) | int(words[1]) << 32 and offset == int(words[2]) | int(words[3]) << 32
    assert 0 <= seed < 2**62 and 0 <= offset < 2**62 and (seed, offset) != fj.philox_seed_offset(jax.random.key(4))


# ---------------------------------------------------------------- score terms and dropout under vmap

FOLDS = {
    # name: (term, its shape per instance, mapped, the folded (forward, backward) problem's bias_shape or alibi)
    "bias_11ss_shared": ("bias", (1, 1), False, ("11SS", "B1SS")),
    "bias_1hss_mapped": ("bias", (1, 4), True, ("BHSS", "BHSS")),
    "bias_b1ss_mapped": ("bias", (2, 1), True, ("B1SS", "B1SS")),
    "bias_bhss_shared": ("bias", (2, 4), False, ("BHSS", "BHSS")),
    "alibi_h_shared": ("alibi", (4,), False, ("H", "H")),
    "alibi_h_mapped": ("alibi", (4,), True, ("BH", "BH")),
    "alibi_bh_shared": ("alibi", (2, 4), False, ("BH", "BH")),
    "alibi_bh_mapped": ("alibi", (2, 4), True, ("BH", "BH")),
}
V = 3  # instances under vmap, each of batch 2


def _stacked(count, **kw):
    """q, k, v, dout of `count` instances, stacked on a leading axis."""
    return [jnp.stack(xs) for xs in zip(*(_inputs(s, **kw)[:4] for s in range(count)))]


def _assert_trees_close(got, want, tol=1e-2):
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), rtol=tol, atol=tol)


@pytest.mark.parametrize("name", sorted(FOLDS))
def test_vmap_folds_score_terms_with_the_batch(reference_calls, name):
    """One forward and one backward over the folded batch of V * 2; each instance's out, dq, dk, dv (and
    dbias, in the instance's bias shape) equal a separate call's."""
    term, shape, mapped, folded = FOLDS[name]
    sizes = dict(b=2, sq=64, sk=48, hq=4, hk=2, d=32, dtype=jnp.float16)
    qs, ks, vs, douts = _stacked(V, **sizes)
    lead = (V,) if mapped else ()
    if term == "bias":
        x = jax.random.normal(jax.random.PRNGKey(7), (*lead, *shape, 64, 48), jnp.float32).astype(jnp.float16)
    else:
        x = jax.random.uniform(jax.random.PRNGKey(7), (*lead, *shape), jnp.float32, 0.05, 0.5)

    def fwd_bwd(q, k, v, dout, x):
        if term == "bias":
            out, vjp = jax.vjp(lambda q, k, v, x: fj.flash_attention(q, k, v, causal=True, bias=x), q, k, v, x)
        else:
            out, vjp = jax.vjp(lambda q, k, v: fj.flash_attention(q, k, v, causal=True, alibi_slopes=x), q, k, v)
        return out, vjp(dout)

    batched = jax.jit(jax.vmap(fwd_bwd, in_axes=(0, 0, 0, 0, 0 if mapped else None)))(qs, ks, vs, douts, x)
    attr = "bias_shape" if term == "bias" else "alibi"
    assert {(kind, getattr(p, attr)) for kind, p in reference_calls if p.batch == V * 2} == \
        {("fwd", folded[0]), ("bwd", folded[1])}
    for i in range(V):
        single = fwd_bwd(qs[i], ks[i], vs[i], douts[i], x[i] if mapped else x)
        _assert_trees_close(jax.tree_util.tree_map(lambda y: y[i], batched), single)


def test_vmap_over_the_bias_alone_broadcasts_q_k_v(reference_calls):
    q, k, v, dout, _, _ = _inputs(3, 2, 64, 64, 4, 2, 32, jnp.float16)
    biases = jax.random.normal(jax.random.PRNGKey(4), (V, 1, 4, 64, 64), jnp.float32).astype(jnp.float16)
    run = _fwd_bwd(causal=True)
    batched = jax.vmap(run, in_axes=(None, None, None, 0, None))(q, k, v, biases, dout)
    assert {(kind, p.bias_shape) for kind, p in reference_calls if p.batch == V * 2} == {("fwd", "BHSS"), ("bwd", "BHSS")}
    assert batched[1][3].shape == biases.shape
    for i in range(V):
        _assert_trees_close(jax.tree_util.tree_map(lambda y: y[i], batched), run(q, k, v, biases[i], dout))


def test_vmap_keeps_a_constant_shared_bias_unfolded(reference_calls):
    """A bias [1, ..] that is neither mapped nor differentiated is read by every entry of the folded
    batch, in the backward too."""
    qs, ks, vs, douts = _stacked(V, b=2, sq=64, sk=64, hq=4, hk=2, d=32, dtype=jnp.float16)
    bias = rand((1, 4, 64, 64), jnp.float16)
    grads = jax.vmap(jax.grad(_loss(lambda q, k, v: fj.flash_attention(q, k, v, bias=bias)), argnums=(0, 1, 2)))(
        qs, ks, vs)
    assert {(kind, p.bias_shape, p.bias_grad) for kind, p in reference_calls if p.batch == V * 2} == \
        {("fwd", "1HSS", False), ("bwd", "1HSS", False)}
    loop = jax.grad(_loss(lambda q, k, v: fj.flash_attention(q, k, v, bias=bias)), argnums=(0, 1, 2))(qs[1], ks[1], vs[1])
    _assert_trees_close([g[1] for g in grads], loop)


def test_grad_of_vmap_sums_each_instances_dbias(reference_calls):
    qs, ks, vs, _ = _stacked(V, b=2, sq=64, sk=64, hq=4, hk=2, d=32, dtype=jnp.float16)
    bias = rand((1, 1, 64, 64), jnp.float16)

    def loss(qs, ks, vs, bias):
        outs = jax.vmap(lambda q, k, v: fj.flash_attention(q, k, v, bias=bias))(qs, ks, vs)
        return (outs.astype(jnp.float32) ** 2).sum()

    dbias = jax.jit(jax.grad(loss, argnums=3))(qs, ks, vs, bias)
    single = jax.grad(lambda q, k, v, bias: loss(q[None], k[None], v[None], bias), argnums=3)
    want = sum(_f64(single(qs[i], ks[i], vs[i], bias)) for i in range(V))
    assert dbias.shape == bias.shape
    _assert_close("dbias", dbias, want)


def test_vmap_with_one_key_is_one_call_over_the_folded_batch(reference_calls):
    """An unmapped key: one seed serves the folded call, so the vmapped result is exactly that of one
    call over the V * B batch with the same key."""
    qs, ks, vs, douts = _stacked(V, b=2, sq=64, sk=64, hq=4, hk=2, d=32, dtype=jnp.float16)
    bias = rand((1, 4, 64, 64), jnp.float16)

    def fwd_bwd(q, k, v, dout, bias):
        attention = lambda q, k, v, bias: fj.flash_attention(q, k, v, bias=bias, dropout_rate=0.25, dropout_rng=KEY)
        out, vjp = jax.vjp(attention, q, k, v, bias)
        return out, vjp(dout)

    out, (dq, dk, dv, dbias) = jax.vmap(fwd_bwd, in_axes=(0, 0, 0, 0, None))(qs, ks, vs, douts, bias)
    assert {(kind, p.batch) for kind, p in reference_calls if p.batch > 2} == {("fwd", V * 2), ("bwd", V * 2)}
    merged = [x.reshape(V * 2, *x.shape[2:]) for x in (qs, ks, vs, douts)]
    whole_out, (whole_dq, whole_dk, whole_dv, _) = fwd_bwd(*merged, jnp.broadcast_to(bias, (V * 2, 4, 64, 64)))
    for got, want in ((out, whole_out), (dq, whole_dq), (dk, whole_dk), (dv, whole_dv)):
        np.testing.assert_allclose(np.asarray(got.reshape(want.shape), np.float32), np.asarray(want, np.float32),
                                   rtol=1e-3, atol=1e-3)
    assert dbias.shape == (V, 1, 4, 64, 64)


def test_vmap_over_keys_runs_the_instances_one_after_another(reference_calls):
    """A key per instance: each instance is its own call with its own seed (jax.lax.map), so the result
    equals a loop over the instances."""
    qs, ks, vs, douts = _stacked(V, b=2, sq=64, sk=64, hq=4, hk=2, d=32, dtype=jnp.float16)
    bias = rand((1, 1, 64, 64), jnp.float16)
    keys = jax.random.split(KEY, V)

    def fwd_bwd(q, k, v, dout, bias, key):
        attention = lambda q, k, v, bias: fj.flash_attention(q, k, v, bias=bias, causal=True, dropout_rate=0.25,
                                                             dropout_rng=key)
        out, vjp = jax.vjp(attention, q, k, v, bias)
        return out, vjp(dout)

    batched = jax.jit(jax.vmap(fwd_bwd, in_axes=(0, 0, 0, 0, None, 0)))(qs, ks, vs, douts, bias, keys)
    assert {kind for kind, _ in reference_calls} == {"fwd", "bwd"}
    assert {p.batch for _, p in reference_calls} == {2}
    for i in range(V):
        single = fwd_bwd(qs[i], ks[i], vs[i], douts[i], bias, keys[i])
        _assert_trees_close(jax.tree_util.tree_map(lambda y: y[i], batched), single)
    assert not np.array_equal(batched[0][0], batched[0][1])


def test_vmap_of_varlen_with_slopes_and_a_key_matches_a_loop(reference_calls):
    lengths = [40, 24]
    cu = jnp.array(np.concatenate([[0], np.cumsum(lengths)]), jnp.int32)
    qs, ks, vs = (x[:, 0] for x in _stacked(2, b=1, sq=64, sk=64, hq=4, hk=2, d=32, dtype=jnp.float16)[:3])
    slopes = jax.random.uniform(jax.random.PRNGKey(3), (2, 4), jnp.float32, 0.05, 0.5)
    attention = lambda q, k, v: fj.flash_attention_varlen(q, k, v, cu, cu, 40, 40, alibi_slopes=slopes,
                                                          dropout_rate=0.2, dropout_rng=KEY)
    grad = jax.grad(_loss(attention), argnums=(0, 1, 2))
    grads = jax.jit(jax.vmap(grad))(qs, ks, vs)
    assert {(kind, p.alibi, p.dropout_p) for kind, p in reference_calls} == \
        {("varlen_fwd", "BH", 0.2), ("varlen_bwd", "BH", 0.2)}
    loop = jax.jit(grad)(qs[1], ks[1], vs[1])
    _assert_trees_close([g[1] for g in grads], loop)


# ------------------------------------------------------------------------------ lowering, terms


def _custom_call_line(text, target):
    return next(line for line in text.splitlines() if f"custom_call @{target}(" in line)


def _signature(line):
    """'(operand types) -> (result types)' of a custom call line."""
    return re.search(r"\} : (\(.*\) -> \(.*\))$", line.strip()).group(1)


def _holds(text, words):
    """Whether the lowered text holds the program words (printed as a list or as hex)."""
    listed = f"dense<[{', '.join(str(w) for w in words)}]> : tensor<{len(words)}xi64>"
    return listed in text or f'dense<"0x{words.astype("<i8").tobytes().hex().upper()}">' in text


def test_lowering_of_grad_holds_bias_seed_and_dbias(pretend_gpu):
    """Both calls take the bias and one seed value (drawn once, in the traced function); the backward
    returns dbias before its workspace, which holds dS. A constant bias: no dbias, a smaller workspace."""
    q, k, v = qkv()
    bias = rand((1, 4, 128, 128))
    attention = lambda q, k, v, bias: fj.flash_attention(q, k, v, bias=bias, causal=True, dropout_rate=0.1,
                                                         dropout_rng=KEY)
    loss = lambda q, k, v, bias: attention(q, k, v, bias).astype(jnp.float32).sum()
    qkv_types = "tensor<2x128x4x64xbf16>, tensor<2x128x2x64xbf16>, tensor<2x128x2x64xbf16>"
    workspaces = []
    for argnums in ((0, 1, 2, 3), (0, 1, 2)):
        text = jax.jit(jax.grad(loss, argnums=argnums)).trace(q, k, v, bias).lower(
            lowering_platforms=("cuda",)).as_text()
        fwd, bwd = (_custom_call_line(text, f"fmha_rt_{kind}") for kind in ("fwd", "bwd"))
        assert _signature(fwd) == (f"({qkv_types}, tensor<1x4x128x128xbf16>, tensor<4xui32>) -> "
                                   "(tensor<2x128x4x64xbf16>, tensor<2x4x128xf32>)")
        dbias = ", tensor<1x4x128x128xbf16>" if len(argnums) == 4 else ""
        operands, results = _signature(bwd).split(" -> ")
        assert operands == (f"(tensor<2x128x4x64xbf16>, {qkv_types}, tensor<2x128x4x64xbf16>, tensor<2x4x128xf32>, "
                            "tensor<1x4x128x128xbf16>, tensor<4xui32>)")
        workspace = re.fullmatch(rf"\({qkv_types}{dbias}, tensor<(\d+)xui8>\)", results)
        assert workspace, results
        workspaces.append(int(workspace.group(1)))
        seeds = [re.search(rf"@fmha_rt_{kind}\((.*?)\)", line).group(1).split(", ")[-1] for kind, line in
                 (("fwd", fwd), ("bwd", bwd))]
        assert seeds[0] == seeds[1]  # one value feeds both calls
        options = fj.CallOptions(None, fj.resolve_mask(True, (-1, -1), None, "top_left"), False, ARCH, dropout_p=0.1)
        p = fj.batch_problem(q, k, v, options, bias, None, bias_grad=len(argnums) == 4)
        assert _holds(text, xla_program.forward(p, ARCH).encode()) and _holds(text, xla_program.backward(p, ARCH).encode())
        assert workspaces[-1] == portable.bwd_workspace(p, ARCH).total_bytes
    ds = portable.bwd_workspace(problem(batch=2, seqlen_q=128, seqlen_k=128, bias_shape="1HSS", bias_grad=True,
                                             window_right=0, dropout_p=0.1), ARCH).region("ds")
    assert workspaces[0] - workspaces[1] >= ds.nbytes


def test_lowering_of_slopes_and_of_a_folded_bias(pretend_gpu):
    q, k, v = qkv()
    slopes = jax.random.uniform(jax.random.PRNGKey(0), (4,), jnp.float32)
    text = jax.jit(lambda q, k, v: fj.flash_attention(q, k, v, alibi_slopes=slopes)).trace(q, k, v).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "tensor<4xf32>) -> (tensor<2x128x4x64xbf16>, tensor<2x4x128xf32>)" in _custom_call_line(text, "fmha_rt_fwd")
    stacked = [jnp.stack([x, x, x]) for x in (q, k, v)]
    bias = rand((1, 1, 128, 128))
    grad = jax.vmap(jax.grad(lambda q, k, v, bias: fj.flash_attention(q, k, v, bias=bias).astype(jnp.float32).sum(),
                             argnums=(0, 3)), in_axes=(0, 0, 0, None))
    text = jax.jit(grad).trace(*stacked, bias).lower(lowering_platforms=("cuda",)).as_text()
    fwd, bwd = (_signature(_custom_call_line(text, f"fmha_rt_{kind}")) for kind in ("fwd", "bwd"))
    assert fwd.startswith("(tensor<6x128x4x64xbf16>") and "tensor<1x1x128x128xbf16>) ->" in fwd  # shared, as it is
    assert "tensor<6x1x128x128xbf16>) ->" in bwd and "tensor<6x1x128x128xbf16>, tensor<" in bwd.split(" -> ")[1]


# ------------------------------------------------- the sm_90 plans run by the kernels, interpreted


@pytest.fixture(scope="module")
def interpreter():
    pytest.importorskip("torch")
    import interpret_exec
    return interpret_exec


def _run_planned(ie, planned, arch, *operands):
    """What the handler does with a program, on the host: one byte buffer per operand (a copy) and per
    result (0xFF bytes: NaN in every float dtype, so an unwritten element shows), the zero fills, and each
    launch's placeholder pointers replaced by views of those buffers at their offsets; the launches then
    run under the Triton interpreter. Returns the results."""
    import torch
    buffers = [torch.from_numpy(np.frombuffer(np.ascontiguousarray(x).tobytes(), np.uint8).copy()) for x in operands]
    buffers += [torch.full((b.nbytes,), 0xFF, dtype=torch.uint8) for b in planned.results]
    for fill in planned.zero_fills:
        buffers[fill.value][fill.offset:fill.offset + fill.nbytes] = 0
    variants = portable.variant_map(arch)
    launches = []
    for launch in planned.launches:
        signature, args = variants[launch.variant]["signature"], dict(launch.args)
        for name, value in launch.args.items():
            if isinstance(value, Pointer) and value.address:
                buffer, offset = xla_program.resolve_placeholder(value.address, len(buffers), name)
                args[name] = buffers[buffer][offset:].view(ie._POINTER_DTYPES[signature[name]])
        launches.append(Launch(launch.variant, launch.grid, args))
    ie.run([launch for launch in launches if all(launch.grid)], arch)
    return tuple(np.frombuffer(buf.numpy().tobytes(), jnp.dtype(b.dtype)).reshape(b.shape)
                 for b, buf in zip(planned.results, buffers[planned.operands:]))


@pytest.fixture
def interpreted_calls(pretend_gpu, monkeypatch, interpreter):
    """The custom calls run by the kernels of their sm_90 plans under the Triton interpreter (fp16 only:
    the interpreter mishandles bf16), through jax.pure_callback; records (kind, problem) of every call."""
    made = []

    def custom_call(kind, problem, arch, operands):
        made.append((kind, problem))
        plan = xla_program.planned_backward if kind.endswith("bwd") else xla_program.planned_forward
        planned = plan(problem, arch)
        results = [jax.ShapeDtypeStruct(b.shape, jnp.dtype(b.dtype)) for b in planned.results]
        return jax.pure_callback(functools.partial(_run_planned, interpreter, planned, arch), results, *operands,
                                 vmap_method="sequential")

    monkeypatch.setattr(fj, "xla_custom_call", custom_call)
    return made


def _kernel_mask(ie, rng, rate, b, hq, sq, sk):
    """The keep mask the kernels draw for `rng`'s seed and offset (given by value), bool [B, Hq, Sq, Sk]."""
    seed, offset = fj.philox_seed_offset(rng)
    p = AttentionProblem(batch=b, seqlen_q=sq, seqlen_k=sk, heads_q=hq, heads_k=hq, head_dim_qk=32, head_dim_v=32,
                         dtype="fp16", dropout_p=rate)
    return ie.dropout_mask(p, {"philox_seed": seed, "philox_offset": offset}, arch=ARCH).numpy()


KERNEL_CASES = {
    # name: (Sk, bias rows or None, slopes shape or None, dropout rate, mask options)
    "bias_1hss_unaligned_keys": (37, (1, 2), None, 0.0, {}),
    "bias_b1ss_causal_dropout": (48, (2, 1), None, 0.2, {"causal": True}),
    "alibi_bh_window_br": (56, None, (2, 2), 0.0, {"window": (8, 4), "causal_alignment": "bottom_right"}),
}


@pytest.mark.parametrize("name", sorted(KERNEL_CASES))
def test_the_kernels_through_the_programs_buffers_match_the_float64_reference(interpreted_calls, interpreter, name):
    """The real kernels on the buffers XLA would pass: a bias padded to 8 keys and its dbias cut back,
    slopes, and the uint32 seed operand read as the int64 pair that philox_seed_offset gives."""
    sk, bias_rows, slopes, rate, mask = KERNEL_CASES[name]
    b, sq, hq = 2, 40, 2
    q, k, v, dout, bias, alibi = _inputs(7, b, sq, sk, hq, 2, 32, jnp.float16, bias_rows, slopes)
    rng = jax.random.key(11) if rate else None
    out, (dq, dk, dv, dbias) = _fwd_bwd(**mask, alibi_slopes=alibi, dropout_rate=rate, dropout_rng=rng)(
        q, k, v, bias, dout)
    keep = _kernel_mask(interpreter, rng, rate, b, hq, sq, sk).astype(bool) if rate else None
    want_out, want = _float64(q, k, v, dout, mask, bias, alibi, keep, rate)
    _assert_close("out", out, want_out)
    for n, got, ref in zip(("dq", "dk", "dv", "dbias"), (dq, dk, dv, dbias), want):
        if ref is not None:
            _assert_close(n, got, ref)
    assert [kind for kind, _ in interpreted_calls] == ["fwd", "bwd"]


def test_the_kernels_under_vmap_with_a_shared_bias_and_one_key(interpreted_calls, interpreter):
    """V instances folded into one call: each instance's dbias in its [1, Hq, ..] shape, and its dropout
    mask the folded call's rows of that instance, which differ from what a call on it alone draws."""
    b, s, hq, rate = 2, 32, 2, 0.25
    qs, ks, vs, douts = _stacked(2, b=b, sq=s, sk=s, hq=hq, hk=1, d=32, dtype=jnp.float16)
    bias = rand((1, hq, s, s), jnp.float16)
    rng = jax.random.key(5)
    outs, grads = jax.vmap(_fwd_bwd(dropout_rate=rate, dropout_rng=rng), in_axes=(0, 0, 0, None, 0))(
        qs, ks, vs, bias, douts)
    assert {(kind, p.batch, p.bias_shape) for kind, p in interpreted_calls if p.batch == 2 * b} == \
        {("fwd", 4, "1HSS"), ("bwd", 4, "BHSS")}
    keep = _kernel_mask(interpreter, rng, rate, 2 * b, hq, s, s).astype(bool)
    for i in range(2):
        want_out, want = _float64(qs[i], ks[i], vs[i], douts[i], {}, bias, None, keep[i * b:(i + 1) * b], rate)
        _assert_close("out", outs[i], want_out)
        for n, got, ref in zip(("dq", "dk", "dv", "dbias"), grads, want):
            _assert_close(n, got[i], ref)
    alone = _kernel_mask(interpreter, rng, rate, b, hq, s, s).astype(bool)
    assert np.array_equal(alone, keep[:b]) and not np.array_equal(alone, keep[b:])


def test_the_kernels_for_varlen_with_slopes_and_dropout(interpreted_calls, interpreter):
    """Sequence b's dropout mask is [b, :, :len_q, :len_k] of the mask for the [B, max_seqlen] shapes."""
    lengths_q, lengths_k, hq, rate = [30, 0, 17], [21, 9, 40], 2, 0.2
    cu_q, cu_k = (np.concatenate([[0], np.cumsum(n)]).astype(np.int32) for n in (lengths_q, lengths_k))
    keys = jax.random.split(jax.random.PRNGKey(8), 4)
    q, dout = (jax.random.normal(key, (cu_q[-1], hq, 32), jnp.float32).astype(jnp.float16) for key in keys[:2])
    k, v = (jax.random.normal(key, (cu_k[-1], 1, 32), jnp.float32).astype(jnp.float16) for key in keys[2:])
    slopes = jax.random.uniform(jax.random.PRNGKey(9), (3, hq), jnp.float32, 0.05, 0.5)
    rng = jax.random.key(12)
    kw = {"causal": True, "causal_alignment": "bottom_right", "alibi_slopes": slopes, "dropout_rate": rate,
          "dropout_rng": rng}

    @jax.jit
    def run(q, k, v, dout):
        f = lambda q, k, v: fj.flash_attention_varlen(q, k, v, jnp.asarray(cu_q), jnp.asarray(cu_k), 30, 40, **kw)
        out, vjp = jax.vjp(f, q, k, v)
        return out, vjp(dout)

    out, grads = run(q, k, v, dout)
    mask = _kernel_mask(interpreter, rng, rate, 3, hq, 30, 40).astype(bool)
    keep = [mask[i, :, :lq, :lk] for i, (lq, lk) in enumerate(zip(lengths_q, lengths_k))]
    opts = dict(window=(-1, 0), bottom_right=True, alibi_slopes=_f64(slopes), dropout_p=rate, dropout_keep=keep)
    want_out, _ = reference.mha_varlen_fwd_ref(_f64(q), _f64(k), _f64(v), cu_q, cu_k, **opts)
    want = reference.mha_varlen_bwd_ref(_f64(dout), _f64(q), _f64(k), _f64(v), cu_q, cu_k, **opts)
    _assert_close("out", out, want_out)
    for n, got, ref in zip(("dq", "dk", "dv"), grads, want):
        _assert_close(n, got, ref)
    assert [(kind, p.alibi) for kind, p in interpreted_calls] == [("varlen_fwd", "BH"), ("varlen_bwd", "BH")]


def test_the_kernels_at_head_dims_that_are_not_multiples_of_8(interpreted_calls, interpreter):
    """Zero-padded q, k, v through the real kernels: a batch call with a bias (Dqk 12, Dv 20) and a varlen
    call (Dqk = Dv = 5), against the float64 reference at the caller's head dims."""
    seed = random.randrange(2**31)
    b, sq, sk, hq = 2, 40, 33, 2
    q, k, v = qkv(b, sq, sk, hq, 1, 12, dv=20, dtype=jnp.float16, seed=seed)
    keys = jax.random.split(jax.random.PRNGKey(seed + 1), 2)
    dout = jax.random.normal(keys[0], (b, sq, hq, 20), jnp.float32).astype(jnp.float16)
    bias = jax.random.normal(keys[1], (1, hq, sq, sk), jnp.float32).astype(jnp.float16)
    out, (dq, dk, dv, dbias) = _fwd_bwd(causal=True)(q, k, v, bias, dout)
    want_out, want = _float64(q, k, v, dout, {"causal": True}, bias)
    _assert_close(f"out (seed {seed})", out, want_out)
    for n, got, ref in zip(("dq", "dk", "dv", "dbias"), (dq, dk, dv, dbias), want):
        _assert_close(f"{n} (seed {seed})", got, ref)
    _, lse = jax.jit(lambda q, k, v, bias: fj.flash_attention(q, k, v, bias=bias, causal=True, return_lse=True))(
        q, k, v, bias)
    _, want_lse = reference.mha_fwd_ref(_f64(q), _f64(k), _f64(v), window=(-1, 0), bias=_f64(bias))
    _assert_close(f"lse (seed {seed})", lse, want_lse)

    lengths = [23, 0, 17]
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    keys = jax.random.split(jax.random.PRNGKey(seed + 2), 4)
    q, k, v, dout = (jax.random.normal(key, (cu[-1], hq, 5), jnp.float32).astype(jnp.float16) for key in keys)

    @jax.jit
    def run(q, k, v, dout):
        f = lambda q, k, v: fj.flash_attention_varlen(q, k, v, jnp.asarray(cu), jnp.asarray(cu), 23, 23, causal=True)
        out, vjp = jax.vjp(f, q, k, v)
        return out, vjp(dout)

    out, grads = run(q, k, v, dout)
    opts = {"window": (-1, 0)}
    want_out, _ = reference.mha_varlen_fwd_ref(_f64(q), _f64(k), _f64(v), cu, cu, **opts)
    want = reference.mha_varlen_bwd_ref(_f64(dout), _f64(q), _f64(k), _f64(v), cu, cu, **opts)
    _assert_close(f"varlen out (seed {seed})", out, want_out)
    for n, got, ref in zip(("dq", "dk", "dv"), grads, want):
        _assert_close(f"varlen {n} (seed {seed})", got, ref)
    dims = [(kind, p.head_dim_qk, p.head_dim_v) for kind, p in interpreted_calls]
    assert dims == [("fwd", 16, 24), ("bwd", 16, 24), ("fwd", 16, 24), ("varlen_fwd", 8, 8), ("varlen_bwd", 8, 8)]


def test_a_symbolic_zero_cotangent_needs_no_backward(pretend_gpu):
    """symbolic_zeros: a backward whose output cotangent is a symbolic zero returns zeros (None) at once."""
    attention = fj.batch_attention(fj.CallOptions(None, fj.resolve_mask(False, (-1, -1), None, "top_left"), False, ARCH))
    q, k, v = qkv()
    residuals = (q, k, v, q, jnp.zeros((2, 4, 128), jnp.float32), None, None, None, fj.BiasGrad(False))
    assert attention.bwd(residuals, SymbolicZero(jax.core.ShapedArray(q.shape, q.dtype))) == (None,) * 6
