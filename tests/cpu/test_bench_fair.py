"""The benchmark's fairness on a CPU (issue 30): the fp32 reference against the float64 oracle, the correctness
gate (a planted wrong implementation is flagged, not timed, in no ratio), equal turns, ratios within one run
(median of per-round ratios, parity, best peer), merged records, the no-GPU --list line, and --report
without matplotlib. Nothing is timed: a stand-in device invents the times."""

import functools
import json
import os
import random
import subprocess
import sys

import numpy as np
import pytest
import torch

from bench_helpers import StandInDevice, first_table_after, tiny_point
from fmha_rt import reference as oracle
from fmha_rt.bench import cli, clocks, correctness, flops, peers, report, sweep, timing, versus

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def seed_printed():
    seed = random.randrange(2**31)
    print(f"seed {seed}")
    return seed


# ---- the fp32 reference -------------------------------------------------------------------------------

@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("pass_name", ["fwd", "bwd"])
def test_reference_matches_the_float64_oracle(causal, pass_name, monkeypatch):
    """Dense GQA (Hq/Hk = 2) and varlen, chunked into one (batch, head) pair per chunk."""
    monkeypatch.setattr(correctness, "CHUNK_SCORE_BYTES", 1)
    seed = seed_printed()
    window = (-1, 0) if causal else (-1, -1)
    for point in (tiny_point(pass_name, causal=causal), tiny_point(pass_name, causal=causal, seqlens=(5, 9, 3))):
        case = peers.make_case(point, "cpu", seed=seed)
        got = correctness.reference(case)
        if point.varlen:
            bounds = case.cu_seqlens.tolist()
            parts = [(case.q[None, a:b], case.k[None, a:b], case.v[None, a:b],
                      None if case.dout is None else case.dout[None, a:b]) for a, b in zip(bounds[:-1], bounds[1:])]
        else:
            parts = [(case.q, case.k, case.v, case.dout)]
        expected = {}
        for q, k, v, dout in parts:
            if pass_name == "fwd":
                found = {"out": oracle.mha_fwd_ref(q.float(), k.float(), v.float(), window=window, bottom_right=True)[0]}
            else:
                dq, dk, dv, _ = oracle.mha_bwd_ref(dout.float(), q.float(), k.float(), v.float(), window=window,
                                                   bottom_right=True)
                found = {"dq": dq, "dk": dk, "dv": dv}
            for name, value in found.items():
                expected.setdefault(name, []).append(value if not point.varlen else value[0])
        for name, values in expected.items():
            want = np.concatenate(values) if point.varlen else values[0]
            have = got[name].double().numpy()
            assert have.shape == want.shape and np.linalg.norm(have - want) / np.linalg.norm(want) < 1e-5, name


def test_judge_flags_wrong_values_rows_and_non_finite_elements():
    seed = seed_printed()
    gen = torch.Generator().manual_seed(seed)
    ref = torch.randn(4, 32, 2, 16, generator=gen)
    assert correctness.judge({"out": ref.clone()}, {"out": ref})["passed"]
    noisy = ref + 1e-3 * torch.randn(ref.shape, generator=gen)
    check = correctness.judge({"out": noisy}, {"out": ref})
    assert check["passed"] and 5e-4 < check["tensors"]["out"]["rel_err"] < 2e-3
    # an error of 0.3 typical rows' norm in the smallest of 256 rows: the whole tensor's error stays under 2e-2
    # (0.3 / sqrt(256)), the row's (0.3 of the floor its denominator takes) does not
    rows = ref.reshape(-1, 16)
    typical = float(torch.linalg.vector_norm(ref)) / 16
    one_row = ref.clone().reshape(-1, 16)
    one_row[int(torch.linalg.vector_norm(rows, dim=-1).argmin())] += 0.3 * typical / 4  # 16 elements: norm x4
    one_row = one_row.reshape(ref.shape)
    check = correctness.judge({"out": one_row}, {"out": ref})
    assert check["tensors"]["out"]["rel_err"] < correctness.REL_ERR_LIMIT
    assert not check["passed"] and "row_err" in check["reason"]
    poisoned = ref.clone()
    poisoned[0, 0, 0, 0] = float("nan")
    assert correctness.judge({"out": poisoned}, {"out": ref})["reason"] == "out: non-finite elements"
    assert "shape" in correctness.judge({"out": ref[:2]}, {"out": ref})["reason"]
    zero_row = ref.clone()
    zero_row[0, 0, 0] = 0  # a reference row of zeros is judged against the typical row, not divided by 0
    assert correctness.judge({"out": zero_row}, {"out": zero_row})["tensors"]["out"]["row_err"] == 0


