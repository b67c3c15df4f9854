"""The sweep's bookkeeping on a CPU, through a stand-in device (nothing is timed): failures, a lost device,
turn order and rounds, a shape's backward passes taking turns together, --settle, clocks per turn."""

import collections
import dataclasses
import os
import sys

import pytest

from bench_helpers import StandInDevice, table_after, tiny_point
from fmha_rt.bench import cli, clocks, flops, peers, report, sweep, timing


class BrokenAdapter(peers._Adapter):
    def forward(self, case):
        raise RuntimeError("no kernel for this shape")

    def backward(self, case, deterministic):
        return self.forward(case)


class FailsWhenCalled(peers._Adapter):
    def forward(self, case):
        def call():
            raise ValueError("bad launch")
        return call

    def backward(self, case, deterministic):
        return self.forward(case)


def test_sweep_records_each_failure_and_goes_on():
    points = [tiny_point("fwd"), tiny_point("fwd", causal=True), tiny_point("bwd")]
    adapters = {"sdpa_flash": peers.SdpaAdapter("FLASH_ATTENTION"), "broken": BrokenAdapter(),
                "fails": FailsWhenCalled()}
    saved = []
    rows = sweep.run_sweep(points, adapters, StandInDevice(), sweep.Settings(repeats=3, warmup_ms=0),
                           on_point=lambda r: saved.append(len(r)), progress_stream=open(os.devnull, "w"))
    assert [(r["impl"], r["pass"], r["causal"]) for r in rows] == [
        (name, p.pass_name, p.causal) for p, name in sweep.planned_pairs(points, adapters)]
    assert saved == [3, 6, 9]
    for point, row in zip((p for p in points for _ in adapters), rows):
        if row["impl"] == "sdpa_flash":
            assert "error" not in row, row
            assert row["ms"] == 1.0 and row["repeats"] == 3 and row["flops"] == point.flops()
            assert row["copies"] == timing.copies_needed(timing.working_set_bytes(point), 1 << 16)
            assert row["tflops"] == pytest.approx(flops.tflops(row["flops"], 1.0))
        else:
            expected = "RuntimeError: no kernel for this shape" if row["impl"] == "broken" else "ValueError: bad launch"
            assert row["error"] == expected and "ms" not in row


def test_a_lost_device_stops_the_sweep_after_saving():
    saved = []
    with pytest.raises(sweep.DeviceLost, match="no kernel for this shape"):
        sweep.run_sweep([tiny_point("fwd"), tiny_point("fwd", causal=True)], {"broken": BrokenAdapter()},
                        StandInDevice(healthy=False), sweep.Settings(repeats=1, warmup_ms=0),
                        on_point=lambda r: saved.append(list(r)), progress_stream=open(os.devnull, "w"))
    assert len(saved) == 1 and len(saved[0]) == 1 and "error" in saved[0][0]


class NamedCalls(peers._Adapter):
    """Calls that carry their implementation's name, so a test can see who was timed when."""

    def __init__(self, name, fail_in_round=None):
        super().__init__()
        self.name, self.fail_in_round, self.turns = name, fail_in_round, 0

    def forward(self, case):
        def call():
            pass
        call.impl = self.name
        return call

    def backward(self, case, deterministic):
        return self.forward(case)


class PassNamedCalls(NamedCalls):
    """NamedCalls whose backward calls also carry their pass ("name bwd", "name bwd_det")."""

    has_deterministic = True

    def backward(self, case, deterministic):
        call = self.forward(case)
        call.impl = f"{self.name} {'bwd_det' if deterministic else 'bwd'}"
        return call


def test_turn_order_rotates_one_place_per_round():
    assert [sweep.turn_order(["a", "b", "c"], r) for r in range(4)] == [
        ["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"], ["a", "b", "c"]]
    assert sweep.turn_order([], 3) == []


