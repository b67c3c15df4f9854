"""The benchmark harness on a CPU: FLOP counts, the grid and its flags, the report writers on a
synthetic fixture, peer discovery, host overhead and the timing logic (through a stand-in device,
untimed). The sweep's bookkeeping is in test_bench_sweep.py."""

import dataclasses
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import types

import numpy as np
import pytest
import torch

import fmha_rt
from bench_helpers import StandInDevice, table_after, tiny_point
from fmha_rt.bench import cli, flops, grid, machine, overhead, peers, report, sweep, timing

FIXTURE = os.path.join(os.path.dirname(__file__), "data", "bench_sample.json")
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


# ---- FLOPs ----------------------------------------------------------------------------------------

def test_flops_count_the_values_head_dim_where_it_differs():
    # Q K^T at 192 and P V at 128: 2 * (192 + 128) per score element
    assert flops.forward_flops(1, 16, 1024, 1024, 192, causal=False, head_dim_v=128) == 2 * 16 * 1024 * 1024 * 320
    assert flops.pass_flops("bwd", 1, 16, 1024, 1024, 192, True, 128) == 2 * 16 * 1024 * 1024 * 320 // 2 * 5 // 2
    point = grid.Point(kind="dense", pass_name="fwd", dtype="bf16", batch=1, heads_q=16, heads_k=16, seqlen_q=1024,
                       seqlen_k=1024, head_dim=192, causal=False, head_dim_v=128)
    assert point.flops() == 2 * 16 * 1024 * 1024 * 320 and point.fields()["Dv"] == 128 and "D=192/128" in point.label()


def test_forward_flops_match_hand_computed_values():
    # 4 * 2 * 3 * 128 * 128 * 64 = 25_165_824
    assert flops.forward_flops(2, 3, 128, 128, 64, causal=False) == 25_165_824
    assert flops.forward_flops(2, 3, 128, 128, 64, causal=True) == 12_582_912
    assert flops.pass_flops("fwd", 2, 3, 128, 128, 64, False) == 25_165_824


def test_backward_is_two_and_a_half_forwards_and_deterministic_is_the_same_work():
    assert flops.pass_flops("bwd", 2, 3, 128, 128, 64, False) == 62_914_560
    assert flops.pass_flops("bwd_det", 2, 3, 128, 128, 64, True) == 31_457_280
    assert isinstance(flops.pass_flops("bwd", 1, 1, 3, 5, 8, True), int)


def test_causal_with_unequal_lengths_uses_plain_halving():
    # 4 * 1 * 8 * 1024 * 4096 * 128 / 2
    assert flops.forward_flops(1, 8, 1024, 4096, 128, causal=True) == 8_589_934_592


@pytest.mark.parametrize("sq, sk", [(8, 32), (32, 8), (16, 16), (1, 7)])
def test_documented_exact_causal_pair_counts(sq, sk):
    # flops.py documents what the halving convention leaves out; check its formulas by brute force.
    i, j = np.meshgrid(np.arange(sq), np.arange(sk), indexing="ij")
    kept = int(np.count_nonzero(j <= i + sk - sq))
    documented = sq * sk - sq * (sq - 1) // 2 if sq <= sk else sk * (sk + 1) // 2
    assert kept == documented


def test_documented_causal_fraction_for_1k_by_4k():
    kept = 1024 * 4096 - 1024 * 1023 // 2
    assert kept / (1024 * 4096) == pytest.approx(0.875, abs=1e-3)


def test_varlen_flops_sum_over_sequences():
    expected = 4 * 2 * (3 * 3 + 5 * 5) * 16
    assert flops.varlen_pass_flops("fwd", (3, 5), 2, 16, causal=False) == expected
    assert flops.varlen_pass_flops("bwd", (3, 5), 2, 16, causal=True) == expected // 2 * 5 // 2