# ---- the correctness gate in the sweep ----------------------------------------------------------------

class MathAdapter(peers.AutogradAdapter):
    """torch's own SDPA on the CPU, through the same autograd path as the real peers; `skew` plants an error
    (v scaled), `jitter` a backward that differs from call to call."""

    output = staticmethod(peers.heads_third)
    deterministic_mode = "by construction"

    def __init__(self, skew=1.0, jitter=False):
        self.skew, self.jitter, self.calls = skew, jitter, 0

    def bind(self, case, q, k, v, deterministic):
        p = case.point
        qt, kt, vt = peers.heads_second(q, k, v * self.skew)
        call = functools.partial(torch.nn.functional.scaled_dot_product_attention, qt, kt, vt, is_causal=p.causal,
                                 enable_gqa=p.heads_q != p.heads_k)
        return call

    def backward(self, case, deterministic):
        grad = super().backward(case, deterministic)
        if not self.jitter:
            return grad

        def differing():
            self.calls += 1
            dq, dk, dv = grad()
            return dq + self.calls * 1e-3 * dq, dk, dv
        return differing


def run(points, adapters, rounds=1, times=None):
    return sweep.run_sweep(points, adapters, StandInDevice(times=times), sweep.Settings(repeats=2, warmup_ms=0,
                                                                                     rounds=rounds),
                           progress_stream=open(os.devnull, "w"))


def test_a_wrong_implementation_is_flagged_untimed_and_in_no_ratio():
    points = [tiny_point("fwd", causal=True), tiny_point("bwd"), tiny_point("bwd_det")]
    adapters = {"fmha_rt": MathAdapter(), "wrong": MathAdapter(skew=1.1), "right": MathAdapter(),
                "jitter": MathAdapter(jitter=True)}
    rows = run(points, adapters, rounds=4)
    by = {(r["impl"], r["pass"]): r for r in rows}
    for pass_name in ("fwd", "bwd", "bwd_det"):
        wrong = by[("wrong", pass_name)]
        assert not wrong["check"]["passed"] and "rel_err" in wrong["check"]["reason"] and "ms" not in wrong
        right = by[("right", pass_name)]
        # three implementations timed at each point: 4 rounds asked, 6 taken (a multiple of 3)
        assert right["check"]["passed"] and right["rounds"] == 6 and len(right["round_ms"]) == 6
        assert all(e["rel_err"] < 1e-2 for e in right["check"]["tensors"].values())
    # dq off in a plain backward is still within the limits; repeated, it is not bitwise the same
    assert by[("jitter", "bwd")]["check"]["passed"]
    assert by[("jitter", "bwd_det")]["check"]["reason"].endswith("not bitwise repeatable")
    assert {c.peer for c in versus.best_peer_comparisons(rows)} == {"right"}
    assert [c.peer for c in versus.comparisons(rows, "wrong")] == []
    text = report.markdown({"header": {"settings": {"rounds": 4}}, "rows": rows})
    assert text.index("## Failed the correctness check") < text.index("## Machine")
    _, failed = first_table_after(text, "## Failed the correctness check")
    assert sorted((r[0], r[1].split()[1]) for r in failed) == [
        ("jitter", "bwd_det"), ("wrong", "bwd"), ("wrong", "bwd_det"), ("wrong", "fwd")]
    assert "failed check" in text


def test_outputs_given_are_poisoned_before_the_checked_call():
    buffer = torch.ones(3)
    call = functools.partial(lambda out=None: out, out=buffer)
    correctness.poison_given_outputs(call)
    assert torch.isnan(buffer).all()


# ---- equal turns --------------------------------------------------------------------------------------

class NamedCalls(peers.Adapter):
    deterministic_mode = "deterministic=True"

    def __init__(self, name):
        self.name = name

    def forward(self, case):
        def call():
            return None
        call.impl = self.name
        return call

    def backward(self, case, deterministic):
        call = self.forward(case)
        call.impl = f"{self.name} {'bwd_det' if deterministic else 'bwd'}"
        return call


