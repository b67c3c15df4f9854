"""fmha_rt against one peer, point by point (fmha_rt.bench.versus), and the report section made of it."""

import random

import pytest

from fmha_rt.bench import flops, plots, report, versus

SHAPE = {"kind": "dense", "dtype": "bf16", "B": 1, "Hq": 16, "Hk": 16, "Sq": 16384, "Sk": 16384, "D": 128}


def row(impl, pass_name, tflops, causal=False, round_ms=None, **shape):
    point = dict(SHAPE, **shape)
    fl = flops.pass_flops(pass_name, point["B"], point["Hq"], point["Sq"], point["Sk"], point["D"], causal)
    made = {"impl": impl, "pass": pass_name, "causal": causal, **point, "flops": fl, "tflops": tflops,
            "ms": fl / tflops / 1e9}
    if round_ms:
        made["round_ms"] = round_ms
    return made


@pytest.fixture
def rows():
    rng = random.Random()
    fast, slow = rng.uniform(300, 500), rng.uniform(300, 500)
    return [
        row("fmha_rt", "fwd", 1.1 * fast), row("flex", "fwd", fast), row("sdpa_cudnn", "fwd", 1.25 * fast),
        row("fmha_rt", "bwd", 0.95 * slow, round_ms=[1.0, 1.2, 0.9]), row("flex", "bwd", slow, round_ms=[1.1, 1.1, 1.1]),
        row("fmha_rt", "bwd_det", 1.02 * slow, round_ms=[1.0, 1.0, 1.0]),
        # A shape only fmha_rt ran, and one where the peer failed: nothing to compare.
        row("fmha_rt", "fwd", fast, causal=True),
        row("fmha_rt", "bwd", fast, Sq=4096, Sk=4096, B=4),
        {k: v for k, v in row("flex", "bwd", fast, Sq=4096, Sk=4096, B=4).items() if k != "tflops"} | {"error": "x"},
    ]


def test_each_pass_against_the_same_pass_or_the_peers_only_backward(rows):
    found = {c.pass_name: c for c in versus.comparisons(rows, "flex")}
    assert sorted(found) == ["bwd", "bwd_det", "fwd"]
    assert found["fwd"].ratio == pytest.approx(1.1) and not found["fwd"].stand_in
    assert found["bwd"].ratio == pytest.approx(0.95) and found["bwd"].theirs["pass"] == "bwd"
    assert found["bwd_det"].ratio == pytest.approx(1.02) and found["bwd_det"].stand_in
    assert found["bwd_det"].theirs["pass"] == "bwd" and found["bwd_det"].ours["pass"] == "bwd_det"
    assert [c.pass_name for c in versus.comparisons(rows, "sdpa_cudnn")] == ["fwd"]
    assert versus.comparisons(rows, "fa4") == []
    # A peer whose deterministic backward failed is not compared through its backward instead.
    failed = rows + [row("sdpa_cudnn", "bwd", 500.0), {**row("sdpa_cudnn", "bwd_det", 1.0), "error": "x"}]
    del failed[-1]["tflops"]
    assert [c.pass_name for c in versus.comparisons(failed, "sdpa_cudnn")] == ["fwd", "bwd"]


def test_rounds_ahead_pairs_rounds_only_where_both_took_turns_in_them(rows):
    found = {c.pass_name: c for c in versus.comparisons(rows, "flex")}
    # 1.0 <= 1.1 and 0.9 <= 1.1 ahead; 1.2 > 1.1 behind.
    assert found["bwd"].rounds_ahead == (2, 3)
    assert found["fwd"].rounds_ahead is None  # a single round each
    # The stand-in ran in rounds of its own unless the run timed a shape's backward passes together.
    assert found["bwd_det"].rounds_ahead is None
    together = {c.pass_name: c for c in versus.comparisons(rows, "flex", backward_turns_together=True)}
    assert together["bwd_det"].rounds_ahead == (3, 3)


def test_summaries_count_points_at_or_above_and_name_the_lowest():
    ratios = [random.uniform(0.9, 1.3) for _ in range(6)] + [1.0]
    rows = []
    for i, ratio in enumerate(ratios):
        shape = {"B": 1 + i}
        rows += [row("fmha_rt", "bwd", 400 * ratio, **shape), row("flex", "bwd", 400, **shape)]
    (summary,) = versus.summaries(rows, ["flex", "fa4"])
    assert (summary.peer, summary.pass_name, summary.dtype) == ("flex", "bwd", "bf16")
    assert summary.at_or_above == sum(r >= 1 for r in ratios) and len(summary.items) == 7
    assert summary.lowest.ratio == pytest.approx(min(ratios))
    assert summary.lowest.ours["B"] == 1 + ratios.index(min(ratios))
    assert summary.median_ratio == pytest.approx(sorted(ratios)[3])
    assert summary.highest_ratio == pytest.approx(max(ratios)) and not summary.stand_in


def section(text):
    start = text.index("## fmha_rt against each peer")
    end = text.find("\n## ", start + 1)
    return text[start:end if end > 0 else None]


