"""`python -m fmha_rt bench` on the GPU, end to end: a tiny sweep in two rounds writes a record whose
row has its timings, its rounds and, where nvidia-smi is present, the SM clock and power it ran at."""
import json
import os
import shutil
import subprocess
import sys


def test_bench_records_timings_rounds_and_the_clock_they_ran_at(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "fmha_rt", "bench", "--dtype", "fp16", "--hdim", "64", "--seqlen", "1k",
         "--causal", "0", "--pass", "fwd", "--gqa", "0", "--varlen", "0", "--impl", "fmha_rt", "--no-extras",
         "--repeats", "3", "--rounds", "2", "--out", str(out)],
        capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    (row,) = [r for r in json.loads((out / "results.json").read_text())["rows"] if r["impl"] == "fmha_rt"]
    assert row["tflops"] > 0 and len(row["round_ms"]) == 2 and all(ms > 0 for ms in row["round_ms"])
    markdown = (out / "results.md").read_text()
    if shutil.which("nvidia-smi"):
        assert 100 < row["sm_mhz"] < 5000 and 0 < row["power_w"] < 2000, row
        assert len(row["round_sm_mhz"]) == 2 and all(m is None or m > 100 for m in row["round_sm_mhz"])
        assert "## SM clock and power while timed" in markdown
    else:
        assert "sm_mhz" not in row and "SM clock" not in markdown


def test_bench_backward_rounds_gate_and_the_comparison_with_a_peer(tmp_path):
    """The backward and deterministic backward share their rounds (2 asked, rounded up to 2 implementations),
    every row passed the correctness gate, and the report compares fmha_rt with the peer, bwd_det included
    (torch's deterministic mode)."""
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "fmha_rt", "bench", "--dtype", "fp16", "--hdim", "64", "--seqlen", "1k",
         "--causal", "0", "--pass", "bwd", "bwd_det", "--gqa", "0", "--varlen", "0", "--impl", "fmha_rt",
         "sdpa_flash", "--no-extras", "--repeats", "3", "--rounds", "2", "--out", str(out)],
        capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    record = json.loads((out / "results.json").read_text())
    assert record["header"]["settings"]["backward_turns_together"] is True
    rows = {(r["impl"], r["pass"]): r for r in record["rows"]}
    assert set(rows) == {("fmha_rt", "bwd"), ("sdpa_flash", "bwd"), ("fmha_rt", "bwd_det"), ("sdpa_flash", "bwd_det")}
    for row in rows.values():
        assert row["check"]["passed"], row
        assert row["tflops"] > 0 and len(row["round_ms"]) == 2, row
    markdown = (out / "results.md").read_text()
    assert markdown.startswith("# fmha_rt attention benchmark\n\n## fmha_rt over the best peer at each point")
    assert "## fmha_rt against each peer" in markdown
    assert (out / "results_versus.png").stat().st_size > 10_000