def test_each_implementation_takes_the_first_turn_equally_often(monkeypatch):
    monkeypatch.setattr(sweep, "check_pair", lambda *args: ({"passed": True}, 1.0))
    turns = []

    def sample_calls(calls, device, *, warmup_ms, repeats):
        turns.append(calls[0].impl)
        return [1.0] * repeats

    monkeypatch.setattr(timing, "sample_calls", sample_calls)
    names = ["fmha_rt", "fa4", "sdpa_cudnn"]
    rows = run([tiny_point("bwd"), tiny_point("bwd_det")], {n: NamedCalls(n) for n in names}, rounds=4)
    # the warm turn, then 6 rounds (4 rounded up to a multiple of 3), each implementation's passes together
    slots = [turns[i:i + 6] for i in range(0, len(turns), 6)]
    assert len(slots) == 7 and all(sorted(s) == sorted(slots[0]) for s in slots)
    firsts = [s[0] for s in slots[1:]]
    assert firsts == ["fmha_rt bwd", "fa4 bwd", "sdpa_cudnn bwd"] * 2
    assert slots[1][:2] == ["fmha_rt bwd", "fmha_rt bwd_det"]
    assert all(r["rounds"] == 6 for r in rows)
    assert sweep.equal_turn_rounds(5, 5) == 5 and sweep.equal_turn_rounds(1, 5) == 5 and sweep.equal_turn_rounds(6, 4) == 8
    assert "rounded up" in cli.rounds_note(4, 3) and "rounded up" not in cli.rounds_note(5, 5)


def test_a_peer_without_a_deterministic_mode_has_a_row_saying_so(monkeypatch):
    monkeypatch.setattr(sweep, "check_pair", lambda *args: ({"passed": True}, 1.0))

    class NoMode(NamedCalls):
        deterministic_mode = None

    rows = run([tiny_point("bwd_det")], {"fmha_rt": NamedCalls("fmha_rt"), "flex": NoMode("flex")})
    (skipped,) = [r for r in rows if r["impl"] == "flex"]
    assert skipped["skipped"] == "no deterministic mode" and "ms" not in skipped
    assert versus.best_peer_comparisons(rows) == []


# ---- ratios within one run ----------------------------------------------------------------------------

def row(impl, round_ms, pass_name="fwd", run=None, **shape):
    point = {"kind": "dense", "dtype": "bf16", "B": 1, "Hq": 16, "Hk": 16, "Sq": 16384, "Sk": 16384, "D": 128,
             "causal": False, **shape}
    made = {"impl": impl, "pass": pass_name, **point, "flops": 10**12, "round_ms": round_ms,
            "ms": float(np.median(round_ms)), "check": {"passed": True}}
    made["tflops"] = flops.tflops(made["flops"], made["ms"])
    if run is not None:
        made["run"] = run
    return made


def test_ratio_is_the_median_of_per_round_ratios_with_parity_inside_the_noise():
    ours = row("fmha_rt", [1.0, 1.0, 1.0, 1.0, 2.0])
    theirs = row("fa4", [1.1, 1.2, 1.3, 1.1, 1.9])
    (c,) = versus.comparisons([ours, theirs], "fa4")
    assert c.round_ratios == pytest.approx([1.1, 1.2, 1.3, 1.1, 0.95])
    assert c.ratio == pytest.approx(1.1) and c.spread == pytest.approx((0.95, 1.3))
    assert c.verdict == "parity"  # the median is within the peer's round-to-round noise (interquartile 17 %)
    clear = versus.Comparison(row("fmha_rt", [1.0] * 5), row("fa4", [1.2, 1.21, 1.19, 1.2, 1.2]))
    assert clear.verdict == "faster" and clear.text() == "1.200 [1.190-1.210] faster"
    assert versus.Comparison(row("fmha_rt", [1.2] * 5), row("fa4", [1.0] * 5)).verdict == "slower"
    # every round 3 % ahead; one disturbed round moves both rows 5 %, which the quartiles ignore
    steady = versus.Comparison(row("fmha_rt", [1.0, 1.05, 1.0, 1.0, 1.0]), row("fa4", [1.03, 1.0815, 1.03, 1.03, 1.03]))
    assert min(steady.round_ratios) > 1 and steady.verdict == "faster"
    # four rounds 15 % behind and one outlier round ahead: still slower, not parity
    outlier = versus.Comparison(row("fmha_rt", [1.0, 1.0, 0.6, 1.0, 1.0]), row("fa4", [0.85, 0.86, 0.85, 0.84, 0.85]))
    assert max(outlier.round_ratios) > 1 and outlier.verdict == "slower"
    # the middle half of the rounds on both sides of 1: parity
    mixed = versus.Comparison(row("fmha_rt", [1.0] * 5), row("fa4", [0.97, 0.99, 1.0, 1.01, 1.03]))
    assert mixed.verdict == "parity"


