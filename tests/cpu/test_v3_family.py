"""The v3 family on the CPU: its variants and the calls it serves, the forward's descriptor scratch, and
calls through the public API on the stand-in runtime (fake_gpu.py): a served forward launches the v3
kernel with its global scratch inside memory the call holds for it, and a plan-cache hit launches what an
uncached call launches but for the addresses. The kernels run only on a GPU (tests/gpu/test_v3.py):
Gluon has no interpreter."""
import math

import pytest

import fmha_rt
from fmha_rt.runtime import backend, executor
from fmha_rt.plan import dispatch, portable as pp, v3
from fmha_rt.plan import abi
from fmha_rt.errors import FmhaValueError
from fmha_rt.plan.operands import Operand, Operands
from fmha_rt.plan.problem import AttentionProblem
from fmha_rt.runtime.registry import SCRATCH_POINTERS, registry

from test_plan_cache import Inputs, fwd, hits, uncached, unpack, varlen_fwd


@pytest.fixture
def v3_on(monkeypatch):
    monkeypatch.setattr(v3, "MODE", "all")


def problem(**changes):
    shape = dict(batch=2, seqlen_q=300, seqlen_k=300, heads_q=8, heads_k=2, head_dim_qk=128, head_dim_v=128,
                 dtype="bf16")
    return AttentionProblem(**{**shape, **changes})


def test_variants_exist_on_sm_90_alone_and_take_the_portable_signature():
    for arch in ("gfx942", "gfx950", pp.INTERPRET_ARCH):
        assert v3.variants(arch) == []
    variants = {v["key"]: v for v in v3.variants("sm_90")}
    gluon = {v3.fwd_key(d, p): "fmha_fwd" for d in pp.DTYPES for p in v3.FWD_PAIRS}
    gluon.update({v3.fwd_key(d, p, paired=True): "fmha_fwd" for d in pp.DTYPES for p in v3.FWD_PAIRED_CAUSAL_SEQLEN_K})
    gluon.update({v3.fwd_key(d, p, run=True): "fmha_fwd" for d in pp.DTYPES for p in v3.FWD_RUN_TILES})
    gluon.update({v3.dkdv_key(d, p): "fmha_bwd_dkdv" for d in pp.DTYPES for p in v3.BWD_PAIRS})
    gluon.update({v3.dkdv_key(d, p, pp.DQ_ORDERED): "fmha_bwd_dkdv_ordered" for d in pp.DTYPES for p in v3.BWD_PAIRS})
    heads = {v3.dkdv_heads_key(d, p) for d in pp.DTYPES for p in v3.BWD_HEADS_PAIRS}  # dK, dV fp32 accumulators
    gluon.update({key: "fmha_bwd_dkdv" for key in heads})
    rows = {v3.preprocess_key(d, t): "fmha_bwd_preprocess" for d in pp.DTYPES for t in (64, 128, 256)}
    rows.update({v3.dq_convert_key(d, t): "fmha_bwd_dq_convert" for d in pp.DTYPES for t in (64, 128, 256)})
    assert set(variants) == set(gluon) | set(rows)
    assert not set(variants) & {v["key"] for v in pp.variants("sm_90")}
    for key, function in gluon.items():
        v = variants[key]
        # any tile: the same signature
        portable = abi.make_variant("k", function, v["traits"]["dtype"], v3.BWD_TILES[(128, 128)], {}, {},
                                    signature=abi.DKDV_ACCUMULATING_SIGNATURE if key in heads else None)
        assert v["signature"] == portable["signature"] and v["function"] == function
        assert v["language"] == "gluon" and v["module"].startswith("kernels.v3.")
        assert v["global_scratch"] == plan_scratch(function, v["traits"])
        assert v["constexprs"]["BIAS_KIND"] == pp.BIAS_NONE and v["constexprs"]["DROPOUT"] is False
        if function.startswith("fmha_bwd_dkdv"):  # one set of entries; the 256 tiles run fmha_bwd_wide.py's program
            assert v["module"] == "kernels.v3.fmha_bwd"
    for key, function in rows.items():  # the portable family's kernels, built under this family's keys
        assert variants[key]["module"] == "kernels.portable.fmha_bwd" and "language" not in variants[key]


def test_the_ordered_form_takes_its_tickets_by_chunks_of_512_keys():
    """ORDERED_CHUNK_KEYS keys a chunk: 4 blocks of the 64 and 128 tiles, 8 of the wide program's 64-key blocks;
    the atomic form takes no tickets."""
    variants = {v["key"]: v for v in v3.variants("sm_90")}
    for dtype in pp.DTYPES:
        for pair, tile in v3.BWD_TILES.items():
            ordered = variants[v3.dkdv_key(dtype, pair, pp.DQ_ORDERED)]["constexprs"]
            assert ordered["KEY_BLOCK_CHUNK"] * tile.block_n == v3.ORDERED_CHUNK_KEYS == 512
            assert "KEY_BLOCK_CHUNK" not in variants[v3.dkdv_key(dtype, pair)]["constexprs"]


def plan_scratch(function, traits) -> int:
    """The global scratch a v3 variant of `function` declares, from its traits' tile."""
    pair = (traits["head_dim_qk_tile"], traits["head_dim_v_tile"])
    return v3.fwd_global_scratch(pair) if function == "fmha_fwd" else v3.bwd_global_scratch(function, pair)


def test_a_forward_program_makes_q_k_v_and_one_o_descriptor_a_consumer():
    """The loaders make Q's, K's and V's descriptors, each consumer its own of O (kernels/v3/fmha_fwd.py):
    128 bytes each, two consumers in every tile (128 rows)."""
    assert {pair: v3.fwd_global_scratch(pair) for pair in v3.FWD_PAIRS} == {
        (64, 64): 640, (128, 128): 640, (256, 256): 640, (256, 128): 640, (192, 128): 640}


def test_a_backward_program_makes_its_loaders_and_three_consumer_descriptors_a_consumer():
    """The two loaders make K's, V's, Q's, dO's, Lse2's and Delta's descriptors (the row statistics come
    with dO, or in the wide tiles Lse2 with Q), each consumer its own of dK, dV and the dQ accumulator
    (kernels/v3/fmha_bwd.py, fmha_bwd_wide.py), but in the ORDERED form's 64 and 128 tiles, where the dQ
    writer makes the one of the accumulator."""
    sizes = {(f, pair): v3.bwd_global_scratch(f, pair) for f in ("fmha_bwd_dkdv", "fmha_bwd_dkdv_ordered")
             for pair in v3.BWD_PAIRS}
    assert {key: n for key, n in sizes.items() if n != 1536} == {
        ("fmha_bwd_dkdv_ordered", (64, 64)): 1408, ("fmha_bwd_dkdv_ordered", (128, 128)): 1408}


def test_the_manifest_holds_the_built_v3_kernels_with_their_scratch(monkeypatch):
    monkeypatch.delenv("FMHA_RT_ASM_DIR", raising=False)
    entries = [e for e in registry().kernels_for("sm_90") if e.family == v3.FAMILY]
    functions = {v["key"]: v["function"] for v in v3.variants("sm_90")}
    assert sorted(e.key for e in entries) == sorted(functions)
    for e in entries:
        assert [s.name for s in e.params[-2:]] == list(SCRATCH_POINTERS)
        if e.key.startswith(("fmha_fwd_v3", "fmha_bwd_dkdv_v3", "fmha_bwd_dkdv_ordered_v3", "fmha_bwd_dkdv_heads_v3")):
            # the build checked the compiler's figure against the plan's; the manifest records it
            assert e.traits["global_scratch"] == plan_scratch(functions[e.key], e.traits)
            assert e.traits["global_scratch_align"] == v3.GLOBAL_SCRATCH_ALIGN
            # a warpgroup a consumer (two, three in the forward's 192-row tile), then the loader warp (and the
            # ordered backward's dQ writer) in one more: whole warpgroups
            consumers = e.traits["block_m"] // 64 if e.key.startswith("fmha_fwd") else 2
            assert e.threads == (consumers + 1) * 128
        else:
            assert "global_scratch" not in e.traits