def test_rounds_take_turns_and_pool_every_rounds_calls(monkeypatch):
    adapters = {name: NamedCalls(name) for name in ("fmha_rt", "flex", "cudnn")}
    turns = []

    def sample_calls(calls, device, *, warmup_ms, repeats):
        name = calls[0].impl
        turns.append(name)
        adapter = adapters[name]
        adapter.turns += 1
        if adapter.fail_in_round == adapter.turns:
            raise RuntimeError("launch failed")
        # fmha_rt: 1, 2, 3 ms in its three rounds; the others 10 ms in every round
        return [float(adapter.turns) if name == "fmha_rt" else 10.0] * repeats

    monkeypatch.setattr(timing, "sample_calls", sample_calls)
    adapters["cudnn"].fail_in_round = 2
    saved = []
    points = [tiny_point("fwd"), tiny_point("bwd")]
    rows = sweep.run_sweep(points[:1], adapters, StandInDevice(), sweep.Settings(repeats=4, warmup_ms=0, rounds=3),
                           on_point=lambda r: saved.append(len(r)), progress_stream=open(os.devnull, "w"))
    assert turns == ["fmha_rt", "flex", "cudnn", "flex", "cudnn", "fmha_rt", "fmha_rt", "flex"]
    by_impl = {row["impl"]: row for row in rows}
    assert [row["impl"] for row in rows] == ["fmha_rt", "flex", "cudnn"] and saved == [3]
    assert by_impl["fmha_rt"]["round_ms"] == [1.0, 2.0, 3.0]
    assert (by_impl["fmha_rt"]["ms"], by_impl["fmha_rt"]["repeats"]) == (2.0, 12)
    assert by_impl["fmha_rt"]["tflops"] == pytest.approx(flops.tflops(points[0].flops(), 2.0))
    assert by_impl["flex"]["round_ms"] == [10.0] * 3 and by_impl["flex"]["ms"] == 10.0
    assert by_impl["cudnn"]["error"] == "RuntimeError: launch failed" and "ms" not in by_impl["cudnn"]
    one = sweep.run_sweep(points[1:], {"flex": NamedCalls("flex")}, StandInDevice(), sweep.Settings(repeats=2, warmup_ms=0),
                          progress_stream=open(os.devnull, "w"))
    assert "round_ms" not in one[0] and one[0]["repeats"] == 2


def test_a_shapes_backward_passes_take_turns_together(monkeypatch):
    """bwd and bwd_det of one shape share their rounds (the deterministic backward is not timed alone, back to
    back); the forward and other shapes keep their own; --separate-det-turns restores a group per point."""
    fwd, bwd, det = (tiny_point(p) for p in ("fwd", "bwd", "bwd_det"))
    other = tiny_point("bwd", causal=True)
    pairs = [(fwd, "a"), (fwd, "b"), (bwd, "a"), (bwd, "b"), (det, "a"), (other, "a")]
    assert sweep.turn_groups(pairs) == [pairs[:2], pairs[2:5], pairs[5:]]
    assert sweep.turn_groups(pairs, backward_together=False) == [pairs[:2], pairs[2:4], pairs[4:5], pairs[5:]]

    turns = []

    def sample_calls(calls, device, *, warmup_ms, repeats):
        turns.append(calls[0].impl)
        return [1.0] * repeats

    monkeypatch.setattr(timing, "sample_calls", sample_calls)

    class NoDeterministicMode(PassNamedCalls):
        has_deterministic = False

    adapters = {"a": PassNamedCalls("a"), "b": NoDeterministicMode("b")}
    saved = []
    rows = sweep.run_sweep([bwd, det], adapters, StandInDevice(), sweep.Settings(repeats=1, warmup_ms=0, rounds=3),
                           on_point=lambda r: saved.append(len(r)), progress_stream=open(os.devnull, "w"))
    assert turns == ["a bwd", "b bwd", "a bwd_det", "b bwd", "a bwd_det", "a bwd", "a bwd_det", "a bwd", "b bwd"]
    assert [(r["impl"], r["pass"]) for r in rows] == [("a", "bwd"), ("b", "bwd"), ("a", "bwd_det")] and saved == [3]
    assert all(len(r["round_ms"]) == 3 for r in rows)
    turns.clear()
    settings = cli.settings_for(cli.build_parser().parse_args(["--rounds", "2", "--separate-det-turns"]))
    assert settings.backward_turns_together is False and cli.settings_for(
        cli.build_parser().parse_args([])).backward_turns_together is True
    saved.clear()
    sweep.run_sweep([bwd, det], adapters, StandInDevice(), dataclasses.replace(settings, repeats=1, warmup_ms=0),
                    on_point=lambda r: saved.append(len(r)), progress_stream=open(os.devnull, "w"))
    assert turns == ["a bwd", "b bwd", "b bwd", "a bwd", "a bwd_det", "a bwd_det"] and saved == [2, 3]


