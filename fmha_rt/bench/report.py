"""A run's record on disk (JSON) and the views made from it: the Markdown report (here) and the PNG plots
(plots.py).

The writers read nothing but the JSON document: `python -m fmha_rt bench --report results.json`
regenerates the Markdown and the plots of any recorded run, on any machine, without a GPU or torch.

Document (format "fmha_rt-bench/2"; records of format 1, before the correctness gate, still load):
  header         run_id (unique per run), date (UTC), GPU, SM count, clocks, driver, CUDA, versions,
                 implementations found or not found (with the reason and deterministic mode), settings;
                 a synthetic test fixture says "fixture": true; a merged record lists its "runs"
  rows           one per (point, implementation): impl, kind, pass, dtype, B, Hq, Hk, Sq, Sk, D, causal
                 (+ seqlens for varlen), then
                 - "skipped": why the implementation does not run the point (no deterministic mode, ...), or
                 - flops, copies, first_call_ms, check (the correctness gate: per tensor rel_err and
                   row_err, the limits, passed, reason where it failed) and, where it passed, ms, ms_min,
                   ms_max, repeats, tflops, rounds, round_ms (each round's median), peak_extra_bytes
                   (+ workspace_bytes, family, kernel for fmha_rt; + sm_mhz, round_sm_mhz and power_w where
                   NVML sampled the turns), or
                 - error
                 A merged record's rows carry "run", the run_id of the record they came from.
  host_overhead  one per (impl, path) at the tiny overhead shape: us_per_call (median over rounds),
                 round_us, or error
  cold_start     one per impl: seconds from process start to the first forward's result, or error
"""

import json
import os
import statistics
import uuid

from . import flops, grid, peers, versus

FORMAT = "fmha_rt-bench/2"
READABLE_FORMATS = ("fmha_rt-bench/1", FORMAT)
SUBJECT = peers.SUBJECT
POINT_KEYS = ("kind", "pass", "dtype", "B", "Hq", "Hk", "Sq", "Sk", "D", "causal")
MIB = 1024**2


def new_document(header):
    return {"format": FORMAT, "header": {"run_id": uuid.uuid4().hex[:12], **header}, "rows": [],
            "host_overhead": [], "cold_start": []}


def dumps(doc):
    """JSON with one result row a line, so a committed record diffs point by point."""
    entries = []
    for key, value in doc.items():
        if isinstance(value, list) and value:
            text = "[\n" + ",\n".join("  " + json.dumps(item) for item in value) + "\n ]"
        else:
            text = json.dumps(value, indent=1).replace("\n", "\n ")
        entries.append(f" {json.dumps(key)}: {text}")
    return "{\n" + ",\n".join(entries) + "\n}\n"


def save(doc, path):
    """Write atomically, so an interrupted sweep never leaves half a file behind."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    partial = f"{path}.partial"
    with open(partial, "w") as f:
        f.write(dumps(doc))
    os.replace(partial, path)


def load(path):
    with open(path) as f:
        doc = json.load(f)
    if not isinstance(doc, dict) or doc.get("format") not in READABLE_FORMATS:
        found = doc.get("format") if isinstance(doc, dict) else type(doc).__name__
        raise ValueError(f"{path} is not a benchmark record of this tool (format {found!r}, expected {FORMAT!r})")
    return doc


class MergeRefused(ValueError):
    """Records that cannot be merged without pairing figures of different runs."""


# Settings that may differ between records merged into one report: what was swept, not how it was measured.
SWEPT_SETTINGS = ("command", "device")


def run_id(doc, index=0):
    """A record's run id (records from before run ids: their date and position)."""
    header = doc["header"]
    return header.get("run_id") or f"{header.get('date')}#{index}"