def test_the_descriptors_address_must_have_the_compilers_alignment(monkeypatch):
    """TMA descriptors are made in the global scratch, so its pointer is checked against the manifest's
    alignment (before any launch, on every path: executor, plan-cache replay and XLA programs), not the
    16 bytes of other pointers: a caller's workspace that starts off that boundary is refused."""
    monkeypatch.delenv("FMHA_RT_ASM_DIR", raising=False)
    entry = registry().entry("sm_90", v3.dkdv_key("bf16", (128, 128)))
    assert executor.pointer_alignment(entry, "global_scratch") == v3.GLOBAL_SCRATCH_ALIGN
    assert executor.pointer_alignment(entry, "Q") == 16
    executor.check_pointer(entry, "global_scratch", 0x10000 + v3.GLOBAL_SCRATCH_ALIGN)
    with pytest.raises(FmhaValueError, match=r"global_scratch=0x10010 is not 128-byte aligned"):
        executor.check_pointer(entry, "global_scratch", 0x10010)


SERVED = {
    "bf16 D=128 GQA": dict(),
    "fp16 D=64": dict(dtype="fp16", head_dim_qk=64, head_dim_v=64),
    "causal bottom-right": dict(window_right=0, bottom_right=True, seqlen_k=500),
    "window": dict(window_left=64, window_right=16),
    "varlen": dict(varlen=True, total_q=700, total_k=900),
    "head dim 100 (128 tile)": dict(head_dim_qk=100, head_dim_v=100),
    "MQA": dict(heads_k=1),
    "Dqk 64, Dv 128 (the 128 tile)": dict(head_dim_qk=64, head_dim_v=128),
    "head dim 256": dict(head_dim_qk=256, head_dim_v=256),
    "head dim 192 (256 tile)": dict(head_dim_qk=192, head_dim_v=192),
    "192/128 (the 192/128 tile)": dict(head_dim_qk=192, head_dim_v=128),
    "160/128 (the 192/128 tile)": dict(head_dim_qk=160, head_dim_v=128),
    "256/128": dict(head_dim_qk=256, head_dim_v=128),
}
NOT_SERVED = {
    "head dim 32": dict(head_dim_qk=32, head_dim_v=32),
    "bias": dict(bias_shape="1HSS"),
    "alibi": dict(alibi="H"),
    "dropout": dict(dropout_p=0.1),
}


@pytest.mark.parametrize("case", SERVED)
def test_serves_its_calls_on_sm_90_in_the_all_mode(case, v3_on, monkeypatch):
    p = problem(**SERVED[case])
    assert v3.serves_fwd(p, "sm_90")
    assert not v3.serves_fwd(p, "gfx942")
    monkeypatch.setattr(v3, "MODE", "off")
    assert not v3.serves_fwd(p, "sm_90")


@pytest.mark.parametrize("changes, served", [
    (dict(seqlen_q=1024, seqlen_k=1024), True),
    (dict(seqlen_q=300, seqlen_k=2048, window_right=0, bottom_right=True), True),
    (dict(seqlen_q=1024, seqlen_k=1023), False),
    (dict(seqlen_q=4096, seqlen_k=4096, head_dim_qk=64, head_dim_v=64), False),
    (dict(seqlen_q=4096, seqlen_k=8191, head_dim_qk=64, head_dim_v=64), False),
    (dict(seqlen_q=4096, seqlen_k=8192, head_dim_qk=64, head_dim_v=64), True),
    (dict(seqlen_q=4096, seqlen_k=4096, dropout_p=0.1), False),
    (dict(seqlen_q=1024, seqlen_k=1024, head_dim_qk=192, head_dim_v=128), True),
    (dict(seqlen_q=1024, seqlen_k=1023, head_dim_qk=192, head_dim_v=128), False),
    (dict(seqlen_q=1024, seqlen_k=1024, head_dim_qk=256, head_dim_v=128), True),
    (dict(seqlen_q=1024, seqlen_k=1024, head_dim_qk=256, head_dim_v=256), True),
    (dict(seqlen_q=1024, seqlen_k=1023, head_dim_qk=256, head_dim_v=256), False),
], ids=["D=128 1k", "D=128 2k keys, short queries", "D=128 one key short", "D=64 4k", "D=64 one key short of 8k", "D=64 8k",
        "dropout", "192/128 1k",
        "192/128 one key short", "256/128 1k", "D=256 1k", "D=256 one key short"])
def test_the_measured_mode_runs_the_forward_where_it_was_faster(changes, served, monkeypatch):
    monkeypatch.setattr(v3, "MODE", "measured")
    p = problem(heads_k=8, **changes)
    assert v3.serves_fwd(p, "sm_90") is served


@pytest.mark.parametrize("changes, served", [
    (dict(seqlen_q=1024, seqlen_k=1024), True),
    (dict(seqlen_q=1024, seqlen_k=1024, window_right=0), True),
    (dict(seqlen_q=1024, seqlen_k=1023), False),
    (dict(seqlen_q=2048, seqlen_k=2048, deterministic=True), False),
    (dict(seqlen_q=1024, seqlen_k=1024, heads_k=2), True),
    (dict(seqlen_q=1023, seqlen_k=1023, heads_k=2, window_right=0), False),
    (dict(seqlen_q=1024, seqlen_k=1024, heads_k=2, window_right=0), True),
    (dict(seqlen_q=4096, seqlen_k=4096, head_dim_qk=256, head_dim_v=256, heads_k=2, window_right=0), False),
    (dict(seqlen_q=16384, seqlen_k=16384, head_dim_qk=256, head_dim_v=256, heads_k=2, window_right=0), True),
    (dict(seqlen_q=4096, seqlen_k=2047, head_dim_qk=64, head_dim_v=64), False),
    (dict(seqlen_q=4096, seqlen_k=2048, head_dim_qk=64, head_dim_v=64), True),
    (dict(seqlen_q=4096, seqlen_k=4096, dropout_p=0.1), False),
    (dict(seqlen_q=1024, seqlen_k=1024, head_dim_qk=192, head_dim_v=128), True),
    (dict(seqlen_q=1024, seqlen_k=1023, head_dim_qk=192, head_dim_v=128), False),
    (dict(seqlen_q=1024, seqlen_k=1023, head_dim_qk=256, head_dim_v=128), False),
    (dict(seqlen_q=4096, seqlen_k=4096, head_dim_qk=256, head_dim_v=128), True),
], ids=["D=128 1k", "D=128 1k causal", "D=128 one key short", "deterministic 2k", "GQA 1k", "GQA causal one key short of 1k",
        "GQA 1k causal", "D=256 GQA 4k causal", "D=256 GQA 16k causal", "D=64 one key short of 2k", "D=64 2k", "dropout",
        "192/128 1k", "192/128 one key short", "256/128 below 4k", "256/128 4k"])
def test_the_measured_mode_runs_the_backward_where_it_was_faster(changes, served, monkeypatch):
    monkeypatch.setattr(v3, "MODE", "measured")
    p = problem(**{"heads_k": 8, **changes})
    assert v3.serves_bwd(p, "sm_90") is served
    assert not v3.serves_bwd(p, "gfx942")


def test_the_forward_tiles_take_128_rows_and_64_keys_at_256():
    variants = {v["key"]: v for v in v3.variants("sm_90")}
    for pair, tile in (((64, 64), (128, 128)), ((128, 128), (128, 128)), ((256, 256), (128, 64)), ((256, 128), (128, 64)),
                       ((192, 128), (128, 128))):
        constexprs = variants[v3.fwd_key("bf16", pair)]["constexprs"]
        assert (constexprs["BLOCK_M"], constexprs["BLOCK_N"]) == tile


def test_the_consumers_schedule_is_a_build_choice_of_each_forward_tile():
    """FWD_SCHEDULE's constexprs (beyond the signature's) and the `schedule` trait of every forward tile: the
    ping-pong everywhere (measured ahead at D=128 and 256), the other schedules buildable for an A/B."""
    assert set(v3.FWD_SCHEDULE) == set(v3.FWD_TILES)
    assert set(v3.FWD_SCHEDULE.values()) == {v3.PINGPONG}
    variants = {v["key"]: v for v in v3.variants("sm_90")}
    for dtype in pp.DTYPES:
        for pair, schedule in v3.FWD_SCHEDULE.items():
            v = variants[v3.fwd_key(dtype, pair)]
            assert v["constexprs"]["PINGPONG"] is True and "SOFTMAX_TURNS" not in v["constexprs"]
            assert v["traits"]["schedule"] == schedule