def test_close_points_take_the_settle_rounds_and_others_do_not(monkeypatch):
    """--settle: after the planned rounds, a group in which fmha_rt and the settle peer are within
    settle_within at some pass (the deterministic backward against the peer's backward) is timed to
    settle_rounds in all; a group where they are apart keeps its rounds. The decision is taken once, on
    the planned rounds' medians; a failure in a settle round keeps the figures of the rounds before."""
    times, turns = {}, collections.Counter()

    def sample_calls(calls, device, *, warmup_ms, repeats):
        name = calls[0].impl
        turns[name] += 1
        value = times[name][min(turns[name], len(times[name])) - 1]
        if value is None:
            raise RuntimeError("launch failed")
        return [value] * repeats

    monkeypatch.setattr(timing, "sample_calls", sample_calls)

    class NoDeterministicMode(PassNamedCalls):
        has_deterministic = False

    adapters = {"fmha_rt": PassNamedCalls("fmha_rt"), "flex": NoDeterministicMode("flex")}
    settings = sweep.Settings(repeats=1, warmup_ms=0, rounds=2, settle="flex", settle_within=0.03, settle_rounds=5)
    points = [tiny_point("fwd"), tiny_point("bwd"), tiny_point("bwd_det")]

    def run(**per_turn):
        """{(impl, pass): rows' rounds (or the row's error)} for these times per turn (ms; a list is consumed
        turn by turn, its last value repeating; None fails that turn). Keys: fmha_rt, flex (forwards),
        fmha_rt_bwd, fmha_rt_bwd_det, flex_bwd."""
        times.clear(), turns.clear()
        times.update({name.replace("_bwd", " bwd"): v if isinstance(v, list) else [v] for name, v in per_turn.items()})
        pairs = sweep.planned_pairs(points, adapters)
        progress = sweep.Progress(len(pairs) * settings.rounds, open(os.devnull, "w"))
        rows = []
        for group in sweep.turn_groups(pairs):
            rows += sweep.measure_group(group, adapters, StandInDevice(), settings, progress)[0]
        assert progress._done == progress._total
        return {(r["impl"], r["pass"]): r.get("settle_error") or r.get("error") or len(r.get("round_ms", ()))
                for r in rows}

    # forward 10% apart: 2 rounds; backward 1% apart: 5 rounds for every backward row
    assert run(fmha_rt=1.0, flex=1.1, fmha_rt_bwd=1.0, fmha_rt_bwd_det=1.2, flex_bwd=1.01) == {
        ("fmha_rt", "fwd"): 2, ("flex", "fwd"): 2, ("fmha_rt", "bwd"): 5, ("flex", "bwd"): 5, ("fmha_rt", "bwd_det"): 5}
    # decided once: close in the planned rounds, apart afterwards, still 5; apart, then close, still 2
    got = run(fmha_rt=1.0, flex=1.5, fmha_rt_bwd=1.0, fmha_rt_bwd_det=1.5, flex_bwd=[1.01, 1.01, 2.0])
    assert got[("flex", "bwd")] == 5
    got = run(fmha_rt=1.0, flex=1.5, fmha_rt_bwd=1.0, fmha_rt_bwd_det=1.2, flex_bwd=[1.5, 1.5, 1.0])
    assert set(got.values()) == {2}
    # only the deterministic backward is close to flex's backward: the group still settles
    assert run(fmha_rt=1.0, flex=1.5, fmha_rt_bwd=1.0, fmha_rt_bwd_det=1.5, flex_bwd=1.52)[("fmha_rt", "bwd")] == 5
    # flex fails in its fourth round: its row keeps three rounds' figures and says why it stopped
    got = run(fmha_rt=1.0, flex=1.5, fmha_rt_bwd=1.0, fmha_rt_bwd_det=1.5, flex_bwd=[1.01] * 3 + [None])
    assert got[("flex", "bwd")] == "RuntimeError: launch failed" and got[("fmha_rt", "bwd")] == 5
    assert not sweep.settles([(points[0], "fmha_rt")], {}, {}, sweep.Settings(rounds=2))
    # the report says what was extended
    settings_text = report._timing_text({"rounds": 2, "repeats": 1, "warmup_ms": 0, "settle": "flex",
                                         "settle_within": 0.03, "settle_rounds": 5})
    assert "points where fmha_rt and flex were within 3% after them took 5 rounds in all" in settings_text