def merge(docs):
    """One document from several runs of the same settings (a grid split over two commands, say): the first
    run's header with the list of runs, and every row tagged with its run, so that every ratio is still
    formed within one run (versus.pair_key). Refused (MergeRefused) where the runs were measured differently
    (settings other than SWEPT_SETTINGS, GPU) or where two runs measured the same point: a report would then
    hold figures of one point from two runs side by side."""
    if len(docs) == 1:
        return docs[0]
    ids = [run_id(doc, i) for i, doc in enumerate(docs)]
    first = docs[0]["header"]
    for doc in docs[1:]:
        for key in ("gpu", "settings"):
            mine, theirs = _comparable_header(first, key), _comparable_header(doc["header"], key)
            if mine != theirs:
                raise MergeRefused(f"records measured with different {key}: {mine} against {theirs}; "
                                   "report them one by one")
    merged = new_document(dict(first))
    merged["header"].update(run_id=None, runs=[{"run_id": i, "date": d["header"].get("date"),
                                                "command": (d["header"].get("settings") or {}).get("command")}
                                               for i, d in zip(ids, docs)])
    impls = dict(first.get("impls", {}))
    for doc in docs[1:]:
        for name, info in doc["header"].get("impls", {}).items():
            if info.get("status") == "found" or name not in impls:
                impls[name] = info
    merged["header"]["impls"] = impls
    owner = {}
    for index, doc in zip(ids, docs):
        for row in doc["rows"]:
            key = point_key(row)
            if owner.setdefault(key, index) != index:
                raise MergeRefused(f"runs {owner[key]} and {index} both measured {point_text(row)}; "
                                   "merge records of disjoint points only")
            merged["rows"].append({**row, "run": index})
        merged["host_overhead"] += [{**row, "run": index} for row in doc.get("host_overhead", [])]
        merged["cold_start"] += [{**row, "run": index} for row in doc.get("cold_start", [])]
    return merged


def _comparable_header(header, key):
    value = header.get(key)
    if key == "settings" and isinstance(value, dict):
        return {k: v for k, v in value.items() if k not in SWEPT_SETTINGS}
    return value


def point_key(row):
    return tuple(row.get(key) for key in POINT_KEYS) + (tuple(row.get("seqlens") or ()),)


def impl_order(names):
    """Implementations in the table's order (fmha_rt first), unknown names last, alphabetically."""
    known = [name for name in peers.PEER_NAMES if name in names]
    return known + sorted(set(names) - set(known))


def groups(rows):
    """Rows by (pass, dtype), in the grid's order."""
    found = {}
    for row in rows:
        found.setdefault((row["pass"], row["dtype"]), []).append(row)
    order = [(p, d) for p in grid.PASSES for d in grid.DTYPES]
    return [(key, found[key]) for key in order if key in found] + \
           [(key, found[key]) for key in sorted(found) if key not in order]