@pytest.mark.parametrize("schedule, constexprs", [("free", {}), ("turns", {"SOFTMAX_TURNS": True})])
def test_the_other_schedules_set_their_constexprs(monkeypatch, schedule, constexprs):
    monkeypatch.setitem(v3.FWD_SCHEDULE, (128, 128), schedule)
    v = {v["key"]: v for v in v3.variants("sm_90")}[v3.fwd_key("bf16", (128, 128))]
    assert {k: v["constexprs"][k] for k in ("SOFTMAX_TURNS", "PINGPONG") if k in v["constexprs"]} == constexprs
    assert v["traits"]["schedule"] == schedule


def test_causal_forward_programs_run_two_query_blocks_in_the_measured_key_lengths(v3_on):
    """TILES = 2 (kernels/v3/fmha_fwd.py), the tile's paired variant: a program runs query blocks M - 1 - p
    and p of its (head, batch entry), so the grid has half the query blocks, rounded up. Causal calls in the
    key lengths of FWD_PAIRED_CAUSAL_SEQLEN_K take it; any other MHA call a program a block."""
    fwd = {v["key"]: v for v in v3.variants("sm_90") if v["function"] == "fmha_fwd"}
    for dtype in pp.DTYPES:
        for pair in v3.FWD_PAIRS:
            assert fwd[v3.fwd_key(dtype, pair)]["constexprs"]["TILES"] == 1
            paired = fwd.get(v3.fwd_key(dtype, pair, paired=True))
            assert (paired is not None) == (pair in v3.FWD_PAIRED_CAUSAL_SEQLEN_K)
            if paired:
                assert paired["constexprs"]["TILES"] == 2 and paired["constexprs"]["PINGPONG"]
                assert paired["global_scratch"] == v3.fwd_global_scratch(pair)
    for seqlen, paired, single in ((128, 1, 1), (256, 1, 2), (300, 2, 3), (640, 3, 5)):
        rows = (seqlen * 8 * 128, 8 * 128, 128, 1)
        strides = {"q": rows, "k": rows, "v": rows, "out": rows, "lse": (8 * seqlen, seqlen, 1)}
        for window, programs in (((-1, 0), paired), ((-1, -1), single), ((64, 0), single)):
            p = problem(seqlen_q=seqlen, seqlen_k=seqlen, heads_k=8, window_left=window[0], window_right=window[1])
            assert v3.fwd_paired(p) == (window == (-1, 0))
            (launch,) = dispatch.plan_fwd(p, "sm_90", pointed_operands(strides, [v3.DESCRIPTOR_REGION]))
            assert launch.variant == v3.fwd_key("bf16", (128, 128), paired=window == (-1, 0))
            assert launch.grid == (programs, 8, 2)
            descriptors = dispatch.fwd_scratch(p, "sm_90").regions[-1]
            assert descriptors.nbytes == v3.fwd_global_scratch((128, 128)) * programs * 8 * 2