def test_a_failed_settle_round_keeps_the_planned_figures(monkeypatch):
    calls_made = collections.Counter()

    def sample_calls(calls, device, *, warmup_ms, repeats):
        calls_made[calls[0].impl] += 1
        if calls[0].impl == "flex" and calls_made["flex"] == 3:
            raise RuntimeError("launch failed")
        return [1.0 if calls[0].impl == "fmha_rt" else 1.01] * repeats

    monkeypatch.setattr(timing, "sample_calls", sample_calls)
    adapters = {"fmha_rt": NamedCalls("fmha_rt"), "flex": NamedCalls("flex")}
    settings = sweep.Settings(repeats=2, warmup_ms=0, rounds=2, settle="flex", settle_rounds=4)
    rows, lost = sweep.measure_group([(tiny_point("fwd"), "fmha_rt"), (tiny_point("fwd"), "flex")], adapters,
                                     StandInDevice(), settings, sweep.Progress(4, open(os.devnull, "w")))
    by_impl = {r["impl"]: r for r in rows}
    assert lost is None and by_impl["fmha_rt"]["round_ms"] == [1.0] * 4
    flex = by_impl["flex"]
    assert flex["settle_error"] == "RuntimeError: launch failed" and "error" not in flex
    assert flex["round_ms"] == [1.01, 1.01] and flex["ms"] == 1.01 and flex["repeats"] == 4


def test_settle_flags(capsys):
    parsed = cli.build_parser().parse_args(["--rounds", "2", "--settle", "flex", "--settle-within", "2.5"])
    settings = cli.settings_for(parsed)
    assert (settings.settle, settings.settle_within, settings.settle_rounds) == ("flex", 0.025, 8)
    assert cli.settings_for(cli.build_parser().parse_args([])).settle is None
    for argv, message in ((["--settle", "flex", "--impl", "fmha_rt", "sdpa_flash"], "--impl must name both"),
                          (["--settle", "flex", "--rounds", "8"], "must be more than --rounds"),
                          (["--settle", "fmha_rt"], "invalid choice")):
        with pytest.raises(SystemExit):
            cli.main(argv)
        assert message in capsys.readouterr().err
    # a settle peer that this machine does not have: said before anything runs
    missing = next(name for name, found in peers.discover(peers.PEER_NAMES).items() if found.status != "found")
    assert cli.main(["--rounds", "2", "--settle", missing, "--no-extras"]) == 1
    assert f"--settle {missing}, but {missing} is not available here" in capsys.readouterr().err


