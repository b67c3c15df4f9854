"""The ORDERED dQ strategy (kernels/portable/dq_order.py): its rank, counters, tickets and planning.

The interpreter runs a launch's programs one after another, so no program ever waits here: the first
program takes every work item by ticket and the later ones find none (the additions into each dQ tile then
come in key-block order trivially). What the CPU checks is the rest: the rank each key block waits for is
the number of key blocks before it that visit the query block (a wrong rank would wait forever), every
tile's counter ends at the number of key blocks that added into it, the ticket hands out every item, and
the outputs agree with float64 (test_portable_kernels.py) bit for bit whatever the number of programs.
Bitwise equality with programs running at once, over runs, streams and threads is tests/gpu's.
"""
import json
import os
import pathlib
import random
import subprocess
import sys

import pytest
import torch

import interpret_exec as ie
from fmha_rt.errors import FmhaValueError
from fmha_rt.plan import portable as pp
from fmha_rt.plan.operands import Operands
from fmha_rt.plan.problem import AttentionProblem
from fmha_rt.runtime.registry import SCRATCH_POINTERS, Registry

REPO = pathlib.Path(__file__).resolve().parents[2]
SEED = 33


def _rank_cases():
    """Masks and tiles: every alignment and window kind at sequence lengths around the tile sizes, and the v3
    backward's tile (64 query rows, 128 keys: kernels/v3/fmha_bwd.py's ORDERED form uses the same helpers)."""
    rng = random.Random(SEED)
    windows = [(-1, -1), (-1, 0), (0, 0), (7, 3), (16, -1), (2, 1), (0, 40), (-1, 5)]
    cases = []
    for _ in range(160):
        left, right = rng.choice(windows)
        cases.append((rng.choice([1, 15, 16, 17, 40, 64, 100]), rng.choice([0, 1, 16, 31, 40, 70, 129]), left, right,
                      rng.random() < 0.5, rng.choice([16, 32, 64]), rng.choice([16, 32, 64])))
    for _ in range(40):
        left, right = rng.choice(windows + [(100, 0), (200, 70)])
        cases.append((rng.choice([1, 63, 64, 65, 200, 300]), rng.choice([1, 127, 128, 129, 300, 520]), left, right,
                      rng.random() < 0.5, 64, 128))
    return cases