def test_gqa_forward_programs_without_a_mask_run_consecutive_query_blocks_below_8192_keys(v3_on):
    """TILES > 2, the tile's run variant: a program runs FWD_RUN_TILES consecutive query blocks, so the grid
    has that many times fewer programs, rounded up; only GQA calls without a mask in FWD_RUN_SEQLEN_K's key
    lengths take it (MHA measured level)."""
    fwd = {v["key"]: v for v in v3.variants("sm_90") if v["function"] == "fmha_fwd"}
    for dtype in pp.DTYPES:
        for pair, tiles in v3.FWD_RUN_TILES.items():
            run = fwd[v3.fwd_key(dtype, pair, run=True)]
            assert run["constexprs"]["TILES"] == tiles > 2 and run["constexprs"]["PINGPONG"]
            assert run["traits"]["tiles_per_program"] == tiles
    assert v3.FWD_RUN_SEQLEN_K == {((128, 128), True): (0, 8192)}
    for seqlen, runs in ((1024, 2), (1100, 3), (8192, None)):
        for heads_k in (2, 8):
            rows, kv_rows = (seqlen * 8 * 128, 8 * 128, 128, 1), (seqlen * heads_k * 128, heads_k * 128, 128, 1)
            strides = {"q": rows, "k": kv_rows, "v": kv_rows, "out": rows, "lse": (8 * seqlen, seqlen, 1)}
            for window in ((-1, -1), (-1, 0), (64, 64)):
                p = problem(seqlen_q=seqlen, seqlen_k=seqlen, heads_k=heads_k, window_left=window[0],
                            window_right=window[1])
                run = runs is not None and window == (-1, -1) and heads_k < 8
                assert v3.fwd_run(p) == run
                (launch,) = dispatch.plan_fwd(p, "sm_90", pointed_operands(strides, [v3.DESCRIPTOR_REGION]))
                paired = window == (-1, 0) and seqlen < 8192
                assert launch.variant == v3.fwd_key("bf16", (128, 128), paired=paired, run=run)
                programs = runs if run else -(-seqlen // (256 if paired else 128))
                assert launch.grid == (programs, 8, 2)
                descriptors = dispatch.fwd_scratch(p, "sm_90").regions[-1].nbytes
                assert descriptors == v3.fwd_global_scratch((128, 128)) * programs * 16


@pytest.mark.parametrize("dims", [(128, 128), (256, 256), (192, 128), (64, 64)])
def test_each_tile_pairs_causal_query_blocks_in_its_measured_key_lengths_alone(v3_on, dims):
    first, below = v3.FWD_PAIRED_CAUSAL_SEQLEN_K.get(dims, (None, None))
    for seqlen_k in (1, 1024, 2047, 2048, 4096, 8191, 8192, 16384):
        causal = problem(head_dim_qk=dims[0], head_dim_v=dims[1], seqlen_k=seqlen_k, window_right=0)
        assert v3.fwd_paired(causal) == (first is not None and first <= seqlen_k < below)
        assert not v3.fwd_paired(problem(head_dim_qk=dims[0], head_dim_v=dims[1], seqlen_k=seqlen_k))


def test_the_head_dim_64_tile_sets_the_grid_and_the_descriptors_of_a_forward(v3_on):
    p = problem(head_dim_qk=64, head_dim_v=64)  # 300 rows: three programs of 128 a (head, batch entry)
    rows, kv_rows = (300 * 8 * 64, 8 * 64, 64, 1), (300 * 2 * 64, 2 * 64, 64, 1)
    strides = {"q": rows, "k": kv_rows, "v": kv_rows, "out": rows, "lse": (8 * 300, 300, 1)}
    tensors = pointed_operands(strides, [v3.DESCRIPTOR_REGION])
    (launch,) = dispatch.plan_fwd(p, "sm_90", tensors)
    assert launch.variant == v3.fwd_key("bf16", (64, 64)) and launch.grid == (3, 8, 2)
    descriptors = dispatch.fwd_scratch(p, "sm_90").regions[-1]
    assert descriptors.nbytes == v3.fwd_global_scratch((64, 64)) * 3 * 8 * 2


@pytest.mark.parametrize("dims, fwd_pair, pair", [
    ((192, 128), (192, 128), (256, 128)), ((160, 128), (192, 128), (256, 128)), ((136, 96), (192, 128), (256, 128)),
    ((136, 64), (192, 128), (256, 256)), ((200, 128), (256, 128), (256, 128)), ((256, 128), (256, 128), (256, 128)),
    ((192, 192), (256, 256), (256, 256)), ((256, 256), (256, 256), (256, 256)), ((128, 128), (128, 128), (128, 128)),
    ((64, 128), (128, 128), (128, 128)),
])
def test_the_forward_takes_the_192_128_tile_where_it_holds_the_heads_and_the_rest_keeps_its_pair(dims, fwd_pair, pair):
    """Queries and keys of 129..192 with values up to 128 pad within the forward's 192/128 tile; the portable
    family and the v3 backward (head_dim_tiles) keep the pair they had for every head."""
    p = problem(head_dim_qk=dims[0], head_dim_v=dims[1])
    assert v3.fwd_pair(p) == fwd_pair
    assert abi.head_dim_tiles(p) == pair


def test_the_192_128_tile_is_the_v3_familys_alone():
    """The portable kernels need power-of-two tiles: no portable variant takes 192. The v3 family has it for
    the forward and for the backward's tile of two consumers of keys (dK/dV, both strategies); the pre-pass and
    the dQ conversion run their 128 and 256 tiles."""
    assert v3.LATENT_PAIR not in abi.HEAD_DIM_PAIRS and v3.LATENT_PAIR not in v3.BWD_WIDE_PAIRS
    assert all(v["traits"].get("head_dim_qk_tile") != 192 for v in pp.variants("sm_90"))
    latent = {v["function"] for v in v3.variants("sm_90") if v["traits"].get("head_dim_qk_tile") == 192}
    assert latent == {"fmha_fwd", "fmha_bwd_dkdv", "fmha_bwd_dkdv_ordered"}
    assert {v3.dq_tile(pair) for pair in v3.BWD_PAIRS} == {64, 128, 256}


def test_without_the_192_128_tile_the_forward_pads_to_256(monkeypatch):
    tiles = {pair: tile for pair, tile in v3.FWD_TILES.items() if pair != v3.LATENT_PAIR}
    monkeypatch.setattr(v3, "FWD_TILES", tiles)
    assert v3.fwd_pair(problem(head_dim_qk=192, head_dim_v=128)) == (256, 128)


def latent_operands(seqlen, regions):
    """Stand-in operands of problem(head_dim_qk=192, head_dim_v=128, seqlen_q=seqlen_k=seqlen)'s tensors."""
    q_rows, k_rows = (seqlen * 8 * 192, 8 * 192, 192, 1), (seqlen * 2 * 192, 2 * 192, 192, 1)
    v_rows, out_rows = (seqlen * 2 * 128, 2 * 128, 128, 1), (seqlen * 8 * 128, 8 * 128, 128, 1)
    strides = {"q": q_rows, "k": k_rows, "v": v_rows, "out": out_rows, "lse": (8 * seqlen, seqlen, 1)}
    return pointed_operands(strides, regions)


def test_the_all_mode_plans_a_192_128_forward_in_the_192_128_tile(v3_on):
    p = problem(head_dim_qk=192, head_dim_v=128)  # 300 rows: three blocks of 128, a program each
    tensors = latent_operands(300, [v3.DESCRIPTOR_REGION])
    (launch,) = dispatch.plan_fwd(p, "sm_90", tensors)
    assert launch.variant == "fmha_fwd_v3_bf16_d192v128" and launch.grid == (3, 8, 2)
    assert (launch.args["head_dim_qk_div8"], launch.args["head_dim_v_div8"]) == (24, 16)
    assert dispatch.fwd_scratch(p, "sm_90").regions[-1].nbytes == v3.fwd_global_scratch((192, 128)) * 3 * 8 * 2


def test_the_measured_mode_plans_a_192_128_forward_in_the_192_128_tile_from_1024_keys(monkeypatch):
    monkeypatch.setattr(v3, "MODE", "measured")
    for seqlen, variant in ((1024, "fmha_fwd_v3_bf16_d192v128"), (1000, "fmha_fwd_bf16_d256v128_nobias_nodrop")):
        p = problem(seqlen_q=seqlen, seqlen_k=seqlen, head_dim_qk=192, head_dim_v=128)
        regions = [v3.DESCRIPTOR_REGION] if seqlen >= 1024 else []
        (launch,) = dispatch.plan_fwd(p, "sm_90", latent_operands(seqlen, regions))
        assert launch.variant == variant


@pytest.mark.parametrize("case", NOT_SERVED)
def test_leaves_the_rest_to_the_portable_family(case, v3_on):
    p = problem(**NOT_SERVED[case])
    assert not v3.serves_fwd(p, "sm_90")
    assert dispatch.fwd_scratch(p, "sm_90") == pp.fwd_scratch(p)


def test_the_environment_sets_the_mode(monkeypatch):
    for value, mode in (("", "measured"), ("1", "all"), ("0", "off")):
        monkeypatch.setenv("FMHA_RT_V3", value)
        v3.refresh_mode()
        assert v3.MODE == mode
    monkeypatch.delenv("FMHA_RT_V3")
    v3.refresh_mode()
    assert v3.MODE == "measured"


def test_scratch_is_the_padding_then_descriptors_for_every_program(v3_on):
    p = problem(head_dim_qk=100, head_dim_v=100, heads_k=8)
    scratch = dispatch.fwd_scratch(p, "sm_90")
    padding = pp.fwd_scratch(p)
    assert padding.regions and scratch.regions[:-1] == padding.regions
    descriptors = scratch.regions[-1]
    programs = math.ceil(300 / 128) * 8 * 2  # a block of 128 rows a program (MHA without a mask: one block)
    assert descriptors.name == v3.DESCRIPTOR_REGION and not descriptors.zero_init
    assert descriptors.nbytes == v3.fwd_global_scratch((128, 128)) * programs
    assert descriptors.offset % v3.GLOBAL_SCRATCH_ALIGN == 0 and descriptors.offset >= padding.total_bytes
    assert scratch.total_bytes >= descriptors.offset + descriptors.nbytes
    assert dispatch.fwd_scratch(problem(seqlen_q=0), "sm_90").total_bytes == 0  # no programs, no descriptors


def test_plan_is_the_portable_launch_with_the_v3_kernel_and_the_descriptors(v3_on):
    p = problem(window_right=0)
    rows, kv_rows = (300 * 8 * 128, 8 * 128, 128, 1), (300 * 2 * 128, 2 * 128, 128, 1)
    strides = {"q": rows, "k": kv_rows, "v": kv_rows, "out": rows, "lse": (8 * 300, 300, 1)}
    tensors = pointed_operands(strides, [v3.DESCRIPTOR_REGION])
    (launch,) = dispatch.plan_fwd(p, "sm_90", tensors)
    (portable,) = pp.plan_fwd(p, "sm_90", tensors)
    assert launch.variant == v3.fwd_key("bf16", (128, 128), paired=True)
    assert launch.grid == (2, 8, 2)  # three blocks of 128 rows a (head, batch entry), causal: two a program
    assert launch.args == {**portable.args, "global_scratch": tensors.regions[v3.DESCRIPTOR_REGION]}
    assert dispatch.plan_fwd(problem(seqlen_q=0, window_right=0), "sm_90", tensors) == []


def pp_pointer(i):
    return fmha_rt.Pointer(0x7F0000000000 + (i << 24))


def pointed_operands(strides: dict, regions) -> Operands:
    """Operands of distinct stand-in addresses: the arrays of `strides` (name -> strides), then `regions`."""
    operands = Operands()
    for i, (name, st) in enumerate(strides.items()):
        setattr(operands, name, Operand(name, pp_pointer(i), st))
    operands.regions.update({name: pp_pointer(len(strides) + i) for i, name in enumerate(regions)})
    return operands


def allocations_of(rt, monkeypatch):
    """(address, bytes) of every allocation the stand-in makes from here on."""
    made = []
    allocate = rt.mem_alloc

    def recording(ordinal, nbytes, stream=0):
        ptr = allocate(ordinal, nbytes, stream)
        made.append((ptr, nbytes))
        return ptr

    monkeypatch.setattr(backend, "mem_alloc", recording)
    return made


def scratch_of(args, made):
    ptr = args["global_scratch"]
    return next(((start, n) for start, n in made if start <= ptr < start + n), None)


@pytest.mark.parametrize("make, shape, options, kernel", [
    (fwd, {}, {}, "fmha_fwd_v3_fp16_d64"),
    (fwd, {"hq": 8, "hk": 2, "d": 128}, {"causal": True}, "fmha_fwd_v3_fp16_d128_paired"),
    (fwd, {"d": 56}, {"window": (16, 8), "causal_alignment": "bottom_right"}, "fmha_fwd_v3_fp16_d64"),
    (varlen_fwd, {"hq": 8, "hk": 2, "varlen": True}, {"causal": True}, "fmha_fwd_v3_fp16_d64"),
], ids=["MHA", "GQA causal D=128", "window bottom-right D=56", "varlen"])
def test_a_served_call_launches_the_v3_kernel_and_a_hit_launches_the_same(monkeypatch, rt, driver, v3_on, make,
                                                                            shape, options, kernel):
    made = allocations_of(rt, monkeypatch)
    first, second = Inputs(rt, **shape), Inputs(rt, **shape)
    expected = uncached(monkeypatch, driver, make(second, **options))
    (launch,) = [item for item in expected if item[0].startswith("fmha_fwd")]
    assert launch[0] == kernel
    assert fmha_rt.last_launch_info()["family"] == v3.FAMILY
    args = unpack(kernel, launch[2])
    assert args["Q"] == second.q.ptr and args["profile_scratch"] == 0
    descriptors = {v["key"]: v.get("global_scratch") for v in v3.variants("sm_90")}[kernel] * math.prod(launch[1])
    start, nbytes = scratch_of(args, made)  # inside a buffer the call allocated, with room for every program
    assert args["global_scratch"] % v3.GLOBAL_SCRATCH_ALIGN == 0
    assert args["global_scratch"] + descriptors <= start + nbytes
    for _ in range(2):  # seen twice: recorded; then a hit
        make(first, **options)()
    driver.take()
    make(second, **options)()
    assert hits() == 1
    got = driver.take()
    assert [item[0] for item in got] == [item[0] for item in expected]
    hit_args = [unpack(key, packed) for key, _, packed, _ in got]
    planned_args = [unpack(key, packed) for key, _, packed, _ in expected]
    for hit, planned in zip(hit_args, planned_args):
        # a hit takes the stream's kept buffer for its scratch: every other byte is the uncached call's
        assert {**hit, "global_scratch": 0} == {**planned, "global_scratch": 0}
    assert any("global_scratch" in a and a["global_scratch"] for a in hit_args)


def test_a_call_it_does_not_serve_runs_and_reports_the_portable_family(monkeypatch, rt, driver, v3_on):
    x = Inputs(rt, bias=(1, 4, 64, 64))
    fwd(x)()
    (launch,) = driver.take()
    assert launch[0].startswith("fmha_fwd_fp16_d64_bias") and "global_scratch" not in launch[0]
    assert unpack(launch[0], launch[2])["global_scratch"] == 0
    assert fmha_rt.last_launch_info()["family"] == "portable"


def test_the_bench_runs_the_v3_family_beside_the_default(monkeypatch):
    from fmha_rt.bench import grid, peers

    adapter = peers.PEER_BY_NAME["fmha_rt_v3"].make()
    cleared = []
    monkeypatch.setattr(fmha_rt, "clear_plan_cache", lambda: cleared.append(v3.MODE))
    monkeypatch.setattr(v3, "MODE", "measured")
    with adapter.context():
        assert v3.MODE == "all"
    # cleared on entry and on exit: no plan made under the other mode survives the switch
    assert v3.MODE == "measured" and cleared == ["measured", "measured"]
    point = dict(kind="dense", dtype="bf16", batch=1, heads_q=2, heads_k=2, seqlen_q=128, seqlen_k=128,
                 head_dim=128, causal=False)
    for pass_name in ("fwd", "bwd"):
        assert peers.unsupported(adapter, grid.Point(pass_name=pass_name, **point)) is None
    # deterministic rows time the ORDERED form where the family serves them
    assert peers.unsupported(adapter, grid.Point(pass_name="bwd_det", **point)) is None
    monkeypatch.setattr(v3, "ORDERED_FOR_DETERMINISTIC", frozenset())
    with adapter.context():
        assert v3.ORDERED_FOR_DETERMINISTIC == frozenset(v3.ARCHS)
    assert v3.ORDERED_FOR_DETERMINISTIC == frozenset()


# ----------------------------------------------------------------------------------------- backward

BWD_SERVED = {
    "bf16 D=128 MHA causal": dict(heads_k=8, window_right=0),
    "GQA": dict(),
    "MQA": dict(heads_k=1),
    "fp16 D=64 window bottom-right": dict(heads_k=8, dtype="fp16", head_dim_qk=64, head_dim_v=64, window_left=32,
                                          window_right=8, bottom_right=True),
    "varlen head dim 100": dict(heads_k=8, varlen=True, total_q=700, total_k=900, head_dim_qk=100, head_dim_v=100),
    "head dim 256 (the wide kernel)": dict(heads_k=8, head_dim_qk=256, head_dim_v=256),
    "192/128 GQA causal (the wide kernel)": dict(head_dim_qk=192, head_dim_v=128, window_right=0),
}
BWD_NOT_SERVED = {
    "deterministic": dict(heads_k=8, deterministic=True),
    "bias": dict(heads_k=8, bias_shape="1HSS", bias_grad=True),
    "dropout": dict(heads_k=8, dropout_p=0.1),
}


@pytest.mark.parametrize("case", BWD_SERVED)
def test_the_backward_serves_the_non_deterministic_calls(case, v3_on, monkeypatch):
    p = problem(**BWD_SERVED[case])
    assert v3.serves_bwd(p, "sm_90") and v3.serves_bwd(p, "sm_90", pp.DQ_ATOMIC)
    assert not v3.serves_bwd(p, "sm_90", pp.DQ_FUSED) and not v3.serves_bwd(p, "gfx950")
    monkeypatch.setattr(v3, "MODE", "off")
    assert not v3.serves_bwd(p, "sm_90")


@pytest.mark.parametrize("case", BWD_NOT_SERVED)
def test_the_backward_leaves_the_rest_to_the_portable_family(case, v3_on):
    p = problem(**BWD_NOT_SERVED[case])
    assert not v3.serves_bwd(p, "sm_90")
    assert dispatch.bwd_workspace(p, "sm_90") == pp.bwd_workspace(p, "sm_90")


@pytest.mark.parametrize("latent, programs", [(False, 5), (True, 2)], ids=["256_128_tile", "192_128_tile"])
def test_the_192_128_heads_backward_plan(latent, programs, v3_on, monkeypatch):
    """192/128 heads, the atomic strategy's launches: the dK/dV kernel by blocks of 64 keys in the wide (256, 128)
    tile (fmha_bwd_wide.py), or with LATENT_BWD_TILE by pairs of 128-key blocks in the (192, 128) tile of two
    consumers of keys (fmha_bwd.py's program); descriptors for each program, and the 256 tile's dQ conversion."""
    monkeypatch.setattr(v3, "LATENT_BWD_TILE", latent)
    pair = v3.LATENT_PAIR if latent else (256, 128)
    p = problem(head_dim_qk=192, head_dim_v=128, window_right=0)  # GQA 8/2, 300 keys: 5 blocks of 64, 3 of 128
    workspace = dispatch.bwd_workspace(p, "sm_90")
    assert workspace.region(v3.DESCRIPTOR_REGION).nbytes == v3.bwd_global_scratch("fmha_bwd_dkdv", pair) * programs * 2 * 2
    rows, kv_rows, v_rows = (300 * 8 * 192, 8 * 192, 192, 1), (300 * 2 * 192, 2 * 192, 192, 1), (300 * 2 * 128, 2 * 128, 128, 1)
    out_rows = (300 * 8 * 128, 8 * 128, 128, 1)
    strides = {"q": rows, "k": kv_rows, "v": v_rows, "out": out_rows, "lse": (8 * 300, 300, 1), "dout": out_rows,
               "dq": rows, "dk": kv_rows, "dv": v_rows}
    tensors = pointed_operands(strides, [r.name for r in workspace.regions])
    launches = dispatch.plan_bwd(p, "sm_90", tensors)
    assert [launch.variant for launch in launches] == [v3.preprocess_key("bf16", 128), v3.dkdv_key("bf16", pair),
                                                       v3.dq_convert_key("bf16", 256)]
    assert launches[1].grid == (programs, 2, 2) and launches[1].args["head_dim_qk_div8"] == 24


@pytest.mark.parametrize("dims, latent", [((192, 128), True), ((136, 64), True), ((192, 136), False), ((200, 128), False),
                                          ((128, 128), False)])
def test_the_backward_takes_the_192_128_tile_where_switched_on_and_it_holds_the_heads(dims, latent, monkeypatch):
    p = problem(head_dim_qk=dims[0], head_dim_v=dims[1])
    assert v3.bwd_pair(p) == (v3.LATENT_PAIR if latent else abi.head_dim_tiles(p))  # on by default
    monkeypatch.setattr(v3, "LATENT_BWD_TILE", False)
    assert v3.bwd_pair(p) == abi.head_dim_tiles(p)


def test_the_192_128_backward_tile_serves_its_measured_lengths(monkeypatch):
    """It runs from its own measured length (1024 keys), where the padded (256, 128) tile ran from 4096;
    deterministic calls take its ORDERED form only where switched on for every length (level with the
    portable deterministic backward at 16k, behind it below)."""
    monkeypatch.setattr(v3, "MODE", "measured")
    short = problem(head_dim_qk=192, head_dim_v=128, seqlen_q=1024, seqlen_k=1024)
    assert v3.serves_bwd(short, "sm_90") and not v3.serves_bwd(problem(head_dim_qk=192, head_dim_v=128), "sm_90")
    deterministic = problem(head_dim_qk=192, head_dim_v=128, seqlen_q=16384, seqlen_k=16384, deterministic=True)
    assert not v3.serves_bwd(deterministic, "sm_90")
    monkeypatch.setattr(v3, "ORDERED_FOR_DETERMINISTIC", frozenset({"sm_90"}))
    assert dispatch.bwd_workspace(deterministic, "sm_90").dq_strategy == pp.DQ_ORDERED


def test_an_atomic_backward_program_runs_two_key_blocks_but_in_the_wide_tiles():
    """TILES = 2 (kernels/v3/fmha_bwd.py) in the atomic dK/dV kernels of the tiles of two consumers of keys
    (64, 128 and 192/128); the wide program and every ORDERED kernel take one key block a program."""
    for v in v3.variants("sm_90"):
        if v["function"] == "fmha_bwd_dkdv":
            pair = (v["traits"]["head_dim_qk_tile"], v["traits"]["head_dim_v_tile"])
            keys_split = pair not in v3.BWD_WIDE_PAIRS
            assert v["constexprs"]["TILES"] == (2 if keys_split else 1) and v["constexprs"]["BLOCK_N"] == (
                128 if keys_split else 64)
        elif v["function"] == "fmha_bwd_dkdv_ordered":
            assert "TILES" not in v["constexprs"]


def test_the_backward_workspace_is_the_atomic_strategys_with_descriptors(v3_on):
    p = problem(heads_k=8, head_dim_qk=100, head_dim_v=100)
    workspace = dispatch.bwd_workspace(p, "sm_90")
    assert workspace.dq_strategy == pp.DQ_ATOMIC and workspace.dq_splits == 1 and workspace.needs_zeroing
    names = [r.name for r in workspace.regions]
    assert names[:4] == ["delta", "lse2", "dq_acc", v3.DESCRIPTOR_REGION] and names[4:]  # then padding
    assert workspace.region("dq_acc").zero_init
    descriptors = workspace.region(v3.DESCRIPTOR_REGION)
    programs = math.ceil(300 / 256) * 8 * 2  # Hk = 8; two key blocks of 128 a program
    assert descriptors.nbytes == v3.bwd_global_scratch("fmha_bwd_dkdv", (128, 128)) * programs
    assert descriptors.offset % v3.GLOBAL_SCRATCH_ALIGN == 0


def backward_operands(workspace) -> Operands:
    """A backward's operands for problem(): GQA 8/2, 300 rows, head dim 128; the regions of `workspace`."""
    rows, kv_rows = (300 * 8 * 128, 8 * 128, 128, 1), (300 * 2 * 128, 2 * 128, 128, 1)
    strides = {"q": rows, "k": kv_rows, "v": kv_rows, "out": rows, "lse": (8 * 300, 300, 1), "dout": rows,
               "dq": rows, "dk": kv_rows, "dv": kv_rows}
    return pointed_operands(strides, [r.name for r in workspace.regions])


def test_the_backward_plan_is_the_atomic_strategy_with_the_v3_kernels(v3_on):
    p = problem(window_right=0)  # GQA 8/2
    workspace = dispatch.bwd_workspace(p, "sm_90")
    tensors = backward_operands(workspace)
    launches = dispatch.plan_bwd(p, "sm_90", tensors)
    assert [launch.variant for launch in launches] == [v3.preprocess_key("bf16", 128),
                                                       v3.dkdv_key("bf16", (128, 128)),
                                                       v3.dq_convert_key("bf16", 128)]
    # the same arguments as the portable plan of the atomic strategy (built for the interpreter), whose
    # workspace regions are laid out as the v3 one's before its descriptors
    portable = pp.plan_bwd(p, pp.INTERPRET_ARCH, tensors, pp.DQ_ATOMIC)
    assert [r.name for r in pp.bwd_workspace(p, pp.INTERPRET_ARCH, pp.DQ_ATOMIC).regions] == ["delta", "lse2", "dq_acc"]
    for launch, twin in zip(launches, portable):
        assert launch.args == {**twin.args, **({"global_scratch": tensors.regions[v3.DESCRIPTOR_REGION]}
                                               if launch.variant.startswith("fmha_bwd_dkdv") else {})}
    # a program per two key blocks of 128 of a kv head
    assert launches[1].grid == (2, 2, 2) and launches[1].args["DqAcc"] is tensors.regions["dq_acc"]
    assert launches[1].args["kv_group_size"] == 4


def test_causal_gqa_of_the_128_tile_takes_programs_of_one_query_head_from_1024_keys():
    """v3.31's measured lengths (NOTES.md): causal GQA from 1024 keys, 1.06-1.35x the per-key-head program at
    1k-16k on an H100; without a mask never (0.83-0.97x); MHA and deterministic calls never."""
    assert v3.BWD_HEADS_GQA_SEQLEN_K == {((128, 128), True): (1024, 1 << 31)}
    for seqlen, mask, heads in ((1023, True, False), (1024, True, True), (16384, True, True), (4096, False, False)):
        p = problem(seqlen_q=seqlen, seqlen_k=seqlen, **({"window_right": 0} if mask else {}))
        assert v3.bwd_heads(p) == heads, (seqlen, mask)
    assert not v3.bwd_heads(problem(window_right=0, seqlen_q=4096, seqlen_k=4096, heads_k=8))
    assert not v3.bwd_heads(problem(window_right=0, seqlen_q=4096, seqlen_k=4096, deterministic=True))


def test_gqa_programs_of_one_query_head_add_into_fp32_dk_dv_then_convert_them(v3_on, monkeypatch):
    """Where BWD_HEADS_GQA_SEQLEN_K holds (switched on here at every length of causal calls), GQA's dK/dV runs a
    program per (two key blocks, query head, batch entry) that adds into the zeroed fp32 regions dk_acc and
    dv_acc ([B, Sk, Hk, ceil8(D)]), which the dQ conversion's kernel then makes into dK and dV (unscaled: the
    kernel scaled dK), over key rows and key heads; everything else as the per-key-head plan."""
    p = problem(window_right=0)  # GQA 8/2, causal, 300 rows, D = 128
    assert not v3.bwd_heads(p) and not v3.bwd_heads(problem(window_right=0, seqlen_q=4096, seqlen_k=4096, heads_k=8))
    switched_on = {((128, 128), True): (0, 1 << 31)}
    monkeypatch.setattr(v3, "BWD_HEADS_GQA_SEQLEN_K", switched_on)
    workspace = dispatch.bwd_workspace(p, "sm_90")
    tensors = backward_operands(workspace)
    monkeypatch.setattr(v3, "BWD_HEADS_GQA_SEQLEN_K", {})  # the per-key-head plan of the same operands
    plain_launches = dispatch.plan_bwd(p, "sm_90", tensors)
    monkeypatch.setattr(v3, "BWD_HEADS_GQA_SEQLEN_K", switched_on)
    assert v3.bwd_heads(p) and not v3.bwd_heads(problem()) and not v3.bwd_heads(problem(window_right=0, heads_k=8))
    assert not v3.bwd_heads(problem(window_right=0, deterministic=True))
    for name in ("dk_acc", "dv_acc"):
        region = workspace.region(name)
        assert region.zero_init and region.dtype == "fp32" and region.nbytes == 4 * 2 * 300 * 2 * 128
    programs = math.ceil(300 / 256) * 8 * 2  # a program per two key blocks of a query head
    assert workspace.region(v3.DESCRIPTOR_REGION).nbytes == v3.bwd_global_scratch("fmha_bwd_dkdv", (128, 128)) * programs
    launches = dispatch.plan_bwd(p, "sm_90", tensors)
    convert = v3.dq_convert_key("bf16", 128)
    assert [launch.variant for launch in launches] == [v3.preprocess_key("bf16", 128), v3.dkdv_heads_key("bf16", (128, 128)),
                                                       convert, convert, convert]
    heads, dk, dv = launches[1:4]
    assert heads.grid == (2, 8, 2)
    acc_strides = {"b": 300 * 2 * 128, "s": 2 * 128, "h": 128}  # [B, Sk, Hk, 128] fp32, in elements
    assert heads.args["dK"] is tensors.regions["dk_acc"] and heads.args["dV"] is tensors.regions["dv_acc"]
    for name in ("dk", "dv"):
        assert {axis: heads.args[f"stride_{name}_{axis}"] for axis in "bsh"} == acc_strides
    outputs = {"dK", "dV"} | {f"stride_{n}_{axis}" for n in ("dk", "dv") for axis in "bsh"}
    plain_args = plain_launches[1].args
    assert {k: v for k, v in heads.args.items() if k not in outputs | {"global_scratch"}} == \
        {k: v for k, v in plain_args.items() if k not in outputs | {"global_scratch"}}
    for launch, name, output in ((dk, "dk_acc", tensors.dk), (dv, "dv_acc", tensors.dv)):
        assert launch.grid == (math.ceil(300 / 64), 2, 2)  # key rows, key heads, batch
        assert launch.args["DqAcc"] is tensors.regions[name] and launch.args["dQ"] is output.pointer
        assert {axis: launch.args[f"stride_dqacc_{axis}"] for axis in "bsh"} == acc_strides
        assert [launch.args[f"stride_dq_{axis}"] for axis in "bsh"] == list(output.strides[:3])
        assert launch.args["seqlen_q"] == 300 and launch.args["softmax_scale"] == 1.0
        assert launch.args["head_dim_qk_div8"] == 16
    assert launches[4].args == plain_launches[2].args  # dQ's conversion as before


def test_a_served_backward_launches_the_v3_kernels_and_zeroes_the_accumulator(monkeypatch, rt, driver, v3_on):
    from test_plan_cache import bwd

    x = Inputs(rt)
    bwd(x)()
    launched = driver.take()
    assert [key for key, *_ in launched] == [v3.preprocess_key("fp16", 64), v3.dkdv_key("fp16", (64, 64)),
                                             v3.dq_convert_key("fp16", 64)]
    assert fmha_rt.last_launch_info()["family"] == v3.FAMILY
    dkdv = unpack(launched[1][0], launched[1][2])
    workspace = (x.workspace.ptr, x.workspace.ptr + (1 << 20))
    assert workspace[0] <= dkdv["DqAcc"] < dkdv["global_scratch"] < workspace[1]
    assert dkdv["dK"] == x.dk.ptr and dkdv["dV"] == x.dv.ptr
    assert (0, dkdv["DqAcc"]) in [(dev, ptr) for dev, ptr, _ in rt.memsets]  # the accumulator starts at zero
    deterministic = fmha_rt.mha_bwd(x.dout, x.q, x.k, x.v, x.out, x.lse, dq=x.dq, dk=x.dk, dv=x.dv,
                                    deterministic=True, workspace_alloc=lambda n, z: x.workspace)
    assert deterministic and all(not key.startswith("fmha_bwd_dkdv_v3") for key, *_ in driver.take())


@pytest.mark.parametrize("shape, kernel", [({"hq": 8, "hk": 2}, "fmha_bwd_dkdv_v3_fp16_d64"),
                                           ({"d": 60}, "fmha_bwd_dkdv_v3_fp16_d64")], ids=["GQA", "head dim 60 (padded)"])
def test_a_served_backward_hits_the_plan_cache_with_what_an_uncached_call_launches(monkeypatch, rt, driver, v3_on,
                                                                                      shape, kernel):
    from test_plan_cache import bwd

    first, second = Inputs(rt, **shape), Inputs(rt, **shape)
    expected = uncached(monkeypatch, driver, bwd(second, causal=True))
    assert kernel in [key for key, *_ in expected]
    for _ in range(2):  # seen twice: recorded
        bwd(first, causal=True)()
    driver.take()
    bwd(second, causal=True)()
    assert hits() == 1
    # the workspace is the caller's (workspace_alloc): every byte, the descriptors' address included, is the same
    assert driver.take() == expected



# ------------------------------------------------------------------------- the deterministic (ORDERED) backward


@pytest.fixture
def ordered_on(monkeypatch):
    monkeypatch.setattr(v3, "ORDERED_FOR_DETERMINISTIC", frozenset({"sm_90"}))


@pytest.mark.parametrize("case", BWD_SERVED)
def test_deterministic_calls_take_the_ordered_form_where_switched_on(case, ordered_on, monkeypatch):
    """At every length, by request of ORDERED or of nothing; a request for another strategy, another arch
    or the 'off' mode keeps the portable family."""
    monkeypatch.setattr(v3, "MODE", "measured")
    p = problem(**BWD_SERVED[case], deterministic=True)
    assert v3.serves_bwd(p, "sm_90") and v3.serves_bwd(p, "sm_90", pp.DQ_ORDERED)
    assert dispatch.bwd_workspace(p, "sm_90").dq_strategy == pp.DQ_ORDERED
    for request in (pp.DQ_ATOMIC, pp.DQ_FUSED, pp.DQ_DETERMINISTIC):
        assert not v3.serves_bwd(p, "sm_90", request)
    assert not v3.serves_bwd(p, "gfx942")
    non_deterministic = problem(**BWD_SERVED[case])
    assert not v3.serves_bwd(non_deterministic, "sm_90", pp.DQ_ORDERED)
    monkeypatch.setattr(v3, "MODE", "off")
    assert not v3.serves_bwd(p, "sm_90")
    monkeypatch.setattr(v3, "MODE", "all")
    monkeypatch.setattr(v3, "ORDERED_FOR_DETERMINISTIC", frozenset())
    assert not v3.serves_bwd(p, "sm_90")  # off by default at these lengths, whatever the mode


# (tile pair's head dims, heads_k of 8 query heads, causal): the measured length and the one below it
ORDERED_DEFAULTS = {"D=64 MHA": (64, 8, False, 4096, 2048), "D=64 MHA causal": (64, 8, True, 8192, 4096),
                    "D=128 MHA": (128, 8, False, 4096, 2048), "D=128 MHA causal": (128, 8, True, 8192, 4096),
                    "D=128 GQA": (128, 2, False, 2048, 1024), "D=128 GQA causal": (128, 2, True, 2048, 1024),
                    "D=256": (256, 8, False, 16384, 8192)}


@pytest.mark.parametrize("case", ORDERED_DEFAULTS)
@pytest.mark.parametrize("mode", ["measured", "all"])
def test_deterministic_calls_take_the_ordered_form_from_the_measured_lengths(case, mode, monkeypatch):
    """Switched off everywhere (ORDERED_FOR_DETERMINISTIC empty), a deterministic call still takes the ORDERED
    form from MEASURED_ORDERED_MIN_SEQLEN_K's length, dense and without a window other than causal; below
    it, varlen, with a sliding window or in the 'off' mode, the portable family's deterministic backward."""
    head_dim, heads_k, causal, keys, below = ORDERED_DEFAULTS[case]
    monkeypatch.setattr(v3, "MODE", mode)
    shape = dict(batch=1, heads_q=8, heads_k=heads_k, head_dim_qk=head_dim, head_dim_v=head_dim, deterministic=True,
                 window_right=0 if causal else -1)
    p = problem(**shape, seqlen_q=keys, seqlen_k=keys)
    assert v3.serves_bwd(p, "sm_90") and dispatch.bwd_workspace(p, "sm_90").dq_strategy == pp.DQ_ORDERED
    assert not v3.serves_bwd(problem(**shape, seqlen_q=below, seqlen_k=below), "sm_90")
    assert not v3.serves_bwd(p, "gfx942")
    assert not v3.serves_bwd(problem(**{**shape, "window_left": 256, "window_right": 0}, seqlen_q=keys, seqlen_k=keys),
                             "sm_90")
    assert not v3.serves_bwd(problem(**shape, seqlen_q=keys, seqlen_k=keys, varlen=True, total_q=keys, total_k=keys),
                             "sm_90")
    monkeypatch.setattr(v3, "MODE", "off")
    assert not v3.serves_bwd(p, "sm_90")


@pytest.mark.parametrize("changes", [dict(head_dim_qk=64, head_dim_v=64, heads_k=2),
                                     dict(head_dim_qk=256, head_dim_v=256, window_right=0),
                                     dict(head_dim_qk=192, head_dim_v=128, heads_k=2)],
                         ids=["D=64 GQA", "D=256 causal", "192/128 GQA"])
def test_deterministic_calls_where_the_ordered_form_never_led_keep_the_portable_family(changes, monkeypatch):
    monkeypatch.setattr(v3, "MODE", "measured")
    p = problem(**{**dict(batch=1, heads_q=8, heads_k=8, seqlen_q=16384, seqlen_k=16384, deterministic=True), **changes})
    assert not v3.serves_bwd(p, "sm_90")
    assert dispatch.bwd_workspace(p, "sm_90") == pp.bwd_workspace(p, "sm_90")


def test_deterministic_192_128_calls_take_the_ordered_keys_split_tile_from_1024_keys(monkeypatch):
    """v3.33 (1.13-1.73x the portable deterministic backward at 1k-16k): MHA calls of the 192/128 tile, causal
    or not, from 1024 keys, a program per 128-key block taken by ticket, its consumers adding dQ without a
    writer (fewer descriptors)."""
    monkeypatch.setattr(v3, "MODE", "measured")
    for causal, keys, served in ((False, 1024, True), (True, 16384, True), (False, 1023, False)):
        p = problem(batch=1, heads_q=8, heads_k=8, seqlen_q=keys, seqlen_k=keys, head_dim_qk=192, head_dim_v=128,
                    deterministic=True, **({"window_right": 0} if causal else {}))
        assert v3.serves_bwd(p, "sm_90") == served, (causal, keys)
    assert v3.BWD_TILES[v3.LATENT_PAIR].block_n == 128
    assert v3.bwd_global_scratch("fmha_bwd_dkdv_ordered", v3.LATENT_PAIR) == 12 * v3.DESCRIPTOR_BYTES


@pytest.mark.parametrize("changes", [dict(bias_shape="1HSS", bias_grad=True), dict(dropout_p=0.1)],
                         ids=["bias", "dropout"])
def test_the_ordered_form_leaves_what_the_family_does_not_serve(changes, ordered_on):
    p = problem(heads_k=8, deterministic=True, **changes)
    assert not v3.serves_bwd(p, "sm_90")
    assert dispatch.bwd_workspace(p, "sm_90") == pp.bwd_workspace(p, "sm_90")


@pytest.mark.parametrize("head_dim,pair,rows", [(100, (128, 128), 64), (64, (64, 64), v3.BWD_D64_ROWS)],
                         ids=["128-tile", "64-tile"])
def test_the_ordered_workspace_has_counters_for_the_tiles_query_blocks(head_dim, pair, rows, ordered_on):
    """Delta, Lse2, one zeroed fp32 dQ, then the zeroed int32 order region: a ticket and one counter per
    (batch entry, query head, query block of the tile's rows), then the descriptors and the padding."""
    assert v3.BWD_TILES[pair].block_m == rows
    p = problem(heads_k=2, head_dim_qk=head_dim, head_dim_v=head_dim, deterministic=True)
    workspace = dispatch.bwd_workspace(p, "sm_90")
    assert workspace.dq_strategy == pp.DQ_ORDERED and workspace.dq_splits == 1
    names = [r.name for r in workspace.regions]
    assert names[:5] == ["delta", "lse2", "dq_acc", "dq_order", v3.DESCRIPTOR_REGION]
    assert bool(names[5:]) == (head_dim != pair[0])  # padding buffers for heads narrower than their tile
    order = workspace.region("dq_order")
    assert order.zero_init and order.dtype == "i32"
    assert order.nbytes == 4 * (1 + 2 * 8 * math.ceil(300 / rows))
    descriptors = workspace.region(v3.DESCRIPTOR_REGION)
    assert descriptors.nbytes == v3.bwd_global_scratch("fmha_bwd_dkdv_ordered", pair) * math.ceil(300 / 128) * 2 * 2


def test_the_ordered_plan_is_the_portable_ordered_launch_with_a_program_per_item(ordered_on):
    p = problem(window_right=0, deterministic=True)  # GQA 8/2
    workspace = dispatch.bwd_workspace(p, "sm_90")
    tensors = backward_operands(workspace)
    launches = dispatch.plan_bwd(p, "sm_90", tensors)
    assert [launch.variant for launch in launches] == [v3.preprocess_key("bf16", 128),
                                                       v3.dkdv_key("bf16", (128, 128), pp.DQ_ORDERED),
                                                       v3.dq_convert_key("bf16", 128)]
    # the portable ORDERED plan's arguments (built for the interpreter), plus the descriptors
    portable = pp.plan_bwd(p, pp.INTERPRET_ARCH, tensors, pp.DQ_ORDERED)
    for launch, twin in zip(launches, portable):
        assert launch.args == {**twin.args, **({"global_scratch": tensors.regions[v3.DESCRIPTOR_REGION]}
                                               if launch.variant.startswith("fmha_bwd_dkdv") else {})}
    main = launches[1]
    assert main.grid == (3 * 2 * 2, 1, 1)  # key blocks x key heads x batch entries: a program per item
    assert main.args["DqOrder"] is tensors.regions["dq_order"] and main.args["batch"] == 2


def test_a_forced_program_count_launches_the_ordered_items_in_waves(ordered_on, monkeypatch):
    """FMHA_RT_BWD_PROGRAMS=P: at most P programs at once, as launches of P programs that go on taking
    tickets (12 items: 5 + 5 + 2); the same kernel and arguments in each, the same workspace."""
    p = problem(window_right=0, deterministic=True)  # 3 key blocks x 2 key heads x 2 batch entries
    workspace = dispatch.bwd_workspace(p, "sm_90")
    tensors = backward_operands(workspace)
    whole = dispatch.plan_bwd(p, "sm_90", tensors)
    monkeypatch.setenv(pp.BWD_PROGRAMS_ENV, "5")
    assert dispatch.bwd_workspace(p, "sm_90") == workspace
    waves = dispatch.plan_bwd(p, "sm_90", tensors)
    assert [launch.grid for launch in waves[1:-1]] == [(5, 1, 1), (5, 1, 1), (2, 1, 1)]
    assert all(launch.variant == whole[1].variant and launch.args == whole[1].args for launch in waves[1:-1])
    assert waves[0] == whole[0] and waves[-1] == whole[-1]
    monkeypatch.setenv(pp.BWD_PROGRAMS_ENV, "0")
    with pytest.raises(FmhaValueError, match=pp.BWD_PROGRAMS_ENV):
        dispatch.plan_bwd(p, "sm_90", tensors)


def test_a_deterministic_backward_launches_the_ordered_form_and_zeroes_its_counters(monkeypatch, rt, driver,
                                                                                   ordered_on):
    x = Inputs(rt, hq=8, hk=2)
    fmha_rt.mha_bwd(x.dout, x.q, x.k, x.v, x.out, x.lse, dq=x.dq, dk=x.dk, dv=x.dv, deterministic=True,
                    workspace_alloc=lambda n, z: x.workspace)
    launched = driver.take()
    assert [key for key, *_ in launched] == [v3.preprocess_key("fp16", 64), v3.dkdv_key("fp16", (64, 64), pp.DQ_ORDERED),
                                             v3.dq_convert_key("fp16", 64)]
    info = fmha_rt.last_launch_info()
    assert info["family"] == v3.FAMILY
    dkdv = unpack(launched[1][0], launched[1][2])
    zeroed = [ptr for _, ptr, _ in rt.memsets]
    assert dkdv["DqAcc"] in zeroed and dkdv["DqOrder"] in zeroed  # both start at zero: sums and counters
    assert dkdv["global_scratch"] % v3.GLOBAL_SCRATCH_ALIGN == 0
