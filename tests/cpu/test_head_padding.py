"""Head dims that are not multiples of 8: the padding copies alone under the CPU interpreter, their
planning (workspace and forward-scratch regions), the alignment rule their arguments follow, and the
runtime's integration (fmha_rt/plan/head_padding.py).

Attention through the padding (pad -> forward/backward -> unpad against the float64 reference) runs in
test_portable_kernels.py, whose cases include padded head dims. Inputs are fp16 (the interpreter
mishandles bf16).
"""
import itertools

import interpret_exec as ie
import pytest
import torch

from fmha_rt.runtime import executor
from fmha_rt.plan import head_padding
from fmha_rt.plan import layout
from fmha_rt.plan import portable as pp
from fmha_rt.runtime import registry as registry_module
from fmha_rt.errors import FmhaValueError
from fmha_rt.runtime.packing import Pointer
from fmha_rt.plan.operands import Operand, Operands
from fmha_rt.plan.problem import AttentionProblem

SENTINEL = 777.0  # fp16-exact: memory a copy must not touch


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _strided(gen, shape, width, lead_offset=1):
    """A [B, S, H, d] fp16 view with awkward strides: the d columns of `width`-wide rows, sequences
    laid out first ([S, B, H, width] transposed) and the view starting `lead_offset` rows in, so that no
    stride is a multiple of 8 and the data starts off any 16-byte boundary."""
    b, s, h, d = shape
    base = torch.randn(s + lead_offset, b, h, width, generator=gen).to(torch.float16)
    return base[lead_offset:, :, :, :d].transpose(0, 1)


def _padded_regions(problem, pass_name):
    """The '<name>_padded' regions of a pass's scratch, NaN-poisoned."""
    scratch = pp.fwd_scratch(problem) if pass_name == "fwd" else pp.bwd_workspace(problem, pp.INTERPRET_ARCH)
    return {name: view for name, view in ie.scratch_tensors(scratch).items() if name.endswith("_padded")}


# ------------------------------------------------------------------------------------ the copies


@pytest.mark.parametrize("d", [1, 5, 13, 29, 100])
def test_widen_copies_values_and_zero_fills_the_padding_columns(d):
    # 70 x 4 (row, head) pairs per sequence: two programs of 256 pairs. Padded widths up to 32 move in
    # narrow tiles (29: four column steps), 104 in wide ones (two row blocks, four column steps).
    b, s, hq, hk = 2, 70, 4, 1
    problem = AttentionProblem(b, s, s - 9, hq, hk, d, d, "fp16")
    gen = _gen(d)
    inputs = {"q": _strided(gen, (b, s, hq, d), d + 2), "k": _strided(gen, (b, s - 9, hk, d), d + 6),
              "v": _strided(gen, (b, s - 9, hk, d), 2 * d + 1, lead_offset=3)}
    out = torch.zeros(b, s, hq, d, dtype=torch.float16)
    padded = _padded_regions(problem, "fwd")
    tensors = ie.operands_of(**inputs, out=out, **padded)
    before, after, planned = head_padding.for_pass(problem, tensors, "fwd")
    assert [launch.variant for launch in before] == ["fmha_pad_widen_fp16"] * 3
    assert [launch.variant for launch in after] == ["fmha_pad_narrow_fp16"]
    assert before[0].grid == (2, b, 1) and before[0].args["pitch_h"] % 8
    ie.run(before)
    width = layout.padded_head_dim(d)
    for name, caller in inputs.items():
        buffer = padded[f"{name}_padded"]
        assert getattr(planned, name).pointer is buffer and getattr(planned, name).strides == buffer.stride()
        assert getattr(tensors, name).pointer is caller, "the call's operands are left as they are"
        assert buffer.shape[-1] == width and torch.equal(buffer[..., :d], caller)
        assert torch.equal(buffer[..., d:], torch.zeros_like(buffer[..., d:])), f"{name}: padding columns not zero"


