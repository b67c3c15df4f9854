"""The sweep's bookkeeping on a CPU, through a stand-in device (nothing is timed): failures, a lost device,
a shape's backward passes taking turns together, clocks per turn. Equal turns and the correctness gate are in
test_bench_fair.py."""

import os

import pytest

from bench_helpers import StandInDevice, table_after, tiny_point
from fmha_rt.bench import cli, flops, peers, report, sweep, timing


class BrokenAdapter(peers.Adapter):
    def forward(self, case):
        raise RuntimeError("no kernel for this shape")

    def backward(self, case, deterministic):
        return self.forward(case)


class FailsWhenCalled(peers.Adapter):
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


class NamedCalls(peers.Adapter):
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


def test_a_shapes_backward_passes_take_turns_together(monkeypatch):
    """bwd and bwd_det of one shape share their rounds (the deterministic backward is not timed alone, back to
    back); the forward and other shapes keep their own; --separate-det-turns restores a group per point."""
    fwd, bwd, det = (tiny_point(p) for p in ("fwd", "bwd", "bwd_det"))
    other = tiny_point("bwd", causal=True)
    pairs = [(fwd, "a"), (fwd, "b"), (bwd, "a"), (bwd, "b"), (det, "a"), (other, "a")]
    assert sweep.turn_groups(pairs) == [pairs[:2], pairs[2:5], pairs[5:]]
    assert sweep.turn_groups(pairs, backward_together=False) == [pairs[:2], pairs[2:4], pairs[4:5], pairs[5:]]

    settings = cli.settings_for(cli.build_parser().parse_args(["--rounds", "2", "--separate-det-turns"]))
    assert settings.backward_turns_together is False and cli.settings_for(
        cli.build_parser().parse_args([])).backward_turns_together is True


def test_rows_carry_the_clock_each_turn_ran_at(monkeypatch):
    """sm_mhz / power_w: medians over an implementation's turns; round_sm_mhz with several turns (None for
    a turn without a sample); no fields where nothing was sampled (NVML absent)."""
    monkeypatch.setattr(sweep, "check_pair", lambda *args: ({"passed": True}, 1.0))
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


def test_rounds_flag():
    parser = cli.build_parser()
    assert cli.settings_for(parser.parse_args(["--rounds", "3"])).rounds == 3
    assert cli.settings_for(parser.parse_args([])).fields()["rounds"] == 1
    with pytest.raises(SystemExit):
        parser.parse_args(["--rounds", "0"])