def test_the_best_peer_is_the_fastest_that_passed():
    rows = [row("fmha_rt", [1.0] * 5), row("fa4", [0.8] * 5), row("sdpa_cudnn", [0.9] * 5), row("flex", [1.5] * 5),
            row("fmha_rt_v3", [0.7] * 5)]  # fmha_rt under another setting: faster, but not a peer
    rows[1]["check"] = {"passed": False, "reason": "out: rel_err 0.5 > 0.02"}
    (c,) = versus.best_peer_comparisons(rows)
    assert c.peer == "sdpa_cudnn" and c.ratio == pytest.approx(0.9) and c.verdict == "slower"
    text = report.markdown({"header": {}, "rows": rows})
    headings, body = first_table_after(text, "## fmha_rt over the best peer at each point")
    assert text.index("## fmha_rt over the best peer") < text.index("## Machine")
    assert headings[-3:] == ["fmha_rt ms", "peer ms", "fmha_rt / best peer"]
    assert body == [["fwd", "bf16", "dense", "1", "16/16", "16384", "128", "no", "sdpa_cudnn", "1.000", "0.900",
                     "0.900 [0.900-0.900] slower"]]
    assert "- fwd bf16: 1 points: 0 faster, 0 parity, 1 slower" in text


def test_rows_of_different_runs_never_pair():
    rows = [row("fmha_rt", [1.0] * 5, run="a"), row("fa4", [2.0] * 5, run="b")]
    assert versus.comparisons(rows, "fa4") == [] and versus.best_peer_comparisons(rows) == []
    rows.append(row("fa4", [1.1] * 5, run="a"))
    assert [c.theirs["run"] for c in versus.best_peer_comparisons(rows)] == ["a"]
    # rows of different round counts never pair either
    assert versus.comparisons([row("fmha_rt", [1.0] * 5), row("fa4", [1.0] * 10)], "fa4") == []


def record(rows, run_id, settings=None, date="2026-01-01T00:00:00+00:00"):
    doc = report.new_document({"date": date, "gpu": "G", "settings": settings or {"rounds": 5, "command": ["bench"]},
                               "impls": {}})
    doc["header"]["run_id"] = run_id
    doc["rows"] = rows
    return doc


def test_merge_keeps_runs_apart_and_refuses_what_would_mix_them(tmp_path, capsys):
    d64 = record([row("fmha_rt", [1.0] * 5, D=64), row("fa4", [1.1] * 5, D=64)], "run64")
    d256 = record([row("fmha_rt", [1.0] * 5, D=256), row("fa4", [0.9] * 5, D=256)], "run256",
                  settings={"rounds": 5, "command": ["bench", "--hdim", "256"]})
    merged = report.merge([d64, d256])
    assert [r["run"] for r in merged["rows"]] == ["run64"] * 2 + ["run256"] * 2
    assert [r["run_id"] for r in merged["header"]["runs"]] == ["run64", "run256"]
    assert sorted(c.ratio for c in versus.best_peer_comparisons(merged["rows"])) == pytest.approx([0.9, 1.1])
    with pytest.raises(report.MergeRefused, match="both measured"):
        report.merge([d64, record([row("fa4", [0.5] * 5, D=64)], "other")])
    with pytest.raises(report.MergeRefused, match="different settings"):
        report.merge([d64, record([], "r3", settings={"rounds": 10, "command": ["bench"]})])
    for name, doc in (("a.json", d64), ("b.json", d256)):
        report.save(doc, str(tmp_path / name))
    assert cli.main(["--report", str(tmp_path / "a.json"), str(tmp_path / "b.json"), "--out", str(tmp_path / "m")]) == 0
    assert "merged runs | run64" in (tmp_path / "m" / "results.md").read_text()
    report.save(record([row("fa4", [0.5] * 5, D=64)], "other"), str(tmp_path / "c.json"))
    assert cli.main(["--report", str(tmp_path / "a.json"), str(tmp_path / "c.json"), "--out", str(tmp_path / "n")]) == 1
    assert "both measured" in capsys.readouterr().err and not (tmp_path / "n").exists()


# ---- without a GPU, without matplotlib ----------------------------------------------------------------

