"""A run's record on disk (JSON) and the views made from it: the Markdown report (here) and the PNG plots
(plots.py).

The writers read nothing but the JSON document: `python -m fmha_rt bench --report results.json`
regenerates the Markdown and the plots of any recorded run, on any machine, without a GPU or torch.

Document (format "fmha_rt-bench/1"):
  header         date (UTC), GPU, SM count, clocks, driver, CUDA, versions, implementations found or
                 not found (with the reason), settings; a synthetic test fixture says "fixture": true
  rows           one per (point, implementation): impl, kind, pass, dtype, B, Hq, Hk, Sq, Sk, D, causal
                 (+ seqlens for varlen), flops, then either ms, ms_min, ms_max, repeats, tflops,
                 first_call_ms, peak_extra_bytes, copies (+ workspace_bytes, family, kernel for fmha_rt;
                 + round_ms, each round's median, when the row was timed in several rounds; + settle_error
                 where a --settle round failed after the planned ones; + sm_mhz, power_w and, with several
                 rounds, round_sm_mhz where nvidia-smi sampled the clock) or error
  host_overhead  one per (impl, kind, pass) at the tiny overhead shape (dense, and varlen where the impl has
                 it): us_per_call (repeated calls), first_call_us (the first, plan cache cleared),
                 uncached_us_per_call (impls with a plan cache: cleared before every call), or error
  cold_start     one per impl: seconds from process start to the first forward's result, or error
"""

import json
import os
import statistics

from . import flops, grid, peers, versus

FORMAT = "fmha_rt-bench/1"
SUBJECT = peers.SUBJECT
POINT_KEYS = ("kind", "pass", "dtype", "B", "Hq", "Hk", "Sq", "Sk", "D", "causal")
MIB = 1024**2


def new_document(header):
    return {"format": FORMAT, "header": header, "rows": [], "host_overhead": [], "cold_start": []}


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
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        found = doc.get("format") if isinstance(doc, dict) else type(doc).__name__
        raise ValueError(f"{path} is not a benchmark record of this tool (format {found!r}, expected {FORMAT!r})")
    return doc


def merge(docs):
    """One document from several runs (e.g. a sweep split over several machines or days): the first run's
    header, every row, and a later run's row replacing an earlier one at the same (point, impl). An
    implementation found in any run counts as found (a peer installed for a later run only)."""
    merged = new_document(dict(docs[0]["header"]))
    if len(docs) > 1:
        merged["header"]["merged_from"] = [doc["header"].get("date") for doc in docs]
        impls = dict(merged["header"].get("impls", {}))
        for doc in docs[1:]:
            for name, info in doc["header"].get("impls", {}).items():
                if info.get("status") == "found" or name not in impls:
                    impls[name] = info
        merged["header"]["impls"] = impls
    sections = {"rows": lambda r: (point_key(r), r["impl"]),
                "host_overhead": lambda r: (r["impl"], r.get("kind", "dense"), r["pass"]),
                "cold_start": lambda r: r["impl"]}
    for section, key in sections.items():
        by_key = {}
        for doc in docs:
            by_key.update((key(row), row) for row in doc.get(section, []))
        merged[section] = list(by_key.values())
    return merged


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


def ratio_to_best_peer(by_impl):
    """fmha_rt's TFLOP/s over the best other implementation's at one point, or None."""
    subject = by_impl.get(SUBJECT, {}).get("tflops")
    peer_values = [row["tflops"] for impl, row in by_impl.items() if impl != SUBJECT and row.get("tflops")]
    if not subject or not peer_values:
        return None
    return subject / max(peer_values)


# ---- Markdown -------------------------------------------------------------------------------------