def test_report_section(rows):
    doc = {"header": {"settings": {"rounds": 3}}, "rows": rows}
    text = section(report.markdown(doc))
    lines = [line for line in text.splitlines() if line.startswith("| flex") or line.startswith("| sdpa_cudnn")]
    assert lines == [
        "| sdpa_cudnn | fwd | bf16 | 1 | 0 | 0.880 (dense D=128 S=16384) | 0.880 | 0.880 | – |",
        "| flex | fwd | bf16 | 1 | 1 | 1.100 (dense D=128 S=16384) | 1.100 | 1.100 | – |",
        "| flex | bwd | bf16 | 1 | 0 | 0.950 (dense D=128 S=16384) | 0.950 | 0.950 | 2/3 |",
        "| flex | bwd_det (against flex's bwd) | bf16 | 1 | 1 | 1.020 (dense D=128 S=16384) | 1.020 | 1.020 | – |",
    ]
    assert "Rounds ahead" in text
    assert "<summary>fmha_rt / flex, point by point</summary>" in text
    assert "| dense | 1 | 16/16 | 16384 | 128 | no | bf16 | 1.100 | 0.950 (2/3) | 1.020 |" in text
    doc["header"]["settings"]["backward_turns_together"] = True
    assert "| 1.020 (dense D=128 S=16384) | 1.020 | 1.020 | 3/3 |" in section(report.markdown(doc))


def test_no_section_without_a_peer_or_rounds_column_without_rounds(rows):
    alone = [r for r in rows if r["impl"] == "fmha_rt"]
    assert "against each peer" not in report.markdown({"header": {}, "rows": alone})
    single = [{k: v for k, v in r.items() if k != "round_ms"} for r in rows]
    text = section(report.markdown({"header": {}, "rows": single}))
    assert "rounds ahead" not in text and "Rounds ahead" not in text
    assert "| flex | bwd | bf16 | 1 | 0 | 0.950 (dense D=128 S=16384) | 0.950 | 0.950 |" in text


def test_plot_labels_name_the_point():
    assert plots._short_point(row("fmha_rt", "bwd", 1.0, causal=True)) == "D128 16k causal"
    assert plots._short_point(row("fmha_rt", "bwd", 1.0, Hk=2, Sq=4096, Sk=4096)) == "GQA 16/2 D128 4k"
    assert plots._short_point(row("fmha_rt", "fwd", 1.0, Sq=512, Sk=512, D=64)) == "D64 512"
    assert plots._short_point(dict(row("fmha_rt", "fwd", 1.0, D=64), seqlens=[3, 5])) == "varlen D64"


def test_failures_stand_ins_and_merged_records_in_the_section(rows):
    """fmha_rt's failed rows where the peer has a figure are counted apart; a summary mixing stand-in and
    real comparisons says "some"; a merged record shows no rounds ahead (its rows come from other runs)."""
    failed = {**row("fmha_rt", "bwd", 1.0, Sq=1024, Sk=1024, B=16), "error": "RuntimeError: x"}
    del failed["tflops"]
    mixed = rows + [failed, row("flex", "bwd", 300.0, Sq=1024, Sk=1024, B=16),
                    row("fmha_rt", "bwd_det", 330.0, causal=True), row("flex", "bwd_det", 300.0, causal=True),
                    row("flex", "bwd", 200.0, causal=True)]
    by_pass = {s.pass_name: s for s in versus.summaries(mixed, ["flex"])}
    assert [r["Sq"] for r in by_pass["bwd"].failed] == [1024] and len(by_pass["bwd"].items) == 1
    assert by_pass["bwd_det"].stand_in == "some" and len(by_pass["bwd_det"].items) == 2
    text = section(report.markdown({"header": {"settings": {"rounds": 3}}, "rows": mixed}))
    assert "fmha_rt failed" in text and "| flex | bwd | bf16 | 1 | 0 | 0.950 (dense D=128 S=16384) | 0.950 | 0.950 | 1 |" in text
    assert "| flex | bwd_det (some against flex's bwd) | bf16 | 2 |" in text
    merged = section(report.markdown({"header": {"settings": {"rounds": 3}, "merged_from": ["a", "b"]}, "rows": rows}))
    assert "rounds ahead" not in merged.lower() and "(2/3)" not in merged
    only_failed = versus.summaries([failed, row("flex", "bwd", 300.0, Sq=1024, Sk=1024, B=16)], ["flex"])
    assert [(s.items, len(s.failed), s.lowest, s.median_ratio) for s in only_failed] == [((), 1, None, None)]
    assert "| flex | bwd | bf16 | 0 | 0 | – | – | – | 1 |" in section(report.markdown(
        {"header": {}, "rows": [failed, row("flex", "bwd", 300.0, Sq=1024, Sk=1024, B=16)]}))


def test_settle_threshold_is_printed_as_given():
    text = report._timing_text({"rounds": 2, "repeats": 1, "warmup_ms": 0, "settle": "flex", "settle_within": 0.025,
                                "settle_rounds": 8})
    assert "within 2.5% after them took 8 rounds in all" in text