@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour on a machine without a GPU")
def test_list_says_no_gpu_instead_of_found(capsys):
    assert cli.main(["--list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("no GPU: ") and "found" not in lines[0].split(":")[0]
    by_name = {line.split()[0]: line for line in lines[1:]}
    assert by_name["fmha_rt"].split()[1:3] == ["no", "GPU"] and by_name["sdpa_flash"].split()[1:3] == ["no", "GPU"]


def test_list_line_tells_a_missing_driver_from_a_missing_device(monkeypatch):
    from fmha_rt.runtime import backend
    from fmha_rt.bench import machine
    from fmha_rt.errors import FmhaRuntimeError

    def missing():
        raise FmhaRuntimeError("fmha_init: no GPU runtime library found (tried libcuda.so.1)")

    monkeypatch.setattr(backend, "runtime", missing)
    assert machine.gpu_presence() == (False, "no GPU: fmha_init: no GPU runtime library found (tried libcuda.so.1)")
    monkeypatch.setattr(backend, "runtime", lambda: backend.Runtime("cuda", "libcuda.so.1", 13000, ()))
    assert machine.gpu_presence() == (False, "no GPU: the driver library libcuda.so.1 is present but reports no device")
    device = backend.Device(0, "NVIDIA H200", "sm_90", "sm_90", 132, 232448, 1 << 37)
    monkeypatch.setattr(backend, "runtime", lambda: backend.Runtime("cuda", "libcuda.so.1", 13000, (device,)))
    assert machine.gpu_presence() == (True, "GPU found: 1 device(s) (NVIDIA H200) through libcuda.so.1")


def test_report_without_matplotlib_writes_the_markdown_and_says_how_to_get_plots(tmp_path):
    path = tmp_path / "run.json"
    report.save(record([row("fmha_rt", [1.0] * 5), row("fa4", [1.1] * 5)], "r"), str(path))
    code = ("import sys; sys.modules['matplotlib'] = None; sys.modules['torch'] = None\n"
            "from fmha_rt.bench import cli\n"
            f"sys.exit(cli.main(['--report', {str(path)!r}]))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.strip() == "fmha_rt bench: " + report.PLOTS_HINT and "pip install matplotlib" in proc.stderr
    assert (tmp_path / "run.md").exists() and not list(tmp_path.glob("*.png"))
    assert proc.stdout.split() == [str(tmp_path / "run.md")]


# ---- clocks per turn ----------------------------------------------------------------------------------

def test_clock_readings_come_only_from_samples_inside_the_turn():
    samples = [(1.00, 1980.0, 100.0), (1.005, 1830.0, 690.0), (1.010, 1840.0, 670.0), (1.30, 1800.0, None)]
    assert clocks.window_reading(samples, 1.004, 1.011) == {"sm_mhz": 1835.0, "power_w": 680.0}
    assert clocks.window_reading(samples, 1.011, 1.29) == {}  # nothing borrowed from a later sample
    assert clocks.window_reading(samples, 1.25, 1.35) == {"sm_mhz": 1800.0}  # no instantaneous power: none


def test_sampler_thread_reads_its_source_every_few_ms_and_tolerates_none():
    class Source:
        reads, closed = 0, False

        def read(self):
            Source.reads += 1
            return 1830.0 + Source.reads, 650.0

        def close(self):
            Source.closed = True

    sampler = clocks.Sampler(Source(), period_s=0.001)
    import time
    start = time.monotonic()
    while Source.reads < 5 and time.monotonic() - start < 30:
        time.sleep(0.01)
    reading = sampler.reading(0.0, float("inf"))
    sampler.close()
    assert reading["sm_mhz"] > 1830.0 and reading["power_w"] == 650.0 and Source.closed
    empty = clocks.Sampler(None)
    assert empty.reading(0.0, float("inf")) == {}
    empty.close()
    assert clocks.nvml_source(None, 0) is None or isinstance(clocks.nvml_source(None, 0), clocks.NvmlSource)


def test_merged_host_overhead_rows_and_the_user_path_table():
    rows = [{"impl": "fmha_rt", "path": "fwd", "us_per_call": 27.6, "round_us": [27.0, 28.0]},
            {"impl": "sdpa_cudnn", "path": "fwd", "us_per_call": 20.0, "round_us": [19.0, 21.0]},
            {"impl": "fmha_rt", "path": "raw fwd, outputs given", "us_per_call": 9.1, "round_us": [9.0, 9.2]},
            {"impl": "fa4", "path": "fwd+bwd", "error": "RuntimeError: x"}]
    text = report.markdown({"header": {}, "rows": [], "host_overhead": rows})
    _, body = first_table_after(text, "## Host overhead")
    assert body == [["fmha_rt", "fwd", "27.6 [27.0-28.0]"], ["sdpa_cudnn", "fwd", "20.0 [19.0-21.0]"],
                    ["fa4", "fwd+bwd", "error"], ["fmha_rt", "raw fwd, outputs given", "9.1 [9.0-9.2]"]]
    assert json.loads(json.dumps(rows)) == rows