def markdown(doc, plot_names=()):
    header, rows = doc["header"], doc["rows"]
    lines = ["# fmha_rt attention benchmark", ""]
    if header.get("fixture"):
        lines += [f"> **Synthetic test fixture, not a measurement.** {header.get('note', '')}".rstrip(), ""]
    lines += _machine_section(header) + _impls_section(header) + _convention_section(header)
    for (pass_name, dtype), group in groups(rows):
        lines += [f"## {pass_name}, {dtype}: TFLOP/s", ""] + _tflops_table(group) + [""]
    lines += _versus_section(rows, header.get("settings", {}), bool(header.get("merged_from")))
    if plot_names:
        lines += ["## Plots", ""] + [f"![{name}]({name})" for name in plot_names] + [""]
    lines += _clock_section(rows) + _memory_section(rows) + _first_call_section(rows)
    lines += _overhead_section(doc.get("host_overhead", [])) + _cold_start_section(doc.get("cold_start", []))
    lines += _errors_section(rows)
    return "\n".join(lines).rstrip() + "\n"


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
    if h.get("merged_from"):
        body.append(("merged runs", ", ".join(str(d) for d in h["merged_from"])))
    return ["## Machine", ""] + _table(["", ""], body) + [""]


def _impls_section(h):
    impls = h.get("impls", {})
    body = [(name, impls[name].get("status"), impls[name].get("version") or impls[name].get("reason"),
             impls[name].get("description")) for name in impl_order(impls)]
    return ["## Implementations", ""] + _table(["impl", "status", "version or reason", "what"], body) + [""]


def _convention_section(h):
    s = h.get("settings", {})
    return [
        "TFLOP/s = FLOPs / median time. FLOPs: fwd = 4·B·Hq·Sq·Sk·D, halved when causal; bwd and bwd_det"
        " = 2.5 × fwd. Every dense point has B·S = 16k tokens and Hq·D = 2048.",
        f"Median of {_timing_text(s)}; inputs rotate over copies spanning at least four L2 caches. A backward"
        " is timed alone: fmha_rt's mha_bwd on a saved forward; the torch-based implementations'"
        " torch.autograd.grad on a saved graph. `–`: not run (the implementation lacks that mode);"
        " `error`: see Errors.",
        ""]


def _timing_text(settings):
    """'N calls timed ... after a warm-up of W ms', with the rounds where there were several."""
    rounds, repeats, warmup = settings.get("rounds", 1), settings.get("repeats"), settings.get("warmup_ms")
    if rounds == 1 and not settings.get("settle"):
        return f"{repeats} calls timed by CUDA events after a warm-up of at least {warmup} ms"
    return (f"{rounds} x {repeats} calls timed by CUDA events after a warm-up of at least {warmup} ms before each of"
            f" {rounds} rounds, in which the implementations of a point take turns in an order rotated every round"
            + (" (a shape's backward and deterministic backward take theirs together)"
               if settings.get("backward_turns_together") else "")
            + (f"; points where {SUBJECT} and {settings['settle']} were within {settings['settle_within'] * 100:g}%"
               f" after them took {settings['settle_rounds']} rounds in all" if settings.get("settle") else "") +
            " (each row's round_ms: the rounds' medians; [a-b] after a figure: its slowest and fastest round)")


def _tflops_table(group):
    impls = impl_order({row["impl"] for row in group})
    headings = ["kind", "B", "Hq/Hk", "S", "D", "causal"] + impls + [f"{SUBJECT} family", f"{SUBJECT} / best peer"]
    body = []
    for by_impl in points(group).values():
        first = next(iter(by_impl.values()))
        cells = [_tflops_cell(by_impl.get(impl)) for impl in impls]
        ratio = ratio_to_best_peer(by_impl)
        body.append(_point_cells(first) + cells + [by_impl.get(SUBJECT, {}).get("family"),
                                                   None if ratio is None else f"{ratio:.2f}×"])
    return _table(headings, body)


def peer_summaries(rows, settings):
    """versus.summaries of a record's rows against every peer in them, in the tables' order."""
    peers_found = [impl for impl in impl_order({r["impl"] for r in rows}) if impl != SUBJECT]
    return versus.summaries(rows, peers_found, settings.get("backward_turns_together", False))