@pytest.mark.parametrize("d", [5, 13, 45])
def test_narrow_writes_only_the_real_columns(d):
    b, sq, sk, h = 2, 50, 61, 3
    problem = AttentionProblem(b, sq, sk, h, h, d, d, "fp16")
    gen = _gen(10 + d)
    wide = {name: torch.full((b, s, h, d + 5), SENTINEL, dtype=torch.float16)
            for name, s in (("dq", sq), ("dk", sk), ("dv", sk))}
    grads = {name: w[..., :d] for name, w in wide.items()}
    padded = _padded_regions(problem, "bwd")
    for name in grads:  # every column holds data, the padding ones too: only d of them may travel
        padded[f"{name}_padded"].copy_(torch.randn(padded[f"{name}_padded"].shape, generator=gen))
    tensors = ie.operands_of(q=grads["dq"], k=grads["dk"], v=grads["dv"], out=grads["dq"], dout=grads["dq"],
                              **grads, **padded)
    _, after, _ = head_padding.for_pass(problem, tensors, "bwd")
    assert [launch.args["Padded"] is padded[f"{n}_padded"] for launch, n in zip(after, grads)] == [True] * 3
    ie.run(after)
    for name, w in wide.items():
        assert torch.equal(w[..., :d], padded[f"{name}_padded"][..., :d]), name
        assert bool((w[..., d:] == SENTINEL).all()), f"{name}: a column past the head dim was written"


def test_varlen_copies_leave_rows_outside_every_sequence_alone():
    lens, gaps, h, d = [0, 7, 130, 1], [2, 0, 5, 3], 2, 5
    starts, pos = [], 0
    for n, gap in zip(lens, gaps):
        starts.append(pos + gap)
        pos += gap + n
    cu = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32)
    seqstart = torch.tensor(starts + [pos], dtype=torch.int32)
    problem = AttentionProblem(len(lens), max(lens), max(lens), h, h, d, d, "fp16", varlen=True, total_q=pos,
                               total_k=pos)
    gen = _gen(20)
    q = torch.randn(pos, h, d + 1, generator=gen).to(torch.float16)[..., :d]
    out_wide = torch.full((pos, h, 8), SENTINEL, dtype=torch.float16)
    padded = _padded_regions(problem, "fwd")
    padded["out_padded"].copy_(torch.randn(padded["out_padded"].shape, generator=gen))
    tensors = ie.operands_of(q=q, k=q, v=q, out=out_wide[..., :d], cu_seqlens_q=cu, cu_seqlens_k=cu,
                              seqstart_q=seqstart, seqstart_k=seqstart, **padded)
    before, after, _ = head_padding.for_pass(problem, tensors, "fwd")
    assert before[0].grid == (-(-130 * h // head_padding.PAD_TILE.block_m), len(lens), 1)
    ie.run(before + after)
    rows = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lens)])
    gap = torch.ones(pos, dtype=torch.bool)
    gap[rows] = False
    q_padded = padded["q_padded"]
    assert torch.equal(q_padded[rows, :, :d], q[rows]) and bool((q_padded[rows, :, d:] == 0).all())
    assert bool(q_padded[gap].isnan().all()), "a padded row outside every sequence was written"
    assert torch.equal(out_wide[rows, :, :d], padded["out_padded"][rows, :, :d])
    assert bool((out_wide[gap] == SENTINEL).all()) and bool((out_wide[:, :, d:] == SENTINEL).all())


# -------------------------------------------------------------------------------------- planning


def test_no_padding_for_head_dims_that_are_multiples_of_8():
    problem = AttentionProblem(2, 40, 40, 4, 2, 40, 8, "fp16")
    x = torch.zeros(2, 40, 4, 40, dtype=torch.float16)
    tensors = ie.operands_of(q=x, k=x, v=x, out=x, dout=x, dq=x, dk=x, dv=x)
    for pass_name in ("fwd", "bwd"):
        assert layout.padded_tensors(problem, pass_name) == []
        assert head_padding.for_pass(problem, tensors, pass_name) == ([], [], tensors)
    assert pp.fwd_scratch(problem).total_bytes == 0
    assert [r.name for r in pp.bwd_workspace(problem, pp.INTERPRET_ARCH, pp.DQ_ATOMIC).regions] == ["delta", "lse2", "dq_acc"]