def test_unknown_pass_is_rejected():
    with pytest.raises(ValueError, match="pass must be one of"):
        flops.pass_flops("backward", 1, 1, 1, 1, 1, False)


def test_tflops_unit():
    assert flops.tflops(2e12, 1000.0) == pytest.approx(2.0)
    assert flops.tflops(1e9, 1.0) == pytest.approx(1.0)


# ---- Grid and flags -------------------------------------------------------------------------------

def test_full_grid_holds_tokens_and_width_fixed():
    points = grid.build_grid()
    by_kind = {kind: [p for p in points if p.kind == kind] for kind in grid.KINDS}
    assert len(by_kind["dense"]) == 2 * 4 * 6 * 2 * 3  # dtypes, head dims, lengths, masks, passes
    assert len(by_kind["gqa"]) == 2 * 6 * 2 * 3
    assert len(by_kind["varlen"]) == 2 * 4 * 2 * 3
    for p in by_kind["dense"] + by_kind["gqa"]:
        assert p.batch * p.seqlen_q == 16384 and p.seqlen_q == p.seqlen_k
        assert p.heads_q * p.dv == 2048
    assert all(p.heads_q == p.heads_k for p in by_kind["dense"])
    assert all(p.heads_q // p.heads_k == 8 and p.head_dim == 128 for p in by_kind["gqa"])
    for p in by_kind["varlen"]:
        assert sum(p.seqlens) == 16384 and p.batch == len(p.seqlens) and p.seqlen_q == max(p.seqlens)
        assert p.heads_q * p.dv == 2048
    # D=192 is the latent-attention shape: values 128 wide, 16 heads; every other head dim is square
    assert {(p.head_dim, p.dv, p.heads_q) for p in points if p.head_dim == 192} == {(192, 128, 16)}
    assert all(p.dv == p.head_dim for p in points if p.head_dim != 192)


def test_varlen_lengths_are_fixed_bounded_and_sum_to_16k():
    lengths = grid.varlen_seqlens()
    assert lengths == grid.varlen_seqlens()
    # Pinned so that runs on different machines and days measure the same batch.
    assert lengths == (547, 1929, 1785, 2012, 3279, 1124, 2456, 3252)
    assert sum(lengths) == 16384
    assert all(grid.VARLEN_MIN <= n <= grid.VARLEN_MAX for n in lengths[:-1]) and 1 <= lengths[-1] <= grid.VARLEN_MAX


def points_for(argv):
    return grid.build_grid(**cli.selection(cli.build_parser().parse_args(argv)))


def test_flags_pick_exact_subsets():
    points = points_for(["--dtype", "fp16", "--hdim", "64", "--seqlen", "1k", "2048", "--causal", "1",
                         "--pass", "bwd", "--gqa", "0", "--varlen", "0"])
    assert [(p.kind, p.dtype, p.head_dim, p.seqlen_q, p.causal, p.pass_name, p.batch, p.heads_q) for p in points] == [
        ("dense", "fp16", 64, 1024, True, "bwd", 16, 32), ("dense", "fp16", 64, 2048, True, "bwd", 8, 32)]


@pytest.mark.parametrize("gqa, varlen, kinds", [
    ("1", "1", ("dense", "gqa", "varlen")), ("0", "1", ("dense", "varlen")), ("0", "0", ("dense",)),
    ("only", "1", ("gqa",)), ("only", "only", ("gqa", "varlen")), ("1", "only", ("varlen",))])
def test_gqa_and_varlen_flags(gqa, varlen, kinds):
    assert cli.selected_kinds(gqa, varlen) == kinds
    assert {p.kind for p in points_for(["--gqa", gqa, "--varlen", varlen])} == set(kinds)


def test_quick_is_a_small_subset_that_flags_override():
    quick = points_for(["--quick"])
    assert len(quick) == 18
    assert {(p.dtype, p.head_dim, p.seqlen_q) for p in quick if p.kind != "varlen"} == {("bf16", 128, 4096)}
    narrowed = points_for(["--quick", "--hdim", "64", "--pass", "fwd"])
    assert {p.head_dim for p in narrowed} == {64} and {p.kind for p in narrowed} == {"dense", "varlen"}
    settings = cli.settings_for(cli.build_parser().parse_args(["--quick", "--repeats", "7"]))
    assert settings.repeats == 7 and settings.warmup_ms == cli.QUICK_MEASURE_DEFAULTS["warmup_ms"]


def test_duplicate_flag_values_are_measured_once():
    assert len(points_for(["--hdim", "64", "64", "--seqlen", "1k", "1024", "--gqa", "0", "--varlen", "0"])) == 2 * 2 * 3


# ---- Command line ---------------------------------------------------------------------------------

def parse_error(capsys, argv):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    return capsys.readouterr().err


def test_bad_hdim_is_a_clear_argparse_error(capsys):
    err = parse_error(capsys, ["--hdim", "96"])
    assert "argument --hdim: invalid choice: 96 (choose from 64, 128, 192, 256)" in err
    assert "Traceback" not in err


def test_seqlen_spellings(capsys):
    assert cli.parse_seqlen("16k") == 16384 and cli.parse_seqlen("2048") == 2048 and cli.parse_seqlen(" 1K") == 1024
    assert "invalid choice: 3072" in parse_error(capsys, ["--seqlen", "3k"])
    assert "not a sequence length: 'abc'" in parse_error(capsys, ["--seqlen", "abc"])


@pytest.mark.parametrize("argv, message", [
    (["--repeats", "0"], "--repeats: must be a whole number >= 1"),
    (["--warmup-ms", "-1"], "--warmup-ms: must be a number >= 0"),
    (["--causal", "yes"], "argument --causal: invalid choice"),
    (["--impl", "fa5"], "argument --impl: invalid choice: 'fa5'"),
    (["--list", "--report", "x.json"], "not allowed with argument"),
    (["--report", "a.json", "b.json"], "give --out DIR"),
    (["--gqa", "only", "--hdim", "64"], "no point matches these flags"),
])
def test_flag_errors(capsys, argv, message):
    assert message in parse_error(capsys, argv)


def test_report_of_a_file_that_is_not_a_record(tmp_path, capsys):
    path = tmp_path / "other.json"
    path.write_text(json.dumps({"rows": []}))
    assert cli.main(["--report", str(path)]) == 1
    assert "is not a benchmark record" in capsys.readouterr().err


# ---- Peers and the machine without a GPU ----------------------------------------------------------

def importable(module):
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def test_missing_peers_are_not_found_and_present_ones_have_versions():
    found = peers.discover()
    assert list(found) == list(peers.PEER_NAMES)
    for spec in peers.PEERS:
        if not importable(spec.module):
            assert found[spec.name].status == "not found" and found[spec.name].adapter is None
            assert "No module named" in found[spec.name].reason
    for name in ("sdpa_cudnn", "sdpa_flash", "sdpa_efficient"):
        assert found[name].status == "found" and found[name].version == torch.__version__


def test_list_names_every_implementation(capsys):
    assert cli.main(["--list"]) == 0
    out = capsys.readouterr().out
    lines = {line.split()[0]: line for line in out.splitlines()[1:]}
    for spec in peers.PEERS:
        if not importable(spec.module):
            assert lines[spec.name].split()[1:3] == ["not", "found"]
    assert lines["sdpa_flash"].split()[-1] == torch.__version__


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour on a machine without a GPU")
def test_run_without_gpu_says_so_and_writes_nothing(tmp_path, capsys):
    out_dir = tmp_path / "out"
    assert cli.main(["--quick", "--out", str(out_dir)]) == 1
    captured = capsys.readouterr()
    assert "no GPU is visible to torch" in captured.err and "Nothing was measured" in captured.err
    assert "Traceback" not in captured.err + captured.out
    assert "sdpa_flash" in captured.out
    assert not out_dir.exists()


def test_unsupported_modes_are_skipped_not_failed():
    sdpa = peers.SdpaAdapter("FLASH_ATTENTION")
    varlen = tiny_point("fwd", seqlens=(5, 9))
    deterministic = tiny_point("bwd_det")
    assert peers.unsupported(sdpa, varlen) == "no varlen interface"
    assert peers.unsupported(sdpa, deterministic) is None  # torch.use_deterministic_algorithms
    assert peers.unsupported(peers.Adapter(), deterministic) == "no deterministic mode"
    assert sweep.planned_pairs([varlen, deterministic, tiny_point("bwd")], {"sdpa_flash": sdpa}) == [
        (deterministic, "sdpa_flash"), (tiny_point("bwd"), "sdpa_flash")]


def test_fmha_rt_adapter_calls_the_public_api(monkeypatch):
    calls = []

    def mha_fwd(q, k, v, *, causal=False, out=None, lse=None, stream=None):
        calls.append(("fwd", causal, None if out is None else tuple(out.shape), None if lse is None else lse.dtype))
        out = torch.empty_like(q) if out is None else out
        return out, torch.empty(q.shape[0], q.shape[2], q.shape[1]) if lse is None else lse

    def mha_bwd(dout, q, k, v, out, lse, *, causal=False, deterministic=False, dq=None, dk=None, dv=None,
                stream=None):
        calls.append(("bwd", causal, deterministic, dq.shape == q.shape and dk.shape == k.shape, stream))
        return dq, dk, dv

    def mha_varlen_fwd(q, k, v, cu_q, cu_k, max_q, max_k, *, causal, out=None, lse=None, stream=None):
        calls.append(("varlen_fwd", cu_q.tolist(), max_q, out is not None))
        return torch.empty_like(q) if out is None else out, torch.empty(q.shape[1], q.shape[0]) if lse is None else lse

    def mha_varlen_bwd(*args, causal, deterministic, dq=None, dk=None, dv=None, stream=None):
        calls.append(("varlen_bwd", args[6].tolist(), args[8], deterministic))
        return dq, dk, dv

    api = {"mha_fwd": mha_fwd, "mha_bwd": mha_bwd, "mha_varlen_fwd": mha_varlen_fwd,
           "mha_varlen_bwd": mha_varlen_bwd,
           "last_launch_info": lambda: {"family": "portable", "kernel": "attn_fwd_d16", "grid": (1, 2, 3)},
           "bwd_workspace_bytes": lambda q, k, v, causal, deterministic: 4096 if deterministic else 0}
    for name, function in api.items():
        monkeypatch.setattr(fmha_rt, name, function, raising=False)
    adapter = peers.FmhaRtAdapter()

    dense = peers.make_case(tiny_point("bwd_det", causal=True), "cpu", seed=1)
    adapter.forward(dense)()
    assert calls.pop() == ("fwd", True, (2, 32, 4, 16), torch.float32)
    adapter.backward(dense, True)()
    assert calls[-2][:2] == ("fwd", True) and calls[-1] == ("bwd", True, True, True, None)
    assert adapter.launch_info() == {"family": "portable", "kernel": "attn_fwd_d16"}
    assert adapter.workspace_bytes(dense, True) == 4096
    # values narrower than the keys (192/128 in the grid): out given at [B, S, Hq, Dv]
    narrow_v = peers.make_case(dataclasses.replace(tiny_point("fwd"), head_dim_v=8), "cpu", seed=1)
    adapter.forward(narrow_v)()
    assert calls.pop() == ("fwd", False, (2, 32, 4, 8), torch.float32)

    varlen = peers.make_case(tiny_point("bwd", seqlens=(5, 9, 3)), "cpu", seed=2)
    assert varlen.q.shape == (17, 2, 16) and varlen.cu_seqlens.tolist() == [0, 5, 14, 17]
    calls.clear()
    adapter.forward(varlen)()
    assert calls == [("varlen_fwd", [0, 5, 14, 17], 9, False), ("varlen_fwd", [0, 5, 14, 17], 9, True)]
    adapter.backward(varlen, False)()
    assert calls[-1] == ("varlen_bwd", [0, 5, 14, 17], 9, False)
    assert adapter.workspace_bytes(varlen, False) is None


def test_fmha_rt_without_the_api_is_not_found(monkeypatch):
    monkeypatch.delattr(fmha_rt, "mha_fwd", raising=False)
    found = peers.discover(["fmha_rt"])["fmha_rt"]
    assert found.status == "not found" and "mha_fwd" in found.reason


def test_case_inputs_are_seeded_and_not_zero():
    point = tiny_point("bwd")
    a, b = peers.make_case(point, "cpu", seed=3), peers.make_case(point, "cpu", seed=3)
    assert torch.equal(a.q, b.q) and torch.equal(a.dout, b.dout)
    assert not torch.equal(a.q, peers.make_case(point, "cpu", seed=4).q)
    assert a.q.dtype == torch.float16 and a.k.shape == (2, 32, 2, 16) and float(a.q.float().std()) > 0.5


def test_pick_smi_row_by_uuid_and_tolerates_na():
    text = "GPU-aaa, 345, 3201, 1980, 580.1\nGPU-bbb, [N/A], 3201, 1980, 580.1\n"
    assert machine.pick_smi_row(text, "bbb", 0) == {"uuid": "GPU-bbb", "clocks.sm": None, "clocks.mem": 3201,
                                                    "clocks.max.sm": 1980, "driver_version": "580.1"}
    assert machine.pick_smi_row(text, None, 0)["clocks.sm"] == 345
    assert machine.pick_smi_row("", None, 0) == {}


def test_host_overhead_on_the_user_path_and_the_raw_api():
    """Every implementation's fwd and fwd+bwd as its users call it, then fmha_rt's raw API rows, in turns: the
    rounds rounded up to a multiple of the entries."""
    adapters = {"fmha_rt": peers.SdpaAdapter("MATH"), "sdpa_math": peers.SdpaAdapter("MATH")}
    rows = overhead.measure_host_overhead(adapters, StandInDevice(), sweep.Settings(overhead_calls=2, rounds=1))
    assert [(r["impl"], r["path"]) for r in rows] == [
        ("fmha_rt", "fwd"), ("fmha_rt", "fwd+bwd"), ("sdpa_math", "fwd"), ("sdpa_math", "fwd+bwd"),
        ("fmha_rt", "raw fwd, outputs given"), ("fmha_rt", "raw bwd, outputs given")]
    for r in rows:
        assert "error" not in r, r
        assert r["us_per_call"] > 0 and len(r["round_us"]) == 6 and (r["batch"], r["heads"], r["seqlen"]) == (1, 2, 128)
        assert r["causal"] is True and r["head_dim"] == 64 and r["dtype"] == "bf16"


def test_error_text_carries_the_warnings():
    warned = [types.SimpleNamespace(message=UserWarning("flash needs D <= 256")),
              types.SimpleNamespace(message=UserWarning("flash needs D <= 256"))]
    text = sweep.describe_error(RuntimeError("No available kernel"), warned)
    assert text == "RuntimeError: No available kernel | warnings: flash needs D <= 256"
    assert len(sweep.describe_error(RuntimeError("x" * 5000))) == sweep.ERROR_CHARS


# ---- Timing logic (a stand-in device; nothing is timed) -------------------------------------------

def test_time_calls_rotates_copies_and_takes_the_median():
    order = []
    calls = [lambda i=i: order.append(i) for i in range(3)]
    result = timing.time_calls(calls, StandInDevice(times=[5.0, 1.0, 3.0, 2.0, 4.0]), warmup_ms=0, repeats=5)
    assert order == [0, 1, 2, 0, 1, 2, 0, 1]
    assert (result.ms, result.ms_min, result.ms_max, result.repeats) == (3.0, 1.0, 5.0, 5)


def test_copies_span_several_l2s():
    mib = 1024**2
    assert timing.copies_needed(64 * mib, 60 * mib) == 4
    assert timing.copies_needed(10**12, 60 * mib) == timing.MIN_COPIES
    assert timing.copies_needed(1024, 60 * mib) == timing.MAX_COPIES
    with pytest.raises(ValueError):
        timing.copies_needed(0)


def test_working_set_bytes_by_hand():
    fwd = tiny_point("fwd")          # B=2 S=32 Hq=4 Hk=2 D=16
    q, kv, lse = 2 * 32 * 4 * 16 * 2, 2 * (2 * 32 * 2 * 16 * 2), 2 * 32 * 4 * 4
    assert timing.working_set_bytes(fwd) == 2 * q + kv + lse
    assert timing.working_set_bytes(tiny_point("bwd")) == 4 * q + 2 * kv + lse
    varlen = tiny_point("fwd", seqlens=(3, 5))
    assert timing.working_set_bytes(varlen) == 2 * (8 * 2 * 16 * 2) + 2 * (8 * 2 * 16 * 2) + 8 * 2 * 4


def test_cold_start_spawn_reports_the_child_and_its_failures():
    assert "cold_start_child('fa4', 1)" in peers.cold_start_code("fa4", 1)
    compile(peers.cold_start_code("fa4", 1), "<cold start>", "exec")
    ok = timing.spawn_until_ready("import json, time\nfrom fmha_rt.bench import timing\n"
                                  "print(timing.READY_MARKER + json.dumps({'ready': time.time(), 'extra': 7}))",
                                  timeout_s=120)
    assert ok["seconds"] > 0 and ok["extra"] == 7 and "error" not in ok
    failed = timing.spawn_until_ready("raise SystemExit('no GPU here')", timeout_s=120)
    assert failed == {"error": "exit status 1: no GPU here"}


# ---- Report writers on the fixture ----------------------------------------------------------------

@pytest.fixture
def fixture_doc():
    doc = report.load(FIXTURE)
    assert doc["header"]["fixture"] is True
    return doc


def test_markdown_table_rows_and_ratios(fixture_doc):
    text = report.markdown(fixture_doc)
    assert "Synthetic test fixture, not a measurement" in text
    headings, body = table_after(text, "## bwd, bf16: TFLOP/s")
    assert headings == ["kind", "B", "Hq/Hk", "S", "D", "causal", "fmha_rt", "sdpa_flash", "fa4",
                        "fmha_rt family", "fmha_rt / best peer"]
    group = [r for r in fixture_doc["rows"] if (r["pass"], r["dtype"]) == ("bwd", "bf16")]
    assert len(body) == len({report.point_key(r) for r in group}) == 16
    for cells in body:
        kind, b, heads, s, d, causal = cells[:6]
        hq, hk = map(int, heads.split("/"))
        match = [r for r in group if (r["kind"], r["B"], r["Hq"], r["Hk"], r["D"], r["causal"]) ==
                 (kind, int(b), hq, hk, int(d), causal == "yes") and (r.get("seqlens") or str(r["Sq"]) == s)]
        by_impl = {r["impl"]: r for r in match}
        for column, impl in zip(cells[6:9], ("fmha_rt", "sdpa_flash", "fa4")):
            row = by_impl.get(impl)
            expected = "–" if row is None else "error" if "error" in row else f"{row['tflops']:.1f}"
            assert column == expected
        best = max((r for i, r in by_impl.items() if i != "fmha_rt" and "tflops" in r), key=lambda r: r["tflops"])
        ratio = by_impl["fmha_rt"]["tflops"] / best["tflops"]  # one round: the ratio of the medians
        assert cells[10].startswith(f"{ratio:.3f} [{ratio:.3f}-{ratio:.3f}] ") and cells[10].endswith(f"({best['impl']})")
        assert cells[9] == by_impl["fmha_rt"]["family"]
    # The one failed point: the ratio is taken against the peer that did run.
    failed = [c for c in body if c[8] == "error"]
    assert len(failed) == 1 and failed[0][10].endswith("(sdpa_flash)")


def test_markdown_sections(fixture_doc):
    text = report.markdown(fixture_doc, ["p.png"])
    _, impls = table_after(text, "## Implementations")
    assert ["fa2", "not found", "ModuleNotFoundError: No module named 'flash_attn'",
            "flash-attn 2 (flash_attn)", "none"] in impls
    _, det = table_after(text, "## bwd_det, bf16: TFLOP/s")
    assert all(len(row) == 10 for row in det)  # sdpa_flash has no deterministic mode: no column
    _, errors = table_after(text, "## Errors")
    assert errors == [["fa4", "dense bwd bf16 B=16 H=32/32 S=1024 D=64 causal",
                       "RuntimeError: synthetic failure for the fixture \\| warnings: made up"]]
    assert "![p.png](p.png)" in text
    assert "| fa4 | – | – | exit status 1: RuntimeError: synthetic failure for the fixture |" in text
    assert "| fa4 | fwd | 20 | 900.0 | 900.0 |" in text


def test_png_plots_one_per_pass_and_dtype(fixture_doc, tmp_path):
    paths = report.write_reports(fixture_doc, str(tmp_path), "sample")
    expected = {f"sample_{p}_{d}.png" for p, d in {(r["pass"], r["dtype"]) for r in fixture_doc["rows"]}}
    expected.add("sample_versus.png")  # fmha_rt over each peer
    assert {os.path.basename(p) for p in paths} == expected | {"sample.md"}
    for name in expected:
        data = (tmp_path / name).read_bytes()
        assert data[:8] == PNG_SIGNATURE and len(data) > 10_000
        width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
        assert width > 300 and height > 200
    assert "![sample_fwd_bf16.png](sample_fwd_bf16.png)" in (tmp_path / "sample.md").read_text()
    assert "![sample_versus.png](sample_versus.png)" in (tmp_path / "sample.md").read_text()
    alone = dict(fixture_doc, rows=[r for r in fixture_doc["rows"] if r["impl"] == "fmha_rt"])
    names = {os.path.basename(p) for p in report.write_reports(alone, str(tmp_path / "alone"), "sample")}
    assert "sample_versus.png" not in names and "sample_fwd_bf16.png" in names


def test_report_flag_needs_only_the_json(tmp_path):
    record = tmp_path / "run.json"
    shutil.copy(FIXTURE, record)
    # torch is made unimportable: the writers must not need it.
    code = ("import sys; sys.modules['torch'] = None\n"
            "from fmha_rt.bench import cli\n"
            f"sys.exit(cli.main(['--report', {str(record)!r}]))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "run.md").exists() and (tmp_path / "run_fwd_bf16.png").exists()
    assert str(tmp_path / "run.md") in proc.stdout


def test_saved_record_has_one_row_a_line(fixture_doc, tmp_path):
    path = str(tmp_path / "r.json")
    report.save(fixture_doc, path)
    assert report.load(path) == fixture_doc
    lines = open(path).read().splitlines()
    row_lines = [line for line in lines if line.startswith('  {"impl": ')]
    assert len(row_lines) == len(fixture_doc["rows"]) + len(fixture_doc["host_overhead"]) + \
        sum(1 for r in fixture_doc["cold_start"])


def test_sources_digest_names_exactly_the_sources_measured(tmp_path):
    """The digest is reproducible, and changes with any package, header, kernel or manifest byte, but not
    with other files (results, caches)."""
    from fmha_rt.bench import machine

    for rel, text in (("pkg/api.py", "x = 1\n"), ("pkg/shim.c", "int f;\n"), ("include/fmha_rt.h", "/* */\n"),
                      ("kernels/portable/fmha_fwd.py", "# k\n"), ("hsa/manifest.json", "{}\n"),
                      ("bench/results/r.json", "{}\n"), ("pkg/__pycache__/api.pyc", "junk")):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    digest = lambda: machine.sources_digest(root=str(tmp_path), package=str(tmp_path / "pkg"))
    first = digest()
    assert digest() == first and len(first) == 64
    for rel in ("bench/results/r.json", "pkg/__pycache__/api.pyc"):
        (tmp_path / rel).write_text("changed")
        assert digest() == first, rel
    for rel in ("pkg/api.py", "pkg/shim.c", "include/fmha_rt.h", "kernels/portable/fmha_fwd.py", "hsa/manifest.json"):
        before = digest()
        (tmp_path / rel).write_text("changed\n")
        assert digest() != before, rel


def test_merge_counts_a_peer_found_in_any_run_as_found(fixture_doc):
    first = json.loads(json.dumps(fixture_doc))
    second = json.loads(json.dumps(fixture_doc))
    first["header"]["impls"]["late_peer"] = {"status": "not found", "version": None, "reason": "ModuleNotFoundError"}
    second["header"]["impls"]["late_peer"] = {"status": "found", "version": "1.0", "reason": None}
    second["rows"] = []  # runs merged must hold disjoint points
    first["header"]["run_id"], second["header"]["run_id"] = "a", "b"
    assert report.merge([first, second])["header"]["impls"]["late_peer"]["status"] == "found"
    assert report.merge([second, first])["header"]["impls"]["late_peer"]["status"] == "found"


def test_the_recorded_command_names_the_output_folder_only():
    from fmha_rt.bench.cli import recorded_command

    argv = ["--hdim", "128", "--out", "/some/private/place/run1/", "--repeats", "10"]
    assert recorded_command(argv) == ["bench", "--hdim", "128", "--out", "run1", "--repeats", "10"]
    assert recorded_command(["--out=/x/y/merged"]) == ["bench", "--out=merged"]
    assert recorded_command(["--pass", "fwd"]) == ["bench", "--pass", "fwd"]


def test_report_gives_each_figure_its_range_over_the_rounds(fixture_doc):
    """With several rounds a TFLOP/s cell also shows its slowest and fastest round, from round_ms."""
    doc = json.loads(json.dumps(fixture_doc))
    doc["header"]["settings"]["rounds"] = 3
    row = next(r for r in doc["rows"] if (r["impl"], r["pass"], r["dtype"]) == ("fmha_rt", "bwd", "bf16")
               and "tflops" in r)
    row["round_ms"] = [row["ms"] * 1.02, row["ms"], row["ms"] * 0.97]
    slowest, fastest = (flops.tflops(row["flops"], row["ms"] * f) for f in (1.02, 0.97))
    expected = f"{row['tflops']:.1f} [{slowest:.0f}-{fastest:.0f}]"
    _, body = table_after(report.markdown(doc), "## bwd, bf16: TFLOP/s")
    cells = [c[6] for c in body]
    assert cells.count(expected) == 1 and sum("[" in c for c in cells) == 1
    assert "`[a-b]` after a figure: its slowest and fastest round" in report.markdown(doc)
    assert report.round_range_text({"flops": 1e12, "round_ms": [1.0]}) == ""


def test_report_says_how_many_rounds_were_timed(fixture_doc):
    doc = json.loads(json.dumps(fixture_doc))
    repeats = doc["header"]["settings"]["repeats"]
    doc["header"]["settings"]["rounds"] = 3
    assert f"Median of {repeats} calls a turn" in report.markdown(doc)
    assert "in 3 rounds (rounded up at each point to a multiple of its implementations" in report.markdown(doc)