def _versus_section(rows, settings, merged):
    """fmha_rt over each peer: a line per (peer, pass, dtype), then each peer's points folded away. Rounds
    ahead only for one run's record (a merged one pairs rows of different runs)."""
    found = peer_summaries(rows, settings)
    if not found:
        return []
    rounds = not merged and any(c.rounds_ahead for s in found for c in s.items)
    failed = any(s.failed for s in found)
    body = []
    for s in found:
        against = {"all": f" (against {s.peer}'s bwd)", "some": f" (some against {s.peer}'s bwd)", "": ""}[s.stand_in]
        lowest = s.lowest
        body.append((s.peer, s.pass_name + against, s.dtype, len(s.items), s.at_or_above,
                     None if lowest is None else f"{lowest.ratio:.3f} ({_shape_text(lowest.ours)})",
                     _ratio_text(s.median_ratio), _ratio_text(s.highest_ratio))
                    + ((len(s.failed),) if failed else ()) + ((_rounds_ahead_text(s.items),) if rounds else ()))
    lines = [f"## {SUBJECT} against each peer", "",
             f"{SUBJECT}'s TFLOP/s over the peer's at each point both timed. A peer without a deterministic backward"
             " is held against the deterministic backward with its only backward."]
    if failed:
        lines[-1] += (f" {SUBJECT} failed: points the peer has a figure for and {SUBJECT} has none (see Errors);"
                      " they are not among the points compared.")
    if rounds:
        lines[-1] += (f" Rounds ahead: the rounds, summed over the points, in which {SUBJECT}'s median time was at"
                      " most the peer's (both took a turn in every round).")
    lines += [""] + _table(["peer", "pass", "dtype", "points", "at or above", "lowest (at)", "median", "highest"]
                           + ([f"{SUBJECT} failed"] if failed else []) + (["rounds ahead"] if rounds else []),
                           body) + [""]
    for peer in dict.fromkeys(s.peer for s in found):
        passes = [s for s in found if s.peer == peer]
        by_shape = {}
        for s in passes:
            for c in s.items:
                by_shape.setdefault(versus.shape_key(c.ours), {})[s.pass_name] = c
        columns = list(dict.fromkeys(s.pass_name for s in passes if s.items))
        ordered = points([next(iter(cells.values())).ours for cells in by_shape.values()])
        body = [_point_cells(first) + [first["dtype"]]
                + [_ratio_cell(by_shape[versus.shape_key(first)].get(p), rounds) for p in columns]
                for first in (next(iter(by_impl.values())) for by_impl in ordered.values())]
        lines += [f"<details><summary>{SUBJECT} / {peer}, point by point</summary>", ""]
        lines += _table(["kind", "B", "Hq/Hk", "S", "D", "causal", "dtype", *columns], body) + ["", "</details>", ""]
    return lines


def _ratio_text(ratio):
    return None if ratio is None else f"{ratio:.3f}"


def _ratio_cell(comparison, rounds):
    if comparison is None:
        return None
    ahead = _rounds_ahead_text([comparison]) if rounds else None
    return f"{comparison.ratio:.3f}" + (f" ({ahead})" if ahead else "")


def _rounds_ahead_text(comparisons):
    counted = [c.rounds_ahead for c in comparisons if c.rounds_ahead is not None]
    if not counted:
        return None
    return f"{sum(a for a, _ in counted)}/{sum(n for _, n in counted)}"


def _shape_text(row):
    return f"{row['kind']} D={row['D']} S={row['Sq']}{' causal' if row['causal'] else ''}"


def _point_cells(row):
    seqlen = f"≤{row['Sq']} (varlen)" if row.get("seqlens") else row["Sq"]
    return [row["kind"], row["B"], f"{row['Hq']}/{row['Hk']}", seqlen, row["D"], "yes" if row["causal"] else "no"]


def _tflops_cell(row):
    if row is None:
        return None
    if "error" in row:
        return "error"
    return f"{row['tflops']:.1f}{round_range_text(row)}"