def test_padding_regions_follow_each_head_dim():
    # Dqk=13 pads to 16 (q, k; dq, dk), Dv=40 does not: B=2, Sq=30, Sk=50, Hq=4, Hk=2, fp16.
    problem = AttentionProblem(2, 30, 50, 4, 2, 13, 40, "fp16", bias_shape="11SS", bias_grad=True)
    q_bytes, k_bytes = 2 * 2 * 30 * 4 * 16, 2 * 2 * 50 * 2 * 16
    scratch = pp.fwd_scratch(problem)
    assert [(r.name, r.offset, r.nbytes, r.shape, r.dtype, r.zero_init) for r in scratch.regions] == [
        ("q_padded", 0, q_bytes, (2, 30, 4, 16), "fp16", False), ("k_padded", q_bytes, k_bytes, (2, 50, 2, 16), "fp16", False)]
    assert scratch.total_bytes == q_bytes + k_bytes and not scratch.needs_zeroing
    # The backward's own regions keep their offsets; the padded buffers follow, 256-byte aligned.
    plain = pp.bwd_workspace(AttentionProblem(2, 30, 50, 4, 2, 16, 40, "fp16", bias_shape="11SS", bias_grad=True),
                             pp.INTERPRET_ARCH, pp.DQ_ATOMIC)
    ws = pp.bwd_workspace(problem, pp.INTERPRET_ARCH, pp.DQ_ATOMIC)
    assert ws.regions[:4] == plain.regions
    padded = ws.regions[4:]
    assert [(r.name, r.nbytes) for r in padded] == [("q_padded", q_bytes), ("k_padded", k_bytes),
                                                     ("dq_padded", q_bytes), ("dk_padded", k_bytes)]
    assert padded[0].offset == plain.total_bytes and all(r.offset % layout.WORKSPACE_ALIGN == 0 for r in padded)
    assert ws.total_bytes == plain.total_bytes + 2 * q_bytes + 2 * k_bytes
    # Dv=5 alone: v, out (backward input), dout and dv pad; varlen buffers are [total, H, 8].
    varlen = AttentionProblem(3, 20, 20, 2, 2, 32, 5, "fp16", varlen=True, total_q=41, total_k=37, deterministic=True)
    assert [(r.name, r.shape) for r in pp.bwd_workspace(varlen, "sm_90").regions if r.name.endswith("_padded")] == [
        ("v_padded", (37, 2, 8)), ("out_padded", (41, 2, 8)), ("dout_padded", (41, 2, 8)), ("dv_padded", (37, 2, 8))]


def test_padding_plan_needs_the_padded_buffers():
    problem = AttentionProblem(1, 16, 16, 1, 1, 5, 5, "fp16")
    x = torch.zeros(1, 16, 1, 5, dtype=torch.float16)
    with pytest.raises(FmhaValueError, match="q_padded"):
        head_padding.for_pass(problem, ie.operands_of(q=x, k=x, v=x, out=x), "fwd")


# ------------------------------------------------------------------------------------- alignment


def _pad_variant(arch="sm_90"):
    return pp.variant_map(arch)[head_padding.pad_key("fp16", True)]


def test_build_promises_nothing_about_the_callers_side():
    from kernels.build import divisibility_attrs

    signature = _pad_variant()["signature"]
    attrs = {name: divisibility_attrs(signature).get((i,)) for i, name in enumerate(signature)}
    assert attrs["UnalignedArray"] is None and attrs["Padded"] == [["tt.divisibility", 16]]
    assert all(attrs[n] is None for n in ("pitch_b", "pitch_s", "pitch_h"))
    assert attrs["stride_padded_b"] == attrs["stride_padded_s"] == [["tt.divisibility", 8]]
    # The attention kernels keep every promise.
    fwd = pp.variant_map("sm_90")[pp.fwd_key("fp16", (32, 32), pp.BIAS_NONE, False)]["signature"]
    promised = divisibility_attrs(fwd)
    assert all((i,) in promised for i, (n, kind) in enumerate(fwd.items()) if kind.startswith("*") or n.startswith("stride_"))


def test_executor_checks_element_alignment_of_unaligned_pointers():
    entry = registry_module.registry().entry("sm_90", head_padding.pad_key("fp16", True))
    args = {slot.name: 0 for slot in entry.params}
    args.update({name: None for name in ("CuSeqlens", "Seqstart", *registry_module.SCRATCH_POINTERS)})
    args.update(UnalignedArray=Pointer(0x1002), Padded=Pointer(0x1100), pitch_b=5 * 77, pitch_s=15, pitch_h=5,
                stride_padded_b=8 * 77, stride_padded_s=24)
    executor.check_alignment(entry, args)
    with pytest.raises(FmhaValueError, match="UnalignedArray=0x1001 is not 2-byte aligned"):
        executor.check_alignment(entry, dict(args, UnalignedArray=Pointer(0x1001)))
    with pytest.raises(FmhaValueError, match="Padded=0x1102 is not 16-byte aligned"):
        executor.check_alignment(entry, dict(args, Padded=Pointer(0x1102)))
    with pytest.raises(FmhaValueError, match="stride_padded_s=20 must be a multiple of 8"):
        executor.check_alignment(entry, dict(args, stride_padded_s=20))