def _point_sort_key(row):
    kind = grid.KINDS.index(row["kind"]) if row["kind"] in grid.KINDS else len(grid.KINDS)
    return (kind, row["D"], row["Hq"] // max(row["Hk"], 1), row["Sq"], row["causal"])


def points(rows):
    """{point key: {impl: row}} in display order."""
    table = {}
    for row in sorted(rows, key=_point_sort_key):
        table.setdefault(point_key(row), {})[row["impl"]] = row
    return table


# ---- Markdown -------------------------------------------------------------------------------------

def markdown(doc, plot_names=()):
    header, rows = doc["header"], doc["rows"]
    lines = ["# fmha_rt attention benchmark", ""]
    if header.get("fixture"):
        lines += [f"> **Synthetic test fixture, not a measurement.** {header.get('note', '')}".rstrip(), ""]
    lines += _headline_section(rows) + _failed_check_section(rows)
    lines += _machine_section(header) + _impls_section(header) + _convention_section(header)
    for (pass_name, dtype), group in groups(rows):
        lines += [f"## {pass_name}, {dtype}: TFLOP/s", ""] + _tflops_table(group) + [""]
    lines += _versus_section(rows)
    if plot_names:
        lines += ["## Plots", ""] + [f"![{name}]({name})" for name in plot_names] + [""]
    lines += _clock_section(rows) + _memory_section(rows) + _first_call_section(rows)
    lines += _overhead_section(doc.get("host_overhead", [])) + _cold_start_section(doc.get("cold_start", []))
    lines += _errors_section(rows)
    return "\n".join(lines).rstrip() + "\n"


def _headline_section(rows):
    """The first table: fmha_rt over the best peer at each point (the fastest peer that passed the check
    there), the median of per-round ratios with its spread and verdict."""
    found = versus.best_peer_comparisons(rows)
    if not found:
        return []
    counts = []
    for s in versus.summarize(found, "best peer"):
        tally = ", ".join(f"{s.count(v)} {v}" for v in versus.VERDICTS)
        counts.append(f"- {s.pass_name} {s.dtype}: {len(s.items)} points: {tally}")
    body = [[c.ours["pass"], c.ours["dtype"]] + _point_cells(c.ours) + [c.peer, f"{c.ours['ms']:.3f}",
            f"{c.theirs['ms']:.3f}", c.text()] for c in sorted(found, key=_headline_order)]
    return [f"## {SUBJECT} over the best peer at each point", "",
            f"Speed of {SUBJECT} over the fastest peer that passed the correctness check at that point, in the"
            " same run: the median over rounds of each round's ratio (peer ms / fmha_rt ms; above 1: fmha_rt is"
            " faster), [lowest-highest round], and the verdict: parity where the middle half of the rounds' ratios"
            " (first to third quartile) straddles 1 or the median is within the round-to-round noise of 1"
            " (interquartile).", ""] + counts + [""] + \
        _table(["pass", "dtype", "kind", "B", "Hq/Hk", "S", "D", "causal", "best peer", f"{SUBJECT} ms",
                "peer ms", f"{SUBJECT} / best peer"], body) + [""]


def _headline_order(comparison):
    row = comparison.ours
    pass_index = grid.PASSES.index(row["pass"]) if row["pass"] in grid.PASSES else len(grid.PASSES)
    return (pass_index, row["dtype"]) + _point_sort_key(row)


def _failed_check_section(rows):
    """Implementations whose output disagreed with the fp32 reference: not timed there, in no ratio."""
    failed = [row for row in rows if not (row.get("check") or {}).get("passed", True)]
    if not failed:
        return []
    body = [(row["impl"], point_text(row), row["check"].get("reason"), _errors_text(row["check"]))
            for row in failed]
    return ["## Failed the correctness check", "",
            "**These implementations gave wrong results at these points: they were not timed there and are in"
            " no ratio.**", ""] + _table(["impl", "point", "why", "errors (rel / worst row)"], body) + [""]


def _errors_text(check):
    return ", ".join(f"{name} {e['rel_err']:.2g} / {e['row_err']:.2g}" for name, e in check.get("tensors", {}).items())


def _table(headings, body):
    lines = ["| " + " | ".join(headings) + " |", "|" + "|".join("---" for _ in headings) + "|"]
    lines += ["| " + " | ".join(_cell(value) for value in row) + " |" for row in body]
    return lines


def _cell(value):
    if value is None:
        return "–"
    return str(value).replace("|", "\\|").replace("\n", " ")


def _machine_section(h):
    clocks = h.get("clocks_mhz") or {}
    clock_text = None
    if clocks.get("sm") is not None:
        clock_text = f"SM {clocks['sm']} MHz (max {clocks.get('max_sm')}), memory {clocks.get('mem')} MHz"
    l2 = f", L2 {h['l2_bytes'] / MIB:.0f} MiB" if h.get("l2_bytes") else ""
    commit = f" ({h['fmha_rt_commit']})" if h.get("fmha_rt_commit") else ""
    if h.get("fmha_rt_sources_sha256"):
        commit += f", sources sha256 {h['fmha_rt_sources_sha256'][:16]}"

    def text(*keys):
        return " / ".join(_cell(h.get(key)) for key in keys)

    body = [("date (UTC)", h.get("date")),
            ("GPU", f"{text('gpu')}, {text('sm_count')} SMs{l2}"),
            ("clocks at start", clock_text),
            ("driver / CUDA", text("driver", "cuda")),
            ("python / torch / triton", text("python", "torch", "triton")),
            ("fmha_rt", text("fmha_rt") + commit)]
    if h.get("runs"):
        body.append(("merged runs", ", ".join(f"{r['run_id']} ({r.get('date')})" for r in h["runs"])))
    return ["## Machine", ""] + _table(["", ""], body) + [""]


def _impls_section(h):
    impls = h.get("impls", {})
    body = [(name, impls[name].get("status"), impls[name].get("version") or impls[name].get("reason"),
             impls[name].get("description"), impls[name].get("deterministic_mode") or "none")
            for name in impl_order(impls)]
    return ["## Implementations", ""] + _table(["impl", "status", "version or reason", "what",
                                                "deterministic mode (bwd_det)"], body) + [""]


def _convention_section(h):
    s = h.get("settings", {})
    from . import correctness  # the limits are constants of the gate; no torch is imported for them

    return [
        "TFLOP/s = FLOPs / median time. FLOPs: fwd = 4·B·Hq·Sq·Sk·D, halved when causal; bwd and bwd_det"
        " = 2.5 × fwd. Every dense point has B·S = 16k tokens and Hq·D = 2048.",
        f"Median of {_timing_text(s)}; inputs rotate over copies spanning at least four L2 caches. A backward"
        " is timed alone: fmha_rt's mha_bwd on a saved forward; the torch-based implementations'"
        " torch.autograd.grad on a saved graph.",
        f"Correctness gate, before any timing: each implementation's first call at a point is compared with an"
        f" fp32 reference on the same inputs (out; dq, dk, dv): ||err||/||ref|| <= {correctness.REL_ERR_LIMIT:g}"
        f" and every row within {correctness.ROW_ERR_LIMIT:g}; a bwd_det row must also repeat bit for bit.",
        "Cells: `–` not run (`no det. mode`: the implementation has no deterministic backward), `failed"
        " check` (see above), `error` (see Errors); `[a-b]` after a figure: its slowest and fastest round.",
        ""]


def _timing_text(settings):
    """'N calls timed ... in R rounds ...'."""
    rounds, repeats, warmup = settings.get("rounds", 1), settings.get("repeats"), settings.get("warmup_ms")
    return (f"{repeats} calls a turn timed by CUDA events after a warm-up of at least {warmup} ms, in {rounds} rounds"
            " (rounded up at each point to a multiple of its implementations, so that each takes the first turn"
            " of a round equally often; round r starts with implementation r mod n), after an untimed warm turn"
            " of every implementation"
            + ("; a shape's backward and deterministic backward take their turns together"
               if settings.get("backward_turns_together") else ""))


def _tflops_table(group):
    impls = impl_order({row["impl"] for row in group})
    headings = ["kind", "B", "Hq/Hk", "S", "D", "causal"] + impls + [f"{SUBJECT} family", f"{SUBJECT} / best peer"]
    body = []
    for by_impl in points(group).values():
        first = next(iter(by_impl.values()))
        cells = [_tflops_cell(by_impl.get(impl)) for impl in impls]
        ours = by_impl.get(SUBJECT)
        theirs = versus.best_peer(group, ours) if ours is not None and versus.timed(ours) else None
        ratio = None if theirs is None else f"{versus.Comparison(ours, theirs).text()} ({theirs['impl']})"
        body.append(_point_cells(first) + cells + [(ours or {}).get("family"), ratio])
    return _table(headings, body)


def peer_summaries(rows):
    """versus.summaries of a record's rows against every peer in them, in the tables' order."""
    peers_found = [impl for impl in impl_order({r["impl"] for r in rows}) if impl != SUBJECT]
    return versus.summaries(rows, peers_found)


def _versus_section(rows):
    """fmha_rt over each peer: a line per (peer, pass, dtype), then each peer's points folded away."""
    found = peer_summaries(rows)
    if not found:
        return []
    body = []
    for s in found:
        lowest = s.lowest
        body.append((s.peer, s.pass_name, s.dtype, len(s.items), *(s.count(v) for v in versus.VERDICTS),
                     None if lowest is None else f"{lowest.ratio:.3f} ({_shape_text(lowest.ours)})",
                     _ratio_text(s.median_ratio), _ratio_text(s.highest_ratio)))
    lines = [f"## {SUBJECT} against each peer", "",
             f"Per point, the median over rounds of each round's speed ratio {SUBJECT} / peer, within one run;"
             " only rows that passed the correctness check. A peer without a deterministic mode has no bwd_det"
             " comparison.", ""]
    lines += _table(["peer", "pass", "dtype", "points", *versus.VERDICTS, "lowest (at)", "median", "highest"],
                    body) + [""]
    for peer in dict.fromkeys(s.peer for s in found):
        passes = [s for s in found if s.peer == peer]
        by_shape = {}
        for s in passes:
            for c in s.items:
                by_shape.setdefault((c.ours.get("run"),) + versus.shape_key(c.ours), {})[s.pass_name] = c
        columns = list(dict.fromkeys(s.pass_name for s in passes))
        body = []
        for cells in by_shape.values():
            first = next(iter(cells.values())).ours
            body.append(_point_cells(first) + [first["dtype"]] +
                        [cells[p].text() if p in cells else None for p in columns])
        lines += [f"<details><summary>{SUBJECT} / {peer}, point by point</summary>", ""]
        lines += _table(["kind", "B", "Hq/Hk", "S", "D", "causal", "dtype", *columns], body) + ["", "</details>", ""]
    return lines


def _ratio_text(ratio):
    return None if ratio is None else f"{ratio:.3f}"


def _shape_text(row):
    return f"{row['kind']} D={row['D']} S={row['Sq']}{' causal' if row['causal'] else ''}"


def _point_cells(row):
    seqlen = f"≤{row['Sq']} (varlen)" if row.get("seqlens") else row["Sq"]
    return [row["kind"], row["B"], f"{row['Hq']}/{row['Hk']}", seqlen, row["D"], "yes" if row["causal"] else "no"]


SKIPPED_CELLS = {"no deterministic mode": "no det. mode", "no varlen interface": "no varlen"}


def _tflops_cell(row):
    if row is None:
        return None
    if "skipped" in row:
        return SKIPPED_CELLS.get(row["skipped"], row["skipped"])
    if "error" in row:
        return "error"
    if not versus.timed(row):
        return "failed check"
    return f"{row['tflops']:.1f}{round_range_text(row)}"


def round_range_text(row):
    """' [slowest-fastest]': the TFLOP/s of the row's slowest and fastest round medians, where it was timed
    in several rounds (a point whose implementations' ranges overlap is not settled by its medians)."""
    return _spread_text([flops.tflops(row["flops"], ms) for ms in row.get("round_ms", ())])


def _spread_text(values, form=".0f"):
    """' [lowest-highest]' of several values, '' of fewer than two."""
    return f" [{min(values):{form}}-{max(values):{form}}]" if len(values) > 1 else ""


def _clock_section(rows):
    """Each row's SM clock and board power while it was timed, where they were sampled."""
    if not any("sm_mhz" in row for row in rows):
        return []
    return _folded_tables(rows, "SM clock and power while timed", _clock_cell,
                          "NVML sampled every 5 ms; medians of the samples taken during each implementation's own turns"
                          " (warm-up and timed calls; a turn without a sample of its own has no reading), MHz / W"
                          " (instantaneous power, where the driver gives it); with several rounds, the slowest and"
                          " fastest turn's clock in brackets.")


def _clock_cell(row):
    if row is None or "sm_mhz" not in row:
        return None
    turns = [mhz for mhz in row.get("round_sm_mhz", ()) if mhz is not None]
    power = f"{row['power_w']:.0f}" if row.get("power_w") is not None else "–"
    return f"{row['sm_mhz']:.0f}{_spread_text(turns)} / {power}"


def _memory_section(rows):
    return _folded_tables(rows, "Device memory per call", _memory_cell,
                          "Peak extra device memory of one call in MiB (torch allocator, measured around the call);"
                          f" for {SUBJECT}'s backward, `ws` is the workspace its API reports.")


def _folded_tables(rows, title, cell, intro):
    """A section of one folded table per (pass, dtype): a row per point, cell(row) per implementation."""
    lines = [f"## {title}", "", intro, ""]
    for (pass_name, dtype), group in groups(rows):
        impls = impl_order({row["impl"] for row in group})
        body = [_point_cells(next(iter(by_impl.values()))) + [cell(by_impl.get(i)) for i in impls]
                for by_impl in points(group).values()]
        lines += ["<details><summary>" + f"{pass_name}, {dtype}" + "</summary>", ""]
        lines += _table(["kind", "B", "Hq/Hk", "S", "D", "causal"] + impls, body) + ["", "</details>", ""]
    return lines


def _memory_cell(row):
    if row is None or "peak_extra_bytes" not in row:
        return None
    text = f"{row['peak_extra_bytes'] / MIB:.0f}"
    if row.get("workspace_bytes") is not None:
        text += f" (ws {row['workspace_bytes'] / MIB:.1f})"
    return text


def _first_call_section(rows):
    """The first call at a new shape against the steady state: for implementations that compile per
    shape (FlexAttention, FlashAttention-4) the difference is their per-new-shape compile time."""
    timed = [row for row in rows if "first_call_ms" in row and "ms" in row]
    keyed = {}
    for row in timed:
        keyed.setdefault((row["impl"], row["pass"]), []).append(row)
    body = []
    for impl in impl_order({impl for impl, _ in keyed}):
        for pass_name in grid.PASSES:
            sample = keyed.get((impl, pass_name))
            if sample:
                extra = [r["first_call_ms"] - r["ms"] for r in sample]
                body.append((impl, pass_name, len(sample), f"{statistics.median(extra):.1f}",
                             f"{max(extra):.1f}", f"{statistics.median(r['ms'] for r in sample):.3f}"))
    if not body:
        return []
    return ["## First call at a new shape", "",
            "First call minus the steady median, in ms (compile time for implementations that JIT per shape).", ""] + \
        _table(["impl", "pass", "points", "median extra ms", "max extra ms", "median steady ms"], body) + [""]


def _overhead_section(overhead):
    overhead = [row for row in overhead if "path" in row]  # records from before the user-path measurement: none
    if not overhead:
        return []
    from . import overhead as paths

    paths_order = list(paths.USER_PATHS) + list(paths.RAW_PATHS)
    impls = impl_order({row["impl"] for row in overhead})
    rows = sorted(overhead, key=lambda r: (paths_order.index(r["path"]) if r.get("path") in paths_order
                                           else len(paths_order), impls.index(r["impl"])))
    body = [(row["impl"], row.get("path"), _overhead_cell(row)) for row in rows]
    shape = grid.OVERHEAD_SHAPE
    return [f"## Host overhead, µs per call (B={shape['batch']} H={shape['heads']} S={shape['seqlen']}"
            f" D={shape['head_dim']}, bf16, causal)", "",
            "Wall clock over many back-to-back calls of a problem too small to keep the GPU busy, each"
            " implementation called as its users call it, outputs allocated every call: `fwd` the forward"
            f" ({SUBJECT}: fmha_rt.torch.flash_attn_func; SDPA on [B, H, S, D] tensors; FA4: flash_attn_func),"
            " `fwd+bwd` the forward then torch.autograd.grad of its output. The `raw ..., outputs given` rows are"
            f" {SUBJECT}'s own API with preallocated outputs (mha_fwd / mha_bwd): a different path, not comparable"
            " with the others. Median over rounds, taken in turns; [lowest-highest round].", ""] + \
        _table(["impl", "path", "µs per call"], body) + [""]


def _overhead_cell(row):
    if "error" in row:
        return "error"
    return f"{row['us_per_call']:.1f}{_spread_text(row.get('round_us', ()), '.1f')}"


def _cold_start_section(cold):
    if not cold:
        return []
    shape = grid.COLD_START_SHAPE
    by_impl = {row["impl"]: row for row in cold}
    body = [(impl, None if "error" in row else f"{row['seconds']:.2f}",
             None if "error" in row else f"{row['harness_import_s']:.2f}", row.get("error"))
            for impl, row in ((i, by_impl[i]) for i in impl_order(by_impl))]
    return [f"## Cold start (fresh process, one forward B={shape['batch']} H={shape['heads']}"
            f" S={shape['seqlen']} D={shape['head_dim']}, bf16)", "",
            "Seconds from spawning `python -c` to the first result on the host; the harness's own import"
            " is part of it and shown apart.", ""] + \
        _table(["impl", "seconds", "of which harness import", "error"], body) + [""]


def _errors_section(rows):
    failed = [row for row in rows if "error" in row]
    if not failed:
        return []
    body = [(row["impl"], point_text(row), row["error"][:300]) for row in failed]
    return ["## Errors", ""] + _table(["impl", "point", "error"], body) + [""]


def point_text(row):
    """One point in words: kind, pass, dtype, batch, heads, length, head dim, mask."""
    causal = " causal" if row["causal"] else ""
    return (f"{row['kind']} {row['pass']} {row['dtype']} B={row['B']} H={row['Hq']}/{row['Hk']}"
            f" S={row['Sq']} D={row['D']}{causal}")


PLOTS_HINT = "plots skipped: matplotlib is not installed (pip install matplotlib, or the bench extra: pip install 'fmha_rt[bench]')"


def write_reports(doc, out_dir, stem="results", say=print):
    """Markdown and PNGs for `doc` in `out_dir`; returns the paths written. Without matplotlib the Markdown
    is still written and `say` gets one line on how to get the plots."""
    os.makedirs(out_dir, exist_ok=True)
    try:
        from . import plots  # matplotlib, only where reports are written
    except ImportError:
        plots, names = None, []
        say(PLOTS_HINT)
    if plots is not None:
        names = plots.write_plots(doc, out_dir, stem)
    md_path = os.path.join(out_dir, f"{stem}.md")
    with open(md_path, "w") as f:
        f.write(markdown(doc, names))
    return [md_path] + [os.path.join(out_dir, name) for name in names]