def test_rows_carry_the_clock_each_turn_ran_at(monkeypatch):
    """sm_mhz / power_w: medians over an implementation's turns; round_sm_mhz with several turns (None for
    a turn without a sample); no fields where nothing was sampled (nvidia-smi absent)."""
    monkeypatch.setattr(timing, "sample_calls", lambda calls, device, *, warmup_ms, repeats: [1.0] * repeats)
    readings = [{"sm_mhz": 1980.0, "power_w": 300.0}, {"sm_mhz": 1830.0, "power_w": 690.0},  # round 1: a, b
                {"sm_mhz": 1840.0, "power_w": 680.0}, {}]                                   # round 2: b, a
    adapters = {name: NamedCalls(name) for name in ("a", "b")}
    rows = sweep.run_sweep([tiny_point("fwd")], adapters, StandInDevice(clock_readings=readings),
                           sweep.Settings(repeats=2, warmup_ms=0, rounds=2), progress_stream=open(os.devnull, "w"))
    by_impl = {row["impl"]: row for row in rows}
    assert (by_impl["a"]["sm_mhz"], by_impl["a"]["power_w"], by_impl["a"]["round_sm_mhz"]) == (1980.0, 300.0,
                                                                                              [1980.0, None])
    assert (by_impl["b"]["sm_mhz"], by_impl["b"]["power_w"], by_impl["b"]["round_sm_mhz"]) == (1835.0, 685.0,
                                                                                              [1830.0, 1840.0])
    text = report.markdown({"header": {"settings": {"rounds": 2}}, "rows": rows})
    assert "## SM clock and power while timed" in text
    _, body = table_after(text[text.index("## SM clock"):], "<details><summary>fwd, fp16</summary>")
    assert body[0][6:] == ["1980 / 300", "1835 [1830-1840] / 685"]
    (plain,) = sweep.run_sweep([tiny_point("fwd")], {"a": NamedCalls("a")}, StandInDevice(), sweep.Settings(
        repeats=2, warmup_ms=0), progress_stream=open(os.devnull, "w"))
    assert not {"sm_mhz", "power_w", "round_sm_mhz"} & set(plain)
    assert "SM clock" not in report.markdown({"header": {"settings": {}}, "rows": [plain]})


def test_clock_samples_from_nvidia_smi_lines():
    assert clocks.parse_line("1830, 655.41\n") == (1830.0, 655.41)
    assert clocks.parse_line("[N/A], [N/A]") is None and clocks.parse_line("No devices were found") is None
    samples = [(1.00, 1980.0, 100.0), (1.05, 1830.0, 690.0), (1.10, 1840.0, 670.0), (1.30, 1800.0, 700.0)]
    assert clocks.window_reading(samples, 1.04, 1.11) == {"sm_mhz": 1835.0, "power_w": 680.0}
    # a window shorter than the period: the first sample after its start, up to two periods late
    assert clocks.window_reading(samples, 1.11, 1.12) == {}
    assert clocks.window_reading(samples, 1.26, 1.27) == {"sm_mhz": 1800.0, "power_w": 700.0}
    assert clocks.gpu_id("GPU-abc", 0) == clocks.gpu_id("abc", 3) == "GPU-abc" and clocks.gpu_id(None, 2) == "2"


def test_clock_sampler_reads_a_running_command_and_tolerates_a_missing_one():
    script = "print('1830, 650.5'); print('[N/A], [N/A]'); print('1850, 640.5')"
    sampler = clocks.Sampler("0", command=[sys.executable, "-c", script])
    sampler._reader.join(timeout=30)  # the command ends by itself; its lines are all read
    assert sampler.reading(0.0, float("inf")) == {"sm_mhz": 1840.0, "power_w": 645.5}
    sampler.close()
    missing = clocks.Sampler("0", command=["/nonexistent/nvidia-smi"])
    assert missing.reading(0.0, float("inf")) == {}
    missing.close()


def test_rounds_flag():
    parser = cli.build_parser()
    assert cli.settings_for(parser.parse_args(["--rounds", "3"])).rounds == 3
    assert cli.settings_for(parser.parse_args([])).fields()["rounds"] == 1
    with pytest.raises(SystemExit):
        parser.parse_args(["--rounds", "0"])