def test_shipped_pad_kernels_for_every_arch():
    reg = registry_module.registry()
    for arch in pp.BUILD_ARCHS:
        for dtype in pp.DTYPES:
            for widen in (True, False):
                entry = reg.entry(arch, head_padding.pad_key(dtype, widen))
                assert [p.name for p in entry.params][:2] == ["UnalignedArray", "Padded"]
                assert reg.image(entry)


# ---------------------------------------------------------------------------------- integration


def _pointers_with_strides(problem):
    """Device-address stand-ins for a batched call's arrays, rows 5 * H elements apart."""
    sq, sk, hq, hk = problem.seqlen_q, problem.seqlen_k, problem.heads_q, problem.heads_k
    d = problem.head_dim_qk
    tensors = Operands(lse=Operand("lse", Pointer(0x90000000), (hq * sq, sq, 1)))
    for i, (name, s, h) in enumerate((("q", sq, hq), ("k", sk, hk), ("v", sk, hk), ("out", sq, hq), ("dout", sq, hq),
                                      ("dq", sq, hq), ("dk", sk, hk), ("dv", sk, hk))):
        setattr(tensors, name, Operand(name, Pointer(0x10000000 * (i + 1) + 2), (s * h * d, h * d, d, 1)))
    return tensors


def test_forward_integration_substitutes_the_scratch_regions():
    problem = AttentionProblem(2, 64, 80, 4, 2, 5, 5, "bf16", window_left=-1, window_right=0)
    tensors = _pointers_with_strides(problem)
    scratch = pp.fwd_scratch(problem)
    assert scratch.total_bytes > 0 and not scratch.needs_zeroing
    regions = {r.name: r for r in scratch.regions}
    tensors.regions.update({name: Pointer(0xA0000000 + r.offset) for name, r in regions.items()})
    padding = head_padding.for_pass(problem, tensors, "fwd")
    assert [launch.variant for launch in padding.before] == ["fmha_pad_widen_bf16"] * 3
    assert [launch.variant for launch in padding.after] == ["fmha_pad_narrow_bf16"]
    planned = padding.operands
    assert planned.q.pointer is tensors.regions["q_padded"] and planned.out.pointer is tensors.regions["out_padded"]
    assert planned.q.pointer.address == 0xA0000000 + regions["q_padded"].offset
    (fwd,) = pp.plan_fwd(problem, "sm_90", planned)
    assert fwd.args["Q"] is planned.q.pointer and fwd.args["stride_q_s"] == 4 * 8
    assert fwd.args["Lse"] is tensors.lse.pointer  # lse has no head dim: written in place
    assert padding.after[0].args["UnalignedArray"] is tensors.out.pointer
    # Nothing to pad: no scratch, nothing added.
    plain = AttentionProblem(2, 64, 80, 4, 2, 8, 8, "bf16")
    assert pp.fwd_scratch(plain).regions == () and pp.fwd_scratch(plain).total_bytes == 0
    assert head_padding.for_pass(plain, tensors, "fwd") == ([], [], tensors)


def test_backward_integration_uses_the_workspace_regions():
    problem = AttentionProblem(1, 48, 48, 2, 2, 13, 13, "fp16")
    tensors = _pointers_with_strides(problem)
    workspace = pp.bwd_workspace(problem, "sm_90")
    tensors.regions.update({r.name: Pointer(0xB0000000 + r.offset) for r in workspace.regions})
    padding = head_padding.for_pass(problem, tensors, "bwd")
    t = tensors
    assert [launch.args["UnalignedArray"] for launch in padding.before] == [o.pointer for o in (t.q, t.k, t.v, t.out, t.dout)]
    assert [launch.args["UnalignedArray"] for launch in padding.after] == [o.pointer for o in (t.dq, t.dk, t.dv)]
    launches = pp.plan_bwd(problem, "sm_90", padding.operands)
    assert all(o.pointer not in launch.args.values() for launch in launches for o in (t.q, t.dout, t.dq))
