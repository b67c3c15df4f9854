"""fmha_rt against one peer, point by point (fmha_rt.bench.versus), and the report section made of it. The
ratio rules themselves (per-round medians, parity, best peer, runs) are in test_bench_fair.py."""

import random

import pytest

from fmha_rt.bench import flops, plots, report, versus

SHAPE = {"kind": "dense", "dtype": "bf16", "B": 1, "Hq": 16, "Hk": 16, "Sq": 16384, "Sk": 16384, "D": 128}


def row(impl, pass_name, round_ms, causal=False, **shape):
    point = dict(SHAPE, **shape)
    fl = flops.pass_flops(pass_name, point["B"], point["Hq"], point["Sq"], point["Sk"], point["D"], causal)
    ms = sorted(round_ms)[len(round_ms) // 2]
    return {"impl": impl, "pass": pass_name, "causal": causal, **point, "flops": fl, "ms": ms,
            "tflops": flops.tflops(fl, ms), "round_ms": list(round_ms), "check": {"passed": True}}


def test_a_peer_is_compared_on_its_own_pass_only():
    seed = random.randrange(2**31)
    print(f"seed {seed}")
    rng = random.Random(seed)
    base = rng.uniform(1.0, 5.0)
    rows = [row("fmha_rt", "fwd", [base] * 3), row("flex", "fwd", [base * 1.2] * 3),
            row("fmha_rt", "bwd", [base] * 3), row("flex", "bwd", [base * 0.8] * 3),
            row("fmha_rt", "bwd_det", [base] * 3),
            {**row("flex", "bwd_det", [base] * 3), "skipped": "no deterministic mode"}]
    del rows[-1]["ms"]
    found = {c.pass_name: c for c in versus.comparisons(rows, "flex")}
    assert sorted(found) == ["bwd", "fwd"]
    assert found["fwd"].ratio == pytest.approx(1.2) and found["fwd"].verdict == "faster"
    assert found["bwd"].ratio == pytest.approx(0.8) and found["bwd"].verdict == "slower"
    (summary,) = [s for s in versus.summaries(rows, ["flex"]) if s.pass_name == "fwd"]
    assert (summary.count("faster"), summary.count("parity"), summary.count("slower")) == (1, 0, 0)


def test_report_section_counts_verdicts_and_folds_points_away():
    rows = [row("fmha_rt", "fwd", [1.0, 1.0, 1.0]), row("flex", "fwd", [1.1, 1.1, 1.1]),
            row("fmha_rt", "fwd", [1.0, 1.0, 1.0], causal=True), row("flex", "fwd", [0.99, 1.02, 1.0], causal=True)]
    text = report.markdown({"header": {"settings": {"rounds": 3}}, "rows": rows})
    section = text[text.index("## fmha_rt against each peer"):]
    assert "| flex | fwd | bf16 | 2 | 1 | 1 | 0 | 1.000 (dense D=128 S=16384 causal) | 1.050 | 1.100 |" in section
    assert "<summary>fmha_rt / flex, point by point</summary>" in section
    assert "| dense | 1 | 16/16 | 16384 | 128 | no | bf16 | 1.100 [1.100-1.100] faster |" in section
    alone = [r for r in rows if r["impl"] == "fmha_rt"]
    assert "against each peer" not in report.markdown({"header": {}, "rows": alone})


def test_plot_labels_name_the_point():
    assert plots.short_point(row("fmha_rt", "bwd", [1.0], causal=True)) == "D128 16k causal"
    assert plots.short_point(row("fmha_rt", "bwd", [1.0], Hk=2, Sq=4096, Sk=4096)) == "GQA 16/2 D128 4k"
    assert plots.short_point(row("fmha_rt", "fwd", [1.0], Sq=512, Sk=512, D=64)) == "D64 512"
    assert plots.short_point(dict(row("fmha_rt", "fwd", [1.0], D=64), seqlens=[3, 5])) == "varlen D64"