def round_range_text(row):
    """' [slowest-fastest]': the TFLOP/s of the row's slowest and fastest round medians, where it was timed
    in several rounds (a point whose implementations' ranges overlap is not settled by its medians)."""
    return _spread_text([flops.tflops(row["flops"], ms) for ms in row.get("round_ms", ())])


def _spread_text(values):
    """' [lowest-highest]' of several values, '' of fewer than two."""
    return f" [{min(values):.0f}-{max(values):.0f}]" if len(values) > 1 else ""


def _clock_section(rows):
    """Each row's SM clock and board power while it was timed, where they were sampled."""
    if not any("sm_mhz" in row for row in rows):
        return []
    return _folded_tables(rows, "SM clock and power while timed", _clock_cell,
                          "Medians of nvidia-smi's samples over each implementation's turns (warm-up and timed "
                          "calls), MHz / W; with several rounds, the slowest and fastest turn's clock in brackets.")


def _clock_cell(row):
    if row is None or "sm_mhz" not in row:
        return None
    turns = [mhz for mhz in row.get("round_sm_mhz", ()) if mhz is not None]
    return f"{row['sm_mhz']:.0f}{_spread_text(turns)} / {row['power_w']:.0f}"


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


# (column heading, row kind, pass) of the host-overhead table; varlen columns only when measured.
_OVERHEAD_COLUMNS = (("fwd", "dense", "fwd"), ("bwd", "dense", "bwd"), ("varlen fwd", "varlen", "fwd"),
                     ("varlen bwd", "varlen", "bwd"))
# (row label suffix, field) of each line an implementation gets, where it measured that field.
_OVERHEAD_LINES = (("", "us_per_call"), (", plan cache cleared", "uncached_us_per_call"),
                   (", first call", "first_call_us"))


def _overhead_section(overhead):
    if not overhead:
        return []
    by_impl = {}
    for row in overhead:
        by_impl.setdefault(row["impl"], {})[(row.get("kind", "dense"), row["pass"])] = row
    columns = [c for c in _OVERHEAD_COLUMNS if c[1] == "dense" or any((c[1], c[2]) in rows for rows in by_impl.values())]
    body = []
    for impl in impl_order(by_impl):
        rows = by_impl[impl]
        for suffix, field in _OVERHEAD_LINES:
            if field == "us_per_call" or any(field in r for r in rows.values()):
                body.append((impl + suffix, *(_overhead_cell(rows.get((kind, p)), field) for _, kind, p in columns)))
    shape = grid.OVERHEAD_SHAPE
    return [f"## Host overhead, µs per call (B={shape['batch']} H={shape['heads']} S={shape['seqlen']}"
            f" D={shape['head_dim']}, bf16; varlen: sequences of {', '.join(map(str, grid.OVERHEAD_VARLEN_SEQLENS))})",
            "", "Wall clock over many back-to-back calls of a problem too small to keep the GPU busy. \"plan cache "
            "cleared\": the cache is emptied before every call, so each call validates and plans as a call of a "
            "new signature does; \"first call\": one call's host time, plan cache cleared before it.", ""] + \
        _table(["impl", *(c[0] for c in columns)], body) + [""]


def _overhead_cell(row, field="us_per_call"):
    if row is None:
        return None
    if "error" in row:
        return "error"
    return f"{row[field]:.1f}" if field in row else None


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


def write_reports(doc, out_dir, stem="results"):
    """Markdown and PNGs for `doc` in `out_dir`; returns the paths written."""
    from . import plots  # matplotlib, only where reports are written

    os.makedirs(out_dir, exist_ok=True)
    names = plots.write_plots(doc, out_dir, stem)
    md_path = os.path.join(out_dir, f"{stem}.md")
    with open(md_path, "w") as f:
        f.write(markdown(doc, names))
    return [md_path] + [os.path.join(out_dir, name) for name in names]