def _worker(cases) -> list:
    """ordered_rank_worker.py's answer (a JSON object) to each case, under the interpreter."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "tests/cpu")]))
    run = subprocess.run([sys.executable, str(REPO / "tests/cpu/ordered_rank_worker.py")], env=env, text=True,
                         input="".join(json.dumps(c) + "\n" for c in cases), capture_output=True, timeout=600)
    assert run.returncode == 0, run.stderr
    return [json.loads(line) for line in run.stdout.splitlines()]


def _visiting_ranks(cases):
    """{case: [(key block, query block, rank)]} from ordered_rank_worker.py under the interpreter."""
    return {case: answer["ranks"] for case, answer in zip(cases, _worker(cases))}


def test_chunked_tickets_hand_out_every_item_once_a_slots_key_blocks_in_order():
    """dq_order.ticket_item: every (key block, slot) has one ticket; within a slot a smaller key block has a
    smaller ticket (what lets every program finish); CHUNK = 1 numbers key block slowest, and with CHUNK = c the
    first c * slots tickets are the first c key blocks of every slot."""
    cases = [(kb, slots, chunk) for kb in (1, 3, 8, 13) for slots in (1, 2, 5) for chunk in (1, 4, 8)]
    for (key_blocks, slots, chunk), answer in zip(cases, _worker([{"tickets": c} for c in cases])):
        items = [tuple(item) for item in answer["items"]]
        assert sorted(items) == [(n, s) for n in range(key_blocks) for s in range(slots)], (key_blocks, slots, chunk)
        for s in range(slots):
            tickets = [i for i, (_, slot) in enumerate(items) if slot == s]
            assert [items[i][0] for i in tickets] == list(range(key_blocks)), (key_blocks, slots, chunk, s)
        if chunk == 1:
            assert items == [(i // slots, i % slots) for i in range(key_blocks * slots)]
        first = min(chunk, key_blocks) * slots
        assert {n for n, _ in items[:first]} == set(range(min(chunk, key_blocks)))


def _visitors(ranks):
    """{query block: [(key block, rank)] in key-block order}."""
    out = {}
    for n, m, rank in sorted(ranks):
        out.setdefault(m, []).append((n, rank))
    return out


def test_rank_counts_the_earlier_key_blocks_that_visit_the_query_block():
    print(f"seed {SEED}")
    cases = _rank_cases()
    for case, ranks in _visiting_ranks(cases).items():
        for m, visitors in _visitors(ranks).items():
            assert [rank for _, rank in visitors] == list(range(len(visitors))), (case, m, visitors)


def _problem(**extra):
    # GQA 4/2, causal bottom-right with Sq < Sk: query blocks are seen by different numbers of key blocks
    return AttentionProblem(2, 40, 70, 4, 2, 32, 32, "fp16", window_left=-1, window_right=0, bottom_right=True,
                            deterministic=True, **extra)


def _run(problem, seed, programs, monkeypatch):
    monkeypatch.setenv(pp.BWD_PROGRAMS_ENV, str(programs))
    gen = torch.Generator().manual_seed(seed)
    b, sq, sk, hq, hk, d = (problem.batch, problem.seqlen_q, problem.seqlen_k, problem.heads_q, problem.heads_k,
                            problem.head_dim_qk)
    inputs = {"q": torch.randn(b, sq, hq, d, generator=gen).half(), "k": torch.randn(b, sk, hk, d, generator=gen).half(),
              "v": torch.randn(b, sk, hk, d, generator=gen).half()}
    out, lse = ie.forward(problem, inputs)
    dout = torch.randn(*out.shape, generator=gen).half()
    workspace = {}
    grads = ie.backward(problem, inputs, out, lse, dout, dq_strategy=pp.DQ_ORDERED, workspace=workspace)[:3]
    return grads, workspace


def test_counters_end_at_the_visiting_key_blocks_and_the_ticket_hands_out_every_item(monkeypatch):
    problem = _problem()
    tile = pp.tile_for(pp.INTERPRET_ARCH, "bwd_dkdv", (32, 32), pp.BIAS_NONE, False)
    _, workspace = _run(problem, 71, 1, monkeypatch)
    order = workspace["dq_order"]
    key_blocks, query_blocks = -(-problem.seqlen_k // tile.block_n), -(-problem.seqlen_q // tile.block_m)
    items = key_blocks * problem.heads_k * problem.batch
    assert int(order[0]) == items + 1  # one program: every item, then the ticket that found none
    case = (problem.seqlen_q, problem.seqlen_k, problem.window_left, problem.window_right, True, tile.block_m,
            tile.block_n)
    visitors = _visitors(_visiting_ranks([case])[case])
    want = torch.tensor([len(visitors.get(m, [])) for m in range(query_blocks)], dtype=torch.int32)
    assert want.min() >= 1 and want.max() > want.min()  # the case is not trivial
    counters = order[1:].view(problem.batch, problem.heads_q, query_blocks)
    assert torch.equal(counters, want.expand_as(counters))


def test_outputs_are_the_same_bits_for_any_number_of_programs(monkeypatch):
    problem = _problem()
    runs = {}
    for programs in (1, 3, 10_000):
        grads, workspace = _run(problem, 72, programs, monkeypatch)
        planned = pp.ordered_programs(problem, pp.INTERPRET_ARCH)
        assert int(workspace["dq_order"][0]) == _items(problem) + planned
        runs[programs] = [g.view(torch.int16) for g in grads]
    assert pp.ordered_programs(problem, pp.INTERPRET_ARCH) == _items(problem)  # 10_000 clamped to the items
    for programs, bits in runs.items():
        for name, got, want in zip(("dq", "dk", "dv"), bits, runs[1]):
            assert torch.equal(got, want), (programs, name)


def _items(problem):
    block_n = pp.tile_for(pp.INTERPRET_ARCH, "bwd_dkdv", (32, 32), pp.BIAS_NONE, False).block_n
    return -(-problem.seqlen_k // block_n) * problem.heads_k * problem.batch


# ---------------------------------------------------------------------------------------------- planning


@pytest.mark.parametrize("arch", pp.BUILD_ARCHS)
def test_deterministic_calls_take_the_ordered_strategy_where_switched_on_and_the_others_stay_selectable(
        arch, monkeypatch):
    monkeypatch.delenv(pp.BWD_PROGRAMS_ENV, raising=False)
    det = AttentionProblem(4, 4096, 4096, 16, 4, 128, 128, "bf16", window_left=-1, window_right=0, deterministic=True)
    assert pp.dq_strategy(det, arch) != pp.DQ_ORDERED  # no GPU arch takes it by default until measured
    monkeypatch.setattr(pp, "ORDERED_FOR_DETERMINISTIC", frozenset({arch}))
    assert pp.dq_strategy(det, arch) == pp.DQ_ORDERED
    assert pp.dq_strategy(det, arch, pp.DQ_DETERMINISTIC) == pp.DQ_DETERMINISTIC
    non_det = AttentionProblem(4, 4096, 4096, 16, 4, 128, 128, "bf16", window_left=-1, window_right=0)
    assert pp.dq_strategy(non_det, arch) != pp.DQ_ORDERED
    assert pp.dq_strategy(non_det, arch, pp.DQ_ORDERED) == pp.DQ_ORDERED
    shapes = {"q": (4, 4096, 16, 128), "k": (4, 4096, 4, 128), "lse": (4, 16, 4096)}
    arrays = {name: torch.empty(shapes.get(name, shapes["q" if name in ("out", "dout", "dq") else "k"]), device="meta")
              for name in ("q", "k", "v", "out", "lse", "dout", "dq", "dk", "dv")}
    arrays.update({region: torch.empty(1, device="meta") for region in ("delta", "lse2", "dq_acc", "dq_order")})
    operands = Operands.of_arrays(arrays, address=lambda array: 0)
    launches = pp.plan_bwd(det, arch, operands)
    assert [launch.variant for launch in launches] == [
        pp.preprocess_key("bf16", 128), pp.dkdv_key("bf16", (128, 128), pp.BIAS_NONE, False, pp.DQ_ORDERED),
        pp.dq_convert_key("bf16", 128)]
    assert launches[1].grid == (pp.ORDERED_PROGRAMS[arch], 1, 1) and launches[1].args["batch"] == 4
    monkeypatch.setenv(pp.BWD_PROGRAMS_ENV, "7")
    assert pp.plan_bwd(det, arch, operands)[1].grid == (7, 1, 1)


def test_the_one_launch_backward_keeps_tiny_deterministic_calls():
    tiny = AttentionProblem(1, 64, 64, 2, 2, 64, 64, "bf16", deterministic=True)
    assert pp.dq_strategy(tiny, "sm_90") == pp.DQ_SINGLE


@pytest.mark.parametrize("value", ["0", "-3", "abc", "2.5", "\u0663"])
def test_a_forced_program_count_must_be_a_positive_integer(value, monkeypatch):
    monkeypatch.setenv(pp.BWD_PROGRAMS_ENV, value)
    with pytest.raises(FmhaValueError, match=pp.BWD_PROGRAMS_ENV):
        pp.ordered_programs(_problem(), "sm_90")


# -------------------------------------------------------------------------------------------- code objects


@pytest.mark.parametrize("arch", pp.BUILD_ARCHS)
def test_every_ordered_code_object_is_built_and_agrees_with_its_signature(arch):
    """The manifest holds every variant of the ORDERED strategy (the persistent dK/dV pass, the pre-pass and
    the conversion it runs) with the signature's parameters in order, and each binary's own parameter table
    agrees with the manifest's layout (Registry.image refuses one that does not)."""
    reg = Registry(REPO / "hsa")
    wanted = [v for v in pp.variants(arch) if v["function"] == "fmha_bwd_dkdv_ordered"
              or v["key"].startswith(("fmha_bwd_preprocess_", "fmha_bwd_dq_convert_"))]
    assert len([v for v in wanted if v["function"] == "fmha_bwd_dkdv_ordered"]) >= 60
    for variant in wanted:
        entry = reg.entry(arch, variant["key"])
        names = [n for n, kind in variant["signature"].items() if kind != "constexpr"] + list(SCRATCH_POINTERS)
        assert [p.name for p in entry.params] == names, variant["key"]
        if variant["function"] == "fmha_bwd_dkdv_ordered":
            assert entry.traits["dq_strategy"] == pp.DQ_ORDERED and entry.traits["deterministic"]
        reg.image(entry)
